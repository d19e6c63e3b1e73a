// Bad-input catalogue, analysis.hpp and drafters/ (docs/errors.md, rows A* and R*). One
// test case per catalogue row.
#include <catch2/catch_test_macros.hpp>

#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "errors_catalogue.hpp"
#include "specdec/analysis.hpp"
#include "specdec/drafters/count_models.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/error.hpp"

namespace {

using specdec::errc;
using specdec::token_id;
using specdec::testing::check_error;

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
constexpr double infinity = std::numeric_limits<double>::infinity();

}  // namespace

// --- analysis.hpp --------------------------------------------------------------------------

TEST_CASE("A1 analysis: alpha (or a per-position beta) outside 0..1", "[errors][analysis]") {
  for (const double alpha : {-0.1, 1.5, not_a_number}) {
    check_error(
        "A1", [&] { (void)specdec::expected_tokens_per_step(alpha, 4); }, errc::domain,
        "expected_tokens_per_step: alpha = ");
    check_error(
        "A1", [&] { (void)specdec::walltime_improvement(alpha, 4, 0.1); }, errc::domain,
        "walltime_improvement: alpha");
    check_error(
        "A1", [&] { (void)specdec::arithmetic_operations_factor(alpha, 4, 0.1); }, errc::domain,
        "arithmetic_operations_factor: alpha");
    check_error(
        "A1", [&] { (void)specdec::min_improvement_bound(alpha, 0.1); }, errc::domain,
        "min_improvement_bound: alpha");
    check_error(
        "A1", [&] { (void)specdec::oracle_improvement_bound(alpha); }, errc::domain,
        "oracle_improvement_bound: alpha");
    check_error(
        "A1", [&] { (void)specdec::optimal_gamma(alpha, 0.1, 8); }, errc::domain,
        "optimal_gamma: alpha");
    const std::vector<double> betas{0.5, alpha};
    check_error(
        "A1", [&] { (void)specdec::expected_tokens_per_step(betas); }, errc::domain,
        "a per-position beta");
    specdec::BetaEstimator estimator;
    check_error(
        "A1", [&] { estimator.observe(alpha); }, errc::domain, "BetaEstimator::observe: beta");
  }
}

TEST_CASE("A2 analysis: gamma = 0", "[errors][analysis]") {
  check_error(
      "A2", [] { (void)specdec::expected_tokens_per_step(0.5, 0); }, errc::domain,
      "expected_tokens_per_step: gamma = 0 must be >= 1");
  check_error(
      "A2", [] { (void)specdec::walltime_improvement(0.5, 0, 0.1); }, errc::domain, "gamma = 0");
  check_error(
      "A2", [] { (void)specdec::arithmetic_operations_factor(0.5, 0, 0.1); }, errc::domain,
      "gamma = 0");
  const std::vector<double> no_betas;
  check_error(
      "A2", [&] { (void)specdec::expected_tokens_per_step(no_betas); }, errc::domain,
      "(number of betas): gamma = 0");
  check_error(
      "A2", [] { (void)specdec::optimal_gamma(0.5, 0.1, 0); }, errc::domain,
      "optimal_gamma: max_gamma = 0 must be >= 1");
}

TEST_CASE("A3 analysis: cost ratio c negative or not finite", "[errors][analysis]") {
  for (const double c : {-0.1, infinity, not_a_number}) {
    check_error(
        "A3", [&] { (void)specdec::walltime_improvement(0.5, 4, c); }, errc::domain,
        "walltime_improvement: c = ");
    check_error(
        "A3", [&] { (void)specdec::arithmetic_operations_factor(0.5, 4, c); }, errc::domain,
        "c_hat = ");
    check_error(
        "A3", [&] { (void)specdec::min_improvement_bound(0.5, c); }, errc::domain,
        "must be finite and >= 0");
    check_error(
        "A3", [&] { (void)specdec::optimal_gamma(0.5, c, 8); }, errc::domain,
        "optimal_gamma: c = ");
  }
}

TEST_CASE("A4 beta / lk_divergence / lenient_beta: rows of different lengths",
          "[errors][analysis]") {
  const std::vector<double> p{0.5, 0.5};
  const std::vector<double> q{0.2, 0.3, 0.5};
  check_error(
      "A4", [&] { (void)specdec::beta(p, q); }, errc::invalid_size,
      "beta: target p has 2 entries but draft q has 3");
  check_error(
      "A4", [&] { (void)specdec::lk_divergence(p, q); }, errc::invalid_size,
      "target p has 2 entries");
  check_error(
      "A4", [&] { (void)specdec::lenient_beta(p, q, 0.5); }, errc::invalid_size,
      "target p has 2 entries");
}

