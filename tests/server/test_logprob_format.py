"""Token texts, bytes and text offsets of the log-prob formats (models.server.logprobs): a
text's tokens' bytes add up to its UTF-8, as the tokenizer decodes them (byte-level and
SmolLM2 tokenizers), a token's text
is its bytes when they are whole UTF-8 and OpenAI's ``bytes:`` spelling otherwise, offsets
count the characters the tokens before make certain, and both formats carry the values."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.checkpoints.gguf_reader import GGUFFile
from models.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode
from models.server.logprobs import TextOffsets, TokenPieces, chat_logprobs, completion_logprobs
from models.serving import TokenLogprobs
from model_checks import smollm2_gguf

_SPELLING = _bytes_to_unicode()
BYTES = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                                    "tokenizer.ggml.tokens": [_SPELLING[b] for b in range(256)]})
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@pytest.fixture(scope="module")
def smollm2():
  return Tokenizer.from_gguf_fields(GGUFFile(smollm2_gguf()).fields)


def certain(data: bytes) -> bytes:
  """``data`` without a last UTF-8 character still incomplete (that later bytes may finish)."""
  for k in (1, 2, 3):
    try:
      data[-k:].decode("utf-8")
    except UnicodeDecodeError as e:
      if e.start == 0 and e.reason == "unexpected end of data":
        return data[:-k]
  return data


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_a_texts_token_bytes_add_up_to_its_utf8(smollm2, text):
  for tokenizer in (BYTES, smollm2):
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode(text)
    joined = b"".join(pieces(t)[0] for t in ids)
    assert joined.decode("utf-8", "replace") == tokenizer.decode(ids)
    if tokenizer.decode(ids) == text:  # (SmolLM2's vocabulary lacks a few lone bytes)
      assert joined == text.encode("utf-8")
    for t in ids:
      data, token = pieces(t)
      try:
        assert token == data.decode("utf-8")
      except UnicodeDecodeError:
        assert token == "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def test_special_tokens_are_spelled_as_written(smollm2):
  pieces = TokenPieces(smollm2)
  (im_end,) = smollm2.encode("<|im_end|>")
  assert pieces(im_end) == (b"<|im_end|>", "<|im_end|>")
  assert TokenPieces(None)(7) == (b"token_id:7", "token_id:7")


@settings(max_examples=150)
@given(st.lists(st.integers(0, 255), max_size=30), st.data())
def test_offsets_count_the_characters_made_certain(ids, data):
  pieces, offsets = TokenPieces(BYTES), TextOffsets()
  values = [TokenLogprobs(-float(t), ((t, -float(t)), (0, -1.0))) for t in ids]
  cut = data.draw(st.integers(0, len(ids)))  # two streamed chunks share one TextOffsets
  got = (completion_logprobs(pieces, ids[:cut], values[:cut], offsets)["text_offset"]
         + completion_logprobs(pieces, ids[cut:], values[cut:], offsets)["text_offset"])
  assert got == [len(certain(bytes(ids[:j])).decode("utf-8", "replace"))
                 for j in range(len(ids))]
  assert BYTES.decode(ids).startswith(certain(bytes(ids)).decode("utf-8", "replace"))


def test_offsets_do_not_wait_on_bytes_that_never_complete():
  """``ED A0`` starts a surrogate, invalid in UTF-8 whatever follows: two replacement characters
  at once (Python's incremental decoder holds them back)."""
  offsets = TextOffsets()
  assert [offsets.next(bytes([b])) for b in (0xED, 0xA0, 0x41)] == [0, 0, 2]
  assert [TextOffsets().next(b"\xc3"), offsets.next(b"\xc3"), offsets.next(b"\xbc")] == [0, 3, 3]


def test_both_formats_carry_the_values():
  pieces = TokenPieces(BYTES)
  ids = [72, 195, 188]  # "H", then "ü" in two bytes
  values = [TokenLogprobs(-0.5, ((72, -0.5), (105, -1.5))), TokenLogprobs(-2.0, ((1, -0.25),)),
            TokenLogprobs(-0.125, ())]
  legacy = completion_logprobs(pieces, ids, values, TextOffsets())
  assert legacy == dict(tokens=["H", "bytes:\\xc3", "bytes:\\xbc"],
                        token_logprobs=[-0.5, -2.0, -0.125],
                        top_logprobs=[{"H": -0.5, "i": -1.5},
                                      {"\x01": -0.25,
                                       "bytes:\\xc3": -2.0},
                                      {"bytes:\\xbc": -0.125}],
                        text_offset=[0, 1, 1])
  chat = chat_logprobs(pieces, ids, values)["content"]
  assert chat[0] == dict(token="H", logprob=-0.5, bytes=[72], top_logprobs=[
      dict(token="H", logprob=-0.5, bytes=[72]), dict(token="i", logprob=-1.5, bytes=[105])])
  assert chat[1]["bytes"] == [195] and chat[2]["top_logprobs"] == []
