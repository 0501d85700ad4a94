// Decode GEMM kernels for int8 weights.
#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {

template <>
bool launch_family<WeightType::kInt8>(const DecodeLaunch& D, ActKind ak, Deq dq, bool f32_scales, dim3 grid,
                                       size_t smem, cudaStream_t stream) {
  if (ak == ActKind::kBF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kBF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kBF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kBF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kFp8, Deq::kCodes, true>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && !f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kFp8, Deq::kCodes>(D, grid, smem, stream);
  else if (ak == ActKind::kI8 && dq == Deq::kCodes && f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kI8, Deq::kCodes, true>(D, grid, smem, stream);
  else if (ak == ActKind::kI8 && dq == Deq::kCodes && !f32_scales)
    return launch_variant<WeightType::kInt8, ActKind::kI8, Deq::kCodes>(D, grid, smem, stream);
  return false;
}

}  // namespace decode
}  // namespace hj
