"""Which implementation and kernels run a call: the core's half of dispatch.

:func:`choose_family` maps ``impl`` and the platform to a kernel family ("xla", "triton",
"mosaic_gpu", "tpu"); the family's own dispatch module (:mod:`pallas_kernels.gpu.dispatch`,
:mod:`pallas_kernels.tpu.dispatch`) then picks the kernels from shapes and config.
:func:`plan` joins the two into a :class:`Plan` with its reasons, for any platform and device
kind (so a CPU can show what a GPU or TPU would run); ``jax_shared_attn.explain`` calls it with
a public function's own arguments.
"""

from __future__ import annotations

import dataclasses
import re
import types
from typing import Any, Optional

import jax

from pallas_kernels.device import DeviceInfo

IMPLS = ("auto", "xla", "pallas", "pallas:triton", "pallas:mosaic_gpu", "pallas:tpu")
_HOPPER = re.compile(r"\b(GH200|H100|H200|H800|H20)\b", re.IGNORECASE)
_PLATFORMS = types.MappingProxyType(
    {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"})


def _platform(fn: str, platform: Optional[str]) -> str:
  if platform is None:
    return _PLATFORMS.get(jax.default_backend(), jax.default_backend())
  if platform not in _PLATFORMS:
    raise ValueError(f"{fn}: platform must be one of {sorted(_PLATFORMS)} or None (the default "
                     f"backend); got {platform!r}")
  return _PLATFORMS[platform]


def _gpu_family(device_kind: Optional[str]) -> str:
  """Mosaic GPU (wgmma) on Hopper, Triton on every other CUDA GPU."""
  if device_kind is None:
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    return "mosaic_gpu" if cc.startswith("9") else "triton"
  return "mosaic_gpu" if _HOPPER.search(device_kind) else "triton"


def choose_family(impl: str, fn: str = "attention", platform: Optional[str] = None,
                  device_kind: Optional[str] = None) -> str:
  """The kernel family ``impl`` runs on ``platform`` ("cpu", "gpu", "tpu"; None: the default
  backend) with ``device_kind`` (e.g. "NVIDIA H100 80GB HBM3"; None: the default device's)."""
  if not isinstance(impl, str) or impl not in IMPLS:
    raise ValueError(f"{fn}: impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")
  backend = _platform(fn, platform)
  if impl == "xla" or (impl == "auto" and backend not in ("gpu", "tpu")):
    return "xla"
  if impl in ("auto", "pallas"):
    if backend not in ("gpu", "tpu"):
      raise ValueError(
          f"{fn}: impl='pallas' needs a GPU or TPU backend (the default backend is {backend!r}); "
          "use impl='xla', or impl='pallas:triton' / 'pallas:tpu' to run the kernels in "
          "interpret mode")
    return _gpu_family(device_kind) if backend == "gpu" else "tpu"
  family = impl.split(":", 1)[1]
  native = {"triton": "gpu", "mosaic_gpu": "gpu", "tpu": "tpu"}[family]
  if backend not in ("cpu", native):
    raise ValueError(f"{fn}: impl={impl!r} runs on {native} (or cpu, interpreted); the default "
                     f"backend is {backend!r}")
  return family


def check_config(fn: str, family: str, config) -> None:
  """``config`` must be None or the family's config class ("xla" takes an ``XlaConfig`` and
  ignores the others, so that ``impl="auto"`` on a CPU runs a GPU or TPU config's call)."""
  if config is None:
    return
  from pallas_kernels.config import GpuConfig, TpuConfig, XlaConfig
  if not isinstance(config, (GpuConfig, TpuConfig, XlaConfig)):
    raise TypeError(f"{fn}: config must be a GpuConfig, a TpuConfig, an XlaConfig or None; got "
                    f"{type(config).__name__}")
  want = {"triton": GpuConfig, "mosaic_gpu": GpuConfig, "tpu": TpuConfig}.get(family)
  if want is not None and not isinstance(config, want):
    raise TypeError(f"{fn}: the {family} kernels take a {want.__name__} as config; got a "
                    f"{type(config).__name__}")


def segment_alignment(impl: str = "auto", *, platform: Optional[str] = None,
                      device_kind: Optional[str] = None) -> int:
  """Token multiple that shared-segment K/V buffers should be padded to for ``impl`` on
  ``platform`` (None: the default backend). Callers that allocate segment buffers
  (``models.generation``) round their width up to this multiple; the padding is never read as
  keys (the lengths mask it). 128 where the Hopper prefix kernel runs, else 1."""
  if _platform("segment_alignment", platform) != "gpu":
    return 1
  if impl == "pallas:mosaic_gpu" or (impl in ("auto", "pallas")
                                     and _gpu_family(device_kind) == "mosaic_gpu"):
    from pallas_kernels.gpu import dispatch as gpu_dispatch
    return gpu_dispatch.segment_alignment("mosaic_gpu")
  return 1


def suffix_alignment(impl: str = "auto", rows_per_seq: int = 1, config=None, *,
                     platform: Optional[str] = None, device_kind: Optional[str] = None,
                     segment: Optional[int] = None) -> int:
  """Token multiple that per-sequence (own) K/V capacities should be padded to for ``impl``:
  64 on Hopper where decoding runs the one-kernel path (``rows_per_seq = Hq / Hkv >= 8``), 1
  elsewhere (padding is memory). ``segment``: the :func:`segment_alignment` of the same target
  where the caller has it (1: no Hopper kernel runs)."""
  if segment is None:
    segment = segment_alignment(impl, platform=platform, device_kind=device_kind)
  if segment == 1:
    return 1
  from pallas_kernels.gpu import dispatch as gpu_dispatch
  return gpu_dispatch.suffix_alignment("mosaic_gpu", rows_per_seq, config)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a call runs, and why: what :func:`jax_shared_attn.explain` returns and what the
  public functions execute.

  Attributes:
    function: the public function ("shared_prefix_attention", ...).
    impl: the implementation that runs: "xla", "pallas:triton", "pallas:mosaic_gpu" or
      "pallas:tpu".
    platform: "cpu", "gpu" or "tpu": where the program runs (a family off its platform runs in
      Pallas interpret mode).
    device: the :class:`~pallas_kernels.device.DeviceInfo` the kernels are planned for (None
      for "xla").
    backend: the family's plan (:class:`pallas_kernels.gpu.dispatch.GpuPlan`,
      :class:`pallas_kernels.tpu.dispatch.TpuPlan`); for "xla" its forward tiles, a
      :class:`pallas_kernels.xla.XlaConfig`.
    backward: the kernels ``jax.grad`` runs (:class:`jax_shared_attn.backward.BackwardConfig`'s
      ``kernels``): "xla", "triton", "cudnn" or "tpu"; "none" for ``paged_attention``, which is
      forward only.
    backward_tiles: the backward kernels' tiles: a
      :class:`pallas_kernels.gpu.backward.BackwardKernelConfig` ("triton", "cudnn": the parts
      cuDNN does not take), the rows per tile for "tpu", None for "xla" (whose tiles are
      :class:`jax_shared_attn.backward.BackwardConfig`'s).
    reasons: why, in words (the core's, then the family's).
  """

  function: str
  impl: str
  platform: str
  device: Optional[DeviceInfo] = None
  backend: Any = None
  backward: str = "xla"
  backward_tiles: Any = None
  reasons: tuple[str, ...] = ()

  def __str__(self) -> str:
    path = getattr(self.backend, "path", None)
    head = f"{self.function}: {self.impl} on {self.platform}" + (f", path {path}" if path else "")
    return "\n".join([head] + [f"  - {r}" for r in self.reasons])


def _backward_kernels(family: str, backend: str, device: DeviceInfo, config) -> tuple[str, str]:
  """The backward's kernels and why: the GPU families' ``GpuConfig.backward`` ("cudnn" where
  cuDNN's attention backward runs: a CUDA GPU of compute capability >= 8 with the primitive),
  the family's own kernels otherwise."""
  if family not in ("triton", "mosaic_gpu"):
    return family, f"backward: the {family} kernels"
  from pallas_kernels.config import GpuConfig
  from pallas_kernels.gpu import cudnn
  if (config or GpuConfig()).backward != "cudnn":
    return "triton", "backward: the Triton kernels (GpuConfig.backward='triton')"
  if backend == "gpu" and device != DeviceInfo.current():  # planning for a named GPU
    return "cudnn", ("backward: cuDNN's attention backward where a part qualifies, else Triton "
                     "(assumed available on the named device)")
  if not cudnn.available():
    return "triton", "backward: the Triton kernels (cuDNN's attention backward is not available)"
  return "cudnn", "backward: cuDNN's attention backward where a part qualifies, else Triton"


# The kernel families whose kernels apply the score variants (ALiBi, soft-capping, windows).
# The Mosaic GPU kernels (the Hopper prefix kernel, the one-kernel decode) do not.
VARIANT_FAMILIES = ("xla", "triton", "tpu")


def _variant_family(fn: str, impl: str, mods, platform: Optional[str],
                    device_kind: Optional[str]) -> tuple[str, str]:
  """The family that runs a call with score variants (``mods``, a
  :class:`pallas_kernels.base.ScoreMods`) and why. ``impl="auto"``: on a GPU the Triton kernels
  (on Hopper too: the Mosaic GPU kernels lack the variants), elsewhere the XLA path (the TPU
  kernels' variant code runs when ``impl`` names it); an explicit impl: its own family where its
  kernels apply them (:data:`VARIANT_FAMILIES`), "pallas" on Hopper the Triton kernels;
  ``impl="pallas:mosaic_gpu"`` is an error naming the variants."""
  names = mods.describe()
  if impl == "auto":
    backend = _platform(fn, platform)
    if backend == "gpu":
      lack = (" (the Mosaic GPU kernels lack them)" if _gpu_family(device_kind) == "mosaic_gpu"
              else "")
      return "triton", f"score variants ({names}): impl='auto' on a GPU: the Triton kernels{lack}"
    why = (" (the TPU kernels run them with impl='pallas:tpu'; they have not run on a TPU yet)"
           if backend == "tpu" else "")
    return "xla", f"score variants ({names}): impl='auto' runs them on the XLA path{why}"
  family = choose_family(impl, fn, platform, device_kind)
  if family == "xla":
    return family, f"score variants ({names}): the variants run on the XLA path"
  if family in VARIANT_FAMILIES:
    return family, f"score variants ({names}): the {family} kernels apply them"
  if family == "mosaic_gpu" and impl == "pallas":
    return "triton", (f"score variants ({names}): the Mosaic GPU kernels lack them, the Triton "
                      f"kernels apply them")
  names_of = [f"the {f} kernels" for f in VARIANT_FAMILIES]
  kernels = ", ".join(names_of[:-1]) + " and " + names_of[-1]
  raise ValueError(f"{fn}: {', '.join(mods.arguments())} run on {kernels} only; impl={impl!r} "
                   f"has no kernel for them: use impl='auto', 'xla', 'pallas:triton' or "
                   f"'pallas:tpu'")


def plan(fn: str, q, parts, suffix_k, *, impl: str = "auto", config=None,
         platform: Optional[str] = None, device_kind: Optional[str] = None,
         page_table=None, mods=None) -> Plan:
  """The plan for a call with query ``q``, shared ``parts`` (None: no shared part, as
  ``attention_with_lse``) and ``suffix_k``: shapes and dtypes only. ``platform`` and
  ``device_kind`` (None: the default backend and its device) name the target.

  ``page_table`` (``[B, O]``): a call over page pools (``paged_attention``): ``suffix_k`` is the
  key pool ``[pages, page_size, Hkv, D]`` and ``parts`` the levels' ``(table [S, P], lengths,
  segment_of_seq)``.

  ``mods``: the call's score variants (a :class:`pallas_kernels.base.ScoreMods`, None: none):
  ``impl="auto"`` plans the Triton kernels for them on a GPU and the XLA path elsewhere; an
  explicit impl the Triton or TPU kernels, which apply them (:data:`VARIANT_FAMILIES`);
  ``impl="pallas:mosaic_gpu"`` is an error. Their backward is the XLA one."""
  backend = _platform(fn, platform)
  why_variants = None
  if mods is not None:
    family, why_variants = _variant_family(fn, impl, mods, platform, device_kind)
  else:
    family = choose_family(impl, fn, platform, device_kind)
  check_config(fn, family, config)
  why_impl = f"impl={impl!r} on {backend}" + (f" ({device_kind})" if device_kind else "")
  paged = page_table is not None
  if family == "xla":
    from pallas_kernels.xla import XlaConfig
    tiles = config if isinstance(config, XlaConfig) else XlaConfig()
    why = (f"{why_impl}: pure JAX (XLA)",)
    if why_variants is not None:
      why += (why_variants + ("" if paged else ", forward and backward"),)
    why += (f"forward: online softmax over tiles of {tiles.block_rows} query tokens x "
            f"{tiles.block_keys} keys ({tiles})",)
    if paged:
      why += ("the pages gathered into contiguous buffers first",)
    return Plan(fn, "xla", backend, backend=tiles, reasons=why,
                backward="none" if paged else "xla")
  name = f"pallas:{family}"
  reasons = [f"{why_impl}: the {name} kernels"]
  if why_variants is not None:
    reasons.append(why_variants)
  native = {"triton": "gpu", "mosaic_gpu": "gpu", "tpu": "tpu"}[family]
  device = DeviceInfo.for_target(native, device_kind if backend == native else None)
  if backend != native:
    reasons.append(f"lowered for {backend}: the kernels run in Pallas interpret mode"
                   + (" (Triton: Mosaic GPU has none)" if family == "mosaic_gpu" else ""))
  reasons.append(f"planned for {device.device_kind} ({device.cores} "
                 f"{'SMs' if native == 'gpu' else 'TensorCores'})")
  if paged and family == "tpu":
    from pallas_kernels.tpu import dispatch as tpu_dispatch
    bplan = tpu_dispatch.plan_paged(q, [t for t, _, _ in parts], suffix_k, page_table,
                                    device=device, config=config)
  elif paged:
    from pallas_kernels.gpu import dispatch as gpu_dispatch
    bplan = gpu_dispatch.plan_paged(q, [t for t, _, _ in parts], suffix_k, page_table,
                                    device=device, family=family, config=config)
  elif family == "tpu":
    from pallas_kernels.tpu import dispatch as tpu_dispatch
    bplan = tpu_dispatch.plan(q, parts or (), suffix_k, device=device, config=config)
  elif parts is None:
    from pallas_kernels.gpu import dispatch as gpu_dispatch
    bplan = gpu_dispatch.plan_suffix(q, suffix_k, device=device, family=family)
  else:
    from pallas_kernels.gpu import dispatch as gpu_dispatch
    bplan = gpu_dispatch.plan_shared(q, parts, suffix_k, device=device, family=family,
                                     config=config)
  if paged:
    return Plan(fn, name, backend, device, bplan, "none", None,
                tuple(reasons) + tuple(bplan.reasons) + ("forward only (no backward)",))
  if mods is not None:  # the XLA backward recomputes the modified scores
    return Plan(fn, name, backend, device, bplan, "xla", None,
                tuple(reasons) + tuple(bplan.reasons)
                + ("backward: the XLA kernels (score variants)",))
  backward, why_backward = _backward_kernels(family, backend, device, config)
  if family == "tpu":
    from pallas_kernels.tpu import tuned as tpu_tuned
    tiles = tpu_tuned.BACKWARD_BLOCK_ROWS
  else:
    from pallas_kernels.gpu import backward as gpu_backward
    tiles = gpu_backward.default_config(q.shape[-1])
  why_backward += f"; tiles {tiles}"
  return Plan(fn, name, backend, device, bplan, backward, tiles,
              tuple(reasons) + tuple(bplan.reasons) + (why_backward,))

