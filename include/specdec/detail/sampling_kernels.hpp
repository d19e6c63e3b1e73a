// specdec — private kernels behind standardization (sampling.hpp): sums in double with
// independent accumulators, argmax, and the order "more probable first, lower id first"
// that top-k and top-p use.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "specdec/detail/row_kernels.hpp"
#include "specdec/detail/vector_math.hpp"
#include "specdec/kernel_path.hpp"

#if SPECDEC_DISPATCH_AVX2 || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace specdec::detail {

SPECDEC_KERNELS_BEGIN

/// Independent accumulators of the sampling kernels (no -ffast-math needed to vectorize).
inline constexpr std::size_t sampling_lanes = 16;
/// Entries summed in T before the partial sum is widened to double.
inline constexpr std::size_t sampling_block = 256;

/// Pairwise sum of the lanes in a fixed order (pairwise_sum16: halves added, then quarters,
/// then (l[0] + l[2]) + (l[1] + l[3])).
template <class T>
[[nodiscard]] inline T reduce_sampling_lanes(const std::array<T, sampling_lanes>& lanes) noexcept {
  static_assert(sampling_lanes == 16);
  return pairwise_sum16(lanes.data());
}

/// Sum of `size` entries: blocks of `sampling_block` entries are summed in T with
/// `sampling_lanes` independent accumulators (each lane adds 16 terms, so a block sum is
/// accurate to about 20 ulp of T), and the block sums are added in double. Vectorizes
/// without -ffast-math; identical results under every compiler.
template <class T>
[[nodiscard]] inline double sum_in_double(const T* row, std::size_t size) noexcept {
  double total = 0.0;
  std::size_t i = 0;
  for (; i + sampling_block <= size; i += sampling_block) {
    std::array<T, sampling_lanes> lanes{};
    for (std::size_t j = i; j < i + sampling_block; j += sampling_lanes) {
      for (std::size_t k = 0; k < sampling_lanes; ++k) lanes[k] += row[j + k];
    }
    total += static_cast<double>(reduce_sampling_lanes(lanes));
  }
  for (; i < size; ++i) total += static_cast<double>(row[i]);
  return total;
}

/// Validation fused into a pass that reads a row anyway, in pieces that add no horizontal
/// reduction per block (each block only updates lanes; lanes are combined once, at the end):
///  - sign_screen: whether every entry seen is >= 0 (false for NaN and negative entries;
///    -0.0 passes, as the full validator accepts it);
///  - lane_sum: the sum of the entries seen, in T lanes within a block, widened into double
///    lanes after each block (as accurate as sum_in_double: at most 16 terms per T lane).
/// A row is plausible when the screen passed and the sum is finite and within the
/// tolerance of 1 (NaN and infinite entries make the sum NaN or infinite); anything else
/// goes to the full validator, which names the problem (or accepts the row).
template <class T>
struct sign_screen {
  using mask = std::conditional_t<sizeof(T) == 8, std::int64_t, std::int32_t>;
  std::array<mask, sampling_lanes> good;

  sign_screen() noexcept { good.fill(mask{-1}); }

  SPECDEC_KERNEL_INLINE void add(const T* row, std::size_t count) noexcept {
    const std::size_t full = count / sampling_lanes * sampling_lanes;
    for (std::size_t j = 0; j < full; j += sampling_lanes) {
      for (std::size_t k = 0; k < sampling_lanes; ++k) {
        good[k] &= row[j + k] >= T(0) ? mask{-1} : mask{0};
      }
    }
    for (std::size_t j = full; j < count; ++j) {
      good[j - full] &= row[j] >= T(0) ? mask{-1} : mask{0};
    }
  }

  [[nodiscard]] bool passed() const noexcept {
    mask all = mask{-1};
    for (const mask value : good) all &= value;
    return all != 0;
  }
};

template <class T>
struct lane_sum {
  std::array<double, sampling_lanes> lanes{};

  SPECDEC_KERNEL_INLINE void add(const T* row, std::size_t count) noexcept {
    std::array<T, sampling_lanes> block{};
    const std::size_t full = count / sampling_lanes * sampling_lanes;
    for (std::size_t j = 0; j < full; j += sampling_lanes) {
      for (std::size_t k = 0; k < sampling_lanes; ++k) block[k] += row[j + k];
    }
    for (std::size_t j = full; j < count; ++j) block[j - full] += row[j];
    for (std::size_t k = 0; k < sampling_lanes; ++k) lanes[k] += static_cast<double>(block[k]);
  }

  [[nodiscard]] double value() const noexcept { return reduce_sampling_lanes(lanes); }
};

/// The largest relative error of a sum of non-negative T entries as the screens and the
/// mass tables compute it: at most 16 roundings of T per lane (16 terms per lane, or 8
/// terms and a 4-level tree), then double. 16 u_T: 9.5e-7 for float, 1.8e-15 for double.
template <class T>
inline constexpr double screen_sum_error = 8.0 * std::numeric_limits<T>::epsilon();

/// Whether a row whose entries passed (or failed) a sign_screen and whose T entries sum to
/// `total` as computed is plausible (see sign_screen): within the tolerance even if the
/// computed sum is off by its error bound, with a margin for the validator's own order.
/// A row nearer the edge goes to the full validator, which decides exactly.
template <class T>
[[nodiscard]] inline bool plausible_total(bool screen_passed, double total,
                                          double tolerance) noexcept {
  const double deviation = total > 1.0 ? total - 1.0 : 1.0 - total;  // NaN stays NaN
  return screen_passed && deviation + screen_sum_error<T> * total <= tolerance * (1.0 - 1e-6);
}

/// A sign_screen and a lane_sum together: the screen of a row no other sum covers.
template <class T>
struct row_screen {
  sign_screen<T> signs;
  lane_sum<T> sum;

  SPECDEC_KERNEL_INLINE void add(const T* row, std::size_t count) noexcept {
    signs.add(row, count);
    sum.add(row, count);
  }
  [[nodiscard]] double total() const noexcept { return sum.value(); }
  [[nodiscard]] bool plausible(double tolerance) const noexcept {
    return plausible_total<T>(signs.passed(), total(), tolerance);
  }
};

/// A build_mass_table hook that screens the blocks of `row` as the pass reads them (the
/// decoder's in-place target rows). A named type rather than a lambda so that the passes
/// it is fused into are compiled once per scalar type, not once per calling function.
template <class T>
struct row_screen_hook {
  row_screen<T>* screen;
  const T* row;

  SPECDEC_KERNEL_INLINE void operator()(std::size_t first, std::size_t count) const noexcept {
    screen->add(row + first, count);
  }
};

/// row_screen_hook over a nucleus_view (a top-p target row read in place): screens each
/// block's standardized entries, bitwise the screen of the written row (the decoder takes
/// the row's sum from it for beta).
template <class T>
struct nucleus_screen_hook {
  row_screen<T>* screen;
  nucleus_view<T> p;

  SPECDEC_KERNEL_INLINE void operator()(std::size_t first, std::size_t count) const noexcept {
    std::array<T, kernel_block> entries;
    for (std::size_t j = 0; j < count; ++j) entries[j] = p.at(first + j);
    screen->add(entries.data(), count);
  }
};

/// Largest entry of a non-empty row, NaN entries passed over (greedy's dispatched scan,
/// span_max). A row of only NaN and -infinity entries with at least one NaN gives NaN, so
/// that a NaN row is reported as such.
template <class T>
[[nodiscard]] inline T max_entry(const T* row, std::size_t size) noexcept {
  bool unused = true;
  const T result = span_max<false>(row, size, unused);
  if (result == -std::numeric_limits<T>::infinity()) {
    for (std::size_t j = 0; j < size; ++j) {
      if (row[j] != row[j]) return row[j];
    }
  }
  return result;
}

/// Entries per block of block_maxima (Standardizer::apply_sparse's top-k selection).
inline constexpr std::size_t select_block = 64;

#if SPECDEC_VECTOR_MATH_PACKS
/// The largest lane of a pack without NaN lanes: halves folded onto each other.
template <std::size_t Bytes, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE T fold_max(const pack_t<T, Bytes>& value) noexcept {
  if constexpr (Bytes == 2 * sizeof(T)) {
    return value[0] < value[1] ? value[1] : value[0];
  } else {
    using half = pack_t<T, Bytes / 2>;
    half low;
    half high;
    std::memcpy(&low, &value, sizeof low);
    std::memcpy(&high, reinterpret_cast<const unsigned char*>(&value) + sizeof low, sizeof high);
    const half larger = low < high ? high : low;
    return fold_max<Bytes / 2, T>(larger);
  }
}
#endif

/// The largest of the select_block entries at `first`, NaN entries passed over (-infinity
/// when there is none): running maxima in packs of `Bytes`, then their lanes folded.
template <std::size_t Bytes, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE T block_max_of(const T* first) noexcept {
#if SPECDEC_VECTOR_MATH_PACKS
  using pack = pack_t<T, Bytes>;
  constexpr std::size_t width = Bytes / sizeof(T);
  static_assert(width >= 2 && select_block % width == 0);
  pack best = pack{} - std::numeric_limits<T>::infinity();
  for (std::size_t j = 0; j < select_block; j += width) {
    pack value;
    std::memcpy(&value, first + j, sizeof value);
    best = best < value ? value : best;  // a NaN compares false
  }
  return fold_max<Bytes, T>(best);
#else
  T best = -std::numeric_limits<T>::infinity();
  for (std::size_t j = 0; j < select_block; ++j) best = best < first[j] ? first[j] : best;
  return best;
#endif
}

