// The decode GEMM as a persistent, warp-specialized ring for two weight formats, where a launch
// has enough work units to fill the SMs (gemm_decode_sm90.cu decides; HUMMING_JAX_DECODE_RING=0|1
// overrides): fp8 weights x fp8 activations, and uint4 weights (offset 8, bf16 scales) x bf16
// activations. Why (benchmarks/NOTES.md, v11l): at decode sizes the GEMM is a pass over the touched
// weights, and the mma.sync kernel (gemm_decode_sm90.cuh) loses time at every work unit's start and
// end: each CTA fills its cp.async ring, streams 6-16 stages, drains it and reduces, ~1000 such
// CTAs per launch. Here:
//  * One CTA per SM, looping over work units (item x slice of 128 T rows of N, T = 1 or 2; one slice
//    of every item in turn) in a fixed round robin (all units stream the same bytes, so the split
//    is even); the ring runs across units, so the next unit's first stages load while this one
//    finishes. The host picks T by the last wave: 256-row units where their count fills the SMs'
//    rounds, 128-row ones where halving the unit evens out the last round (pick_tiles).
//  * A producer warp: per stage (128 k) one TMA box of the unit's weight rows (fp8: 128 bytes per
//    row, 128-byte swizzle; uint4: 64 bytes, 64-byte swizzle; zeros past K and past the expert's N
//    rows) and the item's token rows of the same 128 k by cp.async (rows gathered through the
//    routing, zeros past the valid rows). The producer also resolves each unit's rows (find_item)
//    one unit ahead, into one of two info slots.
//  * fp8: both complete the stage's mbarrier. Two consumer warpgroups, 64 T weight rows each: per
//    stage T x 4 wgmma m64n{8,16}k32 on e4m3 codes from shared memory into a per-stage partial sum,
//    then acc += part * a_scale * w_scale (a stage is one 128-k scale block: the host requires scale
//    groups of whole 128 k or spanning K), the contract's per-block accumulation.
//  * uint4: the weights are wgmma's A operand from registers, as in the 4-bit prefill mainloop
//    (gemm_prefill_sm90_4bit.cu): lane t of a quad reads bytes 8t .. 8t+7 of each of its rows'
//    32-byte halves of the stage and converts them to bf16 w' = (q - 8) * s in registers (one
//    rounding of an exact product, the contract's w'), which puts the weights' k in that
//    mainloop's order (rs4_k_of). The activations must follow: a second producer warp permutes
//    each stage's token rows in shared memory (one lane per row and 64-k half: eight 16-byte loads,
//    32 byte permutes, eight stores) before the stage's mbarrier completes. Per stage T x 8 wgmma
//    m64n{8,16}k16 straight into the accumulators (the scale is in w'); the A registers are double
//    buffered over the 64-k halves, so one half's conversion overlaps the other's MMAs.
//  * The epilogue stores each valid row from registers (+ bias), rounded to the output type.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {
namespace {

constexpr int kRingThreads = 384;  // producer warpgroup (one or two working warps) + 2 consumer groups
constexpr int kRingK = 128;        // k per stage

// The weight formats of the ring.
enum class RingFormat : int { kFp8 = 0, kU4 = 1 };

// The ring of units of 128 T weight rows (T 64-row tiles per consumer warpgroup) for format F:
// fp8 stages of 16 T KB of weights and 2 KB of activations (16 rows x 128 bytes), 10 / T of them,
// so both shapes keep the same bytes in flight; uint4 stages of 8 T KB of weights and 4 KB of
// activations (16 rows x 128 bf16 as two 64-k blocks of 128-byte rows), as many as fit ~200 KB.
template <RingFormat F, int T>
struct Ring {
  static constexpr bool kU4 = F == RingFormat::kU4;
  static constexpr int kRows = 128 * T;
  static constexpr int kRowBytes = kU4 ? kRingK / 2 : kRingK;  // weight bytes per row and stage
  static constexpr int kWBytes = kRows * kRowBytes;
  static constexpr int kABytes = kItemRows * kRingK * (kU4 ? 2 : 1);
  static constexpr int kAChunks = kABytes / kItemRows / 16;  // 16-byte chunks of a token row per stage
  static constexpr int kStages = kU4 ? (T == 1 ? 16 : 10) : 10 / T;
  static constexpr int kSmem = kStages * (kWBytes + kABytes) + 1024;  // + alignment slack
  // Arrivals completing a stage: the TMA's expect-tx arrive, plus the producer lanes' cp.async
  // (fp8) or the permuting warp (uint4, whose raw copies complete a barrier of their own).
  static constexpr int kFullArrivals = kU4 ? 2 : 1 + 32;
};

struct RingLaunch {
  CUtensorMap w;  // weights [E][N][row bytes]; box (row bytes of 128 k, 128 T, 1), fp8 128-byte / uint4 64-byte swizzle
  DecodeLaunch D;
  int units;      // items x slices
  int slices;     // ceil(N / (128 T))
  int iters;      // ceil(K / kRingK)
  int groups;     // 8-row token groups of the MMA's B operand (1 or 2)
  int slice_major;  // unit order: 0 the slices of an item in turn, 1 one slice of every item in turn
  int narrow;       // 1: units of at most 8 rows take the 8-token MMA in a launch of 16-token groups
};

__device__ __forceinline__ void mbar_init(uint32_t a, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t a) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t a, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(a), "r"(bytes)
               : "memory");
}
// Waits for the completion of the phase of parity `parity` (a fresh barrier counts parity 1 as done).
__device__ __forceinline__ void mbar_wait(uint32_t a, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n" ::"r"(a),
      "r"(parity)
      : "memory");
}
// One arrival once this thread's earlier cp.async copies have landed (counted in the init count).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t a) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Matrix descriptor of a K-major operand with 128-byte swizzle: 8-row atoms of 8 x 128 bytes, 1024
// bytes apart (the stride field); the leading-offset field is unused (an MMA's 32 k lie in a row).
__device__ __forceinline__ uint64_t desc128(uint32_t addr) {
  return (static_cast<uint64_t>((1024 >> 4) | (1u << 30)) << 32) | ((addr >> 4) & 0x3fffu) | (1u << 16);
}

