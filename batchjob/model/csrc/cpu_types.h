// The element types of the CPU kernels: float32, and bfloat16 (a float32's top 16 bits) widened to float32 on load
// and rounded to nearest even on store, so that every sum, product and exponential runs in float32. The conversions
// are a shift and an add on integer lanes, which any vector ISA has (AVX-512 lowers a 16-lane one to a zero-extend
// and a shift); a bf16 K/V row is half the memory traffic of a float32 one, which is what bounds decode attention.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // unaligned 16-float vector (GCC lowers per ISA)
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

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load16(const bf16* p) {
  const vbf16 bits = *reinterpret_cast<const vbf16*>(p);
  return reinterpret_cast<v16>(__builtin_convertvector(bits, vuint16) << 16);
}

inline void store16(float* p, v16 x) { *reinterpret_cast<v16*>(p) = x; }
inline void store16(bf16* p, v16 x) {
  const vuint16 u = reinterpret_cast<vuint16>(x);
  *reinterpret_cast<vbf16*>(p) = __builtin_convertvector((u + 0x7fff + ((u >> 16) & 1)) >> 16, vbf16);
}

// n values from src (float32) into dst (T), 16 at a time.
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(dst + i, load16(src + i));
  for (; i < n; ++i) dst[i] = from_f32<T>(src[i]);
}
