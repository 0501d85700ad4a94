// Prefill grouped GEMM, fp8 e4m3 x e4m3 with 1 x 128 activation and 128 x 128 weight f32 block
// scales -> bf16 (gemm_prefill_sm90_kernel.cuh). 128 x 128 x 128 tiles: one K tile is one scale
// block, so each wgmma partial sum (64 x 128 per consumer warpgroup) is scaled and added into a
// float32 main accumulator once per K tile; a wider N tile would need twice its accumulator
// registers and spill. Clusters of two along N share each A tile.
#include "gemm_prefill_sm90_kernel.cuh"

namespace hj {
namespace prefill {
namespace detail {
using Fp8Block128Config =
    Config<cutlass::float_e4m3_t, cutlass::bfloat16_t, true, Shape<_128, _128, _128>, Shape<_1, _2, _1>>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_KIND(fp8_block128, hj::prefill::detail::Fp8Block128Config)
