// The XLA FFI handler of the custom call `jax_m2n_reshard` on platform `cpu`:
// two stages, `instantiate` (decode the schedule once per executable into an
// ffi::State) and `execute` (find this device, check its buffers, run the
// in-process transport). The nanobind module (module_cpu.cc) exposes them.
//
// Binding (docs/schedule_format.md, "The custom call"):
//   instantiate: attrs schedule (int64[]), site (int64), timeout_ms (int64),
//                optional network (int64[], the emulated inter-domain
//                network: nic_emulator.h), optional tickets (int64 > 0:
//                the last operand is the eager call's int32 ticket)
//   execute:     ctx DeviceOrdinal (the global device id on CPU), ctx State;
//                operands: variadic source shards; results: variadic
//                destination shards, then the workspace uint8[W] last.

#ifndef JAX_M2N_XLA_FFI_RESHARD_CPU_H_
#define JAX_M2N_XLA_FFI_RESHARD_CPU_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/nic_emulator.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

// What the instantiate stage decodes from the attributes; owned by XLA (one per
// executable), shared read-only by every device that runs the executable.
struct ReshardCpuState {
  static ::xla::ffi::TypeId id;  // assigned when the type is registered
  Schedule schedule;
  int64_t site = 0;
  int64_t timeout_ms = 0;
  // The eager path's ticket count (optional attribute `tickets`, > 0): the
  // last operand is then an int32 scalar, the call's generation modulo
  // `tickets` (cpu_transport.h, CpuCall::ticket). 0: no ticket (inside jit).
  int64_t tickets = 0;
  bool has_network = false;  // the `network` attribute was given
  EmulatedNetwork network;
  // Per participant: its buffers passed CheckDeviceBuffers once. An executable's
  // buffer shapes are fixed, so later executions skip the check (256 devices x 856
  // leaves: ~16,000 box checks per device per call).
  std::unique_ptr<std::atomic<bool>[]> checked;
};

// The name under which ReshardCpuState is registered with XLA FFI.
inline constexpr char kReshardCpuStateTypeName[] = "jax_m2n.cpu.ReshardState";

// Type info (the deleter) XLA needs to destroy a ReshardCpuState.
const XLA_FFI_TypeInfo* ReshardCpuStateTypeInfo();

// Largest accepted `timeout_ms` (about 35 years; keeps deadlines finite).
inline constexpr int64_t kMaxTimeoutMs = int64_t{1} << 40;

}  // namespace jax_m2n

// The two stages, as C symbols for jax.ffi.register_ffi_target (api_version=1)
// in the form {"instantiate": capsule, "execute": capsule}. The instantiate
// stage registers ReshardCpuState with the calling XLA if nobody has (the
// registration is idempotent), so registering the type from Python is optional.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nReshardCpuInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nReshardCpuExecute);

#endif  // JAX_M2N_XLA_FFI_RESHARD_CPU_H_
