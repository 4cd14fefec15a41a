// The local copy schedule (decoding, validation) and the CPU handler of
// jax_m2n_local_copy. The copies are box_copy.h's: each box collapses to memcpy (or
// conversion) runs; nothing is staged; large calls split over threads.

#include "xla_ffi/local_copy.h"

#include <algorithm>
#include <functional>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/box_copy.h"
#include "xla_ffi/convert.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

namespace ffi = ::xla::ffi;

namespace {

// Reads the encoded schedule front to back; every read is bounds-checked.
class Reader {
 public:
  explicit Reader(ffi::Span<const int64_t> data) : data_(data) {}
  bool Has(size_t n) const { return data_.size() - pos_ >= n; }
  int64_t Next() { return data_[pos_++]; }
  size_t pos() const { return pos_; }
  size_t size() const { return data_.size(); }

 private:
  ffi::Span<const int64_t> data_;
  size_t pos_ = 0;
};

#define JAX_M2N_LOCAL_ERROR(message) \
  JAX_M2N_ERROR(kInvalidArgument, "local copy schedule: " + (message))

std::string Dims(const int64_t* dims, int64_t rank) {
  return FormatList(std::vector<int64_t>(dims, dims + rank));
}

bool ValidElemBytes(int64_t b) {
  return b == 1 || b == 2 || b == 4 || b == 8 || b == 16;
}

// prod(dims[:rank]); every dim is below 2^62 and the product is checked to stay so.
bool Volume(const int64_t* dims, int64_t rank, int64_t* volume) {
  int64_t v = 1;
  for (int64_t d = 0; d < rank; ++d) {
    if (dims[d] == 0) {
      *volume = 0;
      return true;
    }
    if (v > kLocalCopyMaxValue / dims[d]) return false;
    v *= dims[d];
  }
  *volume = v;
  return true;
}

// Whether two boxes of one output share an element (both non-empty).
bool Overlap(const LocalBox& a, const LocalBox& b, int64_t rank) {
  for (int64_t d = 0; d < rank; ++d) {
    if (a.dst_start[d] >= b.dst_start[d] + b.extent[d] ||
        b.dst_start[d] >= a.dst_start[d] + a.extent[d]) {
      return false;
    }
  }
  return true;
}

// The boxes of output `o` tile it exactly: non-empty ones pairwise disjoint (sorted by
// their first dim's start, so that a pair is compared only where their first dims
// overlap) and their volumes summing to the output's.
ffi::Error CheckTiling(const LocalOutput& out, size_t o) {
  std::vector<int64_t> volume(out.boxes.size());
  std::vector<size_t> order;
  for (size_t b = 0; b < out.boxes.size(); ++b) {
    Volume(out.boxes[b].extent.data(), out.rank, &volume[b]);  // inside: no overflow
    if (volume[b] > 0) order.push_back(b);
  }
  auto start0 = [&](size_t b) { return out.rank == 0 ? 0 : out.boxes[b].dst_start[0]; };
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return start0(a) < start0(b); });
  for (size_t i = 0; i < order.size(); ++i) {
    const LocalBox& a = out.boxes[order[i]];
    for (size_t j = i + 1; j < order.size(); ++j) {
      if (out.rank > 0 && start0(order[j]) >= a.dst_start[0] + a.extent[0]) break;
      if (Overlap(a, out.boxes[order[j]], out.rank)) {
        const size_t x = std::min(order[i], order[j]), y = std::max(order[i], order[j]);
        return JAX_M2N_LOCAL_ERROR(
            "output " + std::to_string(o) + ": boxes " + std::to_string(x) + " and " +
            std::to_string(y) + " must be disjoint; got dst_start " +
            Dims(out.boxes[x].dst_start.data(), out.rank) + " extent " +
            Dims(out.boxes[x].extent.data(), out.rank) + " and dst_start " +
            Dims(out.boxes[y].dst_start.data(), out.rank) + " extent " +
            Dims(out.boxes[y].extent.data(), out.rank));
      }
    }
  }
  int64_t total = 0, want = 0;
  Volume(out.dims.data(), out.rank, &want);
  for (int64_t v : volume) total += v;  // disjoint boxes inside: total <= want
  if (total != want) {
    return JAX_M2N_LOCAL_ERROR("output " + std::to_string(o) +
                               ": the boxes must cover every element exactly once; "
                               "they cover " + std::to_string(total) + " of " +
                               std::to_string(want));
  }
  return ffi::Error::Success();
}

