// Sequence-level exactness of SpeculativeDecoder (paper App. A.1 applied step after step):
// the sequences it generates follow the target's own autoregressive law under the same
// standardization, for Markov targets of order 1 and 2, V in {4, 16, 64}, gamma in
// {1, 3, 6}, T = 1 and T = 0.7 with top-k and top-p on both sides, for LanguageModel drafts
// and proposal-only drafters. Chi-square goodness of fit at a 1e-9 false-failure rate.
//
// The statistic. V = 4: the full law of the 4 generated tokens (256 outcomes, exact
// probabilities by enumeration). V = 16 and 64 (4096 / 262144 outcomes of length 3): the
// sequence is mapped to its "rank profile" — for each position j the rank of x_j under the
// standardized target row given the true history x_<j, grouped as {1st}, {2nd}, {3rd-4th},
// {5th or lower} — 64 cells whose exact probabilities come from enumerating all V^3
// sequences. This is a function of the whole sequence, so under exactness its law is known
// exactly; a decoder that distorts any conditional law (too much or too little mass on the
// probable tokens, a row taken from the wrong prefix across a step boundary, a bonus from the
// wrong row) moves mass between rank groups, which is what the test sees. Length 3 with
// gamma = 6 still crosses step boundaries whenever a draft is rejected (often: the drafts
// differ from the target on purpose), and budget truncation is exercised on every step that
// accepts more than fits.
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
#include "support/statistics.hpp"

namespace {

using specdec::SamplingOptions;
using specdec::token_id;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::chi_square_test;
using specdec::testing::CountingUpDrafter;
using specdec::testing::GreedyChainDrafter;
using specdec::testing::MarkovModel;

const std::vector<token_id> prompt = {1, 2};

// The exact law of a statistic of the generated sequence, and the map sequence -> cell.
class SequenceLaw {
 public:
  SequenceLaw(const MarkovModel<double>& target, const SamplingOptions& sampling,
              std::size_t length)
      : target_(&target), vocab_(target.vocab_size()), length_(length) {
    full_law_ = vocab_ <= 4;
    standardized_.resize(target.states() * vocab_);
    rank_.resize(target.states() * vocab_);
    specdec::Standardizer<double> standardizer(sampling);
    for (std::size_t s = 0; s < target.states(); ++s) {
      const std::span<double> row(standardized_.data() + s * vocab_, vocab_);
      standardizer.apply(target.row(s), row);
      std::vector<std::size_t> order(vocab_);
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return row[a] > row[b]; });
      for (std::size_t r = 0; r < vocab_; ++r) rank_[s * vocab_ + order[r]] = r;
    }
    std::size_t cells = 1;
    for (std::size_t j = 0; j < length_; ++j) cells *= full_law_ ? vocab_ : 4;
    expected_.assign(cells, 0.0);
    enumerate(target.state(prompt), 0, 1.0, 0);
  }

  [[nodiscard]] std::size_t cells() const { return expected_.size(); }
  [[nodiscard]] const std::vector<double>& expected() const { return expected_; }

  [[nodiscard]] std::size_t cell_of(std::span<const token_id> tokens) const {
    std::size_t s = target_->state(prompt);
    std::size_t cell = 0;
    for (std::size_t j = 0; j < length_; ++j) {
      const auto x = static_cast<std::size_t>(tokens[j]);
      cell = cell * (full_law_ ? vocab_ : 4) + digit(s, x);
      s = target_->next_state(s, x);
    }
    return cell;
  }

 private:
  [[nodiscard]] std::size_t digit(std::size_t s, std::size_t x) const {
    if (full_law_) return x;
    const std::size_t rank = rank_[s * vocab_ + x];
    return rank == 0 ? 0 : rank == 1 ? 1 : rank <= 3 ? 2 : 3;
  }

  void enumerate(std::size_t s, std::size_t depth, double probability, std::size_t cell) {
    if (depth == length_) {
      expected_[cell] += probability;
      return;
    }
    for (std::size_t x = 0; x < vocab_; ++x) {
      const double p = standardized_[s * vocab_ + x];
      if (p == 0.0) continue;
      enumerate(target_->next_state(s, x), depth + 1, probability * p,
                cell * (full_law_ ? vocab_ : 4) + digit(s, x));
    }
  }

  const MarkovModel<double>* target_;
  std::size_t vocab_;
  std::size_t length_;
  bool full_law_ = false;
  std::vector<double> standardized_;
  std::vector<std::size_t> rank_;
  std::vector<double> expected_;
};

std::size_t length_for(std::size_t vocab) {
  return vocab <= 4 ? 4 : 3;
}

