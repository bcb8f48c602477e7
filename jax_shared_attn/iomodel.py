"""Bytes and FLOPs of one attention call: the floors that benchmarks compare against.

The IO model follows RelayAttention (Eq. 10) and Hydragen Sec. 3.4: per-sequence
attention reads every sequence's whole context, ``B * (P + S)`` tokens of K/V;
shared-prefix attention reads the prefix once and each suffix once,
``P + B * S`` tokens. FLOPs are the same for both (two matrix products,
``QK^T`` and ``PV``, 2 FLOPs per multiply-add), but only the batched prefix
product can run on the matrix units at full rate.

The floor of a kernel is ``max(bytes / bandwidth, flops / matmul_rate)`` with
both ceilings measured on the device in the same run.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """One decode (or chunked-prefill) attention call with a shared prefix."""

  batch: int  # B sequences
  prefix: int  # P shared tokens
  suffix: int  # S own tokens per sequence (all valid)
  q_heads: int  # Hq
  kv_heads: int  # Hkv
  head_dim: int  # D
  q_len: int = 1  # Tq
  itemsize: int = 2  # bytes per element of q, k, v, out (bf16: 2)

  @property
  def _kv_token_bytes(self) -> int:  # K and V of one token, all KV heads
    return 2 * self.kv_heads * self.head_dim * self.itemsize

  @property
  def _q_out_bytes(self) -> int:  # read q, write out
    return 2 * self.batch * self.q_len * self.q_heads * self.head_dim * self.itemsize

  def shared_bytes(self) -> int:
    """Fewest bytes shared-prefix attention must move: prefix once, suffixes once, q, out."""
    return (self.prefix + self.batch * self.suffix) * self._kv_token_bytes + self._q_out_bytes

  def per_sequence_bytes(self) -> int:
    """Bytes of per-sequence attention: every sequence reads prefix and suffix."""
    return self.batch * (self.prefix + self.suffix) * self._kv_token_bytes + self._q_out_bytes

  def flops(self) -> int:
    """2 FLOPs per multiply-add, ``QK^T`` and ``PV`` over the whole context."""
    return 4 * self.batch * self.q_len * self.q_heads * (self.prefix + self.suffix) * self.head_dim

  def prefix_flops(self) -> int:
    return 4 * self.batch * self.q_len * self.q_heads * self.prefix * self.head_dim

  def floor_s(self, bandwidth: float, matmul_rate: float) -> float:
    """Floor of shared-prefix attention in seconds: bytes/bandwidth vs FLOPs/matmul rate."""
    return max(self.shared_bytes() / bandwidth, self.flops() / matmul_rate)

  def per_sequence_floor_s(self, bandwidth: float, matmul_rate: float) -> float:
    return max(self.per_sequence_bytes() / bandwidth, self.flops() / matmul_rate)

  def read_saving(self) -> float:
    """How many times fewer bytes shared-prefix attention moves than per-sequence attention."""
    return self.per_sequence_bytes() / self.shared_bytes()
