// Strided box copies between dense row-major buffers in host memory, plain or
// converting the element type on the way (xla_ffi/convert.h). Owns the copy
// loop of the CPU transport: dims are collapsed so that each innermost
// contiguous run is one memcpy (or one conversion loop). Knows nothing of
// schedules, devices or threads; never allocates; never checks bounds (callers
// validate boxes).

#ifndef JAX_M2N_XLA_FFI_BOX_COPY_H_
#define JAX_M2N_XLA_FFI_BOX_COPY_H_

#include <cstdint>

#include "xla_ffi/convert.h"

namespace jax_m2n {

// A box inside a dense row-major buffer that is read.
struct ConstBoxRef {
  const void* data = nullptr;     // base of the buffer (not of the box)
  const int64_t* dims = nullptr;  // the buffer's dims, `rank` entries, borrowed
  const int64_t* start = nullptr;  // first index of the box per dim, borrowed
};

// A box inside a dense row-major buffer that is written.
struct BoxRef {
  void* data = nullptr;
  const int64_t* dims = nullptr;
  const int64_t* start = nullptr;
};

// Copies the box of `extent` (`rank` entries) in `src` to the box of the same
// extent in `dst`. Elements are `elem_bytes` opaque bytes (dtype-agnostic).
//
// Preconditions (not checked; DecodeSchedule/CheckOpEnd validate them): both
// boxes lie inside their buffers; source and destination bytes do not overlap.
// rank 0 copies one element; an extent of 0 along any dim copies nothing (and
// then `data` may be null).
//
// Cost: one memcpy per innermost contiguous run, after merging into the run
// every inner dim that is full in both buffers, and merging every pair of outer
// dims that is contiguous in both; e.g. rows [2, 6) of a [8, 6] buffer into a
// [4, 6] buffer is one memcpy of 24 elements.
void CopyBox(const ConstBoxRef& src, const BoxRef& dst, const int64_t* extent,
             int64_t rank, int64_t elem_bytes);

// Like CopyBox, but `src` holds elements of `from` and `dst` elements of `to`,
// each element converted as ConvertElement<from, to> does (bit for bit XLA
// CPU's convert), in one pass: no temporary. Both types in kF32..kF8E5M2
// (from == to copies); otherwise nothing is written. Same preconditions as
// CopyBox; the runs collapse by elements, so a box that is one memcpy for
// CopyBox is one conversion loop here.
void ConvertBox(const ConstBoxRef& src, const BoxRef& dst,
                const int64_t* extent, int64_t rank, ElemType from,
                ElemType to);

// Asks the kernel to back the not-yet-touched pages of [data, data + bytes)
// with transparent huge pages (Linux madvise(MADV_HUGEPAGE) on the 2
// MiB-aligned interior; a no-op elsewhere and for buffers under 4 MiB). XLA
// allocates fresh result buffers per call, and first-touch faults on 4 KiB
// pages can cost more than the copy itself (measured: 64 MiB memcpy into fresh
// memory 227 ms, 7 ms with huge pages); numpy does the same for its large
// arrays. Advice only: it never changes the contents or the validity of the
// memory.
void AdviseHugePages(void* data, int64_t bytes);

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_BOX_COPY_H_
