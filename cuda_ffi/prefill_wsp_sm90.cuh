// The pieces shared by our persistent swapped-operand grouped GEMMs (gemm_prefill_sm90_bf16_wsp.cu,
// gemm_prefill_sm90_fp8_wsp.cu): 64 weight rows per consumer warpgroup on wgmma's A operand, a tile
// of at most kMaxTokens token rows on B (the kernel's: 128 or 256), issued as kChunk-token MMAs.
// Here: the tile widths and the
// dispatch on a tile's chunk count; the ring's barriers and a consumer warp's release of a slot (in
// both CTAs of a cluster); the work items' loop; a warpgroup's item past N; the bias and the
// epilogue of a warpgroup's rows; and the launch (tile list, then the kernel on clusters of one or
// two CTAs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "gemm_decode_sm90.cuh"
#include "gemm_prefill_sm90.h"
#include "mbarrier_sm90.cuh"
#include "tensor_map.h"
#include "tile_list.cuh"
#include "wgmma_sm90.cuh"

namespace hj {
namespace prefill {
namespace wsp {

constexpr int kChunk = 32;                             // tokens per MMA (wgmma's N)
constexpr int kMinTileTokens = 128;                    // the narrowest kernel's kMaxTokens
constexpr int kPassTokens = 32;                        // tokens per epilogue pass
constexpr int kStageRow = 64 * 2 + 16;                 // a warpgroup's staging row (bytes)
constexpr int kStagingBytes = kPassTokens * kStageRow;  // a warpgroup's staging buffer
static_assert(kChunk % 16 == 0 && kChunk <= 64, "chunks");

// A kernel's activation tensor maps for tiles of up to kMaxTokens rows: half-tile boxes of 8, 16,
// .., kMaxTokens / 2 rows.
template <int kMaxTokens>
constexpr int act_maps() {
  static_assert(kMaxTokens % kChunk == 0 && kMaxTokens >= kMinTileTokens && kMaxTokens <= 256, "tile width");
  return kMaxTokens / 16;
}

// The warpgroups of a kernel with tiles of up to kMaxTokens tokens, bf16 or fp8 alike: three
// consumer warpgroups of 64 weight rows for 128 tokens (64 accumulators a thread), two for 256
// (128), and a producer warpgroup. setmaxnreg only redistributes the launch's registers: 128 a
// thread at 512 threads, 168 at 384. Four consumer warpgroups (640 threads, or 544 with a producer
// warp: the four sub-partitions' register files take whole warps in turn) launch at 96, and their
// 112 a thread serializes the wgmma (C7512).
template <int kMaxTokens_>
struct Groups {
  static constexpr int kMaxTokens = kMaxTokens_;
  static constexpr int kActMaps = act_maps<kMaxTokens>();
  static constexpr int kGroups = kMaxTokens == 256 ? 2 : 3;  // consumer warpgroups
  static constexpr int kThreads = (kGroups + 1) * 128;        // + the producer warpgroup
  static constexpr int kRowsCta = 64 * kGroups;               // weight rows (output columns) per CTA
  static constexpr int kProducerRegs = kMaxTokens == 256 ? 40 : 32;
  static constexpr int kConsumerRegs = kMaxTokens == 256 ? 232 : 160;
  static_assert(setmaxnreg_fits(kThreads, kGroups, kProducerRegs, kConsumerRegs), "register budget");
};

// The tile list (tile_list.cuh, in whole chunks): ceil(rows / kMaxTokens) tiles an expert, at most
// R / kMinTileTokens + E of them for any of the kernels; the workspace holds the count (128 bytes),
// then the list.
constexpr size_t list_entries(int64_t R, int64_t E) { return static_cast<size_t>(R / kMinTileTokens + E + 1); }
// A launch's workspace: the count, the list, and the slack run_grouped spends on aligning the base
// (wsp_workspace_bytes).
constexpr size_t list_workspace_bytes(int64_t R, int64_t E) { return 128 + 128 + list_entries(R, E) * 16; }
// Where bf16's default rule picks our kernel (R < kBf16WspMaxRowsPerExpert * E) that fits the
// workspace bound kWorkspaceBase + kWorkspacePerExpert * E for every E up to kMaxExperts (both
// sides linear in E: its ends suffice), so the rule never meets a workspace too small for it; a
// switch may (some 2 M rows), and that call then fails, saying so.
static_assert(list_workspace_bytes(kBf16WspMaxRowsPerExpert, 1) <= kWorkspaceBase + kWorkspacePerExpert &&
                  list_workspace_bytes(kBf16WspMaxRowsPerExpert * kMaxExperts, kMaxExperts) <=
                      kWorkspaceBase + kWorkspacePerExpert * kMaxExperts,
              "bf16's default rule must fit its tile list in the workspace bound");

// A tile's width: its rows rounded up to a whole chunk.
template <int kMaxTokens>
__device__ __forceinline__ int tile_width(int rows) {
  return min((rows + kChunk - 1) / kChunk * kChunk, kMaxTokens);
}

// f(std::integral_constant<int, n>) for a tile's chunk count n (1 .. kMaxTokens / kChunk).
template <int kMaxTokens, int kCh = 1, typename F>
__device__ __forceinline__ void by_chunks(int chunks, F&& f) {
  if constexpr (kCh < kMaxTokens / kChunk) {
    if (chunks > kCh) {
      by_chunks<kMaxTokens, kCh + 1>(chunks, f);
      return;
    }
  }
  f(std::integral_constant<int, kCh>{});
}

// The CTA's ring barriers: kStages full barriers of full_arrivals arrivals, kStages empty ones
// with an arrival from each consumer thread and, in a cluster, from each consumer warp of the
// peer; then a cluster barrier (a CTA alone: a CTA barrier), so that the peer's barriers are
// initialized before any multicast or remote arrival reaches them.
template <int kCluster, int kStages, int kGroups>
__device__ __forceinline__ void init_ring(uint32_t bar_full, uint32_t bar_empty, int full_arrivals) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, full_arrivals);
      mbar_init(bar_empty + 8 * s, kGroups * 128 + (kCluster - 1) * kGroups * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kCluster == 2)
    cluster_sync();
  else
    __syncthreads();
}

// Tiles per group of the work items' order: within a group the items run weight block by weight
// block, so the CTAs running at once share each block's weights among the group's tiles (a
// tile-major order has every CTA streaming its own block: an expert's weights read from HBM once
// per tile). Where a pair of tiles' items fit in the clusters running at once (2 x pairs <=
// clusters: each tile's items run side by side, its tokens read from HBM once), groups of
// kSmallTileGroup: a smaller set of tiles and weight blocks in flight leaves more of L2 to each
// (qwen3 GEMM1 at M = 4096, H100: 1.00 GB read from HBM against 1.07 at 8); else kTileGroup, whose
// groups span the tiles of an expert with many (mixtral's GEMM1: 112 pairs a tile).
// HUMMING_JAX_PREFILL_WSP_GROUP=<n> (1 to kMaxTileGroup) replaces the rule, for timing.
constexpr int kTileGroup = 8;
constexpr int kSmallTileGroup = 2;
constexpr int kMaxTileGroup = 1024;
inline int tile_group(int64_t pairs, int64_t clusters) {
  const int rule = 2 * pairs <= clusters ? kSmallTileGroup : kTileGroup;
  const int64_t n = env_count("HUMMING_JAX_PREFILL_WSP_GROUP", rule, rule);
  return n >= 1 && n <= kMaxTileGroup ? static_cast<int>(n) : rule;
}

// f(tile, n0) for each of this CTA's work items, in order: item i for i = its cluster's index,
// + clusters, ..; items run in groups of W.group tile-list entries (fewer in the last), pair
// of kRowsCta-row weight blocks by pair, each pair over the group's tiles; the CTA takes the
// pair's block of its rank.
template <int kCluster, int kRowsCta, typename Params, typename F>
__device__ __forceinline__ void for_items(const Params& W, int rank, F&& f) {
  const int nb = (W.N + kRowsCta - 1) / kRowsCta, pairs = (nb + kCluster - 1) / kCluster;
  const int tiles = __ldg(W.count), items = tiles * pairs, clusters = static_cast<int>(gridDim.x) / kCluster;
  for (int i = static_cast<int>(blockIdx.x) / kCluster; i < items; i += clusters) {
    const int g = i / (W.group * pairs), j = i - g * W.group * pairs;
    const int in_group = min(W.group, tiles - g * W.group);
    f(W.tiles[g * W.group + j % in_group], ((j / in_group) * kCluster + rank) * kRowsCta);
  }
}

// f(std::integral_constant<int, 0>), .., f(std::integral_constant<int, n - 1>), in order.
template <typename F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int n, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, n>{});
}

