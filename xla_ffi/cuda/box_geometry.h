// Box geometry shared by the CUDA transports (NCCL: cuda_transport.cc; peer copies:
// peer_transport.cc): a box of a dense row-major buffer collapsed to one contiguous run of
// bytes repeated over a few outer dims, and the widest unit a set of addresses allows.
// Header-only, host code; knows nothing of schedules or CUDA.

#ifndef JAX_M2N_XLA_FFI_CUDA_BOX_GEOMETRY_H_
#define JAX_M2N_XLA_FFI_CUDA_BOX_GEOMETRY_H_

#include <cstdint>

#include "xla_ffi/schedule.h"

namespace jax_m2n {

// A box in a dense row-major buffer, collapsed to a contiguous run repeated over outer
// dims (innermost first), in bytes.
struct Geometry {
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t row_bytes = 0;
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
inline Geometry Collapse(const int64_t* src_dims, const int64_t* src_start, const int64_t* dst_dims,
                  const int64_t* dst_start, const int64_t* extent, int64_t rank,
                  int64_t elem_bytes) {
  static const int64_t kZeros[kMaxRank] = {};
  if (src_dims == nullptr) src_dims = extent, src_start = kZeros;
  if (dst_dims == nullptr) dst_dims = extent, dst_start = kZeros;
  int64_t ss[kMaxRank], ds[kMaxRank];
  Strides(src_dims, rank, elem_bytes, ss);
  Strides(dst_dims, rank, elem_bytes, ds);
  Geometry g;
  for (int64_t d = 0; d < rank; ++d) {
    g.src_offset += src_start[d] * ss[d];
    g.dst_offset += dst_start[d] * ds[d];
  }
  g.row_bytes = elem_bytes;
  int64_t d = rank - 1;
  // The contiguous run: inner dims whose stride equals the run so far on both sides.
  for (; d >= 0; --d) {
    if (extent[d] == 1) continue;
    if (ss[d] != g.row_bytes || ds[d] != g.row_bytes) break;
    g.row_bytes *= extent[d];
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
  return g;
}

inline int MaxVecLog2(uint64_t bits) {
  int v = 0;
  while (v < 4 && (bits & ((uint64_t{2} << v) - 1)) == 0) ++v;
  return v;
}

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_BOX_GEOMETRY_H_
