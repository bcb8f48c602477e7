"""Shared pieces of the TPU (Mosaic) kernels: block sizes per chip, padding, dispatch, softmax.

Layout. The kernels read keys and values *head-major* (``[Hkv, P, D]`` for the
prefix, ``[B, Hkv, S, D]`` for suffixes, ``[N, Hkv, T, D]`` for tree
segments), the layout of JAX's own TPU attention kernels: every block is a
``(keys, D)`` slab whose last two dims obey the Mosaic tiling rule (second
minor a multiple of 8, or 16 for bfloat16, minor a multiple of 128) and no
HBM tile is padded. The primitives of :mod:`pallas_kernels.base` use
``[..., seq, heads, D]``; their adapters here transpose and pad (one XLA copy
of each K/V buffer). A cache that is stored head-major can call the
``*_head_major`` kernels directly and skip that copy (see docs/tpu.md).

Interpret vs native. ``interpret=None`` decides at lowering time with
``jax.lax.platform_dependent``: the Mosaic kernel where the program is
lowered for a TPU (also by ``jax.export(..., platforms=["tpu"])`` on a CPU
machine), Pallas' effect-free HLO interpreter (``interpret=True``) anywhere
else. ``interpret=True`` forces the TPU simulator ``pltpu.InterpretParams()``
(checks out-of-bounds block reads and fills uninitialised memory with NaN),
``interpret=False`` forces Mosaic. The simulator is not used for ``None``
because it threads an *ordered* IO effect through the program: on jax 0.10.2
that breaks ``platform_dependent``'s TPU lowering ("Lowering rule for `cond`
returns incorrect set of output tokens") and, where it lowers, it would put
effect tokens into the native TPU program and forbid ``vmap``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.tuned import CHIPS, DEFAULT_CHIP, Chip, chip_of_device_kind  # noqa: F401

LANES = 128  # vreg lanes: the minor block dim is a multiple of this
ROW_ALIGN = 16  # second-minor block dims: 8 sublanes x 2 (bfloat16 packs two rows per sublane)
NT_DIMS = (((1,), (1,)), ((), ()))  # q @ k.T without materialising k.T


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(x: int, m: int) -> int:
  return cdiv(x, m) * m


def pow2_ceil(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def pow2_floor(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x).bit_length() - 1)


# ------------------------------------------------------------------------------------------
# Chips and block sizes
# ------------------------------------------------------------------------------------------


STEP_OVERHEAD_S = 0.35e-6  # fixed cost of one pipelined grid step (order of magnitude)
DEFAULT_SCOPED_VMEM = 16 << 20  # the smallest default scoped-VMEM limit (v5e, v5p)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tuning knobs of the three kernels (static; a different value compiles a new kernel).

  Attributes:
    prefix_rows: query rows (``B * Tq * G`` of one KV head) per prefix/segment block: the M
      dim of both matrix products. At least ~2x the chip's ridge point (FLOPs per K/V byte)
      so that a full block is matmul-bound, and a multiple of the MXU width.
    prefix_keys: keys per prefix/segment block, i.e. per DMA and grid step.
    compute_keys: keys per matrix product inside a block (the float32 score tile is
      ``prefix_rows x compute_keys``): decouples the step size from the score tile's VMEM.
    suffix_keys: keys per suffix block.
    suffix_step_bytes: K+V bytes one suffix grid step should move: sequences and KV heads
      are packed into a step until it moves about this much, so that the fixed cost of a
      grid step stays small against its DMA time.
    vmem_budget_bytes: what the double-buffered blocks, scratch and score temporaries of a
      step may use; 3/4 of the smallest default scoped-VMEM limit, so no kernel needs
      ``vmem_limit_bytes`` (which also needs ``--xla_tpu_scoped_vmem_limit_kib``).
    vmem_limit_bytes: forwarded to ``CompilerParams`` when set (None: the compiler's).
    min_parallel_steps: 2 on megacore chips: keep both TensorCores busy.
  """

  prefix_rows: int = 512
  prefix_keys: int = 512
  compute_keys: int = 512
  suffix_keys: int = 512
  suffix_step_bytes: int = 1 << 20
  vmem_budget_bytes: int = DEFAULT_SCOPED_VMEM * 3 // 4
  vmem_limit_bytes: Optional[int] = None
  min_parallel_steps: int = 1

  def __post_init__(self):
    for name in ("prefix_rows", "prefix_keys", "compute_keys", "suffix_keys"):
      value = getattr(self, name)
      if value <= 0 or value % ROW_ALIGN:
        raise ValueError(f"BlockSizes: {name} must be a positive multiple of {ROW_ALIGN}; "
                         f"got {value}")
    if self.prefix_keys > self.compute_keys and self.prefix_keys % self.compute_keys:
      raise ValueError(f"BlockSizes: prefix_keys ({self.prefix_keys}) must be a multiple of "
                       f"compute_keys ({self.compute_keys}) when larger")


