#!/usr/bin/env bash
# Device run: the key splits merged inside the one kernel (CLUSTER_MERGE). Native tests of the
# cluster path, then timings against the shipped path (merge kernel after the kernel).
#   bash tools/device/cluster_merge.sh <out-dir> [specs]
set -uo pipefail
out=${1:?out dir}
specs=${2:-paper:1024:16384:128,paper:1024:16384:512,paper:1024:4096:128,paper:512:4096:128,paper:512:16384:128,paper:256:4096:128}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "TestNativeFusedDecode and not Paired and not Transposed and not ThreeStages and not Spread" 2>&1 | tail -15 | tee "$out/native_tests.log"
fi
timeout 240 python3 tools/device/stages.py --out "$out" --name cluster_a --specs "$specs" \
  --ops s2,cm,cmtk --trials 5 2>&1 | grep -v "^{" | tail -9
