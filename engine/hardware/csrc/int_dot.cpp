// Integer-dot products over GGUF-style blocks (engine/hardware/int_dot.py is the Python side, and packs the blocks).
//
// y = x @ w.T for x [M, K] (float32 or bfloat16) and w [N, K] held in blocks of 32 weights a row, 8 rows interleaved
// (a group), in the bytes per weight of GGUF's types:
//   Q4_1: a block of 8 rows is fp16 d x 8, fp16 m x 8, then 128 bytes of 4-bit codes c (w = d * c + m): four 32-byte
//         vectors whose low nibbles hold weights 4p..4p+3 of each row in turn and whose high nibbles hold weights
//         4p+16..4p+19, so one 32-bit lane is one row's four codes.
//   Q8_0: fp16 d x 8, then eight 32-byte vectors of int8 codes (w = d * c), vector c holding weights 4c..4c+3 of
//         each row in turn.
// Each row of x is quantized per block of 32 to int8 as llama.cpp's Q8 (dx = max|x| / 127, q = round(x / dx)), so a
// block adds dw * dx * sum(c * q) (+ m * dx * sum(q) for Q4_1) to its row, the sum an integer dot product in which the
// four activations of a lane are broadcast against eight rows at once: AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw),
// or plain C++. The groups are split over torch's intra-op threads. Every path computes the same integers; only the
// float sums' order differs between them.
//
// Built at install (setup.py) into tandem.engine.hardware._cpu_kernels (module.cpp); importing that module registers
// the ops tandem_cpu::q4_1_linear, tandem_cpu::q8_0_linear and tandem_cpu::supported_paths. Each ISA's functions carry
// their own target attribute, so the library loads on any x86-64 CPU and a path runs only where the CPU has it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "paths.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRows = 8;                      // weight rows interleaved in one group
constexpr int64_t kQ4Group = 16 + 16 + 128;   // a block of 8 rows: fp16 d x8, fp16 m x8, 128 bytes of nibbles
constexpr int64_t kQ8Group = 16 + 256;        // fp16 d x8, 256 int8 codes
constexpr int kMaxRows = 4;                   // activation rows that share one pass over a weight group


float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        exponent--;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// x's rows quantized per block: codes [M, K] (int8, or int16 for the wide products), dx [M, nb] scale, sx [M, nb]
// = dx * sum(codes of the block). The wide products' int16 codes c are also split for the SIMD paths into int8
// halves, c = 256 * hi + lo (hi in q, lo in lo), so that they run the int8 products twice: sum(w * c) =
// 256 * sum(w * hi) + sum(w * lo), the same integer. The buffers are the calling thread's, reused from call to call.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<int8_t> lo;
  std::vector<int16_t> q16;
  std::vector<float> dx;
  std::vector<float> sx;
};

// The wide products' codes: within +-kWideMax, so that hi = (c + 128) >> 8 stays within int8 (|hi| <= 127) and
// lo = c - 256 * hi within [-128, 127].
constexpr int kWideMax = 127 * 256 + 127;

inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) { return static_cast<float>(v); }

// One block of 32 values quantized to codes within +-kMax (127 for int8, kWideMax for int16): its codes into q, returns
// its scale; *sum gets the codes' sum. Inlined into each path's quantize_rows, so that its loops vectorize for that
// path's instruction set.
template <typename T, typename Code, int kMax>
TANDEM_INLINE float quantize_block(const T* src, Code* q, int* sum) {
  float values[kBlock];
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int i = 0; i < kBlock; ++i) {
    values[i] = as_float(src[i]);
    amax = std::max(amax, std::fabs(values[i]));
  }
  const float d = amax / static_cast<float>(kMax);
  const float id = d > 0.f ? 1.f / d : 0.f;
  int total = 0;
#pragma omp simd reduction(+ : total)
  for (int i = 0; i < kBlock; ++i) {
    const float v = std::min(static_cast<float>(kMax), std::max(-static_cast<float>(kMax),
                                                                std::nearbyint(values[i] * id)));
    q[i] = static_cast<Code>(v);
    total += static_cast<int>(v);
  }
  *sum = total;
  return d;
}

