// Tests for include/specdec/sampling.hpp: option checks, each step of the standardization
// against a brute-force reference (full sort, double precision), ties and edge cases
// (top-k >= V, top-p = 1, T -> 0, T = 0), logits vs probabilities, and LogitsModel.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "specdec/concepts.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/tree_verification.hpp"
#include "support/kernel_path_listener.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::SamplingOptions;
using specdec::token_id;

// Reference standardization in double with a full sort, written for clarity.
std::vector<double> reference_standardize(const std::vector<double>& p,
                                          const SamplingOptions& options) {
  const std::size_t size = p.size();
  std::vector<double> w(size, 0.0);
  if (options.temperature == 0.0) {
    const auto best = static_cast<std::size_t>(std::max_element(p.begin(), p.end()) - p.begin());
    w[best] = 1.0;
    return w;
  }
  const double maximum = *std::max_element(p.begin(), p.end());
  for (std::size_t j = 0; j < size; ++j) w[j] = std::pow(p[j] / maximum, 1.0 / options.temperature);
  std::vector<std::size_t> order;
  for (std::size_t j = 0; j < size; ++j) {
    if (w[j] > 0.0) order.push_back(j);
  }
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
  std::size_t kept = order.size();
  if (options.top_k != 0) kept = std::min(kept, options.top_k);
  if (options.top_p < 1.0) {
    double mass = 0.0;
    for (std::size_t i = 0; i < kept; ++i) mass += w[order[i]];
    double reached = 0.0;
    for (std::size_t i = 0; i < kept; ++i) {
      reached += w[order[i]];
      if (reached >= options.top_p * mass) {
        kept = i + 1;
        break;
      }
    }
  }
  const double top = w[order[0]];
  std::vector<double> out(size, 0.0);
  for (std::size_t i = 0; i < kept; ++i) {
    const std::size_t j = order[i];
    if (w[j] >= options.min_p * top) out[j] = w[j];
  }
  const double total = std::accumulate(out.begin(), out.end(), 0.0);
  for (double& x : out) x /= total;
  return out;
}

template <class T>
std::vector<T> random_row(std::size_t size, std::uint64_t seed, double zero_fraction = 0.0) {
  specdec::xoshiro256pp g(seed);
  std::vector<T> row(size);
  double total = 0.0;
  for (auto& x : row) {
    const double u = specdec::uniform01<double>(g);
    const double v = specdec::uniform01<double>(g);
    x = v < zero_fraction ? T(0) : static_cast<T>(std::exp(4.0 * u));  // spread of e^4
    total += static_cast<double>(x);
  }
  for (auto& x : row) x = static_cast<T>(static_cast<double>(x) / total);
  return row;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& row) {
  return {row.begin(), row.end()};
}

template <class T>
std::vector<T> standardized(const std::vector<T>& row, const SamplingOptions& options) {
  std::vector<T> out(row.size());
  specdec::Standardizer<T> standardizer(options);
  standardizer.apply(std::span<const T>(row), std::span<T>(out));
  return out;
}

template <class T>
std::vector<std::size_t> support(const std::vector<T>& row) {
  std::vector<std::size_t> ids;
  for (std::size_t j = 0; j < row.size(); ++j) {
    if (row[j] > T(0)) ids.push_back(j);
  }
  return ids;
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

void require_invalid_option(const SamplingOptions& options, const std::string& name) {
  try {
    options.validate();
    FAIL("validate() accepted an invalid " << name);
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::invalid_option);
    CHECK_THAT(e.what(), Catch::Matchers::ContainsSubstring(name));
  }
}

}  // namespace

TEST_CASE("SamplingOptions: defaults are the identity; bad values name the option", "[sampling]") {
  const SamplingOptions defaults;
  CHECK(defaults.identity());
  CHECK_FALSE(defaults.greedy());
  CHECK(SamplingOptions{.temperature = 0.0}.greedy());
  CHECK_FALSE(SamplingOptions{.top_k = 3}.identity());
  CHECK_FALSE(SamplingOptions{.top_p = 0.9}.identity());
  CHECK_FALSE(SamplingOptions{.min_p = 0.1}.identity());
  CHECK_FALSE(SamplingOptions{.temperature = 0.5}.identity());
  CHECK_NOTHROW(
      SamplingOptions{.temperature = 0.0, .top_k = 1, .top_p = 1.0, .min_p = 1.0}.validate());

  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  require_invalid_option({.temperature = -0.5}, "temperature");
  require_invalid_option({.temperature = nan}, "temperature");
  require_invalid_option({.temperature = inf}, "temperature");
  require_invalid_option({.top_p = 0.0}, "top_p");
  require_invalid_option({.top_p = 1.5}, "top_p");
  require_invalid_option({.top_p = nan}, "top_p");
  require_invalid_option({.min_p = -0.1}, "min_p");
  require_invalid_option({.min_p = 1.01}, "min_p");
  CHECK_THROWS_AS(specdec::Standardizer<float>(SamplingOptions{.top_p = 2.0}), specdec::error);
}

TEMPLATE_TEST_CASE("Standardizer: identity options copy the row (renormalized)", "[sampling]",
                   float, double) {
  const auto row = random_row<TestType>(37, 1);
  const auto out = standardized(row, SamplingOptions{});
  for (std::size_t j = 0; j < row.size(); ++j) {
    CHECK(static_cast<double>(out[j]) ==
          Catch::Approx(static_cast<double>(row[j])).epsilon(tolerance<TestType>()));
  }
}

TEMPLATE_TEST_CASE("Standardizer: temperature is the normalized power p^(1/T)", "[sampling]", float,
                   double) {
  const auto row = random_row<TestType>(101, 2, 0.2);
  for (const double temperature : {0.3, 0.7, 1.0, 1.5, 4.0}) {
    const SamplingOptions options{.temperature = temperature};
    const auto out = standardized(row, options);
    const auto expected = reference_standardize(to_double(row), options);
    for (std::size_t j = 0; j < row.size(); ++j) {
      CHECK(static_cast<double>(out[j]) ==
            Catch::Approx(expected[j]).margin(tolerance<TestType>()));
      if (row[j] == TestType(0)) CHECK(out[j] == TestType(0));  // zeros stay zero
    }
  }
}

