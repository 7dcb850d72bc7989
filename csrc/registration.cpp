// Every operator schema of fused_pool_gelu, in one place, and the Python module stub.
//
// The math (docs/design.md):
//   fold:    pooled_weight[n] = mean_r weight[n*k + r],  pooled_bias[n] = mean_r bias[n*k + r]
//   forward: out[b] = max_n scale * gelu(x[b] . pooled_weight[n] + pooled_bias[n])
// Device kernels register themselves next to their code (csrc/cpu/*.cpp, csrc/cuda/*.cu,
// csrc/model_forward.cpp). Everything the stable ABI cannot express is registered from Python:
// the autograd kernels (with their forward-mode AD checks), the fake kernels and the autocast
// kernels (fused_pool_gelu/_autograd.py, _fake.py, _autocast.py).
#include <Python.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "checks.h"
#include "debug_knobs.h"
#include "stable_tensor.h"
#if FPG_WITH_CUDA
#include "cuda/forward_plan.h"
#endif

namespace fused_pool_gelu {

STABLE_TORCH_LIBRARY(fused_pool_gelu, m) {
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
  // forward(x, *fold(weight, bias, k), scale): ModelNew's training path (one autograd node); a
  // caller that holds that fold (and its prepared copy) passes it instead of refolding.
  m.def(
      "model_forward(Tensor x, Tensor weight, Tensor? bias, int pool_kernel_size, float scale, "
      "Tensor? pooled_weight=None, Tensor? pooled_bias=None, Tensor? prepared_weight=None) "
      "-> Tensor");
  // model_forward's training forward: forward_with_argmax's outputs and the fold, which the
  // Python autograd node saves and ModelNew caches (one call where the two ops would be two).
  m.def(
      "_model_forward_with_argmax(Tensor x, Tensor weight, Tensor? bias, int pool_kernel_size, "
      "float scale) -> (Tensor out, Tensor argmax, Tensor preactivation, Tensor pooled_weight, "
      "Tensor pooled_bias)");
  // model_forward without a given fold, also returning the fold it made (no gradient flows through
  // those two): ModelNew's training call after a parameter update, whose cache keeps that fold.
  m.def(
      "_model_forward_and_fold(Tensor x, Tensor weight, Tensor? bias, int pool_kernel_size, "
      "float scale) -> (Tensor out, Tensor pooled_weight, Tensor pooled_bias)");
  // Diagnostics: per row, the columns the certified selection sends to rescoring (-1: all).
  m.def(
      "_certified_candidate_counts(Tensor x, Tensor weight, Tensor? bias, float scale) -> Tensor");
}

// Each op where no kernel of its device is registered, and with all its tensors None (a call with
// no tensor lands here): the kernels' error for the first tensor that is None, else for the device,
// instead of the dispatcher's "There were no tensor arguments".
[[noreturn]] static void fail_without_kernel(const char* op,
                                             std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  const Tensor* first = nullptr;
  for (const auto& [name, t] : tensors) {
    check_defined(op, name, *t);
    if (first == nullptr) first = t;
  }
  fail("fused_pool_gelu.", op, ": ", tensors.begin()->first,
       " must be on the CPU or a CUDA device, got ", device_text(*first));
}

static std::tuple<Tensor, Tensor> fold_without_kernel(const Tensor& weight,
                                                      const std::optional<Tensor>&, int64_t) {
  fail_without_kernel("fold", {{"weight", &weight}});
}

static std::tuple<Tensor, Tensor> fold_backward_without_kernel(const Tensor& grad_pooled_weight,
                                                               const Tensor& grad_pooled_bias,
                                                               int64_t, int64_t) {
  fail_without_kernel("fold_backward", {{"grad_pooled_weight", &grad_pooled_weight},
                                        {"grad_pooled_bias", &grad_pooled_bias}});
}

// forward_with_argmax's errors are labelled forward (checks.h).
static std::tuple<Tensor, Tensor, Tensor> forward_with_argmax_without_kernel(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>&, double,
    const std::optional<Tensor>&) {
  fail_without_kernel("forward", {{"x", &x}, {"weight", &weight}});
}

static Tensor forward_without_kernel(const Tensor& x, const Tensor& weight,
                                     const std::optional<Tensor>&, double,
                                     const std::optional<Tensor>&) {
  fail_without_kernel("forward", {{"x", &x}, {"weight", &weight}});
}

static Tensor model_forward_without_kernel(const Tensor& x, const Tensor& weight,
                                           const std::optional<Tensor>&, int64_t, double,
                                           const std::optional<Tensor>&,
                                           const std::optional<Tensor>&,
                                           const std::optional<Tensor>&) {
  fail_without_kernel("model_forward", {{"x", &x}, {"weight", &weight}});
}

static std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> model_forward_with_argmax_without_kernel(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>&, int64_t, double) {
  fail_without_kernel("_model_forward_with_argmax", {{"x", &x}, {"weight", &weight}});
}

static std::tuple<Tensor, Tensor, Tensor> model_forward_and_fold_without_kernel(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>&, int64_t, double) {
  fail_without_kernel("model_forward", {{"x", &x}, {"weight", &weight}});
}

static std::tuple<Tensor, Tensor, Tensor> forward_backward_without_kernel(
    const std::optional<Tensor>&, const std::optional<Tensor>&, const Tensor& x,
    const Tensor& weight, const Tensor& argmax, const Tensor& preactivation, double) {
  fail_without_kernel("forward_backward", {{"x", &x}, {"weight", &weight}, {"argmax", &argmax},
                                           {"preactivation", &preactivation}});
}

static std::tuple<Tensor, Tensor, Tensor> model_backward_without_kernel(
    const Tensor& grad_out, const Tensor& x, const Tensor& pooled_weight, const Tensor& argmax,
    const Tensor& preactivation, double, int64_t, int64_t) {
  fail_without_kernel("model_backward",
                      {{"grad_out", &grad_out}, {"x", &x}, {"pooled_weight", &pooled_weight},
                       {"argmax", &argmax}, {"preactivation", &preactivation}});
}

static Tensor prepare_weight_without_kernel(const Tensor& weight) {
  fail_without_kernel("prepare_weight", {{"weight", &weight}});
}

STABLE_TORCH_LIBRARY_IMPL(fused_pool_gelu, CompositeExplicitAutograd, m) {
  m.impl("fold", TORCH_BOX(&fold_without_kernel));
  m.impl("fold_backward", TORCH_BOX(&fold_backward_without_kernel));
  m.impl("forward_with_argmax", TORCH_BOX(&forward_with_argmax_without_kernel));
  m.impl("forward", TORCH_BOX(&forward_without_kernel));
  m.impl("model_forward", TORCH_BOX(&model_forward_without_kernel));
  m.impl("_model_forward_with_argmax", TORCH_BOX(&model_forward_with_argmax_without_kernel));
  m.impl("_model_forward_and_fold", TORCH_BOX(&model_forward_and_fold_without_kernel));
  m.impl("forward_backward", TORCH_BOX(&forward_backward_without_kernel));
  m.impl("model_backward", TORCH_BOX(&model_backward_without_kernel));
  m.impl("prepare_weight", TORCH_BOX(&prepare_weight_without_kernel));
}

}  // namespace fused_pool_gelu

// Facts fixed when this binary was compiled (setup.py passes them as macros).
#ifndef FPG_TORCH_VERSION
#define FPG_TORCH_VERSION "unknown"
#endif
#ifndef FPG_TORCH_TARGET
#define FPG_TORCH_TARGET "unknown"
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
  return Py_BuildValue("{s:s,s:s,s:s,s:s,s:O,s:O}", "torch", FPG_TORCH_VERSION, "torch_target",
                       FPG_TORCH_TARGET, "cuda", FPG_CUDA_VERSION, "cuda_archs", FPG_CUDA_ARCHS, "with_cuda",
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
     "What this binary was built with: the torch it was compiled against, the oldest torch whose "
     "stable ABI it targets, the CUDA version and archs, debug."},
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
