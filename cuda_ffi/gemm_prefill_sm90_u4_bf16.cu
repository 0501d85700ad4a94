// Prefill grouped GEMM, uint4 codes (offset 8) with bf16 group scales x bf16 -> bf16
// (gemm_prefill_sm90_mixed.cuh): tiles of 128 weight rows x 128 token rows x 64 k (two consumer
// warpgroups of 64 weight rows each); clusters of two CTAs along the weight rows share each
// activation tile by multicast (the activations are 4x the bytes of the codes per tile).
#include "gemm_prefill_sm90_mixed.cuh"

namespace hj {
namespace prefill {
namespace detail {
using U4Bf16Config = MixedConfig<Shape<_128, _128, _64>, Shape<_2, _1, _1>>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_MIXED_KIND(u4_bf16, hj::prefill::detail::U4Bf16Config)
