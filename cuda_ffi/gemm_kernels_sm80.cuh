// The generic expert GEMM on tensor cores (mma.sync m16n8k16, f32 accumulation; sm_80 and later)
// for the three row layouts (indexed gather, grouped contiguous, batched masked) and every weight
// type. One CTA computes a BM x 128 tile of c for one expert; K advances in steps of 32 through a
// two-stage shared-memory buffer that holds activations and dequantized weights as 16-bit values.
//
// 16-bit activations: weights are dequantized to float32 with the contract's formula and rounded to
// the activation type, exactly the w' of GemmProblem. 8-bit activations: the MMA takes the raw codes
// (fp8/int8 activations; int4/int8/fp8/fp4 weight codes, all exact in bf16) and every `period`
// columns of K the partial sums are scaled by a_scale * w_scale (* scale2) into the f32 accumulator,
// so no scale is ever rounded to 16 bits. Accumulation order is fixed: results are deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "ffi_common.h"
#include "moe_contract.h"

namespace hj {
namespace gemm {

enum class RowMode : int { kIndexed = 0, kGrouped = 1, kBatched = 2 };

constexpr int kBN = 128;           // columns of c per CTA
constexpr int kBK = 32;            // K per pipeline stage
constexpr int kLds = kBK + 8;      // shared row stride in 16-bit elements (80 bytes: no ldmatrix conflicts)
constexpr int kThreads = 128;      // 4 warps
constexpr int kMaxPeriods = kBK / 16;

// Everything a launch needs; built on the host from the parsed GemmProblem.
struct GemmLaunch {
  GemmProblem p;
  RowMode mode;
  int64_t E;
  // indexed
  const int32_t* sorted_ids;
  const int32_t* block_expert_ids;
  const int32_t* ntpp;
  int64_t block_m, gather_div, a_rows, c_rows, padded_rows, sub_tiles;
  // grouped
  const int32_t* offsets;
  int64_t R, gemm_tiles;
  // batched
  const int32_t* counts;
  int64_t T, tiles_per_expert;
  bool vec_a;      // every 8-element activation chunk is one aligned vector load
  bool vec_w;      // likewise for weight chunks
  bool w_uniform;  // one scale (and zero point) per 8-element weight chunk
  int period;      // 8-bit activations: K columns that share one scale pair (16 or 32)
  // The weight scale grid in 32-bit terms (divisions by group sizes are the costly part of an
  // index); the host checks that every index fits.
  uint32_t group_n, group_k, scale_rows, scale_cols, a_group_k, a_scale_cols;
  // Set by a call that launches this GEMM right after a kernel of its own (experts_indexed's
  // GEMM2): everything before that kernel on the stream has completed, so the routing and the
  // weights are final and only `a` waits on it. The decode kernel then reads the routing and
  // issues its first weights before its grid-dependency wait (dependent_launch.cuh).
  bool inputs_ready_but_a;
};

// ---------------------------------------------------------------------------------------------
// Warp-level primitives.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

template <bool kF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to the 16-bit operand type, low half first.
template <bool kF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (kF16) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&r, &h, 4);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &h, 4);
  }
  return r;
}

__device__ __forceinline__ uint4 pack8(const float (&v)[8], bool f16) {
  if (f16) return make_uint4(pack2<true>(v[0], v[1]), pack2<true>(v[2], v[3]), pack2<true>(v[4], v[5]), pack2<true>(v[6], v[7]));
  return make_uint4(pack2<false>(v[0], v[1]), pack2<false>(v[2], v[3]), pack2<false>(v[4], v[5]), pack2<false>(v[6], v[7]));
}

__device__ __forceinline__ uint32_t byte_of(const uint4& r, int j) {
  const uint32_t w = j < 4 ? r.x : r.y;
  return (w >> (8 * (j & 3))) & 0xffu;
}