// Stores a unit's accumulators (+ bias), rounded to the output type: acc[i][4 j + 2 h + e] is weight
// row n0t + 64 i + 8 h, token 8 j + 2 t + e (wgmma's accumulator layout for N = 8 G).
template <int T, int G>
__device__ __forceinline__ void store_unit(const DecodeLaunch& D, const float (&acc)[T][4 * G], int64_t n0t,
                                           int expert, int nvalid, const int32_t* crow, int t) {
  const GemmLaunch& L = D.g;
  const int N = D.N;
  const bool c_f16 = L.p.c_type == ElemType::kF16;
  uint16_t* cout = static_cast<uint16_t*>(L.p.c);
  const float* bias = L.p.w.bias;
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0t + 64 * i + 8 * h;
      if (n >= N) continue;
      const float b = bias ? bias[static_cast<int64_t>(expert) * N + n] : 0.0f;
#pragma unroll
      for (int j = 0; j < G; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = 8 * j + 2 * t + e;
          if (tok >= nvalid) continue;
          const float v = acc[i][4 * j + 2 * h + e] + b;
          cout[static_cast<int64_t>(crow[tok]) * N + n] =
              c_f16 ? __half_as_ushort(__float2half_rn(v)) : __bfloat16_as_ushort(__float2bfloat16_rn(v));
        }
    }
}

// The fp8 consumers' work on one unit: the stages of `expert` over the group's 64 T rows from n0g,
// then the stores. `stage` is the ring position, advanced by the unit's stages.
template <int T, int G>
__device__ __forceinline__ void consume_fp8(const RingLaunch& R, uint32_t wring, uint32_t aring, uint32_t bar_full,
                                            uint32_t bar_empty, int expert, int nvalid, const int32_t* arow,
                                            const int32_t* crow, int64_t n0g, int cg, int wq, int lane,
                                            uint32_t& stage) {
  using RT = Ring<RingFormat::kFp8, T>;
  const DecodeLaunch& D = R.D;
  const GemmLaunch& L = D.g;
  const WeightView& w = L.p.w;
  const int g = lane >> 2, t = lane & 3;
  const int N = D.N, K = D.K;
  // This thread's rows: n0t + 64 i + 8 h (tile i, half h); and its token columns 8 j + 2 t + e.
  const int64_t n0t = n0g + 16 * wq + g;
  uint32_t srow[T][2];
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t n = static_cast<uint32_t>(min(n0t + 64 * i + 8 * h, static_cast<int64_t>(N) - 1));
      srow[i][h] = (static_cast<uint32_t>(expert) * L.scale_rows + D.div_gn.div(n)) * L.scale_cols;
    }
  int64_t abase[G][2];  // scale-row offsets of the token columns (clamped to a valid row)
