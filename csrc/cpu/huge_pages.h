// Large CPU outputs backed by transparent huge pages.
//
// A fresh buffer of hundreds of MB (the fold's adjoint writes the dense [O, K] weight gradient, 256
// MB at the default shape, on every training step) is mapped on first touch, one 4 KB page fault at
// a time: on a 2-core x86 machine that made most of a small-batch training step (docs/training.md,
// "On the CPU"). Where the system's transparent huge pages are set to `madvise` (the default of
// many distributions), asking for them on the buffer before it is touched maps it 2 MB at a time,
// as PyTorch's THP_MEM_ALLOC_ENABLE=1 does for every large allocation. The advice changes no value:
// where the system does not honour it (THP `never`, not Linux, the buffer already touched, e.g. by
// deterministic mode's fill of uninitialized memory), the buffer is an ordinary one. The advice
// outlives the buffer where the allocator keeps the range (glibc's heap, below its mmap threshold):
// later small allocations there may take 2 MB pages too (more memory, never other values), as with
// glibc's own glibc.malloc.hugetlb=1.
#pragma once

#include <cstdint>
#include <vector>

#include "stable_tensor.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fused_pool_gelu {
namespace cpu {

// A new tensor of `sizes` like `like` (its device and dtype), with the kernel asked to back the buffer's whole 2 MB-aligned pages
// with huge pages (only those: the allocator's neighbours in a partly covered one are not ours to
// advise). A buffer that holds no whole 2 MB page gets no advice.
inline Tensor empty_with_huge_pages(const Tensor& like, std::vector<int64_t> sizes) {
  Tensor tensor = aten::empty_like_device(like, std::move(sizes));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePageBytes = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(tensor.data_ptr());
  const uintptr_t first = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t last = (begin + tensor.numel() * tensor.element_size()) & ~(kHugePageBytes - 1);
  if (last > first) {
    // Advice only: an error (EINVAL where the kernel has no THP) leaves an ordinary buffer.
    (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return tensor;
}

}  // namespace cpu
}  // namespace fused_pool_gelu
