// The CUDA driver entry points the launch path uses, looked up in libcuda at first use (no CUDA
// toolkit at build time), the current device and stream through c10's device-guard interface, and
// the thread's CUDA context.
#pragma once

#include "common.h"

#include <dlfcn.h>

namespace {

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

}  // namespace
