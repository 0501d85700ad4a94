// The decode GEMM for fp8 weights x fp8 activations as a persistent, warp-specialized ring,
// where a launch has enough work units to fill the SMs (gemm_decode_sm90.cu decides;
// HUMMING_JAX_DECODE_RING=0|1 overrides). Why (benchmarks/NOTES.md,
// v11l): at decode sizes the fp8 GEMM is a pass over the touched weights, and the mma.sync kernel
// (gemm_decode_sm90.cuh) loses time at every work unit's start and end: each CTA fills its
// cp.async ring, streams 6-16 stages, drains it and reduces, ~1000 such CTAs per launch. Here:
//  * One CTA per SM, looping over work units (item x slice of 128 T rows of N, T = 1 or 2; one slice
//    of every item in turn) in a fixed round robin (all units stream the same bytes, so the split
//    is even); the ring of 10 / T stages runs across units, so the next unit's first stages load
//    while this one finishes. The host picks T by the last wave: 256-row units where their count
//    fills the SMs' rounds, 128-row ones where halving the unit evens out the last round (Ring,
//    pick_tiles).
//  * A producer warp: per stage one TMA box of 128 T weight rows x 128 k (16 T KB, 128-byte swizzle,
//    zeros past K and past the expert's N rows) and the item's token rows of the same 128 k by
//    cp.async (rows gathered through the routing, zeros past the valid rows); both complete one
//    mbarrier. The producer also resolves each unit's rows (find_item) one unit ahead, into one of
//    two info slots.
//  * Two consumer warpgroups, 64 T weight rows each: per stage T x 4 wgmma m64n{8,16}k32 on e4m3
//    codes from shared memory into a per-stage partial sum, then acc += part * a_scale * w_scale
//    (a stage is one 128-k scale block: the host requires scale groups of whole 128 k or spanning
//    K), the contract's per-block accumulation. The epilogue stores each valid row from registers.

#include <algorithm>
#include <cstdlib>
#include <string>

#include "gemm_decode_sm90.cuh"
#include "mbarrier_sm90.cuh"
#include "tensor_map.h"

