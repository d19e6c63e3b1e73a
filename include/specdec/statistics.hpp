// specdec — goodness-of-fit tools for checking that a sampler has the law it should:
// Pearson's chi-square test with its threshold set for a stated false-failure rate, the
// chi-square survival function and quantiles, total-variation distance, and the sample size
// that makes a given total-variation error detectable. specdec's own exactness tests use
// exactly these functions; researchers can use them the same way on their own models:
//
//   std::vector<std::uint64_t> counts(V);            // how often each token was drawn
//   ... run the decoder N times, count the first token ...
//   const auto result = specdec::stats::chi_square_test(counts, target_row);
//   if (!result.passed()) std::cerr << result.describe() << '\n';
//
// Sample sizes: with N draws, a deviation of total-variation distance d from the expected
// law gives a chi-square non-centrality of at least 4 N d^2 (Cauchy-Schwarz);
// `samples_to_detect(d, df)` returns an N for which such a deviation fails the test at the
// 1e-9 threshold with near certainty. Errors (specdec::error): errc::invalid_size for
// lengths that differ, errc::invalid_probability / errc::not_normalized for an expected
// law with a negative or non-finite entry or a sum off 1 by more than 1e-9, errc::domain for
// arguments outside a function's domain.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "specdec/error.hpp"

namespace specdec::stats {

/// Regularized upper incomplete gamma function Q(a, x) = Gamma(a, x) / Gamma(a), for
/// a > 0, x >= 0. Series for x < a + 1, Lentz continued fraction otherwise.
inline double upper_incomplete_gamma_q(double a, double x) {
  if (!(a > 0.0) || !(x >= 0.0)) {
    detail::throw_error(
        errc::domain, "upper_incomplete_gamma_q: needs a > 0 and x >= 0, got a = ", a, ", x = ", x);
  }
  if (x == 0.0) return 1.0;
  const double log_prefactor = -x + a * std::log(x) - std::lgamma(a);
  constexpr double eps = 1e-16;
  constexpr int max_iterations = 100000;
  if (x < a + 1.0) {
    double term = 1.0 / a;
    double sum = term;
    for (int n = 1; n < max_iterations; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::abs(term) < std::abs(sum) * eps) break;
    }
    return std::max(0.0, 1.0 - sum * std::exp(log_prefactor));
  }
  constexpr double tiny = 1e-300;
  double b = x + 1.0 - a;
  double c = 1.0 / tiny;
  double d = 1.0 / b;
  double h = d;
  for (int i = 1; i < max_iterations; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::abs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::abs(c) < tiny) c = tiny;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::abs(delta - 1.0) < eps) break;
  }
  return std::exp(log_prefactor) * h;
}

/// P(X > x) for X ~ chi-square with `df` degrees of freedom.
inline double chi_square_survival(double x, double df) {
  return upper_incomplete_gamma_q(df / 2.0, x / 2.0);
}

