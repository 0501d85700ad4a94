// The prefill grouped GEMM on 4-bit weight codes (gemm_prefill_sm90.h, Kind::kU4Bf16 and
// kU4Bf16N64): CUTLASS's ptr-array mixed-input collective, which loads the codes by TMA, converts
// and scales them in registers and feeds them to a register-sourced wgmma, so no dequantized copy
// of the weights is ever written. Included by one translation unit per configuration
// (gemm_prefill_sm90_u4_*.cu).
//
// The narrow operand must be wgmma's A (the register one), so each expert computes the transposed
// product D^T = W A^T: the problem of expert e is (N, rows_e, K) with
//   A = w [E, N, K/2] bytes of codes: expert e is an N x K, K-contiguous (row-major) matrix;
//   B = a [R, K] bf16: expert e's rows, K-contiguous (a "column-major" K x rows_e matrix);
//   D = c [R, N] bf16: as the N x rows_e product it is column-major (N contiguous), stride N;
//   scales: CUTLASS wants them N-contiguous, [K / group_k, N] per expert, where ours are
//   [N, K / group_k]: the setup kernel writes the transposed copy into the workspace (2 bytes per
//   scale, 1/128 of what dequantizing the experts would write at group_k = 128).
// The bias is a column vector of the transposed problem (one value per weight row).
//
// Exactness. The contract's weight is w' = bf16(float(q - 8) * float(scale)), one rounding of an
// exact float product (a 4-bit integer times an 8-bit significand). Here the code becomes the bf16
// q - 8 exactly (convert below: 128 + q is exact in bf16, and 128 + q - 136 is exact), then the
// collective's ConvertAndScale step multiplies it by the bf16 scale with one bf16 multiply
// (cutlass::bfloat16_t's operator*=, __hmul: the exact product rounded to nearest even once), which
// is w' bit for bit, subnormals and overflow included. wgmma then accumulates w' x a in float32 as
// the bf16 kind does on dequantized weights, and the epilogue rounds acc + bias once.
#pragma once

#include <cuda_bf16.h>

#include "gemm_prefill_sm90_kernel.cuh"
// After the CUTLASS headers above, which it needs: the converter specialized below.
#include "cutlass/detail/collective/mixed_input_utils.hpp"

namespace hj {
namespace prefill {
namespace detail {

// A 4-bit code q in 0..15 that stands for q - 8 (our uint4 weights without zero points). Stored
// like CUTLASS's uint4b_t (two per byte, the even k in the low nibble); a type of its own so that
// the mainloop's conversion to bf16 (below) subtracts the offset.
struct u4o8_t : cutlass::uint4b_t {
  using cutlass::uint4b_t::uint4b_t;
};

}  // namespace detail
}  // namespace prefill
}  // namespace hj

namespace cutlass {

template <>
struct sizeof_bits<hj::prefill::detail::u4o8_t> {
  static constexpr int value = 4;
};

// Eight codes of one 32-bit register (value j in bits 4j..4j+3, the wgmma fragment's order) to eight
// bf16 values q - 8. Each output register holds values 2i (low half) and 2i + 1 (high half): byte i
// of the codes and of the codes shifted by a nibble are placed in the two halves, the nibble is
// masked into the mantissa of 128.0 (0x4300 | q = 128 + q, exact) and 136 is subtracted (exact).
template <class LayoutIn, class LayoutOut>
struct LayoutAwareConvertImpl<hj::prefill::detail::u4o8_t, bfloat16_t, LayoutIn, LayoutOut> {
  template <class EngineIn, class EngineOut>
  CUTLASS_DEVICE static void convert(cute::Tensor<EngineIn, LayoutIn> const& src,
                                     cute::Tensor<EngineOut, LayoutOut>& dst) {
    static_assert(cute::is_same_v<LayoutIn, cute::Layout<cute::_8, cute::_1>> &&
                      cute::is_same_v<LayoutOut, cute::Layout<cute::_8, cute::_1>>,
                  "expected eight consecutive values of a wgmma A fragment");
    const uint32_t codes = cute::recast<uint32_t>(src)(0);
    const uint32_t shifted = codes >> 4;
    auto&& out = cute::recast<uint32_t>(dst);
    const uint32_t k136 = 0x43084308u;  // bf16 {136, 136}
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      const uint32_t pair = __byte_perm(codes, shifted, static_cast<uint32_t>(i | ((4 + i) << 8)));
      const uint32_t biased = (pair & 0x000f000fu) | 0x43004300u;
      const __nv_bfloat162 v = __hsub2(reinterpret_cast<const __nv_bfloat162&>(biased),
                                       reinterpret_cast<const __nv_bfloat162&>(k136));
      out(i) = reinterpret_cast<const uint32_t&>(v);
    }
  }
};

