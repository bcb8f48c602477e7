"""Incremental detokenisation: the released pieces add up to the whole decoded text, none of
them splits a character, and no piece shows text a stop string will cut (byte-level and
SmolLM2 tokenizers, any split of the tokens into arrivals)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.checkpoints.gguf_reader import GGUFFile
from models.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode
from models.server.detokenize import IncrementalText
from model_checks import smollm2_gguf

_SPELLING = _bytes_to_unicode()
BYTES = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                                    "tokenizer.ggml.tokens": [_SPELLING[b] for b in range(256)]})
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@pytest.fixture(scope="module")
def smollm2():
  return Tokenizer.from_gguf_fields(GGUFFile(smollm2_gguf()).fields)


def released(tokenizer, ids, cuts, stop=(), final=None):
  """The pieces an :class:`IncrementalText` releases for ``ids`` arriving in ``cuts``."""
  text, pieces, start = IncrementalText(tokenizer, stop), [], 0
  for end in sorted(set(cuts)) + [len(ids)]:
    pieces.append(text.add(ids[start:end]))
    start = end
  pieces.append(text.finish(final))
  return pieces


def cuts_of(n):
  return st.lists(st.integers(0, n), max_size=8)


@settings(max_examples=150)
@given(st.data())
def test_any_bytes_add_up_to_the_whole_decode(data):
  ids = data.draw(st.lists(st.integers(0, 255), max_size=30))
  pieces = released(BYTES, ids, data.draw(cuts_of(len(ids))))
  assert "".join(pieces) == BYTES.decode(ids)


@settings(max_examples=150)
@given(st.data())
def test_valid_text_is_never_released_with_half_a_character(data):
  text = data.draw(TEXT)
  ids = BYTES.encode(text)
  pieces = released(BYTES, ids, data.draw(cuts_of(len(ids))))
  assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@settings(max_examples=60)
@given(st.data())
def test_smollm2_pieces_add_up_to_the_whole_decode(smollm2, data):
  text = data.draw(TEXT)
  ids = smollm2.encode(text) + data.draw(st.lists(st.integers(0, smollm2.vocab_size - 1),
                                                  max_size=6))
  pieces = released(smollm2, ids, data.draw(cuts_of(len(ids))))
  assert "".join(pieces) == smollm2.decode(ids)


@settings(max_examples=150)
@given(st.data())
def test_no_piece_shows_what_a_stop_string_cuts(data):
  text = data.draw(st.text("abc\u00e9\u4e16", min_size=1, max_size=30))
  stop = data.draw(st.text("abc\u00e9\u4e16", min_size=1, max_size=3))
  ids = BYTES.encode(text)
  # What the engine does: the text ends at the token that completes the first stop string.
  for end in range(1, len(ids) + 1):
    if stop in BYTES.decode(ids[:end]):
      ids = ids[:end]
      break
  whole = BYTES.decode(ids)
  final = whole[:whole.find(stop)] if stop in whole else whole
  pieces = released(BYTES, ids, data.draw(cuts_of(len(ids))), (stop,), final)
  assert "".join(pieces) == final
  shown = ""
  for p in pieces:
    shown += p
    assert final.startswith(shown)
