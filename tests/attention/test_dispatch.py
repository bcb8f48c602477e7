"""The dispatch: which kernels a call runs, as pure functions of shapes, dtypes, device kind and
config (``pallas_kernels.{gpu,tpu}.dispatch``, ``jax_shared_attn.dispatch``), and ``explain``,
all on a CPU for GPU and TPU targets; and that what runs is what the plan says."""

import jax
import jax.numpy as jnp
import pytest

from jax_shared_attn import (GpuConfig, SharedLevel, TpuConfig, XlaConfig, attention_with_lse,
                             explain, hierarchical_attention, shared_prefix_attention)
from jax_shared_attn import dispatch as core
from pallas_kernels.gpu import dispatch as gpu
from pallas_kernels.gpu.config import FusedDecodeOptions
from pallas_kernels.tpu import dispatch as tpu
from pallas_kernels.device import DeviceInfo

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16
H100 = "NVIDIA H100 80GB HBM3"
DEVICE = DeviceInfo.named(H100)


def shapes(b, hq, hkv, d, p, s, tq=1, dtype=BF):
  """q, prefix k, prefix v, suffix k, suffix v as ShapeDtypeStructs."""
  return (S((b, tq, hq, d), dtype), S((p, hkv, d), dtype), S((p, hkv, d), dtype),
          S((b, s, hkv, d), dtype), S((b, s, hkv, d), dtype))


def plan(b, hq, hkv, d, p, s, tq=1, dtype=BF, family="mosaic_gpu", **kw):
  q, pk, pv, sk, _ = shapes(b, hq, hkv, d, p, s, tq, dtype)
  return gpu.plan_shared(q, [("prefix", pk, pv, None, None)], sk, device=DEVICE, family=family,
                         **kw)


@pytest.mark.parametrize("family", ["mosaic_gpu", "triton"])
def test_few_sequences_take_the_flat_path(family):
  got = plan(4, 8, 1, 128, 1024, 128, family=family)
  assert got.path == "flat" and got.flat is not None and got.sequence_major
  assert plan(4, 8, 1, 128, 1024, 128, family=family,
              config=GpuConfig(flat_sequence_major=False)).sequence_major is False
  off = plan(4, 8, 1, 128, 1024, 128, family=family, config=GpuConfig(flat_max_shared_reads=0))
  assert off.path != "flat" and any("budget of 0" in r for r in off.reasons)


def test_flat_budget_is_larger_against_two_kernels():
  config = GpuConfig(flat_max_shared_reads=16 * 2 * 1024 * 128 * 2, flat_split_factor=3)
  assert plan(16, 8, 1, 128, 1024, 128, config=config).path == "flat"
  assert plan(17, 8, 1, 128, 1024, 128, config=config).path == "fused_decode"
  assert plan(48, 8, 1, 128, 1024, 128, family="triton", config=config).path == "flat"
  assert plan(49, 8, 1, 128, 1024, 128, family="triton", config=config).path == "split"


def test_decoding_on_hopper_takes_the_one_kernel():
  got = plan(1024, 8, 1, 128, 16384, 128)
  assert got.path == "fused_decode" and got.fused.splits >= 1
  assert plan(1024, 8, 1, 128, 16384, 128, family="triton").path == "split"
  assert plan(1024, 8, 1, 128, 16384, 128, interpret=True).path == "split"
  off = plan(1024, 8, 1, 128, 16384, 128, config=GpuConfig(fused_decode=False))
  assert off.path == "split" and "GpuConfig.fused_decode is off" in " ".join(off.reasons)


@pytest.mark.parametrize("b,hq,hkv,d,p,s,tq,dtype,why", [
    (1024, 32, 8, 128, 4096, 128, 1, BF, "G=4"),  # Llama-3-8B: too many wasted products
    (1024, 8, 1, 128, 4096, 128, 2, BF, "Tq=2"),
    (1024, 8, 1, 128, 4000, 128, 1, BF, "P=4000"),
    (1024, 8, 1, 128, 4096, 100, 1, BF, "S=100"),
    (1024, 8, 1, 256, 4096, 128, 1, BF, "D=256"),
    (1024, 8, 1, 128, 4096, 128, 1, jnp.float32, "float32"),
])
def test_outside_the_one_kernel_the_kernels_run_apart(b, hq, hkv, d, p, s, tq, dtype, why):
  got = plan(b, hq, hkv, d, p, s, tq, dtype)
  assert got.path == "split" and got.fused is None
  assert why in " ".join(got.reasons)


