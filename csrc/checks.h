// Input validation shared by the CPU and CUDA implementations.
//
// Every message names the argument, what was expected and what came, e.g.
//   "fused_pool_gelu.forward: x must be 2-D [batch, in_features], got shape [2, 4, 32]".
// Their Python twins (fused_pool_gelu/_checks.py), run by the fake kernels, make torch.compile
// report the same errors while tracing.
#pragma once

#include "stable_tensor.h"

#include <cstdint>
#include <initializer_list>
#include <limits>

namespace fused_pool_gelu {

// A required tensor argument given as None reaches the kernels as an undefined tensor.
inline void check_defined(const char* op, const char* name, const Tensor& t) {
  FPG_CHECK(t.defined(), "fused_pool_gelu.", op, ": ", name, " must be a tensor, got None");
}

inline void check_rank(const char* op, const char* name, const Tensor& t, int64_t rank,
                       const char* layout) {
  check_defined(op, name, t);
  FPG_CHECK(t.dim() == rank, "fused_pool_gelu.", op, ": ", name, " must be ", rank, "-D ",
              layout, ", got shape ", sizes_text(t));
}

inline void check_same_device(const char* op, const char* name, const Tensor& t,
                              const char* ref_name, const Tensor& ref) {
  FPG_CHECK(t.device() == ref.device(), "fused_pool_gelu.", op, ": ", name,
              " must be on the same device as ", ref_name, " (", device_text(ref), "), got ",
              device_text(t));
}

// t's dtype must be ref's. Where they differ and ref's is not a floating type, ref is the one to
// change (an integer x beside a float32 weight): named as such. Where they agree, the op's own
// dtype check (the device's list) names ref.
inline void check_same_dtype(const char* op, const char* name, const Tensor& t,
                             const char* ref_name, const Tensor& ref) {
  if (t.scalar_type() == ref.scalar_type()) return;
  FPG_CHECK(is_floating_point(ref.scalar_type()), "fused_pool_gelu.", op, ": ", ref_name,
              " must be a floating-point tensor, got ", ref.scalar_type());
  FPG_CHECK(false, "fused_pool_gelu.", op, ": ", name, " must have the same dtype as ", ref_name,
              " (", ref.scalar_type(), "), got ", t.scalar_type());
}

// The floating dtypes an implementation supports, e.g. {kFloat, kDouble} on the CPU.
inline void check_dtype_in(const char* op, const char* name, const Tensor& t,
                           std::initializer_list<ScalarType> allowed,
                           const char* allowed_text) {
  bool ok = false;
  for (auto s : allowed) ok = ok || t.scalar_type() == s;
  FPG_CHECK(ok, "fused_pool_gelu.", op, ": ", name, " must be ", allowed_text, " on ",
              device_type_text(t.device().type()), ", got ", t.scalar_type());
}

// The dtypes the CUDA kernels are built for (cuda/common.cuh's FPG_DISPATCH_CUDA_FLOATING_TYPES).
inline void check_cuda_floating_dtype(const char* op, const char* name, const Tensor& t) {
  check_dtype_in(op, name, t, {kFloat, kHalf, kBFloat16},
                 "float32, float16 or bfloat16");
}

// fold(weight [O, K], bias [O] or None, k): pools groups of k rows, N = O // k.
inline void check_fold_inputs(const Tensor& weight, const std::optional<Tensor>& bias,
                              int64_t pool_kernel_size) {
  check_rank("fold", "weight", weight, 2, "[out_features, in_features]");
  FPG_CHECK(pool_kernel_size >= 1,
              "fused_pool_gelu.fold: pool_kernel_size must be >= 1, got ", pool_kernel_size);
  FPG_CHECK(pool_kernel_size <= weight.size(0),
              "fused_pool_gelu.fold: pool_kernel_size must be <= out_features (",
              weight.size(0), ") so that at least one pooled feature exists, got ",
              pool_kernel_size);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    FPG_CHECK(b.dim() == 1 && b.size(0) == weight.size(0),
                "fused_pool_gelu.fold: bias must be 1-D [out_features] = [", weight.size(0),
                "], got shape ", sizes_text(b));
    check_same_device("fold", "bias", b, "weight", weight);
    check_same_dtype("fold", "bias", b, "weight", weight);
  }
}

