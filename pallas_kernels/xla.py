"""The "xla" family: the primitives and the whole decomposition in pure JAX, tile by tile.

FlashAttention's forward written with ``lax`` loops: the queries are cut into blocks of
``XlaConfig.block_rows`` tokens (all heads of each), the keys into blocks of
``block_keys``, and each row block runs an online softmax over the key blocks, keeping a
float32 running maximum ``m``, sum ``l`` and unnormalised output ``acc``::

    m' = max(m, max_j s_j)      p_j = exp(s_j - m')      alpha = exp(m - m')
    l' = alpha * l + sum_j p_j  acc' = alpha * acc + sum_j p_j v_j

and ends with ``out = acc / l``, ``lse = m + log(l)``: no score tensor larger than one tile
exists, and an input within one tile is one product, as in the reference. A prior state
``(out, lse)`` starts the softmax at ``m = lse, l = 1, acc = out``, which is the LSE merge
of :func:`pallas_kernels.base.merge_states`; so :func:`shared_attention` runs the parts (prefix,
tree levels, suffix) one after another over one running state, with no merge step and no
per-part output. The reference these must equal stays the plain formula of
:mod:`pallas_kernels.base`.

A row block is ``block_rows // Tq`` sequences' whole queries (decoding: up to ``block_rows``
sequences), or ``block_rows`` queries of one sequence, in every part: a shared part's keys meet
all the block's rows, ``bz * bt * G`` per KV head, in one product (the prefix is read once per
row block, never copied per sequence). The last block of rows or keys is moved back to fit
inside the array instead of padding it: keys it shares with the block before are masked, rows
it shares keep the value already written. The backward (:func:`tiled_attention_grads`) runs
the same tiles from the merged residuals.

Score variants (:class:`pallas_kernels.base.ScoreMods`: ALiBi, soft-capping, windows) are
applied to each tile's scores, from the absolute positions of its rows and keys; the backward
recomputes them the same way and multiplies dS by the soft cap's derivative ``1 - tanh^2``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.base import AttentionOps, ScoreMods, State, _precision, part_offsets

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class XlaConfig:
  """The XLA family's forward tile (``config=`` of the public API with ``impl="xla"``).

  Attributes:
    block_rows: query tokens per tile, every head of each (whole sequences where
      ``Tq <= block_rows``).
    block_keys: keys per tile.

  A tile's float32 scores take ``block_rows * Hq * block_keys * 4`` bytes (8 MiB at 32 query
  heads). The backward's tiles are :class:`jax_shared_attn.backward.BackwardConfig`'s.
  """

  block_rows: int = 256
  block_keys: int = 256

  def __post_init__(self):
    for name in ("block_rows", "block_keys"):
      val = getattr(self, name)
      if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"XlaConfig: {name} must be a positive int; got {val!r}")


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _blocks(b: int, tq: int, block_rows: int) -> tuple[int, int, int]:
  """Row blocks of the ``[B, Tq]`` query tokens: ``(bz, bt, count)``, at most ``block_rows``
  tokens each (whole sequences where ``Tq <= block_rows``)."""
  bt = max(1, min(tq, block_rows))
  bz = max(1, min(b, block_rows // bt))
  return bz, bt, _cdiv(b, bz) * _cdiv(tq, bt)


def _row_block(i, b: int, tq: int, bz: int, bt: int):
  """Block ``i``'s first row ``(z0, t0)``, moved back to fit, its sequences ``zs [bz]`` and
  tokens ``ts [bt]``, and bool ``new [bz, bt]``: the rows no earlier block holds."""
  n_t = _cdiv(tq, bt)
  z_nominal, t_nominal = (i // n_t) * bz, (i % n_t) * bt
  z0, t0 = jnp.minimum(z_nominal, b - bz), jnp.minimum(t_nominal, tq - bt)
  zs = z0 + jnp.arange(bz, dtype=jnp.int32)
  ts = t0 + jnp.arange(bt, dtype=jnp.int32)
  return z0, t0, zs, ts, (zs >= z_nominal)[:, None] & (ts >= t_nominal)[None, :]


def _sliceable(x: Array) -> Array:
  """``x`` as the loops slice it: 16-bit floats as their bits (uint16). XLA's CPU compiler
  slices 16-bit floats in float32, and the conversion, loop-invariant, moves out of the loop
  onto the whole array: a float32 copy of q or K. Bits are sliced as they are."""
  return lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _operand(tile: Array, dtype) -> Array:
  """A tile of a :func:`_sliceable` array in its own ``dtype``."""
  return lax.bitcast_convert_type(tile, dtype) if tile.dtype != dtype else tile


def _slice(x: Array, z0, t0, bz: int, bt: int) -> Array:
  return lax.dynamic_slice(x, (z0, t0) + (0,) * (x.ndim - 2), (bz, bt) + x.shape[2:])


def _update(x: Array, block: Array, z0, t0) -> Array:
  return lax.dynamic_update_slice(x, block, (z0, t0) + (0,) * (x.ndim - 2))


def _loop(n: int, body: Callable, init):
  """``fori_loop`` over ``range(n)``; one step runs as is."""
  return body(0, init) if n == 1 else lax.fori_loop(0, n, body, init)


class _Tiles(NamedTuple):
  """The tiling of one part: ``q [B, Tq, Hq, D]`` against ``k, v [Z, K, Hkv, D]``."""

  b: int
  tq: int
  hkv: int
  g: int
  nk: int
  shared: bool  # Z = 1 < B: every sequence reads the same keys
  bz: int
  bt: int
  bk: int
  n_rows: int

  @classmethod
  def of(cls, q: Array, k: Array, block_rows: int, block_keys: int) -> "_Tiles":
    b, tq, hq = q.shape[:3]
    z, nk, hkv = k.shape[:3]
    if z not in (1, b):
      raise ValueError(f"tiled attention: k holds {z} key sets for {b} sequences (1 or B)")
    bz, bt, n_rows = _blocks(b, tq, block_rows)
    return cls(b, tq, hkv, hq // hkv, nk, z != b, bz, bt, max(1, min(nk, block_keys)), n_rows)

  def fold(self, x: Array) -> Array:
    """``[B, Tq, Hq, ...]`` -> ``[B, Tq, Hkv, G, ...]``."""
    return x.reshape(self.b, self.tq, self.hkv, self.g, *x.shape[3:])

  def keys_of(self, x: Array, z0) -> Array:
    """The key sets (:func:`_sliceable`) of the block's sequences."""
    if self.shared or self.bz == self.b:
      return x
    return lax.dynamic_slice_in_dim(x, z0, self.bz, axis=0)

  def key_block(self, j, k: Array, v: Array, dtypes):
    """Key block ``j`` of the :func:`_sliceable` ``k, v`` (in ``dtypes``), moved back to fit;
    its first key, keys and bool ``fresh [bk]``: the keys no earlier block holds."""
    k0 = j * self.bk
    start = jnp.minimum(k0, self.nk - self.bk)
    keys = start + jnp.arange(self.bk, dtype=jnp.int32)
    tile = lambda x, dt: _operand(lax.dynamic_slice_in_dim(x, start, self.bk, axis=1), dt)
    return tile(k, dtypes[0]), tile(v, dtypes[1]), start, keys, keys >= k0

  def spec(self, product: str) -> str:
    """The einsum of ``product`` (``s = q k``, ``o = p v``, ``kv = p^T q``) for these keys."""
    kz = "" if self.shared else "z"
    return {"s": f"ztkgd,{kz}skd->ztkgs", "o": f"ztkgs,{kz}skd->ztkgd",
            "kv": f"ztkgs,ztkgd->{kz}skd"}[product]


