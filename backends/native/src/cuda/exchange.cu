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
//             receiver's region; rows to this rank itself stay in `tokens`) ->
//             sync (system fence, publish the step in every peer's flag with a
//             release store, wait for every peer's flag with acquire loads,
//             offsets from the gathered count table) -> place (one warp per
//             received token: its row read once and stored locally to each of
//             its routes' rows of the expert-major buffer; padding rows zeroed)
//             -> ack.
//   combine:  begin -> send (one warp per (source rank, token, piece of H): one
//             float32 row per source token, the routes here summed in slot
//             order, or one row per route; y float32 or bf16) -> sync -> finish
//             (one warp per (token, piece of H): the home rank's sum, NaN on any
//             error) -> ack.
// One rank alone (N = 1, either mode) exchanges nothing: the dispatch is dispatch_one_plan
// (begin's prefix, send's route records and count table, sync's plan, in one block, no
// flag or wait) -> place; the combine is one kernel, combine_one: send's slot-order sums
// straight into the output (what finish would write: +0 + s is s for a sum s started at
// +0, and the slot rows' sum from +0 is the same sum), and finish's NaN on an error. Up to
// 4096 routes planned in one block the dispatch is one kernel, dispatch_one_fused (every
// block plans the routes in shared memory, block 0 publishes the plan, then every block
// places rows from its own plan), and the combine of few tokens is combine_one_fine (a warp
// per 16-byte column of a token, all its routes' loads at once); MOE_EP_ONE_RANK_FAST
// switches these off part by part (the same bits either way; see one_rank_fast).
// That is the throughput mode (MOE_EP_EXCHANGE_THROUGHPUT); the low-latency mode runs the
// same steps in one cooperative kernel per stage, grid barriers between them (dispatch_ll,
// combine_ll).
// The copy kernels (send, place, finish) run kCopyThreads threads per block,
// x.num_blocks blocks (default: 2 per multiprocessor), grid-stride over warp-sized
// items, every lane with several 16-byte loads in flight (read-only loads, streaming stores).
// Every wait is bounded by the layer's timeout (%globaltimer): on expiry the
// step's error gets MOE_EP_EXCHANGE_TIMEOUT, which travels to the peers in the
// flags, and the kernels finish without the missing data.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/format_math.cuh"
#include "exchange.h"

namespace moe_ep {
namespace cuda {
namespace {

namespace cg = cooperative_groups;
using ex::RouteMeta;

constexpr int kCopyThreads = 512;  // threads per block of the copy kernels

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

// A 16-byte load of data written before this kernel (kFresh false: the read-only path) or
// possibly during it by a peer, before a barrier (kFresh true: through L2, as PTX allows
// the non-coherent path only for data read-only for the whole kernel).
template <bool kFresh>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kFresh) return __ldcg(p);
  else return __ldg(p);
}

// One warp copies `bytes` bytes: 16-byte pieces, eight (then four) per lane in flight, when both
// ends and the size allow; else 4-byte pieces or bytes.
template <bool kFresh = false>
__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    const int64_t n = bytes / 16;
    int64_t i = lane;
    for (; i + 224 < n; i += 256) {  // eight 16-byte loads in flight per lane (4 KiB per warp)
      int4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = load16<kFresh>(s4 + i + 32 * j);
#pragma unroll
      for (int j = 0; j < 8; ++j) __stcs(d4 + i + 32 * j, v[j]);  // streaming: written once, read by a later kernel
    }
    for (; i + 96 < n; i += 128) {
      const int4 v0 = load16<kFresh>(s4 + i), v1 = load16<kFresh>(s4 + i + 32), v2 = load16<kFresh>(s4 + i + 64),
                 v3 = load16<kFresh>(s4 + i + 96);
      __stcs(d4 + i, v0), __stcs(d4 + i + 32, v1), __stcs(d4 + i + 64, v2), __stcs(d4 + i + 96, v3);
    }
    for (; i < n; i += 32) __stcs(d4 + i, load16<kFresh>(s4 + i));
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

// Programmatic dependent launch (sm_90): every kernel of a stage is launched with
// programmatic stream serialization (launch()), so the next kernel of the chain is
// launched while this one runs and waits here, instead of after it, for the whole
// predecessor grid (its memory visible). First thing in every exchange kernel: wait,
// then let the next kernel launch. Without the launch attribute both are no-ops.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// One warp: the step number, this rank's token count and the send-side prefix.
__device__ void dispatch_prefix_warp(const Dev& d, int64_t T) {
  const int lane = threadIdx.x & 31;
  const uint64_t seq = d.l.seq[0] + 1;
  __syncwarp();  // every lane read the old step number
  if (lane == 0) {
    d.l.seq[0] = seq;
    *d.l.t_me = static_cast<int32_t>(T);
  }
  if (T == 0)
    for (int64_t g = lane; g <= d.s.E; g += 32) d.l.counts[g] = 0;
  __syncwarp();
  // excl[g] = counts[0] + ... + counts[g - 1]: each lane a contiguous run of experts,
  // the runs' totals scanned across the warp.
  const int64_t per = (d.s.E + 31) / 32, g0 = lane * per, g1 = g0 + per < d.s.E ? g0 + per : d.s.E;
  int64_t mine = 0;
  for (int64_t g = g0; g < g1; ++g) mine += d.l.counts[g];
  int64_t incl = mine;
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  int64_t run = incl - mine;
  for (int64_t g = g0; g < g1; ++g) {
    d.l.excl[g] = static_cast<int32_t>(run);
    run += d.l.counts[g];
  }
}

// One warp: dispatch_prefix_warp, then the wait for every receiver's acknowledgement of the
// previous step.
__device__ void dispatch_begin_warp(const Dev& d, int64_t T) {
  dispatch_prefix_warp(d, T);
  const uint64_t seq = d.l.seq[0];
  const int32_t err = wait_peers(d, d.L.disp_ack, [seq](uint64_t v) { return v + 1 >= seq; }, false);
  if ((threadIdx.x & 31) == 0) *d.l.step_err = err;
}

__global__ void dispatch_begin(Dev d, int64_t T) {  // <<<1, 32>>>
  pdl_begin();
  dispatch_begin_warp(d, T);
}

// The record of route r (t * K + k) for rank p: its expert local to p, its send position among
// that expert's rows, its weight; le -1 when the route goes elsewhere or nowhere.
__device__ __forceinline__ RouteMeta route_record(const Dev& d, int64_t r, int32_t p, const float* __restrict__ weights) {
  const int32_t g = d.l.route_expert[r];
  RouteMeta m{-1, 0, 0.0f, 0};
  if (g >= 0 && g / d.s.El == p) {
    m.le = static_cast<int32_t>(g % d.s.El);
    m.pos = d.l.route_pos[r] - d.l.excl[g];
    m.w = weights[r];
  }
  return m;
}

// One thread per own token: its routes' destination ranks and its rank list (the
// combine's); block 0: this rank's count-table row into every peer; one warp per
// (token, destination rank): the token's K route records, and its row once if any
// of its routes goes there (not to this rank itself: dispatch_place reads its own
// rows from `tokens`).
__device__ void dispatch_send_grid(const Dev& d, int64_t T, int64_t row_bytes, const char* __restrict__ tokens,
                                   const float* __restrict__ weights) {
  const ex::Shape& s = d.s;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = gtid; t < T; t += gthreads) {
    int32_t* dest = d.l.route_dest + t * s.K;
    for (int64_t k = 0; k < s.K; ++k) {
      const int32_t g = d.l.route_expert[t * s.K + k];
      dest[k] = g >= 0 ? static_cast<int32_t>(g / s.El) : -1;
    }
    ex::token_ranks(dest, s.K, d.l.tok_ranks + t * s.K);
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
      const RouteMeta m = route_record(d, t * s.K + k, p, weights);
      has = has || m.le >= 0;
      meta[k] = m;
    }
    if (p != s.rank && __any_sync(0xffffffffu, has))  // p is warp-uniform
      warp_copy(base + d.L.drows + (static_cast<int64_t>(s.rank) * s.Tmax + t) * s.stride, tokens + t * row_bytes,
                row_bytes, lane);
  }
}

__global__ void __launch_bounds__(kCopyThreads, 2)
    dispatch_send(Dev d, int64_t T, int64_t row_bytes, const char* __restrict__ tokens,
                  const float* __restrict__ weights) {
  pdl_begin();
  dispatch_send_grid(d, T, row_bytes, tokens, weights);
}

constexpr int kSyncThreads = 256;  // threads of dispatch_sync's one block
constexpr int kMaxWarps = kCopyThreads / 32;  // warps of the largest block that computes the plan (low latency)

// The block's sum of one int64 per thread (every thread gets it); `scratch` holds blockDim.x / 32 values
// (at most kMaxWarps).
__device__ int64_t block_sum(int64_t v, int64_t* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // scratch is free (an earlier call's readers are done)
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += scratch[w];
  return total;
}

// The block's exclusive prefix of one int64 per thread, and the total; `scratch` as block_sum's.
__device__ int64_t block_exclusive(int64_t v, int64_t* scratch, int64_t* total) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int64_t incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  int64_t before = 0, all = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  *total = all;
  return before + incl - v;
}

// ex::plan_from_table computed by one block of any multiple of 32 threads up to kCopyThreads (the same values:
// integer sums, any order): the error bits of the count table (bad ids, overflow of C
// on some rank), this rank's slab offsets off[El + 1], route counts nloc[El], per-source
// prefixes pref[N * El] and the sources' token counts tsrc[N]; then the aligned slab
// sizes and routes per local expert of the caller. Returns the bits (every thread).
__device__ int32_t plan_from_table_block(const Dev& d, const int32_t* table, bool timed_out, int32_t* out_gs,
                                         int32_t* out_tpe) {
  __shared__ int64_t scratch[kMaxWarps];
  __shared__ int32_t s_err;
  const ex::Shape& s = d.s;
  const int64_t row = s.E + 2;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  if (tid == 0) s_err = 0;
  __syncthreads();
  if (!timed_out) {
    for (int32_t src = tid; src < s.N; src += nthreads)
      if (table[src * row + s.E] > 0) atomicOr(&s_err, ex::kBadId);
    for (int32_t dst = 0; dst < s.N; ++dst) {
      int64_t part = 0;
      for (int64_t le = tid; le < s.El; le += nthreads) {
        int64_t n = 0;
        for (int32_t src = 0; src < s.N; ++src) n += table[src * row + dst * s.El + le];
        part += ex::align_up(n, s.A);
      }
      if (block_sum(part, scratch) > s.C && tid == 0) atomicOr(&s_err, ex::kOverflow);
    }
  }
  // This rank's column, El entries in chunks of the block's threads: per-source prefixes, counts, and
  // the slab offsets (an exclusive scan of the aligned counts, carried across chunks).
  int64_t at = 0;
  for (int64_t base = 0; base < s.El; base += nthreads) {
    const int64_t le = base + tid;
    int64_t n = 0;
    if (le < s.El) {
      for (int32_t src = 0; src < s.N; ++src) {
        d.l.pref[src * s.El + le] = static_cast<int32_t>(n);
        n += timed_out ? 0 : table[src * row + static_cast<int64_t>(s.rank) * s.El + le];
      }
      d.l.nloc[le] = static_cast<int32_t>(n);
    }
    int64_t chunk = 0;
    const int64_t before = at + block_exclusive(le < s.El ? ex::align_up(n, s.A) : 0, scratch, &chunk);
    if (le < s.El) d.l.off[le] = static_cast<int32_t>(before > s.C ? s.C + 1 : before);
    at += chunk;
  }
  if (tid == 0) d.l.off[s.El] = static_cast<int32_t>(at > s.C ? s.C + 1 : at);
  for (int32_t src = tid; src < s.N; src += nthreads) d.l.tsrc[src] = timed_out ? 0 : table[src * row + s.E + 1];
  __syncthreads();  // off and nloc complete
  for (int64_t le = tid; le < s.El; le += nthreads) {
    out_gs[le] = ex::group_size(s, d.l.off, le);
    if (out_tpe != nullptr) out_tpe[le] = d.l.nloc[le];
  }
  return s_err;
}

