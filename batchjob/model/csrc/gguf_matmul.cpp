// GGUF's quantized weights used as they are stored: y = x W^T with W [N, K] in GGUF blocks (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each output column's row of blocks dequantized into a small buffer next to the
// arithmetic, never into a whole float copy of W. The dequantized values are bit for bit those of gguf-py's
// dequantize (the same float32 operations in the same order: no fused multiply-add, no reassociation), rounded to
// bfloat16 to nearest even where x is bfloat16, as torch's .to(bfloat16) of them would be. So a matmul here differs
// from F.linear on the dequantized weight only in the order of its float32 sums.
//
// Each output is a dot product over K in one fixed order (16 float32 lanes summed along K, then across lanes), the
// same whatever the row count or a row's place in the batch: a row's result does not depend on its batch.
#pragma GCC optimize("no-fast-math", "fp-contract=off")  // the build's -ffast-math would fuse and reorder them

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

enum GgmlType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Layout {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

Layout layout_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "gguf: no kernel for ggml type ", type);
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K and Q5_K pack 8 six-bit scales and 8 six-bit mins into 12 bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One block of `type` into y (layout_of(type).block floats).
void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case Q8_0: {
      const float d = half_at(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(q[i]) * d;
      return;
    }
    case Q4_0: {
      const float d = half_at(b);
      const uint8_t* q = b + 2;
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>((q[i] & 0x0F) - 8);
        y[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const float d = half_at(b), m = half_at(b + 2);
      const uint8_t* q = b + 4;
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>(q[i] & 0x0F) + m;
        y[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
      }
      return;
    }
    case Q5_0:
    case Q5_1: {
      const bool has_min = type == Q5_1;
      const float d = half_at(b), m = has_min ? half_at(b + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
      const uint8_t* q = b + (has_min ? 8 : 6);
      for (int i = 0; i < 32; ++i) {
        const int low = i < 16 ? (q[i] & 0x0F) : (q[i - 16] >> 4);
        const int v = low | (((qh >> i) & 1) << 4);
        y[i] = has_min ? d * static_cast<float>(v) + m : d * static_cast<float>(v - 16);
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const bool five = type == Q5_K;
      const uint8_t* qh = b + 16;  // Q5_K's fifth bits, 32 bytes
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min_k4(scales, j, sc, m);
        const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(m);
        const uint8_t* q = qs + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int l = 0; l < 32; ++l) {
          int v = (q[l] >> shift) & 0x0F;
          if (five) v |= ((qh[l] >> j) & 1) << 4;
          y[j * 32 + l] = dj * static_cast<float>(v) - mj;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int g = 0; g < 8; ++g) {  // groups of 32: which half of the block, which nibble, which 32 of 64
        const int h = g / 4, nibble = (g / 2) % 2, part = g % 2;
        const float d0 = d * static_cast<float>(scales[g * 2]), d1 = d * static_cast<float>(scales[g * 2 + 1]);
        for (int l = 0; l < 32; ++l) {
          const int low = (ql[h * 64 + part * 32 + l] >> (4 * nibble)) & 0x0F;
          const int high = (qh[h * 32 + l] >> (2 * (g % 4))) & 0x03;
          y[g * 32 + l] = (l < 16 ? d0 : d1) * static_cast<float>((low | (high << 4)) - 32);
        }
      }
      return;
    }
    default: TORCH_CHECK(false, "gguf: no kernel for ggml type ", type);
  }
}

inline uint16_t bf16_nearest_even(float f) {  // as c10::BFloat16's round_to_nearest_even (weights are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Row n of W (K weights) into out: float32, or bfloat16 bits.
template <typename T>
void dequantize_row(int64_t type, const uint8_t* row, int64_t k, T* out, float* scratch) {
  const Layout l = layout_of(type);
  for (int64_t i = 0; i < k / l.block; ++i) {
    dequantize_block(type, row + i * l.bytes, scratch);
    T* o = out + i * l.block;
    if constexpr (std::is_same_v<T, float>)
      std::memcpy(o, scratch, l.block * sizeof(float));
    else
      for (int64_t j = 0; j < l.block; ++j) o[j] = bf16_nearest_even(scratch[j]);
  }
}

void check_weight(const at::Tensor& q, int64_t type, int64_t k) {
  const Layout l = layout_of(type);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(),
              "gguf: the weight must be a contiguous 2-d uint8 tensor of GGUF blocks");
  TORCH_CHECK(k > 0 && k % l.block == 0 && q.size(1) == k / l.block * l.bytes, "gguf: a row of ", q.size(1),
              " bytes does not hold ", k, " weights of ggml type ", type);
}

// W [N, K] dequantized: float32 [N, K] (as gguf-py's dequantize gives it).
at::Tensor gguf_dequantize(const at::Tensor& q, int64_t type, int64_t k) {
  check_weight(q, type, k);
  const int64_t n = q.size(0), row_bytes = q.size(1);
  at::Tensor out = at::empty({n, k}, q.options().dtype(at::kFloat));
  const uint8_t* src = q.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> scratch(256);
    for (int64_t i = n0; i < n1; ++i) dequantize_row(type, src + i * row_bytes, k, dst + i * k, scratch.data());
  });
  return out;
}

