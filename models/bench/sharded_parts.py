"""The measurements of ``hydragen bench sharded`` (:mod:`models.bench.sharded`), run inside its
worker processes: weights drawn into their shards, greedy tokens per mesh, decode throughput
(at a given batch or the largest that fits), and the model-axis collectives of the decode step.
"""

from __future__ import annotations

import functools
import gc
import time

from models.bench import common


def device_init(config, mesh, seed: int = 0, std: float = 0.02):
  """Random weights drawn on the devices, each parameter directly on its shards.

  The same values on every mesh, with no mesh and in every process layout (each
  parameter from ``fold_in(key(seed), i)`` at its original shape; threefry is
  partitionable); KV heads are repeated inside the same program where the model axis
  needs it.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding

  from models.model.llama import build, param_shapes
  from models.parallel import sharding as S

  dtype = config.param_dtype

  @functools.lru_cache(maxsize=None)  # one program per (shape, kind, sharding), not per layer
  def program(shape, kind, sharding):
    def draw(key):
      if kind == "norm":
        x = jnp.ones(shape, dtype)
      else:
        x = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
      if sharding is not None and kind == "kv":
        x = jnp.repeat(x, S.kv_replication(shape[1], mesh.shape[S.MODEL]), axis=1)
      return x
    return jax.jit(draw, out_shardings=sharding)

  key = jax.random.key(seed)
  params = {}
  for i, (path, spec) in enumerate(sorted(param_shapes(config).items())):
    sharding = None if mesh is None else NamedSharding(mesh, S.param_spec(path, config, mesh))
    kind = ("norm" if path.endswith("norm.weight") else
            "kv" if path.endswith(("k_proj", "v_proj")) else "normal")
    params[path] = program(tuple(spec.shape), kind, sharding)(jax.random.fold_in(key, i))
  return build(config if mesh is None else S.sharded_config(config, mesh), params)


def label(mesh) -> str:
  return "none" if mesh is None else f"({mesh[0]}, {mesh[1]})"


def token_cases(meshes, impl: str, say, which=("one", "tree", "standard")) -> dict:
  """Greedy tokens of a float32 model (8 query heads, 2 KV heads: replicated on a model axis
  of 4) for the cases ``which`` on each mesh; ``"case @ mesh"`` -> rows."""
  import numpy as np

  from models.generation.loop import generate
  from models.generation.prompt_tree import PromptTree
  from models.model.config import preset
  from models.parallel import distributed
  from models.parallel import sharding as S

  config = preset("tiny").replace(vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8,
                                  num_kv_heads=2, head_dim=64, intermediate_size=1024,
                                  dtype="float32")
  rng = np.random.default_rng(0)
  ids = lambda k: [int(t) for t in rng.integers(3, config.vocab_size, k)]
  shared = ids(300)
  samples = 8 * max([m[0] for m in meshes if m] + [1])
  half = samples // 2
  cases = {"hydragen one prompt": (ids(257), samples, "hydragen"),
           "hydragen two-level tree": (PromptTree.from_prompts(
               [shared + ids(40), shared + ids(17)], [half, samples - half], min_shared_tokens=4),
               None, "hydragen"),
           "standard": (ids(257), samples, "standard")}
  names = dict(one="hydragen one prompt", tree="hydragen two-level tree", standard="standard")
  unknown = set(which) - set(names)
  if unknown:
    raise ValueError(f"--token-cases: unknown {sorted(unknown)}; choose from {sorted(names)}")
  cases = {names[w]: cases[names[w]] for w in which}
  tokens = {}
  for shape in meshes:
    mesh = None if shape is None else S.make_mesh(shape)
    model = device_init(config, mesh, std=0.1)
    for name, (prompt, k, attention) in cases.items():
      out = generate(model, prompt, num_samples=k, max_new_tokens=24, attention=attention,
                     impl=impl, mesh=mesh)
      tokens[f"{name} @ {label(shape)}"] = np.asarray(distributed.gather(out)).tolist()
    say(f"tokens on mesh {label(shape)}")
    del model
    gc.collect()
  return tokens


def largest_batch(config, mesh, args) -> int:
  """The most sequences that fit, from the device memory: (free / bytes per sequence) x 0.6.

  Per device: weights / m, the shared prompt's K/V / m; per sequence its own K/V (the new
  tokens, 64-aligned), float32 logits twice and the prefix attention's scores, / m. Rounded
  down to a multiple of 64 per data shard. CPUs report no memory: 2 x --batch per shard.
  """
  import jax
  import numpy as np

  from models.generation.cache import kv_bytes_per_token
  from models.model.llama import param_shapes

  d, m = (1, 1) if mesh is None else mesh
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  if not limit:
    return d * 2 * args.batch
  weights = sum(int(np.prod(s.shape)) for s in param_shapes(config).values())
  weights *= np.dtype(config.param_dtype).itemsize
  per_token = kv_bytes_per_token(config)
  own = -(-args.new_tokens // 64) * 64
  per_seq = (own * per_token + 8 * config.vocab_size + 4 * config.num_heads * args.prefix) / m
  free = 0.9 * limit - (weights + args.prefix * per_token) / m - 2**30
  per_shard = int(0.6 * free / per_seq) // 64 * 64
  return d * max(per_shard, 64)


def throughput(config, mesh, batch, args, say) -> dict:
  """Decode-only tokens/s: prefill, 1 step (compiles), 1 step, then the timed steps in one call.

  ``batch=None``: the largest batch that fits (:func:`largest_batch`), halved up to twice on
  an out-of-memory error.
  """
  import jax
  import numpy as np

  from models.generation.loop import decode, prefill
  from models.parallel import sharding as S

  m = None if mesh is None else S.make_mesh(mesh)
  tries = [batch] if batch is not None else [largest_batch(config, mesh, args) // 2**i
                                             for i in range(3)]
  prompt = np.random.default_rng(1).integers(3, config.vocab_size, args.prefix).tolist()
  t0 = time.perf_counter()
  model = device_init(config, m)
  jax.block_until_ready(model)
  row = dict(mesh=list(mesh) if mesh else None, devices=1 if m is None else m.size,
             largest=batch is None, init_s=time.perf_counter() - t0)
  for b in tries:
    row.update(batch=b)
    state = None
    try:
      t0 = time.perf_counter()
      state = jax.block_until_ready(prefill(model, prompt, num_samples=b,
                                            max_new_tokens=args.new_tokens, impl=args.impl,
                                            mesh=m))
      row["prefill_s"] = time.perf_counter() - t0
      t0 = time.perf_counter()
      state = jax.block_until_ready(decode(model, state, 1, impl=args.impl))
      row["compile_s"] = time.perf_counter() - t0
      state = jax.block_until_ready(decode(model, state, 1, impl=args.impl))
      steps = args.new_tokens - 2
      t0 = time.perf_counter()
      state = jax.block_until_ready(decode(model, state, steps, impl=args.impl))
      dt = time.perf_counter() - t0
      row.update(steps=steps, step_ms=dt / steps * 1e3, tokens_per_s=b * steps / dt)
      break
    except Exception as e:  # noqa: BLE001 -- an out-of-memory point is reported, not fatal
      if not common.is_oom(e):
        raise
      row["tokens_per_s"] = "oom"
    finally:
      del state
      gc.collect()
  del model
  gc.collect()
  say(f"throughput mesh {label(mesh)} batch {row['batch']}: {row.get('tokens_per_s')}")
  return row


def collectives(config, mesh, batch, args, say) -> dict:
  """The collectives of the compiled decode step: per layer (1 and 2 layers compiled, the
  difference) and the rest; op, result type, bytes, group size. Plus the measured time of
  the per-layer all-reduce on this mesh."""
  from models.generation.loop import lower_decode, prefill
  from models.parallel import sharding as S

  m = S.make_mesh(mesh)
  prompt = list(range(3, 3 + args.prefix))
  from models.parallel.hlo_collectives import parse_collectives, subtract, time_all_reduce

  found = {}
  for layers in (1, 2):
    small = config.replace(num_layers=layers)
    model = device_init(small, m)
    state = prefill(model, prompt, num_samples=batch, max_new_tokens=args.new_tokens,
                    impl=args.impl, mesh=m)
    found[layers] = parse_collectives(lower_decode(model, state, impl=args.impl).compile()
                                      .as_text())
    del model, state
    gc.collect()
  per_layer = subtract(found[2], found[1])
  rest = subtract(found[1], per_layer)
  row = dict(mesh=list(mesh), batch=batch, per_layer=per_layer, rest=rest,
             per_layer_bytes=sum(c["bytes"] * c["count"] for c in per_layer))
  reduce = [c for c in per_layer if c["op"] == "all-reduce"]
  if reduce:
    row["all_reduce_us"] = time_all_reduce(m, reduce[0]["type"])
    row["per_step_all_reduce_ms"] = (row["all_reduce_us"] * sum(c["count"] for c in reduce)
                                     * config.num_layers / 1e3)
  say(f"collectives mesh {label(mesh)}: {per_layer}")
  return row
