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
* :class:`ScoreMods`, the score variants (ALiBi, soft-capping, sliding windows) that the
  reference primitives and the "xla" family apply;
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreMods:
  """Score variants: what happens to a score ``s = scale * q . k`` before the softmax.

  With query position ``i`` and key position ``j`` counted in the sequence's concatenated
  context (its shared levels in order, then its own keys; its queries at the context's last
  ``Tq`` positions), in this order:

  * ``softcap`` (static float > 0 or None): ``s = softcap * tanh(s / softcap)`` (Gemma 2);
  * ``alibi_slopes`` (float32 ``[B, Hq]`` or None): ``s = s - slope[b, h] * (i - j)`` (BLOOM's
    and FlashInfer's signed distance; with ``causal`` every visible key has ``i >= j``);
  * ``window`` (static ``(left, right)`` or None): key j is visible only if
    ``i - left <= j <= i + right`` (``jax.nn.dot_product_attention``'s ``local_window_size``).

  ``offset`` (int32 ``[B]``, set per shared part by the decomposition, see
  :func:`part_offsets`): query 0 of sequence b sits ``offset[b]`` positions after the part's
  key 0, so query ``t`` and key ``j`` of the part are ``offset[b] + t - j`` apart. A sequence's
  own keys (``suffix_attention``) need none: query ``t`` and own key ``j`` are
  ``kv_lengths[b] - Tq + t - j`` apart, whatever precedes them.
  """

  alibi_slopes: Optional[Array] = None
  offset: Optional[Array] = None
  softcap: Optional[float] = dataclasses.field(default=None, metadata=dict(static=True))
  window: Optional[Tuple[int, int]] = dataclasses.field(default=None,
                                                        metadata=dict(static=True))

  @property
  def positional(self) -> bool:
    """Whether the scores depend on positions (ALiBi or a window)."""
    return self.alibi_slopes is not None or self.window is not None

  def arguments(self) -> Tuple[str, ...]:
    """The public arguments that set these variants, e.g. ``("alibi_slopes", "softcap")``."""
    return tuple(name for name, on in (("alibi_slopes", self.alibi_slopes is not None),
                                       ("softcap", self.softcap is not None),
                                       ("local_window_size", self.window is not None)) if on)

  def describe(self) -> str:
    """The variants in words (for :func:`jax_shared_attn.explain`)."""
    words = []
    if self.alibi_slopes is not None:
      words.append(f"alibi_slopes {list(self.alibi_slopes.shape)}")
    if self.softcap is not None:
      words.append(f"softcap={self.softcap}")
    if self.window is not None:
      words.append(f"local_window_size={self.window}")
    return ", ".join(words)

  def apply(self, s: Array, distance: Optional[Array], slopes: Optional[Array]):
    """Modifies float32 scaled scores ``s``.

    ``distance`` (int, broadcastable to ``s``): query position minus key position (needed
    where :attr:`positional`); ``slopes``: float32 ALiBi slopes broadcastable to ``s``.
    Returns ``(s, visible, dcap)``: the modified scores, the window's bool mask (None without
    a window) and ``ds_modified / ds`` of the soft cap, ``1 - tanh^2`` (None without one).
    """
    dcap = None
    if self.softcap is not None:
      t = jnp.tanh(s / self.softcap)
      s, dcap = self.softcap * t, 1.0 - t * t
    if self.alibi_slopes is not None:
      s = s - slopes * distance.astype(jnp.float32)
    visible = None
    if self.window is not None:
      left, right = self.window
      visible = (distance <= left) & (distance >= -right)
    return s, visible, dcap


@dataclasses.dataclass(frozen=True)
class KernelMods:
  """The static half of a :class:`ScoreMods`, as a kernel body applies it (hashable, so a
  kernel's partial and its lowering key on it): whether ALiBi slopes come as an operand, the
  cap and the window."""

  alibi: bool = False
  softcap: Optional[float] = None
  window: Optional[Tuple[int, int]] = None

  @staticmethod
  def of(mods: Optional[ScoreMods]) -> Optional["KernelMods"]:
    """``mods``' static half, None without variants."""
    if mods is None:
      return None
    return KernelMods(mods.alibi_slopes is not None, mods.softcap, mods.window)

  def apply(self, s: Array, distance: Array, slopes: Optional[Array]) -> tuple[Array, Any]:
    """:meth:`ScoreMods.apply` on a kernel's float32 tile ``s`` of scaled scores: the modified
    scores and the window's mask (None without one)."""
    mods = ScoreMods(alibi_slopes=slopes if self.alibi else None, softcap=self.softcap,
                     window=self.window)
    s, visible, _ = mods.apply(s, distance, slopes)
    return s, visible

  def key_bounds(self, first: Array, last: Array) -> Tuple[Array, Array]:
    """The key positions ``[lo, hi)`` that the window lets queries at positions ``first ..
    last`` (in the keys' coordinates) see; a kernel skips the key tiles outside them."""
    left, right = self.window
    return first - left, last + right + 1


