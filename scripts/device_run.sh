#!/usr/bin/env bash
# One call on the GPU machine: build from source there, then the requested stages.
#   scripts/device_run.sh build test test-ptx test-cuda test-slow test-all test-certified sanitize profile
#                         profile-certified profile-shapes bench-ours bench-forward
#                         bench-forward-graph bench-train bench-train-graph bench-grid
#                         bench-kernelbench bench-paths
# Logs go to $OUT (the device tool brings them back); a short summary prints last.
# BENCH_DTYPES="float32 bfloat16 float16" runs each bench-forward* / bench-train* stage once per
# dtype (default float32); the -graph stages time CUDA-graph replays (--cuda-graph). BENCH_ARGS
# (split on spaces) adds arguments to them: not --dtype or --cuda-graph, which the stages set;
# to bench-grid, the piece of the grid (e.g. BENCH_ARGS="--K 1024 4096"), whose rows merge into
# benchmarks/results/<gpu>-grid.json.
# The benchmarks' results record the commit timed: pass it as FUSED_POOL_GELU_GIT_REVISION=<commit>
# (the device copy's git metadata is stale, so `git rev-parse` there names an older commit).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fpg-out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
summary=()
read -r -a bench_args <<< "${BENCH_ARGS:-}"
# Benchmarks merge their rows into the committed results files (benchmarks/results/<gpu>*.json);
# they come back in $OUT/results.tgz, the stages' logs in $OUT/logs.tgz.
note() { summary+=("$1"); echo "== $1"; }
warn_unnamed_revision() {
  [[ -n "${FUSED_POOL_GELU_GIT_REVISION:-}" ]] ||
    note "FUSED_POOL_GELU_GIT_REVISION unset: the results' git field is the device copy's (stale)"
}

