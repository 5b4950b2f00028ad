// moe_ep_jax_ffi._ffi: XLA FFI handlers over the MoeEp native C ABI
// (backends/native/include/moe_ep_native.h), and the nanobind module that hands
// them to JAX (jax.ffi.register_ffi_target).
//
// Every handler is a thin layer over the C ABI:
//   1. it checks the ranks and extents of its buffers against each other and
//      against its attributes, and returns ffi::Error::InvalidArgument with a
//      message naming the rule, the value seen and what is allowed (JAX raises
//      it as an exception whose message contains that text);
//   2. it calls the C ABI with MOE_EP_DEVICE_CPU (host buffers, no stream) or
//      MOE_EP_DEVICE_CUDA (device buffers, XLA's stream): the format, plan and
//      combine handlers one entry point each; the two expert handlers the
//      stages of a layer object (moe_ep_layer_experts_forward/backward) that
//      they keep per configuration, device and operand dtype (the layer cache
//      below: made once, its workspaces allocated then, never per call);
//   3. it turns a status other than MOE_EP_OK into an ffi::Error carrying
//      moe_ep_last_error() (the core's own rule/value/allowed message).
//
// The same target names are registered for the "cpu" and the "CUDA" platform
// (the CUDA handlers exist only when the core is built with
// MOE_EP_NATIVE_CUDA=ON); XLA picks the one of the platform it compiles for.
// The CUDA handlers only enqueue work on XLA's stream, never synchronise and
// never allocate (the expert stages' scratch is the layer's, allocated when the
// layer is made: at XLA's initialize stage, before any capture), so they are
// marked command-buffer compatible (CUDA graphs).
//
// XLA:CPU runs its threads with denormals flushed to zero (FTZ/DAZ); the
// core's CPU entry points set the IEEE environment they need for the duration
// of each call themselves (backends/native/src/cpu/fpenv.h).
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>


#include "moe_ep_native.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

#ifdef MOE_EP_NATIVE_WITH_CUDA
#include <cuda_runtime_api.h>

// csrc/poison_cuda.cu: the moe_ep_poison target's conditional fill on XLA's stream.
extern "C" cudaError_t moe_ep_ffi_poison_cuda(void* stream, const void* flag, void* data, int64_t bytes,
                                              int32_t width, uint32_t pattern);
// csrc/poison_cuda.cu: the moe_ep_zero_rows target's row zeroing on XLA's stream.
extern "C" cudaError_t moe_ep_ffi_zero_rows_cuda(void* stream, const int32_t* rows, int64_t n, void* data,
                                                 int64_t num_rows, int64_t row_bytes);
#endif

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace moe_ep_ffi {
namespace {

using Dims = ffi::AnyBuffer::Dimensions;

// ----------------------------------------------------------------------------- helpers

// Where a handler runs: the C ABI's device and stream.
struct Dev {
  moe_ep_device device;
  void* stream;
};


std::string ShapeStr(Dims d) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

std::string ShapeStr(const std::vector<int64_t>& d) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    default: return "another dtype";
  }
}

// "<target>: <rule>; got <seen>": the message of every rejection.
ffi::Error Invalid(const char* target, const std::string& rule, const std::string& seen) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + rule + "; got " + seen);
}

// `name` must have rank `rank` (its layout `what`, e.g. "[C, H]").
ffi::Error ExpectRank(const char* target, const char* name, const char* what, Dims got, size_t rank) {
  if (got.size() == rank) return ffi::Error::Success();
  return Invalid(target, std::string(name) + " must have rank " + std::to_string(rank) + " " + what,
                 "rank " + std::to_string(got.size()) + ", shape " + ShapeStr(got));
}

// `name` must have shape `want` (the layout `what` with the sizes it implies).
ffi::Error ExpectShape(const char* target, const char* name, const char* what, Dims got,
                       const std::vector<int64_t>& want) {
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = got[i] == want[i];
  if (ok) return ffi::Error::Success();
  return Invalid(target, std::string(name) + " must have shape " + what + " = " + ShapeStr(want), ShapeStr(got));
}

ffi::Error ExpectDtype(const char* target, const char* name, ffi::DataType got, ffi::DataType want,
                       const std::string& why) {
  if (got == want) return ffi::Error::Success();
  return Invalid(target, std::string(name) + " must have dtype " + DtypeName(want) + why, DtypeName(got));
}

ffi::Error ExpectAtLeast(const char* target, const char* name, int64_t value, int64_t lo) {
  if (value >= lo) return ffi::Error::Success();
  return Invalid(target, std::string("attribute ") + name + " must be >= " + std::to_string(lo), std::to_string(value));
}

// The block formats' sizes (moe_ep_native.h, "Encoded storage").
constexpr int64_t kMxfp8Block = 32;
constexpr int64_t kNvfp4Block = 16;
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

ffi::Error ExpectEncodeFormat(const char* target, int32_t format, const char* name = "format") {
  if (format == MOE_EP_FORMAT_BF16 || format == MOE_EP_FORMAT_MXFP8 || format == MOE_EP_FORMAT_NVFP4)
    return ffi::Error::Success();
  return Invalid(target, std::string("attribute ") + name + " must be 1 (bf16), 2 (mxfp8) or 3 (nvfp4)",
                 std::to_string(format));
}

// Extents of the encoded storage along the blocked axis for `n` values.
int64_t DataExtent(int32_t format, int64_t n) { return format == MOE_EP_FORMAT_NVFP4 ? CeilDiv(n, 2) : n; }
int64_t ScaleExtent(int32_t format, int64_t n) {
  if (format == MOE_EP_FORMAT_MXFP8) return CeilDiv(n, kMxfp8Block);
  if (format == MOE_EP_FORMAT_NVFP4) return CeilDiv(n, kNvfp4Block);
  return 0;  // bf16: no scale
}
const char* DataLayout(int32_t format) {
  return format == MOE_EP_FORMAT_NVFP4 ? "[outer, ceil(n/2), inner] for nvfp4" : "[outer, n, inner]";
}
const char* ScaleLayout(int32_t format) {
  if (format == MOE_EP_FORMAT_MXFP8) return "[outer, ceil(n/32), inner] for mxfp8";
  if (format == MOE_EP_FORMAT_NVFP4) return "[outer, ceil(n/16), inner] for nvfp4";
  return "[outer, 0, inner] for bf16 (no scale)";
}
ffi::DataType DataDtype(int32_t format) { return format == MOE_EP_FORMAT_BF16 ? ffi::DataType::U16 : ffi::DataType::U8; }
const char* FormatName(int32_t format) {
  switch (format) {
    case MOE_EP_FORMAT_BF16: return "bf16";
    case MOE_EP_FORMAT_MXFP8: return "mxfp8";
    case MOE_EP_FORMAT_NVFP4: return "nvfp4";
    default: return "?";
  }
}

// A C ABI status as an ffi::Error: the core's message (moe_ep_last_error(),
// which starts with the C entry point's name), led by the target's name when
// that differs, then the status name.
ffi::Error FromStatus(const char* target, moe_ep_status status) {
  if (status == MOE_EP_OK) return ffi::Error::Success();
  std::string core = moe_ep_last_error();
  const std::string name(target);
  if (core.rfind(name + ":", 0) != 0) core = name + ": " + core;
  std::string message = core + " [" + moe_ep_status_name(status) + "]";
  switch (status) {
    case MOE_EP_ERR_INVALID_ARGUMENT: return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::move(message));
    case MOE_EP_ERR_UNSUPPORTED: return ffi::Error(ffi::ErrorCode::kUnimplemented, std::move(message));
    default: return ffi::Error(ffi::ErrorCode::kInternal, std::move(message));
  }
}

#define MOE_EP_FFI_TRY(expr)               \
  do {                                     \
    ffi::Error _err = (expr);              \
    if (_err.failure()) return _err;       \
  } while (0)

// A pointer to pass for a buffer: NULL when it is empty (the C ABI allows NULL
// exactly for empty arrays; XLA's pointer for an empty buffer means nothing).
template <typename B>
void* DataOrNull(const B& buf) {
  return buf.element_count() == 0 ? nullptr : buf.untyped_data();
}

// ----------------------------------------------------------------------------- formats

// moe_ep_quantize over the [outer, n, inner] view.
ffi::Error Quantize(Dev dev, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::AnyBuffer> data,
                    ffi::Result<ffi::Buffer<ffi::U8>> scale, int32_t format) {
  constexpr const char* kT = "moe_ep_quantize";
  MOE_EP_FFI_TRY(ExpectEncodeFormat(kT, format));
  MOE_EP_FFI_TRY(ExpectRank(kT, "x", "[outer, n, inner]", x.dimensions(), 3));
  const int64_t outer = x.dimensions()[0], n = x.dimensions()[1], inner = x.dimensions()[2];
  MOE_EP_FFI_TRY(ExpectDtype(kT, "data", data->element_type(), DataDtype(format),
                             std::string(" for format ") + std::to_string(format) + " (" + FormatName(format) + ")"));
  MOE_EP_FFI_TRY(ExpectShape(kT, "data", DataLayout(format), data->dimensions(), {outer, DataExtent(format, n), inner}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "scale", ScaleLayout(format), scale->dimensions(), {outer, ScaleExtent(format, n), inner}));
  return FromStatus(kT, moe_ep_quantize(dev.device, dev.stream, static_cast<moe_ep_format>(format),
                                    static_cast<const float*>(DataOrNull(x)), outer, n, inner, DataOrNull(*data),
                                    format == MOE_EP_FORMAT_BF16 ? nullptr : DataOrNull(*scale)));
}

