// The device exchange's kernels (include/moe_ep_native.h, section "exchange";
// the CPU twin in exchange.cc runs the same steps on host memory).
//
// Every stage is a short sequence of kernels on the caller's stream, none of
// which the host waits for (capturable in a CUDA graph; the step numbers live
// on the device, so replays advance them):
//   dispatch: begin (step number, send-side prefix, wait for the receivers'
//             acknowledgement of the previous step) -> send (one warp per
//             (token, destination rank): the token's K route records, and its
//             row once if any of its routes goes there, stored into the
//             receiver's region) -> sync (system fence, publish the step in every
//             peer's flag with a release store, wait for every peer's flag with
//             acquire loads, offsets from the gathered count table) -> place
//             (local copies of the received rows into the expert-major buffer,
//             padding rows zeroed) -> ack.
//   combine:  begin -> send (per (source rank, token) one float32 row: the
//             routes here summed in slot order, or one row per route) -> sync ->
//             finish (the home rank's sum, NaN on any error) -> ack.
// Every wait is bounded by the layer's timeout (%globaltimer): on expiry the
// step's error gets MOE_EP_EXCHANGE_TIMEOUT, which travels to the peers in the
// flags, and the kernels finish without the missing data.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "cuda/common.cuh"
#include "exchange.h"

