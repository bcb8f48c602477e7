#!/usr/bin/env bash
# Device run for the split-merge kernel (pallas_kernels/gpu/merge_kernel.py): native tests of
# every kernel that now merges through it, the merge A/B (tools/device/merge_tune.py), then the
# attention benchmark. Usage: bash tools/device/merge_run.sh $OUT [tests|tune|bench|all]
set -uo pipefail
out=${1:?out}
what=${2:-all}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
filter() { grep -v "it/s\]$\|^[WE]11\|bfc_alloc\|^ \|Allocator\|allocation summary\|^\*\|fragmentation\|^If this\|Current alloc"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_T:-300} python3 -m pytest -q -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "${TEST_K:-TestNative}" 2>&1 | tail -30 | tee "$out/native_tests.log"
fi
if [ "$what" = tune ] || [ "$what" = all ]; then
  timeout ${TUNE_T:-240} python3 tools/device/merge_tune.py --out "$out" ${TUNE_ARGS:-} 2>&1 | filter | tee "$out/merge_tune.log" | tail -30
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${ATT_T:-420} python3 -m jax_shared_attn.bench attention --out "$out/att_paper" --shapes paper \
    --batch ${BATCH:-16,64,256,1024} --prefix ${PREFIX:-1024,4096,16384} --suffix ${SUFFIX:-128,512} \
    --trials 5 --impls ${IMPLS:-ours,split,cudnn,pallas_decode} 2>&1 | filter > "$out/att.log"
  python3 - "$out"/att_paper/attention.json <<'PY' | tee "$out/summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
print(d["info"])
for r in d["rows"]:
    f = lambda k: (f"{r[k]:.1f}" if isinstance(r.get(k), float) else str(r.get(k)))
    print(f"B={r['B']} P={r['P']} S={r['S']} floor={f('floor_us')} ours={f('ours_us')} split={f('split_us')} "
          f"cudnn={f('cudnn_us')} pd={f('pallas_decode_us')} roof={f('roofline')} x={f('speedup_vs_best_per_seq')}")
PY
fi
