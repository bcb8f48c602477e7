"""What could a role-partitioned one-launch kernel reach? HBM read bandwidth against the number of
SMs that stream, and the prefix kernel's time, on the same H100 (device experiment).

  PYTHONPATH=. python3 tools/device/sm_partition.py --out $OUT

Question. The roofline goal of issue 3 is missed where the floor takes the larger of the prefix
FLOPs and the suffix bytes but our kernels pay both: the one kernel runs the suffix steps on the
SMs that run the prefix product (each costs about a prefix step), and the two kernels apart run
one after the other (XLA does not overlap them, docs/results/2026-11-24-h100-streams-partition).
The one design named and not built is a persistent launch whose CTAs take either role: N_s SMs
stream the suffixes while the other 132 - N_s run the prefix product (stream-K: key ranges that
cross row tiles, merged by LSE). Before building it, this measures the two numbers that bound it:

- ``BW(N)``: HBM read bandwidth of N whole-SM CTAs that do nothing but stream a large array
  through shared memory with the bulk tensor copy engine (TMA), ``stages`` copies in flight per
  CTA (``block`` rows of 128 bf16 each, 16-32 KB per copy). One CTA per SM is forced by the
  shared memory each CTA holds (>= 120 KB). This is an upper bound on what a suffix CTA, which
  also multiplies and merges, could stream.
- ``T_p``: the shipped Mosaic GPU prefix kernel alone at each configuration (its own key
  splits; CTA count ``C_p``).

and then, per configuration, the partition bound
``min over N_s of max(T_p * C_p / min(C_p, 132 - N_s), suffix_bytes / BW(N_s))``: perfect
stream-K balance of the prefix over the remaining SMs, no merge and no suffix arithmetic (each
optimistic), against the floor of the attention benchmark (``max(bytes / copy bandwidth,
FLOPs / matmul rate)``, measured in the same run).

Writes ``sm_partition.json`` and ``sm_partition.md``; prints the tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_shared_attn.bench import timing
from jax_shared_attn.bench.attention import parse_spec
from pallas_kernels.gpu import prefix_attention_mgpu as mg

COLS = 128  # bf16 elements per row of the streamed array (256 bytes)
MIN_SMEM = 120 * 1024  # more than half an SM's shared memory: one CTA per SM
DEFAULT_CONFIGS = ",".join(
    f"{shape}:{b}:{p}:{s}" for shape in ("paper", "llama-3-8b") for b in (256, 1024)
    for p in (4096, 16384) for s in (128, 512))


@functools.lru_cache(maxsize=None)
def stream_op(n_ctas: int, blocks_per_cta: int, block: int, stages: int):
  """``x [n_ctas * blocks_per_cta, block, COLS]`` -> each CTA's last block ``[n_ctas, block,
  COLS]``, after streaming its ``blocks_per_cta`` blocks through ``stages`` shared-memory slots
  (a slot's next copy is issued as soon as its last one lands: nothing reads the slots)."""
  if blocks_per_cta < stages:
    raise ValueError(f"blocks_per_cta ({blocks_per_cta}) < stages ({stages})")
  block_bytes = block * COLS * 2
  slots = max(stages, -(-MIN_SMEM // block_bytes))

  def stream(x_ref, o_ref, smem, barriers):
    cta = lax.axis_index("cta")
    base = cta * blocks_per_cta

    def issue(i, slot):
      plgpu.copy_gmem_to_smem(x_ref.at[base + i], smem.at[slot], barriers.at[slot])

    for s in range(stages):
      issue(s, s)

    @pl.loop(0, blocks_per_cta)
    def _(i):
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(barriers.at[slot])

      @pl.when(i + stages < blocks_per_cta)
      def _():
        issue(i + stages, slot)

    last = (blocks_per_cta - 1) % stages
    plgpu.copy_smem_to_gmem(smem.at[last], o_ref.at[cta])
    plgpu.wait_smem_to_gmem(0)

  def body(x_ref, o_ref):  # scratch through run_scoped: plgpu.kernel's keyword for it differs
    pl.run_scoped(lambda smem, barriers: stream(x_ref, o_ref, smem, barriers),
                  plgpu.SMEM((slots, block, COLS), jnp.bfloat16),
                  plgpu.Barrier(num_barriers=stages))

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((n_ctas, block, COLS), jnp.bfloat16),
      grid=(n_ctas,),
      grid_names=("cta",),
  )


def stream_bandwidth(n_ctas: int, *, block: int, stages: int, total_bytes: int, trials: int):
  """Bytes per second read by :func:`stream_op` with ``n_ctas`` CTAs (about ``total_bytes``),
  and whether each CTA's output is its last block."""
  block_bytes = block * COLS * 2
  per_cta = max(stages, total_bytes // (n_ctas * block_bytes))
  n_blocks = n_ctas * per_cta
  op = stream_op(n_ctas, per_cta, block, stages)

  def make(i):
    return (jax.random.normal(jax.random.key(i), (n_blocks, block, COLS), jnp.bfloat16),)

  n_sets = timing.sets_needed(n_blocks * block_bytes)
  res = timing.measure(op, make, n_sets=n_sets, trials=trials)
  (x,) = make(0)
  ok = bool(jnp.array_equal(jax.jit(op)(x), x[per_cta - 1::per_cta]))
  return n_blocks * block_bytes / res["seconds"], ok


def prefix_time(spec: str, trials: int):
  """Device seconds of the shipped prefix kernel at ``spec``'s shape and its CTA count."""
  _, shape = parse_spec(spec)
  b, p, hq, hkv, d = shape.batch, shape.prefix, shape.q_heads, shape.kv_heads, shape.head_dim
  r = b * hq // hkv
  cfg = mg.default_config(r, hkv, p, d)

  def make(i):
    ks = jax.random.split(jax.random.key(i), 3)
    return (jax.random.normal(ks[0], (hkv, r, d), jnp.bfloat16),
            jax.random.normal(ks[1], (p, hkv, d), jnp.bfloat16),
            jax.random.normal(ks[2], (p, hkv, d), jnp.bfloat16))

  op = lambda q, k, v: mg.prefix_attention_rows_mgpu(q, k, v, jnp.int32(p), scale=d ** -0.5,
                                                     config=cfg)
  n_sets = timing.sets_needed(2 * p * hkv * d * 2 + hkv * r * d * 2)
  res = timing.measure(op, make, n_sets=n_sets, trials=trials)
  ctas = hkv * (r // (2 * cfg.block_q)) * cfg.splits
  return res["seconds"], ctas, str(cfg), shape


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--ctas", default="2,4,8,12,16,20,24,32,48,64,96,132")
  ap.add_argument("--variants", default="64x4,64x8,128x2,128x4,128x6",
                  help="block rows x stages (a block is rows x 128 bf16)")
  ap.add_argument("--stream-bytes", type=int, default=128 * 2**20)
  ap.add_argument("--configs", default=DEFAULT_CONFIGS)
  ap.add_argument("--trials", type=int, default=5)
  args = ap.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  kind = jax.devices()[0].device_kind
  sms = getattr(jax.devices()[0], "core_count", 132) if on_gpu else 132
  copy_bw = timing.copy_bandwidth() if on_gpu else timing.copy_bandwidth(n_bytes=2**24)
  rate = timing.matmul_rate() if on_gpu else timing.matmul_rate(n=512)
  print(f"device {kind}, {sms} SMs, jax {jax.__version__}, copy {copy_bw / 1e9:.0f} GB/s, "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)

  # 1. Read bandwidth against the number of streaming SMs.
  ctas = [int(c) for c in args.ctas.split(",") if int(c) <= sms]
  variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
  bw_rows = []
  for block, stages in variants:
    row = {"block": block, "stages": stages, "bytes_per_copy": block * COLS * 2, "gbps": {},
           "ok": True}
    for n in ctas:
      try:
        bw, ok = stream_bandwidth(n, block=block, stages=stages, total_bytes=args.stream_bytes,
                                  trials=args.trials)
        row["gbps"][n] = bw / 1e9
        row["ok"] &= ok
        print(f"stream {block}x{stages} ctas {n}: {bw / 1e9:.0f} GB/s "
              f"({bw / 1e9 / n:.1f} per SM){'' if ok else ' WRONG OUTPUT'}", flush=True)
      except Exception as e:  # noqa: BLE001 -- a variant that cannot run is reported
        row["gbps"][n] = f"err: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        print(f"stream {block}x{stages} ctas {n}: {row['gbps'][n]}", flush=True)
    bw_rows.append(row)
  # The best variant at each CTA count (what a suffix role could pick).
  best = {}
  for n in ctas:
    vals = [r["gbps"][n] for r in bw_rows if isinstance(r["gbps"].get(n), float) and r["ok"]]
    if vals:
      best[n] = max(vals)

  # 2. The prefix kernel alone, and the partition bound per configuration.
  part_rows = []
  prefix_cache = {}
  for spec in args.configs.split(","):
    name, bb, pp, ss = spec.split(":")
    key = f"{name}:{bb}:{pp}"
    if key not in prefix_cache:
      prefix_cache[key] = prefix_time(f"{key}:{ss}", args.trials)
    t_p, c_p, cfg, shape = prefix_cache[key]
    b, s = shape.batch, int(ss)
    hkv, d = shape.kv_heads, shape.head_dim
    suffix_bytes = 2 * b * s * hkv * d * 2
    floor = dataclasses.replace(shape, suffix=s).floor_s(copy_bw, rate)
    work = t_p * min(c_p, sms)  # CTA-seconds, one CTA per SM
    options = []
    for n_s, bw in best.items():
      if n_s >= sms:
        continue
      t_pre = work / min(c_p, sms - n_s) if c_p > sms - n_s else t_p
      options.append((max(t_pre, suffix_bytes / (bw * 1e9)), n_s, t_pre, suffix_bytes / (bw * 1e9)))
    bound, n_s, t_pre, t_suf = min(options) if options else (float("nan"),) * 4
    row = {"config": spec, "floor_us": floor * 1e6, "prefix_us": t_p * 1e6, "prefix_ctas": c_p,
           "prefix_config": cfg, "suffix_mb": suffix_bytes / 1e6,
           "suffix_at_copy_bw_us": suffix_bytes / copy_bw * 1e6,
           "bound_us": bound * 1e6, "bound_suffix_sms": n_s, "bound_prefix_us": t_pre * 1e6,
           "bound_suffix_us": t_suf * 1e6, "floor_over_bound": floor / bound}
    part_rows.append(row)
    print(f"{spec}: prefix {t_p * 1e6:.1f} us on {c_p} CTAs, suffix {suffix_bytes / 1e6:.0f} MB; "
          f"bound {bound * 1e6:.1f} us with {n_s} suffix SMs; floor {floor * 1e6:.1f} "
          f"({floor / bound:.2f} of the bound)", flush=True)

  head = (f"device: {kind}; {sms} SMs; jax {jax.__version__}; copy {copy_bw / 1e9:.0f} GB/s "
          f"(read + write); bf16 matmul {rate / 1e12:.0f} TFLOP/s")
  lines = [head, "", "HBM read bandwidth (GB/s) of N whole-SM CTAs streaming through shared "
           "memory (TMA), by block rows x stages:", "",
           "| block x stages | KB per copy | " + " | ".join(f"N={n}" for n in ctas) + " |",
           "|---|---:|" + "---:|" * len(ctas)]
  for r in bw_rows:
    cells = [f"{r['gbps'][n]:.0f}" if isinstance(r["gbps"].get(n), float) else str(r["gbps"].get(n))
             for n in ctas]
    lines.append(f"| {r['block']}x{r['stages']}{'' if r['ok'] else ' (WRONG OUTPUT)'} | "
                 f"{r['bytes_per_copy'] // 1024} | " + " | ".join(cells) + " |")
  lines.append("| best, per SM | | " + " | ".join(
      f"{best[n] / n:.1f}" if n in best else "" for n in ctas) + " |")
  lines += ["", "Partition bound (optimistic: perfect stream-K balance, no merge, no suffix "
            "arithmetic), device µs:", "",
            "| config | floor | prefix kernel alone (CTAs) | suffix MB | bound | suffix SMs | "
            "prefix / suffix at the bound | floor / bound |", "|---|---:|---:|---:|---:|---:|---|---:|"]
  for r in part_rows:
    lines.append(f"| {r['config']} | {r['floor_us']:.1f} | {r['prefix_us']:.1f} ({r['prefix_ctas']}) | "
                 f"{r['suffix_mb']:.0f} | {r['bound_us']:.1f} | {r['bound_suffix_sms']} | "
                 f"{r['bound_prefix_us']:.1f} / {r['bound_suffix_us']:.1f} | "
                 f"{r['floor_over_bound']:.2f} |")
  table = "\n".join(lines)
  print("\n" + table)
  with open(os.path.join(args.out, "sm_partition.json"), "w") as f:
    json.dump({"device": kind, "sms": sms, "jax": jax.__version__, "copy_bw": copy_bw,
               "matmul_rate": rate, "stream": bw_rows, "best_gbps": best,
               "partition": part_rows}, f, indent=1)
  with open(os.path.join(args.out, "sm_partition.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  main()
