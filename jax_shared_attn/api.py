"""Public attention API: full attention with LSE, shared-prefix and tree attention.

The decomposition (Hydragen, Sec. 3): attention over a context that is the
concatenation of shared segments and a per-sequence suffix equals the LSE
merge of attention over each part. Shared parts are computed once for all
the queries that share them (one matrix product, the segment read once);
the suffix part is per sequence. See :mod:`jax_shared_attn.merge` for the
merge formula.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jax_shared_attn import _checks
from jax_shared_attn import ops as ops_lib

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedLevel:
  """One level of a sharing tree (Hydragen Sec. 3.3).

  Attributes:
    k: ``[N, T, Hkv, D]`` keys of the level's N shared segments (padded to T).
    v: ``[N, T, Hkv, D]`` values, same shape as ``k``.
    lengths: int32 ``[N]``: segment n's first ``lengths[n]`` tokens are valid.
    node_of_seq: int32 ``[B]``: the segment that sequence b continues at this
      level, or ``-1`` if b has no segment at this level.

    all_share: static promise that the level is one segment (N = 1) continued by
      every sequence (``node_of_seq`` all 0), as :meth:`shared_by_all` builds it.
      It lets the kernels treat the segment as a plain shared prefix (on Hopper,
      decoding then runs prefix and suffixes in one kernel).

  Sequence b's context is, level by level, ``k[node_of_seq[b], :lengths[...]]``,
  then its own suffix. Fan-out may differ per segment.
  """

  k: Array
  v: Array
  lengths: Array
  node_of_seq: Array
  all_share: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def shared_by_all(cls, k: Array, v: Array, batch_size: int,
                    length: Optional[Array] = None) -> "SharedLevel":
    """A level with one segment (``k, v [T, Hkv, D]``) shared by all ``batch_size`` sequences."""
    length = k.shape[0] if length is None else length
    return cls(k[None], v[None], jnp.reshape(jnp.asarray(length, jnp.int32), (1,)),
               jnp.zeros((batch_size,), jnp.int32), all_share=True)


def _check_query(fn: str, q: Array) -> tuple[int, int, int, int]:
  _checks.check_rank(fn, "q", q, 4, "[B, Tq, Hq, D]")
  return tuple(q.shape)


def _check_suffix(fn, q, k, v, k_name, v_name, kv_lengths, lengths_name):
  b, tq, hq, d = _check_query(fn, q)
  _checks.check_rank(fn, k_name, k, 4, "[B, S, Hkv, D]")
  _checks.check_kv_pair(fn, k_name, k, v_name, v)
  _checks.check_same(fn, "the batch sizes (axis 0)", **{"q": b, k_name: k.shape[0]})
  _checks.check_same(fn, "the head dims (last axis)", **{"q": d, k_name: k.shape[3]})
  _checks.check_heads(fn, "q", hq, k_name, k.shape[2])
  if kv_lengths is None:
    return jnp.full((b,), k.shape[1], jnp.int32)
  return _checks.lengths_array(fn, lengths_name, kv_lengths, (b,), k.shape[1],
                               f"the capacity {k_name}.shape[1]")


def attention_with_lse(q: Array, k: Array, v: Array, *, kv_lengths: Optional[Array] = None,
                       causal: bool = False, scale: Optional[float] = None,
                       impl: str = "auto") -> tuple[Array, Array]:
  """Attention that also returns the log-sum-exp of the scores.

  Args:
    q: ``[B, Tq, Hq, D]`` queries.
    k: ``[B, Tk, Hkv, D]`` keys, ``Hq % Hkv == 0`` (GQA/MQA: query head h reads
      key head ``h // (Hq // Hkv)``).
    v: ``[B, Tk, Hkv, D]`` values.
    kv_lengths: int ``[B]`` or None (= Tk): only the first ``kv_lengths[b]``
      keys of sequence b are valid. Concrete values must lie in [0, Tk];
      traced values are clamped into it.
    causal: query i of sequence b sits at position ``kv_lengths[b] - Tq + i``
      and sees keys up to and including that position.
    scale: score scale, default ``D ** -0.5``.
    impl: ``"auto"``, ``"xla"`` or a Pallas family (see :mod:`jax_shared_attn.ops`).

  Returns:
    ``out [B, Tq, Hq, D]`` in q's dtype and float32 ``lse [B, Tq, Hq]``,
    ``lse = log(sum_j exp(scale * q . k_j))`` (natural log) over visible keys.
    A row with no visible key gives ``out = 0``, ``lse = -inf``.

  Example:
    >>> out, lse = attention_with_lse(q, k, v, kv_lengths=jnp.array([7, 3]), causal=True)
  """
  fn = "attention_with_lse"
  lengths = _check_suffix(fn, q, k, v, "k", "v", kv_lengths, "kv_lengths")
  _checks.check_float_dtypes(fn, q=q, k=k, v=v)
  scale = _checks.check_scale(fn, scale, q.shape[-1])
  ops = ops_lib.resolve(impl, fn)
  out, lse = ops.suffix_attention(q, k, v, kv_lengths=lengths, causal=bool(causal), scale=scale)
  return out.astype(q.dtype), lse


def _check_level(fn: str, i: int, level: SharedLevel, b: int, hkv: int, d: int,
                 dtype) -> tuple[Array, Array]:
  name = f"levels[{i}]"
  if not isinstance(level, SharedLevel):
    raise TypeError(f"{fn}: {name} must be a SharedLevel; got {type(level).__name__}")
  _checks.check_rank(fn, f"{name}.k", level.k, 4, "[N, T, Hkv, D]")
  _checks.check_kv_pair(fn, f"{name}.k", level.k, f"{name}.v", level.v)
  n, t, lh, ld = level.k.shape
  _checks.check_same(fn, "the key/value heads", **{"suffix_k": hkv, f"{name}.k": lh})
  _checks.check_same(fn, "the head dims", **{"q": d, f"{name}.k": ld})
  _checks.check_float_dtypes(fn, q=jnp.empty((), dtype), **{f"{name}.k": level.k,
                                                         f"{name}.v": level.v})
  if n < 1:
    raise ValueError(f"{fn}: {name}.k must hold at least one segment (N >= 1); got N = 0")
  lengths = _checks.lengths_array(fn, f"{name}.lengths", level.lengths, (n,), t,
                                  f"the capacity {name}.k.shape[1]")
  nodes = level.node_of_seq
  if not hasattr(nodes, "dtype") or not jnp.issubdtype(nodes.dtype, jnp.integer):
    raise TypeError(f"{fn}: {name}.node_of_seq must be an integer array [B]; got "
                    f"{getattr(nodes, 'dtype', type(nodes).__name__)}")
  if tuple(nodes.shape) != (b,):
    raise ValueError(f"{fn}: {name}.node_of_seq must have shape [{b}] (one entry per sequence); "
                     f"got {_checks.shape_str(nodes.shape)}")
  if _checks.is_concrete(nodes) and nodes.size:
    lo, hi = int(jnp.min(nodes)), int(jnp.max(nodes))
    if lo < -1 or hi >= n:
      raise ValueError(f"{fn}: {name}.node_of_seq must lie in [-1, {n - 1}] (N = {n} segments); "
                       f"got values in [{lo}, {hi}]")
    if level.all_share and (lo, hi) != (0, 0):
      raise ValueError(f"{fn}: {name}.all_share=True promises every sequence continues segment "
                       f"0, but {name}.node_of_seq holds values in [{lo}, {hi}]")
  if level.all_share and n != 1:
    raise ValueError(f"{fn}: {name}.all_share=True promises one segment shared by every "
                     f"sequence, but {name}.k holds {n} segments")
  return lengths, jnp.asarray(nodes, jnp.int32)


def _decomposed(fn, q, parts, suffix_k, suffix_v, suffix_lengths, causal, scale, impl,
                return_lse):
  """Shared parts first, then the suffix with the shared result merged in."""
  ops = ops_lib.resolve(impl, fn)
  if ops.shared_attention is not None:  # the family fuses the whole decomposition
    out, lse = ops.shared_attention(q, parts, suffix_k, suffix_v, kv_lengths=suffix_lengths,
                                    causal=bool(causal), scale=scale)
  else:
    out, lse = ops_lib.reference_shared_attention(q, parts, suffix_k, suffix_v,
                                                  kv_lengths=suffix_lengths, causal=bool(causal),
                                                  scale=scale, ops=ops)
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


def shared_prefix_attention(q: Array, prefix_k: Array, prefix_v: Array, suffix_k: Array,
                            suffix_v: Array, *, prefix_length: Optional[Array] = None,
                            suffix_lengths: Optional[Array] = None, causal: bool = True,
                            scale: Optional[float] = None, impl: str = "auto",
                            return_lse: bool = False):
  """Exact attention over one shared prefix plus per-sequence suffixes (Hydragen).

  Sequence b's context is ``concat(prefix[:prefix_length], suffix_b[:suffix_lengths[b]])``.
  The prefix part is ONE batched computation: all ``B * Tq * G`` query rows of
  a KV head against the prefix (read once, never copied per sequence); the
  suffix part is per sequence; the two are merged by their LSE.

  Args:
    q: ``[B, Tq, Hq, D]``: the last Tq tokens of each sequence's suffix.
    prefix_k, prefix_v: ``[P, Hkv, D]`` shared by all B sequences.
    suffix_k, suffix_v: ``[B, S, Hkv, D]`` each sequence's own keys/values.
    prefix_length: int scalar or None (= P): valid prefix tokens.
    suffix_lengths: int ``[B]`` or None (= S): valid suffix tokens per sequence.
    causal: causal inside the suffix (query i sits at suffix position
      ``suffix_lengths[b] - Tq + i``); every valid prefix key is visible to
      every query. With ``suffix_lengths[b] >= Tq`` this is exactly causal
      attention over the concatenated context.
    scale: default ``D ** -0.5``.
    impl: ``"auto"``, ``"xla"`` or a Pallas family (:mod:`jax_shared_attn.ops`).
    return_lse: also return the float32 natural-log LSE ``[B, Tq, Hq]``.

  Returns:
    ``out [B, Tq, Hq, D]`` in q's dtype (and ``lse`` if ``return_lse``).

  Example:
    >>> out = shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens)
  """
  fn = "shared_prefix_attention"
  lengths = _check_suffix(fn, q, suffix_k, suffix_v, "suffix_k", "suffix_v", suffix_lengths,
                          "suffix_lengths")
  _checks.check_rank(fn, "prefix_k", prefix_k, 3, "[P, Hkv, D]")
  _checks.check_kv_pair(fn, "prefix_k", prefix_k, "prefix_v", prefix_v)
  _checks.check_same(fn, "the key/value heads", prefix_k=prefix_k.shape[1],
                     suffix_k=suffix_k.shape[2])
  _checks.check_same(fn, "the head dims", q=q.shape[3], prefix_k=prefix_k.shape[2])
  _checks.check_float_dtypes(fn, q=q, prefix_k=prefix_k, prefix_v=prefix_v, suffix_k=suffix_k,
                             suffix_v=suffix_v)
  p = prefix_k.shape[0]
  plen = (jnp.asarray(p, jnp.int32) if prefix_length is None else _checks.lengths_array(
      fn, "prefix_length", prefix_length, (), p, "the prefix capacity prefix_k.shape[0]"))
  scale = _checks.check_scale(fn, scale, q.shape[-1])
  parts = [("prefix", prefix_k, prefix_v, plen, None)]
  return _decomposed(fn, q, parts, suffix_k, suffix_v, lengths, causal, scale, impl, return_lse)


def hierarchical_attention(q: Array, levels: Sequence[SharedLevel], suffix_k: Array,
                           suffix_v: Array, *, suffix_lengths: Optional[Array] = None,
                           causal: bool = True, scale: Optional[float] = None,
                           impl: str = "auto", return_lse: bool = False):
  """Exact attention over a tree of shared segments plus per-sequence suffixes.

  Sequence b's context is, for each level in order, the segment
  ``levels[l].node_of_seq[b]`` (skipped where it is -1), then its own suffix.
  Each segment's attention is batched over the queries of every sequence
  that shares it (Hydragen Sec. 3.3); all parts are merged by LSE.

  Args:
    q: ``[B, Tq, Hq, D]``.
    levels: sequence of :class:`SharedLevel` (may be empty).
    suffix_k, suffix_v: ``[B, S, Hkv, D]``; suffix_lengths: int ``[B]`` or None.
    causal, scale, impl, return_lse: as in :func:`shared_prefix_attention`.
  """
  fn = "hierarchical_attention"
  lengths = _check_suffix(fn, q, suffix_k, suffix_v, "suffix_k", "suffix_v", suffix_lengths,
                          "suffix_lengths")
  _checks.check_float_dtypes(fn, q=q, suffix_k=suffix_k, suffix_v=suffix_v)
  if isinstance(levels, SharedLevel):
    levels = [levels]
  b, _, _, d = q.shape
  parts = []
  for i, level in enumerate(levels):
    seg_lengths, nodes = _check_level(fn, i, level, b, suffix_k.shape[2], d, q.dtype)
    if level.all_share:  # checked above: one segment, every sequence
      parts.append(("prefix", level.k[0], level.v[0], seg_lengths[0], None))
    else:
      parts.append(("segments", level.k, level.v, seg_lengths, nodes))
  scale = _checks.check_scale(fn, scale, d)
  return _decomposed(fn, q, parts, suffix_k, suffix_v, lengths, causal, scale, impl, return_lse)
