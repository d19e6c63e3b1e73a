// Tests for include/specdec/block_verification.hpp: block verification's output law is the
// target's (exact enumeration of the real code, chi-square of sampled steps), it accepts the
// number of drafts analysis.hpp computes for it (never fewer than Algorithm 1), it is lazy,
// and each broken variant (the token rule, a residual without rho_n, h_i = rho_i, rho not
// capped at 1) fails a test here.
//
// The enumeration drives the real code: for a fixed drafted block, every acceptance
// threshold of the scan and every breakpoint of the final draw is found by bisection over the
// 53-bit uniforms the code consumes (ScriptedGenerator), so the probabilities enumerated are
// counts of uniform01 values, the implementation's own law.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "specdec/analysis.hpp"
#include "specdec/block_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/statistics.hpp"
#include "speculative_decoder_models.hpp"
#include "support/prefix_model.hpp"
#include "support/scripted_uniforms.hpp"
#include "support/sequence_law.hpp"
#include "support/token_law.hpp"

namespace {

using specdec::RowsView;
using specdec::token_id;
using specdec::VerificationResult;
using specdec::detail::block_rule;
using specdec::testing::ScriptedGenerator;

constexpr std::uint64_t grid = specdec::testing::uniform_grid;
using specdec::testing::extend;
using specdec::testing::first_true;
using specdec::testing::PrefixModel;
using specdec::testing::random_model;

/// A draft / target pair and the draft length it is verified at.
struct Pair {
  std::string name;
  PrefixModel draft;
  PrefixModel target;
  std::size_t gamma;
};

/// Random pairs with V = 2..4, gamma 1..3: independent rows, rows with zeros on either side,
/// q = p, and the paper's example (p = (1/3, 2/3), q = (2/3, 1/3), gamma 2).
std::vector<Pair> test_pairs() {
  specdec::xoshiro256pp g(2025);
  std::vector<Pair> pairs;
  for (int k = 0; k < 12; ++k) {
    const std::size_t vocab = 2 + static_cast<std::size_t>(k % 3);
    const std::size_t gamma = 1 + static_cast<std::size_t>(k % 4 == 3 ? 2 : k % 3);
    const double zeros = k % 2 == 0 ? 0.0 : 0.3;
    pairs.push_back({"random " + std::to_string(k), random_model(vocab, g, zeros),
                     random_model(vocab, g, zeros), gamma});
  }
  const PrefixModel same = random_model(3, g, 0.2);
  pairs.push_back({"q = p", same, same, 3});
  pairs.push_back({"paper example", PrefixModel{2, {{2.0 / 3.0, 1.0 / 3.0}}},
                   PrefixModel{2, {{1.0 / 3.0, 2.0 / 3.0}}}, 2});
  return pairs;
}

/// One drafted block's rows: q_1..q_gamma and p_1..p_{gamma+1}, row-major, in T.
template <class T>
struct BlockRows {
  std::vector<token_id> drafts;
  std::vector<T> draft;
  std::vector<T> target;
  std::size_t vocab = 0;

