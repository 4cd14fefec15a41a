// Scalar floating-point conversions between the types a reshard converts in
// flight (f32, f16, bf16, f8_e4m3fn, f8_e5m2; docs/schedule_format.md, "Type
// codes"), bit for bit what XLA CPU's `convert` (jax `astype`) gives. Host and
// device code (`__host__ __device__` under nvcc): integer arithmetic only, so
// the result never depends on the FPU's rounding or denormal modes. Owns the
// ElemType codes; knows nothing of buffers, schedules or transports.

#ifndef JAX_M2N_XLA_FFI_CONVERT_H_
#define JAX_M2N_XLA_FFI_CONVERT_H_

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define JAX_M2N_HD __host__ __device__ __forceinline__
// Host-device templates that call a caller's functor (host-only or
// device-only): no warning for the side that is never instantiated.
#define JAX_M2N_HD_CALLBACK _Pragma("nv_exec_check_disable")
#else
#define JAX_M2N_HD inline
#define JAX_M2N_HD_CALLBACK
#endif

namespace jax_m2n {

// Element type codes of the schedule (tensor fields src_type / dst_type).
enum class ElemType : int64_t {
  kNone = 0,  // no conversion
  kF32 = 1,
  kF16 = 2,
  kBF16 = 3,
  kF8E4M3FN = 4,
  kF8E5M2 = 5,
};
inline constexpr int64_t kNumElemTypes = 6;

// Bytes per element of `type`; 0 for kNone or an unknown code.
JAX_M2N_HD constexpr int64_t ElemTypeBytes(ElemType type) {
  switch (type) {
    case ElemType::kF32:
      return 4;
    case ElemType::kF16:
    case ElemType::kBF16:
      return 2;
    case ElemType::kF8E4M3FN:
    case ElemType::kF8E5M2:
      return 1;
    default:
      return 0;
  }
}

// "f32", "f16", "bf16", "f8_e4m3fn", "f8_e5m2", "none"; "?" if unknown.
JAX_M2N_HD constexpr const char* ElemTypeName(ElemType type) {
  switch (type) {
    case ElemType::kNone:
      return "none";
    case ElemType::kF32:
      return "f32";
    case ElemType::kF16:
      return "f16";
    case ElemType::kBF16:
      return "bf16";
    case ElemType::kF8E4M3FN:
      return "f8_e4m3fn";
    case ElemType::kF8E5M2:
      return "f8_e5m2";
  }
  return "?";
}

// The unsigned integer that holds one element of `T` (its bit pattern).
template <ElemType T>
using ElemBits = std::conditional_t<
    T == ElemType::kF32, uint32_t,
    std::conditional_t<T == ElemType::kF16 || T == ElemType::kBF16, uint16_t,
                       uint8_t>>;

namespace convert_internal {

// The IEEE-like layout of a narrow type: 1 sign bit, kExp exponent bits, kMan
// mantissa bits. kHasInf: the all-ones exponent holds inf/NaN (f16, bf16,
// e5m2); otherwise (e4m3fn) it holds normal numbers and only S.1111.111 is NaN.
template <ElemType T>
struct Layout;
template <>
struct Layout<ElemType::kF16> {
  static constexpr int kExp = 5, kMan = 10;
  static constexpr bool kHasInf = true;
};
template <>
struct Layout<ElemType::kBF16> {
  static constexpr int kExp = 8, kMan = 7;
  static constexpr bool kHasInf = true;
};
template <>
struct Layout<ElemType::kF8E4M3FN> {
  static constexpr int kExp = 4, kMan = 3;
  static constexpr bool kHasInf = false;
};
template <>
struct Layout<ElemType::kF8E5M2> {
  static constexpr int kExp = 5, kMan = 2;
  static constexpr bool kHasInf = true;
};

// Leading zero bits of a nonzero 32-bit value.
JAX_M2N_HD int CountLeadingZeros32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(v));
#else
  return __builtin_clz(v);
#endif
}

template <ElemType T>
JAX_M2N_HD constexpr bool IsNaN(ElemBits<T> x) {
  if constexpr (T == ElemType::kF32) {
    return (x & 0x7fffffffu) > 0x7f800000u;
  } else {
    using L = Layout<T>;
    constexpr uint32_t kAbs = (1u << (L::kExp + L::kMan)) - 1;
    constexpr uint32_t kInf = ((1u << L::kExp) - 1) << L::kMan;
    if constexpr (L::kHasInf) {
      return (x & kAbs) > kInf;
    } else {
      return (x & kAbs) == kAbs;
    }
  }
}

