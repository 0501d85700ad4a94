// Prefill grouped GEMM for experts of few rows (32 to 127 on average), fp8 e4m3 codes with
// 1 x 128 activation and 128 x 128 weight f32 block scales -> bf16 (gemm_prefill_sm90_kernel.cuh):
// 64 x 128 x 128 tiles, pingpong (one K tile is one scale block, as in the 128-row kind).
#include "gemm_prefill_sm90_kernel.cuh"

namespace hj {
namespace prefill {
namespace detail {
using Fp8Block128M64Config =
    Config<cutlass::float_e4m3_t, cutlass::bfloat16_t, true, Shape<_64, _128, _128>, Shape<_1, _2, _1>, true>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_KIND(fp8_block128_m64, hj::prefill::detail::Fp8Block128M64Config)
