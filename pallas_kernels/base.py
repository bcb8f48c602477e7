"""The kernel contract: what every kernel family implements and is compared against.

This module is the bottom of the package graph: every implementation imports it, it imports
none. It holds

* the pure-JAX reference primitives, the plain formula every family must equal (the "xla"
  family, :mod:`pallas_kernels.xla`, computes the same over tiles):
  ``prefix_attention``, ``segment_attention``, ``suffix_attention`` and the whole
  decomposition built from any family's primitives, ``reference_shared_attention``;
* the exact LSE merge ``merge_states``;
* attention over page pools (the serving engine's KV cache), ``paged_attention``, as the
  gathered pages run through the decomposition;
* :class:`AttentionOps`, the interface of a kernel family;
* :class:`AttentionShape`, the bytes and FLOPs of a call (the floors of the benchmarks and of
  the TPU performance model).

Conventions (see DESIGN.md):

* layout ``[batch, seq, heads, head_dim]``; GQA/MQA with ``Hq % Hkv == 0``,
  query head ``h`` reads key/value head ``h // (Hq // Hkv)``;
* LSE is the natural log of the softmax denominator, float32,
  ``lse = log(sum_j exp(scale * q . k_j))`` over the visible keys;
* a row with no visible key has ``out = 0`` and ``lse = -inf`` (never NaN);
* the three primitives return the output in float32 so that partial results
  are merged before any rounding to the input dtype.

Primitives (each has a Pallas kernel with the same signature):

``prefix_attention``   all queries of all sequences against ONE shared K/V
                       sequence: one matrix product with rows
                       ``B * Tq * G`` per KV head (Hydragen Sec. 3.2).
``segment_attention``  a tree level: N shared segments, each sequence's
                       queries against the segment it continues (Sec. 3.3).
``suffix_attention``   per-sequence attention over ragged own K/V, optionally
                       causal, optionally merged with a prior partial result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
State = Tuple[Array, Array]  # (out float32 [..., D], lse float32 [...])


def _precision(dtype) -> lax.Precision:
  # float32 inputs get true float32 products (TF32 on GPUs would cost ~1e-3
  # relative error); 16-bit inputs are exact in any mode.
  return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else lax.Precision.DEFAULT


def softmax_attend(scores: Array, valid: Array, pv) -> State:
  """Masked softmax of float32 ``scores [..., K]`` followed by ``pv(p)``.

  ``pv`` maps unnormalised probabilities (in the value dtype) to ``[..., D]``.
  Returns the normalised output and the LSE; rows with no valid key give
  ``(0, -inf)``. Written with the double-``where`` pattern so that gradients
  stay finite on masked rows.
  """
  if scores.shape[-1] == 0:  # no key at all (an empty segment or buffer)
    zeros = jnp.zeros(scores.shape[:-1], jnp.float32)
    out = pv(jnp.zeros(scores.shape, jnp.float32))
    return jnp.zeros_like(out), zeros - jnp.inf
  masked = jnp.where(valid, scores, -jnp.inf)
  m = jnp.max(masked, axis=-1)
  m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.exp(masked - m[..., None])  # exactly 0 where masked
  denom = jnp.sum(p, axis=-1)
  has_key = denom > 0
  safe_denom = jnp.where(has_key, denom, 1.0)
  out = pv(p) / safe_denom[..., None]
  lse = jnp.where(has_key, m + jnp.log(safe_denom), -jnp.inf)
  return out, lse


def merge_states(outs: Sequence[Array], lses: Sequence[Array]) -> Tuple[Array, Array]:
  """Exact merge of partial results over disjoint key sets (Hydragen Sec. 3.1, App. A).

  ``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) * out_i``, in float32,
  unchecked; ``outs[i] [..., D]``, ``lses[i] [...]``. Parts with ``lse_i = -inf`` weigh 0;
  all ``-inf`` gives ``(0, -inf)``. ``outs[i] [..., D]``, ``lses[i] [...]``."""
  lse = jnp.stack([x.astype(jnp.float32) for x in lses])  # [n, ...]
  m = jnp.max(lse, axis=0)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  w = jnp.exp(lse - m)  # in [0, 1]; exactly 0 for -inf parts
  denom = jnp.sum(w, axis=0)
  has = denom > 0
  safe = jnp.where(has, denom, 1.0)
  out = sum(w_i[..., None] * o.astype(jnp.float32) for w_i, o in zip(w, outs))
  out = out / safe[..., None]
  return out, jnp.where(has, m + jnp.log(safe), -jnp.inf)


def _fold(q: Array, hkv: int) -> Array:
  b, t, hq, d = q.shape
  return q.reshape(b, t, hkv, hq // hkv, d)  # [B, Tq, Hkv, G, D]


def _unfold(x: Array) -> Array:
  b, t, hkv, g = x.shape[:4]
  return x.reshape(b, t, hkv * g, *x.shape[4:])


def prefix_attention(
    q: Array,  # [B, Tq, Hq, D]
    k: Array,  # [P, Hkv, D]
    v: Array,  # [P, Hkv, D]
    *,
    kv_length: Array,  # int32 scalar: the first kv_length keys are valid
    scale: float,
) -> State:
  """Attention of every query against one shared K/V sequence (non-causal).

  The queries of all sequences and the G query heads of each KV head are the
  rows of ONE matrix product per KV head (``rows = B * Tq * G``); the prefix
  is read once and never broadcast to the batch. Returns float32
  ``out [B, Tq, Hq, D]`` and natural-log ``lse [B, Tq, Hq]``.
  """
  hkv = k.shape[1]
  qf = _fold(q, hkv)
  scores = jnp.einsum("btkgd,pkd->btkgp", qf, k, precision=_precision(q.dtype),
                      preferred_element_type=jnp.float32) * scale
  valid = jnp.arange(k.shape[0]) < kv_length  # [P]

  def pv(p):
    return jnp.einsum("btkgp,pkd->btkgd", p.astype(v.dtype), v, precision=_precision(v.dtype),
                      preferred_element_type=jnp.float32)

  out, lse = softmax_attend(scores, valid, pv)
  return _unfold(out), _unfold(lse)


def segment_attention(
    q: Array,  # [B, Tq, Hq, D]
    k: Array,  # [N, T, Hkv, D]
    v: Array,  # [N, T, Hkv, D]
    *,
    lengths: Array,  # int32 [N]
    node_of_seq: Array,  # int32 [B]; -1: the sequence has no segment at this level
    scale: float,
) -> State:
  """One level of a sharing tree: sequence b attends to segment node_of_seq[b].

  Each segment is read once and attended by all the queries in one matrix
  product (``prefix_attention``). This pure-JAX path scans over the N
  segments and, for simplicity and robustness under vmap/grad, multiplies
  every row with every segment and keeps the rows of the segment's
  sequences: N times the FLOPs of a grouped product, never a per-sequence
  copy. The Pallas kernels do the grouped (ragged) product instead.
  Non-causal; float32 out, natural-log LSE.
  """
  n = k.shape[0]
  node = node_of_seq[:, None, None]  # [B, 1, 1]

  def one_segment(i, k_i, v_i, len_i):
    out, lse = prefix_attention(q, k_i, v_i, kv_length=len_i, scale=scale)
    mine = node == i
    return jnp.where(mine[..., None], out, 0.0), jnp.where(mine, lse, -jnp.inf)

  if n == 1:
    return one_segment(0, k[0], v[0], lengths[0])

  def body(carry, xs):
    out, lse = one_segment(*xs)
    mine = node == xs[0]
    return (jnp.where(mine[..., None], out, carry[0]), jnp.where(mine, lse, carry[1])), None

  b, tq, hq, d = q.shape
  init = (jnp.zeros((b, tq, hq, v.shape[-1]), jnp.float32),
          jnp.full((b, tq, hq), -jnp.inf, jnp.float32))
  (out, lse), _ = lax.scan(body, init, (jnp.arange(n), k, v, lengths))
  return out, lse


def visibility_mask(kv_lengths: Array, tq: int, tk: int, causal: bool) -> Array:
  """``[B, Tq, Tk]`` bool: key j visible to query i of sequence b.

  Keys past ``kv_lengths[b]`` are invisible; with ``causal`` query i sits at
  position ``kv_lengths[b] - Tq + i`` and sees keys up to and including it.
  """
  key = jnp.arange(tk)[None, None, :]
  lens = kv_lengths[:, None, None]
  valid = key < lens
  if causal:
    pos = lens - tq + jnp.arange(tq)[None, :, None]
    valid = valid & (key <= pos)
  return valid


def suffix_attention(
    q: Array,  # [B, Tq, Hq, D]
    k: Array,  # [B, S, Hkv, D]
    v: Array,  # [B, S, Hkv, D]
    *,
    kv_lengths: Array,  # int32 [B]
    causal: bool,
    scale: float,
    prior: Optional[State] = None,  # (out f32 [B, Tq, Hq, D], lse [B, Tq, Hq]) merged in
) -> State:
  """Per-sequence attention over each sequence's own ragged K/V.

  With ``prior`` (a partial result over other keys, e.g. the shared prefix)
  the result is merged with it by LSE, as a fused kernel would do.
  """
  hkv = k.shape[2]
  qf = _fold(q, hkv)
  scores = jnp.einsum("btkgd,bskd->btkgs", qf, k, precision=_precision(q.dtype),
                      preferred_element_type=jnp.float32) * scale
  valid = visibility_mask(kv_lengths, q.shape[1], k.shape[1], causal)[:, :, None, None, :]

  def pv(p):
    return jnp.einsum("btkgs,bskd->btkgd", p.astype(v.dtype), v, precision=_precision(v.dtype),
                      preferred_element_type=jnp.float32)

  out, lse = softmax_attend(scores, valid, pv)
  out, lse = _unfold(out), _unfold(lse)
  if prior is not None:
    out, lse = merge_states([prior[0], out], [prior[1], lse])
  return out, lse


def reference_shared_attention(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale,
                               ops: Optional["AttentionOps"] = None) -> State:
  """The decomposition from a family's primitives (default: this module's): the shared parts,
  merged, then the suffix with the merged state as its prior.

  ``parts``: ``("prefix", k [P, Hkv, D], v, length, None)`` or ``("segments", k [N, T, Hkv, D],
  v, lengths [N], node_of_seq [B])`` per shared level, in order.
  """
  ops = XLA_OPS if ops is None else ops
  states = []
  for kind, k, v, lengths, nodes in parts:
    if kind == "prefix":
      states.append(ops.prefix_attention(q, k, v, kv_length=lengths, scale=scale))
    else:
      states.append(ops.segment_attention(q, k, v, lengths=lengths, node_of_seq=nodes,
                                          scale=scale))
  prior = merge_states([s[0] for s in states], [s[1] for s in states]) if states else None
  return ops.suffix_attention(q, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                              scale=scale, prior=prior)


def gather_pages(pool: Array, table: Array) -> Array:
  """``pool [pages, page_size, Hkv, D]`` read through ``table int[N, P]``: ``[N, P * page_size,
  Hkv, D]``, entry n's pages in token order."""
  n, p = table.shape
  return pool[table].reshape((n, p * pool.shape[1]) + pool.shape[2:])