/// block_max[b] = the largest key of block b (select_block entries; the last block may be
/// shorter), NaN keys passed over (-infinity for a block without another key); returns the
/// largest key of the row (-infinity when there is none). With `Screen`, `screen` takes
/// every entry, 4 blocks at a time (its lanes widen to double once per call), then single
/// blocks, then the tail: one order of additions on every path.
template <std::size_t Bytes, bool Screen, class T>
SPECDEC_KERNEL_INLINE T block_maxima_body(const T* key, std::size_t size, double* block_max,
                                          row_screen<T>* screen) noexcept {
  constexpr std::size_t group = 4;
  const std::size_t full = size / select_block;
  T best = -std::numeric_limits<T>::infinity();
  std::size_t b = 0;
  if constexpr (Screen) {
    for (; b + group <= full; b += group) {
      const T* first = key + b * select_block;
      for (std::size_t g = 0; g < group; ++g) {
        const T block = block_max_of<Bytes>(first + g * select_block);
        block_max[b + g] = static_cast<double>(block);
        best = best < block ? block : best;
      }
      screen->add(first, group * select_block);
    }
  }
  for (; b < full; ++b) {
    const T* first = key + b * select_block;
    const T block = block_max_of<Bytes>(first);
    block_max[b] = static_cast<double>(block);
    best = best < block ? block : best;
    if constexpr (Screen) screen->add(first, select_block);
  }
  const std::size_t rest = size - full * select_block;
  if (rest != 0) {
    const T* first = key + full * select_block;
    T block = -std::numeric_limits<T>::infinity();
    for (std::size_t j = 0; j < rest; ++j) block = block < first[j] ? first[j] : block;
    block_max[full] = static_cast<double>(block);
    best = best < block ? block : best;
    if constexpr (Screen) screen->add(first, rest);
  }
  return best;
}

#if SPECDEC_DISPATCH_AVX2
template <bool Screen, class T>
SPECDEC_TARGET_AVX2 T block_maxima_avx2(const T* key, std::size_t size, double* block_max,
                                        row_screen<T>* screen) noexcept {
  return block_maxima_body<32, Screen>(key, size, block_max, screen);
}
#endif
#if SPECDEC_DISPATCH_AVX512
template <bool Screen, class T>
SPECDEC_TARGET_AVX512 T block_maxima_avx512(const T* key, std::size_t size, double* block_max,
                                            row_screen<T>* screen) noexcept {
  return block_maxima_body<64, Screen>(key, size, block_max, screen);
}
#endif

template <bool Screen, class T>
SPECDEC_PORTABLE_KERNEL inline T block_maxima_portable(const T* key, std::size_t size,
                                                       double* block_max,
                                                       row_screen<T>* screen) noexcept {
  return block_maxima_body<16, Screen>(key, size, block_max, screen);
}

/// block_maxima_body on the active kernel path (the same maxima and, with a screen, the
/// same screened sums on every path).
template <bool Screen, class T>
T block_maxima(const T* key, std::size_t size, double* block_max, row_screen<T>* screen) noexcept {
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) return block_maxima_avx512<Screen>(key, size, block_max, screen);
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2()) return block_maxima_avx2<Screen>(key, size, block_max, screen);
#endif
  return block_maxima_portable<Screen>(key, size, block_max, screen);
}

/// block_maxima with a screen when `screen` is not null (validation), without otherwise.
template <class T>
inline T block_maxima(const T* key, std::size_t size, double* block_max,
                      row_screen<T>* screen) noexcept {
  return screen != nullptr ? block_maxima<true>(key, size, block_max, screen)
                           : block_maxima<false>(key, size, block_max, screen);
}

/// Index of the largest entry of a non-empty row, the lowest index among ties.
template <class T>
[[nodiscard]] inline std::size_t first_argmax(const T* row, std::size_t size) noexcept {
  const T best = max_entry(row, size);
  for (std::size_t j = 0; j < size; ++j) {
    if (row[j] == best) return j;
  }
  return 0;
}

/// The binary exponent and the 4 leading mantissa bits of a positive float or double as
/// one integer, monotone in the value: equal codes lie within a factor 2^(1/16).
template <class T>
[[nodiscard]] inline std::int64_t magnitude_code(T value) noexcept {
  if constexpr (sizeof(T) == sizeof(std::uint64_t)) {
    return static_cast<std::int64_t>(std::bit_cast<std::uint64_t>(value) >> 48U);
  } else {
    return static_cast<std::int64_t>(std::bit_cast<std::uint32_t>(value) >> 19U);
  }
}

// ---------------------------------------------------------------------------------------
// Top-p over a full row (Standardizer::keep_nucleus): a histogram pass (which also writes
// each entry's bucket, 2 bytes per entry), a collection pass over those buckets and a pass
// writing the kept weights normalised, each vectorized over chunks of nucleus_chunk entries
// and dispatched to AVX2 (kernel_path.hpp). Bucket b holds
// the weights whose magnitude_code is b below the top weight's (width 2^(1/16)); the last
// bucket also takes everything smaller, bucket nucleus_buckets the entries with no weight
// (zero, negative or NaN).
// ---------------------------------------------------------------------------------------

inline constexpr std::size_t nucleus_buckets = 1024;
/// Buckets per histogram: nucleus_buckets and the one for entries with no weight.
inline constexpr std::size_t nucleus_histogram_size = nucleus_buckets + 1;
inline constexpr std::size_t nucleus_chunk = 64;

/// The bucket of a positive value below the top code: its magnitude code's distance from
/// top_code, larger values in bucket 0, the smallest in the last (branch-free: vectorizes).
template <class T>
SPECDEC_KERNEL_INLINE std::int32_t clamped_bucket(T value, std::int32_t top_code) noexcept {
  using word = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
  constexpr unsigned shift = sizeof(T) == 8 ? 48U : 19U;  // magnitude_code's
  std::int32_t offset = top_code - static_cast<std::int32_t>(std::bit_cast<word>(value) >> shift);
  offset = offset < 0 ? 0 : offset;
  return offset > std::int32_t{nucleus_buckets - 1} ? std::int32_t{nucleus_buckets - 1} : offset;
}

/// bucket[k] = the bucket of weights[k], k < nucleus_chunk (branch-free: vectorizes).
template <class T>
SPECDEC_KERNEL_INLINE void nucleus_chunk_buckets(const T* weights, std::int32_t top_code,
                                                 std::int32_t* bucket) noexcept {
  for (std::size_t k = 0; k < nucleus_chunk; ++k) {
    const T weight = weights[k];
    const std::int32_t offset = clamped_bucket(weight, top_code);
    bucket[k] = weight > T(0) ? offset : std::int32_t{nucleus_buckets};
  }
}

template <class T>
SPECDEC_KERNEL_INLINE std::int32_t nucleus_bucket(T weight, std::int32_t top_code) noexcept {
  return weight > T(0) ? clamped_bucket(weight, top_code) : std::int32_t{nucleus_buckets};
}

/// Adds every weight into its bucket of two histograms (`mass`: 2 nucleus_histogram_size
/// zeroed doubles), even entries into the first, odd ones into the second (two independent
/// chains of additions; the caller adds the two), and writes each entry's bucket to
/// `codes` (one per entry), which the collection pass reads instead of the weights.
template <class T>
SPECDEC_KERNEL_INLINE void nucleus_histogram_body(const T* weights, std::size_t size,
                                                  std::int32_t top_code, double* mass,
                                                  std::uint16_t* codes) noexcept {
  double* const odd = mass + nucleus_histogram_size;
  std::array<std::int32_t, nucleus_chunk> bucket;
  std::size_t j = 0;
  for (; j + nucleus_chunk <= size; j += nucleus_chunk) {
    nucleus_chunk_buckets(weights + j, top_code, bucket.data());
    for (std::size_t k = 0; k < nucleus_chunk; ++k) {
      codes[j + k] = static_cast<std::uint16_t>(bucket[k]);
    }
    for (std::size_t k = 0; k < nucleus_chunk; k += 2) {
      // Entries without weight land in the discarded last bucket, whatever they hold.
      mass[bucket[k]] += static_cast<double>(weights[j + k]);
      odd[bucket[k + 1]] += static_cast<double>(weights[j + k + 1]);
    }
  }
  for (; j < size; ++j) {
    const std::int32_t b = nucleus_bucket(weights[j], top_code);
    codes[j] = static_cast<std::uint16_t>(b);
    mass[b] += static_cast<double>(weights[j]);
  }
}

/// Appends the ids of the entries whose code (nucleus_histogram) is `wanted`, in order.
SPECDEC_KERNEL_INLINE void nucleus_collect_body(const std::uint16_t* codes, std::size_t size,
                                                std::uint16_t wanted,
                                                std::vector<std::uint32_t>& ids) {
  std::size_t j = 0;
  for (; j + nucleus_chunk <= size; j += nucleus_chunk) {
    std::uint32_t found = 0;
    for (std::size_t k = 0; k < nucleus_chunk; ++k) found |= codes[j + k] == wanted ? 1U : 0U;
    if (found == 0) continue;
    for (std::size_t k = 0; k < nucleus_chunk; ++k) {
      if (codes[j + k] == wanted) ids.push_back(static_cast<std::uint32_t>(j + k));
    }
  }
  for (; j < size; ++j) {
    if (codes[j] == wanted) ids.push_back(static_cast<std::uint32_t>(j));
  }
}

/// out[j] = kept ? weights[j] * scale : 0 over [first, last), kept = key >= bound (Inclusive)
/// or key > bound: one comparison and a select per entry, in packs of `Bytes` when the keys
/// and weights have one type (`weights` may be `out`: each pack is loaded before it is
/// stored).
template <std::size_t Bytes, bool Inclusive, class U, class T>
SPECDEC_KERNEL_INLINE void nucleus_keep_range(const U* key, const T* weights, T* out,
                                              std::size_t first, std::size_t last, U bound,
                                              T scale) noexcept {
  std::size_t j = first;
#if SPECDEC_VECTOR_MATH_PACKS
  if constexpr (std::is_same_v<U, T>) {
    using pack = pack_t<T, Bytes>;
    constexpr std::size_t width = Bytes / sizeof(T);
    const auto keep_pack = [&](std::size_t at) SPECDEC_LAMBDA_INLINE {
      pack k;
      pack w;
      std::memcpy(&k, key + at, sizeof k);
      std::memcpy(&w, weights + at, sizeof w);
      w *= scale;
      if constexpr (Inclusive) {
        w = k >= bound ? w : pack{};
      } else {
        w = k > bound ? w : pack{};
      }
      std::memcpy(out + at, &w, sizeof w);
    };
    // A cache line of entries at a time, asking for the keys and the output ahead (the
    // weights are the keys or the output on the library's paths).
    constexpr std::size_t line = cache_line / sizeof(T);
    static_assert(line % width == 0);
    for (; j + line <= last; j += line) {
      prefetch_ahead(key, j);
      prefetch_ahead<true>(out, j);
      for (std::size_t h = 0; h < line; h += width) keep_pack(j + h);
    }
    for (; j + width <= last; j += width) keep_pack(j);
  }
#endif
  for (; j < last; ++j) {
    const U value = key[j];
    const bool kept = Inclusive ? value >= bound : value > bound;
    const T scaled = weights[j] * scale;
    out[j] = kept ? scaled : T(0);
  }
}

