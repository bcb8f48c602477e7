"""The one-kernel decode path's step plans, emulated on the CPU in float64.

The Mosaic GPU kernel (``pallas_kernels.gpu.shared_mgpu``) has no interpret mode (its
native tests run on an H100 through the device tool). What decides correctness beyond the
arithmetic of each step is the plan (``pallas_kernels.gpu.shared_mgpu_plan``, which this
file mirrors): which keys each CTA split and warpgroup visits (prefix blocks, sequences, key
blocks) and how the parts are merged. These tests run the kernel's own plan functions
(``step_ranges``, ``is_suffix``, ``prefix_block``, ``suffix_step``) step by step over float64
arrays, with the kernel's masks and online softmax, and compare the merged result with full
attention; and they check the kernel's barrier protocol (``arrivals``, ``waits``), whose
mistakes hang the GPU instead of giving a wrong number.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import shared_mgpu_plan as fp

H100 = DeviceInfo.named("NVIDIA H100 80GB HBM3")
BLOCK_Q = 64  # rows per consumer warpgroup, as in the kernel
CTA_ROWS = 2 * BLOCK_Q


def ranges(kv_len, max_len, split, cta, *, n_pre, block_kv, block_s, seqs_per_wg, splits,
           spread, ctas):
  return fp.step_ranges(jnp.int32(kv_len), jnp.int32(max_len), jnp.int32(split), jnp.int32(cta),
                        prefix_blocks=n_pre, block_kv=block_kv, block_s=block_s,
                        seqs_per_wg=seqs_per_wg, splits=splits, spread=spread, ctas=ctas)


def walk(rg):
  """The kernel's local steps of one split in order: ("prefix", block, masked) or ("suffix",)."""
  o, n_s, n_pf, steps = (int(x) for x in (rg.o, rg.n_s, rg.n_pf, rg.steps))
  out = []
  for i in range(steps):
    if bool(fp.is_suffix(jnp.int32(i), rg)):
      assert o <= i < o + n_s
      out.append(("suffix",))
    else:
      out.append(("prefix", int(fp.prefix_block(jnp.int32(i), rg)), i >= n_s + n_pf))
  return out


