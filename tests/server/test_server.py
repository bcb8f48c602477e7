"""The OpenAI server, started for real (uvicorn on a free port, in a thread) over the engine
on the tiny model (float32, CPU) with a byte-level tokenizer (one token per byte, so that
characters span tokens), spoken to with the official ``openai`` client and plain httpx.

Streamed and whole answers agree token for token and in text; seeded answers do not depend on
what else runs; usage counts the engine's tokens; log-probs come in OpenAI's completions and
chat formats, streamed and whole, with the engine's values; every bad request is a 400 naming
its field and the server goes on serving; 256 concurrent streaming clients each get their four
answers whole; clients that leave, streaming or not, leave no page behind."""

import asyncio
import json
import random
import threading

import httpx
import pytest
from test_logprob_format import certain

from models.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode
from models.generation.settings import GenerationSettings
from models.model.config import preset
from models.model.llama import random_init
from models.server.launch import ServerThread
from models.serving import Engine, EngineConfig, Request

openai = pytest.importorskip("openai")

MODEL = "tiny-bytes"
# One bucket per padded size: the whole file runs a handful of device programs.
CONFIG = EngineConfig(page_size=4, num_pages=512, max_running=32, max_prefill_tokens=16,
                      decode_steps=4, min_shared_tokens=4, batch_buckets=(32,),
                      prefill_row_buckets=(32,),
                      prefill_buckets=(16,), level_buckets=(2,), segment_buckets=(4,),
                      page_buckets=(16, 256), own_page_buckets=(32, 256))
SYSTEM = "You are a helpful assistant. Answer briefly. "


def byte_tokenizer() -> Tokenizer:
  spelling = _bytes_to_unicode()
  return Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                                     "tokenizer.ggml.tokens": [spelling[b] for b in range(256)]})


@pytest.fixture(scope="module")
def model():
  return random_init(preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def server(model):
  engine = Engine(model, byte_tokenizer(), CONFIG, GenerationSettings(impl="xla"))
  srv = ServerThread(lambda: (engine, MODEL)).start()
  srv.wait_ready(120)
  yield srv
  srv.stop()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def engine_of(server) -> Engine:
  return server.state.backend.engine


def wait_idle(engine: Engine, timeout: float = 60.0) -> None:
  """Returns once no request is queued or running (polls the engine's state)."""
  done = threading.Event()
  for _ in range(int(timeout / 0.02)):
    if not engine.has_work:
      return
    done.wait(0.02)
  raise TimeoutError("the engine did not become idle")


def assert_no_pages_held(engine: Engine) -> None:
  """Nothing in flight; only the prefix cache holds pages, and clearing it frees them all."""
  wait_idle(engine)
  with engine._lock:
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["pages_used"] == stats["pages_cached"]
    engine.tree.clear()
    assert engine.pool.num_used == 0


def sse(lines) -> list[dict]:
  """The chunks of an event stream (``data: [DONE]`` must come last, once)."""
  events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
  assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
  return [json.loads(e) for e in events[:-1]]


def stream_post(server, path: str, body: dict) -> list[dict]:
  with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                    timeout=60) as r:
    assert r.status_code == 200, r.read()
    return sse(list(r.iter_lines()))


# -- answers ------------------------------------------------------------------------------------

def test_completion_streamed_and_whole_agree_and_count_usage(server, client):
  tok = byte_tokenizer()
  body = dict(model=MODEL, prompt=SYSTEM + "Name a colour: ü", max_tokens=12, n=3, seed=5,
              temperature=1.0, extra_body=dict(ignore_eos=True, return_token_ids=True))
  whole = client.completions.create(**body)
  assert [c.index for c in whole.choices] == [0, 1, 2]
  prompt_len = len(tok.encode(body["prompt"]))
  assert whole.usage.prompt_tokens == prompt_len
  assert whole.usage.completion_tokens == 3 * 12 == whole.usage.total_tokens - prompt_len
  for c in whole.choices:
    ids = c.model_extra["token_ids"]
    assert len(ids) == 12 and c.finish_reason == "length"
    assert c.text == tok.decode(ids)
  streamed = client.completions.create(**body, stream=True,
                                       stream_options={"include_usage": True})
  chunks = list(streamed)
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 36
  assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
  assert all(c.usage is None for c in chunks[:-1])
  texts, ids, reasons = ["", "", ""], [[], [], []], [[], [], []]
  for chunk in chunks[:-1]:
    (c,) = chunk.choices
    texts[c.index] += c.text
    ids[c.index] += c.model_extra["token_ids"]
    if c.finish_reason is not None:
      reasons[c.index].append(c.finish_reason)
  for i, c in enumerate(whole.choices):
    assert texts[i] == c.text and ids[i] == c.model_extra["token_ids"]
    assert reasons[i] == ["length"]


