// model_forward's autograd kernel as ONE C++ autograd node: what ModelNew's training step records.
//
// The LibTorch stable ABI has no autograd, so every other op's autograd is registered from Python
// (fused_pool_gelu/_autograd.py), and so is a fallback for this one. A Python autograd.Function
// costs host time on every training step (its apply, and the backward's call back into an op from
// Python), which at small batch is the step's time. This file is therefore built on the full C++
// API, once for each torch minor version the wheel serves, against that version's own headers
// (setup.py: fused_pool_gelu/_model_forward_node_torch2_<minor>.so); _autograd.py loads the one
// built for the running torch, if any, before registering its Python kernels. It holds no device
// code: it calls the ops of fused_pool_gelu._C (stable ABI, any torch) through the dispatcher.
//
// The forward calls _model_forward_with_argmax (fold and forward_with_argmax in one op) below
// autograd, or forward_with_argmax alone on a fold the caller gives (ModelNew's cache, unchanged
// parameters: fold_backward needs none of fold's values, so the backward is the same), and saves
// what the arg-max backward needs. The backward calls model_backward (forward_backward then
// fold_backward in one op) or, when only x needs a gradient, forward_backward alone: the same sums
// in the same order as the separate ops' backward, so the same bits, and the same as the Python
// node's. _model_forward_and_fold's kernel is the same node returning the fold it made as well
// (ModelNew's call after a parameter update, whose cache keeps it: one op call fewer than folding
// first).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"

namespace fused_pool_gelu::node {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

// The ops of fused_pool_gelu._C, through the dispatcher: below autograd (the callers set it) that
// is the device kernel; with create_graph, the op's autograd kernel.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor call_model_forward(const at::Tensor& x, const at::Tensor& weight,
                              const OptionalTensor& bias, int64_t pool_kernel_size, double scale,
                              const OptionalTensor& pooled_weight,
                              const OptionalTensor& pooled_bias,
                              const OptionalTensor& prepared_weight) {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                      int64_t, double, const OptionalTensor&,
                                      const OptionalTensor&, const OptionalTensor&)>(
      "fused_pool_gelu::model_forward");
  return op.call(x, weight, bias, pool_kernel_size, scale, pooled_weight, pooled_bias,
                 prepared_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
call_model_forward_with_argmax(const at::Tensor& x, const at::Tensor& weight,
                               const OptionalTensor& bias, int64_t pool_kernel_size,
                               double scale) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t, double)>(
      "fused_pool_gelu::_model_forward_with_argmax");
  return op.call(x, weight, bias, pool_kernel_size, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_model_forward_and_fold(
    const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias,
    int64_t pool_kernel_size, double scale) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t, double)>(
      "fused_pool_gelu::_model_forward_and_fold");
  return op.call(x, weight, bias, pool_kernel_size, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_forward_with_argmax(
    const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias, double scale,
    const OptionalTensor& prepared_weight) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const OptionalTensor&, double,
      const OptionalTensor&)>("fused_pool_gelu::forward_with_argmax");
  return op.call(x, weight, bias, scale, prepared_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_forward_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& pooled_weight,
    const at::Tensor& argmax, const at::Tensor& preactivation, double scale) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const OptionalTensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, double)>("fused_pool_gelu::forward_backward");
  return op.call(grad_out, std::nullopt, x, pooled_weight, argmax, preactivation, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_model_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& pooled_weight,
    const at::Tensor& argmax, const at::Tensor& preactivation, double scale, int64_t out_features,
    int64_t pool_kernel_size) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, double, int64_t, int64_t)>("fused_pool_gelu::model_backward");
  return op.call(grad_out, x, pooled_weight, argmax, preactivation, scale, out_features,
                 pool_kernel_size);
}

// What the arg-max backward needs, saved by either node's forward.
void save_what_backward_needs(AutogradContext* ctx, const at::Tensor& x,
                              const at::Tensor& weight, const OptionalTensor& bias,
                              int64_t pool_kernel_size, double scale,
                              const at::Tensor& pooled_weight, const at::Tensor& argmax,
                              const at::Tensor& preactivation) {
  ctx->save_for_backward({x, pooled_weight, argmax, preactivation});
  ctx->saved_data["out_features"] = weight.sym_size(0);  // symbolic under tracing
  ctx->saved_data["pool_kernel_size"] = pool_kernel_size;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["has_bias"] = bias.has_value();
}

// The gradients of x, weight and bias (undefined where not needed or no bias), from grad_out.
variable_list backward_of(AutogradContext* ctx, const at::Tensor& grad_out) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor& pooled_weight = saved[1];
  const at::Tensor& argmax = saved[2];
  const at::Tensor& preactivation = saved[3];
  const bool needs_x = ctx->needs_input_grad(0);
  const bool needs_weight = ctx->needs_input_grad(1);
  const bool needs_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
  const double scale = ctx->saved_data["scale"].toDouble();

  // With create_graph (grad mode on here) the ops go through their autograd kernels, which
  // raise a clear error on a gradient of these gradients; otherwise straight to the device
  // kernels. No gradient for the preactivation output: the separate ops' autograd passes zeros
  // there, an allocation and a fill per step for nothing but the sign of a zero grad_x.
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
  if (!at::GradMode::is_enabled()) below_autograd.emplace();
  at::Tensor grad_x, grad_weight, grad_bias;
  if (needs_weight || needs_bias) {
    std::tie(grad_x, grad_weight, grad_bias) = call_model_backward(
        grad_out, x, pooled_weight, argmax, preactivation, scale,
        ctx->saved_data["out_features"].toSymInt().guard_int(__FILE__, __LINE__),
        ctx->saved_data["pool_kernel_size"].toInt());
  } else {
    grad_x = std::get<0>(
        call_forward_backward(grad_out, x, pooled_weight, argmax, preactivation, scale));
  }
  return {needs_x ? grad_x : at::Tensor(), needs_weight ? grad_weight : at::Tensor(),
          needs_bias ? grad_bias : at::Tensor()};
}