// Any other conversion of the codes would read q rather than q - 8: a compile error.
template <FloatRoundStyle Round>
struct NumericConverter<bfloat16_t, hj::prefill::detail::u4o8_t, Round> {
  static_assert(static_cast<int>(Round) < 0, "offset-8 codes convert through LayoutAwareConvertImpl only");
};
template <int N, FloatRoundStyle Round, typename Transform>
struct NumericArrayConverter<bfloat16_t, hj::prefill::detail::u4o8_t, N, Round, Transform> {
  static_assert(N < 0, "offset-8 codes convert through LayoutAwareConvertImpl only");
};

}  // namespace cutlass

namespace hj {
namespace prefill {
namespace detail {

// One mixed-input configuration: tile (weight rows, token rows, K) and cluster shapes; cooperative
// consumers (the two warpgroups split the weight rows of a tile).
template <class TileShape_, class ClusterShape_>
struct MixedConfig {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  static_assert(size<2>(TileShape{}) == kMixedTileK, "the dispatch checks scale groups against kMixedTileK");
};

template <class Cfg>
struct MixedGrouped {
  using ElementW = u4o8_t;
  using ElementAct = cutlass::bfloat16_t;
  using ElementScale = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  static constexpr int kTileK = cute::size<2>(TileShape{});

  using LayoutW = cutlass::layout::RowMajor;       // N x K, K contiguous
  using LayoutAct = cutlass::layout::ColumnMajor;  // K x rows, K contiguous
  using LayoutD = cutlass::layout::ColumnMajor;    // N x rows, N contiguous
  static constexpr int kAlignW = 128 / cutlass::sizeof_bits<ElementW>::value;
  static constexpr int kAlign16 = 8;

  // D = round_to_nearest(acc + bias[e][n]) in float32; the bias of the transposed problem is a
  // column vector per expert (a per-group pointer array; null: no bias).
  using Bias = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float*, float, Stride<_1, _0, _0>, 4, true>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float, cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch, Bias>;
  using EpilogueCollective = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlign16,  // no C operand
      ElementD, LayoutD*, kAlign16,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

  // The codes paired with their scale type: ConvertAndScale (no zero points).
  using MainloopCollective = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<ElementW, ElementScale>, LayoutW*, kAlignW,
      ElementAct, LayoutAct*, kAlign16,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueCollective::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  static_assert(MainloopCollective::KernelConversionMode == cutlass::detail::ConversionMode::ConvertAndScale,
                "expected the convert-and-scale mainloop");

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, MainloopCollective, EpilogueCollective>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Kernel::Arguments;
  using Params = typename Kernel::Params;
  using StrideW = typename Kernel::InternalStrideA;
  using StrideAct = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using StrideScale = typename MainloopCollective::StrideScale;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The setup kernel writes these strides element by element; pin the types it assumes.
  static_assert(std::is_same_v<StrideW, Stride<int64_t, _1, _0>>, "weights must be K-major");
  static_assert(std::is_same_v<StrideAct, Stride<int64_t, _1, _0>>, "activations must be K-major");
  static_assert(std::is_same_v<StrideD, Stride<_1, int64_t, _0>>, "D must be N-major (c row-major)");
  static_assert(std::is_same_v<StrideScale, Stride<_1, int64_t, int64_t>>, "scales must be N-major");

  // Per-expert arrays the kernel reads, carved from the workspace after CUTLASS's own part, each
  // 128-byte aligned; then the transposed scales [E, scale_cols, N].
  struct Arrays {
    Shape3* shapes;
    const ElementW** ptr_w;
    const ElementAct** ptr_act;
    ElementD** ptr_d;
    const ElementScale** ptr_scale;
    const float** ptr_bias;
    StrideW* stride_w;
    StrideAct* stride_act;
    StrideD* stride_d;
    StrideScale* stride_scale;
    uint16_t* scales;  // [E, scale_cols, N]
  };

