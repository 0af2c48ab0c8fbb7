// A bfloat16 matmul with float32 results, for the LM head: logits = x W^T with x [R, K] and W [N, K] in bfloat16,
// each product exact and summed in float32 by AVX512_BF16's dot product (vdpbf16ps), never rounded to bfloat16.
// oneDNN's bf16 GEMM rounds its output to bf16 (near the top of SmolLM2's logits, steps of 1/8: ties that greedy
// breaks by the lowest id), and its f32 GEMM reads W as float32: twice the bytes a decode step reads and half the
// arithmetic rate. Each logit is summed in one fixed order over K whatever the row count or the row's place, so a
// row's logits do not depend on its batch. Built where the compiler targets AVX512_BF16 (-march=native on such a
// CPU); elsewhere bf16_dot_available() is false and the model keeps its float32 head.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;          // float32 results per vector: a tile's columns
constexpr int64_t kTiles = 4;           // tiles a block computes at once
constexpr int64_t kBlock = kLanes * kTiles;  // W's rows (output columns) per block
constexpr int kRows = 6;                // x's rows per block: 6 x 4 accumulators, 4 W vectors, 1 broadcast

bool bf16_dot_available() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

void check_bf16_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.is_contiguous(), "bf16_dot: ", name,
              " must be a contiguous 2-d bfloat16 tensor");
  TORCH_CHECK(t.size(1) % 2 == 0, "bf16_dot: ", name, "'s inner dimension must be even (pairs of K)");
}

// W [N, K] -> [ceil(N / 64) * 4, K / 2, 16, 2]: tiles of 16 output columns, each K pair of a column side by side,
// as vdpbf16ps reads them; columns past N are zero.
at::Tensor bf16_dot_pack(const at::Tensor& weight) {
  check_bf16_matrix(weight, "weight");
  const int64_t n = weight.size(0), k2 = weight.size(1) / 2, tiles = (n + kBlock - 1) / kBlock * kTiles;
  at::Tensor packed = at::zeros({tiles, k2, kLanes, 2}, weight.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(weight.data_ptr());  // a K pair of one column
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < kLanes && t * kLanes + c < n; ++c) {
        const uint32_t* column = src + (t * kLanes + c) * k2;
        for (int64_t k = 0; k < k2; ++k) dst[(t * k2 + k) * kLanes + c] = column[k];
      }
  });
  return packed;
}

#ifdef __AVX512BF16__
// R rows of x against one block of W: 4 tiles of 16 columns, `columns` of them real (the last block's may be fewer).
template <int R>
inline void dot_block(const uint32_t* x, int64_t k2, const __m512i* w, float* out, int64_t ldo, int64_t columns) {
  __m512 acc[R][kTiles];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kTiles; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k2; ++k) {
    __m512bh b[kTiles];
    for (int j = 0; j < kTiles; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * k2 + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * k2 + k]));
      for (int j = 0; j < kTiles; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int j = 0; j < kTiles; ++j) {
    const int64_t left = columns - j * kLanes;
    if (left <= 0) break;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + j * kLanes, mask, acc[r][j]);
  }
}

// R rows against one block over K pairs [k0, k1), every column stored (`out` holds 64 a row): the accumulators
// start from `out` past the first K pairs. A lane's sum runs over K in the same order as dot_block's, so the results
// are dot_block's to the bit; a K slice of the block (64 x 64 pairs, 16 KiB) stays in L1 while the rows read it.
template <int R>
inline void dot_block_slice(const uint32_t* x, int64_t k2, int64_t k0, int64_t k1, const __m512i* w, float* out) {
  __m512 acc[R][kTiles];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kTiles; ++j)
      acc[r][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * kBlock + j * kLanes);
  for (int64_t k = k0; k < k1; ++k) {
    __m512bh b[kTiles];
    for (int j = 0; j < kTiles; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * k2 + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * k2 + k]));
      for (int j = 0; j < kTiles; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kTiles; ++j) _mm512_storeu_ps(out + r * kBlock + j * kLanes, acc[r][j]);
}

template <int R>
inline void dot_slice_rows(const uint32_t* x, int64_t rows, int64_t k2, int64_t k0, int64_t k1, const __m512i* w,
                           float* out) {
  if constexpr (R > 0) {
    if (rows == R)
      dot_block_slice<R>(x, k2, k0, k1, w, out);
    else
      dot_slice_rows<R - 1>(x, rows, k2, k0, k1, w, out);
  }
}

