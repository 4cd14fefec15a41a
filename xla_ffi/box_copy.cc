// Strided box copies on host memory: collapse the box into (outer dims x one
// contiguous run) and memcpy (or convert) each run. Hot path of the CPU
// transport: no allocation, no per-element loop except for runs of one element
// and conversions.

#include "xla_ffi/box_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace jax_m2n {
namespace {

constexpr int kMaxDims = 8;

// A box copy reduced to `n` outer dims (outermost first) around one contiguous
// run of `run` bytes.
struct Collapsed {
  bool empty = false;
  int n = 0;
  int64_t extent[kMaxDims];
  int64_t src_stride[kMaxDims];  // bytes
  int64_t dst_stride[kMaxDims];  // bytes
  int64_t run = 0;               // bytes per memcpy
  int64_t src_offset = 0;        // bytes from the buffer base to the box
  int64_t dst_offset = 0;
};

Collapsed Collapse(const int64_t* src_dims, const int64_t* src_start,
                   const int64_t* dst_dims, const int64_t* dst_start,
                   const int64_t* extent, int64_t rank, int64_t elem_bytes) {
  Collapsed c;
  int64_t ss[kMaxDims], ds[kMaxDims];
  int64_t s = elem_bytes, t = elem_bytes;
  for (int64_t d = rank - 1; d >= 0; --d) {
    if (extent[d] == 0) {
      c.empty = true;
      return c;
    }
    ss[d] = s;
    ds[d] = t;
    s *= src_dims[d];
    t *= dst_dims[d];
  }
  for (int64_t d = 0; d < rank; ++d) {
    c.src_offset += src_start[d] * ss[d];
    c.dst_offset += dst_start[d] * ds[d];
  }
  // The innermost run: dims of extent 1 do not break contiguity; a dim joins
  // the run while its stride equals the run's length in both buffers (i.e.
  // every inner dim is full in both).
  int64_t run = elem_bytes;
  int64_t d = rank - 1;
  for (; d >= 0; --d) {
    if (extent[d] == 1) continue;
    if (ss[d] != run || ds[d] != run) break;
    run *= extent[d];
  }
  c.run = run;
  // Outer dims, outermost first, merging neighbours contiguous in both buffers.
  for (int64_t k = 0; k <= d; ++k) {
    if (extent[k] == 1) continue;
    if (c.n > 0) {
      const int last = c.n - 1;
      if (c.src_stride[last] == extent[k] * ss[k] &&
          c.dst_stride[last] == extent[k] * ds[k]) {
        c.extent[last] *= extent[k];
        c.src_stride[last] = ss[k];
        c.dst_stride[last] = ds[k];
        continue;
      }
    }
    c.extent[c.n] = extent[k];
    c.src_stride[c.n] = ss[k];
    c.dst_stride[c.n] = ds[k];
    ++c.n;
  }
  return c;
}

// Innermost outer dim: `rows` runs of `run` bytes. Fixed small sizes let the
// compiler turn memcpy into one load/store.
template <int64_t kRun>
void CopyRowsFixed(const char* src, char* dst, int64_t rows, int64_t src_stride,
                   int64_t dst_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(dst, src, kRun);
    src += src_stride;
    dst += dst_stride;
  }
}

void CopyRows(const char* src, char* dst, int64_t rows, int64_t run,
              int64_t src_stride, int64_t dst_stride) {
  switch (run) {
    case 1:
      return CopyRowsFixed<1>(src, dst, rows, src_stride, dst_stride);
    case 2:
      return CopyRowsFixed<2>(src, dst, rows, src_stride, dst_stride);
    case 4:
      return CopyRowsFixed<4>(src, dst, rows, src_stride, dst_stride);
    case 8:
      return CopyRowsFixed<8>(src, dst, rows, src_stride, dst_stride);
    case 16:
      return CopyRowsFixed<16>(src, dst, rows, src_stride, dst_stride);
    default:
      for (int64_t i = 0; i < rows; ++i) {
        std::memcpy(dst, src, run);
        src += src_stride;
        dst += dst_stride;
      }
  }
}

