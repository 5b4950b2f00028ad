// CUDA quantize / dequantize over the [outer, n, inner] view (blocks along n).
// Index order of the threads: inner fastest, so that neighbouring threads touch
// neighbouring addresses whenever inner > 1.
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/format_math.cuh"
#include "internal.h"

namespace moe_ep {
namespace cuda {
namespace {

using namespace detail;

// One thread per element: data[i] = bf16 bits of x[i] (nearest even).
__global__ void bf16_quantize_kernel(const float* __restrict__ x, int64_t total, uint16_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = bf16_from_float(x[i]);
}

// One thread per element: out[i] = the exact float32 value of bf16 bits data[i].
__global__ void bf16_dequantize_kernel(const uint16_t* __restrict__ in, int64_t total, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = bf16_to_float(in[i]);
}

// One thread per (outer o, block b, inner i): encodes elements k0..k0+len-1 of
// column (o, i), writes their E4M3 codes and the block's E8M0 code. The scale
// index (o * nb + b) * inner + i is the thread index itself.
__global__ void mxfp8_quantize_kernel(const float* __restrict__ x, int64_t outer, int64_t n, int64_t inner,
                                      uint8_t* __restrict__ data, uint8_t* __restrict__ scale) {
  const int64_t nb = div_up(n, kMxfp8Block);
  const int64_t total = outer * nb * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ob = t / inner, b = ob % nb, o = ob / nb;
    const int64_t k0 = b * kMxfp8Block;
    const int len = static_cast<int>(n - k0 < kMxfp8Block ? n - k0 : kMxfp8Block);
    const int64_t base = (o * n + k0) * inner + i;
    mxfp8_encode_block(x + base, inner, len, data + base, inner, scale + t);
  }
}

// One thread per (outer o, block b, inner i): the block's E4M3 scale code, then
// its codes packed two a byte (element 2j low nibble, 2j + 1 high nibble; an odd
// n leaves the last high nibble 0). Blocks start at even k, so a byte never
// straddles two blocks.
__global__ void nvfp4_quantize_kernel(const float* __restrict__ x, int64_t outer, int64_t n, int64_t inner,
                                      uint8_t* __restrict__ data, uint8_t* __restrict__ scale) {
  const int64_t nb = div_up(n, kNvfp4Block), np = div_up(n, 2);
  const int64_t total = outer * nb * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ob = t / inner, b = ob % nb, o = ob / nb;
    const int64_t k0 = b * kNvfp4Block;
    const int len = static_cast<int>(n - k0 < kNvfp4Block ? n - k0 : kNvfp4Block);
    const float* xb = x + (o * n + k0) * inner + i;
    const Nvfp4Scale sc = nvfp4_block_scale(xb, inner, len);
    uint8_t* db = data + (o * np + k0 / 2) * inner + i;
    for (int j = 0; j < len; j += 2) {
      const uint32_t lo = nvfp4_code(fbits(xb[j * inner]), sc.value);
      const uint32_t hi = j + 1 < len ? nvfp4_code(fbits(xb[(j + 1) * inner]), sc.value) : 0u;
      db[(j / 2) * inner] = static_cast<uint8_t>((lo & 0xFu) | ((hi & 0xFu) << 4));
    }
    scale[t] = static_cast<uint8_t>(sc.code);
  }
}

// One thread per element (o, k, i): E4M3(data) * 2^(scale - 127) of its block.
__global__ void mxfp8_dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                        int64_t outer, int64_t n, int64_t inner, float* __restrict__ out) {
  const int64_t nb = div_up(n, kMxfp8Block);
  const int64_t total = outer * n * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ok = t / inner, k = ok % n, o = ok / n;
    out[t] = mxfp8_decode(data[t], scale[(o * nb + k / kMxfp8Block) * inner + i]);
  }
}

// One thread per element (o, k, i): E2M1(nibble k of the packed bytes) * E4M3(scale).
__global__ void nvfp4_dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                        int64_t outer, int64_t n, int64_t inner, float* __restrict__ out) {
  const int64_t nb = div_up(n, kNvfp4Block), np = div_up(n, 2);
  const int64_t total = outer * n * inner;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = t % inner, ok = t / inner, k = ok % n, o = ok / n;
    const uint32_t byte = data[(o * np + k / 2) * inner + i];
    const uint32_t nibble = (k & 1) ? (byte >> 4) : (byte & 0xFu);
    out[t] = nvfp4_decode(nibble, scale[(o * nb + k / kNvfp4Block) * inner + i]);
  }
}

}  // namespace

moe_ep_status quantize(void* stream, moe_ep_format fmt, const float* x, int64_t outer, int64_t n, int64_t inner,
                       void* data, void* scale) {
  const cudaStream_t s = as_stream(stream);
  switch (fmt) {
    case MOE_EP_FORMAT_BF16: {
      const int64_t total = outer * n * inner;
      if (total == 0) return MOE_EP_OK;
      bf16_quantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, total, static_cast<uint16_t*>(data));
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_quantize_kernel");
      return MOE_EP_OK;
    }
    case MOE_EP_FORMAT_MXFP8: {
      const int64_t total = outer * div_up(n, kMxfp8Block) * inner;
      if (total == 0) return MOE_EP_OK;
      mxfp8_quantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, outer, n, inner, static_cast<uint8_t*>(data),
                                                                    static_cast<uint8_t*>(scale));
      MOE_EP_CUDA_CHECK_LAUNCH("mxfp8_quantize_kernel");
      return MOE_EP_OK;
    }
    case MOE_EP_FORMAT_NVFP4: {
      const int64_t total = outer * div_up(n, kNvfp4Block) * inner;
      if (total == 0) return MOE_EP_OK;
      nvfp4_quantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, outer, n, inner, static_cast<uint8_t*>(data),
                                                                    static_cast<uint8_t*>(scale));
      MOE_EP_CUDA_CHECK_LAUNCH("nvfp4_quantize_kernel");
      return MOE_EP_OK;
    }
    default:
      return fail(MOE_EP_ERR_INTERNAL, "cuda::quantize: unexpected format " + std::to_string(static_cast<int>(fmt)));
  }
}

moe_ep_status dequantize(void* stream, moe_ep_format fmt, const void* data, const void* scale, int64_t outer,
                         int64_t n, int64_t inner, float* out) {
  const cudaStream_t s = as_stream(stream);
  const int64_t total = outer * n * inner;
  if (total == 0) return MOE_EP_OK;
  switch (fmt) {
    case MOE_EP_FORMAT_BF16:
      bf16_dequantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(static_cast<const uint16_t*>(data), total, out);
      MOE_EP_CUDA_CHECK_LAUNCH("bf16_dequantize_kernel");
      return MOE_EP_OK;
    case MOE_EP_FORMAT_MXFP8:
      mxfp8_dequantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scale), outer, n, inner, out);
      MOE_EP_CUDA_CHECK_LAUNCH("mxfp8_dequantize_kernel");
      return MOE_EP_OK;
    case MOE_EP_FORMAT_NVFP4:
      nvfp4_dequantize_kernel<<<blocks_for(total), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scale), outer, n, inner, out);
      MOE_EP_CUDA_CHECK_LAUNCH("nvfp4_dequantize_kernel");
      return MOE_EP_OK;
    default:
      return fail(MOE_EP_ERR_INTERNAL, "cuda::dequantize: unexpected format " + std::to_string(static_cast<int>(fmt)));
  }
}

}  // namespace cuda
}  // namespace moe_ep
