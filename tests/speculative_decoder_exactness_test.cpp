// Sequence-level exactness of SpeculativeDecoder (paper App. A.1 applied step after step):
// the sequences it generates follow the target's own autoregressive law under the same
// standardization, for Markov targets of order 1 and 2, V in {4, 16, 64}, gamma in
// {1, 3, 6}, T = 1, T = 0.7 with top-k and top-p (sparse rows) and T = 0.8 with top-p and
// min-p (dense rows) on both sides, for LanguageModel drafts (verified by block verification,
// the default, and by Algorithm 1, in alternation across configurations) and proposal-only
// drafters. Chi-square goodness of fit at a 1e-9 false-failure rate.
//
// The statistic (tests/support/sequence_law.hpp): the full law of 4 tokens for V = 4, the
// "rank profile" of 3 tokens (64 cells, exact probabilities by enumeration) for V = 16 and
// 64. Length 3 with gamma = 6 still crosses step boundaries whenever a draft is rejected
// (often: the drafts differ from the target on purpose), and budget truncation is exercised
// on every step that accepts more than fits. The same statistic tests every gamma policy in
// gamma_policy_exactness_test.cpp.
//
// Negative control: a hand-written loop that draws drafts from the standardized q but gives
// the verifier the raw q rows (standardization on the target side of the ratio only — the
// bug the decoder rules out by sampling drafts itself) fails the same statistic.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/speculative_sampling.hpp"
#include "speculative_decoder_models.hpp"
#include "support/kernel_path_listener.hpp"
#include "support/sequence_law.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::SamplingOptions;
using specdec::token_id;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::CountingUpDrafter;
using specdec::testing::GreedyChainDrafter;
using specdec::testing::make_markov_draft;
using specdec::testing::make_markov_target;
using specdec::testing::MarkovModel;
using specdec::testing::sample_decoder;
using specdec::testing::samples_for;
using specdec::testing::sequence_length_for;
using specdec::testing::SequenceLaw;
using specdec::testing::StableMarkovModel;
using specdec::testing::truncated_sampling;

const std::vector<token_id>& prompt = specdec::testing::sequence_prompt;

// Two decoders' runs that must agree bitwise: tokens and statistics, beta included.
template <class Result>
void check_same_output(const Result& a, const Result& b) {
  CHECK(a.tokens == b.tokens);
  CHECK(a.statistics.accepted_tokens == b.statistics.accepted_tokens);
  CHECK(a.statistics.drafted_tokens == b.statistics.drafted_tokens);
  CHECK(a.statistics.residual_fallbacks == b.statistics.residual_fallbacks);
  CHECK(a.statistics.beta_sum == b.statistics.beta_sum);
  CHECK(a.statistics.beta_positions == b.statistics.beta_positions);
}

}  // namespace

