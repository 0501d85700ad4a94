// The decode-path expert GEMM: a weight-streaming kernel for few rows per expert (M * top_k small,
// at most 16 rows per work item), all three row layouts (indexed gather, grouped contiguous,
// batched masked) and every weight type of the contract. Host entry: launch_decode (gemm_decode_sm90.h).
//
// Why it is shaped this way (benchmarks/NOTES.md, "v2-decode"): at decode sizes the GEMM is a pass
// over the touched expert weights, so the kernel is built to keep HBM busy and the SM's issue slots
// free:
//  * Operands swapped: 16 weight rows are the A operand of mma.sync m16n8k16 and up to 8 (or 16)
//    tokens the B operand, so a token count of 1 wastes nothing on the weight side.
//  * The k order inside an MMA step is free as long as A and B agree. Each lane therefore copies
//    one contiguous 16-byte chunk of a weight row (8 bf16, 16 8-bit codes or 32 nibbles) and reads
//    the activations of the same k positions; no ldmatrix or shuffle is needed, and the 4-bit
//    magic-number conversion may pair k with k + 4 (the activations are permuted to match).
//  * Weights travel by cp.async (16-byte, L2 256-byte prefetch) into a 3-stage ring of 16 KB per
//    stage per CTA; every lane reads back only the bytes it copied. Three stages, not four: the
//    16 KB freed per CTA hold more items' activations whole (no CTA barrier per stage), and two
//    stages ahead still cover the weights' latency (benchmarks/NOTES.md, v30: 4-bit decode 0.96-1.01x
//    the four-stage time, qwen3 fp8 M = 1 0.89x, bf16 / fp8 otherwise within 1.2%). Activations of
//    the item's rows go through the same ring once per CTA and are shared by its warps.
//  * Dequantization happens in registers after the shared-memory read, with packed 16-bit bit
//    tricks where they are exact (int4 with 16-bit scales of the activation type; e2m1 with e8m0
//    scales and bf16 activations) and otherwise in float32 with the contract's formula (the
//    weight is the activation-type rounding of the float32 value, as in gemm_weight).
//  * 8-bit activations: the MMA takes f16 codes (every fp8/int8/int4/e2m1 code is exact in f16)
//    and each chunk column of K (one scale group of weights and activations) is scaled by
//    a_scale * w_scale into the float32 accumulator, the generic kernel's method.
//  * Enough CTAs for all SMs: a CTA owns 32 * (8 / wk) weight rows of one work item and splits K
//    over wk warp groups (wk = 1..8, chosen on the host from the expected number of items and the
//    shared memory left for two CTAs per SM); the wk partial sums are added in a fixed order
//    through shared memory: deterministic, no atomics.
//  * The bit-level lane mapping and conversions are modelled on the host and checked against the
//    contract by gemm_decode_sm90_model.py; keep the two in step.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda_launch.cuh"
#include "dependent_launch.cuh"
#include "ffi_common.h"
#include "quantize_cuda.h"
#include "gemm_decode_sm90.h"
#include "gemm_kernels_sm80.cuh"

namespace hj {
namespace decode {

using gemm::GemmLaunch;
using gemm::RowMode;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kNT = 2;                                  // 16-row weight tiles per warp
constexpr int kStages = 3;                              // cp.async ring depth
constexpr int kItemRows = 16;                           // rows (tokens) of a work item, as a rule
constexpr int kMaxRows = 32;                            // ... and at most (grouped, D.item_rows)
constexpr int kLaneBytes = kNT * 2 * 16;                // weight bytes one lane copies per stage
constexpr int kWarpStageBytes = kLaneBytes * 32;        // 2 KB
constexpr int kWStageBytes = kWarpStageBytes * kWarps;  // 16 KB of weights per CTA stage
constexpr int kRowsPerWarp = kNT * 16;                  // weight rows per warp
constexpr int kChunkRowBytes = 64;                      // bytes of a row one warp reads per stage
constexpr int kStaticSmemReserve = 768;                // bound on decode_kernel's static shared memory
// The sm_90 opt-in limit per block (227 KB) covers static and dynamic shared memory together.
constexpr int kMaxDynamicSmem = 227 * 1024 - kStaticSmemReserve;

enum class ActKind : int { kBF16 = 0, kF16 = 1, kFp8 = 2, kI8 = 3 };
// kRaw: 16-bit weights. kPackedU4: int4 with a 16-bit scale of the activation type and no scale2.
// kPackedFp4: e2m1 with e8m0 scales, bf16 activations, no scale2. kF32: any other weight with
// 16-bit activations. kCodes: 8-bit activations.
enum class Deq : int { kRaw = 0, kPackedU4 = 1, kPackedFp4 = 2, kF32 = 3, kCodes = 4 };

// The variants that hold the gated epilogue (gemm_indexed_gated, DecodeLaunch::gate_act: the
// activated output pairs written by the kernel): raw and packed. The float32-scale ones would
// spill (28-44 bytes). The host pairs the rows only for these (launch_decode).
constexpr bool has_gated_epilogue(Deq dq) { return dq == Deq::kRaw || dq == Deq::kPackedU4 || dq == Deq::kPackedFp4; }

// n / d for n < 2^31 by a multiply and a shift (the divisor is a run-time constant of the launch).
struct FastDiv {
  uint32_t mul, shift;
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, mul) + n) >> shift; }
};

inline FastDiv make_fastdiv(uint32_t d) {
  uint32_t l = 0;
  while ((uint64_t{1} << l) < d) ++l;
  const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1;
  return FastDiv{static_cast<uint32_t>(m), l};
}

// Everything a launch needs; filled on the host (launch_decode) from the generic kernel's
// GemmLaunch, which already holds the parsed problem and the row layout.
struct DecodeLaunch {
  GemmLaunch g;
  int wk, wn, bn;           // warps along K and along N; weight rows per CTA (= wn * 32)
  int max_rows;             // activation rows per stage held in shared memory
  int nc, iters;            // 64-byte chunk columns of a weight row; pipeline iterations
  int act_row_bytes;        // shared-memory stride of one activation row in a stage
  int act_stage_bytes;      // max_rows * act_row_bytes
  int act_region_bytes;     // the activations' part of shared memory (>= kStages * act_stage_bytes)
  int whole_row_bytes;      // stride of one activation row held over all of K (whole mode)
  int whole_rows;           // items of at most this many rows hold their activations whole (0: never)
  int pre_permute;          // 1: whole-mode items of 4-bit packed variants pre-permute them (kPrePermute)
  int est_items;            // work items expected to have rows (the planner's estimate, from shapes)
  int items;                // work items (indexed: blocks; grouped: gemm + zero items; batched: E, as T <= 16)
  int gemm_items;           // grouped: items below this compute, the rest write zero rows
  int nslot;                // kF32: weight scales per lane chunk (1, or 2 for groups of half a chunk)
  int w_row_bytes;          // bytes of one weight row
  int item_rows;            // grouped: rows per work item (kItemRows; kMaxRows for quantized weights
                            // with 16-bit activations, which then dequantize once per 32 rows)
  int K, N;
  FastDiv div_gk, div_agk;  // k -> weight / activation scale column
  // Run-time divisors of the per-item set-up (a generic integer division is a ~20-instruction
  // sequence, a 64-bit one a subroutine): 16-byte activation units per whole row, the scale
  // grid's group_n, the indexed layout's gather_div (id -> activation row).
  FastDiv div_upr, div_gn, div_gather;
  // gemm_indexed_quant on the fp8 x fp8 variant: non-null, the 16-bit rows [a_rows, xq_cols] that
  // each item activates (xq_act >= 0: silu, gated, with xq_limit) and quantizes into its
  // whole-K activation rows (fp8 e4m3, 128-k groups), the scales beside them in shared memory
  // (xq_scales_offset); the codes and scales of g.p.a are not read.
  const void* xq;
  int xq_f16;  // xq holds float16 (else bfloat16)
  int xq_act;
  float xq_limit;
  int64_t xq_cols;
  // gemm_indexed_gated: gate_act >= 0 (a gated Activation code) makes the epilogue write
  // y[row, i] = act(gate, up) of the row's rounded GEMM values instead of c; the pairs are weight
  // rows (2i, 2i + 1) with gate_oai, else (i, I + i): then the CTA's first wn / 2 warps take gate
  // rows and the others the matching up rows. A CTA covers output columns [x * bn / 2, + bn / 2).
  int gate_act;
  int gate_oai;
  float gate_limit;
  int gate_I;  // output columns, N / 2
  void* gate_y;
  // The CTA's weight rows (set by the host for every launch): from blockIdx.x * x_rows, warps
  // wn >= up_warp adding up_skip (x_rows = bn, up_warp = wn, up_skip = 0 unless gate_act pairs
  // halves: bn / 2, wn / 2, I - bn / 2).
  int x_rows, up_warp, up_skip;
};

// The quantized rows' scales in the activation region: [whole_rows][K / 128] float32 after the
// whole rows.
__host__ __device__ __forceinline__ int xq_scales_offset(const DecodeLaunch& D) {
  return D.whole_rows * D.whole_row_bytes;
}
__host__ __device__ __forceinline__ int xq_scales_bytes(const DecodeLaunch& D) {
  return D.whole_rows * (D.K / 128) * 4;
}
// The activation region of a launch whose items quantize their rows: the whole rows and the scales.
inline int xq_region_bytes(const DecodeLaunch& D) {
  return D.act_region_bytes > xq_scales_offset(D) + xq_scales_bytes(D) ? D.act_region_bytes
                                                                      : xq_scales_offset(D) + xq_scales_bytes(D);
}

