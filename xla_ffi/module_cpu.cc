// The nanobind module `jax_m2n._ffi`: hands the CPU handlers of
// `jax_m2n_reshard` and `jax_m2n_local_copy` to Python
// (registrations()) plus small helpers for the Python side (schedule version,
// decoder check, abandoning a generation). Only bindings here: the handlers
// are reshard_cpu.cc and local_copy.cc.

#include <cstdint>
#include <string>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_transport.h"
#include "xla_ffi/local_copy.h"
#include "xla_ffi/reshard_cpu.h"
#include "xla_ffi/schedule.h"

namespace nb = nanobind;

namespace jax_m2n {
namespace {

template <typename T>
nb::capsule Capsule(T* pointer) {
  return nb::capsule(reinterpret_cast<void*>(pointer));
}

using Int64Array =
    nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Decodes a schedule as the instantiate stage would; raises ValueError with the
// decoder's message (file:line, field, value) if it is invalid.
nb::dict DecodeForPython(Int64Array encoded) {
  ::xla::ffi::ErrorOr<Schedule> decoded = DecodeSchedule(
      ::xla::ffi::Span<const int64_t>(encoded.data(), encoded.shape(0)));
  if (decoded.has_error()) {
    throw nb::value_error(decoded.error().message().c_str());
  }
  const Schedule& s = decoded.value();
  nb::dict out;
  out["version"] = kScheduleVersion;
  out["n_steps"] = s.n_steps;
  out["n_tensors"] = s.tensors.size();
  out["n_ops"] = s.ops.size();
  out["devices"] = s.devices;
  out["ws"] = s.ws_bytes;
  out["fingerprint"] = s.fingerprint;
  return out;
}

// Decodes a local copy schedule as jax_m2n_local_copy's instantiate stage
// would; raises ValueError with the decoder's message if it is invalid.
void CheckLocalCopyForPython(Int64Array encoded) {
  ::xla::ffi::ErrorOr<LocalCopySchedule> decoded = DecodeLocalCopySchedule(
      ::xla::ffi::Span<const int64_t>(encoded.data(), encoded.shape(0)));
  if (decoded.has_error()) {
    throw nb::value_error(decoded.error().message().c_str());
  }
}

}  // namespace
}  // namespace jax_m2n

