// specdec — private helpers of SpeculativeDecoder: the overlap sum_x min(p(x), q(x))
// behind the beta statistic, and the rethrow helpers that put a location on errors.
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

/// beta = sum_x min(p(x), q(x)) (paper Def. 3.1 / Thm. 3.5), summed like sum_in_double:
/// blocks in T lanes, block sums in double (vectorizes without -ffast-math).
template <class T>
[[nodiscard]] inline double overlap_mass(const T* target, const T* draft,
                                         std::size_t size) noexcept {
  double total = 0.0;
  std::size_t i = 0;
  for (; i + sampling_block <= size; i += sampling_block) {
    std::array<T, sampling_lanes> lanes{};
    for (std::size_t j = i; j < i + sampling_block; j += sampling_lanes) {
      for (std::size_t k = 0; k < sampling_lanes; ++k) {
        const T p = target[j + k];
        const T q = draft[j + k];
        lanes[k] += p < q ? p : q;
      }
    }
    total += static_cast<double>(reduce_sampling_lanes(lanes));
  }
  for (; i < size; ++i) total += static_cast<double>(target[i] < draft[i] ? target[i] : draft[i]);
  return total;
}

/// Fast screen of a probability row in one vectorizable pass: true if no entry has its
/// sign bit set and the sum is finite and within `tolerance` of 1, with a margin for
/// summation order (NaN and infinite entries make the sum NaN or infinite, so they fail
/// too). False means "let the full validator decide" (it names the problem, and accepts
/// -0.0). Sums as sum_in_double does.
template <class T>
[[nodiscard]] inline bool plausible_probability_row(const T* row, std::size_t size,
                                                    double tolerance) noexcept {
  constexpr std::size_t lanes = sampling_lanes;
  using bits = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
  std::array<bits, lanes> signs{};
  double total = 0.0;
  std::size_t i = 0;
  for (; i + sampling_block <= size; i += sampling_block) {
    // Two loops over the block (it stays in L1): each vectorizes on its own.
    std::array<T, lanes> sums{};
    for (std::size_t j = i; j < i + sampling_block; j += lanes) {
      for (std::size_t k = 0; k < lanes; ++k) sums[k] += row[j + k];
    }
    for (std::size_t j = i; j < i + sampling_block; j += lanes) {
      for (std::size_t k = 0; k < lanes; ++k) signs[k] |= std::bit_cast<bits>(row[j + k]);
    }
    total += static_cast<double>(reduce_sampling_lanes(sums));
  }
  for (; i < size; ++i) {
    signs[0] |= std::bit_cast<bits>(row[i]);
    total += static_cast<double>(row[i]);
  }
  bits any = 0;
  for (const bits value : signs) any |= value;
  constexpr bits sign_bit = bits{1} << (8 * sizeof(T) - 1);
  const double deviation = total > 1.0 ? total - 1.0 : 1.0 - total;  // NaN stays NaN
  return (any & sign_bit) == 0 && deviation <= tolerance * (1.0 - 1e-6);
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
