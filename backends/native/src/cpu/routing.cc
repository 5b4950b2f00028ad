// CPU routing: the plan (stable counting sort of route ids by expert), the
// permutation of token rows into send order, and the Form-A combine reduction.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "internal.h"
#include "cpu/formats.h"

namespace moe_ep {
namespace cpu {

moe_ep_status plan_routes(void*, const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                          int32_t* send_route, int32_t* route_pos, int32_t* route_expert, int32_t* counts) {
  const int64_t routes = num_tokens * num_topk;
  std::vector<int64_t> next(static_cast<size_t>(num_experts) + 1, 0);
  int32_t bad = 0;
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t e = topk_idx[r];
    if (e >= 0 && e < num_experts) ++next[e];
    else if (e != -1) ++bad;
  }
  for (int64_t e = 0; e < num_experts; ++e) counts[e] = static_cast<int32_t>(next[e]);
  counts[num_experts] = bad;
  // Exclusive prefix: the first send position of each expert; the unrouted tail after them.
  int64_t run = 0;
  for (int64_t e = 0; e <= num_experts; ++e) {
    const int64_t c = e < num_experts ? next[e] : 0;
    next[e] = run;
    run += c;
  }
  int64_t tail = run;
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t e = topk_idx[r];
    if (e >= 0 && e < num_experts) {
      const int64_t p = next[e]++;
      send_route[p] = static_cast<int32_t>(r);
      route_pos[r] = static_cast<int32_t>(p);
      route_expert[r] = e;
    } else {
      send_route[tail++] = static_cast<int32_t>(r);
      route_pos[r] = -1;
      route_expert[r] = -1;
    }
  }
  return MOE_EP_OK;
}

moe_ep_status record_step(void*, const int32_t* error, const int32_t* tokens_per_expert, int64_t num_local_experts,
                          int64_t alignment, int64_t* record) {
  int64_t rows = 0;
  for (int64_t le = 0; le < num_local_experts; ++le) {
    const int64_t n = tokens_per_expert[le];
    rows += (n + alignment - 1) / alignment * alignment;
  }
  record[0] |= static_cast<int64_t>(*error);
  record[1] = std::max(record[1], rows);
  return MOE_EP_OK;
}

moe_ep_status permute_rows(void*, const void* tokens, int64_t num_tokens, int64_t num_topk, int64_t row_bytes,
                           const int32_t* send_route, int64_t num_rows, void* dst) {
  const int64_t routes = num_tokens * num_topk;
  for (int64_t i = 0; i < num_rows; ++i) {  // check first: a bad id changes nothing
    const int32_t r = send_route[i];
    if (r < -1 || r >= routes)
      return fail(MOE_EP_ERR_INVALID_ARGUMENT, "moe_ep_permute_rows: send_route[" + std::to_string(i) + "] must be -1 or in [0, " +
                                                   std::to_string(routes) + "); got " + std::to_string(r));
  }
  const char* src = static_cast<const char*>(tokens);
  char* out = static_cast<char*>(dst);
  for (int64_t i = 0; i < num_rows; ++i) {
    const int32_t r = send_route[i];
    if (r < 0) std::memset(out + i * row_bytes, 0, static_cast<size_t>(row_bytes));
    else std::memcpy(out + i * row_bytes, src + (r / num_topk) * row_bytes, static_cast<size_t>(row_bytes));
  }
  return MOE_EP_OK;
}

namespace {

inline float row_value(const float* row, int64_t h) { return row[h]; }
inline float row_value(const uint16_t* row, int64_t h) { return bf16_to_float(row[h]); }

// Every route position -1 or a row, checked before anything is written.
moe_ep_status check_route_pos(const char* op, const int32_t* route_pos, int64_t routes, int64_t num_rows) {
  if (route_pos == nullptr) return MOE_EP_OK;
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t p = route_pos[r];
    if (p < -1 || p >= num_rows)
      return fail(MOE_EP_ERR_INVALID_ARGUMENT, std::string(op) + ": route_pos[" + std::to_string(r) +
                                                   "] must be -1 or in [0, num_rows) = [0, " +
                                                   std::to_string(num_rows) + "); got " + std::to_string(p));
  }
  return MOE_EP_OK;
}

// The slot-order sums of the combine entries; the route positions are checked by the caller.
template <typename Row>
void sum_rows(const Row* rows, const int32_t* route_pos, int64_t num_tokens, int64_t num_topk, int64_t hidden,
              float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* acc = out + t * hidden;
    for (int64_t h = 0; h < hidden; ++h) acc[h] = 0.0f;  // +0
    for (int64_t k = 0; k < num_topk; ++k) {  // slot order
      const int64_t r = t * num_topk + k;
      const int64_t p = route_pos != nullptr ? route_pos[r] : r;
      if (p < 0) continue;  // an unused slot adds nothing
      const Row* row = rows + p * hidden;
      for (int64_t h = 0; h < hidden; ++h) acc[h] = acc[h] + row_value(row, h);
    }
  }
}

