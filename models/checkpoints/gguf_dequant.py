"""GGUF tensors to float32, written straight into the layout and buffer they will live in.

    >>> w = dequantize(f.tensors["blk.0.ffn_up.weight"], transpose=True)  # float32 [in, out]

A weight is stored ``[out, in]``, each row a run of blocks (Q4_1: 32 values in 20 bytes,
``d * q + m``; Q4_0: ``d * (q - 8)``; Q8_0: ``d * q``, ``d`` and ``m`` float16). The model
holds ``[in, out]``: the packed integers are reordered first (a byte each), then scaled
into the output, so the float32 values are written once, in their final order, a chunk of
rows at a time (a large tensor's chunks on a thread per core: NumPy's loops release the
GIL). The result is 64-byte aligned: on a CPU, ``jax.device_put`` then uses the
buffer as it is instead of copying it. The arithmetic is that of the ``gguf`` package's
``gguf.quants`` (the same float32 products and sums, in the same order): the values are
the same bits. Other types (K-quants, ...) are dequantized by ``gguf.quants`` (the ``gguf``
package, needed for them only) and copied into place.
"""

from __future__ import annotations

import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from models.checkpoints.gguf_reader import BF16, BLOCKS, Q4_0, Q4_1, Q8_0, block_size

ALIGNMENT = 64  # bytes: XLA's CPU client uses a host buffer aligned so without a copy
HUGE_PAGES_FROM = 1 << 21  # bytes: buffers this large are memory maps with huge pages

_CHUNK_VALUES = 1 << 20  # values per chunk of rows (bounds the temporaries of a large tensor)


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
  """An uninitialised C-order array whose data starts on a multiple of :data:`ALIGNMENT`.

  From :data:`HUGE_PAGES_FROM` bytes on, its own anonymous memory map, marked for
  transparent huge pages where the system offers them: the first write into a fresh buffer
  costs a page fault per page, 512 times fewer with 2 MB pages than with 4 KB ones.
  """
  dtype = np.dtype(dtype)
  n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if n >= HUGE_PAGES_FROM:  # a map from a huge-page boundary (the pages past n are never touched)
    memory = mmap.mmap(-1, n + HUGE_PAGES_FROM)
    if hasattr(mmap, "MADV_HUGEPAGE"):
      try:
        memory.madvise(mmap.MADV_HUGEPAGE)
      except OSError:  # a kernel without them: ordinary pages
        pass
    start = -np.frombuffer(memory, np.uint8, count=1).ctypes.data % HUGE_PAGES_FROM
    return np.frombuffer(memory, dtype, count=n // dtype.itemsize, offset=start).reshape(shape)
  raw = np.empty(n + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start:start + n].view(dtype).reshape(shape)


def dequantize(t, *, transpose: bool = False, rows: Optional[np.ndarray] = None) -> np.ndarray:
  """float32 values of GGUF tensor ``t`` (``gguf.ReaderTensor`` or ``TensorInfo``), aligned.

  Args:
    t: has ``data`` (the file's view: typed ``[out, in]``, or uint8 ``[out, bytes per row]``)
      and ``tensor_type``.
    transpose: return ``[in, out]`` instead of ``[out, in]`` (2-D tensors).
    rows: an int index of rows: the tensor's ``[rows]`` (before the transpose).
  """
  kind, data = int(t.tensor_type), t.data
  if data.ndim == 1 and data.dtype != np.uint8:  # norms, rope factors
    out = aligned_empty(data.shape)
    np.copyto(out, data if rows is None else data[rows], casting="unsafe")
    return out
  data = data.reshape(-1, data.shape[-1])
  if rows is not None:
    data = data[rows]
  n_rows, n_cols = data.shape
  if data.dtype == np.uint8:  # blocks
    size, nbytes = block_size(kind)
    n_cols = n_cols // nbytes * size
  out = aligned_empty((n_cols, n_rows) if transpose else (n_rows, n_cols))
  # Chunks of rows, one per thread (NumPy's kernels run without the GIL) or smaller.
  step = min(_CHUNK_VALUES // max(n_cols, 1), -(-n_rows // _workers()))
  if n_rows * n_cols < _CHUNK_VALUES // 4:
    step = n_rows
  step = max(step, 1)

  def chunk(r0: int) -> None:
    r1 = min(n_rows, r0 + step)
    _dequantize_rows(kind, data[r0:r1], out[:, r0:r1] if transpose else out[r0:r1], transpose)

  starts = range(0, n_rows, step)
  if len(starts) == 1:
    chunk(0)
  else:
    for _ in _pool().map(chunk, starts):
      pass
  return out


@functools.lru_cache(maxsize=None)
def _workers() -> int:
  return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count() or 1))


