// Tests for include/specdec/residual_distribution.hpp: the inverse-CDF walk at exact
// boundaries, the rounding and zero-mass policies, accuracy of the streaming mass for large
// float rows, the distribution object, and the law of the real sampler by chi-square over 20+
// (p, q) pairs (V up to 50,000) with broken variants that the same statistic rejects.
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

#include "specdec/detail/sparse_rows.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "support/kernel_path_listener.hpp"
#include "support/scripted_uniforms.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::token_id;

using specdec::testing::all_ones;
using specdec::testing::bits_for;
using specdec::testing::ScriptedGenerator;

/// samples_to_detect(tv, df), scaled down in sanitizer builds (support/scripted_uniforms.hpp).
std::size_t samples_to_detect(double tv, std::size_t degrees_of_freedom) {
  return specdec::testing::scaled_samples_to_detect(tv, degrees_of_freedom);
}

template <class T>
std::vector<T> cast_row(const std::vector<double>& row) {
  return std::vector<T>(row.begin(), row.end());
}

template <class T>
std::span<const T> view(const std::vector<T>& row) {
  return row;
}

/// The law the residual sampler must follow: norm(max(0, p - l q)), computed in double from
/// the very entries the sampler sees.
template <class T>
std::vector<double> residual_law(const std::vector<T>& p, const std::vector<T>& q,
                                 double lenience = 1.0) {
  std::vector<double> law(p.size());
  for (std::size_t j = 0; j < p.size(); ++j) {
    law[j] = std::max(0.0, static_cast<double>(p[j]) - lenience * static_cast<double>(q[j]));
  }
  const double mass = std::accumulate(law.begin(), law.end(), 0.0);
  for (auto& value : law) value /= mass;
  return law;
}

// ---------------------------------------------------------------------------------------
// (p, q) pairs for the statistical tests
// ---------------------------------------------------------------------------------------

struct Pair {
  std::string name;
  std::vector<double> p;
  std::vector<double> q;
};

std::vector<double> normalised(std::vector<double> row) {
  const double sum = std::accumulate(row.begin(), row.end(), 0.0);
  for (auto& value : row) value /= sum;
  return row;
}

/// Random weights u^3 (a spread of large and small entries).
std::vector<double> random_weights(std::size_t size, specdec::xoshiro256pp& g) {
  std::vector<double> row(size);
  for (auto& value : row) {
    const double u = specdec::uniform01<double>(g);
    value = u * u * u + 1e-3;
  }
  return normalised(row);
}

/// Zipf-like weights 1/(rank+1)^s over a random permutation: an LLM-like row.
std::vector<double> zipf_weights(std::size_t size, double exponent, specdec::xoshiro256pp& g) {
  std::vector<std::size_t> order(size);
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t i = size - 1; i > 0; --i) {
    std::swap(order[i], order[specdec::uniform_below(g, i + 1)]);
  }
  std::vector<double> row(size);
  for (std::size_t rank = 0; rank < size; ++rank) {
    row[order[rank]] = 1.0 / std::pow(static_cast<double>(rank + 1), exponent);
  }
  return normalised(row);
}

