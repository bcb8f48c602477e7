"""The serving engine: requests in, tokens out, over a paged KV cache with a prefix tree.

    >>> engine = Engine(model, tokenizer, EngineConfig(page_size=16, num_pages=4096))
    >>> outputs = engine.generate([Request(system + q, n=4, max_tokens=64) for q in questions])
    >>> handle = engine.submit(Request(prompt, max_tokens=32))
    >>> for new_tokens in handle: ...                        # per tick, per sample
    >>> async for new_tokens in engine.stream(request): ...  # with engine.start()

One tick (:meth:`Engine.step`): admit waiting requests while pages allow (a reserve is kept
for the running ones); prefill chunks of prompt tokens (several requests' in one device
call, each attending its own cached pages) (a prompt's last token is fed by the first decode step, as in
:func:`models.generate`); decode ``decode_steps`` steps of every running sequence in one
device call under one cascade plan (:mod:`models.serving.cascade`); retire finished
sequences. A prompt's full pages join the radix tree once prefilled; its last partial page
is each sample's own first page (copied per sample). Out of pages: unlocked tree nodes are
evicted, then the most recently admitted request is preempted (its pages freed; it is
recomputed later and, its tokens depending only on the request, emits the same tokens).

The device programs are keyed by padded sizes only (:meth:`CascadePlan.plan_key`, the
prefill rows, chunk and page buckets, and the top-log-prob size: 0, or
``EngineConfig.max_logprobs`` in a call where a request asks for top log-probs); page ids,
lengths, tokens, seeds and each row's sampling rule are data. Every decode step returns each
sampled token's log-prob (``log_softmax`` of the raw logits); a request with ``logprobs``
gets them per token (:class:`TokenLogprobs`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import threading
import time
from typing import Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.generation.compile_cache import CompileCache
from models.generation.settings import GenerationSettings
from models.serving import device
from models.serving.cascade import plan_cascade
from models.serving.pages import NULL_PAGE, PagePool
from models.serving.paged_cache import empty_pools
from models.serving.radix import RadixTree
from models.serving.requests import (EngineConfig, Handle, Request, RequestOutput,
                                     SampleOutput, TokenLogprobs, prompt_ids)
from models.serving.sampling import RowRules
from models.serving.state import PrefillIndex, PromptPages, Req, Seq


class Engine:
  """Continuous batching over a paged, prefix-cached KV cache (see the module docstring).

  Args:
    model: a :class:`models.model.llama.Llama` (one device).
    tokenizer: a :class:`models.checkpoints.tokenizer.Tokenizer`, for text prompts, text
      outputs and stop strings; its ``eos_id`` (else ``config.eos_token_id``) ends a sample.
    config: an :class:`EngineConfig`.
    settings: the attention implementation and kernel config (``impl``, ``config``) and the
      sampler's search; the sampling rule comes from each request.
    compile_cache: a folder for the persistent compilation cache
      (:class:`models.generation.compile_cache.CompileCache`: every program stored), so that
      another process with the same model shapes, config and code loads the engine's programs
      instead of compiling them; its hits are in :meth:`stats`. None: JAX's own setting.
    mesh: tensor parallel over a device mesh (:func:`models.parallel.sharding.make_mesh`:
      ``(1, m)``, ``"auto"`` or a Mesh whose "data" axis is 1): weights by the rules of
      :mod:`models.parallel.sharding`, the page pools split by KV head over "model"
      (:class:`device.HeadShardedPagedKVCache`). None: one device.
  """

  def __init__(self, model, tokenizer=None, config: EngineConfig = EngineConfig(),
               settings: GenerationSettings = GenerationSettings(),
               compile_cache: Optional[str] = None, mesh=None):
    if not isinstance(config, EngineConfig):
      raise ValueError(f"config must be an EngineConfig; got {type(config).__name__}")
    if not isinstance(settings, GenerationSettings):
      raise ValueError(f"settings must be a GenerationSettings; got {type(settings).__name__}")
    self.config, self.tokenizer = config, tokenizer
    self.settings = GenerationSettings(impl=settings.impl, config=settings.config,
                                       sampler=settings.sampler)
    self.model_config = model.config
    self.compile_cache = None
    if compile_cache is not None:
      self.compile_cache = _use_compile_cache(compile_cache)
    self.mesh = None if mesh is None else _engine_mesh(mesh)
    platform = (jax.default_backend() if self.mesh is None
                else self.mesh.devices.flat[0].platform)
    self.scan_layers = (device.scan_by_default(model.config, platform)
                        if config.scan_layers is None else config.scan_layers)
    self._graphdef, self._params = self._place(model)
    eos = getattr(tokenizer, "eos_id", None)
    self.eos_id = model.config.eos_token_id if eos is None else eos
    self.pool = PagePool(config.num_pages, config.page_size)
    self.tree = RadixTree(self.pool) if config.prefix_caching else None
    self._k, self._v = empty_pools(self._placed_config, config.num_pages, config.page_size,
                                   one_pool=self.scan_layers)
    # Placed (committed) as every device call returns them, so that the first call's pools
    # have the shardings of the later ones' (the same program, compiled once).
    self._k, self._v = jax.device_put(
        (self._k, self._v),
        jax.devices()[0] if self.mesh is None else device.pool_sharding(self.mesh))
    self._lock = threading.RLock()
    self._wake = threading.Event()
    self._ids = itertools.count()
    self._prompt_ids = itertools.count(1)
    self._admissions = itertools.count()
    self._inbox: collections.deque[Req] = collections.deque()  # submitted, not yet drained
    self._waiting: collections.deque[Req] = collections.deque()
    self._active: list[Req] = []  # prefilling or running, in admission order
    self._by_handle: dict[int, Req] = {}
    self._thread: Optional[threading.Thread] = None
    self._stop = False
    self._generated = self._preemptions = 0
    self._decode_calls = self._cascade_calls = 0  # device calls; those with a shared level
    self._decode_row_steps = 0  # rows (padding included) times steps, over decode calls
    self._prefill_calls = self._prefill_streak = 0  # streak: ticks in a row that prefilled
    self._busy_s = 0.0
    self._prompt_total = self._prompt_cached = 0

  # -- submitting --------------------------------------------------------------------------------

  def submit(self, request: Request) -> Handle:
    """Queues ``request``; raises ValueError (naming the field) if it can never run."""
    if not isinstance(request, Request):
      raise ValueError(f"request must be a Request; got {type(request).__name__}")
    prompt = self._check(request)
    handle = Handle(self, next(self._ids), request)
    self._inbox.append(Req(handle, prompt))  # no lock: a tick in progress does not block it
    self._wake.set()
    return handle

  def _drain(self) -> None:
    """Moves submitted requests to the waiting queue (under the lock)."""
    while self._inbox:
      req = self._inbox.popleft()
      self._waiting.append(req)
      self._by_handle[req.handle.request_id] = req

  def _place(self, model):
    """``model``'s graph and weights, on the mesh's shards if there is one."""
    if self.mesh is not None:
      from models.parallel.sharding import shard_model
      model = shard_model(model, self.mesh)
    self._placed_config = model.config  # KV heads replicated where the model axis needs it
    try:
      return device.split_model(model, self.scan_layers)
    except ValueError as e:  # layers that cannot run under one scan
      raise ValueError(f"EngineConfig.scan_layers: {e}") from None

  def _check(self, request: Request) -> np.ndarray:
    return prompt_ids(request, self.model_config, self.config, self.tokenizer)

  def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
    """Runs ``requests`` to completion; outputs in their order (offline batch)."""
    requests = list(requests)
    for i, request in enumerate(requests):  # every request checked before any runs
      try:
        if not isinstance(request, Request):
          raise ValueError(f"must be a Request; got {type(request).__name__}")
        self._check(request)
      except ValueError as e:
        raise ValueError(f"requests[{i}]: {e}") from None
    handles = [self.submit(r) for r in requests]
    while not all(h.done for h in handles):
      self.step()
    for h in handles:
      if h.error is not None:
        raise h.error
    return [h.output for h in handles]

  def cancel(self, handle: Handle) -> None:
    """Ends ``handle``'s request now: its unfinished samples get ``"cancelled"``, its pages
    are freed."""
    with self._lock:
      self._drain()
      req = self._by_handle.get(handle.request_id)
      if req is None or handle.done:
        return
      if req.state == "waiting":
        self._waiting.remove(req)
      else:
        self._release(req)
      req.state = "done"
      for i in range(req.request.n):
        if i not in req.finished:
          req.finished[i] = SampleOutput(
              tuple(handle.tokens[i]), self._text(handle.tokens[i]), "cancelled",
              tuple(handle.logprobs[i]) if req.request.logprobs else None)
      self._finish(req)

  # -- one tick ---------------------------------------------------------------------------------

  @property
  def has_work(self) -> bool:
    return bool(self._inbox or self._waiting or self._active)

  def step(self) -> None:
    """One scheduler tick: admit, prefill one chunk budget, decode (unless the tick prefilled
    and fewer than ``EngineConfig.prefill_ticks`` ticks in a row have), retire."""
    with self._lock:
      start = time.perf_counter()
      self._drain()
      self._admit()
      calls = self._prefill_calls
      self._prefill()
      self._prefill_streak = self._prefill_streak + 1 if self._prefill_calls > calls else 0
      if self._prefill_streak == 0 or self._prefill_streak >= self.config.prefill_ticks:
        self._decode()
        self._prefill_streak = 0
      self._busy_s += time.perf_counter() - start

  def _running_seqs(self) -> list[Seq]:
    return [s for r in self._active if r.state == "running" for s in r.seqs
            if s.finish_reason is None]

  def _decode_need(self, seqs: Sequence[Seq]) -> int:
    """New own pages the next decode call of ``seqs`` needs."""
    ps, k = self.config.page_size, self.config.decode_steps
    need = 0
    for s in seqs:
      steps = min(k, s.req.request.max_tokens - len(s.generated))
      need += max(0, -(-(s.own_len + steps) // ps) - len(s.own_pages))
    return need

  def _free_pages(self, n: int) -> bool:
    """``n`` free pages, evicting unlocked tree nodes if needed."""
    if self.pool.num_free < n and self.tree is not None:
      self.tree.evict(n)
    return self.pool.num_free >= n

  def _admit(self) -> None:
    c, ps = self.config, self.config.page_size
    prefilling = PrefillIndex((r for r in self._active if r.state == "prefill"), ps)
    running = sum(r.request.n for r in self._active)
    reserve = self._decode_need(self._running_seqs())  # admitting changes no running sequence
    while self._waiting:
      req = self._waiting[0]
      n = req.request.n
      if running + n > c.max_running:
        return
      full, tail = divmod(req.context.size, ps)
      match_node, matched = None, np.zeros(0, np.int32)
      if self.tree is not None and full:
        m = self.tree.match(req.context[:full * ps])
        match_node, matched = m.node, m.pages
        self.tree.lock(match_node)
      if self.tree is not None and self._waits_for_a_prefill(req, matched.size, prefilling):
        self.tree.unlock(match_node)
        return
      need = full - matched.size + (n if tail else 0)
      if not self._free_pages(need + reserve):
        if match_node is not None:
          self.tree.unlock(match_node)
        if not self._active:  # cannot happen: submit checked the request fits alone
          raise RuntimeError(f"request {req.handle.request_id} does not fit an empty cache")
        return
      self._waiting.popleft()
      new = self.pool.alloc(need)
      own = new[:need - (n - 1 if tail else 0)]
      req.pages = np.concatenate([matched, own]).astype(np.int32)
      req.copies = new[own.size:]
      req.match_node = match_node
      req.prefilled = req.cached_tokens = matched.size * ps
      self._prompt_total += req.context.size
      self._prompt_cached += req.cached_tokens
      req.admitted = next(self._admissions)
      req.state = "prefill"
      self._active.append(req)
      prefilling.add(req)
      running += n

  def _waits_for_a_prefill(self, req: Req, matched_pages: int,
                           prefilling: PrefillIndex) -> bool:
    """Whether a request being prefilled (``prefilling``) shares more whole pages with
    ``req``'s prompt than the tree holds now (``matched_pages``): those pages join the tree
    when its prefill ends, so ``req`` is admitted after it and reuses them instead of
    computing them again (requests submitted together under one system prompt)."""
    ps, m = self.config.page_size, matched_pages
    keys = req.page_keys(ps)
    if len(keys) <= m:  # no whole page beyond the matched ones
      return False
    # Sharing the first m + 1 pages: the same key, then the tokens checked.
    return any(np.array_equal(other.context[:(m + 1) * ps], req.context[:(m + 1) * ps])
               for other in prefilling.sharing(m, keys[m]))

  def _prefill(self) -> None:
    """Up to ``max_prefill_tokens`` prompt tokens, each chunk counted at its padded length
    (the work its row does): one chunk per request in admission order (the next one only once
    the one before is done); chunks of one padded length run in one device call, a row each."""
    budget, chunks = self.config.max_prefill_tokens, []
    prefilling = [r for r in self._active if r.state == "prefill"]
    for req in prefilling:
      n = min(budget, req.context.size - req.prefilled)
      padded = self.config.prefill_bucket(n) if n > 0 else 0
      if chunks and padded > budget:  # the next tick's, whole rather than split
        break
      if n > 0:
        chunks.append((req, req.prefilled, n))
        budget -= padded
      if req.prefilled + n < req.context.size:
        break
    groups = collections.defaultdict(list)
    for chunk in chunks:
      groups[self.config.prefill_bucket(chunk[2])].append(chunk)
    for t, group in sorted(groups.items()):
      self._prefill_rows(group, t)
    for req, _, n in chunks:
      req.prefilled += n
    for req in prefilling:
      if req.prefilled < req.context.size:
        return
      self._start_running(req)

  def _prefill_rows(self, chunks: Sequence[tuple[Req, int, int]], t: int) -> None:
    """One device call: row r writes chunk (req, start, n) padded to ``t`` tokens."""
    ps, cascade = self.config.page_size, self.config.cascade_config()
    rows = self.config.prefill_rows(len(chunks))
    width = cascade.bucket("own_pages", max(-(-(start + t) // ps) for _, start, _ in chunks))
    tokens = np.zeros((rows, t), np.int32)
    table = np.full((rows, width), NULL_PAGE, np.int32)
    start, end = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for r, (req, s, n) in enumerate(chunks):
      tokens[r, :n] = req.context[s:s + n]
      table[r, :min(width, req.pages.size)] = req.pages[:width]  # the pages this chunk reaches
      start[r], end[r] = s, s + n
    self._prefill_calls += 1
    self._k, self._v = device.prefill(self._graphdef, self._params, self._k, self._v,
                                      jnp.asarray(tokens), table, start, end,
                                      settings=self.settings, mesh=self.mesh)

  def _start_running(self, req: Req) -> None:
    ps, n = self.config.page_size, req.request.n
    full, tail = divmod(req.context.size, ps)
    if self.tree is not None:
      node = self.tree.root
      if full:
        node = self.tree.insert(req.context[:full * ps], req.pages[:full]).node
        for _ in range(n):
          self.tree.lock(node)
        self.tree.unlock(req.match_node)
      req.node = node
    else:
      req.node = PromptPages(-next(self._prompt_ids), req.pages[:full])
      if full and n > 1:
        self.pool.incref(np.tile(req.pages[:full], n - 1))  # one reference per sample
    if tail:
      src = int(req.pages[full])
      for dst in req.copies:
        self._k, self._v = device.copy_page(
            self._k, self._v, np.int32(src), np.int32(dst),
            layer_pages=device.layer_pages(self._graphdef, self._k))
    firsts = [[int(req.pages[full])]] + [[int(p)] for p in req.copies] if tail else [[]] * n
    req.seqs = [Seq(req, i, list(firsts[i]), tail) for i in range(n)]
    req.match_node, req.state = None, "running"

  def _path(self, seq: Seq):
    if isinstance(seq.req.node, PromptPages):
      return (seq.req.node,) if seq.req.node.pages.size else ()
    return self.tree.path(seq.req.node)

  def _decode(self) -> None:
    c, ps, k = self.config, self.config.page_size, self.config.decode_steps
    seqs = self._running_seqs()
    while seqs:  # pages for every sequence's k steps: evict, then preempt the newest
      need = self._decode_need(seqs)
      if self._free_pages(need):
        break
      self._preempt(self._active[-1])
      seqs = self._running_seqs()
    if not seqs:
      return
    steps = [min(k, s.req.request.max_tokens - len(s.generated)) for s in seqs]
    for s, n in zip(seqs, steps):
      more = -(-(s.own_len + n) // ps) - len(s.own_pages)
      if more > 0:
        s.own_pages.extend(int(p) for p in self.pool.alloc(more))
    plan = plan_cascade([self._path(s) for s in seqs], [s.own_pages for s in seqs],
                        [s.own_len for s in seqs], ps, c.cascade_config())
    levels = plan.num_levels or 0
    page_table, seg_lengths, seg_of_seq = plan.page_table, plan.lengths, plan.segment_of_seq
    if levels == 0:  # no shared level: the program without hierarchical attention
      page_table, seg_lengths, seg_of_seq = device.no_levels(plan.order.size)
    self._decode_calls += 1
    self._cascade_calls += levels > 0
    b = plan.order.size
    self._decode_row_steps += b * k
    tokens = np.zeros((b, 1), np.int32)
    limit = np.zeros(b, np.int32)
    seeds = np.zeros(b, np.uint32)
    ids = np.zeros(b, np.int32)
    first_step = np.zeros(b, np.int32)
    rules = RowRules.of([seqs[i].req.request.sampling if i >= 0 else None for i in plan.order])
    # Top log-probs for every row of the call when one asks (one more program per shape).
    wants_top = any(s.req.request.top_logprobs for s in seqs)
    top = device.top_sizes(c, self.model_config.vocab_size)[-1] if wants_top else 0
    for r, i in enumerate(plan.order):
      if i < 0:
        continue
      s = seqs[i]
      tokens[r, 0] = s.next_token
      limit[r] = plan.own_lengths[r] + steps[i]
      seeds[r] = np.uint32(s.req.request.seed % 2**32)
      ids[r], first_step[r] = s.req.request.sample_offset + s.index, len(s.generated)
    self._k, self._v, out, logprobs, top_ids, top_values = device.decode(
        self._graphdef, self._params, self._k, self._v, jnp.asarray(tokens), page_table,
        seg_lengths, seg_of_seq, plan.own_page_table, plan.own_lengths, limit, rules,
        seeds, ids, first_step, num_steps=k, settings=self.settings, top_logprobs=top,
        mesh=self.mesh)
    out, logprobs = np.asarray(out), np.asarray(logprobs)
    top_ids, top_values = np.asarray(top_ids), np.asarray(top_values)
    for r, i in enumerate(plan.order):
      if i < 0:
        continue
      request, n = seqs[i].req.request, steps[i]
      lps = None
      if request.logprobs:
        m = request.top_logprobs
        lps = [TokenLogprobs(float(logprobs[r, j]),
                             tuple(zip(top_ids[r, j, :m].tolist(), top_values[r, j, :m].tolist())))
               for j in range(n)]
      self._accept(seqs[i], out[r, :n], lps)
    for req in [r for r in self._active if r.state == "running"]:
      if all(s.finish_reason is not None for s in req.seqs):
        self._release(req)
        req.state = "done"
        self._finish(req)

  def _accept(self, seq: Seq, tokens: np.ndarray,
              logprobs: Optional[Sequence[TokenLogprobs]] = None) -> None:
    """Takes a decode call's tokens (and their log-probs, if the request asks) for ``seq`` up
    to its first stop."""
    request, handle = seq.req.request, seq.req.handle
    toks = tokens.tolist()
    take, reason = len(toks), None
    for j, tok in enumerate(toks):
      if (not request.ignore_eos and tok == self.eos_id) or tok in request.stop_token_ids:
        reason = "stop"
      elif request.stop:
        text = self.tokenizer.decode(seq.generated + toks[:j + 1])
        cut = min((text.find(s) for s in request.stop if s in text), default=-1)
        if cut >= 0:
          reason, seq.text = "stop", text[:cut]
      if reason is None and len(seq.generated) + j + 1 >= request.max_tokens:
        reason = "length"
      if reason is not None:
        take = j + 1
        break
    start = len(seq.generated)
    seq.generated.extend(toks[:take])
    self._generated += take
    with handle._changed:  # tokens sent before a preemption are not sent again
      sent = max(len(handle.tokens[seq.index]) - start, 0)
      if sent < take:
        handle.tokens[seq.index].extend(toks[sent:take])
        if logprobs is not None:
          handle.logprobs[seq.index].extend(logprobs[sent:take])
    if reason is not None:
      seq.finish_reason = reason
      self._retire(seq)
    else:
      seq.own_len += tokens.size
      seq.next_token = int(tokens[-1])
    handle._notify()

  def _retire(self, seq: Seq) -> None:
    """Frees a finished sample's own pages and its hold on the prompt."""
    self.pool.decref(np.asarray(seq.own_pages, np.int32))
    seq.own_pages = []
    node = seq.req.node
    if isinstance(node, PromptPages):
      if node.pages.size:
        self.pool.decref(node.pages)
    elif node is not self.tree.root:
      self.tree.unlock(node)
    text = seq.text if seq.text is not None else self._text(seq.generated)
    handle, n = seq.req.handle, len(seq.generated)
    logprobs = tuple(handle.logprobs[seq.index][:n]) if seq.req.request.logprobs else None
    seq.req.finished[seq.index] = SampleOutput(tuple(seq.generated), text, seq.finish_reason,
                                               logprobs)

  def _release(self, req: Req) -> None:
    """Frees everything ``req`` holds (any state but waiting)."""
    if req.state == "prefill":
      self.pool.decref(np.concatenate([req.pages[req.cached_tokens // self.config.page_size:],
                                       req.copies]).astype(np.int32))
      if req.match_node is not None:
        self.tree.unlock(req.match_node)
    elif req.state == "running":
      for s in req.seqs:
        if s.finish_reason is None:
          s.finish_reason = "cancelled"
          self._retire(s)
    if req in self._active:
      self._active.remove(req)

  def _preempt(self, req: Req) -> None:
    """Frees ``req``'s pages and puts it back first in the queue (recomputed later)."""
    self._release(req)
    self._preemptions += 1
    self._prompt_total -= req.context.size
    self._prompt_cached -= req.cached_tokens
    req.reset()
    self._waiting.appendleft(req)

  def _finish(self, req: Req) -> None:
    handle = req.handle
    samples = tuple(req.finished[i] for i in range(req.request.n))
    handle.output = RequestOutput(handle.request_id, samples, int(req.prompt.size),
                                  int(req.cached_tokens))
    self._by_handle.pop(handle.request_id, None)
    handle._notify()

  def _text(self, tokens) -> Optional[str]:
    return None if self.tokenizer is None else self.tokenizer.decode(list(tokens))

  # -- the background loop and streaming ----------------------------------------------------------

  @property
  def running_loop(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def start(self) -> None:
    """Runs :meth:`step` in a background thread whenever there is work."""
    if self.running_loop:
      return
    self._stop = False
    self._thread = threading.Thread(target=self._loop, name="hydragen-engine", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    """Stops the background loop (requests in flight stay queued)."""
    self._stop = True
    self._wake.set()
    if self._thread is not None:
      self._thread.join()
    self._thread = None

  def _loop(self) -> None:
    while not self._stop:
      if not self.has_work:
        self._wake.wait(timeout=0.1)
        self._wake.clear()
        continue
      try:
        self.step()
      except Exception as e:  # a bug: every request in flight gets it, the loop goes on
        with self._lock:
          for req in list(self._active) + list(self._waiting):
            self._waiting.remove(req) if req in self._waiting else self._release(req)
            req.handle.error = e
            req.handle._notify()

  async def stream(self, request: Request):
    """Yields per sample the new token ids as they come (an async generator).

    Starts the background loop. A bad request raises its ValueError here; the engine keeps
    serving the others. Leaving the loop early cancels the request.
    """
    self.start()
    async for new in self.follow(self.submit(request)):
      yield new

  async def follow(self, handle: Handle, *, logprobs: bool = False):
    """Yields per sample the new token ids of a submitted ``handle`` as they come (an async
    generator, as :meth:`stream`); when it ends, ``handle.output`` holds the finish reasons,
    texts and cached tokens. ``logprobs=True``: per sample ``(token ids, their
    TokenLogprobs)`` instead (:meth:`Handle.take_logprobs`). Needs the background loop
    (:meth:`start`). Leaving it early cancels the request."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    handle._listeners.append(lambda: loop.call_soon_threadsafe(changed.set))
    try:
      while True:
        new = handle.take_logprobs() if logprobs else handle.take()
        if new is not None:
          yield new
          continue
        if handle.error is not None:
          raise handle.error
        if handle.output is not None:
          return
        await changed.wait()
        changed.clear()
    finally:
      if not handle.done:
        self.cancel(handle)

  def warmup(self) -> int:
    """Compiles every device program the buckets allow (:func:`device.program_shapes`; each
    decode shape with and without top log-probs, :func:`device.top_sizes`), each run once on
    the null page, so that serving compiles nothing; returns how many.

    Needs the level, segment and page buckets set (with ``cascade`` on); the count is the
    product of the buckets' sizes, so keep them few. The programs compile side by side on
    ``EngineConfig.compile_threads`` threads.
    """
    threads = self.config.compile_threads or min(8, os.cpu_count() or 1)
    with self._lock:
      self._k, self._v, programs = device.warm_up(
          self._graphdef, self._params, self._k, self._v, self.config,
          self.model_config.max_position_embeddings, self.model_config.vocab_size,
          self.settings, self.mesh, threads=threads)
    return programs

  # -- inspection and reset ---------------------------------------------------------------------

  def stats(self) -> dict:
    """Requests running and waiting, pages used/shared/free, prefix hit rate, tokens/s, and
    counters of the device calls (``decode_row_steps``: the decode calls' padded rows times
    their steps, against ``generated_tokens`` what the batch buckets cost)."""
    with self._lock:
      tree = self.tree.stats() if self.tree is not None else None
      return dict(
          running=len(self._active), waiting=len(self._waiting) + len(self._inbox),
          running_sequences=len(self._running_seqs()),
          pages_used=self.pool.num_used, pages_free=self.pool.num_free,
          pages_cached=tree.cached_pages if tree else 0,
          pages_shared=tree.shared_pages if tree else 0,
          prefix_hit_rate=(self._prompt_cached / self._prompt_total
                           if self._prompt_total else 0.0),
          generated_tokens=self._generated, preemptions=self._preemptions,
          decode_calls=self._decode_calls, cascade_calls=self._cascade_calls,
          decode_row_steps=self._decode_row_steps, prefill_calls=self._prefill_calls,
          compile_cache_hits=self.compile_cache.hits if self.compile_cache else 0,
          compile_cache_requests=self.compile_cache.requests if self.compile_cache else 0,
          tokens_per_s=self._generated / self._busy_s if self._busy_s else 0.0)

  def reset(self, model=None) -> None:
    """Empties the prefix cache (and takes ``model``'s weights, if given); no request may be
    in flight."""
    with self._lock:
      if self.has_work:
        raise ValueError(f"reset: {len(self._active) + len(self._waiting)} requests are in "
                         "flight (cancel them or let them finish)")
      if model is not None:
        if model.config not in (self.model_config, self._placed_config):
          raise ValueError("reset: model has another config than the engine's")
        self._graphdef, self._params = self._place(model)
      if self.tree is not None:
        self.tree.reset()
      self._prompt_total = self._prompt_cached = 0


def _use_compile_cache(path: str) -> CompileCache:
  """Points JAX's persistent compilation cache at ``path`` (counting its hits from now on)."""
  from jax.experimental.compilation_cache import compilation_cache

  if not isinstance(path, str) or not path:
    raise ValueError(f"compile_cache={path!r} must be a folder name (or None)")
  previous = jax.config.jax_compilation_cache_dir
  cache = CompileCache(os.path.expanduser(path))
  if cache.path is not None and cache.path != previous:
    compilation_cache.reset_cache()  # a cache opened on another folder would stay in use
  return cache.__enter__()


def _engine_mesh(mesh):
  """The engine's mesh: any spec :func:`make_mesh` takes, with a "data" axis of 1 (the rows of
  a step share the page pools, so they are not split)."""
  from models.parallel.mesh import DATA, make_mesh

  mesh = make_mesh((1, jax.device_count()) if mesh == "auto" else mesh)
  if mesh.shape[DATA] != 1:
    raise ValueError(f"mesh: the engine runs tensor parallel only; its data axis must be 1, "
                     f"got {dict(mesh.shape)}")
  return mesh
