// Decoding and validation of the `schedule` attribute
// (docs/schedule_format.md). Everything here is pure: no device, no thread, no
// transport; every error names the field, the op and the offending value.

#include "xla_ffi/schedule.h"

#include <algorithm>
#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_m2n {

namespace ffi = ::xla::ffi;

namespace {

// names[value] of an enum whose values are 0, 1, ... (schedule.h); "?" for any other.
template <typename Enum, size_t N>
const char* NameOf(Enum value, const char* const (&names)[N]) {
  const auto i = static_cast<size_t>(value);
  return i < N ? names[i] : "?";
}

}  // namespace

const char* StageName(Stage stage) {
  static constexpr const char* kNames[] = {"local",  "inject", "forward",
                                           "fanout", "gather", "bcast"};
  static_assert(std::size(kNames) == kNumStages, "one name per Stage");
  return NameOf(stage, kNames);
}

const char* BufferKindName(BufferKind kind) {
  static constexpr const char* kNames[] = {"operand", "result", "workspace"};
  return NameOf(kind, kNames);
}

ElemType TypeOf(const TensorSpec& spec, BufferKind kind) {
  switch (kind) {
    case BufferKind::kOperand:
      return spec.src_type;
    case BufferKind::kResult:
      return spec.dst_type;
    case BufferKind::kWorkspace:
      return spec.wire_type;
  }
  return ElemType::kNone;
}

int64_t ElemBytesOf(const TensorSpec& spec, BufferKind kind) {
  const ElemType type = TypeOf(spec, kind);
  return type == ElemType::kNone ? spec.elem_bytes : ElemTypeBytes(type);
}

ffi::Error MakeError(ffi::ErrorCode code, std::string_view file, int line,
                     std::string_view message) {
  std::string text;
  text.reserve(file.size() + message.size() + 16);
  text.append(file);
  text.push_back(':');
  text.append(std::to_string(line));
  text.append(": ");
  text.append(message);
  return ffi::Error(code, std::move(text));
}

ffi::Error AddContext(const ffi::Error& error, std::string_view context) {
  if (error.success()) return error;
  std::string text(context);
  text.append(": ");
  text.append(error.message());
  return ffi::Error(error.errc().value_or(ffi::ErrorCode::kUnknown),
                    std::move(text));
}

std::string FormatList(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out.append(", ");
    out.append(std::to_string(values[i]));
  }
  out.push_back(']');
  return out;
}

namespace {

template <typename T>
std::string FormatSpan(const T* values, int64_t n) {
  std::string out = "[";
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) out.append(", ");
    out.append(std::to_string(values[i]));
  }
  out.push_back(']');
  return out;
}

std::string Hex(int64_t value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, static_cast<uint64_t>(value));
  return buf;
}

// FNV-1a over int64 words: cheap, deterministic, good enough to catch two
// participants running different schedules under one site.
class Fingerprint {
 public:
  void Add(int64_t value) {
    uint64_t v = static_cast<uint64_t>(value);
    for (int i = 0; i < 8; ++i) {
      hash_ ^= (v >> (8 * i)) & 0xff;
      hash_ *= 0x100000001b3ULL;
    }
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 0xcbf29ce484222325ULL;
};

// Multiplies non-negative values, reporting overflow of int64.
bool MulOverflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

// "op 3 (step 1, tensor 0, fanout)".
std::string OpName(int64_t index, const Op& op) {
  return "op " + std::to_string(index) + " (step " + std::to_string(op.step) +
         ", tensor " + std::to_string(op.tensor) + ", " + StageName(op.stage) +
         ")";
}

// An op's name for errors, formed only when one is raised: "op 3 (step 1, ...)".
struct OpLabel {
  int64_t index;
  const Op* op;
  std::string str() const { return OpName(index, *op); }
};

}  // namespace

// A 256-device refit program decodes ~8,000 ops: keep an op small (its dims are in
// Schedule::coords).
static_assert(sizeof(Op) <= 120, "an Op holds no per-dim arrays");

int32_t Schedule::ParticipantIndex(int64_t device_id) const {
  auto it = std::lower_bound(devices.begin(), devices.end(), device_id);
  if (it == devices.end() || *it != device_id) return -1;
  return static_cast<int32_t>(it - devices.begin());
}

int64_t Schedule::RequiredWorkspaceBytes(int32_t participant) const {
  return std::max<int64_t>(1, ws_bytes[participant]);
}

