"""Chunked backward pass of the decomposition, from the merged output and LSE.

Forward: every part i (the shared prefix, each tree level, the suffix) gives
``(O_i, L_i)`` over its own keys and the parts are merged into ``(O, L)``.
Backward (FlashAttention's, restricted to each part's keys): with the MERGED
``O`` and ``L`` of a row, for the keys of any part::

    P  = exp(scale * q.k - L)          (the row's probabilities over ALL keys)
    D  = rowsum(dO * O) - dL           (dL: the cotangent of the returned LSE)
    dV_part = P^T dO
    dS = P * (dO V^T - D)
    dQ += scale * dS K_part            (summed over the parts)
    dK_part = scale * dS^T Q

so no part needs its own ``(O_i, L_i)`` and nothing is recomputed through the
merge. Score variants (:class:`pallas_kernels.base.ScoreMods`) recompute the forward's
modified scores for ``P`` and multiply ``dS`` by the soft cap's derivative ``1 - tanh^2``
before the products with K and Q (ALiBi's bias and the window do not depend on q or k; the
slopes' gradient is ``-sum dS * (i - j)`` over a row's keys, ``dS`` before the cap's factor);
they run on the XLA kernels only.

A shared part's dK/dV is ONE reduction over all the rows that read it
(rows folded as in the forward: ``B * Tq * G`` per KV head); only the suffix
is per sequence. Every product runs on ``block_rows x block_keys`` tiles
(loops over row blocks, then key blocks: :mod:`pallas_kernels.xla` on the XLA path): no score
tensor larger than a tile exists. Rows with no visible key (``L = -inf``) get zero gradients.

:func:`with_chunked_backward` wraps any forward of the decomposition (the
kernels' or XLA's) in a ``jax.custom_vjp`` whose backward is this one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import xla

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """How the backward runs.

  ``block_rows x block_keys``: the XLA path's tile per KV head (query rows x keys, every KV
  head at once). ``kernels``: ``"xla"`` (:func:`pallas_kernels.xla.tiled_attention_grads`),
  ``"triton"`` / ``"tpu"`` (the Pallas kernels
  of :mod:`pallas_kernels.gpu.backward` / :mod:`pallas_kernels.tpu.backward`,
  interpreted off their platform), ``"cudnn"`` (cuDNN's attention backward,
  :mod:`pallas_kernels.gpu.cudnn`, for the parts it supports when the returned LSE
  gets no cotangent; the Triton kernels for the rest), or None: the family's own
  (Triton for the GPU families, Mosaic TPU for ``pallas:tpu``, XLA for ``xla``).
  ``kernel_tiles``: the Pallas kernels' tiles as planned
  (:attr:`jax_shared_attn.dispatch.Plan.backward_tiles`): a
  :class:`pallas_kernels.gpu.backward.BackwardKernelConfig` for "triton" and "cudnn", the rows
  per tile (int) for "tpu"; None: the kernels' defaults for the head dimension.
  """

  block_rows: int = 256
  block_keys: int = 256
  kernels: Optional[str] = None
  kernel_tiles: Any = None

  def __post_init__(self):
    for name in ("block_rows", "block_keys"):
      val = getattr(self, name)
      if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"BackwardConfig: {name} must be a positive int; got {val!r}")
    if self.kernels not in (None, "xla", "triton", "tpu", "cudnn"):
      raise ValueError(f"BackwardConfig: kernels must be None, 'xla', 'triton', 'tpu' or "
                       f"'cudnn'; got {self.kernels!r}")


def part_grads(q: Array, do: Array, lse: Array, delta: Array, k: Array, v: Array, *,
               scale: float, row_seg: Optional[Array] = None, key_seg: Optional[Array] = None,
               lengths: Optional[Array] = None, causal: bool = False, group: int = 1,
               tq: int = 1, config: BackwardConfig = BackwardConfig()):
  """dQ, dK, dV of one part from the merged residuals, tile by tile.

  Args:
    q, do: ``[Z, H, R, D]`` rows (Z independent problems, H KV heads, R rows
      each), in the input dtype.
    lse, delta: float32 ``[Z, H, R]``: the merged LSE and ``rowsum(dO * O) - dL``.
    k, v: ``[Z, K, H, D]`` the part's keys and values.
    row_seg, key_seg: int32 ``[R]``, ``[K]`` (a shared part, ``Z = 1``): row r
      sees key j iff ``row_seg[r] == key_seg[j]`` (-1: a row without the part,
      -2: a key past its segment's length); or
    lengths, causal, group, tq: the suffix (``Z = B``, ``R = Tq * G``): row r of
      sequence z sees key j iff ``j < lengths[z]`` and, causal,
      ``j <= lengths[z] - tq + r // group``.

  Returns:
    float32 ``dq [Z, H, R, D]``, ``dk, dv [Z, K, H, D]``.
  """
  if config.kernels == "triton":
    from pallas_kernels.gpu import backward as gpu_backward  # deferred: kernels are optional
    tiles = config.kernel_tiles or gpu_backward.default_config(q.shape[-1])
    return gpu_backward.part_grads(q, do, lse, delta, k, v, scale=scale, row_seg=row_seg,
                                   key_seg=key_seg, lengths=lengths, causal=causal, group=group,
                                   tq=tq, sparse=row_seg is not None, config=tiles)
  if config.kernels == "tpu":
    from pallas_kernels.tpu import backward as tpu_backward
    from pallas_kernels.tpu import tuned as tpu_tuned
    rows = config.kernel_tiles or tpu_tuned.BACKWARD_BLOCK_ROWS
    return tpu_backward.part_grads(q, do, lse, delta, k, v, scale=scale, row_seg=row_seg,
                                   key_seg=key_seg, lengths=lengths, causal=causal, group=group,
                                   tq=tq, block_rows=rows)
  # The XLA tiles (pallas_kernels.xla) on the rows as [Z, R, H, D]: Z problems of R queries.
  nat = lambda x: jnp.moveaxis(x, 1, 2)
  if row_seg is not None:
    visible = lambda zs, rs, keys: (row_seg[rs][:, None] == key_seg[keys][None, :])[None]
  else:
    visible = xla.suffix_visible(lengths, tq, causal, group)
  dq, dk, dv = xla.tiled_attention_grads(nat(q), nat(do), nat(lse), nat(delta), k, v, visible,
                                         scale=scale, block_rows=config.block_rows,
                                         block_keys=config.block_keys)
  return nat(dq), dk, dv


def _shared_rows(x: Array, hkv: int) -> Array:
  """``[B, Tq, Hq, ...]`` -> ``[1, Hkv, B*Tq*G, ...]`` (the forward's folded rows)."""
  b, t, hq = x.shape[:3]
  x = x.reshape(b, t, hkv, hq // hkv, *x.shape[3:])
  x = jnp.moveaxis(x, 2, 0)
  return x.reshape(1, hkv, b * t * (hq // hkv), *x.shape[4:])


def _unshared_rows(x: Array, b: int, t: int) -> Array:
  hkv, rows = x.shape[1:3]
  x = x.reshape(hkv, b, t, rows // (b * t), *x.shape[3:])
  x = jnp.moveaxis(x, 0, 2)
  return x.reshape(b, t, -1, *x.shape[4:])


def _seq_rows(x: Array, hkv: int) -> Array:
  """``[B, Tq, Hq, ...]`` -> ``[B, Hkv, Tq*G, ...]`` (one sequence's rows per KV head)."""
  b, t, hq = x.shape[:3]
  x = x.reshape(b, t, hkv, hq // hkv, *x.shape[3:])
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(b, hkv, t * (hq // hkv), *x.shape[4:])


def _unseq_rows(x: Array, t: int) -> Array:
  b, hkv, rows = x.shape[:3]
  x = x.reshape(b, hkv, t, rows // t, *x.shape[3:])
  x = jnp.moveaxis(x, 1, 2)
  return x.reshape(b, t, -1, *x.shape[4:])


def decomposition_grads(q: Array, parts: Sequence[tuple], suffix_k: Optional[Array],
                        suffix_v: Optional[Array], *, kv_lengths: Optional[Array], causal: bool,
                        scale: float, out: Array, lse: Array, dout: Array,
                        dlse: Optional[Array] = None,
                        config: BackwardConfig = BackwardConfig(), mods=None):
  """Gradients of the decomposition from its merged ``out [B,Tq,Hq,D]`` and ``lse [B,Tq,Hq]``.

  ``parts`` as in :func:`pallas_kernels.base.reference_shared_attention`
  (``("prefix", k [P,Hkv,D], v, length, None)`` /
  ``("segments", k [N,T,Hkv,D], v, lengths [N], node_of_seq [B])``);
  ``suffix_k = None`` means no suffix part; ``dlse = None``: the LSE gets no cotangent.
  Returns float32 ``(dq, [(dk, dv) per part], (dsuffix_k, dsuffix_v) or None)``.

  With ``config.kernels == "cudnn"`` and no LSE cotangent (cuDNN computes
  ``rowsum(dO * O)`` itself), the parts :func:`pallas_kernels.gpu.cudnn.supports` runs on
  cuDNN; the others, and every part when ``dlse`` is given, on the Triton kernels.

  ``mods``: the forward's score variants (a :class:`pallas_kernels.base.ScoreMods`, None:
  none), on the XLA kernels only; with ALiBi a fourth result, the float32 gradient of
  ``mods.alibi_slopes`` ``[B, Hq]``.
  """
  if mods is not None and config.kernels not in (None, "xla"):
    raise ValueError(f"decomposition_grads: score variants ({', '.join(mods.arguments())}) run "
                     f"on the XLA backward only; got kernels={config.kernels!r}")
  b, tq, hq, _ = q.shape
  dout = dout.astype(q.dtype)  # the products run in the input dtype; half the bytes for 16-bit
  cudnn = None
  if config.kernels == "cudnn":
    from pallas_kernels.gpu import cudnn  # deferred: kernels are optional
    config = dataclasses.replace(config, kernels="triton")  # the parts cuDNN does not take
    cudnn = cudnn if dlse is None else None
    out16 = out.astype(q.dtype)
  lse = lse.astype(jnp.float32)
  delta = None  # rowsum(dO * O) - dL: only the parts cuDNN does not take read it

  def get_delta():
    nonlocal delta
    if delta is None:
      delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
      if dlse is not None:
        delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
    return delta

  if config.kernels in (None, "xla"):  # one dQ accumulated in place, in q's own layout
    return xla.decomposition_grads(q, parts, suffix_k, suffix_v, kv_lengths=kv_lengths,
                                   causal=causal, scale=scale, lse=lse, delta=get_delta(),
                                   dout=dout, block_rows=config.block_rows,
                                   block_keys=config.block_keys, mods=mods)
  dq = jnp.zeros(q.shape, jnp.float32)
  part_out = []
  for kind, k, v, lengths, nodes in parts:
    hkv = k.shape[-2]
    g = hq // hkv
    one = kind == "prefix" or k.shape[0] == 1  # one segment: a single cuDNN call over its rows
    if cudnn is not None and one and cudnn.supports(q, k, v):
      if kind == "prefix":
        dq_p, dk, dv = cudnn.shared_grads(q, out16, dout, lse, k, v, lengths, scale=scale)
      else:
        dq_p, dk, dv = cudnn.shared_grads(q, out16, dout, lse, k[0], v[0], lengths[0],
                                          scale=scale, rows=nodes == 0)
        dk, dv = dk[None], dv[None]
      dq = dq + dq_p
      part_out.append((dk, dv))
      continue
    rows = [_shared_rows(x, hkv) for x in (q, dout, lse, get_delta())]
    if kind == "prefix":
      row_seg = jnp.zeros((b * tq * g,), jnp.int32)
      key_seg = jnp.where(jnp.arange(k.shape[0]) < lengths, 0, -2)
      kk, vv = k[None], v[None]
    else:
      n_seg, t_seg = k.shape[:2]
      row_seg = jnp.repeat(nodes.astype(jnp.int32), tq * g)
      key_seg = jnp.where(jnp.arange(t_seg)[None, :] < lengths[:, None],
                          jnp.arange(n_seg)[:, None], -2).reshape(-1)
      kk = k.reshape(1, n_seg * t_seg, hkv, k.shape[-1])
      vv = v.reshape(1, n_seg * t_seg, hkv, v.shape[-1])
    dq_p, dk, dv = part_grads(*rows, kk, vv, scale=scale, row_seg=row_seg, key_seg=key_seg,
                              config=config)
    dq = dq + _unshared_rows(dq_p, b, tq)
    part_out.append((dk.reshape(k.shape), dv.reshape(v.shape)))
  suffix = None
  if suffix_k is not None and cudnn is not None and cudnn.supports(
      q, suffix_k, suffix_v, causal=causal, suffix_len=tq):
    dq_s, dk, dv = cudnn.suffix_grads(q, out16, dout, lse, suffix_k, suffix_v, kv_lengths,
                                      causal=causal, scale=scale)
    return dq + dq_s, part_out, (dk, dv)
  if suffix_k is not None:
    hkv = suffix_k.shape[2]
    rows = [_seq_rows(x, hkv) for x in (q, dout, lse, get_delta())]
    dq_s, dk, dv = part_grads(*rows, suffix_k, suffix_v, scale=scale, lengths=kv_lengths,
                              causal=causal, group=hq // hkv, tq=tq, config=config)
    dq = dq + _unseq_rows(dq_s, tq)
    suffix = (dk, dv)
  return dq, part_out, suffix


def with_chunked_backward(forward: Callable, config: BackwardConfig = BackwardConfig()):
  """``forward`` (the decomposition: ``(q, parts, suffix_k, suffix_v, *, kv_lengths, causal,
  scale) -> (out, lse)``) with the chunked backward as its VJP.

  ``suffix_k = suffix_v = kv_lengths = None`` means no suffix part (then
  ``forward`` is called with them as None). Integer inputs get no cotangent. The returned
  function takes ``need_lse`` (static, default True): False returns ``(out, None)``, and the
  backward then knows the LSE gets no cotangent (what lets cuDNN's backward apply), and
  ``mods`` (a :class:`pallas_kernels.base.ScoreMods` or None), the score variants, passed on to
  ``forward`` where given (the ALiBi slopes get their gradient).
  """

  def call(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale, need_lse=True,
           mods=None):
    kinds = tuple(p[0] for p in parts)
    arrays = [tuple(p[1:]) for p in parts]

    def rebuild(arrs):
      return [(kind,) + tuple(a) for kind, a in zip(kinds, arrs)]

    def both(q, arrs, sk, sv, lens, mods):
      extra = {} if mods is None else {"mods": mods}
      out, lse = forward(q, rebuild(arrs), sk, sv, kv_lengths=lens, causal=causal, scale=scale,
                         **extra)
      return out.astype(jnp.float32), lse.astype(jnp.float32)

    def run(q, arrs, sk, sv, lens, mods):
      out, lse = both(q, arrs, sk, sv, lens, mods)
      return (out, lse) if need_lse else out

    f = jax.custom_vjp(run)

    def fwd(q, arrs, sk, sv, lens, mods):
      out, lse = both(q, arrs, sk, sv, lens, mods)
      # O is kept in the input dtype (as FlashAttention keeps it): it only enters rowsum(dO * O)
      return ((out, lse) if need_lse else out), (q, arrs, sk, sv, lens, mods,
                                                 out.astype(q.dtype), lse)

    def bwd(res, ct):
      q, arrs, sk, sv, lens, mods, out, lse = res
      dout, dlse = ct if need_lse else (ct, None)
      dq, dparts, dsuffix, *dslopes = decomposition_grads(
          q, rebuild(arrs), sk, sv, kv_lengths=lens, causal=causal, scale=scale, out=out,
          lse=lse, dout=dout, dlse=dlse, config=config, mods=mods)
      dmods = None
      if dslopes:  # the slopes' cotangent; the offsets and static fields have none
        dmods = dataclasses.replace(mods, alibi_slopes=dslopes[0].astype(
            mods.alibi_slopes.dtype), offset=None)
      darrs = [(dk.astype(a[0].dtype), dv.astype(a[1].dtype), None, None)
               for (dk, dv), a in zip(dparts, arrs)]
      dsk = dsv = None
      if dsuffix is not None:
        dsk, dsv = dsuffix[0].astype(sk.dtype), dsuffix[1].astype(sv.dtype)
      return dq.astype(q.dtype), darrs, dsk, dsv, None, dmods

    f.defvjp(fwd, bwd)
    result = f(q, arrays, suffix_k, suffix_v, kv_lengths, mods)
    return result if need_lse else (result, None)

  return call


def _suffix_with_prior(suffix_attention: Callable, config: BackwardConfig):
  """``suffix_attention(..., prior=(out_p, lse_p))`` with the chunked VJP; the prior is a part
  whose gradient follows from the merge: ``w = exp(lse_p - L)``, ``d out_p = w dO``,
  ``d lse_p = w (dO . (out_p - O) + dL)``."""

  def call(q, k, v, *, kv_lengths, causal, scale, prior):
    @jax.custom_vjp
    def f(q, k, v, lens, prior):
      out, lse = suffix_attention(q, k, v, kv_lengths=lens, causal=causal, scale=scale,
                                  prior=prior)
      return out.astype(jnp.float32), lse.astype(jnp.float32)

    def fwd(q, k, v, lens, prior):
      out, lse = f(q, k, v, lens, prior)
      return (out, lse), (q, k, v, lens, prior, out, lse)

    def bwd(res, ct):
      q, k, v, lens, (po, pl), out, lse = res
      dout, dlse = ct
      dq, _, (dk, dv) = decomposition_grads(q, [], k, v, kv_lengths=lens, causal=causal,
                                            scale=scale, out=out, lse=lse, dout=dout, dlse=dlse,
                                            config=config)
      pl32 = pl.astype(jnp.float32)
      w = jnp.where(jnp.isfinite(pl32), jnp.exp(pl32 - jnp.where(jnp.isfinite(lse), lse, 0.0)),
                    0.0)
      dpo = w[..., None] * dout.astype(jnp.float32)
      dpl = w * (jnp.sum(dout * (po.astype(jnp.float32) - out), axis=-1) + dlse)
      return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
              (dpo.astype(po.dtype), dpl.astype(pl.dtype)))

    f.defvjp(fwd, bwd)
    return f(q, k, v, kv_lengths, prior)

  return call


def differentiable(ops, reference_shared: Callable, config: BackwardConfig = BackwardConfig()):
  """``ops`` (an ``AttentionOps``) with the chunked backward as the VJP of every entry point.

  The whole decomposition becomes ``ops.shared_attention`` (the family's own
  fused forward where it has one, else ``reference_shared(..., ops=ops)``
  built from its primitives), so ``jax.grad`` never differentiates a kernel
  or the reference; each primitive gets the same backward on its own.
  """
  if config.kernels is None:
    family = {"pallas:triton": "triton", "pallas:mosaic_gpu": "triton",
              "pallas:tpu": "tpu"}.get(ops.name, "xla")
    config = dataclasses.replace(config, kernels=family)
  shared_fwd = ops.shared_attention
  if shared_fwd is None:
    shared_fwd = lambda *a, **kw: reference_shared(*a, **kw, ops=ops)
  with_prior = _suffix_with_prior(ops.suffix_attention, config)

  def one_part(kind, q, k, v, lengths, nodes, scale):
    def fwd(q, parts, sk, sv, *, kv_lengths, causal, scale):
      _, k, v, lengths, nodes = parts[0]
      if kind == "prefix":
        return ops.prefix_attention(q, k, v, kv_length=lengths, scale=scale)
      return ops.segment_attention(q, k, v, lengths=lengths, node_of_seq=nodes, scale=scale)

    return with_chunked_backward(fwd, config)(q, [(kind, k, v, lengths, nodes)], None, None,
                                              kv_lengths=None, causal=False, scale=scale)

  def prefix_attention(q, k, v, *, kv_length, scale):
    return one_part("prefix", q, k, v, kv_length, None, scale)

  def segment_attention(q, k, v, *, lengths, node_of_seq, scale):
    return one_part("segments", q, k, v, lengths, node_of_seq, scale)

  def suffix_attention(q, k, v, *, kv_lengths, causal, scale, prior=None, need_lse=True,
                       mods=None):
    if prior is not None:
      if mods is not None:
        raise ValueError("suffix_attention: score variants with a prior state are not "
                         "differentiable here; use shared_attention")
      return with_prior(q, k, v, kv_lengths=kv_lengths, causal=causal, scale=scale, prior=prior)
    fwd = lambda q, parts, sk, sv, *, kv_lengths, causal, scale, **mods: ops.suffix_attention(
        q, sk, sv, kv_lengths=kv_lengths, causal=causal, scale=scale, **mods)
    return with_chunked_backward(fwd, config)(q, [], k, v, kv_lengths=kv_lengths, causal=causal,
                                              scale=scale, need_lse=need_lse, mods=mods)

  return type(ops)(ops.name, prefix_attention, segment_attention, suffix_attention,
                   with_chunked_backward(shared_fwd, config))
