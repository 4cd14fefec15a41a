// Strided box copies on one GPU, optionally converting the element type on the way: the
// pack / unpack / local-copy / peer-copy kernels of the CUDA transport
// (docs/cuda_transport.md). Owns the launch-time descriptor of a copy and the launcher;
// knows nothing of schedules, NCCL or XLA. Plain C++ so that both nvcc (pack.cu.cc) and
// the host compiler (cuda_transport.cc, peer_transport.cc) read it.

#ifndef JAX_M2N_XLA_FFI_CUDA_PACK_H_
#define JAX_M2N_XLA_FFI_CUDA_PACK_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace jax_m2n {

// A box of rank <= 8 collapses to one contiguous run of bytes (a "row") repeated
// over at most 7 outer dims.
inline constexpr int kCopyMaxOuterDims = 7;

// Most elements a converting copy moves per unit: 8, so that narrowing f32 -> bf16 stores
// 16 bytes at a time (over NVLink, wider stores move more bytes per second).
inline constexpr int kConvertMaxVecLog2 = 3;

// One strided copy: `rows` rows of `row_units` units each. Row r is decomposed into outer
// indices innermost first: i_k = (r / prod_{j<k} extent[j]) % extent[k]; its bytes start
// at src + sum_k i_k * src_stride[k] (same for dst; strides in bytes).
// - A plain copy (src_type == dst_type): a unit is (1 << vec_log2) bytes; every pointer,
//   stride and row length is a multiple of the unit.
// - A converting copy (src_type != dst_type, both ElemType codes of xla_ffi/schedule.h,
//   1..5): a unit is (1 << vec_log2) elements (vec_log2 <= kConvertMaxVecLog2), read as
//   src_type and written as dst_type, each converted as XLA's `convert` does
//   (xla_ffi/convert.h); src pointer and strides are multiples of the unit's source
//   bytes, dst ones of its destination bytes.
struct CopyTask {
  const char* src;
  char* dst;
  uint64_t rows;
  uint64_t row_units;
  int32_t vec_log2;  // plain: 0..4 (1- to 16-byte units); converting: 0..3 (1-8 elements)
  int32_t n_outer;   // 0..kCopyMaxOuterDims
  int32_t src_type;  // ElemType code; equal to dst_type (0 included): no conversion
  int32_t dst_type;
  uint64_t extent[kCopyMaxOuterDims];
  int64_t src_stride[kCopyMaxOuterDims];
  int64_t dst_stride[kCopyMaxOuterDims];
  // Entries of LaunchCopyTasks' device-side pointer `table` (the local data plane's
  // addresses, known on the device only): >= 0 makes `src` (`dst`) a byte offset from
  // table[src_slot] (table[dst_slot]), read by the kernel; -1: `src` (`dst`) is the
  // address. The units above are chosen from the offset: table entries must be
  // multiples of 32 bytes (the widest unit).
  int32_t src_slot = -1;
  int32_t dst_slot = -1;
};

// How many tasks one launch carries (by value, as a __grid_constant__ kernel
// parameter: 64 * 224 bytes, under the 32764-byte limit of CUDA >= 12.1 on sm_70+).
inline constexpr int kCopyTasksPerLaunch = 64;

// Enqueues `n` copies (any n >= 0) on `stream`, in as few launches as fit (plain and
// converting copies go to different kernels). The tasks must write disjoint bytes and
// not read what another task writes; `src_type`/`dst_type` must be a supported pair. `tasks` is host
// memory borrowed for the duration of the call. `table`: device memory of int64 addresses
// for the tasks' src_slot / dst_slot (null when no task has one), read by the kernels.
// Returns the first CUDA error (cudaErrorInvalidValue: a slot without a table).
cudaError_t LaunchCopyTasks(const CopyTask* tasks, int n, cudaStream_t stream,
                            const int64_t* table = nullptr);

// Loads the copy kernels into the current device's context now. With CUDA's lazy module
// loading, a first launch in the middle of a reshard may wait for the device's running
// kernels (an NCCL receive waiting for a peer): a deadlock. Call once per device early.
cudaError_t PreloadCopyKernels();

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_PACK_H_
