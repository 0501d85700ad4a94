// Kind::kFp4Bf16 and Kind::kU4Bf16Rs (gemm_prefill_sm90.h): the grouped GEMM for 4-bit codes with
// bf16 activations on our own sm_90a mainloop: MXFP4 (e2m1 codes, one e8m0 scale per 1 x 32
// weights), which CUTLASS's mixed-input collective cannot take (its K tile must hold whole scale
// groups of at least 64 k), and uint4 (offset 8) with bf16 scales per 1 x group_k, group_k a
// multiple of 64 (or spanning K), where it replaces that collective at few rows per expert. So:
//
//  * Operands swapped as in the uint4 kinds: 64 weight rows per warpgroup (128 per CTA) are wgmma's
//    A operand, converted from the codes in registers (A from registers), and a tile of up to 128
//    token rows is the B operand in shared memory (K-major, 128-byte swizzle). One conversion of a
//    weight feeds all the tile's tokens, against one per 8 tokens in the decode kernel's mma.sync.
//  * Each expert's rows are split into ceil(rows / 128) tiles of near-equal size, and a CTA runs
//    the mainloop instantiated for its tile's rows rounded up to 16 (wgmma's N = 16 .. 128): one
//    pass over the weights per 128 rows, and at most 15 rows of wasted MMA work per tile (with
//    fixed 64-row tiles, experts of 65-80 rows cost two weight passes).
//  * The k order inside a 64-k tile is free as long as A and B agree. Lane t of a quad reads bytes
//    8t .. 8t+7 of each of its weight rows' 32-byte tile (one 8-byte shared load, conflict-free),
//    and the decode kernel's two-instruction e2m1 -> bf16 placement pairs nibbles p and p + 4 of a
//    word. The activations are therefore copied once, before the GEMM, into the workspace in the
//    matching order (permute4_kernel, rs4_k_of in rs4_k_order.h): logical k L = 16 j + 8 s + 2 t + h
//    of the tile holds the activation of physical k 16 t + 8 (j >> 1) + 2 (j & 1) + s + 4 h; or the
//    caller's rows are already in it (GroupedArgs::a_k_order: permute_rows and the activation write
//    them so for the grouped class) and are read where they are.
//  * Each 32-k scale group lies in one lane's bytes (t >> 1 picks the group), so the scale is
//    applied in registers before the MMA: w' = bf16(e2m1 * 2^(s-127)) exactly, as the contract's
//    float32-then-round gives (one bf16 multiply of exact factors; fp4_factors). uint4: the
//    decode kernel's magic-number conversion, bf16(128 + q) - 136 = q - 8 exactly, times the bf16
//    scale: one rounding of an exact product, the contract's w'.
//  * A ring of kStages cp.async stages (codes + activations) filled by all 256 threads; wgmma is
//    asynchronous, so the conversion of tile k + 1 overlaps the MMAs of tile k (A registers double
//    buffered). Two CTAs per SM, so that one's pipeline fill and epilogue overlap the other's
//    mainloop. Tiles over experts come from a tile list the setup kernel writes into the workspace
//    (expert, first row, rows), so a CTA starts with one load, not a search.
//  * Epilogue: accumulators + per-expert float32 bias, rounded to bf16 through shared memory into
//    16-byte row stores.
//  * A warp-specialized form of the same tile (tiles of at most 96 rows; gemm4_ws_kernel below,
//    HUMMING_JAX_PREFILL_RS4_WS=1 / 2, for A/B): a producer warp loads the ring by TMA, the two
//    warpgroups only wait, convert and issue the MMAs. Same bits as the mainloop.
//  * The default, a persistent form (gemm4_wsp_kernel, ws_form; HUMMING_JAX_PREFILL_RS4_WS=3 / 4):
//    one CTA per SM of four consumer warpgroups and a producer warpgroup that gives them registers
//    (setmaxnreg), precomputes the e2m1 scale factors and, where a row's scales span whole 16
//    bytes, takes them by TMA in 16-byte windows a row. Same bits, but for a last round that would
//    keep at most half the CTAs busy: its items run as 2-4 k-parts on as many CTAs, the last part
//    adding the others' float32 sums (through the workspace) to its own before the epilogue
//    (wsp_items; HUMMING_JAX_PREFILL_RS4_SPLIT=0 keeps them whole, for A/B and bit-for-bit tests).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "gemm_decode_sm90.cuh"
#include "gemm_prefill_sm90.h"
#include "mbarrier_sm90.cuh"
#include "rs4_k_order.h"
#include "tensor_map.h"
#include "tile_list.cuh"
#include "wgmma_sm90.cuh"

namespace hj {
namespace prefill {
namespace {

using decode::cp_async16;
using decode::cp_async_commit;
using decode::cp_async_wait;
using decode::cp_async_weights;
using decode::fence_reg;
using decode::e2m1_bits;
using decode::fp4_factors;
using decode::hmul2;
using decode::smem_addr;
using decode::wgmma_commit;
using decode::wgmma_fence;
using decode::wgmma_wait;

constexpr int kThreads = 256;    // two warpgroups, both loading and computing
constexpr int kBK = 64;          // k per stage: two scale groups
constexpr int kStages = 5;
constexpr int kRows = 128;       // weight rows (output columns) per CTA
constexpr int kMaxTokens = 128;  // token rows per tile
constexpr int kActBytes = kMaxTokens * kBK * 2;  // one stage of activations (16 KB)
constexpr int kCodeBytes = kRows * kBK / 2;      // one stage of codes (4 KB)
constexpr int kOutStride = kRows * 2 + 16;       // epilogue staging row (bytes)
constexpr int kRingBytes = kStages * (kActBytes + kCodeBytes);
constexpr int kSmem = (kRingBytes > kMaxTokens * kOutStride ? kRingBytes : kMaxTokens * kOutStride) + 1024;
// The persistent forms' split of a small last round (wsp_items): at most kSplitSlots partial sums of
// a CTA's accumulators (512 consumer threads x at most 64 floats, thread-major), kSplitMaxParts
// parts an item; the flags, one per slot and consumer warpgroup, before them in the workspace.
constexpr int kSplitSlots = 66, kSplitMaxParts = 4;
constexpr int kSplitSlotFloats = 512 * 64;
constexpr size_t kSplitFlagBytes = (kSplitSlots * 4 * sizeof(unsigned) + 127) / 128 * 128;
constexpr size_t kSplitBytes = kSplitFlagBytes + size_t{kSplitSlots} * kSplitSlotFloats * sizeof(float);

// rs4_k_of (rs4_k_order.h): physical k (within a 64-k tile) of the activation that logical position
// L of the permuted tile holds, the mapping of the lanes' code bytes onto wgmma's A fragment (module
// comment).

// The codes' format: e2m1 with e8m0 scales per 32 k, or uint4 (offset 8) with bf16 scales per
// group_k (whole 64-k tiles).
enum class Codes : int { kE2M1 = 0, kU4 = 1 };

struct Params4 {
  const __nv_bfloat16* a;   // permuted activations [R, K] (workspace, or the caller's rows: a_k_order)
  const uint8_t* w;         // [E, N, K / 2] codes, low nibble first
  const void* scale;        // e2m1: [E, N, K / 32] e8m0; uint4: [E, N, scale_cols] bf16
  int scale_cols;           // uint4: scale columns per weight row
  decode::FastDiv div_tpg;  // uint4: 64-k tile -> scale column (tiles per group)
  const float* bias;        // [E, N] or nullptr
  __nv_bfloat16* c;         // [R, N]
  const int4* tiles;        // (expert, first row, rows, 0)
  const int* count;         // tiles in the list
  int N, K;
  // The persistent forms' split of a small last round over K (wsp_items): the partial sums
  // [kSplitSlots][kSplitSlotFloats] and their flags [kSplitSlots][4] in the workspace (the flags
  // zeroed by the tile-list kernel each call); split 0 turns it off.
  float* part;
  unsigned* part_flags;
  int split;
};

// The activations in the mainloop's k order (rs4_k_of), 64-k tiles of 128 bytes: a warp copies
// kPermuteTiles tiles through shared memory per pass (each lane kPermuteTiles / 4 independent
// 16-byte loads in flight), then each lane writes its 16-byte chunks of the result.
constexpr int kPermuteTiles = 16;
__global__ void __launch_bounds__(256) permute4_kernel(const uint16_t* a, uint16_t* out, int64_t tiles) {
  __shared__ uint4 s[8][kPermuteTiles * kBK / 8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int sub = lane >> 3, c = lane & 7;  // the lane's tile within each group of four, its chunk
  const uint16_t* sw = reinterpret_cast<const uint16_t*>(s[warp]);
  for (int64_t t0 = (static_cast<int64_t>(blockIdx.x) * 8 + warp) * kPermuteTiles; t0 < tiles;
       t0 += static_cast<int64_t>(gridDim.x) * 8 * kPermuteTiles) {
    uint4 v[kPermuteTiles / 4];
#pragma unroll
    for (int q = 0; q < kPermuteTiles / 4; ++q) {
      const int64_t t = t0 + 4 * q + sub;
      if (t < tiles) v[q] = *reinterpret_cast<const uint4*>(a + t * kBK + c * 8);
    }
#pragma unroll
    for (int q = 0; q < kPermuteTiles / 4; ++q) s[warp][(4 * q + sub) * 8 + c] = v[q];
    __syncwarp();
#pragma unroll
    for (int q = 0; q < kPermuteTiles / 4; ++q) {
      const int64_t t = t0 + 4 * q + sub;
      const uint16_t* in = sw + (4 * q + sub) * kBK;
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = static_cast<uint32_t>(in[rs4_k_of(c * 8 + 2 * i)]) | (static_cast<uint32_t>(in[rs4_k_of(c * 8 + 2 * i + 1)]) << 16);
      if (t < tiles) *reinterpret_cast<uint4*>(out + t * kBK + c * 8) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncwarp();
  }
}

// w' of nibbles P and P + 4 of a word as a bf16 pair, f1 the row's scale factor (e2m1: the first
// factor of fp4_factors; uint4: the bf16 scale in both halves).
template <Codes C, int P>
__device__ __forceinline__ uint32_t pair(uint32_t word, uint32_t f1) {
  if constexpr (C == Codes::kE2M1) {
    return hmul2<false>(e2m1_bits<P, 6>(word), f1);
  } else {
    const uint32_t m = decode::and_or(decode::shift_left<-4 * P>(word), 0x000f000fu, 0x43004300u);  // 128 + q
    return hmul2<false>(decode::hsub2<false>(m, 0x43084308u), f1);                                   // (q - 8) * s
  }
}

// One 64-k tile of a thread's two weight rows (h = 0, 1: code words words[h], scale sc[h]: e2m1, the
// lane's e8m0 byte; uint4, the bf16 scale's bits) to its wgmma A fragments frag[k16 step][register],
// times the first scale factor; f2 gets the second factor of each row, and the result says whether
// any row needs it (apply_second_factor).
template <Codes C>
__device__ __forceinline__ bool convert_codes(const uint32_t (&words)[2][2], const uint32_t (&sc)[2], uint32_t (&frag)[4][4],
                                              uint32_t (&f2)[2]) {
  bool two = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t f1;
    if constexpr (C == Codes::kE2M1) {
      bool tw;
      fp4_factors(sc[h], f1, f2[h], tw);
      two |= tw;
    } else {
      f1 = sc[h] * 0x10001u;
      f2[h] = 0x3f803f80u;  // 1.0
      two |= sc[h] == 0u;
    }
#pragma unroll
    for (int wd = 0; wd < 2; ++wd) {
      // Pair p of word wd: nibbles p and p + 4 -> k16 step (4 wd + p) >> 1, slot p & 1.
      frag[2 * wd + 0][0 + h] = pair<C, 0>(words[h][wd], f1);
      frag[2 * wd + 0][2 + h] = pair<C, 1>(words[h][wd], f1);
      frag[2 * wd + 1][0 + h] = pair<C, 2>(words[h][wd], f1);
      frag[2 * wd + 1][2 + h] = pair<C, 3>(words[h][wd], f1);
    }
  }
  return two;
}

// e8m0 scales above 128 (weights beyond +-12) practically never occur: one vote per warp and tile,
// and the second factor only then (1.0 for the rows that do not need it). The branch also keeps
// ptxas from scheduling conversion instructions past wgmma.fence, which it answers by serializing
// every wgmma (C7513); uint4 therefore keeps one too, on a zero scale, with the factor 1.0 (no
// change to any value).
__device__ __forceinline__ void apply_second_factor(bool two, const uint32_t (&f2)[2], uint32_t (&frag)[4][4]) {
  if (__any_sync(0xffffffffu, two)) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) frag[j][r] = hmul2<false>(frag[j][r], f2[r & 1]);
  }
}

// The four MMAs of a 64-k tile: acc (+)= fragments A of afrag x the activation stage at act (its
// first MMA overwrites acc unless accumulate). Double buffer (kDouble): returns once the previous
// tile's MMAs are done, the other buffer's registers free again; single: once this tile's are.
template <int BN, bool kDouble, int A>
__device__ __forceinline__ void mma_tile(float (&acc)[BN / 2], uint32_t (&afrag)[kDouble ? 2 : 1][4][4], uint32_t act,
                                         bool accumulate) {
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) fence_reg(acc[i]);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) fence_reg(afrag[A][j][r]);  // converted before the fence, not between MMAs
  wgmma_fence();
  const uint32_t dlo = smem_desc_lo(act);
#pragma unroll
  for (int j = 0; j < 4; ++j) Mma<BN>::run(acc, afrag[A][j], smem_desc(dlo + 2 * j), accumulate || j > 0);
  wgmma_commit();
  if constexpr (kDouble)
    wgmma_wait<1>();
  else
    wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) fence_reg(afrag[kDouble ? (A ^ 1) : 0][j][r]);
}