#define TANDEM_QUANTIZE_ROWS(NAME, TARGET)                                                                     \
  template <typename T, typename Code, int kMax>                                                               \
  TARGET void NAME(const T* x, int64_t m, int64_t k, Code* q, float* dx, float* sx) {                          \
    const int64_t nb = k / kBlock;                                                                             \
    for (int64_t r = 0; r < m; ++r) {                                                                          \
      for (int64_t b = 0; b < nb; ++b) {                                                                       \
        int sum;                                                                                               \
        const float d = quantize_block<T, Code, kMax>(x + r * k + b * kBlock, q + r * k + b * kBlock, &sum);   \
        dx[r * nb + b] = d;                                                                                    \
        sx[r * nb + b] = d * static_cast<float>(sum);                                                          \
      }                                                                                                        \
    }                                                                                                          \
  }

TANDEM_QUANTIZE_ROWS(quantize_plain, )
#if TANDEM_X86
TANDEM_QUANTIZE_ROWS(quantize_avx2, TANDEM_TARGET_AVX2)
TANDEM_QUANTIZE_ROWS(quantize_avx512, TANDEM_TARGET_AVX512)
#endif

template <typename T, typename Code, int kMax>
void quantize_into(Path path, const T* x, int64_t m, int64_t k, Code* q, Quantized& out) {
#if TANDEM_X86
  if (path == kAvx512Vnni) return quantize_avx512<T, Code, kMax>(x, m, k, q, out.dx.data(), out.sx.data());
  if (path == kAvx2) return quantize_avx2<T, Code, kMax>(x, m, k, q, out.dx.data(), out.sx.data());
#endif
  quantize_plain<T, Code, kMax>(x, m, k, q, out.dx.data(), out.sx.data());
}

// Each int16 code c as 256 * hi + lo, hi and lo int8 (Quantized).
void split_codes(const int16_t* c, int64_t n, int8_t* hi, int8_t* lo) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const int h = (c[i] + 128) >> 8;
    hi[i] = static_cast<int8_t>(h);
    lo[i] = static_cast<int8_t>(c[i] - 256 * h);
  }
}

// wide: int16 codes (for the Q4_1 products with wide activations; on the SIMD paths split in two int8 halves), else
// int8.
template <typename T>
void quantize_rows(Path path, const T* x, int64_t m, int64_t k, bool wide, Quantized& out) {
  const int64_t nb = k / kBlock;
  out.dx.resize(m * nb);
  out.sx.resize(m * nb);
  if (wide) {
    out.q16.resize(m * k);
    quantize_into<T, int16_t, kWideMax>(path, x, m, k, out.q16.data(), out);
    if (path != kScalar) {
      out.q.resize(m * k);
      out.lo.resize(m * k);
      split_codes(out.q16.data(), m * k, out.q.data(), out.lo.data());
    }
  } else {
    out.q.resize(m * k);
    quantize_into<T, int8_t, 127>(path, x, m, k, out.q.data(), out);
  }
}

// One group of 8 weight rows against `rows` activation rows (rows <= kMaxRows): out[j * 8 + r] for activation row j
// and weight row r of the group.
struct GroupArgs {
  const uint8_t* w;  // the group's blocks
  int64_t nb;        // blocks a row
  const int8_t* q;   // the first activation row's codes (int8 products; the wide products' high halves)
  const int8_t* lo;  // the wide products' low halves (SIMD paths)
  const int16_t* q16;  // the first activation row's codes (wide products, scalar path)
  const float* dx;
  const float* sx;
  int64_t k;  // activation row stride (codes)
  int rows;
};