TEST_CASE("SpeculativeDecoder exactness: LanguageModel drafts", "[speculative_decoder]") {
  std::uint64_t seed = 100;
  for (const std::size_t vocab : {4U, 16U, 64U}) {
    for (const std::size_t order : {1U, 2U}) {
      const auto target_model = make_markov_target(vocab, order, ++seed);
      auto draft = make_markov_draft(target_model, ++seed);
      BatchedMarkovModel<double> batched(target_model);
      auto per_prefix = target_model;
      // T = 1 (dense rows, one fused pass per draft row), top-k + top-p at T = 0.7 (rows
      // kept as their survivors), top-p + min-p without top-k (dense standardized rows) and
      // top-p alone at T = 1 (the draft's nucleus written by its draw's pass).
      for (const int variant : {0, 1, 2, 3}) {
        const bool truncated = variant == 1;
        const SamplingOptions sampling =
            variant == 0   ? SamplingOptions{}
            : variant == 1 ? truncated_sampling(vocab)
            : variant == 2 ? SamplingOptions{.temperature = 0.8, .top_p = 0.85, .min_p = 0.02}
                           : SamplingOptions{.top_p = 0.85};
        const std::size_t length = sequence_length_for(vocab);
        const SequenceLaw law(target_model, sampling, length);
        const std::size_t samples = samples_for(law);
        for (const std::size_t gamma : {1U, 3U, 6U}) {
          // Block verification (the default) and Algorithm 1 alternate across
          // configurations: each sampling variant is verified both ways at gamma > 1.
          const bool token_rule = (gamma + static_cast<std::size_t>(variant) + order) % 2 == 1;
          specdec::DecoderOptions options{.sampling = sampling,
                                          .gamma_policy = specdec::FixedGamma(gamma)};
          if (token_rule) options.verification = specdec::verification_rule::token;
          // alternate batched and per-prefix targets across configurations
          const bool use_batched = (gamma + order) % 2 == 0;
          INFO("V = " << vocab << ", order " << order << ", gamma " << gamma
                      << (variant == 3   ? ", T = 1 top-p"
                          : variant == 2 ? ", T = 0.8 top-p min-p"
                          : truncated    ? ", T = 0.7 top-k top-p"
                                         : ", T = 1")
                      << (use_batched ? ", batched" : ", per prefix")
                      << (token_rule ? ", token rule" : ", block verification"));
          specdec::testing::ChiSquareResult result;
          if (use_batched) {
            specdec::SpeculativeDecoder decoder(batched, draft, options);
            result = sample_decoder(decoder, law, samples, ++seed);
          } else {
            specdec::SpeculativeDecoder decoder(per_prefix, draft, options);
            result = sample_decoder(decoder, law, samples, ++seed);
          }
          INFO(result.describe());
          CHECK(result.passed());
        }
      }
    }
  }
}

TEST_CASE("SpeculativeDecoder exactness: proposal-only drafters", "[speculative_decoder]") {
  std::uint64_t seed = 300;
  for (const std::size_t vocab : {4U, 16U}) {
    const auto target_model = make_markov_target(vocab, 2, ++seed);
    auto target = target_model;
    const auto other = make_markov_draft(target_model, ++seed);
    GreedyChainDrafter<double> good(target_model);  // proposes the target's greedy path
    GreedyChainDrafter<double> poor(other, 2);      // at most 2 proposals, from another chain
    CountingUpDrafter unrelated{vocab};
    for (const int variant : {0, 1, 2}) {  // as above: T = 1, top-k (sparse), top-p (dense)
      const SamplingOptions sampling =
          variant == 0   ? SamplingOptions{}
          : variant == 1 ? truncated_sampling(vocab)
                         : SamplingOptions{.temperature = 0.8, .top_p = 0.85, .min_p = 0.02};
      const std::size_t length = sequence_length_for(vocab);
      const SequenceLaw law(target_model, sampling, length);
      const std::size_t samples = samples_for(law);
      const specdec::DecoderOptions options{.sampling = sampling,
                                            .gamma_policy = specdec::FixedGamma(3)};
      INFO("V = " << vocab << ", variant " << variant);
      specdec::SpeculativeDecoder with_good(target, good, options);
      specdec::SpeculativeDecoder with_poor(target, poor, options);
      specdec::SpeculativeDecoder with_unrelated(target, unrelated, options);
      const auto good_result = sample_decoder(with_good, law, samples, ++seed);
      INFO("greedy-chain drafter: " << good_result.describe());
      CHECK(good_result.passed());
      const auto poor_result = sample_decoder(with_poor, law, samples, ++seed);
      INFO("poor drafter: " << poor_result.describe());
      CHECK(poor_result.passed());
      const auto unrelated_result = sample_decoder(with_unrelated, law, samples, ++seed);
      INFO("counting-up drafter: " << unrelated_result.describe());
      CHECK(unrelated_result.passed());
    }
  }
}

