// The NCCL transport of the C ABI (moe_ep_native.h, section "transport").
//
// Every communicator is non-blocking (ncclConfig_t.blocking = 0): NCCL calls
// return at once, and nccl_ready() polls ncclCommGetAsyncError on the host until
// NCCL has finished enqueuing, at most timeout_ms, so that a peer that never
// arrives ends in MOE_EP_ERR_COMM instead of a hang. Nothing here waits for the
// GPU, so the collectives can be captured in a CUDA graph.
//
// Built only with MOE_EP_NATIVE_NCCL; other builds answer MOE_EP_ERR_UNSUPPORTED.
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "internal.h"

#ifdef MOE_EP_NATIVE_WITH_NCCL
#include "nccl/comm_internal.h"

namespace moe_ep {

std::string nccl_message(const char* op, const char* what, ncclResult_t r) {
  std::string msg = std::string(op) + ": " + what + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') msg += " (" + std::string(last) + ")";
  return msg;
}

moe_ep_status nccl_ready(const char* op, ncclComm_t comm, ncclResult_t issued, int64_t timeout_ms) {
  if (issued != ncclSuccess && issued != ncclInProgress) return fail(MOE_EP_ERR_COMM, nccl_message(op, "NCCL", issued));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  ncclResult_t state = issued;
  for (;;) {
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return fail(MOE_EP_ERR_COMM, nccl_message(op, "ncclCommGetAsyncError", r));
    if (state == ncclSuccess) return MOE_EP_OK;
    if (state != ncclInProgress) return fail(MOE_EP_ERR_COMM, nccl_message(op, "the communicator", state));
    if (std::chrono::steady_clock::now() > deadline)
      return fail(MOE_EP_ERR_COMM, std::string(op) + ": NCCL did not finish within timeout_ms = " +
                                       std::to_string(timeout_ms) + " ms (a rank that never joined or never called?)");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

namespace {

moe_ep_status bad(const char* op, const std::string& rule, const std::string& got) {
  return fail(MOE_EP_ERR_INVALID_ARGUMENT, std::string(op) + ": " + rule + "; got " + got);
}

moe_ep_status device_error(const char* op, int device) {
  return fail(MOE_EP_ERR_CUDA, std::string(op) + ": cudaSetDevice(" + std::to_string(device) + ") failed");
}

moe_ep_status check_comm(const char* op, const moe_ep_comm* comm) {
  if (comm == nullptr || comm->nccl == nullptr) return bad(op, "comm must be a communicator from moe_ep_comm_init", "NULL");
  return MOE_EP_OK;
}

}  // namespace
}  // namespace moe_ep

extern "C" {

int moe_ep_has_nccl(void) { return 1; }

moe_ep_status moe_ep_comm_unique_id(uint8_t* id, size_t id_bytes) {
  const char* op = "moe_ep_comm_unique_id";
  if (id == nullptr) return moe_ep::bad(op, "id must not be NULL", "NULL");
  if (id_bytes != MOE_EP_UNIQUE_ID_BYTES)
    return moe_ep::bad(op, "id_bytes must be MOE_EP_UNIQUE_ID_BYTES = 128", std::to_string(id_bytes));
  static_assert(sizeof(ncclUniqueId) == MOE_EP_UNIQUE_ID_BYTES, "ncclUniqueId size");
  ncclUniqueId uid;
  const ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) return moe_ep::fail(MOE_EP_ERR_COMM, moe_ep::nccl_message(op, "ncclGetUniqueId", r));
  std::memcpy(id, &uid, sizeof uid);
  return MOE_EP_OK;
}

moe_ep_status moe_ep_comm_init(const uint8_t* id, size_t id_bytes, int32_t num_ranks, int32_t rank, int32_t cuda_device,
                               int64_t timeout_ms, moe_ep_comm** comm) {
  const char* op = "moe_ep_comm_init";
  if (comm == nullptr) return moe_ep::bad(op, "comm must not be NULL", "NULL");
  *comm = nullptr;
  if (id == nullptr) return moe_ep::bad(op, "id must not be NULL", "NULL");
  if (id_bytes != MOE_EP_UNIQUE_ID_BYTES)
    return moe_ep::bad(op, "id_bytes must be MOE_EP_UNIQUE_ID_BYTES = 128", std::to_string(id_bytes));
  if (num_ranks < 1) return moe_ep::bad(op, "num_ranks must be >= 1", std::to_string(num_ranks));
  if (rank < 0 || rank >= num_ranks)
    return moe_ep::bad(op, "rank must be in [0, num_ranks) = [0, " + std::to_string(num_ranks) + ")", std::to_string(rank));
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess)
    return moe_ep::fail(MOE_EP_ERR_CUDA, std::string(op) + ": cudaGetDeviceCount failed: " + cudaGetErrorString(e));
  if (cuda_device < 0 || cuda_device >= devices)
    return moe_ep::bad(op, "cuda_device must be in [0, " + std::to_string(devices) + ") (the visible CUDA devices)",
                       std::to_string(cuda_device));
  if (timeout_ms < 1) return moe_ep::bad(op, "timeout_ms must be >= 1", std::to_string(timeout_ms));
  moe_ep::DeviceGuard guard(cuda_device);
  if (!guard.ok()) return moe_ep::device_error(op, cuda_device);
  ncclUniqueId uid;
  std::memcpy(&uid, id, sizeof uid);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t nccl = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&nccl, num_ranks, uid, rank, &config);
  if (nccl == nullptr) return moe_ep::fail(MOE_EP_ERR_COMM, moe_ep::nccl_message(op, "ncclCommInitRankConfig", r));
  const moe_ep_status st = moe_ep::nccl_ready(op, nccl, r, timeout_ms);
  if (st != MOE_EP_OK) {
    ncclCommAbort(nccl);
    return st;
  }
  *comm = new (std::nothrow) moe_ep_comm{nccl, num_ranks, rank, cuda_device, timeout_ms};
  if (*comm == nullptr) {
    ncclCommAbort(nccl);
    return moe_ep::fail(MOE_EP_ERR_INTERNAL, std::string(op) + ": out of host memory");
  }
  return MOE_EP_OK;
}