TEST_CASE("A5 beta / lk_divergence / lenient_beta: NaN / infinite or negative entries",
          "[errors][analysis]") {
  const std::vector<double> p{0.5, 0.5};
  for (const double bad : {not_a_number, infinity, -0.25}) {
    const std::vector<double> q{bad, 0.5};
    check_error(
        "A5", [&] { (void)specdec::beta(p, q); }, errc::invalid_probability,
        "beta: draft q, token 0: probability ");
    check_error(
        "A5", [&] { (void)specdec::lk_divergence(q, p); }, errc::invalid_probability,
        "target p, token 0");
  }
  // Rows need not sum to 1 here (documented): no error for an unnormalised pair.
  const std::vector<double> unnormalised{2.0, 0.0};
  CHECK_NOTHROW(specdec::beta(p, unnormalised));
}

TEST_CASE("A6 lenient_beta: lenience outside 0 < x <= 1", "[errors][analysis]") {
  const std::vector<double> p{0.5, 0.5};
  for (const double lenience : {0.0, 1.5, not_a_number}) {
    check_error(
        "A6", [&] { (void)specdec::lenient_beta(p, p, lenience); }, errc::domain,
        "lenient_beta: lenience l = ");
  }
}

TEST_CASE("A7 AcceptanceEstimator / BetaEstimator::estimate: confidence outside 0 < x < 1",
          "[errors][analysis]") {
  specdec::AcceptanceEstimator acceptance;
  specdec::BetaEstimator betas;
  for (const double confidence : {0.0, 1.0, -0.5, not_a_number}) {
    check_error(
        "A7", [&] { (void)acceptance.estimate(confidence); }, errc::domain,
        "AcceptanceEstimator::estimate: confidence = ");
    check_error(
        "A7", [&] { (void)betas.estimate(confidence); }, errc::domain,
        "BetaEstimator::estimate: confidence = ");
  }
}

TEST_CASE("A8 AcceptanceEstimator::observe_step: accepted > drafted", "[errors][analysis]") {
  specdec::AcceptanceEstimator estimator;
  check_error(
      "A8", [&] { estimator.observe_step(3, 4); }, errc::domain,
      "AcceptanceEstimator::observe_step: accepted = 4");
  CHECK(estimator.steps() == 0);  // the bad observation was not recorded
}

// --- drafters/ -----------------------------------------------------------------------------

TEST_CASE("R1 UnigramModel / BigramModel: vocabulary size 0", "[errors][drafters]") {
  const std::vector<token_id> corpus;
  check_error(
      "R1", [&] { specdec::UnigramModel<float> model(corpus, 0); }, errc::invalid_size,
      "vocab_size must be > 0");
  check_error(
      "R1", [&] { specdec::BigramModel<float> model(corpus, 0); }, errc::invalid_size,
      "vocab_size must be > 0");
}

TEST_CASE("R2 UnigramModel / BigramModel: add_k negative or not finite", "[errors][drafters]") {
  const std::vector<token_id> corpus{0, 1};
  for (const double add_k : {-1.0, not_a_number, infinity}) {
    check_error(
        "R2", [&] { specdec::UnigramModel<float> model(corpus, 4, add_k); }, errc::invalid_option,
        "add_k must be finite and >= 0");
    check_error(
        "R2", [&] { specdec::BigramModel<double> model(corpus, 4, add_k); }, errc::invalid_option,
        "add_k must be finite and >= 0");
  }
}

TEST_CASE("R3 UnigramModel / BigramModel: corpus token outside 0..V-1", "[errors][drafters]") {
  const std::vector<token_id> corpus{0, 1, 4};
  check_error(
      "R3", [&] { specdec::UnigramModel<float> model(corpus, 4); }, errc::invalid_token,
      "corpus position 2: token 4 is outside the vocabulary [0, 4)");
  const std::vector<token_id> negative{-1};
  check_error(
      "R3", [&] { specdec::BigramModel<float> model(negative, 4); }, errc::invalid_token,
      "corpus position 0: token -1");
}

TEST_CASE("R4 UnigramModel / BigramModel: empty corpus with add_k = 0", "[errors][drafters]") {
  const std::vector<token_id> corpus;
  check_error(
      "R4", [&] { specdec::UnigramModel<float> model(corpus, 4, 0.0); }, errc::zero_mass,
      "an empty corpus needs add_k > 0");
  check_error(
      "R4", [&] { specdec::BigramModel<float> model(corpus, 4, 0.0); }, errc::zero_mass,
      "an empty corpus needs add_k > 0");
}