// A slot's release by a consumer thread (its reads of it done): every thread arrives on this
// CTA's empty barrier, which orders its plain shared-memory reads (the fp8 kernel's scales) before
// the producer's next writes; in a cluster, lane 0 of each warp also arrives on the peer's, whose
// producer multicasts into this CTA's slot by TMA, once the warp's MMAs have read it.
template <int kCluster>
__device__ __forceinline__ void release(uint32_t bar, int lane, int rank) {
  mbar_arrive(bar);
  if constexpr (kCluster == 2) {
    __syncwarp();
    if (lane == 0) mbar_arrive_cluster(bar, static_cast<uint32_t>(rank ^ 1));
  }
}

// An item of a warpgroup whose 64 rows all lie past N (in a CTA's last block of rows, where N does
// not fill it): its stages are only waited for and released, with no MMA and no epilogue.
template <int kCluster, int kStages>
__device__ __forceinline__ void skip_item(int KT, uint32_t bar_full, uint32_t bar_empty, uint32_t& slot,
                                          uint32_t& phase, int lane, int rank) {
  for (int kt = 0; kt < KT; ++kt) {
    mbar_wait(bar_full + 8 * slot, phase);
    release<kCluster>(bar_empty + 8 * slot, lane, rank);
    if (++slot == kStages) {
      slot = 0;
      phase ^= 1u;
    }
  }
}