def test_chat_uses_the_template_and_streams_the_same_text(server, client):
  tok = byte_tokenizer()
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi! ¿Qué?"}]
  whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                         temperature=0.0)
  expected = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
  assert whole.usage.prompt_tokens == len(expected)
  assert whole.choices[0].message.role == "assistant"
  assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                               max_completion_tokens=10, temperature=0.0,
                                               stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks)
  assert text == whole.choices[0].message.content
  assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_stop_string_cuts_the_text_and_never_streams_it(server, client):
  prompt = "Stop test: 0123456789"
  full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0)
  text = full.choices[0].text
  at = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
  stop = text[at:at + 2]
  cut = text[:text.find(stop)]
  got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
                                  stop=[stop, "never seen"])
  assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
  chunks = stream_post(server, "/v1/completions", dict(model=MODEL, prompt=prompt,
                                                       max_tokens=24, temperature=0.0,
                                                       stop=stop))
  sent = ""
  for chunk in chunks:
    sent += chunk["choices"][0]["text"]
    assert cut.startswith(sent)  # never a character the final answer cuts
  assert sent == cut


def test_seed_gives_the_same_text_whatever_else_runs(server, client):
  body = dict(model=MODEL, prompt="A seeded story:", max_tokens=16, temperature=1.0, seed=1234,
              top_k=50, top_p=0.9)
  alone = client.completions.create(**{k: v for k, v in body.items() if k != "top_k"},
                                    extra_body=dict(top_k=50)).choices[0].text

  async def crowded():
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
      noise = [c.post("/v1/completions", json=dict(model=MODEL, prompt=f"noise {i}",
                                                    max_tokens=8 + i, seed=i, n=2))
               for i in range(6)]
      answers = await asyncio.gather(c.post("/v1/completions", json=body), *noise)
      assert all(a.status_code == 200 for a in answers)
      return answers[0].json()["choices"][0]["text"]

  assert asyncio.run(crowded()) == alone
  other = client.completions.create(model=MODEL, prompt="A seeded story:", max_tokens=16,
                                    temperature=1.0, seed=4321, top_p=0.9,
                                    extra_body=dict(top_k=50))
  assert other.choices[0].text != alone


def test_several_prompts_give_choices_in_order(server, client):
  tok = byte_tokenizer()
  prompts = [tok.encode("first prompt"), tok.encode("the second one")]
  got = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5,
                                  temperature=0.0)
  assert [c.index for c in got.choices] == [0, 1, 2, 3]
  alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5,
                                     temperature=0.0).choices[0].text for p in prompts]
  assert [c.text for c in got.choices] == [alone[0], alone[0], alone[1], alone[1]]
  assert got.usage.prompt_tokens == sum(map(len, prompts))


# -- log-probabilities --------------------------------------------------------------------------

TOL = 3e-6  # float32 at log-probs near -5: the same request in another batch and cache layout


def piece(token: int) -> str:
  """The byte tokenizer's token text: the character, or OpenAI's spelling of a lone byte that
  is not whole UTF-8."""
  return chr(token) if token < 128 else f"bytes:\\x{token:02x}"


