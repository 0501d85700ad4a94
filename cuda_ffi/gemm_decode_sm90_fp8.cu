// Decode GEMM kernels for fp8 e4m3 weights (per-tensor, per-channel, 128x128 blocks).
#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {

template <>
bool launch_family<WeightType::kFp8E4M3>(const DecodeLaunch& D, ActKind ak, Deq dq, bool f32_scales, dim3 grid,
                                       size_t smem, cudaStream_t stream) {
  if (ak == ActKind::kBF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kBF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kBF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kBF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kF16, Deq::kF32, true>(D, grid, smem, stream);
  else if (ak == ActKind::kF16 && dq == Deq::kF32 && !f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kF16, Deq::kF32>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && D.xq && f32_scales)  // quantizing its rows (D.xq)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kFp8, Deq::kCodes, true, true, true>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && D.xq && !f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kFp8, Deq::kCodes, false, true, true>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kFp8, Deq::kCodes, true>(D, grid, smem, stream);
  else if (ak == ActKind::kFp8 && dq == Deq::kCodes && !f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kFp8, Deq::kCodes>(D, grid, smem, stream);
  else if (ak == ActKind::kI8 && dq == Deq::kCodes && f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kI8, Deq::kCodes, true>(D, grid, smem, stream);
  else if (ak == ActKind::kI8 && dq == Deq::kCodes && !f32_scales)
    return launch_variant<WeightType::kFp8E4M3, ActKind::kI8, Deq::kCodes>(D, grid, smem, stream);
  return false;
}

}  // namespace decode
}  // namespace hj
