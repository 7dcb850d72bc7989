#!/usr/bin/env bash
# compute-sanitizer over every CUDA kernel (scripts/sanitize_case.py). Exits non-zero on any error.
#   SANITIZE_TOOLS="memcheck racecheck"   a subset of the four tools (default: all)
# PyTorch's caching allocator hides out-of-bounds accesses inside its pooled blocks: turn it off.
set -uo pipefail
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
case_py="$(dirname "$0")/sanitize_case.py"
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 1 --target-processes all \
    python3 "$case_py" || status=1
done
exit $status