/// The (p, q) pairs with a non-empty residual, covering the edge cases of the issue.
std::vector<Pair> residual_pairs() {
  specdec::xoshiro256pp g(20230518);
  std::vector<Pair> pairs;
  for (const std::size_t size : {2UL, 3UL, 5UL, 8UL, 16UL, 65UL, 130UL, 1000UL}) {
    pairs.push_back(
        {"random V=" + std::to_string(size), random_weights(size, g), random_weights(size, g)});
  }
  // Disjoint supports: the residual is p.
  pairs.push_back({"disjoint supports", normalised({0.3, 0.2, 0, 0, 0.5, 0}),
                   normalised({0, 0, 0.6, 0.4, 0, 0})});
  // q(x) = 0 where p(x) > 0.
  pairs.push_back({"q zero where p positive", normalised({0.2, 0.3, 0.1, 0.4, 0.0}),
                   normalised({0.0, 0.5, 0.0, 0.25, 0.25})});
  // p(x) = 0 where q(x) > 0.
  pairs.push_back({"p zero where q positive", normalised({0.0, 0.4, 0.0, 0.35, 0.25}),
                   normalised({0.3, 0.1, 0.2, 0.1, 0.3})});
  // One-hot rows.
  pairs.push_back(
      {"one-hot q", normalised({0.1, 0.2, 0.3, 0.4, 0.0}), normalised({0, 0, 0, 1, 0})});
  pairs.push_back({"one-hot p", normalised({0, 0, 1, 0}), normalised({0.25, 0.25, 0.25, 0.25})});
  // Near one-hot p against a uniform q, and the reverse.
  {
    std::vector<double> p(8, 1e-4);
    p[5] = 1.0;
    pairs.push_back({"near one-hot p", normalised(p), std::vector<double>(8, 1.0 / 8)});
    pairs.push_back({"uniform p, near one-hot q", std::vector<double>(8, 1.0 / 8), normalised(p)});
  }
  // p close to q: a residual of total mass ~1e-3 must still be sampled exactly.
  {
    const auto q = random_weights(12, g);
    std::vector<double> p = q;
    p[3] += 1e-3;
    p[7] += 2e-3;
    p[10] = std::max(0.0, p[10] - 1e-3);
    pairs.push_back({"p close to q", normalised(p), q});
  }
  // The residual lives only in the last token of a row spanning several blocks.
  {
    std::vector<double> q(1000, 1.0 / 1000);
    std::vector<double> p = q;
    p[999] += 0.05;
    p[0] -= 0.05 / 1000;
    pairs.push_back({"residual in the last token", normalised(p), normalised(q)});
  }
  // Sparse rows: each model rules out about half of the vocabulary.
  {
    auto p = random_weights(300, g);
    auto q = random_weights(300, g);
    for (std::size_t j = 0; j < 300; ++j) (specdec::uniform_below(g, 2) == 0 ? p : q)[j] = 0.0;
    pairs.push_back({"sparse V=300", normalised(p), normalised(q)});
  }
  // Large vocabularies: LLM-like rows (tails are bucketed).
  pairs.push_back({"zipf V=5000", zipf_weights(5000, 1.1, g), zipf_weights(5000, 1.0, g)});
  pairs.push_back({"zipf V=50000", zipf_weights(50000, 1.05, g), zipf_weights(50000, 1.2, g)});
  {
    auto p = zipf_weights(50000, 1.0, g);
    auto q = p;
    for (std::size_t j = 0; j < q.size(); j += 7) q[j] *= 2.5;  // residual on 6 of 7 tokens
    pairs.push_back({"zipf V=50000 perturbed", p, normalised(q)});
  }
  return pairs;
}

/// Draws `samples` tokens with `draw()` and runs the chi-square against `law` (bucketed).
template <class Draw>
specdec::testing::ChiSquareResult chi_square_of(const std::vector<double>& law, std::size_t samples,
                                                Draw&& draw) {
  const auto bucket = specdec::testing::bucket_tokens(law);
  const std::size_t buckets = *std::max_element(bucket.begin(), bucket.end()) + 1;
  std::vector<double> expected(buckets, 0.0);
  for (std::size_t j = 0; j < law.size(); ++j) expected[bucket[j]] += law[j];
  std::vector<std::uint64_t> observed(buckets, 0);
  // A token of zero probability must never come out: give it its own impossible bucket.
  bool impossible = false;
  for (std::size_t i = 0; i < samples; ++i) {
    const auto token = static_cast<std::size_t>(draw());
    if (token >= law.size() || law[token] == 0.0) {
      impossible = true;
      continue;
    }
    ++observed[bucket[token]];
  }
  auto result = specdec::testing::chi_square_test(observed, expected);
  result.impossible_outcome = result.impossible_outcome || impossible;
  return result;
}

/// Number of samples that detects a total-variation error of 0.01 for this law's buckets.
std::size_t samples_for(const std::vector<double>& law) {
  const auto bucket = specdec::testing::bucket_tokens(law);
  const std::size_t buckets = *std::max_element(bucket.begin(), bucket.end()) + 1;
  return samples_to_detect(0.01, buckets - 1);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Deterministic behaviour
// ---------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("The inverse-CDF walk is exact at its boundaries", "[residual_distribution]",
                   float, double) {
  using T = TestType;
  // Residual weights max(0, p - q) = {0.25, 0, 0.25, 0}, Z = 0.5 (all dyadic, exact in T).
  const std::vector<T> p = {T(0.5), T(0.25), T(0.25), T(0)};
  const std::vector<T> q = {T(0.25), T(0.25), T(0), T(0.5)};
  CHECK(specdec::residual_mass(view(p), view(q)) == 0.5);
  auto draw = [&](std::uint64_t bits) {
    ScriptedGenerator g{{bits}};
    const auto result = specdec::sample_residual(view(p), view(q), g);
    CHECK_FALSE(result.fallback);
    CHECK(g.next == 1);  // exactly one uniform per draw
    return result.token;
  };
  CHECK(draw(0) == 0);
  CHECK(draw(bits_for(0.5) - (1U << 11U)) == 0);  // u = 0.5 - 2^-53: target just below 0.25
  CHECK(draw(bits_for(0.5)) == 2);                // u = 0.5: cumulative 0.25 is not > 0.25
  CHECK(draw(all_ones) == 2);                     // never the trailing zero-weight token

  // The same across blocks and superblocks: V = 40000 (superblocks of 256 entries), weights
  // 1/8, 1/8, 1/4, 1/2 at tokens 5, 64, 20001, 39998; everything else cancels exactly.
  const std::size_t size = 40000;
  std::vector<T> wide_p(size, T(1.0 / 65536));
  std::vector<T> wide_q(size, T(1.0 / 65536));
  const std::size_t tokens[] = {5, 64, 20001, 39998};
  const double masses[] = {0.125, 0.125, 0.25, 0.5};
  for (std::size_t k = 0; k < 4; ++k) wide_p[tokens[k]] += static_cast<T>(masses[k]);
  CHECK(specdec::residual_mass(view(wide_p), view(wide_q)) == 1.0);
  auto wide = [&](std::uint64_t bits) {
    ScriptedGenerator g{{bits}};
    return specdec::sample_residual(view(wide_p), view(wide_q), g).token;
  };
  CHECK(wide(0) == 5);
  CHECK(wide(bits_for(0.125) - 2048) == 5);
  CHECK(wide(bits_for(0.125)) == 64);
  CHECK(wide(bits_for(0.25)) == 20001);
  CHECK(wide(bits_for(0.5) - 2048) == 20001);
  CHECK(wide(bits_for(0.5)) == 39998);
  CHECK(wide(all_ones) == 39998);
}

