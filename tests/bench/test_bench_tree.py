"""`hydragen bench tree` (Sec. 4.4): its three cache layouts, memory model and reports (tiny, CPU)."""

import json
import os

import numpy as np
import pytest

from models.bench import tree as bench_tree
from models.bench.tree import (HEADROOM, Dataset, kv_bytes, make_state, max_batch, memory_needed,
                               run_point, timed_batch_indices)
from models.cli import main
from models.generation.loop import decode
from models.model.config import preset

pytestmark = pytest.mark.device  # runs the model's attention path (docs/gpu-tests.md)

SHOTS, SAMPLES, NEW = 20, 2, 4


@pytest.fixture(scope="module")
def tiny():
  from models.model.llama import random_init
  return random_init(preset("tiny"), seed=5, std=0.12)  # float32: modes must agree exactly


def test_every_mode_holds_the_estimated_bytes_and_decodes_the_same_tokens(tiny):
  data = Dataset.draw(256, SHOTS, 2, 4, 9, seed=1)
  lengths = [len(p) for p in data.problems]
  assert lengths[0] != lengths[1]  # padding to the longer problem is part of the estimate
  tokens = {}
  for mode in bench_tree.MODES:
    state = make_state(tiny, mode, data.shots, data.problems, SAMPLES, NEW, impl="xla")
    assert state.cache.nbytes == kv_bytes(tiny.config, mode, 2, SAMPLES, SHOTS, max(lengths), NEW)
    levels = [level.k[0].shape[:2] for level in state.cache.levels]
    own = np.asarray(state.cache.lengths)[np.argsort(np.asarray(state.sample_ids))]
    if mode == "standard":  # the whole context in every sample's own cache
      assert levels == [] and list(own) == [SHOTS + n - 1 for n in lengths for _ in range(SAMPLES)]
    elif mode == "single-level":  # the few-shot prompt once; each problem copied per sample
      assert levels == [(1, SHOTS)] and list(own) == [n - 1 for n in lengths for _ in range(SAMPLES)]
    else:  # the detected tree: few-shot prompt once, each problem once
      assert levels == [(1, SHOTS), (2, max(lengths) - 1)] and not own.any()
    tokens[mode] = np.asarray(decode(tiny, state, impl="xla").completions())
  np.testing.assert_array_equal(tokens["single-level"], tokens["standard"])
  np.testing.assert_array_equal(tokens["two-level"], tokens["standard"])
  assert len({tuple(r) for r in tokens["standard"]}) == 2  # two problems, two continuations


def test_memory_model_orders_the_modes():
  config = preset("llama-3-8b").replace(dtype="bfloat16")  # the command's default
  need = {m: memory_needed(config, m, 4, 128, 2400, 700, 512) for m in bench_tree.MODES}
  assert need["two-level"] < need["single-level"] < need["standard"]
  # The paper's setting on 80 GB: standard cannot hold one problem's 128 samples (77 GB),
  # single-level holds 2 problems per batch, two-level 6 (docs/tree.md).
  sizes = {m: max_batch(config, m, 80e9, 120, 128, 2400, 700, 512) for m in bench_tree.MODES}
  assert sizes == {"standard": 0, "single-level": 2, "two-level": 6}
  assert max_batch(config, "two-level", 1e9, 120, 128, 2400, 700, 512) == 0  # weights alone: 16 GB
  assert max_batch(preset("tiny"), "two-level", 1e12, 7, 2, 20, 9, 4) == 7


