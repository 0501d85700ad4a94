// Kind::kFp8Block128Wsp (gemm_prefill_sm90.h): the w8a8-fp8-block128 grouped GEMM on our own
// persistent sm_90a kernel, taken where HUMMING_JAX_PREFILL_FP8_WSP selects it (A/B against the
// CUTLASS blockwise kind, Kind::kFp8Block128). The bf16 kernel's structure (gemm_prefill_sm90_bf16_wsp.cu,
// prefill_wsp_sm90.cuh) with e4m3 codes and block scales:
//
//  * A stage is 128 k: one 128-byte swizzle row of codes per weight row and token, and one scale
//    block, so the stage's MMAs (four k32 steps per kChunk-token chunk) go into a partial sum that is
//    then scaled into the accumulators: acc += partial * a_scale[token, kb] * w_scale[rows, kb],
//    a chunk at a time (two partial buffers: chunk c's MMAs run while chunk c - 1 is scaled).
//  * Two forms (Form<kMaxTokens>):
//     - tiles of up to 128 tokens: three consumer warpgroups (192 weight rows a CTA; a warpgroup's
//       64 rows lie in one 128-row scale block, the CTA's in two) and a producer warpgroup,
//       `setmaxnreg` 32 / 160 from the launch's 128: room for the accumulators, two partial buffers
//       and the stage's A fragments; 5 stages;
//     - tiles of up to 256 tokens: two consumer warpgroups (128 weight rows, one scale block) and
//       the producer warpgroup, `setmaxnreg` 40 / 232 from the launch's 168: 128 accumulators a
//       thread; 4 stages. Shared-memory traffic per MAC as the CUTLASS kind's tiles (the bf16
//       kernel's 256-token form; benchmarks/NOTES.md, v12).
//    The producer's 128 threads write the stage's token scales (one or two a thread, loaded two
//    stages ahead) times the CTA's weight-block scales beside the codes; one of them issues the
//    TMA boxes.
//  * Tiles of whole 32-token chunks (tile_list.cuh), one tensor map a operand, no descriptor update
//    between experts, clusters of two sharing the tokens by multicast (=2), as in the bf16 kernel.
// Needs K % 128 == 0 and N % 128 == 0 (the CUTLASS kind's blocks). Output: acc (float32 over the
// blocks) + bias, one rounding to bf16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "gemm_decode_sm90.cuh"
#include "gemm_prefill_sm90.h"
#include "mbarrier_sm90.cuh"
#include "prefill_wsp_sm90.cuh"
#include "tensor_map.h"
#include "tile_list.cuh"
#include "wgmma_sm90.cuh"