// A stage's TMA boxes, issued by the producer's one thread after it armed the full barrier `full`:
// the CTA's weight rows from n0 (one box of w at k0; load_stage), and the tile's tokens as two
// halves of `half` rows of row_bytes (box map; load_tokens): each CTA of a cluster of two loads its
// rank's half, multicast to both; a CTA alone loads both.
template <int kCluster>
__device__ __forceinline__ void load_tokens(uint32_t act_s, const CUtensorMap* map, int k0, int4 tile, int half,
                                            int row_bytes, int rank, uint32_t full) {
  if constexpr (kCluster == 2) {
    tma_load_3d_multicast(act_s + rank * half * row_bytes, map, k0, tile.y + rank * half, 0, full, 0x3);
  } else {
    tma_load_3d(act_s, map, k0, tile.y, 0, full);
    tma_load_3d(act_s + half * row_bytes, map, k0, tile.y + half, 0, full);
  }
}
template <int kCluster>
__device__ __forceinline__ void load_stage(uint32_t w_s, const CUtensorMap* w, uint32_t act_s, const CUtensorMap* map,
                                           int k0, int n0, int4 tile, int half, int row_bytes, int rank,
                                           uint32_t full) {
  tma_load_3d(w_s, w, k0, n0, tile.x, full);
  load_tokens<kCluster>(act_s, map, k0, tile, half, row_bytes, rank, full);
}

// The bias of a consumer thread's two weight rows (n0w + warp * 16 + g + 8 h of its warpgroup's 64
// from n0w), zero without one: loaded before the item's mainloop, so that the epilogue does not
// wait for it.
template <typename Params>
__device__ __forceinline__ void load_bias(const Params& o, int e, int n0w, int tid, float (&b)[2]) {
  const int warp = (tid >> 5) & 3, g = (tid & 31) >> 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = n0w + warp * 16 + g + 8 * h;
    b[h] = o.bias != nullptr && n < o.N ? __ldg(o.bias + static_cast<int64_t>(e) * o.N + n) : 0.0f;
  }
}

