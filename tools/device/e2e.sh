#!/usr/bin/env bash
# Device run: decode Figures 1 and 4 (Llama-3-8B shape, 128 new tokens, the full sweeps) with a
# profiled device-time breakdown per step (--profile-steps), then the native public-API test.
# Each figure takes 3-4 minutes on an H100; run them in separate calls (FIG1=0 / FIG4=0,
# TESTS=0) to stay within a 10-minute call.
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
hg() { python3 -c "from models.cli import main; import sys; sys.exit(main(sys.argv[1:]))" "$@"; }
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
if [ "${FIG1:-1}" = 1 ]; then
timeout ${FIG1_T:-560} bash -c "$(declare -f hg); hg bench decode --model llama-3-8b --sweep batch --batch ${FIG1_B:-1024,512,256,128,64,32} --profile-steps 2 --out $out --no-progress" 2>&1 | filter > "$out/fig1.log"
sed -n '/^llama/,$p' "$out/decode_llama-3-8b_batch.md" 2>/dev/null | grep "^|" | cut -c1-160
fi
if [ "${FIG4:-1}" = 1 ]; then
timeout ${FIG4_T:-560} bash -c "$(declare -f hg); hg bench decode --model llama-3-8b --sweep prefix --prefix ${FIG4_P:-1024,2048,4096,8192,16384} --modes hydragen,none --profile-steps 2 --out $out --no-progress" 2>&1 | filter > "$out/fig4.log"
grep "^|" "$out/decode_llama-3-8b_prefix.md" 2>/dev/null | cut -c1-160
fi
python3 - "$out"/decode_*.json <<'PY' > "$out/kernels.txt"
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        p = r.get("profile")
        if not p: continue
        print(r["mode"], r["batch"], r["prefix"], "busy_ms", round(p["busy_us"] / 1e3, 3))
        for k in p["kernels"][:12]:
            print(f"   {k['us']:9.1f} us x{k['count']:.0f}  {k['name'][:90]}")
PY
if [ "${TESTS:-1}" = 1 ]; then
timeout ${TEST_T:-120} python3 -m pytest -v -p no:cacheprovider tests/test_pallas_gpu_kernels.py -k "public_api" 2>&1 | grep -i "passed\|failed\|error" | tail -8 | tee "$out/native.txt"
fi
