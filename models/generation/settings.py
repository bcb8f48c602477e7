"""How tokens are generated, as one value: the sampling rule, the attention implementation and
its kernel configuration, the sampler's search.

    >>> settings = GenerationSettings(temperature=0.7, top_p=0.9, impl="xla")
    >>> tokens = models.generate(model, prompt, num_samples=8, max_new_tokens=32,
    ...                          settings=settings)

The value is frozen and hashable: it is a static argument of the compiled prefill and decode
programs, and the decoder reads its attention fields (``impl``, ``config``) when it is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from jax_shared_attn.config import GpuConfig, TpuConfig
from jax_shared_attn.ops import IMPLS
from models.generation.sampling import SamplerConfig, SamplingParams


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
  """Sampling, attention and sampler choices of a generation call.

  Attributes:
    temperature, top_k, top_p: the sampling rule (:class:`SamplingParams`; 0 = greedy).
    impl: the attention implementation of :mod:`jax_shared_attn` (``"auto"``, ``"xla"``,
      ``"pallas"``, ...).
    config: the attention kernels' configuration, a :class:`jax_shared_attn.GpuConfig` or
      :class:`jax_shared_attn.TpuConfig` (``config=`` of every attention call), or None for
      the defaults.
    sampler: how :func:`models.generation.sampling.sample` searches for the kept set
      (:class:`SamplerConfig`; None: the backend's default).
    causal_attention: ``(q [B, T, Hq, D], k, v [B, T, Hkv, D]) -> [B, T, Hq, D]``, the causal
      self-attention of a call without a cache, in place of :mod:`jax_shared_attn`'s (a
      benchmark's baseline, e.g. cuDNN's flash attention); None: ``jax_shared_attn``.
  """

  temperature: float = 0.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None
  impl: str = "auto"
  config: Any = None
  sampler: Optional[SamplerConfig] = None
  causal_attention: Optional[Callable] = None

  def __post_init__(self):
    sampling = SamplingParams(self.temperature, self.top_k, self.top_p)  # names a bad field
    for name in ("temperature", "top_k", "top_p"):
      object.__setattr__(self, name, getattr(sampling, name))
    if self.impl not in IMPLS:
      raise ValueError(f"GenerationSettings: {self.impl=} must be one of {IMPLS}")
    if self.config is not None and not isinstance(self.config, (GpuConfig, TpuConfig)):
      raise ValueError(f"GenerationSettings: config must be a GpuConfig, a TpuConfig or None; "
                       f"got {type(self.config).__name__}")
    if self.sampler is not None and not isinstance(self.sampler, SamplerConfig):
      raise ValueError(f"GenerationSettings: sampler must be a SamplerConfig or None; got "
                       f"{type(self.sampler).__name__}")
    if self.causal_attention is not None and not callable(self.causal_attention):
      raise ValueError(f"GenerationSettings: {self.causal_attention=} must be callable or None")

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(self.temperature, self.top_k, self.top_p)

  def replace(self, **changes) -> GenerationSettings:
    return dataclasses.replace(self, **changes)

  def attention_only(self) -> GenerationSettings:
    """These settings without the sampling fields (greedy, the default sampler): what a
    prefill program depends on, so that one program serves every sampling rule."""
    return GenerationSettings(impl=self.impl, config=self.config,
                              causal_attention=self.causal_attention)


# The keywords the entry points still take one by one (they map onto the settings).
SHORTHANDS = ("temperature", "top_k", "top_p", "impl")


def resolve(settings: Optional[GenerationSettings], where: str,
            **shorthands) -> GenerationSettings:
  """``settings`` (default ``GenerationSettings()``) with the keyword ``shorthands`` given
  (``temperature=0.7``, ``impl="xla"``, ...) applied; ``where`` names the caller in errors."""
  unknown = sorted(set(shorthands) - set(SHORTHANDS))
  if unknown:
    raise TypeError(f"{where}() got unexpected keyword arguments {unknown}")
  if settings is None:
    settings = GenerationSettings()
  elif not isinstance(settings, GenerationSettings):
    raise TypeError(f"{where}: settings must be a GenerationSettings; got "
                    f"{type(settings).__name__}")
  # None is a value for top_k and top_p (no filter), not for temperature and impl.
  given = {k: v for k, v in shorthands.items() if v is not None or k in ("top_k", "top_p")}
  return settings.replace(**given) if given else settings
