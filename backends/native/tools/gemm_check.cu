// moe_ep_gemm_check: checks the bf16 grouped GEMMs (src/cuda/gemm/grouped_gemm.h) against
// a naive reference on the GPU, then times the DeepSeek-V3 expert shapes.
//
//   moe_ep_gemm_check                  checks, then timings
//   moe_ep_gemm_check --no-time        checks only
//   moe_ep_gemm_check --mxfp8-weights  the mxfp8-weights GEMM alone (cuda/gemm/mxfp8_weights_gemm.cuh):
//                                      its checks, then its timings at the decode shape
//
// Every check prints one line ("ok" or "MISMATCH ..."); the exit status is non-zero on
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
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/mxfp8_weights_gemm.cuh"

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
    {"<6,3,2>", &moe_ep::cuda::mxfp8_weights_gemm_launch<moe_ep::cuda::mxw::Config<6, 3, 2>>},
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
  bool timing = true, probe = false, mxfp8_only = false, mx_profile = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-time") == 0) timing = false;
    if (std::strcmp(argv[i], "--initcheck-probe") == 0) probe = true;
    if (std::strcmp(argv[i], "--mxfp8-weights") == 0) mxfp8_only = true;
    if (std::strcmp(argv[i], "--mxfp8-weights-profile") == 0) mx_profile = true;
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
  if (mx_profile) {
    mxfp8_weights_profile_launches();
    return 0;
  }
  if (mxfp8_only) {  // the mxfp8-weights kernel alone: its checks, then (unless --no-time) its timings
    mxfp8_weights_checks(timing, sms);
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
  std::printf("checks: %s (%d failed)\n", g_failures == 0 ? "all ok" : "FAILED", g_failures);

  if (timing) {
    time_mxfp8_weights("FC1 (decode)", 4096, 7168, std::vector<int>(32, 32), sms);
    time_mxfp8_weights("FC2 (decode)", 7168, 2048, std::vector<int>(32, 32), sms);
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
