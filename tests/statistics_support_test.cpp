// Tests for include/specdec/statistics.hpp (through tests/support/statistics.hpp): the
// statistic every distribution test relies on, and its catalogue rows S1-S4.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include "errors_catalogue.hpp"
#include "specdec/error.hpp"
#include "specdec/statistics.hpp"
#include "support/statistics.hpp"

using specdec::testing::chi_square_critical_value;
using specdec::testing::chi_square_survival;

TEST_CASE("chi-square survival matches closed forms", "[support]") {
  // df = 2: P(X > x) = exp(-x / 2).  df = 1: P(X > x) = erfc(sqrt(x / 2)).
  for (double x : {0.1, 1.0, 5.0, 20.0, 41.0, 60.0}) {
    CHECK(chi_square_survival(x, 2.0) == Catch::Approx(std::exp(-x / 2.0)).epsilon(1e-12));
    CHECK(chi_square_survival(x, 1.0) ==
          Catch::Approx(std::erfc(std::sqrt(x / 2.0))).epsilon(1e-10));
  }
}

TEST_CASE("chi-square critical values", "[support]") {
  CHECK(chi_square_critical_value(2.0, 1e-9) ==
        Catch::Approx(-2.0 * std::log(1e-9)).epsilon(1e-10));
  CHECK(chi_square_critical_value(1.0, 0.05) == Catch::Approx(3.841458820694124).epsilon(1e-9));
  CHECK(chi_square_critical_value(10.0, 0.01) == Catch::Approx(23.20925115650).epsilon(1e-9));
  // Large df: the Wilson-Hilferty approximation is accurate to well under 1%.
  const double df = 5000.0;
  const double z = 5.997807;  // standard normal upper 1e-9 quantile
  const double wh = df * std::pow(1.0 - 2.0 / (9.0 * df) + z * std::sqrt(2.0 / (9.0 * df)), 3.0);
  CHECK(chi_square_critical_value(df, 1e-9) == Catch::Approx(wh).epsilon(2e-3));
}

TEST_CASE("chi_square_test pools small buckets and flags impossible outcomes", "[support]") {
  const std::vector<double> expected = {0.5, 0.3, 0.19999, 0.00001, 0.0};
  std::vector<std::uint64_t> observed = {5000, 3000, 2000, 0, 0};
  auto result = specdec::testing::chi_square_test(observed, expected);
  CHECK(result.passed());
  CHECK(result.buckets == 3);  // the tiny category joins the smallest regular bucket
  observed[4] = 1;
  result = specdec::testing::chi_square_test(observed, expected);
  CHECK(result.impossible_outcome);
  CHECK_FALSE(result.passed());
}

TEST_CASE("samples_to_detect gives enough samples to catch a 0.01 TV shift", "[support]") {
  const std::size_t n = specdec::testing::samples_to_detect(0.01, 9.0);
  // Expected counts of a uniform law on 10 categories vs one shifted by TV 0.01.
  std::vector<double> p(10, 0.1);
  std::vector<std::uint64_t> shifted(10);
  for (std::size_t i = 0; i < 10; ++i) {
    const double q = p[i] + (i == 0 ? 0.01 : (i == 1 ? -0.01 : 0.0));
    shifted[i] = static_cast<std::uint64_t>(std::llround(q * static_cast<double>(n)));
  }
  CHECK_FALSE(specdec::testing::chi_square_test(shifted, p).passed());
}

TEST_CASE("bucket_tokens: top tokens alone, the tail in groups of about equal mass", "[support]") {
  // Small laws: one bucket per token.
  const std::vector<double> small{0.5, 0.25, 0.25};
  CHECK(specdec::testing::bucket_tokens(small) == std::vector<std::size_t>{0, 1, 2});
  // 1000 tokens with mass proportional to 1 / (j + 1): 31 single buckets + 32 groups.
  std::vector<double> law(1000);
  for (std::size_t j = 0; j < law.size(); ++j) law[j] = 1.0 / static_cast<double>(j + 1);
  const double total = std::accumulate(law.begin(), law.end(), 0.0);
  for (double& w : law) w /= total;
  const auto bucket = specdec::testing::bucket_tokens(law);
  for (std::size_t j = 0; j < 31; ++j) CHECK(bucket[j] == j);  // the 31 most likely
  std::vector<double> mass(63, 0.0);
  for (std::size_t j = 0; j < law.size(); ++j) {
    REQUIRE(bucket[j] < 63);
    mass[bucket[j]] += law[j];
  }
  const double tail = std::accumulate(mass.begin() + 31, mass.end(), 0.0);
  for (std::size_t b = 31; b < 63; ++b) {
    CHECK(mass[b] > 0.0);
    CHECK(mass[b] < 3.0 * tail / 32.0);  // no group holds much more than its share
  }
}

