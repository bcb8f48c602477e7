"""Log-probabilities in OpenAI's two formats, from the engine's :class:`TokenLogprobs`.

    >>> pieces = TokenPieces(tokenizer)
    >>> completion_logprobs(pieces, token_ids, logprobs, TextOffsets())  # /v1/completions
    >>> chat_logprobs(pieces, token_ids, logprobs)                        # /v1/chat/completions

A token's text is its piece in the tokenizer's vocabulary as UTF-8 bytes (byte-level BPE
pieces mapped back to their bytes, SentencePiece's ``▁`` as a space and ``<0xNN>`` as that
byte, special tokens as written); a piece that is not whole UTF-8 (a byte-level token inside
a character) is spelled ``bytes:\\xNN...`` as OpenAI spells it, so that distinct tokens keep
distinct keys. ``text_offset`` counts the characters of the choice's text before each token
(the characters its pieces' bytes complete; 0 at the start of the completion, no echo).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from models.checkpoints.tokenizer import _bytes_to_unicode

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


class TokenPieces:
  """Each token id's bytes and text (see the module docstring), computed once per id."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    backend = getattr(tokenizer, "backend", None)
    self._backend = backend
    self._special = set() if backend is None else set(backend.get_added_tokens_decoder())
    self._byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
    self._cache: dict[int, tuple[bytes, str]] = {}

  def __call__(self, token_id: int) -> tuple[bytes, str]:
    """``(bytes, text)`` of ``token_id``."""
    if token_id not in self._cache:
      data = self._bytes(token_id)
      try:
        text = data.decode("utf-8")
      except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
      self._cache[token_id] = data, text
    return self._cache[token_id]

  def _bytes(self, token_id: int) -> bytes:
    if self._backend is None:  # no tokenizer: the id itself
      return f"token_id:{token_id}".encode()
    piece = self._backend.id_to_token(token_id)
    if piece is None:
      return b""
    if token_id in self._special:
      return piece.encode("utf-8")
    if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
      return bytes(_BYTE_OF_CHAR[c] for c in piece)
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
      return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _settled(data: bytes) -> int:
  """How many leading bytes of ``data`` no later byte can change the decoding of: all but a
  last UTF-8 character still incomplete. (Python's incremental decoder also holds back bytes
  that can never be completed, such as ``ED A0``, a surrogate's start.)"""
  for k in (1, 2, 3):
    try:
      data[-k:].decode("utf-8")
    except UnicodeDecodeError as e:
      if e.start == 0 and e.reason == "unexpected end of data":
        return len(data) - k
  return len(data)


class TextOffsets:
  """A choice's ``text_offset`` as its tokens come: the characters their bytes complete."""

  def __init__(self):
    self._pending = b""
    self.chars = 0

  def next(self, data: bytes) -> int:
    """The offset of a token with bytes ``data``; advances past it."""
    at, data = self.chars, self._pending + data
    n = _settled(data)
    self.chars += len(data[:n].decode("utf-8", "replace"))
    self._pending = data[n:]
    return at


def completion_logprobs(pieces: TokenPieces, token_ids: Sequence[int], logprobs: Sequence,
                        offsets: TextOffsets) -> dict:
  """``/v1/completions``'s ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
  (per token ``{text: logprob}``: the requested most likely tokens and the sampled one) and
  ``text_offset``."""
  out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
  for tok, lp in zip(token_ids, logprobs):
    data, text = pieces(tok)
    out["tokens"].append(text)
    out["token_logprobs"].append(lp.logprob)
    top = {pieces(t)[1]: v for t, v in lp.top}
    top.setdefault(text, lp.logprob)
    out["top_logprobs"].append(top)
    out["text_offset"].append(offsets.next(data))
  return out


def chat_logprobs(pieces: TokenPieces, token_ids: Sequence[int], logprobs: Sequence) -> dict:
  """``/v1/chat/completions``'s ``logprobs``: ``content``, per token ``{token, logprob,
  bytes, top_logprobs: [{token, logprob, bytes}]}``."""
  def entry(tok: int, value: float, top: Optional[Sequence] = None) -> dict:
    data, text = pieces(tok)
    e = dict(token=text, logprob=value, bytes=list(data))
    if top is not None:
      e["top_logprobs"] = [entry(t, v) for t, v in top]
    return e

  return {"content": [entry(tok, lp.logprob, lp.top) for tok, lp in zip(token_ids, logprobs)],
          "refusal": None}