// The unfolded shape (out_features, pool_kernel_size) of the pooled tensor `name`: its rows ==
// out_features // pool_kernel_size (fold_backward, model_backward).
inline void check_unfolded_shape(const char* op, const char* name, const Tensor& pooled,
                                 int64_t out_features, int64_t pool_kernel_size) {
  FPG_CHECK(pool_kernel_size >= 1, "fused_pool_gelu.", op,
              ": pool_kernel_size must be >= 1, got ", pool_kernel_size);
  // Checked on its own: -k < out_features < 0 would pass the row count test below (C++ division
  // truncates toward zero).
  FPG_CHECK(out_features >= 0, "fused_pool_gelu.", op, ": out_features must be >= 0, got ",
              out_features);
  FPG_CHECK(out_features / pool_kernel_size == pooled.size(0), "fused_pool_gelu.", op, ": ",
              name, " must have out_features // pool_kernel_size = ",
              out_features / pool_kernel_size, " rows, got shape ", sizes_text(pooled));
  // The [out_features, in_features] gradient's bytes must be a size (a large k can make a few
  // pooled rows stand for more rows than memory has).
  const int64_t in_features = pooled.size(1);
  const int64_t max_bytes = std::numeric_limits<int64_t>::max();
  FPG_CHECK(in_features == 0 || out_features <= max_bytes / static_cast<int64_t>(pooled.element_size()) / in_features,
              "fused_pool_gelu.", op, ": out_features must keep the [out_features, in_features] "
              "gradient's bytes within 2^63, got [", out_features, ", ", in_features, "] of ",
              pooled.element_size(), "-byte elements");
}

// fold_backward(grad_pooled_weight [N, K], grad_pooled_bias [N], O, k).
inline void check_fold_backward_inputs(const Tensor& grad_pooled_weight,
                                       const Tensor& grad_pooled_bias, int64_t out_features,
                                       int64_t pool_kernel_size) {
  const char* op = "fold_backward";
  check_rank(op, "grad_pooled_weight", grad_pooled_weight, 2, "[pooled_features, in_features]");
  check_unfolded_shape(op, "grad_pooled_weight", grad_pooled_weight, out_features,
                       pool_kernel_size);
  check_defined(op, "grad_pooled_bias", grad_pooled_bias);
  FPG_CHECK(grad_pooled_bias.dim() == 1 && grad_pooled_bias.size(0) == grad_pooled_weight.size(0),
              "fused_pool_gelu.fold_backward: grad_pooled_bias must be 1-D [pooled_features] = [",
              grad_pooled_weight.size(0), "], got shape ", sizes_text(grad_pooled_bias));
  check_same_device(op, "grad_pooled_bias", grad_pooled_bias, "grad_pooled_weight",
                    grad_pooled_weight);
  check_same_dtype(op, "grad_pooled_bias", grad_pooled_bias, "grad_pooled_weight",
                   grad_pooled_weight);
}

// x [B, K] and a weight [rows, K] of `layout` ("[pooled_features, in_features]" or
// "[out_features, in_features]"): their ranks and K.
inline void check_x_and_weight(const char* op, const Tensor& x, const char* weight_name,
                               const Tensor& weight, const char* layout) {
  check_rank(op, "x", x, 2, "[batch, in_features]");
  check_rank(op, weight_name, weight, 2, layout);
  FPG_CHECK(weight.size(1) == x.size(1), "fused_pool_gelu.", op, ": ", weight_name, " must be ",
              layout, " with in_features = x.size(1) = ", x.size(1), ", got shape ",
              sizes_text(weight));
}

// The tensors of forward_with_argmax(x [B, K], weight [N, K], bias [N] or None, scale). op and
// weight_name: the op and the weight's argument named in errors (the backward ops check the same
// inputs).
inline void check_forward_inputs(const Tensor& x, const Tensor& weight,
                                 const std::optional<Tensor>& bias, const char* op = "forward",
                                 const char* weight_name = "weight") {
  check_x_and_weight(op, x, weight_name, weight, "[pooled_features, in_features]");
  FPG_CHECK(weight.size(0) >= 1, "fused_pool_gelu.", op, ": ", weight_name,
              " must have at least one row (pooled feature) to take the max over, got shape ",
              sizes_text(weight));
  check_same_device(op, weight_name, weight, "x", x);
  check_same_dtype(op, weight_name, weight, "x", x);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    FPG_CHECK(b.dim() == 1 && b.size(0) == weight.size(0),
                "fused_pool_gelu.forward: bias must be 1-D [pooled_features] = [", weight.size(0),
                "], got shape ", sizes_text(b));
    check_same_device(op, "bias", b, "x", x);
    check_same_dtype(op, "bias", b, "x", x);
  }
}

// model_forward(x [B, K], weight [O, K], ...): x against the unfolded weight, which the caller
// passed (fold and forward check the rest; forward's message would name the pooled weight).
inline void check_model_forward_inputs(const Tensor& x, const Tensor& weight) {
  check_x_and_weight("model_forward", x, "weight", weight, "[out_features, in_features]");
}