template <ElemType T>
JAX_M2N_HD constexpr uint32_t SignBit(ElemBits<T> x) {
  constexpr int kBits = 8 * sizeof(ElemBits<T>);
  return (static_cast<uint32_t>(x) >> (kBits - 1)) & 1u;
}

// One step of normalizing a subnormal mantissa v (0 < v < 2^(kMan + 1)):
// shifts v left by kStep, adding kStep to s, if that keeps v below 2^(kMan + 1).
template <int kMan, int kStep>
JAX_M2N_HD constexpr void NormalizeStep(uint32_t& v, uint32_t& s) {
  const bool fits = v < (1u << (kMan + 1 - kStep));
  v = fits ? v << kStep : v;
  s += fits ? static_cast<uint32_t>(kStep) : 0u;
}

// A non-NaN element of T as f32 bits: exact (every value of these types is an
// f32), subnormals kept. Branch-free (selects only), so that loops over it
// vectorize; T's subnormals are normalized by a binary search of shifts, not a
// count of leading zeros (which has no vector instruction before AVX-512).
template <ElemType T>
JAX_M2N_HD constexpr uint32_t DecodeToF32(ElemBits<T> x) {
  if constexpr (T == ElemType::kF32) {
    return x;
  } else if constexpr (T == ElemType::kBF16) {
    return static_cast<uint32_t>(x) << 16;  // f32's exponent: inf, subnormals too
  } else {
    using L = Layout<T>;
    constexpr int kBias = (1 << (L::kExp - 1)) - 1;
    constexpr uint32_t kExpMask = (1u << L::kExp) - 1;
    constexpr uint32_t kManMask = (1u << L::kMan) - 1;
    const uint32_t sign = SignBit<T>(x) << 31;
    const uint32_t ef = (static_cast<uint32_t>(x) >> L::kMan) & kExpMask;
    const uint32_t m = static_cast<uint32_t>(x) & kManMask;
    // A subnormal m * 2^(1 - kBias - kMan) (m != 0): shift m left by s until
    // its leading bit is bit kMan; the value is then 1.(v) * 2^(1 - kBias - s).
    // Steps 8, 4, 2, 1 reach any shift up to 15 >= kMan.
    // (Written out, not a loop: GCC vectorizes no loop that holds a loop.)
    uint32_t v = m, s = 0;
    if constexpr (L::kMan >= 8) NormalizeStep<L::kMan, 8>(v, s);
    if constexpr (L::kMan >= 4) NormalizeStep<L::kMan, 4>(v, s);
    NormalizeStep<L::kMan, 2>(v, s);
    NormalizeStep<L::kMan, 1>(v, s);
    const uint32_t normal = ((ef + (127 - kBias)) << 23) | (m << (23 - L::kMan));
    const uint32_t subnormal =
        m == 0 ? 0u
               : (((128 - kBias) - s) << 23) | ((v & kManMask) << (23 - L::kMan));
    uint32_t bits = ef == 0 ? subnormal : normal;
    if constexpr (L::kHasInf) bits = ef == kExpMask ? 0x7f800000u : bits;
    return sign | bits;
  }
}