/// out[j] = weights[j] * scale for the tokens ranked up to `last` (a key above last_key, or
/// equal to it at an id <= last): the nucleus, normalised; 0 for every other token.
/// `weights` may be `out` or, at T = 1, the keys themselves.
template <std::size_t Bytes, class U, class T>
SPECDEC_KERNEL_INLINE void nucleus_keep_body(const U* key, const T* weights, T* out,
                                             std::size_t size, U last_key, std::size_t last,
                                             T scale) noexcept {
  // Ids up to `last` keep last_key's ties, ids after it do not.
  const std::size_t split = std::min(size, last + 1);
  nucleus_keep_range<Bytes, true>(key, weights, out, 0, split, last_key, scale);
  nucleus_keep_range<Bytes, false>(key, weights, out, split, size, last_key, scale);
}

/// nucleus_keep as a build_mass_table hook: writes the nucleus over each block of the pass
/// before the pass sums it, so that a draw from the written row reads it once (the draft
/// stage's top-p rows: Standardizer::apply leaves this write to the draw). `out` is null
/// until apply hands the write over.
template <class U, class T>
struct nucleus_keep_hook {
  const U* key = nullptr;
  const T* weights = nullptr;
  T* out = nullptr;
  U last_key{};
  std::size_t last = 0;
  T scale{};

  SPECDEC_KERNEL_INLINE void operator()(std::size_t first, std::size_t count) const noexcept {
    // Ids up to `last` keep last_key's ties, ids after it do not (nucleus_keep_body).
    const std::size_t end = first + count;
    const std::size_t split = std::clamp(last + 1, first, end);
    nucleus_keep_range<32, true>(key, weights, out, first, split, last_key, scale);
    nucleus_keep_range<32, false>(key, weights, out, split, end, last_key, scale);
  }

#if SPECDEC_DISPATCH_AVX2
  /// One full block of write_and_sum_block_avx2 on one side of `last` (Keep: the comparison).
  template <int Keep>
  SPECDEC_TARGET_AVX2 __attribute__((always_inline)) static double keep_block_avx2(
      const float* row, float* written, std::size_t b, __m256 bound, __m256 factor) noexcept {
    __m256 low = _mm256_setzero_ps();
    __m256 high = _mm256_setzero_ps();
    for (std::size_t i = b; i < b + kernel_block; i += kernel_lanes) {
      prefetch_ahead(row, i);
      prefetch_ahead<true>(written, i);
      const __m256 w0 = _mm256_loadu_ps(row + i);
      const __m256 w1 = _mm256_loadu_ps(row + i + 8);
      const __m256 x0 = _mm256_and_ps(_mm256_mul_ps(w0, factor), _mm256_cmp_ps(w0, bound, Keep));
      const __m256 x1 = _mm256_and_ps(_mm256_mul_ps(w1, factor), _mm256_cmp_ps(w1, bound, Keep));
      _mm256_storeu_ps(written + i, x0);
      _mm256_storeu_ps(written + i + 8, x1);
      low = _mm256_add_ps(low, x0);
      high = _mm256_add_ps(high, x1);
    }
    return reduce_block_lanes_avx2(low, high);
  }

  /// build_float_table_avx2's full block [b, b + kernel_block) of the draft's written row at
  /// T = 1 (keys and weights the model's float row, `source` the output row), written and
  /// summed in one loop instead of written by operator() and read back: keeps and scales 8
  /// entries at a time, stores them and adds the stored values into the block's lanes (a
  /// kept entry is w * scale with w >= last_key > 0, every other one +0: max(x, 0) would
  /// return each as it is), so the row and the block's sum are bitwise the hook's and the
  /// generic sum's. Adds the sum to `mass` and returns true; returns false, doing nothing,
  /// for the block holding `last` (whose ties are kept only up to it) and for other rows
  /// and types (the caller's hook call and sums then). On a 2-vCPU AMD EPYC (Zen 5), one
  /// 128k row: 11.2 us, against 21.7 for the hook's write and the table's read of it (a
  /// memcpy of the row: 6.3 us).
  template <class Source>
  SPECDEC_TARGET_AVX2 __attribute__((always_inline)) bool write_and_sum_block_avx2(
      const Source& source, std::size_t b, double& mass) const noexcept {
    if constexpr (std::is_same_v<U, float> && std::is_same_v<T, float> &&
                  std::is_same_v<Source, row_source<float>>) {
      if (static_cast<const void*>(key) != static_cast<const void*>(weights) || source.row != out ||
          (b <= last && last < b + kernel_block)) {
        return false;
      }
      const __m256 bound = _mm256_set1_ps(last_key);
      const __m256 factor = _mm256_set1_ps(scale);
      // Ids before `last` keep last_key's ties, ids after it do not.
      mass += b + kernel_block <= last ? keep_block_avx2<_CMP_GE_OQ>(key, out, b, bound, factor)
                                       : keep_block_avx2<_CMP_GT_OQ>(key, out, b, bound, factor);
      return true;
    } else {
      static_cast<void>(source);
      static_cast<void>(b);
      static_cast<void>(mass);
      return false;
    }
  }
#endif
};

#if SPECDEC_DISPATCH_AVX2
template <class T>
SPECDEC_TARGET_AVX2 void nucleus_histogram_avx2(const T* weights, std::size_t size,
                                                std::int32_t top_code, double* mass,
                                                std::uint16_t* codes) noexcept {
  nucleus_histogram_body(weights, size, top_code, mass, codes);
}
SPECDEC_TARGET_AVX2 inline void nucleus_collect_avx2(const std::uint16_t* codes, std::size_t size,
                                                     std::uint16_t wanted,
                                                     std::vector<std::uint32_t>& ids) {
  nucleus_collect_body(codes, size, wanted, ids);
}
template <class U, class T>
SPECDEC_TARGET_AVX2 void nucleus_keep_avx2(const U* key, const T* weights, T* out, std::size_t size,
                                           U last_key, std::size_t last, T scale) noexcept {
  nucleus_keep_body<32>(key, weights, out, size, last_key, last, scale);
}
#endif

// The portable builds: out of line like any inline function (not inlined at every
// dispatching call site, which would double the code the compiler optimizes).
template <class T>
SPECDEC_PORTABLE_KERNEL inline void nucleus_histogram_portable(const T* weights, std::size_t size,
                                                               std::int32_t top_code, double* mass,
                                                               std::uint16_t* codes) noexcept {
  nucleus_histogram_body(weights, size, top_code, mass, codes);
}

SPECDEC_PORTABLE_KERNEL inline void nucleus_collect_portable(const std::uint16_t* codes,
                                                             std::size_t size, std::uint16_t wanted,
                                                             std::vector<std::uint32_t>& ids) {
  nucleus_collect_body(codes, size, wanted, ids);
}

template <class U, class T>
SPECDEC_PORTABLE_KERNEL inline void nucleus_keep_portable(const U* key, const T* weights, T* out,
                                                          std::size_t size, U last_key,
                                                          std::size_t last, T scale) noexcept {
  nucleus_keep_body<16>(key, weights, out, size, last_key, last, scale);
}

/// The three passes on the active kernel path (the same results on every path).
template <class T>
void nucleus_histogram(const T* weights, std::size_t size, std::int32_t top_code, double* mass,
                       std::uint16_t* codes) noexcept {
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2_build()) return nucleus_histogram_avx2(weights, size, top_code, mass, codes);
#endif
  nucleus_histogram_portable(weights, size, top_code, mass, codes);
}
inline void nucleus_collect(const std::uint16_t* codes, std::size_t size, std::uint16_t wanted,
                            std::vector<std::uint32_t>& ids) {
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2_build()) return nucleus_collect_avx2(codes, size, wanted, ids);
#endif
  nucleus_collect_portable(codes, size, wanted, ids);
}
template <class U, class T>
void nucleus_keep(const U* key, const T* weights, T* out, std::size_t size, U last_key,
                  std::size_t last, T scale) noexcept {
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2_build()) return nucleus_keep_avx2(key, weights, out, size, last_key, last, scale);
#endif
  nucleus_keep_portable(key, weights, out, size, last_key, last, scale);
}

// ---------------------------------------------------------------------------------------
// Top-p over a long row of probabilities from a sample (Standardizer::find_nucleus): the
// positive mass of the row, then one pass that sums the weights whose key reaches `high`
// (kept whole) and lists the ids whose key lies in [low, high) (the band where a sample
// placed the end of the nucleus), so that only the band is ranked. Both sums run in
// sampling_lanes double lanes, entry j into lane j % sampling_lanes, each lane in id
// order, the lanes combined in one fixed order: bitwise the same on every path, and never
// smaller for a larger set of entries (each lane's additions are monotone). Float rows
// take AVX2 and AVX-512 builds written with intrinsics (a lane skipped by a mask equals a
// lane adding +0); other rows take the portable loops on every path.
// ---------------------------------------------------------------------------------------

/// Double accumulators of nucleus_total and nucleus_band: entry j goes to lane
/// j % nucleus_lanes.
inline constexpr std::size_t nucleus_lanes = 16;
using nucleus_lane_array = mass_lanes;  // the block lanes widen into them (vector_math.hpp)
static_assert(nucleus_lanes == 16, "the lanes are combined by pairwise_sum16");
// The float builds of the passes below ask for one cache line per iteration (prefetch_ahead).
static_assert(nucleus_lanes * sizeof(float) == cache_line);
/// Entries nucleus_band may write past the last id it lists.
inline constexpr std::size_t nucleus_band_slack = 16;

/// What nucleus_band finds: the mass of the keys >= high and how many ids it listed.
struct nucleus_band_found {
  double head;
  std::size_t count;
};

