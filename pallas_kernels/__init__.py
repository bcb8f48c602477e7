"""Pallas kernels for shared-prefix attention.

Each family implements the three primitives of :mod:`pallas_kernels.base`
with the same signatures and semantics (float32 ``out``, natural-log float32
``lse``, ``(0, -inf)`` for rows with no visible key) and returns them as a
:class:`pallas_kernels.base.AttentionOps` from its ``get_ops(interpret=..., config=...)``.

``interpret=None`` (the default) decides at lowering time, with
``jax.lax.platform_dependent``: the native kernel where the program is lowered
for the family's platform (so ``jax.export(..., platforms=["tpu"])`` on a CPU
machine yields the Mosaic kernel), Pallas interpret mode anywhere else (so the
same call runs on a CPU). ``True``/``False`` force one or the other.

``pallas_kernels.gpu``  Triton kernels (any CUDA GPU; interpret mode on CPU), and
                        on Hopper Mosaic GPU (wgmma/TMA) kernels; ``GpuConfig``.
``pallas_kernels.tpu``  Mosaic TPU kernels (interpret mode on CPU); ``TpuConfig``.
Each has a ``config.py`` (the choices, as values), a ``tuned.py`` (tuned values by device kind)
and a ``dispatch.py`` (the plan of a call: every kernel and its config, a pure function of
shapes, config and the :class:`pallas_kernels.device.DeviceInfo` planned for).

``pallas_kernels.base``    the contract every family implements and is tested against (the
                           reference primitives, the LSE merge, ``AttentionOps``); it imports
                           no implementation, and no kernel imports ``jax_shared_attn``.
``pallas_kernels.device``  :class:`DeviceInfo`, the device a plan is made for.
"""

from __future__ import annotations

FAMILIES = ("triton", "mosaic_gpu", "tpu")


def get_ops(family: str, *, interpret: bool | None = None, config=None):
  """Returns the ``AttentionOps`` of a kernel family ("triton", "mosaic_gpu" or "tpu"), with
  ``config`` (a ``GpuConfig`` / ``TpuConfig`` for that family, or None for its defaults)."""
  if family in ("triton", "mosaic_gpu"):
    from pallas_kernels import gpu
    return gpu.get_ops(interpret=interpret, mosaic=(family == "mosaic_gpu"), config=config)
  if family == "tpu":
    from pallas_kernels import tpu
    return tpu.get_ops(interpret=interpret, config=config)
  raise ValueError(f"pallas_kernels.get_ops: family must be one of {FAMILIES}; got {family!r}")