ffi::Error DecodeBox(Reader& r, const LocalOutput& out, size_t o, size_t b,
                     int64_t n_slots, LocalBox* box) {
  const std::string name = "output " + std::to_string(o) + " box " + std::to_string(b);
  if (!r.Has(2 + 4 * static_cast<size_t>(out.rank))) {
    return JAX_M2N_LOCAL_ERROR(name + ": the schedule ends inside the box (length " +
                               std::to_string(r.size()) + ")");
  }
  box->slot = r.Next();
  const int64_t src_type = r.Next();
  if (box->slot < 0 || box->slot >= n_slots) {
    return JAX_M2N_LOCAL_ERROR(name + ": slot must be in [0, n_slots = " +
                               std::to_string(n_slots) + "); got " +
                               std::to_string(box->slot));
  }
  const bool opaque = out.type == ElemType::kNone;
  if (opaque ? src_type != 0 : (src_type < 1 || src_type >= kNumElemTypes)) {
    return JAX_M2N_LOCAL_ERROR(
        name + ": src_type must be " +
        (opaque ? std::string("0 (the output's opaque type)")
                : std::string("a float type code 1..5 (the output is ") +
                      ElemTypeName(out.type) + ")") +
        "; got " + std::to_string(src_type));
  }
  box->src_type = static_cast<ElemType>(src_type);
  box->src_elem_bytes = opaque ? out.elem_bytes : ElemTypeBytes(box->src_type);
  for (auto* field : {&box->src_dims, &box->src_start, &box->dst_start, &box->extent}) {
    field->fill(0);
    for (int64_t d = 0; d < out.rank; ++d) (*field)[d] = r.Next();
  }
  for (int64_t d = 0; d < out.rank; ++d) {
    const int64_t values[4] = {box->src_dims[d], box->src_start[d], box->dst_start[d],
                               box->extent[d]};
    for (int64_t v : values) {
      if (v < 0 || v >= kLocalCopyMaxValue) {
        return JAX_M2N_LOCAL_ERROR(name + ": dims, starts and extents must be in [0, "
                                   "2^62); got " + std::to_string(v) + " in dim " +
                                   std::to_string(d));
      }
    }
    if (box->src_start[d] + box->extent[d] > box->src_dims[d]) {
      return JAX_M2N_LOCAL_ERROR(name + ": src_start[" + std::to_string(d) +
                                 "] + extent = " +
                                 std::to_string(box->src_start[d] + box->extent[d]) +
                                 " must be <= src_dims = " +
                                 std::to_string(box->src_dims[d]));
    }
    if (box->dst_start[d] + box->extent[d] > out.dims[d]) {
      return JAX_M2N_LOCAL_ERROR(name + ": dst_start[" + std::to_string(d) +
                                 "] + extent = " +
                                 std::to_string(box->dst_start[d] + box->extent[d]) +
                                 " must be <= the output's dim = " +
                                 std::to_string(out.dims[d]));
    }
  }
  int64_t src_volume = 0;
  if (!Volume(box->src_dims.data(), out.rank, &src_volume) ||
      src_volume > kLocalCopyMaxValue / 16) {
    return JAX_M2N_LOCAL_ERROR(name + ": the source shard " +
                               Dims(box->src_dims.data(), out.rank) +
                               " must have fewer than 2^58 elements");
  }
  return ffi::Error::Success();
}

