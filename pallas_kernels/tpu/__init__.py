"""TPU (Mosaic) Pallas kernels for shared-prefix attention.

Three kernels with the signatures and semantics of :mod:`jax_shared_attn.reference`
(float32 ``out``, float32 natural-log ``lse``, ``(0, -inf)`` for rows with no
visible key, never NaN):

``prefix.py``   one shared segment, all ``B * Tq * G`` query rows of a KV head in one
                matrix product per row block (Hydragen Sec. 3.2).
``segment.py``  a tree level: rows sorted by segment, grouped tiles with per-visit
                segment ids by scalar prefetch (megablox style, Sec. 3.3).
``suffix.py``   per-sequence ragged attention, causal ``Tq > 1``, blocks past a
                sequence's length skipped by scalar prefetch, ``prior`` merged in the
                kernel's finalisation (Sec. 3.1).
``shared.py``   the whole decomposition (shared parts, merge, suffix) with every
                intermediate kept in the kernels' row layout: no copy between kernels.
``common.py``   block sizes per chip (:class:`BlockSizes`), padding, the online softmax,
                native/interpret dispatch.
``perf_model.py``  bytes, FLOPs and floors per chip (``python -m pallas_kernels.tpu.perf_model``).

Example:
  >>> from pallas_kernels import tpu
  >>> ops = tpu.get_ops()          # native on TPU, interpreted elsewhere (decided when lowering)
  >>> out, lse = ops.prefix_attention(q, pk, pv, kv_length=jnp.int32(100), scale=0.125)
"""

from __future__ import annotations

import functools
from typing import Optional

from pallas_kernels.tpu.common import CHIPS, BlockSizes, block_sizes_for, detect_chip
from pallas_kernels.tpu.prefix import prefix_attention, prefix_attention_head_major
from pallas_kernels.tpu.segment import segment_attention, segment_attention_head_major
from pallas_kernels.tpu.shared import shared_attention
from pallas_kernels.tpu.suffix import suffix_attention, suffix_attention_head_major

__all__ = ["get_ops", "BlockSizes", "block_sizes_for", "CHIPS", "detect_chip",
           "prefix_attention", "segment_attention", "suffix_attention", "shared_attention",
           "prefix_attention_head_major", "segment_attention_head_major",
           "suffix_attention_head_major"]


def get_ops(interpret: Optional[bool] = None, *, chip: Optional[str] = None,
            block_sizes: Optional[BlockSizes] = None):
  """The TPU family as a :class:`jax_shared_attn.ops.AttentionOps`.

  Args:
    interpret: ``None`` (default): Mosaic where the program is lowered for a TPU (also
      ``jax.export(..., platforms=["tpu"])`` from a CPU machine), Pallas' HLO interpreter
      elsewhere, decided at lowering time by ``jax.lax.platform_dependent``. ``True``:
      always the TPU simulator ``pltpu.InterpretParams()``. ``False``: always Mosaic.
    chip: ``"v5e"``, ``"v5p"`` or ``"v6e"``: use that chip's block sizes (e.g. when
      exporting for it from a CPU). Default: the chip of the default backend, else v5e's.
    block_sizes: explicit :class:`BlockSizes` (overrides ``chip``).
  """
  from jax_shared_attn.ops import AttentionOps  # deferred: the core imports us lazily

  if chip is not None and chip not in CHIPS:
    raise ValueError(f"pallas_kernels.tpu.get_ops: chip must be one of {sorted(CHIPS)}; "
                     f"got {chip!r}")
  if block_sizes is None and chip is not None:
    block_sizes = block_sizes_for(chip)
  bind = functools.partial
  knobs = dict(block_sizes=block_sizes, interpret=interpret)
  fused = {}
  if "shared_attention" in AttentionOps._fields:  # the optional whole-decomposition entry
    fused["shared_attention"] = bind(shared_attention, **knobs)
  return AttentionOps(
      "pallas:tpu",
      bind(prefix_attention, **knobs),
      bind(segment_attention, **knobs),
      bind(suffix_attention, **knobs),
      **fused,
  )
