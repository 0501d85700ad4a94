// The dynamic quantization (and the activation) of 16-bit activation rows on the CPU, shared by the
// quantize / activation handlers (activation_cpu.cc) and the GEMMs that prepare their own input
// (gemm_indexed_quant, gemm_indexed_gated; gemm_cpu.cc).
#pragma once

#include <cstdint>

#include "ffi_common.h"

namespace hj {

// x [R, N1] (xt: bf16 or f16), each row activated (act: an Activation code; -1: none, N1 = K) into
// K columns -> q [R, K] codes and scale [R, groups]: scale = absmax / qmax per group of group_k
// columns (0: per row), codes = the values over the scale, rounded to nearest.
void quantize_rows_cpu(ElemType xt, const void* x, int64_t R, int64_t N1, int64_t K, int act, float limit,
                       int64_t group_k, ActQuant kind, void* q, float* scale);

// x [R, N1] (xt: bf16 or f16), each row activated (act: an Activation code) into K columns and
// rounded to xt -> y [R, K] (the activation handler; gemm_indexed_gated's output).
void activate_rows_cpu(ElemType xt, const void* x, int64_t R, int64_t N1, int64_t K, int act, float limit, void* y);

}  // namespace hj
