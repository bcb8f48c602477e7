"""GRPO fine-tuning over a prompt tree: the loss (``grpo``), per-token log-probs of completions
under shared prompts (``logprobs``), one optimizer step (``step``); ``addition`` is a worked
example (a toy addition task, ``hydragen train grpo``)."""

from models.training.grpo import GRPOConfig, group_advantages, grpo_loss  # noqa: F401
from models.training.step import (GRPOBatch, TrainState, default_optimizer,  # noqa: F401
                                  init_train_state, make_batch, train_step)