namespace {

// A decoding error: "schedule: <message>" with this file and line.
#define JAX_M2N_SCHEDULE_ERROR(message) \
  JAX_M2N_ERROR(kInvalidArgument, std::string("schedule: ") + (message))

// The header's counts (docs/schedule_format.md, "The `schedule` array").
struct Header {
  int64_t n_tensors = 0, n_devices = 0, n_steps = 0, n_ops = 0;
};

// (participant, kind, slot) -> tensor: a slot holds one tensor.
using SlotTensors = std::unordered_map<uint64_t, int64_t>;

// The header: magic, version, widths, and counts that add up to the attribute's size.
ffi::Error DecodeHeader(const int64_t* a, int64_t size, Header* h) {
  if (size < kHeaderWidth) {
    return JAX_M2N_SCHEDULE_ERROR(
        "the attribute must hold at least the " + std::to_string(kHeaderWidth) +
        "-element header; got " + std::to_string(size) + " elements");
  }
  const int64_t magic = a[0], version = a[1], n_tensors = a[2],
                n_devices = a[3], n_steps = a[4], n_ops = a[5], op_width = a[6],
                max_rank = a[7];
  if (magic != kScheduleMagic) {
    return JAX_M2N_SCHEDULE_ERROR("header MAGIC must be " + Hex(kScheduleMagic) +
                                  " (\"M2N_\"); got " + Hex(magic) +
                                  ": not a jax_m2n schedule");
  }
  if (version != kScheduleVersion) {
    return JAX_M2N_SCHEDULE_ERROR(
        "header VERSION must be " + std::to_string(kScheduleVersion) +
        " (or " + std::to_string(kScheduleNarrowVersion) + " or " +
        std::to_string(kSchedulePackedVersion) +
        ", the same narrow or packed: the versions this extension decodes); got " +
        std::to_string(version) +
        ": the Python package and the extension are out of step, rebuild");
  }
  if (op_width != kOpFixedWidth) {
    return JAX_M2N_SCHEDULE_ERROR("header OP_FIXED must be " +
                                  std::to_string(kOpFixedWidth) + "; got " +
                                  std::to_string(op_width));
  }
  if (max_rank != kMaxRank) {
    return JAX_M2N_SCHEDULE_ERROR("header MAX_RANK must be " +
                                  std::to_string(kMaxRank) + "; got " +
                                  std::to_string(max_rank));
  }
  if (n_tensors < 0 || n_tensors > size) {
    return JAX_M2N_SCHEDULE_ERROR("header n_tensors must be in [0, " +
                                  std::to_string(size) + "]; got " +
                                  std::to_string(n_tensors));
  }
  if (n_devices < 1 || n_devices > size) {
    return JAX_M2N_SCHEDULE_ERROR("header n_devices must be in [1, " +
                                  std::to_string(size) + "]; got " +
                                  std::to_string(n_devices));
  }
  if (n_steps < 0 || n_steps > (int64_t{1} << 30)) {
    return JAX_M2N_SCHEDULE_ERROR("header n_steps must be in [0, 2^30]; got " +
                                  std::to_string(n_steps));
  }
  if (n_ops < 0 || n_ops > size || n_ops > INT32_MAX) {
    return JAX_M2N_SCHEDULE_ERROR("header n_ops must be in [0, " +
                                  std::to_string(std::min<int64_t>(size, INT32_MAX)) +
                                  "]; got " + std::to_string(n_ops));
  }
  // Each count is <= size (< 2^60 for any real attribute): no overflow here. The
  // ops' records are rank-sized: at least OP_FIXED each; the exact sum is checked
  // once they are read (DecodeSchedule).
  const int64_t prefix = kHeaderWidth + 2 * n_devices + kTensorWidth * n_tensors;
  if (prefix + kOpFixedWidth * n_ops > size) {
    return JAX_M2N_SCHEDULE_ERROR("sizes must add up: 8 + 2 * n_devices (" +
                                  std::to_string(n_devices) + ") + " +
                                  std::to_string(kTensorWidth) + " * n_tensors (" +
                                  std::to_string(n_tensors) + ") + at least " +
                                  std::to_string(kOpFixedWidth) + " * n_ops (" +
                                  std::to_string(n_ops) + ") = " +
                                  std::to_string(prefix + kOpFixedWidth * n_ops) +
                                  " elements at least; got " + std::to_string(size));
  }
  h->n_tensors = n_tensors;
  h->n_devices = n_devices;
  h->n_steps = n_steps;
  h->n_ops = n_ops;
  return ffi::Error::Success();
}

// The participants: global device ids, ascending, and each one's workspace bytes.
ffi::Error DecodeDevices(const int64_t* devices, const int64_t* ws, int64_t n_devices,
                         Schedule* s, Fingerprint* fp) {
  s->devices.assign(devices, devices + n_devices);
  s->ws_bytes.assign(ws, ws + n_devices);
  for (int64_t i = 0; i < n_devices; ++i) {
    if (devices[i] < 0 || devices[i] > INT32_MAX) {
      return JAX_M2N_SCHEDULE_ERROR("devices[" + std::to_string(i) +
                                    "] must be a global device id in [0, 2^31); got " +
                                    std::to_string(devices[i]));
    }
    if (i > 0 && devices[i] <= devices[i - 1]) {
      return JAX_M2N_SCHEDULE_ERROR(
          "devices must be sorted ascending without repeats; "
          "got devices[" +
          std::to_string(i - 1) + "] = " + std::to_string(devices[i - 1]) +
          ", devices[" + std::to_string(i) +
          "] = " + std::to_string(devices[i]));
    }
    if (ws[i] < 0) {
      return JAX_M2N_SCHEDULE_ERROR("ws[" + std::to_string(i) + "] (device " +
                                    std::to_string(devices[i]) +
                                    ") must be >= 0 bytes; got " +
                                    std::to_string(ws[i]));
    }
    fp->Add(devices[i]);
    fp->Add(ws[i]);
  }
  return ffi::Error::Success();
}

// One tensor record: element bytes, rank, dims (zero-padded), conversion codes.
ffi::Error DecodeTensor(const int64_t* row, int64_t t, TensorSpec* spec) {
  const std::string name = "tensor " + std::to_string(t);
  spec->elem_bytes = row[0];
  spec->rank = row[1];
  if (spec->elem_bytes < 1 || spec->elem_bytes > 1024) {
    return JAX_M2N_SCHEDULE_ERROR(name + ": elem_bytes must be in [1, 1024]; got " +
                                  std::to_string(spec->elem_bytes));
  }
  if (spec->rank < 0 || spec->rank > kMaxRank) {
    return JAX_M2N_SCHEDULE_ERROR(name + ": rank must be in [0, " +
                                  std::to_string(kMaxRank) + "]; got " +
                                  std::to_string(spec->rank));
  }
  int64_t bytes = spec->elem_bytes;
  for (int64_t d = 0; d < kMaxRank; ++d) {
    const int64_t dim = row[2 + d];
    spec->dims[d] = dim;
    if (d < spec->rank) {
      if (dim < 0) {
        return JAX_M2N_SCHEDULE_ERROR(name + ": dim_" + std::to_string(d) +
                                      " must be >= 0; got " + std::to_string(dim));
      }
      if (MulOverflows(bytes, dim, &bytes)) {
        return JAX_M2N_SCHEDULE_ERROR(name + ": byte size overflows int64 (dims " +
                                      FormatSpan(row + 2, spec->rank) + ")");
      }
    } else if (dim != 0) {
      return JAX_M2N_SCHEDULE_ERROR(name + ": dim_" + std::to_string(d) +
                                    " must be 0 (padding beyond rank " +
                                    std::to_string(spec->rank) + "); got " +
                                    std::to_string(dim));
    }
  }
  spec->bytes = bytes;
  // Conversion: both 0, or two distinct fused types with elem_bytes the
  // size of the narrower (the wire type).
  const int64_t src_code = row[2 + kMaxRank], dst_code = row[3 + kMaxRank];
  for (const auto& [field, code] : {std::make_pair("src_type", src_code),
                                    std::make_pair("dst_type", dst_code)}) {
    if (code < 0 || code >= kNumElemTypes) {
      return JAX_M2N_SCHEDULE_ERROR(
          name + ": " + field +
          " must be a type code in [0, 5] (0 none, 1 f32, 2 f16, 3 bf16, "
          "4 f8_e4m3fn, 5 f8_e5m2); got " +
          std::to_string(code));
    }
  }
  if ((src_code == 0) != (dst_code == 0) ||
      (src_code != 0 && src_code == dst_code)) {
    return JAX_M2N_SCHEDULE_ERROR(
        name +
        ": src_type and dst_type must both be 0 (no conversion) or two "
        "different types; got src_type = " +
        std::to_string(src_code) + ", dst_type = " +
        std::to_string(dst_code));
  }
  if (src_code != 0) {
    spec->src_type = static_cast<ElemType>(src_code);
    spec->dst_type = static_cast<ElemType>(dst_code);
    spec->wire_type =
        ElemTypeBytes(spec->dst_type) <= ElemTypeBytes(spec->src_type)
            ? spec->dst_type
            : spec->src_type;
    if (spec->elem_bytes != ElemTypeBytes(spec->wire_type)) {
      return JAX_M2N_SCHEDULE_ERROR(
          name + ": elem_bytes must be " +
          std::to_string(ElemTypeBytes(spec->wire_type)) +
          " (the wire type " + ElemTypeName(spec->wire_type) +
          " of a conversion " + ElemTypeName(spec->src_type) + " -> " +
          ElemTypeName(spec->dst_type) + "); got " +
          std::to_string(spec->elem_bytes));
    }
  }
  return ffi::Error::Success();
}

// An op's box: per dim its extent and the start in each side's buffer (local
// coordinates), appended to `coords` (the tensor's rank extents, then src starts,
// then dst starts; DecodeWide points the op at them once every op is read). Sets
// op->bytes.
ffi::Error DecodeBox(const int64_t* row, const TensorSpec& spec,
                     const OpLabel& label, Op* op, std::vector<int64_t>* coords) {
  op->bytes = spec.elem_bytes;
  const int64_t rank = spec.rank;
  const size_t at = coords->size();
  coords->resize(at + 3 * rank);
  int64_t* box = coords->data() + at;
  for (int64_t d = 0; d < spec.rank; ++d) {
    const int64_t extent = row[kOpFixedWidth + 3 * d];
    const int64_t src_start = row[kOpFixedWidth + 3 * d + 1];
    const int64_t dst_start = row[kOpFixedWidth + 3 * d + 2];
    box[d] = extent;
    box[rank + d] = src_start;
    box[2 * rank + d] = dst_start;
    auto dim = [d] { return "[" + std::to_string(d) + "]"; };
    if (extent < 0 || extent > spec.dims[d]) {
      return JAX_M2N_SCHEDULE_ERROR(
          label.str() + ": extent" + dim() + " must be in [0, " +
          std::to_string(spec.dims[d]) + "] (tensor dim " +
          std::to_string(d) + "); got " + std::to_string(extent));
    }
    for (const auto& [side, start] :
         {std::make_pair("src.start", src_start),
          std::make_pair("dst.start", dst_start)}) {
      // Local coordinates: a shard is never larger than the global tensor.
      if (start < 0 || start > spec.dims[d] - extent) {
        return JAX_M2N_SCHEDULE_ERROR(label.str() + ": " + side + dim() + " = " +
                                      std::to_string(start) + " with extent " +
                                      std::to_string(extent) +
                                      " must lie in tensor dim " + std::to_string(d) +
                                      " = " + std::to_string(spec.dims[d]));
      }
    }
    op->bytes *= extent;  // <= spec.bytes: no overflow
  }
  return ffi::Error::Success();
}

// One end of an op (side 0: src, 1: dst): its device (a participant), buffer kind and
// slot (a workspace offset for the workspace), and staging area. A buffer holds one
// tensor across all ops (`slot_tensor`).
ffi::Error DecodeEnd(const int64_t* row, int side, const Schedule& s,
                     const TensorSpec& spec, const OpLabel& label,
                     int64_t n_tensors, SlotTensors* slot_tensor, Op* op) {
  OpEnd& end = side == 0 ? op->src : op->dst;
  const char* which = side == 0 ? "src" : "dst";
  const int64_t device = row[side == 0 ? 3 : 6];
  const int64_t kind = row[side == 0 ? 4 : 7];
  const int64_t slot = row[side == 0 ? 5 : 8];
  const int64_t pack = row[side == 0 ? 9 : 10];
  end.device = device;
  end.participant = s.ParticipantIndex(device);
  if (end.participant < 0) {
    return JAX_M2N_SCHEDULE_ERROR(
        label.str() + ": " + which + "_dev = " + std::to_string(device) +
        " must be one of the devices " + FormatList(s.devices));
  }
  const int64_t min_kind = side == 0 ? 0 : 1;
  if (kind < min_kind || kind > 2) {
    return JAX_M2N_SCHEDULE_ERROR(label.str() + ": " + which + "_kind must be " +
                                  (side == 0
                                       ? "0 (operand), 1 (result) or 2 (workspace)"
                                       : "1 (result) or 2 (workspace)") +
                                  "; got " + std::to_string(kind));
  }
  end.kind = static_cast<BufferKind>(kind);
  end.slot = slot;
  end.pack = pack;
  const int64_t ws_bytes = s.ws_bytes[end.participant];
  if (end.kind == BufferKind::kWorkspace) {
    if (slot < 0 || slot > ws_bytes - spec.bytes) {
      return JAX_M2N_SCHEDULE_ERROR(
          label.str() + ": " + which + "_slot = " + std::to_string(slot) +
          " is a workspace offset: the whole tensor (" +
          std::to_string(spec.bytes) + " bytes) must fit in ws[device " +
          std::to_string(device) + "] = " + std::to_string(ws_bytes) +
          " bytes");
    }
  } else if (slot < 0 || slot >= n_tensors) {
    // A device has at most one operand and one result per tensor.
    return JAX_M2N_SCHEDULE_ERROR(label.str() + ": " + which +
                                  "_slot = " + std::to_string(slot) + " is a " +
                                  BufferKindName(end.kind) +
                                  " index and must be in [0, n_tensors = " +
                                  std::to_string(n_tensors) + ")");
  }
  const uint64_t key =
      ((static_cast<uint64_t>(end.participant) << 2 | kind) << 40) ^
      static_cast<uint64_t>(slot);
  auto [it, inserted] = slot_tensor->emplace(key, op->tensor);
  if (!inserted && it->second != op->tensor) {
    return JAX_M2N_SCHEDULE_ERROR(
        label.str() + ": " + which + " " + BufferKindName(end.kind) + " " +
        std::to_string(slot) + " of device " + std::to_string(device) +
        " holds tensor " + std::to_string(it->second) +
        " in an earlier op; one buffer must hold one tensor");
  }
  if (pack < -1 || (pack >= 0 && pack > ws_bytes - op->bytes)) {
    return JAX_M2N_SCHEDULE_ERROR(
        label.str() + ": " + which + "_pack = " + std::to_string(pack) +
        " must be -1 or a staging area of " + std::to_string(op->bytes) +
        " bytes inside ws[device " + std::to_string(device) +
        "] = " + std::to_string(ws_bytes) + " bytes");
  }
  return ffi::Error::Success();
}

// Op i: its step (ops sorted by step), stage, tensor, box and both ends.
// `remaining`: elements of the attribute from `row` on; sets `*width` to the
// record's (OP_FIXED + 3 * rank of its tensor).
ffi::Error DecodeOp(const int64_t* row, int64_t remaining, int64_t i, const Header& h,
                    Schedule* s, int64_t* prev_step, SlotTensors* slot_tensor,
                    int64_t* width) {
  Op& op = s->ops[i];
  // Names are formed only for an error: a 256-device program decodes ~8,000 ops.
  auto name = [i] { return "op " + std::to_string(i); };
  if (remaining < kOpFixedWidth) {
    return JAX_M2N_SCHEDULE_ERROR(name() + ": sizes must add up: the record needs " +
                                  std::to_string(kOpFixedWidth) +
                                  " elements at least; " + std::to_string(remaining) +
                                  " left in the attribute");
  }
  op.step = row[0];
  if (op.step < 0 || op.step >= h.n_steps) {
    return JAX_M2N_SCHEDULE_ERROR(
        name() + ": step must be in [0, n_steps = " + std::to_string(h.n_steps) +
        "); got " + std::to_string(op.step));
  }
  if (op.step < *prev_step) {
    return JAX_M2N_SCHEDULE_ERROR(name() + ": ops must be sorted by step; got step " +
                                  std::to_string(op.step) + " after step " +
                                  std::to_string(*prev_step));
  }
  *prev_step = op.step;
  if (row[1] < 0 || row[1] >= kNumStages) {
    return JAX_M2N_SCHEDULE_ERROR(name() +
                                  ": stage must be in [0, 5] (local, inject, "
                                  "forward, fanout, gather, bcast); got " +
                                  std::to_string(row[1]));
  }
  op.stage = static_cast<Stage>(row[1]);
  op.tensor = row[2];
  if (op.tensor < 0 || op.tensor >= h.n_tensors) {
    return JAX_M2N_SCHEDULE_ERROR(name() + ": tensor must be in [0, n_tensors = " +
                                  std::to_string(h.n_tensors) + "); got " +
                                  std::to_string(op.tensor));
  }
  const TensorSpec& spec = s->tensors[op.tensor];
  *width = OpWidth(spec.rank);
  if (remaining < *width) {
    return JAX_M2N_SCHEDULE_ERROR(
        name() + ": sizes must add up: the record of a rank-" +
        std::to_string(spec.rank) +
        " tensor needs " + std::to_string(*width) + " elements; " +
        std::to_string(remaining) + " left in the attribute");
  }
  const OpLabel label{i, &op};
  if (ffi::Error e = DecodeBox(row, spec, label, &op, &s->coords); e.failure()) {
    return e;
  }
  for (int side = 0; side < 2; ++side) {
    ffi::Error e = DecodeEnd(row, side, *s, spec, label, h.n_tensors, slot_tensor,
                             &op);
    if (e.failure()) return e;
  }
  s->ops_by_dst[op.dst.participant].push_back(static_cast<int32_t>(i));
  s->ops_by_device[op.dst.participant].push_back(static_cast<int32_t>(i));
  if (op.src.participant != op.dst.participant) {
    s->ops_by_device[op.src.participant].push_back(static_cast<int32_t>(i));
  }
  return ffi::Error::Success();
}

#undef JAX_M2N_SCHEDULE_ERROR

}  // namespace