// ---------------------------------------------------------------------------------------------
// Global -> registers: 8 consecutive K elements of one row ("a chunk"), zero past K or the row set.
// ---------------------------------------------------------------------------------------------
template <bool kQ8>
__device__ __forceinline__ uint4 load_a_chunk(const GemmLaunch& L, int64_t arow, int64_t k) {
  uint4 r = make_uint4(0, 0, 0, 0);
  const int64_t K = L.p.K;
  if (arow < 0 || k >= K) return r;
  if constexpr (kQ8) {
    const uint8_t* p = static_cast<const uint8_t*>(L.p.a.data) + arow * K + k;
    if (L.vec_a && k + 8 <= K) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      return make_uint4(v.x, v.y, 0, 0);
    }
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < K) w[j >> 2] |= static_cast<uint32_t>(p[j]) << (8 * (j & 3));
    return make_uint4(w[0], w[1], 0, 0);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(L.p.a.data) + arow * K + k;
    if (L.vec_a && k + 8 <= K) return *reinterpret_cast<const uint4*>(p);
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < K) w[j >> 1] |= static_cast<uint32_t>(p[j]) << (16 * (j & 1));
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// 8-bit activation codes (fp8 e4m3 or int8) as 8 bf16 values (exact).
__device__ __forceinline__ uint4 a_codes_to_bf16(const uint4& raw, bool fp8) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t b = byte_of(raw, j);
    v[j] = fp8 ? e4m3_to_float(static_cast<uint8_t>(b)) : static_cast<float>(static_cast<int8_t>(b));
  }
  return pack8(v, false);
}

template <WeightType WT>
__device__ __forceinline__ uint4 load_w_chunk(const GemmLaunch& L, int64_t e, int64_t n, int64_t k) {
  uint4 r = make_uint4(0, 0, 0, 0);
  const WeightView& w = L.p.w;
  const int64_t K = L.p.K;
  if (n >= w.N || k >= K) return r;
  // Float weights are addressed in elements, codes in bytes (row_bytes counts K elements for both).
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + (e * w.N + n) * w.row_bytes();
  if constexpr (WT == WeightType::kFloat) {
    const uint16_t* p = static_cast<const uint16_t*>(w.data) + (e * w.N + n) * K + k;
    if (L.vec_w && k + 8 <= K) return *reinterpret_cast<const uint4*>(p);
    uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < K) v[j >> 1] |= static_cast<uint32_t>(p[j]) << (16 * (j & 1));
    return make_uint4(v[0], v[1], v[2], v[3]);
  } else if constexpr (WT == WeightType::kUInt4 || WT == WeightType::kFp4E2M1) {
    const uint8_t* p = row + k / 2;  // k is a multiple of 8
    if (L.vec_w && k + 8 <= K) return make_uint4(*reinterpret_cast<const uint32_t*>(p), 0, 0, 0);
    uint32_t v = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (k + 2 * j < K) v |= static_cast<uint32_t>(p[j]) << (8 * j);
    return make_uint4(v, 0, 0, 0);
  } else {
    const uint8_t* p = row + k;
    if (L.vec_w && k + 8 <= K) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      return make_uint4(v.x, v.y, 0, 0);
    }
    uint32_t v[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < K) v[j >> 2] |= static_cast<uint32_t>(p[j]) << (8 * (j & 3));
    return make_uint4(v[0], v[1], 0, 0);
  }
}

