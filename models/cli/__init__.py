"""The ``hydragen`` command line: :data:`~models.cli.app.COMMANDS` (the command table) and
:func:`main`; ``generate`` is the ``hydragen generate`` command."""

from models.cli.app import COMMANDS, build_parser, main  # noqa: F401
from models.errors import UsageError  # noqa: F401


def __getattr__(name):
  """``models.cli.default_model_path`` (its home before ``models.checkpoints``), for one
  release."""
  if name == "default_model_path":
    import warnings
    from models.checkpoints.default_model import default_model_path
    warnings.warn("models.cli.default_model_path moved to models.default_model_path; the old "
                  "name goes in the next release", DeprecationWarning, stacklevel=2)
    return default_model_path
  raise AttributeError(f"module 'models.cli' has no attribute {name!r}")