// A consumer thread's stmatrix address in its warpgroup's staging buffer (tid: its thread in the
// warpgroup): matrix m = lane >> 3 of an x4 store is token block m >> 1 of the pair, row half m & 1;
// the lane addresses its token (lane & 7) of it.
__device__ __forceinline__ uint32_t stage_lane_row(const uint8_t* staging, int tid) {
  const int warp = tid >> 5, lane = tid & 31, m = lane >> 3;
  return decode::smem_addr(staging) + ((m >> 1) * 8 + (lane & 7)) * kStageRow + (warp * 16 + 8 * (m & 1)) * 2;
}

// Pass `pass` of a warpgroup's epilogue into its staging buffer: acc[4 i + 2 h + q] is weight row
// warp * 16 + g + 8 h of its 64, token 8 i + 2 t + q of the tile; tokens [kPassTokens pass, + kPassTokens)
// plus the bias b[h] (kBias), rounded to bf16 in pairs of tokens, by transposing stmatrix: each
// token's 64 rows become one staging row.
template <bool kBias, int kAcc>
__device__ __forceinline__ void stage_pass(const float (&acc)[kAcc], const float (&b)[2], int pass, uint32_t lane_row) {
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
}

// A warpgroup's epilogue: its rows n0 + [0, 64) (stage_pass), kPassTokens tokens at a time, stored
// as 16-byte row chunks: thread tid stores chunk tid % 8 of tokens tid / 8 + 16 k. sync() is the
// warpgroup's named barrier. o: the kernel's parameters, with c [R, N] bf16 and N (read where
// used, from the parameter space).
template <int kWidth, bool kBias, typename Params, typename Sync, int kAcc>
__device__ __forceinline__ void store(const Params& o, const float (&acc)[kAcc], const float (&b)[2], int row0,
                                      int rows, int n0, uint8_t* staging, int tid, Sync sync) {
  const int N = o.N;
  const uint32_t lane_row = stage_lane_row(staging, tid);
  constexpr int kRowsPerStore = 128 / 8;  // tokens one pass of the warpgroup's 16-byte stores covers
  const int cc = tid & 7, tok0 = tid >> 3;
  const bool col_ok = n0 + cc * 8 < N;
  __nv_bfloat16* out = o.c + static_cast<int64_t>(row0 + tok0) * N + n0 + cc * 8;
  const int64_t step = static_cast<int64_t>(kRowsPerStore) * N;
  const uint8_t* from = staging + tok0 * kStageRow + cc * 16;
#pragma unroll
  for (int pass = 0; pass < (kWidth + kPassTokens - 1) / kPassTokens; ++pass) {
    sync();  // the previous pass's reads are done
    stage_pass<kBias>(acc, b, pass, lane_row);
    sync();
#pragma unroll
    for (int k = 0; k < kPassTokens / kRowsPerStore; ++k) {
      if (pass * kPassTokens + k * kRowsPerStore + tok0 < rows && col_ok)
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(from + k * kRowsPerStore * kStageRow);
      out += step;
    }
  }
}

