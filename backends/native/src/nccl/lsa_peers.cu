// The NCCL provider of the device exchange's peer table (moe_ep_layer_set_peers_nccl,
// include/moe_ep_native.h section "exchange"): every rank's symmetric region is
// one NCCL symmetric window, and the table holds its LSA pointers (NCCL's flat
// mapping of every rank's window in one NVLink domain).
//
// Host sequence (NCCL 2.28.9, nccl_device.h; the public example
// NVIDIA/nccl examples/06_device_api): ncclGetVersion must equal NCCL_VERSION_CODE
// (before NCCL 2.31 the device API runs only with the NCCL it was compiled
// against), ncclMemAlloc, zero fill, ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC),
// ncclDevCommCreate with no resources (to learn the LSA team), one kernel that
// reads ncclGetPeerPointer(win, 0, r) for every rank r, then the table as
// moe_ep_layer_set_peers takes it. The communicator is non-blocking
// (moe_ep_comm_init): every collective call is polled to completion with the
// communicator's timeout (nccl_ready). Teardown (layer destroy): ncclDevCommDestroy,
// ncclCommWindowDeregister, ncclMemFree, while the communicator lives.
//
// Setup only: nothing here runs on the exchange's per-step path or in a capture.
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "exchange.h"
#include "nccl/comm_internal.h"

namespace moe_ep {

struct NcclWindow {
  ncclComm_t comm = nullptr;  // borrowed: the moe_ep_comm's communicator, which must outlive the layer
  int device = 0;
  int64_t timeout_ms = 0;
  void* mem = nullptr;        // ncclMemAlloc
  size_t bytes = 0;
  ncclWindow_t win = nullptr;  // ncclCommWindowRegister
  ncclDevComm dev_comm{};      // ncclDevCommCreate
  bool has_dev_comm = false;
};

namespace lsa {
namespace {

constexpr const char* kOp = "moe_ep_layer_set_peers_nccl";

// table[r] = rank r's LSA pointer of the window's first byte (world rank r; the LSA team holds every rank).
__global__ void peer_pointers(ncclWindow_t win, int num_ranks, unsigned long long* table) {
  const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (r < num_ranks) table[r] = reinterpret_cast<unsigned long long>(ncclGetPeerPointer(win, 0, r));
}

std::string version_string(int code) {
  // NCCL_VERSION(X, Y, Z): X * 10000 + Y * 100 + Z from 2.9 on, X * 1000 + Y * 100 + Z before.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
  const int patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch) + " (" +
         std::to_string(code) + ")";
}

moe_ep_status cuda_error(const char* what, cudaError_t e) {
  return fail(MOE_EP_ERR_CUDA, std::string(kOp) + ": " + what + " failed: " + cudaGetErrorString(e));
}

moe_ep_status nccl_call(const char* what, ncclResult_t r) {
  return r == ncclSuccess ? MOE_EP_OK : fail(MOE_EP_ERR_COMM, nccl_message(kOp, what, r));
}

// Reads every rank's LSA pointer of w's window on the device and copies them to `table`.
moe_ep_status read_peer_table(const NcclWindow& w, int num_ranks, std::vector<uint64_t>* table) {
  cudaStream_t stream = nullptr;
  unsigned long long* dev_table = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) return cuda_error("cudaStreamCreateWithFlags", e);
  const char* what = "cudaMallocAsync";
  e = cudaMallocAsync(reinterpret_cast<void**>(&dev_table), sizeof(unsigned long long) * num_ranks, stream);
  if (e == cudaSuccess) {
    const int threads = 128;
    peer_pointers<<<(num_ranks + threads - 1) / threads, threads, 0, stream>>>(w.win, num_ranks, dev_table);
    what = "the peer-pointer kernel";
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) {
    what = "cudaMemcpyAsync";
    e = cudaMemcpyAsync(table->data(), dev_table, sizeof(unsigned long long) * num_ranks, cudaMemcpyDeviceToHost,
                        stream);
  }
  if (dev_table != nullptr) {
    const cudaError_t f = cudaFreeAsync(dev_table, stream);
    if (e == cudaSuccess && f != cudaSuccess) {
      what = "cudaFreeAsync";
      e = f;
    }
  }
  const cudaError_t s = cudaStreamSynchronize(stream);
  if (e == cudaSuccess && s != cudaSuccess) {
    what = "cudaStreamSynchronize";
    e = s;
  }
  cudaStreamDestroy(stream);
  return e == cudaSuccess ? MOE_EP_OK : cuda_error(what, e);
}

}  // namespace

