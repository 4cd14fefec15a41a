// Box geometry shared by the CUDA transports (NCCL: cuda_transport.cc; peer copies:
// peer_transport.cc): a box of a dense row-major buffer collapsed to one contiguous run
// repeated over a few outer dims, with element sizes that may differ between the two sides
// (a converting copy), and the one place that turns it into a copy-kernel task (pack.h)
// with the widest unit its addresses allow. Header-only, host code; no CUDA calls.

#ifndef JAX_M2N_XLA_FFI_CUDA_BOX_GEOMETRY_H_
#define JAX_M2N_XLA_FFI_CUDA_BOX_GEOMETRY_H_

#include <algorithm>
#include <cstdint>

#include "xla_ffi/convert.h"
#include "xla_ffi/cuda/pack.h"
#include "xla_ffi/schedule.h"

namespace jax_m2n {

// A box in a dense row-major buffer, collapsed to a contiguous run repeated over outer
// dims (innermost first). Offsets and strides in bytes of their side; the run is
// `row_elems` elements, `row_bytes` bytes on the source side (the same on both sides
// unless the element sizes differ).
struct Geometry {
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t row_bytes = 0;
  int64_t row_elems = 0;
  int64_t src_elem_bytes = 0;
  int64_t dst_elem_bytes = 0;
  int n_outer = 0;
  int64_t extent[kMaxRank] = {};
  int64_t src_stride[kMaxRank] = {};
  int64_t dst_stride[kMaxRank] = {};

