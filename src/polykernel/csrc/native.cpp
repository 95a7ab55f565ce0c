// polykernel's native launch path: Triton kernels that Triton compiled, launched from C++.
//
// Why: on the H200 host a Python-side call costs more than the kernel it launches (notes/PERF.md,
// issue 11): Triton's launcher ~6.6 us, each torch allocation ~2-8 us, a Python autograd node
// ~60 us per fwd+bwd. Here an op's whole host path (allocations, launches, its autograd node) is
// C++, as it is for torch's own ops.
//
// What stays in Python, and why this is safe:
// - Triton compiles. A `Slot` (one kernel with fixed constexprs and launch options) keys each
//   launch on what Triton specializes on (device, tensor dtypes and 16-byte alignment, ints equal
//   to 1 / divisible by 16 / their width, bool values). On a key it has not seen, it calls back
//   into Python, which launches through `kernel[grid]` (compiling if needed) and hands back the
//   compiled function's handle and parameter layout. So C++ only ever launches a kernel that
//   Triton compiled for that exact key, with the parameters Triton's own launcher would pass.
// - The parameter layout (which arguments are constexpr-specialized away, their widths, trailing
//   scratch pointers) comes from Triton's compiled signature and is checked against the driver's
//   view of the function (cuFuncGetParamInfo) before it is used; any mismatch leaves that key on
//   the Python path.
// - Tile shapes and grid sizes are chosen in Python (one place: the kernel files) and handed over
//   as a per-shape plan; C++ only does the grid arithmetic that depends on the row count.
//
// No CUDA toolkit is needed to build this: the few driver entry points are looked up in
// libcuda at first use, and the current stream comes from c10's device-guard interface.
//
// The parts, included into this one translation unit (csrc/README.md says what each op's host side
// does):
// - driver.h: the CUDA driver entry points, the current device, stream and context;
// - slot.h: everything tied to Triton's launcher (keys, parameter packing, the Slot), behind a
//   check of the Triton release;
// - plans.h: the per-op plan tables;
// - ops/*.h: one file per op: its plan, launches, autograd node and entry points;
// - here: the Python module.

#include "ops/fused_add_rms_norm.h"
#include "ops/glu.h"
#include "ops/glu_and_mul.h"
#include "ops/layer_norm.h"
#include "ops/quant_fp8.h"
#include "ops/rms_norm.h"
#include "ops/rope.h"
#include "ops/rotary_embedding.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Test hooks: the key and the packed parameters of Python arguments

Arg arg_from_py(py::handle h, std::vector<Tensor>& keep) {
  if (THPVariable_Check(h.ptr())) {
    keep.push_back(THPVariable_Unpack(h.ptr()));
    return T(keep.back());
  }
  if (PyBool_Check(h.ptr())) return Arg{'b', nullptr, h.ptr() == Py_True ? 1 : 0, 0.0};
  if (PyLong_Check(h.ptr())) return I(h.cast<int64_t>());
  if (PyFloat_Check(h.ptr())) return F(h.cast<double>());
  throw py::type_error("polykernel native launch: arguments must be tensors, ints, floats or bools");
}

std::vector<Arg> args_from_py(const py::args& args, std::vector<Tensor>& keep) {
  keep.reserve(args.size());  // Args point into it: it must not reallocate
  std::vector<Arg> out;
  out.reserve(args.size());
  for (const auto& h : args) out.push_back(arg_from_py(h, keep));
  return out;
}

py::bytes key_for(int device, py::args args) {
  std::vector<Tensor> keep;
  std::vector<Arg> a = args_from_py(args, keep);
  return py::bytes(key_of(device, a.data(), static_cast<int>(a.size())));
}

// The packed parameter bytes Triton's kernel would receive (tests compare with the values).
py::bytes pack_for(const std::string& kinds, int scratch, py::args args) {
  std::vector<Tensor> keep;
  std::vector<Arg> a = args_from_py(args, keep);
  Value vals[kMaxParams];
  void* params[kMaxParams];
  const int count = pack(kinds, scratch, a.data(), static_cast<int>(a.size()), vals, params);
  std::string out;
  int j = 0;
  for (char kind : kinds) {
    if (kind == 0) continue;
    out.append(reinterpret_cast<const char*>(params[j++]), kind_size(kind));
  }
  for (; j < count; ++j) out.append(reinterpret_cast<const char*>(params[j]), 8);
  return py::bytes(out);
}

