// The `jax_m2n_reshard` custom call for platform CUDA (docs/schedule_format.md): XLA FFI
// handlers for the instantiate stage (decode the schedule once per executable into
// CudaReshardState) and the execute stage (run this device's part on the XLA stream).
// Not command-buffer compatible (NCCL). The handlers are registered from Python through
// module_cuda.cc; this header only declares them.

#ifndef JAX_M2N_XLA_FFI_CUDA_RESHARD_CUDA_H_
#define JAX_M2N_XLA_FFI_CUDA_RESHARD_CUDA_H_

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_m2n {

// The FFI state of one executable: the decoded schedule and, per participant, its
// DevicePlan (built at the first execute on that device). Registered with
// jax.ffi.register_ffi_type under kCudaReshardStateName.
struct CudaReshardState;
inline constexpr const char kCudaReshardStateName[] = "jax_m2n.cuda.ReshardState";

// Type id / info of CudaReshardState for registration from Python.
XLA_FFI_TypeId* CudaReshardStateTypeId();
const XLA_FFI_TypeInfo* CudaReshardStateTypeInfo();

}  // namespace jax_m2n

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nReshardCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nReshardCudaExecute);

#endif  // JAX_M2N_XLA_FFI_CUDA_RESHARD_CUDA_H_
