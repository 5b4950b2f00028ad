// The device exchange (include/moe_ep_native.h, section "exchange"): the host
// logic of the layer's dispatch and combine stages, and the CPU twin of the
// protocol, tested in CI. The twin runs the very steps of the CUDA kernels
// (cuda/exchange.cu) on host memory, one rank per thread or process: the count
// table, the slab offsets, the flags and their step numbers, the
// acknowledgements, the bounded waits. Both share exchange_layout.h. (The
// kernels' one-rank shortcut, combine_send writing the output itself, has no
// twin here: it writes the very numbers of the two passes.)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <thread>

#include "cpu/formats.h"
#include "cpu/fpenv.h"
#include "exchange.h"

namespace moe_ep {
namespace {

bool cpu_layer(const Exchange* x) { return !x->cuda; }

// ------------------------------------------------------------ CPU twin

uint64_t load_acquire(const void* region, int64_t off, int32_t i) {
  const uint64_t* p = reinterpret_cast<const uint64_t*>(static_cast<const char*>(region) + off) + i;
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

void store_release(void* region, int64_t off, int32_t i, uint64_t v) {
  uint64_t* p = reinterpret_cast<uint64_t*>(static_cast<char*>(region) + off) + i;
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

char* peer(const Exchange& x, int32_t p) { return reinterpret_cast<char*>(x.peers[static_cast<size_t>(p)]); }

// Waits until own[off][p] satisfies `ready` for every peer p, at most timeout_ms in all;
// returns kTimeout when some peer did not arrive, and ORs the error bits the flags carry into *carried.
template <typename Ready>
int32_t wait_all(const Exchange& x, int64_t off, Ready ready, int32_t* carried) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(x.timeout_ms);
  for (int32_t p = 0; p < x.shape.N; ++p) {
    uint64_t v;
    unsigned spins = 0;
    while (!ready(v = load_acquire(x.region, off, p))) {
      if (++spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) return ex::kTimeout;
      std::this_thread::yield();
    }
    if (carried != nullptr) *carried |= static_cast<int32_t>(v & 0xff);
  }
  return 0;
}

moe_ep_status cpu_dispatch(Exchange& x, int64_t T, int64_t row_bytes, const void* tokens, const int32_t* idx,
                           const float* weights, void* out_tokens, float* out_w, int32_t* out_meta, int32_t* out_gs,
                           int32_t* out_tpe, int32_t* out_error) {
  const ex::Shape& s = x.shape;
  const ex::SymLayout& L = x.sym;
  const ex::Local& l = x.loc;
  const uint64_t seq = ++l.seq[0];
  int32_t err = 0;
  MOE_EP_TRY(cpu::plan_routes(nullptr, idx, T, s.K, s.E, l.send_route, l.route_pos, l.route_expert, l.counts));
  if (T == 0) std::fill(l.counts, l.counts + s.E + 1, 0);
  for (int64_t g = 0, run = 0; g < s.E; ++g) {
    l.excl[g] = static_cast<int32_t>(run);
    run += l.counts[g];
  }
  // The receivers must have consumed the previous step.
  err |= wait_all(x, L.disp_ack, [&](uint64_t v) { return v >= seq - 1; }, nullptr);
  for (int64_t r = 0; r < T * s.K; ++r) {
    const int32_t g = l.route_expert[r];
    l.route_dest[r] = g >= 0 ? static_cast<int32_t>(g / s.El) : -1;
  }
  for (int64_t t = 0; t < T; ++t) ex::token_ranks(l.route_dest + t * s.K, s.K, l.tok_ranks + t * s.K);
  if (!(err & ex::kTimeout)) {
    for (int32_t p = 0; p < s.N; ++p) {
      char* base = peer(x, p);
      int32_t* row = reinterpret_cast<int32_t*>(base + L.table) + static_cast<int64_t>(s.rank) * (s.E + 2);
      std::memcpy(row, l.counts, static_cast<size_t>(s.E + 1) * 4);
      row[s.E + 1] = static_cast<int32_t>(T);
      ex::RouteMeta* meta = reinterpret_cast<ex::RouteMeta*>(base + L.dmeta) + static_cast<int64_t>(s.rank) * s.Tmax * s.K;
      char* rows = base + L.drows + static_cast<int64_t>(s.rank) * s.Tmax * s.stride;
      for (int64_t t = 0; t < T; ++t) {
        bool has = false;
        for (int64_t k = 0; k < s.K; ++k) {
          const int64_t r = t * s.K + k;
          const int32_t g = l.route_expert[r];
          ex::RouteMeta m{-1, 0, 0.0f, 0};
          if (g >= 0 && g / s.El == p) {
            m.le = static_cast<int32_t>(g % s.El);
            m.pos = l.route_pos[r] - l.excl[g];
            m.w = weights[r];
            has = true;
          }
          meta[t * s.K + k] = m;
        }
        // This rank's own rows stay in `tokens` (the placement reads them there).
        if (has && p != s.rank)
          std::memcpy(rows + t * s.stride, static_cast<const char*>(tokens) + t * row_bytes, row_bytes);
      }
    }
  }
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  for (int32_t p = 0; p < s.N; ++p) store_release(peer(x, p), L.disp_flag, s.rank, ex::flag_value(seq, err));
  err |= wait_all(x, L.disp_flag, [&](uint64_t v) { return ex::flag_step(v) >= seq; }, &err);
  const int32_t* table = reinterpret_cast<const int32_t*>(static_cast<const char*>(x.region) + L.table);
  err |= ex::plan_from_table(s, table, (err & ex::kTimeout) != 0, l.off, l.nloc, l.pref, l.tsrc);
  *l.step_err = err;
  *l.sticky_err |= err;
  *l.t_me = static_cast<int32_t>(T);
  for (int64_t le = 0; le < s.El; ++le) {
    out_gs[le] = ex::group_size(s, l.off, le);
    if (out_tpe != nullptr) out_tpe[le] = l.nloc[le];
  }
  *out_error = err;
  // Local placement into the expert-major buffer, then the padding rows.
  const char* region = static_cast<const char*>(x.region);
  for (int32_t src = 0; src < s.N; ++src) {
    const ex::RouteMeta* meta = reinterpret_cast<const ex::RouteMeta*>(region + L.dmeta) + src * s.Tmax * s.K;
    const bool own_rows = src == s.rank;
    const char* rows = own_rows ? static_cast<const char*>(tokens) : region + L.drows + src * s.Tmax * s.stride;
    const int64_t row_stride = own_rows ? row_bytes : s.stride;
    for (int64_t t = 0; t < l.tsrc[src]; ++t)
      for (int64_t k = 0; k < s.K; ++k) {
        const ex::RouteMeta m = meta[t * s.K + k];
        int32_t row = -1;
        if (m.le >= 0) row = ex::route_row(s, l.off, l.pref, src, m.le, m.pos);
        l.rowmap[(src * s.Tmax + t) * s.K + k] = row;
        if (row < 0) continue;
        std::memcpy(static_cast<char*>(out_tokens) + row * row_bytes, rows + t * row_stride, row_bytes);
        out_w[row] = m.w;
        int32_t* md = out_meta + 4 * static_cast<int64_t>(row);
        md[0] = m.le, md[1] = src, md[2] = static_cast<int32_t>(t), md[3] = static_cast<int32_t>(k);
      }
  }
  for (int64_t r = 0; r < s.C; ++r) {
    if (!ex::is_padding(s, l.off, l.nloc, r)) continue;
    std::memset(static_cast<char*>(out_tokens) + r * row_bytes, 0, row_bytes);
    out_w[r] = 0.0f;
    for (int c = 0; c < 4; ++c) out_meta[4 * r + c] = -1;
  }
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  for (int32_t p = 0; p < s.N; ++p) store_release(peer(x, p), L.disp_ack, s.rank, seq);
  return MOE_EP_OK;
}

// One element of a y row as float32 (bf16: exact, its bits are the high half).
float y_value(const float* y, int64_t i) { return y[i]; }
float y_value(const uint16_t* y, int64_t i) { return cpu::bf16_to_float(y[i]); }

// One output element: float32 as summed, or its bf16 encoding (nearest, ties to even).
void put_out(float* out, int64_t i, float v) { out[i] = v; }
void put_out(uint16_t* out, int64_t i, float v) { out[i] = cpu::bf16_from_float(v); }

// round_trip (float32 y only; MOE_EP_FORMAT_NONE: none): each route's row through that format's
// round trip as it is read (MOE_EP_Y_F32_MXFP8_ROUND_TRIP, MOE_EP_Y_F32_NVFP4_ROUND_TRIP), into a
// copy of the token's K rows.
template <typename Y, typename O>
moe_ep_status cpu_combine(Exchange& x, int64_t T, const Y* y, O* out, const float* row_values,
                          float* out_values, int32_t* out_error, moe_ep_format round_trip_format) {
  const bool round_trip = round_trip_format != MOE_EP_FORMAT_NONE;
  const ex::Shape& s = x.shape;
  const ex::SymLayout& L = x.sym;
  const ex::Local& l = x.loc;
  std::vector<float> rt_rows(round_trip ? static_cast<size_t>(s.K * s.H) : 0);
  std::vector<uint8_t> rt_data, rt_scale;
  const uint64_t seq = ++l.seq[1];
  int32_t err = *l.step_err;
  err |= wait_all(x, L.comb_ack, [&](uint64_t v) { return v >= seq - 1; }, nullptr);
  // A failed round trip (not possible for the rows of a valid shape) stops the sums, but the
  // peers are still signalled below, so that none waits for this rank into its timeout; this
  // rank's outputs are then NaN and the status is returned (the peers' sums lack this rank's
  // part, and the error status is this rank's alone).
  moe_ep_status status = MOE_EP_OK;
  if (!(err & ex::kTimeout)) {
    for (int32_t src = 0; src < s.N && status == MOE_EP_OK; ++src) {
      char* base = peer(x, src);
      float* crows = reinterpret_cast<float*>(base + L.crows);
      float* cvals = reinterpret_cast<float*>(base + L.cvals);
      for (int64_t t = 0; t < l.tsrc[src] && status == MOE_EP_OK; ++t) {
        const int32_t* rm = l.rowmap + (src * s.Tmax + t) * s.K;
        if (round_trip) {
          for (int64_t k = 0; k < s.K && status == MOE_EP_OK; ++k) {
            if (rm[k] < 0) continue;
            float* row = rt_rows.data() + k * s.H;
            for (int64_t h = 0; h < s.H; ++h) row[h] = y_value(y, rm[k] * s.H + h);
            status = cpu::round_trip_row(round_trip_format, row, s.H, &rt_data, &rt_scale);
          }
          if (status != MOE_EP_OK) break;
        }
        // Route k's element h as the combine reads it.
        const auto value = [&](int64_t k, int64_t h) {
          return round_trip ? rt_rows[static_cast<size_t>(k * s.H + h)] : y_value(y, rm[k] * s.H + h);
        };
        bool has = false;
        for (int64_t k = 0; k < s.K; ++k) {
          if (rm[k] < 0) continue;
          has = true;
          if (row_values != nullptr) cvals[t * s.K + k] = row_values[rm[k]];
          if (s.order == 1)
            for (int64_t h = 0; h < s.H; ++h) crows[(k * s.Tmax + t) * s.H + h] = value(k, h);
        }
        if (s.order == 1 || !has) continue;
        float* dst = crows + (static_cast<int64_t>(s.rank) * s.Tmax + t) * s.H;
        for (int64_t h = 0; h < s.H; ++h) {
          float acc = 0.0f;
          for (int64_t k = 0; k < s.K; ++k)
            if (rm[k] >= 0) acc += value(k, h);
          dst[h] = acc;
        }
      }
    }
  }
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  for (int32_t p = 0; p < s.N; ++p) store_release(peer(x, p), L.comb_flag, s.rank, ex::flag_value(seq, err));
  err |= wait_all(x, L.comb_flag, [&](uint64_t v) { return ex::flag_step(v) >= seq; }, &err);
  *l.step_err = err;
  *l.sticky_err |= err;
  const char* region = static_cast<const char*>(x.region);
  const float* crows = reinterpret_cast<const float*>(region + L.crows);
  const float* cvals = reinterpret_cast<const float*>(region + L.cvals);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const bool bad = err != 0 || status != MOE_EP_OK;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* dest = l.route_dest + t * s.K;
    const int32_t* ranks = l.tok_ranks + t * s.K;  // RANK_SUMS: the ranks to add, in rank order
    for (int64_t h = 0; h < s.H; ++h) {
      float acc = 0.0f;
      if (s.order == 1) {
        for (int64_t k = 0; k < s.K; ++k)
          if (dest[k] >= 0) acc += crows[(k * s.Tmax + t) * s.H + h];
      } else {
        for (int64_t j = 0; j < s.K && ranks[j] >= 0; ++j) acc += crows[(ranks[j] * s.Tmax + t) * s.H + h];
      }
      put_out(out, t * s.H + h, bad ? nan : acc);
    }
    if (out_values != nullptr)
      for (int64_t k = 0; k < s.K; ++k)
        out_values[t * s.K + k] = bad ? nan : (dest[k] >= 0 ? cvals[t * s.K + k] : 0.0f);
  }
  if (out_error != nullptr) *out_error = err;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  for (int32_t p = 0; p < s.N; ++p) store_release(peer(x, p), L.comb_ack, s.rank, seq);
  return status;
}

moe_ep_status alloc_zero(Exchange* x, size_t bytes, void** out) {
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) return cuda::ex_alloc_zero(x->cuda_device, bytes, out);
#else
  (void)x;  // CPU-only build: host memory
#endif
  void* p = std::aligned_alloc(256, align256(bytes));
  if (p == nullptr) return fail(MOE_EP_ERR_INTERNAL, "moe_ep_layer_create: out of host memory for the exchange");
  std::memset(p, 0, align256(bytes));
  *out = p;
  return MOE_EP_OK;
}

moe_ep_status free_mem(const Exchange* x, void* p) {
  if (p == nullptr) return MOE_EP_OK;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) return cuda::ex_free(p);
#endif
  (void)x;
  std::free(p);
  return MOE_EP_OK;
}

