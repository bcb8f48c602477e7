"""The OpenAI protocol: request bodies (pydantic, strict), the error format, response pieces.

Requests are checked the way the OpenAI API checks them: unknown fields and ill-typed values
(``"n": "2"``, ``"stream": 1``) are rejected, every error names its field. A few OpenAI fields
the engine cannot honour are accepted at their neutral value only (``echo``, ``suffix``,
penalties, ``logit_bias``); anything else is a 400 saying so. Log-probabilities: completions'
``logprobs`` (0-5 most likely tokens, OpenAI's legacy limit), chat's ``logprobs`` and
``top_logprobs`` (0-20, only with ``logprobs: true``). Extensions (as vLLM
has them): ``top_k``, ``ignore_eos``, ``return_token_ids`` (each choice, and each streamed
delta, carries its token ids).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
  """An error answered in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

  def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
               kind: str = "invalid_request_error", code: Optional[str] = None):
    super().__init__(message)
    self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


def validation_error(errors: list) -> APIError:
  """The first pydantic (or FastAPI) validation error as an :class:`APIError` naming the field."""
  e = errors[0]
  if e.get("type") == "json_invalid":
    return APIError(f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
  loc = [p for p in e.get("loc", ()) if p != "body"]
  if not loc:
    return APIError(f"the body must be a JSON object ({e['msg']})")
  field = str(loc[0])
  if field == "prompt" and any(str(p).startswith("list[") or p == "str" for p in loc[1:]):
    return APIError("prompt: must be a string, a list of strings, a list of token ids or a "
                    "list of lists of token ids", field)
  path = ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in (
      "str", "int", "float", "bool", "function-after", "list"))))
  msg = e["msg"]
  if e.get("type") == "missing":
    msg = "is required"
  elif e.get("type") == "extra_forbidden":
    msg = "is not a field of this request (unknown parameter)"
  return APIError(f"{path}: {msg}", field)


class _Body(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)

  def check_supported(self) -> None:
    """Raises :class:`APIError` for an OpenAI field the engine does not implement, set to
    other than its neutral value."""
    neutral = dict(frequency_penalty=(None, 0, 0.0), presence_penalty=(None, 0, 0.0),
                   logit_bias=(None, {}), echo=(None, False), suffix=(None,))
    for name, allowed in neutral.items():
      if name in type(self).model_fields and getattr(self, name) not in allowed:
        raise APIError(f"{name}: not supported by this server (only {allowed[-1]!r})", name)
    best_of = getattr(self, "best_of", None)
    if best_of is not None and best_of != self.n:
      raise APIError(f"best_of: not supported by this server (only null or n={self.n})",
                     "best_of")


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  include_usage: bool = False


class _Sampling(_Body):
  """The fields completions and chat completions share."""
  model: str
  n: int = Field(1, ge=1, le=128)
  temperature: Optional[float] = Field(None, ge=0, le=2)
  top_p: Optional[float] = Field(None, gt=0, le=1)
  top_k: Optional[int] = Field(None, ge=1)
  stop: Union[str, list[str], None] = None
  seed: Optional[int] = None
  stream: bool = False
  stream_options: Optional[StreamOptions] = None
  ignore_eos: bool = False
  return_token_ids: bool = False
  user: Optional[str] = None
  frequency_penalty: Optional[float] = None
  presence_penalty: Optional[float] = None
  logit_bias: Optional[dict[str, float]] = None

  def stop_strings(self) -> tuple[str, ...]:
    stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
    if any(not s for s in stop):
      raise APIError("stop: stop strings must not be empty", "stop")
    if len(stop) > 4:
      raise APIError(f"stop: at most 4 stop strings; got {len(stop)}", "stop")
    return stop


class CompletionRequest(_Sampling):
  """``POST /v1/completions``."""
  prompt: Union[str, list[str], list[int], list[list[int]]]
  max_tokens: Optional[int] = Field(16, ge=1)
  logprobs: Optional[int] = Field(None, ge=0, le=5)
  echo: bool = False
  suffix: Optional[str] = None
  best_of: Optional[int] = None

  def logprobs_wanted(self) -> tuple[Optional[int], str]:
    """How many most likely tokens per position to return (None: no log-probs), and the
    field that asked."""
    return self.logprobs, "logprobs"

  def prompts(self) -> list:
    """The prompts: each a string or a list of token ids."""
    p = self.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
      p = [p]
    if not p or any(len(x) == 0 for x in p):
      raise APIError("prompt: must not be empty", "prompt")
    return list(p)


class TextPart(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  type: Literal["text"]
  text: str


class Message(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  role: Literal["system", "developer", "user", "assistant"]
  content: Union[str, list[TextPart], None] = None
  name: Optional[str] = None

  def text(self) -> str:
    if self.content is None:
      return ""
    return self.content if isinstance(self.content, str) else "".join(
        p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
  """``POST /v1/chat/completions``."""
  messages: list[Message] = Field(min_length=1)
  max_tokens: Optional[int] = Field(None, ge=1)
  max_completion_tokens: Optional[int] = Field(None, ge=1)
  logprobs: Optional[bool] = None
  top_logprobs: Optional[int] = Field(None, ge=0, le=20)

  def logprobs_wanted(self) -> tuple[Optional[int], str]:
    """How many most likely tokens per position to return (None: no log-probs), and the
    field that asked."""
    if self.top_logprobs is not None and not self.logprobs:
      raise APIError("top_logprobs: needs logprobs set to true", "top_logprobs")
    return ((self.top_logprobs or 0) if self.logprobs else None), "top_logprobs"

  def token_limit(self) -> tuple[Optional[int], str]:
    """The requested output limit and the field that set it."""
    if self.max_completion_tokens is not None:
      return self.max_completion_tokens, "max_completion_tokens"
    return self.max_tokens, "max_tokens"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached_tokens}}