#pragma unroll
  for (int j = 0; j < G; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) abase[j][e] = static_cast<int64_t>(arow[min(8 * j + 2 * t + e, nvalid - 1)]) * L.a_scale_cols;
  const float s2 = w.scale2 ? w.scale2[expert] : 1.0f;

  float acc[T][4 * G], part[T][4 * G];
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int r = 0; r < 4 * G; ++r) acc[i][r] = part[i][r] = 0.0f;

  for (int ks = 0; ks < R.iters; ++ks, ++stage) {
    const uint32_t s = stage % RT::kStages, ph = (stage / RT::kStages) & 1u;
    // This stage's scales (one 128-k block), loaded before the wait.
    const uint32_t k0 = static_cast<uint32_t>(min(ks * kRingK, K - 1));
    const uint32_t wk = D.div_gk.div(k0), ak = D.div_agk.div(k0);
    float ws[T][2], as[G][2];
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) ws[i][h] = scale_to_float(w.scale_type, load_scale_raw<0>(w.scale_type, w.scale, srow[i][h] + wk)) * s2;
#pragma unroll
    for (int j = 0; j < G; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) as[j][e] = __ldg(L.p.a.scale + abase[j][e] + ak);

    mbar_wait(bar_full + 8 * s, ph);
    const uint32_t wst = wring + s * RT::kWBytes + cg * 64 * T * kRingK, ast = aring + s * RT::kABytes;
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int r = 0; r < 4 * G; ++r) fence_reg(part[i][r]);
    wgmma_fence();
    // Tiles interleaved: consecutive MMAs accumulate into different registers, so the tensor core
    // need not wait for one MMA's result before starting the next.
#pragma unroll
    for (int kk = 0; kk < kRingK / 32; ++kk)
#pragma unroll
      for (int i = 0; i < T; ++i)
        WgMma<G>::run(part[i], desc128(wst + i * 64 * kRingK + kk * 32), desc128(ast + kk * 32), kk);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int r = 0; r < 4 * G; ++r) fence_reg(part[i][r]);
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_empty + 8 * s);  // this warp is done with the stage
    // part[i][4 j + 2 h + e]: row nrow[i][h], token 8 j + 2 t + e.
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int j = 0; j < G; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) acc[i][4 * j + 2 * h + e] += part[i][4 * j + 2 * h + e] * as[j][e] * ws[i][h];
  }
  store_unit<T, G>(D, acc, n0t, expert, nvalid, crow, t);
}