def tiled_attention(q: Array, k: Array, v: Array, visible: Callable, *, scale: float,
                    block_rows: int, block_keys: int, prior: Optional[State] = None,
                    modify: Optional[Callable] = None,
                    key_limit: Optional[Callable] = None) -> State:
  """Online-softmax attention, tile by tile.

  ``q [B, Tq, Hq, D]``; ``k, v [Z, K, Hkv, D]`` (Z = 1: every sequence reads them; Z = B:
  each its own); ``visible(z [bz], t [bt], keys [bk])``: a bool array broadcastable to
  ``[bz, bt, bk]`` (absolute sequence, query and key indices); tiles of ``block_rows`` query
  tokens x ``block_keys`` keys. ``prior``: float32 ``(out [B, Tq, Hq, Dv], lse [B, Tq, Hq])``
  merged in, or None. ``modify``: the score variants (:func:`score_modifier`) or None.
  ``key_limit(z [bz])``: an int32 scalar no visible key of those sequences reaches, or None;
  the key loop then stops at the last block holding a key below it (a cache longer than its
  contents costs nothing past them; the blocks skipped hold no visible key, so the result is
  the same to the bit).
  Returns the float32 ``(out [B, Tq, Hq, Dv], lse [B, Tq, Hq])``.
  """
  tl = _Tiles.of(q, k, block_rows, block_keys)
  b, tq, hq, d = q.shape
  dv = v.shape[-1]
  if prior is None:
    out0 = jnp.zeros((b, tq, tl.hkv, tl.g, dv), jnp.float32)
    lse0 = jnp.full((b, tq, tl.hkv, tl.g), -jnp.inf, jnp.float32)
  else:
    out0, lse0 = (tl.fold(x.astype(jnp.float32)) for x in prior)
  unfold = lambda out, lse: (out.reshape(b, tq, hq, dv), lse.reshape(b, tq, hq))
  if tl.nk == 0 or b * tq == 0:
    return unfold(out0, lse0)
  dtypes = (k.dtype, v.dtype)
  prec, prec_v = _precision(q.dtype), _precision(v.dtype)
  q_dtype, q = q.dtype, tl.fold(_sliceable(q))
  k, v = _sliceable(k), _sliceable(v)
  bz, bt, bk = tl.bz, tl.bt, tl.bk

  def row_block(i, carry):
    out, lse = carry
    z0, t0, zs, ts, new = _row_block(i, b, tq, bz, bt)
    q_i = _operand(_slice(q, z0, t0, bz, bt), q_dtype)
    k_i, v_i = tl.keys_of(k, z0), tl.keys_of(v, z0)
    o_old, l_old = _slice(out, z0, t0, bz, bt), _slice(lse, z0, t0, bz, bt)

    def key_block(j, state):
      m, l, acc = state
      k_j, v_j, _, keys, fresh = tl.key_block(j, k_i, v_i, dtypes)
      if tl.shared:
        k_j, v_j = k_j[0], v_j[0]
      mask = jnp.broadcast_to(visible(zs, ts, keys) & fresh, (bz, bt, bk))[:, :, None, None]
      s = jnp.einsum(tl.spec("s"), q_i, k_j, precision=prec,
                     preferred_element_type=jnp.float32) * scale
      if modify is not None:
        s, in_window, _, _ = modify(s, zs, ts, keys)
        mask = mask & in_window
      s = jnp.where(mask, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no visible key yet: p, alpha are 0
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      pv = jnp.einsum(tl.spec("o"), p.astype(v_j.dtype), v_j, precision=prec_v,
                      preferred_element_type=jnp.float32)
      return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    # The prior as a state: m = lse, l = 1, acc = out (l = 0, acc = 0 where lse = -inf).
    has = jnp.isfinite(l_old)
    state = (l_old, has.astype(jnp.float32), jnp.where(has[..., None], o_old, 0.0))
    blocks = _cdiv(tl.nk, bk)
    if key_limit is None or blocks == 1:
      m, l, acc = _loop(blocks, key_block, state)
    else:
      used = jnp.clip((key_limit(zs) + bk - 1) // bk, 0, blocks)
      m, l, acc = lax.fori_loop(0, used, key_block, state)
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    new = new[:, :, None, None]  # rows an earlier block wrote keep their value
    o_new = jnp.where(new[..., None], acc / safe[..., None], o_old)
    l_new = jnp.where(new & seen, m + jnp.log(safe), jnp.where(new, -jnp.inf, l_old))
    return _update(out, o_new, z0, t0), _update(lse, l_new, z0, t0)

  return unfold(*_loop(tl.n_rows, row_block, (out0, lse0)))


def tiled_attention_grads(q: Array, do: Array, lse: Array, delta: Array, k: Array, v: Array,
                          visible: Callable, *, scale: float, block_rows: int, block_keys: int,
                          dq: Optional[Array] = None, modify: Optional[Callable] = None,
                          dslopes: Optional[Array] = None) -> tuple[Array, ...]:
  """dQ, dK, dV of one part from the merged residuals (:mod:`jax_shared_attn.backward`'s
  formulas), tile by tile, with :func:`tiled_attention`'s arguments and tiles.

  ``q, do [B, Tq, Hq, D]`` in the input dtype; float32 ``lse, delta [B, Tq, Hq]``: the merged
  LSE and ``rowsum(dO * O) - dL``; ``k, v [Z, K, Hkv, D]``; ``dq``: a float32 accumulator
  ``[B, Tq, Hq, D]`` the part's dQ is added to (None: zeros); ``modify``: the forward's score
  variants. Returns float32 ``(dq, dk, dv)``; with ``dslopes`` (a float32 ``[B, Hq]``
  accumulator, ALiBi on) ``(dq, dk, dv, dslopes)``, the slopes' gradient
  ``-sum dS * (i - j)`` over the part's keys added to it.
  """
  with_slopes = dslopes is not None
  tl = _Tiles.of(q, k, block_rows, block_keys)
  shape, cdt = q.shape, q.dtype
  b, tq = shape[:2]
  dq = jnp.zeros(tl.fold(q).shape, jnp.float32) if dq is None else tl.fold(dq)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  if with_slopes:
    dslopes = dslopes.reshape(b, tl.hkv, tl.g)
  if tl.nk == 0 or b * tq == 0:
    return (dq.reshape(shape), dk, dv) + ((dslopes.reshape(b, -1),) if with_slopes else ())
  prec = _precision(cdt)
  finite = tl.fold(jnp.isfinite(lse))
  lse, delta = tl.fold(jnp.where(jnp.isfinite(lse), lse, 0.0)), tl.fold(delta)
  q, do = tl.fold(_sliceable(q)), tl.fold(_sliceable(do.astype(cdt)))
  k, v = _sliceable(k.astype(cdt)), _sliceable(v.astype(cdt))
  bz, bt, bk = tl.bz, tl.bt, tl.bk

  def row_block(i, carry):
    dq, dk, dv, dsl = carry
    z0, t0, zs, ts, new = _row_block(i, b, tq, bz, bt)
    q_i, do_i = (_operand(_slice(x, z0, t0, bz, bt), cdt) for x in (q, do))
    l_i, d_i = _slice(lse, z0, t0, bz, bt), _slice(delta, z0, t0, bz, bt)
    f_i = _slice(finite, z0, t0, bz, bt) & new[:, :, None, None]  # rows with a key, not done
    k_i, v_i = tl.keys_of(k, z0), tl.keys_of(v, z0)
    at_z = 0 if tl.shared or bz == b else z0

    def key_block(j, state):
      dq_i, dk, dv, dsl_i = state
      k_j, v_j, start, keys, fresh = tl.key_block(j, k_i, v_i, (cdt, cdt))
      if tl.shared:
        k_j, v_j = k_j[0], v_j[0]
      mask = jnp.broadcast_to(visible(zs, ts, keys) & fresh, (bz, bt, bk))[:, :, None, None]
      mask = mask & f_i[..., None]
      s = jnp.einsum(tl.spec("s"), q_i, k_j, precision=prec,
                     preferred_element_type=jnp.float32) * scale
      dcap = dbias = None
      if modify is not None:
        s, in_window, dcap, dbias = modify(s, zs, ts, keys)
        mask = mask & in_window
      p = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - l_i[..., None]), 0.0)
      dv_j = jnp.einsum(tl.spec("kv"), p.astype(cdt), do_i, precision=prec,
                        preferred_element_type=jnp.float32)
      dp = jnp.einsum(tl.spec("s"), do_i, v_j, precision=prec,
                      preferred_element_type=jnp.float32)
      ds = p * (dp - d_i[..., None])
      if with_slopes:  # d(s - slope * dist) / d slope = -dist
        dsl_i = dsl_i + jnp.sum(ds * dbias, axis=(1, 4))
      if dcap is not None:  # d softcap * tanh(s / softcap) = (1 - tanh^2) ds
        ds = ds * dcap
      ds = ds.astype(cdt)
      dq_i = dq_i + jnp.einsum(tl.spec("o"), ds, k_j, precision=prec,
                               preferred_element_type=jnp.float32)
      dk_j = jnp.einsum(tl.spec("kv"), ds, q_i, precision=prec,
                        preferred_element_type=jnp.float32)
      if tl.shared:
        dk_j, dv_j = dk_j[None], dv_j[None]
      at = (at_z, start, 0, 0)
      dk = lax.dynamic_update_slice(dk, lax.dynamic_slice(dk, at, dk_j.shape) + dk_j, at)
      dv = lax.dynamic_update_slice(dv, lax.dynamic_slice(dv, at, dv_j.shape) + dv_j, at)
      return dq_i, dk, dv, dsl_i

    dq_i = jnp.zeros((bz, bt, tl.hkv, tl.g, q.shape[-1]), jnp.float32)
    dsl_i = jnp.zeros((bz, tl.hkv, tl.g), jnp.float32) if with_slopes else None
    dq_i, dk, dv, dsl_i = _loop(_cdiv(tl.nk, bk), key_block, (dq_i, dk, dv, dsl_i))
    dq = _update(dq, _slice(dq, z0, t0, bz, bt) + dq_i * scale, z0, t0)
    if with_slopes:  # rows an earlier block holds added 0 (p = 0 there)
      dsl = lax.dynamic_update_slice_in_dim(
          dsl, lax.dynamic_slice_in_dim(dsl, z0, bz) + dsl_i, z0, axis=0)
    return dq, dk, dv, dsl

  dq, dk, dv, dslopes = _loop(tl.n_rows, row_block, (dq, dk, dv, dslopes))
  return (dq.reshape(shape), dk * scale, dv) + ((dslopes.reshape(b, -1),) if with_slopes else ())


