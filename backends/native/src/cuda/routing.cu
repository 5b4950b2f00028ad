// CUDA routing: the route plan (a stable counting sort of route ids by expert,
// no host synchronisation), the permutation of token rows into send order, and
// the Form-A combine reduction.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/common.cuh"
#include "cuda/format_math.cuh"
#include "internal.h"

namespace moe_ep {
namespace cuda {
namespace {

using namespace detail;

// ------------------------------------------------------------------ plan_routes
//
// Buckets: expert e in [0, E) for a routed id; one "unrouted" bucket E (-1 slots
// and bad ids, which fill the tail of send_route in route order). Two ways:
//  * multi-block (plan_hist_kernel, plan_scan_kernel, plan_place_kernel): the N
//    route ids are cut into U contiguous "units" of at least E + 2 ids, one warp
//    each, U <= kPlanMaxUnits, in route order. A unit's row of E + 2 counters
//    (its routed ids per expert, its unrouted ids, its bad ids) lives, between
//    the three kernels, in the unit's own slice of the route_pos output (which is
//    written last, by the same warp, after it has read the row back): no
//    workspace, no allocation, nothing shared between blocks but kernel order.
//    topk_idx must not overlap an output (the last kernel reads it again after
//    route_pos and route_expert were written).
//  * one block (plan_routes_kernel): small inputs (one launch is faster there),
//    and E too large for a unit's counters in shared memory.
// Both give the CPU twin's outputs bit for bit, deterministically.

constexpr int kPlanThreads = 1024;
// Per-expert cursors of the one-block kernel live in shared memory when they fit
// (E * 4 bytes next to the kernel's static shared memory, under the 48 KiB
// default); otherwise the kernel uses the `counts` output itself as its cursor
// array (global memory, same code through a generic pointer) and rewrites it at
// the end.
constexpr int64_t kPlanSharedExperts = 10240;

// Multi-block sizing: a unit holds at least max(E + 2, kPlanUnitMinRoutes) ids;
// at most kPlanMaxUnits units (32 per plan_scan_kernel thread column); up to
// kPlanMaxWarps units (warps) per block, each with E + 2 ints of dynamic shared
// memory, all under kPlanSmemInts ints (48 KiB less room for static shared memory).
constexpr int64_t kPlanUnitMinRoutes = 256;
constexpr int kPlanScanRows = 32;  // rows (units) per plan_scan_kernel thread, at most
constexpr int kPlanScanGroups = 32;
constexpr int64_t kPlanMaxUnits = int64_t{kPlanScanRows} * kPlanScanGroups;
constexpr int kPlanMaxWarps = 4;
constexpr int64_t kPlanSmemInts = 12288 - 64;
// The automatic choice takes the multi-block kernels from this many route ids
// (and at least two units); below, the one-block kernel.
constexpr int64_t kPlanMultiMinRoutes = 2048;
constexpr int kPlanBatch = 8;  // route ids per lane loaded before they are used

// Unit u's ids: [u * N / U, (u + 1) * N / U), at least floor(N / U) >= E + 2 of them.
__device__ __forceinline__ int64_t unit_begin(int64_t u, int64_t num_routes, int64_t num_units) {
  return u * num_routes / num_units;
}

// Pass 1: unit u (one warp) counts its ids per bucket in shared memory (row[e]:
// routed ids of expert e; row[E]: unrouted ids, bad ones included; row[E + 1]:
// bad ids), writes route_expert for its ids, then stores the row in
// route_pos[begin, begin + E + 2).
__global__ void __launch_bounds__(kPlanMaxWarps * 32)
    plan_hist_kernel(const int32_t* __restrict__ topk, int64_t num_routes, int num_experts, int64_t num_units,
                     int32_t* __restrict__ route_pos, int32_t* __restrict__ route_expert) {
  extern __shared__ int s_rows[];
  const int E = num_experts, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t u = int64_t{blockIdx.x} * (blockDim.x >> 5) + warp;
  if (u >= num_units) return;  // whole warps; no block barrier below
  int* row = s_rows + warp * (E + 2);
  for (int e = lane; e < E + 2; e += 32) row[e] = 0;
  __syncwarp();
  const int64_t lo = unit_begin(u, num_routes, num_units), hi = unit_begin(u + 1, num_routes, num_units);
  for (int64_t base = lo; base < hi; base += kPlanBatch * 32) {
    int v[kPlanBatch];
#pragma unroll
    for (int i = 0; i < kPlanBatch; ++i) {
      const int64_t r = base + i * 32 + lane;
      v[i] = r < hi ? topk[r] : -1;
    }
#pragma unroll
    for (int i = 0; i < kPlanBatch; ++i) {
      const int64_t r = base + i * 32 + lane;
      if (r < hi) {
        const bool routed = v[i] >= 0 && v[i] < E;
        atomicAdd(&row[routed ? v[i] : E], 1);
        if (!routed && v[i] != -1) atomicAdd(&row[E + 1], 1);
        route_expert[r] = routed ? v[i] : -1;
      }
    }
  }
  __syncwarp();
  for (int e = lane; e < E + 2; e += 32) route_pos[lo + e] = row[e];
}

// Pass 2: for every column c in [0, E + 2) of the U x (E + 2) unit rows, an
// exclusive prefix over units, in place (row u then holds the ids of bucket c in
// units before u); the column totals go to counts (c < E: counts[c]; c = E + 1:
// counts[E], the bad ids). Block: 32 columns x 32 groups of <= 32 consecutive rows.
__global__ void __launch_bounds__(kPlanScanGroups * 32)
    plan_scan_kernel(int64_t num_routes, int num_experts, int64_t num_units, int32_t* route_pos,
                     int32_t* __restrict__ counts) {
  __shared__ int s_part[kPlanScanGroups][33];
  const int cols = num_experts + 2;
  const int tx = threadIdx.x, g = threadIdx.y;
  const int c = blockIdx.x * 32 + tx;
  const int64_t rows_per_group = div_up(num_units, kPlanScanGroups);  // <= kPlanScanRows
  const int64_t r0 = g * rows_per_group;
  int v[kPlanScanRows];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kPlanScanRows; ++i) {
    const int64_t u = r0 + i;
    v[i] = 0;
    if (i < rows_per_group && u < num_units && c < cols) v[i] = route_pos[unit_begin(u, num_routes, num_units) + c];
    sum += v[i];
  }
  s_part[g][tx] = sum;
  __syncthreads();
  int before = 0, total = 0;
  for (int j = 0; j < kPlanScanGroups; ++j) {
    const int p = s_part[j][tx];
    if (j < g) before += p;
    total += p;
  }
#pragma unroll
  for (int i = 0; i < kPlanScanRows; ++i) {
    const int64_t u = r0 + i;
    if (i < rows_per_group && u < num_units && c < cols) route_pos[unit_begin(u, num_routes, num_units) + c] = before;
    before += v[i];
  }
  if (g == 0 && c < cols && c != num_experts) counts[c < num_experts ? c : num_experts] = total;
}

// Pass 3: every block computes the experts' first send positions (exclusive
// prefix of counts[0, E)) into warp 0's row; each unit's cursor row is then that
// plus its row of pass 2 (the unrouted cursor: all routed ids plus the unit's
// share). Then unit by unit, in route order, 32 ids at a time: lanes with the
// same bucket (__match_any_sync) take consecutive positions in lane order from
// the bucket's cursor, which the group's lowest lane advances. Route order is
// kept within every bucket: units are in route order, ids inside a unit too.
// route_pos of the unit's ids is written here, after its row was read.
__global__ void __launch_bounds__(kPlanMaxWarps * 32)
    plan_place_kernel(const int32_t* __restrict__ topk, int64_t num_routes, int num_experts, int64_t num_units,
                      const int32_t* __restrict__ counts, int32_t* __restrict__ send_route, int32_t* route_pos) {
  extern __shared__ int s_rows[];
  __shared__ int s_warp_sum[kPlanMaxWarps];
  const int E = num_experts, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nthreads = blockDim.x, nwarps = nthreads >> 5;
  const int64_t u = int64_t{blockIdx.x} * nwarps + warp;
  const bool active = u < num_units;  // warp-uniform; every warp reaches every barrier
  const int64_t lo = active ? unit_begin(u, num_routes, num_units) : 0;
  const int64_t hi = active ? unit_begin(u + 1, num_routes, num_units) : 0;
  int* row = s_rows + warp * (E + 2);
  int* first = s_rows;  // [E]: the experts' first send positions (warp 0's row until it is made)

  // Block-wide exclusive prefix of counts[0, E): each thread sums a run of
  // consecutive experts, a scan over threads, then each thread writes its run.
  const int per = static_cast<int>(div_up(E, nthreads));
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int mine = 0;
  for (int e = e0; e < e1; ++e) mine += counts[e];
  int incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) s_warp_sum[warp] = incl;
  __syncthreads();
  int routed_total = 0, before = 0;
  for (int w = 0; w < nwarps; ++w) {
    const int ws = s_warp_sum[w];
    if (w < warp) before += ws;
    routed_total += ws;
  }
  int run = before + incl - mine;
  for (int e = e0; e < e1; ++e) {
    const int cnt = counts[e];
    first[e] = run;
    run += cnt;
  }
  __syncthreads();
  // Cursor rows: warps 1.. first (they read warp 0's row), then warp 0 in place.
  if (warp > 0 && active)
    for (int e = lane; e <= E; e += 32) row[e] = (e < E ? first[e] : routed_total) + route_pos[lo + e];
  __syncthreads();
  if (warp == 0)  // block 0.. always has an active warp 0
    for (int e = lane; e <= E; e += 32) row[e] = (e < E ? row[e] : routed_total) + route_pos[lo + e];
  __syncwarp();
  if (!active) return;  // no block barrier below

  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t base = lo; base < hi; base += kPlanBatch * 32) {
    int v[kPlanBatch];
#pragma unroll
    for (int i = 0; i < kPlanBatch; ++i) {
      const int64_t r = base + i * 32 + lane;
      v[i] = r < hi ? topk[r] : 0;
    }
#pragma unroll
    for (int i = 0; i < kPlanBatch; ++i) {
      const int64_t r = base + i * 32 + lane;
      const bool valid = r < hi;
      const int bucket = valid ? ((v[i] >= 0 && v[i] < E) ? v[i] : E) : E + 1;  // E + 1: never placed
      const unsigned peers = __match_any_sync(0xFFFFFFFFu, bucket);
      const int leader = __ffs(peers) - 1;
      int start = 0;
      if (valid && lane == leader) {
        start = row[bucket];
        row[bucket] = start + __popc(peers);
      }
      start = __shfl_sync(0xFFFFFFFFu, start, leader);
      if (valid) {
        const int pos = start + __popc(peers & lanes_below);
        send_route[pos] = static_cast<int32_t>(r);
        route_pos[r] = bucket < E ? pos : -1;
      }
      __syncwarp();  // this step's cursor updates before the next step's reads
    }
  }
}