/// Adds the entries from j on (lane k taking entry j + k, k < nucleus_lanes) and combines
/// the lanes pairwise in a fixed order.
template <class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE double nucleus_total_finish(nucleus_lane_array& lanes,
                                                                const T* weights, std::size_t j,
                                                                std::size_t size) noexcept {
  for (std::size_t k = 0; j + k < size; ++k) {
    const T weight = weights[j + k];
    lanes[k] += weight > T(0) ? static_cast<double>(weight) : 0.0;
  }
  return pairwise_sum16(lanes.data());
}

template <class U, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE nucleus_band_found nucleus_band_finish(
    nucleus_lane_array& lanes, const U* key, const T* weights, std::size_t j, std::size_t size,
    U high, U low, std::uint32_t* band, std::size_t count) noexcept {
  for (std::size_t k = 0; j + k < size; ++k) {
    const U value = key[j + k];
    lanes[k] += value >= high ? static_cast<double>(weights[j + k]) : 0.0;
    band[count] = static_cast<std::uint32_t>(j + k);
    count += ((value >= low) & (value < high)) ? std::size_t{1} : std::size_t{0};
  }
  return {pairwise_sum16(lanes.data()), count};
}

/// Lists j + (the set bits of `mask`) in increasing order.
SPECDEC_KERNEL_INLINE void list_mask_bits(std::uint32_t mask, std::size_t j, std::uint32_t* band,
                                          std::size_t& count) noexcept {
  while (mask != 0) {
    band[count++] = static_cast<std::uint32_t>(j + static_cast<unsigned>(std::countr_zero(mask)));
    mask &= mask - 1;
  }
}

#if defined(__SSE2__)
// The portable build on x86-64 (SSE2 is part of the architecture): the same lanes in
// 16-byte packs.
template <bool KeyIsWeight>
SPECDEC_PORTABLE_KERNEL nucleus_band_found nucleus_band_sse2(const float* key, const float* weights,
                                                             std::size_t size, float high,
                                                             float low,
                                                             std::uint32_t* band) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 2;
  __m128d sum[packs];
  for (auto& pack : sum) pack = _mm_setzero_pd();
  const __m128 top = _mm_set1_ps(high);
  const __m128 bottom = _mm_set1_ps(low);
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(key, j);
    if constexpr (!KeyIsWeight) prefetch_ahead(weights, j);
    std::uint32_t in_band = 0;
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const __m128 k = _mm_loadu_ps(key + j + 4 * h);
      const __m128 w = KeyIsWeight ? k : _mm_loadu_ps(weights + j + 4 * h);
      const __m128 kept = _mm_and_ps(w, _mm_cmpge_ps(k, top));
      sum[2 * h] = _mm_add_pd(sum[2 * h], _mm_cvtps_pd(kept));
      sum[2 * h + 1] = _mm_add_pd(sum[2 * h + 1], _mm_cvtps_pd(_mm_movehl_ps(kept, kept)));
      const __m128 inside = _mm_and_ps(_mm_cmpge_ps(k, bottom), _mm_cmplt_ps(k, top));
      in_band |= static_cast<std::uint32_t>(_mm_movemask_ps(inside)) << (4 * h);
    }
    list_mask_bits(in_band, j, band, count);
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm_storeu_pd(lanes.data() + 2 * q, sum[q]);
  return nucleus_band_finish(lanes, key, weights, j, size, high, low, band, count);
}
#endif

/// The sum of the positive weights of a row (NaN, zero and negative weights add nothing).
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline double nucleus_total_portable(
    const T* weights, std::size_t size) noexcept {
  nucleus_lane_array lanes{};
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    for (std::size_t k = 0; k < nucleus_lanes; ++k) {
      const T weight = weights[j + k];
      lanes[k] += weight > T(0) ? static_cast<double>(weight) : 0.0;
    }
  }
  return nucleus_total_finish(lanes, weights, j, size);
}

/// head = the sum of weights[j] over the keys >= high; band = the ids j with
/// low <= key[j] < high, in increasing order (room for every entry of the row and
/// nucleus_band_slack more: the vector builds store whole packs).
template <class U, class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline nucleus_band_found nucleus_band_portable(
    const U* key, const T* weights, std::size_t size, U high, U low, std::uint32_t* band) noexcept {
#if defined(__SSE2__)
  if constexpr (std::is_same_v<U, float> && std::is_same_v<T, float>) {
    return static_cast<const void*>(key) == static_cast<const void*>(weights)
               ? nucleus_band_sse2<true>(key, weights, size, high, low, band)
               : nucleus_band_sse2<false>(key, weights, size, high, low, band);
  }
#endif
  nucleus_lane_array lanes{};
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    unsigned any = 0;
    for (std::size_t k = 0; k < nucleus_lanes; ++k) {
      const U value = key[j + k];
      lanes[k] += value >= high ? static_cast<double>(weights[j + k]) : 0.0;
      any |= ((value >= low) & (value < high)) ? 1U : 0U;
    }
    if (any == 0) continue;
    for (std::size_t k = 0; k < nucleus_lanes; ++k) {
      const U value = key[j + k];
      band[count] = static_cast<std::uint32_t>(j + k);
      count += ((value >= low) & (value < high)) ? std::size_t{1} : std::size_t{0};
    }
  }
  return nucleus_band_finish(lanes, key, weights, j, size, high, low, band, count);
}

#if SPECDEC_DISPATCH_AVX2
/// For each 8-bit mask, the positions of its set bits, in order (then zeros): the lane
/// permutation that packs the selected lanes of 8 to the front.
struct pack_front_table {
  std::uint32_t lanes[256][8];
  constexpr pack_front_table() : lanes{} {
    for (unsigned mask = 0; mask < 256; ++mask) {
      unsigned next = 0;
      for (unsigned bit = 0; bit < 8; ++bit) {
        if ((mask >> bit) & 1U) lanes[mask][next++] = bit;
      }
    }
  }
};
inline constexpr pack_front_table pack_front{};

/// Stores the ids of the lanes of `inside` (8 ids in `ids`) packed to the front at
/// band + count, all 8 lanes (the band has nucleus_band_slack of room), and counts them.
SPECDEC_TARGET_AVX2 __attribute__((always_inline)) inline void list_band_avx2(
    __m256 inside, __m256i ids, std::uint32_t* band, std::size_t& count) noexcept {
  const auto mask = static_cast<unsigned>(_mm256_movemask_ps(inside));
  const __m256i order =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pack_front.lanes[mask]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(band + count),
                      _mm256_permutevar8x32_epi32(ids, order));
  count += static_cast<std::size_t>(std::popcount(mask));
}

template <bool KeyIsWeight>
SPECDEC_TARGET_AVX2 nucleus_band_found nucleus_band_avx2(const float* key, const float* weights,
                                                         std::size_t size, float high, float low,
                                                         std::uint32_t* band) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 4;
  __m256d sum[packs];
  for (auto& pack : sum) pack = _mm256_setzero_pd();
  const __m256 top = _mm256_set1_ps(high);
  const __m256 bottom = _mm256_set1_ps(low);
  __m256i ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(key, j);
    if constexpr (!KeyIsWeight) prefetch_ahead(weights, j);
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const __m256 k = _mm256_loadu_ps(key + j + 8 * h);
      const __m256 w = KeyIsWeight ? k : _mm256_loadu_ps(weights + j + 8 * h);
      const __m256 kept = _mm256_and_ps(w, _mm256_cmp_ps(k, top, _CMP_GE_OQ));
      sum[2 * h] = _mm256_add_pd(sum[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
      sum[2 * h + 1] =
          _mm256_add_pd(sum[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
      const __m256 inside =
          _mm256_and_ps(_mm256_cmp_ps(k, bottom, _CMP_GE_OQ), _mm256_cmp_ps(k, top, _CMP_LT_OQ));
      list_band_avx2(inside, ids, band, count);
      ids = _mm256_add_epi32(ids, step);
    }
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm256_storeu_pd(lanes.data() + 4 * q, sum[q]);
  return nucleus_band_finish(lanes, key, weights, j, size, high, low, band, count);
}
#endif

#if SPECDEC_DISPATCH_AVX512
template <bool KeyIsWeight>
SPECDEC_TARGET_AVX512 nucleus_band_found nucleus_band_avx512(const float* key, const float* weights,
                                                             std::size_t size, float high,
                                                             float low,
                                                             std::uint32_t* band) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 8;
  __m512d sum[packs];
  for (auto& pack : sum) pack = _mm512_setzero_pd();
  const __m512 top = _mm512_set1_ps(high);
  const __m512 bottom = _mm512_set1_ps(low);
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(key, j);
    if constexpr (!KeyIsWeight) prefetch_ahead(weights, j);
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const __m512 k = _mm512_loadu_ps(key + j + 16 * h);
      const float* const from = (KeyIsWeight ? key : weights) + j + 16 * h;
      const __mmask16 above = _mm512_cmp_ps_mask(k, top, _CMP_GE_OQ);
      sum[2 * h] = _mm512_add_pd(
          sum[2 * h], _mm512_maskz_cvtps_pd(static_cast<__mmask8>(above), _mm256_loadu_ps(from)));
      sum[2 * h + 1] = _mm512_add_pd(
          sum[2 * h + 1],
          _mm512_maskz_cvtps_pd(static_cast<__mmask8>(above >> 8U), _mm256_loadu_ps(from + 8)));
      const __mmask16 inside =
          _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(k, bottom, _CMP_GE_OQ), k, top, _CMP_LT_OQ);
      // The band's ids packed to the front, all 16 lanes stored (the band has room).
      _mm512_storeu_si512(band + count, _mm512_maskz_compress_epi32(inside, ids));
      count += static_cast<std::size_t>(std::popcount(static_cast<unsigned>(inside)));
      ids = _mm512_add_epi32(ids, step);
    }
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm512_storeu_pd(lanes.data() + 8 * q, sum[q]);
  return nucleus_band_finish(lanes, key, weights, j, size, high, low, band, count);
}
#endif

/// What Standardizer::apply's first pass tells a validating caller when it screens the
/// row (screens_first_pass): whether every entry is >= 0 (no NaN), and the row's sum then
/// (in double lanes, or in blocks of T lanes widened per block: within screen_sum_error of
/// the exact sum either way, as plausible_total needs).
struct first_pass_screen {
  bool signs_passed = false;
  double total = 0.0;
};

