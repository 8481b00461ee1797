// Decode attention over the paged KV cache in one call (engine/attention/cpu_decode.py is the Python side): each
// sequence's one new token writes its K and V into its slot, then attends to every visible key of its blocks, read in
// place through its block table (no gather), with a running softmax per query head.
//
// One layer's cache is [2, blocks, Hk, block_size, D] (K at 0, V at 1; float32 or bfloat16), head-major in a block,
// so a block's keys of one KV head are block_size x D contiguous values. Query heads h * G .. h * G + G - 1 share KV
// head h (G = Hq / Hk). The loops over D are written for the compiler to vectorize (OpenMP simd), compiled once per
// instruction set (paths.h: AVX-512, AVX2, the baseline), the caller naming the path as for the integer-dot
// products, so one build serves every x86-64 CPU. The (sequence, KV head) pairs are split over torch's intra-op
// threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "paths.h"

namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// e^x for x <= 0 (a score less the running maximum), to about 2e-7 relative: x = n ln2 + r, e^r by its series to
// r^6 (|r| <= ln2 / 2), 2^n through the exponent bits. Plain arithmetic, so a loop of it vectorizes (std::exp does
// not).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f +
                                                                                              r * 0.0013888889f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Attention of G query heads (q: G x dim floats) over positions [first, length) of one KV head of one sequence.
// kDim: the head size as a constant (0: dim at run time), so that the loops over it unroll into registers.
template <typename KV, int kDim>
TANDEM_INLINE void attend_head(const float* q, int64_t groups, int64_t dim_at_run_time, const KV* keys,
                               const KV* values, int64_t block_stride, const int64_t* table, int64_t first,
                               int64_t length, int64_t block_size, float scale, float* scores, float* out,
                               float* row) {
  const int64_t dim = kDim ? kDim : dim_at_run_time;
  float running_max[64], total[64];  // per query head of the group (the caller checks groups <= 64)
  for (int64_t g = 0; g < groups; ++g) {
    running_max[g] = -std::numeric_limits<float>::infinity();
    total[g] = 0.f;
  }
  std::fill(out, out + groups * dim, 0.f);
  for (int64_t start = first - first % block_size; start < length; start += block_size) {
    const int64_t block = table[start / block_size];
    const KV* k = keys + block * block_stride;
    const KV* v = values + block * block_stride;
    const int64_t t0 = std::max(first, start) - start, t1 = std::min(length, start + block_size) - start;
    for (int64_t t = t0; t < t1; ++t) {  // the block's keys as floats, once for every query head of the group
      const KV* kt = k + t * dim;
      float* rt = row + t * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) rt[d] = to_float(kt[d]);
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = q + g * dim;
      float* sg = scores + g * block_size;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = t0; t < t1; ++t) {
        const float* rt = row + t * dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * rt[d];
        sg[t] = dot * scale;
        block_max = std::max(block_max, sg[t]);
      }
      const float new_max = std::max(running_max[g], block_max);
      const float rescale = exp_nonpositive(running_max[g] - new_max);  // 0 for the first block (max was -inf)
      running_max[g] = new_max;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = t0; t < t1; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        sum += sg[t];
      }
      total[g] = total[g] * rescale + sum;
      float* og = out + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) og[d] *= rescale;
    }
    for (int64_t t = t0; t < t1; ++t) {  // the block's values as floats
      const KV* vt = v + t * dim;
      float* rt = row + t * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) rt[d] = to_float(vt[d]);
    }
    for (int64_t g = 0; g < groups; ++g) {  // each head's weighted values, its accumulator in registers
      const float* pg = scores + g * block_size;
      float* og = out + g * dim;
      float acc[kDim ? kDim : 1];
      if constexpr (kDim != 0) {
#pragma omp simd
        for (int64_t d = 0; d < kDim; ++d) acc[d] = og[d];
        for (int64_t t = t0; t < t1; ++t) {
          const float p = pg[t];
          const float* rt = row + t * dim;
#pragma omp simd
          for (int64_t d = 0; d < kDim; ++d) acc[d] += p * rt[d];
        }
#pragma omp simd
        for (int64_t d = 0; d < kDim; ++d) og[d] = acc[d];
      } else {
        for (int64_t t = t0; t < t1; ++t) {
          const float p = pg[t];
          const float* rt = row + t * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) og[d] += p * rt[d];
        }
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float inverse = total[g] > 0.f ? 1.f / total[g] : 0.f;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] *= inverse;
  }
}

// attend_head for the head sizes that unroll (64, 128) and any other, compiled once per instruction set.
#define TANDEM_ATTEND_ANY(NAME, TARGET)                                                                          \
  template <typename KV>                                                                                         \
  TARGET void NAME(const float* q, int64_t groups, int64_t dim, const KV* keys, const KV* values,                 \
                   int64_t block_stride, const int64_t* table, int64_t first, int64_t length, int64_t block_size, \
                   float scale, float* scores, float* out, float* row) {                                         \
    if (dim == 64) {                                                                                             \
      attend_head<KV, 64>(q, groups, dim, keys, values, block_stride, table, first, length, block_size, scale,   \
                          scores, out, row);                                                                     \
    } else if (dim == 128) {                                                                                     \
      attend_head<KV, 128>(q, groups, dim, keys, values, block_stride, table, first, length, block_size, scale,  \
                           scores, out, row);                                                                    \
    } else {                                                                                                     \
      attend_head<KV, 0>(q, groups, dim, keys, values, block_stride, table, first, length, block_size, scale,    \
                         scores, out, row);                                                                      \
    }                                                                                                            \
  }

