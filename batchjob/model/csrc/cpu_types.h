// The element types of the CPU kernels: float32, and bfloat16 (a float32's top 16 bits) widened to float32 on load
// and rounded to nearest even on store, so that every sum, product and exponential runs in float32. The conversions
// are a shift and an add on integer lanes, which any vector ISA has (AVX-512 lowers a 16-lane one to a zero-extend
// and a shift); a bf16 K/V row is half the memory traffic of a float32 one, which is what bounds decode attention.
//
// v16, the kernels' 16-float vector: with AVX-512 a GCC vector type (one zmm register); with AVX2 and no AVX-512 a
// pair of 8-float halves (two ymm registers). GCC has no machine mode for a 64-byte vector type on AVX2, so it kept
// each such v16 in memory and moved it through the stack in pieces: attention ran at a tenth of its AVX2 rate.
// Code that needs a lane permutation, a comparison or a conversion goes through the helpers here (vmax, exp16's
// lanes) or has a version per layout (#ifdef BATCHJOB_V16_HALVES).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

typedef int32_t vint16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vuint16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vbf16 __attribute__((vector_size(32), aligned(2)));  // 16 bf16 bit patterns

using bf16 = c10::BFloat16;

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

template <typename T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) {
  return x;
}
template <>
inline bf16 from_f32<bf16>(float x) {  // nearest, ties to even (NaN is not kept: the kernels make none)
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  return bf16(static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16), bf16::from_bits());
}

// Lanewise maximum of two GCC vectors of one type.
template <typename V>
inline V vmax_lanes(V a, V b) {
  return a > b ? a : b;
}

// Lanes of 16 bf16 bit patterns widened to float32, and float32 lanes rounded to bf16 (nearest, ties to even).
template <typename VU, typename VB, typename V>
inline V widen_bf16(VB bits) {
  return reinterpret_cast<V>(__builtin_convertvector(bits, VU) << 16);
}
template <typename VU, typename VB, typename V>
inline VB round_bf16(V x) {
  const VU u = reinterpret_cast<VU>(x);
  return __builtin_convertvector((u + 0x7fff + ((u >> 16) & 1)) >> 16, VB);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
#define BATCHJOB_V16_HALVES 1
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vint8 __attribute__((vector_size(32), aligned(4)));
typedef uint32_t vuint8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t vbf8 __attribute__((vector_size(16), aligned(2)));

struct v16 {
  v8 lo, hi;  // lanes 0-7, 8-15
  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  v16& operator+=(v16 b) {
    lo += b.lo, hi += b.hi;
    return *this;
  }
  v16& operator*=(float b) {
    lo *= b, hi *= b;
    return *this;
  }
};
inline v16 operator+(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator-(v16 a, v16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator-(v16 a, float b) { return {a.lo - b, a.hi - b}; }
inline v16 operator*(v16 a, float b) { return {a.lo * b, a.hi * b}; }
inline v16 operator*(float a, v16 b) { return {a * b.lo, a * b.hi}; }
inline v16 vmax(v16 a, v16 b) { return {vmax_lanes(a.lo, b.lo), vmax_lanes(a.hi, b.hi)}; }

inline v16 load16(const float* p) { return {*reinterpret_cast<const v8*>(p), *reinterpret_cast<const v8*>(p + 8)}; }
inline v16 load16(const bf16* p) {
  return {widen_bf16<vuint8, vbf8, v8>(*reinterpret_cast<const vbf8*>(p)),
          widen_bf16<vuint8, vbf8, v8>(*reinterpret_cast<const vbf8*>(p + 8))};
}
inline void store16(float* p, v16 x) {
  *reinterpret_cast<v8*>(p) = x.lo;
  *reinterpret_cast<v8*>(p + 8) = x.hi;
}
inline void store16(bf16* p, v16 x) {
  *reinterpret_cast<vbf8*>(p) = round_bf16<vuint8, vbf8>(x.lo);
  *reinterpret_cast<vbf8*>(p + 8) = round_bf16<vuint8, vbf8>(x.hi);
}
#else
typedef float v16 __attribute__((vector_size(64), aligned(4)));  // unaligned 16-float vector (GCC lowers per ISA)

inline v16 vmax(v16 a, v16 b) { return vmax_lanes(a, b); }

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load16(const bf16* p) { return widen_bf16<vuint16, vbf16, v16>(*reinterpret_cast<const vbf16*>(p)); }

inline void store16(float* p, v16 x) { *reinterpret_cast<v16*>(p) = x; }
inline void store16(bf16* p, v16 x) { *reinterpret_cast<vbf16*>(p) = round_bf16<vuint16, vbf16>(x); }
#endif

// n values from src (float32) into dst (T), 16 at a time.
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(dst + i, load16(src + i));
  for (; i < n; ++i) dst[i] = from_f32<T>(src[i]);
}
