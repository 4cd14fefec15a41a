// The direct peer path (docs/cuda_transport.md, "Peer path"): the host rendezvous of one
// reshard's per-device calls, the plan of the whole round (every op of every participant,
// with the engine that moves it and the stream that issues it), and its enqueueing with
// cross-device event waits. Never waits for the GPU.

#include "xla_ffi/cuda/peer_transport.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla_ffi/cuda/box_geometry.h"
#include "xla_ffi/cuda/pack.h"

namespace jax_m2n {

namespace ffi = ::xla::ffi;

namespace {

using Clock = std::chrono::steady_clock;

// Strided cross-device boxes whose contiguous run is at least this long go to the copy
// engine (cudaMemcpy3DPeerAsync); shorter runs go to the copy kernel reading the peer's
// memory over NVLink (a DMA descriptor per short row is slow).
constexpr int64_t kMinDmaRowBytes = 512;
constexpr int64_t kMaxDmaPitch = (int64_t{1} << 31) - 1;

// Streams ("lanes") a participant's work is issued on: the XLA stream of its call carries
// the cross-device copy-engine copies; two streams of our own per GPU carry the local
// copies (memcpy or kernel) and the cross-device copy kernels, so that they overlap the
// peer copies of the same step (and a GPU's copy engines keep both NVLink directions
// busy while its SMs pack).
constexpr int kLanes = 3;
constexpr int kDmaLane = 0;
constexpr int kLocalLane = 1;
constexpr int kKernelLane = 2;

// Copy-engine copies of one stream in one step may be spread over several streams of the
// issuing GPU (the XLA stream plus side streams), so that one copy's drain overlaps the
// next one's start. Measured on the 291-leaf Llama-shaped pytree (2026-11-30, 2 x H200):
// 18.4 ms with 4 streams, 18.0 ms with 1 - no gain, so 1 by default;
// JAX_M2N_CUDA_DMA_STREAMS (1-8, read once per plan) is the measurement knob.
constexpr int kDefaultDmaStreams = 1;
constexpr int kMaxDmaStreams = 8;
constexpr int kFirstDmaSideLane = kLanes;  // SideLane ids kLanes.. are the extra DMA streams

int DmaStreams() {
  const char* v = std::getenv("JAX_M2N_CUDA_DMA_STREAMS");
  if (v == nullptr) return kDefaultDmaStreams;
  const int n = std::atoi(v);
  return n < 1 ? 1 : (n > kMaxDmaStreams ? kMaxDmaStreams : n);
}

// Which side issues a cross-device op: the source ("push", the default: the copy engine or
// kernel of the GPU that holds the bytes writes into the peer's memory, as torch's copy_
// does) or the destination ("pull"). JAX_M2N_CUDA_PEER_ISSUE=dst selects pull (read once
// per plan; a measurement knob, docs/cuda_transport.md).
bool PushFromSource() {
  const char* v = std::getenv("JAX_M2N_CUDA_PEER_ISSUE");
  return v == nullptr || std::string(v) != "dst";
}

std::atomic<int> g_engine{static_cast<int>(CudaEngine::kAuto)};

struct Counters {
  std::atomic<int64_t> rounds{0}, memcpys{0}, memcpys_3d{0}, kernel_tasks{0}, converts{0},
      plans{0};
};
Counters& Stats() {
  static Counters* c = new Counters();
  return *c;
}

class ScopedDevice {
 public:
  ScopedDevice() { had_ = cudaGetDevice(&saved_) == cudaSuccess; }
  ~ScopedDevice() {
    int now = -1;
    if (had_ && (cudaGetDevice(&now) != cudaSuccess || now != saved_)) cudaSetDevice(saved_);
  }

