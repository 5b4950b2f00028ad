// The device exchange's one definition of its memory (exchange.cc sizes and
// carves it, the CPU twin in exchange.cc and the kernels in cuda/exchange.cu
// point into it) and the count-table arithmetic both implementations share
// (compiled for the host and, under nvcc, for the device).
//
// Symmetric region (the same layout on every rank; peers write into it):
//   flags:  disp_flag[N], disp_ack[N], comb_flag[N], comb_ack[N]  uint64
//           disp_flag[s]: (step << 8) | error bits, published by rank s after
//           writing its dispatch rows here; disp_ack[d]: the last dispatch step
//           rank d has consumed from its region (written by d, read by the sender);
//           comb_* likewise for combine.
//   table:  [N][E + 2] int32: rank s's routes per global expert, its bad-id
//           count and its T (every rank writes its row into every peer).
//   dmeta:  [N][Tmax][K] RouteMeta: per (source, token, slot) the local expert
//           (-1: not for this rank), the route's index among the source's routes
//           to that expert (token-major) and the router weight.
//   drows:  [N][Tmax][stride] bytes: the token rows (one per source token with a
//           route here; a rank's own rows are not copied: it places them from
//           its tokens).
//   cvals:  [Tmax][K] float32: per-route values returned by combine.
//   crows:  RANK_SUMS: [N][Tmax][H] float32 (one row per expert rank);
//           SLOT_ORDER: [K][Tmax][H] float32 (one row per slot).
#ifndef MOE_EP_NATIVE_EXCHANGE_LAYOUT_H_
#define MOE_EP_NATIVE_EXCHANGE_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define MOE_EP_HD __host__ __device__ __forceinline__
#else
#define MOE_EP_HD inline
#endif

