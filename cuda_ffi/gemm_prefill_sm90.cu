// Host side of the prefill grouped GEMM (gemm_prefill_sm90.h): which problems it takes, the
// device facts it needs, the workspace check, and the call into the kind's translation unit.
// No CUTLASS header is included here, so this file compiles in seconds.
#include "gemm_prefill_sm90.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

#include "cuda_launch.cuh"
#include "gemm_decode_sm90.h"

namespace hj {
namespace prefill {

namespace {
// The workspace base is rounded up to this (TMA descriptors must be 64-byte aligned; XLA only
// promises less for a sub-buffer), and the rounding slack is part of the need.
constexpr size_t kWorkspaceAlign = 128;

// Prefill GEMMs launched by this process (host-side launches, not graph replays): lets the GPU
// tests prove that a problem took this path rather than the generic kernel.
std::atomic<uint64_t> g_launches{0};

// HUMMING_JAX_PREFILL=0 turns the path off at run time (read at each call, so a test or a
// benchmark can compare with the generic kernel in one process).
bool disabled_by_env() { return !env_flag("HUMMING_JAX_PREFILL", true); }

// HUMMING_JAX_PREFILL_MIXED=0: the calls Kind::kU4Bf16 takes go to the dequantizing path instead
// (read at each call, for A/B measurements; humming_jax/ops/gemm.py reads it when tracing to size
// the workspace for the path taken).
bool mixed_disabled_by_env() { return !env_flag("HUMMING_JAX_PREFILL_MIXED", true); }

// HUMMING_JAX_PREFILL_FP4=0: the calls the MXFP4 kinds take go back to the decode kernel and the
// dequantizing path (read at each call; humming_jax/ops/gemm.py reads it when tracing).
bool fp4_disabled_by_env() { return !env_flag("HUMMING_JAX_PREFILL_FP4", true); }

// A bound in rows per expert that environment variable `var` replaces where it holds a positive
// count (read at each call, for A/B measurements; humming_jax/ops/gemm.py's _positive_override reads
// it the same way when tracing to size the workspace for the path taken).
int64_t positive_override(const char* var, int64_t builtin) {
  const int64_t n = env_count(var, builtin, builtin);
  return n > 0 ? n : builtin;
}
// HUMMING_JAX_PREFILL_MIN_ROWS=n > 0: the prefill kinds take calls from n rows per expert instead of
// their built-in bound (against the decode kernel).
int64_t min_rows_or_override(int64_t builtin) { return positive_override("HUMMING_JAX_PREFILL_MIN_ROWS", builtin); }
int64_t min_rows_per_expert() { return min_rows_or_override(kMinRowsPerExpert); }
// The kinds on our 4-bit mainloop start lower.
int64_t rs4_min_rows_per_expert() { return min_rows_or_override(kRs4MinRowsPerExpert); }

// HUMMING_JAX_PREFILL_U4RS: unset, the built-in rule (below kU4RsMaxRowsPerExpert but the CUTLASS
// window); 0, the uint4 calls of our 4-bit mainloop stay on the CUTLASS mixed-input kinds; n > 0,
// the mainloop below n rows per expert, no window (A/B).
bool u4rs_rows_fit(int64_t R, int64_t E) {
  constexpr int64_t kUnset = std::numeric_limits<int64_t>::min();
  const int64_t n = env_count("HUMMING_JAX_PREFILL_U4RS", kUnset, 0);
  if (n == kUnset) return R < kU4RsMaxRowsPerExpert * E && !(R >= kU4RsCutlassFrom * E && R < kU4RsCutlassTo * E);
  return n > 0 && R < n * E;
}
// HUMMING_JAX_PREFILL_FP4_MAX_ROWS=n > 0: the MXFP4 kind up to below n rows per expert instead of
// kFp4MaxRowsPerExpert (A/B against the dequantizing path).
int64_t fp4_max_rows_per_expert() { return positive_override("HUMMING_JAX_PREFILL_FP4_MAX_ROWS", kFp4MaxRowsPerExpert); }

// HUMMING_JAX_PREFILL_BF16_WSP / HUMMING_JAX_PREFILL_FP8_WSP: -1 unset (the default rules,
// wsp_form); 0, the CUTLASS kinds; 1 / 2, our persistent kernels on
// clusters of one / two CTAs; 3 / 4: the same on tiles of up to 256 tokens (humming_jax/ops/gemm.py
// checks the value when the call is traced). A malformed value reads as 0 here.
int wsp_switch(const char* var, int64_t max) {
  const int64_t v = env_count(var, -1, 0);
  return v >= -1 && v <= max ? static_cast<int>(v) : 0;
}
int bf16_wsp_switch() { return wsp_switch("HUMMING_JAX_PREFILL_BF16_WSP", 4); }
int fp8_wsp_switch() { return wsp_switch("HUMMING_JAX_PREFILL_FP8_WSP", 4); }

WspForm switch_form(int v) {
  if (v < 1 || v > 4) return WspForm{};
  return WspForm{v % 2 == 0 ? 2 : 1, v >= 3 ? 256 : 128};
}

// HUMMING_JAX_PREFILL_TILE=64 or 128 (or 256, the mixed-input kinds only): the tile height
// regardless of rows per expert (0: by shape).
int tile_rows_from_env() {
  const char* v = std::getenv("HUMMING_JAX_PREFILL_TILE");
  if (v == nullptr) return 0;
  if (std::strcmp(v, "64") == 0) return 64;
  if (std::strcmp(v, "128") == 0) return 128;
  if (std::strcmp(v, "256") == 0) return 256;
  return 0;
}
}  // namespace

// A malformed value reads as 0 (humming_jax/ops/gemm.py rejects it when the call is traced).
int gather_switch() {
  const int64_t v = env_count("HUMMING_JAX_PREFILL_GATHER", 0, 0);
  return v >= 0 && v <= 2 ? static_cast<int>(v) : 0;
}

// w8a8-fp8-block128 grouped calls (HUMMING_JAX_PREFILL_FP8_WSP unset) run on our persistent kernel,
// tiles of up to 128 tokens, one CTA per SM, for experts of fewer than kFp8WspMaxWeights weight
// elements (N x K) from kFp8WspMinRowsPerExpert up to below kBf16WspMaxRowsPerExpert rows per expert
// on average (the bound its tile list fits the workspace at); the CUTLASS kinds otherwise. Measured
// on the H100 (benchmarks/NOTES.md, v22, gemms): qwen3 (1536 x 2048 and 2048 x 768) 1.03x / 1.09x /
// 1.01x the CUTLASS kinds at 64 / 256 / 1024 rows per expert; deepseek (4096 x 7168, 7168 x 2048)
// 0.85-0.96x with any form, as mixtral at v13-v20. On the H200 (v23): qwen3 1.05x the CUTLASS
// 64-row kind at 32 rows per expert, so the rule starts where the grouped prefill kinds do.
constexpr int64_t kFp8WspMinRowsPerExpert = 32;
constexpr int64_t kFp8WspMaxWeights = int64_t{8} << 20;

WspForm wsp_form(Kind kind, int64_t R, int64_t E, int64_t N, int64_t K) {
  if ((kind != Kind::kBf16Wsp && kind != Kind::kFp8Block128Wsp) || E <= 0) return WspForm{};
  const int v = kind == Kind::kFp8Block128Wsp ? fp8_wsp_switch() : bf16_wsp_switch();
  if (v >= 0) return switch_form(v);
  const int64_t rows = R / E;  // expected rows per expert, from shapes only
  if (kind == Kind::kFp8Block128Wsp) {
    if (rows < kFp8WspMinRowsPerExpert || rows >= kBf16WspMaxRowsPerExpert || N * K >= kFp8WspMaxWeights)
      return WspForm{};
    return WspForm{1, 128};
  }
  if (rows >= kBf16WspMaxRowsPerExpert) return WspForm{};
  return WspForm{rows >= kWspClusterRowsPerExpert || N * K >= kWspWideWeights ? 2 : 1, 256};
}

Kind narrow_kind(Kind k) {
  switch (k) {
    case Kind::kBf16: return Kind::kBf16M64;
    case Kind::kF16: return Kind::kF16M64;
    case Kind::kFp8Block128: return Kind::kFp8Block128M64;
    case Kind::kU4Bf16: return Kind::kU4Bf16N64;
    default: return k;
  }
}

Kind wide_kind(Kind k) {
  switch (k) {
    case Kind::kBf16M64: return Kind::kBf16;
    case Kind::kF16M64: return Kind::kF16;
    case Kind::kFp8Block128M64: return Kind::kFp8Block128;
    case Kind::kU4Bf16N64: return Kind::kU4Bf16;
    case Kind::kU4Bf16N256: return Kind::kU4Bf16;
    default: return k;
  }
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kBf16: return "bf16";
    case Kind::kF16: return "fp16";
    case Kind::kFp8Block128: return "fp8-block128";
    case Kind::kBf16M64: return "bf16-m64";
    case Kind::kF16M64: return "fp16-m64";
    case Kind::kFp8Block128M64: return "fp8-block128-m64";
    case Kind::kU4Bf16: return "u4-bf16";
    case Kind::kU4Bf16N64: return "u4-bf16-n64";
    case Kind::kU4Bf16N256: return "u4-bf16-n256";
    case Kind::kFp4Bf16: return "fp4-bf16";
    case Kind::kU4Bf16Rs: return "u4-bf16-rs";
    case Kind::kBf16Wsp: return "bf16-wsp";
    case Kind::kFp8Block128Wsp: return "fp8-block128-wsp";
    default: return "none";
  }
}

bool current_device(DeviceInfo* info) {
  static std::mutex mu;
  static DeviceInfo cache[64];
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess || d < 0 || d >= 64) {
    cudaGetLastError();
    return false;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (cache[d].device != d) {
    int sms = 0, major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    cache[d].sm_count = sms < kMaxSms ? sms : kMaxSms;
    // The kernels are built for sm_90a only: other devices keep the generic kernel.
    cache[d].sm90 = major == 9 && minor == 0;
    cache[d].device = d;
  }
  *info = cache[d];
  return true;
}

namespace {
// uint4 codes centred on 8 (no zero points, no second scale) with bf16 scales per 1 x group_k,
// bf16 activations and output, from min_rows rows per expert: the mixed-input kinds (min_rows:
// min_rows_per_expert(); rs4_min_rows_per_expert() where our 4-bit mainloop asks). Below
// quant_decode_rows_per_expert(kUInt4) rows per expert they take these calls from the decode kernel,
// which streams the codes once per 32-row item, and above it from the dequantizing path (at
// 1024-4096 rows per expert the 256-token kind measured 1.01-1.19x faster, benchmarks/NOTES.md, v9).
// Rows of codes 16-byte aligned (K % 32) and N % 8 (TMA: scale and output rows of 16 bytes).
bool mixed_input_fits(const GemmProblem& p, int64_t R, int64_t min_rows) {
  const WeightView& w = p.w;
  return w.type == WeightType::kUInt4 && w.zero == nullptr && w.scale2 == nullptr &&
         w.scale_type == ElemType::kBF16 && w.scale != nullptr && w.group_n == 1 &&
         (w.group_k % kMixedTileK == 0 || w.group_k >= p.K) && p.a.type == ElemType::kBF16 &&
         p.c_type == ElemType::kBF16 && p.K % 32 == 0 && p.N % 8 == 0 && R >= min_rows * w.E &&
         w.E * p.N * ((w.scale_cols() + 7) / 8) < (int64_t{1} << 31);
}

// MXFP4 weights (e2m1 codes, e8m0 scales per 1 x 32, nothing else) with bf16 activations and
// output, kRs4MinRowsPerExpert to below fp4_max_rows_per_expert() rows per expert: the MXFP4 kind. K a
// multiple of their 64-k tile, N of 8 (16-byte output chunks), the tile list within a grid column.
bool fp4_fits(const GemmProblem& p, int64_t R) {
  const WeightView& w = p.w;
  return w.type == WeightType::kFp4E2M1 && w.zero == nullptr && w.scale2 == nullptr &&
         w.scale_type == ElemType::kE8M0 && w.scale != nullptr && w.group_n == 1 && w.group_k == 32 &&
         p.a.type == ElemType::kBF16 && !p.a.quantized() && p.c_type == ElemType::kBF16 && p.K % 64 == 0 &&
         p.N % 8 == 0 && R >= rs4_min_rows_per_expert() * w.E && R < fp4_max_rows_per_expert() * w.E &&
         (R + 63) / 64 + w.E + 1 <= 65535;
}

// The uint4 calls of mixed_input_fits whose scale groups are whole 64-k tiles (or span K), K a
// multiple of 64, from kRs4MinRowsPerExpert up at the rows per expert u4rs_rows_fit takes: our 4-bit
// mainloop.
bool u4rs_fits(const GemmProblem& p, int64_t R) {
  return mixed_input_fits(p, R, rs4_min_rows_per_expert()) && p.K % 64 == 0 &&
         (p.w.group_k % 64 == 0 || p.w.group_k >= p.K) && u4rs_rows_fit(R, p.w.E) &&
         (R + 63) / 64 + p.w.E + 1 <= 65535;
}

Kind choose_wide(const GemmProblem& p, int64_t R, const DeviceInfo& dev, bool allow_rs4, WspForm* form) {
  const WeightView& w = p.w;
  const int64_t E = w.E, N = p.N, K = p.K;
  if (!dev.sm90 || dev.sm_count <= 0) return Kind::kNone;
  if (E <= 0 || E > kMaxExperts || R <= 0 || R > INT32_MAX || N <= 0 || N > INT32_MAX || K <= 0 ||
      K > INT32_MAX)
    return Kind::kNone;
  // Expected rows per expert, from shapes only (the routing itself stays on the device): our 4-bit
  // mainloop from rs4_min_rows_per_expert(), every other kind from min_rows_per_expert().
  if (R < std::min(min_rows_per_expert(), rs4_min_rows_per_expert()) * E) return Kind::kNone;
  // TMA: 16-byte aligned rows and base addresses for A, B and D (and 16-byte bias vectors).
  if (N % 8 || K % 8) return Kind::kNone;
  if (!aligned_to(p.a.data, 16) || !aligned_to(w.data, 16) || !aligned_to(p.c, 16)) return Kind::kNone;
  if (w.bias && !aligned_to(w.bias, 16)) return Kind::kNone;
  if (allow_rs4 && !fp4_disabled_by_env() && fp4_fits(p, R)) return Kind::kFp4Bf16;
  if (allow_rs4 && !mixed_disabled_by_env() && u4rs_fits(p, R)) return Kind::kU4Bf16Rs;
  if (R < min_rows_per_expert() * E) return Kind::kNone;
  if (w.type == WeightType::kFloat) {
    if (p.a.quantized() || w.data_type != p.a.type || p.c_type != p.a.type) return Kind::kNone;
    if (p.a.type == ElemType::kBF16) {
      // Our persistent kernel by its rule or its switch (its tile list within the workspace bound
      // wherever the rule picks it: prefill_wsp_sm90.cuh).
      *form = wsp_form(Kind::kBf16Wsp, R, E, N, K);
      return form->cluster > 0 ? Kind::kBf16Wsp : Kind::kBf16;
    }
    if (p.a.type == ElemType::kF16) return Kind::kF16;
    return Kind::kNone;
  }
  if (!mixed_disabled_by_env() && mixed_input_fits(p, R, min_rows_per_expert())) return Kind::kU4Bf16;
  // Quantized weights, 16-bit activations: dequantized chunks through the 16-bit kernel.
  if (!p.a.quantized() && p.c_type == p.a.type && (w.group_k % 8 == 0 || w.group_k >= K) && w.group_n >= 1) {
    if (p.a.type == ElemType::kBF16) return Kind::kBf16;
    if (p.a.type == ElemType::kF16) return Kind::kF16;
  }
  // w8a8-fp8-block128: e4m3 codes on both sides, 128 x 128 f32 weight scales, 1 x 128 f32
  // activation scales, whole blocks only, bf16 out.
  if (w.type == WeightType::kFp8E4M3 && p.a.type == ElemType::kE4M3 && p.c_type == ElemType::kBF16 &&
      w.scale_type == ElemType::kF32 && w.zero == nullptr && w.scale2 == nullptr && w.group_n == 128 &&
      w.group_k == 128 && p.a.group_k == 128 && N % 128 == 0 && K % 128 == 0 && p.a.scale != nullptr) {
    *form = wsp_form(Kind::kFp8Block128Wsp, R, E, N, K);
    return form->cluster > 0 ? Kind::kFp8Block128Wsp : Kind::kFp8Block128;
  }
  return Kind::kNone;
}
}  // namespace

Kind choose(const GemmProblem& p, int64_t R, const DeviceInfo& dev, bool allow_rs4, WspForm* form) {
  WspForm f;  // choose_wide sets it only where ours was weighed; wsp_form gives no form where it lost
  const Kind wide = choose_wide(p, R, dev, allow_rs4, &f);
  if (form != nullptr) *form = f;
  if (wide == Kind::kNone) return wide;
  if (wide == Kind::kFp4Bf16 || wide == Kind::kU4Bf16Rs || wide == Kind::kBf16Wsp || wide == Kind::kFp8Block128Wsp)
    return wide;  // tile widths follow each tile's rows
  const int forced = tile_rows_from_env();
  if (wide == Kind::kU4Bf16 && (forced == 256 || (forced == 0 && R >= kTallRowsPerExpertMixed * p.w.E)))
    return Kind::kU4Bf16N256;
  if (forced == 128 || forced == 256) return wide;
  const int64_t wide_from = wide == Kind::kFp8Block128 ? kWideRowsPerExpertFp8
                            : wide == Kind::kU4Bf16    ? kWideRowsPerExpertMixed
                                                       : kWideRowsPerExpert16;
  if (forced == 64 || R < wide_from * p.w.E) return narrow_kind(wide);
  return wide;
}

namespace {
bool is_rs4(Kind k) { return k == Kind::kFp4Bf16 || k == Kind::kU4Bf16Rs; }

// What a launch of args.kind needs of the workspace.
size_t needed_bytes(const GroupedArgs& args, const DeviceInfo& dev) {
  if (is_rs4(args.kind)) return rs4_workspace_bytes(args.R, args.K, args.E);
  if (args.kind == Kind::kBf16Wsp || args.kind == Kind::kFp8Block128Wsp)
    return wsp_workspace_bytes(args.R, args.E);
  size_t need = workspace_bytes(args.kind, args.E, dev.sm_count);
  if (wide_kind(args.kind) == Kind::kU4Bf16) need += mixed_scale_bytes(args.E, args.N, args.scale_cols);
  return need;
}
}  // namespace

size_t workspace_bytes(Kind kind, int64_t E, int sm_count) {
  size_t n = 0;
  switch (kind) {
    case Kind::kBf16: n = workspace_bytes_bf16(E, sm_count); break;
    case Kind::kF16: n = workspace_bytes_f16(E, sm_count); break;
    case Kind::kFp8Block128: n = workspace_bytes_fp8_block128(E, sm_count); break;
    case Kind::kBf16M64: n = workspace_bytes_bf16_m64(E, sm_count); break;
    case Kind::kF16M64: n = workspace_bytes_f16_m64(E, sm_count); break;
    case Kind::kFp8Block128M64: n = workspace_bytes_fp8_block128_m64(E, sm_count); break;
    case Kind::kU4Bf16: n = workspace_bytes_u4_bf16(E, sm_count); break;
    case Kind::kU4Bf16N64: n = workspace_bytes_u4_bf16_n64(E, sm_count); break;
    case Kind::kU4Bf16N256: n = workspace_bytes_u4_bf16_n256(E, sm_count); break;
    default: return 0;
  }
  return n + kWorkspaceAlign;
}

Error run_grouped(const std::string& call, const GroupedArgs& args, const DeviceInfo& dev, cudaStream_t stream) {
  const size_t need = needed_bytes(args, dev);
  if (args.workspace == nullptr || args.workspace_bytes < need)
    return invalid(call, "the workspace result holds " + std::to_string(args.workspace_bytes) + " bytes; the " +
                             kind_name(args.kind) + " prefill kernel needs " + std::to_string(need) + " for E = " +
                             std::to_string(args.E) + " on " + std::to_string(dev.sm_count) + " SMs");
  GroupedArgs a = args;
  const uintptr_t base = reinterpret_cast<uintptr_t>(args.workspace);
  const uintptr_t aligned = (base + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  a.workspace = reinterpret_cast<void*>(aligned);
  a.workspace_bytes = args.workspace_bytes - (aligned - base);
  std::string err;
  switch (args.kind) {
    case Kind::kBf16: err = run_bf16(a, dev, stream); break;
    case Kind::kF16: err = run_f16(a, dev, stream); break;
    case Kind::kFp8Block128: err = run_fp8_block128(a, dev, stream); break;
    case Kind::kBf16M64: err = run_bf16_m64(a, dev, stream); break;
    case Kind::kF16M64: err = run_f16_m64(a, dev, stream); break;
    case Kind::kFp8Block128M64: err = run_fp8_block128_m64(a, dev, stream); break;
    case Kind::kU4Bf16: err = run_u4_bf16(a, dev, stream); break;
    case Kind::kU4Bf16N64: err = run_u4_bf16_n64(a, dev, stream); break;
    case Kind::kU4Bf16N256: err = run_u4_bf16_n256(a, dev, stream); break;
    case Kind::kFp4Bf16:
    case Kind::kU4Bf16Rs: err = run_rs4(a, dev, stream); break;
    case Kind::kBf16Wsp:
    case Kind::kFp8Block128Wsp: {
      const WspForm& f = args.form;
      err = f.cluster == 0 ? std::string("the call carries no form of the persistent kernel")
            : args.kind == Kind::kBf16Wsp ? run_bf16_wsp(a, dev, stream, f.cluster, f.max_tokens)
                                          : run_fp8_wsp(a, dev, stream, f.cluster, f.max_tokens);
      break;
    }
    default: return invalid(call, "no prefill kernel for this problem");
  }
  if (!err.empty())
    return Error::Internal("humming_jax." + call + ": prefill " + kind_name(args.kind) + " kernel: " + err);
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return Error::Success();
}

namespace {
// Quantized weights: experts dequantized a chunk at a time into the workspace past the kernel's
// own part, each chunk's GEMM launched after its dequantization on the same stream. The chunk is
// as many whole experts as the rest of the workspace holds (the wrapper sizes it,
// dequant_buffer_bytes); with room for none the call is left to the generic kernel.
Error run_dequantized(const std::string& call, const GroupedArgs& g, const GemmProblem& p, const DeviceInfo& dev,
                      cudaStream_t stream, bool* handled) {
  const size_t need = workspace_bytes(g.kind, g.E, dev.sm_count);
  const size_t per_expert = static_cast<size_t>(g.N) * static_cast<size_t>(g.K) * 2;
  if (g.workspace_bytes < need + kWorkspaceAlign + per_expert) return Error::Success();
  const uintptr_t base = reinterpret_cast<uintptr_t>(g.workspace) + need;
  const uintptr_t buf = (base + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  const size_t room = g.workspace_bytes - need - (buf - base);
  // Also below 2^31 runs of 8 values per chunk (the dequantization kernel's 32-bit indexing).
  const int64_t runs_per_expert = std::max<int64_t>(1, g.N * g.K / 8);
  const int64_t chunk = std::min<int64_t>({g.E, static_cast<int64_t>(room / per_expert),
                                           std::max<int64_t>(1, (int64_t{1} << 31) / runs_per_expert - 1)});
  *handled = true;
  for (int64_t e0 = 0; e0 < g.E; e0 += chunk) {
    const int64_t n = std::min(chunk, g.E - e0);
    std::string err = dequantize_experts(p, e0, n, reinterpret_cast<void*>(buf), dev.sm_count, stream);
    if (!err.empty()) return Error::Internal("humming_jax." + call + ": dequantizing experts: " + err);
    GroupedArgs c = g;
    c.w = reinterpret_cast<const void*>(buf);
    c.workspace_bytes = need;  // the kernel's part only
    c.e0 = e0;
    c.groups = n;
    c.zero_tail = e0 + n >= g.E;
    HJ_RETURN_IF_ERROR(run_grouped(call, c, dev, stream));
  }
  return Error::Success();
}

// Whether our persistent bf16 kernel writes the gated rows itself for a call of this form: the
// 256-token form (two consumer warpgroups, each holding the gate and the up rows of its 32 output
// columns: blocks of 128 weight rows), N / 2 whole 16-byte runs, y 16-byte aligned.
bool wsp_gates(const WspForm& form, int64_t N, const void* y) {
  return form.max_tokens == 256 && N % 16 == 0 && aligned_to(y, 16);
}
}  // namespace

Error try_grouped(const std::string& call, const GemmProblem& p, const int32_t* offsets, int64_t R,
                  void* workspace, size_t ws_bytes, cudaStream_t stream, bool* handled, const GatherRows* gather,
                  const GatedOut* gate, bool* gated) {
  *handled = false;
  if (disabled_by_env()) return Error::Success();
  DeviceInfo dev;
  if (!current_device(&dev)) return Error::Success();
  WspForm form;
  Kind kind = choose(p, R, dev, /*allow_rs4=*/true, &form);
  if (kind == Kind::kNone) return Error::Success();
  if (gather != nullptr) {
    // Only our persistent bf16 kernel gathers rows; choose() gave it 16-bit rows of x (p.a) that
    // are 16-byte aligned, as its cp.async copies need.
    const int sw = gather_switch();
    if (kind != Kind::kBf16Wsp || !(form.cluster == 1 ? sw >= 1 : sw == 2)) return Error::Success();
  }
  // A workspace without room for the permuted activations of our 4-bit mainloop was sized for
  // another path (the call was traced with HUMMING_JAX_PREFILL_FP4=0 or HUMMING_JAX_PREFILL_U4RS=0):
  // that path then (for mxfp4 the dequantizing one, for uint4 the CUTLASS mixed-input kinds).
  if (is_rs4(kind) && ws_bytes < rs4_workspace_bytes(R, p.K, p.w.E))
    kind = kind == Kind::kU4Bf16Rs ? choose(p, R, dev, /*allow_rs4=*/false, &form) : Kind::kBf16;
  // Likewise a workspace without room for the transposed scales was sized for the dequantizing path
  // (traced with HUMMING_JAX_PREFILL_MIXED=0).
  if (wide_kind(kind) == Kind::kU4Bf16 &&
      ws_bytes < workspace_bytes(kind, p.w.E, dev.sm_count) + mixed_scale_bytes(p.w.E, p.N, p.w.scale_cols()))
    kind = Kind::kBf16;
  // Rows in the 4-bit mainloop's k order are that mainloop's alone: another kind takes them only after
  // grouped_rows (gemm_cuda.cu) has put them back in their natural order.
  if (p.a_k_order && !is_rs4(kind)) return Error::Success();
  GroupedArgs g;
  g.kind = kind;
  g.form = form;
  g.a = p.a.data;
  g.a_scale = p.a.scale;
  g.w = p.w.data;
  g.w_scale = static_cast<const float*>(p.w.scale);
  g.w_scale_raw = p.w.scale;
  g.scale_cols = p.w.scale_cols();
  g.group_k = p.w.group_k;
  g.bias = p.w.bias;
  g.offsets = offsets;
  g.c = p.c;
  g.R = R;
  g.N = p.N;
  g.K = p.K;
  g.E = p.w.E;
  g.workspace = workspace;
  g.workspace_bytes = ws_bytes;
  g.a_k_order = p.a_k_order;
  if (gather != nullptr) {
    g.gather = gather->perm;
    g.gather_div = gather->top_k;
  }
  // choose() gave our bf16 kernel float weights and bf16 rows; the gathered form keeps its
  // activation apart.
  const bool gates = gate != nullptr && gated != nullptr && gather == nullptr && kind == Kind::kBf16Wsp &&
                     wsp_gates(form, p.N, gate->y);
  if (gates) g.gate = *gate;
  // The 16-bit kinds with quantized weights run on dequantized chunks (fp8 block weights keep
  // their codes: the fp8 kind scales them in the mainloop).
  const Kind wk = wide_kind(kind);
  if ((wk == Kind::kBf16 || wk == Kind::kF16) && p.w.type != WeightType::kFloat) {
    // Dequantized only from decode::quant_decode_rows_per_expert() rows per expert (64 for 8-bit
    // codes, 128 for 4-bit ones; below it the decode kernel or the generic one), whatever room the
    // workspace happens to have (humming_jax/ops/gemm.py, dequant_min_rows_per_expert, sizes it by
    // the same rule).
    if (R < decode::quant_decode_rows_per_expert(p.w.type) * p.w.E) return Error::Success();
    return run_dequantized(call, g, p, dev, stream, handled);
  }
  *handled = true;
  HJ_RETURN_IF_ERROR(run_grouped(call, g, dev, stream));
  if (gates) *gated = true;
  return Error::Success();
}

}  // namespace prefill
}  // namespace hj

// Number of prefill GEMM launches so far in this process (for tests, through ctypes).
extern "C" __attribute__((visibility("default"))) uint64_t HjPrefillLaunches() {
  return hj::prefill::g_launches.load(std::memory_order_relaxed);
}
