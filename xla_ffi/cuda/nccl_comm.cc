// NCCL loading (dlopen of the plugin's libnccl.so.2), communicator creation with a warm-up
// exchange that connects every pair of ranks, and the watchdog (docs/cuda_transport.md,
// "Timeouts"). Never called on the hot path except TakeEvent/Watch/WaitReady.

#include "xla_ffi/cuda/nccl_comm.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "xla_ffi/cuda/pack.h"

namespace jax_m2n {
namespace {

using Clock = std::chrono::steady_clock;

const char* Basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

std::string CudaError(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

// Restores the calling thread's current device on scope exit.
class ScopedDevice {
 public:
  ScopedDevice() { had_ = cudaGetDevice(&saved_) == cudaSuccess; }
  ~ScopedDevice() {
    if (had_) cudaSetDevice(saved_);
  }

 private:
  int saved_ = 0;
  bool had_ = false;
};

template <typename F>
bool Resolve(void* lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
    return false;
  }
  return true;
}

}  // namespace

std::string ErrorAt(const char* file, int line, const std::string& message) {
  return std::string(Basename(file)) + ":" + std::to_string(line) + ": " + message;
}

std::string NcclApi::Describe(ncclResult_t result, ncclComm_t comm) const {
  std::string out = GetErrorString ? GetErrorString(result) : "NCCL error";
  out += " (ncclResult_t " + std::to_string(static_cast<int>(result)) + ")";
  if (GetLastError != nullptr) {
    const char* last = GetLastError(comm);
    if (last != nullptr && *last != '\0') out += ": " + std::string(last);
  }
  return out;
}

const NcclApi* LoadNccl(const std::string& library_path, std::string* error) {
  static std::mutex mu;
  static NcclApi* loaded = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded != nullptr) return loaded;

  void* lib = nullptr;
  std::string origin;
  if (library_path.empty()) {
    // The JAX CUDA plugin links libnccl.so.2 from the nvidia-nccl wheel: share that copy
    // (one NCCL per process; a second copy would duplicate its global state).
    lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    origin = "already loaded";
    if (lib == nullptr) {
      lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
      origin = "libnccl.so.2 from the library search path";
    }
  } else {
    lib = dlopen(library_path.c_str(), RTLD_NOW | RTLD_LOCAL);
    origin = library_path;
  }
  if (lib == nullptr) {
    const char* why = dlerror();
    *error = JAX_M2N_AT(
        "dlopen(" + (library_path.empty() ? std::string("libnccl.so.2") : library_path) +
        ") failed: " + (why ? why : "unknown") +
        ". Import jax and initialize its CUDA backend first (the plugin loads "
        "nvidia-nccl's libnccl.so.2), or pass nccl_library=<path to libnccl.so.2>.");
    return nullptr;
  }
  auto api = std::make_unique<NcclApi>();
  std::string missing;
#define JAX_M2N_NCCL_RESOLVE(name) Resolve(lib, "nccl" #name, &api->name, &missing);
  JAX_M2N_NCCL_FUNCTIONS(JAX_M2N_NCCL_RESOLVE)
#undef JAX_M2N_NCCL_RESOLVE
  if (!missing.empty()) {
    *error = JAX_M2N_AT("NCCL (" + origin + ") lacks " + missing +
                           "; jax_m2n needs NCCL >= 2.19.");
    return nullptr;
  }
  ncclResult_t r = api->GetVersion(&api->version);
  if (r != ncclSuccess || api->version < 21900) {
    *error = JAX_M2N_AT("NCCL (" + origin + ") version " + std::to_string(api->version) +
                           " must be >= 21900 (2.19)");
    return nullptr;
  }
  api->origin = origin;
  loaded = api.release();  // lives for the process: handlers may run until exit
  return loaded;
}

Communicator& Communicator::Get() {
  // Never destroyed: CUDA and NCCL must not be called from static destructors.
  static Communicator* c = new Communicator();
  return *c;
}

LocalRank* Communicator::ForOrdinal(int ordinal) const {
  if (ordinal < 0 || ordinal >= static_cast<int>(by_ordinal_.size())) return nullptr;
  return by_ordinal_[ordinal];
}