TEST_CASE("SpeculativeDecoder exactness: standardizing inside the target model only is exact",
          "[speculative_decoder]") {
  // A target that returns standardized rows itself, decoded with identity options and a raw
  // draft: the decoder draws each draft from the very q it verifies with, so the output
  // follows the (standardized) target rows. Sampling settings only matter through the rows.
  const std::size_t vocab = 16;
  const auto target_model = make_markov_target(vocab, 2, 401);
  const SamplingOptions sampling = truncated_sampling(vocab);
  std::vector<double> table;
  specdec::Standardizer<double> standardizer(sampling);
  for (std::size_t s = 0; s < target_model.states(); ++s) {
    std::vector<double> row(vocab);
    standardizer.apply(target_model.row(s), std::span<double>(row));
    table.insert(table.end(), row.begin(), row.end());
  }
  MarkovModel<double> standardized_target(vocab, 2, table);
  auto draft = make_markov_draft(target_model, 402);
  const SequenceLaw law(target_model, sampling, 3);
  specdec::SpeculativeDecoder decoder(standardized_target, draft,
                                      {.gamma_policy = specdec::FixedGamma(3)});
  const auto result = sample_decoder(decoder, law, samples_for(law), 403);
  INFO(result.describe());
  CHECK(result.passed());
}

namespace {

// A Markov chain that returns log-probabilities (logits up to a constant).
struct LogitsMarkov {
  const MarkovModel<double>* chain;
  std::vector<double> logits;
  std::size_t vocab_size() const { return chain->vocab_size(); }
  std::span<const double> next_token_logits(std::span<const token_id> context) {
    const auto row = chain->row(chain->state(context));
    logits.resize(row.size());
    for (std::size_t j = 0; j < row.size(); ++j) logits[j] = std::log(row[j]) + 3.0;
    return logits;
  }
};

}  // namespace

TEST_CASE("SpeculativeDecoder exactness: standardizing in LogitsModel on both sides",
          "[speculative_decoder]") {
  // The cheaper route for logits models: the adapters standardize, the decoder does not.
  const std::size_t vocab = 16;
  const auto target_model = make_markov_target(vocab, 2, 601);
  const auto draft_model = make_markov_draft(target_model, 602);
  const SamplingOptions sampling = truncated_sampling(vocab);
  LogitsMarkov target_logits{&target_model, {}};
  LogitsMarkov draft_logits{&draft_model, {}};
  specdec::LogitsModel target(target_logits, sampling);
  specdec::LogitsModel draft(draft_logits, sampling);
  const SequenceLaw law(target_model, sampling, 3);
  specdec::SpeculativeDecoder decoder(target, draft, {.gamma_policy = specdec::FixedGamma(3)});
  const auto result = sample_decoder(decoder, law, samples_for(law), 603);
  INFO(result.describe());
  CHECK(result.passed());
}

namespace {

/// The sequence law of a hand-written speculative loop (gamma drafts, then
/// verify_speculative), for the broken variants: draft(sequence, q, g) draws a token and
/// writes the row the verifier will use as q; target(prefix, p) writes p for a prefix.
/// Returns the chi-square of its sequences against `law`.
template <class Draft, class Target>
specdec::testing::ChiSquareResult hand_written_law(const SequenceLaw& law, std::size_t vocab,
                                                   std::size_t gamma, std::uint64_t seed,
                                                   Draft&& draft, Target&& target) {
  std::vector<double> q_rows(gamma * vocab);
  std::vector<double> p_rows((gamma + 1) * vocab);
  std::vector<std::uint64_t> counts(law.cells(), 0);
  specdec::xoshiro256pp g(seed);
  for (std::size_t k = 0; k < samples_for(law); ++k) {
    std::vector<token_id> sequence = prompt;
    while (sequence.size() < prompt.size() + law.length()) {
      const std::size_t base = sequence.size();
      for (std::size_t i = 0; i < gamma; ++i) {
        sequence.push_back(draft(std::span<const token_id>(sequence),
                                 std::span<double>(q_rows.data() + i * vocab, vocab), g));
      }
      for (std::size_t i = 0; i <= gamma; ++i) {
        target(std::span<const token_id>(sequence.data(), base + i),
               std::span<double>(p_rows.data() + i * vocab, vocab));
      }
      const std::vector<token_id> drafts(sequence.begin() + static_cast<std::ptrdiff_t>(base),
                                         sequence.end());
      const auto verdict = specdec::verify_speculative(
          std::span<const token_id>(drafts),
          specdec::RowsView<const double>(q_rows.data(), gamma, vocab),
          specdec::RowsView<const double>(p_rows.data(), gamma + 1, vocab), g);
      sequence.resize(base + verdict.accepted);
      sequence.push_back(verdict.token);
    }
    ++counts[law.cell_of(std::span<const token_id>(sequence).subspan(prompt.size()))];
  }
  return specdec::testing::chi_square_test(counts, law.expected());
}

}  // namespace

