"""Gradients of the decomposition against an independent float64 NumPy gradient.

The oracle builds each sequence's whole context explicitly and applies the
textbook attention gradient (written here from the formula, sharing no code
with the library), then scatters each context key's dK/dV back to the array it
came from (a segment read by several sequences sums their contributions).
``jax.grad`` of the float64 reference cross-checks the oracle itself.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import SharedLevel, hierarchical_attention
from jax_shared_attn import backward as bw
from jax_shared_attn import ops as ops_lib
from jax_shared_attn.testing import rel_err, tolerance
from strategies import SEEDS, count_case, lengths, rand, small_jit

# ((B, Tq, Hq, Hkv, D, S), levels as ((N, T, all_share), ...), causal, scale): MHA to MQA,
# Tq > 1, empty buffers, a shared prefix (all_share), several segments per level, sequences
# with no segment (-1), sizes off any tile multiple. Static values are tied to the shape so
# that each shape compiles once per dtype.
SHAPES = (
    ((3, 1, 4, 1, 16, 5), (), True, None),
    ((5, 3, 4, 2, 16, 7), ((1, 12, True), (3, 5, False)), True, 0.3),
    ((4, 2, 6, 3, 32, 3), ((2, 6, False), (4, 3, False), (3, 2, False)), False, None),
    ((6, 4, 2, 2, 16, 0), ((4, 7, False),), True, None),
    ((2, 5, 8, 1, 64, 8), ((3, 1, False), (1, 4, True)), True, 0.2),
)
SMALL = bw.BackwardConfig(block_rows=6, block_keys=4)  # many partial tiles at these sizes


def oracle_grads(q, do, dl, sources, contexts, causal, scale, eps=0.0, part_rounding=False):
  """Float64 gradient of attention over explicit contexts.

  ``sources``: name -> (k, v) float64 ``[n, Hkv, D]`` (flattened buffers);
  ``contexts[b]``: list of (name, index) for sequence b's keys in order, the
  last ``suffix_len[b]`` of them the causal suffix (``causal`` is that list or None).
  Returns dq and name -> (dk, dv), then the variances (same layout) of the error of a backward
  that rounds to a dtype of machine epsilon ``eps`` where a FlashAttention backward in a 16-bit
  dtype rounds: P before P @ V and O in the forward (O enters rowsum(dO * O)), P before
  dV = P^T dO, dS before dQ = dS K and dK = dS^T Q, and the gradients. Each rounding to nearest
  is an independent error, uniform over plus or minus half an ulp of the value (variance
  ulp^2 / 12), carried to the gradients to first order: what the dtype allows, sums of terms
  of both signs included (where one rounding of the result would understate it).
  ``part_rounding``: each part's share of dQ is rounded as well before the parts are summed
  (a backward that returns every part's gradients in the input dtype, as cuDNN's does).
  """
  b, tq, hq, _ = q.shape
  grads = {n: (np.zeros_like(k), np.zeros_like(v)) for n, (k, v) in sources.items()}
  var = {n: (np.zeros_like(k), np.zeros_like(v)) for n, (k, v) in sources.items()}
  dq = np.zeros_like(q)
  dq_var = np.zeros_like(q)
  def rvar(x):  # variance of rounding x to nearest: (ulp of x)^2 / 12
    return (eps * np.exp2(np.frexp(x)[1] - 1.0)) ** 2 / 12 * (x != 0)
  for i in range(b):
    names = [n for n, _ in contexts[i]]
    idx = np.array([j for _, j in contexts[i]], int)
    k = np.stack([sources[n][0][j] for n, j in contexts[i]]) if idx.size else None
    v = np.stack([sources[n][1][j] for n, j in contexts[i]]) if idx.size else None
    hkv = next(iter(sources.values()))[0].shape[1]
    g = hq // hkv
    for t in range(tq):
      vis = np.ones(idx.size, bool)
      if causal is not None:
        s = causal[i]
        pos = np.arange(idx.size) - (idx.size - s)
        vis = (pos < 0) | (pos <= s - tq + t)
      if not vis.any():
        continue
      for h in range(hq):
        kk, vv = k[vis, h // g], v[vis, h // g]
        logits = scale * kk @ q[i, t, h]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        o = p @ vv
        dp = vv @ do[i, t, h]
        ds = p * (dp - do[i, t, h] @ o + dl[i, t, h])
        dq[i, t, h] = scale * ds @ kk
        # rowsum(dO * O): O's rounding, and the forward's rounding of P (one error per key).
        delta_var = (do[i, t, h] ** 2) @ rvar(o) + rvar(p) @ (dp ** 2)
        # dS: its own rounding (per key), and P times the row's error of rowsum(dO * O).
        dq_var[i, t, h] = scale ** 2 * (rvar(ds) @ (kk ** 2) + (p @ kk) ** 2 * delta_var)
        if part_rounding:
          vis_names = np.array(names, object)[vis]
          for name in set(vis_names.tolist()):
            dq_var[i, t, h] += rvar(scale * ds[vis_names == name] @ kk[vis_names == name])
        ds_var, p_var = rvar(ds), rvar(p)
        for c, j in enumerate(np.flatnonzero(vis)):
          grads[names[j]][0][idx[j], h // g] += scale * ds[c] * q[i, t, h]
          grads[names[j]][1][idx[j], h // g] += p[c] * do[i, t, h]
          var[names[j]][0][idx[j], h // g] += scale ** 2 * q[i, t, h] ** 2 * (
              ds_var[c] + p[c] ** 2 * delta_var)
          var[names[j]][1][idx[j], h // g] += p_var[c] * do[i, t, h] ** 2
  dq_var += rvar(dq)  # the gradients' own rounding
  var = {n: (vk + rvar(grads[n][0]), vv + rvar(grads[n][1])) for n, (vk, vv) in var.items()}
  return dq, grads, dq_var, var


def draw_case(draw, rng, shape, dtype):
  """Random tree, suffixes, cotangents; the oracle's view of them."""
  (b, tq, hq, hkv, d, s), structure, _, scale = shape
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  sk, sk64 = rand(rng, (b, s, hkv, d), dtype)
  sv, sv64 = rand(rng, (b, s, hkv, d), dtype)
  lens = lengths(draw, b, s)
  sources = {"suffix": (sk64.reshape(b * s, hkv, d), sv64.reshape(b * s, hkv, d))}
  contexts = [[] for _ in range(b)]
  levels = []
  for lvl, (n, t, all_share) in enumerate(structure):
    k, k64 = rand(rng, (n, t, hkv, d), dtype)
    v, v64 = rand(rng, (n, t, hkv, d), dtype)
    seg_lens = lengths(draw, n, t)
    nodes = np.array([0 if all_share else draw(st.integers(-1, n - 1)) for _ in range(b)],
                     np.int32)
    levels.append(SharedLevel(k, v, jnp.asarray(seg_lens), jnp.asarray(nodes), all_share))
    sources[lvl] = (k64.reshape(n * t, hkv, d), v64.reshape(n * t, hkv, d))
    for i, node in enumerate(nodes):
      if node >= 0:
        contexts[i] += [(lvl, node * t + j) for j in range(seg_lens[node])]
  for i in range(b):
    contexts[i] += [("suffix", i * s + j) for j in range(lens[i])]
  do, do64 = rand(rng, (b, tq, hq, d), dtype)
  dl = rng.normal(size=(b, tq, hq))
  scale = d ** -0.5 if scale is None else scale
  return dict(q=q, q64=q64, sk=sk, sv=sv, lens=jnp.asarray(lens), levels=levels, do=do,
              do64=do64, dl=jnp.asarray(dl, jnp.float32), dl64=dl, sources=sources,
              contexts=contexts, scale=scale, lens64=lens)


