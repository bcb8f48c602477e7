"""TPU (Mosaic) Pallas kernels for shared-prefix attention.

Three kernels with the signatures and semantics of :mod:`pallas_kernels.base`
(float32 ``out``, float32 natural-log ``lse``, ``(0, -inf)`` for rows with no
visible key, never NaN):

``prefix.py``   one shared segment, all ``B * Tq * G`` query rows of a KV head in one
                matrix product per row block (Hydragen Sec. 3.2).
``segment.py``  a tree level: rows sorted by segment, grouped tiles with per-visit
                segment ids by scalar prefetch (megablox style, Sec. 3.3).
``suffix.py``   per-sequence ragged attention, causal ``Tq > 1``, blocks past a
                sequence's length skipped by scalar prefetch, ``prior`` merged in the
                kernel's finalisation (Sec. 3.1).
``paged.py``    the suffix kernel over page pools: each sequence's own pages read in place
                through its page table (scalar prefetch).
``shared.py``   the whole decomposition (shared parts, merge, suffix) with every
                intermediate kept in the kernels' row layout: no copy between kernels;
                ``paged_attention``, the same over page pools.
``common.py``   block sizes per chip (:class:`BlockSizes`), padding, the online softmax,
                native/interpret dispatch.
``config.py``   :class:`TpuConfig`, the choices a call passes (static under jit).
``dispatch.py`` the plan of a call (:class:`TpuPlan`: block sizes of the chip planned for and
                every kernel's blocks), a pure function of shapes, device and config;
                ``shared.run_plan`` executes it.
``tuned.py``    the chips' numbers (``CHIPS``) and which device kind names which chip.
``perf_model.py``  bytes, FLOPs and floors per chip (``python -m pallas_kernels.tpu.perf_model``).

Example:
  >>> from pallas_kernels import tpu
  >>> ops = tpu.get_ops()          # native on TPU, interpreted elsewhere (decided when lowering)
  >>> out, lse = ops.prefix_attention(q, pk, pv, kv_length=jnp.int32(100), scale=0.125)
"""

from __future__ import annotations

import functools
from typing import Optional

from pallas_kernels.base import AttentionOps
from pallas_kernels.device import DeviceInfo
from pallas_kernels.tpu import dispatch
from pallas_kernels.tpu.common import CHIPS, BlockSizes, block_sizes_for, chip_of_device_kind
from pallas_kernels.tpu.config import TpuConfig
from pallas_kernels.tpu.prefix import prefix_attention, prefix_attention_head_major
from pallas_kernels.tpu.segment import segment_attention, segment_attention_head_major
from pallas_kernels.tpu.shared import paged_attention, run_plan, run_suffix, shared_attention
from pallas_kernels.tpu.paged import paged_suffix_attention, paged_suffix_head_major
from pallas_kernels.tpu.suffix import suffix_attention, suffix_attention_head_major

__all__ = ["get_ops", "TpuConfig", "BlockSizes", "block_sizes_for", "CHIPS",
           "chip_of_device_kind", "prefix_attention", "segment_attention", "suffix_attention",
           "shared_attention", "run_plan", "prefix_attention_head_major", "segment_attention_head_major",
           "suffix_attention_head_major", "paged_attention", "paged_suffix_attention",
           "paged_suffix_head_major"]


def get_ops(interpret: Optional[bool] = None, *, chip: Optional[str] = None,
            block_sizes: Optional[BlockSizes] = None, config: Optional[TpuConfig] = None,
            device: Optional[DeviceInfo] = None, plan: Optional[dispatch.TpuPlan] = None):
  """The TPU family as a :class:`pallas_kernels.base.AttentionOps`.

  Args:
    interpret: ``None`` (default): Mosaic where the program is lowered for a TPU (also
      ``jax.export(..., platforms=["tpu"])`` from a CPU machine), Pallas' HLO interpreter
      elsewhere, decided at lowering time by ``jax.lax.platform_dependent``. ``True``:
      always the TPU simulator ``pltpu.InterpretParams()``. ``False``: always Mosaic.
    config: a :class:`TpuConfig` (None: its defaults, the chip of ``device``).
    chip, block_sizes: shorthand for ``config=TpuConfig(chip, block_sizes)``.
    device: the device planned for (None: the default TPU, else v5e's numbers).
    plan: a :class:`~pallas_kernels.tpu.dispatch.TpuPlan` of one call's shapes: the
      ``shared_attention`` and ``suffix_attention`` entries execute it as it is (a paged plan,
      :func:`~pallas_kernels.tpu.dispatch.plan_paged`: the ``paged_attention`` entry); the
      others run with its block sizes.
  """
  if config is not None and not isinstance(config, TpuConfig):
    raise TypeError(f"pallas_kernels.tpu.get_ops: config must be a TpuConfig or None; got "
                    f"{type(config).__name__}")
  if config is None:
    if chip is not None and chip not in CHIPS:
      raise ValueError(f"pallas_kernels.tpu.get_ops: chip must be one of {sorted(CHIPS)}; "
                       f"got {chip!r}")
    config = TpuConfig(chip, block_sizes)
  elif chip is not None or block_sizes is not None:
    raise ValueError("pallas_kernels.tpu.get_ops: pass chip and block_sizes inside config, "
                     "not beside it")
  if device is None:
    device = plan.device if plan is not None else DeviceInfo.for_target("tpu")
  bs = plan.block_sizes if plan is not None else dispatch.block_sizes(config, device)
  bind = functools.partial
  knobs = dict(block_sizes=bs, interpret=interpret)
  suffix = bind(suffix_attention, **knobs)
  shared = bind(shared_attention, device=device, **knobs)
  paged = bind(paged_attention, device=device, **knobs)
  if plan is not None and plan.path == "paged":
    paged = bind(paged_attention, plan=plan, interpret=interpret)
  elif plan is not None:  # the call's own plan, as it is
    suffix = bind(run_suffix, plan, interpret=interpret)
    shared = bind(run_plan, plan, interpret=interpret)
  return AttentionOps("pallas:tpu", bind(prefix_attention, **knobs),
                      bind(segment_attention, **knobs), suffix, shared, paged)
