// Numerical edges (docs/errors.md, "Numerical edges"): float rows of V = 256k where a naive
// float sum loses accuracy, denormal probabilities, rows summing to 1 +- 1e-6, and extreme
// temperatures.
//
// Error bound achieved (measured here, asserted with margin): for float rows of
// V = 262144 the residual mass Z = sum max(0, p - q) and the row mass used by every draw
// are within 5e-7 relative of a double reference (the sampler's 64-entry blocks of 16
// lanes are combined in double; residual_distribution.hpp documents about 4.2e-7), while
// a naive left-to-right float sum of the same rows is off by up to 5e-3 relative.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/validation.hpp"
#include "support/kernel_path_listener.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::token_id;

constexpr std::size_t big_vocab = 262144;  // 256k

double double_sum(std::span<const float> row) {
  double sum = 0.0;
  for (const float value : row) sum += static_cast<double>(value);
  return sum;
}

float naive_float_sum(std::span<const float> row) {
  float sum = 0.0F;
  for (const float value : row) sum += value;
  return sum;
}

// A float row of V = 256k: one head entry of mass `head`, the rest spread over the tail
// in entries far below half an ulp of the head (a naive float sum drops them all).
std::vector<float> head_and_tail(double head, std::size_t head_index) {
  std::vector<float> row(big_vocab, static_cast<float>((1.0 - head) / (big_vocab - 1)));
  row[head_index] = static_cast<float>(head);
  return row;
}

// A float row of V = 256k with random weights spanning 6 orders of magnitude, sorted
// ascending or descending or left shuffled, normalised in double.
std::vector<float> random_row(std::uint64_t seed, int order) {
  specdec::xoshiro256pp g(seed);
  std::vector<double> weights(big_vocab);
  for (double& w : weights) w = std::exp(14.0 * specdec::uniform01<double>(g));
  if (order > 0) std::sort(weights.begin(), weights.end());
  if (order < 0) std::sort(weights.rbegin(), weights.rend());
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<float> row(big_vocab);
  for (std::size_t j = 0; j < big_vocab; ++j) row[j] = static_cast<float>(weights[j] / total);
  return row;
}

}  // namespace

TEST_CASE("float rows of V = 256k: masses within 5e-7 of a double reference",
          "[numerical_edges][residual_distribution]") {
  const std::vector<float> zero(big_vocab, 0.0F);
  const std::vector<std::vector<float>> rows{
      head_and_tail(0.995, 0), head_and_tail(0.995, big_vocab - 1),
      head_and_tail(0.5, 77),  random_row(1, 0),
      random_row(2, 1),        random_row(3, -1)};
  double worst_library = 0.0;
  double worst_naive = 0.0;
  for (const auto& row : rows) {
    const double reference = double_sum(row);
    const double library =
        specdec::residual_mass(std::span<const float>(row), std::span<const float>(zero));
    const double naive = static_cast<double>(naive_float_sum(row));
    worst_library = std::max(worst_library, std::abs(library - reference) / reference);
    worst_naive = std::max(worst_naive, std::abs(naive - reference) / reference);
    // Validation sums in double: these rows are valid at the float tolerance.
    CHECK_NOTHROW(specdec::validate_probability_row(std::span<const float>(row), big_vocab, {}));
  }
  INFO("worst relative error: library " << worst_library << ", naive float sum " << worst_naive);
  CHECK(worst_library <= 5e-7);
  CHECK(worst_naive >= 1e-3);  // the premise: a naive float sum really does lose the tail

  // Residual masses Z = sum max(0, p - q) of float row pairs, against double references.
  double worst_residual = 0.0;
  for (std::size_t a = 0; a < rows.size(); ++a) {
    for (std::size_t b = 0; b < rows.size(); ++b) {
      if (a == b) continue;
      double reference = 0.0;
      for (std::size_t j = 0; j < big_vocab; ++j) {
        reference +=
            std::max(0.0, static_cast<double>(rows[a][j]) - static_cast<double>(rows[b][j]));
      }
      const double library =
          specdec::residual_mass(std::span<const float>(rows[a]), std::span<const float>(rows[b]));
      worst_residual = std::max(worst_residual, std::abs(library - reference) / reference);
    }
  }
  INFO("worst relative residual-mass error " << worst_residual);
  CHECK(worst_residual <= 5e-7);
}

