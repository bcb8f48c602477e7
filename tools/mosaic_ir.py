"""Fingerprints of the Mosaic GPU kernels as lowered for CUDA, without a GPU (CPU machine).

  PYTHONPATH=. python tools/mosaic_ir.py > before.txt   # then change the kernel's source
  PYTHONPATH=. python tools/mosaic_ir.py > after.txt && diff before.txt after.txt

For each shape and step plan (``FusedDecodeOptions``) of the one-kernel decode path (and the
prefix kernel with its default config), lowers the
kernel with ``jax.export(platforms=["cuda"])`` and prints a hash of its Mosaic GPU module as text
without debug information (source locations change with any edit). Identical lines mean the
refactor left the kernel unchanged, so its native tests on a GPU still hold; a different line
means the kernel changed and must be retested there (``tests/kernels/test_pallas_gpu_kernels.py
-k Native``). ``--dump DIR`` also writes each module's text.
"""

import argparse
import hashlib
import os

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core

from pallas_kernels.device import DeviceInfo
from pallas_kernels.gpu import merge
from pallas_kernels.gpu import prefix_mgpu as mg
from pallas_kernels.gpu import shared_mgpu as fm
from pallas_kernels.gpu import shared_mgpu_plan as fp
from pallas_kernels.gpu.config import FusedDecodeOptions

S = jax.ShapeDtypeStruct
H100 = DeviceInfo.named("NVIDIA H100 80GB HBM3")  # the configs of the published runs
BF16 = jnp.bfloat16
CHECKS = [jax.export.DisabledSafetyCheck.custom_call(t)
          for t in ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")]
# (B, Hq, Hkv, D, P, S): the paper's headline, a small D = 64 case, several KV heads, G = 4.
SHAPES = [(1024, 8, 1, 128, 16384, 128), (300, 8, 1, 64, 384, 64), (40, 32, 8, 128, 512, 192),
          (256, 32, 8, 128, 4096, 128)]
PLANS = {"default": FusedDecodeOptions(), "spread": FusedDecodeOptions(spread_suffix=True),
         "ranges": FusedDecodeOptions(spread_suffix=False),
         "three_slots": FusedDecodeOptions(stages=3)}


def modules(fn, *args) -> list[str]:
  """The Mosaic GPU modules (text, no debug info) that exporting ``fn(*args)`` lowers. ``fn``
  must be a function not exported before: jax.jit reuses its earlier trace and lowering."""
  seen = []
  serde = core._run_serde_pass

  def spy(module, **kw):
    if kw.get("serialize"):
      seen.append(module.operation.get_asm(enable_debug_info=False))
    return serde(module, **kw)

  core._run_serde_pass = spy
  try:
    jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=CHECKS)(*args)
  finally:
    core._run_serde_pass = serde
  if not seen:  # jax.jit caches traces by function: a function exported before lowers nothing
    raise ValueError("no Mosaic GPU kernel was lowered; pass a function not exported before")
  return seen


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dump", help="write each module's text into this folder")
  args = ap.parse_args()
  if args.dump:
    os.makedirs(args.dump, exist_ok=True)
  cases = []
  for b, hq, hkv, d, p, s in SHAPES:
    ins = (S((b, 1, hq, d), BF16), S((p, hkv, d), BF16), S((p, hkv, d), BF16),
           S((b, s, hkv, d), BF16), S((b, s, hkv, d), BF16), S((b,), jnp.int32))
    for plan, options in PLANS.items():
      g = hq // hkv
      fcfg = fp.default_config(b * g, hkv, p, s, g, device=H100, head_dim=d, options=options)
      fused = lambda q, k, v, sk, sv, n, p=p, fcfg=fcfg: fm.fused_decode(
          q, k, v, p, sk, sv, n, scale=0.1, config=fcfg, merge=merge.default_config(H100))
      cases.append((f"fused B={b} Hq={hq} Hkv={hkv} D={d} P={p} S={s} {plan}", fused, ins))
    rows = b * hq // hkv
    cfg = mg.default_config(rows, hkv, p, d, device=H100)
    prefix = lambda q, k, v, p=p, cfg=cfg: mg.prefix_attention_rows_mgpu(q, k, v, p, scale=0.1,
                                                                         config=cfg)
    cases.append((f"prefix rows={rows} Hkv={hkv} D={d} P={p} {cfg}",
                  prefix, (S((hkv, -(-rows // 128) * 128, d), BF16), ins[1], ins[2])))
  for i, (name, fn, ins) in enumerate(cases):
    texts = modules(fn, *ins)
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    print(f"{digest} {len(texts)} {name}", flush=True)
    if args.dump:
      with open(os.path.join(args.dump, f"{i:02d}.mlir"), "w") as f:
        f.write(f"// {name}\n" + "\n".join(texts))


if __name__ == "__main__":
  main()