// The epilogue of consumer warpgroup tid / 128 (its 64 rows from n0w, its staging buffer and named
// barrier 1 + the group), with the bias b of load_bias or without one.
template <int kWidth, typename Params, int kAcc>
__device__ __forceinline__ void store_group(const Params& o, const float (&acc)[kAcc], const float (&b)[2],
                                            int4 tile, int n0w, uint8_t* staging, int tid) {
  const int wg = tid >> 7, bar_id = 1 + wg;
  auto sync = [bar_id] { asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory"); };
  uint8_t* mine = staging + wg * kStagingBytes;
  if (o.bias != nullptr)
    store<kWidth, true>(o, acc, b, tile.y, tile.z, n0w, mine, tid & 127, sync);
  else
    store<kWidth, false>(o, acc, b, tile.y, tile.z, n0w, mine, tid & 127, sync);
}

// The gated epilogue of one consumer warpgroup (tid: its thread, 0 .. 127; staging: its own buffer;
// sync: its named barrier) over one item: the warpgroup stages its 64 rows a pass (stage_pass: the
// values c would hold), then writes y [R, N / 2] = act(gate, up) of its 32 output columns from j0,
// 8 columns (16 bytes) of one token a thread, rounded as the activation kernel rounds (the same
// contract functions: its values, bit for bit). The warpgroup holds both halves of its columns, so
// its epilogue needs no other warpgroup (and can run while another issues MMAs):
//  kGate 1, halves: its rows 0 .. 31 are gate rows j0 + [0, 32), rows 32 .. 63 the up rows
//  N / 2 + j0 + [0, 32): output columns 8 oc .. 8 oc + 7 are 16-byte chunks oc and oc + 4.
//  kGate 2, interleaved (swigluoai): its rows are 2 j0 + [0, 64), output column j0 + j is rows 2 j
//  (gate) and 2 j + 1 (up): columns 8 oc .. 8 oc + 7 are 16-byte chunks 2 oc and 2 oc + 1.
// The activation is a template argument: each pass's code holds its one activation (the first
// form, a runtime switch in every value's code, ran the layer 1.1-1.65x slower; benchmarks/NOTES.md,
// v18).
template <int kGate, Activation kAct, int kWidth, bool kBias, typename Params, typename Sync, int kAcc>
__device__ __forceinline__ void store_gated_as(const Params& o, const float (&acc)[kAcc], const float (&b)[2],
                                               int row0, int rows, int j0, uint8_t* staging, int tid, Sync sync) {
  static_assert(kGate == 1 || kGate == 2, "gated layouts");
  constexpr int kPasses = (kWidth + kPassTokens - 1) / kPassTokens;
  constexpr int kChunks = 4;  // 16-byte output chunks of a token: 32 columns
  static_assert(kPassTokens * kChunks == 128, "a pass: one chunk a thread");
  const int I = o.N / 2;
  const uint32_t lane_row = stage_lane_row(staging, tid);
  const int oc = tid % kChunks, tok0 = tid / kChunks;
  const bool col_ok = j0 + oc * 8 < I;
  __nv_bfloat16* out = o.c + static_cast<int64_t>(row0 + tok0) * I + j0 + oc * 8;
  const uint8_t* row = staging + tok0 * kStageRow;
  const uint8_t* first = kGate == 1 ? row + oc * 16 : row + oc * 32;
  const uint8_t* second = kGate == 1 ? first + kChunks * 16 : first + 16;
  const float limit = o.gate_limit;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    sync();  // the previous pass's reads are done
    stage_pass<kBias>(acc, b, pass, lane_row);
    sync();
    if (pass * kPassTokens + tok0 < rows && col_ok) {
      const uint4 p = *reinterpret_cast<const uint4*>(first), q = *reinterpret_cast<const uint4*>(second);
      const uint32_t pw[4] = {p.x, p.y, p.z, p.w}, qw[4] = {q.x, q.y, q.z, q.w};
      float g[8], u[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kGate == 1) {
          g[2 * e] = half_to_float<ElemType::kBF16>(pw[e] & 0xffffu);
          g[2 * e + 1] = half_to_float<ElemType::kBF16>(pw[e] >> 16);
          u[2 * e] = half_to_float<ElemType::kBF16>(qw[e] & 0xffffu);
          u[2 * e + 1] = half_to_float<ElemType::kBF16>(qw[e] >> 16);
        } else {
          g[e] = half_to_float<ElemType::kBF16>(pw[e] & 0xffffu);
          u[e] = half_to_float<ElemType::kBF16>(pw[e] >> 16);
          g[e + 4] = half_to_float<ElemType::kBF16>(qw[e] & 0xffffu);
          u[e + 4] = half_to_float<ElemType::kBF16>(qw[e] >> 16);
        }
      }
      uint32_t r[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        r[e] = pack_half2<ElemType::kBF16>(activation_gated(kAct, g[2 * e], u[2 * e], limit),
                                           activation_gated(kAct, g[2 * e + 1], u[2 * e + 1], limit));
      *reinterpret_cast<uint4*>(out) = make_uint4(r[0], r[1], r[2], r[3]);
    }
    out += static_cast<int64_t>(kPassTokens) * I;
  }
}