  BlockRows(const Pair& pair, std::span<const token_id> block)
      : drafts(block.begin(), block.end()), vocab(pair.target.vocab) {
    for (std::size_t i = 0; i <= block.size(); ++i) {
      const auto prefix = block.first(i);
      for (const double x : pair.target(prefix)) target.push_back(static_cast<T>(x));
      if (i < block.size()) {
        for (const double x : pair.draft(prefix)) draft.push_back(static_cast<T>(x));
      }
    }
  }
  [[nodiscard]] RowsView<const T> q() const { return {draft.data(), drafts.size(), vocab}; }
  [[nodiscard]] RowsView<const T> p() const { return {target.data(), drafts.size() + 1, vocab}; }
};

/// The verifier under test: block verification with a rule (exact or a broken variant), or
/// Algorithm 1 (verify_speculative), on model drafts.
enum class verifier {
  block,
  block_proposals,
  residual_without_rho,
  h_without_z,
  uncapped_rho,
  token_rule
};

template <class T, class G>
VerificationResult run_verifier(verifier which, const BlockRows<T>& rows, G& g) {
  const std::span<const token_id> drafts(rows.drafts);
  switch (which) {
    case verifier::block:
      return specdec::verify_block(drafts, rows.q(), rows.p(), g);
    case verifier::block_proposals:
      return specdec::verify_block_proposals(drafts, rows.p(), g);
    case verifier::residual_without_rho:
      return specdec::detail::verify_block_rows<block_rule::residual_without_rho, false>(
          drafts, rows.q(), rows.p(), g);
    case verifier::h_without_z:
      return specdec::detail::verify_block_rows<block_rule::h_without_z, false>(drafts, rows.q(),
                                                                                rows.p(), g);
    case verifier::uncapped_rho:
      return specdec::detail::verify_block_rows<block_rule::uncapped_rho, false>(drafts, rows.q(),
                                                                                 rows.p(), g);
    case verifier::token_rule:
      return specdec::verify_speculative(drafts, rows.q(), rows.p(), g);
  }
  return {};
}

/// Runs the verifier with scripted uniforms k * 2^-53 (then zeros) and checks how many it
/// consumed: one per examined position of the scan (gamma - n + 1 for n > 0, gamma for
/// n = 0), then one for the draw.
template <class T>
VerificationResult scripted(verifier which, const BlockRows<T>& rows,
                            const std::vector<std::uint64_t>& ks) {
  ScriptedGenerator g;
  for (const std::uint64_t k : ks) g.outputs.push_back(k << 11U);
  for (int pad = 0; pad < 4; ++pad) g.outputs.push_back(0);
  const VerificationResult result = run_verifier(which, rows, g);
  const std::size_t gamma = rows.drafts.size();
  const std::size_t n = result.accepted;
  const std::size_t scan = n > 0 ? gamma - n + 1 : gamma;
  CHECK(g.next == scan + 1);
  return result;
}

/// The law of (n, t) of one verification of a fixed drafted block by the real code:
/// law[n][t].
template <class T>
std::vector<std::vector<double>> probe_block(verifier which, const BlockRows<T>& rows) {
  const std::size_t gamma = rows.drafts.size();
  const std::size_t vocab = rows.vocab;
  std::vector<std::vector<double>> law(gamma + 1, std::vector<double>(vocab, 0.0));
  const auto draw_law = [&](std::vector<std::uint64_t> prefix, double weight,
                            std::vector<double>& out) {
    std::uint64_t from = 0;
    while (from < grid) {
      prefix.push_back(from);
      const token_id token = scripted(which, rows, prefix).token;
      prefix.pop_back();
      const std::uint64_t to = first_true(from + 1, [&](std::uint64_t k) {
        std::vector<std::uint64_t> ks = prefix;
        ks.push_back(k);
        return scripted(which, rows, ks).token != token;
      });
      out[static_cast<std::size_t>(token)] +=
          weight * static_cast<double>(to - from) / static_cast<double>(grid);
      from = to;
    }
  };
  double reach = 1.0;                   // P(the scan fails at every position above i)
  std::vector<std::uint64_t> rejected;  // u = 1 - 2^-53 at each position above i
  for (std::size_t i = gamma; i >= 1 && reach > 0.0; --i) {
    // Position i accepts for k < K: K / 2^53 = P(u_i < h_i).
    const std::uint64_t threshold = first_true(0, [&](std::uint64_t k) {
      std::vector<std::uint64_t> ks = rejected;
      ks.push_back(k);
      return scripted(which, rows, ks).accepted != i;
    });
    const double accept = static_cast<double>(threshold) / static_cast<double>(grid);
    if (threshold > 0) {
      std::vector<std::uint64_t> ks = rejected;
      ks.push_back(0);
      draw_law(ks, reach * accept, law[i]);
    }
    reach *= 1.0 - accept;
    rejected.push_back(grid - 1);
  }
  if (reach > 0.0) draw_law(rejected, reach, law[0]);
  return law;
}

/// Probability of each emitted sequence x_1..x_n, t of one step, drafts x ~ q.
using Law = specdec::testing::TokenLaw;
using specdec::testing::law_total_variation;
using specdec::testing::max_difference;

template <class T>
Law step_law(const Pair& pair, verifier which, double* mean_accepted = nullptr,
             double* mean_square = nullptr) {
  Law law;
  const std::size_t vocab = pair.target.vocab;
  std::vector<token_id> block(pair.gamma, 0);
  double first = 0.0;
  double second = 0.0;
  // Every block x in V^gamma with its draft probability.
  std::size_t blocks = 1;
  for (std::size_t i = 0; i < pair.gamma; ++i) blocks *= vocab;
  for (std::size_t code = 0; code < blocks; ++code) {
    std::size_t rest = code;
    double probability = 1.0;
    for (std::size_t i = 0; i < pair.gamma; ++i) {
      block[i] = static_cast<token_id>(rest % vocab);
      rest /= vocab;
      probability *=
          pair.draft(std::span<const token_id>(block).first(i))[static_cast<std::size_t>(block[i])];
    }
    if (probability == 0.0) continue;
    const BlockRows<T> rows(pair, block);
    const auto outcome = probe_block(which, rows);
    for (std::size_t n = 0; n <= pair.gamma; ++n) {
      for (std::size_t t = 0; t < vocab; ++t) {
        const double mass = probability * outcome[n][t];
        if (mass == 0.0) continue;
        std::vector<token_id> emitted(block.begin(),
                                      block.begin() + static_cast<std::ptrdiff_t>(n));
        emitted.push_back(static_cast<token_id>(t));
        law[emitted] += mass;
        first += mass * static_cast<double>(n);
        second += mass * static_cast<double>(n * n);
      }
    }
  }
  if (mean_accepted != nullptr) *mean_accepted = first;
  if (mean_square != nullptr) *mean_square = second;
  return law;
}

Law target_law(const Pair& pair) {
  return extend(Law{{{}, 1.0}}, pair.target, pair.gamma + 1);
}

double exact_expectation(const Pair& pair, specdec::verification_rule rule) {
  return specdec::expected_accepted_drafts(pair.draft, pair.target, pair.target.vocab, pair.gamma,
                                           rule);
}

}  // namespace