namespace moe_ep {
namespace cuda {
namespace {

using ex::RouteMeta;

struct Dev {
  ex::Shape s;
  ex::SymLayout L;
  ex::Local l;
  char* own;  // this rank's region (peers write here)
  uint64_t timeout_ns;
};

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t* flag_at(char* region, int64_t off, int32_t i) {
  return reinterpret_cast<uint64_t*>(region + off) + i;
}

__device__ __forceinline__ char* peer(const Dev& d, int32_t p) { return reinterpret_cast<char*>(d.l.peers[p]); }

// Waits until `ready(*p)`, at most timeout_ns from t0; returns the last value and sets *late on expiry.
template <typename Ready>
__device__ uint64_t bounded_wait(const uint64_t* p, uint64_t t0, uint64_t timeout_ns, Ready ready, bool* late) {
  uint64_t v = ld_acquire_sys(p);
  while (!ready(v)) {
    if (globaltimer() - t0 > timeout_ns) {
      *late = true;
      return v;
    }
    __nanosleep(128);
    v = ld_acquire_sys(p);
  }
  return v;
}

// One warp copies `bytes` bytes (16-byte pieces when both ends and the size allow).
__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += 32) d4[i] = s4[i];
  } else if ((a & 3) == 0) {
    const int* s4 = reinterpret_cast<const int*>(src);
    int* d4 = reinterpret_cast<int*>(dst);
    for (int64_t i = lane; i < bytes / 4; i += 32) d4[i] = s4[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ void warp_zero(char* dst, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    int4* d4 = reinterpret_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += 32) d4[i] = make_int4(0, 0, 0, 0);
  } else {
    for (int64_t i = lane; i < bytes; i += 32) dst[i] = 0;
  }
}

__device__ __forceinline__ int64_t warp_id() { return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int64_t num_warps() { return (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5; }

// Waits for every peer's value at region[off][p] (lanes over peers); returns the OR of the
// error bits the flags carry, plus kTimeout when one did not come. One warp.
template <typename Ready>
__device__ int32_t wait_peers(const Dev& d, int64_t off, Ready ready, bool carry) {
  const int lane = threadIdx.x & 31;
  const uint64_t t0 = globaltimer();
  int32_t err = 0;
  for (int32_t p = lane; p < d.s.N; p += 32) {
    bool late = false;
    const uint64_t v = bounded_wait(flag_at(d.own, off, p), t0, d.timeout_ns, ready, &late);
    if (late) err |= ex::kTimeout;
    else if (carry) err |= static_cast<int32_t>(v & 0xff);
  }
  return __reduce_or_sync(0xffffffffu, err);
}

__device__ void publish(const Dev& d, int64_t off, uint64_t value) {
  __threadfence_system();
  for (int32_t p = threadIdx.x & 31; p < d.s.N; p += 32) st_release_sys(flag_at(peer(d, p), off, d.s.rank), value);
}

// ------------------------------------------------------------------ dispatch

__global__ void dispatch_begin(Dev d, int64_t T) {  // <<<1, 32>>>
  const int lane = threadIdx.x;
  const uint64_t seq = d.l.seq[0] + 1;
  if (lane == 0) {
    d.l.seq[0] = seq;
    *d.l.t_me = static_cast<int32_t>(T);
    if (T == 0)
      for (int64_t g = 0; g <= d.s.E; ++g) d.l.counts[g] = 0;
    int64_t run = 0;
    for (int64_t g = 0; g < d.s.E; ++g) {
      d.l.excl[g] = static_cast<int32_t>(run);
      run += d.l.counts[g];
    }
  }
  const int32_t err = wait_peers(d, d.L.disp_ack, [seq](uint64_t v) { return v + 1 >= seq; }, false);
  if (lane == 0) *d.l.step_err = err;
}

__global__ void dispatch_send(Dev d, int64_t T, int64_t row_bytes, const char* __restrict__ tokens,
                              const float* __restrict__ weights) {
  const ex::Shape& s = d.s;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = gtid; r < T * s.K; r += gthreads) {
    const int32_t g = d.l.route_expert[r];
    d.l.route_dest[r] = g >= 0 ? static_cast<int32_t>(g / s.El) : -1;
  }
  if (*d.l.step_err & ex::kTimeout) return;
  if (blockIdx.x == 0) {
    const int64_t row = s.E + 2;
    for (int64_t i = threadIdx.x; i < s.N * row; i += blockDim.x) {
      const int32_t p = static_cast<int32_t>(i / row);
      const int64_t j = i % row;
      int32_t* table = reinterpret_cast<int32_t*>(peer(d, p) + d.L.table);
      table[static_cast<int64_t>(s.rank) * row + j] = j <= s.E ? d.l.counts[j] : static_cast<int32_t>(T);
    }
  }
  const int lane = threadIdx.x & 31;
  for (int64_t item = warp_id(); item < T * s.N; item += num_warps()) {
    const int64_t t = item / s.N;
    const int32_t p = static_cast<int32_t>(item % s.N);
    char* base = peer(d, p);
    RouteMeta* meta = reinterpret_cast<RouteMeta*>(base + d.L.dmeta) + (static_cast<int64_t>(s.rank) * s.Tmax + t) * s.K;
    bool has = false;
    for (int64_t k = lane; k < s.K; k += 32) {
      const int64_t r = t * s.K + k;
      const int32_t g = d.l.route_expert[r];
      RouteMeta m{-1, 0, 0.0f, 0};
      if (g >= 0 && g / s.El == p) {
        m.le = static_cast<int32_t>(g % s.El);
        m.pos = d.l.route_pos[r] - d.l.excl[g];
        m.w = weights[r];
        has = true;
      }
      meta[k] = m;
    }
    if (__any_sync(0xffffffffu, has))
      warp_copy(base + d.L.drows + (static_cast<int64_t>(s.rank) * s.Tmax + t) * s.stride, tokens + t * row_bytes,
                row_bytes, lane);
  }
}

__global__ void dispatch_sync(Dev d, int32_t* out_gs, int32_t* out_tpe, int32_t* out_error) {  // <<<1, 32>>>
  const uint64_t seq = d.l.seq[0];
  int32_t err = *d.l.step_err;
  publish(d, d.L.disp_flag, ex::flag_value(seq, err));
  err |= wait_peers(d, d.L.disp_flag, [seq](uint64_t v) { return ex::flag_step(v) >= seq; }, true);
  __syncwarp();
  __threadfence_system();
  if (threadIdx.x == 0) {
    const int32_t* table = reinterpret_cast<const int32_t*>(d.own + d.L.table);
    err |= ex::plan_from_table(d.s, table, (err & ex::kTimeout) != 0, d.l.off, d.l.nloc, d.l.pref, d.l.tsrc);
    *d.l.step_err = err;
    atomicOr(d.l.sticky_err, err);
    *out_error = err;
    for (int64_t le = 0; le < d.s.El; ++le) {
      out_gs[le] = ex::group_size(d.s, d.l.off, le);
      if (out_tpe != nullptr) out_tpe[le] = d.l.nloc[le];
    }
  }
}

// Whether buffer row r is padding (off is non-decreasing: binary search).
__device__ bool padding_row(const Dev& d, int64_t r) {
  const int32_t* off = d.l.off;
  if (r >= off[d.s.El]) return true;
  int64_t lo = 0, hi = d.s.El;  // the last le with off[le] <= r
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (off[mid] <= r) lo = mid;
    else hi = mid;
  }
  return r - off[lo] >= d.l.nloc[lo];
}

__global__ void dispatch_place(Dev d, int64_t row_bytes, char* __restrict__ out_tokens, float* __restrict__ out_w,
                               int32_t* __restrict__ out_meta) {
  const ex::Shape& s = d.s;
  const int lane = threadIdx.x & 31;
  const int64_t received = s.N * s.Tmax;
  for (int64_t item = warp_id(); item < received + s.C; item += num_warps()) {
    if (item < received) {
      const int32_t src = static_cast<int32_t>(item / s.Tmax);
      const int64_t t = item % s.Tmax;
      if (t >= d.l.tsrc[src]) continue;
      const RouteMeta* meta = reinterpret_cast<const RouteMeta*>(d.own + d.L.dmeta) + item * s.K;
      const char* row_src = d.own + d.L.drows + item * s.stride;
      for (int64_t k = 0; k < s.K; ++k) {
        const RouteMeta m = meta[k];
        const int32_t row = m.le >= 0 ? ex::route_row(s, d.l.off, d.l.pref, src, m.le, m.pos) : -1;
        if (lane == 0) {
          d.l.rowmap[item * s.K + k] = row;
          if (row >= 0) {
            out_w[row] = m.w;
            int32_t* md = out_meta + 4 * static_cast<int64_t>(row);
            md[0] = m.le, md[1] = src, md[2] = static_cast<int32_t>(t), md[3] = static_cast<int32_t>(k);
          }
        }
        if (row >= 0) warp_copy(out_tokens + row * row_bytes, row_src, row_bytes, lane);
      }
    } else {
      const int64_t r = item - received;
      if (!padding_row(d, r)) continue;
      warp_zero(out_tokens + r * row_bytes, row_bytes, lane);
      if (lane == 0) {
        out_w[r] = 0.0f;
        for (int c = 0; c < 4; ++c) out_meta[4 * r + c] = -1;
      }
    }
  }
}

__global__ void stage_ack(Dev d, int which, int64_t ack_off) {  // <<<1, 32>>>
  publish(d, ack_off, d.l.seq[which]);
}

// ------------------------------------------------------------------ combine

__global__ void combine_begin(Dev d) {  // <<<1, 32>>>
  const uint64_t seq = d.l.seq[1] + 1;
  const int32_t err = wait_peers(d, d.L.comb_ack, [seq](uint64_t v) { return v + 1 >= seq; }, false);
  __syncwarp();
  if (threadIdx.x == 0) {
    d.l.seq[1] = seq;
    *d.l.step_err |= err;
  }
}

__global__ void combine_send(Dev d, const float* __restrict__ y, const float* __restrict__ row_values) {
  const ex::Shape& s = d.s;
  if (*d.l.step_err & ex::kTimeout) return;
  const int lane = threadIdx.x & 31;
  const bool vec = (s.H % 4 == 0) && (reinterpret_cast<uintptr_t>(y) % 16 == 0);
  for (int64_t item = warp_id(); item < s.N * s.Tmax; item += num_warps()) {
    const int32_t src = static_cast<int32_t>(item / s.Tmax);
    const int64_t t = item % s.Tmax;
    if (t >= d.l.tsrc[src]) continue;
    const int32_t* rm = d.l.rowmap + item * s.K;
    char* base = peer(d, src);
    float* crows = reinterpret_cast<float*>(base + d.L.crows);
    bool has = false;
    for (int64_t k = 0; k < s.K; ++k) {
      const int32_t row = rm[k];
      if (row < 0) continue;
      has = true;
      if (row_values != nullptr && lane == 0) reinterpret_cast<float*>(base + d.L.cvals)[t * s.K + k] = row_values[row];
      if (s.order == 1)
        warp_copy(reinterpret_cast<char*>(crows + (k * s.Tmax + t) * s.H),
                  reinterpret_cast<const char*>(y + static_cast<int64_t>(row) * s.H), 4 * s.H, lane);
    }
    if (s.order == 1 || !has) continue;
    float* dst = crows + (static_cast<int64_t>(s.rank) * s.Tmax + t) * s.H;
    if (vec) {
      for (int64_t h = 4 * lane; h < s.H; h += 128) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int64_t k = 0; k < s.K; ++k) {
          const int32_t row = rm[k];
          if (row < 0) continue;
          const float4 v = *reinterpret_cast<const float4*>(y + static_cast<int64_t>(row) * s.H + h);
          acc.x = __fadd_rn(acc.x, v.x), acc.y = __fadd_rn(acc.y, v.y);
          acc.z = __fadd_rn(acc.z, v.z), acc.w = __fadd_rn(acc.w, v.w);
        }
        *reinterpret_cast<float4*>(dst + h) = acc;
      }
    } else {
      for (int64_t h = lane; h < s.H; h += 32) {
        float acc = 0.0f;
        for (int64_t k = 0; k < s.K; ++k)
          if (rm[k] >= 0) acc = __fadd_rn(acc, y[static_cast<int64_t>(rm[k]) * s.H + h]);
        dst[h] = acc;
      }
    }
  }
}