def row_variants(mods: ScoreMods, b: int, tq: int, hq: int, hkv: int,
                 offset: Optional[Array] = None) -> Tuple[Optional[Array], Optional[Array]]:
  """``mods`` over the kernels' folded query rows (row ``(b, t, g)`` of KV head h, ``R = B *
  Tq * G`` per head): each row's position, int32 ``[R]`` (query t of sequence b at ``offset[b]
  + t`` in a shared part's key coordinates; None without ``offset`` or where no position is
  needed), and each row's ALiBi slope, float32 ``[Hkv, R]`` (None without ALiBi)."""
  g = hq // hkv
  pos = slopes = None
  if offset is not None and mods.positional:
    pos = offset.astype(jnp.int32)[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]
    pos = jnp.repeat(pos.reshape(-1), g)
  if mods.alibi_slopes is not None:
    s = jnp.broadcast_to(mods.alibi_slopes.astype(jnp.float32).reshape(b, 1, hkv, g),
                         (b, tq, hkv, g))
    slopes = jnp.moveaxis(s, 2, 0).reshape(hkv, b * tq * g)
  return pos, slopes


def part_offsets(parts, kv_lengths: Optional[Array], tq: int, b: int) -> list:
  """Per shared part of the decomposition, int32 ``[B]``: how many positions query 0 of each
  sequence sits after the part's key 0 (:attr:`ScoreMods.offset`).

  Sequence b's context is its segment of every level (length 0 where it has none), then its
  ``kv_lengths[b]`` own keys (None: none); its queries are the context's last ``tq``
  positions. So a part's offset is the length of that part and everything after it, less
  ``tq``."""
  after = (jnp.zeros((b,), jnp.int32) if kv_lengths is None
           else jnp.asarray(kv_lengths, jnp.int32)) - tq
  offsets = []
  for kind, _, _, lengths, nodes in reversed(list(parts)):
    if kind == "prefix":
      own = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (b,))
    else:
      own = jnp.where(nodes >= 0, lengths[jnp.clip(nodes, 0)], 0).astype(jnp.int32)
    after = after + own
    offsets.append(after)
  return offsets[::-1]


def _mod_scores(mods: Optional[ScoreMods], scores: Array, distance) -> tuple[Array, Any]:
  """``mods`` applied to reference scores ``[B, Tq, Hkv, G, K]``; ``distance()`` gives the
  ``[B, Tq, K]`` query-minus-key positions. Returns the scores and the window's mask
  ``[B, Tq, 1, 1, K]`` (True without a window)."""
  if mods is None:
    return scores, True
  dist = distance()[:, :, None, None, :] if mods.positional else None
  slopes = None
  if mods.alibi_slopes is not None:
    b, _, hkv, g = scores.shape[:4]
    slopes = mods.alibi_slopes.reshape(b, hkv, g)[:, None, :, :, None]
  scores, visible, _ = mods.apply(scores, dist, slopes)
  return scores, True if visible is None else visible


def _part_distance(mods: ScoreMods, tq: int, tk: int):
  if mods is None or mods.offset is None:
    if mods is not None and mods.positional:
      raise ValueError("prefix/segment attention: ScoreMods.offset is needed for ALiBi or a "
                       "window (part_offsets gives it)")
    return lambda: None
  return lambda: (mods.offset[:, None, None] + jnp.arange(tq)[None, :, None]
                  - jnp.arange(tk)[None, None, :])


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
    mods: Optional[ScoreMods] = None,  # variants, with the part's offset
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
  scores, in_window = _mod_scores(mods, scores, _part_distance(mods, q.shape[1], k.shape[0]))
  valid = (jnp.arange(k.shape[0]) < kv_length) & in_window  # [P] or [B, Tq, 1, 1, P]

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
    mods: Optional[ScoreMods] = None,  # variants, with the level's offset
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
    extra = {} if mods is None else {"mods": mods}
    out, lse = prefix_attention(q, k_i, v_i, kv_length=len_i, scale=scale, **extra)
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
    mods: Optional[ScoreMods] = None,  # variants (own keys: no offset needed)
) -> State:
  """Per-sequence attention over each sequence's own ragged K/V.

  With ``prior`` (a partial result over other keys, e.g. the shared prefix)
  the result is merged with it by LSE, as a fused kernel would do.
  """
  hkv = k.shape[2]
  qf = _fold(q, hkv)
  scores = jnp.einsum("btkgd,bskd->btkgs", qf, k, precision=_precision(q.dtype),
                      preferred_element_type=jnp.float32) * scale
  tq, tk = q.shape[1], k.shape[1]
  scores, in_window = _mod_scores(mods, scores, lambda: (
      (kv_lengths - tq)[:, None, None] + jnp.arange(tq)[None, :, None]
      - jnp.arange(tk)[None, None, :]))
  valid = visibility_mask(kv_lengths, tq, tk, causal)[:, :, None, None, :] & in_window

  def pv(p):
    return jnp.einsum("btkgs,bskd->btkgd", p.astype(v.dtype), v, precision=_precision(v.dtype),
                      preferred_element_type=jnp.float32)

  out, lse = softmax_attend(scores, valid, pv)
  out, lse = _unfold(out), _unfold(lse)
  if prior is not None:
    out, lse = merge_states([prior[0], out], [prior[1], lse])
  return out, lse