def tree_fn(impl, causal, scale, config=None, with_lse=True, api_config=None):
  """(q, levels, sk, sv, lens) -> (out, lse), or out alone without ``with_lse`` (then the LSE
  is not asked for: its cotangent is statically zero), through the public API (with
  ``api_config`` as its ``config=``) or, with ``config`` (a BackwardConfig), through
  ``ops.differentiable(XLA_OPS, config)``."""
  if config is None:
    return lambda q, levels, sk, sv, lens: hierarchical_attention(
        q, levels, sk, sv, suffix_lengths=lens, causal=causal, scale=scale, impl=impl,
        return_lse=with_lse, config=api_config)
  shared = ops_lib.differentiable(ops_lib.XLA_OPS, config).shared_attention

  def f(q, levels, sk, sv, lens):
    parts = [("prefix", l.k[0], l.v[0], l.lengths[0], None) if l.all_share else
             ("segments", l.k, l.v, l.lengths, l.node_of_seq) for l in levels]
    out, lse = shared(q, parts, sk, sv, kv_lengths=lens, causal=causal, scale=scale,
                      need_lse=with_lse)
    return (out.astype(q.dtype), lse) if with_lse else out.astype(q.dtype)

  return f


def make_vjp(impl, causal, scale, config=None, with_lse=True, api_config=None):
  """Jitted ``(q, levels, sk, sv, lens, do, dl) -> (dq, dks, dvs, dsk, dsv)`` of
  :func:`tree_fn` (``dl`` unused without ``with_lse``); :func:`vjp_fn` caches it."""
  f = tree_fn(impl, causal, scale, config, with_lse, api_config)

  def run(q, levels, sk, sv, lens, do, dl):
    _, pull = jax.vjp(lambda q, ks, vs, sk, sv: f(
        q, [SharedLevel(k, v, l.lengths, l.node_of_seq, l.all_share)
            for k, v, l in zip(ks, vs, levels)],
        sk, sv, lens), q, [l.k for l in levels], [l.v for l in levels], sk, sv)
    return pull((do, dl) if with_lse else do)

  return small_jit(run)