ffi::Error DecodeOutput(Reader& r, size_t o, int64_t n_slots, LocalOutput* out) {
  const std::string name = "output " + std::to_string(o);
  if (!r.Has(4)) {
    return JAX_M2N_LOCAL_ERROR(name + ": the schedule ends inside its header (length " +
                               std::to_string(r.size()) + ")");
  }
  const int64_t type = r.Next();
  out->elem_bytes = r.Next();
  out->rank = r.Next();
  const int64_t n_boxes = r.Next();
  if (type < 0 || type >= kNumElemTypes) {
    return JAX_M2N_LOCAL_ERROR(name + ": type must be 0 (opaque) or a float type code "
                               "1..5; got " + std::to_string(type));
  }
  out->type = static_cast<ElemType>(type);
  if (!ValidElemBytes(out->elem_bytes) ||
      (out->type != ElemType::kNone && out->elem_bytes != ElemTypeBytes(out->type))) {
    return JAX_M2N_LOCAL_ERROR(
        name + ": elem_bytes must be " +
        (out->type == ElemType::kNone
             ? std::string("1, 2, 4, 8 or 16")
             : std::to_string(ElemTypeBytes(out->type)) + " (" +
                   ElemTypeName(out->type) + ")") +
        "; got " + std::to_string(out->elem_bytes));
  }
  if (out->rank < 0 || out->rank > kMaxRank) {
    return JAX_M2N_LOCAL_ERROR(name + ": rank must be in [0, 8]; got " +
                               std::to_string(out->rank));
  }
  // Each box takes at least 2 entries: a count beyond what is left is malformed.
  if (n_boxes < 0 || !r.Has(static_cast<size_t>(out->rank)) ||
      static_cast<uint64_t>(n_boxes) > (r.size() - r.pos()) / 2) {
    return JAX_M2N_LOCAL_ERROR(name + ": n_boxes must be in [0, what the schedule's "
                               "length holds]; got " + std::to_string(n_boxes));
  }
  for (int64_t d = 0; d < out->rank; ++d) {
    out->dims[d] = r.Next();
    if (out->dims[d] < 0 || out->dims[d] >= kLocalCopyMaxValue) {
      return JAX_M2N_LOCAL_ERROR(name + ": dims[" + std::to_string(d) +
                                 "] must be in [0, 2^62); got " +
                                 std::to_string(out->dims[d]));
    }
  }
  int64_t volume = 0;
  if (!Volume(out->dims.data(), out->rank, &volume) ||
      volume > kLocalCopyMaxValue / out->elem_bytes) {
    return JAX_M2N_LOCAL_ERROR(name + ": dims " + Dims(out->dims.data(), out->rank) +
                               " must hold fewer than 2^62 bytes");
  }
  out->bytes = volume * out->elem_bytes;
  out->boxes.resize(static_cast<size_t>(n_boxes));
  for (size_t b = 0; b < out->boxes.size(); ++b) {
    if (ffi::Error e = DecodeBox(r, *out, o, b, n_slots, &out->boxes[b]); e.failure()) {
      return e;
    }
  }
  return CheckTiling(*out, o);
}

}  // namespace

ffi::ErrorOr<LocalCopySchedule> DecodeLocalCopySchedule(
    ffi::Span<const int64_t> encoded) {
  using Result = ffi::ErrorOr<LocalCopySchedule>;
  Reader r(encoded);
  if (!r.Has(kLocalCopyHeaderWidth)) {
    return Result(ffi::Unexpected(JAX_M2N_LOCAL_ERROR(
        "length must be at least 4 (magic, version, n_slots, n_outputs); got " +
        std::to_string(encoded.size()))));
  }
  const int64_t magic = r.Next(), version = r.Next();
  if (magic != kLocalCopyMagic || version != kLocalCopyVersion) {
    return Result(ffi::Unexpected(JAX_M2N_LOCAL_ERROR(
        "magic and version must be " + std::to_string(kLocalCopyMagic) + ", " +
        std::to_string(kLocalCopyVersion) + "; got " + std::to_string(magic) + ", " +
        std::to_string(version))));
  }
  LocalCopySchedule s;
  s.n_slots = r.Next();
  const int64_t n_outputs = r.Next();
  if (s.n_slots < 0 || s.n_slots > (int64_t{1} << 31)) {
    return Result(ffi::Unexpected(JAX_M2N_LOCAL_ERROR(
        "n_slots must be in [0, 2^31]; got " + std::to_string(s.n_slots))));
  }
  if (n_outputs < 0 ||
      static_cast<uint64_t>(n_outputs) > (r.size() - r.pos()) / 4) {
    return Result(ffi::Unexpected(JAX_M2N_LOCAL_ERROR(
        "n_outputs must be in [0, what the schedule's length holds]; got " +
        std::to_string(n_outputs))));
  }
  s.outputs.resize(static_cast<size_t>(n_outputs));
  for (size_t o = 0; o < s.outputs.size(); ++o) {
    if (ffi::Error e = DecodeOutput(r, o, s.n_slots, &s.outputs[o]); e.failure()) {
      return Result(ffi::Unexpected(e));
    }
  }
  if (r.pos() != r.size()) {
    return Result(ffi::Unexpected(JAX_M2N_LOCAL_ERROR(
        "length must be what its outputs and boxes take, " + std::to_string(r.pos()) +
        "; got " + std::to_string(r.size()))));
  }
  return s;
}

