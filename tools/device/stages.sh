#!/usr/bin/env bash
# Device run: two or three K/V slots in flight in the Mosaic GPU kernels. Native oracle tests
# of the three-slot kernels (and the shipped ones), then tools/device/stages.py on the paper
# shape (SPECS) and the Llama-3-8B shape (LSPECS). Usage: bash tools/device/stages.sh $OUT
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|Allocator\|allocation summary\|fragmentation\|^If this\|Current alloc"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_T:-260} python3 -m pytest -v -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TEST_K:-ThreeStages or prefix_kernel_configs or (TestNativeFusedDecode and not Transposed and not Spread and not Equal)}" \
    2>&1 | grep -E "PASS|FAIL|ERROR|passed|failed|Timeout|Error" | tail -40 | tee "$out/tests.log"
fi
if [ -n "${SPECS-x}" ]; then
  timeout ${ATT_T:-300} python3 tools/device/stages.py --out "$out" --name stages_paper \
    ${SPECS:+--specs $SPECS} --ops ${OPS:-s2,s3} 2>&1 | filter | tail -16 | tee "$out/paper.log"
fi
if [ -n "${LSPECS:-}" ]; then
  timeout ${LATT_T:-300} python3 tools/device/stages.py --out "$out" --name stages_llama \
    --specs $LSPECS --ops ${LOPS:-s2,s3,s3n,g4s3} 2>&1 | filter | tail -12 | tee "$out/llama.log"
fi