// The wk groups' partial sums red[wk][kMaxRows][bn + 8] (float32, Kern::run's reduction) fit in the
// weight ring alone, for every split of the warps.
constexpr bool reduction_fits_ring() {
  for (int wk = 1; wk <= kWarps; wk *= 2)
    if (wk * kMaxRows * (kWarps / wk * kRowsPerWarp + 8) * 4 > kStages * kWStageBytes) return false;
  return true;
}
static_assert(reduction_fits_ring(), "the reduction buffer must fit in the weight ring");

// Shared memory of a launch: the ring (weights + activations); the reduction reuses it.
inline size_t decode_smem_bytes(const DecodeLaunch& D) {
  return static_cast<size_t>(kStages) * kWStageBytes + static_cast<size_t>(D.act_region_bytes);
}

// ---------------------------------------------------------------------------------------------
// Device primitives.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy of weights to shared-memory address `dst`; `bytes` < 16 zero-fills the rest
// (0 = no read at all). The L2 prefetch hint pulls the rest of the row's 256-byte segment, which
// the next stages read.
__device__ __forceinline__ void cp_async_weights(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}

// The same without the prefetch hint (activation rows).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void lds128(uint32_t (&r)[4], const void* p) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void lds64(uint32_t (&r)[2], const void* p) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

// The same loads from a shared-memory address.
__device__ __forceinline__ void lds128(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void lds64(uint32_t (&r)[2], uint32_t a) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

__device__ __forceinline__ void sts128(uint32_t a, uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x0), "r"(x1), "r"(x2), "r"(x3) : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma (sm_90a): the primitives of the fp8 ring kernel (e4m3 codes of both operands straight from
// shared memory) and of the 4-bit prefill mainloop.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps a register's value in place across asynchronous wgmma reads or writes (the compiler sees
// a read and a write here, so it can neither move nor reuse the register before this point).
__device__ __forceinline__ void fence_reg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64 x 8G] (+)= A[64 x 32] * B[32 x 8G], e4m3 codes, float32 accumulators; acc = 0 overwrites D.
template <int G>
struct WgMma;
template <>
struct WgMma<1> {
  static __device__ __forceinline__ void run(float (&d)[4], uint64_t da, uint64_t db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "r"(acc));
  }
};
template <>
struct WgMma<2> {
  static __device__ __forceinline__ void run(float (&d)[8], uint64_t da, uint64_t db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(acc));
  }
};

// (a & b) | c
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

template <int S>
__device__ __forceinline__ uint32_t shift_left(uint32_t x) {
  if constexpr (S >= 0)
    return x << S;
  else
    return x >> (-S);
}

// Packed 16-bit arithmetic, round to nearest even, subnormals kept (no .ftz).
template <bool kF16>
__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (kF16)
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

template <bool kF16>
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (kF16)
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ float f16_lo(uint32_t x) { return __half2float(__ushort_as_half(static_cast<unsigned short>(x))); }
__device__ __forceinline__ float f16_hi(uint32_t x) { return __half2float(__ushort_as_half(static_cast<unsigned short>(x >> 16))); }