// The uint4 consumers' work on one unit (module comment): per stage and 64-row tile i, each 64-k
// half b converted into A fragments frag[b] (w' = (q - 8) * s, bf16) and run as four k16 MMAs into
// tile i's accumulator sets. A stage is released once the first MMA group of the next one has been waited for (all
// its groups are then complete), the last one after the unit's final wait.
template <int T, int G>
__device__ __forceinline__ void consume_u4(const RingLaunch& R, uint32_t wring, uint32_t aring, uint32_t bar_full,
                                           uint32_t bar_empty, int expert, int nvalid, const int32_t* crow,
                                           int64_t n0g, int cg, int wq, int lane, uint32_t& stage) {
  using RT = Ring<RingFormat::kU4, T>;
  const DecodeLaunch& D = R.D;
  const GemmLaunch& L = D.g;
  const WeightView& w = L.p.w;
  const int g = lane >> 2, t = lane & 3;
  const int N = D.N;
  // This thread's rows: n0t + 64 i + 8 h (tile i, half h).
  const int64_t n0t = n0g + 16 * wq + g;
  uint32_t srow[T][2];  // scale-row offsets
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t n = static_cast<uint32_t>(min(n0t + 64 * i + 8 * h, static_cast<int64_t>(N) - 1));
      srow[i][h] = (static_cast<uint32_t>(expert) * L.scale_rows + D.div_gn.div(n)) * L.scale_cols;
    }
  // Stage row lr = cg 64 T + 64 i + 16 wq + 8 h + g: 64 bytes, its 16-byte units c at c ^ ((lr >> 1) & 3)
  // (the TMA's 64-byte swizzle; (lr >> 1) & 3 = (g >> 1) & 3). Half b's lane bytes 8t .. 8t+7 lie in
  // unit 2b + (t >> 1): the offset for b = 0, and bit 5 flipped for b = 1.
  const uint32_t wlane = (cg * 64 * T + 16 * wq + g) * RT::kRowBytes + (((t >> 1) ^ ((g >> 1) & 3)) << 4) + (t & 1) * 8;
  auto woff = [&](int i, int h, int b) { return (wlane + (64 * i + 8 * h) * RT::kRowBytes) ^ (32u * b); };
  // bf16 scale bits of each row at stage ks (scale groups of whole stages or spanning K).
  auto load_scales = [&](int ks, uint32_t(&dst)[T][2]) {
    const uint32_t wk = D.div_gk.div(static_cast<uint32_t>(min(ks, R.iters - 1) * kRingK));
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) dst[i][h] = load_scale_raw<2>(w.scale_type, w.scale, srow[i][h] + wk);
  };
  // Scales of stages ks (slot ks & 1) and ks + 1: a slot is reloaded for stage ks + 2 once stage ks
  // has read it, two stages ahead of its use without register copies.
  uint32_t sc[2][T][2];
  load_scales(0, sc[0]);
  load_scales(1, sc[1]);

  // NA accumulator sets per tile, the k16 steps of a half in turn over them: the MMAs of a chain
  // into one set wait for each other's results, so more sets keep the tensor core busy (four with
  // one tile, two with two, at the same registers).
  constexpr int NA = T == 1 ? 4 : 2;
  float acc[T][NA][4 * G];
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int a = 0; a < NA; ++a)
#pragma unroll
      for (int r = 0; r < 4 * G; ++r) acc[i][a][r] = 0.0f;
  uint32_t frag[2][4][4];  // [half][k16 step][register]

  auto run_stage = [&](int ks, uint32_t(&scs)[T][2]) {
    const uint32_t s = stage % RT::kStages, ph = (stage / RT::kStages) & 1u;
    mbar_wait(bar_full + 8 * s, ph);
    const uint32_t wst = wring + s * RT::kWBytes, ast = aring + s * RT::kABytes;
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        bool zero_scale = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t words[2];
          lds64(words, wst + woff(i, h, b));
          const uint32_t f1 = scs[i][h] * 0x10001u;
          zero_scale |= scs[i][h] == 0u;
#pragma unroll
          for (int wd = 0; wd < 2; ++wd) {
            // Pair p of word wd: nibbles p and p + 4 -> k16 step (4 wd + p) >> 1, slot p & 1.
            frag[b][2 * wd + 0][0 + h] = rs4_pair<Codes::kU4, 0>(words[wd], f1);
            frag[b][2 * wd + 0][2 + h] = rs4_pair<Codes::kU4, 1>(words[wd], f1);
            frag[b][2 * wd + 1][0 + h] = rs4_pair<Codes::kU4, 2>(words[wd], f1);
            frag[b][2 * wd + 1][2 + h] = rs4_pair<Codes::kU4, 3>(words[wd], f1);
          }
        }
        // As in the 4-bit prefill mainloop: a warp-uniform branch (a multiply by 1.0 on a zero
        // scale, no change to any value) keeps ptxas from scheduling conversions past wgmma.fence,
        // which it would answer by serializing every wgmma.
        if (__any_sync(0xffffffffu, zero_scale)) {
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) frag[b][j][r] = hmul2<false>(frag[b][j][r], 0x3f803f80u);
        }
#pragma unroll
        for (int a = 0; a < NA; ++a)
#pragma unroll
          for (int r = 0; r < 4 * G; ++r) fence_reg(acc[i][a][r]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) fence_reg(frag[b][j][r]);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j)
          RsMma<8 * G>::run(acc[i][(4 * b + j) % NA], frag[b][j], desc128(ast + b * 2048 + j * 32), 1);
        wgmma_commit();
        wgmma_wait<1>();  // the previous group is done: the other half's registers are free again
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) fence_reg(frag[b ^ 1][j][r]);
        if (i == 0 && b == 0 && ks > 0) {  // every group of the previous stage is complete
          __syncwarp();
          if (lane == 0) mbar_arrive(bar_empty + 8 * ((stage - 1) % RT::kStages));
        }
      }
    load_scales(ks + 2, scs);
    ++stage;
  };
  for (int ks = 0; ks < R.iters; ks += 2) {
    run_stage(ks, sc[0]);
    if (ks + 1 < R.iters) run_stage(ks + 1, sc[1]);
  }
  wgmma_wait<0>();
  float sum[T][4 * G];
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int r = 0; r < 4 * G; ++r) {
#pragma unroll
      for (int a = 0; a < NA; ++a) fence_reg(acc[i][a][r]);
      sum[i][r] = acc[i][0][r];
#pragma unroll
      for (int a = 1; a < NA; ++a) sum[i][r] += acc[i][a][r];
    }
  __syncwarp();
  if (lane == 0) mbar_arrive(bar_empty + 8 * ((stage - 1) % RT::kStages));
  store_unit<T, G>(D, sum, n0t, expert, nvalid, crow, t);
}