def test_split_plans_each_part():
  q, pk, pv, sk, _ = shapes(256, 8, 1, 128, 4096, 128, tq=2)
  seg = S((3, 512, 1, 128), BF)
  one = S((1, 1024, 1, 128), BF)
  parts = [("prefix", pk, pv, None, None), ("segments", seg, seg, None, None),
           ("segments", one, one, None, None)]
  got = gpu.plan_shared(q, parts, sk, device=DEVICE, family="mosaic_gpu")
  assert got.path == "split"
  first, second, third = got.prefixes
  assert first.kernel == "mosaic" and first.triton.splits == first.mosaic.splits
  assert second is None  # several segments: the segment kernel
  assert third.kernel == "mosaic"  # one segment: the batched prefix kernel
  assert got.segments[1] is not None and got.segments[0] is got.segments[2] is None
  assert got.suffix is not None and got.device == DEVICE


def prefix_plan(*args, **kw):
  return gpu.plan_prefix(*args, device=DEVICE, **kw)


def test_prefix_plan_kernel_choice():
  assert prefix_plan(2048, 1, 4096, 128, BF, family="mosaic_gpu").kernel == "mosaic"
  assert prefix_plan(2048, 1, 4000, 128, BF, family="mosaic_gpu").kernel == "triton"
  assert prefix_plan(2048, 1, 4096, 128, jnp.float32, family="mosaic_gpu").kernel == "triton"
  assert prefix_plan(2048, 1, 4096, 128, BF, family="mosaic_gpu",
                         interpret=True).kernel == "triton"
  assert prefix_plan(2048, 1, 4096, 128, BF, family="triton").kernel == "triton"
  assert prefix_plan(0, 1, 4096, 128, BF).kernel == "empty"
  many = prefix_plan(16, 1, 16384, 128, BF, max_fused_prior_splits=2)
  assert many.splits > 2 and many.merge_first
  assert not prefix_plan(16, 1, 16384, 128, BF,
                         max_fused_prior_splits=many.splits).merge_first


def test_alignments_follow_the_target():
  assert core.segment_alignment("auto", platform="gpu", device_kind=H100) == 128
  assert core.segment_alignment("auto", platform="gpu", device_kind="NVIDIA A100-SXM4-80GB") == 1
  assert core.segment_alignment("pallas:mosaic_gpu", platform="gpu", device_kind="A100") == 128
  assert core.segment_alignment("auto", platform="tpu") == 1
  assert core.segment_alignment("auto", platform="cpu") == 1
  assert [core.suffix_alignment("auto", g, platform="gpu", device_kind=H100)
          for g in (1, 4, 8, 16, 64)] == [1, 1, 64, 64, 64]
  assert core.suffix_alignment("auto", 8, GpuConfig(fused_decode=False), platform="gpu",
                               device_kind=H100) == 1


def test_family_choice_and_errors():
  assert core.choose_family("auto", platform="cpu") == "xla"
  assert core.choose_family("auto", platform="gpu", device_kind=H100) == "mosaic_gpu"
  assert core.choose_family("pallas", platform="gpu", device_kind="Tesla T4") == "triton"
  assert core.choose_family("auto", platform="tpu") == "tpu"
  assert core.choose_family("pallas:triton", platform="cpu") == "triton"
  with pytest.raises(ValueError, match="impl must be one of"):
    core.choose_family("cuda")
  with pytest.raises(ValueError, match="needs a GPU or TPU"):
    core.choose_family("pallas", platform="cpu")
  with pytest.raises(ValueError, match="runs on tpu"):
    core.choose_family("pallas:tpu", platform="gpu")
  with pytest.raises(ValueError, match="platform must be one of"):
    core.choose_family("auto", platform="metal")


