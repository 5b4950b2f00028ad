// The CUDA side of two targets of ffi_module.cc that change a few elements of an array in
// place (aliased), where an XLA select would read and write all of it.
//
// moe_ep_poison: the array overwritten with one NaN bit pattern when a device flag is set,
// left untouched otherwise.
// The jax layer turns every result to NaN on a data-dependent input error (the flag lives
// on the device, decided inside the program). As an XLA select that is a full read and
// write of the array whatever the flag says: for the weight gradients of a large layer
// (E_local * H * 2I values) more memory traffic than any other pass of the backward. Here
// every block reads the one flag byte and returns when it is clear; only an erroring step
// writes, and nothing is read.
//
// moe_ep_zero_rows: the listed rows of an array zeroed (the stash's alignment padding rows:
// at most align - 1 a slab, where a select over the whole [C, 2I] stash would copy it).
#include <cstdint>

#include <cuda_runtime_api.h>

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

// words: the array as 32-bit words (its 16-byte aligned bulk as uint4 vectors when
// `vectors` > 0), filled with `pattern` when *flag != 0. `tail16`: one trailing 16-bit
// element after the words (an odd count of 2-byte elements), or -1.
__global__ void PoisonKernel(const uint8_t* flag, uint32_t* words, int64_t vectors, int64_t n_words,
                             uint32_t pattern, int32_t tail16) {
  if (*flag == 0) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint4* vec = reinterpret_cast<uint4*>(words);
  const uint4 v = make_uint4(pattern, pattern, pattern, pattern);
  for (int64_t i = first; i < vectors; i += stride) vec[i] = v;
  for (int64_t i = vectors * 4 + first; i < n_words; i += stride) words[i] = pattern;
  if (tail16 >= 0 && first == 0) reinterpret_cast<uint16_t*>(words + n_words)[0] = static_cast<uint16_t>(tail16);
}

}  // namespace

// Enqueue the conditional fill of `bytes` bytes at `data` (element width 2 or 4 bytes;
// `pattern` the element's NaN bits, a 2-byte one in its low half) on `stream`, gated by
// the byte at `flag` (device memory). Returns the launch's status.
extern "C" cudaError_t moe_ep_ffi_poison_cuda(void* stream, const void* flag, void* data, int64_t bytes,
                                              int32_t width, uint32_t pattern) {
  if (bytes <= 0) return cudaSuccess;
  uint32_t word = pattern;
  int32_t tail16 = -1;
  if (width == 2) {
    word = (pattern & 0xFFFFu) | ((pattern & 0xFFFFu) << 16);
    if (bytes % 4 != 0) tail16 = static_cast<int32_t>(pattern & 0xFFFFu);
  }
  const int64_t n_words = bytes / 4;
  const int64_t vectors = (reinterpret_cast<uintptr_t>(data) % 16 == 0) ? n_words / 4 : 0;
  const int64_t work = vectors > 0 ? vectors : (n_words > 0 ? n_words : 1);
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  if (blocks < 1) blocks = 1;
  PoisonKernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(flag), static_cast<uint32_t*>(data), vectors, n_words, word, tail16);
  return cudaGetLastError();
}

// ----------------------------------------------------------------------------- zero rows

namespace {

// Block b zeroes row rows[b] of `data` (row_bytes bytes a row), nothing for -1 or a row
// outside [0, num_rows). `vec`: rows and data 16-byte aligned (uint4 stores).
__global__ void ZeroRowsKernel(const int32_t* rows, uint8_t* data, int64_t num_rows, int64_t row_bytes, bool vec) {
  const int32_t r = rows[blockIdx.x];
  if (r < 0 || r >= num_rows) return;
  uint8_t* row = data + static_cast<int64_t>(r) * row_bytes;
  if (vec) {
    uint4* v = reinterpret_cast<uint4*>(row);
    for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) v[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) row[i] = 0;
  }
}

}  // namespace

// Enqueue the zeroing of the rows listed in `rows` ([n] int32, device memory; -1 = none) of
// `data` ([num_rows, row_bytes] bytes) on `stream`. Returns the launch's status.
extern "C" cudaError_t moe_ep_ffi_zero_rows_cuda(void* stream, const int32_t* rows, int64_t n, void* data,
                                                 int64_t num_rows, int64_t row_bytes) {
  if (n <= 0 || num_rows <= 0 || row_bytes <= 0) return cudaSuccess;
  const bool vec = reinterpret_cast<uintptr_t>(data) % 16 == 0 && row_bytes % 16 == 0;
  ZeroRowsKernel<<<static_cast<unsigned>(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      rows, static_cast<uint8_t*>(data), num_rows, row_bytes, vec);
  return cudaGetLastError();
}