def block_sizes_for(chip: str) -> BlockSizes:
  """The heuristic, per chip (docs/tpu.md explains each number).

  * ``prefix_rows``: the smallest multiple of the MXU width that is >= 2x the ridge point
    (v5e 241, v5p 166, v6e 560 FLOPs per K/V byte): 512, 384, 1280 rows.
  * ``prefix_keys``: the power of two (>= 512) that gives a full row block of MXU work per
    step at D = 128 of about twice the fixed step cost: 1024, 2048, 2048.
  * ``compute_keys`` = 512, halved by :func:`pallas_kernels.tpu.prefix.prefix_blocks`
    while a step's VMEM estimate exceeds the budget (v6e's 1280-row tile: 256).
  * ``suffix_keys`` = 512; ``suffix_step_bytes`` ~3x (bandwidth x step cost): 1 MiB on
    v5e, 2 MiB on v5p and v6e.
  """
  c = CHIPS[chip]
  rows = round_up(int(2 * c.ridge), c.mxu)
  keys = max(512, pow2_ceil(int(0.75e-6 * c.bf16_flops_per_s / (4 * rows * LANES))))
  step = 1 << 20 if 3 * c.hbm_bytes_per_s * STEP_OVERHEAD_S < (1 << 20) else 2 << 20
  return BlockSizes(prefix_rows=rows, prefix_keys=keys, compute_keys=512, suffix_keys=512,
                    suffix_step_bytes=step, min_parallel_steps=c.tensorcores)


