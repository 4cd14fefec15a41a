// The CUDA handler of `jax_m2n_reshard`: binds the XLA FFI call frame (stream, device
// ordinal, state, buffers, attributes), maps the process-local ordinal to the global device
// id through the communicator's table, and hands the device's part of the schedule to the
// CUDA transport. No host synchronization here; no data movement of its own.

#include "xla_ffi/cuda/reshard_cuda.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/cuda_transport.h"
#include "xla_ffi/cuda/nccl_comm.h"
#include "xla_ffi/cuda/peer_transport.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

namespace ffi = ::xla::ffi;

struct CudaReshardState {
  static ffi::TypeId id;

  explicit CudaReshardState(Schedule s) : schedule(std::move(s)) {
    slots.resize(schedule.devices.size());
    for (auto& slot : slots) slot = std::make_unique<Slot>();
  }

  // One per participant: the plan for that device, built on its first execute. The
  // mutex also serializes executions on one device (XLA runs one at a time anyway).
  struct Slot {
    std::mutex mu;
    DevicePlanPtr plan;
  };

  Schedule schedule;
  std::vector<std::unique_ptr<Slot>> slots;
  // Whether the peer path can run this schedule (every participant local, peer access
  // between them): -1 not yet known, else 0/1 for communicator generation `peer_gen`.
  std::mutex peer_mu;
  int peer_ok = -1;
  uint64_t peer_gen = 0;

  bool PeerOk(const Communicator& comm) {
    std::lock_guard<std::mutex> lock(peer_mu);
    if (peer_ok < 0 || peer_gen != comm.generation()) {
      peer_ok = PeerPathPossible(schedule, comm) ? 1 : 0;
      peer_gen = comm.generation();
    }
    return peer_ok == 1;
  }
};

ffi::TypeId CudaReshardState::id = {};

XLA_FFI_TypeId* CudaReshardStateTypeId() { return &CudaReshardState::id; }

const XLA_FFI_TypeInfo* CudaReshardStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<CudaReshardState>();
  return &info;
}

