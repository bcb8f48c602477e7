"""Sharded decoding on N GPUs against 1: the same tokens, and decode throughput scaling.

Run on a multi-GPU machine (``nvidia-h200-x2`` / ``-x4``) from the repository root::

    PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
        python3 tools/device/sharded_decode.py --out "$OUT"

Two parts, one process:

1. Tokens. A float32 random model small enough to compare exactly (8 query
   heads, 2 KV heads: fewer than the model axis on 4 GPUs, so KV heads are
   replicated), greedy, for the hydragen path (one prompt, and a two-level
   tree) and the standard path: tokens on every mesh == tokens with no mesh
   on one GPU (``impl="auto"``: the Pallas kernels run per shard).
2. Throughput. A bf16 random model of a named shape (default llama-3-8b),
   hydragen decode at a large batch with a long shared prompt, decode only
   (prefill and compilation excluded, paper App. D.1): 1 GPU with no mesh,
   then each mesh of N GPUs. Weak scaling by default (the batch per "data"
   shard is fixed, so N data shards decode N times the sequences), strong
   with ``--strong`` (the same global batch). Scaling efficiency =
   ``tput_N / (N * tput_1)`` (the issue's goal: >= 0.85).

Prints a table and writes ``sharded_decode.json`` and ``.md`` under ``--out``.
The weights are drawn on the devices, each parameter straight into its
shards, with the same values on every mesh (threefry is partitionable).
For a CPU smoke run of the logic (no timings of interest)::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 tools/device/sharded_decode.py \
        --model tiny --batch 8 --prefix 32 --new-tokens 6 --out /tmp/sd
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from models import sharding as S
from models.config import preset
from models.generate import decode, generate, prefill
from models.llama import build, param_shapes
from models.prompt_tree import PromptTree


def meshes_for(n: int) -> list[tuple[int, int]]:
  """Data parallel, tensor parallel and one mixed shape, for n devices."""
  shapes = [(n, 1), (1, n)]
  if n >= 4 and n % 2 == 0:
    shapes.append((n // 2, 2))
  return list(dict.fromkeys(shapes))


def device_init(config, mesh, seed: int = 0, std: float = 0.02):
  """Random weights drawn on the devices, each parameter directly on its shards.

  The same values for every mesh (and with ``mesh=None``, on one device):
  each parameter is drawn from ``fold_in(key(seed), i)`` at its original
  shape; KV heads are repeated inside the same program where the model axis
  needs it.
  """
  dtype = config.param_dtype

  @functools.lru_cache(maxsize=None)
  def program(shape, path, sharding):
    def draw(key):
      if path.endswith("norm.weight"):
        x = jnp.ones(shape, dtype)
      else:
        x = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
      if sharding is not None and path.endswith(("k_proj", "v_proj")):
        x = jnp.repeat(x, S.kv_replication(shape[0], mesh.shape[S.MODEL]), axis=0)
      return x
    return jax.jit(draw, out_shardings=sharding)

  key = jax.random.key(seed)
  params = {}
  for i, (path, spec) in enumerate(sorted(param_shapes(config).items())):
    sharding = None if mesh is None else NamedSharding(mesh, S.param_spec(path, config, mesh))
    params[path] = program(tuple(spec.shape), path, sharding)(jax.random.fold_in(key, i))
  return build(config if mesh is None else S.sharded_config(config, mesh), params)


def _free():
  gc.collect()
  for d in jax.devices():
    stats = d.memory_stats() or {}
    if stats.get("bytes_in_use", 0) > 0.5 * stats.get("bytes_limit", 1):
      print(f"  note: {d} still holds {stats['bytes_in_use'] / 1e9:.1f} GB", file=sys.stderr)


# -- part 1: tokens ----------------------------------------------------------------------------

def token_check(meshes, impl: str, new_tokens: int, samples: int) -> list[dict]:
  config = preset("tiny").replace(vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8,
                                  num_kv_heads=2, head_dim=64, intermediate_size=1024,
                                  dtype="float32")
  rng = np.random.default_rng(0)
  ids = lambda n: [int(t) for t in rng.integers(3, config.vocab_size, n)]
  shared = ids(300)
  half = samples // 2
  cases = {
      "hydragen one prompt": (ids(257), samples, "hydragen"),
      "hydragen two-level tree": (PromptTree.from_prompts(
          [shared + ids(40), shared + ids(17)], [half, samples - half], min_shared_tokens=4),
          None, "hydragen"),
      "standard": (ids(257), samples, "standard"),
  }
  base = device_init(config, None, std=0.1)
  ref = {name: np.asarray(generate(base, p, num_samples=n, max_new_tokens=new_tokens,
                                   attention=a, impl=impl))
         for name, (p, n, a) in cases.items()}
  del base
  rows = []
  for shape in meshes:
    mesh = S.make_mesh(shape)
    model = device_init(config, mesh, std=0.1)
    for name, (p, n, a) in cases.items():
      out = np.asarray(generate(model, p, num_samples=n, max_new_tokens=new_tokens, attention=a,
                                impl=impl, mesh=mesh))
      diff = np.argwhere(out != ref[name])
      rows.append(dict(mesh=list(shape), case=name, same=bool(len(diff) == 0),
                       first_diff=None if not len(diff) else [int(i) for i in diff[0]],
                       distinct_tokens=int(len(np.unique(ref[name])))))
      print(f"  tokens {name:26s} mesh {shape}: {'same' if not len(diff) else 'DIFFERENT'}",
            flush=True)
    del model
    _free()
  return rows


# -- part 2: throughput ------------------------------------------------------------------------

def throughput(model, mesh, batch: int, prefix: int, new_tokens: int, impl: str) -> dict:
  """Decode-only tokens/s: prefill, 1 step (compile), 1 step, then the timed steps in one call."""
  prompt = np.random.default_rng(1).integers(3, model.config.vocab_size, prefix).tolist()
  row = dict(mesh=None if mesh is None else [mesh.shape[S.DATA], mesh.shape[S.MODEL]],
             devices=1 if mesh is None else mesh.size, batch=batch, prefix=prefix)
  state = None
  try:
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill(model, prompt, num_samples=batch,
                                          max_new_tokens=new_tokens, impl=impl, mesh=mesh))
    row["prefill_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, 1, impl=impl))
    row["compile_s"] = time.perf_counter() - t0
    state = jax.block_until_ready(decode(model, state, 1, impl=impl))
    steps = new_tokens - 2
    t0 = time.perf_counter()
    state = jax.block_until_ready(decode(model, state, steps, impl=impl))
    dt = time.perf_counter() - t0
    row.update(steps=steps, step_ms=dt / steps * 1e3, tokens_per_s=batch * steps / dt)
  except Exception as e:  # noqa: BLE001 -- an OOM point is reported, not fatal
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
      raise
    row["tokens_per_s"] = "oom"
  finally:
    del state
    _free()
  return row


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="llama-3-8b", help="preset shape for the throughput part")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--batch", type=int, default=512,
                 help="sequences per data shard (weak scaling) or in all (--strong)")
  p.add_argument("--strong", action="store_true", help="the same global batch on every mesh")
  p.add_argument("--prefix", type=int, default=2048, help="shared prompt tokens")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--meshes", default="", help="e.g. '2x1,1x2' (default: N x 1, 1 x N, N/2 x 2)")
  p.add_argument("--impl", default="auto", help="attention implementation (throughput)")
  p.add_argument("--token-impl", default="auto",
                 help="attention implementation for the token check ('xla' separates kernel "
                      "rounding from sharding if 'auto' differs)")
  p.add_argument("--skip-tokens", action="store_true")
  p.add_argument("--skip-throughput", action="store_true")
  p.add_argument("--out", default="runs/sharded_decode")
  args = p.parse_args(argv)

  n = jax.device_count()
  meshes = ([tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
            if args.meshes else meshes_for(n))
  info = dict(device=jax.devices()[0].device_kind, devices=n, backend=jax.default_backend(),
              jax=jax.__version__, date=time.strftime("%Y-%m-%d"), impl=args.impl,
              token_impl=args.token_impl,
              model=args.model, dtype=args.dtype, batch=args.batch, prefix=args.prefix,
              new_tokens=args.new_tokens, scaling="strong" if args.strong else "weak")
  print(f"{n} x {info['device']}, jax {info['jax']}; meshes {meshes}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  result = dict(info=info, tokens=[], throughput=[])
  path = os.path.join(args.out, "sharded_decode.json")

  def save():
    with open(path, "w") as f:
      json.dump(result, f, indent=1)

  if not args.skip_tokens:
    samples = 8 * max(m[0] for m in meshes)
    result["tokens"] = token_check(meshes, args.token_impl, new_tokens=24, samples=samples)
    save()
  if not args.skip_throughput:
    config = preset(args.model)
    longest = args.prefix + args.new_tokens + 1
    config = config.replace(dtype=args.dtype,
                            max_position_embeddings=max(config.max_position_embeddings, longest))
    t0 = time.perf_counter()
    model = device_init(config, None)
    print(f"  1 device: weights in {time.perf_counter() - t0:.1f} s", flush=True)
    base = throughput(model, None, args.batch, args.prefix, args.new_tokens, args.impl)
    del model
    result["throughput"].append(base)
    print(f"  1 device: {base}", flush=True)
    save()
    for shape in meshes:
      mesh = S.make_mesh(shape)
      batch = args.batch if args.strong else args.batch * shape[0]
      model = device_init(config, mesh)
      row = throughput(model, mesh, batch, args.prefix, args.new_tokens, args.impl)
      del model
      if isinstance(row.get("tokens_per_s"), float) and isinstance(base.get("tokens_per_s"), float):
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["efficiency"] = row["speedup"] / mesh.size
      result["throughput"].append(row)
      print(f"  mesh {shape}: {row}", flush=True)
      save()

  md = markdown(result)
  with open(os.path.join(args.out, "sharded_decode.md"), "w") as f:
    f.write(md)
  print(md)
  bad = [r for r in result["tokens"] if not r["same"]]
  return 1 if bad else 0


def markdown(result) -> str:
  info = result["info"]
  lines = [f"{info['devices']} x {info['device']}, jax {info['jax']}, {info['date']}, "
           f"impl={info['impl']}", ""]
  if result["tokens"]:
    lines += ["| mesh | case | same tokens as 1 device |", "|---|---|---|"]
    lines += [f"| {tuple(r['mesh'])} | {r['case']} | "
              f"{'yes' if r['same'] else 'NO, first at ' + str(r['first_diff'])} |"
              for r in result["tokens"]]
    lines.append("")
  if result["throughput"]:
    lines += [f"{info['model']} {info['dtype']} (random weights), hydragen, prompt "
              f"{info['prefix']} tokens, {info['new_tokens']} new; {info['scaling']} scaling; "
              "decode only.", "",
              "| mesh (data, model) | devices | batch | tokens/s | step ms | speedup | "
              "efficiency |", "|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: (f % v) if isinstance(v, float) else str(v if v is not None else "")
    for r in result["throughput"]:
      lines.append(f"| {tuple(r['mesh']) if r['mesh'] else '1 GPU, no mesh'} | {r['devices']} | "
                   f"{r['batch']} | {fmt(r.get('tokens_per_s'), '%.0f')} | "
                   f"{fmt(r.get('step_ms'), '%.2f')} | {fmt(r.get('speedup'), '%.2f')} | "
                   f"{fmt(r.get('efficiency'), '%.2f')} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
