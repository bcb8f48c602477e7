#!/usr/bin/env bash
# Device runs for the two opt-in paths written without a device on 2026-11-23 (stop 18):
# the one kernel's transposed suffix steps and the flat path's sequence-major rows.
#   STAGE=check  bash tools/device/transposed.sh $OUT   # native oracle tests, then attention
#                                                       # (transposed vs shipped vs split) and
#                                                       # the flat layouts (~8 min)
#   STAGE=decode bash tools/device/transposed.sh $OUT   # Llama-3-8B decode, switch off / on
# Outcome (H100, 2026-11-23, docs/results/2026-11-23-h100-switches): both pass their native
# tests; FLAT_SEQUENCE_MAJOR became the default, TRANSPOSED_SUFFIX stays off (slower at 4 of 5
# shapes). `python3 tools/device/transposed.py trace` prints a compile failure's whole traceback.
set -uo pipefail
out=${1:?out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
quiet() { grep -v "^WARNING\|^[WE]11\|it/s\]$"; }
if [ "${STAGE:-check}" = check ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_gpu_kernels.py \
    -k "FusedDecode or (TestNative and flat) or (TestNative and public_api)" 2>&1 | tail -25 \
    | tee "$out/tests.log"
  timeout 200 python3 tools/device/transposed.py attention --out "$out" --ceilings 2.74e12 7.3e14 \
    2>&1 | quiet | tee "$out/attention.log" | tail -10
  timeout 100 python3 tools/device/flat_tune.py --shape llama-3-8b --batch 16 --prefix 1024 \
    --suffix 128,512 --variants flat_head,flat_seq,off --trials 5 --out "$out" 2>&1 | quiet \
    | tee "$out/flat.log" | tail -5
else
  for t in 0 1; do
    timeout 280 python3 tools/device/transposed.py decode --transposed $t --out "$out" \
      2>&1 | quiet | grep "^{" | tee -a "$out/decode.log" \
      | python3 -c "import json,sys
for l in sys.stdin:
  r=json.loads(l); print(r['transposed'], r['batch'], r['prefix'], round(r.get('tokens_per_s',0)) if isinstance(r.get('tokens_per_s'),float) else r.get('tokens_per_s'))"
  done
fi