moe_ep_status ex_release(NcclWindow* w) {
  if (w == nullptr) return MOE_EP_OK;
  moe_ep_status st = MOE_EP_OK;
  auto keep = [&](moe_ep_status s) {
    if (st == MOE_EP_OK) st = s;
  };
  {
    DeviceGuard guard(w->device);
    const char* op = "moe_ep_layer_destroy";
    if (!guard.ok())
      keep(fail(MOE_EP_ERR_CUDA, std::string(op) + ": cudaSetDevice(" + std::to_string(w->device) + ") failed"));
    // No kernel may still be storing through the window's mappings when they go.
    if (guard.ok() && cudaDeviceSynchronize() != cudaSuccess)
      keep(fail(MOE_EP_ERR_CUDA, std::string(op) + ": cudaDeviceSynchronize before releasing the NCCL window failed"));
    if (w->has_dev_comm) {
      const ncclResult_t r = ncclDevCommDestroy(w->comm, &w->dev_comm);
      keep(r == ncclSuccess ? MOE_EP_OK
                            : nccl_ready(op, w->comm, r, w->timeout_ms));  // ncclInProgress: poll; else the error
    }
    if (w->win != nullptr) {
      const ncclResult_t r = ncclCommWindowDeregister(w->comm, w->win);
      keep(r == ncclSuccess ? MOE_EP_OK : nccl_ready(op, w->comm, r, w->timeout_ms));
    }
    if (w->mem != nullptr) {
      const ncclResult_t r = ncclMemFree(w->mem);
      if (r != ncclSuccess) keep(fail(MOE_EP_ERR_COMM, nccl_message(op, "ncclMemFree", r)));
    }
  }
  delete w;
  return st;
}