TEST_CASE("Mass tables split any vocabulary into at most 256 superblocks",
          "[residual_distribution]") {
  for (const std::size_t size :
       {1UL, 63UL, 64UL, 65UL, 16384UL, 16385UL, 50000UL, 131072UL, 262144UL, 300007UL}) {
    const std::vector<float> row(size, 1.0F);
    specdec::detail::mass_table table;
    specdec::detail::build_mass_table(specdec::detail::row_source<float>{row.data(), size}, table);
    INFO("V = " << size);
    CHECK(table.superblocks >= 1);
    CHECK(table.superblocks <= specdec::detail::max_superblocks);
    CHECK(table.superblock_elements % specdec::detail::kernel_block == 0);
    CHECK(table.superblocks * table.superblock_elements >= size);
    CHECK((table.superblocks - 1) * table.superblock_elements < size);
    CHECK(table.total == static_cast<double>(size));  // integers: every sum is exact
  }
}

TEST_CASE("Rounding never yields a zero-weight token or an index out of range",
          "[residual_distribution]") {
  // Simulate a total that rounding made larger than the sum of the parts: a draw near the
  // top must then take the last token of positive weight, at every level of the walk.
  std::vector<double> row(5000, 0.0);
  row[17] = 0.25;
  row[3001] = 0.5;
  row[3002] = 0.25;  // the last positive token; 3003..4999 are zero
  const specdec::detail::row_source<double> source{row.data(), row.size()};
  specdec::detail::mass_table table;
  specdec::detail::build_mass_table(source, table);
  REQUIRE(table.total == 1.0);
  table.total = 1.5;
  CHECK(specdec::detail::draw_from_table(source, table, 0.99) == 3002);
  CHECK(specdec::detail::draw_from_table(source, table, 0.1) == 17);
  // A stored cumulative mass that the recomputed blocks fall short of (rounding between
  // passes): the block walk overruns and takes the last positive token of the superblock.
  table.total = 1.5;
  const std::size_t superblock = 3001 / table.superblock_elements;
  REQUIRE(superblock == 3002 / table.superblock_elements);
  for (std::size_t s = superblock; s < table.superblocks; ++s) table.cumulative_mass[s] += 0.5;
  CHECK(specdec::detail::draw_from_table(source, table, 0.9) == 3002);
  CHECK(specdec::detail::find_superblock(table, 1.35).index == superblock);
  CHECK(specdec::detail::find_superblock(table, 0.0).index == 17 / table.superblock_elements);
  CHECK(std::isinf(specdec::detail::find_superblock(table, 1.5).remaining));
  // The walk itself: zero masses are never chosen, overrun picks the last positive item.
  const std::vector<double> masses = {0.0, 1.0, 0.0, 2.0, 0.0};
  auto mass_of = [&](std::size_t i) { return masses[i]; };
  CHECK(specdec::detail::walk_masses(5, 0.0, mass_of).index == 1);
  CHECK(specdec::detail::walk_masses(5, 1.0, mass_of).index == 3);
  const auto overrun = specdec::detail::walk_masses(5, 3.0, mass_of);
  CHECK(overrun.index == 3);
  CHECK(std::isinf(overrun.remaining));
  CHECK(specdec::detail::walk_masses(3, 0.0, [](std::size_t) { return 0.0; }).index ==
        specdec::detail::no_index);
}