#ifdef __AVX512F__
// A Q4_K/Q5_K block's sub-block j: its scale d * sc_j and its offset dmin * m_j, each in every lane.
inline void k_sub_block(const uint8_t* b, int j, __m512& scale, __m512& offset) {
  int sc, mn;
  scale_min_k4(b + 4, j, sc, mn);
  scale = _mm512_set1_ps(half_at(b) * static_cast<float>(sc));
  offset = _mm512_set1_ps(half_at(b + 2) * static_cast<float>(mn));
}

// The same dequantization 16 weights at a time (the same float32 operations, so the same bits), written straight
// into the matmul's panel, in float32 or bfloat16.
template <typename T>
inline void emit(T* o, __m512 f) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(o, f);
  } else {
#ifdef __AVX512BF16__
    // Nearest even, as torch rounds; its treatment of denormals never shows: a dequantized weight is 0 or at least
    // the smallest fp16 scale's multiple, 2^-24 (or a difference of such products, far above float32's 2^-126).
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(f));
#endif
  }
}

inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512 to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0F)); }
inline __m512i high_nibbles(__m512i v) { return _mm512_srli_epi32(v, 4); }

#ifdef __AVX512BF16__
// bf16 weights, 32 at a time. The 4- and 5-bit types by table: a block's (or sub-block's) 16 or 32 possible values
// computed once, each by the same float32 operations as above and rounded alike, then looked up for its 32 weights
// by their codes (vpermw), instead of converting and scaling each weight: the same bits at a quarter of the
// operations. Q8_0 and Q6_K (256 and 64 codes a scale: no table pays) computed as above, their codes gathered 32 at
// a time.
inline __m512i table16(__m512 values) { return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values)); }
inline __m512i table32(__m512 low, __m512 high) { return (__m512i)_mm512_cvtne2ps_pbh(high, low); }
inline void look_up(uint16_t* o, __m512i codes, __m512i table) {
  _mm512_storeu_si512(o, _mm512_permutexvar_epi16(codes, table));
}
// The 32 codes of a Q4_0/Q4_1/Q5_0/Q5_1 block: 16 bytes' low nibbles, then their high nibbles.
inline __m512i nibble_codes(const uint8_t* q) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i low = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_srli_epi16(v, 4), 1);
}

