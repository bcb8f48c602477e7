#!/bin/bash
# Device run: the one kernel's split sharing at several suffix-step costs (attention, one
# process), then the one-kernel native oracle tests at the default and a non-default cost.
# Usage (on the GPU machine): bash tools/device/split_balance.sh $OUT
set -u
OUT=${1:?out dir}
export PYTHONPATH=.:tools/device
VARIANTS=${VARIANTS:-cost4,cost2,cost3,cost6}
CONFIGS=${CONFIGS:-paper:1024:16384:128,paper:1024:16384:512,paper:256:16384:128,paper:1024:4096:128,paper:256:4096:128,paper:1024:1024:128}
if [ "${SWEEP:-1}" = 1 ]; then
  timeout ${SWEEP_S:-330} python3 tools/device/split_balance.py attention --variants "$VARIANTS" \
    --configs "$CONFIGS" --ceilings 2.74e12 7.35e14 --out "$OUT" > "$OUT/split_balance.log" 2>&1
  echo "sweep rc=$?"
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TESTS_S:-220} python3 -m pytest -q -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TESTS_K:-TestNativeFusedDecode and not Transposed}" > "$OUT/native_tests.log" 2>&1
  echo "tests rc=$?"
  tail -3 "$OUT/native_tests.log"
fi
grep -A20 "^| shape" "$OUT/split_balance.log" 2>/dev/null