// The permuting warp's placement (uint4): logical position L of a 64-k block of a token row
// receives physical k ring_permuted_k(L), which must be the k order of the A fragments (rs4_k_of).
// Lane data: physical 16-byte unit 2 t + jh holds bf16 words u[jl] (k 2 jl, 2 jl + 1) and u[2 + jl]
// (k 4 + 2 jl, ...); logical unit lc = 4 jh + 2 jl + s takes as its word t the halves s of both.
constexpr int ring_permuted_k(int L) {
  const int lc = L >> 3, t = (L >> 1) & 3, half = L & 1;
  const int jh = lc >> 2, jl = (lc >> 1) & 1, sh = lc & 1;
  return 8 * (2 * t + jh) + 2 * (half ? 2 + jl : jl) + sh;
}
constexpr bool ring_permutation_matches() {
  for (int L = 0; L < 64; ++L)
    if (ring_permuted_k(L) != rs4_k_of(L)) return false;
  return true;
}
static_assert(ring_permutation_matches(), "the permuting warp must follow the A fragments' k order");

template <RingFormat F, int T>
__global__ void __launch_bounds__(kRingThreads, 1) ring_kernel(const __grid_constant__ RingLaunch R) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using RT = Ring<F, T>;
  constexpr int kRingStages = RT::kStages, kRingRows = RT::kRows, kRingWBytes = RT::kWBytes;
  extern __shared__ uint8_t ring_raw[];
  // full[S], empty[S], raw[S] (uint4: the activation copies landed), info_full[2], info_empty[2]
  __shared__ __align__(8) uint64_t bars[3 * kRingStages + 4];
  __shared__ int s_info[2][4];
  __shared__ int32_t s_arow[2][kItemRows], s_crow[2][kItemRows];
  const DecodeLaunch& D = R.D;
  const GemmLaunch& L = D.g;
  const uint32_t base = (smem_addr(ring_raw) + 1023u) & ~1023u;  // the TMA's swizzles: 1024-byte atoms
  const uint32_t wring = base, aring = base + kRingStages * kRingWBytes;
  const uint32_t bar_full = smem_addr(&bars[0]), bar_empty = smem_addr(&bars[kRingStages]);
  const uint32_t bar_raw = smem_addr(&bars[2 * kRingStages]);
  const uint32_t bar_info_full = smem_addr(&bars[3 * kRingStages]), bar_info_empty = smem_addr(&bars[3 * kRingStages + 2]);
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < kRingStages; ++s) {
      mbar_init(bar_full + 8 * s, RT::kFullArrivals);
      mbar_init(bar_empty + 8 * s, 8);  // the consumer warps
      mbar_init(bar_raw + 8 * s, 32);   // the producer lanes' cp.async (uint4)
    }
    for (int q = 0; q < 2; ++q) {
      mbar_init(bar_info_full + 8 * q, 32);                     // the producer lanes
      mbar_init(bar_info_empty + 8 * q, RT::kU4 ? 8 + 1 : 8);  // the consumer warps (+ the permuting warp)
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  int units = R.units;
  if (L.mode == RowMode::kIndexed)  // units of the used blocks only (blocks are used in order)
    units = static_cast<int>(min(static_cast<int64_t>(units),
                                 (indexed_used_rows(L) + L.block_m - 1) / L.block_m * R.slices));
  const int nitems = units / R.slices;
  // Unit u's item and slice in the launch's order.
  auto unit_of = [&](int u, int& item, int& slice) {
    if (R.slice_major) {
      slice = u / nitems;
      item = u - slice * nitems;
    } else {
      item = u / R.slices;
      slice = u - item * R.slices;
    }
  };

  // uint4: registers moved from the producer warpgroup to the consumers (accumulator sets, double-
  // buffered A fragments, scales two stages ahead: more than 168 per thread at T = 2): 128 x (168 -
  // 64) freed >= 256 x (216 - 168) taken. Each side sets its count first and never rejoins the
  // other's code.
  if (warp < 4) {
    if constexpr (RT::kU4) asm volatile("setmaxnreg.dec.sync.aligned.u32 64;\n" ::: "memory");
    if (warp == 0) {  // producer
    const uint8_t* a = static_cast<const uint8_t*>(L.p.a.data);
    constexpr int kRowChunks = RT::kAChunks, kCopies = kItemRows * kRowChunks / 32;
    const int64_t a_row_bytes = static_cast<int64_t>(D.K) * (RT::kU4 ? 2 : 1);
    uint32_t stage = 0;
    for (int k = 0, u = blockIdx.x; u < units; ++k, u += gridDim.x) {
      const int q = k & 1;
      int item, slice;
      unit_of(u, item, slice);
      mbar_wait(bar_info_empty + 8 * q, ((k >> 1) & 1) ^ 1);
      find_item(D, item, lane, s_arow[q], s_crow[q], s_info[q]);
      __syncwarp();
      const int expert = s_info[q][0], nvalid = s_info[q][1];
      mbar_arrive(bar_info_full + 8 * q);
      if (expert < 0 || nvalid <= 0) continue;
      int64_t arow_bytes[kCopies];  // this lane's copies: rows r = c / kRowChunks, c = lane + 32 m
#pragma unroll
      for (int m = 0; m < kCopies; ++m) {
        const int r = (lane + 32 * m) / kRowChunks;
        arow_bytes[m] = r < nvalid ? static_cast<int64_t>(s_arow[q][r]) * a_row_bytes : -1;
      }
      for (int ks = 0; ks < R.iters; ++ks, ++stage) {
        const uint32_t s = stage % kRingStages, ph = (stage / kRingStages) & 1u;
        mbar_wait(bar_empty + 8 * s, ph ^ 1u);
        if (lane == 0) {
          mbar_arrive_expect_tx(bar_full + 8 * s, kRingWBytes);
          tma_load_3d(wring + s * kRingWBytes, &R.w, ks * RT::kRowBytes, slice * kRingRows, expert, bar_full + 8 * s);
        }
        // Token row r's 16-byte unit j: 64-k block j >> 3 (uint4; fp8 has one), unit j & 7 of its
        // 128-byte row, 128-byte swizzle.
#pragma unroll
        for (int m = 0; m < kCopies; ++m) {
          const int c = lane + 32 * m, r = c / kRowChunks, j = c % kRowChunks;
          if (r >= 8 * R.groups) break;
          const int64_t kb = static_cast<int64_t>(ks) * (kRowChunks * 16) + j * 16;
          const bool ok = arow_bytes[m] >= 0 && kb < a_row_bytes;
          cp_async16(aring + s * RT::kABytes + (j >> 3) * (kItemRows * 128) + r * 128 + (((j & 7) ^ (r & 7)) << 4),
                     ok ? a + arow_bytes[m] + kb : a, ok ? 16 : 0);
        }
        cp_async_mbar_arrive((RT::kU4 ? bar_raw : bar_full) + 8 * s);
      }
    }
    cp_async_wait<0>();
    } else if (RT::kU4 && warp == 1) {  // uint4: the activations into the A fragments' k order, in place
    const int r = lane & 15, b = lane >> 4;  // this lane's token row and 64-k block
    uint32_t stage = 0;
    for (int k = 0, u = blockIdx.x; u < units; ++k, u += gridDim.x) {
      const int q = k & 1;
      mbar_wait(bar_info_full + 8 * q, (k >> 1) & 1);
      const int expert = s_info[q][0], nvalid = s_info[q][1];
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_info_empty + 8 * q);
      if (expert < 0 || nvalid <= 0) continue;
      for (int ks = 0; ks < R.iters; ++ks, ++stage) {
        const uint32_t s = stage % kRingStages, ph = (stage / kRingStages) & 1u;
        mbar_wait(bar_raw + 8 * s, ph);
        const uint32_t row = aring + s * RT::kABytes + b * (kItemRows * 128) + r * 128;
        uint32_t v[8][4];
#pragma unroll
        for (int pc = 0; pc < 8; ++pc) lds128(v[pc], row + ((pc ^ (r & 7)) << 4));
#pragma unroll
        for (int lc = 0; lc < 8; ++lc) {
          const int jh = lc >> 2, jl = (lc >> 1) & 1;
          const uint32_t sel = (lc & 1) ? 0x7632u : 0x5410u;
          sts128(row + ((lc ^ (r & 7)) << 4), __byte_perm(v[jh][jl], v[jh][2 + jl], sel),
                 __byte_perm(v[2 + jh][jl], v[2 + jh][2 + jl], sel), __byte_perm(v[4 + jh][jl], v[4 + jh][2 + jl], sel),
                 __byte_perm(v[6 + jh][jl], v[6 + jh][2 + jl], sel));
        }
        fence_proxy_async();  // the stores, visible to the consumers' wgmma
        __syncwarp();
        if (lane == 0) mbar_arrive(bar_full + 8 * s);
      }
    }
    }
  } else {  // consumers
    if constexpr (RT::kU4) asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
    const int cw = warp - 4, cg = cw >> 2, wq = cw & 3;
    uint32_t stage = 0;
    for (int k = 0, u = blockIdx.x; u < units; ++k, u += gridDim.x) {
      const int q = k & 1;
      int item, slice;
      unit_of(u, item, slice);
      (void)item;
      mbar_wait(bar_info_full + 8 * q, (k >> 1) & 1);
      const int expert = s_info[q][0], nvalid = s_info[q][1];
      const int64_t zlo = s_info[q][2], zhi = s_info[q][3];
      const int64_t n0 = static_cast<int64_t>(slice) * kRingRows;
      if (expert >= 0 && nvalid > 0) {
        const bool narrow = R.groups == 1 || (R.narrow && nvalid <= 8);
        if constexpr (RT::kU4) {
          if (narrow)
            consume_u4<T, 1>(R, wring, aring, bar_full, bar_empty, expert, nvalid, s_crow[q], n0 + 64 * T * cg, cg,
                             wq, lane, stage);
          else
            consume_u4<T, 2>(R, wring, aring, bar_full, bar_empty, expert, nvalid, s_crow[q], n0 + 64 * T * cg, cg,
                             wq, lane, stage);
        } else {
          if (narrow)
            consume_fp8<T, 1>(R, wring, aring, bar_full, bar_empty, expert, nvalid, s_arow[q], s_crow[q],
                              n0 + 64 * T * cg, cg, wq, lane, stage);
          else
            consume_fp8<T, 2>(R, wring, aring, bar_full, bar_empty, expert, nvalid, s_arow[q], s_crow[q],
                              n0 + 64 * T * cg, cg, wq, lane, stage);
        }
      }
      // Rows [zlo, zhi) of the slice are zeros (grouped rows past the last expert, batched rows past a count).
      if (zhi > zlo) {
        uint16_t* cout = static_cast<uint16_t*>(L.p.c);
        const int64_t N = D.N, cols = min(N, n0 + kRingRows) - n0;
        for (int64_t idx = tid - 128; idx < (zhi - zlo) * cols; idx += kRingThreads - 128)
          cout[(zlo + idx / cols) * N + n0 + idx % cols] = 0;
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_info_empty + 8 * q);
    }
  }
