"""The bridge between HTTP requests and the engine loop.

The engine runs its own loop in a background thread (:meth:`models.serving.Engine.start`);
a request is submitted without waiting for a tick (the engine's inbox), and its tokens come
back through :meth:`Engine.follow`, which wakes the asyncio loop from the engine's thread.
Detokenisation happens here, on the HTTP side, never on the engine's thread
(:class:`models.server.detokenize.IncrementalText`).

:meth:`Backend.prepare` turns an OpenAI request into engine requests, checking what the
engine would refuse first, so that every error names the OpenAI field; :meth:`Backend.submit`
queues them and :meth:`Backend.updates` follows them, yielding :class:`Update` values.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import AsyncIterator, Optional, Sequence

from models.server.detokenize import IncrementalText
from models.server.logprobs import TokenPieces
from models.server.protocol import APIError
from models.serving import Engine, Request, TokenLogprobs


@dataclasses.dataclass
class Job:
  """One prompt of an HTTP request: its engine request and the OpenAI field it came from."""
  request: Request
  prompt_field: str
  limit_field: str


@dataclasses.dataclass(frozen=True)
class Update:
  """New output of choice ``index``: its text (certain, never half a character), its token
  ids, when it ends its finish reason (``"stop"``, ``"length"``; ``"abort"`` if the server
  cancelled it), and when asked for the log-probs of its token ids (else None)."""
  index: int
  text: str
  token_ids: tuple[int, ...]
  finish_reason: Optional[str] = None
  logprobs: Optional[tuple[TokenLogprobs, ...]] = None


@dataclasses.dataclass
class Totals:
  """A request's usage, filled as its prompts finish."""
  prompt_tokens: int = 0
  completion_tokens: int = 0
  cached_tokens: int = 0


