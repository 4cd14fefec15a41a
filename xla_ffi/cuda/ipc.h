// CUDA IPC memory for the local data plane: device memory one program allocates and
// exports (a 64-byte handle) and another program on the same host maps. Owns the four
// calls and their error messages; knows nothing of versions, JAX or XLA. The memory is
// cudaMalloc'ed in the device's primary context (the one XLA uses): XLA's own buffers
// are not exportable (virtual memory management allocations), cudaMalloc's are.

#ifndef JAX_M2N_XLA_FFI_CUDA_IPC_H_
#define JAX_M2N_XLA_FFI_CUDA_IPC_H_

#include <cstdint>
#include <string>

namespace jax_m2n {

// Bytes of an exported handle (cudaIpcMemHandle_t).
inline constexpr size_t kIpcHandleBytes = 64;

// Each returns "" on success, else "<call>: <CUDA call>(<arguments>) failed: <CUDA's
// error string>". Each makes `device_ordinal` current for the call and restores the
// thread's previous device.

// Allocates `nbytes` (> 0) on the device (256-byte aligned) and exports it: `*address`
// the device pointer, `*handle` the kIpcHandleBytes to send to the reader.
std::string IpcAlloc(int device_ordinal, int64_t nbytes, uint64_t* address,
                     std::string* handle);

// Maps another process's exported memory (lazy peer access, so a handle from another
// GPU of the host maps too where peer access is possible): `*address` is valid in this
// process until IpcClose. Opening a handle of this same process fails.
std::string IpcOpen(int device_ordinal, const std::string& handle, uint64_t* address);

// Unmaps what IpcOpen mapped. Work that reads it must have finished.
std::string IpcClose(uint64_t address);

// Frees what IpcAlloc allocated (readers' mappings become invalid: free a version only
// after its readers are done). Synchronizes the device, as cudaFree does.
std::string IpcFree(uint64_t address);

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_IPC_H_