// The epilogue of a tile of S slabs of 64 weight rows per warpgroup, for the kThreadsHere / 128
// warpgroups that share it (64 S of them rows from n0): acc[sl][4 i + q] (weight row wg * 64 S +
// sl * 64 + warp * 16 + g + 8 (q >> 1), token 8 i + 2 t + (q & 1)) plus the expert's bias, rounded
// to bf16 and staged in shared memory, then stored as 16-byte row chunks by the kThreadsHere
// threads of tid; sync() is the barrier among them (where the staging overwrites the ring, every MMA
// of the tile must be done before the first one).
template <int BN, int kThreadsHere, int S, int AW, typename Sync>
__device__ __forceinline__ void store_tile(const Params4& P, const float (&acc)[S][AW], int e, int row0, int rows,
                                           int n0, uint8_t* smem, int tid, Sync sync) {
  static_assert(AW >= BN / 2, "accumulators");
  constexpr int kRowsCta = kThreadsHere / 128 * 64 * S;
  constexpr int kStride = kRowsCta * 2 + 16;  // staging row (bytes)
  const int N = P.N;
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  sync();
#pragma unroll
  for (int sl = 0; sl < S; ++sl)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wg * 64 * S + sl * 64 + warp * 16 + g + 8 * h;
      const float b = (P.bias != nullptr && n0 + r < N) ? __ldg(P.bias + static_cast<int64_t>(e) * N + n0 + r) : 0.0f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int tok = 8 * i + 2 * t + q;
          *reinterpret_cast<__nv_bfloat16*>(smem + tok * kStride + r * 2) = __float2bfloat16_rn(acc[sl][4 * i + 2 * h + q] + b);
        }
    }
  sync();
  constexpr int kChunks = kRowsCta / 8;  // 16-byte chunks of an output row
  for (int ch = tid; ch < BN * kChunks; ch += kThreadsHere) {
    const int tok = ch / kChunks, cc = ch % kChunks;
    if (tok < rows && n0 + cc * 8 < N)
      *reinterpret_cast<uint4*>(P.c + static_cast<int64_t>(row0 + tok) * N + n0 + cc * 8) =
          *reinterpret_cast<const uint4*>(smem + tok * kStride + cc * 16);
  }
}

// ---------------------------------------------------------------------------------------------
// One CTA tile: 128 weight rows from n0 of expert e x `rows` token rows from row0, on the mainloop
// of width BN (rows rounded up to 16).
// ---------------------------------------------------------------------------------------------
template <Codes C, int BN>
__device__ __forceinline__ void tile4(const Params4& P, int e, int row0, int rows, int n0, uint8_t* smem,
                                         uint32_t base) {
  constexpr int kAcc = BN / 2;  // accumulators per thread
  // Double-buffered A fragments (the conversion of tile k + 1 overlaps tile k's MMAs) up to 96
  // tokens; wider tiles convert after their MMAs are done, to stay within 128 registers (two CTAs
  // per SM), and leave the overlap to the SM's other warpgroups.
  constexpr bool kDouble = BN <= 96;
  const int N = P.N, K = P.K;
  const int KT = K / kBK;
  const uint32_t act0 = base;                           // stage s at act0 + s * kActBytes
  const uint32_t code0 = base + kStages * kActBytes;    // stage s at code0 + s * kCodeBytes

  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;

  const int64_t row_bytes = K / 2;
  const uint8_t* wexp = P.w + static_cast<int64_t>(e) * N * row_bytes;
  const int scols = C == Codes::kE2M1 ? K / 32 : P.scale_cols;
  const __nv_bfloat16* arow0 = P.a + static_cast<int64_t>(row0) * K;

  // This thread's weight rows in the CTA tile: wg * 64 + warp * 16 + g + 8 h.
  auto my_row = [&](int h) { return wg * 64 + warp * 16 + g + 8 * h; };
  // Scale index of each of the thread's rows at k tile 0 (e2m1: the lane's 32-k group t >> 1).
  int64_t srow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    srow[h] = (static_cast<int64_t>(e) * N + min(n0 + my_row(h), N - 1)) * scols + (C == Codes::kE2M1 ? (t >> 1) : 0);

  // Each thread's cp.async sources, advanced by one k tile per stage: one 16-byte chunk of codes
  // (row tid / 2) and kActChunks of activations (rows past the tile's are zero-filled: no read).
  constexpr int kActChunks = (BN * 8 + kThreads - 1) / kThreads;
  const int crow = tid >> 1;
  const uint8_t* csrc = wexp + static_cast<int64_t>(n0 + crow < N ? n0 + crow : 0) * row_bytes + (tid & 1) * 16;
  const int cbytes = n0 + crow < N ? 16 : 0;
  const uint32_t cdst = crow * (kBK / 2) + (tid & 1) * 16;
  const __nv_bfloat16* asrc[kActChunks];
  uint32_t adst[kActChunks];
  int abytes[kActChunks];
#pragma unroll
  for (int i = 0; i < kActChunks; ++i) {
    const int ch = tid + i * kThreads, r = ch >> 3, c = ch & 7;
    const bool ok = r < rows;
    asrc[i] = arow0 + static_cast<int64_t>(ok ? r : 0) * K + c * 8;
    abytes[i] = ok ? 16 : 0;
    adst[i] = r < BN ? r * 128 + ((c ^ (r & 7)) << 4) : ~0u;  // ~0: beyond the tile width, no copy
  }
  auto load_stage = [&](int kt, int s) {
    cp_async_weights(code0 + s * kCodeBytes + cdst, csrc + kt * (kBK / 2), cbytes);
#pragma unroll
    for (int i = 0; i < kActChunks; ++i)
      if (BN * 8 % kThreads == 0 || adst[i] != ~0u)
        cp_async16(act0 + s * kActBytes + adst[i], asrc[i] + kt * kBK, abytes[i]);
  };

  float acc[kAcc];  // the first MMA of the tile overwrites them (scale-d 0): no initialization
  uint32_t afrag[kDouble ? 2 : 1][4][4];  // [buffer][k16 step][register]

  // Scales of tiles kt (slot kt & 1) and kt + 1: slot kt & 1 is reloaded for tile kt + 2 once tile
  // kt has read it, so the ring needs no register copies (a copy would wait for the load).
  uint32_t sc[2][2];
  auto load_scales = [&](int kt, uint32_t (&dst)[2]) {
    const uint32_t k = static_cast<uint32_t>(min(kt, KT - 1));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (C == Codes::kE2M1)
        dst[h] = __ldg(static_cast<const uint8_t*>(P.scale) + srow[h] + 2 * k);
      else
        dst[h] = __ldg(static_cast<const unsigned short*>(P.scale) + srow[h] + P.div_tpg.div(k));
    }
  };
  load_scales(0, sc[0]);
  load_scales(1, sc[1]);

#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }
  int s_use = 0, s_load = kStages - 2;  // ring slots of tile kt and of tile kt + kStages - 2

  // One k tile: codes of stage kt to A fragments of buffer B, then the MMAs.
  auto step = [&](int kt, auto buf) {
    constexpr int B = decltype(buf)::value;  // the scale slot
    constexpr int A = kDouble ? B : 0;         // the fragment buffer
    cp_async_wait<kStages - 3>();
    __syncthreads();  // stage kt visible; every warpgroup's MMAs of tile kt - 2 are complete
    if (kt + kStages - 2 < KT) load_stage(kt + kStages - 2, s_load);
    cp_async_commit();
    const int s = s_use;
    s_use = s_use == kStages - 1 ? 0 : s_use + 1;
    s_load = s_load == kStages - 1 ? 0 : s_load + 1;
    uint32_t words[2][2], f2[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) decode::lds64(words[h], code0 + s * kCodeBytes + my_row(h) * (kBK / 2) + t * 8);
    const bool two = convert_codes<C>(words, sc[B], afrag[A], f2);
    load_scales(kt + 2, sc[B]);
    apply_second_factor(two, f2, afrag[A]);
    mma_tile<BN, kDouble, A>(acc, afrag, act0 + s * kActBytes, kt > 0);
  };

  for (int kt = 0; kt < KT; kt += 2) {
    step(kt, std::integral_constant<int, 0>{});
    if (kt + 1 < KT) step(kt + 1, std::integral_constant<int, 1>{});
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) fence_reg(acc[i]);
  cp_async_wait<0>();
  store_tile<BN, kThreads, 1>(P, reinterpret_cast<const float(&)[1][kAcc]>(acc), e, row0, rows, n0, smem, tid,
                              [] { __syncthreads(); });  // the ring: the staging
}

// Grid: x = N tiles of kRows weight rows, y = tile-list entries (extra ones return).
template <Codes C>
__global__ void __launch_bounds__(kThreads, 2) gemm4_kernel(Params4 P) {
  extern __shared__ uint8_t smem_raw[];
  const int tile_idx = static_cast<int>(blockIdx.y);
  if (tile_idx >= __ldg(P.count)) return;
  const int4 tile = P.tiles[tile_idx];
  const int n0 = static_cast<int>(blockIdx.x) * kRows;
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - smem_addr(smem_raw));
  switch ((tile.z + 15) >> 4) {  // the tile's rows (1 .. kMaxTokens) in 16s
    case 1: tile4<C, 16>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
    case 2: tile4<C, 32>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
    case 3: tile4<C, 48>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
    case 4: tile4<C, 64>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
    case 5: tile4<C, 80>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
    case 6: tile4<C, 96>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
    case 7: tile4<C, 112>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
    default: tile4<C, 128>(P, tile.x, tile.y, tile.z, n0, smem, base); break;
  }
}

