// What every part of the native launch path includes: torch's extension and autograd headers,
// and the names they share. One translation unit (native.cpp) includes all the parts.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A backward asked to build a graph (create_graph=True: grad mode is on inside it) would return
// gradients with no graph, i.e. second derivatives of zero: refuse clearly instead. The Python
// path of the same impls (POLYKERNEL_NATIVE=0) differentiates through the op's torch formula.
inline void refuse_double_backward(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "polykernel.", op,
              " (triton, native launch path): double backward (create_graph=True) is not supported on the native "
              "path; POLYKERNEL_NATIVE=0 runs the Python path, which supports it");
}
