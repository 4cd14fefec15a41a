// The in-process transport: a process-wide rendezvous of generations (one per
// execution of a site), per-step barriers with a timeout, and pulls of boxes
// from peers' buffers. The lifetime rule that shapes everything below: a device
// returns only when no peer is copying (or can start copying) from its buffers.
// Each device's call runs on the thread XLA runs its program on (PjRt's pool
// for the eager path's asynchronous programs); nothing here spawns threads.

#include "xla_ffi/cpu_transport.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/box_copy.h"
#include "xla_ffi/nic_emulator.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {
namespace {

namespace ffi = ::xla::ffi;
using Clock = std::chrono::steady_clock;

// One execution of a site: the meeting point of its participants' k-th calls.
// All fields are guarded by `mu`, except `published` entries, which are
// written before barrier 0 and read only after it (ordered by `mu`).
struct Generation {
  std::mutex mu;
  std::condition_variable cv;

  int64_t site = 0;
  int64_t index = 0;  // k

  // Set by the first participant that arrives.
  bool initialized = false;
  int32_t n = 0;
  int64_t n_steps = 0;
  uint64_t fingerprint = 0;
  int64_t first_device = -1;     // who initialized it (for mismatch messages)
  std::vector<int64_t> devices;  // that device's participants

  std::vector<int64_t> reached;  // per participant: last barrier, -1: none
  std::vector<int32_t> count;    // per barrier: participants that reached it
  // Per barrier: when its last participant reached it. With an emulated
  // network, the transfers of step b are posted at released[b] (below).
  std::vector<std::chrono::steady_clock::time_point> released;
  std::vector<char> copying;     // per participant: between barriers
  int32_t copying_count = 0;
  std::vector<const CpuDeviceBuffers*> published;

  bool aborted = false;
  ffi::ErrorCode abort_code = ffi::ErrorCode::kAborted;
  std::string abort_reason;

  // Marks the generation aborted (the first reason wins; it carries the
  // file:line where the abort was decided) and wakes everyone.
  void AbortLocked(const ffi::Error& reason) {
    if (aborted) return;
    aborted = true;
    abort_code = reason.errc().value_or(ffi::ErrorCode::kAborted);
    abort_reason = reason.message();
    cv.notify_all();
  }
};

// The process-wide registry: per site, each device's next generation index and
// the generations some participant has not joined yet.
class Rendezvous {
 public:
  static Rendezvous& Global() {
    static Rendezvous* rendezvous = new Rendezvous();  // never destroyed: calls
    return *rendezvous;  // may still run while the process exits
  }

  // This device's next generation of `site`, created if it is the first to
  // join. `n_participants` < 0: unknown (the entry is dropped once a joiner
  // that knows it has seen all participants join).
  //
  // With `tickets` > 0 the caller names its generation modulo `tickets`
  // (`ticket`, the eager path's ticket operand): generations this device
  // skips to reach it are given up (aborted, naming this device) - their
  // programs failed before the handler ran - so a later execution never joins
  // an earlier call's generation.
  std::shared_ptr<Generation> Join(int64_t site, int64_t device_id,
                                   int64_t n_participants, int64_t tickets = 0,
                                   int64_t ticket = 0) {
    std::vector<std::shared_ptr<Generation>> skipped;
    std::shared_ptr<Generation> generation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Site& s = sites_[site];
      int64_t& next = s.next[device_id];
      while (tickets > 0 && next % tickets != ticket) {
        skipped.push_back(JoinLocked(s, site, next++, n_participants));
      }
      generation = JoinLocked(s, site, next++, n_participants);
    }
    for (const std::shared_ptr<Generation>& g : skipped) {
      std::lock_guard<std::mutex> lock(g->mu);
      g->AbortLocked(JAX_M2N_ERROR(
          kAborted, "device " + std::to_string(device_id) +
                        " did not take part in this generation: its program "
                        "failed before the handler ran (that call's outputs "
                        "carry the cause)"));
    }
    return generation;
  }

