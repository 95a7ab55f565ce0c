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

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <atomic>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------------------------------------
// CUDA driver entry points

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using CUdevice = int;

struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*param_info)(CUfunction, size_t, size_t*, size_t*) = nullptr;  // CUDA >= 12.4
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  std::string error;  // why the driver is unusable; empty when it is usable
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = "libcuda.so.1 could not be loaded";
      return d;
    }
    d.launch = reinterpret_cast<decltype(d.launch)>(dlsym(lib, "cuLaunchKernel"));
    d.ctx_get_current = reinterpret_cast<decltype(d.ctx_get_current)>(dlsym(lib, "cuCtxGetCurrent"));
    d.ctx_set_current = reinterpret_cast<decltype(d.ctx_set_current)>(dlsym(lib, "cuCtxSetCurrent"));
    d.primary_ctx_retain = reinterpret_cast<decltype(d.primary_ctx_retain)>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    d.device_get = reinterpret_cast<decltype(d.device_get)>(dlsym(lib, "cuDeviceGet"));
    d.param_info = reinterpret_cast<decltype(d.param_info)>(dlsym(lib, "cuFuncGetParamInfo"));
    d.error_string = reinterpret_cast<decltype(d.error_string)>(dlsym(lib, "cuGetErrorString"));
    if (!d.launch || !d.ctx_get_current || !d.ctx_set_current || !d.primary_ctx_retain || !d.device_get ||
        !d.error_string) {
      d.error = "libcuda lacks an entry point this path uses";
    } else if (!d.param_info) {
      d.error = "libcuda lacks cuFuncGetParamInfo (driver older than CUDA 12.4)";
    }
    return d;
  }();
  return d;
}

void check(CUresult r, const char* what) {
  if (r == 0) return;
  const char* msg = nullptr;
  driver().error_string(r, &msg);
  throw std::runtime_error(std::string("polykernel native launch: ") + what + " failed: " + (msg ? msg : "?"));
}

const c10::impl::DeviceGuardImplInterface* cuda_guard() {
  static const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl;
}