TEST_CASE("Block verification: the paper's example accepts 11/9 drafts, Algorithm 1 10/9",
          "[block_verification][analysis]") {
  const PrefixModel q{2, {{2.0 / 3.0, 1.0 / 3.0}}};
  const PrefixModel p{2, {{1.0 / 3.0, 2.0 / 3.0}}};
  CHECK(std::abs(specdec::expected_accepted_drafts(q, p, 2, 2, specdec::verification_rule::token) -
                 10.0 / 9.0) < 1e-15);
  CHECK(std::abs(specdec::expected_accepted_drafts(q, p, 2, 2, specdec::verification_rule::block) -
                 11.0 / 9.0) < 1e-15);
  // gamma 1: block verification is Algorithm 1 (h_1 = rho_1 = min(1, p / q)).
  CHECK(std::abs(specdec::expected_accepted_drafts(q, p, 2, 1, specdec::verification_rule::block) -
                 specdec::expected_accepted_drafts(q, p, 2, 1, specdec::verification_rule::token)) <
        1e-15);
}

TEMPLATE_TEST_CASE(
    "Block verification, enumerated on the real code: gamma + 1 tokens follow "
    "the target law, and the mean accepted drafts are analysis.hpp's",
    "[block_verification][exactness]", double, float) {
  // Double rows: the law to 1e-12. Float rows: to the rows' own rounding (1e-6).
  const double tolerance = std::is_same_v<TestType, double> ? 1e-12 : 2e-6;
  std::size_t gains = 0;
  for (const Pair& pair : test_pairs()) {
    double mean = 0.0;
    const Law law = step_law<TestType>(pair, verifier::block, &mean);
    INFO(pair.name << ", V = " << pair.target.vocab << ", gamma = " << pair.gamma);
    CHECK(max_difference(extend(law, pair.target, pair.gamma + 1), target_law(pair)) < tolerance);
    const double block = exact_expectation(pair, specdec::verification_rule::block);
    const double token = exact_expectation(pair, specdec::verification_rule::token);
    CHECK(std::abs(mean - block) < tolerance);
    CHECK(block >= token - 1e-12);  // never fewer accepted drafts than Algorithm 1
    if (block > token + 1e-3) ++gains;
    if (pair.name == "q = p") CHECK(std::abs(mean - static_cast<double>(pair.gamma)) < tolerance);
  }
  CHECK(gains >= 4);  // the pairs show the gain, not only ties
}

