// CUDA IPC allocation, export, mapping and release through the runtime API (the
// primary context, shared with XLA). Errors are strings for the nanobind module to
// raise; nothing here aborts.

#include "xla_ffi/cuda/ipc.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace jax_m2n {
namespace {

std::string Failed(const char* call, const std::string& what, cudaError_t err) {
  // A failed runtime call stays this thread's last error: cleared here, or the next
  // kernel launch checked on this thread (XLA's, an eager call's) reports it as its own.
  cudaGetLastError();
  return std::string(call) + ": " + what + " failed: " + cudaGetErrorString(err) + " (" +
         cudaGetErrorName(err) + ")";
}

// Makes `ordinal` current for its lifetime, restoring the previous device after.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = previous_ == ordinal ? cudaSuccess : cudaSetDevice(ordinal);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace

std::string IpcAlloc(int device_ordinal, int64_t nbytes, uint64_t* address,
                     std::string* handle) {
  if (nbytes <= 0) return "ipc_alloc: nbytes must be > 0; got " + std::to_string(nbytes);
  DeviceScope scope(device_ordinal);
  if (scope.error() != cudaSuccess) {
    return Failed("ipc_alloc", "cudaSetDevice(" + std::to_string(device_ordinal) + ")",
                  scope.error());
  }
  void* ptr = nullptr;
  if (cudaError_t err = cudaMalloc(&ptr, static_cast<size_t>(nbytes)); err != cudaSuccess) {
    return Failed("ipc_alloc",
                  "cudaMalloc(device " + std::to_string(device_ordinal) + ", " +
                      std::to_string(nbytes) + " bytes)",
                  err);
  }
  cudaIpcMemHandle_t h;
  if (cudaError_t err = cudaIpcGetMemHandle(&h, ptr); err != cudaSuccess) {
    cudaFree(ptr);
    return Failed("ipc_alloc", "cudaIpcGetMemHandle(device " +
                                   std::to_string(device_ordinal) + ")",
                  err);
  }
  static_assert(sizeof(h) == kIpcHandleBytes, "cudaIpcMemHandle_t is 64 bytes");
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  *address = reinterpret_cast<uint64_t>(ptr);
  return "";
}

std::string IpcOpen(int device_ordinal, const std::string& handle, uint64_t* address) {
  if (handle.size() != kIpcHandleBytes) {
    return "ipc_open: handle must be " + std::to_string(kIpcHandleBytes) +
           " bytes; got " + std::to_string(handle.size());
  }
  DeviceScope scope(device_ordinal);
  if (scope.error() != cudaSuccess) {
    return Failed("ipc_open", "cudaSetDevice(" + std::to_string(device_ordinal) + ")",
                  scope.error());
  }
  cudaIpcMemHandle_t h;  // passed by value, as the driver's cuIpcOpenMemHandle takes it
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  if (cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
      err != cudaSuccess) {
    return Failed("ipc_open",
                  "cudaIpcOpenMemHandle(device " + std::to_string(device_ordinal) + ")",
                  err);
  }
  *address = reinterpret_cast<uint64_t>(ptr);
  return "";
}

std::string IpcClose(uint64_t address) {
  if (cudaError_t err = cudaIpcCloseMemHandle(reinterpret_cast<void*>(address));
      err != cudaSuccess) {
    return Failed("ipc_close", "cudaIpcCloseMemHandle(" + std::to_string(address) + ")",
                  err);
  }
  return "";
}

std::string IpcFree(uint64_t address) {
  if (cudaError_t err = cudaFree(reinterpret_cast<void*>(address)); err != cudaSuccess) {
    return Failed("ipc_free", "cudaFree(" + std::to_string(address) + ")", err);
  }
  return "";
}

}  // namespace jax_m2n
