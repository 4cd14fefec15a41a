// The CUDA handlers of the local data plane's custom calls (xla_ffi/local_copy.h has
// the schedule and the contract): jax_m2n_local_copy fills a GPU's outputs with boxes
// read from device memory another program exported (an opened CUDA IPC mapping), and
// jax_m2n_local_store copies a GPU's arrays to such memory; both on XLA's stream with
// the copy kernels of pack.h, with no host synchronization. Registered from Python
// through module_cuda.cc; this header only declares them.

#ifndef JAX_M2N_XLA_FFI_CUDA_LOCAL_COPY_CUDA_H_
#define JAX_M2N_XLA_FFI_CUDA_LOCAL_COPY_CUDA_H_

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

// jax_m2n_local_copy on platform CUDA ({"instantiate": ..., "execute": ...}):
//   instantiate: attr schedule (int64[]), decoded and validated (DecodeLocalCopySchedule).
//   execute:     operand 0: the pointer table (device memory; each entry a device
//                address of this GPU, a multiple of 32 bytes); results: the outputs.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nLocalCopyCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nLocalCopyCudaExecute);

// jax_m2n_local_store on platform CUDA: operand 0 the destination addresses (multiples
// of 32 bytes), operands 1..n the arrays; result: a uint8 scalar set to 1 after the
// copies, on the same stream.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nLocalStoreCuda);

#endif  // JAX_M2N_XLA_FFI_CUDA_LOCAL_COPY_CUDA_H_