// ConvertRun's loop, built for vectorizing: at Bazel's -O2, GCC's cheap cost
// model leaves it scalar; the branch-free conversions of convert.h then run
// about 2x faster (f32 -> bf16: 16 Mi elements in ~13 ms instead of ~25 ms),
// and an AVX2 clone (picked at load time where the CPU has it) 2x again; an
// x86-64-v4 (AVX-512) clone takes 1.5x off the f32 -> f8 and f16 -> f32 loops.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define JAX_M2N_VECTORIZE                  \
  __attribute__((optimize("O3"),           \
                 target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__GNUC__) && !defined(__clang__)
#define JAX_M2N_VECTORIZE __attribute__((optimize("O3")))
#else
#define JAX_M2N_VECTORIZE
#endif

template <ElemType From, ElemType To>
JAX_M2N_VECTORIZE void ConvertRunCpu(const void* src, void* dst, int64_t n) {
  const ElemBits<From>* s = static_cast<const ElemBits<From>*>(src);
  ElemBits<To>* d = static_cast<ElemBits<To>*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = ConvertElement<From, To>(s[i]);
}

// f16 -> e5m2: e5m2 is f16's top byte, so the conversion is a round to nearest
// even of the f16 bits at a fixed shift of 8 (subnormals, carries into the
// exponent and overflow to inf included) in 16-bit lanes, plus the NaN rule.
// Bit for bit ConvertElement<kF16, kF8E5M2> (tests/dtype_test.py: every f16).
JAX_M2N_VECTORIZE void ConvertF16ToE5M2(const void* src, void* dst, int64_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t abs = s[i] & 0x7fffu;
    uint16_t r = static_cast<uint16_t>(abs + 0x7fu + ((abs >> 8) & 1u)) >> 8;
    r = r > 0x7cu ? 0x7cu : r;
    r |= (s[i] >> 8) & 0x80u;
    d[i] = static_cast<uint8_t>(abs > 0x7c00u ? 0x7fu : r);  // NaN: 0x7f
  }
}

// An f8 element (From: e4m3fn or e5m2) to f16 (To16 = kF16) or bf16 bits, for
// From's non-NaN values that are To16 normals or zero: every e4m3fn value in
// both, every e5m2 value in bf16 (e5m2's subnormals are f16 subnormals: e5m2
// -> f16 is a shift instead). Exact, in 16-bit lanes: a normal is rebiased by
// one add; a subnormal m * 2^(1 - bias - kMan) is normalized by two shift
// steps (convert.h's NormalizeStep); e5m2's inf is selected.
template <ElemType From, ElemType To16>
inline uint16_t F8ToWide16(uint8_t x) {
  using S = convert_internal::Layout<From>;
  using D = convert_internal::Layout<To16>;
  constexpr uint32_t kSrcBias = (1u << (S::kExp - 1)) - 1;
  constexpr uint32_t kDstBias = (1u << (D::kExp - 1)) - 1;
  constexpr uint32_t kManMask = (1u << S::kMan) - 1;
  constexpr int kUp = D::kMan - S::kMan;
  // Every value 16 bits wide, so that GCC vectorizes in 16-bit lanes.
  const uint16_t abs = x & 0x7fu;
  const uint16_t m = abs & kManMask;
  // The subnormal's value 1.(v) * 2^(1 - kSrcBias - s), s in 1..kMan: steps
  // of 2 and 1 as in convert.h's NormalizeStep, with the exponent field
  // (kDstBias + 1 - kSrcBias - s) counted down instead of s up.
  constexpr uint16_t kE0 = kDstBias + 1 - kSrcBias;
  const bool fits2 = m < (1u << (S::kMan - 1));
  uint16_t v = fits2 ? static_cast<uint16_t>(m << 2) : m;
  uint16_t e = fits2 ? static_cast<uint16_t>(kE0 - 2) : kE0;
  const bool fits1 = v < (1u << S::kMan);
  v = fits1 ? static_cast<uint16_t>(v << 1) : v;
  e = fits1 ? static_cast<uint16_t>(e - 1) : e;
  const uint16_t normal = static_cast<uint16_t>(
      (abs << kUp) + ((kDstBias - kSrcBias) << D::kMan));
  const uint16_t sub = static_cast<uint16_t>(
      (e << D::kMan) | ((v & kManMask) << kUp));
  uint16_t r = (abs >> S::kMan) == 0 ? sub : normal;
  r = abs == 0 ? static_cast<uint16_t>(0) : r;
  if constexpr (S::kHasInf) {
    constexpr uint16_t kInf = ((1u << D::kExp) - 1) << D::kMan;
    r = abs == (((1u << S::kExp) - 1) << S::kMan) ? kInf : r;
  }
  return static_cast<uint16_t>(((x & 0x80u) << 8) | r);
}

