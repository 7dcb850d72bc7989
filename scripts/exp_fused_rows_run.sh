#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
start=$SECONDS
MAX_JOBS=16 NVCC_THREADS=4 TORCH_CUDA_ARCH_LIST="9.0a" FUSED_POOL_GELU_CUDA=1 \
  python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $((SECONDS - start)) s"
cd /tmp
timeout 240 python3 -m pytest -p no:cacheprovider -q -x "$ROOT/tests/test_certified.py" > "$OUT/test-certified.log" 2>&1
echo "== test_certified rc=$? $((SECONDS - start)) s"; tail -15 "$OUT/test-certified.log"
for round in 1 2; do
  timeout 150 python3 "$ROOT/benchmarks/profile_forward.py" --paths certified 3xtf32 --prepared yes \
    --batches 33 64 128 132 133 --out "$OUT/profile-r$round.json" > "$OUT/profile-r$round.log" 2>&1
  echo "== profile r$round rc=$? $((SECONDS - start)) s"; grep "B=" "$OUT/profile-r$round.log" | sed 's/candidates per row/cand/'
done