TEST_CASE("float rows of V = 256k: the tail a naive float CDF loses is drawn at its rate",
          "[numerical_edges][residual_distribution]") {
  // Head 0.995 at token 0, tail mass 0.005 in 262143 entries of 1.9e-8 each: below half an
  // ulp of the head, so a naive float running sum never leaves 0.995 and a naive inverse
  // CDF never draws the tail. The library draws it with probability 0.005.
  const std::vector<float> row = head_and_tail(0.995, 0);
  const std::vector<float> zero(big_vocab, 0.0F);
  const double tail = 1.0 - static_cast<double>(row[0]) / double_sum(row);
  const std::vector<double> expected{1.0 - tail, tail};
  // Enough draws to see a deviation of total variation tail / 2.
  const std::size_t draws = specdec::testing::samples_to_detect(tail / 2.0, 1.0);
  const std::span<const float> row_view(row);
  const std::span<const float> zero_view(zero);
  specdec::residual_distribution<float> distribution(row_view, zero_view);
  specdec::xoshiro256pp g(2024);
  std::vector<std::uint64_t> library(2, 0);
  std::vector<std::uint64_t> naive(2, 0);
  const float naive_total = naive_float_sum(row);
  for (std::size_t k = 0; k < draws; ++k) {
    ++library[distribution(g) == 0 ? 0 : 1];
    // The deliberately broken variant: inverse CDF over a naive float running sum.
    const float target = specdec::uniform01<float>(g) * naive_total;
    float running = 0.0F;
    std::size_t chosen = big_vocab - 1;
    for (std::size_t j = 0; j < big_vocab; ++j) {
      running += row[j];
      if (target < running) {
        chosen = j;
        break;
      }
    }
    ++naive[chosen == 0 ? 0 : 1];
  }
  const auto good = specdec::testing::chi_square_test(library, expected);
  INFO(good.describe());
  CHECK(good.passed());
  const auto broken = specdec::testing::chi_square_test(naive, expected);
  INFO(broken.describe());
  CHECK_FALSE(broken.passed());
}

