"""The ``hydragen`` command line (see :mod:`models.cli.app`)."""

from models.cli.app import UsageError, build_parser, main  # noqa: F401
