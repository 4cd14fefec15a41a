// The in-process CPU transport of jax_m2n_reshard: every participant of a
// reshard is a device of this process, and each device's call runs on its own
// (XLA's) thread. Owns the process-wide rendezvous (site + per-device
// generation), the step barriers, timeouts and buffer lifetimes. Does not
// decode schedules (schedule.h) or talk to XLA (reshard_cpu.cc); spawns no
// threads: a device's part runs on the thread XLA runs its program on.

#ifndef JAX_M2N_XLA_FFI_CPU_TRANSPORT_H_
#define JAX_M2N_XLA_FFI_CPU_TRANSPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/nic_emulator.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

// One buffer of one device's call, borrowed from XLA's call frame.
struct CpuBuffer {
  char* data = nullptr;
  ::xla::ffi::Span<const int64_t> dims;
  int64_t elem_bytes = 0;
};

// All buffers of one device's call. Operands are only read (by the device and
// its peers); results and the workspace are only written by their own device.
struct CpuDeviceBuffers {
  std::vector<CpuBuffer> operands;
  std::vector<CpuBuffer> results;  // without the trailing workspace
  char* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

// What identifies one device's part of one reshard.
struct CpuCall {
  const Schedule* schedule = nullptr;  // decoded and validated
  int64_t site = 0;                    // the `site` attribute
  int64_t timeout_ms = 0;              // the `timeout_ms` attribute, > 0
  int32_t participant = 0;             // index of this device in devices
  // The emulated network (nic_emulator.h), or nullptr: then every copy runs at
  // memory speed. With it, an op whose ends lie in different domains reserves
  // the source's egress and this device's ingress NIC queue, and this device
  // leaves the step only when its last such transfer has arrived.
  const EmulatedNetwork* network = nullptr;
  // The eager path's generation ticket (the `tickets` attribute): with
  // tickets > 0 this call belongs to the generation k of `site` with
  // k % tickets == ticket, the first such k not yet joined by this device;
  // generations skipped on the way are aborted (their programs never ran the
  // handler). 0: the device's next generation (inside jit).
  int64_t tickets = 0;
  int64_t ticket = 0;
};

// Runs one device's part of a reshard. The device joins generation k of
// `site`, where k counts this device's previous joins of that site (the k-th
// execution on each device meets the k-th on every other participant),
// publishes `buffers`, and then for every step s in [0, n_steps): waits until
// all participants have finished step s - 1 (a barrier), then performs the ops
// of step s whose destination is this device, reading its peers' published
// buffers (pull). A last barrier after the last step keeps every device in the
// call until no peer can read its buffers any more.
//
// Preconditions: CheckDeviceBuffers(schedule, participant, shapes of
// `buffers`) succeeded. `buffers` must stay valid until this returns; it
// returns only when no peer reads them any more (on success and on error).
//
// Errors (codes in parentheses; all name the site, the generation and this
// device):
//  - a participant did not reach a barrier within timeout_ms: every waiting
//    participant returns the same reason, naming the step and the devices that
//    did not arrive (kDeadlineExceeded);
//  - this device joined a generation already aborted (a late arriver): returns
//    at once, copying nothing (kAborted, with the original reason);
//  - participants disagree on the schedule (fingerprint) (kFailedPrecondition);
//  - a peer rejected its buffers or abandoned the generation
//    (AbortNextCpuGeneration), or a peer's buffer does not match an op: the
//    generation is aborted, every participant fails (kAborted / the code
//    of the original error).
// A failed generation does not affect later generations of the same site.
::xla::ffi::Error RunCpuTransport(const CpuCall& call,
                                  const CpuDeviceBuffers& buffers);

// Consumes `device_id`'s next generation of `site` without taking part in it
// and aborts that generation with `reason`, so that its participants fail at
// once instead of waiting for the timeout, and `device_id`'s following
// generation lines up with its peers' again. Used (1) by the handler when this
// device's buffers fail CheckDeviceBuffers, (2) by the Python side for a device
// whose program it could not dispatch (module_cpu.cc: `abandon`).
// `n_participants` is the number of participants if known, else -1.
// `tickets`/`ticket`: as in CpuCall (the generation to give up is the one the
// ticket names).
void AbortNextCpuGeneration(int64_t site, int64_t device_id,
                            int64_t n_participants,
                            const ::xla::ffi::Error& reason,
                            int64_t tickets = 0, int64_t ticket = 0);

// Gives up generation `index` of `site` for `device_id`, whose program will not
// reach the handler (the eager path, when a device's program failed before
// it): its participants fail at once with `reason`. Consumed now if it is the
// device's next generation; otherwise aborted now and skipped by the device's
// next ticketed call. No effect if the device has joined it already.
void AbandonCpuGeneration(int64_t site, int64_t device_id, int64_t index,
                          const ::xla::ffi::Error& reason);

// For tests: while a device is held, its handler waits before joining its
// generation (its program is running, its transfer has not started).
// hold=false releases the devices.
void HoldCpuDevices(const std::vector<int64_t>& device_ids, bool hold);

// Per device of `device_ids`: how many generations of `site` it has joined or
// abandoned (its next generation index). Devices of one site are in step when
// these are equal; the eager caller reads them before and after a call to find
// a device whose program never reached the handler.
std::vector<int64_t> JoinedCpuGenerations(int64_t site,
                                          const std::vector<int64_t>& device_ids);

// Aborts generation `index` of `site` with `reason`: participants waiting in it
// fail at once, and any of `device_ids` that joins it later fails at once
// (copying nothing). Used when the caller is interrupted (KeyboardInterrupt)
// while the generation runs. No effect on a generation everyone has left.
void AbortCpuGeneration(int64_t site, int64_t index,
                        const std::vector<int64_t>& device_ids,
                        const ::xla::ffi::Error& reason);

// For tests: the number of generations not yet joined by all participants
// (entries that a completed or fully drained generation leaves behind: 0).
int64_t PendingCpuGenerations();

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CPU_TRANSPORT_H_