TEST_CASE("SpeculativeDecoder exactness: negative control is caught", "[speculative_decoder]") {
  // Drafts drawn from standardize(q) but verified against the raw q rows, with p
  // standardized: the ratio no longer uses the q the token came from.
  const std::size_t vocab = 16;
  const auto target_model = make_markov_target(vocab, 2, 501);
  const auto draft_model = make_markov_draft(target_model, 502);
  const SamplingOptions sampling = truncated_sampling(vocab);
  const SequenceLaw law(target_model, sampling, 3);
  specdec::Standardizer<double> standardizer(sampling);
  std::vector<double> standardized_q(vocab);
  const auto broken = hand_written_law(
      law, vocab, 3, 503,
      [&](std::span<const token_id> sequence, std::span<double> q, specdec::xoshiro256pp& g) {
        const auto raw = draft_model.row(draft_model.state(sequence));
        std::copy(raw.begin(), raw.end(), q.begin());
        standardizer.apply(raw, std::span<double>(standardized_q));
        return specdec::sample_from_row(std::span<const double>(standardized_q), g);
      },
      [&](std::span<const token_id> prefix, std::span<double> p) {
        standardizer.apply(target_model.row(target_model.state(prefix)), p);
      });
  INFO(broken.describe());
  CHECK_FALSE(broken.passed());
}

namespace {

/// A draft whose rows are a Markov chain's rows times a state-dependent factor in
/// [1/4, 4] (unnormalised, so decoded with validate_rows off): q is the row over its sum.
/// The row is rewritten on every call (valid until the next one).
struct ScaledDraft {
  MarkovModel<double> chain;
  std::vector<double> row{};
  [[nodiscard]] std::size_t vocab_size() const { return chain.vocab_size(); }
  [[nodiscard]] double factor(std::size_t state) const {
    return 0.25 * std::pow(16.0, static_cast<double>((state * 7919U) % 13U) / 12.0);
  }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    const std::size_t state = chain.state(context);
    const auto source = chain.row(state);
    row.assign(source.begin(), source.end());
    for (double& x : row) x *= factor(state);
    return row;
  }
};

/// The T = 1 law of decoders over `target_model` drafting with `drafter`: chi-square for
/// gamma 1, 3 and 6, a batched target (rows in place) and a per-prefix one, FixedGamma and
/// ConfidenceStop (which reads the draft's top probability).
template <class Drafter>
void check_law_at_unit_temperature(const MarkovModel<double>& target_model, Drafter& drafter,
                                   bool validate_rows, std::uint64_t& seed) {
  BatchedMarkovModel<double> batched(target_model);
  auto per_prefix = target_model;
  const SequenceLaw law(target_model, SamplingOptions{}, 3);
  const std::size_t samples = samples_for(law);
  for (const std::size_t gamma : {1U, 3U, 6U}) {
    for (const bool use_batched : {true, false}) {
      for (const bool confidence_stop : {false, true}) {
        specdec::DecoderOptions options{.validate_rows = validate_rows};
        if (confidence_stop) {
          options.gamma_policy = specdec::ConfidenceStop(0.3, gamma);
        } else {
          options.gamma_policy = specdec::FixedGamma(gamma);
        }
        INFO("gamma " << gamma << (use_batched ? ", batched" : ", per prefix")
                      << (confidence_stop ? ", ConfidenceStop" : ""));
        specdec::testing::ChiSquareResult result;
        if (use_batched) {
          specdec::SpeculativeDecoder decoder(batched, drafter, options);
          result = sample_decoder(decoder, law, samples, ++seed);
        } else {
          specdec::SpeculativeDecoder decoder(per_prefix, drafter, options);
          result = sample_decoder(decoder, law, samples, ++seed);
        }
        INFO(result.describe());
        CHECK(result.passed());
      }
    }
  }
}

}  // namespace

