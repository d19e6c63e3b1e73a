// The engine's numeric kernels: the skinny matrix product that dominates a forward pass,
// and the dot / axpy of attention, with an AVX2+FMA path chosen at run time and a portable
// path for every other CPU.
//
// The skinny product y_j = W x_j for b <= ~16 columns is written the way CPU engines write
// it: W (rows x cols, row-major, the layout of a GGUF weight) is streamed once per block of
// rows, and each row is dotted with all b columns while it is in registers, so b columns
// cost about the memory time of one. Eigen's general product packs W on every call, which
// for a handful of columns costs more than the product itself.
//
// Batch invariance. Every output element y_j[o] is computed by the same sequence of
// floating-point operations whatever b is and wherever column j sits in the batch: one
// 8-lane accumulator chain over the row (k = 0, 8, 16, ...), a fixed lane reduction, then
// the scalar tail in order. Tiles of rows and columns only change which elements are
// computed together, never how. So a position's logits and KV entries are bit-identical
// whether it was evaluated alone, in a batch of drafts, or in a token tree, which is what
// makes greedy speculative output equal to greedy plain output token for token. dot()
// uses the same chain, so attention is invariant too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LLAMA_KERNELS_X86 1
#else
#define LLAMA_KERNELS_X86 0
#endif

namespace llama::kernels {

/// The instruction sets with a kernel path.
enum class isa { portable, avx2 };

[[nodiscard]] inline std::string_view to_string(isa path) noexcept {
  return path == isa::avx2 ? "avx2+fma" : "portable";
}

namespace detail {

// ---- portable path: the same 8-lane structure in plain C++ ------------------------------

inline float reduce_lanes(const float lanes[8]) noexcept {
  const float a = (lanes[0] + lanes[4]) + (lanes[2] + lanes[6]);
  const float b = (lanes[1] + lanes[5]) + (lanes[3] + lanes[7]);
  return a + b;
}

inline float dot_portable(const float* a, const float* b, std::size_t n) noexcept {
  float lanes[8] = {};
  const std::size_t vector_end = n & ~std::size_t{7};
  for (std::size_t k = 0; k < vector_end; k += 8) {
    for (std::size_t l = 0; l < 8; ++l) lanes[l] += a[k + l] * b[k + l];
  }
  float sum = reduce_lanes(lanes);
  for (std::size_t k = vector_end; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

inline void matmul_portable(const float* w, std::size_t rows, std::size_t cols, const float* x,
                            std::size_t x_stride, std::size_t columns, float* y,
                            std::size_t y_stride) noexcept {
  for (std::size_t o = 0; o < rows; ++o) {
    const float* row = w + o * cols;
    for (std::size_t j = 0; j < columns; ++j) {
      y[j * y_stride + o] = dot_portable(row, x + j * x_stride, cols);
    }
  }
}

inline void axpy_portable(float alpha, const float* x, float* y, std::size_t n) noexcept {
  for (std::size_t k = 0; k < n; ++k) y[k] += alpha * x[k];
}

inline void exp_shifted_portable(float* x, std::size_t n, float shift) noexcept {
  for (std::size_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

inline void silu_mul_portable(float* gate, const float* up, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0F + std::exp(-gate[i])) * up[i];
}

inline void scores_portable(const float* q, const float* keys, std::size_t stride,
                            std::size_t count, std::size_t dim, float scale,
                            float* scores) noexcept {
  for (std::size_t t = 0; t < count; ++t)
    scores[t] = dot_portable(q, keys + t * stride, dim) * scale;
}

inline void values_portable(const float* weights, const float* values, std::size_t stride,
                            std::size_t count, std::size_t dim, float* out) noexcept {
  for (std::size_t t = 0; t < count; ++t) axpy_portable(weights[t], values + t * stride, out, dim);
}

// ---- AVX2 + FMA path ------------------------------------------------------------------

#if LLAMA_KERNELS_X86
#define LLAMA_AVX2 __attribute__((target("avx2,fma")))
#ifndef LLAMA_PREFETCH
#define LLAMA_PREFETCH 2048
#endif

LLAMA_AVX2 inline float reduce_lanes_avx2(__m256 v) noexcept {
  // lanes (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1: the portable order
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  const __m128 single = _mm_add_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1));
  return _mm_cvtss_f32(single);
}

LLAMA_AVX2 inline float dot_avx2(const float* a, const float* b, std::size_t n) noexcept {
  __m256 acc = _mm256_setzero_ps();
  const std::size_t vector_end = n & ~std::size_t{7};
  for (std::size_t k = 0; k < vector_end; k += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  }
  float sum = reduce_lanes_avx2(acc);
  for (std::size_t k = vector_end; k < n; ++k) sum = std::fma(a[k], b[k], sum);
  return sum;
}

// R rows x C columns of y: R*C accumulators, each row vector loaded once per k-step and
// used for all C columns.
template <std::size_t R, std::size_t C>
LLAMA_AVX2 inline void tile_avx2(const float* w, std::size_t cols, const float* x,
                                 std::size_t x_stride, float* y, std::size_t y_stride,
                                 std::size_t prefetch) noexcept {
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (std::size_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  const std::size_t vector_end = cols & ~std::size_t{7};
  for (std::size_t k = 0; k < vector_end; k += 8) {
    __m256 row[R];
#pragma GCC unroll 8
    for (std::size_t r = 0; r < R; ++r) {
      const float* at = w + r * cols + k;
      _mm_prefetch(reinterpret_cast<const char*>(at + prefetch), _MM_HINT_T0);
      row[r] = _mm256_loadu_ps(at);
    }
#pragma GCC unroll 8
    for (std::size_t c = 0; c < C; ++c) {
      __m256 column = _mm256_loadu_ps(x + c * x_stride + k);
      // Keep the column in a register: folded into each FMA as a memory operand it would be
      // loaded R times, and the loads, not the FMAs, would bound the loop.
      if constexpr (R > 1) __asm__("" : "+x"(column));
#pragma GCC unroll 8
      for (std::size_t r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(row[r], column, acc[r][c]);
    }
  }
  for (std::size_t r = 0; r < R; ++r) {
    const float* wr = w + r * cols;
    for (std::size_t c = 0; c < C; ++c) {
      const float* xc = x + c * x_stride;
      float sum = reduce_lanes_avx2(acc[r][c]);
      for (std::size_t k = vector_end; k < cols; ++k) sum = std::fma(wr[k], xc[k], sum);
      y[c * y_stride + r] = sum;
    }
  }
}

// Rows [0, rows) of the product for C columns: tiles of R rows, then single rows.
template <std::size_t R, std::size_t C>
LLAMA_AVX2 inline void rows_avx2(const float* w, std::size_t rows, std::size_t cols, const float* x,
                                 std::size_t x_stride, float* y, std::size_t y_stride,
                                 std::size_t prefetch) noexcept {
  std::size_t o = 0;
  for (; o + R <= rows; o += R) {
    tile_avx2<R, C>(w + o * cols, cols, x, x_stride, y + o, y_stride, prefetch);
  }
  for (; o < rows; ++o) tile_avx2<1, C>(w + o * cols, cols, x, x_stride, y + o, y_stride, prefetch);
}

LLAMA_AVX2 inline void columns_avx2(std::size_t c, const float* w, std::size_t rows,
                                    std::size_t cols, const float* x, std::size_t x_stride,
                                    float* y, std::size_t y_stride, std::size_t p) noexcept {
  switch (c) {
    case 1:
      rows_avx2<8, 1>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
    case 2:
      rows_avx2<4, 2>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
    case 3:
      rows_avx2<3, 3>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
    case 4:
      rows_avx2<3, 4>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
    case 5:
      rows_avx2<2, 5>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
    case 6:
      rows_avx2<2, 6>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
    case 7:
      rows_avx2<1, 7>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
    default:
      rows_avx2<1, 8>(w, rows, cols, x, x_stride, y, y_stride, p);
      break;
  }
}

LLAMA_AVX2 inline void matmul_avx2(const float* w, std::size_t rows, std::size_t cols,
                                   const float* x, std::size_t x_stride, std::size_t columns,
                                   float* y, std::size_t y_stride) noexcept {
  if (columns == 0 || rows == 0) return;
  // Columns in groups of at most 6 (up to 12 accumulators), as even as possible (8 = 4 + 4,
  // 9 = 5 + 4). With more than one group, rows go in blocks of about 16 KiB, a multiple of
  // 6 rows (whole tiles of 2 and 3 rows), that stay in L1 while every group passes over
  // them: W comes from memory once, and the groups after the first compute on rows the
  // first one has just brought in, so that memory and arithmetic overlap finely instead of
  // alternating block by block.
  const std::size_t groups = (columns + 5) / 6;
  const std::size_t group = (columns + groups - 1) / groups;
  const std::size_t block =
      groups == 1 ? rows : std::max<std::size_t>(6, (16 * 1024) / (cols * sizeof(float)) / 6 * 6);
  for (std::size_t o = 0; o < rows; o += block) {
    const std::size_t n = std::min(block, rows - o);
    for (std::size_t j = 0, g = 1; j < columns; j += group, ++g) {
      const std::size_t c = std::min(group, columns - j);
      // Each later group prefetches further ahead still, so memory stays busy while it
      // computes on rows the first group brought in.
      columns_avx2(c, w + o * cols, n, cols, x + j * x_stride, x_stride, y + j * y_stride + o,
                   y_stride, g * LLAMA_PREFETCH);
    }
  }
}

LLAMA_AVX2 inline void axpy_avx2(float alpha, const float* x, float* y, std::size_t n) noexcept {
  const __m256 a = _mm256_set1_ps(alpha);
  const std::size_t vector_end = n & ~std::size_t{7};
  for (std::size_t k = 0; k < vector_end; k += 8) {
    _mm256_storeu_ps(y + k, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + k), _mm256_loadu_ps(y + k)));
  }
  for (std::size_t k = vector_end; k < n; ++k) y[k] = std::fma(alpha, x[k], y[k]);
}

// exp(x) as x = n ln2 + r with |r| <= ln2 / 2: exp(r) by its degree-6 Taylor polynomial
// (Horner, fused multiply-adds; relative error below 2e-7 on that interval), 2^n through the
// exponent bits. x is clamped to [-87, 88] (exp(-87) ~ 1.6e-38 stands in for smaller values,
// which only softmax tails and saturated SiLU gates see); NaN passes through. exp_lane is the
// same arithmetic for one value, so vector lanes and tails agree bit for bit.
namespace exp_constants {
inline constexpr float low = -87.0F, high = 88.0F;
inline constexpr float log2e = 1.44269504088896341F;
inline constexpr float ln2_high = 0.693145751953125F;  // exact in float: n * ln2_high is exact
inline constexpr float ln2_low = 1.428606820309417232e-06F;
inline constexpr float c6 = 1.0F / 720.0F, c5 = 1.0F / 120.0F, c4 = 1.0F / 24.0F, c3 = 1.0F / 6.0F,
                       c2 = 0.5F, c1 = 1.0F, c0 = 1.0F;
}  // namespace exp_constants

inline float exp_lane(float x) noexcept {
  namespace k = exp_constants;
  if (std::isnan(x)) return x;  // NaN stays NaN: a corrupt model's rows must fail validation
  x = std::min(std::max(x, k::low), k::high);
  const float n = std::nearbyint(x * k::log2e);
  float r = std::fma(-n, k::ln2_high, x);
  r = std::fma(-n, k::ln2_low, r);
  float p = std::fma(k::c6, r, k::c5);
  p = std::fma(p, r, k::c4);
  p = std::fma(p, r, k::c3);
  p = std::fma(p, r, k::c2);
  p = std::fma(p, r, k::c1);
  p = std::fma(p, r, k::c0);
  const auto bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23U;
  float scale = 0.0F;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

LLAMA_AVX2 inline __m256 exp_avx2(__m256 x) noexcept {
  namespace k = exp_constants;
  const __m256 input = x;
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(k::low)), _mm256_set1_ps(k::high));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(k::log2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(k::ln2_high), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(k::ln2_low), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(k::c6), r, _mm256_set1_ps(k::c5));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k::c4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k::c3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k::c2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k::c1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k::c0));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), input, nan);
}

