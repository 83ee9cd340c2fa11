// Paged prefill attention on the CPU: the new tokens of each prefill (or chunked-prefill)
// sequence attend causally over its cached K/V, read in place through its block table.
//
// One work item is a sequence, a KV head and a run of its query rows (as many as the threads
// allow). It copies the K/V rows those queries can see to float32 once (K transposed, so 16
// keys are one vector), then, for each query head of the KV head and 16 rows at a time,
// computes the scores as a small matrix product (each K vector serves 16 rows while it is in a
// register; 16 accumulators and the vector fill half of AVX-512's registers, 24 rows spill
// and ran slower), takes an exact softmax per row and sums V the same way (each V vector
// serves 16 rows). Nothing is computed for keys past a row's position or before its window.
// Float32 throughout, whatever the cache dtype, but for a bfloat16 cache on a CPU with
// AVX512-BF16 (bf16_item: bf16 products summed in float32); the output is rounded once.
//
// torch's flash kernel runs at ~80 GF/s on this shape (2 threads, bf16, 256 tokens, 12 heads
// of 64), this op at ~210 in float32 and ~290 in bf16 pairs; see
// `benchmarks/cpu_kernels.py --only prefill`.
//
// Built on first use by asyncengine/worker/cpu_ops.py; torch.ops.asyncengine.paged_prefill_attention.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

using asyncengine_cpu::exp_in_place;
using asyncengine_cpu::from_float;
using asyncengine_cpu::load_row;
using asyncengine_cpu::to_float;

constexpr int64_t kRows = 16;  // query rows computed together
constexpr int64_t kKeys = 16;  // keys per score vector

struct Item {
  int64_t seq, kv_head, row0, row1;  // rows: of the sequence's new tokens
};

// s[r * stride + j] for j in [j0, j1) (a multiple of kKeys apart) = q[r] . kt[:, j], r < kRows.
// kt: [dim][stride] (keys transposed), q: [kRows][dim].
inline void scores(const float* __restrict q, const float* __restrict kt, int64_t dim,
                   int64_t stride, int64_t j0, int64_t j1, float* __restrict s) {
#if defined(__AVX512F__)
  for (int64_t j = j0; j < j1; j += kKeys) {
    __m512 acc[kRows];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 k = _mm512_loadu_ps(kt + d * stride + j);
      for (int64_t r = 0; r < kRows; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * dim + d]), k, acc[r]);
    }
    for (int64_t r = 0; r < kRows; ++r) _mm512_storeu_ps(s + r * stride + j, acc[r]);
  }
#else
  for (int64_t r = 0; r < kRows; ++r) {
    float* sr = s + r * stride;
    for (int64_t j = j0; j < j1; ++j) sr[j] = 0.f;
    for (int64_t d = 0; d < dim; ++d) {
      const float qd = q[r * dim + d];
      const float* k = kt + d * stride;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) sr[j] += qd * k[j];
    }
  }
#endif
}

// acc[r * dim + e] = sum over j in [j0, j1) of p[r * stride + j] * v[j * dim + e], r < kRows.
inline void weighted_values(const float* __restrict p, const float* __restrict v, int64_t dim,
                            int64_t stride, int64_t j0, int64_t j1, float* __restrict acc) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t e = 0; e < dim; e += 16) {
      __m512 a[kRows];
      for (auto& x : a) x = _mm512_setzero_ps();
      for (int64_t j = j0; j < j1; ++j) {
        const __m512 vj = _mm512_loadu_ps(v + j * dim + e);
        for (int64_t r = 0; r < kRows; ++r)
          a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * stride + j]), vj, a[r]);
      }
      for (int64_t r = 0; r < kRows; ++r) _mm512_storeu_ps(acc + r * dim + e, a[r]);
    }
    return;
  }
#endif
  std::fill(acc, acc + kRows * dim, 0.f);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * dim;
    for (int64_t r = 0; r < kRows; ++r) {
      const float w = p[r * stride + j];
      float* ar = acc + r * dim;
#pragma omp simd
      for (int64_t e = 0; e < dim; ++e) ar[e] += w * vj[e];
    }
  }
}

