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
