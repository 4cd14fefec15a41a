// The local data plane's custom calls (docs/schedule_format.md, "The local copy
// schedule"): `jax_m2n_local_copy` fills a device's output arrays with boxes read
// straight from memory another program exported (a pointer table operand), converting
// dtypes on the way; `jax_m2n_local_store` (CUDA only: on CPU numpy's copy is as fast
// and dispatches faster) copies a device's arrays to raw addresses. Owns the local copy
// schedule (decoding, validation: the boxes tile each output exactly), the pointer
// table's check and the CPU handler. Platform-free decoding, shared with the CUDA
// handlers (xla_ffi/cuda/local_copy_cuda.cc); never maps, opens or frees memory.

#ifndef JAX_M2N_XLA_FFI_LOCAL_COPY_H_
#define JAX_M2N_XLA_FFI_LOCAL_COPY_H_

#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/convert.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

// Format constants of the `schedule` attribute of jax_m2n_local_copy.
inline constexpr int64_t kLocalCopyMagic = 0x4C43505F;  // "LCP_"
inline constexpr int64_t kLocalCopyVersion = 1;
inline constexpr int64_t kLocalCopyHeaderWidth = 4;  // magic, version, n_slots, n_outputs
// Bound on every dim, start, extent and byte count: sums and products of two stay in
// int64 while validating.
inline constexpr int64_t kLocalCopyMaxValue = int64_t{1} << 62;

// One box of an output: `extent` elements starting at `src_start` in the source shard
// (a dense row-major array of `src_dims` at pointer-table entry `slot`) land at
// `dst_start` in the output.
struct LocalBox {
  int64_t slot = 0;
  ElemType src_type = ElemType::kNone;  // == the output's type: a plain copy
  int64_t src_elem_bytes = 0;
  std::array<int64_t, kMaxRank> src_dims{};
  std::array<int64_t, kMaxRank> src_start{};
  std::array<int64_t, kMaxRank> dst_start{};
  std::array<int64_t, kMaxRank> extent{};
};

// One output array of the call and the boxes that fill it (exactly: every element by
// one box).
struct LocalOutput {
  ElemType type = ElemType::kNone;  // kNone: opaque elements of elem_bytes
  int64_t elem_bytes = 0;
  int64_t rank = 0;
  std::array<int64_t, kMaxRank> dims{};
  int64_t bytes = 0;
  std::vector<LocalBox> boxes;
};

// A decoded, validated local copy schedule; immutable, safe to share between threads.
struct LocalCopySchedule {
  int64_t n_slots = 0;  // entries the pointer table must have
  std::vector<LocalOutput> outputs;
};

// Decodes and validates the `schedule` attribute: the layout, every value's range,
// every box inside its source shard and its output, a supported type pair, and that
// the boxes of each output tile it exactly (disjoint, volumes summing to the output's).
// Errors name the output, the box, the field and the value.
::xla::ffi::ErrorOr<LocalCopySchedule> DecodeLocalCopySchedule(
    ::xla::ffi::Span<const int64_t> encoded);

// Checks XLA's results against the schedule: their count, dims and element sizes.
::xla::ffi::Error CheckLocalCopyResults(const LocalCopySchedule& schedule,
                                        const ::xla::ffi::RemainingRets& rets);

// The pointer-table operand (operand 0 of both calls): n int64 addresses, as a 1-D
// int64[n] or as their bytes, uint32[2n] (little-endian halves: what JAX passes
// whatever jax_enable_x64 says); any 8-byte-aligned XLA buffer reads as int64[n].
// Returns an error naming the call otherwise.
::xla::ffi::Error CheckPointerTable(const ::xla::ffi::AnyBuffer& table, int64_t n,
                                    const char* call);

// Registers the FFI state type `State` (a struct with `static ffi::TypeId id`) under
// `name` with the calling XLA, once per process; an instantiate handler calls it first,
// so that Python need not register the type (as reshard_cpu.cc does).
template <typename State>
XLA_FFI_Error* RegisterStateTypeOnce(const XLA_FFI_Api* api, const char* name) {
  static std::mutex mu;
  static const XLA_FFI_TypeInfo info = ::xla::ffi::MakeTypeInfo<State>();
  std::lock_guard<std::mutex> lock(mu);
  if (State::id.type_id != 0) return nullptr;
  return ::xla::ffi::Ffi::RegisterTypeId(api, name, &State::id, &info);
}

}  // namespace jax_m2n

// jax_m2n_local_copy on platform cpu, for jax.ffi.register_ffi_target(api_version=1) as
// {"instantiate": capsule, "execute": capsule}:
//   instantiate: attr schedule (int64[]); decodes it (LocalCopySchedule) into the state.
//   execute:     operand 0: int64[n_slots] source pointers (CheckPointerTable) (host addresses readable in
//                this process: each the base of a dense row-major source shard of the
//                dims its boxes name); results: the outputs. Reads the sources, writes
//                each output once; allocates nothing.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nLocalCopyCpuInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxM2nLocalCopyCpuExecute);

#endif  // JAX_M2N_XLA_FFI_LOCAL_COPY_H_