namespace {

// A narrow schedule (kScheduleNarrowVersion) as the version-3 array it stands for:
// the header with VERSION 3, each int32 after it widened, a kNarrowPad dropped. Its
// fingerprint is then the wide encoding's (peers may hold either).
std::vector<int64_t> Widen(ffi::Span<const int64_t> encoded) {
  const int64_t words = static_cast<int64_t>(encoded.size()) - kHeaderWidth;
  std::vector<int64_t> wide(encoded.begin(), encoded.begin() + kHeaderWidth);
  wide[1] = kScheduleVersion;
  wide.reserve(kHeaderWidth + 2 * words);
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t word = static_cast<uint64_t>(encoded[kHeaderWidth + w]);
    wide.push_back(static_cast<int32_t>(static_cast<uint32_t>(word)));
    wide.push_back(static_cast<int32_t>(static_cast<uint32_t>(word >> 32)));
  }
  if (words > 0 && wide.back() == kNarrowPad) wide.pop_back();
  return wide;
}

// A packed schedule (kSchedulePackedVersion) as the version-3 array it stands for:
// the header with VERSION 3, then the count of elements the word after the header
// gives, each read as a zigzag LEB128 varint from the bytes of the words after it.
// Errors name the element and the byte; the padding must be zero and under a word.
ffi::ErrorOr<std::vector<int64_t>> Unpack(ffi::Span<const int64_t> encoded) {
  auto fail = [](const std::string& message) -> ffi::ErrorOr<std::vector<int64_t>> {
    return ffi::Unexpected<ffi::Error>(
        JAX_M2N_ERROR(kInvalidArgument, "schedule: packed body: " + message));
  };
  if (encoded.size() < static_cast<size_t>(kHeaderWidth + 1)) {
    return fail("the word after the header (the element count) is missing");
  }
  const int64_t count = encoded[kHeaderWidth];
  const int64_t n_bytes =
      8 * (static_cast<int64_t>(encoded.size()) - kHeaderWidth - 1);
  // Every element is at least one byte: a larger count cannot be read.
  if (count < 0 || count > n_bytes) {
    return fail("element count = " + std::to_string(count) + " must lie in [0, " +
                std::to_string(n_bytes) + "], the bytes that follow it");
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(n_bytes));
  if (n_bytes > 0) {  // the words' bytes, little-endian
    for (int64_t w = 0; w < n_bytes / 8; ++w) {
      const uint64_t word = static_cast<uint64_t>(encoded[kHeaderWidth + 1 + w]);
      for (int k = 0; k < 8; ++k) {
        bytes[8 * w + k] = static_cast<uint8_t>(word >> (8 * k));
      }
    }
  }
  std::vector<int64_t> wide(encoded.begin(), encoded.begin() + kHeaderWidth);
  wide[1] = kScheduleVersion;
  wide.reserve(kHeaderWidth + count);
  int64_t at = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint64_t z = 0;
    for (int shift = 0;; shift += 7) {
      if (at >= n_bytes) {
        return fail("element " + std::to_string(i) + " of " + std::to_string(count) +
                    " is cut off at byte " + std::to_string(at));
      }
      if (shift > 63) {
        return fail("element " + std::to_string(i) + " at byte " + std::to_string(at) +
                    " runs past 10 bytes (not an int64)");
      }
      const uint8_t b = bytes[at++];
      z |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) break;
    }
    wide.push_back(static_cast<int64_t>(z >> 1) ^ -static_cast<int64_t>(z & 1));
  }
  if (n_bytes - at >= 8) {
    return fail(std::to_string(n_bytes - at) + " bytes after element " +
                std::to_string(count) + " of " + std::to_string(count) +
                ": the padding must be less than a word");
  }
  for (int64_t k = at; k < n_bytes; ++k) {
    if (bytes[k] != 0) return fail("padding byte " + std::to_string(k) + " must be 0");
  }
  return wide;
}