// Whether the block of `type` was written here (else the caller computes it).
inline bool dequantize_block_bf16(int64_t type, const uint8_t* b, uint16_t* o) {
  const __m512 codes16 = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 codes32 = _mm512_add_ps(codes16, _mm512_set1_ps(16.0f));
  switch (type) {
    case Q4_0: {  // d * (q - 8)
      const __m512 d = _mm512_set1_ps(half_at(b));
      look_up(o, nibble_codes(b + 2), table16(_mm512_mul_ps(d, _mm512_sub_ps(codes16, _mm512_set1_ps(8.0f)))));
      return true;
    }
    case Q4_1: {  // d * q + m
      const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(half_at(b + 2));
      look_up(o, nibble_codes(b + 4), table16(_mm512_add_ps(_mm512_mul_ps(d, codes16), m)));
      return true;
    }
    case Q5_0:
    case Q5_1: {  // d * (q - 16), d * q + m; q's fifth bit from the block's 32-bit mask
      const bool has_min = type == Q5_1;
      const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(has_min ? half_at(b + 2) : 0.0f);
      uint32_t bits;
      std::memcpy(&bits, b + (has_min ? 4 : 2), 4);
      __m512i codes = nibble_codes(b + (has_min ? 8 : 6));
      codes = _mm512_mask_add_epi16(codes, bits, codes, _mm512_set1_epi16(16));
      const __m512 shift = _mm512_set1_ps(16.0f);
      const __m512 low = has_min ? _mm512_add_ps(_mm512_mul_ps(d, codes16), m) : _mm512_mul_ps(d, _mm512_sub_ps(codes16, shift));
      const __m512 high = has_min ? _mm512_add_ps(_mm512_mul_ps(d, codes32), m) : _mm512_mul_ps(d, _mm512_sub_ps(codes32, shift));
      look_up(o, codes, table32(low, high));
      return true;
    }
    case Q4_K:
    case Q5_K: {  // per 32-weight sub-block j: (d * sc_j) * q - dmin * m_j
      const bool five = type == Q5_K;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        __m512 dj, mj;
        k_sub_block(b, j, dj, mj);
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (j / 2) * 32)));
        __m512i codes = j % 2 ? _mm512_srli_epi16(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
        const __m512 low = _mm512_sub_ps(_mm512_mul_ps(dj, codes16), mj);
        if (!five) {
          look_up(o + j * 32, codes, table16(low));
          continue;
        }
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        const __mmask32 fifth = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << j)));
        codes = _mm512_mask_add_epi16(codes, fifth, codes, _mm512_set1_epi16(16));
        look_up(o + j * 32, codes, table32(low, _mm512_sub_ps(_mm512_mul_ps(dj, codes32), mj)));
      }
      return true;
    }
    case Q8_0: {  // x * d, 32 at once
      const __m512 d = _mm512_set1_ps(half_at(b));
      const __m512 low = _mm512_mul_ps(to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), d);
      const __m512 high = _mm512_mul_ps(to_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), d);
      _mm512_storeu_si512(o, table32(low, high));
      return true;
    }
    case Q6_K: {  // (d * sc) * (q - 32), q's 6 bits gathered 32 at a time in 16-bit lanes
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int g = 0; g < 8; ++g) {
        const int hb = g / 4, nibble = (g / 2) % 2, part = g % 2;
        const __m512i ql = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + hb * 64 + part * 32)));
        const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + hb * 32)));
        const __m512i low = nibble ? _mm512_srli_epi16(ql, 4) : _mm512_and_si512(ql, _mm512_set1_epi16(0x0F));
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * (g % 4)), _mm512_set1_epi16(3));
        const __m512i codes = _mm512_sub_epi16(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)), _mm512_set1_epi16(32));
        const __m512 d0 = _mm512_set1_ps(d * static_cast<float>(scales[g * 2]));
        const __m512 d1 = _mm512_set1_ps(d * static_cast<float>(scales[g * 2 + 1]));
        const __m512 first = _mm512_mul_ps(d0, to_float(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(codes))));
        const __m512 second = _mm512_mul_ps(d1, to_float(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(codes, 1))));
        _mm512_storeu_si512(o + g * 32, table32(first, second));
      }
      return true;
    }
    default:
      return false;
  }
}
#endif