template <typename B>
auto BindQuantize(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::F32>>()  // x [outer, n, inner] f32: the values; blocks run along n
      .template Ret<ffi::AnyBuffer>()         // data: bf16 [outer, n, inner] u16 bits; mxfp8 [outer, n, inner] u8
                                              //   E4M3 codes; nvfp4 [outer, ceil(n/2), inner] u8, two E2M1 codes a byte
      .template Ret<ffi::Buffer<ffi::U8>>()   // scale [outer, ceil(n/B), inner] u8 block scales (E8M0 for mxfp8,
                                              //   E4M3 for nvfp4); [outer, 0, inner] and unwritten for bf16
      .template Attr<int32_t>("format");      // 1 bf16, 2 mxfp8, 3 nvfp4
}

// moe_ep_dequantize over the [outer, n, inner] view.
ffi::Error Dequantize(Dev dev, ffi::AnyBuffer data, ffi::Buffer<ffi::U8> scale, ffi::Result<ffi::Buffer<ffi::F32>> out,
                      int32_t format, int64_t n) {
  constexpr const char* kT = "moe_ep_dequantize";
  MOE_EP_FFI_TRY(ExpectEncodeFormat(kT, format));
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "n", n, 0));
  MOE_EP_FFI_TRY(ExpectRank(kT, "out", "[outer, n, inner]", out->dimensions(), 3));
  const int64_t outer = out->dimensions()[0], inner = out->dimensions()[2];
  MOE_EP_FFI_TRY(ExpectShape(kT, "out", "[outer, n, inner] (n: attribute)", out->dimensions(), {outer, n, inner}));
  MOE_EP_FFI_TRY(ExpectDtype(kT, "data", data.element_type(), DataDtype(format),
                             std::string(" for format ") + std::to_string(format) + " (" + FormatName(format) + ")"));
  MOE_EP_FFI_TRY(ExpectShape(kT, "data", DataLayout(format), data.dimensions(), {outer, DataExtent(format, n), inner}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "scale", ScaleLayout(format), scale.dimensions(), {outer, ScaleExtent(format, n), inner}));
  return FromStatus(kT, moe_ep_dequantize(dev.device, dev.stream, static_cast<moe_ep_format>(format), DataOrNull(data),
                                      format == MOE_EP_FORMAT_BF16 ? nullptr : DataOrNull(scale), outer, n, inner,
                                      static_cast<float*>(DataOrNull(*out))));
}

template <typename B>
auto BindDequantize(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // data: the encoded codes, layout as moe_ep_quantize's data
      .template Arg<ffi::Buffer<ffi::U8>>()    // scale: block scales as moe_ep_quantize's ([outer, 0, inner] for bf16)
      .template Ret<ffi::Buffer<ffi::F32>>()   // out [outer, n, inner] f32: the exact decoded values
      .template Attr<int32_t>("format")        // 1 bf16, 2 mxfp8, 3 nvfp4
      .template Attr<int64_t>("n");            // the logical extent of the blocked axis
}

// moe_ep_dequantize_bf16 over the [outer, n, inner] view: the exact bf16 bits of the
// values (NaN where bf16 cannot hold one), and the inexact flag ORed into `flag`, which
// aliases the zeroed input `flag_in` (XLA gives no zeroed outputs).
ffi::Error DequantizeBf16(Dev dev, ffi::AnyBuffer data, ffi::Buffer<ffi::U8> scale, ffi::Buffer<ffi::S32> flag_in,
                          ffi::Result<ffi::Buffer<ffi::U16>> out, ffi::Result<ffi::Buffer<ffi::S32>> flag,
                          int32_t format, int64_t n) {
  constexpr const char* kT = "moe_ep_dequantize_bf16";
  if (format != MOE_EP_FORMAT_MXFP8 && format != MOE_EP_FORMAT_NVFP4)
    return Invalid(kT, "attribute format must be 2 (mxfp8) or 3 (nvfp4)", std::to_string(format));
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "n", n, 0));
  MOE_EP_FFI_TRY(ExpectRank(kT, "out", "[outer, n, inner]", out->dimensions(), 3));
  const int64_t outer = out->dimensions()[0], inner = out->dimensions()[2];
  MOE_EP_FFI_TRY(ExpectShape(kT, "out", "[outer, n, inner] (n: attribute)", out->dimensions(), {outer, n, inner}));
  MOE_EP_FFI_TRY(ExpectDtype(kT, "data", data.element_type(), DataDtype(format),
                             std::string(" for format ") + std::to_string(format) + " (" + FormatName(format) + ")"));
  MOE_EP_FFI_TRY(ExpectShape(kT, "data", DataLayout(format), data.dimensions(), {outer, DataExtent(format, n), inner}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "scale", ScaleLayout(format), scale.dimensions(), {outer, ScaleExtent(format, n), inner}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "flag", "[1]", flag->dimensions(), {1}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "flag_in", "[1]", flag_in.dimensions(), {1}));
  if (flag_in.untyped_data() != flag->untyped_data())
    return Invalid(kT, "flag must alias flag_in (input_output_aliases={2: 1})", "separate buffers");
  return FromStatus(kT, moe_ep_dequantize_bf16(dev.device, dev.stream, static_cast<moe_ep_format>(format),
                                           DataOrNull(data), DataOrNull(scale), outer, n, inner, 0,
                                           static_cast<uint16_t*>(DataOrNull(*out)),
                                           static_cast<int32_t*>(flag->untyped_data())));
}

template <typename B>
auto BindDequantizeBf16(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // data: mxfp8 or nvfp4 codes, layout as moe_ep_quantize's data
      .template Arg<ffi::Buffer<ffi::U8>>()    // scale: block scales as moe_ep_quantize's
      .template Arg<ffi::Buffer<ffi::S32>>()   // flag_in [1] s32: zero (aliased to the flag result)
      .template Ret<ffi::Buffer<ffi::U16>>()   // out [outer, n, inner] u16: bf16 bits of the exact values, NaN where
                                               //   bf16 cannot hold one
      .template Ret<ffi::Buffer<ffi::S32>>()   // flag [1] s32: 1 when some value was not a bf16 value, else 0
      .template Attr<int32_t>("format")        // 2 mxfp8, 3 nvfp4
      .template Attr<int64_t>("n");            // the logical extent of the blocked axis
}

// moe_ep_dequantize_bf16_gather: buffer row i = the exact bf16 bits of token row
// route[i] / num_topk (rows blocked along their last axis), zero bits where route[i] is -1.
ffi::Error DequantizeBf16Gather(Dev dev, ffi::AnyBuffer data, ffi::Buffer<ffi::U8> scale,
                                ffi::Buffer<ffi::S32> route, ffi::Buffer<ffi::S32> flag_in,
                                ffi::Result<ffi::Buffer<ffi::U16>> out, ffi::Result<ffi::Buffer<ffi::S32>> flag,
                                int32_t format, int64_t n, int64_t num_topk) {
  constexpr const char* kT = "moe_ep_dequantize_bf16_gather";
  if (format != MOE_EP_FORMAT_MXFP8 && format != MOE_EP_FORMAT_NVFP4)
    return Invalid(kT, "attribute format must be 2 (mxfp8) or 3 (nvfp4)", std::to_string(format));
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "n", n, 0));
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "num_topk", num_topk, 1));
  MOE_EP_FFI_TRY(ExpectRank(kT, "data", "[T, codes]", data.dimensions(), 2));
  MOE_EP_FFI_TRY(ExpectRank(kT, "route", "[C]", route.dimensions(), 1));
  const int64_t t = data.dimensions()[0], c = route.dimensions()[0];
  MOE_EP_FFI_TRY(ExpectDtype(kT, "data", data.element_type(), DataDtype(format),
                             std::string(" for format ") + std::to_string(format) + " (" + FormatName(format) + ")"));
  const int64_t codes = DataExtent(format, n), scales = ScaleExtent(format, n);
  MOE_EP_FFI_TRY(ExpectShape(kT, "data", "[T, codes of n] (n: attribute)", data.dimensions(), {t, codes}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "scale", "[T, scales of n] (T: data's rows)", scale.dimensions(), {t, scales}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "out", "[C, n] (C: route's length)", out->dimensions(), {c, n}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "flag", "[1]", flag->dimensions(), {1}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "flag_in", "[1]", flag_in.dimensions(), {1}));
  if (flag_in.untyped_data() != flag->untyped_data())
    return Invalid(kT, "flag must alias flag_in (input_output_aliases={3: 1})", "separate buffers");
  return FromStatus(kT, moe_ep_dequantize_bf16_gather(dev.device, dev.stream, static_cast<moe_ep_format>(format),
                                                  DataOrNull(data), codes, DataOrNull(scale), scales, t,
                                                  static_cast<const int32_t*>(DataOrNull(route)), num_topk, c, n,
                                                  static_cast<uint16_t*>(DataOrNull(*out)),
                                                  static_cast<int32_t*>(flag->untyped_data())));
}

template <typename B>
auto BindDequantizeBf16Gather(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // data [T, codes]: the token rows' mxfp8 or nvfp4 codes
      .template Arg<ffi::Buffer<ffi::U8>>()    // scale [T, scales]: their block scales
      .template Arg<ffi::Buffer<ffi::S32>>()   // route [C] s32: buffer row i's route id, -1 = none (a zero row)
      .template Arg<ffi::Buffer<ffi::S32>>()   // flag_in [1] s32: zero (aliased to the flag result)
      .template Ret<ffi::Buffer<ffi::U16>>()   // out [C, n] u16: bf16 bits of token route[i] / K's exact values
      .template Ret<ffi::Buffer<ffi::S32>>()   // flag [1] s32: 1 when some value was not a bf16 value, else 0
      .template Attr<int32_t>("format")        // 2 mxfp8, 3 nvfp4
      .template Attr<int64_t>("n")             // the row length
      .template Attr<int64_t>("num_topk");     // K >= 1
}