// One block: publish this step in every peer's flag, wait for theirs, then the plan from
// the gathered count table.
__device__ void dispatch_sync_block(const Dev& d, int32_t* out_gs, int32_t* out_tpe, int32_t* out_error) {
  __shared__ int32_t s_wait;
  const uint64_t seq = d.l.seq[0];
  if (threadIdx.x < 32) {
    int32_t err = *d.l.step_err;
    publish(d, d.L.disp_flag, ex::flag_value(seq, err));
    err |= wait_peers(d, d.L.disp_flag, [seq](uint64_t v) { return ex::flag_step(v) >= seq; }, true);
    if (threadIdx.x == 0) s_wait = err;
  }
  __syncthreads();
  __threadfence_system();  // the peers' table rows, published before their flags, are read after this
  const int32_t* table = reinterpret_cast<const int32_t*>(d.own + d.L.table);
  const int32_t err = s_wait | plan_from_table_block(d, table, (s_wait & ex::kTimeout) != 0, out_gs, out_tpe);
  if (threadIdx.x == 0) {
    *d.l.step_err = err;
    atomicOr(d.l.sticky_err, err);
    *out_error = err;
  }
}

__global__ void __launch_bounds__(kSyncThreads)
    dispatch_sync(Dev d, int32_t* out_gs, int32_t* out_tpe, int32_t* out_error) {  // <<<1, kSyncThreads>>>
  pdl_begin();
  dispatch_sync_block(d, out_gs, out_tpe, out_error);
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

// One warp copies `bytes` bytes from `src` to `dst + row * stride` for the row of each
// lane set in `mask` (mask warp-uniform): 16-byte pieces, each loaded once and stored to
// every destination, when the addresses and sizes allow; else one warp_copy per
// destination. Every lane runs every pass (the shuffles need the whole warp).
constexpr int kFanInFlight = 4;                      // 16-byte loads per lane in flight, each stored to every row
constexpr int64_t kFanPass = 32 * kFanInFlight * 16;  // bytes of one warp pass (2 KiB)
constexpr int64_t kFanUnit = 32 * 16;                 // bytes of one 16-byte load per lane (a pass's least piece)

template <bool kFresh>
__device__ __forceinline__ void warp_fanout(char* dst, int64_t stride, int32_t row, unsigned mask, const char* src,
                                            int64_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                      static_cast<uintptr_t>(bytes) | static_cast<uintptr_t>(stride);
  if ((a & 15) != 0) {
    for (unsigned m = mask; m != 0; m &= m - 1) {
      const int32_t r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
      warp_copy<kFresh>(dst + static_cast<int64_t>(r) * stride, src, bytes, lane);
    }
    return;
  }
  const int4* s4 = reinterpret_cast<const int4*>(src);
  const int64_t n = bytes / 16;
  for (int64_t i0 = 0; i0 < n; i0 += 32 * kFanInFlight) {
    const int64_t i = i0 + lane;
    int4 v[kFanInFlight];
#pragma unroll
    for (int j = 0; j < kFanInFlight; ++j)
      if (i + 32 * j < n) v[j] = load16<kFresh>(s4 + i + 32 * j);
    for (unsigned m = mask; m != 0; m &= m - 1) {
      const int32_t r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
      int4* d4 = reinterpret_cast<int4*>(dst + static_cast<int64_t>(r) * stride);
#pragma unroll
      for (int j = 0; j < kFanInFlight; ++j)
        if (i + 32 * j < n) __stcs(d4 + i + 32 * j, v[j]);  // streaming: written once, read by a later kernel
    }
  }
}

// warp_fanout's 16-byte path alone (the caller checked the alignment), kInFlight loads per lane
// in flight, read-only loads: dispatch_one_fused's, whose kFanUnit pieces need one load a lane,
// so that its loop holds fewer registers (warp_fanout, with warp_copy's eight loads a lane
// for unaligned rows, spills in a 64-register kernel).
template <int kInFlight>
__device__ __forceinline__ void warp_fanout16(char* dst, int64_t stride, int32_t row, unsigned mask, const char* src,
                                              int64_t bytes, int lane) {
  const int4* s4 = reinterpret_cast<const int4*>(src);
  const int64_t n = bytes / 16;
  for (int64_t i0 = 0; i0 < n; i0 += 32 * kInFlight) {
    const int64_t i = i0 + lane;
    int4 v[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (i + 32 * j < n) v[j] = __ldg(s4 + i + 32 * j);
    for (unsigned m = mask; m != 0; m &= m - 1) {
      const int32_t r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
      int4* d4 = reinterpret_cast<int4*>(dst + static_cast<int64_t>(r) * stride);
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        if (i + 32 * j < n) __stcs(d4 + i + 32 * j, v[j]);
    }
  }
}

// One warp per (received token, piece of its row): the routes' buffer rows from the
// gathered offsets (lanes over slots, 32 at a time; piece 0 writes rowmap, weight and
// metadata) and the piece read once and stored to each of those rows (this rank's own
// rows from `tokens`, the peers' from the region). A row is cut into pieces of whole
// units of `unit` bytes (kFanPass, or at one rank kFanUnit: MOE_EP_ONE_RANK_FAST's
// "place") only when there are more warps than received tokens (few tokens), so that
// every warp has work. Then one warp per padding row: zeros, weight 0, metadata -1.
// `received`: the token items, N * Tmax (item src * Tmax + t; those past a source's T are
// skipped), or at one rank this step's T (the same items without the skipped ones, so that
// a layer made for many tokens cuts its rows as finely for few).
// kFresh: the peers' rows were written during this kernel (the low-latency mode).
template <bool kFresh>
__device__ void dispatch_place_grid(const Dev& d, int64_t row_bytes, const char* __restrict__ tokens,
                                    char* __restrict__ out_tokens, float* __restrict__ out_w,
                                    int32_t* __restrict__ out_meta, int64_t unit, int64_t received) {
  const ex::Shape& s = d.s;
  const int lane = threadIdx.x & 31;
  const bool whole_passes = ((reinterpret_cast<uintptr_t>(out_tokens) | reinterpret_cast<uintptr_t>(tokens) |
                              reinterpret_cast<uintptr_t>(d.own + d.L.drows) | static_cast<uintptr_t>(row_bytes) |
                              static_cast<uintptr_t>(s.stride)) & 15) == 0;
  int64_t pieces = 1;
  if (whole_passes && received > 0) {
    const int64_t most = detail::div_up(row_bytes, unit), want = num_warps() / received;
    pieces = want < 1 ? 1 : (want < most ? want : most);
  }
  const int64_t piece_bytes = pieces == 1 ? row_bytes : detail::div_up(detail::div_up(row_bytes, pieces), unit) * unit;
  const RouteMeta* meta = reinterpret_cast<const RouteMeta*>(d.own + d.L.dmeta);
  for (int64_t item = warp_id(); item < received * pieces + s.C; item += num_warps()) {
    if (item < received * pieces) {
      const int64_t tok = item / pieces, piece = item % pieces;
      const int32_t src = static_cast<int32_t>(tok / s.Tmax);
      const int64_t t = tok % s.Tmax;
      if (t >= d.l.tsrc[src]) continue;
      const int64_t h0 = piece * piece_bytes;
      if (h0 >= row_bytes) continue;  // the last pieces of a short row
      const int64_t len = row_bytes - h0 < piece_bytes ? row_bytes - h0 : piece_bytes;
      const char* from = (src == s.rank ? tokens + t * row_bytes : d.own + d.L.drows + tok * s.stride) + h0;
      for (int64_t k0 = 0; k0 < s.K; k0 += 32) {
        const int64_t k = k0 + lane, route = tok * s.K + k;
        int32_t row = -1;
        if (k < s.K) {
          const RouteMeta m = meta[route];
          row = m.le >= 0 ? ex::route_row(s, d.l.off, d.l.pref, src, m.le, m.pos) : -1;
          if (piece == 0) {
            d.l.rowmap[route] = row;
            if (row >= 0) {
              out_w[row] = m.w;
              int32_t* md = out_meta + 4 * static_cast<int64_t>(row);
              md[0] = m.le, md[1] = src, md[2] = static_cast<int32_t>(t), md[3] = static_cast<int32_t>(k);
            }
          }
        }
        const unsigned mask = __ballot_sync(0xffffffffu, row >= 0);
        if (mask != 0) warp_fanout<kFresh>(out_tokens + h0, row_bytes, row, mask, from, len, lane);
      }
    } else {
      const int64_t r = item - received * pieces;
      if (!padding_row(d, r)) continue;
      warp_zero(out_tokens + r * row_bytes, row_bytes, lane);
      if (lane == 0) {
        out_w[r] = 0.0f;
        for (int c = 0; c < 4; ++c) out_meta[4 * r + c] = -1;
      }
    }
  }
}

__global__ void __launch_bounds__(kCopyThreads, 2)
    dispatch_place(Dev d, int64_t row_bytes, const char* __restrict__ tokens, char* __restrict__ out_tokens,
                   float* __restrict__ out_w, int32_t* __restrict__ out_meta, int64_t unit, int64_t received) {
  pdl_begin();
  dispatch_place_grid<false>(d, row_bytes, tokens, out_tokens, out_w, out_meta, unit, received);
}

__global__ void stage_ack(Dev d, int which, int64_t ack_off) {  // <<<1, 32>>>
  pdl_begin();
  publish(d, ack_off, d.l.seq[which]);
}

// ------------------------------------------------------------------ combine

// How a warp reads a piece of a row of Y (float32 or bf16 bit patterns): kVec, in
// 16-byte vectors of V elements (rows 16-byte aligned), else element by element.
// A piece is kPieceVecs accesses per lane.
constexpr int kPieceVecs = 4;

template <typename Y, bool kVec>
struct Cols {
  using Elem = Y;
  using Raw = typename std::conditional<kVec, uint4, Y>::type;
  static constexpr int V = kVec ? 16 / static_cast<int>(sizeof(Y)) : 1;
  static constexpr int64_t kPiece = 32 * V * kPieceVecs;  // elements of one warp's piece
  static __device__ __forceinline__ Raw load(const Y* p) { return *reinterpret_cast<const Raw*>(p); }
};

// Raw loads as float32 (bf16: exactly, its bits are the high half of the float's); the
// 16-byte ones are format_math.cuh's (shared with the combine reduction).
__device__ __forceinline__ void unpack(float r, float (&v)[1]) { v[0] = r; }
__device__ __forceinline__ void unpack(uint16_t r, float (&v)[1]) { v[0] = detail::bf16_to_float(r); }
using detail::unpack;

template <int V>
__device__ __forceinline__ void store(float* p, const float (&v)[V]) {
  if constexpr (V == 1) {
    *p = v[0];
  } else {
#pragma unroll
    for (int i = 0; i < V; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
  }
}
// The same sums as bf16 (the output's encoding when it is bf16: nearest, ties to even).
template <int V>
__device__ __forceinline__ void store(uint16_t* p, const float (&v)[V]) {
  if constexpr (V == 1) {
    *p = detail::bf16_from_float(v[0]);
  } else {
#pragma unroll
    for (int i = 0; i < V; i += 4)
      *reinterpret_cast<uint2*>(p + i) = detail::bf16x4_from_float(v[i], v[i + 1], v[i + 2], v[i + 3]);
  }
}

// kRt: the moe_ep_format whose round trip float32 rows of y still need (MOE_EP_FORMAT_MXFP8:
// MOE_EP_Y_F32_MXFP8_ROUND_TRIP, MOE_EP_FORMAT_NVFP4: MOE_EP_Y_F32_NVFP4_ROUND_TRIP; NONE: none):
// each lane's four values through it as they are read, the block's maximum agreed by its eight
// (mxfp8) or four (nvfp4) lanes (the FC2 epilogue's round trip, the same values:
// fc2_epilogue_block_vec4_kernel). Every lane of the warp must take part (H a multiple of 128:
// ex_combine checks it), and whether a row is read must be the same in all of them (one token a
// warp).
template <typename C, int kRt>
__device__ __forceinline__ void round_trip_read(float (&v)[C::V]) {
  static_assert(kRt == MOE_EP_FORMAT_NONE || kRt == MOE_EP_FORMAT_MXFP8 || kRt == MOE_EP_FORMAT_NVFP4,
                "round_trip_read: mxfp8, nvfp4 or none");
  if constexpr (kRt != MOE_EP_FORMAT_NONE) {
    static_assert(C::V == 4 && std::is_same<typename C::Elem, float>::value, "the round trip reads float4 rows");
    if constexpr (kRt == MOE_EP_FORMAT_MXFP8) detail::mxfp8_round_trip_cvt4(detail::group_block_max<8>(v), v);
    else detail::nvfp4_round_trip_with(detail::group_block_max<4>(v), v, 4);
  }
}

// acc = (((+0 + r_0) + r_1) + ...) over the rows r_j = row(j), j < n, that are not
// NULL, in that order (float32, round to nearest), at the C::V elements from h (kRt: each
// row's values through round_trip_read first); the loads of kBatch rows are in flight at once
// (the batch changes when loads are issued, not the order of the additions).
constexpr int kSumBatch = 4;

template <typename C, int kRt = MOE_EP_FORMAT_NONE, int kBatch = kSumBatch, typename Row>
__device__ __forceinline__ void sum_rows(int64_t n, Row row, int64_t h, float (&acc)[C::V]) {
#pragma unroll
  for (int u = 0; u < C::V; ++u) acc[u] = 0.0f;
  for (int64_t j0 = 0; j0 < n; j0 += kBatch) {
    typename C::Raw raw[kBatch];
    bool ok[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const typename C::Elem* p = j0 + j < n ? row(j0 + j) : nullptr;
      ok[j] = p != nullptr;
      if (ok[j]) raw[j] = C::load(p + h);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (!ok[j]) continue;
      float v[C::V];
      unpack(raw[j], v);
      round_trip_read<C, kRt>(v);
#pragma unroll
      for (int u = 0; u < C::V; ++u) acc[u] = __fadd_rn(acc[u], v[u]);
    }
  }
}

// The warp's piece [h0, h1) of row `from`, as float32 (kRt: through round_trip_read), into row `to`.
template <typename C, int kRt = MOE_EP_FORMAT_NONE>
__device__ __forceinline__ void copy_piece(float* to, const typename C::Elem* from, int64_t h0, int64_t h1, int lane) {
  typename C::Raw raw[kPieceVecs];
#pragma unroll
  for (int i = 0; i < kPieceVecs; ++i) {
    const int64_t h = h0 + (lane + 32 * i) * C::V;
    if (h < h1) raw[i] = C::load(from + h);
  }
#pragma unroll
  for (int i = 0; i < kPieceVecs; ++i) {
    const int64_t h = h0 + (lane + 32 * i) * C::V;
    if (h >= h1) continue;
    float v[C::V];
    unpack(raw[i], v);
    round_trip_read<C, kRt>(v);
    store(to + h, v);
  }
}

// One warp: the step number and the wait for every source's acknowledgement of the previous step.
__device__ void combine_begin_warp(const Dev& d) {
  const uint64_t seq = d.l.seq[1] + 1;
  const int32_t err = wait_peers(d, d.L.comb_ack, [seq](uint64_t v) { return v + 1 >= seq; }, false);
  __syncwarp();
  if (threadIdx.x == 0) {
    d.l.seq[1] = seq;
    *d.l.step_err |= err;
  }
}

__global__ void combine_begin(Dev d) {  // <<<1, 32>>>
  pdl_begin();
  combine_begin_warp(d);
}

// One warp per (source rank, token, piece of H) with routes here. RANK_SUMS: their
// y rows summed in slot order in float32 into the source's row for this rank;
// SLOT_ORDER: each route's y row, as float32, into the source's row for its slot.
// Piece 0 also returns the routes' values. `direct` (N = 1, this rank is the only
// source and the home rank): the sums in slot order go straight into `direct`,
// every token's row (a token with no route: +0), and nothing at all on an error
// (combine_finish writes the NaN).
template <typename Y, bool kVec, typename O, int kRt = MOE_EP_FORMAT_NONE>
__device__ void combine_send_grid(const Dev& d, const Y* __restrict__ y, const float* __restrict__ row_values,
                                  O* __restrict__ direct) {
  using C = Cols<Y, kVec>;
  const ex::Shape& s = d.s;
  const int32_t err = *d.l.step_err;
  if ((err & ex::kTimeout) || (direct != nullptr && err != 0)) return;
  const int lane = threadIdx.x & 31;
  const int64_t pieces = detail::div_up(s.H, C::kPiece);
  for (int64_t item = warp_id(); item < s.N * s.Tmax * pieces; item += num_warps()) {
    const int64_t st = item / pieces, h0 = (item % pieces) * C::kPiece;
    const int64_t h1 = h0 + C::kPiece < s.H ? h0 + C::kPiece : s.H;
    const int32_t src = static_cast<int32_t>(st / s.Tmax);
    const int64_t t = st % s.Tmax;
    if (t >= d.l.tsrc[src]) continue;
    const int32_t* rm = d.l.rowmap + st * s.K;
    char* base = peer(d, src);
    float* crows = reinterpret_cast<float*>(base + d.L.crows);
    if (h0 == 0 && row_values != nullptr)
      for (int64_t k = lane; k < s.K; k += 32)
        if (rm[k] >= 0) reinterpret_cast<float*>(base + d.L.cvals)[t * s.K + k] = row_values[rm[k]];
    if (s.order == 1 && direct == nullptr) {
      for (int64_t k = 0; k < s.K; ++k)
        if (rm[k] >= 0)
          copy_piece<C, kRt>(crows + (k * s.Tmax + t) * s.H, y + static_cast<int64_t>(rm[k]) * s.H, h0, h1, lane);
      continue;
    }
    if (direct == nullptr) {
      bool has = false;
      for (int64_t k = 0; k < s.K; ++k) has = has || rm[k] >= 0;
      if (!has) continue;  // no row goes back (the home rank does not read it)
    }
    const auto route_row = [&](int64_t k) -> const Y* {
      const int32_t r = rm[k];
      return r >= 0 ? y + static_cast<int64_t>(r) * s.H : nullptr;
    };
    float* to = crows + (static_cast<int64_t>(s.rank) * s.Tmax + t) * s.H;
    for (int64_t h = h0 + lane * C::V; h < h1; h += 32 * C::V) {
      float acc[C::V];
      sum_rows<C, kRt>(s.K, route_row, h, acc);
      if (direct != nullptr) store(direct + t * s.H + h, acc);
      else store(to + h, acc);
    }
  }
}

template <typename Y, bool kVec, typename O, int kRt = MOE_EP_FORMAT_NONE>
__global__ void __launch_bounds__(kCopyThreads, 2)
    combine_send(Dev d, const Y* __restrict__ y, const float* __restrict__ row_values, O* __restrict__ direct) {
  pdl_begin();
  combine_send_grid<Y, kVec, O, kRt>(d, y, row_values, direct);
}

// One warp: publish this step in every source's flag and wait for theirs.
__device__ void combine_sync_warp(const Dev& d) {
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

__global__ void combine_sync(Dev d) {  // <<<1, 32>>>
  pdl_begin();
  combine_sync_warp(d);
}

// One warp per (token, piece of H): the home rank's sum from +0 (SLOT_ORDER: the
// slot rows of the token's routes in slot order; RANK_SUMS: the rows of the ranks
// in tok_ranks, in rank order), NaN on any error; piece 0 also the per-route values.
// One rank alone (`direct`): combine_send wrote the sums, only an error's NaN is written
// here (the step's error only grows from combine_send to here, so no sum is left unwritten).
template <bool kVec, typename O>
__device__ void combine_finish_grid(const Dev& d, int64_t T, O* __restrict__ out, float* __restrict__ out_values,
                                    int32_t* out_error) {
  using C = Cols<float, kVec>;
  const ex::Shape& s = d.s;
  const bool direct = s.N == 1;  // as combine_as chose for combine_send
  const int lane = threadIdx.x & 31;
  const int32_t err = *d.l.step_err;
  if (out_error != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *out_error = err;
  const float nan = __int_as_float(0x7fc00000);
  const float* crows = reinterpret_cast<const float*>(d.own + d.L.crows);
  const float* cvals = reinterpret_cast<const float*>(d.own + d.L.cvals);
  const int64_t pieces = detail::div_up(s.H, C::kPiece);
  for (int64_t item = warp_id(); item < T * pieces; item += num_warps()) {
    const int64_t t = item / pieces, h0 = (item % pieces) * C::kPiece;
    const int64_t h1 = h0 + C::kPiece < s.H ? h0 + C::kPiece : s.H;
    const int32_t* dest = d.l.route_dest + t * s.K;
    if (h0 == 0 && out_values != nullptr)
      for (int64_t k = lane; k < s.K; k += 32)
        out_values[t * s.K + k] = err ? nan : (dest[k] >= 0 ? cvals[t * s.K + k] : 0.0f);
    if (direct && err == 0) continue;
    const int32_t* ranks = d.l.tok_ranks + t * s.K;
    const auto slot_row = [&](int64_t k) -> const float* {
      return dest[k] >= 0 ? crows + (k * s.Tmax + t) * s.H : nullptr;
    };
    const auto rank_row = [&](int64_t j) -> const float* {
      return ranks[j] >= 0 ? crows + (static_cast<int64_t>(ranks[j]) * s.Tmax + t) * s.H : nullptr;
    };
    for (int64_t h = h0 + lane * C::V; h < h1; h += 32 * C::V) {
      float acc[C::V];
      if (err) {
#pragma unroll
        for (int u = 0; u < C::V; ++u) acc[u] = nan;
      } else if (s.order == 1) {
        sum_rows<C>(s.K, slot_row, h, acc);
      } else {
        sum_rows<C>(s.K, rank_row, h, acc);
      }
      store(out + t * s.H + h, acc);
    }
  }
}

template <bool kVec, typename O>
__global__ void __launch_bounds__(kCopyThreads, 2)
    combine_finish(Dev d, int64_t T, O* __restrict__ out, float* __restrict__ out_values, int32_t* out_error) {
  pdl_begin();
  combine_finish_grid<kVec, O>(d, T, out, out_values, out_error);
}

// ------------------------------------------------------------------ one rank: no exchange

// One rank alone (N = 1, either mode) has no peer to send to, wait for or acknowledge: the
// dispatch is dispatch_one_plan (the prefix, the route records, the count table and the plan,
// what dispatch_begin, dispatch_send and dispatch_sync compute, in one block, with no
// flag, fence or wait) and then dispatch_place; the combine is combine_one (combine_send's
// sums straight into the output, combine_finish's NaN and error, the routes' values). The
// same results bit for bit as the five-kernel stages at N = 1 (those moved nothing either:
// the rows stay in `tokens`, the sums go straight into the output), in two kernels instead
// of five and one instead of five; no step flag changes (no peer reads them). Few routes
// (the routes planned in one block, up to kOneSmallRoutes): the same values from
// dispatch_one_fused, one kernel, or dispatch_one_small and dispatch_place; few tokens:
// combine_one_fine for combine_one (MOE_EP_ONE_RANK_FAST, one_rank_fast).

// What dispatch_send_grid writes at N = 1 (rank 0; no row moves), spread over one block as
// one thread per route rather than one warp per token: every token's destination ranks and
// rank list, the count-table row and every route's record (the same values).
// Thread i of n threads takes tokens and routes i, i + n, ...: one block (n = blockDim.x) or
// the grid (dispatch_one_records).
__device__ void dispatch_one_records_range(const Dev& d, int64_t T, const float* __restrict__ weights, int64_t i,
                                           int64_t n) {
  const ex::Shape& s = d.s;
  for (int64_t t = i; t < T; t += n) {
    int32_t* dest = d.l.route_dest + t * s.K;
    for (int64_t k = 0; k < s.K; ++k) dest[k] = d.l.route_expert[t * s.K + k] >= 0 ? 0 : -1;
    ex::token_ranks(dest, s.K, d.l.tok_ranks + t * s.K);
  }
  RouteMeta* meta = reinterpret_cast<RouteMeta*>(d.own + d.L.dmeta);
  for (int64_t r = i; r < T * s.K; r += n) meta[r] = route_record(d, r, 0, weights);
}

// The count-table row dispatch_send writes at N = 1 (one block).
__device__ void dispatch_one_table_block(const Dev& d, int64_t T) {
  int32_t* table = reinterpret_cast<int32_t*>(d.own + d.L.table);
  for (int64_t j = threadIdx.x; j < d.s.E + 2; j += blockDim.x)
    table[j] = j <= d.s.E ? d.l.counts[j] : static_cast<int32_t>(T);
}

// Many routes at N = 1: the records of dispatch_one_records_range over the whole grid (one
// block would wait on their loads one after another), after dispatch_one_plan's prefix.
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_one_records(Dev d, int64_t T, const float* __restrict__ weights) {
  pdl_begin();
  dispatch_one_records_range(d, T, weights, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                             static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// The one-kernel plan at N = 1 keeps a counter per (warp, expert) in shared memory: up to
// this many experts and this many routes (T * K), the decode sizes, where one block is
// quicker than four launches. More: plan_routes first (several blocks from 2048 routes), then
// dispatch_one_plan for the prefix and the plan, and dispatch_one_records over the grid: one
// block alone takes the routes one chunk after another (about 180 us for 32768 routes on an
// H100, which dispatch_place waits for). MOE_EP_ONE_RANK_PLAN=block|grid overrides the
// choice (timing, and the tests of both ways).
constexpr int64_t kOneRouteExperts = 256;
constexpr int64_t kOneBlockMaxRoutes = 4096;
constexpr int kOneWarps = kCopyThreads / 32;

// plan_routes' outputs that the exchange reads (route_expert, route_pos, counts; not
// send_route), the same values, computed by one block of kCopyThreads threads at
// E <= kOneRouteExperts: routes in chunks of the block's threads, in route order; in a
// chunk, the lanes of a warp with the same expert take consecutive places in lane order
// (__match_any_sync), and the warps of the chunk follow each other per expert from the
// expert's running count. route_pos holds each route's index among its expert's routes
// until the prefix is known; then its send position (+ excl[expert]).
__device__ void one_rank_routes_block(const Dev& d, const int32_t* __restrict__ topk, int64_t T) {
  __shared__ int32_t s_cnt[kOneWarps][kOneRouteExperts];
  __shared__ int32_t s_cursor[kOneRouteExperts];
  __shared__ int32_t s_bad;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = static_cast<int>(d.s.E);
  const int64_t R = T * d.s.K;
  for (int e = tid; e < E; e += blockDim.x) s_cursor[e] = 0;
  if (tid == 0) s_bad = 0;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t chunk = 0; chunk < R; chunk += blockDim.x) {
    for (int e = lane; e < E; e += 32) s_cnt[warp][e] = 0;
    __syncthreads();  // the counters zero (and the cursors, the first time)
    const int64_t r = chunk + tid;
    const int v = r < R ? topk[r] : -1;
    const bool routed = r < R && v >= 0 && v < E;
    if (r < R && !routed && v != -1) atomicAdd(&s_bad, 1);
    const unsigned peers = __match_any_sync(0xffffffffu, routed ? v : E + lane);  // not routed: a group alone
    const int rank = __popc(peers & lanes_below);
    if (routed && rank == 0) s_cnt[warp][v] = __popc(peers);
    __syncthreads();  // every warp's counts
    for (int e = tid; e < E; e += blockDim.x) {  // the warps' starts per expert, in warp order
      int run = s_cursor[e];
      for (int w = 0; w < kOneWarps; ++w) {
        const int c = s_cnt[w][e];
        s_cnt[w][e] = run;
        run += c;
      }
      s_cursor[e] = run;
    }
    __syncthreads();  // the starts
    if (r < R) {
      d.l.route_expert[r] = routed ? v : -1;
      d.l.route_pos[r] = routed ? s_cnt[warp][v] + rank : -1;
    }
    __syncthreads();  // every start read before the next chunk zeroes the counters
  }
  for (int e = tid; e < E; e += blockDim.x) d.l.counts[e] = s_cursor[e];
  if (tid == 0) d.l.counts[E] = s_bad;
}

// One block: at E <= kOneRouteExperts with topk (plan_routes not run), the routes first
// (one_rank_routes_block); then the prefix, the route records (unless `records` is false:
// dispatch_one_records writes them next), the count table and the plan.
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_one_plan(Dev d, int64_t T, const int32_t* __restrict__ topk, const float* __restrict__ weights,
                      int32_t* out_gs, int32_t* out_tpe, int32_t* out_error, bool records) {  // <<<1, kCopyThreads>>>
  pdl_begin();
  if (topk != nullptr) {
    one_rank_routes_block(d, topk, T);
    __syncthreads();  // counts, route_expert and route_pos written (the block's own global stores)
  }
  if (threadIdx.x < 32) {
    dispatch_prefix_warp(d, T);
    if (threadIdx.x == 0) *d.l.step_err = 0;
  }
  __syncthreads();  // the prefix and the step's error visible to the block
  if (topk != nullptr)  // the routes' indices among their expert's routes into send positions
    for (int64_t r = threadIdx.x; r < T * d.s.K; r += blockDim.x) {
      const int32_t g = d.l.route_expert[r];
      if (g >= 0) d.l.route_pos[r] += d.l.excl[g];
    }
  __syncthreads();
  if (records) dispatch_one_records_range(d, T, weights, threadIdx.x, blockDim.x);
  dispatch_one_table_block(d, T);
  __syncthreads();  // the table and the records written (the block's own global stores)
  const int32_t* table = reinterpret_cast<const int32_t*>(d.own + d.L.table);
  const int32_t err = plan_from_table_block(d, table, false, out_gs, out_tpe);
  if (threadIdx.x == 0) {
    *d.l.step_err = err;
    atomicOr(d.l.sticky_err, err);
    *out_error = err;
  }
}

// The one-rank plan of few routes (T, T * K <= kOneSmallRoutes, E <= kOneRouteExperts, the
// routes planned in one block): every value dispatch_one_plan writes with topk and records (the
// routes, the prefix, the send positions, the records, the count table, the plan, the step
// number and error), the same values, from shared memory and registers. dispatch_one_plan reads
// back from global memory what it has just written, step after step: some twenty dependent
// round trips for 1024 routes (about 10 us on an H100, which dispatch_place waits for). Here each
// thread loads its routes' ids (and weights) once, all in flight together (route
// r = j * kCopyThreads + tid, j < kOneSmallPer); the routes' indices among their expert's routes
// come as in one_rank_routes_block (chunks of the block's threads in route order,
// __match_any_sync within a warp, the warps' starts per expert in warp order), each warp
// clearing its own counters so that a chunk needs two barriers; one warp scans the counts
// (excl) and the aligned counts (off, cut past C) while the others store; each value is stored
// once. Two kernels use it: dispatch_one_small (the plan alone, then dispatch_place) and
// dispatch_one_fused (the plan in every block, then the place from shared memory, one kernel).
constexpr int64_t kOneSmallRoutes = kOneBlockMaxRoutes;
constexpr int kOneSmallPer = static_cast<int>(kOneSmallRoutes / kCopyThreads);  // routes per thread
constexpr int kOneFanInFlight = 4;  // dispatch_one_fused: 16-byte loads per lane in flight (warp_fanout16)

struct OneSmallShared {
  int32_t cnt[kOneWarps][kOneRouteExperts];  // per chunk: each warp's routes per expert, then its starts
  int32_t cursor[kOneRouteExperts];          // routes per expert so far (at the end: the counts, nloc)
  int32_t excl[kOneRouteExperts];            // exclusive prefix of the counts
  int32_t off[kOneRouteExperts + 1];         // aligned slab starts (past C: C + 1)
  int32_t row[kOneSmallRoutes];              // with_rows: every route's buffer row (-1: none)
  uint32_t any[kOneSmallRoutes / 32];        // per token, a bit: a route with a valid expert id (atomicOr)
  int32_t bad, err;
};

// One block of kCopyThreads threads: the plan into `sh` (and, with_rows, the routes' rows, every
// thread's stores visible to the block on return); with `publish`, every value dispatch_one_plan
// stores (only one block of a grid publishes).
__device__ void one_small_plan(const Dev& d, int64_t T, const int32_t* __restrict__ topk,
                               const float* __restrict__ weights, int32_t* out_gs, int32_t* out_tpe,
                               int32_t* out_error, bool publish, bool with_rows, OneSmallShared& sh) {
  const ex::Shape& s = d.s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = static_cast<int>(s.E);
  const int64_t K = s.K, R = T * K;
  int v[kOneSmallPer];
  float w[kOneSmallPer];
#pragma unroll
  for (int j = 0; j < kOneSmallPer; ++j) {  // every load in flight at once
    const int64_t r = static_cast<int64_t>(j) * kCopyThreads + tid;
    v[j] = r < R ? topk[r] : -1;
    w[j] = publish && r < R ? weights[r] : 0.0f;
  }
  const uint64_t seq = publish && tid == 0 ? d.l.seq[0] + 1 : 0;
  for (int e = tid; e < E; e += kCopyThreads) sh.cursor[e] = 0;
  for (int64_t i = tid; i < detail::div_up(T, 32); i += kCopyThreads) sh.any[i] = 0;
  if (tid == 0) sh.bad = 0;
  for (int e = lane; e < E; e += 32) sh.cnt[warp][e] = 0;
  __syncwarp();  // the warp's counters zero before its lanes count
  const unsigned lanes_below = (1u << lane) - 1u;
  int idx[kOneSmallPer];
  int bad = 0;
#pragma unroll
  for (int j = 0; j < kOneSmallPer; ++j) {
    idx[j] = -1;
    if (static_cast<int64_t>(j) * kCopyThreads >= R) continue;  // the same for the whole block
    const int64_t r = static_cast<int64_t>(j) * kCopyThreads + tid;
    const bool routed = r < R && v[j] >= 0 && v[j] < E;
    if (r < R && !routed && v[j] != -1) ++bad;
    const unsigned peers = __match_any_sync(0xffffffffu, routed ? v[j] : E + lane);  // not routed: a group alone
    const int rank = __popc(peers & lanes_below);
    if (routed && rank == 0) sh.cnt[warp][v[j]] = __popc(peers);
    __syncthreads();  // every warp's counts of this chunk (the first time: the cursors, bad and any zero too)
    for (int e = tid; e < E; e += kCopyThreads) {  // the warps' starts per expert, in warp order
      int run = sh.cursor[e];
      for (int q = 0; q < kOneWarps; ++q) {
        const int c = sh.cnt[q][e];
        sh.cnt[q][e] = run;
        run += c;
      }
      sh.cursor[e] = run;
    }
    __syncthreads();  // the starts
    if (routed) {
      idx[j] = sh.cnt[warp][v[j]] + rank;
      const int t = static_cast<int>(r) / static_cast<int>(K);  // 32-bit: r < kOneSmallRoutes
      atomicOr(&sh.any[t >> 5], 1u << (t & 31));
    } else {
      v[j] = -1;  // route_expert's value of a route with no (valid) expert
    }
    __syncwarp();  // every lane of the warp read its start: the warp clears its counters for the next chunk
    for (int e = lane; e < E; e += 32) sh.cnt[warp][e] = 0;
    __syncwarp();
  }
  if (bad != 0) atomicAdd(&sh.bad, bad);  // after a barrier that followed bad = 0 (bad > 0: some chunk ran)
  __syncthreads();  // the counts (cursor), bad and any complete
  if (warp == 0) {  // exclusive prefixes of the counts and of the aligned counts: runs of experts per lane
    const int per = (E + 31) / 32, g0 = lane * per, g1 = g0 + per < E ? g0 + per : E;
    int64_t mine = 0, mine_al = 0;
    for (int g = g0; g < g1; ++g) {
      mine += sh.cursor[g];
      mine_al += ex::align_up(sh.cursor[g], s.A);
    }
    int64_t incl = mine, incl_al = mine_al;
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, incl, o), u_al = __shfl_up_sync(0xffffffffu, incl_al, o);
      if (lane >= o) incl += u, incl_al += u_al;
    }
    int64_t run = incl - mine, at = incl_al - mine_al;
    for (int g = g0; g < g1; ++g) {
      sh.excl[g] = static_cast<int32_t>(run);
      sh.off[g] = static_cast<int32_t>(at > s.C ? s.C + 1 : at);
      run += sh.cursor[g];
      at += ex::align_up(sh.cursor[g], s.A);
    }
    if (lane == 31) {  // incl_al: every expert's aligned count
      sh.off[E] = static_cast<int32_t>(incl_al > s.C ? s.C + 1 : incl_al);
      sh.err = (sh.bad > 0 ? ex::kBadId : 0) | (incl_al > s.C ? ex::kOverflow : 0);
    }
  }
  int32_t* table = reinterpret_cast<int32_t*>(d.own + d.L.table);
  if (publish) {  // meanwhile (warp 0 after its scan): what needs no prefix
    RouteMeta* meta = reinterpret_cast<RouteMeta*>(d.own + d.L.dmeta);
#pragma unroll
    for (int j = 0; j < kOneSmallPer; ++j) {
      const int64_t r = static_cast<int64_t>(j) * kCopyThreads + tid;
      if (r >= R) continue;
      d.l.route_expert[r] = v[j];
      d.l.route_dest[r] = v[j] >= 0 ? 0 : -1;
      const int t = static_cast<int>(r) / static_cast<int>(K);  // 32-bit: r < kOneSmallRoutes
      const bool any = (sh.any[t >> 5] >> (t & 31) & 1u) != 0;
      d.l.tok_ranks[r] = r == t * K && any ? 0 : -1;  // ex::token_ranks of those destinations
      meta[r] = v[j] >= 0 ? RouteMeta{v[j], idx[j], w[j], 0} : RouteMeta{-1, 0, 0.0f, 0};  // route_record, p = 0
    }
    for (int e = tid; e < E; e += kCopyThreads) {
      const int32_t n = sh.cursor[e];
      d.l.counts[e] = n;
      table[e] = n;
      d.l.nloc[e] = n;
      d.l.pref[e] = 0;
      if (out_tpe != nullptr) out_tpe[e] = n;
    }
    if (tid == 0) {
      d.l.seq[0] = seq;
      *d.l.t_me = static_cast<int32_t>(T);
      d.l.counts[E] = sh.bad;
      table[E] = sh.bad;
      table[E + 1] = static_cast<int32_t>(T);
      d.l.tsrc[0] = static_cast<int32_t>(T);
    }
  }
  __syncthreads();  // excl, off and the error bits
#pragma unroll
  for (int j = 0; j < kOneSmallPer; ++j) {
    const int64_t r = static_cast<int64_t>(j) * kCopyThreads + tid;
    if (r >= R) continue;
    if (publish) d.l.route_pos[r] = v[j] >= 0 ? sh.excl[v[j]] + idx[j] : -1;
    if (with_rows) {  // ex::route_row at N = 1 (pref 0, pos idx); -1 past C
      const int64_t row = v[j] >= 0 ? static_cast<int64_t>(sh.off[v[j]]) + idx[j] : s.C;
      sh.row[r] = row < s.C ? static_cast<int32_t>(row) : -1;
    }
  }
  if (publish) {
    for (int e = tid; e < E; e += kCopyThreads) {
      d.l.excl[e] = sh.excl[e];
      d.l.off[e] = sh.off[e];
      out_gs[e] = ex::group_size(s, sh.off, e);
    }
    if (tid == 0) {
      const int32_t err = sh.err;
      d.l.off[E] = sh.off[E];
      *d.l.step_err = err;
      atomicOr(d.l.sticky_err, err);
      *out_error = err;
    }
  }
  if (with_rows) __syncthreads();  // the rows
}

// The small plan alone (MOE_EP_ONE_RANK_FAST's "plan"; dispatch_place follows).
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_one_small(Dev d, int64_t T, const int32_t* __restrict__ topk, const float* __restrict__ weights,
                       int32_t* out_gs, int32_t* out_tpe, int32_t* out_error) {  // <<<1, kCopyThreads>>>
  __shared__ OneSmallShared sh;
  pdl_begin();
  one_small_plan(d, T, topk, weights, out_gs, out_tpe, out_error, true, false, sh);
}

// The whole one-rank dispatch of few routes in one kernel (MOE_EP_ONE_RANK_FAST's "fused"):
// every block computes the small plan (block 0 also publishes it: the records, the table and the
// plan the later stages read), so that no block waits for another kernel or block, then does
// dispatch_place_grid's work at N = 1 over this step's T tokens with the routes' rows from its
// shared memory: one warp per (token, piece of kFanUnit units) storing the piece to each of the
// token's rows (piece 0 also rowmap, weight and metadata), then one warp per padding row. The
// same values as dispatch_one_plan and dispatch_place; the rows' only global read is the token
// piece, where dispatch_place's warps wait on four loads in a row (T, the records, the offsets,
// the piece). Rows 16-byte aligned only (tokens, out_tokens and row_bytes: ex_dispatch checks),
// so that the loop holds warp_fanout16 alone.
__global__ void __launch_bounds__(kCopyThreads, 2)
    dispatch_one_fused(Dev d, int64_t T, int64_t row_bytes, const char* __restrict__ tokens,
                       const int32_t* __restrict__ topk, const float* __restrict__ weights,
                       char* __restrict__ out_tokens, float* __restrict__ out_w, int32_t* __restrict__ out_meta,
                       int32_t* out_gs, int32_t* out_tpe, int32_t* out_error) {
  __shared__ OneSmallShared sh;
  pdl_begin();
  one_small_plan(d, T, topk, weights, out_gs, out_tpe, out_error, blockIdx.x == 0, true, sh);
  const ex::Shape& s = d.s;
  const int lane = threadIdx.x & 31;
  int64_t pieces = 1;
  if (T > 0) {
    const int64_t most = detail::div_up(row_bytes, kFanUnit), want = num_warps() / T;
    pieces = want < 1 ? 1 : (want < most ? want : most);
  }
  const int64_t piece_bytes =
      pieces == 1 ? row_bytes : detail::div_up(detail::div_up(row_bytes, pieces), kFanUnit) * kFanUnit;
  for (int64_t item = warp_id(); item < T * pieces + s.C; item += num_warps()) {
    if (item < T * pieces) {  // T * pieces <= max(T, num_warps()): 32-bit division (no call, no spills around it)
      const int32_t it = static_cast<int32_t>(item), np = static_cast<int32_t>(pieces);
      const int32_t t = it / np, piece = it - t * np;
      const int64_t h0 = piece * piece_bytes;
      if (h0 >= row_bytes) continue;  // the last pieces of a short row
      const int64_t len = row_bytes - h0 < piece_bytes ? row_bytes - h0 : piece_bytes;
      for (int64_t k0 = 0; k0 < s.K; k0 += 32) {
        const int64_t k = k0 + lane, route = t * s.K + k;
        const int32_t row = k < s.K ? sh.row[route] : -1;
        const unsigned mask = __ballot_sync(0xffffffffu, row >= 0);
        if (mask != 0)
          warp_fanout16<kOneFanInFlight>(out_tokens + h0, row_bytes, row, mask, tokens + t * row_bytes + h0, len, lane);
        if (piece == 0 && k < s.K) {  // after the stores: these loads wait on nothing else
          d.l.rowmap[route] = row;
          if (row >= 0) {
            out_w[row] = weights[route];
            int32_t* md = out_meta + 4 * static_cast<int64_t>(row);
            md[0] = topk[route], md[1] = 0, md[2] = static_cast<int32_t>(t), md[3] = static_cast<int32_t>(k);
          }
        }
      }
    } else {
      const int64_t r = item - T * pieces;  // padding_row from the shared plan
      bool pad = r >= sh.off[s.E];
      if (!pad) {
        int64_t lo = 0, hi = s.E;  // the last le with off[le] <= r
        while (hi - lo > 1) {
          const int64_t mid = (lo + hi) / 2;
          if (sh.off[mid] <= r) lo = mid;
          else hi = mid;
        }
        pad = r - sh.off[lo] >= sh.cursor[lo];
      }
      if (!pad) continue;
      warp_zero(out_tokens + r * row_bytes, row_bytes, lane);
      if (lane == 0) {
        out_w[r] = 0.0f;
        for (int c = 0; c < 4; ++c) out_meta[4 * r + c] = -1;
      }
    }
  }
}

// Per own route: its value (row_values at its row) as combine_finish returns it at N = 1,
// NaN on an error. A route with no row here has none: 0 (at N = 1 a routed route without a
// row is an overflow, an error).
__device__ void combine_one_values(const Dev& d, int64_t T, const float* __restrict__ row_values,
                                   float* __restrict__ out_values) {
  const int32_t err = *d.l.step_err;
  const float nan = __int_as_float(0x7fc00000);
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t r = gtid; r < T * d.s.K; r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t row = d.l.rowmap[r];
    out_values[r] = err ? nan : (row >= 0 ? row_values[row] : 0.0f);
  }
}

template <typename Y, bool kVecY, bool kVecOut, typename O, int kRt = MOE_EP_FORMAT_NONE>
__global__ void __launch_bounds__(kCopyThreads, 2)
    combine_one(Dev d, int64_t T, const Y* __restrict__ y, const float* __restrict__ row_values, O* __restrict__ out,
                float* __restrict__ out_values, int32_t* out_error) {
  pdl_begin();
  combine_send_grid<Y, kVecY, O, kRt>(d, y, nullptr, out);       // the sums (nothing on an error)
  combine_finish_grid<kVecOut, O>(d, T, out, nullptr, out_error);  // an error's NaN rows; the error
  if (out_values != nullptr) combine_one_values(d, T, row_values, out_values);
}

// combine_send_grid's one-rank sums (`direct`) for few tokens (MOE_EP_ONE_RANK_FAST's "combine",
// combine_one_as says when): one warp per (token, piece of one 16-byte vector per lane, 32 * V
// columns), the piece's loads from all of the token's routes in flight at once (kOneSumBatch
// rows), where combine_send_grid's pieces of kPieceVecs vectors a lane and four rows a batch leave
// most warps idle at 128 tokens and the busy ones waiting on eight loads in a row. The same sums
// in the same order (sum_rows), into the same places; nothing on an error (combine_finish_grid
// writes the NaN). Vector rows only (kRt: H a multiple of 128, so every lane has columns in
// every piece, as round_trip_read needs).
constexpr int kOneSumBatch = 8;

template <typename Y, typename O, int kRt>
__device__ void combine_one_sums_fine(const Dev& d, const Y* __restrict__ y, O* __restrict__ out) {
  using C = Cols<Y, true>;
  const ex::Shape& s = d.s;
  const int32_t err = *d.l.step_err;
  const int64_t T = d.l.tsrc[0];  // loaded with the error, not after it
  if (err != 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t piece = 32 * C::V, pieces = detail::div_up(s.H, piece);
  for (int64_t item = warp_id(); item < T * pieces; item += num_warps()) {
    const int32_t it = static_cast<int32_t>(item), np = static_cast<int32_t>(pieces);  // T * pieces <= 2 *
    const int32_t t = it / np;                       // num_warps() (combine_one_as): 32-bit division
    const int64_t h = static_cast<int64_t>(it - t * np) * piece + lane * C::V;
    const int32_t* rm = d.l.rowmap + static_cast<int64_t>(t) * s.K;
    const bool in = h < s.H;  // the last piece of a row may be short (never with kRt: no lane is out)
    float acc[C::V];
    if (s.K <= 32) {  // the token's rows in one load, handed round by shuffles (every lane takes part)
      const int32_t mine = lane < s.K ? rm[lane] : -1;
      const auto route_row = [&](int64_t k) -> const Y* {
        const int32_t r = __shfl_sync(0xffffffffu, mine, static_cast<int>(k));
        return r >= 0 && in ? y + static_cast<int64_t>(r) * s.H : nullptr;
      };
      sum_rows<C, kRt, kOneSumBatch>(s.K, route_row, h, acc);
    } else {
      const auto route_row = [&](int64_t k) -> const Y* {
        const int32_t r = rm[k];
        return r >= 0 && in ? y + static_cast<int64_t>(r) * s.H : nullptr;
      };
      sum_rows<C, kRt, kOneSumBatch>(s.K, route_row, h, acc);
    }
    if (in) store(out + static_cast<int64_t>(t) * s.H + h, acc);
  }
}

template <typename Y, typename O, int kRt = MOE_EP_FORMAT_NONE>
__global__ void __launch_bounds__(kCopyThreads, 2)
    combine_one_fine(Dev d, int64_t T, const Y* __restrict__ y, const float* __restrict__ row_values,
                     O* __restrict__ out, float* __restrict__ out_values, int32_t* out_error) {
  pdl_begin();
  combine_one_sums_fine<Y, O, kRt>(d, y, out);                    // the sums (nothing on an error)
  combine_finish_grid<true, O>(d, T, out, nullptr, out_error);     // an error's NaN rows; the error
  if (out_values != nullptr) combine_one_values(d, T, row_values, out_values);
}

// ------------------------------------------------------------------ low latency: one kernel per stage

// The low-latency mode runs a stage's steps in one cooperative kernel (every block resident,
// cooperative launch), the kernel boundaries of the throughput mode replaced by grid-wide
// barriers: the same bodies, the same flags and sequence numbers, the same results bit for
// bit. Before the barrier that precedes a publication, every thread fences its own stores
// into the peers' regions at system scope, as the end of a kernel did.

__global__ void __launch_bounds__(kCopyThreads, 2)
    dispatch_ll(Dev d, int64_t T, int64_t row_bytes, const char* __restrict__ tokens,
                const float* __restrict__ weights, char* __restrict__ out_tokens, float* __restrict__ out_w,
                int32_t* __restrict__ out_meta, int32_t* out_gs, int32_t* out_tpe, int32_t* out_error) {
  cg::grid_group grid = cg::this_grid();
  if (blockIdx.x == 0 && threadIdx.x < 32) dispatch_begin_warp(d, T);
  grid.sync();
  dispatch_send_grid(d, T, row_bytes, tokens, weights);
  __threadfence_system();
  grid.sync();
  if (blockIdx.x == 0) dispatch_sync_block(d, out_gs, out_tpe, out_error);
  grid.sync();
  dispatch_place_grid<true>(d, row_bytes, tokens, out_tokens, out_w, out_meta, kFanPass, d.s.N * d.s.Tmax);
  grid.sync();  // every peer row in this region read before the acknowledgement
  if (blockIdx.x == 0 && threadIdx.x < 32) publish(d, d.L.disp_ack, d.l.seq[0]);
}

template <typename Y, bool kVecY, bool kVecOut, typename O, int kRt = MOE_EP_FORMAT_NONE>
__global__ void __launch_bounds__(kCopyThreads, 2)
    combine_ll(Dev d, int64_t T, const Y* __restrict__ y, const float* __restrict__ row_values, O* __restrict__ out,
               float* __restrict__ out_values, int32_t* out_error) {
  cg::grid_group grid = cg::this_grid();
  if (blockIdx.x == 0 && threadIdx.x < 32) combine_begin_warp(d);
  grid.sync();
  combine_send_grid<Y, kVecY, O, kRt>(d, y, row_values, d.s.N == 1 ? out : nullptr);
  __threadfence_system();
  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x < 32) combine_sync_warp(d);
  grid.sync();
  combine_finish_grid<kVecOut, O>(d, T, out, out_values, out_error);
  grid.sync();  // every source row in this region read before the acknowledgement
  if (blockIdx.x == 0 && threadIdx.x < 32) publish(d, d.L.comb_ack, d.l.seq[1]);
}

// One kernel launched with one launch attribute.
template <typename... KArgs, typename... Args>
cudaError_t launch_with(cudaLaunchAttribute attr, void (*kernel)(KArgs...), unsigned grid, unsigned block,
                        cudaStream_t st, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = st;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

// One kernel of a stage, launched with programmatic stream serialization (pdl_begin).
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), unsigned grid, unsigned block, cudaStream_t st, Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return launch_with(attr, kernel, grid, block, st, args...);
}

// A low-latency stage's one kernel: a cooperative launch (every block resident, so the
// grid-wide barriers cannot deadlock) of `blocks` blocks (Exchange::ll_blocks: the
// setting, cut to what every low-latency kernel can have resident; ex_ll_blocks).
template <typename... KArgs, typename... Args>
cudaError_t launch_cooperative(void (*kernel)(KArgs...), int blocks, cudaStream_t st, Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return launch_with(attr, kernel, static_cast<unsigned>(blocks), kCopyThreads, st, args...);
}

moe_ep_status launch_failed(const char* kernel, cudaError_t err) {
  (void)cudaGetLastError();  // not left for the next check
  return fail(MOE_EP_ERR_CUDA, std::string("CUDA kernel exchange ") + kernel + " failed: " + cudaGetErrorName(err) +
                                   ": " + cudaGetErrorString(err));
}

#define MOE_EP_EX_LAUNCH(name, kernel, grid, block, st, ...)                         \
  do {                                                                               \
    const cudaError_t _e = launch(kernel, grid, block, st, __VA_ARGS__);             \
    if (_e != cudaSuccess) return launch_failed(name, _e);                           \
  } while (0)

// combine_send for y of element type Y and output element O (at one rank combine_send
// writes the output), 16-byte vectors where the rows and `direct` allow (kRt: always; the
// caller checked y, the output and H).
template <typename Y, typename O, int kRt = MOE_EP_FORMAT_NONE>
moe_ep_status launch_combine_send(cudaStream_t st, unsigned blocks, const Dev& d, const void* y,
                                  const float* row_values, O* direct) {
  const Y* rows = static_cast<const Y*>(y);
  constexpr bool kRound = kRt != MOE_EP_FORMAT_NONE;
  const bool vec = kRound || (d.s.H % (16 / static_cast<int64_t>(sizeof(Y))) == 0 && aligned16(y) &&
                              (direct == nullptr || aligned16(direct)));
  auto* kernel =
      kRound ? combine_send<Y, true, O, kRt> : (vec ? combine_send<Y, true, O> : combine_send<Y, false, O>);
  MOE_EP_EX_LAUNCH("combine_send", kernel, blocks, kCopyThreads, st, d, rows, row_values, direct);
  return MOE_EP_OK;
}

// The combine's five launches for output element O (float, or uint16_t bf16 bits).
template <typename O>
moe_ep_status combine_as(cudaStream_t st, const Dev& d, int num_blocks, int64_t comb_ack, int64_t T, const void* y,
                         int32_t y_dtype, O* out, const float* row_values, float* out_values, int32_t* out_error) {
  const unsigned blocks = static_cast<unsigned>(num_blocks);
  O* direct = d.s.N == 1 ? out : nullptr;  // one rank: the sums go straight into out
  MOE_EP_EX_LAUNCH("combine_begin", combine_begin, 1, 32, st, d);
  if (y_dtype == MOE_EP_DTYPE_BF16) MOE_EP_TRY(launch_combine_send<uint16_t>(st, blocks, d, y, row_values, direct));
  else if (y_dtype == MOE_EP_Y_F32_MXFP8_ROUND_TRIP)
    MOE_EP_TRY((launch_combine_send<float, O, MOE_EP_FORMAT_MXFP8>(st, blocks, d, y, row_values, direct)));
  else if (y_dtype == MOE_EP_Y_F32_NVFP4_ROUND_TRIP)
    MOE_EP_TRY((launch_combine_send<float, O, MOE_EP_FORMAT_NVFP4>(st, blocks, d, y, row_values, direct)));
  else MOE_EP_TRY(launch_combine_send<float>(st, blocks, d, y, row_values, direct));
  MOE_EP_EX_LAUNCH("combine_sync", combine_sync, 1, 32, st, d);
  auto* finish = d.s.H % 4 == 0 && aligned16(out) ? combine_finish<true, O> : combine_finish<false, O>;
  MOE_EP_EX_LAUNCH("combine_finish", finish, blocks, kCopyThreads, st, d, T, out, out_values,
                   out_error);
  MOE_EP_EX_LAUNCH("combine_ack", stage_ack, 1, 32, st, d, 1, comb_ack);
  return MOE_EP_OK;
}

// The low-latency combine: combine_ll with 16-byte vectors where the rows of y (combine_send)
// and the output (combine_finish, and combine_send at one rank) allow.
template <typename Y, typename O, int kRt = MOE_EP_FORMAT_NONE>
moe_ep_status combine_ll_as(cudaStream_t st, const Exchange& x, const Dev& d, int64_t T, const void* y, O* out,
                            const float* row_values, float* out_values, int32_t* out_error) {
  const Y* rows = static_cast<const Y*>(y);
  const bool vec_out = d.s.H % 4 == 0 && aligned16(out);
  const bool vec_y = d.s.H % (16 / static_cast<int64_t>(sizeof(Y))) == 0 && aligned16(y) && (d.s.N > 1 || vec_out);
  constexpr bool kRound = kRt != MOE_EP_FORMAT_NONE;
  auto* kernel = kRound ? combine_ll<Y, true, true, O, kRt>  // the caller checked y, the output and H
                 : vec_y ? (vec_out ? combine_ll<Y, true, true, O> : combine_ll<Y, true, false, O>)
                         : (vec_out ? combine_ll<Y, false, true, O> : combine_ll<Y, false, false, O>);
  const cudaError_t e = launch_cooperative(kernel, x.ll_blocks, st, d, T, rows, row_values, out, out_values,
                                           out_error);
  return e == cudaSuccess ? MOE_EP_OK : launch_failed("combine_ll", e);
}

// The one-rank combine (combine_one) with 16-byte vectors where y and the output allow;
// combine_one_fine instead when those are vectors and its pieces come to at most two per warp
// of the grid (few tokens; `fine`: MOE_EP_ONE_RANK_FAST's "combine").
template <typename Y, typename O, int kRt = MOE_EP_FORMAT_NONE>
moe_ep_status combine_one_as(cudaStream_t st, const Exchange& x, const Dev& d, int64_t T, const void* y, O* out,
                             const float* row_values, float* out_values, int32_t* out_error, bool fine) {
  const Y* rows = static_cast<const Y*>(y);
  const bool vec_out = d.s.H % 4 == 0 && aligned16(out);
  // Vector rows of y only with a vector output (combine_send writes the sums into it).
  const bool vec_y = d.s.H % (16 / static_cast<int64_t>(sizeof(Y))) == 0 && aligned16(y) && vec_out;
  const int64_t fine_pieces = T * detail::div_up(d.s.H, 32 * (16 / static_cast<int64_t>(sizeof(Y))));
  constexpr bool kRound = kRt != MOE_EP_FORMAT_NONE;
  if (fine && (kRound || vec_y) && fine_pieces <= 2 * static_cast<int64_t>(x.num_blocks) * (kCopyThreads / 32)) {
    MOE_EP_EX_LAUNCH("combine_one_fine", (combine_one_fine<Y, O, kRt>), static_cast<unsigned>(x.num_blocks),
                     kCopyThreads, st, d, T, rows, row_values, out, out_values, out_error);
    return MOE_EP_OK;
  }
  auto* kernel = kRound ? combine_one<Y, true, true, O, kRt>  // the caller checked y, the output and H
                 : vec_y ? combine_one<Y, true, true, O>
                         : (vec_out ? combine_one<Y, false, true, O> : combine_one<Y, false, false, O>);
  MOE_EP_EX_LAUNCH("combine_one", kernel, static_cast<unsigned>(x.num_blocks), kCopyThreads, st, d, T, rows,
                   row_values, out, out_values, out_error);
  return MOE_EP_OK;
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

moe_ep_status ex_default_blocks(int cuda_device, int* out) {
  int sms = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cuda_device);
  if (err != cudaSuccess) return cuda_fail("moe_ep_layer_create: the device's multiprocessor count", err);
  *out = 2 * (sms > 0 ? sms : 1);  // two blocks of kCopyThreads per multiprocessor
  return MOE_EP_OK;
}

namespace {

// Every combine_ll instantiation (y float32 or bf16 bits, vector loads of y and of the
// output or not, output float32 or bf16), for the occupancy query.
template <typename Y, typename O>
void combine_ll_kernels(const void** k) {
  k[0] = reinterpret_cast<const void*>(combine_ll<Y, true, true, O>);
  k[1] = reinterpret_cast<const void*>(combine_ll<Y, true, false, O>);
  k[2] = reinterpret_cast<const void*>(combine_ll<Y, false, true, O>);
  k[3] = reinterpret_cast<const void*>(combine_ll<Y, false, false, O>);
}

}  // namespace

moe_ep_status ex_ll_blocks(int cuda_device, int num_blocks, int* out) {
  const void* kernels[17] = {reinterpret_cast<const void*>(dispatch_ll)};
  combine_ll_kernels<float, float>(kernels + 1);
  combine_ll_kernels<float, uint16_t>(kernels + 5);
  combine_ll_kernels<uint16_t, float>(kernels + 9);
  combine_ll_kernels<uint16_t, uint16_t>(kernels + 13);
  int sms = 0, per_sm = 1 << 30;
  cudaError_t err = cudaSetDevice(cuda_device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cuda_device);
  for (const void* kernel : kernels) {
    int n = 0;
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kCopyThreads, 0);
    if (n < per_sm) per_sm = n;
  }
  if (err != cudaSuccess) return cuda_fail("moe_ep_layer_create: the low-latency kernels' occupancy", err);
  const int resident = sms * per_sm;
  *out = num_blocks < resident ? num_blocks : resident;  // 0: they cannot run on this device
  return MOE_EP_OK;
}

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

namespace {

// Whether one rank plans its routes in one block (dispatch_one_plan with topk): E <= kOneRouteExperts
// and, unless MOE_EP_ONE_RANK_PLAN says block or grid, at most kOneBlockMaxRoutes routes.
bool one_block_plan(int64_t num_experts, int64_t num_routes) {
  if (num_experts > kOneRouteExperts) return false;
  const char* force = std::getenv("MOE_EP_ONE_RANK_PLAN");
  if (force != nullptr && std::strcmp(force, "block") == 0) return true;
  if (force != nullptr && std::strcmp(force, "grid") == 0) return false;
  return num_routes <= kOneBlockMaxRoutes;
}

// Whether MOE_EP_ONE_RANK_FAST turns on `part` of the one-rank kernels for few tokens: "fused"
// (dispatch_one_fused: the whole dispatch in one kernel where the routes are planned in one
// block, up to kOneSmallRoutes), "plan" (without "fused" there: dispatch_one_small for
// dispatch_one_plan), "place" (dispatch_place's rows cut in kFanUnit pieces, over this step's
// tokens, wherever dispatch_place runs at one rank), "combine" (combine_one_fine). Unset, empty
// or "all": every part; "none": none; otherwise a comma-separated list of the parts on
// (check_one_rank_env rejects any other word), the others run the kernels they replace (the
// same results; for timing them against each other).
// The parts MOE_EP_ONE_RANK_FAST names.
constexpr const char* kOneRankFastParts[] = {"fused", "plan", "place", "combine"};

// MOE_EP_ONE_RANK_PLAN and MOE_EP_ONE_RANK_FAST checked before a one-rank stage: a value that
// names nothing is an error with the rule and the value (not a silent default).
moe_ep_status check_one_rank_env(const char* op) {
  const char* plan = std::getenv("MOE_EP_ONE_RANK_PLAN");
  if (plan != nullptr && *plan != '\0' && std::strcmp(plan, "block") != 0 && std::strcmp(plan, "grid") != 0)
    return fail(MOE_EP_ERR_INVALID_ARGUMENT, std::string(op) + ": MOE_EP_ONE_RANK_PLAN must be unset, 'block' or "
                                                               "'grid'; got '" + plan + "'");
  const char* fast = std::getenv("MOE_EP_ONE_RANK_FAST");
  if (fast == nullptr || *fast == '\0' || std::strcmp(fast, "all") == 0 || std::strcmp(fast, "none") == 0)
    return MOE_EP_OK;
  for (const char* p = fast;;) {
    const char* end = std::strchr(p, ',');
    const std::string item(p, end != nullptr ? static_cast<size_t>(end - p) : std::strlen(p));
    bool known = false;
    for (const char* part : kOneRankFastParts) known = known || item == part;
    if (!known)
      return fail(MOE_EP_ERR_INVALID_ARGUMENT,
                  std::string(op) + ": MOE_EP_ONE_RANK_FAST must be unset, 'all', 'none' or a comma-separated list of "
                                    "fused, plan, place, combine; got '" + fast + "'");
    if (end == nullptr) return MOE_EP_OK;
    p = end + 1;
  }
}

bool one_rank_fast(const char* part) {
  const char* v = std::getenv("MOE_EP_ONE_RANK_FAST");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "all") == 0) return true;
  const size_t n = std::strlen(part);
  for (const char* p = v;;) {
    const char* end = std::strchr(p, ',');
    const size_t len = end != nullptr ? static_cast<size_t>(end - p) : std::strlen(p);
    if (len == n && std::strncmp(p, part, n) == 0) return true;
    if (end == nullptr) return false;
    p = end + 1;
  }
}

}  // namespace