#else
  __trap();
#endif
}

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    else
      cudaGetLastError();
  });
  return fn;
}

// The ring's format for a planned launch, or -1: fp8 codes on both sides with scale groups of whole
// 128 k or spanning K; uint4 (offset 8, no zero points or second scale) with bf16 scales of such
// groups and bf16 activations, K a multiple of 128.
int ring_format_of(const DecodeLaunch& D) {
  const GemmProblem& p = D.g.p;
  auto covers = [&](int64_t group) { return group >= D.K || (group > 0 && group % kRingK == 0); };
  if (D.max_rows > kItemRows || tensor_map_encoder() == nullptr || !covers(p.w.group_k)) return -1;
  if (p.w.type == WeightType::kFp8E4M3 && p.a.type == ElemType::kE4M3 && p.a.scale != nullptr && covers(p.a.group_k) &&
      D.K % 16 == 0)
    return static_cast<int>(RingFormat::kFp8);
  if (p.w.type == WeightType::kUInt4 && p.w.zero == nullptr && p.w.scale2 == nullptr &&
      p.w.scale_type == ElemType::kBF16 && p.a.type == ElemType::kBF16 && D.K % kRingK == 0)
    return static_cast<int>(RingFormat::kU4);
  return -1;
}

// Work units of `items` items in slices of `rows` weight rows.
int64_t ring_units(const DecodeLaunch& D, int64_t items, int rows) { return items * ((D.N + rows - 1) / rows); }

}  // namespace