namespace moe_ep {
namespace ex {

constexpr int32_t kBadId = 1;    // MOE_EP_EXCHANGE_BAD_EXPERT_ID
constexpr int32_t kOverflow = 2; // MOE_EP_EXCHANGE_OVERFLOW
constexpr int32_t kTimeout = 4;  // MOE_EP_EXCHANGE_TIMEOUT

struct RouteMeta {
  int32_t le;   // local expert on the receiver, -1: this slot does not go there
  int32_t pos;  // index among the source's routes to that expert, token-major
  float w;      // router weight
  int32_t pad;
};

MOE_EP_HD int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Sizes of one exchange (fixed at layer creation).
struct Shape {
  int32_t N, rank, K, order;
  int64_t E, El, Tmax, C, A, H, stride;  // stride: bytes of a token row slot (16-byte multiple)
};

// Offsets (bytes) of the symmetric region's pieces.
struct SymLayout {
  int64_t disp_flag, disp_ack, comb_flag, comb_ack, table, dmeta, drows, cvals, crows, bytes;
};

MOE_EP_HD SymLayout sym_layout(const Shape& s) {
  SymLayout L{};
  int64_t at = 0;
  auto take = [&](int64_t b) { int64_t p = at; at += align_up(b, 256); return p; };
  L.disp_flag = take(8 * s.N);
  L.disp_ack = take(8 * s.N);
  L.comb_flag = take(8 * s.N);
  L.comb_ack = take(8 * s.N);
  L.table = take(4 * s.N * (s.E + 2));
  L.dmeta = take(static_cast<int64_t>(sizeof(RouteMeta)) * s.N * s.Tmax * s.K);
  L.drows = take(s.stride * s.N * s.Tmax);
  L.cvals = take(4 * s.Tmax * s.K);
  L.crows = take(4 * s.H * s.Tmax * (s.order == 1 ? s.K : s.N));
  L.bytes = at;
  return L;
}

// The rank-local state (never written by peers).
struct Local {
  uint64_t* seq;        // [2] the dispatch and combine step numbers
  int32_t* step_err;    // [1] this step's error bits
  int32_t* sticky_err;  // [1] the record since the last clear
  int32_t* excl;        // [E] exclusive prefix of this rank's routes per expert
  int32_t* route_dest;  // [Tmax*K] destination rank of each own route (-1: none)
  int32_t* tok_ranks;   // [Tmax*K] per own token: the ranks of its routes, ascending, each once, then -1
  int32_t* off;         // [El + 1] aligned slab starts
  int32_t* nloc;        // [El] routes per local expert
  int32_t* pref;        // [N][El] routes from lower source ranks per local expert
  int32_t* tsrc;        // [N] T of every source rank this step
  int32_t* rowmap;      // [N][Tmax][K] buffer row of every received route (-1: none)
  int32_t* t_me;        // [1] this rank's T of the last dispatch
  uint64_t* peers;      // [N] the peer table
  int32_t* send_route;  // [Tmax*K] plan scratch (moe_ep_plan_routes)
  int32_t* route_pos;   // [Tmax*K]
  int32_t* route_expert;  // [Tmax*K]
  int32_t* counts;      // [E + 1]
};

MOE_EP_HD int64_t local_bytes_carve(const Shape& s, char* base, Local* out) {
  int64_t at = 0;
  auto take = [&](int64_t b) { char* p = base ? base + at : nullptr; at += align_up(b > 0 ? b : 1, 256); return p; };
  Local l{};
  l.seq = reinterpret_cast<uint64_t*>(take(16));
  l.step_err = reinterpret_cast<int32_t*>(take(4));
  l.sticky_err = reinterpret_cast<int32_t*>(take(4));
  l.excl = reinterpret_cast<int32_t*>(take(4 * s.E));
  l.route_dest = reinterpret_cast<int32_t*>(take(4 * s.Tmax * s.K));
  l.tok_ranks = reinterpret_cast<int32_t*>(take(4 * s.Tmax * s.K));
  l.off = reinterpret_cast<int32_t*>(take(4 * (s.El + 1)));
  l.nloc = reinterpret_cast<int32_t*>(take(4 * s.El));
  l.pref = reinterpret_cast<int32_t*>(take(4 * s.N * s.El));
  l.tsrc = reinterpret_cast<int32_t*>(take(4 * s.N));
  l.rowmap = reinterpret_cast<int32_t*>(take(4 * s.N * s.Tmax * s.K));
  l.t_me = reinterpret_cast<int32_t*>(take(4));
  l.peers = reinterpret_cast<uint64_t*>(take(8 * s.N));
  l.send_route = reinterpret_cast<int32_t*>(take(4 * s.Tmax * s.K));
  l.route_pos = reinterpret_cast<int32_t*>(take(4 * s.Tmax * s.K));
  l.route_expert = reinterpret_cast<int32_t*>(take(4 * s.Tmax * s.K));
  l.counts = reinterpret_cast<int32_t*>(take(4 * (s.E + 1)));
  if (out != nullptr) *out = l;
  return at;
}

// Flag values: (step << 8) | error bits.
MOE_EP_HD uint64_t flag_value(uint64_t step, int32_t err) { return (step << 8) | static_cast<uint64_t>(err & 0xff); }
MOE_EP_HD uint64_t flag_step(uint64_t v) { return v >> 8; }

// From the gathered table ([N][E + 2], every rank's row of this step), the
// step's error bits (the same on every rank) and this rank's placement:
// off[El + 1], nloc[El], pref[N][El], tsrc[N]. Sequential (one thread).
// With `timed_out` every count is taken as 0 (nothing is placed).
MOE_EP_HD int32_t plan_from_table(const Shape& s, const int32_t* table, bool timed_out, int32_t* off, int32_t* nloc,
                                  int32_t* pref, int32_t* tsrc) {
  const int64_t row = s.E + 2;
  int32_t err = 0;
  if (!timed_out) {
    for (int32_t src = 0; src < s.N; ++src)
      if (table[src * row + s.E] > 0) err |= kBadId;
    for (int32_t d = 0; d < s.N; ++d) {
      int64_t total = 0;
      for (int64_t le = 0; le < s.El; ++le) {
        int64_t n = 0;
        for (int32_t src = 0; src < s.N; ++src) n += table[src * row + d * s.El + le];
        total += align_up(n, s.A);
      }
      if (total > s.C) err |= kOverflow;
    }
  }
  int64_t at = 0;
  for (int64_t le = 0; le < s.El; ++le) {
    int64_t n = 0;
    for (int32_t src = 0; src < s.N; ++src) {
      pref[src * s.El + le] = static_cast<int32_t>(n);
      n += timed_out ? 0 : table[src * row + static_cast<int64_t>(s.rank) * s.El + le];
    }
    off[le] = static_cast<int32_t>(at > s.C ? s.C + 1 : at);  // past C: nothing of it fits
    nloc[le] = static_cast<int32_t>(n);
    at += align_up(n, s.A);
  }
  off[s.El] = static_cast<int32_t>(at > s.C ? s.C + 1 : at);
  for (int32_t src = 0; src < s.N; ++src) tsrc[src] = timed_out ? 0 : table[src * row + s.E + 1];
  return err;
}

// The buffer row of a received route (-1: it does not fit in C).
MOE_EP_HD int32_t route_row(const Shape& s, const int32_t* off, const int32_t* pref, int32_t src, int32_t le,
                            int32_t pos) {
  const int64_t r = static_cast<int64_t>(off[le]) + pref[src * s.El + le] + pos;
  return r < s.C ? static_cast<int32_t>(r) : -1;
}

// Whether buffer row r is padding (no route lands there).
MOE_EP_HD bool is_padding(const Shape& s, const int32_t* off, const int32_t* nloc, int64_t r) {
  for (int64_t le = 0; le < s.El; ++le)
    if (r >= off[le] && r < off[le + 1]) return r - off[le] >= nloc[le];
  return true;
}

// One token's route ranks (dest[K], -1: no route) as the home rank sums them in
// MOE_EP_COMBINE_RANK_SUMS: ascending, each once, then -1 up to K entries.
MOE_EP_HD void token_ranks(const int32_t* dest, int64_t K, int32_t* out) {
  int64_t n = 0;
  for (int32_t prev = -1;; ++n) {
    int32_t next = -1;
    for (int64_t k = 0; k < K; ++k)
      if (dest[k] > prev && (next < 0 || dest[k] < next)) next = dest[k];
    if (next < 0) break;
    out[n] = prev = next;
  }
  for (; n < K; ++n) out[n] = -1;
}

// The aligned slab size of local expert le cut at C.
MOE_EP_HD int32_t group_size(const Shape& s, const int32_t* off, int64_t le) {
  const int64_t a = off[le] < s.C ? off[le] : s.C, b = off[le + 1] < s.C ? off[le + 1] : s.C;
  return static_cast<int32_t>(b - a);
}

}  // namespace ex
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_EXCHANGE_LAYOUT_H_