// The one-block plan, kPlanThreads threads over N = T * K route ids:
//  1. histogram of routed ids per expert (atomics), bad-id count, route_expert;
//  2. in-place exclusive prefix sum of the histogram: each expert's first send
//     position; the unrouted cursor starts at their total;
//  3. placement, chunk by chunk of kPlanThreads route ids in route order, and
//     inside a chunk warp by warp (one warp per step, __syncthreads between; only
//     the warps that hold ids of the chunk): lanes with the same bucket
//     (__match_any_sync) take consecutive positions in lane order from the
//     bucket's cursor, and the group's lowest lane then advances the cursor.
//     Route order is therefore kept within every bucket: the sort is stable by
//     route id;
//  4. the cursors now hold each expert's end position: counts[e] = end[e] -
//     end[e - 1], taken top-down in chunks so that an in-place rewrite of
//     `counts` never reads a value it already overwrote; counts[E] = bad ids.
__global__ void __launch_bounds__(kPlanThreads)
    plan_routes_kernel(const int32_t* __restrict__ topk, int64_t num_routes, int num_experts,
                       int32_t* __restrict__ send_route, int32_t* __restrict__ route_pos,
                       int32_t* __restrict__ route_expert, int32_t* counts, int cursors_in_shared) {
  extern __shared__ int s_cursor_dyn[];
  __shared__ int s_warp_sum[32];
  __shared__ int s_bad, s_tail, s_carry;
  int* cursor = cursors_in_shared ? s_cursor_dyn : counts;  // generic pointer: shared or global
  const int E = num_experts;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nthreads = blockDim.x, nwarps = nthreads >> 5;

  for (int e = tid; e < E; e += nthreads) cursor[e] = 0;
  if (tid == 0) {
    s_bad = 0;
    s_carry = 0;
  }
  __syncthreads();

  // 1. histogram
  for (int64_t r = tid; r < num_routes; r += nthreads) {
    const int v = topk[r];
    const bool routed = v >= 0 && v < E;
    if (routed) atomicAdd(&cursor[v], 1);
    else if (v != -1) atomicAdd(&s_bad, 1);
    route_expert[r] = routed ? v : -1;
  }
  __syncthreads();

  // 2. exclusive prefix sum of cursor[0, E), chunk by chunk with a running carry
  for (int chunk = 0; chunk < E; chunk += nthreads) {
    const int e = chunk + tid;
    const int v = e < E ? cursor[e] : 0;
    int incl = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xFFFFFFFFu, incl, d);
      if (lane >= d) incl += y;
    }
    if (lane == 31) s_warp_sum[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int ws = lane < nwarps ? s_warp_sum[lane] : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xFFFFFFFFu, ws, d);
        if (lane >= d) ws += y;
      }
      s_warp_sum[lane] = ws;  // inclusive prefix over warps
    }
    __syncthreads();
    const int carry = s_carry;
    const int before = carry + (warp > 0 ? s_warp_sum[warp - 1] : 0) + incl - v;
    if (e < E) cursor[e] = before;
    const int chunk_total = s_warp_sum[nwarps - 1];
    __syncthreads();  // every thread has read s_carry and s_warp_sum
    if (tid == 0) s_carry = carry + chunk_total;
    __syncthreads();
  }
  if (tid == 0) s_tail = s_carry;  // unrouted ids start after all routed ones
  __syncthreads();

  // 3. stable placement
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t chunk = 0; chunk < num_routes; chunk += nthreads) {
    const int64_t r = chunk + tid;
    const bool valid = r < num_routes;
    int bucket = E + 1;  // lanes past the end: a group of their own, never placed
    if (valid) {
      const int v = topk[r];
      bucket = (v >= 0 && v < E) ? v : E;
    }
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, bucket);
    const int rank = __popc(peers & lanes_below);
    const int64_t left = num_routes - chunk;  // > 0; the same in every thread
    const int busy_warps = left >= nthreads ? nwarps : static_cast<int>((left + 31) >> 5);
    for (int w = 0; w < busy_warps; ++w) {
      if (warp == w) {  // warp-uniform
        int* slot = bucket < E ? &cursor[bucket] : &s_tail;
        const int start = valid ? *slot : 0;
        __syncwarp();  // all peers read the cursor before the lowest one advances it
        if (valid) {
          if (rank == 0) *slot = start + __popc(peers);
          const int pos = start + rank;
          send_route[pos] = static_cast<int32_t>(r);
          route_pos[r] = bucket < E ? pos : -1;
        }
      }
      __syncthreads();
    }
  }

  // 4. counts from the end positions (top-down: see above)
  for (int hi = E; hi > 0; hi -= nthreads) {
    const int lo = hi > nthreads ? hi - nthreads : 0;
    const int e = lo + tid;
    int c = 0;
    if (e < hi) c = cursor[e] - (e > 0 ? cursor[e - 1] : 0);
    __syncthreads();
    if (e < hi) counts[e] = c;
    __syncthreads();
  }
  if (tid == 0) counts[E] = s_bad;
}

