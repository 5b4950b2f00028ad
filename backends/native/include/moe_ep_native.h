/*
 * moe_ep_native.h: the C ABI of the MoeEp native kernel core.
 *
 * The numerics of one rank of the MoeEp operator (docs/spec.md) as plain C
 * entry points over raw pointers, for any framework binding (the JAX FFI
 * backend `jax-ffi`, ctypes, a PyTorch extension). Nothing here communicates:
 * the exchange between ranks is the binding's (or a transport's) job.
 *
 * Conventions
 * - Every entry point returns a moe_ep_status. On anything but MOE_EP_OK,
 *   moe_ep_last_error() gives a message for the calling thread that states the
 *   rule, the value seen and what is allowed; no output has been written when a
 *   size check fails (checks run before any work).
 * - `device` picks the implementation: MOE_EP_DEVICE_CPU (host pointers,
 *   `stream` must be NULL) or MOE_EP_DEVICE_CUDA (device pointers, `stream` a
 *   cudaStream_t, NULL for the legacy default stream; the call only enqueues
 *   work). A build without CUDA answers MOE_EP_ERR_UNSUPPORTED to CUDA calls.
 * - Arrays are dense and row-major; shapes are given as `[dims] dtype: meaning`.
 *   bf16 is passed as its 16-bit pattern (uint16_t), float8 codes as uint8_t.
 *   Every pointer is aligned to its element size (4 bytes for float and int32,
 *   2 for bf16) and workspaces to 8 bytes (256 recommended); a misaligned
 *   pointer is rejected with MOE_EP_ERR_INVALID_ARGUMENT.
 * - Sizes are int64_t and must be >= 0 (row counts may be 0); every size check
 *   happens on the host, before any work. Values inside device arrays cannot
 *   be checked by the CUDA implementation without a synchronisation: where the
 *   CPU implementation rejects a bad value (an index out of range), the CUDA one
 *   documents what it does instead.
 * - Routes: route id r = token * num_topk + slot. -1 in topk_idx marks an unused
 *   slot. Expert ids outside [-1, num_experts) are input errors.
 * - CPU entry points set the IEEE floating-point environment they need (no
 *   flush-to-zero, no denormals-are-zero, round to nearest) for the duration of
 *   the call and restore the caller's afterwards, so callers running with FTZ
 *   (XLA:CPU's threads) get the same codes.
 * - Numerics follow docs/spec.md: float32 accumulation (no TF32, no reduced
 *   precision), the formats bit-exact (round to nearest, ties to even), and no
 *   rounding point beyond the ones the spec names.
 */
#ifndef MOE_EP_NATIVE_H_
#define MOE_EP_NATIVE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MOE_EP_API __declspec(dllexport)
#else
#define MOE_EP_API __attribute__((visibility("default")))
#endif

/** Bumped on any incompatible change of a signature or a struct below, and when an entry
 *  point, a field or a flag is added (ABI 3, 4, 5, 6, 7, 8, 9, 10, 11): a binding built for N calls the entry points of N. */
#define MOE_EP_NATIVE_ABI_VERSION 11

typedef enum {
  MOE_EP_OK = 0,
  MOE_EP_ERR_INVALID_ARGUMENT = 1, /* a size, pointer, enum or index breaks a rule */
  MOE_EP_ERR_UNSUPPORTED = 2,      /* e.g. a CUDA call in a build without CUDA */
  MOE_EP_ERR_CUDA = 3,             /* the CUDA runtime reported an error */
  MOE_EP_ERR_INTERNAL = 4,         /* a bug in this library (out of memory included) */
  MOE_EP_ERR_COMM = 5,             /* the transport (NCCL) failed or timed out */
} moe_ep_status;

typedef enum {
  MOE_EP_DEVICE_CPU = 0,
  MOE_EP_DEVICE_CUDA = 1,
} moe_ep_device;

/** Number formats (docs/spec.md section 8). NONE: plain float32, no rounding. */
typedef enum {
  MOE_EP_FORMAT_NONE = 0,
  MOE_EP_FORMAT_BF16 = 1,
  MOE_EP_FORMAT_MXFP8 = 2, /* E4M3 codes, one E8M0 scale per 32 elements (0xFF: NaN) */
  MOE_EP_FORMAT_NVFP4 = 3, /* E2M1 codes two a byte, one E4M3 scale per 16 elements (0x7F: NaN) */
} moe_ep_format;

/* ------------------------------------------------------------------ library */

/** MOE_EP_NATIVE_ABI_VERSION of the library actually loaded. */
MOE_EP_API int moe_ep_abi_version(void);
/** 1 when the library was built with the CUDA implementation, else 0. */
MOE_EP_API int moe_ep_has_cuda(void);
/** A static string: version, compiler, CUDA architectures (or "no CUDA"). */
MOE_EP_API const char* moe_ep_build_info(void);
/** The message of the last failing call on this thread ("" when none). */
MOE_EP_API const char* moe_ep_last_error(void);
/** A static name for a status ("MOE_EP_ERR_INVALID_ARGUMENT", ...). */
MOE_EP_API const char* moe_ep_status_name(moe_ep_status status);

/* ------------------------------------------------------------------ formats */

/** The element type of a plain (unencoded) operand. */
typedef enum {
  MOE_EP_DTYPE_F32 = 0,  /* float32 */
  MOE_EP_DTYPE_BF16 = 1, /* bfloat16 bit patterns (uint16_t) */
} moe_ep_dtype;

/*
 * Tensors are viewed as [outer, n, inner]: the format's blocks run along the
 * middle axis (extent n, need not be a multiple of the block size: the last
 * block is partial). A last-axis encoding has inner = 1.
 *
 * Encoded storage (the layout of moe_ep_spec.formats.BlockScaledTensor):
 *   BF16:  data [outer, n, inner] uint16 bf16 bits; scale unused (NULL).
 *   MXFP8: data [outer, n, inner] uint8 E4M3 codes;
 *          scale [outer, ceil(n/32), inner] uint8 E8M0 codes.
 *   NVFP4: data [outer, ceil(n/2), inner] uint8: element 2j in the low nibble,
 *          2j+1 in the high nibble (odd n: the last high nibble is 0);
 *          scale [outer, ceil(n/16), inner] uint8 E4M3 codes.
 * A block holding NaN or +-Inf gets the NaN scale code and decodes to NaN
 * throughout; other blocks are unaffected. Zeros keep their sign bit.
 */

/**
 * Encode x in fmt (BF16, MXFP8 or NVFP4; NONE is rejected).
 *   x:     [outer, n, inner] float32: the values.
 *   data:  encoded codes (layout above).
 *   scale: block scales (layout above); NULL for BF16.
 */
MOE_EP_API moe_ep_status moe_ep_quantize(moe_ep_device device, void* stream, moe_ep_format fmt, const float* x,
                                         int64_t outer, int64_t n, int64_t inner, void* data, void* scale);

/**
 * Decode to float32, exactly (a decoded value beyond float32 range becomes +-Inf).
 *   data, scale: as moe_ep_quantize writes them (scale NULL for BF16).
 *   out:   [outer, n, inner] float32.
 */
MOE_EP_API moe_ep_status moe_ep_dequantize(moe_ep_device device, void* stream, moe_ep_format fmt, const void* data,
                                           const void* scale, int64_t outer, int64_t n, int64_t inner, float* out);

