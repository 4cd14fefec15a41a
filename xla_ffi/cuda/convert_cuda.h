// The CUDA-only variant of the in-flight conversions (docs/cuda_transport.md, "Conversion
// in flight"): XLA GPU lowers `convert` to the hardware's cvt instructions (saturating
// fp8 conversions plus an infinity fix-up, f16 as the hub for fp8), whose NaN results
// differ from XLA CPU's (xla_ffi/convert.h). This header mirrors that lowering with the
// same instructions so that a reshard converts bit for bit like `astype` on the GPU.
// Device code only (included by pack.cu.cc); below sm_89 it falls back to convert.h.

#ifndef JAX_M2N_XLA_FFI_CUDA_CONVERT_CUDA_H_
#define JAX_M2N_XLA_FFI_CUDA_CONVERT_CUDA_H_

#include <cstdint>

#include "xla_ffi/convert.h"

namespace jax_m2n {
namespace convert_cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890

__device__ __forceinline__ uint16_t F32ToF16(uint32_t x) {
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(__uint_as_float(x)));
  return r;
}

__device__ __forceinline__ uint16_t F32ToBF16(uint32_t x) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(__uint_as_float(x)));
  return r;
}

__device__ __forceinline__ uint32_t F16ToF32(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return __float_as_uint(f);
}

__device__ __forceinline__ uint32_t BF16ToF32(uint16_t h) {
#if __CUDA_ARCH__ >= 900
  float f;
  asm("cvt.f32.bf16 %0, %1;" : "=f"(f) : "h"(h));
  return __float_as_uint(f);
#else
  return static_cast<uint32_t>(h) << 16;
#endif
}

// XLA's fix-up after a saturating fp8 conversion: inputs (|bits|) above the largest value
// that still rounds to a finite one, up to and including infinity, give infinity (NaN for
// e4m3fn, which has none) with the input's sign.
template <ElemType To, int kSrcMan, int kSrcBias, uint32_t kSrcInf>
__device__ __forceinline__ uint8_t FixInfinity(uint32_t src, int src_bits, uint8_t res) {
  constexpr int kDstMan = To == ElemType::kF8E4M3FN ? 3 : 2;
  constexpr int kDstBias = To == ElemType::kF8E4M3FN ? 7 : 15;
  constexpr uint32_t kLargest = To == ElemType::kF8E4M3FN ? 0x7e : 0x7b;
  constexpr uint8_t kInf = To == ElemType::kF8E4M3FN ? 0x7f : 0x7c;
  constexpr uint32_t kLower =
      ((kLargest << (kSrcMan - kDstMan)) + (uint32_t{kSrcBias - kDstBias} << kSrcMan)) |
      ((1u << (kSrcMan - kDstMan - 1)) - (kLargest & 1u));
  const uint32_t sign = src >> (src_bits - 1);
  const uint32_t abs = src & ((1u << (src_bits - 1)) - 1u);
  if (abs > kLower && abs <= kSrcInf) return static_cast<uint8_t>(kInf | (sign << 7));
  return res;
}

template <ElemType To>
__device__ __forceinline__ uint8_t F32ToF8(uint32_t x) {
  uint16_t r;
  const float f = __uint_as_float(x);
  if constexpr (To == ElemType::kF8E4M3FN) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(r) : "f"(f));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %1;" : "=h"(r) : "f"(f));
  }
  return FixInfinity<To, 23, 127, 0x7f800000u>(x, 32, static_cast<uint8_t>(r & 0xff));
}

template <ElemType To>
__device__ __forceinline__ uint8_t F16ToF8(uint16_t h) {
  uint16_t r;
  const uint32_t pair = static_cast<uint32_t>(h) | (static_cast<uint32_t>(h) << 16);
  if constexpr (To == ElemType::kF8E4M3FN) {
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(pair));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;" : "=h"(r) : "r"(pair));
  }
  return FixInfinity<To, 10, 15, 0x7c00u>(h, 16, static_cast<uint8_t>(r & 0xff));
}

template <ElemType From>
__device__ __forceinline__ uint16_t F8ToF16(uint8_t b) {
  uint32_t r;
  const uint16_t in = b;
  if constexpr (From == ElemType::kF8E4M3FN) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(in));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(in));
  }
  return static_cast<uint16_t>(r & 0xffff);
}

// Any source to f32 the way XLA GPU extends it (fp8 through f16).
template <ElemType From>
__device__ __forceinline__ uint32_t ToF32(ElemBits<From> x) {
  if constexpr (From == ElemType::kF32) {
    return x;
  } else if constexpr (From == ElemType::kF16) {
    return F16ToF32(x);
  } else if constexpr (From == ElemType::kBF16) {
    return BF16ToF32(x);
  } else {
    return F16ToF32(F8ToF16<From>(x));
  }
}

template <ElemType T>
inline constexpr bool kIsF8 = T == ElemType::kF8E4M3FN || T == ElemType::kF8E5M2;

// One element as XLA GPU (sm_89+) converts it.
template <ElemType From, ElemType To>
__device__ __forceinline__ ElemBits<To> ConvertElementXlaGpu(ElemBits<From> x) {
  if constexpr (From == To) {
    return x;
  } else if constexpr (kIsF8<To>) {
    if constexpr (From == ElemType::kF16) {
      return F16ToF8<To>(x);
    } else if constexpr (kIsF8<From>) {
      return F16ToF8<To>(F8ToF16<From>(x));
    } else {
      return F32ToF8<To>(ToF32<From>(x));
    }
  } else if constexpr (kIsF8<From> && To == ElemType::kF16) {
    return F8ToF16<From>(x);
  } else if constexpr (To == ElemType::kF32) {
    return ToF32<From>(x);
  } else if constexpr (To == ElemType::kF16) {
    return F32ToF16(ToF32<From>(x));
  } else {  // kBF16
    return F32ToBF16(ToF32<From>(x));
  }
}

#else  // below sm_89 (no fp8 cvt instructions): XLA GPU emulates; convert.h's semantics

template <ElemType From, ElemType To>
__device__ __forceinline__ ElemBits<To> ConvertElementXlaGpu(ElemBits<From> x) {
  return ConvertElement<From, To>(x);
}

#endif

}  // namespace convert_cuda
}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CUDA_CONVERT_CUDA_H_
