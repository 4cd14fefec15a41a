// The C++ side of the schedule format, version kScheduleVersion
// (docs/schedule_format.md; the Python side is jax_m2n/_src/schedule.py).
// Owns: decoding and validating the `schedule` attribute of `jax_m2n_reshard`
// into a `Schedule`, and the execute-time check of boxes against the buffers
// XLA hands a device. Platform-free (no device API, no threads, no transport):
// the CPU and CUDA transports both build on it. It never moves data.

#ifndef JAX_M2N_XLA_FFI_SCHEDULE_H_
#define JAX_M2N_XLA_FFI_SCHEDULE_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/convert.h"

namespace jax_m2n {

// ---------------------------------------------------------------------------
// Format constants (docs/schedule_format.md, "The `schedule` array").
// ---------------------------------------------------------------------------

inline constexpr int64_t kScheduleMagic = 0x4D324E5F;  // "M2N_"
inline constexpr int64_t kScheduleVersion = 3;
// The same records with every element after the header an int32, two to an int64 word
// (element 2k in the low half of word k, little-endian), an odd count padded with
// kNarrowPad (never a value: narrow values lie in (-2^31, 2^31)): what encoders wrote
// before the packed form (docs/schedule_format.md, "Narrow schedules"); still decoded.
inline constexpr int64_t kScheduleNarrowVersion = 4;
inline constexpr int64_t kNarrowPad = -(int64_t{1} << 31);
// The same records packed (docs/schedule_format.md, "Packed schedules"): after the
// header, one word with the count of elements after the version-3 header, then
// those elements as zigzag LEB128 varints, their bytes in little-endian words, the
// last word zero-padded: what encoders write.
inline constexpr int64_t kSchedulePackedVersion = 5;
inline constexpr int64_t kHeaderWidth = 8;
inline constexpr int64_t kMaxRank = 8;
// elem_bytes, rank, dims, src_type, dst_type
inline constexpr int64_t kTensorWidth = 4 + kMaxRank;
inline constexpr int64_t kOpFixedWidth = 11;           // fields 0..10
// An op record: the fixed fields, then (extent, src start, dst start) per dim of
// its tensor's rank (version 3; at most 35 elements).
inline constexpr int64_t OpWidth(int64_t rank) { return kOpFixedWidth + 3 * rank; }

// What an op does in the route. Transports copy every stage the same way; the
// stage says why the op exists (and lets a transport pick an engine).
enum class Stage : int8_t {
  kLocal = 0,    // source and destination shard on one device
  kInject = 1,   // source device -> a leader of the destination domain
  kForward = 2,  // leader -> leader of the next domain (ring)
  kFanout = 3,   // leader -> replicas inside its domain
  kGather = 4,   // source shard -> a full-tensor workspace buffer
  kBcast = 5,    // full-tensor workspace buffer -> destination shards
};
inline constexpr int64_t kNumStages = 6;
const char* StageName(Stage stage);

// Which buffer of a device an op reads or writes.
enum class BufferKind : int8_t {
  kOperand = 0,  // slot = operand index (source shards only)
  kResult = 1,   // slot = result index (destination shards, not the workspace)
  kWorkspace =
      2,  // slot = byte offset of a full-tensor buffer in the workspace
};
const char* BufferKindName(BufferKind kind);

// One tensor of the pytree: its element size, global shape and conversion.
// Converting (src_type != kNone): operands hold src_type, results dst_type,
// workspace buffers and staging areas the wire type (the narrower of the two,
// whose size is elem_bytes); not converting: every buffer holds elem_bytes.
struct TensorSpec {
  int64_t elem_bytes = 0;  // bytes per element on the wire (in the workspace)
  int64_t rank = 0;
  std::array<int64_t, kMaxRank>
      dims{};         // global shape; dims[d] == 0 for d >= rank
  int64_t bytes = 0;  // elem_bytes * prod(dims[:rank]): wire bytes
  ElemType src_type = ElemType::kNone;   // kNone: no conversion
  ElemType dst_type = ElemType::kNone;
  ElemType wire_type = ElemType::kNone;  // dst_type if narrower, else src_type
};

// The element type of a `kind` buffer of `spec` (kNone when not converting).
ElemType TypeOf(const TensorSpec& spec, BufferKind kind);
// Bytes per element of a `kind` buffer of `spec`.
int64_t ElemBytesOf(const TensorSpec& spec, BufferKind kind);

// One side (source or destination) of an op.
struct OpEnd {
  int64_t device = 0;  // global device id
  int64_t slot = 0;    // meaning depends on `kind`
  int64_t pack = -1;   // workspace byte offset of a staging area, -1 if none
  // First index per dim, local coordinates: the tensor's rank values, held by the
  // schedule (Schedule::coords).
  const int64_t* start = nullptr;
  int32_t participant = 0;  // index of `device` in Schedule::devices
  BufferKind kind = BufferKind::kOperand;
};

// One copy of a box of one tensor from one buffer to another (a chunk). 120 bytes
// plus 24 a dim in the schedule's coordinates (a decoded op was 288 bytes with every
// dim of kMaxRank inline: most of a 256-device refit program's decoded schedule).
struct Op {
  int64_t step = 0;
  int64_t tensor = 0;
  int64_t bytes = 0;  // elem_bytes * prod(extent[:rank]): wire bytes
  // Box size per dim: the tensor's rank values, held by the schedule (coords).
  const int64_t* extent = nullptr;
  OpEnd src;
  OpEnd dst;
  Stage stage = Stage::kLocal;
};

// A decoded, validated schedule. Immutable after DecodeSchedule; safe to share
// between threads. Move-only: its ops point into its own `coords`.
struct Schedule {
  Schedule() = default;
  Schedule(Schedule&&) = default;
  Schedule& operator=(Schedule&&) = default;
  Schedule(const Schedule&) = delete;
  Schedule& operator=(const Schedule&) = delete;

