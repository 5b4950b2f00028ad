// The mxfp8-weights GEMM of mxfp8_weights_gemm.cuh (same contract: Mxfp8WeightsGemm, the same
// exact decode, the same NaN and inexact rules) on Hopper's warpgroup MMAs: wgmma.mma_async
// m64nNk16 with the decoded weights as the register A operand and the x rows as the shared
// memory B operand, N = 8 to 64 (the pass's x rows). The plain kernel's warps each issue
// 2 kNt mma.sync a k16 step and load every x fragment from shared memory themselves; here
// the block (one warpgroup: 4 warps, 128 weight rows) issues two wgmmas a k16 step, whose
// B operand the tensor cores read from shared memory, and a warp decodes the next 64-slice
// while the last one's wgmmas run (two register buffers of A fragments).
//
// Rows: wgmma u (0, 1) takes the block's weight rows 64 u .. 64 u + 63; warp w holds its
// rows 64 u + 16 w + g and + 8 + g (lane = 4 g + q), the A fragment of mma.sync m16n8k16.
// The accumulator of wgmma u: d[4 i + c] at weight row 64 u + 16 w + g + 8 (c >> 1) and x
// row 8 i + 2 q + (c & 1).
//
// The k permutation is the plain kernel's (lane quad q holds the 16 codes [16 q, 16 q + 16)
// of its weight row in a 64-slice; k16 step j takes codes 4 j .. 4 j + 3 of each quad as
// the logical columns {2 q, 2 q + 1, 2 q + 8, 2 q + 9}), so the x rows are stored permuted
// alike: each 4-byte piece (two bf16 at physical k 64 h + 16 q + 4 j + 2 hh) is copied with
// its own cp.async into the core matrix (step 4 h + j, 8-row group, k half hh) at slot q.
// The core matrices (8 rows x 16 bytes, the no-swizzle K-major layout of a wgmma
// descriptor) lie 144 bytes apart along k (LBO) and 288 bytes apart along the rows (SBO),
// and the steps kStepPitch apart (32 modulo 128 bytes), so the 32 pieces a warp copies (one
// x row, one h) land in 32 different banks.
//
// Ordering: the cp.async writes are the generic proxy, wgmma reads shared memory through
// the async proxy: each thread fences (fence.proxy.async.shared::cta) after its copies
// landed and before the block barrier that precedes the stage's wgmmas. A stage buffer is
// refilled only after the wgmmas that read it completed (wgmma.wait_group before that
// barrier), and an A buffer is decoded into only after the wgmmas that read it completed.
#ifndef MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_WGMMA_CUH_
#define MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_WGMMA_CUH_

#include "cuda/gemm/mxfp8_weights_gemm.cuh"