def balanced_block(n: int, max_block: int, align: int = ROW_ALIGN) -> int:
  """Block size for ``n`` items, at most ``max_block``: an exact divisor of ``n`` (no
  padding copy) if one that is a multiple of ``align`` needs at most twice the fewest
  blocks; else as few blocks as possible, equally sized, rounded up to ``align`` (so
  ``n`` pads by less than ``align`` per block)."""
  n = max(n, 1)
  fewest = cdiv(n, max_block)
  for blocks in range(fewest, 2 * fewest + 1):
    if n % blocks == 0 and (n // blocks) % align == 0:
      return n // blocks
  return round_up(cdiv(n, fewest), align)


# ------------------------------------------------------------------------------------------
# Dtypes, padding
# ------------------------------------------------------------------------------------------


def compute_dtype(*arrays) -> jnp.dtype:
  """The dtype the kernels read: bfloat16 stays bfloat16, everything else runs in float32
  (float16 is not a TPU matmul type; float16 -> float32 is exact)."""
  dt = jnp.result_type(*arrays)
  return jnp.dtype(jnp.bfloat16) if dt == jnp.bfloat16 else jnp.dtype(jnp.float32)


def precision(dtype) -> lax.Precision:
  # As the reference: true float32 products for float32 (Mosaic: contract_precision<fp32>).
  return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else lax.Precision.DEFAULT


def pad_to(x: jax.Array, shape) -> jax.Array:
  """Zero-pads ``x`` at the end of every axis up to ``shape`` (zeros in q/k are exact)."""
  pads = [(0, t - s) for s, t in zip(x.shape, shape)]
  if any(p for _, p in pads):
    x = jnp.pad(x, pads)
  return x


# ------------------------------------------------------------------------------------------
# Native vs interpret dispatch
# ------------------------------------------------------------------------------------------


def dispatch(build: Callable[[object], Callable], args, interpret: Optional[bool]):
  """Runs ``build(interpret_value)(*args)``; ``interpret=None`` picks at lowering time."""
  if interpret is None:
    return lax.platform_dependent(*args, tpu=build(False), default=build(True))
  return build(pltpu.InterpretParams() if interpret else False)(*args)


def compiler_params(semantics, vmem_limit_bytes: Optional[int] = None):
  """Grid semantics; a VMEM limit only when one was asked for."""
  return pltpu.CompilerParams(dimension_semantics=tuple(semantics),
                              vmem_limit_bytes=vmem_limit_bytes)


def suffix_call(kernel, args, *, grid, in_specs, row_spec, lse_spec, out_shape, state, keys: int,
                q_itemsize: int, kv_itemsize: int, out_dtype, has_prior: bool, vmem_limit_bytes,
                name: str, interpret: Optional[bool]):
  """Runs a suffix kernel (contiguous or paged) on ``args`` (two scalar-prefetch operands
  first) over ``grid`` (semantics parallel, parallel, arbitrary): outputs ``out`` of
  ``out_shape = (Hkv, B, rows, D)`` in ``out_dtype`` and float32 ``lse [Hkv, B, rows, 128]``;
  the online-softmax state ``(m, l, acc)`` in VMEM scratch with the leading dims ``state``; a
  cost estimate of reading ``keys`` keys per sequence once."""
  hkv, b, rows, d = out_shape
  cost = pl.CostEstimate(
      flops=4 * b * hkv * rows * keys * d, transcendentals=b * hkv * rows * keys,
      bytes_accessed=b * hkv * (2 * keys * d * kv_itemsize + rows * d * q_itemsize
                                + rows * d * jnp.dtype(out_dtype).itemsize + rows * LANES * 4
                                + (rows * (d + LANES) * 4 if has_prior else 0)))

  def build(interpret_value):
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(out_shape, out_dtype),
                   jax.ShapeDtypeStruct((hkv, b, rows, LANES), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=[row_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM(state + (LANES,), jnp.float32),
                            pltpu.VMEM(state + (LANES,), jnp.float32),
                            pltpu.VMEM(state + (d,), jnp.float32)]),
        compiler_params=compiler_params(("parallel", "parallel", "arbitrary"), vmem_limit_bytes),
        cost_estimate=cost, interpret=interpret_value, name=name)

  return dispatch(build, tuple(args), interpret)


# ------------------------------------------------------------------------------------------
# Online softmax over key blocks (the body shared by the three kernels)
# ------------------------------------------------------------------------------------------


def _widen(x: jax.Array, width: int) -> jax.Array:
  """``[..., r, 128]`` lane-replicated -> ``[..., r, width]`` (width a multiple of 128), by
  concatenation: the layout-trivial broadcast Mosaic handles for any multiple."""
  reps = width // LANES
  return x if reps == 1 else jnp.concatenate([x] * reps, axis=-1)


def init_state(m_ref, l_ref, acc_ref):
  m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def init_state_from(m_ref, l_ref, acc_ref, out_prior, lse_prior):
  """Starts the online softmax from a prior partial result ``(out, lse)``: the fused
  merge. A state (m, l, acc) stands for ``out = acc / l`` and ``lse = m + log(l)``, so
  ``(m, l, acc) = (lse, 1, out)``; a prior with ``lse = -inf`` is the empty state."""
  has = lse_prior > -jnp.inf  # [r, 128]
  m_ref[...] = lse_prior
  l_ref[...] = jnp.where(has, 1.0, 0.0)
  acc_ref[...] = jnp.where(lanes(has, acc_ref.shape[-1]), out_prior, 0.0)


def lanes(x: jax.Array, width: int) -> jax.Array:
  """``[..., r, 128]`` lane-replicated -> ``[..., r, width]`` for any ``width`` (a static lane
  slice where it is not a multiple of 128: the paged suffix kernel's head dims)."""
  if width % LANES == 0:
    return _widen(x, width)
  return _widen(x, round_up(width, LANES))[..., :width]