TEMPLATE_TEST_CASE("Standardizer: temperature on logits equals the power on probabilities",
                   "[sampling]", float, double) {
  const auto row = random_row<TestType>(64, 3, 0.1);
  std::vector<TestType> logits(row.size());
  for (std::size_t j = 0; j < row.size(); ++j) {
    // log-probabilities shifted by an arbitrary constant; log(0) = -inf
    logits[j] = static_cast<TestType>(std::log(static_cast<double>(row[j])) + 17.0);
  }
  for (const double temperature : {0.25, 0.7, 1.0, 2.0}) {
    const SamplingOptions options{.temperature = temperature, .top_k = 40, .top_p = 0.9};
    const auto from_probabilities = specdec::standardize(row, options);
    const auto from_logits = specdec::standardize_logits(logits, options);
    REQUIRE(support(from_probabilities) == support(from_logits));
    for (std::size_t j = 0; j < row.size(); ++j) {
      CHECK(
          static_cast<double>(from_logits[j]) ==
          Catch::Approx(static_cast<double>(from_probabilities[j])).margin(tolerance<TestType>()));
    }
    // and both equal softmax(logits / T) computed directly
    std::vector<double> scaled(logits.size());
    for (std::size_t j = 0; j < logits.size(); ++j) {
      scaled[j] = static_cast<double>(logits[j]) / temperature;
    }
    std::vector<double> direct(scaled.size());
    specdec::softmax(std::span<const double>(scaled), std::span<double>(direct));
    const auto truncated = reference_standardize(direct, {.top_k = 40, .top_p = 0.9});
    for (std::size_t j = 0; j < logits.size(); ++j) {
      CHECK(static_cast<double>(from_logits[j]) ==
            Catch::Approx(truncated[j]).margin(tolerance<TestType>()));
    }
  }
}

TEMPLATE_TEST_CASE("Standardizer: T = 0 is one-hot at the lowest argmax; T -> 0 approaches it",
                   "[sampling]", float, double) {
  std::vector<TestType> row = {TestType(0.1), TestType(0.3), TestType(0.2), TestType(0.3),
                               TestType(0.1)};
  const auto greedy = standardized(row, {.temperature = 0.0, .top_k = 3, .top_p = 0.5});
  CHECK(greedy == std::vector<TestType>{0, 1, 0, 0, 0});  // ties: lowest id (1, not 3)

  // tiny T: ties at the maximum share the mass; everything else vanishes
  for (const double temperature : {1e-3, 1e-30, 1e-300}) {
    const auto cold = standardized(row, {.temperature = temperature});
    CHECK(static_cast<double>(cold[1]) == Catch::Approx(0.5));
    CHECK(static_cast<double>(cold[3]) == Catch::Approx(0.5));
    CHECK(static_cast<double>(cold[0]) < 1e-100);  // (1/3)^1000 underflows only in float
    CHECK(static_cast<double>(cold[2]) < 1e-100);
  }
  // unique maximum: tiny T approaches the one-hot argmax
  row[3] = TestType(0.29);
  const auto cold = standardized(row, {.temperature = 1e-3});
  CHECK(static_cast<double>(cold[1]) == Catch::Approx(1.0));
  CHECK(static_cast<double>(cold[3]) < 1e-12);
  // T so small that 1/T overflows: the limit is taken directly
  const auto frozen = standardized(row, {.temperature = std::numeric_limits<double>::denorm_min()});
  CHECK(frozen == std::vector<TestType>{0, 1, 0, 0, 0});
}

TEMPLATE_TEST_CASE("Standardizer: top-k keeps the k most probable, lower ids win ties",
                   "[sampling]", float, double) {
  const std::vector<TestType> row = {TestType(0.1), TestType(0.2),  TestType(0.2),
                                     TestType(0.2), TestType(0.05), TestType(0.25)};
  const auto top2 = standardized(row, {.top_k = 2});
  CHECK(support(top2) == std::vector<std::size_t>{1, 5});  // 0.25, then the first 0.2
  CHECK(static_cast<double>(top2[5]) == Catch::Approx(0.25 / 0.45));
  CHECK(support(standardized(row, {.top_k = 3})) == std::vector<std::size_t>{1, 2, 5});
  CHECK(support(standardized(row, {.top_k = 1})) == std::vector<std::size_t>{5});

  // k >= V and k >= number of non-zero entries: no-op
  const std::vector<TestType> sparse = {TestType(0.5), TestType(0), TestType(0.5)};
  CHECK(standardized(row, {.top_k = 6}) == row);
  CHECK(standardized(row, {.top_k = 1000}) == row);
  CHECK(standardized(sparse, {.top_k = 2}) == sparse);
  CHECK(standardized(sparse, {.top_k = 1}) == std::vector<TestType>{1, 0, 0});
}

TEMPLATE_TEST_CASE("Standardizer: top-p keeps the smallest prefix reaching p", "[sampling]", float,
                   double) {
  const std::vector<TestType> row = {TestType(0.125), TestType(0.25), TestType(0.5),
                                     TestType(0.125)};
  CHECK(support(standardized(row, {.top_p = 0.5})) == std::vector<std::size_t>{2});  // exactly p
  CHECK(support(standardized(row, {.top_p = 0.51})) == std::vector<std::size_t>{1, 2});
  CHECK(support(standardized(row, {.top_p = 0.75})) == std::vector<std::size_t>{1, 2});
  // the tie between ids 0 and 3 at 0.125: the lower id enters first
  CHECK(support(standardized(row, {.top_p = 0.8})) == std::vector<std::size_t>{0, 1, 2});
  CHECK(support(standardized(row, {.top_p = 1e-9})) == std::vector<std::size_t>{2});
  // p = 1: no-op, even for zero entries
  const std::vector<TestType> sparse = {TestType(0.25), TestType(0), TestType(0.75)};
  CHECK(standardized(sparse, {.top_p = 1.0}) == sparse);
}