TEST_CASE("SpeculativeDecoder exactness: unnormalised draft rows at T = 1",
          "[speculative_decoder]") {
  // At T = 1 without truncation the decoder copies a draft row once and keeps its sum s as
  // a scalar (q = row / s) instead of rescaling the row: the acceptance ratio and the
  // residual must both use q = row / s. Rows off by factors 1/4..4 (validate_rows off).
  std::uint64_t seed = 700;
  const std::size_t vocab = 16;
  const auto target_model = make_markov_target(vocab, 2, ++seed);
  ScaledDraft draft{make_markov_draft(target_model, ++seed)};
  check_law_at_unit_temperature(target_model, draft, false, seed);
}

TEST_CASE("SpeculativeDecoder exactness: ignoring the draft normaliser is caught",
          "[speculative_decoder]") {
  // The broken variant of the test above: drafts drawn from row / s, verified with the raw
  // row as q (the scalar normaliser forgotten in the ratio and the residual). Same
  // statistic, same sample size: it must fail.
  const std::size_t vocab = 16;
  const auto target_model = make_markov_target(vocab, 2, 701);
  ScaledDraft draft{make_markov_draft(target_model, 702)};
  const SequenceLaw law(target_model, SamplingOptions{}, 3);
  const auto broken = hand_written_law(
      law, vocab, 3, 703,
      [&](std::span<const token_id> sequence, std::span<double> q, specdec::xoshiro256pp& g) {
        const auto row = draft.next_token_probabilities(sequence);
        std::copy(row.begin(), row.end(), q.begin());
        return specdec::sample_from_row(row, g);  // draws from row / s
      },
      [&](std::span<const token_id> prefix, std::span<double> p) {
        const auto row = target_model.row(target_model.state(prefix));
        std::copy(row.begin(), row.end(), p.begin());
      });
  INFO(broken.describe());
  CHECK_FALSE(broken.passed());
}

namespace {

/// ScaledDraft with its scaled rows precomputed: stable rows (read in place at T = 1),
/// unnormalised by the same state factors.
struct StableScaledDraft {
  static constexpr bool stable_rows = true;
  std::vector<double> table;
  MarkovModel<double> chain;
  explicit StableScaledDraft(MarkovModel<double> model) : chain(std::move(model)) {
    const ScaledDraft scaled{chain};
    for (std::size_t s = 0; s < chain.states(); ++s) {
      for (const double x : chain.row(s)) table.push_back(x * scaled.factor(s));
    }
  }
  [[nodiscard]] std::size_t vocab_size() const { return chain.vocab_size(); }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    const std::size_t vocab = chain.vocab_size();
    return {table.data() + chain.state(context) * vocab, vocab};
  }
};

/// The broken variant: declares stable_rows but rewrites one buffer on every call, so the
/// rows the decoder keeps pointers to all become the last drafted row.
struct PromiseBreakingDraft {
  static constexpr bool stable_rows = true;
  MarkovModel<double> chain;
  std::vector<double> row{};
  [[nodiscard]] std::size_t vocab_size() const { return chain.vocab_size(); }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    const auto source = chain.row(chain.state(context));
    row.assign(source.begin(), source.end());
    return row;
  }
};

static_assert(specdec::SpeculativeDecoder<MarkovModel<double>,
                                          StableMarkovModel<double>>::draft_rows_in_place);
static_assert(
    specdec::SpeculativeDecoder<MarkovModel<double>, StableScaledDraft>::draft_rows_in_place);
// Rows of another scalar type are converted, so still copied.
static_assert(!specdec::SpeculativeDecoder<MarkovModel<double>,
                                           StableMarkovModel<float>>::draft_rows_in_place);
static_assert(
    !specdec::SpeculativeDecoder<MarkovModel<double>, MarkovModel<double>>::draft_rows_in_place);

}  // namespace

TEST_CASE("SpeculativeDecoder exactness: stable draft rows read in place",
          "[speculative_decoder]") {
  // A draft with stable_rows is read in place at T = 1 (no copy): the same law, for
  // normalised rows (validation on) and rows off by factors 1/4..4 (validation off), gamma
  // 1..6, batched targets (their rows in place too) and per-prefix targets, with a policy
  // that reads the draft's top probability.
  std::uint64_t seed = 900;
  const std::size_t vocab = 16;
  const auto target_model = make_markov_target(vocab, 2, ++seed);
  StableMarkovModel<double> draft(make_markov_draft(target_model, ++seed));
  StableScaledDraft scaled_draft(make_markov_draft(target_model, ++seed));
  {
    INFO("normalised rows");
    check_law_at_unit_temperature(target_model, draft, true, seed);
  }
  INFO("unnormalised rows");
  check_law_at_unit_temperature(target_model, scaled_draft, false, seed);
}