void clear_plans() {
  plans<RmsPlan>().clear();
  plans<LnPlan>().clear();
  plans<AddRmsPlan>().clear();
  plans<GluPlan>().clear();
  plans<AndMulPlan>().clear();
  plans<RopePlan>().clear();
  plans<RotaryPlan>().clear();
  plans<QuantPlan>().clear();
}

}  // namespace

// Per op NAME: NAME(...) runs the op (None: the Python path), NAME_plan_state(...) and
// set_NAME_plan(..., plan) read and store its plan (backends/triton/_native.call).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "polykernel's native launch path (see native.cpp)";
  py::class_<Slot, SlotPtr>(m, "Slot")
      .def(py::init<py::object>())
      .def("add", &Slot::add)
      .def("launches", &Slot::launches);
  m.def("driver_error", [] { return driver().error; });
  m.def("accept_triton", &accept_triton, py::arg("major"), py::arg("minor"));
  m.def("current_stream", [](int device) {
    return reinterpret_cast<uint64_t>(
        cuda_guard()->getStream(c10::Device(c10::DeviceType::CUDA, device)).native_handle());
  });
  m.def("rms_norm", &rms_norm);
  m.def("rms_norm_plan_state", &rms_plan_state);
  m.def("set_rms_norm_plan", &set_rms_plan);
  m.def("layer_norm", &layer_norm, py::arg("x"), py::arg("w").none(true), py::arg("b").none(true), py::arg("eps"));
  m.def("layer_norm_plan_state", &ln_plan_state, py::arg("x"), py::arg("w").none(true), py::arg("b").none(true));
  m.def("set_layer_norm_plan", &set_ln_plan, py::arg("x"), py::arg("w").none(true), py::arg("b").none(true), py::arg("plan"));
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("fused_add_rms_norm_plan_state", &add_rms_plan_state);
  m.def("set_fused_add_rms_norm_plan", &set_add_rms_plan);
  m.def("fused_add_rms_norm_inplace", &fused_add_rms_norm_inplace);  // fused_add_rms_norm_: the same plans
  m.def("fused_add_rms_norm_inplace_plan_state", &add_rms_plan_state);
  m.def("set_fused_add_rms_norm_inplace_plan", &set_add_rms_plan);
  m.def("glu", &glu);
  m.def("glu_plan_state", &glu_plan_state);
  m.def("set_glu_plan", &set_glu_plan);
  m.def("glu_and_mul", &glu_and_mul, py::arg("x"), py::arg("out").none(true), py::arg("act"));
  m.def("glu_and_mul_plan_state", &and_mul_plan_state);
  m.def("set_glu_and_mul_plan", &set_and_mul_plan);
  m.def("rope", &rope);
  m.def("rope_plan_state", &rope_plan_state);
  m.def("set_rope_plan", &set_rope_plan);
  m.def("rotary_embedding", &rotary_embedding, py::arg("positions"), py::arg("query"), py::arg("key").none(true),
        py::arg("head_size"), py::arg("cos_sin_cache"), py::arg("is_neox"));
  m.def("rotary_embedding_plan_state", &rotary_plan_state, py::arg("query"), py::arg("key").none(true), py::arg("head_size"),
        py::arg("cos_sin_cache"), py::arg("is_neox"));
  m.def("set_rotary_embedding_plan", &set_rotary_plan, py::arg("query"), py::arg("key").none(true), py::arg("head_size"),
        py::arg("cos_sin_cache"), py::arg("is_neox"), py::arg("plan"));
  m.def("static_quant_fp8", &static_quant_fp8);  // the three quantisers share one plan table
  m.def("static_quant_fp8_plan_state", &quant_plan_state);
  m.def("set_static_quant_fp8_plan", &set_quant_plan);
  m.def("dynamic_quant_fp8", &dynamic_quant_fp8);
  m.def("dynamic_quant_fp8_plan_state", &quant_plan_state);
  m.def("set_dynamic_quant_fp8_plan", &set_quant_plan);
  m.def("rms_norm_quant_fp8", &rms_norm_quant_fp8);
  m.def("rms_norm_quant_fp8_plan_state", &quant_plan_state);
  m.def("set_rms_norm_quant_fp8_plan", &set_quant_plan);
  m.def("clear_plans", &clear_plans);
  m.def("key_for", &key_for);
  m.def("pack_for", &pack_for);
}