ffi::Error CheckLocalCopyResults(const LocalCopySchedule& schedule,
                                 const ffi::RemainingRets& rets) {
  if (rets.size() != schedule.outputs.size()) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         "the call must have one result per output of its schedule, " +
                             std::to_string(schedule.outputs.size()) + "; got " +
                             std::to_string(rets.size()));
  }
  for (size_t o = 0; o < rets.size(); ++o) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(o);
    if (ret.has_error()) return ret.error();
    const ffi::AnyBuffer& buffer = **ret;
    const LocalOutput& out = schedule.outputs[o];
    const auto dims = buffer.dimensions();
    bool same = static_cast<int64_t>(dims.size()) == out.rank &&
                static_cast<int64_t>(ffi::ByteWidth(buffer.element_type())) ==
                    out.elem_bytes;
    for (int64_t d = 0; same && d < out.rank; ++d) same = dims[d] == out.dims[d];
    if (!same) {
      return JAX_M2N_ERROR(
          kInvalidArgument,
          "result " + std::to_string(o) + " must have dims " +
              Dims(out.dims.data(), out.rank) + " of " + std::to_string(out.elem_bytes) +
              "-byte elements (its schedule's output); got dims " +
              FormatList(std::vector<int64_t>(dims.begin(), dims.end())) + " of " +
              std::to_string(ffi::ByteWidth(buffer.element_type())) + "-byte elements");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckPointerTable(const ffi::AnyBuffer& table, int64_t n, const char* call) {
  const ffi::DataType type = table.element_type();
  const bool wide = type == ffi::DataType::S64 || type == ffi::DataType::U64;
  const bool halves = type == ffi::DataType::S32 || type == ffi::DataType::U32;
  if (!(wide || halves) || table.dimensions().size() != 1 ||
      static_cast<int64_t>(table.size_bytes()) != 8 * n) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         std::string(call) + ": operand 0 must be the pointer table, "
                         "int64[" + std::to_string(n) + "] or its bytes as uint32[" +
                             std::to_string(2 * n) + "]; got dtype code " +
                             std::to_string(static_cast<int>(type)) + " with " +
                             std::to_string(table.element_count()) + " elements");
  }
  return ffi::Error::Success();
}

namespace {

// The CPU state of one executable: the decoded schedule.
struct LocalCopyCpuState {
  static ffi::TypeId id;
  LocalCopySchedule schedule;
};
ffi::TypeId LocalCopyCpuState::id = {};
constexpr char kLocalCopyCpuStateName[] = "jax_m2n.cpu.LocalCopyState";

constexpr char kCopyCall[] = "jax_m2n_local_copy (cpu)";

ffi::ErrorOr<std::unique_ptr<LocalCopyCpuState>> Instantiate(
    ffi::Span<const int64_t> schedule) {
  ffi::ErrorOr<LocalCopySchedule> decoded = DecodeLocalCopySchedule(schedule);
  if (decoded.has_error()) {
    return ffi::Unexpected(AddContext(decoded.error(), std::string(kCopyCall) +
                                                           ", instantiate"));
  }
  auto state = std::make_unique<LocalCopyCpuState>();
  state->schedule = std::move(decoded.value());
  return state;
}

// One piece of a call's copying: a box, or a slab of one along its outermost dim that
// is not 1, of one output.
struct Piece {
  const LocalOutput* out;
  const void* src;
  void* dst;
  LocalBox box;
  int64_t bytes;  // written
};

void CopyPiece(const Piece& p) {
  const ConstBoxRef from{p.src, p.box.src_dims.data(), p.box.src_start.data()};
  const BoxRef to{p.dst, p.out->dims.data(), p.box.dst_start.data()};
  if (p.box.src_type == p.out->type) {
    CopyBox(from, to, p.box.extent.data(), p.out->rank, p.out->elem_bytes);
  } else {
    ConvertBox(from, to, p.box.extent.data(), p.out->rank, p.box.src_type,
               p.out->type);
  }
}

// Splits `p` into slabs of about `target` bytes along its outermost dim that is not 1
// (a box of one element, or of rank 0, stays whole).
void Split(const Piece& p, int64_t target, std::vector<Piece>* pieces) {
  int64_t d = 0;
  while (d < p.out->rank && p.box.extent[d] == 1) ++d;
  const int64_t parts =
      d == p.out->rank ? 1 : std::min(p.box.extent[d], (p.bytes + target - 1) / target);
  if (parts <= 1) {
    pieces->push_back(p);
    return;
  }
  const int64_t extent = p.box.extent[d];
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t begin = extent * i / parts, end = extent * (i + 1) / parts;
    Piece slab = p;
    slab.box.src_start[d] += begin;
    slab.box.dst_start[d] += begin;
    slab.box.extent[d] = end - begin;
    slab.bytes = p.bytes / extent * (end - begin);
    pieces->push_back(slab);
  }
}