bool ring_applies(const DecodeLaunch& D) { return ring_format_of(D) >= 0; }

int ring_units_256(const DecodeLaunch& D, int64_t items) {
  return static_cast<int>(std::min<int64_t>(ring_units(D, items, 256), INT32_MAX));
}

namespace {

// Tiles per consumer warpgroup (T): the unit height with the shorter estimated launch, counted in
// rounds of units over the SMs (the round robin's last round is the launch's tail) at a 128-row
// unit's cost relative to a 256-row one (kHalfUnitCost tenths of it, its fixed per-unit share not
// halving; measured 0.54-0.58 for fp8). Right for 15 of 18 fp8 GEMMs timed both ways, the others
// within 3% (benchmarks/NOTES.md, v11m). HUMMING_JAX_RING_ROWS=128|256 forces one (A/B timing).
int pick_tiles(const DecodeLaunch& D, int sms) {
  if (const char* v = std::getenv("HUMMING_JAX_RING_ROWS"); v && *v) {
    if (std::atoi(v) == 128) return 1;
    if (std::atoi(v) == 256) return 2;
  }
  constexpr int64_t kHalfUnitCost = 6;  // tenths of a 256-row unit's time
  const int64_t items = std::max(D.est_items, 1), slots = std::max(sms, 1);
  const int64_t u2 = ring_units(D, items, 256), u1 = ring_units(D, items, 128);
  const int64_t t2 = 10 * ((u2 + slots - 1) / slots), t1 = kHalfUnitCost * ((u1 + slots - 1) / slots);
  return t1 < t2 ? 1 : 2;
}

template <RingFormat F, int T>
bool launch_ring(const DecodeLaunch& D, int sms, cudaStream_t stream) {
  using RT = Ring<F, T>;
  static unsigned configured = 0;
  if (!raise_smem_limit_once(ring_kernel<F, T>, RT::kSmem, false, configured)) {
    cudaGetLastError();  // not launched: the caller launches the planned kernel, whose check must not see this
    return false;
  }
  RingLaunch R{};
  R.D = D;
  R.slices = (D.N + RT::kRows - 1) / RT::kRows;
  R.iters = (D.K + kRingK - 1) / kRingK;
  R.groups = (D.max_rows + 7) / 8;
  const int64_t units = static_cast<int64_t>(D.items) * R.slices;
  if (units <= 0 || units > INT32_MAX) return false;
  R.units = static_cast<int>(units);
  const int64_t row_bytes = RT::kU4 ? D.K / 2 : D.K;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(D.N),
                              static_cast<cuuint64_t>(D.g.E)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(row_bytes) * D.N};
  const cuuint32_t box[3] = {RT::kRowBytes, RT::kRows, 1}, estrides[3] = {1, 1, 1};
  // A/B switches (timing only): HUMMING_JAX_RING_L2=none|128|256 (the TMA's L2 promotion, default
  // 256), HUMMING_JAX_RING_ORDER=item (an item's slices in turn instead of one slice of every item),
  // HUMMING_JAX_RING_NARROW=0 (16-token MMAs for every unit of a launch with items over 8 rows).
  const char* l2 = std::getenv("HUMMING_JAX_RING_L2");
  const std::string l2s = l2 ? l2 : "";
  const CUtensorMapL2promotion promo = l2s == "none"  ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                                       : l2s == "128" ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                      : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  const char* order = std::getenv("HUMMING_JAX_RING_ORDER");
  // Slice-major by default: neighbouring CTAs stream the same slice of different experts (NOTES v11n:
  // fp8 qwen3 M = 4 / 128 3% faster, the rest within 1%).
  R.slice_major = !(order && std::string(order) == "item");
  R.narrow = env_flag("HUMMING_JAX_RING_NARROW", true);
  if (tensor_map_encoder()(&R.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(D.g.p.w.data), dims, strides,
                           box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           RT::kU4 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B, promo,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  const int grid = static_cast<int>(std::min<int64_t>(units, std::max(sms, 1)));
  ring_kernel<F, T><<<grid, kRingThreads, RT::kSmem, stream>>>(R);
  return true;
}

template <RingFormat F>
int launch_format(const DecodeLaunch& D, int sms, cudaStream_t stream) {
  if (pick_tiles(D, sms) == 1) return launch_ring<F, 1>(D, sms, stream) ? Ring<F, 1>::kRows : 0;
  return launch_ring<F, 2>(D, sms, stream) ? Ring<F, 2>::kRows : 0;
}

}  // namespace

int launch_ring_kernel(const DecodeLaunch& D, int sms, cudaStream_t stream) {
  switch (ring_format_of(D)) {
    case static_cast<int>(RingFormat::kFp8): return launch_format<RingFormat::kFp8>(D, sms, stream);
    case static_cast<int>(RingFormat::kU4): return launch_format<RingFormat::kU4>(D, sms, stream);
    default: return 0;
  }
}

}  // namespace decode
}  // namespace hj
