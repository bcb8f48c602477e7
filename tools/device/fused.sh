#!/usr/bin/env bash
# Device run for the one-kernel decode path (prefix + suffixes in one Mosaic GPU kernel):
# native tests against the oracle, then the attention benchmark with "ours" (fused) and
# "split" (the two kernels apart) side by side. Usage: bash tools/device/fused.sh $OUT [quick]
set -uo pipefail
out=${1:?out}
mode=${2:-quick}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_T:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TEST_K:-FusedDecode or NativeMosaic}" 2>&1 | tail -25 | tee "$out/tests.log"
fi
if [ "$mode" = quick ]; then
  timeout ${ATT_T:-200} python3 -m jax_shared_attn.bench attention --out "$out/att_paper" --shapes paper \
    --batch 16,1024 --prefix 1024,16384 --suffix 128 --trials 3 --impls ours,split 2>&1 | filter > "$out/att.log"
  timeout ${ATT_T:-200} python3 -m jax_shared_attn.bench attention --out "$out/att_llama" --shapes llama-3-8b \
    --batch 1024 --prefix 1024 --suffix 128 --trials 3 --impls ours,split 2>&1 | filter >> "$out/att.log"
else
  timeout ${ATT_T:-420} python3 -m jax_shared_attn.bench attention --out "$out/att_paper" --shapes paper \
    --batch 16,64,256,1024 --prefix 1024,4096,16384 --suffix 128,512 --trials 5 \
    --impls ${IMPLS:-ours,split,cudnn,pallas_decode} 2>&1 | filter > "$out/att.log"
fi
python3 - "$out"/att_*/attention.json <<'PY' | tee "$out/summary.txt"
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    for r in d["rows"]:
        f = lambda k: (f"{r[k]:.1f}" if isinstance(r.get(k), float) else str(r.get(k)))
        print(f"Hq={r['Hq']} B={r['B']} P={r['P']} S={r['S']} floor={f('floor_us')} ours={f('ours_us')} "
              f"split={f('split_us')} cudnn={f('cudnn_us')} roof={f('roofline')} err_split={r.get('err_split')}")
        for k in r.get("ours_kernels", [])[:4]:
            print(f"   {k['us']:8.1f} us x{k['count']:.2f}  {k['name'][:70]}")
PY
