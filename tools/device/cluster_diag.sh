#!/usr/bin/env bash
# Where does the cluster-merged one kernel's extra time go? (device run; writes under $OUT)
#   bash tools/device/cluster_diag.sh
# 1. ptxas register / spill report of the shipped and the cluster-merged kernel (headline shape);
# 2. shipped vs cluster merge (cm) vs cluster merge + lengths in the kernel (cmtk), full and ragged
#    suffixes; 3. the cluster launch alone (patches/cluster_launch_only.patch: clusters, but every
#    split stores its own part and the merge kernel runs), in a patched copy of the tree.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
specs=${SPECS:-paper:1024:16384:128,paper:1024:4096:128,paper:1024:16384:512}
MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 tools/device/stages.py --out $OUT --name ptxas \
  --specs paper:1024:16384:128 --ops s2,cm --trials 1 > $OUT/dump.log 2>&1
grep "C7512\|spill stores,\|Used [0-9]* registers" $OUT/dump.log | uniq -c | cut -c1-150
timeout 200 python3 tools/device/stages.py --out $OUT --name full --specs $specs \
  --ops s2,cm,cmtk --trials 5 2>&1 | grep -v "^{" | tail -6
timeout 200 python3 tools/device/stages.py --out $OUT --name ragged --specs $specs \
  --ops s2,cm,cmtk --trials 5 --ragged 2>&1 | grep -v "^{" | tail -6
rm -rf /tmp/launch_only && cp -r . /tmp/launch_only && cd /tmp/launch_only \
  && git apply tools/device/patches/cluster_launch_only.patch \
  && timeout 200 python3 tools/device/stages.py --out $OUT --name launch_only --specs $specs \
    --ops s2,cm --trials 5 2>&1 | grep -v "^{" | tail -6
