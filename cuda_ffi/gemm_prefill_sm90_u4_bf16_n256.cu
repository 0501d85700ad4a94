// Prefill grouped GEMM, uint4 codes (offset 8) with bf16 group scales x bf16 -> bf16, for experts
// of many rows (kTallRowsPerExpertMixed and up; gemm_prefill_sm90_mixed.cuh): tiles of 128 weight
// rows x 256 token rows x 64 k, so each converted code tile feeds twice the tokens of the 128-row
// kind; clusters of two CTAs along the weight rows share each activation tile by multicast.
#include "gemm_prefill_sm90_mixed.cuh"

namespace hj {
namespace prefill {
namespace detail {
using U4Bf16N256Config = MixedConfig<Shape<_128, _256, _64>, Shape<_2, _1, _1>>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_MIXED_KIND(u4_bf16_n256, hj::prefill::detail::U4Bf16N256Config)