TEST_CASE(
    "Block verification of proposals, enumerated on the real code: the target law, "
    "Algorithm 1's expectation",
    "[block_verification][exactness]") {
  for (const Pair& pair : test_pairs()) {
    double mean = 0.0;
    const Law law = step_law<double>(pair, verifier::block_proposals, &mean);
    INFO(pair.name);
    CHECK(max_difference(extend(law, pair.target, pair.gamma + 1), target_law(pair)) < 1e-12);
    // With a one-hot q, E[n] is Algorithm 1's for one-hot q: sum_i E[prod_{j <= i} p_j(x_j)].
    double expected = 0.0;
    const std::size_t vocab = pair.target.vocab;
    std::size_t blocks = 1;
    for (std::size_t i = 0; i < pair.gamma; ++i) blocks *= vocab;
    std::vector<token_id> block(pair.gamma);
    for (std::size_t code = 0; code < blocks; ++code) {
      std::size_t rest = code;
      double drafted = 1.0;
      for (std::size_t i = 0; i < pair.gamma; ++i) {
        block[i] = static_cast<token_id>(rest % vocab);
        rest /= vocab;
        drafted *= pair.draft(
            std::span<const token_id>(block).first(i))[static_cast<std::size_t>(block[i])];
      }
      // Position i is accepted with probability prod_{j <= i} p_j(x_j) (q one-hot).
      double running = 1.0;
      double sum = 0.0;
      for (std::size_t i = 0; i < pair.gamma; ++i) {
        running *= pair.target(
            std::span<const token_id>(block).first(i))[static_cast<std::size_t>(block[i])];
        sum += running;
      }
      expected += drafted * sum;
    }
    CHECK(std::abs(mean - expected) < 1e-12);
  }
}

TEST_CASE("Block verification enumeration catches every broken variant",
          "[block_verification][exactness]") {
  for (const verifier broken :
       {verifier::residual_without_rho, verifier::h_without_z, verifier::uncapped_rho}) {
    double worst = 0.0;
    for (const Pair& pair : test_pairs()) {
      const Law law = step_law<double>(pair, broken);
      worst = std::max(worst,
                       max_difference(extend(law, pair.target, pair.gamma + 1), target_law(pair)));
    }
    INFO("variant " << static_cast<int>(broken));
    CHECK(worst > 1e-3);
  }
}