/// The x with P(X > x) = tail_probability, X ~ chi-square(df). Bisection to 1e-12 relative.
inline double chi_square_critical_value(double df, double tail_probability) {
  if (!(df > 0.0) || !(tail_probability > 0.0 && tail_probability < 1.0)) {
    detail::throw_error(errc::domain,
                        "chi_square_critical_value: needs df > 0 and a tail probability in "
                        "(0, 1), got df = ",
                        df, ", tail probability = ", tail_probability);
  }
  double lo = 0.0;
  double hi = std::max(1.0, df);
  while (chi_square_survival(hi, df) > tail_probability) hi *= 2.0;
  for (int i = 0; i < 200 && (hi - lo) > 1e-12 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (chi_square_survival(mid, df) > tail_probability ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

struct ChiSquareResult {
  double statistic = 0.0;
  std::size_t degrees_of_freedom = 0;
  double critical_value = 0.0;
  double p_value = 1.0;
  std::size_t samples = 0;
  std::size_t buckets = 0;
  bool impossible_outcome = false;  ///< a category with expected probability 0 was observed

  [[nodiscard]] bool passed() const { return !impossible_outcome && statistic <= critical_value; }

  [[nodiscard]] std::string describe() const {
    std::ostringstream out;
    out << "chi2 = " << statistic << ", df = " << degrees_of_freedom
        << ", critical = " << critical_value << ", p = " << p_value << ", N = " << samples
        << ", buckets = " << buckets << (impossible_outcome ? ", IMPOSSIBLE OUTCOME SEEN" : "");
    return out.str();
  }
};

/// Pearson chi-square goodness of fit of `observed` counts against `expected`
/// probabilities (same length; expected sums to 1 within 1e-9). Categories whose expected
/// count is below `min_expected` are pooled into one tail bucket (merged into the
/// smallest regular bucket if the pool is still too small). The threshold is the
/// chi-square quantile for `false_failure_rate`. Any observation of a category with
/// expected probability exactly 0 fails the test outright.
inline ChiSquareResult chi_square_test(std::span<const std::uint64_t> observed,
                                       std::span<const double> expected,
                                       double false_failure_rate = 1e-9,
                                       double min_expected = 5.0) {
  if (observed.size() != expected.size() || observed.empty()) {
    detail::throw_error(errc::invalid_size, "chi_square_test: ", observed.size(),
                        " observed counts and ", expected.size(),
                        " expected probabilities (need equal, non-zero lengths)");
  }
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (!(expected[i] >= 0.0) || !std::isfinite(expected[i])) {
      detail::throw_error(errc::invalid_probability, "chi_square_test: expected probability ", i,
                          " is ", expected[i]);
    }
  }
  const double total_probability = std::accumulate(expected.begin(), expected.end(), 0.0);
  if (std::abs(total_probability - 1.0) > 1e-9) {
    detail::throw_error(errc::not_normalized, "chi_square_test: expected probabilities sum to ",
                        total_probability, ", not 1 within 1e-9");
  }
  ChiSquareResult result;
  const std::uint64_t n = std::accumulate(observed.begin(), observed.end(), std::uint64_t{0});
  result.samples = static_cast<std::size_t>(n);
  const double samples = static_cast<double>(n);

  std::vector<double> bucket_expected;
  std::vector<double> bucket_observed;
  double pooled_expected = 0.0;
  double pooled_observed = 0.0;
  for (std::size_t i = 0; i < observed.size(); ++i) {
    if (expected[i] == 0.0) {
      if (observed[i] != 0) result.impossible_outcome = true;
      continue;
    }
    const double e = expected[i] * samples;
    if (e < min_expected) {
      pooled_expected += e;
      pooled_observed += static_cast<double>(observed[i]);
    } else {
      bucket_expected.push_back(e);
      bucket_observed.push_back(static_cast<double>(observed[i]));
    }
  }
  if (pooled_expected > 0.0) {
    if (pooled_expected >= min_expected || bucket_expected.empty()) {
      bucket_expected.push_back(pooled_expected);
      bucket_observed.push_back(pooled_observed);
    } else {
      const auto smallest = static_cast<std::size_t>(
          std::min_element(bucket_expected.begin(), bucket_expected.end()) -
          bucket_expected.begin());
      bucket_expected[smallest] += pooled_expected;
      bucket_observed[smallest] += pooled_observed;
    }
  }
  result.buckets = bucket_expected.size();
  for (std::size_t b = 0; b < bucket_expected.size(); ++b) {
    const double diff = bucket_observed[b] - bucket_expected[b];
    result.statistic += diff * diff / bucket_expected[b];
  }
  result.degrees_of_freedom = result.buckets > 1 ? result.buckets - 1 : 1;
  const auto df = static_cast<double>(result.degrees_of_freedom);
  result.critical_value = chi_square_critical_value(df, false_failure_rate);
  result.p_value = chi_square_survival(result.statistic, df);
  return result;
}

/// Number of samples for which a deviation of total variation `tv` from the expected law
/// gives a non-centrality (>= 4 N tv^2) of three times the distance between the 1e-9
/// critical value and the mean df: such a deviation is then caught with near certainty.
inline std::size_t samples_to_detect(double tv, double df, double false_failure_rate = 1e-9) {
  if (!(tv > 0.0 && tv <= 1.0)) {
    detail::throw_error(errc::domain, "samples_to_detect: tv = ", tv, " is outside (0, 1]");
  }
  const double excess = chi_square_critical_value(df, false_failure_rate) - df;
  return static_cast<std::size_t>(std::ceil(3.0 * excess / (4.0 * tv * tv)));
}

/// Total-variation distance between two probability vectors of equal length.
inline double total_variation(std::span<const double> a, std::span<const double> b) {
  if (a.size() != b.size()) {
    detail::throw_error(errc::invalid_size, "total_variation: lengths ", a.size(), " and ",
                        b.size(), " differ");
  }
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += std::abs(a[i] - b[i]);
  return 0.5 * sum;
}

}  // namespace specdec::stats