// ---------------------------------------------------------------------------------------------
// The warp-specialized form of the same tile (HUMMING_JAX_PREFILL_RS4_WS=1 / 2, A/B; the persistent
// form further below grew out of it and is the default). Beside
// humming-kernels the mainloop above does the same conversion and MMA work but issues ~30% more
// instructions (every thread's copy and scale-load addressing, the ring's slot arithmetic) and
// waits at a CTA barrier per stage (benchmarks/NOTES.md, v11v). Here a producer warp fills a ring
// of kWsStages: per stage one TMA box of the 128 rows' codes (32 bytes each, no swizzle: the layout
// the consumers read above), one box of the tile's activation rows x 64 k (128-byte swizzle, the B
// operand's layout above; rows past R zero, rows past the tile's never stored) and the 128 rows'
// 16-bit scale words (loaded kWsScaleAhead stages ahead, stored to shared memory), all completing
// one mbarrier. The two consumer warpgroups wait on it, convert and issue the MMAs in the same k
// order and rounding as above (the same bits), one k16 step at a time, and release the stage on a
// second mbarrier once its MMAs are done. The producer is a ninth warp; two CTAs per SM leave 96
// registers a thread (18 warps, five on some scheduler; a producer warpgroup giving its registers
// to the consumers by setmaxnreg would leave ptxas 80), which bounds the tile: 96 tokens with one
// 64-row slab per warpgroup, 32 with two (WsShape).
// ---------------------------------------------------------------------------------------------
constexpr int kWsThreads = 288;  // two consumer warpgroups (warps 0-7) + a producer warp
constexpr int kWsActTokens = 96;  // activation rows a stage holds
constexpr int kWsActBytes = kWsActTokens * kBK * 2;  // one stage of activations (12 KB)
// Four stages: the producer's loop is unrolled over the ring, so its slots and phases are constants.
constexpr int kWsStages = 4;
constexpr int kWsScaleAhead = kWsStages;  // stages between a scale word's load and its store

// The form's shape for S slabs of 64 weight rows per consumer warpgroup (128 S rows per CTA).
// Two slabs convert twice the weights per stage against the same waits, activation tile and
// descriptors; their accumulators limit the tile to 48 tokens within 96 registers.
template <int S>
struct WsShape {
  static constexpr int kRowsCta = kRows * S;
  static constexpr int kCodeBytes = kRowsCta * kBK / 2;  // one stage of codes
  static constexpr int kScaleBytes = kRowsCta * 2;       // one stage's scale words: 16 bits per row
  static constexpr int kMaxTokens = S == 1 ? 96 : 32;
  static constexpr int kSmem = kWsStages * (kWsActBytes + kCodeBytes + kScaleBytes) + 1024;
  // The epilogue's staging lies in the activation and code rings (contiguous).
  static_assert(kMaxTokens * (kRowsCta * 2 + 16) <= kWsStages * (kWsActBytes + kCodeBytes), "staging");
  static_assert(kMaxTokens <= kWsActTokens && kRowsCta <= 256, "one TMA box per stage and operand");
};

struct Ws4Params {
  CUtensorMap codes;   // [E][N][K / 2] bytes; box (32, 128 S, 1), no swizzle
  CUtensorMap act[kMaxTokens / 16];  // permuted activations [R][K] bf16 as (K, R, 1); box (kBK, 16 (i + 1), 1), 128-byte swizzle
  CUtensorMap scales;  // persistent forms with TMA scales (WspShape::kTmaScales): uint4 [E][N][scale_cols] bf16, box
                       // (8, 256, 1); e2m1 [E][N][K / 32] bytes, box (16, 256, 1)
  Params4 P;
};

__device__ __forceinline__ void sts16(uint32_t a, uint32_t v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(a), "h"(static_cast<unsigned short>(v)) : "memory");
}
__device__ __forceinline__ uint32_t lds16(uint32_t a) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ void sts32(uint32_t a, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
}
__device__ __forceinline__ void lds128(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// The OR of four words.
__device__ __forceinline__ uint32_t lds128_or(uint32_t a) {
  uint32_t x, y, z, w;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "r"(a));
  return x | y | z | w;
}

// The full barrier's arrivals: the TMA's expect-tx arrive and the producer lanes' scale words.
constexpr int kWsFullArrivals = 1 + 32;
// The empty barrier's: every consumer thread (no warp vote or election per stage).
constexpr int kWsEmptyArrivals = 256;

// The scale words of kWords weight rows of an expert for the producers (ws_produce, wsp_produce):
// rows first + stride q (clamped to N - 1), at stage kt: uint4, the group's bf16 scale; e2m1, the
// two 32-k groups' e8m0 bytes of the stage (an even index: K / 32 is even). kOffsets: the rows as
// 32-bit byte offsets from the expert's scales (an expert's scales are far below 2^32 bytes), within
// the persistent producer's few registers; else a pointer a row.
template <Codes C, int kWords, bool kOffsets>
struct ScaleRows {
  static constexpr int kBytes = C == Codes::kE2M1 ? 1 : 2;
  const uint8_t* base;  // kOffsets: the expert's scales
  std::conditional_t<kOffsets, uint32_t, const uint8_t*> row[kWords];

  // scols: scale columns a row (e2m1: K / 32; uint4: P.scale_cols).
  __device__ __forceinline__ ScaleRows(const Params4& P, int scols, int e, int first, int stride) {
    const int N = P.N;
    if constexpr (kOffsets) {
      base = static_cast<const uint8_t*>(P.scale) + static_cast<int64_t>(e) * N * scols * kBytes;
#pragma unroll
      for (int q = 0; q < kWords; ++q) row[q] = static_cast<uint32_t>(min(first + stride * q, N - 1) * scols * kBytes);
    } else {
#pragma unroll
      for (int q = 0; q < kWords; ++q) {
        const int64_t n = min(first + stride * q, N - 1);
        row[q] = static_cast<const uint8_t*>(P.scale) + (static_cast<int64_t>(e) * N + n) * scols * kBytes;
      }
    }
  }

  __device__ __forceinline__ void load(const Params4& P, int kt, int KT, uint32_t (&dst)[kWords]) const {
    const uint32_t k = static_cast<uint32_t>(min(kt, KT - 1));  // past the end: a repeat, never stored
    const uint32_t off = C == Codes::kE2M1 ? 2u * k : 2u * P.div_tpg.div(k);
#pragma unroll
    for (int q = 0; q < kWords; ++q) {
      const uint8_t* a;
      if constexpr (kOffsets)
        a = base + (row[q] + off);
      else
        a = row[q] + off;
      dst[q] = __ldg(reinterpret_cast<const unsigned short*>(a));
    }
  }
};

// The producer warp: stages 0 .. KT - 1 of the tile into ring slots kt % kWsStages, each by two TMA
// boxes (the codes, 32 bytes of each of the 128 S rows; the tile's activation rows, one box of its
// width) and the rows' scale words.
template <Codes C, int S>
__device__ __forceinline__ void ws_produce(const Ws4Params& W, int e, int row0, int bn, int n0, uint32_t base,
                                           uint32_t bar_full, uint32_t bar_empty) {
  using Sh = WsShape<S>;
  constexpr int kWords = 4 * S;  // scale words per lane: rows lane + 32 q
  const Params4& P = W.P;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int KT = P.K / kBK;
  const uint32_t act0 = base, code0 = base + kWsStages * kWsActBytes, sc0 = code0 + kWsStages * Sh::kCodeBytes;
  const ScaleRows<C, kWords, false> rows(P, C == Codes::kE2M1 ? P.K / 32 : P.scale_cols, e, n0 + lane, 32);
  auto scale_words = [&](int kt, uint32_t (&dst)[kWords]) { rows.load(P, kt, KT, dst); };
  // The scale words travel kWsScaleAhead stages ahead in a ring of register slots whose index is a
  // compile-time constant (the stage loop unrolled over the ring): a slot is stored, then reloaded
  // for stage kt + kWsScaleAhead. A loop-carried copy (next -> cur) would make each stage wait for
  // the load it had just issued (the register move waits on its scoreboard).
  uint32_t ring[kWsScaleAhead][kWords];
#pragma unroll
  for (int j = 0; j < kWsScaleAhead; ++j) scale_words(j, ring[j]);
  const CUtensorMap* act_map = &W.act[bn / 16 - 1];
  const uint32_t tx = static_cast<uint32_t>(Sh::kCodeBytes + bn * kBK * 2);
  // Stage kt into slot J (= kt % kWsStages) in phase ph of the ring.
  auto stage = [&](int kt, uint32_t ph, auto slot) {
    constexpr int J = decltype(slot)::value;
    const uint32_t full = bar_full + 8 * J;
    mbar_wait(bar_empty + 8 * J, ph ^ 1u);
    if (lane == 0) {
      mbar_arrive_expect_tx(full, tx);
      tma_load_3d(code0 + J * Sh::kCodeBytes, &W.codes, kt * (kBK / 2), n0, e, full);
      tma_load_3d(act0 + J * kWsActBytes, act_map, kt * kBK, row0, 0, full);
    }
#pragma unroll
    for (int q = 0; q < kWords; ++q) sts16(sc0 + J * Sh::kScaleBytes + (lane + 32 * q) * 2, ring[J][q]);
    mbar_arrive(full);  // release: the scale words above are visible to the waiters
    scale_words(kt + kWsScaleAhead, ring[J]);
  };
  static_assert(kWsStages == 4, "the stage loop below unrolls over four slots");
  uint32_t ph = 0;
  for (int kt = 0; kt < KT; kt += kWsStages, ph ^= 1u) {
    stage(kt, ph, std::integral_constant<int, 0>{});
    if (kt + 1 < KT) stage(kt + 1, ph, std::integral_constant<int, 1>{});
    if (kt + 2 < KT) stage(kt + 2, ph, std::integral_constant<int, 2>{});
    if (kt + 3 < KT) stage(kt + 3, ph, std::integral_constant<int, 3>{});
  }
}

// One stage of a consumer warpgroup's S slabs of 64 weight rows: the codes at code_s (this thread's
// first row's 8 bytes in the stage's slot), the scale words at sc_s (likewise), the activations at
// act_s. The A fragments are converted and double-buffered per k16 step rather than per stage (two
// fragments of 4 registers per slab): the conversion of step j + 1 overlaps the MMAs of step j.
// At step 0 the previous stage's last MMAs are done, and the empty barrier `release` (0: none) gets
// this thread's arrival. Same k order and rounding as gemm4_kernel: the same bits.
// The producer's precomputed first factors (kPre, WsFactors): fac_s is the thread's first row's
// word in the slot (the row's first factors of its two 32-k groups as bf16 halves; uint4: the scale
// twice), picked for the lane's group by the byte selector sel; flag_s, the slot's four flag words
// (nonzero where a row of the stage needs the second factor), read by every thread alike.
struct WsFactors {
  uint32_t fac_s = 0, flag_s = 0, sel = 0;
};

template <Codes C>
__device__ __forceinline__ void second_factor(uint32_t sw, int t, uint32_t& f2) {
  if constexpr (C == Codes::kE2M1) {
    uint32_t f1;
    bool tw;
    fp4_factors((sw >> (8 * (t >> 1))) & 0xffu, f1, f2, tw);
  } else {
    f2 = 0x3f803f80u;  // 1.0
  }
}