namespace {

/// Samples `samples` steps: x ~ q along the prefix, verification, then the emitted tokens
/// extended to gamma + 1 by sampling from p. Returns the counts of each sequence (indexed as
/// in `cells`) and the mean number of accepted drafts.
struct Sampled {
  std::vector<std::uint64_t> counts;
  double mean_accepted = 0.0;
};

Sampled sample_steps(const Pair& pair, verifier which, std::size_t samples,
                     const std::map<std::vector<token_id>, std::size_t>& cells,
                     std::uint64_t seed) {
  specdec::xoshiro256pp g(seed);
  Sampled out;
  out.counts.assign(cells.size(), 0);
  std::vector<token_id> block(pair.gamma);
  double accepted = 0.0;
  for (std::size_t s = 0; s < samples; ++s) {
    for (std::size_t i = 0; i < pair.gamma; ++i) {
      const auto& q = pair.draft(std::span<const token_id>(block).first(i));
      block[i] = specdec::sample_from_row(std::span<const double>(q), g);
    }
    const BlockRows<double> rows(pair, block);
    const VerificationResult result = run_verifier(which, rows, g);
    accepted += static_cast<double>(result.accepted);
    std::vector<token_id> sequence(block.begin(),
                                   block.begin() + static_cast<std::ptrdiff_t>(result.accepted));
    sequence.push_back(result.token);
    while (sequence.size() < pair.gamma + 1) {
      sequence.push_back(
          specdec::sample_from_row(std::span<const double>(pair.target(sequence)), g));
    }
    ++out.counts[cells.at(sequence)];
  }
  out.mean_accepted = accepted / static_cast<double>(samples);
  return out;
}

specdec::stats::ChiSquareResult chi_square(
    const Law& expected, const Sampled& sampled,
    const std::map<std::vector<token_id>, std::size_t>& cells) {
  std::vector<double> probabilities(cells.size(), 0.0);
  for (const auto& [sequence, cell] : cells) {
    const auto it = expected.find(sequence);
    probabilities[cell] = it == expected.end() ? 0.0 : it->second;
  }
  return specdec::stats::chi_square_test(sampled.counts, probabilities);
}

/// Every sequence of gamma + 1 tokens, numbered.
std::map<std::vector<token_id>, std::size_t> all_cells(const Pair& pair) {
  std::map<std::vector<token_id>, std::size_t> cells;
  std::size_t total = 1;
  for (std::size_t i = 0; i <= pair.gamma; ++i) total *= pair.target.vocab;
  for (std::size_t code = 0; code < total; ++code) {
    std::vector<token_id> sequence(pair.gamma + 1);
    std::size_t rest = code;
    for (auto& token : sequence) {
      token = static_cast<token_id>(rest % pair.target.vocab);
      rest /= pair.target.vocab;
    }
    cells.emplace(sequence, code);
  }
  return cells;
}

}  // namespace

TEST_CASE(
    "Block verification, sampled: chi-square of gamma + 1 tokens against the target law; "
    "each broken variant fails it",
    "[block_verification][exactness][statistical]") {
  const auto pairs = test_pairs();
  // The exact rule on the pairs with the largest gain over Algorithm 1.
  for (const std::size_t index : {2UL, 7UL, 12UL}) {
    const Pair& pair = pairs[index];
    const auto cells = all_cells(pair);
    const Law expected = target_law(pair);
    const std::size_t samples = specdec::testing::scaled_samples_to_detect(0.01, cells.size());
    const Sampled sampled = sample_steps(pair, verifier::block, samples, cells, 77 + index);
    const auto result = chi_square(expected, sampled, cells);
    INFO(pair.name << ": " << result.describe());
    CHECK(result.passed());
  }
  // Each broken variant, on the pair where its law is furthest from the target's, with
  // enough samples to detect that distance at the same false-failure rate.
  for (const verifier broken :
       {verifier::residual_without_rho, verifier::h_without_z, verifier::uncapped_rho}) {
    std::size_t worst_pair = 0;
    double worst = 0.0;
    for (std::size_t k = 0; k < pairs.size(); ++k) {
      const double tv = law_total_variation(
          extend(step_law<double>(pairs[k], broken), pairs[k].target, pairs[k].gamma + 1),
          target_law(pairs[k]));
      if (tv > worst) {
        worst = tv;
        worst_pair = k;
      }
    }
    const Pair& pair = pairs[worst_pair];
    const auto cells = all_cells(pair);
    const std::size_t samples =
        specdec::stats::samples_to_detect(worst, static_cast<double>(cells.size()));
    const Sampled sampled = sample_steps(pair, broken, samples, cells, 99);
    const auto result = chi_square(target_law(pair), sampled, cells);
    INFO("variant " << static_cast<int>(broken) << " on " << pair.name << " (TV " << worst
                    << "): " << result.describe());
    CHECK_FALSE(result.passed());
  }
}