// ----------------------------------------------------------------------------- plan, permute, combine

ffi::Error PlanRoutes(Dev dev, ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::Buffer<ffi::S32>> send_route,
                      ffi::Result<ffi::Buffer<ffi::S32>> route_pos, ffi::Result<ffi::Buffer<ffi::S32>> route_expert,
                      ffi::Result<ffi::Buffer<ffi::S32>> counts, int64_t num_experts) {
  constexpr const char* kT = "moe_ep_plan_routes";
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "num_experts", num_experts, 1));
  MOE_EP_FFI_TRY(ExpectRank(kT, "topk_idx", "[T, K]", topk_idx.dimensions(), 2));
  const int64_t t = topk_idx.dimensions()[0], k = topk_idx.dimensions()[1];
  MOE_EP_FFI_TRY(ExpectShape(kT, "send_route", "[T * K]", send_route->dimensions(), {t * k}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "route_pos", "[T * K]", route_pos->dimensions(), {t * k}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "route_expert", "[T * K]", route_expert->dimensions(), {t * k}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "counts", "[num_experts + 1]", counts->dimensions(), {num_experts + 1}));
  return FromStatus(kT, moe_ep_plan_routes(dev.device, dev.stream, static_cast<const int32_t*>(DataOrNull(topk_idx)), t, k,
                                       num_experts, static_cast<int32_t*>(DataOrNull(*send_route)),
                                       static_cast<int32_t*>(DataOrNull(*route_pos)),
                                       static_cast<int32_t*>(DataOrNull(*route_expert)),
                                       static_cast<int32_t*>(DataOrNull(*counts))));
}

template <typename B>
auto BindPlanRoutes(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()   // topk_idx [T, K] s32: expert ids, -1 = unused slot
      .template Ret<ffi::Buffer<ffi::S32>>()   // send_route [T*K] s32: route ids sorted by (expert, route id), the
                                               //   unrouted ones (-1 slots, bad ids) after them in route order
      .template Ret<ffi::Buffer<ffi::S32>>()   // route_pos [T*K] s32: each route id's position in send_route, -1 unrouted
      .template Ret<ffi::Buffer<ffi::S32>>()   // route_expert [T*K] s32: each routed id's expert, -1 unrouted
      .template Ret<ffi::Buffer<ffi::S32>>()   // counts [E + 1] s32: routes per expert, then the number of bad ids
      .template Attr<int64_t>("num_experts");  // E >= 1
}

ffi::Error PermuteRows(Dev dev, ffi::AnyBuffer tokens, ffi::Buffer<ffi::S32> send_route, ffi::Result<ffi::AnyBuffer> dst,
                       int64_t num_topk) {
  constexpr const char* kT = "moe_ep_permute_rows";
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "num_topk", num_topk, 1));
  const Dims td = tokens.dimensions();
  if (td.size() < 1) return Invalid(kT, "tokens must have rank >= 1 [T, ...]", "rank 0");
  MOE_EP_FFI_TRY(ExpectRank(kT, "send_route", "[R]", send_route.dimensions(), 1));
  const int64_t rows = send_route.dimensions()[0];
  std::vector<int64_t> want(td.begin(), td.end());
  want[0] = rows;
  MOE_EP_FFI_TRY(ExpectShape(kT, "dst", "[R, ...] (R: send_route's length, the rest: tokens' row shape)",
                             dst->dimensions(), want));
  MOE_EP_FFI_TRY(ExpectDtype(kT, "dst", dst->element_type(), tokens.element_type(), " (the dtype of tokens)"));
  const size_t width = ffi::ByteWidth(tokens.element_type());
  if (width == 0) return Invalid(kT, "tokens must have a whole-byte dtype", DtypeName(tokens.element_type()));
  int64_t row_bytes = static_cast<int64_t>(width);
  for (size_t i = 1; i < td.size(); ++i) row_bytes *= td[i];
  return FromStatus(kT, moe_ep_permute_rows(dev.device, dev.stream, DataOrNull(tokens), td[0], num_topk, row_bytes,
                                        static_cast<const int32_t*>(DataOrNull(send_route)), rows, DataOrNull(*dst)));
}

template <typename B>
auto BindPermuteRows(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // tokens [T, ...] any whole-byte dtype: rows move unchanged
      .template Arg<ffi::Buffer<ffi::S32>>()   // send_route [R] s32: route ids in [0, T*K), or -1 for a zero row
      .template Ret<ffi::AnyBuffer>()          // dst [R, ...] tokens' dtype: dst[i] = tokens[send_route[i] / K]
      .template Attr<int64_t>("num_topk");     // K >= 1
}

// What the combine targets check of their rows: float32 or bfloat16, a round_trip of none,
// mxfp8 or nvfp4 (float32 rows only: the unrounded expert outputs), [R, H].
ffi::Error ExpectCombineRows(const char* kT, const ffi::AnyBuffer& rows, int32_t round_trip) {
  const ffi::DataType rt = rows.element_type();
  if (rt != ffi::DataType::F32 && rt != ffi::DataType::BF16)
    return Invalid(kT, "rows must have dtype float32 or bfloat16", DtypeName(rt));
  if (round_trip != MOE_EP_FORMAT_NONE && round_trip != MOE_EP_FORMAT_MXFP8 && round_trip != MOE_EP_FORMAT_NVFP4)
    return Invalid(kT, "attribute round_trip must be 0 (none), 2 (mxfp8) or 3 (nvfp4)", std::to_string(round_trip));
  if (round_trip != MOE_EP_FORMAT_NONE && rt != ffi::DataType::F32)
    return Invalid(kT, "rows must have dtype float32 when round_trip is set (the unrounded expert outputs)",
                   DtypeName(rt));
  return ExpectRank(kT, "rows", "[R, H]", rows.dimensions(), 2);
}

ffi::Error CombineReduce(Dev dev, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> route_pos,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t num_topk, int32_t round_trip) {
  constexpr const char* kT = "moe_ep_combine_reduce";
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "num_topk", num_topk, 1));
  MOE_EP_FFI_TRY(ExpectCombineRows(kT, rows, round_trip));
  const ffi::DataType rt = rows.element_type();
  MOE_EP_FFI_TRY(ExpectRank(kT, "out", "[T, H]", out->dimensions(), 2));
  const int64_t r = rows.dimensions()[0], h = rows.dimensions()[1], t = out->dimensions()[0];
  MOE_EP_FFI_TRY(ExpectShape(kT, "out", "[T, H] (H: rows' width)", out->dimensions(), {t, h}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "route_pos", "[T * K] (T: out's rows)", route_pos.dimensions(), {t * num_topk}));
  if (t == 0) return ffi::Error::Success();  // nothing to sum (and a NULL route_pos would mean the identity)
  const auto* pos = static_cast<const int32_t*>(route_pos.untyped_data());
  float* o = static_cast<float*>(DataOrNull(*out));
  if (round_trip != MOE_EP_FORMAT_NONE)  // each row read through the block format's round trip: one pass
    return FromStatus(kT, moe_ep_combine_reduce_round_trip(dev.device, dev.stream, static_cast<moe_ep_format>(round_trip),
                                                           static_cast<const float*>(DataOrNull(rows)), r, pos, t,
                                                           num_topk, h, o));
  if (rt == ffi::DataType::BF16)  // a bf16 combine format's rows as they are: half the bytes, the same sums
    return FromStatus(kT, moe_ep_combine_reduce_bf16(dev.device, dev.stream,
                                                     static_cast<const uint16_t*>(DataOrNull(rows)), r, pos, t,
                                                     num_topk, h, o));
  return FromStatus(kT, moe_ep_combine_reduce(dev.device, dev.stream, static_cast<const float*>(DataOrNull(rows)), r,
                                              pos, t, num_topk, h, o));
}

template <typename B>
auto BindCombineReduce(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // rows [R, H] f32 or bf16: the returned (decoded) expert outputs
      .template Arg<ffi::Buffer<ffi::S32>>()   // route_pos [T*K] s32: row of each route, -1 = none (adds nothing)
      .template Ret<ffi::Buffer<ffi::F32>>()   // out [T, H] f32: ((+0 + Y[t,0]) + Y[t,1]) + ... in slot order
      .template Attr<int64_t>("num_topk")      // K >= 1
      .template Attr<int32_t>("round_trip");   // 0, or 2 / 3: Y = the mxfp8 / nvfp4 round trip of the f32 row
}