// m16n8k32 with s8 operands (four codes per register) into int32, exact. Fragments as m16n8k16's
// with four k per register.
__device__ __forceinline__ void mma_s8_16832(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------------
// Codes as exact f16 pairs (the 8-bit-activation MMA operands, and the first step of the float32
// path). Pair p of a 4-bit word holds nibbles p and p + 4 (k and k + 4); pair p of an 8-bit word
// holds bytes 2p and 2p + 1.
// ---------------------------------------------------------------------------------------------
// int4: (q - z) via 1024 + q (f16 0x6400 | q) minus 1024 + z; zm = (0x6400 + z) in both halves.
template <int P>
__device__ __forceinline__ uint32_t u4_code_pair(uint32_t q, uint32_t zm) {
  return hsub2<true>(and_or(shift_left<-4 * P>(q), 0x000f000fu, 0x64006400u), zm);
}

// e2m1 sign and magnitude bits placed into a 16-bit float: magnitude at bits [MB, MB + 2], sign at
// bit 15 of each half. As f16 (MB = 9) the value is e2m1 * 2^-14; as bf16 (MB = 6) e2m1 * 2^-126;
// codes with a zero exponent land on subnormals, which the multiplies below keep exactly.
template <int P, int MB>
__device__ __forceinline__ uint32_t e2m1_bits(uint32_t q) {
  constexpr uint32_t mag_mask = (0x7u << MB) | (0x7u << (MB + 16));
  const uint32_t sign = shift_left<12 - 4 * P>(q) & 0x80008000u;
  return and_or(shift_left<MB - 4 * P>(q), mag_mask, sign);
}

// e8m0 scale s as bf16 factors of e2m1 * 2^-126 (e2m1_bits<P, 6>): 2^(s - 1) = 2^126 * 2^(s - 127) in
// one factor when s <= 128, else 2^127 and 2^(s - 128) (no factor may overflow); s = 255 is NaN, as
// e8m0_to_float says. Every product is exact when representable (e2m1 has two significant bits).
__device__ __forceinline__ void fp4_factors(uint32_t s, uint32_t& f1, uint32_t& f2, bool& two) {
  two = s > 128u && s != 255u;
  f1 = (s <= 128u ? (s + 126u) << 7 : (s == 255u ? 0x7fc0u : 0x7f00u)) * 0x10001u;
  f2 = two ? ((s - 1u) << 7) * 0x10001u : 0x3f803f80u;
}

template <int P>
__device__ __forceinline__ uint32_t fp4_code_pair(uint32_t q) {
  return hmul2<true>(e2m1_bits<P, 9>(q), 0x74007400u);  // * 2^14
}

// int8 codes: (b ^ 0x80) into the mantissa of 1024, minus 1152.
template <int P>
__device__ __forceinline__ uint32_t i8_code_pair(uint32_t w) {
  const uint32_t h = __byte_perm(w ^ 0x80808080u, 0x64646464u, P == 0 ? 0x4140 : 0x4342);
  return hsub2<true>(h, 0x64806480u);
}

template <int P>
__device__ __forceinline__ uint32_t fp8_code_pair(uint32_t w) {
  const __half2_raw r =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(P == 0 ? (w & 0xffffu) : (w >> 16)), __NV_E4M3);
  return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

// ---------------------------------------------------------------------------------------------
// Weight scales.
// ---------------------------------------------------------------------------------------------
// Raw bits of scale element idx. SB: the element size when the variant fixes it (the packed modes),
// 0 to read it from the launch (f32 first: every 8-bit weight scheme has f32 scales).
template <int SB>
__device__ __forceinline__ uint32_t load_scale_raw(ElemType t, const void* base, uint32_t idx) {
  if constexpr (SB == 4) return __ldg(static_cast<const unsigned int*>(base) + idx);
  if constexpr (SB == 2) return __ldg(static_cast<const unsigned short*>(base) + idx);
  if constexpr (SB == 1) return __ldg(static_cast<const unsigned char*>(base) + idx);
  if (t == ElemType::kF32) return __ldg(static_cast<const unsigned int*>(base) + idx);
  if (t == ElemType::kBF16 || t == ElemType::kF16) return __ldg(static_cast<const unsigned short*>(base) + idx);
  return __ldg(static_cast<const unsigned char*>(base) + idx);
}

__device__ __forceinline__ float scale_to_float(ElemType t, uint32_t raw) {
  switch (t) {
    case ElemType::kF32: return __uint_as_float(raw);
    case ElemType::kBF16: return __uint_as_float(raw << 16);
    case ElemType::kF16: return f16_lo(raw);
    case ElemType::kE8M0: return e8m0_to_float(static_cast<uint8_t>(raw));
    case ElemType::kE4M3: return e4m3_to_float(static_cast<uint8_t>(raw));
    default: return __uint_as_float(0x7fc00000u);
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel. SF: the weight scales are float32 (every 8-bit weight scheme), known at compile time
// so that the float32 and codes modes read and convert them without a switch on the type. ZP: uint4
// weights may have zero points (false: none, known at compile time, so no zero-point loads). FQ
// (fp8 x fp8 only): the variant that quantizes its 16-bit token rows itself (DecodeLaunch::xq), a
// kernel of its own so that the other variants carry none of its code.
// ---------------------------------------------------------------------------------------------
template <WeightType WT, ActKind AK, Deq DQ, bool SF, bool ZP = true, bool FQ = false>
struct Kern {
  static constexpr bool kQ8 = AK == ActKind::kFp8 || AK == ActKind::kI8;
  static constexpr bool kFusedQ = FQ;
  static_assert(!FQ || (WT == WeightType::kFp8E4M3 && AK == ActKind::kFp8 && DQ == Deq::kCodes),
                "the fused quantization is an fp8 x fp8 variant");
  static constexpr bool kF16 = AK != ActKind::kBF16;  // MMA operand type: f16 (also for 8-bit codes)
  // int8 weights and activations: their codes go to the integer m16n8k32 MMA as they are. (An e4m3
  // mma.sync is no shortcut on sm_90: ptxas expands it into f16 conversions of both operands.)
  static constexpr bool kNative8 = WT == WeightType::kInt8 && AK == ActKind::kI8;
  static constexpr bool k4Bit = WT == WeightType::kUInt4 || WT == WeightType::kFp4E2M1;
  // Quantized weights with 16-bit activations take grouped items of up to kMaxRows rows.
  static constexpr bool kWideItems = !kQ8 && WT != WeightType::kFloat;
  // 4-bit weights with 16-bit activations pair k with k + 4 in a register; in whole mode the CTA
  // reorders its activation rows that way once per item (permute_whole_activations), instead of
  // every warp doing it per MMA step (4 PRMT per token tile and weight word, on the ALU pipe that
  // the conversion already saturates). Packed modes only: the float32-scale modes would spill.
  static constexpr bool kPrePermute = k4Bit && !kQ8 && (DQ == Deq::kPackedU4 || DQ == Deq::kPackedFp4);
  // Weight copies from per-item row offsets (Item::roff): fewer instructions per iteration, four
  // more registers. Packed e2m1 only: 1-2.5% faster there at 1-16 tokens, while packed uint4 was
  // -1% to +1.2% (benchmarks/NOTES.md, v11j) and the other variants would spill.
  static constexpr bool kRowOffsets = DQ == Deq::kPackedFp4;
  static constexpr bool kGatedEpilogue = has_gated_epilogue(DQ);
  // Indexed items issue their first stages' weights before placing their ids (decode_kernel).
  static constexpr bool kEarlyWeights = DQ == Deq::kRaw || DQ == Deq::kPackedU4 || DQ == Deq::kPackedFp4;
  static constexpr int kEpc = WT == WeightType::kFloat ? 8 : (k4Bit ? 32 : 16);  // k per lane chunk
  static constexpr int kKw = 4 * kEpc;                                           // k per chunk column
  static constexpr int kAsz = kQ8 ? 1 : 2;                                       // activation bytes
  static constexpr int kNs = DQ == Deq::kF32 ? 2 : 1;                            // scale slots per chunk
  static constexpr bool kScaled = WT != WeightType::kFloat;
  static constexpr int kSB = DQ == Deq::kPackedU4 ? 2 : (DQ == Deq::kPackedFp4 ? 1 : (SF ? 4 : 0));  // scale bytes
  static_assert(!SF || DQ == Deq::kF32 || DQ == Deq::kCodes, "f32 scales: float32 and codes modes only");

  static __device__ __forceinline__ float scale_value(const DecodeLaunch& D, uint32_t raw) {
    if constexpr (SF)
      return __uint_as_float(raw);
    else
      return scale_to_float(D.g.p.w.scale_type, raw);
  }
  static_assert(!(kQ8 && DQ != Deq::kCodes), "8-bit activations use codes");
  static_assert(!(WT == WeightType::kFloat && DQ != Deq::kRaw), "16-bit weights are used as they are");

  // A lane's scales for one iteration: weight scale(s) and zero point of each of its rows, and
  // (8-bit activations) the activation scales of the two token columns it accumulates.
  template <int TOKT>
  struct Scales {
    uint32_t w[kNT][2][kNs];
    uint32_t z;  // zero points of the four rows, one byte each (row i * 2 + h)
    float a[TOKT][2];
  };

  struct Item {
    int expert, nvalid;
    // The lane's 16 bytes of chunk column 0 in its first row (g of tile 0), or (kRowOffsets) in
    // row N - 1 when that row lies past N.
    const uint8_t* wlane;
    // kRowOffsets: the byte offset from wlane of row g + 8h of tile i (roff[2i + h]); rows past N
    // copy row N - 1 (real bytes, whose sums are never stored) instead of a predicate per row and
    // iteration. Otherwise: rows stride8 apart, zero-filled past N (row_ok bit 2i + h).
    uint32_t roff[kNT * 2];
    int64_t stride8;
    unsigned row_ok;
    uint32_t srow[kNT][2];  // scale-grid index of each row's first column
  };

  // Issues the cp.async copies of iteration `it` into ring slot it % kStages: the warp's weights
  // (unless `weights` is false: issue_first_weights copied them) and, staged, the activations.
  static __device__ __forceinline__ void issue(const DecodeLaunch& D, const Item& it_, int it, uint8_t* smem,
                                               const int64_t* s_abyte, int wk, int warp, int lane, int tid,
                                               bool whole, bool weights = true) {
    const int slot = it % kStages;
    const int c = it * D.wk + wk;
    const int t = lane & 3;
    if (weights && c < D.nc) {
      // The lane's part of a last, partial chunk column may lie past K: zero-filled.
      const bool kok = c * kKw + t * kEpc < D.K;
      // The lane's 16 bytes of rows 8q + g (row-major 64-byte rows). lane * 16 is added to the
      // shared-memory address, not to the pointer: the latter made ptxas (CUDA 13.0) spill more in
      // the 8-bit-activation variants with float32 scales (fp8 x fp8: 16 bytes instead of none).
      const uint32_t dst =
          smem_addr(smem + slot * kWStageBytes + warp * kWarpStageBytes) + static_cast<uint32_t>(lane * 16);
      if constexpr (kRowOffsets) {
        // the source stays inside the row (column 0) where the column is zero-filled
        const uint8_t* src = it_.wlane + (kok ? static_cast<uint32_t>(c) * kChunkRowBytes : 0u);
        const int bytes = kok ? 16 : 0;
#pragma unroll
        for (int q = 0; q < kNT * 2; ++q) cp_async_weights(dst + q * 512, src + it_.roff[q], bytes);
      } else {
        const uint8_t* src = it_.wlane + static_cast<uint32_t>(c) * kChunkRowBytes;
#pragma unroll
        for (int q = 0; q < kNT * 2; ++q) {
          const bool ok = kok && ((it_.row_ok >> q) & 1u);
          cp_async_weights(dst + q * 512, ok ? src : it_.wlane, ok ? 16 : 0);
          src += it_.stride8;
        }
      }
    }
    // Activations of the item's rows for the stage's K range, shared by the CTA's warps. Row r's
    // bytes start at s_abyte[r] (set per item); 16-byte unit cu of the stage is k = k_first + cu * 16 / kAsz.
    // Whole mode: copied once for the item (copy_whole_activations).
    if (whole) return;
    const int ks_bytes = D.wk * kKw * kAsz;
    const int upr_log2 = __ffs(ks_bytes / 16) - 1;  // 16-byte units per row (a power of two)
    const int units = it_.nvalid << upr_log2;
    const uint32_t abase = smem_addr(smem + kStages * kWStageBytes + slot * D.act_stage_bytes);
    const uint8_t* a = static_cast<const uint8_t*>(D.g.p.a.data);
    const int64_t kb_first = static_cast<int64_t>(it) * ks_bytes;  // byte offset of the stage in a row
    const int64_t row_bytes = static_cast<int64_t>(D.K) * kAsz;
    for (int u = tid; u < units; u += kThreads) {
      const int r = u >> upr_log2, cu = u & ((1 << upr_log2) - 1);
      const int64_t kb = kb_first + cu * 16;
      const bool ok = kb < row_bytes;
      cp_async16(abase + r * D.act_row_bytes + cu * 16, ok ? a + s_abyte[r] + kb : a, ok ? 16 : 0);
    }
  }

  // The weights of the ring's first kStages - 1 stages, not committed: run() (weights_issued)
  // commits them with its first stage's copies. Issued as soon as the item's expert is known, so
  // that their memory latency overlaps the rest of the item's set-up.
  // With them, the scales those stages use are prefetched into L1 (run's first load_scales would
  // otherwise wait on their own memory latency after the weights arrived).
  static __device__ __forceinline__ void issue_first_weights(const DecodeLaunch& D, const Item& it_, uint8_t* smem,
                                                             int warp, int lane) {
    const int wk = warp >> (__ffs(D.wn) - 1);
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st >= D.iters) break;
      issue(D, it_, st, smem, nullptr, wk, warp, lane, 0, true);
      if constexpr (kScaled && kSB > 0) {
        const uint32_t k0 = min(static_cast<uint32_t>((st * D.wk + wk) * kKw + (lane & 3) * kEpc),
                                static_cast<uint32_t>(D.K - 1));
        const uint32_t sk0 = D.div_gk.div(k0);
        const uint8_t* scale = static_cast<const uint8_t*>(D.g.p.w.scale);
        for_rows(it_, [&](int, int, uint32_t base) {
          asm volatile("prefetch.global.L1 [%0];\n" ::"l"(scale + static_cast<size_t>(base + sk0) * kSB));
        });
      }
    }
  }

  // The item's weight and scale rows for the CTA's slice from row n0 of expert `expert` (a valid
  // id): the lane's first weight bytes and its rows' bounds or offsets, and their scale-grid rows.
  static __device__ __forceinline__ void setup_rows(const DecodeLaunch& D, Item& it_, int expert, int64_t n0,
                                                    int warp, int lane) {
    const GemmLaunch& L = D.g;
    const WeightView& w = L.p.w;
    it_.expert = expert;
    const int wn = warp & (D.wn - 1);
    // The CTA's rows from blockIdx.x * x_rows; warps from up_warp on skip up_skip rows (the gated
    // halves pairing: gate rows i, then up rows I + i; otherwise x_rows = bn and no warp skips).
    int64_t n_lane = n0 + wn * kRowsPerWarp + (lane >> 2);
    if constexpr (kGatedEpilogue)
      n_lane = static_cast<int64_t>(blockIdx.x) * D.x_rows + wn * kRowsPerWarp + (lane >> 2) +
               (wn >= D.up_warp ? D.up_skip : 0);
    const int64_t n_first = kRowOffsets ? min(n_lane, static_cast<int64_t>(D.N) - 1) : n_lane;
    it_.wlane = static_cast<const uint8_t*>(w.data) +
                (static_cast<int64_t>(expert) * D.N + n_first) * D.w_row_bytes + (lane & 3) * 16;
    it_.stride8 = static_cast<int64_t>(8) * D.w_row_bytes;
    it_.row_ok = 0u;
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t n = n_lane + i * 16 + 8 * h;
        const bool ok = n < D.N;
        if constexpr (kRowOffsets)  // < 24 rows apart; the host keeps 24 rows below 2^31 bytes
          it_.roff[i * 2 + h] = static_cast<uint32_t>((min(n, static_cast<int64_t>(D.N) - 1) - n_first) * D.w_row_bytes);
        else
          it_.row_ok |= ok ? 1u << (i * 2 + h) : 0u;
        it_.srow[i][h] = 0u;
        if constexpr (WT != WeightType::kFloat) {
          if (ok)
            it_.srow[i][h] = (static_cast<uint32_t>(expert) * L.scale_rows + D.div_gn.div(static_cast<uint32_t>(n))) *
                             L.scale_cols;
        }
      }
  }

  // Whole mode: the item's activation rows over all chunk columns of K, copied once by the CTA
  // (zeros past K), so that the pipeline's stages carry only each warp's own weights and need no
  // CTA barrier. Row r at r * whole_row_bytes of the activation region.
  static __device__ __forceinline__ void copy_whole_activations(const DecodeLaunch& D, int nvalid, uint8_t* smem,
                                                                const int64_t* s_abyte, int tid) {
    const int units_per_row = D.nc * kKw * kAsz / 16;
    const uint32_t abase = smem_addr(smem + kStages * kWStageBytes);
    const uint8_t* a = static_cast<const uint8_t*>(D.g.p.a.data);
    const int64_t row_bytes = static_cast<int64_t>(D.K) * kAsz;
    for (int u = tid; u < nvalid * units_per_row; u += kThreads) {
      const int r = static_cast<int>(D.div_upr.div(static_cast<uint32_t>(u))), cu = u - r * units_per_row;
      const int64_t kb = static_cast<int64_t>(cu) * 16;
      const bool ok = kb < row_bytes;
      cp_async16(abase + r * D.whole_row_bytes + cu * 16, ok ? a + s_abyte[r] + kb : a, ok ? 16 : 0);
    }
  }

  // Whole mode with 16-bit rows (DecodeLaunch::xq): the item's rows activated (or not) and
  // quantized into the whole-K activation rows (fp8 e4m3, one scale per 128 k, as the
  // activation_quant / quantize kernels: the same values, maximum, scale and codes) and their
  // scales beside them, by the whole CTA: each half warp takes one 128-k group of a row, 8 values
  // per lane. The loop runs warp-uniformly (shuffles, vote).
  static __device__ __noinline__ void quantize_whole_activations(const DecodeLaunch& D, int nvalid, uint8_t* smem,
                                                                 const int32_t* s_arow, int tid) {
    const int ngroups = D.K >> 7, total = nvalid * ngroups;
    const int lane = tid & 31, j16 = lane & 15;
    uint8_t* abase = smem + kStages * kWStageBytes;
    float* sxs = reinterpret_cast<float*>(abase + xq_scales_offset(D));
    const uint16_t* x = static_cast<const uint16_t*>(D.xq);
    for (int base = (tid >> 5) * 2; base < total; base += kThreads / 16) {
      const int gi = base + (lane >> 4);
      const bool ok = gi < total;
      const int r = ok ? gi / ngroups : 0, grp = gi - r * ngroups;
      float v[8];
      if (ok) {
        const uint16_t* xr = x + static_cast<int64_t>(s_arow[r]) * D.xq_cols;
        // The one activation taken here (quantizes_whole) known at compile time: the code runs
        // once per item, so its size is instruction fetches on the path to the first MMA.
        const int act = D.xq_act < 0 ? -1 : static_cast<int>(Activation::kSilu);
        if (D.xq_f16)
          act8<ElemType::kF16>(act, D.xq_limit, xr, D.K, grp * 128 + j16 * 8, v);
        else
          act8<ElemType::kBF16>(act, D.xq_limit, xr, D.K, grp * 128 + j16 * 8, v);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
      }
      float m = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float sc = quant_scale(ActQuant::kFp8E4M3, m);
      const uint2 codes = e4m3_codes8(v, sc);
      if (ok) {
        *reinterpret_cast<uint2*>(abase + r * D.whole_row_bytes + grp * 128 + j16 * 8) = codes;
        if (j16 == 0) sxs[r * ngroups + grp] = sc;
      }
    }
  }

  // Whole mode, kPrePermute: each 16-byte unit (k0..k7) of the item's activation rows becomes
  // (k0,k4) (k1,k5) (k2,k6) (k3,k7), the order of the weight pairs. Run by the whole CTA between
  // two barriers, after the copies landed.
  static __device__ __forceinline__ void permute_whole_activations(const DecodeLaunch& D, int nvalid, uint8_t* smem,
                                                                   int tid) {
    const int units_per_row = D.nc * kKw * kAsz / 16;
    const uint32_t abase = smem_addr(smem + kStages * kWStageBytes);
    for (int u = tid; u < nvalid * units_per_row; u += kThreads) {
      const int r = static_cast<int>(D.div_upr.div(static_cast<uint32_t>(u))), cu = u - r * units_per_row;
      const uint32_t addr = abase + r * D.whole_row_bytes + cu * 16;
      uint32_t x[4];
      lds128(x, addr);
      sts128(addr, __byte_perm(x[0], x[2], 0x5410), __byte_perm(x[0], x[2], 0x7632), __byte_perm(x[1], x[3], 0x5410),
             __byte_perm(x[1], x[3], 0x7632));
    }
  }

  // f(i, h, srow) for each of the lane's rows (row g + 8h of tile i; srow: its scale-grid index), the
  // one shape of the scale and zero-point loads.
  template <typename F>
  static __device__ __forceinline__ void for_rows(const Item& it_, F&& f) {
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) f(i, h, it_.srow[i][h]);
  }

  // Loads the lane's scales of iteration `it` (plain loads, consumed two iterations later).
  template <int TOKT>
  static __device__ __forceinline__ void load_scales(const DecodeLaunch& D, const Item& it_, int it, int wk,
                                                     int lane, const int32_t* s_arow, Scales<TOKT>& s) {
    const int c = it * D.wk + wk;
    const int t = lane & 3;
    const WeightView& w = D.g.p.w;
    // Indices are clamped into range instead of predicated: a clamped scale only ever meets
    // zero-filled activations (k >= K), a row past N (srow 0) or a token column past nvalid,
    // none of which is stored. Fields a variant does not use are set once, for the ring's copies.
    if constexpr (!kScaled) {
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int q = 0; q < kNs; ++q) s.w[i][h][q] = 0u;
    }
    if constexpr (WT != WeightType::kUInt4 || !ZP) s.z = 0x08080808u;
    if constexpr (!kQ8) {
#pragma unroll
      for (int j = 0; j < TOKT; ++j) s.a[j][0] = s.a[j][1] = 0.0f;
    }
    if constexpr (kScaled) {
      const uint32_t kmax = static_cast<uint32_t>(D.K - 1);
      const uint32_t k0 = min(static_cast<uint32_t>(c * kKw + t * kEpc), kmax);
      const uint32_t sk0 = D.div_gk.div(k0);
      uint32_t sk1 = sk0;
      if constexpr (kNs == 2) sk1 = D.div_gk.div(min(k0 + (D.nslot == 2 ? kEpc / 2 : 0), kmax));
      for_rows(it_, [&](int i, int h, uint32_t base) {
        s.w[i][h][0] = load_scale_raw<kSB>(w.scale_type, w.scale, base + sk0);
        if constexpr (kNs == 2) s.w[i][h][1] = load_scale_raw<kSB>(w.scale_type, w.scale, base + sk1);
      });
      if constexpr (WT == WeightType::kUInt4 && ZP) {
        s.z = 0x08080808u;
        if (w.zero) {
          uint32_t z = 0;
          for_rows(it_, [&](int i, int h, uint32_t base) {
            z |= static_cast<uint32_t>(__ldg(w.zero + base + sk0)) << (8 * (i * 2 + h));
          });
          s.z = z;
        }
      }
    }
    if constexpr (kQ8) {
      if constexpr (kFusedQ) {  // read from shared memory where they are used
#pragma unroll
        for (int j = 0; j < TOKT; ++j) s.a[j][0] = s.a[j][1] = 0.0f;
        return;
      }
      const ActView& a = D.g.p.a;
      const uint32_t ak = D.div_agk.div(min(static_cast<uint32_t>(c * kKw), static_cast<uint32_t>(D.K - 1)));
      const int64_t cols = static_cast<int64_t>(D.g.a_scale_cols);
#pragma unroll
      for (int j = 0; j < TOKT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = min(8 * j + 2 * t + e, it_.nvalid - 1);
          s.a[j][e] = __ldg(a.scale + s_arow[tok] * cols + ak);
        }
    }
  }

  // ------------------------------------------------------------------------------------------
  // Dequantization of one pair of a weight word into the MMA's A operand type.
  // ------------------------------------------------------------------------------------------
  // The exact f16 code pair (before any scale).
  template <int P>
  static __device__ __forceinline__ uint32_t code_pair(uint32_t word, uint32_t z) {
    if constexpr (WT == WeightType::kUInt4)
      return u4_code_pair<P>(word, (0x6400u + z) * 0x10001u);
    else if constexpr (WT == WeightType::kFp4E2M1)
      return fp4_code_pair<P>(word);
    else if constexpr (WT == WeightType::kInt8)
      return i8_code_pair<P>(word);
    else
      return fp8_code_pair<P>(word);
  }

  // w' of the contract for a pair: float32 (code * scale (* scale2)), rounded to the activation
  // type; or the code itself for 8-bit activations.
  template <int P>
  static __device__ __forceinline__ uint32_t deq_pair(const DecodeLaunch& D, uint32_t word, uint32_t sraw, uint32_t z,
                                                      float s2) {
    if constexpr (DQ == Deq::kCodes) {
      return code_pair<P>(word, z);
    } else if constexpr (DQ == Deq::kPackedU4) {
      // (128 + q) or (1024 + q) exactly, minus (128 + z) / (1024 + z): the integer q - z; times the
      // 16-bit scale: one rounding of an exact product, as float32-then-round gives.
      constexpr uint32_t magic = kF16 ? 0x64006400u : 0x43004300u;
      const uint32_t m = and_or(shift_left<-4 * P>(word), 0x000f000fu, magic);
      const uint32_t zm = ((kF16 ? 0x6400u : 0x4300u) + z) * 0x10001u;
      return hmul2<kF16>(hsub2<kF16>(m, zm), sraw * 0x10001u);
    } else if constexpr (DQ == Deq::kPackedFp4) {
      // e2m1 * 2^-126 as bf16 times the first factor of fp4_factors (here `sraw`); the rare
      // second factor is applied by the caller.
      return hmul2<false>(e2m1_bits<P, 6>(word), sraw);
    } else {  // kF32
      const uint32_t cp = code_pair<P>(word, z);
      const float sc = scale_value(D, sraw);
      float lo = f16_lo(cp) * sc, hi = f16_hi(cp) * sc;
      if (D.g.p.w.scale2) {
        lo = lo * s2;
        hi = hi * s2;
      }
      return gemm::pack2<kF16>(lo, hi);
    }
  }


  // Activation codes (8-bit) as f16 pairs.
  template <int P>
  static __device__ __forceinline__ uint32_t act_code_pair(uint32_t w) {
    if constexpr (AK == ActKind::kI8)
      return i8_code_pair<P>(w);
    else
      return fp8_code_pair<P>(w);
  }

  // Two MMA steps over a lane's four words per row, for operands that need no conversion (16-bit
  // weights, int8 x int8 codes): step st takes words 2st and 2st + 1 of every weight row and of
  // each token's activations (the same k positions). mma(i, j, a, b0, b1) issues one MMA.
  template <int TOKT, typename F>
  static __device__ __forceinline__ void two_word_steps(const uint32_t (&w)[kNT][2][4], const uint32_t (&arow)[TOKT],
                                                        F&& mma) {
    uint32_t b[TOKT][4];
#pragma unroll
    for (int j = 0; j < TOKT; ++j) lds128(b[j], arow[j]);
#pragma unroll
    for (int st = 0; st < 2; ++st)
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        const uint32_t a[4] = {w[i][0][2 * st], w[i][1][2 * st], w[i][0][2 * st + 1], w[i][1][2 * st + 1]};
#pragma unroll
        for (int j = 0; j < TOKT; ++j) mma(i, j, a, b[j][2 * st], b[j][2 * st + 1]);
      }
  }

  // ------------------------------------------------------------------------------------------
  // MMAs of one chunk column: the lane's weight words w[i][h][0..3] (tile i, row g + 8h) against
  // the activations of token columns g (+ 8) at the same k positions.
  // ------------------------------------------------------------------------------------------
  // kTwo (packed e2m1 only): some lane of the warp has a scale above 2^1 this iteration, which
  // takes the second factor of fp4_factors.
  // kPre (kPrePermute, whole mode): the activations are already in pair order.
  template <int TOKT, bool kPre, bool kTwo = false>
  static __device__ __forceinline__ void chunk_mma(const DecodeLaunch& D, float (&acc)[kNT][TOKT][4],
                                                   const uint32_t (&w)[kNT][2][4], const uint8_t* arow0,
                                                   int arb, int g, int nvalid, const Scales<TOKT>& s, float s2) {
    // Token columns past nvalid read the last valid row instead of zeros: their sums are never
    // stored, and the loads need no predicate or zero fill.
    uint32_t arow[TOKT];  // shared-memory addresses
#pragma unroll
    for (int j = 0; j < TOKT; ++j) arow[j] = smem_addr(arow0) + min(g + 8 * j, nvalid - 1) * arb;

    if constexpr (WT == WeightType::kFloat) {
      // 8 bf16/f16 per lane and row: two MMA steps of natural pairs.
      two_word_steps<TOKT>(w, arow, [&](int i, int j, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        gemm::mma_16816<kF16>(acc[i][j], a, b0, b1);
      });
    } else if constexpr (kNative8) {
      // 16 codes per lane and row: MMA step st takes words 2st and 2st + 1 of the weights and of the
      // activations (the same k positions); no conversion at all.
      int c[kNT][TOKT][4] = {};
      two_word_steps<TOKT>(w, arow, [&](int i, int j, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        mma_s8_16832(c[i][j], a, b0, b1);
      });
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int j = 0; j < TOKT; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[i][j][r] += static_cast<float>(c[i][j][r]);  // exact: |sum| <= 64 * 128 * 128 = 2^20
    } else if constexpr (!k4Bit) {
      // 16 8-bit codes per lane and row: word st is MMA step st (bytes 0,1 and 2,3 as pairs).
      uint32_t b[TOKT][8];
#pragma unroll
      for (int j = 0; j < TOKT; ++j) {
        const uint32_t p = arow[j];
        if constexpr (kQ8) {
          uint32_t y[4];
          lds128(y, p);
#pragma unroll
          for (int st = 0; st < 4; ++st) {
            b[j][2 * st] = act_code_pair<0>(y[st]);
            b[j][2 * st + 1] = act_code_pair<1>(y[st]);
          }
        } else {
          uint32_t y0[4], y1[4];
          lds128(y0, p);
          lds128(y1, p + 16);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            b[j][q] = y0[q];
            b[j][4 + q] = y1[q];
          }
        }
      }
#pragma unroll
      for (int st = 0; st < 4; ++st)
#pragma unroll
        for (int i = 0; i < kNT; ++i) {
          constexpr int kSlot = 0;
          const int sl = (kNs == 2 && st >= 2) ? 1 : kSlot;
          uint32_t p01[2], p23[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t sr = s.w[i][h][kNs == 2 ? sl : 0];
            p01[h] = deq_pair<0>(D, w[i][h][st], sr, 0u, s2);
            p23[h] = deq_pair<1>(D, w[i][h][st], sr, 0u, s2);
          }
          const uint32_t a[4] = {p01[0], p01[1], p23[0], p23[1]};
#pragma unroll
          for (int j = 0; j < TOKT; ++j) gemm::mma_16816<kF16>(acc[i][j], a, b[j][2 * st], b[j][2 * st + 1]);
        }
    } else {
      // 32 nibbles per lane and row; word wd gives MMA steps 2wd (pairs 0, 1) and 2wd + 1 (2, 3),
      // each pair holding k and k + 4. The activations are permuted to the same pairs.
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        uint32_t b[TOKT][4];  // (k0,k4) (k1,k5) (k2,k6) (k3,k7) of the word's 8 positions
#pragma unroll
        for (int j = 0; j < TOKT; ++j) {
          const uint32_t p = arow[j];
          if constexpr (kQ8) {
            uint32_t y[2];
            lds64(y, p + wd * 8);
            const uint32_t q0 = __byte_perm(y[0], y[1], 0x5140), q1 = __byte_perm(y[0], y[1], 0x7362);
            b[j][0] = act_code_pair<0>(q0);
            b[j][1] = act_code_pair<1>(q0);
            b[j][2] = act_code_pair<0>(q1);
            b[j][3] = act_code_pair<1>(q1);
          } else {
            uint32_t x[4];
            lds128(x, p + wd * 16);
            if constexpr (kPre) {
#pragma unroll
              for (int q = 0; q < 4; ++q) b[j][q] = x[q];
            } else {
              b[j][0] = __byte_perm(x[0], x[2], 0x5410);
              b[j][1] = __byte_perm(x[0], x[2], 0x7632);
              b[j][2] = __byte_perm(x[1], x[3], 0x5410);
              b[j][3] = __byte_perm(x[1], x[3], 0x7632);
            }
          }
        }
        const int sl = (kNs == 2 && wd >= 2) ? 1 : 0;
#pragma unroll
        for (int i = 0; i < kNT; ++i) {
          uint32_t pr[2][4];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t sr = s.w[i][h][kNs == 2 ? sl : 0];
            uint32_t f2 = 0;
            bool two = false;
            if constexpr (DQ == Deq::kPackedFp4) fp4_factors(sr, sr, f2, two);
            const uint32_t z = WT == WeightType::kUInt4 && ZP ? (s.z >> (8 * (i * 2 + h))) & 0xffu : 8u;
            pr[h][0] = deq_pair<0>(D, w[i][h][wd], sr, z, s2);
            pr[h][1] = deq_pair<1>(D, w[i][h][wd], sr, z, s2);
            pr[h][2] = deq_pair<2>(D, w[i][h][wd], sr, z, s2);
            pr[h][3] = deq_pair<3>(D, w[i][h][wd], sr, z, s2);
            if constexpr (DQ == Deq::kPackedFp4 && kTwo) {
#pragma unroll
              for (int q = 0; q < 4; ++q) pr[h][q] = hmul2<false>(pr[h][q], f2);  // 1.0 where not needed
            }
            (void)two;
          }
          const uint32_t a0[4] = {pr[0][0], pr[1][0], pr[0][1], pr[1][1]};
          const uint32_t a1[4] = {pr[0][2], pr[1][2], pr[0][3], pr[1][3]};
#pragma unroll
          for (int j = 0; j < TOKT; ++j) {
            gemm::mma_16816<kF16>(acc[i][j], a0, b[j][0], b[j][1]);
            gemm::mma_16816<kF16>(acc[i][j], a1, b[j][2], b[j][3]);
          }
        }
      }
    }
  }

  // gemm_indexed_gated's epilogue (DecodeLaunch::gate_act): each output column's gate and up sums
  // added over the wk groups in the fixed order and biased as the plain epilogue does, rounded to
  // c's type as it would store them, then activated and rounded again: the values of the plain GEMM
  // with the same K split followed by the activation kernel, bit for bit (the halves pairing takes
  // at most 4 K groups, so where a plain call's plan takes 8 the sums' order differs). Inlined: as a call it made the packed int4
  // variants with zero points spill (12 / 28 bytes); inlined they hold none.
  static __device__ __forceinline__ void store_gated(const DecodeLaunch& D, int expert, int nvalid, const float* red,
                                                  const int32_t* s_crow, int tid) {
    const int bnp = D.bn + 8, half = D.bn >> 1, half_log2 = __ffs(half) - 1;
    const bool oai = D.gate_oai != 0, c_f16 = D.g.p.c_type == ElemType::kF16;
    const int64_t I = D.gate_I, N = D.N, col0 = static_cast<int64_t>(blockIdx.x) * half;
    const float* bias = D.g.p.w.bias;
    uint16_t* y = static_cast<uint16_t*>(D.gate_y);
    const Activation a = static_cast<Activation>(D.gate_act);
    for (int idx = tid; idx < (nvalid << half_log2); idx += kThreads) {
      const int tok = idx >> half_log2, j = idx & (half - 1);
      const int64_t col = col0 + j;
      if (col >= I) continue;
      const int lg = oai ? 2 * j : j, lu = oai ? 2 * j + 1 : half + j;        // the CTA's rows
      const int64_t pg = oai ? 2 * col : col, pu = oai ? 2 * col + 1 : I + col;  // the weight rows
      float g = 0.0f, u = 0.0f;
      for (int q = 0; q < D.wk; ++q) {  // fixed order: deterministic, as the plain epilogue
        g += red[(q * kMaxRows + tok) * bnp + lg];
        u += red[(q * kMaxRows + tok) * bnp + lu];
      }
      if (bias) {
        g += bias[static_cast<int64_t>(expert) * N + pg];
        u += bias[static_cast<int64_t>(expert) * N + pu];
      }
      const uint32_t gu = c_f16 ? gemm::pack2<true>(g, u) : gemm::pack2<false>(g, u);  // the stored GEMM values
      float v;
      if (c_f16) {
        v = activation_gated(a, half_to_float<ElemType::kF16>(gu & 0xffffu), half_to_float<ElemType::kF16>(gu >> 16),
                             D.gate_limit);
      } else {
        v = activation_gated(a, half_to_float<ElemType::kBF16>(gu & 0xffffu),
                             half_to_float<ElemType::kBF16>(gu >> 16), D.gate_limit);
      }
      const uint32_t out = c_f16 ? gemm::pack2<true>(v, 0.0f) : gemm::pack2<false>(v, 0.0f);
      y[static_cast<int64_t>(s_crow[tok]) * I + col] = static_cast<uint16_t>(out & 0xffffu);
    }
  }

  // ------------------------------------------------------------------------------------------
  // One work item over the CTA's N slice: the K pipeline, the fixed-order reduction over the wk
  // warp groups, bias and the rounded store of every valid row.
  // ------------------------------------------------------------------------------------------
  // kWhole (kPrePermute variants only, chosen by the caller): the item runs in whole mode with
  // pre-permuted activations; otherwise whole mode is decided here, with the activations as copied.
  // weights_issued: issue_first_weights copied the first stages' weights.
  template <int TOKT, bool kWhole>
  static __device__ void run(const DecodeLaunch& D, const Item& item, int64_t n0, uint8_t* smem,
                             const int32_t* s_arow, const int32_t* s_crow, const int64_t* s_abyte,
                             bool weights_issued) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wn = warp & (D.wn - 1), wk = warp >> (__ffs(D.wn) - 1);  // wn: a power of two
    const int g = lane >> 2, t = lane & 3;
    const float s2 = D.g.p.w.scale2 ? D.g.p.w.scale2[item.expert] : 1.0f;

    float acc[kNT][TOKT][4];
    float part[kQ8 ? kNT : 1][kQ8 ? TOKT : 1][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
      for (int j = 0; j < TOKT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

    Scales<TOKT> s0, s1, s2n;  // this iteration, the next, the one after
    load_scales<TOKT>(D, item, 0, wk, lane, s_arow, s0);
    load_scales<TOKT>(D, item, 1, wk, lane, s_arow, s1);
    // Whole mode (the item's activations fit over all of K): they join stage 0's copies, and
    // after stage 0 no CTA barrier is needed, as each lane reads back only the weight bytes it
    // copied itself. Otherwise each stage carries its K range of the activations for all warps.
    const bool whole = kWhole || item.nvalid <= D.whole_rows;
    const int arb = whole ? D.whole_row_bytes : D.act_row_bytes;
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < D.iters) issue(D, item, st, smem, s_abyte, wk, warp, lane, tid, whole, !weights_issued);
      if (st == 0 && whole && !kFusedQ) copy_whole_activations(D, item.nvalid, smem, s_abyte, tid);
      cp_async_commit();
    }
    // 16-bit token rows (D.xq): quantized while the first stages' weights are in flight (every
    // item is whole, host-checked); the first iteration's barrier publishes them.
    if constexpr (kFusedQ) quantize_whole_activations(D, item.nvalid, smem, s_arow, tid);

    for (int it = 0; it < D.iters; ++it) {
      cp_async_wait<kStages - 2>();
      // Staged: stage `it` visible to all, stage it - 1 free for the next copies. Whole: once,
      // for the activations.
      if (!whole || it == 0) __syncthreads();
      if constexpr (kPrePermute && kWhole) {
        if (it == 0) {
          permute_whole_activations(D, item.nvalid, smem, tid);
          __syncthreads();
        }
      }
      if (it + kStages - 1 < D.iters) issue(D, item, it + kStages - 1, smem, s_abyte, wk, warp, lane, tid, whole);
      cp_async_commit();
      load_scales<TOKT>(D, item, it + 2, wk, lane, s_arow, s2n);

      const int c = it * D.wk + wk;
      if (c < D.nc) {
        const int slot = it % kStages;
        const uint8_t* wsm = smem + slot * kWStageBytes + warp * kWarpStageBytes + lane * 16;
        uint32_t w[kNT][2][4];
#pragma unroll
        for (int i = 0; i < kNT; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) lds128(w[i][h], wsm + (i * 2 + h) * 512);
        const uint8_t* arow0 = smem + kStages * kWStageBytes +
                               (whole ? c * kKw * kAsz : slot * D.act_stage_bytes + wk * kKw * kAsz) + t * kEpc * kAsz;
        if constexpr (kQ8) {
#pragma unroll
          for (int i = 0; i < kNT; ++i)
#pragma unroll
            for (int j = 0; j < TOKT; ++j)
#pragma unroll
              for (int r = 0; r < 4; ++r) part[i][j][r] = 0.0f;
          chunk_mma<TOKT, false>(D, part, w, arow0, arb, g, item.nvalid, s0, s2);
          if constexpr (kFusedQ) {  // the token rows' scales of this chunk column, quantized above
            const float* sxs = reinterpret_cast<const float*>(smem + kStages * kWStageBytes + xq_scales_offset(D));
            const int grp = (c * kKw) >> 7, ng = D.K >> 7;
#pragma unroll
            for (int j = 0; j < TOKT; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) s0.a[j][e] = sxs[min(8 * j + 2 * t + e, item.nvalid - 1) * ng + grp];
          }
          // One scale pair per chunk column (the host checked that scale groups cover whole
          // chunk columns): acc += part * a_scale * (w_scale * scale2), as the generic kernel.
#pragma unroll
          for (int i = 0; i < kNT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float ws = scale_value(D, s0.w[i][h][0]);
              if (D.g.p.w.scale2) ws = ws * s2;
#pragma unroll
              for (int j = 0; j < TOKT; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) acc[i][j][2 * h + e] += part[i][j][2 * h + e] * s0.a[j][e] * ws;
            }
        } else if constexpr (DQ == Deq::kPackedFp4) {
          // One vote per iteration: e8m0 scales above 128 (weights beyond +-12) practically never
          // occur, and the common variant then carries no second multiply and no branch.
          bool two = false;
#pragma unroll
          for (int i = 0; i < kNT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) two |= s0.w[i][h][0] > 128u && s0.w[i][h][0] != 255u;
          if (__any_sync(0xffffffffu, two))
            chunk_mma<TOKT, kWhole, true>(D, acc, w, arow0, arb, g, item.nvalid, s0, s2);
          else
            chunk_mma<TOKT, kWhole, false>(D, acc, w, arow0, arb, g, item.nvalid, s0, s2);
        } else {
          chunk_mma<TOKT, kWhole>(D, acc, w, arow0, arb, g, item.nvalid, s0, s2);
        }
      }
      s0 = s1;
      s1 = s2n;
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring becomes the reduction buffer

    // Partial sums of each wk group: red[wk][token][n], rows padded by 8 floats (no bank conflicts).
    float* red = reinterpret_cast<float*>(smem);
    const int bnp = D.bn + 8;
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
      for (int j = 0; j < TOKT; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int tok = 8 * j + 2 * t + (r & 1);
          const int nl = wn * kRowsPerWarp + i * 16 + g + 8 * (r >> 1);
          if (tok < item.nvalid) red[(wk * kMaxRows + tok) * bnp + nl] = acc[i][j][r];
        }
    __syncthreads();
    if constexpr (kGatedEpilogue) {  // the raw and packed variants (the float32-scale ones would spill)
      if (D.gate_act >= 0) {
        store_gated(D, item.expert, item.nvalid, red, s_crow, tid);
        return;
      }
    }

    const int N = D.N;
    const bool c_f16 = D.g.p.c_type == ElemType::kF16;
    uint16_t* cout = static_cast<uint16_t*>(D.g.p.c);
    const float* bias = D.g.p.w.bias;
    const int half_log2 = __ffs(D.bn / 2) - 1;
    for (int idx = tid; idx < (item.nvalid << half_log2); idx += kThreads) {
      const int tok = idx >> half_log2, nl = (idx & ((1 << half_log2) - 1)) * 2;
      const int64_t n = n0 + nl;
      if (n >= N) continue;
      float v0 = 0.0f, v1 = 0.0f;
      for (int q = 0; q < D.wk; ++q) {  // fixed order: deterministic
        v0 += red[(q * kMaxRows + tok) * bnp + nl];
        v1 += red[(q * kMaxRows + tok) * bnp + nl + 1];
      }
      if (bias) {
        v0 += bias[static_cast<int64_t>(item.expert) * N + n];
        if (n + 1 < N) v1 += bias[static_cast<int64_t>(item.expert) * N + n + 1];
      }
      const uint32_t pr = c_f16 ? gemm::pack2<true>(v0, v1) : gemm::pack2<false>(v0, v1);
      const int64_t off = static_cast<int64_t>(s_crow[tok]) * N + n;
      if (n + 1 < N && (off & 1) == 0) {
        *reinterpret_cast<uint32_t*>(cout + off) = pr;
      } else {
        cout[off] = static_cast<uint16_t>(pr & 0xffffu);
        if (n + 1 < N) cout[off + 1] = static_cast<uint16_t>(pr >> 16);
      }
    }
  }
};