 private:
  int saved_ = 0;
  bool had_ = false;
};

// Peer access between local GPUs: probed and enabled once per ordered pair.
std::mutex g_peer_mu;
std::map<std::pair<int, int>, bool> g_peer_ok;

bool EnsurePeerAccess(int from, int to) {
  if (from == to) return true;
  std::lock_guard<std::mutex> lock(g_peer_mu);
  auto it = g_peer_ok.find({from, to});
  if (it != g_peer_ok.end()) return it->second;
  ScopedDevice restore;
  int can = 0;
  bool ok = cudaDeviceCanAccessPeer(&can, from, to) == cudaSuccess && can;
  if (ok && cudaSetDevice(from) == cudaSuccess) {
    cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // clear the sticky-for-this-thread error state
      e = cudaSuccess;
    }
    ok = e == cudaSuccess;
  } else {
    ok = false;
  }
  g_peer_ok[{from, to}] = ok;
  return ok;
}

// The side lanes of a GPU: one stream per (ordinal, lane), made once, never destroyed.
std::mutex g_lane_mu;
std::map<std::pair<int, int>, cudaStream_t> g_side_lanes;

cudaError_t SideLane(int ordinal, int lane, cudaStream_t* out) {
  std::lock_guard<std::mutex> lock(g_lane_mu);
  auto it = g_side_lanes.find({ordinal, lane});
  if (it != g_side_lanes.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  ScopedDevice restore;
  cudaError_t e = cudaSetDevice(ordinal);
  cudaStream_t s = nullptr;
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = PreloadCopyKernels();
  if (e != cudaSuccess) return e;
  g_side_lanes[{ordinal, lane}] = s;
  *out = s;
  return cudaSuccess;
}

// Bytes of one side of an op: a buffer of one participant plus an offset.
struct PeerRef {
  int32_t participant = 0;
  BufferKind kind = BufferKind::kOperand;
  int32_t slot = 0;
  int64_t offset = 0;
};

enum class How : int8_t { kMemcpy, kMemcpy3d, kKernel };

struct PeerOp {
  How how = How::kMemcpy;
  PeerRef src, dst;
  int64_t bytes = 0;
  Geometry g;     // offsets folded into src/dst
  ElemType src_type = ElemType::kNone, dst_type = ElemType::kNone;  // differ: converts
  int64_t step = 0;
  int32_t issuer = 0;  // participant * kLanes + lane whose stream issues it
  std::string label;  // for errors
};

// The work one stream does in one step, and the participants whose buffers it touches.
struct LaneWork {
  int32_t issuer = 0;  // participant * kLanes + lane
  std::vector<int32_t> touches;
  std::vector<const PeerOp*> dma, kernels;
  // dma[i] goes to stream dma_stream[i]: 0 = the lane's own, k > 0 = extra DMA stream k
  // (forked from the lane's stream by `fork`, joined back by joins[k - 1]).
  std::vector<int8_t> dma_stream;
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> joins;
  cudaEvent_t done = nullptr;
};

struct PeerStep {
  int64_t step = 0;
  std::vector<LaneWork> work;
  std::vector<int32_t> touched;  // participants touched by any lane in this step
};

struct PeerPlan {
  std::vector<int64_t> signature;  // shapes of every participant's buffers + generation
  std::vector<int> ordinal;        // per participant
  std::vector<std::vector<cudaStream_t>> lanes;  // per participant; [kDmaLane] unused
  std::vector<std::vector<cudaStream_t>> dma_extra;  // per participant: extra DMA streams
  std::vector<cudaEvent_t> start;  // per participant, on its XLA stream
  std::vector<PeerOp> ops;
  std::vector<PeerStep> steps;
  int64_t n_memcpy = 0, n_memcpy_3d = 0, n_kernel = 0, n_convert = 0;

  ~PeerPlan() {
    // Pending waits on these events stay valid: CUDA releases them once they complete.
    for (cudaEvent_t e : start) cudaEventDestroy(e);
    for (auto& st : steps) {
      for (auto& w : st.work) {
        cudaEventDestroy(w.done);
        if (w.fork != nullptr) cudaEventDestroy(w.fork);
        for (cudaEvent_t e : w.joins) cudaEventDestroy(e);
      }
    }
  }
};

int64_t Elements(ffi::Span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::vector<int64_t> SignatureOf(const std::vector<const PeerCall*>& calls, uint64_t gen) {
  std::vector<int64_t> sig;
  sig.push_back(static_cast<int64_t>(gen));
  for (const PeerCall* c : calls) {
    sig.push_back(-1);
    for (const auto& b : c->shapes->operands) sig.push_back(Elements(b.dims));
    sig.push_back(-2);
    for (const auto& b : c->shapes->results) sig.push_back(Elements(b.dims));
    sig.push_back(c->shapes->workspace_bytes);
  }
  return sig;
}

ffi::Span<const int64_t> DimsOfEnd(const PeerCall& c, const Op& op, const OpEnd& end) {
  return BufferDims(*c.schedule, *c.shapes, op, end);
}

PeerRef RefOf(int32_t participant, const OpEnd& end, int64_t offset) {
  PeerRef r;
  r.participant = participant;
  r.kind = end.kind;
  if (end.kind == BufferKind::kWorkspace) {
    r.offset = end.slot + offset;
  } else {
    r.slot = static_cast<int32_t>(end.slot);
    r.offset = offset;
  }
  return r;
}

bool FitsDma3d(const Geometry& g) {
  if (g.n_outer < 1 || g.n_outer > 2 || g.row_bytes < kMinDmaRowBytes) return false;
  if (g.src_stride[0] > kMaxDmaPitch || g.dst_stride[0] > kMaxDmaPitch) return false;
  if (g.n_outer == 2 &&
      (g.src_stride[1] % g.src_stride[0] != 0 || g.dst_stride[1] % g.dst_stride[0] != 0)) {
    return false;
  }
  return true;
}

// Copy-engine copies that continue one another - the chunks of one transfer: operand ->
// result, same buffers on both sides, adjacent bytes (contiguous copies) or adjacent rows
// of the same pitches (2-D copies) - become one copy in the step of the first, unless some op of the round reads that result (a leader forwarding chunks as they
// arrive). Safe to move earlier: an operand is ready at the start and never written, and
// nothing else writes those result bytes. `ops` sorted by step.
void MergeChunkCopies(std::vector<PeerOp>* ops) {
  std::set<std::pair<int32_t, int32_t>> read;  // (participant, result slot) some op reads
  for (const PeerOp& o : *ops) {
    if (o.src.kind == BufferKind::kResult) read.insert({o.src.participant, o.src.slot});
  }
  std::map<std::array<int32_t, 4>, size_t> tail;  // buffers -> the copy to extend
  std::vector<PeerOp> out;
  out.reserve(ops->size());
  for (PeerOp& o : *ops) {
    const bool flat = o.how == How::kMemcpy;
    const bool rows = o.how == How::kMemcpy3d && o.g.n_outer == 1;  // 2-D: rows continue
    if ((flat || rows) && o.src_type == o.dst_type && o.src.kind == BufferKind::kOperand &&
        o.dst.kind == BufferKind::kResult && read.count({o.dst.participant, o.dst.slot}) == 0) {
      const std::array<int32_t, 4> key = {o.src.participant, o.src.slot, o.dst.participant,
                                          o.dst.slot};
      auto it = tail.find(key);
      if (it != tail.end()) {
        PeerOp& t = out[it->second];
        if (flat && t.how == How::kMemcpy && t.src.offset + t.bytes == o.src.offset &&
            t.dst.offset + t.bytes == o.dst.offset) {
          t.bytes += o.bytes;
          t.g.row_bytes += o.g.row_bytes;
          t.g.row_elems += o.g.row_elems;
          continue;
        }
        if (rows && t.how == How::kMemcpy3d && t.g.n_outer == 1 &&
            t.g.row_bytes == o.g.row_bytes && t.g.src_stride[0] == o.g.src_stride[0] &&
            t.g.dst_stride[0] == o.g.dst_stride[0] &&
            t.src.offset + t.g.extent[0] * t.g.src_stride[0] == o.src.offset &&
            t.dst.offset + t.g.extent[0] * t.g.dst_stride[0] == o.dst.offset) {
          t.bytes += o.bytes;
          t.g.extent[0] += o.g.extent[0];
          continue;
        }
      }
      tail[key] = out.size();
    }
    out.push_back(std::move(o));
  }
  *ops = std::move(out);
}

ffi::ErrorOr<std::unique_ptr<PeerPlan>> BuildPeerPlan(const std::vector<const PeerCall*>& calls,
                                                      const Communicator& comm) {
  const Schedule& s0 = *calls[0]->schedule;
  const int32_t n = static_cast<int32_t>(calls.size());
  auto plan = std::make_unique<PeerPlan>();
  plan->signature = SignatureOf(calls, comm.generation());
  ScopedDevice restore;
  for (int32_t p = 0; p < n; ++p) {
    const PeerCall& c = *calls[p];
    if (ffi::Error e = CheckDeviceBuffers(*c.schedule, p, *c.shapes); e.failure()) {
      return ffi::Unexpected(e);
    }
    plan->ordinal.push_back(c.ordinal);
    std::vector<cudaStream_t> lanes(kLanes, nullptr);
    cudaError_t err = cudaSuccess;
    for (int lane = 1; lane < kLanes && err == cudaSuccess; ++lane) {
      err = SideLane(c.ordinal, lane, &lanes[lane]);
    }
    cudaEvent_t ev = nullptr;
    if (err == cudaSuccess) err = cudaSetDevice(c.ordinal);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      return ffi::Unexpected(JAX_M2N_ERROR(
          kInternal, "peer path: stream/event on device " +
                         std::to_string(s0.devices[p]) + ": " + CudaError(err)));
    }
    plan->lanes.push_back(std::move(lanes));
    plan->dma_extra.emplace_back();
    plan->start.push_back(ev);
  }
  const bool push = PushFromSource();
  // Every op once: from its destination's encoding (each encoding lists the ops that
  // touch its device; the SPMD encoding lists all).
  for (int32_t p = 0; p < n; ++p) {
    const PeerCall& c = *calls[p];
    const Schedule& s = *c.schedule;
    for (int32_t index : s.ops_by_dst[p]) {
      const Op& op = s.ops[index];
      if (op.bytes == 0) continue;
      const int32_t a = op.src.participant;
      if (a < 0 || a >= n) {
        return ffi::Unexpected(JAX_M2N_ERROR(kInternal, OpLabel(s, index) + ": bad participant"));
      }
      const TensorSpec& t = s.tensors[op.tensor];
      ffi::Span<const int64_t> sd = DimsOfEnd(*calls[a], op, op.src);
      ffi::Span<const int64_t> dd = DimsOfEnd(c, op, op.dst);
      PeerOp o;
      o.src_type = TypeOf(t, op.src.kind);
      o.dst_type = TypeOf(t, op.dst.kind);
      o.g = Collapse(sd.begin(), op.src.start, dd.begin(), op.dst.start,
                     op.extent, t.rank, ElemBytesOf(t, op.src.kind),
                     ElemBytesOf(t, op.dst.kind));
      o.src = RefOf(a, op.src, o.g.src_offset);
      o.dst = RefOf(p, op.dst, o.g.dst_offset);
      o.bytes = op.bytes;
      o.step = op.step;
      o.label = OpLabel(s, index);
      // Which GPU issues a cross-device op. A converting op is a kernel on the side that
      // keeps the wire type on NVLink: the source narrows and stores into the peer
      // (destination holds the wire type), the destination widens what it loads from the
      // peer (source holds the wire type). Others follow PushFromSource().
      const bool converts = o.src_type != o.dst_type;
      const bool from_src = converts ? o.dst_type == t.wire_type : push;
      if (converts) {
        o.how = How::kKernel;
      } else if (o.g.n_outer == 0) {
        o.how = How::kMemcpy;
      } else if (a != p && FitsDma3d(o.g)) {
        o.how = How::kMemcpy3d;
      } else {
        o.how = How::kKernel;
      }
      if (o.how == How::kKernel && a != p) {
        const int runs_on = from_src ? calls[a]->ordinal : calls[p]->ordinal;
        const int other = from_src ? calls[p]->ordinal : calls[a]->ordinal;
        if (!EnsurePeerAccess(runs_on, other)) {
          return ffi::Unexpected(JAX_M2N_ERROR(
              kFailedPrecondition, o.label + ": peer access from GPU " +
                                       std::to_string(runs_on) + " to GPU " +
                                       std::to_string(other) + " is unavailable"));
        }
      }
      if (a == p) {
        o.issuer = p * kLanes + kLocalLane;
      } else {
        o.issuer =
            (from_src ? a : p) * kLanes + (o.how == How::kKernel ? kKernelLane : kDmaLane);
      }
      if (converts) ++plan->n_convert;
      plan->ops.push_back(std::move(o));
    }
  }
  std::stable_sort(plan->ops.begin(), plan->ops.end(),
                   [](const PeerOp& x, const PeerOp& y) { return x.step < y.step; });
  MergeChunkCopies(&plan->ops);
  const int dma_streams = DmaStreams();
  for (size_t i = 0; i < plan->ops.size();) {
    PeerStep st;
    st.step = plan->ops[i].step;
    std::map<int32_t, LaneWork> by_issuer;
    for (; i < plan->ops.size() && plan->ops[i].step == st.step; ++i) {
      const PeerOp& o = plan->ops[i];
      LaneWork& w = by_issuer[o.issuer];
      w.issuer = o.issuer;
      (o.how == How::kKernel ? w.kernels : w.dma).push_back(&o);
      for (int32_t d : {o.src.participant, o.dst.participant}) {
        if (std::find(w.touches.begin(), w.touches.end(), d) == w.touches.end()) {
          w.touches.push_back(d);
        }
        if (std::find(st.touched.begin(), st.touched.end(), d) == st.touched.end()) {
          st.touched.push_back(d);
        }
      }
      if (o.how == How::kMemcpy) ++plan->n_memcpy;
      if (o.how == How::kMemcpy3d) ++plan->n_memcpy_3d;
      if (o.how == How::kKernel) ++plan->n_kernel;
    }
    for (auto& [issuer, w] : by_issuer) {
      const int32_t p = issuer / kLanes;
      cudaError_t err = cudaSetDevice(plan->ordinal[p]);
      if (err == cudaSuccess) err = cudaEventCreateWithFlags(&w.done, cudaEventDisableTiming);
      // Several cross-device copy-engine copies: spread over the extra DMA streams, least
      // bytes first (local copies keep their one lane: they overlap the peer copies).
      const int k = issuer % kLanes != kDmaLane
                        ? 1
                        : std::min<int>(dma_streams, static_cast<int>(w.dma.size()));
      if (err == cudaSuccess && k > 1) {
        std::vector<int64_t> load(k, 0);
        for (const PeerOp* o : w.dma) {
          const int least =
              static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
          w.dma_stream.push_back(static_cast<int8_t>(least));
          load[least] += o->bytes;
        }
        err = cudaEventCreateWithFlags(&w.fork, cudaEventDisableTiming);
        for (int j = 1; j < k && err == cudaSuccess; ++j) {
          cudaEvent_t e = nullptr;
          err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
          if (err == cudaSuccess) w.joins.push_back(e);
        }
        std::vector<cudaStream_t>& extra = plan->dma_extra[p];
        while (err == cudaSuccess && static_cast<int>(extra.size()) < k - 1) {
          cudaStream_t sx = nullptr;
          err = SideLane(plan->ordinal[p], kFirstDmaSideLane + static_cast<int>(extra.size()),
                         &sx);
          if (err == cudaSuccess) extra.push_back(sx);
        }
        if (err == cudaSuccess) err = cudaSetDevice(plan->ordinal[p]);
      }
      if (err != cudaSuccess) {
        return ffi::Unexpected(JAX_M2N_ERROR(kInternal, "peer path: cudaEventCreate: " +
                                                            CudaError(err)));
      }
      st.work.push_back(std::move(w));
    }
    plan->steps.push_back(std::move(st));
  }
  Stats().plans.fetch_add(1, std::memory_order_relaxed);
  return plan;
}

char* BaseOf(const PeerRef& r, const std::vector<const PeerCall*>& calls) {
  return BufferBase(*calls[r.participant]->buffers, r.kind, r.slot);
}

// Enqueues a whole round. `calls` by participant; every call waits while this runs.
ffi::Error EnqueueRound(const PeerPlan& plan, const std::vector<const PeerCall*>& calls) {
  ScopedDevice restore;
  const int32_t n = static_cast<int32_t>(calls.size());
  auto stream_of = [&](int32_t issuer) {
    const int32_t p = issuer / kLanes;
    return issuer % kLanes == kDmaLane ? calls[p]->stream : plan.lanes[p][issuer % kLanes];
  };
  auto fail = [&](const std::string& what, cudaError_t err) {
    return JAX_M2N_ERROR(kInternal, "peer path: " + what + ": " + CudaError(err));
  };
  // last[d]: the (issuer, event) pairs after which every earlier access to d's buffers
  // is complete (initially: d's XLA stream at the start of the call).
  std::vector<std::vector<std::pair<int32_t, cudaEvent_t>>> last(n);
  for (int32_t p = 0; p < n; ++p) {
    cudaError_t err = cudaSetDevice(plan.ordinal[p]);
    if (err == cudaSuccess) err = cudaEventRecord(plan.start[p], calls[p]->stream);
    if (err != cudaSuccess) return fail("cudaEventRecord(start) on GPU " +
                                        std::to_string(plan.ordinal[p]), err);
    last[p] = {{p * kLanes + kDmaLane, plan.start[p]}};
  }
  thread_local std::vector<CopyTask> tasks;
  std::vector<cudaEvent_t> waits;
  for (const PeerStep& st : plan.steps) {
    for (const LaneWork& w : st.work) {
      const int32_t p = w.issuer / kLanes;
      cudaStream_t stream = stream_of(w.issuer);
      cudaError_t err = cudaSetDevice(plan.ordinal[p]);
      if (err != cudaSuccess) return fail("cudaSetDevice", err);
      waits.clear();
      for (int32_t d : w.touches) {
        for (const auto& [issuer, ev] : last[d]) {
          if (issuer != w.issuer && std::find(waits.begin(), waits.end(), ev) == waits.end()) {
            waits.push_back(ev);
          }
        }
      }
      for (cudaEvent_t ev : waits) {
        err = cudaStreamWaitEvent(stream, ev, 0);
        if (err != cudaSuccess) return fail("cudaStreamWaitEvent", err);
      }
      if (w.fork != nullptr) {  // fork the extra DMA streams off this one
        err = cudaEventRecord(w.fork, stream);
        for (size_t j = 0; j < w.joins.size() && err == cudaSuccess; ++j) {
          err = cudaStreamWaitEvent(plan.dma_extra[p][j], w.fork, 0);
        }
        if (err != cudaSuccess) return fail("fork of the DMA streams", err);
      }
      for (size_t i = 0; i < w.dma.size(); ++i) {
        const PeerOp* o = w.dma[i];
        const cudaStream_t dma_stream =
            w.dma_stream.empty() || w.dma_stream[i] == 0 ? stream
                                                          : plan.dma_extra[p][w.dma_stream[i] - 1];
        const char* src = BaseOf(o->src, calls) + o->src.offset;
        char* dst = BaseOf(o->dst, calls) + o->dst.offset;
        const int so = plan.ordinal[o->src.participant], dso = plan.ordinal[o->dst.participant];
        if (o->how == How::kMemcpy) {
          err = so == dso ? cudaMemcpyAsync(dst, src, o->bytes, cudaMemcpyDeviceToDevice,
                                            dma_stream)
                          : cudaMemcpyPeerAsync(dst, dso, src, so, o->bytes, dma_stream);
        } else {
          const Geometry& g = o->g;
          cudaMemcpy3DPeerParms m = {};
          const size_t rows = static_cast<size_t>(g.extent[0]);
          const size_t depth = g.n_outer == 2 ? static_cast<size_t>(g.extent[1]) : 1;
          const size_t src_ys =
              g.n_outer == 2 ? static_cast<size_t>(g.src_stride[1] / g.src_stride[0]) : rows;
          const size_t dst_ys =
              g.n_outer == 2 ? static_cast<size_t>(g.dst_stride[1] / g.dst_stride[0]) : rows;
          m.srcPtr = make_cudaPitchedPtr(const_cast<char*>(src), g.src_stride[0], g.row_bytes,
                                         src_ys);
          m.dstPtr = make_cudaPitchedPtr(dst, g.dst_stride[0], g.row_bytes, dst_ys);
          m.srcDevice = so;
          m.dstDevice = dso;
          m.extent = make_cudaExtent(g.row_bytes, rows, depth);
          err = cudaMemcpy3DPeerAsync(&m, dma_stream);
        }
        if (err != cudaSuccess) {
          return JAX_M2N_ERROR(kInternal, std::string(o->how == How::kMemcpy
                                                          ? "cudaMemcpy(Peer)Async"
                                                          : "cudaMemcpy3DPeerAsync") +
                                              " for " + o->label + ": " + CudaError(err));
        }
      }
      for (size_t j = 0; j < w.joins.size(); ++j) {  // join them back
        err = cudaEventRecord(w.joins[j], plan.dma_extra[p][j]);
        if (err == cudaSuccess) err = cudaStreamWaitEvent(stream, w.joins[j], 0);
        if (err != cudaSuccess) return fail("join of the DMA streams", err);
      }
      if (!w.kernels.empty()) {
        tasks.clear();
        for (const PeerOp* o : w.kernels) {
          tasks.push_back(BoxCopyTask(o->g, BaseOf(o->src, calls) + o->src.offset,
                                      BaseOf(o->dst, calls) + o->dst.offset,
                                      o->src_type, o->dst_type));
        }
        err = LaunchCopyTasks(tasks.data(), static_cast<int>(tasks.size()), stream);
        if (err != cudaSuccess) {
          return JAX_M2N_ERROR(kInternal, "copy kernel (" + std::to_string(tasks.size()) +
                                              " boxes, first " + w.kernels.front()->label +
                                              ") failed to launch: " + CudaError(err));
        }
      }
      err = cudaEventRecord(w.done, stream);
      if (err != cudaSuccess) return fail("cudaEventRecord", err);
    }
    for (int32_t d : st.touched) {
      last[d].clear();
      for (const LaneWork& w : st.work) {
        if (std::find(w.touches.begin(), w.touches.end(), d) != w.touches.end()) {
          last[d].emplace_back(w.issuer, w.done);
        }
      }
    }
  }
  // Each XLA stream goes on only after every access to its device's buffers.
  for (int32_t p = 0; p < n; ++p) {
    cudaError_t err = cudaSetDevice(plan.ordinal[p]);
    if (err != cudaSuccess) return fail("cudaSetDevice", err);
    for (const auto& [issuer, ev] : last[p]) {
      if (issuer == p * kLanes + kDmaLane) continue;
      err = cudaStreamWaitEvent(calls[p]->stream, ev, 0);
      if (err != cudaSuccess) return fail("cudaStreamWaitEvent (end)", err);
    }
  }
  return ffi::Error::Success();
}

// --- the rendezvous -------------------------------------------------------------------

using Key = std::pair<int64_t, uint64_t>;  // (site, schedule fingerprint)

struct Round {
  explicit Round(size_t n) : calls(n, nullptr) {}
  std::vector<const PeerCall*> calls;
  size_t arrived = 0;
  std::atomic<bool> done{false};
  ffi::Error status = ffi::Error::Success();  // set by the executor before `done`
};

std::mutex g_mu;
std::condition_variable g_cv;
std::map<Key, std::shared_ptr<Round>>* g_open = new std::map<Key, std::shared_ptr<Round>>();

std::mutex g_plans_mu;
std::map<Key, std::unique_ptr<PeerPlan>>* g_plans =
    new std::map<Key, std::unique_ptr<PeerPlan>>();
constexpr size_t kMaxPlans = 512;

ffi::Error ExecuteRound(const Key& key, const std::vector<const PeerCall*>& calls) {
  Communicator& comm = Communicator::Get();
  std::lock_guard<std::mutex> lock(g_plans_mu);  // one executor per plan at a time
  auto it = g_plans->find(key);
  if (it == g_plans->end() || it->second->signature != SignatureOf(calls, comm.generation())) {
    ffi::ErrorOr<std::unique_ptr<PeerPlan>> built = BuildPeerPlan(calls, comm);
    if (built.has_error()) return built.error();
    if (g_plans->size() >= kMaxPlans) g_plans->clear();
    it = g_plans->insert_or_assign(key, std::move(built.value())).first;
  }
  const PeerPlan& plan = *it->second;
  if (ffi::Error e = EnqueueRound(plan, calls); e.failure()) return e;
  Counters& c = Stats();
  c.rounds.fetch_add(1, std::memory_order_relaxed);
  c.memcpys.fetch_add(plan.n_memcpy, std::memory_order_relaxed);
  c.memcpys_3d.fetch_add(plan.n_memcpy_3d, std::memory_order_relaxed);
  c.kernel_tasks.fetch_add(plan.n_kernel, std::memory_order_relaxed);
  c.converts.fetch_add(plan.n_convert, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace

void SetCudaEngine(CudaEngine engine) { g_engine.store(static_cast<int>(engine)); }
CudaEngine GetCudaEngine() { return static_cast<CudaEngine>(g_engine.load()); }

bool PeerPathPossible(const Schedule& schedule, const Communicator& comm) {
  std::vector<int> ordinals;
  for (int64_t d : schedule.devices) {
    LocalRank* r = comm.ForDevice(d);
    if (r == nullptr) return false;
    ordinals.push_back(r->ordinal);
  }
  for (int a : ordinals) {
    for (int b : ordinals) {
      if (!EnsurePeerAccess(a, b)) return false;
    }
  }
  return true;
}

ffi::Error RunPeerCall(const PeerCall& call, int64_t site, int64_t timeout_ms) {
  const Schedule& s = *call.schedule;
  const Key key{site, s.fingerprint};
  const size_t n = s.devices.size();
  std::shared_ptr<Round> round;
  bool executor = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    std::shared_ptr<Round>& open = (*g_open)[key];
    if (open == nullptr) open = std::make_shared<Round>(n);
    if (open->calls.size() != n || open->calls[call.participant] != nullptr) {
      return JAX_M2N_ERROR(kInternal,
                           "peer path: device " + std::to_string(s.devices[call.participant]) +
                               " joined the open round of site " + std::to_string(site) +
                               " twice (two executions of one reshard overlap on a device)");
    }
    round = open;
    round->calls[call.participant] = &call;
    // The call that completes the round runs it (a round that reached n is never
    // withdrawn: withdrawing needs arrived < n under this lock).
    executor = ++round->arrived == n;
    if (executor) g_open->erase(key);
  }
  if (executor) {
    ffi::Error e = ExecuteRound(key, round->calls);
    {
      std::lock_guard<std::mutex> lock(g_mu);
      round->status = e;
      round->done.store(true, std::memory_order_release);
    }
    g_cv.notify_all();
    return e;
  }
  // Spin briefly (the round usually completes within microseconds), then block.
  const auto spin_until = Clock::now() + std::chrono::microseconds(200);
  while (!round->done.load(std::memory_order_acquire) && Clock::now() < spin_until) {
    std::this_thread::yield();
  }
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(timeout_ms > 0 ? timeout_ms : 600000);
  std::unique_lock<std::mutex> lock(g_mu);
  while (!round->done.load(std::memory_order_acquire)) {
    if (g_cv.wait_until(lock, deadline) == std::cv_status::timeout &&
        !round->done.load(std::memory_order_acquire) && round->arrived < n) {
      // Nobody will run this round: withdraw (later calls start a fresh one).
      auto it = g_open->find(key);
      if (it != g_open->end() && it->second == round) g_open->erase(it);
      std::vector<int64_t> missing;
      for (size_t p = 0; p < n; ++p) {
        if (round->calls[p] == nullptr) missing.push_back(s.devices[p]);
      }
      round->calls[call.participant] = nullptr;
      --round->arrived;
      return JAX_M2N_ERROR(kDeadlineExceeded,
                           "peer path: device " + std::to_string(s.devices[call.participant]) +
                               " waited timeout_ms=" + std::to_string(timeout_ms) +
                               " for the calls of devices " + FormatList(missing) +
                               " of the same reshard (site " + std::to_string(site) +
                               "); they never arrived");
    }
  }
  return round->status;
}

PeerStats GetPeerStats() {
  Counters& c = Stats();
  PeerStats s;
  s.rounds = c.rounds.load();
  s.memcpys = c.memcpys.load();
  s.memcpys_3d = c.memcpys_3d.load();
  s.kernel_tasks = c.kernel_tasks.load();
  s.converts = c.converts.load();
  s.plans_built = c.plans.load();
  return s;
}

}  // namespace jax_m2n
