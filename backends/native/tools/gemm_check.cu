// moe_ep_gemm_check: checks the bf16 grouped GEMMs (src/cuda/gemm/grouped_gemm.h) against
// a naive reference on the GPU, then times the DeepSeek-V3 expert shapes.
//
//   moe_ep_gemm_check                  checks, then timings
//   moe_ep_gemm_check --no-time        checks only
//   moe_ep_gemm_check --mxfp8-weights  the mxfp8-weights GEMM alone (cuda/gemm/mxfp8_weights_gemm.cuh):
//                                      its checks, then its timings at the decode shape
//   moe_ep_gemm_check --nvfp4-weights  the nvfp4-weights GEMM alone (cuda/gemm/nvfp4_weights_gemm.cuh):
//                                      its checks (the default choice, then each variant), then its
//                                      timings at the decode shapes against a device copy of its
//                                      weight bytes and against the mxfp8-weights GEMM
//                                      (with --mxfp8-weights too: both kernels' checks and timings)
//   moe_ep_gemm_check --mxfp8-weights-profile, --nvfp4-weights-profile
//                                      one launch of each variant at the decode shape, nothing
//                                      else (for ncu -k regex:mxfp8_weights_gemm / nvfp4_weights_gemm)
//   moe_ep_gemm_check --nvfp4-weights-sweep
//                                      configurations of the nvfp4-weights GEMM beyond its variants,
//                                      timed at the decode shapes: which to pick
//   moe_ep_gemm_check --fc1-swiglu     FC1 with the SwiGLU in its epilogue (cuda/gemm/fc1_swiglu_gemm.h)
//                                      against FC1's float32 GEMM and the layer's pass, bit for bit,
//                                      then (unless --no-time) both timed at the prefill shape
//   moe_ep_gemm_check --fc1-swiglu-profile
//                                      the prefill shape's check alone: one launch of each kernel
//                                      (for ncu -k regex:device_kernel: the CUTLASS kernels' function name)
//   moe_ep_gemm_check --initcheck-probe  (under compute-sanitizer --tool initcheck) whether the tool
//                                      sees the grouped GEMM's stores
//
// The run without flags includes both block-scaled-weights GEMMs' checks (the nvfp4 one's
// variant checks too; the mxfp8 one's come with --mxfp8-weights) and their default choice's
// timings at the decode shapes (32 experts x 32 rows).
//
// Every check prints one line ("ok" or "MISMATCH ..."; an nvfp4 mismatch then up to three
// indented lines, one an output: where, what its weight row holds, got, want, bound); the exit status is non-zero on
// any mismatch or CUDA error. The reference multiplies the bf16 inputs exactly (the
// products of two bf16 are exact in float32) and sums in float64; a result passes when
// |d - ref| <= 1e-5 * sum_k |a_k| |b_k| (+ 1e-30) for every element. Rows (kNN, kNT) past
// the last offset must be left untouched; kTN groups with no rows must be 0 (or their old
// value with accumulate).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/formats.h"
#include "cuda/gemm/fc1_swiglu_gemm.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/mxfp8_weights_gemm.cuh"
#include "cuda/gemm/nvfp4_weights_gemm.cuh"
#include "cuda/swiglu.cuh"

using moe_ep::cuda::GemmLayout;
using moe_ep::cuda::GemmKernel;
using moe_ep::cuda::GroupedGemmProblem;

namespace {

#define CHECK_CUDA(expr)                                                                              \
  do {                                                                                                \
    cudaError_t e_ = (expr);                                                                          \
    if (e_ != cudaSuccess) {                                                                          \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

const char* layout_name(GemmLayout l) {
  switch (l) {
    case GemmLayout::kNN: return "NN";
    case GemmLayout::kNT: return "NT";
    case GemmLayout::kTN: return "TN";
  }
  return "?";
}

using moe_ep::cuda::detail::bf16_to_float;  // the device decode (the host's: moe_ep::cpu::bf16_to_float)

// Pseudo-random bf16 in about [-2, 2] with a few exponents, from a hash of (seed, i).
__host__ __device__ inline uint16_t random_bf16(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  const uint32_t sign = static_cast<uint32_t>(x & 1) << 15;
  const uint32_t exponent = 125 + static_cast<uint32_t>((x >> 1) % 3);  // 2^-2 .. 2^0
  const uint32_t mantissa = static_cast<uint32_t>((x >> 8) & 0x7F);
  return static_cast<uint16_t>(sign | (exponent << 7) | mantissa);
}

__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = random_bf16(seed, static_cast<uint64_t>(i));
}

__global__ void fill_float(float* p, int64_t n, uint64_t seed, float value, bool random) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = random ? bf16_to_float(random_bf16(seed, static_cast<uint64_t>(i))) : value;
}

__device__ int group_of_row(const int32_t* off, int groups, int64_t r) {
  int lo = 0, hi = groups;  // off[lo] <= r < off[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (off[mid] <= r) lo = mid; else hi = mid;
  }
  return lo;
}

// ref / bound have the shape of d. ref = (accumulate ? d0 : 0) + sum a*b in float64;
// bound = sum |a||b|. Elements no group owns get ref = d0, bound = 0 (must be untouched).
__global__ void reference(GroupedGemmProblem p, const float* d0, double* ref, double* bound) {
  const bool tn = p.layout == GemmLayout::kTN;
  const int64_t rows = tn ? static_cast<int64_t>(p.num_groups) * p.m : p.total_rows;
  const int64_t total = rows * p.n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / p.n, j = idx % p.n;
    double s = 0.0, b = 0.0;
    bool owned = true;
    if (tn) {
      const int g = static_cast<int>(row / p.m);
      const int64_t i = row % p.m;
      for (int64_t r = p.offsets[g]; r < p.offsets[g + 1]; ++r) {
        const double prod = static_cast<double>(bf16_to_float(p.a[r * p.m + i]) * bf16_to_float(p.b[r * p.n + j]));
        s += prod;
        b += fabs(prod);
      }
    } else if (row >= p.offsets[p.num_groups]) {
      owned = false;
    } else {
      const int g = group_of_row(p.offsets, p.num_groups, row);
      const uint16_t* bg = p.b + static_cast<int64_t>(g) * p.k * p.n;
      for (int64_t kk = 0; kk < p.k; ++kk) {
        const float bv = p.layout == GemmLayout::kNN ? bf16_to_float(bg[kk * p.n + j]) : bf16_to_float(bg[j * p.k + kk]);
        const double prod = static_cast<double>(bf16_to_float(p.a[row * p.k + kk]) * bv);
        s += prod;
        b += fabs(prod);
      }
    }
    ref[idx] = owned ? (p.accumulate ? static_cast<double>(d0[idx]) : 0.0) + s : static_cast<double>(d0[idx]);
    bound[idx] = owned ? b : 0.0;
  }
}

template <class T>
T* device_alloc(size_t count) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  return p;
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)); }

struct Buffers {
  uint16_t* a = nullptr;
  uint16_t* b = nullptr;
  float* d = nullptr;
  int32_t* off = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  int64_t a_elems = 0, b_elems = 0, d_elems = 0;
  void release() {
    cudaFree(a); cudaFree(b); cudaFree(d); cudaFree(off); cudaFree(ws);
    *this = Buffers{};
  }
};

// Element counts of the operands of p.
void operand_sizes(const GroupedGemmProblem& p, int64_t* a, int64_t* b, int64_t* d) {
  if (p.layout == GemmLayout::kTN) {
    *a = p.total_rows * p.m;
    *b = p.total_rows * p.n;
    *d = static_cast<int64_t>(p.num_groups) * p.m * p.n;
  } else {
    *a = p.total_rows * p.k;
    *b = static_cast<int64_t>(p.num_groups) * p.k * p.n;
    *d = p.total_rows * p.n;
  }
}

Buffers make_buffers(GroupedGemmProblem& p, const std::vector<int32_t>& offsets, int sm_count, uint64_t seed) {
  Buffers buf;
  operand_sizes(p, &buf.a_elems, &buf.b_elems, &buf.d_elems);
  buf.a = device_alloc<uint16_t>(buf.a_elems);
  buf.b = device_alloc<uint16_t>(buf.b_elems);
  buf.d = device_alloc<float>(buf.d_elems);
  buf.off = device_alloc<int32_t>(offsets.size());
  CHECK_CUDA(cudaMemcpy(buf.off, offsets.data(), offsets.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill_bf16<<<grid_for(buf.a_elems), 256>>>(buf.a, buf.a_elems, seed * 3 + 1);
  fill_bf16<<<grid_for(buf.b_elems), 256>>>(buf.b, buf.b_elems, seed * 3 + 2);
  CHECK_CUDA(cudaGetLastError());
  p.a = buf.a;
  p.b = buf.b;
  p.d = buf.d;
  p.offsets = buf.off;
  buf.ws_bytes = moe_ep::cuda::grouped_gemm_workspace_bytes(p, sm_count);
  CHECK_CUDA(cudaMalloc(&buf.ws, std::max<size_t>(buf.ws_bytes, 1)));
  return buf;
}

// Rows an expert for `routes` routes (tokens x top-8) over 32 local experts: a fixed draw of
// the multinomial spread around routes / 32 (the bench's random routing), `routes` in all.
// 1024 routes: the decode (128 tokens; 20 to 42 rows an expert); 32768: the prefill (4096
// tokens; about 1024 +- 32, so about half the experts have 9 tiles of 128 rows).
std::vector<int> spread_rows(int routes) {
  std::vector<int> rows(32, 0);
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < routes; ++i) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 29;
    ++rows[(h >> 7) % 32];
  }
  return rows;
}

// The groups' row offsets: off[0] = 0, off[g + 1] = off[g] + rows[g].
std::vector<int32_t> offsets_of(const std::vector<int>& rows) {
  std::vector<int32_t> off(rows.size() + 1, 0);
  for (size_t g = 0; g < rows.size(); ++g) off[g + 1] = off[g] + rows[g];
  return off;
}

int g_failures = 0;

