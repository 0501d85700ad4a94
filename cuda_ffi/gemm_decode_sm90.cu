// Host side of the decode GEMM: decides, from shapes and attributes only (never device data),
// whether a GEMM call is a decode problem the weight-streaming kernel supports, sizes its grid and
// launches it. The kernels are in gemm_decode_sm90.cuh, instantiated per weight family in
// gemm_decode_sm90_<family>.cu.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "gemm_decode_sm90.cuh"

namespace hj {
namespace decode {
namespace {

std::atomic<uint64_t> g_launches{0};
std::atomic<uint64_t> g_ring_launches{0};  // of which the fp8 ring kernel
std::atomic<uint64_t> g_quant_launches{0};  // of which the decode kernel quantizing its token rows
std::atomic<uint64_t> g_gated_launches{0};  // of which the decode kernel activating its output pairs

// sm_90: shared memory per SM, and what the system keeps per resident CTA.
constexpr int64_t kSmemPerSm = 228 * 1024;
// Grouped calls with quantized weights and 16-bit activations: the most rows per expert (on
// average) the decode kernel takes by default (quant_decode_rows_per_expert), for 8-bit codes and
// for 4-bit ones. The dequantizing prefill path, tried first, takes calls from the same number
// (DEQUANT_MIN_ROWS_PER_EXPERT / DEQUANT_MIN_ROWS_PER_EXPERT_4BIT in humming_jax/ops/gemm.py). The
// decode kernel streams the codes once per 32-row item; dequantizing reads them once but writes
// and reads 2-byte weights. At 32-63 rows per expert the decode kernel ran 2.7x faster on the H200
// (benchmarks/NOTES.md, v4); with MXFP4 codes 1.49x faster at 64 rows per expert (qwen3), 1.09x
// slower at 128 (gpt-oss) and even at 256 (deepseek, mixtral), v9.
constexpr int64_t kMaxRowsPerExpertQuantGrouped = 64;
constexpr int64_t kMaxRowsPerExpertQuant4Grouped = 128;
constexpr int64_t kSmemReservedPerCta = 1024 + kStaticSmemReserve;  // + the kernel's static shared memory

// Resident CTAs per SM for `smem` bytes of dynamic shared memory each (at most two: the kernel's
// launch bounds).
int64_t ctas_per_sm(int64_t smem) { return std::min<int64_t>(2, kSmemPerSm / (smem + kSmemReservedPerCta)); }

// Compute capability and SM count of the current device (host queries, allowed under capture).
bool device_info(int* major, int* minor, int* sms) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return false;
  return true;
}

// Expected number of distinct experts hit by `draws` uniform picks among E.
int64_t expected_distinct(int64_t E, int64_t draws) {
  if (E <= 0 || draws <= 0) return 0;
  const double d = static_cast<double>(E) * (1.0 - std::pow(1.0 - 1.0 / static_cast<double>(E), static_cast<double>(draws)));
  return static_cast<int64_t>(std::ceil(d));
}

const char* mode_name(RowMode m) {
  return m == RowMode::kIndexed ? "indexed" : (m == RowMode::kGrouped ? "grouped" : "batched");
}

bool decline(const GemmLaunch& L, const char* why) {
  if (env_flag("HUMMING_JAX_DECODE_LOG", false))
    std::fprintf(stderr, "humming_jax decode: %s N=%lld K=%lld -> generic kernel (%s)\n", mode_name(L.mode),
                 static_cast<long long>(L.p.N), static_cast<long long>(L.p.K), why);
  return false;
}

struct Plan {
  DecodeLaunch D;
  ActKind ak;
  Deq dq;
  bool f32_scales;  // float32 and codes modes: the weight scales are float32
  dim3 grid;
  size_t smem;
};

// max_wk: the most K groups a CTA may split into (gemm_indexed_gated's halves pairing needs two
// warps along N, so at most kWarps / 2).
bool plan(const GemmLaunch& L, int sms, Plan* out, int max_wk = kWarps) {
  const GemmProblem& p = L.p;
  const WeightView& w = p.w;
  DecodeLaunch& D = out->D;
  D = DecodeLaunch{};
  D.g = L;
  D.gate_act = -1;
  const int64_t K = p.K, N = p.N, E = L.E;
  if (K <= 0 || N <= 0 || E <= 0) return decline(L, "empty problem");
  if (K >= (int64_t{1} << 30) || N >= (int64_t{1} << 30)) return decline(L, "K or N too large");
  D.K = static_cast<int>(K);
  D.N = static_cast<int>(N);

  // Activation kind and the weight family's chunk geometry.
  ActKind ak;
  switch (p.a.type) {
    case ElemType::kBF16: ak = ActKind::kBF16; break;
    case ElemType::kF16: ak = ActKind::kF16; break;
    case ElemType::kE4M3: ak = ActKind::kFp8; break;
    case ElemType::kI8: ak = ActKind::kI8; break;
    default: return decline(L, "activation type");
  }
  const bool q8 = ak == ActKind::kFp8 || ak == ActKind::kI8;
  const bool four = w.type == WeightType::kUInt4 || w.type == WeightType::kFp4E2M1;
  const int epc = w.type == WeightType::kFloat ? 8 : (four ? 32 : 16);  // k per lane chunk
  const int kw = 4 * epc;                                               // k per chunk column
  const int asz = q8 ? 1 : 2;
  const int64_t row_bytes = w.type == WeightType::kFloat ? 2 * K : (four ? K / 2 : K);

  // Rows: the work items and how many of them are expected to do work.
  int64_t est = 0, grid_items = 0, rows_total = 0;
  D.item_rows = kItemRows;
  switch (L.mode) {
    case RowMode::kIndexed: {
      if (L.block_m > kItemRows) return decline(L, "block_m > 16 (prefill-sized blocks)");
      if (L.a_rows >= INT32_MAX || L.c_rows >= INT32_MAX) return decline(L, "too many rows");
      if (L.gather_div < 1 || L.gather_div > (int64_t{1} << 30)) return decline(L, "gather_div out of range");
      const int64_t blocks = L.padded_rows / L.block_m;
      // Used blocks are a prefix; an expert with n rows uses ceil(n / block_m) of them.
      const int64_t bound = std::min(blocks, L.c_rows / L.block_m + std::min(E, L.c_rows));
      if (blocks == 0 || bound == 0) return decline(L, "no blocks");
      if (blocks > INT32_MAX) return decline(L, "too many blocks");
      D.items = static_cast<int>(blocks);
      grid_items = bound;
      // A block holds at most block_m ids, all distinct and below c_rows.
      D.max_rows = static_cast<int>(std::min(L.block_m, L.c_rows));
      est = std::max<int64_t>(1, std::min(bound, expected_distinct(E, L.c_rows)));
      rows_total = L.c_rows;
      break;
    }
    case RowMode::kGrouped: {
      const int64_t R = L.R;
      if (R <= 0) return decline(L, "no rows");
      // Quantized weights with 16-bit activations may take several items per expert on average
      // (kMaxRowsPerExpertQuantGrouped): every item dequantizes the expert's codes again, which
      // still beats dequantizing every expert for the prefill kernel at these sizes. Above 16 rows
      // per expert on average the items hold 32 rows, halving that work (below, 16-row items keep
      // the activation stages, sized by the item, small). HUMMING_JAX_DECODE_ITEM_ROWS=16 keeps
      // 16-row items (A/B timing).
      const bool codes16 = w.type != WeightType::kFloat && !p.a.quantized();
      const char* rows_env = std::getenv("HUMMING_JAX_DECODE_ITEM_ROWS");
      const bool wide_ok = !(rows_env && std::atoi(rows_env) == kItemRows);
      D.item_rows = codes16 && wide_ok && R > kItemRows * E ? kMaxRows : kItemRows;
      const int64_t max_per_expert = codes16 ? quant_decode_rows_per_expert(w.type) : kItemRows;
      if (R > max_per_expert * E)
        return decline(L, "more rows per expert on average than the decode kernel takes");
      const int64_t tiles = (R + D.item_rows - 1) / D.item_rows;
      const int64_t gemm_items = tiles + std::min(E, R);
      if (gemm_items + tiles > INT32_MAX) return decline(L, "too many rows");
      D.gemm_items = static_cast<int>(gemm_items);
      D.items = static_cast<int>(gemm_items + tiles);
      grid_items = D.items;
      D.max_rows = static_cast<int>(std::min<int64_t>(D.item_rows, R));
      est = std::max<int64_t>(1, expected_distinct(E, R));
      rows_total = R;
      break;
    }
    default: {
      if (L.T <= 0 || L.T > kItemRows) return decline(L, "T > 16 rows per expert");
      if (E * L.T >= INT32_MAX) return decline(L, "too many rows");
      D.items = static_cast<int>(E);
      grid_items = E;
      D.max_rows = static_cast<int>(L.T);
      est = E;
      rows_total = E * L.T;
      break;
    }
  }

  // 16-byte copies: aligned bases and rows.
  if (!aligned_to(w.data, 16) || row_bytes % 16) return decline(L, "weight rows not 16-byte aligned");
  if (row_bytes >= (int64_t{1} << 26)) return decline(L, "weight rows of 64 MB or more");  // 32-bit row offsets
  if (!aligned_to(p.a.data, 16) || (K * asz) % 16) return decline(L, "activation rows not 16-byte aligned");
  D.w_row_bytes = static_cast<int>(row_bytes);

  // Dequantization mode and the scale groups it can follow.
  const int64_t gk = w.group_k;
  auto covers = [&](int64_t group, int64_t span) { return group >= K || group % span == 0; };
  Deq dq;
  D.nslot = 1;
  if (w.type == WeightType::kFloat) {
    dq = Deq::kRaw;
  } else if (q8) {
    // One (a_scale, w_scale) pair per chunk column of K.
    if (!covers(gk, kw) || !covers(p.a.group_k, kw))
      return decline(L, "8-bit activations need weight and activation scale groups that are multiples of the "
                        "chunk column (64 k for 8-bit weights, 128 k for 4-bit) or span K");
    dq = Deq::kCodes;
  } else {
    const bool act_scale = w.scale_type == p.a.type;  // a 16-bit scale of the activation type
    if (w.type == WeightType::kUInt4 && act_scale && !w.scale2 && covers(gk, epc))
      dq = Deq::kPackedU4;
    else if (w.type == WeightType::kFp4E2M1 && w.scale_type == ElemType::kE8M0 && ak == ActKind::kBF16 &&
             !w.scale2 && covers(gk, epc))
      dq = Deq::kPackedFp4;
    else if (covers(gk, epc))
      dq = Deq::kF32;
    else if (covers(gk, epc / 2)) {
      // One zero point per row and lane chunk is loaded; two groups per chunk would need two.
      if (w.type == WeightType::kUInt4 && w.zero)
        return decline(L, "int4 zero points with scale groups of half a lane chunk (16 k)");
      dq = Deq::kF32;
      D.nslot = 2;
    } else {
      return decline(L, "weight scale groups narrower than half a lane chunk");
    }
  }
  D.div_gk = make_fastdiv(static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(gk, 1), int64_t{1} << 30)));
  D.div_agk = make_fastdiv(
      static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(p.a.group_k, 1), int64_t{1} << 30)));

  // Warps along K (wk) against warps along N: more CTAs (large wk) let more SMs stream at once and
  // even out items of unequal cost, a wider CTA (small wk) shares each activation load among more
  // rows, has fewer CTA start-ups and keeps the activation stage small enough for two CTAs per SM.
  // Each wk's estimated time: rounds of CTAs times what one CTA costs, its bn weight rows' bytes
  // plus kCtaFixedBytes for its start-up and pipeline fill (the item's activation rows, read by
  // all of its CTAs, mostly come from L2 and are left out); never more K groups than chunk columns.
  // A round is the larger of two bounds: the waves of resident CTAs (ceil(CTAs / slots)), and the
  // busiest SM's CTAs (ceil(CTAs / SMs)) at kPairCost tenths of a CTA each, as two CTAs sharing an
  // SM take ~1.2x one CTA's time. Of the wk within kNearTie of the least estimate, the largest that
  // leaves each K group at least kMinIters chunk columns (else the least estimate's, the smallest
  // wk among equals): a finer split measured faster wherever the estimates come that close.
  // Fitted on per-GEMM timings of every wk (benchmarks/NOTES.md, v39: 66 GEMMs on an H100 and
  // 2 x 72 on an H200, 0.4 / 0.8 / 0.5% above the per-GEMM best in total against 2.0 / 2.3 / 1.4%
  // for the v11k rule, which counted the activation rows and took the least estimate:
  // HUMMING_JAX_DECODE_PLAN=bytes keeps it, =resident the rule before it, the most resident CTAs,
  // for A/B timing).
  D.nc = static_cast<int>((K + kw - 1) / kw);
  D.div_upr = make_fastdiv(static_cast<uint32_t>(D.nc * kw * asz / 16));
  D.div_gn = make_fastdiv(std::min<uint32_t>(std::max<uint32_t>(L.group_n, 1u), 1u << 30));  // n < 2^30
  D.div_gather = make_fastdiv(L.mode == RowMode::kIndexed ? static_cast<uint32_t>(L.gather_div) : 1u);
  const int lane_bytes = epc * asz;  // activation bytes a lane reads per token and chunk column
  // Activation rows of `base` bytes padded so that the lanes of a quarter warp read distinct banks
  // (the staged rows of one stage and the whole-K rows alike).
  auto padded_row = [&](int base) {
    const int want = lane_bytes == 16 ? 64 : 16;
    return base + ((want - base % 128) + 128) % 128;
  };
  auto act_row_bytes = [&](int wk) { return padded_row(wk * kw * asz); };
  auto smem_for = [&](int wk) {
    return static_cast<int64_t>(kStages) * (kWStageBytes + int64_t{D.max_rows} * act_row_bytes(wk));
  };
  constexpr int64_t kCtaFixedBytes = 32 << 10;
  constexpr int64_t kPairCost = 6;   // tenths of a CTA's time per CTA on an SM running two
  constexpr double kNearTie = 0.05;  // estimates this close to the least count as equal
  constexpr int kMinIters = 16;      // chunk columns per K group below which a finer split is not taken
  const char* plan_env = std::getenv("HUMMING_JAX_DECODE_PLAN");
  const std::string plan_rule = plan_env ? plan_env : "";
  const bool by_resident = plan_rule == "resident", by_bytes = plan_rule == "bytes";
  const int64_t item_act_bytes =
      by_bytes ? std::min<int64_t>(D.max_rows, (rows_total + est - 1) / est) * K * asz : 0;
  double scores[4];  // by log2(wk); double: no overflow
  int n_cands = 0, least = 0;  // least: the first (smallest wk) among the lowest scores
  for (int c = 1; c <= max_wk && c <= 8 && (c == 1 || c <= D.nc); c *= 2) {
    const int64_t sm = smem_for(c);
    if (sm > kMaxDynamicSmem) break;
    const int64_t per_sm = ctas_per_sm(sm);
    const int64_t bn = kWarps / c * kRowsPerWarp;
    const int64_t ctas = est * ((N + bn - 1) / bn), slots = std::max<int64_t>(1, per_sm * sms);
    const int64_t tenths = std::max(10 * ((ctas + slots - 1) / slots), kPairCost * ((ctas + sms - 1) / sms));
    const double score = by_resident ? -static_cast<double>(std::min(ctas, slots))  // resident CTAs
                                     : static_cast<double>(tenths) *
                                           static_cast<double>(bn * row_bytes + item_act_bytes + kCtaFixedBytes);
    scores[n_cands] = score;
    if (n_cands == 0 || score < scores[least]) least = n_cands;
    ++n_cands;
  }
  int wk = 1 << least;
  if (!by_resident && !by_bytes) {
    for (int i = n_cands - 1; i > least; --i) {
      if (scores[i] <= scores[least] * (1.0 + kNearTie) && (D.nc + (1 << i) - 1) >> i >= kMinIters) {
        wk = 1 << i;
        break;
      }
    }
  }
  // HUMMING_JAX_DECODE_WK=1|2|4|8 forces the K split where it fits (for tuning measurements).
  if (const char* v = std::getenv("HUMMING_JAX_DECODE_WK"); v && *v) {
    const int c = std::atoi(v);
    if ((c == 1 || c == 2 || c == 4 || c == 8) && c <= max_wk && (c == 1 || c <= D.nc) &&
        smem_for(c) <= kMaxDynamicSmem)
      wk = c;
  }
  D.est_items = static_cast<int>(std::min<int64_t>(est, INT32_MAX));
  D.wk = wk;
  D.wn = kWarps / wk;
  D.bn = D.wn * kRowsPerWarp;
  D.iters = (D.nc + wk - 1) / wk;
  D.act_row_bytes = act_row_bytes(wk);
  D.act_stage_bytes = D.max_rows * D.act_row_bytes;
  D.act_region_bytes = kStages * D.act_stage_bytes;
  // Whole mode: items whose activation rows fit over all of K keep them for the whole pipeline
  // (no CTA barrier per stage). The region may grow up to what still leaves two CTAs per SM.
  // HUMMING_JAX_DECODE_WHOLE_ACT=0 turns it off (A/B timing).
  D.whole_row_bytes = 0;
  D.whole_rows = 0;
  if (env_flag("HUMMING_JAX_DECODE_WHOLE_ACT", true)) {
    const int64_t whole_row = padded_row(D.nc * kw * asz);
    const int64_t cap = kSmemPerSm / 2 - kSmemReservedPerCta - int64_t{kStages} * kWStageBytes;
    const int64_t region = std::max<int64_t>(D.act_region_bytes, std::min<int64_t>(cap, whole_row * D.max_rows));
    const int64_t rows = std::min<int64_t>(D.max_rows, region / whole_row);
    if (rows >= 1) {
      D.whole_row_bytes = static_cast<int>(whole_row);
      D.whole_rows = static_cast<int>(rows);
      D.act_region_bytes = static_cast<int>(std::max<int64_t>(D.act_region_bytes, rows * whole_row));
    }
  }

  // HUMMING_JAX_DECODE_PRE_PERMUTE=0 keeps the per-MMA-step permutation of whole-mode activations
  // in the 4-bit packed variants (A/B timing).
  D.pre_permute = env_flag("HUMMING_JAX_DECODE_PRE_PERMUTE", true) ? 1 : 0;

  D.x_rows = D.bn;  // the CTA's rows (gemm_indexed_gated's halves pairing sets them again)
  D.up_warp = D.wn;
  D.up_skip = 0;
  const int64_t n_slices = (N + D.bn - 1) / D.bn;
  if (n_slices > INT32_MAX) return decline(L, "N too large");
  out->ak = ak;
  out->dq = dq;
  out->f32_scales = (dq == Deq::kF32 || dq == Deq::kCodes) && w.scale_type == ElemType::kF32;
  out->smem = decode_smem_bytes(D);
  if (out->smem > static_cast<size_t>(kMaxDynamicSmem)) return decline(L, "shared memory");
  // HUMMING_JAX_DECODE_GRID_ITEMS=n (n >= 1; for A/B timing): at most n item rows in the grid, each
  // CTA running items y, y + n, ... in turn (fewer waves and CTA launches, a longer stream per CTA).
  int64_t grid_rows = std::min<int64_t>(grid_items, 65535);
  if (const char* v = std::getenv("HUMMING_JAX_DECODE_GRID_ITEMS"); v && *v) {
    const int cap = std::atoi(v);
    if (cap >= 1) grid_rows = std::min<int64_t>(grid_rows, cap);
  }
  out->grid = dim3(static_cast<unsigned>(n_slices), static_cast<unsigned>(grid_rows));
  return true;
}

