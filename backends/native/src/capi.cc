// The C ABI: checks every size, pointer and enum once (the same rules for
// every device), then calls the CPU or CUDA implementation.
#include <limits>
#include <new>
#include <cstdio>
#include <string>

#include "cpu/fpenv.h"
#include "internal.h"

#define MOE_EP_STR_(x) #x
#define MOE_EP_STR(x) MOE_EP_STR_(x)

#ifndef MOE_EP_NATIVE_VERSION
#define MOE_EP_NATIVE_VERSION "dev"
#endif

namespace moe_ep {
namespace {

thread_local std::string g_last_error;

}  // namespace
constexpr int64_t kInt32Limit = std::numeric_limits<int32_t>::max();
constexpr int64_t kElemLimit = std::numeric_limits<int64_t>::max() / 16;
constexpr int64_t kMaxExperts = int64_t{1} << 30;
namespace {

moe_ep_status check_device(const Check& ck, moe_ep_device device, void* stream) {
  if (device == MOE_EP_DEVICE_CPU) {
    if (stream != nullptr) return ck.bad("stream must be NULL for MOE_EP_DEVICE_CPU", "a non-NULL stream");
    return MOE_EP_OK;
  }
  if (device == MOE_EP_DEVICE_CUDA) {
#ifdef MOE_EP_NATIVE_WITH_CUDA
    return MOE_EP_OK;
#else
    return fail(MOE_EP_ERR_UNSUPPORTED, std::string(ck.op) +
                                            ": this build of the native core has no CUDA implementation "
                                            "(rebuild with MOE_EP_NATIVE_CUDA=ON)");
#endif
  }
  return ck.bad("device must be MOE_EP_DEVICE_CPU (0) or MOE_EP_DEVICE_CUDA (1)", std::to_string(static_cast<int>(device)));
}

moe_ep_status check_view(const Check& ck, int64_t outer, int64_t n, int64_t inner) {
  MOE_EP_TRY(ck.nonneg("outer", outer));
  MOE_EP_TRY(ck.nonneg("n", n));
  MOE_EP_TRY(ck.nonneg("inner", inner));
  MOE_EP_TRY(ck.product("outer * n", outer, n, kElemLimit));
  return ck.product("outer * n * inner", outer * n, inner, kElemLimit);
}

moe_ep_status check_format(const Check& ck, moe_ep_format fmt, const void* data, const void* scale, int64_t count) {
  if (fmt != MOE_EP_FORMAT_BF16 && fmt != MOE_EP_FORMAT_MXFP8 && fmt != MOE_EP_FORMAT_NVFP4)
    return ck.bad("fmt must be MOE_EP_FORMAT_BF16 (1), MOE_EP_FORMAT_MXFP8 (2) or MOE_EP_FORMAT_NVFP4 (3)",
                  std::to_string(static_cast<int>(fmt)));
  MOE_EP_TRY(ck.ptr("data", data, count, fmt == MOE_EP_FORMAT_BF16 ? 2 : 1));
  if (fmt == MOE_EP_FORMAT_BF16) {
    if (scale != nullptr) return ck.bad("scale must be NULL for MOE_EP_FORMAT_BF16", "a non-NULL pointer");
    return MOE_EP_OK;
  }
  return ck.ptr("scale", scale, count);
}

// What moe_ep_quantize and moe_ep_dequantize check: the device, the view, the encoded
// buffers and the float32 array `name`; *count = its elements.
moe_ep_status check_codec(const Check& ck, moe_ep_device device, void* stream, moe_ep_format fmt, const void* data,
                          const void* scale, int64_t outer, int64_t n, int64_t inner, const char* name,
                          const float* values, int64_t* count) {
  MOE_EP_TRY(check_device(ck, device, stream));
  MOE_EP_TRY(check_view(ck, outer, n, inner));
  *count = outer * n * inner;
  MOE_EP_TRY(check_format(ck, fmt, data, scale, *count));
  return ck.ptr(name, values, *count, 4);
}

moe_ep_status check_desc_impl(const Check& ck, const moe_ep_expert_desc* d) {
  if (d == nullptr) return ck.bad("desc must not be NULL", "NULL");
  MOE_EP_TRY(ck.nonneg("desc.num_rows", d->num_rows));
  MOE_EP_TRY(ck.positive("desc.hidden", d->hidden));
  MOE_EP_TRY(ck.positive("desc.intermediate", d->intermediate));
  MOE_EP_TRY(ck.positive("desc.num_local_experts", d->num_local_experts));
  // Every product the entry points form, checked one factor at a time (no step can overflow).
  MOE_EP_TRY(ck.product("4 * desc.intermediate", 4, d->intermediate, kElemLimit));
  if (d->hidden > kElemLimit - 4 * d->intermediate)
    return ck.bad("desc.hidden + 4 * desc.intermediate must be <= " + std::to_string(kElemLimit),
                  std::to_string(d->hidden) + " + " + std::to_string(4 * d->intermediate));
  MOE_EP_TRY(ck.product("desc.num_rows * (desc.hidden + 4 * desc.intermediate)", d->num_rows, d->hidden + 4 * d->intermediate,
                        kElemLimit));
  MOE_EP_TRY(ck.product("desc.hidden * 2 * desc.intermediate", d->hidden, 2 * d->intermediate, kElemLimit));
  MOE_EP_TRY(ck.product("desc.num_local_experts * desc.hidden * 2 * desc.intermediate", d->num_local_experts,
                        d->hidden * 2 * d->intermediate, kElemLimit));
  if (d->apply_topk_in_fc1 != 0 && d->apply_topk_in_fc1 != 1)
    return ck.bad("desc.apply_topk_in_fc1 must be 0 or 1", std::to_string(d->apply_topk_in_fc1));
  if (d->has_clamp != 0 && d->has_clamp != 1) return ck.bad("desc.has_clamp must be 0 or 1", std::to_string(d->has_clamp));
  if (d->has_clamp && !(d->gate_up_clamp > 0.0f && d->gate_up_clamp <= std::numeric_limits<float>::max())) {
    char got[32];
    std::snprintf(got, sizeof got, "%g", static_cast<double>(d->gate_up_clamp));
    return ck.bad("desc.gate_up_clamp must be finite and > 0 when desc.has_clamp is 1", got);
  }
  const int32_t f = d->intermediate_format;
  if (f < MOE_EP_FORMAT_NONE || f > MOE_EP_FORMAT_NVFP4)
    return ck.bad("desc.intermediate_format must be a moe_ep_format (0 NONE, 1 BF16, 2 MXFP8, 3 NVFP4)", std::to_string(f));
  return MOE_EP_OK;
}

// The operands expert_forward and expert_backward share.
moe_ep_status check_expert_operands(const Check& ck, const moe_ep_expert_desc& d, const float* x, const float* w,
                                    const float* fc1, const float* fc2, const int32_t* group_sizes) {
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate, E = d.num_local_experts;
  MOE_EP_TRY(ck.ptr("x", x, C * H, 4));
  MOE_EP_TRY(ck.ptr("w", w, C, 4));
  MOE_EP_TRY(ck.ptr("fc1", fc1, E * H * 2 * I, 4));
  MOE_EP_TRY(ck.ptr("fc2", fc2, E * I * H, 4));
  return ck.ptr("group_sizes", group_sizes, E, 4);
}

moe_ep_status check_workspace(const Check& ck, const void* workspace, size_t have, size_t need) {
  if (have < need) return ck.bad("workspace_bytes must be >= " + std::to_string(need), std::to_string(have));
  if (need > 0 && workspace == nullptr) return ck.bad("workspace must not be NULL", "NULL");
  return ck.ptr("workspace", workspace, static_cast<int64_t>(need), 8);
}

}  // namespace

moe_ep_status check_desc(const Check& ck, const moe_ep_expert_desc* d) { return check_desc_impl(ck, d); }

moe_ep_status fail(moe_ep_status status, const std::string& message) {
  g_last_error = message;
  return status;
}

}  // namespace moe_ep