namespace hj {
namespace prefill {
namespace {

using decode::fence_reg;
using decode::smem_addr;
using decode::wgmma_commit;
using decode::wgmma_fence;
using decode::wgmma_wait;

using wsp::kChunk;
using wsp::kStagingBytes;
using wsp::release;

constexpr int kBK = 128;  // k per stage: one 128-byte row of codes, one scale block
constexpr int kScaleAhead = 2;  // stages between a scale's load and its store (the producer's register ring)

// A form of the kernel: tiles of up to kMaxTokens token rows (its warpgroups: wsp::Groups).
template <int kMaxTokens_>
struct Form : wsp::Groups<kMaxTokens_> {
  using G = wsp::Groups<kMaxTokens_>;
  static constexpr int kWBytes = G::kRowsCta * kBK;      // a stage's codes (one TMA box)
  static constexpr int kActBytes = G::kMaxTokens * kBK;  // a stage's token codes
  // 128-row weight scale blocks a CTA's rows meet: 192 rows from a multiple of 192, two; 128 rows
  // from a multiple of 128, one.
  static constexpr int kBlocks = G::kRowsCta == 128 ? 1 : 2;
  static constexpr int kTokensPerThread = G::kMaxTokens / 128;  // token scales a producer thread writes
  // A scale slot: for each of the CTA's weight blocks, the tile's token scales times the block's
  // scale (the producer multiplies; a consumer reads its warpgroup's block).
  static constexpr int kBlockScaleBytes = G::kMaxTokens * 4;
  static constexpr int kScaleBytes = kBlocks * kBlockScaleBytes;
  static constexpr int kStages = G::kMaxTokens == 256 ? 4 : 5;
  static constexpr int kRingBytes = kStages * (kWBytes + kActBytes + kScaleBytes);
  static constexpr int kSmem = kRingBytes + G::kGroups * kStagingBytes + 1024;  // + the 1024-byte alignment
  static_assert(kSmem <= 227 * 1024 - 256, "shared memory");
  static_assert(G::kRowsCta == 128 || G::kRowsCta == 192, "a CTA's rows meet one or two 128-row scale blocks");
};

// gemm8_wsp_kernel launches by this process (HjPrefillFp8WspLaunches), for the GPU tests.
std::atomic<uint64_t> g_fp8_wsp_launches{0};

template <int kMaxTokens>
struct Fp8WspParams {
  CUtensorMap w;  // [E, N, K] e4m3, boxes of 128 k x kRowsCta rows x 1
  // [R, K] e4m3, boxes of 128 k x 8 (i + 1) rows: half a tile of 16 (i + 1)
  CUtensorMap act[Form<kMaxTokens>::kActMaps];
  const float* a_scale;  // [R, K / 128]
  const float* w_scale;  // [E, N / 128, K / 128]
  const float* bias;     // [E, N] or nullptr
  __nv_bfloat16* c;      // [R, N]
  int4* tiles;           // (expert, first row, rows, 0)
  int* count;            // tiles in the list
  int N, K, R;
  int group;             // tiles per group of the work items' order (wsp::for_items)
};

__device__ __forceinline__ void sts32(uint32_t a, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ float2 lds64(uint32_t a) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory");
  return v;
}

// The producer warpgroup (thread p of 128): for each of this cluster's items, its KT stages; slot
// and phase run on across items. Thread 0 issues the TMA boxes (the CTA's kRowsCta weight rows;
// half of the tile's tokens, multicast to both CTAs of a cluster of two, or both halves alone);
// thread p stores tokens p (+ 128)'s scales times each of the CTA's weight-block scales of the
// stage, all loaded kScaleAhead stages ahead into a ring of register slots with compile-time
// indices.
template <int kMaxTokens, int kCluster>
__device__ __forceinline__ void produce(const Fp8WspParams<kMaxTokens>& W, uint32_t w0, uint32_t act0, uint32_t sc0,
                                        uint32_t bar_full, uint32_t bar_empty, int rank, int p) {
  using F = Form<kMaxTokens>;
  constexpr int kT = F::kTokensPerThread, kB = F::kBlocks;
  constexpr int kWBytes = F::kWBytes, kActBytes = F::kActBytes, kScaleBytes = F::kScaleBytes;
  const int KT = W.K / kBK, NB = W.N / 128;
  uint32_t slot = 0, phase = 0;
  wsp::for_items<kCluster, F::kRowsCta>(W, rank, [&](int4 tile, int n0) {
    const int width = wsp::tile_width<kMaxTokens>(tile.z), half = width / 2;
    const CUtensorMap* map = &W.act[half / 8 - 1];
    const uint32_t tx = static_cast<uint32_t>(kWBytes + width * kBK);  // both halves land here
    // Token p + 128 t's scale row (tokens past the tile or R: zero) and the scale rows of weight
    // blocks n0 / 128 and, with two, the next (past N: the first again, never used).
    const int rb = n0 / 128;
    const float* as_row[kT];
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      const int q = p + 128 * t;
      as_row[t] = q < width && tile.y + q < W.R ? W.a_scale + static_cast<int64_t>(tile.y + q) * KT : nullptr;
    }
    const float* ws_row = W.w_scale + (static_cast<int64_t>(tile.x) * NB + rb) * KT;
    const int next_block = rb + 1 < NB ? KT : 0;
    // d[t]: token p + 128 t's scale; d[kT + b]: weight block rb + b's.
    auto scales = [&](int kt, float (&d)[kT + kB]) {
      const int k = min(kt, KT - 1);  // past the end: a repeat, never stored
#pragma unroll
      for (int t = 0; t < kT; ++t) d[t] = as_row[t] != nullptr ? __ldg(as_row[t] + k) : 0.0f;
#pragma unroll
      for (int b = 0; b < kB; ++b) d[kT + b] = __ldg(ws_row + b * next_block + k);
    };
    float ring[kScaleAhead][kT + kB];
#pragma unroll
    for (int j = 0; j < kScaleAhead; ++j) scales(j, ring[j]);
    auto stage = [&](int kt, auto ring_slot) {
      constexpr int J = decltype(ring_slot)::value;
      const uint32_t full = bar_full + 8 * slot, act_s = act0 + slot * kActBytes, sc_s = sc0 + slot * kScaleBytes;
      mbar_wait(bar_empty + 8 * slot, phase ^ 1u);
      if (p == 0) {
        mbar_arrive_expect_tx(full, tx);
        wsp::load_stage<kCluster>(w0 + slot * kWBytes, &W.w, act_s, map, kt * kBK, n0, tile, half, kBK, rank, full);
      }
#pragma unroll
      for (int b = 0; b < kB; ++b)
#pragma unroll
        for (int t = 0; t < kT; ++t)
          sts32(sc_s + b * F::kBlockScaleBytes + (p + 128 * t) * 4, ring[J][t] * ring[J][kT + b]);
      mbar_arrive(full);  // release: the scales above are visible to the waiters
      scales(kt + kScaleAhead, ring[J]);
      if (++slot == F::kStages) {
        slot = 0;
        phase ^= 1u;
      }
    };
    static_assert(kScaleAhead == 2, "the stage loop below unrolls over two register slots");
    for (int kt = 0; kt < KT; kt += 2) {
      stage(kt, std::integral_constant<int, 0>{});
      if (kt + 1 < KT) stage(kt + 1, std::integral_constant<int, 1>{});
    }
  });
}

// Chunk c's partial sum into the accumulators: tokens 32 c + 8 i + 2 t + q, weight rows g + 8 h of
// the warp; tok_s holds token 2 t's scale times the warpgroup's weight-block scale.
template <int c, int kAcc>
__device__ __forceinline__ void promote(float (&acc)[kAcc], const float (&part)[kChunk / 2], uint32_t tok_s) {
#pragma unroll
  for (int i = 0; i < kChunk / 8; ++i) {
    const float2 s = lds64(tok_s + (c * kChunk + 8 * i) * 4);
    const float s0 = s.x, s1 = s.y;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      acc[c * kChunk / 2 + 4 * i + 2 * h] = fmaf(part[4 * i + 2 * h], s0, acc[c * kChunk / 2 + 4 * i + 2 * h]);
      acc[c * kChunk / 2 + 4 * i + 2 * h + 1] = fmaf(part[4 * i + 2 * h + 1], s1, acc[c * kChunk / 2 + 4 * i + 2 * h + 1]);
    }
  }
}

// A consumer warpgroup's part of one item with kCh chunks: per stage, the warp's four k32 A
// fragments by ldmatrix, then per chunk four MMAs into a partial buffer, scaled into the
// accumulators while the next chunk's MMAs run.
template <int kMaxTokens, int kCh, int kCluster>
__device__ __forceinline__ void consume(int KT, uint32_t w_t, uint32_t x, uint32_t act0, uint32_t tok_t,
                                        uint32_t bar_full, uint32_t bar_empty, uint32_t& slot, uint32_t& phase,
                                        float (&acc)[kMaxTokens / 2], int lane, int rank) {
  using F = Form<kMaxTokens>;
#pragma unroll
  for (int i = 0; i < kCh * kChunk / 2; ++i) acc[i] = 0.0f;
  uint32_t frag[4][4];
  float part[2][kChunk / 2];
  for (int kt = 0; kt < KT; ++kt) {
    mbar_wait(bar_full + 8 * slot, phase);
    const uint32_t w_s = w_t + slot * F::kWBytes, dlo = smem_desc_lo(act0 + slot * F::kActBytes);
    const uint32_t sc = slot * F::kScaleBytes;
    // k32 step j's 32 bytes are 16-byte chunks 2 j and 2 j + 1 of the row (chunk ch at
    // ch ^ row % 8 in the 128-byte swizzle): the lane's chunk 2 j + (lane >> 4) is at x ^ 32 j.
#pragma unroll
    for (int j = 0; j < 4; ++j) ldmatrix_x4(frag[j], w_s + (x ^ (32u * j)));
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) fence_reg(frag[j][r]);
    wsp::static_for<kCh>([&](auto cc) {
        constexpr int C = decltype(cc)::value;
#pragma unroll
        for (int i = 0; i < kChunk / 2; ++i) fence_reg(part[C & 1][i]);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j)
          MmaE4m3<kChunk>::run(part[C & 1], frag[j], smem_desc(dlo + C * (kChunk * kBK / 16) + 2 * j), j > 0);
        wgmma_commit();
        if constexpr (C > 0) {
          wgmma_wait<1>();  // chunk C - 1's MMAs are done
#pragma unroll
          for (int i = 0; i < kChunk / 2; ++i) fence_reg(part[(C - 1) & 1][i]);
          promote<C - 1>(acc, part[(C - 1) & 1], tok_t + sc);
        }
    });
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kChunk / 2; ++i) fence_reg(part[(kCh - 1) & 1][i]);
    promote<kCh - 1>(acc, part[(kCh - 1) & 1], tok_t + sc);
    release<kCluster>(bar_empty + 8 * slot, lane, rank);  // its codes and scales are read
    if (++slot == F::kStages) {
      slot = 0;
      phase ^= 1u;
    }
  }
}