/// The vector builds' end: the packs' maxima folded, then the entries from j on.
template <std::size_t Lanes>
[[nodiscard]] SPECDEC_KERNEL_INLINE max_and_total<float> nucleus_max_total_finish(
    const float (&top)[Lanes], bool signs_passed, nucleus_lane_array& lanes, const float* row,
    std::size_t j, std::size_t size) noexcept {
  float maximum = top[0];
  for (const float value : top) maximum = maximum < value ? value : maximum;
  for (std::size_t k = j; k < size; ++k) {
    maximum = maximum < row[k] ? row[k] : maximum;
    signs_passed = signs_passed && row[k] >= 0.0F;
  }
  return {maximum, nucleus_total_finish(lanes, row, j, size), signs_passed};
}

#if defined(__SSE2__)
SPECDEC_PORTABLE_KERNEL inline max_and_total<float> nucleus_max_total_sse2(
    const float* row, std::size_t size) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 2;
  __m128d sum[packs];
  for (auto& pack : sum) pack = _mm_setzero_pd();
  __m128 best = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  __m128 bad = _mm_setzero_ps();
  const __m128 zero = _mm_setzero_ps();
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(row, j);
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const __m128 w = _mm_loadu_ps(row + j + 4 * h);
      best = _mm_max_ps(w, best);                    // a NaN lane of w keeps best
      bad = _mm_or_ps(bad, _mm_cmpnge_ps(w, zero));  // negative or NaN
      const __m128 kept = _mm_and_ps(w, _mm_cmpgt_ps(w, zero));
      sum[2 * h] = _mm_add_pd(sum[2 * h], _mm_cvtps_pd(kept));
      sum[2 * h + 1] = _mm_add_pd(sum[2 * h + 1], _mm_cvtps_pd(_mm_movehl_ps(kept, kept)));
    }
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm_storeu_pd(lanes.data() + 2 * q, sum[q]);
  alignas(16) float top[4];
  _mm_store_ps(top, best);
  return nucleus_max_total_finish(top, _mm_movemask_ps(bad) == 0, lanes, row, j, size);
}
#endif

#if SPECDEC_DISPATCH_AVX2
SPECDEC_TARGET_AVX2 inline max_and_total<float> nucleus_max_total_avx2(const float* row,
                                                                       std::size_t size) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 4;
  __m256d sum[packs];
  for (auto& pack : sum) pack = _mm256_setzero_pd();
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(row, j);
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const __m256 w = _mm256_loadu_ps(row + j + 8 * h);
      best = _mm256_max_ps(w, best);                                 // a NaN lane keeps best
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(w, zero, _CMP_NGE_UQ));  // negative or NaN
      const __m256 kept = _mm256_and_ps(w, _mm256_cmp_ps(w, zero, _CMP_GT_OQ));
      sum[2 * h] = _mm256_add_pd(sum[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
      sum[2 * h + 1] =
          _mm256_add_pd(sum[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
    }
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm256_storeu_pd(lanes.data() + 4 * q, sum[q]);
  alignas(32) float top[8];
  _mm256_store_ps(top, best);
  return nucleus_max_total_finish(top, _mm256_movemask_ps(bad) == 0, lanes, row, j, size);
}
#endif

#if SPECDEC_DISPATCH_AVX512
SPECDEC_TARGET_AVX512 inline max_and_total<float> nucleus_max_total_avx512(
    const float* row, std::size_t size) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 8;
  __m512d sum[packs];
  for (auto& pack : sum) pack = _mm512_setzero_pd();
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 bad = 0;
  const __m512 zero = _mm512_setzero_ps();
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(row, j);
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const float* const from = row + j + 16 * h;
      const __m512 w = _mm512_loadu_ps(from);
      bad = static_cast<__mmask16>(bad | _mm512_cmp_ps_mask(w, zero, _CMP_NGE_UQ));
      // A NaN lane of w keeps best (the zero-masked form: see nucleus_band_avx512).
      best = _mm512_maskz_max_ps(static_cast<__mmask16>(0xFFFFU), w, best);
      const __mmask16 kept = _mm512_cmp_ps_mask(w, zero, _CMP_GT_OQ);
      sum[2 * h] = _mm512_add_pd(
          sum[2 * h], _mm512_maskz_cvtps_pd(static_cast<__mmask8>(kept), _mm256_loadu_ps(from)));
      sum[2 * h + 1] = _mm512_add_pd(
          sum[2 * h + 1],
          _mm512_maskz_cvtps_pd(static_cast<__mmask8>(kept >> 8U), _mm256_loadu_ps(from + 8)));
    }
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm512_storeu_pd(lanes.data() + 8 * q, sum[q]);
  alignas(64) float top[16];
  _mm512_store_ps(top, best);
  return nucleus_max_total_finish(top, bad == 0, lanes, row, j, size);
}
#endif

#if SPECDEC_DISPATCH_AVX2
/// nucleus_total of a float row alone (no maximum, no screen): the tempered weights' mass
/// at T != 1. The same lanes and additions as nucleus_max_total_avx2's sum.
SPECDEC_TARGET_AVX2 inline double nucleus_total_avx2(const float* row, std::size_t size) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 4;
  __m256d sum[packs];
  for (auto& pack : sum) pack = _mm256_setzero_pd();
  const __m256 zero = _mm256_setzero_ps();
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(row, j);
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const __m256 w = _mm256_loadu_ps(row + j + 8 * h);
      const __m256 kept = _mm256_and_ps(w, _mm256_cmp_ps(w, zero, _CMP_GT_OQ));
      sum[2 * h] = _mm256_add_pd(sum[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
      sum[2 * h + 1] =
          _mm256_add_pd(sum[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
    }
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm256_storeu_pd(lanes.data() + 4 * q, sum[q]);
  return nucleus_total_finish(lanes, row, j, size);
}
#endif

#if SPECDEC_DISPATCH_AVX512
/// nucleus_total of a float row alone: nucleus_max_total_avx512's sum without its maximum
/// and screen (three fewer operations per 16 entries, most of them on the port the
/// conversions need).
SPECDEC_TARGET_AVX512 inline double nucleus_total_avx512(const float* row,
                                                         std::size_t size) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 8;
  __m512d sum[packs];
  for (auto& pack : sum) pack = _mm512_setzero_pd();
  const __m512 zero = _mm512_setzero_ps();
  std::size_t j = 0;
  for (; j + nucleus_lanes <= size; j += nucleus_lanes) {
    prefetch_ahead(row, j);
    for (std::size_t h = 0; h < packs / 2; ++h) {
      const float* const from = row + j + 16 * h;
      const __mmask16 kept = _mm512_cmp_ps_mask(_mm512_loadu_ps(from), zero, _CMP_GT_OQ);
      sum[2 * h] = _mm512_add_pd(
          sum[2 * h], _mm512_maskz_cvtps_pd(static_cast<__mmask8>(kept), _mm256_loadu_ps(from)));
      sum[2 * h + 1] = _mm512_add_pd(
          sum[2 * h + 1],
          _mm512_maskz_cvtps_pd(static_cast<__mmask8>(kept >> 8U), _mm256_loadu_ps(from + 8)));
    }
  }
  nucleus_lane_array lanes;
  for (std::size_t q = 0; q < packs; ++q) _mm512_storeu_pd(lanes.data() + 8 * q, sum[q]);
  return nucleus_total_finish(lanes, row, j, size);
}
#endif

/// Top-p's band pass at T = 1 with apply's first pass fused into it (the keys are the
/// weights), in one read of the row: the row's maximum and sign screen (nucleus_max_total's),
/// the band's ids (nucleus_band's, bitwise), the head (the mass of the entries >= `high`)
/// and the row's positive mass. The two masses are summed as the mass tables sum
/// (row_kernels.hpp): each block of kernel_block entries in 16 lanes of T (entry j in lane
/// j % 16, each lane in entry order; a NaN or negative entry adds +0), the block's lanes
/// widened into 16 double lanes, which are combined pairwise at the end. No entry is
/// converted to double on its own: the conversions bound the pass otherwise (they share
/// the vector port with the comparisons and the band's compress), and the pass now runs at
/// the speed of a plain read of the row. Accuracy: each block's lanes add at most 8
/// entries in T (7 roundings), so either mass is within 7 u_T of the exact sum of its
/// entries (u_float = 2^-24), plus the double additions: the nucleus is then placed within
/// that relative error of the top-p threshold, the accuracy the draws already have.
template <class T>
struct screened_band_found {
  max_and_total<T> screen;
  nucleus_band_found band;
};

/// The entries [j, end) of one block (j a multiple of nucleus_lanes) added into its lanes
/// `head` and `total`, with the maximum, the screen and the band's ids, one by one.
template <class T>
SPECDEC_KERNEL_INLINE void screened_band_entries(const T* row, std::size_t j, std::size_t end,
                                                 T high, T low, T& maximum, bool& signs_passed,
                                                 block_lanes<T>& head, block_lanes<T>& total,
                                                 std::uint32_t* band, std::size_t& count) noexcept {
  for (std::size_t i = j; i < end; ++i) {
    const T value = row[i];
    const std::size_t lane = i % nucleus_lanes;
    maximum = maximum < value ? value : maximum;  // a NaN entry keeps the maximum
    signs_passed = signs_passed && value >= T(0);
    head[lane] += value >= high ? value : T(0);
    total[lane] += value > T(0) ? value : T(0);
    band[count] = static_cast<std::uint32_t>(i);
    count += ((value >= low) & (value < high)) ? std::size_t{1} : std::size_t{0};
  }
}

/// Folds the packs' maxima `top`, adds the last partial block from j on (j a multiple of
/// kernel_block: the vector builds' end), then combines the lanes.
template <class T, std::size_t Lanes>
[[nodiscard]] SPECDEC_KERNEL_INLINE screened_band_found<T> screened_band_finish(
    const T (&top)[Lanes], bool signs_passed, nucleus_lane_array& head, nucleus_lane_array& total,
    const T* row, std::size_t j, std::size_t size, T high, T low, std::uint32_t* band,
    std::size_t count) noexcept {
  T maximum = top[0];
  for (const T value : top) maximum = maximum < value ? value : maximum;
  block_lanes<T> head_block{};
  block_lanes<T> total_block{};
  screened_band_entries(row, j, size, high, low, maximum, signs_passed, head_block, total_block,
                        band, count);
  widen_block_lanes(head_block, head);
  widen_block_lanes(total_block, total);
  return {{maximum, pairwise_sum16(total.data()), signs_passed},
          {pairwise_sum16(head.data()), count}};
}

/// The portable loops (any scalar type; float rows on x86-64 take the SSE2 build).
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline screened_band_found<T> nucleus_screened_band_loops(
    const T* row, std::size_t size, T high, T low, std::uint32_t* band) noexcept {
  nucleus_lane_array head{};
  nucleus_lane_array total{};
  T maximum = -std::numeric_limits<T>::infinity();
  bool signs_passed = true;
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + kernel_block <= size; j += kernel_block) {
    block_lanes<T> head_block{};
    block_lanes<T> total_block{};
    screened_band_entries(row, j, j + kernel_block, high, low, maximum, signs_passed, head_block,
                          total_block, band, count);
    widen_block_lanes(head_block, head);
    widen_block_lanes(total_block, total);
  }
  const T top[1] = {maximum};
  return screened_band_finish(top, signs_passed, head, total, row, j, size, high, low, band, count);
}

