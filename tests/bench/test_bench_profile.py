"""Device time from profiler traces: interval union, categories, the xspace reader."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.bench import profile, timing


def _ev(name, start, dur):
  return profile.Event(name, float(start), float(dur))


def test_busy_time_counts_overlaps_once_and_skips_gaps():
  events = [_ev("a", 0, 10), _ev("b", 5, 10), _ev("c", 30, 5), _ev("d", 31, 1)]
  assert profile.busy_ns(events) == 15 + 5
  assert profile.span_ns(events) == 35
  assert profile.busy_ns([]) == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 50)), max_size=20))
def test_busy_time_equals_a_dense_count(intervals):
  events = [_ev("k", s, d) for s, d in intervals]
  covered = np.zeros(260, bool)
  for s, d in intervals:
    covered[s:s + d] = True
  assert profile.busy_ns(events) == covered.sum()


def test_categories():
  assert profile.category("hydragen_suffix_attention") == "attention"
  assert profile.category("cudnn_generated_fort_native_sdpa_sm90") == "attention"
  assert profile.category("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmul"
  assert profile.category("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
  assert profile.category("loop_add_fusion") == "other"


def test_breakdown_divides_by_calls():
  events = [_ev("gemm_a", 0, 4000), _ev("hydragen_prefix", 4000, 2000), _ev("gemm_a", 6000, 4000)]
  b = profile.breakdown(events, per=2)
  assert b["busy_us"] == pytest.approx(5.0)
  assert b["by_category_us"] == pytest.approx({"matmul": 4.0, "attention": 1.0})
  assert b["kernels"][0] == {"name": "gemm_a", "us": 4.0, "count": 1.0}
  assert [k["name"] for k in profile.breakdown(events, top=1)["kernels"]] == ["gemm_a"]
  assert len(profile.breakdown(events, top=5)["kernels"]) == 2


def test_reader_takes_the_stream_lines_of_device_planes_only():
  line = lambda name, evs: types.SimpleNamespace(
      name=name, events=[types.SimpleNamespace(name=n, start_ns=s, duration_ns=d) for n, s, d in evs])
  plane = lambda name, lines: types.SimpleNamespace(name=name, lines=lines)
  planes = [
      plane("/host:CPU", [line("python", [("f", 0, 100)])]),
      plane("/device:GPU:0", [line("Stream #13(Compute)", [("k2", 50, 5), ("k1", 10, 5)]),
                              line("XLA Ops", [("fusion", 10, 5)]),
                              line("XLA Modules", [("jit_f", 0, 60)])]),
  ]
  events = profile.events_from_xspace(planes)
  assert [e.name for e in events] == ["k1", "k2"]
  assert profile.events_from_xspace(planes[:1]) is None  # no device: the caller uses the clock


def test_measure_on_cpu_uses_the_wall_clock():
  m = timing.measure(lambda x: x * 2, lambda i: (jnp.full((64,), float(i + 1)),), n_sets=2,
                     trials=2, warmup=1)
  if jax.default_backend() == "cpu":
    assert m["method"] == "wall" and m["seconds"] == m["wall_s"] > 0
  else:
    assert m["method"] == "profiler" and 0 < m["device_s"]


def test_compare_ops_times_checks_and_reports_failures():
  def boom(x):
    raise ValueError("no such kernel")

  ops = {"ref": lambda x: x * 2, "same": lambda x: x + x, "off": lambda x: x * 2 + 1, "bad": boom}
  row = timing.compare_ops(ops, lambda i: (jnp.full((64,), float(i + 1)),), n_sets=2, trials=2)
  assert all(isinstance(row[k], float) and row[k] > 0 for k in ("ref", "same", "off"))
  assert "err_ref" not in row and row["err_same"] == 0.0 and row["err_off"] > 0.1
  assert row["bad"].startswith("err: ValueError: no such kernel")
