// Kind::kBf16Wsp (gemm_prefill_sm90.h): the bf16 grouped GEMM on our own persistent sm_90a kernel,
// taken for unquantized bf16 weights where HUMMING_JAX_PREFILL_BF16_WSP selects it (A/B against
// the CUTLASS ptr-array kind, Kind::kBf16). What it changes against that kind:
//
//  * Token granularity. Operands are swapped as in the 4-bit mainloop: 64 weight rows per consumer
//    warpgroup are wgmma's A operand (ldmatrix from shared memory into registers), a tile of at
//    most 128 token rows is the B operand in shared memory, issued as kChunk-token MMAs. Each
//    expert's rows are split into ceil(rows / 128) tiles of whole chunks but the last (tile_list.cuh),
//    so an expert costs its rows rounded up to one chunk. The CUTLASS kind's 128-row tiles cost whole
//    128s: at 128 +- 11 rows per expert (gpt-oss-120b, M = 4096, uniform routing) a third of its MMA
//    work is padding (ours: a tenth), at 256 +- 16 (qwen3-30b-a3b) a fifth (ours: 6%).
//  * No tensor-map update between experts: the weights are one 3-D map [E, N, K], the tokens one
//    map over all R rows. A tile's box reads past its expert's rows into the next expert's (or
//    zeros past R); those columns of the accumulators are never stored.
//  * One CTA per SM, persistent over the work items (tile x block of weight rows) by a static
//    stride, a ring of kStages stages, each warpgroup's epilogue through its own staging buffer and
//    named barrier. Two forms (Form<kMaxTokens>):
//     - tiles of up to 128 tokens: three consumer warpgroups (192 weight rows) and a producer
//       warpgroup, setmaxnreg 32 / 160 from the launch's 128;
//     - tiles of up to 256 tokens: two consumer warpgroups (128 weight rows) and a producer
//       warpgroup, setmaxnreg 40 / 232 from the launch's 168, room for 128 accumulators a thread.
//       Each MMA reads its tokens from shared memory once per 64 x 32 x 16 MACs whatever the tile,
//       but a tile of twice the tokens halves the weight fragments' ldmatrix reads per MAC, and a
//       stage's TMA writes per MAC fall from 1/64 + 1/96 to 1/128 + 1/64 bytes: shared-memory
//       traffic per MAC as the CUTLASS kind's 128 x 256 tiles (benchmarks/NOTES.md, v12).
//  * kCluster = 2: two CTAs of a cluster take neighbouring blocks of weight rows of the same tile
//    and load half of its tokens each, multicast to both, which halves the tokens' L2 traffic (the
//    CUTLASS kind's 1 x 2 cluster does the same for its A tile). A consumer warp releases a slot
//    in both CTAs' empty barriers: a peer's multicast writes into this CTA's slot.
//  * Gathered tokens (GroupedArgs::gather): row r of the problem is token row gather[r] / div of x,
//    so GEMM1 reads the routed tokens where they are instead of a permuted copy (R x K written and
//    read again). The whole producer warpgroup then loads a stage's token rows by 16-byte cp.async
//    into the 128-byte swizzle's positions (a pair of threads per row, its source row looked up
//    once per item), one thread the weights' box by TMA; each thread's cp.async arrival counts in
//    the full barrier's 1 + 128. The consumers fence the generic proxy's writes before their
//    wgmma reads them. No multicast: each CTA of a cluster loads its tile's rows itself. Measured
//    at ~0.6x the TMA path's rate at 256-token tiles (benchmarks/NOTES.md, v17): taken only where
//    HUMMING_JAX_PREFILL_GATHER asks for it.
//  * Gated rows (GroupedArgs::gate, gemm_grouped_gated; the 256-token form): the kernel writes
//    y [R, N / 2] = act(gate, up) of its rounded rows instead of c (wsp::store_gated): each
//    consumer warpgroup holds the gate and the up rows of its 32 output columns, stages them and
//    writes their activation alone. In the halves layout (gate row i, up row N / 2 + i) the CTA's
//    block b loads gate rows 64 b + [0, 64) and up rows N / 2 + 64 b + [0, 64) as two boxes, and
//    warpgroup g reads gate rows 32 g + [0, 32) and up rows 32 g + [0, 32) of them; interleaved
//    (swigluoai: rows 2i, 2i + 1) its 128 rows as usual, 64 a warpgroup. The activation call's
//    pass over c (R x N read, R x N / 2 written) and c's own writes go away.
// K tails: the TMA fills columns past K with zeros on both operands, so K needs only 16-byte rows.
// Rounding: acc (float32 over k) + bias, one rounding to bf16, the contract's order.
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