def score_modifier(mods: Optional[ScoreMods], distance: Callable, hkv: int) -> Optional[Callable]:
  """``mods`` as the ``modify(s, zs, ts, keys)`` of :func:`tiled_attention` (None: no variant):
  tile scores ``s [bz, bt, Hkv, G, bk]`` -> ``(scores, in-window mask, d cap, d bias)``: the
  first three as :meth:`pallas_kernels.base.ScoreMods.apply`, then ``-distance`` (float32,
  broadcastable to ``s``: the ALiBi score's derivative by its slope; None without ALiBi).
  ``distance(zs, ts, keys)``: int ``[bz, bt, bk]``, query position minus key position."""
  if mods is None:
    return None

  def modify(s, zs, ts, keys):
    dist = distance(zs, ts, keys)[:, :, None, None, :] if mods.positional else None
    slopes = None
    if mods.alibi_slopes is not None:
      b = mods.alibi_slopes.shape[0]
      slopes = mods.alibi_slopes.reshape(b, hkv, -1)[zs][:, None, :, :, None]
    s, in_window, dcap = mods.apply(s, dist, slopes)
    dbias = None if slopes is None else -dist.astype(jnp.float32)
    return s, True if in_window is None else in_window, dcap, dbias

  return modify


def _offset_distance(offset: Optional[Array], key_pos: Callable = lambda keys: keys) -> Callable:
  """``distance(zs, ts, keys)``: ``offset[z] + t - key_pos(keys)`` (0 offsets where None)."""
  def distance(zs, ts, keys):
    base = 0 if offset is None else offset[zs][:, None, None]
    return base + ts[None, :, None] - key_pos(keys)[None, None, :]
  return distance