TEMPLATE_TEST_CASE("Standardizer: min-p keeps tokens >= min_p * max", "[sampling]", float, double) {
  const std::vector<TestType> row = {TestType(0.1), TestType(0.4), TestType(0.2), TestType(0.3)};
  CHECK(support(standardized(row, {.min_p = 0.5})) == std::vector<std::size_t>{1, 2, 3});  // >= 0.2
  CHECK(support(standardized(row, {.min_p = 0.51})) == std::vector<std::size_t>{1, 3});
  CHECK(support(standardized(row, {.min_p = 1.0})) == std::vector<std::size_t>{1});
  const std::vector<TestType> tied = {TestType(0.4), TestType(0.2), TestType(0.4)};
  CHECK(support(standardized(tied, {.min_p = 1.0})) == std::vector<std::size_t>{0, 2});
}

TEMPLATE_TEST_CASE("Standardizer: combined settings match the full-sort reference", "[sampling]",
                   float, double) {
  // Large rows exercise the selection by halving in top-p (more than 32 candidates).
  specdec::xoshiro256pp g(11);
  specdec::Standardizer<TestType> standardizer(SamplingOptions{});
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t size = 1 + specdec::uniform_below(g, 3000);
    const auto row = random_row<TestType>(size, 100 + static_cast<std::uint64_t>(trial), 0.3);
    if (support(row).empty()) continue;
    SamplingOptions options;
    const std::uint64_t k_kind = specdec::uniform_below(g, 3);  // none, heap-sized, any
    options.top_k = k_kind == 0   ? 0
                    : k_kind == 1 ? 1 + specdec::uniform_below(g, size / 16 + 1)
                                  : specdec::uniform_below(g, size + 5);
    const double temperatures[] = {1.0, 1.0, 0.5, 1.7};
    options.temperature = temperatures[specdec::uniform_below(g, 4)];
    options.top_p = specdec::uniform_below(g, 4) == 0 ? 1.0 : specdec::uniform01<double>(g);
    if (options.top_p == 0.0) options.top_p = 0.5;
    options.min_p = specdec::uniform_below(g, 2) == 0 ? 0.0 : 0.2 * specdec::uniform01<double>(g);
    INFO("trial " << trial << " V = " << size << " T = " << options.temperature << " top_k = "
                  << options.top_k << " top_p = " << options.top_p << " min_p = " << options.min_p);
    standardizer = specdec::Standardizer<TestType>(options);
    std::vector<TestType> out(size);
    const double top = standardizer.apply(std::span<const TestType>(row), std::span<TestType>(out));
    const auto expected = reference_standardize(to_double(row), options);
    REQUIRE(support(out) == support(expected));
    double total = 0.0;
    for (std::size_t j = 0; j < size; ++j) {
      total += static_cast<double>(out[j]);
      CHECK(static_cast<double>(out[j]) ==
            Catch::Approx(expected[j]).margin(tolerance<TestType>()));
    }
    CHECK(total == Catch::Approx(1.0).margin(1e-5));
    CHECK(top == Catch::Approx(*std::max_element(expected.begin(), expected.end())));
  }
}

/// `out` (a standardized row) keeps the shortest prefix of the ranking of `row` (higher
/// first, lower id first among ties) whose mass reaches top_p of the row's (within `slack`
/// times the row's mass: sums in other orders), nothing else, normalised to 1.
template <class T>
void check_shortest_prefix(const std::vector<T>& row, const std::vector<T>& out, double top_p,
                           double slack = 1e-9) {
  const std::size_t size = row.size();
  std::vector<std::size_t> order;
  for (std::size_t j = 0; j < size; ++j) {
    if (row[j] > T(0)) order.push_back(j);
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  });
  std::size_t kept = 0;
  while (kept < order.size() && out[order[kept]] > T(0)) ++kept;
  REQUIRE(kept > 0);
  CHECK(support(out).size() == kept);  // nothing outside the prefix
  double mass = 0.0;
  double all = 0.0;
  for (std::size_t i = 0; i < order.size(); ++i) all += static_cast<double>(row[order[i]]);
  for (std::size_t i = 0; i < kept; ++i) mass += static_cast<double>(row[order[i]]);
  const double last = static_cast<double>(row[order[kept - 1]]);
  CHECK(mass >= top_p * all - slack * all);
  CHECK(mass - last < top_p * all + slack * all);
  // The kept weights are the row's, normalised by the kept mass.
  double kept_total = 0.0;
  for (const T x : out) kept_total += static_cast<double>(x);
  CHECK(kept_total == Catch::Approx(1.0).epsilon(1e-5));
}

