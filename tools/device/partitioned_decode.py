"""The partitioned launch inside the decode loop: A/B against the shipped path (device experiment).

  PYTHONPATH=. python3 tools/device/partitioned_decode.py decode --partitioned 0 --out $OUT
  PYTHONPATH=. python3 tools/device/partitioned_decode.py decode --partitioned 1 --out $OUT

``--partitioned 1`` routes the GPU family's ``shared_attention`` (the call a decode step makes
per layer) to ``tools/device/partitioned.py`` where it applies -- one query token, one shared
prefix, G = 4, D = 128, bf16, and a shape :func:`partitioned.plan` takes (one launch: suffix-role
CTAs first, then prefix units the GPU balances over the SMs) -- and leaves every other call to
the shipped path. ``--side-ctas`` and ``--unit-keys`` override the plan's constants. Each setting runs in its own process (the routing is read when the decode loop is
traced), with ``models.bench_decode.run_point`` (random bf16 weights, the whole prompt shared),
appending rows to ``partitioned_decode.json``.
"""

import argparse
import contextlib
import functools
import importlib.util
import os
import pathlib
import sys

import jax.numpy as jnp

import pallas_kernels.gpu as gpu

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from decode_ab import add_decode_parser, decode_points  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "partitioned", pathlib.Path(__file__).with_name("partitioned.py"))
partitioned = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(partitioned)

def routed(original):
  """``shared_attention`` with eligible decode calls sent to the partitioned launch."""

  @functools.wraps(original)
  def shared_attention(q, parts, suffix_k, suffix_v, *, kv_lengths, causal, scale, mosaic=False,
                       interpret=None):
    b, tq, hq, d = q.shape
    ok = (tq == 1 and len(parts) == 1 and parts[0][0] == "prefix" and d == 128
          and q.dtype == jnp.bfloat16 and interpret is not True)
    if ok:
      _, k, v, length, _ = parts[0]
      hkv = k.shape[1]
      p_plan = partitioned.plan(b, hq, hkv, k.shape[0])
      # TMA with the tiles' transforms needs the capacity a multiple of 8 (run the decode
      # benchmark with --profile-steps 0: 128 new tokens, capacity 128).
      ok = (p_plan is not None and k.shape[0] % 128 == 0 and suffix_k.shape[1] >= 64
            and suffix_k.shape[1] % 8 == 0 and k.dtype == suffix_k.dtype == q.dtype)
    if not ok:
      return original(q, parts, suffix_k, suffix_v, kv_lengths=kv_lengths, causal=causal,
                      scale=scale, mosaic=mosaic, interpret=interpret)
    splits, side = p_plan
    return partitioned.partitioned_attention(q, k, v, suffix_k, suffix_v, kv_lengths,
                                             splits=splits, side_ctas=side, scale=scale,
                                             prefix_length=length)

  return shared_attention


@contextlib.contextmanager
def routing(enabled: bool):
  original = gpu.shared_attention
  if enabled:
    gpu.shared_attention = routed(original)
  try:
    yield
  finally:
    gpu.shared_attention = original


def main():
  ap = argparse.ArgumentParser()
  sub = ap.add_subparsers(dest="what", required=True)
  d = add_decode_parser(sub, batch="256,1024", prefix="4096")
  d.add_argument("--partitioned", type=int, default=1)
  d.add_argument("--side-ctas", type=int, default=partitioned.DECODE_SIDE_CTAS)
  d.add_argument("--unit-keys", type=int, default=partitioned.DECODE_UNIT_KEYS)
  d.set_defaults(profile_steps=0)
  args = ap.parse_args()
  partitioned.DECODE_SIDE_CTAS, partitioned.DECODE_UNIT_KEYS = args.side_ctas, args.unit_keys
  os.makedirs(args.out, exist_ok=True)
  decode_points(args, lambda: routing(bool(args.partitioned)), "partitioned_decode.json",
                dict(partitioned=args.partitioned, side_ctas=args.side_ctas,
                     unit_keys=args.unit_keys))


if __name__ == "__main__":
  main()
