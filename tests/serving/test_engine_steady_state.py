"""The serving engine in steady state: after :meth:`Engine.warmup`, 1,000 requests (random
prompts sharing system prompts and topics, n 1-2, mixed sampling rules, some asking for
log-probs and top log-probs, random arrivals) compile nothing, and a sample of them gets the
tokens of each request alone."""

import numpy as np
import pytest
from test_engine import MIXES, SETTINGS, assert_drained, count_compiles, expected, got, model  # noqa: F401

from models.bench.common import COMPILE
from models.serving import Engine, EngineConfig, Request

CONFIG = EngineConfig(page_size=4, num_pages=160, max_running=16, max_prefill_tokens=32,
                      decode_steps=4, min_shared_tokens=4, batch_buckets=(16,),
                      prefill_row_buckets=(16,),
                      prefill_buckets=(8, 32), level_buckets=(2,), segment_buckets=(8,),
                      page_buckets=(4,), own_page_buckets=(4, 16))


def requests(rng, num):
  systems = [rng.integers(0, 256, 8).tolist() for _ in range(3)]
  topics = [rng.integers(0, 256, 4).tolist() for _ in range(4)]
  out = []
  for _ in range(num):
    kind = int(rng.integers(0, 3))
    prompt = [] if kind == 2 else list(systems[int(rng.integers(0, 3))])
    if kind == 1:
      prompt += topics[int(rng.integers(0, 4))]
    prompt += rng.integers(0, 256, int(rng.integers(1, 5))).tolist()
    top = int(rng.choice([0, 0, 0, 0, 1, 5]))  # a few decode calls with top log-probs
    out.append(Request(prompt, n=int(rng.integers(1, 3)), max_tokens=int(rng.integers(1, 5)),
                       seed=int(rng.integers(0, 2**31)), ignore_eos=True,
                       logprobs=bool(top or rng.integers(0, 2)), top_logprobs=top,
                       **MIXES[int(rng.integers(0, len(MIXES)))]))
  return out


def run(engine, rng, reqs):
  """Submits the requests in random bursts of 0-12 per tick; runs until all are done."""
  handles, i = [], 0
  while i < len(reqs) or engine.has_work:
    burst = int(rng.integers(0, 13))
    handles += [engine.submit(r) for r in reqs[i:i + burst]]
    i += burst
    engine.step()
  return handles


def test_a_thousand_requests_compile_nothing_after_warm_up(model):
  rng = np.random.default_rng(0)
  engine = Engine(model, config=CONFIG, settings=SETTINGS)
  # prefill: 16 rows x chunks (8, 32) x widths (4, 16); decode: 16 rows x (no level, 2 x 8
  # x 4) x own pages (4, 16) x top log-probs (0, 20); the page copy.
  assert engine.warmup() == 4 + 4 * 2 + 1
  reqs = requests(rng, 1000)
  with count_compiles() as events:
    handles = run(engine, rng, reqs)
  assert events == []
  stats = engine.stats()
  assert 0 < stats["cascade_calls"] < stats["decode_calls"]
  assert stats["prefix_hit_rate"] > 0.3
  for j in rng.choice(len(reqs), 40, replace=False):
    assert got(handles[j].output) == expected(model, reqs[j]), j
  for h in handles:
    for s in h.output.samples:
      assert (s.logprobs is not None) == h.request.logprobs
      if s.logprobs is not None:
        assert len(s.logprobs) == len(s.token_ids)
        assert all(len(lp.top) == h.request.top_logprobs for lp in s.logprobs)
  assert_drained(engine)


def test_warmup_on_threads_compiles_each_program_once(model):
  """Compiled side by side (``compile_threads=2``), the warm-up's programs are the ones its runs
  then use: as many XLA compiles as one after another, and none when serving."""
  compiled = []
  # Other pool shapes: programs of their own. The first warm-up also compiles helpers of the
  # process's first engine; the two after it are compared.
  for threads, num_pages in ((1, 36), (1, 40), (2, 44)):
    config = EngineConfig(page_size=4, num_pages=num_pages, max_running=4, max_prefill_tokens=8,
                          decode_steps=2, min_shared_tokens=4, batch_buckets=(4,),
                          prefill_row_buckets=(4,), prefill_buckets=(8,), level_buckets=(1,),
                          segment_buckets=(2,), page_buckets=(2,), own_page_buckets=(4,),
                          max_logprobs=0, compile_threads=threads)
    engine = Engine(model, config=config, settings=SETTINGS)
    with count_compiles() as events:
      assert engine.warmup() == 1 + 2 + 1  # prefill; decode without and with a level; copy
    compiled.append(events.count(COMPILE))
    rng = np.random.default_rng(threads)
    reqs = [Request(rng.integers(0, 256, 9).tolist(), n=2, max_tokens=3, ignore_eos=True)
            for _ in range(3)]
    with count_compiles() as events:
      outs = engine.generate(reqs)
    assert events == [] and all(len(s.token_ids) == 3 for o in outs for s in o.samples)
  assert compiled[1] == compiled[2] == 4
  with pytest.raises(ValueError, match="compile_threads=0 must be an int >= 1"):
    EngineConfig(compile_threads=0)
  with pytest.raises(ValueError, match=r"warmup: EngineConfig\.segment_buckets, page_buckets "
                     "must be set"):
    Engine(model, config=EngineConfig(num_pages=8, level_buckets=(1,)),
           settings=SETTINGS).warmup()
