#!/usr/bin/env bash
# Device run: mixed suffix steps in the one kernel (FusedConfig.mixed_suffix). Native oracle tests
# of the mixed kernel, then tools/device/stages.py A/B (shipped vs mixed) on the paper shape.
# Usage: bash tools/device/mixed.sh $OUT   (TESTS=0 skips the tests; SPECS, OPS, SUFFIX_LENGTH)
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|Allocator\|allocation summary\|fragmentation\|^If this\|Current alloc"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
if [ "${PTXAS:-0}" = 1 ]; then  # registers, spills and wgmma serialisation of both kernels
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 tools/device/stages.py --out "$out" --name ptxas \
    --specs paper:1024:16384:128 --ops ${OPS:-s2,mx} --trials 1 > "$out/ptxas_dump.log" 2>&1
  grep "C7512\|spill stores,\|Used [0-9]* registers" "$out/ptxas_dump.log" | uniq -c | cut -c1-150 \
    | tee "$out/ptxas.txt"
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_T:-280} python3 -m pytest -v -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TEST_K:-TestNativeFusedDecodeMixed}" \
    2>&1 | grep -E "PASS|FAIL|ERROR|passed|failed|Timeout|Error|error" | tail -40 | tee "$out/tests.log"
fi
if [ -n "${SPECS-x}" ]; then
  timeout ${ATT_T:-280} python3 tools/device/stages.py --out "$out" --name ${NAME:-mixed_paper} \
    ${SPECS:+--specs $SPECS} --ops ${OPS:-s2,mx} ${SUFFIX_LENGTH:+--suffix-length $SUFFIX_LENGTH} \
    ${RAGGED:+--ragged} 2>&1 | filter | tail -16 | tee "$out/paper.log"
fi
