"""The oracle suite (``tests/family_suite.py``) once per kernel family.

``xla`` (the pure-JAX reference path), ``pallas:triton`` and ``pallas:tpu`` run everywhere
(off their platform the kernels run in Pallas interpret mode); ``pallas:mosaic_gpu`` has no
interpret mode and runs on a CUDA GPU only.
"""

import jax
import pytest

from family_suite import FamilySuite


class TestXla(FamilySuite):
  IMPL = "xla"


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
