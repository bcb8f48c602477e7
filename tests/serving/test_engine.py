"""The serving engine on the tiny model (float32, CPU): tokens equal generating each request
alone, whatever the arrivals, sharing, cascade, prefix caching, preemption and cancellations;
page accounting; no compiles in steady state; errors name the field."""

import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from models.bench.common import COMPILE, TRACE, counting_compiles
from models.generation.loop import generate
from models.generation.sampling import sample
from models.generation.settings import GenerationSettings
from models.model.config import preset
from models.model.llama import random_init
from models.serving import Engine, EngineConfig, Request, RowRules, device

SETTINGS = GenerationSettings(impl="xla")
PAD = 64  # the oracle's padded length: prompt + max_tokens stays below it
# Few buckets: every test reuses the same handful of device programs.
BUCKETS = dict(batch_buckets=(8,),
               prefill_row_buckets=(8,), prefill_buckets=(8,), level_buckets=(2,),
               segment_buckets=(2,), page_buckets=(8,), own_page_buckets=(8, 16))


def config(**changes) -> EngineConfig:
  base = dict(page_size=4, num_pages=64, max_running=8, max_prefill_tokens=8, decode_steps=3,
              min_shared_tokens=4, **BUCKETS)
  return EngineConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def model():
  return random_init(preset("tiny"), seed=0)


@functools.lru_cache(maxsize=None)
def _forward_fn(model):
  graphdef, params = nnx.split(model)

  @jax.jit
  def last_logits(params, tokens, pos):  # full causal forward, no cache: [V] at ``pos``
    return nnx.merge(graphdef, params)(tokens, settings=SETTINGS)[0, pos]

  return lambda tokens, pos: last_logits(params, tokens, pos)


_sample = jax.jit(sample, static_argnums=(2, 3))
_ORACLE = {}


def oracle(model, request: Request) -> list[list[int]]:
  """Each sample's first ``max_tokens`` tokens with no stop: the request alone, recomputed
  from scratch at every step (right padding cannot change a causal prefix)."""
  key = (id(model), request.prompt, request.n, request.max_tokens, request.sampling,
         request.seed)
  if key not in _ORACLE:
    forward, samples = _forward_fn(model), []
    for i in range(request.n):
      tokens = list(request.prompt)
      for t in range(request.max_tokens):
        padded = np.zeros((1, PAD), np.int32)
        padded[0, :len(tokens)] = tokens
        logits = forward(padded, len(tokens) - 1)
        k = jax.random.fold_in(jax.random.fold_in(
            jax.random.key(np.uint32(request.seed % 2**32)), i), t)
        tokens.append(int(_sample(logits[None], k[None], request.sampling, None)[0]))
      samples.append(tokens[len(request.prompt):])
    _ORACLE[key] = samples
  return _ORACLE[key]


def expected(model, request: Request, eos=None):
  """Per sample (tokens, finish_reason) after the stops."""
  out = []
  for tokens in oracle(model, request):
    for j, tok in enumerate(tokens):
      if tok in request.stop_token_ids or (tok == eos and not request.ignore_eos):
        out.append((tuple(tokens[:j + 1]), "stop"))
        break
    else:
      out.append((tuple(tokens), "length"))
  return out


def got(output):
  return [(s.token_ids, s.finish_reason) for s in output.samples]


def assert_drained(engine):
  """Nothing in flight holds a page; clearing the tree frees every page."""
  stats = engine.stats()
  assert stats["running"] == stats["waiting"] == 0
  assert engine.tree is None or stats["pages_used"] == stats["pages_cached"]
  if engine.tree is not None:
    engine.tree.clear()
  assert engine.pool.num_used == 0