// Each route's row through the round trip into a copy (rows stay as they are), added to
// its token's sum in slot order from +0 as sum_rows adds rows. The positions are checked
// by the caller.
moe_ep_status round_trip_sum_rows(moe_ep_format fmt, const float* rows, const int32_t* route_pos, int64_t num_tokens,
                                  int64_t num_topk, int64_t hidden, float* out) {
  std::vector<float> row(static_cast<size_t>(hidden));
  std::vector<uint8_t> data, scale;
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* acc = out + t * hidden;
    for (int64_t h = 0; h < hidden; ++h) acc[h] = 0.0f;  // +0
    for (int64_t k = 0; k < num_topk; ++k) {
      const int64_t r = t * num_topk + k;
      const int64_t p = route_pos != nullptr ? route_pos[r] : r;
      if (p < 0) continue;  // an unused slot adds nothing
      std::memcpy(row.data(), rows + p * hidden, static_cast<size_t>(hidden) * sizeof(float));
      MOE_EP_TRY(round_trip_row(fmt, row.data(), hidden, &data, &scale));
      for (int64_t h = 0; h < hidden; ++h) acc[h] = acc[h] + row[static_cast<size_t>(h)];
    }
  }
  return MOE_EP_OK;
}

}  // namespace

moe_ep_status combine_reduce(void*, const float* rows, int64_t num_rows, const int32_t* route_pos, int64_t num_tokens,
                             int64_t num_topk, int64_t hidden, float* out) {
  MOE_EP_TRY(check_route_pos("moe_ep_combine_reduce", route_pos, num_tokens * num_topk, num_rows));
  sum_rows(rows, route_pos, num_tokens, num_topk, hidden, out);
  return MOE_EP_OK;
}

moe_ep_status combine_reduce_bf16(void*, const uint16_t* rows, int64_t num_rows, const int32_t* route_pos,
                                  int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out) {
  MOE_EP_TRY(check_route_pos("moe_ep_combine_reduce_bf16", route_pos, num_tokens * num_topk, num_rows));
  sum_rows(rows, route_pos, num_tokens, num_topk, hidden, out);
  return MOE_EP_OK;
}

moe_ep_status combine_reduce_round_trip(void*, moe_ep_format fmt, const float* rows, int64_t num_rows,
                                        const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                        int64_t hidden, float* out) {
  MOE_EP_TRY(check_route_pos("moe_ep_combine_reduce_round_trip", route_pos, num_tokens * num_topk, num_rows));
  return round_trip_sum_rows(fmt, rows, route_pos, num_tokens, num_topk, hidden, out);
}

moe_ep_status combine_reduce_encode(void* stream, moe_ep_dtype rows_dtype, moe_ep_format round_trip, const void* rows,
                                    int64_t num_rows, const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                    int64_t hidden, const uint8_t* error, moe_ep_format out_format, void* out_data,
                                    void* out_scale) {
  // The positions once (a rejected call writes nothing), then the sums of the entry this
  // one fuses into a scratch row block, NaN on an error, and moe_ep_quantize's encode.
  MOE_EP_TRY(check_route_pos("moe_ep_combine_reduce_encode", route_pos, num_tokens * num_topk, num_rows));
  std::vector<float> sum(static_cast<size_t>(num_tokens * hidden));
  if (round_trip != MOE_EP_FORMAT_NONE) {
    MOE_EP_TRY(round_trip_sum_rows(round_trip, static_cast<const float*>(rows), route_pos, num_tokens, num_topk,
                                   hidden, sum.data()));
  } else if (rows_dtype == MOE_EP_DTYPE_BF16) {
    sum_rows(static_cast<const uint16_t*>(rows), route_pos, num_tokens, num_topk, hidden, sum.data());
  } else {
    sum_rows(static_cast<const float*>(rows), route_pos, num_tokens, num_topk, hidden, sum.data());
  }
  if (error != nullptr && *error != 0) {
    const uint32_t nan_bits = 0x7FC00000u;  // the positive quiet NaN of every NaN the spec writes
    float nan;
    std::memcpy(&nan, &nan_bits, sizeof nan);
    std::fill(sum.begin(), sum.end(), nan);
  }
  return quantize(stream, out_format, sum.data(), num_tokens, hidden, 1, out_data, out_scale);
}

}  // namespace cpu
}  // namespace moe_ep