// Rows [lo, hi) of c over kWidth columns from n0 (0: the CTA's N slice, D.bn; clipped to N) become
// zeros, written by kN threads, this one the `first`-th (the decode kernel: all its threads; the
// ring kernel: a work unit's consumer threads). Both as template arguments: immediates, as the
// decode kernel's scheduling was tuned with.
template <int kN, int kWidth = 0>
__device__ __forceinline__ void zero_rows(const DecodeLaunch& D, int64_t lo, int64_t hi, int64_t n0, uint32_t first) {
  if (hi <= lo) return;
  uint16_t* cout = static_cast<uint16_t*>(D.g.p.c);
  const int64_t N = D.N;
  const int64_t n_end = min(N, n0 + (kWidth ? kWidth : D.bn));
  const int64_t cols = n_end - n0;
  for (int64_t idx = first; idx < (hi - lo) * cols; idx += kN) {
    const int64_t r = lo + idx / cols, n = n0 + idx % cols;
    cout[r * N + n] = 0;
  }
}

// Rows of work item `item` (run by one warp) for the fp8 ring kernel (gemm_decode_sm90_fp8_ring.cu):
// s_info = {expert (-1: none), valid rows, zero rows lo, hi}; s_arow / s_crow: each valid row's
// activation row and output row. Indexed: the block's distinct valid ids; grouped: 16-row tiles of
// each expert's rows, experts in order, then items of zero rows past the last expert; batched: one
// expert's first T rows, zeros past its count. decode_kernel keeps an inline copy of the same
// enumeration: calling this instead changed ptxas' register allocation of its 128-register
// variants (fp8 x fp8 4 -> 36 bytes of spills, the float32 modes 4 -> 8-12) and made fp8 up to
// 4.5% slower (benchmarks/NOTES.md, v11m).
__device__ __forceinline__ void find_item(const DecodeLaunch& D, int item, int lane, int32_t* s_arow,
                                          int32_t* s_crow, int* s_info) {
  const GemmLaunch& L = D.g;
  if (L.mode == RowMode::kIndexed) {
    const int expert = L.block_expert_ids[item];
    const bool eok = expert >= 0 && expert < L.E;  // never address weights with an invalid id
    bool valid = false;
    int64_t id = -1;
    if (eok && lane < L.block_m) {
      id = L.sorted_ids[static_cast<int64_t>(item) * L.block_m + lane];
      // ids below c_rows < 2^31 (host-checked) divide in 32 bits
      valid = id >= 0 && id < L.c_rows && D.div_gather.div(static_cast<uint32_t>(id)) < L.a_rows;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    const int slot = __popc(mask & ((1u << lane) - 1u));
    if (valid && slot < D.max_rows) {  // ids are distinct: a block holds at most max_rows
      s_arow[slot] = static_cast<int32_t>(D.div_gather.div(static_cast<uint32_t>(id)));
      s_crow[slot] = static_cast<int32_t>(id);
    }
    if (lane == 0) {
      s_info[0] = eok ? expert : -1;
      s_info[1] = eok ? min(__popc(mask), D.max_rows) : 0;
      s_info[2] = s_info[3] = 0;
    }
  } else if (L.mode == RowMode::kGrouped) {
    // Offsets clamped monotone into [0, R]; each expert's rows in items of 16, experts in
    // order (the generic kernel's enumeration with 16-row tiles).
    const int R = static_cast<int>(L.R);
    int found_e = -1, found_lo = 0, found_hi = 0, found_tile = 0;
    int done = 0, tbase = 0;
    for (int e0 = 0; e0 < L.E; e0 += 32) {
      const int e = e0 + lane;
      int v = e < L.E ? L.offsets[e + 1] : INT_MIN;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v = max(v, y);
      }
      const int hi = min(R, max(v, done));
      int lo = __shfl_up_sync(0xffffffffu, hi, 1);
      if (lane == 0) lo = done;
      const int tiles = e < L.E ? (hi - lo + D.item_rows - 1) / D.item_rows : 0;
      int incl = tiles;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      const int excl = incl - tiles;
      const bool mine = item < D.gemm_items && e < L.E && item >= tbase + excl && item < tbase + incl;
      const unsigned m = __ballot_sync(0xffffffffu, mine);
      if (m) {
        const int src = __ffs(m) - 1;
        found_e = __shfl_sync(0xffffffffu, e, src);
        found_lo = __shfl_sync(0xffffffffu, lo, src);
        found_hi = __shfl_sync(0xffffffffu, hi, src);
        found_tile = __shfl_sync(0xffffffffu, item - tbase - excl, src);
      }
      done = __shfl_sync(0xffffffffu, hi, 31);
      tbase += __shfl_sync(0xffffffffu, incl, 31);
    }
    int nvalid = 0;
    int64_t zl = 0, zh = 0;
    if (item < D.gemm_items) {
      if (found_e >= 0) {
        const int first = found_lo + found_tile * D.item_rows;
        nvalid = min(D.item_rows, found_hi - first);
        if (lane < nvalid) {
          s_arow[lane] = first + lane;
          s_crow[lane] = first + lane;
        }
      }
    } else {
      // Rows past the last expert's are written as zeros.
      zl = done + static_cast<int64_t>(item - D.gemm_items) * D.item_rows;
      zh = min(static_cast<int64_t>(R), zl + D.item_rows);
    }
    if (lane == 0) {
      s_info[0] = found_e;
      s_info[1] = nvalid;
      s_info[2] = static_cast<int>(zl);
      s_info[3] = static_cast<int>(zh);
    }
  } else {
    const int expert = item;  // T <= kItemRows (host-checked): one item per expert, rows from 0
    int64_t cnt = L.counts[expert];
    cnt = cnt < 0 ? 0 : (cnt > L.T ? L.T : cnt);
    const int64_t t_end = min(L.T, static_cast<int64_t>(kItemRows));
    const int nvalid = static_cast<int>(cnt < t_end ? cnt : t_end);
    if (lane < nvalid) {
      s_arow[lane] = static_cast<int32_t>(expert * L.T + lane);
      s_crow[lane] = s_arow[lane];
    }
    if (lane == 0) {
      s_info[0] = expert;
      s_info[1] = nvalid;
      // Rows past the count are written as zeros.
      s_info[2] = static_cast<int>(expert * L.T + cnt);
      s_info[3] = static_cast<int>(expert * L.T + t_end);
    }
  }
}

