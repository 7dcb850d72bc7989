#!/usr/bin/env bash
# compute-sanitizer over every CUDA kernel. Exits non-zero on any error.
#   scripts/sanitize.sh                        scripts/sanitize_case.py (every kernel and path once,
#                                              small odd shapes) under all four tools
#   SANITIZE_TOOLS="memcheck racecheck"        a subset of the four tools
#   SANITIZE_TESTS="odd_shapes or misaligned"  also these GPU tests (pytest -k over tests/test_cuda.py
#                                              and test_certified.py, the kernel tests; not slow, not
#                                              profiler) under each tool
#   SANITIZE_TESTS=cuda                        every one of them (-k also matches marker names)
#   The tests run with FUSED_POOL_GELU_SANITIZER set to the tool: test_certified.py's forced calls
#   then skip their torch.profiler check of which kernels ran (CUPTI cannot attach).
#
# PyTorch's caching allocator hides out-of-bounds accesses inside its pooled blocks, so the tests
# run with it off, except those marked `graphs`: capturing a CUDA graph allocates through the
# caching allocator (with it off, cudaMalloc inside the capture invalidates it), so they run in a
# second pass with it on.
#
# Per tool:
#   racecheck: only kernels named fused_pool_gelu::* are instrumented. racecheck reports
#     shared-memory hazards within a kernel, so PyTorch's kernels cannot involve our code; with
#     them instrumented too a pass ran 1 GPU test in 7 minutes, with the filter ~77 in 4.
#   initcheck: every kernel is instrumented (a kernel left out has its writes untracked, and the
#     next kernel that reads them reports every element as uninitialized: measured with
#     --kernel-name-exclude).
#   racecheck and initcheck leave out the float16 / bfloat16 forward (in sanitize_case.py, whose
#     half-type fold and backward run under them, and the half-type tests, each of which runs the
#     half forward): its z comes from cuBLAS's tensor-core GEMM, whose writes initcheck does not
#     see (our epilogue's every read of z is reported uninitialized, as is PyTorch's avg_pool2d
#     after a cuBLAS half GEMM in the half reference Model), and racecheck aborts on it ("The
#     Sanitizer failed to handle a hardware exception", in the half forward and in PyTorch's
#     pooling forward). memcheck and synccheck run it; the
#     epilogue instance it runs differs from the float32 ones in its output type only.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
status=0
pytest_gpu=(python3 -m pytest -q -p no:cacheprovider --timeout=600)
# Half-type tests (see above): every float16 / bfloat16 test, by name or id.
half_tests="half or float16"
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  sanitize=(compute-sanitizer --tool "$tool" --error-exitcode 1 --target-processes all)
  selection=${SANITIZE_TESTS:-}
  case $tool in
    racecheck)
      sanitize+=(--kernel-name kns=fused_pool_gelu)
      selection="($selection) and not ($half_tests)" ;;
    initcheck) selection="($selection) and not ($half_tests)" ;;
  esac
  echo "== ${sanitize[*]}: sanitize_case.py"
  SANITIZE_TOOL=$tool PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${sanitize[@]}" python3 "$here/sanitize_case.py" ||
    status=1
  if [[ -n "${SANITIZE_TESTS:-}" ]]; then
    echo "== ${sanitize[*]}: tests -k '$selection' (caching allocator off)"
    (cd "$here/../tests" && PYTORCH_NO_CUDA_MEMORY_CACHING=1 FUSED_POOL_GELU_SANITIZER=$tool \
      "${sanitize[@]}" "${pytest_gpu[@]}" \
      -m "cuda and not slow and not profiler and not graphs" -k "$selection" test_cuda.py \
      test_certified.py) || status=1
    echo "== ${sanitize[*]}: tests -k '$selection', graph captures (caching allocator on)"
    (cd "$here/../tests" && FUSED_POOL_GELU_SANITIZER=$tool "${sanitize[@]}" "${pytest_gpu[@]}" \
      -m "cuda and graphs and not slow and not profiler" -k "$selection" test_cuda.py)
    rc=$?
    # pytest's 5 (no test collected): a selection without graph captures (test_certified).
    [[ $rc -eq 0 || $rc -eq 5 ]] || status=1
  fi
done
exit $status