template <int R>
inline void dot_rows(const uint32_t* x, int64_t rows, int64_t k2, const __m512i* w, float* out, int64_t ldo,
                     int64_t columns) {
  if constexpr (R > 0) {
    if (rows == R)
      dot_block<R>(x, k2, w, out, ldo, columns);
    else
      dot_rows<R - 1>(x, rows, k2, w, out, ldo, columns);
  }
}
#endif

// x [R, K] bfloat16, W packed by bf16_dot_pack from [N, K] -> out, float32 [R, N] (the caller's, so that it can
// hand the same memory back call after call).
void bf16_dot(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  check_bf16_matrix(x, "x");
  const int64_t n = out.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1) && packed.size(0) * kLanes >= n,
              "bf16_dot: a weight packed by bf16_dot_pack for this x and out expected");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == x.size(0) && out.is_contiguous(),
              "bf16_dot: out must be a contiguous float32 [rows of x, n]");
#ifdef __AVX512BF16__
  const int64_t rows = x.size(0), k2 = packed.size(1), blocks = (n + kBlock - 1) / kBlock;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const __m512i* wp = reinterpret_cast<const __m512i*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  // Blocks of W's columns per task: a block (64 x K bf16) stays in cache while every row block reads it.
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const __m512i* w = wp + b * kTiles * k2;
      const int64_t columns = std::min<int64_t>(kBlock, n - b * kBlock);
      for (int64_t r = 0; r < rows; r += kRows)
        dot_rows<kRows>(xp + r * k2, std::min<int64_t>(kRows, rows - r), k2, w, op + r * n + b * kBlock, n, columns);
    }
  });
#else
  TORCH_CHECK(false, "bf16_dot: this build has no AVX512_BF16 (see bf16_dot_available)");
#endif
}

#ifdef __AVX512BF16__
// exp(x) for x <= 0 (a logit less the row's running max): 2^n exp(r) with n = round(x log2 e) and |r| <= ln2 / 2,
// Cephes' expf polynomial; 2 ulp, and below -87 it gives 0 or a denormal, where exp's sum cannot tell.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// One row's log-sum-exp over a range of columns, kept as a running max and 16 lanes of exp sums (rescaled when the
// max grows), with the count of logits above the row's target logit.
struct RowState {
  float max = -std::numeric_limits<float>::infinity();
  __m512 sums = _mm512_setzero_ps();
  int64_t above = 0;

  void add(const float* logits, int64_t columns, float target) {
    __mmask16 masks[kTiles];
    __m512 v[kTiles];
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < kTiles; ++j) {
      const int64_t left = columns - j * kLanes;
      masks[j] = left >= kLanes ? __mmask16(0xFFFF) : left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0);
      v[j] = _mm512_maskz_loadu_ps(masks[j], logits + j * kLanes);
      top = _mm512_mask_max_ps(top, masks[j], top, v[j]);
      above += _mm_popcnt_u32(_mm512_mask_cmp_ps_mask(masks[j], v[j], _mm512_set1_ps(target), _CMP_GT_OQ));
    }
    const float block_max = _mm512_reduce_max_ps(top);
    if (block_max > max) {
      sums = _mm512_mul_ps(sums, exp_nonpositive(_mm512_set1_ps(max - block_max)));
      max = block_max;
    }
    const __m512 m = _mm512_set1_ps(max);
    for (int j = 0; j < kTiles; ++j)
      sums = _mm512_mask_add_ps(sums, masks[j], sums, exp_nonpositive(_mm512_sub_ps(v[j], m)));
  }
};

constexpr int64_t kChunkBlocks = 16;  // W's blocks whose log-sum-exp one task sums: 1,024 columns
constexpr int64_t kRowTile = 48;      // x's rows a task reads against its chunk: 12 KiB of logits, in L1
constexpr int64_t kSlice = 64;        // K pairs of W a pass over the tile's rows reads (16 KiB of a block)
#endif