def _shared_part(kind: str, k: Array, v: Array, lengths: Array, nodes: Optional[Array],
                 mods: Optional[ScoreMods] = None):
  """A shared part (``"prefix"`` or ``"segments"``) as keys ``[1, K, Hkv, D]``, values, their
  visibility and the score variants' ``modify`` (``mods``: with the part's offset; None: no
  variant): a tree level's N segments are one axis of ``N * T`` keys, each visible to its own
  sequences (every sequence meets every segment: N times the FLOPs of a grouped product, as in
  the reference)."""
  hkv = k.shape[-2]
  if kind == "prefix":
    modify = score_modifier(mods, _offset_distance(getattr(mods, "offset", None)), hkv)
    return k[None], v[None], lambda zs, ts, keys: (keys < lengths)[None, None, :], modify
  n, t_seg, hkv = k.shape[:3]
  modify = score_modifier(  # a flat key's position inside its own segment
      mods, _offset_distance(getattr(mods, "offset", None), lambda keys: keys % t_seg), hkv)
  key_seg = jnp.where(jnp.arange(t_seg)[None, :] < lengths[:, None],
                      jnp.arange(n, dtype=jnp.int32)[:, None], -2).reshape(-1)
  flat = lambda x: x.reshape(1, n * t_seg, hkv, x.shape[-1])
  nodes = nodes.astype(jnp.int32)  # -1: no segment at this level
  visible = lambda zs, ts, keys: (nodes[zs][:, None] == key_seg[keys][None, :])[:, None, :]
  return flat(k), flat(v), visible, modify