TEST_CASE(
    "Block verification, sampled: the mean accepted drafts per step are the exact "
    "expectation; Algorithm 1's fall short of it",
    "[block_verification][statistical]") {
  const auto pairs = test_pairs();
  // z threshold for a two-sided false-failure rate of 1e-9.
  const double z_critical = 6.1094;
  // The two pairs with the largest gain over Algorithm 1, and the paper's example (last).
  std::vector<std::pair<double, std::size_t>> gains;
  for (std::size_t k = 0; k + 1 < pairs.size(); ++k) {
    gains.emplace_back(exact_expectation(pairs[k], specdec::verification_rule::block) -
                           exact_expectation(pairs[k], specdec::verification_rule::token),
                       k);
  }
  std::sort(gains.rbegin(), gains.rend());
  for (const std::size_t index : {gains[0].second, gains[1].second, pairs.size() - 1}) {
    const Pair& pair = pairs[index];
    double mean = 0.0;
    double square = 0.0;
    (void)step_law<double>(pair, verifier::block, &mean, &square);
    const double variance = square - mean * mean;
    const double gap = mean - exact_expectation(pair, specdec::verification_rule::token);
    REQUIRE(gap > 0.01);
    // Enough samples that the token rule's mean lies 2 z_critical standard errors away.
    const auto samples = static_cast<std::size_t>(
        std::ceil(std::pow(2.0 * z_critical, 2.0) * variance / (gap * gap)));
    const auto cells = all_cells(pair);
    const Sampled block = sample_steps(pair, verifier::block, samples, cells, 5 + index);
    const Sampled token = sample_steps(pair, verifier::token_rule, samples, cells, 5 + index);
    const double error = std::sqrt(variance / static_cast<double>(samples));
    INFO(pair.name << ": E[n] " << mean << ", block " << block.mean_accepted << ", token rule "
                   << token.mean_accepted << ", standard error " << error << ", " << samples
                   << " steps");
    CHECK(std::abs(block.mean_accepted - mean) <= z_critical * error);
    CHECK(std::abs(token.mean_accepted - mean) > z_critical * error);
  }
}

TEMPLATE_TEST_CASE(
    "Block verification is lazy: row pairs below n are read at their drafted "
    "entries only",
    "[block_verification]", double, float) {
  const auto pairs = test_pairs();
  const Pair& pair = pairs[7];
  REQUIRE(pair.gamma >= 2);
  std::vector<token_id> block(pair.gamma, 1);
  const BlockRows<TestType> rows(pair, block);
  for (std::size_t stop = 1; stop <= pair.gamma; ++stop) {
    // Uniforms that reject every position above `stop`, accept at `stop` (u = 0 when its
    // weight is positive), then draw.
    std::vector<std::uint64_t> ks(pair.gamma - stop, grid - 1);
    ks.push_back(0);
    ks.push_back(grid / 3);
    const VerificationResult clean = scripted(verifier::block, rows, ks);
    if (clean.accepted != stop) continue;  // h_stop = 0 here
    // Poison every entry of p_1..p_stop and q_1..q_stop except the drafted ones.
    BlockRows<TestType> poisoned = rows;
    const std::size_t vocab = rows.vocab;
    for (std::size_t i = 0; i < stop; ++i) {
      for (std::size_t x = 0; x < vocab; ++x) {
        if (x == static_cast<std::size_t>(block[i])) continue;
        poisoned.target[i * vocab + x] = std::numeric_limits<TestType>::quiet_NaN();
        poisoned.draft[i * vocab + x] = std::numeric_limits<TestType>::quiet_NaN();
      }
    }
    const VerificationResult lazy = scripted(verifier::block, poisoned, ks);
    INFO("stopped at " << stop);
    CHECK(lazy == clean);
  }
}

