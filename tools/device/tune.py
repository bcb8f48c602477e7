"""Device tuning sweep: each kernel alone over its knobs, against the ceilings.

Run on the GPU machine: ``PYTHONPATH=. python3 tools/device/tune.py [mosaic] [wide] [triton] [suffix]
[name:B:P ...]`` (``wide``: 128- against 192-key steps of the Mosaic prefix kernel; ``name:B:P``
restricts the prefix shapes).
Prints one table; a development tool (the benchmark of record is
``python -m jax_shared_attn.bench attention``).
"""

import functools
import itertools
import sys

import jax
import jax.numpy as jnp

from jax_shared_attn.bench import timing
from pallas_kernels.gpu import prefix_attention_mgpu as mg
from pallas_kernels.gpu.prefix_attention import PrefixConfig, prefix_attention_rows
from pallas_kernels.gpu.suffix_attention import SuffixConfig, suffix_rows

bf16 = jnp.bfloat16
PREFIX_SHAPES = [("paper", 1024, 8, 1, 16384), ("paper", 256, 8, 1, 4096),
                 ("llama", 1024, 32, 8, 2048), ("llama", 256, 32, 8, 2048),
                 ("llama", 1024, 32, 8, 16384), ("llama", 1024, 32, 8, 4096),
                 ("llama", 1024, 32, 8, 8192), ("llama", 256, 32, 8, 16384),
                 ("paper", 1024, 8, 1, 4096), ("paper", 1024, 8, 1, 8192)]
# (name, B, Hq, Hkv, capacity, lengths): "full", or "ragged" (uniform in [1, capacity], as in
# the middle of a decode run), or an int. Each suffix call merges one bf16 prior (the prefix).
SUFFIX_SHAPES = [("paper", 1024, 8, 1, 128, "full"), ("llama", 1024, 32, 8, 136, "ragged"),
                 ("llama", 1024, 32, 8, 24, 18), ("llama", 256, 32, 8, 136, "ragged"),
                 ("paper", 64, 8, 1, 512, "full")]
SUFFIX_CONFIGS = [(128, 4, 2, 1), (128, 4, 1, 1), (64, 4, 2, 1), (64, 4, 1, 1), (64, 8, 2, 1),
                  (32, 4, 2, 1), (32, 4, 3, 1), (32, 2, 2, 1), (16, 4, 2, 1), (16, 2, 3, 1),
                  (64, 4, 2, 2), (32, 4, 2, 4)]


def rnd(i, shape):
  return jax.random.normal(jax.random.key(i), shape, bf16)


def main(what):
  rows_out = []

  def record(group, cfg, fn, make, n_sets, work, unit):
    try:
      t = timing.device_time(fn, make, n_sets=n_sets, trials=5)
      rows_out.append((group, cfg, t * 1e6, work / t / unit))
    except Exception as e:
      rows_out.append((group, cfg, -1.0, str(e).splitlines()[0][:100]))
    r = rows_out[-1]
    print(f"{r[0]:40s} {r[2]:9.1f} us {r[3] if isinstance(r[3], str) else f'{r[3]:8.1f}'}  {r[1]}",
          flush=True)

  only = {w for w in what if ":" in w}  # e.g. llama:1024:4096 (name:B:P) restricts the shapes
  for name, b, hq, hkv, p in PREFIX_SHAPES:
    if only and f"{name}:{b}:{p}" not in only:
      continue
    d, r = 128, b * hq // hkv
    flops = 4 * r * hkv * p * d
    make = lambda i: (rnd(3 * i, (hkv, r, d)), rnd(3 * i + 1, (p, hkv, d)), rnd(3 * i + 2, (p, hkv, d)))
    n_sets = timing.sets_needed(2 * p * hkv * d * 2)
    group = f"prefix {name} B={b} P={p} (TFLOP/s)"
    if "mosaic" in what or "wide" in what:
      base = mg.default_config(r, hkv, p, d)
      steps_list = ([(128, 2), (64, 3), (64, 4)] if "mosaic" in what
                    else [(128, 2), (192, 2)])
      for (bkv, steps), splits in itertools.product(steps_list, sorted({1, 2, base.splits})):
        cfg = mg.MosaicPrefixConfig(64, bkv, steps, splits)
        fn = functools.partial(lambda q, k, v, cfg: mg.prefix_attention_rows_mgpu(
            q, k, v, jnp.int32(p), scale=d**-0.5, config=cfg), cfg=cfg)
        record(group, f"mosaic {cfg}", fn, make, n_sets, flops, 1e12)
    if "triton" in what:
      for bm, bn, warps, stages in [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3)]:
        cfg = PrefixConfig(bm, bn, 2 if b * hq // hkv * hkv <= 8192 else 1, warps, stages)
        fn = functools.partial(prefix_attention_rows, kv_length=jnp.int32(p), scale=d**-0.5, config=cfg)
        record(group, f"triton {cfg}", fn, make, n_sets, flops, 1e12)

  if "suffix" in what:
    for name, b, hq, hkv, s, lens in SUFFIX_SHAPES:
      d, g = 128, hq // hkv
      if lens == "full":
        lengths = jnp.full((b,), s, jnp.int32)
      elif lens == "ragged":
        lengths = jax.random.randint(jax.random.key(7), (b,), 1, s + 1, jnp.int32)
      else:
        lengths = jnp.full((b,), lens, jnp.int32)
      nbytes = 2 * int(lengths.sum()) * hkv * d * 2
      make = lambda i: (rnd(5 * i, (hkv, b, g, d)), rnd(5 * i + 1, (b, s, hkv, d)),
                        rnd(5 * i + 2, (b, s, hkv, d)), rnd(5 * i + 3, (1, hkv, b, g, d)),
                        jax.random.normal(jax.random.key(5 * i + 4), (1, hkv, b, g)))
      for bn, warps, stages, splits in SUFFIX_CONFIGS:
        cfg = SuffixConfig(bn, splits, warps, stages)
        fn = functools.partial(lambda q, k, v, po, pl_, cfg, lengths: suffix_rows(
            q, k, v, lengths, [(po, pl_)], q_len=1, causal=True, scale=d**-0.5,
            out_dtype=bf16, config=cfg), cfg=cfg, lengths=lengths)
        record(f"suffix {name} B={b} S={s} len={lens} (GB/s)", str(cfg), fn, make,
               timing.sets_needed(nbytes), nbytes, 1e9)

  groups = {}
  for row in rows_out:
    groups.setdefault(row[0], []).append(row)
  for key, rs in groups.items():
    ok = sorted([r for r in rs if r[2] > 0], key=lambda r: r[2])
    bad = [r for r in rs if r[2] <= 0]
    print(f"\n== {key}: {len(ok)} ok, {len(bad)} failed" + (f" (e.g. {bad[0][1]}: {bad[0][3]})" if bad else ""))
    for r in ok[:5]:
      print(f"  {r[2]:9.1f} us  {r[3]:7.1f}  {r[1]}")
    if ok:
      print(f"  worst {ok[-1][2]:9.1f} us  {ok[-1][3]:7.1f}  {ok[-1][1]}")
  sys.stdout.flush()


if __name__ == "__main__":
  main(set(sys.argv[1:]) or {"mosaic", "triton", "suffix"})
