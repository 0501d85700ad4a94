// Row ranges of the experts of a grouped (contiguous) GEMM, derived on the device from
// expert_first_token_offset exactly as the CPU handler derives them, and the zero rows past the last
// expert: shared by the setup kernels of the prefill kinds (gemm_prefill_sm90_kernel.cuh,
// gemm_prefill_sm90_mixed.cuh, tile_list.cuh); and the row count the routing filled, shared by the
// kernels that permute rows (routing_cuda.cu, activation_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace hj {

// The rows the routing filled: its last offset, clamped to [0, R] (an offset past the rows never
// addresses memory).
__device__ __forceinline__ int64_t valid_rows(const int32_t* offsets, int64_t num_offsets, int64_t R) {
  const int64_t valid = offsets[num_offsets - 1];
  return valid < 0 ? 0 : (valid > R ? R : valid);
}

namespace prefill {

constexpr int kSetupThreads = 256;

// Row ranges of the experts, as the CPU handler derives them: hi_e = min(R, max(0, off[1..e+1])),
// lo_e = hi_{e-1}, lo_0 = 0. Called by a whole block of kSetupThreads: leaves hi_e in s_hi[e] for
// every e < E (a warp scan over the offsets held in shared memory) and returns hi_{E-1}, the first
// row past the last expert.
__device__ inline int expert_row_ends(const int32_t* offsets, int E, int R, int32_t* s_hi) {
  __shared__ int32_t s_last;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  for (int e = tid; e < E; e += kSetupThreads) s_hi[e] = offsets[e + 1];
  __syncthreads();
  if (tid < 32) {
    int done = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      int v = e < E ? s_hi[e] : INT_MIN;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v = max(v, y);
      }
      const int hi = min(R, max(v, done));
      if (e < E) s_hi[e] = hi;
      done = __shfl_sync(0xffffffffu, hi, 31);
    }
    if (lane == 0) s_last = done;
  }
  __syncthreads();
  return s_last;
}

// The first row past the last expert (what expert_row_ends returns), by a whole block, without
// the per-expert ends.
__device__ inline int last_expert_row(const int32_t* offsets, int E, int R) {
  __shared__ int32_t s_last;
  const int tid = static_cast<int>(threadIdx.x);
  int m = 0;
  for (int e = tid; e < E; e += kSetupThreads) m = max(m, offsets[e + 1]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (tid == 0) s_last = 0;
  __syncthreads();
  if ((tid & 31) == 0) atomicMax(&s_last, m);
  __syncthreads();
  return min(R, s_last);
}

// Rows [first, R) of c (rows of row_bytes, a multiple of 16) belong to no local expert: zeros,
// 16 bytes per store, shared out over every thread of the grid.
__device__ inline void zero_rows(void* c, int64_t row_bytes, int first, int R) {
  const int64_t per_row = row_bytes / 16;
  const int64_t count = (static_cast<int64_t>(R) - first) * per_row;
  uint4* out = reinterpret_cast<uint4*>(c) + static_cast<int64_t>(first) * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kSetupThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kSetupThreads + threadIdx.x; i < count; i += stride)
    out[i] = make_uint4(0u, 0u, 0u, 0u);
}

}  // namespace prefill
}  // namespace hj