TEMPLATE_TEST_CASE("Standardizer: top-p on long rows of every shape keeps the shortest prefix",
                   "[sampling]", float, double) {
  // The histogram, collection and masking kernels of top-p work on chunks of 64 entries
  // (dispatched per kernel path): long rows whose weights span many binades (beyond the 64
  // binades of the histogram's buckets, so the clamped last bucket holds mass), flat rows,
  // one dominant token, many exact ties and zeros, heavy log-normal tails (the nucleus holds
  // about a tenth of the tokens). The kept set must be a prefix of the ranking (higher
  // first, lower id first among ties) whose mass reaches top_p, and one token shorter must
  // not; the kept weights are the row's, normalised.
  using T = TestType;
  specdec::xoshiro256pp g(2027);
  for (int trial = 0; trial < 60; ++trial) {
    const std::size_t size =
        64 * (1 + specdec::uniform_below(g, 500)) + specdec::uniform_below(g, 64);
    const int shape = trial % 5;
    std::vector<T> row(size);
    for (std::size_t j = 0; j < size; ++j) {
      const double u = specdec::uniform01<double>(g);
      double x = 0.0;
      switch (shape) {
        case 0:  // 2^0 .. 2^-90 (float: below 2^-64 of the top the last bucket takes all)
          x = std::exp2(-90.0 * u);
          break;
        case 1:  // nearly flat
          x = 1.0 + 0.01 * u;
          break;
        case 2:  // eight levels: exact ties everywhere, a quarter zero
          x = std::floor(8.0 * u) / 8.0;
          break;
        case 3:  // Gaussian-logit softmax shape
          x = std::exp(6.0 * (u - 1.0) * (u + 0.5));
          break;
        default:  // heavy log-normal tail: the nucleus holds about a tenth of the tokens
          x = std::exp(2.5 * specdec::testing::standard_normal(g));
      }
      row[j] = static_cast<T>(x);
    }
    if (shape == 3) row[specdec::uniform_below(g, size)] = T(1e4);  // one dominant token
    row[specdec::uniform_below(g, size)] = T(2);                    // a positive maximum
    double total = 0.0;
    for (const T x : row) total += static_cast<double>(x);
    for (auto& x : row) x = static_cast<T>(static_cast<double>(x) / total);
    const double top_p = shape == 4 ? 0.9 : 0.05 + 0.9 * specdec::uniform01<double>(g);
    INFO("trial " << trial << ", shape " << shape << ", V = " << size << ", top_p " << top_p);
    const auto out = standardized(row, {.top_p = top_p});
    check_shortest_prefix(row, out, top_p);
  }
}

/// Normalises `row` (weights) to 1, standardizes it with `standardizer` (top-p 0.9 at
/// `temperature`) and checks that the kept set is the shortest prefix of its tempered weights.
template <class T>
void check_long_row_nucleus(specdec::Standardizer<T>& standardizer, std::vector<T>& row,
                            double temperature) {
  const std::size_t size = row.size();
  double total = 0.0;
  for (const T x : row) total += static_cast<double>(x);
  for (auto& x : row) x = static_cast<T>(static_cast<double>(x) / total);
  std::vector<T> out(size);
  standardizer.apply(std::span<const T>(row), std::span<T>(out));
  std::vector<T> weights(size);  // the tempered weights, as a T = 1 row
  for (std::size_t j = 0; j < size; ++j) {
    weights[j] = static_cast<T>(std::pow(static_cast<double>(row[j]), 1.0 / temperature));
  }
  check_shortest_prefix(weights, out, 0.9, temperature == 1.0 ? 1e-9 : 1e-5);
}

TEMPLATE_TEST_CASE("Standardizer: top-p from a sample places the nucleus of long rows",
                   "[sampling]", float, double) {
  // Rows of at least 4096 probabilities find the nucleus from a sample of 2048 entries (in
  // evenly spaced runs), which places its end in a band; only the band is ranked. On the rows of
  // language models (softmax of Gaussian logits, log-normal tails, one dominant token or a dominant
  // pair) the band must hold the end: no row may need the full histogram (a band placed wrongly
  // would pass every other test through that fallback), and the kept set is the shortest prefix.
  using T = TestType;
  specdec::xoshiro256pp g(4099);
  for (const double temperature : {1.0, 0.7}) {
    specdec::Standardizer<T> standardizer({.temperature = temperature, .top_p = 0.9});
    for (int trial = 0; trial < 24; ++trial) {
      const std::size_t size = 4096 + specdec::uniform_below(g, 130000);
      const double spread = 1.0 + 0.25 * static_cast<double>(trial % 8);
      std::vector<T> row(size);
      for (auto& x : row) {
        x = static_cast<T>(std::exp(spread * specdec::testing::standard_normal(g)));
      }
      if (trial % 3 == 2) row[specdec::uniform_below(g, size)] = T(3e4);  // one dominant token
      if (trial % 3 == 1) {
        // A dominant pair (as a draft row whose two tokens' logits were moved 1 and 2
        // above the largest): the sample rarely holds either.
        const T largest = *std::max_element(row.begin(), row.end());
        row[specdec::uniform_below(g, size)] = static_cast<T>(largest * std::exp(2.0));
        row[specdec::uniform_below(g, size)] = static_cast<T>(largest * std::exp(1.0));
      }
      INFO("T = " << temperature << ", trial " << trial << ", V = " << size);
      check_long_row_nucleus(standardizer, row, temperature);
    }
    CHECK(standardizer.nucleus_fallbacks() == 0);
  }
}

TEMPLATE_TEST_CASE(
    "Standardizer: top-p's sample holds on rows whose neighbouring ids move together", "[sampling]",
    float, double) {
  // The sample reads runs of adjacent entries (one cache line each). Vocabularies order
  // related tokens together, so neighbouring probabilities can move together; a run then
  // tells less than as many scattered entries, and the band's standard error must come
  // from the spread between runs, not from the entries as if independent (that band is
  // too narrow on these rows: 8 of these 96 rows missed the end of the nucleus with it).
  // Rows: blocks of 64 ids sharing a log-normal level, times a log-normal factor per entry;
  // no row may need the full histogram, and the kept set is the shortest prefix.
  using T = TestType;
  specdec::xoshiro256pp g(4133);
  for (const double temperature : {1.0, 0.7}) {
    specdec::Standardizer<T> standardizer({.temperature = temperature, .top_p = 0.9});
    for (int trial = 0; trial < 24; ++trial) {
      const std::size_t size = 4096 + specdec::uniform_below(g, 130000);
      std::vector<T> row(size);
      double level = 0.0;
      for (std::size_t j = 0; j < size; ++j) {
        if (j % 64 == 0) level = 2.0 * specdec::testing::standard_normal(g);
        row[j] = static_cast<T>(std::exp(level + 0.5 * specdec::testing::standard_normal(g)));
      }
      INFO("T = " << temperature << ", trial " << trial << ", V = " << size);
      check_long_row_nucleus(standardizer, row, temperature);
    }
    CHECK(standardizer.nucleus_fallbacks() == 0);
  }
}

