// The smallest complete use of specdec: two toy models, one speculative generation.
#include <cstdio>
#include <span>
#include <vector>

#include "specdec/speculative_decoder.hpp"

// A model over 4 tokens ("abcd") that expects the letter after the previous one; the
// larger `confidence`, the surer it is. Any type with these two members is a LanguageModel.
struct CyclicModel {
  double confidence = 1.0;
  std::vector<double> row = std::vector<double>(4);

  std::size_t vocab_size() const { return 4; }
  std::span<const double> next_token_probabilities(std::span<const specdec::token_id> context) {
    const specdec::token_id expected = context.empty() ? 0 : (context.back() + 1) % 4;
    for (specdec::token_id t = 0; t < 4; ++t)
      row[static_cast<std::size_t>(t)] = (t == expected ? confidence : 1.0) / (confidence + 3.0);
    return row;
  }
};
static_assert(specdec::LanguageModel<CyclicModel>);

int main() {
  CyclicModel target{.confidence = 12.0};  // M_p, the model whose distribution we want
  CyclicModel draft{.confidence = 6.0};    // M_q, a cheaper approximation of it
  specdec::DecoderOptions options;
  options.gamma_policy = specdec::FixedGamma{4};  // draft 4 tokens per target call
  specdec::SpeculativeDecoder decoder(target, draft, options);

  const std::vector<specdec::token_id> prompt = {0};
  const specdec::GenerationResult result = decoder.generate(prompt, 40, /*seed=*/42);

  for (const specdec::token_id token : result.tokens) std::putchar("abcd"[token]);
  const specdec::DecoderStatistics& stats = result.statistics;
  std::printf("\n%zu tokens in %zu steps (target passes), alpha = mean beta = %.3f\n",
              stats.emitted_tokens, stats.steps, stats.mean_beta());
}
