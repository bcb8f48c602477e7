"""The key-split merge: the Triton merge kernel against XLA's, alone and inside attention.

Run on the GPU machine:
``PYTHONPATH=. python3 tools/device/merge_tune.py --out $OUT``. With the profiler's device
clock (``jax_shared_attn.bench.timing``), in one process:

* ``merge``: the merges the attention paths run (stacks of key-split partial states of the
  sizes they produce), XLA (``merge_states``) against the kernel at several row tiles and warp
  counts;
* ``attention``: ``shared_prefix_attention(impl=IMPL)`` on configurations whose path merges
  key splits (the flat path, the one-kernel path, the kernels apart), with the merge kernel and
  with XLA's merge.

Writes ``merge_tune.json`` and prints tables. A development tool; the benchmark of record is
``python -m jax_shared_attn.bench attention``.
"""

import argparse
import contextlib
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from jax_shared_attn.bench import timing
from jax_shared_attn.iomodel import AttentionShape
from jax_shared_attn.testing import rel_err
from pallas_kernels.gpu import merge_kernel as mk

# name: (parts per stack, rows, D, partial dtype, output dtype) -- what each path merges
MERGES = {
    "one-kernel B=256 P=4K (8 splits)": ((8,), 2048, 128, jnp.bfloat16, jnp.bfloat16),
    "one-kernel B=1024 P=16K (2 splits)": ((2,), 8192, 128, jnp.bfloat16, jnp.bfloat16),
    "one-kernel B=64 P=16K (8 splits)": ((8,), 512, 128, jnp.bfloat16, jnp.bfloat16),
    "flat B=16 paper (12 splits)": ((12,), 128, 128, jnp.float32, jnp.bfloat16),
    "flat B=16 Llama (3 splits)": ((3,), 512, 128, jnp.float32, jnp.bfloat16),
    "suffix splits + prior (4 + 4)": ((4, 4), 1024, 128, jnp.float32, jnp.bfloat16),
    "prefix splits (32)": ((32,), 128, 128, jnp.float32, jnp.float32),
}
IMPL = "auto"
TILES = (4, 8, 16)
WARPS = (4, 8)


@contextlib.contextmanager
def knobs(tile=None, warps=None, preload=None):
  before = mk.TILE_ROWS, mk.NUM_WARPS, mk.PRELOAD
  mk.TILE_ROWS = tile or before[0]
  mk.NUM_WARPS = warps or before[1]
  mk.PRELOAD = before[2] if preload is None else preload
  try:
    yield
  finally:
    mk.TILE_ROWS, mk.NUM_WARPS, mk.PRELOAD = before


def merge_op(out_dtype, xla=False, **kw):
  def op(*flat):
    stacks = list(zip(flat[::2], flat[1::2]))
    with knobs(**kw), (mk.xla_merge() if xla else contextlib.nullcontext()):
      return mk.merge_parts(stacks, out_dtype=out_dtype)
  return op


def merge_inputs(counts, rows, d, dtype, seed):
  key = jax.random.key(seed)
  flat = []
  for i, n in enumerate(counts):
    ko, kl = jax.random.split(jax.random.fold_in(key, i))
    flat += [jax.random.normal(ko, (n, 1, rows, d), dtype),
             jax.random.normal(kl, (n, 1, rows), jnp.float32) * 4]
  return flat


def attention_op(xla):
  def op(q, pk, pv, sk, sv):
    with mk.xla_merge() if xla else contextlib.nullcontext():
      return shared_prefix_attention(q, pk, pv, sk, sv, impl=IMPL)
  return op