def workload(rng, num=6):
  """Requests with a system prompt, one prompt sampled n times, and a two-level tree."""
  system = rng.integers(0, 256, 9).tolist()
  topic = rng.integers(0, 256, 6).tolist()
  reqs = []
  for j in range(num):
    kind = j % 3
    if kind == 0:
      prompt = system + rng.integers(0, 256, int(rng.integers(1, 6))).tolist()
    elif kind == 1:
      prompt = system + topic + rng.integers(0, 256, int(rng.integers(1, 4))).tolist()
    else:
      prompt = rng.integers(0, 256, int(rng.integers(1, 12))).tolist()
    sampled = j % 2 == 1
    reqs.append(Request(prompt, n=int(rng.integers(1, 4)), max_tokens=int(rng.integers(1, 8)),
                        temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else None,
                        seed=int(rng.integers(0, 100)), ignore_eos=True))
  return reqs


def run_schedule(engine, requests, arrivals, cancel_at=()):
  """Submits request i at tick ``arrivals[i]``; cancels (i, tick) pairs; runs to the end."""
  handles, tick = {}, 0
  while len(handles) < len(requests) or engine.has_work:
    for i, at in enumerate(arrivals):
      if at == tick:
        handles[i] = engine.submit(requests[i])
    for i, at in cancel_at:
      if at == tick and i in handles:
        engine.cancel(handles[i])
    engine.step()
    tick += 1
    assert tick < 500, "the engine does not finish"
  return [handles[i] for i in range(len(requests))]


# -- exactness -------------------------------------------------------------------------------------

def test_oracle_and_engine_equal_generate(model):
  greedy = Request(list(range(3, 14)), n=2, max_tokens=5, ignore_eos=True)
  sampled = Request(list(range(7, 13)), n=3, max_tokens=5, temperature=0.9, top_p=0.8, seed=7)
  engine = Engine(model, config=config(), settings=SETTINGS)
  outs = engine.generate([greedy, sampled])
  for request, out in zip((greedy, sampled), outs):
    want = np.asarray(generate(model, list(request.prompt), num_samples=request.n,
                               max_new_tokens=request.max_tokens, seed=request.seed,
                               temperature=request.temperature, top_p=request.top_p,
                               impl="xla")).tolist()
    assert oracle(model, request) == want
    assert [list(s.token_ids) for s in out.samples] == want
    assert all(s.finish_reason == "length" for s in out.samples)
  assert_drained(engine)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_and_sharing_give_each_request_its_tokens(model, seed):
  rng = np.random.default_rng(seed)
  requests = workload(rng)
  engine = Engine(model, config=config(), settings=SETTINGS)
  # The first (a system prompt's) is cached by tick 2; the others come at random ticks.
  arrivals = [0] + rng.integers(2, 8, len(requests) - 1).tolist()
  handles = run_schedule(engine, requests, arrivals)
  for request, handle in zip(requests, handles):
    assert got(handle.output) == expected(model, request)
    assert handle.output.prompt_tokens == len(request.prompt)
  stats = engine.stats()
  assert stats["prefix_hit_rate"] > 0  # the system prompt was reused
  assert 0 < stats["cascade_calls"] < stats["decode_calls"]  # with and without shared levels
  # Each call ran its padded batch (the one bucket, 8) for decode_steps steps.
  assert stats["decode_row_steps"] == stats["decode_calls"] * 8 * config().decode_steps
  assert stats["decode_row_steps"] >= stats["generated_tokens"]
  assert_drained(engine)


@pytest.mark.parametrize("changes", [dict(cascade=False), dict(prefix_caching=False),
                                     dict(decode_steps=1, min_shared_tokens=0),
                                     dict(scan_layers=False)])
def test_cascade_off_and_prefix_caching_off_give_the_same_tokens(model, changes):
  rng = np.random.default_rng(2)
  requests = workload(rng)
  engine = Engine(model, config=config(**changes), settings=SETTINGS)
  for request, out in zip(requests, engine.generate(requests)):
    assert got(out) == expected(model, request)
  assert (engine.stats()["cascade_calls"] > 0) == changes.get("cascade", True)
  assert_drained(engine)


