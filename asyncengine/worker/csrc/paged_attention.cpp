// Paged decode attention on the CPU: one new token per sequence, attending over its cached K/V
// read in place through its block table. Each block is read once (K for all the query heads of
// a KV head, then V), and nothing is computed for slots outside the sequence or its window.
// Softmax and the weighted sum of V run in float32 whatever the cache dtype, and so do the
// scores but over a bfloat16 cache on AVX512-BF16 (products in bf16 pairs, summed in float32).
//
// Built on first use by asyncengine/worker/cpu_ops.py; torch.ops.asyncengine.paged_decode_attention.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

using asyncengine_cpu::exp_in_place;
using asyncengine_cpu::from_float;
#if defined(__AVX512F__)
using asyncengine_cpu::load16;
#endif
using asyncengine_cpu::load_row;
using asyncengine_cpu::to_float;

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  float acc = 0.f;  // reassociated into a vector sum (built with -fassociative-math)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * to_float(b[d]);
  return acc;
}

#if defined(__AVX512F__)
// The lane sums of a0..a3, times `scale`, into out[0], out[stride], .., out[3 * stride]: each
// sum's lanes halved, twice, two sums to a register (a 128-bit quarter a sum), then the 4 lanes
// of each quarter.
inline void store_sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float scale, float* out,
                        int64_t stride) {
  const __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44),
                                   _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44),
                                   _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, 0x88),
                           _mm512_shuffle_f32x4(r01, r23, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
  for (int64_t j = 0; j < 4; ++j) out[j * stride] = lanes[4 * j];
}
#endif

// The scores of `num_heads` query heads (rows of `q`, `dim` apart) against one K row, read in
// the cache's dtype, into `out` (`out_stride` apart). A dot product alone ends in a horizontal
// sum that costs more than its multiplies at head_dim 64; with AVX-512, four heads' sums are
// folded together instead.
template <typename T>
inline void head_dots(const float* __restrict q, const T* __restrict k, int64_t num_heads,
                      int64_t dim, float* __restrict out, int64_t out_stride) {
  int64_t h = 0;
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (; h + 4 <= num_heads; h += 4) {
      const float* q0 = q + h * dim;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 kd = load16(k + d);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), kd, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + dim + d), kd, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 2 * dim + d), kd, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 3 * dim + d), kd, a3);
      }
      store_sums4(a0, a1, a2, a3, 1.f, out + h * out_stride, out_stride);
    }
  }
#endif
  for (; h < num_heads; ++h) out[h * out_stride] = dot(q + h * dim, k, dim);
}

#if defined(__AVX512BF16__)
// head_dots for a bfloat16 query and K row on a CPU with AVX512-BF16: the products in bf16
// pairs (vdpbf16ps, summed in float32), half the multiplies and no conversion of K, then times
// `scale`. Four heads at a time: num_heads a multiple of 4, dim of 32.
inline void head_dots_bf16(const c10::BFloat16* __restrict q, const c10::BFloat16* __restrict k,
                           int64_t num_heads, int64_t dim, float scale, float* __restrict out,
                           int64_t out_stride) {
  for (int64_t h = 0; h < num_heads; h += 4) {
    const c10::BFloat16* q0 = q + h * dim;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512bh kd = (__m512bh)_mm512_loadu_si512(k + d);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(q0 + d), kd);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(q0 + dim + d), kd);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(q0 + 2 * dim + d), kd);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(q0 + 3 * dim + d), kd);
    }
    store_sums4(a0, a1, a2, a3, scale, out + h * out_stride, out_stride);
  }
}
#endif

