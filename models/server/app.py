"""The FastAPI application: OpenAI's completions and chat completions over the engine.

    app = build_app(load)     # load() -> (engine, model name), run in a thread at start-up

``GET /health`` answers 503 until ``load`` returns (and if it failed), then 200. Every error is
OpenAI's ``{"error": {...}}`` with the field in ``param``; user input never gets a 500. A
streamed answer is server-sent events (``data: {chunk}``, ``data: [DONE]`` last); a client
that disconnects, streaming or not, cancels its engine requests (their pages are freed).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from models.server.bridge import Backend, Totals
from models.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from models.server.metrics import Metrics
from models.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, usage,
                                    validation_error)


class State:
  """The app's state: the backend once loaded (else None), a loading error, the metrics."""

  def __init__(self):
    self.backend: Optional[Backend] = None
    self.error: Optional[BaseException] = None
    self.loaded = threading.Event()
    self.metrics = Metrics(self)

  def ready(self) -> Backend:
    if self.backend is None:
      raise APIError("the model is still loading" if self.error is None else
                     f"the model failed to load: {self.error}", status=503, kind="server_error")
    return self.backend


def build_app(load: Callable[[], tuple], *, on_load_error: Callable[[BaseException], None]
              = lambda e: None) -> FastAPI:
  """The server's app. ``load()`` returns ``(engine, model_name)``; it runs in a thread when
  the app starts (``/health`` answers 503 meanwhile); its exception goes to ``on_load_error``
  (the command line stops the server with it)."""
  state = State()

  def loader():
    try:
      engine, name = load()
      state.backend = Backend(engine, name, state.metrics)
    except BaseException as e:  # noqa: BLE001 -- reported through /health and on_load_error
      state.error = e
      on_load_error(e)
    finally:
      state.loaded.set()

  async def lifespan(app):
    threading.Thread(target=loader, name="hydragen-load", daemon=True).start()
    yield
    if state.backend is not None:
      await asyncio.to_thread(state.backend.engine.stop)

  app = FastAPI(title="hydragen", lifespan=lifespan)
  app.state.hydragen = state

  @app.exception_handler(APIError)
  async def api_error(request, e: APIError):
    state.metrics.requests.labels(request.url.path, str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(RequestValidationError)
  async def invalid(request, e):
    return await api_error(request, validation_error(e.errors()))

  @app.exception_handler(HTTPException)
  async def http_error(request, e: HTTPException):
    return await api_error(request, APIError(str(e.detail), status=e.status_code,
                                             kind="invalid_request_error"))

  @app.get("/health")
  async def health():
    if state.backend is not None:
      return {"status": "ok"}
    status = "loading" if state.error is None else f"failed: {state.error}"
    return JSONResponse({"status": status}, status_code=503)

  @app.get("/v1/models")
  async def models():
    backend = state.ready()
    return {"object": "list", "data": [{"id": backend.model_name, "object": "model",
                                        "created": 0, "owned_by": "hydragen",
                                        "max_model_len": backend.context,
                                        "vocab_size": backend.vocab}]}

  @app.get("/metrics")
  async def metrics():
    body = await asyncio.to_thread(state.metrics.render)  # Engine.stats waits for a tick
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.post("/v1/completions")
  async def completions(request: Request):
    backend = state.ready()
    body = await _parse(request, CompletionRequest, backend)
    prompts = [backend.encode(p, "prompt") if isinstance(p, str) else p for p in body.prompts()]
    jobs = _prepare(backend, body, prompts, "prompt", body.max_tokens, "max_tokens")
    return await _answer(request, state, backend, body, jobs, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    backend = state.ready()
    body = await _parse(request, ChatCompletionRequest, backend)
    prompt = backend.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
    limit, field = body.token_limit()
    jobs = _prepare(backend, body, [prompt], "messages", limit, field)
    return await _answer(request, state, backend, body, jobs, chat=True)

  return app


async def _parse(request: Request, model, backend: Backend):
  """The body as ``model`` (raises :class:`APIError` naming the field)."""
  raw = await request.body()
  try:
    data = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise APIError(f"the body is not valid JSON ({e})") from None
  if not isinstance(data, dict):
    raise APIError(f"the body must be a JSON object; got {type(data).__name__}")
  try:
    body = model.model_validate(data)
  except ValidationError as e:
    raise validation_error(e.errors()) from None
  body.check_supported()
  if body.model != backend.model_name:
    raise APIError(f"model: {body.model!r} is not served here; this server serves "
                   f"{backend.model_name!r}", "model", code="model_not_found")
  if body.stream_options is not None and not body.stream:
    raise APIError("stream_options: only allowed with stream=true", "stream_options")
  return body


def _prepare(backend: Backend, body, prompts, prompt_field: str, limit, limit_field: str):
  top_logprobs, logprobs_field = body.logprobs_wanted()
  return backend.prepare(prompts, prompt_field=prompt_field, n=body.n, max_tokens=limit,
                         limit_field=limit_field,
                         temperature=1.0 if body.temperature is None else body.temperature,
                         top_p=body.top_p, top_k=body.top_k, stop=body.stop_strings(),
                         seed=body.seed, ignore_eos=body.ignore_eos,
                         top_logprobs=top_logprobs, logprobs_field=logprobs_field)


class _Logprobs:
  """A response's ``logprobs`` per choice, in the endpoint's format (text offsets carried
  from one streamed chunk to the next)."""

  def __init__(self, backend: Backend, chat: bool):
    self.chat, self.offsets = chat, {}
    self.pieces = backend.pieces

  def __call__(self, u) -> Optional[dict]:
    if not u.logprobs:
      return None
    if self.chat:
      return chat_logprobs(self.pieces, u.token_ids, u.logprobs)
    offsets = self.offsets.setdefault(u.index, TextOffsets())
    return completion_logprobs(self.pieces, u.token_ids, u.logprobs, offsets)


async def _answer(request: Request, state: State, backend: Backend, body, jobs, *, chat: bool):
  """The answer: a JSON body, or an event stream when ``body.stream``."""
  handles = backend.submit(jobs)
  path, totals = request.url.path, Totals()
  rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
  head = dict(id=rid, object="chat.completion" if chat else "text_completion",
              created=int(time.time()), model=backend.model_name)
  if body.stream:
    state.metrics.requests.labels(path, "200").inc()
    return StreamingResponse(_events(backend, body, jobs, handles, totals, head, chat),
                             media_type="text/event-stream")
  choices = {}

  async def collect():
    async for u in backend.updates(jobs, handles, totals, stream_text=False):
      choices[u.index] = u

  done = asyncio.ensure_future(collect())
  gone = asyncio.ensure_future(_disconnected(request))
  await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
  if not done.done():  # the client left: stop its requests (collect's cleanup cancels them)
    done.cancel()
    await asyncio.gather(done, return_exceptions=True)
    state.metrics.requests.labels(path, "499").inc()
    return Response(status_code=499)
  gone.cancel()
  done.result()
  out, logprobs = [], _Logprobs(backend, chat)
  for i in sorted(choices):
    u = choices[i]
    choice = {"index": i, "logprobs": logprobs(u), "finish_reason": u.finish_reason}
    if chat:
      choice["message"] = {"role": "assistant", "content": u.text}
    else:
      choice["text"] = u.text
    if body.return_token_ids:
      choice["token_ids"] = list(u.token_ids)
    out.append(choice)
  state.metrics.requests.labels(path, "200").inc()
  return {**head, "choices": out,
          "usage": usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)}


async def _disconnected(request: Request) -> None:
  """Returns when the client closes the connection (the body was read already)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


async def _events(backend: Backend, body, jobs, handles, totals: Totals, head: dict, chat: bool):
  """The server-sent events of a streamed answer."""
  head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
  include_usage = body.stream_options is not None and body.stream_options.include_usage
  extra = {"usage": None} if include_usage else {}

  def event(choice: dict) -> str:
    return f"data: {json.dumps({**head, 'choices': [choice], **extra})}\n\n"

  if chat:  # the role first, as OpenAI sends it
    for i in range(sum(job.request.n for job in jobs)):
      yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None})
  logprobs = _Logprobs(backend, chat)
  async for u in backend.updates(jobs, handles, totals):
    if not (u.text or u.finish_reason or body.return_token_ids or u.logprobs):
      continue  # tokens whose text is not certain yet (half a character, a possible stop)
    choice = {"index": u.index, "logprobs": logprobs(u), "finish_reason": u.finish_reason}
    if chat:
      choice["delta"] = {"content": u.text} if u.text or u.finish_reason is None else {}
    else:
      choice["text"] = u.text
    if body.return_token_ids:
      choice["token_ids"] = list(u.token_ids)
    yield event(choice)
  if include_usage:
    counts = usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)
    yield f"data: {json.dumps({**head, 'choices': [], 'usage': counts})}\n\n"
  yield "data: [DONE]\n\n"
