"""Bytes, FLOPs and floors of the TPU kernels for one decode step, per chip (on paper).

No TPU is available to us, so this is the model, not a measurement: for each chip
(:data:`pallas_kernels.tpu.common.CHIPS`, public datasheet numbers) and shape, the
bytes and FLOPs our kernels move and compute with the block sizes the heuristic picks
for that chip (prefix re-read once per row block, padding, float32 prefix state,
lane-replicated LSE), the floor ``max(bytes / HBM bandwidth, FLOPs / bf16 MXU rate)``,
the same floor for per-sequence attention (every sequence reads prefix + suffix,
:class:`pallas_kernels.base.AttentionShape`, RelayAttention Eq. 10) and the implied speedup.

Two layouts of the caller's K/V: head-major (``[Hkv, P, D]``, ``[B, Hkv, S, D]``: the
kernels read it in place) and the API layout (``[P, Hkv, D]``, ``[B, S, Hkv, D]``:
the adapters add an XLA transpose, a read and a write of each K/V buffer, when
``Hkv > 1``).

Usage::

    python -m pallas_kernels.tpu.perf_model --markdown     # the tables of docs/tpu.md
    python -m pallas_kernels.tpu.perf_model --json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import types

from pallas_kernels.base import AttentionShape
from pallas_kernels.tpu import common
from pallas_kernels.tpu.common import LANES
from pallas_kernels.tpu.prefix import prefix_blocks
from pallas_kernels.tpu.suffix import suffix_blocks

SHAPES = types.MappingProxyType({  # name: (Hq, Hkv, D)
    "Hydragen paper (Hq 8, Hkv 1, D 128)": (8, 1, 128),
    "Llama-3-8B (Hq 32, Hkv 8, D 128)": (32, 8, 128),
})
BATCHES = (16, 64, 256, 1024)
PREFIXES = (1024, 4096, 16384)
SUFFIXES = (128, 512)


@dataclasses.dataclass(frozen=True)
class KernelCost:
  prefix_bytes: int  # the prefix kernel: q, K/V (once per row block), f32 out + LSE
  suffix_bytes: int  # the suffix kernel: q, K/V, f32 prior in, out (q dtype) + LSE
  relayout_bytes: int  # XLA copies when K/V (and q/out) come in the API layout
  prefix_flops: int  # MXU work (padded rows, keys and lanes)
  suffix_flops: int
  prefix_block: tuple  # (rows, keys)
  suffix_block: tuple  # (sequences, heads, keys)

  @property
  def bytes(self) -> int:
    return self.prefix_bytes + self.suffix_bytes

  @property
  def flops(self) -> int:
    return self.prefix_flops + self.suffix_flops

  def floor_s(self, bandwidth: float, matmul_rate: float, relayout: bool = False) -> float:
    """The two kernels run one after the other: the sum of their floors (plus the copies
    at full bandwidth with ``relayout``)."""
    return (max(self.prefix_bytes / bandwidth, self.prefix_flops / matmul_rate)
            + max(self.suffix_bytes / bandwidth, self.suffix_flops / matmul_rate)
            + (self.relayout_bytes / bandwidth if relayout else 0.0))


def kernel_cost(shape: AttentionShape, chip: str) -> KernelCost:
  """Bytes and FLOPs of ``shared_attention`` (one prefix, full suffixes) on ``chip``."""
  bs = common.block_sizes_for(chip)
  b, p, s, tq = shape.batch, shape.prefix, shape.suffix, shape.q_len
  hq, hkv, d, item = shape.q_heads, shape.kv_heads, shape.head_dim, shape.itemsize
  rows_seq = tq * (hq // hkv)
  rows = b * rows_seq
  dp = common.round_up(d, LANES)
  # Prefix kernel.
  br, bk, _ = prefix_blocks(rows, p, dp, item, bs)
  rp, pp = common.round_up(rows, br), common.round_up(p, bk)
  state = rows * (dp + LANES) * 4  # float32 out + lane-replicated LSE, per KV head
  prefix_bytes = hkv * (rp * dp * item + (rp // br) * 2 * pp * dp * item + rp * (dp + LANES) * 4)
  prefix_flops = 4 * hkv * rp * pp * dp
  # Suffix kernel (all suffixes full: every block is read).
  blocks = suffix_blocks(b, hkv, s, rows_seq, dp, item, bs, True)
  bp, sp = common.round_up(b, blocks.batch), common.round_up(s, blocks.keys)
  r_sfx = bp * rows_seq
  suffix_bytes = hkv * (r_sfx * dp * item + bp * 2 * sp * dp * item + r_sfx * (dp + LANES) * 4
                        + r_sfx * dp * item + r_sfx * LANES * 4)
  suffix_flops = 4 * hkv * bp * common.round_up(rows_seq, 8) * sp * dp
  # XLA copies around the kernels.
  q_bytes = b * tq * hq * d * item
  glue = 0
  if hkv > 1 or tq > 1:
    glue += 2 * q_bytes + 2 * q_bytes  # fold q in, unfold out
  if rp != rows or dp != d:
    glue += q_bytes + hkv * rp * dp * item  # pad q for the prefix kernel
  if r_sfx != rows or dp != d:
    glue += q_bytes + hkv * r_sfx * dp * item + 2 * hkv * state  # pad q and the state
  if hkv > 1 or pp != p or dp != d:
    glue += 2 * (p * hkv * d * item + hkv * pp * dp * item)  # prefix K, V -> head-major
  if hkv > 1 or sp != s or bp != b or dp != d:
    glue += 2 * (b * s * hkv * d * item + bp * hkv * sp * dp * item)  # suffix K, V
  return KernelCost(prefix_bytes, suffix_bytes, glue, prefix_flops, suffix_flops, (br, bk),
                    (blocks.batch, blocks.heads, blocks.keys))


def rows_for(chip: str):
  """One dict per (shape, B, P, S) with the model's numbers for ``chip``."""
  c = common.CHIPS[chip]
  bw, mxu = c.hbm_bytes_per_s, c.bf16_flops_per_s
  for name, (hq, hkv, d) in SHAPES.items():
    for b, p, s in itertools.product(BATCHES, PREFIXES, SUFFIXES):
      shape = AttentionShape(batch=b, prefix=p, suffix=s, q_heads=hq, kv_heads=hkv, head_dim=d)
      cost = kernel_cost(shape, chip)
      ours = cost.floor_s(bw, mxu)
      ours_api = cost.floor_s(bw, mxu, relayout=True)
      per_seq = shape.per_sequence_floor_s(bw, mxu)
      yield dict(chip=chip, shape=name, B=b, P=p, S=s,
                 ideal_MB=shape.shared_bytes() / 1e6, ours_MB=cost.bytes / 1e6,
                 relayout_MB=cost.relayout_bytes / 1e6, GFLOP=cost.flops / 1e9,
                 floor_us=ours * 1e6, floor_api_us=ours_api * 1e6,
                 ideal_floor_us=shape.floor_s(bw, mxu) * 1e6,
                 per_seq_MB=shape.per_sequence_bytes() / 1e6, per_seq_floor_us=per_seq * 1e6,
                 speedup=per_seq / ours, speedup_api=per_seq / ours_api,
                 bound="+".join("MXU" if f / mxu > b_ / bw else "HBM" for b_, f in (
                     (cost.prefix_bytes, cost.prefix_flops), (cost.suffix_bytes, cost.suffix_flops))),
                 prefix_block=cost.prefix_block, suffix_block=cost.suffix_block)