// f8 -> f16, bf16, f32 (bf16 << 16: every f8 value is a bf16, and the NaN
// rules agree) and e4m3fn -> e5m2 (through f16, exact, then the f16 -> e5m2
// rounding): 16-bit lanes, bit for bit ConvertElement.
template <ElemType From, ElemType To>
JAX_M2N_VECTORIZE void ConvertF8Run(const void* src, void* dst, int64_t n) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  ElemBits<To>* d = static_cast<ElemBits<To>*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t x = s[i];
    const bool nan = convert_internal::IsNaN<From>(x);
    if constexpr (To == ElemType::kF16 && From == ElemType::kF8E5M2) {
      const uint16_t value = static_cast<uint16_t>(x << 8);  // f16's top byte
      d[i] = nan ? convert_internal::ConvertNaN<From, To>(x) : value;
    } else if constexpr (To == ElemType::kF16 || To == ElemType::kBF16) {
      const uint16_t value = F8ToWide16<From, To>(x);
      d[i] = nan ? convert_internal::ConvertNaN<From, To>(x) : value;
    } else if constexpr (To == ElemType::kF32) {
      const uint16_t value = F8ToWide16<From, ElemType::kBF16>(x);
      const uint16_t nan16 = convert_internal::ConvertNaN<From, ElemType::kBF16>(x);
      d[i] = static_cast<uint32_t>(nan ? nan16 : value) << 16;
    } else {  // e4m3fn -> e5m2
      static_assert(From == ElemType::kF8E4M3FN && To == ElemType::kF8E5M2);
      const uint16_t h = F8ToWide16<From, ElemType::kF16>(x);
      const uint16_t abs = h & 0x7fffu;
      uint16_t r = static_cast<uint16_t>(abs + 0x7fu + ((abs >> 8) & 1u)) >> 8;
      r = r > 0x7cu ? 0x7cu : r;
      r |= (h >> 8) & 0x80u;
      d[i] = static_cast<uint8_t>(nan ? 0x7fu : r);  // ConvertNaN: 0x7f
    }
  }
}

