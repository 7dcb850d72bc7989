#include "debug_knobs.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace fused_pool_gelu {
namespace {

// Both knobs in one word, so that a reload racing a forward gives it one consistent pair:
// bit 0 set once read, bits 1-2 the CertifiedMode, bit 3 force_mma_sync.
std::atomic<unsigned> knob_bits{0};

bool is_set(const char* value) { return value != nullptr && std::strcmp(value, "") != 0; }

unsigned read_knob_bits() {
  const char* certified = std::getenv("FUSED_POOL_GELU_CERTIFIED");
  const char* force_mma_sync = std::getenv("FUSED_POOL_GELU_FORCE_MMA_SYNC");
  const CertifiedMode mode = !is_set(certified)              ? CertifiedMode::kAuto
                             : std::strcmp(certified, "0") == 0 ? CertifiedMode::kNever
                                                                : CertifiedMode::kAlways;
  const bool force = is_set(force_mma_sync) && std::strcmp(force_mma_sync, "0") != 0;
  return 1u | (static_cast<unsigned>(mode) << 1) | (force ? 8u : 0u);
}

}  // namespace

DebugKnobs debug_knobs() {
  unsigned bits = knob_bits.load(std::memory_order_relaxed);
  if (bits == 0) {
    // Only where nothing was stored since: a reload racing this first read keeps its bits.
    unsigned expected = 0;
    bits = read_knob_bits();
    if (!knob_bits.compare_exchange_strong(expected, bits, std::memory_order_relaxed)) {
      bits = expected;
    }
  }
  DebugKnobs knobs;
  knobs.certified = static_cast<CertifiedMode>((bits >> 1) & 3u);
  knobs.force_mma_sync = (bits & 8u) != 0;
  return knobs;
}

void reload_debug_knobs() { knob_bits.store(read_knob_bits(), std::memory_order_relaxed); }

}  // namespace fused_pool_gelu
