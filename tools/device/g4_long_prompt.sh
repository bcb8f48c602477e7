#!/usr/bin/env bash
# Device run: is the one-kernel decode path worth it at G = 4 (Llama-3-8B) when the shared prompt
# is long? Decode A/B (the one kernel forced on with --max-waste 16, then the default --max-waste 8,
# kernels apart; separate processes, batch 1024, PREFIX prompts), then the attention
# microbenchmark with the one kernel on: `ours` is the one kernel, `split` the kernels apart.
# Usage: bash tools/device/g4_long_prompt.sh $OUT
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt"
if [ "${DECODE:-1}" = 1 ]; then
  TESTS=0 PREFIX=${PREFIX:-4096,8192,16384} VARIANTS="${VARIANTS:---max-waste 16;--max-waste 8}" T=${T:-220} \
    bash tools/device/fused_decode_g4.sh "$out"
fi
if [ "${ATTN:-1}" = 1 ]; then
  timeout ${AT:-300} python3 tools/device/fused_variant.py --max-waste 16 -- attention \
    --shapes llama-3-8b --prefix ${APREFIX:-4096,16384} --batch ${ABATCH:-256,1024} --suffix 128,512 \
    --impls ours,split --trials 5 --out "$out/attention" 2>&1 | grep -v "it/s\]$" | tail -14
fi
