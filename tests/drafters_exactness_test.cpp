// Exactness of SpeculativeDecoder with every drafter of include/specdec/drafters/ and every
// gamma policy of gamma_policy.hpp: greedy output identical to plain greedy decoding, and
// at T = 1 the law of whole generated sequences equal to autoregressive sampling from the
// target (sequence-level chi-square), whatever drafter and policy. Every run is
// deterministic: fixed seeds, and no policy reads a clock.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/drafters/count_models.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/speculative_decoder.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::token_id;
using Tokens = std::vector<token_id>;

constexpr std::size_t vocab = 4;

// A context-dependent target: the row is picked by the last two tokens from 16 fixed rows
// (some with zeros, some near one-hot, some flat), so drafts are sometimes right, sometimes
// impossible.
class ToyTarget {
 public:
  ToyTarget() {
    specdec::xoshiro256pp rng(77);
    for (auto& row : rows_) {
      double sum = 0.0;
      for (auto& value : row) {
        const double u = specdec::uniform01<double>(rng);
        value = u < 0.2 ? 0.0 : u * u * u;
        sum += value;
      }
      if (sum == 0.0) {
        row[0] = 1.0;
        sum = 1.0;
      }
      for (auto& value : row) value /= sum;
    }
    rows_[5] = {0.02, 0.9, 0.05, 0.03};
    rows_[6] = {0.25, 0.25, 0.25, 0.25};
  }

  [[nodiscard]] std::size_t vocab_size() const { return vocab; }
  [[nodiscard]] std::span<const double> next_token_probabilities(
      std::span<const token_id> context) {
    return rows_[row_index(context)];
  }

 private:
  static std::size_t row_index(std::span<const token_id> context) {
    const std::size_t n = context.size();
    const auto last = n >= 1 ? static_cast<std::size_t>(context[n - 1]) : 0;
    const auto before = n >= 2 ? static_cast<std::size_t>(context[n - 2]) : 0;
    return (last * 4 + before * 7 + n % 3) % 16;
  }
  std::array<std::array<double, vocab>, 16> rows_{};
};

const Tokens prompt = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 1, 2, 3, 0, 1};
const Tokens corpus = {0, 1, 2, 3, 1, 2, 0, 1, 3, 3, 2, 1, 0, 1, 2, 3, 0, 0, 1, 2};

// Deterministic policies only: gamma must not depend on wall time, or a run could not be
// reproduced. The controller's measured c is covered with a simulated clock in
// gamma_policy_exactness_test.cpp.
std::vector<specdec::AnyGammaPolicy> policies() {
  return {specdec::FixedGamma(3), specdec::AdditiveGamma({.initial = 2, .max_gamma = 6}),
          specdec::ConfidenceStop(0.6, 5),
          specdec::OptimalGammaController({.max_gamma = 6, .cost_ratio = 0.1})};
}

const std::array<const char*, 4> policy_names = {"FixedGamma", "AdditiveGamma", "ConfidenceStop",
                                                 "OptimalGammaController (c = 0.1)"};

// Calls `check(draft, name)` with a fresh instance of every drafter.
template <class Check>
void for_each_drafter(Check&& check) {
  {
    specdec::NgramDrafter ngram({.max_order = 3, .window = 16});
    check(ngram, "NgramDrafter (proposals)");
  }
  {
    specdec::NgramDrafter ngram({.max_order = 3, .window = 16});
    auto model = ngram.as_model<double>(vocab);
    check(model, "NgramDraftModel");
  }
  {
    specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 4});
    check(lookup, "PromptLookupDrafter");
  }
  {
    specdec::UnigramModel<double> unigram(corpus, vocab, 1.0);
    check(unigram, "UnigramModel");
  }
  {
    specdec::BigramModel<double> bigram(corpus, vocab, 0.5);
    check(bigram, "BigramModel");
  }
}

Tokens plain_greedy(ToyTarget& target, Tokens context, std::size_t count) {
  const std::size_t start = context.size();
  for (std::size_t i = 0; i < count; ++i) {
    const auto row = target.next_token_probabilities(context);
    context.push_back(
        static_cast<token_id>(std::max_element(row.begin(), row.end()) - row.begin()));
  }
  return Tokens(context.begin() + static_cast<std::ptrdiff_t>(start), context.end());
}

// Index of a sequence of `length` tokens among the vocab^length outcomes.
std::size_t outcome(std::span<const token_id> tokens) {
  std::size_t index = 0;
  for (const token_id t : tokens) index = index * vocab + static_cast<std::size_t>(t);
  return index;
}

constexpr std::size_t sequence_length = 3;
constexpr std::size_t outcomes = vocab * vocab * vocab;

// The exact law of the next `sequence_length` tokens under autoregressive sampling.
std::vector<double> target_sequence_law(ToyTarget& target) {
  std::vector<double> law(outcomes, 0.0);
  for (std::size_t index = 0; index < outcomes; ++index) {
    Tokens context = prompt;
    double probability = 1.0;
    for (std::size_t i = 0; i < sequence_length; ++i) {
      const std::size_t divisor =
          sequence_length - 1 - i == 0 ? 1 : (sequence_length - 1 - i == 1 ? vocab : vocab * vocab);
      const auto token = static_cast<token_id>(index / divisor % vocab);
      probability *= target.next_token_probabilities(context)[static_cast<std::size_t>(token)];
      context.push_back(token);
    }
    law[index] = probability;
  }
  return law;
}

constexpr std::size_t samples_per_case = 8000;

}  // namespace