// store_gated_as for the item's activation (o.gate_act): the halves layout's silu, gelu and
// gelu_tanh, or swigluoai's interleaved rows; consumer warpgroup tid / 128's epilogue (its staging
// buffer and named barrier 1 + the group, as store_group's).
template <int kGate, int kWidth, bool kBias, typename Params, int kAcc>
__device__ __forceinline__ void store_gated(const Params& o, const float (&acc)[kAcc], const float (&b)[2], int row0,
                                            int rows, int j0, uint8_t* staging, int tid) {
  const int wg = tid >> 7, bar_id = 1 + wg;
  auto sync = [bar_id] { asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory"); };
  uint8_t* mine = staging + wg * kStagingBytes;
  const int t = tid & 127;
  if constexpr (kGate == 2) {
    store_gated_as<2, Activation::kSwigluOai, kWidth, kBias>(o, acc, b, row0, rows, j0, mine, t, sync);
  } else {
    switch (static_cast<Activation>(o.gate_act)) {
      case Activation::kGelu:
        store_gated_as<1, Activation::kGelu, kWidth, kBias>(o, acc, b, row0, rows, j0, mine, t, sync);
        break;
      case Activation::kGeluTanh:
        store_gated_as<1, Activation::kGeluTanh, kWidth, kBias>(o, acc, b, row0, rows, j0, mine, t, sync);
        break;
      default:
        store_gated_as<1, Activation::kSilu, kWidth, kBias>(o, acc, b, row0, rows, j0, mine, t, sync);
        break;
    }
  }
}

// A consumer warpgroup's item: past N, its stages only waited for and released (the predicate
// passed through a shuffle, which ptxas takes as warp-uniform and so keeps the stage loops on the
// uniform datapath); else the bias loaded first, consume(acc) over the item's KT stages, then the
// epilogue of its rows from n0w.
template <int kWidth, int kCluster, int kStages, typename Params, int kAcc, typename Consume>
__device__ __forceinline__ void group_item(const Params& W, int4 tile, int n0w, int KT, uint32_t bar_full,
                                           uint32_t bar_empty, uint32_t& slot, uint32_t& phase, float (&acc)[kAcc],
                                           uint8_t* staging, int tid, int rank, Consume&& consume) {
  if (__shfl_sync(0xffffffffu, n0w >= W.N, 0)) {
    skip_item<kCluster, kStages>(KT, bar_full, bar_empty, slot, phase, tid & 31, rank);
    return;
  }
  float b[2];
  load_bias(W, tile.x, n0w, tid, b);
  consume(acc);
  store_group<kWidth>(W, acc, b, tile, n0w, staging, tid);
}

// The tensor maps of a launch, W.w and (act) W.act[i]: the weights [E, N, K] in boxes of bk x
// rows_cta, the activations [R, K] in boxes of bk x 8 (i + 1) (half a tile of 16 (i + 1) rows),
// elements of elem_bytes, 128-byte swizzle. An error message, or empty.
template <typename Params>
std::string tensor_maps(Params& W, CUtensorMapDataType type, int elem_bytes, const GroupedArgs& g, uint32_t bk,
                        uint32_t rows_cta, bool act = true) {
  if (tensor_map_encoder() == nullptr) return "cuTensorMapEncodeTiled is not available";
  if (!encode_rows_3d(&W.w, type, elem_bytes, g.w, g.K, g.N, g.E, bk, rows_cta, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B))
    return "cuTensorMapEncodeTiled failed for the weights";
  for (size_t i = 0; act && i < sizeof(W.act) / sizeof(W.act[0]); ++i)
    if (!encode_rows_3d(&W.act[i], type, elem_bytes, g.a, g.K, g.R, 1, bk, 8 * (i + 1), CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B))
      return "cuTensorMapEncodeTiled failed for the activations";
  return std::string();
}

// The launch of a persistent kernel with `items` work items (a bound: the tile count is known on the
// device only) on clusters of `cluster` (1 or 2) CTAs: one CTA per SM, or per item where there
// are fewer; clusters of two as many as fit at once (a GPC's SMs pair up, so that can be below
// SMs / 2; asked once per device). one / two are the kernel's forms for clusters of one / two CTAs
// (one kernel per Params type, whose statics these are). An error message, or empty.
template <typename Params>
std::string launch(void (*one)(Params), void (*two)(Params), const Params& params, int cluster, int threads, int smem,
                   int64_t items, int device, int sm_count, cudaStream_t stream, const char* name) {
  static std::mutex mu;
  static unsigned configured[2] = {0, 0};
  static int clusters_cache[64] = {};
  if (cluster != 1 && cluster != 2) return "cluster size must be 1 or 2";
  if (device < 0 || device >= 64) return "device index out of range";
  auto kernel = cluster == 2 ? two : one;
  if (!decode::raise_smem_limit_once(kernel, smem, true, configured[cluster - 1]))
    return std::string(name) + ": " + cudaGetErrorString(cudaGetLastError());
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cluster == 2 ? 1 : 0;  // a CTA alone: a plain launch
  int64_t ctas = std::min<int64_t>(sm_count, items);
  if (cluster == 2) {
    std::lock_guard<std::mutex> lock(mu);
    if (clusters_cache[device] == 0) {
      cfg.gridDim = dim3(static_cast<unsigned>(sm_count / 2 * 2));
      int n = 0;
      if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess || n <= 0) {
        cudaGetLastError();
        return std::string("no cluster of two CTAs of ") + name + " fits on this device";
      }
      clusters_cache[device] = n;
    }
    ctas = 2 * std::min<int64_t>(clusters_cache[device], items);
  }
  cfg.gridDim = dim3(static_cast<unsigned>(ctas));
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, params);
  if (err == cudaSuccess) err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(name) + ": " + cudaGetErrorString(err);
}