// Row i of dst copies token send_route[i] / K, or is zeros for -1 and for an id outside
// [0, T * K), in 16/4/2/1-byte units. A thread takes kPermuteUnroll units a block's
// stride apart and issues all their loads before any store (a warp's units are
// contiguous), so that enough bytes are in flight for the copy to be memory-bound.
constexpr int kPermuteUnroll = 4;

template <typename V>
__global__ void permute_rows_kernel(const V* __restrict__ tokens, int64_t num_routes, int64_t num_topk,
                                    int64_t units_per_row, const int32_t* __restrict__ send_route, int64_t num_rows,
                                    V* __restrict__ dst) {
  const int64_t total = num_rows * units_per_row;
  const int64_t step = int64_t{gridDim.x} * blockDim.x * kPermuteUnroll;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x} * kPermuteUnroll + threadIdx.x; base < total; base += step) {
    V v[kPermuteUnroll];
#pragma unroll
    for (int k = 0; k < kPermuteUnroll; ++k) {
      const int64_t t = base + int64_t{k} * blockDim.x;
      v[k] = V{};
      if (t >= total) continue;
      const int64_t row = div_nonneg(t, units_per_row), u = t - row * units_per_row;
      const int64_t route = send_route[row];
      if (route >= 0 && route < num_routes) v[k] = tokens[div_nonneg(route, num_topk) * units_per_row + u];
    }
#pragma unroll
    for (int k = 0; k < kPermuteUnroll; ++k) {
      const int64_t t = base + int64_t{k} * blockDim.x;
      if (t < total) dst[t] = v[k];
    }
  }
}

__device__ __forceinline__ float row_value(const float* row, int64_t h) { return row[h]; }
__device__ __forceinline__ float row_value(const uint16_t* row, int64_t h) { return bf16_to_float(row[h]); }

// One thread per output element (t, h): out = (((+0 + Y[t,0]) + Y[t,1]) + ...)
// in slot order, adding nothing for a -1 position or one outside [0, num_rows).
template <typename Row>
__global__ void combine_reduce_kernel(const Row* __restrict__ rows, int64_t num_rows,
                                      const int32_t* __restrict__ route_pos, int64_t num_tokens, int64_t num_topk,
                                      int64_t hidden, float* __restrict__ out) {
  const int64_t total = num_tokens * hidden;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = idx / hidden, h = idx - t * hidden;
    float acc = 0.0f;
    for (int64_t k = 0; k < num_topk; ++k) {
      const int64_t r = t * num_topk + k;
      const int64_t p = route_pos != nullptr ? static_cast<int64_t>(route_pos[r]) : r;
      if (p >= 0 && p < num_rows) acc = fadd(acc, row_value(rows + p * hidden, h));
    }
    out[idx] = acc;
  }
}

