// CUDA handlers of the routing metadata (indexed and grouped layouts) and of the row permutation
// of the grouped format. Semantics mirror routing_cpu.cc; entries are placed in increasing
// token*k+j order within each expert, as on the CPU, so the metadata is deterministic.
//
// One launch per call, one block per local expert. Each warp of a block takes one contiguous
// segment of the entries, four consecutive entries per lane (one 16-byte load), and counts its
// own expert's matches; after a prefix over the warps it places them in entry order by ballots,
// so no block barrier sits inside the loops. The expert map is staged in shared memory when it
// is small, so an entry costs no dependent global load. The expert's start differs by layout:
// - grouped (no padding): the entries of lower local experts, counted in the same pass; no
//   histogram and no atomics.
// - indexed (each expert padded to block_m rows): every block counts all experts into a shared
//   histogram and scans it, as the start needs each lower expert's padded count.
// Every block also writes its share of the tail past the used rows. Cost: each block reads all M*k
// entries twice (counting, then placement), 16 entries per lane in flight (these reads hit L2
// after the first block).
// Calls of at most 32 entries (decode) take routing_small_kernel instead: one warp, one entry
// per lane, no histogram and no block-wide scan.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_launch.cuh"
#include "dependent_launch.cuh"
#include "ffi_common.h"
#include "grouped_rows.cuh"
#include "layer_steps_cuda.h"
#include "rs4_k_order.cuh"

namespace hj {
namespace {

constexpr int kRouteThreads = 512;
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kRouteUnroll = 4;  // 128-entry steps in flight per warp (16 entries per lane)
constexpr int64_t kMaxHistExperts = 12 * 1024;  // 48 KB of shared histogram
constexpr int64_t kMaxSharedMap = 8 * 1024;     // expert maps up to 32 KB are staged in shared memory

// Exclusive scan of v over the block; *total receives the block's sum. All threads must call it.
__device__ int block_exclusive_scan(int v, int* s_warp, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nwarps ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < nwarps) s_warp[lane] = w;
  }
  __syncthreads();
  const int before = warp ? s_warp[warp - 1] : 0;
  *total = s_warp[nwarps - 1];
  __syncthreads();  // s_warp is reused by the next call
  return before + x - v;
}

struct RoutingArgs {
  const int32_t* ids;
  const int32_t* map;
  int32_t entries, num_global, num_local, block_m;
  int32_t* order;  // sorted_ids (indexed) or permutation (grouped)
  int32_t order_len;
  int32_t* blocks;  // block_expert_ids (indexed)
  int32_t num_blocks;
  int32_t* ntpp;     // num_tokens_post_padded (indexed)
  int32_t* offsets;  // expert_first_token_offset (grouped)
  int32_t* src;      // src_rows
};