moe_ep_status moe_ep_comm_destroy(moe_ep_comm* comm) {
  const char* op = "moe_ep_comm_destroy";
  if (comm == nullptr) return MOE_EP_OK;
  moe_ep_status st = MOE_EP_OK;
  if (comm->nccl != nullptr) {
    moe_ep::DeviceGuard guard(comm->device);
    st = moe_ep::nccl_ready(op, comm->nccl, ncclCommFinalize(comm->nccl), comm->timeout_ms);
    if (st == MOE_EP_OK) {
      const ncclResult_t r = ncclCommDestroy(comm->nccl);
      if (r != ncclSuccess) st = moe_ep::fail(MOE_EP_ERR_COMM, moe_ep::nccl_message(op, "ncclCommDestroy", r));
    } else {
      ncclCommAbort(comm->nccl);
    }
  }
  delete comm;
  return st;
}

moe_ep_status moe_ep_comm_info(const moe_ep_comm* comm, int32_t* num_ranks, int32_t* rank) {
  const char* op = "moe_ep_comm_info";
  if (moe_ep_status st = moe_ep::check_comm(op, comm); st != MOE_EP_OK) return st;
  if (num_ranks == nullptr || rank == nullptr) return moe_ep::bad(op, "num_ranks and rank must not be NULL", "NULL");
  *num_ranks = comm->num_ranks;
  *rank = comm->rank;
  return MOE_EP_OK;
}

moe_ep_status moe_ep_comm_all_gather(moe_ep_comm* comm, void* stream, const void* send, void* recv, int64_t bytes) {
  const char* op = "moe_ep_comm_all_gather";
  if (moe_ep_status st = moe_ep::check_comm(op, comm); st != MOE_EP_OK) return st;
  if (bytes < 0) return moe_ep::bad(op, "bytes must be >= 0", std::to_string(bytes));
  if (bytes > std::numeric_limits<int64_t>::max() / comm->num_ranks)
    return moe_ep::bad(op, "num_ranks * bytes must fit int64", std::to_string(bytes));
  if (bytes == 0) return MOE_EP_OK;
  if (send == nullptr || recv == nullptr) return moe_ep::bad(op, "send and recv must not be NULL when bytes > 0", "NULL");
  moe_ep::DeviceGuard guard(comm->device);
  if (!guard.ok()) return moe_ep::device_error(op, comm->device);
  const ncclResult_t r = ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm->nccl,
                                       static_cast<cudaStream_t>(stream));
  return moe_ep::nccl_ready(op, comm->nccl, r, comm->timeout_ms);
}