constexpr int kBK = 64;  // k per stage: one 128-byte swizzle row of bf16
constexpr int kStages = 4;

// A form of the kernel: tiles of up to kMaxTokens token rows (its warpgroups: wsp::Groups).
template <int kMaxTokens_>
struct Form : wsp::Groups<kMaxTokens_> {
  using G = wsp::Groups<kMaxTokens_>;
  static constexpr int kWBytes = G::kRowsCta * kBK * 2;      // a stage's weights (one TMA box)
  static constexpr int kActBytes = G::kMaxTokens * kBK * 2;  // a stage's tokens
  static constexpr int kRingBytes = kStages * (kWBytes + kActBytes);
  static constexpr int kSmem = kRingBytes + G::kGroups * kStagingBytes + 1024;  // + the 1024-byte alignment
  static_assert(kSmem <= 227 * 1024 - 256, "shared memory");
};

// gemm16_wsp_kernel launches by this process (HjPrefillBf16WspLaunches): lets the GPU tests prove
// that a call took this kernel rather than the CUTLASS kind.
std::atomic<uint64_t> g_wsp_launches{0};
// ... of which with gathered tokens (HjPrefillGatherLaunches).
std::atomic<uint64_t> g_gather_launches{0};
// ... of which wrote the gated rows (HjPrefillGatedLaunches).
std::atomic<uint64_t> g_gated_launches{0};

// kGate: 0, the kernel writes c; 1 or 2, the gated rows y = act(gate, up) of c's values instead
// (wsp::store_gated; 1: the halves layout, 2: interleaved). A type of its own per kGate, so that each
// kernel keeps its own launch statics (wsp::launch).
template <int kMaxTokens, int kGate = 0>
struct WspParams {
  CUtensorMap w;  // [E, N, K] bf16, boxes of 64 k x kRowsCta rows x 1 (kGate 1: x 64 rows)
  // [R, K] bf16, boxes of 64 k x 8 (i + 1) rows: half a tile of 16 (i + 1)
  CUtensorMap act[Form<kMaxTokens>::kActMaps];
  const float* bias;  // [E, N] or nullptr
  __nv_bfloat16* c;   // [R, N]; kGate: y [R, N / 2]
  int4* tiles;        // (expert, first row, rows, 0)
  int* count;         // tiles in the list
  int N, K;
  int group;  // tiles per group of the work items' order (wsp::for_items)
  // Gathered tokens: row r's tokens are x's row gather[r] / div (an id outside [0, R): zeros);
  // x == nullptr: the act maps over the problem's rows.
  const __nv_bfloat16* x;
  const int32_t* gather;
  int div, R;
  int gate_act;  // kGate: the Activation code
  float gate_limit;
};

constexpr int kGatherThreads = 128;  // the producer warpgroup

