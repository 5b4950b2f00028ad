// The layer object (moe_ep_layer_*, include/moe_ep_native.h): one rank's expert
// computation for one configuration on one device, its workspaces allocated
// once at creation.
//
// Two paths behind the same stages:
// - tensor cores (CUDA, bf16 operands, this build with the CUTLASS grouped GEMMs,
//   an sm_90 device and a supported shape): cuda/layer_tc.cu;
// - staged (every other case, and the CPU implementation that CI tests): the
//   operands decoded to float32 into the layer's buffers, the float32 expert
//   kernels of the implementation (moe_ep_expert_forward/backward), the stash
//   encoded with moe_ep_quantize and the combine round trip applied in place.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <new>
#include <string>
#include <tuple>

#include "cpu/fpenv.h"
#include "exchange.h"
#include "internal.h"

struct moe_ep_layer {
  moe_ep_layer_config cfg;  // normalised: struct_size = sizeof(moe_ep_layer_config)
  moe_ep_expert_desc desc;  // num_rows = cfg.max_rows
  bool tensor_cores = false;
  int planes = 0;
  void* buffer = nullptr;  // the one allocation (host or device memory)
  size_t bytes = 0;
  // Staged path: pieces of `buffer`.
  float* x32 = nullptr;       // [C, H] (bf16 operands only)
  float* fc1_32 = nullptr;    // [E, H, 2I] (bf16 operands only)
  float* fc2_32 = nullptr;    // [E, I, H] (bf16 operands only)
  float* c32 = nullptr;       // [C, 2I] the FC1 output
  float* dy32 = nullptr;      // [C, H] a bf16 cotangent in float32 (with_backward)
  float* y32 = nullptr;       // [C, H] the float32 expert output (bf16 expert_out_dtype only)
  void* expert_ws = nullptr;  // max(forward, backward) expert workspace
  uint8_t* rt_data = nullptr;   // [C, H] codes of the combine round trip (CPU)
  uint8_t* rt_scale = nullptr;  // [C, ceil(H/16)] scales of it (CPU)
#ifdef MOE_EP_NATIVE_WITH_CUDA
  moe_ep::cuda::TcWorkspace tc{};
#endif
  moe_ep::Exchange* ex = nullptr;  // the device exchange (exchange.cc), when config.ex_num_ranks >= 1
};

