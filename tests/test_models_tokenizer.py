"""Tokenizers: the GGUF-built one equals transformers' own GGUF tokenizer; chat templates."""

import builtins
import os

import pytest

from models.generate import PAD_ID
from models.loading import gguf_fields, _gguf_reader
from models.tokenizer import CHATML_FALLBACK, Tokenizer
from test_models_loading import smollm2_gguf

TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces,\ttabs\tand\n\nblank lines\n   indented\n",
    "Numbers: 3.14159, 1,000,000 and 2024-06-01; x=1234567 (x2)",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # comment\n",
    "Ünïcödé: naïve café, 日本語のテキスト, 한국어, Ελληνικά, עברית, emoji 🤗🚀👩‍💻",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "It's, we'll, they're, I'd; ALL CAPS and MiXeD; snake_case camelCase kebab-case",
    "URLs https://example.com/a?b=c&d=e#f and e-mail someone@example.org",
    "trailing whitespace   ",
    "",
]


@pytest.fixture(scope="module")
def ours():
  return Tokenizer.from_gguf_fields(gguf_fields(_gguf_reader(smollm2_gguf())))


@pytest.fixture(scope="module")
def theirs():
  transformers = pytest.importorskip("transformers")
  path = smollm2_gguf()
  return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                    gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_encodes_and_decodes_like_transformers(ours, theirs, text):
  ids = ours.encode(text)
  assert ids == theirs.encode(text, add_special_tokens=True)
  assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == text
  assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_every_unicode_numeral_is_its_own_pre_token(ours, theirs):
  """SmolLM2's rule (llama.cpp "smollm" pre-tokenizer; the model's own tokenizer.json splits
  digits the same way): every \\p{N} character stands alone before byte-level BPE. For ASCII
  digits transformers' GGUF tokenizer agrees (the vocabulary has no merges across them); for
  other numerals after a space it differs, because transformers has no "smollm" split and
  merges the space with the numeral's first byte."""
  ids = ours.encode(" ½ 7")
  assert [ours.backend.id_to_token(i) for i in ids] == ["Ġ", "Â½", "Ġ", "7"]
  assert theirs.encode(" 7") == ours.encode(" 7")
  assert theirs.encode(" ½") != ours.encode(" ½")  # the known difference, pinned


def test_special_tokens_and_ids(ours):
  assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, False)
  assert ours.encode("<|im_end|>") == [2]
  assert ours.decode([2, 19556, PAD_ID, PAD_ID]) == "Hello"  # pad ids dropped, special skipped


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Write a haiku."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
])
def test_chat_template_renders_like_transformers(ours, theirs, messages):
  assert ours.chat_template is not None
  expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert ours.apply_chat_template(messages) == expected


def test_chatml_fallback_without_template_or_jinja2(ours, monkeypatch):
  messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
  expected = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
             "<|im_start|>assistant\n"
  plain = Tokenizer(ours.backend, eos_id=2)
  assert plain.apply_chat_template(messages) == expected  # CHATML_FALLBACK through jinja2
  real_import = builtins.__import__

  def no_jinja(name, *args, **kwargs):
    if name.startswith("jinja2"):
      raise ImportError(name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_jinja)
  assert ours.apply_chat_template(messages) == expected  # the documented fallback
  assert "im_start" in CHATML_FALLBACK


def test_tokenizer_json_directories(ours, theirs, tmp_path):
  theirs.save_pretrained(tmp_path / "hf")  # tokenizer.json + tokenizer_config.json
  loaded = Tokenizer.from_dir(str(tmp_path / "hf"))
  assert (loaded.bos_id, loaded.eos_id) == (ours.bos_id, ours.eos_id)
  assert loaded.chat_template == ours.chat_template
  ours.save(str(tmp_path / "ours"))
  again = Tokenizer.from_dir(str(tmp_path / "ours"))
  for text in TEXTS:
    assert loaded.encode(text) == again.encode(text) == ours.encode(text)
