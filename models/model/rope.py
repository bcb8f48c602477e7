"""Rotary position embeddings (RoPE) in the Hugging Face "rotate half" layout.

Head dimension ``i < D/2`` is paired with ``i + D/2`` and the pair is rotated
by ``position * inv_freq[i]``. Meta's original checkpoints (and GGUF files)
pair adjacent dimensions instead; their q/k projection rows are permuted on
loading (:mod:`models.checkpoints.loading`) so that this one layout serves every format.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.model.config import LlamaConfig, RopeScaling


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
  """float32 ``[D/2]``: ``theta ** (-2i / D)``, scaled as the config says.

  Computed in float64 on the host (then rounded once), so it is a constant
  of the compiled program.
  """
  d = config.head_dim
  inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  if config.rope_scaling is not None:
    inv_freq = _scale(inv_freq, config.rope_scaling)
  if config.rope_freq_factors is not None:
    inv_freq = inv_freq / np.asarray(config.rope_freq_factors, np.float64)
  return inv_freq.astype(np.float32)


def _scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
  if s.kind == "linear":
    return inv_freq / s.factor
  # llama3 (Llama 3.1 paper, and transformers' _compute_llama3_parameters):
  # long wavelengths are interpolated by `factor`, short ones kept, the band
  # between blended linearly in (context / wavelength).
  old = s.original_max_position_embeddings
  low_freq_wavelen = old / s.low_freq_factor
  high_freq_wavelen = old / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  blended = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(medium, blended, scaled)


def apply_rope(
    x: jax.Array,  # [B, T, H, D]
    positions: jax.Array,  # int32 [B, T]: absolute position of each token
    inv_freq: np.ndarray,  # float32 [D/2]
) -> jax.Array:
  """Rotates each (i, i + D/2) pair by ``positions * inv_freq[i]``; returns x's dtype.

  The angles, cos and sin are float32 whatever x's dtype is (positions up to
  ~1e5 keep ~1e-3 rad accuracy in float32, as in transformers).
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, D/2]: broadcast over heads
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