// The current device's primary context must be current on this thread (autograd's device threads
// have it; a fresh thread may not), as in Triton's own launcher.
void ensure_context(int device) {
  const Driver& d = driver();
  CUcontext ctx = nullptr;
  check(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) return;
  CUdevice dev = 0;
  check(d.device_get(&dev, device), "cuDeviceGet");
  check(d.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(d.ctx_set_current(ctx), "cuCtxSetCurrent");
}

// ---------------------------------------------------------------------------------------------
// Arguments, keys and parameter packing

struct Arg {
  char kind;  // 't' tensor, 'i' int, 'f' float, 'b' bool
  const Tensor* t;
  int64_t i;
  double f;
};

inline Arg T(const Tensor& t) { return Arg{'t', &t, 0, 0.0}; }
inline Arg I(int64_t i) { return Arg{'i', nullptr, i, 0.0}; }
inline Arg F(double f) { return Arg{'f', nullptr, 0, f}; }

// The specialization key of one launch: device, then per argument what Triton specializes on.
// Finer than Triton's key only costs an extra entry (a miss), never a wrong kernel.
std::string key_of(int device, const Arg* a, int n) {
  std::string key;
  key.reserve(2 + 2 * n);
  key.push_back(static_cast<char>(device));
  for (int k = 0; k < n; ++k) {
    switch (a[k].kind) {
      case 't':
        key.push_back(static_cast<char>(a[k].t->scalar_type()));
        key.push_back((reinterpret_cast<uintptr_t>(a[k].t->data_ptr()) & 15) == 0 ? 'A' : 'u');
        break;
      case 'i': {
        const int64_t v = a[k].i;
        char bits = '@';  // 0x40: the low three bits are free
        bits |= (v == 1) ? 1 : 0;
        bits |= (v % 16 == 0) ? 2 : 0;
        bits |= (v >= INT32_MIN && v <= INT32_MAX) ? 4 : 0;
        key.push_back('i');
        key.push_back(bits);
        break;
      }
      case 'b':
        key.push_back('b');
        key.push_back(a[k].i ? '1' : '0');
        break;
      default:
        key.push_back('f');
        key.push_back('.');
    }
  }
  return key;
}

union Value {
  void* p;
  int32_t i;
  int64_t l;
  float f;
  double d;
};

constexpr int kMaxParams = 48;

// Pack the launch parameters as Triton's launcher does: every non-constexpr argument in order
// (kinds: 0 skipped, 'p' pointer, 'i' i32, 'l' i64, 'f' fp32, 'd' fp64), then `scratch` null
// pointers (Triton's global and profile scratch, unused by these kernels). Ints fill 'i'/'l' and
// floats 'f'/'d': Triton typed them so, and the key (which holds each argument's kind) keeps a
// layout to the arguments it was made for.
int pack(const std::string& kinds, int scratch, const Arg* a, int n, Value* vals, void** params) {
  if (static_cast<int>(kinds.size()) != n) throw std::runtime_error("polykernel native launch: argument count changed");
  int j = 0;
  for (int k = 0; k < n; ++k) {
    const char kind = kinds[k];
    if (kind == 0) continue;
    if (j >= kMaxParams) throw std::runtime_error("polykernel native launch: too many parameters");
    switch (kind) {
      case 'p':
        if (a[k].kind != 't') throw std::runtime_error("polykernel native launch: pointer parameter given a non-tensor");
        vals[j].p = a[k].t->data_ptr();
        break;
      case 'i':
        vals[j].i = static_cast<int32_t>(a[k].i);
        break;
      case 'l':
        vals[j].l = a[k].i;
        break;
      case 'f':
        vals[j].f = static_cast<float>(a[k].f);
        break;
      case 'd':
        vals[j].d = a[k].f;
        break;
      default:
        throw std::runtime_error("polykernel native launch: unknown parameter kind");
    }
    params[j] = &vals[j];
    ++j;
  }
  for (int s = 0; s < scratch; ++s) {
    vals[j].p = nullptr;
    params[j] = &vals[j];
    ++j;
  }
  return j;
}

size_t kind_size(char kind) { return (kind == 'i' || kind == 'f') ? 4 : 8; }

// ---------------------------------------------------------------------------------------------
// Slot: one kernel with fixed constexprs and launch options, its compiled specializations

struct Entry {
  CUfunction fn = nullptr;
  unsigned block = 0;
  unsigned shared = 0;
  std::string kinds;
  int scratch = 0;
};

class Slot {
 public:
  explicit Slot(py::object miss) : miss_(miss.release().ptr()) {}  // kept for the process's life

  // Launch on the current device and stream; a key not seen before goes through Python.
  void launch(unsigned gx, unsigned gy, unsigned gz, const Arg* a, int n) {
    const int device = cuda_guard()->getDevice().index();
    std::string key = key_of(device, a, n);
    std::shared_ptr<const Entry> e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = entries_.find(key);
      if (it != entries_.end()) e = it->second;
    }
    if (!e) {
      call_python(gx, gy, gz, a, n, key);
      return;
    }
    if (static_cast<uint64_t>(gx) * gy * gz == 0) return;
    Value vals[kMaxParams];
    void* params[kMaxParams];
    pack(e->kinds, e->scratch, a, n, vals, params);
    ensure_context(device);
    void* stream = cuda_guard()->getStream(c10::Device(c10::DeviceType::CUDA, device)).native_handle();
    check(driver().launch(e->fn, gx, gy, gz, e->block, 1, 1, e->shared, stream, params, nullptr), "cuLaunchKernel");
    launches_.fetch_add(1, std::memory_order_relaxed);
  }

  // Python hands over a compiled specialization. Refused (false) when the driver's view of the
  // function's parameters differs from the layout Triton's signature gives.
  bool add(const py::bytes& key, uint64_t fn, int num_warps, int shared, const std::string& kinds) {
    const Driver& d = driver();
    if (!d.error.empty() || fn == 0) return false;
    CUfunction f = reinterpret_cast<CUfunction>(fn);
    size_t offset = 0, size = 0;
    size_t j = 0;
    for (char kind : kinds) {
      if (kind == 0) continue;
      if (d.param_info(f, j, &offset, &size) != 0 || size != kind_size(kind)) return false;
      ++j;
    }
    int scratch = 0;  // trailing pointer parameters Triton's launcher appends
    while (d.param_info(f, j, &offset, &size) == 0) {
      if (size != 8 || ++scratch > 2) return false;
      ++j;
    }
    auto e = std::make_shared<const Entry>(Entry{f, static_cast<unsigned>(32 * num_warps), static_cast<unsigned>(shared), kinds, scratch});
    std::lock_guard<std::mutex> lock(mu_);
    entries_[std::string(key)] = std::move(e);
    return true;
  }

  int64_t launches() const { return launches_.load(); }

 private:
  void call_python(unsigned gx, unsigned gy, unsigned gz, const Arg* a, int n, const std::string& key) {
    py::gil_scoped_acquire gil;
    py::tuple args(n);
    for (int k = 0; k < n; ++k) {
      switch (a[k].kind) {
        case 't':
          args[k] = py::cast(*a[k].t);
          break;
        case 'i':
          args[k] = py::int_(a[k].i);
          break;
        case 'b':
          args[k] = py::bool_(a[k].i != 0);
          break;
        default:
          args[k] = py::float_(a[k].f);
      }
    }
    py::handle miss{miss_};
    miss(py::make_tuple(gx, gy, gz), args, py::bytes(key));
  }

  PyObject* miss_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const Entry>> entries_;
  std::atomic<int64_t> launches_{0};
};

