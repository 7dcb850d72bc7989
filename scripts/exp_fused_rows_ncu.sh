#!/usr/bin/env bash
set -uo pipefail
ROOT=$(pwd)
start=$SECONDS
MAX_JOBS=16 NVCC_THREADS=4 TORCH_CUDA_ARCH_LIST="9.0a" FUSED_POOL_GELU_CUDA=1 \
  python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $((SECONDS - start)) s"
cd /tmp
FUSED_POOL_GELU_CERTIFIED=1 timeout 200 ncu --cache-control none --clock-control none --replay-mode application \
  --kernel-name regex:select_rescore --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
  -o "$OUT/fused" python3 "$ROOT/benchmarks/timer_state_case.py" forward 128 --prepared > "$OUT/ncu.log" 2>&1
echo "ncu rc=$? $((SECONDS - start)) s"; tail -5 "$OUT/ncu.log"
ncu --import "$OUT/fused.ncu-rep" --print-details all > "$OUT/details.txt" 2>&1
ncu --import "$OUT/fused.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
grep -i "duration\|stall\|cycles per issued\|achieved occupancy\|registers" "$OUT/details.txt" | head -30
ls -la "$OUT"
