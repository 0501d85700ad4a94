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
//  * One CTA per SM, persistent over the work items (tile x block of 256 weight rows) by a static
//    stride: four consumer warpgroups and a producer warpgroup (setmaxnreg 24 / 120 from the
//    launch's 96), a ring of kStages stages, each warpgroup's epilogue through its own staging
//    buffer and named barrier.
//  * kCluster = 2: two CTAs of a cluster take neighbouring blocks of weight rows of the same tile
//    and load half of its tokens each, multicast to both, which halves the tokens' L2 traffic (the
//    CUTLASS kind's 1 x 2 cluster does the same for its A tile). A consumer warp releases a slot
//    in both CTAs' empty barriers: a peer's multicast writes into this CTA's slot.
// K tails: the TMA fills columns past K with zeros on both operands, so K needs only 16-byte rows.
// Rounding: acc (float32 over k) + bias, one rounding to bf16, the contract's order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "gemm_decode_sm90.cuh"
#include "gemm_prefill_sm90.h"
#include "mbarrier_sm90.cuh"
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

constexpr int kBK = 64;                           // k per stage: one 128-byte swizzle row of bf16
constexpr int kGroups = 4;                        // consumer warpgroups
constexpr int kThreads = (kGroups + 1) * 128;     // + the producer warpgroup
constexpr int kRowsCta = 64 * kGroups;            // weight rows (output columns) per CTA
constexpr int kMaxTokens = 128;                   // token rows per tile
constexpr int kChunk = 32;                        // tokens per MMA (wgmma's N)
constexpr int kWBytes = kRowsCta * kBK * 2;       // a stage's weights (32 KB: one TMA box)
constexpr int kActBytes = kMaxTokens * kBK * 2;   // a stage's tokens (16 KB)
constexpr int kStages = 4;
constexpr int kPassTokens = 32;                   // tokens per epilogue pass
constexpr int kStageRow = 64 * 2 + 16;            // a warpgroup's staging row (bytes)
constexpr int kStagingBytes = kPassTokens * kStageRow;
constexpr int kRingBytes = kStages * (kWBytes + kActBytes);
constexpr int kSmem = kRingBytes + kGroups * kStagingBytes + 1024;  // + the 1024-byte alignment
// setmaxnreg from the launch's 96 (640 threads): 32 x 128 + 120 x 512 = 64 K.
constexpr int kProducerRegs = 32, kConsumerRegs = 120;
constexpr int kActMaps = kMaxTokens / 16;  // half-tile boxes of 8, 16, .., 64 rows
static_assert(kMaxTokens % kChunk == 0 && kChunk % 16 == 0 && kChunk <= 64, "chunks");
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kGroups <= 65536, "register budget");
static_assert(kSmem <= 227 * 1024 - 256, "shared memory");

// gemm16_wsp_kernel launches by this process (HjPrefillBf16WspLaunches): lets the GPU tests prove
// that a call took this kernel rather than the CUTLASS kind.
std::atomic<uint64_t> g_wsp_launches{0};

struct WspParams {
  CUtensorMap w;                  // [E, N, K] bf16, boxes of 64 k x 256 rows x 1
  CUtensorMap act[kActMaps];      // [R, K] bf16, boxes of 64 k x 8 (i + 1) rows: half a tile of 16 (i + 1)
  const float* bias;              // [E, N] or nullptr
  __nv_bfloat16* c;               // [R, N]
  const int4* tiles;              // (expert, first row, rows, 0)
  const int* count;               // tiles in the list
  int N, K;
};

// A tile's width: its rows rounded up to a whole chunk.
__device__ __forceinline__ int tile_width(int rows) { return min((rows + kChunk - 1) / kChunk * kChunk, kMaxTokens); }

