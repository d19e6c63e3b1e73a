// A steady-state speculative step allocates nothing: this translation unit replaces the
// global operator new/delete with counting versions, warms a decoder up, then counts the
// allocations of many further steps — deterministic, unlike timing. Covers batched and
// per-prefix targets, LanguageModel and proposal drafters, identity / truncated / greedy
// sampling, validation and beta collection on, a streaming callback, a timed gamma policy,
// token trees, and KV-cache models on CachedContext. generate() allocates only for its
// result, the same number of times for 50 or 400 tokens.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <span>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/cached_context.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "speculative_decoder_models.hpp"
#include "support/counting_allocator.hpp"

namespace {

using specdec::token_id;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::GreedyChainDrafter;
using specdec::testing::MarkovModel;

// Counts the allocations of `steps` decoder steps after `warm_up` steps, driving the loop
// like an engine: its own reserved context, step() once per iteration.
template <class Decoder>
std::size_t allocations_per_steady_state(Decoder& decoder, std::size_t warm_up, std::size_t steps) {
  std::vector<token_id> context = {1, 2, 3};
  context.reserve(8192);
  decoder.reserve(8192);
  specdec::xoshiro256pp g(42);
  const auto run = [&](std::size_t count) {
    for (std::size_t s = 0; s < count; ++s) {
      const auto result = decoder.step(context, g);
      context.insert(context.end(), result.tokens.begin(), result.tokens.end());
    }
  };
  run(warm_up);
  specdec::testing::AllocationCounter counter;
  run(steps);
  return counter.stop();
}

// A gamma policy that wants timings (so the decoder reads the clock) and adapts gamma
// within a fixed range.
struct TimedPolicy {
  std::size_t gamma = 4;
  double seconds = 0.0;
  std::size_t next_gamma() const { return gamma; }
  bool continue_drafting(double top_probability, std::size_t) const {
    return top_probability > 0.05;
  }
  void observe(const specdec::StepFeedback& feedback) {
    seconds += feedback.draft_seconds + feedback.target_seconds;
    gamma = feedback.accepted == feedback.drafted ? 5 : 3;
  }
  bool needs_timing() const { return true; }
};

// KV-cache Markov model (see speculative_decoder_cache_test.cpp), reserved up front.
class KvMarkovModel {
 public:
  explicit KvMarkovModel(MarkovModel<float> model) : model_(std::move(model)) {
    states_.reserve(8192);
    cache_.reserve(8192);
    buffer_.reserve(8192);
  }
  std::size_t vocab_size() const { return model_.vocab_size(); }
  std::span<const float> next_token_probabilities(std::span<const token_id> context) {
    cache_.sync(context, *this);
    return model_.row(context.empty() ? 0 : states_[context.size() - 1]);
  }
  specdec::RowsView<const float> score_draft(std::span<const token_id> context,
                                             std::span<const token_id> draft) {
    buffer_.assign(context.begin(), context.end());
    buffer_.insert(buffer_.end(), draft.begin(), draft.end());
    cache_.sync(buffer_, *this);
    rows_.resize((draft.size() + 1) * vocab_size());
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const std::size_t length = context.size() + i;
      const auto row = model_.row(length == 0 ? 0 : states_[length - 1]);
      std::copy(row.begin(), row.end(),
                rows_.begin() + static_cast<std::ptrdiff_t>(i * vocab_size()));
    }
    return {rows_.data(), draft.size() + 1, vocab_size()};
  }
  void truncate(std::size_t n) { states_.resize(n); }
  void append(std::span<const token_id> tokens) {
    for (const token_id token : tokens) {
      const std::size_t previous = states_.empty() ? 0 : states_.back();
      states_.push_back(model_.next_state(previous, static_cast<std::size_t>(token)));
    }
  }

 private:
  MarkovModel<float> model_;
  specdec::CachedContext cache_;
  std::vector<std::size_t> states_;
  std::vector<token_id> buffer_;
  std::vector<float> rows_;
};

constexpr std::size_t vocab = 256;

MarkovModel<float> target_chain() {
  return MarkovModel<float>::random(vocab, 1, 3, 2.0, 0.1);
}
MarkovModel<float> draft_chain(const MarkovModel<float>& target) {
  return target.order1_blend(MarkovModel<float>::random(vocab, 1, 4), 0.7);
}

}  // namespace

TEST_CASE("Allocation counter: sees allocations", "[speculative_decoder]") {
  static volatile std::size_t sink = 0;
  specdec::testing::AllocationCounter counter;
  {
    std::vector<token_id> probe(sink + 16);
    sink = sink + probe.size();
  }
  CHECK(counter.stop() == 1);
}

