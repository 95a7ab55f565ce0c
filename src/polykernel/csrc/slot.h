// Everything tied to Triton's launcher: the arguments of a launch, their specialization key, the
// parameters packed as Triton's launcher packs them, and the Slot (one kernel's compiled
// specializations, launched with cuLaunchKernel). Written against Triton's launcher of the
// releases named below; on another release no specialization is accepted (the Python path runs).
#pragma once

#include "driver.h"

namespace {

// ---------------------------------------------------------------------------------------------
// The Triton releases this layout was written for
//
// What it takes from Triton: a compiled kernel's parameters are its non-constexpr arguments in
// order, then at most two scratch pointers (global, profile); a launch is one CTA per cluster of
// 32 * num_warps threads with `shared` bytes of dynamic shared memory. Run on the H200 with Triton
// 3.6; the launchers of 3.8 (torch 2.14's) and 3.9 (backends/nvidia/driver.c) pack the same way.
// The driver check in Slot::add catches a change of parameter sizes, not of meaning: a release
// outside this range is refused until someone reads its launcher and widens the range.
constexpr int kTritonOldest[2] = {3, 6};
constexpr int kTritonNewest[2] = {3, 9};

std::atomic<bool>& triton_accepted() {
  static std::atomic<bool> ok{false};
  return ok;
}

// Python says which Triton compiles the kernels (at load). "" when this layout was written for it
// (Slots then take its kernels), else why not (they take none: every launch stays in Python).
std::string accept_triton(int major, int minor) {
  const bool ok = (major > kTritonOldest[0] || (major == kTritonOldest[0] && minor >= kTritonOldest[1])) &&
                  (major < kTritonNewest[0] || (major == kTritonNewest[0] && minor <= kTritonNewest[1]));
  triton_accepted().store(ok);
  if (ok) return "";
  return "Triton " + std::to_string(major) + "." + std::to_string(minor) + " is not a release the launch layout was written for (" +
         std::to_string(kTritonOldest[0]) + "." + std::to_string(kTritonOldest[1]) + " to " + std::to_string(kTritonNewest[0]) +
         "." + std::to_string(kTritonNewest[1]) + ")";
}

// ---------------------------------------------------------------------------------------------
// Arguments, keys and parameter packing

struct Arg {
  char kind;  // 't' tensor, 'i' int, 'f' float, 'b' bool
  const Tensor* t;
  int64_t i;  // 't': bytes past t's data pointer (TAt)
  double f;
};

inline Arg T(const Tensor& t) { return Arg{'t', &t, 0, 0.0}; }
// A pointer `bytes` into a contiguous t (the up half of glu_and_mul's rows): no view tensor per
// call (x.narrow cost ~1 µs of host time on a CPU; the miss path makes one, once per key).
inline Arg TAt(const Tensor& t, int64_t bytes) { return Arg{'t', &t, bytes, 0.0}; }
inline void* ptr_of(const Arg& a) { return static_cast<char*>(a.t->data_ptr()) + a.i; }
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
        key.push_back((reinterpret_cast<uintptr_t>(ptr_of(a[k])) & 15) == 0 ? 'A' : 'u');
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
        vals[j].p = ptr_of(a[k]);
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
#ifdef POLYKERNEL_NATIVE_HOST_TEST
    const int device = 0;  // the host-side test's build (plans.h, on_device): every launch is its miss
#else
    const int device = cuda_guard()->getDevice().index();
#endif
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

  // Python hands over a compiled specialization. Refused (false) on a Triton release this layout
  // was not written for, or when the driver's view of the function's parameters differs from the
  // layout Triton's signature gives.
  bool add(const py::bytes& key, uint64_t fn, int num_warps, int shared, const std::string& kinds) {
    const Driver& d = driver();
    if (!triton_accepted().load(std::memory_order_relaxed) || !d.error.empty() || fn == 0) return false;
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
          if (a[k].i == 0) {
            args[k] = py::cast(*a[k].t);
          } else {  // TAt: a flat view starting there (Triton reads its pointer and dtype)
            const Tensor& t = *a[k].t;
            const int64_t skip = a[k].i / t.element_size();
            args[k] = py::cast(t.as_strided({t.numel() - skip}, {1}, t.storage_offset() + skip));
          }
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

}  // namespace