using SlotPtr = std::shared_ptr<Slot>;

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Plans: per op and (dtypes, row length, flags, device), the slots and the shape numbers Python
// chose. Kept for the process's life (a handful per model); `clear_plans` forgets them.

// The norms' shape numbers: rows per program forward and backward, the backward's persistent
// grid size, the column-sum kernel's block; n is the row length the plan is for.
struct RowPlan {
  int64_t n = 0, rows_fwd = 0, rows_bwd = 0, programs = 0, colsum_block = 0;
};

struct RmsPlan : RowPlan {
  SlotPtr fwd, fwd_infer, bwd, colsum;
};

struct LnPlan : RowPlan {
  SlotPtr fwd, fwd_infer, bwd, colsum_w, colsum_b;
};

struct AddRmsPlan : RowPlan {
  SlotPtr fwd, fwd_infer, bwd, bwd_dso, colsum;  // bwd_dso: the new residual's gradient added in
};

struct GluPlan {
  SlotPtr fwd, bwd;
  int64_t numel = 0, block = 0;  // the flat walk: one row of numel elements, block elements per program
};

struct RopePlan {
  SlotPtr fwd, bwd;
  int64_t block_t = 0;    // positions per program
  bool per_head = false;  // one head per program (the grid is B · cdiv(T, block_t) · (HQ + HK)), or all
};

template <typename P>
struct PlanTable {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<P>> plans;  // null: this key stays in Python
  std::vector<std::shared_ptr<P>> retired;                    // cleared plans a saved node may still use

  // 0: no entry yet, 1: a plan, 2: Python's path for this key
  int find(const std::string& key, std::shared_ptr<P>& out) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it == plans.end()) return 0;
    out = it->second;
    return out ? 1 : 2;
  }
  void set(const std::string& key, std::shared_ptr<P> p) {
    std::lock_guard<std::mutex> lock(mu);
    plans[key] = std::move(p);
  }
  int state(const std::string& key) {
    std::shared_ptr<P> p;
    return find(key, p);
  }
  // Python's plan object (None: this key stays in Python), read by `fill`.
  template <typename Fill>
  void store(const std::string& key, const py::object& plan, Fill fill) {
    if (plan.is_none()) {
      set(key, nullptr);
      return;
    }
    auto p = std::make_shared<P>();
    fill(*p);
    set(key, std::move(p));
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& kv : plans)
      if (kv.second) retired.push_back(kv.second);
    plans.clear();
  }
};

// The process's plan table of each plan type (one per op), never destroyed: a saved autograd
// node may still point into it at exit.
template <typename P>
PlanTable<P>& plans() {
  static auto* t = new PlanTable<P>();
  return *t;
}

SlotPtr slot_of(const py::object& plan, const char* name) { return plan.attr(name).cast<SlotPtr>(); }

void read_rows(RowPlan& p, const py::object& plan, int64_t n) {
  p.n = n;
  p.rows_fwd = plan.attr("rows_fwd").cast<int64_t>();
  p.rows_bwd = plan.attr("rows_bwd").cast<int64_t>();
  p.programs = plan.attr("programs").cast<int64_t>();
  p.colsum_block = plan.attr("colsum_block").cast<int64_t>();
}

// The plan-table key of a call: what the plan's tile choice and kernels depend on (device, the row
// length or size, small codes: dtypes, flags). Raw bytes, short enough for the string's own buffer:
// no allocation on the per-call path.
std::string plan_key(int device, int64_t n, std::initializer_list<int> codes) {
  std::string key(1 + sizeof n, '\0');
  key[0] = static_cast<char>(device);
  std::memcpy(&key[1], &n, sizeof n);
  for (int c : codes) key.push_back(static_cast<char>(c));
  return key;
}

inline int dtype_code(const c10::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? static_cast<int>(t->scalar_type()) : -1;
}

// Inputs the native path takes: CUDA, dense and contiguous, non-empty rows.
bool plain(const Tensor& t) { return t.is_cuda() && t.layout() == c10::kStrided && t.is_contiguous(); }

// ---------------------------------------------------------------------------------------------
// rms_norm