// e4m3fn -> e5m2 in 8-bit lanes: a normal rounds at a fixed shift of 1 and is
// rebiased (+8 in the exponent; nothing overflows: 448 is an e5m2); a
// subnormal m * 2^-9 is an e5m2 normal with at most 2 significant bits after
// its leading one, so it is normalized (steps of 2 and 1) with no rounding.
// e4m3fn's NaN gives 0x7f whatever its sign (ConvertNaN).
JAX_M2N_VECTORIZE void ConvertE4M3ToE5M2(const void* src, void* dst,
                                         int64_t n) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t x = s[i];
    const uint8_t abs = x & 0x7fu;
    const uint8_t normal =
        static_cast<uint8_t>(((abs + ((abs >> 1) & 1u)) >> 1) + 0x20u);
    // Subnormal: v = m << k with bit 3 set, e5m2 exponent field 9 - k.
    uint8_t v = abs, e = 9;
    bool fits = v < 4;
    v = fits ? static_cast<uint8_t>(v << 2) : v;
    e = fits ? static_cast<uint8_t>(e - 2) : e;
    fits = v < 8;
    v = fits ? static_cast<uint8_t>(v << 1) : v;
    e = fits ? static_cast<uint8_t>(e - 1) : e;
    const uint8_t sub = static_cast<uint8_t>((e << 2) | ((v & 7u) >> 1));
    uint8_t r = abs < 8 ? sub : normal;
    r = abs == 0 ? static_cast<uint8_t>(0) : r;
    r = static_cast<uint8_t>((x & 0x80u) | r);
    d[i] = abs == 0x7fu ? static_cast<uint8_t>(0x7fu) : r;
  }
}

// A non-NaN f16 or bf16 (From) rounded to an f8 (To), as EncodeFromF32 does
// (nearest even, To's subnormals, overflow to inf or e4m3fn's NaN), in 16-bit
// lanes with no per-element shift: a normal of To rounds at the fixed shift
// kMan(From) - kMan(To) and is rebiased; below To's smallest normal the
// significand is first scaled by 2^t (t in 0..kMan(To), a multiply; t < 0:
// the result is 0) so that To's quantum sits at bit kMan(From) + 1.
template <ElemType From, ElemType To>
inline uint8_t Narrow16ToF8(uint16_t x) {
  using S = convert_internal::Layout<From>;
  using D = convert_internal::Layout<To>;
  constexpr int kSrcBias = (1 << (S::kExp - 1)) - 1;
  constexpr int kDstBias = (1 << (D::kExp - 1)) - 1;
  constexpr int kDstEmin = 1 - kDstBias;
  constexpr int kShift = S::kMan - D::kMan;
  constexpr uint16_t kMinNormal = (kSrcBias + kDstEmin) << S::kMan;
  const uint16_t abs = x & 0x7fffu;
  const uint16_t r = static_cast<uint16_t>(
      abs + ((1u << (kShift - 1)) - 1) + ((abs >> kShift) & 1u)) >> kShift;
  const uint16_t normal =
      static_cast<uint16_t>(r - ((kSrcBias - kDstBias) << D::kMan));
  // Subnormal of To: q = RNE(sig * 2^t / 2^(kMan(From) + 1)), where
  // t = ef + 1 + kMan(To) - kSrcBias - kDstEmin (t > kMan(To) is a normal).
  const uint16_t ef = abs >> S::kMan;
  const uint16_t sig = (abs & ((1u << S::kMan) - 1)) | (1u << S::kMan);
  constexpr int kT0 = kSrcBias + kDstEmin - 1 - D::kMan;  // ef with t = 0
  // p = 2^t, 0 for t < 0 (and for ef == 0: From's subnormals); a sum of
  // compares, not a chain of selects (which GCC turns into branches).
  static_assert(kT0 >= 1 && D::kMan <= 3, "Narrow16ToF8: t out of range");
  const uint16_t p = static_cast<uint16_t>(
      (ef == kT0) | ((ef == kT0 + 1) << 1) | ((ef == kT0 + 2) << 2) |
      (D::kMan >= 3 ? (ef == kT0 + 3) << 3 : 0));
  const uint16_t w = static_cast<uint16_t>(sig * p);
  constexpr int kQ = S::kMan + 1;
  const uint16_t sub = static_cast<uint16_t>(
      w + ((1u << (kQ - 1)) - 1) + ((w >> kQ) & 1u)) >> kQ;
  uint16_t bits = abs < kMinNormal ? sub : normal;
  if constexpr (D::kHasInf) {
    constexpr uint16_t kInf = ((1u << D::kExp) - 1) << D::kMan;
    bits = bits >= kInf ? kInf : bits;
  } else {
    bits = bits > 0x7eu ? 0x7fu : bits;  // e4m3fn: no inf, overflow is NaN
  }
  return static_cast<uint8_t>(((x >> 8) & 0x80u) | bits);
}