// The producer (one thread): for each of this cluster's items, its KT stages into the ring; slot
// and phase run on across items. Each stage: the CTA's kRowsCta weight rows (one box), and half of
// the tile's tokens (row0 + rank * width / 2), multicast to both CTAs of a cluster of two; a CTA
// alone loads both halves.
// kGate 1 (halves): the CTA's block of 128 rows at n0 is the gate rows n0 / 2 + [0, 64) and the
// up rows N / 2 + n0 / 2 + [0, 64), two boxes (the items' blocks still count N / 128).
template <int kMaxTokens, int kCluster, int kGate>
__device__ __forceinline__ void produce(const WspParams<kMaxTokens, kGate>& W, uint32_t w0, uint32_t act0,
                                        uint32_t bar_full, uint32_t bar_empty, int rank) {
  using F = Form<kMaxTokens>;
  constexpr int kWBytes = F::kWBytes, kActBytes = F::kActBytes;
  const int KT = (W.K + kBK - 1) / kBK;
  uint32_t slot = 0, phase = 0;
  wsp::for_items<kCluster, F::kRowsCta>(W, rank, [&](int4 tile, int n0) {
    const int width = wsp::tile_width<kMaxTokens>(tile.z), half = width / 2;
    const CUtensorMap* map = &W.act[half / 8 - 1];
    const uint32_t tx = static_cast<uint32_t>(kWBytes + width * kBK * 2);  // both halves land here
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t full = bar_full + 8 * slot, act_s = act0 + slot * kActBytes;
      mbar_wait(bar_empty + 8 * slot, phase ^ 1u);
      mbar_arrive_expect_tx(full, tx);
      if constexpr (kGate == 1) {
        const uint32_t w_s = w0 + slot * kWBytes;
        tma_load_3d(w_s, &W.w, kt * kBK, n0 / 2, tile.x, full);
        tma_load_3d(w_s + kWBytes / 2, &W.w, kt * kBK, W.N / 2 + n0 / 2, tile.x, full);
        wsp::load_tokens<kCluster>(act_s, map, kt * kBK, tile, half, kBK * 2, rank, full);
      } else {
        wsp::load_stage<kCluster>(w0 + slot * kWBytes, &W.w, act_s, map, kt * kBK, n0, tile, half, kBK * 2, rank,
                                  full);
      }
      if (++slot == kStages) {
        slot = 0;
        phase ^= 1u;
      }
    }
  });
}

// The producer warpgroup (pt: its thread, 0 .. 127) with gathered tokens. Thread pt takes half
// pt % 2 of rows pt / 2, + 64, .. of the tile: per item it looks their source rows up once (into
// registers; -1: zeros, also for rows past the tile's own, whose columns are never stored), per
// stage it copies 16-byte chunks pt % 2, + 2, + 4, + 6 of each (a pair of threads reads whole
// 32-byte sectors) to where the 128-byte swizzle puts them (chunk c of row r at c ^ r % 8), and
// arrives once its copies land; thread 0 also arms the full barrier with the weights' bytes and
// loads their box by TMA. No shared-memory lookups or barriers in the stage loop (a per-row lookup
// there, one 16-byte column of every 16th row a thread, was 6.5% slower still; v17).
template <int kMaxTokens, int kCluster, int kGate>
__device__ __forceinline__ void produce_gathered(const WspParams<kMaxTokens, kGate>& W, uint32_t w0, uint32_t act0,
                                                 uint32_t bar_full, uint32_t bar_empty, int rank, int pt) {
  using F = Form<kMaxTokens>;
  constexpr int kWBytes = F::kWBytes, kActBytes = F::kActBytes;
  constexpr int kRowStep = kGatherThreads / 2, kRows = kMaxTokens / kRowStep;  // a thread's rows
  const int KT = (W.K + kBK - 1) / kBK;
  const int half = pt & 1, q = pt >> 1;
  uint32_t slot = 0, phase = 0;
  wsp::for_items<kCluster, F::kRowsCta>(W, rank, [&](int4 tile, int n0) {
    const int width = wsp::tile_width<kMaxTokens>(tile.z);
    int src[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = q + kRowStep * i;
      const int id = r < tile.z ? __ldg(W.gather + tile.y + r) : -1;
      src[i] = id >= 0 && id < W.R ? id / W.div : -1;
    }
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t full = bar_full + 8 * slot, act_s = act0 + slot * kActBytes;
      mbar_wait(bar_empty + 8 * slot, phase ^ 1u);
      if (pt == 0) {
        mbar_arrive_expect_tx(full, static_cast<uint32_t>(kWBytes));
        tma_load_3d(w0 + slot * kWBytes, &W.w, kt * kBK, n0, tile.x, full);
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = q + kRowStep * i;
        if (r < width) {
          const __nv_bfloat16* row = W.x + static_cast<int64_t>(src[i] < 0 ? 0 : src[i]) * W.K;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int c = half + 2 * j, k = kt * kBK + c * 8;
            const bool ok = src[i] >= 0 && k < W.K;
            decode::cp_async16(act_s + r * (kBK * 2) + ((c ^ (r & 7)) << 4), ok ? row + k : W.x, ok ? 16 : 0);
          }
        }
      }
      cp_async_mbar_arrive(full);
      if (++slot == kStages) {
        slot = 0;
        phase ^= 1u;
      }
    }
  });
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no thread leaves with its copies in flight
}

