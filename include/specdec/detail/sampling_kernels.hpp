// specdec — private kernels behind standardization (sampling.hpp): sums in double with
// independent accumulators, argmax, and the order "more probable first, lower id first"
// that top-k and top-p use.
#pragma once

#include <Eigen/Core>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace specdec::detail {

/// Independent accumulators of the sampling kernels (no -ffast-math needed to vectorize).
inline constexpr std::size_t sampling_lanes = 16;
/// Entries summed in T before the partial sum is widened to double.
inline constexpr std::size_t sampling_block = 256;

/// Pairwise sum of the lanes in a fixed order.
template <class T>
[[nodiscard]] inline T reduce_sampling_lanes(std::array<T, sampling_lanes> lanes) noexcept {
  for (std::size_t width = sampling_lanes / 2; width != 0; width /= 2) {
    for (std::size_t k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  }
  return lanes[0];
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

/// Largest entry of a non-empty row (Eigen's vectorized reduction; with NaN entries the
/// result is unspecified, callers validate rows or propagate NaN otherwise).
template <class T>
[[nodiscard]] inline T max_entry(const T* row, std::size_t size) noexcept {
  return Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(row, static_cast<Eigen::Index>(size))
      .maxCoeff();
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

/// Strict total order on token ids of a row: higher probability first, lower id first
/// among equal probabilities. Top-k and top-p keep a prefix of this order.
template <class T>
struct more_probable_first {
  const T* row;
  [[nodiscard]] bool operator()(std::uint32_t a, std::uint32_t b) const noexcept {
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  }
};

/// In place x -> exp(x) (vectorized by Eigen) for exponents x <= 0 (NaN stays NaN).
/// Results below the smallest normal number, exp(-inf) included, become exactly 0: Eigen's
/// vectorized exp clamps its argument, so exp(-inf) would otherwise come out as a tiny
/// positive number and a zero probability would gain support. (Flushing subnormal weights
/// changes a probability by less than 1.2e-38 relative to the largest one, which is 1.)
template <class T>
inline void exponentiate_flushing(T* values, std::size_t size) noexcept {
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> x(values, static_cast<Eigen::Index>(size));
  x = x.exp();
  constexpr T smallest_normal = std::numeric_limits<T>::min();
  for (std::size_t j = 0; j < size; ++j) values[j] = values[j] < smallest_normal ? T(0) : values[j];
}

}  // namespace specdec::detail
