#!/usr/bin/env bash
# Device run: native tests of the one kernel, then Llama-3-8B decode (batch 1024) with the one
# kernel forced on at G = 4 (--max-waste 16) in variants (VARIANTS: ";"-separated flag sets of
# tools/device/fused_variant.py), and optionally the kernels apart with the no-attention ceiling.
# Usage: bash tools/device/fused_decode_g4.sh $OUT
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
V="python3 tools/device/fused_variant.py"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_T:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TEST_K:-FusedDecode}" 2>&1 | tail -4 | tee "$out/tests.log"
fi
A="decode --model llama-3-8b --sweep prefix --batch ${BATCH:-1024} --prefix ${PREFIX:-2048,4096} --new-tokens ${NEW:-128} --profile-steps 2 --no-progress"
IFS=';' read -ra vs <<< "${VARIANTS:---max-waste 16}"
n=0
for v in "${vs[@]}"; do
  n=$((n+1))
  echo "v$n: $v" >> "$out/variants.txt"
  timeout ${T:-150} $V $v -- $A --modes hydragen --out "$out/v$n" 2>&1 | filter > "$out/v$n.log"
done
if [ "${SPLIT:-0}" = 1 ]; then
  timeout ${T:-170} $V -- $A --modes hydragen,none --out "$out/split" 2>&1 | filter > "$out/split.log"
fi
cat "$out/variants.txt"
python3 - "$out"/*/decode_*.json <<'PY' | tee "$out/summary.txt"
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        p = r.get("profile") or {}
        cats = {k: round(v / 1e3, 2) for k, v in (p.get("by_category_us") or {}).items()}
        print(path.split('/')[-2], r["mode"], r["batch"], r["prefix"], r.get("tokens_per_s"),
              "busy_ms", round(p.get("busy_us", 0) / 1e3, 2), cats)
PY