namespace moe_ep {
namespace cuda {
namespace mxw {

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
// 4 bytes, or 4 zero bytes when !fill.
__device__ __forceinline__ void cp_async4_zfill(void* dst, const void* src, bool fill) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(fill ? 4 : 0));
}

constexpr int kCoreLbo = 144;  // bytes from a core matrix's k half 0 to its half 1
constexpr int kCoreSbo = 288;  // bytes from one 8-row group to the next

// A wgmma kernel variant: kMaxNt, the n8 tiles of x rows a pass holds at most (N up to
// 8 kMaxNt); kSlices, the 64-slices of k a stage (1 or 2); kStages, the stage buffers;
// kAhead, the stages loaded ahead of the one multiplied (kStages >= kAhead + 2 lets a
// stage's wgmmas run on while the next stage starts; kStages == kAhead + 1 waits for them
// at every stage); kMinBlocks, the blocks an SM (the register budget); kPlanes, the x
// planes (1 or 3).
// kAblate (measurement only; the results are wrong unless 0): bit 1, no wgmma issued; bit 2,
// x rows copied as 16-byte chunks unpermuted; bit 4, no decode (the A fragments are the raw codes).
template <int kMaxNt_, int kSlices_, int kStages_, int kAhead_, int kMinBlocks_, int kPlanes_ = 1, int kAblate_ = 0>
struct WgConfig {
  static constexpr int kAblate = kAblate_;
  static constexpr int kMaxNt = kMaxNt_;
  static constexpr int kSlices = kSlices_;
  static constexpr int kStages = kStages_;
  static constexpr int kAhead = kAhead_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kPlanes = kPlanes_;
  static constexpr int kMaxRows = 8 * kMaxNt_;
  static constexpr int kStageK = 64 * kSlices_;
  static constexpr int kSteps = 4 * kSlices_;  // k16 steps a stage
  // Bytes from one k16 step's core matrices to the next: 32 modulo 128 (bank spread).
  static constexpr int kStepPitch = ((kMaxNt_ * kCoreSbo - 16 + 127) / 128) * 128 + 32;
  static constexpr int kPlaneBytes = kSteps * kStepPitch;
  static_assert(kSlices_ == 1 || kSlices_ == 2, "64 or 128 k a stage");
  static_assert(kAhead_ >= 1 && kStages_ >= kAhead_ + 1, "a buffer for each stage in flight and the one multiplied");
  static_assert(kMaxNt_ >= 1 && kMaxNt_ <= 8, "N up to 64");
};

template <class Cfg>
struct WgStage {
  uint4 w[kTileN][Cfg::kStageK / 16];  // codes; with 8 chunks a row, chunk c of row r at c ^ (4 (r & 1))
  uint32_t s[kTileN];                  // the 4-byte word of scale codes holding the stage's
  alignas(16) unsigned char x[Cfg::kPlanes][Cfg::kPlaneBytes];  // x rows as core matrices (above)
};
template <class Cfg>
constexpr size_t wg_smem_bytes() {
  return sizeof(WgStage<Cfg>) * Cfg::kStages;
}

// The descriptor of one k16 step's B operand: core matrices from `at` (no swizzle).
__device__ __forceinline__ uint64_t wg_desc(const void* at) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(at));
  return static_cast<uint64_t>((a >> 4) & 0x3FFFu) | (static_cast<uint64_t>(kCoreLbo >> 4) << 16) |
         (static_cast<uint64_t>(kCoreSbo >> 4) << 32);
}

// The block's weight row of a warp's decode row t (0..3): t = 2 u + v is wgmma u's row g + 8 v
// of the warp's 16.
__device__ __forceinline__ int wg_row(int t, int warp, int g) { return 64 * (t >> 1) + 16 * warp + 8 * (t & 1) + g; }