// A thread's rows' scale words (kPacked: its 2 S words adjacent at sc_s, in (slab, h) order, one
// 4- or 8-byte load; else at sc_s + (64 slab + 8 h) * 2, the row-major slot).
template <int S, bool kPacked>
__device__ __forceinline__ void scale_words(uint32_t sc_s, uint32_t (&sw)[S][2]) {
  if constexpr (kPacked) {
    uint32_t v[S];
    if constexpr (S == 1)
      v[0] = lds32(sc_s);
    else
      decode::lds64(v, sc_s);
#pragma unroll
    for (int sl = 0; sl < S; ++sl) {
      sw[sl][0] = v[sl] & 0xffffu;
      sw[sl][1] = v[sl] >> 16;
    }
  } else {
#pragma unroll
    for (int sl = 0; sl < S; ++sl)
#pragma unroll
      for (int h = 0; h < 2; ++h) sw[sl][h] = lds16(sc_s + (64 * sl + 8 * h) * 2);
  }
}

template <Codes C, int BN, int S, int AW = BN / 2, bool kPre = false, bool kPacked = false>
__device__ __forceinline__ void ws_stage(float (&acc)[S][AW], uint32_t (&frag)[2][S][4], uint32_t code_s,
                                         uint32_t sc_s, uint32_t act_s, int t, bool accumulate, uint32_t release,
                                         WsFactors pre = WsFactors()) {
  constexpr int kAcc = BN / 2;
  uint32_t f1[S][2], f2[S][2];
  bool any_two;
  if constexpr (kPre) {
    uint32_t fw[S][2];  // the first factors' words (kPacked: adjacent, one 8- or 16-byte load)
    if constexpr (kPacked && S == 1) {
      decode::lds64(fw[0], pre.fac_s);
    } else if constexpr (kPacked) {
      uint32_t v[4];
      lds128(v, pre.fac_s);
#pragma unroll
      for (int i = 0; i < 4; ++i) fw[i >> 1][i & 1] = v[i];
    } else {
#pragma unroll
      for (int sl = 0; sl < S; ++sl)
#pragma unroll
        for (int h = 0; h < 2; ++h) fw[sl][h] = lds32(pre.fac_s + (64 * sl + 8 * h) * 4);
    }
#pragma unroll
    for (int sl = 0; sl < S; ++sl)
#pragma unroll
      for (int h = 0; h < 2; ++h) f1[sl][h] = __byte_perm(fw[sl][h], 0u, pre.sel);
    any_two = lds128_or(pre.flag_s) != 0u;  // the same for the whole CTA: no vote
    if (any_two) {
      uint32_t sw[S][2];
      scale_words<S, kPacked>(sc_s, sw);
#pragma unroll
      for (int sl = 0; sl < S; ++sl)
#pragma unroll
        for (int h = 0; h < 2; ++h) second_factor<C>(sw[sl][h], t, f2[sl][h]);
    }
  } else {
    bool two = false;
    uint32_t sws[S][2];
    scale_words<S, kPacked>(sc_s, sws);
#pragma unroll
    for (int sl = 0; sl < S; ++sl)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t sw = sws[sl][h];
        if constexpr (C == Codes::kE2M1) {
          bool tw;
          fp4_factors((sw >> (8 * (t >> 1))) & 0xffu, f1[sl][h], f2[sl][h], tw);  // this lane's 32-k group
          two |= tw;
        } else {
          f1[sl][h] = sw * 0x10001u;
          f2[sl][h] = 0x3f803f80u;  // 1.0
          two |= sw == 0u;
        }
      }
    // As in apply_second_factor: the second e8m0 factor only on a vote (uint4: on a zero scale,
    // factor 1.0), and the branch keeps the conversion before wgmma.fence.
    any_two = __any_sync(0xffffffffu, two);
  }
  const uint32_t dlo = smem_desc_lo(act_s);
  // Each row's 8 code bytes of the stage: word w feeds k16 steps 2 w and 2 w + 1. One slab reads
  // both words at once (one 8-byte load, conflict-free); two read a word at a time (registers).
  uint32_t words[S][2][2];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int B = j & 1, w = j >> 1;
    if (S == 1 ? j == 0 : (j & 1) == 0) {
#pragma unroll
      for (int sl = 0; sl < S; ++sl)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a = code_s + (64 * sl + 8 * h) * (kBK / 2);
          if constexpr (S == 1)
            decode::lds64(words[sl][h], a);
          else
            words[sl][h][w] = lds32(a + 4 * w);
        }
    }
#pragma unroll
    for (int sl = 0; sl < S; ++sl)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Pair p of the word: nibbles p and p + 4 -> k16 step 2 w + (p >> 1), slot p & 1.
        if ((j & 1) == 0) {
          frag[B][sl][0 + h] = pair<C, 0>(words[sl][h][w], f1[sl][h]);
          frag[B][sl][2 + h] = pair<C, 1>(words[sl][h][w], f1[sl][h]);
        } else {
          frag[B][sl][0 + h] = pair<C, 2>(words[sl][h][w], f1[sl][h]);
          frag[B][sl][2 + h] = pair<C, 3>(words[sl][h][w], f1[sl][h]);
        }
      }
    if (any_two) {
#pragma unroll
      for (int sl = 0; sl < S; ++sl)
#pragma unroll
        for (int r = 0; r < 4; ++r) frag[B][sl][r] = hmul2<false>(frag[B][sl][r], f2[sl][r & 1]);
    }
#pragma unroll
    for (int sl = 0; sl < S; ++sl) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) fence_reg(acc[sl][i]);
#pragma unroll
      for (int r = 0; r < 4; ++r) fence_reg(frag[B][sl][r]);
    }
    wgmma_fence();
#pragma unroll
    for (int sl = 0; sl < S; ++sl)
      Mma<BN>::run(reinterpret_cast<float(&)[BN / 2]>(acc[sl]), frag[B][sl], smem_desc(dlo + 2 * j), accumulate || j > 0);
    wgmma_commit();
    wgmma_wait<1>();  // step j - 1's MMAs are done: its fragment registers are free
#pragma unroll
    for (int sl = 0; sl < S; ++sl)
#pragma unroll
      for (int r = 0; r < 4; ++r) fence_reg(frag[B ^ 1][sl][r]);
    if (j == 0 && release != 0u) mbar_arrive(release);
  }
}

// A consumer warpgroup's part of the tile (wg 0 / 1: weight rows [64 S wg, + 64 S), S slabs of 64),
// on the mainloop of width BN (ws_stage), then (both groups) the epilogue.
template <Codes C, int BN, int S>
__device__ __forceinline__ void ws_consume(const Params4& P, int e, int row0, int rows, int n0, uint8_t* smem,
                                           uint32_t base, uint32_t bar_full, uint32_t bar_empty) {
  using Sh = WsShape<S>;
  constexpr int kAcc = BN / 2;
  const int KT = P.K / kBK;
  const uint32_t act0 = base, code0 = base + kWsStages * kWsActBytes, sc0 = code0 + kWsStages * Sh::kCodeBytes;
  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row00 = wg * 64 * S + warp * 16 + g;  // row (sl, h): row00 + 64 sl + 8 h
  const uint32_t code_t = code0 + row00 * (kBK / 2) + t * 8, sc_t = sc0 + row00 * 2;

  float acc[S][kAcc];
  uint32_t frag[2][S][4];  // [k16 step & 1][slab][register]
  for (int kt = 0; kt < KT; ++kt) {
    const uint32_t ukt = static_cast<uint32_t>(kt);
    const uint32_t s = ukt % kWsStages;
    mbar_wait(bar_full + 8 * s, (ukt / kWsStages) & 1u);
    ws_stage<C, BN, S>(acc, frag, code_t + s * Sh::kCodeBytes, sc_t + s * Sh::kScaleBytes, act0 + s * kWsActBytes, t,
                       kt > 0, kt > 0 ? bar_empty + 8 * ((ukt + kWsStages - 1) % kWsStages) : 0u);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int sl = 0; sl < S; ++sl)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) fence_reg(acc[sl][i]);
  // Every stage has landed and been read: the rings become the output staging once both consumer
  // groups are past their MMAs (named barrier 1: the 256 consumer threads).
  store_tile<BN, 256, S>(P, acc, e, row0, rows, n0, smem, tid, [] { asm volatile("bar.sync 1, 256;\n" ::: "memory"); });
}