moe_ep_status get(const Check& ck, const moe_ep_layer* layer, Exchange** out) {
  if (layer == nullptr) return ck.bad("layer must not be NULL", "NULL");
  Exchange* x = layer_exchange(layer);
  if (x == nullptr)
    return ck.bad("the layer must be made with config->ex_num_ranks >= 1 for the exchange stages", "0");
  *out = x;
  return MOE_EP_OK;
}

moe_ep_status check_stream(const Check& ck, const Exchange* x, void* stream) {
  if (cpu_layer(x) && stream != nullptr) return ck.bad("stream must be NULL for a CPU layer", "a non-NULL stream");
  return MOE_EP_OK;
}

}  // namespace

moe_ep_status exchange_check_config(const Check& ck, const moe_ep_layer_config& c) {
  if (c.ex_num_ranks == 0) return MOE_EP_OK;
  MOE_EP_TRY(ck.positive("config->ex_num_ranks", c.ex_num_ranks));
  if (c.ex_rank < 0 || c.ex_rank >= c.ex_num_ranks)
    return ck.bad("config->ex_rank must be in [0, ex_num_ranks = " + std::to_string(c.ex_num_ranks) + ")",
                  std::to_string(c.ex_rank));
  MOE_EP_TRY(ck.positive("config->ex_num_topk", c.ex_num_topk));
  if (c.ex_num_experts != static_cast<int64_t>(c.ex_num_ranks) * c.num_local_experts)
    return ck.bad("config->ex_num_experts must be ex_num_ranks * num_local_experts = " +
                      std::to_string(static_cast<int64_t>(c.ex_num_ranks) * c.num_local_experts),
                  std::to_string(c.ex_num_experts));
  MOE_EP_TRY(ck.nonneg("config->ex_max_tokens", c.ex_max_tokens));
  MOE_EP_TRY(ck.positive("config->ex_token_bytes", c.ex_token_bytes));
  MOE_EP_TRY(ck.positive("config->ex_expert_alignment", c.ex_expert_alignment));
  MOE_EP_TRY(ck.nonneg("config->ex_timeout_ms", c.ex_timeout_ms));
  MOE_EP_TRY(ck.nonneg("config->ex_num_sms", c.ex_num_sms));
  if (c.ex_combine_order != MOE_EP_COMBINE_RANK_SUMS && c.ex_combine_order != MOE_EP_COMBINE_SLOT_ORDER)
    return ck.bad("config->ex_combine_order must be MOE_EP_COMBINE_RANK_SUMS (0) or MOE_EP_COMBINE_SLOT_ORDER (1)",
                  std::to_string(c.ex_combine_order));
  if (c.ex_mode != MOE_EP_EXCHANGE_THROUGHPUT && c.ex_mode != MOE_EP_EXCHANGE_LOW_LATENCY)
    return ck.bad("config->ex_mode must be MOE_EP_EXCHANGE_THROUGHPUT (0) or MOE_EP_EXCHANGE_LOW_LATENCY (1)",
                  std::to_string(c.ex_mode));
  constexpr int64_t kLimit = (int64_t{1} << 31) - 1;
  MOE_EP_TRY(ck.product("config->ex_max_tokens * ex_num_topk", c.ex_max_tokens, c.ex_num_topk, kLimit / 64));
  MOE_EP_TRY(ck.product("config->ex_max_tokens * ex_num_ranks * ex_num_topk",
                        c.ex_max_tokens * c.ex_num_topk, c.ex_num_ranks, kLimit));
  if (c.max_rows >= kLimit) return ck.bad("config->max_rows must be < 2^31 with the exchange", std::to_string(c.max_rows));
  return MOE_EP_OK;
}

