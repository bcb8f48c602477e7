"""192-key steps in the Mosaic GPU prefix kernel, against 128-key steps.

``pallas_kernels.gpu.wide_prefix_steps(n)`` sets the keys per split from which the prefix kernel
takes 192-key steps (``prefix_attention_mgpu.WIDE_MIN_KEYS``; 0: never). On the GPU machine:

``PYTHONPATH=. python3 tools/device/wide_steps.py attention --out $OUT`` times, in one process
(profiler device clock), ``shipped`` (``impl="auto"``) and ``narrow`` (the same with 128-key
steps everywhere) at ``--configs`` (``shape:B:P:S``), writing ``wide_attention.json``.

``PYTHONPATH=. python3 tools/device/wide_steps.py decode --min-keys 0 --out $OUT`` runs
``models.bench_decode.run_point`` with the setting (one process per setting: it is read when the
decode loop is traced) and appends the rows to ``wide_decode.json``. Development tools; the
benchmarks of record are ``python -m jax_shared_attn.bench attention`` and ``hydragen bench
decode``.
"""

import argparse
import os

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from decode_ab import add_attention_parser, add_decode_parser, decode_points


def shipped(q, pk, pv, sk, sv):
  return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


def narrow(q, pk, pv, sk, sv):
  with gpu.wide_prefix_steps(0):
    return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


VARIANTS = {"shipped": shipped, "narrow": narrow}


def attention(args):
  bench.compare_variants({v: VARIANTS[v] for v in args.variants.split(",")}, args.configs,
                         trials=args.trials, out_json=os.path.join(args.out, "wide_attention.json"),
                         ceilings=tuple(args.ceilings) if args.ceilings else None)


def decode(args):
  decode_points(args, lambda: gpu.wide_prefix_steps(args.min_keys), "wide_decode.json",
                dict(wide_min_keys=args.min_keys))


def main():
  ap = argparse.ArgumentParser()
  sub = ap.add_subparsers(dest="what", required=True)
  add_attention_parser(sub, "llama:1024:4096:128,llama:1024:8192:128,llama:1024:16384:128,"
                       "llama:256:16384:128,llama:1024:16384:512", ",".join(VARIANTS))
  d = add_decode_parser(sub, batch="1024", prefix="8192,16384")
  d.add_argument("--min-keys", type=int, default=8192)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  dict(attention=attention, decode=decode)[args.what](args)


if __name__ == "__main__":
  main()