namespace {

ffi::ErrorOr<std::unique_ptr<CudaReshardState>> Instantiate(
    ffi::Span<const int64_t> schedule, int64_t site, int64_t timeout_ms) {
  (void)site;        // used at execute: the peer path's rendezvous key
  (void)timeout_ms;  // used at execute
  ffi::ErrorOr<Schedule> decoded = DecodeSchedule(schedule);
  if (decoded.has_error()) return ffi::Unexpected(decoded.error());
  return std::make_unique<CudaReshardState>(std::move(decoded.value()));
}

ffi::Error Execute(cudaStream_t stream, int32_t ordinal, CudaReshardState* state,
                   ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Span<const int64_t> schedule, int64_t site, int64_t timeout_ms) {
  (void)schedule;  // decoded at instantiate
  Communicator& comm = Communicator::Get();
  if (!comm.initialized()) {
    return JAX_M2N_ERROR(
        kFailedPrecondition,
        "jax_m2n_reshard (CUDA): the NCCL communicator must exist before a reshard runs; "
        "jax_m2n/_src/ffi.py creates it with _ffi_cuda.initialize() before the first CUDA "
        "reshard (docs/dev_contracts.md, \"_ffi_cuda\")");
  }
  LocalRank* rank = comm.ForOrdinal(ordinal);
  if (rank == nullptr) {
    return JAX_M2N_ERROR(kFailedPrecondition,
                         "jax_m2n_reshard (CUDA): DeviceOrdinal " + std::to_string(ordinal) +
                             " is not in the device table given to initialize(): " +
                             comm.DescribeLocalTable());
  }
  if (std::string sticky = comm.StickyError(); !sticky.empty()) {
    return JAX_M2N_ERROR(kAborted, "jax_m2n_reshard (CUDA) on device " +
                                       std::to_string(rank->device_id) +
                                       ": an earlier reshard failed: " + sticky +
                                       " (its communicator was aborted; to recover, "
                                       "restart the processes, or call finalize() then "
                                       "initialize() of jax_m2n._ffi_cuda on every "
                                       "process)");
  }
  const Schedule& s = state->schedule;
  const int32_t participant = s.ParticipantIndex(rank->device_id);
  if (participant < 0) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         "jax_m2n_reshard (CUDA): device " + std::to_string(rank->device_id) +
                             " (DeviceOrdinal " + std::to_string(ordinal) +
                             ") must be a participant of the schedule; participants are " +
                             FormatList(s.devices));
  }
  if (rets.size() < 1) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         "jax_m2n_reshard (CUDA): the last result must be the workspace; got "
                         "no results");
  }

  // Buffers of this call (scratch reused per thread: no allocation after the first call).
  thread_local DeviceBufferShapes shapes;
  thread_local DeviceBuffers buffers;
  shapes.operands.clear();
  shapes.results.clear();
  buffers.operands.clear();
  buffers.results.clear();
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> buf = args.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    shapes.operands.push_back(
        {buf->dimensions(), static_cast<int64_t>(ffi::ByteWidth(buf->element_type()))});
    buffers.operands.push_back(static_cast<const char*>(buf->untyped_data()));
  }
  const size_t n_results = rets.size() - 1;
  for (size_t i = 0; i <= n_results; ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> buf = rets.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    ffi::Result<ffi::AnyBuffer>& r = buf.value();
    if (i == n_results) {
      shapes.workspace_bytes = static_cast<int64_t>(r->size_bytes());
      buffers.workspace = static_cast<char*>(r->untyped_data());
    } else {
      shapes.results.push_back(
          {r->dimensions(), static_cast<int64_t>(ffi::ByteWidth(r->element_type()))});
      buffers.results.push_back(static_cast<char*>(r->untyped_data()));
    }
  }

  // XLA makes the device's context current; be robust to a thread that changed it.
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != ordinal) {
    cudaError_t err = cudaSetDevice(ordinal);
    if (err != cudaSuccess) {
      return JAX_M2N_ERROR(kInternal, "cudaSetDevice(" + std::to_string(ordinal) +
                                          ") failed: " + cudaGetErrorString(err));
    }
  }

  // The engine: the direct peer path when every participant is a GPU of this process
  // (docs/cuda_transport.md, "Which engine"), else NCCL. Every participant decides
  // alike: the answer depends only on the schedule's devices and the process.
  const CudaEngine engine = GetCudaEngine();
  if (engine != CudaEngine::kNccl) {
    const bool peer_ok = state->PeerOk(comm);
    if (!peer_ok && engine == CudaEngine::kPeer) {
      return JAX_M2N_ERROR(kFailedPrecondition,
                           "jax_m2n_reshard (CUDA): set_engine(\"peer\") requires every "
                           "participant " + FormatList(s.devices) +
                               " to be a GPU of this process with peer access to the others");
    }
    if (peer_ok) {
      PeerCall call;
      call.schedule = &s;
      call.participant = participant;
      call.ordinal = ordinal;
      call.shapes = &shapes;
      call.buffers = &buffers;
      call.stream = stream;
      return RunPeerCall(call, site, timeout_ms);
    }
  }

  CudaReshardState::Slot& slot = *state->slots[participant];
  std::lock_guard<std::mutex> lock(slot.mu);
  if (slot.plan == nullptr || !PlanMatches(*slot.plan, shapes, comm.generation())) {
    ffi::ErrorOr<DevicePlanPtr> plan =
        BuildDevicePlan(s, participant, shapes, comm);
    if (plan.has_error()) return plan.error();
    slot.plan = std::move(plan.value());
  }
  return RunDevicePlan(*slot.plan, buffers, rank, stream, timeout_ms);
}

}  // namespace
}  // namespace jax_m2n

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxM2nReshardCudaInstantiate, jax_m2n::Instantiate,
                              xla::ffi::Ffi::BindInstantiate()
                                  .Attr<xla::ffi::Span<const int64_t>>("schedule")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("timeout_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxM2nReshardCudaExecute, jax_m2n::Execute,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()    // stream: XLA's compute stream
        .Ctx<xla::ffi::DeviceOrdinal>()                   // ordinal: process-local CUDA id
        .Ctx<xla::ffi::State<jax_m2n::CudaReshardState>>()  // state: decoded schedule
        .RemainingArgs()                                   // source shards
        .RemainingRets()                                   // destination shards, workspace
        .Attr<xla::ffi::Span<const int64_t>>("schedule")
        .Attr<int64_t>("site")
        .Attr<int64_t>("timeout_ms"));