using moe_ep::Check;
using moe_ep::check_codec;
using moe_ep::check_desc_impl;
using moe_ep::check_device;
using moe_ep::check_expert_operands;
using moe_ep::check_format;
using moe_ep::check_view;
using moe_ep::check_workspace;
using moe_ep::kElemLimit;
using moe_ep::kInt32Limit;
using moe_ep::kMaxExperts;

// Runs `call` on the chosen implementation, turning exceptions into statuses.
#ifdef MOE_EP_NATIVE_WITH_CUDA
#define MOE_EP_CUDA_CALL(device, call) \
  if ((device) == MOE_EP_DEVICE_CUDA) return moe_ep::cuda::call;
#else
#define MOE_EP_CUDA_CALL(device, call) (void)(device);
#endif
#define MOE_EP_DISPATCH(device, call)                                                       \
  try {                                                                                    \
    MOE_EP_CUDA_CALL(device, call)                                                         \
    moe_ep::cpu::IeeeFpEnv fp_env;                                                          \
    return moe_ep::cpu::call;                                                              \
  } catch (const std::bad_alloc&) {                                                        \
    return moe_ep::fail(MOE_EP_ERR_INTERNAL, "out of host memory");                         \
  } catch (const std::exception& ex) {                                                     \
    return moe_ep::fail(MOE_EP_ERR_INTERNAL, ex.what());                                    \
  }

