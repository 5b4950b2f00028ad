// The nvfp4-weights GEMM of nvfp4_weights_gemm.cuh (same contract: Nvfp4WeightsGemm with one
// x plane, the same exact decode, the same NaN rule) on Hopper's warpgroup MMAs:
// wgmma.mma_async m64nNk16 with the decoded weights as the register A operand and the x rows
// as the shared-memory B operand, N = 8 to 64 (the pass's x rows). The mma.sync kernel's
// warps issue 4 kNt mma.sync a k16 step and load and permute every x fragment themselves;
// here a block (one warpgroup: 4 warps, 128 weight rows of one expert) issues two wgmmas a
// k16 step, whose B operand the tensor cores read from shared memory at full rate, and the
// warps decode the next 64 k of weights while the last ones' wgmmas run (two register
// buffers of A fragments).
//
// No permutation of x: the stage's x rows are copied as they are, 16 bytes at a time, into
// the no-swizzle K-major core matrices a wgmma descriptor reads (8 rows x 16 bytes, 128
// bytes apart along k (LBO), 256 along the rows (SBO); a k16 step's core matrices
// kMaxNt * 256 bytes after the last's). So the A fragment must hold the true k order: lane
// (g, q) needs, for k16 step s, the codes k = 16 s + 2 q, 2 q + 1 and 16 s + 8 + 2 q, + 9 of its
// rows, which are byte q of the row's code words 2 s and 2 s + 1. The quad's 4 lanes read the
// same 16 bytes of a row (one shared-memory broadcast: 8 rows a warp, 128 distinct bytes, one
// wavefront with the rows' chunks swizzled by (row >> 1) & 3), and each lane decodes byte q of
// every word: one byte permute puts the byte's low code at bits 15..12 and its high code at
// 31..28 (the mma.sync kernel's raw_pair position), then the same bit moves and multiplies.
//
// Rows: wgmma u (0, 1) takes the block's weight rows 64 u .. 64 u + 63; warp w holds rows
// 64 u + 16 w + g and + 8 + g (lane = 4 g + q), the A fragment of mma.sync m16n8k16. The
// accumulator of wgmma u: d[4 i + c] at weight row 64 u + 16 w + g + 8 (c >> 1) and x row
// 8 i + 2 q + (c & 1).
//
// Ordering: cp.async writes shared memory through the generic proxy, wgmma reads it through
// the async proxy: each thread fences (fence.proxy.async.shared::cta) after its copies landed
// and before the block barrier that precedes the stage's wgmmas. A stage buffer is refilled
// only after the wgmmas that read it completed (wgmma.wait_group before that barrier), and an
// A buffer is decoded into only after the wgmmas that read it completed.
//
// Included by nvfp4_weights_gemm.cuh after its decode helpers (nvw::scale_mults,
// nvw::stage_all_fast, nvw::kTwo126, nvw::cp_async8), before nvfp4_weights_gemm, which runs
// this kernel for one x plane when Nvfp4WeightsGemm::wgmma is set.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_NVFP4_WEIGHTS_WGMMA_CUH_
#define MOE_EP_NATIVE_CUDA_GEMM_NVFP4_WEIGHTS_WGMMA_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moe_ep {
namespace cuda {
namespace nvg {

// wgmma.mma_async m64nNk16, float32 += bf16 x bf16, A from registers (4 bf16x2: the
// m16n8k16 A fragment of the warp's 16 rows), B from shared memory (descriptor, K-major),
// d += A B.
template <int kN>
struct Wgmma;
template <>
struct Wgmma<8> {
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3"
        "}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};
template <>
struct Wgmma<16> {
  static __device__ __forceinline__ void mma(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};
template <>
struct Wgmma<24> {
  static __device__ __forceinline__ void mma(float (&d)[12], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7,"
        "%8, %9, %10, %11"
        "}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};
template <>
struct Wgmma<32> {
  static __device__ __forceinline__ void mma(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7,"
        "%8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};
template <>
struct Wgmma<40> {
  static __device__ __forceinline__ void mma(float (&d)[20], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %25, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7,"
        "%8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19"
        "}, {%20, %21, %22, %23}, %24, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};
template <>
struct Wgmma<48> {
  static __device__ __forceinline__ void mma(float (&d)[24], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7,"
        "%8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23"
        "}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};
template <>
struct Wgmma<56> {
  static __device__ __forceinline__ void mma(float (&d)[28], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %33, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7,"
        "%8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23,"
        "%24, %25, %26, %27"
        "}, {%28, %29, %30, %31}, %32, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};
template <>
struct Wgmma<64> {
  static __device__ __forceinline__ void mma(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7,"
        "%8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23,"
        "%24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
  }
};

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// The generic proxy's shared memory writes (cp.async) made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses to the accumulators across a wgmma wait.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

using mxw::kThreads;  // 128: one warpgroup
using mxw::kTileN;    // 128 weight rows a block
constexpr int kStageK = 128;            // k a stage: 64 bytes of codes a weight row, 8 k16 steps
constexpr int kSteps = kStageK / 16;    // k16 steps a stage
constexpr int kCoreLbo = 128;           // bytes from a core matrix's k half 0 to its half 1
constexpr int kCoreSbo = 256;           // bytes from one 8-row group to the next

// A variant: kMaxNt, the n8 tiles of x rows a pass holds at most (N up to 8 kMaxNt);
// kStages, the stage buffers; kAhead, the stages loaded ahead of the one multiplied
// (kStages >= kAhead + 2 lets a stage's wgmmas run on while the next stage starts);
// kMinBlocks, the blocks an SM (the register budget).
template <int kMaxNt_, int kStages_, int kAhead_, int kMinBlocks_>
struct WgConfig {
  static constexpr int kMaxNt = kMaxNt_;
  static constexpr int kStages = kStages_;
  static constexpr int kAhead = kAhead_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kMaxRows = 8 * kMaxNt_;
  static constexpr int kStepBytes = kMaxNt_ * kCoreSbo;  // a k16 step's core matrices
  static_assert(kAhead_ >= 1 && kStages_ >= kAhead_ + 1, "a buffer for each stage in flight and the one multiplied");
  static_assert(kMaxNt_ == 4 || kMaxNt_ == 6 || kMaxNt_ == 8, "the pass widths of wg_issue_nt");
};

template <class Cfg>
struct alignas(128) WgStage {
  uint4 w[kTileN][4];  // codes: 16-byte chunk j of row r at j ^ ((r >> 1) & 3)
  uint2 s[kTileN];     // 8 scale codes a row: one a k16 step
  alignas(128) unsigned char x[kSteps * Cfg::kStepBytes];  // x rows as core matrices (above)
};

// The descriptor of a k16 step's B operand: core matrices from `at` (no swizzle).
__device__ __forceinline__ uint64_t wg_desc(const void* at) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(at));
  return static_cast<uint64_t>((a >> 4) & 0x3FFFu) | (static_cast<uint64_t>(kCoreLbo >> 4) << 16) |
         (static_cast<uint64_t>(kCoreSbo >> 4) << 32);
}

// The block's weight row of a warp's decode row t (0..3): t = 2 u + v is wgmma u's row g + 8 v
// of the warp's 16. (r >> 1) & 3, the row's chunk swizzle, is (g >> 1) & 3.
__device__ __forceinline__ int wg_row(int t, int warp, int g) { return 64 * (t >> 1) + 16 * warp + 8 * (t & 1) + g; }

// Stage ks (k from ks * kStageK) of the block's weight rows and of the pass's 8 nt x rows
// from m0 (rows at or past r1 zero-filled) into st. Codes: a thread's chunk c = tid % 4 of
// rows tid / 4 + 32 u. x: round u copies rows 8 u .. 8 u + 7, a warp 8 rows x 4 chunks
// (64 bytes of each row; one 128-byte core matrix a chunk).
template <class Cfg>
__device__ __forceinline__ void wg_load_stage(const Nvfp4WeightsGemm& p, WgStage<Cfg>& st, int e, int64_t nb,
                                              int64_t m0, int64_t r1, int64_t ks, int nt) {
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t K = p.k, k0 = ks * kStageK;
  {
    const int r = tid >> 2, c = tid & 3;
    const uint8_t* src = p.codes + (static_cast<int64_t>(e) * p.n + nb + r) * (K / 2) + k0 / 2 + 16 * c;
    const int cs = c ^ ((r >> 1) & 3);  // the same for rows r + 32 u
#pragma unroll
    for (int u = 0; u < kTileN / 32; ++u) mxw::cp_async16(&st.w[r + 32 * u][cs], src + u * 32 * (K / 2), true);
  }
  nvw::cp_async8(&st.s[tid], p.scales + (static_cast<int64_t>(e) * p.n + nb + tid) * (K / 16) + k0 / 16);
  const int xr = tid & 7, xc = tid >> 3;  // row within the round, 16-byte chunk (0..15)
  unsigned char* dst = st.x + (xc >> 1) * Cfg::kStepBytes + (xc & 1) * kCoreLbo + xr * 16;
  const uint16_t* first = p.x + m0 * K + k0 + 8 * xc;  // row m0: always a row of the pass
#pragma unroll
  for (int u = 0; u < Cfg::kMaxNt; ++u) {
    if (u >= nt) break;
    const bool in = 8 * u + xr < r1 - m0;
    mxw::cp_async16(dst + u * kCoreSbo, in ? first + (8 * u + xr) * K : first, in);
  }
}

// The 8 scale codes of each of the lane's 4 decode rows as bf16x2 multipliers, mult[t][s]
// for k16 step s (nvw::scale_mults<kFast>).
template <bool kFast>
__device__ __forceinline__ void wg_mults(const uint2 (&sc)[4], uint32_t (&mult)[4][kSteps]) {
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t m[2];
      nvw::scale_mults<kFast>(((i < 2 ? sc[t].x : sc[t].y) >> (16 * (i & 1))) & 0xFFFFu, m);
      mult[t][2 * i] = m[0];
      mult[t][2 * i + 1] = m[1];
    }
}

// Byte q of the code word w (its low code: the lower k) as a bf16x2 MMA operand times mult:
// the byte permute puts the low code at bits 15..12 (from w << 4) and the high code at 31..28,
// then nvw::decode8's bit moves (E2M1 2^-126) and multiplies.
template <bool kFast>
__device__ __forceinline__ uint32_t wg_pair(uint32_t w, uint32_t sel, uint32_t mult) {
  const uint32_t v = __byte_perm(w, w << 4, sel);
  const uint32_t raw = (v & 0x80008000u) | ((v >> 6) & 0x01C001C0u);
  __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&raw);
  if (!kFast) {
    const uint32_t two126 = nvw::kTwo126;
    b = __hmul2(b, *reinterpret_cast<const __nv_bfloat162*>(&two126));
  }
  return mxw::bf16x2_bits(__hmul2(b, *reinterpret_cast<const __nv_bfloat162*>(&mult)));
}

// Slice h (steps 4 h .. 4 h + 3: the code chunks 2 h and 2 h + 1 of each row) of a stage for
// one warp: its 4 decode rows into a[t][2 j + hh] (step 4 h + j, k half hh).
template <bool kFast, class Cfg>
__device__ __forceinline__ void wg_decode(const WgStage<Cfg>& st, const uint32_t (&mult)[4][kSteps], int h, int warp,
                                          int g, uint32_t sel, uint32_t (&a)[4][8]) {
  const int sw = (g >> 1) & 3;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int r = wg_row(t, warp, g);
    const uint4 c0 = st.w[r][(2 * h) ^ sw], c1 = st.w[r][(2 * h + 1) ^ sw];
    const uint32_t words[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) a[t][i] = wg_pair<kFast>(words[i], sel, mult[t][4 * h + (i >> 1)]);
  }
}

// The wgmmas of slice h of a stage for kNt n8 tiles of x rows (N = 8 kNt): its four k16
// steps, both m64 halves, into the first 4 kNt accumulators of each half.
template <int kNt, class Cfg>
__device__ __forceinline__ void wg_issue(const WgStage<Cfg>& st, int h, float (&acc)[2][4 * Cfg::kMaxNt],
                                         const uint32_t (&ab)[4][8]) {
  wg_fence();  // in the branch of this width: the registers' writers before the wgmmas that read them
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint64_t desc = wg_desc(&st.x[(4 * h + j) * Cfg::kStepBytes]);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      Wgmma<8 * kNt>::mma(*reinterpret_cast<float(*)[4 * kNt]>(&acc[u][0]), ab[2 * u][2 * j], ab[2 * u + 1][2 * j],
                          ab[2 * u][2 * j + 1], ab[2 * u + 1][2 * j + 1], desc);
  }
}

// wg_issue for the pass's nt (1 <= nt <= kMaxNt): one pipeline for every pass width (a
// branch a width; with a pass body a width, ptxas serializes the wgmmas: C7512).
template <class Cfg>
__device__ __forceinline__ void wg_issue_nt(const WgStage<Cfg>& st, int h, float (&acc)[2][4 * Cfg::kMaxNt],
                                            const uint32_t (&ab)[4][8], int nt) {
  constexpr int kMaxNt = Cfg::kMaxNt;
  if constexpr (kMaxNt == 8) {
    if (nt == 8) return wg_issue<8, Cfg>(st, h, acc, ab);
    if (nt == 7) return wg_issue<7, Cfg>(st, h, acc, ab);
  }
  if constexpr (kMaxNt >= 6) {
    if (nt == 6) return wg_issue<6, Cfg>(st, h, acc, ab);
    if (nt == 5) return wg_issue<5, Cfg>(st, h, acc, ab);
  }
  if (nt == 4) return wg_issue<4, Cfg>(st, h, acc, ab);
  if (nt == 3) return wg_issue<3, Cfg>(st, h, acc, ab);
  if (nt == 2) return wg_issue<2, Cfg>(st, h, acc, ab);
  return wg_issue<1, Cfg>(st, h, acc, ab);
}

// One stage of a pass: wait for the buffers, refill the one kAhead stages on, then per slice
// decode into A buffer (kParity * 2 + h) & 1 and issue its wgmmas (one commit group).
template <int kParity, class Cfg>
__device__ __forceinline__ void wg_stage(const Nvfp4WeightsGemm& p, WgStage<Cfg>* stages, int e, int64_t nb,
                                         int64_t m0, int64_t r1, int64_t ks, int64_t nks, int nt,
                                         float (&acc)[2][4 * Cfg::kMaxNt], uint32_t (&a)[2][4][8]) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, q = lane & 3;
  // The buffer refilled below was last read kStages - kAhead stages ago: with two or more
  // stages between, every wgmma group but the newest (the last stage's last slice) is done.
  if constexpr (Cfg::kStages >= Cfg::kAhead + 2) {
    wg_wait<1>();
  } else {
    wg_wait<0>();
  }
  mxw::cp_async_wait<Cfg::kAhead - 1>();
  fence_proxy_async_shared();
  __syncthreads();  // stage ks landed for every thread; the refilled buffer's wgmmas are done
  const int64_t next = ks + Cfg::kAhead;
  if (next < nks) wg_load_stage<Cfg>(p, stages[next % Cfg::kStages], e, nb, m0, r1, next, nt);
  mxw::cp_async_commit();
  const WgStage<Cfg>& st = stages[ks % Cfg::kStages];
  uint2 sc[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) sc[t] = st.s[wg_row(t, warp, g)];
  // byte 1 <- byte q of w << 4 (the low code at bits 15..12), byte 3 <- byte q of w
  const uint32_t sel = (static_cast<uint32_t>(q) << 12) | ((4u + q) << 4);
  uint32_t any = 0;
#pragma unroll
  for (int t = 0; t < 4; ++t) any |= sc[t].x | sc[t].y;
  // Warp-uniform (wgmma is .aligned): the stage's one-multiply decode when every scale code of
  // the warp's rows is below 2 in magnitude (nvw::stage_all_fast).
  const bool fast = __all_sync(0xFFFFFFFFu, (any & 0x40404040u) == 0);
  uint32_t mult[4][kSteps];
  if (fast) {
    wg_mults<true>(sc, mult);
  } else {
    wg_mults<false>(sc, mult);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t(&ab)[4][8] = a[(2 * kParity + h) & 1];
    if (h > 0) wg_wait<1>();  // the group that last read this A buffer (two slices ago) is done
    if (fast) {
      wg_decode<true, Cfg>(st, mult, h, warp, g, sel, ab);
    } else {
      wg_decode<false, Cfg>(st, mult, h, warp, g, sel, ab);
    }
    wg_issue_nt<Cfg>(st, h, acc, ab, nt);
    wg_commit();
  }
}

// One pass over K for the rows [m0, min(m0 + 8 nt, r1)) of expert e and the block's 128
// weight rows from nb.
template <class Cfg>
__device__ __forceinline__ void wg_pass(const Nvfp4WeightsGemm& p, WgStage<Cfg>* stages, int e, int64_t nb,
                                        int64_t m0, int64_t r1, int nt) {
  constexpr int kMaxNt = Cfg::kMaxNt;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int64_t nks = p.k / kStageK;
  float acc[2][4 * kMaxNt];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int i = 0; i < 4 * kMaxNt; ++i) acc[u][i] = 0.0f;
  uint32_t a[2][4][8];
#pragma unroll
  for (int s = 0; s < Cfg::kAhead; ++s) {
    if (s < nks) wg_load_stage<Cfg>(p, stages[s], e, nb, m0, r1, s, nt);
    mxw::cp_async_commit();
  }
  for (int64_t ks = 0; ks < nks; ks += 2) {  // two stages a round: the A buffers' parity is static
    wg_stage<0, Cfg>(p, stages, e, nb, m0, r1, ks, nks, nt, acc, a);
    if (ks + 1 < nks) wg_stage<1, Cfg>(p, stages, e, nb, m0, r1, ks + 1, nks, nt, acc, a);
  }
  wg_wait<0>();
  fence_operands(acc[0]);
  fence_operands(acc[1]);
  mxw::cp_async_wait<0>();
  __syncthreads();  // every warp done with the buffers before the next pass refills them
#pragma unroll
  for (int i = 0; i < kMaxNt; ++i) {
    if (i >= nt) break;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t r = m0 + 8 * i + 2 * q + (c & 1);
      if (r >= r1) continue;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int64_t at = r * p.n + nb + 64 * u + 16 * warp + 8 * (c >> 1) + g;
        float v = acc[u][4 * i + c];
        if (p.y_bf16 != nullptr) {
          p.y_bf16[at] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
          continue;
        }
        if (p.accumulate) v += p.y[at];
        p.y[at] = v;
      }
    }
  }
}

// Grid (N / kTileN, E), kThreads threads, Cfg::kStages stages of dynamic shared memory. A
// block: weight rows [nb, nb + 128) of expert e = blockIdx.y, nb = 128 blockIdx.x, over the
// expert's rows in passes of up to 8 kMaxNt.
template <class Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) nvfp4_weights_wgmma_kernel(Nvfp4WeightsGemm p) {
  extern __shared__ __align__(128) unsigned char smem[];
  WgStage<Cfg>* stages = reinterpret_cast<WgStage<Cfg>*>(smem);
  pdl_wait();  // launched with programmatic dependent launch (pdl.cuh)
  const int e = static_cast<int>(blockIdx.y);
  int64_t r0, r1;
  mxw::expert_rows(p, e, r0, r1);
  const int64_t nb = static_cast<int64_t>(blockIdx.x) * kTileN;
  for (int64_t m0 = r0; m0 < r1; m0 += Cfg::kMaxRows) {
    const int64_t rem = r1 - m0;
    const int nt = rem >= Cfg::kMaxRows ? Cfg::kMaxNt : static_cast<int>((rem + 7) / 8);
    wg_pass<Cfg>(p, stages, e, nb, m0, r1, nt);
  }
}

// The variant nvfp4_weights_gemm runs with Nvfp4WeightsGemm::wgmma (moe_ep_gemm_check also
// checks and times <8,3,1,2> and <6,3,1,3>; none has run on a GPU yet).
using WgDefaultConfig = WgConfig<6, 4, 2, 2>;

}  // namespace nvg

// Whether the wgmma kernel takes p: nvfp4_weights_gemm_fits and one x plane.
inline bool nvfp4_weights_wgmma_fits(const Nvfp4WeightsGemm& p) {
  return mxw::coded_gemm_fits<Nvfp4Format>(p) && p.x_planes <= 1;
}

// One launch of the wgmma kernel for Cfg.
template <class Cfg>
inline cudaError_t nvfp4_weights_wgmma_launch(const Nvfp4WeightsGemm& p, cudaStream_t stream) {
  if (!nvfp4_weights_wgmma_fits(p)) return cudaErrorInvalidValue;
  constexpr size_t smem = sizeof(nvg::WgStage<Cfg>) * Cfg::kStages;
  // Per device and cheap; not a stream operation, so allowed inside a CUDA-graph capture.
  cudaError_t err = cudaFuncSetAttribute(nvg::nvfp4_weights_wgmma_kernel<Cfg>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.n / nvg::kTileN), static_cast<unsigned>(p.num_experts));
  const cudaError_t launched = launch_pdl(nvg::nvfp4_weights_wgmma_kernel<Cfg>, grid, nvg::kThreads, smem, stream, p);
  return launched != cudaSuccess ? launched : cudaGetLastError();
}

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_NVFP4_WEIGHTS_WGMMA_CUH_