// model_forward's optional pooled_weight, pooled_bias and prepared_weight (a caller's cached fold
// of weight and bias): given together, shaped, placed and typed as fold's outputs for this weight.
// Their values are trusted to be that fold (comparing them would cost the fold they save).
inline void check_model_forward_folded(const Tensor& weight, const std::optional<Tensor>& bias,
                                       int64_t pool_kernel_size,
                                       const std::optional<Tensor>& pooled_weight,
                                       const std::optional<Tensor>& pooled_bias,
                                       const std::optional<Tensor>& prepared_weight) {
  FPG_CHECK(pooled_weight.has_value() == pooled_bias.has_value(),
            "fused_pool_gelu.model_forward: pooled_weight and pooled_bias must be given together "
            "(fold's two outputs), got only ",
            pooled_weight.has_value() ? "pooled_weight" : "pooled_bias");
  FPG_CHECK(!prepared_weight.has_value() || pooled_weight.has_value(),
            "fused_pool_gelu.model_forward: prepared_weight is made from pooled_weight, which "
            "must be given with it, got prepared_weight without pooled_weight");
  if (!pooled_weight.has_value()) return;
  // fold's checks, which the call no longer reaches: the pooled shape needs a valid k.
  check_fold_inputs(weight, bias, pool_kernel_size);
  const int64_t pooled_features = weight.size(0) / pool_kernel_size;
  FPG_CHECK(pooled_weight->dim() == 2 && pooled_weight->size(0) == pooled_features &&
                pooled_weight->size(1) == weight.size(1),
            "fused_pool_gelu.model_forward: pooled_weight must be fold's [out_features // "
            "pool_kernel_size, in_features] = [", pooled_features, ", ", weight.size(1),
            "], got shape ", sizes_text(*pooled_weight));
  FPG_CHECK(pooled_bias->dim() == 1 && pooled_bias->size(0) == pooled_features,
            "fused_pool_gelu.model_forward: pooled_bias must be fold's [out_features // "
            "pool_kernel_size] = [", pooled_features, "], got shape ", sizes_text(*pooled_bias));
  check_same_device("model_forward", "pooled_weight", *pooled_weight, "weight", weight);
  check_same_dtype("model_forward", "pooled_weight", *pooled_weight, "weight", weight);
  check_same_device("model_forward", "pooled_bias", *pooled_bias, "weight", weight);
  check_same_dtype("model_forward", "pooled_bias", *pooled_bias, "weight", weight);
}

// prepare_weight(weight [N, K]): any floating dtype (the copy is made from its float32 values).
inline void check_prepare_weight_inputs(const Tensor& weight) {
  check_rank("prepare_weight", "weight", weight, 2, "[pooled_features, in_features]");
  FPG_CHECK(is_floating_point(weight.scalar_type()),
              "fused_pool_gelu.prepare_weight: weight must be a floating-point tensor, got ",
              weight.scalar_type());
}

// forward_backward(grad_out [B]?, grad_preactivation [B]?, x [B, K], weight [N, K],
//                  argmax [B] int64, preactivation [B], scale).
// op and weight_name: as check_forward_inputs' (model_backward checks the same inputs).
inline void check_forward_backward_inputs(const std::optional<Tensor>& grad_out,
                                          const std::optional<Tensor>& grad_preactivation,
                                          const Tensor& x, const Tensor& weight,
                                          const Tensor& argmax,
                                          const Tensor& preactivation,
                                          const char* op = "forward_backward",
                                          const char* weight_name = "weight") {
  check_forward_inputs(x, weight, std::nullopt, op, weight_name);
  const int64_t batch = x.size(0);
  auto check_batch_vector = [&](const char* name, const Tensor& t) {
    check_defined(op, name, t);
    FPG_CHECK(t.dim() == 1 && t.size(0) == batch, "fused_pool_gelu.", op, ": ", name,
                " must be 1-D [batch] = [", batch, "], got shape ", sizes_text(t));
    check_same_device(op, name, t, "x", x);
  };
  check_batch_vector("argmax", argmax);
  FPG_CHECK(argmax.scalar_type() == kLong,
              "fused_pool_gelu.", op, ": argmax must be int64, got ", argmax.scalar_type());
  check_batch_vector("preactivation", preactivation);
  check_same_dtype(op, "preactivation", preactivation, "x", x);
  if (grad_out.has_value()) {
    check_batch_vector("grad_out", *grad_out);
    check_same_dtype(op, "grad_out", *grad_out, "x", x);
  }
  if (grad_preactivation.has_value()) {
    check_batch_vector("grad_preactivation", *grad_preactivation);
    check_same_dtype(op, "grad_preactivation", *grad_preactivation, "x", x);
  }
}

// model_backward(grad_out [B], x [B, K], pooled_weight [N, K], argmax [B] int64, preactivation [B],
//                scale, out_features, pool_kernel_size) with N = out_features // pool_kernel_size.
inline void check_model_backward_inputs(const Tensor& grad_out, const Tensor& x,
                                        const Tensor& pooled_weight, const Tensor& argmax,
                                        const Tensor& preactivation, int64_t out_features,
                                        int64_t pool_kernel_size) {
  check_forward_backward_inputs(grad_out, std::nullopt, x, pooled_weight, argmax, preactivation,
                                "model_backward", "pooled_weight");
  check_unfolded_shape("model_backward", "pooled_weight", pooled_weight, out_features,
                       pool_kernel_size);
}

inline bool is_reduced_float(const Tensor& t) {
  return t.scalar_type() == kHalf || t.scalar_type() == kBFloat16;
}

inline std::optional<Tensor> to_float(const std::optional<Tensor>& t) {
  return t.has_value() ? std::optional<Tensor>(aten::to_dtype(*t, kFloat)) : std::nullopt;
}

}  // namespace fused_pool_gelu
