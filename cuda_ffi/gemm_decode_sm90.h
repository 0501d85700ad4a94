// The decode-path GEMM's host entry (kernels in gemm_decode_sm90.cuh). Compiled into the CUDA
// library and called by the GEMM handlers only with HUMMING_JAX_FAST_PATHS (CMake option, default
// OFF) until a GPU run has verified it.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ffi_common.h"
#include "gemm_kernels_sm80.cuh"
#include "quantize_cuda.h"

namespace hj {
namespace decode {

// Runs the weight-streaming decode kernel when the call is a decode problem it supports
// (*launched = true) and otherwise leaves it to the generic kernel (*launched = false). Decided on
// the host from shapes and attributes only: indexed with block_m <= 16, grouped with at most 16
// rows per local expert on average (quantized weights with 16-bit activations: up to
// quant_decode_rows_per_expert), batched with T <= 16; 16-byte aligned rows; scale groups that
// fit the kernel's chunks; a compute capability 9.0 device. HUMMING_JAX_DECODE=0 turns it off,
// HUMMING_JAX_DECODE_LOG=1 prints each decision to stderr.
// qin (gemm_indexed_quant): L.p.a is the quantization of qin->x (activated first where qin->act >=
// 0). When a kernel is launched, the quantization kernel runs first, or the decode kernel quantizes
// the rows itself where every work item holds them whole (fp8 e4m3 in 128-k groups;
// HUMMING_JAX_DECODE_QUANT=0: never). When nothing is launched it may have run already; running it
// again is harmless.
// gate (gemm_indexed_gated): where the decode kernel takes the call (indexed layout, not the fp8
// ring), its epilogue writes gate->y instead of c, and *gated says so; otherwise c is written and
// the caller activates it.
Error launch_decode(const std::string& call, const gemm::GemmLaunch& L, cudaStream_t stream, bool* launched,
                    const InputQuant* qin = nullptr, const GatedOut* gate = nullptr, bool* gated = nullptr);

// Grouped calls with quantized weights of this type and 16-bit activations: the decode kernel takes
// them up to this many rows per expert on average, and the dequantizing prefill path from it (64
// for 8-bit codes, 128 for 4-bit ones: the values humming_jax/ops/gemm.py sizes the workspace by).
// HUMMING_JAX_QUANT_DECODE_ROWS=<n> (n > 0) replaces it for every type (for A/B timing;
// humming_jax/ops/gemm.py reads it too).
int64_t quant_decode_rows_per_expert(WeightType t);

}  // namespace decode
}  // namespace hj