const char* deq_name(Deq d) {
  switch (d) {
    case Deq::kRaw: return "raw";
    case Deq::kPackedU4: return "packed-u4";
    case Deq::kPackedFp4: return "packed-fp4";
    case Deq::kF32: return "f32";
    default: return "codes";
  }
}

}  // namespace

int64_t quant_decode_rows_per_expert(WeightType t) {
  const int64_t base = t == WeightType::kUInt4 || t == WeightType::kFp4E2M1 ? kMaxRowsPerExpertQuant4Grouped
                                                                               : kMaxRowsPerExpertQuantGrouped;
  const char* v = std::getenv("HUMMING_JAX_QUANT_DECODE_ROWS");
  const int64_t r = v && *v ? std::atoll(v) : 0;
  return r > 0 ? r : base;
}

namespace {

// The rows an item is expected to hold (the planner's estimate of items with rows).
int64_t expected_item_rows(const GemmLaunch& L, const DecodeLaunch& D) {
  return (L.c_rows + D.est_items - 1) / std::max(1, D.est_items);
}

// Whether the decode kernel can quantize qin's rows (after silu, where qin asks for it) as it
// takes the call: the fp8 x fp8 variant, fp8 e4m3 codes in 128-k groups of 16-bit rows, 16-byte
// aligned, every item's rows held whole (whole_rows covers the most rows an item has), shared
// memory for their scales, and few enough 128-k groups per item (kMaxQuantPasses).
constexpr int kMaxQuantPasses = 2;

bool quantizes_whole(const GemmLaunch& L, const Plan& pl, const InputQuant& qin) {
  const DecodeLaunch& D = pl.D;
  if (L.mode != RowMode::kIndexed || L.p.w.type != WeightType::kFp8E4M3 || pl.ak != ActKind::kFp8 ||
      pl.dq != Deq::kCodes)
    return false;
  if (qin.kind != ActQuant::kFp8E4M3 || qin.group_k != 128 || qin.K != D.K || D.K % 128 != 0 ||
      (qin.xt != ElemType::kBF16 && qin.xt != ElemType::kF16) || !aligned_to(qin.x, 16) || qin.N1 % 8 != 0)
    return false;
  // One activation, silu, the gated one of the fp8 models (their code is fetched on the path to the
  // first MMA: the kernel holds one; benchmarks/NOTES.md v11s).
  if (qin.act >= 0 && qin.act != static_cast<int>(Activation::kSilu)) return false;
  if (D.whole_rows <= 0 || D.whole_rows < D.max_rows) return false;
  // The quantization runs before the item's first MMA, one 128-k group of a row per half warp and
  // pass, each pass waiting on its loads: more than kMaxQuantPasses passes for the expected rows
  // of an item outlast the first weight stages (benchmarks/NOTES.md v11s: mixtral GEMM2, K = 14336,
  // 7 passes, 1.5x slower than the quantization kernel first).
  if (expected_item_rows(L, D) * (D.K / 128) > int64_t{kMaxQuantPasses} * (kThreads / 16)) return false;
  return static_cast<int64_t>(kStages) * kWStageBytes + xq_region_bytes(D) <= kMaxDynamicSmem;
}

}  // namespace