// Grid: a multiple of kCluster CTAs, at most one per SM; cluster c takes items c, c + clusters, ..
template <int kMaxTokens, int kCluster>
__global__ void __launch_bounds__(Form<kMaxTokens>::kThreads, 1)
    gemm8_wsp_kernel(const __grid_constant__ Fp8WspParams<kMaxTokens> W) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using F = Form<kMaxTokens>;
  constexpr int kGroups = F::kGroups, kRowsCta = F::kRowsCta, kStages = F::kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[kStages], empty[kStages]
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle's 1024-byte atoms
  const uint32_t w0 = base, act0 = w0 + kStages * F::kWBytes, sc0 = act0 + kStages * F::kActBytes;
  uint8_t* staging = smem_raw + (base - smem_addr(smem_raw)) + F::kRingBytes;
  const uint32_t bar_full = smem_addr(&bars[0]), bar_empty = smem_addr(&bars[kStages]);
  const int tid = static_cast<int>(threadIdx.x);
  const int rank = kCluster == 2 ? static_cast<int>(cluster_rank()) : 0;
  // Full: the expect-tx arrival and the 128 scale writers.
  wsp::init_ring<kCluster, kStages, kGroups>(bar_full, bar_empty, 1 + 128);
  if (tid >= 128 * kGroups) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(F::kProducerRegs));
    produce<kMaxTokens, kCluster>(W, w0, act0, sc0, bar_full, bar_empty, rank, tid - 128 * kGroups);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(F::kConsumerRegs));
    const int KT = W.K / kBK;
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    // The lane's ldmatrix row and swizzled offset of step 0 (as in the bf16 kernel) and its first
    // token scale's offset in a scale slot (token 2 t), opaque to ptxas so that they stay in registers.
    const int row = wg * 64 + warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    uint32_t w_t = w0 + row * kBK;
    uint32_t x = static_cast<uint32_t>(((lane >> 4) ^ (lane & 7)) << 4);
    uint32_t tok_t = sc0 + (lane & 3) * 8;
    asm volatile("" : "+r"(w_t), "+r"(x), "+r"(tok_t));
    uint32_t slot = 0, phase = 0;
    float acc[kMaxTokens / 2];
    wsp::for_items<kCluster, kRowsCta>(W, rank, [&](int4 tile, int n0) {
      // This warpgroup's scales in a slot: those of block (n0 + 64 wg) / 128, the first or (192-row
      // CTAs) second of the CTA's.
      const uint32_t blk_t =
          tok_t + F::kBlockScaleBytes * static_cast<uint32_t>(((n0 + 64 * wg) >> 7) - (n0 >> 7));
      wsp::by_chunks<kMaxTokens>(wsp::tile_width<kMaxTokens>(tile.z) / kChunk, [&](auto chunks) {
        constexpr int kCh = decltype(chunks)::value;
        wsp::group_item<kCh * kChunk, kCluster, kStages>(
            W, tile, n0 + wg * 64, KT, bar_full, bar_empty, slot, phase, acc, staging, tid, rank, [&](auto& a) {
              consume<kMaxTokens, kCh, kCluster>(KT, w_t, x, act0, blk_t, bar_full, bar_empty, slot, phase, a, lane,
                                                 rank);
            });
      });
    });
  }
  // No CTA of a cluster leaves while its peer may still arrive on its barriers.
  if constexpr (kCluster == 2) cluster_sync();