NB_MODULE(_ffi, m) {
  m.doc() =
      "jax_m2n CPU extension: the jax_m2n_reshard XLA FFI handler (platform "
      "cpu) and helpers. See docs/schedule_format.md.";

  m.attr("SCHEDULE_VERSION") = jax_m2n::kScheduleVersion;

  m.def(
      "registrations",
      []() {
        nb::dict stages;
        stages["instantiate"] = jax_m2n::Capsule(JaxM2nReshardCpuInstantiate);
        stages["execute"] = jax_m2n::Capsule(JaxM2nReshardCpuExecute);
        nb::dict targets;
        targets["jax_m2n_reshard"] = stages;
        nb::dict local_copy;
        local_copy["instantiate"] =
            jax_m2n::Capsule(JaxM2nLocalCopyCpuInstantiate);
        local_copy["execute"] = jax_m2n::Capsule(JaxM2nLocalCopyCpuExecute);
        targets["jax_m2n_local_copy"] = local_copy;
        return targets;
      },
      "Targets for jax.ffi.register_ffi_target(name, target, platform='cpu', "
      "api_version=1): {'jax_m2n_reshard': {'instantiate': capsule, "
      "'execute': capsule}, 'jax_m2n_local_copy': {'instantiate': capsule, "
      "'execute': capsule}}.");

  m.def(
      "type_registrations",
      []() {
        nb::dict type;
        type["type_id"] = jax_m2n::Capsule(&jax_m2n::ReshardCpuState::id);
        type["type_info"] = jax_m2n::Capsule(
            const_cast<XLA_FFI_TypeInfo*>(jax_m2n::ReshardCpuStateTypeInfo()));
        nb::dict types;
        types[jax_m2n::kReshardCpuStateTypeName] = type;
        return types;
      },
      "Optional: {name: {'type_id': capsule, 'type_info': capsule}} for "
      "jax.ffi.register_ffi_type(name, reg, platform='cpu'). The instantiate "
      "stage registers its state type itself when nobody has.");

  m.def(
      "schedule_version", []() { return jax_m2n::kScheduleVersion; },
      "The schedule format version this extension decodes.");

  m.def("decode_schedule", &jax_m2n::DecodeForPython, nb::arg("schedule"),
        "Decodes and validates a schedule (1-D C-contiguous int64 array) as "
        "the instantiate stage does. Returns a summary dict (version, n_steps, "
        "n_tensors, n_ops, devices, ws, fingerprint); raises ValueError naming "
        "the field and value if it is invalid. Buffer-dependent checks run at "
        "execute time only.");

  m.def("check_local_copy_schedule", &jax_m2n::CheckLocalCopyForPython,
        nb::arg("schedule"),
        "Decodes and validates a jax_m2n_local_copy schedule (1-D C-contiguous "
        "int64 array) as its instantiate stage does, the tiling of every output "
        "included; raises ValueError naming the output, box, field and value.");

  m.def(
      "abandon",
      [](int64_t site, std::vector<int64_t> device_ids, std::string reason) {
        for (int64_t device : device_ids) {
          jax_m2n::AbortNextCpuGeneration(
              site, device, /*n_participants=*/-1,
              JAX_M2N_ERROR(kAborted, reason));
        }
      },
      nb::arg("site"), nb::arg("device_ids"),
      nb::arg("reason") =
          "its program was not dispatched (abandoned by the caller)",
      "For the eager path: consumes the next generation of `site` on each of "
      "`device_ids` whose program will not reach the handler, with `reason` "
      "(the cause, e.g. the program's own error). Peers waiting in that "
      "generation fail at once with the reason (instead of after timeout_ms) "
      "and the devices' next calls line up with their peers again.");

  m.def(
      "joined",
      [](int64_t site, std::vector<int64_t> device_ids) {
        return jax_m2n::JoinedCpuGenerations(site, device_ids);
      },
      nb::arg("site"), nb::arg("device_ids"),
      "Per device: how many generations of `site` it has joined or abandoned. "
      "Equal for every device of a site when they are in step.");

  m.def(
      "abort",
      [](int64_t site, int64_t index, std::vector<int64_t> device_ids,
         std::string reason) {
        jax_m2n::AbortCpuGeneration(site, index, device_ids,
                                    JAX_M2N_ERROR(kAborted, reason));
      },
      nb::arg("site"), nb::arg("index"), nb::arg("device_ids"),
      nb::arg("reason"),
      "Aborts generation `index` of `site` (0-based: the value joined() had "
      "before the call): its participants fail at once with `reason`, and any "
      "of `device_ids` that joins it later fails at once.");

  m.def(
      "abandon_generation",
      [](int64_t site, std::vector<int64_t> device_ids, int64_t index,
         std::string reason) {
        for (int64_t device : device_ids) {
          jax_m2n::AbandonCpuGeneration(site, device, index,
                                        JAX_M2N_ERROR(kAborted, reason));
        }
      },
      nb::arg("site"), nb::arg("device_ids"), nb::arg("index"),
      nb::arg("reason"),
      "For the eager path: gives up generation `index` (0-based) of `site` on "
      "each of `device_ids` whose program did not (or will not) reach the "
      "handler, with `reason`: its peers fail at once, and the device's later "
      "ticketed calls skip it. No effect on a device that has joined it.");

  m.def(
      "hold",
      [](std::vector<int64_t> device_ids, bool hold) {
        nb::gil_scoped_release release;
        jax_m2n::HoldCpuDevices(device_ids, hold);
      },
      nb::arg("device_ids"), nb::arg("hold") = true,
      "For tests: while held, a device's handler waits before it joins its "
      "generation (its program runs, its transfer has not started); "
      "hold(ids, False) releases them.");

  m.def(
      "pending_generations", []() { return jax_m2n::PendingCpuGenerations(); },
      "For tests: generations of any site not yet joined by all participants.");
}