def test_tpu_plan_block_sizes():
  q, pk, pv, sk, _ = shapes(64, 8, 1, 128, 4096, 128)
  parts = [("prefix", pk, pv, None, None)]
  v6e = tpu.plan(q, parts, sk, device=DeviceInfo.named("TPU v6 lite"))
  assert v6e.chip == "v6e" and v6e.block_sizes == tpu.block_sizes(TpuConfig(chip="v6e"), DEVICE)
  assert len(v6e.prefix_blocks) == 1
  assert tpu.plan(q, parts, sk, config=TpuConfig(chip="v5p"),
                  device=DeviceInfo.named("TPU v6 lite")).chip == "v5p"
  explicit = TpuConfig(block_sizes=tpu.block_sizes(TpuConfig(chip="v5p"), DEVICE))
  assert tpu.plan(q, parts, sk, device=DEVICE, config=explicit).block_sizes == explicit.block_sizes


def test_explain_for_every_target_on_a_cpu():
  args = shapes(1024, 8, 1, 128, 16384, 128)
  hopper = explain(shared_prefix_attention, *args, platform="gpu", device_kind=H100)
  assert hopper.impl == "pallas:mosaic_gpu" and hopper.backend.path == "fused_decode"
  assert "fused_decode" in str(hopper) and "G=8" in str(hopper)
  apart = explain(shared_prefix_attention, *args, platform="gpu", device_kind=H100,
                  config=GpuConfig(fused_decode=False))
  assert apart.backend.path == "split" and apart.backend.prefixes[0].kernel == "mosaic"
  assert explain(shared_prefix_attention, *args, platform="gpu",
                 device_kind="Tesla T4").impl == "pallas:triton"
  on_tpu = explain(shared_prefix_attention, *args, platform="tpu", device_kind="TPU v5 lite",
                   config=TpuConfig(chip="v6e"))
  assert on_tpu.impl == "pallas:tpu" and on_tpu.backend.chip == "v6e"
  assert explain(shared_prefix_attention, *args, platform="cpu").impl == "xla"
  interpreted = explain(shared_prefix_attention, *args, platform="cpu", impl="pallas:mosaic_gpu")
  assert "interpret mode" in str(interpreted)
  full = explain(attention_with_lse, args[0], args[3], args[4], platform="gpu", device_kind=H100)
  assert full.backend.path == "suffix"
  lv = SharedLevel(S((2, 256, 1, 128), BF), S((2, 256, 1, 128), BF), S((2,), jnp.int32),
                   S((1024,), jnp.int32))
  tree = explain(hierarchical_attention, args[0], [lv], args[3], args[4], platform="gpu",
                 device_kind=H100)
  assert tree.backend.path == "split" and tree.backend.prefixes == (None,)


def test_explain_takes_the_lengths_as_shapes_too():
  args = shapes(16, 9, 3, 64, 1024, 64)
  kw = dict(platform="gpu", device_kind=H100)
  lengths = dict(prefix_length=S((), jnp.int32), suffix_lengths=S((16,), jnp.int32))
  plan = explain(shared_prefix_attention, *args, **lengths, **kw)
  assert str(plan) == str(explain(shared_prefix_attention, *args, **kw,
                                  suffix_lengths=jnp.full((16,), 3, jnp.int32)))


def test_explain_checks_its_arguments():
  args = shapes(8, 8, 1, 128, 256, 64)
  with pytest.raises(ValueError, match="fn must be"):
    explain(jax.nn.dot_product_attention, *args)
  with pytest.raises(TypeError, match="take a GpuConfig"):
    explain(shared_prefix_attention, *args, platform="gpu", device_kind=H100, config=TpuConfig())
  with pytest.raises(ValueError, match="the head dims"):
    explain(shared_prefix_attention, args[0], S((256, 1, 64), BF), S((256, 1, 64), BF),
            *args[3:], platform="gpu")


MARKERS = {"flat": "hydragen_flat_attention", "fused_decode": "_fused_jit",
           "split": "hydragen_suffix_attention"}


@pytest.mark.parametrize("b,config", [(4, None), (1024, None), (1024, GpuConfig(fused_decode=False)),
                                      (4, GpuConfig(flat_max_shared_reads=0))])