TEMPLATE_TEST_CASE("denormal probabilities", "[numerical_edges][validation][speculative_sampling]",
                   float, double) {
  using limits = std::numeric_limits<TestType>;
  const TestType tiny = limits::denorm_min();
  // A valid row with denormal entries: accepted by validation, drawable, and a denormal
  // entry is a possible (if improbable) outcome, never NaN-driven.
  std::vector<TestType> row{TestType(0.5), tiny, TestType(0.5) - tiny, limits::min() / 4};
  CHECK_NOTHROW(specdec::validate_probability_row(std::span<const TestType>(row), 4, {}));
  specdec::xoshiro256pp g(3);
  for (int k = 0; k < 1000; ++k) {
    const token_id t = specdec::sample_from_row(std::span<const TestType>(row), g);
    CHECK((t == 0 || t == 2));  // mass 1e-45 / 1e-308 is never hit in 1000 draws
  }
  // A row whose ENTIRE mass is denormal (unchecked samplers renormalise by the computed
  // sum). Draws stay in range, on positive entries and uniform over them: for float rows
  // the masses are normal numbers in double; for double rows the draw walks to a whole
  // number of denorm_min units (regression test of finding F4 in docs/errors.md, where
  // u * Z rounded to the denormal grid gave the first positive entry half its share).
  std::vector<TestType> denormal_row(64, TestType(0));
  for (std::size_t j = 0; j < 64; j += 2) denormal_row[j] = tiny;
  std::vector<std::uint64_t> counts(64, 0);
  std::vector<double> expected(64, 0.0);
  for (std::size_t j = 0; j < 64; j += 2) expected[j] = 1.0 / 32.0;
  const std::size_t draws = specdec::testing::samples_to_detect(0.1, 31.0);
  for (std::size_t k = 0; k < draws; ++k) {
    const token_id t = specdec::sample_from_row(std::span<const TestType>(denormal_row), g);
    REQUIRE((t >= 0 && t < 64));
    ++counts[static_cast<std::size_t>(t)];
  }
  const auto fit = specdec::testing::chi_square_test(counts, expected);
  INFO(fit.describe());
  CHECK_FALSE(fit.impossible_outcome);
  CHECK(fit.passed());
  // Uneven denormal masses (1, 2, 3 and 10 units) keep their ratios too.
  std::vector<TestType> uneven{tiny, TestType(0), tiny * 2, tiny * 3, tiny * 10};
  std::vector<std::uint64_t> uneven_counts(5, 0);
  const std::vector<double> uneven_expected{1.0 / 16, 0.0, 2.0 / 16, 3.0 / 16, 10.0 / 16};
  const std::size_t uneven_draws = specdec::testing::samples_to_detect(0.02, 3.0);
  std::vector<std::uint64_t> rounded_counts(5, 0);  // negative control: walk to u * Z
  for (std::size_t k = 0; k < uneven_draws; ++k) {
    const double u = specdec::uniform01<double>(g);
    const token_id t = specdec::sample_from_row(std::span<const TestType>(uneven), g);
    REQUIRE((t >= 0 && t < 5));
    ++uneven_counts[static_cast<std::size_t>(t)];
    double total = 0.0;
    for (const TestType x : uneven) total += static_cast<double>(x);
    const double target = u * total;  // rounded to the denormal grid for double rows
    double running = 0.0;
    std::size_t chosen = 4;
    for (std::size_t j = 0; j < uneven.size(); ++j) {
      running += static_cast<double>(uneven[j]);
      if (target < running) {
        chosen = j;
        break;
      }
    }
    ++rounded_counts[chosen];
  }
  const auto uneven_fit = specdec::testing::chi_square_test(uneven_counts, uneven_expected);
  INFO(uneven_fit.describe());
  CHECK(uneven_fit.passed());
  const auto rounded_fit = specdec::testing::chi_square_test(rounded_counts, uneven_expected);
  INFO(rounded_fit.describe());
  // The old draw is caught for double rows (TV 1/32); for float rows it is exact.
  if constexpr (std::is_same_v<TestType, double>) {
    CHECK_FALSE(rounded_fit.passed());
  } else {
    CHECK(rounded_fit.passed());
  }
  // Verification: p(x) denormal, q(x) normal accepts with probability p/q (tiny) and the
  // residual has positive mass: no fallback, t with p(t) > q(t).
  const std::vector<TestType> q{TestType(0.25), TestType(0.25), TestType(0.25), TestType(0.25)};
  std::vector<TestType> p{TestType(0.75), tiny, TestType(0.25) - tiny, TestType(0)};
  std::vector<TestType> target = p;
  target.insert(target.end(), p.begin(), p.end());
  const std::vector<token_id> drafts{1};
  for (int k = 0; k < 200; ++k) {
    const auto result = specdec::verify_speculative_checked(
        std::span<const token_id>(drafts), specdec::RowsView<const TestType>(q.data(), 1, 4),
        specdec::RowsView<const TestType>(target.data(), 2, 4), g);
    CHECK(result.accepted == 0);
    CHECK_FALSE(result.residual_fallback);
    CHECK(result.token == 0);  // the only token with p > q
  }
  CHECK(specdec::argmax(std::span<const TestType>(denormal_row)) == 0);
}

TEMPLATE_TEST_CASE("rows summing to 1 +/- 1e-6", "[numerical_edges][validation]", float, double) {
  // Double rows: tolerance 1e-6 (inclusive); float rows: 1e-3, so 1 +- 1e-6 is always fine.
  const double tolerance = specdec::default_sum_tolerance<TestType>;
  const auto row_with_sum = [](double sum) {
    std::vector<TestType> row(8, static_cast<TestType>(0.125));
    row[0] = static_cast<TestType>(0.125 + (sum - 1.0));
    return row;
  };
  for (const double offset : {1e-6, -1e-6, 0.99e-6, -0.99e-6}) {
    const auto row = row_with_sum(1.0 + offset);
    const double actual = std::accumulate(row.begin(), row.end(), 0.0, [](double s, TestType v) {
      return s + static_cast<double>(v);
    });
    INFO("offset " << offset << ", actual sum - 1 = " << actual - 1.0);
    if (std::abs(actual - 1.0) <= tolerance) {
      CHECK_NOTHROW(specdec::validate_probability_row(std::span<const TestType>(row), 8, {}));
    } else {
      CHECK_THROWS_AS(specdec::validate_probability_row(std::span<const TestType>(row), 8, {}),
                      specdec::error);
    }
    // Such rows verify normally: the samplers renormalise by the sum they compute.
    std::vector<TestType> target = row;
    target.insert(target.end(), row.begin(), row.end());
    const std::vector<token_id> drafts{3};
    specdec::xoshiro256pp g(11);
    const auto result = specdec::verify_speculative_proposals(
        std::span<const token_id>(drafts), specdec::RowsView<const TestType>(target.data(), 2, 8),
        g);
    CHECK((result.token >= 0 && result.token < 8));
  }
  if constexpr (std::is_same_v<TestType, double>) {
    // Just outside the double tolerance.
    for (const double offset : {1.5e-6, -1.5e-6}) {
      const auto row = row_with_sum(1.0 + offset);
      CHECK_THROWS_AS(specdec::validate_probability_row(std::span<const TestType>(row), 8, {}),
                      specdec::error);
    }
  } else {
    for (const double offset : {1e-6, -1e-6, 9e-4, -9e-4}) {
      const auto row = row_with_sum(1.0 + offset);
      CHECK_NOTHROW(specdec::validate_probability_row(std::span<const TestType>(row), 8, {}));
    }
    for (const double offset : {1.5e-3, -1.5e-3}) {
      const auto row = row_with_sum(1.0 + offset);
      CHECK_THROWS_AS(specdec::validate_probability_row(std::span<const TestType>(row), 8, {}),
                      specdec::error);
    }
  }
}