  // Arguments with everything but the workspace-derived pointers; enough for size queries.
  static Arguments arguments(int64_t E, int sm_count, int max_active_clusters, const Arrays& arr, int chunk,
                             bool has_bias) {
    Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = ProblemShape{static_cast<int>(E), arr.shapes, nullptr};  // shapes live on the device only
    args.mainloop.ptr_A = arr.ptr_w;
    args.mainloop.dA = arr.stride_w;
    args.mainloop.ptr_B = arr.ptr_act;
    args.mainloop.dB = arr.stride_act;
    args.mainloop.ptr_S = arr.ptr_scale;
    args.mainloop.dS = arr.stride_scale;
    args.mainloop.chunk_size = chunk;
    args.mainloop.ptr_Z = nullptr;
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
    return align_array(Kernel::get_workspace_size(arguments(E, sm_count, 0, none, kTileK, false)));
  }

  // The per-expert arrays' one layout: from the carver's base (null: measure only).
  static Arrays lay_out(Carver& c, int64_t E) {
    const size_t e = static_cast<size_t>(E);
    Arrays a{};
    a.shapes = c.take<Shape3>(e);
    a.ptr_w = c.take<const ElementW*>(e);
    a.ptr_act = c.take<const ElementAct*>(e);
    a.ptr_d = c.take<ElementD*>(e);
    a.ptr_scale = c.take<const ElementScale*>(e);
    a.ptr_bias = c.take<const float*>(e);
    a.stride_w = c.take<StrideW>(e);
    a.stride_act = c.take<StrideAct>(e);
    a.stride_d = c.take<StrideD>(e);
    a.stride_scale = c.take<StrideScale>(e);
    return a;
  }

  static size_t arrays_bytes(int64_t E) {
    Carver c{nullptr};
    lay_out(c, E);
    return c.used;
  }

  // The kernel's part of the workspace (within kWorkspaceBase + kWorkspacePerExpert * E); the
  // transposed scales come on top (mixed_scale_bytes).
  static size_t workspace_bytes(int64_t E, int sm_count) { return cutlass_workspace(E, sm_count) + arrays_bytes(E); }