def paged_attention(q, k_pages, v_pages, levels, page_table, kv_lengths, *, causal, scale,
                    ops: Optional["AttentionOps"] = None) -> State:
  """Attention over page pools, the reference (and the "xla" family's path): the pages
  gathered into contiguous buffers, then :func:`reference_shared_attention` from ``ops``'
  primitives (default: this module's).

  ``k_pages, v_pages [pages, page_size, Hkv, D]`` hold every sequence's keys. ``levels``: per
  shared level ``(table int[S, P], lengths int[S], segment_of_seq int[B])``: segment s is the
  first ``lengths[s]`` tokens of its pages ``table[s]``, and sequence b continues segment
  ``segment_of_seq[b]`` (-1: none). Then sequence b's own keys: the first ``kv_lengths[b]``
  tokens of its pages ``page_table[b]`` (``[B, O]``), causal inside them as in
  :func:`suffix_attention`.
  """
  parts = [("segments", gather_pages(k_pages, t), gather_pages(v_pages, t), lengths, nodes)
           for t, lengths, nodes in levels]
  return reference_shared_attention(q, parts, gather_pages(k_pages, page_table),
                                    gather_pages(v_pages, page_table), kv_lengths=kv_lengths,
                                    causal=causal, scale=scale, ops=ops)