// moe_ep_combine_reduce_encode: CombineReduce's sums, NaN on the error flag, encoded.
ffi::Error CombineReduceEncode(Dev dev, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> route_pos,
                               ffi::Buffer<ffi::PRED> error, ffi::Result<ffi::AnyBuffer> data,
                               ffi::Result<ffi::Buffer<ffi::U8>> scale, int64_t num_topk, int32_t round_trip,
                               int32_t out_format) {
  constexpr const char* kT = "moe_ep_combine_reduce_encode";
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "num_topk", num_topk, 1));
  MOE_EP_FFI_TRY(ExpectEncodeFormat(kT, out_format, "out_format"));
  MOE_EP_FFI_TRY(ExpectCombineRows(kT, rows, round_trip));
  const ffi::DataType rt = rows.element_type();
  MOE_EP_FFI_TRY(ExpectRank(kT, "data", "[T, H']", data->dimensions(), 2));
  const int64_t r = rows.dimensions()[0], h = rows.dimensions()[1], t = data->dimensions()[0];
  // (bf16 bits as uint16, or as bfloat16 itself: the caller's dtype with no bit cast after the call)
  if (!(out_format == MOE_EP_FORMAT_BF16 && data->element_type() == ffi::DataType::BF16))
    MOE_EP_FFI_TRY(ExpectDtype(kT, "data", data->element_type(), DataDtype(out_format),
                               std::string(" for out_format ") + std::to_string(out_format) + " (" +
                                   FormatName(out_format) + ")"));
  MOE_EP_FFI_TRY(ExpectShape(kT, "data", "[T, H] (bf16, mxfp8) or [T, ceil(H/2)] (nvfp4); H: rows' width",
                             data->dimensions(), {t, DataExtent(out_format, h)}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "scale", "[T, ceil(H/B)] (B: the block; 0 for bf16)", scale->dimensions(),
                             {t, ScaleExtent(out_format, h)}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "route_pos", "[T * K] (T: data's rows)", route_pos.dimensions(), {t * num_topk}));
  if (error.element_count() != 1)
    return Invalid(kT, "error must hold one element (the layer's error flag)", ShapeStr(error.dimensions()));
  if (t == 0) return ffi::Error::Success();  // nothing to sum (and a NULL route_pos would mean the identity)
  return FromStatus(kT, moe_ep_combine_reduce_encode(
      dev.device, dev.stream, rt == ffi::DataType::BF16 ? MOE_EP_DTYPE_BF16 : MOE_EP_DTYPE_F32,
      static_cast<moe_ep_format>(round_trip), DataOrNull(rows), r, static_cast<const int32_t*>(route_pos.untyped_data()),
      t, num_topk, h, static_cast<const uint8_t*>(error.untyped_data()), static_cast<moe_ep_format>(out_format),
      DataOrNull(*data), out_format == MOE_EP_FORMAT_BF16 ? nullptr : DataOrNull(*scale)));
}

template <typename B>
auto BindCombineReduceEncode(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // rows [R, H] f32 or bf16: the expert outputs
      .template Arg<ffi::Buffer<ffi::S32>>()   // route_pos [T*K] s32: row of each route, -1 = none (adds nothing)
      .template Arg<ffi::Buffer<ffi::PRED>>()  // error [] bool: the layer's error flag (every sum NaN)
      .template Ret<ffi::AnyBuffer>()          // data [T, H] bf16 (u16 bits or bf16) / mxfp8 u8 codes, [T, ceil(H/2)]
                                               //   nvfp4 u8
      .template Ret<ffi::Buffer<ffi::U8>>()    // scale [T, ceil(H/B)] u8 block scales; [T, 0], unwritten, for bf16
      .template Attr<int64_t>("num_topk")      // K >= 1
      .template Attr<int32_t>("round_trip")    // 0, or 2 / 3: each row read through mxfp8 / nvfp4 (f32 rows)
      .template Attr<int32_t>("out_format");   // 1 bf16, 2 mxfp8, 3 nvfp4
}

// combine_reduce with route_pos NULL: row t*K+k is slot k of token t.
ffi::Error SlotSum(Dev dev, ffi::Buffer<ffi::F32> rows, ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t num_topk) {
  constexpr const char* kT = "moe_ep_slot_sum";
  MOE_EP_FFI_TRY(ExpectAtLeast(kT, "num_topk", num_topk, 1));
  MOE_EP_FFI_TRY(ExpectRank(kT, "rows", "[T * K, H]", rows.dimensions(), 2));
  MOE_EP_FFI_TRY(ExpectRank(kT, "out", "[T, H]", out->dimensions(), 2));
  const int64_t t = out->dimensions()[0], h = rows.dimensions()[1];
  MOE_EP_FFI_TRY(ExpectShape(kT, "out", "[T, H] (H: rows' width)", out->dimensions(), {t, h}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "rows", "[T * K, H] (T: out's rows, K: attribute num_topk)", rows.dimensions(),
                             {t * num_topk, h}));
  return FromStatus(kT, moe_ep_combine_reduce(dev.device, dev.stream, static_cast<const float*>(DataOrNull(rows)),
                                          t * num_topk, nullptr, t, num_topk, h, static_cast<float*>(DataOrNull(*out))));
}

template <typename B>
auto BindSlotSum(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::F32>>()   // rows [T*K, H] f32: row t*K+k is token t's slot k
      .template Ret<ffi::Buffer<ffi::F32>>()   // out [T, H] f32: ((+0 + rows[t*K]) + rows[t*K+1]) + ... in slot order
      .template Attr<int64_t>("num_topk");     // K >= 1
}

// ----------------------------------------------------------------------------- the error poison

#ifdef MOE_EP_NATIVE_WITH_CUDA
// The answer of a handler whose work is one launch of its own kernel (st: the launch's status).
ffi::Error OwnLaunch(const char* kT, cudaError_t st) {
  if (st == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(kT) + ": the CUDA launch failed: " + cudaGetErrorString(st));
}
#endif

// The quiet NaN bit pattern jnp.asarray(jnp.nan, dtype) has, of the float dtypes the
// target takes (0: another dtype).
uint32_t NanBits(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0x7FC00000u;
    case ffi::DataType::BF16: return 0x7FC0u;
    case ffi::DataType::F16: return 0x7E00u;
    default: return 0;
  }
}

// out (which aliases x: input_output_aliases={0: 0}) = NaN everywhere when *error, else x
// untouched: the jax layer's NaN on a data-dependent error (jnp.where(error, nan, x)) with no
// read or write of x on the usual path (the flag is read on the device).
ffi::Error Poison(Dev dev, ffi::AnyBuffer x, ffi::Buffer<ffi::PRED> error, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kT = "moe_ep_poison";
  const uint32_t nan = NanBits(x.element_type());
  if (nan == 0) return Invalid(kT, "x must have dtype float32, bfloat16 or float16", DtypeName(x.element_type()));
  MOE_EP_FFI_TRY(ExpectDtype(kT, "out", out->element_type(), x.element_type(), " (the dtype of x)"));
  MOE_EP_FFI_TRY(ExpectShape(kT, "out", "(x's shape)", out->dimensions(),
                             std::vector<int64_t>(x.dimensions().begin(), x.dimensions().end())));
  if (error.element_count() != 1)
    return Invalid(kT, "error must hold one element (the layer's error flag)", ShapeStr(error.dimensions()));
  if (x.element_count() == 0) return ffi::Error::Success();
  if (x.untyped_data() != out->untyped_data())
    return Invalid(kT, "out must alias x (input_output_aliases={0: 0})", "separate buffers");
  const int32_t width = static_cast<int32_t>(ffi::ByteWidth(x.element_type()));
  const int64_t bytes = static_cast<int64_t>(x.element_count()) * width;
  if (dev.device == MOE_EP_DEVICE_CPU) {
    if (*static_cast<const uint8_t*>(error.untyped_data()) == 0) return ffi::Error::Success();
    if (width == 4) {
      uint32_t* p = static_cast<uint32_t*>(out->untyped_data());
      std::fill(p, p + bytes / 4, nan);
    } else {
      uint16_t* p = static_cast<uint16_t*>(out->untyped_data());
      std::fill(p, p + bytes / 2, static_cast<uint16_t>(nan));
    }
    return ffi::Error::Success();
  }
#ifdef MOE_EP_NATIVE_WITH_CUDA
  return OwnLaunch(kT, moe_ep_ffi_poison_cuda(dev.stream, error.untyped_data(), out->untyped_data(), bytes, width, nan));
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string(kT) + ": this build has no CUDA");
#endif
}

template <typename B>
auto BindPoison(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // x [...] f32, bf16 or f16
      .template Arg<ffi::Buffer<ffi::PRED>>()  // error [] bool: the layer's error flag
      .template Ret<ffi::AnyBuffer>();         // out: x itself (aliased), all quiet NaN when error
}

// out (which aliases x: input_output_aliases={0: 0}) = x with the rows listed in `rows`
// zeroed (all bytes 0; -1 lists none): a few rows of a large array changed in place.
ffi::Error ZeroRows(Dev dev, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kT = "moe_ep_zero_rows";
  const Dims xd = x.dimensions();
  if (xd.size() < 1) return Invalid(kT, "x must have rank >= 1 [R, ...]", "rank 0");
  MOE_EP_FFI_TRY(ExpectRank(kT, "rows", "[N]", rows.dimensions(), 1));
  MOE_EP_FFI_TRY(ExpectDtype(kT, "out", out->element_type(), x.element_type(), " (the dtype of x)"));
  MOE_EP_FFI_TRY(ExpectShape(kT, "out", "(x's shape)", out->dimensions(), std::vector<int64_t>(xd.begin(), xd.end())));
  const size_t width = ffi::ByteWidth(x.element_type());
  if (width == 0) return Invalid(kT, "x must have a whole-byte dtype", DtypeName(x.element_type()));
  const int64_t num_rows = xd[0], n = rows.dimensions()[0];
  if (x.element_count() == 0 || n == 0) return ffi::Error::Success();
  if (x.untyped_data() != out->untyped_data())
    return Invalid(kT, "out must alias x (input_output_aliases={0: 0})", "separate buffers");
  const int64_t row_bytes = static_cast<int64_t>(x.element_count() / static_cast<size_t>(num_rows) * width);
  if (dev.device == MOE_EP_DEVICE_CPU) {
    const int32_t* r = static_cast<const int32_t*>(rows.untyped_data());
    for (int64_t i = 0; i < n; ++i)
      if (r[i] < -1 || r[i] >= num_rows)
        return Invalid(kT, "rows[" + std::to_string(i) + "] must be -1 or in [0, R) = [0, " + std::to_string(num_rows) +
                               ")", std::to_string(r[i]));
    uint8_t* base = static_cast<uint8_t*>(out->untyped_data());
    for (int64_t i = 0; i < n; ++i)
      if (r[i] >= 0) std::memset(base + static_cast<int64_t>(r[i]) * row_bytes, 0, static_cast<size_t>(row_bytes));
    return ffi::Error::Success();
  }
#ifdef MOE_EP_NATIVE_WITH_CUDA  // (CUDA zeroes nothing for a row out of range: it cannot check the values)
  return OwnLaunch(kT, moe_ep_ffi_zero_rows_cuda(dev.stream, static_cast<const int32_t*>(rows.untyped_data()), n,
                                                 out->untyped_data(), num_rows, row_bytes));
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string(kT) + ": this build has no CUDA");
#endif
}