def engine_logprobs(server, prompt: list, top: int, **sampling):
  """The engine's own answer to the same request (tokens, TokenLogprobs), submitted directly."""
  out = engine_of(server).submit(Request(prompt, logprobs=True, top_logprobs=top,
                                         **sampling)).result()
  return out.samples[0].token_ids, out.samples[0].logprobs


def test_completion_logprobs_in_openais_format_streamed_and_whole(server, client):
  tok = byte_tokenizer()
  prompt = "Log-probs, ü: "
  body = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=11, logprobs=3,
              extra_body=dict(ignore_eos=True, return_token_ids=True))
  whole = client.completions.create(**body).choices[0]
  ids = whole.model_extra["token_ids"]
  lp = whole.logprobs
  tokens, values = engine_logprobs(server, tok.encode(prompt), 3, max_tokens=10,
                                   temperature=1.0, seed=11, ignore_eos=True)
  assert list(tokens) == ids and lp.tokens == [piece(t) for t in ids]
  assert all(isinstance(v, float) for v in lp.token_logprobs)
  for j, (mine, theirs) in enumerate(zip(values, lp.top_logprobs)):
    assert abs(lp.token_logprobs[j] - mine.logprob) <= TOL
    expected = {piece(t): v for t, v in mine.top}
    expected.setdefault(piece(ids[j]), mine.logprob)  # the sampled token, always there
    assert theirs.keys() == expected.keys()
    assert all(abs(theirs[k] - expected[k]) <= TOL for k in expected)
  # Offsets: the characters of the text that the tokens before each one make certain.
  text = tok.decode(ids)
  assert lp.text_offset == [len(certain(bytes(ids[:j])).decode("utf-8", "replace"))
                            for j in range(10)]
  assert text.startswith(certain(bytes(ids)).decode("utf-8", "replace"))

  streamed = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
  for chunk in client.completions.create(**body, stream=True):
    (c,) = chunk.choices
    if c.logprobs is not None:
      for name in streamed:
        streamed[name] += getattr(c.logprobs, name)
      assert len(c.logprobs.tokens) == len(c.model_extra["token_ids"])
  assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
  assert [t.keys() for t in streamed["top_logprobs"]] == [t.keys() for t in lp.top_logprobs]
  assert max(abs(a - b) for a, b in zip(streamed["token_logprobs"], lp.token_logprobs)) <= TOL


def test_chat_logprobs_in_openais_format_streamed_and_whole(server, client):
  messages = [{"role": "user", "content": "Log-probs, please."}]
  body = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.0, logprobs=True,
              top_logprobs=4)
  whole = client.chat.completions.create(**body).choices[0]
  content = whole.logprobs.content
  tok = byte_tokenizer()
  prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
  tokens, values = engine_logprobs(server, prompt, 4, max_tokens=8)
  assert len(content) == 8
  assert "".join(bytes(e.bytes).decode("latin-1") for e in content) == bytes(tokens).decode(
      "latin-1")  # one byte per token: the bytes in order
  for e, token, mine in zip(content, tokens, values):
    assert e.bytes == [token] and e.token == piece(token)
    assert abs(e.logprob - mine.logprob) <= TOL
    assert [(t.token, t.bytes) for t in e.top_logprobs] == [(piece(t), [t]) for t, _ in mine.top]
    assert all(abs(t.logprob - v) <= TOL for t, (_, v) in zip(e.top_logprobs, mine.top))
    assert e.top_logprobs[0].token == e.token  # greedy: the most likely token
  streamed = []
  for chunk in client.chat.completions.create(**body, stream=True):
    if chunk.choices[0].logprobs is not None:
      streamed += chunk.choices[0].logprobs.content
  assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
  assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) <= TOL
  plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
  assert plain.choices[0].logprobs is None


# -- errors ---------------------------------------------------------------------------------------