void rms_forward(RmsPlan& p, const Tensor& x, const Tensor& w, const Tensor& y, const Tensor* rstd, double eps,
                 double offset) {
  const int64_t m = x.numel() / p.n;
  const unsigned grid = static_cast<unsigned>(cdiv(m, p.rows_fwd));
  Arg a[] = {T(x), T(w), T(y), T(rstd ? *rstd : y), I(m), I(p.n), I(p.n), I(p.n), F(eps), F(offset)};
  (rstd ? p.fwd : p.fwd_infer)->launch(grid, 1, 1, a, 10);
}

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, double eps, double offset,
                        int64_t plan) {
    RmsPlan& p = *reinterpret_cast<RmsPlan*>(plan);
    Tensor y = at::empty(x.sizes(), x.options());
    Tensor rstd = at::empty({x.numel() / p.n}, x.options().dtype(at::kFloat));
    rms_forward(p, x, w, y, &rstd, eps, offset);
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["plan"] = plan;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RmsPlan& p = *reinterpret_cast<RmsPlan*>(ctx->saved_data["plan"].toInt());
    const double offset = ctx->saved_data["offset"].toDouble();
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor dy = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();
    const int64_t m = x.numel() / p.n;
    Tensor dx = at::empty(x.sizes(), x.options());
    const int64_t progs = std::min(p.programs, cdiv(m, p.rows_bwd));
    Tensor part = at::empty({progs, p.n}, x.options().dtype(at::kFloat));
    Arg a[] = {T(x), T(w), T(dy), T(rstd), T(dx), T(part), I(m), I(p.n), I(p.n), I(p.n), I(p.n), F(offset)};
    p.bwd->launch(static_cast<unsigned>(progs), 1, 1, a, 12);
    Tensor dw;
    if (ctx->needs_input_grad(1)) {
      dw = at::empty(w.sizes(), w.options());
      Arg c[] = {T(part), T(dw), I(progs), I(p.n)};
      p.colsum->launch(static_cast<unsigned>(cdiv(p.n, p.colsum_block)), 1, 1, c, 4);
    }
    return {ctx->needs_input_grad(0) ? dx : Tensor(), dw, Tensor(), Tensor(), Tensor()};
  }
};

std::string rms_key(const Tensor& x, const Tensor& w, bool llama) {
  return plan_key(x.get_device(), x.size(-1), {static_cast<int>(x.scalar_type()), static_cast<int>(w.scalar_type()),
                                                llama ? 1 : 0});
}

// The op on the native path, or None: no plan for this key yet (plan_state says which), or an
// input this path does not take. Arguments are validated by polykernel.rms_norm before.
py::object rms_norm(const Tensor& x, const Tensor& w, double eps, double offset, bool llama) {
  if (!plain(x) || !plain(w) || x.dim() == 0 || x.numel() == 0) return py::none();
  std::shared_ptr<RmsPlan> p;
  if (plans<RmsPlan>().find(rms_key(x, w, llama), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad())) {
    return py::cast(RmsNormFn::apply(x, w, eps, offset, reinterpret_cast<int64_t>(p.get())));
  }
  Tensor y = at::empty(x.sizes(), x.options());
  rms_forward(*p, x, w, y, nullptr, eps, offset);
  return py::cast(y);
}

int rms_plan_state(const Tensor& x, const Tensor& w, bool llama) { return plans<RmsPlan>().state(rms_key(x, w, llama)); }

void set_rms_plan(const Tensor& x, const Tensor& w, bool llama, py::object plan) {
  plans<RmsPlan>().store(rms_key(x, w, llama), plan, [&](RmsPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.fwd_infer = slot_of(plan, "fwd_infer");
    p.bwd = slot_of(plan, "bwd");
    p.colsum = slot_of(plan, "colsum");
    read_rows(p, plan, x.size(-1));
  });
}

// ---------------------------------------------------------------------------------------------
// layer_norm (weight and bias each optional)

void ln_forward(LnPlan& p, const Tensor& x, const Tensor* w, const Tensor* b, const Tensor& y, const Tensor* mean,
                const Tensor* rstd, double eps) {
  const int64_t m = x.numel() / p.n;
  const unsigned grid = static_cast<unsigned>(cdiv(m, p.rows_fwd));
  // Absent tensors are never read (HAS_W/HAS_B/STORE_STATS are constexprs): any pointer will do.
  Arg a[] = {T(x), T(w ? *w : x), T(b ? *b : x), T(y), T(mean ? *mean : y), T(rstd ? *rstd : y),
             I(m), I(p.n), I(p.n), I(p.n), F(eps)};
  (mean ? p.fwd : p.fwd_infer)->launch(grid, 1, 1, a, 11);
}

struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const c10::optional<Tensor>& w,
                        const c10::optional<Tensor>& b, double eps, int64_t plan) {
    LnPlan& p = *reinterpret_cast<LnPlan*>(plan);
    const bool has_w = w.has_value() && w->defined(), has_b = b.has_value() && b->defined();
    const int64_t m = x.numel() / p.n;
    Tensor y = at::empty(x.sizes(), x.options());
    Tensor mean = at::empty({m}, x.options().dtype(at::kFloat));
    Tensor rstd = at::empty({m}, x.options().dtype(at::kFloat));
    ln_forward(p, x, has_w ? &*w : nullptr, has_b ? &*b : nullptr, y, &mean, &rstd, eps);
    ctx->save_for_backward({x, has_w ? *w : Tensor(), mean, rstd});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["bias"] = has_b ? static_cast<int64_t>(b->scalar_type()) : int64_t(-1);
    if (has_b) ctx->saved_data["bias_sizes"] = b->sizes().vec();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    LnPlan& p = *reinterpret_cast<LnPlan*>(ctx->saved_data["plan"].toInt());
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
    const int64_t bias_dtype = ctx->saved_data["bias"].toInt();
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor dy = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();
    const bool has_w = w.defined(), has_b = bias_dtype >= 0;
    const int64_t m = x.numel() / p.n;
    Tensor dx = at::empty(x.sizes(), x.options());
    const int64_t progs = std::min(std::min(p.programs, m), cdiv(m, p.rows_bwd));
    const auto part_opts = x.options().dtype(at::kFloat);
    Tensor dw_part = has_w ? at::empty({progs, p.n}, part_opts) : dx;
    Tensor db_part = has_b ? at::empty({progs, p.n}, part_opts) : dx;
    Arg a[] = {T(x), T(has_w ? w : x), T(dy), T(mean), T(rstd), T(dx), T(dw_part), T(db_part),
               I(m), I(p.n), I(p.n), I(p.n), I(p.n)};
    p.bwd->launch(static_cast<unsigned>(progs), 1, 1, a, 13);
    const unsigned cgrid = static_cast<unsigned>(cdiv(p.n, p.colsum_block));
    // needs_input_grad counts only the tensor inputs that were given: x, then w, then b.
    const size_t w_edge = 1, b_edge = has_w ? 2 : 1;
    Tensor dw, db;
    if (has_w && ctx->needs_input_grad(w_edge)) {
      dw = at::empty(w.sizes(), w.options());
      Arg c[] = {T(dw_part), T(dw), I(progs), I(p.n)};
      p.colsum_w->launch(cgrid, 1, 1, c, 4);
    }
    if (has_b && ctx->needs_input_grad(b_edge)) {
      db = at::empty(ctx->saved_data["bias_sizes"].toIntVector(), x.options().dtype(static_cast<c10::ScalarType>(bias_dtype)));
      Arg c[] = {T(db_part), T(db), I(progs), I(p.n)};
      p.colsum_b->launch(cgrid, 1, 1, c, 4);
    }
    return {ctx->needs_input_grad(0) ? dx : Tensor(), dw, db, Tensor(), Tensor()};
  }
};

std::string ln_key(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b) {
  return plan_key(x.get_device(), x.size(-1), {static_cast<int>(x.scalar_type()), dtype_code(w), dtype_code(b)});
}

py::object layer_norm(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b, double eps) {
  if (!plain(x) || x.dim() == 0 || x.numel() == 0) return py::none();
  if ((w.has_value() && !plain(*w)) || (b.has_value() && !plain(*b))) return py::none();
  std::shared_ptr<LnPlan> p;
  if (plans<LnPlan>().find(ln_key(x, w, b), p) != 1) return py::none();
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || (w.has_value() && w->requires_grad()) || (b.has_value() && b->requires_grad()));
  if (grad) return py::cast(LayerNormFn::apply(x, w, b, eps, reinterpret_cast<int64_t>(p.get())));
  Tensor y = at::empty(x.sizes(), x.options());
  ln_forward(*p, x, w.has_value() ? &*w : nullptr, b.has_value() ? &*b : nullptr, y, nullptr, nullptr, eps);
  return py::cast(y);
}

int ln_plan_state(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b) {
  return plans<LnPlan>().state(ln_key(x, w, b));
}

void set_ln_plan(const Tensor& x, const c10::optional<Tensor>& w, const c10::optional<Tensor>& b, py::object plan) {
  plans<LnPlan>().store(ln_key(x, w, b), plan, [&](LnPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.fwd_infer = slot_of(plan, "fwd_infer");
    p.bwd = slot_of(plan, "bwd");
    p.colsum_w = slot_of(plan, "colsum_w");
    p.colsum_b = slot_of(plan, "colsum_b");
    read_rows(p, plan, x.size(-1));
  });
}

// ---------------------------------------------------------------------------------------------
// fused_add_rms_norm: s = x + residual, y = rms_norm(s); returns (y, s)

void add_rms_forward(AddRmsPlan& p, const Tensor& x, const Tensor& r, const Tensor& w, const Tensor& y, const Tensor& s,
                     const Tensor* rstd, double eps, double offset) {
  const int64_t m = x.numel() / p.n;
  const unsigned grid = static_cast<unsigned>(cdiv(m, p.rows_fwd));
  Arg a[] = {T(x), T(r), T(w), T(y), T(s), T(rstd ? *rstd : y), I(m), I(p.n), I(p.n), I(p.n), I(p.n), I(p.n),
             F(eps), F(offset)};
  (rstd ? p.fwd : p.fwd_infer)->launch(grid, 1, 1, a, 14);
}