/**
 * Decode block-scaled codes to bf16 operands (the tensor-core GEMMs' input): every
 * value moe_ep_dequantize gives, as its bf16 bit pattern when bf16 holds it exactly;
 * a value bf16 cannot hold decodes to NaN (0x7FC0) and sets *out_inexact, so the
 * result is exact or visibly not, never silently rounded.
 *   fmt:   MOE_EP_FORMAT_MXFP8 or MOE_EP_FORMAT_NVFP4.
 *   data, scale: as moe_ep_quantize writes them for the view [outer, n, inner].
 *   transpose_rows: 0: out has the view's layout [outer, n, inner]. R >= 1 (needs
 *          inner = 1 and outer a multiple of R): the view is [outer / R, R, n] and out
 *          [outer / R, n, R], every [R, n] matrix transposed (expert weights stored
 *          [E, N, K] blocked along K, decoded to a GEMM's [E, K, N] in one pass).
 *   out:   uint16 bf16 bits, [outer, n, inner] or [outer / R, n, R].
 *   out_inexact: [1] int32 (device memory for CUDA), or NULL: 1 is ORed in (never
 *          cleared here) when some value was not a bf16 value; the caller zeroes it.
 * Which values are not bf16 values: none for nvfp4 (E2M1 x E4M3 has at most 6
 * significant bits and a magnitude in [2^-10, 2688]); for mxfp8 (E4M3 x 2^(c - 127))
 * only magnitudes below 2^-126 off bf16's subnormal grid (multiples of 2^-133),
 * which needs a scale code c <= 2. A magnitude of 2^128 or more is +-Inf, as in
 * moe_ep_dequantize (not inexact). NaN blocks and codes give 0x7FC0 (not inexact).
 * CUDA: one kernel, 16-byte loads and stores when n is a multiple of 16 (mxfp8) or
 * 32 (nvfp4), inner = 1, R is a multiple of 8 and data and out are 16-byte aligned;
 * element by element otherwise. Capturable in a CUDA graph.
 */
MOE_EP_API moe_ep_status moe_ep_dequantize_bf16(moe_ep_device device, void* stream, moe_ep_format fmt,
                                                const void* data, const void* scale, int64_t outer, int64_t n,
                                                int64_t inner, int64_t transpose_rows, uint16_t* out,
                                                int32_t* out_inexact);

/**
 * moe_ep_dequantize_bf16 of rows that need not be contiguous: row o's codes start at
 * data + o * data_row_bytes and its scales at scale + o * scale_row_bytes (the parts of
 * a packed byte row, e.g. the rows a dispatch received, decoded where they lie; no copy).
 *   fmt:   MOE_EP_FORMAT_MXFP8 or MOE_EP_FORMAT_NVFP4.
 *   data_row_bytes:  >= the codes of one row (n for mxfp8, ceil(n / 2) for nvfp4).
 *   scale_row_bytes: >= the scales of one row (ceil(n / 32) mxfp8, ceil(n / 16) nvfp4).
 *   out:   [rows, n] uint16 bf16 bits (contiguous).
 *   out_inexact: as moe_ep_dequantize_bf16's.
 * The same values as moe_ep_dequantize_bf16 of the rows made contiguous. CUDA: one
 * kernel, 16-byte loads and stores when n is a multiple of 16 (mxfp8) or 32 (nvfp4) and
 * data, data_row_bytes and out are 16-byte aligned; element by element otherwise.
 * Added in ABI 3 (a new entry point; no struct changed).
 */
MOE_EP_API moe_ep_status moe_ep_dequantize_bf16_rows(moe_ep_device device, void* stream, moe_ep_format fmt,
                                                     const void* data, int64_t data_row_bytes, const void* scale,
                                                     int64_t scale_row_bytes, int64_t rows, int64_t n, uint16_t* out,
                                                     int32_t* out_inexact);

/**
 * moe_ep_dequantize_bf16_rows of rows gathered by route id: out row i is the decode of
 * token row route[i] / num_topk (its codes at data + (route[i] / num_topk) *
 * data_row_bytes, its scales likewise), or all zero bits where route[i] is -1. The
 * one-rank dispatch's row gather and the decode of the gathered rows in one pass: the
 * tokens' codes are read where they lie, no gathered copy is written.
 *   num_tokens: the token rows at data and scale (>= 0).
 *   route:      [rows] int32: -1 or in [0, num_tokens * num_topk).
 *   num_topk:   >= 1.
 *   out:        [rows, n] uint16 bf16 bits. The rest as moe_ep_dequantize_bf16_rows.
 * CPU rejects a route id out of range before writing anything; CUDA writes a zero row
 * for it. Added in ABI 5 (a new entry point; no struct changed).
 */
MOE_EP_API moe_ep_status moe_ep_dequantize_bf16_gather(moe_ep_device device, void* stream, moe_ep_format fmt,
                                                       const void* data, int64_t data_row_bytes, const void* scale,
                                                       int64_t scale_row_bytes, int64_t num_tokens,
                                                       const int32_t* route, int64_t num_topk, int64_t rows,
                                                       int64_t n, uint16_t* out, int32_t* out_inexact);

/* ------------------------------------------------------------- plan/permute */

/**
 * Plan one rank's routes (docs/spec.md section 4), stable by route id.
 *   topk_idx:     [num_tokens, num_topk] int32: expert ids, -1 = unused slot (must not overlap an output:
 *                 the CUDA implementation reads it again after writing route_pos and route_expert).
 *   send_route:   [num_tokens * num_topk] int32 out: route ids sorted by
 *                 (expert, route id); the first sum(counts[0:num_experts])
 *                 entries are routed, the rest hold the unrouted route ids
 *                 (-1 slots and bad ids) in route order.
 *   route_pos:    [num_tokens * num_topk] int32 out: the position of each route
 *                 id in send_route, -1 for an unrouted slot.
 *   route_expert: [num_tokens * num_topk] int32 out: the expert of each routed
 *                 id, -1 for an unrouted slot.
 *   counts:       [num_experts + 1] int32 out: routes per expert, then the
 *                 number of expert ids outside [-1, num_experts) (input errors:
 *                 such slots are not routed; the caller raises).
 * 1 <= num_experts <= 2^30, num_topk >= 1, num_tokens * num_topk <= 2^31 - 2.
 * CUDA: deterministic, no workspace; one block for small plans, three multi-block kernels
 * for large ones (MOE_EP_PLAN_ROUTES=single|multi forces one, for tests and timing).
 */
MOE_EP_API moe_ep_status moe_ep_plan_routes(moe_ep_device device, void* stream, const int32_t* topk_idx,
                                            int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                                            int32_t* send_route, int32_t* route_pos, int32_t* route_expert,
                                            int32_t* counts);

/**
 * One step's entry in a front-end's persistent error record (the record a host reads and
 * clears with one synchronisation, e.g. the PyTorch front-end's static-mode flags):
 *   record[0] |= *error;
 *   record[1]  = max(record[1], sum over le of align_up(tokens_per_expert[le], alignment)).
 *   error:             [1] int32: a step's error bits (a dispatch's or combine's out_error).
 *   tokens_per_expert: [num_local_experts] int32: a dispatch's routes per local expert (>= 0).
 *   record:            [2] int64 in/out: the OR of the error bits, the most aligned rows seen.
 * num_local_experts >= 1, alignment >= 1. CUDA: one kernel, nothing allocated, capturable.
 * Added in ABI 7 (a new entry point; no struct changed).
 */
MOE_EP_API moe_ep_status moe_ep_record_step(moe_ep_device device, void* stream, const int32_t* error,
                                            const int32_t* tokens_per_expert, int64_t num_local_experts,
                                            int64_t alignment, int64_t* record);