// The producer (one thread): for each of this cluster's items, its KT stages into the ring; slot
// and phase run on across items. Each stage: the CTA's 256 weight rows (one box), and half of the
// tile's tokens (row0 + rank * width / 2), multicast to both CTAs of a cluster of two; a CTA alone
// loads both halves.
template <int kCluster>
__device__ __forceinline__ void produce(const WspParams& W, uint32_t w0, uint32_t act0, uint32_t bar_full,
                                        uint32_t bar_empty, int rank) {
  const int KT = (W.K + kBK - 1) / kBK;
  const int nb = (W.N + kRowsCta - 1) / kRowsCta, pairs = (nb + kCluster - 1) / kCluster;
  const int items = __ldg(W.count) * pairs, clusters = static_cast<int>(gridDim.x) / kCluster;
  uint32_t slot = 0, phase = 0;
  for (int i = static_cast<int>(blockIdx.x) / kCluster; i < items; i += clusters) {
    const int4 tile = W.tiles[i / pairs];
    const int n0 = ((i % pairs) * kCluster + rank) * kRowsCta;
    const int width = tile_width(tile.z), half = width / 2;
    const CUtensorMap* map = &W.act[half / 8 - 1];
    const uint32_t tx = static_cast<uint32_t>(kWBytes + width * kBK * 2);  // both halves land here
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t full = bar_full + 8 * slot, act_s = act0 + slot * kActBytes;
      mbar_wait(bar_empty + 8 * slot, phase ^ 1u);
      mbar_arrive_expect_tx(full, tx);
      tma_load_3d(w0 + slot * kWBytes, &W.w, kt * kBK, n0, tile.x, full);
      if constexpr (kCluster == 2) {
        tma_load_3d_multicast(act_s + rank * half * (kBK * 2), map, kt * kBK, tile.y + rank * half, 0, full, 0x3);
      } else {
        tma_load_3d(act_s, map, kt * kBK, tile.y, 0, full);
        tma_load_3d(act_s + half * (kBK * 2), map, kt * kBK, tile.y + half, 0, full);
      }
      if (++slot == kStages) {
        slot = 0;
        phase ^= 1u;
      }
    }
  }
}

// A slot's release by a consumer warp (its lanes' ldmatrix and MMA reads done): in this CTA's empty
// barrier and, in a cluster, in the peer's, whose producer multicasts into this CTA's slot.
template <int kCluster>
__device__ __forceinline__ void release(uint32_t bar, int lane, int rank) {
  if (lane == 0) {
    mbar_arrive(bar);
    if constexpr (kCluster == 2) mbar_arrive_cluster(bar, static_cast<uint32_t>(rank ^ 1));
  }
}