TEMPLATE_TEST_CASE("Zero-weight tokens never come out of a residual", "[residual_distribution]",
                   float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(5);
  for (const std::size_t size : {3UL, 64UL, 65UL, 200UL, 1500UL}) {
    // About half the tokens have p <= q (zero residual weight).
    std::vector<T> p(size);
    std::vector<T> q(size);
    for (std::size_t j = 0; j < size; ++j) {
      p[j] = static_cast<T>(specdec::uniform01<double>(g));
      q[j] = static_cast<T>(specdec::uniform01<double>(g));
    }
    for (int i = 0; i < 2000; ++i) {
      const auto result = specdec::sample_residual(view(p), view(q), g);
      REQUIRE_FALSE(result.fallback);
      REQUIRE(static_cast<std::size_t>(result.token) < size);
      REQUIRE(p[static_cast<std::size_t>(result.token)] >
              q[static_cast<std::size_t>(result.token)]);
    }
  }
}

TEMPLATE_TEST_CASE("Zero or non-finite residual mass falls back to p", "[residual_distribution]",
                   float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(8);
  // p == q: the residual is empty, every draw comes from p (never token 1, which p rules out).
  const std::vector<T> p = {T(0.5), T(0), T(0.25), T(0.25)};
  std::vector<std::uint64_t> counts(4, 0);
  for (int i = 0; i < 4000; ++i) {
    const auto result = specdec::sample_residual(view(p), view(p), g);
    REQUIRE(result.fallback);
    ++counts[static_cast<std::size_t>(result.token)];
  }
  CHECK(counts[1] == 0);
  CHECK(counts[0] > 1500);
  CHECK(counts[2] > 700);
  CHECK(counts[3] > 700);
  // Residual mass that is pure rounding noise: q is p with one ulp moved. Whatever comes
  // out is in range and, if not a fallback, of positive weight.
  std::vector<T> q = p;
  q[0] = std::nextafter(q[0], T(1));
  for (int i = 0; i < 100; ++i) {
    const auto result = specdec::sample_residual(view(p), view(q), g);
    REQUIRE(static_cast<std::size_t>(result.token) < 4);
    if (!result.fallback)
      CHECK(p[static_cast<std::size_t>(result.token)] > q[static_cast<std::size_t>(result.token)]);
  }
  // NaN entries weigh nothing; an infinite entry makes the mass non-finite: fallback to p,
  // whose mass is infinite too, so the documented last resort is p's argmax.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const std::vector<T> with_nan = {T(0.5), nan, T(0.5), T(0)};
  const std::vector<T> uniform = {T(0.25), T(0.25), T(0.25), T(0.25)};
  for (int i = 0; i < 100; ++i) {
    const auto result = specdec::sample_residual(view(with_nan), view(uniform), g);
    CHECK_FALSE(result.fallback);
    CHECK((result.token == 0 || result.token == 2));
  }
  // The same inside full kernel blocks (the vectorized path): V = 300, NaN at 140.
  std::vector<T> wide_p(300, T(1) / T(300));
  std::vector<T> wide_q(300, T(1) / T(300));
  wide_p[140] = nan;
  wide_p[150] *= T(2);
  wide_p[299] *= T(2);
  for (int i = 0; i < 100; ++i) {
    const auto result = specdec::sample_residual(view(wide_p), view(wide_q), g);
    CHECK_FALSE(result.fallback);
    CHECK((result.token == 150 || result.token == 299));
  }
  CHECK(std::abs(specdec::residual_mass(view(wide_p), view(wide_q)) - 2.0 / 300) < 1e-6);
  const std::vector<T> with_inf = {T(0), T(0.5), std::numeric_limits<T>::infinity(), T(0)};
  const auto infinite = specdec::sample_residual(view(with_inf), view(uniform), g);
  CHECK(infinite == specdec::ResidualDraw{2, true});
  // Rows without any mass (a violated precondition): argmax of p, lowest id among ties.
  const std::vector<T> zeros(4, T(0));
  CHECK(specdec::sample_residual(view(zeros), view(zeros), g) == specdec::ResidualDraw{0, true});
  CHECK(specdec::sample_from_row(view(zeros), g) == 0);
}