// The codes of a raw weight chunk as floats (before any scale); codes past K are zero bytes and
// are masked by the caller.
template <WeightType WT>
__device__ __forceinline__ void weight_codes(const uint4& raw, int zero, float (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (WT == WeightType::kUInt4) {
      v[j] = static_cast<float>(static_cast<int>((raw.x >> (4 * j)) & 0xfu) - zero);
    } else if constexpr (WT == WeightType::kFp4E2M1) {
      v[j] = e2m1_to_float(static_cast<uint8_t>((raw.x >> (4 * j)) & 0xfu));
    } else if constexpr (WT == WeightType::kInt8) {
      v[j] = static_cast<float>(static_cast<int8_t>(byte_of(raw, j)));
    } else if constexpr (WT == WeightType::kFp8E4M3) {
      v[j] = e4m3_to_float(static_cast<uint8_t>(byte_of(raw, j)));
    } else {
      v[j] = 0.0f;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel. BM rows x 128 columns per CTA; kQ8: 8-bit activations; kF16: fp16 operands (16-bit
// activations only).
// ---------------------------------------------------------------------------------------------
template <int BM, WeightType WT, bool kQ8, bool kF16>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(const __grid_constant__ GemmLaunch L) {
  static_assert(BM == 16 || BM == 32 || BM == 64, "BM");
  static_assert(!(kQ8 && kF16), "8-bit activations use bf16 operands");
  constexpr int WARPS_M = BM >= 64 ? 2 : 1;
  constexpr int WARPS_N = 4 / WARPS_M;
  constexpr int WTM = BM / WARPS_M, WTN = kBN / WARPS_N;
  constexpr int MI = WTM / 16, NI = WTN / 8;
  constexpr int A_CHUNKS = BM * kBK / 8;
  constexpr int A_ITERS = (A_CHUNKS + kThreads - 1) / kThreads;
  constexpr int W_ITERS = kBN * kBK / 8 / kThreads;

  __shared__ __align__(16) uint16_t sA[2][BM][kLds];
  __shared__ __align__(16) uint16_t sW[2][kBN][kLds];
  __shared__ float sAs[kQ8 ? 2 : 1][kMaxPeriods][BM];   // activation scale per row and period
  __shared__ float sWs[kQ8 ? 2 : 1][kMaxPeriods][kBN];  // weight scale (* scale2) per column and period
  __shared__ int64_t s_arow[BM];                        // row of a, or -1: no product
  __shared__ int64_t s_crow[BM];                        // row of c, or -1: not written
  __shared__ int s_grp[4];                              // grouped: expert, lo, hi, tile; then done

  const GemmProblem& p = L.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t N = p.N, K = p.K;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int64_t x = blockIdx.x;
  int64_t expert = 0;

  // ---- rows of this tile --------------------------------------------------------------------
  bool any = false;
  if (L.mode == RowMode::kIndexed) {
    const int64_t b = x / L.sub_tiles, s = x - b * L.sub_tiles;
    int64_t used = *L.ntpp;
    used = used < 0 ? 0 : (used > L.padded_rows ? L.padded_rows : used);
    if (b * L.block_m >= used) return;
    expert = L.block_expert_ids[b];
    if (expert < 0 || expert >= L.E) return;  // never address weights with an invalid id
    const int64_t first = b * L.block_m + s * BM;
    const int64_t rows = min(static_cast<int64_t>(BM), L.block_m - s * BM);
    for (int i = tid; i < BM; i += kThreads) {
      int64_t ar = -1, cr = -1;
      if (i < rows) {
        const int64_t id = L.sorted_ids[first + i];
        if (id >= 0 && id < L.c_rows && id / L.gather_div < L.a_rows) {
          ar = id / L.gather_div;
          cr = id;
        }
      }
      s_arow[i] = ar;
      s_crow[i] = cr;
      any |= ar >= 0;
    }
  } else if (L.mode == RowMode::kGrouped) {
    if (warp == 0) {
      // Offsets clamped monotone into [0, R] (expert 0 starts at row 0); tiles of each expert in order.
      const int R = static_cast<int>(L.R);
      if (lane == 0) s_grp[0] = -1;
      __syncwarp();
      int done = 0, tbase = 0;
      for (int e0 = 0; e0 < L.E; e0 += 32) {
        const int e = e0 + lane;
        int v = e < L.E ? L.offsets[e + 1] : INT_MIN;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, v, o);
          if (lane >= o) v = max(v, y);
        }
        const int hi = min(R, max(v, done));
        int lo = __shfl_up_sync(0xffffffffu, hi, 1);
        if (lane == 0) lo = done;
        const int tiles = e < L.E ? (hi - lo + BM - 1) / BM : 0;
        int incl = tiles;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        const int excl = incl - tiles;
        if (x < L.gemm_tiles && e < L.E && x >= tbase + excl && x < tbase + incl) {
          s_grp[0] = e;
          s_grp[1] = lo;
          s_grp[2] = hi;
          s_grp[3] = static_cast<int>(x - tbase - excl);
        }
        done = __shfl_sync(0xffffffffu, hi, 31);
        tbase += __shfl_sync(0xffffffffu, incl, 31);
      }
      __syncwarp();
      if (lane == 0 && x >= L.gemm_tiles) s_grp[1] = done;
    }
    __syncthreads();
    if (x < L.gemm_tiles) {
      expert = s_grp[0];
      if (expert < 0) return;
      const int64_t first = s_grp[1] + static_cast<int64_t>(s_grp[3]) * BM, hi = s_grp[2];
      for (int i = tid; i < BM; i += kThreads) {
        const int64_t r = first + i;
        s_arow[i] = r < hi ? r : -1;
        s_crow[i] = r < hi ? r : -1;
        any |= r < hi;
      }
    } else {
      // Rows past the last expert's are written as zeros.
      const int64_t first = s_grp[1] + (x - L.gemm_tiles) * BM;
      if (first >= L.R) return;
      for (int i = tid; i < BM; i += kThreads) {
        s_arow[i] = -1;
        s_crow[i] = first + i < L.R ? first + i : -1;
      }
    }
  } else {
    expert = x / L.tiles_per_expert;
    const int64_t s = x - expert * L.tiles_per_expert;
    int64_t cnt = L.counts[expert];
    cnt = cnt < 0 ? 0 : (cnt > L.T ? L.T : cnt);
    for (int i = tid; i < BM; i += kThreads) {
      const int64_t t = s * BM + i;
      const int64_t r = expert * L.T + t;
      s_crow[i] = t < L.T ? r : -1;
      s_arow[i] = t < cnt ? r : -1;  // rows past the count are written as zeros
      any |= t < cnt;
    }
  }
  any = __syncthreads_or(any);

  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][ni][r] = 0.0f;

  if (any) {
    const WeightView& w = p.w;
    const int periods = kQ8 ? kBK / L.period : 1;
    const float s2 = w.scale2 ? w.scale2[expert] : 1.0f;
    const bool a_fp8 = p.a.type == ElemType::kE4M3;
    const int64_t a_scols = L.a_scale_cols;

    uint4 ra[A_ITERS];
    uint4 rw[W_ITERS];
    float rws[W_ITERS];  // scale of each weight chunk (uniform case)
    int rwz[W_ITERS];    // zero point of each weight chunk
    float ras = 0.0f;    // kQ8: this thread's activation scale entry
    float rwsp[2] = {0.0f, 0.0f};  // kQ8: this thread's weight scale entries

    auto scale_index = [&](int64_t n, int64_t k) {
      const uint32_t sn = L.group_n == 1 ? static_cast<uint32_t>(n) : static_cast<uint32_t>(n) / L.group_n;
      const uint32_t sk = static_cast<uint32_t>(k) / L.group_k;
      return (expert * L.scale_rows + sn) * static_cast<int64_t>(L.scale_cols) + sk;
    };

    auto load_stage = [&](int64_t k0) {
#pragma unroll
      for (int it = 0; it < A_ITERS; ++it) {
        const int c = tid + it * kThreads;
        if (c < A_CHUNKS) ra[it] = load_a_chunk<kQ8>(L, s_arow[c / (kBK / 8)], k0 + (c % (kBK / 8)) * 8);
      }
#pragma unroll
      for (int it = 0; it < W_ITERS; ++it) {
        const int c = tid + it * kThreads;
        const int64_t n = n0 + c / (kBK / 8), k = k0 + (c % (kBK / 8)) * 8;
        rw[it] = load_w_chunk<WT>(L, expert, n, k);
        rws[it] = 1.0f;
        rwz[it] = 8;
        if constexpr (WT != WeightType::kFloat) {
          if (L.w_uniform && n < N && k < K) {
            const int64_t si = scale_index(n, k);
            if (!kQ8) rws[it] = load_elem(w.scale_type, w.scale, si);
            if (WT == WeightType::kUInt4 && w.zero) rwz[it] = w.zero[si];
          }
        }
      }
      if constexpr (kQ8) {
        if (tid < BM * periods) {
          const int row = tid % BM, pc = tid / BM;
          const int64_t ar = s_arow[row], k = k0 + pc * L.period;
          ras = (ar >= 0 && k < K) ? p.a.scale[ar * a_scols + static_cast<uint32_t>(k) / L.a_group_k] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int idx = tid + j * kThreads;
          if (idx < kBN * periods) {
            const int64_t n = n0 + idx % kBN, k = k0 + (idx / kBN) * L.period;
            rwsp[j] = (n < N && k < K) ? load_elem(w.scale_type, w.scale, scale_index(n, k)) * s2 : 0.0f;
          }
        }
      }
    };

    auto store_stage = [&](int st, int64_t k0) {
#pragma unroll
      for (int it = 0; it < A_ITERS; ++it) {
        const int c = tid + it * kThreads;
        if (c < A_CHUNKS) {
          const uint4 v = kQ8 ? a_codes_to_bf16(ra[it], a_fp8) : ra[it];
          *reinterpret_cast<uint4*>(&sA[st][c / (kBK / 8)][(c % (kBK / 8)) * 8]) = v;
        }
      }
#pragma unroll
      for (int it = 0; it < W_ITERS; ++it) {
        const int c = tid + it * kThreads;
        const int nl = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
        uint4 v;
        if constexpr (WT == WeightType::kFloat) {
          v = rw[it];
        } else {
          const int64_t n = n0 + nl, k = k0 + kc;
          float f[8];
          if (kQ8 || L.w_uniform) {
            weight_codes<WT>(rw[it], rwz[it], f);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              if (!kQ8) {
                f[j] = f[j] * rws[it];
                if (w.scale2) f[j] = f[j] * s2;
              }
              if (n >= N || k + j >= K) f[j] = 0.0f;
            }
          } else {
            // Scale groups narrower than a chunk: scale and zero point element by element.
            weight_codes<WT>(rw[it], 0, f);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              if (n < N && k + j < K) {
                const int64_t si = scale_index(n, k + j);
                if (WT == WeightType::kUInt4) f[j] = f[j] - static_cast<float>(w.zero ? w.zero[si] : 8);
                f[j] = f[j] * load_elem(w.scale_type, w.scale, si);
                if (w.scale2) f[j] = f[j] * s2;
              } else {
                f[j] = 0.0f;
              }
            }
          }
          v = pack8(f, kF16);
        }
        *reinterpret_cast<uint4*>(&sW[st][nl][kc]) = v;
      }
      if constexpr (kQ8) {
        if (tid < BM * periods) sAs[st][tid / BM][tid % BM] = ras;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int idx = tid + j * kThreads;
          if (idx < kBN * periods) sWs[st][idx / kBN][idx % kBN] = rwsp[j];
        }
      }
    };

    float part[kQ8 ? MI : 1][kQ8 ? NI : 1][4];
    if constexpr (kQ8) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
          for (int r = 0; r < 4; ++r) part[mi][ni][r] = 0.0f;
    }

    const int64_t ktiles = (K + kBK - 1) / kBK;
    load_stage(0);
    store_stage(0, 0);
    __syncthreads();
    for (int64_t kt = 0; kt < ktiles; ++kt) {
      const int st = static_cast<int>(kt & 1);
      if (kt + 1 < ktiles) load_stage((kt + 1) * kBK);
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        uint32_t af[MI][4];
        uint32_t bf[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          ldsm_x4(af[mi], &sA[st][wm * WTM + mi * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
#pragma unroll
        for (int nj = 0; nj < NI / 2; ++nj) {
          uint32_t r[4];
          ldsm_x4(r, &sW[st][wn * WTN + nj * 16 + (lane & 7) + (lane >> 4) * 8][ks * 16 + ((lane >> 3) & 1) * 8]);
          bf[2 * nj][0] = r[0];
          bf[2 * nj][1] = r[1];
          bf[2 * nj + 1][0] = r[2];
          bf[2 * nj + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) {
            if constexpr (kQ8)
              mma_16816<false>(part[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
            else
              mma_16816<kF16>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
          }
        if constexpr (kQ8) {
          if (((ks + 1) * 16) % L.period == 0) {
            const int pc = (ks * 16) / L.period;
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
              for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                  const int row = wm * WTM + mi * 16 + (lane >> 2) + (r >> 1) * 8;
                  const int col = wn * WTN + ni * 8 + 2 * (lane & 3) + (r & 1);
                  acc[mi][ni][r] += part[mi][ni][r] * sAs[st][pc][row] * sWs[st][pc][col];
                  part[mi][ni][r] = 0.0f;
                }
          }
        }
      }
      if (kt + 1 < ktiles) store_stage(st ^ 1, (kt + 1) * kBK);
      __syncthreads();
    }
  }

  // ---- epilogue: c = round(acc + bias); rows without a product are written as zeros -------------
  const bool c_f16 = p.c_type == ElemType::kF16;
  uint16_t* c = static_cast<uint16_t*>(p.c);
  const float* bias = p.w.bias;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = wm * WTM + mi * 16 + (lane >> 2) + half * 8;
      const int64_t cr = s_crow[row];
      if (cr < 0) continue;
      const bool zero = s_arow[row] < 0;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int64_t n = n0 + wn * WTN + ni * 8 + 2 * (lane & 3);
        if (n >= N) continue;
        float v0 = 0.0f, v1 = 0.0f;
        if (!zero) {
          v0 = acc[mi][ni][half * 2] + (bias ? bias[expert * N + n] : 0.0f);
          if (n + 1 < N) v1 = acc[mi][ni][half * 2 + 1] + (bias ? bias[expert * N + n + 1] : 0.0f);
        }
        const int64_t off = cr * N + n;
        if (n + 1 < N && (off & 1) == 0) {
          *reinterpret_cast<uint32_t*>(c + off) = c_f16 ? pack2<true>(v0, v1) : pack2<false>(v0, v1);
        } else {
          const uint32_t pr = c_f16 ? pack2<true>(v0, v1) : pack2<false>(v0, v1);
          c[off] = static_cast<uint16_t>(pr & 0xffffu);
          if (n + 1 < N) c[off + 1] = static_cast<uint16_t>(pr >> 16);
        }
      }
    }
}