  int64_t n_steps = 0;
  std::vector<int64_t> devices;   // global ids of the participants, ascending
  std::vector<int64_t> ws_bytes;  // workspace bytes each participant needs
  std::vector<TensorSpec> tensors;
  std::vector<Op> ops;  // sorted by step
  // Per op, its tensor's rank values of extent, then src start, then dst start.
  std::vector<int64_t> coords;

  // Per participant, indices into `ops` (in step order) of the ops it writes
  // (dst) and of the ops that touch it (src or dst).
  std::vector<std::vector<int32_t>> ops_by_dst;
  std::vector<std::vector<int32_t>> ops_by_device;

  // Hash of everything every participant's encoding shares (header without
  // n_ops, devices, ws, tensors): participants of one rendezvous must agree.
  uint64_t fingerprint = 0;

  // Index of `device_id` in `devices`, or -1 if it is not a participant.
  int32_t ParticipantIndex(int64_t device_id) const;
  // Bytes of the workspace result a participant needs: max(1, ws_bytes[p]).
  int64_t RequiredWorkspaceBytes(int32_t participant) const;
};

// Decodes and validates a `schedule` attribute. Checks everything that does not
// depend on the buffers of one device (see the invariants section of
// docs/schedule_format.md); errors name the field, the op and the value, e.g.
// "schedule.cc:210: schedule: op 3 (step 1): src.start[1] + extent[1] = 9
// exceeds tensor 0 dim 1 = 8".
::xla::ffi::ErrorOr<Schedule> DecodeSchedule(
    ::xla::ffi::Span<const int64_t> encoded);

// The shape of one buffer XLA handed to a device, for CheckDeviceBuffers.
struct BufferShape {
  ::xla::ffi::Span<const int64_t> dims;  // borrowed from the call frame
  int64_t elem_bytes = 0;                // byte width of the buffer's dtype
};

// The buffers of one device's call: operands, results without the workspace,
// and the workspace size.
struct DeviceBufferShapes {
  std::vector<BufferShape> operands;
  std::vector<BufferShape> results;
  int64_t workspace_bytes = 0;
};

// Execute-time check for one participant: the workspace is large enough, and
// for every op that touches it, on its own side(s): the slot exists, the
// buffer's rank and element size match the tensor, the box lies inside the
// buffer, and a staging area (pack >= 0) lies inside the workspace.
::xla::ffi::Error CheckDeviceBuffers(const Schedule& schedule,
                                     int32_t participant,
                                     const DeviceBufferShapes& buffers);

// Checks one side of one op against a buffer of the device on that side (the
// per-op part of CheckDeviceBuffers; transports use it on peers' buffers).
// `kind`/`slot` have been resolved to `buffer` by the caller; for kWorkspace
// pass the tensor's global dims.
::xla::ffi::Error CheckOpEnd(const Schedule& schedule, int32_t op_index,
                             bool src_side, const BufferShape& buffer);

// ---------------------------------------------------------------------------
// Errors. STYLE.md: an ffi::Error carries file:line and the call and peer.
// ---------------------------------------------------------------------------

// Strips the directories of a __FILE__ string.
constexpr std::string_view FileBaseName(std::string_view path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

// "<file>:<line>: <message>".
::xla::ffi::Error MakeError(::xla::ffi::ErrorCode code, std::string_view file,
                            int line, std::string_view message);

// Prefixes an error's message with context, keeping its code.
::xla::ffi::Error AddContext(const ::xla::ffi::Error& error,
                             std::string_view context);

// Builds an ffi::Error with the code `kInvalidArgument`, `kInternal`, ... and
// the current file:line, e.g. JAX_M2N_ERROR(kInvalidArgument, "bad " + x).
#define JAX_M2N_ERROR(code, message)                \
  ::jax_m2n::MakeError(::xla::ffi::ErrorCode::code, \
                       ::jax_m2n::FileBaseName(__FILE__), __LINE__, (message))

// Formats integers for error messages: "[1, 2, 3]".
std::string FormatList(const std::vector<int64_t>& values);

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_SCHEDULE_H_
