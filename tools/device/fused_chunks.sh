#!/usr/bin/env bash
# Device run for the packed suffix chunks of the one-kernel decode path: native tests, then the
# attention benchmark at G = 4 (forced: --max-waste 16) with 16- and 8-key chunks against the
# kernels apart, and the paper shape with the defaults. Usage: bash tools/device/fused_chunks.sh $OUT
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
V="python3 tools/device/fused_variant.py"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_T:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TEST_K:-FusedDecode}" 2>&1 | tail -25 | tee "$out/tests.log"
fi
L="--shapes llama-3-8b --batch 64,1024 --prefix 1024,4096 --suffix 128 --trials 3"
timeout 150 $V --max-waste 16 -- attention $L --impls ours,split --out "$out/g4_c16" 2>&1 | filter > "$out/att.log"
timeout 100 $V --max-waste 16 --block-s 8 -- attention $L --impls ours --out "$out/g4_c8" 2>&1 | filter >> "$out/att.log"
timeout 120 python3 -m jax_shared_attn.bench attention --shapes paper --batch 16,1024 --prefix 1024,16384 \
  --suffix 128 --trials 3 --impls ours,split --out "$out/paper" 2>&1 | filter >> "$out/att.log"
tail -5 "$out/att.log"
python3 - "$out"/*/attention.json <<'PY' | tee "$out/summary.txt"
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    for r in d["rows"]:
        f = lambda k: (f"{r[k]:.1f}" if isinstance(r.get(k), float) else str(r.get(k)))
        print(f"{path.split('/')[-2]:7s} Hq={r['Hq']} B={r['B']} P={r['P']} S={r['S']} floor={f('floor_us')} "
              f"ours={f('ours_us')} split={f('split_us')} roof={f('roofline')}")
PY
