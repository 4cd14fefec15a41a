// The direct peer path of the CUDA transport (docs/cuda_transport.md, "Peer path"): when
// every participant of a schedule is a GPU of this process, the devices' concurrent calls
// meet in a host rendezvous, and the last to arrive enqueues the whole schedule on the
// participants' XLA streams: copy-engine peer copies (contiguous, 2-D and 3-D strided) and
// copy kernels that store into (or, widening a dtype, load from) a peer's memory over
// NVLink, ordered by cross-device events. No NCCL, no staging, no host synchronization.

#ifndef JAX_M2N_XLA_FFI_CUDA_PEER_TRANSPORT_H_
#define JAX_M2N_XLA_FFI_CUDA_PEER_TRANSPORT_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/cuda_transport.h"
#include "xla_ffi/cuda/nccl_comm.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

// Which engine moves a schedule's cross-device bytes (set_engine() in _ffi_cuda).
enum class CudaEngine : int {
  kAuto = 0,  // peer path when every participant is local and peer access works, else NCCL
  kNccl = 1,  // always NCCL (the multi-process engine), e.g. to compare
  kPeer = 2,  // always the peer path; a schedule it cannot run is an error
};
void SetCudaEngine(CudaEngine engine);
CudaEngine GetCudaEngine();

// True if every participant of `schedule` is a device of this process (in `comm`'s
// table) and every pair of their GPUs can access each other's memory (peer access is
// enabled here for those pairs). Not cached: call once per state.
bool PeerPathPossible(const Schedule& schedule, const Communicator& comm);

// One device's call, borrowed for the duration of RunPeerCall: the other participants'
// executor thread reads it while this call waits in the rendezvous.
struct PeerCall {
  const Schedule* schedule = nullptr;  // this call's encoding (may hold only its ops)
  int32_t participant = 0;
  int ordinal = 0;
  const DeviceBufferShapes* shapes = nullptr;
  const DeviceBuffers* buffers = nullptr;
  cudaStream_t stream = nullptr;
};

// Meets the calls of the other participants of the same reshard (same `site` and
// schedule fingerprint; the k-th call of each device forms round k) and returns once the
// whole round is enqueued on every participant's stream. Errors: a participant that does
// not arrive within `timeout_ms` (<= 0: 10 minutes) -> DEADLINE_EXCEEDED on the calls that
// waited; a bad buffer or a failed CUDA call -> the same error on every call of the round.
::xla::ffi::Error RunPeerCall(const PeerCall& call, int64_t site, int64_t timeout_ms);

// Counters for tests and the docs (process-wide, since load).
struct PeerStats {
  int64_t rounds = 0;         // rounds enqueued
  int64_t memcpys = 0;        // contiguous copies (peer or local), per round summed
  int64_t memcpys_3d = 0;     // 2-D / 3-D strided copy-engine copies
  int64_t kernel_tasks = 0;   // boxes moved by the copy kernel (local or over NVLink)
  int64_t converts = 0;       // of those, boxes converted (dtype=) on the way
  int64_t plans_built = 0;
};
PeerStats GetPeerStats();

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_PEER_TRANSPORT_H_