TEMPLATE_TEST_CASE("The one-hot residual removes the drafted token", "[residual_distribution]",
                   float, double) {
  using T = TestType;
  const std::vector<T> p = {T(0.5), T(0.25), T(0.125), T(0.125)};
  auto draw = [&](token_id drafted, std::uint64_t bits, double lenience = 1.0) {
    ScriptedGenerator g{{bits}};
    return specdec::sample_residual_one_hot(view(p), drafted, g, lenience);
  };
  // Without token 0 the weights are {0, 0.25, 0.125, 0.125}, Z = 0.5.
  CHECK(draw(0, 0) == specdec::ResidualDraw{1, false});
  CHECK(draw(0, bits_for(0.5)) == specdec::ResidualDraw{2, false});
  CHECK(draw(0, bits_for(0.75)) == specdec::ResidualDraw{3, false});
  CHECK(draw(0, all_ones) == specdec::ResidualDraw{3, false});
  CHECK(draw(3, all_ones) == specdec::ResidualDraw{2, false});
  // Lenience 0.25: the drafted token keeps max(0, p(x) - l) = 0.25: weights {0.25, 0.25,
  // 0.125, 0.125}, Z = 0.75.
  CHECK(draw(0, 0, 0.25) == specdec::ResidualDraw{0, false});
  CHECK(draw(0, bits_for(0.25), 0.25) == specdec::ResidualDraw{0, false});
  CHECK(draw(0, bits_for(0.375), 0.25) == specdec::ResidualDraw{1, false});
  // A one-hot p on the drafted token leaves nothing: fall back to p (which gives x).
  const std::vector<T> one_hot = {T(0), T(1), T(0)};
  ScriptedGenerator g{{bits_for(0.5)}};
  CHECK(specdec::sample_residual_one_hot(view(one_hot), 1, g) == specdec::ResidualDraw{1, true});
  // The one-hot residual across blocks: V = 300, the drafted token in the middle block.
  std::vector<T> wide(300, T(0));
  wide[100] = T(0.5);
  wide[130] = T(0.25);
  wide[299] = T(0.25);
  ScriptedGenerator h{{0, all_ones, bits_for(0.5)}};
  CHECK(specdec::sample_residual_one_hot(view(wide), 100, h).token == 130);
  CHECK(specdec::sample_residual_one_hot(view(wide), 100, h).token == 299);
  CHECK(specdec::sample_residual_one_hot(view(wide), 130, h).token == 100);
}

TEST_CASE("The streaming mass of a 256k float row is accurate to the documented bound",
          "[residual_distribution]") {
  specdec::xoshiro256pp g(77);
  constexpr std::size_t size = 262144;
  std::vector<float> p(size);
  std::vector<float> q(size);
  for (std::size_t j = 0; j < size; ++j) {
    p[j] = static_cast<float>(specdec::uniform01<double>(g)) / static_cast<float>(size);
    q[j] = static_cast<float>(specdec::uniform01<double>(g)) / static_cast<float>(size);
  }
  // Reference: the exact float differences (exact in double) summed with compensation.
  double reference = 0.0;
  double compensation = 0.0;
  for (std::size_t j = 0; j < size; ++j) {
    const double term =
        std::max(0.0, static_cast<double>(p[j]) - static_cast<double>(q[j])) - compensation;
    const double next = reference + term;
    compensation = (next - reference) - term;
    reference = next;
  }
  const double computed = specdec::residual_mass(view(p), view(q));
  const double bound = 12.0 * 0x1.0p-24 * reference;  // 11 u (block sums) + u (differences)
  INFO("computed " << computed << " reference " << reference);
  CHECK(std::abs(computed - reference) <= bound);
  // The same rows in double are accurate to rounding level.
  const std::vector<double> p64(p.begin(), p.end());
  const std::vector<double> q64(q.begin(), q.end());
  CHECK(std::abs(specdec::residual_mass(view(p64), view(q64)) - reference) <= 1e-13 * reference);
}

TEMPLATE_TEST_CASE("residual_distribution behaves like a standard distribution",
                   "[residual_distribution]", float, double) {
  using T = TestType;
  using Distribution = specdec::residual_distribution<T>;
  STATIC_REQUIRE(std::is_same_v<typename Distribution::result_type, token_id>);
  STATIC_REQUIRE(
      std::is_same_v<typename Distribution::param_type::distribution_type, Distribution>);
  const std::vector<T> p = {T(0.5), T(0.25), T(0.25), T(0)};
  const std::vector<T> q = {T(0.25), T(0.25), T(0), T(0.5)};
  Distribution residual(view(p), view(q));
  CHECK(residual.min() == 0);
  CHECK(residual.max() == 3);
  CHECK(residual.mass() == 0.5);
  CHECK_FALSE(residual.falls_back());
  CHECK(residual.param() == typename Distribution::param_type(view(p), view(q)));
  CHECK(residual == Distribution(typename Distribution::param_type(view(p), view(q))));
  CHECK_FALSE(residual == Distribution(view(q), view(p)));
  // Draws from the stored table equal one-shot draws with the same uniforms.
  specdec::xoshiro256pp a(3);
  specdec::xoshiro256pp b(3);
  for (int i = 0; i < 200; ++i) {
    const token_id token = residual(a);
    CHECK(token == specdec::sample_residual(view(p), view(q), b).token);
    CHECK((token == 0 || token == 2));
  }
  // operator()(g, param) uses the given parameters only.
  const typename Distribution::param_type reversed(view(q), view(p));
  for (int i = 0; i < 50; ++i) CHECK(residual(a, reversed) == 3);
  residual.reset();
  CHECK(residual.fallback_count() == 0);
  // p == q: every draw is a counted fallback from p.
  residual.param(typename Distribution::param_type(view(p), view(p)));
  CHECK(residual.falls_back());
  CHECK(residual.mass() == 0.0);
  for (int i = 0; i < 30; ++i) CHECK(residual(a) != 3);
  CHECK(residual.fallback_count() == 30);
  (void)residual(a, typename Distribution::param_type(view(q), view(q)));
  CHECK(residual.fallback_count() == 31);
  // Lenience: weights max(0, p - q/2) = {0.375, 0.125, 0.25, 0}.
  const Distribution lenient(view(p), view(q), 0.5);
  CHECK(lenient.mass() == 0.75);
  CHECK(lenient.param().lenience() == 0.5);
}

