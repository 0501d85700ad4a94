// The prefill grouped GEMM, one template for every kind (gemm_prefill_sm90.h): CUTLASS's
// persistent, warp-specialized (one TMA producer warpgroup, two wgmma consumer warpgroups,
// cooperative or pingpong) ptr-array mainloop over a device-side group scheduler, with our own setup kernel,
// workspace layout, epilogue (acc + per-expert bias) and launch. Included once per translation
// unit (gemm_prefill_sm90_<kind>.cu), each instantiating one configuration, so a change to one
// kind recompiles one file and the files build in parallel.
//
// Layouts (TN, both operands K-major, as wgmma wants them and as our tensors already are):
//   A = a [R, K] row-major; expert e's rows start at a + lo_e * K.
//   B = w [E, N, K]: expert e is an N x K, K-contiguous matrix ("column-major B").
//   D = c [R, N] row-major. There is no C operand (beta = 0), so no source is read.
//   fp8 block scales: a_scale [R, K/128] and w_scale [E, N/128, K/128], both K-major, which is
//   the K-major layout of CUTLASS's blockwise scale config: they are used in place, no copy.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "gemm_prefill_sm90.h"
#include "grouped_rows.cuh"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the prefill grouped GEMM needs CUDA >= 12.3 (device-side TMA descriptor updates)"
#endif

namespace hj {
namespace prefill {
namespace detail {

using namespace cute;

// Workspace arrays laid out one after another, each 128-byte aligned. With a null base the carver
// only measures, so a layout written once gives both the pointers and the bytes it needs.
constexpr size_t kArrayAlign = 128;
inline size_t align_array(size_t bytes) { return (bytes + kArrayAlign - 1) / kArrayAlign * kArrayAlign; }

struct Carver {
  char* base;       // null: measure only
  size_t used = 0;  // bytes laid out so far
  template <class T>
  T* take(size_t count) {
    T* q = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += align_array(count * sizeof(T));
    return q;
  }
};

// One configuration: element types, whether fp8 block scales apply, tile and cluster shapes, and
// the consumer schedule: cooperative (two warpgroups split one 128-row tile) or pingpong (each
// warpgroup owns a whole 64-row tile and the two alternate mainloop and epilogue).
template <class ElementAB_, class ElementD_, bool kBlockScaled_, class TileShape_, class ClusterShape_,
          bool kPingpong_ = false>
struct Config {
  using ElementAB = ElementAB_;
  using ElementD = ElementD_;
  static constexpr bool kBlockScaled = kBlockScaled_;
  static constexpr bool kPingpong = kPingpong_;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
};

// The CUTLASS schedule tags of a configuration.
template <class Cfg>
struct Schedule {
  using Epilogue = std::conditional_t<Cfg::kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using Mainloop = std::conditional_t<
      Cfg::kBlockScaled,
      std::conditional_t<Cfg::kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>,
      std::conditional_t<Cfg::kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
};

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M_e, N, K) per expert
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;

// Block scales: one per activation row and 128 columns of K, one per 128 x 128 weight block; both
// K-major (consecutive K-blocks adjacent), the layout our quantize call and weight format use.
using BlockScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;
using LayoutSFA = decltype(BlockScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(BlockScaleConfig::deduce_layoutSFB());

template <class Cfg>
struct Epilogue {
  static constexpr int kAlignD = 16 / sizeof(typename Cfg::ElementD);
  // D = round_to_nearest(acc + bias[e][n]) in float32, the contract's order (acc + bias, then one
  // rounding). The bias is a row vector per expert, found through a per-expert pointer array
  // indexed by the group; a null array means no bias (the broadcast then reads nothing).
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<0, typename Cfg::TileShape, float*, float,
                                                           Stride<_0, _1, _0>, 4, true>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, typename Cfg::ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch, Bias>;
  using Collective = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::TileShape, typename Cfg::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD,                            // no C operand
      typename Cfg::ElementD, LayoutD*, kAlignD,
      typename Schedule<Cfg>::Epilogue, Fusion>::CollectiveOp;
};

template <class Cfg, bool kBlockScaled = Cfg::kBlockScaled>
struct Mainloop;

template <class Cfg>
struct Mainloop<Cfg, false> {
  static constexpr int kAlign = 16 / sizeof(typename Cfg::ElementAB);
  using Collective = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      typename Cfg::ElementAB, LayoutA*, kAlign,
      typename Cfg::ElementAB, LayoutB*, kAlign,
      float, typename Cfg::TileShape, typename Cfg::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue<Cfg>::Collective::SharedStorage))>,
      typename Schedule<Cfg>::Mainloop>::CollectiveOp;
};

template <class Cfg>
struct Mainloop<Cfg, true> {
  static constexpr int kAlign = 16 / sizeof(typename Cfg::ElementAB);
  using Collective = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      typename Cfg::ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlign,
      typename Cfg::ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlign,
      float, typename Cfg::TileShape, typename Cfg::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue<Cfg>::Collective::SharedStorage))>,
      typename Schedule<Cfg>::Mainloop>::CollectiveOp;
};