// One correctness check: layout, fixed dims, per-group row counts, extra rows past the
// last offset, accumulate, launched directly or through a captured CUDA graph.
// kernel_choice: the one to run (kAuto: what the dispatcher picks).
void check(const char* name, GemmLayout layout, int64_t m, int64_t n, int64_t k, const std::vector<int>& rows,
           int64_t extra_rows, bool accumulate, bool graph, GemmKernel kernel_choice, int sm_count, uint64_t seed) {
  GroupedGemmProblem p;
  p.layout = layout;
  p.num_groups = static_cast<int32_t>(rows.size());
  const std::vector<int32_t> off = offsets_of(rows);
  p.total_rows = off.back() + extra_rows;
  p.m = m;
  p.n = n;
  p.k = k;
  p.accumulate = accumulate;
  p.kernel = kernel_choice;
  const char* kernel = moe_ep::cuda::grouped_gemm_kernel_name(p);
  char label[256];
  std::snprintf(label, sizeof(label), "check %-26s %s %-15s groups=%d m=%lld n=%lld k=%lld rows=%lld%s%s", name,
                layout_name(layout), kernel, p.num_groups, static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k), static_cast<long long>(p.total_rows), accumulate ? " accumulate" : "",
                graph ? " graph" : "");
  if (!moe_ep::cuda::grouped_gemm_supported(p)) {
    std::printf("%s: MISMATCH (grouped_gemm_supported() is false)\n", label);
    ++g_failures;
    return;
  }
  Buffers buf = make_buffers(p, off, sm_count, seed);
  // D before: random values with accumulate; without, a NaN sentinel wherever the GEMM
  // must write (so an unwritten output shows) and random values in the rows past the
  // last offset (kNN, kNT: they must stay as they are).
  fill_float<<<grid_for(buf.d_elems), 256>>>(buf.d, buf.d_elems, seed * 3 + 3, 0.f, true);
  if (!accumulate) {
    const size_t owned = layout == GemmLayout::kTN ? static_cast<size_t>(buf.d_elems) : static_cast<size_t>(off.back()) * n;
    CHECK_CUDA(cudaMemset(buf.d, 0xFF, owned * sizeof(float)));
  }
  CHECK_CUDA(cudaGetLastError());
  float* d0 = device_alloc<float>(buf.d_elems);
  double* ref = device_alloc<double>(buf.d_elems);
  double* bound = device_alloc<double>(buf.d_elems);
  CHECK_CUDA(cudaMemcpy(d0, buf.d, buf.d_elems * sizeof(float), cudaMemcpyDeviceToDevice));
  {
    GroupedGemmProblem q = p;
    q.d = d0;
    reference<<<grid_for(buf.d_elems), 256>>>(q, d0, ref, bound);
    CHECK_CUDA(cudaGetLastError());
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaError_t e;
  if (graph) {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    e = moe_ep::cuda::grouped_gemm_bf16(p, buf.ws, buf.ws_bytes, stream, sm_count);
    CHECK_CUDA(cudaStreamEndCapture(stream, &g));
    if (e == cudaSuccess) {
      CHECK_CUDA(cudaGraphInstantiate(&exec, g, 0));
      CHECK_CUDA(cudaGraphLaunch(exec, stream));
      CHECK_CUDA(cudaGraphExecDestroy(exec));
    }
    CHECK_CUDA(cudaGraphDestroy(g));
  } else {
    e = moe_ep::cuda::grouped_gemm_bf16(p, buf.ws, buf.ws_bytes, stream, sm_count);
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    std::printf("%s: MISMATCH (launch: %s)\n", label, cudaGetErrorName(e));
    ++g_failures;
  } else {
    std::vector<float> h_d(buf.d_elems);
    std::vector<double> h_ref(buf.d_elems), h_bound(buf.d_elems);
    CHECK_CUDA(cudaMemcpy(h_d.data(), buf.d, buf.d_elems * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(h_ref.data(), ref, buf.d_elems * sizeof(double), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(h_bound.data(), bound, buf.d_elems * sizeof(double), cudaMemcpyDeviceToHost));
    int64_t bad = 0, first = -1;
    double worst = 0.0;  // max |d - ref| / bound
    for (int64_t i = 0; i < buf.d_elems; ++i) {
      const double err = std::fabs(static_cast<double>(h_d[i]) - h_ref[i]);
      const double tol = 1e-5 * h_bound[i] + 1e-30;
      const bool ok = std::isfinite(h_d[i]) ? err <= tol : (std::isnan(h_ref[i]) && std::isnan(h_d[i]));
      if (!ok) {
        if (first < 0) first = i;
        ++bad;
      } else if (h_bound[i] > 0) {
        worst = std::max(worst, err / h_bound[i]);
      }
    }
    if (bad == 0) {
      std::printf("%s: ok (max |d-ref|/sum|ab| = %.2e)\n", label, worst);
    } else {
      std::printf("%s: MISMATCH %lld of %lld elements, first at %lld: d=%.9g ref=%.9g sum|ab|=%.9g\n", label,
                  static_cast<long long>(bad), static_cast<long long>(buf.d_elems), static_cast<long long>(first),
                  h_d[first], h_ref[first], h_bound[first]);
      ++g_failures;
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  cudaFree(d0);
  cudaFree(ref);
  cudaFree(bound);
  buf.release();
}

// kNN or kTN with a bf16 D: the same kernel's float32 D rounded to nearest even, bit for bit
// (the two instantiations share tile, schedule and mainloop, so their accumulators are
// equal), kNN rows past the last offset untouched, kTN groups with no rows bf16 zeros.
void check_bf16_out(const char* name, GemmLayout layout, int64_t m, int64_t n, int64_t k, const std::vector<int>& rows,
                    int64_t extra_rows, GemmKernel kernel_choice, int sm_count, uint64_t seed) {
  GroupedGemmProblem p;
  p.layout = layout;
  p.num_groups = static_cast<int32_t>(rows.size());
  const std::vector<int32_t> off = offsets_of(rows);
  p.total_rows = off.back() + extra_rows;
  p.m = m;
  p.n = n;
  p.k = k;
  p.kernel = kernel_choice;
  char label[256];
  std::snprintf(label, sizeof(label), "check %-26s %s %-15s bf16 D groups=%d m=%lld n=%lld k=%lld rows=%lld", name,
                layout_name(layout), moe_ep::cuda::grouped_gemm_kernel_name(p), p.num_groups,
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                static_cast<long long>(p.total_rows));
  Buffers buf = make_buffers(p, off, sm_count, seed);
  uint16_t* d16 = device_alloc<uint16_t>(buf.d_elems);
  CHECK_CUDA(cudaMemset(d16, 0x5A, buf.d_elems * sizeof(uint16_t)));  // a sentinel everywhere
  GroupedGemmProblem q = p;
  q.d = nullptr;
  q.d_bf16 = d16;
  const size_t ws16 = moe_ep::cuda::grouped_gemm_workspace_bytes(q, sm_count);
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, std::max<size_t>(ws16, 1)));
  cudaError_t e = moe_ep::cuda::grouped_gemm_bf16(p, buf.ws, buf.ws_bytes, nullptr, sm_count);
  if (e == cudaSuccess) e = moe_ep::cuda::grouped_gemm_bf16(q, ws, ws16, nullptr, sm_count);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (!moe_ep::cuda::grouped_gemm_supported(q) || e != cudaSuccess) {
    std::printf("%s: MISMATCH (supported %d, launch %s)\n", label, moe_ep::cuda::grouped_gemm_supported(q) ? 1 : 0,
                cudaGetErrorName(e));
    ++g_failures;
  } else {
    std::vector<float> h_d(buf.d_elems);
    std::vector<uint16_t> h_16(buf.d_elems);
    CHECK_CUDA(cudaMemcpy(h_d.data(), buf.d, buf.d_elems * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(h_16.data(), d16, buf.d_elems * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    const int64_t owned = layout == GemmLayout::kTN ? static_cast<int64_t>(buf.d_elems) : static_cast<int64_t>(off.back()) * n;
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < buf.d_elems; ++i) {
      uint16_t want = 0x5A5A;
      if (i < owned) want = moe_ep::cpu::bf16_from_float(h_d[i]);  // the project's bf16 encoding
      if (h_16[i] != want) {
        if (first < 0) first = i;
        ++bad;
      }
    }
    if (bad == 0) {
      std::printf("%s: ok (bit for bit the float32 D rounded to bf16; %s)\n", label,
                  layout == GemmLayout::kTN ? "empty groups zero" : "rows past the slabs untouched");
    } else {
      std::printf("%s: MISMATCH %lld of %lld elements, first at %lld: bf16 %04x, float32 D %.9g\n", label,
                  static_cast<long long>(bad), static_cast<long long>(buf.d_elems), static_cast<long long>(first),
                  h_16[first], h_d[first]);
      ++g_failures;
    }
  }
  cudaFree(ws);
  cudaFree(d16);
  buf.release();
}

// Times one shape: warm-up, then `iters` launches between CUDA events.
void time_rows(const char* name, GemmLayout layout, int64_t m, int64_t n, int64_t k, const std::vector<int>& rows,
               int sm_count, GemmKernel kernel_choice = GemmKernel::kAuto, bool bf16_d = false) {
  GroupedGemmProblem p;
  p.layout = layout;
  const int groups = static_cast<int>(rows.size());
  p.num_groups = groups;
  const std::vector<int32_t> off = offsets_of(rows);
  const int min_rows = *std::min_element(rows.begin(), rows.end()), max_rows = *std::max_element(rows.begin(), rows.end());
  p.total_rows = off.back();
  p.m = m;
  p.n = n;
  p.k = k;
  p.kernel = kernel_choice;
  Buffers buf = make_buffers(p, off, sm_count, 7);
  CHECK_CUDA(cudaMemset(buf.d, 0, buf.d_elems * sizeof(float)));
  void* ws = buf.ws;
  size_t ws_bytes = buf.ws_bytes;
  if (bf16_d) {  // D as bf16 into the float buffer's memory (half of it), its own workspace
    p.d_bf16 = reinterpret_cast<uint16_t*>(buf.d);
    p.d = nullptr;
    ws_bytes = moe_ep::cuda::grouped_gemm_workspace_bytes(p, sm_count);
    CHECK_CUDA(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 1)));
  }
  const int warmup = 3, iters = 20;
  cudaEvent_t t0, t1;
  CHECK_CUDA(cudaEventCreate(&t0));
  CHECK_CUDA(cudaEventCreate(&t1));
  for (int i = 0; i < warmup; ++i) CHECK_CUDA(moe_ep::cuda::grouped_gemm_bf16(p, ws, ws_bytes, 0, sm_count));
  CHECK_CUDA(cudaEventRecord(t0));
  for (int i = 0; i < iters; ++i) CHECK_CUDA(moe_ep::cuda::grouped_gemm_bf16(p, ws, ws_bytes, 0, sm_count));
  CHECK_CUDA(cudaEventRecord(t1));
  CHECK_CUDA(cudaEventSynchronize(t1));
  float ms = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
  ms /= iters;
  // FLOPs: 2 * rows * (fixed dims), rows summed over the groups.
  const double fixed = layout == GemmLayout::kTN ? static_cast<double>(m) * n : static_cast<double>(n) * k;
  const double flops = 2.0 * static_cast<double>(p.total_rows) * fixed;
  const double bytes = 2.0 * (buf.a_elems + buf.b_elems) + (bf16_d ? 2.0 : 4.0) * buf.d_elems;
  const char* kernel = moe_ep::cuda::grouped_gemm_kernel_name(p);
  char per_group[32];
  if (min_rows == max_rows) std::snprintf(per_group, sizeof(per_group), "%d", min_rows);
  else std::snprintf(per_group, sizeof(per_group), "%d..%d", min_rows, max_rows);
  std::printf("time  %-30s %s %-15s groups=%d rows/group=%s m=%lld n=%lld k=%lld: %.3f ms, %.1f TFLOP/s, %.2f TB/s (A+B+D once)\n",
              name, layout_name(layout), kernel, groups, per_group, static_cast<long long>(m), static_cast<long long>(n),
              static_cast<long long>(k), ms, flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e12);
  CHECK_CUDA(cudaEventDestroy(t0));
  CHECK_CUDA(cudaEventDestroy(t1));
  if (bf16_d) cudaFree(ws);
  buf.release();
}

// time_rows with every group the same size.
void time_shape(const char* name, GemmLayout layout, int64_t m, int64_t n, int64_t k, int groups, int rows_per_group,
                int sm_count, GemmKernel kernel_choice = GemmKernel::kAuto, bool bf16_d = false) {
  time_rows(name, layout, m, n, k, std::vector<int>(groups, rows_per_group), sm_count, kernel_choice, bf16_d);
}

// ------------------------------------------------------------------ mxfp8 weights (--mxfp8-weights)

// Random E4M3 codes (never a NaN code) and E8M0 scale codes in [110, 130], from a hash.
__global__ void fill_mxfp8(uint8_t* codes, int64_t n_codes, uint8_t* scales, int64_t n_scales, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_codes; i += stride) {
    const uint16_t r = random_bf16(seed, static_cast<uint64_t>(i));
    const uint8_t c = static_cast<uint8_t>(r ^ (r >> 8));
    codes[i] = (c & 0x7F) == 0x7F ? static_cast<uint8_t>(c ^ 0x01) : c;
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_scales; i += stride)
    scales[i] = static_cast<uint8_t>(110 + random_bf16(seed + 99, static_cast<uint64_t>(i)) % 21);
}

// The exact value of an E4M3 code times 2^(s - 127), NaN for a NaN code or scale 0xFF.
__device__ double mxfp8_exact(uint8_t c, uint8_t s) {
  if ((c & 0x7F) == 0x7F || s == 0xFF) return nan("");
  const int ex = (c >> 3) & 0xF, man = c & 7;
  const double v = ex == 0 ? ldexp(static_cast<double>(man), -9) : ldexp(8.0 + man, ex - 10);
  return ldexp((c & 0x80) ? -v : v, static_cast<int>(s) - 127);
}

// Whether bf16 holds E4M3(c) * 2^(s - 127) (mxfp8_exact's value v): every value of 2^-126
// or more (at most 4 significant bits), and below that the multiples of 2^-133.
__device__ bool bf16_holds(double v) {
  const double a = fabs(v);
  return isnan(v) || a >= ldexp(1.0, -126) || floor(ldexp(a, 133)) == ldexp(a, 133);
}

// y[r, n] = sum_k x[r, k] W_e[n, k] in float64, and the sum of |products|; rows past the
// last offset: ref = the old y (untouched), bound 0. NaN for every row of an expert whose
// weight row n holds a value bf16 cannot hold (the kernel decodes it to NaN).
__global__ void mxfp8_reference(moe_ep::cuda::Mxfp8WeightsGemm p, int64_t rows, const float* y0, double* ref,
                                double* bound) {
  const int64_t total = rows * p.n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / p.n, n = idx % p.n;
    if (r >= p.off[p.num_experts]) {
      ref[idx] = y0[idx];
      bound[idx] = 0.0;
      continue;
    }
    const int e = group_of_row(p.off, p.num_experts, r);
    const uint8_t* c = p.codes + (static_cast<int64_t>(e) * p.n + n) * p.k;
    const uint8_t* sc = p.scales + (static_cast<int64_t>(e) * p.n + n) * (p.k / 32);
    double s = 0.0, b = 0.0;
    const int planes = p.x_planes > 1 ? p.x_planes : 1;
    for (int64_t k = 0; k < p.k; ++k) {
      const double w = mxfp8_exact(c[k], sc[k / 32]);
      if (!bf16_holds(w)) s = nan("");
      for (int pl = 0; pl < planes; ++pl) {
        const double prod = static_cast<double>(bf16_to_float(p.x[pl * p.x_plane_stride + r * p.k + k])) * w;
        s += prod;
        b += fabs(prod);
      }
    }
    ref[idx] = (p.accumulate ? static_cast<double>(y0[idx]) : 0.0) + s;
    bound[idx] = b;
  }
}

struct MxBuffers {
  uint16_t* x = nullptr;
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  int32_t* off = nullptr;
  float* y = nullptr;
  int64_t x_elems = 0, code_bytes = 0, scale_bytes = 0, y_elems = 0;
  void release() {
    cudaFree(x); cudaFree(codes); cudaFree(scales); cudaFree(off); cudaFree(y);
    *this = MxBuffers{};
  }
};

