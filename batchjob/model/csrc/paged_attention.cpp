// Paged attention on a CPU that reads K/V blocks where they lie in the cache, for all sequences of a step in one
// call: decodes and prefill chunks (with cached context) alike. The torch path in batchjob/model/ops.py gathers a
// copy of every sequence's K/V per layer first; with many running sequences that copy bounds decode.
//
// Work items are (sequence, tile of query rows), taken dynamically by OpenMP threads, largest first. An item walks
// its context block by block, twice (scores, then the weighted sum of V), and within a block one KV head at a time
// for the G query heads that share it, so that each K/V row is loaded once for all G of them. For head sizes that
// are a multiple of 16 (64, 128) and G <= 8, a templated path keeps a row's G queries and G output accumulators in
// vector registers; other shapes take the generic loops. q and the caches are float32 or bf16 (cpu_types.h: bf16 is
// widened on load, so scores, softmax and sums run in float32; a bf16 cache halves the bytes a decode step reads).
// With AVX512_BF16, bf16 dot products run in vdpbf16ps (float32 sums of bf16 products): a decode's scores, and both
// GEMMs of a prefill tile, whose probabilities are then rounded to bf16 (`python scripts/cpu_ops_ab.py attention`
// with DTYPE=bfloat16: 1.6-1.8x the widening loops' prefill rate).
// Gemma's options, a sliding window (a query at p sees keys in (p - window, p]) and soft-capped scores
// (cap * tanh(s / cap)): prefill tiles take them in the register-blocked path (which then starts at the tile's first
// window, masks the rest and caps the scores before the softmax), decodes in the generic loops (each row from its
// window's first key). Head size 256 (Gemma's) has the register-blocked prefill tiles and the generic decode loops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "cpu_types.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // query rows per work item: bounds the scores scratch, balances long prefills

struct Item {
  int64_t seq, row0, row1, cost;
};

// One work item's view of the step: rows [row0, row1) of sequence `seq`, at positions first_pos + j. T is the
// element type of q and the caches (float or bf16); the output and all scratch are float32.
template <typename T>
struct Tile {
  const T* q;  // [rows, H, D], rows q_row elements apart (views of the fused qkv rows)
  float* out;  // [rows, H, D]
  const T* k;  // cache base
  const T* v;
  const int32_t* table;
  int64_t rows, first_pos, ctx, h, kvh, d, bs, row_stride, block_stride, q_row;
  float scale;
  int64_t window;  // 0: none
  float softcap;   // 0: none
  float* scores;   // [rows, H, ctx]
};

// The first key row j sees: 0, or the start of its window.
template <typename T>
inline int64_t row_lo(const Tile<T>& t, int64_t j) {
  return t.window ? std::max<int64_t>(0, t.first_pos + j - t.window + 1) : 0;
}

// The first key a register-blocked tile computes: its first row's window start, rounded down to 16 keys (whole steps
// of the score GEMM and whole bf16 pairs; the keys before a row's window are masked).
template <typename T>
inline int64_t tile_lo(const Tile<T>& t) {
  return row_lo(t, 0) / 16 * 16;
}

// One past the last row that sees the key at pos: all rows, or those whose window still holds pos.
template <typename T>
inline int64_t rows_hi(int64_t pos, const Tile<T>& t) {
  return t.window ? std::min(t.rows, pos - t.first_pos + t.window) : t.rows;
}

template <typename T>
inline int64_t first_row(int64_t pos, const Tile<T>& t) { return std::max<int64_t>(0, pos - t.first_pos); }

// The cache row (all KV heads) of the sequence's key at position pos.
template <typename T>
inline const T* cache_row(const Tile<T>& t, const T* cache, int64_t pos) {
  return cache + t.table[pos / t.bs] * t.block_stride + (pos % t.bs) * t.row_stride;
}

template <typename T>
void softmax_rows(const Tile<T>& t) {
  for (int64_t j = 0; j < t.rows; ++j) {
    // keys row j sees: [lo, n); the unseen entries stay 0 and add nothing to the weighted sum
    const int64_t lo = row_lo(t, j), n = t.first_pos + j + 1;
    for (int64_t hq = 0; hq < t.h; ++hq) {
      float* s = t.scores + (j * t.h + hq) * t.ctx;
      float mx = s[lo];
      for (int64_t i = lo + 1; i < n; ++i) mx = std::max(mx, s[i]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = lo; i < n; ++i) {
        s[i] = std::exp(s[i] - mx);
        sum += s[i];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t i = lo; i < n; ++i) s[i] *= inv;
    }
  }
}

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // older GCC: the same permutation through __builtin_shuffle and an index vector
typedef int32_t vi16 __attribute__((vector_size(64)));
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, vi16{__VA_ARGS__})
#endif

#ifdef BATCHJOB_V16_HALVES
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, vint8{__VA_ARGS__})
#endif

