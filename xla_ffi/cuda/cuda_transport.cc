// DevicePlan construction (once per executable and device) and execution (every call) of
// the CUDA transport (docs/cuda_transport.md). Per step, in stream order: pack kernels and
// local copies, one NCCL group of sends/receives, unpack kernels. Must not synchronize with
// the host on the execution path.

#include "xla_ffi/cuda/cuda_transport.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "xla_ffi/cuda/box_geometry.h"
#include "xla_ffi/cuda/pack.h"

namespace jax_m2n {

namespace ffi = ::xla::ffi;

namespace {

// Where the bytes of one side of an op live on this device: the base of a buffer plus a
// byte offset.
struct BufferRef {
  BufferKind kind = BufferKind::kOperand;
  int32_t slot = 0;     // operand / result index; unused for the workspace
  int64_t offset = 0;   // bytes from the buffer's (or the workspace's) base
};

// A strided or converting copy with pointers still symbolic (resolved per call).
struct CopyTemplate {
  BufferRef src, dst;       // offsets include the geometry's
  Geometry g;
  ElemType src_type = ElemType::kNone, dst_type = ElemType::kNone;
  int32_t op = 0;           // index into Schedule::ops, for errors
};

struct MemcpyTemplate {
  BufferRef src, dst;
  int64_t bytes = 0;
  int32_t op = 0;
};

struct P2pTemplate {
  bool send = true;
  int peer_rank = 0;
  int64_t peer_device = 0;
  BufferRef buffer;
  int64_t bytes = 0;
  int32_t op = 0;
};

struct StepPlan {
  int64_t step = 0;
  std::vector<CopyTemplate> pre;   // pack + strided local copies
  std::vector<MemcpyTemplate> copies;
  std::vector<P2pTemplate> p2p;
  std::vector<CopyTemplate> post;  // unpack
};

CopyTemplate MakeCopy(const Geometry& g, BufferRef src, BufferRef dst, ElemType src_type,
                      ElemType dst_type, int32_t op) {
  CopyTemplate t;
  src.offset += g.src_offset;
  dst.offset += g.dst_offset;
  t.src = src;
  t.dst = dst;
  t.g = g;
  t.src_type = src_type;
  t.dst_type = dst_type;
  t.op = op;
  return t;
}

BufferRef RefOf(const OpEnd& end) {
  BufferRef r;
  r.kind = end.kind;
  if (end.kind == BufferKind::kWorkspace) {
    r.offset = end.slot;
  } else {
    r.slot = static_cast<int32_t>(end.slot);
  }
  return r;
}

BufferRef Staging(int64_t pack) {
  BufferRef r;
  r.kind = BufferKind::kWorkspace;
  r.offset = pack;
  return r;
}

}  // namespace

char* BufferBase(const DeviceBuffers& buffers, BufferKind kind, int64_t slot) {
  switch (kind) {
    case BufferKind::kOperand:
      // Operands are read only; the transports never write through this pointer.
      return const_cast<char*>(buffers.operands[slot]);
    case BufferKind::kResult:
      return buffers.results[slot];
    case BufferKind::kWorkspace:
    default:
      return buffers.workspace;
  }
}

ffi::Span<const int64_t> BufferDims(const Schedule& schedule,
                                    const DeviceBufferShapes& shapes, const Op& op,
                                    const OpEnd& end) {
  switch (end.kind) {
    case BufferKind::kOperand:
      return shapes.operands[end.slot].dims;
    case BufferKind::kResult:
      return shapes.results[end.slot].dims;
    case BufferKind::kWorkspace:
    default: {
      const TensorSpec& t = schedule.tensors[op.tensor];
      return ffi::Span<const int64_t>(t.dims.data(), t.rank);
    }
  }
}

std::string OpLabel(const Schedule& s, int32_t index) {
  const Op& op = s.ops[index];
  return "op " + std::to_string(index) + " (step " + std::to_string(op.step) + ", " +
         StageName(op.stage) + ", tensor " + std::to_string(op.tensor) + ", device " +
         std::to_string(op.src.device) + " -> " + std::to_string(op.dst.device) + ", " +
         std::to_string(op.bytes) + " bytes)";
}

std::string CudaError(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

class DevicePlan {
 public:
  const Schedule* schedule = nullptr;
  int32_t participant = 0;
  int64_t device = 0;
  uint64_t generation = 0;
  std::vector<int64_t> operand_elems, result_elems;  // shape signature, for PlanMatches
  int64_t workspace_bytes = 0;
  std::vector<StepPlan> steps;  // only steps with work on this device
  int64_t max_tasks = 0;        // largest pre/post list (scratch size)
  DevicePlanStats stats;
};

namespace {

int64_t Elements(ffi::Span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

}  // namespace

ffi::ErrorOr<DevicePlanPtr> BuildDevicePlan(const Schedule& s,
                                                          int32_t participant,
                                                          const DeviceBufferShapes& shapes,
                                                          const Communicator& comm) {
  if (ffi::Error e = CheckDeviceBuffers(s, participant, shapes); e.failure()) {
    return ffi::Unexpected(e);
  }
  DevicePlanPtr plan(new DevicePlan());
  plan->schedule = &s;
  plan->participant = participant;
  plan->device = s.devices[participant];
  plan->generation = comm.generation();
  for (const auto& b : shapes.operands) plan->operand_elems.push_back(Elements(b.dims));
  for (const auto& b : shapes.results) plan->result_elems.push_back(Elements(b.dims));
  plan->workspace_bytes = shapes.workspace_bytes;
  const int64_t self = plan->device;

  StepPlan* cur = nullptr;
  for (int32_t index : s.ops_by_device[participant]) {
    const Op& op = s.ops[index];
    if (op.bytes == 0) continue;
    if (cur == nullptr || cur->step != op.step) {
      plan->steps.emplace_back();
      cur = &plan->steps.back();
      cur->step = op.step;
    }
    const TensorSpec& t = s.tensors[op.tensor];
    const bool is_src = op.src.device == self, is_dst = op.dst.device == self;
    if (is_src && is_dst) {  // local: a device copy (converting in one kernel), no staging
      ffi::Span<const int64_t> sd = BufferDims(s, shapes, op, op.src);
      ffi::Span<const int64_t> dd = BufferDims(s, shapes, op, op.dst);
      const ElemType st = TypeOf(t, op.src.kind), dt = TypeOf(t, op.dst.kind);
      Geometry g = Collapse(sd.begin(), op.src.start, dd.begin(), op.dst.start,
                            op.extent, t.rank, ElemBytesOf(t, op.src.kind),
                            ElemBytesOf(t, op.dst.kind));
      if (g.n_outer == 0 && st == dt) {
        MemcpyTemplate m;
        m.src = RefOf(op.src);
        m.src.offset += g.src_offset;
        m.dst = RefOf(op.dst);
        m.dst.offset += g.dst_offset;
        m.bytes = g.row_bytes;
        m.op = index;
        cur->copies.push_back(m);
        ++plan->stats.memcpys;
      } else {
        cur->pre.push_back(MakeCopy(g, RefOf(op.src), RefOf(op.dst), st, dt, index));
        ++plan->stats.kernel_tasks;
      }
      continue;
    }
    if (!is_src && !is_dst) {
      return ffi::Unexpected(JAX_M2N_ERROR(
          kInternal, OpLabel(s, index) + " does not involve device " + std::to_string(self)));
    }
    const OpEnd& mine = is_src ? op.src : op.dst;
    const OpEnd& peer = is_src ? op.dst : op.src;
    P2pTemplate p;
    p.send = is_src;
    p.peer_device = peer.device;
    p.peer_rank = comm.RankOf(peer.device);
    p.bytes = op.bytes;
    p.op = index;
    if (p.peer_rank < 0) {
      return ffi::Unexpected(JAX_M2N_ERROR(
          kFailedPrecondition,
          OpLabel(s, index) + ": peer device " + std::to_string(peer.device) +
              " is not in the NCCL communicator (initialize(device_ids=...) must list "
              "every JAX device)"));
    }
    ffi::Span<const int64_t> dims = BufferDims(s, shapes, op, mine);
    // The buffer's element type and the wire's (staging areas hold the wire type).
    const ElemType mine_type = TypeOf(t, mine.kind), wire = t.wire_type;
    const int64_t mine_bytes = ElemBytesOf(t, mine.kind);
    if (mine.pack >= 0) {
      // Gather the box into a dense staging area (send) / scatter it from one (receive),
      // narrowing before the send / widening after the receive when the types differ.
      if (is_src) {
        Geometry g = Collapse(dims.begin(), mine.start, nullptr, nullptr,
                              op.extent, t.rank, mine_bytes, t.elem_bytes);
        cur->pre.push_back(
            MakeCopy(g, RefOf(mine), Staging(mine.pack), mine_type, wire, index));
      } else {
        Geometry g = Collapse(nullptr, nullptr, dims.begin(), mine.start,
                              op.extent, t.rank, t.elem_bytes, mine_bytes);
        cur->post.push_back(
            MakeCopy(g, Staging(mine.pack), RefOf(mine), wire, mine_type, index));
      }
      ++plan->stats.kernel_tasks;
      p.buffer = Staging(mine.pack);
    } else {
      Geometry g = Collapse(dims.begin(), mine.start, nullptr, nullptr,
                            op.extent, t.rank, mine_bytes);
      if (mine_type != wire) {
        return ffi::Unexpected(JAX_M2N_ERROR(
            kInvalidArgument,
            OpLabel(s, index) + ": " + (is_src ? "src_pack" : "dst_pack") +
                " = -1 requires the buffer to hold the wire type " + ElemTypeName(wire) +
                "; it holds " + ElemTypeName(mine_type) +
                " (a converting op needs a staging area on the NCCL engine)"));
      }
      if (g.n_outer != 0) {
        std::vector<int64_t> dv(dims.begin(), dims.end());
        return ffi::Unexpected(JAX_M2N_ERROR(
            kInvalidArgument,
            OpLabel(s, index) + ": " + (is_src ? "src_pack" : "dst_pack") +
                " = -1 requires a box contiguous in the buffer of dims " + FormatList(dv) +
                "; this one is not (encode the schedule with staging=True)"));
      }
      p.buffer = RefOf(mine);
      p.buffer.offset += g.src_offset;
    }
    if (is_src) {
      ++plan->stats.sends;
      plan->stats.bytes_sent += op.bytes;
    } else {
      ++plan->stats.recvs;
      plan->stats.bytes_received += op.bytes;
    }
    cur->p2p.push_back(p);
  }
  for (const StepPlan& st : plan->steps) {
    plan->max_tasks = std::max<int64_t>(
        plan->max_tasks, static_cast<int64_t>(std::max(st.pre.size(), st.post.size())));
  }
  plan->stats.steps = static_cast<int64_t>(plan->steps.size());
  return plan;
}

bool PlanMatches(const DevicePlan& plan, const DeviceBufferShapes& shapes,
                 uint64_t generation) {
  if (plan.generation != generation || plan.workspace_bytes > shapes.workspace_bytes ||
      plan.operand_elems.size() != shapes.operands.size() ||
      plan.result_elems.size() != shapes.results.size()) {
    return false;
  }
  for (size_t i = 0; i < shapes.operands.size(); ++i) {
    if (Elements(shapes.operands[i].dims) != plan.operand_elems[i]) return false;
  }
  for (size_t i = 0; i < shapes.results.size(); ++i) {
    if (Elements(shapes.results[i].dims) != plan.result_elems[i]) return false;
  }
  return true;
}

DevicePlanStats StatsOf(const DevicePlan& plan) { return plan.stats; }

void DevicePlanDeleter::operator()(DevicePlan* plan) const { delete plan; }

namespace {

char* Base(const BufferRef& r, const DeviceBuffers& b) {
  return BufferBase(b, r.kind, r.slot);
}

ffi::Error LaunchCopies(const std::vector<CopyTemplate>& templates, const DeviceBuffers& b,
                        std::vector<CopyTask>* scratch, cudaStream_t stream,
                        const DevicePlan& plan, int64_t step, const char* what) {
  if (templates.empty()) return ffi::Error::Success();
  scratch->clear();
  for (const CopyTemplate& t : templates) {
    scratch->push_back(BoxCopyTask(t.g, Base(t.src, b) + t.src.offset,
                                   Base(t.dst, b) + t.dst.offset, t.src_type,
                                   t.dst_type));
  }
  cudaError_t err = LaunchCopyTasks(scratch->data(), static_cast<int>(scratch->size()), stream);
  if (err != cudaSuccess) {
    return JAX_M2N_ERROR(kInternal,
                         std::string(what) + " kernel (" + std::to_string(templates.size()) +
                             " boxes, step " + std::to_string(step) + ", device " +
                             std::to_string(plan.device) + ", first " +
                             OpLabel(*plan.schedule, templates.front().op) +
                             ") failed to launch: " + CudaError(err));
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RunDevicePlan(const DevicePlan& plan, const DeviceBuffers& b, LocalRank* rank,
                         cudaStream_t stream, int64_t timeout_ms) {
  if (plan.steps.empty()) return ffi::Error::Success();
  Communicator& comm = Communicator::Get();
  const NcclApi& nccl = comm.api();
  thread_local std::vector<CopyTask> scratch;
  scratch.reserve(static_cast<size_t>(plan.max_tasks));
  const Schedule& s = *plan.schedule;
  using Clock = std::chrono::steady_clock;
  // Host-side bound for NCCL calls that report ncclInProgress (nonblocking communicators).
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(timeout_ms > 0 ? timeout_ms : 600000);

  std::lock_guard<std::mutex> lock(rank->mu);
  if (rank->comm == nullptr) {
    std::string why = comm.StickyError();
    return JAX_M2N_ERROR(kFailedPrecondition,
                         "the NCCL communicator of device " + std::to_string(plan.device) +
                             " was aborted" + (why.empty() ? std::string() : ": " + why));
  }
  cudaEvent_t start = nullptr, end = nullptr;
  if (timeout_ms > 0) {
    cudaError_t err = comm.TakeEvent(rank, &start);
    if (err == cudaSuccess) err = comm.TakeEvent(rank, &end);
    if (err == cudaSuccess) err = cudaEventRecord(start, stream);
    if (err != cudaSuccess) {
      return JAX_M2N_ERROR(kInternal, "cudaEventRecord (watchdog) on device " +
                                          std::to_string(plan.device) + ": " + CudaError(err));
    }
  }
  for (const StepPlan& st : plan.steps) {
    if (ffi::Error e = LaunchCopies(st.pre, b, &scratch, stream, plan, st.step, "pack");
        e.failure()) {
      return e;
    }
    for (const MemcpyTemplate& m : st.copies) {
      cudaError_t err = cudaMemcpyAsync(Base(m.dst, b) + m.dst.offset,
                                        Base(m.src, b) + m.src.offset, m.bytes,
                                        cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) {
        return JAX_M2N_ERROR(kInternal, "cudaMemcpyAsync(bytes=" + std::to_string(m.bytes) +
                                            ") for " + OpLabel(s, m.op) + ": " +
                                            CudaError(err));
      }
    }
    if (!st.p2p.empty()) {
      ncclResult_t r = nccl.GroupStart();
      if (r != ncclSuccess) {
        return JAX_M2N_ERROR(kInternal, "ncclGroupStart: " + nccl.Describe(r, rank->comm));
      }
      const P2pTemplate* failed = nullptr;
      for (const P2pTemplate& p : st.p2p) {
        if (p.send) {
          r = nccl.Send(Base(p.buffer, b) + p.buffer.offset, static_cast<size_t>(p.bytes),
                        ncclUint8, p.peer_rank, rank->comm, stream);
        } else {
          r = nccl.Recv(Base(p.buffer, b) + p.buffer.offset,
                        static_cast<size_t>(p.bytes), ncclUint8, p.peer_rank, rank->comm,
                        stream);
        }
        if (r != ncclSuccess && r != ncclInProgress) {
          failed = &p;
          break;
        }
      }
      ncclResult_t end_r = nccl.GroupEnd();
      if (failed == nullptr && end_r == ncclInProgress) {
        bool late = false;
        end_r = comm.WaitReady(rank->comm, deadline, &late);
        if (late) {
          return JAX_M2N_ERROR(kDeadlineExceeded,
                               "ncclGroupEnd (step " + std::to_string(st.step) + ", device " +
                                   std::to_string(plan.device) + ", " +
                                   std::to_string(st.p2p.size()) +
                                   " sends/receives) still in progress after timeout_ms=" +
                                   std::to_string(timeout_ms) +
                                   " (NCCL connecting to a peer that does not answer?)");
        }
      }
      if (failed != nullptr || end_r != ncclSuccess) {
        const P2pTemplate& p = failed ? *failed : st.p2p.front();
        return JAX_M2N_ERROR(
            kInternal, std::string(failed ? (p.send ? "ncclSend" : "ncclRecv") : "ncclGroupEnd") +
                           "(peer=device " + std::to_string(p.peer_device) + " rank " +
                           std::to_string(p.peer_rank) + ", bytes=" + std::to_string(p.bytes) +
                           (failed ? "" : ", first of " + std::to_string(st.p2p.size())) +
                           ") on device " + std::to_string(plan.device) + " for " +
                           OpLabel(s, p.op) + " failed: " +
                           nccl.Describe(failed ? r : end_r, rank->comm));
      }
    }
    if (ffi::Error e = LaunchCopies(st.post, b, &scratch, stream, plan, st.step, "unpack");
        e.failure()) {
      return e;
    }
  }
  if (timeout_ms > 0) {
    cudaError_t err = cudaEventRecord(end, stream);
    if (err != cudaSuccess) {
      return JAX_M2N_ERROR(kInternal, "cudaEventRecord (watchdog) on device " +
                                          std::to_string(plan.device) + ": " + CudaError(err));
    }
    comm.Watch(rank, start, end, timeout_ms,
               "reshard on device " + std::to_string(plan.device) + " (rank " +
                   std::to_string(rank->rank) + ", " + std::to_string(plan.steps.size()) +
                   " steps)");
  }
  return ffi::Error::Success();
}

}  // namespace jax_m2n
