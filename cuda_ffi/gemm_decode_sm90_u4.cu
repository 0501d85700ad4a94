// Decode GEMM kernels for 4-bit integer weights (GPTQ/AWQ, with or without zero points). With 8-bit
// activations (no scheme pairs them; the contract allows it) the scale type is read at run time:
// the compile-time float32 variant would spill.
#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {

template <>
bool launch_family<WeightType::kUInt4>(const DecodeLaunch& D, ActKind ak, Deq dq, bool f32_scales, dim3 grid,
                                       size_t smem, cudaStream_t stream) {
  // The common packed case without zero points (GPTQ symmetric) has its own variants: no zero-point
  // loads or unpacking in the main loop.
  const bool zero = D.g.p.w.zero != nullptr;
  if (ak == ActKind::kBF16 && dq == Deq::kPackedU4 && !zero)
    return launch_variant<WeightType::kUInt4, ActKind::kBF16, Deq::kPackedU4, false, false>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kPackedU4 && !zero)
    return launch_variant<WeightType::kUInt4, ActKind::kF16, Deq::kPackedU4, false, false>(D, grid, smem, stream);
  else if (ak == ActKind::kBF16 && dq == Deq::kPackedU4)
    return launch_variant<WeightType::kUInt4, ActKind::kBF16, Deq::kPackedU4>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kPackedU4)
    return launch_variant<WeightType::kUInt4, ActKind::kF16, Deq::kPackedU4>(D, grid, smem, stream);
  else if (ak == ActKind::kBF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kUInt4, ActKind::kBF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kBF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kUInt4, ActKind::kBF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kUInt4, ActKind::kF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kUInt4, ActKind::kF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes)
    return launch_variant<WeightType::kUInt4, ActKind::kFp8, Deq::kCodes>(D, grid, smem, stream);
  else if (ak == ActKind::kI8 && dq == Deq::kCodes)
    return launch_variant<WeightType::kUInt4, ActKind::kI8, Deq::kCodes>(D, grid, smem, stream);
  return false;
}

}  // namespace decode
}  // namespace hj