TEMPLATE_TEST_CASE(
    "Block verification is lazy above n: a position whose uniform reaches the bound on its "
    "weight reads no row",
    "[block_verification]", double, float) {
  // Every drafted block of every pair. The positions the scan rejects above `stop` get u just
  // below 1, at or above the bound Z_max / (Z_max + 1 - rho) that the drafted entries give
  // (rho < 1 wherever the scan rejects). Their target rows, except the drafted entries, are
  // inflated to 1e30: a scan that read one would find a huge Z there (h = 1) and stop at that
  // position instead.
  std::size_t inflated_positions = 0;
  for (const Pair& pair : test_pairs()) {
    const std::size_t vocab = pair.target.vocab;
    std::size_t blocks = 1;
    for (std::size_t i = 0; i < pair.gamma; ++i) blocks *= vocab;
    for (std::size_t code = 0; code < blocks; ++code) {
      std::vector<token_id> block(pair.gamma);
      for (std::size_t i = 0, rest = code; i < pair.gamma; ++i, rest /= vocab) {
        block[i] = static_cast<token_id>(rest % vocab);
      }
      const BlockRows<TestType> rows(pair, block);
      for (std::size_t stop = 0; stop + 1 < pair.gamma; ++stop) {
        std::vector<std::uint64_t> ks(1, grid - 1);  // no bonus (where rho_gamma < 1)
        ks.insert(ks.end(), pair.gamma - 1 - stop, grid - 1);
        if (stop > 0) ks.push_back(0);  // h_0 = 1 takes no uniform
        ks.push_back(grid / 3);
        const VerificationResult clean = scripted(verifier::block, rows, ks);
        if (clean.accepted != stop) continue;
        BlockRows<TestType> inflated = rows;
        for (std::size_t i = stop + 1; i < pair.gamma; ++i) {
          for (std::size_t x = 0; x < vocab; ++x) {
            if (x != static_cast<std::size_t>(block[i])) inflated.target[i * vocab + x] = 1e30F;
          }
          ++inflated_positions;
        }
        INFO(pair.name << ", block " << code << ", stopped at " << stop);
        CHECK(scripted(verifier::block, inflated, ks) == clean);
      }
    }
  }
  CHECK(inflated_positions >= 20);
}

TEMPLATE_TEST_CASE("Block verification takes Eigen matrices and RowsView alike",
                   "[block_verification]", double, float) {
  const auto pairs = test_pairs();
  const std::vector<token_id> block(pairs[1].gamma, 0);
  const BlockRows<TestType> rows(pairs[1], block);
  using Matrix = Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const Matrix> q(rows.draft.data(), static_cast<Eigen::Index>(block.size()),
                                   static_cast<Eigen::Index>(rows.vocab));
  const Eigen::Map<const Matrix> p(rows.target.data(), static_cast<Eigen::Index>(block.size() + 1),
                                   static_cast<Eigen::Index>(rows.vocab));
  const Matrix q_copy = q;
  const Matrix p_copy = p;
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    specdec::xoshiro256pp a(seed);
    specdec::xoshiro256pp b(seed);
    specdec::xoshiro256pp c(seed);
    const auto expected =
        specdec::verify_block(std::span<const token_id>(block), rows.q(), rows.p(), a);
    CHECK(specdec::verify_block(std::span<const token_id>(block), q_copy, p_copy, b) == expected);
    CHECK(specdec::verify_block_checked(std::span<const token_id>(block), q_copy, p_copy, c) ==
          expected);
    specdec::xoshiro256pp d(seed);
    specdec::xoshiro256pp e(seed);
    CHECK(specdec::verify_block_proposals(std::span<const token_id>(block), p_copy, d) ==
          specdec::verify_block_proposals_checked(std::span<const token_id>(block), rows.p(), e));
  }
}

namespace {

/// The decoder's rows after `context` + prefix, standardized as the decoder standardizes
/// them: a function of the drafted prefix for expected_accepted_drafts.
struct StandardizedRows {
  const specdec::testing::MarkovModel<double>* model;
  std::vector<token_id> context;
  specdec::SamplingOptions sampling;

