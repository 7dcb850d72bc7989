// Every operator schema of fused_pool_gelu, in one place, and the Python module stub.
//
// The math (docs/design.md):
//   fold:    pooled_weight[n] = mean_r weight[n*k + r],  pooled_bias[n] = mean_r bias[n*k + r]
//   forward: out[b] = max_n scale * gelu(x[b] . pooled_weight[n] + pooled_bias[n])
// Device kernels register themselves next to their code (csrc/cpu/*.cpp, csrc/cuda/*.cu), and so
// do model_forward's kernels (csrc/model_forward.cpp); the fake kernels, autograd formulas and
// autocast kernels registered from Python live in fused_pool_gelu/_fake.py, _autograd.py and
// _autocast.py.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "checks.h"
#include "cuda/forward_plan.h"
#include "debug_knobs.h"
#include "op_calls.h"

namespace fused_pool_gelu {

// forward on a device: forward_with_argmax without the outputs kept for backward.
static at::Tensor forward_kernel(const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, double scale,
                                 const c10::optional<at::Tensor>& prepared_weight) {
  return std::get<0>(call_forward_with_argmax(x, weight, bias, scale, prepared_weight));
}

// forward's autograd kernel. When a gradient is needed it goes through forward_with_argmax, whose
// derivative is registered in Python (_autograd.py); otherwise it dispatches straight to the device
// kernel, skipping the Python autograd layer: microseconds that matter at small batch.
static at::Tensor forward_autograd(const at::Tensor& x, const at::Tensor& weight,
                                   const c10::optional<at::Tensor>& bias, double scale,
                                   const c10::optional<at::Tensor>& prepared_weight) {
  check_no_tangent("forward", "x", x);
  check_no_tangent("forward", "weight", weight);
  if (bias.has_value()) check_no_tangent("forward", "bias", *bias);
  const bool needs_grad =
      at::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (bias.has_value() && bias->requires_grad()));
  if (needs_grad) return forward_kernel(x, weight, bias, scale, prepared_weight);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return forward_kernel(x, weight, bias, scale, prepared_weight);
}

// prepare_weight's autograd kernel: not differentiable (a copy in another precision, for the
// forward's selection only), so its output never carries a gradient function.
static at::Tensor prepare_weight_autograd(const at::Tensor& weight) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_prepare_weight(weight);
}

TORCH_LIBRARY(fused_pool_gelu, m) {
  // One line each; the public ops' contracts in full: their wrappers' docstrings (ops.py).
  // Average-pool groups of k rows of a Linear's weight and bias (the O % k tail rows dropped).
  m.def("fold(Tensor weight, Tensor? bias, int pool_kernel_size) -> (Tensor, Tensor)");
  // Adjoint of fold: grad_weight[n*k + r] = grad_pooled_weight[n] / k, tail rows zero.
  m.def(
      "fold_backward(Tensor grad_pooled_weight, Tensor grad_pooled_bias, int out_features, "
      "int pool_kernel_size) -> (Tensor, Tensor)");
  // out[b] = max_n scale * gelu(x[b] . weight[n] + bias[n]), its arg-max n and z there.
  m.def(
      "forward_with_argmax(Tensor x, Tensor weight, Tensor? bias, float scale, "
      "Tensor? prepared_weight=None) -> (Tensor out, Tensor argmax, Tensor preactivation)");
  // The public forward: out [B] of forward_with_argmax (differentiable through it).
  m.def(
      "forward(Tensor x, Tensor weight, Tensor? bias, float scale, "
      "Tensor? prepared_weight=None) -> Tensor");
  // The certified path's scaled fp16 copy of the pooled weight and its norms (prepared_weight.h).
  m.def("prepare_weight(Tensor weight) -> Tensor");
  // Arg-max backward of forward_with_argmax: a gather and a deterministic segment reduction.
  m.def(
      "forward_backward(Tensor? grad_out, Tensor? grad_preactivation, Tensor x, Tensor weight, "
      "Tensor argmax, Tensor preactivation, float scale) -> "
      "(Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");
  // model_forward's backward: forward_backward, then fold_backward (the same bits as the two).
  m.def(
      "model_backward(Tensor grad_out, Tensor x, Tensor pooled_weight, Tensor argmax, "
      "Tensor preactivation, float scale, int out_features, int pool_kernel_size) -> "
      "(Tensor grad_x, Tensor grad_weight, Tensor grad_bias)");
  // forward(x, *fold(weight, bias, k), scale) as one C++ autograd node (ModelNew's training); a
  // caller that holds that fold (and its prepared copy) passes it instead of refolding.
  m.def(
      "model_forward(Tensor x, Tensor weight, Tensor? bias, int pool_kernel_size, float scale, "
      "Tensor? pooled_weight=None, Tensor? pooled_bias=None, Tensor? prepared_weight=None) "
      "-> Tensor");
  // Diagnostics: per row, the columns the certified selection sends to rescoring (-1: all).
  m.def(
      "_certified_candidate_counts(Tensor x, Tensor weight, Tensor? bias, float scale) -> Tensor");
}

// prepare_weight where no kernel of its device is registered, and with weight None (a call with no
// tensor lands here): the kernels' error instead of the dispatcher's.
static at::Tensor prepare_weight_without_kernel(const at::Tensor& weight) {
  check_defined("prepare_weight", "weight", weight);
  TORCH_CHECK(false, "fused_pool_gelu.prepare_weight: weight must be on the CPU or a CUDA device, "
              "got ", weight.device());
}

TORCH_LIBRARY_IMPL(fused_pool_gelu, CompositeExplicitAutograd, m) {
  m.impl("forward", &forward_kernel);
  m.impl("prepare_weight", &prepare_weight_without_kernel);
}