// Each row r < kRows of s (`stride` apart): exp(score - max) over the keys it sees, 0 elsewhere
// in [j0, j1), and 1 / the sum of its exps in inv_sum[r]; rows from `rows` on are all 0. Row r
// is at position `first_pos + r` relative to k_lo, which the window (if any) counts from.
inline void softmax_rows(float* s, int64_t stride, int64_t rows, int64_t first_pos,
                         int64_t window, int64_t k_lo, int64_t j0, int64_t j1, float* inv_sum) {
  for (int64_t r = 0; r < kRows; ++r) {
    float* sr = s + r * stride;
    if (r >= rows) {  // no such row: nothing to weigh
      std::fill(sr + j0, sr + j1, 0.f);
      inv_sum[r] = 0.f;
      continue;
    }
    const int64_t pos = first_pos + r;
    const int64_t a = window > 0 ? std::max<int64_t>(-k_lo, pos - window + 1) : -k_lo;
    const int64_t b = pos + 1;  // row r sees [a, b)
    inv_sum[r] = exp_in_place(sr, a, b);
    std::fill(sr + j0, sr + a, 0.f);
    std::fill(sr + b, sr + j1, 0.f);
  }
}

#if defined(__AVX512BF16__)
// One item of a bfloat16 cache, in bf16 arithmetic: vdpbf16ps multiplies pairs of bf16 and sums
// them in float32, half the instructions of the float32 path's QK^T and PV for the same steps.
// K is kept as its rows' element pairs, transposed (kt[p * stride + j]: elements 2p and 2p + 1
// of key j), so 16 keys' next pair are one vector; V as pairs of keys (v[jp * dim + e]: element e
// of keys 2jp and 2jp + 1); each row's softmax weights are rounded to bf16 before PV, as
// transformers' eager attention rounds them. Scores and the softmax stay float32.
struct Bf16Item {
  const c10::BFloat16* q;    // the sequence's first new row, head 0
  const c10::BFloat16* k;    // the cache's K, at the item's KV head
  const c10::BFloat16* v;    // the cache's V, at the item's KV head
  c10::BFloat16* out;        // the sequence's first output row, head 0
  const int32_t* table;
  int64_t num_heads, dim, group, kv_head, block_size, token_stride, block_stride;
  int64_t context, row0, row1, k_lo, k_hi, stride, window;
  float scale;
};

struct Bf16Scratch {
  std::vector<uint32_t> kt, v, q;
  std::vector<uint16_t> p;
};

void bf16_item(const Bf16Item& it, Bf16Scratch& scratch, float* s) {
  const int64_t dim = it.dim, pairs = dim / 2, stride = it.stride;
  scratch.kt.assign(pairs * stride, 0u);
  scratch.v.assign(stride / 2 * dim, 0u);  // keys past the item's: zero weights on zeros
  scratch.q.resize(kRows * pairs);
  scratch.p.resize(kRows * stride);
  uint16_t* v_halves = reinterpret_cast<uint16_t*>(scratch.v.data());
  for (int64_t t = it.k_lo; t < it.k_hi; ++t) {
    const int64_t offset = it.table[t / it.block_size] * it.block_stride +
                           (t % it.block_size) * it.token_stride;
    const auto* k_pairs = reinterpret_cast<const uint32_t*>(it.k + offset);
    const auto* v_row = reinterpret_cast<const uint16_t*>(it.v + offset);
    const int64_t j = t - it.k_lo;
    for (int64_t p = 0; p < pairs; ++p) scratch.kt[p * stride + j] = k_pairs[p];
    uint16_t* v_pair = v_halves + (j / 2) * dim * 2 + j % 2;
    for (int64_t e = 0; e < dim; ++e) v_pair[2 * e] = v_row[e];
  }
  const __m512 scale = _mm512_set1_ps(it.scale);
  for (int64_t h = it.kv_head * it.group; h < (it.kv_head + 1) * it.group; ++h) {
    for (int64_t r0 = it.row0; r0 < it.row1; r0 += kRows) {
      const int64_t rows = std::min(kRows, it.row1 - r0);
      std::fill(scratch.q.begin(), scratch.q.end(), 0u);
      for (int64_t r = 0; r < rows; ++r) {
        const auto* q_pairs =
            reinterpret_cast<const uint32_t*>(it.q + ((r0 + r) * it.num_heads + h) * dim);
        std::copy(q_pairs, q_pairs + pairs, scratch.q.data() + r * pairs);
      }
      // keys seen by any of these rows, relative to k_lo; j0 rounded down to a vector
      const int64_t lo =
          (it.window > 0 ? std::max<int64_t>(0, it.context + r0 - it.window + 1) : 0) - it.k_lo;
      const int64_t hi = it.context + r0 + rows - it.k_lo;
      const int64_t j0 = lo / kKeys * kKeys, j1 = (hi + kKeys - 1) / kKeys * kKeys;
      for (int64_t j = j0; j < j1; j += kKeys) {
        __m512 acc[kRows];
        for (auto& a : acc) a = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
          const __m512bh k = (__m512bh)_mm512_loadu_si512(scratch.kt.data() + p * stride + j);
          for (int64_t r = 0; r < kRows; ++r) {
            const __m512bh q = (__m512bh)_mm512_set1_epi32(scratch.q[r * pairs + p]);
            acc[r] = _mm512_dpbf16_ps(acc[r], q, k);
          }
        }
        for (int64_t r = 0; r < kRows; ++r)
          _mm512_storeu_ps(s + r * stride + j, _mm512_mul_ps(acc[r], scale));
      }
      float inv_sum[kRows];
      softmax_rows(s, stride, rows, it.context + r0 - it.k_lo, it.window, it.k_lo, j0, j1, inv_sum);
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t j = j0; j < j1; j += kKeys) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(scratch.p.data() + r * stride + j),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + r * stride + j)));
        }
      }
      const auto* p_pairs = reinterpret_cast<const uint32_t*>(scratch.p.data());
      for (int64_t e = 0; e < dim; e += 16) {
        __m512 acc[kRows];
        for (auto& a : acc) a = _mm512_setzero_ps();
        for (int64_t jp = j0 / 2; jp < j1 / 2; ++jp) {
          const __m512bh v = (__m512bh)_mm512_loadu_si512(scratch.v.data() + jp * dim + e);
          for (int64_t r = 0; r < kRows; ++r) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32(p_pairs[r * (stride / 2) + jp]);
            acc[r] = _mm512_dpbf16_ps(acc[r], p, v);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          c10::BFloat16* o = it.out + ((r0 + r) * it.num_heads + h) * dim + e;
          const __m512 normed = _mm512_mul_ps(acc[r], _mm512_set1_ps(inv_sum[r]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(normed));
        }
      }
    }
  }
}
#endif  // __AVX512BF16__

