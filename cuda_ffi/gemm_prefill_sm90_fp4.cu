// Kind::kFp4Bf16 (gemm_prefill_sm90.h): the grouped GEMM for MXFP4 weights (e2m1 codes, one e8m0
// scale per 1 x 32 weights) with bf16 activations, our own sm_90a mainloop. CUTLASS's mixed-input
// collective cannot take it (its K tile must hold whole scale groups of at least 64 k), so:
//
//  * Operands swapped as in the uint4 kinds: 64 weight rows per warpgroup are wgmma's A operand,
//    converted from the codes in registers (A from registers), and a tile of BN token rows is the
//    B operand in shared memory (K-major, 128-byte swizzle). One conversion of a weight feeds BN
//    tokens, against one per 8 tokens in the decode kernel's mma.sync.
//  * The k order inside a 64-k tile is free as long as A and B agree. Lane t of a quad reads bytes
//    8t .. 8t+7 of each of its weight rows' 32-byte tile (one 8-byte shared load, conflict-free),
//    and the decode kernel's two-instruction e2m1 -> bf16 placement pairs nibbles p and p + 4 of a
//    word. The activations are therefore copied once, before the GEMM, into the workspace in the
//    matching order (permute_kernel, fp4_k_of below): logical k L = 16 j + 8 s + 2 t + h of the
//    tile holds the activation of physical k 16 t + 8 (j >> 1) + 2 (j & 1) + s + 4 h.
//  * Each 32-k scale group lies in one lane's bytes (t >> 1 picks the group), so the scale is
//    applied in registers before the MMA: w' = bf16(e2m1 * 2^(s-127)) exactly, as the contract's
//    float32-then-round gives (one bf16 multiply of exact factors; fp4_factors).
//  * A ring of kStages cp.async stages (codes + activations) filled by all 256 threads; wgmma is
//    asynchronous, so the conversion of tile k + 1 overlaps the MMAs of tile k (A registers double
//    buffered). Tiles over experts come from a tile list the setup kernel writes into the workspace
//    (expert, first row, rows), so a CTA starts with one load, not a search.
//  * Epilogue: accumulators + per-expert float32 bias, rounded to bf16 through shared memory into
//    16-byte row stores.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "gemm_decode_sm90.cuh"
#include "gemm_prefill_sm90.h"
#include "grouped_rows.cuh"

