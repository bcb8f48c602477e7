"""The ``hydragen`` command line: :data:`~models.cli.app.COMMANDS` (the command table) and
:func:`main`; ``generate`` is the ``hydragen generate`` command."""

from models.cli.app import COMMANDS, build_parser, main  # noqa: F401
from models.errors import UsageError  # noqa: F401