template <typename T>
void dequantize_row_avx512(int64_t type, const uint8_t* row, int64_t k, T* out) {
  const Layout l = layout_of(type);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i one = _mm512_set1_epi32(1);
  for (int64_t blk = 0; blk < k / l.block; ++blk) {
    const uint8_t* b = row + blk * l.bytes;
    T* o = out + blk * l.block;
#ifdef __AVX512BF16__
    if constexpr (!std::is_same_v<T, float>)
      if (dequantize_block_bf16(type, b, o)) continue;
#endif
    switch (type) {
      case Q8_0: {
        const __m512 d = _mm512_set1_ps(half_at(b));
        for (int h = 0; h < 2; ++h) {
          const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * h)));
          emit(o + 16 * h, _mm512_mul_ps(to_float(q), d));
        }
        break;
      }
      case Q4_0:
      case Q4_1: {
        const bool has_min = type == Q4_1;
        const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(has_min ? half_at(b + 2) : 0.0f);
        const __m512i q = bytes16(b + (has_min ? 4 : 2));
        const __m512i half[2] = {low_nibbles(q), high_nibbles(q)};
        for (int h = 0; h < 2; ++h)
          emit(o + 16 * h, has_min ? _mm512_add_ps(_mm512_mul_ps(d, to_float(half[h])), m)
                                   : _mm512_mul_ps(d, to_float(_mm512_sub_epi32(half[h], _mm512_set1_epi32(8)))));
        break;
      }
      case Q5_0:
      case Q5_1: {
        const bool has_min = type == Q5_1;
        const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(has_min ? half_at(b + 2) : 0.0f);
        uint32_t bits;
        std::memcpy(&bits, b + (has_min ? 4 : 2), 4);
        const __m512i q = bytes16(b + (has_min ? 8 : 6));
        const __m512i half[2] = {low_nibbles(q), high_nibbles(q)};
        for (int h = 0; h < 2; ++h) {
          const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits >> (16 * h))), lanes), one);
          const __m512i v = _mm512_or_si512(half[h], _mm512_slli_epi32(hi, 4));
          emit(o + 16 * h, has_min ? _mm512_add_ps(_mm512_mul_ps(d, to_float(v)), m)
                                   : _mm512_mul_ps(d, to_float(_mm512_sub_epi32(v, _mm512_set1_epi32(16)))));
        }
        break;
      }
      case Q4_K:
      case Q5_K: {
        const bool five = type == Q5_K;
        const uint8_t* qs = b + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          __m512 dj, mj;
          k_sub_block(b, j, dj, mj);
          for (int h = 0; h < 2; ++h) {
            const __m512i q = bytes16(qs + (j / 2) * 32 + 16 * h);
            __m512i v = j % 2 ? high_nibbles(q) : low_nibbles(q);
            if (five) {
              const __m512i hb = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + 16 + 16 * h), j), one);
              v = _mm512_or_si512(v, _mm512_slli_epi32(hb, 4));
            }
            emit(o + j * 32 + 16 * h, _mm512_sub_ps(_mm512_mul_ps(dj, to_float(v)), mj));
          }
        }
        break;
      }
      case Q6_K: {
        const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
        const float d = half_at(b + 208);
        for (int g = 0; g < 8; ++g) {
          const int hb = g / 4, nibble = (g / 2) % 2, part = g % 2;
          for (int h = 0; h < 2; ++h) {
            const __m512 dg = _mm512_set1_ps(d * static_cast<float>(scales[g * 2 + h]));
            const __m512i low = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + hb * 64 + part * 32 + 16 * h), 4 * nibble), _mm512_set1_epi32(0x0F));
            const __m512i high = _mm512_and_si512(_mm512_srli_epi32(bytes16(b + 128 + hb * 32 + 16 * h), 2 * (g % 4)), _mm512_set1_epi32(3));
            const __m512i v = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
            emit(o + g * 32 + 16 * h, _mm512_mul_ps(dg, to_float(v)));
          }
        }
        break;
      }
      default: TORCH_CHECK(false, "gguf: no kernel for ggml type ", type);
    }
  }
}

constexpr int kCols = 4;   // W's rows (output columns) per microkernel: 4 x 6 accumulators, 1 x vector, 4 W vectors
constexpr int kRows = 6;   // x's rows per microkernel
constexpr int64_t kPanelBytes = 384 << 10;

// The 16 lanes of each of 4 accumulators summed, in one fixed order: {sum a[0], sum a[1], sum a[2], sum a[3]}.
inline __m128 sum_lanes(const __m512* a) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // per 128-bit lane: 4 partial sums
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Where a row's (up to) 4 results go: float32 as summed, or bfloat16 rounded once to nearest even, each plus its
// bias (float32) first, as oneDNN's bf16 GEMM rounds its biased sum.
struct Output {
  void* data;
  bool bf16;
  int64_t ldo;          // elements from one row of out to the next
  const float* bias;    // [columns of this part] or null
};

inline void store(const Output& o, int64_t r, int64_t c, int cols, __m128 sums) {
  const __mmask8 mask = static_cast<__mmask8>((1u << cols) - 1);
  if (o.bias) sums = _mm_add_ps(sums, _mm_maskz_loadu_ps(mask, o.bias + c));
  if (!o.bf16) {
    _mm_mask_storeu_ps(static_cast<float*>(o.data) + r * o.ldo + c, mask, sums);
    return;
  }
#ifdef __AVX512BF16__
  const __m128i rounded = (__m128i)_mm_cvtneps_pbh(sums);
  _mm_mask_storeu_epi16(static_cast<uint16_t*>(o.data) + r * o.ldo + c, mask, rounded);
#endif
}

// R rows of x (row stride k) against `cols` dequantized rows of W (stride k): rows r0.. and columns c0.. of out,
// fp32 sums over K.
template <typename T, int R>
inline void dot_tile(const T* x, const T* w, int64_t k, int cols, const Output& out, int64_t r0, int64_t c0) {
  constexpr int64_t step = 64 / sizeof(T);  // elements per 512-bit vector
  __m512 acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < k; i += step) {
    __m512i b[kCols];
    for (int c = 0; c < kCols; ++c) b[c] = _mm512_loadu_si512(w + c * k + i);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_loadu_si512(x + r * k + i);
      for (int c = 0; c < kCols; ++c) {
        if constexpr (std::is_same_v<T, float>) {
          acc[r][c] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b[c]), acc[r][c]);
        } else {
#ifdef __AVX512BF16__
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
#endif
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store(out, r0 + r, c0, cols, sum_lanes(acc[r]));
}