  [[nodiscard]] std::vector<double> operator()(std::span<const token_id> prefix) const {
    std::vector<token_id> sequence = context;
    sequence.insert(sequence.end(), prefix.begin(), prefix.end());
    const auto raw = model->row(model->state(sequence));
    std::vector<double> out(raw.size());
    specdec::Standardizer<double> standardizer(sampling);
    standardizer.apply(raw, std::span<double>(out));
    return out;
  }
};

}  // namespace

TEST_CASE(
    "SpeculativeDecoder: block verification by default accepts the exact expected "
    "number of drafts; the token rule accepts Algorithm 1's",
    "[block_verification][speculative_decoder][statistical]") {
  // Steps after one fixed context: the mean accepted drafts per step against
  // expected_accepted_drafts for each rule, at T = 1 (fused dense path), T = 1.5 with top-k
  // (survivors) and T = 1.3 with top-p and min-p (standardized dense rows). A decoder that verified
  // with the other rule would fail: the number of steps puts the two expectations 2 z_critical
  // standard errors apart.
  const double z_critical = 6.1094;  // two-sided, false-failure rate 1e-9
  constexpr std::size_t vocab = 6;
  constexpr std::size_t gamma = 3;
  const auto target = specdec::testing::make_markov_target(vocab, 1, 33);
  const auto draft = specdec::testing::make_markov_draft(target, 34);
  const std::vector<token_id> context{1, 2};
  for (const specdec::SamplingOptions& sampling :
       {specdec::SamplingOptions{}, specdec::SamplingOptions{.temperature = 1.5, .top_k = 5},
        specdec::SamplingOptions{.temperature = 1.3, .top_p = 0.95, .min_p = 0.02}}) {
    const StandardizedRows q{&draft, context, sampling};
    const StandardizedRows p{&target, context, sampling};
    const double block =
        specdec::expected_accepted_drafts(q, p, vocab, gamma, specdec::verification_rule::block);
    const double token =
        specdec::expected_accepted_drafts(q, p, vocab, gamma, specdec::verification_rule::token);
    INFO("T = " << sampling.temperature << ", top-k " << sampling.top_k << ", top-p "
                << sampling.top_p << ": block " << block << ", token rule " << token);
    REQUIRE(block > token + 0.05);
    // Var(n) <= E[n] (gamma - E[n]) for n in [0, gamma] (Bhatia-Davis), under either rule;
    // enough steps for 2 z_critical standard errors between the two expectations.
    const double variance = std::max(block * (gamma - block), token * (gamma - token));
    const auto steps = static_cast<std::size_t>(
        std::ceil(std::pow(2.0 * z_critical / (block - token), 2.0) * variance));
    for (const auto rule :
         {specdec::verification_rule::automatic, specdec::verification_rule::token}) {
      auto target_model = target;
      auto draft_model = draft;
      specdec::DecoderOptions options{.sampling = sampling,
                                      .gamma_policy = specdec::FixedGamma(gamma)};
      options.verification = rule;
      specdec::SpeculativeDecoder decoder(target_model, draft_model, options);
      specdec::xoshiro256pp g(808);
      double accepted = 0.0;
      for (std::size_t s = 0; s < steps; ++s) {
        accepted += static_cast<double>(decoder.step(context, g).accepted);
      }
      const double mean = accepted / static_cast<double>(steps);
      const double expected = rule == specdec::verification_rule::token ? token : block;
      const double other = rule == specdec::verification_rule::token ? block : token;
      const double error = std::sqrt(variance / static_cast<double>(steps));
      INFO("T = " << sampling.temperature << ", top-k " << sampling.top_k << ", top-p "
                  << sampling.top_p << ", rule " << specdec::to_string(rule) << ": mean " << mean
                  << ", expected " << expected << " (other rule " << other << "), " << steps
                  << " steps");
      CHECK(std::abs(mean - expected) <= z_critical * error);
      CHECK(std::abs(mean - other) > z_critical * error);
      CHECK(std::abs(decoder.statistics().accepted_per_step() - mean) < 1e-12);
    }
  }
}