// ---------------------------------------------------------------------------------------
// The law of the real sampler
// ---------------------------------------------------------------------------------------

// Sample sizes: samples_to_detect(0.01, df) for each pair's buckets (270k..550k draws), so a
// total-variation error of 0.01 fails at the 1e-9 threshold. Float rows run all 21 pairs
// (V up to 50,000) through the distribution object (one streaming pass, then a walk per
// draw) and three small ones also through sample_residual (a full pass per draw: the
// verifier's path, which speculative_sampling_test exercises again); double rows run the
// pairs with V <= 1000 through the distribution object. All paths share the kernels.
TEMPLATE_TEST_CASE("Residual draws follow norm(max(0, p - q)) (chi-square, 20+ pairs)",
                   "[residual_distribution][statistical]", float, double) {
  using T = TestType;
  constexpr bool is_float = std::is_same_v<T, float>;
  specdec::xoshiro256pp g(is_float ? 101 : 202);
  const auto pairs = residual_pairs();
  REQUIRE(pairs.size() >= 20);
  for (std::size_t index = 0; index < pairs.size(); ++index) {
    const auto& pair = pairs[index];
    if (!is_float && pair.p.size() > 1000) continue;
    const auto p = cast_row<T>(pair.p);
    const auto q = cast_row<T>(pair.q);
    const auto law = residual_law(p, q);
    const std::size_t samples = samples_for(law);
    specdec::residual_distribution<T> residual(view(p), view(q));
    REQUIRE_FALSE(residual.falls_back());
    const auto stored = chi_square_of(law, samples, [&] { return residual(g); });
    INFO(pair.name << " (V = " << p.size() << "), distribution object: " << stored.describe());
    CHECK(stored.passed());
    if (is_float && index % 4 == 1 && p.size() <= 16) {
      std::size_t fallbacks = 0;
      const auto one_shot = chi_square_of(law, samples, [&] {
        const auto draw = specdec::sample_residual(view(p), view(q), g);
        fallbacks += draw.fallback ? 1 : 0;
        return draw.token;
      });
      INFO(pair.name << ", sample_residual: " << one_shot.describe());
      CHECK(one_shot.passed());
      CHECK(fallbacks == 0);
    }
  }
}

TEST_CASE("Lenient residual draws follow norm(max(0, p - l q))",
          "[residual_distribution][statistical]") {
  specdec::xoshiro256pp g(303);
  const auto pairs = residual_pairs();
  for (const double lenience : {0.5, 0.1}) {
    for (const std::size_t index : {lenience == 0.5 ? 3UL : 13UL}) {
      const auto p = cast_row<float>(pairs[index].p);
      const auto q = cast_row<float>(pairs[index].q);
      const auto law = residual_law(p, q, lenience);
      specdec::residual_distribution<float> residual(view(p), view(q), lenience);
      const auto result = chi_square_of(law, samples_for(law), [&] { return residual(g); });
      INFO(pairs[index].name << ", l = " << lenience << ": " << result.describe());
      CHECK(result.passed());
    }
  }
}