def emulate(q, pk, pv, sk, sv, kv_len, lens, *, m, splits, block_kv, block_s, spread=True):
  """q [R, D] (rows b * m + g of one KV head, R a multiple of 128), prefix [P, D], suffixes
  [B, S, D]. Returns the parts as the kernel writes them: a list of (out [R, D], lse [R])."""
  r, d = q.shape
  batch = sk.shape[0]
  seqs_per_wg = BLOCK_Q // m
  tiles = r // CTA_ROWS
  parts = []
  for split in range(splits):
    pre_out, pre_lse = np.zeros((r, d)), np.full(r, -np.inf)
    suf_out, suf_lse = np.zeros((r, d)), np.full(r, -np.inf)
    for tile in range(tiles):
      seq0 = tile * 2 * seqs_per_wg
      tile_lens = [lens[s] if s < batch else 0 for s in range(seq0, seq0 + 2 * seqs_per_wg)]
      rg = ranges(kv_len, max(tile_lens), split, tile * splits + split,
                  n_pre=pk.shape[0] // block_kv, block_kv=block_kv, block_s=block_s,
                  seqs_per_wg=seqs_per_wg, splits=splits, spread=spread, ctas=tiles * splits)
      steps, o, n_s = (int(x) for x in (rg.steps, rg.o, rg.n_s))
      plan = walk(rg)
      for w in (0, 1):
        base = tile * CTA_ROWS + w * BLOCK_Q
        rows = q[base:base + BLOCK_Q]
        # The prefix part: this split's prefix blocks, rows against keys < kv_len (only the
        # masked block may hold keys past it).
        keys = []
        for step in plan:
          if step[0] == "prefix":
            _, blk, masked = step
            block = range(blk * block_kv, (blk + 1) * block_kv)
            assert masked or block[-1] < kv_len
            keys += [k for k in block if k < kv_len]
        if keys:
          s = rows @ pk[keys].T
          mx = s.max(1, keepdims=True)
          p = np.exp(s - mx)
          pre_out[base:base + BLOCK_Q] = p @ pv[keys] / p.sum(1, keepdims=True)
          pre_lse[base:base + BLOCK_Q] = (mx[:, 0] + np.log(p.sum(1)))
        # The suffix part, step by step: the warpgroup's 64 rows, other sequences' rows masked.
        acc, m_i, l_i = np.zeros((BLOCK_Q, d)), np.full(BLOCK_Q, -np.inf), np.zeros(BLOCK_Q)
        for i in range(o, o + n_s):
          j, blk = (int(x) for x in fp.suffix_step(jnp.int32(i), rg))
          seq = seq0 + w * seqs_per_wg + j
          n_valid = lens[seq] if seq < batch else 0
          kb = np.arange(blk * block_s, (blk + 1) * block_s)
          s = rows @ sk[min(seq, batch - 1)][kb].T
          own = (np.arange(BLOCK_Q) // m == j)[:, None] & (kb < n_valid)[None, :]
          s = np.where(own, s, -np.inf)
          m_new = np.maximum(m_i, s.max(1))
          m_use = np.where(np.isneginf(m_new), 0.0, m_new)
          alpha = np.exp(m_i - m_use)
          p = np.exp(s - m_use[:, None])
          l_i = l_i * alpha + p.sum(1)
          acc = acc * alpha[:, None] + p @ sv[min(seq, batch - 1)][kb]
          m_i = m_new
        has = l_i > 0
        safe = np.where(has, l_i, 1.0)
        suf_out[base:base + BLOCK_Q] = acc / safe[:, None]
        suf_lse[base:base + BLOCK_Q] = np.where(has, m_i + np.log(safe), -np.inf)
    parts += [(pre_out, pre_lse), (suf_out, suf_lse)]
  return parts


def merge(parts):
  lses = np.stack([l for _, l in parts])
  top = lses.max(0)
  top = np.where(np.isneginf(top), 0.0, top)
  w = np.exp(lses - top)
  den = w.sum(0)
  out = sum(wi[:, None] * o for wi, (o, _) in zip(w, parts)) / np.where(den > 0, den, 1)[:, None]
  return out, np.where(den > 0, top + np.log(np.where(den > 0, den, 1)), -np.inf)


BLOCK_KV, BLOCK_S = 8, 4  # the kernel's 128 and 64, scaled down


def draw_case(data, rows_per_seq, splits):
  """A random case: G, batch, splits, a prefix of whole blocks with any valid length, suffixes
  of a capacity of whole blocks with lengths 0, 1, the capacity or any (float64, D = 8)."""
  m = data.draw(st.sampled_from(rows_per_seq), label="G")
  batch = data.draw(st.integers(1, 3 * (CTA_ROWS // m)), label="batch")
  n_splits = data.draw(st.sampled_from(splits), label="splits")
  p = BLOCK_KV * data.draw(st.integers(1, 4), label="prefix blocks")
  cap = BLOCK_S * data.draw(st.integers(1, 3), label="suffix blocks")
  kv_len = data.draw(st.sampled_from([0, 1, p]) | st.integers(0, p), label="kv_len")
  lens = data.draw(st.lists(st.sampled_from([0, 1, cap]) | st.integers(0, cap),
                            min_size=batch, max_size=batch), label="lens")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
  d = 8
  r = -(-batch * m // CTA_ROWS) * CTA_ROWS
  q = rng.standard_normal((r, d))
  pk, pv = rng.standard_normal((2, p, d))
  sk, sv = rng.standard_normal((2, batch, cap, d))
  return m, n_splits, (q, pk, pv, sk, sv, kv_len, lens)


def check_full_attention(parts, m, q, pk, pv, sk, sv, kv_len, lens):
  """The merged parts equal full attention over the prefix and each row's own suffix."""
  out, lse = merge(parts)
  for row in range(len(lens) * m):
    b = row // m
    keys = np.concatenate([pk[:kv_len], sk[b, :lens[b]]])
    vals = np.concatenate([pv[:kv_len], sv[b, :lens[b]]])
    if len(keys) == 0:
      assert np.isneginf(lse[row]) and not out[row].any()
      continue
    s = keys @ q[row]
    ref_lse = s.max() + np.log(np.exp(s - s.max()).sum())
    ref = np.exp(s - ref_lse) @ vals
    np.testing.assert_allclose(out[row], ref, rtol=1e-10, atol=1e-12)
    # An lse can sit at 0 (here 7e-4 was seen), where a pure relative bound is float64 noise.
    np.testing.assert_allclose(lse[row], ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spread", [True, False])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_plan_against_full_attention(data, spread):
  """Every split's prefix blocks and suffix steps (half a K/V slot per warpgroup), merged."""
  m, splits, case = draw_case(data, [1, 2, 4, 8, 16, 32], [1, 2, 3, 5])
  parts = emulate(*case, m=m, splits=splits, block_kv=BLOCK_KV, block_s=BLOCK_S, spread=spread)
  check_full_attention(parts, m, *case)


@settings(max_examples=300, deadline=None)
@given(n_pre=st.integers(0, 300), kv_short=st.integers(0, 127), n_sblk=st.integers(0, 5),
       seqs_per_wg=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), splits=st.integers(1, 9),
       spread=st.booleans(), tiles=st.integers(1, 40), tile=st.integers(0, 39))
def test_splits_tile_the_step_list(n_pre, kv_short, n_sblk, seqs_per_wg, splits, spread, tiles,
                                   tile):
  """Over a row tile's key splits, every valid prefix block and every suffix step is visited
  exactly once; only the prefix's last block is masked, and only when the prefix ends inside it,
  as its split's last step; each split's suffix steps are one run in order. Equal counts
  (``spread=False``) cut the list into ranges of at most ``ceil(steps / splits)``; ``spread``
  gives each split its share of both kinds, within one step of an equal share, and starts the
  CTAs' suffix runs at positions spread over the split's unmasked prefix blocks."""
  tile = tile % tiles
  block_kv, block_s = 128, 64
  kv_len = max(n_pre * block_kv - kv_short, 0)
  n_suf = seqs_per_wg * n_sblk
  rgs = [ranges(kv_len, n_sblk * block_s, s, tile * splits + s, n_pre=n_pre, block_kv=block_kv,
                block_s=block_s, seqs_per_wg=seqs_per_wg, splits=splits, spread=spread,
                ctas=tiles * splits) for s in range(splits)]
  n_valid = int(rgs[0].n_pre)
  assert n_valid == -(-kv_len // block_kv)
  blocks, suffix = [], []
  for rg in rgs:
    plan = walk(rg)
    o, n_s, s_lo = int(rg.o), int(rg.n_s), int(rg.s_lo)
    assert [x[0] for x in plan[o:o + n_s]] == ["suffix"] * n_s
    suffix += list(range(s_lo, s_lo + n_s))
    prefix = [x for x in plan if x[0] == "prefix"]
    blocks += [x[1] for x in prefix]
    for k, (_, blk, masked) in enumerate(prefix):
      assert masked == (blk == n_valid - 1 and kv_len % block_kv != 0)
      assert not masked or k == len(prefix) - 1 and plan[-1] == prefix[-1]
    total = n_valid + n_suf
    if spread:
      assert abs(len(prefix) - n_valid / splits) < 1 and abs(n_s - n_suf / splits) < 1
    else:
      assert len(plan) <= -(-total // splits)
  assert sorted(blocks) == list(range(n_valid))
  assert suffix == list(range(n_suf))


def test_spread_suffix_runs_start_apart():
  """With spread steps the CTAs of a KV head start their suffix runs at positions covering the
  split's unmasked prefix blocks evenly (here 64 of them over 128 CTAs: each start at most twice)."""
  starts = [int(ranges(128 * 128, 128, c % 2, c, n_pre=128, block_kv=128, block_s=64,
                       seqs_per_wg=8, splits=2, spread=True, ctas=128).o) for c in range(128)]
  counts = np.bincount(starts, minlength=65)
  assert counts.max() <= 2 and counts.sum() == 128 and len(counts) == 65


# Step plans for the barrier checks: prefix length, suffix blocks, sequences per warpgroup, key
# splits, both step plans, the CTA among its KV head's, K/V slots.
BARRIER_PLANS = dict(
    n_pre=st.integers(0, 40), kv_short=st.integers(0, 127), n_sblk=st.integers(0, 5),
    seqs_per_wg=st.sampled_from([1, 2, 4, 8, 16, 64]), splits=st.integers(1, 9),
    spread=st.booleans(), ctas=st.integers(1, 40), cta=st.integers(0, 39),
    steps_buf=st.sampled_from([2, 3]))


def phase_errors(plan_suffix, steps_buf, waits):
  """Barrier phases a warpgroup skips before waiting again on the same barrier. Mosaic GPU keeps
  each barrier's phase in the waiting threads and flips it at every wait, so a warpgroup must
  wait on every phase of a barrier up to its last wait there; ``plan_suffix`` lists whether each
  local step is a suffix step."""
  errors = []
  for w in (0, 1):
    for slot in range(steps_buf):
      mine = [(i, sfx) for i, sfx in enumerate(plan_suffix) if i % steps_buf == slot]
      for name in ("k", "v", "k1", "v1"):
        arrived = [i for i, sfx in mine if name in fp.arrivals(sfx)]
        waited = [i for i, sfx in mine if name in waits(w, sfx)]
        assert set(waited) <= set(arrived), (w, name, waited, arrived)  # no wait without a copy
        if waited and [i for i in arrived if i <= waited[-1]] != waited:
          errors.append((w, name, slot))
  return errors


@settings(max_examples=300, deadline=None)
@given(**BARRIER_PLANS)
def test_barrier_phases(n_pre, kv_short, n_sblk, seqs_per_wg, splits, spread, ctas, cta,
                        steps_buf):
  """Every consumer warpgroup waits on each phase of every barrier it waits on (see
  :func:`phase_errors`), for both step plans."""
  kv_len = max(n_pre * 128 - kv_short, 0)
  for split in range(splits):
    rg = ranges(kv_len, n_sblk * 64, split, (cta % ctas) * splits + split, n_pre=n_pre,
                block_kv=128, block_s=64, seqs_per_wg=seqs_per_wg, splits=splits, spread=spread,
                ctas=ctas * splits)
    plan = [x[0] == "suffix" for x in walk(rg)]
    assert phase_errors(plan, steps_buf, fp.waits) == []


def test_barrier_phase_check_catches_skipped_phases():
  """Warpgroup 1 waiting only on its own half's barriers at suffix steps (what the kernel did
  before the suffix steps could sit among prefix blocks) skips phases of "k" and "v" as soon
  as a prefix step follows an odd number of suffix steps on a slot, which hangs the kernel."""
  own_half = lambda w, sfx: ("k1", "v1") if (w == 1 and sfx) else ("k", "v")
  assert phase_errors([True, False, False], 2, own_half) == [(1, "k", 0), (1, "v", 0)]
  assert phase_errors([False, True, True], 2, own_half) == []  # suffix steps last: no skip
  assert phase_errors([True, False, False], 2, fp.waits) == []


@pytest.mark.parametrize("spread", [None, True, False])
def test_default_config_spreads_as_the_rule_or_the_options_say(spread):
  """``default_config`` spreads the suffix steps exactly where ``spreads`` says so for its own
  splits, prefix blocks and suffix steps (``spread_suffix=None``), and as the options force it
  otherwise; the rule spreads only with few splits and a prefix that outweighs the suffix steps,
  where equal ranges would put every suffix step in the last split's tail."""
  from pallas_kernels.gpu.config import FusedDecodeOptions
  options = FusedDecodeOptions(spread_suffix=spread)
  for b, p, s, g in itertools.product([16, 256, 1024], [1024, 4096, 16384], [128, 512], [8, 16]):
    cfg = fp.default_config(b * g, 1, p, s, g, device=H100, options=options)
    steps = (cfg.block_q // g) * (s // cfg.block_s)
    rule = fp.spreads(cfg.splits, p // cfg.block_kv, steps)
    assert cfg.spread_suffix == (rule if spread is None else spread), (b, p, s, g, cfg)
    if rule:
      assert cfg.splits <= 2 and p // cfg.block_kv >= steps


def consumer_ops(w, rg):
  """Consumer warpgroup ``w``'s barrier operations over one split, in the kernel's order
  (``kv_loop``), by step: ``("wk", i)`` / ``("wv", i)`` wait for K / V, ``("ak", i)`` /
  ``("av", i)`` arrive on its consumed barrier, ``("sa",)`` / ``("sw",)`` arrive on / wait for the
  schedule barrier."""
  steps = int(rg.steps)
  ops = [("wk", 0)] if steps else []
  if w == 1:
    ops += [("sa",), ("sw",)]
  for i in range(steps):
    ops += [("sa",), ("sw",), ("ak", i)]  # QK product, then its slot's K is released
    ops += [("sa",)]  # softmax done
    ops += [("wv", i), ("sw",)]  # PV product; in it, the next step's K
    ops += [("wk", i + 1)] if i + 1 < steps else []
    ops += [("av", i)]
  if w == 0:
    ops += [("sa",), ("sw",)]
  return ops


def producer_ops(n_pos, steps_buf):
  """The producer's: step ``p`` reuses the slot of ``p - steps_buf`` once both warpgroups
  released it (``("pk", .)`` / ``("pv", .)``), K then V (``("ik", p)`` / ``("iv", p)``)."""
  ops = []
  for p in range(n_pos):
    ops += ([("pk", p - steps_buf)] if p >= steps_buf else []) + [("ik", p)]
    ops += ([("pv", p - steps_buf)] if p >= steps_buf else []) + [("iv", p)]
  return ops


def stuck(actors):
  """Runs the three warpgroups' operation lists (consumer 0, consumer 1, producer) as the
  barriers allow; returns the operations each is stuck at (empty if all finish). A schedule
  barrier phase completes at every second arrival, whichever warpgroup makes it."""
  issued, consumed = set(), {}
  sched_arrivals, sched_waits = 0, [0, 0]
  at = [0] * len(actors)
  while True:
    moved = False
    for a, ops in enumerate(actors):
      while at[a] < len(ops):
        op, *arg = ops[at[a]]
        if op in ("wk", "wv"):
          ok = (op[1], arg[0]) in issued
        elif op in ("pk", "pv"):
          ok = consumed.get((op[1], arg[0]), 0) == 2
        elif op == "sw":
          ok = sched_arrivals >= 2 * (sched_waits[a] + 1)
          sched_waits[a] += ok
        else:
          ok = True
          if op in ("ak", "av"):
            consumed[op[1], arg[0]] = consumed.get((op[1], arg[0]), 0) + 1
          elif op in ("ik", "iv"):
            issued.add((op[1], arg[0]))
          else:
            sched_arrivals += 1
        if not ok:
          break
        at[a] += 1
        moved = True
    if not moved:
      return [ops[i] for ops, i in zip(actors, at) if i < len(ops)]


@settings(max_examples=200, deadline=None)
@given(n_pre=st.integers(0, 12), kv_short=st.integers(0, 127), n_sblk=st.integers(0, 3),
       seqs_per_wg=st.sampled_from([1, 2, 4, 8]), splits=st.integers(1, 4),
       spread=st.booleans(), ctas=st.integers(1, 8), cta=st.integers(0, 7),
       steps_buf=st.sampled_from([2, 3]))
def test_barrier_protocol_runs_to_the_end(n_pre, kv_short, n_sblk, seqs_per_wg, splits, spread,
                                          ctas, cta, steps_buf):
  """The producer and the two consumer warpgroups never wait on each other in a cycle (a hang on
  the GPU), for both step plans."""
  kv_len = max(n_pre * 128 - kv_short, 0)
  for split in range(splits):
    rg = ranges(kv_len, n_sblk * 64, split, (cta % ctas) * splits + split, n_pre=n_pre,
                block_kv=128, block_s=64, seqs_per_wg=seqs_per_wg, splits=splits,
                spread=spread, ctas=ctas * splits)
    actors = [consumer_ops(0, rg), consumer_ops(1, rg), producer_ops(int(rg.steps), steps_buf)]
    assert stuck(actors) == []


def test_barrier_protocol_check_catches_a_hang():
  """The check finds hangs: warpgroup 0 leaving out its closing schedule barrier (the kernel's
  ``perform_schedule_barrier()`` after its last step) leaves warpgroup 1 waiting on its last
  phase, and a consumer that never releases its V slots stalls the producer once the steps
  outnumber the slots."""
  rg = ranges(3 * 128, 128, 0, 0, n_pre=3, block_kv=128, block_s=64, seqs_per_wg=2, splits=1,
              spread=False, ctas=1)  # 3 prefix blocks, then 4 suffix steps
  c0, c1 = consumer_ops(0, rg), consumer_ops(1, rg)
  producer = producer_ops(int(rg.steps), 2)
  assert int(rg.steps) == 7 and stuck([c0, c1, producer]) == []
  assert c0[-2:] == [("sa",), ("sw",)] and stuck([c0[:-2], c1, producer]) == [("sw",)]
  keeps_v = [op for op in c0 if op[0] != "av"]
  assert stuck([keeps_v, c1, producer]) != []