/**
 * Permute token rows into send order: dst[i] = tokens[send_route[i] / num_topk]
 * for i < num_rows, a zero row where send_route[i] is -1.
 *   tokens:     [num_tokens, row_bytes] bytes (any element type: codes move unchanged).
 *   send_route: [num_rows] int32: route ids in [0, num_tokens * num_topk) or -1.
 *   dst:        [num_rows, row_bytes] bytes out.
 * CPU rejects a route id out of range; CUDA writes a zero row for it.
 */
MOE_EP_API moe_ep_status moe_ep_permute_rows(moe_ep_device device, void* stream, const void* tokens,
                                             int64_t num_tokens, int64_t num_topk, int64_t row_bytes,
                                             const int32_t* send_route, int64_t num_rows, void* dst);

/* ------------------------------------------------------------------ combine */

/**
 * Form-A combine reduction (docs/spec.md section 6, step 3):
 *   out[t] = (((+0 + Y[t,0]) + Y[t,1]) + ...) + Y[t,K-1] in float32, slot order,
 * with Y[t,k] = rows[route_pos[t*K+k]], or nothing added where route_pos is -1
 * (a NaN in an unused row never reaches the sum).
 *   rows:      [num_rows, hidden] float32: the returned (decoded) expert outputs.
 *   route_pos: [num_tokens * num_topk] int32: row of each route, -1 = none; NULL
 *              means the identity (row t*K+k, num_rows must be num_tokens*num_topk,
 *              unless num_tokens is 0: then there is nothing to reduce).
 *   out:       [num_tokens, hidden] float32.
 * CPU rejects a row index out of range; CUDA adds nothing for it.
 */
MOE_EP_API moe_ep_status moe_ep_combine_reduce(moe_ep_device device, void* stream, const float* rows, int64_t num_rows,
                                               const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                               int64_t hidden, float* out);

/**
 * moe_ep_combine_reduce of bf16 rows (a bf16 combine format's rows are bf16 values:
 * half the bytes to read, the same float32 sums bit for bit).
 *   rows: [num_rows, hidden] uint16 bf16 bit patterns. The rest as moe_ep_combine_reduce.
 * CUDA (both entries): 16-byte loads, four float32 or eight bf16 values a thread, when
 * hidden allows it and rows and out are 16-byte aligned; element by element otherwise.
 * Added in ABI 3 (a new entry point; no struct changed).
 */
MOE_EP_API moe_ep_status moe_ep_combine_reduce_bf16(moe_ep_device device, void* stream, const uint16_t* rows,
                                                    int64_t num_rows, const int32_t* route_pos, int64_t num_tokens,
                                                    int64_t num_topk, int64_t hidden, float* out);

/**
 * moe_ep_combine_reduce of float32 rows that have not been through the combine format yet:
 * every route's row goes through fmt's round trip (its encode and decode, section 8, bit
 * for bit: blocks of 32 (mxfp8) or 16 (nvfp4) along hidden, the last one partial) as it
 * is read, then into the slot-order sum: out[t] = ((+0 + RT(rows[p_0])) + RT(rows[p_1])) + ...
 * One pass over the unrounded expert outputs where the rows would otherwise be rounded
 * in place first and read again (the one-rank combine: nothing travels between the two).
 *   fmt: MOE_EP_FORMAT_MXFP8 or MOE_EP_FORMAT_NVFP4.
 *   The rest as moe_ep_combine_reduce (rows are not written).
 * CUDA: four values a thread, a block's lanes agreeing on its scale through shuffles, when
 * hidden is a multiple of the block and rows and out are 16-byte aligned; one block a
 * thread otherwise. Added in ABI 5 (a new entry point; no struct changed).
 */
MOE_EP_API moe_ep_status moe_ep_combine_reduce_round_trip(moe_ep_device device, void* stream, moe_ep_format fmt,
                                                          const float* rows, int64_t num_rows,
                                                          const int32_t* route_pos, int64_t num_tokens,
                                                          int64_t num_topk, int64_t hidden, float* out);

/**
 * The one-rank combine's last pass: the slot-order sums of moe_ep_combine_reduce (float32
 * rows), moe_ep_combine_reduce_bf16 (bf16 rows) or moe_ep_combine_reduce_round_trip
 * (float32 rows through round_trip's format as they are read), NaN everywhere when *error
 * is set, encoded in out_format: bit for bit moe_ep_quantize(out_format, sums, num_tokens,
 * hidden, 1) of those sums (after the NaN) on the same device (a sum that is NaN because a
 * row held one has the device's NaN bits: CUDA's additions give 0x7FFFFFFF, which bf16
 * keeps as 0x7FFF; the block formats encode every NaN alike). The float32 sums are never written: one pass
 * where the sum, the NaN select and the encode would read and write them twice more.
 *   rows_dtype: MOE_EP_DTYPE_F32 or MOE_EP_DTYPE_BF16: rows' element type.
 *   round_trip: MOE_EP_FORMAT_NONE, or MOE_EP_FORMAT_MXFP8 / MOE_EP_FORMAT_NVFP4 (float32 rows only).
 *   rows, num_rows, route_pos, num_tokens, num_topk, hidden: as moe_ep_combine_reduce.
 *   error:      [1] uint8 (device memory on CUDA), or NULL for none: nonzero: every sum is
 *               the quiet NaN 0x7FC00000 (the spec's NaN on a data-dependent error).
 *   out_format: MOE_EP_FORMAT_BF16, MOE_EP_FORMAT_MXFP8 or MOE_EP_FORMAT_NVFP4.
 *   out_data, out_scale: the encoded [num_tokens, hidden] (the layout above, blocks along
 *               hidden; out_scale NULL for bf16).
 * CPU rejects a row index out of range (writing nothing); CUDA adds nothing for it. CUDA:
 * 16-byte loads, four float32 or eight bf16 values a thread, a block's lanes agreeing on
 * its scale through shuffles, when hidden is a multiple of 32 and rows and out_data are
 * 16-byte aligned; 32 columns a thread otherwise. Added in ABI 6 (a new entry point; the
 * moe_ep_dtype enum moved above its first use, unchanged).
 */
MOE_EP_API moe_ep_status moe_ep_combine_reduce_encode(moe_ep_device device, void* stream, moe_ep_dtype rows_dtype,
                                                      moe_ep_format round_trip, const void* rows, int64_t num_rows,
                                                      const int32_t* route_pos, int64_t num_tokens, int64_t num_topk,
                                                      int64_t hidden, const uint8_t* error, moe_ep_format out_format,
                                                      void* out_data, void* out_scale);

/* ------------------------------------------------------------------ experts */

/**
 * The static description of one rank's expert buffer (docs/spec.md section 5).
 * Rows are expert-major: local expert e owns rows [off_e, off_e + group_sizes[e])
 * with off_e = group_sizes[0] + ... + group_sizes[e-1]; rows after the last
 * slab belong to no expert and get zero outputs (and no gradient).
 */
typedef struct {
  int64_t num_rows;           /* C >= 0: rows of the buffer */
  int64_t hidden;             /* H >= 1 */
  int64_t intermediate;       /* I >= 1 */
  int64_t num_local_experts;  /* E_local >= 1 */
  int32_t apply_topk_in_fc1;  /* 1: y = R_int(w*h) W2; 0: y = w * (R_int(h) W2) */
  int32_t has_clamp;          /* 1: the SwiGLU clamp with limit gate_up_clamp */
  float gate_up_clamp;        /* L > 0, finite (the stored absolute value) */
  int32_t intermediate_format; /* a moe_ep_format: R_int along I (NONE: identity) */
} moe_ep_expert_desc;

