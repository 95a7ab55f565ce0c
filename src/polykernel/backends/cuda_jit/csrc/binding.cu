// The torch side of the cuda_jit norms: dtype dispatch and the launch on the current stream
// (CUDA-graph safe: no allocation, no synchronization). The Python host
// (polykernel/backends/cuda_jit/_host.py) hands over [M, n] views it has checked: unit inner
// stride, 16-byte aligned rows, n a multiple of the vector width; the checks below repeat that.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/types.h>

#include "rms_norm.cuh"

namespace {

template <typename A>
struct Cuda {
  using type = A;
};
template <>
struct Cuda<at::Half> {
  using type = __half;
};
template <>
struct Cuda<at::BFloat16> {
  using type = __nv_bfloat16;
};

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t n, int vec) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.size(0) == rows && t.size(1) == n, "cuda_jit rms_norm: ", name, " must be a CUDA [", rows,
              ", ", n, "] tensor");
  TORCH_CHECK(t.stride(1) == 1 && t.stride(0) % vec == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "cuda_jit rms_norm: ",
              name, " rows must be 16-byte aligned with a unit inner stride");
}

template <typename A, typename WA>
void run(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, const at::Tensor& out, const at::Tensor& res_out,
         double eps, double offset, bool add, bool llama) {
  using T = typename Cuda<A>::type;
  using W = typename Cuda<WA>::type;
  const auto stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  const T* xp = reinterpret_cast<const T*>(x.data_ptr<A>());
  T* op = reinterpret_cast<T*>(out.data_ptr<A>());
  const W* wp = reinterpret_cast<const W*>(weight.data_ptr<WA>());
  cudaError_t err;
  if (add) {
    err = pk_jit::launch_rms_norm<T, W, true>(xp, x.stride(0), reinterpret_cast<const T*>(residual.data_ptr<A>()), residual.stride(0), op,
                                             out.stride(0), reinterpret_cast<T*>(res_out.data_ptr<A>()), res_out.stride(0), wp, x.size(0),
                                             (int)x.size(1), (float)eps, (float)offset, false, stream);
  } else {
    err = pk_jit::launch_rms_norm<T, W, false>(xp, x.stride(0), nullptr, 0, op, out.stride(0), nullptr, 0, wp, x.size(0), (int)x.size(1),
                                              (float)eps, (float)offset, llama, stream);
  }
  TORCH_CHECK(err == cudaSuccess, "cuda_jit rms_norm: launch failed: ", cudaGetErrorString(err));
}

}  // namespace

// y = rms_norm(x) into out (add false), or s = x + residual into res_out and y = rms_norm(s) into
// out (add true; in place when out is x and res_out is residual). weight: x's dtype or fp32.
void rms_norm_fwd(at::Tensor x, at::Tensor residual, at::Tensor weight, at::Tensor out, at::Tensor res_out, double eps, double offset,
                  bool add, bool llama) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int vec = 16 / (int)x.element_size();
  TORCH_CHECK(n % vec == 0 && n <= INT32_MAX, "cuda_jit rms_norm: the row length must be a multiple of ", vec);
  check_rows(x, "x", rows, n, vec);
  check_rows(out, "out", rows, n, vec);
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "cuda_jit rms_norm: out must have x's dtype");
  if (add) {
    check_rows(residual, "residual", rows, n, vec);
    check_rows(res_out, "res_out", rows, n, vec);
    TORCH_CHECK(residual.scalar_type() == x.scalar_type() && res_out.scalar_type() == x.scalar_type(),
                "cuda_jit rms_norm: residual must have x's dtype");
  }
  TORCH_CHECK(weight.is_cuda() && weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              "cuda_jit rms_norm: weight must be a contiguous, 16-byte aligned CUDA [n] tensor");
  if (rows == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const bool fp32_weight = weight.scalar_type() == at::kFloat;
  TORCH_CHECK(fp32_weight || weight.scalar_type() == x.scalar_type(), "cuda_jit rms_norm: weight must have x's dtype or float32");
  switch (x.scalar_type()) {
    case at::kFloat:
      run<float, float>(x, residual, weight, out, res_out, eps, offset, add, llama);
      break;
    case at::kHalf:
      fp32_weight ? run<at::Half, float>(x, residual, weight, out, res_out, eps, offset, add, llama)
                  : run<at::Half, at::Half>(x, residual, weight, out, res_out, eps, offset, add, llama);
      break;
    case at::kBFloat16:
      fp32_weight ? run<at::BFloat16, float>(x, residual, weight, out, res_out, eps, offset, add, llama)
                  : run<at::BFloat16, at::BFloat16>(x, residual, weight, out, res_out, eps, offset, add, llama);
      break;
    default:
      TORCH_CHECK(false, "cuda_jit rms_norm: x must be float32, float16 or bfloat16");
  }
}