// Samples to detect a deviation of total variation 0.1 in the statistic's law (about 6.9k
// for 64 cells; the negative control below deviates far more: its chi2 is about 0.19 N).
std::size_t samples_for(const SequenceLaw& law) {
  return specdec::testing::samples_to_detect(
      0.1, static_cast<double>(std::min<std::size_t>(law.cells() - 1, 63)));
}

template <class Decoder>
specdec::testing::ChiSquareResult sample_decoder(Decoder& decoder, const SequenceLaw& law,
                                                 std::size_t length, std::size_t samples,
                                                 std::uint64_t seed) {
  std::vector<std::uint64_t> counts(law.cells(), 0);
  specdec::xoshiro256pp g(seed);
  for (std::size_t k = 0; k < samples; ++k) {
    const auto result = decoder.generate(prompt, length, g);
    ++counts[law.cell_of(result.tokens)];
  }
  return chi_square_test(counts, law.expected());
}

MarkovModel<double> make_target(std::size_t vocab, std::size_t order, std::uint64_t seed) {
  return MarkovModel<double>::random(vocab, order, seed, 1.5, 0.15);
}

// A draft that differs from the target on purpose: for an order-2 target an order-1 blend
// of the target with noise; for an order-1 target an unrelated order-2 chain.
MarkovModel<double> make_draft(const MarkovModel<double>& target, std::uint64_t seed) {
  const std::size_t vocab = target.vocab_size();
  if (target.order() == 2) {
    return target.order1_blend(MarkovModel<double>::random(vocab, 1, seed, 1.5, 0.15), 0.5);
  }
  return MarkovModel<double>::random(vocab, 2, seed, 1.0, 0.15);
}

SamplingOptions truncated_sampling(std::size_t vocab) {
  return {.temperature = 0.7, .top_k = vocab <= 4 ? 3 : vocab / 2, .top_p = 0.9};
}

}  // namespace