// Indexed layout: the rows its blocks hold (blocks are used in order), clamped to the padded rows.
__device__ __forceinline__ int64_t indexed_used_rows(const GemmLaunch& L) {
  const int64_t used = *L.ntpp;
  return used < 0 ? 0 : (used > L.padded_rows ? L.padded_rows : used);
}

template <WeightType WT, ActKind AK, Deq DQ, bool SF, bool ZP, bool FQ>
__global__ void __launch_bounds__(kThreads, 2) decode_kernel(const __grid_constant__ DecodeLaunch D) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using K_ = Kern<WT, AK, DQ, SF, ZP, FQ>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int32_t s_arow[kMaxRows], s_crow[kMaxRows];
  __shared__ int64_t s_abyte[kMaxRows];  // byte offset of each row of a
  __shared__ int s_info[6];  // expert, nvalid, zero rows lo, hi (grouped scan: expert, lo, hi, tile)
  static_assert(sizeof(s_arow) + sizeof(s_crow) + sizeof(s_abyte) + sizeof(s_info) + 128 <= kStaticSmemReserve,
                "static shared memory exceeds the reserve subtracted from kMaxDynamicSmem");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * D.bn;
  const GemmLaunch& L = D.g;
  // launch_variant launches it dependent on the kernel before it. Where only `a` waits on that
  // kernel (GemmLaunch::inputs_ready_but_a), the first item's routing and first weights go out
  // before the wait, overlapping that kernel's tail.
  const bool wait_late = L.inputs_ready_but_a;
  if (!wait_late) begin_dependent_grid();

  for (int item = blockIdx.y; item < D.items; item += gridDim.y) {
    int64_t zlo = 0, zhi = 0;
    typename K_::Item it_;
    bool early = false;  // the first stages' weights are in flight (issue_first_weights)
    if (L.mode == RowMode::kIndexed) {
      // The used-block count, the block's expert and (warp 0) its ids are independent loads, in
      // bounds for every item (items = len(block_expert_ids), sorted_ids = block_m per block):
      // issued together, and the first stages' weights go out before the ids are placed.
      int64_t used = *L.ntpp;
      const int expert = L.block_expert_ids[item];
      int64_t id = -1;
      if (warp == 0 && lane < L.block_m) id = L.sorted_ids[static_cast<int64_t>(item) * L.block_m + lane];
      used = used < 0 ? 0 : (used > L.padded_rows ? L.padded_rows : used);
      if (static_cast<int64_t>(item) * L.block_m >= used) break;  // blocks are used in order
      const bool eok = expert >= 0 && expert < L.E;  // never address weights with an invalid id
      // The raw and packed variants (the float32-scale and 8-bit-code ones would spill more).
      if (K_::kEarlyWeights && eok) {
        K_::setup_rows(D, it_, expert, n0, warp, lane);
        K_::issue_first_weights(D, it_, smem, warp, lane);
        early = true;
      }
      if (warp == 0) {
        bool valid = false;
        if (eok && lane < L.block_m) {
          // ids below c_rows < 2^31 (host-checked) divide in 32 bits
          valid = id >= 0 && id < L.c_rows && D.div_gather.div(static_cast<uint32_t>(id)) < L.a_rows;
        }
        const unsigned mask = __ballot_sync(0xffffffffu, valid);
        const int slot = __popc(mask & ((1u << lane) - 1u));
        if (valid && slot < D.max_rows) {  // ids are distinct: a block holds at most max_rows
          s_arow[slot] = static_cast<int32_t>(D.div_gather.div(static_cast<uint32_t>(id)));
          s_crow[slot] = static_cast<int32_t>(id);
        }
        if (lane == 0) {
          s_info[0] = eok ? expert : -1;
          s_info[1] = eok ? min(__popc(mask), D.max_rows) : 0;
        }
      }
    } else if (L.mode == RowMode::kGrouped) {
      if (warp == 0) {
        // Offsets clamped monotone into [0, R]; each expert's rows in items of 16, experts in
        // order (the generic kernel's enumeration with 16-row tiles).
        const int R = static_cast<int>(L.R);
        int found_e = -1, found_lo = 0, found_hi = 0, found_tile = 0;
        int done = 0, tbase = 0;
        for (int e0 = 0; e0 < L.E; e0 += 32) {
          const int e = e0 + lane;
          int v = e < L.E ? L.offsets[e + 1] : INT_MIN;
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v = max(v, y);
          }
          const int hi = min(R, max(v, done));
          int lo = __shfl_up_sync(0xffffffffu, hi, 1);
          if (lane == 0) lo = done;
          const int tiles = e < L.E ? (hi - lo + D.item_rows - 1) / D.item_rows : 0;
          int incl = tiles;
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
          }
          const int excl = incl - tiles;
          const bool mine = item < D.gemm_items && e < L.E && item >= tbase + excl && item < tbase + incl;
          const unsigned m = __ballot_sync(0xffffffffu, mine);
          if (m) {
            const int src = __ffs(m) - 1;
            found_e = __shfl_sync(0xffffffffu, e, src);
            found_lo = __shfl_sync(0xffffffffu, lo, src);
            found_hi = __shfl_sync(0xffffffffu, hi, src);
            found_tile = __shfl_sync(0xffffffffu, item - tbase - excl, src);
          }
          done = __shfl_sync(0xffffffffu, hi, 31);
          tbase += __shfl_sync(0xffffffffu, incl, 31);
        }
        int nvalid = 0;
        int64_t zl = 0, zh = 0;
        if (item < D.gemm_items) {
          if (found_e >= 0) {
            const int first = found_lo + found_tile * D.item_rows;
            nvalid = min(D.item_rows, found_hi - first);
            if (lane < nvalid) {
              s_arow[lane] = first + lane;
              s_crow[lane] = first + lane;
            }
          }
        } else {
          // Rows past the last expert's are written as zeros.
          zl = done + static_cast<int64_t>(item - D.gemm_items) * D.item_rows;
          zh = min(static_cast<int64_t>(R), zl + D.item_rows);
        }
        if (lane == 0) {
          s_info[0] = found_e;
          s_info[1] = nvalid;
          s_info[2] = static_cast<int>(zl);
          s_info[3] = static_cast<int>(zh);
        }
      }
    } else {
      if (warp == 0) {
        const int expert = item;  // T <= kItemRows (host-checked): one item per expert
        const int64_t t0 = 0;
        int64_t cnt = L.counts[expert];
        cnt = cnt < 0 ? 0 : (cnt > L.T ? L.T : cnt);
        const int64_t t_end = min(L.T, t0 + kItemRows);
        const int64_t hi_valid = cnt < t_end ? cnt : t_end;
        const int nvalid = hi_valid > t0 ? static_cast<int>(hi_valid - t0) : 0;
        if (lane < nvalid) {
          s_arow[lane] = static_cast<int32_t>(expert * L.T + t0 + lane);
          s_crow[lane] = s_arow[lane];
        }
        if (lane == 0) {
          s_info[0] = expert;
          s_info[1] = nvalid;
          // Rows past the count are written as zeros.
          s_info[2] = static_cast<int>(expert * L.T + max(cnt, t0));
          s_info[3] = static_cast<int>(expert * L.T + t_end);
        }
      }
    }
    if (wait_late) begin_dependent_grid();  // before any read of a (at once after the first item)
    __syncthreads();
    const int expert = s_info[0], nvalid = s_info[1];
    if (L.mode != RowMode::kIndexed) {
      zlo = s_info[2];
      zhi = s_info[3];
    }

    if (expert >= 0 && nvalid > 0) {
      if (tid < nvalid) s_abyte[tid] = static_cast<int64_t>(s_arow[tid]) * D.K * K_::kAsz;
      __syncthreads();
      if (!early) K_::setup_rows(D, it_, expert, n0, warp, lane);
      it_.nvalid = nvalid;
      // Token columns in tiles of 8: 1, 2 or (32-row items only) 4 of them.
      auto run_tiles = [&](auto tokt) {
        constexpr int T = decltype(tokt)::value;
        if (K_::kPrePermute && D.pre_permute && nvalid <= D.whole_rows)
          K_::template run<T, true>(D, it_, n0, smem, s_arow, s_crow, s_abyte, early);
        else
          K_::template run<T, false>(D, it_, n0, smem, s_arow, s_crow, s_abyte, early);
      };
      if (nvalid <= 8)
        run_tiles(std::integral_constant<int, 1>{});
      else if (nvalid <= 16)
        run_tiles(std::integral_constant<int, 2>{});
      else if constexpr (K_::kWideItems)
        run_tiles(std::integral_constant<int, 4>{});
    } else if (early) {  // no valid rows after all: the early copies land before the ring is reused
      cp_async_commit();
      cp_async_wait<0>();
    }
    zero_rows<kThreads>(D, zlo, zhi, n0, threadIdx.x);
    __syncthreads();  // shared memory is reused by the next item
  }
