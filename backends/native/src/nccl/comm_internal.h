// What the NCCL transport (nccl/comm.cc) shares with the NCCL provider of the
// device exchange's peer table (nccl/lsa_peers.cu): the communicator behind a
// moe_ep_comm and the host-side polling of a non-blocking NCCL communicator.
// Only in builds with MOE_EP_NATIVE_NCCL.
#ifndef MOE_EP_NATIVE_NCCL_COMM_INTERNAL_H_
#define MOE_EP_NATIVE_NCCL_COMM_INTERNAL_H_

#ifdef MOE_EP_NATIVE_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <string>

#include "internal.h"

struct moe_ep_comm {
  ncclComm_t nccl = nullptr;
  int32_t num_ranks = 0;
  int32_t rank = 0;
  int32_t device = 0;
  int64_t timeout_ms = 0;
};

namespace moe_ep {

// "<op>: <what> failed: <NCCL's error string> (<NCCL's last error>)".
std::string nccl_message(const char* op, const char* what, ncclResult_t r);

// Polls until NCCL has finished the host side of the last call on `comm` (issued: what that call
// returned), at most timeout_ms; MOE_EP_ERR_COMM with NCCL's message on failure or expiry.
moe_ep_status nccl_ready(const char* op, ncclComm_t comm, ncclResult_t issued, int64_t timeout_ms);

// Sets a device for the scope of a call and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  bool ok() const { return ok_; }

 private:
  int previous_ = -1;
  bool ok_ = false;
};

}  // namespace moe_ep

#endif  // MOE_EP_NATIVE_WITH_NCCL
#endif  // MOE_EP_NATIVE_NCCL_COMM_INTERNAL_H_
