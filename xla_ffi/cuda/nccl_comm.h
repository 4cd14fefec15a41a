// The NCCL engine of the CUDA transport: loads the libnccl.so.2 the JAX CUDA plugin already
// has in the process (dlopen, no link-time dependency), and owns the one communicator over
// all JAX devices (rank = position in jax.devices()), its per-device ranks in this process,
// and the watchdog that turns a peer that never arrives into an error instead of a hang.
// Knows nothing of schedules or XLA; never launches kernels of its own.

#ifndef JAX_M2N_XLA_FFI_CUDA_NCCL_COMM_H_
#define JAX_M2N_XLA_FFI_CUDA_NCCL_COMM_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace jax_m2n {

// "file.cc:123: <message>": the location prefix of every error this extension returns.
std::string ErrorAt(const char* file, int line, const std::string& message);
#define JAX_M2N_AT(message) ::jax_m2n::ErrorAt(__FILE__, __LINE__, (message))

// The NCCL entry points the transport uses, each `nccl<Name>`, in one list: X(Name) per
// function (the members below and LoadNccl's dlsym calls both expand it, so the two
// cannot drift). Only functions present since NCCL 2.19.
#define JAX_M2N_NCCL_FUNCTIONS(X)                                                    \
  X(GetVersion) X(GetUniqueId) X(CommInitRankConfig) X(CommFinalize) X(CommDestroy)  \
  X(CommAbort) X(CommGetAsyncError) X(GetErrorString) X(GetLastError) X(GroupStart) \
  X(GroupEnd) X(Send) X(Recv)

// The NCCL entry points, resolved with dlsym: `Send` is ncclSend, typed from the nccl.h
// of the build.
struct NcclApi {
#define JAX_M2N_NCCL_MEMBER(name) decltype(&::nccl##name) name = nullptr;
  JAX_M2N_NCCL_FUNCTIONS(JAX_M2N_NCCL_MEMBER)
#undef JAX_M2N_NCCL_MEMBER
  int version = 0;      // ncclGetVersion(), e.g. 22809
  std::string origin;   // how it was found: "already loaded" or the path dlopen'ed

  // "<ncclGetErrorString>: <ncclGetLastError>" for a failed call on `comm` (may be null).
  std::string Describe(ncclResult_t result, ncclComm_t comm) const;
};

// Loads NCCL once per process (thread-safe). `library_path` "" = the libnccl.so.2 that is
// already loaded (RTLD_NOLOAD), else the default search path; a path = that file. The
// first successful load wins; later calls return it whatever their argument.
// Returns nullptr and sets *error on failure.
const NcclApi* LoadNccl(const std::string& library_path, std::string* error);

// One of this process's devices as a rank of the communicator.
struct LocalRank {
  int ordinal = -1;        // process-local CUDA ordinal (XLA's DeviceOrdinal)
  int64_t device_id = -1;  // global JAX device id
  int rank = -1;           // position in jax.devices()
  ncclComm_t comm = nullptr;
  // NCCL communicators are not thread-safe: every NCCL call on `comm` holds this.
  std::mutex mu;

  // Completion events for the watchdog, reused (cudaEventDisableTiming).
  std::mutex events_mu;
  std::vector<cudaEvent_t> free_events;
};

struct InitOptions {
  std::string unique_id;                             // ncclUniqueId bytes (128)
  std::vector<int64_t> device_ids;                   // all ranks: global ids, rank order
  std::vector<std::pair<int, int64_t>> local;        // (CUDA ordinal, global id)
  int64_t timeout_ms = 600000;
  std::string nccl_library;
  // Blocking NCCL communicators (the default): ncclGroupEnd enqueues and returns in
  // ~10 us; nonblocking ones cost ~120 us of host time per group (measured, NCCL 2.28).
  bool blocking = true;
  int64_t warmup_bytes = 8 << 20;
};

// The process-wide communicator. Initialize/Finalize are called from Python (one at a
// time, never concurrently with a reshard on this process); the handler reads it from
// XLA's threads.
class Communicator {
 public:
  static Communicator& Get();

  // Collective over all processes; blocking. Returns "" or an error message; sets
  // *timed_out when the deadline passed (a rank that never arrived).
  std::string Initialize(const InitOptions& options, bool* timed_out);
  // Destroys the communicator (after an abort too). Returns "" or an error message.
  std::string Finalize();

  bool initialized() const { return initialized_.load(std::memory_order_acquire); }
  // Increments at every Initialize: plans that cached ranks rebuild when it changes.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  const NcclApi& api() const { return *api_; }

  // The rank of this process for a CUDA ordinal; nullptr if none.
  LocalRank* ForOrdinal(int ordinal) const;
  // This process's rank of a global device id; nullptr if the device is not local.
  LocalRank* ForDevice(int64_t device_id) const;
  // The rank of a global device id; -1 if the device is not in the communicator.
  int RankOf(int64_t device_id) const;
  std::string DescribeLocalTable() const;  // "{ordinal 0 -> device 0 (rank 0), ...}"

  // The first fatal error (timeout, asynchronous NCCL error); "" while healthy. After
  // one, the communicator is aborted and every later reshard fails with it.
  std::string StickyError() const;

  // Watches one call: `start`/`end` are events recorded on the call's stream before
  // and after its work (taken from rank->free_events via TakeEvent). If `end` has not
  // completed `timeout_ms` after `start` completed, the communicator is aborted (its
  // kernels exit) and the sticky error set. timeout_ms <= 0: events are just recycled.
  void Watch(LocalRank* rank, cudaEvent_t start, cudaEvent_t end, int64_t timeout_ms,
             std::string what);
  // An event for Watch; returns cudaSuccess or the creation error.
  cudaError_t TakeEvent(LocalRank* rank, cudaEvent_t* event);

  // Waits (polling ncclCommGetAsyncError) until `comm` has no operation in progress,
  // for nonblocking communicators after ncclGroupEnd returned ncclInProgress.
  ncclResult_t WaitReady(ncclComm_t comm, std::chrono::steady_clock::time_point deadline,
                         bool* timed_out) const;

 private:
  Communicator() = default;
  struct Pending {
    LocalRank* rank;
    cudaEvent_t start, end;
    int64_t timeout_ms;
    bool started = false;
    std::chrono::steady_clock::time_point started_at;
    std::string what;
  };
  void WatchdogLoop();
  void AbortAll(const std::string& reason);  // sets the sticky error, aborts every comm
  void ReleaseEvent(LocalRank* rank, cudaEvent_t event);

  std::mutex init_mu_;  // Initialize / Finalize
  std::atomic<bool> initialized_{false};
  std::atomic<uint64_t> generation_{0};
  const NcclApi* api_ = nullptr;
  InitOptions options_;
  std::vector<std::unique_ptr<LocalRank>> local_;
  std::vector<LocalRank*> by_ordinal_;                  // index: CUDA ordinal
  std::vector<std::pair<int64_t, int>> rank_of_;        // sorted (device id, rank)

  mutable std::mutex error_mu_;
  std::string sticky_error_;

  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::deque<Pending> pending_;
  bool watch_stop_ = false;
  std::thread watchdog_;
};

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_NCCL_COMM_H_