moe_ep_status ex_set_peers(moe_ep_layer* layer, Exchange& x, moe_ep_comm* comm) {
  const Check ck{kOp};
  if (comm->nccl == nullptr) return ck.bad("comm must be a communicator from moe_ep_comm_init", "a destroyed one");
  const int32_t n = x.shape.N, rank = x.shape.rank;
  if (comm->num_ranks != n)
    return ck.bad("comm's num_ranks must be the layer's config.ex_num_ranks = " + std::to_string(n),
               std::to_string(comm->num_ranks));
  if (comm->rank != rank)
    return ck.bad("comm's rank must be the layer's config.ex_rank = " + std::to_string(rank), std::to_string(comm->rank));
  if (comm->device != x.cuda_device)
    return ck.bad("comm's cuda_device must be the layer's config.cuda_device = " + std::to_string(x.cuda_device),
               std::to_string(comm->device));
  int runtime = 0;
  MOE_EP_TRY(nccl_call("ncclGetVersion", ncclGetVersion(&runtime)));
  if (runtime != NCCL_VERSION_CODE)
    return fail(MOE_EP_ERR_UNSUPPORTED,
                std::string(kOp) + ": the NCCL library loaded must be the version this library was compiled against "
                "(before NCCL 2.31 the device API runs only with the very NCCL it was built with); compiled with " +
                    version_string(NCCL_VERSION_CODE) + ", running " + version_string(runtime) +
                    ": rebuild against the running NCCL, or use the IPC loopback or the grouped send/recv exchange");

  DeviceGuard guard(comm->device);
  if (!guard.ok())
    return fail(MOE_EP_ERR_CUDA, std::string(kOp) + ": cudaSetDevice(" + std::to_string(comm->device) + ") failed");
  NcclWindow* w = new (std::nothrow) NcclWindow();
  if (w == nullptr) return fail(MOE_EP_ERR_INTERNAL, std::string(kOp) + ": out of host memory");
  w->comm = comm->nccl;
  w->device = comm->device;
  w->timeout_ms = comm->timeout_ms;
  const size_t align = NCCL_WIN_REQUIRED_ALIGNMENT;
  w->bytes = (static_cast<size_t>(x.sym.bytes) + align - 1) / align * align;

  // Undoes everything on failure, keeping the first error's message.
  auto undo = [&](moe_ep_status st) {
    const std::string message = moe_ep_last_error();
    ex_release(w);
    return fail(st, message);
  };
  // An NCCL call that failed or did not finish within the timeout may still write into w
  // (the window handle, the device communicator) and use the memory: those are left
  // allocated, on purpose (the communicator is unusable now and must be destroyed).
  auto abandon = [&](moe_ep_status st) {
    const std::string message = moe_ep_last_error();
    return fail(st, message + " (the window's memory is left allocated: NCCL may still use it)");
  };
  moe_ep_status st = nccl_call("ncclMemAlloc", ncclMemAlloc(&w->mem, w->bytes));
  if (st != MOE_EP_OK) {
    w->mem = nullptr;
    return undo(st);
  }
  {  // Zero before the registration: no peer can store into the window before it is registered everywhere.
    cudaStream_t stream = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) {
      e = cudaMemsetAsync(w->mem, 0, w->bytes, stream);
      const cudaError_t s = cudaStreamSynchronize(stream);
      if (e == cudaSuccess) e = s;
      cudaStreamDestroy(stream);
    }
    if (e != cudaSuccess) return undo(cuda_error("zeroing the window (cudaMemsetAsync)", e));
  }
  // Written by NCCL when the (possibly asynchronous) registration completes: heap memory, polled to completion.
  st = nccl_ready(kOp, w->comm, ncclCommWindowRegister(w->comm, w->mem, w->bytes, &w->win, NCCL_WIN_COLL_SYMMETRIC),
                  w->timeout_ms);
  if (st != MOE_EP_OK) return abandon(st);
  if (w->win == nullptr)  // NCCL's answer when the communicator has no symmetric memory
    st = fail(MOE_EP_ERR_UNSUPPORTED,
              std::string(kOp) + ": NCCL registered no symmetric window (no symmetric-memory support for these ranks: "
              "NCCL_WIN_ENABLE=0, NCCL_CUMEM_ENABLE=0, or GPUs without peer access): use the IPC loopback or the "
              "grouped send/recv exchange");
  if (st != MOE_EP_OK) {
    w->win = nullptr;  // failed or unknown: nothing of ours to deregister (the communicator reclaims the rest)
    return undo(st);
  }
  ncclDevCommRequirements reqs;
  std::memset(&reqs, 0, sizeof reqs);  // 2.28.9: a plain struct, no initializer macro; no resources needed
  st = nccl_ready(kOp, w->comm, ncclDevCommCreate(w->comm, &reqs, &w->dev_comm), w->timeout_ms);
  if (st != MOE_EP_OK) return abandon(st);
  w->has_dev_comm = true;
  if (w->dev_comm.nRanks != n || w->dev_comm.rank != rank)
    return undo(fail(MOE_EP_ERR_INTERNAL, std::string(kOp) + ": NCCL's device communicator has rank " +
                                              std::to_string(w->dev_comm.rank) + " of " +
                                              std::to_string(w->dev_comm.nRanks) + ", the layer rank " +
                                              std::to_string(rank) + " of " + std::to_string(n)));
  if (w->dev_comm.lsaSize != w->dev_comm.nRanks)
    return undo(fail(MOE_EP_ERR_UNSUPPORTED,
                     std::string(kOp) + ": ranks outside one NVLink (LSA) team: use the IPC loopback or the grouped "
                     "send/recv exchange (NCCL's LSA team has " + std::to_string(w->dev_comm.lsaSize) +
                         " ranks, the communicator " + std::to_string(w->dev_comm.nRanks) + ")"));
  std::vector<uint64_t> table(static_cast<size_t>(n), 0);
  st = read_peer_table(*w, n, &table);
  if (st != MOE_EP_OK) return undo(st);
  for (int32_t p = 0; p < n; ++p)
    if (table[p] == 0 || table[p] % 256 != 0)
      return undo(fail(MOE_EP_ERR_INTERNAL, std::string(kOp) + ": NCCL's LSA pointer of rank " + std::to_string(p) +
                                                " must be a non-NULL address aligned to 256 bytes; got " +
                                                std::to_string(table[p])));
  st = moe_ep_layer_set_peers(layer, table.data());
  if (st != MOE_EP_OK) {  // the table may be half set: back to the layer's own region, unconnected
    x.peers.assign(x.peers.size(), 0);
    x.region = x.own;
    x.connected = false;
    return undo(st);
  }
  x.nccl = w;
  return MOE_EP_OK;
}

}  // namespace lsa
}  // namespace moe_ep
