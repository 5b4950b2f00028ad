// The device exchange's state hung off a layer (moe_ep_layer.ex) and the
// implementation entry points exchange.cc calls: the CPU twin (exchange.cc) and
// the CUDA kernels (cuda/exchange.cu).
#ifndef MOE_EP_NATIVE_EXCHANGE_H_
#define MOE_EP_NATIVE_EXCHANGE_H_

#include <vector>

#include "exchange_layout.h"
#include "internal.h"

namespace moe_ep {

#ifdef MOE_EP_NATIVE_WITH_NCCL_DEVICE
struct NcclWindow;  // the NCCL provider's window (nccl/lsa_peers.cu)
#endif

struct Exchange {
  ex::Shape shape{};
  ex::SymLayout sym{};
  bool cuda = false;
  int cuda_device = 0;
  int64_t timeout_ms = 60000;
  int num_blocks = 32;            // thread blocks of the copy kernels (CUDA default: 2 per multiprocessor)
  int mode = MOE_EP_EXCHANGE_THROUGHPUT;  // moe_ep_exchange_mode (CUDA)
  int ll_blocks = 0;              // the low-latency kernels' grid (CUDA, mode LOW_LATENCY)
  int64_t token_bytes_max = 0;
  void* own = nullptr;      // the region the layer allocated (zeroed)
  void* region = nullptr;   // the region in use (own, or the caller's, from set_peers)
  void* local = nullptr;    // the Local pieces (device memory on CUDA)
  int64_t local_bytes = 0;
  ex::Local loc{};
  std::vector<uint64_t> peers;   // host copy of the table
  std::vector<void*> opened;     // IPC mappings to close (CUDA)
#ifdef MOE_EP_NATIVE_WITH_NCCL_DEVICE
  NcclWindow* nccl = nullptr;    // the NCCL provider's memory, window and device communicator (released by destroy)
#endif
  bool connected = false;
  int64_t last_tokens = -1;      // T of the last dispatch (host)
};

// Layer hooks (layer.cc calls these).
moe_ep_status exchange_check_config(const Check& ck, const moe_ep_layer_config& c);
moe_ep_status exchange_create(const moe_ep_layer_config& c, Exchange** out);
moe_ep_status exchange_destroy(Exchange* x);
// The layer's exchange state and configuration (layer.cc defines them).
Exchange* layer_exchange(const moe_ep_layer* l);

#ifdef MOE_EP_NATIVE_WITH_CUDA
namespace cuda {
moe_ep_status ex_default_blocks(int cuda_device, int* out);
// The low-latency mode's grid: num_blocks, cut to what every one of its kernels can have
// resident on the device at once (0: they cannot run there).
moe_ep_status ex_ll_blocks(int cuda_device, int num_blocks, int* out);
moe_ep_status ex_alloc_zero(int cuda_device, size_t bytes, void** out);
moe_ep_status ex_free(void* p);
moe_ep_status ex_copy_to_device(int cuda_device, void* dst, const void* src, size_t bytes);
moe_ep_status ex_ipc_handle(const void* base, uint8_t* handle);
moe_ep_status ex_ipc_open(int cuda_device, const uint8_t* handle, void** out);
moe_ep_status ex_ipc_close(void* p);
// Plans the routes of topk_idx itself (plan_routes, or inside the one-rank kernel).
moe_ep_status ex_dispatch(void* stream, const Exchange& x, int64_t T, int64_t row_bytes, const void* tokens,
                          const int32_t* topk_idx, const float* weights, void* out_tokens, float* out_w,
                          int32_t* out_meta, int32_t* out_gs, int32_t* out_tpe, int32_t* out_error);
// y: [C, H] of y_dtype (MOE_EP_DTYPE_F32, _BF16, or MOE_EP_Y_F32_MXFP8_ROUND_TRIP / _NVFP4_ROUND_TRIP:
// float32 put through mxfp8's / nvfp4's round trip as read; H % 128 == 0, y and out 16-byte
// aligned: moe_ep_layer_combine checks);
// out: [T, H] float32, or bf16 with out_bf16.
moe_ep_status ex_combine(void* stream, const Exchange& x, int64_t T, const void* y, int32_t y_dtype, void* out,
                         bool out_bf16, const float* row_values, float* out_values, int32_t* out_error);
moe_ep_status ex_status(void* stream, const Exchange& x, int32_t* bits, bool clear);
}  // namespace cuda
#endif

#ifdef MOE_EP_NATIVE_WITH_NCCL_DEVICE
namespace lsa {
// moe_ep_layer_set_peers_nccl after the layer checks (a CUDA layer with an exchange, not connected yet):
// the comm checks, the symmetric window, the peer table; on success x.nccl owns the window.
moe_ep_status ex_set_peers(moe_ep_layer* layer, Exchange& x, moe_ep_comm* comm);
// Releases what ex_set_peers made (NULL: nothing); the communicator must still be alive.
moe_ep_status ex_release(NcclWindow* w);
}  // namespace lsa
#endif

}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_EXCHANGE_H_
