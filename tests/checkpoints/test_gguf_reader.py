"""The memory-mapped GGUF reader and dequantizer against the ``gguf`` package's (the oracle):
the same metadata values, tensors, model parameters and tokenizer, bit for bit."""

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (llama.cpp's reader) is the oracle")

from models.checkpoints.gguf_dequant import dequantize, dequantize_block  # noqa: E402
from models.checkpoints.gguf_reader import GGUFFile, StringArray  # noqa: E402
from models.model.config import preset  # noqa: E402
from models.model.llama import flat_params, random_init  # noqa: E402
from models.checkpoints.loading import (_hf_name, from_pretrained, gguf_config, hf_tensors,  # noqa: E402
                            model_from_tensors, unpermute_rope_rows)
from models.checkpoints.tokenizer import Tokenizer, _bytes_to_unicode  # noqa: E402
from model_checks import smollm2_gguf
from gguf_writer import Q, write_tiny_llama_gguf  # noqa: E402


def oracle_fields(reader) -> dict:
  """Every field as the gguf package decodes it (Python values), its GGUF.* header aside."""
  return {key: field.contents() for key, field in reader.fields.items()
          if not key.startswith("GGUF.")}


def plain(value):
  return value.tolist() if isinstance(value, (np.ndarray, StringArray)) else value


def oracle_dequantize(t) -> np.ndarray:
  """float32 ``[out, in]`` by gguf.quants."""
  values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
  return values.reshape(tuple(int(n) for n in reversed(t.shape)))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def write_test_gguf(path, tensors: dict, alignment: int = 32):
  """Metadata of every value type, and ``tensors`` (name -> (float32 array, ggml type))."""
  w = gguf.GGUFWriter(str(path), "llama")
  if alignment != 32:
    w.add_custom_alignment(alignment)
  w.add_uint8("t.u8", 200)
  w.add_int8("t.i8", -100)
  w.add_uint16("t.u16", 60000)
  w.add_int16("t.i16", -30000)
  w.add_uint32("t.u32", 4_000_000_000)
  w.add_int32("t.i32", -2_000_000_000)
  w.add_float32("t.f32", 0.1)
  w.add_uint64("t.u64", 2**63 + 5)
  w.add_int64("t.i64", -2**62)
  w.add_float64("t.f64", 0.1)
  w.add_bool("t.bool", True)
  w.add_string("t.str", "héllo wörld 🤗")
  w.add_string("t.empty", "")
  w.add_array("t.ints", [3, -1, 7])
  w.add_array("t.floats", [0.5, 1.25])
  w.add_array("t.strs", ["a", "", "ü b", "日本"])
  w.add_array("t.bools", [True, False, True])
  for name, (x, kind) in tensors.items():
    if kind == gguf.GGMLQuantizationType.F32:
      w.add_tensor(name, np.ascontiguousarray(x, np.float32))
    elif kind == gguf.GGMLQuantizationType.F16:
      w.add_tensor(name, np.ascontiguousarray(x, np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(x, np.float32), kind),
                   raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1]  # Q5_*: gguf's fallback


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path, alignment):
  rng = np.random.default_rng(0)
  tensors = {f"w.{kind.name}": (rng.normal(size=(37, 96)).astype(np.float32), kind)
             for kind in TYPES}
  tensors["norm"] = (rng.normal(size=(96,)).astype(np.float32), Q.F32)
  path = tmp_path / "t.gguf"
  write_test_gguf(path, tensors, alignment)
  reader = gguf.GGUFReader(str(path))
  ours = GGUFFile(str(path))
  expected = oracle_fields(reader)
  assert list(ours.fields) == list(expected)
  for key, value in expected.items():
    got = ours.fields[key]
    assert plain(got) == value and type(plain(got)) is type(value), key
  assert isinstance(ours.fields["t.ints"], np.ndarray)  # numeric arrays stay NumPy views
  assert isinstance(ours.fields["t.strs"], StringArray) and ours.fields["t.strs"][2] == "ü b"
  assert list(ours.tensors) == [t.name for t in reader.tensors]
  for t in reader.tensors:
    mine = ours.tensors[t.name]
    assert mine.shape == tuple(int(n) for n in t.shape) and mine.tensor_type == int(t.tensor_type)
    assert same_bits(mine.data, t.data), t.name
    whole = oracle_dequantize(t)
    assert same_bits(dequantize(mine), whole), t.name
    if whole.ndim == 2:
      transposed = dequantize(mine, transpose=True)
      assert same_bits(transposed, np.ascontiguousarray(whole.T)), t.name
      assert transposed.ctypes.data % 64 == 0  # the CPU device takes it without a copy
      rows = rng.permutation(whole.shape[0])
      assert same_bits(dequantize(mine, transpose=True, rows=rows),
                       np.ascontiguousarray(whole[rows].T)), t.name
      block = dequantize_block(mine, slice(3, 30), slice(5, 77))
      assert same_bits(block, np.ascontiguousarray(whole[3:30, 5:77])), t.name