// Grid: x = N tiles of 128 S weight rows, y = tile-list entries (extra ones return).
template <Codes C, int S>
__global__ void __launch_bounds__(kWsThreads, 2) gemm4_ws_kernel(const __grid_constant__ Ws4Params W) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using Sh = WsShape<S>;
  const Params4& P = W.P;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * kWsStages];  // full[kWsStages], empty[kWsStages]
  const int tile_idx = static_cast<int>(blockIdx.y);
  if (tile_idx >= __ldg(P.count)) return;
  const int4 tile = P.tiles[tile_idx];
  const int n0 = static_cast<int>(blockIdx.x) * Sh::kRowsCta;
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle's 1024-byte atoms
  uint8_t* smem = smem_raw + (base - smem_addr(smem_raw));
  const uint32_t bar_full = smem_addr(&bars[0]), bar_empty = smem_addr(&bars[kWsStages]);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWsStages; ++s) {
      mbar_init(bar_full + 8 * s, kWsFullArrivals);
      mbar_init(bar_empty + 8 * s, kWsEmptyArrivals);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int bn = min((tile.z + 15) >> 4, Sh::kMaxTokens / 16) * 16;
  if (threadIdx.x >= 256) {
    ws_produce<C, S>(W, tile.x, tile.y, bn, n0, base, bar_full, bar_empty);
    return;
  }
  // The widths up to the form's tile (each instantiated only where it fits the registers).
  auto consume = [&](auto width) {
    constexpr int BN = decltype(width)::value;
    if constexpr (BN <= Sh::kMaxTokens) ws_consume<C, BN, S>(P, tile.x, tile.y, tile.z, n0, smem, base, bar_full, bar_empty);
  };
  switch (bn >> 4) {
    case 1: consume(std::integral_constant<int, 16>{}); break;
    case 2: consume(std::integral_constant<int, 32>{}); break;
    case 3: consume(std::integral_constant<int, 48>{}); break;
    case 4: consume(std::integral_constant<int, 64>{}); break;
    case 5: consume(std::integral_constant<int, 80>{}); break;
    default: consume(std::integral_constant<int, 96>{}); break;
  }
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// The persistent form (HUMMING_JAX_PREFILL_RS4_WS=3 / 4): one CTA per SM of four consumer
// warpgroups and a producer warpgroup, over the work items (tile-list entry x block of N) by a
// static stride. Each consumer warpgroup owns two 64-row slabs and tiles of at most 48 rows
// (WspTwoSlabs: 512 weight rows per CTA) or one slab and 128 (WspOneSlab: 256). Against the
// two-CTA forms above:
//  * a stage's activation box serves 512 or 256 weight rows instead of the one-slab form's 128, so
//    the activations' L2 -> shared traffic per weight falls 4x or 2x;
//  * the producer warpgroup gives its registers to the consumers (setmaxnreg: 32 and 112, from the
//    launch's 96), which lets two slabs take 48-token tiles, or one 128, without serialized wgmmas;
//  * the ring runs on across items, and each warpgroup stages and stores its own rows in a buffer
//    of its own, so one item's epilogue overlaps the next item's loads.
// The same conversion, k order and rounding as the forms above (ws_stage): the same bits.
// ---------------------------------------------------------------------------------------------
// The persistent form's shape: S slabs of 64 rows per consumer warpgroup, tiles of at most kMaxTokens
// rows run kNarrow or kMaxTokens wide (two widths: see gemm4_wsp_kernel).
template <int S, int kMaxTok, int kNarrowTok, bool kTma = false>
struct WspShape {
  static constexpr int kSlabs = S;
  static constexpr int kGroups = 4;                        // consumer warpgroups
  static constexpr int kThreads = (kGroups + 1) * 128;     // + the producer warpgroup
  static constexpr int kRowsCta = 64 * kSlabs * kGroups;   // 512 or 256
  static constexpr int kMaxTokens = kMaxTok, kNarrow = kNarrowTok;
  static constexpr int kActBytes = kMaxTokens * kBK * 2;   // whole 1024-byte swizzle atoms
  static constexpr int kCodeBytes = kRowsCta * kBK / 2;    // TMA boxes of 256 rows
  // A stage's scale slot: the rows' 16-bit scale words; with kPreFactors, then the rows' first
  // factors (32 bits: WsFactors) and four flag words, one a producer warp (used for e2m1 only,
  // wsp_pre: a uint4 row's factor is its scale, one multiply).
  static constexpr bool kPreFactors = true;
  static constexpr int kRawBytes = kRowsCta * 2;
  static constexpr int kFacBytes = kPreFactors ? kRowsCta * 4 : 0;
  static constexpr int kScaleBytes = kRawBytes + kFacBytes + (kPreFactors ? 16 : 0);
  static constexpr int kStageRowBytes = 64 * kSlabs * 2 + 16;                 // a warpgroup's staging row
  static constexpr int kStagingBytes = kMaxTokens * kStageRowBytes;          // per warpgroup
  static constexpr int kStageBytes = kActBytes + kCodeBytes + kScaleBytes;
  // kTmaScales: the producer takes the rows' scale words from windows of kWindowGroups words a row
  // (16 bytes) that TMA boxes bring into two buffers (kWindowBytes each, after the staging) instead
  // of one load per row and stage (wsp_produce_tma).
  static constexpr bool kTmaScales = kTma;
  static constexpr int kWindowGroups = 8;                                    // 16-bit words a row
  static constexpr int kWindowBytes = kTma ? kRowsCta * kWindowGroups * 2 : 0;
  static constexpr int kFree = 227 * 1024 - 1024 - kGroups * kStagingBytes - 256 - 2 * kWindowBytes - 128;
  static constexpr int kStages = kFree / kStageBytes < 6 ? kFree / kStageBytes : 6;
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kWindowOffset = (kRingBytes + kGroups * kStagingBytes + 127) / 128 * 128;  // from base
  static constexpr int kSmem = (kTma ? kWindowOffset + 2 * kWindowBytes : kRingBytes + kGroups * kStagingBytes) + 1024;
  // setmaxnreg from the launch's 96: 32 x 128 + 112 x 512 = 96 x 640. At 104 the two-slab
  // consumer's wgmmas are on the edge of serialization (C7512), which small changes elsewhere
  // in the kernel tip; the producer fits 32 with a scale ring two stages deep.
  static constexpr int kProducerRegs = 32, kConsumerRegs = 112;
  static constexpr int kScaleAhead = 2;  // stages between a scale word's load and its store
  static constexpr int kScaleWords = kRowsCta / 128;       // per producer thread: rows p + 128 q
  static constexpr int kFullArrivals = 1 + 128;            // the TMA's expect-tx arrive + the scale writers
  static constexpr int kEmptyArrivals = 128 * kGroups;
  static_assert(kStages >= 4, "stages");
  static_assert(kActBytes % 1024 == 0 && kCodeBytes % 1024 == 0 && kScaleBytes % 16 == 0, "slot alignment");
  static_assert(kMaxTokens <= ::hj::prefill::kMaxTokens && kMaxTokens % 16 == 0 && kNarrow < kMaxTokens, "widths");
  static_assert(setmaxnreg_fits(kThreads, kGroups, kProducerRegs, kConsumerRegs), "register budget");
  static_assert(kGroups * 128 * kSlabs * (kMaxTokens / 2) <= kSplitSlotFloats, "a split slot holds the accumulators");
};
// Whether the producer precomputes the first factors (e2m1: fp4_factors' 12-odd instructions a row
// and stage move from the 16 consumer warps to the 4 producer warps).
template <Codes C, typename Sh>
constexpr bool wsp_pre = Sh::kPreFactors && C == Codes::kE2M1;

// The persistent forms' scale slots are thread-major: consumer thread (wg, warp, g)'s rows' words
// (row wg 64 S + 64 slab + 16 warp + 8 h + g, in (slab, h) order) lie adjacent at index
// ((4 wg + warp) 8 + g) 2 S, so it reads them in one 4- or 8-byte load (its first factors in one
// 8- or 16-byte load) instead of 2 S separate ones, whose issue and waits were a large share of the
// consumers' stalls at two slabs (benchmarks/NOTES.md, v24). Row p + 128 q of the producer's thread p
// lies at wsp_packed<S>(p) + 128 q.
template <int S>
__device__ __forceinline__ uint32_t wsp_packed(uint32_t p) {
  const uint32_t lane_pos = ((p >> 4) & 3u) * 8u + (p & 7u), h = (p >> 3) & 1u;
  if constexpr (S == 2) return lane_pos * 4u + ((p >> 6) & 1u) * 2u + h;
  return (p >> 6) * 64u + lane_pos * 2u + h;
}

using WspTwoSlabs = WspShape<2, 48, 32>;   // HUMMING_JAX_PREFILL_RS4_WS=3
using WspOneSlab = WspShape<1, 128, 64>;   // HUMMING_JAX_PREFILL_RS4_WS=4
using WspTwoSlabsTma = WspShape<2, 48, 32, true>;  // the same with TMA scales (uint4)
using WspOneSlabTma = WspShape<1, 128, 64, true>;

// The work items: item i of `count` tile-list entries x nb blocks of N is block i % nb of entry i / nb.
struct WspItem {
  int e, row0, rows, n0;
};
// The CTAs' work: `items` = the tile list's entries x `nb` blocks of Sh::kRowsCta weight rows (the
// producer and the consumers count them alike). CTA b runs items b, b + G, ... below `whole`
// (G = gridDim.x CTAs); where a last round would keep at most half of them busy (its `rem` items
// at most G / 2), those items are split instead into `parts` k-ranges each, one unit per CTA
// (wsp_unit). A CTA's time is mostly its own: a last round of 39% of the CTAs took 0.81-0.85 of a
// full round (benchmarks/NOTES.md, v29, the tail probe), so parts of a small round pay.
struct WspItems {
  int nb, items, whole, rem, parts;
};
template <typename Sh>
__device__ __forceinline__ WspItems wsp_items(const Params4& P) {
  const int nb = (P.N + Sh::kRowsCta - 1) / Sh::kRowsCta, items = __ldg(P.count) * nb;
  const int G = static_cast<int>(gridDim.x), KT = P.K / kBK, rem = items % G;
  int parts = 1;
  if (P.split != 0 && rem > 0 && 2 * rem <= G && rem <= kSplitSlots)
    parts = min(min(kSplitMaxParts, G / rem), min(1 + kSplitSlots / rem, KT));
  return WspItems{nb, items, parts > 1 ? items - rem : items, rem, parts};
}
// A CTA's unit of the split last round: item `item`'s k tiles [kt0, kt1), part `part` of w.parts
// (part -1: none), its partial sums in slot `slot0 + part` (the item's parts - 1 slots from slot0).
struct WspUnit {
  int item, part, kt0, kt1, slot0;
};
__device__ __forceinline__ WspUnit wsp_unit(const WspItems& w, int KT) {
  const int u = static_cast<int>(blockIdx.x);
  if (w.parts <= 1 || u >= w.rem * w.parts) return WspUnit{0, -1, 0, KT, 0};
  const int p = u / w.rem, r = u % w.rem;
  return WspUnit{w.whole + r, p, p * KT / w.parts, (p + 1) * KT / w.parts, r * (w.parts - 1)};
}
// The CTA's work in order, alike for the producer and the consumers: f(i, unit) for its whole items
// i = blockIdx.x, + gridDim.x, ... below w.whole (unit: part -1, k tiles [0, KT)), then for its unit
// of the split last round, if any.
template <typename F>
__device__ __forceinline__ void wsp_each_unit(const WspItems& w, int KT, F&& f) {
  for (int i = static_cast<int>(blockIdx.x); i < w.whole; i += static_cast<int>(gridDim.x)) f(i, WspUnit{i, -1, 0, KT, 0});
  const WspUnit u = wsp_unit(w, KT);
  if (u.part >= 0) f(u.item, u);
}
// The ring's next slot, and its phase on each wrap.
template <int kStages>
__device__ __forceinline__ void wsp_next_slot(uint32_t& slot, uint32_t& phase) {
  if (++slot == kStages) {
    slot = 0;
    phase ^= 1u;
  }
}
__device__ __forceinline__ WspItem wsp_item(const Params4& P, int i, int nb, int rows_cta) {
  const int4 tile = P.tiles[i / nb];
  return WspItem{tile.x, tile.y, tile.z, (i % nb) * rows_cta};
}

// One stage's scale words of the producer thread p's rows (p + 128 q: word(q)) into the slot at
// sc_s, in the packed layout (pk: wsp_packed of p); for e2m1 with precomputed factors (wsp_pre),
// also the rows' first factors and the warp's flag word.
template <Codes C, typename Sh, typename Word>
__device__ __forceinline__ void wsp_store_words(uint32_t sc_s, uint32_t pk, int p, Word word) {
  [[maybe_unused]] uint32_t two = 0;  // e2m1 with precomputed factors only
#pragma unroll
  for (int q = 0; q < Sh::kScaleWords; ++q) {
    const uint32_t sw = word(q), row = pk + 128u * q;  // row p + 128 q's packed index
    sts16(sc_s + row * 2, sw);
    if constexpr (wsp_pre<C, Sh>) {
      // fp4_factors' first factor of each 32-k group's e8m0 byte, as the consumers would
      // compute it, and whether the second is needed.
      const uint32_t lo = sw & 0xffu, hi = (sw >> 8) & 0xffu;
      auto f1 = [](uint32_t e) { return e <= 128u ? (e + 126u) << 7 : (e == 255u ? 0x7fc0u : 0x7f00u); };
      sts32(sc_s + Sh::kRawBytes + row * 4, f1(lo) | (f1(hi) << 16));
      two |= static_cast<uint32_t>((lo > 128u && lo != 255u) || (hi > 128u && hi != 255u));
    }
  }
  if constexpr (wsp_pre<C, Sh>) {
    const uint32_t any = __any_sync(0xffffffffu, two != 0u);
    if ((p & 31) == 0) sts32(sc_s + Sh::kRawBytes + Sh::kFacBytes + (p >> 5) * 4, any);
  }
}

// A stage's loads by TMA, once its slot is free (every producer thread waits): thread 0 issues the
// slot's codes (the item's kRowsCta rows x 32 bytes, in boxes of 256 rows) and the tile's activation
// rows, both completing the stage's full barrier with tx bytes.
template <typename Sh>
__device__ __forceinline__ void wsp_load_stage(const Ws4Params& W, const WspItem& it, const CUtensorMap* act_map,
                                               uint32_t tx, int kt, int p, uint32_t slot, uint32_t phase,
                                               uint32_t full, uint32_t bar_empty, uint32_t code0, uint32_t act0) {
  mbar_wait(bar_empty + 8 * slot, phase ^ 1u);
  if (p == 0) {
    mbar_arrive_expect_tx(full, tx);
    const uint32_t code_s = code0 + slot * Sh::kCodeBytes;
#pragma unroll
    for (int b = 0; b < Sh::kRowsCta / 256; ++b)
      tma_load_3d(code_s + b * (256 * kBK / 2), &W.codes, kt * (kBK / 2), it.n0 + 256 * b, it.e, full);
    tma_load_3d(act0 + slot * Sh::kActBytes, act_map, kt * kBK, it.row0, 0, full);
  }
}

// What both producers keep: thread p of the producer warpgroup, the CTA's items, the ring's slot
// offsets and the slot and phase of the next stage (run on across items).
template <typename Sh>
struct WspRing {
  int p, KT;
  WspItems work;
  uint32_t act0, code0, sc0, pk;  // pk: wsp_packed of p
  uint32_t slot = 0, phase = 0;
  __device__ __forceinline__ WspRing(const Params4& P, uint32_t base)
      : p(static_cast<int>(threadIdx.x) - 128 * Sh::kGroups),
        KT(P.K / kBK),
        work(wsp_items<Sh>(P)),
        act0(base),
        code0(base + Sh::kStages * Sh::kActBytes),
        sc0(code0 + Sh::kStages * Sh::kCodeBytes),
        pk(wsp_packed<Sh::kSlabs>(static_cast<uint32_t>(p))) {
    static_assert(Sh::kSlabs == 1 || Sh::kSlabs == 2, "wsp_packed covers one or two slabs");
  }
  __device__ __forceinline__ void advance() { wsp_next_slot<Sh::kStages>(slot, phase); }
  // A stage's loads (wsp_load_stage) for item `it`, whose tile's activation map is act_map and whose
  // stages carry tx bytes by TMA.
  __device__ __forceinline__ void load(const Ws4Params& W, const WspItem& it, const CUtensorMap* act_map, uint32_t tx,
                                       int kt, uint32_t full, uint32_t bar_empty) const {
    wsp_load_stage<Sh>(W, it, act_map, tx, kt, p, slot, phase, full, bar_empty, code0, act0);
  }
};

// An item's activation box: the map of its tile's width (its rows rounded up to 16) and a stage's
// bytes by TMA (the codes and that box).
struct WspActBox {
  const CUtensorMap* map;
  uint32_t tx;
};
template <typename Sh>
__device__ __forceinline__ WspActBox wsp_act_box(const Ws4Params& W, const WspItem& it) {
  const int bn = min((it.rows + 15) >> 4, Sh::kMaxTokens / 16) * 16;
  return WspActBox{&W.act[bn / 16 - 1], static_cast<uint32_t>(Sh::kCodeBytes + bn * kBK * 2)};
}

// The producer warpgroup: for each of this CTA's items, its KT stages into the ring (slot, phase
// run on across items). Thread 0 issues the TMA boxes (the CTA's rows' codes in boxes of 256, the
// tile's activations as one); all 128 threads store the scale words of rows p + 128 q, which travel
// Sh::kScaleAhead stages ahead in a ring of register slots with compile-time indices (ws_produce).
template <Codes C, typename Sh>
__device__ __forceinline__ void wsp_produce(const Ws4Params& W, uint32_t base, uint32_t bar_full, uint32_t bar_empty) {
  constexpr int kWords = Sh::kScaleWords;
  const Params4& P = W.P;
  WspRing<Sh> r(P, base);
  const int KT = r.KT;
  const int scols = C == Codes::kE2M1 ? P.K / 32 : P.scale_cols;
  // Item `it`'s stages kt0 .. kt1 - 1 (all of K but for a unit of the split last round).
  auto produce = [&](const WspItem& it, int kt0, int kt1) {
    const ScaleRows<C, kWords, true> rows(P, scols, it.e, it.n0 + r.p, 128);  // this thread's rows' scale words
    auto scale_words = [&](int kt, uint32_t (&dst)[kWords]) { rows.load(P, kt, KT, dst); };
    constexpr int kAhead = Sh::kScaleAhead;
    uint32_t ring[kAhead][kWords];
#pragma unroll
    for (int j = 0; j < kAhead; ++j) scale_words(kt0 + j, ring[j]);
    const WspActBox box = wsp_act_box<Sh>(W, it);
    auto stage = [&](int kt, auto ring_slot) {
      constexpr int J = decltype(ring_slot)::value;
      const uint32_t full = bar_full + 8 * r.slot;
      r.load(W, it, box.map, box.tx, kt, full, bar_empty);
      wsp_store_words<C, Sh>(r.sc0 + r.slot * Sh::kScaleBytes, r.pk, r.p, [&](int q) { return ring[J][q]; });
      mbar_arrive(full);  // release: the scale words above are visible to the waiters
      // The words of stage kt + kAhead: uint4 groups of several 64-k tiles (tpg > 1) repeat the
      // words of the stage before, which ring[J ^ 1] holds (loaded a stage ago): copied instead of
      // requested again (half the scale requests at 128-k groups; measured 0-1.4% faster, as the
      // repeats mostly hit L1: benchmarks/NOTES.md, v24).
      if constexpr (C == Codes::kU4) {
        const int kn = min(kt + kAhead, KT - 1), kp = min(kt + kAhead - 1, KT - 1);
        if (P.div_tpg.div(static_cast<uint32_t>(kn)) == P.div_tpg.div(static_cast<uint32_t>(kp))) {
#pragma unroll
          for (int q = 0; q < kWords; ++q) ring[J][q] = ring[J ^ 1][q];
        } else {
          scale_words(kt + kAhead, ring[J]);
        }
      } else {
        scale_words(kt + kAhead, ring[J]);
      }
      r.advance();
    };
    static_assert(kAhead == 2, "the stage loop below unrolls over two register slots");
    for (int kt = kt0; kt < kt1; kt += 2) {
      stage(kt, std::integral_constant<int, 0>{});
      if (kt + 1 < kt1) stage(kt + 1, std::integral_constant<int, 1>{});
    }
  };
  wsp_each_unit(r.work, KT, [&](int i, const WspUnit& u) { produce(wsp_item(P, i, r.work.nb, Sh::kRowsCta), u.kt0, u.kt1); });
}

// The producer warpgroup with TMA scales (Sh::kTmaScales): as wsp_produce, but each stage's scale words come
// from shared memory, where TMA boxes (16 bytes x 256 rows, [row][8] 16-bit words: uint4, 8 groups' bf16
// scales; e2m1, the e8m0 byte pairs of 8 stages) bring an item's scales a window of Sh::kWindowGroups words a
// row at a time, instead of one global request per row and stage (benchmarks/NOTES.md, v24: the L2's tag
// lookups). A stage's word: uint4, its group (div_tpg); e2m1, the stage itself. Windows alternate between two
// buffers, counted over the CTA's items by v; at a window's first stage thread 0 loads the next window of the
// item into the other buffer, after a named barrier among the 128 producer threads (every one is past its
// last read of that buffer, the window before), and all wait on the window's own load.
template <Codes C, typename Sh>
__device__ __forceinline__ void wsp_produce_tma(const Ws4Params& W, uint32_t base, uint32_t bar_full,
                                                uint32_t bar_empty, uint32_t bar_win) {
  static_assert(Sh::kTmaScales && Sh::kRowsCta % 256 == 0, "TMA scales in boxes of 256 rows");
  constexpr int kBoxes = Sh::kRowsCta / 256, kWg = Sh::kWindowGroups;
  const Params4& P = W.P;
  WspRing<Sh> r(P, base);
  const int KT = r.KT, p = r.p;
  const uint32_t win0 = base + Sh::kWindowOffset;
  // The word of stage kt: uint4, its group; e2m1, the stage's two 32-k groups' bytes.
  auto word_of = [&](int kt) {
    return C == Codes::kE2M1 ? kt : static_cast<int>(P.div_tpg.div(static_cast<uint32_t>(kt)));
  };
  uint32_t next_v = 0;
  // Item `it`'s stages kt0 .. kt1 - 1 (all of K but for a unit of the split last round), whose
  // windows run to last_w: a window beyond it is never loaded (no copy may be in flight at exit).
  auto produce = [&](const WspItem& it, int kt0, int kt1) {
    const WspActBox box = wsp_act_box<Sh>(W, it);
    const int last_w = word_of(kt1 - 1) / kWg;
    auto load_window = [&](int w, uint32_t buf) {
      const uint32_t bar = bar_win + 8 * buf;
      mbar_arrive_expect_tx(bar, static_cast<uint32_t>(Sh::kWindowBytes));
#pragma unroll
      for (int b = 0; b < kBoxes; ++b)
        tma_load_3d(win0 + buf * Sh::kWindowBytes + b * (256 * kWg * 2), &W.scales, w * kWg * (C == Codes::kE2M1 ? 2 : 1),
                    it.n0 + 256 * b, it.e, bar);
    };
    int w_cur = -1;
    uint32_t v = 0;
    for (int kt = kt0; kt < kt1; ++kt) {
      const int g = word_of(kt);
      const int w = g / kWg;
      if (w != w_cur) {  // the window's first stage (the same kt for every producer thread)
        v = next_v++;
        asm volatile("bar.sync 5, 128;\n" ::: "memory");
        if (p == 0) {
          if (w_cur < 0) load_window(w, v & 1u);  // the item's first window
          if (w + 1 <= last_w) load_window(w + 1, (v + 1) & 1u);
        }
        mbar_wait(bar_win + 8 * (v & 1u), (v >> 1) & 1u);
        w_cur = w;
      }
      const uint32_t full = bar_full + 8 * r.slot;
      r.load(W, it, box.map, box.tx, kt, full, bar_empty);
      const uint32_t words = win0 + (v & 1u) * Sh::kWindowBytes + static_cast<uint32_t>(g % kWg) * 2;
      wsp_store_words<C, Sh>(r.sc0 + r.slot * Sh::kScaleBytes, r.pk, p,
                             [&](int q) { return lds16(words + static_cast<uint32_t>(p + 128 * q) * (kWg * 2)); });
      mbar_arrive(full);  // release: the scale words above are visible to the waiters
      r.advance();
    }
  };
  wsp_each_unit(r.work, KT, [&](int i, const WspUnit& u) { produce(wsp_item(P, i, r.work.nb, Sh::kRowsCta), u.kt0, u.kt1); });
}

// A st.global.release.gpu / ld.global.acquire.gpu pair: the split's flags.
__device__ __forceinline__ void st_release(unsigned* a, unsigned v) {
  asm volatile("st.global.release.gpu.u32 [%0], %1;\n" ::"l"(a), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* a) {
  unsigned v;
  asm volatile("ld.global.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(a) : "memory");
  return v;
}

// A consumer warpgroup's part of one item (weight rows [64 S wg, + 64 S) of the CTA's, S slabs) on
// the mainloop of width BN over k tiles [u.kt0, u.kt1), then its own epilogue through its staging
// buffer. A unit of the split last round (u.part >= 0) that is not the item's last part stores its
// sums in its slot and raises its warpgroup's flag instead; the last part waits for the others'
// flags and adds their sums to its own, in part order (the same sum every run), before its epilogue.
// Every part runs in the same round, one CTA per SM, so no wait can outlast the others' work.
template <Codes C, typename Sh, int BN>
__device__ __forceinline__ void wsp_consume(const Params4& P, const WspItem& it, const WspUnit& u, int parts,
                                            uint8_t* staging, uint32_t base, uint32_t bar_full, uint32_t bar_empty,
                                            uint32_t& slot, uint32_t& phase, float (&acc)[Sh::kSlabs][Sh::kMaxTokens / 2]) {
  constexpr int S = Sh::kSlabs, kAcc = BN / 2;
  const uint32_t act0 = base, code0 = base + Sh::kStages * Sh::kActBytes, sc0 = code0 + Sh::kStages * Sh::kCodeBytes;
  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row00 = wg * 64 * S + warp * 16 + g;  // row (sl, h): row00 + 64 sl + 8 h
  // The thread's addresses in slot 0 (codes, scale words, first factors) and its group's byte
  // selector, opaque to ptxas, which would otherwise recompute them from the thread index at
  // every stage (some 20 instructions of the stage's ~270).
  const int tpos = (wg * 4 + warp) * 8 + g;  // the thread's packed scale words (wsp_packed)
  uint32_t code_t = code0 + row00 * (kBK / 2) + t * 8, raw_t = sc0 + tpos * 4 * S,
           fac_t = sc0 + Sh::kRawBytes + tpos * 8 * S;
  uint32_t sel = 0x1010u + 0x2222u * static_cast<uint32_t>(t >> 1);  // the lane's group's bf16 half, twice
  asm volatile("" : "+r"(code_t), "+r"(raw_t), "+r"(fac_t), "+r"(sel));

  uint32_t frag[2][S][4];  // [k16 step & 1][slab][register]
  uint32_t prev = 0;       // the slot of the stage before
  for (int kt = u.kt0; kt < u.kt1; ++kt) {
    mbar_wait(bar_full + 8 * slot, phase);
    const uint32_t sc_s = slot * Sh::kScaleBytes;
    WsFactors pre;
    pre.fac_s = fac_t + sc_s;
    pre.flag_s = sc0 + sc_s + Sh::kRawBytes + Sh::kFacBytes;
    pre.sel = sel;
    ws_stage<C, BN, S, Sh::kMaxTokens / 2, wsp_pre<C, Sh>, true>(acc, frag, code_t + slot * Sh::kCodeBytes, raw_t + sc_s,
                                                           act0 + slot * Sh::kActBytes, t, kt > u.kt0,
                                                           kt > u.kt0 ? bar_empty + 8 * prev : 0u, pre);
    prev = slot;
    wsp_next_slot<Sh::kStages>(slot, phase);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int sl = 0; sl < S; ++sl)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) fence_reg(acc[sl][i]);
  mbar_arrive(bar_empty + 8 * prev);  // the item's last stage, now read
  // Named barrier 1 + wg: this warpgroup's 128 threads (its staging, its rows; the split's flags).
  const int bar_id = 1 + wg;
  auto wg_sync = [bar_id] { asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory"); };
  if (u.part >= 0) {
    // Thread-major slots: float f of thread tid at f * 512 + tid (coalesced), L2 only (cg).
    auto slot_at = [&](int q) { return P.part + static_cast<size_t>(u.slot0 + q) * kSplitSlotFloats + tid; };
    if (u.part < parts - 1) {
      float* dst = slot_at(u.part);
#pragma unroll
      for (int sl = 0; sl < S; ++sl)
#pragma unroll
        for (int i = 0; i < kAcc; ++i) __stcg(dst + (sl * kAcc + i) * 512, acc[sl][i]);
      __threadfence();
      wg_sync();
      if ((tid & 127) == 0) st_release(P.part_flags + (u.slot0 + u.part) * 4 + wg, 1u);
      return;
    }
    if ((tid & 127) == 0)
      for (int q = 0; q < parts - 1; ++q)
        while (ld_acquire(P.part_flags + (u.slot0 + q) * 4 + wg) == 0u) __nanosleep(64);
    wg_sync();
#pragma unroll
    for (int sl = 0; sl < S; ++sl)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) {
        const int f = (sl * kAcc + i) * 512;
        float sum = __ldcg(slot_at(0) + f);
        for (int q = 1; q < parts - 1; ++q) sum += __ldcg(slot_at(q) + f);
        acc[sl][i] = sum + acc[sl][i];
      }
  }
  store_tile<BN, 128, S>(P, acc, it.e, it.row0, it.rows, it.n0 + wg * 64 * S, staging + wg * Sh::kStagingBytes,
                         tid & 127, wg_sync);
}

// Grid: x = min(SMs, the items' bound x the parts an item may take); each CTA takes items
// blockIdx.x, + gridDim.x, ..., then its unit of a split last round (wsp_each_unit); CTAs beyond
// the work exit at once.
template <Codes C, typename Sh>
__global__ void __launch_bounds__(Sh::kThreads, 1) gemm4_wsp_kernel(const __grid_constant__ Ws4Params W) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  const Params4& P = W.P;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * Sh::kStages + 2];  // full[kStages], empty[kStages], window[2]
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle's 1024-byte atoms
  uint8_t* staging = smem_raw + (base - smem_addr(smem_raw)) + Sh::kRingBytes;
  const uint32_t bar_full = smem_addr(&bars[0]), bar_empty = smem_addr(&bars[Sh::kStages]);
  const uint32_t bar_win = smem_addr(&bars[2 * Sh::kStages]);
  if (threadIdx.x == 0) {
    for (int s = 0; s < Sh::kStages; ++s) {
      mbar_init(bar_full + 8 * s, Sh::kFullArrivals);
      mbar_init(bar_empty + 8 * s, Sh::kEmptyArrivals);
    }
    if constexpr (Sh::kTmaScales) {
      mbar_init(bar_win, 1);
      mbar_init(bar_win + 8, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= 128 * Sh::kGroups) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Sh::kProducerRegs));
    if constexpr (Sh::kTmaScales) {
      wsp_produce_tma<C, Sh>(W, base, bar_full, bar_empty, bar_win);
    } else {
      (void)bar_win;
      wsp_produce<C, Sh>(W, base, bar_full, bar_empty);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Sh::kConsumerRegs));
  const WspItems work = wsp_items<Sh>(P);
  const int KT = P.K / kBK;
  uint32_t slot = 0, phase = 0;
  float acc[Sh::kSlabs][Sh::kMaxTokens / 2];
  // Two widths on one accumulator array: wgmmas of different widths on separate arrays in one
  // loop, or of three widths, make ptxas serialize them (C7512). Tiles of up to kNarrow rows take
  // kNarrow-wide MMAs (the columns past their rows, never stored, read stale activation rows).
  wsp_each_unit(work, KT, [&](int i, const WspUnit& u) {
    const WspItem it = wsp_item(P, i, work.nb, Sh::kRowsCta);
    if (it.rows <= Sh::kNarrow)
      wsp_consume<C, Sh, Sh::kNarrow>(P, it, u, work.parts, staging, base, bar_full, bar_empty, slot, phase, acc);
    else
      wsp_consume<C, Sh, Sh::kMaxTokens>(P, it, u, work.parts, staging, base, bar_full, bar_empty, slot, phase, acc);
  });