// Q4_1 x8 block: code of row r, weight i (0..31) sits in byte 32 + 32 * (c % 4) + 4 * r + i % 4 where c = i / 4,
// the low nibble for c < 4 and the high nibble for c >= 4. Code: the activations' codes, int8 (a.q) or int16
// (a.q16, the wide products: activations kept to 1 / kWideMax of each block's largest).
template <typename Code>
void q4_1_group_scalar(const GroupArgs& a, float* out) {
  const Code* codes = std::is_same_v<Code, int8_t> ? reinterpret_cast<const Code*>(a.q)
                                                   : reinterpret_cast<const Code*>(a.q16);
  for (int j = 0; j < a.rows; ++j) {
    for (int r = 0; r < kRows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* blk = a.w + b * kQ4Group;
        const float d = half_to_float(load_u16(blk + 2 * r)), m = half_to_float(load_u16(blk + 16 + 2 * r));
        const Code* q = codes + j * a.k + b * kBlock;
        int64_t dot = 0;
        for (int i = 0; i < kBlock; ++i) {
          const int c = i / 4;
          const uint8_t byte = blk[32 + 32 * (c % 4) + 4 * r + i % 4];
          dot += (c < 4 ? byte & 0x0f : byte >> 4) * q[i];
        }
        acc += d * a.dx[j * a.nb + b] * static_cast<float>(dot) + m * a.sx[j * a.nb + b];
      }
      out[j * kRows + r] = acc;
    }
  }
}

// Q8_0 x8 block: code of row r, weight i sits in byte 16 + 32 * (i / 4) + 4 * r + i % 4.
void q8_0_group_scalar(const GroupArgs& a, float* out) {
  for (int j = 0; j < a.rows; ++j) {
    for (int r = 0; r < kRows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* blk = a.w + b * kQ8Group;
        const float d = half_to_float(load_u16(blk + 2 * r));
        const int8_t* codes = reinterpret_cast<const int8_t*>(blk + 16);
        const int8_t* q = a.q + j * a.k + b * kBlock;
        int dot = 0;
        for (int i = 0; i < kBlock; ++i) dot += codes[32 * (i / 4) + 4 * r + i % 4] * q[i];
        acc += d * a.dx[j * a.nb + b] * static_cast<float>(dot);
      }
      out[j * kRows + r] = acc;
    }
  }
}

#if TANDEM_X86

#define TANDEM_AVX2 TANDEM_TARGET_AVX2
#define TANDEM_VNNI TANDEM_TARGET_AVX512

// The 8 code vectors of a Q4_1 x8 block: v[c] holds weights 4c..4c+3 of each of the 8 rows (one 32-bit lane a row).
#define TANDEM_Q4_CODES(blk, v)                                                            \
  for (int p = 0; p < 4; ++p) {                                                            \
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * p)); \
    v[p] = _mm256_and_si256(packed, low);                                                  \
    v[p + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);                       \
  }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One block's dot products of eight rows' codes v (unsigned, <= 15) with one row's int8 activations q: int32 x 8.
TANDEM_AVX2 inline __m256i q4_dot_avx2(const __m256i* v, const int8_t* q) {
  // pairs of code (<= 15) x activation (|q| <= 127): eight sums of two stay within int16
  __m256i pairs = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(load_i32(q)));
  for (int c = 1; c < 8; ++c) {
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[c], _mm256_set1_epi32(load_i32(q + 4 * c))));
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

TANDEM_VNNI inline __m256i q4_dot_vnni(const __m256i* v, const int8_t* q) {
  __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();  // two chains, half the latency
  for (int c = 0; c < 8; c += 2) {
    even = _mm256_dpbusd_epi32(even, v[c], _mm256_set1_epi32(load_i32(q + 4 * c)));
    odd = _mm256_dpbusd_epi32(odd, v[c + 1], _mm256_set1_epi32(load_i32(q + 4 * c + 4)));
  }
  return _mm256_add_epi32(even, odd);
}

