// Internal interface of the native core: capi.cc validates every size and
// pointer once, then calls one implementation (cpu:: always, cuda:: when built
// with MOE_EP_NATIVE_CUDA). Implementations may assume the checks of capi.cc
// passed; they report data errors (CPU only) and runtime failures through
// moe_ep::fail().
#ifndef MOE_EP_NATIVE_INTERNAL_H_
#define MOE_EP_NATIVE_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "align.h"
#include "moe_ep_native.h"

namespace moe_ep {

// Sets the calling thread's last error and returns `status`.
moe_ep_status fail(moe_ep_status status, const std::string& message);

// Argument checks of the entry points: formats "<op>: <rule>; got <value>" and returns INVALID_ARGUMENT.
struct Check {
  const char* op;
  moe_ep_status bad(const std::string& rule, const std::string& got) const {
    return fail(MOE_EP_ERR_INVALID_ARGUMENT, std::string(op) + ": " + rule + "; got " + got);
  }
  moe_ep_status nonneg(const char* name, int64_t v) const {
    return v >= 0 ? MOE_EP_OK : bad(std::string(name) + " must be >= 0", std::to_string(v));
  }
  moe_ep_status positive(const char* name, int64_t v) const {
    return v >= 1 ? MOE_EP_OK : bad(std::string(name) + " must be >= 1", std::to_string(v));
  }
  // A pointer may be NULL only when the array it points to is empty, and must be
  // aligned to its element size (`align` bytes).
  moe_ep_status ptr(const char* name, const void* p, int64_t count, size_t align = 1) const {
    if (p == nullptr) return count == 0 ? MOE_EP_OK : bad(std::string(name) + " must not be NULL", "NULL");
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    if (addr % align != 0)
      return bad(std::string(name) + " must be aligned to " + std::to_string(align) + " bytes",
                 "an address " + std::to_string(addr % align) + " bytes past a multiple of " + std::to_string(align));
    return MOE_EP_OK;
  }
  moe_ep_status product(const char* what, int64_t a, int64_t b, int64_t limit) const {
    if (a != 0 && b > limit / a)
      return bad(std::string(what) + " must be <= " + std::to_string(limit), std::to_string(a) + " * " + std::to_string(b));
    return MOE_EP_OK;
  }
};

#define MOE_EP_TRY(expr)                        \
  do {                                          \
    moe_ep_status _st = (expr);                 \
    if (_st != MOE_EP_OK) return _st;           \
  } while (0)

// The checks of a moe_ep_expert_desc (capi.cc): sizes, products, flags, formats.
moe_ep_status check_desc(const Check& ck, const moe_ep_expert_desc* d);

// Block sizes of the block-scaled formats.
constexpr int64_t kMxfp8Block = 32;
constexpr int64_t kNvfp4Block = 16;
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ------------------------------------------------------------------ workspaces
// The one definition of the expert workspaces' layouts: capi.cc sizes them with
// these functions, the CPU and CUDA implementations point into them with the
// same functions. Pieces start at 256-byte aligned offsets from the base.
inline size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

struct ForwardWorkspace {
  float* op;         // [C, I] the FC2 operand (after R_int)
  int64_t* offsets;  // [E_local + 1] slab offsets
};

struct BackwardWorkspace {
  float* h;          // [C, I]  h = s * u recomputed from the stash (CPU: the dfc2 GEMM's left operand)
  float* a;          // [C, I]  a = dY W2^T
  float* dc;         // [C, 2I] [dg, du]
  float* z;          // [C, H]  z = h W2 (CPU: the dfc2 GEMM's right operand)
  int64_t* offsets;  // [E_local + 1] slab offsets
};

// Places the pieces at `base` (NULL: only sizes them; ws may be NULL) and returns the total bytes.
inline size_t forward_workspace_layout(const moe_ep_expert_desc& d, void* base, ForwardWorkspace* ws) {
  const size_t C = static_cast<size_t>(d.num_rows), I = static_cast<size_t>(d.intermediate);
  char* b = static_cast<char*>(base);
  size_t at = 0;
  auto take = [&](size_t bytes) { char* p = b ? b + at : nullptr; at += align256(bytes); return p; };
  float* op = reinterpret_cast<float*>(take(C * I * sizeof(float)));
  int64_t* off = reinterpret_cast<int64_t*>(take((static_cast<size_t>(d.num_local_experts) + 1) * sizeof(int64_t)));
  if (ws != nullptr) *ws = ForwardWorkspace{op, off};
  return at;
}

inline size_t backward_workspace_layout(const moe_ep_expert_desc& d, void* base, BackwardWorkspace* ws) {
  const size_t C = static_cast<size_t>(d.num_rows), I = static_cast<size_t>(d.intermediate),
               H = static_cast<size_t>(d.hidden);
  char* b = static_cast<char*>(base);
  size_t at = 0;
  auto take = [&](size_t bytes) { char* p = b ? b + at : nullptr; at += align256(bytes); return p; };
  float* h = reinterpret_cast<float*>(take(C * I * sizeof(float)));
  float* a = reinterpret_cast<float*>(take(C * I * sizeof(float)));
  float* dc = reinterpret_cast<float*>(take(C * 2 * I * sizeof(float)));
  float* z = reinterpret_cast<float*>(take(C * H * sizeof(float)));
  int64_t* off = reinterpret_cast<int64_t*>(take((static_cast<size_t>(d.num_local_experts) + 1) * sizeof(int64_t)));
  if (ws != nullptr) *ws = BackwardWorkspace{h, a, dc, z, off};
  return at;
}

inline size_t forward_workspace_bytes(const moe_ep_expert_desc& d) { return forward_workspace_layout(d, nullptr, nullptr); }
inline size_t backward_workspace_bytes(const moe_ep_expert_desc& d) { return backward_workspace_layout(d, nullptr, nullptr); }

// How a backward runs (the layer's configuration and the call's flags): bf16_operands: the
// spec's backward_operand_format bf16 (R_bf16 of dY, dc and w*h before their GEMMs, dw = <a, h>
// in both placements); accumulate: dfc1 and dfc2 get the weight gradients added to what they hold;
// bf16_weight_grads (tensor-core path only: the staged kernels always write float32, layer.cc
// rounds): dfc1 and dfc2 are bf16, the float32 gradients rounded to nearest even.
struct BackwardOptions {
  bool bf16_operands = false;
  bool accumulate = false;
  bool bf16_weight_grads = false;
};

#define MOE_EP_IMPL_DECLS                                                                                          \
  moe_ep_status quantize(void* stream, moe_ep_format fmt, const float* x, int64_t outer, int64_t n, int64_t inner,   \
                         void* data, void* scale);                                                                 \
  moe_ep_status dequantize(void* stream, moe_ep_format fmt, const void* data, const void* scale, int64_t outer,     \
                           int64_t n, int64_t inner, float* out);                                                  \
  /* fmt MXFP8 or NVFP4; outer * n * inner > 0; transpose_rows 0, or >= 1 with inner == 1 and */                \
  /* outer % transpose_rows == 0; inexact NULL or a 4-byte aligned int32 (capi.cc checks them) */                  \
  moe_ep_status dequantize_bf16(void* stream, moe_ep_format fmt, const void* data, const void* scale,             \
                                int64_t outer, int64_t n, int64_t inner, int64_t transpose_rows, uint16_t* out,    \
                                int32_t* inexact);                                                                 \
  /* fmt MXFP8 or NVFP4; rows * n > 0; the row strides cover a row's codes and scales (capi.cc checks them) */ \
  /* route NULL: out row o is source row o; else source row route[o] / num_topk, a zero row for -1 */          \
  moe_ep_status dequantize_bf16_rows(void* stream, moe_ep_format fmt, const void* data, int64_t data_row_bytes,     \
                                     const void* scale, int64_t scale_row_bytes, int64_t rows, int64_t n,          \
                                     uint16_t* out, int32_t* inexact, const int32_t* route, int64_t num_topk,      \
                                     int64_t num_sources);                                                         \
  moe_ep_status plan_routes(void* stream, const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,           \
                            int64_t num_experts, int32_t* send_route, int32_t* route_pos, int32_t* route_expert,    \
                            int32_t* counts);                                                                      \
  moe_ep_status record_step(void* stream, const int32_t* error, const int32_t* tokens_per_expert,                  \
                            int64_t num_local_experts, int64_t alignment, int64_t* record);                         \
  moe_ep_status permute_rows(void* stream, const void* tokens, int64_t num_tokens, int64_t num_topk,               \
                             int64_t row_bytes, const int32_t* send_route, int64_t num_rows, void* dst);           \
  moe_ep_status combine_reduce(void* stream, const float* rows, int64_t num_rows, const int32_t* route_pos,        \
                               int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out);                  \
  moe_ep_status combine_reduce_bf16(void* stream, const uint16_t* rows, int64_t num_rows, const int32_t* route_pos,\
                                    int64_t num_tokens, int64_t num_topk, int64_t hidden, float* out);             \
  /* fmt MXFP8 or NVFP4 (capi.cc checks it) */                                                                  \
  moe_ep_status combine_reduce_round_trip(void* stream, moe_ep_format fmt, const float* rows, int64_t num_rows,     \
                                          const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,          \
                                          int64_t hidden, float* out);                                             \
  /* rows_dtype F32 or BF16, round_trip NONE/MXFP8/NVFP4 (NONE for bf16 rows), out_format BF16/MXFP8/NVFP4; */   \
  /* num_tokens * hidden > 0 (capi.cc checks them) */                                                           \
  moe_ep_status combine_reduce_encode(void* stream, moe_ep_dtype rows_dtype, moe_ep_format round_trip,              \
                                      const void* rows, int64_t num_rows, const int32_t* route_pos,                \
                                      int64_t num_tokens, int64_t num_topk, int64_t hidden, const uint8_t* error,  \
                                      moe_ep_format out_format, void* out_data, void* out_scale);                  \
  moe_ep_status expert_forward(void* stream, const moe_ep_expert_desc& d, const float* x, const float* w,          \
                               const float* fc1, const float* fc2, const int32_t* group_sizes, float* y, float* c,  \
                               void* workspace);                                                                   \
  moe_ep_status expert_backward(void* stream, const moe_ep_expert_desc& d, const float* x, const float* w,         \
                                const float* fc1, const float* fc2, const uint16_t* fc1_c, const float* dy,         \
                                const int32_t* group_sizes, float* dx, float* dw, float* dfc1, float* dfc2,         \
                                void* workspace, const BackwardOptions& opt = BackwardOptions{});

namespace cpu {
MOE_EP_IMPL_DECLS
// dequantize_bf16's values as float32 (the bf16 decode: NaN where bf16 cannot hold a value,
// 1 ORed into *inexact then): the staged layer's operands from block-scaled weights.
void dequantize_bf16_values(moe_ep_format fmt, const void* data, const void* scale, int64_t outer, int64_t n,
                            int64_t inner, int64_t transpose_rows, float* out, int32_t* inexact);
// The round trip of one row of n float32 values through fmt (a moe_ep_format code; NONE: nothing)
// in place: quantize then dequantize, with data and scale as scratch (resized here). R_int of
// the staged experts, the combine format's round trip of moe_ep_combine_reduce_round_trip.
moe_ep_status round_trip_row(int32_t fmt, float* row, int64_t n, std::vector<uint8_t>* data,
                             std::vector<uint8_t>* scale);
}  // namespace cpu

#ifdef MOE_EP_NATIVE_WITH_CUDA
namespace cuda {
MOE_EP_IMPL_DECLS
const char* arch_list();  // the CUDA architectures compiled in, for moe_ep_build_info

// The layer's tensor-core path (cuda/layer_tc.cu): bf16 operands, CUTLASS grouped GEMMs.
struct TcWorkspace {
  int32_t* offsets;    // [E_local + 1] int32 slab offsets
  void* gemm;          // the grouped GEMMs' workspace (gemm_bytes)
  size_t gemm_bytes;
  float* c;            // [C, 2I] float32 FC1 output (forward)
  uint16_t* left;      // [3, C, I] bf16 planes: the FC2 operand (forward), w*h or h (backward)
  uint16_t* right;     // [3, C, H] bf16 planes: dY or w*dY (backward)
  uint16_t* dc;        // [3, C, 2I] bf16 planes of dc (backward)
  float* a;            // [C, I] a = (w dY or dY) W2^T (backward)
  float* h;            // [C, I] h (backward)
  float* z;            // [C, H] z = h W2 (backward, apply_topk_in_fc1 = 0)
  float* dy32;         // [C, H] a bf16 cotangent in float32 (backward, apply_topk_in_fc1 = 0)
  float* y32;          // [C, H] the FC2 output in float32 (forward, bf16 expert-output rows only)
  float* wgrad32;      // [wgrad32_experts, H, 2I] float32 weight gradients of that many experts at a
                       // time (exact backward, bf16 weight gradients): c itself when it holds one
                       // expert's or more (C >= H: C / H experts, at most E_local), else one expert's
  int wgrad32_experts;
  int sm_count;
};
// Bytes of the tensor-core workspace (0 when the build or the shape has no tensor-core path).
// bf16_backward: the backward's operands are bf16 (one plane each, no a, h, z or dy32).
size_t tc_workspace_layout(const moe_ep_expert_desc& d, int sm_count, bool backward, bool bf16_out,
                           int32_t combine_format, void* base, TcWorkspace* ws, bool bf16_backward = false);
// bf16 FC2 operand planes the forward needs for this intermediate format (1: exactly bf16, else 3).
int tc_operand_planes(int32_t intermediate_format);
// The expert weights of the tensor-core forward: bf16 fc1 [E, H, 2I] and fc2 [E, I, H]; or
// block-scaled as stored (codes_format MXFP8: codes [E, N, K] E4M3, scales [E, N, K / 32]
// E8M0; NVFP4: codes [E, N, K / 2], two E2M1 a byte, scales [E, N, K / 16] E4M3; fc1 N = 2I,
// K = H; fc2 N = H, K = I), read by the block-scaled-weights GEMMs
// (cuda/gemm/mxfp8_weights_gemm.cuh, nvfp4_weights_gemm.cuh); the mxfp8 one ORs 1 into
// *inexact where a weight value is not a bf16 value (decoded to NaN).
struct TcWeights {
  const uint16_t* fc1 = nullptr;
  const uint16_t* fc2 = nullptr;
  int32_t codes_format = MOE_EP_FORMAT_NONE;  // MOE_EP_FORMAT_MXFP8 or NVFP4 with codes
  const uint8_t* fc1_codes = nullptr;
  const uint8_t* fc1_scales = nullptr;
  const uint8_t* fc2_codes = nullptr;
  const uint8_t* fc2_scales = nullptr;
  int32_t* inexact = nullptr;
  bool coded() const { return fc1_codes != nullptr; }
};
// Whether the block-scaled-weights GEMMs take the layer's shapes (H and 2I, the N and K of FC1
// and FC2, multiples of 128).
bool tc_coded_weights_fit(const moe_ep_expert_desc& d);
// y: [C, H] float32, or bf16 (bf16_out: combine_format bf16 or nvfp4, whose values are bf16 values: the rows
// are written as their bf16 bits after the round trip).
// tail_deferred: NULL, or where tc_forward says (true) that it left y's rows past the last
// slab (rows >= ws.offsets[E]) unwritten for the caller to zero (finish_forward's tail_off),
// one launch fewer; false: y is whole.
moe_ep_status tc_forward(void* stream, const moe_ep_expert_desc& d, int32_t combine_format, bool bf16_out,
                         const uint16_t* x, const float* w, const TcWeights& weights, const int32_t* group_sizes,
                         void* y, uint16_t* fc1_c, const TcWorkspace& ws, bool* tail_deferred = nullptr);
moe_ep_status tc_backward(void* stream, const moe_ep_expert_desc& d, const uint16_t* x, const float* w,
                          const uint16_t* fc1, const uint16_t* fc2, const uint16_t* fc1_c, const void* dy,
                          int32_t dy_dtype, const int32_t* group_sizes, float* dx, float* dw, void* dfc1, void* dfc2,
                          const TcWorkspace& ws, const BackwardOptions& opt = BackwardOptions{});
// Device memory for a layer on cuda_device (cudaMalloc after cudaSetDevice), and its release.
moe_ep_status device_alloc(int cuda_device, size_t bytes, void** out);
moe_ep_status device_free(void* p);
// The device's SM count and whether it is sm_90 (the tensor-core kernels' architecture).
moe_ep_status device_props(int cuda_device, int* sm_count, bool* is_sm90);
// In-place combine round trip of y [C, H] (rows past off are left as they are).
moe_ep_status round_trip_rows(void* stream, int32_t fmt, float* y, int64_t rows, int64_t n);
// p[0, n) of dtype (moe_ep_dtype) all NaN when *error != 0 (device memory), else untouched: a grid
// of at most a few blocks per SM whose threads return at once when there is no error.
moe_ep_status nan_on_error(void* stream, const int32_t* error, void* p, int64_t n, int32_t dtype);
// An exchange layer's experts forward finished in one kernel: with *error == 0, the stash's
// padding rows [min(off[g] + valid[g], off[g + 1]), off[g + 1]) of every g < groups, cut at `rows`,
// zero (stash [rows, stash_cols] bf16, NULL: none); otherwise y [y_count] of y_dtype and the
// whole stash NaN (what zeroing the padding and then nan_on_error on both would give).
// tail_off (device, or NULL): with *error == 0, y's elements from row min(*tail_off, rows) on
// (rows of y_count / rows elements) zero too (tc_forward's deferred tail).
moe_ep_status finish_forward(void* stream, const int32_t* error, const int32_t* off, const int32_t* valid,
                             int64_t groups, uint16_t* stash, int64_t rows, int64_t stash_cols, void* y,
                             int64_t y_count, int32_t y_dtype, const int32_t* tail_off = nullptr);
}  // namespace cuda
#endif

#undef MOE_EP_IMPL_DECLS

}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_INTERNAL_H_
