// The generic tensor-core expert GEMM with 32 rows per CTA, all weight and activation types.
#include "gemm_kernels_sm80.cuh"

namespace hj {
namespace gemm {
HJ_DEFINE_LAUNCH_SM80(32)
}  // namespace gemm
}  // namespace hj