namespace hj {
namespace prefill {
namespace {

using decode::cp_async16;
using decode::cp_async_commit;
using decode::cp_async_wait;
using decode::cp_async_weights;
using decode::e2m1_bits;
using decode::fp4_factors;
using decode::hmul2;
using decode::smem_addr;

constexpr int kThreads = 256;  // two warpgroups, both loading and computing
constexpr int kBK = 64;        // k per stage: two scale groups
constexpr int kStages = 6;

// Physical k (within a 64-k tile) of the activation that logical position L of the permuted tile
// holds. The mapping of the lanes' code bytes onto wgmma's A fragment (module comment).
__host__ __device__ constexpr int fp4_k_of(int L) {
  return 16 * ((L >> 1) & 3) + 8 * (L >> 5) + 2 * ((L >> 4) & 1) + ((L >> 3) & 1) + 4 * (L & 1);
}

template <int MT, int BN>
struct Tile {
  static constexpr int kRows = 2 * 64 * MT;              // weight rows (output columns) per CTA
  static constexpr int kActBytes = BN * kBK * 2;          // one stage of activations
  static constexpr int kCodeBytes = kRows * kBK / 2;      // one stage of codes
  static constexpr int kRingBytes = kStages * (kActBytes + kCodeBytes);
  static constexpr int kOutStride = kRows * 2 + 16;       // epilogue staging row (bytes)
  static constexpr int kOutBytes = BN * kOutStride;
  static constexpr int kSmem = (kRingBytes > kOutBytes ? kRingBytes : kOutBytes) + 1024;  // + alignment
  static_assert(kActBytes % 1024 == 0, "128-byte swizzle atoms");
};

struct Fp4Params {
  const __nv_bfloat16* a;   // permuted activations [R, K] (workspace)
  const uint8_t* w;         // [E, N, K / 2] e2m1 codes
  const uint8_t* scale;     // [E, N, K / 32] e8m0
  const float* bias;        // [E, N] or nullptr
  __nv_bfloat16* c;         // [R, N]
  const int4* tiles;        // (expert, first row, rows, 0)
  const int* count;         // tiles in the list
  int N, K;
};

// ---------------------------------------------------------------------------------------------
// wgmma primitives (sm_90a).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps a register's value in place across asynchronous wgmma reads or writes (the compiler sees
// a read and a write here, so it can neither move nor reuse the register before this point).
__device__ __forceinline__ void fence_reg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor of a K-major tile with 128-byte swizzle: 8-row atoms of 128
// bytes, 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

template <int BN>
struct Mma;

// D[64 x 64] += A[64 x 16] (registers) * B[16 x 64] (shared memory).
template <>
struct Mma<64> {
  static __device__ __forceinline__ void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
  }
};

// D[64 x 128] += A[64 x 16] (registers) * B[16 x 128] (shared memory).
template <>
struct Mma<128> {
  static __device__ __forceinline__ void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
  }
};

// ---------------------------------------------------------------------------------------------
// Setup: the tile list, and the rows past the last expert as zeros. Block 0 writes the list (a warp
// scan of the experts' tile counts); every block takes a share of the zero tail.
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kSetupThreads) fp4_setup_kernel(const int32_t* offsets, int E, int R, int bn,
                                                                  int4* tiles, int* count, __nv_bfloat16* c,
                                                                  int64_t N) {
  extern __shared__ int32_t s_hi[];  // [E], block 0 only
  int last;
  if (blockIdx.x == 0) {
    last = expert_row_ends(offsets, E, R, s_hi);
    // Exclusive prefix of the tile counts, by warp 0 in chunks of 32 experts, written over s_hi
    // only after every thread has read its ends: first into registers of the writing threads.
    __shared__ int32_t s_first;
    const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
    if (tid == 0) s_first = 0;
    __syncthreads();
    for (int e0 = 0; e0 < E; e0 += kSetupThreads) {
      const int e = e0 + tid;
      const int lo = e < E ? (e > 0 ? s_hi[e - 1] : 0) : 0;
      const int hi = e < E ? s_hi[e] : 0;
      const int n = (hi - lo + bn - 1) / bn;
      // Block-wide exclusive scan of n over this chunk of kSetupThreads experts.
      __shared__ int32_t s_warp[kSetupThreads / 32];
      int v = n;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
      }
      if (lane == 31) s_warp[tid >> 5] = v;
      __syncthreads();
      int before = s_first;
      for (int w = 0; w < (tid >> 5); ++w) before += s_warp[w];
      before += v - n;
      for (int i = 0; i < n; ++i) tiles[before + i] = make_int4(e, lo + i * bn, min(bn, hi - lo - i * bn), 0);
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

// The activations in the mainloop's k order (fp4_k_of), a 64-k tile at a time: a warp copies four
// tiles (512 bytes) through shared memory, each lane then writes 16 bytes of the result.
__global__ void __launch_bounds__(256) fp4_permute_kernel(const uint16_t* a, uint16_t* out, int64_t tiles) {
  __shared__ uint16_t s[8][4 * kBK];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int sub = lane >> 3, c = lane & 7;  // lane's tile of the four and its 16-byte chunk
  for (int64_t t0 = (static_cast<int64_t>(blockIdx.x) * 8 + warp) * 4; t0 < tiles;
       t0 += static_cast<int64_t>(gridDim.x) * 32) {
    const bool ok = t0 + sub < tiles;
    if (ok) *reinterpret_cast<uint4*>(&s[warp][sub * kBK + c * 8]) = *reinterpret_cast<const uint4*>(a + (t0 + sub) * kBK + c * 8);
    __syncwarp();
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = s[warp][sub * kBK + fp4_k_of(c * 8 + 2 * i)];
      const uint32_t hi = s[warp][sub * kBK + fp4_k_of(c * 8 + 2 * i + 1)];
      v[i] = lo | (hi << 16);
    }
    if (ok) *reinterpret_cast<uint4*>(out + (t0 + sub) * kBK + c * 8) = make_uint4(v[0], v[1], v[2], v[3]);
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------------------------
// The GEMM. Grid: x = N tiles of kRows weight rows, y = tile-list entries (extra ones return).
// ---------------------------------------------------------------------------------------------
template <int MT, int BN>
__global__ void __launch_bounds__(kThreads, 1) fp4_gemm_kernel(Fp4Params P) {
  using T = Tile<MT, BN>;
  constexpr int kAcc = BN / 2;  // accumulators per thread and 64-row tile
  extern __shared__ uint8_t smem_raw[];
  const int tile_idx = static_cast<int>(blockIdx.y);
  if (tile_idx >= __ldg(P.count)) return;
  const int4 tile = P.tiles[tile_idx];
  const int e = tile.x, row0 = tile.y, rows = tile.z;
  const int n0 = static_cast<int>(blockIdx.x) * T::kRows;
  const int N = P.N, K = P.K;
  const int KT = K / kBK;

  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - smem_addr(smem_raw));
  const uint32_t act0 = base;                                  // stage s at act0 + s * kActBytes
  const uint32_t code0 = base + kStages * T::kActBytes;        // stage s at code0 + s * kCodeBytes

  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;

  const int64_t row_bytes = K / 2;
  const uint8_t* wexp = P.w + (static_cast<int64_t>(e) * N) * row_bytes;
  const int scols = K / 32;
  const uint8_t* sexp = P.scale + static_cast<int64_t>(e) * N * scols;
  const __nv_bfloat16* arow0 = P.a + static_cast<int64_t>(row0) * K;

  // This thread's weight rows: r = wg * 64 * MT + mt * 64 + warp * 16 + g + 8 h (in the CTA tile).
  auto my_row = [&](int mt, int h) { return wg * 64 * MT + mt * 64 + warp * 16 + g + 8 * h; };
  const uint8_t* srow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) srow[mt][h] = sexp + static_cast<int64_t>(min(n0 + my_row(mt, h), N - 1)) * scols + (t >> 1);

  auto load_stage = [&](int kt) {
    const int s = kt % kStages;
    // Codes: kRows rows x two 16-byte chunks.
#pragma unroll
    for (int i = 0; i < (T::kRows * 2) / kThreads; ++i) {
      const int ch = tid + i * kThreads;
      const int r = ch >> 1, half = ch & 1;
      const bool ok = n0 + r < N;
      const uint8_t* src = wexp + static_cast<int64_t>(ok ? n0 + r : 0) * row_bytes + kt * (kBK / 2) + half * 16;
      cp_async_weights(code0 + s * T::kCodeBytes + r * (kBK / 2) + half * 16, src, ok ? 16 : 0);
    }
    // Activations: BN rows x eight 16-byte chunks, 128-byte swizzle.
#pragma unroll
    for (int i = 0; i < (BN * 8) / kThreads; ++i) {
      const int ch = tid + i * kThreads;
      const int r = ch >> 3, c = ch & 7;
      const bool ok = r < rows;
      const __nv_bfloat16* src = arow0 + static_cast<int64_t>(ok ? r : 0) * K + kt * kBK + c * 8;
      cp_async16(act0 + s * T::kActBytes + r * 128 + ((c ^ (r & 7)) << 4), src, ok ? 16 : 0);
    }
  };

  float acc[MT][kAcc];  // the first MMA of a tile overwrites them (scale-d 0): no initialization
  uint32_t afrag[2][MT][4][4];  // [buffer][m tile][k16 step][register]

  // Scales of the next tiles, loaded two iterations ahead.
  uint32_t sc[3][MT][2];
  auto load_scales = [&](int kt, uint32_t (&dst)[MT][2]) {
    const int k = min(kt, KT - 1) * 2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) dst[mt][h] = __ldg(srow[mt][h] + k);
  };
  load_scales(0, sc[0]);
  load_scales(1, sc[1]);

#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < KT) load_stage(s);
    cp_async_commit();
  }

  // One k tile: codes of stage kt to A fragments of buffer B, then the MMAs.
  auto step = [&](int kt, auto buf) {
    constexpr int B = decltype(buf)::value;
    cp_async_wait<kStages - 3>();
    __syncthreads();  // stage kt visible; every warpgroup's MMAs of tile kt - 2 are complete
    if (kt + kStages - 2 < KT) load_stage(kt + kStages - 2);
    cp_async_commit();
    load_scales(kt + 2, sc[2]);
    const int s = kt % kStages;
    bool two = false;
    uint32_t f2[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t words[2];
        decode::lds64(words, code0 + s * T::kCodeBytes + my_row(mt, h) * (kBK / 2) + t * 8);
        uint32_t f1;
        bool tw;
        fp4_factors(sc[0][mt][h], f1, f2[mt][h], tw);
        two |= tw;
#pragma unroll
        for (int wd = 0; wd < 2; ++wd) {
          // Pair p of word wd: nibbles p and p + 4 -> k16 step (4 wd + p) >> 1, slot p & 1.
          afrag[B][mt][2 * wd + 0][0 + h] = hmul2<false>(e2m1_bits<0, 6>(words[wd]), f1);
          afrag[B][mt][2 * wd + 0][2 + h] = hmul2<false>(e2m1_bits<1, 6>(words[wd]), f1);
          afrag[B][mt][2 * wd + 1][0 + h] = hmul2<false>(e2m1_bits<2, 6>(words[wd]), f1);
          afrag[B][mt][2 * wd + 1][2 + h] = hmul2<false>(e2m1_bits<3, 6>(words[wd]), f1);
        }
      }
    // e8m0 scales above 128 (weights beyond +-12) practically never occur: one vote per warp and
    // tile, and the second factor only then (1.0 for the rows that do not need it).
    if (__any_sync(0xffffffffu, two)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) afrag[B][mt][j][r] = hmul2<false>(afrag[B][mt][j][r], f2[mt][r & 1]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[0][mt][h] = sc[1][mt][h];
        sc[1][mt][h] = sc[2][mt][h];
      }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) fence_reg(acc[mt][i]);
    wgmma_fence();
    const uint32_t act = act0 + s * T::kActBytes;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint64_t desc = smem_desc(act + j * 32);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) Mma<BN>::run(acc[mt], afrag[B][mt][j], desc, kt > 0 || j > 0);
    }
    wgmma_commit();
    wgmma_wait<1>();  // tile kt - 1 done: the other buffer's registers are free again
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) fence_reg(afrag[B ^ 1][mt][j][r]);
  };

  for (int kt = 0; kt < KT; kt += 2) {
    step(kt, std::integral_constant<int, 0>{});
    if (kt + 1 < KT) step(kt + 1, std::integral_constant<int, 1>{});
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) fence_reg(acc[mt][i]);
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the output staging

  // acc[mt][4 i + q]: weight row my_row(mt, q >> 1), token 8 i + 2 t + (q & 1).
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = my_row(mt, h);
      const float b = (P.bias != nullptr && n0 + r < N) ? __ldg(P.bias + static_cast<int64_t>(e) * N + n0 + r) : 0.0f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int tok = 8 * i + 2 * t + q;
          *reinterpret_cast<__nv_bfloat16*>(smem + tok * T::kOutStride + r * 2) =
              __float2bfloat16_rn(acc[mt][4 * i + 2 * h + q] + b);
        }
    }
  __syncthreads();
  constexpr int kChunks = T::kRows / 8;  // 16-byte chunks of an output row
  for (int ch = tid; ch < BN * kChunks; ch += kThreads) {
    const int tok = ch / kChunks, cc = ch % kChunks;
    if (tok < rows && n0 + cc * 8 < N)
      *reinterpret_cast<uint4*>(P.c + static_cast<int64_t>(row0 + tok) * N + n0 + cc * 8) =
          *reinterpret_cast<const uint4*>(smem + tok * T::kOutStride + cc * 16);
  }
}