// Q4_1's group kernel on one path: DOT is q4_dot_avx2 or q4_dot_vnni; WIDE: the activations' codes are int16 split
// in halves (Quantized), each half's products computed as the int8 ones and the high half's shifted by 8 bits.
#define TANDEM_Q4_1_GROUP(NAME, TARGET, DOT, WIDE)                                                            \
  template <int R>                                                                                            \
  TARGET void NAME(const GroupArgs& a, float* out) {                                                          \
    __m256 acc[R], offsets[R];                                                                                \
    for (int j = 0; j < R; ++j) acc[j] = offsets[j] = _mm256_setzero_ps();                                    \
    const __m256i low = _mm256_set1_epi8(0x0f);                                                               \
    for (int64_t b = 0; b < a.nb; ++b) {                                                                      \
      const uint8_t* blk = a.w + b * kQ4Group;                                                                \
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));               \
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));          \
      __m256i v[8];                                                                                           \
      TANDEM_Q4_CODES(blk, v)                                                                                 \
      for (int j = 0; j < R; ++j) {                                                                           \
        const int64_t at = j * a.k + b * kBlock;                                                              \
        __m256i sums = DOT(v, a.q + at);                                                                      \
        if (WIDE) sums = _mm256_add_epi32(_mm256_slli_epi32(sums, 8), DOT(v, a.lo + at));                     \
        const __m256 dot = _mm256_cvtepi32_ps(sums);                                                          \
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.dx[j * a.nb + b])), dot, acc[j]);         \
        offsets[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sx[j * a.nb + b]), offsets[j]);                     \
      }                                                                                                       \
    }                                                                                                         \
    for (int j = 0; j < R; ++j) _mm256_storeu_ps(out + j * kRows, _mm256_add_ps(acc[j], offsets[j]));         \
  }

TANDEM_Q4_1_GROUP(q4_1_group_avx2, TANDEM_AVX2, q4_dot_avx2, false)
TANDEM_Q4_1_GROUP(q4_1_group_vnni, TANDEM_VNNI, q4_dot_vnni, false)
TANDEM_Q4_1_GROUP(q4_1_x16_group_avx2, TANDEM_AVX2, q4_dot_avx2, true)
TANDEM_Q4_1_GROUP(q4_1_x16_group_vnni, TANDEM_VNNI, q4_dot_vnni, true)

// Q8_0's codes are signed: |w| (unsigned) times q with w's sign, so that one operand is unsigned.
TANDEM_AVX2 inline __m256i q8_dot_avx2(const __m256i* w_abs, const __m256i* w, const int8_t* q) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {  // a pair of 127 x 127 products fills int16: widen each step
    const __m256i pairs =
        _mm256_maddubs_epi16(w_abs[c], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(q + 4 * c)), w[c]));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
  }
  return sum;
}

TANDEM_VNNI inline __m256i q8_dot_vnni(const __m256i* w_abs, const __m256i* w, const int8_t* q) {
  __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
  for (int c = 0; c < 8; c += 2) {
    even = _mm256_dpbusd_epi32(even, w_abs[c], _mm256_sign_epi8(_mm256_set1_epi32(load_i32(q + 4 * c)), w[c]));
    odd = _mm256_dpbusd_epi32(odd, w_abs[c + 1],
                              _mm256_sign_epi8(_mm256_set1_epi32(load_i32(q + 4 * c + 4)), w[c + 1]));
  }
  return _mm256_add_epi32(even, odd);
}

// Q8_0's group kernel on one path: ABS makes |w|, DOT is q8_dot_avx2 or q8_dot_vnni.
#define TANDEM_Q8_0_GROUP(NAME, TARGET, ABS, DOT)                                                              \
  template <int R>                                                                                            \
  TARGET void NAME(const GroupArgs& a, float* out) {                                                          \
    __m256 acc[R];                                                                                            \
    for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();                                                 \
    for (int64_t b = 0; b < a.nb; ++b) {                                                                      \
      const uint8_t* blk = a.w + b * kQ8Group;                                                                \
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));               \
      __m256i w[8], w_abs[8];                                                                                 \
      for (int c = 0; c < 8; ++c) {                                                                           \
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));                       \
        w_abs[c] = ABS(w[c]);                                                                                 \
      }                                                                                                       \
      for (int j = 0; j < R; ++j) {                                                                           \
        const __m256 dot = _mm256_cvtepi32_ps(DOT(w_abs, w, a.q + j * a.k + b * kBlock));                     \
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.dx[j * a.nb + b])), dot, acc[j]);         \
      }                                                                                                       \
    }                                                                                                         \
    for (int j = 0; j < R; ++j) _mm256_storeu_ps(out + j * kRows, acc[j]);                                    \
  }

#define TANDEM_ABS_AVX2(w) _mm256_sign_epi8(w, w)
TANDEM_Q8_0_GROUP(q8_0_group_avx2, TANDEM_AVX2, TANDEM_ABS_AVX2, q8_dot_avx2)
TANDEM_Q8_0_GROUP(q8_0_group_vnni, TANDEM_VNNI, _mm256_abs_epi8, q8_dot_vnni)

