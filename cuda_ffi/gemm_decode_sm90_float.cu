// Decode GEMM kernels for 16-bit float weights (bf16 / fp16, the activations' type).
#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {

template <>
void launch_family<WeightType::kFloat>(const DecodeLaunch& D, ActKind ak, Deq, dim3 grid, size_t smem,
                                       cudaStream_t stream) {
  if (ak == ActKind::kF16)
    launch_variant<WeightType::kFloat, ActKind::kF16, Deq::kRaw>(D, grid, smem, stream);
  else
    launch_variant<WeightType::kFloat, ActKind::kBF16, Deq::kRaw>(D, grid, smem, stream);
}

}  // namespace decode
}  // namespace hj
