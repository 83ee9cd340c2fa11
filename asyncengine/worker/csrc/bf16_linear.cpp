// A bfloat16 linear layer for CPUs with AVX512-BF16 (asyncengine/worker/cpu_linear.py).
//
// out[m, n] = x[m, :] . w[n, :] (+ bias[n]), products and sums in float32, rounded to bf16 once.
// The weight is stored in column tiles of kCols outputs, each tile as K/2 rows of kCols pairs
// ([N / kCols, K / 2, kCols, 2]: `pack_bf16_weight` in cpu_linear.py), so one 64-byte load holds
// 16 outputs' next two weights, the operand of one `vdpbf16ps` against a broadcast pair of x.
//
// A gated product (`bf16_linear_silu_mul`) takes a weight that stacks a gate's outputs and an up
// projection's, packed in pairs (`pair_gate_up` before `pack_bf16_weight`): tile t holds gate
// outputs 16t..16t+15 in its first register and the same up outputs in its second. Its pass
// ends in silu(gate) * up, rounded where transformers rounds (the linears' outputs, then silu's),
// and writes half the columns: the MLP's separate activation op and its pass over the
// [rows, 2 * intermediate] product are gone.
//
// A decode step's product has few rows, and its weights come from memory (a model's are far
// larger than the caches) at about the rate the cores can multiply them: the kernel keeps both
// busy at once. While a tile's outputs are computed, the next tile is prefetched into L2, spread
// over the tile's passes (one per kMaxRows rows), so the memory stream never waits on the
// arithmetic or the other way round. Over a forward's weights read from memory this is 1.5x
// oneDNN's packed product at 16 rows and no slower at 512 (benchmarks/cpu_kernels.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <utility>

#include "cpu_common.h"

namespace {

constexpr int64_t kCols = 32;     // outputs per column tile: two 16-lane registers
constexpr int kMaxRows = 12;      // rows per pass: 24 accumulators + 2 weight registers
constexpr int64_t kLine = 64;     // bytes per cache line
constexpr int64_t kAheadL1 = 32;  // registers of the current tile prefetched ahead into L1

#if defined(__AVX512BF16__)

// 16 floats rounded to bf16 (to nearest even), and the bf16 values back as floats
inline __m512 round_bf16(__m512 v) {
  return asyncengine_cpu::widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
}

// silu(gate) * up of 16 outputs, rounded as silu_and_mul (pointwise.cpp) rounds
inline __m256i silu_mul16(__m512 gate_sum, __m512 up_sum) {
  const __m512 gate = round_bf16(gate_sum), up = round_bf16(up_sum);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gate);
  const __m512 denominator = _mm512_add_ps(one, asyncengine_cpu::exp16(neg));
  const __m512 silu = round_bf16(_mm512_div_ps(gate, denominator));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, up));
}

// `rows` rows of x against one column tile. `next` (`next_lines` cache lines left to fetch,
// `lines_per_pair` of them per weight pair) is the next tile's part this pass prefetches.
// `Gated`: the tile pairs gate and up outputs, and the pass writes silu(gate) * up.
template <int Rows, bool Gated>
void tile_pass(const int32_t* x, int64_t x_stride, const __m512i* w, int64_t pairs,
               const c10::BFloat16* bias, c10::BFloat16* out, int64_t out_stride,
               const char* next, int64_t next_lines, int lines_per_pair) {
  __m512 acc[Rows][2];
  for (int j = 0; j < 2; ++j) {
    const __m512 start =
        bias == nullptr ? _mm512_setzero_ps() : asyncengine_cpu::load16(bias + 16 * j);
    for (int i = 0; i < Rows; ++i) acc[i][j] = start;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i* wp = w + 2 * p;
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAheadL1), _MM_HINT_T0);
    if (p * lines_per_pair < next_lines) {
      for (int q = 0; q < lines_per_pair; ++q)
        _mm_prefetch(next + (p * lines_per_pair + q) * kLine, _MM_HINT_T1);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 1);
    for (int i = 0; i < Rows; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(x[i * x_stride + p]);  // x[i, 2p:2p+2]
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xi, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xi, w1);
    }
  }
  for (int i = 0; i < Rows; ++i) {
    if constexpr (Gated) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * out_stride),
                          silu_mul16(acc[i][0], acc[i][1]));
    } else {
      for (int j = 0; j < 2; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * out_stride + 16 * j),
                            (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
      }
    }
  }
}