TEST_CASE("SpeculativeDecoder: no allocation per step in steady state", "[speculative_decoder]") {
  const auto target_model = target_chain();
  const auto draft_model = draft_chain(target_model);
  std::size_t streamed = 0;
  const auto stream = [&streamed](const specdec::EmittedToken&) { ++streamed; };

  SECTION("batched target, LanguageModel draft, truncated sampling, callback, timed policy") {
    BatchedMarkovModel<float> target(target_model);
    auto draft = draft_model;
    specdec::DecoderOptions options{
        .sampling = {.temperature = 0.7, .top_k = 40, .top_p = 0.9, .min_p = 0.01},
        .gamma_policy = TimedPolicy{},
        .stop_sequences = {{7, 7, 7, 7}}};
    options.on_token = stream;
    specdec::SpeculativeDecoder decoder(target, draft, options);
    CHECK(allocations_per_steady_state(decoder, 20, 300) == 0);
    CHECK(streamed > 300);
  }
  SECTION("per-prefix target, identity sampling, large-k top-k and top-p on the full row") {
    auto target = target_model;
    auto draft = draft_model;
    for (const auto& sampling : {specdec::SamplingOptions{}, specdec::SamplingOptions{.top_k = 100},
                                 specdec::SamplingOptions{.temperature = 1.3, .top_p = 0.8}}) {
      specdec::SpeculativeDecoder decoder(target, draft, {.sampling = sampling});
      CHECK(allocations_per_steady_state(decoder, 20, 300) == 0);
    }
  }
  SECTION("greedy with a proposal-only drafter") {
    BatchedMarkovModel<float> target(target_model);
    GreedyChainDrafter<float> drafter(draft_model);
    specdec::SpeculativeDecoder decoder(
        target, drafter,
        {.sampling = {.temperature = 0.0}, .gamma_policy = specdec::FixedGamma(6)});
    CHECK(allocations_per_steady_state(decoder, 20, 300) == 0);
  }
  SECTION("T > 0 with a proposal-only drafter") {
    auto target = target_model;
    GreedyChainDrafter<float> drafter(draft_model);
    specdec::SpeculativeDecoder decoder(target, drafter, {.sampling = {.top_p = 0.95}});
    CHECK(allocations_per_steady_state(decoder, 20, 300) == 0);
  }
  SECTION("token trees: per-path target, with and without replacement, greedy") {
    auto target = target_model;
    auto draft = draft_model;
    for (const auto sampling :
         {specdec::expansion::without_replacement, specdec::expansion::with_replacement}) {
      specdec::DecoderOptions options{.sampling = {.temperature = 0.9}};
      options.tree_shape = specdec::TreeShape::branching({3, 2, 1});
      options.tree_sampling = sampling;
      specdec::SpeculativeDecoder decoder(target, draft, options);
      CHECK(allocations_per_steady_state(decoder, 20, 300) == 0);
    }
    specdec::DecoderOptions greedy{.sampling = {.temperature = 0.0}};
    greedy.tree_shape = specdec::TreeShape::branching({2, 2, 2});
    specdec::SpeculativeDecoder decoder(target, draft, greedy);
    CHECK(allocations_per_steady_state(decoder, 20, 300) == 0);
  }
  SECTION("KV-cache models on CachedContext") {
    KvMarkovModel target(target_model);
    KvMarkovModel draft(draft_model);
    specdec::SpeculativeDecoder decoder(target, draft, {.sampling = {.temperature = 0.9}});
    CHECK(allocations_per_steady_state(decoder, 20, 300) == 0);
  }
}

TEST_CASE("Standardizer: reserve covers long top-p rows, so apply allocates nothing",
          "[sampling]") {
  // Rows of at least 4096 probabilities find the nucleus through a band of listed ids and
  // keys (find_nucleus_sampled); reserve(V), which the decoder calls at construction, must
  // hold those buffers too, at T = 1 (where apply screens the row) and T != 1.
  constexpr std::size_t long_vocab = 8192;
  std::vector<float> row(long_vocab);
  specdec::xoshiro256pp g(3);
  double total = 0.0;
  for (float& x : row) {
    x = static_cast<float>(std::exp(4.0 * specdec::uniform01<double>(g)));
    total += static_cast<double>(x);
  }
  for (float& x : row) x = static_cast<float>(static_cast<double>(x) / total);
  std::vector<float> out(long_vocab);
  for (const double temperature : {1.0, 0.7}) {
    specdec::Standardizer<float> standardizer({.temperature = temperature, .top_p = 0.9});
    standardizer.reserve(long_vocab);
    specdec::detail::first_pass_screen screen;
    specdec::testing::AllocationCounter counter;
    (void)standardizer.apply(std::span<const float>(row), std::span<float>(out), &screen);
    CHECK(counter.stop() == 0);
    CHECK(standardizer.nucleus_fallbacks() == 0);
    CHECK(screen.signs_passed);  // screened at T = 1 (with the band) and at T != 1
    CHECK(screen.total == Catch::Approx(1.0).epsilon(1e-6));
  }
}

TEST_CASE("SpeculativeDecoder: generate() allocates only for its result", "[speculative_decoder]") {
  const auto target_model = target_chain();
  const auto draft_model = draft_chain(target_model);
  BatchedMarkovModel<float> target(target_model);
  auto draft = draft_model;
  specdec::SpeculativeDecoder decoder(target, draft, {.sampling = {.temperature = 0.8}});
  const std::vector<token_id> prompt = {5, 6, 7};
  const auto count = [&](std::size_t tokens) {
    (void)decoder.generate(prompt, tokens, 1);  // warm up at this length
    specdec::testing::AllocationCounter counter;
    const auto result = decoder.generate(prompt, tokens, 2);
    const std::size_t allocations = counter.stop();
    CHECK(result.tokens.size() == tokens);
    return allocations;
  };
  const std::size_t short_run = count(50);
  const std::size_t long_run = count(400);
  CHECK(short_run == long_run);
  CHECK(long_run <= 4);  // the result's tokens and histogram; nothing per step
}