struct FusedAddRmsNormFn : public torch::autograd::Function<FusedAddRmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& w, double eps,
                               double offset, int64_t plan) {
    AddRmsPlan& p = *reinterpret_cast<AddRmsPlan*>(plan);
    Tensor y = at::empty(x.sizes(), x.options());
    Tensor s = at::empty(x.sizes(), x.options());  // its own storage: saved for backward alone
    Tensor rstd = at::empty({x.numel() / p.n}, x.options().dtype(at::kFloat));
    add_rms_forward(p, x, r, w, y, s, &rstd, eps, offset);
    ctx->save_for_backward({s, w, rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["plan"] = plan;
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: no zeros read
    return {y, s};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    AddRmsPlan& p = *reinterpret_cast<AddRmsPlan*>(ctx->saved_data["plan"].toInt());
    const double offset = ctx->saved_data["offset"].toDouble();
    auto saved = ctx->get_saved_variables();
    const Tensor &s = saved[0], &w = saved[1], &rstd = saved[2];
    const Tensor& dy_in = grads[0];
    const Tensor& dso_in = grads[1];
    Tensor ds, dw;
    if (!dy_in.defined()) {  // only the new residual was used: y contributes nothing
      ds = dso_in;
    } else {
      const Tensor dy = dy_in.is_contiguous() ? dy_in : dy_in.contiguous();
      const bool has_dso = dso_in.defined();
      const Tensor dso = !has_dso ? dy : (dso_in.is_contiguous() ? dso_in : dso_in.contiguous());
      const int64_t m = s.numel() / p.n;
      ds = at::empty(s.sizes(), s.options());
      const int64_t progs = std::min(std::min(p.programs, m), cdiv(m, p.rows_bwd));
      Tensor part = at::empty({progs, p.n}, s.options().dtype(at::kFloat));
      Arg a[] = {T(s), T(w), T(dy), T(dso), T(rstd), T(ds), T(part), I(m), I(p.n), I(p.n), I(p.n), I(p.n), I(p.n),
                 F(offset)};
      (has_dso ? p.bwd_dso : p.bwd)->launch(static_cast<unsigned>(progs), 1, 1, a, 14);
      if (ctx->needs_input_grad(2)) {
        dw = at::empty(w.sizes(), w.options());
        Arg c[] = {T(part), T(dw), I(progs), I(p.n)};
        p.colsum->launch(static_cast<unsigned>(cdiv(p.n, p.colsum_block)), 1, 1, c, 4);
      }
    }
    return {ctx->needs_input_grad(0) ? ds : Tensor(), ctx->needs_input_grad(1) ? ds : Tensor(), dw, Tensor(), Tensor(),
            Tensor()};
  }
};

std::string add_rms_key(const Tensor& x, const Tensor& r, const Tensor& w) {
  return plan_key(x.get_device(), x.size(-1), {static_cast<int>(x.scalar_type()), static_cast<int>(r.scalar_type()),
                                                static_cast<int>(w.scalar_type())});
}

py::object fused_add_rms_norm(const Tensor& x, const Tensor& r, const Tensor& w, double eps, double offset) {
  if (!plain(x) || !plain(r) || !plain(w) || x.dim() == 0 || x.numel() == 0 || !x.sizes().equals(r.sizes())) {
    return py::none();
  }
  std::shared_ptr<AddRmsPlan> p;
  if (plans<AddRmsPlan>().find(add_rms_key(x, r, w), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (x.requires_grad() || r.requires_grad() || w.requires_grad())) {
    variable_list out = FusedAddRmsNormFn::apply(x, r, w, eps, offset, reinterpret_cast<int64_t>(p.get()));
    return py::make_tuple(out[0], out[1]);
  }
  Tensor y = at::empty(x.sizes(), x.options());
  Tensor s = at::empty(x.sizes(), x.options());
  add_rms_forward(*p, x, r, w, y, s, nullptr, eps, offset);
  return py::make_tuple(y, s);
}

int add_rms_plan_state(const Tensor& x, const Tensor& r, const Tensor& w) {
  return plans<AddRmsPlan>().state(add_rms_key(x, r, w));
}

void set_add_rms_plan(const Tensor& x, const Tensor& r, const Tensor& w, py::object plan) {
  plans<AddRmsPlan>().store(add_rms_key(x, r, w), plan, [&](AddRmsPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.fwd_infer = slot_of(plan, "fwd_infer");
    p.bwd = slot_of(plan, "bwd");
    p.bwd_dso = slot_of(plan, "bwd_dso");
    p.colsum = slot_of(plan, "colsum");
    read_rows(p, plan, x.size(-1));
  });
}

// ---------------------------------------------------------------------------------------------
// GLU: act(gate) * up (swiglu, geglu), contiguous inputs as one flat row

void glu_forward(GluPlan& p, const Tensor& g, const Tensor& u, const Tensor& y) {
  const int64_t blocks = cdiv(p.numel, p.block);
  Arg a[] = {T(g), T(u), T(y), I(1), I(p.numel), I(blocks), I(0), I(0), I(0)};
  p.fwd->launch(static_cast<unsigned>(blocks), 1, 1, a, 9);
}

struct GluFn : public torch::autograd::Function<GluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& g, const Tensor& u, int64_t act, int64_t plan) {
    GluPlan& p = *reinterpret_cast<GluPlan*>(plan);
    Tensor y = at::empty(g.sizes(), g.options());
    glu_forward(p, g, u, y);
    ctx->save_for_backward({g, u});
    ctx->saved_data["plan"] = plan;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    GluPlan& p = *reinterpret_cast<GluPlan*>(ctx->saved_data["plan"].toInt());
    auto saved = ctx->get_saved_variables();
    const Tensor &g = saved[0], &u = saved[1];
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor dy = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();
    Tensor dg = at::empty(g.sizes(), g.options());
    Tensor du = at::empty(g.sizes(), g.options());
    const int64_t blocks = cdiv(p.numel, p.block);
    Arg a[] = {T(g), T(u), T(dy), T(dg), T(du), I(1), I(p.numel), I(blocks), I(0), I(0), I(0), I(0), I(0)};
    p.bwd->launch(static_cast<unsigned>(blocks), 1, 1, a, 13);
    return {ctx->needs_input_grad(0) ? dg : Tensor(), ctx->needs_input_grad(1) ? du : Tensor(), Tensor(), Tensor()};
  }
};