LocalRank* Communicator::ForDevice(int64_t device_id) const {
  for (const auto& lr : local_) {
    if (lr->device_id == device_id) return lr.get();
  }
  return nullptr;
}

int Communicator::RankOf(int64_t device_id) const {
  auto it = std::lower_bound(rank_of_.begin(), rank_of_.end(),
                             std::make_pair(device_id, -1));
  if (it == rank_of_.end() || it->first != device_id) return -1;
  return it->second;
}

std::string Communicator::DescribeLocalTable() const {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < local_.size(); ++i) {
    if (i) os << ", ";
    os << "ordinal " << local_[i]->ordinal << " -> device " << local_[i]->device_id
       << " (rank " << local_[i]->rank << ")";
  }
  os << "}";
  return os.str();
}

std::string Communicator::StickyError() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return sticky_error_;
}

ncclResult_t Communicator::WaitReady(ncclComm_t comm, Clock::time_point deadline,
                                     bool* timed_out) const {
  *timed_out = false;
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = api_->CommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (Clock::now() > deadline) {
      *timed_out = true;
      return ncclInProgress;
    }
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

namespace {

// Creation of this process's ranks and the warm-up exchange, run on a helper thread so
// that Initialize can give up after its deadline even with blocking communicators (whose
// calls cannot be interrupted). If Initialize gave up, the thread aborts what it created.
struct InitJob {
  const NcclApi* api = nullptr;
  ncclUniqueId id;
  int n_ranks = 0;
  bool blocking = true;
  int64_t timeout_ms = 0;
  size_t warmup_bytes = 0;
  Clock::time_point deadline;
  std::vector<std::unique_ptr<LocalRank>> local;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool abandoned = false;
  std::string error;
  bool timed_out = false;

  void AbortAll() {
    for (auto& lr : local) {
      if (lr->comm != nullptr) api->CommAbort(lr->comm);
      lr->comm = nullptr;
    }
  }
};

// Waits (nonblocking communicators) until `comm` has no operation in progress.
ncclResult_t WaitComm(const NcclApi& api, ncclComm_t comm, Clock::time_point deadline,
                      bool* late) {
  *late = false;
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = api.CommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (Clock::now() > deadline) {
      *late = true;
      return ncclInProgress;
    }
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::string CreateRanks(InitJob& job) {
  const NcclApi& api = *job.api;
  ScopedDevice restore;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = job.blocking ? 1 : 0;
  for (auto& lr : job.local) {
    cudaError_t cerr = cudaSetDevice(lr->ordinal);
    if (cerr == cudaSuccess) cerr = PreloadCopyKernels();
    if (cerr != cudaSuccess) {
      return JAX_M2N_AT("preparing device " + std::to_string(lr->device_id) + " (ordinal " +
                        std::to_string(lr->ordinal) + ") failed: " + CudaError(cerr));
    }
  }
  ncclResult_t r = api.GroupStart();
  if (r != ncclSuccess) return JAX_M2N_AT("ncclGroupStart failed: " + api.Describe(r, nullptr));
  for (auto& lr : job.local) {
    cudaSetDevice(lr->ordinal);
    r = api.CommInitRankConfig(&lr->comm, job.n_ranks, job.id, lr->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      api.GroupEnd();
      return JAX_M2N_AT("ncclCommInitRankConfig(rank=" + std::to_string(lr->rank) +
                        ", nranks=" + std::to_string(job.n_ranks) + ") failed: " +
                        api.Describe(r, nullptr));
    }
  }
  r = api.GroupEnd();  // blocking communicators: returns once every rank has joined
  if (r != ncclSuccess && r != ncclInProgress) {
    return JAX_M2N_AT("ncclGroupEnd (communicator creation, " + std::to_string(job.n_ranks) +
                      " ranks) failed: " + api.Describe(r, nullptr));
  }
  for (auto& lr : job.local) {
    bool late = false;
    r = WaitComm(api, lr->comm, job.deadline, &late);
    if (late || r != ncclSuccess) {
      job.timed_out = late;
      return JAX_M2N_AT("ncclCommInitRankConfig(rank=" + std::to_string(lr->rank) +
                        ", device " + std::to_string(lr->device_id) + ", nranks=" +
                        std::to_string(job.n_ranks) + "): " +
                        (late ? "timed out after " + std::to_string(job.timeout_ms) +
                                    " ms: not every rank called initialize"
                              : api.Describe(r, lr->comm)));
    }
  }
  return "";
}

// Every rank sends warmup_bytes to every other rank and receives as much, in one group:
// NCCL connects peers lazily, and a connection set up inside a reshard would block the
// host until the peer arrives (a deadlock when programs are dispatched one by one).
std::string Warmup(InitJob& job) {
  const NcclApi& api = *job.api;
  ScopedDevice restore;
  const int n_ranks = job.n_ranks;
  const size_t bytes = job.warmup_bytes;
  struct Buffers {
    char* send = nullptr;
    char* recv = nullptr;
    cudaStream_t stream = nullptr;
  };
  std::vector<Buffers> bufs(job.local.size());
  std::string err;
  auto cleanup = [&] {
    for (size_t i = 0; i < job.local.size(); ++i) {
      cudaSetDevice(job.local[i]->ordinal);
      if (bufs[i].stream) cudaStreamSynchronize(bufs[i].stream);
      if (bufs[i].send) cudaFree(bufs[i].send);
      if (bufs[i].recv) cudaFree(bufs[i].recv);
      if (bufs[i].stream) cudaStreamDestroy(bufs[i].stream);
    }
  };
  for (size_t i = 0; i < job.local.size() && err.empty(); ++i) {
    cudaError_t c = cudaSetDevice(job.local[i]->ordinal);
    if (c == cudaSuccess) c = cudaMalloc(&bufs[i].send, bytes * n_ranks);
    if (c == cudaSuccess) c = cudaMalloc(&bufs[i].recv, bytes * n_ranks);
    if (c == cudaSuccess) c = cudaStreamCreateWithFlags(&bufs[i].stream, cudaStreamNonBlocking);
    if (c == cudaSuccess) c = cudaMemsetAsync(bufs[i].send, 1, bytes * n_ranks, bufs[i].stream);
    if (c != cudaSuccess) {
      err = JAX_M2N_AT("warm-up buffers on device " + std::to_string(job.local[i]->device_id) +
                       " (" + std::to_string(2 * bytes * n_ranks) + " bytes): " + CudaError(c));
    }
  }
  if (!err.empty()) {
    cleanup();
    return err;
  }
  ncclResult_t r = api.GroupStart();
  for (size_t i = 0; i < job.local.size() && r == ncclSuccess; ++i) {
    const int self = job.local[i]->rank;
    for (int k = 1; k < n_ranks && r == ncclSuccess; ++k) {
      // Pairwise order (self+k, self-k) as in an all-to-all.
      const int to = (self + k) % n_ranks, from = (self - k + n_ranks) % n_ranks;
      r = api.Send(bufs[i].send + to * bytes, bytes, ncclUint8, to, job.local[i]->comm,
                   bufs[i].stream);
      if (r == ncclSuccess || r == ncclInProgress) {
        r = api.Recv(bufs[i].recv + from * bytes, bytes, ncclUint8, from, job.local[i]->comm,
                     bufs[i].stream);
      }
      if (r == ncclInProgress) r = ncclSuccess;
    }
  }
  ncclResult_t end = api.GroupEnd();  // blocking: returns once peers are connected
  if (r == ncclSuccess) r = end;
  if (r != ncclSuccess && r != ncclInProgress) {
    job.AbortAll();  // the streams would never drain
    cleanup();
    return JAX_M2N_AT("warm-up exchange (ncclSend/ncclRecv to every peer, " +
                      std::to_string(bytes) + " bytes each) failed: " + api.Describe(r, nullptr));
  }
  for (auto& lr : job.local) {
    bool late = false;
    r = WaitComm(api, lr->comm, job.deadline, &late);
    if (late || r != ncclSuccess) {
      job.timed_out = late;
      job.AbortAll();
      cleanup();
      return JAX_M2N_AT("warm-up exchange on device " + std::to_string(lr->device_id) +
                        (late ? std::string(": timed out connecting peers")
                              : ": " + api.Describe(r, nullptr)));
    }
  }
  // Wait for the exchange itself, with the deadline (a peer process may be missing).
  for (size_t i = 0; i < job.local.size() && err.empty(); ++i) {
    cudaSetDevice(job.local[i]->ordinal);
    for (;;) {
      cudaError_t q = cudaStreamQuery(bufs[i].stream);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        err = JAX_M2N_AT("warm-up exchange on device " +
                         std::to_string(job.local[i]->device_id) + ": " + CudaError(q));
        break;
      }
      if (Clock::now() > job.deadline) {
        job.timed_out = true;
        err = JAX_M2N_AT("warm-up exchange on device " +
                         std::to_string(job.local[i]->device_id) + " timed out after " +
                         std::to_string(job.timeout_ms) + " ms: a peer never arrived");
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (!err.empty()) job.AbortAll();  // kernels exit, so cleanup's synchronize returns
  cleanup();
  return err;
}

void RunInitJob(const std::shared_ptr<InitJob>& job) {
  std::string err = CreateRanks(*job);
  if (!err.empty()) job->AbortAll();
  if (err.empty() && job->warmup_bytes > 0 && job->n_ranks > 1) err = Warmup(*job);
  std::lock_guard<std::mutex> lock(job->mu);
  job->error = err;
  job->done = true;
  if (job->abandoned) job->AbortAll();  // Initialize gave up: nobody will use these
  job->cv.notify_all();
}

}  // namespace

std::string Communicator::Initialize(const InitOptions& o, bool* timed_out) {
  *timed_out = false;
  std::lock_guard<std::mutex> lock(init_mu_);
  if (initialized()) {
    if (o.device_ids == options_.device_ids && o.local == options_.local) return "";
    return JAX_M2N_AT(
        "initialize: the communicator already exists with another device table (local " +
        DescribeLocalTable() + "); call finalize() first");
  }
  // Arguments (the Python side checked types).
  if (o.unique_id.size() != sizeof(ncclUniqueId)) {
    return JAX_M2N_AT("initialize: unique_id must be " + std::to_string(sizeof(ncclUniqueId)) +
                      " bytes (nccl_unique_id()); got " + std::to_string(o.unique_id.size()));
  }
  if (o.device_ids.empty() || o.local.empty()) {
    return JAX_M2N_AT("initialize: device_ids and local_devices must be non-empty");
  }
  std::vector<std::pair<int64_t, int>> rank_of;
  for (size_t r = 0; r < o.device_ids.size(); ++r) {
    rank_of.emplace_back(o.device_ids[r], static_cast<int>(r));
  }
  std::sort(rank_of.begin(), rank_of.end());
  for (size_t i = 1; i < rank_of.size(); ++i) {
    if (rank_of[i].first == rank_of[i - 1].first) {
      return JAX_M2N_AT("initialize: device_ids must be distinct; device " +
                        std::to_string(rank_of[i].first) + " appears twice");
    }
  }
  std::string error;
  const NcclApi* api = LoadNccl(o.nccl_library, &error);
  if (api == nullptr) return error;
  api_ = api;
  rank_of_ = std::move(rank_of);

  int n_cuda = 0;
  cudaError_t cerr = cudaGetDeviceCount(&n_cuda);
  if (cerr != cudaSuccess) return JAX_M2N_AT("cudaGetDeviceCount failed: " + CudaError(cerr));
  auto job = std::make_shared<InitJob>();
  std::vector<LocalRank*> by_ordinal(n_cuda, nullptr);
  for (const auto& [ordinal, device_id] : o.local) {
    if (ordinal < 0 || ordinal >= n_cuda || by_ordinal[ordinal] != nullptr) {
      return JAX_M2N_AT("initialize: local_devices ordinals must be distinct CUDA ordinals "
                        "in [0, " + std::to_string(n_cuda) + "); got " + std::to_string(ordinal));
    }
    const int rank = RankOf(device_id);
    if (rank < 0) {
      return JAX_M2N_AT("initialize: local device " + std::to_string(device_id) +
                        " must be listed in device_ids");
    }
    auto lr = std::make_unique<LocalRank>();
    lr->ordinal = ordinal;
    lr->device_id = device_id;
    lr->rank = rank;
    by_ordinal[ordinal] = lr.get();
    job->local.push_back(std::move(lr));
  }

  // Multicast (NVLS) must stay off on these machines; respect an explicit setting.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);

  job->api = api_;
  std::memcpy(&job->id, o.unique_id.data(), sizeof(job->id));
  job->n_ranks = static_cast<int>(o.device_ids.size());
  job->blocking = o.blocking;
  job->timeout_ms = o.timeout_ms;
  job->warmup_bytes = static_cast<size_t>(std::max<int64_t>(0, o.warmup_bytes));
  job->deadline = Clock::now() + std::chrono::milliseconds(o.timeout_ms);
  std::thread([job] { RunInitJob(job); }).detach();
  {
    std::unique_lock<std::mutex> jlock(job->mu);
    // A little past the deadline: the job's own checks report more precisely.
    const bool finished = job->cv.wait_until(
        jlock, job->deadline + std::chrono::seconds(2), [&] { return job->done; });
    if (!finished) {
      job->abandoned = true;  // the job aborts its communicators if it ever returns
      *timed_out = true;
      return JAX_M2N_AT("initialize: creating the NCCL communicator (" +
                        std::to_string(job->n_ranks) + " ranks; this process: " +
                        std::to_string(job->local.size()) + ") did not finish within timeout_ms=" +
                        std::to_string(o.timeout_ms) + ": a process never called initialize "
                        "(or NCCL is stuck); restart the processes");
    }
    if (!job->error.empty()) {
      *timed_out = job->timed_out;
      return job->error;
    }
  }
  local_ = std::move(job->local);
  by_ordinal_ = std::move(by_ordinal);
  options_ = o;
  {
    std::lock_guard<std::mutex> elock(error_mu_);
    sticky_error_.clear();
  }
  {
    std::lock_guard<std::mutex> wlock(watch_mu_);
    watch_stop_ = false;
  }
  watchdog_ = std::thread([this] { WatchdogLoop(); });
  generation_.fetch_add(1, std::memory_order_acq_rel);
  initialized_.store(true, std::memory_order_release);
  return "";
}

std::string Communicator::Finalize() {
  std::lock_guard<std::mutex> lock(init_mu_);
  if (!initialized()) return "";
  initialized_.store(false, std::memory_order_release);
  {
    std::lock_guard<std::mutex> wlock(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::string err;
  ScopedDevice restore;
  for (auto& lr : local_) {
    std::lock_guard<std::mutex> rlock(lr->mu);
    cudaSetDevice(lr->ordinal);
    if (lr->comm != nullptr) {
      ncclResult_t r = api_->CommFinalize(lr->comm);
      bool late = false;
      if (r == ncclSuccess || r == ncclInProgress) {
        r = WaitReady(lr->comm, Clock::now() + std::chrono::milliseconds(options_.timeout_ms),
                      &late);
      }
      if (r != ncclSuccess || late) {
        if (err.empty()) {
          err = JAX_M2N_AT("ncclCommFinalize(device " + std::to_string(lr->device_id) +
                              ") " + (late ? std::string("timed out") : api_->Describe(r, lr->comm)) +
                              "; aborted instead");
        }
        api_->CommAbort(lr->comm);
      } else {
        api_->CommDestroy(lr->comm);
      }
      lr->comm = nullptr;
    }
    for (cudaEvent_t e : lr->free_events) cudaEventDestroy(e);
    lr->free_events.clear();
  }
  // Events of calls still pending are leaked on purpose: their streams may never drain.
  pending_.clear();
  local_.clear();
  by_ordinal_.clear();
  rank_of_.clear();
  return err;
}

cudaError_t Communicator::TakeEvent(LocalRank* rank, cudaEvent_t* event) {
  {
    std::lock_guard<std::mutex> lock(rank->events_mu);
    if (!rank->free_events.empty()) {
      *event = rank->free_events.back();
      rank->free_events.pop_back();
      return cudaSuccess;
    }
  }
  return cudaEventCreateWithFlags(event, cudaEventDisableTiming);
}

void Communicator::ReleaseEvent(LocalRank* rank, cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(rank->events_mu);
  rank->free_events.push_back(event);
}

void Communicator::Watch(LocalRank* rank, cudaEvent_t start, cudaEvent_t end,
                         int64_t timeout_ms, std::string what) {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    Pending p;
    p.rank = rank;
    p.start = start;
    p.end = end;
    p.timeout_ms = timeout_ms;
    p.what = std::move(what);
    pending_.push_back(std::move(p));
  }
  watch_cv_.notify_one();
}

void Communicator::AbortAll(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (sticky_error_.empty()) sticky_error_ = reason;
  }
  // Abort sets NCCL's abort flag: kernels blocked on a peer exit, and streams drain.
  for (auto& lr : local_) {
    std::lock_guard<std::mutex> rlock(lr->mu);
    if (lr->comm != nullptr) {
      cudaSetDevice(lr->ordinal);
      api_->CommAbort(lr->comm);
      lr->comm = nullptr;
    }
  }
}

// Polls pending calls every millisecond while there are any; sleeps otherwise. Also polls
// ncclCommGetAsyncError (a failed peer connection surfaces there) every 100 ms.
void Communicator::WatchdogLoop() {
  auto last_async_check = Clock::now();
  std::unique_lock<std::mutex> lock(watch_mu_);
  for (;;) {
    if (pending_.empty()) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
    }
    if (watch_stop_) return;
    std::deque<Pending> work;
    work.swap(pending_);
    lock.unlock();

    std::string fatal;
    std::deque<Pending> keep;
    const auto now = Clock::now();
    for (auto& p : work) {
      cudaSetDevice(p.rank->ordinal);
      cudaError_t q = cudaEventQuery(p.end);
      if (q == cudaSuccess) {
        ReleaseEvent(p.rank, p.start);
        ReleaseEvent(p.rank, p.end);
        continue;
      }
      if (q != cudaErrorNotReady) {
        if (fatal.empty()) fatal = JAX_M2N_AT(p.what + ": " + CudaError(q));
        continue;
      }
      if (p.timeout_ms > 0) {
        if (!p.started && cudaEventQuery(p.start) == cudaSuccess) {
          p.started = true;
          p.started_at = now;
        }
        if (p.started && now - p.started_at > std::chrono::milliseconds(p.timeout_ms)) {
          if (fatal.empty()) {
            fatal = JAX_M2N_AT(
                p.what + " did not complete within timeout_ms=" + std::to_string(p.timeout_ms) +
                " of starting on the GPU (a peer never arrived?); the NCCL communicator was "
                "aborted, this call's results are invalid, and every later reshard fails "
                "until _ffi_cuda.finalize() and initialize() are called again");
          }
          continue;
        }
      }
      keep.push_back(std::move(p));
    }
    if (fatal.empty() && now - last_async_check > std::chrono::milliseconds(100)) {
      last_async_check = now;
      for (auto& lr : local_) {
        std::lock_guard<std::mutex> rlock(lr->mu);
        if (lr->comm == nullptr) continue;
        ncclResult_t state = ncclSuccess;
        if (api_->CommGetAsyncError(lr->comm, &state) == ncclSuccess &&
            state != ncclSuccess && state != ncclInProgress) {
          fatal = JAX_M2N_AT("asynchronous NCCL error on device " +
                                std::to_string(lr->device_id) + " (rank " +
                                std::to_string(lr->rank) + "): " +
                                api_->Describe(state, lr->comm));
          break;
        }
      }
    }
    if (!fatal.empty()) {
      AbortAll(fatal);
      keep.clear();  // their events may never complete: leaked on purpose
    }
    lock.lock();
    for (auto& p : keep) pending_.push_front(std::move(p));
    if (!pending_.empty()) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(1));
    }
  }
}

}  // namespace jax_m2n