@functools.lru_cache(maxsize=None)
def _pool() -> ThreadPoolExecutor:
  return ThreadPoolExecutor(_workers(), thread_name_prefix="gguf-dequantize")


def dequantize_block(t, rows: slice, cols: Optional[slice] = None) -> np.ndarray:
  """float32 block ``[rows, cols]`` of ``t``'s ``[out, in]``: only the bytes of the blocks
  covering ``cols`` are read."""
  kind, data = int(t.tensor_type), t.data
  if cols is None:  # a 1-D tensor (the norms): small
    return dequantize(t)[rows]
  if data.dtype != np.uint8:
    return np.asarray(data[rows, cols], np.float32)
  size, nbytes = block_size(kind)
  first, last = cols.start // size, -(-cols.stop // size)
  part = data[rows, first * nbytes:last * nbytes]
  out = np.empty((part.shape[0], (last - first) * size), np.float32)
  _dequantize_rows(kind, part, out, False)
  return out[:, cols.start - first * size:cols.stop - first * size]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
  """float32 of the float16 at byte ``at`` of each block: ``[..., nb, bytes] -> [..., nb, 1]``."""
  return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16).astype(np.float32)


def _dequantize_rows(kind: int, data: np.ndarray, out: np.ndarray, transpose: bool) -> None:
  """Writes the float32 of ``data`` (``r`` rows of the file) into ``out`` (``[r, C]``, or
  ``[C, r]`` with ``transpose``; a view of the result)."""
  r = data.shape[0]
  if data.dtype != np.uint8:  # F32, F16 (and plain integers): values as they are
    np.copyto(out, data.T if transpose else data, casting="unsafe")
    return
  if kind == BF16:  # the upper 16 bits of a float32
    bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
    np.copyto(out, (bits.view(np.float32)).T if transpose else bits.view(np.float32))
    return
  if kind not in BLOCKS:
    from gguf.quants import dequantize as gguf_dequantize

    values = np.asarray(gguf_dequantize(np.ascontiguousarray(data), kind), np.float32)
    np.copyto(out, values.reshape(r, -1).T if transpose else values.reshape(r, -1))
    return
  size, nbytes = BLOCKS[kind]
  nb = data.shape[1] // nbytes
  blocks = data.reshape(r, nb, nbytes)
  # Blocks' axes [row, block, value] become [block, value, row] for our [in, out].
  order = (1, 2, 0) if transpose else (0, 1, 2)
  shape = (nb, size, r) if transpose else (r, nb, size)
  axis = 1 if transpose else 2  # the value-in-block axis
  view = out.view()
  view.shape = shape  # in place: raises rather than copy
  d = _f16(blocks, 0).transpose(order)
  if kind == Q8_0:
    np.multiply(blocks[..., 2:].view(np.int8).transpose(order), d, out=view, dtype=np.float32)
    return
  packed = blocks[..., 2 if kind == Q4_0 else 4:].transpose(order)  # 16 bytes: 2 values each
  q = np.empty(shape, np.uint8)
  half = [slice(None)] * 3
  half[axis] = slice(0, size // 2)
  np.bitwise_and(packed, np.uint8(0x0F), out=q[tuple(half)])
  half[axis] = slice(size // 2, size)
  np.right_shift(packed, np.uint8(4), out=q[tuple(half)])
  if kind == Q4_0:
    signed = q.view(np.int8)
    np.subtract(signed, np.int8(8), out=signed)
    np.multiply(d, signed, out=view, dtype=np.float32)
    return
  np.multiply(d, q, out=view, dtype=np.float32)  # Q4_1: d * q + m
  np.add(view, _f16(blocks, 2).transpose(order), out=view)