Error launch_decode(const std::string& call, const GemmLaunch& L, cudaStream_t stream, bool* launched,
                    const InputQuant* qin, const GatedOut* gate, bool* gated) {
  *launched = false;
  if (gated) *gated = false;
  if (!env_flag("HUMMING_JAX_DECODE", true)) return Error::Success();
  int major = 0, minor = 0, sms = 0;
  if (!device_info(&major, &minor, &sms) || major != 9 || minor != 0) {
    decline(L, "not a compute capability 9.0 device");
    return Error::Success();
  }
  // gemm_indexed_gated: the epilogue pairs the rows (indexed layout, an even N; the halves pairing
  // splits the CTA's warps, so at most kWarps / 2 K groups). HUMMING_JAX_DECODE_GATED=0: never.
  const bool oai = gate && gate->act == static_cast<int>(Activation::kSwigluOai);
  const bool gate_here = gate && gated && L.mode == RowMode::kIndexed && L.p.N % 2 == 0 &&
                         env_flag("HUMMING_JAX_DECODE_GATED", true);
  Plan pl;
  if (!plan(L, sms, &pl, gate_here && !oai ? kWarps / 2 : kWarps)) return Error::Success();
  const DecodeLaunch& D = pl.D;
  // fp8 x fp8 calls on the persistent ring kernel where the expected work units (items with rows x
  // 256-row slices) fill the SMs, as one CTA per SM otherwise leaves SMs idle (benchmarks/NOTES.md,
  // v11l-v11m: mixtral M = 1 GEMM2, 32 units, 1.8x slower; 128+ units up to 1.13x faster).
  // HUMMING_JAX_DECODE_RING=0 keeps the decode kernel, =1 takes the ring wherever it applies.
  const char* ring_env = std::getenv("HUMMING_JAX_DECODE_RING");
  const std::string ring_mode = ring_env && *ring_env ? ring_env : "auto";
  const bool ring = pl.dq == Deq::kCodes && (ring_mode == "1" || ring_mode == "auto") && fp8_ring_applies(D) &&
                    (ring_mode == "1" || fp8_ring_units(D, D.est_items) >= sms);
  // gemm_indexed_quant: the decode kernel quantizes the token rows itself where it takes the call
  // and every item holds its rows whole; elsewhere (the ring among them) the quantization kernel
  // runs first.
  const bool fuse = !ring && qin && env_flag("HUMMING_JAX_DECODE_QUANT", true) && quantizes_whole(L, pl, *qin);
  if (fuse) {
    pl.D.xq = qin->x;
    pl.D.xq_f16 = qin->xt == ElemType::kF16 ? 1 : 0;
    pl.D.xq_act = qin->act;
    pl.D.xq_limit = qin->limit;
    pl.D.xq_cols = qin->N1;
    pl.D.act_region_bytes = xq_region_bytes(pl.D);  // the quantized rows' scales beside them
    pl.smem = decode_smem_bytes(pl.D);
  }
  if (qin && !fuse) HJ_RETURN_IF_ERROR(launch_quantize(call, stream, *qin));
  // The ring kernel keeps its own epilogue; the raw and packed variants hold the gated one.
  const bool gating = gate_here && !ring && has_gated_epilogue(pl.dq);
  if (gating) {
    pl.D.gate_act = gate->act;
    pl.D.gate_oai = oai ? 1 : 0;
    pl.D.gate_limit = gate->limit;
    pl.D.gate_I = static_cast<int>(L.p.N / 2);
    pl.D.gate_y = gate->y;
    if (!oai) {  // the first wn / 2 warps take gate rows, the others the matching up rows
      pl.D.x_rows = pl.D.bn / 2;
      pl.D.up_warp = pl.D.wn / 2;
      pl.D.up_skip = pl.D.gate_I - pl.D.bn / 2;
    }
  }
  const int ring_rows = ring ? launch_fp8_ring(D, sms, stream) : 0;
  const bool on_ring = ring_rows > 0;
  if (ring && !on_ring)
    decline(L, "fp8 ring kernel: set-up failed (tensor map or shared-memory limit); planned kernel instead");
  bool ok = on_ring;
  if (!ok) switch (L.p.w.type) {
    case WeightType::kFloat: ok = launch_family<WeightType::kFloat>(D, pl.ak, pl.dq, pl.f32_scales, pl.grid, pl.smem, stream); break;
    case WeightType::kUInt4: ok = launch_family<WeightType::kUInt4>(D, pl.ak, pl.dq, pl.f32_scales, pl.grid, pl.smem, stream); break;
    case WeightType::kInt8: ok = launch_family<WeightType::kInt8>(D, pl.ak, pl.dq, pl.f32_scales, pl.grid, pl.smem, stream); break;
    case WeightType::kFp8E4M3: ok = launch_family<WeightType::kFp8E4M3>(D, pl.ak, pl.dq, pl.f32_scales, pl.grid, pl.smem, stream); break;
    case WeightType::kFp4E2M1: ok = launch_family<WeightType::kFp4E2M1>(D, pl.ak, pl.dq, pl.f32_scales, pl.grid, pl.smem, stream); break;
  }
  if (!ok) {
    decline(L, "no kernel variant for this weight, activation and scale combination");
    return Error::Success();
  }
  *launched = true;
  if (gated) *gated = gating && !on_ring;
  g_launches.fetch_add(1, std::memory_order_relaxed);
  if (gating && !on_ring) g_gated_launches.fetch_add(1, std::memory_order_relaxed);
  if (on_ring) g_ring_launches.fetch_add(1, std::memory_order_relaxed);
  if (fuse) g_quant_launches.fetch_add(1, std::memory_order_relaxed);
  const bool log = env_flag("HUMMING_JAX_DECODE_LOG", false);
  if (log && on_ring)
    std::fprintf(stderr, "humming_jax decode: %s N=%d K=%d -> fp8 ring kernel (units of %d rows, items=%d rows<=%d)\n",
                 mode_name(L.mode), D.N, D.K, ring_rows, D.items, D.max_rows);
  else if (log)
    std::fprintf(stderr,
                 "humming_jax decode: %s N=%d K=%d -> decode kernel (weights %d, %s, wk=%d bn=%d grid=%ux%u "
                 "items=%d rows<=%d whole<=%d smem=%zu%s%s)\n",
                 mode_name(L.mode), D.N, D.K, static_cast<int>(L.p.w.type), deq_name(pl.dq), D.wk, D.bn, pl.grid.x,
                 pl.grid.y, D.items, D.max_rows, D.whole_rows, pl.smem,
                 fuse ? ", quantizes its rows" : "", gating ? ", writes activated pairs" : "");
  return launch_status(call, on_ring ? "fp8_ring_kernel" : "decode_kernel");
}

}  // namespace decode
}  // namespace hj

// Decode kernel launches made by this process (host-side count; tests use it to prove the path ran).
extern "C" __attribute__((visibility("default"))) uint64_t HjDecodeLaunches() {
  return hj::decode::g_launches.load(std::memory_order_relaxed);
}

// Of those, launches of the fp8 ring kernel.
extern "C" __attribute__((visibility("default"))) uint64_t HjDecodeRingLaunches() {
  return hj::decode::g_ring_launches.load(std::memory_order_relaxed);
}

// Of those, decode kernel launches that quantized their 16-bit token rows themselves
// (gemm_indexed_quant).
extern "C" __attribute__((visibility("default"))) uint64_t HjDecodeQuantLaunches() {
  return hj::decode::g_quant_launches.load(std::memory_order_relaxed);
}

// Of those, decode kernel launches that wrote activated output pairs (gemm_indexed_gated).
extern "C" __attribute__((visibility("default"))) uint64_t HjDecodeGatedLaunches() {
  return hj::decode::g_gated_launches.load(std::memory_order_relaxed);
}