LLAMA_AVX2 inline void exp_shifted_avx2(float* x, std::size_t n, float shift) noexcept {
  const __m256 s = _mm256_set1_ps(shift);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
  for (; i < n; ++i) x[i] = exp_lane(x[i] - shift);
}

LLAMA_AVX2 inline void silu_mul_avx2(float* gate, const float* up, std::size_t n) noexcept {
  const __m256 one = _mm256_set1_ps(1.0F);
  const __m256 zero = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_avx2(_mm256_sub_ps(zero, g));
    _mm256_storeu_ps(
        gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) gate[i] = gate[i] / (1.0F + exp_lane(-gate[i])) * up[i];
}

// Attention scores of one query against `count` keys (stride `stride` floats apart): the
// operations of dot_avx2 per key, four keys at a time so that four accumulator chains are
// in flight (one chain waits on the fused multiply-add latency at every step).
LLAMA_AVX2 inline void scores_avx2(const float* q, const float* keys, std::size_t stride,
                                   std::size_t count, std::size_t dim, float scale,
                                   float* scores) noexcept {
  constexpr std::size_t K = 4;
  const std::size_t vector_end = dim & ~std::size_t{7};
  std::size_t t = 0;
  for (; t + K <= count; t += K) {
    const float* key[K];
    __m256 acc[K];
#pragma GCC unroll 4
    for (std::size_t i = 0; i < K; ++i) {
      key[i] = keys + (t + i) * stride;
      acc[i] = _mm256_setzero_ps();
    }
    for (std::size_t k = 0; k < vector_end; k += 8) {
      const __m256 query = _mm256_loadu_ps(q + k);
#pragma GCC unroll 4
      for (std::size_t i = 0; i < K; ++i)
        acc[i] = _mm256_fmadd_ps(query, _mm256_loadu_ps(key[i] + k), acc[i]);
    }
#pragma GCC unroll 4
    for (std::size_t i = 0; i < K; ++i) {
      float sum = reduce_lanes_avx2(acc[i]);
      for (std::size_t k = vector_end; k < dim; ++k) sum = std::fma(q[k], key[i][k], sum);
      scores[t + i] = sum * scale;
    }
  }
  for (; t < count; ++t) scores[t] = dot_avx2(q, keys + t * stride, dim) * scale;
}