// A consumer warpgroup's part of one item (weight rows [64 wg, + 64) of the CTA's) with kCh chunks
// of kChunk tokens: per stage and k16 step, the warp's 16 x 16 weight fragment by ldmatrix (double
// buffered across steps: step j + 1's load overlaps step j's MMAs), then the kCh MMAs.
template <int kCh, int kCluster>
__device__ __forceinline__ void consume(int KT, uint32_t w_t, uint32_t x, uint32_t act0,
                                        uint32_t bar_full, uint32_t bar_empty, uint32_t& slot, uint32_t& phase,
                                        float (&acc)[kMaxTokens / 2], int lane, int rank) {
  uint32_t frag[2][4];
  uint32_t prev = 0;
  for (int kt = 0; kt < KT; ++kt) {
    mbar_wait(bar_full + 8 * slot, phase);
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
#pragma unroll
      for (int c = 0; c < kCh; ++c)
        Mma<kChunk>::run(reinterpret_cast<float(&)[kChunk / 2]>(acc[c * kChunk / 2]), frag[B],
                         smem_desc(dlo + c * (kChunk * kBK * 2 / 16) + 2 * j), kt > 0 || j > 0);
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

// A warpgroup's epilogue: acc[4 i + 2 h + q] is weight row n0 + warp * 16 + g + 8 h, token
// 8 i + 2 t + q of the tile; plus the expert's bias (kBias), rounded to bf16 in pairs of tokens,
// staged kPassTokens tokens at a time by transposing stmatrix (each token's 64 rows become one
// staging row) and stored as 16-byte row chunks: thread tid stores chunk tid % 8 of tokens
// tid / 8 + 16 k. sync() is the warpgroup's named barrier.
template <int kWidth, bool kBias, typename Sync>
__device__ __forceinline__ void store(const WspParams& W, const float (&acc)[kMaxTokens / 2], int e, int row0, int rows,
                                      int n0, uint8_t* staging, int tid, Sync sync) {
  const int N = W.N;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2;
  float b[2] = {0.0f, 0.0f};
  if constexpr (kBias) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n0 + warp * 16 + g + 8 * h;
      if (n < N) b[h] = __ldg(W.bias + static_cast<int64_t>(e) * N + n);
    }
  }
  // Matrix m = lane >> 3 of an x4 store: token block m >> 1 of the pair, row half m & 1; the lane
  // addresses its token (lane & 7) of it.
  const int m = lane >> 3;
  const uint32_t lane_row = smem_addr(staging) + ((m >> 1) * 8 + (lane & 7)) * kStageRow + (warp * 16 + 8 * (m & 1)) * 2;
  constexpr int kRowsPerStore = 128 / 8;  // tokens one pass of the warpgroup's 16-byte stores covers
  const int cc = tid & 7, tok0 = tid >> 3;
  const bool col_ok = n0 + cc * 8 < N;
  __nv_bfloat16* out = W.c + static_cast<int64_t>(row0 + tok0) * N + n0 + cc * 8;
  const int64_t step = static_cast<int64_t>(kRowsPerStore) * N;
  const uint8_t* from = staging + tok0 * kStageRow + cc * 16;
#pragma unroll
  for (int pass = 0; pass < (kWidth + kPassTokens - 1) / kPassTokens; ++pass) {
    sync();  // the previous pass's reads are done
#pragma unroll
    for (int s = 0; s < kPassTokens / 16; ++s) {
      uint32_t r[4];
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const int i = pass * (kPassTokens / 8) + 2 * s + (mm >> 1), h = mm & 1;
        const float lo = acc[4 * i + 2 * h], hi = acc[4 * i + 2 * h + 1];
        const __nv_bfloat162 v = kBias ? __floats2bfloat162_rn(lo + b[h], hi + b[h]) : __floats2bfloat162_rn(lo, hi);
        r[mm] = *reinterpret_cast<const uint32_t*>(&v);
      }
      stmatrix_x4_trans(lane_row + s * 16 * kStageRow, r);
    }
    sync();
#pragma unroll
    for (int k = 0; k < kPassTokens / kRowsPerStore; ++k) {
      if (pass * kPassTokens + k * kRowsPerStore + tok0 < rows && col_ok)
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(from + k * kRowsPerStore * kStageRow);
      out += step;
    }
  }
}

