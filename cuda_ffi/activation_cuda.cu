// CUDA handlers of the activation, the fused activation + dynamic quantization, and the dynamic
// quantization of 16-bit activations. Element values come from moe_contract.h, as on the CPU
// (activation_cpu.cc): the activation in float32, then rounded (activation) or quantized from the
// float32 value (activation_quant) with scale = absmax / qmax per row or per group of columns.
#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "ffi_common.h"

namespace hj {
namespace {

// The activation of column i of row r (float32), or the plain value for the identity (quantize).
template <ElemType XT>
__device__ __forceinline__ float act_at(int act, float limit, const void* x, int64_t r, int64_t N1, int64_t I,
                                        int64_t i) {
  if (act < 0) return load_elem(XT, x, r * N1 + i);
  const Activation a = static_cast<Activation>(act);
  if (activation_is_gated(a)) {
    int64_t g, u;
    gated_columns(a, i, I, &g, &u);
    return activation_gated(a, load_elem(XT, x, r * N1 + g), load_elem(XT, x, r * N1 + u), limit);
  }
  return activation_single(a, load_elem(XT, x, r * N1 + i));
}

template <ElemType XT>
__global__ void activation_kernel(const void* __restrict__ x, void* __restrict__ y, int act, float limit, int64_t R,
                                  int64_t N1, int64_t I) {
  const int64_t n = R * I;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / I, i = idx - r * I;
    store_elem(XT, y, idx, act_at<XT>(act, limit, x, r, N1, I, i));
  }
}

constexpr int kQuantThreads = 256;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One block per row. Whole-row scale: the block reduces the absmax; per-group scales: each warp
// takes groups in turn. The activation is recomputed in the second pass rather than stored.
template <ElemType XT, ElemType QT>
__global__ void __launch_bounds__(kQuantThreads)
    quant_kernel(const void* __restrict__ x, void* __restrict__ q, float* __restrict__ scale, int act, float limit,
                 int64_t N1, int64_t K, int64_t group_k) {
  constexpr ActQuant kind = QT == ElemType::kE4M3 ? ActQuant::kFp8E4M3 : ActQuant::kInt8;
  __shared__ float s_max[kQuantThreads / 32];
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (group_k == 0 || group_k >= K) {
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < K; i += blockDim.x) m = fmaxf(m, fabsf(act_at<XT>(act, limit, x, r, N1, K, i)));
    m = warp_max(m);
    if (lane == 0) s_max[warp] = m;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < nwarps; ++w) m = fmaxf(m, s_max[w]);
    const float s = quant_scale(kind, m);
    if (threadIdx.x == 0) scale[r] = s;
    for (int64_t i = threadIdx.x; i < K; i += blockDim.x)
      store_elem(QT, q, r * K + i, quant_code_value(act_at<XT>(act, limit, x, r, N1, K, i), s));
    return;
  }
  const int64_t groups = K / group_k;
  for (int64_t g = warp; g < groups; g += nwarps) {
    const int64_t k0 = g * group_k;
    float m = 0.0f;
    for (int64_t i = k0 + lane; i < k0 + group_k; i += 32) m = fmaxf(m, fabsf(act_at<XT>(act, limit, x, r, N1, K, i)));
    const float s = quant_scale(kind, warp_max(m));
    if (lane == 0) scale[r * groups + g] = s;
    for (int64_t i = k0 + lane; i < k0 + group_k; i += 32)
      store_elem(QT, q, r * K + i, quant_code_value(act_at<XT>(act, limit, x, r, N1, K, i), s));
  }
}

template <ElemType XT>
Error launch_quant(const std::string& call, cudaStream_t stream, const AnyBuffer& x, AnyBuffer q, AnyBuffer scale,
                   int act, float limit, int64_t R, int64_t N1, int64_t K, int64_t group_k, ActQuant kind) {
  if (R == 0) return Error::Success();
  if (R > INT32_MAX) return invalid(call, "too many rows");
  const unsigned grid = static_cast<unsigned>(R);
  float* sc = static_cast<float*>(scale.untyped_data());
  if (kind == ActQuant::kFp8E4M3)
    quant_kernel<XT, ElemType::kE4M3><<<grid, kQuantThreads, 0, stream>>>(x.untyped_data(), q.untyped_data(), sc,
                                                                           act, limit, N1, K, group_k);
  else
    quant_kernel<XT, ElemType::kI8><<<grid, kQuantThreads, 0, stream>>>(x.untyped_data(), q.untyped_data(), sc, act,
                                                                         limit, N1, K, group_k);
  return launch_status(call, "quant_kernel");
}

Error ActivationCuda(cudaStream_t stream, AnyBuffer x, Result<AnyBuffer> y, int64_t activation, float limit) {
  const std::string call = "activation";
  ActivationShape s;
  HJ_RETURN_IF_ERROR(check_activation(call, x, activation, &s));
  HJ_RETURN_IF_ERROR(check_activation_output(call, x, *y, s));
  if (s.R * s.I == 0) return Error::Success();
  const int threads = 256;
  const unsigned grid = grid_for(s.R * s.I, threads, 8192);
  const int act = static_cast<int>(activation);
  if (elem_type_of(x.element_type()) == ElemType::kF16)
    activation_kernel<ElemType::kF16><<<grid, threads, 0, stream>>>(x.untyped_data(), y->untyped_data(), act, limit,
                                                                    s.R, s.N1, s.I);
  else
    activation_kernel<ElemType::kBF16><<<grid, threads, 0, stream>>>(x.untyped_data(), y->untyped_data(), act, limit,
                                                                     s.R, s.N1, s.I);
  return launch_status(call, "activation_kernel");
}

Error ActivationQuantCuda(cudaStream_t stream, AnyBuffer x, Result<AnyBuffer> q, Result<AnyBuffer> scale,
                          int64_t activation, float limit, int64_t group_k) {
  const std::string call = "activation_quant";
  ActivationShape s;
  HJ_RETURN_IF_ERROR(check_activation(call, x, activation, &s));
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quant_results(call, x, *q, *scale, s.R, s.I, group_k, &kind));
  const int act = static_cast<int>(activation);
  if (elem_type_of(x.element_type()) == ElemType::kF16)
    return launch_quant<ElemType::kF16>(call, stream, x, *q, *scale, act, limit, s.R, s.N1, s.I, group_k, kind);
  return launch_quant<ElemType::kBF16>(call, stream, x, *q, *scale, act, limit, s.R, s.N1, s.I, group_k, kind);
}

Error QuantizeCuda(cudaStream_t stream, AnyBuffer x, Result<AnyBuffer> q, Result<AnyBuffer> scale, int64_t group_k) {
  const std::string call = "quantize";
  int64_t R = 0, K = 0;
  HJ_RETURN_IF_ERROR(check_quantize_input(call, x, &R, &K));
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quant_results(call, x, *q, *scale, R, K, group_k, &kind));
  if (elem_type_of(x.element_type()) == ElemType::kF16)
    return launch_quant<ElemType::kF16>(call, stream, x, *q, *scale, -1, 0.0f, R, K, K, group_k, kind);
  return launch_quant<ElemType::kBF16>(call, stream, x, *q, *scale, -1, 0.0f, R, K, K, group_k, kind);
}

}  // namespace
}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjActivationCuda, hj::ActivationCuda, hj::bind_activation<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjActivationQuantCuda, hj::ActivationQuantCuda,
                              hj::bind_activation_quant<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjQuantizeCuda, hj::QuantizeCuda, hj::bind_quantize<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
