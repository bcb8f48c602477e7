"""Does running the prefix and suffix kernels on two CUDA streams overlap them?

The two-kernel path (``pallas_kernels.gpu._split_shared_attention``) runs the prefix kernel
(compute-bound on the tensor cores) and then the suffix kernel (bound by HBM reads), which
merges the prefix's state in its epilogue: their times add, where the floor takes the larger.
This experiment drops that dependency: the suffix kernel runs without the prior, one of the two
kernels goes on a second stream (``jax.experimental.compute_on.compute_on2`` with
``compute_type="gpu_stream:1"``: XLA wraps the call in call-start / call-done on another
stream), and XLA merges the two states afterwards (fused into the layout change). Variants:

* ``split``: the shipped two-kernel path (``fused_decode(False)``, ``flat_decode(0)``),
* ``sep``: prefix, suffix without prior, XLA merge, one stream (what the merge pass costs),
* ``side_prefix`` / ``side_suffix``: the same with the prefix / the suffix on stream 1,
* with ``--prefix-sms N``, ``sep_smsN`` / ``side_suffix_smsN``: the prefix kernel's key splits
  chosen for N SMs instead of 132 (fewer CTAs, so SMs are left free for the suffix kernel:
  does the block scheduler then run the two side by side?).

Device time is the profiler's union of kernel intervals over all streams
(``jax_shared_attn.bench.timing``), so overlap shows as a shorter time; the table at the end
also gives each variant's summed kernel time and the overlap (sum minus busy). Run on the GPU machine:
``PYTHONPATH=. python3 tools/device/streams.py --out $OUT``. Writes ``streams.json`` and prints a
table. A development tool.
"""

import argparse
import contextlib
import functools
import json
import os

import jax
import jax.numpy as jnp

import pallas_kernels.gpu as gpu
from jax_shared_attn import shared_prefix_attention
from jax_shared_attn.bench import attention as bench
from jax_shared_attn.bench import profile as profile_lib
from jax_shared_attn.merge import merge_states
from pallas_kernels.gpu import _common
from pallas_kernels.gpu import prefix_attention_mgpu as mg
from pallas_kernels.gpu.prefix_attention import prefix_attention_rows
from pallas_kernels.gpu.suffix_attention import suffix_rows


def _side(fn, stream):
  if stream is None:
    return fn
  from jax._src import core
  from jax.experimental import compute_on as co
  wrap = getattr(co, "compute_on2", None) or co.compute_on  # renamed in jax 0.11
  return wrap(fn, compute_type=f"gpu_stream:{stream}",
              out_memory_spaces=(core.MemorySpace.Device, core.MemorySpace.Device))


@contextlib.contextmanager
def _prefix_sms(num_sms):
  """While tracing: the Mosaic prefix kernel's splits chosen as if the GPU had ``num_sms``."""
  if num_sms is None:
    yield
    return
  orig = mg.default_config
  mg.default_config = functools.partial(orig, num_sms=num_sms)
  try:
    yield
  finally:
    mg.default_config = orig