// Local experts of the lane's four entries in each 128-entry step s0 .. s0 + U - 1 (entry
// step * 128 + lane * 4 + j; -2 past s_hi or the entries, -1 remote or invalid). map is the
// staged or the global expert map. Positions past the end are flagged apart: every int32 is a
// possible id.
template <int U>
__device__ __forceinline__ void step_experts(const RoutingArgs& a, const int32_t* map, bool vec, int s0, int s_hi,
                                             int lane, int (&l)[U][4]) {
  int id[U][4];
  unsigned past[U];  // bit j: entry j lies past s_hi or the entries
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = (s0 + u) * 128 + lane * 4;
    past[u] = 0;
    if (s0 + u < s_hi && vec && i + 3 < a.entries) {
      const int4 v = __ldg(reinterpret_cast<const int4*>(a.ids + i));
      id[u][0] = v.x, id[u][1] = v.y, id[u][2] = v.z, id[u][3] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool in = s0 + u < s_hi && i + j < a.entries;
        id[u][j] = in ? __ldg(a.ids + i + j) : 0;
        past[u] |= in ? 0u : 1u << j;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      l[u][j] = (past[u] >> j) & 1u ? -2 : local_expert(id[u][j], map, a.num_global, a.num_local);
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <bool kIndexed>
__global__ void __launch_bounds__(kRouteThreads, 1) routing_kernel(RoutingArgs a, bool shared_map) {
  extern __shared__ int s_dyn[];  // [num_global] staged map (if shared_map), then (indexed) [num_local] histogram
  __shared__ int s_warp[32];
  __shared__ int s_wcount[kRouteWarps], s_wbelow[kRouteWarps], s_wvalid[kRouteWarps];
  __shared__ int s_count;
  begin_dependent_grid();  // launch_routing launches it dependent on the kernel before it
  const int e = blockIdx.x;
  const int E = a.num_local;
  const int bm = kIndexed ? a.block_m : 1;
  int* s_hist = s_dyn + (shared_map ? a.num_global : 0);
  const int32_t* map = shared_map ? s_dyn : a.map;
  const bool vec = (reinterpret_cast<uintptr_t>(a.ids) & 15) == 0;

  // Warp w walks the 128-entry steps [s_lo, s_hi) (warp-uniform bounds, so every ballot sees all
  // lanes), counting its own expert's entries, and either every expert into the histogram
  // (indexed) or the entries of lower experts and all local entries (grouped).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int steps = (a.entries + 127) / 128;
  const int per_warp = (steps + kRouteWarps - 1) / kRouteWarps;
  const int s_lo = min(steps, warp * per_warp), s_hi = min(steps, s_lo + per_warp);
  if (shared_map)
    for (int i = threadIdx.x; i < a.num_global; i += blockDim.x) s_dyn[i] = a.map[i];
  if (kIndexed)
    for (int i = threadIdx.x; i < E; i += blockDim.x) s_hist[i] = 0;
  __syncthreads();
  int mine_count = 0, below_count = 0, valid_count = 0;
  for (int s0 = s_lo; s0 < s_hi; s0 += kRouteUnroll) {
    int l[kRouteUnroll][4];
    step_experts(a, map, vec, s0, s_hi, lane, l);
#pragma unroll
    for (int u = 0; u < kRouteUnroll; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int x = l[u][j];
        if constexpr (kIndexed) {
          if (x >= 0) atomicAdd(&s_hist[x], 1);
        } else {
          below_count += x >= 0 && x < e;
          valid_count += x >= 0;
        }
        mine_count += x == e;
      }
  }
  mine_count = warp_sum(mine_count);
  below_count = warp_sum(below_count);
  valid_count = warp_sum(valid_count);
  if (lane == 0) {
    s_wcount[warp] = mine_count;
    s_wbelow[warp] = below_count;
    s_wvalid[warp] = valid_count;
  }
  __syncthreads();

  int start = 0, count = 0, total = 0;
  if constexpr (kIndexed) {
    if (threadIdx.x == 0) s_count = s_hist[e];
    // Exclusive starts of every expert's padded range, each thread owning a contiguous slice.
    const int per = (E + blockDim.x - 1) / blockDim.x;
    const int lo = min(E, static_cast<int>(threadIdx.x) * per), hi = min(E, lo + per);
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += (s_hist[i] + bm - 1) / bm * bm;
    int run = block_exclusive_scan(mine, s_warp, &total);
    for (int i = lo; i < hi; ++i) {
      const int c = s_hist[i];
      s_hist[i] = run;
      run += (c + bm - 1) / bm * bm;
    }
    __syncthreads();
    start = s_hist[e];
    count = s_count;
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.ntpp = total;
  } else {
    for (int w = 0; w < kRouteWarps; ++w) {
      start += s_wbelow[w];
      count += s_wcount[w];
      total += s_wvalid[w];
    }
    if (threadIdx.x == 0) a.offsets[e] = start;
    if (blockIdx.x == 0 && threadIdx.x == 0) a.offsets[E] = total;
  }

  // Place this expert's entries in increasing entry order: the warps before this one hold the
  // ranks below its first (s_wcount); within a step, entry (lane, j) follows the matches of the
  // lanes below (all four of theirs) and its own lane's earlier ones. Step st's remote entries
  // get src = -1 from block st % gridDim.x only.
  int rank = 0;
  for (int w = 0; w < warp; ++w) rank += s_wcount[w];
  const unsigned below = (1u << lane) - 1u;
  for (int s0 = s_lo; s0 < s_hi; s0 += kRouteUnroll) {
    int l[kRouteUnroll][4];
    step_experts(a, map, vec, s0, s_hi, lane, l);
#pragma unroll
    for (int u = 0; u < kRouteUnroll; ++u) {
      unsigned m[4];
      int before = 0, step_total = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        m[j] = __ballot_sync(0xffffffffu, l[u][j] == e);
        before += __popc(m[j] & below);
        step_total += __popc(m[j]);
      }
      const bool remote_writer = (s0 + u) % static_cast<int>(gridDim.x) == static_cast<int>(blockIdx.x);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = (s0 + u) * 128 + lane * 4 + j;
        if (l[u][j] == e) {
          const int pos = start + rank + before++;
          a.order[pos] = i;
          a.src[i] = kIndexed ? i : pos;
        } else if (l[u][j] == -1 && remote_writer) {
          a.src[i] = -1;
        }
      }
      rank += step_total;
    }
  }

  const int sentinel = kIndexed ? a.entries : -1;
  if (kIndexed) {
    const int padded = (count + bm - 1) / bm * bm;
    for (int p = start + count + threadIdx.x; p < start + padded; p += blockDim.x) a.order[p] = sentinel;
    for (int b = start / bm + threadIdx.x; b < (start + padded) / bm; b += blockDim.x) a.blocks[b] = e;
  }
  // Rows past the used ones: every block writes a share.
  const int tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  for (int p = total + tid; p < a.order_len; p += stride) a.order[p] = sentinel;
  if (kIndexed)
    for (int b = total / bm + tid; b < a.num_blocks; b += stride) a.blocks[b] = -1;
}