// The attribute in its order (docs/schedule_format.md): header, devices and their
// workspace bytes, tensor records, op records; each section checked as it is read.
ffi::ErrorOr<Schedule> DecodeWide(ffi::Span<const int64_t> encoded) {
  const int64_t size = static_cast<int64_t>(encoded.size());
  const int64_t* a = encoded.begin();
  auto fail = [](ffi::Error error) -> ffi::ErrorOr<Schedule> {
    return ffi::Unexpected<ffi::Error>(std::move(error));
  };
  Header h;
  if (ffi::Error e = DecodeHeader(a, size, &h); e.failure()) return fail(std::move(e));

  Schedule s;
  s.n_steps = h.n_steps;
  Fingerprint fp;
  for (int i = 0; i < kHeaderWidth; ++i) {
    if (i != 5) fp.Add(a[i]);  // n_ops differs between per-device encodings
  }
  const int64_t* devices = a + kHeaderWidth;
  const int64_t* ws = devices + h.n_devices;
  if (ffi::Error e = DecodeDevices(devices, ws, h.n_devices, &s, &fp); e.failure()) {
    return fail(std::move(e));
  }

  const int64_t* tensors = ws + h.n_devices;
  s.tensors.resize(h.n_tensors);
  for (int64_t t = 0; t < h.n_tensors; ++t) {
    const int64_t* row = tensors + t * kTensorWidth;
    for (int i = 0; i < kTensorWidth; ++i) fp.Add(row[i]);
    if (ffi::Error e = DecodeTensor(row, t, &s.tensors[t]); e.failure()) {
      return fail(std::move(e));
    }
  }
  s.fingerprint = fp.value();

  const int64_t* ops = tensors + h.n_tensors * kTensorWidth;
  s.ops.resize(h.n_ops);
  s.ops_by_dst.resize(h.n_devices);
  s.ops_by_device.resize(h.n_devices);
  SlotTensors slot_tensor;
  int64_t prev_step = 0;
  const int64_t* end = a + size;
  // The records' elements beyond their fixed fields: their coordinates, if sizes add up.
  s.coords.reserve(std::max<int64_t>(0, (end - ops) - h.n_ops * kOpFixedWidth));
  for (int64_t i = 0; i < h.n_ops; ++i) {
    int64_t width = 0;
    ffi::Error e = DecodeOp(ops, end - ops, i, h, &s, &prev_step, &slot_tensor, &width);
    if (e.failure()) return fail(std::move(e));
    ops += width;
  }
  // Every op's coordinates are in place (appended in op order): point the ops at them.
  const int64_t* box = s.coords.data();
  for (Op& op : s.ops) {
    const int64_t rank = s.tensors[op.tensor].rank;
    op.extent = box;
    op.src.start = box + rank;
    op.dst.start = box + 2 * rank;
    box += 3 * rank;
  }
  if (ops != end) {
    return fail(JAX_M2N_ERROR(
        kInvalidArgument,
        "schedule: sizes must add up: " + std::to_string(end - ops) +
        " elements after the last of n_ops = " + std::to_string(h.n_ops) +
        " op records"));
  }
  return s;
}

}  // namespace