/** Bytes of float32 scratch moe_ep_expert_forward needs for desc (>= 0). */
MOE_EP_API size_t moe_ep_expert_forward_workspace(const moe_ep_expert_desc* desc);
/** Bytes of float32 scratch moe_ep_expert_backward needs for desc (>= 0). */
MOE_EP_API size_t moe_ep_expert_backward_workspace(const moe_ep_expert_desc* desc);

/**
 * Grouped SwiGLU expert MLP, forward (FC1, clamp, SwiGLU, router weight, R_int, FC2).
 *   x:           [C, H] float32: decoded input rows (padding rows zero).
 *   w:           [C] float32: router weight of every row (0 in padding).
 *   fc1:         [E_local, H, 2I] float32: decoded FC1 weights (gate columns 0..I-1, up I..2I-1).
 *   fc2:         [E_local, I, H] float32: decoded FC2 weights.
 *   group_sizes: [E_local] int32: slab sizes, each >= 0, sum <= C. CPU rejects
 *                others; CUDA counts a negative size as 0 and ends slabs at C.
 *   y:           [C, H] float32 out: the expert output before the combine round trip.
 *   c:           [C, 2I] float32 out: the FC1 output before the clamp (the stash
 *                is its bf16 rounding).
 *   workspace:   scratch of moe_ep_expert_forward_workspace(desc) bytes, device
 *                memory for CUDA (NULL allowed when that is 0).
 */
MOE_EP_API moe_ep_status moe_ep_expert_forward(moe_ep_device device, void* stream, const moe_ep_expert_desc* desc,
                                               const float* x, const float* w, const float* fc1, const float* fc2,
                                               const int32_t* group_sizes, float* y, float* c, void* workspace,
                                               size_t workspace_bytes);

/**
 * Grouped SwiGLU expert MLP, backward (docs/spec.md section 9.2: recomputation
 * from the bf16 stash; every rounding point straight-through).
 *   x, w, fc1, fc2, group_sizes: as moe_ep_expert_forward.
 *   fc1_c: [C, 2I] uint16 bf16 bits: the stash (pre-clamp FC1 output).
 *   dy:    [C, H] float32: the output cotangent of every row.
 *   dx:    [C, H] float32 out;  dw: [C] float32 out;
 *   dfc1:  [E_local, H, 2I] float32 out;  dfc2: [E_local, I, H] float32 out
 *          (zero for an expert with no rows).
 *   workspace: scratch of moe_ep_expert_backward_workspace(desc) bytes.
 */
MOE_EP_API moe_ep_status moe_ep_expert_backward(moe_ep_device device, void* stream, const moe_ep_expert_desc* desc,
                                                const float* x, const float* w, const float* fc1, const float* fc2,
                                                const uint16_t* fc1_c, const float* dy, const int32_t* group_sizes,
                                                float* dx, float* dw, float* dfc1, float* dfc2, void* workspace,
                                                size_t workspace_bytes);

/* -------------------------------------------------------------------- layer */

/*
 * The layer object: one rank's expert computation for one configuration on one
 * device. Created once (it allocates every workspace then); the per-step stages
 * allocate nothing, never synchronise with the host and, on CUDA, only enqueue
 * work on the caller's stream, so they can be captured in a CUDA graph. A layer
 * is used by one thread at a time (stages of one layer must not run
 * concurrently on different streams: they share the workspaces).
 *
 * Operands: x, fc1 and fc2 have the layer's operand_dtype, MOE_EP_DTYPE_BF16
 * (bit patterns, uint16_t) or MOE_EP_DTYPE_F32. With bf16 operands on CUDA the
 * expert GEMMs run on tensor cores (CUTLASS grouped GEMMs, float32
 * accumulation; moe_ep_layer_get_info says whether this build and shape have
 * them). A float32 value the spec computes exactly that is not a bf16 value (the
 * FC2 operand without an intermediate_format, the backward's cotangents) enters
 * them as the sum of three bf16 values (hi + mid + lo, each the bf16 rounding of
 * what the previous ones left), whose products the float32 accumulator sums:
 * the float32 operand to within 2^-24 of its magnitude, inside the spec's
 * budgets (docs/native.md). With backward_operand_format BF16 the backward's
 * operands are bf16 values by the spec's own rounding: one piece each.
 *
 * Versioning: the configuration starts with its size. A caller sets
 * struct_size = sizeof(moe_ep_layer_config) as its header defines it
 * (MOE_EP_LAYER_CONFIG_INIT does); the library reads the fields that fit in
 * struct_size, treats fields past it as 0 (their defaults), and rejects a larger
 * struct whose bytes past the library's own size are not all zero. Fields are
 * only ever appended.
 */

typedef struct {
  uint32_t struct_size;         /* sizeof(moe_ep_layer_config) of the caller's header */
  int32_t device;               /* moe_ep_device */
  int32_t cuda_device;          /* the CUDA device ordinal the layer lives on (CUDA only) */
  int32_t operand_dtype;        /* moe_ep_dtype of x, fc1, fc2 */
  int64_t max_rows;             /* C >= 0: the most rows of the expert-major buffer a stage takes */
  int64_t hidden;               /* H >= 1 */
  int64_t intermediate;         /* I >= 1 */
  int64_t num_local_experts;    /* E_local >= 1 */
  int32_t apply_topk_in_fc1;    /* 1: y = R_int(w*h) W2; 0: y = w * (R_int(h) W2) */
  int32_t has_clamp;            /* 1: the SwiGLU clamp with limit gate_up_clamp */
  float gate_up_clamp;          /* L > 0, finite */
  int32_t intermediate_format;  /* moe_ep_format: R_int along I (NONE: identity) */
  int32_t combine_format;       /* moe_ep_format: the per-route round trip of y along H (NONE: none) */
  int32_t with_backward;        /* 1: also allocate what moe_ep_layer_experts_backward needs */
  /* The device exchange (section "exchange" below); ex_num_ranks = 0: none (every ex_ field ignored). */
  int32_t ex_num_ranks;         /* N >= 1: ranks of the expert-parallel group; 0: no exchange */
  int32_t ex_rank;              /* this rank, in [0, N) */
  int32_t ex_num_topk;          /* K >= 1 */
  int64_t ex_num_experts;       /* E = N * num_local_experts */
  int64_t ex_max_tokens;        /* the most tokens a rank passes to one dispatch (>= 0) */
  int64_t ex_token_bytes;       /* the most bytes of one token row a dispatch moves (>= 1) */
  int64_t ex_expert_alignment;  /* A >= 1: every local expert's slab is a multiple of A rows */
  int64_t ex_timeout_ms;        /* bound of every wait for a peer (0: 60000) */
  int32_t ex_num_sms;           /* thread blocks of the copy kernels (0: 2 per multiprocessor of the device;
                                   the CPU implementation ignores it) */
  int32_t ex_combine_order;     /* moe_ep_combine_order */
  /* Appended in ABI 3. */
  int32_t expert_out_dtype;     /* moe_ep_dtype of the expert-output rows y (experts_forward writes them, combine
                                   reads them): MOE_EP_DTYPE_F32 (0, default) or MOE_EP_DTYPE_BF16, which needs
                                   combine_format MOE_EP_FORMAT_BF16 or MOE_EP_FORMAT_NVFP4 (the rows are then bf16
                                   values exactly: half the bytes for the same numbers; mxfp8's are not always;
                                   nvfp4 also needs hidden % 16 == 0) */
  int32_t ex_mode;              /* moe_ep_exchange_mode of the device exchange (0: throughput); was reserved0 (0) */
  /* Appended in ABI 8. */
  int32_t backward_operand_format; /* moe_ep_format of the backward's GEMM operands (docs/spec.md 9.2, the spec's
                                      backward_operand_format): MOE_EP_FORMAT_NONE (0, default): exact float32
                                      operands; MOE_EP_FORMAT_BF16: the cotangent, dc and w*h rounded to bf16
                                      (nearest even) before their GEMMs, dw = <a, h> in both placements. On tensor
                                      cores the backward is then four bf16 grouped GEMMs and one fused SwiGLU pass */
  int32_t reserved1;            /* must be 0 */
} moe_ep_layer_config;