TEMPLATE_TEST_CASE("Standardizer: top-p falls back to the full histogram when the sample misleads",
                   "[sampling]", float, double) {
  // The sample is 2048 entries in runs of one cache line (64 / sizeof(T) entries), one run
  // from the middle of each of 2048 / run equal stretches, rounded down to a multiple of the
  // run (sampling.hpp, take_sample). Rows whose sampled entries are unrepresentative:
  //  - all tiny: the sample sees none of the row's mass, so the first band sits at the
  //    top, above the end of the nucleus. Every entry above the sampled ones is then listed
  //    exactly (heavy_retry), and the second band holds the end: nucleus_retries() counts
  //    the row, nucleus_fallbacks() does not;
  //  - all equal and moderately small: the sample sees a heavy tail at one level, which the
  //    listed entries above it do not correct, so both bands miss and the full histogram
  //    runs (nucleus_fallbacks() counts the row).
  // Each row must be found out (the end not in the band) and still give the shortest prefix.
  using T = TestType;
  specdec::xoshiro256pp g(4111);
  specdec::Standardizer<T> standardizer({.top_p = 0.9});
  constexpr int trials = 16;
  for (int trial = 0; trial < trials; ++trial) {
    const std::size_t size = 4096 + specdec::uniform_below(g, 60000);
    std::vector<T> row(size);
    for (auto& x : row) x = static_cast<T>(std::exp(2.5 * specdec::testing::standard_normal(g)));
    constexpr std::size_t run = 64 / sizeof(T);
    const std::size_t spacing = size / (2048 / run);
    const bool tiny = trial % 2 == 0;
    const T planted = tiny ? T(1e-30) : T(4.5);  // the log-normal mean is about 22.7
    for (std::size_t c = 0; c < 2048 / run; ++c) {
      const std::size_t start = (c * spacing + spacing / 2) / run * run;
      std::fill_n(row.begin() + static_cast<std::ptrdiff_t>(start), run, planted);
    }
    double total = 0.0;
    for (const T x : row) total += static_cast<double>(x);
    for (auto& x : row) x = static_cast<T>(static_cast<double>(x) / total);
    std::vector<T> out(size);
    const std::size_t fallbacks = standardizer.nucleus_fallbacks();
    const std::size_t retries = standardizer.nucleus_retries();
    standardizer.apply(std::span<const T>(row), std::span<T>(out));
    INFO("trial " << trial << ", V = " << size);
    check_shortest_prefix(row, out, 0.9);
    CHECK(standardizer.nucleus_retries() == retries + (tiny ? 1 : 0));
    CHECK(standardizer.nucleus_fallbacks() == fallbacks + (tiny ? 0 : 1));
  }
}

TEMPLATE_TEST_CASE(
    "Standardizer: top-p places the nucleus of rows where a few tokens hold the mass", "[sampling]",
    float, double) {
  // A language model's row often gives most of its mass to a few tokens. A sample of 2048
  // entries rarely holds them, and its estimate puts their mass in the top bucket wherever
  // they lie, so the first band misses the end whenever they lie in different buckets (a
  // row of 0.7 and 0.25 at T = 1; 0.5 and 0.3 at T = 0.7). The entries above every sampled
  // one are then listed exactly and the second band holds the end: no row may need the
  // full histogram, the kept set is the shortest prefix, and the second band must have run
  // (nucleus_retries()). Two to five heavy tokens holding 30% to 99% of the mass, on
  // log-normal rows, at T = 1 and 0.7.
  using T = TestType;
  specdec::xoshiro256pp g(4157);
  for (const double temperature : {1.0, 0.7}) {
    specdec::Standardizer<T> standardizer({.temperature = temperature, .top_p = 0.9});
    for (int trial = 0; trial < 32; ++trial) {
      const std::size_t size = 4096 + specdec::uniform_below(g, 130000);
      std::vector<double> light(size);
      double light_total = 0.0;
      for (auto& x : light) {
        x = std::exp(2.5 * specdec::testing::standard_normal(g));
        light_total += x;
      }
      const std::size_t heavy = 2 + specdec::uniform_below(g, 4);
      // Half the rows end the nucleus among the heavy tokens, half among the others.
      const double heavy_mass = trial % 2 == 0 ? 0.9 + 0.09 * specdec::uniform01<double>(g)
                                               : 0.3 + 0.6 * specdec::uniform01<double>(g);
      std::vector<double> share(heavy);
      double shares = 0.0;
      for (auto& x : share) {
        x = std::exp(1.5 * specdec::testing::standard_normal(g));
        shares += x;
      }
      std::vector<T> row(size);
      for (std::size_t j = 0; j < size; ++j) {
        row[j] = static_cast<T>((1.0 - heavy_mass) * light[j] / light_total);
      }
      for (std::size_t k = 0; k < heavy; ++k) {
        row[specdec::uniform_below(g, size)] = static_cast<T>(heavy_mass * share[k] / shares);
      }
      INFO("T = " << temperature << ", trial " << trial << ", V = " << size << ", " << heavy
                  << " heavy tokens holding " << heavy_mass);
      check_long_row_nucleus(standardizer, row, temperature);
    }
    CHECK(standardizer.nucleus_fallbacks() == 0);
    CHECK(standardizer.nucleus_retries() > 0);
    UNSCOPED_INFO("T = " << temperature << ": " << standardizer.nucleus_retries()
                         << " of 32 rows placed by the second band");
  }
}