TEST_CASE("Broken residual samplers fail the same chi-square",
          "[residual_distribution][statistical]") {
  specdec::xoshiro256pp g(404);
  const auto pairs = residual_pairs();
  const auto& pair = pairs[3];  // random V = 8
  const auto p = cast_row<double>(pair.p);
  const auto q = cast_row<double>(pair.q);
  const auto law = residual_law(p, q);
  const std::size_t samples = samples_for(law);
  const double mass = specdec::residual_mass(view(p), view(q));

  // No clamp: the walk runs over the signed differences p - q.
  const auto unclamped = chi_square_of(law, samples, [&] {
    const double target = specdec::uniform01<double>(g) * mass;
    double running = 0.0;
    for (std::size_t j = 0; j < p.size(); ++j) {
      running += p[j] - q[j];
      if (running > target) return j;
    }
    return p.size() - 1;
  });
  INFO("no clamp: " << unclamped.describe());
  CHECK_FALSE(unclamped.passed());
  // Residual = p, and residual = q.
  const auto from_p =
      chi_square_of(law, samples, [&] { return specdec::sample_from_row(view(p), g); });
  INFO("residual = p: " << from_p.describe());
  CHECK_FALSE(from_p.passed());
  const auto from_q =
      chi_square_of(law, samples, [&] { return specdec::sample_from_row(view(q), g); });
  INFO("residual = q: " << from_q.describe());
  CHECK_FALSE(from_q.passed());
  // Normaliser 1 - sum(min(p, q)) computed in float for a residual of mass ~1e-3: the
  // cancellation shifts the walk's target, caught on the "p close to q" pair.
  const auto& close = *std::find_if(pairs.begin(), pairs.end(), [](const Pair& candidate) {
    return candidate.name == "p close to q";
  });
  const auto pc = cast_row<float>(close.p);
  const auto qc = cast_row<float>(close.q);
  const auto close_law = residual_law(pc, qc);
  float overlap = 0.0F;
  for (std::size_t j = 0; j < pc.size(); ++j) overlap += std::min(pc[j], qc[j]);
  const double cancelled = static_cast<double>(1.0F - overlap);
  INFO("1 - sum(min) = " << cancelled << " vs streamed "
                         << specdec::residual_mass(view(pc), view(qc)));
  const auto careless = chi_square_of(close_law, samples_for(close_law), [&] {
    const double target = specdec::uniform01<double>(g) * cancelled * 1.5;
    double running = 0.0;
    for (std::size_t j = 0; j < pc.size(); ++j) {
      running += std::max(0.0, static_cast<double>(pc[j]) - static_cast<double>(qc[j]));
      if (running > target) return j;
    }
    return pc.size() - 1;
  });
  CHECK_FALSE(careless.passed());
}

TEMPLATE_TEST_CASE("Residual draws with an unnormalised draft row and a fused block hook",
                   "[residual_distribution]", float, double) {
  // The decoder keeps draft rows unnormalised (q = f c with f = 1 / s kept as a scalar) and
  // fuses work into the residual pass through a block hook. For every u on a grid, the draw
  // from (p, c, f) must be the draw from p and the materialised row q = f c (computed in T,
  // as the pass computes it), bitwise; the residual mass must be the same; and the hook
  // must see every block of the row exactly once, in order.
  using T = TestType;
  specdec::xoshiro256pp g(31);
  for (const std::size_t vocab : {5U, 128U, 300U, 40000U}) {
    std::vector<T> p(vocab);
    std::vector<T> c(vocab);
    double p_total = 0.0;
    double c_total = 0.0;
    for (std::size_t j = 0; j < vocab; ++j) {
      p[j] = static_cast<T>(specdec::uniform01<double>(g));
      c[j] = j % 7 == 0 ? T(0) : static_cast<T>(specdec::uniform01<double>(g));
      p_total += static_cast<double>(p[j]);
      c_total += static_cast<double>(c[j]);
    }
    for (T& x : p) x = static_cast<T>(static_cast<double>(x) / p_total);
    for (const double lenience : {1.0, 0.6}) {
      const auto factor = static_cast<T>(lenience / c_total);
      std::vector<T> q(vocab);
      for (std::size_t j = 0; j < vocab; ++j) q[j] = factor * c[j];
      INFO("V = " << vocab << ", lenience " << lenience);
      const std::span<const T> ps(p);
      for (std::size_t k = 0; k < 257; ++k) {
        const double u = static_cast<double>(k) / 257.0;
        std::size_t next = 0;
        bool in_order = true;
        const auto fused = specdec::detail::residual_draw(
            ps, std::span<const T>(c), factor, u, [&](std::size_t first, std::size_t count) {
              in_order =
                  in_order && first == next && count > 0 && count <= specdec::detail::kernel_block;
              next = first + count;
            });
        const auto plain = specdec::detail::residual_draw(ps, std::span<const T>(q), T(1), u);
        CHECK(in_order);
        CHECK(next == vocab);
        CHECK(fused.token == plain.token);
        CHECK(fused.fallback == plain.fallback);
        CHECK(fused.mass == plain.mass);
      }
    }
  }
}