// The same sums, V = 16 / sizeof(Row) consecutive elements a thread (four float32 or
// eight bf16 from one 16-byte load a row; hidden a multiple of V, rows and out 16-byte
// aligned); the loads of all num_topk rows are issued before the adds (up to kReduceBatch
// at a time) to keep them in flight.
constexpr int kReduceBatch = 8;

template <typename Row>
__global__ void combine_reduce_vec_kernel(const Row* __restrict__ rows, int64_t num_rows,
                                          const int32_t* __restrict__ route_pos, int64_t num_tokens,
                                          int64_t num_topk, int64_t hidden, float* __restrict__ out) {
  constexpr int V = 16 / static_cast<int>(sizeof(Row));
  const int64_t per_row = hidden / V, total = num_tokens * per_row;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = div_nonneg(idx, per_row), h = (idx - t * per_row) * V;
    float acc[V];
#pragma unroll
    for (int u = 0; u < V; ++u) acc[u] = 0.0f;
    for (int64_t k0 = 0; k0 < num_topk; k0 += kReduceBatch) {
      uint4 raw[kReduceBatch];
      bool ok[kReduceBatch];
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        const int64_t k = k0 + j;
        int64_t p = -1;
        if (k < num_topk) p = route_pos != nullptr ? static_cast<int64_t>(route_pos[t * num_topk + k]) : t * num_topk + k;
        ok[j] = p >= 0 && p < num_rows;
        if (ok[j]) raw[j] = __ldg(reinterpret_cast<const uint4*>(rows + p * hidden + h));
      }
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        if (!ok[j]) continue;
        float v[V];
        unpack(raw[j], v);
#pragma unroll
        for (int u = 0; u < V; ++u) acc[u] = fadd(acc[u], v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < V; u += 4)
      *reinterpret_cast<float4*>(out + t * hidden + h + u) = make_float4(acc[u], acc[u + 1], acc[u + 2], acc[u + 3]);
  }
}

template <typename Row>
moe_ep_status launch_combine_reduce(void* stream, const Row* rows, int64_t num_rows, const int32_t* route_pos,
                                    int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out) {
  constexpr int64_t V = 16 / static_cast<int64_t>(sizeof(Row));
  const int64_t total = num_tokens * hidden;
  if (total == 0) return MOE_EP_OK;
  const cudaStream_t s = as_stream(stream);
  if (hidden % V == 0 && aligned16(rows) && aligned16(out)) {
    combine_reduce_vec_kernel<Row><<<blocks_for(total / V), kThreads, 0, s>>>(rows, num_rows, route_pos, num_tokens,
                                                                              num_topk, hidden, out);
    MOE_EP_CUDA_CHECK_LAUNCH("combine_reduce_vec_kernel");
    return MOE_EP_OK;
  }
  combine_reduce_kernel<Row><<<blocks_for(total), kThreads, 0, s>>>(rows, num_rows, route_pos, num_tokens, num_topk,
                                                                    hidden, out);
  MOE_EP_CUDA_CHECK_LAUNCH("combine_reduce_kernel");
  return MOE_EP_OK;
}

// combine_reduce_round_trip: the sums of combine_reduce_vec_kernel over float32 rows, each
// route's row through the block format's round trip as it is read. Four values a lane
// (hidden a multiple of the block, rows and out 16-byte aligned): the kGroup = block / 4
// lanes of a block, which share a token and so a route, agree on its largest magnitude
// with shuffles, as fc2_epilogue_block_vec4_kernel does, and round trip their values with
// the same helpers (mxfp8_round_trip_cvt4, nvfp4_round_trip_with). A token's rows are
// loaded kReduceBatch at a time before any is rounded. Every lane of a warp runs every
// iteration (the shuffles need them); lanes past the end only look.
template <bool kMx>
__global__ void __launch_bounds__(kThreads)
    combine_reduce_round_trip_vec_kernel(const float4* __restrict__ rows, int64_t num_rows,
                                         const int32_t* __restrict__ route_pos, int64_t num_tokens,
                                         int64_t num_topk, int64_t hidden, float4* __restrict__ out) {
  constexpr int kGroup = (kMx ? kMxfp8Block : kNvfp4Block) / 4;
  const int64_t q = hidden / 4, total = num_tokens * q;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x} + threadIdx.x - lane; base < total; base += stride) {
    const int64_t idx = base + lane;
    const bool here = idx < total;
    const int64_t t = here ? div_nonneg(idx, q) : 0, h4 = idx - t * q;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t k0 = 0; k0 < num_topk; k0 += kReduceBatch) {
      float4 raw[kReduceBatch];
      bool ok[kReduceBatch];
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        const int64_t k = k0 + j;
        int64_t p = -1;
        if (here && k < num_topk)
          p = route_pos != nullptr ? static_cast<int64_t>(route_pos[t * num_topk + k]) : t * num_topk + k;
        ok[j] = p >= 0 && p < num_rows;
        raw[j] = ok[j] ? __ldg(rows + p * q + h4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        if (k0 + j >= num_topk) break;  // the same for every lane: the shuffles stay whole
        float v[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
        const BlockMax bm = group_block_max<kGroup>(v);  // a block's lanes are kGroup-aligned within the warp
        if (!ok[j]) continue;  // an unused slot adds nothing
        if constexpr (kMx) mxfp8_round_trip_cvt4(bm, v);
        else nvfp4_round_trip_with(bm, v, 4);
#pragma unroll
        for (int u = 0; u < 4; ++u) acc[u] = fadd(acc[u], v[u]);
      }
    }
    if (here) out[idx] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  }
}

// acc[0 .. len): the slot-order sum over token t's routes of a piece of len <= B columns of
// their rows (route r = t * num_topk + k at row route_pos[r], or r when route_pos is NULL;
// a row outside [0, num_rows) adds nothing), each piece read by load(p, v) and passed
// through round_trip(v) first. The per-thread sum of the scalar combine kernels below.
template <int B, typename Load, typename RoundTrip>
__device__ __forceinline__ void sum_routes(float (&acc)[B], int len, int64_t t, int64_t num_topk,
                                           const int32_t* __restrict__ route_pos, int64_t num_rows, Load load,
                                           RoundTrip round_trip) {
  for (int j = 0; j < B; ++j) acc[j] = 0.0f;
  for (int64_t k = 0; k < num_topk; ++k) {
    const int64_t r = t * num_topk + k;
    const int64_t p = route_pos != nullptr ? static_cast<int64_t>(route_pos[r]) : r;
    if (p < 0 || p >= num_rows) continue;
    float v[B];
    load(p, v);
    round_trip(v);
    for (int j = 0; j < len; ++j) acc[j] = fadd(acc[j], v[j]);
  }
}