def test_what_is_lowered_is_what_explain_says(b, config):
  """The CUDA lowering of a call holds the kernels of the path ``explain`` gives for it, and not
  those of the other paths."""
  args = shapes(b, 8, 1, 128, 1024, 128)
  got = explain(shared_prefix_attention, *args, platform="gpu", device_kind=H100,
                impl="pallas:mosaic_gpu", config=config)
  fn = lambda *a: shared_prefix_attention(*a, impl="pallas:mosaic_gpu", config=config)
  checks = [jax.export.DisabledSafetyCheck.custom_call(t)
            for t in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")]
  text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
      *args).mlir_module()
  for path, marker in MARKERS.items():
    assert (marker in text) == (path == got.backend.path), (path, got.backend.path)


@pytest.mark.parametrize("impl,config", [
    ("pallas:triton", None), ("pallas:mosaic_gpu", None),
    ("pallas:mosaic_gpu", GpuConfig(fused_decode=False, flat_max_shared_reads=0)),
    ("pallas:tpu", None), ("pallas:tpu", TpuConfig(chip="v6e")), ("xla", None)])
def test_explain_is_the_plan_the_call_executes(monkeypatch, impl, config):
  """On a CPU (the kernels interpreted): the plan each public function hands to its executor
  equals what ``explain`` returns for the same arguments."""
  from jax_shared_attn import api
  seen = []
  real = api._execute
  monkeypatch.setattr(api, "_execute", lambda plan, call: (seen.append(plan), real(plan, call))[1])
  q, pk, pv, sk, sv = shapes(64, 8, 1, 128, 1024, 128)
  lv = SharedLevel(S((3, 256, 1, 128), BF), S((3, 256, 1, 128), BF), S((3,), jnp.int32),
                   S((64,), jnp.int32))
  kw = dict(impl=impl, config=config)
  calls = [(shared_prefix_attention, (q, pk, pv, sk, sv)),
           (hierarchical_attention, (q, [lv], sk, sv)),
           (attention_with_lse, (q, sk, sv))]
  for fn, args in calls:
    seen.clear()
    jax.eval_shape(lambda *a: fn(*a, **kw), *args)  # traces the executor: nothing runs
    assert seen == [explain(fn, *args, **kw)], fn.__name__
    assert seen[0].impl == impl and (impl == "xla") == isinstance(seen[0].backend, XlaConfig)


@pytest.mark.parametrize("impl", ["pallas:triton", "pallas:tpu"])
def test_the_backward_runs_the_plans_tiles(monkeypatch, impl):
  """The backward kernels take their tiles from the plan (no default chosen inside them): a
  plan with other tiles reaches every kernel call of ``jax.grad``."""
  import dataclasses

  from jax_shared_attn import api
  from pallas_kernels.gpu import backward as gpu_backward
  from pallas_kernels.tpu import backward as tpu_backward
  gpu_tiles = gpu_backward.BackwardKernelConfig(16, 32, num_warps=2)
  module, tiles, key = ((gpu_backward, gpu_tiles, "config") if impl == "pallas:triton"
                        else (tpu_backward, 32, "block_rows"))
  real_plan, real_grads = core.plan, module.part_grads
  planned, seen = [], []

  def plan(*args, **kwargs):
    planned.append(real_plan(*args, **kwargs))
    return dataclasses.replace(planned[-1], backward_tiles=tiles)

  def part_grads(*args, **kwargs):
    seen.append(kwargs[key])
    return real_grads(*args, **kwargs)

  monkeypatch.setattr(api.dispatch, "plan", plan)
  monkeypatch.setattr(module, "part_grads", part_grads)
  k = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(k[0], (2, 1, 4, 16))
  pk, pv = (jax.random.normal(x, (8, 2, 16)) for x in k[1:3])
  sk, sv = (jax.random.normal(x, (2, 4, 2, 16)) for x in k[3:5])
  loss = lambda q, pk: shared_prefix_attention(q, pk, pv, sk, sv, prefix_length=8,
                                               impl=impl).sum()
  jax.eval_shape(jax.grad(loss, argnums=(0, 1)), q, pk)
  assert planned and planned[0].backward_tiles not in (None, tiles)
  assert seen and all(t == tiles for t in seen), seen