#else
  __trap();
#endif
}

// One launch of the form with tiles of up to kMaxTokens tokens; an error message, or empty.
template <int kMaxTokens>
std::string run_form(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream, int cluster) {
  using F = Form<kMaxTokens>;
  Fp8WspParams<kMaxTokens> W{};
  W.a_scale = g.a_scale;
  W.w_scale = g.w_scale;
  W.R = static_cast<int>(g.R);
  std::string e = wsp::tensor_maps(W, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, g, kBK, F::kRowsCta);  // e4m3 codes as bytes
  if (e.empty())
    e = wsp::run(g, W, F::kRowsCta, kMaxTokens, gemm8_wsp_kernel<kMaxTokens, 1>, gemm8_wsp_kernel<kMaxTokens, 2>,
                 cluster, F::kThreads, F::kSmem, dev, stream, "gemm8_wsp_kernel");
  return e;
}

}  // namespace

std::string run_fp8_wsp(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream, int cluster,
                        int max_tokens) {
  if (g.K % kBK != 0 || g.N % 128 != 0) return "K and N must be multiples of 128";
  if (max_tokens != 128 && max_tokens != 256) return "the persistent fp8 kernel takes tiles of 128 or 256 tokens";
  const std::string e =
      max_tokens == 256 ? run_form<256>(g, dev, stream, cluster) : run_form<128>(g, dev, stream, cluster);
  if (!e.empty()) return e;
  g_fp8_wsp_launches.fetch_add(1, std::memory_order_relaxed);
  return std::string();
}

}  // namespace prefill
}  // namespace hj

// Launches of the persistent fp8 kernel so far in this process (for tests, through ctypes).
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillFp8WspLaunches() {
  return hj::prefill::g_fp8_wsp_launches.load(std::memory_order_relaxed);
}
