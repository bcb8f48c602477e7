"""Every shipped Triton configuration lowers for CUDA (jax.export on a CPU machine).

The kernels' block sizes, splits and warps come from heuristics of the shape,
so the sweep covers the batch sizes, head dims and GQA ratios that pick
different configurations; a configuration that cannot lower fails here.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

from jax_shared_attn import SharedLevel, hierarchical_attention, shared_prefix_attention
from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import merge
from pallas_kernels.gpu import shared_mgpu_plan as fp
from pallas_kernels.gpu.config import FusedDecodeOptions, GpuConfig, MosaicPrefixOptions

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "mosaic_gpu_v2"
FLAT = "hydragen_flat_attention"
MERGE = "hydragen_merge"
S = jax.ShapeDtypeStruct
H100 = DeviceInfo.named("NVIDIA H100 80GB HBM3")  # the configs of the kernels below are its
MERGE_CONFIG = merge.default_config(H100)


def fused_config(*args, **kw):
  return fp.default_config(*args, device=H100, **kw)


def mosaic_prefix_config(*args, **kw):
  from pallas_kernels.gpu import prefix_mgpu as mg
  return mg.default_config(*args, device=H100, **kw)


def fused_decode(q, k, v, n, sk, sv, sl, *, scale, config=None):
  """The one-kernel decode path directly, with its default config where none is given."""
  from pallas_kernels.gpu import shared_mgpu as fm
  if config is None:
    b, _, hq, d = q.shape
    g = hq // k.shape[1]
    config = fused_config(b * g, k.shape[1], k.shape[0], sk.shape[1], g, head_dim=d)
  return fm.fused_decode(q, k, v, n, sk, sv, sl, scale=scale, config=config, merge=MERGE_CONFIG)


def is_flat(b, tq, hq, hkv, p, d, one_kernel=False, itemsize=2):
  """The small-batch path's rule: at most 64 query rows per KV head, and the batch's reads of
  the shared K/V within the budget (``flat_split_factor`` times larger where the alternative is
  not the one-kernel decode path)."""
  cfg = GpuConfig()
  budget = cfg.flat_max_shared_reads * (1 if one_kernel else cfg.flat_split_factor)
  return 2 * b * p * hkv * d * itemsize <= budget and tq * hq // hkv <= 64


def attention_kernels(text):
  """Triton kernel calls in an exported module, not counting the split-merge kernel's."""
  calls = [line for line in text.splitlines() if TRITON in line]
  return sum(MERGE not in line for line in calls)


def export_cuda(fn, *args):
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (TRITON, MOSAIC)]
  return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


# (B, Hq, Hkv, D, P, S, Tq): B 1..1024 and G 1..8 select different tiles and splits;
# P and S are not multiples of any block.
SWEEP = [(b, hkv * g, hkv, d, 1000 + 17 * b % 93, 100 + b % 29, 1)
         for b, (hkv, g), d in itertools.product([1, 16, 64, 256, 1024], [(1, 8), (8, 4), (2, 1)],
                                                 [128])]
SWEEP += [(b, 8, 1, d, 777, 61, tq) for b, d, tq in itertools.product([3, 300], [64, 80, 256],
                                                                        [1, 4])]
SWEEP += [(1, 32, 8, 128, 2048, 2048, 2048), (4, 8, 1, 64, 100, 300, 257)]  # chunked prefill