moe_ep_status exchange_create(const moe_ep_layer_config& c, Exchange** out) {
  *out = nullptr;
  if (c.ex_num_ranks == 0) return MOE_EP_OK;
  Exchange* x = new (std::nothrow) Exchange();
  if (x == nullptr) return fail(MOE_EP_ERR_INTERNAL, "moe_ep_layer_create: out of host memory");
  ex::Shape& s = x->shape;
  s.N = c.ex_num_ranks, s.rank = c.ex_rank, s.K = c.ex_num_topk, s.order = c.ex_combine_order;
  s.E = c.ex_num_experts, s.El = c.num_local_experts, s.Tmax = c.ex_max_tokens, s.C = c.max_rows;
  s.A = c.ex_expert_alignment, s.H = c.hidden, s.stride = ex::align_up(c.ex_token_bytes, 16);
  x->sym = ex::sym_layout(s);
  x->cuda = c.device == MOE_EP_DEVICE_CUDA;
  x->cuda_device = c.cuda_device;
  x->timeout_ms = c.ex_timeout_ms > 0 ? c.ex_timeout_ms : 60000;
  x->num_blocks = c.ex_num_sms > 0 ? c.ex_num_sms : 32;  // the CPU twin has no blocks
  x->mode = c.ex_mode;                                    // nor kernels: one path for both modes
  x->token_bytes_max = c.ex_token_bytes;
  x->peers.assign(static_cast<size_t>(s.N), 0);
  moe_ep_status st = MOE_EP_OK;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda && c.ex_num_sms == 0) st = cuda::ex_default_blocks(x->cuda_device, &x->num_blocks);
  if (x->cuda && st == MOE_EP_OK && x->mode == MOE_EP_EXCHANGE_LOW_LATENCY) {
    st = cuda::ex_ll_blocks(x->cuda_device, x->num_blocks, &x->ll_blocks);
    if (st == MOE_EP_OK && x->ll_blocks < 1)
      st = fail(MOE_EP_ERR_UNSUPPORTED, "moe_ep_layer_create: the low-latency exchange's kernels cannot be resident "
                                        "on CUDA device " + std::to_string(x->cuda_device) +
                                        " (a cooperative launch needs every block resident); use "
                                        "MOE_EP_EXCHANGE_THROUGHPUT");
  }
