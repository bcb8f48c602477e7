"""Tokenizers: from a ``tokenizer.json`` or rebuilt from GGUF metadata; chat templates.

:class:`Tokenizer` wraps a Hugging Face ``tokenizers.Tokenizer`` (the fast Rust
one) with the few things generation needs: BOS/EOS ids, whether to prepend
BOS, decoding that drops the generation pad id, and the chat template.

A GGUF file carries its vocabulary, merges and token types as
``tokenizer.ggml.*`` metadata. For byte-level BPE vocabularies
(``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3) the tokenizer is rebuilt
with the pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre`` (SmolLM2's
``"smollm"``: every digit on its own, then GPT-2's split).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# llama.cpp's pre-tokenizer regexes per `tokenizer.ggml.pre` (applied in order).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 and Qwen3: Llama 3's split with every digit on its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_SPLITS = {
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "gpt2": (_GPT2_SPLIT,),
    "default": (_GPT2_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
  """Text <-> token ids.

  Attributes:
    backend: the ``tokenizers.Tokenizer``.
    bos_id, eos_id: special ids (or None).
    add_bos: prepend ``bos_id`` in :meth:`encode` (Llama 2/3 yes, SmolLM2 no).
    chat_template: a Jinja template (HF convention) or None.
  """

  def __init__(self, backend, *, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
               add_bos: bool = False, chat_template: Optional[str] = None):
    self.backend = backend
    self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, bool(add_bos)
    self.chat_template = chat_template

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_bos: Optional[bool] = None) -> list[int]:
    """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    add_bos = self.add_bos if add_bos is None else add_bos
    if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``ids``; negative ids (the generation pad, ``models.PAD_ID``) are dropped."""
    ids = [int(i) for i in ids if int(i) >= 0]
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                          add_generation_prompt: bool = True) -> str:
    """Renders ``messages`` (``[{"role": ..., "content": ...}]``) with the chat template.

    Uses jinja2 the way transformers does (sandboxed, ``trim_blocks``,
    ``lstrip_blocks``). Without a template, or without jinja2 installed, the
    ChatML format (``<|im_start|>role\\ncontent<|im_end|>\\n``) is used, which is
    SmolLM2-Instruct's format apart from its default system message.
    """
    template = self.chat_template or CHATML_FALLBACK
    try:
      from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
      return _render_chatml(messages, add_generation_prompt)

    def raise_exception(message):
      raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    token = lambda i: self.backend.id_to_token(i) if i is not None else ""
    return env.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=token(self.bos_id), eos_token=token(self.eos_id))

  # -- construction ---------------------------------------------------------------------------

  @classmethod
  def from_dir(cls, path: str) -> "Tokenizer":
    """From ``tokenizer.json`` (+ ``tokenizer_config.json`` for BOS/EOS and the chat template)."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(os.path.join(path, "tokenizer.json"))
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    meta = _read_json(os.path.join(path, "hydragen_tokenizer.json"))
    if meta:  # written by save(): ids directly
      return cls(backend, bos_id=meta.get("bos_id"), eos_id=meta.get("eos_id"),
                 add_bos=meta.get("add_bos", False), chat_template=meta.get("chat_template"))

    def token_id(name):
      tok = cfg.get(name)
      if isinstance(tok, Mapping):
        tok = tok.get("content")
      return backend.token_to_id(tok) if isinstance(tok, str) else None

    add_bos = cfg.get("add_bos_token")
    if add_bos is None:  # Llama 2/3 tokenizer.json add BOS in the post-processor
      add_bos = backend.encode("a").ids[:1] == [token_id("bos_token")]
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: take the default
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = os.path.join(path, "chat_template.jinja")  # transformers >= 4.50 writes it apart
    if template is None and os.path.exists(jinja_file):
      with open(jinja_file) as f:
        template = f.read()
    return cls(backend, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"),
               add_bos=bool(add_bos), chat_template=template)

  @classmethod
  def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
    """From GGUF ``tokenizer.*`` metadata: a mapping such as
    :attr:`models.checkpoints.gguf_reader.GGUFFile.fields` (string arrays with ``tolist()``,
    numeric arrays as NumPy) or plain Python values (lists)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
      raise ValueError(f"Tokenizer.from_gguf_fields: only byte-level BPE ('gpt2') vocabularies "
                       f"are supported; tokenizer.ggml.model is {kind!r}")
    types = fields.get("tokenizer.ggml.token_type")
    backend = _byte_level_bpe(_strings(fields["tokenizer.ggml.tokens"]),
                              _strings(fields.get("tokenizer.ggml.merges", ())),
                              np.zeros(0, np.int32) if types is None else np.asarray(types),
                              fields.get("tokenizer.ggml.pre", "default"))
    return cls(backend, bos_id=fields.get("tokenizer.ggml.bos_token_id"),
               eos_id=fields.get("tokenizer.ggml.eos_token_id"),
               add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
               chat_template=fields.get("tokenizer.chat_template"))

  def save(self, path: str) -> None:
    """Writes ``tokenizer.json`` and ``hydragen_tokenizer.json`` (ids, template) into ``path``."""
    os.makedirs(path, exist_ok=True)
    self.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "hydragen_tokenizer.json"), "w") as f:
      json.dump(dict(bos_id=self.bos_id, eos_id=self.eos_id, add_bos=self.add_bos,
                     chat_template=self.chat_template), f, indent=2)


def _strings(values) -> list[str]:
  return values.tolist() if hasattr(values, "tolist") else list(values)


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _render_chatml(messages, add_generation_prompt: bool) -> str:
  text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
  return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
               + list(range(ord("\xae"), ord("\xff") + 1)))
  chars, n = list(printable), 0
  for b in range(256):
    if b not in printable:
      printable.append(b)
      chars.append(256 + n)
      n += 1
  return dict(zip(printable, map(chr, chars)))


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: np.ndarray,
                    pre: str):
  """A ``tokenizers.Tokenizer`` for a byte-level BPE vocabulary stored in a GGUF
  (``token_types``: llama.cpp's type of each token, or fewer: the rest are normal)."""
  from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
  from tokenizers import Tokenizer as Backend

  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  # Tokens are stored in the byte alphabet already; a few files store raw text.
  if set("".join(tokens)) <= alphabet:  # all of them: nothing to respell
    vocab = dict(zip(tokens, range(len(tokens))))
  else:
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
  bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False)
  backend = Backend(bpe)
  splits = _PRE_SPLITS.get(pre)
  if splits is None:
    raise ValueError(f"Tokenizer: unknown GGUF pre-tokenizer tokenizer.ggml.pre = {pre!r} "
                     f"(known: {', '.join(sorted(_PRE_SPLITS))})")
  backend.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  token_types = np.asarray(token_types)[:len(tokens)]
  control = [tokens[i] for i in np.flatnonzero(token_types == _CONTROL)
             if set(tokens[i]) <= alphabet]
  user = [tokens[i] for i in np.flatnonzero(token_types == _USER_DEFINED) if tokens[i] in vocab]
  backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
  backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
  return backend