// A non-NaN f32 (bits) rounded to T: round to nearest, ties to even, with
// T's subnormals; beyond T's largest finite value: inf (f16, bf16, e5m2) or
// NaN (e4m3fn, which has no inf). Branch-free (selects only), so that loops
// over it vectorize: zero, inf and overflow fall out of the same arithmetic.
template <ElemType T>
JAX_M2N_HD constexpr ElemBits<T> EncodeFromF32(uint32_t x) {
  using L = Layout<T>;
  constexpr int kBias = (1 << (L::kExp - 1)) - 1;
  constexpr int kEmin = 1 - kBias;
  constexpr int kBits = 1 + L::kExp + L::kMan;
  constexpr uint32_t kInf = ((1u << L::kExp) - 1) << L::kMan;
  constexpr uint32_t kNaN = (1u << (L::kExp + L::kMan)) - 1;  // e4m3fn
  const uint32_t sign = (x >> 31) << (kBits - 1);
  const uint32_t abs = x & 0x7fffffffu;
  // Round to nearest even at a shift of kShift: add half a unit less one, plus
  // the kept lsb (a tie then carries only from odd), and shift. A carry out of
  // the mantissa bumps the exponent, as it should.
  constexpr int kShift = 23 - L::kMan;
  uint32_t bits =
      (abs + ((1u << (kShift - 1)) - 1) + ((abs >> kShift) & 1u)) >> kShift;
  if constexpr (kEmin > -126) {
    // f32 normals of T's normal range: the same rounding, exponent rebiased.
    // Below T's smallest normal: T's subnormals, i.e. the significand (with
    // its implicit bit) in units of T's smallest quantum 2^(kEmin - kMan),
    // rounded the same way at a per-element shift (a carry from the largest
    // subnormal makes the smallest normal: exponent field 0 + 1).
    constexpr uint32_t kMinNormal = static_cast<uint32_t>(kEmin + 127) << 23;
    const uint32_t normal = bits - (static_cast<uint32_t>(127 - kBias) << L::kMan);
    const uint32_t ef = abs >> 23;
    const uint32_t sig = (abs & 0x7fffffu) | (ef != 0 ? 0x800000u : 0u);
    // value = sig * 2^(max(ef, 1) - 150); quantum 2^(kEmin - kMan): shift by
    // kShift + (kEmin + 127 - max(ef, 1)), at least kShift + 1 for the elements
    // that take it (the clamp keeps the others' shift in range too); 25
    // already rounds every sig < 2^24 to 0.
    constexpr uint32_t kEfMin = kEmin + 127;
    const uint32_t ef_sub = ef == 0 ? 1u : (ef > kEfMin ? kEfMin : ef);
    uint32_t shift = kShift + kEfMin - ef_sub;
    shift = shift > 25 ? 25u : shift;
    const uint32_t sub =
        (sig + ((1u << (shift - 1)) - 1) + ((sig >> shift) & 1u)) >> shift;
    bits = abs < kMinNormal ? sub : normal;
  }
  if constexpr (L::kHasInf) {
    bits = bits >= kInf ? kInf : bits;
  } else {
    bits = bits > kNaN - 1 ? kNaN : bits;
  }
  return static_cast<ElemBits<T>>(sign | bits);
}

// The NaN XLA CPU's convert makes of a NaN `x` (measured with jax 0.10.2,
// exhaustively over the 16- and 8-bit sources; see docs/schedule_format.md):
// f16 -> f32 and f32 -> f16 quiet the NaN and keep the payload's top bits;
// bf16 -> f32 keeps the bits (shift, no quieting); bf16 -> f16 is f32 -> f16
// of that; every other conversion gives the canonical quiet NaN with x's sign,
// except to e5m2 from f16, bf16 or e4m3fn: 0x7f whatever the sign.
template <ElemType From, ElemType To>
JAX_M2N_HD constexpr ElemBits<To> ConvertNaN(ElemBits<From> x) {
  const uint32_t s = SignBit<From>(x);
  if constexpr (To == ElemType::kF32) {
    if constexpr (From == ElemType::kF16) {
      return (s << 31) | 0x7fc00000u | ((static_cast<uint32_t>(x) & 0x3ffu) << 13);
    } else if constexpr (From == ElemType::kBF16) {
      return static_cast<uint32_t>(x) << 16;
    } else {
      return (s << 31) | 0x7fc00000u;
    }
  } else if constexpr (To == ElemType::kF16) {
    uint32_t f = 0;
    if constexpr (From == ElemType::kF32) {
      f = x;
    } else if constexpr (From == ElemType::kBF16) {
      f = static_cast<uint32_t>(x) << 16;
    } else {
      return static_cast<uint16_t>((s << 15) | 0x7e00u);
    }
    return static_cast<uint16_t>(((f >> 31) << 15) | 0x7e00u |
                                 ((f >> 13) & 0x3ffu));
  } else if constexpr (To == ElemType::kBF16) {
    return static_cast<uint16_t>((s << 15) | 0x7fc0u);
  } else if constexpr (To == ElemType::kF8E4M3FN) {
    return static_cast<uint8_t>((s << 7) | 0x7fu);
  } else {  // kF8E5M2
    if constexpr (From == ElemType::kF32) {
      return static_cast<uint8_t>((s << 7) | 0x7eu);
    } else {
      return static_cast<uint8_t>(0x7fu);
    }
  }
}

}  // namespace convert_internal