struct ModelForward : public torch::autograd::Function<ModelForward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptionalTensor& bias, int64_t pool_kernel_size, double scale,
                            const OptionalTensor& given_pooled_weight,
                            const OptionalTensor& given_pooled_bias,
                            const OptionalTensor& prepared_weight) {
    // Straight to the device kernels: through the autograd key, forward_with_argmax would enter
    // its Python autograd kernel even with grad mode off.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor out, argmax, preactivation, pooled_weight;
    if (given_pooled_weight.has_value()) {
      pooled_weight = *given_pooled_weight;
      std::tie(out, argmax, preactivation) = call_forward_with_argmax(
          x, pooled_weight, given_pooled_bias, scale, prepared_weight);
    } else {
      std::tie(out, argmax, preactivation, pooled_weight, std::ignore) =
          call_model_forward_with_argmax(x, weight, bias, pool_kernel_size, scale);
    }
    save_what_backward_needs(ctx, x, weight, bias, pool_kernel_size, scale, pooled_weight,
                             argmax, preactivation);
    return out;
  }

  // One gradient per forward argument, in order (undefined for the non-tensor ones, for an
  // absent bias and for the given fold, which is not differentiated: the gradients reach weight
  // and bias through fold_backward).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads = backward_of(ctx, grad_outputs[0]);
    grads.resize(8);
    return grads;
  }
};

// _model_forward_and_fold's node: ModelForward without a given fold, which also returns the fold
// it made (for ModelNew's cache; no gradient flows through it).
struct ModelForwardAndFold : public torch::autograd::Function<ModelForwardAndFold> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& weight, const OptionalTensor& bias,
                               int64_t pool_kernel_size, double scale) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, argmax, preactivation, pooled_weight, pooled_bias] =
        call_model_forward_with_argmax(x, weight, bias, pool_kernel_size, scale);
    save_what_backward_needs(ctx, x, weight, bias, pool_kernel_size, scale, pooled_weight,
                             argmax, preactivation);
    ctx->mark_non_differentiable({pooled_weight, pooled_bias});
    // No zero-filled gradients for the fold outputs (autograd's default would allocate and fill
    // two fold-sized tensors per backward): only out's gradient is read.
    ctx->set_materialize_grads(false);
    return {out, pooled_weight, pooled_bias};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (!grad_outputs[0].defined()) return variable_list(5);
    variable_list grads = backward_of(ctx, grad_outputs[0]);
    grads.resize(5);
    return grads;
  }
};

// The tangent checks of model_forward and _model_forward_and_fold, after their input checks, in
// the Python node's order (so that the two report the same first error).
void check_no_tangents(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias) {
  check_no_tangent("model_forward", "x", x);
  check_no_tangent("model_forward", "weight", weight);
  if (bias.has_value()) check_no_tangent("model_forward", "bias", *bias);
}

bool needs_grad(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias) {
  return at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() ||
                                        (bias.has_value() && bias->requires_grad()));
}

at::Tensor model_forward_autograd(const at::Tensor& x, const at::Tensor& weight,
                                  const OptionalTensor& bias, int64_t pool_kernel_size,
                                  double scale, const OptionalTensor& pooled_weight,
                                  const OptionalTensor& pooled_bias,
                                  const OptionalTensor& prepared_weight) {
  check_model_forward_inputs(x, weight);
  check_model_forward_folded(weight, bias, pool_kernel_size, pooled_weight, pooled_bias,
                             prepared_weight);
  check_no_tangents(x, weight, bias);
  if (!needs_grad(x, weight, bias)) {  // no node: the device kernel, which checks the rest
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_model_forward(x, weight, bias, pool_kernel_size, scale, pooled_weight,
                              pooled_bias, prepared_weight);
  }
  return ModelForward::apply(x, weight, bias, pool_kernel_size, scale, pooled_weight, pooled_bias,
                             prepared_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> model_forward_and_fold_autograd(
    const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias,
    int64_t pool_kernel_size, double scale) {
  check_model_forward_inputs(x, weight);
  check_no_tangents(x, weight, bias);
  if (!needs_grad(x, weight, bias)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_model_forward_and_fold(x, weight, bias, pool_kernel_size, scale);
  }
  const variable_list outs = ModelForwardAndFold::apply(x, weight, bias, pool_kernel_size, scale);
  return {outs[0], outs[1], outs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_pool_gelu, Autograd, m) {
  m.impl("model_forward", &model_forward_autograd);
  m.impl("_model_forward_and_fold", &model_forward_and_fold_autograd);
}

}  // namespace fused_pool_gelu::node
