// Paged decode attention on the CPU: one new token per sequence, attending over its cached K/V
// read in place through its block table. Each block is read once (K for all the query heads of
// a KV head, then V), and nothing is computed for slots outside the sequence or its window.
// Scores, softmax and the weighted sum of V run in float32 whatever the cache dtype.
//
// Built on first use by asyncengine/worker/cpu_ops.py; torch.ops.asyncengine.paged_decode_attention.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace {

using asyncengine_cpu::fast_exp;
using asyncengine_cpu::from_float;
using asyncengine_cpu::to_float;

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;  // reassociated into a vector sum (built with -fassociative-math)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

// out, query: [num_seqs, num_heads, head_dim]
// kv_cache:   [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32
//
// One work item is a sequence and a run of its KV heads (all of them when there are enough
// sequences to keep every thread busy): a block's slots are then read front to back, and the
// next block is prefetched while this one is computed, since the blocks lie anywhere.
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

      // one pass over K (which == 0) or V (which == 1), block by block
      auto for_each_slot = [&](const T* base, auto&& body) {
        for (int64_t b = first_block; b < end_block; ++b) {
          if (b + 1 < end_block) {
            const T* next = base + table[b + 1] * block_stride + kv_head0 * head_dim;
            for (int64_t t = 0; t < block_size; ++t)
              for (int64_t e = 0; e < item_len; e += kLine)
                __builtin_prefetch(next + t * token_stride + e);
          }
          const int64_t t0 = std::max(start, b * block_size);
          const int64_t t1 = std::min(len, (b + 1) * block_size);
          const T* block = base + table[b] * block_stride + kv_head0 * head_dim;
          for (int64_t t = t0; t < t1; ++t) {
            load_row(block + (t - b * block_size) * token_stride, row.data(), item_len);
            body(t - start);
          }
        }
      };
      for_each_slot(k_base, [&](int64_t i) {
        for (int64_t h = 0; h < heads_per_item; ++h)
          scores[h * n + i] = dot(q.data() + h * head_dim, row.data() + (h / group) * head_dim,
                                  head_dim);
      });
      for (int64_t h = 0; h < heads_per_item; ++h) {
        float* s = scores.data() + h * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
        for (int64_t i = 0; i < n; ++i) s[i] = fast_exp(s[i] - m);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) sum += s[i];
        inv_sum[h] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_slot(v_base, [&](int64_t i) {
        for (int64_t h = 0; h < heads_per_item; ++h) {
          const float p = scores[h * n + i];
          const float* v = row.data() + (h / group) * head_dim;
          float* a = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
        }
      });
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

}  // namespace

TORCH_LIBRARY(asyncengine, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(asyncengine, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
