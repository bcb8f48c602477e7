"""Hypothesis strategies and input builders shared by the attention tests.

Compiling a new shape costs ~0.7 s on a CPU, so static shapes come from
curated lists that together cover every head_dim (64, 80, 128, 256), every
GQA ratio G in {1, 2, 3, 4, 8}, empty buffers, Tq > suffix length, and
non-multiples of any block size, while everything that is a runtime array
(lengths, tree assignments, values) is drawn freely.
"""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from jax_shared_attn import SharedLevel
from jax_shared_attn.testing import check_attention

DTYPES = ("float32", "bfloat16", "float16")
SEEDS = st.integers(0, 2**31 - 1)

CASES = collections.Counter()

# The tests' small programs (interpreted Pallas kernels, the attention API at test sizes) are
# compiled once per drawn shape or static choice and run briefly: on the CPU, LLVM -O0 for them,
# unless HYDRAGEN_TEST_FAST_COMPILE=0 (conftest.py keeps -O1 for the rest, where the SmolLM2
# tests run 2-3x slower at -O0). The flat Triton kernel's cases 1 and 3: 18.3 -> 15.0 s on the
# 2-core CPU (2026-11-28).
SMALL_PROGRAM_OPTIONS = (
    {"xla_backend_optimization_level": 0}
    if os.environ.get("HYDRAGEN_TEST_FAST_COMPILE", "1") != "0" else None)


# XLA_FLAGS of the 8-CPU-device subprocesses (mesh tests): 8 host devices, fast CPU compiles
# (LLVM -O0: the programs are tiny, compiling dominates).
DEVICE_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                "--xla_llvm_disable_expensive_passes=true")


def small_jit(fun, small: bool = True, **jit_kwargs):
  """``jax.jit(fun, **jit_kwargs)``, compiled with :data:`SMALL_PROGRAM_OPTIONS` on the CPU where
  ``small`` (native kernels and other backends keep XLA's defaults)."""
  if small and SMALL_PROGRAM_OPTIONS and jax.default_backend() == "cpu":
    jit_kwargs["compiler_options"] = SMALL_PROGRAM_OPTIONS
  return jax.jit(fun, **jit_kwargs)


def count_case(name: str) -> None:
  """Records one generated property-test case (the total is printed at the end of the run)."""
  CASES[name] += 1


# (B, Tq, Hq, Hkv, D, P, S): P = prefix capacity, S = suffix capacity.
PREFIX_SHAPES = (
    (1, 1, 1, 1, 64, 17, 5),
    (4, 1, 8, 1, 128, 40, 9),
    (3, 2, 4, 2, 80, 23, 6),
    (2, 3, 6, 2, 256, 13, 4),
    (5, 1, 4, 1, 64, 0, 7),
    (4, 2, 8, 2, 128, 31, 0),
    (2, 4, 16, 2, 64, 9, 11),
    (1, 5, 2, 2, 128, 1, 3),
)

# (B, Tq, Hq, Hkv, D, Tk)
FULL_SHAPES = (
    (1, 1, 1, 1, 64, 7),
    (3, 1, 8, 1, 128, 33),
    (2, 3, 4, 2, 80, 12),
    (4, 2, 6, 2, 256, 5),
    (2, 4, 16, 2, 64, 0),
    (5, 5, 4, 1, 128, 9),
    (1, 2, 8, 4, 64, 1),
)

# ((B, Tq, Hq, Hkv, D, S), levels as ((N, T), ...))
TREE_SHAPES = (
    ((3, 1, 4, 1, 64, 5), ()),
    ((4, 1, 8, 1, 128, 6), ((1, 9),)),
    ((6, 2, 4, 2, 80, 4), ((1, 12), (3, 5))),
    ((5, 1, 6, 2, 256, 3), ((2, 6), (4, 3), (3, 2))),
    ((7, 3, 16, 2, 64, 0), ((4, 7),)),
    ((2, 1, 2, 2, 128, 8), ((3, 1), (1, 4))),
)


def rand(rng, shape, dtype, scale=1.0):
  """Normal random array in ``dtype`` (as a jnp array) and its exact float64 value."""
  # Rounded in NumPy (ml_dtypes: round to nearest even, as XLA's convert): a jnp conversion
  # would compile a program for every new shape.
  x = np.asarray(rng.normal(size=shape) * scale, np.float32).astype(jnp.dtype(dtype))
  return jnp.asarray(x), x.astype(np.float64)


def lengths(draw, b, cap):
  """int32 [b] lengths in [0, cap], biased toward the edges 0, 1 and cap."""
  edge = st.sampled_from(sorted({0, min(1, cap), cap}))
  return np.array([draw(st.one_of(edge, st.integers(0, cap))) for _ in range(b)], np.int32)


def random_tree(draw, rng, b, hkv, d, dtype, structure):
  """Levels of the given (N, T) structure with random lengths and assignments (-1 = no segment
  at that level, so fan-out is uneven), and each sequence's float64 segments in level order."""
  levels, seg_k, seg_v = [], [[] for _ in range(b)], [[] for _ in range(b)]
  for n, t in structure:
    k, k64 = rand(rng, (n, t, hkv, d), dtype)
    v, v64 = rand(rng, (n, t, hkv, d), dtype)
    lens = lengths(draw, n, t)
    nodes = np.array([draw(st.integers(-1, n - 1)) for _ in range(b)], np.int32)
    levels.append(SharedLevel(k, v, jnp.asarray(lens), jnp.asarray(nodes)))
    for i, node in enumerate(nodes):
      if node >= 0:
        seg_k[i].append(k64[node, :lens[node]])
        seg_v[i].append(v64[node, :lens[node]])
  return levels, seg_k, seg_v


def assert_close(out, lse, ref_out, ref_lse, dtype):
  """``out`` (every sequence, no NaN) and the LSE within the input dtype's tolerances of the
  float64 oracle (:func:`jax_shared_attn.testing.check_attention`)."""
  check_attention(out, lse, ref_out, ref_lse, dtype)