  static Arrays carve(void* workspace, int64_t E, int sm_count) {
    Carver c{static_cast<char*>(workspace) + cutlass_workspace(E, sm_count)};
    Arrays a = lay_out(c, E);
    a.scales = reinterpret_cast<uint16_t*>(c.base + c.used);
    return a;
  }
};

// What the mixed setup kernel reads and writes.
template <class G>
struct MixedSetupParams {
  typename G::Arrays arr;
  const int32_t* offsets;
  const uint8_t* w;       // [E, N, K / 2] codes
  const uint16_t* scale;  // [E, N, scale_cols] bf16
  const typename G::ElementAct* a;
  const float* bias;
  typename G::ElementD* c;
  int32_t R, E;
  int64_t N, K, scale_cols;
};

// Per-expert shapes, pointers and strides of the transposed problems (block 0), the scales
// transposed to [E, scale_cols, N] and the rows past the last expert zeroed (every block).
template <class G>
__global__ void __launch_bounds__(kSetupThreads) setup_mixed_groups(MixedSetupParams<G> s) {
  extern __shared__ int32_t s_hi[];  // [E], block 0 only
  int last;
  if (blockIdx.x == 0) {
    last = expert_row_ends(s.offsets, s.E, s.R, s_hi);
    for (int e = static_cast<int>(threadIdx.x); e < s.E; e += kSetupThreads) {
      const int lo = e > 0 ? s_hi[e - 1] : 0;
      const int hi = s_hi[e];
      s.arr.shapes[e] = typename G::Shape3(static_cast<int>(s.N), hi - lo, static_cast<int>(s.K));
      s.arr.ptr_w[e] = reinterpret_cast<const typename G::ElementW*>(s.w + static_cast<int64_t>(e) * s.N * (s.K / 2));
      s.arr.ptr_act[e] = s.a + static_cast<int64_t>(lo) * s.K;
      s.arr.ptr_d[e] = s.c + static_cast<int64_t>(lo) * s.N;
      s.arr.ptr_scale[e] =
          reinterpret_cast<const typename G::ElementScale*>(s.arr.scales + static_cast<int64_t>(e) * s.scale_cols * s.N);
      s.arr.ptr_bias[e] = s.bias ? s.bias + static_cast<int64_t>(e) * s.N : nullptr;
      s.arr.stride_w[e] = typename G::StrideW(s.K, _1{}, _0{});
      s.arr.stride_act[e] = typename G::StrideAct(s.K, _1{}, _0{});
      s.arr.stride_d[e] = typename G::StrideD(_1{}, s.N, _0{});
      s.arr.stride_scale[e] = typename G::StrideScale(_1{}, s.N, s.scale_cols * s.N);
    }
  } else {
    last = last_expert_row(s.offsets, s.E, s.R);
  }
  // Scales: one thread per (expert, weight row, run of up to 8 groups) reads its run (adjacent
  // in memory) and writes it to 8 group rows, consecutive threads taking consecutive weight rows so
  // the writes coalesce. 32-bit index math (the host keeps the count below 2^31).
  const uint32_t N = static_cast<uint32_t>(s.N), cols = static_cast<uint32_t>(s.scale_cols);
  const uint32_t runs = (cols + 7) / 8;
  const uint32_t total = static_cast<uint32_t>(s.E) * runs * N;
  for (uint32_t i = blockIdx.x * kSetupThreads + threadIdx.x; i < total; i += gridDim.x * kSetupThreads) {
    const uint32_t er = i / N;
    const uint32_t n = i - er * N;
    const uint32_t e = er / runs;
    const uint32_t j0 = (er - e * runs) * 8;
    const uint16_t* src = s.scale + (static_cast<size_t>(e) * N + n) * cols + j0;
    uint16_t* dst = s.arr.scales + (static_cast<size_t>(e) * cols + j0) * N + n;
#pragma unroll
    for (uint32_t j = 0; j < 8; ++j)
      if (j0 + j < cols) dst[static_cast<size_t>(j) * N] = src[j];
  }
  zero_rows(s.c, s.N * static_cast<int64_t>(sizeof(typename G::ElementD)), last, s.R);
}

template <class G>
std::string run_mixed(const GroupedArgs& g, const DeviceInfo& dev, cudaStream_t stream) {
  int clusters = 0;
  std::string err = device_setup<G>(dev.device, &clusters);
  if (!err.empty()) return err;
  if (g.E > INT32_MAX || g.R > INT32_MAX) return "problem too large";
  if (g.e0 != 0 || (g.groups >= 0 && g.groups != g.E) || !g.zero_tail) return "the mixed-input kind runs all experts at once";
  if (g.K % 32 || g.N % 8 || g.scale_cols < 1) return "K must be a multiple of 32, N of 8";
  if (g.E * g.N * ((g.scale_cols + 7) / 8) >= (int64_t{1} << 31)) return "too many scales";
  // The group length along K: whole tiles, or one group spanning K.
  const int64_t chunk = g.scale_cols == 1 ? g.K : g.group_k;
  if (chunk != g.K && chunk % G::kTileK) return "scale groups must be whole K tiles or span K";

  const typename G::Arrays arr = G::carve(g.workspace, g.E, dev.sm_count);
  MixedSetupParams<G> s{};
  s.arr = arr;
  s.offsets = g.offsets;
  s.w = static_cast<const uint8_t*>(g.w);
  s.scale = static_cast<const uint16_t*>(g.w_scale_raw);
  s.a = static_cast<const typename G::ElementAct*>(g.a);
  s.bias = g.bias;
  s.c = static_cast<typename G::ElementD*>(g.c);
  s.R = static_cast<int32_t>(g.R);
  s.E = static_cast<int32_t>(g.E);
  s.N = g.N;
  s.K = g.K;
  s.scale_cols = g.scale_cols;
  // Enough blocks that the zero tail and the scale transposition run at bandwidth.
  const int64_t blocks = setup_blocks(std::max<int64_t>(g.R * g.N * static_cast<int64_t>(sizeof(typename G::ElementD)) / 16,
                                                       g.E * g.N * ((g.scale_cols + 7) / 8)),
                                      dev.sm_count);
  setup_mixed_groups<G><<<static_cast<unsigned>(blocks), kSetupThreads, g.E * sizeof(int32_t), stream>>>(s);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launching setup_mixed_groups: ") + cudaGetErrorString(e);

  return launch_gemm<G>(G::arguments(g.E, dev.sm_count, clusters, arr, static_cast<int>(chunk), g.bias != nullptr),
                        g.workspace, dev.device, stream);
}

}  // namespace detail
}  // namespace prefill
}  // namespace hj

// Defines the two entry points of one mixed-input kind (gemm_prefill_sm90.h).
#define HJ_DEFINE_PREFILL_MIXED_KIND(SUFFIX, CFG)                                                 \
  namespace hj {                                                                                  \
  namespace prefill {                                                                             \
  size_t workspace_bytes_##SUFFIX(int64_t E, int sm_count) {                                      \
    return detail::MixedGrouped<CFG>::workspace_bytes(E, sm_count);                               \
  }                                                                                               \
  std::string run_##SUFFIX(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream) { \
    return detail::run_mixed<detail::MixedGrouped<CFG>>(args, dev, stream);                       \
  }                                                                                               \
  }                                                                                               \
  }
