#!/usr/bin/env bash
# Device run: native kernel tests, then the attention benchmark. Usage (on the GPU machine):
#   bash tools/device/attention.sh <out-dir> [benchmark args...]
set -uo pipefail
out=${1:?out dir}; shift
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py -k Native \
    2>&1 | tail -25 | tee "$out/native_tests.txt"
fi
python3 -m jax_shared_attn.bench attention --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v "it/s\]$" | tail -40