#endif

using GroupFn = void (*)(const GroupArgs&, float*);

enum Kind { kQ4_1 = 0, kQ4_1Wide = 1, kQ8_0 = 2 };  // Q4_1 with int8 or int16 activations, Q8_0

// The group kernel of `kind` on `path` for `rows` activation rows (1..kMaxRows).
GroupFn group_kernel(Kind kind, Path path, int rows) {
#if TANDEM_X86
  if (path == kAvx512Vnni) {
    static const GroupFn vnni[3][4] = {
        {q4_1_group_vnni<1>, q4_1_group_vnni<2>, q4_1_group_vnni<3>, q4_1_group_vnni<4>},
        {q4_1_x16_group_vnni<1>, q4_1_x16_group_vnni<2>, q4_1_x16_group_vnni<3>, q4_1_x16_group_vnni<4>},
        {q8_0_group_vnni<1>, q8_0_group_vnni<2>, q8_0_group_vnni<3>, q8_0_group_vnni<4>}};
    return vnni[kind][rows - 1];
  }
  if (path == kAvx2) {
    static const GroupFn avx2[3][4] = {
        {q4_1_group_avx2<1>, q4_1_group_avx2<2>, q4_1_group_avx2<3>, q4_1_group_avx2<4>},
        {q4_1_x16_group_avx2<1>, q4_1_x16_group_avx2<2>, q4_1_x16_group_avx2<3>, q4_1_x16_group_avx2<4>},
        {q8_0_group_avx2<1>, q8_0_group_avx2<2>, q8_0_group_avx2<3>, q8_0_group_avx2<4>}};
    return avx2[kind][rows - 1];
  }
#endif
  static const GroupFn plain[3] = {q4_1_group_scalar<int8_t>, q4_1_group_scalar<int16_t>, q8_0_group_scalar};
  return plain[kind];
}

// Below this many group blocks (8 rows x 32 weights each) a product runs on the calling thread: waking the
// others costs more than they would save.
constexpr int64_t kParallelGroupBlocks = 512;

template <typename Out>
void store(Out* y, int64_t n, int64_t row0, int64_t rows_here, const float* acc, int64_t stride) {
  for (int64_t r = 0; r < rows_here; ++r) y[row0 + r] = static_cast<Out>(acc[r * stride]);
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t n, int64_t path, Kind kind) {
  const int64_t group_bytes = kind == kQ8_0 ? kQ8Group : kQ4Group;
  TORCH_CHECK(x.dim() == 2, "int_dot: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int_dot: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "int_dot: blocks must be a contiguous uint8 [groups of 8 rows, blocks * bytes] tensor");
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "int_dot: CPU tensors only");
  const int64_t m = x.size(0), k = x.size(1), groups = blocks.size(0);
  TORCH_CHECK(k % kBlock == 0, "int_dot: K must be a multiple of 32, got ", k);
  const int64_t nb = k / kBlock;
  TORCH_CHECK(blocks.size(1) == nb * group_bytes, "int_dot: a group of 8 rows of ", k, " weights takes ",
              nb * group_bytes, " bytes, got ", blocks.size(1));
  TORCH_CHECK(n > (groups - 1) * kRows && n <= groups * kRows, "int_dot: ", groups, " groups of 8 rows cannot hold ",
              n, " rows");
  const Path chosen = resolve(path);
  const at::Tensor xc = x.contiguous();
  thread_local Quantized quantized;
  if (xc.scalar_type() == at::kFloat) {
    quantize_rows(chosen, xc.data_ptr<float>(), m, k, kind == kQ4_1Wide, quantized);
  } else {
    quantize_rows(chosen, xc.data_ptr<at::BFloat16>(), m, k, kind == kQ4_1Wide, quantized);
  }
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  void* y = out.data_ptr();
  const Quantized& qz = quantized;
  auto run = [&](int64_t begin, int64_t end) {
    float acc[kMaxRows * kRows];
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      const GroupFn fn = group_kernel(kind, chosen, rows);
      const bool wide = kind == kQ4_1Wide;
      const bool halves = wide && chosen != kScalar;
      GroupArgs args{nullptr, nb, wide && !halves ? nullptr : qz.q.data() + r0 * k,
                     halves ? qz.lo.data() + r0 * k : nullptr, wide ? qz.q16.data() + r0 * k : nullptr,
                     qz.dx.data() + r0 * nb, qz.sx.data() + r0 * nb, k, rows};
      for (int64_t g = begin; g < end; ++g) {
        args.w = w + g * nb * group_bytes;
        fn(args, acc);
        const int64_t row0 = g * kRows, rows_here = std::min<int64_t>(kRows, n - row0);
        for (int j = 0; j < rows; ++j) {
          if (bf16) {
            store(static_cast<at::BFloat16*>(y) + (r0 + j) * n, n, row0, rows_here, acc + j * kRows, 1);
          } else {
            store(static_cast<float*>(y) + (r0 + j) * n, n, row0, rows_here, acc + j * kRows, 1);
          }
        }
      }
    }
  };
  if (groups * nb * m < kParallelGroupBlocks || at::get_num_threads() == 1) {
    run(0, groups);
  } else {
    const int64_t threads = at::get_num_threads();
    at::parallel_for(0, groups, (groups + threads - 1) / threads, run);
  }
  return out;
}

