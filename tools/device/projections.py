"""The q/k/v projections in the decode loop: XLA's merged product (weights concatenated at every
step) against three products (``models.llama.SEPARATE_PROJECTIONS_MIN_ROWS``).

On the GPU machine: ``PYTHONPATH=. python3 tools/device/projections.py --out $OUT`` first
compiles a loop of Llama-3-8B-sized projections both ways and reports whether the optimized HLO
holds a concatenate and the device time per iteration, then runs
``models.bench_decode.run_point`` (random bf16 weights, the whole prompt shared) for each
setting, mode, batch and prompt, writing ``projections.json``. A development tool; the benchmark
of record is ``hydragen bench decode``.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

import models.llama as llama
from jax_shared_attn.bench import timing


def probe(batch: int, steps: int = 8):
  """The projections of one layer in a ``fori_loop`` (weights invariant), merged or not."""
  d, hq, hkv, hd = 4096, 32, 8, 128
  key = jax.random.key(0)
  x = jax.random.normal(key, (batch, 1, d), jnp.bfloat16)
  wq = jax.random.normal(key, (hq, hd, d), jnp.bfloat16) * 0.01
  wk = jax.random.normal(key, (hkv, hd, d), jnp.bfloat16) * 0.01
  wv = jax.random.normal(key, (hkv, hd, d), jnp.bfloat16) * 0.01
  rows = {}
  for separate in (False, True):
    def body(_, x, separate=separate):
      xk, xv = llama._unshared(x, 2) if separate else (x, x)
      q = jnp.einsum("btd,hkd->bthk", x, wq)
      k = jnp.einsum("btd,hkd->bthk", xk, wk)
      v = jnp.einsum("btd,hkd->bthk", xv, wv)
      return x + (q.sum((2, 3)) + k.sum((2, 3)) + v.sum((2, 3)))[..., None].astype(x.dtype)
    fn = jax.jit(lambda x, body=body: lax.fori_loop(0, steps, body, x))
    text = fn.lower(x).compile().as_text()
    t = timing.device_time(fn, lambda i: (x + i,), n_sets=1, trials=5)
    rows["separate" if separate else "merged"] = dict(
        concatenate_in_hlo="concatenate(" in text, us_per_iteration=t / steps * 1e6)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", default="1024,512")
  ap.add_argument("--prefix", default="2048")
  ap.add_argument("--modes", default="none,hydragen")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--separate", type=int, choices=(0, 1), default=1,
                  help="1: three products at every batch, 0: never (models.llama."
                       "SEPARATE_PROJECTIONS_MIN_ROWS 0 or 2**62; one process per setting: it is "
                       "read when the decode loop is traced, and traces are cached)")
  ap.add_argument("--probe", action="store_true", help="run the projection-loop probe first")
  ap.add_argument("--out", default=".")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "projections.json")
  result = (json.load(open(path)) if os.path.exists(path)
            else dict(info=timing.device_info(), probe={}, rows=[]))
  for b in (int(x) for x in args.batch.split(",")) if args.probe else ():
    result["probe"][b] = probe(b)
    print("probe", b, result["probe"][b], flush=True)
  llama.SEPARATE_PROJECTIONS_MIN_ROWS = 0 if args.separate else 2**62  # before any tracing
  from models.bench_decode import device_random_init, run_point
  from models.config import preset
  config = preset("llama-3-8b").replace(dtype="bfloat16")
  model = device_random_init(config, seed=0)
  for p in (int(x) for x in args.prefix.split(",")):
    for b in (int(x) for x in args.batch.split(",")):
      for mode in args.modes.split(","):
        row = run_point(model, mode, b, p, args.new_tokens, impl="auto", profile_steps=1)
        prof = row.pop("profile", None) or {}
        row.update(separate_projections=bool(args.separate), busy_ms=prof.get("busy_us", 0) / 1e3,
                   top=[(k["name"][:60], round(k["us"], 1)) for k in prof.get("kernels", [])[:10]])
        result["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("mode", "batch", "prefix", "separate_projections",
                                              "tokens_per_s", "step_ms", "busy_ms")}), flush=True)
        with open(path, "w") as f:
          json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
