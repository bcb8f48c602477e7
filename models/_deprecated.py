"""Old module paths (before the subpackages) as aliases of the new ones, for one release.

``import models.llama`` returns the module :mod:`models.model.llama` itself (the same object)
and emits a :class:`DeprecationWarning` naming the new path. One import hook, installed when
``models`` is imported, answers every name of :data:`MOVED`; other names are left to the
ordinary finders.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_BENCH = ("compare", "decode", "sampler", "sharded", "sharded_parts", "train", "tree")

# old module path -> new module path
MOVED = {
    "models.config": "models.model.config",
    "models.rope": "models.model.rope",
    "models.llama": "models.model.llama",
    "models.loading": "models.checkpoints.loading",
    "models.tokenizer": "models.checkpoints.tokenizer",
    "models.cache": "models.generation.cache",
    "models.prompt_tree": "models.generation.prompt_tree",
    "models.sharing": "models.generation.sharing",
    "models.generate": "models.generation.loop",
    "models.sampling": "models.generation.sampling",
    "models.programs": "models.generation.programs",
    "models.sharding": "models.parallel.sharding",
    "models.distributed": "models.parallel.distributed",
    "models.hlo_collectives": "models.parallel.hlo_collectives",
    "models.grpo": "models.training.grpo",
    "models.logprobs": "models.training.logprobs",
    "models.train_grpo": "models.training.addition",
    **{f"models.bench_{name}": f"models.bench.{name}" for name in _BENCH},
    **{f"jax_shared_attn.bench.{name}": f"models.bench.{name}"
       for name in ("attention", "backward", "profile", "timing")},
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds the names of :data:`MOVED`; loading one imports its new module and binds it."""

  def find_spec(self, name, path=None, target=None):
    if name not in MOVED:
      return None
    return importlib.util.spec_from_loader(name, self)

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    old = module.__spec__.name
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release",
                  DeprecationWarning, stacklevel=2)
    # The import system returns sys.modules[old] after this call: the new module itself.
    sys.modules[old] = importlib.import_module(new)


def install() -> None:
  """Puts the alias finder first on ``sys.meta_path`` (once)."""
  if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