#if defined(__SSE2__)
SPECDEC_PORTABLE_KERNEL inline screened_band_found<float> nucleus_screened_band_sse2(
    const float* row, std::size_t size, float high, float low, std::uint32_t* band) noexcept {
  constexpr std::size_t packs = nucleus_lanes / 4;  // float packs per 16 lanes
  __m128d head[2 * packs];
  __m128d total[2 * packs];
  for (auto& pack : head) pack = _mm_setzero_pd();
  for (auto& pack : total) pack = _mm_setzero_pd();
  __m128 best = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  __m128 bad = _mm_setzero_ps();
  const __m128 zero = _mm_setzero_ps();
  const __m128 top = _mm_set1_ps(high);
  const __m128 bottom = _mm_set1_ps(low);
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + kernel_block <= size; j += kernel_block) {
    __m128 head_block[packs];
    __m128 total_block[packs];
    for (std::size_t h = 0; h < packs; ++h) {
      head_block[h] = _mm_setzero_ps();
      total_block[h] = _mm_setzero_ps();
    }
    for (std::size_t g = j; g < j + kernel_block; g += nucleus_lanes) {
      prefetch_ahead(row, g);
      std::uint32_t in_band = 0;
      for (std::size_t h = 0; h < packs; ++h) {
        const __m128 w = _mm_loadu_ps(row + g + 4 * h);
        best = _mm_max_ps(w, best);  // a NaN lane of w keeps best
        bad = _mm_or_ps(bad, _mm_cmpnge_ps(w, zero));
        const __m128 above = _mm_cmpge_ps(w, top);
        // Adding +0 leaves a lane as it was; max(w, 0) is +0 for a NaN or negative w.
        head_block[h] = _mm_add_ps(head_block[h], _mm_and_ps(w, above));
        total_block[h] = _mm_add_ps(total_block[h], _mm_max_ps(w, zero));
        const __m128 inside = _mm_andnot_ps(above, _mm_cmpge_ps(w, bottom));
        in_band |= static_cast<std::uint32_t>(_mm_movemask_ps(inside)) << (4 * h);
      }
      list_mask_bits(in_band, g, band, count);
    }
    for (std::size_t h = 0; h < packs; ++h) {
      head[2 * h] = _mm_add_pd(head[2 * h], _mm_cvtps_pd(head_block[h]));
      head[2 * h + 1] =
          _mm_add_pd(head[2 * h + 1], _mm_cvtps_pd(_mm_movehl_ps(head_block[h], head_block[h])));
      total[2 * h] = _mm_add_pd(total[2 * h], _mm_cvtps_pd(total_block[h]));
      total[2 * h + 1] =
          _mm_add_pd(total[2 * h + 1], _mm_cvtps_pd(_mm_movehl_ps(total_block[h], total_block[h])));
    }
  }
  nucleus_lane_array head_lanes;
  nucleus_lane_array total_lanes;
  for (std::size_t q = 0; q < 2 * packs; ++q) {
    _mm_storeu_pd(head_lanes.data() + 2 * q, head[q]);
    _mm_storeu_pd(total_lanes.data() + 2 * q, total[q]);
  }
  alignas(16) float maxima[4];
  _mm_store_ps(maxima, best);
  return screened_band_finish(maxima, _mm_movemask_ps(bad) == 0, head_lanes, total_lanes, row, j,
                              size, high, low, band, count);
}
#endif

#if SPECDEC_DISPATCH_AVX2
SPECDEC_TARGET_AVX2 inline screened_band_found<float> nucleus_screened_band_avx2(
    const float* row, std::size_t size, float high, float low, std::uint32_t* band) noexcept {
  __m256d head[4];
  __m256d total[4];
  for (auto& pack : head) pack = _mm256_setzero_pd();
  for (auto& pack : total) pack = _mm256_setzero_pd();
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  const __m256 top = _mm256_set1_ps(high);
  const __m256 bottom = _mm256_set1_ps(low);
  __m256i ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + kernel_block <= size; j += kernel_block) {
    __m256 head_block[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 total_block[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (std::size_t g = j; g < j + kernel_block; g += nucleus_lanes) {
      prefetch_ahead(row, g);
      for (std::size_t h = 0; h < 2; ++h) {
        const __m256 w = _mm256_loadu_ps(row + g + 8 * h);
        best = _mm256_max_ps(w, best);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(w, zero, _CMP_NGE_UQ));
        const __m256 above = _mm256_cmp_ps(w, top, _CMP_GE_OQ);
        head_block[h] = _mm256_add_ps(head_block[h], _mm256_and_ps(w, above));
        total_block[h] = _mm256_add_ps(total_block[h], _mm256_max_ps(w, zero));
        const __m256 inside = _mm256_andnot_ps(above, _mm256_cmp_ps(w, bottom, _CMP_GE_OQ));
        list_band_avx2(inside, ids, band, count);
        ids = _mm256_add_epi32(ids, step);
      }
    }
    for (std::size_t h = 0; h < 2; ++h) {
      head[2 * h] =
          _mm256_add_pd(head[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(head_block[h])));
      head[2 * h + 1] =
          _mm256_add_pd(head[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(head_block[h], 1)));
      total[2 * h] =
          _mm256_add_pd(total[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(total_block[h])));
      total[2 * h + 1] = _mm256_add_pd(total[2 * h + 1],
                                       _mm256_cvtps_pd(_mm256_extractf128_ps(total_block[h], 1)));
    }
  }
  nucleus_lane_array head_lanes;
  nucleus_lane_array total_lanes;
  for (std::size_t q = 0; q < 4; ++q) {
    _mm256_storeu_pd(head_lanes.data() + 4 * q, head[q]);
    _mm256_storeu_pd(total_lanes.data() + 4 * q, total[q]);
  }
  alignas(32) float maxima[8];
  _mm256_store_ps(maxima, best);
  return screened_band_finish(maxima, _mm256_movemask_ps(bad) == 0, head_lanes, total_lanes, row, j,
                              size, high, low, band, count);
}
#endif