TANDEM_ATTEND_ANY(attend_plain, )
#if TANDEM_X86
TANDEM_ATTEND_ANY(attend_avx2, TANDEM_TARGET_AVX2)
TANDEM_ATTEND_ANY(attend_avx512, TANDEM_TARGET_AVX512)
#endif

template <typename KV>
void attend_any(Path path, const float* q, int64_t groups, int64_t dim, const KV* keys, const KV* values,
                int64_t block_stride, const int64_t* table, int64_t first, int64_t length, int64_t block_size,
                float scale, float* scores, float* out, float* row) {
#if TANDEM_X86
  if (path == kAvx512Vnni) {
    return attend_avx512(q, groups, dim, keys, values, block_stride, table, first, length, block_size, scale,
                         scores, out, row);
  }
  if (path == kAvx2) {
    return attend_avx2(q, groups, dim, keys, values, block_stride, table, first, length, block_size, scale, scores,
                       out, row);
  }
#endif
  attend_plain(q, groups, dim, keys, values, block_stride, table, first, length, block_size, scale, scores, out,
               row);
}

template <typename KV, typename Q>
void decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv, const at::Tensor& slots,
            const at::Tensor& tables, const at::Tensor& lengths, double scale, int64_t window, Path path,
            at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv.size(2), block_size = kv.size(3), num_blocks = kv.size(1);
  const int64_t groups = heads / kv_heads;
  KV* cache = kv.data_ptr<KV>();
  const int64_t plane = num_blocks * kv_heads * block_size * dim;  // K's values, then V's
  const int64_t block_stride = kv_heads * block_size * dim;
  const Q* qp = q.data_ptr<Q>();
  const Q* kp = k.data_ptr<Q>();
  const Q* vp = v.data_ptr<Q>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t table_width = tables.size(1);
  for (int64_t b = 0; b < batch; ++b) {  // the new token's K and V into its slot, before any read
    const int64_t block = slot[b] / block_size, offset = slot[b] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      KV* kd = cache + block * block_stride + (h * block_size + offset) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        kd[d] = static_cast<KV>(to_float(kp[(b * kv_heads + h) * dim + d]));
        kd[plane + d] = static_cast<KV>(to_float(vp[(b * kv_heads + h) * dim + d]));
      }
    }
  }
  Q* op = out.data_ptr<Q>();
  const int64_t work = batch * kv_heads;
  const int64_t context = std::accumulate(length, length + batch, int64_t{0});
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> query(groups * dim), scores(groups * block_size), result(groups * dim), row(block_size * dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      for (int64_t j = 0; j < groups * dim; ++j) query[j] = to_float(qp[(b * heads + h * groups) * dim + j]);
      const int64_t first = window > 0 ? std::max<int64_t>(0, length[b] - window) : 0;
      attend_any(path, query.data(), groups, dim, cache + h * block_size * dim, cache + plane + h * block_size * dim,
                 block_stride, table + b * table_width, first, length[b], block_size, static_cast<float>(scale),
                 scores.data(), result.data(), row.data());
      for (int64_t j = 0; j < groups * dim; ++j) op[(b * heads + h * groups) * dim + j] = static_cast<Q>(result[j]);
    }
  };
  // A few thousand keys take microseconds: below that, waking the other threads costs more than they save.
  if (context * kv_heads < 8192 || at::get_num_threads() == 1) {
    run(0, work);
  } else {
    at::parallel_for(0, work, 1, run);
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv,
                        const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lengths, double scale,
                        int64_t window, int64_t path) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "paged_decode: q, k, v must be [B, heads, D]");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous(),
              "paged_decode: kv must be one layer's contiguous cache [2, blocks, Hk, block_size, D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "paged_decode: q, k, v contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "paged_decode: q, k and v must share a dtype");
  TORCH_CHECK(q.size(2) == kv.size(4) && k.size(1) == kv.size(2) && q.size(1) % kv.size(2) == 0,
              "paged_decode: q [B, Hq, D], k [B, Hk, D] and kv [2, blocks, Hk, block_size, D] disagree");
  TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && tables.is_contiguous() && slots.is_contiguous() &&
                  lengths.is_contiguous(),
              "paged_decode: slots, block tables and lengths must be contiguous int64 tensors");
  TORCH_CHECK(q.size(1) / kv.size(2) <= 64, "paged_decode: at most 64 query heads per KV head");
  TORCH_CHECK(slots.size(0) == q.size(0) && tables.size(0) == q.size(0) && lengths.size(0) == q.size(0),
              "paged_decode: one slot, block table row and length per sequence");
  const Path chosen = resolve(path);
  at::Tensor out = at::empty_like(q);
  const auto cache = kv.scalar_type(), dtype = q.scalar_type();
  if (cache == at::kFloat && dtype == at::kFloat) {
    decode<float, float>(q, k, v, kv, slots, tables, lengths, scale, window, chosen, out);
  } else if (cache == at::kBFloat16 && dtype == at::kBFloat16) {
    decode<at::BFloat16, at::BFloat16>(q, k, v, kv, slots, tables, lengths, scale, window, chosen, out);
  } else if (cache == at::kBFloat16 && dtype == at::kFloat) {
    decode<at::BFloat16, float>(q, k, v, kv, slots, tables, lengths, scale, window, chosen, out);
  } else {
    TORCH_CHECK(false, "paged_decode: a ", cache, " cache with ", dtype, " queries is not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) kv, Tensor slots, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, int path) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