using TilePass = void (*)(const int32_t*, int64_t, const __m512i*, int64_t,
                          const c10::BFloat16*, c10::BFloat16*, int64_t, const char*, int64_t,
                          int);

template <bool Gated, int... R>
constexpr std::array<TilePass, sizeof...(R)> make_passes(std::integer_sequence<int, R...>) {
  return {&tile_pass<R + 1, Gated>...};
}
constexpr auto kPasses = make_passes<false>(std::make_integer_sequence<int, kMaxRows>{});
constexpr auto kGatedPasses = make_passes<true>(std::make_integer_sequence<int, kMaxRows>{});

#endif  // __AVX512BF16__

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// out = x @ w.T (+ bias), or, `gated`, silu(gate) * up of it: [rows, N / 2]
void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
            const std::optional<at::Tensor>& bias, bool gated) {
  TORCH_CHECK(bf16_linear_available(), "bf16_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x: a contiguous 2-D bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kCols &&
                  packed.size(3) == 2 && packed.scalar_type() == at::kBFloat16,
              "packed: a contiguous bfloat16 [N / 32, K / 2, 32, 2] tensor");
  const int64_t rows = x.size(0), pairs = packed.size(1), tiles = packed.size(0);
  const int64_t n = tiles * kCols;
  TORCH_CHECK(x.size(1) == 2 * pairs, "x has ", x.size(1), " columns, the weight ", 2 * pairs);
  const int64_t out_cols = gated ? n / 2 : n;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == rows &&
                  out.size(1) == out_cols && out.scalar_type() == at::kBFloat16,
              "out: a contiguous bfloat16 [rows, ", gated ? "N / 2" : "N", "] tensor");
  [[maybe_unused]] const c10::BFloat16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "bias: a contiguous bfloat16 [N] tensor");
    bias_data = bias->data_ptr<c10::BFloat16>();
  }
  if (rows == 0) return;
#if defined(__AVX512BF16__)
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x.data_ptr());
  const __m512i* weight = reinterpret_cast<const __m512i*>(packed.data_ptr());
  c10::BFloat16* out_data = out.data_ptr<c10::BFloat16>();
  const int64_t tile_lines = 2 * pairs;  // a tile's 64-byte registers, each a cache line
  const int64_t num_passes = (rows + kMaxRows - 1) / kMaxRows;
  const int lines_per_pair = static_cast<int>((2 + num_passes - 1) / num_passes);
  const auto& passes = gated ? kGatedPasses : kPasses;
  const int64_t tile_cols = gated ? kCols / 2 : kCols;  // the output columns a tile writes
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const char* next = reinterpret_cast<const char*>(weight + (t + 1) * tile_lines);
      const int64_t next_lines = t + 1 < end ? tile_lines : 0;  // the next tile of this thread
      int64_t fetched = 0;
      for (int64_t row = 0; row < rows;) {
        // passes of even size: 16 rows as 8 + 8, not 12 + 4
        const int64_t left = rows - row;
        const int64_t passes_left = (left + kMaxRows - 1) / kMaxRows;
        const int64_t pass_rows = (left + passes_left - 1) / passes_left;
        passes[pass_rows - 1](x_pairs + row * pairs, pairs, weight + t * tile_lines, pairs,
                              bias_data == nullptr ? nullptr : bias_data + t * kCols,
                              out_data + row * out_cols + t * tile_cols, out_cols,
                              next + fetched * kLine, std::max<int64_t>(0, next_lines - fetched),
                              lines_per_pair);
        fetched += pairs * lines_per_pair;
        row += pass_rows;
      }
    }
  });
#endif
}

void bf16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias) {
  linear(out, x, packed, bias, /*gated=*/false);
}

void bf16_linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                          const std::optional<at::Tensor>& bias) {
  linear(out, x, packed, bias, /*gated=*/true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(asyncengine, m) {
  m.def("bf16_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("bf16_linear_silu_mul(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
}

TORCH_LIBRARY_IMPL(asyncengine, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_linear_silu_mul", &bf16_linear_silu_mul);
}