SYSTEM = list(range(100, 109))


@st.composite
def schedules(draw):
  """Requests over a shared system prompt or alone, random ticks, some cancelled."""
  requests, arrivals, cancels = [], [], []
  for i in range(draw(st.integers(2, 5))):
    own = draw(st.lists(st.integers(0, 255), min_size=1, max_size=6))
    prompt = SYSTEM + own if draw(st.booleans()) else own
    sampled = draw(st.booleans())
    requests.append(Request(prompt, n=draw(st.integers(1, 3)),
                            max_tokens=draw(st.integers(1, 6)),
                            temperature=0.8 if sampled else 0.0, seed=draw(st.integers(0, 9)),
                            ignore_eos=True))
    arrivals.append(draw(st.integers(0, 5)))
    if draw(st.integers(0, 4)) == 0:
      cancels.append((i, arrivals[-1] + draw(st.integers(0, 2))))
  return requests, arrivals, cancels


@settings(max_examples=4, deadline=None)
@given(schedules())
def test_random_schedules_with_cancellations(model, schedule):
  requests, arrivals, cancels = schedule
  engine = Engine(model, config=config(num_pages=24), settings=SETTINGS)
  handles = run_schedule(engine, requests, arrivals, cancel_at=cancels)
  for request, handle in zip(requests, handles):
    samples = handle.output.samples
    if any(s.finish_reason == "cancelled" for s in samples):
      for sample, want in zip(samples, oracle(model, request)):
        assert list(sample.token_ids) == want[:len(sample.token_ids)]
    else:
      assert got(handle.output) == expected(model, request)
  assert_drained(engine)


def test_preemption_under_a_tiny_page_budget_finishes_every_request(model):
  rng = np.random.default_rng(3)
  requests = [Request(r.prompt, n=r.n, max_tokens=7, temperature=r.temperature,
                      top_p=r.top_p, seed=r.seed, ignore_eos=True) for r in workload(rng)]
  engine = Engine(model, config=config(num_pages=14), settings=SETTINGS)
  handles = run_schedule(engine, requests, [0] * len(requests))
  assert engine.stats()["preemptions"] > 0
  for request, handle in zip(requests, handles):
    assert got(handle.output) == expected(model, request)
  assert_drained(engine)