namespace hj {
namespace decode {
namespace {

constexpr int kRingThreads = 384;                 // producer warpgroup (one working warp) + 2 consumer groups
constexpr int kRingK = 128;                       // k (= bytes) per stage
constexpr int kRingABytes = kItemRows * kRingK;   // 2 KB of activations per stage (up to 16 rows)
constexpr int kFullArrivals = 1 + 32;             // the TMA's expect-tx arrive + the producer lanes' cp.async

// The ring of units of 128 T weight rows (T 64-row tiles per consumer warpgroup): stages of 16 T
// KB of weights, 10 / T of them, so both shapes keep the same bytes in flight.
template <int T>
struct Ring {
  static constexpr int kRows = 128 * T;
  static constexpr int kStages = 10 / T;
  static constexpr int kWBytes = kRows * kRingK;
  static constexpr int kSmem = kStages * (kWBytes + kRingABytes) + 1024;  // + alignment slack
};

struct RingLaunch {
  CUtensorMap w;  // weights [E][N][K] bytes; box (kRingK, 128 T, 1), 128-byte swizzle
  DecodeLaunch D;
  int units;      // items x slices
  int slices;     // ceil(N / (128 T))
  int iters;      // ceil(K / kRingK)
  int groups;     // 8-row token groups of the MMA's B operand (1 or 2)
  int slice_major;  // unit order: 0 the slices of an item in turn, 1 one slice of every item in turn
  int narrow;       // 1: units of at most 8 rows take the 8-token MMA in a launch of 16-token groups
};

// Matrix descriptor of a K-major operand with 128-byte swizzle: 8-row atoms of 8 x 128 bytes, 1024
// bytes apart (the stride field); the leading-offset field is unused (an MMA's 32 k lie in a row).
__device__ __forceinline__ uint64_t desc128(uint32_t addr) {
  return (static_cast<uint64_t>((1024 >> 4) | (1u << 30)) << 32) | ((addr >> 4) & 0x3fffu) | (1u << 16);
}

// The consumers' work on one unit: the stages of `expert` over the group's 64 T rows from n0g, then
// the stores. `stage` is the ring position, advanced by the unit's stages.
template <int T, int G>
__device__ __forceinline__ void consume(const RingLaunch& R, uint32_t wring, uint32_t aring, uint32_t bar_full,
                                        uint32_t bar_empty, int expert, int nvalid, const int32_t* arow,
                                        const int32_t* crow, int64_t n0g, int cg, int wq, int lane, uint32_t& stage) {
  const DecodeLaunch& D = R.D;
  const GemmLaunch& L = D.g;
  const WeightView& w = L.p.w;
  const int g = lane >> 2, t = lane & 3;
  const int N = D.N, K = D.K;
  // This thread's rows: tile i (64 rows), half h; and its token columns 8 j + 2 t + e.
  int64_t nrow[T][2];
  uint32_t srow[T][2];
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      nrow[i][h] = n0g + 64 * i + 16 * wq + 8 * h + g;
      const uint32_t n = static_cast<uint32_t>(min(nrow[i][h], static_cast<int64_t>(N) - 1));
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
    const uint32_t s = stage % Ring<T>::kStages, ph = (stage / Ring<T>::kStages) & 1u;
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
    // The stage's token rows were written by cp.async (the generic proxy); the wgmma reads them
    // through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const uint32_t wst = wring + s * Ring<T>::kWBytes + cg * 64 * T * kRingK, ast = aring + s * kRingABytes;
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

  const bool c_f16 = L.p.c_type == ElemType::kF16;
  uint16_t* cout = static_cast<uint16_t*>(L.p.c);
  const float* bias = w.bias;
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = nrow[i][h];
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

template <int T>
__global__ void __launch_bounds__(kRingThreads, 1) fp8_ring_kernel(const __grid_constant__ RingLaunch R) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  constexpr int kRingStages = Ring<T>::kStages, kRingRows = Ring<T>::kRows, kRingWBytes = Ring<T>::kWBytes;
  extern __shared__ uint8_t ring_raw[];
  __shared__ __align__(8) uint64_t bars[2 * kRingStages + 4];  // full[S], empty[S], info_full[2], info_empty[2]
  __shared__ int s_info[2][4];
  __shared__ int32_t s_arow[2][kItemRows], s_crow[2][kItemRows];
  const DecodeLaunch& D = R.D;
  const GemmLaunch& L = D.g;
  begin_dependent_grid();  // launch_ring launches it dependent on the kernel before it
  const uint32_t base = (smem_addr(ring_raw) + 1023u) & ~1023u;  // TMA's 128-byte swizzle: 1024-byte atoms
  const uint32_t wring = base, aring = base + kRingStages * kRingWBytes;
  const uint32_t bar_full = smem_addr(&bars[0]), bar_empty = smem_addr(&bars[kRingStages]);
  const uint32_t bar_info_full = smem_addr(&bars[2 * kRingStages]), bar_info_empty = smem_addr(&bars[2 * kRingStages + 2]);
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < kRingStages; ++s) {
      mbar_init(bar_full + 8 * s, kFullArrivals);
      mbar_init(bar_empty + 8 * s, 8);  // the consumer warps
    }
    for (int q = 0; q < 2; ++q) {
      mbar_init(bar_info_full + 8 * q, 32);  // the producer lanes
      mbar_init(bar_info_empty + 8 * q, 8);
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

  if (warp == 0) {  // producer
    const uint8_t* a = static_cast<const uint8_t*>(L.p.a.data);
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
      int64_t arow_bytes[kItemRows * 8 / 32];  // this lane's copies: rows r = c >> 3, c = lane + 32 m
#pragma unroll
      for (int m = 0; m < kItemRows * 8 / 32; ++m) {
        const int r = (lane + 32 * m) >> 3;
        arow_bytes[m] = r < nvalid ? static_cast<int64_t>(s_arow[q][r]) * D.K : -1;
      }
      for (int ks = 0; ks < R.iters; ++ks, ++stage) {
        const uint32_t s = stage % kRingStages, ph = (stage / kRingStages) & 1u;
        mbar_wait(bar_empty + 8 * s, ph ^ 1u);
        if (lane == 0) {
          mbar_arrive_expect_tx(bar_full + 8 * s, kRingWBytes);
          tma_load_3d(wring + s * kRingWBytes, &R.w, ks * kRingK, slice * kRingRows, expert, bar_full + 8 * s);
        }
#pragma unroll
        for (int m = 0; m < kItemRows * 8 / 32; ++m) {
          const int c = lane + 32 * m, r = c >> 3, j = c & 7;
          if (r >= 8 * R.groups) break;
          const int64_t kb = static_cast<int64_t>(ks) * kRingK + j * 16;
          const bool ok = arow_bytes[m] >= 0 && kb < D.K;
          cp_async16(aring + s * kRingABytes + r * 128 + ((j ^ (r & 7)) << 4), ok ? a + arow_bytes[m] + kb : a,
                     ok ? 16 : 0);
        }
        cp_async_mbar_arrive(bar_full + 8 * s);
      }
    }
    cp_async_wait<0>();
  } else if (warp >= 4) {  // consumers
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
        if (R.groups == 1 || (R.narrow && nvalid <= 8))
          consume<T, 1>(R, wring, aring, bar_full, bar_empty, expert, nvalid, s_arow[q], s_crow[q], n0 + 64 * T * cg,
                        cg, wq, lane, stage);
        else
          consume<T, 2>(R, wring, aring, bar_full, bar_empty, expert, nvalid, s_arow[q], s_crow[q], n0 + 64 * T * cg,
                        cg, wq, lane, stage);
      }
      // Rows [zlo, zhi) of the slice are zeros (grouped rows past the last expert, batched rows past a count).
      zero_rows<kRingThreads - 128, kRingRows>(D, zlo, zhi, n0, static_cast<uint32_t>(tid - 128));
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_info_empty + 8 * q);
    }
  }