TEST_CASE("SpeculativeDecoder exactness: LanguageModel drafts", "[speculative_decoder]") {
  std::uint64_t seed = 100;
  for (const std::size_t vocab : {4U, 16U, 64U}) {
    for (const std::size_t order : {1U, 2U}) {
      const auto target_model = make_target(vocab, order, ++seed);
      auto draft = make_draft(target_model, ++seed);
      BatchedMarkovModel<double> batched(target_model);
      auto per_prefix = target_model;
      for (const bool truncated : {false, true}) {
        const SamplingOptions sampling = truncated ? truncated_sampling(vocab) : SamplingOptions{};
        const std::size_t length = length_for(vocab);
        const SequenceLaw law(target_model, sampling, length);
        const std::size_t samples = samples_for(law);
        for (const std::size_t gamma : {1U, 3U, 6U}) {
          specdec::DecoderOptions options{.sampling = sampling,
                                          .gamma_policy = specdec::FixedGamma(gamma)};
          // alternate batched and per-prefix targets across configurations
          const bool use_batched = (gamma + order) % 2 == 0;
          INFO("V = " << vocab << ", order " << order << ", gamma " << gamma
                      << (truncated ? ", T = 0.7 top-k top-p" : ", T = 1")
                      << (use_batched ? ", batched" : ", per prefix"));
          specdec::testing::ChiSquareResult result;
          if (use_batched) {
            specdec::SpeculativeDecoder decoder(batched, draft, options);
            result = sample_decoder(decoder, law, length, samples, ++seed);
          } else {
            specdec::SpeculativeDecoder decoder(per_prefix, draft, options);
            result = sample_decoder(decoder, law, length, samples, ++seed);
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
    const auto target_model = make_target(vocab, 2, ++seed);
    auto target = target_model;
    const auto other = make_draft(target_model, ++seed);
    GreedyChainDrafter<double> good(target_model);  // proposes the target's greedy path
    GreedyChainDrafter<double> poor(other, 2);      // at most 2 proposals, from another chain
    CountingUpDrafter unrelated{vocab};
    for (const bool truncated : {false, true}) {
      const SamplingOptions sampling = truncated ? truncated_sampling(vocab) : SamplingOptions{};
      const std::size_t length = length_for(vocab);
      const SequenceLaw law(target_model, sampling, length);
      const std::size_t samples = samples_for(law);
      const specdec::DecoderOptions options{.sampling = sampling,
                                            .gamma_policy = specdec::FixedGamma(3)};
      INFO("V = " << vocab << (truncated ? ", T = 0.7 top-k top-p" : ", T = 1"));
      specdec::SpeculativeDecoder with_good(target, good, options);
      specdec::SpeculativeDecoder with_poor(target, poor, options);
      specdec::SpeculativeDecoder with_unrelated(target, unrelated, options);
      const auto good_result = sample_decoder(with_good, law, length, samples, ++seed);
      INFO("greedy-chain drafter: " << good_result.describe());
      CHECK(good_result.passed());
      const auto poor_result = sample_decoder(with_poor, law, length, samples, ++seed);
      INFO("poor drafter: " << poor_result.describe());
      CHECK(poor_result.passed());
      const auto unrelated_result = sample_decoder(with_unrelated, law, length, samples, ++seed);
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
  const auto target_model = make_target(vocab, 2, 401);
  const SamplingOptions sampling = truncated_sampling(vocab);
  std::vector<double> table;
  specdec::Standardizer<double> standardizer(sampling);
  for (std::size_t s = 0; s < target_model.states(); ++s) {
    std::vector<double> row(vocab);
    standardizer.apply(target_model.row(s), std::span<double>(row));
    table.insert(table.end(), row.begin(), row.end());
  }
  MarkovModel<double> standardized_target(vocab, 2, table);
  auto draft = make_draft(target_model, 402);
  const SequenceLaw law(target_model, sampling, 3);
  specdec::SpeculativeDecoder decoder(standardized_target, draft,
                                      {.gamma_policy = specdec::FixedGamma(3)});
  const auto result = sample_decoder(decoder, law, 3, samples_for(law), 403);
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
  const auto target_model = make_target(vocab, 2, 601);
  const auto draft_model = make_draft(target_model, 602);
  const SamplingOptions sampling = truncated_sampling(vocab);
  LogitsMarkov target_logits{&target_model, {}};
  LogitsMarkov draft_logits{&draft_model, {}};
  specdec::LogitsModel target(target_logits, sampling);
  specdec::LogitsModel draft(draft_logits, sampling);
  const SequenceLaw law(target_model, sampling, 3);
  specdec::SpeculativeDecoder decoder(target, draft, {.gamma_policy = specdec::FixedGamma(3)});
  const auto result = sample_decoder(decoder, law, 3, samples_for(law), 603);
  INFO(result.describe());
  CHECK(result.passed());
}

TEST_CASE("SpeculativeDecoder exactness: negative control is caught", "[speculative_decoder]") {
  // Drafts drawn from standardize(q) but verified against the raw q rows, with p
  // standardized: the ratio no longer uses the q the token came from.
  const std::size_t vocab = 16;
  const std::size_t gamma = 3;
  const std::size_t length = 3;
  const auto target_model = make_target(vocab, 2, 501);
  const auto draft_model = make_draft(target_model, 502);
  const SamplingOptions sampling = truncated_sampling(vocab);
  const SequenceLaw law(target_model, sampling, length);
  specdec::Standardizer<double> standardizer(sampling);
  std::vector<double> raw_q(gamma * vocab);
  std::vector<double> standardized_q(vocab);
  std::vector<double> standardized_p((gamma + 1) * vocab);
  std::vector<std::uint64_t> counts(law.cells(), 0);
  specdec::xoshiro256pp g(503);
  const std::size_t samples = samples_for(law);
  for (std::size_t k = 0; k < samples; ++k) {
    std::vector<token_id> sequence = prompt;
    while (sequence.size() < prompt.size() + length) {
      const std::size_t base = sequence.size();
      for (std::size_t i = 0; i < gamma; ++i) {
        const auto q = draft_model.row(draft_model.state(sequence));
        std::copy(q.begin(), q.end(), raw_q.begin() + static_cast<std::ptrdiff_t>(i * vocab));
        standardizer.apply(q, std::span<double>(standardized_q));
        sequence.push_back(specdec::sample_from_row(std::span<const double>(standardized_q), g));
      }
      for (std::size_t i = 0; i <= gamma; ++i) {
        const auto p = target_model.row(
            target_model.state(std::span<const token_id>(sequence.data(), base + i)));
        standardizer.apply(p, std::span<double>(standardized_p.data() + i * vocab, vocab));
      }
      const std::vector<token_id> drafts(sequence.begin() + static_cast<std::ptrdiff_t>(base),
                                         sequence.end());
      const auto verdict = specdec::verify_speculative(
          std::span<const token_id>(drafts),
          specdec::RowsView<const double>(raw_q.data(), gamma, vocab),
          specdec::RowsView<const double>(standardized_p.data(), gamma + 1, vocab), g);
      sequence.resize(base + verdict.accepted);
      sequence.push_back(verdict.token);
    }
    ++counts[law.cell_of(std::span<const token_id>(sequence).subspan(prompt.size()))];
  }
  const auto broken = chi_square_test(counts, law.expected());
  INFO(broken.describe());
  CHECK_FALSE(broken.passed());
}