#else
  __trap();  // sm_90 only: the host dispatches this kernel on compute capability 9.x
#endif
}

// The fp8 x fp8 persistent ring kernel (gemm_decode_sm90_fp8_ring.cu): whether it takes a planned
// launch (fp8 codes on both sides, scale groups of whole 128 k or spanning K), and its launch
// (the weight rows of its work units, 128 or 256; 0: not launched, the caller keeps the planned
// kernel).
bool fp8_ring_applies(const DecodeLaunch& D);
int fp8_ring_units(const DecodeLaunch& D, int64_t items);  // work units of `items` items in 256-row slices
int launch_fp8_ring(const DecodeLaunch& D, int sms, cudaStream_t stream);

// Per weight family (gemm_decode_sm90_<family>.cu): launches the kernel variant for the
// activation kind and dequantization mode; false when the family has no such variant.
template <WeightType WT>
bool launch_family(const DecodeLaunch& D, ActKind ak, Deq dq, bool f32_scales, dim3 grid, size_t smem,
                   cudaStream_t stream);
template <>
bool launch_family<WeightType::kFloat>(const DecodeLaunch&, ActKind, Deq, bool, dim3, size_t, cudaStream_t);
template <>
bool launch_family<WeightType::kUInt4>(const DecodeLaunch&, ActKind, Deq, bool, dim3, size_t, cudaStream_t);
template <>
bool launch_family<WeightType::kInt8>(const DecodeLaunch&, ActKind, Deq, bool, dim3, size_t, cudaStream_t);
template <>
bool launch_family<WeightType::kFp8E4M3>(const DecodeLaunch&, ActKind, Deq, bool, dim3, size_t, cudaStream_t);
template <>
bool launch_family<WeightType::kFp4E2M1>(const DecodeLaunch&, ActKind, Deq, bool, dim3, size_t, cudaStream_t);

