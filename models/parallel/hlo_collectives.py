"""The collectives of a compiled XLA program: which ops, their result types, bytes, group sizes.

    >>> text = jax.jit(f).lower(*args).compile().as_text()
    >>> parse_collectives(text)   # [{"op": "all-reduce", "type": "bf16[512,1,4096]", ...}, ...]

Counting the ops of a program compiled with 1 and with 2 layers and subtracting
(:func:`subtract`) gives what each layer adds; :func:`loop_text` restricts the text to what a
while loop runs per iteration. :func:`time_all_reduce` measures one all-reduce of a given type
over the mesh's model axis.
"""

from __future__ import annotations

import re
import time

COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                        r"collective-permute)(-start)?\(")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4,
               "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def loop_text(hlo: str, *, condition: bool = True) -> str:
  """The text of the entry computation's (first) while loop: its body, its condition (unless
  ``condition=False``) and every computation they call (fusions, reductions, conditionals),
  transitively: what runs once per iteration, e.g. per decode step."""
  blocks = loop_computations(hlo, condition=condition)
  return "\n".join(blocks[n] for n in sorted(blocks))


def loop_computations(hlo: str, *, condition: bool = True) -> dict[str, str]:
  """:func:`loop_text`, one entry per computation: name -> its instructions' text."""
  blocks = dict(re.findall(r"^(?:ENTRY )?%?([\w.-]+) [^\n]*\{\n(.*?)^\}", hlo, re.M | re.S))
  (entry,) = re.findall(r"^ENTRY %?([\w.-]+)", hlo, re.M)
  loop = re.search(r" while\([^\n]*", blocks[entry])
  if loop is None:
    raise ValueError("loop_text: the entry computation has no while loop")
  keys = ("body", "condition") if condition else ("body",)
  todo = [re.search(rf"{k}=%?([\w.-]+)", loop.group(0)).group(1) for k in keys]
  seen = set()
  while todo:
    name = todo.pop()
    if name in seen or name not in blocks:
      continue
    seen.add(name)
    for ref in re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\n]*)",
                          blocks[name]):
      todo += re.findall(r"%?([\w.-]+)", ref)
  return {n: blocks[n] for n in seen}


def parse_collectives(hlo: str) -> list[dict]:
  """Collective ops of an HLO module text: op, result type, bytes, group size, count."""
  counts = {}
  for line in hlo.splitlines():
    match = COLLECTIVE.search(line)
    if match is None:
      continue
    rtype, op, start = match.groups()
    shapes = re.findall(r"(\w+)\[([\d,]*)\]", rtype)
    if start and op != "all-reduce":
      shapes = shapes[-1:]  # async starts return (operand, result): the result
    nbytes = sum(DTYPE_BYTES.get(t, 4) * _prod(dims) for t, dims in shapes)
    key = (op, " ".join(f"{t}[{d}]" for t, d in shapes), nbytes, group_size(line))
    counts[key] = counts.get(key, 0) + 1
  return [dict(op=o, type=t, bytes=b, group=g, count=c) for (o, t, b, g), c in counts.items()]


def group_size(line: str):
  """Devices per replica group, from the three spellings XLA prints (None: every device)."""
  explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)  # {{0,1},{2,3}}
  if explicit:
    return len(explicit.group(1).split(","))
  iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", line)  # [2,2]<=[4]
  if iota:
    return int(iota.group(1))
  named = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{([^}]*)\}", line)  # mesh[...] {'a'}
  if named:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
    return _prod(",".join(sizes[a] for a in re.findall(r"'(\w+)'", named.group(2))))
  return None


def _prod(dims: str) -> int:
  out = 1
  for d in filter(None, dims.split(",")):
    out *= int(d)
  return out


def subtract(a, b) -> list[dict]:
  left = {(c["op"], c["type"], c["bytes"], c["group"]): c["count"] for c in a}
  for c in b:
    key = (c["op"], c["type"], c["bytes"], c["group"])
    left[key] = left.get(key, 0) - c["count"]
  return [dict(op=o, type=t, bytes=nb, group=g, count=c) for (o, t, nb, g), c in left.items()
          if c > 0]


def time_all_reduce(mesh, rtype: str, repeats: int = 100) -> float:
  """Microseconds per all-reduce of one array of ``rtype`` over the model axis (psum inside a
  jitted loop; median of 3 runs)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  from jax_shared_attn.sharding import shard_map
  from models.parallel import sharding as S

  t, dims = re.match(r"(\w+)\[([\d,]*)\]", rtype).groups()
  dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16}.get(t, jnp.float32)
  shape = tuple(int(d) for d in dims.split(",") if d)
  d = mesh.shape[S.DATA]
  x = jnp.ones((shape[0] * d,) + shape[1:], dtype, device=S.rows_sharding(mesh, len(shape)))

  def body(block):
    m = mesh.shape[S.MODEL]
    return lax.fori_loop(0, repeats, lambda i, y: lax.psum(y, S.MODEL) / m, block)

  spec = P(S.DATA, *(None,) * (len(shape) - 1))
  run = jax.jit(shard_map(body, mesh, (spec,), spec))
  jax.block_until_ready(run(x))
  times = []
  for _ in range(3):
    t0 = time.perf_counter()
    jax.block_until_ready(run(x))
    times.append((time.perf_counter() - t0) / repeats * 1e6)
  return float(np.median(times))
