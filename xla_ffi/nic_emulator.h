// The emulated inter-domain network of the CPU transport (an emulator, not a
// network): per device one egress and one ingress NIC queue, each a virtual
// clock at the emulated bandwidth. A transfer between devices of different
// domains reserves both queues and its caller sleeps until the reservation
// ends. Owns only time bookkeeping: it never copies bytes or spawns threads.

#ifndef JAX_M2N_XLA_FFI_NIC_EMULATOR_H_
#define JAX_M2N_XLA_FFI_NIC_EMULATOR_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_m2n {

// The parameters of one call's emulated network, decoded from the optional
// CPU attribute `network` (int64[2 + n_devices]):
//   [bytes_per_s, latency_ns, domain of devices[0], ..., domain of devices[n-1]]
// where devices are the schedule's participants (ascending global ids).
struct EmulatedNetwork {
  int64_t bytes_per_s = 0;          // per queue (egress and ingress), > 0
  int64_t latency_ns = 0;           // added to every transfer's arrival, >= 0
  std::vector<int64_t> domain;      // per participant

  // Whether a transfer between two participants crosses the network.
  bool Crosses(int32_t src_participant, int32_t dst_participant) const {
    return domain[src_participant] != domain[dst_participant];
  }
};

// Decodes and checks the `network` attribute against `n_devices`.
::xla::ffi::ErrorOr<EmulatedNetwork> DecodeEmulatedNetwork(
    ::xla::ffi::Span<const int64_t> encoded, int64_t n_devices);

// The process-wide NIC queues, keyed by global device id. Thread-safe.
class NicEmulator {
 public:
  using Clock = std::chrono::steady_clock;

  static NicEmulator& Global();

  // Reserves a transfer of `bytes` from device `src` to device `dst`, posted at
  // `posted` (not after now): it starts when both src's egress queue and dst's
  // ingress queue are free (not before `posted`), occupies both for bytes / bytes_per_s, and its last byte arrives
  // latency_ns after that. Returns the arrival time; the caller waits until
  // then (transfers already reserved on a queue delay later ones: the NIC is
  // shared by all of a device's cross-domain transfers, across calls).
  Clock::time_point Reserve(int64_t src, int64_t dst, int64_t bytes,
                            Clock::time_point posted,
                            const EmulatedNetwork& network);

  // For tests: how many queues have been used.
  int64_t QueueCount();

 private:
  NicEmulator() = default;
};

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_NIC_EMULATOR_H_
