#!/usr/bin/env bash
# Device run: profiler-timed attention slice with kernel breakdowns, a profiled decode step
# (Llama-3-8B shape) by kernel category, and the native tests not yet re-run on a GPU.
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
hg() { python3 -c "from models.cli import main; import sys; sys.exit(main(sys.argv[1:]))" "$@"; }
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
timeout ${ATT_T:-200} python3 -m jax_shared_attn.bench attention --out "$out/att" --shapes ${SHAPES:-paper} \
  --batch ${BATCH:-16,256,1024} --prefix ${PREFIX:-4096,16384} --suffix 128 --trials 5 \
  --impls ${IMPLS:-ours,cudnn,xla} 2>&1 | filter > "$out/att.log"
python3 - "$out/att/attention.json" <<'PY' | tee "$out/att_breakdown.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(f"B={r['B']} P={r['P']} S={r['S']} floor={r['floor_us']:.1f} ours={r.get('ours_us')} wall={r.get('ours_wall_us')} cudnn={r.get('cudnn_us')} cudnn_wall={r.get('cudnn_wall_us')} xla={r.get('xla_us')} {r.get('timing')}")
    for k in r.get("ours_kernels", [])[:8]:
        print(f"   {k['us']:8.1f} us x{k['count']:.0f}  {k['name'][:90]}")
PY
if [ "${DECODE:-1}" = 1 ]; then
timeout ${DEC_T:-220} bash -c "$(declare -f hg); hg bench decode --model llama-3-8b --sweep batch --batch ${DBATCH:-1024,256} --prefix ${DPREFIX:-2048} --modes hydragen,none --new-tokens 16 --profile-steps 3 --out $out/dec --no-progress" 2>&1 | filter > "$out/dec.log"
python3 - "$out"/dec/*.json <<'PY' | tee "$out/dec_breakdown.txt"
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        p = r.get("profile")
        print(r["mode"], r["batch"], r["prefix"], "step_ms", r.get("step_ms"), "busy_ms", p and round(p["busy_us"] / 1e3, 3),
              {k: round(v / 1e3, 3) for k, v in (p or {}).get("by_category_us", {}).items()})
        for k in (p or {}).get("kernels", [])[:10]:
            print(f"   {k['us']:9.1f} us x{k['count']:.0f}  {k['name'][:90]}")
PY
fi
if [ "${TESTS:-1}" = 1 ]; then
timeout ${TEST_T:-150} python3 -m pytest -v -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py -k "Native and (segment or public_api)" 2>&1 | grep -i "passed\|failed\|error" | tail -15 > "$out/native.txt"
cat "$out/native.txt"
fi