// Stage ks (k from ks * kStageK) of the block's weight rows and of the pass's kRows x rows
// from m0 (rows at or past r1 zero-filled) into st.
template <class Cfg>
__device__ __forceinline__ void wg_load_stage(const Mxfp8WeightsGemm& p, WgStage<Cfg>& st, int e, int64_t nb,
                                              int64_t m0, int64_t r1, int64_t ks, int rows) {
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t K = p.k, k0 = ks * Cfg::kStageK;
  constexpr int kChunks = Cfg::kStageK / 16;
  constexpr int kRowsARound = kThreads / kChunks;
  const int r = tid / kChunks, c = tid % kChunks;
  const uint8_t* src = p.codes + (static_cast<int64_t>(e) * p.n + nb + r) * K + k0 + 16 * c;
  const int cs = kChunks == 8 ? c ^ ((r & 1) << 2) : c;  // the row parity is the same for rows r + 16 u
#pragma unroll
  for (int u = 0; u < kTileN / kRowsARound; ++u)
    cp_async16(&st.w[r + u * kRowsARound][cs], src + u * kRowsARound * K, true);
  cp_async4(&st.s[tid], p.scales + (static_cast<int64_t>(e) * p.n + nb + tid) * (K / 32) + ((k0 / 32) & ~int64_t{3}));
  constexpr int kPieces = Cfg::kStageK / 2;  // 4-byte pieces of an x row
  if constexpr ((Cfg::kAblate & 2) != 0) {
    constexpr int kXChunks = Cfg::kStageK / 8;
    for (int pl = 0; pl < Cfg::kPlanes; ++pl) {
      const uint16_t* x = p.x + pl * p.x_plane_stride;
      for (int i = tid; i < rows * kXChunks; i += kThreads) {
        const int xr = i / kXChunks, c = i % kXChunks;
        const bool in = m0 + xr < r1;
        cp_async16(&st.x[pl][(c >> 1) * Cfg::kStepPitch + (xr >> 3) * kCoreSbo + (c & 1) * kCoreLbo + (xr & 7) * 16],
                   x + (in ? m0 + xr : m0) * K + k0 + 8 * c, in);
      }
    }
    return;
  }
  // A thread copies the same piece pi of rows xr0 + kRowsARoundX u: its shared offsets
  // differ by constants, its global addresses by kRowsARoundX rows.
  constexpr int kRowsARoundX = kThreads / kPieces;  // 2 or 4 (a divisor of 8)
  const int pi = tid % kPieces, xr0 = tid / kPieces;
  const int h = pi >> 5, q = (pi >> 3) & 3, j = (pi >> 1) & 3, hh = pi & 1;
  const int dst0 = (4 * h + j) * Cfg::kStepPitch + hh * kCoreLbo + xr0 * 16 + 4 * q;
  const int rounds = rows / kRowsARoundX;  // rows: a multiple of 8, at most kMaxRows
  const int64_t left = r1 - m0 - xr0;      // this thread's rows in the pass
#pragma unroll
  for (int pl = 0; pl < Cfg::kPlanes; ++pl) {
    const uint16_t* first = p.x + pl * p.x_plane_stride + m0 * K + k0 + 2 * pi;  // row m0: always valid
    const uint16_t* src = first + xr0 * K;
#pragma unroll
    for (int u = 0; u < Cfg::kMaxRows / kRowsARoundX; ++u) {
      if (u < rounds) {
        constexpr int kStep = kRowsARoundX;
        const int off = ((kStep * u) >> 3) * kCoreSbo + ((kStep * u) & 7) * 16;
        const bool in = kStep * u < left;
        cp_async4_zfill(&st.x[pl][dst0 + off], in ? src : first, in);
      }
      src += kRowsARoundX * K;
    }
  }
}

// Whether every scale code of a thread's stage (its 4 weight rows' codes at bytes
// sel + 2 h + (q >> 1) of scw, h < kSlices) takes the fast decode.
template <int kSlices>
__device__ __forceinline__ bool wg_all_fast(const uint32_t (&scw)[4], int sel, int q) {
  bool fast = true;
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int h = 0; h < kSlices; ++h) {
      const uint32_t sc = (scw[t] >> (8 * (sel + 2 * h + (q >> 1)))) & 0xFFu;
      fast &= sc - kFastScaleMin <= 254u - kFastScaleMin;
    }
  return fast;
}

// Slice h of the stage: the warp's 4 decode rows' 16 codes into a (decode16<kFast>).
template <bool kFast, class Cfg>
__device__ __forceinline__ void wg_decode(const WgStage<Cfg>& st, const uint32_t (&scw)[4], int sel, int h, int warp,
                                          int g, int q, uint32_t (&a)[4][8], bool& bad) {
  constexpr int kChunks = Cfg::kStageK / 16;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int r = wg_row(t, warp, g);
    const int c = kChunks == 8 ? (4 * h + q) ^ ((r & 1) << 2) : q;
    decode16<kFast>(st.w[r][c], (scw[t] >> (8 * (sel + 2 * h + (q >> 1)))) & 0xFFu, a[t], bad);
  }
}

// The wgmmas of slice h of a stage for kNt n8 tiles of x rows (N = 8 kNt): every plane's
// four k16 steps, both m64 halves, into the first 4 kNt accumulators of each half.
template <int kNt, class Cfg>
__device__ __forceinline__ void wg_issue(const WgStage<Cfg>& st, int h, float (&acc)[2][4 * Cfg::kMaxNt],
                                         const uint32_t (&ab)[4][8]) {
#pragma unroll
  for (int pl = 0; pl < Cfg::kPlanes; ++pl)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint64_t desc = wg_desc(&st.x[pl][(4 * h + j) * Cfg::kStepPitch]);
#pragma unroll
      for (int u = 0; u < 2; ++u)
        Wgmma<8 * kNt>::mma(*reinterpret_cast<float(*)[4 * kNt]>(&acc[u][0]), ab[2 * u][2 * j], ab[2 * u + 1][2 * j],
                            ab[2 * u][2 * j + 1], ab[2 * u + 1][2 * j + 1], desc);
    }
}

