// Prefill grouped GEMM, bf16 x bf16 -> bf16 (gemm_prefill_sm90_kernel.cuh): 128 x 256 x 64 tiles
// (two consumer warpgroups of 64 x 256), clusters of two CTAs along N sharing each A tile by
// multicast.
#include "gemm_prefill_sm90_kernel.cuh"

namespace hj {
namespace prefill {
namespace detail {
using Bf16Config = Config<cutlass::bfloat16_t, cutlass::bfloat16_t, false, Shape<_128, _256, _64>, Shape<_1, _2, _1>>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_KIND(bf16, hj::prefill::detail::Bf16Config)
