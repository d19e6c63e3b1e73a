// Test support: the chi-square machinery of include/specdec/statistics.hpp under the name
// every statistical test of the library uses (specdec::testing), plus the bucketing of large
// vocabularies. One statistic for all tests, separately tested in
// tests/statistics_support_test.cpp.
//
// Usage:
//   auto result = specdec::testing::chi_square_test(observed_counts, expected_probabilities);
//   REQUIRE(result.passed());   // false-failure probability 1e-9 by default
//   INFO(result.describe());
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <vector>

#include "specdec/random.hpp"
#include "specdec/statistics.hpp"

namespace specdec::testing {

using namespace specdec::stats;  // NOLINT(google-build-using-namespace): one statistic

/// A standard normal draw (Box-Muller, one of the pair), for rows of Gaussian logits.
inline double standard_normal(xoshiro256pp& g) {
  const double u1 = uniform01<double>(g);
  const double u2 = uniform01<double>(g);
  return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2);
}

/// Groups tokens for a chi-square over a large vocabulary: the `individual` most likely
/// tokens get their own bucket, the rest are split in id order into `groups` buckets of
/// about equal mass. Returns the bucket of every token.
inline std::vector<std::size_t> bucket_tokens(const std::vector<double>& law,
                                              std::size_t individual = 31,
                                              std::size_t groups = 32) {
  std::vector<std::size_t> bucket(law.size(), 0);
  if (law.size() <= individual + groups) {
    std::iota(bucket.begin(), bucket.end(), 0);
    return bucket;
  }
  std::vector<std::size_t> order(law.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(individual),
                    order.end(), [&](std::size_t a, std::size_t b) { return law[a] > law[b]; });
  std::vector<bool> alone(law.size(), false);
  double rest = 1.0;
  for (std::size_t k = 0; k < individual; ++k) {
    bucket[order[k]] = k;
    alone[order[k]] = true;
    rest -= law[order[k]];
  }
  double running = 0.0;
  for (std::size_t j = 0; j < law.size(); ++j) {
    if (alone[j]) continue;
    const auto group =
        rest <= 0.0
            ? 0
            : std::min(groups - 1,
                       static_cast<std::size_t>(running / rest * static_cast<double>(groups)));
    bucket[j] = individual + group;
    running += law[j];
  }
  return bucket;
}

}  // namespace specdec::testing