#else
  __trap();
#endif
}

// The tensor maps of a launch; an error message, or empty.
std::string ws_tensor_maps(Ws4Params& W, const void* codes, int64_t E, int64_t N, int64_t K, const void* act, int64_t R,
                           int rows_cta) {
  if (tensor_map_encoder() == nullptr) return "cuTensorMapEncodeTiled is not available";
  // A stage takes 32 bytes of each weight row; a 256-byte L2 promotion fetches eight stages' worth at
  // once, which must then stay in the L2 until the CTA's later stages read them. 128 bytes measured
  // 1.00-1.02x faster than 256 at deepseek / mixtral M = 64 / 128 (int4, mxfp4; H100, NOTES v26), no
  // promotion 0.78-0.87x. HUMMING_JAX_PREFILL_RS4_L2=none|128|256 picks one (A/B).
  const CUtensorMapL2promotion promo = l2_promotion_from_env("HUMMING_JAX_PREFILL_RS4_L2", CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  if (!encode_rows_3d(&W.codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, codes, K / 2, N, E, kBK / 2,
                      static_cast<uint32_t>(rows_cta), CU_TENSOR_MAP_SWIZZLE_NONE, promo))
    return "cuTensorMapEncodeTiled failed for the codes";
  // One map per tile width (16, 32, .., 128 rows): a stage's activations are one box.
  for (int i = 0; i < kMaxTokens / 16; ++i)
    if (!encode_rows_3d(&W.act[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, act, K, R, 1, kBK, 16 * (i + 1),
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B))
      return "cuTensorMapEncodeTiled failed for the activations";
  return std::string();
}

// The shared-memory limit is raised once per device (a per-context attribute).
template <Codes C>
std::string prepare_device(int device) {
  static std::mutex mu;
  static bool done[64] = {};
  if (device < 0 || device >= 64) return "device index out of range";
  std::lock_guard<std::mutex> lock(mu);
  if (!done[device]) {
    const cudaError_t e = cudaFuncSetAttribute(gemm4_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
    }
    done[device] = true;
  }
  return std::string();
}

// The workspace from its (128-byte aligned) base: the tile count (128 bytes), the tile list (at most
// R / 32 + E + 1 entries of 16 bytes, a bound with room to spare: each expert adds at most one tile
// beyond R / kMaxTokens), then the permuted activations from act_offset, 128-byte aligned ...
size_t act_offset(int64_t R, int64_t E) {
  const size_t list = static_cast<size_t>((R + 31) / 32 + E + 1) * 16;
  return (128 + list + 127) / 128 * 128;
}

// ... then the split's flags and partial sums (kSplitBytes) from split_offset, 128-byte aligned.
size_t split_offset(int64_t R, int64_t K, int64_t E) {
  return (act_offset(R, E) + static_cast<size_t>(R) * static_cast<size_t>(K) * 2 + 127) / 128 * 128;
}

}  // namespace

size_t rs4_workspace_bytes(int64_t R, int64_t K, int64_t E) {
  // ... plus the slack run_grouped spends on aligning the base.
  return 128 + split_offset(R, K, E) + kSplitBytes;
}

namespace {

// The time of `items` equal work items on `sms` persistent CTAs, in rounds: the whole rounds plus the
// last, partial one as the fourth root of its fill. Fewer SMs streaming go faster each, but far from in
// proportion: the root fits the persistent forms' per-GEMM times on the H100 (benchmarks/NOTES.md,
// v25: a last round 39% / 48% full cost 0.79 / 0.83 of a full one).
double rounds_cost(int64_t items, int sms) {
  const int64_t slots = std::max(sms, 1);
  if (items <= 0) return 0.0;
  const double part = static_cast<double>(items % slots) / static_cast<double>(slots);
  return static_cast<double>(items / slots) + std::sqrt(std::sqrt(part));
}

// The persistent form at any size: form 4 above 32 rows per expert on average (H100, v26, against
// the plain mainloop that held calls above 48 rows before: 0.96-1.12x at 64 rows per expert, the
// losses deepseek's within the sweep's +-4% noise, 1.00-1.17x at 96-128, mxfp4 1.08-1.19x at
// 256-512). Up to 32: two slabs and 48-token tiles (form 3, items of 512 weight rows) stream a
// weight row in kTwoSlabCost of the time one slab and 128-token tiles take (form 4, items of 256
// rows) where both fill their rounds (H100, v25: 0.86-0.89 at deepseek's GEMM1, K = 7168; v24,
// qwen3: 0.87-0.89), but their items are half as many: form 3 where its rounds, each twice as long,
// cost less, and only up to 32 rows per expert (at 48, v24: 1.1-1.7x form 4's time). The model put
// form 3 at 0.88 / 0.96 / 1.47x form 4's time at deepseek GEMM1 / mixtral GEMM1 / mixtral GEMM2
// (its 64 items on 132 SMs); measured 0.86-0.89 / 0.95-0.96 / 1.46-1.55 (M = 128, int4 and mxfp4).
constexpr double kTwoSlabCost = 0.875;
int ws_form(const GroupedArgs& g, int sms) {
  const int64_t e = std::max<int64_t>(g.E, 1);
  if (g.R > 32 * e) return 4;
  const int64_t items3 = (g.N + WspTwoSlabs::kRowsCta - 1) / WspTwoSlabs::kRowsCta * e;
  const int64_t items4 = (g.N + WspOneSlab::kRowsCta - 1) / WspOneSlab::kRowsCta * e;
  return 2.0 * kTwoSlabCost * rounds_cost(items3, sms) <= rounds_cost(items4, sms) ? 3 : 4;
}

}  // namespace

// Launches of the 4-bit mainloop's persistent forms, two slabs / one slab (forms 3 / 4; tests read
// them to prove which form the rule took).
std::atomic<uint64_t> g_rs4_persistent_launches[2];

std::string run_rs4(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream) {
  const Codes codes = g.kind == Kind::kFp4Bf16 ? Codes::kE2M1 : Codes::kU4;
  // A persistent form (ws_form) at every size; the plain mainloop, whose tiles hold up to 128 rows,
  // where the driver has no tensor-map encoder (the warp-specialized forms load by TMA; the call
  // fails where HUMMING_JAX_PREFILL_RS4_WS forces one without it). HUMMING_JAX_PREFILL_RS4_WS=1 / =2: the
  // two-CTA form with one / two slabs always (A/B), =3 / =4: the persistent form with two slabs and
  // tiles of 48 rows / one slab and 128, =0: never; Python rejects other values.
  const int64_t ws_switch = env_count("HUMMING_JAX_PREFILL_RS4_WS", -1, 0);
  const int form = ws_switch >= 1 && ws_switch <= 4 ? static_cast<int>(ws_switch)
                   : ws_switch == -1 && tensor_map_encoder() != nullptr
                       ? ws_form(g, dev.sm_count)
                       : 0;
  const bool persistent = form >= 3;  // 3: WspTwoSlabs, 4: WspOneSlab
  const int ws_slabs = form == 1 || form == 2 ? form : 0;
  const bool warp_specialized = form > 0;
  const int max_tokens = form == 1   ? WsShape<1>::kMaxTokens
                         : form == 2 ? WsShape<2>::kMaxTokens
                         : form == 3 ? WspTwoSlabs::kMaxTokens
                         : form == 4 ? WspOneSlab::kMaxTokens
                                     : kMaxTokens;
  const int64_t max_tiles = (g.R + max_tokens - 1) / max_tokens + g.E;
  // Workspace (base 128-byte aligned by run_grouped): count, tile list, then the activations.
  uint8_t* ws = static_cast<uint8_t*>(g.workspace);
  int* count = reinterpret_cast<int*>(ws);
  int4* tiles = reinterpret_cast<int4*>(ws + 128);
  const size_t act_off = act_offset(g.R, g.E);
  __nv_bfloat16* act = reinterpret_cast<__nv_bfloat16*>(ws + act_off);
  const size_t split_off = split_offset(g.R, g.K, g.E);
  if (g.workspace_bytes < split_off + kSplitBytes) return "workspace too small for the permuted activations and the split";
  unsigned* part_flags = reinterpret_cast<unsigned*>(ws + split_off);
  float* part = reinterpret_cast<float*>(ws + split_off + kSplitFlagBytes);
  {
    const std::string e = codes == Codes::kE2M1 ? prepare_device<Codes::kE2M1>(dev.device) : prepare_device<Codes::kU4>(dev.device);
    if (!e.empty()) return e;
  }
  {
    const std::string e = launch_tile_list(g.offsets, g.E, g.R, g.N, max_tokens, /*chunk=*/1, tiles, count, g.c,
                                           dev.sm_count, stream, part_flags, kSplitSlots * 4);
    if (!e.empty()) return e;
  }
  cudaError_t err;
  const int64_t ktiles = g.R * (g.K / kBK);
  // Rows already in the k order (g.a_k_order: permute_rows or the activation wrote them so) are read
  // where they are; TMA needs a 16-byte aligned base, else they are copied as they are.
  const bool a_in_place = g.a_k_order && reinterpret_cast<uintptr_t>(g.a) % 16 == 0;
  const __nv_bfloat16* act_in = a_in_place ? static_cast<const __nv_bfloat16*>(g.a) : act;
  if (g.a_k_order && !a_in_place && ktiles > 0) {
    err = cudaMemcpyAsync(act, g.a, static_cast<size_t>(g.R) * static_cast<size_t>(g.K) * 2, cudaMemcpyDeviceToDevice,
                          stream);
    if (err != cudaSuccess) return std::string("copying the ordered activations: ") + cudaGetErrorString(err);
  } else if (!g.a_k_order && ktiles > 0) {
    const int64_t pblocks = std::min<int64_t>((ktiles + 8 * kPermuteTiles - 1) / (8 * kPermuteTiles), int64_t{dev.sm_count} * 16);
    permute4_kernel<<<static_cast<unsigned>(pblocks), 256, 0, stream>>>(static_cast<const uint16_t*>(g.a),
                                                                           reinterpret_cast<uint16_t*>(act), ktiles);
    err = cudaGetLastError();
    if (err != cudaSuccess) return std::string("permute4_kernel: ") + cudaGetErrorString(err);
  }
  Params4 P;
  P.a = act_in;
  P.w = static_cast<const uint8_t*>(g.w);
  P.scale = g.w_scale_raw;
  P.scale_cols = static_cast<int>(g.scale_cols);
  // 64-k tiles per scale group (uint4; a group spanning K: any count beyond the tiles of K; e2m1
  // does not use it, and its 32-k groups would make it zero, a division by zero on the host).
  const int64_t tpg = codes == Codes::kE2M1 ? 1 : (g.group_k >= g.K ? (g.K + kBK - 1) / kBK : g.group_k / kBK);
  if (tpg < 1) return "scale groups must be whole 64-k tiles";
  P.div_tpg = decode::make_fastdiv(static_cast<uint32_t>(tpg));
  P.bias = g.bias;
  P.c = static_cast<__nv_bfloat16*>(g.c);
  P.tiles = tiles;
  P.count = count;
  // The persistent forms split a small last round over K (wsp_items); HUMMING_JAX_PREFILL_RS4_SPLIT=0
  // keeps every item whole (A/B; the other forms' sums in the same order, bit for bit).
  P.part = part;
  P.part_flags = part_flags;
  P.split = env_flag("HUMMING_JAX_PREFILL_RS4_SPLIT", true) ? 1 : 0;
  P.N = static_cast<int>(g.N);
  P.K = static_cast<int>(g.K);
  const int rows_cta = form == 3 ? WspTwoSlabs::kRowsCta : form == 4 ? WspOneSlab::kRowsCta
                       : warp_specialized ? kRows * ws_slabs : kRows;
  const int64_t n_blocks = (g.N + rows_cta - 1) / rows_cta;
  const dim3 grid(static_cast<unsigned>(n_blocks), static_cast<unsigned>(max_tiles));
  if (warp_specialized) {
    Ws4Params W{};
    W.P = P;
    // The persistent form's codes boxes hold 256 rows (a box dimension holds at most 256).
    const std::string e = ws_tensor_maps(W, g.w, g.E, g.N, g.K, act_in, g.R, persistent ? 256 : rows_cta);
    if (!e.empty()) return e;
    // A persistent form takes the scales by TMA (WspShape::kTmaScales) where a row's scales span
    // whole 16 bytes (uint4: scale_cols % 8 == 0; e2m1: K % 512 == 0) and the tensor is 16-byte
    // aligned (the TMA's stride and address rules); HUMMING_JAX_PREFILL_RS4_TMA_SCALES=0 keeps the
    // per-row loads (A/B).
    const bool e2m1_codes = codes == Codes::kE2M1;
    const int64_t scale_cols = e2m1_codes ? g.K / 32 : P.scale_cols;
    const bool tma_scales = persistent && (e2m1_codes ? scale_cols % 16 == 0 : scale_cols % 8 == 0) &&
                            reinterpret_cast<uintptr_t>(g.w_scale_raw) % 16 == 0 &&
                            env_flag("HUMMING_JAX_PREFILL_RS4_TMA_SCALES", true);
    if (tma_scales && !encode_rows_3d(&W.scales, e2m1_codes ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                      e2m1_codes ? 1 : 2, g.w_scale_raw, scale_cols, g.N, g.E, e2m1_codes ? 16 : 8, 256,
                                      CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B))
      return "cuTensorMapEncodeTiled failed for the scales";
    // The launches' twelve kernels (codes format x form, the persistent forms with and without TMA
    // scales), each raising its limit once.
    auto launch = [&](auto kernel, dim3 grid_here, int threads, int smem, unsigned& configured) {
      if (!decode::raise_smem_limit_once(kernel, smem, true, configured)) return false;
      kernel<<<grid_here, threads, smem, stream>>>(W);
      return true;
    };
    static unsigned configured[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const bool e2m1 = codes == Codes::kE2M1;
    bool ok;
    if (persistent) {
      // One CTA per SM, or per work item where there are fewer (the tile count is known on the
      // device only: its bound here), times the parts a split item may take (CTAs beyond the
      // work exit at once).
      const int64_t units = n_blocks * max_tiles * (P.split != 0 ? kSplitMaxParts : 1);
      const dim3 pgrid(static_cast<unsigned>(std::min<int64_t>(dev.sm_count, units)));
      auto launch_p = [&](auto shape, unsigned* conf) {
        using Sh = decltype(shape);
        return e2m1 ? launch(gemm4_wsp_kernel<Codes::kE2M1, Sh>, pgrid, Sh::kThreads, Sh::kSmem, conf[0])
                    : launch(gemm4_wsp_kernel<Codes::kU4, Sh>, pgrid, Sh::kThreads, Sh::kSmem, conf[1]);
      };
      if (tma_scales)
        ok = form == 3 ? launch_p(WspTwoSlabsTma{}, configured + 8) : launch_p(WspOneSlabTma{}, configured + 10);
      else
        ok = form == 3 ? launch_p(WspTwoSlabs{}, configured + 4) : launch_p(WspOneSlab{}, configured + 6);
    } else if (ws_slabs == 1) {
      ok = e2m1 ? launch(gemm4_ws_kernel<Codes::kE2M1, 1>, grid, kWsThreads, WsShape<1>::kSmem, configured[0])
                : launch(gemm4_ws_kernel<Codes::kU4, 1>, grid, kWsThreads, WsShape<1>::kSmem, configured[1]);
    } else {
      ok = e2m1 ? launch(gemm4_ws_kernel<Codes::kE2M1, 2>, grid, kWsThreads, WsShape<2>::kSmem, configured[2])
                : launch(gemm4_ws_kernel<Codes::kU4, 2>, grid, kWsThreads, WsShape<2>::kSmem, configured[3]);
    }
    const char* name = persistent ? "gemm4_wsp_kernel: " : "gemm4_ws_kernel: ";
    if (!ok) return std::string(name) + cudaGetErrorString(cudaGetLastError());
    err = cudaGetLastError();
    if (err != cudaSuccess) return std::string(name) + cudaGetErrorString(err);
    if (persistent) g_rs4_persistent_launches[form - 3].fetch_add(1, std::memory_order_relaxed);
    return std::string();
  }
  if (codes == Codes::kE2M1)
    gemm4_kernel<Codes::kE2M1><<<grid, kThreads, kSmem, stream>>>(P);
  else
    gemm4_kernel<Codes::kU4><<<grid, kThreads, kSmem, stream>>>(P);
  err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("gemm4_kernel: ") + cudaGetErrorString(err);
  return std::string();
}

}  // namespace prefill
}  // namespace hj

// Launches of the 4-bit mainloop's persistent forms made by this process (host-side counts; tests
// use them to prove which form the rule took): two slabs and 48-token tiles / one slab and 128.
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillRs4TwoSlabLaunches() {
  return hj::prefill::g_rs4_persistent_launches[0].load(std::memory_order_relaxed);
}
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillRs4OneSlabLaunches() {
  return hj::prefill::g_rs4_persistent_launches[1].load(std::memory_order_relaxed);
}
