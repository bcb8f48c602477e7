"""Pure-JAX attention primitives that return the log-sum-exp (the "xla" path).

These are the references every kernel must equal, and the fallback path on
any backend. Conventions (see DESIGN.md):

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

from typing import Optional, Tuple

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
    from jax_shared_attn.merge import merge_states
    out, lse = merge_states([prior[0], out], [prior[1], lse])
  return out, lse