TEMPLATE_TEST_CASE("Standardizer: top-p at T = 1 on long rows whose mass is far from 1",
                   "[sampling]", float, double) {
  // At T = 1 the sample places the band before any pass, as for a row of mass 1 (a
  // validated row's), so that the row's maximum, mass and screen come from the band's pass.
  // Rows of mass 1e-3 or 1e3 (unvalidated rows of weights) put the end of the nucleus far
  // from that band: the search must run again knowing the mass, find the band from the
  // sample then (no full histogram: nucleus_fallbacks() stays 0), and keep the shortest
  // prefix; the screen reports the row's own mass. A first pass that gave up on such rows
  // instead of searching again fails the prefix check.
  using T = TestType;
  specdec::xoshiro256pp g(4127);
  specdec::Standardizer<T> standardizer({.top_p = 0.9});
  for (int trial = 0; trial < 12; ++trial) {
    const std::size_t size = 4096 + specdec::uniform_below(g, 60000);
    std::vector<T> row(size);
    for (auto& x : row) x = static_cast<T>(std::exp(2.5 * specdec::testing::standard_normal(g)));
    const double mass = trial % 2 == 0 ? 1e-3 : 1e3;
    double total = 0.0;
    for (const T x : row) total += static_cast<double>(x);
    for (auto& x : row) x = static_cast<T>(static_cast<double>(x) * mass / total);
    std::vector<T> out(size);
    specdec::detail::first_pass_screen screen;
    standardizer.apply(std::span<const T>(row), std::span<T>(out), &screen);
    INFO("trial " << trial << ", V = " << size << ", mass " << mass);
    check_shortest_prefix(row, out, 0.9);
    CHECK(screen.signs_passed);
    CHECK(screen.total == Catch::Approx(mass).epsilon(1e-6));
  }
  CHECK(standardizer.nucleus_fallbacks() == 0);
}

/// apply_sparse on `row` gives exactly the non-zero entries apply() writes for `dense_row`
/// (the same row, or its valid twin): the same ids in increasing order, bitwise the same
/// weights and top probability.
template <class T>
void check_sparse_is_dense(specdec::Standardizer<T>& standardizer, const std::vector<T>& row,
                           const std::vector<T>& dense_row) {
  const std::size_t size = row.size();
  const std::size_t top_k = standardizer.options().top_k;
  std::vector<T> dense(size);
  const double dense_top = standardizer.apply(std::span<const T>(dense_row), std::span<T>(dense));
  std::vector<T> scratch(size, std::numeric_limits<T>::quiet_NaN());
  std::vector<std::uint32_t> ids(top_k);
  std::vector<T> weights(top_k);
  double sparse_top = -1.0;
  const std::size_t count = standardizer.apply_sparse(
      std::span<const T>(row), std::span<T>(scratch), ids.data(), weights.data(), sparse_top);
  std::vector<std::uint32_t> expected_ids;
  for (std::size_t j = 0; j < size; ++j) {
    if (dense[j] > T(0)) expected_ids.push_back(static_cast<std::uint32_t>(j));
  }
  REQUIRE(count == expected_ids.size());
  CHECK(std::vector<std::uint32_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(count)) ==
        expected_ids);
  for (std::size_t k = 0; k < count; ++k) CHECK(weights[k] == dense[ids[k]]);
  CHECK(sparse_top == dense_top);
}

TEMPLATE_TEST_CASE("Standardizer: apply_sparse gives apply's non-zero entries bitwise",
                   "[sampling]", float, double) {
  // The decoder keeps top-k rows as their survivors: the ids in increasing order and the
  // weights must be exactly the non-zero entries of the dense row, for every temperature
  // (1, others, the T -> 0 limit), with top-p and min-p after top-k, ties and zero rows;
  // the scratch row is read only where apply_sparse wrote (garbage elsewhere is harmless).
  specdec::xoshiro256pp g(17);
  for (int trial = 0; trial < 400; ++trial) {
    const std::size_t size = 2 + specdec::uniform_below(g, 3000);
    auto row = random_row<TestType>(size, 500 + static_cast<std::uint64_t>(trial), 0.3);
    if (trial % 7 == 0) {  // ties: a few equal values
      for (std::size_t j = 0; j < size; j += 3) row[j] = row[0];
    }
    if (trial % 50 == 1) std::fill(row.begin(), row.end(), TestType(0));
    SamplingOptions options;
    options.top_k =
        1 + specdec::uniform_below(g, specdec::uniform_below(g, 2) == 0 ? size / 16 + 1 : size - 1);
    const double temperatures[] = {1.0, 0.5, 1.7, 1e-300};
    options.temperature = temperatures[specdec::uniform_below(g, 4)];
    options.top_p =
        specdec::uniform_below(g, 3) == 0 ? 1.0 : 0.05 + 0.95 * specdec::uniform01<double>(g);
    options.min_p = specdec::uniform_below(g, 2) == 0 ? 0.0 : 0.3 * specdec::uniform01<double>(g);
    INFO("trial " << trial << " V = " << size << " T = " << options.temperature << " top_k = "
                  << options.top_k << " top_p = " << options.top_p << " min_p = " << options.min_p);
    specdec::Standardizer<TestType> standardizer(options);
    REQUIRE(standardizer.sparse_for(size));
    check_sparse_is_dense(standardizer, row, row);
  }
  // Rows with top_k >= V, or greedy, are not sparse.
  CHECK_FALSE(specdec::Standardizer<TestType>(SamplingOptions{.top_k = 8}).sparse_for(8));
  CHECK_FALSE(specdec::Standardizer<TestType>(SamplingOptions{.top_k = 0}).sparse_for(8));
  CHECK_FALSE(specdec::Standardizer<TestType>(SamplingOptions{.temperature = 0.0, .top_k = 2})
                  .sparse_for(8));
}

