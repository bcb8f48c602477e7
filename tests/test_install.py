"""A non-editable wheel install works from outside the repository (the CLI and the packages)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
  """Builds the wheel (no build isolation: offline), installs it alone into a folder, then,
  from a folder outside the repository with only that folder added to the path: the
  ``hydragen`` script's help, and an attention call through the installed packages (which must
  be the wheel's, not the checkout's or an editable install's)."""
  wheels, site, away = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
  away.mkdir()
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
  leftovers = [p for p in ("build", "hydragen_jax.egg-info")
               if not os.path.exists(os.path.join(ROOT, p))]
  try:
    subprocess.run(pip + ["wheel", ROOT, "--no-deps", "--no-build-isolation", "-w", str(wheels)],
                   check=True, cwd=tmp_path, capture_output=True, timeout=300)
  finally:  # setuptools builds inside the checkout: leave it as it was
    for p in leftovers:
      shutil.rmtree(os.path.join(ROOT, p), ignore_errors=True)
  (wheel,) = wheels.glob("*.whl")
  subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                 cwd=tmp_path, capture_output=True, timeout=300)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = str(site)
  done = subprocess.run([sys.executable, str(site / "bin" / "hydragen"), "--help"], cwd=away,
                        env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "generate" in done.stdout
  code = """
import numpy as np, jax.numpy as jnp
import jax_shared_attn, models, pallas_kernels
from jax_shared_attn import shared_prefix_attention
for m in (jax_shared_attn, models, pallas_kernels):
  assert m.__file__.startswith(SITE), m.__file__
q = jnp.ones((2, 1, 4, 64)); pk = jnp.ones((8, 2, 64)); sk = jnp.ones((2, 3, 2, 64))
out = shared_prefix_attention(q, pk, pk, sk, sk, impl="xla")
assert out.shape == (2, 1, 4, 64) and np.allclose(out, 1.0)
print("ok")
""".replace("SITE", repr(str(site)))
  done = subprocess.run([sys.executable, "-c", code], cwd=away, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