template <class Cfg>
struct Grouped {
  using ElementAB = typename Cfg::ElementAB;
  using ElementD = typename Cfg::ElementD;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, typename Mainloop<Cfg>::Collective,
                                                      typename Epilogue<Cfg>::Collective>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Kernel::Arguments;
  using Params = typename Kernel::Params;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The setup kernel writes these strides element by element; pin the types it assumes.
  static_assert(std::is_same_v<StrideA, Stride<int64_t, _1, _0>>, "A must be K-major (row-major)");
  static_assert(std::is_same_v<StrideB, Stride<int64_t, _1, _0>>, "B must be K-major");
  static_assert(std::is_same_v<StrideD, Stride<int64_t, _1, _0>>, "D must be row-major");

  // Per-expert arrays the kernel reads, carved from the workspace after CUTLASS's own part
  // (per-SM TMA descriptors), each 128-byte aligned.
  struct Arrays {
    Shape3* shapes;
    const ElementAB** ptr_a;
    const ElementAB** ptr_b;
    ElementD** ptr_d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    const float** ptr_sfa;   // fp8 only
    const float** ptr_sfb;   // fp8 only
    const float** ptr_bias;  // bias only
  };

  // Arguments with everything but the workspace-derived pointers; enough for size queries.
  static Arguments arguments(int64_t E, int sm_count, int max_active_clusters, const Arrays& arr,
                             bool has_bias) {
    Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = ProblemShape{static_cast<int>(E), arr.shapes, nullptr};  // shapes live on the device only
    if constexpr (Cfg::kBlockScaled) {
      // The scale layouts are derived in the kernel from each group's (M, N, K); the layout
      // arrays are not read, so none are passed.
      args.mainloop = {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b, arr.ptr_sfa, nullptr, arr.ptr_sfb, nullptr};
    } else {
      args.mainloop = {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b};
    }
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = arr.ptr_d;
    args.epilogue.dD = arr.stride_d;
    // Tree arguments in child order: acc fetch, bias broadcast, then the add.
    args.epilogue.thread = {{}, {has_bias ? arr.ptr_bias : nullptr, 0.0f, {}}, {}};
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = sm_count;
    args.hw_info.max_active_clusters = max_active_clusters;
    return args;
  }

  static size_t cutlass_workspace(int64_t E, int sm_count) {
    Arrays none{};
    return align_array(Kernel::get_workspace_size(arguments(E, sm_count, 0, none, false)));
  }

  // The arrays' one layout: from the carver's base (null: measure only).
  static Arrays lay_out(Carver& c, int64_t E) {
    const size_t e = static_cast<size_t>(E);
    Arrays a{};
    a.shapes = c.take<Shape3>(e);
    a.ptr_a = c.take<const ElementAB*>(e);
    a.ptr_b = c.take<const ElementAB*>(e);
    a.ptr_d = c.take<ElementD*>(e);
    a.stride_a = c.take<StrideA>(e);
    a.stride_b = c.take<StrideB>(e);
    a.stride_d = c.take<StrideD>(e);
    a.ptr_bias = c.take<const float*>(e);
    if (Cfg::kBlockScaled) {
      a.ptr_sfa = c.take<const float*>(e);
      a.ptr_sfb = c.take<const float*>(e);
    }
    return a;
  }

  static size_t arrays_bytes(int64_t E) {
    Carver c{nullptr};
    lay_out(c, E);
    return c.used;
  }

