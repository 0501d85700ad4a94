// CUDA handler of the finalize step: out[t] = sum over j of topk_weights[t, j] * d[src_rows[t, j]],
// accumulated in float32 in increasing j (as finalize_cpu.cc), then rounded; entries whose source
// row is outside d are skipped, so a token with no local expert gets exactly 0. The result aliases
// the caller's `out`, and every element of it is written.
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda_launch.cuh"
#include "ffi_common.h"

namespace hj {
namespace {

template <ElemType T>
__device__ __forceinline__ float half_to_float(uint32_t h) {
  return T == ElemType::kF16 ? f16_to_float(static_cast<uint16_t>(h)) : bf16_to_float(static_cast<uint16_t>(h));
}
template <ElemType T>
__device__ __forceinline__ uint32_t float_to_half(float v) {
  return T == ElemType::kF16 ? float_to_f16(v) : float_to_bf16(v);
}

// Each thread owns V consecutive columns of one token. The top-k entries go in chunks of kJ: the
// chunk's source rows and weights are loaded first, then all of its row loads are issued, then
// they are accumulated in entry order. At decode sizes (one block) the kernel is a chain of
// dependent loads, and loading entry by entry made it k round trips long instead of two per chunk.
constexpr int kJ = 8;

template <ElemType T, int V>
__global__ void finalize_kernel(const uint16_t* __restrict__ d, const float* __restrict__ w,
                                const int32_t* __restrict__ src, uint16_t* __restrict__ out, int64_t M, int64_t H,
                                int64_t k, int64_t Rd) {
  using Vec = std::conditional_t<V == 8, uint4, uint16_t>;
  const int64_t per_row = H / V;
  const int64_t n = M * per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_row, h0 = (idx - t * per_row) * V;
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
    for (int64_t j0 = 0; j0 < k; j0 += kJ) {
      int64_t row[kJ];
      float wj[kJ];
      bool ok[kJ];  // padding, remote or out of range: skipped
#pragma unroll
      for (int u = 0; u < kJ; ++u) {
        const bool in = j0 + u < k;
        row[u] = in ? src[t * k + j0 + u] : -1;
        wj[u] = in ? w[t * k + j0 + u] : 0.0f;
        ok[u] = row[u] >= 0 && row[u] < Rd;
      }
      Vec raw[kJ][V == 8 ? 1 : V];
#pragma unroll
      for (int u = 0; u < kJ; ++u) {
        if (!ok[u]) continue;
        const uint16_t* dr = d + row[u] * H + h0;
        if constexpr (V == 8) {
          raw[u][0] = *reinterpret_cast<const uint4*>(dr);
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v) raw[u][v] = dr[v];
        }
      }
#pragma unroll
      for (int u = 0; u < kJ; ++u) {
        if (!ok[u]) continue;
        if constexpr (V == 8) {
          const uint32_t words[4] = {raw[u][0].x, raw[u][0].y, raw[u][0].z, raw[u][0].w};
#pragma unroll
          for (int v = 0; v < 8; ++v) acc[v] += wj[u] * half_to_float<T>(words[v >> 1] >> (16 * (v & 1)));
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] += wj[u] * half_to_float<T>(raw[u][v]);
        }
      }
    }
    if constexpr (V == 8) {
      uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
      for (int v = 0; v < 8; ++v) words[v >> 1] |= float_to_half<T>(acc[v]) << (16 * (v & 1));
      *reinterpret_cast<uint4*>(out + t * H + h0) = make_uint4(words[0], words[1], words[2], words[3]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) out[t * H + h0 + v] = static_cast<uint16_t>(float_to_half<T>(acc[v]));
    }
  }
}

template <ElemType T>
Error launch_finalize(const std::string& call, cudaStream_t stream, const AnyBuffer& d, const AnyBuffer& w,
                      const AnyBuffer& src, AnyBuffer result, int64_t M, int64_t H, int64_t k, int64_t Rd) {
  const auto* dp = static_cast<const uint16_t*>(d.untyped_data());
  auto* op = static_cast<uint16_t*>(result.untyped_data());
  const auto* wp = static_cast<const float*>(w.untyped_data());
  const auto* sp = static_cast<const int32_t*>(src.untyped_data());
  const int threads = 256;
  if (H % 8 == 0 && aligned_to(dp, 16) && aligned_to(op, 16))
    finalize_kernel<T, 8><<<grid_for(M * H / 8, threads, 8192), threads, 0, stream>>>(dp, wp, sp, op, M, H, k, Rd);
  else
    finalize_kernel<T, 1><<<grid_for(M * H, threads, 8192), threads, 0, stream>>>(dp, wp, sp, op, M, H, k, Rd);
  return launch_status(call, "finalize_kernel");
}

Error FinalizeCuda(cudaStream_t stream, AnyBuffer d, AnyBuffer topk_weights, AnyBuffer src_rows, AnyBuffer out,
                   Result<AnyBuffer> result) {
  const std::string call = "finalize";
  HJ_RETURN_IF_ERROR(check_finalize_result(call, d, topk_weights, src_rows, out, *result));
  const int64_t M = dim(out, 0), H = dim(out, 1), k = dim(topk_weights, 1), Rd = dim(d, 0);
  if (M * H == 0) return Error::Success();
  if (elem_type_of(d.element_type()) == ElemType::kF16)
    return launch_finalize<ElemType::kF16>(call, stream, d, topk_weights, src_rows, *result, M, H, k, Rd);
  return launch_finalize<ElemType::kBF16>(call, stream, d, topk_weights, src_rows, *result, M, H, k, Rd);
}

}  // namespace
}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjFinalizeCuda, hj::FinalizeCuda, hj::bind_finalize<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
