// model_forward's and model_backward's device kernels: the whole block on the unfolded Linear
// parameters, forward(x, *fold(weight, bias, k), scale), and its backward, each as one call of the
// device's own kernels (no dispatcher in between). model_forward's autograd (one node: fold and
// forward_with_argmax forward, model_backward backward) is registered apart (the C++ node of
// csrc/autograd_node/, or fused_pool_gelu/_autograd.py's); model_forward's kernels serve the calls
// that need no gradient, and _model_forward_with_argmax's that node's forward.
// _model_forward_and_fold is model_forward that also returns the fold it made, ModelNew's training
// call after a parameter update (its cache keeps the fold).
//
// A caller that holds fold(weight, bias, k) (ModelNew's cache, unchanged parameters) passes it as
// pooled_weight and pooled_bias, with its prepared copy if it has one: the forward then skips the
// fold, and the backward is the same (fold_backward needs none of fold's values), so gradient
// accumulation and evaluation with grad enabled fold once per parameter update.
//
// Inputs are validated by the kernels it calls, so errors name them (fold: for weight, bias and
// pool_kernel_size; forward: for x), as they do when ModelNew calls the ops one by one; x's width
// against the unfolded weight first (check_model_forward_inputs), which forward would report
// against the pooled weight.
#include <optional>
#include <tuple>

#include "checks.h"
#include "cpu/kernels.h"
#include "stable_tensor.h"
#if FPG_WITH_CUDA
#include "cuda/kernels.h"
#endif

namespace fused_pool_gelu {
namespace {

template <auto fold, auto forward_with_argmax>
Tensor model_forward_kernel(const Tensor& x, const Tensor& weight,
                            const std::optional<Tensor>& bias, int64_t pool_kernel_size,
                            double scale, const std::optional<Tensor>& pooled_weight,
                            const std::optional<Tensor>& pooled_bias,
                            const std::optional<Tensor>& prepared_weight) {
  check_model_forward_inputs(x, weight);
  check_model_forward_folded(weight, bias, pool_kernel_size, pooled_weight, pooled_bias,
                             prepared_weight);
  if (pooled_weight.has_value()) {
    return std::get<0>(forward_with_argmax(x, *pooled_weight, *pooled_bias, scale,
                                           prepared_weight));
  }
  const auto [folded_weight, folded_bias] = fold(weight, bias, pool_kernel_size);
  return std::get<0>(forward_with_argmax(x, folded_weight, folded_bias, scale, std::nullopt));
}

// _model_forward_with_argmax: the forward of model_forward's autograd node (C++ or Python), which
// saves argmax, preactivation and the fold for model_backward, and returns the fold as well from
// _model_forward_and_fold. One call instead of fold's and forward_with_argmax's: host time per
// training step after each parameter update.
template <auto fold, auto forward_with_argmax>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> model_forward_with_argmax_kernel(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
    int64_t pool_kernel_size, double scale) {
  check_model_forward_inputs(x, weight);
  auto [pooled_weight, pooled_bias] = fold(weight, bias, pool_kernel_size);
  auto [out, argmax, preactivation] =
      forward_with_argmax(x, pooled_weight, pooled_bias, scale, std::nullopt);
  return {out, argmax, preactivation, pooled_weight, pooled_bias};
}

// _model_forward_and_fold: model_forward's output and the fold it made, for ModelNew's cache (its
// autograd kernel, the C++ or Python node, calls _model_forward_with_argmax below autograd; this
// serves calls that need no gradient).
template <auto fold, auto forward_with_argmax>
std::tuple<Tensor, Tensor, Tensor> model_forward_and_fold_kernel(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
    int64_t pool_kernel_size, double scale) {
  auto outs = model_forward_with_argmax_kernel<fold, forward_with_argmax>(
      x, weight, bias, pool_kernel_size, scale);  // out, argmax, preactivation, the fold
  return {std::get<0>(outs), std::get<3>(outs), std::get<4>(outs)};
}

// model_backward on the CPU: the two ops it stands for (CUDA has a kernel of its own, which skips
// the pooled gradient's zero rows: cuda/backward.cu).
std::tuple<Tensor, Tensor, Tensor> model_backward_cpu(
    const Tensor& grad_out, const Tensor& x, const Tensor& pooled_weight, const Tensor& argmax,
    const Tensor& preactivation, double scale, int64_t out_features, int64_t pool_kernel_size) {
  check_model_backward_inputs(grad_out, x, pooled_weight, argmax, preactivation, out_features,
                              pool_kernel_size);
  auto [grad_x, grad_pooled_weight, grad_pooled_bias] =
      cpu::forward_backward(grad_out, std::nullopt, x, pooled_weight, argmax, preactivation, scale);
  auto [grad_weight, grad_bias] =
      cpu::fold_backward(grad_pooled_weight, grad_pooled_bias, out_features, pool_kernel_size);
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CPU, m) {
  m.impl("model_forward",
         TORCH_BOX((&model_forward_kernel<cpu::fold, cpu::forward_with_argmax>)));
  m.impl("_model_forward_with_argmax",
         TORCH_BOX((&model_forward_with_argmax_kernel<cpu::fold, cpu::forward_with_argmax>)));
  m.impl("_model_forward_and_fold",
         TORCH_BOX((&model_forward_and_fold_kernel<cpu::fold, cpu::forward_with_argmax>)));
  m.impl("model_backward", TORCH_BOX(&model_backward_cpu));
}

#if FPG_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CUDA, m) {
  m.impl("model_forward",
         TORCH_BOX((&model_forward_kernel<cuda::fold, cuda::forward_with_argmax>)));
  m.impl("_model_forward_with_argmax",
         TORCH_BOX((&model_forward_with_argmax_kernel<cuda::fold, cuda::forward_with_argmax>)));
  m.impl("_model_forward_and_fold",
         TORCH_BOX((&model_forward_and_fold_kernel<cuda::fold, cuda::forward_with_argmax>)));
}
#endif

}  // namespace fused_pool_gelu