// Decode sizes (at most 32 entries): one block per expert would spend the call on its barriers
// and scans, so warp 0 of a single pass holds one entry per lane. Ranks within an expert come
// from __match_any_sync (lanes in entry order), an expert's start from a 32-step shuffle sum over
// the lanes (each expert's padded count taken once, from its first lane). Every block repeats
// that warp's work (at most 32 loads) so that all of them know the total for their share of the
// tails; block 0 alone writes the entries.
constexpr int kSmallEntries = 32;
constexpr int kSmallThreads = 512;

template <bool kIndexed>
__global__ void __launch_bounds__(kSmallThreads) routing_small_kernel(RoutingArgs a) {
  __shared__ int s_l[kSmallEntries];
  __shared__ int s_total;
  begin_dependent_grid();  // launch_routing launches it dependent on the kernel before it
  const int bm = kIndexed ? a.block_m : 1;
  if (threadIdx.x < 32) {
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x;
    const int l = lane < a.entries ? local_expert(__ldg(a.ids + lane), a.map, a.num_global, a.num_local) : -2;
    const unsigned peers = __match_any_sync(full, l);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    const int count = __popc(peers);
    const bool first = l >= 0 && rank == 0;
    const int padded = (count + bm - 1) / bm * bm;
    int start = 0, total = 0;
    for (int j = 0; j < 32; ++j) {
      const int lj = __shfl_sync(full, l, j);
      if constexpr (kIndexed) {
        const int pj = __shfl_sync(full, first ? padded : 0, j);  // nonzero only at first lanes
        total += pj;
        start += lj < l ? pj : 0;
      } else {
        total += lj >= 0;
        start += lj >= 0 && lj < l;
      }
    }
    s_l[lane] = l;
    if (lane == 0) s_total = total;
    if (blockIdx.x == 0) {
      if (l >= 0) {
        const int pos = start + rank;
        a.order[pos] = lane;
        a.src[lane] = kIndexed ? lane : pos;
      } else if (l == -1) {
        a.src[lane] = -1;
      }
      if constexpr (kIndexed) {
        if (first) {
          for (int p = start + count; p < start + padded; ++p) a.order[p] = a.entries;
          for (int b = start / bm; b < (start + padded) / bm; ++b) a.blocks[b] = l;
        }
        if (lane == 0) *a.ntpp = total;
      } else {
        if (lane == 0) a.offsets[a.num_local] = total;
      }
    }
  }
  __syncthreads();
  const int total = s_total;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  for (int p = total + tid; p < a.order_len; p += stride) a.order[p] = kIndexed ? a.entries : -1;
  if constexpr (kIndexed) {
    for (int b = total / bm + tid; b < a.num_blocks; b += stride) a.blocks[b] = -1;
  } else {
    const int n = min(a.entries, kSmallEntries);
    for (int e = tid; e < a.num_local; e += stride) {
      int below = 0;
      for (int j = 0; j < n; ++j) below += s_l[j] >= 0 && s_l[j] < e;
      a.offsets[e] = below;
    }
  }
}

