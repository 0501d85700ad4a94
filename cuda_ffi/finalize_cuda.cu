// CUDA handler of the finalize step: out[t] = sum over j of topk_weights[t, j] * d[src_rows[t, j]],
// accumulated in float32 in increasing j (as finalize_cpu.cc), then rounded; entries whose source
// row is outside d are skipped, so a token with no local expert gets exactly 0. The result aliases
// the caller's `out`, and every element of it is written.
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda_launch.cuh"
#include "dependent_launch.cuh"
#include "ffi_common.h"
#include "layer_steps_cuda.h"

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

// The top-k entries go in chunks of J: the chunk's source rows and weights are loaded first, then
// all of its row loads are issued, then they are accumulated in entry order (each element's sum
// runs over j in increasing order, whatever the chunking). At decode sizes (one block) the kernel
// is a chain of dependent loads, and loading entry by entry made it k round trips long instead of
// two per chunk.
template <int J>
__device__ __forceinline__ void load_entries(const float* __restrict__ w, const int32_t* __restrict__ src, int64_t t,
                                             int64_t k, int64_t j0, int64_t Rd, int64_t (&row)[J], float (&wj)[J],
                                             bool (&ok)[J]) {
#pragma unroll
  for (int u = 0; u < J; ++u) {
    const bool in = j0 + u < k;
    row[u] = in ? src[t * k + j0 + u] : -1;
    wj[u] = in ? w[t * k + j0 + u] : 0.0f;
    ok[u] = row[u] >= 0 && row[u] < Rd;  // padding, remote or out of range: skipped
  }
}

// A unit of V columns of a row: V = 8, a 16-byte vector; V = 1, one value (any H or alignment).
template <int V>
using Unit = std::conditional_t<V == 8, uint4, uint16_t>;

template <ElemType T>
__device__ __forceinline__ void unpack(uint4 r, float (&f)[8]) {
  const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int v = 0; v < 8; ++v) f[v] = half_to_float<T>(words[v >> 1] >> (16 * (v & 1)));
}
template <ElemType T>
__device__ __forceinline__ void unpack(uint16_t r, float (&f)[1]) {
  f[0] = half_to_float<T>(r);
}
template <ElemType T>
__device__ __forceinline__ uint4 pack(const float (&f)[8]) {
  uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
  for (int v = 0; v < 8; ++v) words[v >> 1] |= float_to_half<T>(f[v]) << (16 * (v & 1));
  return make_uint4(words[0], words[1], words[2], words[3]);
}
template <ElemType T>
__device__ __forceinline__ uint16_t pack(const float (&f)[1]) {
  return static_cast<uint16_t>(float_to_half<T>(f[0]));
}

// A thread owns C units of V columns of one token, Q = H / (V C) units apart, so a warp's loads of
// one unit are contiguous. With 16-byte units, J * C = 8 row loads in flight a chunk at every k:
// with a vector a thread and k = 2 (mixtral) a thread had 2 loads in flight and the kernel ran at
// 35-47% of the copy rate, against 84% at k = 8 (deepseek; benchmarks/NOTES.md, v21).
template <ElemType T, int V, int J, int C>
__global__ void finalize_kernel(const uint16_t* __restrict__ d, const float* __restrict__ w,
                                const int32_t* __restrict__ src, uint16_t* __restrict__ out, int64_t M, int64_t H,
                                int64_t k, int64_t Rd) {
  begin_dependent_grid();  // launch() launches it dependent on the kernel before it
  const int64_t Q = H / (V * C);
  const int64_t n = M * Q;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / Q, q = idx - t * Q;
    float acc[C][V];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[c][v] = 0.0f;
    for (int64_t j0 = 0; j0 < k; j0 += J) {
      int64_t row[J];
      float wj[J];
      bool ok[J];
      load_entries<J>(w, src, t, k, j0, Rd, row, wj, ok);
      Unit<V> raw[J][C];
#pragma unroll
      for (int u = 0; u < J; ++u) {
        if (!ok[u]) continue;
        const Unit<V>* dr = reinterpret_cast<const Unit<V>*>(d + row[u] * H) + q;
#pragma unroll
        for (int c = 0; c < C; ++c) raw[u][c] = dr[c * Q];
      }
#pragma unroll
      for (int u = 0; u < J; ++u) {
        if (!ok[u]) continue;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          float f[V];
          unpack<T>(raw[u][c], f);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[c][v] += wj[u] * f[v];
        }
      }
    }
    Unit<V>* o = reinterpret_cast<Unit<V>*>(out + t * H) + q;