vjp_fn = functools.lru_cache(maxsize=None)(make_vjp)


def per_seq_err(x, ref, axis_b=0, tol=None, var=None):
  """Worst per-sequence relative error, each against max(its own norm, the batch's per-sequence
  RMS norm), so one wrong sequence is caught while near-zero gradients do not divide by ~0.

  With ``tol`` and ``var`` (the oracle's error variances, same shape): the worst ratio of a
  sequence's error to what it may have, the larger of ``tol`` and SIGMAS times the standard
  deviation of its error norm, relative to the same norm (<= 1 passes)."""
  x = np.moveaxis(np.asarray(x, np.float64), axis_b, 0)
  ref = np.moveaxis(np.asarray(ref, np.float64), axis_b, 0)
  if np.isnan(x).any():
    return np.inf
  if ref.shape[0] == 0 or not ref.size:
    return float(np.abs(x).max(initial=0.0))
  flat = lambda a: a.reshape(len(ref), -1)
  norms = np.maximum(np.sqrt((flat(ref) ** 2).sum(1)), 1e-300)
  floor = max(np.sqrt(np.mean(norms ** 2)), 1e-30)
  errs = np.sqrt((flat(x - ref) ** 2).sum(1)) / np.maximum(norms, floor)
  if tol is not None:
    sd = np.sqrt(flat(np.moveaxis(var, axis_b, 0)).sum(1))
    errs = errs / np.maximum(tol, SIGMAS * sd / np.maximum(norms, floor))
  return float(errs.max(initial=0.0))


# 16-bit gradients may be off by this many standard deviations of their rounding error (a
# sequence's error norm concentrates: over ~3,000 sequence gradients of random cases, on the XLA
# path and the Triton kernels interpreted, the largest ratio measured was 1.5, the median 0.5).
SIGMAS = 3


def assert_matches_oracle(grads, c, causal, dtype, *, with_lse=True, part_rounding=False):
  """Every gradient of ``grads = (dq, dks, dvs, dsk, dsv)`` of case ``c`` against the float64
  oracle, per sequence (``with_lse=False``: the LSE's cotangent is zero)."""
  dq, dks, dvs, dsk, dsv = grads
  tol = tolerance(dtype)
  # A 16-bit dtype's rounding (float32: tol covers the accumulation order).
  eps = tol if np.dtype(dtype).itemsize == 2 else 0.0
  dl64 = c["dl64"] if with_lse else np.zeros_like(c["dl64"])
  want_dq, want, dq_var, var = oracle_grads(
      c["q64"], c["do64"], dl64, c["sources"], c["contexts"],
      list(c["lens64"]) if causal else None, c["scale"], eps, part_rounding)
  b, s = c["sk"].shape[:2]
  got = {"suffix": (dsk, dsv), **{i: (dk, dv) for i, (dk, dv) in enumerate(zip(dks, dvs))}}
  errs = {"dq": per_seq_err(dq, want_dq, tol=tol, var=dq_var)}
  for name, (gk, gv) in got.items():
    shape = (b, s) if name == "suffix" else gk.shape[:2]
    for i, (tag, g) in enumerate((("dk", gk), ("dv", gv))):
      w, v = (a[name][i].reshape(shape + a[name][i].shape[1:]) for a in (want, var))
      errs[f"{tag}[{name}]"] = per_seq_err(g, w, tol=tol, var=v)
  bad = {k: e for k, e in errs.items() if not e <= 1}
  assert not bad, (bad, tol)


