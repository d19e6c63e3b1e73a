// Helpers shared by the sampler tests: sample sizes scaled down in sanitizer builds, and a
// generator that replays scripted 64-bit outputs so that a test controls every uniform a
// draw or a step sees.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "support/statistics.hpp"

namespace specdec::testing {

/// Sanitizer builds (-O1 with AddressSanitizer and UBSan instrumentation, about 10x slower)
/// run every statistical test on the same pairs and code paths with 1/4 of the samples
/// (power for a total-variation error of 0.02): they look for memory errors and
/// undefined behaviour. The optimised builds run the full sizes (power for 0.01).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr std::size_t sanitizer_divisor = 4;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr std::size_t sanitizer_divisor = 4;
#else
inline constexpr std::size_t sanitizer_divisor = 1;
#endif
#else
inline constexpr std::size_t sanitizer_divisor = 1;
#endif

/// samples_to_detect(tv, df) (statistics.hpp), divided by sanitizer_divisor in sanitizer
/// builds.
inline std::size_t scaled_samples_to_detect(double tv, std::size_t degrees_of_freedom) {
  return samples_to_detect(tv,
                           static_cast<double>(degrees_of_freedom > 1 ? degrees_of_freedom : 1)) /
         sanitizer_divisor;
}

/// A generator replaying given 64-bit outputs, to script the uniforms a draw or step sees.
struct ScriptedGenerator {
  using result_type = std::uint64_t;
  std::vector<std::uint64_t> outputs;
  std::size_t next = 0;
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return std::numeric_limits<result_type>::max(); }
  result_type operator()() { return outputs.at(next++); }
};

/// The raw output for which uniform01<double> returns exactly u (u a multiple of 2^-53).
inline std::uint64_t bits_for(double u) {
  return static_cast<std::uint64_t>(std::ldexp(u, 53)) << 11U;
}
/// The raw output giving the largest uniform, 1 - 2^-53.
inline constexpr std::uint64_t all_ones = ~std::uint64_t{0};
/// One step of 2^-53 in u.
inline constexpr std::uint64_t one_ulp = std::uint64_t{1} << 11U;

}  // namespace specdec::testing