// Raises `kernel`'s dynamic shared-memory limit to `bytes` (and, with max_carveout, prefers the
// largest shared-memory carveout) once per device: a launch above 48 KB needs it, and it is a
// per-context attribute. `configured`: the caller's static record, bit d for device d (a benign
// race: the calls are idempotent). False when it fails, the error left in cudaGetLastError.
template <typename Kernel>
bool raise_smem_limit_once(Kernel kernel, int bytes, bool max_carveout, unsigned& configured) {
  int dev = 0;
  cudaGetDevice(&dev);
  const unsigned bit = dev < 32 ? (1u << dev) : 0u;
  if ((configured & bit) && bit) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) return false;
  if (max_carveout)
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  configured |= bit;
  return true;
}

template <WeightType WT, ActKind AK, Deq DQ, bool SF = false, bool ZP = true, bool FQ = false>
bool launch_variant(const DecodeLaunch& D, dim3 grid, size_t smem, cudaStream_t stream) {
  auto kernel = decode_kernel<WT, AK, DQ, SF, ZP, FQ>;
  static unsigned configured = 0;
  // A failure stays in cudaGetLastError, which the caller's launch check reports; no launch then.
  if (!raise_smem_limit_once(kernel, kMaxDynamicSmem, true, configured)) return true;
  launch_dependent(kernel, grid, dim3(kThreads), smem, stream, D);
  return true;
}

}  // namespace decode
}  // namespace hj