// planes: x as that many bf16 planes of [rows, k] (p.x_planes, p.x_plane_stride).
MxBuffers make_mx(moe_ep::cuda::Mxfp8WeightsGemm& p, const std::vector<int32_t>& off, int64_t rows, uint64_t seed,
                  int planes = 1) {
  MxBuffers b;
  const int64_t E = static_cast<int64_t>(off.size()) - 1;
  b.x_elems = planes * rows * p.k;
  p.x_planes = planes;
  p.x_plane_stride = rows * p.k;
  b.code_bytes = E * p.n * p.k;
  b.scale_bytes = E * p.n * (p.k / 32);
  b.y_elems = rows * p.n;
  p.total_rows = rows;
  b.x = device_alloc<uint16_t>(b.x_elems);
  b.codes = device_alloc<uint8_t>(b.code_bytes);
  b.scales = device_alloc<uint8_t>(b.scale_bytes);
  b.off = device_alloc<int32_t>(off.size());
  b.y = device_alloc<float>(b.y_elems);
  CHECK_CUDA(cudaMemcpy(b.off, off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill_bf16<<<grid_for(b.x_elems), 256>>>(b.x, b.x_elems, seed * 3 + 1);
  fill_mxfp8<<<grid_for(b.code_bytes), 256>>>(b.codes, b.code_bytes, b.scales, b.scale_bytes, seed * 3 + 2);
  fill_float<<<grid_for(b.y_elems), 256>>>(b.y, b.y_elems, seed * 3 + 3, 0.0f, true);
  CHECK_CUDA(cudaGetLastError());
  p.x = b.x;
  p.codes = b.codes;
  p.scales = b.scales;
  p.off = b.off;
  p.y = b.y;
  p.num_experts = static_cast<int>(E);
  return b;
}

// A launch of the mxfp8-weights GEMM: the default choice, or one kernel variant.
using MxLaunch = cudaError_t (*)(const moe_ep::cuda::Mxfp8WeightsGemm&, cudaStream_t);
// The launch check_mxfp8_weights runs (the default choice unless a variant is checked).
MxLaunch g_mx_check_launch = &moe_ep::cuda::mxfp8_weights_gemm;

// What a check plants in the weights before the run.
enum class MxPlant { kNone, kNanBlock, kInexactBlock, kNanCode, kScaleSweep };

// The kernel against the float64 reference: |y - ref| <= k 2^-24 sum |products| (+ 1e-30),
// the bound of float32 summation (bf16 output: plus its rounding, 2^-8 of |ref| + that
// bound); NaN where the reference is NaN; rows past the last offset untouched; *inexact
// set exactly when a weight value is not a bf16 value.
// kNanBlock: the scale of (expert 0, weight row 5, block 1) is 0xFF. kInexactBlock: the
// scale of (expert 0, weight row 7, block 0) is 0, whose random codes include values below
// bf16's subnormal grid: weight row 7 decodes to NaN for every row of expert 0. kNanCode:
// the code of (expert 0, weight row 9, k 37) is 0x7F (NaN), decoded by the fast path.
// kScaleSweep: expert 0's scale codes run through 3..14 (both sides of the fast decode's
// lower bound, 10) and expert 1's through 130..150: no NaN, no flag (expert 0's outputs, near
// 2^-120, sit under the bound's 1e-30 floor: there only NaN and the flag are checked).
// The launch is g_mx_check_launch.
// planes: x as that many bf16 planes (3: one pass multiplies them all at few rows; a
// launch a plane at more).
void check_mxfp8_weights(const char* name, int64_t n, int64_t k, const std::vector<int>& rows, int64_t extra_rows,
                         bool accumulate, MxPlant plant, uint64_t seed, bool bf16_out = false,
                         bool passes_of_32 = false, int planes = 1) {
  moe_ep::cuda::Mxfp8WeightsGemm p{};
  p.n = n;
  p.k = k;
  p.accumulate = accumulate;
  p.passes_of_32 = passes_of_32;
  const std::vector<int32_t> off = offsets_of(rows);
  const int64_t total_rows = off.back() + extra_rows;
  MxBuffers b = make_mx(p, off, total_rows, seed, planes);
  double* ref = device_alloc<double>(b.y_elems);
  double* bound = device_alloc<double>(b.y_elems);
  if (plant == MxPlant::kNanBlock || plant == MxPlant::kInexactBlock) {
    const uint8_t code = plant == MxPlant::kNanBlock ? 0xFF : 0x00;
    const int64_t at = plant == MxPlant::kNanBlock ? 5 * (k / 32) + 1 : 7 * (k / 32);
    CHECK_CUDA(cudaMemcpy(b.scales + at, &code, 1, cudaMemcpyHostToDevice));
  } else if (plant == MxPlant::kNanCode) {
    const uint8_t code = 0x7F;
    CHECK_CUDA(cudaMemcpy(b.codes + 9 * k + 37, &code, 1, cudaMemcpyHostToDevice));
  } else if (plant == MxPlant::kScaleSweep) {
    const int64_t per_expert = n * (k / 32);
    std::vector<uint8_t> sc(static_cast<size_t>(2 * per_expert));
    for (int64_t i = 0; i < per_expert; ++i) {
      sc[static_cast<size_t>(i)] = static_cast<uint8_t>(3 + i % 12);
      sc[static_cast<size_t>(per_expert + i)] = static_cast<uint8_t>(130 + i % 21);
    }
    CHECK_CUDA(cudaMemcpy(b.scales, sc.data(), sc.size(), cudaMemcpyHostToDevice));
  }
  mxfp8_reference<<<grid_for(b.y_elems), 256>>>(p, total_rows, b.y, ref, bound);
  CHECK_CUDA(cudaGetLastError());
  int32_t* flag = device_alloc<int32_t>(1);
  CHECK_CUDA(cudaMemset(flag, 0, sizeof(int32_t)));
  p.inexact = flag;
  uint16_t* y16 = nullptr;
  if (bf16_out) {
    y16 = device_alloc<uint16_t>(b.y_elems);
    CHECK_CUDA(cudaMemset(y16, 0, b.y_elems * sizeof(uint16_t)));
    p.y_bf16 = y16;
  }
  if (!moe_ep::cuda::mxfp8_weights_gemm_fits(p)) {
    std::printf("check mxfp8 weights %-34s: MISMATCH (the sizes do not fit the kernel)\n", name);
    ++g_failures;
    b.release();
    return;
  }
  CHECK_CUDA(g_mx_check_launch(p, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> y(b.y_elems);
  std::vector<double> r(b.y_elems), bd(b.y_elems);
  CHECK_CUDA(cudaMemcpy(r.data(), ref, r.size() * sizeof(double), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(bd.data(), bound, bd.size() * sizeof(double), cudaMemcpyDeviceToHost));
  if (bf16_out) {
    std::vector<uint16_t> h(b.y_elems);
    CHECK_CUDA(cudaMemcpy(h.data(), y16, h.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < b.y_elems; ++i) {
      y[i] = moe_ep::cpu::bf16_to_float(h[i]);
      // Rows past the last expert: untouched, so still the zeros written before the run.
      if (i / n >= off.back()) y[i] = h[i] == 0 ? static_cast<float>(r[i]) : std::nanf("");
    }
  } else {
    CHECK_CUDA(cudaMemcpy(y.data(), b.y, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  int32_t flagged = 0;
  CHECK_CUDA(cudaMemcpy(&flagged, flag, sizeof flagged, cudaMemcpyDeviceToHost));
  int64_t bad = 0, nans = 0, first = -1;
  const double rel = static_cast<double>(k * planes) * std::ldexp(1.0, -24);
  for (int64_t i = 0; i < b.y_elems; ++i) {
    const bool want_nan = std::isnan(r[i]);
    nans += want_nan ? 1 : 0;
    double tol = rel * bd[i] + 1e-30;
    // bf16 keeps 8 significant bits: its rounding moves a value by at most 2^-8 of it.
    if (bf16_out && i / n < off.back()) tol += std::ldexp(1.0, -8) * (std::fabs(r[i]) + tol);
    const bool ok = want_nan ? std::isnan(y[i]) : (!std::isnan(y[i]) && std::fabs(static_cast<double>(y[i]) - r[i]) <= tol);
    if (!ok && bad++ == 0) first = i;
  }
  // One NaN weight row of expert 0: every row of expert 0 is NaN in that column.
  const bool nan_row = plant == MxPlant::kNanBlock || plant == MxPlant::kInexactBlock || plant == MxPlant::kNanCode;
  const int64_t want_nans = nan_row ? rows[0] : 0;
  if (nans != want_nans) {
    std::printf("check mxfp8 weights %-34s: MISMATCH (%lld NaN outputs expected, the reference has %lld)\n", name,
                static_cast<long long>(want_nans), static_cast<long long>(nans));
    ++g_failures;
  }
  const int32_t want_flag = plant == MxPlant::kInexactBlock ? 1 : 0;
  if (flagged != want_flag) {
    std::printf("check mxfp8 weights %-34s: MISMATCH (the inexact flag is %d, expected %d)\n", name, flagged, want_flag);
    ++g_failures;
  }
  if (bad) {
    std::printf("check mxfp8 weights %-34s: MISMATCH at %lld of %lld (first [%lld, %lld]: %.9g, want %.9g, bound %.3g)\n",
                name, static_cast<long long>(bad), static_cast<long long>(b.y_elems), static_cast<long long>(first / n),
                static_cast<long long>(first % n), y[first], r[first], bd[first]);
    ++g_failures;
  } else {
    std::printf("check mxfp8 weights %-34s: ok (%lld outputs, %lld NaN, flag %d)\n", name,
                static_cast<long long>(b.y_elems), static_cast<long long>(nans), flagged);
  }
  cudaFree(ref);
  cudaFree(bound);
  cudaFree(flag);
  cudaFree(y16);
  b.release();
}

// The kernel at the decode shape against a device copy: the read rate of the codes and
// scales, as a fraction of the copy's (read + write) bandwidth; and the bf16 grouped GEMM
// on the same shape (its weights 2 bytes an element) for comparison; `launch` runs the
// kernel (a variant's, for the variant timings, which skip the bf16 GEMM: with_bf16).
// planes: x as that many bf16 planes (launch mxfp8_weights_gemm_plane_by_plane for a launch a
// plane).
void time_mxfp8_weights(const char* name, int64_t n, int64_t k, const std::vector<int>& rows, int sm_count,
                        bool passes_of_32 = false, MxLaunch launch = &moe_ep::cuda::mxfp8_weights_gemm,
                        bool with_bf16 = true, int planes = 1) {
  moe_ep::cuda::Mxfp8WeightsGemm p{};
  p.n = n;
  p.k = k;
  p.passes_of_32 = passes_of_32;
  const int experts = static_cast<int>(rows.size());
  const std::vector<int32_t> off = offsets_of(rows);
  MxBuffers b = make_mx(p, off, off.back(), 11, planes);
  const int warmup = 3, iters = 20;
  cudaEvent_t t0, t1;
  CHECK_CUDA(cudaEventCreate(&t0));
  CHECK_CUDA(cudaEventCreate(&t1));
  auto timed = [&](auto&& fn) {
    for (int i = 0; i < warmup; ++i) fn();
    CHECK_CUDA(cudaEventRecord(t0));
    for (int i = 0; i < iters; ++i) fn();
    CHECK_CUDA(cudaEventRecord(t1));
    CHECK_CUDA(cudaEventSynchronize(t1));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
    return static_cast<double>(ms) / iters;
  };
  const double ms = timed([&] { CHECK_CUDA(launch(p, 0)); });
  uint8_t* copy = device_alloc<uint8_t>(b.code_bytes);
  const double copy_ms =
      timed([&] { CHECK_CUDA(cudaMemcpyAsync(copy, b.codes, b.code_bytes, cudaMemcpyDeviceToDevice, 0)); });
  const double read_bytes = static_cast<double>(b.code_bytes + b.scale_bytes);
  const double copy_bw = 2.0 * static_cast<double>(b.code_bytes) / (copy_ms * 1e-3);  // read + write
  const double read_ms = read_bytes / copy_bw * 1e3;
  int lo = rows[0], hi = rows[0];
  for (int v : rows) lo = std::min(lo, v), hi = std::max(hi, v);
  std::printf("time  mxfp8 weights %-24s experts=%d rows=%d (%d..%d an expert) n=%lld k=%lld: %.4f ms; weight read "
              "(codes + scales at the copy's %.2f TB/s) %.4f ms: %.3f of the weight-read roofline\n",
              name, experts, off.back(), lo, hi, static_cast<long long>(n), static_cast<long long>(k), ms,
              copy_bw / 1e12, read_ms, read_ms / ms);
  cudaFree(copy);
  CHECK_CUDA(cudaEventDestroy(t0));
  CHECK_CUDA(cudaEventDestroy(t1));
  b.release();
  if (with_bf16 && lo == hi) time_shape(name, GemmLayout::kNN, 0, n, k, experts, lo, sm_count);  // the bf16 GEMM
}

// Kernel variants <kMaxNt, kStages, kMinBlocks> at the decode shapes, the one the decode
// picks (<6, 2, 3>) alternated with the others (clocks drift over a run).
struct MxVariant {
  const char* name;
  MxLaunch launch;
};
const MxVariant kMxVariants[] = {
    {"<6,2,3> few rows", &moe_ep::cuda::mxfp8_weights_gemm_launch<moe_ep::cuda::mxw::FewRowsConfig>},
    {"<8,3,2> default", &moe_ep::cuda::mxfp8_weights_gemm_launch<moe_ep::cuda::mxw::DefaultConfig>},
    {"<6,3,2> few rows, long K", &moe_ep::cuda::mxfp8_weights_gemm_launch<moe_ep::cuda::mxw::FewRowsLongKConfig>},
    {"<6,2,3> few rows", &moe_ep::cuda::mxfp8_weights_gemm_launch<moe_ep::cuda::mxw::FewRowsConfig>},
};

// --mxfp8-weights-profile: one launch of each variant at FC1's decode shape with the
// routing's spread, nothing else (for a profiler: ncu -k regex:mxfp8_weights_gemm).
void mxfp8_weights_profile_launches() {
  moe_ep::cuda::Mxfp8WeightsGemm p{};
  p.n = 4096;
  p.k = 7168;
  const std::vector<int> rows = spread_rows(1024);
  const std::vector<int32_t> off = offsets_of(rows);
  MxBuffers b = make_mx(p, off, off.back(), 11);
  for (int i = 0; i < 3; ++i) {  // the first three: each kernel once
    CHECK_CUDA(kMxVariants[i].launch(p, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("profiled launch %d: %s\n", i, kMxVariants[i].name);
  }
  b.release();
}

void mxfp8_weights_checks(bool timing, int sm_count) {
  const std::vector<int> ragged = {0, 1, 33, 0, 70, 7, 32, 45, 0, 129};
  for (bool acc : {false, true}) check_mxfp8_weights("ragged", 256, 512, ragged, 5, acc, MxPlant::kNone, 21);
  check_mxfp8_weights("ragged, bf16 output", 256, 512, ragged, 5, false, MxPlant::kNone, 25, true);
  check_mxfp8_weights("ragged, 32-row passes", 256, 512, ragged, 5, true, MxPlant::kNone, 27, false, true);
  check_mxfp8_weights("ragged, a NaN scale block", 128, 1024, {17, 3, 40}, 0, false, MxPlant::kNanBlock, 22);
  check_mxfp8_weights("ragged, an inexact block", 128, 1024, {40, 3, 17}, 0, false, MxPlant::kInexactBlock, 26);
  check_mxfp8_weights("ragged, a NaN code", 128, 1024, {40, 3, 17}, 0, false, MxPlant::kNanCode, 28);
  check_mxfp8_weights("scale codes 3..14 and 130..150", 128, 1024, {33, 50, 9}, 2, true, MxPlant::kScaleSweep, 29);
  check_mxfp8_weights("32-row passes, scale sweep", 256, 512, {50, 33, 17}, 0, false, MxPlant::kScaleSweep, 30,
                      false, true);
  check_mxfp8_weights("decode FC2 shape, 4 experts", 7168, 2048, {32, 31, 1, 64}, 0, false, MxPlant::kNone, 23);
  check_mxfp8_weights("all experts empty", 128, 128, {0, 0, 0}, 3, false, MxPlant::kNone, 24);
  // K = 384: three 128-k stages, an odd count for the picked 2-stage ring (also with --no-time).
  check_mxfp8_weights("ragged, k 384", 128, 384, {9, 50, 0, 17}, 1, true, MxPlant::kNone, 38);
  // Three x planes: one pass at few rows (Planes3Config), a launch a plane at more.
  check_mxfp8_weights("3 planes, few rows", 256, 512, {20, 0, 42, 1, 33}, 3, false, MxPlant::kNone, 47, false, false, 3);
  check_mxfp8_weights("3 planes, few rows, accumulate", 256, 512, {20, 0, 42, 1, 33}, 3, true, MxPlant::kNone, 48, false,
                      false, 3);
  check_mxfp8_weights("3 planes, a NaN code", 128, 1024, {40, 3, 17}, 0, false, MxPlant::kNanCode, 49, false, false, 3);
  check_mxfp8_weights("3 planes, an inexact block", 128, 1024, {40, 3, 17}, 0, false, MxPlant::kInexactBlock, 50,
                      false, false, 3);
  check_mxfp8_weights("3 planes, many rows", 256, 512, {70, 9, 129}, 2, true, MxPlant::kNone, 51, false, false, 3);
  check_mxfp8_weights("3 planes, decode FC2 shape", 7168, 2048, {32, 31, 1, 40}, 0, false, MxPlant::kNone, 52, false,
                      false, 3);
  if (!timing) return;
  // DeepSeek-V3 per rank at 128 tokens, top-8: 32 local experts, 1024 rows.
  time_mxfp8_weights("FC1 (decode)", 4096, 7168, std::vector<int>(32, 32), sm_count);
  time_mxfp8_weights("FC2 (decode)", 7168, 2048, std::vector<int>(32, 32), sm_count);
  time_mxfp8_weights("FC1 (decode, spread)", 4096, 7168, spread_rows(1024), sm_count);
  time_mxfp8_weights("FC2 (decode, spread)", 7168, 2048, spread_rows(1024), sm_count);
  time_mxfp8_weights("FC1 (spread, 32-row passes)", 4096, 7168, spread_rows(1024), sm_count, true);
  time_mxfp8_weights("FC1 (48 rows)", 4096, 7168, std::vector<int>(32, 48), sm_count);
  time_mxfp8_weights("FC1 (64 rows)", 4096, 7168, std::vector<int>(32, 64), sm_count);
  // The variants (kMxVariants): each one's own checks first (the ragged and decode-shape ones).
  for (const MxVariant& v : kMxVariants) {
    g_mx_check_launch = v.launch;
    const std::string label = std::string("variant ") + v.name;
    check_mxfp8_weights(label.c_str(), 256, 512, {0, 1, 33, 0, 70, 7, 32, 45, 0, 129}, 5, true, MxPlant::kNone, 31);
    check_mxfp8_weights((label + ", NaN code").c_str(), 128, 1024, {40, 3, 17}, 0, false, MxPlant::kNanCode, 32);
    check_mxfp8_weights((label + ", bf16 output").c_str(), 256, 512, {0, 1, 33, 0, 70, 7, 32, 45, 0, 129}, 5, false,
                        MxPlant::kNone, 34, true);
    check_mxfp8_weights((label + ", an inexact block").c_str(), 128, 1024, {40, 3, 17}, 0, false,
                        MxPlant::kInexactBlock, 35);
    check_mxfp8_weights((label + ", scale sweep").c_str(), 128, 1024, {33, 50, 9}, 2, true, MxPlant::kScaleSweep, 36);
    check_mxfp8_weights((label + ", FC2 shape").c_str(), 7168, 2048, {32, 31, 1, 64}, 0, false, MxPlant::kNone, 33);
    // K = 384: three 128-k stages, an odd count for the 2-stage ring (ran in runs 58 and 60).
    check_mxfp8_weights((label + ", k 384").c_str(), 128, 384, {9, 50, 0, 17}, 1, true, MxPlant::kNone, 37);
  }
  g_mx_check_launch = &moe_ep::cuda::mxfp8_weights_gemm;
  // FC2 of a float32 or mxfp8 intermediate (three bf16 planes) at the spread: one pass for
  // the three planes against a launch a plane, alternated.
  for (int i = 0; i < 2; ++i) {
    time_mxfp8_weights("FC2 spread, 3 planes apart", 7168, 2048, spread_rows(1024), sm_count, false,
                       &moe_ep::cuda::mxfp8_weights_gemm_plane_by_plane, false, 3);
    time_mxfp8_weights("FC2 spread, 3 planes, one pass", 7168, 2048, spread_rows(1024), sm_count, false,
                       &moe_ep::cuda::mxfp8_weights_gemm, false, 3);
  }
  for (const MxVariant& v : kMxVariants) {
    for (const bool fc1 : {true, false}) {
      const std::string label = std::string(fc1 ? "FC1 spread " : "FC2 spread ") + v.name;
      time_mxfp8_weights(label.c_str(), fc1 ? 4096 : 7168, fc1 ? 7168 : 2048, spread_rows(1024), sm_count, false,
                         v.launch, false);
    }
  }
}

// ------------------------------------------------------------------ nvfp4 weights (--nvfp4-weights)

using moe_ep::cuda::Nvfp4WeightsGemm;

// A 64-bit hash of (seed, i) (random_bf16's mix, all 64 bits kept).
__host__ __device__ inline uint64_t hash64(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  return x;
}

// Random nvfp4 weights: code bytes (two E2M1 codes each) uniform over all 256; scale codes
// uniform over 0x20..0x3F (E4M3 0.125 .. 1.875: positive and below 2, the kernel's fast
// decode; the range amax / 6 scales mostly take). The checks plant the other scale codes
// (plant_nvfp4_specials).
__global__ void fill_nvfp4(uint8_t* codes, int64_t n_codes, uint8_t* scales, int64_t n_scales, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_codes; i += stride)
    codes[i] = static_cast<uint8_t>(hash64(seed, static_cast<uint64_t>(i)) >> 24);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n_scales; i += stride)
    scales[i] = static_cast<uint8_t>(0x20 + (hash64(seed + 99, static_cast<uint64_t>(i)) >> 40) % 32);
}

// The exact value of element k of an nvfp4 weight row (codes: k / 2 bytes, element 2 j in the
// low nibble of byte j; scales: one E4M3 code a 16-block): E2M1 * E4M3, NaN for a scale code
// 0x7F / 0xFF. Table and field decode, independent of the kernel's bit moves.
__device__ double nvfp4_exact(const uint8_t* codes, const uint8_t* scales, int64_t k) {
  const uint8_t sc = scales[k / 16];
  if ((sc & 0x7F) == 0x7F) return nan("");
  const int ex = (sc >> 3) & 0xF, man = sc & 7;
  const double sm = ex == 0 ? ldexp(static_cast<double>(man), -9) : ldexp(8.0 + man, ex - 10);
  const double s = (sc & 0x80) ? -sm : sm;
  const uint8_t byte = codes[k / 2];
  const int nib = (k & 1) ? (byte >> 4) : (byte & 0xF);
  const double e2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const double v = (nib & 8) ? -e2m1[nib & 7] : e2m1[nib & 7];
  return v * s;
}

// y[r, n] = sum_k x[r, k] W_e[n, k] (summed over the x planes) in float64, and the sum of
// |products|; NaN where weight row n of the row's expert has a NaN scale block; rows past
// the last offset: ref = the old y (untouched), bound 0.
__global__ void nvfp4_reference(Nvfp4WeightsGemm p, int64_t rows, const float* y0, double* ref, double* bound) {
  const int64_t total = rows * p.n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / p.n, n = idx % p.n;
    if (r >= p.off[p.num_experts]) {
      ref[idx] = y0[idx];
      bound[idx] = 0.0;
      continue;
    }
    const int e = group_of_row(p.off, p.num_experts, r);
    const uint8_t* c = p.codes + (static_cast<int64_t>(e) * p.n + n) * (p.k / 2);
    const uint8_t* sc = p.scales + (static_cast<int64_t>(e) * p.n + n) * (p.k / 16);
    double s = 0.0, b = 0.0;
    bool nan_weight = false;
    const int planes = p.x_planes > 1 ? p.x_planes : 1;
    for (int64_t k = 0; k < p.k; ++k) {
      const double w = nvfp4_exact(c, sc, k);
      if (isnan(w)) {
        nan_weight = true;
        continue;
      }
      for (int pl = 0; pl < planes; ++pl) {
        const double prod = static_cast<double>(bf16_to_float(p.x[pl * p.x_plane_stride + r * p.k + k])) * w;
        s += prod;
        b += fabs(prod);
      }
    }
    ref[idx] = nan_weight ? nan("") : (p.accumulate ? static_cast<double>(y0[idx]) : 0.0) + s;
    bound[idx] = b;
  }
}

// The x rows, the weights (codes, then the scales, in one allocation: the timings copy both
// with one device copy), the offsets and y of an nvfp4 run.
struct NvBuffers {
  uint16_t* x = nullptr;
  uint8_t* weights = nullptr;  // codes [E, N, K / 2], then scales [E, N, K / 16]
  int32_t* off = nullptr;
  float* y = nullptr;
  int64_t x_elems = 0, code_bytes = 0, scale_bytes = 0, y_elems = 0;
  uint8_t* codes() const { return weights; }
  uint8_t* scales() const { return weights + code_bytes; }
  void release() {
    cudaFree(x); cudaFree(weights); cudaFree(off); cudaFree(y);
    *this = NvBuffers{};
  }
};

// planes: x as that many bf16 planes of [rows, k] (p.x_planes, p.x_plane_stride). y: random.
NvBuffers make_nv(Nvfp4WeightsGemm& p, const std::vector<int32_t>& off, int64_t rows, uint64_t seed, int planes = 1) {
  NvBuffers b;
  const int64_t E = static_cast<int64_t>(off.size()) - 1;
  b.x_elems = planes * rows * p.k;
  p.x_planes = planes;
  p.x_plane_stride = rows * p.k;
  b.code_bytes = E * p.n * (p.k / 2);  // a multiple of 64 (n % 128 == 0): the scales stay 8-byte aligned
  b.scale_bytes = E * p.n * (p.k / 16);
  b.y_elems = rows * p.n;
  p.total_rows = rows;
  b.x = device_alloc<uint16_t>(b.x_elems);
  b.weights = device_alloc<uint8_t>(b.code_bytes + b.scale_bytes);
  b.off = device_alloc<int32_t>(off.size());
  b.y = device_alloc<float>(b.y_elems);
  CHECK_CUDA(cudaMemcpy(b.off, off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill_bf16<<<grid_for(b.x_elems), 256>>>(b.x, b.x_elems, seed * 3 + 1);
  fill_nvfp4<<<grid_for(b.code_bytes), 256>>>(b.codes(), b.code_bytes, b.scales(), b.scale_bytes, seed * 3 + 2);
  fill_float<<<grid_for(b.y_elems), 256>>>(b.y, b.y_elems, seed * 3 + 3, 0.0f, true);
  CHECK_CUDA(cudaGetLastError());
  p.x = b.x;
  p.codes = b.codes();
  p.scales = b.scales();
  p.off = b.off;
  p.y = b.y;
  p.num_experts = static_cast<int>(E);
  return b;
}

// A launch of the nvfp4-weights GEMM: the default choice, or one kernel variant.
using NvLaunch = cudaError_t (*)(const Nvfp4WeightsGemm&, cudaStream_t);

// p's x planes as a launch a plane through nvfp4_weights_gemm (x_planes 1, the later ones
// accumulating): what the timings compare the one-pass three-plane kernel with at few rows.
cudaError_t nvfp4_plane_by_plane(const Nvfp4WeightsGemm& p, cudaStream_t stream) {
  Nvfp4WeightsGemm one = p;
  one.x_planes = 1;
  for (int pl = 0; pl < (p.x_planes > 1 ? p.x_planes : 1); ++pl) {
    one.x = p.x + pl * p.x_plane_stride;
    one.accumulate = p.accumulate || pl > 0;
    const cudaError_t err = moe_ep::cuda::nvfp4_weights_gemm(one, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// "<kMaxNt,kStages,kMinBlocks>" (",3" more for three planes) of a kernel variant.
template <class Cfg>
std::string config_name() {
  char s[32];
  std::snprintf(s, sizeof(s), "<%d,%d,%d%s>", Cfg::kMaxNt, Cfg::kStages, Cfg::kMinBlocks, Cfg::kPlanes == 3 ? ",3" : "");
  return s;
}

// What nvfp4_weights_gemm runs for p (its choice, restated for the labels): the variant for
// the rows an expert on average (Nvfp4WeightsGemm::total_rows) and K, or a launch a plane.
std::string nvfp4_auto_pick(const Nvfp4WeightsGemm& p) {
  namespace nvw = moe_ep::cuda::nvw;
  const bool few =
      p.total_rows > 0 && p.total_rows <= moe_ep::cuda::mxw::kFewRowsPerExpert * static_cast<int64_t>(p.num_experts);
  if (p.x_planes == 3) return few ? "auto: " + config_name<nvw::Planes3Config>() : "auto: 3 x " + config_name<nvw::DefaultConfig>();
  return "auto: " + (few && p.k < moe_ep::cuda::mxw::kLongK ? config_name<nvw::FewRowsConfig>()
                                                             : config_name<nvw::DefaultConfig>());
}

// The kernel variants (nvfp4_weights_gemm_launch<Cfg>), each with the mxfp8-weights kernel's
// variant of the same role (the timings' comparison) and the x planes it takes.
struct NvVariant {
  std::string name;
  NvLaunch launch;
  int planes;
  std::string mx_name;
  MxLaunch mx_launch;
};
std::vector<NvVariant> nv_variants() {
  namespace cu = moe_ep::cuda;
  return {
      {config_name<cu::nvw::FewRowsConfig>() + " few rows", &cu::nvfp4_weights_gemm_launch<cu::nvw::FewRowsConfig>, 1,
       config_name<cu::mxw::FewRowsConfig>() + " few rows", &cu::mxfp8_weights_gemm_launch<cu::mxw::FewRowsConfig>},
      {config_name<cu::nvw::DefaultConfig>() + " default", &cu::nvfp4_weights_gemm_launch<cu::nvw::DefaultConfig>, 1,
       config_name<cu::mxw::DefaultConfig>() + " default", &cu::mxfp8_weights_gemm_launch<cu::mxw::DefaultConfig>},
      {config_name<cu::nvw::Planes3Config>() + " 3 planes", &cu::nvfp4_weights_gemm_launch<cu::nvw::Planes3Config>, 3,
       config_name<cu::mxw::Planes3Config>() + " 3 planes", &cu::mxfp8_weights_gemm_launch<cu::mxw::Planes3Config>},
  };
}

// What a check plants in the weights (plant_nvfp4_specials), in every expert and every
// block of 128 weight rows, at these rows of the block (rr = weight row % 128):
constexpr int kNvRowHalvesMixed = 2;      // code bytes 0x91: +0.5, -0.5 (E2M1 1 and 9: the bf16-subnormal step)
constexpr int kNvRowHalvesPlus = 3;       // code bytes 0x11: +0.5 everywhere
constexpr int kNvRowHalvesMinus = 4;      // code bytes 0x99: -0.5 everywhere
constexpr int kNvRowNegScales = 10;       // scale codes 0xA0..0xBF (negative, below 2: the fast decode)
constexpr int kNvRowZeroScales = 11;      // scale codes 0x00 and 0x80 (+0, -0): every output of the row 0
constexpr int kNvRowSubScales = 12;       // scale codes 0x01..0x07, 0x81..0x87 (E4M3 subnormals)
constexpr int kNvRowSweep = 13;           // from here the 128 scale codes below 2 in turn (16 rows at most)
constexpr int kNvSlowRow0 = 32;           // rows 32..63 (warp 1): in stage nvfp4_slow_stage every other scale
                                          // code 2 or more (0x40..0x7E, 0xC0..0xFE, each at least twice), the
                                          // others the 128 below 2: the warp's slow decode
constexpr int kNvRowSlowPlus = 40;        // code bytes 0x11 in the slow warp
constexpr int kNvRowSlowMinus = 41;       // code bytes 0x99 in the slow warp
constexpr int kNvRowNan7F = 100;          // scale code 0x7F at block 1 (warp 3: its stage 0 on the slow decode)
constexpr int kNvRowNanFF = 101;          // scale code 0xFF at the last block (and its stage)

// The stage (128 k) whose slow-warp scales are planted: the second when there is one.
int64_t nvfp4_slow_stage(int64_t k) { return k / 128 > 1 ? 1 : 0; }
// The i-th (mod 128) E4M3 code below 2 in magnitude (0x00..0x3F, 0x80..0xBF) and the i-th
// (mod 126) of 2 or more, not NaN (0x40..0x7E, 0xC0..0xFE).
uint8_t small_scale_code(int64_t i) {
  i %= 128;
  return static_cast<uint8_t>(i < 64 ? i : 0x80 + (i - 64));
}
uint8_t big_scale_code(int64_t i) {
  i %= 126;
  return static_cast<uint8_t>(i < 63 ? 0x40 + i : 0xC0 + (i - 63));
}

void plant_nvfp4_specials(std::vector<uint8_t>& codes, std::vector<uint8_t>& scales, int64_t experts, int64_t n,
                          int64_t k) {
  const int64_t kb = k / 16, kh = k / 2, slow = nvfp4_slow_stage(k);
  const int64_t sweep_rows = (128 + kb - 1) / kb;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t nb = 0; nb < n; nb += 128) {
      auto code_row = [&](int rr) { return codes.data() + (e * n + nb + rr) * kh; };
      auto scale_row = [&](int rr) { return scales.data() + (e * n + nb + rr) * kb; };
      std::memset(code_row(kNvRowHalvesMixed), 0x91, static_cast<size_t>(kh));
      std::memset(code_row(kNvRowHalvesPlus), 0x11, static_cast<size_t>(kh));
      std::memset(code_row(kNvRowHalvesMinus), 0x99, static_cast<size_t>(kh));
      std::memset(code_row(kNvRowSlowPlus), 0x11, static_cast<size_t>(kh));
      std::memset(code_row(kNvRowSlowMinus), 0x99, static_cast<size_t>(kh));
      for (int64_t b = 0; b < kb; ++b) {
        scale_row(kNvRowNegScales)[b] = static_cast<uint8_t>(0xA0 + b % 32);
        scale_row(kNvRowZeroScales)[b] = static_cast<uint8_t>(b % 2 ? 0x80 : 0x00);
        scale_row(kNvRowSubScales)[b] = static_cast<uint8_t>((b % 2 ? 0x80 : 0x00) + 1 + (b / 2) % 7);
      }
      for (int64_t i = 0; i < sweep_rows * kb; ++i)
        scale_row(kNvRowSweep + static_cast<int>(i / kb))[i % kb] = small_scale_code(i);
      for (int rr = kNvSlowRow0; rr < kNvSlowRow0 + 32; ++rr)
        for (int64_t j = 0; j < 8; ++j) {
          const int64_t i = (rr - kNvSlowRow0) * 8 + j;  // 0..255
          scale_row(rr)[8 * slow + j] = i % 2 == 0 ? big_scale_code(i / 2) : small_scale_code(i / 2);
        }
      scale_row(kNvRowNan7F)[1] = 0x7F;
      scale_row(kNvRowNanFF)[kb - 1] = 0xFF;
    }
}

// What plant_nvfp4_specials put in weight row n (for a mismatch's line).
std::string nvfp4_row_plant(int64_t n, int64_t k, bool specials) {
  if (!specials) return "random codes and scales";
  const int rr = static_cast<int>(n % 128);
  const int64_t kb = k / 16, sweep_rows = (128 + kb - 1) / kb;
  char s[160];
  const long long slow = static_cast<long long>(nvfp4_slow_stage(k));
  switch (rr) {
    case kNvRowHalvesMixed: return "code bytes 0x91 (E2M1 +0.5, -0.5), random scales";
    case kNvRowHalvesPlus: return "code bytes 0x11 (E2M1 +0.5), random scales";
    case kNvRowHalvesMinus: return "code bytes 0x99 (E2M1 -0.5), random scales";
    case kNvRowNegScales: return "scale codes 0xA0..0xBF (negative)";
    case kNvRowZeroScales: return "scale codes 0x00 / 0x80 (+-0)";
    case kNvRowSubScales: return "scale codes 0x01..0x07 / 0x81..0x87 (E4M3 subnormals)";
    case kNvRowNan7F: return "scale code 0x7F (NaN) at block 1";
    case kNvRowNanFF: return "scale code 0xFF (NaN) at the last block";
    case kNvRowSlowPlus:
    case kNvRowSlowMinus:
      std::snprintf(s, sizeof(s), "code bytes %s; scale codes >= 2 and < 2 alternating in stage %lld (slow decode)",
                    rr == kNvRowSlowPlus ? "0x11 (+0.5)" : "0x99 (-0.5)", slow);
      return s;
    default: break;
  }
  if (rr >= kNvRowSweep && rr < kNvRowSweep + sweep_rows) return "the sweep of the 128 scale codes below 2";
  if (rr >= kNvSlowRow0 && rr < kNvSlowRow0 + 32) {
    std::snprintf(s, sizeof(s), "scale codes >= 2 and < 2 alternating in stage %lld (the warp's slow decode there)", slow);
    return s;
  }
  return "random codes and scales";
}

// The nvfp4-weights kernel (`launch`; nullptr: nvfp4_weights_gemm, the default choice) against
// the float64 reference: |y - ref| <= k planes 2^-24 sum |products| (+ 2^-21 (|ref| + sum
// |products|) with accumulate: the added old y; + 1e-30), the bound of float32 summation
// in another order (bf16 output: plus its rounding, 2^-8 of |ref| + that bound); NaN
// exactly where the weight row of the output's expert has a NaN scale block, read off the
// scale bytes on the host (and the reference must agree); rows past the last offset
// untouched. specials: plant_nvfp4_specials's weights (every scale code, both decodes,
// E2M1 +-0.5, NaN blocks), else fill_nvfp4's alone. planes: x as that many bf16 planes.
void check_nvfp4_weights(const char* name, int64_t n, int64_t k, const std::vector<int>& rows, int64_t extra_rows,
                         bool accumulate, bool specials, uint64_t seed, bool bf16_out = false, int planes = 1,
                         NvLaunch launch = nullptr, const char* launch_name = nullptr) {
  Nvfp4WeightsGemm p{};
  p.n = n;
  p.k = k;
  p.accumulate = accumulate;
  const std::vector<int32_t> off = offsets_of(rows);
  const int64_t total_rows = off.back() + extra_rows;
  NvBuffers b = make_nv(p, off, total_rows, seed, planes);
  const std::string which = launch == nullptr ? nvfp4_auto_pick(p) : std::string(launch_name);
  char label[256];
  std::snprintf(label, sizeof(label), "check nvfp4 weights %-44s [%s] experts=%d rows=%lld n=%lld k=%lld%s%s%s%s",
                name, which.c_str(), p.num_experts, static_cast<long long>(total_rows), static_cast<long long>(n),
                static_cast<long long>(k), planes == 3 ? " 3 planes" : "", accumulate ? " accumulate" : "",
                bf16_out ? " bf16 out" : "", specials ? " specials" : "");
  const int64_t E = p.num_experts;
  std::vector<uint8_t> codes(static_cast<size_t>(b.code_bytes)), scales(static_cast<size_t>(b.scale_bytes));
  CHECK_CUDA(cudaMemcpy(codes.data(), b.codes(), codes.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(scales.data(), b.scales(), scales.size(), cudaMemcpyDeviceToHost));
  if (specials) {
    plant_nvfp4_specials(codes, scales, E, n, k);
    CHECK_CUDA(cudaMemcpy(b.codes(), codes.data(), codes.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(b.scales(), scales.data(), scales.size(), cudaMemcpyHostToDevice));
  }
  // What the weights of the experts with rows hold: the distinct scale codes and code bytes,
  // the warp-stages (32 weight rows x 128 k) the kernel decodes slowly (a scale code of 2 or
  // more, or NaN), and the weight rows with a NaN scale block (their outputs must be NaN).
  const int64_t kb = k / 16, kh = k / 2;
  bool scale_seen[256] = {}, code_seen[256] = {};
  int64_t slow_stages = 0, all_stages = 0;
  std::vector<char> nan_row(static_cast<size_t>(E * n), 0);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t c = 0; c < n; ++c)
      for (int64_t j = 0; j < kb; ++j)
        if ((scales[static_cast<size_t>((e * n + c) * kb + j)] & 0x7F) == 0x7F) nan_row[static_cast<size_t>(e * n + c)] = 1;
    if (rows[static_cast<size_t>(e)] == 0) continue;
    for (int64_t i = e * n * kb; i < (e + 1) * n * kb; ++i) scale_seen[scales[static_cast<size_t>(i)]] = true;
    for (int64_t i = e * n * kh; i < (e + 1) * n * kh; ++i) code_seen[codes[static_cast<size_t>(i)]] = true;
    for (int64_t w0 = 0; w0 < n; w0 += 32)
      for (int64_t s = 0; s < k / 128; ++s) {
        bool slow = false;
        for (int64_t c = w0; c < w0 + 32; ++c)
          for (int64_t j = 8 * s; j < 8 * s + 8; ++j) slow |= (scales[static_cast<size_t>((e * n + c) * kb + j)] & 0x40) != 0;
        slow_stages += slow ? 1 : 0;
        ++all_stages;
      }
  }
  const int scale_codes = static_cast<int>(std::count(scale_seen, scale_seen + 256, true));
  const int code_bytes = static_cast<int>(std::count(code_seen, code_seen + 256, true));
  double* ref = device_alloc<double>(b.y_elems);
  double* bound = device_alloc<double>(b.y_elems);
  nvfp4_reference<<<grid_for(b.y_elems), 256>>>(p, total_rows, b.y, ref, bound);
  CHECK_CUDA(cudaGetLastError());
  uint16_t* y16 = nullptr;
  const uint16_t kSentinel = 0x5A5A;  // bf16 output before the run (about 1.5e16): rows past the last offset keep it
  if (bf16_out) {
    y16 = device_alloc<uint16_t>(b.y_elems);
    CHECK_CUDA(cudaMemset(y16, 0x5A, b.y_elems * sizeof(uint16_t)));
    p.y_bf16 = y16;
  }
  auto done = [&] {
    cudaFree(ref);
    cudaFree(bound);
    cudaFree(y16);
    b.release();
  };
  if (!moe_ep::cuda::nvfp4_weights_gemm_fits(p)) {
    std::printf("%s: MISMATCH (nvfp4_weights_gemm_fits is false for these sizes)\n", label);
    ++g_failures;
    done();
    return;
  }
  CHECK_CUDA(cudaDeviceSynchronize());  // the fills, plants and reference done before the run
  const cudaError_t err = launch == nullptr ? moe_ep::cuda::nvfp4_weights_gemm(p, 0) : launch(p, 0);
  if (err != cudaSuccess) {
    std::printf("%s: MISMATCH (launch: %s)\n", label, cudaGetErrorName(err));
    ++g_failures;
    done();
    return;
  }
  const cudaError_t run_err = cudaDeviceSynchronize();
  if (run_err != cudaSuccess) {
    std::printf("%s: CUDA error %s in the run (the device is unusable: stopping)\n", label, cudaGetErrorName(run_err));
    std::exit(2);
  }
  std::vector<float> y(static_cast<size_t>(b.y_elems));
  std::vector<uint16_t> h16;
  std::vector<double> r(static_cast<size_t>(b.y_elems)), bd(static_cast<size_t>(b.y_elems));
  CHECK_CUDA(cudaMemcpy(r.data(), ref, r.size() * sizeof(double), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(bd.data(), bound, bd.size() * sizeof(double), cudaMemcpyDeviceToHost));
  if (bf16_out) {
    h16.resize(static_cast<size_t>(b.y_elems));
    CHECK_CUDA(cudaMemcpy(h16.data(), y16, h16.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < h16.size(); ++i) y[i] = moe_ep::cpu::bf16_to_float(h16[i]);
  } else {
    CHECK_CUDA(cudaMemcpy(y.data(), b.y, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  const double rel = static_cast<double>(k * planes) * std::ldexp(1.0, -24);
  int64_t bad = 0, nans = 0, ref_disagree = 0, first_ref_disagree = -1;
  std::vector<int64_t> shown;  // the first mismatches
  std::vector<double> shown_tol;
  for (int64_t i = 0; i < b.y_elems; ++i) {
    const int64_t row = i / n, col = i % n;
    bool ok;
    double tol = 0.0;
    if (row >= off.back()) {  // past the last expert: untouched
      ok = bf16_out ? h16[static_cast<size_t>(i)] == kSentinel
                    : static_cast<double>(y[static_cast<size_t>(i)]) == r[static_cast<size_t>(i)];
    } else {
      const int e = static_cast<int>(std::upper_bound(off.begin(), off.end(), static_cast<int32_t>(row)) - off.begin()) - 1;
      const bool want_nan = nan_row[static_cast<size_t>(e * n + col)] != 0;
      nans += want_nan ? 1 : 0;
      if (std::isnan(r[static_cast<size_t>(i)]) != want_nan && ref_disagree++ == 0) first_ref_disagree = i;
      tol = rel * bd[static_cast<size_t>(i)] + 1e-30;
      if (accumulate) tol += std::ldexp(1.0, -21) * (std::fabs(r[static_cast<size_t>(i)]) + bd[static_cast<size_t>(i)]);
      // bf16 keeps 8 significant bits: its rounding moves a value by at most 2^-8 of it.
      if (bf16_out) tol += std::ldexp(1.0, -8) * (std::fabs(r[static_cast<size_t>(i)]) + tol);
      const float v = y[static_cast<size_t>(i)];
      ok = want_nan ? std::isnan(v)
                    : (!std::isnan(v) && std::fabs(static_cast<double>(v) - r[static_cast<size_t>(i)]) <= tol);
    }
    if (!ok) {
      if (bad < 3) {
        shown.push_back(i);
        shown_tol.push_back(tol);
      }
      ++bad;
    }
  }
  // The plants reached the kernel: every scale code, every code byte and a slow warp-stage in
  // the experts with rows (a fault of this program where not).
  const bool covered = !specials || off.back() == 0 || (scale_codes == 256 && code_bytes == 256 && slow_stages > 0);
  if (!covered) {
    std::printf("%s: MISMATCH (the planted weights do not cover the cases: %d/256 scale codes, %d/256 code bytes, "
                "%lld slow warp-stages in the experts with rows)\n",
                label, scale_codes, code_bytes, static_cast<long long>(slow_stages));
    ++g_failures;
  }
  if (ref_disagree != 0) {  // the reference's NaN against the scale bytes: a fault of this program, not the kernel
    const int64_t i = first_ref_disagree;
    std::printf("%s: MISMATCH (the float64 reference's NaN outputs disagree with the NaN scale blocks at %lld "
                "outputs, first [row %lld, col %lld]: ref %.9g)\n",
                label, static_cast<long long>(ref_disagree), static_cast<long long>(i / n),
                static_cast<long long>(i % n), r[static_cast<size_t>(i)]);
    ++g_failures;
  }
  if (bad) {
    std::printf("%s: MISMATCH at %lld of %lld outputs\n", label, static_cast<long long>(bad),
                static_cast<long long>(b.y_elems));
    for (size_t s = 0; s < shown.size(); ++s) {
      const int64_t i = shown[s], row = i / n, col = i % n;
      if (row >= off.back()) {
        std::printf("    [row %lld, col %lld] past the last expert's rows (%d): changed, got %.9g (bits %08x / bf16 %04x), "
                    "want it untouched: %.9g\n",
                    static_cast<long long>(row), static_cast<long long>(col), off.back(), y[static_cast<size_t>(i)],
                    moe_ep::cpu::float_bits(y[static_cast<size_t>(i)]), bf16_out ? h16[static_cast<size_t>(i)] : 0,
                    bf16_out ? moe_ep::cpu::bf16_to_float(kSentinel) : r[static_cast<size_t>(i)]);
        continue;
      }
      const int e = static_cast<int>(std::upper_bound(off.begin(), off.end(), static_cast<int32_t>(row)) - off.begin()) - 1;
      std::printf("    [row %lld, col %lld] expert %d (its row %lld of %d), weight row %lld (%s): got %.9g, want %.9g%s, "
                  "|diff| %.3g, bound %.3g (sum |products| %.3g)\n",
                  static_cast<long long>(row), static_cast<long long>(col), e, static_cast<long long>(row - off[e]),
                  rows[static_cast<size_t>(e)], static_cast<long long>(col), nvfp4_row_plant(col, k, specials).c_str(),
                  y[static_cast<size_t>(i)], r[static_cast<size_t>(i)],
                  nan_row[static_cast<size_t>(e * n + col)] ? " (NaN: a NaN scale block)" : "",
                  std::fabs(static_cast<double>(y[static_cast<size_t>(i)]) - r[static_cast<size_t>(i)]), shown_tol[s],
                  bd[static_cast<size_t>(i)]);
    }
    ++g_failures;
  } else if (ref_disagree == 0 && covered) {
    std::printf("%s: ok (%lld outputs, %lld NaN where expected; the experts with rows hold %d/256 scale codes, "
                "%d/256 code bytes, %lld of %lld warp-stages on the slow decode)\n",
                label, static_cast<long long>(b.y_elems), static_cast<long long>(nans), scale_codes, code_bytes,
                static_cast<long long>(slow_stages), static_cast<long long>(all_stages));
  }
  done();
}

// The mean time of one call of fn over 20 calls between CUDA events, after 3 warm-up calls.
template <class Fn>
double mean_ms(Fn&& fn) {
  const int warmup = 3, iters = 20;
  cudaEvent_t t0, t1;
  CHECK_CUDA(cudaEventCreate(&t0));
  CHECK_CUDA(cudaEventCreate(&t1));
  for (int i = 0; i < warmup; ++i) fn();
  CHECK_CUDA(cudaEventRecord(t0));
  for (int i = 0; i < iters; ++i) fn();
  CHECK_CUDA(cudaEventRecord(t1));
  CHECK_CUDA(cudaEventSynchronize(t1));
  float ms = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
  CHECK_CUDA(cudaEventDestroy(t0));
  CHECK_CUDA(cudaEventDestroy(t1));
  return static_cast<double>(ms) / iters;
}

// The nvfp4-weights kernel at one shape (`launch`, named launch_name; nullptr: nvfp4_weights_gemm,
// the default choice) against a device copy of its weight bytes in the same run (codes and
// scales, one copy: the read rate as a fraction of the copy's read + write bandwidth, the
// weight read's roofline), and against the mxfp8-weights kernel on the same shape and rows
// (`mx_launch`, named mx_name; nullptr: mxfp8_weights_gemm), whose weights are about twice
// the bytes. planes: x as that many bf16 planes.
void time_nvfp4_weights(const char* name, int64_t n, int64_t k, const std::vector<int>& rows, NvLaunch launch,
                        const std::string& launch_name, MxLaunch mx_launch, const std::string& mx_name, int planes = 1) {
  const int experts = static_cast<int>(rows.size());
  const std::vector<int32_t> off = offsets_of(rows);
  Nvfp4WeightsGemm p{};
  p.n = n;
  p.k = k;
  NvBuffers b = make_nv(p, off, off.back(), 11, planes);
  const std::string which = launch == nullptr ? nvfp4_auto_pick(p) : launch_name;
  const NvLaunch run = launch == nullptr ? &moe_ep::cuda::nvfp4_weights_gemm : launch;
  const cudaError_t err = run(p, 0);
  if (err != cudaSuccess) {
    std::printf("time  nvfp4 weights %-30s [%s]: FAILED (launch: %s)\n", name, which.c_str(), cudaGetErrorName(err));
    ++g_failures;
    b.release();
    return;
  }
  const double ms = mean_ms([&] { CHECK_CUDA(run(p, 0)); });
  const int64_t bytes = b.code_bytes + b.scale_bytes;
  uint8_t* copy = device_alloc<uint8_t>(bytes);
  const double copy_ms =
      mean_ms([&] { CHECK_CUDA(cudaMemcpyAsync(copy, b.weights, bytes, cudaMemcpyDeviceToDevice, 0)); });
  cudaFree(copy);
  b.release();
  const double copy_bw = 2.0 * static_cast<double>(bytes) / (copy_ms * 1e-3);  // read + write
  const double read_ms = static_cast<double>(bytes) / copy_bw * 1e3;
  moe_ep::cuda::Mxfp8WeightsGemm q{};
  q.n = n;
  q.k = k;
  MxBuffers mb = make_mx(q, off, off.back(), 11, planes);
  const MxLaunch mx_run = mx_launch == nullptr ? &moe_ep::cuda::mxfp8_weights_gemm : mx_launch;
  CHECK_CUDA(mx_run(q, 0));
  const double mx_ms = mean_ms([&] { CHECK_CUDA(mx_run(q, 0)); });
  mb.release();
  int lo = rows[0], hi = rows[0];
  for (int v : rows) lo = std::min(lo, v), hi = std::max(hi, v);
  std::printf("time  nvfp4 weights %-30s [%s] experts=%d rows=%d (%d..%d an expert) n=%lld k=%lld%s: %.4f ms; weight "
              "read (codes + scales at the copy's %.2f TB/s) %.4f ms: %.3f of the weight-read roofline; mxfp8 weights "
              "[%s] %.4f ms: nvfp4 takes %.3f of its time\n",
              name, which.c_str(), experts, off.back(), lo, hi, static_cast<long long>(n), static_cast<long long>(k),
              planes == 3 ? " 3 planes" : "", ms, copy_bw / 1e12, read_ms, read_ms / ms, mx_name.c_str(), mx_ms,
              ms / mx_ms);
}

// --nvfp4-weights-profile: one launch of each variant at FC1's decode shape with the
// routing's spread (the three-plane variant at FC2's, with three x planes), nothing else
// (for a profiler: ncu -k regex:nvfp4_weights_gemm).
void nvfp4_weights_profile_launches() {
  const std::vector<int> rows = spread_rows(1024);
  const std::vector<int32_t> off = offsets_of(rows);
  int i = 0;
  for (const NvVariant& v : nv_variants()) {
    Nvfp4WeightsGemm p{};
    p.n = v.planes == 3 ? 7168 : 4096;
    p.k = v.planes == 3 ? 2048 : 7168;
    NvBuffers b = make_nv(p, off, off.back(), 11, v.planes);
    CHECK_CUDA(v.launch(p, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("profiled launch %d: nvfp4 weights %s, n=%lld k=%lld, %d x planes\n", i++, v.name.c_str(),
                static_cast<long long>(p.n), static_cast<long long>(p.k), v.planes);
    b.release();
  }
}

// The nvfp4-weights GEMM's checks (the default choice, then each variant), then (timing)
// its timings at the decode shapes.
void nvfp4_weights_checks(bool timing) {
  // Empty experts (first, middle, last), one of 1 row, ones past 48 and 64 rows (several
  // passes): 317 rows, few an expert on average (the default choice: the few-rows variant).
  const std::vector<int> ragged = {0, 1, 33, 0, 70, 7, 32, 45, 0, 129};
  // 265 rows over 5 experts: more than 48 an expert on average (the default variant).
  const std::vector<int> many = {70, 0, 129, 1, 65};
  check_nvfp4_weights("ragged, random weights", 256, 512, ragged, 5, false, false, 61);
  for (bool acc : {false, true}) check_nvfp4_weights("ragged", 256, 512, ragged, 5, acc, true, 62);
  check_nvfp4_weights("ragged, bf16 output", 256, 512, ragged, 5, false, true, 63, true);
  for (bool acc : {false, true}) check_nvfp4_weights("many rows", 256, 512, many, 3, acc, true, 64);
  check_nvfp4_weights("many rows, bf16 output", 256, 512, many, 3, false, true, 65, true);
  // K = 384: three 128-k stages (a multiple of 128, not of 256); K = 128: one stage, fewer
  // than the pipeline's depth.
  check_nvfp4_weights("k 384", 128, 384, {9, 50, 0, 17}, 1, true, true, 66);
  check_nvfp4_weights("k 128 (one stage)", 128, 128, {5, 0, 60}, 2, false, true, 67);
  check_nvfp4_weights("decode FC2 shape, 4 experts", 7168, 2048, {32, 31, 1, 64}, 0, false, true, 68);
  check_nvfp4_weights("decode FC1 shape, 2 experts", 4096, 7168, {32, 17}, 0, false, true, 69);
  check_nvfp4_weights("all experts empty", 128, 128, {0, 0, 0}, 3, false, true, 70);
  // Three x planes: one pass at few rows (the three-plane variant), a launch a plane at more.
  check_nvfp4_weights("3 planes, few rows", 256, 512, {20, 0, 42, 1, 33}, 3, false, true, 71, false, 3);
  check_nvfp4_weights("3 planes, few rows, accumulate", 256, 512, {20, 0, 42, 1, 33}, 3, true, true, 72, false, 3);
  check_nvfp4_weights("3 planes, many rows", 256, 512, {70, 9, 129}, 2, false, true, 73, false, 3);
  check_nvfp4_weights("3 planes, many rows, accumulate", 256, 512, {70, 9, 129}, 2, true, true, 74, false, 3);
  check_nvfp4_weights("3 planes, decode FC2 shape", 7168, 2048, {32, 31, 1, 40}, 0, false, true, 75, false, 3);
  // Each variant launched itself, whatever the rows (the three-plane one with three planes).
  for (const NvVariant& v : nv_variants()) {
    const char* vn = v.name.c_str();
    const int pl = v.planes;
    check_nvfp4_weights("variant: ragged", 256, 512, ragged, 5, true, true, 81, false, pl, v.launch, vn);
    check_nvfp4_weights("variant: ragged, random weights", 256, 512, ragged, 5, false, false, 82, false, pl, v.launch, vn);
    if (pl == 1)
      check_nvfp4_weights("variant: ragged, bf16 output", 256, 512, ragged, 5, false, true, 83, true, pl, v.launch, vn);
    check_nvfp4_weights("variant: many rows", 256, 512, many, 3, false, true, 84, false, pl, v.launch, vn);
    check_nvfp4_weights("variant: k 384", 128, 384, {9, 50, 0, 17}, 1, true, true, 85, false, pl, v.launch, vn);
    check_nvfp4_weights("variant: k 128 (one stage)", 128, 128, {5, 0, 60}, 2, false, true, 86, false, pl, v.launch, vn);
    check_nvfp4_weights("variant: decode FC2 shape", 7168, 2048, {32, 31, 1, 64}, 0, false, true, 87, false, pl,
                        v.launch, vn);
    check_nvfp4_weights("variant: all experts empty", 128, 128, {0, 0, 0}, 3, false, true, 88, false, pl, v.launch, vn);
  }
  if (!timing) return;
  // DeepSeek-V3 per rank at 128 tokens, top-8: 32 local experts, 1024 rows (32 an expert, or
  // the routing's spread of 20..42); FC1 n 4096 (2 x intermediate 2048), k 7168 (hidden);
  // FC2 n 7168, k 2048. The default choice first, then each variant (the three-plane one at
  // FC2, the operand it takes: the exact bf16 pieces of a float32 intermediate).
  const std::vector<int> even(32, 32), spread = spread_rows(1024);
  time_nvfp4_weights("FC1 (decode)", 4096, 7168, even, nullptr, "", nullptr, "auto");
  time_nvfp4_weights("FC2 (decode)", 7168, 2048, even, nullptr, "", nullptr, "auto");
  time_nvfp4_weights("FC1 (decode, spread)", 4096, 7168, spread, nullptr, "", nullptr, "auto");
  time_nvfp4_weights("FC2 (decode, spread)", 7168, 2048, spread, nullptr, "", nullptr, "auto");
  for (const NvVariant& v : nv_variants()) {
    for (const bool fc1 : {true, false}) {
      if (fc1 && v.planes == 3) continue;
      for (const bool spread_rows_ : {false, true}) {
        const std::string label = std::string(fc1 ? "FC1" : "FC2") + (spread_rows_ ? " (decode, spread)" : " (decode)");
        time_nvfp4_weights(label.c_str(), fc1 ? 4096 : 7168, fc1 ? 7168 : 2048, spread_rows_ ? spread : even, v.launch,
                           v.name, v.mx_launch, v.mx_name, v.planes);
      }
    }
  }
  // FC2 of three x planes at the spread: a launch a plane against the one pass, twice, alternated.
  for (int i = 0; i < 2; ++i) {
    time_nvfp4_weights("FC2 (spread), 3 planes apart", 7168, 2048, spread, &nvfp4_plane_by_plane, "3 x auto",
                       &moe_ep::cuda::mxfp8_weights_gemm_plane_by_plane, "3 x auto", 3);
    time_nvfp4_weights("FC2 (spread), 3 planes", 7168, 2048, spread, nullptr, "", nullptr, "auto", 3);
  }
}

// --nvfp4-weights-sweep: configurations of the nvfp4-weights kernel beyond the ones it picks,
// timed at the decode's FC1 and FC2 with the routing's spread of rows, as the layer gets them
// (each expert's rows rounded up to 16: the static layout's alignment) and unrounded, against
// the mxfp8-weights kernel's few-rows variant on the same rows: which configuration to pick.
template <class Cfg>
void sweep_nvfp4_config(const char* role, int64_t n, int64_t k, const std::vector<int>& rows, const char* rows_name) {
  namespace cu = moe_ep::cuda;
  const std::string label = std::string(role) + " (" + rows_name + ")";
  time_nvfp4_weights(label.c_str(), n, k, rows, &cu::nvfp4_weights_gemm_launch<Cfg>, config_name<Cfg>(),
                     &cu::mxfp8_weights_gemm_launch<cu::mxw::FewRowsConfig>,
                     config_name<cu::mxw::FewRowsConfig>() + " few rows");
}
void nvfp4_weights_sweep() {
  namespace mxw = moe_ep::cuda::mxw;
  const std::vector<int> spread = spread_rows(1024);
  std::vector<int> aligned = spread;
  for (int& r : aligned) r = (r + 15) / 16 * 16;
  for (const bool fc1 : {true, false}) {
    const char* role = fc1 ? "FC1" : "FC2";
    const int64_t n = fc1 ? 4096 : 7168, k = fc1 ? 7168 : 2048;
    for (int a = 0; a < 2; ++a) {
      const std::vector<int>& rows = a ? spread : aligned;
      const char* name = a ? "spread" : "spread, aligned 16";
      sweep_nvfp4_config<mxw::Config<8, 3, 2>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<6, 2, 3>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<6, 2, 4>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<8, 2, 3>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<6, 3, 3>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<6, 3, 2>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<6, 4, 2>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<8, 4, 2>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<6, 2, 2>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<4, 3, 2>>(role, n, k, rows, name);
      sweep_nvfp4_config<mxw::Config<4, 4, 3>>(role, n, k, rows, name);
    }
  }
}

// ------------------------------------------------------------------ FC1 with SwiGLU (--fc1-swiglu)
// The fused FC1 (cuda/gemm/fc1_swiglu_gemm.h) against what the layer runs without it: FC1's
// float32 grouped GEMM (the kNN kernel grouped_gemm_bf16 picks) and the FC1 pass for a bf16
// intermediate format (layer_tc.cu's fc1_epilogue_vec4_kernel, as fc1_pass_reference below,
// compiled like it with --fmad=false). h and the stash must be equal bit for bit on the
// slabs' rows; rows past the last slab must be untouched (the layer zeroes them).

__global__ void fc1_pass_reference(const float* c, const float* w, const int32_t* off, int groups, int64_t I,
                                   moe_ep::cuda::detail::SwigluParams p, uint16_t* h, uint16_t* stash) {
  using namespace moe_ep::cuda::detail;
  const int64_t end = off[groups];
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < end * I;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / I, i = t % I;
    const float g = c[r * 2 * I + i], u = c[r * 2 * I + I + i];
    if (stash != nullptr) {
      stash[r * 2 * I + i] = bf16_from_float(g);
      stash[r * 2 * I + I + i] = bf16_from_float(u);
    }
    h[t] = bf16_from_float(bf16_round_trip(swiglu_operand(g, u, w[r], p)));
  }
}

__global__ void fill_u16(uint16_t* p, int64_t n, uint16_t v) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = v;
}

// Elements of a and b that differ (first n values), and the first one's index (-1: none).
int64_t count_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int64_t n, int64_t* first) {
  int64_t d = 0;
  *first = -1;
  for (int64_t i = 0; i < n; ++i)
    if (a[i] != b[i]) {
      if (d == 0) *first = i;
      ++d;
    }
  return d;
}

struct Fc1Case {
  int64_t H, I;
  std::vector<int> rows;
  int64_t extra_rows;
  bool weight, clamp, stash;
  bool extreme = false;  // x with rows scaled by 2^8, a NaN and infinities (make_extreme_rows)
};

// Rows of x [C, H] bf16 the SwiGLU's edges come from: every fifth row (from row 2) times
// 2^8 (exact), so their gate values reach thousands and 1 + exp(-g) overflows or passes
// 2^64 (the epilogue's divided elements); a NaN in row 3, +inf in row 8, -inf in row 11
// (rows of NaN and infinite c).
__global__ void make_extreme_rows(uint16_t* x, int64_t C, int64_t H) {
  using moe_ep::cuda::detail::bf16_from_float;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < C * H;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / H, c = i % H;
    if (r % 5 == 2) x[i] = bf16_from_float(bf16_to_float(x[i]) * 256.0f);
    if (r == 3 && c == 0) x[i] = 0x7FC0;
    if (r == 8 && c == 1) x[i] = 0x7F80;
    if (r == 11 && c == 2) x[i] = 0xFF80;
  }
}

// recip_rn_fast (swiglu.cuh) against __fdiv_rn(1, d) on every float32 d in [1, 2^64)
// (recip_rn_fast_ok's range), and recip_rn_fast_ok on both sides of its bounds.
__global__ void recip_fast_check(unsigned long long* mismatches, uint32_t* first) {
  using namespace moe_ep::cuda::detail;
  constexpr uint32_t kLo = 0x3F800000u, kHi = 0x5F800000u;  // 1, 2^64
  for (uint32_t b = kLo + blockIdx.x * blockDim.x + threadIdx.x; b < kHi; b += gridDim.x * blockDim.x) {
    const float d = __uint_as_float(b);
    if (__float_as_uint(recip_rn_fast(d)) != __float_as_uint(__fdiv_rn(1.0f, d)) || !recip_rn_fast_ok(d)) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first, b);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const uint32_t outside[] = {kLo - 1, kHi, 0x7F800000u, 0x7FC00000u, 0xFFC00000u, 0u, 0xBF800000u};
    for (uint32_t b : outside)
      if (recip_rn_fast_ok(__uint_as_float(b))) {
        atomicAdd(mismatches, 1ull);
        atomicMin(first, b);
      }
  }
}

// Runs an exhaustive check kernel (mismatches, first: its counter and the smallest failing
// bit pattern) on 4096 blocks of 256 threads and prints its line: ok_line, or "MISMATCH
// what: ..." (counted in g_failures).
template <class Kernel>
void run_exhaustive_check(Kernel kernel, const char* what, const char* ok_line) {
  unsigned long long* n = device_alloc<unsigned long long>(1);
  uint32_t* first = device_alloc<uint32_t>(1);
  CHECK_CUDA(cudaMemset(n, 0, sizeof *n));
  CHECK_CUDA(cudaMemset(first, 0xFF, sizeof *first));
  kernel<<<4096, 256>>>(n, first);
  CHECK_CUDA(cudaGetLastError());
  unsigned long long hn = 0;
  uint32_t hf = 0;
  CHECK_CUDA(cudaMemcpy(&hn, n, sizeof hn, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(&hf, first, sizeof hf, cudaMemcpyDeviceToHost));
  if (hn == 0) {
    std::printf("ok        %s: %s\n", what, ok_line);
  } else {
    ++g_failures;
    std::printf("MISMATCH  %s: %llu float32 values wrong, the first 0x%08x\n", what, hn, hf);
  }
  CHECK_CUDA(cudaFree(n));
  CHECK_CUDA(cudaFree(first));
}

void check_recip_fast() {
  run_exhaustive_check(recip_fast_check, "recip_rn_fast",
                       "equals __fdiv_rn(1, d) bit for bit on every float32 d in [1, 2^64), and recip_rn_fast_ok "
                       "holds there only");
}

// bf16_pair_rn_cvt (format_math.cuh) against bf16_from_float on every float32 bit pattern b,
// in either half of the pair (the other 1.0f: a partner that is never NaN, so no value,
// subnormals and zeros included, goes unchecked); any_nan against isnan on each.
__global__ void bf16_cvt_check(unsigned long long* mismatches, uint32_t* first) {
  using namespace moe_ep::cuda::detail;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < (uint64_t{1} << 32);
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t b = static_cast<uint32_t>(i);
    const float a = __uint_as_float(b), one = 1.0f;
    const bool nan = isnan(a);
    const bool wrong = any_nan(a, one) != nan || any_nan(one, a) != nan ||
                       (!nan && (bf16_pair_rn_cvt(a, one) != bf16_pair(bf16_from_float(a), bf16_from_float(one)) ||
                                 bf16_pair_rn_cvt(one, a) != bf16_pair(bf16_from_float(one), bf16_from_float(a))));
    if (wrong) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first, b);
    }
  }
}

void check_bf16_cvt() {
  run_exhaustive_check(bf16_cvt_check, "bf16_pair_rn_cvt",
                       "equals bf16_from_float's pair bit for bit on every float32 that is not NaN, and any_nan "
                       "finds every NaN");
}

void check_fc1_swiglu(const char* name, const Fc1Case& k, int sm_count, uint64_t seed, bool timing) {
  using moe_ep::cuda::Fc1SwigluProblem;
  const int E = static_cast<int>(k.rows.size());
  std::vector<int32_t> off(E + 1, 0);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + k.rows[e];
  const int64_t C = off[E] + k.extra_rows, H = k.H, I = k.I;
  uint16_t* x = device_alloc<uint16_t>(C * H);
  uint16_t* w1 = device_alloc<uint16_t>(static_cast<int64_t>(E) * H * 2 * I);
  float* w = device_alloc<float>(C);
  float* c = device_alloc<float>(C * 2 * I);
  int32_t* d_off = device_alloc<int32_t>(E + 1);
  uint16_t* h_ref = device_alloc<uint16_t>(C * I);
  uint16_t* h_got = device_alloc<uint16_t>(C * I);
  uint16_t* s_ref = device_alloc<uint16_t>(C * 2 * I);
  uint16_t* s_got = device_alloc<uint16_t>(C * 2 * I);
  fill_bf16<<<grid_for(C * H), 256>>>(x, C * H, seed);
  if (k.extreme) make_extreme_rows<<<grid_for(C * H), 256>>>(x, C, H);
  fill_bf16<<<grid_for(E * H * 2 * I), 256>>>(w1, E * H * 2 * I, seed + 1);
  fill_float<<<grid_for(C), 256>>>(w, C, seed + 2, 0.0f, true);
  constexpr uint16_t kSentinel = 0x7FC1;  // a NaN nothing computes
  for (uint16_t* p : {h_ref, h_got}) fill_u16<<<grid_for(C * I), 256>>>(p, C * I, kSentinel);
  for (uint16_t* p : {s_ref, s_got}) fill_u16<<<grid_for(C * 2 * I), 256>>>(p, C * 2 * I, kSentinel);
  CHECK_CUDA(cudaMemcpy(d_off, off.data(), (E + 1) * sizeof(int32_t), cudaMemcpyHostToDevice));

  // The layer without the fused kernel: FC1's float32 c, then the pass.
  GroupedGemmProblem g;
  g.layout = GemmLayout::kNN;
  g.num_groups = E;
  g.offsets = d_off;
  g.total_rows = C;
  g.n = 2 * I;
  g.k = H;
  g.a = x;
  g.b = w1;
  g.d = c;
  const size_t g_ws = moe_ep::cuda::grouped_gemm_workspace_bytes(g, sm_count);
  Fc1SwigluProblem q;
  q.num_groups = E;
  q.offsets = d_off;
  q.total_rows = C;
  q.hidden = H;
  q.intermediate = I;
  q.x = x;
  q.w1 = w1;
  q.weight = w;
  q.h = h_got;
  q.stash = k.stash ? s_got : nullptr;
  q.apply_weight = k.weight;
  q.has_clamp = k.clamp;
  q.limit = 7.0f;  // c's magnitudes reach tens: the clamp acts on some values
  if (!moe_ep::cuda::fc1_swiglu_gemm_supported(q)) {
    std::printf("MISMATCH fc1 swiglu %s: the kernel does not take the case\n", name);
    ++g_failures;
    return;
  }
  const size_t q_ws = moe_ep::cuda::fc1_swiglu_gemm_workspace_bytes(q, sm_count);
  void* ws = device_alloc<char>(std::max(g_ws, q_ws));
  const moe_ep::cuda::detail::SwigluParams sp{C, I, k.weight ? 1 : 0, k.clamp ? 1 : 0, q.limit};
  auto unfused = [&] {
    CHECK_CUDA(moe_ep::cuda::grouped_gemm_bf16(g, ws, std::max(g_ws, q_ws), nullptr, sm_count));
    fc1_pass_reference<<<grid_for(std::max<int64_t>(off[E] * I, 1)), 256>>>(c, w, d_off, E, I, sp, h_ref, k.stash ? s_ref : nullptr);
    CHECK_CUDA(cudaGetLastError());
  };
  using moe_ep::cuda::Fc1SwigluKernel;
  auto fused_with = [&](Fc1SwigluKernel kernel) {
    q.kernel = kernel;
    CHECK_CUDA(moe_ep::cuda::fc1_swiglu_gemm(q, ws, std::max(g_ws, q_ws), nullptr, sm_count));
  };
  unfused();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> hr(C * I), hg(C * I), sr(C * 2 * I), sg(C * 2 * I);
  CHECK_CUDA(cudaMemcpy(hr.data(), h_ref, hr.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(sr.data(), s_ref, sr.size() * 2, cudaMemcpyDeviceToHost));
  char what[200];
  for (Fc1SwigluKernel kernel : {Fc1SwigluKernel::kCooperative, Fc1SwigluKernel::kPingpong}) {
    fill_u16<<<grid_for(C * I), 256>>>(h_got, C * I, kSentinel);
    fill_u16<<<grid_for(C * 2 * I), 256>>>(s_got, C * 2 * I, kSentinel);
    fused_with(kernel);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(hg.data(), h_got, hg.size() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(sg.data(), s_got, sg.size() * 2, cudaMemcpyDeviceToHost));
    int64_t first_h = -1, first_s = -1;
    const int64_t dh = count_diff(hr, hg, C * I, &first_h);  // rows past the slabs: both sentinels
    const int64_t ds = count_diff(sr, sg, C * 2 * I, &first_s);
    std::snprintf(what, sizeof what, "fc1 swiglu %s [%s] (H %lld, I %lld, %d groups, %lld rows%s%s%s%s)", name,
                  kernel == Fc1SwigluKernel::kPingpong ? "pingpong" : "cooperative", static_cast<long long>(H),
                  static_cast<long long>(I), E, static_cast<long long>(C), k.weight ? ", weight" : "",
                  k.clamp ? ", clamp" : "", k.stash ? ", stash" : "", k.extreme ? ", extreme rows" : "");
    if (dh == 0 && ds == 0) {
      std::printf("ok        %s: h and the stash equal the GEMM and the pass bit for bit\n", what);
      continue;
    }
    ++g_failures;
    std::printf("MISMATCH  %s: %lld of %lld h values differ, %lld of %lld stash values\n", what,
                static_cast<long long>(dh), static_cast<long long>(C * I), static_cast<long long>(ds),
                static_cast<long long>(C * 2 * I));
    if (first_h >= 0)
      std::printf("  h[%lld, %lld]: got 0x%04x, want 0x%04x\n", static_cast<long long>(first_h / I),
                  static_cast<long long>(first_h % I), hg[first_h], hr[first_h]);
    if (first_s >= 0)
      std::printf("  stash[%lld, %lld]: got 0x%04x, want 0x%04x\n", static_cast<long long>(first_s / (2 * I)),
                  static_cast<long long>(first_s % (2 * I)), sg[first_s], sr[first_s]);
  }
  if (timing) {
    cudaEvent_t t0, t1;
    CHECK_CUDA(cudaEventCreate(&t0));
    CHECK_CUDA(cudaEventCreate(&t1));
    auto time_of = [&](auto&& run) {
      for (int i = 0; i < 3; ++i) run();
      constexpr int kIters = 20;
      CHECK_CUDA(cudaEventRecord(t0));
      for (int i = 0; i < kIters; ++i) run();
      CHECK_CUDA(cudaEventRecord(t1));
      CHECK_CUDA(cudaEventSynchronize(t1));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
      return ms / kIters;
    };
    std::snprintf(what, sizeof what, "fc1 swiglu %s (H %lld, I %lld, %d groups, %lld rows%s)", name,
                  static_cast<long long>(H), static_cast<long long>(I), E, static_cast<long long>(C),
                  k.stash ? ", stash" : "");
    for (int pass = 0; pass < 2; ++pass) {  // alternating
      const float tu = time_of(unfused);
      const float tc = time_of([&] { fused_with(Fc1SwigluKernel::kCooperative); });
      const float tp = time_of([&] { fused_with(Fc1SwigluKernel::kPingpong); });
      std::printf("time  %s: GEMM + pass %.4f ms; fused cooperative %.4f ms (%.3f of it), pingpong %.4f ms (%.3f)\n",
                  what, tu, tc, tc / tu, tp, tp / tu);
    }
    CHECK_CUDA(cudaEventDestroy(t0));
    CHECK_CUDA(cudaEventDestroy(t1));
  }
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w1), static_cast<void*>(w), static_cast<void*>(c),
                  static_cast<void*>(d_off), static_cast<void*>(h_ref), static_cast<void*>(h_got),
                  static_cast<void*>(s_ref), static_cast<void*>(s_got), ws})
    CHECK_CUDA(cudaFree(p));
}

// DeepSeek-V3 per rank at 4096 tokens (hidden 7168, intermediate 2048, 32 experts, the
// routing's spread), no weight or clamp; with or without the stash. The timed case, and the
// one --fc1-swiglu-profile launches.
Fc1Case fc1_prefill_case(bool stash) { return {7168, 2048, spread_rows(32768), 0, false, false, stash}; }

void fc1_swiglu_checks(bool timing, int sm_count) {
  check_recip_fast();
  check_bf16_cvt();
  // Ragged groups: empty ones, groups off the 128-row tile, one of several tiles; rows past the slabs.
  const std::vector<int> ragged = {0, 1, 129, 0, 300, 7, 256, 45, 0};
  for (bool stash : {true, false})
    for (bool weight : {true, false})
      check_fc1_swiglu("ragged", {512, 256, ragged, 13, weight, !weight, stash}, sm_count, 31, false);
  check_fc1_swiglu("three column tiles", {384, 384, ragged, 0, true, true, true}, sm_count, 32, false);
  // 2 I of one and of three 256-column tiles: the cluster's second CTA holds a tile past N.
  check_fc1_swiglu("one column tile", {256, 128, ragged, 3, true, true, true}, sm_count, 36, false);
  check_fc1_swiglu("all groups empty", {256, 128, {0, 0, 0}, 5, true, false, true}, sm_count, 33, false);
  // Gate values past the epilogue's branch-free reciprocal (divided), NaN and infinite c.
  for (bool clamp : {false, true})
    check_fc1_swiglu("extreme", {512, 256, ragged, 13, true, clamp, true, true}, sm_count, 37, false);
  check_fc1_swiglu("prefill, spread", fc1_prefill_case(false), sm_count, 34, timing);
  check_fc1_swiglu("prefill, spread", fc1_prefill_case(true), sm_count, 35, timing);
}

// --initcheck-probe (run under compute-sanitizer --tool initcheck): does initcheck see the
// grouped GEMM's stores into D as initialising writes? D comes fresh from cudaMalloc (never
// written), the GEMM writes every row of it (no accumulate), then read_after_gemm_kernel
// reads them. A control buffer written by an ordinary kernel is read by
// read_after_plain_kernel. A report naming read_after_gemm_kernel (and none naming the
// control) means the tool does not track the GEMM's (TMA) stores; a report in the control
// would mean the tool is misused.
__global__ void read_after_gemm_kernel(const float* d, int64_t n, float* sink) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    acc += d[i];
  if (acc == 12345.0f) *sink = acc;  // keeps the loads
}
__global__ void write_plain_kernel(float* d, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    d[i] = 1.0f;
}
__global__ void read_after_plain_kernel(const float* d, int64_t n, float* sink) {
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    acc += d[i];
  if (acc == 12345.0f) *sink = acc;
}

int initcheck_probe(int sm_count) {
  for (GemmKernel kernel : {GemmKernel::kCooperative, GemmKernel::kPingpong, GemmKernel::kCooperativeN2}) {
    GroupedGemmProblem p;
    p.layout = GemmLayout::kNN;
    const std::vector<int> rows = {64, 200, 0, 33};
    const std::vector<int32_t> off = offsets_of(rows);
    p.num_groups = static_cast<int32_t>(rows.size());
    p.total_rows = off.back();
    p.n = 256;
    p.k = 128;
    p.kernel = kernel;
    Buffers buf = make_buffers(p, off, sm_count, 11);
    CHECK_CUDA(cudaMemset(buf.ws, 0, std::max<size_t>(buf.ws_bytes, 1)));
    float* sink = device_alloc<float>(1);
    float* plain = device_alloc<float>(buf.d_elems);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(moe_ep::cuda::grouped_gemm_bf16(p, buf.ws, buf.ws_bytes, nullptr, sm_count));
    read_after_gemm_kernel<<<grid_for(buf.d_elems), 256>>>(buf.d, buf.d_elems, sink);
    write_plain_kernel<<<grid_for(buf.d_elems), 256>>>(plain, buf.d_elems);
    read_after_plain_kernel<<<grid_for(buf.d_elems), 256>>>(plain, buf.d_elems, sink);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("initcheck probe (%s kernel): the GEMM wrote %lld floats of a fresh D, then two read kernels ran\n",
                moe_ep::cuda::grouped_gemm_kernel_name(p), static_cast<long long>(buf.d_elems));
    cudaFree(sink);
    cudaFree(plain);
    buf.release();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool timing = true, probe = false, mxfp8_only = false, mx_profile = false, nvfp4_only = false, nv_profile = false,
       nv_sweep = false, fc1 = false, fc1_profile = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--fc1-swiglu") == 0) fc1 = true;
    if (std::strcmp(argv[i], "--fc1-swiglu-profile") == 0) fc1_profile = true;
    if (std::strcmp(argv[i], "--no-time") == 0) timing = false;
    if (std::strcmp(argv[i], "--initcheck-probe") == 0) probe = true;
    if (std::strcmp(argv[i], "--mxfp8-weights") == 0) mxfp8_only = true;
    if (std::strcmp(argv[i], "--mxfp8-weights-profile") == 0) mx_profile = true;
    if (std::strcmp(argv[i], "--nvfp4-weights") == 0) nvfp4_only = true;
    if (std::strcmp(argv[i], "--nvfp4-weights-profile") == 0) nv_profile = true;
    if (std::strcmp(argv[i], "--nvfp4-weights-sweep") == 0) nv_sweep = true;
  }
  if (!moe_ep::cuda::grouped_gemm_built()) {
    std::printf("moe_ep_gemm_check: this build has no CUTLASS grouped GEMM (MOE_EP_NATIVE_CUTLASS=OFF)\n");
    return 1;
  }
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("moe_ep_gemm_check: the kernels are sm_90a only\n");
    return 1;
  }
  const int sms = prop.multiProcessorCount;
  if (probe) return initcheck_probe(sms);
  if (fc1_profile) {  // one launch of each kernel at the prefill shape, for a profiler
    check_fc1_swiglu("prefill, spread", fc1_prefill_case(false), sms, 34, false);
    return g_failures == 0 ? 0 : 1;
  }
  if (fc1) {
    fc1_swiglu_checks(timing, sms);
    std::printf("checks: %s (%d failed)\n", g_failures == 0 ? "all ok" : "FAILED", g_failures);
    return g_failures == 0 ? 0 : 1;
  }
  if (nv_sweep) {
    nvfp4_weights_sweep();
    return g_failures == 0 ? 0 : 1;
  }
  if (mx_profile || nv_profile) {
    if (mx_profile) mxfp8_weights_profile_launches();
    if (nv_profile) nvfp4_weights_profile_launches();
    return 0;
  }
  if (mxfp8_only || nvfp4_only) {  // the block-scaled-weights kernels alone: checks, then (unless --no-time) timings
    if (mxfp8_only) mxfp8_weights_checks(timing, sms);
    if (nvfp4_only) nvfp4_weights_checks(timing);
    std::printf("checks: %s (%d failed)\n", g_failures == 0 ? "all ok" : "FAILED", g_failures);
    return g_failures == 0 ? 0 : 1;
  }

  // Ragged groups: empty groups (first, middle, last), groups of 1 row, groups that are
  // not a multiple of the 128-row tile, one larger than several tiles.
  const std::vector<int> ragged = {0, 1, 129, 0, 300, 7, 256, 45, 0};
  const std::vector<int> all_empty = {0, 0, 0};
  for (GemmLayout layout : {GemmLayout::kNN, GemmLayout::kNT}) {
    for (GemmKernel kernel : {GemmKernel::kCooperative, GemmKernel::kPingpong, GemmKernel::kCooperativeN2}) {
      if (kernel == GemmKernel::kCooperativeN2 && layout != GemmLayout::kNN) continue;
      for (bool acc : {false, true}) {
        check("ragged, n,k off the tile", layout, 0, 264, 200, ragged, 13, acc, false, kernel, sms, 1);
        check("ragged, big n,k", layout, 0, 1024, 1536, ragged, 0, acc, false, kernel, sms, 2);
      }
      check("all groups empty", layout, 0, 256, 128, all_empty, 5, false, false, kernel, sms, 3);
      check("one group", layout, 0, 512, 512, {1000}, 0, false, false, kernel, sms, 4);
      check("ragged, graph", layout, 0, 264, 200, ragged, 13, true, true, kernel, sms, 5);
    }
    check("ragged, n = 8", layout, 0, 8, 64, ragged, 0, false, false, GemmKernel::kAuto, sms, 10);
  }
  for (bool acc : {false, true}) {
    check("ragged K, m,n off the tile", GemmLayout::kTN, 264, 136, 0, ragged, 11, acc, false, GemmKernel::kAuto, sms, 6);
    check("ragged K, big m,n", GemmLayout::kTN, 1024, 1536, 0, {0, 3, 77, 0, 512, 64, 1, 250}, 0, acc, false,
          GemmKernel::kAuto, sms, 7);
    check("all groups empty", GemmLayout::kTN, 256, 128, 0, all_empty, 5, acc, false, GemmKernel::kAuto, sms, 8);
  }
  check("ragged K, graph", GemmLayout::kTN, 264, 136, 0, ragged, 11, false, true, GemmKernel::kAuto, sms, 9);
  for (GemmKernel kernel : {GemmKernel::kCooperative, GemmKernel::kPingpong, GemmKernel::kCooperativeN2}) {
    check_bf16_out("ragged, n,k off the tile", GemmLayout::kNN, 0, 264, 200, ragged, 13, kernel, sms, 12);
    check_bf16_out("ragged, big n,k", GemmLayout::kNN, 0, 1024, 1536, ragged, 0, kernel, sms, 13);
  }
  check_bf16_out("ragged K, m,n off the tile", GemmLayout::kTN, 264, 136, 0, ragged, 11, GemmKernel::kAuto, sms, 14);
  check_bf16_out("ragged K, big m,n", GemmLayout::kTN, 1024, 1536, 0, {0, 3, 77, 0, 512, 64, 1, 250}, 0,
                 GemmKernel::kAuto, sms, 15);
  check_bf16_out("all groups empty", GemmLayout::kTN, 256, 128, 0, all_empty, 5, GemmKernel::kAuto, sms, 16);
  mxfp8_weights_checks(false, sms);
  nvfp4_weights_checks(false);
  fc1_swiglu_checks(false, sms);
  std::printf("checks: %s (%d failed)\n", g_failures == 0 ? "all ok" : "FAILED", g_failures);

  if (timing) {
    time_mxfp8_weights("FC1 (decode)", 4096, 7168, std::vector<int>(32, 32), sms);
    time_mxfp8_weights("FC2 (decode)", 7168, 2048, std::vector<int>(32, 32), sms);
    time_nvfp4_weights("FC1 (decode)", 4096, 7168, std::vector<int>(32, 32), nullptr, "", nullptr, "auto");
    time_nvfp4_weights("FC2 (decode)", 7168, 2048, std::vector<int>(32, 32), nullptr, "", nullptr, "auto");
    // DeepSeek-V3 per rank: hidden 7168, intermediate 2048 (FC1 out 2I = 4096), 32 local experts.
    const GemmKernel coop = GemmKernel::kCooperative, pp = GemmKernel::kPingpong, n2 = GemmKernel::kCooperativeN2;
    // The prefill's kNN kernels against each other: the routing's spread of rows (as the
    // layer gets them), then every group 1024 rows; float32 and bf16 D; twice, alternating.
    const std::vector<int> spread = spread_rows(32768);
    for (int pass = 0; pass < 2; ++pass) {
      for (GemmKernel kernel : {coop, n2}) {
        time_rows("FC1 forward (prefill, spread)", GemmLayout::kNN, 0, 4096, 7168, spread, sms, kernel);
        time_rows("FC2 forward (prefill, spread)", GemmLayout::kNN, 0, 7168, 2048, spread, sms, kernel);
        time_rows("FC2 fwd, bf16 D (prefill, spread)", GemmLayout::kNN, 0, 7168, 2048, spread, sms, kernel, true);
      }
    }
    for (GemmKernel kernel : {coop, n2}) {
      time_shape("FC1 forward (prefill)", GemmLayout::kNN, 0, 4096, 7168, 32, 1024, sms, kernel);
      time_shape("FC2 forward (prefill)", GemmLayout::kNN, 0, 7168, 2048, 32, 1024, sms, kernel);
      time_shape("FC2 forward, bf16 D (prefill)", GemmLayout::kNN, 0, 7168, 2048, 32, 1024, sms, kernel, true);
    }
    // The decode's kNN kernels against each other (32 rows an expert, and the routing's
    // spread at 128 tokens), twice, alternating; then 128 rows an expert.
    const std::vector<int> decode = spread_rows(1024);
    for (int pass = 0; pass < 2; ++pass) {
      for (GemmKernel kernel : {pp, n2}) {
        time_shape("FC1 forward (decode)", GemmLayout::kNN, 0, 4096, 7168, 32, 32, sms, kernel);
        time_shape("FC2 forward (decode)", GemmLayout::kNN, 0, 7168, 2048, 32, 32, sms, kernel);
        time_shape("FC2 forward, bf16 D (decode)", GemmLayout::kNN, 0, 7168, 2048, 32, 32, sms, kernel, true);
        time_rows("FC1 forward (decode, spread)", GemmLayout::kNN, 0, 4096, 7168, decode, sms, kernel);
        time_rows("FC2 forward (decode, spread)", GemmLayout::kNN, 0, 7168, 2048, decode, sms, kernel);
      }
    }
    time_shape("FC1 forward (decode)", GemmLayout::kNN, 0, 4096, 7168, 32, 32, sms, coop);
    time_shape("FC1 forward (prefill)", GemmLayout::kNN, 0, 4096, 7168, 32, 1024, sms, pp);
    for (GemmKernel kernel : {pp, coop, n2})
      time_shape("FC1 forward (128 rows/group)", GemmLayout::kNN, 0, 4096, 7168, 32, 128, sms, kernel);
    time_rows("FC1 data grad (spread)", GemmLayout::kNT, 0, 7168, 4096, spread, sms);
    time_shape("FC1 data grad", GemmLayout::kNT, 0, 7168, 4096, 32, 1024, sms);
    time_shape("FC2 data grad", GemmLayout::kNT, 0, 2048, 7168, 32, 1024, sms);
    time_shape("FC1 weight grad", GemmLayout::kTN, 7168, 4096, 0, 32, 1024, sms);
    time_shape("FC2 weight grad", GemmLayout::kTN, 2048, 7168, 0, 32, 1024, sms);
    time_shape("FC1 weight grad, bf16 D", GemmLayout::kTN, 7168, 4096, 0, 32, 1024, sms, GemmKernel::kAuto, true);
    time_shape("FC2 weight grad, bf16 D", GemmLayout::kTN, 2048, 7168, 0, 32, 1024, sms, GemmKernel::kAuto, true);
  }
  return g_failures == 0 ? 0 : 1;
}