#if SPECDEC_DISPATCH_AVX512
SPECDEC_TARGET_AVX512 inline screened_band_found<float> nucleus_screened_band_avx512(
    const float* row, std::size_t size, float high, float low, std::uint32_t* band) noexcept {
  __m512d head[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
  __m512d total[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 bad = 0;
  const __m512 zero = _mm512_setzero_ps();
  const __m512 top = _mm512_set1_ps(high);
  const __m512 bottom = _mm512_set1_ps(low);
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  // Zero-masked forms with every lane on: GCC 12 warns about some unmasked ones.
  const auto all = static_cast<__mmask16>(0xFFFFU);
  std::size_t count = 0;
  std::size_t j = 0;
  for (; j + kernel_block <= size; j += kernel_block) {
    __m512 head_block = _mm512_setzero_ps();
    __m512 total_block = _mm512_setzero_ps();
    for (std::size_t g = j; g < j + kernel_block; g += nucleus_lanes) {
      prefetch_ahead(row, g);
      const __m512 w = _mm512_loadu_ps(row + g);
      bad = static_cast<__mmask16>(bad | _mm512_cmp_ps_mask(w, zero, _CMP_NGE_UQ));
      // A NaN lane of w keeps best (the zero-masked form: see nucleus_max_total_avx512).
      best = _mm512_maskz_max_ps(all, w, best);
      const __mmask16 above = _mm512_cmp_ps_mask(w, top, _CMP_GE_OQ);
      head_block = _mm512_mask_add_ps(head_block, above, head_block, w);
      total_block = _mm512_add_ps(total_block, _mm512_maskz_max_ps(all, w, zero));
      const __mmask16 inside =
          _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(~above), w, bottom, _CMP_GE_OQ);
      _mm512_storeu_si512(band + count, _mm512_maskz_compress_epi32(inside, ids));
      count += static_cast<std::size_t>(std::popcount(static_cast<unsigned>(inside)));
      ids = _mm512_add_epi32(ids, step);
    }
    // The block's 16 lanes widened into the double lanes (lanes 0-7, then 8-15; zero-masked
    // forms with every lane on, as above).
    const auto eight = static_cast<__mmask8>(0xFFU);
    head[0] = _mm512_add_pd(
        head[0], _mm512_maskz_cvtps_pd(eight, _mm512_maskz_extractf32x8_ps(eight, head_block, 0)));
    head[1] = _mm512_add_pd(
        head[1], _mm512_maskz_cvtps_pd(eight, _mm512_maskz_extractf32x8_ps(eight, head_block, 1)));
    total[0] = _mm512_add_pd(total[0], _mm512_maskz_cvtps_pd(eight, _mm512_maskz_extractf32x8_ps(
                                                                        eight, total_block, 0)));
    total[1] = _mm512_add_pd(total[1], _mm512_maskz_cvtps_pd(eight, _mm512_maskz_extractf32x8_ps(
                                                                        eight, total_block, 1)));
  }
  nucleus_lane_array head_lanes;
  nucleus_lane_array total_lanes;
  for (std::size_t q = 0; q < 2; ++q) {
    _mm512_storeu_pd(head_lanes.data() + 8 * q, head[q]);
    _mm512_storeu_pd(total_lanes.data() + 8 * q, total[q]);
  }
  alignas(64) float maxima[16];
  _mm512_store_ps(maxima, best);
  return screened_band_finish(maxima, bad == 0, head_lanes, total_lanes, row, j, size, high, low,
                              band, count);
}
#endif

/// nucleus_band on the active kernel path (the same results on every path).
template <class U, class T>
[[nodiscard]] nucleus_band_found nucleus_band(const U* key, const T* weights, std::size_t size,
                                              U high, U low, std::uint32_t* band) noexcept {
  if constexpr (std::is_same_v<U, float> && std::is_same_v<T, float>) {
    const bool same = static_cast<const void*>(key) == static_cast<const void*>(weights);
#if SPECDEC_DISPATCH_AVX512
    if (use_avx512()) {
      return same ? nucleus_band_avx512<true>(key, weights, size, high, low, band)
                  : nucleus_band_avx512<false>(key, weights, size, high, low, band);
    }
#endif
#if SPECDEC_DISPATCH_AVX2
    if (use_avx2()) {
      return same ? nucleus_band_avx2<true>(key, weights, size, high, low, band)
                  : nucleus_band_avx2<false>(key, weights, size, high, low, band);
    }
#endif
    static_cast<void>(same);
  }
  return nucleus_band_portable(key, weights, size, high, low, band);
}

/// max_and_total of a row on the active kernel path: float rows in one pass, others in two
/// (span_max, then nucleus_total); the same maximum and bitwise the same total either way.
template <class T>
[[nodiscard]] max_and_total<T> nucleus_max_total(const T* row, std::size_t size) noexcept {
  if constexpr (std::is_same_v<T, float>) {
#if SPECDEC_DISPATCH_AVX512
    if (use_avx512()) return nucleus_max_total_avx512(row, size);
#endif
#if SPECDEC_DISPATCH_AVX2
    if (use_avx2()) return nucleus_max_total_avx2(row, size);
#endif
#if defined(__SSE2__)
    return nucleus_max_total_sse2(row, size);
#endif
  }
  bool signs_passed = true;
  const T maximum = span_max<true>(row, size, signs_passed);
  return {maximum, nucleus_total_portable(row, size), signs_passed};
}

/// nucleus_total on the active kernel path: float rows take a pass of their own on the AVX2
/// and AVX-512 paths (nucleus_max_total's sum without the maximum and signs: 3% of a
/// T = 0.7 top-p row at 128k, AVX-512) and nucleus_max_total's pass on the portable one,
/// other rows the portable loops; bitwise the same sum everywhere.
template <class T>
[[nodiscard]] double nucleus_total(const T* weights, std::size_t size) noexcept {
  if constexpr (std::is_same_v<T, float>) {
#if SPECDEC_DISPATCH_AVX512
    if (use_avx512()) return nucleus_total_avx512(weights, size);
#endif
#if SPECDEC_DISPATCH_AVX2
    if (use_avx2()) return nucleus_total_avx2(weights, size);
#endif
    return nucleus_max_total(weights, size).total;
  } else {
    return nucleus_total_portable(weights, size);
  }
}

/// screened_band_found of a row of probabilities on the active kernel path: bitwise the
/// same on every path. `band` has room for every entry of the row and nucleus_band_slack more.
template <class T>
[[nodiscard]] screened_band_found<T> nucleus_screened_band(const T* row, std::size_t size, T high,
                                                           T low, std::uint32_t* band) noexcept {
  if constexpr (std::is_same_v<T, float>) {
#if SPECDEC_DISPATCH_AVX512
    if (use_avx512()) return nucleus_screened_band_avx512(row, size, high, low, band);
#endif
#if SPECDEC_DISPATCH_AVX2
    if (use_avx2()) return nucleus_screened_band_avx2(row, size, high, low, band);
#endif
#if defined(__SSE2__)
    return nucleus_screened_band_sse2(row, size, high, low, band);
#endif
  }
  return nucleus_screened_band_loops(row, size, high, low, band);
}

/// The smallest positive T whose magnitude_code is `code` (0 for codes <= 0).
template <class T>
[[nodiscard]] inline T from_magnitude_code(std::int64_t code) noexcept {
  if (code <= 0) return T(0);
  if constexpr (sizeof(T) == sizeof(std::uint64_t)) {
    return std::bit_cast<T>(static_cast<std::uint64_t>(code) << 48U);
  } else {
    return std::bit_cast<T>(static_cast<std::uint32_t>(code) << 19U);
  }
}

/// Strict total order on token ids of a row: higher probability first, lower id first
/// among equal probabilities. Top-k and top-p keep a prefix of this order.
template <class T>
struct more_probable_first {
  const T* row;
  [[nodiscard]] bool operator()(std::uint32_t a, std::uint32_t b) const noexcept {
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  }
};

// ---------------------------------------------------------------------------------------
// Top-p's sample (Standardizer::sampled_band): runs of adjacent entries, one cache line of
// keys each, read with nothing between them that waits on an earlier one.
// ---------------------------------------------------------------------------------------

/// Entries per run of the sample: one cache line of keys.
template <class U>
inline constexpr std::size_t nucleus_sample_run = std::max<std::size_t>(cache_line / sizeof(U), 1);

/// The sample's runs: run c (c < runs) holds the nucleus_sample_run<U> entries from
/// sample_run_start(c). Writes each sampled entry's weight to weight_of (0 for an
/// entry without weight: a weight or key not > 0, or NaN) and its bucket to code_of
/// (nucleus_bucket of its key; nucleus_buckets for an entry without weight), run after run,
/// and each run's weight in the buckets after bucket 0 to run_mass: four partial sums (entry
/// i of the run into sum i % 4, in entry order) combined as (s0 + s1) + (s2 + s3). The run
/// `ahead` runs later is asked for meanwhile. Branch-free, so that each run is a few vector
/// instructions; the same numbers on every path.
template <class U>
[[nodiscard]] inline std::size_t sample_run_start(std::size_t c, std::size_t spacing) noexcept {
  constexpr std::size_t run = nucleus_sample_run<U>;
  return (c * spacing + spacing / 2) / run * run;
}

template <class U, class T>
SPECDEC_KERNEL_INLINE void sample_runs_body(const U* key, const T* weights, std::size_t spacing,
                                            std::size_t runs, std::size_t ahead,
                                            std::int32_t top_code, T* __restrict weight_of,
                                            std::uint16_t* __restrict code_of,
                                            double* run_mass) noexcept {
  constexpr std::size_t run = nucleus_sample_run<U>;
  static_assert(run % 4 == 0);
  const bool separate = static_cast<const void*>(weights) != static_cast<const void*>(key);
  for (std::size_t c = 0; c < runs; ++c) {
    if (c + ahead < runs) {
      const std::size_t next = sample_run_start<U>(c + ahead, spacing);
      prefetch_entry(key, next);
      if (separate) prefetch_entry(weights, next);
    }
    const std::size_t j = sample_run_start<U>(c, spacing);
    const U* const run_keys = key + j;
    const T* const run_weights = weights + j;
    T* __restrict const weight_out = weight_of + c * run;
    std::uint16_t* __restrict const code_out = code_of + c * run;
    for (std::size_t i = 0; i < run; ++i) {
      const U k = run_keys[i];
      const T weight = run_weights[i];
      const std::int32_t offset = clamped_bucket(k, top_code);  // by the key
      const bool counted = k > U(0) && weight > T(0);
      weight_out[i] = counted ? weight : T(0);
      code_out[i] = static_cast<std::uint16_t>(counted ? offset : std::int32_t{nucleus_buckets});
    }
    double part[4] = {0.0, 0.0, 0.0, 0.0};
    for (std::size_t i = 0; i < run; i += 4) {
      for (std::size_t k = 0; k < 4; ++k) {
        part[k] += code_out[i + k] > 0 ? static_cast<double>(weight_out[i + k]) : 0.0;
      }
    }
    run_mass[c] = (part[0] + part[1]) + (part[2] + part[3]);
  }
}

#if SPECDEC_DISPATCH_AVX512
template <class U, class T>
SPECDEC_TARGET_AVX512 void sample_runs_avx512(const U* key, const T* weights, std::size_t spacing,
                                              std::size_t runs, std::size_t ahead,
                                              std::int32_t top_code, T* weight_of,
                                              std::uint16_t* code_of, double* run_mass) noexcept {
  sample_runs_body(key, weights, spacing, runs, ahead, top_code, weight_of, code_of, run_mass);
}
#endif
#if SPECDEC_DISPATCH_AVX2
template <class U, class T>
SPECDEC_TARGET_AVX2 void sample_runs_avx2(const U* key, const T* weights, std::size_t spacing,
                                          std::size_t runs, std::size_t ahead,
                                          std::int32_t top_code, T* weight_of,
                                          std::uint16_t* code_of, double* run_mass) noexcept {
  sample_runs_body(key, weights, spacing, runs, ahead, top_code, weight_of, code_of, run_mass);
}
#endif
template <class U, class T>
SPECDEC_PORTABLE_KERNEL inline void sample_runs_portable(const U* key, const T* weights,
                                                         std::size_t spacing, std::size_t runs,
                                                         std::size_t ahead, std::int32_t top_code,
                                                         T* weight_of, std::uint16_t* code_of,
                                                         double* run_mass) noexcept {
  sample_runs_body(key, weights, spacing, runs, ahead, top_code, weight_of, code_of, run_mass);
}

/// sample_runs_body on the active kernel path (the same numbers on every path).
template <class U, class T>
void sample_runs(const U* key, const T* weights, std::size_t spacing, std::size_t runs,
                 std::size_t ahead, std::int32_t top_code, T* weight_of, std::uint16_t* code_of,
                 double* run_mass) noexcept {
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) {
    return sample_runs_avx512(key, weights, spacing, runs, ahead, top_code, weight_of, code_of,
                              run_mass);
  }
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2()) {
    return sample_runs_avx2(key, weights, spacing, runs, ahead, top_code, weight_of, code_of,
                            run_mass);
  }
#endif
  sample_runs_portable(key, weights, spacing, runs, ahead, top_code, weight_of, code_of, run_mass);
}

// ---------------------------------------------------------------------------------------
// Top-p's band after the band pass (Standardizer::resolve_band): each band entry's bucket
// and weight read once, in vector gathers where the path has them, and the ids of one
// bucket listed.
// ---------------------------------------------------------------------------------------