__global__ void combine_sync(Dev d) {  // <<<1, 32>>>
  const uint64_t seq = d.l.seq[1];
  int32_t err = *d.l.step_err;
  publish(d, d.L.comb_flag, ex::flag_value(seq, err));
  err |= wait_peers(d, d.L.comb_flag, [seq](uint64_t v) { return ex::flag_step(v) >= seq; }, true);
  __syncwarp();
  __threadfence_system();
  if (threadIdx.x == 0) {
    *d.l.step_err = err;
    atomicOr(d.l.sticky_err, err);
  }
}

__global__ void combine_finish(Dev d, int64_t T, float* __restrict__ out, float* __restrict__ out_values,
                               int32_t* out_error) {
  const ex::Shape& s = d.s;
  const int lane = threadIdx.x & 31;
  const int32_t err = *d.l.step_err;
  if (out_error != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *out_error = err;
  const float nan = __int_as_float(0x7fc00000);
  const float* crows = reinterpret_cast<const float*>(d.own + d.L.crows);
  const float* cvals = reinterpret_cast<const float*>(d.own + d.L.cvals);
  for (int64_t t = warp_id(); t < T; t += num_warps()) {
    const int32_t* dest = d.l.route_dest + t * s.K;
    for (int64_t h = lane; h < s.H; h += 32) {
      float acc = 0.0f;
      if (s.order == 1) {
        for (int64_t k = 0; k < s.K; ++k)
          if (dest[k] >= 0) acc = __fadd_rn(acc, crows[(k * s.Tmax + t) * s.H + h]);
      } else {
        for (int32_t p = 0; p < s.N; ++p) {
          bool here = false;
          for (int64_t k = 0; k < s.K; ++k) here = here || dest[k] == p;
          if (here) acc = __fadd_rn(acc, crows[(static_cast<int64_t>(p) * s.Tmax + t) * s.H + h]);
        }
      }
      out[t * s.H + h] = err ? nan : acc;
    }
    if (out_values != nullptr)
      for (int64_t k = lane; k < s.K; k += 32)
        out_values[t * s.K + k] = err ? nan : (dest[k] >= 0 ? cvals[t * s.K + k] : 0.0f);
  }
}

Dev make_dev(const Exchange& x) {
  Dev d;
  d.s = x.shape;
  d.L = x.sym;
  d.l = x.loc;
  d.own = static_cast<char*>(x.region);
  d.timeout_ns = static_cast<uint64_t>(x.timeout_ms) * 1000000ull;
  return d;
}

moe_ep_status cuda_fail(const char* what, cudaError_t err) {
  return fail(MOE_EP_ERR_CUDA, std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace

moe_ep_status ex_alloc_zero(int cuda_device, size_t bytes, void** out) {
  cudaError_t err = cudaSetDevice(cuda_device);
  if (err == cudaSuccess) err = cudaMalloc(out, bytes);
  if (err == cudaSuccess) err = cudaMemset(*out, 0, bytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return cuda_fail("moe_ep_layer_create: the exchange's memory", err);
  return MOE_EP_OK;
}

moe_ep_status ex_free(void* p) {
  const cudaError_t err = cudaFree(p);
  return err == cudaSuccess ? MOE_EP_OK : cuda_fail("moe_ep_layer_destroy: cudaFree", err);
}

moe_ep_status ex_copy_to_device(int cuda_device, void* dst, const void* src, size_t bytes) {
  cudaError_t err = cudaSetDevice(cuda_device);
  if (err == cudaSuccess) err = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  return err == cudaSuccess ? MOE_EP_OK : cuda_fail("moe_ep_layer_set_peers: cudaMemcpy", err);
}

moe_ep_status ex_ipc_handle(const void* base, uint8_t* handle) {
  cudaIpcMemHandle_t h;
  const cudaError_t err = cudaIpcGetMemHandle(&h, const_cast<void*>(base));
  if (err != cudaSuccess) return cuda_fail("moe_ep_layer_ipc_handle: cudaIpcGetMemHandle", err);
  static_assert(sizeof h == MOE_EP_IPC_HANDLE_BYTES, "cudaIpcMemHandle_t is 64 bytes");
  std::memcpy(handle, &h, sizeof h);
  return MOE_EP_OK;
}

moe_ep_status ex_ipc_open(int cuda_device, const uint8_t* handle, void** out) {
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof h);
  cudaError_t err = cudaSetDevice(cuda_device);
  if (err == cudaSuccess) err = cudaIpcOpenMemHandle(out, h, cudaIpcMemLazyEnablePeerAccess);
  return err == cudaSuccess ? MOE_EP_OK : cuda_fail("moe_ep_layer_set_peers_ipc: cudaIpcOpenMemHandle", err);
}

moe_ep_status ex_ipc_close(void* p) {
  const cudaError_t err = cudaIpcCloseMemHandle(p);
  return err == cudaSuccess ? MOE_EP_OK : cuda_fail("moe_ep_layer_destroy: cudaIpcCloseMemHandle", err);
}

moe_ep_status ex_dispatch(void* stream, const Exchange& x, int64_t T, int64_t row_bytes, const void* tokens,
                          const float* weights, void* out_tokens, float* out_w, int32_t* out_meta, int32_t* out_gs,
                          int32_t* out_tpe, int32_t* out_error) {
  const Dev d = make_dev(x);
  cudaStream_t st = detail::as_stream(stream);
  const unsigned blocks = static_cast<unsigned>(x.num_blocks);
  dispatch_begin<<<1, 32, 0, st>>>(d, T);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange dispatch_begin");
  dispatch_send<<<blocks, 256, 0, st>>>(d, T, row_bytes, static_cast<const char*>(tokens), weights);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange dispatch_send");
  dispatch_sync<<<1, 32, 0, st>>>(d, out_gs, out_tpe, out_error);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange dispatch_sync");
  dispatch_place<<<blocks, 256, 0, st>>>(d, row_bytes, static_cast<char*>(out_tokens), out_w, out_meta);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange dispatch_place");
  stage_ack<<<1, 32, 0, st>>>(d, 0, x.sym.disp_ack);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange dispatch_ack");
  return MOE_EP_OK;
}

moe_ep_status ex_combine(void* stream, const Exchange& x, int64_t T, const float* y, float* out,
                         const float* row_values, float* out_values, int32_t* out_error) {
  const Dev d = make_dev(x);
  cudaStream_t st = detail::as_stream(stream);
  const unsigned blocks = static_cast<unsigned>(x.num_blocks);
  combine_begin<<<1, 32, 0, st>>>(d);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange combine_begin");
  combine_send<<<blocks, 256, 0, st>>>(d, y, row_values);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange combine_send");
  combine_sync<<<1, 32, 0, st>>>(d);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange combine_sync");
  combine_finish<<<blocks, 256, 0, st>>>(d, T, out, out_values, out_error);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange combine_finish");
  stage_ack<<<1, 32, 0, st>>>(d, 1, x.sym.comb_ack);
  MOE_EP_CUDA_CHECK_LAUNCH("exchange combine_ack");
  return MOE_EP_OK;
}

moe_ep_status ex_status(void* stream, const Exchange& x, int32_t* bits, bool clear) {
  cudaError_t err = cudaSetDevice(x.cuda_device);
  if (err == cudaSuccess) err = cudaStreamSynchronize(detail::as_stream(stream));
  if (err == cudaSuccess) err = cudaMemcpy(bits, x.loc.sticky_err, 4, cudaMemcpyDeviceToHost);
  if (err == cudaSuccess && clear) err = cudaMemset(x.loc.sticky_err, 0, 4);
  if (err == cudaSuccess && clear) err = cudaDeviceSynchronize();
  return err == cudaSuccess ? MOE_EP_OK : cuda_fail("moe_ep_layer_exchange_status", err);
}

}  // namespace cuda
}  // namespace moe_ep