GOOD = dict(model=MODEL, prompt="hello", max_tokens=4)
BAD = [  # (path, body or raw bytes, the field the error names)
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "hello"}, "model"),
    ("/v1/completions", {**GOOD, "n": 0}, "n"),
    ("/v1/completions", {**GOOD, "n": "2"}, "n"),
    ("/v1/completions", {**GOOD, "n": 33}, "n"),
    ("/v1/completions", {**GOOD, "top_p": 0}, "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**GOOD, "top_k": 0}, "top_k"),
    ("/v1/completions", {**GOOD, "prompt": "x" * 1024}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 256]}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ""}, "prompt"),
    ("/v1/completions", {**GOOD, "max_tokens": 1020}, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**GOOD, "n": 32, "max_tokens": 80}, "max_tokens"),
    ("/v1/completions", {**GOOD, "stop": ""}, "stop"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {**GOOD, "stream": 1}, "stream"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {**GOOD, "stream": True, "stream_options": {"x": 1}}, "stream_options"),
    ("/v1/completions", {**GOOD, "logprobs": 6}, "logprobs"),
    ("/v1/completions", {**GOOD, "logprobs": True}, "logprobs"),
    ("/v1/completions", {**GOOD, "echo": True}, "echo"),
    ("/v1/completions", {**GOOD, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {**GOOD, "best_of": 3}, "best_of"),
    ("/v1/completions", {**GOOD, "frobnicate": True}, "frobnicate"),
    ("/v1/completions", {**GOOD, "seed": 1.5}, "seed"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "logprobs": 1},
     "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1100}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "prompt": "hi"}, "prompt"),
]


def test_every_bad_request_is_a_400_naming_its_field(server):
  with httpx.Client(base_url=server.url, timeout=30) as c:
    for path, body, field in BAD:
      r = (c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body))
      assert r.status_code == 400, (body, r.text)
      error = r.json()["error"]
      assert error["type"] == "invalid_request_error" and error["param"] == field, (body, error)
      if field is not None:
        assert error["message"].startswith(field), error
    assert c.get("/v1/nothing").json()["error"]["message"] == "Not Found"
    assert c.post("/v1/completions", json=GOOD).status_code == 200  # still serving


def test_the_openai_client_raises_bad_request(client):
  with pytest.raises(openai.BadRequestError, match="top_p"):
    client.completions.create(model=MODEL, prompt="x", top_p=2.0)


# -- health, models, metrics ---------------------------------------------------------------------

def test_health_is_503_while_loading_then_200(model):
  release = threading.Event()

  def load():
    release.wait(60)
    return Engine(model, byte_tokenizer(), CONFIG, GenerationSettings(impl="xla")), MODEL

  loading = ServerThread(load).start()
  try:
    assert httpx.get(loading.url + "/health").status_code == 503
    r = httpx.post(loading.url + "/v1/completions", json=GOOD)
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    release.set()
    loading.wait_ready(60)
    assert httpx.get(loading.url + "/health").status_code == 200
  finally:
    release.set()
    loading.stop()


def test_models_and_metrics(server, client):
  (model,) = client.models.list().data
  assert model.id == MODEL and model.model_extra["max_model_len"] == 1024
  client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
  text = httpx.get(server.url + "/metrics").text
  for name in ("hydragen_running", "hydragen_waiting", "hydragen_pages_used",
               "hydragen_pages_free", "hydragen_pages_shared", "hydragen_prefix_hit_rate",
               "hydragen_tokens_per_s", "hydragen_time_to_first_token_seconds_bucket",
               "hydragen_time_per_output_token_seconds_bucket",
               'hydragen_requests_total{endpoint="/v1/completions",status="200"}'):
    assert name in text, name
  free = float(next(line.split()[1] for line in text.splitlines()
                    if line.startswith("hydragen_pages_free ")))
  assert free == engine_of(server).pool.num_free
  assert "hydragen_model_shards 1.0" in text  # one device (the served mesh: test_cli_serve.py)


# -- load and faults ----------------------------------------------------------------------------

async def _stream(client: httpx.AsyncClient, body: dict, leave_after=None):
  """A streamed completion: (token ids, finish reasons, usage), or None when it left early."""
  ids, reasons, usage = [], [], None
  async with client.stream("POST", "/v1/completions", json=body) as r:
    assert r.status_code == 200
    events = 0
    async for line in r.aiter_lines():
      if not line.startswith("data: "):
        continue
      events += 1
      if leave_after is not None and events > leave_after:
        return None  # closes the connection mid-stream
      if line == "data: [DONE]":
        break
      chunk = json.loads(line[6:])
      usage = chunk.get("usage") or usage
      for c in chunk["choices"]:
        ids += c["token_ids"]
        if c["finish_reason"]:
          reasons.append(c["finish_reason"])
  return ids, reasons, usage


