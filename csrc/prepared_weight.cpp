// The layout checks of a prepared weight (prepared_weight.h). Which weight it was made from is
// checked in Python (fused_pool_gelu/_prepared.py): the stable ABI shows no storage identity or
// version counter.
#include "prepared_weight.h"

namespace fused_pool_gelu {

void check_prepared_weight(const char* op, const Tensor& prepared, const Tensor& weight) {
  const int64_t bytes = prepared_bytes(weight.size(0), weight.size(1));
  FPG_CHECK(prepared.device() == weight.device(), "fused_pool_gelu.", op,
            ": prepared_weight must be on weight's device (", device_text(weight), "), got ",
            device_text(prepared));
  FPG_CHECK(prepared.scalar_type() == kByte, "fused_pool_gelu.", op,
            ": prepared_weight must be uint8 (made by fused_pool_gelu.prepare_weight), got ",
            prepared.scalar_type());
  FPG_CHECK(prepared.dim() == 1 && prepared.size(0) == bytes, "fused_pool_gelu.", op,
            ": prepared_weight must be 1-D [pooled_features * (128 * ceil(in_features / 64) + ",
            "16)] = [", bytes, "] for weight of shape ", sizes_text(weight), ", got shape ",
            sizes_text(prepared));
  FPG_CHECK(prepared.is_contiguous() && prepared.storage_offset() == 0, "fused_pool_gelu.", op,
            ": prepared_weight must be prepare_weight's output itself, not a view of it");
}

}  // namespace fused_pool_gelu