// The fields both layouts take from the inputs; the caller adds its outputs.
RoutingArgs routing_inputs(const RoutingShape& s, const AnyBuffer& topk_ids, const AnyBuffer& expert_map) {
  RoutingArgs a{};
  a.ids = static_cast<const int32_t*>(topk_ids.untyped_data());
  a.map = static_cast<const int32_t*>(expert_map.untyped_data());
  a.entries = static_cast<int32_t>(s.M * s.top_k);
  a.num_global = static_cast<int32_t>(s.num_global);
  a.num_local = static_cast<int32_t>(s.num_local);
  return a;
}

Error launch_routing(const std::string& call, cudaStream_t stream, const RoutingShape& s, bool indexed,
                     RoutingArgs args) {
  if (s.num_global > INT32_MAX) return invalid(call, "expert_map is too long");
  // HUMMING_JAX_ROUTING_SMALL=0 keeps calls of at most 32 entries on the per-expert kernel (A/B).
  if (args.entries <= kSmallEntries && env_flag("HUMMING_JAX_ROUTING_SMALL", true)) {
    const int64_t work = std::max<int64_t>(args.order_len, indexed ? args.num_blocks : s.num_local);
    const unsigned grid = grid_for(work, kSmallThreads, 1024);
    launch_dependent(indexed ? routing_small_kernel<true> : routing_small_kernel<false>, dim3(grid),
                     dim3(kSmallThreads), 0, stream, args);
    return launch_status(call, "routing_small_kernel");
  }
  if (indexed && s.num_local > kMaxHistExperts)
    return invalid(call, "at most " + std::to_string(kMaxHistExperts) + " local experts are supported");
  const bool shared_map = s.num_global <= kMaxSharedMap;
  const size_t smem = ((shared_map ? s.num_global : 0) + (indexed ? s.num_local : 0)) * sizeof(int);
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(indexed ? routing_kernel<true> : routing_kernel<false>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess)
      return Error::Internal("humming_jax." + call + ": routing_kernel cannot have " + std::to_string(smem) +
                             " bytes of shared memory: " + cudaGetErrorString(e));
  }
  const dim3 grid(static_cast<unsigned>(s.num_local));
  launch_dependent(indexed ? routing_kernel<true> : routing_kernel<false>, grid, dim3(kRouteThreads), smem, stream,
                   args, shared_map);
  return launch_status(call, "routing_kernel");
}

Error RoutingIndexedCuda(cudaStream_t stream, AnyBuffer topk_ids, AnyBuffer expert_map,
                         Result<AnyBuffer> sorted_ids, Result<AnyBuffer> block_expert_ids, Result<AnyBuffer> ntpp,
                         Result<AnyBuffer> src_rows, int64_t num_local_experts, int64_t block_m,
                         int64_t identity_map) {
  const std::string call = "routing_indexed";
  RoutingShape s;
  HJ_RETURN_IF_ERROR(check_routing_inputs(call, topk_ids, expert_map, num_local_experts, identity_map, &s));
  int64_t P = 0;
  HJ_RETURN_IF_ERROR(check_routing_indexed_outputs(call, s, block_m, topk_ids, expert_map, *sorted_ids,
                                                   *block_expert_ids, *ntpp, *src_rows, &P));
  return launch_routing_indexed(call, stream, s, topk_ids, expert_map, block_m, P, *sorted_ids, *block_expert_ids,
                                *ntpp, *src_rows);
}

Error RoutingGroupedCuda(cudaStream_t stream, AnyBuffer topk_ids, AnyBuffer expert_map,
                         Result<AnyBuffer> permutation, Result<AnyBuffer> offsets, Result<AnyBuffer> src_rows,
                         int64_t num_local_experts, int64_t identity_map) {
  const std::string call = "routing_grouped";
  RoutingShape s;
  HJ_RETURN_IF_ERROR(check_routing_inputs(call, topk_ids, expert_map, num_local_experts, identity_map, &s));
  HJ_RETURN_IF_ERROR(
      check_routing_grouped_outputs(call, s, topk_ids, expert_map, *permutation, *offsets, *src_rows));
  RoutingArgs a = routing_inputs(s, topk_ids, expert_map);
  a.block_m = 1;
  a.order = static_cast<int32_t*>(permutation->untyped_data());
  a.order_len = a.entries;
  a.offsets = static_cast<int32_t*>(offsets->untyped_data());
  a.src = static_cast<int32_t*>(src_rows->untyped_data());
  return launch_routing(call, stream, s, false, a);
}