// --- Catalogue rows S1-S4 (docs/errors.md): bad input to include/specdec/statistics.hpp ---

TEST_CASE("S1 chi_square_test, total_variation: lengths differ or are empty",
          "[errors][statistics]") {
  using specdec::errc;
  using specdec::testing::check_error;
  const std::vector<std::uint64_t> counts{3, 4, 5};
  const std::vector<double> law{0.5, 0.5};
  check_error(
      "S1", [&] { (void)specdec::stats::chi_square_test(counts, law); }, errc::invalid_size,
      "chi_square_test: 3 observed counts and 2 expected probabilities");
  check_error(
      "S1",
      [] {
        (void)specdec::stats::chi_square_test(std::span<const std::uint64_t>(),
                                              std::span<const double>());
      },
      errc::invalid_size, "chi_square_test: 0 observed counts");
  const std::vector<double> three{0.2, 0.3, 0.5};
  check_error(
      "S1", [&] { (void)specdec::stats::total_variation(law, three); }, errc::invalid_size,
      "total_variation: lengths 2 and 3 differ");
}

TEST_CASE("S2 chi_square_test: an expected probability negative, NaN or infinite",
          "[errors][statistics]") {
  using specdec::errc;
  using specdec::testing::check_error;
  const std::vector<std::uint64_t> counts{3, 4, 5};
  for (const double bad : {-0.25, std::nan(""), std::numeric_limits<double>::infinity()}) {
    const std::vector<double> law{0.5, 0.5 - bad, bad};
    check_error(
        "S2", [&] { (void)specdec::stats::chi_square_test(counts, law); },
        errc::invalid_probability, "chi_square_test: expected probability ");
  }
}

TEST_CASE("S3 chi_square_test: expected probabilities off 1 by more than 1e-9",
          "[errors][statistics]") {
  using specdec::errc;
  using specdec::testing::check_error;
  const std::vector<std::uint64_t> counts{3, 4, 5};
  const std::vector<double> law{0.25, 0.25, 0.25};
  check_error(
      "S3", [&] { (void)specdec::stats::chi_square_test(counts, law); }, errc::not_normalized,
      "chi_square_test: expected probabilities sum to 0.75, not 1 within 1e-9");
  const std::vector<double> almost{0.25, 0.25, 0.5 + 5e-10};
  CHECK(specdec::stats::chi_square_test(counts, almost).buckets >= 1);  // within the tolerance
}

TEST_CASE("S4 chi_square_survival, chi_square_critical_value, samples_to_detect: domain",
          "[errors][statistics]") {
  using specdec::errc;
  using specdec::testing::check_error;
  check_error(
      "S4", [] { (void)specdec::stats::chi_square_survival(1.0, 0.0); }, errc::domain,
      "upper_incomplete_gamma_q: needs a > 0 and x >= 0, got a = 0");
  check_error(
      "S4", [] { (void)specdec::stats::chi_square_survival(-1.0, 3.0); }, errc::domain,
      "upper_incomplete_gamma_q: needs a > 0 and x >= 0");
  for (const double tail : {0.0, 1.0, -1e-9, std::nan("")}) {
    check_error(
        "S4", [&] { (void)specdec::stats::chi_square_critical_value(3.0, tail); }, errc::domain,
        "chi_square_critical_value: needs df > 0 and a tail probability in (0, 1)");
  }
  check_error(
      "S4", [] { (void)specdec::stats::chi_square_critical_value(0.0, 1e-9); }, errc::domain,
      "chi_square_critical_value: needs df > 0");
  for (const double tv : {0.0, 1.5, std::nan("")}) {
    check_error(
        "S4", [&] { (void)specdec::stats::samples_to_detect(tv, 10.0); }, errc::domain,
        "samples_to_detect: tv = ");
  }
}
