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
#include <cstdint>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchjob_cpu, m) {
  m.def("bf16_dot_available() -> bool", &bf16_dot_available);  // no tensor to dispatch on: one kernel for all
  m.def("bf16_dot_pack(Tensor weight) -> Tensor");
  m.def("bf16_dot(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
  m.impl("bf16_dot_pack", c10::DispatchKey::CPU, &bf16_dot_pack);
  m.impl("bf16_dot", c10::DispatchKey::CPU, &bf16_dot);
}