// Version 3 as it is; a narrow or packed schedule widened first (its temporary freed
// on return).
ffi::ErrorOr<Schedule> DecodeSchedule(ffi::Span<const int64_t> encoded) {
  if (encoded.size() >= static_cast<size_t>(kHeaderWidth) &&
      encoded[0] == kScheduleMagic && encoded[1] == kScheduleNarrowVersion) {
    const std::vector<int64_t> wide = Widen(encoded);
    return DecodeWide(ffi::Span<const int64_t>(wide.data(), wide.size()));
  }
  if (encoded.size() >= static_cast<size_t>(kHeaderWidth) &&
      encoded[0] == kScheduleMagic && encoded[1] == kSchedulePackedVersion) {
    ffi::ErrorOr<std::vector<int64_t>> wide = Unpack(encoded);
    if (wide.has_error()) return ffi::Unexpected<ffi::Error>(wide.error());
    return DecodeWide(ffi::Span<const int64_t>(wide->data(), wide->size()));
  }
  return DecodeWide(encoded);
}


ffi::Error CheckOpEnd(const Schedule& schedule, int32_t op_index, bool src_side,
                      const BufferShape& buffer) {
  const Op& op = schedule.ops[op_index];
  const OpEnd& end = src_side ? op.src : op.dst;
  const TensorSpec& spec = schedule.tensors[op.tensor];
  const int64_t rank = static_cast<int64_t>(buffer.dims.size());
  auto where = [&]() {
    return OpName(op_index, op) + ": " +
           (src_side ? "source " : "destination ") + BufferKindName(end.kind) +
           " " + std::to_string(end.slot) + " of device " +
           std::to_string(end.device);
  };
  if (rank != spec.rank) {
    return JAX_M2N_ERROR(kInvalidArgument,
                         where() + " must have the tensor's rank " +
                             std::to_string(spec.rank) + "; got dims " +
                             FormatSpan(buffer.dims.begin(), rank));
  }
  const int64_t elem_bytes = ElemBytesOf(spec, end.kind);
  if (buffer.elem_bytes != elem_bytes) {
    const ElemType type = TypeOf(spec, end.kind);
    return JAX_M2N_ERROR(
        kInvalidArgument,
        where() + " must have " + std::to_string(elem_bytes) +
            "-byte elements (tensors table" +
            (type == ElemType::kNone ? std::string()
                                     : std::string(", ") + ElemTypeName(type)) +
            "); got " +
            std::to_string(buffer.elem_bytes) + "-byte elements");
  }
  for (int64_t d = 0; d < rank; ++d) {
    if (end.start[d] + op.extent[d] > buffer.dims[d]) {
      return JAX_M2N_ERROR(
          kInvalidArgument,
          where() + ": box start " + FormatSpan(end.start, rank) +
              " + extent " + FormatSpan(op.extent, rank) +
              " must lie inside the buffer's dims " +
              FormatSpan(buffer.dims.begin(), rank) + " (dim " +
              std::to_string(d) + ")");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckDeviceBuffers(const Schedule& schedule, int32_t participant,
                              const DeviceBufferShapes& buffers) {
  const int64_t device = schedule.devices[participant];
  const int64_t required = schedule.RequiredWorkspaceBytes(participant);
  if (buffers.workspace_bytes < required) {
    return JAX_M2N_ERROR(
        kInvalidArgument,
        "the workspace (last result) of device " + std::to_string(device) +
            " must hold at least max(1, ws) = " + std::to_string(required) +
            " bytes; got " + std::to_string(buffers.workspace_bytes));
  }
  for (int32_t index : schedule.ops_by_device[participant]) {
    const Op& op = schedule.ops[index];
    const TensorSpec& spec = schedule.tensors[op.tensor];
    for (int side = 0; side < 2; ++side) {
      const OpEnd& end = side == 0 ? op.src : op.dst;
      if (end.participant != participant) continue;
      BufferShape shape;
      switch (end.kind) {
        case BufferKind::kOperand:
        case BufferKind::kResult: {
          const std::vector<BufferShape>& list =
              end.kind == BufferKind::kOperand ? buffers.operands
                                               : buffers.results;
          if (end.slot >= static_cast<int64_t>(list.size())) {
            return JAX_M2N_ERROR(
                kInvalidArgument,
                OpName(index, op) + ": " + (side == 0 ? "src" : "dst") +
                    "_slot = " + std::to_string(end.slot) +
                    " must name one of the " + std::to_string(list.size()) +
                    " " + BufferKindName(end.kind) + "s of device " +
                    std::to_string(device) +
                    (end.kind == BufferKind::kResult
                         ? " (results without the trailing workspace)"
                         : ""));
          }
          shape = list[end.slot];
          break;
        }
        case BufferKind::kWorkspace:
          // Inside ws (checked by DecodeSchedule) <= the real workspace.
          shape.dims = ffi::Span<const int64_t>(spec.dims.data(), spec.rank);
          shape.elem_bytes = spec.elem_bytes;
          break;
      }
      if (ffi::Error error = CheckOpEnd(schedule, index, side == 0, shape);
          error.failure()) {
        return error;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace jax_m2n
