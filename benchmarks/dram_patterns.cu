// DRAM read rate of the access patterns a weight-streaming decode kernel can use, on a matrix of
// R rows x Kb bytes (weights [E * N, K] of 1-byte codes) far larger than L2. Each pattern reads
// every byte once per pass; the rate is bytes / median pass time. Nothing is computed: the
// patterns differ only in the shape of the requests and the bytes in flight per SM.
//   tma RxC / S     persistent (one CTA per SM), one thread issues 2D TMA boxes of R rows x C
//                   bytes into a ring of S stages; a unit is R rows over all of K (the fp8 ring
//                   kernel: 128 or 256 rows x 128 bytes), units round robin over the CTAs or
//                   (`bal`) in contiguous ranges of equal count
//   bulk C / S      persistent, 1D bulk copies of C contiguous bytes (a layout whose stage is one run)
//   ldgsts wn x wk  the decode kernel's copies: 8 warps per CTA, two CTAs per SM; each warp moves 32
//                   rows x 64 bytes per stage with cp.async (16 bytes per lane and row, L2 256-byte
//                   prefetch), four stages; wn warps side by side over rows, wk over K
//   cp.async RxC / S by W warps
//                   persistent, the ring's stages (R rows x 128 bytes) filled by cp.async from W
//                   warps (the ring's producer: one warp; its warpgroup: four)
//   ld.v4           every thread reads 16-byte vectors in a grid-stride loop (the plain read rate)
//   memcpy          cudaMemcpyAsync device to device, counted as read + write bytes
// Build (sm_90a) and run:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o build/dram_patterns benchmarks/dram_patterns.cu
//   build/dram_patterns [Kb=4096] [MB=1024] [CTAs per persistent pattern = SMs] > dram_patterns.json
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../cuda_ffi/mbarrier_sm90.cuh"

using hj::mbar_arrive_expect_tx;
using hj::mbar_wait;

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
constexpr int kMaxStages = 12;

// Waits until request i of a ring of `stages` slots (bars[i % stages]) has landed.
__device__ __forceinline__ void wait_fill(const uint64_t* bars, int64_t i, int stages) {
  mbar_wait(smem_u32(&bars[i % stages]), static_cast<uint32_t>((i / stages) & 1));
}

// One thread per CTA: request i goes to slot i % S; before reusing a slot, wait for its previous
// request. Units (row blocks over all of K, or contiguous runs) go round robin over the CTAs.
// Requests per unit: K / box_cols; box (rows, cols) in bytes, esz the tensor map's element bytes.
// mode: 0 a 2D box, 1 a bulk copy of contiguous bytes, 2 / 3 a 3D box of box_cols / 128 k blocks
// (128-byte swizzle) over a view (128 B, rows, blocks) / (128 B, blocks, rows).
__global__ void tma_stream(const __grid_constant__ CUtensorMap map, int units, int reqs_per_unit, int box_rows,
                           int box_cols, int esz, int stages, const uint8_t* base, int64_t bulk_bytes, int mode,
                           uint32_t* zeros, int balanced) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) hj::mbar_init(smem_u32(&bars[s]), 1);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  const uint32_t stage_bytes = static_cast<uint32_t>(box_rows) * box_cols;
  int64_t issued = 0;
  // Round robin, or (balanced) a contiguous range of units per CTA.
  const int u_lo = balanced ? static_cast<int>(static_cast<int64_t>(units) * blockIdx.x / gridDim.x) : blockIdx.x;
  const int u_hi = balanced ? static_cast<int>(static_cast<int64_t>(units) * (blockIdx.x + 1) / gridDim.x) : units;
  for (int u = u_lo; u < u_hi; u += balanced ? 1 : gridDim.x) {
    for (int r = 0; r < reqs_per_unit; ++r, ++issued) {
      const int s = static_cast<int>(issued % stages);
      const uint32_t bar = smem_u32(&bars[s]);
      if (issued >= stages) {
        wait_fill(bars, issued - stages, stages);
        // The buffer holds no zero byte: a zero here is a box past the matrix (TMA zero fill).
        uint32_t last;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(last) : "r"(((smem_u32(smem) + 1023u) & ~1023u) + (s + 1) * stage_bytes - 4));
        if (last == 0u)
          atomicAdd(zeros, 1u);
      }
      mbar_arrive_expect_tx(bar, stage_bytes);
      const uint32_t dst = ((smem_u32(smem) + 1023u) & ~1023u) + static_cast<uint32_t>(s) * stage_bytes;
      if (mode == 1) {
        const uint8_t* src = base + (static_cast<int64_t>(u) * reqs_per_unit + r) * bulk_bytes;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
            "l"(src), "r"(stage_bytes), "r"(bar)
            : "memory");
      } else if (mode == 0) {
        const int c0 = r * box_cols / esz, c1 = u * box_rows;  // coordinates in elements
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
                dst),
            "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(bar)
            : "memory");
      } else {  // 3D views of 128-byte k blocks: (128, rows, blocks) or (128, blocks, rows)
        const int kb = r * box_cols / 128, row = u * box_rows;
        const int c1 = mode == 2 ? row : kb, c2 = mode == 2 ? kb : row;
        hj::tma_load_3d(dst, &map, 0, c1, c2, bar);
      }
    }
  }
  for (int64_t i = issued > stages ? issued - stages : 0; i < issued; ++i)
    wait_fill(bars, i, stages);
}

