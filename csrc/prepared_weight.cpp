// Which weight each prepared weight was made from (prepared_weight.h): a host-side table keyed by
// the prepared tensor's storage, so that forward can refuse a stale or foreign one instead of
// selecting columns on the wrong values.
#include "prepared_weight.h"

#include <ATen/core/Tensor.h>

#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace fused_pool_gelu {
namespace {

struct Source {
  // Weak references: the table keeps neither tensor's memory alive. The one to the prepared
  // storage keeps its StorageImpl object (the key) from being freed and its address reused while
  // the entry exists.
  c10::weak_intrusive_ptr<c10::StorageImpl> prepared;
  c10::weak_intrusive_ptr<c10::StorageImpl> weight;
  int64_t offset;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t version;
};

// An inference tensor has no version counter (torch.inference_mode): its prepared weight is held
// to the weight's identity only, and its in-place edits (possible only under inference_mode) go
// unseen, as writes through `.data` do.
constexpr int64_t kNoVersion = -1;
int64_t version_of(const at::Tensor& weight) {
  return weight.is_inference() ? kNoVersion : weight._version();
}

std::mutex table_mutex;
std::unordered_map<const c10::StorageImpl*, Source>& table() {
  static auto* sources = new std::unordered_map<const c10::StorageImpl*, Source>();
  return *sources;
}

}  // namespace

void record_prepared_weight(const at::Tensor& prepared, const at::Tensor& weight) {
  Source source{prepared.storage().getWeakStorageImpl(),
                weight.storage().getWeakStorageImpl(),
                weight.storage_offset(),
                weight.sizes().vec(),
                weight.strides().vec(),
                version_of(weight)};
  std::lock_guard<std::mutex> lock(table_mutex);
  auto& sources = table();
  // Entries of freed prepared weights go when the next one is recorded: the table stays as large
  // as the number of live prepared weights.
  for (auto it = sources.begin(); it != sources.end();) {
    it = it->second.prepared.expired() ? sources.erase(it) : std::next(it);
  }
  sources.insert_or_assign(prepared.storage().unsafeGetStorageImpl(), std::move(source));
}

void check_prepared_weight(const char* op, const at::Tensor& prepared, const at::Tensor& weight) {
  const int64_t n = weight.size(0);
  const int64_t bytes = prepared_bytes(n, weight.size(1));
  TORCH_CHECK(prepared.device() == weight.device(), "fused_pool_gelu.", op,
              ": prepared_weight must be on weight's device (", weight.device(), "), got ",
              prepared.device());
  TORCH_CHECK(prepared.scalar_type() == at::kByte, "fused_pool_gelu.", op,
              ": prepared_weight must be uint8 (made by fused_pool_gelu.prepare_weight), got ",
              prepared.scalar_type());
  TORCH_CHECK(prepared.dim() == 1 && prepared.size(0) == bytes, "fused_pool_gelu.", op,
              ": prepared_weight must be 1-D [pooled_features * (128 * ceil(in_features / 64) + ",
              "16)] = [", bytes, "] for weight of shape ", weight.sizes(), ", got shape ",
              prepared.sizes());
  TORCH_CHECK(prepared.is_contiguous() && prepared.storage_offset() == 0, "fused_pool_gelu.", op,
              ": prepared_weight must be prepare_weight's output itself, not a view of it");
  std::lock_guard<std::mutex> lock(table_mutex);
  const auto& sources = table();
  const auto it = sources.find(prepared.storage().unsafeGetStorageImpl());
  // A copy of a prepared weight (torch.compile's and opcheck's input copies, a loaded one) has no
  // entry: trusted as it is (prepared_weight.h).
  if (it == sources.end()) return;
  const Source& source = it->second;
  const c10::intrusive_ptr<c10::StorageImpl> made_from = source.weight.lock();
  TORCH_CHECK(made_from.get() == weight.storage().unsafeGetStorageImpl() &&
                  source.offset == weight.storage_offset() && source.sizes == weight.sizes() &&
                  source.strides == weight.strides(),
              "fused_pool_gelu.", op,
              ": prepared_weight was made from another weight tensor (another storage, offset, "
              "shape or strides): call prepare_weight(weight) with this weight");
  if (source.version == kNoVersion) return;
  const int64_t version = version_of(weight);
  TORCH_CHECK(source.version == version, "fused_pool_gelu.", op,
              ": prepared_weight is stale: weight was modified in place after prepare_weight "
              "(version counter ", source.version, " then, ", version,
              " now): call prepare_weight(weight) again");
}

}  // namespace fused_pool_gelu