// The same, one (token, block) a thread (any hidden, any alignment; the last block may be
// partial): the block's values of each route copied, round tripped, added into out.
template <bool kMx>
__global__ void combine_reduce_round_trip_kernel(const float* __restrict__ rows, int64_t num_rows,
                                                 const int32_t* __restrict__ route_pos, int64_t num_tokens,
                                                 int64_t num_topk, int64_t hidden, float* __restrict__ out) {
  constexpr int B = kMx ? kMxfp8Block : kNvfp4Block;
  const int64_t nb = div_up(hidden, int64_t{B}), total = num_tokens * nb;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = idx / nb, h0 = (idx - t * nb) * B;
    const int len = static_cast<int>(hidden - h0 < B ? hidden - h0 : B);
    float acc[B];
    sum_routes(
        acc, len, t, num_topk, route_pos, num_rows,
        [&](int64_t p, float (&v)[B]) {
          for (int j = 0; j < len; ++j) v[j] = rows[p * hidden + h0 + j];
        },
        [&](float (&v)[B]) {
          if constexpr (kMx) mxfp8_round_trip_block(v, len);
          else nvfp4_round_trip_block(v, len);
        });
    for (int j = 0; j < len; ++j) out[t * hidden + h0 + j] = acc[j];
  }
}

template <bool kMx>
moe_ep_status launch_combine_reduce_round_trip(cudaStream_t s, const float* rows, int64_t num_rows,
                                               const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                               int64_t hidden, float* out) {
  constexpr int64_t B = kMx ? kMxfp8Block : kNvfp4Block;
  if (hidden % B == 0 && aligned16(rows) && aligned16(out)) {
    combine_reduce_round_trip_vec_kernel<kMx><<<blocks_for(num_tokens * (hidden / 4)), kThreads, 0, s>>>(
        reinterpret_cast<const float4*>(rows), num_rows, route_pos, num_tokens, num_topk, hidden,
        reinterpret_cast<float4*>(out));
    MOE_EP_CUDA_CHECK_LAUNCH("combine_reduce_round_trip_vec_kernel");
    return MOE_EP_OK;
  }
  combine_reduce_round_trip_kernel<kMx><<<blocks_for(num_tokens * div_up(hidden, B)), kThreads, 0, s>>>(
      rows, num_rows, route_pos, num_tokens, num_topk, hidden, out);
  MOE_EP_CUDA_CHECK_LAUNCH("combine_reduce_round_trip_kernel");
  return MOE_EP_OK;
}

// ------------------------------------------------------------------ combine_reduce_encode
//
// The one-rank combine's last pass: the slot-order sums of combine_reduce (float32 or bf16
// rows; float32 rows optionally through a block format's round trip as they are read, as
// combine_reduce_round_trip), all NaN when *error is set, encoded straight into the output
// format. The float32 sum is never written: the encode reads it from registers.

// Stores the kN consecutive values v of one lane, elements e0..e0+kN-1 of the flat [T, H]
// output (H a multiple of 32, so that no block crosses a row and e0 / block is the block's
// scale index), in format kOut: bf16 bits, mxfp8 codes and E8M0 scales, nvfp4 packed codes
// and E4M3 scales, with the quantize kernels' helpers (the same bits as moe_ep_quantize of
// the sums). All 32 lanes must call it (the block formats' shuffles); only lanes with
// `here` store, the first lane of a block its scale.
template <int kOut, int kN>
__device__ __forceinline__ void store_encoded(const float (&v)[kN], int64_t e0, bool here, int lane,
                                              void* __restrict__ data, uint8_t* __restrict__ scale) {
  static_assert(kN == 4 || kN == 8, "four or eight values a lane");
  if constexpr (kOut == MOE_EP_FORMAT_BF16) {
    if (!here) return;
    uint32_t w[kN / 2];
#pragma unroll
    for (int j = 0; j < kN / 2; ++j)
      w[j] = bf16_pair(bf16_from_float(v[2 * j]), bf16_from_float(v[2 * j + 1]));
    uint16_t* d = static_cast<uint16_t*>(data) + e0;
    if constexpr (kN == 4) *reinterpret_cast<uint2*>(d) = make_uint2(w[0], w[1]);
    else *reinterpret_cast<uint4*>(d) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    constexpr int kBlock = kOut == MOE_EP_FORMAT_MXFP8 ? static_cast<int>(kMxfp8Block) : static_cast<int>(kNvfp4Block);
    constexpr int kGroup = kBlock / kN;  // lanes of one block
    const BlockMax bm = group_block_max<kGroup>(v);
    if (!here) return;
    const float(&a)[4] = *reinterpret_cast<const float(*)[4]>(&v[0]);
    const float(&b)[4] = *reinterpret_cast<const float(*)[4]>(&v[kN - 4]);
    uint32_t sc;
    if constexpr (kOut == MOE_EP_FORMAT_MXFP8) {
      sc = mxfp8_scale_code(bm);
      uint8_t* d = static_cast<uint8_t*>(data) + e0;
      if constexpr (kN == 4) *reinterpret_cast<uint32_t*>(d) = mxfp8_codes4(a, sc);
      else *reinterpret_cast<uint2*>(d) = make_uint2(mxfp8_codes4(a, sc), mxfp8_codes4(b, sc));
    } else {
      const Nvfp4Scale ns = nvfp4_scale_of(bm);
      sc = ns.code;
      uint8_t* d = static_cast<uint8_t*>(data) + e0 / 2;
      if constexpr (kN == 4) *reinterpret_cast<uint16_t*>(d) = static_cast<uint16_t>(nvfp4_codes4(a, ns.value));
      else *reinterpret_cast<uint32_t*>(d) = nvfp4_codes4(a, ns.value) | (nvfp4_codes4(b, ns.value) << 16);
    }
    if ((lane & (kGroup - 1)) == 0) scale[e0 / kBlock] = static_cast<uint8_t>(sc);
  }
}