TEMPLATE_TEST_CASE("Standardizer: apply_sparse on long rows keeps apply's survivors bitwise",
                   "[sampling]", float, double) {
  // On rows of many blocks, apply_sparse ranks only the blocks whose maximum reaches a guess
  // taken from every 8th block, and all blocks when fewer than k reach it. Shapes: log-normal
  // (the guess holds), ascending (the large entries cluster at the end), large entries only
  // in the sampled blocks (fewer than k blocks reach the guess: the fallback), one value
  // everywhere (every block ties), and a few NaN entries (never selected; no validation).
  specdec::xoshiro256pp g(23);
  for (int trial = 0; trial < 60; ++trial) {
    const std::size_t size = 4096 + specdec::uniform_below(g, 60000);
    const int shape = trial % 5;
    std::vector<TestType> row(size);
    for (std::size_t j = 0; j < size; ++j) {
      double value = std::exp(2.5 * specdec::testing::standard_normal(g));
      if (shape == 1) value = 1.0 + static_cast<double>(j) * 1e-3;
      if (shape == 2) value = (j / 64) % 8 == 0 ? 10.0 + value : 1e-3 * value;
      if (shape == 3) value = 1.0;
      row[j] = static_cast<TestType>(value);
    }
    if (shape == 4) {
      for (std::size_t j = 7; j < size; j += 997)
        row[j] = std::numeric_limits<TestType>::quiet_NaN();
    }
    const std::size_t ks[] = {1, 5, 50, 300};
    SamplingOptions options;
    options.top_k = ks[static_cast<std::size_t>(trial / 5) % 4];
    options.temperature = trial % 2 == 0 ? 1.0 : 0.7;
    options.top_p = trial % 3 == 0 ? 0.9 : 1.0;
    INFO("trial " << trial << " shape " << shape << " V = " << size
                  << " top_k = " << options.top_k);
    specdec::Standardizer<TestType> standardizer(options);
    REQUIRE(standardizer.sparse_for(size));
    std::vector<TestType> clean = row;  // apply() needs a valid row: NaN entries as zeros
    for (TestType& x : clean) x = x == x ? x : TestType(0);
    check_sparse_is_dense(standardizer, row, clean);
  }
}

TEMPLATE_TEST_CASE("Standardizer: logits follow the same reference", "[sampling]", float, double) {
  specdec::xoshiro256pp g(12);
  for (int trial = 0; trial < 100; ++trial) {
    const std::size_t size = 1 + specdec::uniform_below(g, 2000);
    const auto row = random_row<double>(size, 500 + static_cast<std::uint64_t>(trial), 0.2);
    if (support(row).empty()) continue;
    std::vector<TestType> logits(size);
    std::vector<double> rounded(size);  // the probabilities the float logits stand for
    for (std::size_t j = 0; j < size; ++j) {
      logits[j] = static_cast<TestType>(std::log(row[j]) - 3.0);
      rounded[j] = std::exp(static_cast<double>(logits[j]));
    }
    SamplingOptions options;
    options.temperature = specdec::uniform_below(g, 2) == 0 ? 1.0 : 0.6;
    options.top_k = specdec::uniform_below(g, 2) == 0 ? 0 : 1 + specdec::uniform_below(g, size);
    options.top_p =
        specdec::uniform_below(g, 2) == 0 ? 1.0 : 0.05 + 0.9 * specdec::uniform01<double>(g);
    options.min_p = specdec::uniform_below(g, 2) == 0 ? 0.0 : 0.1 * specdec::uniform01<double>(g);
    INFO("trial " << trial << " V = " << size << " T = " << options.temperature << " top_k = "
                  << options.top_k << " top_p = " << options.top_p << " min_p = " << options.min_p);
    const auto out = specdec::standardize_logits(logits, options);
    const auto expected = reference_standardize(rounded, options);
    REQUIRE(support(out) == support(expected));
    for (std::size_t j = 0; j < size; ++j) {
      CHECK(static_cast<double>(out[j]) ==
            Catch::Approx(expected[j]).margin(tolerance<TestType>()));
    }
  }
}

TEMPLATE_TEST_CASE("Standardizer: double rows into float output", "[sampling]", float, double) {
  const auto row = random_row<double>(50, 5);
  const SamplingOptions options{.temperature = 0.8, .top_k = 10};
  specdec::Standardizer<TestType> standardizer(options);
  std::vector<TestType> out(row.size());
  standardizer.apply(std::span<const double>(row), std::span<TestType>(out));
  const auto expected = reference_standardize(row, options);
  for (std::size_t j = 0; j < row.size(); ++j) {
    CHECK(static_cast<double>(out[j]) == Catch::Approx(expected[j]).margin(tolerance<TestType>()));
  }
}

TEMPLATE_TEST_CASE("softmax is stable for large and -inf logits", "[sampling]", float, double) {
  const TestType inf = std::numeric_limits<TestType>::infinity();
  const std::vector<TestType> logits = {TestType(1000), TestType(1001), -inf, TestType(999)};
  std::vector<TestType> out(logits.size());
  specdec::softmax(std::span<const TestType>(logits), std::span<TestType>(out));
  const double e1 = std::exp(-1.0);
  const double e2 = std::exp(-2.0);
  const double total = 1.0 + e1 + e2;
  CHECK(static_cast<double>(out[1]) == Catch::Approx(1.0 / total));
  CHECK(static_cast<double>(out[0]) == Catch::Approx(e1 / total));
  CHECK(static_cast<double>(out[3]) == Catch::Approx(e2 / total));
  CHECK(out[2] == TestType(0));

  const std::vector<TestType> impossible = {-inf, -inf};
  std::vector<TestType> zero(2, TestType(7));
  specdec::softmax(std::span<const TestType>(impossible), std::span<TestType>(zero));
  CHECK(zero == std::vector<TestType>{0, 0});
}

