"""Where the GPU idles inside the jitted decode loop (device experiment).

Profiles ``--steps`` decode steps of a random-weight model and prints the device busy time, the
span of the kernels, and the largest idle gaps with the kernels around them. The profiled call
includes the ``decode()`` wrapper's host work before the loop starts (it reads ``state.step``
and the cache lengths: the gap "after MemcpyD2H before MemcpyH2D", ~35-45 ms per call on an
H100): divided by ``--steps``, it shrinks as the steps grow; what stays per step is the loop's.

  python3 tools/device/decode_gaps.py --model llama-3-8b --batch 1024 --prefix 2048 --mode none
"""

import argparse
import collections

import jax
import numpy as np


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="llama-3-8b")
  ap.add_argument("--batch", type=int, default=1024)
  ap.add_argument("--prefix", type=int, default=2048)
  ap.add_argument("--mode", default="none")
  ap.add_argument("--steps", type=int, default=6)
  args = ap.parse_args()
  from jax_shared_attn.bench import profile
  from models.bench_decode import device_random_init
  from models.config import preset
  from models.generate import decode, prefill
  model = device_random_init(preset(args.model).replace(dtype="bfloat16"))
  prompt = np.random.default_rng(0).integers(3, model.config.vocab_size, size=args.prefix).tolist()
  state = prefill(model, prompt, num_samples=args.batch, max_new_tokens=2 * args.steps + 4,
                  attention=args.mode)
  state = jax.block_until_ready(decode(model, state, args.steps))  # compile
  holder = [state]

  def run():
    holder[0] = jax.block_until_ready(decode(model, holder[0], args.steps))

  events = profile.device_events(run)
  if not events:
    raise SystemExit("no device events (the profiler sees no GPU/TPU plane here)")
  events = sorted(events, key=lambda e: e.start_ns)
  busy = profile.busy_ns(events) / 1e6 / args.steps
  span = (events[-1].end_ns - events[0].start_ns) / 1e6 / args.steps
  print(f"{args.mode} B={args.batch} P={args.prefix}: {len(events) / args.steps:.0f} kernels/step, "
        f"busy {busy:.2f} ms/step, span {span:.2f} ms/step")
  gaps, end, prev = [], events[0].end_ns, events[0].name
  for e in events[1:]:
    if e.start_ns > end:
      gaps.append((e.start_ns - end, prev, e.name))
    if e.end_ns > end:
      end, prev = e.end_ns, e.name
  total = sum(g for g, _, _ in gaps) / 1e6 / args.steps
  by_size = collections.Counter()
  for g, _, _ in gaps:
    by_size["<2us" if g < 2e3 else "2-10us" if g < 1e4 else "10-100us" if g < 1e5 else ">100us"] += g
  print(f"idle {total:.2f} ms/step in {len(gaps) / args.steps:.0f} gaps/step; by size (ms/step):",
        {k: round(v / 1e6 / args.steps, 3) for k, v in by_size.items()})
  pairs = collections.Counter()
  for g, a, b in gaps:
    pairs[(a[:40], b[:40])] += g
  for (a, b), g in pairs.most_common(12):
    print(f"  {g / 1e6 / args.steps:7.3f} ms/step  after {a}  before {b}")


if __name__ == "__main__":
  main()
