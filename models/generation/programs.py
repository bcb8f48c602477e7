"""Traced programs kept on disk, so that a warm start neither traces nor lowers them.

    >>> store = ProgramStore("~/.cache/hydragen/programs")
    >>> store.begin("generate SmolLM2 'Name a fruit.' x2")   # optional: read ahead (below)
    >>> state = prefill(model, prompt, num_samples=8, max_new_tokens=32, programs=store)
    >>> state = decode(model, state, programs=store)
    >>> store.loaded, store.exported                   # (2, 0) on the second run

A jitted function's program is exported once (:func:`jax.export.export`: traced and lowered to
StableHLO) and serialized to ``<dir>/<name>-<key>.jaxexport``. Compiled, its executable is
written next to it (``<dir>/<name>-<key>-<host>.xla``, :mod:`jax.experimental.serialize_executable`;
``<host>``: :func:`host_fingerprint`, the processor it was compiled for). A later process loads
the executable and calls it: nothing is traced, lowered or compiled, and nothing but the
executable is read (no StableHLO module to lower again for XLA's persistent cache, no import of
the CPU's LAPACK bindings that lowering an exported program starts with). Where the executable is
missing or cannot be loaded, the exported program is compiled through ``jax.jit`` (XLA's
persistent compilation cache, ``jax_compilation_cache_dir``, may skip compiling it). An executable
is written only where XLA compiled the program here: one taken from XLA's persistent cache does
not serialize again (the copy lacks its compiled functions). Each program is compiled under a
name of its own (its key) for that reason: a computation that XLA's cache holds from another
key (the same model before a code change) is compiled afresh once, then loaded from here.

The key is a SHA-256 of everything that decides the program: the name, the static arguments'
``repr`` (frozen dataclasses: the model config, the sampling parameters), the inputs' pytree
structure, shapes and dtypes, the source of the project's packages (``models``,
``jax_shared_attn``, ``pallas_kernels``: a code change is a new program), the jax and jaxlib
versions, the platform and device kind, every ``jax.config`` value but the cache settings, and
``XLA_FLAGS``. Any difference is another file; nothing stale is ever called.

Loading an executable is not free on a CPU (XLA rebuilds the program's module and its thunks:
the larger the program, the longer). The store remembers which program followed which in a
process (``<dir>/next.json``: a program's key -> the next program's key and donated inputs) and,
when it loads a program from disk, loads the program that followed it last time in a background
thread, while the first one runs (counted in ``preloaded``). :meth:`ProgramStore.begin` names a
run (e.g. a command and its flags): the programs the last run of that name called are then
loaded in the background at once, in their order, while the caller does its other work
(imports, reading the weights). A call finds its program ready; a read ahead that is not
called, or fails, costs nothing but the thread's work. A program that was read ahead starts no
read of its own (the decode loop would share the cores with it).

An executable is machine code, loaded as it is: the store's folder must be trusted as the code
is (it is the user's own cache folder).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import pickle
import platform
import threading
from typing import Any, Callable, Optional, Sequence

import jax

PACKAGES = ("models", "jax_shared_attn", "pallas_kernels")
SUFFIX = ".jaxexport"
EXECUTABLE_SUFFIX = ".xla"
NEXT_INDEX = "next.json"
READ_AHEAD = 4  # programs begin() loads in the background, at most


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


@functools.lru_cache(maxsize=None)
def host_fingerprint() -> str:
  """The processor a compiled executable is for (part of its file name): the machine type and,
  where ``/proc/cpuinfo`` tells them, the first processor's model and instruction-set flags (an
  XLA CPU executable is machine code for the host's instruction set)."""
  parts = [platform.machine()]
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if not line.strip():  # the end of the first processor's block
          break
        if line.startswith(("model name", "flags", "Features", "CPU implementer", "CPU part")):
          parts.append(" ".join(line.split()))
  except OSError:
    pass
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