// y[p] = x[perm[p] / top_k] for p below the valid row count, zeros elsewhere; V is the copy unit.
// Rows of at least 32 units: a warp a row (permute_rows_warp_kernel); shorter rows (the fp8
// activations' scales: 4 units of 16 bytes) a thread a unit, as a warp a row would leave most of
// its lanes idle (measured on the H200: 2.9 -> 10.5 µs for 32768 rows of 64 bytes).
template <typename V>
__global__ void permute_rows_kernel(const V* __restrict__ x, const int32_t* __restrict__ perm,
                                    const int32_t* __restrict__ offsets, int64_t num_offsets, int64_t R,
                                    int64_t units_per_row, int64_t top_k, V* __restrict__ y) {
  const int64_t valid = valid_rows(offsets, num_offsets, R);
  const int64_t n = R * units_per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = idx / units_per_row, c = idx - p * units_per_row;
    const int64_t id = p < valid ? perm[p] : -1;
    V v{};
    if (id >= 0 && id < R) v = x[(id / top_k) * units_per_row + c];
    y[idx] = v;
  }
}

// A warp a row: the row's source is looked up once, then kPermuteUnroll units a lane are loaded
// together before any is stored, so each lane keeps that many loads in flight (a thread a unit
// waits on the permutation's load, then the row's, for every unit; on the H200 this kernel took
// 3-14% less time at bf16 rows of 4-14 KB).
constexpr int kPermuteThreads = 256;
constexpr int kPermuteUnroll = 8;

template <typename V>
__global__ void __launch_bounds__(kPermuteThreads)
    permute_rows_warp_kernel(const V* __restrict__ x, const int32_t* __restrict__ perm,
                             const int32_t* __restrict__ offsets, int64_t num_offsets, int64_t R,
                             int64_t units_per_row, int64_t top_k, V* __restrict__ y) {
  const int64_t valid = valid_rows(offsets, num_offsets, R);
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kPermuteThreads / 32);
  for (int64_t p = (static_cast<int64_t>(blockIdx.x) * kPermuteThreads + threadIdx.x) >> 5; p < R; p += warps) {
    const int64_t id = p < valid ? __ldg(perm + p) : -1;
    const V* src = id >= 0 && id < R ? x + (id / top_k) * units_per_row : nullptr;
    V* dst = y + p * units_per_row;
    for (int64_t c0 = lane; c0 < units_per_row; c0 += 32 * kPermuteUnroll) {
      V v[kPermuteUnroll];
#pragma unroll
      for (int u = 0; u < kPermuteUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        v[u] = src != nullptr && c < units_per_row ? src[c] : V{};
      }
#pragma unroll
      for (int u = 0; u < kPermuteUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        if (c < units_per_row) dst[c] = v[u];
      }
    }
  }
}

template <typename V>
Error launch_permute(const std::string& call, cudaStream_t stream, const void* x, const int32_t* perm,
                     const int32_t* offsets, int64_t num_offsets, int64_t R, int64_t row_bytes, int64_t top_k,
                     void* y) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(V));
  if (units >= 32) {
    permute_rows_warp_kernel<V><<<grid_for(R * 32, kPermuteThreads), kPermuteThreads, 0, stream>>>(
        static_cast<const V*>(x), perm, offsets, num_offsets, R, units, top_k, static_cast<V*>(y));
    return launch_status(call, "permute_rows_warp_kernel");
  }
  const int threads = 256;
  permute_rows_kernel<V><<<grid_for(R * units, threads), threads, 0, stream>>>(
      static_cast<const V*>(x), perm, offsets, num_offsets, R, units, top_k, static_cast<V*>(y));
  return launch_status(call, "permute_rows_kernel");
}

// permute_rows with k_order = 1 (16-byte aligned rows, fewer than 2^31 16-byte chunks): a thread
// loads 8 consecutive columns of the source row (one 16-byte load) and the 8 threads of a 64-column
// tile trade them into the order (rs4_write_ordered, rs4_k_order.cuh).
__global__ void __launch_bounds__(kPermuteThreads)
    permute_rows_ordered_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ perm,
                                const int32_t* __restrict__ offsets, int64_t num_offsets, int64_t R, uint32_t chunks,
                                int64_t top_k, uint4* __restrict__ y) {
  const int64_t valid = valid_rows(offsets, num_offsets, R);
  rs4_write_ordered<kPermuteThreads>(y, static_cast<uint32_t>(R) * chunks, [&](uint32_t idx) {
    const uint32_t p = idx / chunks, q = idx - p * chunks;
    const int64_t id = p < valid ? __ldg(perm + p) : -1;
    return id >= 0 && id < R ? __ldg(x + (id / top_k) * chunks + q) : uint4{};
  });
}

