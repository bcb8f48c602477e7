"""``python -m models.cli``: the ``hydragen`` command."""

import sys

from models.cli import main

sys.exit(main())