template <int kCh, int kCluster>
__device__ __forceinline__ void item(const WspParams& W, int KT, int4 tile, int n0, uint32_t w_t, uint32_t x,
                                     uint32_t act0, uint32_t bar_full, uint32_t bar_empty,
                                     uint32_t& slot, uint32_t& phase, float (&acc)[kMaxTokens / 2], uint8_t* staging,
                                     int tid, int rank) {
  consume<kCh, kCluster>(KT, w_t, x, act0, bar_full, bar_empty, slot, phase, acc, tid & 31, rank);
  const int wg = tid >> 7, bar_id = 1 + wg;
  auto sync = [bar_id] { asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory"); };
  uint8_t* mine = staging + wg * kStagingBytes;
  if (W.bias != nullptr)
    store<kCh * kChunk, true>(W, acc, tile.x, tile.y, tile.z, n0 + wg * 64, mine, tid & 127, sync);
  else
    store<kCh * kChunk, false>(W, acc, tile.x, tile.y, tile.z, n0 + wg * 64, mine, tid & 127, sync);
}

// f(std::integral_constant<int, n>) for the item's chunk count n (1 .. kMaxTokens / kChunk).
template <int kCh = 1, typename F>
__device__ __forceinline__ void by_chunks(int chunks, F&& f) {
  if constexpr (kCh < kMaxTokens / kChunk) {
    if (chunks > kCh) {
      by_chunks<kCh + 1>(chunks, f);
      return;
    }
  }
  f(std::integral_constant<int, kCh>{});
}

// Grid: a multiple of kCluster CTAs, at most one per SM; cluster c takes items c, c + clusters, ..
template <int kCluster>
__global__ void __launch_bounds__(kThreads, 1) gemm16_wsp_kernel(const __grid_constant__ WspParams W) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[kStages], empty[kStages]
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle's 1024-byte atoms
  const uint32_t w0 = base, act0 = base + kStages * kWBytes;
  uint8_t* staging = smem_raw + (base - smem_addr(smem_raw)) + kRingBytes;
  const uint32_t bar_full = smem_addr(&bars[0]), bar_empty = smem_addr(&bars[kStages]);
  const int tid = static_cast<int>(threadIdx.x);
  const int rank = kCluster == 2 ? static_cast<int>(cluster_rank()) : 0;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, 1);                          // the producer's expect-tx arrival
      mbar_init(bar_empty + 8 * s, kGroups * 4 * kCluster);    // each consumer warp of each CTA
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The peer's barriers are initialized before any multicast or remote arrival reaches them.
  if constexpr (kCluster == 2)
    cluster_sync();
  else
    __syncthreads();
  if (tid >= 128 * kGroups) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid == 128 * kGroups) produce<kCluster>(W, w0, act0, bar_full, bar_empty, rank);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const int KT = (W.K + kBK - 1) / kBK;
    const int nb = (W.N + kRowsCta - 1) / kRowsCta, pairs = (nb + kCluster - 1) / kCluster;
    const int items = __ldg(W.count) * pairs, clusters = static_cast<int>(gridDim.x) / kCluster;
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    // The lane's ldmatrix row (row (lane & 7) + 8 ((lane >> 3) & 1) of the warp's 16) and its
    // swizzled offset of k16 step 0 (chunk lane >> 4), opaque to ptxas so that they stay in
    // registers across stages.
    const int row = wg * 64 + warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    uint32_t w_t = w0 + row * (kBK * 2);
    uint32_t x = static_cast<uint32_t>(((lane >> 4) ^ (lane & 7)) << 4);
    asm volatile("" : "+r"(w_t), "+r"(x));
    uint32_t slot = 0, phase = 0;
    float acc[kMaxTokens / 2];
    for (int i = static_cast<int>(blockIdx.x) / kCluster; i < items; i += clusters) {
      const int4 tile = W.tiles[i / pairs];
      const int n0 = ((i % pairs) * kCluster + rank) * kRowsCta;
      // One width (kChunk) on one accumulator array: the item's chunk count only picks how many
      // of its parts the MMAs cover.
      by_chunks(tile_width(tile.z) / kChunk, [&](auto chunks) {
        item<decltype(chunks)::value, kCluster>(W, KT, tile, n0, w_t, x, act0, bar_full, bar_empty, slot, phase, acc,
                                                staging, tid, rank);
      });
    }
  }
  // No CTA of a cluster leaves while its peer may still arrive on its barriers.
  if constexpr (kCluster == 2) cluster_sync();
#else
  __trap();
#endif
}

// The tensor maps of a launch; an error message, or empty.
std::string tensor_maps(WspParams& W, const void* w, int64_t E, int64_t N, int64_t K, const void* act, int64_t R) {
  if (tensor_map_encoder() == nullptr) return "cuTensorMapEncodeTiled is not available";
  if (!encode_rows_3d(&W.w, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, K, N, E, kBK, kRowsCta, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B))
    return "cuTensorMapEncodeTiled failed for the weights";
  for (int i = 0; i < kActMaps; ++i)
    if (!encode_rows_3d(&W.act[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, act, K, R, 1, kBK, 8 * (i + 1),
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B))
      return "cuTensorMapEncodeTiled failed for the activations";
  return std::string();
}

// The workspace from its (128-byte aligned) base: the tile count (128 bytes), then the tile list:
// ceil(rows / 128) tiles an expert, at most R / 128 + E of them.
size_t list_entries(int64_t R, int64_t E) { return static_cast<size_t>(R / kMaxTokens + E + 1); }

// Co-resident clusters of two of the kernel on this device (a GPC's SMs pair up; the count can be
// below SMs / 2), asked once per device.
int max_clusters(int device, int sm_count) {
  static std::mutex mu;
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (cached[device] == 0) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(sm_count / 2 * 2));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = kSmem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, gemm16_wsp_kernel<2>, &cfg) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      return 0;
    }
    cached[device] = n;
  }
  return cached[device];
}

}  // namespace