// out, query: [num_tokens, num_heads, head_dim], the prefill sequences' new tokens in order
// kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V), holding them too
// block_tables: [num_seqs, max_blocks]; query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs]
template <typename T>
void prefill_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                    const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                    const at::Tensor& seq_lens, double scale, int64_t window) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * dim, block_stride = block_size * token_stride;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const T* q_base = query.data_ptr<T>();
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + num_blocks * block_stride;
  T* o_base = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  int64_t work = 0, max_new = 0;  // multiply-adds, roughly: enough to pay for waking threads?
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_new = starts[s + 1] - starts[s];
    TORCH_CHECK(num_new >= 0 && num_new <= lens[s], "sequence ", s, ": ", num_new,
                " new tokens but seq_len ", lens[s]);
    work += num_new * lens[s] * num_heads * dim;
    max_new = std::max(max_new, num_new);
  }
  const int num_threads = work < (1 << 20) ? 1 : at::get_num_threads();
  // K/V are copied once per item: items as long as the threads allow (at least 4 per thread,
  // a multiple of kRows rows, at least 2 * kRows)
  const int64_t splits = (4 * num_threads + num_seqs * num_kv_heads - 1) / (num_seqs * num_kv_heads);
  int64_t item_rows = (max_new + splits - 1) / splits;
  item_rows = std::max<int64_t>(2 * kRows, (item_rows + kRows - 1) / kRows * kRows);
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t g = 0; g < num_kv_heads; ++g)
      for (int64_t r = 0; r < starts[s + 1] - starts[s]; r += item_rows)
        items.push_back({s, g, r, std::min<int64_t>(starts[s + 1] - starts[s], r + item_rows)});

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> kt, v, s, q(kRows * dim), acc(kRows * dim), tile(kKeys * dim);
#if defined(__AVX512BF16__)
    Bf16Scratch bf16_scratch;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      const Item item = items[i];
      const int64_t len = lens[item.seq];
      const int64_t context = len - (starts[item.seq + 1] - starts[item.seq]);
      const int32_t* table = tables + item.seq * max_blocks;
      // the keys the item's rows see: [k_lo, k_hi), absolute positions
      const int64_t first_pos = context + item.row0, last_pos = context + item.row1 - 1;
      const int64_t k_lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const int64_t k_hi = last_pos + 1;
      const int64_t nk = k_hi - k_lo, stride = (nk + kKeys - 1) / kKeys * kKeys;
      s.resize(kRows * stride);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (dim % 16 == 0) {
          const int64_t offset = item.kv_head * dim;
          const Bf16Item bf16{q_base + starts[item.seq] * num_heads * dim, k_base + offset,
                              v_base + offset, o_base + starts[item.seq] * num_heads * dim,
                              table, num_heads, dim, group, item.kv_head, block_size,
                              token_stride, block_stride, context, item.row0, item.row1, k_lo,
                              k_hi, stride, window, fscale};
          bf16_item(bf16, bf16_scratch, s.data());
          continue;
        }
      }