std::string glu_key(const Tensor& g, const Tensor& u, int64_t act) {
  return plan_key(g.get_device(), g.numel(), {static_cast<int>(act), static_cast<int>(g.scalar_type()),
                                               static_cast<int>(u.scalar_type())});
}

py::object glu(const Tensor& g, const Tensor& u, int64_t act) {
  if (!plain(g) || !plain(u) || g.numel() == 0 || !g.sizes().equals(u.sizes())) return py::none();
  std::shared_ptr<GluPlan> p;
  if (plans<GluPlan>().find(glu_key(g, u, act), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (g.requires_grad() || u.requires_grad())) {
    return py::cast(GluFn::apply(g, u, act, reinterpret_cast<int64_t>(p.get())));
  }
  Tensor y = at::empty(g.sizes(), g.options());
  glu_forward(*p, g, u, y);
  return py::cast(y);
}

int glu_plan_state(const Tensor& g, const Tensor& u, int64_t act) { return plans<GluPlan>().state(glu_key(g, u, act)); }

void set_glu_plan(const Tensor& g, const Tensor& u, int64_t act, py::object plan) {
  plans<GluPlan>().store(glu_key(g, u, act), plan, [&](GluPlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.bwd = slot_of(plan, "bwd");
    p.numel = g.numel();
    p.block = plan.attr("block").cast<int64_t>();
  });
}

// ---------------------------------------------------------------------------------------------
// rope: q [B, HQ, T, D] and k [B, HK, T, D] rotated by cos/sin [B or 1, T, D], any strides.
// Outputs keep q's / k's dense layout (empty_like); backward rotates the gradients by -sin.

// Launch one rotation: rot(q) into qo and rot(k) into ko, where a null q (or k) takes no heads and
// the other pair stands in for its pointers (HQ = 0: never read), as the Python launcher does.
void rope_launch(RopePlan& p, bool backward, const Tensor* q, const Tensor* k, const Tensor& cos, const Tensor& sin,
                 const Tensor* qo, const Tensor* ko) {
  const Tensor& qa = q ? *q : *k;
  const Tensor& ka = k ? *k : *q;
  const Tensor& qoa = q ? *qo : *ko;
  const Tensor& koa = k ? *ko : *qo;
  const int64_t b = qa.size(0), t = qa.size(2);
  const int64_t hq = q ? q->size(1) : 0, hk = k ? k->size(1) : 0;
  const int64_t n_tblocks = cdiv(t, p.block_t);
  const auto qs = qa.strides(), ks = ka.strides(), qos = qoa.strides(), kos = koa.strides();
  const auto cs = cos.strides(), ss = sin.strides();
  Arg a[] = {T(qa), T(ka), T(qoa), T(koa), T(cos), T(sin), I(t), I(n_tblocks), I(hq), I(hk),
             I(qs[0]), I(qs[1]), I(qs[2]), I(qs[3]), I(ks[0]), I(ks[1]), I(ks[2]), I(ks[3]),
             I(qos[0]), I(qos[1]), I(qos[2]), I(qos[3]), I(kos[0]), I(kos[1]), I(kos[2]), I(kos[3]),
             I(cos.size(0) != 1 ? cs[0] : 0), I(cs[1]), I(cs[2]), I(sin.size(0) != 1 ? ss[0] : 0), I(ss[1]), I(ss[2])};
  const int64_t grid = b * n_tblocks * (p.per_head ? hq + hk : 1);
  (backward ? p.bwd : p.fwd)->launch(static_cast<unsigned>(grid), 1, 1, a, 32);
}

struct RopeFn : public torch::autograd::Function<RopeFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, int64_t plan) {
    RopePlan& p = *reinterpret_cast<RopePlan*>(plan);
    Tensor qo = at::empty_like(q), ko = at::empty_like(k);
    rope_launch(p, false, &q, &k, cos, sin, &qo, &ko);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["plan"] = plan;
    ctx->saved_data["q_sizes"] = q.sizes().vec();
    ctx->saved_data["q_strides"] = qo.strides().vec();
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    ctx->saved_data["k_strides"] = ko.strides().vec();
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: not rotated
    return {qo, ko};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RopePlan& p = *reinterpret_cast<RopePlan*>(ctx->saved_data["plan"].toInt());
    auto saved = ctx->get_saved_variables();
    const Tensor &cos = saved[0], &sin = saved[1];
    const bool use_q = grads[0].defined() && ctx->needs_input_grad(0);
    const bool use_k = grads[1].defined() && ctx->needs_input_grad(1);
    // dq / dk in the forward outputs' layout (which the gradients usually share)
    auto like = [&](const char* sizes, const char* strides, const Tensor& g) {
      return at::empty_strided(ctx->saved_data[sizes].toIntVector(), ctx->saved_data[strides].toIntVector(), g.options());
    };
    Tensor dq = use_q ? like("q_sizes", "q_strides", grads[0]) : Tensor();
    Tensor dk = use_k ? like("k_sizes", "k_strides", grads[1]) : Tensor();
    if (use_q || use_k) {
      rope_launch(p, true, use_q ? &grads[0] : nullptr, use_k ? &grads[1] : nullptr, cos, sin,
                  use_q ? &dq : nullptr, use_k ? &dk : nullptr);
    }
    return {dq, dk, Tensor(), Tensor(), Tensor()};
  }
};