def update_state(q, k, v, valid, m_ref, l_ref, acc_ref, *, scale: float, mods=None):
  """One key block of the online softmax (natural log), exact for fully masked rows.

  q ``[r, D]``, k/v ``[bk, D]``, valid ``[r, bk]`` bool; state refs m/l ``[r, 128]``
  (lane-replicated, the Mosaic idiom for per-row scalars) and acc ``[r, D]`` float32.
  Masked scores are -inf and their probabilities are selected to 0; the running max is
  replaced by 0 while a row has seen no key, so no ``inf - inf`` ever occurs.

  ``mods``: score variants, ``(kind, distance, slopes)``: a
  :class:`pallas_kernels.base.KernelMods`, the query-minus-key positions ``[r, bk]`` int32
  (None where not needed) and the rows' ALiBi slopes ``[r, bk]`` (None without ALiBi).
  """
  prec = precision(q.dtype)
  s = lax.dot_general(q, k, NT_DIMS, precision=prec, preferred_element_type=jnp.float32) * scale
  if mods is not None:
    kind, distance, slopes = mods
    s, visible = kind.apply(s, distance, slopes)
    if visible is not None:
      valid = valid & visible
  s = jnp.where(valid, s, -jnp.inf)
  m_blk = jnp.max(s, axis=1, keepdims=True)  # [r, 1]
  m_blk_safe = jnp.where(m_blk > -jnp.inf, m_blk, 0.0)
  p = jnp.where(valid, jnp.exp(s - m_blk_safe), 0.0)  # [r, bk]
  l_blk = jnp.sum(p, axis=1, keepdims=True)  # [r, 1]
  pv = lax.dot(p.astype(v.dtype), v, precision=precision(v.dtype),
               preferred_element_type=jnp.float32)  # [r, D]
  m_prev = m_ref[...]  # [r, 128]
  m_next = jnp.maximum(m_prev, m_blk)
  m_safe = jnp.where(m_next > -jnp.inf, m_next, 0.0)
  alpha = jnp.exp(m_prev - m_safe)  # rescales the old state (0 when it was empty)
  beta = jnp.exp(m_blk - m_safe)  # rescales this block (0 when it had no visible key)
  m_ref[...] = m_next
  l_ref[...] = alpha * l_ref[...] + beta * l_blk
  width = acc_ref.shape[-1]
  acc_ref[...] = lanes(alpha, width) * acc_ref[...] + lanes(beta, width) * pv


def key_chunks(q_ref, k_ref, v_ref, start, length, chunk: int, m_ref, l_ref, acc_ref, *,
               scale: float, mods=None):
  """Online-softmax updates over a ``[block_keys, D]`` K/V block whose first key is key
  ``start``, ``chunk`` keys per matrix product; chunks at or past ``length`` (the valid
  keys) are skipped. Static slices at multiples of 16 rows: tile-aligned.

  ``mods``: score variants, ``(kind, pos, slopes)``: a
  :class:`pallas_kernels.base.KernelMods`, the rows' positions in the keys' coordinates and
  their ALiBi slopes, ``[block_rows, 128]`` lane-replicated (each None where not needed)."""
  block_rows, block_keys = q_ref.shape[0], k_ref.shape[0]
  for c in range(block_keys // chunk):
    first = start + c * chunk

    @pl.when(first < length)
    def _chunk():
      key = first + lax.broadcasted_iota(jnp.int32, (block_rows, chunk), 1)
      rows = slice(c * chunk, (c + 1) * chunk)
      chunk_mods = None
      if mods is not None:
        kind, pos, slopes = mods
        chunk_mods = (kind, None if pos is None else lanes(pos, chunk) - key,
                      None if slopes is None else lanes(slopes, chunk))
      update_state(q_ref[...], k_ref[rows, :], v_ref[rows, :], key < length, m_ref, l_ref,
                   acc_ref, scale=scale, mods=chunk_mods)


def final_state(m_ref, l_ref, acc_ref):
  """``(out [..., r, D], lse [..., r, 128])`` of a state: ``out = acc / l`` and natural-log
  ``lse = m + log(l)``; ``(0, -inf)`` where no key was visible."""
  l = l_ref[...]
  has = l > 0.0
  safe = jnp.where(has, l, 1.0)
  out = acc_ref[...] / lanes(safe, acc_ref.shape[-1])
  out = jnp.where(lanes(has, acc_ref.shape[-1]), out, 0.0)
  lse = jnp.where(has, m_ref[...] + jnp.log(safe), -jnp.inf)
  return out, lse
