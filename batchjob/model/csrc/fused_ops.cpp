// The decoder layer's elementwise ops on a CPU, each one pass over its rows on all threads: in torch each is several
// kernels (RMSNorm: add, pow, mean, rsqrt, two muls; rotary: float casts, chunks, four muls, cat) with a temporary
// per step, a noticeable share of a step at SmolLM2's sizes. Float32 rows, contiguous within a row; the arithmetic is
// HF's (RMSNorm in float32, x * rsqrt(mean(x^2) + eps) then times the weight; rotary in the neox layout).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGrain = 16;  // rows per task: a row is a few hundred floats

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": rows of contiguous floats expected");
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// RMSNorm of x [T, N] into a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const at::Tensor w = weight.contiguous();
  const int64_t n = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * xs, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// residual += x, then x = RMSNorm(residual): the decoder layer's pre-norm, in place on both ([T, N] contiguous).
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm_: shapes");
  const at::Tensor w = weight.contiguous();
  const int64_t n = x.size(1);
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float *xr = xp + r * n, *rr = rp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      norm_row(rr, wp, xr, n, static_cast<float>(eps));
    }
  });
}

// Rotary embedding in place on q [T, H, D] and k [T, KVH, D] (views of the fused qkv rows: each head's D floats
// contiguous), neox layout: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos_sin_cache [P, D] holds cos
// in its first D/2 columns and sin in the rest.
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "rotary_: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) == k.size(2),
              "rotary_: q [T, H, D] and k [T, KVH, D] with contiguous heads");
  const int64_t d = q.size(2), half = d / 2;
  TORCH_CHECK(q.stride(1) == d && k.stride(1) == d, "rotary_: heads back to back");
  const at::Tensor cs = cos_sin_cache.contiguous(), pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(cs.scalar_type() == at::kFloat && cs.size(1) == d, "rotary_: cos_sin_cache [P, D] float32");
  const int64_t h = q.size(1), kvh = k.size(1), qs = q.stride(0), ks = k.stride(0), max_pos = cs.size(0);
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float* csp = cs.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.size(0); ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_: position out of range");
  auto rotate = [half](float* x, const float* cos, const float* sin) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * cos[i] - x2 * sin[i];
      x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  };
  at::parallel_for(0, q.size(0), kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *cos = csp + pp[t] * d, *sin = cos + half;
      for (int64_t j = 0; j < h; ++j) rotate(qp + t * qs + j * d, cos, sin);
      for (int64_t j = 0; j < kvh; ++j) rotate(kp + t * ks + j * d, cos, sin);
    }
  });
}

// The step's K and V rows [T, KVH, D] into the paged cache [num_blocks, block_size, KVH, D] at slot_mapping
// (slots < 0 are skipped).
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "store_kv: float32 only");
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv: contiguous caches");
  TORCH_CHECK(k.dim() == 3 && k.size(1) * k.size(2) == row && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.sizes() == k.sizes() && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "store_kv: K/V rows [T, KVH, D] with contiguous rows");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < slots.size(0); ++t) TORCH_CHECK(sp[t] < num_slots, "store_kv: slot out of range");
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  at::parallel_for(0, slots.size(0), 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * row, kp + t * ks, row * sizeof(float));
      std::memcpy(vc + sp[t] * row, vp + t * vs, row * sizeof(float));
    }
  });
}

// x [T, 2I] holds gate then up: returns silu(gate) * up [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  const int64_t inter = x.size(1) / 2, xs = x.stride(0);
  at::Tensor out = at::empty({x.size(0), inter}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = xp + r * xs, *u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
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
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
  m.impl("rotary_", c10::DispatchKey::CPU, &rotary_);
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
}
