#!/usr/bin/env bash
# Device run: the suffix warpgroup (FusedConfig.suffix_wg). Native oracle tests, ptxas register
# and spill report, then tools/device/stages.py A/B against the shipped kernel (full suffixes
# and, with SPECS0, empty ones). Usage: bash tools/device/side_wg.sh $OUT
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|Allocator\|allocation summary\|fragmentation\|^If this\|Current alloc"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_T:-240} python3 -m pytest -v -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TEST_K:-TestNativeFusedDecodeSuffixWarpgroup}" 2>&1 \
    | grep -E "PASS|FAIL|ERROR|passed|failed|Timeout|Error|error|assert" | tail -40 | tee "$out/tests.log"
fi
if [ "${PTXAS:-1}" = 1 ]; then
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 tools/device/stages.py --out "$out/ptxas" --name ptxas \
    --specs paper:1024:16384:128 --ops s2,sw${PTXAS_OPS:-} --trials 1 > "$out/ptxas_full.log" 2>&1
  grep -i -E "spill|Used [0-9]+ registers|registers|error" "$out/ptxas_full.log" | sort | uniq -c | head -30 | tee "$out/ptxas.log"
fi
if [ -n "${SPECS-x}" ]; then
  timeout ${ATT_T:-200} python3 tools/device/stages.py --out "$out" --name side_full \
    ${SPECS:+--specs $SPECS} --ops ${OPS:-s2,sw} 2>&1 | filter | tail -16 | tee "$out/full.log"
fi
if [ -n "${SPECS0:-}" ]; then
  timeout ${ATT0_T:-120} python3 tools/device/stages.py --out "$out" --name side_empty \
    --specs $SPECS0 --ops ${OPS0:-s2,sw} --suffix-length 0 2>&1 | filter | tail -8 | tee "$out/empty.log"
fi