template <typename T, int R>
inline void dot_rows(const T* x, int64_t rows, const T* w, int64_t k, int cols, const Output& out, int64_t r0,
                     int64_t c0) {
  if constexpr (R > 0) {
    if (rows == R)
      dot_tile<T, R>(x, w, k, cols, out, r0, c0);
    else
      dot_rows<T, R - 1>(x, rows, w, k, cols, out, r0, c0);
  }
}
#endif

bool gguf_matmul_available(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#elif defined(__AVX512F__)
  return dtype == at::kFloat;
#else
  return false;
#endif
}

// x [R, K] (float32 or bfloat16) times W^T (+ bias), W [N, K] in GGUF blocks of `type` -> out [R, N], float32 or
// bfloat16 (a view whose rows may be longer: one part of a fused matmul's output).
void gguf_matmul(const at::Tensor& x, const at::Tensor& q, int64_t type, const std::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gguf_matmul: x must be a contiguous 2-d tensor");
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0);
  check_weight(q, type, k);
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_out || out.scalar_type() == at::kFloat) && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == n && out.stride(1) == 1,
              "gguf_matmul: out must be float32 or bfloat16 [rows of x, rows of W] with unit column stride");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n &&
                        bias->is_contiguous()),
              "gguf_matmul: bias must be a contiguous float32 [rows of W]");
  TORCH_CHECK(!bf16_out || gguf_matmul_available(at::kBFloat16), "gguf_matmul: this build writes no bfloat16");
  TORCH_CHECK(gguf_matmul_available(x.scalar_type()), "gguf_matmul: this build has no kernel for x of ",
              x.scalar_type());
#ifdef __AVX512F__
  // Columns dequantized at once, then read by every row of x: as many as fit in about half of a core's L2 (fewer
  // passes over x), in multiples of the microkernel's, at least 16; and at least two panels per thread.
  const int64_t element = x.scalar_type() == at::kFloat ? 4 : 2, threads = at::get_num_threads();
  int64_t width = std::clamp<int64_t>(kPanelBytes / (k * element) / kCols * kCols, 16, 128);
  width = std::max<int64_t>(16, std::min<int64_t>(width, (n / (2 * threads) + kCols - 1) / kCols * kCols));
  const int64_t row_bytes = q.size(1), panels = (n + width - 1) / width;
  const uint8_t* wq = q.data_ptr<uint8_t>();
  const Output o{out.data_ptr(), bf16_out, out.stride(0), bias ? bias->data_ptr<float>() : nullptr};
  auto run = [&](auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<T> panel(width * k);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t first = p * width, cols = std::min<int64_t>(width, n - first);
        for (int64_t c = 0; c < cols; ++c) dequantize_row_avx512(type, wq + (first + c) * row_bytes, k, panel.data() + c * k);
        for (int64_t c = cols; c < (cols + kCols - 1) / kCols * kCols; ++c) std::fill_n(panel.data() + c * k, k, T(0));
        for (int64_t r = 0; r < rows; r += kRows)
          for (int64_t c = 0; c < cols; c += kCols)
            dot_rows<T, kRows>(xp + r * k, std::min<int64_t>(kRows, rows - r), panel.data() + c * k, k,
                               static_cast<int>(std::min<int64_t>(kCols, cols - c)), o, r, first + c);
      }
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(x.data_ptr<float>());
  else
    run(reinterpret_cast<const uint16_t*>(x.data_ptr()));
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchjob_cpu, m) {
  m.def("gguf_matmul_available(ScalarType dtype) -> bool", &gguf_matmul_available);
  m.def("gguf_dequantize(Tensor q, int type, int k) -> Tensor");
  m.def("gguf_matmul(Tensor x, Tensor q, int type, int k, Tensor? bias, Tensor(a!) out) -> ()");
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &gguf_dequantize);
  m.impl("gguf_matmul", c10::DispatchKey::CPU,
         [](const at::Tensor& x, const at::Tensor& q, int64_t type, int64_t k, const std::optional<at::Tensor>& bias,
            at::Tensor& out) {
           TORCH_CHECK(x.size(-1) == k, "gguf_matmul: x has ", x.size(-1), " features, W ", k);
           gguf_matmul(x, q, type, bias, out);
         });
}