// f16, bf16 -> e4m3fn, bf16 -> e5m2 (f16 -> e5m2: ConvertF16ToE5M2) and
// e5m2 -> e4m3fn (through f16: e5m2 is f16's top byte): Narrow16ToF8 and the
// NaN rule, bit for bit ConvertElement.
template <ElemType From, ElemType To>
JAX_M2N_VECTORIZE void ConvertNarrowRun(const void* src, void* dst, int64_t n) {
  const ElemBits<From>* s = static_cast<const ElemBits<From>*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const ElemBits<From> x = s[i];
    const uint8_t nan = convert_internal::ConvertNaN<From, To>(x);
    uint8_t value;
    if constexpr (From == ElemType::kF8E5M2) {
      value = Narrow16ToF8<ElemType::kF16, To>(static_cast<uint16_t>(x << 8));
    } else {
      value = Narrow16ToF8<From, To>(x);
    }
    d[i] = convert_internal::IsNaN<From>(x) ? nan : value;
  }
}

// f16 -> bf16 in 16-bit lanes: a normal rounds at a fixed shift of 3 and is
// rebiased; a subnormal m * 2^-24 (a bf16 normal) is normalized by shift steps
// of 8, 4, 2, 1 and then rounded the same way; inf and NaN are selected.
// Bit for bit ConvertElement<kF16, kBF16>.
JAX_M2N_VECTORIZE void ConvertF16ToBF16(const void* src, void* dst, int64_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t x = s[i];
    const uint16_t abs = x & 0x7fffu;
    const uint16_t normal = static_cast<uint16_t>(
        ((abs + 3u + ((abs >> 3) & 1u)) >> 3) + (112u << 7));
    // Subnormal: v = m << k with bit 10 set, value 1.(v) * 2^(-14 - k),
    // bf16 exponent field 113 - k; e counts it down from 112 (= field - 1,
    // since the rounded significand keeps its leading bit).
    uint16_t v = abs, e = 112;
    bool fits = v < (1u << 3);
    v = fits ? static_cast<uint16_t>(v << 8) : v;
    e = fits ? static_cast<uint16_t>(e - 8) : e;
    fits = v < (1u << 7);
    v = fits ? static_cast<uint16_t>(v << 4) : v;
    e = fits ? static_cast<uint16_t>(e - 4) : e;
    fits = v < (1u << 9);
    v = fits ? static_cast<uint16_t>(v << 2) : v;
    e = fits ? static_cast<uint16_t>(e - 2) : e;
    fits = v < (1u << 10);
    v = fits ? static_cast<uint16_t>(v << 1) : v;
    e = fits ? static_cast<uint16_t>(e - 1) : e;
    const uint16_t sub = static_cast<uint16_t>(
        (e << 7) + ((v + 3u + ((v >> 3) & 1u)) >> 3));
    uint16_t r = abs < 0x400u ? sub : normal;
    r = abs == 0 ? static_cast<uint16_t>(0) : r;
    r = abs == 0x7c00u ? static_cast<uint16_t>(0x7f80u) : r;
    r = static_cast<uint16_t>((x & 0x8000u) | r);
    d[i] = abs > 0x7c00u ? static_cast<uint16_t>((x & 0x8000u) | 0x7fc0u) : r;
  }
}

