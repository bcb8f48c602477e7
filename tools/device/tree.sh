#!/usr/bin/env bash
# H100: hierarchical sharing benchmark (issue 9, paper Sec. 4.4 / Fig. 7), Llama-3-8B shape,
# random bf16 weights, reduced: 16 problems x 128 samples, 256 new tokens.
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${TREE_TIMEOUT:-560} python3 -c "from models.cli import main; import sys; sys.exit(main(sys.argv[1:]))" \
  bench tree --model llama-3-8b --shots 2400 --problems 16 --samples 128 --new-tokens 256 \
  --batch ${TREE_BATCH:-1,4} --out "$out" --no-progress 2>&1 \
  | grep -v "^[WE]11\|bfc_alloc\|Allocator\|allocation summary\|fragmentation\|Current alloc" | tee "$out/tree_log.txt" | grep -v "^{"