class AttentionOps(NamedTuple):
  """An implementation of the three primitives (:data:`XLA_OPS`: this module's reference ones).

  ``shared_attention`` is optional: a family may compute the whole
  decomposition itself, ``shared_attention(q, parts, suffix_k, suffix_v, *,
  kv_lengths, causal, scale) -> (out, lse)`` with ``parts`` a list of
  ``("prefix", k, v, length, None)`` / ``("segments", k, v, lengths,
  node_of_seq)``, to keep intermediates in its own layout and fuse merges.
  The differentiable ops the public API builds also take ``need_lse`` (static) on
  ``shared_attention`` and ``suffix_attention``: False returns ``(out, None)``.

  ``paged_attention`` (optional, forward only): the decomposition over page pools, with
  :func:`paged_attention`'s signature (without ``ops``); None: the pages are gathered and the
  family's primitives run on the gathered buffers.
  """

  name: str
  prefix_attention: Callable[..., Any]
  segment_attention: Callable[..., Any]
  suffix_attention: Callable[..., Any]
  shared_attention: Callable[..., Any] | None = None
  paged_attention: Callable[..., Any] | None = None


# The reference primitives as ops: whole score tensors, the tests' autodiff reference.
XLA_OPS = AttentionOps("xla", prefix_attention, segment_attention, suffix_attention)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """One decode (or chunked-prefill) attention call with a shared prefix: its bytes and FLOPs.

  The IO model follows RelayAttention (Eq. 10) and Hydragen Sec. 3.4: per-sequence attention
  reads every sequence's whole context, ``B * (P + S)`` tokens of K/V; shared-prefix attention
  reads the prefix once and each suffix once, ``P + B * S`` tokens. FLOPs are the same for both
  (``QK^T`` and ``PV``, 2 FLOPs per multiply-add), but only the batched prefix product runs on
  the matrix units at full rate. A floor is ``max(bytes / bandwidth, flops / matmul_rate)``.
  """

  batch: int  # B sequences
  prefix: int  # P shared tokens
  suffix: int  # S own tokens per sequence (all valid)
  q_heads: int  # Hq
  kv_heads: int  # Hkv
  head_dim: int  # D
  q_len: int = 1  # Tq
  itemsize: int = 2  # bytes per element of q, k, v, out (bf16: 2)

  @property
  def _kv_token_bytes(self) -> int:  # K and V of one token, all KV heads
    return 2 * self.kv_heads * self.head_dim * self.itemsize

  @property
  def _q_out_bytes(self) -> int:  # read q, write out
    return 2 * self.batch * self.q_len * self.q_heads * self.head_dim * self.itemsize

  def shared_bytes(self) -> int:
    """Fewest bytes shared-prefix attention must move: prefix once, suffixes once, q, out."""
    return (self.prefix + self.batch * self.suffix) * self._kv_token_bytes + self._q_out_bytes

  def per_sequence_bytes(self) -> int:
    """Bytes of per-sequence attention: every sequence reads prefix and suffix."""
    return self.batch * (self.prefix + self.suffix) * self._kv_token_bytes + self._q_out_bytes

  def flops(self) -> int:
    """2 FLOPs per multiply-add, ``QK^T`` and ``PV`` over the whole context."""
    return 4 * self.batch * self.q_len * self.q_heads * (self.prefix + self.suffix) * self.head_dim

  def prefix_flops(self) -> int:
    return 4 * self.batch * self.q_len * self.q_heads * self.prefix * self.head_dim

  def floor_s(self, bandwidth: float, matmul_rate: float) -> float:
    """Floor of shared-prefix attention in seconds: bytes/bandwidth vs FLOPs/matmul rate."""
    return max(self.shared_bytes() / bandwidth, self.flops() / matmul_rate)

  def per_sequence_floor_s(self, bandwidth: float, matmul_rate: float) -> float:
    return max(self.per_sequence_bytes() / bandwidth, self.flops() / matmul_rate)

  def read_saving(self) -> float:
    """How many times fewer bytes shared-prefix attention moves than per-sequence attention."""
    return self.per_sequence_bytes() / self.shared_bytes()
