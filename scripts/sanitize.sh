#!/usr/bin/env bash
# compute-sanitizer over every CUDA kernel. Exits non-zero on any error.
#   scripts/sanitize.sh                        scripts/sanitize_case.py (every kernel and path once,
#                                              small odd shapes) under all four tools
#   SANITIZE_TOOLS="memcheck racecheck"        a subset of the four tools
#   SANITIZE_TESTS="odd_shapes or misaligned"  also these GPU tests (pytest -k over tests/test_cuda.py,
#                                              markers cuda, not slow, not profiler) under each tool
# PyTorch's caching allocator hides out-of-bounds accesses inside its pooled blocks: turn it off.
set -uo pipefail
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
here="$(cd "$(dirname "$0")" && pwd)"
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  sanitize=(compute-sanitizer --tool "$tool" --error-exitcode 1 --target-processes all)
  echo "== compute-sanitizer --tool $tool: sanitize_case.py"
  "${sanitize[@]}" python3 "$here/sanitize_case.py" || status=1
  if [[ -n "${SANITIZE_TESTS:-}" ]]; then
    echo "== compute-sanitizer --tool $tool: test_cuda.py -k '$SANITIZE_TESTS'"
    (cd "$here/../tests" && "${sanitize[@]}" python3 -m pytest -q -p no:cacheprovider \
      -m "cuda and not slow and not profiler" -k "$SANITIZE_TESTS" test_cuda.py) || status=1
  fi
done
exit $status