Error PermuteRowsCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer permutation, AnyBuffer offsets,
                      Result<AnyBuffer> y, int64_t top_k, int64_t k_order) {
  const std::string call = "permute_rows";
  PermuteShape s;
  HJ_RETURN_IF_ERROR(check_permute_rows(call, x, permutation, offsets, *y, top_k, &s));
  HJ_RETURN_IF_ERROR(check_k_order(call, k_order, x.element_type(), s.cols));
  if (k_order == 1) {
    if (s.R == 0 || s.cols == 0) return Error::Success();
    if (!aligned_to(y->untyped_data(), 16)) return invalid(call, "k_order = 1 needs a 16-byte aligned y");
    if (!aligned_to(x.untyped_data(), 16)) return invalid(call, "k_order = 1 needs a 16-byte aligned x");
    if (s.R * (s.cols / 8) >= INT32_MAX) return invalid(call, "k_order = 1 takes fewer than 2^31 16-byte chunks");
    const auto chunks = static_cast<uint32_t>(s.cols / 8);
    permute_rows_ordered_kernel<<<grid_for(s.R * chunks, kPermuteThreads), kPermuteThreads, 0, stream>>>(
        static_cast<const uint4*>(x.untyped_data()), static_cast<const int32_t*>(permutation.untyped_data()),
        static_cast<const int32_t*>(offsets.untyped_data()), s.num_offsets, s.R, chunks, top_k,
        static_cast<uint4*>(y->untyped_data()));
    return launch_status(call, "permute_rows_ordered_kernel");
  }
  const int64_t row_bytes = s.cols * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  return permute_rows_into(call, stream, x.untyped_data(), static_cast<const int32_t*>(permutation.untyped_data()),
                           static_cast<const int32_t*>(offsets.untyped_data()), s.num_offsets, s.R, row_bytes, top_k,
                           y->untyped_data());
}

}  // namespace

Error launch_routing_indexed(const std::string& call, cudaStream_t stream, const RoutingShape& s,
                             const AnyBuffer& topk_ids, const AnyBuffer& expert_map, int64_t block_m, int64_t P,
                             AnyBuffer& sorted_ids, AnyBuffer& block_expert_ids, AnyBuffer& ntpp,
                             AnyBuffer& src_rows) {
  RoutingArgs a = routing_inputs(s, topk_ids, expert_map);
  a.block_m = static_cast<int32_t>(block_m);
  a.order = static_cast<int32_t*>(sorted_ids.untyped_data());
  a.order_len = static_cast<int32_t>(P);
  a.blocks = static_cast<int32_t*>(block_expert_ids.untyped_data());
  a.num_blocks = static_cast<int32_t>(P / block_m);
  a.ntpp = static_cast<int32_t*>(ntpp.untyped_data());
  a.src = static_cast<int32_t*>(src_rows.untyped_data());
  return launch_routing(call, stream, s, true, a);
}

Error permute_rows_into(const std::string& call, cudaStream_t stream, const void* x, const int32_t* perm,
                        const int32_t* offsets, int64_t num_offsets, int64_t R, int64_t row_bytes, int64_t top_k,
                        void* y) {
  if (R == 0 || row_bytes == 0) return Error::Success();
  auto fits = [&](size_t unit) {
    return row_bytes % static_cast<int64_t>(unit) == 0 && aligned_to(x, unit) && aligned_to(y, unit);
  };
  if (fits(16)) return launch_permute<uint4>(call, stream, x, perm, offsets, num_offsets, R, row_bytes, top_k, y);
  if (fits(4)) return launch_permute<uint32_t>(call, stream, x, perm, offsets, num_offsets, R, row_bytes, top_k, y);
  if (fits(2)) return launch_permute<uint16_t>(call, stream, x, perm, offsets, num_offsets, R, row_bytes, top_k, y);
  return launch_permute<uint8_t>(call, stream, x, perm, offsets, num_offsets, R, row_bytes, top_k, y);
}

}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjRoutingIndexedCuda, hj::RoutingIndexedCuda,
                              hj::bind_routing_indexed<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjRoutingGroupedCuda, hj::RoutingGroupedCuda,
                              hj::bind_routing_grouped<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjPermuteRowsCuda, hj::PermuteRowsCuda, hj::bind_permute_rows<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