size_t bf16_wsp_workspace_bytes(int64_t R, int64_t E) {
  // The count, the list, and the slack run_grouped spends on aligning the base.
  return 128 + 128 + list_entries(R, E) * 16;
}

std::string run_bf16_wsp(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream, int cluster) {
  if (cluster != 1 && cluster != 2) return "cluster size must be 1 or 2";
  if (g.workspace_bytes < 128 + list_entries(g.R, g.E) * 16) return "workspace too small for the tile list";
  uint8_t* ws = static_cast<uint8_t*>(g.workspace);
  int* count = reinterpret_cast<int*>(ws);
  int4* tiles = reinterpret_cast<int4*>(ws + 128);
  WspParams W{};
  {
    const std::string e = tensor_maps(W, g.w, g.E, g.N, g.K, g.a, g.R);
    if (!e.empty()) return e;
  }
  W.bias = g.bias;
  W.c = static_cast<__nv_bfloat16*>(g.c);
  W.tiles = tiles;
  W.count = count;
  W.N = static_cast<int>(g.N);
  W.K = static_cast<int>(g.K);
  {
    // The list (whole chunks) and the zero rows past the last expert.
    const std::string e = launch_tile_list(g.offsets, g.E, g.R, g.N, kMaxTokens, kChunk, tiles, count, g.c,
                                           dev.sm_count, stream);
    if (!e.empty()) return e;
  }
  // The items' bound on the host (the tile count is known on the device only).
  const int64_t nb = (g.N + kRowsCta - 1) / kRowsCta, pairs = (nb + cluster - 1) / cluster;
  const int64_t items = static_cast<int64_t>(list_entries(g.R, g.E)) * pairs;
  static unsigned configured[2] = {0, 0};
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cluster == 2 ? 1 : 0;  // a CTA alone: a plain launch
  cudaError_t err;
  if (cluster == 2) {
    if (!decode::raise_smem_limit_once(gemm16_wsp_kernel<2>, kSmem, true, configured[1]))
      return std::string("gemm16_wsp_kernel: ") + cudaGetErrorString(cudaGetLastError());
    const int clusters = max_clusters(dev.device, dev.sm_count);
    if (clusters <= 0) return "no cluster of two CTAs of gemm16_wsp_kernel fits on this device";
    cfg.gridDim = dim3(static_cast<unsigned>(2 * std::min<int64_t>(clusters, items)));
    err = cudaLaunchKernelEx(&cfg, gemm16_wsp_kernel<2>, W);
  } else {
    if (!decode::raise_smem_limit_once(gemm16_wsp_kernel<1>, kSmem, true, configured[0]))
      return std::string("gemm16_wsp_kernel: ") + cudaGetErrorString(cudaGetLastError());
    cfg.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(dev.sm_count, items)));
    err = cudaLaunchKernelEx(&cfg, gemm16_wsp_kernel<1>, W);
  }
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("gemm16_wsp_kernel: ") + cudaGetErrorString(err);
  g_wsp_launches.fetch_add(1, std::memory_order_relaxed);
  return std::string();
}

}  // namespace prefill
}  // namespace hj

// Launches of the persistent bf16 kernel so far in this process (for tests, through ctypes).
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillBf16WspLaunches() {
  return hj::prefill::g_wsp_launches.load(std::memory_order_relaxed);
}