def test_stops_eos_and_cancellation(model):
  base = Request(list(range(20, 31)), n=2, max_tokens=6, temperature=1.0, seed=3)
  tokens = oracle(model, base)
  stop_id = tokens[0][2]
  eos_model = random_init(preset("tiny").replace(eos_token_id=tokens[1][1]), seed=0)
  engine = Engine(eos_model, config=config(), settings=SETTINGS)
  with_stop = Request(base.prompt, n=2, max_tokens=6, temperature=1.0, seed=3,
                      stop_token_ids=(stop_id,))
  ignore = Request(base.prompt, n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
  cancelled = Request(list(range(40, 50)), n=2, max_tokens=7)
  handles = run_schedule(engine, [base, with_stop, ignore, cancelled], [0, 0, 1, 0],
                         cancel_at=[(3, 2)])
  eos = eos_model.config.eos_token_id
  assert got(handles[0].output) == expected(model, base, eos)
  assert got(handles[1].output) == expected(model, with_stop, eos)
  assert got(handles[2].output) == expected(model, ignore, eos)
  assert handles[0].output.samples[1].finish_reason == "stop"
  out = handles[3].output
  assert [s.finish_reason for s in out.samples] == ["cancelled"] * 2
  for sample, want in zip(out.samples, oracle(model, cancelled)):
    assert list(sample.token_ids) == want[:len(sample.token_ids)]
  assert_drained(engine)


class CharTokenizer:
  """Token t <-> the letter ``chr(97 + t % 26)`` (for stop strings)."""
  eos_id = None

  def encode(self, text):
    return [ord(c) - 97 for c in text]

  def decode(self, ids):
    return "".join(chr(97 + t % 26) for t in ids)


def test_text_prompts_and_stop_strings(model):
  tok = CharTokenizer()
  plain = Request("hello world"[:5] + "abcdef", max_tokens=6, ignore_eos=True)
  text = tok.decode(oracle(model, Request(tuple(tok.encode(plain.prompt)), max_tokens=6))[0])
  stop = text[2:4]
  engine = Engine(model, tok, config=config(), settings=SETTINGS)
  one_token = Request([7], n=2, max_tokens=4, temperature=1.0, seed=1)  # nothing to prefill
  out_plain, out_stop, out_one = engine.generate(
      [plain, Request(plain.prompt, max_tokens=6, stop=(stop,), ignore_eos=True), one_token])
  assert got(out_one) == expected(model, one_token)
  assert out_plain.samples[0].text == text
  cut = text.find(stop)
  assert out_stop.samples[0].text == text[:cut]
  assert out_stop.samples[0].finish_reason == "stop"
  assert len(out_stop.samples[0].token_ids) == cut + len(stop)
  assert_drained(engine)


# -- pages ------------------------------------------------------------------------------------------

def test_a_shared_prompt_is_stored_once_and_cancel_frees_at_once(model):
  engine = Engine(model, config=config(), settings=SETTINGS)
  prompt = list(range(50, 63))  # 12 tokens prefilled: 3 full pages, no tail
  first = engine.submit(Request(prompt, n=3, max_tokens=9, ignore_eos=True))
  engine.step()  # 8 of 12 prompt tokens prefilled
  engine.step()  # the rest: the prompt's pages join the tree; decoding starts
  second = engine.submit(Request(prompt, n=2, max_tokens=6, ignore_eos=True))
  engine.step()
  stats = engine.stats()
  assert stats["pages_cached"] == 3 and stats["pages_shared"] == 3
  used = stats["pages_used"]
  assert used == 3 + sum(len(s.own_pages) for r in engine._active for s in r.seqs)
  with pytest.raises(ValueError, match="in flight"):
    engine.reset()
  engine.cancel(first)
  assert engine.stats()["pages_used"] < used
  assert [s.finish_reason for s in first.output.samples] == ["cancelled"] * 3
  assert second.result().cached_tokens == 12
  assert_drained(engine)


def test_requests_submitted_together_reuse_the_pages_of_the_first_prefill(model):
  """A system prompt shared by requests that arrive at once is prefilled once: the others are
  admitted when its pages are in the tree (not prefilled beside it in the same call)."""
  engine = Engine(model, config=config(), settings=SETTINGS)
  system = list(range(50, 66))  # 4 whole pages
  requests = [Request(system + [70 + i], max_tokens=3, ignore_eos=True) for i in range(4)]
  outputs = engine.generate(requests)
  assert [o.cached_tokens for o in outputs] == [0, 16, 16, 16]
  # Sharing 2 of its 4 pages, or none: the tree's pages where there are any.
  more = [Request(system[:8] + [99] * 8 + [1], max_tokens=2, ignore_eos=True),
          Request([98] * 17, max_tokens=2, ignore_eos=True)]
  engine.reset()
  assert [o.cached_tokens for o in engine.generate(more + requests[:1] + more)] == [
      0, 0, 8, 16, 16]  # the third waits for the first's 2 pages; the last pair hits its own
  alone = [Engine(model, config=config(), settings=SETTINGS).generate([r])[0] for r in requests]
  assert ([o.samples[0].token_ids for o in outputs]
          == [o.samples[0].token_ids for o in alone])
  assert_drained(engine)


# -- compiles ---------------------------------------------------------------------------------------

def test_a_second_workload_of_the_same_shapes_compiles_nothing(model):
  engine = Engine(model, config=config(), settings=SETTINGS)

  def run(seed):
    rng = np.random.default_rng(seed)
    requests = [Request(rng.integers(0, 256, len(r.prompt)).tolist() if i % 3 == 2 else r.prompt,
                        n=r.n, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                        seed=int(rng.integers(0, 100)), ignore_eos=True)
               for i, r in enumerate(workload(np.random.default_rng(5)))]
    run_schedule(engine, requests, [0, 0, 1, 2, 2, 3])
    engine.reset()

  run(0)
  before = engine.stats()["generated_tokens"]
  with count_compiles() as events:
    run(1)
  assert events == []
  assert engine.stats()["generated_tokens"] == 2 * before > 0


def count_compiles():
  """A context manager collecting the compile events (tracing, XLA compiles) inside it."""
  return counting_compiles((COMPILE, TRACE))


MIXES = [dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=3),
         dict(temperature=1.2, top_p=0.8), dict(temperature=0.9, top_k=20, top_p=0.6),
         dict(temperature=0.5, top_k=1)]


