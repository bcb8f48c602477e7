"""The oracle suite (``tests/family_suite.py``) once per kernel family.

``xla`` (pure JAX: once with its default tiles, once with tiny ones), ``pallas:triton`` and ``pallas:tpu`` run everywhere
(off their platform the kernels run in Pallas interpret mode); ``pallas:mosaic_gpu`` has no
interpret mode and runs on a CUDA GPU only.
"""

import jax
import pytest

from family_suite import FamilySuite
from jax_shared_attn import XlaConfig


class TestXla(FamilySuite):
  IMPL = "xla"


class TestXlaTiles(FamilySuite):
  """The XLA family on tiles far smaller than the cases: many row and key blocks, partial and
  moved-back last blocks, blocks of several sequences (decoding) and of part of one."""
  IMPL = "xla"
  CONFIG = XlaConfig(block_rows=3, block_keys=5)
  EXAMPLES = dict(prefix=12, tree=10, full=6, primitive=3, paged=6)


class TestTriton(FamilySuite):
  IMPL = "pallas:triton"
  EXAMPLES = dict(prefix=8, tree=6, full=4, primitive=3, paged=5)  # interpreted: fewer cases


@pytest.mark.skipif(jax.default_backend() not in ("cpu", "tpu"),
                    reason="the TPU kernels run on a TPU, or interpreted on a CPU")
class TestTpu(FamilySuite):
  IMPL = "pallas:tpu"


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU runs on a CUDA GPU only")
class TestMosaicGpu(FamilySuite):
  IMPL = "pallas:mosaic_gpu"