namespace {

// The checks every combine_reduce entry makes of its sizes, positions and rows
// (row_bytes: 4 for float32 rows, 2 for bf16).
moe_ep_status check_reduce(const Check& ck, const void* rows, size_t row_bytes, int64_t num_rows,
                           const int32_t* route_pos, int64_t num_tokens, int64_t num_topk, int64_t hidden) {
  MOE_EP_TRY(ck.nonneg("num_rows", num_rows));
  MOE_EP_TRY(ck.nonneg("num_tokens", num_tokens));
  MOE_EP_TRY(ck.positive("num_topk", num_topk));
  MOE_EP_TRY(ck.nonneg("hidden", hidden));
  MOE_EP_TRY(ck.product("num_tokens * num_topk", num_tokens, num_topk, kInt32Limit));
  MOE_EP_TRY(ck.product("num_rows * hidden", num_rows, hidden, kElemLimit));
  MOE_EP_TRY(ck.product("num_tokens * hidden", num_tokens, hidden, kElemLimit));
  // NULL route_pos is the identity; with no tokens there is nothing to reduce (and the
  // caller's empty route_pos array is NULL), whatever num_rows is.
  if (route_pos == nullptr && num_tokens > 0 && num_rows != num_tokens * num_topk)
    return ck.bad("num_rows must be num_tokens * num_topk = " + std::to_string(num_tokens * num_topk) +
                      " when route_pos is NULL",
                  std::to_string(num_rows));
  return ck.ptr("rows", rows, num_rows * hidden, row_bytes);
}

// moe_ep_combine_reduce's checks and dispatch for rows of float32 (4 bytes) or bf16 (2).
// Row: float (float32 rows), uint16_t (bf16 rows); kRoundTrip: float32 rows through fmt's
// round trip as they are read (fmt is checked here).
template <typename Row, bool kRoundTrip = false>
moe_ep_status combine_reduce_entry(const char* op, moe_ep_device device, void* stream, const Row* rows,
                                   int64_t num_rows, const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                   int64_t hidden, float* out, moe_ep_format fmt = MOE_EP_FORMAT_NONE) {
  const Check ck{op};
  MOE_EP_TRY(check_device(ck, device, stream));
  if (kRoundTrip && fmt != MOE_EP_FORMAT_MXFP8 && fmt != MOE_EP_FORMAT_NVFP4)  // (fmt is unused otherwise)
    return ck.bad("fmt must be MOE_EP_FORMAT_MXFP8 (" + std::to_string(MOE_EP_FORMAT_MXFP8) +
                      ") or MOE_EP_FORMAT_NVFP4 (" + std::to_string(MOE_EP_FORMAT_NVFP4) +
                      "): the block formats, whose round trip the sum applies",
                  std::to_string(static_cast<int>(fmt)));
  MOE_EP_TRY(check_reduce(ck, rows, sizeof(Row), num_rows, route_pos, num_tokens, num_topk, hidden));
  MOE_EP_TRY(ck.ptr("out", out, num_tokens * hidden, 4));
  if (num_tokens == 0 || hidden == 0) return MOE_EP_OK;
  if constexpr (kRoundTrip) {
    MOE_EP_DISPATCH(device, combine_reduce_round_trip(stream, fmt, rows, num_rows, route_pos, num_tokens, num_topk,
                                                      hidden, out))
  } else if constexpr (sizeof(Row) == 4) {
    MOE_EP_DISPATCH(device, combine_reduce(stream, rows, num_rows, route_pos, num_tokens, num_topk, hidden, out))
  } else {
    MOE_EP_DISPATCH(device, combine_reduce_bf16(stream, rows, num_rows, route_pos, num_tokens, num_topk, hidden, out))
  }
}

}  // namespace