  // Gives up generation `index` of `site` for `device_id`, whose program did
  // not reach the handler: consumed now if it is the device's next one, else
  // (earlier generations still to run there) aborted now and skipped by the
  // device's next ticketed join. Nothing if the device has joined it.
  void Abandon(int64_t site, int64_t device_id, int64_t index,
               const ffi::Error& reason) {
    std::shared_ptr<Generation> g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Site& s = sites_[site];
      int64_t& next = s.next[device_id];
      if (next > index) return;
      if (next == index) {
        g = JoinLocked(s, site, next++, -1);
      } else {
        g = EntryLocked(s, site, index).generation;
      }
    }
    std::lock_guard<std::mutex> lock(g->mu);
    g->AbortLocked(ffi::Error(
        reason.errc().value_or(ffi::ErrorCode::kAborted),
        "device " + std::to_string(device_id) +
            " did not take part in this generation: " + reason.message()));
  }

  // Per device: how many generations of `site` it has joined (or abandoned).
  std::vector<int64_t> Joined(int64_t site,
                              const std::vector<int64_t>& device_ids) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> out;
    out.reserve(device_ids.size());
    auto it = sites_.find(site);
    for (int64_t d : device_ids) {
      if (it == sites_.end()) {
        out.push_back(0);
        continue;
      }
      auto n = it->second.next.find(d);
      out.push_back(n == it->second.next.end() ? 0 : n->second);
    }
    return out;
  }

  // Aborts generation `index` of `site` whatever its state: in progress (its
  // participants fail now), partly joined, or not joined by anyone yet among
  // `device_ids` (then whoever joins it later fails at once). A generation that
  // every participant has joined and left is gone: nothing to do.
  void Abort(int64_t site, int64_t index,
             const std::vector<int64_t>& device_ids, const ffi::Error& reason) {
    std::shared_ptr<Generation> g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Site& s = sites_[site];
      auto live = s.live.find(index);
      if (live != s.live.end()) g = live->second.lock();
      if (!g) {
        bool someone_to_come = false;
        for (int64_t d : device_ids) {
          auto n = s.next.find(d);
          if (n == s.next.end() || n->second <= index) someone_to_come = true;
        }
        if (!someone_to_come) return;
        g = EntryLocked(s, site, index).generation;
      }
    }
    std::lock_guard<std::mutex> lock(g->mu);
    g->AbortLocked(reason);
  }

  int64_t Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t total = 0;
    for (const auto& [site, s] : sites_) total += s.pending.size();
    return total;
  }

 private:
  struct Entry {
    std::shared_ptr<Generation> generation;
    int64_t joined = 0;
    int64_t n = -1;
  };
  struct Site {
    std::unordered_map<int64_t, int64_t> next;  // device id -> next index
    std::map<int64_t, Entry> pending;           // index -> generation
    // Every generation some participant may still be in (for Abort); expired
    // entries are dropped as new generations are made.
    std::map<int64_t, std::weak_ptr<Generation>> live;
  };

  // Counts one participant into generation `index` (made if new).
  std::shared_ptr<Generation> JoinLocked(Site& s, int64_t site, int64_t index,
                                         int64_t n_participants) {
    Entry& entry = EntryLocked(s, site, index);
    std::shared_ptr<Generation> generation = entry.generation;
    ++entry.joined;
    if (n_participants > 0) entry.n = n_participants;
    if (entry.n > 0 && entry.joined >= entry.n) s.pending.erase(index);
    return generation;
  }

  // The pending entry of generation `index`, made (with its generation) if new.
  Entry& EntryLocked(Site& s, int64_t site, int64_t index) {
    Entry& entry = s.pending[index];
    if (!entry.generation) {
      entry.generation = std::make_shared<Generation>();
      entry.generation->site = site;
      entry.generation->index = index;
      for (auto it = s.live.begin(); it != s.live.end();) {
        it = it->second.expired() ? s.live.erase(it) : std::next(it);
      }
      s.live[index] = entry.generation;
    }
    return entry;
  }

  std::mutex mu_;
  std::unordered_map<int64_t, Site> sites_;
};