  static size_t workspace_bytes(int64_t E, int sm_count) { return cutlass_workspace(E, sm_count) + arrays_bytes(E); }

  static Arrays carve(void* workspace, int64_t E, int sm_count) {
    Carver c{static_cast<char*>(workspace) + cutlass_workspace(E, sm_count)};
    return lay_out(c, E);
  }
};

// What the setup kernel reads and writes.
template <class G>
struct SetupParams {
  typename G::Arrays arr;
  const int32_t* offsets;
  const typename G::ElementAB* a;
  const typename G::ElementAB* w;
  const float* a_scale;
  const float* w_scale;
  const float* bias;
  typename G::ElementD* c;
  int32_t R, E;     // E: all experts (the offsets scanned)
  int32_t e0, groups;  // the experts this launch computes; arrays and w are indexed by e - e0
  bool zero_tail;   // write rows [last offset, R) as zeros
  int64_t N, K;
};

// Per-expert problem shapes, operand pointers and strides from expert_first_token_offset, then the
// rows past the last expert zeroed. Block 0 does the per-expert part; every block takes a share of
// the zero tail.
template <class G>
__global__ void __launch_bounds__(kSetupThreads) setup_groups(SetupParams<G> s) {
  extern __shared__ int32_t s_hi[];  // [E], block 0 only
  int last;
  if (blockIdx.x == 0) {
    last = expert_row_ends(s.offsets, s.E, s.R, s_hi);
    const int64_t sfk = s.K / 128;
    for (int i = static_cast<int>(threadIdx.x); i < s.groups; i += kSetupThreads) {
      const int e = s.e0 + i;
      const int lo = e > 0 ? s_hi[e - 1] : 0;
      const int hi = s_hi[e];
      s.arr.shapes[i] = typename G::Shape3(hi - lo, static_cast<int>(s.N), static_cast<int>(s.K));
      s.arr.ptr_a[i] = s.a + static_cast<int64_t>(lo) * s.K;
      s.arr.ptr_b[i] = s.w + static_cast<int64_t>(i) * s.N * s.K;
      s.arr.ptr_d[i] = s.c + static_cast<int64_t>(lo) * s.N;
      s.arr.stride_a[i] = typename G::StrideA(s.K, _1{}, _0{});
      s.arr.stride_b[i] = typename G::StrideB(s.K, _1{}, _0{});
      s.arr.stride_d[i] = typename G::StrideD(s.N, _1{}, _0{});
      if (s.bias) s.arr.ptr_bias[i] = s.bias + static_cast<int64_t>(e) * s.N;
      if (s.arr.ptr_sfa) {
        s.arr.ptr_sfa[i] = s.a_scale + static_cast<int64_t>(lo) * sfk;
        s.arr.ptr_sfb[i] = s.w_scale + static_cast<int64_t>(e) * (s.N / 128) * sfk;
      }
    }
  } else {
    last = last_expert_row(s.offsets, s.E, s.R);
  }
  if (s.zero_tail) zero_rows(s.c, s.N * static_cast<int64_t>(sizeof(typename G::ElementD)), last, s.R);
}

// Per-device facts of one kernel, set up once: the shared-memory limit raised to what the kernel
// needs (required above 48 KB) and the number of clusters that fit at once (the persistent grid).
template <class G>
std::string device_setup(int device, int* max_active_clusters) {
  static std::mutex mu;
  static bool done[64] = {};
  static int clusters[64] = {};
  if (device < 0 || device >= 64) return "device index out of range";
  std::lock_guard<std::mutex> lock(mu);
  if (!done[device]) {
    const void* fn = reinterpret_cast<const void*>(cutlass::device_kernel<typename G::Kernel>);
    const int smem = G::Kernel::SharedStorageSize;
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
    }
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    const unsigned cx = cute::size<0>(typename G::Kernel::ClusterShape{});
    const unsigned cy = cute::size<1>(typename G::Kernel::ClusterShape{});
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cx;
    attr.val.clusterDim.y = cy;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(cx, cy, 1);
    cfg.blockDim = dim3(G::Kernel::MaxThreadsPerBlock, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, fn, &cfg) != cudaSuccess) {
      cudaGetLastError();
      n = 0;  // CUTLASS then sizes the grid from the SM count
    }
    clusters[device] = n;
    done[device] = true;
  }
  *max_active_clusters = clusters[device];
  return {};
}