  int64_t rows() const {
    int64_t r = 1;
    for (int k = 0; k < n_outer; ++k) r *= extent[k];
    return r;
  }
};

inline void Strides(const int64_t* dims, int64_t rank, int64_t elem_bytes, int64_t* stride) {
  int64_t s = elem_bytes;
  for (int64_t d = rank - 1; d >= 0; --d) {
    stride[d] = s;
    s *= dims[d];
  }
}

// `src_dims`/`dst_dims` null = a dense buffer of exactly the box (a staging area).
// Elements are `src_elem_bytes` wide in the source buffer, `dst_elem_bytes` in the
// destination (equal unless the copy converts).
inline Geometry Collapse(const int64_t* src_dims, const int64_t* src_start,
                         const int64_t* dst_dims, const int64_t* dst_start,
                         const int64_t* extent, int64_t rank, int64_t src_elem_bytes,
                         int64_t dst_elem_bytes) {
  static const int64_t kZeros[kMaxRank] = {};
  if (src_dims == nullptr) src_dims = extent, src_start = kZeros;
  if (dst_dims == nullptr) dst_dims = extent, dst_start = kZeros;
  // In elements first: which dims merge does not depend on the element sizes.
  int64_t ss[kMaxRank], ds[kMaxRank];
  Strides(src_dims, rank, 1, ss);
  Strides(dst_dims, rank, 1, ds);
  Geometry g;
  for (int64_t d = 0; d < rank; ++d) {
    g.src_offset += src_start[d] * ss[d];
    g.dst_offset += dst_start[d] * ds[d];
  }
  g.row_elems = 1;
  int64_t d = rank - 1;
  // The contiguous run: inner dims whose stride equals the run so far on both sides.
  for (; d >= 0; --d) {
    if (extent[d] == 1) continue;
    if (ss[d] != g.row_elems || ds[d] != g.row_elems) break;
    g.row_elems *= extent[d];
  }
  // Outer dims, merging neighbours that are contiguous on both sides.
  for (; d >= 0; --d) {
    if (extent[d] == 1) continue;
    if (g.n_outer > 0) {
      const int k = g.n_outer - 1;
      if (ss[d] == g.src_stride[k] * g.extent[k] && ds[d] == g.dst_stride[k] * g.extent[k]) {
        g.extent[k] *= extent[d];
        continue;
      }
    }
    g.extent[g.n_outer] = extent[d];
    g.src_stride[g.n_outer] = ss[d];
    g.dst_stride[g.n_outer] = ds[d];
    ++g.n_outer;
  }
  g.src_elem_bytes = src_elem_bytes;
  g.dst_elem_bytes = dst_elem_bytes;
  g.src_offset *= src_elem_bytes;
  g.dst_offset *= dst_elem_bytes;
  g.row_bytes = g.row_elems * src_elem_bytes;
  for (int k = 0; k < g.n_outer; ++k) {
    g.src_stride[k] *= src_elem_bytes;
    g.dst_stride[k] *= dst_elem_bytes;
  }
  return g;
}

inline Geometry Collapse(const int64_t* src_dims, const int64_t* src_start,
                         const int64_t* dst_dims, const int64_t* dst_start,
                         const int64_t* extent, int64_t rank, int64_t elem_bytes) {
  return Collapse(src_dims, src_start, dst_dims, dst_start, extent, rank, elem_bytes,
                  elem_bytes);
}

inline int MaxVecLog2(uint64_t bits) {
  int v = 0;
  while (v < 4 && (bits & ((uint64_t{2} << v) - 1)) == 0) ++v;
  return v;
}

// The copy-kernel task moving box `g` from `src` to `dst` (device pointers of the box's
// first element on each side, offsets already applied), converting from `src_type` to
// `dst_type` when they differ (ElemType codes; equal: a plain copy). The unit is the
// widest that the row, the strides and both pointers allow (per call: pointers change).
inline CopyTask BoxCopyTask(const Geometry& g, const char* src, char* dst,
                            ElemType src_type = ElemType::kNone,
                            ElemType dst_type = ElemType::kNone) {
  CopyTask t;
  t.src = src;
  t.dst = dst;
  t.src_type = static_cast<int32_t>(src_type);
  t.dst_type = static_cast<int32_t>(dst_type);
  t.rows = static_cast<uint64_t>(g.rows());
  t.n_outer = g.n_outer;
  for (int k = 0; k < kCopyMaxOuterDims; ++k) {
    t.extent[k] = k < g.n_outer ? static_cast<uint64_t>(g.extent[k]) : 1;
    t.src_stride[k] = k < g.n_outer ? g.src_stride[k] : 0;
    t.dst_stride[k] = k < g.n_outer ? g.dst_stride[k] : 0;
  }
  if (src_type == dst_type) {
    uint64_t bits = static_cast<uint64_t>(g.row_bytes) | reinterpret_cast<uintptr_t>(src) |
                    reinterpret_cast<uintptr_t>(dst);
    for (int k = 0; k < g.n_outer; ++k) {
      bits |= static_cast<uint64_t>(g.src_stride[k]) | static_cast<uint64_t>(g.dst_stride[k]);
    }
    t.vec_log2 = MaxVecLog2(bits);
    t.row_units = static_cast<uint64_t>(g.row_bytes) >> t.vec_log2;
    return t;
  }
  // Converting: up to 8 elements per unit, each side's unit aligned to its own bytes.
  uint64_t elems = static_cast<uint64_t>(g.row_elems);
  for (int k = 0; k < g.n_outer; ++k) {
    elems |= static_cast<uint64_t>(g.src_stride[k] / g.src_elem_bytes) |
             static_cast<uint64_t>(g.dst_stride[k] / g.dst_elem_bytes);
  }
  int v = std::min(MaxVecLog2(elems), kConvertMaxVecLog2);
  while (v > 0 && ((reinterpret_cast<uintptr_t>(src) % (g.src_elem_bytes << v)) != 0 ||
                   (reinterpret_cast<uintptr_t>(dst) % (g.dst_elem_bytes << v)) != 0)) {
    --v;
  }
  t.vec_log2 = v;
  t.row_units = static_cast<uint64_t>(g.row_elems) >> v;
  return t;
}

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_BOX_GEOMETRY_H_
