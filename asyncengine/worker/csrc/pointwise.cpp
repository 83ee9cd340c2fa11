// The pointwise layers of a decoder on the CPU, one pass each: RMSNorm (alone, or after the
// residual add before it), rotary embedding (in place) and SiLU-and-multiply. Arithmetic runs
// in float32 and each result is rounded to the tensor's dtype at the same points as
// transformers' eager code rounds it, so bf16 outputs match it bit for bit wherever the float32
// sums agree.
//
// Built with paged_attention.cpp by asyncengine/worker/cpu_ops.py; torch.ops.asyncengine.*.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"

namespace {

using asyncengine_cpu::fast_exp;
using asyncengine_cpu::from_float;
using asyncengine_cpu::round_to;
using asyncengine_cpu::to_float;

// rows per thread: at least torch's grain of 32768 elements, below which waking a thread costs
// more than it saves
inline int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 32768 / row_len); }

// one row: out = weight * T(x * rsqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm
template <typename T>
inline void norm_row(T* __restrict out, const T* __restrict x, const T* __restrict w, int64_t dim,
                     float eps) {
  float sum = 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float v = to_float(x[d]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d)
    out[d] = from_float<T>(to_float(w[d]) * round_to<T>(to_float(x[d]) * inv));
}

// out, x: [rows, dim] (rows contiguous); weight: [dim]
template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xs = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(os + r * dim, xs + r * dim, w, dim, static_cast<float>(eps));
  });
}

// residual, x, out: [rows, dim] (rows contiguous); weight: [dim]
// residual = T(residual + x) in place, then out = rms_norm(residual): a decoder's residual add
// and the next RMSNorm in one pass, each rounded as the two separate ops round
template <typename T>
void add_rms_norm_kernel(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                         const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xs = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* rs = residual.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xs + r * dim;
      T* rr = rs + r * dim;
      for (int64_t d = 0; d < dim; ++d) rr[d] = from_float<T>(to_float(rr[d]) + to_float(xr[d]));
      norm_row(os + r * dim, rr, w, dim, static_cast<float>(eps));  // the row is in L1 still
    }
  });
}

// x: [tokens, heads, head_dim], rotated in place (rows may be strided: a view into fused qkv)
// cos, sin: [max_positions, head_dim / 2] float32; positions: [tokens] int64
// rotate-half layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), with c and s rounded to T first
template <typename T>
void rotary_kernel(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* xs = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  at::parallel_for(0, tokens, grain(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * half;
      const float* s = sn + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = xs + t * token_stride + h * head_stride;
        T* x2 = x1 + half;
        for (int64_t d = 0; d < half; ++d) {
          const float cd = round_to<T>(c[d]), sd = round_to<T>(s[d]);
          const float a = to_float(x1[d]), b = to_float(x2[d]);
          x1[d] = from_float<T>(round_to<T>(a * cd) - round_to<T>(b * sd));
          x2[d] = from_float<T>(round_to<T>(b * cd) + round_to<T>(a * sd));
        }
      }
    }
  });
}

// x: [rows, 2 * n] (gate, then up); out: [rows, n] = T(silu(gate)) * up
template <typename T>
void silu_and_mul_kernel(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xs = x.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xs + r * 2 * n;
      const T* up = gate + n;
      T* orow = os + r * n;
      for (int64_t d = 0; d < n; ++d) {
        const float g = to_float(gate[d]);
        orow[d] = from_float<T>(round_to<T>(g / (1.f + fast_exp(-g))) * to_float(up[d]));
      }
    }
  });
}

#define DISPATCH_FLOATING(dtype, NAME, ...)                             \
  switch (dtype) {                                                      \
    case at::kFloat: {                                                  \
      using scalar_t = float;                                           \
      __VA_ARGS__();                                                    \
      break;                                                            \
    }                                                                   \
    case at::kBFloat16: {                                               \
      using scalar_t = c10::BFloat16;                                   \
      __VA_ARGS__();                                                    \
      break;                                                            \
    }                                                                   \
    case at::kHalf: {                                                   \
      using scalar_t = c10::Half;                                       \
      __VA_ARGS__();                                                    \
      break;                                                            \
    }                                                                   \
    default:                                                            \
      TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);           \
  }

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.sizes() == x.sizes() && out.is_contiguous(),
              "rms_norm: x and out must be contiguous [rows, dim]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be [dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out must share a dtype");
  DISPATCH_FLOATING(x.scalar_type(), "rms_norm",
                    [&] { rms_norm_kernel<scalar_t>(out, x, weight, eps); });
}

void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.is_contiguous() && out.sizes() == x.sizes() && out.is_contiguous(),
              "add_rms_norm: x, residual and out must be contiguous [rows, dim]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "add_rms_norm: weight must be [dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: x, residual, weight and out must share a dtype");
  DISPATCH_FLOATING(x.scalar_type(), "add_rms_norm",
                    [&] { add_rms_norm_kernel<scalar_t>(out, residual, x, weight, eps); });
}

void rotary_embedding(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_embedding: x must be [tokens, heads, head_dim] with unit stride in dim");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rotary_embedding: positions must be int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(1) * 2 == x.size(2),
              "rotary_embedding: cos and sin must be float32 [positions, head_dim / 2]");
  DISPATCH_FLOATING(x.scalar_type(), "rotary_embedding",
                    [&] { rotary_kernel<scalar_t>(x, positions, cos, sin); });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous() &&
                  out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x must be contiguous [rows, 2n] and out [rows, n] of its dtype");
  DISPATCH_FLOATING(x.scalar_type(), "silu_and_mul",
                    [&] { silu_and_mul_kernel<scalar_t>(out, x); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(asyncengine, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) "
      "-> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(asyncengine, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