// f32 -> f16 and bf16 -> f16 (through its f32 bits) by the F16C instruction
// vcvtps2ph with its rounding in the immediate (nearest even: MXCSR's rounding
// mode plays no part; its FTZ neither, and DAZ only zeroes f32 subnormals,
// which round to +-0 in f16 anyway), 8 elements at a time; its NaN (quieted,
// the payload's top bits kept) is ConvertNaN's. Checked bit for bit against
// ConvertElement over every f32 with MXCSR's FTZ and DAZ off and on. The
// generic loop (32-bit integer lanes) takes 2-3x longer.
#if defined(__GNUC__) && defined(__x86_64__)
#define JAX_M2N_HAVE_F16C 1
template <ElemType From>
__attribute__((target("avx2,f16c"))) void ConvertToF16F16c(const void* src,
                                                          void* dst,
                                                          int64_t n) {
  const ElemBits<From>* s = static_cast<const ElemBits<From>*>(src);
  uint16_t* d = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 f;
    if constexpr (From == ElemType::kF32) {
      f = _mm256_loadu_ps(reinterpret_cast<const float*>(s + i));
    } else {  // bf16: its f32 bits
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) d[i] = ConvertElement<From, ElemType::kF16>(s[i]);
}

// f16 -> f32 by vcvtph2ps: exact (no rounding), subnormals kept whatever
// MXCSR says, NaNs quieted with their payload (ConvertNaN<kF16, kF32>).
__attribute__((target("avx2,f16c"))) void ConvertF16ToF32F16c(const void* src,
                                                             void* dst,
                                                             int64_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  uint32_t* d = static_cast<uint32_t*>(dst);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(reinterpret_cast<float*>(d + i), _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = ConvertElement<ElemType::kF16, ElemType::kF32>(s[i]);
}

bool HaveF16c() {
  static const bool have =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return have;
}
#endif

template <ElemType T>
inline constexpr bool kIsF8 = T == ElemType::kF8E4M3FN || T == ElemType::kF8E5M2;

// The loop of each pair. Every one is bit for bit ConvertElement (checked
// over every 8/16-bit source and every f32, for each clone); the special ones
// exist because GCC vectorizes convert.h's generic code in 32-bit lanes only:
// f32 sources and f16/bf16 -> f32, bf16 -> f16 keep it (f32 -> f8: 16 Mi
// elements in ~6.5 ms with the v4 clone, was ~50 ms scalar), the others run in
// 16-bit lanes (e.g. f16 -> e5m2 ~1.8 ms, f16/bf16 -> e4m3fn ~5 ms).
ConvertRunFn GetConvertRunCpu(ElemType from, ElemType to) {
  ConvertRunFn out = nullptr;
  VisitConversion(from, to, [&](auto f, auto t) {
    constexpr ElemType kFrom = decltype(f)::value, kTo = decltype(t)::value;
    if constexpr ((kFrom == ElemType::kF32 || kFrom == ElemType::kBF16) &&
                  kTo == ElemType::kF16) {
#if defined(JAX_M2N_HAVE_F16C)
      out = HaveF16c() ? &ConvertToF16F16c<kFrom> : &ConvertRunCpu<kFrom, kTo>;
#else
      out = &ConvertRunCpu<kFrom, kTo>;
#endif
    } else if constexpr (kFrom == ElemType::kF16 && kTo == ElemType::kF32) {
#if defined(JAX_M2N_HAVE_F16C)
      out = HaveF16c() ? &ConvertF16ToF32F16c : &ConvertRunCpu<kFrom, kTo>;
#else
      out = &ConvertRunCpu<kFrom, kTo>;
#endif
    } else if constexpr (kFrom == ElemType::kF8E4M3FN &&
                         kTo == ElemType::kF8E5M2) {
      out = &ConvertE4M3ToE5M2;
    } else if constexpr (kFrom == ElemType::kF16 && kTo == ElemType::kF8E5M2) {
      out = &ConvertF16ToE5M2;
    } else if constexpr (kFrom == ElemType::kF16 && kTo == ElemType::kBF16) {
      out = &ConvertF16ToBF16;
    } else if constexpr ((kFrom == ElemType::kF16 ||
                          kFrom == ElemType::kBF16 ||
                          kFrom == ElemType::kF8E5M2) &&
                         kIsF8<kTo> && kFrom != kTo) {
      out = &ConvertNarrowRun<kFrom, kTo>;
    } else if constexpr (kFrom != kTo && kIsF8<kFrom>) {
      out = &ConvertF8Run<kFrom, kTo>;
    } else {
      out = &ConvertRunCpu<kFrom, kTo>;
    }
  });
  return out;
}

}  // namespace