def suffix_visible(kv_lengths: Array, tq: int, causal: bool, group: int = 1) -> Callable:
  """The ``visible`` of :func:`tiled_attention` for each sequence's own keys: row ``t`` of
  sequence ``z`` (query ``t // group``) sees key j iff ``j < kv_lengths[z]`` and, causal,
  ``j <= kv_lengths[z] - tq + t // group``."""

  def visible(zs, ts, keys):
    n = kv_lengths[zs][:, None, None]
    ok = keys[None, None, :] < n
    if causal:
      ok = ok & (keys[None, None, :] <= n - tq + (ts // group)[None, :, None])
    return ok

  return visible


def _suffix_modifier(mods: Optional[ScoreMods], kv_lengths: Array, tq: int, hkv: int):
  """The score variants of each sequence's own keys: query t and own key j are
  ``kv_lengths[z] - tq + t - j`` apart."""
  if mods is None:
    return None
  return score_modifier(mods, _offset_distance(kv_lengths - tq), hkv)


def _tiled(q, k, v, visible, modify, *, scale, prior, config, key_limit=None) -> State:
  return tiled_attention(q, k, v, visible, scale=scale, block_rows=config.block_rows,
                         block_keys=config.block_keys, prior=prior, modify=modify,
                         key_limit=key_limit)


def _part_limit(kind: str, lengths: Array) -> Optional[Callable]:
  """The ``key_limit`` of a shared part: the prefix length; none for a tree level (its
  segments' keys lie side by side)."""
  if kind != "prefix":
    return None
  return lambda zs: jnp.max(jnp.asarray(lengths, jnp.int32))


def _suffix_limit(kv_lengths: Array) -> Callable:
  """The ``key_limit`` of the own keys: the longest own length among the block's sequences."""
  return lambda zs: jnp.max(jnp.asarray(kv_lengths, jnp.int32)[zs])


def prefix_attention(q: Array, k: Array, v: Array, *, kv_length: Array, scale: float,
                     prior: Optional[State] = None, config: XlaConfig = XlaConfig(),
                     mods: Optional[ScoreMods] = None) -> State:
  """:func:`pallas_kernels.base.prefix_attention` over tiles (``prior``: a state merged in)."""
  return _tiled(q, *_shared_part("prefix", k, v, kv_length, None, mods), scale=scale,
                prior=prior, config=config, key_limit=_part_limit("prefix", kv_length))


def segment_attention(q: Array, k: Array, v: Array, *, lengths: Array, node_of_seq: Array,
                      scale: float, prior: Optional[State] = None,
                      config: XlaConfig = XlaConfig(),
                      mods: Optional[ScoreMods] = None) -> State:
  """:func:`pallas_kernels.base.segment_attention` over tiles (``prior``: a state merged in)."""
  return _tiled(q, *_shared_part("segments", k, v, lengths, node_of_seq, mods), scale=scale,
                prior=prior, config=config)


def suffix_attention(q: Array, k: Array, v: Array, *, kv_lengths: Array, causal: bool,
                     scale: float, prior: Optional[State] = None,
                     config: XlaConfig = XlaConfig(),
                     mods: Optional[ScoreMods] = None) -> State:
  """:func:`pallas_kernels.base.suffix_attention` over tiles; ``prior`` starts the softmax."""
  tq = q.shape[1]
  return _tiled(q, k, v, suffix_visible(kv_lengths, tq, causal),
                _suffix_modifier(mods, kv_lengths, tq, k.shape[2]), scale=scale, prior=prior,
                config=config, key_limit=_suffix_limit(kv_lengths))


def _part_mods(mods: Optional[ScoreMods], parts, kv_lengths, q: Array) -> list:
  """Each shared part's ``mods`` with its offset (:func:`pallas_kernels.base.part_offsets`)."""
  if mods is None:
    return [None] * len(parts)
  offsets = part_offsets(parts, kv_lengths, q.shape[1], q.shape[0])
  return [dataclasses.replace(mods, offset=o) for o in offsets]


def shared_attention(q: Array, parts, suffix_k: Optional[Array], suffix_v: Optional[Array], *,
                     kv_lengths: Optional[Array], causal: bool, scale: float,
                     config: XlaConfig = XlaConfig(), mods: Optional[ScoreMods] = None) -> State:
  """The whole decomposition (:func:`pallas_kernels.base.reference_shared_attention`'s
  arguments; ``suffix_k = None``: no suffix part), one running state through the parts."""
  state = None
  for (kind, k, v, lengths, nodes), part_mods in zip(parts,
                                                     _part_mods(mods, parts, kv_lengths, q)):
    state = _tiled(q, *_shared_part(kind, k, v, lengths, nodes, part_mods), scale=scale,
                   prior=state, config=config, key_limit=_part_limit(kind, lengths))
  if suffix_k is not None:
    state = suffix_attention(q, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                             scale=scale, prior=state, config=config, mods=mods)
  if state is None:  # nothing to attend to
    b, tq, hq, d = q.shape
    state = (jnp.zeros((b, tq, hq, d), jnp.float32), jnp.full((b, tq, hq), -jnp.inf))
  return state


def get_ops(config: Optional[XlaConfig] = None) -> AttentionOps:
  """The XLA family's ``AttentionOps`` with ``config`` (None: the defaults)."""
  config = XlaConfig() if config is None else config
  bind = lambda f: functools.partial(f, config=config)
  return AttentionOps("xla", bind(prefix_attention), bind(segment_attention),
                      bind(suffix_attention), bind(shared_attention))


def decomposition_grads(q: Array, parts, suffix_k: Optional[Array], suffix_v: Optional[Array],
                        *, kv_lengths: Optional[Array], causal: bool, scale: float, lse: Array,
                        delta: Array, dout: Array, block_rows: int, block_keys: int,
                        mods: Optional[ScoreMods] = None):
  """The decomposition's gradients (:func:`jax_shared_attn.backward.decomposition_grads`'s
  arguments and result; ``lse, delta [B, Tq, Hq]`` float32, ``dout`` in q's dtype), one float32
  dQ accumulated in place through the parts; tiles of ``block_rows`` query rows per KV head x
  ``block_keys`` keys; ``mods``: the forward's score variants. With ALiBi on, a fourth result:
  the float32 gradient of ``mods.alibi_slopes`` ``[B, Hq]``."""
  b, tq, hq, d = q.shape
  dq = jnp.zeros(q.shape, jnp.float32)
  alibi = mods is not None and mods.alibi_slopes is not None
  dslopes = jnp.zeros((b, hq), jnp.float32) if alibi else None

  def grads(k, v, visible, modify, dq):
    nonlocal dslopes
    res = tiled_attention_grads(q, dout, lse, delta, k, v, visible, scale=scale,
                                block_rows=max(1, block_rows // (hq // k.shape[2])),
                                block_keys=block_keys, dq=dq, modify=modify, dslopes=dslopes)
    if alibi:
      dslopes = res[3]
    return res[:3]

  part_out = []
  for (kind, k, v, lengths, nodes), part_mods in zip(parts,
                                                     _part_mods(mods, parts, kv_lengths, q)):
    dq, dk, dv = grads(*_shared_part(kind, k, v, lengths, nodes, part_mods), dq)
    part_out.append((dk.reshape(k.shape), dv.reshape(v.shape)))
  suffix = None
  if suffix_k is not None:
    dq, dk, dv = grads(suffix_k, suffix_v, suffix_visible(kv_lengths, tq, causal),
                       _suffix_modifier(mods, kv_lengths, tq, suffix_k.shape[2]), dq)
    suffix = (dk, dv)
  return (dq, part_out, suffix) + ((dslopes,) if alibi else ())