def markdown() -> str:
  out = ["Generated by `python -m pallas_kernels.tpu.perf_model --markdown` (bf16, one decode "
         "step, Tq = 1, every suffix full).", ""]
  out.append("| chip | HBM GB/s | bf16 TFLOP/s | ridge FLOP/B | MXU | TensorCores | prefix rows x "
             "keys | suffix keys | suffix step |")
  out.append("|---|---|---|---|---|---|---|---|---|")
  for name, c in common.CHIPS.items():
    bs = common.block_sizes_for(name)
    out.append(f"| {name} | {c.hbm_bytes_per_s / 1e9:.0f} | {c.bf16_flops_per_s / 1e12:.0f} | "
               f"{c.ridge:.0f} | {c.mxu}x{c.mxu} | {c.tensorcores} | {bs.prefix_rows} x "
               f"{bs.prefix_keys} | {bs.suffix_keys} | {bs.suffix_step_bytes >> 20} MiB |")
  for chip in common.CHIPS:
    rows = list(rows_for(chip))
    for name in SHAPES:
      out += ["", f"#### {chip}, {name}", "",
              "| B | P | S | ideal MB | ours MB | GFLOP | bound (prefix+suffix) | ours floor us | per-seq MB | "
              "per-seq floor us | speedup | + relayout MB | speedup, API layout |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
      for r in rows:
        if r["shape"] != name:
          continue
        out.append(f"| {r['B']} | {r['P']} | {r['S']} | {r['ideal_MB']:.1f} | {r['ours_MB']:.1f} "
                   f"| {r['GFLOP']:.2f} | {r['bound']} | {r['floor_us']:.1f} | "
                   f"{r['per_seq_MB']:.0f} | {r['per_seq_floor_us']:.1f} | {r['speedup']:.1f}x | "
                   f"{r['relayout_MB']:.1f} | {r['speedup_api']:.1f}x |")
  return "\n".join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--markdown", action="store_true", help="Markdown tables (default)")
  parser.add_argument("--json", action="store_true", help="JSON rows")
  args = parser.parse_args(argv)
  if args.json:
    json.dump([r for chip in common.CHIPS for r in rows_for(chip)], sys.stdout, indent=1)
    print()
  else:
    print(markdown())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