// Lane l of the result is the sum of the 8 lanes of x[l]: three rounds of in-lane and cross-lane permutes and adds
// (vshufps, vperm2f128), each half as many vectors as the last.
inline v8 lane_sums8(const v8 (&x)[8]) {
  v8 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // a[i] lanes 0-1, 4-5: x[2i]'s partial sums; 2-3, 6-7: x[2i + 1]'s
    a[i] = SHUFFLE8(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           SHUFFLE8(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  for (int i = 0; i < 2; ++i)  // b[i] lanes 0, 4: x[4i]; 1, 5: x[4i + 1]; 2, 6: x[4i + 2]; 3, 7: x[4i + 3]
    b[i] = SHUFFLE8(a[2 * i], a[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
           SHUFFLE8(a[2 * i], a[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
  return SHUFFLE8(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

inline v16 lane_sums16(const v16 (&x)[16]) {
  v8 lo[8], hi[8];
  for (int i = 0; i < 8; ++i) lo[i] = x[i].lo + x[i].hi, hi[i] = x[i + 8].lo + x[i + 8].hi;
  return {lane_sums8(lo), lane_sums8(hi)};
}
#else
// Lane l of the result is the sum of the 16 lanes of x[l]: four rounds that each add the two halves of every group
// of lanes across a pair of vectors (15 two-source permutes and adds in all, against 16 separate lane sums).
inline v16 lane_sums16(const v16 (&x)[16]) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // groups of 16 -> 8: lanes 0-7 for x[2i], 8-15 for x[2i + 1]
    a[i] = SHUFFLE16(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE16(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 8 -> 4
    b[i] = SHUFFLE16(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE16(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 4 -> 2
    c[i] = SHUFFLE16(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE16(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE16(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +  // 2 -> 1
         SHUFFLE16(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

// G heads' rows of NV * 16 values, back to back at src, times mul, into registers.
template <int NV, int G, typename T>
inline void load_heads(v16 (&dst)[G][NV], const T* src, float mul) {
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) dst[g][i] = load16(src + (g * NV + i) * 16) * mul;
}

// Calls f(block_base, p0, last, kh, j) for each block of the context (its rows start at block_base, position p0),
// each KV head kh, and each query row j that sees part of the block: positions [p0, last). Blocks lie at random
// places in the pool, where no hardware prefetcher sees them coming, so while a KV head's rows of block b are used
// the same rows of block b + 2 are asked into L2, one line per line read; past the last block, `then`'s first blocks
// (the pass after this one). A burst of a whole block at a time into L1 stalled on the core's few miss buffers
// (`python scripts/cpu_ops_ab.py attention` compares the two).
template <typename T, typename F>
inline void walk_blocks(const Tile<T>& t, const T* cache, const T* then, F&& f) {
  constexpr int64_t kAhead = 2;
  const int64_t nblocks = (t.ctx + t.bs - 1) / t.bs;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t p0 = b * t.bs, p1 = std::min(p0 + t.bs, t.ctx), a = b + kAhead;
    const T* base = cache + t.table[b] * t.block_stride;
    const T* ahead = a < nblocks               ? cache + t.table[a] * t.block_stride
                         : then && a - nblocks < nblocks ? then + t.table[a - nblocks] * t.block_stride
                                                         : nullptr;
    for (int64_t kh = 0; kh < t.kvh; ++kh) {
      if (ahead)
        for (int64_t p = 0; p < t.bs; ++p)
          for (int64_t i = 0; i < t.d; i += 64 / sizeof(T)) __builtin_prefetch(ahead + p * t.row_stride + kh * t.d + i, 0, 1);
      for (int64_t j = first_row(p0, t); j < t.rows; ++j) f(base, p0, std::min(p1, t.first_pos + j + 1), kh, j);
    }
  }
}

// A row's G query heads in registers, and their dot products with a key row as 16 partial sums (lanes to be added):
// the queries widened to float32 and pre-scaled, the key widened on load.
template <int NV, int G, typename T>
struct QueryRegs {
  v16 q[G][NV];
  static constexpr bool kScaled = true;  // the scale is in q: the dots are the scores
  QueryRegs(const T* src, float scale) { load_heads(q, src, scale); }
  inline v16 dot(int g, const T* k) const {
    v16 a = q[g][0] * load16(k);
    for (int i = 1; i < NV; ++i) a += q[g][i] * load16(k + i * 16);
    return a;
  }
};

#ifdef __AVX512BF16__
// bf16 on a CPU with AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs of q and K and adds each pair's products into
// a float32 lane, one instruction per 32 elements where widening K costs two and the products another. q stays bf16
// (the model's own values), so the scale is applied to the sums instead.
template <int NV, int G>
struct QueryRegs<NV, G, bf16> {
  __m512bh q[G][NV / 2];
  static constexpr bool kScaled = false;
  QueryRegs(const bf16* src, float) {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NV / 2; ++i) q[g][i] = (__m512bh)_mm512_loadu_si512(src + (g * NV / 2 + i) * 32);
  }
  inline v16 dot(int g, const bf16* k) const {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], (__m512bh)_mm512_loadu_si512(k));
    for (int i = 1; i < NV / 2; ++i) a = _mm512_dpbf16_ps(a, q[g][i], (__m512bh)_mm512_loadu_si512(k + i * 32));
    return (v16)a;
  }
};
#endif

template <int NV, int G, typename T>
void attend_fast(const Tile<T>& t) {
  constexpr int64_t D = NV * 16;
  // Pass 1: scaled scores.
  walk_blocks(t, t.k, t.v, [&](const T* kb, int64_t p0, int64_t last, int64_t kh, int64_t j) {
    using Q = QueryRegs<NV, G, T>;
    const Q q(t.q + j * t.q_row + kh * G * D, t.scale);
    const float post = Q::kScaled ? 1.f : t.scale;
    float* s = t.scores + (j * t.h + kh * G) * t.ctx;
    if (last - p0 == 16) {  // a whole block of 16 keys: 16 dot products reduced together, no per-score lane sum
      for (int g = 0; g < G; ++g) {
        v16 dots[16];
        for (int64_t p = 0; p < 16; ++p) dots[p] = q.dot(g, kb + p * t.row_stride + kh * D);
        v16 sums = lane_sums16(dots);
        if constexpr (!Q::kScaled) sums *= post;
        store16(s + g * t.ctx + p0, sums);
      }
      return;
    }
    for (int64_t p = p0; p < last; ++p) {
      const T* kr = kb + (p - p0) * t.row_stride + kh * D;
      for (int g = 0; g < G; ++g) {
        const v16 a = q.dot(g, kr);
        float sum = 0.f;
        for (int l = 0; l < 16; ++l) sum += a[l];
        s[g * t.ctx + p] = sum * post;
      }
    }
  });
  softmax_rows(t);
  // Pass 2: out = P V, accumulated in registers per (row, KV head) over a block.
  std::fill(t.out, t.out + t.rows * t.h * D, 0.f);
  walk_blocks(t, t.v, static_cast<const T*>(nullptr), [&](const T* vb, int64_t p0, int64_t last, int64_t kh,
                                                          int64_t j) {
    v16 acc[G][NV];
    float* orow = t.out + (j * t.h + kh * G) * D;
    load_heads(acc, orow, 1.f);
    const float* s = t.scores + (j * t.h + kh * G) * t.ctx;
    for (int64_t p = p0; p < last; ++p) {
      const T* vr = vb + (p - p0) * t.row_stride + kh * D;
      v16 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16(vr + i * 16);
      for (int g = 0; g < G; ++g) {
        const float w = s[g * t.ctx + p];
        for (int i = 0; i < NV; ++i) acc[g][i] += w * vv[i];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NV; ++i) store16(orow + (g * NV + i) * 16, acc[g][i]);
  });
}

// Prefill tiles: the scores of a KV head's G query heads x rows against a run of keys as small register-blocked
// GEMMs. The tile's queries are transposed once into qt [D][M] (M = rows x G query vectors, padded to whole vectors),
// so that a key's element is broadcast against 16 query vectors at a time: no horizontal sums, and each K and V row
// is read once per tile rather than once per query row. Scores are kept key-major, [ctx][M], so the softmax runs
// across query vectors too.
// Register blocking per ISA: keys and 16-query vectors per score step, then query vectors (R) and output vectors of a
// row (NC of its NV) per P V step.
#if defined(__AVX512F__)
constexpr int kKeysPerStep = 8, kQueryVectorsPerStep = 3;  // 24 accumulators of the 32 vector registers
template <int NV>
constexpr int kValueRows = NV == 4 ? 6 : NV == 8 ? 2 : 1;  // R x NV accumulators fit the registers
template <int NV>
constexpr int kValueCols = NV;
#elif defined(BATCHJOB_V16_HALVES)
// 16 ymm registers, a v16 in two: 6 keys x 1 query vector is 12 accumulators, 2 for the queries, 1 for a key's
// element (AVX2 GEMMs' 6 x 16 step); P V: 6 query vectors x one 16-float output vector, 2 for V, 1 for a weight.
constexpr int kKeysPerStep = 6, kQueryVectorsPerStep = 1;
template <int NV>
constexpr int kValueRows = 6;
template <int NV>
constexpr int kValueCols = 1;
#else
constexpr int kKeysPerStep = 2, kQueryVectorsPerStep = 3;
template <int NV>
constexpr int kValueRows = 1;
template <int NV>
constexpr int kValueCols = NV;
#endif

// s[kp][m] = scale * K(kp) . qt[:, m] for KP keys (rows at k[kp]) and MV vectors of 16 query vectors from m0.
template <int D, int MV, int KP, typename T>
inline void tile_scores(const float* qt, int64_t m_pad, const T* const* k, float* s, float scale) {
  v16 acc[KP][MV] = {};
  for (int d = 0; d < D; ++d) {
    v16 qv[MV];
    for (int i = 0; i < MV; ++i) qv[i] = load16(qt + d * m_pad + i * 16);
    for (int kp = 0; kp < KP; ++kp) {
      const float kd = to_f32(k[kp][d]);
      for (int i = 0; i < MV; ++i) acc[kp][i] += kd * qv[i];
    }
  }
  for (int kp = 0; kp < KP; ++kp)
    for (int i = 0; i < MV; ++i) store16(s + kp * m_pad + i * 16, acc[kp][i] * scale);
}

// o[r] = sum over the context's keys p of P[p][m0 + r] V(p), for R query vectors whose output rows (D floats each) lie
// back to back at o: the NC 16-float vectors of each row from vector c. The R x NC accumulators stay in registers
// over the whole context, block after block (per-block calls that loaded and stored them took a quarter of the P V
// time), while V rows come from L2 once per R vectors.
template <int NV, int R, int NC, typename T>
inline void context_values(const Tile<T>& t, int64_t kh, int c, const float* s, int64_t m_pad, float* o,
                           int64_t lo) {
  v16 acc[R][NC] = {};
  for (int64_t p0 = lo / t.bs * t.bs; p0 < t.ctx; p0 += t.bs) {
    const T* vb = cache_row(t, t.v, p0) + (kh * NV + c) * 16;
    const int64_t n = std::min(t.bs, t.ctx - p0);
    for (int64_t p = std::max<int64_t>(0, lo - p0); p < n; ++p) {
      const T* vr = vb + p * t.row_stride;
      v16 vv[NC];
      for (int i = 0; i < NC; ++i) vv[i] = load16(vr + i * 16);
      const float* w = s + (p0 + p) * m_pad;
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < NC; ++i) acc[r][i] += w[r] * vv[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NC; ++i) store16(o + r * NV * 16 + (c + i) * 16, acc[r][i]);
}

// e^x for x <= 0 (a score less its row's maximum), within a few ulp of expf; glibc's vector expf took a large share
// of a prefill tile's time, this less than half of it: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial, n added to the exponent bits; 0 below -87
// (a masked score), where 2^n would leave the normal floats. V: a GCC vector of floats, VI: of as many int32.
template <typename V, typename VI>
inline V exp_lanes(V x) {
  const V lo = V{} - 87.f, zero = {};
  const auto masked = x < lo;
  x = masked ? lo : x;
  const V n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f - 0.5f, VI), V);  // rounds x<=0
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const V e = reinterpret_cast<V>(reinterpret_cast<VI>(p) + (__builtin_convertvector(n, VI) << 23));
  return masked ? zero : e;
}

#ifdef BATCHJOB_V16_HALVES
inline v16 exp16(v16 x) { return {exp_lanes<v8, vint8>(x.lo), exp_lanes<v8, vint8>(x.hi)}; }
#else
inline v16 exp16(v16 x) { return exp_lanes<v16, vint16>(x); }
#endif

#ifdef BATCHJOB_V16_HALVES
// An 8 x 8 block transposed in registers: unpacks, in-lane shuffles, then 128-bit lane swaps (24 permutes).
inline void transpose8(v8 (&r)[8]) {
  v8 a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = SHUFFLE8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    a[i + 1] = SHUFFLE8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      b[i + 2 * j] = SHUFFLE8(a[i + j], a[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      b[i + 2 * j + 1] = SHUFFLE8(a[i + j], a[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int i = 0; i < 4; ++i) {
    r[i] = SHUFFLE8(b[i], b[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = SHUFFLE8(b[i], b[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// A 16 x 16 block transposed in registers: its four 8 x 8 blocks each transposed, the off-diagonal two swapped.
inline void transpose16(v16 (&r)[16]) {
  v8 q[4][8];  // [rows 0-7 | 8-15][cols 0-7 | 8-15] -> blocks 0: (0-7, 0-7), 1: (0-7, 8-15), 2: (8-15, 0-7), 3
  for (int i = 0; i < 8; ++i) q[0][i] = r[i].lo, q[1][i] = r[i].hi, q[2][i] = r[i + 8].lo, q[3][i] = r[i + 8].hi;
  for (auto& b : q) transpose8(b);
  for (int i = 0; i < 8; ++i) r[i] = {q[0][i], q[2][i]}, r[i + 8] = {q[1][i], q[3][i]};
}
#else
// A 16 x 16 block transposed in registers: four rounds that each swap the off-diagonal halves of every 2k x 2k
// block (k = 8, 4, 2, 1) across pairs of rows, 64 two-source permutes in all.
inline void transpose16(v16 (&r)[16]) {
  v16 n[16];
  for (int i = 0; i < 8; ++i) {
    n[i] = SHUFFLE16(r[i], r[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    n[i + 8] = SHUFFLE16(r[i], r[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int g = 0; g < 16; g += 8)
    for (int i = g; i < g + 4; ++i) {
      r[i] = SHUFFLE16(n[i], n[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      r[i + 4] = SHUFFLE16(n[i], n[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
  for (int g = 0; g < 16; g += 4)
    for (int i = g; i < g + 2; ++i) {
      n[i] = SHUFFLE16(r[i], r[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      n[i + 2] = SHUFFLE16(r[i], r[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int i = 0; i < 16; i += 2) {
    r[i] = SHUFFLE16(n[i], n[i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    r[i + 1] = SHUFFLE16(n[i], n[i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
}
#endif

// qt[d][m] = the tile's query vector m (row m / G, query head kh G + m % G) at d, 0 for m >= m: 16 x 16 blocks
// transposed in registers (scalar copies took a tenth of a short prefill's attention).
template <int NV, int G, typename T>
void transpose_queries(const Tile<T>& t, int64_t kh, int64_t m, int64_t m_pad, float* qt) {
  constexpr int64_t D = NV * 16;
  for (int64_t m0 = 0; m0 < m_pad; m0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      v16 r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t mi = m0 + i;
        r[i] = mi < m ? load16(t.q + mi / G * t.q_row + (kh * G + mi % G) * D + d0) : v16{};
      }
      transpose16(r);
      for (int64_t k = 0; k < 16; ++k) store16(qt + (d0 + k) * m_pad + m0, r[k]);
    }
}

#ifdef __AVX512BF16__
// bf16 prefill tiles on a CPU with AVX512_BF16: both GEMMs of the tile in vdpbf16ps, which multiplies 16 pairs of bf16
// and adds each pair's two products into a float32 lane: half the instructions of float32 FMAs, and no widening. The
// pairs run along each GEMM's inner axis: for the scores, query elements (d, d + 1), a key's pair broadcast; for P V,
// keys (p, p + 1), the probabilities rounded to bf16 (as flash attention's bf16 path on a GPU does) and broadcast.

// qt2[d / 2][m] = the pair (d, d + 1) of the tile's query vector m, as one 32-bit word: the query rows, read as
// words, transposed in 16 x 16 blocks (transpose16 only moves bits).
template <int NV, int G>
void transpose_query_pairs(const Tile<bf16>& t, int64_t kh, int64_t m, int64_t m_pad, uint32_t* qt2) {
  constexpr int64_t D = NV * 16;
  for (int64_t m0 = 0; m0 < m_pad; m0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      v16 r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t mi = m0 + i;
        r[i] = mi < m ? *reinterpret_cast<const v16*>(t.q + mi / G * t.q_row + (kh * G + mi % G) * D + d0) : v16{};
      }
      transpose16(r);
      for (int64_t k = 0; k < 16; ++k) *reinterpret_cast<v16*>(qt2 + (d0 / 2 + k) * m_pad + m0) = r[k];
    }
}

// s[kp][m] = scale * K(kp) . q(m) for KP keys and MV vectors of 16 query vectors: tile_scores on query pairs.
template <int D, int MV, int KP>
inline void tile_scores(const uint32_t* qt2, int64_t m_pad, const bf16* const* k, float* s, float scale) {
  __m512 acc[KP][MV];
  for (int kp = 0; kp < KP; ++kp)
    for (int i = 0; i < MV; ++i) acc[kp][i] = _mm512_setzero_ps();
  for (int d2 = 0; d2 < D / 2; ++d2) {
    __m512bh qv[MV];
    for (int i = 0; i < MV; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qt2 + d2 * m_pad + i * 16);
    for (int kp = 0; kp < KP; ++kp) {
      const __m512bh kd = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(k[kp] + 2 * d2));
      for (int i = 0; i < MV; ++i) acc[kp][i] = _mm512_dpbf16_ps(acc[kp][i], qv[i], kd);
    }
  }
  for (int kp = 0; kp < KP; ++kp)
    for (int i = 0; i < MV; ++i) _mm512_storeu_ps(s + kp * m_pad + i * 16, _mm512_mul_ps(acc[kp][i], _mm512_set1_ps(scale)));
}

// p2[p / 2][m] = the probabilities of keys p and p + 1 (0 past the context) for query vector m, rounded to bf16 and
// packed into one word, key p in the low half: the word vdpbf16ps pairs with the two keys' V values.
inline void pack_probability_pairs(const float* s, int64_t lo, int64_t ctx, int64_t m_pad, uint32_t* p2) {
  for (int64_t p = lo; p < ctx; p += 2)
    for (int64_t i = 0; i < m_pad; i += 16) {
      const vuint16 lo = reinterpret_cast<vuint16>(load16(s + p * m_pad + i));
      const vuint16 hi = p + 1 < ctx ? reinterpret_cast<vuint16>(load16(s + (p + 1) * m_pad + i)) : vuint16{};
      const vuint16 lo_r = (lo + 0x7fff + ((lo >> 16) & 1)) >> 16, hi_r = (hi + 0x7fff + ((hi >> 16) & 1)) & 0xffff0000u;
      *reinterpret_cast<vuint16*>(p2 + p / 2 * m_pad + i) = lo_r | hi_r;
    }
}

// o[r] = sum over the context's keys of P V, as context_values, two keys per vdpbf16ps. The V rows of keys p and
// p + 1 are interleaved by 16-bit unpacks, which work within 128-bit lanes: accumulator lanes hold the output's
// elements in the order (0-3, 8-11, 16-19, 24-27) and (4-7, 12-15, 20-23, 28-31) per 32, put back at the end.
template <int NV, int R>
inline void context_values_pairs(const Tile<bf16>& t, int64_t kh, const uint32_t* p2, int64_t m_pad, float* o,
                                 int64_t lo) {
  static_assert(NV % 2 == 0, "whole 32-element halves of a row");
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  // blocks hold an even number of keys: a pair never straddles two; lo is even too
  for (int64_t p0 = lo / t.bs * t.bs; p0 < t.ctx; p0 += t.bs) {
    const bf16* vb = cache_row(t, t.v, p0) + kh * NV * 16;
    const int64_t n = std::min(t.bs, t.ctx - p0);
    for (int64_t p = std::max<int64_t>(0, lo - p0); p < n; p += 2) {
      const bf16* v0 = vb + p * t.row_stride;
      __m512bh vv[NV];
      for (int j = 0; j < NV / 2; ++j) {
        const __m512i a = _mm512_loadu_si512(v0 + j * 32);
        const __m512i b = p + 1 < n ? _mm512_loadu_si512(v0 + t.row_stride + j * 32) : zero;
        vv[2 * j] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        vv[2 * j + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      const uint32_t* w = p2 + (p0 + p) / 2 * m_pad;
      for (int r = 0; r < R; ++r) {
        const __m512bh wr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w[r]));
        for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], vv[i], wr);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV / 2; ++j) {
      const v16 lo = (v16)acc[r][2 * j], hi = (v16)acc[r][2 * j + 1];
      float* dst = o + r * NV * 16 + j * 32;
      *reinterpret_cast<v16*>(dst) = SHUFFLE16(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      *reinterpret_cast<v16*>(dst + 16) =
          SHUFFLE16(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    }
}
#endif

// Scores of every key of the tile's context against query vectors [m0, m0 + 16 MV): qt holds them transposed as
// float32 (Q = float) or, for vdpbf16ps, as bf16 pairs (Q = uint32_t), and the matching tile_scores runs.
template <int D, int MV, typename T, typename Q>
void scores_run(const Tile<T>& t, const Q* qt, int64_t m0, int64_t m_pad, int64_t kh, float* s) {
  auto key = [&](int64_t p) { return cache_row(t, t.k, p) + kh * D; };
  int64_t p = tile_lo(t);
  for (; p + kKeysPerStep <= t.ctx; p += kKeysPerStep) {
    const T* k[kKeysPerStep];
    for (int i = 0; i < kKeysPerStep; ++i) k[i] = key(p + i);
    tile_scores<D, MV, kKeysPerStep>(qt + m0, m_pad, k, s + p * m_pad + m0, t.scale);
  }
  for (; p < t.ctx; ++p) {
    const T* k[1] = {key(p)};
    tile_scores<D, MV, 1>(qt + m0, m_pad, k, s + p * m_pad + m0, t.scale);
  }
}

template <int NV, int G, typename T>
void attend_tiled(const Tile<T>& t, std::vector<float>& scratch) {
  constexpr int64_t D = NV * 16;
  constexpr int R = kValueRows<NV>, NC = kValueCols<NV>, MV = kQueryVectorsPerStep;
#ifdef __AVX512BF16__
  constexpr bool kPairs = std::is_same_v<T, bf16>;  // both GEMMs in vdpbf16ps (above), where blocks hold whole pairs
#else
  constexpr bool kPairs = false;
#endif
  const bool pairs = kPairs && t.bs % 2 == 0;
  const int64_t m = t.rows * G, m_pad = (m + 15) / 16 * 16;
  scratch.resize(D * m_pad + t.ctx * m_pad + 2 * m_pad + m_pad * D + (t.ctx + 1) / 2 * m_pad);
  float* qt = scratch.data();        // [D][m_pad]: the tile's queries, transposed (as pairs: [D / 2][m_pad] words)
  float* s = qt + D * m_pad;         // [ctx][m_pad]: scores, then probabilities
  float* mx = s + t.ctx * m_pad;     // [m_pad]
  float* inv_sum = mx + m_pad;       // [m_pad]: sums of the probabilities
  float* o = inv_sum + m_pad;        // [m_pad][D]: unnormalised outputs
  [[maybe_unused]] uint32_t* p2 = reinterpret_cast<uint32_t*>(o + m_pad * D);  // [ctx / 2][m_pad]: bf16 pairs of P
  const int64_t lo = tile_lo(t);  // keys before it: outside every row's window, neither computed nor read
  for (int64_t kh = 0; kh < t.kvh; ++kh) {
    int64_t m0 = 0;
    if (pairs) {
#ifdef __AVX512BF16__
      if constexpr (kPairs) {
        uint32_t* qt2 = reinterpret_cast<uint32_t*>(qt);
        transpose_query_pairs<NV, G>(t, kh, m, m_pad, qt2);
        for (; m0 + 16 * MV <= m_pad; m0 += 16 * MV) scores_run<D, MV>(t, qt2, m0, m_pad, kh, s);
        if (m_pad - m0 == 32) scores_run<D, 2>(t, qt2, m0, m_pad, kh, s);
        if (m_pad - m0 == 16) scores_run<D, 1>(t, qt2, m0, m_pad, kh, s);
      }
#endif
    } else {
      transpose_queries<NV, G>(t, kh, m, m_pad, qt);
      for (; m0 + 16 * MV <= m_pad; m0 += 16 * MV) scores_run<D, MV>(t, qt, m0, m_pad, kh, s);
      if (m_pad - m0 == 32) scores_run<D, 2>(t, qt, m0, m_pad, kh, s);
      if (m_pad - m0 == 16) scores_run<D, 1>(t, qt, m0, m_pad, kh, s);
    }
    if (t.softcap)
      for (int64_t p = lo; p < t.ctx; ++p)
        for (int64_t i = 0; i < m; ++i) s[p * m_pad + i] = t.softcap * std::tanh(s[p * m_pad + i] / t.softcap);
    // Causal mask: query row j sees keys up to first_pos + j; only the tile's own rows' keys are cut.
    for (int64_t p = t.first_pos + 1; p < t.ctx; ++p)
      for (int64_t i = 0; i < std::min(m, (p - t.first_pos) * G); ++i) s[p * m_pad + i] = -1e30f;
    // Window: row j sees no key p <= first_pos + j - window, that is rows j >= p - first_pos + window.
    if (t.window)
      for (int64_t p = lo; p < t.ctx; ++p)
        for (int64_t i = std::max<int64_t>(0, (p - t.first_pos + t.window) * G); i < m; ++i) s[p * m_pad + i] = -1e30f;
    // Maxima, then probabilities (unnormalised) and their sums, 16 query vectors at a time down the keys, so that the
    // running maximum and sum stay in a register (with the loop over keys outside, every key stored and reloaded
    // them: 2-3 % of a prefill's attention time).
    for (int64_t i = 0; i < m_pad; i += 16) {
      v16 hi = v16{} - 1e30f;
      for (int64_t p = lo; p < t.ctx; ++p) {
        const v16 row = load16(s + p * m_pad + i);
        hi = vmax(row, hi);
      }
      v16 total = {};
      for (int64_t p = lo; p < t.ctx; ++p) {
        const v16 e = exp16(load16(s + p * m_pad + i) - hi);
        store16(s + p * m_pad + i, e);
        total += e;
      }
      store16(mx + i, hi);
      store16(inv_sum + i, total);
    }
    if (pairs) {
#ifdef __AVX512BF16__
      if constexpr (kPairs) {
        pack_probability_pairs(s, lo, t.ctx, m_pad, p2);
        for (m0 = 0; m0 + R <= m; m0 += R) context_values_pairs<NV, R>(t, kh, p2 + m0, m_pad, o + m0 * D, lo);
        for (; m0 < m; ++m0) context_values_pairs<NV, 1>(t, kh, p2 + m0, m_pad, o + m0 * D, lo);
      }
#endif
    } else {
      for (int c = 0; c < NV; c += NC) {
        for (m0 = 0; m0 + R <= m; m0 += R) context_values<NV, R, NC>(t, kh, c, s + m0, m_pad, o + m0 * D, lo);
        for (; m0 < m; ++m0) context_values<NV, 1, NC>(t, kh, c, s + m0, m_pad, o + m0 * D, lo);
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      float* dst = t.out + (i / G * t.h + kh * G + i % G) * D;
      const float inv = 1.f / inv_sum[i];
      for (int64_t d = 0; d < D; ++d) dst[d] = o[i * D + d] * inv;
    }
  }
}

template <typename T>
void attend_generic(const Tile<T>& t) {
  const int64_t g = t.h / t.kvh, d = t.d, lo = row_lo(t, 0);
  for (int64_t pos = lo; pos < t.ctx; ++pos) {
    const T* krow = cache_row(t, t.k, pos);
    for (int64_t j = first_row(pos, t), j1 = rows_hi(pos, t); j < j1; ++j) {
      const T* qrow = t.q + j * t.q_row;
      for (int64_t hq = 0; hq < t.h; ++hq) {
        const T* a = qrow + hq * d;
        const T* b = krow + (hq / g) * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += to_f32(a[i]) * to_f32(b[i]);
        s *= t.scale;
        if (t.softcap) s = t.softcap * std::tanh(s / t.softcap);
        t.scores[(j * t.h + hq) * t.ctx + pos] = s;
      }
    }
  }
  softmax_rows(t);
  std::fill(t.out, t.out + t.rows * t.h * d, 0.f);
  for (int64_t pos = lo; pos < t.ctx; ++pos) {
    const T* vrow = cache_row(t, t.v, pos);
    for (int64_t j = first_row(pos, t), j1 = rows_hi(pos, t); j < j1; ++j) {
      for (int64_t hq = 0; hq < t.h; ++hq) {
        const float w = t.scores[(j * t.h + hq) * t.ctx + pos];
        float* o = t.out + (j * t.h + hq) * d;
        const T* x = vrow + (hq / g) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] += w * to_f32(x[i]);
      }
    }
  }
}

template <typename T>
struct Kernels {
  void (*rows)(const Tile<T>&);                       // a few query rows (decodes): per-row loops
  void (*tiled)(const Tile<T>&, std::vector<float>&);  // many (prefill tiles): register-blocked GEMMs; null for
                                                       // shapes without one
};

template <int NV, typename T>
Kernels<T> pick_g(int64_t g) {
  switch (g) {
    case 1: return {attend_fast<NV, 1, T>, attend_tiled<NV, 1, T>};
    case 2: return {attend_fast<NV, 2, T>, attend_tiled<NV, 2, T>};
    case 3: return {attend_fast<NV, 3, T>, attend_tiled<NV, 3, T>};
    case 4: return {attend_fast<NV, 4, T>, attend_tiled<NV, 4, T>};
    case 5: return {attend_fast<NV, 5, T>, attend_tiled<NV, 5, T>};
    case 6: return {attend_fast<NV, 6, T>, attend_tiled<NV, 6, T>};
    case 7: return {attend_fast<NV, 7, T>, attend_tiled<NV, 7, T>};
    case 8: return {attend_fast<NV, 8, T>, attend_tiled<NV, 8, T>};
    default: return {attend_generic<T>, nullptr};
  }
}

// Head size 256: a row's G queries (G x 16 vectors) do not fit the registers of the per-row path, so decodes take the
// generic loops; prefill tiles the register-blocked GEMMs, one query vector per P V step.
template <typename T>
Kernels<T> pick_wide(int64_t g) {
  switch (g) {
    case 1: return {attend_generic<T>, attend_tiled<16, 1, T>};
    case 2: return {attend_generic<T>, attend_tiled<16, 2, T>};
    case 4: return {attend_generic<T>, attend_tiled<16, 4, T>};
    case 8: return {attend_generic<T>, attend_tiled<16, 8, T>};
    default: return {attend_generic<T>, nullptr};
  }
}

template <typename T>
Kernels<T> pick(int64_t d, int64_t g) {
  if (d == 64) return pick_g<4, T>(g);
  if (d == 128) return pick_g<8, T>(g);
  if (d == 256) return pick_wide<T>(g);
  return {attend_generic<T>, nullptr};
}

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale, int64_t window,
                double softcap, at::Tensor& out) {
  const int64_t h = q.size(1), d = q.size(2), bs = k_cache.size(1), kvh = k_cache.size(2);
  const int64_t num_seqs = seq_lens.size(0), max_blocks = tables.size(1);
  Kernels<T> kernels = pick<T>(d, h / kvh);
  if (window || softcap) kernels.rows = attend_generic<T>;  // the per-row registers path knows neither option

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();

  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t r = qsl[s]; r < qsl[s + 1]; r += kQueryTile) {
      const int64_t r1 = std::min<int64_t>(r + kQueryTile, qsl[s + 1]);
      items.push_back({s, r, r1, (r1 - r) * (window ? std::min<int64_t>(lens[s], window + r1 - r) : lens[s])});
    }
  }
  // Largest first, so that the dynamic schedule ends with small items on every thread.
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores, out32;  // out32: a bf16 item's float32 output, rounded into `out` at its end
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& item = items[it];
      const int64_t seq_len = lens[item.seq], q_len = qsl[item.seq + 1] - qsl[item.seq];
      Tile<T> t;
      T* dst = out.data_ptr<T>() + item.row0 * h * d;
      t.q = q.data_ptr<T>() + item.row0 * q.stride(0);
      t.k = k_cache.data_ptr<T>();
      t.v = v_cache.data_ptr<T>();
      t.table = tables.data_ptr<int32_t>() + item.seq * max_blocks;
      t.rows = item.row1 - item.row0;
      t.first_pos = seq_len - q_len + (item.row0 - qsl[item.seq]);
      t.ctx = t.first_pos + t.rows;  // keys the item's last row sees
      t.h = h, t.kvh = kvh, t.d = d, t.bs = bs, t.row_stride = kvh * d, t.block_stride = bs * kvh * d;
      t.q_row = q.stride(0);
      t.scale = static_cast<float>(scale);
      t.window = window;
      t.softcap = static_cast<float>(softcap);
      if constexpr (std::is_same_v<T, float>) {
        t.out = dst;
      } else {
        out32.resize(t.rows * h * d);
        t.out = out32.data();
      }
      if (kernels.tiled && t.rows * (h / kvh) >= 16) {  // at least one whole vector of query rows
        kernels.tiled(t, scores);
      } else {
        scores.assign(t.rows * h * t.ctx, 0.f);
        t.scores = scores.data();
        kernels.rows(t);
      }
      if constexpr (!std::is_same_v<T, float>) store_row(dst, t.out, t.rows * h * d);
    }
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype,
              "q and the caches: all float32 or all bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "int32 metadata");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  // q may be a view of the fused qkv rows: read in place if each row's heads lie back to back.
  const at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  const int64_t h = q.size(1), d = q.size(2), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % kvh == 0, "head_dim or head counts do not match");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap: 0 (none) or positive");
  at::Tensor out = at::empty({q.size(0), h, d}, q.options());
  const at::Tensor tables = block_tables.contiguous();
  if (dtype == at::kFloat)
    attend_all<float>(qc, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, window, softcap, out);
  else
    attend_all<bf16>(qc, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, window, softcap, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(batchjob_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