#define MOE_EP_LAYER_CONFIG_INIT {sizeof(moe_ep_layer_config)}

typedef struct {
  uint32_t struct_size;         /* set by the caller, as for the configuration */
  int32_t tensor_cores;         /* 1: the expert GEMMs run on tensor cores (CUTLASS), 0: float32 kernels */
  int32_t fc2_operand_planes;   /* bf16 pieces the FC2 operand is split into (1 when it is exactly bf16, else 3) */
  int32_t reserved;
  uint64_t workspace_bytes;     /* what the layer allocated */
} moe_ep_layer_info;

/** A layer (opaque). */
typedef struct moe_ep_layer moe_ep_layer;

/** Make a layer for config (allocates its workspaces). layer: out (NULL on failure). */
MOE_EP_API moe_ep_status moe_ep_layer_create(const moe_ep_layer_config* config, moe_ep_layer** layer);
/** Free a layer after the work enqueued with it (NULL: nothing to do). */
MOE_EP_API moe_ep_status moe_ep_layer_destroy(moe_ep_layer* layer);
/** What the layer runs (info->struct_size set by the caller). */
MOE_EP_API moe_ep_status moe_ep_layer_get_info(const moe_ep_layer* layer, moe_ep_layer_info* info);

/**
 * The experts' forward over the expert-major buffer (docs/spec.md section 5),
 * the combine round trip included.
 *   num_rows:    C, 0 <= C <= config.max_rows.
 *   x:           [C, H] operand_dtype: the decoded input rows (padding rows zero).
 *   w:           [C] float32: the router weight of every row (0 in padding).
 *   fc1:         [E_local, H, 2I] operand_dtype;  fc2: [E_local, I, H] operand_dtype.
 *   group_sizes: [E_local] int32 (device memory on CUDA): slab sizes from row 0;
 *                each >= 0, sum <= C (CPU rejects others; CUDA counts a
 *                negative size as 0 and ends the slabs at C).
 *   y:           [C, H] config.expert_out_dtype out (float32 by default, bf16 bit patterns with
 *                MOE_EP_DTYPE_BF16): R_comb of the expert output; rows of no expert zero.
 *                16-byte aligned on the tensor-core path (moe_ep_layer_get_info says which).
 *   fc1_c:       [C, 2I] uint16 bf16 out, or NULL: the stash (the bf16 rounding of
 *                the FC1 output before the clamp); rows of no expert zero.
 * With a device exchange (config.ex_num_ranks >= 1), after its dispatch, the stash
 * rows of the slabs' padding (rows past a local expert's routes) are zero, whatever
 * the weights hold. With a device exchange whose last step reported an error
 * (the dispatch's out_error bits, the same on every rank, or a combine's
 * timeout), y and fc1_c are all NaN
 * (the spec's all-ranks NaN rule), decided on the device: no host synchronisation.
 * The same holds for every output of moe_ep_layer_experts_backward.
 */
MOE_EP_API moe_ep_status moe_ep_layer_experts_forward(moe_ep_layer* layer, void* stream, int64_t num_rows,
                                                      const void* x, const float* w, const void* fc1, const void* fc2,
                                                      const int32_t* group_sizes, void* y, uint16_t* fc1_c);

/**
 * moe_ep_layer_experts_forward with mxfp8 expert weights read as they are stored, the
 * decode forward's weight read at about half the bytes of their bf16 decode
 * (docs/cuda-nccl.md, "The block-scaled-weights forward"). The layer's operand_dtype must be
 * MOE_EP_DTYPE_BF16, and hidden and intermediate multiples of 32.
 *   num_rows, x, w, group_sizes, y, fc1_c: as moe_ep_layer_experts_forward (x bf16).
 *   fc1_codes:  [E_local, 2I, H] uint8 E4M3 codes;  fc1_scales: [E_local, 2I, H / 32] uint8 E8M0:
 *               the weight fc1 [E_local, H, 2I] stored transposed, blocked along H (K-major).
 *   fc2_codes:  [E_local, H, I] uint8;  fc2_scales: [E_local, H, I / 32] uint8: fc2 [E_local, I, H]
 *               stored the same way, blocked along I.
 *   inexact:    [1] int32 (device memory on CUDA) or NULL: 1 is ORed in (never cleared here) when a
 *               weight value is not a bf16 value.
 * The values are those of moe_ep_layer_experts_forward given the weights' bf16 decode
 * (moe_ep_dequantize_bf16 with transpose_rows, into [E, K, N]): a weight value bf16 cannot
 * hold (mxfp8 below 2^-126 off bf16's grid, scale codes 0..2 only) is NaN there, so the
 * outputs that depend on it are NaN, and *inexact is set. On CUDA the tensor cores run on
 * the codes (a grouped GEMM that decodes them to bf16 in registers, one pass over the
 * weights per 64 rows of an expert; float32 accumulation, so sums may differ from the bf16
 * path's in order only); that needs the tensor-core path and hidden and intermediate
 * multiples of 128 (else MOE_EP_ERR_UNSUPPORTED), x and the codes 16-byte and the scales
 * 4-byte aligned. On CPU the float32 kernels run on the same decoded values.
 * Added in ABI 4 (a new entry point; no struct changed).
 */
MOE_EP_API moe_ep_status moe_ep_layer_experts_forward_mxfp8(moe_ep_layer* layer, void* stream, int64_t num_rows,
                                                            const void* x, const float* w, const uint8_t* fc1_codes,
                                                            const uint8_t* fc1_scales, const uint8_t* fc2_codes,
                                                            const uint8_t* fc2_scales, const int32_t* group_sizes,
                                                            void* y, uint16_t* fc1_c, int32_t* inexact);

