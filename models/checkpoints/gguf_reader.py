"""A GGUF file read through a memory map: metadata decoded on access, tensors as byte views.

    >>> f = GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf")
    >>> f.fields["llama.block_count"]                  # 30 (decoded now, once)
    >>> f.fields["tokenizer.ggml.token_type"]          # int32 ndarray, a view of the file
    >>> f.fields["tokenizer.ggml.tokens"]              # StringArray: str on indexing / tolist()
    >>> f.tensors["blk.0.attn_q.weight"].data          # uint8 [rows, bytes per row], a view

Layout (little-endian; version 2 or 3): ``"GGUF"``, version u32, tensor count u64, KV count
u64; KV pairs (key string, value type u32, value); tensor infos (name, n_dims u32, dims u64
fastest first, type u32, offset u64); tensor data from the next multiple of
``general.alignment`` (32 by default). A string is a u64 length and UTF-8 bytes.

Opening walks the KV section once to find where each value lies (string arrays are walked
length by length: their end is known only then) and reads the tensor infos; no value is
decoded until asked for. Numeric arrays are NumPy views of the map; a string array keeps the
offsets of its strings and decodes them on access. The ``gguf`` package's reader decodes
every field into Python objects on opening; this one reads the same bytes to the same values.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, Iterator, Mapping, NamedTuple

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13))
_SCALARS = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i",
            FLOAT32: "f", BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}
_NUMPY = {UINT8: np.uint8, INT8: np.int8, UINT16: np.uint16, INT16: np.int16, UINT32: np.uint32,
          INT32: np.int32, FLOAT32: np.float32, BOOL: np.bool_, UINT64: np.uint64,
          INT64: np.int64, FLOAT64: np.float64}

# ggml tensor types -> (values per block, bytes per block); plain types have blocks of 1.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
          28: np.float64}
# The block types dequantized here (models.checkpoints.gguf_dequant): (values, bytes) per block.
BLOCKS = {BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}


def block_size(kind: int) -> tuple[int, int]:
  """``(values, bytes)`` per block of ggml type ``kind`` (ValueError if unknown)."""
  if kind in BLOCKS:
    return BLOCKS[kind]
  try:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
  except ImportError:
    raise ValueError(f"GGUF: tensor type {kind} is read with the gguf package: "
                     "pip install gguf") from None
  try:
    return GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
  except (ValueError, KeyError):
    raise ValueError(f"GGUF: unknown tensor type {kind}") from None


class StringArray:
  """A GGUF array of strings: ``len``, ``[i]`` and ``tolist()`` decode from the map.

  ``starts``, ``lengths``: int64 ``[n]``, each string's byte offset in the file and length.
  """

  def __init__(self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
    self._buf, self.starts, self.lengths = buf, starts, lengths

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, i: int) -> str:
    a = int(self.starts[i])
    return self._buf[a:a + int(self.lengths[i])].tobytes().decode("utf-8")

  def __iter__(self) -> Iterator[str]:
    return iter(self.tolist())

  def tolist(self) -> list[str]:
    """Every string, decoded (one copy of the array's bytes, then a slice per string)."""
    if not len(self):
      return []
    first = int(self.starts[0])
    raw = self._buf[first:int(self.starts[-1] + self.lengths[-1])].tobytes()
    starts = (self.starts - first).tolist()
    return [raw[a:a + n].decode("utf-8") for a, n in zip(starts, self.lengths.tolist())]


class TensorInfo(NamedTuple):
  """A tensor of the file, as ``gguf.ReaderTensor`` names its parts.

  ``shape``: GGUF's dims (fastest first: ``[in, out]`` for a weight); ``tensor_type``: the
  ggml type id; ``data``: a view of the map, NumPy order: plain types typed
  (``[out, in]``), block-quantized types ``uint8 [out, bytes per row]``.
  """

  name: str
  shape: tuple[int, ...]
  tensor_type: int
  data: np.ndarray


class GGUFFile:
  """A GGUF file: ``fields`` (key -> value, decoded on access), ``tensors`` (name -> info).

  Raises ValueError naming the problem when the file is not GGUF version 2 or 3.
  """

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    self.buf = np.frombuffer(self._map, np.uint8)  # a plain ndarray view (no np.memmap)
    if self._map[:4] != MAGIC or len(self._map) < 24:
      raise ValueError(f"GGUFFile: {path} does not start with b'GGUF' and a GGUF header "
                       f"(got {self._map[:4]!r}, {len(self._map)} bytes)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._map, 4)
    if version not in (2, 3):
      raise ValueError(f"GGUFFile: {path} is GGUF version {version}; versions 2 and 3 are read "
                       "(a big-endian file reads as a huge version)")
    self.version = version
    self._where: dict[str, tuple[int, int]] = {}  # key -> (value type, offset of the value)
    self._cache: dict[str, Any] = {}
    self._string_arrays: dict[int, tuple] = {}  # offset -> string starts, lengths, end
    self.fields: Mapping[str, Any] = _Fields(self)
    try:
      infos, offset = self._walk(n_kv, n_tensors)
    except struct.error:  # a read past the end
      infos, offset = None, len(self._map) + 1
    if offset > len(self._map):
      raise ValueError(f"GGUFFile: {path} ends inside its metadata ({len(self._map)} bytes: "
                       "truncated?)")
    alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
      raise ValueError(f"GGUFFile: {path}: general.alignment must be a power of two; got "
                       f"{alignment}")
    self.data_offset = -(-offset // alignment) * alignment
    self.tensors = {name: self._tensor(name, dims, kind, start)
                    for name, dims, kind, start in infos}

  def _walk(self, n_kv: int, n_tensors: int) -> tuple[list, int]:
    """Notes where each KV value lies; the tensor infos, and the offset after them."""
    offset = 24
    for _ in range(n_kv):
      key, offset = self._string(offset)
      (kind,) = struct.unpack_from("<I", self._map, offset)
      self._where[key] = (kind, offset + 4)
      offset = self._skip(kind, offset + 4)
    infos = []
    for _ in range(n_tensors):
      name, offset = self._string(offset)
      (n_dims,) = struct.unpack_from("<I", self._map, offset)
      dims = struct.unpack_from(f"<{n_dims}Q", self._map, offset + 4)
      kind, start = struct.unpack_from("<IQ", self._map, offset + 4 + 8 * n_dims)
      offset += 4 + 8 * n_dims + 12
      infos.append((name, tuple(int(n) for n in dims), kind, start))
    return infos, offset

  def _string(self, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", self._map, offset)
    return self._map[offset + 8:offset + 8 + n].decode("utf-8"), offset + 8 + n

  def _skip(self, kind: int, offset: int) -> int:
    """The offset after a value of type ``kind`` at ``offset``."""
    if kind in _SCALARS:
      return offset + struct.calcsize(_SCALARS[kind])
    if kind == STRING:
      return offset + 8 + struct.unpack_from("<Q", self._map, offset)[0]
    if kind != ARRAY:
      raise ValueError(f"GGUFFile: {self.path}: unknown value type {kind} at byte {offset}")
    item, n = struct.unpack_from("<IQ", self._map, offset)
    offset += 12
    if item in _SCALARS:
      return offset + n * struct.calcsize(_SCALARS[item])
    if item == STRING:  # walked once: the offsets are kept for decoding
      self._string_arrays[offset] = self._string_offsets(offset, n)
      return self._string_arrays[offset][2]
    for _ in range(n):  # arrays of arrays: rare, walked item by item
      offset = self._skip(item, offset)
    return offset

  def _string_offsets(self, offset: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Starts and lengths of ``n`` consecutive strings at ``offset``, and the offset after."""
    starts, lengths, unpack, m = [0] * n, [0] * n, struct.Struct("<Q").unpack_from, self._map
    for i in range(n):
      (length,) = unpack(m, offset)
      starts[i], lengths[i] = offset + 8, length
      offset += 8 + length
    return np.asarray(starts, np.int64), np.asarray(lengths, np.int64), offset

  def value(self, key: str) -> Any:
    """The decoded value of ``key`` (KeyError if absent): a Python scalar or str, a NumPy
    array (numeric arrays), a :class:`StringArray`, or a list (arrays of arrays)."""
    if key not in self._cache:
      kind, offset = self._where[key]
      self._cache[key] = self._decode(kind, offset)[0]
    return self._cache[key]

  def _decode(self, kind: int, offset: int) -> tuple[Any, int]:
    if kind in _SCALARS:
      fmt = "<" + _SCALARS[kind]
      return struct.unpack_from(fmt, self._map, offset)[0], offset + struct.calcsize(fmt)
    if kind == STRING:
      return self._string(offset)
    item, n = struct.unpack_from("<IQ", self._map, offset)
    offset += 12
    if item in _SCALARS:
      dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
      end = offset + n * dtype.itemsize
      return self.buf[offset:end].view(dtype), end
    if item == STRING:
      starts, lengths, end = (self._string_arrays.get(offset)
                              or self._string_offsets(offset, n))
      return StringArray(self.buf, starts, lengths), end
    out = []
    for _ in range(n):
      value, offset = self._decode(item, offset)
      out.append(value)
    return out, offset

  def _tensor(self, name: str, dims: tuple[int, ...], kind: int, start: int) -> TensorInfo:
    shape = tuple(reversed(dims))  # NumPy order: slowest first
    n = int(np.prod(shape, dtype=np.int64))
    offset = self.data_offset + start
    if kind in _PLAIN:
      dtype, end = np.dtype(_PLAIN[kind]), offset + n * np.dtype(_PLAIN[kind]).itemsize
    else:
      size, nbytes = block_size(kind)
      if shape[-1] % size:
        raise ValueError(f"GGUFFile: {self.path}: tensor {name} has rows of {shape[-1]} values, "
                         f"not a multiple of its type's blocks of {size}")
      dtype, end = None, offset + n // size * nbytes
    if end > len(self.buf):
      raise ValueError(f"GGUFFile: {self.path}: tensor {name} runs past the end of the file")
    data = self.buf[offset:end]
    if dtype is not None:
      return TensorInfo(name, dims, kind, data.view(dtype).reshape(shape))
    return TensorInfo(name, dims, kind, data.reshape(*shape[:-1], shape[-1] // size * nbytes))


class _Fields(Mapping):
  """``GGUFFile.fields``: key -> value, each decoded on first access."""

  def __init__(self, file: GGUFFile):
    self._file = file

  def __getitem__(self, key: str) -> Any:
    return self._file.value(key)

  def __iter__(self) -> Iterator[str]:
    return iter(self._file._where)

  def __len__(self) -> int:
    return len(self._file._where)

  def __contains__(self, key) -> bool:
    return key in self._file._where