#pragma unroll
    for (int c = 0; c < C; ++c) o[c * Q] = pack<T>(acc[c]);
  }
}

template <ElemType T, int V, int J, int C>
void launch(cudaStream_t stream, const uint16_t* d, const float* w, const int32_t* src, uint16_t* out, int64_t M,
            int64_t H, int64_t k, int64_t Rd) {
  constexpr int threads = 256;
  const unsigned blocks = grid_for(M * H / (V * C), threads, 8192);
  launch_dependent(finalize_kernel<T, V, J, C>, dim3(blocks), dim3(threads), 0, stream, d, w, src, out, M, H, k, Rd);
}

template <ElemType T>
Error launch_finalize(const std::string& call, cudaStream_t stream, const AnyBuffer& d, const AnyBuffer& w,
                      const AnyBuffer& src, AnyBuffer result, int64_t M, int64_t H, int64_t k, int64_t Rd) {
  const auto* dp = static_cast<const uint16_t*>(d.untyped_data());
  auto* op = static_cast<uint16_t*>(result.untyped_data());
  const auto* wp = static_cast<const float*>(w.untyped_data());
  const auto* sp = static_cast<const int32_t*>(src.untyped_data());
  if (H % 8 == 0 && aligned_to(dp, 16) && aligned_to(op, 16)) {
    // 8 row loads a chunk: J entries of C vectors, C the most that divides a row's vectors.
    const int64_t vecs = H / 8;
    if (k <= 2 && vecs % 4 == 0)
      launch<T, 8, 2, 4>(stream, dp, wp, sp, op, M, H, k, Rd);
    else if (k <= 4 && vecs % 2 == 0)
      launch<T, 8, 4, 2>(stream, dp, wp, sp, op, M, H, k, Rd);
    else
      launch<T, 8, 8, 1>(stream, dp, wp, sp, op, M, H, k, Rd);
  } else {
    launch<T, 1, 8, 1>(stream, dp, wp, sp, op, M, H, k, Rd);
  }
  return launch_status(call, "finalize_kernel");
}

Error FinalizeCuda(cudaStream_t stream, AnyBuffer d, AnyBuffer topk_weights, AnyBuffer src_rows, AnyBuffer out,
                   Result<AnyBuffer> result) {
  const std::string call = "finalize";
  HJ_RETURN_IF_ERROR(check_finalize_result(call, d, topk_weights, src_rows, out, *result));
  return launch_finalize_rows(call, stream, d, topk_weights, src_rows, *result);
}

}  // namespace

Error launch_finalize_rows(const std::string& call, cudaStream_t stream, const AnyBuffer& d,
                           const AnyBuffer& topk_weights, const AnyBuffer& src_rows, AnyBuffer& result) {
  const int64_t M = dim(result, 0), H = dim(result, 1), k = dim(topk_weights, 1), Rd = dim(d, 0);
  if (M * H == 0) return Error::Success();
  if (elem_type_of(d.element_type()) == ElemType::kF16)
    return launch_finalize<ElemType::kF16>(call, stream, d, topk_weights, src_rows, result, M, H, k, Rd);
  return launch_finalize<ElemType::kBF16>(call, stream, d, topk_weights, src_rows, result, M, H, k, Rd);
}

}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjFinalizeCuda, hj::FinalizeCuda, hj::bind_finalize<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