// The decode kernel's copy pattern: warp (wn, wk) of a CTA moves rows [32 wn, 32 wn + 32) of the
// CTA's row block, 64 bytes at column (it * WK + wk) * 64, four stages deep. Units: row blocks of
// 32 WN rows over all of K, round robin over the CTAs.
template <int WN>
__global__ void __launch_bounds__(256, 2) ldgsts_stream(const uint8_t* w, int64_t kb, int units, uint32_t* sink) {
  constexpr int kWK = 8 / WN, kStages = 4;
  extern __shared__ __align__(1024) uint8_t smem[];  // [kStages][8 warps][2048]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wn = warp % WN, wk = warp / WN, g = lane >> 2, t = lane & 3;
  const int iters = static_cast<int>(kb / (64 * kWK));
  uint32_t acc = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const uint8_t* rows = w + (static_cast<int64_t>(u) * 32 * WN + 32 * wn + g) * kb + t * 16;
    auto issue = [&](int it) {
      const uint8_t* src = rows + static_cast<int64_t>(it * kWK + wk) * 64;
      const uint32_t dst = smem_u32(smem + ((it % kStages) * 8 + warp) * 2048 + lane * 16);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst + q * 512),
                     "l"(src + static_cast<int64_t>(8 * q) * kb)
                     : "memory");
    };
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < iters) issue(st);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (int it = 0; it < iters; ++it) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
      if (it + kStages - 1 < iters) issue(it + kStages - 1);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      acc += *reinterpret_cast<const uint32_t*>(smem + ((it % kStages) * 8 + warp) * 2048 + lane * 16);
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the reads
}

// The ring's stages (R rows x 128 bytes of K, S of them) filled by cp.async from `warps` copying
// warps of a persistent CTA (one per SM), instead of one thread's TMA: each thread copies its
// share of a stage's 16-byte chunks and arrives on the stage's barrier when they land (init count:
// all copying threads); before reusing a slot every thread waits for its previous fill.
__global__ void cp_stream(const uint8_t* w, int64_t kb, int units, int box_rows, int stages) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  const int tid = threadIdx.x, nthreads = blockDim.x;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) hj::mbar_init(smem_u32(&bars[s]), nthreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const uint32_t stage_bytes = static_cast<uint32_t>(box_rows) * 128;
  const int reqs = static_cast<int>(kb / 128), chunks = box_rows * 8;
  const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
  int64_t issued = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const uint8_t* rows = w + static_cast<int64_t>(u) * box_rows * kb;
    for (int r = 0; r < reqs; ++r, ++issued) {
      const int s = static_cast<int>(issued % stages);
      const uint32_t bar = smem_u32(&bars[s]);
      if (issued >= stages) wait_fill(bars, issued - stages, stages);
      for (int c = tid; c < chunks; c += nthreads) {  // chunk c: row c / 8, 16 bytes c % 8
        const uint8_t* src = rows + static_cast<int64_t>(c >> 3) * kb + r * 128 + (c & 7) * 16;
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(base + s * stage_bytes + c * 16),
                     "l"(src)
                     : "memory");
      }
      hj::cp_async_mbar_arrive(bar);
    }
  }
  for (int64_t i = issued > stages ? issued - stages : 0; i < issued; ++i)
    wait_fill(bars, i, stages);
}

__global__ void ldv4_stream(const uint4* w, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
}