// kN = 16 / sizeof(row element) values a lane from one 16-byte load a route (four float32
// or eight bf16), the loads of up to kReduceBatch routes issued before any is added, as
// combine_reduce_vec_kernel; kRt (float32 rows only) rounds each route's values through
// the block format first, as combine_reduce_round_trip_vec_kernel. hidden a multiple of
// 32, rows and the output 16-byte aligned. Every lane of a warp runs every iteration (the
// shuffles need them); lanes past the end only look.
template <bool kBf16Rows, int kRt, int kOut>
__global__ void __launch_bounds__(kThreads)
    combine_reduce_encode_vec_kernel(const uint4* __restrict__ rows, int64_t num_rows,
                                     const int32_t* __restrict__ route_pos, int64_t num_tokens, int64_t num_topk,
                                     int64_t hidden, const uint8_t* __restrict__ error, void* __restrict__ data,
                                     uint8_t* __restrict__ scale) {
  constexpr int kN = kBf16Rows ? 8 : 4;
  static_assert(!kBf16Rows || kRt == MOE_EP_FORMAT_NONE, "the round trip reads float32 rows");
  const int64_t q = hidden / kN, total = num_tokens * q;
  const bool poisoned = error != nullptr && *error != 0;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x} + threadIdx.x - lane; base < total; base += stride) {
    const int64_t idx = base + lane;
    const bool here = idx < total;
    const int64_t t = here ? div_nonneg(idx, q) : 0, hq = idx - t * q;
    float acc[kN];
#pragma unroll
    for (int u = 0; u < kN; ++u) acc[u] = 0.0f;  // +0
    for (int64_t k0 = 0; k0 < num_topk; k0 += kReduceBatch) {
      uint4 raw[kReduceBatch];
      bool ok[kReduceBatch];
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        const int64_t k = k0 + j;
        int64_t p = -1;
        if (here && k < num_topk)
          p = route_pos != nullptr ? static_cast<int64_t>(route_pos[t * num_topk + k]) : t * num_topk + k;
        ok[j] = p >= 0 && p < num_rows;
        raw[j] = ok[j] ? __ldg(rows + p * q + hq) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int j = 0; j < kReduceBatch; ++j) {
        if (k0 + j >= num_topk) break;  // the same for every lane: the shuffles stay whole
        float v[kN];
        unpack(raw[j], v);
        if constexpr (kRt != MOE_EP_FORMAT_NONE) {
          constexpr int kGroup = (kRt == MOE_EP_FORMAT_MXFP8 ? kMxfp8Block : kNvfp4Block) / 4;
          const BlockMax bm = group_block_max<kGroup>(v);
          if (!ok[j]) continue;  // an unused slot adds nothing
          if constexpr (kRt == MOE_EP_FORMAT_MXFP8) mxfp8_round_trip_cvt4(bm, v);
          else nvfp4_round_trip_with(bm, v, 4);
        } else if (!ok[j]) {
          continue;
        }
#pragma unroll
        for (int u = 0; u < kN; ++u) acc[u] = fadd(acc[u], v[u]);
      }
    }
    if (poisoned) {
#pragma unroll
      for (int u = 0; u < kN; ++u) acc[u] = bitsf(kQuietNaN);
    }
    store_encoded<kOut, kN>(acc, idx * kN, here, lane, data, scale);
  }
}

// The same, one (token, chunk of 32 columns) a thread (any hidden; the last chunk may be
// partial): each route's chunk copied (and round tripped block by block: 32 columns are one
// mxfp8 block or two nvfp4 ones), added, then encoded block by block of the output format
// with the encoders of the quantize kernels.
constexpr int kEncodeChunk = 32;

template <int kOut>
__global__ void combine_reduce_encode_kernel(const void* __restrict__ rows, bool bf16_rows, int32_t rt,
                                             int64_t num_rows, const int32_t* __restrict__ route_pos,
                                             int64_t num_tokens, int64_t num_topk, int64_t hidden,
                                             const uint8_t* __restrict__ error, void* __restrict__ data,
                                             uint8_t* __restrict__ scale) {
  const int64_t nc = div_up(hidden, int64_t{kEncodeChunk}), total = num_tokens * nc;
  const bool poisoned = error != nullptr && *error != 0;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = idx / nc, h0 = (idx - t * nc) * kEncodeChunk;
    const int len = static_cast<int>(hidden - h0 < kEncodeChunk ? hidden - h0 : kEncodeChunk);
    float acc[kEncodeChunk];
    sum_routes(
        acc, len, t, num_topk, route_pos, num_rows,
        [&](int64_t p, float (&v)[kEncodeChunk]) {
          for (int j = 0; j < len; ++j)
            v[j] = bf16_rows ? bf16_to_float(static_cast<const uint16_t*>(rows)[p * hidden + h0 + j])
                             : static_cast<const float*>(rows)[p * hidden + h0 + j];
        },
        [&](float (&v)[kEncodeChunk]) {
          if (rt == MOE_EP_FORMAT_MXFP8) {
            mxfp8_round_trip_block(v, len);
          } else if (rt == MOE_EP_FORMAT_NVFP4) {
            for (int b = 0; b < len; b += static_cast<int>(kNvfp4Block))
              nvfp4_round_trip_block(v + b, len - b < kNvfp4Block ? len - b : static_cast<int>(kNvfp4Block));
          }
        });
    if (poisoned)
      for (int j = 0; j < len; ++j) acc[j] = bitsf(kQuietNaN);
    if constexpr (kOut == MOE_EP_FORMAT_BF16) {
      uint16_t* d = static_cast<uint16_t*>(data) + t * hidden + h0;
      for (int j = 0; j < len; ++j) d[j] = bf16_from_float(acc[j]);
    } else if constexpr (kOut == MOE_EP_FORMAT_MXFP8) {
      mxfp8_encode_block(acc, 1, len, static_cast<uint8_t*>(data) + t * hidden + h0, 1,
                         scale + t * div_up(hidden, int64_t{kMxfp8Block}) + h0 / kMxfp8Block);
    } else {
      uint8_t* d = static_cast<uint8_t*>(data) + t * div_up(hidden, int64_t{2}) + h0 / 2;
      uint8_t* sc = scale + t * div_up(hidden, int64_t{kNvfp4Block}) + h0 / kNvfp4Block;
      for (int b = 0; b < len; b += static_cast<int>(kNvfp4Block)) {
        const int n = len - b < kNvfp4Block ? len - b : static_cast<int>(kNvfp4Block);
        const Nvfp4Scale ns = nvfp4_block_scale(acc + b, 1, n);
        for (int j = 0; j < n; j += 2) {
          const uint32_t lo = nvfp4_code(fbits(acc[b + j]), ns.value);
          const uint32_t hi = j + 1 < n ? nvfp4_code(fbits(acc[b + j + 1]), ns.value) : 0u;
          d[(b + j) / 2] = static_cast<uint8_t>((lo & 0xFu) | ((hi & 0xFu) << 4));
        }
        sc[b / kNvfp4Block] = static_cast<uint8_t>(ns.code);
      }
    }
  }
}