TORCH_LIBRARY_IMPL(fused_pool_gelu, Autograd, m) {
  m.impl("forward", &forward_autograd);
  m.impl("prepare_weight", &prepare_weight_autograd);
}

// torch.func's forward-mode transforms (jvp, jacfwd, hessian) run an op's autograd-level kernels
// (Autograd, then ADInplaceOrView) at the transform's level, where an input's tangent is still
// visible (_fw_grad(0) on functorch's wrapper), then unwrap the inputs and call the device kernel,
// whose own check_no_tangent then sees none: without a check at these keys an op without a
// forward-mode formula, as these are, returns a tangent of zeros with no error. forward and
// model_forward check in their C++ autograd kernels (whose calls below autograd skip this key);
// the ops whose autograd kernels are Python's (register_autograd in _autograd.py) check here, one
// key below them. Inputs without a tangent (constants inside a transform) pass: their result's
// zero tangent is the right one.
// A call whose tensor arguments are all None reaches this key too (it is always in the dispatch
// key set), and nothing below it: with no tensor there is no device to dispatch to. It gets the
// error the kernels give for a None tensor, not the dispatcher's "no tensor arguments".
static void check_arguments_and_redispatch(const c10::OperatorHandle& op,
                                           c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  // The op's short name only for the errors: no string work on the calls that pass.
  const auto op_name = [&op] {
    const std::string& name = op.schema().name();  // "fused_pool_gelu::fold"
    return name.substr(name.find("::") + 2);
  };
  bool any_tensor = false;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor() || !value.toTensor().defined()) continue;
    any_tensor = true;
    if (value.toTensor()._fw_grad(/*level=*/0).defined()) {
      check_no_tangent(op_name().c_str(), arguments[i].name().c_str(), value.toTensor());
    }
  }
  if (!any_tensor) {
    // Named as the kernels' checks name it (forward_with_argmax's as forward's: checks.h).
    const std::string name = op_name() == "forward_with_argmax" ? "forward" : op_name();
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (arguments[i].type()->kind() == c10::TypeKind::TensorType) {
        check_defined(name.c_str(), arguments[i].name().c_str(), at::Tensor());
      }
    }
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

TORCH_LIBRARY_IMPL(fused_pool_gelu, ADInplaceOrView, m) {
  // forward, model_forward and prepare_weight have kernels of their own that check (see above).
  for (const char* op : {"fold", "fold_backward", "forward_with_argmax", "forward_backward",
                         "model_backward", "_certified_candidate_counts"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&check_arguments_and_redispatch>());
  }
}

}  // namespace fused_pool_gelu

// Facts fixed when this binary was compiled (setup.py passes them as macros).
#ifndef FPG_TORCH_VERSION
#define FPG_TORCH_VERSION "unknown"
#endif
#ifndef FPG_CUDA_VERSION
#define FPG_CUDA_VERSION ""
#endif
#ifndef FPG_CUDA_ARCHS
#define FPG_CUDA_ARCHS ""
#endif
#ifndef FPG_WITH_CUDA
#define FPG_WITH_CUDA 0
#endif
#ifndef FPG_DEBUG
#define FPG_DEBUG 0
#endif

static PyObject* compiled_build_info(PyObject*, PyObject*) {
  return Py_BuildValue("{s:s,s:s,s:s,s:O,s:O}", "torch", FPG_TORCH_VERSION, "cuda",
                       FPG_CUDA_VERSION, "cuda_archs", FPG_CUDA_ARCHS, "with_cuda",
                       FPG_WITH_CUDA ? Py_True : Py_False, "debug",
                       FPG_DEBUG ? Py_True : Py_False);
}

// The planner's view of a CUDA device (cuda/forward_plan.h's DeviceLimits), for the tests.
static PyObject* device_limits(PyObject*, PyObject* arg) {
#if FPG_WITH_CUDA
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return nullptr;
  try {
    const fused_pool_gelu::cuda::DeviceLimits& l =
        fused_pool_gelu::cuda::device_limits_of(static_cast<int>(device));
    static_assert(fused_pool_gelu::cuda::fg::kNumSimtBatchTiles == 5, "the simt tuple below");
    const int* simt = l.simt_ctas_per_sm;
    return Py_BuildValue("{s:i,s:(iiiii),s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "sms", l.sms, "simt",
                         simt[0], simt[1], simt[2], simt[3], simt[4], "tc_gemv",
                         l.tc_gemv_ctas_per_sm, "tc", l.tc_ctas_per_sm, "wgmma",
                         l.wgmma_ctas_per_sm, "epilogue", l.epilogue_one_split_ctas_per_sm,
                         "smem_per_sm", l.smem_per_sm, "spread_smem_max", l.spread_smem_max,
                         "dependent_launch", l.dependent_launch ? 1 : 0);
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
#else
  (void)arg;
  PyErr_SetString(PyExc_RuntimeError, "fused_pool_gelu was built without CUDA kernels");
  return nullptr;
#endif
}

static PyObject* reload_debug_knobs(PyObject*, PyObject*) {
  fused_pool_gelu::reload_debug_knobs();
  Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"compiled_build_info", compiled_build_info, METH_NOARGS,
     "What this binary was built against: torch and CUDA versions, CUDA archs, debug."},
    {"_device_limits", device_limits, METH_O,
     "The forward planner's limits of a CUDA device (csrc/cuda/forward_plan.h's DeviceLimits)."},
    {"_reload_debug_knobs", reload_debug_knobs, METH_NOARGS,
     "Reads the FUSED_POOL_GELU_* debug knobs (csrc/debug_knobs.h) from the environment again."},
    {nullptr, nullptr, 0, nullptr}};

// Importing fused_pool_gelu._C loads this library, which runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                                          module_methods};
  return PyModule_Create(&module_def);
}