// Runs `pieces` on up to `threads` threads (this one included), balanced by bytes.
// Two threads copy 256 MiB into fresh memory in 25 ms where one takes 43 ms (2 cores,
// measured with numpy): the first-touch page faults and the copy both scale.
void RunPieces(std::vector<Piece>& pieces, int64_t threads) {
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.bytes > b.bytes; });
  std::vector<std::vector<const Piece*>> work(static_cast<size_t>(threads));
  std::vector<int64_t> load(static_cast<size_t>(threads), 0);
  for (const Piece& p : pieces) {
    const size_t t = std::min_element(load.begin(), load.end()) - load.begin();
    work[t].push_back(&p);
    load[t] += p.bytes;
  }
  auto run = [](const std::vector<const Piece*>& mine) {
    for (const Piece* p : mine) CopyPiece(*p);
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < work.size(); ++t) {
    if (!work[t].empty()) helpers.emplace_back(run, std::cref(work[t]));
  }
  run(work[0]);
  for (std::thread& h : helpers) h.join();
}

// How many threads a copy of `bytes` uses: one per kBytesPerThread, at most the
// hardware's threads (and 8): below that, starting a thread costs more than it saves.
constexpr int64_t kBytesPerThread = int64_t{8} << 20;
int64_t ThreadsFor(int64_t bytes) {
  static const int64_t hardware =
      std::max<int64_t>(1, std::min<int64_t>(8, std::thread::hardware_concurrency()));
  return std::max<int64_t>(1, std::min(hardware, bytes / kBytesPerThread));
}

ffi::Error Execute(LocalCopyCpuState* state, ffi::AnyBuffer table,
                   ffi::RemainingRets rets) {
  const LocalCopySchedule& s = state->schedule;
  if (ffi::Error e = CheckPointerTable(table, s.n_slots, kCopyCall); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckLocalCopyResults(s, rets); e.failure()) {
    return AddContext(e, kCopyCall);
  }
  const int64_t* pointers = static_cast<const int64_t*>(table.untyped_data());
  thread_local std::vector<Piece> whole, pieces;
  whole.clear();
  pieces.clear();
  int64_t total = 0;
  for (size_t o = 0; o < s.outputs.size(); ++o) {
    const LocalOutput& out = s.outputs[o];
    void* dst = (*rets.get<ffi::AnyBuffer>(o))->untyped_data();
    // A fresh XLA buffer: huge pages make its first-touch faults 30x cheaper.
    AdviseHugePages(dst, out.bytes);
    for (size_t b = 0; b < out.boxes.size(); ++b) {
      const LocalBox& box = out.boxes[b];
      int64_t volume = 0;
      Volume(box.extent.data(), out.rank, &volume);
      if (volume == 0) continue;
      const void* src = reinterpret_cast<const void*>(pointers[box.slot]);
      if (src == nullptr) {
        return JAX_M2N_ERROR(kInvalidArgument,
                             std::string(kCopyCall) + ": pointer table entry " +
                                 std::to_string(box.slot) + " (output " +
                                 std::to_string(o) + " box " + std::to_string(b) +
                                 ") must not be null");
      }
      whole.push_back(Piece{&out, src, dst, box, volume * out.elem_bytes});
      total += volume * out.elem_bytes;
    }
  }
  const int64_t threads = ThreadsFor(total);
  if (threads <= 1) {
    for (const Piece& p : whole) CopyPiece(p);
    return ffi::Error::Success();
  }
  for (const Piece& p : whole) Split(p, (total + threads - 1) / threads, &pieces);
  RunPieces(pieces, threads);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kInstantiate, Instantiate,
                       ffi::Ffi::BindInstantiate().Attr<ffi::Span<const int64_t>>(
                           "schedule"));

// The execute stage binds no attributes: the state holds the decoded schedule.
XLA_FFI_DEFINE_HANDLER(kExecute, Execute,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::State<LocalCopyCpuState>>()  // decoded schedule
                           .Arg<ffi::AnyBuffer>()                 // pointer table
                           .RemainingRets());                     // outputs

}  // namespace
}  // namespace jax_m2n

extern "C" XLA_FFI_Error* JaxM2nLocalCopyCpuInstantiate(XLA_FFI_CallFrame* call_frame) {
  if (XLA_FFI_Error* error = jax_m2n::RegisterStateTypeOnce<jax_m2n::LocalCopyCpuState>(
          call_frame->api, jax_m2n::kLocalCopyCpuStateName)) {
    return error;
  }
  return jax_m2n::kInstantiate(call_frame);
}

extern "C" XLA_FFI_Error* JaxM2nLocalCopyCpuExecute(XLA_FFI_CallFrame* call_frame) {
  return jax_m2n::kExecute(call_frame);
}