struct EncodeArgs {
  const void* rows;
  int64_t num_rows;
  const int32_t* route_pos;
  int64_t num_tokens, num_topk, hidden;
  const uint8_t* error;
  void* data;
  uint8_t* scale;
};

template <bool kBf16Rows, int kRt, int kOut>
void launch_encode_vec(cudaStream_t s, const EncodeArgs& a) {
  const int64_t lanes = a.num_tokens * (a.hidden / (kBf16Rows ? 8 : 4));
  combine_reduce_encode_vec_kernel<kBf16Rows, kRt, kOut><<<blocks_for(lanes), kThreads, 0, s>>>(
      static_cast<const uint4*>(a.rows), a.num_rows, a.route_pos, a.num_tokens, a.num_topk, a.hidden, a.error, a.data,
      a.scale);
}

template <int kOut>
void launch_encode_vec_rows(cudaStream_t s, bool bf16_rows, int32_t rt, const EncodeArgs& a) {
  if (bf16_rows) return launch_encode_vec<true, MOE_EP_FORMAT_NONE, kOut>(s, a);
  if (rt == MOE_EP_FORMAT_MXFP8) return launch_encode_vec<false, MOE_EP_FORMAT_MXFP8, kOut>(s, a);
  if (rt == MOE_EP_FORMAT_NVFP4) return launch_encode_vec<false, MOE_EP_FORMAT_NVFP4, kOut>(s, a);
  return launch_encode_vec<false, MOE_EP_FORMAT_NONE, kOut>(s, a);
}

template <int kOut>
void launch_encode_as(cudaStream_t s, bool vec, bool bf16_rows, int32_t rt, const EncodeArgs& a) {
  if (vec) return launch_encode_vec_rows<kOut>(s, bf16_rows, rt, a);
  combine_reduce_encode_kernel<kOut><<<blocks_for(a.num_tokens * div_up(a.hidden, int64_t{kEncodeChunk})), kThreads,
                                       0, s>>>(a.rows, bf16_rows, rt, a.num_rows, a.route_pos, a.num_tokens,
                                               a.num_topk, a.hidden, a.error, a.data, a.scale);
}

template <typename V>
moe_ep_status launch_permute(cudaStream_t s, const void* tokens, int64_t num_routes, int64_t num_topk,
                             int64_t row_bytes, const int32_t* send_route, int64_t num_rows, void* dst) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(V));
  permute_rows_kernel<V><<<blocks_for(div_up(num_rows * units, kPermuteUnroll)), kThreads, 0, s>>>(
      static_cast<const V*>(tokens), num_routes, num_topk, units, send_route, num_rows, static_cast<V*>(dst));
  MOE_EP_CUDA_CHECK_LAUNCH("permute_rows_kernel");
  return MOE_EP_OK;
}

// The widest unit that divides row_bytes and to which both base pointers are aligned.
bool fits_unit(int64_t row_bytes, const void* a, const void* b, size_t unit) {
  return row_bytes % static_cast<int64_t>(unit) == 0 && aligned_to(a, unit) && aligned_to(b, unit);
}

// Multi-block or one block. MOE_EP_PLAN_ROUTES=single|multi overrides the
// automatic choice (timing and tests of both ways; "multi" where it can run: a
// unit's counters in shared memory and at least E + 2 route ids).
bool plan_multi_block(int64_t num_routes, int64_t num_experts) {
  const int64_t row = num_experts + 2;
  const bool can = row <= kPlanSmemInts && num_routes >= row;
  const char* force = std::getenv("MOE_EP_PLAN_ROUTES");
  if (force != nullptr && std::strcmp(force, "single") == 0) return false;
  if (force != nullptr && std::strcmp(force, "multi") == 0) return can;
  return can && num_routes >= std::max(kPlanMultiMinRoutes, 2 * row);
}

}  // namespace

moe_ep_status plan_routes(void* stream, const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                          int64_t num_experts, int32_t* send_route, int32_t* route_pos, int32_t* route_expert,
                          int32_t* counts) {
  const int64_t num_routes = num_tokens * num_topk;
  if (num_experts < 1 || num_experts > INT32_MAX - 2 * kPlanThreads || num_routes >= INT32_MAX)
    return fail(MOE_EP_ERR_INTERNAL, "cuda::plan_routes: sizes out of range (capi checks them)");
  const cudaStream_t s = as_stream(stream);
  const int E = static_cast<int>(num_experts);
  const int64_t row = num_experts + 2;  // a unit's counters
  if (plan_multi_block(num_routes, num_experts)) {
    const int64_t num_units =  // >= 1 (num_routes >= row), each unit >= row ids
        std::max<int64_t>(1, std::min(kPlanMaxUnits, num_routes / std::max(row, kPlanUnitMinRoutes)));
    const int warps = static_cast<int>(std::min<int64_t>(kPlanMaxWarps, kPlanSmemInts / row));           // >= 1
    const unsigned blocks = static_cast<unsigned>(div_up(num_units, warps));
    const size_t smem = static_cast<size_t>(warps * row) * sizeof(int);
    plan_hist_kernel<<<blocks, warps * 32, smem, s>>>(topk_idx, num_routes, E, num_units, route_pos, route_expert);
    MOE_EP_CUDA_CHECK_LAUNCH("plan_hist_kernel");
    plan_scan_kernel<<<static_cast<unsigned>(div_up(row, 32)), dim3(32, kPlanScanGroups), 0, s>>>(
        num_routes, E, num_units, route_pos, counts);
    MOE_EP_CUDA_CHECK_LAUNCH("plan_scan_kernel");
    plan_place_kernel<<<blocks, warps * 32, smem, s>>>(topk_idx, num_routes, E, num_units, counts, send_route,
                                                       route_pos);
    MOE_EP_CUDA_CHECK_LAUNCH("plan_place_kernel");
    return MOE_EP_OK;
  }
  const bool shared = num_experts <= kPlanSharedExperts;
  const size_t smem = shared ? static_cast<size_t>(num_experts) * sizeof(int) : 0;
  // Always launched: counts is written even when there are no routes.
  plan_routes_kernel<<<1, kPlanThreads, smem, s>>>(topk_idx, num_routes, E, send_route, route_pos, route_expert,
                                                   counts, shared ? 1 : 0);
  MOE_EP_CUDA_CHECK_LAUNCH("plan_routes_kernel");
  return MOE_EP_OK;
}