// out += sum_t weights[t] values_t, key after key, with up to 64 output lanes held in
// registers: the same fused multiply-adds, in the same order, as axpy_avx2 per key.
LLAMA_AVX2 inline void values_avx2(const float* weights, const float* values, std::size_t stride,
                                   std::size_t count, std::size_t dim, float* out) noexcept {
  std::size_t d = 0;
  for (; d + 64 <= dim; d += 64) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (std::size_t i = 0; i < 8; ++i) acc[i] = _mm256_loadu_ps(out + d + 8 * i);
    for (std::size_t t = 0; t < count; ++t) {
      const __m256 w = _mm256_set1_ps(weights[t]);
      const float* v = values + t * stride + d;
#pragma GCC unroll 8
      for (std::size_t i = 0; i < 8; ++i)
        acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
#pragma GCC unroll 8
    for (std::size_t i = 0; i < 8; ++i) _mm256_storeu_ps(out + d + 8 * i, acc[i]);
  }
  if (d < dim) {
    for (std::size_t t = 0; t < count; ++t)
      axpy_avx2(weights[t], values + t * stride + d, out + d, dim - d);
  }
}

#undef LLAMA_AVX2
#endif  // LLAMA_KERNELS_X86

inline bool cpu_has_avx2() noexcept {
#if LLAMA_KERNELS_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

inline isa detect() noexcept {
  // LLAMA_KERNELS=portable forces the portable path (tests cover both paths this way).
  if (const char* forced = std::getenv("LLAMA_KERNELS");
      forced != nullptr && std::strcmp(forced, "portable") == 0) {
    return isa::portable;
  }
  return cpu_has_avx2() ? isa::avx2 : isa::portable;
}

inline isa& active_path() noexcept {
  static isa path = detect();
  return path;
}

}  // namespace detail