// Blocks held by handle (register_blocks): what a compiled graph calls with an int instead of a tensor, so that the
// graph has no weight among its inputs (no guard on them, nothing lifted) and calls C++ with nothing in between.
std::mutex& registry_lock() {
  static std::mutex lock;
  return lock;
}

std::vector<at::Tensor>& registry() {
  static std::vector<at::Tensor> held;
  return held;
}

int64_t register_blocks(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && blocks.is_cpu(),
              "int_dot: blocks must be a contiguous uint8 [groups of 8 rows, blocks * bytes] CPU tensor");
  std::lock_guard<std::mutex> guard(registry_lock());
  auto& held = registry();
  for (size_t i = 0; i < held.size(); ++i) {
    if (!held[i].defined()) {
      held[i] = blocks;
      return static_cast<int64_t>(i);
    }
  }
  held.push_back(blocks);
  return static_cast<int64_t>(held.size() - 1);
}

void release_blocks(int64_t handle) {
  std::lock_guard<std::mutex> guard(registry_lock());
  auto& held = registry();
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(held.size()) && held[handle].defined(),
              "int_dot: no blocks are held under handle ", handle);
  held[handle] = at::Tensor();
}

at::Tensor held_blocks(int64_t handle) {
  std::lock_guard<std::mutex> guard(registry_lock());
  auto& held = registry();
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(held.size()) && held[handle].defined(),
              "int_dot: no blocks are held under handle ", handle);
  return held[handle];
}

// kind: 0 Q4_1, 1 Q4_1 with int16 activations, 2 Q8_0 (Kind).
at::Tensor block_project(const at::Tensor& x, int64_t handle, int64_t n, int64_t path, int64_t kind) {
  TORCH_CHECK(kind >= kQ4_1 && kind <= kQ8_0, "int_dot: unknown kind ", kind);
  return block_linear(x, held_blocks(handle), n, path, static_cast<Kind>(kind));
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t n, int64_t path) {
  return block_linear(x, blocks, n, path, kQ4_1);
}

at::Tensor q4_1_linear_wide(const at::Tensor& x, const at::Tensor& blocks, int64_t n, int64_t path) {
  return block_linear(x, blocks, n, path, kQ4_1Wide);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t n, int64_t path) {
  return block_linear(x, blocks, n, path, kQ8_0);
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks, int n, int path) -> Tensor");
  m.def("q4_1_linear_wide(Tensor x, Tensor blocks, int n, int path) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor blocks, int n, int path) -> Tensor");
  m.def("supported_paths() -> int", &supported_paths);
  m.def("register_blocks(Tensor blocks) -> int", &register_blocks);
  m.def("release_blocks(int handle) -> ()", &release_blocks);
  m.def("block_project(Tensor x, int handle, int n, int path, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q4_1_linear_wide", &q4_1_linear_wide);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("block_project", &block_project);
}
