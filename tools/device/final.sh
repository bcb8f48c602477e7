#!/usr/bin/env bash
# Last device run of the session: decode Figures 1 and 4 (Llama-3-8B shape), and the
# attention sweep for the Llama-3-8B head shape (reduced). Each part has its own cap.
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
hg() { python3 -c "from models.cli import main; import sys; sys.exit(main(sys.argv[1:]))" "$@"; }
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
timeout 150 bash -c "$(declare -f hg); hg bench decode --model llama-3-8b --sweep batch --batch 1024,256,64 --out $out --no-progress" 2>&1 | filter | grep "^|" > "$out/fig1.txt"; cat "$out/fig1.txt"
timeout 200 bash -c "$(declare -f hg); hg bench decode --model llama-3-8b --sweep prefix --prefix 1024,4096,16384 --modes hydragen,none --out $out --no-progress" 2>&1 | filter | grep "^|" > "$out/fig4.txt"; cat "$out/fig4.txt"
timeout 190 python3 -m jax_shared_attn.bench attention --out "$out" --shapes llama-3-8b --batch 16,256,1024 --prefix 1024,16384 --suffix 128,512 --trials 5 --impls ours,cudnn,pallas_decode,xla 2>&1 | filter | grep "^|\|Device" | tail -16