def check_case(impl, c, shape, dtype, config=None, tag=None):
  causal = shape[2]
  grads = vjp_fn(impl, causal, c["scale"], config)(
      c["q"], c["levels"], c["sk"], c["sv"], c["lens"], c["do"], c["dl"])
  assert_matches_oracle(grads, c, causal, dtype)
  count_case(tag or f"backward {impl}")


def _property(impl, dtypes, max_examples, config=None, tag=None, shapes=SHAPES):
  @settings(max_examples=max_examples)
  @given(data=st.data(), shape=st.sampled_from(shapes), dtype=st.sampled_from(dtypes),
         seed=SEEDS)
  def test(data, shape, dtype, seed):
    c = draw_case(data.draw, np.random.default_rng(seed), shape, dtype)
    check_case(impl, c, shape, dtype, config, tag)

  return test


test_xla_small_tiles = _property("xla", ("float32", "bfloat16"), 300, SMALL,
                                 "backward xla (6x4 tiles)")
# The public API's default tiles, and the kernel families (forward and backward kernels).
test_xla_api = _property("xla", ("float32", "bfloat16"), 30, shapes=SHAPES[1:2])


@pytest.mark.parametrize("impl", ["pallas:triton", "pallas:tpu"])
def test_kernel_paths(impl):
  native = {"pallas:triton": "gpu", "pallas:tpu": "tpu"}[impl]
  if jax.default_backend() not in ("cpu", native):
    pytest.skip(f"{impl} runs on {native} or interpreted on a CPU")
  # One shape: after its first compile per dtype every example runs in milliseconds, natively
  # and interpreted alike (300 cases in ~8 s on the 2-core CPU).
  _property(impl, ("float32", "bfloat16"), 300, shapes=SHAPES[1:2])()


def dense_float64(q, ks, vs, sk, sv, levels, lens, causal, scale):
  """Float64 JAX attention over each sequence's whole context (segments gathered per sequence,
  then the suffix): no decomposition, no merge, no code shared with the library."""
  b, tq, hq, _ = q.shape
  hkv = sk.shape[2]
  keys, vals, masks = [], [], []
  for k, v, l in zip(ks, vs, levels):
    node = jnp.maximum(l.node_of_seq, 0)
    keys.append(k[node])
    vals.append(v[node])
    t = jnp.arange(k.shape[1])
    masks.append(jnp.broadcast_to(((t[None] < l.lengths[node][:, None])
                                   & (l.node_of_seq[:, None] >= 0))[:, None], (b, tq, len(t))))
  j = jnp.arange(sk.shape[1])[None, None]
  ok = j < lens[:, None, None]
  if causal:
    ok = ok & (j <= lens[:, None, None] - tq + jnp.arange(tq)[None, :, None])
  keys.append(sk)
  vals.append(sv)
  masks.append(jnp.broadcast_to(ok, (b, tq, sk.shape[1])))
  k, v, mask = (jnp.concatenate(x, axis=1 if x is not masks else 2)
                for x in (keys, vals, masks))
  k = jnp.repeat(k, hq // hkv, axis=2)
  v = jnp.repeat(v, hq // hkv, axis=2)
  s = scale * jnp.einsum("bthd,blhd->bthl", q, k)
  mask = mask[:, :, None, :]
  any_ = mask.any(-1)
  m = jnp.max(jnp.where(mask, s, -jnp.inf), -1)
  m = jax.lax.stop_gradient(jnp.where(any_, m, 0.0))
  e = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - m[..., None]), 0.0)
  den = jnp.where(any_, e.sum(-1), 1.0)
  out = jnp.einsum("bthl,blhd->bthd", e / den[..., None], v)
  return out, jnp.where(any_, m + jnp.log(den), -jnp.inf)