template <int MT, int BN>
std::string launch_gemm(const Fp4Params& P, int64_t max_tiles, int device, cudaStream_t stream) {
  using T = Tile<MT, BN>;
  {
    // The shared-memory limit is raised once per device (a per-context attribute).
    static std::mutex mu;
    static bool done[64] = {};
    if (device < 0 || device >= 64) return "device index out of range";
    std::lock_guard<std::mutex> lock(mu);
    if (!done[device]) {
      const cudaError_t e =
          cudaFuncSetAttribute(fp4_gemm_kernel<MT, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmem);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
      }
      done[device] = true;
    }
  }
  const dim3 grid(static_cast<unsigned>((P.N + T::kRows - 1) / T::kRows), static_cast<unsigned>(max_tiles));
  fp4_gemm_kernel<MT, BN><<<grid, kThreads, T::kSmem, stream>>>(P);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("fp4_gemm_kernel: ") + cudaGetErrorString(err);
}

}  // namespace

int64_t fp4_tile_tokens(Kind kind) { return kind == Kind::kFp4Bf16N128 ? 128 : 64; }

size_t fp4_workspace_bytes(int64_t R, int64_t K, int64_t E) {
  // Count (128 bytes), tile list (at most R / 64 + E + 1 entries of 16 bytes: each expert and the
  // zero tail add at most one partial tile), the activations at a 128-byte boundary, and the slack
  // run_grouped spends on aligning the base.
  const size_t list = static_cast<size_t>((R + 63) / 64 + E + 1) * 16;
  return 128 + (128 + list + 127) / 128 * 128 + static_cast<size_t>(R) * static_cast<size_t>(K) * 2;
}

