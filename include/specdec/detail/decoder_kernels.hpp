// specdec — private helpers of SpeculativeDecoder: the overlap sum_x min(p(x), q(x))
// behind the beta statistic, and the rethrow helpers that put a location on errors.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include "specdec/error.hpp"

namespace specdec::detail {

/// beta = sum_x min(p(x), q(x)) (paper Def. 3.1 / Thm. 3.5), accumulated in double in 8
/// independent lanes combined in a fixed order (vectorizes without -ffast-math).
template <class T>
[[nodiscard]] inline double overlap_mass(const T* target, const T* draft,
                                         std::size_t size) noexcept {
  constexpr std::size_t lanes = 8;
  std::array<double, lanes> sums{};
  std::size_t i = 0;
  for (; i + lanes <= size; i += lanes) {
    for (std::size_t k = 0; k < lanes; ++k) {
      const T p = target[i + k];
      const T q = draft[i + k];
      sums[k] += static_cast<double>(p < q ? p : q);
    }
  }
  for (; i < size; ++i) sums[0] += static_cast<double>(target[i] < draft[i] ? target[i] : draft[i]);
  return ((sums[0] + sums[4]) + (sums[2] + sums[6])) + ((sums[1] + sums[5]) + (sums[3] + sums[7]));
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
