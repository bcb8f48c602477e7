"""Score variants (ALiBi, soft-capping, sliding windows) on every public function, against a
float64 NumPy oracle of each sequence's whole context.

The oracle concatenates each sequence's context explicitly (its segments in level order, then
its own keys), puts its queries at the context's last Tq positions and applies the formulas
there, forward and gradient (written here, sharing no code with the library): it sees no
decomposition, so the split's positions, windows hiding whole levels and the merge are all
checked.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_shared_attn import (PagedLevel, SharedLevel, attention_with_lse, explain,
                             hierarchical_attention, paged_attention, shared_prefix_attention)
from jax_shared_attn import backward as bw
from jax_shared_attn import ops as ops_lib
from jax_shared_attn.testing import check_attention
from pallas_kernels import xla
from pallas_kernels.base import ScoreMods
from pallas_kernels.xla import XlaConfig
from strategies import DTYPES, SEEDS, count_case, lengths, rand, small_jit

# Static choices: each distinct one compiles a program, so they come from short lists.
SOFTCAPS = (0.7, 3.0)
WINDOWS = (0, 2, (1, 0), (4, 0), (3, 2), (9, 1))
COMBOS = ("alibi", "softcap", "window", "alibi+window", "softcap+window")
SMALL_TILES = XlaConfig(block_rows=3, block_keys=4)  # partial row and key blocks


def oracle(q, do, dl, sources, contexts, own, causal, scale, slopes=None, softcap=None,
           window=None):
  """Float64 attention with the variants, and its gradient, over explicit contexts.

  ``sources``: name -> (k, v) float64 ``[n, Hkv, D]``; ``contexts[b]``: sequence b's keys in
  context order as (name, index); its last ``own[b]`` keys are its own (``causal`` applies to
  them: every shared key is visible). Query t of sequence b sits at position ``C_b - Tq + t``
  (``C_b``: its context length), key c at c. ``slopes [B, Hq]``, ``softcap``, ``window =
  (left, right)``: None where off. ``do [B, Tq, Hq, D]``, ``dl [B, Tq, Hq]``: cotangents.
  Returns ``out, lse, dq``, name -> (dk, dv) and ``dslopes [B, Hq]``.
  """
  b, tq, hq, _ = q.shape
  out = np.zeros_like(q)
  lse = np.full((b, tq, hq), -np.inf)
  dq = np.zeros_like(q)
  grads = {n: (np.zeros_like(k), np.zeros_like(v)) for n, (k, v) in sources.items()}
  dslopes = np.zeros((b, hq))
  hkv = next(iter(sources.values()))[0].shape[1]
  g = hq // hkv
  for i in range(b):
    names = [n for n, _ in contexts[i]]
    idx = [j for _, j in contexts[i]]
    n_ctx = len(idx)
    if not n_ctx:
      continue
    k = np.stack([sources[n][0][j] for n, j in contexts[i]])
    v = np.stack([sources[n][1][j] for n, j in contexts[i]])
    kpos = np.arange(n_ctx)
    for t in range(tq):
      qpos = n_ctx - tq + t
      vis = np.ones(n_ctx, bool)
      if causal:
        vis &= (kpos < n_ctx - own[i]) | (kpos <= qpos)
      if window is not None:
        vis &= (kpos >= qpos - window[0]) & (kpos <= qpos + window[1])
      if not vis.any():
        continue
      for h in range(hq):
        kk, vv = k[vis, h // g], v[vis, h // g]
        s = scale * (kk @ q[i, t, h])
        dcap = 1.0
        if softcap is not None:
          th = np.tanh(s / softcap)
          s, dcap = softcap * th, 1 - th ** 2
        if slopes is not None:
          s = s - slopes[i, h] * (qpos - kpos[vis])
        m = s.max()
        p = np.exp(s - m)
        lse[i, t, h] = m + np.log(p.sum())
        p /= p.sum()
        o = p @ vv
        out[i, t, h] = o
        ds = p * (vv @ do[i, t, h] - do[i, t, h] @ o + dl[i, t, h])
        dslopes[i, h] -= ds @ (qpos - kpos[vis])
        ds = ds * dcap
        dq[i, t, h] = scale * ds @ kk
        for c, j in enumerate(np.flatnonzero(vis)):
          grads[names[j]][0][idx[j], h // g] += scale * ds[c] * q[i, t, h]
          grads[names[j]][1][idx[j], h // g] += p[c] * do[i, t, h]
  return out, lse, dq, grads, dslopes


def per_seq_err(x, ref):
  """Worst per-sequence relative error, each against max(its own norm, the batch's RMS norm)."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  if np.isnan(x).any():
    return np.inf
  x, ref = x.reshape(len(x), -1), ref.reshape(len(ref), -1)
  norms = np.sqrt((ref ** 2).sum(1))
  floor = max(np.sqrt(np.mean(norms ** 2)), 1e-30)
  return float((np.sqrt(((x - ref) ** 2).sum(1)) / np.maximum(norms, floor)).max(initial=0.0))


GRAD_TOL = 1e-5  # float32 inputs (jax_shared_attn.testing.tolerance)


def variant_kwargs(draw, rng, combo, b, hq):
  """The public keywords of ``combo`` and the oracle's ``slopes [B, Hq]``."""
  kw, slopes = {}, None
  if "alibi" in combo:
    per_seq = draw(st.booleans())
    slopes = rng.uniform(-0.5, 1.0, size=(b, hq) if per_seq else (hq,)).astype(np.float32)
    kw["alibi_slopes"] = jnp.asarray(slopes)
    slopes = np.broadcast_to(slopes, (b, hq)).astype(np.float64)
  if "softcap" in combo:
    kw["softcap"] = draw(st.sampled_from(SOFTCAPS))
  if "window" in combo:
    kw["local_window_size"] = draw(st.sampled_from(WINDOWS))
  return kw, slopes


def oracle_kwargs(kw, slopes):
  window = kw.get("local_window_size")
  if isinstance(window, int):
    window = (window, window)
  return dict(slopes=slopes, softcap=kw.get("softcap"), window=window)


def draw_tree(draw, rng, b, tq, hq, hkv, d, s, structure):
  """Random levels (``(N, T, all_share)`` each; -1: a sequence without a segment there),
  suffixes, cotangents, and the oracle's view of them (sources, contexts, own lengths)."""
  q, q64 = rand(rng, (b, tq, hq, d), "float32")
  sk, sk64 = rand(rng, (b, s, hkv, d), "float32")
  sv, sv64 = rand(rng, (b, s, hkv, d), "float32")
  lens = lengths(draw, b, s)
  sources = {"suffix": (sk64.reshape(b * s, hkv, d), sv64.reshape(b * s, hkv, d))}
  contexts = [[] for _ in range(b)]
  levels = []
  for lvl, (n, t, all_share) in enumerate(structure):
    k, k64 = rand(rng, (n, t, hkv, d), "float32")
    v, v64 = rand(rng, (n, t, hkv, d), "float32")
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
  do, do64 = rand(rng, (b, tq, hq, d), "float32")
  dl = rng.normal(size=(b, tq, hq))
  return dict(q=q, q64=q64, sk=sk, sv=sv, lens=lens, levels=levels, do=do, do64=do64,
              dl=jnp.asarray(dl, jnp.float32), dl64=dl, sources=sources, contexts=contexts)


def check_grads(got, want_dq, want, c, part_names, dslopes=None, want_dslopes=None):
  """``got = (dq, [(dk, dv) per part name])`` against the oracle, per sequence (a shared
  part's gradient per segment row); ``dslopes`` (``[Hq]`` or ``[B, Hq]``, as the slopes given)
  against the oracle's ``[B, Hq]``."""
  dq, parts = got
  errs = {"dq": per_seq_err(dq, want_dq)}
  if dslopes is not None:
    want_dslopes = want_dslopes if dslopes.ndim == 2 else want_dslopes.sum(0, keepdims=True)
    errs["dslopes"] = per_seq_err(np.reshape(dslopes, want_dslopes.shape), want_dslopes)
  for name, (dk, dv) in zip(part_names, parts):
    errs[f"dk[{name}]"] = per_seq_err(dk, want[name][0].reshape(dk.shape))
    errs[f"dv[{name}]"] = per_seq_err(dv, want[name][1].reshape(dv.shape))
  bad = {k: e for k, e in errs.items() if not e <= GRAD_TOL}
  assert not bad, bad


@functools.lru_cache(maxsize=None)
def tree_vjp(causal, static):
  """Jitted ``(q, levels, sk, sv, lens, slopes, do, dl) -> ((out, lse), grads)`` of
  ``hierarchical_attention`` with the variants ``static`` (softcap, window) and small tiles."""
  static = dict(static)

  def run(q, levels, sk, sv, lens, slopes, do, dl):
    def f(q, ks, vs, sk, sv, slopes):
      lv = [SharedLevel(k, v, l.lengths, l.node_of_seq, l.all_share)
            for k, v, l in zip(ks, vs, levels)]
      return hierarchical_attention(q, lv, sk, sv, suffix_lengths=lens, causal=causal,
                                    return_lse=True, config=SMALL_TILES, alibi_slopes=slopes,
                                    **static)

    res, pull = jax.vjp(f, q, [l.k for l in levels], [l.v for l in levels], sk, sv, slopes)
    return res, pull((do, dl))

  return small_jit(run)


def static_of(kw):
  return tuple(sorted((k, v) for k, v in kw.items() if k != "alibi_slopes"))


# ((B, Tq, Hq, Hkv, D, S), levels as ((N, T, all_share), ...)): a shared prefix and a level of
# several segments (some sequences without one), GQA, Tq > 1; windows of a few tokens hide
# whole levels from some queries.
TREE_SHAPES = (
    ((4, 2, 4, 2, 16, 6), ((1, 7, True), (3, 5, False))),
    ((3, 3, 2, 1, 16, 4), ((2, 6, False),)),
)


def check_tree_vjp(vjp, draw, rng, causal, combo, shape, structure):
  """Draws a tree of ``structure`` and the variants of ``combo``, runs ``vjp`` (a
  :func:`tree_vjp`-like builder) and checks its outputs, LSE and gradients (the slopes' too)
  against the float64 oracle."""
  b, tq, hq, hkv, d, s = shape
  c = draw_tree(draw, rng, b, tq, hq, hkv, d, s, structure)
  kw, slopes = variant_kwargs(draw, rng, combo, b, hq)
  (out, lse), (dq, dks, dvs, dsk, dsv, dslopes) = vjp(causal, static_of(kw))(
      c["q"], c["levels"], c["sk"], c["sv"], jnp.asarray(c["lens"]), kw.get("alibi_slopes"),
      c["do"], c["dl"])
  want_out, want_lse, want_dq, want, want_dslopes = oracle(
      c["q64"], c["do64"], c["dl64"], c["sources"], c["contexts"], c["lens"], causal,
      d ** -0.5, **oracle_kwargs(kw, slopes))
  check_attention(out, lse, want_out, want_lse, "float32")
  names = ["suffix"] + list(range(len(structure)))
  check_grads((dq, [(dsk, dsv)] + list(zip(dks, dvs))), want_dq, want, c, names, dslopes,
              want_dslopes)


@settings(max_examples=8)
@given(data=st.data(), seed=SEEDS, causal=st.booleans(), combo=st.sampled_from(COMBOS),
       shape=st.sampled_from(TREE_SHAPES))
def test_hierarchical_attention(data, seed, causal, combo, shape):
  count_case("variants hierarchical_attention")
  rng = np.random.default_rng(seed)
  check_tree_vjp(tree_vjp, data.draw, rng, causal, combo, *shape)


@functools.lru_cache(maxsize=None)
def small_tiles_vjp(causal, static):
  """:func:`tree_vjp` through the differentiable XLA ops with small forward and backward tiles
  (several row and key blocks per part, the last moved back to fit)."""
  static = dict(static)
  window = static.get("local_window_size")
  shared = ops_lib.differentiable(
      xla.get_ops(SMALL_TILES),
      bw.BackwardConfig(block_rows=6, block_keys=4, kernels="xla")).shared_attention

  def run(q, levels, sk, sv, lens, slopes, do, dl):
    def f(q, ks, vs, sk, sv, slopes):
      parts = [("segments", k, v, l.lengths, l.node_of_seq) for k, v, l in zip(ks, vs, levels)]
      mods = ScoreMods(alibi_slopes=None if slopes is None else jnp.broadcast_to(
          slopes, (q.shape[0], q.shape[2])), softcap=static.get("softcap"),
          window=(window, window) if isinstance(window, int) else window)
      return shared(q, parts, sk, sv, kv_lengths=lens, causal=causal, scale=q.shape[-1] ** -0.5,
                    mods=mods)

    res, pull = jax.vjp(f, q, [l.k for l in levels], [l.v for l in levels], sk, sv, slopes)
    return res, pull((do, dl))

  return small_jit(run)


@settings(max_examples=5)
@given(data=st.data(), seed=SEEDS, causal=st.booleans(), combo=st.sampled_from(COMBOS))
def test_backward_small_tiles(data, seed, causal, combo):
  """The tiled forward and backward with several tiles per part (rows of a block that an
  earlier block holds, keys of a block moved back), gradients of the slopes included."""
  count_case("variants backward (6 x 4 tiles)")
  rng = np.random.default_rng(seed)
  check_tree_vjp(small_tiles_vjp, data.draw, rng, causal, combo, (5, 3, 4, 2, 16, 7),
                 ((1, 9, False), (3, 5, False)))


@functools.lru_cache(maxsize=None)
def prefix_vjp(causal, static):
  static = dict(static)

  def run(q, pk, pv, plen, sk, sv, lens, slopes, do, dl):
    f = lambda q, pk, pv, sk, sv, slopes: shared_prefix_attention(
        q, pk, pv, sk, sv, prefix_length=plen, suffix_lengths=lens, causal=causal,
        return_lse=True, alibi_slopes=slopes, **static)
    res, pull = jax.vjp(f, q, pk, pv, sk, sv, slopes)
    return res, pull((do, dl))

  return small_jit(run)


@settings(max_examples=8)
@given(data=st.data(), seed=SEEDS, causal=st.booleans(), combo=st.sampled_from(COMBOS))
def test_shared_prefix_attention(data, seed, causal, combo):
  count_case("variants shared_prefix_attention")
  rng = np.random.default_rng(seed)
  b, tq, hq, hkv, d, s, p = 3, 2, 4, 1, 16, 5, 9
  c = draw_tree(data.draw, rng, b, tq, hq, hkv, d, s, ((1, p, True),))
  level = c["levels"][0]
  kw, slopes = variant_kwargs(data.draw, rng, combo, b, hq)
  (out, lse), (dq, dpk, dpv, dsk, dsv, dslopes) = prefix_vjp(causal, static_of(kw))(
      c["q"], level.k[0], level.v[0], level.lengths[0], c["sk"], c["sv"],
      jnp.asarray(c["lens"]), kw.get("alibi_slopes"), c["do"], c["dl"])
  want_out, want_lse, want_dq, want, want_dslopes = oracle(
      c["q64"], c["do64"], c["dl64"], c["sources"], c["contexts"], c["lens"], causal,
      d ** -0.5, **oracle_kwargs(kw, slopes))
  check_attention(out, lse, want_out, want_lse, "float32")
  check_grads((dq, [(dsk, dsv), (dpk, dpv)]), want_dq, want, c, ["suffix", 0], dslopes,
              want_dslopes)


@functools.lru_cache(maxsize=None)
def full_vjp(causal, static):
  static = dict(static)

  def run(q, k, v, lens, slopes, do, dl):
    f = lambda q, k, v, slopes: attention_with_lse(q, k, v, kv_lengths=lens, causal=causal,
                                                   config=SMALL_TILES, alibi_slopes=slopes,
                                                   **static)
    res, pull = jax.vjp(f, q, k, v, slopes)
    return res, pull((do, dl))

  return small_jit(run)


@settings(max_examples=8)
@given(data=st.data(), seed=SEEDS, causal=st.booleans(), combo=st.sampled_from(COMBOS))
def test_attention_with_lse(data, seed, causal, combo):
  count_case("variants attention_with_lse")
  rng = np.random.default_rng(seed)
  b, tq, hq, hkv, d, tk = 3, 3, 4, 2, 16, 7  # Tq > some kv_lengths: queries before key 0
  c = draw_tree(data.draw, rng, b, tq, hq, hkv, d, tk, ())
  kw, slopes = variant_kwargs(data.draw, rng, combo, b, hq)
  (out, lse), (dq, dk, dv, dslopes) = full_vjp(causal, static_of(kw))(
      c["q"], c["sk"], c["sv"], jnp.asarray(c["lens"]), kw.get("alibi_slopes"), c["do"],
      c["dl"])
  want_out, want_lse, want_dq, want, want_dslopes = oracle(
      c["q64"], c["do64"], c["dl64"], c["sources"], c["contexts"], c["lens"], causal,
      d ** -0.5, **oracle_kwargs(kw, slopes))
  check_attention(out, lse, want_out, want_lse, "float32")
  check_grads((dq, [(dk, dv)]), want_dq, want, c, ["suffix"], dslopes, want_dslopes)


@functools.lru_cache(maxsize=None)
def paged_fn(causal, static):
  static = dict(static)

  def run(q, k_pages, v_pages, table, lens, levels, slopes):
    kw = dict(static, **({} if slopes is None else {"alibi_slopes": slopes}))
    return paged_attention(q, k_pages, v_pages, table, lens, levels=levels, causal=causal,
                           return_lse=True, **kw)

  return small_jit(run)


@settings(max_examples=6)
@given(data=st.data(), seed=SEEDS, causal=st.booleans(), combo=st.sampled_from(COMBOS),
       dtype=st.sampled_from(DTYPES))
def test_paged_attention(data, seed, causal, combo, dtype):
  """Forward (``paged_attention`` has no backward): two levels and own pages in one pool, in
  every input dtype."""
  count_case("variants paged_attention")
  rng = np.random.default_rng(seed)
  draw = data.draw
  b, tq, hq, hkv, d, ps, pages = 3, 2, 4, 2, 16, 3, 16
  q, q64 = rand(rng, (b, tq, hq, d), dtype)
  kp, kp64 = rand(rng, (pages, ps, hkv, d), dtype)
  vp, vp64 = rand(rng, (pages, ps, hkv, d), dtype)
  order = iter(rng.permutation(pages))
  take = lambda n, p: np.array([[next(order) for _ in range(p)] for _ in range(n)], np.int32)
  contexts = [[] for _ in range(b)]

  def add(i, row, n):
    contexts[i] += [("pool", row[j // ps] * ps + j % ps) for j in range(n)]

  levels = []
  for n_seg, n_pages in ((1, 2), (2, 1)):
    table = take(n_seg, n_pages)
    seg_lens = lengths(draw, n_seg, n_pages * ps)
    nodes = np.array([draw(st.integers(-1, n_seg - 1)) for _ in range(b)], np.int32)
    levels.append(PagedLevel(jnp.asarray(table), jnp.asarray(seg_lens), jnp.asarray(nodes)))
    for i, node in enumerate(nodes):
      if node >= 0:
        add(i, table[node], seg_lens[node])
  own = take(b, 2)
  lens = lengths(draw, b, 2 * ps)
  for i in range(b):
    add(i, own[i], lens[i])
  kw, slopes = variant_kwargs(draw, rng, combo, b, hq)
  out, lse = paged_fn(causal, static_of(kw))(q, kp, vp, jnp.asarray(own), jnp.asarray(lens),
                                             levels, kw.get("alibi_slopes"))
  sources = {"pool": (kp64.reshape(-1, hkv, d), vp64.reshape(-1, hkv, d))}
  zeros = np.zeros((b, tq, hq, d))
  want_out, want_lse, _, _, _ = oracle(q64, zeros, zeros[..., 0], sources, contexts, lens, causal,
                                    d ** -0.5, **oracle_kwargs(kw, slopes))
  assert out.dtype == q.dtype
  check_attention(out, lse, want_out, want_lse, dtype)


@pytest.mark.parametrize("variants", [dict(softcap=0.8), dict(window=(2, 1)), dict(alibi=True),
                                      dict(alibi=True, softcap=1.5, window=(3, 0))])
def test_oracle_gradient_is_its_forward_derivative(variants):
  """The oracle's gradient formula (softcap's 1 - tanh^2, the slopes' -sum dS (i - j)) equals
  central differences of its own forward along random directions, in float64."""
  rng = np.random.default_rng(7)
  b, tq, hq, hkv, d = 2, 3, 4, 2, 8
  q = rng.normal(size=(b, tq, hq, d))
  sources = {"a": (rng.normal(size=(6, hkv, d)), rng.normal(size=(6, hkv, d))),
             "s": (rng.normal(size=(8, hkv, d)), rng.normal(size=(8, hkv, d)))}
  contexts = [[("a", j) for j in range(5)] + [("s", j) for j in range(4)],
              [("a", j) for j in (0, 1)] + [("s", 4 + j) for j in range(3)]]
  own = [4, 3]
  do, dl = rng.normal(size=q.shape), rng.normal(size=q.shape[:3])
  slopes = rng.uniform(-0.5, 1.0, size=(b, hq)) if variants.get("alibi") else None
  kw = dict(softcap=variants.get("softcap"), window=variants.get("window"))

  def loss(q, sources, slopes):
    out, lse, *_ = oracle(q, do, dl, sources, contexts, own, True, 0.4, slopes, **kw)
    return float((out * do).sum() + np.where(np.isfinite(lse), lse * dl, 0.0).sum())

  _, _, dq, grads, dslopes = oracle(q, do, dl, sources, contexts, own, True, 0.4, slopes, **kw)
  dirs = (rng.normal(size=q.shape), {n: tuple(rng.normal(size=x.shape) for x in kv)
                                     for n, kv in sources.items()},
          None if slopes is None else rng.normal(size=slopes.shape))
  eps = 1e-6

  def at(sign):
    move = lambda x, dx: x + sign * eps * dx
    return loss(move(q, dirs[0]),
                {n: tuple(move(x, dx) for x, dx in zip(kv, dirs[1][n]))
                 for n, kv in sources.items()},
                None if slopes is None else move(slopes, dirs[2]))

  numeric = (at(1) - at(-1)) / (2 * eps)
  analytic = (dq * dirs[0]).sum() + sum((g * dx).sum() for n in sources
                                        for g, dx in zip(grads[n], dirs[1][n]))
  if slopes is not None:
    analytic += (dslopes * dirs[2]).sum()
  assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (numeric, analytic)


def test_window_hiding_a_level_gives_no_nan_and_empty_rows_minus_inf():
  """A window that hides the shared prefix from every query: the prefix contributes nothing;
  a query with no key in its window gets out 0 and lse -inf (non-causal, before key 0)."""
  rng = np.random.default_rng(0)
  q, _ = rand(rng, (2, 3, 2, 16), "float32")
  pk, _ = rand(rng, (8, 1, 16), "float32")
  sk, _ = rand(rng, (2, 5, 1, 16), "float32")
  lens = jnp.asarray([5, 4], jnp.int32)


  def run(q, pk, sk):
    got = shared_prefix_attention(q, pk, pk, sk, sk, suffix_lengths=lens,
                                  local_window_size=(1, 0), return_lse=True)
    alone = attention_with_lse(q, sk, sk, kv_lengths=lens, causal=True,
                               local_window_size=(1, 0))
    empty = attention_with_lse(q, sk, sk, kv_lengths=jnp.asarray([1, 0], jnp.int32),
                               local_window_size=0)
    return got, alone, empty

  got, alone, (out, lse) = small_jit(run)(q, pk, sk)
  np.testing.assert_allclose(got[0], alone[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], alone[1], rtol=1e-6)
  assert np.isneginf(lse[0, :2]).all() and np.isfinite(lse[0, 2]).all()
  assert np.isneginf(lse[1]).all() and not np.isnan(out).any()
  assert not np.asarray(out[0, :2]).any() and not np.asarray(out[1]).any()


def call_prefix(**kw):
  rng = np.random.default_rng(1)
  q, _ = rand(rng, (2, 1, 4, 16), "float32")
  pk, _ = rand(rng, (5, 2, 16), "float32")
  sk, _ = rand(rng, (2, 3, 2, 16), "float32")
  return shared_prefix_attention(q, pk, pk, sk, sk, **kw)


@pytest.mark.parametrize("kw, error, message", [
    (dict(alibi_slopes=jnp.ones((3,), jnp.float32)), ValueError,
     r"alibi_slopes must have shape \[4\] \(Hq\) or \[2, 4\] \(B, Hq\); got \[3\]"),
    (dict(alibi_slopes=jnp.ones((4,), jnp.int32)), TypeError,
     "alibi_slopes must have dtype float32"),
    (dict(alibi_slopes=jnp.ones((4,), jnp.bfloat16)), TypeError,
     "alibi_slopes must have dtype float32"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a float32 array"),
    (dict(alibi_slopes=jnp.asarray([0.5, np.nan, 0.1, 0.2], jnp.float32)), ValueError,
     "alibi_slopes must be finite"),
    (dict(alibi_slopes=jnp.full((2, 4), np.inf, jnp.float32)), ValueError,
     "alibi_slopes must be finite"),
    (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0; got 0.0"),
    (dict(softcap=-2.0), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap="30"), TypeError, "softcap must be a Python float > 0 or None"),
    (dict(softcap=True), TypeError, "softcap must be a Python float > 0 or None"),
    (dict(softcap=jnp.float32(30.0)), TypeError, "softcap must be a Python float"),
    (dict(local_window_size=-1), ValueError, "local_window_size must be >= 0"),
    (dict(local_window_size=(3, -2)), ValueError, "local_window_size must be >= 0"),
    (dict(local_window_size=(3, 1, 2)), ValueError,
     "local_window_size must be an int or a \\(left, right\\) pair; got 3 values"),
    (dict(local_window_size=2.5), TypeError, "local_window_size must be an int or a"),
    (dict(local_window_size=(1, 2.0)), TypeError, "local_window_size must be an int or a"),
    (dict(local_window_size=True), TypeError, "local_window_size must be an int or a"),
    (dict(softcap=5.0, impl="pallas:mosaic_gpu"), ValueError,
     "softcap run on the xla kernels, the triton kernels and the tpu kernels only; "
     "impl='pallas:mosaic_gpu' "
     ".*impl='auto', 'xla'"),
])
def test_bad_variants_name_the_argument(kw, error, message):
  with pytest.raises(error, match=message):
    call_prefix(**kw)


def test_every_function_checks_the_variants():
  rng = np.random.default_rng(2)
  q, _ = rand(rng, (2, 1, 4, 16), "float32")
  k, _ = rand(rng, (2, 3, 2, 16), "float32")
  pages, _ = rand(rng, (4, 2, 2, 16), "float32")
  table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
  calls = {
      "attention_with_lse": lambda **kw: attention_with_lse(q, k, k, **kw),
      "hierarchical_attention": lambda **kw: hierarchical_attention(q, [], k, k, **kw),
      "paged_attention": lambda **kw: paged_attention(q, pages, pages, table,
                                                      jnp.asarray([3, 4], jnp.int32), **kw),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match=f"{name}: softcap must be a finite number"):
      call(softcap=-1.0)
    with pytest.raises(ValueError, match=rf"{name}: alibi_slopes must have shape"):
      call(alibi_slopes=jnp.ones((2, 2), jnp.float32))
    with pytest.raises(ValueError, match=f"{name}: local_window_size run on the xla kernels"):
      call(local_window_size=4, impl="pallas:mosaic_gpu")


def test_traced_slopes_are_not_checked_for_finiteness_but_run():
  rng = np.random.default_rng(3)
  q, _ = rand(rng, (1, 1, 2, 16), "float32")
  k, _ = rand(rng, (1, 4, 1, 16), "float32")
  run = jax.jit(lambda s: attention_with_lse(q, k, k, alibi_slopes=s)[0])
  assert np.isfinite(run(jnp.asarray([0.5, 0.25], jnp.float32))).all()


def test_explain_plans_variants_under_auto():
  """``impl="auto"``: the Triton kernels on a GPU, the XLA path on a CPU and a TPU; the backward
  is the XLA one everywhere."""
  rng = np.random.default_rng(4)
  q, _ = rand(rng, (2, 1, 4, 16), "float32")
  pk, _ = rand(rng, (5, 2, 16), "float32")
  sk, _ = rand(rng, (2, 3, 2, 16), "float32")
  args = (shared_prefix_attention, q, pk, pk, sk, sk)
  # (explicit kernel impls: tests/kernels/test_kernel_variants.py)
  for platform, kind in (("cpu", None), ("gpu", "NVIDIA H100 80GB HBM3"), ("tpu", "TPU v5 lite")):
    plan = explain(*args, platform=platform, device_kind=kind, softcap=50.0,
                   local_window_size=(7, 0), alibi_slopes=jnp.ones((4,), jnp.float32))
    assert plan.impl == ("pallas:triton" if platform == "gpu" else "xla"), plan
    assert plan.backward == "xla", plan
    text = str(plan)
    assert ("the Triton kernels" if platform == "gpu" else "on the XLA path") in text, text
    assert "alibi_slopes [2, 4], softcap=50.0, local_window_size=(7, 0)" in text, text
    # without variants the plan is the family's own
    plain = explain(*args, platform=platform, device_kind=kind)
    assert "variants" not in str(plain)
    assert plain.impl == ("xla" if platform == "cpu" else plain.impl)
  assert explain(*args, platform="gpu", device_kind="NVIDIA H100 80GB HBM3").impl != "xla"


def test_window_convention_matches_jax_dot_product_attention():
  """``local_window_size`` means what it means in ``jax.nn.dot_product_attention``."""
  rng = np.random.default_rng(5)
  q, _ = rand(rng, (2, 6, 4, 16), "float32")
  k, _ = rand(rng, (2, 6, 2, 16), "float32")
  v, _ = rand(rng, (2, 6, 2, 16), "float32")
  cases = (((2, 1), False), ((3, 0), True), (1, False))

  def run(q, k, v):
    return [(jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window),
             attention_with_lse(q, k, v, causal=causal, local_window_size=window)[0])
            for window, causal in cases]

  with jax.default_matmul_precision("highest"):  # float32 products on a GPU too (no TF32)
    results = small_jit(run)(q, k, v)
  for want, got in results:
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_sharded_calls_split_the_slopes_with_the_heads():
  """``sharded`` passes the variants on (slopes split as the query heads are); on this
  process's mesh the result equals the unsharded call."""
  from jax.sharding import Mesh

  from jax_shared_attn.sharding import sharded
  rng = np.random.default_rng(6)
  q, _ = rand(rng, (2, 2, 4, 16), "float32")
  pk, _ = rand(rng, (5, 2, 16), "float32")
  sk, _ = rand(rng, (2, 3, 2, 16), "float32")
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  kw = dict(alibi_slopes=jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32), softcap=2.0,
            local_window_size=(3, 0), return_lse=True)
  got, want = small_jit(lambda *a: (sharded(shared_prefix_attention, mesh)(*a, **kw),
                                     shared_prefix_attention(*a, **kw)))(q, pk, pk, sk, sk)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
  with pytest.raises(ValueError, match="shared_prefix_attention: alibi_slopes must be finite"):
    sharded(shared_prefix_attention, mesh)(q, pk, pk, sk, sk,
                                           alibi_slopes=jnp.full((4,), np.nan, jnp.float32))


def test_eager_sharded_calls_of_one_structure_compile_once():
  """Called eagerly, ``sharded`` reuses the program of a call of the same structure: fresh
  arrays of the same shapes compile nothing, and give the unsharded call's results."""
  from jax.sharding import Mesh

  from jax_shared_attn.sharding import sharded
  from models.bench.common import counting_compiles
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  fn = sharded(shared_prefix_attention, mesh)
  for seed in range(3):
    rng = np.random.default_rng(seed)
    q, _ = rand(rng, (2, 2, 4, 16), "float32")
    pk, _ = rand(rng, (5, 2, 16), "float32")
    sk, _ = rand(rng, (2, 3, 2, 16), "float32")
    with counting_compiles() as compiles:
      got = sharded(shared_prefix_attention, mesh)(q, pk, pk, sk, sk, softcap=2.0)
      again = fn(q, pk, pk, sk, sk, softcap=2.0)
    if seed:
      assert compiles == []  # seed 0's program, reused
    want = shared_prefix_attention(q, pk, pk, sk, sk, softcap=2.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(again, got)
