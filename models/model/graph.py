"""A model split once for the jitted programs that take it.

``nnx.split`` walks the whole module graph, and ``jax.jit`` hashes a static ``GraphDef`` and
flattens an ``nnx.State`` on every call: together several milliseconds a call for a 30-layer
model, more than a decode step on a GPU. :func:`split` walks the graph once per model and keeps
its live variables: each call then reads their current values into a flat list (which jit
flattens natively) beside a :class:`Graph` whose hash is computed once.

The values are read at every call, so weights changed in place (``nnx.update``, an optimizer's
update, a checkpoint loaded into the model) are what the next call sees. The structure is
taken at the first call: a module or variable replaced by a new object afterwards is not seen
(call :func:`forget`, or build a new model, as :func:`models.parallel.placement` does).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
from flax import nnx


class HashedOnce:
  """For frozen dataclasses (``eq=False``) passed as static arguments of jitted programs, which
  jit hashes at every call: equality by the fields, the hash of the fields computed once, and
  an object equal to itself at once."""

  def _fields(self) -> tuple:
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

  def __post_init__(self):
    object.__setattr__(self, "_hash", hash(self._fields()))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (type(other) is type(self) and self._hash == other._hash
                             and self._fields() == other._fields())


@dataclasses.dataclass(frozen=True, eq=False)
class Graph(HashedOnce):
  """A static argument of jitted programs: a model's ``GraphDef`` and the tree structure of its
  weights, with the hash computed once. :meth:`merge` rebuilds the model inside a trace."""

  graphdef: Any
  treedef: Any

  def merge(self, weights) -> nnx.Module:
    """The model with ``weights`` (the list :func:`split` returned, or arrays like them)."""
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, list(weights)))


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


_SPLITS: dict[int, tuple[weakref.ref, Graph, list, Any]] = {}


def split(model: nnx.Module) -> tuple[Graph, list[jax.Array]]:
  """``(graph, weights)``: the model's :class:`Graph` (cached per model) and the current values
  of its variables as a flat list; ``graph.merge(weights)`` is the model."""
  entry = _SPLITS.get(id(model))
  if entry is None or entry[0]() is not model:
    graphdef, state = nnx.split(model)
    variables = jax.tree.leaves(nnx.state(model), is_leaf=_is_variable)
    treedef = jax.tree.structure(state)
    if treedef.num_leaves != len(variables):  # a variable holding a tree: no flat form
      return Graph(graphdef, treedef), jax.tree.leaves(state)
    # Plain arrays without read hooks are read as stored (get_value copies each one's tree).
    plain = all(isinstance(v.get_raw_value(), jax.Array) and "on_get_value" not in v.get_metadata()
                for v in variables)
    read = (lambda v: v.get_raw_value()) if plain else (lambda v: v.get_value())
    key = id(model)
    ref = weakref.ref(model, lambda _, key=key: _SPLITS.pop(key, None))
    entry = _SPLITS[key] = (ref, Graph(graphdef, treedef), variables, read)
  _, graph, variables, read = entry
  return graph, [read(v) for v in variables]


def forget(model: nnx.Module) -> None:
  """Drops ``model``'s cached split (after replacing one of its modules or variables)."""
  _SPLITS.pop(id(model), None)
