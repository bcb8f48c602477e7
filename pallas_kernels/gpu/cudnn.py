"""One part's backward on cuDNN's fused attention backward, from the merged residuals.

FlashAttention's backward needs, besides q, k, v and dO, a row's output ``O`` (for
``D = rowsum(dO * O)``) and its LSE (for ``P = exp(scale * q.k - L)``). Given the MERGED ``O``
and ``L`` of the decomposition, the backward over one part's keys is exactly that part's share
of the whole gradient (:mod:`jax_shared_attn.backward`). cuDNN's backward (the one
``jax.nn.dot_product_attention(implementation="cudnn")`` differentiates with) takes ``O`` and
the softmax statistics as inputs, so each part's backward runs on it with the merged residuals:

* a shared part (a prefix, or a tree level with one segment): ONE call over every row that reads
  it, ``q [1, B*Tq, Hq, D]`` (a free reshape) against the segment's ``k, v [1, P, Hkv, D]``;
  its dK/dV is one reduction over all those rows, never a per-sequence copy. Rows of sequences
  without the segment get zero dO and O (no contribution);
* the suffixes: ``q [B, Tq, Hq, D]`` against ``k, v [B, S, Hkv, D]``, non-causal with key
  lengths, or causal with ``Tq == S`` (teacher forcing). cuDNN's causal mask is top-left (row
  ``u`` sees keys ``j <= u``); ours is bottom-right within each length (row ``t`` sees
  ``j <= len - Tq + t``), so where a sequence is shorter than ``S`` its rows are shifted up by
  ``S - len`` before the call and back after it (skipped, by ``lax.cond``, when every length is
  ``S``).

It needs a CUDA GPU of compute capability >= 8.0, cuDNN, 16-bit inputs and a head dimension
that is a multiple of 8 (<= 128 before Hopper, <= 256 on it); :func:`supports` says which parts
qualify and :mod:`jax_shared_attn.backward` runs the others on the Triton kernels. It binds the
backward primitive of ``jax._src.cudnn.fused_attention_stablehlo`` (the same one in jax 0.10
and 0.11), which is private: :func:`available` is False where it is missing.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
_BIG = 1e30  # the LSE given to rows with no visible key: exp(s - _BIG) = 0


def _cc_major() -> int:
  """The default device's compute capability major (0 where it has none)."""
  cc = str(getattr(jax.devices()[0], "compute_capability", "") or "0")
  try:
    return int(cc.split(".")[0])
  except ValueError:
    return 0


def available() -> bool:
  """True on a CUDA GPU of compute capability >= 8.0 with cuDNN and the backward primitive."""
  if jax.default_backend() != "gpu":
    return False
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from jax._src.lib import cuda_versions
  except ImportError:
    return False
  if cuda_versions is None or not hasattr(fa, "_dot_product_attention_bwd_p_wrapper"):
    return False
  return _cc_major() >= 8


def supports(q: Array, k: Array, v: Array, *, causal: bool = False,
             suffix_len: Optional[int] = None, head_dim_max: Optional[int] = None) -> bool:
  """Whether one part with query ``q [..., D]`` and keys ``k, v [..., S, Hkv, D]`` can run on
  cuDNN: 16-bit, one dtype, equal head dims (a multiple of 8, at most ``head_dim_max``) and,
  for a causal suffix, as many queries as keys (``suffix_len``: the query count)."""
  if q.dtype not in (jnp.bfloat16, jnp.float16) or not q.dtype == k.dtype == v.dtype:
    return False
  d = q.shape[-1]
  if head_dim_max is None:  # cuDNN's limit: 256 on Hopper and later, else 128
    head_dim_max = 256 if _cc_major() >= 9 else 128
  if d % 8 or d > head_dim_max or k.shape[-1] != d or v.shape[-1] != d:
    return False
  if causal and suffix_len != k.shape[-3]:
    return False
  return True


def attention_bwd(q, k, v, o, do, stats, q_seqlen, kv_seqlen, *, causal: bool, scale: float):
  """cuDNN's flash-attention backward, layout ``BTNH``: ``q, o, do [B, T, Hq, D]``,
  ``k, v [B, S, Hkv, D]``, ``stats`` float32 ``[B, Hq, T]`` (the LSE of ``scale * q.k``),
  ``q_seqlen, kv_seqlen`` int32 ``[B]`` (padding mask; ``causal``: top-left, row ``u`` sees
  keys ``j <= u``). Returns ``dq, dk, dv`` in the input dtype."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  unused = jnp.zeros(0, q.dtype)
  mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
  dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(
      q, k, v, unused, q_seqlen, kv_seqlen, unused, unused, unused, unused, stats, o, do,
      scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
      layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
  return dq, dk, dv


def _keys_only(x: Array, lengths: Array) -> Array:
  """``x [B, S, ...]`` with the rows of padding keys (``>= lengths[b]``) zeroed: cuDNN leaves
  them unwritten."""
  keep = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :] < lengths[:, None]
  return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 2)), x, 0)


def _stats(lse: Array) -> Array:
  """``[B, T, Hq]`` merged LSE -> cuDNN's ``[B, Hq, T]``; rows without a key get ``_BIG``."""
  lse = jnp.where(jnp.isfinite(lse), lse, _BIG)
  return jnp.moveaxis(lse.astype(jnp.float32), -1, 1)