TEST_CASE("SpeculativeDecoder exactness: a draft breaking the stable_rows promise is caught",
          "[speculative_decoder]") {
  // The broken variant of the test above (and the proof that rows are read in place): a
  // draft that declares stable_rows but overwrites one buffer, so every kept draft row is the
  // last one drafted. Same statistic, same sample size: it must fail. Its honest twin (the
  // same model without the promise, copied) passes.
  const std::size_t vocab = 16;
  const auto target_model = make_markov_target(vocab, 2, 951);
  PromiseBreakingDraft breaking{make_markov_draft(target_model, 952)};
  auto honest = make_markov_draft(target_model, 952);
  BatchedMarkovModel<double> batched(target_model);
  const SequenceLaw law(target_model, SamplingOptions{}, 3);
  const std::size_t samples = samples_for(law);
  const specdec::DecoderOptions options{.gamma_policy = specdec::FixedGamma(3)};
  specdec::SpeculativeDecoder broken_decoder(batched, breaking, options);
  const auto broken = sample_decoder(broken_decoder, law, samples, 953);
  INFO(broken.describe());
  CHECK_FALSE(broken.passed());
  specdec::SpeculativeDecoder honest_decoder(batched, honest, options);
  const auto control = sample_decoder(honest_decoder, law, samples, 953);
  INFO(control.describe());
  CHECK(control.passed());
}

TEST_CASE("SpeculativeDecoder: stable draft rows give the copied path's output bitwise",
          "[speculative_decoder]") {
  // Reading in place changes where the draft rows are read from, nothing else: the same
  // tokens, sources and statistics (beta included) as copying them, step after step, with
  // validation on and off, for batched and per-prefix targets and several gamma.
  for (const std::size_t vocab : {16U, 64U}) {
    const auto target_model = make_markov_target(vocab, 2, 970 + vocab);
    const auto draft_model = make_markov_draft(target_model, 971 + vocab);
    StableMarkovModel<double> stable(draft_model);
    auto copied = draft_model;
    BatchedMarkovModel<double> batched(target_model);
    auto per_prefix = target_model;
    for (const std::size_t gamma : {1U, 4U, 7U}) {
      for (const bool checks : {true, false}) {
        const specdec::DecoderOptions options{.gamma_policy = specdec::FixedGamma(gamma),
                                              .validate_rows = checks,
                                              .collect_beta = true};
        INFO("V = " << vocab << ", gamma " << gamma << ", checks " << checks);
        const auto compare = [&](auto& target) {
          specdec::SpeculativeDecoder in_place(target, stable, options);
          specdec::SpeculativeDecoder with_copy(target, copied, options);
          check_same_output(in_place.generate(prompt, 400, 17 + gamma),
                            with_copy.generate(prompt, 400, 17 + gamma));
        };
        compare(batched);
        compare(per_prefix);
      }
    }
  }
}

namespace {

// Rows of V entries from a small bank: the row after a context is bank row
// (7 * last token + length) % rows, so that long rows (V in the thousands) need no Markov
// table. `Batched` adds score_draft, whose rows the decoder may read in place.
template <bool Batched>
class RowBankModel {
 public:
  RowBankModel(std::size_t vocab, std::vector<double> bank)
      : vocab_(vocab), bank_(std::move(bank)) {}

  [[nodiscard]] std::size_t vocab_size() const { return vocab_; }

  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    return row_after(context.size(), context.empty() ? 0 : context.back());
  }