TEST_CASE("Greedy speculative decoding equals plain greedy with every drafter and policy",
          "[drafters][exactness]") {
  ToyTarget target;
  const Tokens expected = plain_greedy(target, prompt, 60);
  for_each_drafter([&](auto& draft, const char* name) {
    const auto all = policies();
    for (std::size_t p = 0; p < all.size(); ++p) {
      specdec::DecoderOptions options;
      options.sampling.temperature = 0.0;
      options.gamma_policy = all[p];
      specdec::SpeculativeDecoder decoder(target, draft, options);
      for (int repeat = 0; repeat < 2; ++repeat) {  // the drafter keeps its tables between
        const auto result = decoder.generate(prompt, 60, std::uint64_t{1});
        INFO(name << " with " << policy_names[p] << ", repeat " << repeat);
        CHECK(result.tokens == expected);
      }
    }
  });
}

TEST_CASE("Speculative sampling keeps the target's sequence law with every drafter and policy",
          "[drafters][exactness]") {
  ToyTarget target;
  const std::vector<double> law = target_sequence_law(target);
  std::uint64_t seed = 1000;
  for_each_drafter([&](auto& draft, const char* name) {
    const auto all = policies();
    for (std::size_t p = 0; p < all.size(); ++p) {
      specdec::DecoderOptions options;
      options.sampling.temperature = 1.0;
      options.gamma_policy = all[p];
      specdec::SpeculativeDecoder decoder(target, draft, options);
      specdec::xoshiro256pp rng(++seed);
      std::vector<std::uint64_t> counts(outcomes, 0);
      for (std::size_t sample = 0; sample < samples_per_case; ++sample) {
        const auto result = decoder.generate(prompt, sequence_length, rng);
        ++counts[outcome(result.tokens)];
      }
      const auto test = specdec::testing::chi_square_test(counts, law);
      INFO(name << " with " << policy_names[p] << ": " << test.describe() << ", drafted "
                << decoder.statistics().drafted_tokens << ", accepted "
                << decoder.statistics().accepted_tokens);
      CHECK(test.passed());
      // The drafts were really used (and some accepted), so the test exercised them.
      CHECK(decoder.statistics().accepted_tokens > 0);
    }
  });
}

TEST_CASE("The sequence-level statistic rejects the draft's own law (accepting every draft)",
          "[drafters][exactness]") {
  // The broken variant: output the drafts without verification, i.e. sample sequences from
  // the draft q autoregressively. The same statistic with the same sample size must fail.
  ToyTarget target;
  const std::vector<double> law = target_sequence_law(target);
  specdec::xoshiro256pp rng(99);
  const auto broken_counts = [&](auto& model) {
    std::vector<std::uint64_t> counts(outcomes, 0);
    for (std::size_t sample = 0; sample < samples_per_case; ++sample) {
      Tokens context = prompt;
      for (std::size_t i = 0; i < sequence_length; ++i) {
        const auto row = model.next_token_probabilities(context);
        const double u = specdec::uniform01<double>(rng);
        double cumulative = 0.0;
        std::size_t token = 0;
        for (; token + 1 < vocab; ++token) {
          cumulative += row[token];
          if (u < cumulative) break;
        }
        context.push_back(static_cast<token_id>(token));
      }
      ++counts[outcome(std::span<const token_id>(context).last(sequence_length))];
    }
    return counts;
  };
  specdec::NgramDrafter ngram({.max_order = 3, .window = 16});
  auto ngram_model = ngram.as_model<double>(vocab);
  const auto ngram_test = specdec::testing::chi_square_test(broken_counts(ngram_model), law);
  INFO("n-gram q: " << ngram_test.describe());
  CHECK_FALSE(ngram_test.passed());
  specdec::BigramModel<double> bigram(corpus, vocab, 0.5);
  const auto bigram_test = specdec::testing::chi_square_test(broken_counts(bigram), law);
  INFO("bigram q: " << bigram_test.describe());
  CHECK_FALSE(bigram_test.passed());
}

TEST_CASE("Drafters speed up a repetitive target", "[drafters][exactness]") {
  // A target that greedily continues a period-5 pattern: the n-gram and prompt-lookup
  // drafters learn it from the prompt, so nearly every step accepts all gamma drafts.
  struct Periodic {
    std::array<double, 8> row{};
    [[nodiscard]] std::size_t vocab_size() const { return row.size(); }
    std::span<const double> next_token_probabilities(std::span<const token_id> context) {
      row.fill(0.02);
      const auto next = context.empty() ? 0 : (static_cast<std::size_t>(context.back()) + 1) % 5;
      row[next] = 1.0 - 0.02 * 7;
      return row;
    }
  } target;
  const Tokens periodic_prompt = {0, 1, 2, 3, 4, 0, 1, 2};
  specdec::DecoderOptions options;
  options.sampling.temperature = 0.0;
  options.gamma_policy = specdec::FixedGamma(4);
  specdec::NgramDrafter ngram;
  specdec::SpeculativeDecoder ngram_decoder(target, ngram, options);
  const auto ngram_result = ngram_decoder.generate(periodic_prompt, 100, std::uint64_t{3});
  CHECK(ngram_result.statistics.tokens_per_step() > 4.5);
  specdec::PromptLookupDrafter lookup;
  specdec::SpeculativeDecoder lookup_decoder(target, lookup, options);
  const auto lookup_result = lookup_decoder.generate(periodic_prompt, 100, std::uint64_t{3});
  CHECK(lookup_result.statistics.tokens_per_step() > 4.5);
  CHECK(lookup_result.tokens == ngram_result.tokens);
}