#if defined(__AVX512F__)
// The lane sums of 16 vectors, four to a 128-bit quarter: quarter j holds the sums of
// v[4j] .. v[4j + 3], in order. Pairs of lanes are added first, then pairs of those, then the
// quarters: 45 instructions for 16 sums, where summing each vector alone takes 4 or more apiece.
inline __m512 sums16(const __m512* v) {
  __m512 pairs[8];  // per quarter: v[2j] and v[2j + 1], each as two partial sums
  for (int j = 0; j < 8; ++j)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  __m512 quads[4];  // per quarter: the quarter's sum of v[4j] .. v[4j + 3]
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// sums16's quarters, quarter j (four floats) at out + j * out_stride
inline void store_quarters(__m512 sums, float* out, int64_t out_stride) {
  _mm_storeu_ps(out, _mm512_castps512_ps128(sums));
  _mm_storeu_ps(out + out_stride, _mm512_extractf32x4_ps(sums, 1));
  _mm_storeu_ps(out + 2 * out_stride, _mm512_extractf32x4_ps(sums, 2));
  _mm_storeu_ps(out + 3 * out_stride, _mm512_extractf32x4_ps(sums, 3));
}

// head_dots over four K rows at once (four consecutive slots) for 4 query heads (rows of `q`,
// `dim` apart, scaled already): their 16 dot products summed together by sums16, each head's 4
// scores stored as one 128-bit write at out + h * out_stride. dim a multiple of 16.
template <typename T>
inline void head_dots_x4(const float* __restrict q, const T* const* k, int64_t dim,
                         float* __restrict out, int64_t out_stride) {
  __m512 acc[16];  // acc[4 * head + row]
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    __m512 rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = load16(k[r] + d);
    for (int h = 0; h < 4; ++h) {
      const __m512 qd = _mm512_loadu_ps(q + h * dim + d);
      for (int r = 0; r < 4; ++r) acc[4 * h + r] = _mm512_fmadd_ps(qd, rows[r], acc[4 * h + r]);
    }
  }
  store_quarters(sums16(acc), out, out_stride);
}
#endif

#if defined(__AVX512BF16__)
// head_dots_x4 in bf16 pairs (vdpbf16ps) for a bfloat16 query and K rows, times `scale`. dim a
// multiple of 32.
inline void head_dots_bf16_x4(const c10::BFloat16* __restrict q, const c10::BFloat16* const* k,
                              int64_t dim, float scale, float* __restrict out,
                              int64_t out_stride) {
  __m512 acc[16];  // acc[4 * head + row]
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 32) {
    __m512bh rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = (__m512bh)_mm512_loadu_si512(k[r] + d);
    for (int h = 0; h < 4; ++h) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + h * dim + d);
      for (int r = 0; r < 4; ++r) acc[4 * h + r] = _mm512_dpbf16_ps(acc[4 * h + r], qd, rows[r]);
    }
  }
  store_quarters(_mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale)), out, out_stride);
}
#endif

#if defined(__AVX512F__)
// The weighted sum of V for `heads` query heads of one KV head, kept in registers over every
// slot: a head's D floats are D / 16 registers, and kHeads heads are summed in one pass over
// the slots (16 accumulators). acc[h * D ..] = sum over slots i of p[h * n + i] * V[slot i].
template <typename T, int D>
struct WeightedV {
  static constexpr int kVecs = D / 16, kHeads = 16 / kVecs;

  template <typename ForEachSlot>
  static void run(ForEachSlot&& for_each_slot, int64_t heads, const float* p, int64_t n,
                  float* acc) {
    for (int64_t h0 = 0; h0 < heads; h0 += kHeads) {
      __m512 a[kHeads][kVecs];
      for (auto& head : a)
        for (auto& vec : head) vec = _mm512_setzero_ps();
      const float* ph = p + h0 * n;
      for_each_slot([&](const T* v, int64_t i) {
        __m512 row[kVecs];
        for (int j = 0; j < kVecs; ++j) row[j] = load16(v + 16 * j);
        for (int h = 0; h < kHeads; ++h) {
          const __m512 weight = _mm512_set1_ps(ph[h * n + i]);
          for (int j = 0; j < kVecs; ++j) a[h][j] = _mm512_fmadd_ps(weight, row[j], a[h][j]);
        }
      });
      for (int h = 0; h < kHeads; ++h)
        for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(acc + (h0 + h) * D + 16 * j, a[h][j]);
    }
  }
};
#endif