def test_out_of_memory_is_reported_as_x_and_other_errors_raise(tiny, monkeypatch):
  data = Dataset.draw(256, SHOTS, 2, 4, 9, seed=1)
  kw = dict(samples=SAMPLES, new_tokens=NEW, impl="xla", budget=10**12)

  def oom(*args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
  monkeypatch.setattr(bench_tree, "make_state", oom)
  row = run_point(tiny, data, "two-level", 2, **kw)
  assert row["total_s"] == "x" and row["why"] == "out of memory"
  assert run_point(tiny, data, "two-level", 2, **{**kw, "budget": 1})["why"] == "memory estimate"
  monkeypatch.setattr(bench_tree, "make_state", lambda *a, **k: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    run_point(tiny, data, "two-level", 2, **kw)


def test_summary_compares_two_level_with_single_level():
  row = lambda mode, b, total, at_max=False: dict(mode=mode, problems_per_batch=b, sequences=8 * b,
                                                  total_s=total, at_max_batch=at_max)
  rows = [row("single-level", 1, 10.0, True), row("two-level", 1, 8.0), row("standard", 1, 20.0),
          row("single-level", 2, "x"), row("two-level", 2, 12.5), row("two-level", 4, 4.0, True)]
  assert bench_tree.summarize(rows) == [
      "equal batch (1 problem(s), 8 sequences): two-level takes 20.0% less time than "
      "single-level (paper: 18% less)",
      "each at the largest batch that fits: two-level (4 problems) takes 60.0% less time than "
      "single-level (1) (paper: 55% less in all)"]
  assert rows[1]["vs_single_level"] == 1.25 and "vs_single_level" not in rows[4]
  rows[1]["total_s"] = 12.0
  assert "20.0% more time" in bench_tree.summarize(rows)[0]


@pytest.mark.slow
def test_bench_tree_tiny_end_to_end(tmp_path):
  config = preset("tiny").replace(dtype="bfloat16")  # the command's model: bf16, this shape
  need = lambda mode, b: memory_needed(config, mode, b, SAMPLES, SHOTS, 9, NEW)
  # A budget in which single-level fits 2 problems per batch and two-level all 3.
  assert need("two-level", 3) < need("single-level", 3)
  budget = (max(need("single-level", 2), need("two-level", 3)) + need("single-level", 3)) / 2
  budget /= HEADROOM
  out = str(tmp_path)
  assert main(["bench", "tree", "--model", "tiny", "--shots", str(SHOTS), "--problems", "3",
               "--problem-tokens", "4,9", "--samples", str(SAMPLES), "--new-tokens", str(NEW),
               "--batch", "3", "--modes", "single-level,two-level", "--impl", "xla",
               "--memory-gb", repr(budget / 1e9), "--out", out, "--no-progress"]) == 0
  stem = os.path.join(out, "tree_tiny")
  report = json.load(open(stem + ".json"))
  assert {r["sampling"] for r in report["rows"]} == {"greedy", "sampled"}
  sampled = [r for r in report["rows"] if r["sampling"] == "sampled"]
  assert all(r["tokens_per_s"] == "x" or r["tokens_per_s"] > 0 for r in sampled)
  assert os.path.getsize(stem + "_sampled.png") > 0
  report["rows"] = [r for r in report["rows"] if r["sampling"] == "greedy"]
  report["summary"] = [s for s in report["summary"] if s.startswith("greedy: ")]
  assert report["info"]["max_batch_single-level"] == 2 and report["info"]["max_batch_two-level"] == 3
  rows = {(r["mode"], r["problems_per_batch"]): r for r in report["rows"]}
  assert set(rows) == {("single-level", 3), ("two-level", 3), ("single-level", 2)}
  assert rows[("single-level", 3)]["total_s"] == "x"  # over the budget: reported, not run
  assert rows[("single-level", 2)]["at_max_batch"] and rows[("two-level", 3)]["at_max_batch"]
  for key, batches in ((("single-level", 2), 2), (("two-level", 3), 1)):
    r = rows[key]
    assert r["tokens_per_s"] > 0 and r["decode_s"] > 0 and r["prefill_s"] > 0
    assert r["batches"] == batches
  # 3 problems in batches of 2: the smaller last batch (1 problem) is timed too, not counted
  # at the full batch's time; the per-batch figures are the full batch's.
  r = rows[("single-level", 2)]
  assert r["timed_batches"] == 2 and [t["problems"] for t in r["timed"]] == [2, 1]
  full, last = r["timed"]
  assert r["batch_s"] == pytest.approx(full["prefill_s"] + full["decode_s"])
  assert r["total_s"] == pytest.approx(r["batch_s"] + last["prefill_s"] + last["decode_s"])
  r = rows[("two-level", 3)]
  assert r["timed_batches"] == 1 and r["total_s"] == pytest.approx(r["batch_s"])
  assert len(report["summary"]) == 1 and "two-level (3 problems)" in report["summary"][0]
  md = open(stem + ".md").read()
  assert "| two-level | greedy | 3 |" in md and "| single-level | sampled | 3 |" in md
  assert "largest batch" in md
  assert os.path.getsize(stem + ".png") > 0


def test_timed_batches_always_include_a_smaller_last_batch():
  assert timed_batch_indices([12, 4], 1) == [0, 1]
  assert timed_batch_indices([3] * 8, 1) == [0]
  assert timed_batch_indices([3, 3, 3, 1], 2) == [0, 1, 3]
  assert timed_batch_indices([3, 3, 1], 0) == [0, 1, 2]
  assert timed_batch_indices([5], 1) == [0]
  assert timed_batch_indices([2, 1], 5) == [0, 1]