# (shape, B, P, S): the flat path (paper B=16, Llama B=16), the one kernel (paper B >= 64),
# the kernels apart (Llama B=256: prefix splits into the suffix kernel, no merge kernel).
ATTENTION = [("paper", 16, 1024, 128), ("paper", 16, 1024, 512), ("paper", 32, 1024, 128),
             ("paper", 64, 1024, 128), ("paper", 256, 4096, 128), ("paper", 1024, 16384, 128),
             ("paper", 256, 16384, 512), ("llama-3-8b", 16, 1024, 128)]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--out", default=".")
  ap.add_argument("--skip", default="", help="comma list of: merge,attention")
  ap.add_argument("--merges", default=None, help="comma list of MERGES indices")
  ap.add_argument("--attention", default=None, help="comma list of ATTENTION indices")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "merge_tune.json")
  result = dict(info=timing.device_info(), merge=[], attention=[])

  def save():
    with open(path, "w") as f:
      json.dump(result, f, indent=1)

  if "merge" not in args.skip:
    items = list(MERGES.items())
    if args.merges:
      items = [items[int(i)] for i in args.merges.split(",")]
    for name, (counts, rows, d, dtype, out_dtype) in items:
      make = functools.partial(merge_inputs, counts, rows, d, dtype)
      n = timing.sets_needed(timing.tree_bytes(make(0)))
      row = dict(name=name, counts=counts, rows=rows)
      ref = np.asarray(jax.jit(merge_op(out_dtype, xla=True))(*make(0))[0], np.float32)
      variants = [("xla", dict(xla=True))] + [
          (f"t{t}w{w}{'' if pre else 'n'}", dict(tile=t, warps=w, preload=pre))
          for t in TILES for w in WARPS for pre in (True, False)] + [("default", {})]
      for label, kw in variants:
        try:
          op = merge_op(out_dtype, **kw)
          row[label] = timing.device_time(op, make, n_sets=n, trials=args.trials) * 1e6
          if label != "xla":
            row[f"err_{label}"] = rel_err(np.asarray(jax.jit(op)(*make(0))[0], np.float32), ref)
        except Exception as e:  # noqa: BLE001 -- reported, not fatal
          row[label] = f"err: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
      result["merge"].append(row)
      best = min((k for k in row if k[0] == "t" and isinstance(row[k], float)), key=row.get)
      print(f"{name}: xla {row['xla']:.2f} default {row['default']:.2f} best {best} "
            f"{row[best]:.2f} us", flush=True)
      save()

  if "attention" not in args.skip:
    configs = ATTENTION if not args.attention else [ATTENTION[int(i)] for i in
                                                    args.attention.split(",")]
    for shape_name, b, p, s in configs:
      hq, hkv, d = bench.SHAPES[shape_name]
      shape = AttentionShape(b, p, s, hq, hkv, d)
      make = functools.partial(bench._inputs, shape, jnp.bfloat16)
      n = timing.sets_needed(timing.tree_bytes(jax.eval_shape(lambda: make(0))))
      row = dict(shape=shape_name, B=b, P=p, S=s)
      outs = {}
      for label, xla in (("kernel", False), ("xla", True)):
        m = timing.measure(attention_op(xla), make, n_sets=n, trials=args.trials)
        row[label] = m["seconds"] * 1e6
        row[f"{label}_kernels"] = m.get("breakdown", {}).get("kernels", [])[:6]
        outs[label] = np.asarray(jax.jit(attention_op(xla))(*make(0)), np.float32)
      row["err"] = rel_err(outs["kernel"], outs["xla"])
      row["flat"] = gpu.flat_applies(jax.ShapeDtypeStruct((b, 1, hq, d), jnp.bfloat16),
                                     [("prefix", jax.ShapeDtypeStruct((p, hkv, d), jnp.bfloat16),
                                       None, p, None)],
                                     jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16),
                                     mosaic=True)
      result["attention"].append(row)
      print(f"{shape_name} B={b} P={p} S={s}: merge kernel {row['kernel']:.1f} us, XLA merge "
            f"{row['xla']:.1f} us (err {row['err']:.1e}, flat={row['flat']})", flush=True)
      save()

  print("\n| merge | parts | rows | XLA us | kernel (default) us | best tile/warps | us |")
  print("|---|---|---:|---:|---:|---|---:|")
  for r in result["merge"]:
    best = min((k for k in r if k[0] == "t" and isinstance(r[k], float)), key=r.get)
    f = lambda v: f"{v:.2f}" if isinstance(v, float) else "err"
    print(f"| {r['name']} | {'+'.join(map(str, r['counts']))} | {r['rows']} | {f(r['xla'])} | "
          f"{f(r['default'])} | {best} | {f(r[best])} |")
  print("\n| shape | B | P | S | with merge kernel us | with XLA merge us |")
  print("|---|---:|---:|---:|---:|---:|")
  for r in result["attention"]:
    print(f"| {r['shape']} | {r['B']} | {r['P']} | {r['S']} | {r['kernel']:.1f} | {r['xla']:.1f} |")


if __name__ == "__main__":
  main()
