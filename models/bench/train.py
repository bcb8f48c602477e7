"""``hydragen bench train``: a whole GRPO training step, hydragen vs standard attention.

    python -m models.bench.train --layers 16 --out runs/train      # Llama-3-8B shape, bf16

One prompt of ``--prompt`` tokens, ``--group`` completions of ``--completion`` tokens each
(the GRPO shape: 16 x 512 after a 2K prompt), random weights of a named shape with
``--layers`` layers, one :func:`models.training.train_step` (log-probs, GRPO loss, backward,
AdamW update) per call. Modes:

* ``hydragen``: the prompt runs once, its K/V shared by the completions' queries;
* ``standard``: every completion runs its whole sequence (prompt + completion), the prompt's
  tokens recomputed per completion; attention through ``--standard-impl`` (``cudnn``:
  ``jax.nn.dot_product_attention``'s flash kernels, forward and backward).

Each mode: compile (timed), one warm-up step, then ``--steps`` timed steps (median).
Memory: the compiled step's temporaries and arguments (XLA's memory analysis) and the
device's peak after the mode (cumulative over the modes run so far). A mode that does not
fit is reported as OOM. Writes ``train.json`` and ``train.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

from models.bench import common

MODES = ("hydragen", "standard")


HELP = "A whole GRPO training step: hydragen vs standard attention."


def cudnn_causal(q, k, v):
  """cuDNN's fused flash attention (causal), the standard mode's baseline on GPUs."""
  import jax
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def attention_settings(impl: str):
  """The training step's attention: ``"cudnn"`` (:func:`cudnn_causal` for the standard mode's
  cache-less attention) or a :mod:`jax_shared_attn` impl."""
  from models.generation.settings import GenerationSettings
  if impl == "cudnn":
    return GenerationSettings(causal_attention=cudnn_causal)
  return GenerationSettings(impl=impl)


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="llama-3-8b", help="a preset name (random weights)")
  p.add_argument("--layers", type=int, default=16, help="decoder layers (as many as fit)")
  p.add_argument("--prompt", type=int, default=2048, help="prompt tokens (shared)")
  p.add_argument("--completion", type=int, default=512, help="tokens per completion")
  p.add_argument("--group", type=int, default=16, help="completions per prompt (G)")
  p.add_argument("--steps", type=int, default=3, help="timed steps per mode")
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--impl", default="auto", help="hydragen's attention implementation")
  p.add_argument("--standard-impl", default=None,
                 help="the standard mode's attention: cudnn (default on GPUs for 16-bit "
                      "dtypes) or a jax_shared_attn impl (default elsewhere: --impl)")
  p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                 help="recompute each layer in the backward pass (jax.checkpoint)")
  p.add_argument("--out", default="runs/train")
  p.set_defaults(handler=main_args)


def run_mode(config, mode: str, *, prompt: int, completion: int, group: int, steps: int,
             impl: str, remat: bool, seed: int = 0) -> dict:
  """Times ``steps`` training steps of ``mode`` on random weights; returns one result row."""
  import jax
  import numpy as np
  import optax

  from models.bench.decode import device_random_init
  from models.generation.prompt_tree import PromptTree
  from models.training import step as training
  from models.training.grpo import GRPOConfig

  rng = np.random.default_rng(seed)
  tree = PromptTree.from_prompts([rng.integers(0, config.vocab_size, prompt + 1).tolist()],
                                 group)
  completions = rng.integers(0, config.vocab_size, (group, completion)).astype(np.int32)
  rewards = rng.standard_normal(group).astype(np.float32)
  grpo = GRPOConfig(group_size=group)
  batch = training.make_batch(tree, completions, rewards, grpo, config)
  optimizer = optax.adamw(1e-6)
  attention = "hydragen" if mode == "hydragen" else "standard"
  row = dict(mode=mode, impl=impl, layers=config.num_layers, prompt=prompt,
             completion=completion, group=group, remat=remat,
             tokens=(prompt + group * completion if mode == "hydragen"
                     else group * (prompt + completion)))
  kwargs = dict(config=grpo, optimizer=optimizer, attention=attention,
                settings=attention_settings(impl), remat=remat, mesh=None)
  try:
    # Drawn here and dropped once copied into the state: one copy of the weights on the device.
    state = training.init_train_state(device_random_init(config, seed=seed), optimizer)
    gc.collect()
    start = time.perf_counter()
    compiled = training._train_step.lower(state, batch, None, **kwargs).compile()
    row["compile_s"] = round(time.perf_counter() - start, 2)
    try:  # which attention backward the step runs (cuDNN's custom call, counted in the HLO)
      row["cudnn_backward_calls"] = compiled.as_text().count("fmhaSoftmaxBackward")
    except Exception:  # noqa: BLE001 -- a backend without the text
      pass
    memory = compiled.memory_analysis()
    if memory is not None:
      row["temp_gb"] = round(memory.temp_size_in_bytes / 2**30, 3)
      row["argument_gb"] = round(memory.argument_size_in_bytes / 2**30, 3)
    state, metrics = compiled(state, batch, None)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      state, metrics = compiled(state, batch, None)
      jax.block_until_ready((state.params, metrics))
      times.append(time.perf_counter() - start)
    row["step_s"] = round(statistics.median(times), 4)
    row["loss"] = float(metrics["loss"])
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      row["peak_gb_so_far"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
  except Exception as e:  # noqa: BLE001 (an OOM is a result; anything else is re-raised)
    if not common.is_oom(e):
      raise
    row["error"] = "OOM"
  finally:
    state = None
    gc.collect()
  return row


def markdown(rows, info) -> str:
  lines = [f"# Whole GRPO training step ({info['model']}, {info['layers']} layers, "
           f"{info['dtype']}, remat={info['remat']})", "",
           f"{info['device']}, {info['date']}, jax {info['jax']}. One prompt of "
           f"{info['prompt']} tokens, {info['group']} completions of {info['completion']} "
           "tokens; log-probs, GRPO loss, backward and AdamW update in one jitted step.", "",
           "| mode | attention | tokens run | step (s) | compiled temporaries (GB) | "
           "arguments (GB) | device peak so far (GB) | compile (s) | cuDNN backward calls |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    cell = lambda k: "OOM" if "error" in r else str(r.get(k, "-"))
    lines.append(f"| {r['mode']} | {r['impl']} | {r['tokens']} | {cell('step_s')} | "
                 f"{cell('temp_gb')} | {cell('argument_gb')} | {cell('peak_gb_so_far')} | "
                 f"{cell('compile_s')} | {cell('cudnn_backward_calls')} |")
  done = {r["mode"]: r for r in rows if "step_s" in r}
  if len(done) == 2:
    h, s = done["hydragen"], done["standard"]
    lines += ["", f"hydragen: {s['step_s'] / h['step_s']:.2f}x faster per step"
              + (f", {s['temp_gb'] / h['temp_gb']:.2f}x fewer temporary bytes"
                 if h.get("temp_gb") else "") + "."]
  return "\n".join(lines) + "\n"


def main_args(args: argparse.Namespace) -> int:
  import jax

  from models.model.config import preset

  modes = [m for m in args.modes.split(",") if m]
  bad = sorted(set(modes) - set(MODES))
  if bad:
    raise SystemExit(f"bench train: --modes must be among {MODES}; got {bad}")
  config = preset(args.model, num_layers=args.layers, dtype=args.dtype)
  if args.prompt + 1 + args.completion > config.max_position_embeddings:
    raise SystemExit(f"bench train: --prompt {args.prompt} + --completion {args.completion} "
                     f"exceeds the model's context ({config.max_position_embeddings})")
  # cuDNN's flash attention takes 16-bit inputs only
  cudnn_ok = jax.default_backend() == "gpu" and args.dtype in ("bfloat16", "float16")
  standard_impl = args.standard_impl or ("cudnn" if cudnn_ok else args.impl)
  info = common.stamp(model=args.model, layers=args.layers, dtype=args.dtype, remat=args.remat,
                      prompt=args.prompt, completion=args.completion, group=args.group)
  rows = []
  for mode in modes:
    impl = args.impl if mode == "hydragen" else standard_impl
    rows.append(run_mode(config, mode, prompt=args.prompt, completion=args.completion,
                         group=args.group, steps=args.steps, impl=impl, remat=args.remat))
    print(json.dumps(rows[-1]), flush=True)
  os.makedirs(args.out, exist_ok=True)
  common.write_json(os.path.join(args.out, "train.json"), info, rows)
  text = markdown(rows, info)
  common.write_text(os.path.join(args.out, "train.md"), text)
  print(text)
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m models.bench.train",
                              description=__doc__.split("\n")[0])
  configure(p)
  return main_args(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