def test_new_sampling_mixes_compile_nothing_and_draw_each_requests_tokens(model):
  """Warmed up on greedy requests only, the engine runs any mix of temperature, top-k and
  top-p with the programs it has (each row's rule is data), and every request gets the
  tokens of its rule alone."""
  def requests(seed, mixes):
    rng = np.random.default_rng(seed)
    return [Request(r.prompt, n=r.n, max_tokens=r.max_tokens, seed=int(rng.integers(0, 100)),
                    ignore_eos=True, **mixes[int(rng.integers(0, len(mixes)))])
            for r in workload(np.random.default_rng(5))]

  engine = Engine(model, config=config(), settings=SETTINGS)
  run_schedule(engine, requests(0, MIXES[:1]), [0, 0, 1, 2, 2, 3])
  engine.reset()
  mixed = requests(1, MIXES[1:])
  assert len({r.sampling for r in mixed}) >= 3
  with count_compiles() as events:
    handles = run_schedule(engine, mixed, [0, 0, 1, 2, 2, 3])
  assert events == []
  for request, handle in zip(mixed, handles):
    assert got(handle.output) == expected(model, request)
  assert_drained(engine)


def test_prefill_chunks_of_several_requests_share_a_device_call(model):
  rng = np.random.default_rng(4)
  requests = [Request(rng.integers(0, 256, int(rng.integers(2, 9))).tolist(), max_tokens=3,
                      ignore_eos=True, **MIXES[i % len(MIXES)]) for i in range(6)]
  engine = Engine(model, config=config(max_prefill_tokens=32, prefill_buckets=(4, 8, 32)),
                  settings=SETTINGS)
  outs = engine.generate(requests)
  for request, out in zip(requests, outs):
    assert got(out) == expected(model, request)
  # 6 prompts of 1..7 context tokens, at most 32 padded tokens per tick: fewer calls than chunks.
  assert engine.stats()["prefill_calls"] < len(requests)
  assert_drained(engine)


def test_the_prefill_budget_counts_padded_chunks(model, monkeypatch):
  """``max_prefill_tokens`` bounds the padded work of a tick: 5-token chunks padded to 8 fill a
  16-token budget two at a time (three would be 15 real tokens but 24 computed)."""
  shapes = []
  prefill = device.prefill
  monkeypatch.setattr(device, "prefill", lambda graph, params, k, v, tokens, *a, **kw: (
      shapes.append(tokens.shape), prefill(graph, params, k, v, tokens, *a, **kw))[1])
  rng = np.random.default_rng(9)
  requests = [Request(rng.integers(0, 256, 6).tolist(), max_tokens=2, ignore_eos=True)
              for _ in range(6)]
  engine = Engine(model, config=config(max_prefill_tokens=16, prefill_buckets=(8, 16)),
                  settings=SETTINGS)
  for request, out in zip(requests, engine.generate(requests)):
    assert got(out) == expected(model, request)
  assert [t for _, t in shapes] == [8, 8, 8]  # two chunks a call (rows padded to a bucket)
  assert_drained(engine)


