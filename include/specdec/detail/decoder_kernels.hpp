// specdec — private helpers of SpeculativeDecoder: row validation fused into passes that
// read a row anyway, the overlap sum_x min(p(x), q(x)) behind the beta statistic, and the
// rethrow helpers that put a location on errors.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/error.hpp"

namespace specdec::detail {

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

  void add(const T* row, std::size_t count) noexcept {
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

  void add(const T* row, std::size_t count) noexcept {
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

/// Whether a row whose entries passed (or failed) a sign_screen and sum to `total` is
/// plausible (see sign_screen), with a margin on the tolerance for summation order.
[[nodiscard]] inline bool plausible_total(bool screen_passed, double total,
                                          double tolerance) noexcept {
  const double deviation = total > 1.0 ? total - 1.0 : 1.0 - total;  // NaN stays NaN
  return screen_passed && deviation <= tolerance * (1.0 - 1e-6);
}

/// A sign_screen and a lane_sum together: the screen of a row no other sum covers.
template <class T>
struct row_screen {
  sign_screen<T> signs;
  lane_sum<T> sum;

  void add(const T* row, std::size_t count) noexcept {
    signs.add(row, count);
    sum.add(row, count);
  }
  [[nodiscard]] double total() const noexcept { return sum.value(); }
  [[nodiscard]] bool plausible(double tolerance) const noexcept {
    return plausible_total(signs.passed(), total(), tolerance);
  }
};

/// The largest entry seen by a pass, block by block (lanes of running maxima; NaN entries
/// are passed over).
template <class T>
struct row_maximum {
  std::array<T, sampling_lanes> lanes;

  row_maximum() noexcept { lanes.fill(-std::numeric_limits<T>::infinity()); }

  void add(const T* row, std::size_t count) noexcept {
    const std::size_t full = count / sampling_lanes * sampling_lanes;
    for (std::size_t j = 0; j < full; j += sampling_lanes) {
      for (std::size_t k = 0; k < sampling_lanes; ++k) {
        lanes[k] = lanes[k] < row[j + k] ? row[j + k] : lanes[k];
      }
    }
    for (std::size_t j = full; j < count; ++j) {
      lanes[j - full] = lanes[j - full] < row[j] ? row[j] : lanes[j - full];
    }
  }

  [[nodiscard]] T value() const noexcept {
    T best = lanes[0];
    for (const T value : lanes) best = best < value ? value : best;
    return best;
  }
};

/// Fast screen of a probability row in one vectorizable pass (row_screen::plausible).
template <class T>
[[nodiscard]] inline bool plausible_probability_row(const T* row, std::size_t size,
                                                    double tolerance) noexcept {
  row_screen<T> screen;
  constexpr std::size_t block = 16 * sampling_lanes;  // 16 terms per T lane
  for (std::size_t i = 0; i < size; i += block) {
    screen.add(row + i, size - i < block ? size - i : block);
  }
  return screen.plausible(tolerance);
}

/// beta = sum_x min(p(x), q(x)) (paper Def. 3.1 / Thm. 3.5) with q = factor * draft (the
/// decoder keeps draft rows unnormalised; factor 1 multiplies nothing), summed like
/// lane_sum: T lanes per block of 16 terms each, widened into double lanes (vectorizes
/// without -ffast-math). With `Screen`, the target row is also screened into `screen`
/// while each block is in L1 (validation fused into the beta pass).
template <bool Screen, class T>
[[nodiscard]] inline double overlap_mass(const T* target, const T* draft, T factor,
                                         std::size_t size, row_screen<T>& screen) noexcept {
  constexpr std::size_t block = 16 * sampling_lanes;
  std::array<double, sampling_lanes> total{};
  for (std::size_t i = 0; i < size; i += block) {
    const std::size_t count = size - i < block ? size - i : block;
    const std::size_t full = count / sampling_lanes * sampling_lanes;
    std::array<T, sampling_lanes> lanes{};
    const T* p = target + i;
    const T* c = draft + i;
    if (factor == T(1)) {
      for (std::size_t j = 0; j < full; j += sampling_lanes) {
        for (std::size_t k = 0; k < sampling_lanes; ++k) {
          const T q = c[j + k];
          lanes[k] += p[j + k] < q ? p[j + k] : q;
        }
      }
    } else {
      for (std::size_t j = 0; j < full; j += sampling_lanes) {
        for (std::size_t k = 0; k < sampling_lanes; ++k) {
          const T q = factor * c[j + k];
          lanes[k] += p[j + k] < q ? p[j + k] : q;
        }
      }
    }
    for (std::size_t j = full; j < count; ++j) {
      const T q = factor * c[j];
      lanes[j - full] += p[j] < q ? p[j] : q;
    }
    for (std::size_t k = 0; k < sampling_lanes; ++k) total[k] += static_cast<double>(lanes[k]);
    if constexpr (Screen) screen.add(p, count);
  }
  return reduce_sampling_lanes(total);
}

/// The message of a specdec::error without the "specdec: <code>: " prefix error adds.
[[nodiscard]] inline std::string bare_message(const error& e) {
  const std::string_view text = e.what();
  std::string prefix = "specdec: ";
  prefix += to_string(e.code());
  prefix += ": ";
  if (text.substr(0, prefix.size()) == prefix) return std::string(text.substr(prefix.size()));
  return std::string(text);
}

}  // namespace specdec::detail
