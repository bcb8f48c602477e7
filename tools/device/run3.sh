#!/usr/bin/env bash
# Native tests (Triton + Mosaic), tuning sweep, attention benchmark slice.
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py -k "Native" 2>&1 | tail -15 > "$out/native_tests.txt"
tail -4 "$out/native_tests.txt"
timeout 200 python3 tools/device/tune.py mosaic suffix 2>&1 | grep -v "^[WE]1122\|bfc_alloc" > "$out/tune.txt"
cat "$out/tune.txt"
timeout 170 python3 -m jax_shared_attn.bench attention --out "$out" --batch 16,256,1024 --prefix 4096,16384 --suffix 128 --trials 5 --impls ours,triton,cudnn,jax_pallas_hydragen 2>&1 | grep -v "it/s\]$\|^[WE]1122\|bfc_alloc" | tail -22