def test_scan_layers_runs_one_layers_code_and_needs_uniform_layers():
  """Under ``scan_layers`` a decode program's trace is the same size whatever the layer count
  (one layer's code in a scan); layers with different windows are refused, naming the field."""
  def decode_eqns(layers):
    engine = Engine(random_init(preset("tiny", num_layers=layers), seed=0),
                    config=config(scan_layers=True), settings=SETTINGS)
    assert len(engine._k) == 1 and engine._k[0].shape[0] == layers * engine.config.num_pages
    b, z = 8, lambda *shape: np.zeros(shape, np.int32)
    traced = device.decode.trace(
        engine._graphdef, engine._params, engine._k, engine._v, jnp.asarray(z(b, 1)),
        *device.no_levels(b), z(b, 8), z(b), z(b), RowRules.of([None] * b),
        np.zeros(b, np.uint32), z(b), z(b), num_steps=2, settings=SETTINGS)
    return str(traced.jaxpr).count(" = ")

  assert decode_eqns(2) == decode_eqns(5)
  gemma_like = preset("tiny", sliding_window=4, layer_types=("sliding_attention",
                                                             "full_attention"))
  with pytest.raises(ValueError, match="EngineConfig.scan_layers"):
    Engine(random_init(gemma_like, seed=0), config=config(scan_layers=True), settings=SETTINGS)
  # The default: the scan where the layers allow it, else the layers unrolled.
  assert Engine(random_init(gemma_like, seed=0), config=config(),
                settings=SETTINGS).scan_layers is False
  assert Engine(random_init(preset("tiny"), seed=0), config=config(),
                settings=SETTINGS).scan_layers is True
  with pytest.raises(ValueError, match="scan_layers=1 must be None or a bool"):
    config(scan_layers=1)
  # On a GPU the default unrolls (XLA would copy each layer's weight slices every step).
  assert [device.scan_by_default(preset("tiny"), p) for p in ("cpu", "tpu", "gpu")] == [
      True, True, False]
  assert device.scan_by_default(gemma_like, "cpu") is False


@pytest.mark.parametrize("ticks", [1, 3])
def test_prefill_ticks_bounds_the_prefill_burst_and_keeps_the_tokens(model, ticks):
  """``prefill_ticks``: a decode call after at most that many ticks that prefilled (while
  sequences run); more prefill ticks per decode call give fewer, fuller decode calls and the
  same tokens."""
  rng = np.random.default_rng(5)
  requests = [Request(rng.integers(0, 256, int(rng.integers(6, 13))).tolist(), max_tokens=4,
                      ignore_eos=True) for _ in range(8)]
  engine = Engine(model, config=config(prefill_ticks=ticks), settings=SETTINGS)
  ticks_seen = []  # per tick: [prefilled, decoded]
  prefill, decode = engine._prefill, engine._decode

  def logged_prefill():
    calls = engine._prefill_calls
    prefill()
    ticks_seen.append([engine._prefill_calls > calls, False])

  def logged_decode():
    ticks_seen[-1][1] = True
    decode()

  engine._prefill, engine._decode = logged_prefill, logged_decode
  for request, out in zip(requests, engine.generate(requests)):
    assert got(out) == expected(model, request)
  burst = 0
  for prefilled, decoded in ticks_seen:
    burst = burst + 1 if prefilled else 0
    assert decoded == (not prefilled or burst % ticks == 0), ticks_seen
  calls = engine.stats()["decode_calls"]
  if ticks == 1:
    assert all(decoded for _, decoded in ticks_seen)
  else:  # 8 prompts of 6-12 tokens, 8 per tick: a decode call every third prefilling tick
    assert sum(d for _, d in ticks_seen) == calls < len(ticks_seen)
  assert_drained(engine)


