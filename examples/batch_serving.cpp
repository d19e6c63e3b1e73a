// Continuous batching with specdec::BatchDecoder: requests arrive while others are being
// decoded; every step drafts for all active sequences and scores all their drafted prefixes
// in ONE target call; each request keeps its own sampling options, seed, gamma and stop token,
// and its tokens do not depend on the requests around it.
//
//   ./build/gcc/examples/batch_serving
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "specdec/batch_decoder.hpp"

namespace {

using specdec::token_id;

/// A bigram "engine" over 32 tokens: row(previous token) is a fixed softmax. score_batch
/// answers a whole ragged batch in one call, as a transformer's batched forward pass would.
struct BigramEngine {
  static constexpr std::size_t vocab = 32;
  std::vector<float> table = std::vector<float>(vocab * vocab);
  std::vector<float> rows;
  std::size_t calls = 0;

  explicit BigramEngine(double sharpness) {
    for (std::size_t a = 0; a < vocab; ++a) {
      double total = 0.0;
      for (std::size_t b = 0; b < vocab; ++b) {
        total += std::exp(sharpness * std::sin(0.37 * static_cast<double>(a * 7 + b * 3)));
      }
      for (std::size_t b = 0; b < vocab; ++b) {
        table[a * vocab + b] = static_cast<float>(
            std::exp(sharpness * std::sin(0.37 * static_cast<double>(a * 7 + b * 3))) / total);
      }
    }
  }
  [[nodiscard]] std::size_t vocab_size() const { return vocab; }
  std::span<const float> row_after(token_id previous) const {
    return {table.data() + static_cast<std::size_t>(previous) * vocab, vocab};
  }
  std::span<const float> next_token_probabilities(std::span<const token_id> context) {
    return row_after(context.empty() ? 0 : context.back());
  }
  specdec::RowsView<const float> score_batch(std::span<const specdec::BatchScoreRequest> batch) {
    ++calls;
    rows.clear();
    for (const auto& request : batch) {
      token_id previous = request.context.empty() ? 0 : request.context.back();
      for (std::size_t k = 0; k <= request.drafts.size(); ++k) {
        const auto row = row_after(previous);
        rows.insert(rows.end(), row.begin(), row.end());
        if (k < request.drafts.size()) previous = request.drafts[k];
      }
    }
    return {rows.data(), rows.size() / vocab, vocab};
  }
};

}  // namespace

int main() {
  BigramEngine target(3.0);
  BigramEngine draft(2.5);  // a cheaper, blurrier model of the same vocabulary
  specdec::BatchDecoder decoder(target, draft, {.threads = 2});
  std::uint64_t next_id = 0;
  const auto admit = [&](std::size_t count) {
    for (std::size_t k = 0; k < count; ++k, ++next_id) {
      specdec::SequenceRequest request;
      request.id = next_id;
      request.prompt = {static_cast<token_id>(next_id % 32)};
      request.max_new_tokens = 24;
      request.seed = 42;
      request.sampling.temperature = next_id % 3 == 0 ? 0.0 : 0.8;  // some greedy requests
      request.gamma_policy = specdec::FixedGamma(2 + next_id % 4);
      request.stop_tokens = {31};
      decoder.add(request);
    }
  };
  admit(4);
  std::size_t tokens = 0;
  while (decoder.active() > 0 || next_id < 12) {
    if (decoder.steps() % 3 == 0 && next_id < 12) admit(2);  // requests keep arriving
    tokens += decoder.step();
    for (const auto& done : decoder.take_finished()) {
      std::printf("request %2llu: %2zu tokens in %zu steps, %zu of %zu drafts accepted, %s:",
                  static_cast<unsigned long long>(done.id), done.tokens.size(), done.steps,
                  done.accepted, done.drafted,
                  done.end == specdec::sequence_end::stop_token ? "stop token" : "max tokens");
      for (const token_id t : done.tokens) std::printf(" %d", t);
      std::printf("\n");
    }
  }
  std::printf("%zu tokens for %zu requests in %zu target calls (%.2f tokens per call)\n", tokens,
              static_cast<std::size_t>(next_id), target.calls,
              static_cast<double>(tokens) / static_cast<double>(target.calls));
  return 0;
}