// A consumer warpgroup's part of one item (weight rows [64 wg, + 64) of the CTA's) with kCh chunks
// of kChunk tokens: per stage and k16 step, the warp's 16 x 16 weight fragment by ldmatrix (double
// buffered across steps: step j + 1's load overlaps step j's MMAs), then the kCh MMAs.
template <int kMaxTokens, int kCh, int kCluster>
__device__ __forceinline__ void consume(int KT, uint32_t w_t, uint32_t x, uint32_t act0, uint32_t bar_full,
                                        uint32_t bar_empty, uint32_t& slot, uint32_t& phase,
                                        float (&acc)[kMaxTokens / 2], int lane, int rank, bool gathered) {
  constexpr int kWBytes = Form<kMaxTokens>::kWBytes, kActBytes = Form<kMaxTokens>::kActBytes;
  uint32_t frag[2][4];
  uint32_t prev = 0;
  for (int kt = 0; kt < KT; ++kt) {
    mbar_wait(bar_full + 8 * slot, phase);
    // Gathered tokens were written by cp.async (the generic proxy); the wgmma reads them through
    // the async proxy.
    if (gathered) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const uint32_t w_s = w_t + slot * kWBytes;
    const uint32_t dlo = smem_desc_lo(act0 + slot * kActBytes);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int B = j & 1;
      // Step j's 16 k are 16-byte chunks 2 j and 2 j + 1 of the row, chunk ch at (ch ^ row % 8) in
      // the 128-byte swizzle: the lane's chunk 2 j + (lane >> 4) is at x ^ 32 j.
      ldmatrix_x4(frag[B], w_s + (x ^ (32u * j)));
#pragma unroll
      for (int i = 0; i < kCh * kChunk / 2; ++i) fence_reg(acc[i]);
#pragma unroll
      for (int r = 0; r < 4; ++r) fence_reg(frag[B][r]);
      wgmma_fence();
      // The 256-token form's chunks in MMAs of up to kPer chunks (Mma<N> goes to N = 128): one or
      // two instructions a k16 step instead of kCh (the 128-token form: ptxas serializes them).
      constexpr int kPer = kMaxTokens == 256 ? 128 / kChunk : 1;
      wsp::static_for<(kCh + kPer - 1) / kPer>([&](auto q) {
        constexpr int c0 = decltype(q)::value * kPer, n = kCh - c0 < kPer ? kCh - c0 : kPer;
        Mma<n * kChunk>::run(reinterpret_cast<float(&)[n * kChunk / 2]>(acc[c0 * kChunk / 2]), frag[B],
                             smem_desc(dlo + c0 * (kChunk * kBK * 2 / 16) + 2 * j), kt > 0 || j > 0);
      });
      wgmma_commit();
      wgmma_wait<1>();  // step j - 1's MMAs are done: its fragment and, at j = 0, the previous slot are free
#pragma unroll
      for (int r = 0; r < 4; ++r) fence_reg(frag[B ^ 1][r]);
      if (j == 0 && kt > 0) release<kCluster>(bar_empty + 8 * prev, lane, rank);
    }
    prev = slot;
    if (++slot == kStages) {
      slot = 0;
      phase ^= 1u;
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kCh * kChunk / 2; ++i) fence_reg(acc[i]);
  release<kCluster>(bar_empty + 8 * prev, lane, rank);
}

