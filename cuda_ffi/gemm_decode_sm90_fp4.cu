// Decode GEMM kernels for fp4 e2m1 weights (MXFP4 with e8m0 scales, NVFP4 with e4m3 scales and scale2).
#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {

template <>
bool launch_family<WeightType::kFp4E2M1>(const DecodeLaunch& D, ActKind ak, Deq dq, bool f32_scales, dim3 grid,
                                       size_t smem, cudaStream_t stream) {
  if (ak == ActKind::kBF16 && dq == Deq::kPackedFp4)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kBF16, Deq::kPackedFp4>(D, grid, smem, stream);
  else if (ak == ActKind::kBF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kBF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kBF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kBF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kFp8, Deq::kCodes, true>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && !f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kFp8, Deq::kCodes>(D, grid, smem, stream);
  else if (ak == ActKind::kI8 && dq == Deq::kCodes && f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kI8, Deq::kCodes, true>(D, grid, smem, stream);
  else if (ak == ActKind::kI8 && dq == Deq::kCodes && !f32_scales)
    return launch_variant<WeightType::kFp4E2M1, ActKind::kI8, Deq::kCodes>(D, grid, smem, stream);
  return false;
}

}  // namespace decode
}  // namespace hj