// wg_issue for the pass's nt (1 <= nt <= kMaxNt): one pipeline for every pass width (a
// branch a width; with a pass body a width, ptxas serialized the wgmmas: C7512).
template <class Cfg>
__device__ __forceinline__ void wg_issue_nt(const WgStage<Cfg>& st, int h, float (&acc)[2][4 * Cfg::kMaxNt],
                                            const uint32_t (&ab)[4][8], int nt) {
  constexpr int kMaxNt = Cfg::kMaxNt;
  static_assert(kMaxNt == 4 || kMaxNt == 6 || kMaxNt == 8, "the widths below");
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
// decode into A buffer (kParity kSlices + h) & 1 and issue its wgmmas (one commit group).
template <int kParity, class Cfg>
__device__ __forceinline__ void wg_stage(const Mxfp8WeightsGemm& p, WgStage<Cfg>* stages, int e, int64_t nb,
                                         int64_t m0, int64_t r1, int64_t ks, int64_t nks, int nt,
                                         float (&acc)[2][4 * Cfg::kMaxNt], uint32_t (&a)[2][4][8], bool& bad) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, q = lane & 3;
  // The buffer refilled below was last read kStages - kAhead stages ago: with two or more
  // stages between, every wgmma group but the newest (the last stage's last slice) is done.
  if constexpr (Cfg::kStages >= Cfg::kAhead + 2) {
    wg_wait<1>();
  } else {
    wg_wait<0>();
  }
  cp_async_wait<Cfg::kAhead - 1>();
  fence_proxy_async_shared();
  __syncthreads();  // stage ks landed for every thread; the refilled buffer's wgmmas are done
  const int64_t next = ks + Cfg::kAhead;
  if (next < nks) wg_load_stage<Cfg>(p, stages[next % Cfg::kStages], e, nb, m0, r1, next, 8 * nt);
  cp_async_commit();
  const WgStage<Cfg>& st = stages[ks % Cfg::kStages];
  uint32_t scw[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) scw[t] = st.s[wg_row(t, warp, g)];
  const int sel = static_cast<int>((ks * Cfg::kStageK / 32) & 3);
  // Warp-uniform: the decode copy without the slow path when every code of the warp is fast.
  const bool fast = __all_sync(0xFFFFFFFFu, wg_all_fast<Cfg::kSlices>(scw, sel, q));
#pragma unroll
  for (int h = 0; h < Cfg::kSlices; ++h) {
    constexpr int kBufBase = kParity * Cfg::kSlices;
    uint32_t(&ab)[4][8] = a[(kBufBase + h) & 1];
    if (h > 0) wg_wait<1>();  // the group that last read this A buffer (two slices ago) is done
    if constexpr ((Cfg::kAblate & 4) != 0) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint4 w = st.w[wg_row(t, warp, g)][Cfg::kStageK == 128 ? (4 * h + q) ^ ((wg_row(t, warp, g) & 1) << 2) : q];
        ab[t][0] = w.x, ab[t][1] = w.y, ab[t][2] = w.z, ab[t][3] = w.w;
        ab[t][4] = w.x ^ scw[t], ab[t][5] = w.y, ab[t][6] = w.z, ab[t][7] = w.w ^ fast;
      }
    } else if (fast) {
      wg_decode<true, Cfg>(st, scw, sel, h, warp, g, q, ab, bad);
    } else {
      wg_decode<false, Cfg>(st, scw, sel, h, warp, g, q, ab, bad);
    }
    wg_fence();
    if constexpr ((Cfg::kAblate & 1) != 0) {
      // Keep the decode: fold the A fragments into the accumulators (no tensor work).
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t >> 1][(4 * (t & 1) + i) % (4 * Cfg::kMaxNt)] += __uint_as_float(ab[t][i]);
    } else {
      wg_issue_nt<Cfg>(st, h, acc, ab, nt);
    }
    wg_commit();
  }
}