// out, query: [num_seqs, num_heads, head_dim]
// kv_cache:   [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32
//
// One work item is a sequence and a run of its KV heads (all of them when there are enough
// sequences to keep every thread busy): a block's slots are then read front to back, with the
// next block's and V's lines asked for ahead (for_each_slot), since the blocks lie anywhere.
template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   int64_t window) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between slots of one block
  const int64_t block_stride = block_size * token_stride;
  const int64_t max_blocks = block_tables.size(1);
  // threads only where there is work enough to pay for waking them (~0.1 ms)
  int64_t total_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total_len += seq_lens.data_ptr<int32_t>()[s];
  const int64_t work = total_len * num_heads * head_dim;
  const int num_threads = work < (1 << 18) ? 1 : at::get_num_threads();
  const int64_t kv_heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / kv_heads_per_item;
  const int64_t heads_per_item = kv_heads_per_item * group;
  const int64_t item_len = kv_heads_per_item * head_dim;  // contiguous elements per slot
  const T* q_base = query.data_ptr<T>();
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + num_blocks * block_stride;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* o_base = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  [[maybe_unused]] const bool by_fours = group % 4 == 0 && head_dim % 16 == 0;
  [[maybe_unused]] const bool bf16_dots = group % 4 == 0 && head_dim % 32 == 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> q(heads_per_item * head_dim), row(item_len);
    std::vector<float> acc(heads_per_item * head_dim), inv_sum(heads_per_item), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * items_per_seq; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t kv_head0 = (item % items_per_seq) * kv_heads_per_item;
      const int64_t len = lens[seq];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const int32_t* table = tables + seq * max_blocks;
      const int64_t first_block = start / block_size, end_block = (len + block_size - 1) / block_size;
      const T* q_seq = q_base + (seq * num_heads + kv_head0 * group) * head_dim;
      for (int64_t i = 0; i < heads_per_item * head_dim; ++i) q[i] = to_float(q_seq[i]) * fscale;
      scores.resize(heads_per_item * n);

      // One pass over K or V (`base`), block by block, each slot's row (the item's KV heads)
      // handed to `body` in the cache's dtype. The cache is far larger than the CPU's caches and its
      // blocks lie anywhere, so each slot asks for the same slot of the next block (a block
      // ahead, the misses spread over the block: all of a block's at once ran 1.2x slower)
      // and, over K, for its own V row into the outer caches, where the pass over V after the
      // softmax finds it. Together 2x the next K block alone: 1,180 -> 590 us a call for 64
      // sequences of 256-320 tokens, bf16, 2 threads (it was 17% of the op time of 256-token
      // prompts generating 64 tokens each).
      auto for_each_slot = [&](const T* base, auto&& body) {
        const bool is_k = base == k_base;
        for (int64_t b = first_block; b < end_block; ++b) {
          const int64_t t0 = std::max(start, b * block_size);
          const int64_t t1 = std::min(len, (b + 1) * block_size);
          const T* block = base + table[b] * block_stride + kv_head0 * head_dim;
          const T* next = b + 1 < end_block
                              ? base + table[b + 1] * block_stride + kv_head0 * head_dim
                              : nullptr;
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t slot = t - b * block_size;
            for (int64_t e = 0; next != nullptr && e < item_len; e += kLine)
              __builtin_prefetch(next + slot * token_stride + e);
            for (int64_t e = 0; is_k && e < item_len; e += kLine)
              __builtin_prefetch(block + (v_base - k_base) + slot * token_stride + e, 0, 1);
            body(block + slot * token_stride, t - start);
          }
        }
      };
      // V's weighted sum into acc, a KV head at a time with its heads' sums in registers
      // (AVX-512, a head_dim of 64 or 128, heads per KV head a multiple of 4 or 2); false: not
      // done, for the plain loop below
      auto weighted_v_in_registers = [&]() {
#if defined(__AVX512F__)
        auto by_kv_head = [&](auto sum) {
          using Sum = decltype(sum);
          if (group % Sum::kHeads != 0) return false;
          for (int64_t g = 0; g < kv_heads_per_item; ++g) {
            auto slots = [&](auto&& body) {
              const int64_t offset = (kv_head0 + g) * head_dim;
              for (int64_t b = first_block; b < end_block; ++b) {
                const int64_t t0 = std::max(start, b * block_size);
                const int64_t t1 = std::min(len, (b + 1) * block_size);
                const T* block = v_base + table[b] * block_stride + offset;
                const T* next =
                    b + 1 < end_block ? v_base + table[b + 1] * block_stride + offset : nullptr;
                for (int64_t t = t0; t < t1; ++t) {  // prefetching as for_each_slot does
                  const int64_t slot = t - b * block_size;
                  for (int64_t e = 0; next != nullptr && e < head_dim; e += kLine)
                    __builtin_prefetch(next + slot * token_stride + e);
                  body(block + slot * token_stride, t - start);
                }
              }
            };
            Sum::run(slots, group, scores.data() + g * group * n, n,
                     acc.data() + g * group * head_dim);
          }
          return true;
        };
        if (head_dim == 64) return by_kv_head(WeightedV<T, 64>{});
        if (head_dim == 128) return by_kv_head(WeightedV<T, 128>{});
#endif
        return false;
      };
      // The scores, a slot at a time (every head of the item against the slot's K row) ...
      auto score_slot = [&](const T* k, int64_t i) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (bf16_dots) {
            for (int64_t g = 0; g < kv_heads_per_item; ++g)
              head_dots_bf16(q_seq + g * group * head_dim, k + g * head_dim, group, head_dim,
                             fscale, scores.data() + g * group * n + i, n);
            return;
          }
        }