extern "C" {

int moe_ep_abi_version(void) { return MOE_EP_NATIVE_ABI_VERSION; }

int moe_ep_has_cuda(void) {
#ifdef MOE_EP_NATIVE_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

const char* moe_ep_build_info(void) {
#if defined(__clang__)
#define MOE_EP_COMPILER "clang " MOE_EP_STR(__clang_major__) "." MOE_EP_STR(__clang_minor__)
#elif defined(__GNUC__)
#define MOE_EP_COMPILER "gcc " MOE_EP_STR(__GNUC__) "." MOE_EP_STR(__GNUC_MINOR__)
#else
#define MOE_EP_COMPILER "unknown compiler"
#endif
  // Built once into a static buffer with snprintf (no iostreams in the C ABI).
  static char info[256];
  static const int once = [] {
#ifdef MOE_EP_NATIVE_WITH_CUDA
    const char* cuda = moe_ep::cuda::arch_list();
    return std::snprintf(info, sizeof info, "moe_ep_native %s (ABI %d), %s, CUDA archs %s", MOE_EP_NATIVE_VERSION,
                         MOE_EP_NATIVE_ABI_VERSION, MOE_EP_COMPILER, cuda);
#else
    return std::snprintf(info, sizeof info, "moe_ep_native %s (ABI %d), %s, no CUDA", MOE_EP_NATIVE_VERSION,
                         MOE_EP_NATIVE_ABI_VERSION, MOE_EP_COMPILER);
#endif
  }();
  (void)once;
  return info;
}

const char* moe_ep_last_error(void) { return moe_ep::g_last_error.c_str(); }

const char* moe_ep_status_name(moe_ep_status status) {
  switch (status) {
    case MOE_EP_OK: return "MOE_EP_OK";
    case MOE_EP_ERR_INVALID_ARGUMENT: return "MOE_EP_ERR_INVALID_ARGUMENT";
    case MOE_EP_ERR_UNSUPPORTED: return "MOE_EP_ERR_UNSUPPORTED";
    case MOE_EP_ERR_CUDA: return "MOE_EP_ERR_CUDA";
    case MOE_EP_ERR_INTERNAL: return "MOE_EP_ERR_INTERNAL";
    case MOE_EP_ERR_COMM: return "MOE_EP_ERR_COMM";
  }
  return "MOE_EP_ERR_UNKNOWN";
}

moe_ep_status moe_ep_quantize(moe_ep_device device, void* stream, moe_ep_format fmt, const float* x, int64_t outer,
                              int64_t n, int64_t inner, void* data, void* scale) {
  const Check ck{"moe_ep_quantize"};
  int64_t count = 0;
  MOE_EP_TRY(check_codec(ck, device, stream, fmt, data, scale, outer, n, inner, "x", x, &count));
  if (count == 0) return MOE_EP_OK;
  MOE_EP_DISPATCH(device, quantize(stream, fmt, x, outer, n, inner, data, scale))
}

moe_ep_status moe_ep_dequantize(moe_ep_device device, void* stream, moe_ep_format fmt, const void* data,
                                const void* scale, int64_t outer, int64_t n, int64_t inner, float* out) {
  const Check ck{"moe_ep_dequantize"};
  int64_t count = 0;
  MOE_EP_TRY(check_codec(ck, device, stream, fmt, data, scale, outer, n, inner, "out", out, &count));
  if (count == 0) return MOE_EP_OK;
  MOE_EP_DISPATCH(device, dequantize(stream, fmt, data, scale, outer, n, inner, out))
}

moe_ep_status moe_ep_dequantize_bf16(moe_ep_device device, void* stream, moe_ep_format fmt, const void* data,
                                     const void* scale, int64_t outer, int64_t n, int64_t inner, int64_t transpose_rows,
                                     uint16_t* out, int32_t* out_inexact) {
  const Check ck{"moe_ep_dequantize_bf16"};
  MOE_EP_TRY(check_device(ck, device, stream));
  if (fmt != MOE_EP_FORMAT_MXFP8 && fmt != MOE_EP_FORMAT_NVFP4)
    return ck.bad("fmt must be MOE_EP_FORMAT_MXFP8 (2) or MOE_EP_FORMAT_NVFP4 (3) (the block-scaled formats; bf16 "
                  "data is already bf16)",
                  std::to_string(static_cast<int>(fmt)));
  MOE_EP_TRY(check_view(ck, outer, n, inner));
  MOE_EP_TRY(ck.nonneg("transpose_rows", transpose_rows));
  if (transpose_rows > 0) {
    if (inner != 1)
      return ck.bad("inner must be 1 when transpose_rows >= 1 (the matrices are blocked along their last axis)",
                    std::to_string(inner));
    if (outer % transpose_rows != 0)
      return ck.bad("outer must be a multiple of transpose_rows = " + std::to_string(transpose_rows) +
                        " (the view is [outer / transpose_rows, transpose_rows, n])",
                    std::to_string(outer));
  }
  const int64_t count = outer * n * inner;
  MOE_EP_TRY(check_format(ck, fmt, data, scale, count));
  MOE_EP_TRY(ck.ptr("out", out, count, 2));
  MOE_EP_TRY(ck.ptr("out_inexact", out_inexact, 0, 4));
  if (count == 0) return MOE_EP_OK;
  MOE_EP_DISPATCH(device, dequantize_bf16(stream, fmt, data, scale, outer, n, inner, transpose_rows, out, out_inexact))
}

namespace {

// moe_ep_dequantize_bf16_rows' and _gather's checks and dispatch: rows of out from
// num_sources rows at data / scale, through route when gather (else the identity,
// num_sources = rows).
moe_ep_status dequantize_bf16_rows_entry(const Check& ck, bool gather, moe_ep_device device, void* stream,
                                         moe_ep_format fmt, const void* data, int64_t data_row_bytes,
                                         const void* scale, int64_t scale_row_bytes, int64_t num_sources,
                                         const int32_t* route, int64_t num_topk, int64_t rows, int64_t n,
                                         uint16_t* out, int32_t* out_inexact) {
  MOE_EP_TRY(check_device(ck, device, stream));
  if (fmt != MOE_EP_FORMAT_MXFP8 && fmt != MOE_EP_FORMAT_NVFP4)
    return ck.bad("fmt must be MOE_EP_FORMAT_MXFP8 (2) or MOE_EP_FORMAT_NVFP4 (3) (the block-scaled formats; bf16 "
                  "data is already bf16)",
                  std::to_string(static_cast<int>(fmt)));
  MOE_EP_TRY(check_view(ck, rows, n, 1));
  const bool mx = fmt == MOE_EP_FORMAT_MXFP8;
  const int64_t codes = mx ? n : (n + 1) / 2, scales = (n + (mx ? 31 : 15)) / (mx ? 32 : 16);
  if (data_row_bytes < codes)
    return ck.bad("data_row_bytes must be >= the codes of one row (" + std::to_string(codes) + " for n = " +
                      std::to_string(n) + ")",
                  std::to_string(data_row_bytes));
  if (scale_row_bytes < scales)
    return ck.bad("scale_row_bytes must be >= the scales of one row (" + std::to_string(scales) + " for n = " +
                      std::to_string(n) + ")",
                  std::to_string(scale_row_bytes));
  const std::string src = gather ? "num_tokens" : "rows";  // the rows read
  MOE_EP_TRY(ck.product((src + " * data_row_bytes").c_str(), num_sources, data_row_bytes, kElemLimit));
  MOE_EP_TRY(ck.product((src + " * scale_row_bytes").c_str(), num_sources, scale_row_bytes, kElemLimit));
  if (gather) MOE_EP_TRY(ck.product("num_tokens * num_topk", num_sources, num_topk, kInt32Limit));
  const int64_t count = rows * n;
  MOE_EP_TRY(ck.ptr("data", data, num_sources * n));
  MOE_EP_TRY(ck.ptr("scale", scale, num_sources * n));
  MOE_EP_TRY(ck.ptr("out", out, count, 2));
  MOE_EP_TRY(ck.ptr("out_inexact", out_inexact, 0, 4));
  if (count == 0) return MOE_EP_OK;
  MOE_EP_DISPATCH(device, dequantize_bf16_rows(stream, fmt, data, data_row_bytes, scale, scale_row_bytes, rows, n,
                                               out, out_inexact, route, num_topk, num_sources))
}

}  // namespace

moe_ep_status moe_ep_dequantize_bf16_rows(moe_ep_device device, void* stream, moe_ep_format fmt, const void* data,
                                          int64_t data_row_bytes, const void* scale, int64_t scale_row_bytes,
                                          int64_t rows, int64_t n, uint16_t* out, int32_t* out_inexact) {
  const Check ck{"moe_ep_dequantize_bf16_rows"};
  return dequantize_bf16_rows_entry(ck, false, device, stream, fmt, data, data_row_bytes, scale, scale_row_bytes,
                                    rows, nullptr, 1, rows, n, out, out_inexact);
}

moe_ep_status moe_ep_dequantize_bf16_gather(moe_ep_device device, void* stream, moe_ep_format fmt, const void* data,
                                            int64_t data_row_bytes, const void* scale, int64_t scale_row_bytes,
                                            int64_t num_tokens, const int32_t* route, int64_t num_topk, int64_t rows,
                                            int64_t n, uint16_t* out, int32_t* out_inexact) {
  const Check ck{"moe_ep_dequantize_bf16_gather"};
  MOE_EP_TRY(ck.nonneg("num_tokens", num_tokens));
  MOE_EP_TRY(ck.positive("num_topk", num_topk));
  MOE_EP_TRY(ck.nonneg("rows", rows));
  MOE_EP_TRY(ck.ptr("route", route, rows, 4));
  return dequantize_bf16_rows_entry(ck, true, device, stream, fmt, data, data_row_bytes, scale, scale_row_bytes,
                                    num_tokens, route, num_topk, rows, n, out, out_inexact);
}

moe_ep_status moe_ep_plan_routes(moe_ep_device device, void* stream, const int32_t* topk_idx, int64_t num_tokens,
                                 int64_t num_topk, int64_t num_experts, int32_t* send_route, int32_t* route_pos,
                                 int32_t* route_expert, int32_t* counts) {
  const Check ck{"moe_ep_plan_routes"};
  MOE_EP_TRY(check_device(ck, device, stream));
  MOE_EP_TRY(ck.nonneg("num_tokens", num_tokens));
  MOE_EP_TRY(ck.positive("num_topk", num_topk));
  MOE_EP_TRY(ck.positive("num_experts", num_experts));
  if (num_experts > kMaxExperts)
    return ck.bad("num_experts must be <= " + std::to_string(kMaxExperts) + " (2^30)", std::to_string(num_experts));
  MOE_EP_TRY(ck.product("num_tokens * num_topk", num_tokens, num_topk, kInt32Limit - 1));
  const int64_t routes = num_tokens * num_topk;
  MOE_EP_TRY(ck.ptr("topk_idx", topk_idx, routes, 4));
  MOE_EP_TRY(ck.ptr("send_route", send_route, routes, 4));
  MOE_EP_TRY(ck.ptr("route_pos", route_pos, routes, 4));
  MOE_EP_TRY(ck.ptr("route_expert", route_expert, routes, 4));
  MOE_EP_TRY(ck.ptr("counts", counts, num_experts + 1, 4));
  MOE_EP_DISPATCH(device, plan_routes(stream, topk_idx, num_tokens, num_topk, num_experts, send_route, route_pos,
                                      route_expert, counts))
}

moe_ep_status moe_ep_record_step(moe_ep_device device, void* stream, const int32_t* error,
                                 const int32_t* tokens_per_expert, int64_t num_local_experts, int64_t alignment,
                                 int64_t* record) {
  const Check ck{"moe_ep_record_step"};
  MOE_EP_TRY(check_device(ck, device, stream));
  MOE_EP_TRY(ck.positive("num_local_experts", num_local_experts));
  MOE_EP_TRY(ck.positive("alignment", alignment));
  MOE_EP_TRY(ck.ptr("error", error, 1, 4));
  MOE_EP_TRY(ck.ptr("tokens_per_expert", tokens_per_expert, num_local_experts, 4));
  MOE_EP_TRY(ck.ptr("record", record, 2, 8));
  MOE_EP_DISPATCH(device, record_step(stream, error, tokens_per_expert, num_local_experts, alignment, record))
}

moe_ep_status moe_ep_permute_rows(moe_ep_device device, void* stream, const void* tokens, int64_t num_tokens,
                                  int64_t num_topk, int64_t row_bytes, const int32_t* send_route, int64_t num_rows,
                                  void* dst) {
  const Check ck{"moe_ep_permute_rows"};
  MOE_EP_TRY(check_device(ck, device, stream));
  MOE_EP_TRY(ck.nonneg("num_tokens", num_tokens));
  MOE_EP_TRY(ck.positive("num_topk", num_topk));
  MOE_EP_TRY(ck.nonneg("row_bytes", row_bytes));
  MOE_EP_TRY(ck.nonneg("num_rows", num_rows));
  MOE_EP_TRY(ck.product("num_tokens * num_topk", num_tokens, num_topk, kInt32Limit));
  MOE_EP_TRY(ck.product("num_tokens * row_bytes", num_tokens, row_bytes, kElemLimit));
  MOE_EP_TRY(ck.product("num_rows * row_bytes", num_rows, row_bytes, kElemLimit));
  MOE_EP_TRY(ck.ptr("tokens", tokens, num_tokens * row_bytes));
  MOE_EP_TRY(ck.ptr("send_route", send_route, num_rows, 4));
  MOE_EP_TRY(ck.ptr("dst", dst, num_rows * row_bytes));
  if (num_rows == 0) return MOE_EP_OK;
  MOE_EP_DISPATCH(device, permute_rows(stream, tokens, num_tokens, num_topk, row_bytes, send_route, num_rows, dst))
}


moe_ep_status moe_ep_combine_reduce(moe_ep_device device, void* stream, const float* rows, int64_t num_rows,
                                    const int32_t* route_pos, int64_t num_tokens, int64_t num_topk, int64_t hidden,
                                    float* out) {
  return combine_reduce_entry("moe_ep_combine_reduce", device, stream, rows, num_rows, route_pos, num_tokens, num_topk,
                              hidden, out);
}

moe_ep_status moe_ep_combine_reduce_bf16(moe_ep_device device, void* stream, const uint16_t* rows, int64_t num_rows,
                                         const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                         int64_t hidden, float* out) {
  return combine_reduce_entry("moe_ep_combine_reduce_bf16", device, stream, rows, num_rows, route_pos, num_tokens,
                              num_topk, hidden, out);
}

moe_ep_status moe_ep_combine_reduce_round_trip(moe_ep_device device, void* stream, moe_ep_format fmt,
                                               const float* rows, int64_t num_rows, const int32_t* route_pos,
                                               int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out) {
  return combine_reduce_entry<float, true>("moe_ep_combine_reduce_round_trip", device, stream, rows, num_rows,
                                           route_pos, num_tokens, num_topk, hidden, out, fmt);
}

moe_ep_status moe_ep_combine_reduce_encode(moe_ep_device device, void* stream, moe_ep_dtype rows_dtype,
                                           moe_ep_format round_trip, const void* rows, int64_t num_rows,
                                           const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                           int64_t hidden, const uint8_t* error, moe_ep_format out_format,
                                           void* out_data, void* out_scale) {
  const Check ck{"moe_ep_combine_reduce_encode"};
  MOE_EP_TRY(check_device(ck, device, stream));
  if (rows_dtype != MOE_EP_DTYPE_F32 && rows_dtype != MOE_EP_DTYPE_BF16)
    return ck.bad("rows_dtype must be MOE_EP_DTYPE_F32 (" + std::to_string(MOE_EP_DTYPE_F32) +
                      ") or MOE_EP_DTYPE_BF16 (" + std::to_string(MOE_EP_DTYPE_BF16) + ")",
                  std::to_string(static_cast<int>(rows_dtype)));
  if (round_trip != MOE_EP_FORMAT_NONE && round_trip != MOE_EP_FORMAT_MXFP8 && round_trip != MOE_EP_FORMAT_NVFP4)
    return ck.bad("round_trip must be MOE_EP_FORMAT_NONE (0), MOE_EP_FORMAT_MXFP8 (2) or MOE_EP_FORMAT_NVFP4 (3)",
                  std::to_string(static_cast<int>(round_trip)));
  if (round_trip != MOE_EP_FORMAT_NONE && rows_dtype != MOE_EP_DTYPE_F32)
    return ck.bad("rows_dtype must be MOE_EP_DTYPE_F32 when round_trip is set (the unrounded expert outputs)",
                  std::to_string(static_cast<int>(rows_dtype)));
  const bool bf16_rows = rows_dtype == MOE_EP_DTYPE_BF16;
  MOE_EP_TRY(check_reduce(ck, rows, bf16_rows ? 2 : 4, num_rows, route_pos, num_tokens, num_topk, hidden));
  MOE_EP_TRY(check_format(ck, out_format, out_data, out_scale, num_tokens * hidden));
  if (num_tokens == 0 || hidden == 0) return MOE_EP_OK;
  MOE_EP_DISPATCH(device, combine_reduce_encode(stream, rows_dtype, round_trip, rows, num_rows, route_pos, num_tokens,
                                                num_topk, hidden, error, out_format, out_data, out_scale))
}

size_t moe_ep_expert_forward_workspace(const moe_ep_expert_desc* desc) {
  if (check_desc_impl(Check{"moe_ep_expert_forward_workspace"}, desc) != MOE_EP_OK) return 0;
  return moe_ep::forward_workspace_bytes(*desc);
}

size_t moe_ep_expert_backward_workspace(const moe_ep_expert_desc* desc) {
  if (check_desc_impl(Check{"moe_ep_expert_backward_workspace"}, desc) != MOE_EP_OK) return 0;
  return moe_ep::backward_workspace_bytes(*desc);
}

moe_ep_status moe_ep_expert_forward(moe_ep_device device, void* stream, const moe_ep_expert_desc* desc, const float* x,
                                    const float* w, const float* fc1, const float* fc2, const int32_t* group_sizes,
                                    float* y, float* c, void* workspace, size_t workspace_bytes) {
  const Check ck{"moe_ep_expert_forward"};
  MOE_EP_TRY(check_device(ck, device, stream));
  MOE_EP_TRY(check_desc_impl(ck, desc));
  const moe_ep_expert_desc& d = *desc;
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate;
  MOE_EP_TRY(check_expert_operands(ck, d, x, w, fc1, fc2, group_sizes));
  MOE_EP_TRY(ck.ptr("y", y, C * H, 4));
  MOE_EP_TRY(ck.ptr("c", c, C * 2 * I, 4));
  MOE_EP_TRY(check_workspace(ck, workspace, workspace_bytes, moe_ep::forward_workspace_bytes(d)));
  MOE_EP_DISPATCH(device, expert_forward(stream, d, x, w, fc1, fc2, group_sizes, y, c, workspace))
}

moe_ep_status moe_ep_expert_backward(moe_ep_device device, void* stream, const moe_ep_expert_desc* desc, const float* x,
                                     const float* w, const float* fc1, const float* fc2, const uint16_t* fc1_c,
                                     const float* dy, const int32_t* group_sizes, float* dx, float* dw, float* dfc1,
                                     float* dfc2, void* workspace, size_t workspace_bytes) {
  const Check ck{"moe_ep_expert_backward"};
  MOE_EP_TRY(check_device(ck, device, stream));
  MOE_EP_TRY(check_desc_impl(ck, desc));
  const moe_ep_expert_desc& d = *desc;
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate, E = d.num_local_experts;
  MOE_EP_TRY(check_expert_operands(ck, d, x, w, fc1, fc2, group_sizes));
  MOE_EP_TRY(ck.ptr("fc1_c", fc1_c, C * 2 * I, 2));
  MOE_EP_TRY(ck.ptr("dy", dy, C * H, 4));
  MOE_EP_TRY(ck.ptr("dx", dx, C * H, 4));
  MOE_EP_TRY(ck.ptr("dw", dw, C, 4));
  MOE_EP_TRY(ck.ptr("dfc1", dfc1, E * H * 2 * I, 4));
  MOE_EP_TRY(ck.ptr("dfc2", dfc2, E * I * H, 4));
  MOE_EP_TRY(check_workspace(ck, workspace, workspace_bytes, moe_ep::backward_workspace_bytes(d)));
  MOE_EP_DISPATCH(device, expert_backward(stream, d, x, w, fc1, fc2, fc1_c, dy, group_sizes, dx, dw, dfc1, dfc2,
                                          workspace))
}

}  // extern "C"
