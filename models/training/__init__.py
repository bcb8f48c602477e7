"""GRPO fine-tuning over a prompt tree: the loss (``grpo``), per-token log-probs of completions
under shared prompts (``logprobs``), one optimizer step (``step``), rollouts drawn from the
serving engine (``rollouts``); ``addition`` is a worked example (a toy addition task,
``hydragen train grpo``). The names below are imported on first use (the command line imports
``addition`` without them)."""

import importlib

_EXPORTS = {
    **{name: "models.training.grpo" for name in ("GRPOConfig", "group_advantages", "grpo_loss")},
    **{name: "models.training.step" for name in ("GRPOBatch", "TrainState", "default_optimizer",
                                                 "init_train_state", "make_batch", "train_step")},
    "engine_rollouts": "models.training.rollouts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'models.training' has no attribute {name!r}")