@settings(max_examples=4)
@given(data=st.data(), shape=st.sampled_from(SHAPES), seed=SEEDS)
def test_oracle_agrees_with_autodiff_of_float64_reference(data, shape, seed):
  """The NumPy gradient formula equals jax.grad of a float64 dense JAX attention (x64 on)."""
  c = draw_case(data.draw, np.random.default_rng(seed), shape, "float32")
  causal = shape[2]
  with jax.enable_x64(True):
    f64 = lambda x: jnp.asarray(np.asarray(x, np.float32), jnp.float64)
    levels = c["levels"]
    ref = lambda q, ks, vs, sk, sv: dense_float64(q, ks, vs, sk, sv, levels, c["lens"], causal,
                                                  c["scale"])
    # One program per example (eagerly, each operation compiled on its own for each shape).
    grads = small_jit(
        lambda q, ks, vs, sk, sv, do, dl: jax.vjp(ref, q, ks, vs, sk, sv)[1]((do, dl)))
    dq, dks, dvs, dsk, dsv = grads(f64(c["q"]), [f64(l.k) for l in levels],
                                   [f64(l.v) for l in levels], f64(c["sk"]), f64(c["sv"]),
                                   jnp.asarray(c["do64"]), jnp.asarray(c["dl64"]))
    assert dq.dtype == jnp.float64
  want_dq, want, _, _ = oracle_grads(c["q64"], c["do64"], c["dl64"], c["sources"],
                                     c["contexts"], list(c["lens64"]) if causal else None,
                                     c["scale"])
  got = {"suffix": (dsk, dsv), **{i: kv for i, kv in enumerate(zip(dks, dvs))}}
  assert rel_err(dq, want_dq) <= 1e-10
  for name, (dk, dv) in got.items():
    assert rel_err(dk, want[name][0].reshape(dk.shape)) <= 1e-10, name
    assert rel_err(dv, want[name][1].reshape(dv.shape)) <= 1e-10, name


def test_one_wrong_sequence_is_caught():
  """The per-sequence check rejects a gradient with one sequence 5% off, which a batch-wide
  relative norm at 16-bit tolerance passes."""
  rng = np.random.default_rng(3)
  want = rng.normal(size=(64, 2, 4, 16))
  got = want.copy()
  got[5] *= 1.05
  assert rel_err(got, want) <= tolerance("bfloat16")
  assert per_seq_err(got, want) > tolerance("bfloat16")
  assert per_seq_err(want, want) == 0.0


def test_primitives_and_prior_vjp_equal_autodiff_of_the_reference():
  """Each primitive alone (prefix, segments, suffix with and without a prior state) has the
  chunked VJP; it equals autodiff of the reference primitive, the prior's gradient included."""
  rng = np.random.default_rng(7)
  b, tq, hq, hkv, d, p, n, t, s = 3, 2, 4, 2, 16, 11, 2, 5, 6
  x = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, pk, pv, segk, segv, sk, sv = (x(b, tq, hq, d), x(p, hkv, d), x(p, hkv, d), x(n, t, hkv, d),
                                   x(n, t, hkv, d), x(b, s, hkv, d), x(b, s, hkv, d))
  prior = (x(b, tq, hq, d), x(b, tq, hq) + 1.0)
  prior = (prior[0], prior[1].at[0, 0, 0].set(-jnp.inf))
  seg_lens, nodes, lens = jnp.array([5, 0], jnp.int32), jnp.array([1, -1, 0], jnp.int32), \
      jnp.array([6, 2, 0], jnp.int32)
  ours = ops_lib.differentiable(ops_lib.XLA_OPS, bw.BackwardConfig(3, 4))
  calls = {  # name: (f(ops, *args), args)
      "prefix": (lambda o, q, k, v: o.prefix_attention(q, k, v, kv_length=jnp.int32(7),
                                                       scale=0.3), (q, pk, pv)),
      "segments": (lambda o, q, k, v: o.segment_attention(q, k, v, lengths=seg_lens,
                                                          node_of_seq=nodes, scale=0.3),
                   (q, segk, segv)),
      "suffix": (lambda o, q, k, v: o.suffix_attention(q, k, v, kv_lengths=lens, causal=True,
                                                       scale=0.3), (q, sk, sv)),
      "suffix+prior": (lambda o, q, k, v, po, pl: o.suffix_attention(
          q, k, v, kv_lengths=lens, causal=True, scale=0.3, prior=(po, pl)), (q, sk, sv, *prior)),
  }
  dout, dl = x(b, tq, hq, d), x(b, tq, hq)
  for name, (f, args) in calls.items():
    # One program each (eagerly, every operation would compile on its own).
    got, want = (jax.tree.leaves(small_jit(lambda *a, o=o: jax.vjp(functools.partial(f, o), *a)[1](
        (dout, dl)))(*args)) for o in (ours, ops_lib.XLA_OPS))
    for g, w in zip(got, want):
      assert np.isfinite(np.asarray(g)).all(), name
      assert rel_err(g, w) <= 1e-5, name
