"""The one-kernel decode path with transposed suffix steps, against the shipped dispatch.

``pallas_kernels.gpu.transposed_suffix(True)`` runs the one kernel's suffix steps as
``S^T = K Q^T`` over column groups of ``max(16, G)`` query rows (and lets the one kernel take
any G >= 2). It passes ``TestNativeFusedDecodeTransposed`` on an H100 and is off by default
(docs/results/2026-11-23-h100-switches, then, with the suffix part merged in place,
docs/results/2026-11-23-h100-transposed-merge: it wins some G = 4 microbenchmarks but loses in
the decode loop). On the GPU machine:

``PYTHONPATH=. python3 tools/device/transposed.py attention --out $OUT`` times, in one process
(profiler device clock, ``jax_shared_attn.bench.timing.compare_ops``), ``shipped``
(``impl="auto"``), ``transposed`` (the same under the switch) and ``split`` (prefix and suffix
kernels apart) for the configurations of ``--configs`` (``shape:B:P:S``), writing
``transposed_attention.json`` and a table.

``PYTHONPATH=. python3 tools/device/transposed.py decode --transposed 1 --out $OUT`` runs
``models.bench_decode.run_point`` (random bf16 weights, the whole prompt shared) with the switch
on or off -- one process per setting: it is read when the decode loop is traced -- and appends
the rows to ``transposed_decode.json``. Development tools; the benchmarks of record are
``python -m jax_shared_attn.bench attention`` and ``hydragen bench decode``.
"""

import argparse
import os


import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from decode_ab import add_attention_parser, add_decode_parser, decode_points


def shipped(q, pk, pv, sk, sv):
  return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


def transposed(q, pk, pv, sk, sv):
  with gpu.transposed_suffix(True):
    return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


def split(q, pk, pv, sk, sv):
  with gpu.fused_decode(False), gpu.flat_decode(0):
    return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


VARIANTS = {"shipped": shipped, "transposed": transposed, "split": split}


def attention(args):
  bench.compare_variants({v: VARIANTS[v] for v in args.variants.split(",")}, args.configs,
                         trials=args.trials,
                         out_json=os.path.join(args.out, "transposed_attention.json"),
                         ceilings=tuple(args.ceilings) if args.ceilings else None)


def trace(args):
  """Compiles and runs ``transposed`` once at ``--configs``' first entry and prints the whole
  traceback of a failure (lowering errors name the kernel line only in the unfiltered one)."""
  import traceback
  import jax
  import jax.numpy as jnp
  jax.config.update("jax_traceback_filtering", "off")
  shape = bench.parse_spec(args.configs.split(",")[0])[1]
  q, pk, pv, sk, sv = bench._inputs(shape, jnp.bfloat16, 0)
  try:
    out = jax.block_until_ready(jax.jit(transposed)(q, pk, pv, sk, sv))
    ref = jax.jit(split)(q, pk, pv, sk, sv)
    print("ok, max |transposed - split| =", float(jnp.abs(out.astype(float) - ref).max()))
  except Exception:  # noqa: BLE001 -- a development probe: print everything
    traceback.print_exc()


def decode(args):
  decode_points(args, lambda: gpu.transposed_suffix(bool(args.transposed)),
                "transposed_decode.json", dict(transposed=bool(args.transposed)))


def main():
  ap = argparse.ArgumentParser()
  sub = ap.add_subparsers(dest="what", required=True)
  add_attention_parser(sub, "paper:1024:16384:128,paper:1024:16384:512,paper:256:4096:128,"
                       "paper:256:16384:512,llama:1024:1024:128,llama:1024:4096:128,"
                       "llama:256:16384:128", ",".join(VARIANTS))
  t = sub.add_parser("trace")
  t.add_argument("--configs", default="llama:1024:1024:128")
  t.add_argument("--out", default=".")
  d = add_decode_parser(sub, batch="1024,256", prefix="2048")
  d.add_argument("--transposed", type=int, choices=(0, 1), default=1)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  dict(attention=attention, trace=trace, decode=decode)[args.what](args)


if __name__ == "__main__":
  main()