moe_ep_status moe_ep_comm_exchange(moe_ep_comm* comm, void* stream, const void* send, const int64_t* send_rows,
                                   void* recv, const int64_t* recv_rows, int64_t row_bytes) {
  const char* op = "moe_ep_comm_exchange";
  if (moe_ep_status st = moe_ep::check_comm(op, comm); st != MOE_EP_OK) return st;
  if (send_rows == nullptr || recv_rows == nullptr)
    return moe_ep::bad(op, "send_rows and recv_rows must not be NULL ([num_ranks] int64 host arrays)", "NULL");
  if (row_bytes < 1) return moe_ep::bad(op, "row_bytes must be >= 1", std::to_string(row_bytes));
  const int64_t limit = std::numeric_limits<int64_t>::max() / row_bytes;
  int64_t send_total = 0, recv_total = 0;
  auto add = [&](const char* name, int32_t p, int64_t v, int64_t& total) {
    if (v < 0) return moe_ep::bad(op, std::string(name) + "[" + std::to_string(p) + "] must be >= 0", std::to_string(v));
    if (v > limit - total) return moe_ep::bad(op, std::string("sum(") + name + ") * row_bytes must fit int64", std::to_string(v));
    total += v;
    return MOE_EP_OK;
  };
  for (int32_t p = 0; p < comm->num_ranks; ++p) {
    if (moe_ep_status st = add("send_rows", p, send_rows[p], send_total); st != MOE_EP_OK) return st;
    if (moe_ep_status st = add("recv_rows", p, recv_rows[p], recv_total); st != MOE_EP_OK) return st;
  }
  if (send_total > 0 && send == nullptr) return moe_ep::bad(op, "send must not be NULL when sum(send_rows) > 0", "NULL");
  if (recv_total > 0 && recv == nullptr) return moe_ep::bad(op, "recv must not be NULL when sum(recv_rows) > 0", "NULL");
  moe_ep::DeviceGuard guard(comm->device);
  if (!guard.ok()) return moe_ep::device_error(op, comm->device);
  const auto* src = static_cast<const unsigned char*>(send);
  auto* dst = static_cast<unsigned char*>(recv);
  auto s = static_cast<cudaStream_t>(stream);
  ncclResult_t r = ncclGroupStart();
  int64_t send_off = 0, recv_off = 0;
  for (int32_t p = 0; p < comm->num_ranks && (r == ncclSuccess || r == ncclInProgress); ++p) {
    if (send_rows[p] > 0)
      r = ncclSend(src + send_off * row_bytes, static_cast<size_t>(send_rows[p] * row_bytes), ncclUint8, p, comm->nccl, s);
    if (recv_rows[p] > 0 && (r == ncclSuccess || r == ncclInProgress))
      r = ncclRecv(dst + recv_off * row_bytes, static_cast<size_t>(recv_rows[p] * row_bytes), ncclUint8, p, comm->nccl, s);
    send_off += send_rows[p];
    recv_off += recv_rows[p];
  }
  const ncclResult_t end = ncclGroupEnd();
  return moe_ep::nccl_ready(op, comm->nccl, (r == ncclSuccess || r == ncclInProgress) ? end : r, comm->timeout_ms);
}

}  // extern "C"

#else  // no NCCL transport in this build

struct moe_ep_comm {
  int unused;
};

namespace {
moe_ep_status unsupported(const char* op) {
  return moe_ep::fail(MOE_EP_ERR_UNSUPPORTED,
                      std::string(op) + ": this build of the native core has no NCCL transport (rebuild with "
                                        "MOE_EP_NATIVE_CUDA=ON and MOE_EP_NATIVE_NCCL=ON; docs/native.md)");
}
}  // namespace

extern "C" {
int moe_ep_has_nccl(void) { return 0; }
moe_ep_status moe_ep_comm_unique_id(uint8_t*, size_t) { return unsupported("moe_ep_comm_unique_id"); }
moe_ep_status moe_ep_comm_init(const uint8_t*, size_t, int32_t, int32_t, int32_t, int64_t, moe_ep_comm** comm) {
  if (comm != nullptr) *comm = nullptr;
  return unsupported("moe_ep_comm_init");
}
moe_ep_status moe_ep_comm_destroy(moe_ep_comm* comm) {
  return comm == nullptr ? MOE_EP_OK : unsupported("moe_ep_comm_destroy");
}
moe_ep_status moe_ep_comm_info(const moe_ep_comm*, int32_t*, int32_t*) { return unsupported("moe_ep_comm_info"); }
moe_ep_status moe_ep_comm_all_gather(moe_ep_comm*, void*, const void*, void*, int64_t) {
  return unsupported("moe_ep_comm_all_gather");
}
moe_ep_status moe_ep_comm_exchange(moe_ep_comm*, void*, const void*, const int64_t*, void*, const int64_t*, int64_t) {
  return unsupported("moe_ep_comm_exchange");
}
}  // extern "C"

#endif
