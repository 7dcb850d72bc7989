#!/usr/bin/env bash
# Kernel variants side by side on the GPU machine, in one call.
#
# Here (with git):   scripts/compare_variants.sh prepare main=main new=my-branch ...
#   exports each git ref's tree into variants/NAME, replacing what was there (git-ignored: name
#   `variants` in the device tool's `carry`, 64 MB in all; one tree is ~1 MB).
# There:             scripts/compare_variants.sh run
#   builds every tree under variants/ (in parallel, each into /tmp/fpg-variants/NAME), then
#   SUITE="NAME ..." runs the GPU tests (-m "cuda and not slow") on those, SANITIZE="NAME ..."
#   memcheck and racecheck on the workload, and profile_forward.py (PROFILE_ARGS, default the
#   certified path with a prepared weight at B = 1024 and 4096) on every variant, ROUNDS times
#   (default 2) in interleaved order, so that the machine's drift hits all of them alike. Logs go
#   to $OUT; the profile lines print last. PROFILE_NAMES="NAME ..." profiles only those trees;
#   REUSE_BUILDS=1 skips the builds and takes the packages an earlier call left on a machine still
#   warm (a tree without one is an error, not a silent rebuild); PROFILE_TIMEOUT (s, default 180)
#   bounds each profile process.
# Timing-only variants (ones that compute wrong numbers to time a part) need no suite.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TREES="$ROOT/variants"

case ${1:-} in
  prepare)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 prepare NAME=REF [NAME=REF ...]" >&2; exit 2; }
    rm -rf "$TREES"
    for pair in "$@"; do
      name=${pair%%=*} ref=${pair#*=}
      [[ $name =~ ^[A-Za-z0-9_-]+$ && $pair == *=* ]] || {
        echo "expected NAME=REF with NAME in letters, digits, _ and -, got '$pair'" >&2; exit 2; }
      mkdir -p "$TREES/$name"
      git -C "$ROOT" archive "$ref" | tar -x -C "$TREES/$name" || exit 1
      echo "variants/$name <- $ref ($(git -C "$ROOT" rev-parse --short "$ref"))"
    done
    ;;
  run)
    export PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/fpg-out}
    mkdir -p "$OUT"
    PKGS=/tmp/fpg-variants
    names=()
    shopt -s nullglob
    for dir in "$TREES"/*/; do names+=("$(basename "$dir")"); done
    shopt -u nullglob
    if [ ${#names[@]} -eq 0 ]; then
      echo "no trees under variants/: run '$0 prepare' here first" >&2
      exit 2
    fi
    steps="$OUT/steps.txt"
    stamp() { date -u +%H:%M:%S; }
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
    if [ "${REUSE_BUILDS:-0}" = 1 ]; then
      for name in "${names[@]}"; do
        [ -d "$PKGS/$name/fused_pool_gelu" ] || {
          echo "REUSE_BUILDS=1 but $PKGS/$name holds no build (the machine was not warm?)" >&2
          exit 2; }
      done
    else
      # Every build gets a share of the cores; a hung step must not eat the session's device time.
      jobs=$(( $(nproc) / ${#names[@]} )); [ "$jobs" -ge 1 ] || jobs=1
      pids=()
      for name in "${names[@]}"; do
        # pip install --target keeps a package already there: on a machine still warm from an
        # earlier call, the old build would be the one timed.
        rm -rf "${PKGS:?}/$name"
        (cd "$TREES/$name" && env MAX_JOBS=$jobs NVCC_THREADS=1 TORCH_CUDA_ARCH_LIST=9.0a \
           FUSED_POOL_GELU_CUDA=1 timeout -s KILL 600 python3 -m pip install --no-build-isolation \
           --no-deps -q --target "$PKGS/$name" . > "$OUT/build_$name.log" 2>&1
         echo "$(stamp) build $name rc=$?" >> "$steps") &
        pids+=($!)
      done
      wait "${pids[@]}"
    fi
    for name in ${SUITE:-}; do
      (cd "$TREES/$name/tests" && PYTHONPATH="$PKGS/$name" timeout -s KILL 240 python3 -m pytest \
         -p no:cacheprovider -q -m "cuda and not slow" --timeout=60 . > "$OUT/suite_$name.log" 2>&1
       echo "$(stamp) suite $name rc=$?: $(tail -n 1 "$OUT/suite_$name.log")" >> "$steps")
    done
    for name in ${SANITIZE:-}; do
      (cd "$TREES/$name/tests" && PYTHONPATH="$PKGS/$name" SANITIZE_TOOLS="memcheck racecheck" \
         timeout -s KILL 240 bash ../scripts/sanitize.sh > "$OUT/sanitize_$name.log" 2>&1
       echo "$(stamp) sanitize $name rc=$?" >> "$steps")
    done
    default_profile="--paths certified --prepared yes --batches 1024 4096 --calls 20"
    read -r -a profile_args <<< "${PROFILE_ARGS:-$default_profile}"
    read -r -a profile_names <<< "${PROFILE_NAMES:-${names[*]}}"
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for name in "${profile_names[@]}"; do
        echo "== $name, round $round, $(stamp)" >> "$OUT/profile.txt"
        (cd "$TREES/$name/benchmarks" && PYTHONPATH="$PKGS/$name" \
           timeout -s KILL "${PROFILE_TIMEOUT:-180}" python3 profile_forward.py \
           "${profile_args[@]}") >> "$OUT/profile.txt" 2>&1
      done
    done
    echo "$(stamp) done" >> "$steps"
    cat "$steps"
    grep -E "^==|B=" "$OUT/profile.txt"
    ;;
  *)
    echo "usage: $0 prepare NAME=REF ... (here) | run (on the GPU machine)" >&2
    exit 2
    ;;
esac