  specdec::RowsView<const double> score_draft(std::span<const token_id> context,
                                              std::span<const token_id> draft) requires Batched {
    rows_.resize((draft.size() + 1) * vocab_);
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const std::size_t length = context.size() + i;
      const token_id last = i > 0 ? draft[i - 1] : (context.empty() ? 0 : context.back());
      const auto row = row_after(length, last);
      std::copy(row.begin(), row.end(), rows_.begin() + static_cast<std::ptrdiff_t>(i * vocab_));
    }
    return {rows_.data(), draft.size() + 1, vocab_};
  }

 private:
  [[nodiscard]] std::span<const double> row_after(std::size_t length, token_id last) const {
    const std::size_t rows = bank_.size() / vocab_;
    const std::size_t r = (7 * static_cast<std::size_t>(last) + length) % rows;
    return {bank_.data() + r * vocab_, vocab_};
  }

  std::size_t vocab_;
  std::vector<double> bank_;
  std::vector<double> rows_;
};

// `rows` normalised rows of V entries: softmax of 2 N(0, 1) logits, or, with `levels`, of
// logits rounded to a few levels (many equal entries: the nucleus ends among ties, and its
// last kept id falls inside a block of 128).
std::vector<double> row_bank(std::size_t vocab, std::size_t rows, std::uint64_t seed, bool levels) {
  specdec::xoshiro256pp g(seed);
  std::vector<double> bank(vocab * rows);
  for (std::size_t r = 0; r < rows; ++r) {
    double total = 0.0;
    for (std::size_t j = 0; j < vocab; ++j) {
      double logit = 2.0 * specdec::testing::standard_normal(g);
      if (levels) logit = std::round(logit);
      bank[r * vocab + j] = std::exp(logit);
      total += bank[r * vocab + j];
    }
    for (std::size_t j = 0; j < vocab; ++j) bank[r * vocab + j] /= total;
  }
  return bank;
}

}  // namespace

TEST_CASE(
    "SpeculativeDecoder: top-p target rows read in place give the written rows' output "
    "bitwise",
    "[speculative_decoder]") {
  // Top-p alone at T = 1: a batched target's rows are read in place (the row, its nucleus's
  // last key and id, and its scale), a per-prefix target's are written by the standardizer.
  // Same tokens, sources and statistics (beta included), step after step: every pass that
  // reads a row in place (the decisions' entries, beta, the residual and bonus draws, block
  // verification's residual tables, their fallbacks) gives what the written row gives. Rows
  // long enough for full blocks of 128 on both sides of the nucleus's last id and for the
  // sampled search of long rows, with many ties at the nucleus's end; V not a multiple of
  // 128; both verification rules, a lenient residual, validation and beta on and off. The
  // written rows' own exactness is the chi-square of "LanguageModel drafts" above (variant 3,
  // per-prefix targets), which also runs the in-place rows at small V (batched targets).
  for (const std::size_t vocab : {300U, 6000U}) {
    for (const bool levels : {false, true}) {
      const auto target_bank = row_bank(vocab, 8, 1000 + vocab + levels, levels);
      const auto draft_bank = row_bank(vocab, 8, 2000 + vocab + levels, levels);
      RowBankModel<true> batched(vocab, target_bank);
      RowBankModel<false> per_prefix(vocab, target_bank);
      for (const double top_p : {0.9, 0.5}) {
        for (const int rule : {0, 1, 2}) {  // block verification, Algorithm 1, lenience 0.8
          for (const bool checks : {true, false}) {
            RowBankModel<false> draft(vocab, draft_bank);
            specdec::DecoderOptions options{.sampling = SamplingOptions{.top_p = top_p},
                                            .gamma_policy = specdec::FixedGamma(4),
                                            .validate_rows = checks,
                                            .collect_beta = true};
            if (rule >= 1) options.verification = specdec::verification_rule::token;
            if (rule == 2) options.lenience = 0.8;
            INFO("V = " << vocab << (levels ? ", levelled rows" : "") << ", top-p " << top_p
                        << ", rule " << rule << ", checks " << checks);
            specdec::SpeculativeDecoder in_place(batched, draft, options);
            specdec::SpeculativeDecoder written(per_prefix, draft, options);
            const auto a = in_place.generate(prompt, 300, 31 + vocab);
            check_same_output(a, written.generate(prompt, 300, 31 + vocab));
            CHECK(a.statistics.accepted_tokens > 0);
          }
        }
      }
    }
  }
}
