// The CPU FFI handler of `jax_m2n_reshard`: instantiate decodes the schedule
// into ffi::State; execute maps XLA's buffers to the schedule's slots, checks
// them, and hands over to the in-process transport. No copying here, no
// waiting here: cpu_transport.cc owns both.

#include "xla_ffi/reshard_cpu.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_transport.h"
#include "xla_ffi/nic_emulator.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

namespace ffi = ::xla::ffi;

ffi::TypeId ReshardCpuState::id = {};

const XLA_FFI_TypeInfo* ReshardCpuStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = {
      XLA_FFI_TypeInfo_STRUCT_SIZE,
      /*extension_start=*/nullptr,
      /*deleter=*/
      [](void* state) { delete static_cast<ReshardCpuState*>(state); },
  };
  return &info;
}

namespace {

// The context of errors that happen outside the rendezvous.
std::string CallName(int64_t site) {
  return "jax_m2n_reshard (cpu), site " + std::to_string(site);
}
std::string CallName(int64_t site, int64_t device) {
  return "jax_m2n_reshard (cpu) on device " + std::to_string(device) +
         ", site " + std::to_string(site);
}

// Reads a required int64 (array) attribute out of the instantiate stage's
// attributes (bound as a dictionary so that `network` may be absent).
template <typename T>
ffi::Error GetAttr(const ffi::Dictionary& attrs, const char* name, T* value) {
  if (!attrs.contains(name)) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         std::string("attribute ") + name + " is missing");
  }
  ffi::ErrorOr<T> got = attrs.get<T>(name);
  if (got.has_error()) {
    return JAX_M2N_ERROR(kInvalidArgument, std::string("attribute ") + name +
                                               " has the wrong type: " +
                                               got.error().message());
  }
  *value = got.value();
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<ReshardCpuState>> Instantiate(
    ffi::Dictionary attrs) {
  using Result = ffi::ErrorOr<std::unique_ptr<ReshardCpuState>>;
  auto fail = [](const ffi::Error& error, const std::string& context) {
    return Result(ffi::Unexpected<ffi::Error>(AddContext(error, context)));
  };
  int64_t site = 0;
  if (ffi::Error e = GetAttr(attrs, "site", &site); e.failure()) {
    return fail(e, CallName(site) + ", instantiate");
  }
  const std::string context = CallName(site) + ", instantiate";
  ffi::Span<const int64_t> schedule;
  int64_t timeout_ms = 0;
  if (ffi::Error e = GetAttr(attrs, "schedule", &schedule); e.failure()) {
    return fail(e, context);
  }
  if (ffi::Error e = GetAttr(attrs, "timeout_ms", &timeout_ms); e.failure()) {
    return fail(e, context);
  }
  if (timeout_ms < 1 || timeout_ms > kMaxTimeoutMs) {
    return fail(JAX_M2N_ERROR(kInvalidArgument,
                              "attribute timeout_ms must be in [1, 2^40] ms; got " +
                                  std::to_string(timeout_ms)),
                context);
  }
  ffi::ErrorOr<Schedule> decoded = DecodeSchedule(schedule);
  if (decoded.has_error()) return fail(decoded.error(), context);
  auto state = std::make_unique<ReshardCpuState>();
  state->schedule = std::move(decoded.value());
  state->checked = std::make_unique<std::atomic<bool>[]>(state->schedule.devices.size());
  state->site = site;
  state->timeout_ms = timeout_ms;
  if (attrs.contains("network")) {
    ffi::Span<const int64_t> network;
    if (ffi::Error e = GetAttr(attrs, "network", &network); e.failure()) {
      return fail(e, context);
    }
    ffi::ErrorOr<EmulatedNetwork> emulated = DecodeEmulatedNetwork(
        network, static_cast<int64_t>(state->schedule.devices.size()));
    if (emulated.has_error()) return fail(emulated.error(), context);
    state->network = std::move(emulated.value());
    state->has_network = true;
  }
  if (attrs.contains("tickets")) {
    if (ffi::Error e = GetAttr(attrs, "tickets", &state->tickets);
        e.failure()) {
      return fail(e, context);
    }
    if (state->tickets < 1 || state->tickets > (int64_t{1} << 30)) {
      return fail(JAX_M2N_ERROR(kInvalidArgument,
                                "attribute tickets must be in [1, 2^30]; got " +
                                    std::to_string(state->tickets)),
                  context);
    }
  }
  for (std::string_view name : attrs) {
    if (name != "schedule" && name != "site" && name != "timeout_ms" &&
        name != "network" && name != "tickets") {
      return fail(JAX_M2N_ERROR(kInvalidArgument,
                                "attributes must be schedule, site, timeout_ms "
                                "and optionally network, tickets; got " +
                                    std::string(name)),
                  context);
    }
  }
  return Result(std::move(state));
}