def test_256_streaming_clients_get_every_answer_whole(server, client):
  engine = engine_of(server)
  questions = [SYSTEM + f"Question {i}?" for i in range(8)]
  base = dict(model=MODEL, max_tokens=6, temperature=0.0, ignore_eos=True,
              return_token_ids=True)
  expected = [client.completions.create(
      model=MODEL, prompt=q, max_tokens=6, temperature=0.0,
      extra_body=dict(ignore_eos=True, return_token_ids=True)).choices[0].model_extra["token_ids"]
      for q in questions]
  before = engine.stats()["generated_tokens"]

  async def one_client(c, k):
    got = []
    for j in range(4):
      q = (k + j) % len(questions)
      got.append((q, await _stream(c, dict(base, prompt=questions[q], stream=True,
                                           stream_options={"include_usage": True}))))
    return got

  async def run():
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
      return await asyncio.gather(*(one_client(c, k) for k in range(256)))

  results = [r for per_client in asyncio.run(run()) for r in per_client]
  assert len(results) == 1024
  for q, (ids, reasons, usage) in results:
    assert ids == expected[q] and reasons == ["length"]
    assert usage["completion_tokens"] == 6
  assert engine.stats()["generated_tokens"] - before == 1024 * 6  # none recomputed, none lost
  assert_no_pages_held(engine)


@pytest.fixture
def cancelled(server, monkeypatch):
  """The engine requests the server cancels (a list, filled as it cancels them)."""
  engine, out = engine_of(server), []
  cancel = engine.cancel

  def counting(handle):
    cancel(handle)
    if any(s.finish_reason == "cancelled" for s in handle.output.samples):
      out.append(handle.request_id)

  monkeypatch.setattr(engine, "cancel", counting)
  return out


def test_clients_that_leave_mid_stream_leave_no_pages(server, cancelled):
  engine = engine_of(server)
  rng = random.Random(0)
  body = dict(model=MODEL, temperature=0.0, ignore_eos=True, return_token_ids=True, stream=True)

  async def run():
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
      lone = await _stream(c, dict(body, prompt="alone", max_tokens=1000), leave_after=1)
      wait_idle(engine)
      assert lone is None and len(cancelled) == 1  # 250 device calls: it cannot have ended
      return await asyncio.gather(*(  # 3 in 4 leave after 0-12 events (the rest may be done)
          _stream(c, dict(body, prompt=SYSTEM + f"leave {i}", max_tokens=200),
                  leave_after=rng.randint(0, 12) if i % 4 else None)
          for i in range(48)))

  results = asyncio.run(run())
  assert sum(r is None for r in results) == 36
  assert all(r[1] == ["length"] and len(r[0]) == 200 for r in results if r is not None)
  assert_no_pages_held(engine)
  assert 1 < len(cancelled) <= 37


def test_a_client_that_leaves_a_whole_answer_cancels_it(server, cancelled):
  engine = engine_of(server)
  body = dict(model=MODEL, prompt="a long answer", max_tokens=1000, ignore_eos=True)

  async def run():
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
      task = asyncio.ensure_future(c.post("/v1/completions", json=body))
      for _ in range(3000):  # until the engine runs it
        if engine.stats()["running"]:
          break
        await asyncio.sleep(0.01)
      engine.stop()  # paused: the answer cannot end before the server sees the client leave
      try:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(3000):
          if cancelled:
            break
          await asyncio.sleep(0.01)
      finally:
        engine.start()

  asyncio.run(run())
  assert_no_pages_held(engine)
  assert len(cancelled) == 1
  left = server.state.metrics.requests.labels("/v1/completions", "499")._value.get()
  assert left == 1