// One element of From (its bits) converted to To, as XLA CPU's convert does:
// round to nearest even, subnormals kept, overflow to inf (NaN for e4m3fn),
// NaNs as ConvertNaN says. From == To returns x unchanged.
template <ElemType From, ElemType To>
JAX_M2N_HD constexpr ElemBits<To> ConvertElement(ElemBits<From> x) {
  namespace ci = convert_internal;
  static_assert(From != ElemType::kNone && To != ElemType::kNone,
                "ConvertElement: kNone is not an element type");
  if constexpr (From == To) {
    return x;
  } else if constexpr (From == ElemType::kBF16 && To == ElemType::kF32) {
    return static_cast<uint32_t>(x) << 16;  // exact, NaNs included (as XLA)
  } else if constexpr (From == ElemType::kF32) {
    // Both computed, one selected: no branch in a loop over elements.
    const ElemBits<To> nan = ci::ConvertNaN<From, To>(x);
    const ElemBits<To> value = ci::EncodeFromF32<To>(x);
    return ci::IsNaN<From>(x) ? nan : value;
  } else {
    const ElemBits<To> nan = ci::ConvertNaN<From, To>(x);
    const uint32_t f = ci::DecodeToF32<From>(x);  // some f32 for a NaN x: unused
    ElemBits<To> value;
    if constexpr (To == ElemType::kF32) {
      value = f;
    } else {
      value = ci::EncodeFromF32<To>(f);
    }
    return ci::IsNaN<From>(x) ? nan : value;
  }
}

// Converts n contiguous elements (src and dst must not overlap).
template <ElemType From, ElemType To>
JAX_M2N_HD void ConvertRun(const void* src, void* dst, int64_t n) {
  const ElemBits<From>* s = static_cast<const ElemBits<From>*>(src);
  ElemBits<To>* d = static_cast<ElemBits<To>*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = ConvertElement<From, To>(s[i]);
}

// A compile-time ElemType as a value, for VisitConversion's callback.
template <ElemType T>
struct ElemTypeTag {
  static constexpr ElemType value = T;
};

namespace convert_internal {
JAX_M2N_HD_CALLBACK
template <ElemType From, typename Fn>
JAX_M2N_HD bool VisitTo(ElemType to, Fn&& fn) {
  switch (to) {
    case ElemType::kF32:
      fn(ElemTypeTag<From>{}, ElemTypeTag<ElemType::kF32>{});
      return true;
    case ElemType::kF16:
      fn(ElemTypeTag<From>{}, ElemTypeTag<ElemType::kF16>{});
      return true;
    case ElemType::kBF16:
      fn(ElemTypeTag<From>{}, ElemTypeTag<ElemType::kBF16>{});
      return true;
    case ElemType::kF8E4M3FN:
      fn(ElemTypeTag<From>{}, ElemTypeTag<ElemType::kF8E4M3FN>{});
      return true;
    case ElemType::kF8E5M2:
      fn(ElemTypeTag<From>{}, ElemTypeTag<ElemType::kF8E5M2>{});
      return true;
    default:
      return false;
  }
}
}  // namespace convert_internal

// The runtime dispatcher: calls fn(ElemTypeTag<From>{}, ElemTypeTag<To>{}) for
// the runtime pair (from, to), both in kF32..kF8E5M2 (equal types included:
// ConvertElement is then the identity). Returns false, calling nothing, if
// either is kNone or unknown. E.g.
//   VisitConversion(from, to, [&](auto f, auto t) {
//     ConvertRun<decltype(f)::value, decltype(t)::value>(src, dst, n);
//   });
JAX_M2N_HD_CALLBACK
template <typename Fn>
JAX_M2N_HD bool VisitConversion(ElemType from, ElemType to, Fn&& fn) {
  namespace ci = convert_internal;
  switch (from) {
    case ElemType::kF32:
      return ci::VisitTo<ElemType::kF32>(to, fn);
    case ElemType::kF16:
      return ci::VisitTo<ElemType::kF16>(to, fn);
    case ElemType::kBF16:
      return ci::VisitTo<ElemType::kBF16>(to, fn);
    case ElemType::kF8E4M3FN:
      return ci::VisitTo<ElemType::kF8E4M3FN>(to, fn);
    case ElemType::kF8E5M2:
      return ci::VisitTo<ElemType::kF8E5M2>(to, fn);
    default:
      return false;
  }
}

// A host function converting n contiguous elements, for a runtime pair.
using ConvertRunFn = void (*)(const void* src, void* dst, int64_t n);

// The ConvertRun for (from, to), or nullptr if either is kNone or unknown.
inline ConvertRunFn GetConvertRun(ElemType from, ElemType to) {
  ConvertRunFn out = nullptr;
  VisitConversion(from, to, [&](auto f, auto t) {
    out = &ConvertRun<decltype(f)::value, decltype(t)::value>;
  });
  return out;
}

}  // namespace jax_m2n

#endif  // JAX_M2N_XLA_FFI_CONVERT_H_