def decoupled(prefix_stream=None, suffix_stream=None, prefix_sms=None):
  def op(*args):
    with _prefix_sms(prefix_sms):
      return _op(*args)

  def _op(q, pk, pv, sk, sv):
    b, tq, hq, d = q.shape
    hkv = pk.shape[1]
    m = tq * (hq // hkv)
    scale = d ** -0.5
    q_rows = _common.fold_rows(q, hkv)  # [Hkv, B*M, D]
    lens = jnp.full((b,), sk.shape[1], jnp.int32)

    def prefix(q_rows, pk, pv):
      return prefix_attention_rows(q_rows, pk, pv, kv_length=pk.shape[0], scale=scale,
                                   mosaic=True)

    def suffix(q_rows, sk, sv, lens):
      return suffix_rows(q_rows.reshape(hkv, b, m, d), sk, sv, lens, [], q_len=tq, causal=False,
                         scale=scale, out_dtype=q.dtype, by_sequence=True)

    p_out, p_lse = _side(prefix, prefix_stream)(q_rows, pk, pv)  # [n, Hkv, B*M(,D)]
    s_out, s_lse = _side(suffix, suffix_stream)(q_rows, sk, sv, lens)  # [B, Hkv, M(,D)]
    n = p_out.shape[0]
    p_out = jnp.swapaxes(p_out.reshape(n, hkv, b, m, d), 1, 2)
    p_lse = jnp.swapaxes(p_lse.reshape(n, hkv, b, m), 1, 2)
    out, _ = merge_states([*p_out, s_out.astype(jnp.float32)], [*p_lse, s_lse])
    return out.astype(q.dtype).reshape(b, tq, hq, d)
  return op


def split(q, pk, pv, sk, sv):
  with gpu.fused_decode(False), gpu.flat_decode(0):
    return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


def shipped(q, pk, pv, sk, sv):
  return shared_prefix_attention(q, pk, pv, sk, sv, impl="auto")


VARIANTS = {
    "shipped": shipped,
    "split": split,
    "sep": decoupled(),
    "side_prefix": decoupled(prefix_stream=1),
    "side_suffix": decoupled(suffix_stream=1),
}


def stream_report(op, spec, calls=3):
  """Kernel intervals of a few calls of ``op`` on ``spec``'s inputs, with the stream each ran on
  (the profiler's line names): did the two kernels run on two streams, and at the same time?"""
  args = bench._inputs(bench.parse_spec(spec)[1], jnp.bfloat16, 0)
  fn = jax.jit(op)
  jax.block_until_ready(fn(*args))
  # The entry computation's schedule: where XLA put the async start/done around the kernels.
  hlo = fn.lower(*args).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  schedule = [ln.strip()[:160] for ln in entry.splitlines()
              if any(t in ln for t in ("call-start", "call-done", "custom-call", "async", "fusion("))]
  events = profile_lib.device_events(
      lambda: [jax.block_until_ready(fn(*args)) for _ in range(calls)]) or []
  t0 = events[0].start_ns if events else 0
  return schedule, [dict(start_us=(e.start_ns - t0) / 1e3, dur_us=e.duration_ns / 1e3,
                         stream=e.stream[:24], kernel=e.name[:50]) for e in events]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--configs", default="llama:1024:1024:128,llama:1024:2048:64,"
                  "llama:1024:2048:128,llama:1024:4096:128,llama:256:4096:128,"
                  "llama:256:16384:128,llama:1024:16384:128,paper:1024:16384:128,"
                  "paper:1024:4096:128")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--trials", type=int, default=3)
  ap.add_argument("--prefix-sms", type=int, default=None,
                  help="also time sep / side_suffix with the prefix splits chosen for N SMs")
  ap.add_argument("--report", default=None,
                  help="VARIANT@SPEC: print the kernel intervals and streams of a few calls")
  ap.add_argument("--out", default=".")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  variants = dict(VARIANTS)
  if args.prefix_sms:
    n = args.prefix_sms
    variants[f"sep_sms{n}"] = decoupled(prefix_sms=n)
    variants[f"side_suffix_sms{n}"] = decoupled(suffix_stream=1, prefix_sms=n)
  if args.report:
    v, spec = args.report.split("@")
    schedule, events = stream_report(variants[v], spec)
    print("\n".join(schedule))
    for e in events:
      print(f"{e['start_us']:9.1f} {e['dur_us']:8.1f}  {e['stream']:24s} {e['kernel']}")
    with open(os.path.join(args.out, f"report_{v}.json"), "w") as f:
      json.dump(dict(schedule=schedule, events=events), f, indent=1)
    return
  names = args.variants.split(",")
  if args.prefix_sms:
    names += [f"sep_sms{args.prefix_sms}", f"side_suffix_sms{args.prefix_sms}"]
  rows = bench.compare_variants({v: variants[v] for v in names}, args.configs,
                                trials=args.trials, out_json=os.path.join(args.out, "streams.json"))
  print("\n| shape | B | P | S | variant | busy us | kernels summed us | overlap us | kernels |")
  print("|---|---:|---:|---:|---|---:|---:|---:|---|")
  for r in rows:
    for v in names:
      if not isinstance(r.get(v), float):
        continue
      ks = r.get(f"{v}_kernels", [])
      total = sum(k["us"] for k in ks)
      top = "; ".join(f"{k['name'][:40]} {k['us']:.1f}" for k in ks[:3])
      print(f"| {r['shape']} | {r['B']} | {r['P']} | {r['S']} | {v} | {r[v]:.1f} | {total:.1f} | "
            f"{total - r[v]:.1f} | {top} |")
  with open(os.path.join(args.out, "overlap.json"), "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