/// The path in use: AVX2+FMA where the CPU has both, unless LLAMA_KERNELS=portable.
[[nodiscard]] inline isa active() noexcept {
  return detail::active_path();
}

/// Selects a path (tests run every path this way). Returns false, changing nothing, if the
/// CPU cannot run it. Not thread-safe: call it before any engine computes.
inline bool select(isa path) noexcept {
  if (path == isa::avx2 && !detail::cpu_has_avx2()) return false;
  detail::active_path() = path;
  return true;
}

/// y_j[o] = sum_k w[o][k] x_j[k] for o < rows, j < columns: w row-major (rows x cols),
/// column j of x at x + j * x_stride, of y at y + j * y_stride.
inline void matmul(const float* w, std::size_t rows, std::size_t cols, const float* x,
                   std::size_t x_stride, std::size_t columns, float* y,
                   std::size_t y_stride) noexcept {
#if LLAMA_KERNELS_X86
  if (active() == isa::avx2) {
    detail::matmul_avx2(w, rows, cols, x, x_stride, columns, y, y_stride);
    return;
  }
#endif
  detail::matmul_portable(w, rows, cols, x, x_stride, columns, y, y_stride);
}

/// sum_k a[k] b[k], with the same operation order as one element of matmul.
[[nodiscard]] inline float dot(const float* a, const float* b, std::size_t n) noexcept {
#if LLAMA_KERNELS_X86
  if (active() == isa::avx2) return detail::dot_avx2(a, b, n);
#endif
  return detail::dot_portable(a, b, n);
}

