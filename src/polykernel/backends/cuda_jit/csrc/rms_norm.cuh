// RMSNorm and fused add + RMSNorm forward: one block per row, 128-bit loads and stores, fp32 math.
//
// Pure CUDA (no torch headers), so that nvcc alone compiles it (tests/backends/test_cuda_jit.py);
// binding.cu adds the torch launcher. Semantics: polykernel/ops/rms_norm.py (casting "fp32" and
// "llama", any offset) and ops/fused_add_rms_norm.py (s = x + residual rounded to T, then the
// "fp32" norm of s). Rows are [M, n] with unit inner stride, 16-byte aligned, n a multiple of the
// vector width V = 16 / sizeof(T) (the host checks; there is no scalar tail).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace pk_jit {

template <typename T>
struct Num;
template <>
struct Num<float> {
  static __device__ __forceinline__ float to_f(float v) { return v; }
  static __device__ __forceinline__ float from_f(float v) { return v; }
};
template <>
struct Num<__half> {
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
};
template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

// 16 bytes of T: one 128-bit load or store.
template <typename T>
struct alignas(16) Vec {
  T v[16 / sizeof(T)];
};

// Sum over the block: shuffles within each warp, one partial per warp in shared memory, then
// every warp sums the partials (no second barrier). blockDim.x is a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* partial) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The weight (+ offset) of one vector of T: W is T or float (fp32 master weights), read in
// 16-byte pieces.
template <typename T, typename W>
__device__ __forceinline__ void load_weight(const W* w, int j, float offset, float* out) {
  constexpr int V = 16 / sizeof(T);
  constexpr int PER = 16 / sizeof(W);
  const Vec<W>* p = reinterpret_cast<const Vec<W>*>(w + (int64_t)j * V);
#pragma unroll
  for (int c = 0; c < V / PER; ++c) {
    Vec<W> piece = p[c];
#pragma unroll
    for (int k = 0; k < PER; ++k) out[c * PER + k] = Num<W>::to_f(piece.v[k]) + offset;
  }
}

template <typename T>
__device__ __forceinline__ Vec<T> normalized(const Vec<T>& in, const float* wv, float rstd, bool llama) {
  constexpr int V = 16 / sizeof(T);
  Vec<T> y;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    float xh = Num<T>::to_f(in.v[k]) * rstd;
    if (llama) xh = Num<T>::to_f(Num<T>::from_f(xh));  // Hugging Face Llama rounds x̂ first
    y.v[k] = Num<T>::from_f(xh * wv[k]);
  }
  return y;
}

// One vector of the row's input: x, or with ADD s = T(x + r), which it also stores; its
// squares are added to ss in fp32.
template <typename T, bool ADD>
__device__ __forceinline__ Vec<T> load_input(const Vec<T>* xr, const Vec<T>* rr, Vec<T>* sr, int j, float& ss) {
  constexpr int V = 16 / sizeof(T);
  Vec<T> a = xr[j];
  if constexpr (ADD) {
    Vec<T> b = rr[j];
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] = Num<T>::from_f(Num<T>::to_f(a.v[k]) + Num<T>::to_f(b.v[k]));  // PyTorch's rounded sum
    sr[j] = a;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float h = Num<T>::to_f(a.v[k]);
    ss += h * h;
  }
  return a;
}

// VPT > 0: each thread holds VPT vectors of the row in registers, in T (x is read once);
// VPT == 0: a row too long for that is read again in the second pass (from L2, or from s with
// ADD: each thread re-reads only what it wrote itself). No __restrict__: in place, out == x and
// res_out == residual (every element is read before its own thread writes it).
template <typename T, typename W, int VPT, bool ADD>
__global__ void __launch_bounds__(1024) rms_norm_kernel(const T* x, int64_t x_stride, const T* residual, int64_t r_stride, T* out,
                                                        int64_t out_stride, T* res_out, int64_t ro_stride, const W* w, int n, float eps,
                                                        float offset, bool llama) {
  constexpr int V = 16 / sizeof(T);
  __shared__ float partial[32];
  const int64_t row = blockIdx.x;
  const int nv = n / V;
  const Vec<T>* xr = reinterpret_cast<const Vec<T>*>(x + row * x_stride);
  const Vec<T>* rr = ADD ? reinterpret_cast<const Vec<T>*>(residual + row * r_stride) : nullptr;
  Vec<T>* yr = reinterpret_cast<Vec<T>*>(out + row * out_stride);
  Vec<T>* sr = ADD ? reinterpret_cast<Vec<T>*>(res_out + row * ro_stride) : nullptr;
  float ss = 0.f;
  float wv[V];
  if constexpr (VPT > 0) {
    Vec<T> held[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nv) held[i] = load_input<T, ADD>(xr, rr, sr, j, ss);
    }
    const float rstd = rsqrtf(block_sum(ss, partial) / (float)n + eps);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j < nv) {
        load_weight<T, W>(w, j, offset, wv);
        yr[j] = normalized<T>(held[i], wv, rstd, llama);
      }
    }
  } else {
    for (int j = threadIdx.x; j < nv; j += blockDim.x) load_input<T, ADD>(xr, rr, sr, j, ss);
    const float rstd = rsqrtf(block_sum(ss, partial) / (float)n + eps);
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
      const Vec<T> in = ADD ? sr[j] : xr[j];
      load_weight<T, W>(w, j, offset, wv);
      yr[j] = normalized<T>(in, wv, rstd, llama);
    }
  }
}

// Threads and vectors per thread for a row of nv vectors: the fewest vectors per thread (1, 2,
// 4, 8) that fit in 512 threads (four blocks per SM stay resident), else 8 in 1024; rows longer
// than 8192 vectors re-read (vpt 0, 1024 threads).
inline void row_config(int nv, int* threads, int* vpt) {
  *vpt = 0;
  for (int v = 1; v <= 8; v *= 2) {
    if ((nv + v - 1) / v <= 512) {
      *vpt = v;
      break;
    }
  }
  if (*vpt == 0 && nv <= 8 * 1024) *vpt = 8;
  const int per = *vpt ? *vpt : 1;
  int t = (nv + per - 1) / per;
  t = ((t + 31) / 32) * 32;
  *threads = t < 32 ? 32 : (t > 1024 || *vpt == 0 ? 1024 : t);
}

template <typename T, typename W, bool ADD>
cudaError_t launch_rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t r_stride, T* out, int64_t out_stride, T* res_out,
                            int64_t ro_stride, const W* w, int64_t rows, int n, float eps, float offset, bool llama, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  int threads, vpt;
  row_config(n / V, &threads, &vpt);
  const dim3 grid((unsigned)rows), block((unsigned)threads);
#define PK_JIT_LAUNCH(VPT)                                                                                                      \
  rms_norm_kernel<T, W, VPT, ADD>                                                                                               \
      <<<grid, block, 0, stream>>>(x, x_stride, residual, r_stride, out, out_stride, res_out, ro_stride, w, n, eps, offset, llama)
  switch (vpt) {
    case 1: PK_JIT_LAUNCH(1); break;
    case 2: PK_JIT_LAUNCH(2); break;
    case 4: PK_JIT_LAUNCH(4); break;
    case 8: PK_JIT_LAUNCH(8); break;
    default: PK_JIT_LAUNCH(0); break;
  }
#undef PK_JIT_LAUNCH
  return cudaGetLastError();
}

}  // namespace pk_jit