TEST_CASE("R5 BigramModel::next_token_probabilities: last context token outside 0..V-1",
          "[errors][drafters]") {
  const std::vector<token_id> corpus{0, 1, 2, 3};
  specdec::BigramModel<float> model(corpus, 4);
  const std::vector<token_id> context{1, 9};
  check_error(
      "R5", [&] { (void)model.next_token_probabilities(context); }, errc::invalid_token,
      "bigram model: context position 1: token 9 is outside the vocabulary [0, 4)");
}

TEST_CASE("R6 NgramDrafter: max_order or window out of range", "[errors][drafters]") {
  for (const std::size_t order : {std::size_t{1}, std::size_t{33}}) {
    check_error(
        "R6", [&] { specdec::NgramDrafter drafter({.max_order = order, .window = 512}); },
        errc::invalid_option, "NgramDrafter: max_order must be in [2, 32]");
  }
  check_error(
      "R6", [] { specdec::NgramDrafter drafter({.max_order = 4, .window = 3}); },
      errc::invalid_option, "NgramDrafter: window (3) must be >= max_order (4)");
  check_error(
      "R6", [] { specdec::NgramDrafter drafter({.max_order = 4, .window = std::size_t{1} << 40}); },
      errc::invalid_option, "is too large for 32-bit record indices");
}

TEST_CASE("R7 NgramDraftModel: vocabulary size 0 / or context tokens outside 0..V-1",
          "[errors][drafters]") {
  specdec::NgramDrafter drafter;
  check_error(
      "R7", [&] { (void)drafter.as_model<float>(0); }, errc::invalid_size,
      "ngram draft model: vocab_size must be > 0");
  // The drafter saw token 9; a model view of V = 4 cannot place it.
  auto model = drafter.as_model<float>(4);
  const std::vector<token_id> context{1, 9, 1, 9, 1};
  check_error(
      "R7", [&] { (void)model.next_token_probabilities(context); }, errc::invalid_token,
      "ngram draft model: context token 9 is outside the vocabulary [0, 4)");
}

TEST_CASE("R8 PromptLookupDrafter: n-gram bounds or window out of range", "[errors][drafters]") {
  check_error(
      "R8", [] { specdec::PromptLookupDrafter lookup({.min_ngram = 0}); }, errc::invalid_option,
      "PromptLookupDrafter: need 1 <= min_ngram <= max_ngram");
  check_error(
      "R8", [] { specdec::PromptLookupDrafter lookup({.min_ngram = 4, .max_ngram = 2}); },
      errc::invalid_option, "got min_ngram 4, max_ngram 2");
  check_error(
      "R8", [] { specdec::PromptLookupDrafter lookup({.window = 1}); }, errc::invalid_option,
      "PromptLookupDrafter: window must be >= 2, got 1");
}

TEST_CASE("A9 expected_accepted_drafts: gamma = 0, too many blocks, bad rows",
          "[errors][analysis]") {
  const auto uniform = [](std::span<const token_id>) { return std::vector<double>{0.5, 0.5}; };
  check_error(
      "A9",
      [&] {
        (void)specdec::expected_accepted_drafts(uniform, uniform, 2, 0,
                                                specdec::verification_rule::block);
      },
      errc::domain, "expected_accepted_drafts: gamma = 0, must be >= 1");
  check_error(
      "A9",
      [&] {
        (void)specdec::expected_accepted_drafts(uniform, uniform, 2, 25,
                                                specdec::verification_rule::block);
      },
      errc::domain,
      "expected_accepted_drafts: 2^25 blocks, more than the 2^24 the enumeration allows");
  check_error(
      "A9",
      [&] {
        (void)specdec::expected_accepted_drafts(uniform, uniform, 3, 2,
                                                specdec::verification_rule::token);
      },
      errc::invalid_size,
      "expected_accepted_drafts: the draft row after 0 drafted tokens has 2 entries, expected 3");
  const auto negative = [](std::span<const token_id> prefix) {
    return prefix.empty() ? std::vector<double>{0.5, 0.5} : std::vector<double>{1.5, -0.5};
  };
  check_error(
      "A9",
      [&] {
        (void)specdec::expected_accepted_drafts(uniform, negative, 2, 2,
                                                specdec::verification_rule::block);
      },
      errc::invalid_probability,
      "expected_accepted_drafts: a target row after 1 drafted tokens has the entry -0.5");
}