def reference_shared_attention(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale,
                               ops: Optional["AttentionOps"] = None,
                               mods: Optional[ScoreMods] = None) -> State:
  """The decomposition from a family's primitives (default: this module's): the shared parts,
  merged, then the suffix with the merged state as its prior.

  ``parts``: ``("prefix", k [P, Hkv, D], v, length, None)`` or ``("segments", k [N, T, Hkv, D],
  v, lengths [N], node_of_seq [B])`` per shared level, in order. ``mods``: score variants
  (their ``offset`` is set here per part, :func:`part_offsets`); the primitives of ``ops`` must
  take them.
  """
  ops = XLA_OPS if ops is None else ops
  extras = [{} for _ in parts]
  if mods is not None:
    offsets = part_offsets(parts, kv_lengths, q.shape[1], q.shape[0])
    extras = [{"mods": dataclasses.replace(mods, offset=o)} for o in offsets]
  states = []
  for (kind, k, v, lengths, nodes), extra in zip(parts, extras):
    if kind == "prefix":
      states.append(ops.prefix_attention(q, k, v, kv_length=lengths, scale=scale, **extra))
    else:
      states.append(ops.segment_attention(q, k, v, lengths=lengths, node_of_seq=nodes,
                                          scale=scale, **extra))
  prior = merge_states([s[0] for s in states], [s[1] for s in states]) if states else None
  extra = {} if mods is None else {"mods": mods}
  return ops.suffix_attention(q, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                              scale=scale, prior=prior, **extra)


def gather_pages(pool: Array, table: Array) -> Array:
  """``pool [pages, page_size, Hkv, D]`` read through ``table int[N, P]``: ``[N, P * page_size,
  Hkv, D]``, entry n's pages in token order."""
  n, p = table.shape
  return pool[table].reshape((n, p * pool.shape[1]) + pool.shape[2:])


def paged_attention(q, k_pages, v_pages, levels, page_table, kv_lengths, *, causal, scale,
                    ops: Optional["AttentionOps"] = None,
                    mods: Optional[ScoreMods] = None) -> State:
  """Attention over page pools, the reference (and the "xla" family's path): the pages
  gathered into contiguous buffers, then :func:`reference_shared_attention` from ``ops``'
  primitives (default: this module's).

  ``k_pages, v_pages [pages, page_size, Hkv, D]`` hold every sequence's keys. ``levels``: per
  shared level ``(table int[S, P], lengths int[S], segment_of_seq int[B])``: segment s is the
  first ``lengths[s]`` tokens of its pages ``table[s]``, and sequence b continues segment
  ``segment_of_seq[b]`` (-1: none). Then sequence b's own keys: the first ``kv_lengths[b]``
  tokens of its pages ``page_table[b]`` (``[B, O]``), causal inside them as in
  :func:`suffix_attention`. ``mods``: score variants, as in
  :func:`reference_shared_attention`.
  """
  extra = {} if mods is None else {"mods": mods}
  parts = [("segments", gather_pages(k_pages, t), gather_pages(v_pages, t), lengths, nodes)
           for t, lengths, nodes in levels]
  return reference_shared_attention(q, parts, gather_pages(k_pages, page_table),
                                    gather_pages(v_pages, page_table), kv_lengths=kv_lengths,
                                    causal=causal, scale=scale, ops=ops, **extra)


class AttentionOps(NamedTuple):
  """An implementation of the three primitives (:data:`XLA_OPS`: this module's reference ones).

  ``shared_attention`` is optional: a family may compute the whole
  decomposition itself, ``shared_attention(q, parts, suffix_k, suffix_v, *,
  kv_lengths, causal, scale) -> (out, lse)`` with ``parts`` a list of
  ``("prefix", k, v, length, None)`` / ``("segments", k, v, lengths,
  node_of_seq)``, to keep intermediates in its own layout and fuse merges.
  The differentiable ops the public API builds also take ``need_lse`` (static) on
  ``shared_attention`` and ``suffix_attention``: False returns ``(out, None)``.
  The reference primitives, the "xla" family and the Triton and TPU families take ``mods`` (a
  :class:`ScoreMods`, the score variants); the Mosaic GPU kernels do not.

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
