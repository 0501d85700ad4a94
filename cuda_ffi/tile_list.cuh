// The tile list of the prefill kernels that split each expert's rows into token tiles of their
// own (gemm_prefill_sm90_4bit.cu, gemm_prefill_sm90_bf16_wsp.cu), written on the device by a setup
// kernel that also zeroes the output rows past the last expert.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "grouped_rows.cuh"

namespace hj {
namespace prefill {
namespace {
// ---------------------------------------------------------------------------------------------
// Setup of the kernels that run over a tile list (gemm_prefill_sm90_4bit.cu,
// gemm_prefill_sm90_bf16_wsp.cu): the list, and the rows past the last expert as zeros. Block 0
// writes the list (a block scan of the experts' tile counts, kSetupThreads experts at a time); every
// block takes a share of the zero tail. An expert's rows are split into ceil(rows / max_tokens)
// tiles (max_tokens: the kernel's widest tile): near-equal ones (chunk <= 1), or whole chunks of
// `chunk` rows shared out as evenly as possible, the last tile taking the remainder, so that tiles
// costing their rows rounded up to a chunk cost the expert's rows rounded up to one chunk in all.
// Each entry is (expert, first row, rows, 0); c is [R, N] bf16.
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kSetupThreads) tile_list_kernel(const int32_t* offsets, int E, int R, int max_tokens,
                                                                  int chunk, int4* tiles, int* count, __nv_bfloat16* c,
                                                                  int64_t N, unsigned* zero_words, int n_zero) {
  extern __shared__ int32_t s_hi[];  // [E], block 0 only
  int last;
  if (blockIdx.x == 0) {
    for (int i = static_cast<int>(threadIdx.x); i < n_zero; i += kSetupThreads) zero_words[i] = 0u;
    last = expert_row_ends(offsets, E, R, s_hi);
    __shared__ int32_t s_first;
    __shared__ int32_t s_warp[kSetupThreads / 32];
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
    if (tid == 0) s_first = 0;
    __syncthreads();
    for (int e0 = 0; e0 < E; e0 += kSetupThreads) {
      const int e = e0 + tid;
      const int lo = e < E ? (e > 0 ? s_hi[e - 1] : 0) : 0;
      const int rows = e < E ? s_hi[e] - lo : 0;
      const int n = (rows + max_tokens - 1) / max_tokens;
      int v = n;  // inclusive scan within the warp, then the warps before
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
      }
      if (lane == 31) s_warp[tid >> 5] = v;
      __syncthreads();
      int before = s_first + v - n;
      for (int w = 0; w < (tid >> 5); ++w) before += s_warp[w];
      if (chunk <= 1) {
        for (int i = 0; i < n; ++i) {
          const int a = static_cast<int>(static_cast<int64_t>(rows) * i / n);
          const int b = static_cast<int>(static_cast<int64_t>(rows) * (i + 1) / n);
          tiles[before + i] = make_int4(e, lo + a, b - a, 0);
        }
      } else {
        // c chunks over n tiles: base each, one more for the first `extra` (at most
        // max_tokens / chunk each, as c <= n * max_tokens / chunk when max_tokens is whole chunks).
        const int chunks = (rows + chunk - 1) / chunk, base = n > 0 ? chunks / n : 0, extra = n > 0 ? chunks % n : 0;
        int a = 0;
        for (int i = 0; i < n; ++i) {
          const int b = min(rows, a + (base + (i < extra ? 1 : 0)) * chunk);
          tiles[before + i] = make_int4(e, lo + a, b - a, 0);
          a = b;
        }
      }
      __syncthreads();
      if (tid == kSetupThreads - 1) s_first = before + n;
      __syncthreads();
    }
    if (threadIdx.x == 0) *count = s_first;
  } else {
    last = last_expert_row(offsets, E, R);
  }
  zero_rows(c, N * 2, last, R);
}

// tile_list_kernel on `stream` for the call's offsets and output c [R, N] (the zero rows shared out
// over up to four blocks an SM), also zeroing n_zero words at zero_words (the kernel's flags, which
// an uninitialized workspace cannot hold); an error message, or empty.
inline std::string launch_tile_list(const int32_t* offsets, int64_t E, int64_t R, int64_t N, int max_tokens, int chunk,
                                    int4* tiles, int* count, void* c, int sm_count, cudaStream_t stream,
                                    unsigned* zero_words = nullptr, int n_zero = 0) {
  const int64_t zero_work = R * N / 8;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(int64_t{sm_count} * 4, (zero_work + kSetupThreads * 8 - 1) / (kSetupThreads * 8)));
  tile_list_kernel<<<static_cast<unsigned>(blocks), kSetupThreads, E * sizeof(int32_t), stream>>>(
      offsets, static_cast<int>(E), static_cast<int>(R), max_tokens, chunk, tiles, count,
      static_cast<__nv_bfloat16*>(c), N, zero_words, n_zero);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("tile_list_kernel: ") + cudaGetErrorString(err);
}
}  // namespace

}  // namespace prefill
}  // namespace hj
