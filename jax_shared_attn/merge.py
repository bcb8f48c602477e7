"""Exact merge of partial attention results by their log-sum-exp.

If ``(out_i, lse_i)`` is attention over disjoint key sets ``K_i`` (natural-log
LSE), attention over their union is (Hydragen Sec. 3.1, Appendix A)::

    lse = log(sum_i exp(lse_i))
    out = sum_i exp(lse_i - lse) * out_i

A part with ``lse_i = -inf`` (no visible key) has weight 0; if every part is
``-inf`` the result is ``(0, -inf)``. Arithmetic is float32.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import jax
import jax.numpy as jnp

from jax_shared_attn import _checks
from pallas_kernels.base import merge_states

Array = jax.Array

__all__ = ["merge_attention_states", "merge_states"]


def merge_attention_states(outs: Sequence[Array], lses: Sequence[Array]) -> Tuple[Array, Array]:
  """Merges n >= 1 partial attention results over disjoint key sets, exactly.

  Args:
    outs: sequence of n arrays of one shape ``[..., D]`` (e.g. ``[B, Tq, Hq, D]``),
      each normalised attention output over its own keys.
    lses: sequence of n float arrays ``[...]`` (e.g. ``[B, Tq, Hq]``): the
      natural-log log-sum-exp of the scaled scores of each part; ``-inf``
      marks a part with no visible key.

  Returns:
    ``(out, lse)``: ``out`` in the promoted dtype of ``outs`` and float32
    ``lse = log(sum_i exp(lse_i))``; ``out = sum_i exp(lse_i - lse) * out_i``.
    Never NaN: parts with ``lse = -inf`` are ignored and if all are, the
    result is ``(0, -inf)``.

  Example:
    >>> o1, l1 = attention_with_lse(q, k[:, :5], v[:, :5])
    >>> o2, l2 = attention_with_lse(q, k[:, 5:], v[:, 5:])
    >>> out, lse = merge_attention_states([o1, o2], [l1, l2])  # == attention over all of k
  """
  fn = "merge_attention_states"
  if isinstance(outs, jax.Array) or isinstance(lses, jax.Array):
    raise TypeError(f"{fn}: outs and lses must be sequences (list/tuple) of arrays, one per part")
  outs, lses = list(outs), list(lses)
  if not outs:
    raise ValueError(f"{fn}: outs must hold at least one partial result; got none")
  if len(outs) != len(lses):
    raise ValueError(f"{fn}: outs and lses must have the same length; got {len(outs)} and {len(lses)}")
  shape = outs[0].shape
  for i, (o, l) in enumerate(zip(outs, lses)):
    _checks.check_float_dtypes(fn, **{f"outs[{i}]": o})
    _checks.check_float_dtypes(fn, **{f"lses[{i}]": l})
    if o.shape != shape:
      raise ValueError(f"{fn}: outs[{i}] has shape {_checks.shape_str(o.shape)}; expected "
                       f"{_checks.shape_str(shape)} like outs[0]")
    if l.shape != shape[:-1]:
      raise ValueError(f"{fn}: lses[{i}] must have shape {_checks.shape_str(shape[:-1])} (outs "
                       f"without the last axis); got {_checks.shape_str(l.shape)}")
  out, lse = merge_states(outs, lses)
  return out.astype(jnp.result_type(*outs)), lse
