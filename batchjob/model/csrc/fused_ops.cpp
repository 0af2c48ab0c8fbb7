// The decoder layer's elementwise ops on a CPU, each one pass over its rows on all threads: in torch each is several
// kernels (RMSNorm: add, pow, mean, rsqrt, two muls; rotary: float casts, chunks, four muls, cat) with a temporary
// per step, a noticeable share of a step at SmolLM2's sizes. Float32 or bfloat16 rows (cpu_types.h), contiguous within
// a row; the arithmetic is HF's, in float32 (RMSNorm: x * rsqrt(mean(x^2) + eps), rounded to the row's type, then
// times the weight; rotary in the neox layout), each result rounded to the row's type where HF's would be.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "cpu_types.h"

namespace {

constexpr int64_t kGrain = 16;  // rows per task: a row is a few hundred floats

// Calls f.template operator()<T>() with T the element type of float32 or bfloat16 tensors.
template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  if (dtype == at::kFloat)
    f.template operator()<float>();
  else if (dtype == at::kBFloat16)
    f.template operator()<bf16>();
  else
    TORCH_CHECK(false, name, ": float32 or bfloat16 only");
}

void check_rows(const at::Tensor& x, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.scalar_type() == dtype, name, ": all tensors of one dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": rows of contiguous elements expected");
}

template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) sq += to_f32(x[i]) * to_f32(x[i]);
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<T>(to_f32(from_f32<T>(to_f32(x[i]) * inv)) * to_f32(w[i]));
}

// RMSNorm of x [T, N] into a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), "rms_norm", [&]<typename T>() {
    check_rows(x, w.scalar_type(), "rms_norm");
    const int64_t n = x.size(1), xs = x.stride(0);
    const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * xs, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x, then x = RMSNorm(residual): the decoder layer's pre-norm, in place on both ([T, N] contiguous).
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm_: shapes");
  const at::Tensor w = weight.contiguous();
  dispatch(x.scalar_type(), "add_rms_norm_", [&]<typename T>() {
    check_rows(x, w.scalar_type(), "add_rms_norm_");
    check_rows(residual, w.scalar_type(), "add_rms_norm_");
    const int64_t n = x.size(1);
    T *xp = x.data_ptr<T>(), *rp = residual.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        T *xr = xp + r * n, *rr = rp + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) rr[i] = from_f32<T>(to_f32(rr[i]) + to_f32(xr[i]));
        norm_row(rr, wp, xr, n, static_cast<float>(eps));
      }
    });
  });
}

// Rotary embedding in place on q [T, H, D] and k [T, KVH, D] (views of the fused qkv rows: each head's D floats
// contiguous), neox layout: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos_sin_cache [P, R] holds cos
// in its first R/2 columns and sin in the rest. The first R dims of a head turn; with R < D (partial rotary) the
// others stay as they are.
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "rotary_: q and k of one dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) == k.size(2),
              "rotary_: q [T, H, D] and k [T, KVH, D] with contiguous heads");
  const int64_t d = q.size(2), rot = cos_sin_cache.size(1), half = rot / 2;
  TORCH_CHECK(q.stride(1) == d && k.stride(1) == d, "rotary_: heads back to back");
  const at::Tensor cs = cos_sin_cache.contiguous(), pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(cs.scalar_type() == at::kFloat && rot % 2 == 0 && rot <= d,
              "rotary_: cos_sin_cache [P, R] float32, R even and at most D");
  const int64_t h = q.size(1), kvh = k.size(1), qs = q.stride(0), ks = k.stride(0), max_pos = cs.size(0);
  const float* csp = cs.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.size(0); ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_: position out of range");
  dispatch(q.scalar_type(), "rotary_", [&]<typename T>() {
    T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
    auto rotate = [half](T* x, const float* cos, const float* sin) {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
        x[i] = from_f32<T>(x1 * cos[i] - x2 * sin[i]);
        x[i + half] = from_f32<T>(x2 * cos[i] + x1 * sin[i]);
      }
    };
    at::parallel_for(0, q.size(0), kGrain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float *cos = csp + pp[t] * rot, *sin = cos + half;
        for (int64_t j = 0; j < h; ++j) rotate(qp + t * qs + j * d, cos, sin);
        for (int64_t j = 0; j < kvh; ++j) rotate(kp + t * ks + j * d, cos, sin);
      }
    });
  });
}