class ProgramStore:
  """Exported programs in ``path`` (created if missing), and what this process did with them.

  Attributes:
    loaded: programs read from disk (no tracing).
    exported: programs traced and lowered here (and written, if ``path`` is writable).
    unstorable: programs run without the store: they call custom kernels (Pallas, Mosaic),
      which ``jax.export`` refuses to serialize.
    preloaded: of ``loaded``, those loaded in the background (after the program before them,
      or from :meth:`begin`) before they were called.
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

    def call(*a):
      return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(a)))

    pending = self._pending.pop(key, None)
    if pending is not None:
      try:
        run = pending.result()
      except Exception:  # noqa: BLE001 -- the read ahead failed: load it here instead
        run = None
      if run is not None:
        self.loaded += 1
        self.preloaded += 1
        # No read-ahead from here: it would share the cores with this program (the decode
        # loop), not with a prefill.
        self._follows(key, donated)
        return call
    run = None
    if _stored(self.path, key):
      self._preload_next(key)  # the next program loads while this one does, then runs
      run = _load(self.path, key, donated)
    if run is not None:
      self.loaded += 1
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
      _write(os.path.join(self.path, key + SUFFIX), exported.serialize())
      # Compiled for the exported avals, as a load compiles it.
      run, fresh = _compile(exported, donated, key)
      if fresh:
        _write_executable(self.path, key, run)
    self._follows(key, donated)
    return call

  def begin(self, run: str) -> None:
    """Names the run that starts now (e.g. a command and its flags, as a string) and loads the
    programs the last run of that name (with the same code and environment: :meth:`key`) called,
    in their order, in a background thread (:data:`READ_AHEAD` at most): each call of one finds
    it ready. The first program called from now on is noted as that name's first."""
    # With the code and environment, as every program key: a run of the same name in another
    # setting calls other programs.
    text = repr((run, code_fingerprint(), environment()))
    start = "begin-" + hashlib.sha256(text.encode()).hexdigest()[:32]
    index, key, ahead = self._index(), start, []
    while len(ahead) < READ_AHEAD:
      entry = index.get(key)
      following = entry.get("key") if isinstance(entry, dict) else None
      if not isinstance(following, str) or following in ahead or following == start:
        break
      ahead.append(following)
      key = following
    for key in ahead:
      self._read_ahead(key, index)
    self._previous = start

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
    """Starts loading the program that followed ``key`` last time, if stored."""
    index = self._index()
    entry = index.get(key)
    following = entry.get("key") if isinstance(entry, dict) else None
    if isinstance(following, str):
      self._read_ahead(following, index)

  def _read_ahead(self, key: str, index: dict) -> None:
    """Starts loading the stored program ``key`` in the background thread (queued after the
    loads already started), unless it is loading already or not stored."""
    if key in self._pending or not _stored(self.path, key):
      return
    donated = None
    for entry in index.values():  # the donated inputs noted where the program was a "next"
      if isinstance(entry, dict) and entry.get("key") == key:
        try:
          donated = tuple(int(i) for i in entry.get("donated", ()))
        except (TypeError, ValueError):  # a damaged entry: read nothing ahead
          return
        break
    if donated is None:
      return
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="programs")
    self._pending[key] = self._pool.submit(_load, self.path, key, donated)

  def close(self) -> None:
    """Cancels the loads that have not started (one under way finishes: the process waits for
    it at exit)."""
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
      self._pool = None
    self._pending.clear()

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


def _compile(exported: "jax.export.Exported", donated: tuple[int, ...], key: str):
  """``exported`` compiled for its own input avals: ``(compiled, fresh)``. ``fresh``: XLA
  compiled it here; False where it came from XLA's persistent cache, whose executables do not
  serialize again (the copy lacks their functions: loaded, it fails when called). The program is
  named after its key, so that XLA's cache holds it under a name of its own (the same
  computation stored under another key, e.g. before a code change, is not taken from there)."""
  call = exported.call

  def program(*args):
    return call(*args)

  program.__name__ = program.__qualname__ = key.replace("-", "_")
  hits = _persistent_cache_hits()
  before = getattr(hits, "count", 0)
  compiled = jax.jit(program, donate_argnums=donated).lower(*exported.in_avals).compile()
  return compiled, getattr(hits, "count", 0) == before


@functools.lru_cache(maxsize=None)
def _persistent_cache_hits() -> threading.local:
  """Per thread, ``count``: the compilations that thread took from XLA's persistent cache. One
  listener for the process, never removed (removing one while another thread reports an event
  can hide that event from the listeners after it)."""
  hits = threading.local()

  def listen(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # reported by the compiling thread
      hits.count = getattr(hits, "count", 0) + 1

  jax.monitoring.register_event_listener(listen)
  return hits


def _executable_file(path: str, key: str) -> str:
  return os.path.join(path, f"{key}-{host_fingerprint()}{EXECUTABLE_SUFFIX}")


def _stored(path: str, key: str) -> bool:
  """Whether ``key``'s executable or exported program is in ``path``."""
  return (os.path.exists(_executable_file(path, key))
          or os.path.exists(os.path.join(path, key + SUFFIX)))


def _load(path: str, key: str, donated: tuple[int, ...]):
  """The stored program ``key``, ready to call: its executable loaded, else its exported
  program compiled (and that executable written); None when neither can be read."""
  from jax.experimental import serialize_executable

  try:
    with open(_executable_file(path, key), "rb") as f:
      return serialize_executable.deserialize_and_load(*pickle.load(f))
  except Exception:  # noqa: BLE001 -- missing, damaged, or from another jaxlib: compile it
    pass
  try:
    run, fresh = _compile(_read(os.path.join(path, key + SUFFIX)), donated, key)
  except Exception:  # noqa: BLE001 -- missing, damaged or foreign: trace it afresh
    return None
  if fresh:
    _write_executable(path, key, run)
  return run


def _write_executable(path: str, key: str, run) -> None:
  """Writes the compiled program ``run``'s executable (best effort: some cannot be)."""
  from jax.experimental import serialize_executable

  try:
    payload = pickle.dumps(serialize_executable.serialize(run))
  except Exception:  # noqa: BLE001 -- e.g. a backend that does not serialize executables
    return
  _write(_executable_file(path, key), payload)


def _write(file: str, data: bytes) -> None:
  """``data`` into ``file``, written whole and then renamed (a reader never sees half a file);
  best effort (a read-only store only loses the write)."""
  tmp = f"{file}.{os.getpid()}.tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, file)
  except OSError:
    pass
