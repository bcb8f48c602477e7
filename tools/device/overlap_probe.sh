# The overlapped Mosaic prefix kernel on the GPU machine: native tests, ptxas report, timing.
# Usage (repository root): bash tools/device/overlap_probe.sh  (writes under $OUT)
export PYTHONPATH=.
timeout 200 python3 -m pytest -q -x tests/test_pallas_gpu_kernels.py -k "test_prefix_kernel_configs" \
  -p no:cacheprovider > $OUT/native.log 2>&1; tail -4 $OUT/native.log
MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 tools/device/overlap.py --out $OUT \
  --specs paper:1024:16384 --trials 3 > $OUT/dump.log 2>&1
grep "C7512\|spill stores,\|Used [0-9]* registers" $OUT/dump.log | uniq -c | cut -c1-150
tail -3 $OUT/dump.log
timeout 220 python3 tools/device/overlap.py --out $OUT \
  --specs paper:1024:16384,paper:256:4096,llama:1024:16384,llama:256:4096 2>&1 | tail -8