// A launch's common part: the tile list (the workspace's count, then its entries) and the output's
// fields of W (tiles, count, c, bias, N, K; the kernel's own fields are the caller's), the tile list
// kernel (tiles of up to max_tokens rows in whole chunks; zero rows past the last expert), then the
// kernel on `items` bounded by the list. An error message, or empty.
template <typename Params>
std::string run(const GroupedArgs& g, Params& W, int rows_cta, int max_tokens, void (*one)(Params),
                void (*two)(Params), int cluster, int threads, int smem, const DeviceInfo& dev, cudaStream_t stream,
                const char* name) {
  if (g.workspace_bytes < 128 + list_entries(g.R, g.E) * 16) return "workspace too small for the tile list";
  uint8_t* ws = static_cast<uint8_t*>(g.workspace);
  W.count = reinterpret_cast<int*>(ws);
  W.tiles = reinterpret_cast<int4*>(ws + 128);
  W.bias = g.bias;
  // A gated call's kernel writes y [R, N / 2] (and the zero rows there) instead of c.
  void* out = g.gate.y != nullptr ? g.gate.y : g.c;
  const int64_t out_cols = g.gate.y != nullptr ? g.N / 2 : g.N;
  W.c = static_cast<__nv_bfloat16*>(out);
  W.N = static_cast<int>(g.N);
  W.K = static_cast<int>(g.K);
  const int64_t nb = (g.N + rows_cta - 1) / rows_cta, pairs = (nb + cluster - 1) / cluster;
  W.group = tile_group(pairs, dev.sm_count / cluster);
  const std::string e =
      launch_tile_list(g.offsets, g.E, g.R, out_cols, max_tokens, kChunk, W.tiles, W.count, out, dev.sm_count, stream);
  if (!e.empty()) return e;
  return launch(one, two, W, cluster, threads, smem, static_cast<int64_t>(list_entries(g.R, g.E)) * pairs, dev.device,
                dev.sm_count, stream, name);
}

}  // namespace wsp
}  // namespace prefill
}  // namespace hj