// Launches the kernel for the problem's weight and activation types with BM rows per CTA. Each BM
// is instantiated in its own translation unit (gemm_sm80_bm*.cu) so the variants build in parallel.
template <int BM>
void launch_sm80(const GemmLaunch& L, dim3 grid, cudaStream_t stream);
template <>
void launch_sm80<16>(const GemmLaunch& L, dim3 grid, cudaStream_t stream);
template <>
void launch_sm80<32>(const GemmLaunch& L, dim3 grid, cudaStream_t stream);
template <>
void launch_sm80<64>(const GemmLaunch& L, dim3 grid, cudaStream_t stream);

template <int BM, WeightType WT>
void launch_sm80_for_act(const GemmLaunch& L, dim3 grid, cudaStream_t stream) {
  if (WT != WeightType::kFloat && L.p.a.quantized()) {
    if constexpr (WT != WeightType::kFloat) gemm_kernel<BM, WT, true, false><<<grid, kThreads, 0, stream>>>(L);
  } else if (L.p.a.type == ElemType::kF16) {
    gemm_kernel<BM, WT, false, true><<<grid, kThreads, 0, stream>>>(L);
  } else {
    gemm_kernel<BM, WT, false, false><<<grid, kThreads, 0, stream>>>(L);
  }
}

#define HJ_DEFINE_LAUNCH_SM80(BM)                                                                     \
  template <>                                                                                        \
  void launch_sm80<BM>(const GemmLaunch& L, dim3 grid, cudaStream_t stream) {                        \
    switch (L.p.w.type) {                                                                            \
      case WeightType::kFloat: launch_sm80_for_act<BM, WeightType::kFloat>(L, grid, stream); break;     \
      case WeightType::kUInt4: launch_sm80_for_act<BM, WeightType::kUInt4>(L, grid, stream); break;     \
      case WeightType::kInt8: launch_sm80_for_act<BM, WeightType::kInt8>(L, grid, stream); break;       \
      case WeightType::kFp8E4M3: launch_sm80_for_act<BM, WeightType::kFp8E4M3>(L, grid, stream); break; \
      case WeightType::kFp4E2M1: launch_sm80_for_act<BM, WeightType::kFp4E2M1>(L, grid, stream); break; \
    }                                                                                                \
  }

}  // namespace gemm
}  // namespace hj