// The step's K and V rows [T, KVH, D] into the paged cache [num_blocks, block_size, KVH, D] at slot_mapping
// (slots < 0 are skipped): rows copied as they are, so the cache holds the model's dtype.
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  const auto dtype = k.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && v.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "store_kv: all float32 or all bfloat16");
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv: contiguous caches");
  TORCH_CHECK(k.dim() == 3 && k.size(1) * k.size(2) == row && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.sizes() == k.sizes() && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "store_kv: K/V rows [T, KVH, D] with contiguous rows");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < slots.size(0); ++t) TORCH_CHECK(sp[t] < num_slots, "store_kv: slot out of range");
  const int64_t size = k.element_size();
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, slots.size(0), 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * row * size, kp + t * ks * size, row * size);
      std::memcpy(vc + sp[t] * row * size, vp + t * vs * size, row * size);
    }
  });
}

// x [T, 2I] holds gate then up: returns silu(gate) * up [T, I].
// (silu rounded to x's type before the product, as torch's F.silu(gate) * up rounds it)
at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t inter = x.size(1) / 2, xs = x.stride(0);
  at::Tensor out = at::empty({x.size(0), inter}, x.options());
  dispatch(x.scalar_type(), "silu_and_mul", [&]<typename T>() {
    check_rows(x, x.scalar_type(), "silu_and_mul");
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T *g = xp + r * xs, *u = g + inter;
        T* o = op + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
          const float gi = to_f32(g[i]);
          o[i] = from_f32<T>(to_f32(from_f32<T>(gi / (1.f + std::exp(-gi)))) * to_f32(u[i]));
        }
      }
    });
  });
  return out;
}

// Each row of x [T, K] quantized for the int8 matmuls (int8_linear.py's quantize_rows_torch in one pass): inv = 127 /
// max(max|x|, 1e-12), q = round-half-even(x * inv) + 128 as uint8 [T, K], scale = max(max|x|, 1e-12) * (1 / 127).
// One pass over a row that stays in L1, where torch's ops take five over the whole activation, each a temporary.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  at::Tensor q = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), "quantize_rows", [&]<typename T>() {
    check_rows(x, x.scalar_type(), "quantize_rows");
    const int64_t n = x.size(1), xs = x.stride(0);
    const T* xp = x.data_ptr<T>();
    uint8_t* qp = q.data_ptr<uint8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = xp + r * xs;
        float m = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(to_f32(xr[i])));
        m = std::max(m, 1e-12f);
        const float inv = 127.f / m;
        sp[r] = m * (1.f / 127.f);  // as torch computes it, to the bit: a product, which fast-math leaves as it is
        uint8_t* qr = qp + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float v = std::min(std::max(std::nearbyint(to_f32(xr[i]) * inv), -127.f), 127.f);
          qr[i] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
        }
      }
    });
  });
  return {q, scale};
}

// How many of each row's values exceed the row's threshold: a prompt token's rank less one, from its row of
// logprobs. torch's (x > t).sum(-1) widens the booleans to int64 first, a pass over [rows, vocab] eight times their size.
at::Tensor count_greater(const at::Tensor& x, const at::Tensor& threshold) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && threshold.scalar_type() == at::kFloat, "count_greater: float32 only");
  check_rows(x, at::kFloat, "count_greater");
  const at::Tensor t = threshold.contiguous();
  TORCH_CHECK(t.numel() == x.size(0), "count_greater: one threshold a row");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const int64_t n = x.size(1), xs = x.stride(0);
  const float *xp = x.data_ptr<float>(), *tp = t.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * xs;
      const float limit = tp[r];
      int32_t above = 0;
#pragma omp simd reduction(+ : above)
      for (int64_t i = 0; i < n; ++i) above += xr[i] > limit;
      op[r] = above;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchjob_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("count_greater(Tensor x, Tensor threshold) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
  m.impl("rotary_", c10::DispatchKey::CPU, &rotary_);
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("quantize_rows", c10::DispatchKey::CPU, &quantize_rows);
  m.impl("count_greater", c10::DispatchKey::CPU, &count_greater);
}