// Maps XLA's buffers to the schedule's slots and checks them (once per
// participant of the executable: their shapes never change); on success fills
// `buffers`.
ffi::Error CollectBuffers(const ReshardCpuState& state, int32_t participant,
                          const ffi::RemainingArgs& args, size_t n_operands,
                          const ffi::RemainingRets& rets,
                          CpuDeviceBuffers* buffers) {
  DeviceBufferShapes shapes;
  buffers->operands.reserve(n_operands);
  shapes.operands.reserve(n_operands);
  for (size_t i = 0; i < n_operands; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> arg = args.get<ffi::AnyBuffer>(i);
    if (arg.has_error()) {
      return JAX_M2N_ERROR(kInvalidArgument,
                           "operand " + std::to_string(i) +
                               " must be an array: " + arg.error().message());
    }
    CpuBuffer view{static_cast<char*>(arg->untyped_data()), arg->dimensions(),
                   static_cast<int64_t>(ffi::ByteWidth(arg->element_type()))};
    buffers->operands.push_back(view);
    shapes.operands.push_back(BufferShape{view.dims, view.elem_bytes});
  }
  if (rets.size() < 1) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         "the call must have at least one result (the uint8 "
                         "workspace, last); got none");
  }
  const size_t n_results = rets.size() - 1;
  buffers->results.reserve(n_results);
  shapes.results.reserve(n_results);
  for (size_t i = 0; i <= n_results; ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) {
      return JAX_M2N_ERROR(kInvalidArgument,
                           "result " + std::to_string(i) +
                               " must be an array: " + ret.error().message());
    }
    ffi::AnyBuffer buffer = **ret;
    if (i == n_results) {
      if (buffer.element_type() != ffi::DataType::U8 ||
          buffer.dimensions().size() != 1) {
        return JAX_M2N_ERROR(
            kInvalidArgument,
            "the last result must be the workspace, a 1-D uint8 array; got "
            "dtype code " +
                std::to_string(static_cast<int>(buffer.element_type())) +
                " with rank " + std::to_string(buffer.dimensions().size()));
      }
      buffers->workspace = static_cast<char*>(buffer.untyped_data());
      buffers->workspace_bytes = static_cast<int64_t>(buffer.size_bytes());
      shapes.workspace_bytes = buffers->workspace_bytes;
      break;
    }
    CpuBuffer view{static_cast<char*>(buffer.untyped_data()),
                   buffer.dimensions(),
                   static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()))};
    buffers->results.push_back(view);
    shapes.results.push_back(BufferShape{view.dims, view.elem_bytes});
  }
  std::atomic<bool>& checked = state.checked[participant];
  if (checked.load(std::memory_order_acquire)) return ffi::Error::Success();
  ffi::Error error = CheckDeviceBuffers(state.schedule, participant, shapes);
  if (error.success()) checked.store(true, std::memory_order_release);
  return error;
}

