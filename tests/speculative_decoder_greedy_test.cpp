// Greedy identity of SpeculativeDecoder: with temperature 0, speculative decoding emits
// exactly the tokens of plain greedy decoding of the target (argmax, lowest id among ties),
// token for token, whatever the draft: 1,000 random prompts, drafts of mixed quality
// (perfect, blended, unrelated, proposal-only), batched and per-prefix targets, varying
// gamma, with and without stop tokens and truncation settings (which greedy ignores).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/speculative_decoder.hpp"
#include "speculative_decoder_models.hpp"
#include "support/kernel_path_listener.hpp"

namespace {

using specdec::token_id;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::CountingUpDrafter;
using specdec::testing::GreedyChainDrafter;
using specdec::testing::MarkovModel;

// Plain greedy decoding of the target: argmax of each row, lowest id among ties.
std::vector<token_id> plain_greedy(const MarkovModel<float>& target,
                                   std::span<const token_id> prompt, std::size_t max_new_tokens,
                                   token_id stop_token) {
  std::vector<token_id> sequence(prompt.begin(), prompt.end());
  std::vector<token_id> generated;
  while (generated.size() < max_new_tokens) {
    const auto row = target.row(target.state(sequence));
    const auto best = static_cast<token_id>(std::max_element(row.begin(), row.end()) - row.begin());
    sequence.push_back(best);
    generated.push_back(best);
    if (best == stop_token) break;
  }
  return generated;
}

// A target with many exact ties: rows quantized to multiples of 1/8 so that the maximum is
// often shared (lowest id must win on both sides).
MarkovModel<float> tied_target(std::size_t vocab, std::uint64_t seed) {
  const auto smooth = MarkovModel<float>::random(vocab, 2, seed, 1.0, 0.2);
  std::vector<float> table;
  for (std::size_t s = 0; s < smooth.states(); ++s) {
    std::vector<float> row(vocab);
    float total = 0.0F;
    for (std::size_t j = 0; j < vocab; ++j) {
      row[j] = static_cast<float>(static_cast<int>(smooth.row(s)[j] * 24.0F)) / 8.0F + 0.125F;
      total += row[j];
    }
    for (auto& x : row) x /= total;
    table.insert(table.end(), row.begin(), row.end());
  }
  return {vocab, 2, table};
}

}  // namespace

TEST_CASE("SpeculativeDecoder greedy identity: 1,000 random prompts, drafts of mixed quality",
          "[speculative_decoder]") {
  constexpr std::size_t vocab = 24;
  const auto target_model = tied_target(vocab, 7);
  BatchedMarkovModel<float> batched(target_model);
  auto per_prefix = target_model;
  auto perfect = target_model;  // a LanguageModel draft equal to the target
  auto blended = target_model.order1_blend(MarkovModel<float>::random(vocab, 1, 8), 0.5);
  auto unrelated = MarkovModel<float>::random(vocab, 2, 9);
  GreedyChainDrafter<float> good_proposals(target_model);
  GreedyChainDrafter<float> poor_proposals(unrelated, 3);
  CountingUpDrafter counting{vocab};

  specdec::xoshiro256pp g(2024);
  std::size_t mismatches = 0;
  std::size_t runs = 0;
  std::size_t accepted = 0;
  std::size_t drafted = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    std::vector<token_id> prompt(1 + specdec::uniform_below(g, 8));
    for (auto& token : prompt) token = static_cast<token_id>(specdec::uniform_below(g, vocab));
    const std::size_t max_new_tokens = 1 + specdec::uniform_below(g, 40);
    const std::size_t gamma = 1 + specdec::uniform_below(g, 6);
    const bool with_stop = specdec::uniform_below(g, 3) == 0;
    const token_id stop_token =
        with_stop ? static_cast<token_id>(specdec::uniform_below(g, vocab)) : token_id{-1};
    specdec::DecoderOptions options{
        .sampling = {.temperature = 0.0, .top_k = trial % 2 == 0 ? 0U : 2U, .top_p = 0.5},
        .gamma_policy = specdec::FixedGamma(gamma)};
    if (with_stop) options.stop_tokens = {stop_token};
    const auto expected = plain_greedy(target_model, prompt, max_new_tokens, stop_token);

    const auto check = [&](auto& decoder) {
      const auto result = decoder.generate(prompt, max_new_tokens, g);
      ++runs;
      accepted += result.statistics.accepted_tokens;
      drafted += result.statistics.drafted_tokens;
      if (result.tokens != expected) {
        ++mismatches;
        UNSCOPED_INFO("trial " << trial << " gamma " << gamma << " max " << max_new_tokens);
      }
      // greedy beta is the match indicator: mean beta == accepted / verified positions
      if (result.statistics.beta_positions > 0) {
        CHECK(result.statistics.beta_sum == static_cast<double>(result.statistics.accepted_tokens));
      }
    };
    // alternate batched and per-prefix targets across drafts
    specdec::SpeculativeDecoder a(batched, perfect, options);
    specdec::SpeculativeDecoder b(per_prefix, blended, options);
    specdec::SpeculativeDecoder c(batched, unrelated, options);
    specdec::SpeculativeDecoder d(per_prefix, good_proposals, options);
    specdec::SpeculativeDecoder e(batched, poor_proposals, options);
    specdec::SpeculativeDecoder f(batched, counting, options);
    check(a);
    check(b);
    check(c);
    check(d);
    check(e);
    check(f);
  }
  CHECK(mismatches == 0);
  CHECK(runs == 6000);
  // the mix really had good and bad drafts
  CHECK(accepted > drafted / 10);
  CHECK(accepted < drafted);
}
