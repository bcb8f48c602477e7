"""Float64 NumPy oracle of full attention and helpers for tests and benchmarks.

The oracle builds each sequence's whole context explicitly (shared segments
concatenated with its suffix) and runs textbook softmax attention in float64:
it shares no code with the library, so agreement means something.
"""

from __future__ import annotations

from typing import Optional, Sequence

import ml_dtypes
import numpy as np


def oracle_attention(q, contexts_k, contexts_v, *, visible_from_end: Optional[Sequence[int]] = None,
                     causal_suffix: Optional[Sequence[int]] = None, scale=None):
  """Float64 attention per sequence over an explicit context.

  Args:
    q: ``[B, Tq, Hq, D]``.
    contexts_k, contexts_v: length-B lists of ``[L_b, Hkv, D]`` arrays: each
      sequence's whole context, in order.
    causal_suffix: per sequence, the number of trailing context tokens that
      form the causal suffix (None: non-causal). Query i then sees every key
      before the suffix and suffix keys ``j <= S_b - Tq + i``.
    scale: default ``D ** -0.5``.

  Returns:
    ``(out [B, Tq, Hq, D], lse [B, Tq, Hq])`` float64; rows with no visible
    key are ``(0, -inf)``.
  """
  q = np.asarray(q, np.float64)
  b, tq, hq, d = q.shape
  scale = d ** -0.5 if scale is None else scale
  out = np.zeros((b, tq, hq, d))
  lse = np.full((b, tq, hq), -np.inf)
  for i in range(b):
    k = np.asarray(contexts_k[i], np.float64)
    v = np.asarray(contexts_v[i], np.float64)
    n_ctx, hkv = k.shape[0], (k.shape[1] if k.ndim == 3 else 1)
    g = hq // hkv
    for t in range(tq):
      visible = np.ones((n_ctx,), bool)
      if causal_suffix is not None:
        s = int(causal_suffix[i])
        pos = s - tq + t  # position inside the suffix
        j = np.arange(n_ctx) - (n_ctx - s)  # suffix position of each key (<0: shared part)
        visible = (j < 0) | (j <= pos)
      if not visible.any():
        continue
      for h in range(hq):
        kk = k[visible, h // g]
        vv = v[visible, h // g]
        logits = scale * (kk @ q[i, t, h])
        m = logits.max()
        w = np.exp(logits - m)
        out[i, t, h] = (w @ vv) / w.sum()
        lse[i, t, h] = m + np.log(w.sum())
  return out, lse


def oracle_full(q, k, v, kv_lengths=None, causal=False, scale=None):
  """Oracle for ``attention_with_lse``: q ``[B,Tq,Hq,D]``, k/v ``[B,Tk,Hkv,D]``."""
  k = np.asarray(k)
  v = np.asarray(v)
  b, tk = k.shape[:2]
  lens = np.full((b,), tk) if kv_lengths is None else np.asarray(kv_lengths)
  ks = [k[i, :lens[i]] for i in range(b)]
  vs = [v[i, :lens[i]] for i in range(b)]
  return oracle_attention(q, ks, vs, causal_suffix=(lens if causal else None), scale=scale)


def oracle_tree(q, segments_k, segments_v, suffix_k, suffix_v, suffix_lengths=None, causal=True,
                scale=None):
  """Oracle for prefix/tree attention.

  ``segments_k[b]`` is the list of sequence b's shared segments (each
  ``[L, Hkv, D]``) in context order; the suffix follows.
  """
  suffix_k = np.asarray(suffix_k)
  suffix_v = np.asarray(suffix_v)
  b, s = suffix_k.shape[:2]
  lens = np.full((b,), s) if suffix_lengths is None else np.asarray(suffix_lengths)
  hkv, d = suffix_k.shape[2:]
  ks, vs = [], []
  for i in range(b):
    ks.append(np.concatenate([np.asarray(x).reshape(-1, hkv, d) for x in segments_k[i]]
                             + [suffix_k[i, :lens[i]]], axis=0))
    vs.append(np.concatenate([np.asarray(x).reshape(-1, hkv, d) for x in segments_v[i]]
                             + [suffix_v[i, :lens[i]]], axis=0))
  return oracle_attention(q, ks, vs, causal_suffix=(lens if causal else None), scale=scale)


def rel_err(x, ref) -> float:
  """``||x - ref|| / ||ref||`` in float64 over finite reference entries; inf if x has NaN."""
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if np.isnan(x).any():
    return float("inf")
  den = np.linalg.norm(ref)
  num = np.linalg.norm(x - ref)
  return float(num / den) if den > 0 else float(num)


def lse_err(lse, ref) -> float:
  """Max abs error of LSEs; -inf entries must match exactly (else inf)."""
  lse = np.asarray(lse, np.float64)
  ref = np.asarray(ref, np.float64)
  if np.isnan(lse).any() or not np.array_equal(np.isneginf(lse), np.isneginf(ref)):
    return float("inf")
  fin = np.isfinite(ref)
  if not fin.any():
    return 0.0
  return float(np.max(np.abs(lse[fin] - ref[fin]) / np.maximum(1.0, np.abs(ref[fin]))))


def tolerance(dtype) -> float:
  """Relative-norm tolerance of an output against the float64 oracle, by input dtype.

  16-bit inputs: the oracle runs on the rounded inputs, so what remains is two roundings to
  the dtype, of the probabilities before the P.V product and of the output, each at most half
  an ulp (eps/2) of every entry: eps in all (bfloat16 7.8e-3, float16 9.8e-4; the measured
  worst sequence is about 0.3 eps). float32: accumulation over up to 16K keys.
  """
  dt = np.dtype(dtype)
  if dt == np.float64:
    return 1e-10
  if dt == np.float32:
    return 1e-5
  return float(ml_dtypes.finfo(dt).eps)


def lse_tolerance(dtype) -> float:
  """Tolerance of ``lse_err`` against the float64 oracle, by input dtype.

  The oracle runs on the rounded inputs, and the products of 16-bit numbers are exact in
  float32, so a 16-bit input's LSE carries only float32 accumulation error (a few eps32;
  32 eps32 = 3.8e-6 covers sums over long contexts). float32 inputs round each product too.
  """
  dt = np.dtype(dtype)
  if dt == np.float64:
    return 1e-10
  if dt == np.float32:
    return 1e-5
  return 32 * float(np.finfo(np.float32).eps)


def rel_err_rows(x, ref, axis: int = 0) -> np.ndarray:
  """``rel_err`` of every index along ``axis`` (a sequence, by default), as a float64 vector.

  An entry whose reference is all zero (an empty context) gets the norm of ``x`` itself; an
  entry of ``x`` with a NaN gets inf.
  """
  x = np.moveaxis(np.asarray(x, np.float64), axis, 0)
  ref = np.moveaxis(np.asarray(ref, np.float64), axis, 0)
  x = x.reshape(x.shape[0], -1)
  ref = ref.reshape(ref.shape[0], -1)
  num = np.linalg.norm(x - ref, axis=1)
  den = np.linalg.norm(ref, axis=1)
  err = np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
  return np.where(np.isnan(x).any(axis=1), np.inf, err)


def check_rows(x, ref, tol: float, what: str = "out", axis: int = 0) -> float:
  """Asserts every sequence (index along ``axis``) of ``x`` is within ``tol`` of ``ref``
  (relative norm); the message names the worst one. Returns the worst error."""
  err = rel_err_rows(x, ref, axis)
  if err.size == 0:
    return 0.0
  worst = int(np.argmax(err))
  assert err[worst] <= tol, (f"{what}: sequence {worst} of {err.size} is off by {err[worst]:.3e} "
                             f"(tolerance {tol:.3e}); {int((err > tol).sum())} over")
  return float(err[worst])


def check_attention(out, lse, ref_out, ref_lse, dtype) -> None:
  """Output (every sequence) and LSE (every entry, -inf where the oracle's is) within the
  input dtype's tolerances of the float64 oracle."""
  check_rows(out, ref_out, tolerance(dtype))
  if lse is not None:
    err = lse_err(lse, ref_lse)
    assert err <= lse_tolerance(dtype), f"lse off by {err:.3e} (tolerance {lse_tolerance(dtype):.3e})"