// Grid: a multiple of kCluster CTAs, at most one per SM; cluster c takes items c, c + clusters, ..
template <int kMaxTokens, int kCluster, int kGate>
__global__ void __launch_bounds__(Form<kMaxTokens>::kThreads, 1)
    gemm16_wsp_kernel(const __grid_constant__ WspParams<kMaxTokens, kGate> W) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using F = Form<kMaxTokens>;
  constexpr int kGroups = F::kGroups, kRowsCta = F::kRowsCta;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[kStages], empty[kStages]
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle's 1024-byte atoms
  const uint32_t w0 = base, act0 = base + kStages * F::kWBytes;
  uint8_t* staging = smem_raw + (base - smem_addr(smem_raw)) + F::kRingBytes;
  const uint32_t bar_full = smem_addr(&bars[0]), bar_empty = smem_addr(&bars[kStages]);
  const int tid = static_cast<int>(threadIdx.x);
  const int rank = kCluster == 2 ? static_cast<int>(cluster_rank()) : 0;
  static_assert(kGate == 0 || kGroups == 2, "the gated layouts take blocks of 128 rows: two consumer warpgroups");
  const bool gathered = kGate == 0 && W.x != nullptr;
  // full: the producer's expect-tx arrival, and with gathered tokens each producer thread's cp.async one
  wsp::init_ring<kCluster, kStages, kGroups>(bar_full, bar_empty, gathered ? 1 + kGatherThreads : 1);
  if (tid >= 128 * kGroups) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(F::kProducerRegs));
    if (gathered)
      produce_gathered<kMaxTokens, kCluster>(W, w0, act0, bar_full, bar_empty, rank, tid - 128 * kGroups);
    else if (tid == 128 * kGroups)
      produce<kMaxTokens, kCluster>(W, w0, act0, bar_full, bar_empty, rank);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(F::kConsumerRegs));
    const int KT = (W.K + kBK - 1) / kBK;
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    // The lane's ldmatrix row (row (lane & 7) + 8 ((lane >> 3) & 1) of the warp's 16) and its
    // swizzled offset of k16 step 0 (chunk lane >> 4), opaque to ptxas so that they stay in
    // registers across stages.
    // The halves layout's warpgroup g reads gate rows 32 g + [0, 32) (its warps 0, 1) and up rows
    // 64 + 32 g + [0, 32) (warps 2, 3) of the stage's two boxes.
    const int mine = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    const int row = kGate == 1 ? (warp < 2 ? 0 : 32) + 32 * wg + mine : wg * 64 + mine;
    uint32_t w_t = w0 + row * (kBK * 2);
    uint32_t x = static_cast<uint32_t>(((lane >> 4) ^ (lane & 7)) << 4);
    asm volatile("" : "+r"(w_t), "+r"(x));
    uint32_t slot = 0, phase = 0;
    float acc[kMaxTokens / 2];
    wsp::for_items<kCluster, kRowsCta>(W, rank, [&](int4 tile, int n0) {
      // A warpgroup past N skips the item's mainloop (group_item; the gated ones run every item).
      // One width (kChunk) on one accumulator array: the item's chunk count only picks how many
      // of its parts the MMAs cover.
      wsp::by_chunks<kMaxTokens>(wsp::tile_width<kMaxTokens>(tile.z) / kChunk, [&](auto chunks) {
        constexpr int kCh = decltype(chunks)::value;
        if constexpr (kGate == 0) {
          wsp::group_item<kCh * kChunk, kCluster, kStages>(
              W, tile, n0 + wg * 64, KT, bar_full, bar_empty, slot, phase, acc, staging, tid, rank, [&](auto& a) {
                consume<kMaxTokens, kCh, kCluster>(KT, w_t, x, act0, bar_full, bar_empty, slot, phase, a, lane, rank,
                                                   gathered);
              });
        } else {
          // Both warpgroups run every item (rows past N are the TMA's zeros, columns past N / 2
          // never stored). Warpgroup g writes output columns j0 = n0 / 2 + 32 g + [0, 32); load_bias
          // takes weight row n0w + 16 warp + ..: in the halves layout its warps 0, 1 hold gate rows
          // j0 + [0, 32), warps 2, 3 up rows N / 2 + j0 + [0, 32).
          const int j0 = n0 / 2 + 32 * wg;
          const int n0w = kGate == 1 ? (warp < 2 ? j0 : W.N / 2 + j0 - 32) : n0 + wg * 64;
          float b[2];
          wsp::load_bias(W, tile.x, n0w, tid, b);
          consume<kMaxTokens, kCh, kCluster>(KT, w_t, x, act0, bar_full, bar_empty, slot, phase, acc, lane, rank,
                                             false);
          if (W.bias != nullptr)
            wsp::store_gated<kGate, kCh * kChunk, true>(W, acc, b, tile.y, tile.z, j0, staging, tid);
          else
            wsp::store_gated<kGate, kCh * kChunk, false>(W, acc, b, tile.y, tile.z, j0, staging, tid);
        }
      });
    });
  }
  // No CTA of a cluster leaves while its peer may still arrive on its barriers.
  if constexpr (kCluster == 2) cluster_sync();