@pytest.mark.slow
def test_tensor_parallel_engine_in_a_subprocess():
  """tests/serving/test_engine_mesh.py on 4 CPU devices (the flag must precede JAX's start)."""
  import os
  import re
  import subprocess
  import sys
  from pathlib import Path

  from strategies import DEVICE_FLAGS
  root = Path(__file__).resolve().parents[2]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + DEVICE_FLAGS).strip())
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
       "tests/serving/test_engine_mesh.py"],
      cwd=root, env=env, capture_output=True, text=True, timeout=900)
  report = proc.stdout[-6000:] + proc.stderr[-2000:]
  assert proc.returncode == 0, report
  summary = proc.stdout.strip().splitlines()[-1]
  assert re.search(r"\b4 passed", summary) and "skipped" not in summary, report


# -- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=[]), "prompt"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(stop=("",)), "stop"),
    (dict(seed=1.5), "seed"), (dict(stop_token_ids=(-1,)), "stop_token_ids")])
def test_bad_requests_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    Request(**{"prompt": [1, 2], **kwargs})


@pytest.mark.parametrize("kwargs, field", [
    (dict(page_size=0), "page_size"), (dict(num_pages=1), "num_pages"),
    (dict(cascade=1), "cascade"), (dict(batch_buckets=(4,)), "batch_buckets"),
    (dict(prefill_row_buckets=(4,)), "prefill_row_buckets"),
    (dict(prefill_row_buckets=(4, 2, 8)), "prefill_row_buckets"),
    (dict(decode_steps=-1), "decode_steps"), (dict(prefill_ticks=0), "prefill_ticks")])
def test_bad_engine_configs_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    config(**kwargs)


def test_prefill_rows_are_padded_to_their_own_buckets():
  """A lone prompt's chunk runs as one row, not as a decode batch of rows."""
  default = EngineConfig(max_running=64, batch_buckets=(64,))
  assert [default.prefill_rows(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
  pinned = config()
  assert [pinned.prefill_rows(n) for n in (1, 8)] == [8, 8]


def test_requests_the_engine_cannot_serve_fail_alone(model):
  engine = Engine(model, config=config(), settings=SETTINGS)
  good = Request(list(range(1, 9)), max_tokens=4, ignore_eos=True)
  bad = [(Request([1] * 1025), "prompt"), (Request([1] * 1000, max_tokens=100), "max_tokens"),
         (Request([1, 256]), "prompt"), (Request([1, 2], n=9), "n"),
         (Request([1, 2], n=4, max_tokens=60), "max_tokens"), (Request("text"), "tokenizer"),
         (Request([1] * 40, max_tokens=30), "own_page_buckets"),
         (Request([1, 2], stop=("x",)), "stop")]
  handle = engine.submit(good)
  for request, field in bad:
    with pytest.raises(ValueError, match=field):
      engine.submit(request)
  with pytest.raises(ValueError, match=r"requests\[1\].*n="):
    engine.generate([good, bad[3][0]])
  assert got(handle.result()) == expected(model, good)

  async def main():
    async def collect(request):
      tokens = [[] for _ in range(request.n)]
      async for new in engine.stream(request):
        for t, more in zip(tokens, new):
          t.extend(more)
      return tokens

    return await asyncio.gather(collect(good), collect(bad[3][0]), collect(other),
                                return_exceptions=True)

  other = Request(list(range(1, 10)), n=2, max_tokens=4, temperature=1.0, seed=2,
                  ignore_eos=True)
  try:
    ok, err, ok2 = asyncio.run(main())
  finally:
    engine.stop()
  assert isinstance(err, ValueError) and "n=" in str(err)
  assert [tuple(t) for t in ok] == [want for want, _ in expected(model, good)]
  assert [tuple(t) for t in ok2] == [want for want, _ in expected(model, other)]
  assert_drained(engine)