/**
 * moe_ep_layer_experts_forward with block-scaled expert weights read as they are stored:
 * weight_format MOE_EP_FORMAT_MXFP8 (as moe_ep_layer_experts_forward_mxfp8) or
 * MOE_EP_FORMAT_NVFP4, the decode forward's weight read at about half (mxfp8) or 0.28
 * (nvfp4) of the bytes of their bf16 decode (docs/cuda-nccl.md, "The block-scaled-weights
 * forward"). The layer's operand_dtype must be MOE_EP_DTYPE_BF16, and hidden and
 * intermediate multiples of the format's block (32 mxfp8, 16 nvfp4).
 *   num_rows, x, w, group_sizes, y, fc1_c: as moe_ep_layer_experts_forward (x bf16).
 *   fc1_codes:  [E_local, 2I, H] uint8 E4M3 codes (mxfp8) or [E_local, 2I, H / 2] uint8, two
 *               E2M1 codes a byte, element 2 j in the low nibble (nvfp4);
 *   fc1_scales: [E_local, 2I, H / 32] uint8 E8M0 (mxfp8) or [E_local, 2I, H / 16] uint8 E4M3
 *               (nvfp4): the weight fc1 [E_local, H, 2I] stored transposed, blocked along H.
 *   fc2_codes, fc2_scales: fc2 [E_local, I, H] stored the same way ([E_local, H, ...]),
 *               blocked along I.
 *   inexact:    [1] int32 (device memory on CUDA) or NULL: 1 is ORed in (never cleared here)
 *               when a weight value is not a bf16 value (mxfp8 only: every nvfp4 value is).
 * The values are those of moe_ep_layer_experts_forward given the weights' bf16 decode
 * (moe_ep_dequantize_bf16 with transpose_rows, into [E, K, N]); moe_ep_layer_experts_forward_mxfp8
 * says what mxfp8 adds (values bf16 cannot hold are NaN, and flagged). On CUDA the tensor
 * cores run on the codes (grouped GEMMs that decode them to bf16 in registers, one pass
 * over the weights per 48 or 64 rows of an expert; float32 accumulation, so sums may differ
 * from the bf16 path's in order only); that needs the tensor-core path and hidden and
 * intermediate multiples of 128 (else MOE_EP_ERR_UNSUPPORTED), x and the codes 16-byte
 * aligned, the scales 4-byte (mxfp8) or 8-byte (nvfp4) aligned. On CPU the float32
 * kernels run on the same decoded values.
 * Added in ABI 10 (a new entry point; no struct changed).
 */
MOE_EP_API moe_ep_status moe_ep_layer_experts_forward_block_scaled(
    moe_ep_layer* layer, void* stream, int32_t weight_format, int64_t num_rows, const void* x, const float* w,
    const uint8_t* fc1_codes, const uint8_t* fc1_scales, const uint8_t* fc2_codes, const uint8_t* fc2_scales,
    const int32_t* group_sizes, void* y, uint16_t* fc1_c, int32_t* inexact);

/**
 * The experts' backward (docs/spec.md section 9.2: recomputed from the stash,
 * every rounding point straight-through), with the layer's backward_operand_format
 * (NONE: exact float32 operands; BF16: R_bf16 of the cotangent, of dc and of w*h
 * before their GEMMs). Needs config.with_backward = 1.
 *   num_rows, x, w, fc1, fc2, group_sizes: as moe_ep_layer_experts_forward.
 *   fc1_c: [C, 2I] uint16 bf16: the stash.
 *   dy:    [C, H] dy_dtype: the cotangent of every row; dy_dtype MOE_EP_DTYPE_F32, or
 *          MOE_EP_DTYPE_BF16 for a bf16 cotangent (exact: on tensor cores it is then
 *          one bf16 operand instead of three pieces).
 *   dx: [C, H] float32 out;  dw: [C] float32 out (rows of no expert: zero);
 *   dfc1: [E_local, H, 2I] float32 out;  dfc2: [E_local, I, H] float32 out (zero for an expert with no rows).
 */
MOE_EP_API moe_ep_status moe_ep_layer_experts_backward(moe_ep_layer* layer, void* stream, int64_t num_rows,
                                                       const void* x, const float* w, const void* fc1,
                                                       const void* fc2, const uint16_t* fc1_c, const void* dy,
                                                       int32_t dy_dtype, const int32_t* group_sizes, float* dx,
                                                       float* dw, float* dfc1, float* dfc2);

/* flags of moe_ep_layer_experts_backward_ex. */
#define MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS 1 /* dfc1 and dfc2 hold float32 gradients (e.g. a training loop's
                                                     main_grad) and get this step's added: dfc += gradient (on
                                                     tensor cores in the weight-gradient GEMMs' epilogue: one
                                                     float32 addition per element, no extra pass); an expert
                                                     with no rows leaves them as they are */
#define MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 2 /* dfc1 and dfc2 are bf16: [E_local, H, 2I] and [E_local, I, H]
                                               uint16 bf16 bit patterns, the float32 gradients rounded to
                                               nearest even (the values a cast of the float32 result gives;
                                               zeros for an expert with no rows). Needs operand_dtype bf16;
                                               not with MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS.
                                               Added in ABI 9 */

/**
 * moe_ep_layer_experts_backward with flags (0: the same call). With
 * MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS, dfc1 and dfc2 are read and the step's weight
 * gradients added to them (the gradient is the one moe_ep_layer_experts_backward writes,
 * rounded once more by the addition); after a failed dispatch they are NaN, as every output.
 * With MOE_EP_BACKWARD_WEIGHT_GRADS_BF16 (ABI 9), dfc1 and dfc2 point to bf16 arrays and get
 * the bf16 rounding of the gradient moe_ep_layer_experts_backward writes (16-byte aligned
 * on the tensor-core path): the bf16 backward's weight-gradient GEMMs round in their
 * epilogue; the exact backward and the staged path compute each expert's float32 gradient
 * in the layer's buffers (sized at creation) and round it once.
 * Added in ABI 8 (with the configuration's backward_operand_format); dfc1 and dfc2 are
 * void* since ABI 9 (float* before: the same pointers).
 */
MOE_EP_API moe_ep_status moe_ep_layer_experts_backward_ex(moe_ep_layer* layer, void* stream, int64_t num_rows,
                                                          const void* x, const float* w, const void* fc1,
                                                          const void* fc2, const uint16_t* fc1_c, const void* dy,
                                                          int32_t dy_dtype, const int32_t* group_sizes, float* dx,
                                                          float* dw, void* dfc1, void* dfc2, int32_t flags);

/* ----------------------------------------------------------------- exchange */

/*
 * The device exchange: dispatch and combine as stages of the layer, the ranks'
 * rows moved by the GPU itself with stores into the peers' memory, no host
 * synchronisation, capturable in a CUDA graph (docs/cuda-nccl.md, "The device
 * exchange"). Static layout only: the expert-major buffer has max_rows = C rows.
 *
 * Every rank's layer exposes one "symmetric" region of moe_ep_layer_exchange_info
 * bytes (the same size on every rank); the kernels take the N peers' region
 * addresses from a table (moe_ep_layer_set_peers) and do not care where they
 * come from: CUDA IPC between processes on one GPU (the loopback provider of
 * moe_ep_native.exchange), NCCL's symmetric windows (LSA pointers), or plain
 * host memory shared between processes for the CPU implementation (the CPU twin
 * of the protocol, same layout, flags and sequence numbers).
 *
 * Protocol, per stage: a per-stage sequence number lives on the device (so graph
 * replays advance it); a sender waits until the receiver acknowledged the
 * previous step, writes its rows and metadata into the receiver's region, then
 * publishes the step's number in the receiver's flag with a system-scope release;
 * the receiver waits for every peer's flag (acquire), copies locally, then
 * acknowledges. Every wait is bounded by ex_timeout_ms: on expiry the stage sets
 * MOE_EP_EXCHANGE_TIMEOUT in the step's error and the layer's record, finishes
 * without the missing peer (its outputs are NaN) and never hangs; the layer is
 * unusable afterwards (destroy it). The calls of every rank must be made in the
 * same order (dispatch, combine, dispatch, ...), as for any collective.
 */

typedef enum {
  MOE_EP_COMBINE_RANK_SUMS = 0, /* one float32 row per (token, rank): that rank's routes summed in slot order,
                                   then the home rank sums the ranks' rows in rank order (an order the spec allows
                                   within the combine budget; equal to the slot order when a token's routes live
                                   on one rank) */
  MOE_EP_COMBINE_SLOT_ORDER = 1 /* one float32 row per route; the home rank sums in slot order from +0:
                                   bit for bit moe_ep_combine_reduce */
} moe_ep_combine_order;