#else
  __trap();
#endif
}

// One launch of the form with tiles of up to kMaxTokens tokens and the epilogue kGate; an error
// message, or empty.
template <int kMaxTokens, int kGate>
std::string run_form(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream, int cluster) {
  using F = Form<kMaxTokens>;
  WspParams<kMaxTokens, kGate> W{};
  if (g.gather != nullptr) {
    W.x = static_cast<const __nv_bfloat16*>(g.a);
    W.gather = g.gather;
    W.div = static_cast<int>(g.gather_div);
    W.R = static_cast<int>(g.R);
  }
  W.gate_act = g.gate.act;
  W.gate_limit = g.gate.limit;
  // Gathered tokens need no act maps (produce_gathered copies the rows itself); the halves layout
  // loads its 128 rows as two boxes of 64.
  std::string e = wsp::tensor_maps(W, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, g, kBK, kGate == 1 ? 64 : F::kRowsCta,
                                   g.gather == nullptr);
  if (e.empty())
    e = wsp::run(g, W, F::kRowsCta, kMaxTokens, gemm16_wsp_kernel<kMaxTokens, 1, kGate>,
                 gemm16_wsp_kernel<kMaxTokens, 2, kGate>, cluster, F::kThreads, F::kSmem, dev, stream,
                 "gemm16_wsp_kernel");
  return e;
}

}  // namespace

size_t wsp_workspace_bytes(int64_t R, int64_t E) { return wsp::list_workspace_bytes(R, E); }

std::string run_bf16_wsp(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream, int cluster,
                         int max_tokens) {
  if (max_tokens != 128 && max_tokens != 256) return "the persistent bf16 kernel takes tiles of 128 or 256 tokens";
  const bool gated = g.gate.y != nullptr;
  if (gated && (max_tokens != 256 || g.gather != nullptr || g.N % 16 != 0))
    return "the gated epilogue needs tiles of 256 tokens, N % 16 == 0 and token rows read by TMA";
  const bool oai = static_cast<Activation>(g.gate.act) == Activation::kSwigluOai;
  const std::string e = !gated ? (max_tokens == 256 ? run_form<256, 0>(g, dev, stream, cluster)
                                                    : run_form<128, 0>(g, dev, stream, cluster))
                        : oai  ? run_form<256, 2>(g, dev, stream, cluster)
                               : run_form<256, 1>(g, dev, stream, cluster);
  if (!e.empty()) return e;
  g_wsp_launches.fetch_add(1, std::memory_order_relaxed);
  if (g.gather != nullptr) g_gather_launches.fetch_add(1, std::memory_order_relaxed);
  if (gated) g_gated_launches.fetch_add(1, std::memory_order_relaxed);
  return std::string();
}

}  // namespace prefill
}  // namespace hj

// Launches of the persistent bf16 kernel so far in this process (for tests, through ctypes).
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillBf16WspLaunches() {
  return hj::prefill::g_wsp_launches.load(std::memory_order_relaxed);
}

// ... of which read gathered token rows (gemm_grouped_gather).
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillGatherLaunches() {
  return hj::prefill::g_gather_launches.load(std::memory_order_relaxed);
}

// ... of which wrote the gated rows of gemm_grouped_gated.
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillGatedLaunches() {
  return hj::prefill::g_gated_launches.load(std::memory_order_relaxed);
}
