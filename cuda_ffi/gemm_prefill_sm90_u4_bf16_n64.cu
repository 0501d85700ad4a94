// Prefill grouped GEMM, uint4 codes (offset 8) with bf16 group scales x bf16 -> bf16, for experts
// of few rows (32 to 127 on average; gemm_prefill_sm90_mixed.cuh): tiles of 128 weight rows x 64
// token rows x 64 k, so an expert of 32-64 rows streams its codes once through one half-full tile
// instead of a quarter-full 128-token one. No clusters: at 32-64 rows per expert they measured
// 0-3% slower than single CTAs (benchmarks/NOTES.md, v9).
#include "gemm_prefill_sm90_mixed.cuh"

namespace hj {
namespace prefill {
namespace detail {
using U4Bf16N64Config = MixedConfig<Shape<_128, _64, _64>, Shape<_1, _1, _1>>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_MIXED_KIND(u4_bf16_n64, hj::prefill::detail::U4Bf16N64Config)