TEMPLATE_TEST_CASE("Sparse rows: draws and residuals over survivors give each token its weight",
                   "[residual_distribution]", float, double) {
  // The decoder keeps top-k rows as survivors (increasing ids, weights). Exact laws of the
  // real kernels: over a grid of N uniforms u = k / N an inverse-CDF draw gives token j for
  // a run of consecutive u whose length is N w_j / Z up to one grid step, so each count must
  // be within 1 (plus rounding) of N w_j / Z, for the plain draw, the residual
  // max(0, p - l q) (q merged by id, ids of q outside p ignored) and the one-hot residual.
  using T = TestType;
  using specdec::detail::sparse_row;
  specdec::xoshiro256pp g(41);
  constexpr std::size_t grid = 20000;
  const auto law_of = [](const auto& draw, std::size_t vocab) {
    std::vector<double> counts(vocab, 0.0);
    std::size_t out_of_range = 0;
    for (std::size_t k = 0; k < grid; ++k) {
      const std::size_t token = draw(static_cast<double>(k) / static_cast<double>(grid));
      if (token < vocab) {
        counts[token] += 1.0;
      } else {
        ++out_of_range;
      }
    }
    CHECK(out_of_range == 0);
    return counts;
  };
  const auto check_law = [](const std::vector<double>& counts, const std::vector<double>& w) {
    double total = 0.0;
    for (const double x : w) total += x;
    for (std::size_t j = 0; j < w.size(); ++j) {
      INFO("token " << j << " weight " << w[j] / total);
      CHECK(std::abs(counts[j] - static_cast<double>(grid) * w[j] / total) <= 1.0 + 1e-6);
    }
  };
  for (int trial = 0; trial < 40; ++trial) {
    const std::size_t vocab = 2 + specdec::uniform_below(g, 300);
    // Survivors of p and q: random subsets (increasing ids) with random weights.
    std::vector<std::uint32_t> p_ids;
    std::vector<std::uint32_t> q_ids;
    std::vector<T> p_w;
    std::vector<T> q_w;
    std::vector<double> p_dense(vocab, 0.0);
    std::vector<double> q_dense(vocab, 0.0);
    for (std::size_t j = 0; j < vocab; ++j) {
      if (specdec::uniform01<double>(g) < 0.3 || (j == vocab - 1 && p_ids.empty())) {
        p_ids.push_back(static_cast<std::uint32_t>(j));
        p_w.push_back(static_cast<T>(specdec::uniform01<double>(g) + 0.01));
        p_dense[j] = static_cast<double>(p_w.back());
      }
      if (specdec::uniform01<double>(g) < 0.3) {
        q_ids.push_back(static_cast<std::uint32_t>(j));
        q_w.push_back(static_cast<T>(specdec::uniform01<double>(g) + 0.01));
        q_dense[j] = static_cast<double>(q_w.back());
      }
    }
    const sparse_row<T> p{p_ids.data(), p_w.data(), p_ids.size()};
    const sparse_row<T> q{q_ids.data(), q_w.data(), q_ids.size()};
    INFO("trial " << trial << ", V = " << vocab);
    for (std::size_t j = 0; j < vocab; ++j) {
      CHECK(static_cast<double>(p.at(j)) == p_dense[j]);
      CHECK(static_cast<double>(q.at(j)) == q_dense[j]);
    }
    check_law(law_of([&](double u) { return specdec::detail::sparse_draw(p, u, 0); }, vocab),
              p_dense);
    double overlap = 0.0;
    for (std::size_t j = 0; j < vocab; ++j) overlap += std::min(p_dense[j], q_dense[j]);
    CHECK(specdec::detail::sparse_overlap(p, q) == Catch::Approx(overlap).epsilon(1e-12));
    std::vector<T> scratch(p_ids.size());
    for (const double lenience : {1.0, 0.5}) {
      std::vector<double> residual(vocab);
      double mass = 0.0;
      for (std::size_t j = 0; j < vocab; ++j) {
        residual[j] = std::max(
            0.0, static_cast<double>(static_cast<T>(
                     p_dense[j] -
                     static_cast<double>(static_cast<T>(lenience) * static_cast<T>(q_dense[j])))));
        mass += residual[j];
      }
      if (!(mass > 0.0)) continue;
      bool fallback = false;
      double drawn_mass = 0.0;
      check_law(law_of(
                    [&](double u) {
                      const auto draw = specdec::detail::sparse_residual_draw(
                          p, q, static_cast<T>(lenience), u, scratch.data());
                      fallback = fallback || draw.fallback;
                      drawn_mass = draw.mass;
                      return draw.token;
                    },
                    vocab),
                residual);
      CHECK_FALSE(fallback);
      CHECK(drawn_mass == Catch::Approx(mass).epsilon(1e-6));
    }
    // One-hot residual: p without the drafted token x (a survivor, or not).
    const std::size_t x = specdec::uniform_below(g, vocab);
    std::vector<double> without = p_dense;
    without[x] = 0.0;
    double without_mass = 0.0;
    for (const double w : without) without_mass += w;
    if (without_mass > 0.0) {
      check_law(law_of(
                    [&](double u) {
                      return specdec::detail::sparse_residual_one_hot_draw(p, x, 1.0, u).token;
                    },
                    vocab),
                without);
    }
  }
}
