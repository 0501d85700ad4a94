// Decode GEMM kernels for 16-bit float weights (bf16 / fp16, the activations' type).
#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {

template <>
bool launch_family<WeightType::kFloat>(const DecodeLaunch& D, ActKind ak, Deq, bool, dim3 grid, size_t smem,
                                       cudaStream_t stream) {
  if (ak == ActKind::kF16)
    return launch_variant<WeightType::kFloat, ActKind::kF16, Deq::kRaw>(D, grid, smem, stream);
  else
    return launch_variant<WeightType::kFloat, ActKind::kBF16, Deq::kRaw>(D, grid, smem, stream);
  return false;
}

}  // namespace decode
}  // namespace hj
