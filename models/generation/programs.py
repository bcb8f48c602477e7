"""Traced programs kept on disk, so that a warm start neither traces nor lowers them.

    >>> store = ProgramStore("~/.cache/hydragen/programs")
    >>> state = prefill(model, prompt, num_samples=8, max_new_tokens=32, programs=store)
    >>> state = decode(model, state, programs=store)
    >>> store.loaded, store.exported                   # (2, 0) on the second run

A jitted function's program is exported once (:func:`jax.export.export`: traced and lowered to
StableHLO) and serialized to ``<dir>/<name>-<key>.jaxexport``. A later process deserializes it
and calls it through ``jax.jit`` (a call of one primitive: nothing of the model is traced);
XLA's persistent compilation cache (``jax_compilation_cache_dir``) then skips compiling it.

The key is a SHA-256 of everything that decides the program: the name, the static arguments'
``repr`` (frozen dataclasses: the model config, the sampling parameters), the inputs' pytree
structure, shapes and dtypes, the source of the project's packages (``models``,
``jax_shared_attn``, ``pallas_kernels``: a code change is a new program), the jax and jaxlib
versions, the platform and device kind, every ``jax.config`` value but the cache settings, and
``XLA_FLAGS``. Any difference is another file; nothing stale is ever called.

Reading a compiled program back is not free on a CPU (SmolLM2-135M's decode program: ~0.6 s
to deserialize its executable, while the prefill before it runs for ~0.7 s). The store
remembers which program followed which in a process (``<dir>/next.json``: a program's key ->
the next program's key and donated inputs) and, when it loads a program from disk, reads the
program that followed it last time in a background thread, while the first one runs (counted
in ``preloaded``). The next call finds it ready; a call that does not come, or a preload that
fails, costs nothing but the thread's work. One step only: a program that was read ahead
starts no read of its own (the decode loop would share the cores with it).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
from typing import Any, Callable, Optional, Sequence

import jax

PACKAGES = ("models", "jax_shared_attn", "pallas_kernels")
SUFFIX = ".jaxexport"
NEXT_INDEX = "next.json"


@functools.lru_cache(maxsize=None)
def code_fingerprint(packages: tuple[str, ...] = PACKAGES) -> str:
  """SHA-256 of every ``.py`` file of ``packages`` (as imported: their paths and contents)."""
  import importlib
  digest = hashlib.sha256()
  for name in packages:
    root = os.path.dirname(importlib.import_module(name).__file__)
    for folder, dirs, files in sorted(os.walk(root)):
      dirs.sort()
      for f in sorted(files):
        if f.endswith(".py"):
          path = os.path.join(folder, f)
          digest.update(os.path.relpath(path, root).encode() + b"\0")
          with open(path, "rb") as fh:
            digest.update(fh.read() + b"\0")
  return digest.hexdigest()


def environment() -> str:
  """What besides the code and the arguments decides a traced program (part of every key)."""
  import jaxlib
  device = jax.devices()[0]
  flags = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
  return repr((jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
               flags, os.environ.get("XLA_FLAGS", "")))


class ProgramStore:
  """Exported programs in ``path`` (created if missing), and what this process did with them.

  Attributes:
    loaded: programs read from disk (no tracing).
    exported: programs traced and lowered here (and written, if ``path`` is writable).
    unstorable: programs run without the store: they call custom kernels (Pallas, Mosaic),
      which ``jax.export`` refuses to serialize.
    preloaded: of ``loaded``, those read and compiled in the background while the program
      before them ran.
  """

  def __init__(self, path: str):
    if not path:
      raise ValueError("ProgramStore: path must be a directory name; got an empty string")
    self.path = os.path.expanduser(path)
    os.makedirs(self.path, exist_ok=True)
    self.loaded = self.exported = self.unstorable = self.preloaded = 0
    self._calls: dict[tuple, Callable] = {}
    self._previous: Optional[str] = None  # the key of the last program this store set up
    self._pending: dict[str, concurrent.futures.Future] = {}
    self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

  def key(self, name: str, static: Any, args: Sequence[Any]) -> str:
    leaves, tree = jax.tree.flatten(args)
    avals = [(tuple(x.shape), str(x.dtype), getattr(x, "weak_type", False)) for x in leaves]
    text = repr((name, static, str(tree), avals, code_fingerprint(), environment()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]

  def call(self, name: str, fn: Callable, static_args: tuple, args: Sequence[Any], *,
           static: dict, out_like: Callable[..., Any], donate: Sequence[int] = ()):
    """``fn(*static_args, *args, **static)`` through the stored program (exported on the first call).

    Args:
      name: the program's name (the start of its file name).
      fn: a ``jax.jit`` function; ``static_args`` (its leading positional arguments) and
        ``static`` are its static arguments: values whose ``repr`` says all that matters
        about them (an NNX GraphDef, frozen dataclasses, ints, strings, None).
      args: the traced arguments (pytrees of arrays).
      out_like: ``out_like(*args)``, a pytree with the structure of ``fn``'s result.
      donate: the indices of ``args`` donated (updated in place).
    """
    # In memory, by the values themselves (hashing is ~10x cheaper than the file key's repr).
    leaves, tree = jax.tree.flatten(args)
    avals = tuple((tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
                  for x in leaves)
    memo = (name, static_args, tuple(sorted(static.items())), tree, avals, environment())
    call = self._calls.get(memo)
    if call is None:
      key = f"{name}-{self.key(name, (static_args, sorted(static.items())), args)}"
      call = self._calls[memo] = self._load_or_export(key, functools.partial(fn, *static_args),
                                                      args, static, out_like, donate)
    return call(*args)

  def _load_or_export(self, key, fn, args, static, out_like, donate):
    tree = jax.tree.structure(args)
    out_tree = jax.tree.structure(out_like(*args))
    counts = [len(jax.tree.leaves(a)) for a in args]
    starts = [sum(counts[:i]) for i in range(len(args))]
    donated = tuple(j for i in donate for j in range(starts[i], starts[i] + counts[i]))
    pending = self._pending.pop(key, None)
    if pending is not None:
      try:
        run = pending.result()
      except Exception:  # noqa: BLE001 -- the preload failed: load it here instead
        run = None
      if run is not None:
        self.loaded += 1
        self.preloaded += 1
        # No read-ahead from here: it would share the cores with this program (the decode
        # loop), not with a prefill.
        self._follows(key, donated)
        return lambda *a: jax.tree.unflatten(out_tree, run(*jax.tree.leaves(a)))
    file = os.path.join(self.path, key + SUFFIX)
    exported = None
    if os.path.exists(file):
      try:
        exported = _read(file)
        self.loaded += 1
      except Exception:  # noqa: BLE001 -- a damaged or foreign file: export afresh
        exported = None
    if exported is not None:
      self._preload_next(key)
    else:
      def flat(*leaves):
        return jax.tree.leaves(fn(*jax.tree.unflatten(tree, leaves), **static))
      specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(args)]
      try:
        exported = jax.export.export(jax.jit(flat))(*specs)
      except ValueError as e:
        if "custom calls" not in str(e):
          raise
        self.unstorable += 1
        return lambda *a: fn(*a, **static)
      self.exported += 1
      tmp = f"{file}.{os.getpid()}.tmp"
      try:  # written whole, then renamed: a reader never sees half a file
        with open(tmp, "wb") as f:
          f.write(exported.serialize())
        os.replace(tmp, file)
      except OSError:
        pass
    self._follows(key, donated)
    # Compiled for the exported avals, as a preload compiles it: one persistent-cache entry.
    run = _compile(exported, donated)

    def call(*a):
      return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(a)))
    return call

  # -- what follows what ---------------------------------------------------------------------

  def _index(self) -> dict:
    try:
      with open(os.path.join(self.path, NEXT_INDEX)) as f:
        index = json.load(f)
      return index if isinstance(index, dict) else {}
    except (OSError, ValueError):
      return {}

  def _follows(self, key: str, donated: tuple[int, ...]) -> None:
    """Notes that the stored program ``key`` is set up now, after the one before it."""
    if self._previous is not None and self._previous != key:
      self._note_next(self._previous, key, donated)
    self._previous = key

  def _note_next(self, previous: str, key: str, donated: tuple[int, ...]) -> None:
    """Records that ``key`` (donating ``donated``) followed ``previous`` (best effort)."""
    entry = {"key": key, "donated": list(donated)}
    index = self._index()
    if index.get(previous) == entry:
      return
    index[previous] = entry
    file = os.path.join(self.path, NEXT_INDEX)
    tmp = f"{file}.{os.getpid()}.tmp"
    try:
      with open(tmp, "w") as f:
        json.dump(index, f)
      os.replace(tmp, file)
    except OSError:
      pass

  def _preload_next(self, key: str) -> None:
    """Starts reading and compiling the program that followed ``key`` last time, if stored."""
    entry = self._index().get(key)
    following = entry.get("key") if isinstance(entry, dict) else None
    if not isinstance(following, str) or following in self._pending:
      return
    file = os.path.join(self.path, f"{following}{SUFFIX}")
    try:
      donated = tuple(int(i) for i in entry.get("donated", ()))
    except (TypeError, ValueError):  # a damaged entry: read nothing ahead
      return
    if not os.path.exists(file):
      return
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="programs")
    self._pending[following] = self._pool.submit(_compile_stored, file, donated)

  def summary(self) -> str:
    """E.g. ``"2 programs loaded (1 read ahead), none traced"`` or ``"1 loaded, 1 traced"``."""
    ahead = f" ({self.preloaded} read ahead)" if self.preloaded else ""
    if not self.exported:
      text = f"{self.loaded} program{'s' * (self.loaded != 1)} loaded{ahead}, none traced"
    else:
      text = f"{self.loaded} loaded{ahead}, {self.exported} traced"
    return text + (f", {self.unstorable} not storable (custom kernels)" if self.unstorable else "")


def store_or_none(path: Optional[str]) -> Optional[ProgramStore]:
  """A store in ``path``, or None where it is None/empty or cannot be created."""
  if not path:
    return None
  try:
    return ProgramStore(path)
  except OSError:
    return None


def _read(file: str) -> "jax.export.Exported":
  with open(file, "rb") as f:
    return jax.export.deserialize(bytearray(f.read()))


def _compile(exported: "jax.export.Exported", donated: tuple[int, ...]):
  """``exported`` compiled (or read from XLA's persistent cache) for its own input avals."""
  return jax.jit(exported.call, donate_argnums=donated).lower(*exported.in_avals).compile()


def _compile_stored(file: str, donated: tuple[int, ...]):
  """The stored program in ``file``, compiled."""
  return _compile(_read(file), donated)
