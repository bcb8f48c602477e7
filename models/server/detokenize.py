"""Incremental detokenisation: a sample's text as its tokens arrive, never a split character.

    >>> text = IncrementalText(tokenizer, stop=("\\n\\n",))
    >>> text.add([1734, 314])       # the text that is certain: no half character, no stop string
    >>> text.finish(final_text)     # the rest (the engine's text, cut before a stop string)

A byte-level BPE token can end inside a UTF-8 character: its text then ends in U+FFFD
until the next tokens complete it, so text is released only up to a decoded window that does
not end in U+FFFD (the window then starts on a character border). Each window is decoded
after the one before it as context and only the difference is taken (a SentencePiece token
decodes without its leading space at the start of a text). While a stop string can still
complete, its longest possible start (``max(len(stop)) - 1`` characters) is held back, and
text from a complete stop string on is never released, so a stream never shows text the
final answer cuts.
"""

from __future__ import annotations

from typing import Optional, Sequence


class IncrementalText:
  """One sample's text, released as it becomes certain (see the module docstring)."""

  def __init__(self, tokenizer, stop: Sequence[str] = ()):
    self.tokenizer = tokenizer
    self.stop = tuple(stop)
    self.hold = max((len(s) for s in stop), default=1) - 1
    self.tokens: list[int] = []
    self.prefix = self.read = 0  # token offsets: the context window, the first unread token
    self.text = ""  # decoded tokens[:read]
    self.sent = 0  # characters of ``text`` released

  def add(self, token_ids: Sequence[int]) -> str:
    """Takes new tokens; returns the text they make certain (may be empty)."""
    self.tokens.extend(int(t) for t in token_ids)
    if self.tokenizer is None or self.read == len(self.tokens):
      return ""
    context = self._decode(self.tokens[self.prefix:self.read])
    window = self._decode(self.tokens[self.prefix:])
    if len(window) > len(context) and not window.endswith("\ufffd"):
      self.text += window[len(context):]
      self.prefix, self.read = self.read, len(self.tokens)
    end = len(self.text) - self.hold
    for s in self.stop:  # a complete stop string ends the sample there (its token may carry
      at = self.text.find(s)  # text past it)
      if at >= 0:
        end = min(end, at)
    return self._release(end)

  def finish(self, final: Optional[str] = None) -> str:
    """The text not yet released: ``final`` (the whole text as the engine ends it) past what
    was sent, or without ``final`` the decoded rest."""
    if final is None:
      if self.tokenizer is None:
        return ""
      rest = self._decode(self.tokens[self.prefix:])[len(self._decode(
          self.tokens[self.prefix:self.read])):]
      final = self.text + rest
    self.text = final
    return self._release(len(final))

  def _release(self, end: int) -> str:
    if end <= self.sent:
      return ""
    out, self.sent = self.text[self.sent:end], end
    return out

  def _decode(self, ids) -> str:
    return self.tokenizer.decode(ids) if ids else ""