#endif
  if (st == MOE_EP_OK) st = alloc_zero(x, static_cast<size_t>(x->sym.bytes), &x->own);
  x->local_bytes = ex::local_bytes_carve(s, nullptr, nullptr);
  if (st == MOE_EP_OK) st = alloc_zero(x, static_cast<size_t>(x->local_bytes), &x->local);
  if (st != MOE_EP_OK) {
    exchange_destroy(x);
    return st;
  }
  ex::local_bytes_carve(s, static_cast<char*>(x->local), &x->loc);
  x->region = x->own;
  *out = x;
  return MOE_EP_OK;
}

moe_ep_status exchange_destroy(Exchange* x) {
  if (x == nullptr) return MOE_EP_OK;
  moe_ep_status st = MOE_EP_OK;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  for (void* p : x->opened) {
    const moe_ep_status s2 = cuda::ex_ipc_close(p);
    if (st == MOE_EP_OK) st = s2;
  }
#endif
#ifdef MOE_EP_NATIVE_WITH_NCCL_DEVICE
  if (x->nccl != nullptr) {
    const moe_ep_status s2 = lsa::ex_release(x->nccl);
    x->nccl = nullptr;
    if (st == MOE_EP_OK) st = s2;
  }
#endif
  const moe_ep_status a = free_mem(x, x->own), b = free_mem(x, x->local);
  delete x;
  if (st == MOE_EP_OK) st = a;
  if (st == MOE_EP_OK) st = b;
  return st;
}

}  // namespace moe_ep