// The tile choice depends on T only through its next power of two (capped in Python): keying on
// that keeps the table small when prompt lengths vary.
int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

std::string rope_key(const Tensor& q, const Tensor& k) {
  std::string key = plan_key(q.get_device(), next_pow2(q.size(2)), {});
  const int64_t more[] = {q.size(1), k.size(1), q.size(3)};
  key.append(reinterpret_cast<const char*>(more), sizeof more);
  return key;
}

py::object rope(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  auto strided_cuda = [](const Tensor& t) { return t.is_cuda() && t.layout() == c10::kStrided; };
  if (!strided_cuda(q) || !strided_cuda(k) || !strided_cuda(cos) || !strided_cuda(sin)) return py::none();
  if (q.dim() != 4 || k.dim() != 4 || cos.dim() != 3 || sin.dim() != 3 || q.numel() == 0 || k.numel() == 0) {
    return py::none();
  }
  std::shared_ptr<RopePlan> p;
  if (plans<RopePlan>().find(rope_key(q, k), p) != 1) return py::none();
  if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || cos.requires_grad() || sin.requires_grad())) {
    if (cos.requires_grad() || sin.requires_grad()) return py::none();  // Python's path refuses it by name
    variable_list out = RopeFn::apply(q, k, cos, sin, reinterpret_cast<int64_t>(p.get()));
    return py::make_tuple(out[0], out[1]);
  }
  Tensor qo = at::empty_like(q), ko = at::empty_like(k);
  rope_launch(*p, false, &q, &k, cos, sin, &qo, &ko);
  return py::make_tuple(qo, ko);
}

int rope_plan_state(const Tensor& q, const Tensor& k) { return plans<RopePlan>().state(rope_key(q, k)); }

void set_rope_plan(const Tensor& q, const Tensor& k, py::object plan) {
  plans<RopePlan>().store(rope_key(q, k), plan, [&](RopePlan& p) {
    p.fwd = slot_of(plan, "fwd");
    p.bwd = slot_of(plan, "bwd");
    p.block_t = plan.attr("block_t").cast<int64_t>();
    p.per_head = plan.attr("per_head").cast<bool>();
  });
}

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
  plans<RopePlan>().clear();
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
  m.def("glu", &glu);
  m.def("glu_plan_state", &glu_plan_state);
  m.def("set_glu_plan", &set_glu_plan);
  m.def("rope", &rope);
  m.def("rope_plan_state", &rope_plan_state);
  m.def("set_rope_plan", &set_rope_plan);
  m.def("clear_plans", &clear_plans);
  m.def("key_for", &key_for);
  m.def("pack_for", &pack_for);
}