void CopyBox(const ConstBoxRef& src, const BoxRef& dst, const int64_t* extent,
             int64_t rank, int64_t elem_bytes) {
  const Collapsed c = Collapse(src.dims, src.start, dst.dims, dst.start, extent,
                               rank, elem_bytes);
  if (c.empty) return;
  const char* s = static_cast<const char*>(src.data) + c.src_offset;
  char* t = static_cast<char*>(dst.data) + c.dst_offset;
  if (c.n == 0) {
    std::memcpy(t, s, c.run);
    return;
  }
  const int inner = c.n - 1;
  if (c.n == 1) {
    CopyRows(s, t, c.extent[0], c.run, c.src_stride[0], c.dst_stride[0]);
    return;
  }
  // Odometer over the outer dims except the innermost, which CopyRows walks.
  int64_t index[kMaxDims] = {0};
  while (true) {
    CopyRows(s, t, c.extent[inner], c.run, c.src_stride[inner],
             c.dst_stride[inner]);
    int k = inner - 1;
    for (; k >= 0; --k) {
      s += c.src_stride[k];
      t += c.dst_stride[k];
      if (++index[k] < c.extent[k]) break;
      s -= c.src_stride[k] * c.extent[k];
      t -= c.dst_stride[k] * c.extent[k];
      index[k] = 0;
    }
    if (k < 0) return;
  }
}

void ConvertBox(const ConstBoxRef& src, const BoxRef& dst,
                const int64_t* extent, int64_t rank, ElemType from,
                ElemType to) {
  const ConvertRunFn convert = GetConvertRunCpu(from, to);
  if (convert == nullptr) return;
  // Collapsed in elements (elem_bytes 1): the two sides' element sizes differ.
  const Collapsed c =
      Collapse(src.dims, src.start, dst.dims, dst.start, extent, rank, 1);
  if (c.empty) return;
  const int64_t sb = ElemTypeBytes(from), tb = ElemTypeBytes(to);
  const char* s = static_cast<const char*>(src.data) + c.src_offset * sb;
  char* t = static_cast<char*>(dst.data) + c.dst_offset * tb;
  if (c.n == 0) {
    convert(s, t, c.run);
    return;
  }
  int64_t ss[kMaxDims], ts[kMaxDims];
  for (int k = 0; k < c.n; ++k) {
    ss[k] = c.src_stride[k] * sb;
    ts[k] = c.dst_stride[k] * tb;
  }
  const int inner = c.n - 1;
  int64_t index[kMaxDims] = {0};
  while (true) {
    const char* si = s;
    char* ti = t;
    for (int64_t i = 0; i < c.extent[inner]; ++i) {
      convert(si, ti, c.run);
      si += ss[inner];
      ti += ts[inner];
    }
    int k = inner - 1;
    for (; k >= 0; --k) {
      s += ss[k];
      t += ts[k];
      if (++index[k] < c.extent[k]) break;
      s -= ss[k] * c.extent[k];
      t -= ts[k] * c.extent[k];
      index[k] = 0;
    }
    if (k < 0) return;
  }
}

void AdviseHugePages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (data == nullptr || bytes < static_cast<int64_t>(2 * kHuge)) return;
  const uintptr_t begin =
      (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) &
      ~(kHuge - 1);
  if (end > begin) {
    // Failure (e.g. THP disabled) only means no huge pages: ignore it.
    (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace jax_m2n