// Blocks of the setup kernel for `work` 16-byte items (zero-tail vectors, transposed scales): about
// eight per thread, at least one, at most two per SM.
inline int64_t setup_blocks(int64_t work, int sm_count) {
  const int64_t blocks = (work + kSetupThreads * 8 - 1) / (kSetupThreads * 8);
  return blocks < 1 ? 1 : (blocks > 2 * sm_count ? 2 * sm_count : blocks);
}

// The grouped GEMM of `args` (its per-expert arrays already written on the device): CUTLASS's
// checks, its workspace initialized in `workspace`, the launch on `stream`.
template <class G>
std::string launch_gemm(typename G::Arguments args, void* workspace, int device, cudaStream_t stream) {
  args.hw_info.device_id = device;
  if (!G::Kernel::can_implement(args)) return "CUTLASS cannot implement these arguments";
  cutlass::Status st = G::Kernel::initialize_workspace(args, workspace, stream);
  if (st != cutlass::Status::kSuccess)
    return std::string("initialize_workspace: ") + cutlass::cutlassGetStatusString(st);
  typename G::Params params = G::Kernel::to_underlying_arguments(args, workspace);
  st = G::Gemm::run(params, stream);
  if (st != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    return std::string("launching the grouped GEMM: ") + cutlass::cutlassGetStatusString(st) + " (" +
           cudaGetErrorString(e) + ")";
  }
  return {};
}

template <class G>
std::string run(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream) {
  using ElementAB = typename G::ElementAB;
  using ElementD = typename G::ElementD;
  int clusters = 0;
  std::string err = device_setup<G>(dev.device, &clusters);
  if (!err.empty()) return err;
  if (g.E > INT32_MAX || g.R > INT32_MAX) return "problem too large";

  const typename G::Arrays arr = G::carve(g.workspace, g.E, dev.sm_count);
  SetupParams<G> s{};
  s.arr = arr;
  s.offsets = g.offsets;
  s.a = static_cast<const ElementAB*>(g.a);
  s.w = static_cast<const ElementAB*>(g.w);
  s.a_scale = g.a_scale;
  s.w_scale = g.w_scale;
  s.bias = g.bias;
  s.c = static_cast<ElementD*>(g.c);
  const int64_t groups = g.groups < 0 ? g.E : g.groups;
  if (g.e0 < 0 || groups < 1 || g.e0 + groups > g.E) return "expert range out of bounds";
  s.R = static_cast<int32_t>(g.R);
  s.E = static_cast<int32_t>(g.E);
  s.e0 = static_cast<int32_t>(g.e0);
  s.groups = static_cast<int32_t>(groups);
  s.zero_tail = g.zero_tail;
  s.N = g.N;
  s.K = g.K;
  // Enough blocks that a large zero tail (expert parallelism: most rows elsewhere) is written at
  // bandwidth; an empty tail costs each block one pass over the offsets.
  const int64_t blocks =
      g.zero_tail ? setup_blocks(g.R * g.N * static_cast<int64_t>(sizeof(ElementD)) / 16, dev.sm_count) : 1;
  setup_groups<G><<<static_cast<unsigned>(blocks), kSetupThreads, g.E * sizeof(int32_t), stream>>>(s);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launching setup_groups: ") + cudaGetErrorString(e);

  return launch_gemm<G>(G::arguments(groups, dev.sm_count, clusters, arr, g.bias != nullptr), g.workspace,
                        dev.device, stream);
}

}  // namespace detail
}  // namespace prefill
}  // namespace hj

// Defines the two entry points of one kind (gemm_prefill_sm90.h).
#define HJ_DEFINE_PREFILL_KIND(SUFFIX, CFG)                                                       \
  namespace hj {                                                                                  \
  namespace prefill {                                                                             \
  size_t workspace_bytes_##SUFFIX(int64_t E, int sm_count) {                                      \
    return detail::Grouped<CFG>::workspace_bytes(E, sm_count);                                    \
  }                                                                                               \
  std::string run_##SUFFIX(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream) { \
    return detail::run<detail::Grouped<CFG>>(args, dev, stream);                                  \
  }                                                                                               \
  }                                                                                               \
  }