namespace moe_ep {
namespace {

bool is_cuda(const moe_ep_layer* l) { return l->cfg.device == MOE_EP_DEVICE_CUDA; }

// Carves the staged path's pieces (base NULL: sizes only); returns the bytes.
size_t staged_layout(moe_ep_layer* l, char* base) {
  const moe_ep_expert_desc& d = l->desc;
  const size_t C = static_cast<size_t>(d.num_rows), H = static_cast<size_t>(d.hidden),
               I = static_cast<size_t>(d.intermediate), E = static_cast<size_t>(d.num_local_experts);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    char* p = base ? base + at : nullptr;
    at += align256(bytes);
    return p;
  };
  const bool bf16 = l->cfg.operand_dtype == MOE_EP_DTYPE_BF16;
  l->x32 = bf16 ? reinterpret_cast<float*>(take(C * H * sizeof(float))) : nullptr;
  l->fc1_32 = bf16 ? reinterpret_cast<float*>(take(E * H * 2 * I * sizeof(float))) : nullptr;
  l->fc2_32 = bf16 ? reinterpret_cast<float*>(take(E * I * H * sizeof(float))) : nullptr;
  l->c32 = reinterpret_cast<float*>(take(C * 2 * I * sizeof(float)));
  l->dy32 = l->cfg.with_backward ? reinterpret_cast<float*>(take(C * H * sizeof(float))) : nullptr;
  l->y32 = l->cfg.expert_out_dtype == MOE_EP_DTYPE_BF16 ? reinterpret_cast<float*>(take(C * H * sizeof(float)))
                                                         : nullptr;
  size_t ws = forward_workspace_bytes(d);
  if (l->cfg.with_backward) ws = std::max(ws, backward_workspace_bytes(d));
  l->expert_ws = take(ws);
  if (!is_cuda(l) && l->cfg.combine_format != MOE_EP_FORMAT_NONE) {
    l->rt_data = reinterpret_cast<uint8_t*>(take(C * H * 2));
    l->rt_scale = reinterpret_cast<uint8_t*>(take(C * static_cast<size_t>(ceil_div(static_cast<int64_t>(H), 16))));
  }
  return at;
}

moe_ep_status alloc(moe_ep_layer* l, size_t bytes) {
  l->bytes = bytes;
  if (bytes == 0) return MOE_EP_OK;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (is_cuda(l)) return cuda::device_alloc(l->cfg.cuda_device, bytes, &l->buffer);
#endif
  l->buffer = std::aligned_alloc(256, align256(bytes));
  if (l->buffer == nullptr)
    return fail(MOE_EP_ERR_INTERNAL, "moe_ep_layer_create: out of host memory (" + std::to_string(bytes) + " bytes)");
  std::memset(l->buffer, 0, align256(bytes));  // once, at creation: nothing reads unwritten memory
  return MOE_EP_OK;
}

moe_ep_status release(moe_ep_layer* l) {
  if (l->buffer == nullptr) return MOE_EP_OK;
  void* p = l->buffer;
  l->buffer = nullptr;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (is_cuda(l)) return cuda::device_free(p);
#endif
  std::free(p);
  return MOE_EP_OK;
}

// The configuration as this library knows it: struct_size bytes of the caller's,
// the rest zero; a larger struct must hold only zeros past ours.
moe_ep_status read_config(const Check& ck, const moe_ep_layer_config* in, moe_ep_layer_config* out) {
  if (in == nullptr) return ck.bad("config must not be NULL", "NULL");
  const size_t size = in->struct_size;
  constexpr size_t kFirst = sizeof(uint32_t);
  if (size < kFirst + sizeof(int32_t))
    return ck.bad("config->struct_size must be sizeof(moe_ep_layer_config) = " +
                      std::to_string(sizeof(moe_ep_layer_config)) + " (MOE_EP_LAYER_CONFIG_INIT sets it)",
                  std::to_string(size));
  std::memset(out, 0, sizeof *out);
  std::memcpy(out, in, std::min(size, sizeof *out));
  if (size > sizeof *out) {
    const unsigned char* extra = reinterpret_cast<const unsigned char*>(in) + sizeof *out;
    for (size_t i = 0; i < size - sizeof *out; ++i)
      if (extra[i] != 0)
        return fail(MOE_EP_ERR_UNSUPPORTED,
                    std::string(ck.op) + ": config->struct_size is " + std::to_string(size) +
                        " and the fields past this library's " + std::to_string(sizeof *out) +
                        " bytes are set; this library is older than the caller's header (rebuild it)");
  }
  out->struct_size = sizeof *out;
  return MOE_EP_OK;
}

moe_ep_status check_config(const Check& ck, const moe_ep_layer_config& c) {
  if (c.device != MOE_EP_DEVICE_CPU && c.device != MOE_EP_DEVICE_CUDA)
    return ck.bad("config->device must be MOE_EP_DEVICE_CPU (0) or MOE_EP_DEVICE_CUDA (1)", std::to_string(c.device));
#ifndef MOE_EP_NATIVE_WITH_CUDA
  if (c.device == MOE_EP_DEVICE_CUDA)
    return fail(MOE_EP_ERR_UNSUPPORTED, std::string(ck.op) +
                                            ": this build of the native core has no CUDA implementation "
                                            "(rebuild with MOE_EP_NATIVE_CUDA=ON)");
#endif
  if (c.device == MOE_EP_DEVICE_CUDA) MOE_EP_TRY(ck.nonneg("config->cuda_device", c.cuda_device));
  if (c.operand_dtype != MOE_EP_DTYPE_F32 && c.operand_dtype != MOE_EP_DTYPE_BF16)
    return ck.bad("config->operand_dtype must be MOE_EP_DTYPE_F32 (0) or MOE_EP_DTYPE_BF16 (1)",
                  std::to_string(c.operand_dtype));
  if (c.combine_format < MOE_EP_FORMAT_NONE || c.combine_format > MOE_EP_FORMAT_NVFP4)
    return ck.bad("config->combine_format must be a moe_ep_format (0 NONE, 1 BF16, 2 MXFP8, 3 NVFP4)",
                  std::to_string(c.combine_format));
  if (c.with_backward != 0 && c.with_backward != 1)
    return ck.bad("config->with_backward must be 0 or 1", std::to_string(c.with_backward));
  if (c.expert_out_dtype != MOE_EP_DTYPE_F32 && c.expert_out_dtype != MOE_EP_DTYPE_BF16)
    return ck.bad("config->expert_out_dtype must be MOE_EP_DTYPE_F32 (0) or MOE_EP_DTYPE_BF16 (1)",
                  std::to_string(c.expert_out_dtype));
  if (c.expert_out_dtype == MOE_EP_DTYPE_BF16 && c.combine_format != MOE_EP_FORMAT_BF16 &&
      c.combine_format != MOE_EP_FORMAT_NVFP4)
    return ck.bad("config->combine_format must be MOE_EP_FORMAT_BF16 (1) or MOE_EP_FORMAT_NVFP4 (3) when "
                  "config->expert_out_dtype is MOE_EP_DTYPE_BF16 (only then are the expert-output rows bf16 values)",
                  std::to_string(c.combine_format));
  if (c.expert_out_dtype == MOE_EP_DTYPE_BF16 && c.combine_format == MOE_EP_FORMAT_NVFP4 && c.hidden % 16 != 0)
    return ck.bad("config->hidden must be a multiple of 16 (whole nvfp4 blocks in a row) when "
                  "config->expert_out_dtype is MOE_EP_DTYPE_BF16 with combine_format MOE_EP_FORMAT_NVFP4",
                  std::to_string(c.hidden));
  if (c.backward_operand_format != MOE_EP_FORMAT_NONE && c.backward_operand_format != MOE_EP_FORMAT_BF16)
    return ck.bad("config->backward_operand_format must be MOE_EP_FORMAT_NONE (0: exact float32 operands) or "
                  "MOE_EP_FORMAT_BF16 (1)",
                  std::to_string(c.backward_operand_format));
  if (c.reserved1 != 0) return ck.bad("config->reserved1 must be 0", std::to_string(c.reserved1));
  moe_ep_expert_desc d{c.max_rows, c.hidden, c.intermediate, c.num_local_experts, c.apply_topk_in_fc1,
                       c.has_clamp, c.gate_up_clamp, c.intermediate_format};
  MOE_EP_TRY(check_desc(ck, &d));
  return exchange_check_config(ck, c);
}

moe_ep_status check_layer(const Check& ck, const moe_ep_layer* l, void* stream, int64_t num_rows) {
  if (l == nullptr) return ck.bad("layer must not be NULL", "NULL");
  if (!is_cuda(l) && stream != nullptr) return ck.bad("stream must be NULL for a CPU layer", "a non-NULL stream");
  MOE_EP_TRY(ck.nonneg("num_rows", num_rows));
  if (num_rows > l->desc.num_rows)
    return ck.bad("num_rows must be <= the layer's max_rows = " + std::to_string(l->desc.num_rows) +
                      " (make a larger layer)",
                  std::to_string(num_rows));
  return MOE_EP_OK;
}

moe_ep_status check_operands(const Check& ck, const moe_ep_layer* l, int64_t C, const void* x, const float* w,
                             const void* fc1, const void* fc2, const int32_t* group_sizes) {
  const moe_ep_expert_desc& d = l->desc;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_local_experts;
  const size_t el = l->cfg.operand_dtype == MOE_EP_DTYPE_BF16 ? 2 : 4;
  MOE_EP_TRY(ck.ptr("x", x, C * H, el));
  MOE_EP_TRY(ck.ptr("w", w, C, 4));
  MOE_EP_TRY(ck.ptr("fc1", fc1, E * H * 2 * I, el));
  MOE_EP_TRY(ck.ptr("fc2", fc2, E * I * H, el));
  return ck.ptr("group_sizes", group_sizes, E, 4);
}

// The implementation of the layer's device.
#ifdef MOE_EP_NATIVE_WITH_CUDA
#define MOE_EP_LAYER_IMPL(l, call) (is_cuda(l) ? ::moe_ep::cuda::call : ::moe_ep::cpu::call)
#else
#define MOE_EP_LAYER_IMPL(l, call) (::moe_ep::cpu::call)
#endif

// bf16 operands to float32 (exact) into the layer's buffers; returns the float32 views.
moe_ep_status stage_operands(moe_ep_layer* l, void* stream, int64_t C, const void* x, const void* fc1, const void* fc2,
                             const float** x32, const float** fc1_32, const float** fc2_32) {
  if (l->cfg.operand_dtype == MOE_EP_DTYPE_F32) {
    *x32 = static_cast<const float*>(x);
    *fc1_32 = static_cast<const float*>(fc1);
    *fc2_32 = static_cast<const float*>(fc2);
    return MOE_EP_OK;
  }
  const moe_ep_expert_desc& d = l->desc;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_local_experts;
  if (C > 0) MOE_EP_TRY(MOE_EP_LAYER_IMPL(l, dequantize(stream, MOE_EP_FORMAT_BF16, x, nullptr, C, H, 1, l->x32)));
  MOE_EP_TRY(MOE_EP_LAYER_IMPL(l, dequantize(stream, MOE_EP_FORMAT_BF16, fc1, nullptr, E, H * 2 * I, 1, l->fc1_32)));
  MOE_EP_TRY(MOE_EP_LAYER_IMPL(l, dequantize(stream, MOE_EP_FORMAT_BF16, fc2, nullptr, E, I * H, 1, l->fc2_32)));
  *x32 = l->x32;
  *fc1_32 = l->fc1_32;
  *fc2_32 = l->fc2_32;
  return MOE_EP_OK;
}

moe_ep_status round_trip_y(moe_ep_layer* l, void* stream, moe_ep_format f, float* y, int64_t C, int64_t H);

// The staged forward on float32 operands (staged already).
moe_ep_status staged_forward_f32(moe_ep_layer* l, void* stream, int64_t C, const float* x32, const float* w,
                                 const float* fc1_32, const float* fc2_32, const int32_t* group_sizes, void* y_out,
                                 uint16_t* fc1_c) {
  moe_ep_expert_desc d = l->desc;
  d.num_rows = C;
  const int64_t H = d.hidden, I = d.intermediate;
  const bool bf16_out = l->cfg.expert_out_dtype == MOE_EP_DTYPE_BF16;
  float* y = bf16_out ? l->y32 : static_cast<float*>(y_out);
  MOE_EP_TRY(MOE_EP_LAYER_IMPL(l, expert_forward(stream, d, x32, w, fc1_32, fc2_32, group_sizes, y, l->c32,
                                                 l->expert_ws)));
  if (C == 0) return MOE_EP_OK;
  if (fc1_c != nullptr)
    MOE_EP_TRY(MOE_EP_LAYER_IMPL(l, quantize(stream, MOE_EP_FORMAT_BF16, l->c32, C, 2 * I, 1, fc1_c, nullptr)));
  // bf16 rows (combine_format bf16): the bf16 encoding is the round trip itself; nvfp4's
  // values after its round trip are bf16 values, encoded exactly.
  const moe_ep_format f = static_cast<moe_ep_format>(l->cfg.combine_format);
  if (bf16_out && f == MOE_EP_FORMAT_BF16)
    return MOE_EP_LAYER_IMPL(l, quantize(stream, MOE_EP_FORMAT_BF16, y, C, H, 1, y_out, nullptr));
  if (f == MOE_EP_FORMAT_NONE) return MOE_EP_OK;
  MOE_EP_TRY(round_trip_y(l, stream, f, y, C, H));
  if (bf16_out) return MOE_EP_LAYER_IMPL(l, quantize(stream, MOE_EP_FORMAT_BF16, y, C, H, 1, y_out, nullptr));
  return MOE_EP_OK;
}

moe_ep_status staged_forward(moe_ep_layer* l, void* stream, int64_t C, const void* x, const float* w, const void* fc1,
                             const void* fc2, const int32_t* group_sizes, void* y_out, uint16_t* fc1_c) {
  const float *x32, *fc1_32, *fc2_32;
  MOE_EP_TRY(stage_operands(l, stream, C, x, fc1, fc2, &x32, &fc1_32, &fc2_32));
  return staged_forward_f32(l, stream, C, x32, w, fc1_32, fc2_32, group_sizes, y_out, fc1_c);
}

// R_comb of the float32 rows y in place (rows of no expert are zero and stay zero).
moe_ep_status round_trip_y(moe_ep_layer* l, void* stream, moe_ep_format f, float* y, int64_t C, int64_t H) {
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (is_cuda(l)) return cuda::round_trip_rows(stream, f, y, C, H);
#endif
  // CPU: quantize and decode back (rows of no expert are zero and stay zero).
  uint8_t* scale = f == MOE_EP_FORMAT_BF16 ? nullptr : l->rt_scale;
  MOE_EP_TRY(cpu::quantize(nullptr, f, y, C, H, 1, l->rt_data, scale));
  return cpu::dequantize(nullptr, f, l->rt_data, scale, C, H, 1, y);
}

moe_ep_status staged_backward(moe_ep_layer* l, void* stream, int64_t C, const void* x, const float* w, const void* fc1,
                              const void* fc2, const uint16_t* fc1_c, const void* dy, int32_t dy_dtype,
                              const int32_t* group_sizes, float* dx, float* dw, float* dfc1, float* dfc2,
                              const BackwardOptions& opt) {
  moe_ep_expert_desc d = l->desc;
  d.num_rows = C;
  const float *x32, *fc1_32, *fc2_32;
  MOE_EP_TRY(stage_operands(l, stream, C, x, fc1, fc2, &x32, &fc1_32, &fc2_32));
  const float* dyf = static_cast<const float*>(dy);
  if (dy_dtype == MOE_EP_DTYPE_BF16) {
    if (C > 0)
      MOE_EP_TRY(MOE_EP_LAYER_IMPL(l, dequantize(stream, MOE_EP_FORMAT_BF16, dy, nullptr, C, d.hidden, 1, l->dy32)));
    dyf = l->dy32;
  }
  return MOE_EP_LAYER_IMPL(l, expert_backward(stream, d, x32, w, fc1_32, fc2_32, fc1_c, dyf, group_sizes, dx, dw,
                                              dfc1, dfc2, l->expert_ws, opt));
}

// Runs body() with the CPU floating-point environment the kernels need, turning exceptions into statuses.
template <typename Fn>
moe_ep_status guarded(const moe_ep_layer* l, Fn body) {
  try {
    if (is_cuda(l)) return body();
    cpu::IeeeFpEnv fp_env;
    return body();
  } catch (const std::bad_alloc&) {
    return fail(MOE_EP_ERR_INTERNAL, "out of host memory");
  } catch (const std::exception& ex) {
    return fail(MOE_EP_ERR_INTERNAL, ex.what());
  }
}

#ifdef MOE_EP_NATIVE_WITH_CUDA
// Whether finish_forward runs its kernel after the experts forward (a CUDA layer with an
// exchange that has dispatched): then it also zeroes y's rows past the last slab.
bool tail_by_finish(const moe_ep_layer* l) { return is_cuda(l) && l->ex != nullptr && l->ex->last_tokens >= 0; }
#endif

// The experts' stages on the layer's path (tensor cores or staged), arguments checked.
// tail_deferred: as cuda::tc_forward's (set false on the other paths).
moe_ep_status experts_forward(moe_ep_layer* l, void* stream, int64_t C, const void* x, const float* w, const void* fc1,
                              const void* fc2, const int32_t* group_sizes, void* y, uint16_t* fc1_c,
                              bool* tail_deferred) {
  *tail_deferred = false;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (l->tensor_cores) {
    moe_ep_expert_desc d = l->desc;
    d.num_rows = C;
    cuda::TcWeights wt;
    wt.fc1 = static_cast<const uint16_t*>(fc1);
    wt.fc2 = static_cast<const uint16_t*>(fc2);
    return cuda::tc_forward(stream, d, l->cfg.combine_format, l->cfg.expert_out_dtype == MOE_EP_DTYPE_BF16,
                            static_cast<const uint16_t*>(x), w, wt, group_sizes, y, fc1_c, l->tc,
                            tail_by_finish(l) ? tail_deferred : nullptr);
  }
#endif
  return staged_forward(l, stream, C, x, w, fc1, fc2, group_sizes, y, fc1_c);
}

// moe_ep_layer_experts_forward_block_scaled on the layer's path: the tensor cores read the
// codes (CUDA); the staged path (CPU) decodes them to the values of their bf16 decode in its
// float32 buffers and runs the float32 kernels on x decoded from bf16, as experts_forward
// does with bf16 weights.
moe_ep_status experts_forward_block_scaled(moe_ep_layer* l, void* stream, int32_t fmt, int64_t C, const void* x,
                                           const float* w, const uint8_t* fc1_codes, const uint8_t* fc1_scales,
                                           const uint8_t* fc2_codes, const uint8_t* fc2_scales,
                                           const int32_t* group_sizes, void* y, uint16_t* fc1_c, int32_t* inexact,
                                           bool* tail_deferred) {
  *tail_deferred = false;
  moe_ep_expert_desc d = l->desc;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (l->tensor_cores) {
    d.num_rows = C;
    cuda::TcWeights wt;
    wt.codes_format = fmt;
    wt.fc1_codes = fc1_codes;
    wt.fc1_scales = fc1_scales;
    wt.fc2_codes = fc2_codes;
    wt.fc2_scales = fc2_scales;
    wt.inexact = inexact;
    return cuda::tc_forward(stream, d, l->cfg.combine_format, l->cfg.expert_out_dtype == MOE_EP_DTYPE_BF16,
                            static_cast<const uint16_t*>(x), w, wt, group_sizes, y, fc1_c, l->tc,
                            tail_by_finish(l) ? tail_deferred : nullptr);
  }
#endif
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_local_experts;
  const auto f = static_cast<moe_ep_format>(fmt);
  // The weights' bf16 decode into [E, K, N] (transpose_rows N), as float32 values.
  cpu::dequantize_bf16_values(f, fc1_codes, fc1_scales, E * 2 * I, H, 1, 2 * I, l->fc1_32, inexact);
  cpu::dequantize_bf16_values(f, fc2_codes, fc2_scales, E * H, I, 1, H, l->fc2_32, inexact);
  if (C > 0) MOE_EP_TRY(cpu::dequantize(nullptr, MOE_EP_FORMAT_BF16, x, nullptr, C, H, 1, l->x32));
  return staged_forward_f32(l, stream, C, l->x32, w, l->fc1_32, l->fc2_32, group_sizes, y, fc1_c);
}

moe_ep_status experts_backward(moe_ep_layer* l, void* stream, int64_t C, const void* x, const float* w,
                               const void* fc1, const void* fc2, const uint16_t* fc1_c, const void* dy,
                               int32_t dy_dtype, const int32_t* group_sizes, float* dx, float* dw, void* dfc1,
                               void* dfc2, int32_t flags) {
  BackwardOptions opt;
  opt.bf16_operands = l->cfg.backward_operand_format == MOE_EP_FORMAT_BF16;
  opt.accumulate = (flags & MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS) != 0;
  opt.bf16_weight_grads = (flags & MOE_EP_BACKWARD_WEIGHT_GRADS_BF16) != 0;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (l->tensor_cores) {
    moe_ep_expert_desc d = l->desc;
    d.num_rows = C;
    return cuda::tc_backward(stream, d, static_cast<const uint16_t*>(x), w, static_cast<const uint16_t*>(fc1),
                             static_cast<const uint16_t*>(fc2), fc1_c, dy, dy_dtype, group_sizes, dx, dw, dfc1, dfc2,
                             l->tc, opt);
  }
#endif
  if (!opt.bf16_weight_grads)
    return staged_backward(l, stream, C, x, w, fc1, fc2, fc1_c, dy, dy_dtype, group_sizes, dx, dw,
                           static_cast<float*>(dfc1), static_cast<float*>(dfc2), opt);
  // bf16 weight gradients on the staged path (operand_dtype bf16, checked): the float32
  // gradients go into the layer's float32 copies of the weights, fc1_32 and fc2_32 (staged
  // again at every call, of exactly the gradients' sizes; the kernels write an expert's
  // gradients only after their last read of its weights), then are rounded once into dfc1
  // and dfc2: nothing allocated per step.
  MOE_EP_TRY(staged_backward(l, stream, C, x, w, fc1, fc2, fc1_c, dy, dy_dtype, group_sizes, dx, dw, l->fc1_32,
                             l->fc2_32, opt));
  const int64_t H = l->desc.hidden, I = l->desc.intermediate, E = l->desc.num_local_experts;
  MOE_EP_TRY(MOE_EP_LAYER_IMPL(l, quantize(stream, MOE_EP_FORMAT_BF16, l->fc1_32, E, H * 2 * I, 1, dfc1, nullptr)));
  return MOE_EP_LAYER_IMPL(l, quantize(stream, MOE_EP_FORMAT_BF16, l->fc2_32, E, I * H, 1, dfc2, nullptr));
}

// With an exchange: when its last step reported an error (its dispatch's: a bad id or an
// overflow on some rank, or a peer that never came; or a combine's timeout), the stage's
// outputs are all NaN, as the all-ranks NaN rule asks; nothing is read or written when there
// was none.
struct Output {
  void* p;
  int64_t n;
  int32_t dtype;
};
moe_ep_status nan_on_dispatch_error(const moe_ep_layer* l, void* stream, std::initializer_list<Output> outs) {
  if (l->ex == nullptr || l->ex->last_tokens < 0) return MOE_EP_OK;
  const int32_t* err = l->ex->loc.step_err;
  for (const Output& o : outs) {
#ifdef MOE_EP_NATIVE_WITH_CUDA
    if (is_cuda(l)) {
      MOE_EP_TRY(cuda::nan_on_error(stream, err, o.p, o.n, o.dtype));
      continue;
    }
#endif
    if (*err == 0 || o.p == nullptr) continue;
    for (int64_t i = 0; i < o.n; ++i) {
      if (o.dtype == MOE_EP_DTYPE_BF16) static_cast<uint16_t*>(o.p)[i] = 0x7FC0;
      else static_cast<float*>(o.p)[i] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  return MOE_EP_OK;
}

// With an exchange after its dispatch: the stash rows of the slabs' padding (alignment rows
// past each local expert's routes) are zero whatever the weights hold (0 * inf is NaN). CPU
// layers (a CUDA layer's finish_forward zeroes them in its one kernel).
moe_ep_status zero_stash_padding(const moe_ep_layer* l, uint16_t* fc1_c, int64_t rows) {
  if (l->ex == nullptr || l->ex->last_tokens < 0 || fc1_c == nullptr) return MOE_EP_OK;
  const int64_t n = 2 * l->desc.intermediate, groups = l->desc.num_local_experts;
  const int32_t* off = l->ex->loc.off;
  const int32_t* valid = l->ex->loc.nloc;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t end = std::min<int64_t>(off[g + 1], rows);
    const int64_t start = std::min<int64_t>(static_cast<int64_t>(off[g]) + valid[g], end);
    if (end > start) std::memset(fc1_c + start * n, 0, static_cast<size_t>((end - start) * n) * sizeof(uint16_t));
  }
  return MOE_EP_OK;
}

// The outputs of the experts forward entries: y [C, H] of the layer's expert_out_dtype
// (16-byte aligned on the tensor-core path: the GEMM's TMA and the bf16 epilogue store whole
// vectors) and fc1_c [C, 2I] bf16 or NULL.
moe_ep_status check_forward_outputs(const Check& ck, const moe_ep_layer* l, int64_t C, const void* y,
                                    const uint16_t* fc1_c) {
  const bool bf16_out = l->cfg.expert_out_dtype == MOE_EP_DTYPE_BF16;
  MOE_EP_TRY(ck.ptr("y", y, C * l->desc.hidden, bf16_out ? 2 : 4));
  if (fc1_c != nullptr) MOE_EP_TRY(ck.ptr("fc1_c", fc1_c, C * 2 * l->desc.intermediate, 2));
  if (l->tensor_cores && !aligned16(y))
    return ck.bad("y must be 16-byte aligned on the tensor-core path", std::to_string(reinterpret_cast<uintptr_t>(y)));
  return MOE_EP_OK;
}

// After an experts forward: the stash's padding rows zero and, after a failed dispatch, the
// outputs NaN (zero_stash_padding, nan_on_dispatch_error).
// tail_deferred: the experts forward left y's rows past its last slab to this kernel.
moe_ep_status finish_forward(const moe_ep_layer* l, void* stream, int64_t C, void* y, uint16_t* fc1_c,
                             bool tail_deferred) {
  const bool bf16_out = l->cfg.expert_out_dtype == MOE_EP_DTYPE_BF16;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (is_cuda(l)) {  // all in one kernel
    if (!tail_by_finish(l)) return MOE_EP_OK;
    return cuda::finish_forward(stream, l->ex->loc.step_err, l->ex->loc.off, l->ex->loc.nloc,
                                l->desc.num_local_experts, fc1_c, C, 2 * l->desc.intermediate, y,
                                y != nullptr ? C * l->desc.hidden : 0,
                                bf16_out ? MOE_EP_DTYPE_BF16 : MOE_EP_DTYPE_F32,
                                tail_deferred ? l->tc.offsets + l->desc.num_local_experts : nullptr);
  }
#endif
  MOE_EP_TRY(zero_stash_padding(l, fc1_c, C));
  return nan_on_dispatch_error(l, stream,
                               {{y, C * l->desc.hidden, bf16_out ? MOE_EP_DTYPE_BF16 : MOE_EP_DTYPE_F32},
                                {fc1_c, C * 2 * l->desc.intermediate, MOE_EP_DTYPE_BF16}});
}

}  // namespace

Exchange* layer_exchange(const moe_ep_layer* l) { return l->ex; }

}  // namespace moe_ep