def test_files_that_are_not_gguf_are_refused(tmp_path):
  from models.checkpoints.loading import CheckpointError

  (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(60))
  with pytest.raises(ValueError, match="does not start with b'GGUF'"):
    GGUFFile(str(tmp_path / "x.gguf"))
  (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(60))
  with pytest.raises(ValueError, match="version 1"):
    GGUFFile(str(tmp_path / "v1.gguf"))
  whole = open(write_tiny_llama_gguf(tmp_path / "tiny.gguf"), "rb").read()
  for size in (10, 200, 3000, len(whole) - 7):  # the header, KV pairs, strings, tensor data
    (tmp_path / "cut.gguf").write_bytes(whole[:size])
    with pytest.raises(ValueError, match="GGUF header|ends inside its metadata|past the end"):
      GGUFFile(str(tmp_path / "cut.gguf"))
    with pytest.raises(CheckpointError, match="cut.gguf: not a readable GGUF file"):
      from_pretrained(str(tmp_path / "cut.gguf"))


def oracle_pretrained(path):
  """The loader before the memory-mapped reader: gguf's reader and dequantization, the q/k rows
  unpermuted, transformers' names, model_from_tensors' generic path; the tokenizer from the
  fields as Python lists."""
  reader = gguf.GGUFReader(path)
  fields = oracle_fields(reader)
  by_name = {t.name: t for t in reader.tensors}
  factors = None
  if "rope_freqs.weight" in by_name:
    factors = tuple(np.asarray(oracle_dequantize(by_name.pop("rope_freqs.weight")), np.float64))
  config = gguf_config(fields, has_output="output.weight" in by_name, rope_freq_factors=factors)
  tensors = {}
  for t in by_name.values():
    name, x = _hf_name(t.name), oracle_dequantize(t)
    if name.endswith(("q_proj.weight", "k_proj.weight")):
      x = unpermute_rope_rows(x, x.shape[0] // config.head_dim)
    tensors[name] = x
  return model_from_tensors(config, tensors, dtype="float32"), fields


def check_against_oracle(path):
  model, tokenizer, config = from_pretrained(path)
  expected_model, fields = oracle_pretrained(path)
  assert config == expected_model.config
  ours, theirs = flat_params(model), flat_params(expected_model)
  assert ours.keys() == theirs.keys()
  for key in ours:
    assert same_bits(ours[key], theirs[key]), key
  # The tokenizer: vocabulary, merges, special tokens as in the file; ids and template.
  spelling, tokens = _bytes_to_unicode(), fields["tokenizer.ggml.tokens"]
  alphabet = set(spelling.values())
  vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
           for i, t in enumerate(tokens)}
  saved = json.loads(tokenizer.backend.to_str())
  assert saved["model"]["vocab"] == vocab
  assert saved["model"]["merges"] == [m.split(" ") for m in fields.get("tokenizer.ggml.merges", [])]
  types = fields.get("tokenizer.ggml.token_type", [])
  special = [t for t, k in zip(tokens, types) if k == 3 and set(t) <= alphabet]
  user = [t for t, k in zip(tokens, types) if k == 4 and t in vocab]
  assert [(a["content"], a["special"]) for a in saved["added_tokens"]] == (
      [(t, True) for t in special] + [(t, False) for t in user])
  expected = Tokenizer.from_gguf_fields(fields)
  assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos, tokenizer.chat_template) == (
      expected.bos_id, expected.eos_id, expected.add_bos, expected.chat_template)
  assert tokenizer.backend.to_str() == expected.backend.to_str()
  return model, tokenizer


def test_smollm2_loads_as_through_the_gguf_package():
  """SmolLM2-135M (Q4_1 weights, a Q8_0 embedding, 49K tokens): every parameter and the
  tokenizer as the gguf package's reader and dequantization give them."""
  model, tokenizer = check_against_oracle(smollm2_gguf())
  assert tokenizer.chat_template is not None and tokenizer.eos_id == 2
  assert len(tokenizer.backend.get_vocab()) == 49152


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "F16"])
def test_a_written_llama_gguf_loads_as_through_the_gguf_package(tmp_path, kind):
  model, tokenizer = check_against_oracle(write_tiny_llama_gguf(tmp_path / "tiny.gguf", kind))
  assert model.lm_head is not None and tokenizer.encode(" the") == [254]
