"""The module paths before the subpackages still import, for one release: each is the new
module itself and warns (DeprecationWarning) naming where it went."""

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from models import _deprecated

ROOT = Path(__file__).resolve().parent


@pytest.mark.parametrize("old", sorted(_deprecated.MOVED))
def test_an_old_path_is_the_new_module_and_warns(old):
  new = _deprecated.MOVED[old]
  sys.modules.pop(old, None)
  with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
    module = importlib.import_module(old)
  assert module is importlib.import_module(new)


def test_from_imports_of_old_paths_and_the_generate_function():
  import models
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from models.llama import Llama
    from models.sharding import make_mesh
    import models.generate  # noqa: F401
  assert Llama is models.Llama and make_mesh is models.make_mesh
  assert callable(models.generate) and models.generate.__name__ == "generate"


def test_new_paths_do_not_warn():
  code = ("import warnings; warnings.simplefilter('error', DeprecationWarning); import models, "
          "models.cli, models.bench.decode, models.generation.loop, models.parallel.sharding, "
          "models.training.step; print(models.generate.__module__)")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True,
                       text=True, env={"PYTHONPATH": str(ROOT.parent), "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0 and out.stdout.strip() == "models.generation.loop", out.stderr


def test_python_m_of_the_old_benchmark_package():
  out = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m",
                        "jax_shared_attn.bench"], cwd=ROOT.parent, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT.parent), "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 2 and "python -m models.bench" in out.stderr, out.stderr
  assert "jax_shared_attn.bench moved to models.bench" in out.stderr


def test_default_model_path_is_public_and_its_old_name_warns():
  import models
  import models.cli
  from models.checkpoints.default_model import default_model_path
  assert models.default_model_path is default_model_path
  with pytest.warns(DeprecationWarning, match="models.default_model_path"):
    assert models.cli.default_model_path is default_model_path
  with pytest.raises(AttributeError, match="no_such_name"):
    models.cli.no_such_name  # noqa: B018
