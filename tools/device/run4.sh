#!/usr/bin/env bash
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py -k "NativeMosaic" 2>&1 | tail -15 > "$out/mosaic_tests.txt"
tail -3 "$out/mosaic_tests.txt"
timeout 380 python3 tools/device/tune.py suffix mosaic 2>&1 | grep -v "^[WE]1122\|bfc_alloc" | tee "$out/tune.txt" | grep -v "^  "