#endif
      kt.assign(dim * stride, 0.f);
      v.assign(stride * dim, 0.f);
      // kKeys rows at a time: K's into a row-major tile, then its columns out as kt's rows
      // (one contiguous store each; a store per element, kt's rows apart, cost more than the
      // scores they feed)
      for (int64_t t0 = k_lo; t0 < k_hi; t0 += kKeys) {
        const int64_t n = std::min(kKeys, k_hi - t0);
        for (int64_t t = t0; t < t0 + n; ++t) {
          const int64_t offset = table[t / block_size] * block_stride +
                                 (t % block_size) * token_stride + item.kv_head * dim;
          load_row(k_base + offset, tile.data() + (t - t0) * dim, dim);
          load_row(v_base + offset, v.data() + (t - k_lo) * dim, dim);
        }
        std::fill(tile.begin() + n * dim, tile.end(), 0.f);
        for (int64_t d = 0; d < dim; ++d) {
          float* column = kt.data() + d * stride + (t0 - k_lo);
#pragma omp simd
          for (int64_t t = 0; t < kKeys; ++t) column[t] = tile[t * dim + d];
        }
      }
      for (int64_t h = item.kv_head * group; h < (item.kv_head + 1) * group; ++h) {
        for (int64_t r0 = item.row0; r0 < item.row1; r0 += kRows) {
          const int64_t rows = std::min(kRows, item.row1 - r0);
          std::fill(q.begin(), q.end(), 0.f);
          for (int64_t r = 0; r < rows; ++r) {
            const T* qr = q_base + ((starts[item.seq] + r0 + r) * num_heads + h) * dim;
            for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = to_float(qr[d]) * fscale;
          }
          // keys seen by any of these rows, relative to k_lo; j0 rounded down to a vector
          const int64_t lo = (window > 0 ? std::max<int64_t>(0, context + r0 - window + 1) : 0) - k_lo;
          const int64_t hi = context + r0 + rows - k_lo;
          const int64_t j0 = lo / kKeys * kKeys, j1 = (hi + kKeys - 1) / kKeys * kKeys;
          scores(q.data(), kt.data(), dim, stride, j0, j1, s.data());
          float inv_sum[kRows];
          softmax_rows(s.data(), stride, rows, context + r0 - k_lo, window, k_lo, j0, j1, inv_sum);
          weighted_values(s.data(), v.data(), dim, stride, j0, std::min(j1, nk), acc.data());
          for (int64_t r = 0; r < rows; ++r) {
            T* o = o_base + ((starts[item.seq] + r0 + r) * num_heads + h) * dim;
            for (int64_t d = 0; d < dim; ++d) o[d] = from_float<T>(acc[r * dim + d] * inv_sum[r]);
          }
        }
      }
    }
  }
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [tokens, heads, dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache: [2, blocks, bs, kvh, dim]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of KV heads");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "block_tables: [seqs, max_blocks], seq_lens: [seqs]");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1,
              "query_start_loc: [seqs + 1]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "all inputs must be contiguous");
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0),
              "query_start_loc must run from 0 to the number of query rows");
  switch (query.scalar_type()) {
    case at::kFloat:
      return prefill_kernel<float>(out, query, kv_cache, block_tables, query_start_loc, seq_lens,
                                   scale, window);
    case at::kBFloat16:
      return prefill_kernel<c10::BFloat16>(out, query, kv_cache, block_tables, query_start_loc,
                                           seq_lens, scale, window);
    case at::kHalf:
      return prefill_kernel<c10::Half>(out, query, kv_cache, block_tables, query_start_loc,
                                       seq_lens, scale, window);
    default:
      TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(asyncengine, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(asyncengine, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
