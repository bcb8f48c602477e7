"""The device experiments' kernels lower for CUDA, and the partition bound's arithmetic (CPU).

``tools/device/suffix_role.py`` and ``tools/device/sm_partition.py`` hold Mosaic GPU kernels
that only a GPU runs (their exactness checks run there, against a float64 oracle); here they
are exported for CUDA so that an API change in jax breaks CI, not the next device session.
``tools/partition_bound.py`` turns their measurements into the bound in
``docs/results/2026-11-24-h100-sm-partition``; its interpolation and its reading of the
committed files are checked here.
"""

import functools
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "2026-11-24-h100-sm-partition"
S = jax.ShapeDtypeStruct


def load(path: str):
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def export_cuda(fn, *args) -> str:
  checks = [jax.export.DisabledSafetyCheck.custom_call(t)
            for t in ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")]
  return jax.export.export(jax.jit(fn), platforms=["cuda"],
                           disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("b,s,hkv,g,ctas,wgs,stages,block_s,layout", [
    (64, 128, 1, 8, 4, 2, 2, 64, "cols"), (32, 192, 2, 4, 2, 4, 1, 64, "cols"),
    (64, 256, 1, 8, 4, 2, 1, 128, "cols"), (64, 128, 1, 8, 4, 2, 2, 64, "rows"),
    (32, 192, 2, 4, 2, 1, 4, 64, "rows"), (256, 136, 8, 4, 32, 2, 2, 64, "rows")])
def test_suffix_role_lowers(b, s, hkv, g, ctas, wgs, stages, block_s, layout):
  sr = load("tools/device/suffix_role.py")
  fn = functools.partial(sr.suffix_rows_mgpu, rows_per_seq=g, scale=0.1, n_ctas=ctas, wgs=wgs,
                         stages=stages, block_s=block_s, layout=layout)
  kv = S((b, s, hkv, 128), jnp.bfloat16)
  text = export_cuda(fn, S((hkv, b * g, 128), jnp.bfloat16), kv, kv, S((b,), jnp.int32))
  assert "mosaic_gpu_v2" in text


def test_suffix_role_rejects_uneven_work():
  sr = load("tools/device/suffix_role.py")
  kv = jnp.zeros((64, 128, 1, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="column groups do not divide"):
    sr.suffix_rows_mgpu(jnp.zeros((1, 512, 128), jnp.bfloat16), kv, kv,
                        jnp.full((64,), 128, jnp.int32), rows_per_seq=8, scale=0.1, n_ctas=3)


def test_suffix_role_rows_rejects_uneven_work():
  sr = load("tools/device/suffix_role.py")
  kv = jnp.zeros((64, 128, 1, 128), jnp.bfloat16)
  args = (jnp.zeros((1, 512, 128), jnp.bfloat16), kv, kv, jnp.full((64,), 128, jnp.int32))
  with pytest.raises(ValueError, match="row tiles do not divide"):  # 8 tiles, 3 x 2 warpgroups
    sr.suffix_rows_mgpu(*args, rows_per_seq=8, scale=0.1, n_ctas=3, layout="rows")
  with pytest.raises(ValueError, match="a multiple of 64"):
    sr.suffix_rows_mgpu(*args, rows_per_seq=8, scale=0.1, n_ctas=2, block_s=32, layout="rows")


def test_partition_parts_idle_launch_lowers():
  """The diagnostic's flat grid with idle side CTAs (``tools/device/partition_parts.py``)."""
  import dataclasses
  pp = load("tools/device/partition_parts.py")
  mg = pp.mg
  cfg = dataclasses.replace(mg.default_config(1024, 8, 4096, 128), splits=4, block_kv=128)

  def idle(q, k, v, lens):
    return mg.prefix_attention_rows_mgpu(
        q, k, v, jnp.int32(4096), scale=0.1, config=cfg,
        side=(32, lambda *refs: None, (lens,), (S((8,), jnp.float32),)))
  pre = S((4096, 8, 128), jnp.bfloat16)
  text = export_cuda(idle, S((8, 1024, 128), jnp.bfloat16), pre, pre, S((256,), jnp.int32))
  assert text.count("mosaic_gpu_v2") == 1


def test_stream_kernel_lowers():
  sp = load("tools/device/sm_partition.py")
  op = sp.stream_op(4, 6, 128, 4)
  assert "mosaic_gpu_v2" in export_cuda(lambda x: op(x), S((24, 128, 128), jnp.bfloat16))


def test_curve_interpolates_the_measured_points():
  pb = load("tools/partition_bound.py")
  at = pb.curve({4: 100.0, 8: 300.0, 32: 900.0})
  assert at(4) == 100.0 and at(8) == 300.0 and at(32) == 900.0
  assert at(2) == 50.0  # below the smallest count: its rate per SM
  assert at(6) == 200.0 and at(20) == 600.0  # linear between counts
  assert at(64) == 900.0  # above the largest: the largest's


def test_partition_bound_on_the_committed_measurements(tmp_path, monkeypatch, capsys):
  pb = load("tools/partition_bound.py")
  roles = sorted(str(p) for p in RESULTS.glob("suffix_role*.json"))
  monkeypatch.setattr("sys.argv", ["partition_bound.py", "--partition",
                                   str(RESULTS / "sm_partition.json"), "--suffix-role", *roles,
                                   "--out", str(tmp_path)])
  pb.main()
  table = capsys.readouterr().out
  assert (tmp_path / "partition_bound.md").read_text() == table
  rows = json.loads((tmp_path / "partition_bound.json").read_text())
  assert len(rows) == 16
  for r in rows:
    # The bound is the slower role at the best split plus the merge, and no role is faster than
    # its parts allow: the prefix on fewer SMs never beats the prefix kernel on all of them.
    assert r["bound_us"] == pytest.approx(max(r["prefix_us"], r["suffix_us"]) + r["merge_us"])
    assert 1 <= r["suffix_sms"] < 132
  part = json.loads((RESULTS / "sm_partition.json").read_text())["partition"]
  for r, p in zip(rows, part):
    assert r["prefix_us"] >= p["prefix_us"] - 1e-9


@pytest.mark.parametrize("b,p,s,hq,hkv,splits,side", [
    (64, 1024, 128, 32, 8, 1, 16), (64, 1024, 256, 8, 1, 2, 4), (256, 1024, 136, 32, 8, 8, 32)])
def test_partitioned_launch_lowers(b, p, s, hq, hkv, splits, side):
  """The prefix kernel with suffix-role CTAs in the same launch (``side=``): one Mosaic GPU
  kernel whose outputs are the prefix's splits and the suffix part, its flat grid holding the
  suffix CTAs and then one CTA per prefix unit (more than an H100's 132 SMs in the last case),
  then the merge kernel."""
  pt = load("tools/device/partitioned.py")
  fn = functools.partial(pt.partitioned_attention, splits=splits, side_ctas=side)
  kv = S((b, s, hkv, 128), jnp.bfloat16)
  pre = S((p, hkv, 128), jnp.bfloat16)
  text = export_cuda(fn, S((b, 1, hq, 128), jnp.bfloat16), pre, pre, kv, kv, S((b,), jnp.int32))
  assert text.count("mosaic_gpu_v2") == 1 and text.count("xla.gpu.triton") == 1  # the merge


def test_partitioned_plan():
  """The decode plan: suffix CTAs whose row tiles divide evenly, prefix units of at least
  DECODE_UNIT_KEYS keys and about DECODE_UNITS of them; None off the measured shape (G = 4)."""
  pt = load("tools/device/partitioned.py")
  assert pt.plan(256, 32, 8, 4096) == (4, 64) and pt.plan(1024, 32, 8, 4096) == (1, 64)
  for b, p in [(32, 1024), (64, 4096), (256, 4096), (1024, 4096), (256, 16384), (96, 2048)]:
    splits, side = pt.plan(b, 32, 8, p)
    row_tiles, tiles = 8 * b * 4 // 64, 8 * b * 4 // 128
    assert row_tiles % (2 * side) == 0 and 1 <= side <= pt.DECODE_SIDE_CTAS
    assert splits == 1 or p // splits >= pt.DECODE_UNIT_KEYS
    assert splits == 1 or tiles * (splits - 1) < pt.DECODE_UNITS
  assert pt.plan(48, 32, 8, 4096) is None and pt.plan(256, 8, 1, 4096) is None  # rows, G = 8


def test_partitioned_decode_routing():
  """The decode A/B's routing: eligible calls take the partitioned launch (one Mosaic GPU kernel
  and the merge kernel), the others stay on the shipped kernels (the Mosaic prefix kernel and
  the Triton suffix kernel that merges its splits)."""
  pdx = load("tools/device/partitioned_decode.py")
  from jax_shared_attn import shared_prefix_attention
  for b, cap, mosaic, triton in [(256, 128, 1, 1), (1024, 128, 1, 1), (256, 130, 1, 1)]:
    def f(q, pk, pv, sk, sv, lens):
      with pdx.routing(True):
        return shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=lens,
                                       prefix_length=jnp.int32(4000), impl="pallas:mosaic_gpu")
    pre = S((4096, 8, 128), jnp.bfloat16)
    own = S((b, cap, 8, 128), jnp.bfloat16)
    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")]
    text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
        S((b, 1, 32, 128), jnp.bfloat16), pre, pre, own, own, S((b,), jnp.int32)).mlir_module()
    assert (text.count("mosaic_gpu_v2"), text.count("xla.gpu.triton")) == (mosaic, triton)


def test_suffix_role_check_can_fail():
  """The device check of the suffix role accepts the exact answer in the kernel's layout and
  rejects a perturbed output, a shifted LSE and a lost -inf row."""
  import numpy as np
  from jax_shared_attn.testing import oracle_full
  from pallas_kernels.gpu._common import fold_rows, unfold_rows
  sr = load("tools/device/suffix_role.py")
  b, s, hkv, g, d = 8, 24, 2, 4, 16
  q, sk, sv = sr.inputs(jax.random.key(0), b, s, hkv, g, d, jnp.float32)
  lens = jnp.array([0, 1, 5, 24, 3, 17, 22, 9], jnp.int32)
  ref_o, ref_l = oracle_full(unfold_rows(q, b, 1), sk, sv, kv_lengths=lens, scale=0.25)
  rows = np.asarray(fold_rows(jnp.asarray(ref_o, jnp.float32), hkv))  # [Hkv, R, D]
  o_t = np.swapaxes(rows.reshape(hkv * b * g // 16, 16, d), 1, 2)  # the kernel's o^T tiles
  lse = np.asarray(fold_rows(jnp.asarray(ref_l, jnp.float32)[..., None], hkv))[..., 0]
  assert sr.compare(o_t, lse, q, sk, sv, lens, scale=0.25)["ok"]
  bad = o_t.copy()
  bad[3, 5, 7] += 0.5
  assert not sr.compare(bad, lse, q, sk, sv, lens, scale=0.25)["ok"]
  assert not sr.compare(o_t, lse + 0.1, q, sk, sv, lens, scale=0.25)["ok"]
  lost = lse.copy()
  lost[0, 0] = 0.0  # sequence 0 has no key: its LSE must stay -inf
  assert not sr.compare(o_t, lost, q, sk, sv, lens, scale=0.25)["ok"]


def test_prefix_references_reach_table(tmp_path, monkeypatch):
  """The reach table's arithmetic: the floor of the whole call from the run's own ceilings, the
  goal's allowance and the fastest prefix op against it. On a CPU cuDNN is stood in for by
  XLA's attention (same call, no ``implementation``); the Mosaic GPU ops fail and are reported."""
  from jax_shared_attn.iomodel import AttentionShape
  pr = load("tools/device/prefix_references.py")
  orig = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **k: orig(*a, **k))
  monkeypatch.setattr("sys.argv", ["prefix_references", "--specs", "paper:16:256", "--trials",
                                   "1", "--ops", "ours,cudnn,cudnn_ks", "--suffixes", "16,64",
                                   "--splits", "1,2", "--out", str(tmp_path)])
  pr.main()
  report = json.loads((tmp_path / "prefix_references.json").read_text())
  assert [row["parts"] for row in report["rows"]] == [1, 2]
  for row in report["rows"]:
    assert row["ours"].startswith("err")  # Mosaic GPU: no CPU lowering
  timed = {f"{n}/{row['parts']}": row[n] for row in report["rows"] for n in ("cudnn", "cudnn_ks")}
  assert [x["s"] for x in report["reach"]] == [16, 64]
  for x in report["reach"]:
    floor = AttentionShape(16, 256, x["s"], 8, 1, 128).floor_s(report["copy_bandwidth"],
                                                               report["matmul_rate"]) * 1e6
    assert x["floor_us"] == pytest.approx(floor)
    assert x["allowed_us"] == pytest.approx(floor / 0.8)
    assert (x["best_prefix"], x["best_prefix_us"]) == min(timed.items(), key=lambda kv: kv[1])
    assert x["prefix_over_allowed"] == pytest.approx(min(timed.values()) / (floor / 0.8))
  assert "| paper:16:256 | 64 |" in (tmp_path / "prefix_references.md").read_text()
  # A saved run re-rendered for another suffix length and goal, measuring nothing; and with the
  # profiler's kernel list, an op counts its longest kernel (a reference's input preparation is
  # not held against it).
  (tmp_path / "again").mkdir()
  report["rows"][1]["cudnn_kernels"] = [{"name": "sdpa", "us": 3.0}, {"name": "memset", "us": 1.0}]
  (tmp_path / "saved.json").write_text(json.dumps(report))
  monkeypatch.setattr("sys.argv", ["prefix_references", "--render", str(tmp_path / "saved.json"),
                                   "--suffixes", "32", "--goal", "0.5",
                                   "--out", str(tmp_path / "again")])
  pr.main()
  (x,) = json.loads((tmp_path / "again" / "prefix_references.json").read_text())["reach"]
  floor = AttentionShape(16, 256, 32, 8, 1, 128).floor_s(report["copy_bandwidth"],
                                                         report["matmul_rate"]) * 1e6
  assert (x["s"], x["best_prefix"], x["best_prefix_us"]) == (32, "cudnn/2", 3.0)
  assert x["prefix_over_allowed"] == pytest.approx(3.0 / (floor / 0.5))