std::string run_fp4_bf16(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream) {
  const int64_t bn = fp4_tile_tokens(g.kind);
  const int64_t max_tiles = (g.R + bn - 1) / bn + g.E + 1;
  // Workspace (base 128-byte aligned by run_grouped): count, tile list, then the activations.
  uint8_t* ws = static_cast<uint8_t*>(g.workspace);
  int* count = reinterpret_cast<int*>(ws);
  int4* tiles = reinterpret_cast<int4*>(ws + 128);
  const size_t act_off = (128 + static_cast<size_t>(max_tiles) * 16 + 127) / 128 * 128;
  __nv_bfloat16* act = reinterpret_cast<__nv_bfloat16*>(ws + act_off);
  if (g.workspace_bytes < act_off + static_cast<size_t>(g.R) * static_cast<size_t>(g.K) * 2)
    return "workspace too small for the permuted activations";
  // Rows past the last expert: a share per block, as in the other kinds' setup.
  const int64_t zero_work = g.R * g.N / 8;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(dev.sm_count * 4, (zero_work + kSetupThreads * 8 - 1) / (kSetupThreads * 8)));
  fp4_setup_kernel<<<static_cast<unsigned>(blocks), kSetupThreads, g.E * sizeof(int32_t), stream>>>(
      g.offsets, static_cast<int>(g.E), static_cast<int>(g.R), static_cast<int>(bn), tiles, count,
      static_cast<__nv_bfloat16*>(g.c), g.N);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("fp4_setup_kernel: ") + cudaGetErrorString(err);
  const int64_t ktiles = g.R * (g.K / kBK);
  if (ktiles > 0) {
    const int64_t pblocks = std::min<int64_t>((ktiles + 31) / 32, int64_t{dev.sm_count} * 16);
    fp4_permute_kernel<<<static_cast<unsigned>(pblocks), 256, 0, stream>>>(static_cast<const uint16_t*>(g.a),
                                                                           reinterpret_cast<uint16_t*>(act), ktiles);
    err = cudaGetLastError();
    if (err != cudaSuccess) return std::string("fp4_permute_kernel: ") + cudaGetErrorString(err);
  }
  Fp4Params P;
  P.a = act;
  P.w = static_cast<const uint8_t*>(g.w);
  P.scale = static_cast<const uint8_t*>(g.w_scale_raw);
  P.bias = g.bias;
  P.c = static_cast<__nv_bfloat16*>(g.c);
  P.tiles = tiles;
  P.count = count;
  P.N = static_cast<int>(g.N);
  P.K = static_cast<int>(g.K);
  return bn == 128 ? launch_gemm<1, 128>(P, max_tiles, dev.device, stream) : launch_gemm<2, 64>(P, max_tiles, dev.device, stream);
}

}  // namespace prefill
}  // namespace hj