#endif
        for (int64_t g = 0; g < kv_heads_per_item; ++g)
          head_dots(q.data() + g * group * head_dim, k + g * head_dim, group, head_dim,
                    scores.data() + g * group * n + i, n);
      };
      // ... or, with AVX-512 and query heads in fours, four slots at a time (a run of four may
      // span two blocks), a slot at a time only for the last slots of the sequence
      bool scored = false;
#if defined(__AVX512F__)
      if (by_fours) {
        const T* run[4];
        int64_t run_start = 0, run_len = 0;
        for_each_slot(k_base, [&](const T* k, int64_t i) {
          if (run_len == 0) run_start = i;
          run[run_len++] = k;
          if (run_len < 4) return;
          run_len = 0;
          for (int64_t g = 0; g < kv_heads_per_item; ++g) {
            const T* rows[4] = {run[0] + g * head_dim, run[1] + g * head_dim,
                                run[2] + g * head_dim, run[3] + g * head_dim};
            for (int64_t h = g * group; h < (g + 1) * group; h += 4) {
              float* out = scores.data() + h * n + run_start;
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<T, c10::BFloat16>) {
                if (bf16_dots) {
                  head_dots_bf16_x4(q_seq + h * head_dim, rows, head_dim, fscale, out, n);
                  continue;
                }
              }
#endif
              head_dots_x4(q.data() + h * head_dim, rows, head_dim, out, n);
            }
          }
        });
        for (int64_t r = 0; r < run_len; ++r) score_slot(run[r], run_start + r);
        scored = true;
      }
#endif
      if (!scored) for_each_slot(k_base, score_slot);
      for (int64_t h = 0; h < heads_per_item; ++h)
        inv_sum[h] = exp_in_place(scores.data() + h * n, 0, n);
      if (!weighted_v_in_registers()) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for_each_slot(v_base, [&](const T* v_row, int64_t i) {
          load_row(v_row, row.data(), item_len);
          for (int64_t h = 0; h < heads_per_item; ++h) {
            const float p = scores[h * n + i];
            const float* v = row.data() + (h / group) * head_dim;
            float* a = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
          }
        });
      }
      T* o_seq = o_base + (seq * num_heads + kv_head0 * group) * head_dim;
      for (int64_t h = 0; h < heads_per_item; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          o_seq[h * head_dim + d] = from_float<T>(acc[h * head_dim + d] * inv_sum[h]);
    }
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [seqs, heads, dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache: [2, blocks, bs, kvh, dim]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0), "block_tables");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == query.size(0), "seq_lens");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "all inputs must be contiguous");
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_kernel<float>(out, query, kv_cache, block_tables, seq_lens, scale, window);
    case at::kBFloat16:
      return decode_kernel<c10::BFloat16>(out, query, kv_cache, block_tables, seq_lens, scale,
                                          window);
    case at::kHalf:
      return decode_kernel<c10::Half>(out, query, kv_cache, block_tables, seq_lens, scale, window);
    default:
      TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
}

// A step's new K and V rows into their cache slots (block * block_size + offset; a negative slot
// is skipped). key, value: [tokens, kv_heads, head_dim], rows possibly strided (views into the
// fused qkv rows), each row's heads contiguous; slots: [tokens] int64. One call for both: in
// torch it was two index_copy_ calls and the views to them, ~10 us a layer at decode.
void store_kv(at::Tensor kv_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: a contiguous [2, blocks, block_size, kv_heads, head_dim] tensor");
  const int64_t tokens = key.size(0), heads = kv_cache.size(3), dim = kv_cache.size(4);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads &&
                    t->size(2) == dim && t->stride(2) == 1 && t->stride(1) == dim,
                "key/value: [tokens, kv_heads, head_dim] rows with their heads contiguous");
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(), "key/value: the cache's dtype");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.is_contiguous() &&
                  slots.scalar_type() == at::kLong,
              "slots: a contiguous [tokens] int64 tensor");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row_bytes = heads * dim * kv_cache.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is past the cache's ", num_slots);
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + num_slots * row_bytes;
  const char* k_rows = static_cast<const char*>(key.data_ptr());
  const char* v_rows = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  const int64_t grain = std::max<int64_t>(1, 65536 / row_bytes);  // tokens a thread copies
  at::parallel_for(0, tokens, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (slot[t] < 0) continue;
      std::memcpy(k_cache + slot[t] * row_bytes, k_rows + t * k_stride, row_bytes);
      std::memcpy(v_cache + slot[t] * row_bytes, v_rows + t * v_stride, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(asyncengine, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> ()");
  m.def("store_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(asyncengine, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("store_kv", &store_kv);
}