using moe_ep::Check;

extern "C" {

moe_ep_status moe_ep_layer_create(const moe_ep_layer_config* config, moe_ep_layer** layer) {
  const Check ck{"moe_ep_layer_create"};
  if (layer == nullptr) return ck.bad("layer must not be NULL", "NULL");
  *layer = nullptr;
  moe_ep_layer_config cfg;
  MOE_EP_TRY(moe_ep::read_config(ck, config, &cfg));
  MOE_EP_TRY(moe_ep::check_config(ck, cfg));
  moe_ep_layer* l = new (std::nothrow) moe_ep_layer();
  if (l == nullptr) return moe_ep::fail(MOE_EP_ERR_INTERNAL, "moe_ep_layer_create: out of host memory");
  l->cfg = cfg;
  l->desc = moe_ep_expert_desc{cfg.max_rows,         cfg.hidden,    cfg.intermediate,  cfg.num_local_experts,
                               cfg.apply_topk_in_fc1, cfg.has_clamp, cfg.gate_up_clamp, cfg.intermediate_format};
  size_t bytes = 0;
  int sm_count = 0;
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (cfg.device == MOE_EP_DEVICE_CUDA && cfg.operand_dtype == MOE_EP_DTYPE_BF16) {
    bool sm90 = false;
    moe_ep_status st = moe_ep::cuda::device_props(cfg.cuda_device, &sm_count, &sm90);
    if (st != MOE_EP_OK) {
      delete l;
      return st;
    }
    if (sm90)
      bytes = moe_ep::cuda::tc_workspace_layout(l->desc, sm_count, cfg.with_backward != 0,
                                                cfg.expert_out_dtype == MOE_EP_DTYPE_BF16, cfg.combine_format, nullptr,
                                                nullptr, cfg.backward_operand_format == MOE_EP_FORMAT_BF16);
    if (bytes > 0) {
      l->tensor_cores = true;
      l->planes = moe_ep::cuda::tc_operand_planes(cfg.intermediate_format);
    }
  }
#endif
  if (!l->tensor_cores) bytes = moe_ep::staged_layout(l, nullptr);
  moe_ep_status st = moe_ep::alloc(l, bytes);
  if (st != MOE_EP_OK) {
    delete l;
    return st;
  }
#ifdef MOE_EP_NATIVE_WITH_CUDA
  if (l->tensor_cores)
    moe_ep::cuda::tc_workspace_layout(l->desc, sm_count, cfg.with_backward != 0,
                                      cfg.expert_out_dtype == MOE_EP_DTYPE_BF16, cfg.combine_format, l->buffer, &l->tc,
                                      cfg.backward_operand_format == MOE_EP_FORMAT_BF16);
#endif
  if (!l->tensor_cores) moe_ep::staged_layout(l, static_cast<char*>(l->buffer));
  (void)sm_count;
  st = moe_ep::exchange_create(cfg, &l->ex);
  if (st != MOE_EP_OK) {
    moe_ep::release(l);
    delete l;
    return st;
  }
  *layer = l;
  return MOE_EP_OK;
}

moe_ep_status moe_ep_layer_destroy(moe_ep_layer* layer) {
  if (layer == nullptr) return MOE_EP_OK;
  const moe_ep_status sx = moe_ep::exchange_destroy(layer->ex);
  const moe_ep_status st = moe_ep::release(layer);
  delete layer;
  return st != MOE_EP_OK ? st : sx;
}

moe_ep_status moe_ep_layer_get_info(const moe_ep_layer* layer, moe_ep_layer_info* info) {
  const Check ck{"moe_ep_layer_get_info"};
  if (layer == nullptr) return ck.bad("layer must not be NULL", "NULL");
  if (info == nullptr) return ck.bad("info must not be NULL", "NULL");
  if (info->struct_size < sizeof(uint32_t))
    return ck.bad("info->struct_size must be sizeof(moe_ep_layer_info) = " + std::to_string(sizeof(moe_ep_layer_info)),
                  std::to_string(info->struct_size));
  moe_ep_layer_info full{};
  full.struct_size = static_cast<uint32_t>(std::min<size_t>(info->struct_size, sizeof full));
  full.tensor_cores = layer->tensor_cores ? 1 : 0;
  full.fc2_operand_planes = layer->tensor_cores ? layer->planes : 0;
  full.workspace_bytes = layer->bytes;
  std::memcpy(info, &full, full.struct_size);
  return MOE_EP_OK;
}

moe_ep_status moe_ep_layer_experts_forward(moe_ep_layer* layer, void* stream, int64_t num_rows, const void* x,
                                           const float* w, const void* fc1, const void* fc2,
                                           const int32_t* group_sizes, void* y, uint16_t* fc1_c) {
  const Check ck{"moe_ep_layer_experts_forward"};
  MOE_EP_TRY(moe_ep::check_layer(ck, layer, stream, num_rows));
  MOE_EP_TRY(moe_ep::check_operands(ck, layer, num_rows, x, w, fc1, fc2, group_sizes));
  MOE_EP_TRY(moe_ep::check_forward_outputs(ck, layer, num_rows, y, fc1_c));
  return moe_ep::guarded(layer, [&]() -> moe_ep_status {
    bool tail_deferred = false;
    MOE_EP_TRY(moe_ep::experts_forward(layer, stream, num_rows, x, w, fc1, fc2, group_sizes, y, fc1_c,
                                       &tail_deferred));
    return moe_ep::finish_forward(layer, stream, num_rows, y, fc1_c, tail_deferred);
  });
}

namespace {
// The block-scaled-weights forward's checks and call, errors named after the entry point ck.op.
moe_ep_status forward_block_scaled(const Check& ck, moe_ep_layer* layer, void* stream, int32_t weight_format,
                                   int64_t num_rows, const void* x, const float* w, const uint8_t* fc1_codes,
                                   const uint8_t* fc1_scales, const uint8_t* fc2_codes, const uint8_t* fc2_scales,
                                   const int32_t* group_sizes, void* y, uint16_t* fc1_c, int32_t* inexact) {
  MOE_EP_TRY(moe_ep::check_layer(ck, layer, stream, num_rows));
  if (weight_format != MOE_EP_FORMAT_MXFP8 && weight_format != MOE_EP_FORMAT_NVFP4)
    return ck.bad("weight_format must be MOE_EP_FORMAT_MXFP8 (" + std::to_string(MOE_EP_FORMAT_MXFP8) +
                      ") or MOE_EP_FORMAT_NVFP4 (" + std::to_string(MOE_EP_FORMAT_NVFP4) + ")",
                  std::to_string(weight_format));
  const bool nv = weight_format == MOE_EP_FORMAT_NVFP4;
  const char* fmt_name = nv ? "nvfp4" : "mxfp8";
  if (layer->cfg.operand_dtype != MOE_EP_DTYPE_BF16)
    return ck.bad("the layer's operand_dtype must be MOE_EP_DTYPE_BF16 (1): x is bf16",
                  std::to_string(layer->cfg.operand_dtype));
  const moe_ep_expert_desc& d = layer->desc;
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_local_experts;
  const int64_t block = nv ? 16 : 32;
  if (H % block != 0 || I % block != 0)
    return ck.bad("hidden and intermediate must be multiples of " + std::to_string(block) + " (the " + fmt_name +
                      " block along K)",
                  "hidden " + std::to_string(H) + ", intermediate " + std::to_string(I));
  if (moe_ep::is_cuda(layer)) {
#ifdef MOE_EP_NATIVE_WITH_CUDA
    if (!layer->tensor_cores || !moe_ep::cuda::tc_coded_weights_fit(d))
      return moe_ep::fail(MOE_EP_ERR_UNSUPPORTED,
                          std::string(ck.op) + ": on CUDA it needs the tensor-core path "
                          "(moe_ep_layer_get_info's tensor_cores = 1) and hidden and intermediate multiples of 128; "
                          "got tensor_cores " + std::to_string(layer->tensor_cores ? 1 : 0) + ", hidden " +
                              std::to_string(H) + ", intermediate " + std::to_string(I) +
                              " (decode the weights to bf16 and call moe_ep_layer_experts_forward instead)");
#endif
  }
  const int64_t per_code = nv ? 2 : 1;  // codes a byte
  MOE_EP_TRY(ck.ptr("x", x, num_rows * H, 2));
  MOE_EP_TRY(ck.ptr("w", w, num_rows, 4));
  MOE_EP_TRY(ck.ptr("fc1_codes", fc1_codes, E * 2 * I * (H / per_code), 1));
  MOE_EP_TRY(ck.ptr("fc1_scales", fc1_scales, E * 2 * I * (H / block), 1));
  MOE_EP_TRY(ck.ptr("fc2_codes", fc2_codes, E * H * (I / per_code), 1));
  MOE_EP_TRY(ck.ptr("fc2_scales", fc2_scales, E * H * (I / block), 1));
  MOE_EP_TRY(ck.ptr("group_sizes", group_sizes, E, 4));
  MOE_EP_TRY(ck.ptr("inexact", inexact, 0, 4));
  if (layer->tensor_cores) {
    // The block-scaled-weights GEMMs' vector loads.
    const uintptr_t scale_align = nv ? 8 : 4;
    for (const auto& [name, p, align] : {std::tuple<const char*, const void*, uintptr_t>{"x", x, 16},
                                         {"fc1_codes", fc1_codes, 16}, {"fc2_codes", fc2_codes, 16},
                                         {"fc1_scales", fc1_scales, scale_align},
                                         {"fc2_scales", fc2_scales, scale_align}})
      if (!moe_ep::aligned_to(p, align))
        return ck.bad(std::string(name) + " must be " + std::to_string(align) + "-byte aligned on the tensor-core path",
                      std::to_string(reinterpret_cast<uintptr_t>(p)));
  }
  MOE_EP_TRY(moe_ep::check_forward_outputs(ck, layer, num_rows, y, fc1_c));
  return moe_ep::guarded(layer, [&]() -> moe_ep_status {
    bool tail_deferred = false;
    MOE_EP_TRY(moe_ep::experts_forward_block_scaled(layer, stream, weight_format, num_rows, x, w, fc1_codes,
                                                    fc1_scales, fc2_codes, fc2_scales, group_sizes, y, fc1_c,
                                                    inexact, &tail_deferred));
    return moe_ep::finish_forward(layer, stream, num_rows, y, fc1_c, tail_deferred);
  });
}
}  // namespace

moe_ep_status moe_ep_layer_experts_forward_block_scaled(moe_ep_layer* layer, void* stream, int32_t weight_format,
                                                        int64_t num_rows, const void* x, const float* w,
                                                        const uint8_t* fc1_codes, const uint8_t* fc1_scales,
                                                        const uint8_t* fc2_codes, const uint8_t* fc2_scales,
                                                        const int32_t* group_sizes, void* y, uint16_t* fc1_c,
                                                        int32_t* inexact) {
  return forward_block_scaled(Check{"moe_ep_layer_experts_forward_block_scaled"}, layer, stream, weight_format,
                              num_rows, x, w, fc1_codes, fc1_scales, fc2_codes, fc2_scales, group_sizes, y, fc1_c,
                              inexact);
}

moe_ep_status moe_ep_layer_experts_forward_mxfp8(moe_ep_layer* layer, void* stream, int64_t num_rows, const void* x,
                                                 const float* w, const uint8_t* fc1_codes, const uint8_t* fc1_scales,
                                                 const uint8_t* fc2_codes, const uint8_t* fc2_scales,
                                                 const int32_t* group_sizes, void* y, uint16_t* fc1_c,
                                                 int32_t* inexact) {
  return forward_block_scaled(Check{"moe_ep_layer_experts_forward_mxfp8"}, layer, stream, MOE_EP_FORMAT_MXFP8,
                              num_rows, x, w, fc1_codes, fc1_scales, fc2_codes, fc2_scales, group_sizes, y, fc1_c,
                              inexact);
}

moe_ep_status moe_ep_layer_experts_backward(moe_ep_layer* layer, void* stream, int64_t num_rows, const void* x,
                                            const float* w, const void* fc1, const void* fc2, const uint16_t* fc1_c,
                                            const void* dy, int32_t dy_dtype, const int32_t* group_sizes, float* dx,
                                            float* dw, float* dfc1, float* dfc2) {
  return moe_ep_layer_experts_backward_ex(layer, stream, num_rows, x, w, fc1, fc2, fc1_c, dy, dy_dtype, group_sizes, dx,
                                          dw, dfc1, dfc2, 0);
}

moe_ep_status moe_ep_layer_experts_backward_ex(moe_ep_layer* layer, void* stream, int64_t num_rows, const void* x,
                                               const float* w, const void* fc1, const void* fc2,
                                               const uint16_t* fc1_c, const void* dy, int32_t dy_dtype,
                                               const int32_t* group_sizes, float* dx, float* dw, void* dfc1,
                                               void* dfc2, int32_t flags) {
  const Check ck{"moe_ep_layer_experts_backward"};
  if ((flags & ~(MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS | MOE_EP_BACKWARD_WEIGHT_GRADS_BF16)) != 0)
    return ck.bad("flags must be 0, MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS (1) or MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 (2)",
                  std::to_string(flags));
  const bool bf16_grads = (flags & MOE_EP_BACKWARD_WEIGHT_GRADS_BF16) != 0;
  if (bf16_grads && (flags & MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS) != 0)
    return ck.bad("MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 (2) cannot be combined with MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS "
                  "(1): accumulation is into float32 gradients; pass one of them",
                  std::to_string(flags));
  MOE_EP_TRY(moe_ep::check_layer(ck, layer, stream, num_rows));
  if (!layer->cfg.with_backward)
    return ck.bad("the layer must be made with config->with_backward = 1 for the backward", "0");
  if (bf16_grads && layer->cfg.operand_dtype != MOE_EP_DTYPE_BF16)
    return ck.bad("MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 needs a layer of operand_dtype MOE_EP_DTYPE_BF16 (1): bf16 "
                  "gradients are for bf16 weights",
                  std::to_string(layer->cfg.operand_dtype));
  MOE_EP_TRY(moe_ep::check_operands(ck, layer, num_rows, x, w, fc1, fc2, group_sizes));
  const int64_t H = layer->desc.hidden, I = layer->desc.intermediate, E = layer->desc.num_local_experts;
  MOE_EP_TRY(ck.ptr("fc1_c", fc1_c, num_rows * 2 * I, 2));
  if (dy_dtype != MOE_EP_DTYPE_F32 && dy_dtype != MOE_EP_DTYPE_BF16)
    return ck.bad("dy_dtype must be MOE_EP_DTYPE_F32 (0) or MOE_EP_DTYPE_BF16 (1)", std::to_string(dy_dtype));
  MOE_EP_TRY(ck.ptr("dy", dy, num_rows * H, dy_dtype == MOE_EP_DTYPE_BF16 ? 2 : 4));
  MOE_EP_TRY(ck.ptr("dx", dx, num_rows * H, 4));
  MOE_EP_TRY(ck.ptr("dw", dw, num_rows, 4));
  MOE_EP_TRY(ck.ptr("dfc1", dfc1, E * H * 2 * I, bf16_grads ? 2 : 4));
  MOE_EP_TRY(ck.ptr("dfc2", dfc2, E * I * H, bf16_grads ? 2 : 4));
  if (bf16_grads && layer->tensor_cores) {  // the weight-gradient GEMMs' bf16 epilogue stores whole vectors
    for (const auto& [name, p] : {std::pair<const char*, const void*>{"dfc1", dfc1}, {"dfc2", dfc2}})
      if (!moe_ep::aligned16(p))
        return ck.bad(std::string(name) + " must be 16-byte aligned on the tensor-core path with "
                      "MOE_EP_BACKWARD_WEIGHT_GRADS_BF16",
                      std::to_string(reinterpret_cast<uintptr_t>(p)));
  }
  return moe_ep::guarded(layer, [&]() -> moe_ep_status {
    MOE_EP_TRY(moe_ep::experts_backward(layer, stream, num_rows, x, w, fc1, fc2, fc1_c, dy, dy_dtype, group_sizes, dx,
                                        dw, dfc1, dfc2, flags));
    constexpr int32_t f32 = MOE_EP_DTYPE_F32;
    const int32_t g = bf16_grads ? MOE_EP_DTYPE_BF16 : f32;
    return moe_ep::nan_on_dispatch_error(layer, stream,
                                         {{dx, num_rows * H, f32}, {dw, num_rows, f32}, {dfc1, E * H * 2 * I, g},
                                          {dfc2, E * I * H, g}});
  });
}

}  // extern "C"