namespace {

constexpr int kRecordThreads = 256;

// moe_ep_record_step: one block sums the aligned counts, thread 0 updates the record.
__global__ void __launch_bounds__(kRecordThreads)
    record_step_kernel(const int32_t* __restrict__ error, const int32_t* __restrict__ tpe, int64_t n,
                       int64_t alignment, int64_t* record) {
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh): after a combine's kernel
  __shared__ int64_t s_part[kRecordThreads / 32];
  int64_t rows = 0;
  for (int64_t le = threadIdx.x; le < n; le += blockDim.x) {
    const int64_t c = tpe[le];
    rows += (c + alignment - 1) / alignment * alignment;
  }
  for (int o = 16; o > 0; o >>= 1) rows += __shfl_xor_sync(0xffffffffu, rows, o);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = rows;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t all = 0;
    for (int w = 0; w < kRecordThreads / 32; ++w) all += s_part[w];
    record[0] |= static_cast<int64_t>(*error);
    record[1] = all > record[1] ? all : record[1];
  }
}

}  // namespace

moe_ep_status record_step(void* stream, const int32_t* error, const int32_t* tokens_per_expert,
                          int64_t num_local_experts, int64_t alignment, int64_t* record) {
  (void)launch_pdl(record_step_kernel, 1, kRecordThreads, 0, as_stream(stream), error, tokens_per_expert,
                   num_local_experts, alignment, record);
  MOE_EP_CUDA_CHECK_LAUNCH("record_step_kernel");
  return MOE_EP_OK;
}

moe_ep_status permute_rows(void* stream, const void* tokens, int64_t num_tokens, int64_t num_topk, int64_t row_bytes,
                           const int32_t* send_route, int64_t num_rows, void* dst) {
  if (num_rows == 0 || row_bytes == 0) return MOE_EP_OK;
  const cudaStream_t s = as_stream(stream);
  const int64_t num_routes = num_tokens * num_topk;
  if (fits_unit(row_bytes, tokens, dst, 16))
    return launch_permute<uint4>(s, tokens, num_routes, num_topk, row_bytes, send_route, num_rows, dst);
  if (fits_unit(row_bytes, tokens, dst, 4))
    return launch_permute<uint32_t>(s, tokens, num_routes, num_topk, row_bytes, send_route, num_rows, dst);
  if (fits_unit(row_bytes, tokens, dst, 2))
    return launch_permute<uint16_t>(s, tokens, num_routes, num_topk, row_bytes, send_route, num_rows, dst);
  return launch_permute<uint8_t>(s, tokens, num_routes, num_topk, row_bytes, send_route, num_rows, dst);
}

moe_ep_status combine_reduce_encode(void* stream, moe_ep_dtype rows_dtype, moe_ep_format round_trip, const void* rows,
                                    int64_t num_rows, const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                    int64_t hidden, const uint8_t* error, moe_ep_format out_format, void* out_data,
                                    void* out_scale) {
  const cudaStream_t s = as_stream(stream);
  const bool bf16_rows = rows_dtype == MOE_EP_DTYPE_BF16;
  const int32_t rt = static_cast<int32_t>(round_trip);
  // 16-byte loads and whole blocks a lane group: every block format's block divides 32.
  const bool vec = hidden % kEncodeChunk == 0 && aligned16(rows) && aligned16(out_data);
  const EncodeArgs a{rows, num_rows, route_pos, num_tokens, num_topk, hidden, error, out_data,
                     static_cast<uint8_t*>(out_scale)};
  switch (out_format) {
    case MOE_EP_FORMAT_BF16: launch_encode_as<MOE_EP_FORMAT_BF16>(s, vec, bf16_rows, rt, a); break;
    case MOE_EP_FORMAT_MXFP8: launch_encode_as<MOE_EP_FORMAT_MXFP8>(s, vec, bf16_rows, rt, a); break;
    default: launch_encode_as<MOE_EP_FORMAT_NVFP4>(s, vec, bf16_rows, rt, a); break;
  }
  MOE_EP_CUDA_CHECK_LAUNCH(vec ? "combine_reduce_encode_vec_kernel" : "combine_reduce_encode_kernel");
  return MOE_EP_OK;
}

moe_ep_status combine_reduce(void* stream, const float* rows, int64_t num_rows, const int32_t* route_pos,
                             int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out) {
  return launch_combine_reduce(stream, rows, num_rows, route_pos, num_tokens, num_topk, hidden, out);
}

moe_ep_status combine_reduce_bf16(void* stream, const uint16_t* rows, int64_t num_rows, const int32_t* route_pos,
                                  int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out) {
  return launch_combine_reduce(stream, rows, num_rows, route_pos, num_tokens, num_topk, hidden, out);
}

moe_ep_status combine_reduce_round_trip(void* stream, moe_ep_format fmt, const float* rows, int64_t num_rows,
                                        const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                        int64_t hidden, float* out) {
  const cudaStream_t s = as_stream(stream);
  if (fmt == MOE_EP_FORMAT_MXFP8)
    return launch_combine_reduce_round_trip<true>(s, rows, num_rows, route_pos, num_tokens, num_topk, hidden, out);
  return launch_combine_reduce_round_trip<false>(s, rows, num_rows, route_pos, num_tokens, num_topk, hidden, out);
}

}  // namespace cuda
}  // namespace moe_ep