class Backend:
  """What the HTTP layer serves: an engine (its loop running), its tokenizer, the model's
  name, and the metrics it reports to (:class:`models.server.metrics.Metrics` or None)."""

  def __init__(self, engine: Engine, model_name: str, metrics=None):
    self.engine, self.tokenizer, self.model_name = engine, engine.tokenizer, model_name
    self.metrics = metrics
    self.context = engine.model_config.max_position_embeddings
    self.vocab = engine.model_config.vocab_size
    self.pieces = TokenPieces(self.tokenizer)  # token texts and bytes for log-probs
    engine.start()

  # -- checking ---------------------------------------------------------------------------------

  def encode(self, text: str, field: str) -> list[int]:
    if self.tokenizer is None:
      raise APIError(f"{field}: this model has no tokenizer; send token ids", field)
    ids = self.tokenizer.encode(text)
    if not ids:
      raise APIError(f"{field}: encodes to no tokens", field)
    return ids

  def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
    """The token ids of ``messages`` under the checkpoint's chat template."""
    if self.tokenizer is None:
      raise APIError("messages: this model has no tokenizer (chat needs one)", "messages")
    try:
      text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 -- the template's own complaint about the messages
      raise APIError(f"messages: the chat template rejects them ({' '.join(str(e).split())})",
                     "messages") from None
    return self.encode(text, "messages")

  def prepare(self, prompts: Sequence[list[int]], *, prompt_field: str, n: int,
              max_tokens: Optional[int], limit_field: str, temperature: float,
              top_p: Optional[float], top_k: Optional[int], stop: tuple[str, ...],
              seed: Optional[int], ignore_eos: bool, top_logprobs: Optional[int] = None,
              logprobs_field: str = "logprobs") -> list[Job]:
    """Engine requests for ``prompts`` (token ids), after the checks the engine would make,
    each naming the OpenAI field. ``max_tokens=None``: up to the context (and the cache).
    ``top_logprobs``: None, or the log-probs of each token and this many most likely ones
    (asked for by ``logprobs_field``)."""
    c = self.engine.config
    if n > c.max_running:
      raise APIError(f"n: at most {c.max_running} samples per prompt (the server's "
                     f"--max-running); got {n}", "n")
    if top_logprobs is not None and top_logprobs > min(c.max_logprobs, self.vocab):
      raise APIError(f"{logprobs_field}: at most {min(c.max_logprobs, self.vocab)} most "
                     f"likely tokens on this server; got {top_logprobs}", logprobs_field)
    if stop and self.tokenizer is None:
      raise APIError("stop: stop strings need a tokenizer; this model has none", "stop")
    if seed is None:
      seed = random.getrandbits(31)
    jobs = []
    for i, ids in enumerate(prompts):
      where = prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]"
      bad = [t for t in ids if not 0 <= t < self.vocab]
      if bad:
        raise APIError(f"{where}: token id {bad[0]} is outside the vocabulary [0, "
                       f"{self.vocab})", prompt_field)
      if len(ids) >= self.context:
        raise APIError(f"{where}: {len(ids)} tokens; the model's context is {self.context} "
                       "(and leaves no room for output)", prompt_field)
      fit = self._fits(len(ids), n)
      if max_tokens is None:
        limit = min(self.context - len(ids), fit)
        if limit < 1:
          raise APIError(f"{where}: {len(ids)} tokens leave no room for output in the "
                         "server's KV cache (see --num-pages)", prompt_field)
      else:
        limit = max_tokens
        if len(ids) + limit > self.context:
          raise APIError(f"{limit_field}: {limit} tokens after a prompt of {len(ids)} "
                         f"exceed the model's context of {self.context}", limit_field)
        if limit > fit:
          raise APIError(f"{limit_field}: {n} sample(s) of {limit} tokens after a prompt of "
                         f"{len(ids)} need more pages than the server's KV cache holds (at "
                         f"most {max(fit, 0)} tokens each; see --num-pages)", limit_field)
      jobs.append(Job(Request(list(ids), n=n, max_tokens=limit, temperature=temperature,
                              top_p=None if top_p == 1 else top_p, top_k=top_k, stop=stop,
                              seed=seed, ignore_eos=ignore_eos,
                              logprobs=top_logprobs is not None,
                              top_logprobs=top_logprobs or 0), prompt_field, limit_field))
    return jobs

  def _fits(self, prompt_len: int, n: int) -> int:
    """The most tokens per sample that ``n`` samples of a prompt may ever hold in the cache
    (the engine's own bound: the prompt's whole pages once, each sample's tail and output)."""
    c = self.engine.config
    full, tail = divmod(prompt_len - 1, c.page_size)
    per_sample = (c.num_pages - 1 - full) // n
    return per_sample * c.page_size - tail

  # -- running ----------------------------------------------------------------------------------

  def submit(self, jobs: Sequence[Job]) -> list:
    """Submits ``jobs`` to the engine (never waits for a tick): their handles."""
    handles = []
    try:
      for job in jobs:
        handles.append(self.engine.submit(job.request))
    except ValueError as e:  # a check the engine makes and prepare() does not
      for h in handles:
        self.engine.cancel(h)
      raise APIError(" ".join(str(e).split()), job.prompt_field) from None
    return handles

  async def updates(self, jobs: Sequence[Job], handles: Sequence, totals: Totals, *,
                    stream_text: bool = True) -> AsyncIterator[Update]:
    """The updates of the submitted ``jobs`` (choice ``j * n + i`` is sample ``i`` of prompt
    ``j``) as the engine produces them; ``totals`` is filled as prompts end. Leaving early
    cancels what still runs. ``stream_text=False``: only the final updates, each with the
    whole text and token ids of its choice."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    start = time.perf_counter()
    pumps = []  # each ends once the engine has ended its request
    try:
      pumps += [asyncio.ensure_future(self._pump(j, h, queue)) for j, h in enumerate(handles)]
      texts = [[IncrementalText(self.tokenizer, job.request.stop)
                for _ in range(job.request.n)] for job in jobs]
      first, pending = [None] * len(jobs), len(jobs)
      while pending:
        j, new = await queue.get()
        n = jobs[j].request.n
        if isinstance(new, BaseException):
          raise new
        if new is not None:
          if first[j] is None:
            first[j] = time.perf_counter()
          if stream_text:
            for i, (ids, logprobs) in enumerate(new):
              text = texts[j][i].add(ids)
              if text or ids:
                yield Update(j * n + i, text, tuple(ids), None, logprobs)
          continue
        pending -= 1
        output = handles[j].output
        totals.prompt_tokens += output.prompt_tokens
        totals.cached_tokens += output.cached_tokens
        for i, sample in enumerate(output.samples):
          totals.completion_tokens += len(sample.token_ids)
          reason = "abort" if sample.finish_reason == "cancelled" else sample.finish_reason
          if stream_text:
            yield Update(j * n + i, texts[j][i].finish(sample.text), (), reason,
                         () if sample.logprobs is not None else None)
          else:
            yield Update(j * n + i, sample.text or "", sample.token_ids, reason,
                         sample.logprobs)
        if self.metrics is not None:
          self.metrics.observe(start, first[j], time.perf_counter(), output)
    finally:
      for h in handles:
        if not h.done:
          loop.run_in_executor(None, self.engine.cancel, h)  # never blocks this loop

  async def _pump(self, j: int, handle, queue: asyncio.Queue) -> None:
    """Feeds ``queue`` with ``(j, new (token ids, log-probs) per sample)`` per tick, then
    ``(j, None)`` (or the error)."""
    try:
      async for new in self.engine.follow(handle, logprobs=True):
        queue.put_nowait((j, new))
      queue.put_nowait((j, None))
    except Exception as e:  # noqa: BLE001 -- an engine failure ends this request only
      queue.put_nowait((j, e))