moe_ep_status ex_dispatch(void* stream, const Exchange& x, int64_t T, int64_t row_bytes, const void* tokens,
                          const int32_t* topk_idx, const float* weights, void* out_tokens, float* out_w,
                          int32_t* out_meta, int32_t* out_gs, int32_t* out_tpe, int32_t* out_error) {
  const Dev d = make_dev(x);
  cudaStream_t st = detail::as_stream(stream);
  if (d.s.N == 1) MOE_EP_TRY(check_one_rank_env("moe_ep_layer_dispatch"));
  // One rank with few experts and routes: the plan of the routes and their records inside
  // dispatch_one_plan; otherwise plan_routes first (and at one rank the records over the grid).
  const bool one_kernel_plan = d.s.N == 1 && one_block_plan(d.s.E, T * d.s.K);
  if (!one_kernel_plan)
    MOE_EP_TRY(plan_routes(stream, topk_idx, T, d.s.K, d.s.E, x.loc.send_route, x.loc.route_pos, x.loc.route_expert,
                           x.loc.counts));
  if (d.s.N == 1) {  // one rank: no exchange (either mode)
    const bool small = one_kernel_plan && T <= kOneSmallRoutes && T * d.s.K <= kOneSmallRoutes;
    if (small && aligned16(tokens) && aligned16(out_tokens) && row_bytes % 16 == 0 && one_rank_fast("fused")) {
      MOE_EP_EX_LAUNCH("dispatch_one_fused", dispatch_one_fused, static_cast<unsigned>(x.num_blocks), kCopyThreads, st,
                       d, T, row_bytes, static_cast<const char*>(tokens), topk_idx, weights,
                       static_cast<char*>(out_tokens), out_w, out_meta, out_gs, out_tpe, out_error);
      return MOE_EP_OK;
    }
    if (small && one_rank_fast("plan")) {
      MOE_EP_EX_LAUNCH("dispatch_one_small", dispatch_one_small, 1, kCopyThreads, st, d, T, topk_idx, weights, out_gs,
                       out_tpe, out_error);
    } else {
      MOE_EP_EX_LAUNCH("dispatch_one_plan", dispatch_one_plan, 1, kCopyThreads, st, d, T,
                       one_kernel_plan ? topk_idx : nullptr, weights, out_gs, out_tpe, out_error, one_kernel_plan);
      if (!one_kernel_plan)
        MOE_EP_EX_LAUNCH("dispatch_one_records", dispatch_one_records, static_cast<unsigned>(x.num_blocks),
                         kCopyThreads, st, d, T, weights);
    }
    const bool fine = one_rank_fast("place");
    MOE_EP_EX_LAUNCH("dispatch_place", dispatch_place, static_cast<unsigned>(x.num_blocks), kCopyThreads, st, d,
                     row_bytes, static_cast<const char*>(tokens), static_cast<char*>(out_tokens), out_w, out_meta,
                     fine ? kFanUnit : kFanPass, fine ? T : d.s.Tmax);
    return MOE_EP_OK;
  }
  if (x.mode == MOE_EP_EXCHANGE_LOW_LATENCY) {
    const cudaError_t e = launch_cooperative(dispatch_ll, x.ll_blocks, st, d, T, row_bytes,
                                             static_cast<const char*>(tokens), weights, static_cast<char*>(out_tokens),
                                             out_w, out_meta, out_gs, out_tpe, out_error);
    return e == cudaSuccess ? MOE_EP_OK : launch_failed("dispatch_ll", e);
  }
  const unsigned blocks = static_cast<unsigned>(x.num_blocks);
  MOE_EP_EX_LAUNCH("dispatch_begin", dispatch_begin, 1, 32, st, d, T);
  MOE_EP_EX_LAUNCH("dispatch_send", dispatch_send, blocks, kCopyThreads, st, d, T, row_bytes,
                   static_cast<const char*>(tokens), weights);
  MOE_EP_EX_LAUNCH("dispatch_sync", dispatch_sync, 1, kSyncThreads, st, d, out_gs, out_tpe, out_error);
  MOE_EP_EX_LAUNCH("dispatch_place", dispatch_place, blocks, kCopyThreads, st, d, row_bytes,
                   static_cast<const char*>(tokens), static_cast<char*>(out_tokens), out_w, out_meta, kFanPass,
                   d.s.N * d.s.Tmax);
  MOE_EP_EX_LAUNCH("dispatch_ack", stage_ack, 1, 32, st, d, 0, x.sym.disp_ack);
  return MOE_EP_OK;
}