# run_stage NAME DIR CMD...: run CMD in DIR (tests and benchmarks run outside the source tree, so
# that the installed package is imported), log to $OUT/NAME.log.
run_stage() {
  local name=$1 dir=$2; shift 2
  local start=$SECONDS
  # A hung kernel must not eat the session's device time: every stage has a time limit.
  (cd "$dir" && timeout --kill-after=10 "${STAGE_TIMEOUT_S:-300}" "$@") > "$OUT/$name.log" 2>&1
  local rc=$?
  note "$name rc=$rc $((SECONDS - start))s"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

for stage in "$@"; do
  case $stage in
    build)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
      run_stage build "$ROOT" env MAX_JOBS=16 NVCC_THREADS=4 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0a}" \
        FUSED_POOL_GELU_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -v . || break
      ;;
    test)
      run_stage test "$ROOT/tests" python3 -m pytest -p no:cacheprovider -q -m "cuda and not slow" --timeout=180 -n "${PYTEST_WORKERS:-6}" \
        --durations=10 .
      ;;
    test-ptx)
      # The PTX path of GPUs newer than the wheel's binaries. CUDA_FORCE_PTX_JIT=1 would make the
      # driver JIT every module from its PTX, torch's included, and torch's wheels carry none: the
      # probe shows whether this torch runs that way. Whatever it says, a build holding compute_90
      # PTX alone (the wheel's later-GPU entry, no binaries) is JIT compiled here and runs the
      # GPU suite.
      CUDA_FORCE_PTX_JIT=1 timeout 120 python3 -c "import torch; torch.ones(2, device='cuda').add_(1).sum().item()" \
        > "$OUT/force-ptx-jit-torch.log" 2>&1
      note "torch under CUDA_FORCE_PTX_JIT=1: rc=$? ($(grep -m1 -oE '[A-Za-z]*Error: .{0,120}' "$OUT/force-ptx-jit-torch.log"))"
      ptx_target=/tmp/fpg-ptx-only
      rm -rf "$ptx_target" "$ROOT/build"  # no object of another build may be packaged
      run_stage build-ptx "$ROOT" env MAX_JOBS=16 NVCC_THREADS=4 TORCH_CUDA_ARCH_LIST=9.0 \
        FUSED_POOL_GELU_PTX_ONLY=1 FUSED_POOL_GELU_CUDA=1 python3 -m pip install \
        --no-build-isolation --no-deps -q --target "$ptx_target" . || break
      run_stage check-ptx-build /tmp env PYTHONPATH="$ptx_target" python3 -c "import fused_pool_gelu as f; \
a = f.build_info()['cuda_archs']; assert a.endswith('(PTX only)'), a; print(a)" || break
      STAGE_TIMEOUT_S=${STAGE_TIMEOUT_S:-420} run_stage test-ptx "$ROOT/tests" env PYTHONPATH="$ptx_target" python3 -m pytest \
        -p no:cacheprovider -q -m "cuda and not slow" --timeout=300 -n "${PYTEST_WORKERS:-6}" .
      ;;
    test-cuda)
      run_stage test-cuda "$ROOT/tests" python3 -m pytest -p no:cacheprovider -q -x --timeout=180 \
        --durations=5 test_cuda.py
      ;;
    test-slow)
      run_stage test-slow "$ROOT/tests" python3 -m pytest -p no:cacheprovider -q -m "cuda and slow" \
        --timeout=300 --durations=5 .
      ;;
    test-all)
      run_stage test-all "$ROOT/tests" python3 -m pytest -p no:cacheprovider -q --timeout=300 --durations=10 .
      ;;
    sanitize)
      run_stage sanitize "$ROOT/tests" bash "$ROOT/scripts/sanitize.sh"
      ;;
    test-certified)
      run_stage test-certified "$ROOT/tests" python3 -m pytest -p no:cacheprovider -q --timeout=180 \
        --durations=5 test_certified.py
      ;;
    profile-certified)
      run_stage profile-certified /tmp python3 "$ROOT/benchmarks/profile_forward.py" \
        --paths certified 3xtf32 --batches 128 1024 1536 4096 --out "$OUT/profile-certified.json"
      ;;
    profile)
      run_stage profile /tmp python3 "$ROOT/benchmarks/profile_forward.py" --out "$OUT/profile.json"
      ;;
    profile-shapes)
      # Which path should serve each batch away from the default shape (research/README.md,
      # decision log: where the certified path serves). It applies from 33 rows, and its candidate
      # counts only there.
      run_stage profile-shapes /tmp python3 "$ROOT/benchmarks/profile_forward.py" \
        --paths default certified 3xtf32 --batches 40 128 513 1024 \
        --shapes 1024x512 2048x512 4096x512 8192x128 8192x2048 16384x512 \
        --out "$OUT/profile-shapes.json"
      ;;
    bench-ours)
      run_stage bench-ours /tmp python3 "$ROOT/benchmarks/bench_forward.py" --skip-compile \
        --impls fold_eager ours_op ours_model --out "$OUT/bench-ours.json"
      ;;
    bench-forward|bench-forward-graph|bench-train|bench-train-graph)
      warn_unnamed_revision
      script=bench_forward.py; [[ $stage == bench-train* ]] && script=bench_train.py
      launch=(); [[ $stage == *-graph ]] && launch=(--cuda-graph)
      for dtype in ${BENCH_DTYPES:-float32}; do
        run_stage "$stage-$dtype" /tmp python3 "$ROOT/benchmarks/$script" \
          --dtype "$dtype" ${launch[@]+"${launch[@]}"} ${bench_args[@]+"${bench_args[@]}"}
      done
      ;;
    bench-paths)
      warn_unnamed_revision
      run_stage bench-paths /tmp python3 "$ROOT/benchmarks/bench_paths.py" \
        ${bench_args[@]+"${bench_args[@]}"}
      ;;
    bench-grid)
      warn_unnamed_revision
      # bench_grid.py starts nothing past its --deadline-s (420 s): a stage of 8 minutes holds it.
      STAGE_TIMEOUT_S=${STAGE_TIMEOUT_S:-480} run_stage bench-grid /tmp python3 \
        "$ROOT/benchmarks/bench_grid.py" ${bench_args[@]+"${bench_args[@]}"}
      ;;
    bench-kernelbench)
      warn_unnamed_revision
      run_stage bench-kernelbench /tmp python3 "$ROOT/benchmarks/bench_kernelbench.py"
      ;;
    *) note "unknown stage $stage" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$ROOT" benchmarks/results
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log ./*.txt 2>/dev/null)
printf '%s\n' "${summary[@]}"