#else
  __trap();
#endif
}

}  // namespace

bool fp8_ring_applies(const DecodeLaunch& D) {
  const GemmProblem& p = D.g.p;
  auto covers = [&](int64_t group) { return group >= D.K || (group > 0 && group % kRingK == 0); };
  return p.w.type == WeightType::kFp8E4M3 && p.a.type == ElemType::kE4M3 && p.a.scale != nullptr &&
         covers(p.w.group_k) && covers(p.a.group_k) && D.max_rows <= kItemRows && D.K % 16 == 0 &&
         tensor_map_encoder() != nullptr;
}

namespace {

// Work units of `items` items in slices of `rows` weight rows.
int64_t ring_units(const DecodeLaunch& D, int64_t items, int rows) { return items * ((D.N + rows - 1) / rows); }

}  // namespace

int fp8_ring_units(const DecodeLaunch& D, int64_t items) {
  return static_cast<int>(std::min<int64_t>(ring_units(D, items, Ring<2>::kRows), INT32_MAX));
}

namespace {

// Tiles per consumer warpgroup (T): the unit height with the shorter estimated launch, counted in
// rounds of units over the SMs (the round robin's last round is the launch's tail) at a 128-row
// unit's cost relative to a 256-row one (kHalfUnitCost tenths of it, its fixed per-unit share not
// halving; measured 0.54-0.58). Right for 15 of 18 fp8 GEMMs timed both ways, the others within 3%
// (benchmarks/NOTES.md, v11m). HUMMING_JAX_RING_ROWS=128|256 forces one (A/B timing).
int pick_tiles(const DecodeLaunch& D, int sms) {
  if (const char* v = std::getenv("HUMMING_JAX_RING_ROWS"); v && *v) {
    if (std::atoi(v) == 128) return 1;
    if (std::atoi(v) == 256) return 2;
  }
  constexpr int64_t kHalfUnitCost = 6;  // tenths of a 256-row unit's time
  const int64_t items = std::max(D.est_items, 1), slots = std::max(sms, 1);
  const int64_t u2 = ring_units(D, items, Ring<2>::kRows), u1 = ring_units(D, items, Ring<1>::kRows);
  const int64_t t2 = 10 * ((u2 + slots - 1) / slots), t1 = kHalfUnitCost * ((u1 + slots - 1) / slots);
  return t1 < t2 ? 1 : 2;
}

template <int T>
bool launch_ring(const DecodeLaunch& D, int sms, cudaStream_t stream) {
  static unsigned configured = 0;
  if (!raise_smem_limit_once(fp8_ring_kernel<T>, Ring<T>::kSmem, false, configured)) {
    cudaGetLastError();  // not launched: the caller launches the planned kernel, whose check must not see this
    return false;
  }
  RingLaunch R{};
  R.D = D;
  R.slices = (D.N + Ring<T>::kRows - 1) / Ring<T>::kRows;
  R.iters = (D.K + kRingK - 1) / kRingK;
  R.groups = (D.max_rows + 7) / 8;
  const int64_t units = static_cast<int64_t>(D.items) * R.slices;
  if (units <= 0 || units > INT32_MAX) return false;
  R.units = static_cast<int>(units);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(D.K), static_cast<cuuint64_t>(D.N),
                              static_cast<cuuint64_t>(D.g.E)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(D.K), static_cast<cuuint64_t>(D.K) * D.N};
  const cuuint32_t box[3] = {kRingK, Ring<T>::kRows, 1}, estrides[3] = {1, 1, 1};
  // A/B switches (timing only): HUMMING_JAX_RING_L2=none|128|256 (the TMA's L2 promotion, default
  // 256), HUMMING_JAX_RING_ORDER=item (an item's slices in turn instead of one slice of every item),
  // HUMMING_JAX_RING_NARROW=0 (16-token MMAs for every unit of a launch with items over 8 rows).
  const CUtensorMapL2promotion promo = l2_promotion_from_env("HUMMING_JAX_RING_L2", CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  const char* order = std::getenv("HUMMING_JAX_RING_ORDER");
  // Slice-major by default: neighbouring CTAs stream the same slice of different experts (NOTES v11n:
  // qwen3 M = 4 / 128 3% faster, the rest within 1%).
  R.slice_major = !(order && std::string(order) == "item");
  R.narrow = env_flag("HUMMING_JAX_RING_NARROW", true);
  if (tensor_map_encoder()(&R.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(D.g.p.w.data), dims, strides,
                           box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  // One CTA per SM; HUMMING_JAX_RING_BALANCE=1 (A/B timing): as many CTAs as give every CTA the
  // same number of the expected units (the round robin's rounds over the SMs, each CTA a full last
  // round), where the SMs would otherwise split the last round unevenly.
  int64_t grid64 = std::min<int64_t>(units, std::max(sms, 1));
  if (env_flag("HUMMING_JAX_RING_BALANCE", false)) {
    const int64_t expected = std::max<int64_t>(1, std::min<int64_t>(units, ring_units(D, std::max(D.est_items, 1), Ring<T>::kRows)));
    const int64_t rounds = (expected + grid64 - 1) / grid64;
    grid64 = (expected + rounds - 1) / rounds;
  }
  const int grid = static_cast<int>(grid64);
  launch_dependent(fp8_ring_kernel<T>, dim3(grid), dim3(kRingThreads), Ring<T>::kSmem, stream, R);
  return true;
}

}  // namespace

int launch_fp8_ring(const DecodeLaunch& D, int sms, cudaStream_t stream) {
  if (pick_tiles(D, sms) == 1) return launch_ring<1>(D, sms, stream) ? Ring<1>::kRows : 0;
  return launch_ring<2>(D, sms, stream) ? Ring<2>::kRows : 0;
}

}  // namespace decode
}  // namespace hj