/*
 * How a stage runs on CUDA. Both move the same rows with the same flags and give the
 * same results, bit for bit; both are capturable in a CUDA graph.
 */
typedef enum {
  MOE_EP_EXCHANGE_THROUGHPUT = 0,  /* five kernels per stage (begin, send, sync, place/finish, ack), chained with
                                      programmatic dependent launch: for many tokens */
  MOE_EP_EXCHANGE_LOW_LATENCY = 1  /* one cooperative kernel per stage (grid-wide barriers between the steps, at
                                      most ex_num_sms blocks, and no more than can be resident): for few tokens */
} moe_ep_exchange_mode;

/* Error bits of a step (out_error) and of the layer's record (moe_ep_layer_exchange_status). */
#define MOE_EP_EXCHANGE_BAD_EXPERT_ID 1 /* some rank's topk_idx held an id outside [-1, E) */
#define MOE_EP_EXCHANGE_OVERFLOW 2      /* some rank's aligned rows exceeded C */
#define MOE_EP_EXCHANGE_TIMEOUT 4       /* a peer did not arrive within ex_timeout_ms */

/**
 * symmetric_bytes (out): bytes of the region every rank must expose;
 * own_region (out): the address of the region the layer allocated for itself
 * (device memory from cudaMalloc, whole allocation: IPC-exportable; or host
 * memory for a CPU layer).
 */
MOE_EP_API moe_ep_status moe_ep_layer_exchange_info(const moe_ep_layer* layer, uint64_t* symmetric_bytes,
                                                    uint64_t* own_region);

/**
 * The peer table: peer_regions[r] = the address, in this process, of rank r's
 * region (num_ranks entries). peer_regions[rank] is this rank's own region:
 * the one the layer allocated, or caller memory of symmetric_bytes bytes,
 * zero-filled, that stays valid while the layer lives (a CPU provider passes a
 * shared-memory mapping here). Call before the first dispatch, not during a capture.
 */
MOE_EP_API moe_ep_status moe_ep_layer_set_peers(moe_ep_layer* layer, const uint64_t* peer_regions);

/** CUDA layers: the cudaIpcMemHandle_t (MOE_EP_IPC_HANDLE_BYTES bytes) of the layer's own region. */
#define MOE_EP_IPC_HANDLE_BYTES 64
MOE_EP_API moe_ep_status moe_ep_layer_ipc_handle(const moe_ep_layer* layer, uint8_t* handle, size_t handle_bytes);

/**
 * CUDA layers: the peer table from every rank's IPC handle ([num_ranks][64]
 * bytes, rank order; this rank's own entry is not opened). The opened mappings
 * are closed by moe_ep_layer_destroy.
 */
MOE_EP_API moe_ep_status moe_ep_layer_set_peers_ipc(moe_ep_layer* layer, const uint8_t* handles, size_t handle_bytes);

/** An NCCL communicator (section "transport"; declared here for the NCCL peer provider). */
typedef struct moe_ep_comm moe_ep_comm;

/**
 * CUDA layers: the peer table from NCCL's symmetric memory (the LSA pointers of
 * one NVLink domain), for ranks on distinct GPUs. Collective over comm: every
 * rank of the layer's exchange calls it with its layer and its rank's comm.
 *   layer: a CUDA layer made with config.ex_num_ranks >= 1 whose peers are not set yet.
 *   comm:  a communicator from moe_ep_comm_init with num_ranks = config.ex_num_ranks,
 *          rank = config.ex_rank and cuda_device = config.cuda_device.
 * Steps: the runtime NCCL must be the very version the library was compiled
 * against (before NCCL 2.31 the device API needs it; else MOE_EP_ERR_UNSUPPORTED
 * naming both); ncclMemAlloc of symmetric_bytes rounded up to 4096 bytes
 * (NCCL_WIN_REQUIRED_ALIGNMENT), zero-filled; ncclCommWindowRegister of it with
 * NCCL_WIN_COLL_SYMMETRIC; ncclDevCommCreate (no resources); when NCCL's LSA team
 * does not hold every rank (ranks on more than one NVLink domain, or NCCL without
 * symmetric-memory support for them) everything is undone and the answer is
 * MOE_EP_ERR_UNSUPPORTED (use the IPC loopback or the grouped send/recv exchange);
 * else one small kernel reads every rank's LSA pointer of the window (this rank's
 * own entry is the window's local mapping, used as the region) and the table is
 * set as by moe_ep_layer_set_peers. Every host wait on NCCL is bounded by comm's
 * timeout_ms (MOE_EP_ERR_COMM on expiry or an NCCL failure).
 * The layer owns the memory, the window and the device communicator:
 * moe_ep_layer_destroy releases them (ncclDevCommDestroy, ncclCommWindowDeregister,
 * ncclMemFree), so comm must outlive the layer. The layer's own region
 * (moe_ep_layer_exchange_info) is then unused. Call once, before the first
 * dispatch, never during a CUDA-graph capture. Builds without the NCCL transport
 * answer MOE_EP_ERR_UNSUPPORTED, and so do CPU layers.
 */
MOE_EP_API moe_ep_status moe_ep_layer_set_peers_nccl(moe_ep_layer* layer, moe_ep_comm* comm);

/**
 * Dispatch (collective): this rank's tokens to the ranks of their experts, into
 * every rank's expert-major buffer in the spec's routing order (local expert,
 * source rank, source token, slot), slabs aligned to ex_expert_alignment.
 * A token crosses to a rank at most once, however many of its K experts live
 * there; its copies into the slots are local writes on the receiver.
 *   num_tokens:   T, 0 <= T <= ex_max_tokens (the same T need not hold on every rank).
 *   row_bytes:    bytes of one token row, 1 <= row_bytes <= ex_token_bytes (the same on every rank).
 *   tokens:       [T, row_bytes] bytes (any encoding: moved unchanged).
 *   topk_idx:     [T, K] int32;  topk_weights: [T, K] float32.
 *   out_tokens:   [C, row_bytes] bytes out: padding rows zero.
 *   out_weights:  [C] float32 out: padding 0.
 *   out_route_metadata: [C, 4] int32 out: (local_expert, src_rank, src_token, src_slot), -1 rows padding.
 *   out_group_sizes:    [E_local] int32 out: the aligned slab sizes, cut at C.
 *   out_tokens_per_expert: [E_local] int32 out, or NULL: routes per local expert.
 *   out_error:    [1] int32 out: the step's error bits, the same on every rank
 *                 (bad ids and overflow: rows that do not fit are dropped).
 * CUDA, one rank: no exchange; the routes are planned in one block up to 4096 routes, over
 * the grid beyond (MOE_EP_ONE_RANK_PLAN=block|grid forces one, for tests and timing).
 */
MOE_EP_API moe_ep_status moe_ep_layer_dispatch(moe_ep_layer* layer, void* stream, int64_t num_tokens,
                                               int64_t row_bytes, const void* tokens, const int32_t* topk_idx,
                                               const float* topk_weights, void* out_tokens, float* out_weights,
                                               int32_t* out_route_metadata, int32_t* out_group_sizes,
                                               int32_t* out_tokens_per_expert, int32_t* out_error);