int64_t ElementCount(ffi::Span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// The test gate (HoldCpuDevices): devices whose handlers wait before joining.
std::mutex& HoldMutex() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::condition_variable& HoldCv() {
  static std::condition_variable* cv = new std::condition_variable();
  return *cv;
}
std::vector<int64_t>& HeldDevices() {
  static std::vector<int64_t>* held = new std::vector<int64_t>();
  return *held;
}
void WaitWhileHeld(int64_t device) {
  std::unique_lock<std::mutex> lock(HoldMutex());
  HoldCv().wait(lock, [device] {
    const auto& held = HeldDevices();
    return std::find(held.begin(), held.end(), device) == held.end();
  });
}

std::string Where(const Generation& g, int64_t device) {
  return "jax_m2n_reshard (cpu) on device " + std::to_string(device) +
         ", site " + std::to_string(g.site) + ", generation " +
         std::to_string(g.index);
}

// "before step 2" / "after the last step (1)".
std::string BarrierName(int64_t barrier, int64_t n_steps) {
  if (barrier < n_steps) {
    return barrier == 0 ? "step 0 (arrival, before step 0)"
                        : "step " + std::to_string(barrier) + " (after step " +
                              std::to_string(barrier - 1) + ")";
  }
  return "the end (after the last step, " + std::to_string(n_steps - 1) + ")";
}

// One device's part of one generation.
class Participant {
 public:
  Participant(const CpuCall& call, const CpuDeviceBuffers& buffers,
              std::shared_ptr<Generation> generation)
      : call_(call),
        schedule_(*call.schedule),
        buffers_(buffers),
        g_(std::move(generation)),
        p_(call.participant),
        device_(schedule_.devices[p_]) {}

  ffi::Error Run() {
    std::unique_lock<std::mutex> lock(g_->mu);
    if (g_->aborted) {
      // A late arriver: its peers have given up (and may be gone). Publish
      // nothing, copy nothing.
      return AddContext(
          JAX_M2N_ERROR(kAborted,
                        "arrived after the generation was aborted; nothing "
                        "was copied. Reason: " +
                            g_->abort_reason),
          Where(*g_, device_));
    }
    if (!g_->initialized) Initialize();
    if (g_->fingerprint != schedule_.fingerprint ||
        g_->n != static_cast<int32_t>(schedule_.devices.size())) {
      ffi::Error reason = JAX_M2N_ERROR(
          kFailedPrecondition,
          "participants must run the same schedule under one site; device " +
              std::to_string(device_) + " has devices " +
              FormatList(schedule_.devices) + " (fingerprint " +
              std::to_string(schedule_.fingerprint) + "), device " +
              std::to_string(g_->first_device) + " has devices " +
              FormatList(g_->devices) + " (fingerprint " +
              std::to_string(g_->fingerprint) +
              "). Use one site per reshard plan");
      g_->AbortLocked(reason);
      return AddContext(reason, Where(*g_, device_));
    }
    g_->published[p_] = &buffers_;

    const std::vector<int32_t>& mine = schedule_.ops_by_dst[p_];
    size_t cursor = 0;
    for (int64_t step = 0;; ++step) {
      if (ffi::Error error = Barrier(lock, step); error.failure()) {
        return error;
      }
      if (step == schedule_.n_steps) return ffi::Error::Success();
      // The emulated NICs see this step's transfers posted when its barrier
      // released, not when this thread got a core: waking 8 device threads on
      // 2 cores is the emulator's cost, not the network's.
      const Clock::time_point posted = g_->released[step];
      // Copy this step's ops, without the lock: peers copy concurrently.
      lock.unlock();
      ffi::Error error = ffi::Error::Success();
      Clock::time_point arrival = Clock::time_point::min();
      for (; cursor < mine.size() && schedule_.ops[mine[cursor]].step == step;
           ++cursor) {
        error = Copy(mine[cursor], posted, &arrival);
        if (error.failure()) break;
      }
      lock.lock();
      if (error.success() && arrival > Clock::now()) {
        // Emulated network: the bytes are here, the modelled NIC is not done.
        // Sleep (no CPU) until it is, or until the generation is aborted.
        g_->cv.wait_until(lock, arrival, [this] { return g_->aborted; });
      }
      if (error.failure()) {
        StopCopying();
        g_->AbortLocked(ffi::Error(
            error.errc().value_or(ffi::ErrorCode::kInternal),
            "device " + std::to_string(device_) + " failed in step " +
                std::to_string(step) + ": " + error.message()));
        return Fail(lock);
      }
    }
  }

 private:
  void Initialize() {
    const int32_t n = static_cast<int32_t>(schedule_.devices.size());
    g_->initialized = true;
    g_->n = n;
    g_->n_steps = schedule_.n_steps;
    g_->fingerprint = schedule_.fingerprint;
    g_->first_device = device_;
    g_->devices = schedule_.devices;
    g_->reached.assign(n, -1);
    g_->count.assign(schedule_.n_steps + 1, 0);
    g_->released.assign(schedule_.n_steps + 1, Clock::time_point::min());
    g_->copying.assign(n, 0);
    g_->published.assign(n, nullptr);
  }

  void StopCopying() {
    if (g_->copying[p_]) {
      g_->copying[p_] = 0;
      if (--g_->copying_count == 0 && g_->aborted) g_->cv.notify_all();
    }
  }

  // Waits (holding `lock`) until no participant copies any more, then returns
  // the generation's abort reason. After an abort nobody starts copying, so
  // this wait is bounded by the copies in flight.
  ffi::Error Fail(std::unique_lock<std::mutex>& lock) {
    g_->cv.wait(lock, [this] { return g_->copying_count == 0; });
    return ffi::Error(g_->abort_code,
                      Where(*g_, device_) + ": " + g_->abort_reason);
  }

  // Barrier `b` precedes step b; barrier n_steps follows the last step.
  ffi::Error Barrier(std::unique_lock<std::mutex>& lock, int64_t b) {
    StopCopying();
    if (g_->aborted) return Fail(lock);
    g_->reached[p_] = b;
    if (++g_->count[b] == g_->n) {
      g_->released[b] = Clock::now();
      g_->cv.notify_all();
    }
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(call_.timeout_ms);
    while (true) {
      // Aborted first: a device woken for barrier b after a later abort must
      // not start copying from peers that are leaving.
      if (g_->aborted) return Fail(lock);
      if (g_->count[b] == g_->n) break;
      if (g_->cv.wait_until(lock, deadline) == std::cv_status::timeout &&
          !g_->aborted && g_->count[b] < g_->n) {
        std::vector<int64_t> missing;
        for (int32_t q = 0; q < g_->n; ++q) {
          if (g_->reached[q] < b) missing.push_back(schedule_.devices[q]);
        }
        g_->AbortLocked(JAX_M2N_ERROR(
            kDeadlineExceeded,
            "timed out after " + std::to_string(call_.timeout_ms) + " ms at " +
                BarrierName(b, g_->n_steps) + " of " +
                std::to_string(g_->n_steps) + " steps: devices " +
                FormatList(missing) + " did not arrive (participants " +
                FormatList(schedule_.devices) + ")"));
        return Fail(lock);
      }
    }
    if (b < g_->n_steps) {
      g_->copying[p_] = 1;
      ++g_->copying_count;
    }
    return ffi::Error::Success();
  }

  // Resolves one end of an op to (base pointer, dims) in a device's buffers,
  // checking the box against a peer's (this device's own were checked by
  // CheckDeviceBuffers before the transport ran: RunCpuTransport's precondition).
  ffi::Error Resolve(int32_t op_index, bool src_side,
                     const CpuDeviceBuffers& buffers, CpuBuffer* view) const {
    const Op& op = schedule_.ops[op_index];
    const OpEnd& end = src_side ? op.src : op.dst;
    const TensorSpec& spec = schedule_.tensors[op.tensor];
    switch (end.kind) {
      case BufferKind::kOperand:
      case BufferKind::kResult: {
        const std::vector<CpuBuffer>& list = end.kind == BufferKind::kOperand
                                                 ? buffers.operands
                                                 : buffers.results;
        if (end.slot >= static_cast<int64_t>(list.size())) {
          return JAX_M2N_ERROR(kInvalidArgument,
                               "op " + std::to_string(op_index) + ": " +
                                   BufferKindName(end.kind) + " " +
                                   std::to_string(end.slot) + " of device " +
                                   std::to_string(end.device) +
                                   " does not exist (it has " +
                                   std::to_string(list.size()) + ")");
        }
        *view = list[end.slot];
        break;
      }
      case BufferKind::kWorkspace:
        if (end.slot + spec.bytes > buffers.workspace_bytes) {
          return JAX_M2N_ERROR(
              kInvalidArgument,
              "op " + std::to_string(op_index) + ": workspace bytes [" +
                  std::to_string(end.slot) + ", " +
                  std::to_string(end.slot + spec.bytes) + ") of device " +
                  std::to_string(end.device) + " exceed its workspace of " +
                  std::to_string(buffers.workspace_bytes) + " bytes");
        }
        view->data = buffers.workspace + end.slot;
        view->dims = ffi::Span<const int64_t>(spec.dims.data(), spec.rank);
        view->elem_bytes = spec.elem_bytes;
        break;
    }
    if (end.participant == p_) return ffi::Error::Success();
    return CheckOpEnd(schedule_, op_index, src_side,
                      BufferShape{view->dims, view->elem_bytes});
  }

  // Copies one op; with an emulated network, a cross-domain op also reserves
  // the NIC queues for op.bytes (wire bytes: the narrower type of a
  // conversion) and raises `*arrival` to the time its last byte arrives.
  ffi::Error Copy(int32_t op_index, Clock::time_point posted,
                  Clock::time_point* arrival) const {
    const Op& op = schedule_.ops[op_index];
    if (op.bytes == 0) return ffi::Error::Success();
    if (call_.network != nullptr &&
        call_.network->Crosses(op.src.participant, op.dst.participant)) {
      *arrival = std::max(*arrival, NicEmulator::Global().Reserve(
                                        op.src.device, op.dst.device, op.bytes,
                                        posted, *call_.network));
    }
    CpuBuffer src, dst;
    if (ffi::Error e = Resolve(op_index, /*src_side=*/true,
                               *g_->published[op.src.participant], &src);
        e.failure()) {
      return e;
    }
    if (ffi::Error e = Resolve(op_index, /*src_side=*/false, buffers_, &dst);
        e.failure()) {
      return e;
    }
    const TensorSpec& spec = schedule_.tensors[op.tensor];
    const ConstBoxRef from{src.data, src.dims.begin(), op.src.start};
    const BoxRef to{dst.data, dst.dims.begin(), op.dst.start};
    // A converting tensor: one pass from the source buffer's type to the
    // destination's (the wire type only ever sits in the workspace).
    const ElemType src_type = TypeOf(spec, op.src.kind);
    const ElemType dst_type = TypeOf(spec, op.dst.kind);
    if (src_type != dst_type) {
      ConvertBox(from, to, op.extent, spec.rank, src_type, dst_type);
    } else {
      CopyBox(from, to, op.extent, spec.rank, src.elem_bytes);
    }
    return ffi::Error::Success();
  }

  const CpuCall& call_;
  const Schedule& schedule_;
  const CpuDeviceBuffers& buffers_;
  std::shared_ptr<Generation> g_;
  const int32_t p_;
  const int64_t device_;
};

}  // namespace