// Each row's log-softmax at its target column and the target's rank, from x [R, K] bfloat16 and W packed by
// bf16_dot_pack: (log p(target) [R] float32, logits above the target's [R] int64), the logits never written out.
// Tasks of 1,024 columns x 48 rows keep a chunk's running max and exp sums per row; chunks are merged in column
// order, so a row's result depends on neither its batch nor the thread count. Equal to log_softmax of bf16_dot's
// logits up to the order of the exp sums.
std::tuple<at::Tensor, at::Tensor> bf16_dot_logprobs(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                                     const at::Tensor& targets) {
  check_bf16_matrix(x, "x");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1) && packed.size(0) * kLanes >= n && n > 0,
              "bf16_dot_logprobs: a weight packed by bf16_dot_pack for this x and n expected");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == x.size(0),
              "bf16_dot_logprobs: one int64 target a row");
  const int64_t rows = x.size(0);
  at::Tensor logprobs = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor above = at::zeros({rows}, x.options().dtype(at::kLong));
  const at::Tensor t = targets.contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < n, "bf16_dot_logprobs: target ", tp[r], " outside the ", n, " columns");
#ifdef __AVX512BF16__
  const int64_t k2 = packed.size(1), blocks = (n + kBlock - 1) / kBlock;
  const int64_t chunks = (blocks + kChunkBlocks - 1) / kChunkBlocks, tiles = (rows + kRowTile - 1) / kRowTile;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const __m512i* wp = reinterpret_cast<const __m512i*>(packed.data_ptr());
  // The target's logit, by the very operations the chunks compute it with (a column's sum does not depend on
  // the rows beside it), so that counting the logits above it never counts the target itself.
  std::vector<float> target_logit(rows);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    alignas(64) float block[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = tp[r] / kBlock;
      dot_block<1>(xp + r * k2, k2, wp + b * kTiles * k2, block, kBlock, std::min<int64_t>(kBlock, n - b * kBlock));
      target_logit[r] = block[tp[r] - b * kBlock];
    }
  });
  std::vector<RowState> states(chunks * rows);
  at::parallel_for(0, chunks * tiles, 1, [&](int64_t task0, int64_t task1) {
    alignas(64) float block[kRowTile * kBlock];
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t c = task / tiles, r_begin = task % tiles * kRowTile;
      const int64_t r_end = std::min(rows, r_begin + kRowTile);
      for (int64_t b = c * kChunkBlocks; b < std::min(blocks, (c + 1) * kChunkBlocks); ++b) {
        const __m512i* w = wp + b * kTiles * k2;
        for (int64_t k0 = 0; k0 < k2; k0 += kSlice)
          for (int64_t r = r_begin; r < r_end; r += kRows)
            dot_slice_rows<kRows>(xp + r * k2, std::min<int64_t>(kRows, r_end - r), k2, k0,
                                  std::min(k2, k0 + kSlice), w, block + (r - r_begin) * kBlock);
        const int64_t columns = std::min<int64_t>(kBlock, n - b * kBlock);
        for (int64_t r = r_begin; r < r_end; ++r)
          states[c * rows + r].add(block + (r - r_begin) * kBlock, columns, target_logit[r]);
      }
    }
  });
  float* lp = logprobs.data_ptr<float>();
  int64_t* ap = above.data_ptr<int64_t>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) max = std::max(max, states[c * rows + r].max);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const RowState& s = states[c * rows + r];
        sums = _mm512_add_ps(sums, _mm512_mul_ps(s.sums, exp_nonpositive(_mm512_set1_ps(s.max - max))));
        ap[r] += s.above;
      }
      alignas(64) float lanes[kLanes];
      _mm512_store_ps(lanes, sums);
      float sum = 0.0f;
      for (const float lane : lanes) sum += lane;  // a fixed order, not the compiler's choice of tree
      lp[r] = (target_logit[r] - max) - std::log(sum);
    }
  });
#else
  TORCH_CHECK(false, "bf16_dot_logprobs: this build has no AVX512_BF16 (see bf16_dot_available)");
#endif
  return {logprobs, above};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchjob_cpu, m) {
  m.def("bf16_dot_available() -> bool", &bf16_dot_available);  // no tensor to dispatch on: one kernel for all
  m.def("bf16_dot_pack(Tensor weight) -> Tensor");
  m.def("bf16_dot(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
  m.impl("bf16_dot_pack", c10::DispatchKey::CPU, &bf16_dot_pack);
  m.def("bf16_dot_logprobs(Tensor x, Tensor packed, int n, Tensor targets) -> (Tensor, Tensor)");
  m.impl("bf16_dot", c10::DispatchKey::CPU, &bf16_dot);
  m.impl("bf16_dot_logprobs", c10::DispatchKey::CPU, &bf16_dot_logprobs);
}