def shared_grads(q, out, dout, lse, k, v, length, *, scale: float, rows: Optional[Array] = None,
                 bwd: Optional[Callable] = None):
  """dQ ``[B, Tq, Hq, D]`` and dK, dV ``[P, Hkv, D]`` (float32) of one shared segment.

  ``q, out, dout [B, Tq, Hq, D]`` (input dtype), ``lse`` float32 ``[B, Tq, Hq]`` (merged),
  ``k, v [P, Hkv, D]``, ``length`` its valid keys; ``rows`` bool ``[B]``: the sequences that
  read the segment (None: all). ``bwd``: the call with :func:`attention_bwd`'s contract (None:
  cuDNN's).
  """
  bwd = bwd or attention_bwd
  b, tq, hq, d = q.shape
  if rows is not None:
    keep = rows[:, None, None, None]
    out = jnp.where(keep, out, 0)
    dout = jnp.where(keep, dout, 0)
  fold = lambda x: x.reshape(1, b * tq, *x.shape[2:])
  stats = _stats(lse.reshape(1, b * tq, hq))
  n = jnp.clip(jnp.asarray(length, jnp.int32), 0, k.shape[0]).reshape(1)

  def run(_):
    dq, dk, dv = bwd(fold(q), k[None], v[None], fold(out), fold(dout), stats,
                     jnp.full((1,), b * tq, jnp.int32), n, causal=False, scale=scale)
    dk, dv = _keys_only(dk, n), _keys_only(dv, n)
    return (dq.reshape(q.shape).astype(jnp.float32), dk[0].astype(jnp.float32),
            dv[0].astype(jnp.float32))

  def empty(_):  # no key: no gradient (and no cuDNN call with zero keys)
    return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))

  return lax.cond(n[0] > 0, run, empty, None)


def suffix_grads(q, out, dout, lse, k, v, lengths, *, causal: bool, scale: float,
                 bwd: Optional[Callable] = None):
  """dQ ``[B, Tq, Hq, D]``, dK, dV ``[B, S, Hkv, D]`` (float32) of the suffixes: row ``t`` of
  sequence ``b`` sees key ``j`` iff ``j < lengths[b]`` and, causal (``Tq == S``),
  ``j <= lengths[b] - Tq + t``."""
  bwd = bwd or attention_bwd
  b, tq, hq, d = q.shape
  s = k.shape[1]
  lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, s)
  stats = _stats(lse)
  def f32(grads):  # padding keys' rows zeroed (cuDNN leaves them unwritten), float32
    dq, dk, dv = grads
    return (dq.astype(jnp.float32), _keys_only(dk, lengths).astype(jnp.float32),
            _keys_only(dv, lengths).astype(jnp.float32))

  if not causal:
    return f32(bwd(q, k, v, out, dout, stats, jnp.full((b,), tq, jnp.int32), lengths,
                   causal=False, scale=scale))

  def aligned(_):  # every length is S: the masks agree
    return f32(bwd(q, k, v, out, dout, stats, lengths, lengths, causal=True, scale=scale))

  def shifted(_):  # row t -> u = t - (S - len): cuDNN's top-left mask is ours
    shift = (s - lengths)[:, None]
    u = jnp.arange(tq, dtype=jnp.int32)[None, :]
    up = jnp.minimum(u + shift, tq - 1)  # u < len reads row u + shift; the rest is padding
    take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)),
                                              axis=1)
    st = jnp.take_along_axis(stats, up[:, None, :], axis=2)
    real = (u < lengths[:, None])[..., None, None]  # rows past a length: padding, zero dO and O
    dq, dk, dv = bwd(take(q, up), k, v, jnp.where(real, take(out, up), 0),
                     jnp.where(real, take(dout, up), 0), st, lengths, lengths, causal=True,
                     scale=scale)
    back = jnp.maximum(u - shift, 0)  # row t's result sits at u = t - shift (t >= shift)
    dq = jnp.where((u >= shift)[..., None, None], take(dq, back), 0)
    return f32((dq, dk, dv))

  return lax.cond(jnp.all(lengths == s), aligned, shifted, None)