// Median of `passes` timed passes (after one warm-up), in seconds.
template <typename F>
double time_median(F&& pass, int passes) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  pass();
  CHECK(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int i = 0; i < passes; ++i) {
    CHECK(cudaEventRecord(a));
    pass();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e-3);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t kb = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t mb = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int64_t rows = (mb << 20) / kb / 256 * 256, bytes = rows * kb;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // Persistent patterns run one CTA on each of `ctas` SMs (default all): fewer show the rate one
  // SM reaches when the others idle, as in a launch with fewer work units than SMs.
  const int ctas = argc > 3 ? std::max(1, std::min(sms, std::atoi(argv[3]))) : sms;
  uint8_t *w = nullptr, *w2 = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&w, bytes));
  CHECK(cudaMalloc(&w2, bytes));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(w, 0x5a, bytes));
  CHECK(cudaMemset(sink, 0, 4));
  CHECK(cudaFuncSetAttribute(tma_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  const int passes = 10;
  std::printf("{\"kb\": %lld, \"rows\": %lld, \"bytes\": %lld, \"sms\": %d, \"ctas\": %d, \"passes\": %d, \"points\": [\n",
              static_cast<long long>(kb), static_cast<long long>(rows), static_cast<long long>(bytes), sms, ctas, passes);
  bool first = true;
  // TMA patterns count the boxes that arrived zero-filled in sink[0] (must stay 0).
  auto report = [&](const std::string& name, double moved, double sec) {
    uint32_t zeros = 0;
    CHECK(cudaMemcpy(&zeros, sink, 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemset(sink, 0, 4));
    std::printf("%s  {\"pattern\": \"%s\", \"ms\": %.4f, \"tbps\": %.3f, \"zero_boxes\": %u}", first ? "" : ",\n",
                name.c_str(), sec * 1e3, moved / sec * 1e-12, zeros);
    std::fflush(stdout);
    first = false;
  };

  report("memcpy (read + write)", 2.0 * bytes,
         time_median([&] { CHECK(cudaMemcpyAsync(w2, w, bytes, cudaMemcpyDeviceToDevice)); }, passes));
  report("ld.v4", bytes, time_median([&] { ldv4_stream<<<ctas * 8, 512>>>(reinterpret_cast<const uint4*>(w), bytes / 16, sink); }, passes));

  auto encode = encoder();
  struct Box {
    int r, c, s, balanced;
  };
  // Boxes of 32 KB (and the ring's 16 KB one) at 4 and 6 stages; columns above 256 bytes use 8-byte
  // elements (a box is at most 256 elements per dimension).
  // (With few units per SM the last round of a round robin leaves SMs idle: `bal` takes contiguous
  // ranges of units per CTA instead.)
  const Box boxes[] = {{256, 128, 4, 0}, {256, 128, 6, 0}, {128, 128, 8, 0}, {64, 128, 12, 0}, {128, 128, 8, 1},
                       {64, 128, 12, 1}, {128, 256, 4, 0}, {64, 512, 4, 0}, {32, 1024, 4, 0}, {16, 2048, 4, 0},
                       {32, 1024, 6, 0}};
  for (const Box& b : boxes) {
    if (b.c > kb || kb % b.c) continue;
    const int esz = b.c > 256 ? 8 : 1;
    CUtensorMap map{};
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kb / esz), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kb)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(b.c / esz), static_cast<cuuint32_t>(b.r)};
    const cuuint32_t estr[2] = {1, 1};
    const CUresult res = encode(&map, esz == 8 ? CU_TENSOR_MAP_DATA_TYPE_UINT64 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w,
                                dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (res != CUDA_SUCCESS) {
      std::fprintf(stderr, "tensor map %dx%d: error %d\n", b.r, b.c, static_cast<int>(res));
      continue;
    }
    const int units = static_cast<int>(rows / b.r), reqs = static_cast<int>(kb / b.c);
    const size_t smem = static_cast<size_t>(b.s) * b.r * b.c + 1024;
    const double sec = time_median(
        [&] { tma_stream<<<ctas, 32, smem>>>(map, units, reqs, b.r, b.c, esz, b.s, w, 0, 0, sink, b.balanced); }, passes);
    report("tma " + std::to_string(b.r) + "x" + std::to_string(b.c) + " / " + std::to_string(b.s) + (b.balanced ? " bal" : ""),
           bytes, sec);
  }
  for (int c : {16384, 32768}) {
    for (int s : {4, 6}) {
      if (static_cast<int64_t>(c) * s > 200 * 1024) continue;
      const int units = static_cast<int>(bytes / c / 8), reqs = 8;  // 8 contiguous runs per unit
      CUtensorMap none{};
      const double sec = time_median(
          [&] { tma_stream<<<ctas, 32, static_cast<size_t>(c) * s + 1024>>>(none, units, reqs, 1, c, 1, s, w, c, 1, sink, 0); }, passes);
      report("bulk " + std::to_string(c) + " / " + std::to_string(s), static_cast<double>(units) * reqs * c, sec);
    }
  }
  // The ring's 128-byte-swizzled tiles of 128 k, `nb` of them per request (128 nb contiguous bytes
  // per row): 2-tile requests are a ring stage of two scale blocks, 4-tile ones of four.
  struct Box3 {
    int r, s, mode, nb;
  };
  for (const Box3& b : {Box3{128, 5, 2, 2}, Box3{256, 3, 2, 2}, Box3{64, 6, 2, 4}, Box3{128, 3, 2, 4},
                        Box3{64, 6, 3, 4}, Box3{128, 3, 3, 4}}) {
    const int64_t req_bytes = 128 * b.nb;
    if (kb % req_bytes) continue;
    CUtensorMap map{};
    const cuuint64_t nb = static_cast<cuuint64_t>(kb / 128), nr = static_cast<cuuint64_t>(rows);
    const cuuint64_t dims[3] = {128, b.mode == 2 ? nr : nb, b.mode == 2 ? nb : nr};
    const cuuint64_t strides[2] = {b.mode == 2 ? static_cast<cuuint64_t>(kb) : 128u,
                                   b.mode == 2 ? 128u : static_cast<cuuint64_t>(kb)};
    const cuuint32_t box[3] = {128, b.mode == 2 ? static_cast<cuuint32_t>(b.r) : static_cast<cuuint32_t>(b.nb),
                               b.mode == 2 ? static_cast<cuuint32_t>(b.nb) : static_cast<cuuint32_t>(b.r)};
    const cuuint32_t estr[3] = {1, 1, 1};
    const CUresult res = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, w, dims, strides, box, estr,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (res != CUDA_SUCCESS) {
      std::fprintf(stderr, "3D tensor map %d rows mode %d: error %d\n", b.r, b.mode, static_cast<int>(res));
      continue;
    }
    const int units = static_cast<int>(rows / b.r), reqs = static_cast<int>(kb / req_bytes);
    const size_t smem = static_cast<size_t>(b.s) * b.r * req_bytes + 1024;
    const double sec = time_median(
        [&] { tma_stream<<<ctas, 32, smem>>>(map, units, reqs, b.r, static_cast<int>(req_bytes), 1, b.s, w, 0, b.mode, sink, 0); },
        passes);
    report(std::string(b.mode == 2 ? "tma3d blocks outer " : "tma3d blocks inner ") + std::to_string(b.r) + "x" +
               std::to_string(req_bytes) + " / " + std::to_string(b.s),
           bytes, sec);
  }
  const int grid = 2 * ctas, lsm = 4 * 8 * 2048;
  CHECK(cudaFuncSetAttribute(ldgsts_stream<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, lsm));
  CHECK(cudaFuncSetAttribute(ldgsts_stream<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, lsm));
  CHECK(cudaFuncSetAttribute(ldgsts_stream<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, lsm));
  // A stage spans 64 x (8 / wn) bytes of K: narrower rows would read nothing.
  if (kb % 512 == 0)
    report("ldgsts 1x8", bytes, time_median([&] { ldgsts_stream<1><<<grid, 256, lsm>>>(w, kb, static_cast<int>(rows / 32), sink); }, passes));
  if (kb % 256 == 0)
    report("ldgsts 2x4", bytes, time_median([&] { ldgsts_stream<2><<<grid, 256, lsm>>>(w, kb, static_cast<int>(rows / 64), sink); }, passes));
  if (kb % 128 == 0)
    report("ldgsts 4x2", bytes, time_median([&] { ldgsts_stream<4><<<grid, 256, lsm>>>(w, kb, static_cast<int>(rows / 128), sink); }, passes));
  CHECK(cudaFuncSetAttribute(cp_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  for (int r : {128, 256}) {
    for (int nw : {1, 2, 4}) {
      const int st = r == 128 ? 10 : 5;  // the ring's stages: 160 KB in flight
      const size_t smem = static_cast<size_t>(st) * r * 128 + 1024;
      report("cp.async " + std::to_string(r) + "x128 / " + std::to_string(st) + " by " + std::to_string(nw) + " warps",
             bytes, time_median([&] { cp_stream<<<ctas, 32 * nw, smem>>>(w, kb, static_cast<int>(rows / r), r, st); }, passes));
    }
  }
  std::printf("\n]}\n");
  CHECK(cudaFree(w));
  CHECK(cudaFree(w2));
  CHECK(cudaFree(sink));
  return 0;
}