@pytest.mark.parametrize("b,hq,hkv,d,p,s,tq", SWEEP)
def test_shared_prefix_attention_exports_for_cuda(b, hq, hkv, d, p, s, tq):
  dt = jnp.bfloat16
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n,
                                                             impl="pallas:triton")
  text = export_cuda(fn, S((b, tq, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                     S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  if is_flat(b, tq, hq, hkv, p, d):  # few sequences: one kernel over shared then own keys
    assert attention_kernels(text) == 1 and FLAT in text
  else:
    assert attention_kernels(text) == 2 and FLAT not in text  # prefix kernel + suffix kernel


# The Hopper family: the prefix on Mosaic GPU where P is a whole number of 128-key
# (D <= 128) or 64-key (D = 256) tiles, Triton otherwise.
MOSAIC_SWEEP = [(b, hkv * g, hkv, d, p, 128 + b % 29, 1)
                for b, (hkv, g), d, p in itertools.product(
                    [1, 16, 256, 1024], [(1, 8), (8, 4)], [64, 128, 256], [1024, 16384])]
MOSAIC_SWEEP += [(3, 8, 1, 128, 777, 61, 2), (40, 32, 8, 80, 1024, 100, 1)]  # Triton fallback


@pytest.mark.parametrize("b,hq,hkv,d,p,s,tq", MOSAIC_SWEEP)
def test_hopper_family_exports_for_cuda(b, hq, hkv, d, p, s, tq):
  dt = jnp.bfloat16
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n,
                                                             impl="pallas:mosaic_gpu")
  text = export_cuda(fn, S((b, tq, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                     S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  if is_flat(b, tq, hq, hkv, p, d):
    assert MOSAIC not in text and attention_kernels(text) == 1 and FLAT in text
    return
  mosaic = d % 64 == 0 and p % (64 if d > 128 else 128) == 0
  assert (MOSAIC in text) == mosaic
  assert attention_kernels(text) == (1 if mosaic else 2)


@pytest.mark.parametrize("b,n,d", [(8, 3, 128), (1024, 16, 128), (96, 40, 64)])
def test_hierarchical_attention_exports_for_cuda(b, n, d):
  dt = jnp.bfloat16
  fn = lambda q, pk, lk, lens, nodes, sk, n_: hierarchical_attention(
      q, [SharedLevel.shared_by_all(pk, pk, b), SharedLevel(lk, lk, lens, nodes)], sk, sk,
      suffix_lengths=n_, impl="pallas:triton")
  text = export_cuda(fn, S((b, 1, 32, d), dt), S((2400, 8, d), dt), S((n, 513, 8, d), dt),
                     S((n,), jnp.int32), S((b,), jnp.int32), S((b, 70, 8, d), dt),
                     S((b,), jnp.int32))
  assert text.count(TRITON) >= 3


def _distinct_fused_cases():
  """Decoding with one prefix whose buffers are whole blocks (P % 128, S % 64), batches 1-1024,
  G 8 and 16, one or two KV heads, D 64 and 128, both step plans: one case per kernel structure
  (one split, a cluster pair, or several splits merged after it; step plan, K/V slots, tile max,
  G and D). The other cases differ from one of these in grid size and constants only."""
  seen, cases = set(), []
  for b, (hkv, g), d, (p, s), spread in itertools.product(
      [1, 16, 1024], [(1, 8), (2, 8), (1, 16)], [64, 128], [(1024, 64), (16384, 192)],
      [True, False]):
    cfg = fused_config(b * g, hkv, p, s, g, head_dim=d,
                            options=FusedDecodeOptions(spread_suffix=spread))
    key = (min(cfg.splits, 3), cfg.cluster_merge, cfg.spread_suffix, cfg.max_concurrent_steps,
           cfg.tile_max_in_kernel, g, d)
    if key not in seen:
      seen.add(key)
      cases.append((b, hkv * g, hkv, d, p, s, spread))
  return cases


@pytest.mark.parametrize("b,hq,hkv,d,p,s,spread", _distinct_fused_cases())
def test_fused_decode_exports_for_cuda(b, hq, hkv, d, p, s, spread):
  """Both step plans (``spread_suffix``: the splits' shares of prefix and suffix steps, or equal
  ranges of "prefix, then suffix") lower for CUDA as ONE Mosaic GPU kernel for prefix and
  suffixes (no Triton kernel)."""
  dt = jnp.bfloat16
  # flat path off: small batches take the one kernel too
  config = GpuConfig(flat_max_shared_reads=0, fused=FusedDecodeOptions(spread_suffix=spread))
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n,
                                                             impl="pallas:mosaic_gpu",
                                                             config=config)
  text = export_cuda(fn, S((b, 1, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                     S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  assert text.count(f"custom_call @{MOSAIC}") == 1 and "private @_fused_jit" in text
  assert attention_kernels(text) == 0  # no Triton kernel but the split merge's


# The small-batch path on both families: G 1..8, D 64/80/128/256, Tq 1 and 4 (causal inside
# the own keys), buffers off the block multiples.
FLAT_SWEEP = [(b, hkv * g, hkv, d, p, s, tq, impl)
              for b, (hkv, g), d, (p, s), tq, impl in itertools.product(
                  [1, 3, 16], [(1, 8), (8, 4), (2, 1)], [64, 80, 128, 256],
                  [(1024, 128), (777, 61)], [1, 4], ["pallas:triton", "pallas:mosaic_gpu"])
              if tq * g <= 64 and (b == 3 or (tq == 1 and d == 128)) and b * p * hkv * d * 4 <= 2**24]


@pytest.mark.parametrize("b,hq,hkv,d,p,s,tq,impl", FLAT_SWEEP)
def test_flat_path_exports_for_cuda(b, hq, hkv, d, p, s, tq, impl):
  dt = jnp.bfloat16
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n,
                                                             impl=impl)
  text = export_cuda(fn, S((b, tq, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                     S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  # the flat kernel, and the merge kernel where it splits the keys
  assert attention_kernels(text) == 1 and FLAT in text and MOSAIC not in text


@pytest.mark.parametrize("counts,lead,d,in_dtype,out_dtype", [
    ((2,), (1, 8192), 128, jnp.bfloat16, jnp.bfloat16),  # the one-kernel path's 2 key splits
    ((16,), (1, 16, 8), 128, jnp.float32, jnp.bfloat16),  # the flat path's splits
    ((3, 1, 5), (8, 5, 12), 80, jnp.float32, jnp.float32),  # suffix splits + priors, D = 80
    ((32,), (2, 40), 256, jnp.float32, jnp.float32),  # many prefix splits, D = 256
    ((1,), (1, 1), 64, jnp.float16, jnp.float16),
])
def test_merge_kernel_exports_for_cuda(counts, lead, d, in_dtype, out_dtype):
  from pallas_kernels.gpu.merge import merge_parts
  args = [x for n in counts for x in (S((n, *lead, d), in_dtype), S((n, *lead), jnp.float32))]
  fn = lambda *a: merge_parts(list(zip(a[::2], a[1::2])), out_dtype=out_dtype,
                              config=MERGE_CONFIG)
  text = export_cuda(fn, *args)
  assert text.count(TRITON) == 1 and MERGE in text


def test_flat_path_switch_and_limits():
  """``flat_max_shared_reads=0`` turns the path off; reads of the shared K/V past the budget,
  more than 64 query rows per KV head, a tree level or an empty suffix buffer take the other
  paths."""
  dt = jnp.bfloat16

  def export(b, tq, hq, s, impl="pallas:triton", config=None):
    fn = lambda q, pk, pv, sk, sv: shared_prefix_attention(q, pk, pv, sk, sv, impl=impl,
                                                           config=config)
    return export_cuda(fn, S((b, tq, hq, 128), dt), S((1024, 1, 128), dt),
                       S((1024, 1, 128), dt), S((b, s, 1, 128), dt), S((b, s, 1, 128), dt))

  assert FLAT in export(4, 1, 8, 128)
  assert FLAT not in export(4, 1, 8, 128, config=GpuConfig(flat_max_shared_reads=0))
  per_seq = 2 * 1024 * 128 * 2  # shared K/V bytes one sequence reads
  small = GpuConfig(flat_max_shared_reads=16 * per_seq, flat_split_factor=3)
  n = 16 * small.flat_split_factor  # against two kernels: flat_split_factor x the budget
  assert FLAT in export(n, 1, 8, 128, config=small)
  assert FLAT not in export(n + 1, 1, 8, 128, config=small)
  # Against the one-kernel decode path (Hopper family, G = 8, whole blocks): the budget itself.
  assert FLAT in export(16, 1, 8, 128, "pallas:mosaic_gpu", small)
  text = export(17, 1, 8, 128, "pallas:mosaic_gpu", small)
  assert FLAT not in text and "_fused_jit" in text
  default = GpuConfig()
  assert FLAT not in export(default.flat_max_shared_reads * default.flat_split_factor // per_seq
                            + 1, 1, 8, 128)
  assert FLAT not in export(4, 9, 8, 128)  # 72 rows per KV head
  assert FLAT not in export(4, 1, 8, 0)
  fn = lambda q, pk, lk, lens, nodes, sk: hierarchical_attention(
      q, [SharedLevel.shared_by_all(pk, pk, 4), SharedLevel(lk, lk, lens, nodes)], sk, sk,
      impl="pallas:triton")
  text = export_cuda(fn, S((4, 1, 8, 128), dt), S((1024, 1, 128), dt), S((2, 64, 1, 128), dt),
                     S((2,), jnp.int32), S((4,), jnp.int32), S((4, 128, 1, 128), dt))
  assert FLAT not in text


def test_fused_decode_off_switch_and_limits():
  """``GpuConfig(fused_decode=False)`` and shapes outside the kernel's limits take the split
  path."""
  dt = jnp.bfloat16

  def export(b, tq, p, s, d=128, config=None):
    fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv,
                                                               suffix_lengths=n,
                                                               impl="pallas:mosaic_gpu",
                                                               config=config)
    return export_cuda(fn, S((b, tq, 8, d), dt), S((p, 1, d), dt), S((p, 1, d), dt),
                       S((b, s, 1, d), dt), S((b, s, 1, d), dt), S((b,), jnp.int32))

  assert "_fused_jit" in export(64, 1, 1024, 128)
  assert "_fused_jit" not in export(64, 1, 1024, 128, config=GpuConfig(fused_decode=False))
  for b, tq, p, s, d in [(64, 2, 1024, 128, 128),  # Tq > 1
                         (64, 1, 1024, 100, 128),  # suffix capacity not whole 64-key blocks
                         (64, 1, 1000, 128, 128),  # prefix not whole 128-key blocks
                         (64, 1, 1024, 128, 256)]:  # D = 256
    text = export(b, tq, p, s, d)
    assert "_fused_jit" not in text and TRITON in text
  # G = 4 (Llama-3-8B): 16x wasted suffix products; the kernels run apart.
  fn = lambda q, pk, pv, sk, sv: shared_prefix_attention(q, pk, pv, sk, sv,
                                                         impl="pallas:mosaic_gpu")
  text = export_cuda(fn, S((64, 1, 32, 128), dt), S((1024, 8, 128), dt), S((1024, 8, 128), dt),
                     S((64, 128, 8, 128), dt), S((64, 128, 8, 128), dt))
  assert "_fused_jit" not in text and TRITON in text


@pytest.mark.parametrize("g", [1, 2, 4, 8, 16, 32, 64])
def test_fused_kernel_exports_for_every_group_size(g):
  """The kernel itself takes any G dividing 64 (the dispatcher uses it for G >= 8)."""
  dt = jnp.bfloat16
  fn = lambda q, k, v, n, sk, sv, sl: fused_decode(q, k, v, n, sk, sv, sl, scale=0.1)
  b = 37
  text = export_cuda(fn, S((b, 1, 2 * g, 128), dt), S((256, 2, 128), dt), S((256, 2, 128), dt),
                     S((), jnp.int32), S((b, 128, 2, 128), dt), S((b, 128, 2, 128), dt),
                     S((b,), jnp.int32))
  assert text.count(f"custom_call @{MOSAIC}") == 1


@pytest.mark.parametrize("d", [64, 128])
def test_kv_slots_follow_the_shared_memory(d):
  """``stages`` options: three K/V slots where ``smem_bytes`` says they fit, and those configurations
  lower for CUDA (Mosaic GPU checks a kernel's shared memory when it lowers); four fit at D = 64
  only, and Mosaic GPU agrees. The one kernel fits three slots only since its
  LSE is stored from registers (with a staging tile it was 168 bytes over at D = 128)."""
  from pallas_kernels.gpu import prefix_mgpu as mg
  dt = jnp.bfloat16
  b, g, p, s = 256, 8, 2048, 128
  fused_cfg = lambda stages=2: fused_config(b * g, 1, p, s, g, head_dim=d,
                                                 options=FusedDecodeOptions(stages=stages))
  prefix_cfg = lambda keys, dim, stages=2: mosaic_prefix_config(
      b * g, 1, keys, dim, options=MosaicPrefixOptions(stages=stages))

  def lower_fused(cfg):
    fn = lambda q, k, v, sk, sv, n: fused_decode(q, k, v, p, sk, sv, n, scale=0.1, config=cfg)
    return export_cuda(fn, S((b, 1, g, d), dt), S((p, 1, d), dt), S((p, 1, d), dt),
                       S((b, s, 1, d), dt), S((b, s, 1, d), dt), S((b,), jnp.int32))

  def lower_prefix(cfg, keys=4096):
    fn = lambda q, k, v: mg.prefix_attention_rows_mgpu(q, k, v, keys, scale=0.1, config=cfg)
    return export_cuda(fn, S((1, b * g, d), dt), S((keys, 1, d), dt), S((keys, 1, d), dt))

  assert fused_cfg().max_concurrent_steps == 2 and prefix_cfg(4096, d).max_concurrent_steps == 2
  cfg = fused_cfg(3)
  assert cfg.max_concurrent_steps == 3
  assert MOSAIC in lower_fused(cfg)
  pcfg = prefix_cfg(4096, d, 3)
  assert (pcfg.block_kv, pcfg.max_concurrent_steps) == (128, 3)
  assert MOSAIC in lower_prefix(pcfg)
  # 8K keys per split: 192-key steps, two slots (three do not fit)
  wide = mosaic_prefix_config(8192, 1, 16384, 128, options=MosaicPrefixOptions(stages=3))
  assert (wide.block_kv, wide.max_concurrent_steps) == (192, 2)
  assert prefix_cfg(4096, 256, 3).max_concurrent_steps == 2
  # Four slots: the model and Mosaic GPU agree (they fit at D = 64, not at D = 128), and the
  # defaults take them only where they fit.
  four = dataclasses.replace(fused_cfg(), max_concurrent_steps=4)
  fits = fp.smem_bytes(four, d) <= fp.SMEM_LIMIT
  assert fits == (d == 64)
  assert fused_cfg(4).max_concurrent_steps == (4 if fits else 2)
  if fits:
    assert MOSAIC in lower_fused(four)
  else:
    with pytest.raises(Exception, match="shared memory"):
      lower_fused(four)


@pytest.mark.parametrize("block_kv,splits,d,stages", [(128, 2, 128, 2), (192, 2, 128, 2),
                                                     (128, 1, 64, 3), (64, 3, 256, 2)])
def test_prefix_kernel_overlap_exports_for_cuda(block_kv, splits, d, stages):
  """The Mosaic prefix kernel with the intra-warpgroup overlap (``MosaicPrefixConfig.overlap``)
  lowers for CUDA with 128-, 192- and 64-key steps, two or three K/V slots; its module differs
  from the kernel's without it."""
  from pallas_kernels.gpu import prefix_mgpu as mg
  dt, keys = jnp.bfloat16, 4096

  def lower(cfg):
    fn = lambda q, k, v: mg.prefix_attention_rows_mgpu(q, k, v, keys, scale=0.1, config=cfg)
    return export_cuda(fn, S((1, 1024, d), dt), S((keys, 1, d), dt), S((keys, 1, d), dt))

  cfg = mg.MosaicPrefixConfig(64, block_kv, stages, splits)
  over = lower(dataclasses.replace(cfg, overlap=True))
  assert MOSAIC in over and over != lower(cfg)


@pytest.mark.parametrize("b,g,d,extra", [(1024, 8, 128, {}), (300, 8, 64, {}), (100, 16, 128, {}),
                                         (256, 8, 128, {"max_concurrent_steps": 3})])
def test_fused_tile_max_in_kernel_exports_for_cuda(b, g, d, extra):
  """With ``tile_max_in_kernel`` the one kernel lowers without XLA's reduction of the suffix
  lengths before it (and with it otherwise); G < 8 (more than MAX_TILE_LOADS sequences per CTA)
  keeps the reduction."""
  dt, p, s = jnp.bfloat16, 1024, 128

  def lower(cfg):
    fn = lambda q, k, v, sk, sv, n: fused_decode(q, k, v, p, sk, sv, n, scale=0.1, config=cfg)
    return export_cuda(fn, S((b, 1, g, d), dt), S((p, 1, d), dt), S((p, 1, d), dt),
                       S((b, s, 1, d), dt), S((b, s, 1, d), dt), S((b,), jnp.int32))

  cfg = dataclasses.replace(fused_config(b * g, 1, p, s, g, head_dim=d), **extra)
  assert not fused_config(b * 4, 1, p, s, 4, head_dim=d).tile_max_in_kernel
  assert cfg.tile_max_in_kernel
  inside = lower(cfg)
  assert MOSAIC in inside and "stablehlo.reduce" not in inside
  assert "stablehlo.reduce" in lower(dataclasses.replace(cfg, tile_max_in_kernel=False))


@pytest.mark.parametrize("options", [MosaicPrefixOptions(), MosaicPrefixOptions(overlap=False),
                                     MosaicPrefixOptions(wide_min_keys=0),
                                     MosaicPrefixOptions(wide_min_keys=2048)])
def test_prefix_wide_steps_and_overlap_follow_the_options(options):
  """``default_config`` takes 192-key steps exactly where a split covers at least
  ``wide_min_keys`` keys at D <= 128 (never with 0), and overlaps exactly the 128-key steps at
  D = 128 where ``overlap`` is on (192-key steps' S, P and O do not fit in the registers; D 64
  and 256 were not measured)."""
  for rows, keys, d in itertools.product([128, 8192], [1024, 4096, 16384], [64, 128, 256]):
    cfg = mosaic_prefix_config(rows, 1, keys, d, options=options)
    wide = (d <= 128 and options.wide_min_keys > 0
            and keys // cfg.splits >= options.wide_min_keys)
    assert (cfg.block_kv == 192) == wide, (rows, keys, d, cfg)
    assert cfg.overlap == (options.overlap and cfg.block_kv == 128 and d == 128), (rows, keys, d)


# Suffix capacity 100 takes the split path (the prefix kernel), 128 the one-kernel decode path.
@pytest.mark.parametrize("capacity,function", [(100, "_mosaic_rows"), (128, "_fused_jit")])
def test_mosaic_kernel_lowered_once_per_shape(capacity, function):
  """A model calls the kernel once per layer with the same shapes: the compiled module holds one
  copy of the Mosaic GPU kernel (one lowering, one GPU compilation), not one per call (32
  copies made the first Llama-3-8B decode call compile for ~60 s on an H100)."""
  dt = jnp.bfloat16

  def layers(q, pk, pv, sk, sv, n):
    outs = []
    for _ in range(4):
      # flat path off: 64 sequences of a 1K prefix would take it at capacity 100
      out = shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n, impl="pallas:mosaic_gpu",
                                    config=GpuConfig(flat_max_shared_reads=0))
      outs.append(out)
      q = out.astype(dt)
    return outs

  kv = S((64, capacity, 1, 128), dt)
  text = export_cuda(layers, S((64, 1, 8, 128), dt), S((1024, 1, 128), dt),
                     S((1024, 1, 128), dt), kv, kv, S((64,), jnp.int32))
  assert text.count(f"private @{function}") == 1, "the kernel's function is not shared"
  assert text.count(f"custom_call @{MOSAIC}") == 1


@pytest.mark.parametrize("hq,hkv,merge_kernel", [(8, 1, True), (32, 8, False)])
def test_split_merge_kernel_only_where_no_transpose_follows(hq, hkv, merge_kernel):
  """Head-major rows (``flat_sequence_major=False``). One KV head: the flat path's splits merge
  in the merge kernel. Several: XLA merges them, fused into the transpose back to
  [B, Tq, Hq, D] (merge_kernel.merge_parts)."""
  dt = jnp.bfloat16
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(
      q, pk, pv, sk, sv, suffix_lengths=n, impl="pallas:triton",
      config=GpuConfig(flat_sequence_major=False))
  b, d, p, s = 16, 128, 1024, 128
  text = export_cuda(fn, S((b, 1, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                     S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  assert FLAT in text and (MERGE in text) == merge_kernel


@pytest.mark.parametrize("hq,hkv", [(8, 1), (32, 8)])
@pytest.mark.parametrize("tq,transposes", [(1, 0), (3, 2)])
def test_flat_path_sequence_major(hq, hkv, tq, transposes):
  """By default (``flat_sequence_major``) the flat path reads q and writes its output as
  [B, Hkv, Tq*G, D]: in decoding both are [B, 1, Hq, D] reshaped, so no transpose runs and the
  splits merge in the merge kernel (which writes the final layout). With Tq > 1 and several KV
  heads the rows are folded and unfolded by transposes."""
  dt = jnp.bfloat16
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n,
                                                             impl="pallas:triton")
  b, d, p, s = 16, 128, 1024, 128
  text = export_cuda(fn, S((b, tq, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                     S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  assert FLAT in text and MERGE in text
  assert text.count("stablehlo.transpose") == (0 if hkv == 1 else transposes)


@pytest.mark.parametrize("tq,transposes", [(1, 1), (3, 2)])
def test_decode_output_written_in_place(tq, transposes):
  """Several KV heads, one key split: the suffix kernel writes the sequence-major layout, which
  in decoding (Tq = 1) is [B, 1, Hq, D] itself; the only transpose left is the query fold for
  the prefix kernel. With Tq > 1 the output goes back to [B, Tq, Hq, D] by a second one."""
  dt = jnp.bfloat16
  fn = lambda q, pk, pv, sk, sv, n: shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=n,
                                                             impl="pallas:triton")
  b, hq, hkv, d, p, s = 256, 32, 8, 128, 1024, 128
  text = export_cuda(fn, S((b, tq, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                     S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
  assert attention_kernels(text) == 2 and MERGE not in text
  assert text.count("stablehlo.transpose") == transposes


def test_mosaic_ir_fingerprints_tell_kernels_apart():
  """``tools/mosaic_ir.py`` (how a kernel refactor is checked without a GPU): the lowered module
  of one export, without debug info, is the same on a repeat through a caller on other source
  lines, and differs between two step plans that change the kernel. (Its first use: the
  ``wait_on`` refactor of shared_mgpu.py, which moved the kernel's own lines, left
  every module of tools/mosaic_ir.py's list identical.)"""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parents[2] / "tools" / "mosaic_ir.py"
  spec = importlib.util.spec_from_file_location("mosaic_ir", path)
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  dt = jnp.bfloat16
  b, g, d, p, s = 300, 8, 64, 384, 64
  ins = (S((b, 1, g, d), dt), S((p, 1, d), dt), S((p, 1, d), dt), S((b, s, 1, d), dt),
         S((b, s, 1, d), dt), S((b,), jnp.int32))
  plan = lambda spread: fused_config(b * g, 1, p, s, g, head_dim=d,
                                          options=FusedDecodeOptions(spread_suffix=spread))
  # A fresh function per export (jax.jit would reuse a function's trace and lowering).
  fn = lambda cfg: lambda q, k, v, sk, sv, n: fused_decode(q, k, v, p, sk, sv, n, scale=0.1,
                                                              config=cfg)
  # The same function written elsewhere in this file (other source lines, other locations).
  fn2 = lambda q, k, v, sk, sv, n: (
      fused_decode(q, k, v, p, sk, sv, n, scale=0.1, config=plan(False)))
  ranges = tool.modules(fn(plan(False)), *ins)
  again = tool.modules(fn2, *ins)
  with pytest.raises(ValueError, match="not exported before"):
    tool.modules(fn2, *ins)
  spread = tool.modules(fn(plan(True)), *ins)
  assert len(ranges) == 1 and len(spread) == 1 and len(ranges[0]) > 10_000
  assert ranges == again and ranges != spread
  assert "loc(" not in ranges[0]


@pytest.mark.parametrize("b,g,hkv,d,p,s,extra", [
    (1024, 8, 1, 128, 16384, 128, {}),  # 2 splits (the paper's headline)
    (512, 8, 1, 128, 4096, 128, {}),  # 4 splits
    (700, 8, 2, 64, 2048, 64, {"splits": 3, "spread_suffix": True}),
    (1024, 8, 1, 128, 1024, 128, {"max_concurrent_steps": 3}),
    (300, 16, 1, 128, 1024, 192, {"splits": 2, "tile_max_in_kernel": True})])
def test_fused_cluster_merge_exports_for_cuda(b, g, hkv, d, p, s, extra):
  """With ``cluster_merge`` the one kernel merges its key splits itself: it lowers for CUDA as a
  cluster kernel (2-4 splits), and the module has no merge kernel after it (it does without).
  ``default_config`` takes it with two splits only, and not with the option off."""
  from pallas_kernels.gpu import shared_mgpu as fm
  dt = jnp.bfloat16

  def lower(cfg):
    fn = lambda q, k, v, sk, sv, n: fused_decode(q, k, v, p, sk, sv, n, scale=0.1, config=cfg)
    return export_cuda(fn, S((b, 1, g * hkv, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                       S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))

  cfg = fused_config(b * g, hkv, p, s, g, head_dim=d)
  assert cfg.cluster_merge == (cfg.splits == 2)
  assert not fused_config(b * g, hkv, p, s, g, head_dim=d,
                               options=FusedDecodeOptions(cluster_merge=False)).cluster_merge
  assert not fused_config(256 * 8, 1, 4096, 128, 8).cluster_merge  # 8 splits
  cfg = dataclasses.replace(cfg, cluster_merge=True, **extra)
  assert 2 <= cfg.splits <= fp.MAX_CLUSTER_SPLITS
  inside = lower(cfg)
  assert inside.count(f"custom_call @{MOSAIC}") == 1 and MERGE not in inside
  assert MERGE in lower(dataclasses.replace(cfg, cluster_merge=False)) or hkv > 1
  for bad in ({"splits": 1}, {"splits": 8}):
    with pytest.raises(ValueError, match="cluster_merge needs"):
      jax.eval_shape(lambda *a: fm.fused_rows_mgpu(
          *a, rows_per_seq=g, scale=0.1, config=dataclasses.replace(cfg, **bad)),
          S((hkv, -(-b * g // 128) * 128, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
          S((1,), jnp.int32),
          S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32))
