"""GRPO rollouts drawn from a serving engine instead of a static :func:`models.generate` call.

    >>> engine = Engine(model, tokenizer, EngineConfig(...))
    >>> for step in range(steps):
    ...   completions = engine_rollouts(engine, tree, max_new_tokens=32, temperature=1.0,
    ...                                 seed=step, eos_id=tokenizer.eos_id)
    ...   state, metrics = train_step(state, make_batch(tree, completions, ...), ...)
    ...   engine.reset(model=state.model())             # the new weights, an empty cache

The engine decodes each sample only until it ends (static ``generate`` decodes every
sample to the longest) and returns what ``generate`` returns for the same tree and seed:
sample b of the tree draws with the key of (seed, b, step).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from models.generation.loop import PAD_ID, as_prompt_tree
from models.serving import Engine, Request


def engine_rollouts(engine: Engine, prompts, num_samples=1, *, max_new_tokens: int,
                    temperature: float = 1.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None, seed: int = 0,
                    eos_id: Optional[int] = None, pad_id: int = PAD_ID) -> np.ndarray:
  """int32 ``[samples, max_new_tokens]``: ``generate(model, prompts, num_samples=...,
  max_new_tokens=..., temperature=..., seed=..., eos_id=...)`` through ``engine``.

  ``prompts``: what :func:`models.generate` takes (a prompt, prompts, or a
  :class:`PromptTree` listing its samples). A sample ends after ``eos_id``; the rest of its row
  is ``pad_id``. The consecutive samples of one prompt are one request (``n`` samples sharing
  its pages), numbered as ``generate`` numbers them (``Request.sample_offset``).
  """
  tree = as_prompt_tree(prompts, num_samples)
  requests, b = [], 0
  while b < tree.num_samples:
    prompt, n = tree.prompt(b), 1
    while b + n < tree.num_samples and tree.prompt(b + n) == prompt:
      n += 1
    requests.append(Request(prompt, n=n, max_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, sample_offset=b,
                            stop_token_ids=() if eos_id is None else (eos_id,),
                            ignore_eos=True))
    b += n
  out = np.full((tree.num_samples, max_new_tokens), pad_id, np.int32)
  for request, result in zip(requests, engine.generate(requests)):
    for i, sample in enumerate(result.samples):
      out[request.sample_offset + i, :len(sample.token_ids)] = sample.token_ids
  return out