/// y += alpha x.
inline void axpy(float alpha, const float* x, float* y, std::size_t n) noexcept {
#if LLAMA_KERNELS_X86
  if (active() == isa::avx2) {
    detail::axpy_avx2(alpha, x, y, n);
    return;
  }
#endif
  detail::axpy_portable(alpha, x, y, n);
}

/// x[i] = exp(x[i] - shift): the numerators of a softmax.
inline void exp_shifted(float* x, std::size_t n, float shift) noexcept {
#if LLAMA_KERNELS_X86
  if (active() == isa::avx2) {
    detail::exp_shifted_avx2(x, n, shift);
    return;
  }
#endif
  detail::exp_shifted_portable(x, n, shift);
}

/// gate[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)): SwiGLU.
inline void silu_mul(float* gate, const float* up, std::size_t n) noexcept {
#if LLAMA_KERNELS_X86
  if (active() == isa::avx2) {
    detail::silu_mul_avx2(gate, up, n);
    return;
  }
#endif
  detail::silu_mul_portable(gate, up, n);
}

/// scores[t] = dot(q, key_t) * scale for the `count` keys at keys + t * stride.
inline void attention_scores(const float* q, const float* keys, std::size_t stride,
                             std::size_t count, std::size_t dim, float scale,
                             float* scores) noexcept {
#if LLAMA_KERNELS_X86
  if (active() == isa::avx2) {
    detail::scores_avx2(q, keys, stride, count, dim, scale, scores);
    return;
  }
#endif
  detail::scores_portable(q, keys, stride, count, dim, scale, scores);
}

/// out += sum_t weights[t] value_t over the `count` values at values + t * stride, in order
/// of t (the result equals `count` calls of axpy).
inline void attention_values(const float* weights, const float* values, std::size_t stride,
                             std::size_t count, std::size_t dim, float* out) noexcept {
#if LLAMA_KERNELS_X86
  if (active() == isa::avx2) {
    detail::values_avx2(weights, values, stride, count, dim, out);
    return;
  }
#endif
  detail::values_portable(weights, values, stride, count, dim, out);
}

}  // namespace llama::kernels