// One pass over K for the rows [m0, min(m0 + 8 nt, r1)) of expert e and the block's 128
// weight rows from nb.
template <class Cfg>
__device__ __forceinline__ void wg_pass(const Mxfp8WeightsGemm& p, WgStage<Cfg>* stages, int e, int64_t nb,
                                        int64_t m0, int64_t r1, int nt) {
  constexpr int kMaxNt = Cfg::kMaxNt;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int64_t nks = p.k / Cfg::kStageK;
  float acc[2][4 * kMaxNt];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int i = 0; i < 4 * kMaxNt; ++i) acc[u][i] = 0.0f;
  uint32_t a[2][4][8];
#pragma unroll
  for (int s = 0; s < Cfg::kAhead; ++s) {
    if (s < nks) wg_load_stage<Cfg>(p, stages[s], e, nb, m0, r1, s, 8 * nt);
    cp_async_commit();
  }
  bool bad = false;
  for (int64_t ks = 0; ks < nks; ks += 2) {  // two stages a round: the A buffers' parity is static
    wg_stage<0, Cfg>(p, stages, e, nb, m0, r1, ks, nks, nt, acc, a, bad);
    if (ks + 1 < nks) wg_stage<1, Cfg>(p, stages, e, nb, m0, r1, ks + 1, nks, nt, acc, a, bad);
  }
  wg_wait<0>();
  fence_operands(acc[0]);
  fence_operands(acc[1]);
  cp_async_wait<0>();
  __syncthreads();  // every warp done with the buffers before the next pass refills them
  if (bad && p.inexact != nullptr) atomicOr(p.inexact, 1);
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

// Grid (N / kTileN, E), kThreads threads (one warpgroup), wg_smem_bytes<Cfg>() of dynamic
// shared memory. Each pass takes as many n8 tiles as the expert's remaining rows need, up
// to Cfg::kMaxNt.
template <class Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks) mxfp8_weights_wgmma_kernel(Mxfp8WeightsGemm p) {
  constexpr int kMaxNt = Cfg::kMaxNt;
  extern __shared__ __align__(16) unsigned char wg_smem[];
  WgStage<Cfg>* stages = reinterpret_cast<WgStage<Cfg>*>(wg_smem);
  const int e = static_cast<int>(blockIdx.y);
  const int64_t r0 = p.off[e], r1 = p.off[e + 1];
  const int64_t nb = static_cast<int64_t>(blockIdx.x) * kTileN;
  for (int64_t m0 = r0; m0 < r1;) {
    const int64_t rem = r1 - m0;
    const int nt = rem >= 8 * kMaxNt ? kMaxNt : static_cast<int>((rem + 7) / 8);
    wg_pass<Cfg>(p, stages, e, nb, m0, r1, nt);
    m0 += 8 * nt;
  }
}

}  // namespace mxw

// One wgmma variant's launch (checked and timed by moe_ep_gemm_check against the plain
// kernel's). p.passes_of_32 is not used: Cfg::kMaxNt sets the passes.
template <class Cfg>
inline cudaError_t mxfp8_weights_wgmma_launch(const Mxfp8WeightsGemm& p, cudaStream_t stream) {
  if (!mxfp8_weights_gemm_fits(p) || (p.x_planes == 3) != (Cfg::kPlanes == 3)) return cudaErrorInvalidValue;
  constexpr size_t smem = mxw::wg_smem_bytes<Cfg>();
  cudaError_t err = cudaFuncSetAttribute(mxw::mxfp8_weights_wgmma_kernel<Cfg>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.n / mxw::kTileN), static_cast<unsigned>(p.num_experts));
  mxw::mxfp8_weights_wgmma_kernel<Cfg><<<grid, mxw::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_CUDA_GEMM_MXFP8_WEIGHTS_WGMMA_CUH_
