// The CUDA handlers of jax_m2n_local_copy and jax_m2n_local_store: the decoded schedule
// turned into copy-kernel tasks (box_geometry.h, pack.h) whose source (copy) or
// destination (store) is a slot of the device-side pointer table, launched on XLA's
// stream. No host synchronization, no allocation after the first call on a thread.

#include "xla_ffi/cuda/local_copy_cuda.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda/box_geometry.h"
#include "xla_ffi/cuda/pack.h"
#include "xla_ffi/local_copy.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {
namespace {

namespace ffi = ::xla::ffi;

constexpr char kCopyCall[] = "jax_m2n_local_copy (CUDA)";
constexpr char kStoreCall[] = "jax_m2n_local_store (CUDA)";

// The state of one executable: the schedule and each box's geometry (per output, in
// the schedule's order), computed once.
struct LocalCopyCudaState {
  static ffi::TypeId id;
  LocalCopySchedule schedule;
  std::vector<std::vector<Geometry>> geometry;
};
ffi::TypeId LocalCopyCudaState::id = {};
constexpr char kLocalCopyCudaStateName[] = "jax_m2n.cuda.LocalCopyState";

ffi::ErrorOr<std::unique_ptr<LocalCopyCudaState>> Instantiate(
    ffi::Span<const int64_t> schedule) {
  ffi::ErrorOr<LocalCopySchedule> decoded = DecodeLocalCopySchedule(schedule);
  if (decoded.has_error()) {
    return ffi::Unexpected(
        AddContext(decoded.error(), std::string(kCopyCall) + ", instantiate"));
  }
  auto state = std::make_unique<LocalCopyCudaState>();
  state->schedule = std::move(decoded.value());
  for (const LocalOutput& out : state->schedule.outputs) {
    std::vector<Geometry>& g = state->geometry.emplace_back();
    for (const LocalBox& box : out.boxes) {
      g.push_back(Collapse(box.src_dims.data(), box.src_start.data(), out.dims.data(),
                           box.dst_start.data(), box.extent.data(), out.rank,
                           box.src_elem_bytes, out.elem_bytes));
    }
  }
  return state;
}

// XLA makes the device's context current; be robust to a thread that changed it.
ffi::Error UseDevice(int32_t ordinal, const char* call) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == ordinal) {
    return ffi::Error::Success();
  }
  cudaError_t err = cudaSetDevice(ordinal);
  if (err != cudaSuccess) {
    return JAX_M2N_ERROR(kInternal, std::string(call) + ": cudaSetDevice(" +
                                        std::to_string(ordinal) +
                                        ") failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error Launch(const std::vector<CopyTask>& tasks, cudaStream_t stream,
                  const int64_t* table, const char* call) {
  cudaError_t err =
      LaunchCopyTasks(tasks.data(), static_cast<int>(tasks.size()), stream, table);
  if (err != cudaSuccess) {
    return JAX_M2N_ERROR(kInternal, std::string(call) + ": launching " +
                                        std::to_string(tasks.size()) +
                                        " copy tasks failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t ordinal, LocalCopyCudaState* state,
                   ffi::AnyBuffer table, ffi::RemainingRets rets) {
  const LocalCopySchedule& s = state->schedule;
  if (ffi::Error e = CheckPointerTable(table, s.n_slots, kCopyCall); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckLocalCopyResults(s, rets); e.failure()) {
    return AddContext(e, kCopyCall);
  }
  if (ffi::Error e = UseDevice(ordinal, kCopyCall); e.failure()) return e;
  thread_local std::vector<CopyTask> tasks;
  tasks.clear();
  for (size_t o = 0; o < s.outputs.size(); ++o) {
    const LocalOutput& out = s.outputs[o];
    char* dst = static_cast<char*>((*rets.get<ffi::AnyBuffer>(o))->untyped_data());
    for (size_t b = 0; b < out.boxes.size(); ++b) {
      const Geometry& g = state->geometry[o][b];
      if (g.rows() == 0 || g.row_elems == 0) continue;
      // The source is an offset from its table entry (a multiple of 32 bytes): the
      // unit is chosen from the offset's alignment.
      CopyTask t = BoxCopyTask(g, reinterpret_cast<const char*>(g.src_offset),
                               dst + g.dst_offset, out.boxes[b].src_type, out.type);
      t.src_slot = static_cast<int32_t>(out.boxes[b].slot);
      tasks.push_back(t);
    }
  }
  if (tasks.empty()) return ffi::Error::Success();
  return Launch(tasks, stream, static_cast<const int64_t*>(table.untyped_data()),
                kCopyCall);
}

ffi::Error Store(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer table,
                 ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> done) {
  const int64_t n = static_cast<int64_t>(args.size());
  if (ffi::Error e = CheckPointerTable(table, n, kStoreCall); e.failure()) return e;
  if (ffi::Error e = UseDevice(ordinal, kStoreCall); e.failure()) return e;
  thread_local std::vector<CopyTask> tasks;
  tasks.clear();
  for (int64_t i = 0; i < n; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> arg = args.get<ffi::AnyBuffer>(i);
    if (arg.has_error()) return arg.error();
    const int64_t bytes = static_cast<int64_t>(arg->size_bytes());
    if (bytes == 0) continue;
    Geometry g;  // the whole array: one contiguous run of bytes
    g.row_bytes = g.row_elems = bytes;
    g.src_elem_bytes = g.dst_elem_bytes = 1;
    CopyTask t = BoxCopyTask(g, static_cast<const char*>(arg->untyped_data()),
                             /*dst=offset from the table entry*/ nullptr);
    t.dst_slot = static_cast<int32_t>(i);
    tasks.push_back(t);
  }
  if (!tasks.empty()) {
    if (ffi::Error e = Launch(tasks, stream,
                              static_cast<const int64_t*>(table.untyped_data()),
                              kStoreCall);
        e.failure()) {
      return e;
    }
  }
  if (done->size_bytes() > 0) {
    cudaError_t err = cudaMemsetAsync(done->untyped_data(), 1, 1, stream);
    if (err != cudaSuccess) {
      return JAX_M2N_ERROR(kInternal, std::string(kStoreCall) +
                                          ": cudaMemsetAsync failed: " +
                                          cudaGetErrorString(err));
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kInstantiate, Instantiate,
                       ffi::Ffi::BindInstantiate().Attr<ffi::Span<const int64_t>>(
                           "schedule"));

// The execute stage binds no attributes: the state holds the decoded schedule.
XLA_FFI_DEFINE_HANDLER(kExecute, Execute,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                           .Ctx<ffi::DeviceOrdinal>()          // process-local CUDA id
                           .Ctx<ffi::State<LocalCopyCudaState>>()  // decoded schedule
                           .Arg<ffi::AnyBuffer>()                  // pointer table
                           .RemainingRets());                      // outputs

XLA_FFI_DEFINE_HANDLER(kStore, Store,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                           .Ctx<ffi::DeviceOrdinal>()          // process-local CUDA id
                           .Arg<ffi::AnyBuffer>()              // destination addresses
                           .RemainingArgs()                    // arrays
                           .Ret<ffi::AnyBuffer>());            // done: uint8 scalar

}  // namespace
}  // namespace jax_m2n

extern "C" XLA_FFI_Error* JaxM2nLocalCopyCudaInstantiate(XLA_FFI_CallFrame* call_frame) {
  if (XLA_FFI_Error* error = jax_m2n::RegisterStateTypeOnce<jax_m2n::LocalCopyCudaState>(
          call_frame->api, jax_m2n::kLocalCopyCudaStateName)) {
    return error;
  }
  return jax_m2n::kInstantiate(call_frame);
}

extern "C" XLA_FFI_Error* JaxM2nLocalCopyCudaExecute(XLA_FFI_CallFrame* call_frame) {
  return jax_m2n::kExecute(call_frame);
}

extern "C" XLA_FFI_Error* JaxM2nLocalStoreCuda(XLA_FFI_CallFrame* call_frame) {
  return jax_m2n::kStore(call_frame);
}
