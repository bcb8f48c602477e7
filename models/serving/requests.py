"""The serving engine's values: its configuration, a request, a request's output, a handle.

    >>> config = EngineConfig(page_size=16, num_pages=2048, decode_steps=8)
    >>> request = Request(prompt=[1, 2, 3], n=4, max_tokens=32, temperature=0.7, seed=1)

Everything here is checked when it is made; errors name the field.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Optional, Sequence, Union

import numpy as np

from models.generation.sampling import SamplingParams
from models.serving.cascade import CascadeConfig

FINISH_REASONS = ("stop", "length", "cancelled")
MAX_TOP_LOGPROBS = 20  # the most top log-probs a request may ask for per token (OpenAI's limit)
_BUCKET_FIELDS = ("batch_buckets", "prefill_buckets", "prefill_row_buckets", "level_buckets",
                  "segment_buckets", "page_buckets", "own_page_buckets")


def _positive_int(owner: str, name: str, value, minimum: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{owner}: {name}={value!r} must be an int >= {minimum}")


def _buckets(owner: str, name: str, value) -> None:
  if value is None:
    return
  if (not isinstance(value, tuple) or not value or list(value) != sorted(value)
      or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in value)):
    raise ValueError(f"{owner}: {name}={value!r} must be None or an ascending tuple of ints >= 1")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How the engine stores K/V and schedules (a frozen value).

  Attributes:
    page_size: tokens per KV page.
    num_pages: pages in the pool (page 0 is the null page: ``num_pages - 1`` usable).
    max_running: sequences decoding at once (a request's ``n`` samples count ``n``).
    max_prefill_tokens: prompt tokens prefilled per tick, each chunk counted at its padded
      length (``prefill_bucket``): the rows a tick's calls compute.
    decode_steps: decode steps per device call (one cascade plan for all of them).
    prefill_ticks: while prompts are being prefilled, a decode call runs after at most this
      many ticks that prefilled. 1 (the default) decodes every tick: running sequences never
      wait on a prefill burst. Larger values fill the batch before decoding (what SGLang's
      and vLLM's default schedulers do when requests arrive together): fewer decode calls
      at larger batches, longer waits between a running sequence's tokens.
    min_shared_tokens: a segment shared by >= 2 running sequences is read once for all of
      them from this many tokens on.
    cascade: False: shared prompt pages are stored once but every sequence reads them as its
      own keys (the paged-attention baseline of vLLM and SGLang decode).
    prefix_caching: False: no radix tree; each request stores its own prompt (shared by its
      ``n`` samples only) and frees it when done.
    batch_buckets: padded batch sizes of the decode program (None: powers of two).
    prefill_buckets: padded prefill chunk lengths (None: powers of two up to
      ``max_prefill_tokens``).
    prefill_row_buckets: padded row counts of a prefill call (one row per request's chunk;
      None: powers of two up to ``max_running``), so that a lone long prompt is not padded
      to a decode batch of rows.
    level_buckets, segment_buckets, page_buckets, own_page_buckets: padded sizes of the
      cascade plan (:class:`models.serving.cascade.CascadeConfig`; None: powers of two);
      ``own_page_buckets`` also pads a prefill chunk's page table.
    scan_layers: run the decoder's layers as one ``lax.scan`` over stacked weights (a copy of
      the layers' weights) and one page pool of all layers: each device program holds one
      layer's code, so compiling does not grow with the layer count. None (the default): when
      the layers run the same code (one sliding window for all), except on a GPU, where XLA
      copies each layer's weights out of the stack at every step
      (:func:`models.serving.device.scan_by_default`); True: the scan, refusing layers that
      differ; False: the layers unrolled, a pool per layer.
    max_logprobs: the most top log-probs per token a request may ask for (0 to 20): a
      decode call in which a row asks for any returns this many for every row (a second
      program per decode shape; 0: none, and no second program).
    compile_threads: threads on which :meth:`Engine.warmup` compiles its programs side by
      side (None: the machine's cores, at most 8; 1: one after another).
  """

  page_size: int = 16
  num_pages: int = 1024
  max_running: int = 64
  max_prefill_tokens: int = 256
  decode_steps: int = 8
  prefill_ticks: int = 1
  min_shared_tokens: int = 16
  cascade: bool = True
  prefix_caching: bool = True
  batch_buckets: Optional[tuple[int, ...]] = None
  prefill_buckets: Optional[tuple[int, ...]] = None
  prefill_row_buckets: Optional[tuple[int, ...]] = None
  level_buckets: Optional[tuple[int, ...]] = None
  segment_buckets: Optional[tuple[int, ...]] = None
  page_buckets: Optional[tuple[int, ...]] = None
  own_page_buckets: Optional[tuple[int, ...]] = None
  scan_layers: Optional[bool] = None
  max_logprobs: int = MAX_TOP_LOGPROBS
  compile_threads: Optional[int] = None

  def __post_init__(self):
    for name in ("page_size", "max_running", "max_prefill_tokens", "decode_steps",
                 "prefill_ticks"):
      _positive_int("EngineConfig", name, getattr(self, name))
    _positive_int("EngineConfig", "max_logprobs", self.max_logprobs, 0)
    if self.max_logprobs > MAX_TOP_LOGPROBS:
      raise ValueError(f"EngineConfig: max_logprobs={self.max_logprobs} must be at most "
                       f"{MAX_TOP_LOGPROBS}")
    _positive_int("EngineConfig", "num_pages", self.num_pages, 2)
    _positive_int("EngineConfig", "min_shared_tokens", self.min_shared_tokens, 0)
    if self.compile_threads is not None:
      _positive_int("EngineConfig", "compile_threads", self.compile_threads)
    for name in ("cascade", "prefix_caching", "scan_layers"):
      if not isinstance(getattr(self, name), bool) and not (
          name == "scan_layers" and self.scan_layers is None):
        kinds = "None or a bool" if name == "scan_layers" else "a bool"
        raise ValueError(f"EngineConfig: {name}={getattr(self, name)!r} must be {kinds}")
    for name in _BUCKET_FIELDS:
      value = getattr(self, name)
      if isinstance(value, list):
        object.__setattr__(self, name, value := tuple(value))
      _buckets("EngineConfig", name, value)
    if self.batch_buckets is not None and self.batch_buckets[-1] < self.max_running:
      raise ValueError(f"EngineConfig: batch_buckets={self.batch_buckets} must reach "
                       f"max_running={self.max_running}")
    if self.prefill_row_buckets is not None and self.prefill_row_buckets[-1] < self.max_running:
      raise ValueError(f"EngineConfig: prefill_row_buckets={self.prefill_row_buckets} must "
                       f"reach max_running={self.max_running}")
    if self.prefill_buckets is not None and self.prefill_buckets[-1] < self.max_prefill_tokens:
      raise ValueError(f"EngineConfig: prefill_buckets={self.prefill_buckets} must reach "
                       f"max_prefill_tokens={self.max_prefill_tokens}")

  def cascade_config(self) -> CascadeConfig:
    """The planner's config: no shared level at all when ``cascade`` is False."""
    return CascadeConfig(min_shared_tokens=self.min_shared_tokens if self.cascade else 2**62,
                         batch=self.batch_buckets, levels=self.level_buckets,
                         segments=self.segment_buckets, pages=self.page_buckets,
                         own_pages=self.own_page_buckets)

  def prefill_rows(self, n: int) -> int:
    """The padded row count of a prefill call of ``n`` chunks."""
    if self.prefill_row_buckets is None:
      return 1 << max(n - 1, 0).bit_length()
    return next(s for s in self.prefill_row_buckets if s >= n)

  def prefill_bucket(self, n: int) -> int:
    """The padded length of a prefill chunk of ``n`` tokens."""
    if self.prefill_buckets is None:
      return min(1 << max(n - 1, 0).bit_length(), max(self.max_prefill_tokens, n))
    return next(s for s in self.prefill_buckets if s >= n)


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt and how to sample it.

  Attributes:
    prompt: token ids, or text (the engine needs a tokenizer).
    n: samples of the prompt (they share its pages and are admitted together).
    max_tokens: tokens to generate per sample.
    temperature, top_p, top_k: the sampling rule (temperature 0: greedy).
    stop: strings that end a sample once its text contains one (needs a tokenizer).
    stop_token_ids: tokens that end a sample (kept in its output).
    seed: the sample ``i`` token at step ``t`` depends only on (seed, i, t), as in
      :func:`models.generate`.
    ignore_eos: keep generating after the end-of-sequence token.
    sample_offset: sample ``i`` draws as sample ``sample_offset + i`` of the seed (so that
      requests can continue one numbering, as :func:`models.generate` numbers all the
      samples of its prompts: prompt j's first sample is the sum of the counts before it).
    logprobs: return each generated token's log-probability (:class:`TokenLogprobs`):
      ``log_softmax`` of the model's raw logits, before temperature, top-k and top-p.
    top_logprobs: with ``logprobs``, also this many most likely tokens per position
      (0 to 20, at most ``EngineConfig.max_logprobs``).
  """

  prompt: Union[str, Sequence[int]]
  n: int = 1
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: Optional[float] = None
  top_k: Optional[int] = None
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0
  ignore_eos: bool = False
  sample_offset: int = 0
  logprobs: bool = False
  top_logprobs: int = 0

  def __post_init__(self):
    if isinstance(self.prompt, str):
      if not self.prompt:
        raise ValueError("Request: prompt is empty")
    else:
      try:
        ids = tuple(int(t) for t in self.prompt)
      except (TypeError, ValueError):
        raise ValueError(f"Request: prompt must be text or a sequence of token ids; got "
                         f"{type(self.prompt).__name__}") from None
      if not ids:
        raise ValueError("Request: prompt is empty: give at least one token")
      if any(int(t) != t for t in self.prompt):
        raise ValueError("Request: prompt token ids must be ints")
      object.__setattr__(self, "prompt", ids)
    _positive_int("Request", "n", self.n)
    _positive_int("Request", "max_tokens", self.max_tokens)
    for name in ("temperature", "top_p"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not math.isfinite(value)):
        raise ValueError(f"Request: {name}={value!r} must be a finite number")
    if self.temperature < 0:
      raise ValueError(f"Request: temperature={self.temperature!r} must be >= 0")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ValueError(f"Request: top_p={self.top_p!r} must lie in (0, 1] or be None")
    if self.top_k is not None:
      _positive_int("Request", "top_k", self.top_k)
    stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
    if any(not isinstance(s, str) or not s for s in stop):
      raise ValueError(f"Request: stop={self.stop!r} must be non-empty strings")
    object.__setattr__(self, "stop", stop)
    ids = tuple(self.stop_token_ids)
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
      raise ValueError(f"Request: stop_token_ids={self.stop_token_ids!r} must be ints >= 0")
    object.__setattr__(self, "stop_token_ids", ids)
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"Request: seed={self.seed!r} must be an int")
    if not isinstance(self.ignore_eos, bool):
      raise ValueError(f"Request: ignore_eos={self.ignore_eos!r} must be a bool")
    _positive_int("Request", "sample_offset", self.sample_offset, 0)
    if self.sample_offset + self.n > 2**31:
      raise ValueError(f"Request: sample_offset={self.sample_offset} + n={self.n} must stay "
                       "below 2**31 (int32 sample ids)")
    if not isinstance(self.logprobs, bool):
      raise ValueError(f"Request: logprobs={self.logprobs!r} must be a bool")
    _positive_int("Request", "top_logprobs", self.top_logprobs, 0)
    if self.top_logprobs > MAX_TOP_LOGPROBS:
      raise ValueError(f"Request: top_logprobs={self.top_logprobs} must be at most "
                       f"{MAX_TOP_LOGPROBS}")
    if self.top_logprobs and not self.logprobs:
      raise ValueError(f"Request: top_logprobs={self.top_logprobs} needs logprobs=True")

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(float(self.temperature), self.top_k, self.top_p)


def prompt_ids(request: Request, model_config, config: EngineConfig, tokenizer=None) -> np.ndarray:
  """The request's prompt as int32 ids, after the checks that need the model and the engine:
  ids in the vocabulary, prompt + ``max_tokens`` within the model's context, ``n`` and
  ``max_tokens`` within what the cache can ever hold (a ValueError naming the field)."""
  c, mc = config, model_config
  if isinstance(request.prompt, str):
    if tokenizer is None:
      raise ValueError("Request: prompt is text; the engine needs a tokenizer (or give ids)")
    prompt = np.asarray(tokenizer.encode(request.prompt), np.int32)
    if prompt.size == 0:
      raise ValueError("Request: prompt encodes to no tokens")
  else:
    prompt = np.asarray(request.prompt, np.int64)
    if prompt.min() < 0 or prompt.max() >= mc.vocab_size:
      raise ValueError(f"Request: prompt token ids must lie in [0, {mc.vocab_size}) (the "
                       f"vocabulary); got values in [{prompt.min()}, {prompt.max()}]")
    prompt = prompt.astype(np.int32)
  if request.stop and tokenizer is None:
    raise ValueError("Request: stop strings need a tokenizer (or use stop_token_ids)")
  if prompt.size > mc.max_position_embeddings:
    raise ValueError(f"Request: prompt has {prompt.size} tokens; the model's context is "
                     f"{mc.max_position_embeddings} (config.max_position_embeddings)")
  if prompt.size + request.max_tokens > mc.max_position_embeddings:
    raise ValueError(f"Request: max_tokens={request.max_tokens} after a prompt of "
                     f"{prompt.size} tokens exceeds the model's context of "
                     f"{mc.max_position_embeddings} tokens")
  if request.top_logprobs > min(c.max_logprobs, mc.vocab_size):
    raise ValueError(f"Request: top_logprobs={request.top_logprobs} exceeds "
                     f"EngineConfig.max_logprobs={c.max_logprobs} (or the vocabulary of "
                     f"{mc.vocab_size})")
  if request.n > c.max_running:
    raise ValueError(f"Request: n={request.n} exceeds EngineConfig.max_running="
                     f"{c.max_running}")
  ps = c.page_size
  full, tail = divmod(prompt.size - 1, ps)
  worst = full + request.n * -(-(tail + request.max_tokens) // ps)
  if worst > c.num_pages - 1:
    raise ValueError(f"Request: n={request.n} samples of max_tokens={request.max_tokens} "
                     f"need up to {worst} pages; the cache holds {c.num_pages - 1} "
                     "(EngineConfig.num_pages)")
  if c.own_page_buckets is not None:
    # A row's own page table: the prompt pages in no shared level and its own tokens; a
    # prefill chunk's: the pages up to its padded end.
    context = prompt.size - 1
    chunk = c.prefill_bucket(min(context, c.max_prefill_tokens)) if context else 0
    need = max(full + -(-(tail + request.max_tokens) // ps), -(-(context + chunk - 1) // ps))
    if need > c.own_page_buckets[-1]:
      raise ValueError(f"Request: a prompt of {prompt.size} tokens with max_tokens="
                       f"{request.max_tokens} needs page tables of up to {need} pages; the "
                       f"largest of EngineConfig.own_page_buckets is {c.own_page_buckets[-1]}")
  return prompt


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """A generated token's log-probability and the most likely tokens at its position
  (``top``: ``(token id, log-prob)`` pairs, most likely first; empty without
  ``Request.top_logprobs``)."""
  logprob: float
  top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class SampleOutput:
  """One sample: its tokens (a stop token or EOS kept), text (with a tokenizer; cut before a
  stop string), why it ended (``"stop"``, ``"length"`` or ``"cancelled"``), and with
  ``Request.logprobs`` one :class:`TokenLogprobs` per token id (else None)."""
  token_ids: tuple[int, ...]
  text: Optional[str]
  finish_reason: str
  logprobs: Optional[tuple[TokenLogprobs, ...]] = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """A finished request: its samples, its prompt's length, and the prompt tokens whose K/V
  came from the prefix cache."""
  request_id: int
  samples: tuple[SampleOutput, ...]
  prompt_tokens: int
  cached_tokens: int


class Handle:
  """A submitted request: iterate it for new tokens, or read :attr:`output` when done.

  Iterating yields one tuple per tick that produced tokens: per sample, its new token ids.
  Without a running engine loop (:meth:`Engine.start`) iteration drives :meth:`Engine.step`.
  With ``Request.logprobs``, ``logprobs[i]`` holds sample i's :class:`TokenLogprobs`,
  aligned with ``tokens[i]`` (:meth:`take_logprobs` takes both at once).
  """

  def __init__(self, engine, request_id: int, request: Request):
    self.engine, self.request_id, self.request = engine, request_id, request
    self.tokens: list[list[int]] = [[] for _ in range(request.n)]
    self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(request.n)]
    self.output: Optional[RequestOutput] = None
    self.error: Optional[BaseException] = None
    self._sent = [0] * request.n
    self._changed = threading.Condition()
    self._listeners = []

  @property
  def done(self) -> bool:
    return self.output is not None or self.error is not None

  def _notify(self) -> None:
    with self._changed:
      self._changed.notify_all()
    for listener in list(self._listeners):
      listener()

  def take(self) -> Optional[tuple[tuple[int, ...], ...]]:
    """The tokens not yet taken, per sample (None if there are none)."""
    new = self.take_logprobs()
    return None if new is None else tuple(ids for ids, _ in new)

  def take_logprobs(self):
    """The tokens not yet taken, per sample ``(token ids, their TokenLogprobs)`` (the second
    None without ``Request.logprobs``), or None if there are none."""
    with self._changed:
      new = tuple((tuple(t[s:]), tuple(lp[s:]) if self.request.logprobs else None)
                  for t, lp, s in zip(self.tokens, self.logprobs, self._sent))
      self._sent = [len(t) for t in self.tokens]
    return new if any(ids for ids, _ in new) else None

  def __iter__(self):
    while True:
      new = self.take()
      if new is not None:
        yield new
        continue
      if self.error is not None:
        raise self.error
      if self.output is not None:
        return
      if self.engine.running_loop:
        with self._changed:
          self._changed.wait(timeout=0.1)
      else:
        self.engine.step()

  def result(self) -> RequestOutput:
    """The output, running the engine (or waiting for its loop) until the request is done."""
    for _ in self:
      pass
    return self.output
