// CUDA routing: the route plan (a stable counting sort of route ids by expert,
// one thread block, no host synchronisation), the permutation of token rows
// into send order, and the Form-A combine reduction.
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "internal.h"

namespace moe_ep {
namespace cuda {
namespace {

using namespace detail;

constexpr int kPlanThreads = 1024;
// Per-expert cursors live in shared memory when they fit (E * 4 bytes next to
// the kernel's static shared memory, under the 48 KiB default); otherwise the
// kernel uses the `counts` output itself as its cursor array (global memory,
// same code through a generic pointer) and rewrites it at the end.
constexpr int64_t kPlanSharedExperts = 10240;

// plan_routes in one block of kPlanThreads threads, over N = T * K route ids.
// Buckets: expert e in [0, E) for a routed id; one "unrouted" bucket (-1 slots
// and bad ids, which fill the tail of send_route in route order).
//  1. histogram of routed ids per expert (atomics), bad-id count, route_expert;
//  2. in-place exclusive prefix sum of the histogram: each expert's first send
//     position; the unrouted cursor starts at their total;
//  3. placement, chunk by chunk of kPlanThreads route ids in route order, and
//     inside a chunk warp by warp (one warp per step, __syncthreads between):
//     lanes with the same bucket (__match_any_sync) take consecutive positions
//     in lane order from the bucket's cursor, and the group's lowest lane then
//     advances the cursor. Route order is therefore kept within every bucket:
//     the sort is stable by route id;
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
    for (int w = 0; w < nwarps; ++w) {
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

// One thread per 16/4/2/1-byte unit of the destination: row i copies token
// send_route[i] / K, or writes zeros for -1 and for an id outside [0, T * K).
template <typename V>
__global__ void permute_rows_kernel(const V* __restrict__ tokens, int64_t num_routes, int64_t num_topk,
                                    int64_t units_per_row, const int32_t* __restrict__ send_route, int64_t num_rows,
                                    V* __restrict__ dst) {
  const int64_t total = num_rows * units_per_row;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = t / units_per_row, u = t - row * units_per_row;
    const int64_t route = send_route[row];
    V v{};
    if (route >= 0 && route < num_routes) v = tokens[(route / num_topk) * units_per_row + u];
    dst[t] = v;
  }
}

// One thread per output element (t, h): out = (((+0 + Y[t,0]) + Y[t,1]) + ...)
// in slot order, adding nothing for a -1 position or one outside [0, num_rows).
__global__ void combine_reduce_kernel(const float* __restrict__ rows, int64_t num_rows,
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
      if (p >= 0 && p < num_rows) acc = fadd(acc, rows[p * hidden + h]);
    }
    out[idx] = acc;
  }
}

template <typename V>
moe_ep_status launch_permute(cudaStream_t s, const void* tokens, int64_t num_routes, int64_t num_topk,
                             int64_t row_bytes, const int32_t* send_route, int64_t num_rows, void* dst) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(V));
  permute_rows_kernel<V><<<blocks_for(num_rows * units), kThreads, 0, s>>>(
      static_cast<const V*>(tokens), num_routes, num_topk, units, send_route, num_rows, static_cast<V*>(dst));
  MOE_EP_CUDA_CHECK_LAUNCH("permute_rows_kernel");
  return MOE_EP_OK;
}

// The widest unit that divides row_bytes and to which both base pointers are aligned.
bool fits_unit(int64_t row_bytes, const void* a, const void* b, size_t unit) {
  return row_bytes % static_cast<int64_t>(unit) == 0 && reinterpret_cast<uintptr_t>(a) % unit == 0 &&
         reinterpret_cast<uintptr_t>(b) % unit == 0;
}

}  // namespace

moe_ep_status plan_routes(void* stream, const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                          int64_t num_experts, int32_t* send_route, int32_t* route_pos, int32_t* route_expert,
                          int32_t* counts) {
  const int64_t num_routes = num_tokens * num_topk;
  if (num_experts < 1 || num_experts > INT32_MAX - 2 * kPlanThreads || num_routes >= INT32_MAX)
    return fail(MOE_EP_ERR_INTERNAL, "cuda::plan_routes: sizes out of range (capi checks them)");
  const bool shared = num_experts <= kPlanSharedExperts;
  const size_t smem = shared ? static_cast<size_t>(num_experts) * sizeof(int) : 0;
  // Always launched: counts is written even when there are no routes.
  plan_routes_kernel<<<1, kPlanThreads, smem, as_stream(stream)>>>(topk_idx, num_routes, static_cast<int>(num_experts),
                                                                   send_route, route_pos, route_expert, counts,
                                                                   shared ? 1 : 0);
  MOE_EP_CUDA_CHECK_LAUNCH("plan_routes_kernel");
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

moe_ep_status combine_reduce(void* stream, const float* rows, int64_t num_rows, const int32_t* route_pos,
                             int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out) {
  const int64_t total = num_tokens * hidden;
  if (total == 0) return MOE_EP_OK;
  combine_reduce_kernel<<<blocks_for(total), kThreads, 0, as_stream(stream)>>>(rows, num_rows, route_pos, num_tokens,
                                                                                num_topk, hidden, out);
  MOE_EP_CUDA_CHECK_LAUNCH("combine_reduce_kernel");
  return MOE_EP_OK;
}

}  // namespace cuda
}  // namespace moe_ep
