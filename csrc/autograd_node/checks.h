// model_forward's input checks on the full C++ API (at::Tensor), for its autograd node
// (model_forward_node.cpp), which is built against each torch's own headers and cannot include
// ../checks.h (the stable ABI's Tensor). The same conditions and messages as ../checks.h's
// check_model_forward_inputs and check_model_forward_folded and as fused_pool_gelu/_checks.py's,
// which the Python node runs (tests/test_autograd_node.py compares the two nodes' errors).
//
// Sizes are read as sym_size and messages print sym_sizes: under torch.compile and torch.export the
// tensors have symbolic sizes, and size() or sizes() would fix every one of them (the batch
// included) to the traced value, as the Python node's `.shape` does not.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace fused_pool_gelu::node {

inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "fused_pool_gelu.", op, ": ", name, " must be a tensor, got None");
}

inline void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank,
                       const char* layout) {
  check_defined(op, name, t);
  TORCH_CHECK(t.dim() == rank, "fused_pool_gelu.", op, ": ", name, " must be ", rank, "-D ",
              layout, ", got shape ", t.sym_sizes());
}

// Forward-mode AD has no formula for these ops (a tangent would be dropped, the result's tangent
// silently zero). Level 0 is the one forward AD supports; torch.func's jvp shows its tangents at
// the autograd key, where this node runs, and not below it.
inline void check_no_tangent(const char* op, const char* name, const at::Tensor& t) {
  check_defined(op, name, t);
  TORCH_CHECK(!t._fw_grad(/*level=*/0).defined(), "fused_pool_gelu.", op, ": ", name,
              " carries a forward-mode AD tangent; forward-mode AD (torch.func.jvp, jacfwd, "
              "torch.autograd.forward_ad) is not supported, use reverse mode (backward, "
              "torch.autograd.grad)");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "fused_pool_gelu.", op, ": ", name,
              " must be on the same device as ", ref_name, " (", ref.device(), "), got ",
              t.device());
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t,
                             const char* ref_name, const at::Tensor& ref) {
  if (t.scalar_type() == ref.scalar_type()) return;
  TORCH_CHECK(ref.is_floating_point(), "fused_pool_gelu.", op, ": ", ref_name,
              " must be a floating-point tensor, got ", ref.scalar_type());
  TORCH_CHECK(false, "fused_pool_gelu.", op, ": ", name, " must have the same dtype as ", ref_name,
              " (", ref.scalar_type(), "), got ", t.scalar_type());
}

// x [B, K] against the unfolded weight [O, K] (forward's message would name the pooled weight).
inline void check_model_forward_inputs(const at::Tensor& x, const at::Tensor& weight) {
  check_rank("model_forward", "x", x, 2, "[batch, in_features]");
  check_rank("model_forward", "weight", weight, 2, "[out_features, in_features]");
  TORCH_CHECK(weight.sym_size(1) == x.sym_size(1), "fused_pool_gelu.model_forward: weight must "
              "be [out_features, in_features] with in_features = x.size(1) = ", x.sym_size(1),
              ", got shape ", weight.sym_sizes());
}

// fold's checks of weight, bias and k (a given fold skips fold, and its shape needs a valid k).
inline void check_fold_inputs(const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              int64_t pool_kernel_size) {
  check_rank("fold", "weight", weight, 2, "[out_features, in_features]");
  TORCH_CHECK(pool_kernel_size >= 1,
              "fused_pool_gelu.fold: pool_kernel_size must be >= 1, got ", pool_kernel_size);
  TORCH_CHECK(pool_kernel_size <= weight.sym_size(0),
              "fused_pool_gelu.fold: pool_kernel_size must be <= out_features (",
              weight.sym_size(0), ") so that at least one pooled feature exists, got ",
              pool_kernel_size);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0),
                "fused_pool_gelu.fold: bias must be 1-D [out_features] = [", weight.sym_size(0),
                "], got shape ", bias->sym_sizes());
    check_same_device("fold", "bias", *bias, "weight", weight);
    check_same_dtype("fold", "bias", *bias, "weight", weight);
  }
}

// A caller's fold of weight and bias (ModelNew's cache): given together, shaped, placed and typed
// as fold's outputs. Its values are trusted to be that fold (comparing them would cost the fold).
inline void check_model_forward_folded(const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias,
                                       int64_t pool_kernel_size,
                                       const std::optional<at::Tensor>& pooled_weight,
                                       const std::optional<at::Tensor>& pooled_bias,
                                       const std::optional<at::Tensor>& prepared_weight) {
  TORCH_CHECK(pooled_weight.has_value() == pooled_bias.has_value(),
              "fused_pool_gelu.model_forward: pooled_weight and pooled_bias must be given together "
              "(fold's two outputs), got only ",
              pooled_weight.has_value() ? "pooled_weight" : "pooled_bias");
  TORCH_CHECK(!prepared_weight.has_value() || pooled_weight.has_value(),
              "fused_pool_gelu.model_forward: prepared_weight is made from pooled_weight, which "
              "must be given with it, got prepared_weight without pooled_weight");
  if (!pooled_weight.has_value()) return;
  check_fold_inputs(weight, bias, pool_kernel_size);
  const c10::SymInt rows = weight.sym_size(0) / pool_kernel_size;
  TORCH_CHECK(pooled_weight->dim() == 2 && pooled_weight->sym_size(0) == rows &&
                  pooled_weight->sym_size(1) == weight.sym_size(1),
              "fused_pool_gelu.model_forward: pooled_weight must be fold's [out_features // "
              "pool_kernel_size, in_features] = [", rows, ", ", weight.sym_size(1),
              "], got shape ", pooled_weight->sym_sizes());
  TORCH_CHECK(pooled_bias->dim() == 1 && pooled_bias->sym_size(0) == rows,
              "fused_pool_gelu.model_forward: pooled_bias must be fold's [out_features // "
              "pool_kernel_size] = [", rows, "], got shape ", pooled_bias->sym_sizes());
  check_same_device("model_forward", "pooled_weight", *pooled_weight, "weight", weight);
  check_same_dtype("model_forward", "pooled_weight", *pooled_weight, "weight", weight);
  check_same_device("model_forward", "pooled_bias", *pooled_bias, "weight", weight);
  check_same_dtype("model_forward", "pooled_bias", *pooled_bias, "weight", weight);
}

}  // namespace fused_pool_gelu::node