template <typename B>
auto BindZeroRows(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // x [R, ...] any whole-byte dtype
      .template Arg<ffi::Buffer<ffi::S32>>()   // rows [N] s32: rows to zero, -1 = none
      .template Ret<ffi::AnyBuffer>();         // out: x itself (aliased), the listed rows all zero bytes
}

// ----------------------------------------------------------------------------- experts

// Shapes shared by forward and backward: x [C, H], w [C], fc1 [El, H, 2I],
// fc2 [El, I, H], group_sizes [El]. Sets c, h, i, el.
ffi::Error ExpertShapes(const char* kT, Dims x, Dims w, Dims fc1, Dims fc2, Dims gs, int64_t* c, int64_t* h,
                        int64_t* i, int64_t* el) {
  MOE_EP_FFI_TRY(ExpectRank(kT, "x", "[C, H]", x, 2));
  MOE_EP_FFI_TRY(ExpectRank(kT, "fc1", "[E_local, H, 2I]", fc1, 3));
  *c = x[0];
  *h = x[1];
  *el = fc1[0];
  if (fc1[2] < 2 || fc1[2] % 2 != 0)
    return Invalid(kT, "fc1's last axis (2I: gate then up columns) must be even and >= 2", ShapeStr(fc1));
  *i = fc1[2] / 2;
  if (*el < 1) return Invalid(kT, "fc1 must hold at least one expert (E_local >= 1)", ShapeStr(fc1));
  MOE_EP_FFI_TRY(ExpectShape(kT, "fc1", "[E_local, H, 2I] (H: x's width)", fc1, {*el, *h, 2 * *i}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "fc2", "[E_local, I, H] (from fc1)", fc2, {*el, *i, *h}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "w", "[C] (C: x's rows)", w, {*c}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "group_sizes", "[E_local] (from fc1)", gs, {*el}));
  return ffi::Error::Success();
}

ffi::Error ExpectFormatAttr(const char* kT, int32_t value, const char* name = "intermediate_format") {
  if (value >= MOE_EP_FORMAT_NONE && value <= MOE_EP_FORMAT_NVFP4) return ffi::Error::Success();
  return Invalid(kT, std::string("attribute ") + name + " must be 0 (none), 1 (bf16), 2 (mxfp8) or 3 (nvfp4)",
                 std::to_string(value));
}

// ----------------------------------------------------------------------------- the layer cache

// One moe_ep_layer per (device, device ordinal, operand dtype, shape and
// configuration fields), made on first use and kept for the life of the
// process: the handlers allocate nothing per call (the layer's workspaces are
// allocated once, at creation). A layer serves every row count up to its
// max_rows; a call with more rows (or the first backward, which needs
// with_backward) makes a larger layer that replaces it. A replaced CUDA layer is
// never freed (a CUDA graph XLA captured earlier may still hold its
// workspaces; a replaced CPU layer is), nor is any layer freed at exit (the CUDA context may be gone by
// then); so the memory kept is at most the sum of the sizes each configuration
// grew through.
//
// A layer is used by one thread at a time: every stage call holds its slot's
// mutex (on the CPU for the whole computation, on CUDA while it enqueues work
// on XLA's stream; XLA runs one device's kernels in stream order).
//
// On CUDA the layer is made at XLA's initialize stage (before XLA captures the
// program into a command buffer: the initialize handler of the bundle), so the
// execute handler only looks it up. An execute handler that finds no layer
// while its stream is being captured returns an error instead of allocating
// inside the capture.
struct LayerKey {
  int32_t device, ordinal, dtype;
  int64_t hidden, intermediate, experts;
  int32_t apply_topk_in_fc1, has_clamp;
  uint32_t clamp_bits;  // the float's bits (so the key is ordered and exact)
  int32_t intermediate_format;
  int32_t combine_format;  // the round trip the forward applies to y (0: none, the jax layer's own)
  int32_t backward_operand_format;  // the backward's operands: 0 exact, 1 bf16 (the forward passes it too: one layer)

  auto Tie() const {
    return std::tie(device, ordinal, dtype, hidden, intermediate, experts, apply_topk_in_fc1, has_clamp, clamp_bits,
                    intermediate_format, combine_format, backward_operand_format);
  }
  bool operator<(const LayerKey& o) const { return Tie() < o.Tie(); }
};

struct LayerSlot {
  std::mutex mu;                  // held for every stage call
  moe_ep_layer* layer = nullptr;  // the current layer (guarded by the cache's mutex for replacement)
  int64_t max_rows = 0;
  bool with_backward = false;
};

struct LayerRecord {  // one layer ever made, for layer_cache_info()
  LayerKey key;
  int64_t max_rows;
  bool with_backward;
  bool live;
  moe_ep_layer_info info;
};

class LayerCache {
 public:
  // The slot of `key` whose layer takes `rows` rows (and the backward when
  // `backward`), made or grown when needed (`may_create` false: an error
  // instead). On success `*lock` holds the slot's mutex.
  ffi::Error Acquire(const char* kT, const LayerKey& key, int64_t rows, bool backward, bool may_create,
                     LayerSlot** out, std::unique_lock<std::mutex>* lock) {
    LayerSlot* slot;
    {
      std::lock_guard<std::mutex> guard(mu_);
      std::unique_ptr<LayerSlot>& owned = slots_[key];
      if (!owned) owned = std::make_unique<LayerSlot>();
      slot = owned.get();
    }
    std::unique_lock<std::mutex> held(slot->mu);
    if (slot->layer == nullptr || slot->max_rows < rows || (backward && !slot->with_backward)) {
      if (!may_create)
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                          std::string(kT) + ": no layer object for this configuration exists and the stream is being "
                                            "captured into a CUDA graph (the layer is made at XLA's initialize "
                                            "stage, or on a first run outside capture; it is never allocated "
                                            "inside a capture)");
      const int64_t max_rows = std::max(rows, slot->max_rows);
      const bool with_backward = backward || slot->with_backward;
      moe_ep_layer* made = nullptr;
      MOE_EP_FFI_TRY(Make(kT, key, max_rows, with_backward, &made));
      // A replaced CPU layer is freed (nothing can hold its host workspaces: no graph
      // captures them, and the slot's mutex is held); a replaced CUDA layer stays
      // allocated (see above).
      if (slot->layer != nullptr && key.device == MOE_EP_DEVICE_CPU) moe_ep_layer_destroy(slot->layer);
      slot->layer = made;
      slot->max_rows = max_rows;
      slot->with_backward = with_backward;
      LayerRecord rec{key, max_rows, with_backward, true, {}};
      rec.info.struct_size = sizeof rec.info;
      moe_ep_layer_get_info(made, &rec.info);
      std::lock_guard<std::mutex> guard(mu_);
      for (LayerRecord& r : records_)
        if (r.live && !(r.key < key) && !(key < r.key)) r.live = false;
      records_.push_back(rec);
    }
    *out = slot;
    *lock = std::move(held);
    return ffi::Error::Success();
  }

  std::vector<LayerRecord> Records() {
    std::lock_guard<std::mutex> guard(mu_);
    return records_;
  }

 private:
  static ffi::Error Make(const char* kT, const LayerKey& key, int64_t max_rows, bool with_backward,
                         moe_ep_layer** out) {
    moe_ep_layer_config cfg{};
    cfg.struct_size = sizeof cfg;  // MOE_EP_LAYER_CONFIG_INIT
    cfg.device = key.device;
    cfg.cuda_device = key.device == MOE_EP_DEVICE_CUDA ? key.ordinal : 0;
    cfg.operand_dtype = key.dtype;
    cfg.max_rows = max_rows;
    cfg.hidden = key.hidden;
    cfg.intermediate = key.intermediate;
    cfg.num_local_experts = key.experts;
    cfg.apply_topk_in_fc1 = key.apply_topk_in_fc1;
    cfg.has_clamp = key.has_clamp;
    std::memcpy(&cfg.gate_up_clamp, &key.clamp_bits, sizeof cfg.gate_up_clamp);
    cfg.intermediate_format = key.intermediate_format;
    // The combine round trip is the jax layer's where its rows travel encoded (the
    // all-to-all moves the codes): combine_format 0. At one rank the layer may ask
    // for y after the round trip (FfiKernels.expert_forward_combined).
    cfg.combine_format = key.combine_format;
    // A bf16 combine format's rows are bf16 values: y comes back as bf16 (exact, half the
    // bytes; the tensor-core FC2 GEMM writes it itself where nothing else happens to it).
    cfg.expert_out_dtype = key.combine_format == MOE_EP_FORMAT_BF16 ? MOE_EP_DTYPE_BF16 : MOE_EP_DTYPE_F32;
    cfg.with_backward = with_backward ? 1 : 0;
    cfg.backward_operand_format = key.backward_operand_format;
#ifdef MOE_EP_NATIVE_WITH_CUDA
    int current = -1;  // moe_ep_layer_create selects the layer's device; XLA's thread keeps its own
    if (key.device == MOE_EP_DEVICE_CUDA) cudaGetDevice(&current);
#endif
    const moe_ep_status st = moe_ep_layer_create(&cfg, out);
#ifdef MOE_EP_NATIVE_WITH_CUDA
    if (current >= 0) cudaSetDevice(current);
#endif
    return FromStatus(kT, st);
  }

  std::mutex mu_;
  std::map<LayerKey, std::unique_ptr<LayerSlot>> slots_;
  std::vector<LayerRecord> records_;
};