/*
 * y_dtype of moe_ep_layer_combine: float32 rows of which the combine puts each through mxfp8's
 * (MOE_EP_Y_F32_MXFP8_ROUND_TRIP) or nvfp4's (MOE_EP_Y_F32_NVFP4_ROUND_TRIP) round trip
 * (docs/spec.md section 8) as it reads it, the sums then as for the round-tripped rows in
 * float32, bit for bit. A block-scaled combine_format's rounding done by the combine rather
 * than by the experts forward: a layer made with combine_format MOE_EP_FORMAT_NONE writes y
 * unrounded, and this combine rounds it, one pass over y fewer. hidden must be a multiple of
 * 128; on CUDA y and out must be 16-byte aligned. mxfp8: added in ABI 7; nvfp4: in ABI 11.
 */
#define MOE_EP_Y_F32_MXFP8_ROUND_TRIP 2
#define MOE_EP_Y_F32_NVFP4_ROUND_TRIP 3

/**
 * Combine (collective) of the last dispatch: the expert-major rows back to their
 * tokens, unweighted, summed per token in float32 (moe_ep_combine_order).
 *   num_tokens:  T of the last dispatch on this rank.
 *   y:           [C, H] y_dtype: rows as dispatched (padding rows never read).
 *   y_dtype:     MOE_EP_DTYPE_F32, or MOE_EP_DTYPE_BF16 (bf16 bit patterns: e.g. the rows of
 *                experts_forward with expert_out_dtype bf16); sums are float32 either way,
 *                the same numbers for the same values. Or MOE_EP_Y_F32_MXFP8_ROUND_TRIP /
 *                MOE_EP_Y_F32_NVFP4_ROUND_TRIP: float32 rows each put through mxfp8's /
 *                nvfp4's round trip as the combine reads them.
 *   out:         [T, H] out_dtype out: the sums (+0 for a token with no route), float32, or
 *                their bf16 encoding (nearest, ties to even: the output encoding for bf16).
 *   out_dtype:   MOE_EP_DTYPE_F32 or MOE_EP_DTYPE_BF16.
 *   row_values:  [C] float32, or NULL: one value per row returned to its (token, slot)...
 *   out_values:  [T, K] float32 out (with row_values): ...here; exactly 0 for a -1 slot.
 *   out_error:   [1] int32 out, or NULL: this step's error bits (the dispatch's, and a timeout).
 * The backward's exchanges are these two stages: combine_backward is a dispatch
 * of the output cotangent rows, dispatch_backward a combine of the row
 * cotangents with the router-weight cotangents as row_values.
 */
MOE_EP_API moe_ep_status moe_ep_layer_combine(moe_ep_layer* layer, void* stream, int64_t num_tokens, const void* y,
                                              int32_t y_dtype, void* out, int32_t out_dtype, const float* row_values,
                                              float* out_values, int32_t* out_error);

/**
 * The layer's error record: the OR of every step's bits since the last clear.
 * Waits for `stream` first (one host synchronisation). clear: 1 resets the record.
 */
MOE_EP_API moe_ep_status moe_ep_layer_exchange_status(moe_ep_layer* layer, void* stream, int32_t* bits, int32_t clear);

/* ---------------------------------------------------------------- transport */

/*
 * The NCCL transport: moves rows between the ranks of one expert-parallel
 * group. Built with MOE_EP_NATIVE_NCCL=ON (needs the CUDA implementation and
 * NCCL, docs/native.md says how the build finds it); other builds answer
 * MOE_EP_ERR_UNSUPPORTED to every call below except moe_ep_has_nccl.
 *
 * - A communicator is made from a unique id of MOE_EP_UNIQUE_ID_BYTES bytes
 *   that one rank creates (moe_ep_comm_unique_id) and every rank receives out
 *   of band (the PyTorch front-end passes it through torch.distributed's store).
 * - Its NCCL communicator is non-blocking: moe_ep_comm_init returns
 *   MOE_EP_ERR_COMM when the group has not formed within timeout_ms, and every
 *   collective call waits (on the host, at most timeout_ms) only for NCCL to
 *   have enqueued its work, never for the GPU.
 * - moe_ep_comm_all_gather and moe_ep_comm_exchange are collective over the
 *   communicator: every rank calls them in the same order with matching sizes.
 *   They enqueue on `stream` (a cudaStream_t on the communicator's device, NULL
 *   for the legacy default stream) and never synchronise, so they can be
 *   captured in a CUDA graph.
 * - A failure of NCCL (a peer gone, a timeout) returns MOE_EP_ERR_COMM; the
 *   communicator must then be destroyed.
 */

#define MOE_EP_UNIQUE_ID_BYTES 128

/* moe_ep_comm, an NCCL communicator over num_ranks ranks (opaque), is declared in section "exchange". */

/** 1 when the library was built with the NCCL transport, else 0. */
MOE_EP_API int moe_ep_has_nccl(void);

/**
 * A new unique id for moe_ep_comm_init (one rank calls this).
 *   id: [id_bytes] uint8 out; id_bytes must be MOE_EP_UNIQUE_ID_BYTES.
 */
MOE_EP_API moe_ep_status moe_ep_comm_unique_id(uint8_t* id, size_t id_bytes);

/**
 * Join the communicator of `id` as `rank` of `num_ranks` (collective: blocks
 * until every rank has joined, at most timeout_ms).
 *   id:          [id_bytes] uint8: the unique id; id_bytes must be MOE_EP_UNIQUE_ID_BYTES.
 *   num_ranks:   >= 1;  rank: in [0, num_ranks);  cuda_device: a CUDA device ordinal.
 *   timeout_ms:  >= 1: the bound on every host-side wait of this communicator.
 *   comm:        out: the communicator (NULL on failure).
 */
MOE_EP_API moe_ep_status moe_ep_comm_init(const uint8_t* id, size_t id_bytes, int32_t num_ranks, int32_t rank,
                                          int32_t cuda_device, int64_t timeout_ms, moe_ep_comm** comm);

/** Finalize and free a communicator after its enqueued work (NULL: nothing to do); aborts it when finalizing fails. */
MOE_EP_API moe_ep_status moe_ep_comm_destroy(moe_ep_comm* comm);

/** num_ranks (out) and rank (out) of a communicator. */
MOE_EP_API moe_ep_status moe_ep_comm_info(const moe_ep_comm* comm, int32_t* num_ranks, int32_t* rank);

/**
 * All-gather (the count exchange): recv[r] = rank r's send, for every rank r.
 *   send: [bytes] bytes (device memory).
 *   recv: [num_ranks, bytes] bytes out (device memory).
 */
MOE_EP_API moe_ep_status moe_ep_comm_all_gather(moe_ep_comm* comm, void* stream, const void* send, void* recv,
                                                int64_t bytes);

/**
 * The variable-size row exchange (dispatch and combine): one grouped
 * ncclSend/ncclRecv per peer with rows.
 *   send:      [sum(send_rows), row_bytes] bytes (device): the rows for rank 0,
 *              then those for rank 1, ...
 *   send_rows: [num_ranks] int64 (host): rows for every rank, >= 0.
 *   recv:      [sum(recv_rows), row_bytes] bytes out (device): rows from rank 0,
 *              then from rank 1, ...
 *   recv_rows: [num_ranks] int64 (host): rows from every rank, >= 0; must equal
 *              what that rank sends here (not checkable locally: a mismatch is
 *              an NCCL error or a hang that the timeout ends).
 *   row_bytes: >= 1.
 */
MOE_EP_API moe_ep_status moe_ep_comm_exchange(moe_ep_comm* comm, void* stream, const void* send,
                                              const int64_t* send_rows, void* recv, const int64_t* recv_rows,
                                              int64_t row_bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_EP_NATIVE_H_ */
