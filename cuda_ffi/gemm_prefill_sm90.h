// The prefill path of the grouped (contiguous) expert GEMM on Hopper: a persistent,
// warp-specialized TMA + wgmma grouped GEMM built from CUTLASS 3.x collectives, one kernel per
// (element type, scaling) pair, each in its own translation unit (gemm_prefill_sm90_*.cu).
//
// Everything the kernels need per expert (row count, operand addresses, strides) is derived on
// the device from expert_first_token_offset by a small kernel launched before the GEMM, into the
// call's workspace result, so nothing travels to the host and the call stays capturable into a
// CUDA graph. Compiled only with HUMMING_JAX_FAST_PATHS (CMake option, default ON).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi_common.h"
#include "quantize_cuda.h"

namespace hj {
namespace prefill {

// Which kernel runs a grouped problem.
enum class Kind : int {
  kNone = 0,
  kBf16 = 1,          // bf16 activations x bf16 weights -> bf16
  kF16 = 2,           // fp16 x fp16 -> fp16
  kFp8Block128 = 3,   // fp8 e4m3 codes, 1x128 activation and 128x128 weight f32 scales -> bf16
  // The same three on 64-row pingpong tiles, for experts of kMinRowsPerExpert up to
  // kWideRowsPerExpert16 / kWideRowsPerExpertFp8 rows on average.
  kBf16M64 = 4,
  kF16M64 = 5,
  kFp8Block128M64 = 6,
  // uint4 codes (offset 8, no zero points) with bf16 scales per 1 x group_k (group_k whole 64-k
  // tiles, or one group spanning K) x bf16 activations -> bf16, the codes converted and scaled in
  // the mainloop (gemm_prefill_sm90_mixed.cuh). From kMinRowsPerExpert rows per expert up it takes
  // these calls from the decode kernel and the dequantizing path; HUMMING_JAX_PREFILL_MIXED=0 gives
  // them back. 128-token tiles from kWideRowsPerExpertMixed to below kTallRowsPerExpertMixed rows per
  // expert on average.
  kU4Bf16 = 7,
  // The same on tiles of 64 token rows, for experts of kMinRowsPerExpert up to
  // kWideRowsPerExpertMixed rows on average.
  kU4Bf16N64 = 8,
  // ... and of 256 token rows, from kTallRowsPerExpertMixed rows per expert on average.
  kU4Bf16N256 = 9,
  // MXFP4 (e2m1 codes, e8m0 scales per 1 x 32) x bf16 activations -> bf16 on our own mainloop
  // (gemm_prefill_sm90_4bit.cu): the codes converted and scaled in registers into register-sourced
  // wgmma, tiles of 128 weight rows x up to 128 tokens (the tile's rows rounded up to 16); from
  // kRs4MinRowsPerExpert up to below kFp4MaxRowsPerExpert rows per expert on average.
  // HUMMING_JAX_PREFILL_FP4=0 gives these calls back to the decode kernel and the dequantizing path.
  kFp4Bf16 = 10,
  // The same mainloop for the uint4 calls of kU4Bf16 whose scale groups are whole 64-k tiles (or
  // span K) and K % 64 == 0, from kRs4MinRowsPerExpert up to below kU4RsMaxRowsPerExpert rows per
  // expert but kU4RsCutlassFrom-kU4RsCutlassTo. HUMMING_JAX_PREFILL_U4RS=0 gives them back to the
  // CUTLASS mixed-input kinds; HUMMING_JAX_PREFILL_U4RS=<n>: the mainloop up to below n rows per
  // expert, no window (for A/B timing).
  kU4Bf16Rs = 11,
  // bf16 x unquantized bf16 weights -> bf16 on our own persistent kernel (gemm_prefill_sm90_bf16_wsp.cu):
  // weight rows on wgmma's A operand, tiles of up to 128 tokens costing their rows rounded up to 32.
  // Only where HUMMING_JAX_PREFILL_BF16_WSP=1 (one CTA per SM) or =2 (clusters of two sharing the
  // tokens by multicast) selects it, for A/B timing against kBf16 / kBf16M64; =3 / =4: the same
  // with tiles of up to 256 tokens (two consumer warpgroups); 0 or unset: never.
  kBf16Wsp = 12,
  // w8a8-fp8-block128 on our own persistent kernel (gemm_prefill_sm90_fp8_wsp.cu): the same tiles,
  // the block scales applied a 128-k stage and 32-token chunk at a time. Only where
  // HUMMING_JAX_PREFILL_FP8_WSP=1 or =2 (clusters of two) selects it, for A/B timing against
  // kFp8Block128 / kFp8Block128M64; =3 / =4: the same with tiles of up to 256 tokens (two consumer
  // warpgroups); 0 or unset: never.
  kFp8Block128Wsp = 13,
};

// The kind on 64-row tiles of a 128-row kind, and back (the 256-token mixed kind's 128-row kind is
// kU4Bf16).
Kind narrow_kind(Kind k);
Kind wide_kind(Kind k);

const char* kind_name(Kind k);

// The persistent grid never exceeds this many CTAs, so the per-SM part of the workspace (TMA
// descriptors) has a bound that does not depend on the device. Kept in step with
// humming_jax/ops/gemm.py (grouped_workspace_bytes).
constexpr int kMaxSms = 256;
// Workspace bound requested by the Python wrapper: kWorkspaceBase + kWorkspacePerExpert * E.
constexpr size_t kWorkspaceBase = size_t(256) << 10;
constexpr size_t kWorkspacePerExpert = 256;
// Above this many experts the setup kernel's shared-memory scan would not fit; such problems take
// the generic kernel.
constexpr int64_t kMaxExperts = 8192;
// Rows per expert (R / E, known on the host from shapes alone) from which the prefill kernel is
// chosen over the generic one (at least half of a 64-row tile used), and from which it runs on
// 128-row tiles instead of 64-row ones, per kind as measured on the H200 (benchmarks/NOTES.md, v4:
// at 64 rows per expert the 16-bit 128 x 256 tile still wins, the fp8 128 x 128 one does not).
// HUMMING_JAX_PREFILL_TILE=64, 128 (or 256: the mixed-input kinds) forces one tile height at run
// time (for A/B measurements).
// HUMMING_JAX_PREFILL_MIXED=0 sends the calls the mixed-input kinds take back to the decode kernel
// or the dequantizing path (read at each call here, and when the call is traced by humming_jax/ops/gemm.py, which then
// requests the dequantization buffer instead of the transposed scales).
// HUMMING_JAX_PREFILL_MIN_ROWS=n > 0 replaces kMinRowsPerExpert at run time (A/B timing of the
// prefill kinds at decode sizes against the decode kernel).
constexpr int64_t kMinRowsPerExpert = 32;
constexpr int64_t kWideRowsPerExpert16 = 64;
constexpr int64_t kWideRowsPerExpertFp8 = 128;
// The K tile of Kind::kU4Bf16 (gemm_prefill_sm90_u4_bf16.cu): its scale groups must be whole tiles
// or span K (humming_jax/ops/gemm.py, MIXED_TILE_K).
constexpr int64_t kMixedTileK = 64;
constexpr int64_t kWideRowsPerExpertMixed = 128;
// From this many rows per expert the mixed-input kind runs on 256-token tiles; measured on the H200
// 1.18-1.29x faster than the 128-token tiles at 256 rows per expert, and 1.01-1.19x faster than the
// dequantizing path at 1024-4096 (benchmarks/NOTES.md, v9).
constexpr int64_t kTallRowsPerExpertMixed = 256;

// The range of rows per expert (on average) of the kinds on our 4-bit mainloop: up to below these.
// MXFP4 above it: the dequantizing path (HUMMING_JAX_PREFILL_FP4_MAX_ROWS=<n> moves the bound, A/B).
// uint4 against the CUTLASS kinds (tiles of 128 tokens up to 255 rows per expert, so two from 129
// rows as the mainloop's; of 256 from 256 rows), the mainloop in its persistent form reading the
// grouped class's k-ordered rows (H100, benchmarks/results/h100/2026-12-06-v2{6,7,8}-*sweep-u4rs*.json):
// 1.12-1.28x faster at 192-240 rows per expert, 1.21-1.24x at 272-352, 1.08-1.10x at 384, 1.01-1.10x
// at 512, 1.12-1.13x at 576, 1.02-1.05x at 640-768 (deepseek, mixtral and qwen3 shapes); but 0.96-0.99x
// at 416-496, where the mainloop's four tiles of 104-124 tokens cost as much as its 512 rows while
// CUTLASS's two 256-token tiles waste as little, hence that window stays on CUTLASS; from 1024 rows
// per expert the two are within 2% (0.98-1.02x).
// MXFP4 (H100, benchmarks/results/h100/2026-12-06-v29-call1-sweep-fp4-max-rows.json): the mainloop
// 1.45-1.49x faster than the dequantizing path at 768 rows per expert, 1.33-1.35x at 1024, 1.07-1.12x
// at 2048, 0.95-0.97x at 4096 (deepseek, mixtral shapes): a log-linear crossover at ~3100-3500.
constexpr int64_t kFp4MaxRowsPerExpert = 3072;
constexpr int64_t kU4RsMaxRowsPerExpert = 1024;
constexpr int64_t kU4RsCutlassFrom = 408, kU4RsCutlassTo = 504;  // rows per expert, [from, to)
// ... and from this many rows per expert up, below kMinRowsPerExpert (the other kinds' bound): with
// the grouped class's rows k-ordered, at 8 rows per expert the mainloop's persistent forms took
// 0.82-0.95x the decode kernel's time at deepseek and qwen3 shapes (int4 and mxfp4), 0.99-1.03x at
// mixtral's; at 4 mixtral's took 1.13-1.15x (benchmarks/NOTES.md, v27). At 16: 0.69-0.77x (v25).
// HUMMING_JAX_PREFILL_MIN_ROWS=n > 0 replaces both bounds.
constexpr int64_t kRs4MinRowsPerExpert = 8;

// The device the call runs on, as the dispatch needs it (cached per device).
struct DeviceInfo {
  int device = -1;
  int sm_count = 0;  // capped at kMaxSms
  bool sm90 = false;  // compute capability 9.0 (sm_90a code present in this library)
};
bool current_device(DeviceInfo* info);

// Our persistent kernels' form: clusters of one or two CTAs (cluster 0: not ours, the CUTLASS kind)
// and tiles of up to 128 or 256 tokens.
struct WspForm {
  int cluster = 0;
  int max_tokens = 0;
};

// Unquantized bf16 grouped calls run on our persistent kernel by default (HUMMING_JAX_PREFILL_BF16_WSP
// unset), on tiles of up to 256 tokens, below kBf16WspMaxRowsPerExpert rows per expert on average;
// on clusters of two CTAs from kWspClusterRowsPerExpert rows per expert or from kWspWideWeights
// weight elements (N x K) an expert, where sharing the tokens pays for the cluster's coupling.
// Measured on the H100 (benchmarks/NOTES.md, v14): 1.04-1.28x the CUTLASS kind at 32-1024 rows per
// expert on the four benchmark shapes; 0.96-0.97x at 2048 and 0.94-0.96x at 4096 (mixtral,
// deepseek), so the CUTLASS kind from 2048.
constexpr int64_t kBf16WspMaxRowsPerExpert = 2048;
constexpr int64_t kWspClusterRowsPerExpert = 512;
constexpr int64_t kWspWideWeights = int64_t{64} << 20;

// The form of the persistent kernel for the grouped call of `kind` (kBf16Wsp, kFp8Block128Wsp) of R
// rows over E experts of N x K: the switch's where it is set (HUMMING_JAX_PREFILL_BF16_WSP /
// _FP8_WSP, 1 to 4), else bf16's rule above or fp8's (gemm_prefill_sm90.cu, kFp8WspMaxWeights).
WspForm wsp_form(Kind kind, int64_t R, int64_t E, int64_t N, int64_t K);

// One grouped problem: rows [off[e], off[e+1]) of a (clamped monotone into [0, R], expert 0 from
// row 0, as on the CPU) use expert e; rows from the last offset to R become zeros.
struct GroupedArgs {
  Kind kind = Kind::kNone;
  WspForm form;                    // kBf16Wsp, kFp8Block128Wsp: the form choose() picked
  const void* a = nullptr;         // [R, K] 16-bit values or fp8 codes
  const float* a_scale = nullptr;  // fp8: [R, K / 128]
  const void* w = nullptr;         // [E, N, K] (uint4: [E, N, K / 2] bytes)
  const float* w_scale = nullptr;  // fp8: [E, N / 128, K / 128]
  const void* w_scale_raw = nullptr;  // uint4: [E, N, scale_cols] bf16
  int64_t scale_cols = 0, group_k = 0;  // uint4
  const float* bias = nullptr;     // [E, N] or nullptr
  const int32_t* offsets = nullptr;  // [E + 1]
  void* c = nullptr;               // [R, N], a's 16-bit type (bf16 for fp8)
  int64_t R = 0, N = 0, K = 0, E = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // The experts this launch computes: [e0, e0 + groups) (groups < 0: all E). w holds expert e at
  // index e - e0 (a chunk of dequantized weights); bias, scales and offsets stay global.
  // zero_tail: write the zero rows past the last expert (the last chunk only).
  int64_t e0 = 0, groups = -1;
  bool zero_tail = true;
  // Gathered tokens (kBf16Wsp only): `a` holds the token rows [M, K], and row r of the problem is
  // a's row gather[r] / gather_div (an id outside [0, R): zeros).
  const int32_t* gather = nullptr;
  int64_t gather_div = 1;
  // A gated call (gemm_grouped_gated; kBf16Wsp on tiles of 256 tokens only): y != nullptr makes
  // the kernel write y [R, N / 2] = act(gate, up) of its rounded output rows instead of c.
  GatedOut gate{-1, 0.0f, nullptr};
  // kFp4Bf16 / kU4Bf16Rs: a's rows are already in the mainloop's k order (rs4_k_order.h), so
  // run_rs4 reads them as they are instead of copying them into the workspace in that order.
  bool a_k_order = false;
};

// Token rows a grouped call gathers itself (gemm_grouped_gather): the problem's `a` is x [M, K]
// and row r is x[perm[r] / top_k].
struct GatherRows {
  const int32_t* perm = nullptr;  // [R]
  int64_t top_k = 1;
};

// HUMMING_JAX_PREFILL_GATHER: 0 (default), gemm_grouped_gather permutes the rows into its
// workspace first; 1, our persistent bf16 kernel gathers them itself where it runs on clusters of
// one CTA; 2, also on clusters of two (read at each call, for A/B timing). Gathering by cp.async
// measured slower than the permuted copy read by TMA at 256-token tiles (benchmarks/NOTES.md, v17).
int gather_switch();

// The kernel for this problem, or kNone (then the generic kernel runs). Host-side, from shapes,
// dtypes and alignment only. uint4 weights with bf16 scales and activations get kU4Bf16 (unless
// HUMMING_JAX_PREFILL_MIXED=0); other quantized weights with 16-bit activations get the 16-bit
// kind: they are dequantized into the workspace a chunk of experts at a time (dequantize_experts)
// first.
// allow_rs4 = false: as if our 4-bit mainloop's kinds (kFp4Bf16, kU4Bf16Rs) did not exist.
// form (optional): set to the persistent kernel's form where the kind is one of ours (kBf16Wsp,
// kFp8Block128Wsp), else to no form; the switches are read once, here.
Kind choose(const GemmProblem& p, int64_t R, const DeviceInfo& dev, bool allow_rs4 = true,
            WspForm* form = nullptr);

// Workspace bytes a kind needs for E experts on a device with sm_count SMs, including the slack
// for aligning the base (<= the bound kWorkspaceBase + kWorkspacePerExpert * E).
size_t workspace_bytes(Kind kind, int64_t E, int sm_count);

// What Kind::kU4Bf16 needs on top of workspace_bytes: the scales transposed to [E, scale_cols, N]
// bf16 (humming_jax/ops/gemm.py, mixed_scale_bytes).
constexpr size_t mixed_scale_bytes(int64_t E, int64_t N, int64_t scale_cols) {
  return static_cast<size_t>(E) * static_cast<size_t>(N) * static_cast<size_t>(scale_cols) * 2;
}

// Workspace bytes of the kinds on our 4-bit mainloop (kFp4Bf16, kU4Bf16Rs) for R rows, K and E
// experts (the tile list and the permuted activations, R x K bf16), including the alignment slack
// (humming_jax/ops/gemm.py, rs4_workspace_bytes).
size_t rs4_workspace_bytes(int64_t R, int64_t K, int64_t E);

// Launches the setup kernel and the GEMM on `stream`. Errors name the call; a workspace smaller
// than workspace_bytes(kind, E, SMs) is an InvalidArgument that names the size needed.
Error run_grouped(const std::string& call, const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);

// The hook of the grouped GEMM handler: runs the prefill kernel when the problem suits it
// (*handled = true, the result is the call's), else leaves the call to the generic kernel.
// gather (optional): the call's rows are gathered token rows; the prefill kernel then runs only
// where it gathers them itself (*handled = false otherwise: the caller permutes them into `a`).
// gate (optional, with gated): where the kernel applies the gated activation itself (our bf16
// kernel's 256-token form, N a multiple of 16) it writes gate->y and sets *gated (the caller
// starts it false); otherwise c, and the caller activates it.
Error try_grouped(const std::string& call, const GemmProblem& p, const int32_t* offsets, int64_t R,
                  void* workspace, size_t ws_bytes, cudaStream_t stream, bool* handled,
                  const GatherRows* gather = nullptr, const GatedOut* gate = nullptr, bool* gated = nullptr);

// w' of the contract (gemm_weight: the activation-type rounding of the float32 weight) of experts
// [e0, e0 + experts) into out [experts, N, K] of the activation type (bf16 or fp16). Needs K % 8 == 0
// and scale groups of whole 8-column runs (group_k % 8 == 0 or group_k >= K).
std::string dequantize_experts(const GemmProblem& p, int64_t e0, int64_t experts, void* out, int sm_count,
                               cudaStream_t stream);

// Per-kind entry points, one translation unit each. They return an empty string on success.
size_t workspace_bytes_bf16(int64_t E, int sm_count);
size_t workspace_bytes_f16(int64_t E, int sm_count);
size_t workspace_bytes_fp8_block128(int64_t E, int sm_count);
size_t workspace_bytes_bf16_m64(int64_t E, int sm_count);
size_t workspace_bytes_f16_m64(int64_t E, int sm_count);
size_t workspace_bytes_fp8_block128_m64(int64_t E, int sm_count);
size_t workspace_bytes_u4_bf16(int64_t E, int sm_count);
size_t workspace_bytes_u4_bf16_n64(int64_t E, int sm_count);
size_t workspace_bytes_u4_bf16_n256(int64_t E, int sm_count);
std::string run_bf16(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_f16(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_fp8_block128(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_bf16_m64(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_f16_m64(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_fp8_block128_m64(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_u4_bf16(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_u4_bf16_n64(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_u4_bf16_n256(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);
std::string run_rs4(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream);  // kFp4Bf16, kU4Bf16Rs
// Kinds kBf16Wsp and kFp8Block128Wsp: workspace bytes (their tile list, with the alignment slack),
// and the launches on clusters of `cluster` (1 or 2) CTAs.
size_t wsp_workspace_bytes(int64_t R, int64_t E);
// Tiles of up to max_tokens (128 or 256) token rows, clusters of `cluster` (1 or 2) CTAs.
std::string run_bf16_wsp(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream, int cluster,
                         int max_tokens);
std::string run_fp8_wsp(const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream, int cluster,
                        int max_tokens);

}  // namespace prefill
}  // namespace hj