LayerCache& Cache() {
  static LayerCache* cache = new LayerCache();  // never destroyed (see above)
  return *cache;
}

// Where a stage runs: the device, its ordinal, the stream, and whether the
// call may make a layer (false while the stream is captured into a CUDA graph).
struct Where {
  Dev dev;
  int32_t ordinal;
  bool may_create;
};

const char* kOperandDtypes = "float32 or bfloat16";

moe_ep_dtype OperandDtype(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? MOE_EP_DTYPE_BF16 : MOE_EP_DTYPE_F32;
}

// x, fc1 and fc2: one dtype, float32 or bfloat16 (the layer's operand_dtype).
ffi::Error ExpectOperandDtypes(const char* kT, ffi::DataType x, ffi::DataType fc1, ffi::DataType fc2) {
  if (x != ffi::DataType::F32 && x != ffi::DataType::BF16)
    return Invalid(kT, std::string("x must have dtype ") + kOperandDtypes, DtypeName(x));
  MOE_EP_FFI_TRY(ExpectDtype(kT, "fc1", fc1, x, " (the dtype of x: the layer's operand dtype)"));
  return ExpectDtype(kT, "fc2", fc2, x, " (the dtype of x: the layer's operand dtype)");
}

LayerKey KeyOf(const Where& at, ffi::DataType dtype, int64_t h, int64_t i, int64_t el, bool apply_topk_in_fc1,
               bool has_clamp, float gate_up_clamp, int32_t intermediate_format, int32_t combine_format,
               int32_t backward_operand_format) {
  LayerKey k{};
  k.device = at.dev.device;
  k.ordinal = at.ordinal;
  k.dtype = OperandDtype(dtype);
  k.hidden = h;
  k.intermediate = i;
  k.experts = el;
  k.apply_topk_in_fc1 = apply_topk_in_fc1 ? 1 : 0;
  k.has_clamp = has_clamp ? 1 : 0;
  const float clamp = has_clamp ? gate_up_clamp : 0.0f;  // ignored without the clamp: one layer
  std::memcpy(&k.clamp_bits, &clamp, sizeof clamp);
  k.intermediate_format = intermediate_format;
  k.combine_format = combine_format;
  k.backward_operand_format = backward_operand_format;
  return k;
}

// moe_ep_layer_experts_forward of the cached layer. `execute` false: the
// initialize stage (make the layer, run nothing).
ffi::Error ExpertForward(Where at, bool execute, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer fc1,
                         ffi::AnyBuffer fc2, ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::BF16>> fc1_c, bool apply_topk_in_fc1, bool has_clamp,
                         float gate_up_clamp, int32_t intermediate_format, int32_t combine_format,
                         int32_t backward_operand_format) {
  constexpr const char* kT = "moe_ep_expert_forward";
  int64_t c, h, i, el;
  MOE_EP_FFI_TRY(ExpertShapes(kT, x.dimensions(), w.dimensions(), fc1.dimensions(), fc2.dimensions(),
                              group_sizes.dimensions(), &c, &h, &i, &el));
  MOE_EP_FFI_TRY(ExpectOperandDtypes(kT, x.element_type(), fc1.element_type(), fc2.element_type()));
  MOE_EP_FFI_TRY(ExpectShape(kT, "y", "[C, H]", y->dimensions(), {c, h}));
  // fc1_c [0, 2I] (C > 0): no stash asked for (a forward nobody differentiates): none written.
  const bool no_stash = c > 0 && fc1_c->dimensions().size() == 2 && fc1_c->dimensions()[0] == 0;
  MOE_EP_FFI_TRY(ExpectShape(kT, "fc1_c", "[C, 2I], or [0, 2I] for no stash", fc1_c->dimensions(),
                             {no_stash ? 0 : c, 2 * i}));
  MOE_EP_FFI_TRY(ExpectFormatAttr(kT, intermediate_format));
  MOE_EP_FFI_TRY(ExpectFormatAttr(kT, combine_format, "combine_format"));
  if (backward_operand_format != MOE_EP_FORMAT_NONE && backward_operand_format != MOE_EP_FORMAT_BF16)
    return Invalid(kT, "backward_operand_format must be 0 (exact) or 1 (bf16)", std::to_string(backward_operand_format));
  const bool bf16_y = combine_format == MOE_EP_FORMAT_BF16;
  if (y->element_type() != (bf16_y ? ffi::DataType::BF16 : ffi::DataType::F32))
    return Invalid(kT, bf16_y ? "y must have dtype bfloat16 when combine_format is 1 (bf16: its rows are bf16 values)"
                              : "y must have dtype float32 unless combine_format is 1 (bf16)",
                   DtypeName(y->element_type()));
  const LayerKey key = KeyOf(at, x.element_type(), h, i, el, apply_topk_in_fc1, has_clamp, gate_up_clamp,
                             intermediate_format, combine_format, backward_operand_format);
  LayerSlot* slot = nullptr;
  std::unique_lock<std::mutex> lock;
  MOE_EP_FFI_TRY(Cache().Acquire(kT, key, c, /*backward=*/false, at.may_create, &slot, &lock));
  if (!execute) return ffi::Error::Success();
  return FromStatus(kT, moe_ep_layer_experts_forward(
      slot->layer, at.dev.stream, c, DataOrNull(x), static_cast<const float*>(DataOrNull(w)), DataOrNull(fc1),
      DataOrNull(fc2), static_cast<const int32_t*>(DataOrNull(group_sizes)), DataOrNull(*y),
      no_stash ? nullptr : static_cast<uint16_t*>(DataOrNull(*fc1_c))));
}

template <typename B>
auto BindExpertForward(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()             // x [C, H] f32 or bf16: input rows, expert-major (padding rows zero)
      .template Arg<ffi::Buffer<ffi::F32>>()      // w [C] f32: router weight of every row (0 in padding)
      .template Arg<ffi::AnyBuffer>()             // fc1 [E_local, H, 2I] x's dtype (gate 0..I-1, up I..2I-1)
      .template Arg<ffi::AnyBuffer>()             // fc2 [E_local, I, H] x's dtype
      .template Arg<ffi::Buffer<ffi::S32>>()      // group_sizes [E_local] s32: slab sizes, each >= 0, sum <= C
      .template Ret<ffi::AnyBuffer>()             // y [C, H] f32 (bf16 when combine_format is 1): expert output,
                                                  // after combine_format's round trip
      .template Ret<ffi::Buffer<ffi::BF16>>()     // fc1_c [C, 2I] bf16: the stash (bf16 of the pre-clamp FC1 output);
                                                  // [0, 2I]: none asked for, none written
      .template Attr<bool>("apply_topk_in_fc1")   // true: y = R_int(w*h) W2; false: y = w * (R_int(h) W2)
      .template Attr<bool>("has_clamp")           // the SwiGLU clamp
      .template Attr<float>("gate_up_clamp")      // its limit L > 0, finite (ignored without has_clamp)
      .template Attr<int32_t>("intermediate_format")  // R_int along I: 0 none, 1 bf16, 2 mxfp8, 3 nvfp4
      .template Attr<int32_t>("combine_format")   // the round trip of y along H: 0 none (the jax layer's), 1..3
      .template Attr<int32_t>("backward_operand_format");  // the backward's (0 exact, 1 bf16): one layer for both
}