/// For each of the `count` ids of `band`: code[i] = (bits of key[id] - low_bits) >> shift (a
/// bucket below 2^16: the caller's keys lie in the band) and weight_out[i] = weights[id].
template <class U, class T>
SPECDEC_KERNEL_INLINE void band_codes_body(
    const U* key, const T* weights, const std::uint32_t* band, std::size_t from, std::size_t count,
    std::conditional_t<sizeof(U) == 8, std::uint64_t, std::uint32_t> low_bits, unsigned shift,
    std::uint16_t* code, T* weight_out) noexcept {
  using word = std::conditional_t<sizeof(U) == 8, std::uint64_t, std::uint32_t>;
  for (std::size_t i = from; i < count; ++i) {
    const std::uint32_t id = band[i];
    code[i] = static_cast<std::uint16_t>((std::bit_cast<word>(key[id]) - low_bits) >> shift);
    weight_out[i] = weights[id];
  }
}

#if SPECDEC_DISPATCH_AVX512
template <bool KeyIsWeight>
SPECDEC_TARGET_AVX512 void band_codes_avx512(const float* key, const float* weights,
                                             const std::uint32_t* band, std::size_t count,
                                             std::uint32_t low_bits, unsigned shift,
                                             std::uint16_t* code, float* weight_out) noexcept {
  const __m512i low = _mm512_set1_epi32(static_cast<int>(low_bits));
  const __m128i by = _mm_cvtsi32_si128(static_cast<int>(shift));
  // Masked forms with every lane on: GCC 12 warns about the unmasked ones.
  const auto all = static_cast<__mmask16>(0xFFFFU);
  const __m512 none = _mm512_setzero_ps();
  std::size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    // Ids below 2^31 (a row's size is: see band_codes), so the signed indices are exact.
    const __m512i ids = _mm512_loadu_si512(band + i);
    const __m512 keys = _mm512_mask_i32gather_ps(none, all, ids, key, 4);
    const __m512i bucket =
        _mm512_maskz_srl_epi32(all, _mm512_sub_epi32(_mm512_castps_si512(keys), low), by);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(code + i),
                        _mm512_maskz_cvtepi32_epi16(all, bucket));
    _mm512_storeu_ps(weight_out + i,
                     KeyIsWeight ? keys : _mm512_mask_i32gather_ps(none, all, ids, weights, 4));
  }
  band_codes_body(key, weights, band, i, count, low_bits, shift, code, weight_out);
}
#endif
#if SPECDEC_DISPATCH_AVX2
template <bool KeyIsWeight>
SPECDEC_TARGET_AVX2 void band_codes_avx2(const float* key, const float* weights,
                                         const std::uint32_t* band, std::size_t count,
                                         std::uint32_t low_bits, unsigned shift,
                                         std::uint16_t* code, float* weight_out) noexcept {
  const __m256i low = _mm256_set1_epi32(static_cast<int>(low_bits));
  const __m128i by = _mm_cvtsi32_si128(static_cast<int>(shift));
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i ids = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(band + i));
    const __m256 keys = _mm256_i32gather_ps(key, ids, 4);
    const __m256i bucket = _mm256_srl_epi32(_mm256_sub_epi32(_mm256_castps_si256(keys), low), by);
    // Buckets below 2^16: the unsigned saturation keeps them.
    const __m128i narrow =
        _mm_packus_epi32(_mm256_castsi256_si128(bucket), _mm256_extracti128_si256(bucket, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(code + i), narrow);
    _mm256_storeu_ps(weight_out + i, KeyIsWeight ? keys : _mm256_i32gather_ps(weights, ids, 4));
  }
  band_codes_body(key, weights, band, i, count, low_bits, shift, code, weight_out);
}
#endif

/// band_codes_body on the active kernel path (float rows gather on the AVX2 and AVX-512
/// paths; the same codes and weights everywhere).
template <class U, class T>
void band_codes(const U* key, const T* weights, const std::uint32_t* band, std::size_t count,
                std::conditional_t<sizeof(U) == 8, std::uint64_t, std::uint32_t> low_bits,
                unsigned shift, std::uint16_t* code, T* weight_out, std::size_t size) noexcept {
  if constexpr (std::is_same_v<U, float> && std::is_same_v<T, float>) {
    // The gathers' indices are signed 32-bit lanes: rows of fewer than 2^31 entries.
    const bool gather = size <= std::size_t{0x7fffffff};
    const bool same = static_cast<const void*>(key) == static_cast<const void*>(weights);
#if SPECDEC_DISPATCH_AVX512
    if (gather && use_avx512()) {
      return same ? band_codes_avx512<true>(key, weights, band, count, low_bits, shift, code,
                                            weight_out)
                  : band_codes_avx512<false>(key, weights, band, count, low_bits, shift, code,
                                             weight_out);
    }
#endif
#if SPECDEC_DISPATCH_AVX2
    if (gather && use_avx2()) {
      return same ? band_codes_avx2<true>(key, weights, band, count, low_bits, shift, code,
                                          weight_out)
                  : band_codes_avx2<false>(key, weights, band, count, low_bits, shift, code,
                                           weight_out);
    }
#endif
    static_cast<void>(gather);
    static_cast<void>(same);
  }
  static_cast<void>(size);
  band_codes_body(key, weights, band, 0, count, low_bits, shift, code, weight_out);
}

/// Lists the ids band[i] whose code[i] is `bucket` (i < count) into out, in order, and returns
/// how many. `out` has room for count + nucleus_band_slack ids (the vector build stores
/// whole packs); it may be `band` itself (each pack is read before the list reaches it).
SPECDEC_KERNEL_INLINE std::size_t list_bucket_body(const std::uint16_t* code,
                                                   const std::uint32_t* band, std::size_t from,
                                                   std::size_t count, std::uint16_t bucket,
                                                   std::uint32_t* out,
                                                   std::size_t listed) noexcept {
  for (std::size_t i = from; i < count; ++i) {
    out[listed] = band[i];
    listed += code[i] == bucket ? std::size_t{1} : std::size_t{0};
  }
  return listed;
}

#if SPECDEC_DISPATCH_AVX512
SPECDEC_TARGET_AVX512 inline std::size_t list_bucket_avx512(const std::uint16_t* code,
                                                            const std::uint32_t* band,
                                                            std::size_t count, std::uint16_t bucket,
                                                            std::uint32_t* out) noexcept {
  const __m256i wanted = _mm256_set1_epi16(static_cast<short>(bucket));
  std::size_t listed = 0;
  std::size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(code + i));
    const __mmask16 match = _mm256_cmpeq_epi16_mask(codes, wanted);
    if (match == 0) continue;  // most packs: the bucket is one of some hundreds
    const __m512i ids = _mm512_loadu_si512(band + i);
    _mm512_storeu_si512(out + listed, _mm512_maskz_compress_epi32(match, ids));
    listed += static_cast<std::size_t>(std::popcount(static_cast<unsigned>(match)));
  }
  return list_bucket_body(code, band, i, count, bucket, out, listed);
}
#endif

/// list_bucket_body on the active kernel path (the same list everywhere).
inline std::size_t list_bucket(const std::uint16_t* code, const std::uint32_t* band,
                               std::size_t count, std::uint16_t bucket,
                               std::uint32_t* out) noexcept {
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) return list_bucket_avx512(code, band, count, bucket, out);
#endif
  return list_bucket_body(code, band, 0, count, bucket, out, 0);
}
SPECDEC_KERNELS_END

// The dispatchers' instances for float and double rows (specdec/kernel_instances.hpp).
#define SPECDEC_SAMPLING_PAIR_INSTANCES(prefix, U, T)                                             \
  prefix template void nucleus_keep<U, T>(const U*, const T*, T*, std::size_t, U, std::size_t,    \
                                          T) noexcept;                                            \
  prefix template nucleus_band_found nucleus_band<U, T>(const U*, const T*, std::size_t, U, U,    \
                                                        std::uint32_t*) noexcept;                 \
  prefix template void build_mass_table_dispatch<row_source<T>, nucleus_keep_hook<U, T>>(         \
      const row_source<T>&, mass_table&, nucleus_keep_hook<U, T>&) noexcept;                      \
  prefix template void band_codes<U, T>(                                                          \
      const U*, const T*, const std::uint32_t*, std::size_t,                                      \
      std::conditional_t<sizeof(U) == 8, std::uint64_t, std::uint32_t>, unsigned, std::uint16_t*, \
      T*, std::size_t) noexcept;                                                                  \
  prefix template void sample_runs<U, T>(const U*, const T*, std::size_t, std::size_t,            \
                                         std::size_t, std::int32_t, T*, std::uint16_t*,           \
                                         double*) noexcept;
#define SPECDEC_SAMPLING_ROW_INSTANCES(prefix, T)                                              \
  prefix template T block_maxima<true, T>(const T*, std::size_t, double*,                      \
                                          row_screen<T>*) noexcept;                            \
  prefix template T block_maxima<false, T>(const T*, std::size_t, double*,                     \
                                           row_screen<T>*) noexcept;                           \
  prefix template void nucleus_histogram<T>(const T*, std::size_t, std::int32_t, double*,      \
                                            std::uint16_t*) noexcept;                          \
  prefix template max_and_total<T> nucleus_max_total<T>(const T*, std::size_t) noexcept;       \
  prefix template double nucleus_total<T>(const T*, std::size_t) noexcept;                     \
  prefix template screened_band_found<T> nucleus_screened_band<T>(const T*, std::size_t, T, T, \
                                                                  std::uint32_t*) noexcept;    \
  SPECDEC_MASS_TABLE_INSTANCES(prefix, row_screen_hook<T>, T)                                  \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, nucleus_scaled_difference_source<T>, nucleus_screen_hook<T>)
#define SPECDEC_SAMPLING_INSTANCES(prefix)                            \
  SPECDEC_FOR_ROW_TYPE_PAIRS(SPECDEC_SAMPLING_PAIR_INSTANCES, prefix) \
  SPECDEC_FOR_ROW_TYPES(SPECDEC_SAMPLING_ROW_INSTANCES, prefix)
SPECDEC_DECLARE_KERNEL_INSTANCES(SPECDEC_SAMPLING_INSTANCES)

}  // namespace specdec::detail