namespace {

struct LogitsOnly {
  std::vector<float> logits = {0.0F, 1.0F, 2.0F};
  std::size_t vocab_size() const { return logits.size(); }
  std::span<const float> next_token_logits(std::span<const token_id>) { return logits; }
};

struct BatchedLogits : LogitsOnly {
  std::vector<double> storage;
  specdec::RowsView<const double> score_draft_logits(std::span<const token_id>,
                                                     std::span<const token_id> draft) {
    storage.clear();
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      for (std::size_t j = 0; j < 3; ++j) storage.push_back(static_cast<double>(i * j));
    }
    return {storage.data(), draft.size() + 1, 3};
  }
};

// Tree logits: node i's row is i * (0, 1, 2), i = 0 the root.
struct TreeLogits : LogitsOnly {
  std::vector<float> storage;
  specdec::RowsView<const float> score_tree_logits(std::span<const token_id>,
                                                   const specdec::TokenTreeView& tree) {
    storage.clear();
    for (std::size_t i = 0; i < tree.size(); ++i) {
      for (std::size_t j = 0; j < 3; ++j) storage.push_back(static_cast<float>(i * j));
    }
    return {storage.data(), tree.size(), 3};
  }
};

}  // namespace

TEST_CASE("LogitsModel forwards token-tree scoring as a TreeScoringModel", "[sampling]") {
  STATIC_REQUIRE(specdec::HasTreeLogitsScoring<TreeLogits, specdec::TokenTreeView>);
  STATIC_REQUIRE_FALSE(specdec::HasTreeLogitsScoring<LogitsOnly, specdec::TokenTreeView>);
  STATIC_REQUIRE(specdec::TreeScoringModel<specdec::LogitsModel<TreeLogits>>);
  STATIC_REQUIRE_FALSE(specdec::TreeScoringModel<specdec::LogitsModel<LogitsOnly>>);
  STATIC_REQUIRE_FALSE(specdec::BatchedLanguageModel<specdec::LogitsModel<TreeLogits>>);

  TreeLogits model;
  const std::vector<token_id> tokens = {specdec::no_token, 1, 2, 0};
  const std::vector<std::size_t> parents = {specdec::TokenTreeView::npos, 0, 0, 1};
  const std::vector<std::size_t> depths = {0, 1, 1, 2};
  const specdec::TokenTreeView tree{tokens, parents, depths};
  specdec::LogitsModel adapter(model);
  const auto rows = adapter.score_tree({}, tree);
  REQUIRE(rows.rows() == 4);
  REQUIRE(rows.cols() == 3);
  for (std::size_t i = 0; i < 4; ++i) {
    const std::vector<float> logits = {0.0F, static_cast<float>(i), static_cast<float>(2 * i)};
    std::vector<float> expected(3);
    specdec::softmax(std::span<const float>(logits), std::span<float>(expected));
    for (std::size_t j = 0; j < 3; ++j) CHECK(rows(i, j) == expected[j]);
  }
  // With sampling options every node's row is standardized like next_token_probabilities.
  const SamplingOptions sampling{.temperature = 0.0};
  specdec::LogitsModel greedy(model, sampling);
  const auto one_hot = greedy.score_tree({}, tree);
  CHECK(one_hot(0, 0) == 1.0F);  // the root's logits are all 0: the lowest id
  CHECK(one_hot(3, 2) == 1.0F);
  CHECK(one_hot(3, 0) == 0.0F);
}

TEST_CASE("LogitsModel adapts logits models to LanguageModel", "[sampling]") {
  STATIC_REQUIRE(specdec::LogitsLanguageModel<LogitsOnly>);
  STATIC_REQUIRE_FALSE(specdec::LanguageModel<LogitsOnly>);
  STATIC_REQUIRE(specdec::LanguageModel<specdec::LogitsModel<LogitsOnly>>);
  STATIC_REQUIRE_FALSE(specdec::BatchedLanguageModel<specdec::LogitsModel<LogitsOnly>>);
  STATIC_REQUIRE(specdec::BatchedLanguageModel<specdec::LogitsModel<BatchedLogits>>);

  LogitsOnly model;
  specdec::LogitsModel adapter(model);
  CHECK(adapter.vocab_size() == 3);
  const auto row = adapter.next_token_probabilities({});
  const double total = 1.0 + std::exp(1.0) + std::exp(2.0);
  CHECK(static_cast<double>(row[2]) == Catch::Approx(std::exp(2.0) / total).epsilon(1e-6));
  CHECK(&adapter.model() == &model);

  // with sampling options the adapter standardizes: rows == standardize_logits
  const SamplingOptions sampling{.temperature = 0.5, .top_k = 2};
  specdec::LogitsModel standardizing(model, sampling);
  CHECK(standardizing.sampling() == sampling);
  const auto standardized_row = standardizing.next_token_probabilities({});
  const auto expected = specdec::standardize_logits(model.logits, sampling);
  REQUIRE(standardized_row.size() == expected.size());
  for (std::size_t j = 0; j < expected.size(); ++j) CHECK(standardized_row[j] == expected[j]);
  CHECK(standardized_row[0] == 0.0F);
  CHECK_THROWS_AS(specdec::LogitsModel(model, SamplingOptions{.top_p = 0.0}), specdec::error);

  BatchedLogits batched;
  specdec::LogitsModel batched_adapter(batched);
  const std::vector<token_id> draft = {1, 2};
  const auto rows = batched_adapter.score_draft({}, draft);
  REQUIRE(rows.rows() == 3);
  CHECK(rows(0, 0) == Catch::Approx(1.0 / 3.0));  // logits all 0: uniform
  const double total2 = 1.0 + std::exp(2.0) + std::exp(4.0);
  CHECK(rows(2, 2) == Catch::Approx(std::exp(4.0) / total2));
  specdec::LogitsModel greedy_batched(batched, SamplingOptions{.temperature = 0.0});
  const auto one_hot = greedy_batched.score_draft({}, draft);
  CHECK(one_hot(0, 0) == 1.0);  // all logits 0: lowest id
  CHECK(one_hot(2, 2) == 1.0);
}