ffi::Error ExpertBackward(Where at, bool execute, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> w, ffi::AnyBuffer fc1,
                          ffi::AnyBuffer fc2, ffi::Buffer<ffi::BF16> fc1_c, ffi::AnyBuffer dy,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::Buffer<ffi::F32>> dx,
                          ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::Result<ffi::AnyBuffer> dfc1,
                          ffi::Result<ffi::AnyBuffer> dfc2, bool apply_topk_in_fc1, bool has_clamp,
                          float gate_up_clamp, int32_t intermediate_format, int32_t combine_format,
                          int32_t backward_operand_format) {
  constexpr const char* kT = "moe_ep_expert_backward";
  int64_t c, h, i, el;
  MOE_EP_FFI_TRY(ExpertShapes(kT, x.dimensions(), w.dimensions(), fc1.dimensions(), fc2.dimensions(),
                              group_sizes.dimensions(), &c, &h, &i, &el));
  MOE_EP_FFI_TRY(ExpectOperandDtypes(kT, x.element_type(), fc1.element_type(), fc2.element_type()));
  MOE_EP_FFI_TRY(ExpectShape(kT, "fc1_c", "[C, 2I]", fc1_c.dimensions(), {c, 2 * i}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "dy", "[C, H]", dy.dimensions(), {c, h}));
  if (dy.element_type() != ffi::DataType::F32 && dy.element_type() != ffi::DataType::BF16)
    return Invalid(kT, std::string("dy must have dtype ") + kOperandDtypes, DtypeName(dy.element_type()));
  MOE_EP_FFI_TRY(ExpectShape(kT, "dx", "[C, H]", dx->dimensions(), {c, h}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "dw", "[C]", dw->dimensions(), {c}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "dfc1", "[E_local, H, 2I]", dfc1->dimensions(), {el, h, 2 * i}));
  MOE_EP_FFI_TRY(ExpectShape(kT, "dfc2", "[E_local, I, H]", dfc2->dimensions(), {el, i, h}));
  // The weight gradients: f32, or bf16 with bf16 operands (the float32 gradients rounded to
  // nearest even by the native layer, MOE_EP_BACKWARD_WEIGHT_GRADS_BF16: no cast pass).
  const bool bf16_grads = dfc1->element_type() == ffi::DataType::BF16;
  const ffi::DataType grad_dtype = bf16_grads ? ffi::DataType::BF16 : ffi::DataType::F32;
  if ((dfc1->element_type() != ffi::DataType::F32 && !bf16_grads) || dfc2->element_type() != grad_dtype)
    return Invalid(kT, "dfc1 and dfc2 must both have dtype f32, or both bf16",
                   std::string(DtypeName(dfc1->element_type())) + " and " + DtypeName(dfc2->element_type()));
  if (bf16_grads && x.element_type() != ffi::DataType::BF16)
    return Invalid(kT, "bf16 dfc1 and dfc2 need bf16 operands (x, fc1, fc2)", DtypeName(x.element_type()));
  MOE_EP_FFI_TRY(ExpectFormatAttr(kT, intermediate_format));
  MOE_EP_FFI_TRY(ExpectFormatAttr(kT, combine_format, "combine_format"));
  if (backward_operand_format != MOE_EP_FORMAT_NONE && backward_operand_format != MOE_EP_FORMAT_BF16)
    return Invalid(kT, "backward_operand_format must be 0 (exact) or 1 (bf16)", std::to_string(backward_operand_format));
  const LayerKey key = KeyOf(at, x.element_type(), h, i, el, apply_topk_in_fc1, has_clamp, gate_up_clamp,
                             intermediate_format, combine_format, backward_operand_format);
  LayerSlot* slot = nullptr;
  std::unique_lock<std::mutex> lock;
  MOE_EP_FFI_TRY(Cache().Acquire(kT, key, c, /*backward=*/true, at.may_create, &slot, &lock));
  if (!execute) return ffi::Error::Success();
  return FromStatus(kT, moe_ep_layer_experts_backward_ex(
      slot->layer, at.dev.stream, c, DataOrNull(x), static_cast<const float*>(DataOrNull(w)), DataOrNull(fc1),
      DataOrNull(fc2), static_cast<const uint16_t*>(DataOrNull(fc1_c)), DataOrNull(dy),
      OperandDtype(dy.element_type()), static_cast<const int32_t*>(DataOrNull(group_sizes)),
      static_cast<float*>(DataOrNull(*dx)), static_cast<float*>(DataOrNull(*dw)), DataOrNull(*dfc1),
      DataOrNull(*dfc2), bf16_grads ? MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 : 0));
}

template <typename B>
auto BindExpertBackward(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()             // x [C, H] f32 or bf16: input rows (as the forward's)
      .template Arg<ffi::Buffer<ffi::F32>>()      // w [C] f32: router weights
      .template Arg<ffi::AnyBuffer>()             // fc1 [E_local, H, 2I] x's dtype
      .template Arg<ffi::AnyBuffer>()             // fc2 [E_local, I, H] x's dtype
      .template Arg<ffi::Buffer<ffi::BF16>>()     // fc1_c [C, 2I] bf16: the stash (pre-clamp FC1 output)
      .template Arg<ffi::AnyBuffer>()             // dy [C, H] f32 or bf16: output cotangent of every row
      .template Arg<ffi::Buffer<ffi::S32>>()      // group_sizes [E_local] s32: slab sizes
      .template Ret<ffi::Buffer<ffi::F32>>()      // dx [C, H] f32
      .template Ret<ffi::Buffer<ffi::F32>>()      // dw [C] f32
      .template Ret<ffi::AnyBuffer>()             // dfc1 [E_local, H, 2I] f32, or bf16 with bf16 operands (the f32
                                                  // gradient rounded to nearest even); zero for an expert with no rows
      .template Ret<ffi::AnyBuffer>()             // dfc2 [E_local, I, H] as dfc1
      .template Attr<bool>("apply_topk_in_fc1")   // as the forward's
      .template Attr<bool>("has_clamp")           // as the forward's
      .template Attr<float>("gate_up_clamp")      // as the forward's
      .template Attr<int32_t>("intermediate_format")  // as the forward's (straight-through: not applied backward)
      .template Attr<int32_t>("combine_format")   // as the forward's (one layer object for both stages)
      .template Attr<int32_t>("backward_operand_format");  // the operands: 0 exact float32, 1 R_bf16 of dY, dc, w*h
}

// The expert stages' handlers: the CPU one (host buffers; the ordinal keeps
// XLA:CPU's virtual devices, which run concurrently, on separate layers) and,
// in a CUDA build, CUDA's initialize and execute handlers.
template <typename Impl>
auto StageOnCpu(Impl impl) {
  return [impl](int32_t ordinal, auto... args) -> ffi::Error {
    return impl(Where{Dev{MOE_EP_DEVICE_CPU, nullptr}, ordinal, true}, true, std::move(args)...);
  };
}

// ----------------------------------------------------------------------------- device wrappers

// The CPU handler of an implementation: host pointers, no stream.
template <typename Impl>
auto OnCpu(Impl impl) {
  return [impl](auto... args) -> ffi::Error {
    return impl(Dev{MOE_EP_DEVICE_CPU, nullptr}, std::move(args)...);
  };
}

#ifdef MOE_EP_NATIVE_WITH_CUDA
// The CUDA handler of an implementation: device pointers, XLA's stream.
template <typename Impl>
auto OnCuda(Impl impl) {
  return [impl](cudaStream_t stream, auto... args) -> ffi::Error {
    return impl(Dev{MOE_EP_DEVICE_CUDA, static_cast<void*>(stream)}, std::move(args)...);
  };
}

// Whether `stream` is being captured into a CUDA graph (then nothing may be allocated).
bool Capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

// CUDA's initialize stage: makes (or grows) the layer before XLA runs or
// captures the program; runs nothing.
template <typename Impl>
auto StageInitCuda(Impl impl) {
  return [impl](cudaStream_t stream, int32_t ordinal, auto... args) -> ffi::Error {
    return impl(Where{Dev{MOE_EP_DEVICE_CUDA, static_cast<void*>(stream)}, ordinal, !Capturing(stream)}, false,
                std::move(args)...);
  };
}

// CUDA's execute stage: the layer's stage on XLA's stream (enqueue only).
template <typename Impl>
auto StageOnCuda(Impl impl) {
  return [impl](cudaStream_t stream, int32_t ordinal, auto... args) -> ffi::Error {
    return impl(Where{Dev{MOE_EP_DEVICE_CUDA, static_cast<void*>(stream)}, ordinal, !Capturing(stream)}, true,
                std::move(args)...);
  };
}
#endif

}  // namespace
}  // namespace moe_ep_ffi

// ----------------------------------------------------------------------------- handler symbols

namespace mf = moe_ep_ffi;

#define MOE_EP_CPU_BIND(B) mf::B(ffi::Ffi::Bind())
#define MOE_EP_CUDA_BIND(B) mf::B(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpQuantizeCpu, mf::OnCpu(mf::Quantize), MOE_EP_CPU_BIND(BindQuantize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpDequantizeCpu, mf::OnCpu(mf::Dequantize), MOE_EP_CPU_BIND(BindDequantize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpDequantizeBf16Cpu, mf::OnCpu(mf::DequantizeBf16), MOE_EP_CPU_BIND(BindDequantizeBf16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpDequantizeBf16GatherCpu, mf::OnCpu(mf::DequantizeBf16Gather),
                              MOE_EP_CPU_BIND(BindDequantizeBf16Gather));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpPlanRoutesCpu, mf::OnCpu(mf::PlanRoutes), MOE_EP_CPU_BIND(BindPlanRoutes));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpPermuteRowsCpu, mf::OnCpu(mf::PermuteRows), MOE_EP_CPU_BIND(BindPermuteRows));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpCombineReduceCpu, mf::OnCpu(mf::CombineReduce), MOE_EP_CPU_BIND(BindCombineReduce));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpCombineReduceEncodeCpu, mf::OnCpu(mf::CombineReduceEncode),
                              MOE_EP_CPU_BIND(BindCombineReduceEncode));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpSlotSumCpu, mf::OnCpu(mf::SlotSum), MOE_EP_CPU_BIND(BindSlotSum));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpPoisonCpu, mf::OnCpu(mf::Poison), MOE_EP_CPU_BIND(BindPoison));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpZeroRowsCpu, mf::OnCpu(mf::ZeroRows), MOE_EP_CPU_BIND(BindZeroRows));