ffi::Error RunCpuTransport(const CpuCall& call,
                           const CpuDeviceBuffers& buffers) {
  const Schedule& schedule = *call.schedule;
  const int64_t device = schedule.devices[call.participant];
  // Before anyone writes them: huge pages for large fresh destinations.
  if (!schedule.ops_by_dst[call.participant].empty()) {
    for (const CpuBuffer& result : buffers.results) {
      AdviseHugePages(result.data,
                      result.elem_bytes * ElementCount(result.dims));
    }
    AdviseHugePages(buffers.workspace, buffers.workspace_bytes);
  }
  WaitWhileHeld(device);
  std::shared_ptr<Generation> generation = Rendezvous::Global().Join(
      call.site, device, static_cast<int64_t>(schedule.devices.size()),
      call.tickets, call.ticket);
  return Participant(call, buffers, std::move(generation)).Run();
}

void AbortNextCpuGeneration(int64_t site, int64_t device_id,
                            int64_t n_participants, const ffi::Error& reason,
                            int64_t tickets, int64_t ticket) {
  std::shared_ptr<Generation> g = Rendezvous::Global().Join(
      site, device_id, n_participants, tickets, ticket);
  std::lock_guard<std::mutex> lock(g->mu);
  g->AbortLocked(ffi::Error(
      reason.errc().value_or(ffi::ErrorCode::kAborted),
      "device " + std::to_string(device_id) +
          " did not take part in this generation: " + reason.message()));
}

std::vector<int64_t> JoinedCpuGenerations(
    int64_t site, const std::vector<int64_t>& device_ids) {
  return Rendezvous::Global().Joined(site, device_ids);
}

void AbortCpuGeneration(int64_t site, int64_t index,
                        const std::vector<int64_t>& device_ids,
                        const ffi::Error& reason) {
  Rendezvous::Global().Abort(site, index, device_ids, reason);
}

void AbandonCpuGeneration(int64_t site, int64_t device_id, int64_t index,
                          const ffi::Error& reason) {
  Rendezvous::Global().Abandon(site, device_id, index, reason);
}

int64_t PendingCpuGenerations() { return Rendezvous::Global().Pending(); }

void HoldCpuDevices(const std::vector<int64_t>& device_ids, bool hold) {
  std::lock_guard<std::mutex> lock(HoldMutex());
  for (int64_t d : device_ids) {
    if (hold) {
      HeldDevices().push_back(d);
    } else {
      auto& held = HeldDevices();
      held.erase(std::remove(held.begin(), held.end(), d), held.end());
    }
  }
  HoldCv().notify_all();
}

}  // namespace jax_m2n
