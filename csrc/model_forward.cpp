// model_forward: the whole block on the unfolded Linear parameters, forward(x, *fold(weight, bias,
// k), scale), with ONE C++ autograd node for ModelNew's training path.
//
// Through the separate ops each training step crosses into Python four times (the autograd
// formulas of fold and forward_with_argmax, registered in _autograd.py, run once forward and once
// backward) and records two graph nodes. Here the forward calls fold and forward_with_argmax below
// autograd and saves what the arg-max backward needs; the backward calls model_backward
// (forward_backward then fold_backward in one op: on CUDA it skips the pooled gradient's zero rows)
// or, when only x needs a gradient, forward_backward alone. Same sums in the same order, so the
// same bits as the separate ops.
//
// A caller that holds fold(weight, bias, k) (ModelNew's cache, unchanged parameters) passes it as
// pooled_weight and pooled_bias, with its prepared copy if it has one: the forward then skips the
// fold, and the backward is the same (fold_backward needs none of fold's values), so gradient
// accumulation and evaluation with grad enabled fold once per parameter update.
//
// Inputs are validated by the ops it calls, so errors name them (fold: for weight, bias and
// pool_kernel_size; forward: for x), as they do when ModelNew calls the ops one by one; x's width
// against the unfolded weight first (check_model_forward_inputs), which forward would report
// against the pooled weight.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"
#include "op_calls.h"

namespace fused_pool_gelu {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// forward_with_argmax on the given fold, or on a new one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> folded_forward_with_argmax(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    int64_t pool_kernel_size, double scale, const c10::optional<at::Tensor>& pooled_weight,
    const c10::optional<at::Tensor>& pooled_bias,
    const c10::optional<at::Tensor>& prepared_weight) {
  check_model_forward_folded(weight, bias, pool_kernel_size, pooled_weight, pooled_bias,
                             prepared_weight);
  at::Tensor pooled_w, pooled_b;
  if (pooled_weight.has_value()) {
    pooled_w = *pooled_weight;
    pooled_b = *pooled_bias;
  } else {
    std::tie(pooled_w, pooled_b) = call_fold(weight, bias, pool_kernel_size);
  }
  auto [out, argmax, preactivation] =
      call_forward_with_argmax(x, pooled_w, pooled_b, scale, prepared_weight);
  return {out, argmax, preactivation, pooled_w};
}

// Below autograd (inference mode, or called from a kernel that already handles autograd).
at::Tensor model_forward_kernel(const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, int64_t pool_kernel_size,
                                double scale, const c10::optional<at::Tensor>& pooled_weight,
                                const c10::optional<at::Tensor>& pooled_bias,
                                const c10::optional<at::Tensor>& prepared_weight) {
  check_model_forward_inputs(x, weight);
  return std::get<0>(folded_forward_with_argmax(x, weight, bias, pool_kernel_size, scale,
                                                pooled_weight, pooled_bias, prepared_weight));
}

// model_backward on any device without a kernel of its own (the CPU): the two ops it stands for.
std::tuple<at::Tensor, at::Tensor, at::Tensor> model_backward_composite(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& pooled_weight,
    const at::Tensor& argmax, const at::Tensor& preactivation, double scale, int64_t out_features,
    int64_t pool_kernel_size) {
  check_model_backward_inputs(grad_out, x, pooled_weight, argmax, preactivation, out_features,
                              pool_kernel_size);
  auto [grad_x, grad_pooled_weight, grad_pooled_bias] =
      call_forward_backward(grad_out, c10::nullopt, x, pooled_weight, argmax, preactivation, scale);
  auto [grad_weight, grad_bias] =
      call_fold_backward(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size);
  return {grad_x, grad_weight, grad_bias};
}

struct ModelForward : public torch::autograd::Function<ModelForward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, int64_t pool_kernel_size,
                            double scale, const c10::optional<at::Tensor>& given_pooled_weight,
                            const c10::optional<at::Tensor>& given_pooled_bias,
                            const c10::optional<at::Tensor>& prepared_weight) {
    // Straight to the device kernels: through the autograd keys, fold and forward_with_argmax
    // would each enter their Python autograd formula even with grad mode off.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, argmax, preactivation, pooled_weight] =
        folded_forward_with_argmax(x, weight, bias, pool_kernel_size, scale, given_pooled_weight,
                                   given_pooled_bias, prepared_weight);
    ctx->save_for_backward({x, pooled_weight, argmax, preactivation});
    ctx->saved_data["out_features"] = weight.size(0);
    ctx->saved_data["pool_kernel_size"] = pool_kernel_size;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_bias"] = bias.has_value();
    return out;
  }

  // One gradient per forward argument, in order (undefined for the non-tensor ones, for an
  // absent bias and for the given fold, which is not differentiated: the gradients reach weight
  // and bias through fold_backward).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& pooled_weight = saved[1];
    const at::Tensor& argmax = saved[2];
    const at::Tensor& preactivation = saved[3];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool needs_x = ctx->needs_input_grad(0);
    const bool needs_weight = ctx->needs_input_grad(1);
    const bool needs_bias = has_bias && ctx->needs_input_grad(2);

    // With create_graph (grad mode on here) the ops go through their autograd formulas, which
    // raise a clear error on a gradient of these gradients; otherwise straight to the device
    // kernels.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    // No gradient for the preactivation output: the separate ops' autograd passes zeros there,
    // which costs an allocation and a fill per step for nothing but the sign of a zero grad_x
    // (dz = -0.0 + 0 = +0.0 at scale 0).
    const double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor grad_x, grad_weight, grad_bias;
    if (needs_weight || needs_bias) {
      std::tie(grad_x, grad_weight, grad_bias) = call_model_backward(
          grad_outputs[0], x, pooled_weight, argmax, preactivation, scale,
          ctx->saved_data["out_features"].toInt(), ctx->saved_data["pool_kernel_size"].toInt());
    } else {
      grad_x = std::get<0>(call_forward_backward(grad_outputs[0], c10::nullopt, x, pooled_weight,
                                                 argmax, preactivation, scale));
    }
    return {needs_x ? grad_x : at::Tensor(), needs_weight ? grad_weight : at::Tensor(),
            needs_bias ? grad_bias : at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor model_forward_autograd(const at::Tensor& x, const at::Tensor& weight,
                                  const c10::optional<at::Tensor>& bias, int64_t pool_kernel_size,
                                  double scale, const c10::optional<at::Tensor>& pooled_weight,
                                  const c10::optional<at::Tensor>& pooled_bias,
                                  const c10::optional<at::Tensor>& prepared_weight) {
  check_model_forward_inputs(x, weight);
  // Tangents are visible here under torch.func's jvp, not in the kernels (registration.cpp).
  check_no_tangent("model_forward", "x", x);
  check_no_tangent("model_forward", "weight", weight);
  if (bias.has_value()) check_no_tangent("model_forward", "bias", *bias);
  return ModelForward::apply(x, weight, bias, pool_kernel_size, scale, pooled_weight, pooled_bias,
                             prepared_weight);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_pool_gelu, CompositeExplicitAutograd, m) {
  m.impl("model_forward", &model_forward_kernel);
  m.impl("model_backward", &model_backward_composite);
}

TORCH_LIBRARY_IMPL(fused_pool_gelu, Autograd, m) {
  m.impl("model_forward", &model_forward_autograd);
}

}  // namespace fused_pool_gelu