TEMPLATE_TEST_CASE("extreme temperatures keep zeros zero and rows normalised",
                   "[numerical_edges][sampling]", float, double) {
  // Regression (finding F2): for float rows, temperature > ~7e44 made 1/T round to 0 and
  // log(0) * 0 turned zero entries into NaN.
  const std::vector<TestType> row{TestType(0.5), TestType(0), TestType(0.3), TestType(0.2)};
  const std::vector<TestType> logits{TestType(1), -std::numeric_limits<TestType>::infinity(),
                                     TestType(0.5), TestType(-3)};
  for (const double temperature :
       {1e-300, 1e-30, 1e30, 1e45, 1e300, std::numeric_limits<double>::max()}) {
    specdec::SamplingOptions options;
    options.temperature = temperature;
    specdec::Standardizer<TestType> standardizer(options);
    std::vector<TestType> out(4);
    for (const bool from_logits : {false, true}) {
      if (from_logits) {
        (void)standardizer.apply_logits(std::span<const TestType>(logits),
                                        std::span<TestType>(out));
      } else {
        (void)standardizer.apply(std::span<const TestType>(row), std::span<TestType>(out));
      }
      INFO("temperature " << temperature << (from_logits ? " (logits)" : " (probabilities)"));
      CHECK(out[1] == TestType(0));
      double sum = 0.0;
      for (const TestType value : out) {
        CHECK(std::isfinite(value));
        CHECK(value >= TestType(0));
        sum += static_cast<double>(value);
      }
      CHECK(std::abs(sum - 1.0) <= 1e-6);
    }
  }
}

TEMPLATE_TEST_CASE("a logit row of only NaN and -infinity gives NaN entries, never a zero row",
                   "[numerical_edges][sampling]", float, double) {
  // The row maximum passes NaN entries over; when nothing else is left (only -infinity) it
  // reports the NaN, so that apply_logits writes NaN (which validation rejects) instead of
  // the zero row of an all -infinity input. Lengths around the scan's lanes and chunks.
  constexpr TestType nan = std::numeric_limits<TestType>::quiet_NaN();
  constexpr TestType impossible = -std::numeric_limits<TestType>::infinity();
  for (const std::size_t size :
       {std::size_t{1}, std::size_t{3}, std::size_t{40}, std::size_t{1100}}) {
    INFO("V = " << size);
    std::vector<TestType> logits(size, impossible);
    logits[size / 2] = nan;
    specdec::Standardizer<TestType> standardizer(specdec::SamplingOptions{.temperature = 0.7});
    std::vector<TestType> out(size, TestType(0.5));
    (void)standardizer.apply_logits(std::span<const TestType>(logits), std::span<TestType>(out));
    CHECK(std::all_of(out.begin(), out.end(), [](TestType x) { return std::isnan(x); }));
    // All -infinity: no possible token, a zero row.
    logits[size / 2] = impossible;
    (void)standardizer.apply_logits(std::span<const TestType>(logits), std::span<TestType>(out));
    CHECK(std::all_of(out.begin(), out.end(), [](TestType x) { return x == TestType(0); }));
  }
}
