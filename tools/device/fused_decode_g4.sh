#!/usr/bin/env bash
# Device run: Llama-3-8B decode (batch 1024) with the one kernel forced on at G = 4, with 16- and
# 8-key suffix chunks, against the kernels apart and the no-attention ceiling, in one run.
# Usage: bash tools/device/fused_decode_g4.sh $OUT
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
V="python3 tools/device/fused_variant.py"
A="decode --model llama-3-8b --sweep prefix --batch 1024 --prefix ${PREFIX:-2048,4096} --profile-steps 2 --no-progress"
timeout ${T:-170} $V --max-waste 16 -- $A --modes hydragen --out "$out/c16" 2>&1 | filter > "$out/c16.log"
timeout ${T:-170} $V --max-waste 16 --block-s 8 -- $A --modes hydragen --out "$out/c8" 2>&1 | filter > "$out/c8.log"
timeout ${T:-170} $V -- $A --modes hydragen,none --out "$out/split" 2>&1 | filter > "$out/split.log"
python3 - "$out"/*/decode_*.json <<'PY' | tee "$out/summary.txt"
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        p = r.get("profile") or {}
        cats = {k: round(v / 1e3, 2) for k, v in (p.get("by_category_us") or {}).items()}
        print(path.split('/')[-2], r["mode"], r["batch"], r["prefix"], r.get("tokens_per_s"),
              "busy_ms", round(p.get("busy_us", 0) / 1e3, 2), cats)
        for k in (p.get("kernels") or [])[:5]:
            print(f"     {k['us']:9.1f} us x{k['count']:.0f}  {k['name'][:80]}")
PY