// The combine of y_dtype rows (MOE_EP_DTYPE_F32, _BF16, MOE_EP_Y_F32_MXFP8_ROUND_TRIP or
// _NVFP4_ROUND_TRIP) into output elements O, in the layer's mode.
template <typename O>
moe_ep_status ex_combine_into(cudaStream_t st, const Exchange& x, const Dev& d, int64_t T, const void* y,
                              int32_t y_dtype, O* out, const float* row_values, float* out_values,
                              int32_t* out_error) {
  const bool bf16 = y_dtype == MOE_EP_DTYPE_BF16, mx = y_dtype == MOE_EP_Y_F32_MXFP8_ROUND_TRIP,
             nv = y_dtype == MOE_EP_Y_F32_NVFP4_ROUND_TRIP;
  if (d.s.N == 1) {  // one rank: no exchange (either mode)
    MOE_EP_TRY(check_one_rank_env("moe_ep_layer_combine"));
    const bool fine = one_rank_fast("combine");
    if (bf16) return combine_one_as<uint16_t>(st, x, d, T, y, out, row_values, out_values, out_error, fine);
    if (mx)
      return combine_one_as<float, O, MOE_EP_FORMAT_MXFP8>(st, x, d, T, y, out, row_values, out_values, out_error,
                                                           fine);
    if (nv)
      return combine_one_as<float, O, MOE_EP_FORMAT_NVFP4>(st, x, d, T, y, out, row_values, out_values, out_error,
                                                           fine);
    return combine_one_as<float>(st, x, d, T, y, out, row_values, out_values, out_error, fine);
  }
  if (x.mode == MOE_EP_EXCHANGE_LOW_LATENCY) {
    if (bf16) return combine_ll_as<uint16_t>(st, x, d, T, y, out, row_values, out_values, out_error);
    if (mx) return combine_ll_as<float, O, MOE_EP_FORMAT_MXFP8>(st, x, d, T, y, out, row_values, out_values, out_error);
    if (nv) return combine_ll_as<float, O, MOE_EP_FORMAT_NVFP4>(st, x, d, T, y, out, row_values, out_values, out_error);
    return combine_ll_as<float>(st, x, d, T, y, out, row_values, out_values, out_error);
  }
  return combine_as(st, d, x.num_blocks, x.sym.comb_ack, T, y, y_dtype, out, row_values, out_values, out_error);
}

moe_ep_status ex_combine(void* stream, const Exchange& x, int64_t T, const void* y, int32_t y_dtype, void* out,
                         bool out_bf16, const float* row_values, float* out_values, int32_t* out_error) {
  const Dev d = make_dev(x);
  cudaStream_t st = detail::as_stream(stream);
  if (out_bf16)
    return ex_combine_into(st, x, d, T, y, y_dtype, static_cast<uint16_t*>(out), row_values, out_values, out_error);
  return ex_combine_into(st, x, d, T, y, y_dtype, static_cast<float*>(out), row_values, out_values, out_error);
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
