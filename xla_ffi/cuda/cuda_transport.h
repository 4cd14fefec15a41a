// The CUDA transport: runs one device's part of a decoded schedule on a CUDA stream.
// Owns the per-device executable form of a schedule (DevicePlan: per step, the pack and
// local-copy kernels, device memcpys, one NCCL group of sends/receives, the unpack
// kernels) and its execution. Knows schedules (xla_ffi/schedule.h) and the communicator
// (nccl_comm.h); knows nothing of shardings or of XLA beyond ffi::Error.
//
// Threading: a DevicePlan is immutable once built and may be run from any thread; runs on
// one device are serialized by LocalRank::mu (NCCL communicators are not thread-safe).

#ifndef JAX_M2N_XLA_FFI_CUDA_CUDA_TRANSPORT_H_
#define JAX_M2N_XLA_FFI_CUDA_CUDA_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/nccl_comm.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

class DevicePlan;
struct DevicePlanDeleter {
  void operator()(DevicePlan* plan) const;
};
using DevicePlanPtr = std::unique_ptr<DevicePlan, DevicePlanDeleter>;

// Device pointers of one call on one device. Borrowed for the duration of RunDevicePlan.
struct DeviceBuffers {
  std::vector<const char*> operands;
  std::vector<char*> results;  // without the workspace
  char* workspace = nullptr;
};

// The base address of the buffer an op end names (kind and slot) among `buffers`: an
// operand, a result, or the workspace (whose op ends carry a byte offset, not a slot).
// Shared by this transport and the peer path (peer_transport.cc).
char* BufferBase(const DeviceBuffers& buffers, BufferKind kind, int64_t slot);

// The dims of the buffer an op end names: an operand's or a result's shard shape from
// `shapes`, or for the workspace (full-tensor buffers) the tensor's global dims.
::xla::ffi::Span<const int64_t> BufferDims(const Schedule& schedule,
                                           const DeviceBufferShapes& shapes, const Op& op,
                                           const OpEnd& end);

// Builds the plan of participant `participant` of `schedule` for buffers of `shapes`
// (checked with CheckDeviceBuffers), resolving peers to ranks of `comm`. The schedule
// must outlive the plan.
::xla::ffi::ErrorOr<DevicePlanPtr> BuildDevicePlan(
    const Schedule& schedule, int32_t participant, const DeviceBufferShapes& shapes,
    const Communicator& comm);

// True if `plan` was built for buffers of these shapes and the communicator generation
// (otherwise rebuild it).
bool PlanMatches(const DevicePlan& plan, const DeviceBufferShapes& shapes,
                 uint64_t generation);

// Enqueues the device's work on `stream` (no host synchronization; NCCL calls return once
// enqueued because peers were connected at initialization). `timeout_ms` > 0 bounds the
// wait for NCCL's host side and arms the watchdog for the GPU side.
::xla::ffi::Error RunDevicePlan(const DevicePlan& plan, const DeviceBuffers& buffers,
                                LocalRank* rank, cudaStream_t stream, int64_t timeout_ms);

// Counters of a plan, for tests and the docs: how the work was split.
struct DevicePlanStats {
  int64_t steps = 0;          // steps with work on this device
  int64_t kernel_tasks = 0;   // pack + unpack + strided local copies
  int64_t memcpys = 0;        // contiguous local copies
  int64_t sends = 0;
  int64_t recvs = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};
DevicePlanStats StatsOf(const DevicePlan& plan);

// "op 12 (step 3, fanout, tensor 0, device 2 -> 5, 4096 bytes)": how errors name an op.
std::string OpLabel(const Schedule& s, int32_t index);

// "cudaErrorX (message)": how errors name a CUDA failure.
std::string CudaError(cudaError_t err);

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_CUDA_TRANSPORT_H_