#define MOE_EP_CPU_STAGE_BIND(B) mf::B(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>())
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpExpertForwardCpu, mf::StageOnCpu(mf::ExpertForward),
                              MOE_EP_CPU_STAGE_BIND(BindExpertForward));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpExpertBackwardCpu, mf::StageOnCpu(mf::ExpertBackward),
                              MOE_EP_CPU_STAGE_BIND(BindExpertBackward));

#ifdef MOE_EP_NATIVE_WITH_CUDA
#define MOE_EP_CMD_BUFFER {ffi::Traits::kCmdBufferCompatible}
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpQuantizeCuda, mf::OnCuda(mf::Quantize), MOE_EP_CUDA_BIND(BindQuantize),
                              MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpDequantizeCuda, mf::OnCuda(mf::Dequantize), MOE_EP_CUDA_BIND(BindDequantize),
                              MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpDequantizeBf16Cuda, mf::OnCuda(mf::DequantizeBf16),
                              MOE_EP_CUDA_BIND(BindDequantizeBf16), MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpDequantizeBf16GatherCuda, mf::OnCuda(mf::DequantizeBf16Gather),
                              MOE_EP_CUDA_BIND(BindDequantizeBf16Gather), MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpPlanRoutesCuda, mf::OnCuda(mf::PlanRoutes), MOE_EP_CUDA_BIND(BindPlanRoutes),
                              MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpPermuteRowsCuda, mf::OnCuda(mf::PermuteRows), MOE_EP_CUDA_BIND(BindPermuteRows),
                              MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpCombineReduceCuda, mf::OnCuda(mf::CombineReduce),
                              MOE_EP_CUDA_BIND(BindCombineReduce), MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpCombineReduceEncodeCuda, mf::OnCuda(mf::CombineReduceEncode),
                              MOE_EP_CUDA_BIND(BindCombineReduceEncode), MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpSlotSumCuda, mf::OnCuda(mf::SlotSum), MOE_EP_CUDA_BIND(BindSlotSum),
                              MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpPoisonCuda, mf::OnCuda(mf::Poison), MOE_EP_CUDA_BIND(BindPoison),
                              MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpZeroRowsCuda, mf::OnCuda(mf::ZeroRows), MOE_EP_CUDA_BIND(BindZeroRows),
                              MOE_EP_CMD_BUFFER);
// The expert stages: an initialize handler (makes the layer object before any
// capture) and the execute handler (enqueues the stage; command-buffer
// compatible: no allocation, no synchronisation, the layer's workspaces fixed).
#define MOE_EP_CUDA_STAGE_BIND(B, STAGE) \
  mf::B(ffi::Ffi::Bind<STAGE>().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>())
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpExpertForwardCudaInit, mf::StageInitCuda(mf::ExpertForward),
                              MOE_EP_CUDA_STAGE_BIND(BindExpertForward, ffi::ExecutionStage::kInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpExpertForwardCuda, mf::StageOnCuda(mf::ExpertForward),
                              MOE_EP_CUDA_STAGE_BIND(BindExpertForward, ffi::ExecutionStage::kExecute),
                              MOE_EP_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpExpertBackwardCudaInit, mf::StageInitCuda(mf::ExpertBackward),
                              MOE_EP_CUDA_STAGE_BIND(BindExpertBackward, ffi::ExecutionStage::kInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeEpExpertBackwardCuda, mf::StageOnCuda(mf::ExpertBackward),
                              MOE_EP_CUDA_STAGE_BIND(BindExpertBackward, ffi::ExecutionStage::kExecute),
                              MOE_EP_CMD_BUFFER);
#endif

// ----------------------------------------------------------------------------- the Python module

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#ifdef MOE_EP_NATIVE_WITH_CUDA
// {stage: capsule} for jax.ffi.register_ffi_target: a handler bundle.
template <typename I, typename E>
nb::dict Bundle(I* initialize, E* execute) {
  nb::dict d;
  d["initialize"] = Capsule(initialize);
  d["execute"] = Capsule(execute);
  return d;
}
#endif

// Every layer object the expert handlers have made in this process.
nb::list LayerCacheInfo() {
  nb::list out;
  for (const mf::LayerRecord& r : mf::Cache().Records()) {
    nb::dict d;
    d["device"] = r.key.device == MOE_EP_DEVICE_CUDA ? "cuda" : "cpu";
    d["ordinal"] = r.key.ordinal;
    d["operand_dtype"] = r.key.dtype == MOE_EP_DTYPE_BF16 ? "bfloat16" : "float32";
    d["hidden"] = r.key.hidden;
    d["intermediate"] = r.key.intermediate;
    d["num_local_experts"] = r.key.experts;
    d["intermediate_format"] = r.key.intermediate_format;
    d["combine_format"] = r.key.combine_format;
    d["backward_operand_format"] = r.key.backward_operand_format;
    d["max_rows"] = r.max_rows;
    d["with_backward"] = r.with_backward;
    d["live"] = r.live;
    d["tensor_cores"] = r.info.tensor_cores != 0;
    d["fc2_operand_planes"] = r.info.fc2_operand_planes;
    d["workspace_bytes"] = r.info.workspace_bytes;
    out.append(d);
  }
  return out;
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "XLA FFI handlers over the MoeEp native C ABI (moe_ep_native.h); see docs/jax-ffi.md";

  m.def(
      "registrations",
      [](const std::string& platform) {
        nb::dict d;
        if (platform == "cpu") {
          d["moe_ep_quantize"] = Capsule(MoeEpQuantizeCpu);
          d["moe_ep_dequantize"] = Capsule(MoeEpDequantizeCpu);
          d["moe_ep_dequantize_bf16"] = Capsule(MoeEpDequantizeBf16Cpu);
          d["moe_ep_dequantize_bf16_gather"] = Capsule(MoeEpDequantizeBf16GatherCpu);
          d["moe_ep_plan_routes"] = Capsule(MoeEpPlanRoutesCpu);
          d["moe_ep_permute_rows"] = Capsule(MoeEpPermuteRowsCpu);
          d["moe_ep_combine_reduce"] = Capsule(MoeEpCombineReduceCpu);
          d["moe_ep_combine_reduce_encode"] = Capsule(MoeEpCombineReduceEncodeCpu);
          d["moe_ep_slot_sum"] = Capsule(MoeEpSlotSumCpu);
          d["moe_ep_poison"] = Capsule(MoeEpPoisonCpu);
          d["moe_ep_zero_rows"] = Capsule(MoeEpZeroRowsCpu);
          d["moe_ep_expert_forward"] = Capsule(MoeEpExpertForwardCpu);
          d["moe_ep_expert_backward"] = Capsule(MoeEpExpertBackwardCpu);
        }
#ifdef MOE_EP_NATIVE_WITH_CUDA
        if (platform == "CUDA") {
          d["moe_ep_quantize"] = Capsule(MoeEpQuantizeCuda);
          d["moe_ep_dequantize"] = Capsule(MoeEpDequantizeCuda);
          d["moe_ep_dequantize_bf16"] = Capsule(MoeEpDequantizeBf16Cuda);
          d["moe_ep_dequantize_bf16_gather"] = Capsule(MoeEpDequantizeBf16GatherCuda);
          d["moe_ep_plan_routes"] = Capsule(MoeEpPlanRoutesCuda);
          d["moe_ep_permute_rows"] = Capsule(MoeEpPermuteRowsCuda);
          d["moe_ep_combine_reduce"] = Capsule(MoeEpCombineReduceCuda);
          d["moe_ep_combine_reduce_encode"] = Capsule(MoeEpCombineReduceEncodeCuda);
          d["moe_ep_slot_sum"] = Capsule(MoeEpSlotSumCuda);
          d["moe_ep_poison"] = Capsule(MoeEpPoisonCuda);
          d["moe_ep_zero_rows"] = Capsule(MoeEpZeroRowsCuda);
          d["moe_ep_expert_forward"] = Bundle(MoeEpExpertForwardCudaInit, MoeEpExpertForwardCuda);
          d["moe_ep_expert_backward"] = Bundle(MoeEpExpertBackwardCudaInit, MoeEpExpertBackwardCuda);
        }
#endif
        return d;
      },
      nb::arg("platform") = "cpu",
      "{target name: handler capsule} for jax.ffi.register_ffi_target on `platform` ('cpu' or 'CUDA'; empty when "
      "this build has no handlers for it)");
  m.def("platforms", []() {
    nb::list l;
    l.append("cpu");
#ifdef MOE_EP_NATIVE_WITH_CUDA
    l.append("CUDA");
#endif
    return l;
  }, "The platforms this build has handlers for.");
  m.def("abi_version", []() { return moe_ep_abi_version(); }, "MOE_EP_NATIVE_ABI_VERSION of the linked core.");
  m.attr("HEADER_ABI_VERSION") = MOE_EP_NATIVE_ABI_VERSION;
  m.def("has_cuda", []() { return moe_ep_has_cuda() != 0; }, "Whether the core was built with CUDA.");
  m.def("build_info", []() { return std::string(moe_ep_build_info()); }, "The core's version, compiler and CUDA archs.");
  m.def("layer_cache_info", &LayerCacheInfo,
        "One dict per layer object (moe_ep_layer) the expert handlers made in this process, in the order made: "
        "device, ordinal, operand_dtype, hidden, intermediate, num_local_experts, intermediate_format, "
        "combine_format, backward_operand_format, max_rows, "
        "with_backward, live (False once a larger layer replaced it), tensor_cores, fc2_operand_planes, "
        "workspace_bytes.");
}
