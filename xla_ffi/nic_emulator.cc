// The emulated NIC queues: FIFO reservations on per-device virtual clocks. The
// model is the one the planner's cost model assumes (each device sends and
// receives at most nic_gbps over the network, in each direction independently),
// so measured times can be checked against its estimate.

#include "xla_ffi/nic_emulator.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {
namespace {

namespace ffi = ::xla::ffi;
using Clock = NicEmulator::Clock;

std::mutex& Mu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}

// When each queue is next free. Guarded by Mu(); never destroyed (calls may
// still run while the process exits).
std::unordered_map<int64_t, Clock::time_point>& Egress() {
  static auto* queues = new std::unordered_map<int64_t, Clock::time_point>();
  return *queues;
}
std::unordered_map<int64_t, Clock::time_point>& Ingress() {
  static auto* queues = new std::unordered_map<int64_t, Clock::time_point>();
  return *queues;
}

}  // namespace

ffi::ErrorOr<EmulatedNetwork> DecodeEmulatedNetwork(
    ffi::Span<const int64_t> encoded, int64_t n_devices) {
  using Result = ffi::ErrorOr<EmulatedNetwork>;
  if (static_cast<int64_t>(encoded.size()) != 2 + n_devices) {
    return Result(ffi::Unexpected<ffi::Error>(JAX_M2N_ERROR(
        kInvalidArgument,
        "attribute network must have 2 + n_devices = " +
            std::to_string(2 + n_devices) + " entries (bytes_per_s, "
            "latency_ns, one domain per participant); got " +
            std::to_string(encoded.size()))));
  }
  EmulatedNetwork network;
  network.bytes_per_s = encoded[0];
  network.latency_ns = encoded[1];
  if (network.bytes_per_s < 1 || network.latency_ns < 0) {
    return Result(ffi::Unexpected<ffi::Error>(JAX_M2N_ERROR(
        kInvalidArgument,
        "attribute network must have bytes_per_s >= 1 and latency_ns >= 0; "
        "got bytes_per_s " +
            std::to_string(network.bytes_per_s) + ", latency_ns " +
            std::to_string(network.latency_ns))));
  }
  network.domain.assign(encoded.begin() + 2, encoded.end());
  return Result(std::move(network));
}

NicEmulator& NicEmulator::Global() {
  static NicEmulator* emulator = new NicEmulator();
  return *emulator;
}

Clock::time_point NicEmulator::Reserve(int64_t src, int64_t dst, int64_t bytes,
                                       Clock::time_point posted,
                                       const EmulatedNetwork& network) {
  const auto busy = std::chrono::nanoseconds(static_cast<int64_t>(
      static_cast<double>(bytes) * 1e9 /
      static_cast<double>(network.bytes_per_s)));
  const Clock::time_point now =
      posted == Clock::time_point::min() ? Clock::now()
                                         : std::min(posted, Clock::now());
  std::lock_guard<std::mutex> lock(Mu());
  Clock::time_point& egress = Egress()[src];
  Clock::time_point& ingress = Ingress()[dst];
  const Clock::time_point start = std::max({now, egress, ingress});
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(busy);
  egress = end;
  ingress = end;
  return end + std::chrono::nanoseconds(network.latency_ns);
}

int64_t NicEmulator::QueueCount() {
  std::lock_guard<std::mutex> lock(Mu());
  return static_cast<int64_t>(Egress().size() + Ingress().size());
}

}  // namespace jax_m2n
