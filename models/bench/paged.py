"""``hydragen bench paged``: paged attention against the contiguous kernels it replaces.

For each decode configuration (B sequences, a prefix of P tokens shared by all, S own tokens
each), one run times on the same device and data

* ``contiguous``: :func:`jax_shared_attn.shared_prefix_attention` over contiguous buffers;
* ``paged``: :func:`jax_shared_attn.paged_attention` over page pools of ``--page-size`` tokens,
  the prefix one shared level, pages in a random order;
* ``gather``: the pages gathered into contiguous buffers, then ``shared_prefix_attention``
  (what the engine's attention cost before the kernels read pages in place);

with the floor of the call (:class:`pallas_kernels.base.AttentionShape`, this run's copy
bandwidth and matmul rate). Device time per call (profiler). Writes JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import os

from models.bench import common

HELP = "Paged attention vs the contiguous kernels (decode, one shared prefix)."
# (B, P, S) at the Llama-3-8B heads (32/8/128) and the paper's (8/1/128): docs/benchmarks.md's
# attention configurations.
CONFIGS = {"llama": [(256, 4096, 128), (1024, 4096, 128), (256, 16384, 128),
                     (1024, 16384, 128)],
           "paper": [(256, 4096, 128), (1024, 16384, 128)]}
HEADS = {"llama": (32, 8), "paper": (8, 1)}


def configure(d: argparse.ArgumentParser) -> None:
  d.add_argument("--shapes", default="llama,paper", help="head shapes: llama (32/8), paper (8/1)")
  d.add_argument("--page-size", type=common.ints, default=[16, 64])
  d.add_argument("--impl", default="auto")
  d.add_argument("--out", default="runs/paged")
  d.set_defaults(handler=_run)


def _inputs(seed: int, b: int, p: int, s: int, hq: int, hkv: int, ps: int):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jax_shared_attn import PagedLevel

  d = 128
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (b, 1, hq, d), jnp.bfloat16)
  pk = jax.random.normal(ks[1], (p, hkv, d), jnp.bfloat16)
  pv = jax.random.normal(ks[2], (p, hkv, d), jnp.bfloat16)
  sk = jax.random.normal(ks[3], (b, s, hkv, d), jnp.bfloat16)
  sv = jax.random.normal(ks[4], (b, s, hkv, d), jnp.bfloat16)
  n_prefix, n_own = -(-p // ps), -(-s // ps)
  n_pages = 1 + n_prefix + b * n_own
  order = np.random.default_rng(seed).permutation(np.arange(1, n_pages)).astype(np.int32)
  prefix_table = jnp.asarray(order[:n_prefix][None])
  own_table = jnp.asarray(order[n_prefix:].reshape(b, n_own))

  def pool(prefix, own):
    flat = jnp.zeros((n_pages, ps) + prefix.shape[1:], prefix.dtype)
    pad = lambda x, n: jnp.pad(x, ((0, n * ps - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
    flat = flat.at[prefix_table[0]].set(pad(prefix, n_prefix).reshape(n_prefix, ps, *prefix.shape[1:]))
    own_pages = jax.vmap(lambda x: pad(x, n_own))(own).reshape(b * n_own, ps, *own.shape[2:])
    return flat.at[own_table.reshape(-1)].set(own_pages)

  level = PagedLevel(prefix_table, jnp.asarray([p], jnp.int32), jnp.zeros((b,), jnp.int32))
  lens = jnp.full((b,), s, jnp.int32)
  return dict(q=q, pk=pk, pv=pv, sk=sk, sv=sv, k_pages=pool(pk, sk), v_pages=pool(pv, sv),
              own=own_table, level=level, lens=lens)


def _run(args: argparse.Namespace) -> int:
  import jax
  import jax.numpy as jnp

  from jax_shared_attn import paged_attention, shared_prefix_attention
  from models.bench import timing
  from pallas_kernels.base import AttentionShape, gather_pages

  os.makedirs(args.out, exist_ok=True)
  bw, rate = timing.ceilings()
  info = common.stamp(bandwidth_GBps=bw / 1e9, matmul_TFLOPs=rate / 1e12, impl=args.impl)
  rows = []
  impl = args.impl

  def contiguous(x):
    return shared_prefix_attention(x["q"], x["pk"], x["pv"], x["sk"], x["sv"],
                                   suffix_lengths=x["lens"], impl=impl)

  def paged(x):
    return paged_attention(x["q"], x["k_pages"], x["v_pages"], x["own"], x["lens"],
                           levels=[x["level"]], impl=impl)

  def gather(x):
    t = x["level"].page_table[0]
    p = x["pk"].shape[0]
    pk = gather_pages(x["k_pages"], t[None])[0, :p]
    pv = gather_pages(x["v_pages"], t[None])[0, :p]
    return shared_prefix_attention(x["q"], pk, pv, gather_pages(x["k_pages"], x["own"]),
                                   gather_pages(x["v_pages"], x["own"]),
                                   suffix_lengths=x["lens"], impl=impl)

  for shape in args.shapes.split(","):
    hq, hkv = HEADS[shape]
    for b, p, s in CONFIGS[shape]:
      floor = AttentionShape(b, p, s, hq, hkv, 128).floor_s(bw, rate)
      for ps in args.page_size:
        row = dict(shape=shape, B=b, P=p, S=s, page_size=ps, floor_us=floor * 1e6)
        try:
          sets = [_inputs(i, b, p, s, hq, hkv, ps) for i in range(2)]
          for name, fn in (("contiguous", contiguous), ("paged", paged), ("gather", gather)):
            r = timing.measure(fn, lambda i: (sets[i],), n_sets=2, trials=5)
            row[f"{name}_us"] = r["seconds"] * 1e6
          ref = contiguous(sets[0]).astype(jnp.float32)
          row["max_abs_diff"] = float(jnp.max(jnp.abs(paged(sets[0]).astype(jnp.float32) - ref)))
          row["paged_vs_contiguous"] = row["contiguous_us"] / row["paged_us"]
          del sets
        except Exception as e:  # noqa: BLE001 -- a point that does not fit is reported as such
          if not common.is_oom(e):
            raise
          row["error"] = "out of memory"
        rows.append(row)
        print(json.dumps(row), flush=True)
        common.write_json(os.path.join(args.out, "paged.json"), info, rows)
  common.write_text(os.path.join(args.out, "paged.md"), _markdown(rows, info))
  print(_markdown(rows, info))
  return 0


def _markdown(rows, info) -> str:
  head = (f"Paged vs contiguous decode attention, {info['device']}, {info['date']}, "
          f"impl={info['impl']}, bf16, device time per call (us).\n\n"
          "| heads | B | P | S | page | floor | contiguous | paged | gather | contiguous / paged |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
  lines = []
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['shape']} | {r['B']} | {r['P']} | {r['S']} | {r['page_size']} | "
                   f"{r['floor_us']:.1f} | x | x | x | x |")
      continue
    lines.append(f"| {r['shape']} | {r['B']} | {r['P']} | {r['S']} | {r['page_size']} | "
                 f"{r['floor_us']:.1f} | {r['contiguous_us']:.1f} | {r['paged_us']:.1f} | "
                 f"{r['gather_us']:.1f} | {r['paged_vs_contiguous']:.2f} |")
  return head + "\n".join(lines) + "\n"