// The eager call's ticket: the last operand, an int32 scalar in
// [0, state.tickets).
ffi::Error ReadTicket(const ReshardCpuState& state,
                      const ffi::RemainingArgs& args, int64_t* ticket) {
  if (args.size() < 1) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         "the call must end with its int32 ticket operand "
                         "(attribute tickets is set); got no operands");
  }
  ffi::ErrorOr<ffi::AnyBuffer> arg = args.get<ffi::AnyBuffer>(args.size() - 1);
  if (arg.has_error() || arg->element_type() != ffi::DataType::S32 ||
      arg->element_count() != 1) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         "the last operand must be the int32 scalar ticket "
                         "(attribute tickets is set)");
  }
  *ticket = *static_cast<const int32_t*>(arg->untyped_data());
  if (*ticket < 0 || *ticket >= state.tickets) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         "the ticket must be in [0, " +
                             std::to_string(state.tickets) + "); got " +
                             std::to_string(*ticket));
  }
  return ffi::Error::Success();
}

ffi::Error Execute(int32_t device_ordinal, ReshardCpuState* state,
                   ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const Schedule& schedule = state->schedule;
  const int32_t participant = schedule.ParticipantIndex(device_ordinal);
  if (participant < 0) {
    return AddContext(
        JAX_M2N_ERROR(kInvalidArgument,
                      "device " + std::to_string(device_ordinal) +
                          " runs the call but is not one of the schedule's "
                          "devices " +
                          FormatList(schedule.devices)),
        CallName(state->site, device_ordinal));
  }
  int64_t ticket = 0;
  size_t n_operands = args.size();
  if (state->tickets > 0) {
    ffi::Error error = ReadTicket(*state, args, &ticket);
    if (error.failure()) {
      return AddContext(error, CallName(state->site, device_ordinal));
    }
    --n_operands;
  }
  CpuDeviceBuffers buffers;
  if (ffi::Error error =
          CollectBuffers(*state, participant, args, n_operands, rets, &buffers);
      error.failure()) {
    // Take this device's generation down with it, so that peers fail now
    // rather than after timeout_ms, and later generations still line up.
    AbortNextCpuGeneration(state->site, device_ordinal,
                           static_cast<int64_t>(schedule.devices.size()),
                           error, state->tickets, ticket);
    return AddContext(error, CallName(state->site, device_ordinal));
  }
  CpuCall call{&schedule, state->site, state->timeout_ms, participant,
               state->has_network ? &state->network : nullptr};
  call.tickets = state->tickets;
  call.ticket = ticket;
  return RunCpuTransport(call, buffers);
}

XLA_FFI_DEFINE_HANDLER(kInstantiate, Instantiate,
                       ffi::Ffi::BindInstantiate()
                           // schedule (int64[]), site (int64), timeout_ms
                           // (int64), optional network (int64[])
                           .Attrs<ffi::Dictionary>());

// The execute stage binds no attributes: everything it needs is in the state
// (XLA checks attribute counts only for handlers that bind attributes).
XLA_FFI_DEFINE_HANDLER(kExecute, Execute,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::DeviceOrdinal>()  // global id on CPU
                           .Ctx<ffi::State<ReshardCpuState>>()
                           .RemainingArgs()    // source shards
                           .RemainingRets());  // destination shards, workspace

// Registers ReshardCpuState with the XLA that calls us, once. Idempotent on the
// XLA side too: a registration of the same name with the same id succeeds, so
// Python may also register it (module_cpu.cc: type_registrations()).
XLA_FFI_Error* EnsureStateTypeRegistered(const XLA_FFI_Api* api) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (ReshardCpuState::id.type_id != 0) return nullptr;
  return ffi::Ffi::RegisterTypeId(api, kReshardCpuStateTypeName,
                                  &ReshardCpuState::id,
                                  ReshardCpuStateTypeInfo());
}

}  // namespace
}  // namespace jax_m2n

extern "C" XLA_FFI_Error* JaxM2nReshardCpuInstantiate(
    XLA_FFI_CallFrame* call_frame) {
  if (XLA_FFI_Error* error =
          jax_m2n::EnsureStateTypeRegistered(call_frame->api)) {
    return error;
  }
  return jax_m2n::kInstantiate(call_frame);
}

extern "C" XLA_FFI_Error* JaxM2nReshardCpuExecute(
    XLA_FFI_CallFrame* call_frame) {
  return jax_m2n::kExecute(call_frame);
}
