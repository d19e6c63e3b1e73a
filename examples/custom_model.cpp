// Integrating an engine-style model: it outputs logits, scores a whole draft in one batched
// call, and keeps a KV cache that specdec's rollback adapter (CachedContext) keeps in line
// with the accepted context, dropping rejected drafts without re-evaluating anything.
//
// The "engine" is a tiny recurrent network: the state of position k is
// h_k = tanh(A h_{k-1} + E[x_k]), the logits after it are W h_k. Its per-position states
// play the role of a transformer's KV cache. The draft is the same network with 3-bit
// weights, a common kind of draft model (a quantized copy of the target).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <vector>

#include "specdec/cached_context.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"

using specdec::token_id;

class TinyEngine {
 public:
  TinyEngine(std::size_t vocab, std::size_t hidden, int weight_bits)
      : vocab_(vocab), hidden_(hidden) {
    specdec::xoshiro256pp g(7);  // the same weights for target and draft, then quantized
    const auto random_matrix = [&](std::size_t rows, std::size_t cols, double scale) {
      std::vector<float> m(rows * cols);
      for (float& w : m)
        w = static_cast<float>(scale * (2.0 * specdec::uniform01<double>(g) - 1.0));
      if (weight_bits > 0) {  // round to 2^bits levels over [-scale, scale]
        const double step = 2.0 * scale / ((1 << weight_bits) - 1);
        for (float& w : m) w = static_cast<float>(std::round(w / step) * step);
      }
      return m;
    };
    recurrence_ = random_matrix(hidden, hidden, 1.5 / std::sqrt(static_cast<double>(hidden)));
    embedding_ = random_matrix(vocab, hidden, 1.0);
    output_ = random_matrix(vocab, hidden, 6.0 / std::sqrt(static_cast<double>(hidden)));
    truncate(0);
  }

  [[nodiscard]] std::size_t vocab_size() const { return vocab_; }

  // --- The KV-cache hooks CachedContext calls ---------------------------------------
  // Keeps the first n positions: states 0..n (state 0 is the empty context).
  void truncate(std::size_t n) {
    states_.resize((n + 1) * hidden_, 0.0F);
    logits_.resize((n + 1) * vocab_, 0.0F);
  }
  // Evaluates the new positions, one state and one logits row each.
  void append(std::span<const token_id> tokens) {
    for (const token_id token : tokens) {
      const std::size_t k = states_.size() / hidden_;  // index of the new state
      states_.resize((k + 1) * hidden_);
      logits_.resize((k + 1) * vocab_);
      const float* previous = &states_[(k - 1) * hidden_];
      float* state = &states_[k * hidden_];
      for (std::size_t i = 0; i < hidden_; ++i) {
        float sum = embedding_[static_cast<std::size_t>(token) * hidden_ + i];
        for (std::size_t j = 0; j < hidden_; ++j) sum += recurrence_[i * hidden_ + j] * previous[j];
        state[i] = std::tanh(sum);
      }
      for (std::size_t v = 0; v < vocab_; ++v) {
        float logit = 0.0F;
        for (std::size_t j = 0; j < hidden_; ++j) logit += output_[v * hidden_ + j] * state[j];
        logits_[k * vocab_ + v] = logit;
      }
      ++evaluated_positions_;
    }
  }

  // --- What the engine offers: logits (a specdec::LogitsLanguageModel) ----------------
  std::span<const float> next_token_logits(std::span<const token_id> context) {
    cache_.sync(context, *this);  // rolls back and evaluates only what changed
    return {logits_.data() + context.size() * vocab_, vocab_};
  }
  // All gamma + 1 rows in one call: after context, context + x_1, ..., context + x_1..x_gamma.
  specdec::RowsView<const float> score_draft_logits(std::span<const token_id> context,
                                                    std::span<const token_id> draft) {
    joined_.assign(context.begin(), context.end());
    joined_.insert(joined_.end(), draft.begin(), draft.end());
    cache_.sync(joined_, *this);
    return {logits_.data() + context.size() * vocab_, draft.size() + 1, vocab_};
  }

  [[nodiscard]] std::size_t evaluated_positions() const { return evaluated_positions_; }

 private:
  std::size_t vocab_;
  std::size_t hidden_;
  std::vector<float> recurrence_, embedding_, output_;
  std::vector<float> states_, logits_;  // the cache: one state and one logits row per position
  std::vector<token_id> joined_;
  specdec::CachedContext cache_;
  std::size_t evaluated_positions_ = 0;
};

static_assert(specdec::LogitsLanguageModel<TinyEngine>);

int main() {
  constexpr std::size_t vocab = 27;  // 'a'..'z' and ' '
  TinyEngine target_engine(vocab, 96, 0);
  TinyEngine draft_engine(vocab, 96, 3);
  // LogitsModel applies a stable softmax, turning each engine into a LanguageModel; the
  // target's score_draft_logits makes it a BatchedLanguageModel (one call per step).
  specdec::LogitsModel target(target_engine);
  specdec::LogitsModel draft(draft_engine);
  static_assert(specdec::BatchedLanguageModel<decltype(target)>);

  specdec::DecoderOptions options;
  options.sampling.temperature = 0.8;
  options.gamma_policy = specdec::FixedGamma{5};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  const std::vector<token_id> prompt = {7, 4, 11, 11, 14, 26};  // "hello "
  const std::size_t new_tokens = 120;
  const auto result = decoder.generate(prompt, new_tokens, /*seed=*/1);

  for (const token_id t : result.tokens) std::putchar(t == 26 ? ' ' : 'a' + t);
  const auto& stats = result.statistics;
  std::printf("\n\n%zu tokens, %zu batched target calls (%.2f tokens per call), alpha = %.3f\n",
              stats.emitted_tokens, stats.target_calls, stats.tokens_per_target_call(),
              stats.mean_beta());
  // Every target call evaluated only the positions the cache lacked: the drafts of the
  // step and the previous step's correction or bonus token. Rejected drafts were rolled
  // back by CachedContext; accepted positions were never evaluated twice.
  std::printf(
      "target evaluated %zu positions for %zu prompt + generated tokens (%zu of them "
      "for drafts that were rejected);\nwithout the cache each call would re-run the "
      "whole context.\n",
      target_engine.evaluated_positions(), prompt.size() + stats.emitted_tokens,
      target_engine.evaluated_positions() - prompt.size() - stats.emitted_tokens);
}