using moe_ep::Check;
using moe_ep::Exchange;

extern "C" {

moe_ep_status moe_ep_layer_exchange_info(const moe_ep_layer* layer, uint64_t* symmetric_bytes, uint64_t* own_region) {
  const Check ck{"moe_ep_layer_exchange_info"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
  if (symmetric_bytes == nullptr) return ck.bad("symmetric_bytes must not be NULL", "NULL");
  if (own_region == nullptr) return ck.bad("own_region must not be NULL", "NULL");
  *symmetric_bytes = static_cast<uint64_t>(x->sym.bytes);
  *own_region = reinterpret_cast<uint64_t>(x->own);
  return MOE_EP_OK;
}

moe_ep_status moe_ep_layer_set_peers(moe_ep_layer* layer, const uint64_t* peer_regions) {
  const Check ck{"moe_ep_layer_set_peers"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
  if (peer_regions == nullptr) return ck.bad("peer_regions must not be NULL", "NULL");
  for (int32_t p = 0; p < x->shape.N; ++p)
    if (peer_regions[p] == 0 || peer_regions[p] % 256 != 0)
      return ck.bad("peer_regions[" + std::to_string(p) + "] must be a non-NULL address aligned to 256 bytes",
                    std::to_string(peer_regions[p]));
  x->peers.assign(peer_regions, peer_regions + x->shape.N);
  x->region = reinterpret_cast<void*>(peer_regions[x->shape.rank]);
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) {
    MOE_EP_TRY(moe_ep::cuda::ex_copy_to_device(x->cuda_device, x->loc.peers, x->peers.data(), 8 * x->peers.size()));
    x->connected = true;
    return MOE_EP_OK;
  }
#endif
  std::memcpy(x->loc.peers, x->peers.data(), 8 * x->peers.size());
  x->connected = true;
  return MOE_EP_OK;
}

moe_ep_status moe_ep_layer_ipc_handle(const moe_ep_layer* layer, uint8_t* handle, size_t handle_bytes) {
  const Check ck{"moe_ep_layer_ipc_handle"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
  if (handle == nullptr) return ck.bad("handle must not be NULL", "NULL");
  if (handle_bytes != MOE_EP_IPC_HANDLE_BYTES)
    return ck.bad("handle_bytes must be MOE_EP_IPC_HANDLE_BYTES = 64", std::to_string(handle_bytes));
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) return moe_ep::cuda::ex_ipc_handle(x->own, handle);
#endif
  return moe_ep::fail(MOE_EP_ERR_UNSUPPORTED, "moe_ep_layer_ipc_handle: IPC handles exist for CUDA layers only");
}

moe_ep_status moe_ep_layer_set_peers_ipc(moe_ep_layer* layer, const uint8_t* handles, size_t handle_bytes) {
  const Check ck{"moe_ep_layer_set_peers_ipc"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
  if (handles == nullptr) return ck.bad("handles must not be NULL", "NULL");
  if (handle_bytes != static_cast<size_t>(MOE_EP_IPC_HANDLE_BYTES) * x->shape.N)
    return ck.bad("handle_bytes must be 64 * ex_num_ranks = " + std::to_string(64 * x->shape.N),
                  std::to_string(handle_bytes));
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) {
    if (!x->opened.empty()) return ck.bad("the peers were set already (make a new layer to reconnect)", "a second call");
    std::vector<uint64_t> table(static_cast<size_t>(x->shape.N));
    for (int32_t p = 0; p < x->shape.N; ++p) {
      if (p == x->shape.rank) {
        table[p] = reinterpret_cast<uint64_t>(x->own);
        continue;
      }
      void* mapped = nullptr;
      MOE_EP_TRY(moe_ep::cuda::ex_ipc_open(x->cuda_device, handles + 64 * static_cast<size_t>(p), &mapped));
      x->opened.push_back(mapped);
      table[p] = reinterpret_cast<uint64_t>(mapped);
    }
    return moe_ep_layer_set_peers(layer, table.data());
  }
#endif
  return moe_ep::fail(MOE_EP_ERR_UNSUPPORTED, "moe_ep_layer_set_peers_ipc: IPC handles exist for CUDA layers only");
}

moe_ep_status moe_ep_layer_set_peers_nccl(moe_ep_layer* layer, moe_ep_comm* comm) {
  const Check ck{"moe_ep_layer_set_peers_nccl"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
#ifdef MOE_EP_NATIVE_WITH_NCCL_DEVICE
  if (!x->cuda)
    return moe_ep::fail(MOE_EP_ERR_UNSUPPORTED,
                        "moe_ep_layer_set_peers_nccl: NCCL's symmetric windows serve CUDA layers only (a CPU layer "
                        "takes host memory through moe_ep_layer_set_peers); got a CPU layer");
  if (comm == nullptr) return ck.bad("comm must be a communicator from moe_ep_comm_init", "NULL");
  if (x->connected || !x->opened.empty() || x->nccl != nullptr)
    return ck.bad("the peers were set already (make a new layer to reconnect)", "a second call");
  return moe_ep::lsa::ex_set_peers(layer, *x, comm);
#else
  (void)x, (void)comm;
#ifdef MOE_EP_NATIVE_WITH_NCCL
  return moe_ep::fail(MOE_EP_ERR_UNSUPPORTED,
                      "moe_ep_layer_set_peers_nccl: this build's NCCL has no device API (nccl_device.h, NCCL >= 2.28): "
                      "rebuild against nvidia-nccl-cu13==2.28.9 (the NCCL it runs with), or use the IPC loopback "
                      "(moe_ep_layer_set_peers_ipc) or moe_ep_layer_set_peers");
#else
  return moe_ep::fail(MOE_EP_ERR_UNSUPPORTED,
                      "moe_ep_layer_set_peers_nccl: this build of the native core has no NCCL transport (rebuild with "
                      "MOE_EP_NATIVE_CUDA=ON and MOE_EP_NATIVE_NCCL=ON; docs/native.md), so it has no NCCL peer "
                      "provider: use the IPC loopback (moe_ep_layer_set_peers_ipc) or moe_ep_layer_set_peers");
#endif
#endif
}

moe_ep_status moe_ep_layer_dispatch(moe_ep_layer* layer, void* stream, int64_t num_tokens, int64_t row_bytes,
                                    const void* tokens, const int32_t* topk_idx, const float* topk_weights,
                                    void* out_tokens, float* out_weights, int32_t* out_route_metadata,
                                    int32_t* out_group_sizes, int32_t* out_tokens_per_expert, int32_t* out_error) {
  const Check ck{"moe_ep_layer_dispatch"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
  MOE_EP_TRY(moe_ep::check_stream(ck, x, stream));
  if (!x->connected) return ck.bad("the peer table must be set first (moe_ep_layer_set_peers)", "none");
  const moe_ep::ex::Shape& s = x->shape;
  MOE_EP_TRY(ck.nonneg("num_tokens", num_tokens));
  if (num_tokens > s.Tmax)
    return ck.bad("num_tokens must be <= config->ex_max_tokens = " + std::to_string(s.Tmax), std::to_string(num_tokens));
  if (row_bytes < 1 || row_bytes > x->token_bytes_max)
    return ck.bad("row_bytes must be in [1, config->ex_token_bytes = " + std::to_string(x->token_bytes_max) + "]",
                  std::to_string(row_bytes));
  MOE_EP_TRY(ck.ptr("tokens", tokens, num_tokens * row_bytes));
  MOE_EP_TRY(ck.ptr("topk_idx", topk_idx, num_tokens * s.K, 4));
  MOE_EP_TRY(ck.ptr("topk_weights", topk_weights, num_tokens * s.K, 4));
  MOE_EP_TRY(ck.ptr("out_tokens", out_tokens, s.C * row_bytes));
  MOE_EP_TRY(ck.ptr("out_weights", out_weights, s.C, 4));
  MOE_EP_TRY(ck.ptr("out_route_metadata", out_route_metadata, s.C * 4, 4));
  MOE_EP_TRY(ck.ptr("out_group_sizes", out_group_sizes, s.El, 4));
  if (out_tokens_per_expert != nullptr) MOE_EP_TRY(ck.ptr("out_tokens_per_expert", out_tokens_per_expert, s.El, 4));
  MOE_EP_TRY(ck.ptr("out_error", out_error, 1, 4));
  x->last_tokens = num_tokens;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) {
    return moe_ep::cuda::ex_dispatch(stream, *x, num_tokens, row_bytes, tokens, topk_idx, topk_weights, out_tokens,
                                     out_weights, out_route_metadata, out_group_sizes, out_tokens_per_expert,
                                     out_error);
  }
#endif
  moe_ep::cpu::IeeeFpEnv fp_env;
  return moe_ep::cpu_dispatch(*x, num_tokens, row_bytes, tokens, topk_idx, topk_weights, out_tokens, out_weights,
                              out_route_metadata, out_group_sizes, out_tokens_per_expert, out_error);
}

moe_ep_status moe_ep_layer_combine(moe_ep_layer* layer, void* stream, int64_t num_tokens, const void* y_rows,
                                   int32_t y_dtype, void* out, int32_t out_dtype, const float* row_values,
                                   float* out_values, int32_t* out_error) {
  const Check ck{"moe_ep_layer_combine"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
  MOE_EP_TRY(moe_ep::check_stream(ck, x, stream));
  if (x->last_tokens < 0) return ck.bad("a dispatch must come first", "no dispatch on this layer");
  if (num_tokens != x->last_tokens)
    return ck.bad("num_tokens must be the last dispatch's T = " + std::to_string(x->last_tokens),
                  std::to_string(num_tokens));
  const moe_ep::ex::Shape& s = x->shape;
  if (y_dtype != MOE_EP_DTYPE_F32 && y_dtype != MOE_EP_DTYPE_BF16 && y_dtype != MOE_EP_Y_F32_MXFP8_ROUND_TRIP &&
      y_dtype != MOE_EP_Y_F32_NVFP4_ROUND_TRIP)
    return ck.bad("y_dtype must be MOE_EP_DTYPE_F32 (0), MOE_EP_DTYPE_BF16 (1), MOE_EP_Y_F32_MXFP8_ROUND_TRIP (2) or "
                  "MOE_EP_Y_F32_NVFP4_ROUND_TRIP (3)",
                  std::to_string(y_dtype));
  const bool y_bf16 = y_dtype == MOE_EP_DTYPE_BF16;
  const moe_ep_format rt_format = y_dtype == MOE_EP_Y_F32_MXFP8_ROUND_TRIP   ? MOE_EP_FORMAT_MXFP8
                                  : y_dtype == MOE_EP_Y_F32_NVFP4_ROUND_TRIP ? MOE_EP_FORMAT_NVFP4
                                                                             : MOE_EP_FORMAT_NONE;
  const bool y_rt = rt_format != MOE_EP_FORMAT_NONE;
  const char* rt_name =
      rt_format == MOE_EP_FORMAT_NVFP4 ? "MOE_EP_Y_F32_NVFP4_ROUND_TRIP" : "MOE_EP_Y_F32_MXFP8_ROUND_TRIP";
  MOE_EP_TRY(ck.ptr("y", y_rows, s.C * s.H, y_bf16 ? 2 : 4));
  if (y_rt && s.H % 128 != 0)
    return ck.bad(std::string("hidden must be a multiple of 128 with y_dtype ") + rt_name +
                      " (whole blocks in a warp's 128 columns)",
                  std::to_string(s.H));
  if (out_dtype != MOE_EP_DTYPE_F32 && out_dtype != MOE_EP_DTYPE_BF16)
    return ck.bad("out_dtype must be MOE_EP_DTYPE_F32 (0) or MOE_EP_DTYPE_BF16 (1)", std::to_string(out_dtype));
  const bool out_bf16 = out_dtype == MOE_EP_DTYPE_BF16;
  MOE_EP_TRY(ck.ptr("out", out, num_tokens * s.H, out_bf16 ? 2 : 4));
  if (row_values != nullptr || out_values != nullptr) {  // NULL stands for an empty array
    MOE_EP_TRY(ck.ptr("row_values", row_values, s.C, 4));
    MOE_EP_TRY(ck.ptr("out_values", out_values, num_tokens * s.K, 4));
  }
  if (out_error != nullptr) MOE_EP_TRY(ck.ptr("out_error", out_error, 1, 4));
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) {
    if (y_rt && (!moe_ep::aligned16(y_rows) || !moe_ep::aligned16(out)))
      return ck.bad(std::string("y and out must be 16-byte aligned with y_dtype ") + rt_name + " on CUDA",
                    "y at " + std::to_string(reinterpret_cast<uintptr_t>(y_rows) % 16) + ", out at " +
                        std::to_string(reinterpret_cast<uintptr_t>(out) % 16) + " bytes past a multiple of 16");
    return moe_ep::cuda::ex_combine(stream, *x, num_tokens, y_rows, y_dtype, out, out_bf16, row_values, out_values,
                                    out_error);
  }
#endif
  moe_ep::cpu::IeeeFpEnv fp_env;
  const auto run = [&](auto* typed_out) {
    if (y_bf16)
      return moe_ep::cpu_combine(*x, num_tokens, static_cast<const uint16_t*>(y_rows), typed_out, row_values,
                                 out_values, out_error, MOE_EP_FORMAT_NONE);
    return moe_ep::cpu_combine(*x, num_tokens, static_cast<const float*>(y_rows), typed_out, row_values, out_values,
                               out_error, rt_format);
  };
  if (out_bf16) return run(static_cast<uint16_t*>(out));
  return run(static_cast<float*>(out));
}

moe_ep_status moe_ep_layer_exchange_status(moe_ep_layer* layer, void* stream, int32_t* bits, int32_t clear) {
  const Check ck{"moe_ep_layer_exchange_status"};
  Exchange* x;
  MOE_EP_TRY(moe_ep::get(ck, layer, &x));
  MOE_EP_TRY(moe_ep::check_stream(ck, x, stream));
  if (bits == nullptr) return ck.bad("bits must not be NULL", "NULL");
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (x->cuda) return moe_ep::cuda::ex_status(stream, *x, bits, clear != 0);
#endif
  *bits = *x->loc.sticky_err;
  if (clear) *x->loc.sticky_err = 0;
  return MOE_EP_OK;
}

}  // extern "C"
