// Generation with the llama engine: plain decoding of the target (the baseline) and
// speculative decoding with each kind of drafter specdec offers, behind one call each. The
// command-line program, the demo, the benchmark and the tests all run through here, so
// what they compare is the same code.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "engine.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"

namespace llama {

/// How the draft tokens of a speculative run are proposed.
enum class drafter_kind {
  model,          ///< the draft model, a chain of gamma tokens sampled from its q rows
  ngram,          ///< specdec::NgramDrafter over the context (no draft model)
  prompt_lookup,  ///< specdec::PromptLookupDrafter: copies continuations of earlier matches
  tree,           ///< the draft model, a token tree (RunOptions::tree_shape), one target pass
  controller,     ///< the draft model with specdec::OptimalGammaController (Thm 3.8, c measured)
};

[[nodiscard]] inline std::string_view to_string(drafter_kind kind) noexcept {
  switch (kind) {
    case drafter_kind::model:
      return "model";
    case drafter_kind::ngram:
      return "ngram";
    case drafter_kind::prompt_lookup:
      return "prompt-lookup";
    case drafter_kind::tree:
      return "tree";
    case drafter_kind::controller:
      return "controller";
  }
  return "unknown";
}

[[nodiscard]] inline std::optional<drafter_kind> parse_drafter(std::string_view name) noexcept {
  for (const drafter_kind kind :
       {drafter_kind::model, drafter_kind::ngram, drafter_kind::prompt_lookup, drafter_kind::tree,
        drafter_kind::controller}) {
    if (name == to_string(kind)) return kind;
  }
  return std::nullopt;
}

/// Whether `kind` needs the draft model.
[[nodiscard]] constexpr bool uses_draft_model(drafter_kind kind) noexcept {
  return kind == drafter_kind::model || kind == drafter_kind::tree ||
         kind == drafter_kind::controller;
}

/// The default token tree of the tree drafter: a chain of four with a second candidate for
/// each of the first two tokens (7 draft nodes, one target pass of 8 positions).
[[nodiscard]] inline specdec::TreeShape default_tree_shape() {
  return specdec::TreeShape::from_parents({specdec::TreeShape::npos, 0, 0, 1, 1, 3, 5, 6});
}

struct RunOptions {
  specdec::SamplingOptions sampling{};  ///< temperature 0: greedy
  std::size_t max_new_tokens = 128;
  std::uint64_t seed = 0;
  std::size_t gamma = 4;       ///< drafts per step (model, ngram, prompt lookup)
  std::size_t max_gamma = 12;  ///< the controller's search range
  specdec::TreeShape tree_shape = default_tree_shape();
  std::vector<specdec::token_id> stop_tokens{};
  std::function<void(const specdec::EmittedToken&)> on_token{};
  /// How steps verify model drafts (DecoderOptions::verification: chains and trees).
  specdec::verification_rule verification = specdec::verification_rule::automatic;
};

struct RunResult {
  std::vector<specdec::token_id> tokens;
  specdec::stop_reason stop = specdec::stop_reason::max_new_tokens;
  specdec::DecoderStatistics statistics{};  ///< speculative runs
  double seconds = 0.0;                     ///< wall time of the generation (prompt included)
  Engine::Counters target{};                ///< the target's work
  Engine::Counters draft{};                 ///< the draft model's work

  [[nodiscard]] double tokens_per_second() const noexcept {
    return seconds > 0.0 ? static_cast<double>(tokens.size()) / seconds : 0.0;
  }
};

namespace detail {

/// The loop of plain decoding: resets the target, then for each new token calls
/// `draw(context, g)` for the next token, appends it, reports it, stops at a stop token.
template <class Draw>
RunResult plain_loop(Engine& target, std::span<const specdec::token_id> prompt,
                     const RunOptions& options, Draw&& draw) {
  target.reset();
  target.reset_counters();
  RunResult result;
  specdec::default_engine g(options.seed);
  std::vector<specdec::token_id> context(prompt.begin(), prompt.end());
  context.reserve(prompt.size() + options.max_new_tokens);
  const auto started = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < options.max_new_tokens; ++i) {
    const specdec::token_id next = draw(std::span<const specdec::token_id>(context), g);
    context.push_back(next);
    result.tokens.push_back(next);
    if (options.on_token) {
      options.on_token({next, specdec::token_source::correction, i, context.size() - 1});
    }
    if (std::find(options.stop_tokens.begin(), options.stop_tokens.end(), next) !=
        options.stop_tokens.end()) {
      result.stop = specdec::stop_reason::stop_token;
      break;
    }
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  result.target = target.counters();
  return result;
}

}  // namespace detail

/// Plain autoregressive decoding of the target, as a competent engine writes it: one
/// forward pass per token over its KV cache, the logits standardized (temperature, top-k,
/// top-p, min-p) by specdec's Standardizer, one draw per token (greedy: the argmax, lowest
/// id on ties). Its output law is the one speculative decoding must reproduce.
inline RunResult generate_plain(Engine& target, std::span<const specdec::token_id> prompt,
                                const RunOptions& options) {
  specdec::Standardizer<float> standardizer(options.sampling);
  std::vector<float> row(target.vocab_size());
  return detail::plain_loop(
      target, prompt, options,
      [&](std::span<const specdec::token_id> context, specdec::default_engine& g) {
        const std::span<const float> logits = target.next_token_logits(context);
        if (options.sampling.greedy()) {
          return static_cast<specdec::token_id>(std::max_element(logits.begin(), logits.end()) -
                                                logits.begin());
        }
        standardizer.apply_logits(logits, std::span<float>(row));
        return specdec::sample_from_row(std::span<const float>(row), g);
      });
}

/// Seconds per call of the operations Theorem 3.8 is built from, each the median of `calls`
/// measurements at `context`: one target position, the target's batched call of gamma + 1
/// positions (what a decoding step costs: the previous step's token and gamma drafts), one
/// draft position. Calls alternate between two last tokens, so each one rolls the cache
/// back one position and evaluates new positions, as decoding does.
///
/// The measurements are interleaved, one of each per round, so that a machine whose memory
/// bandwidth drifts (a shared host) affects them alike and their ratios stay meaningful. A
/// draft position is timed twice per round: as decoding meets it, gamma draft calls right
/// after the batched target call whose weight stream has evicted the draft's weights
/// (`draft_in_loop`, the mean of the gamma calls), and gamma further calls with its weights
/// in cache (`draft_single`).
struct Costs {
  double target_single = 0.0;
  double target_batched = 0.0;
  double draft_single = 0.0;
  double draft_in_loop = 0.0;
  /// c of Definition 3.7: one draft position over one target position (cache-warm draft).
  [[nodiscard]] double c() const { return draft_single / target_single; }
  /// c as the decoding loop pays it: a draft position after a target pass.
  [[nodiscard]] double c_in_loop() const { return draft_in_loop / target_single; }
  /// The batched target call over a single-position call (Theorem 3.8 assumes 1).
  [[nodiscard]] double batched_ratio() const { return target_batched / target_single; }
  /// One decoding step (gamma draft positions at `c`, one batched target call) in units of
  /// one target position: Theorem 3.8's denominator with the measured batched call charged.
  [[nodiscard]] double step_cost(std::size_t gamma, double c) const {
    return static_cast<double>(gamma) * c + batched_ratio();
  }
};

/// The prompt the demo and the llama benchmarks generate after: Python source, the shipped
/// pair's training domain.
inline constexpr const char* stack_prompt =
    "class Stack:\n"
    "    \"\"\"A last-in, first-out stack of items.\"\"\"\n"
    "\n"
    "    def __init__(self):\n"
    "        self.items = []\n"
    "\n"
    "    def push(self, item):\n";

/// The median of `values` (the mean of the middle two for an even count; 0 when empty).
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

inline Costs measure_costs(Engine& target, Engine& draft,
                           std::span<const specdec::token_id> context, std::size_t gamma,
                           std::size_t calls = 31) {
  std::vector<specdec::token_id> a(context.begin(), context.end());
  std::vector<specdec::token_id> b = a;
  b.back() = a.back() == 3 ? 4 : 3;
  const std::vector<specdec::token_id> drafts(gamma, a.back());
  const std::size_t draft_calls = std::max<std::size_t>(gamma, 1);
  using clock = std::chrono::steady_clock;
  const auto since = [](clock::time_point start) {
    return std::chrono::duration<double>(clock::now() - start).count();
  };
  // Seconds per position, the mean of gamma draft calls as a decoding step makes them.
  const auto draft_position = [&] {
    const auto start = clock::now();
    for (std::size_t j = 0; j < draft_calls; ++j) (void)draft.next_token_logits(j % 2 == 0 ? a : b);
    return since(start) / static_cast<double>(draft_calls);
  };
  std::vector<double> single, batched, in_loop, warm;
  target.reset();
  draft.reset();
  (void)target.next_token_logits(b);  // the cache holds everything before the last position
  (void)draft.next_token_logits(b);
  for (std::size_t i = 0; i < calls; ++i) {
    const auto& last = i % 2 == 0 ? a : b;
    const auto& other = i % 2 == 0 ? b : a;
    auto start = clock::now();
    (void)target.next_token_logits(last);
    single.push_back(since(start));
    start = clock::now();
    (void)target.score_draft_logits(other, drafts);
    batched.push_back(since(start));
    in_loop.push_back(draft_position());  // right after the target's weight stream
    warm.push_back(draft_position());     // the draft's weights now in cache
  }
  Costs costs;
  costs.target_single = median(single);
  costs.target_batched = median(batched);
  costs.draft_in_loop = median(in_loop);
  costs.draft_single = median(warm);
  target.reset();
  draft.reset();
  return costs;
}

namespace detail {

template <class Target, class Draft>
RunResult run_decoder(Engine& target_engine, Engine* draft_engine, Target& target, Draft& draft,
                      specdec::DecoderOptions decoder_options,
                      std::span<const specdec::token_id> prompt, const RunOptions& options) {
  target_engine.reset();
  target_engine.reset_counters();
  if (draft_engine != nullptr) {
    draft_engine->reset();
    draft_engine->reset_counters();
  }
  decoder_options.sampling = options.sampling;
  decoder_options.verification = options.verification;
  decoder_options.stop_tokens = options.stop_tokens;
  decoder_options.on_token = options.on_token;
  RunResult result;
  const auto started = std::chrono::steady_clock::now();
  specdec::SpeculativeDecoder decoder(target, draft, std::move(decoder_options));
  auto generated = decoder.generate(prompt, options.max_new_tokens, options.seed);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  result.tokens = std::move(generated.tokens);
  result.stop = generated.stop;
  result.statistics = std::move(generated.statistics);
  result.target = target_engine.counters();
  if (draft_engine != nullptr) result.draft = draft_engine->counters();
  return result;
}

}  // namespace detail

/// Speculative decoding of `target` with the drafter `kind` (`draft` must be given for the
/// kinds that use the draft model). Throws specdec::decoding_error (with the tokens emitted
/// so far) when a model fails, std::invalid_argument for a missing draft model.
inline RunResult generate_speculative(Engine& target, Engine* draft, drafter_kind kind,
                                      std::span<const specdec::token_id> prompt,
                                      const RunOptions& options) {
  if (uses_draft_model(kind) && draft == nullptr) {
    throw std::invalid_argument("the " + std::string(to_string(kind)) +
                                " drafter needs a draft model");
  }
  specdec::LogitsModel target_model(target);
  specdec::DecoderOptions decoder_options;
  decoder_options.gamma_policy = specdec::FixedGamma{options.gamma};
  switch (kind) {
    case drafter_kind::model: {
      specdec::LogitsModel draft_model(*draft);
      return detail::run_decoder(target, draft, target_model, draft_model, decoder_options, prompt,
                                 options);
    }
    case drafter_kind::tree: {
      specdec::LogitsModel draft_model(*draft);
      decoder_options.tree_shape = options.tree_shape;
      return detail::run_decoder(target, draft, target_model, draft_model, decoder_options, prompt,
                                 options);
    }
    case drafter_kind::controller: {
      specdec::LogitsModel draft_model(*draft);
      specdec::OptimalGammaOptions controller;
      controller.max_gamma = options.max_gamma;
      controller.measure_cost = true;
      controller.prior_alpha = 0.7;
      decoder_options.gamma_policy = specdec::OptimalGammaController(controller);
      return detail::run_decoder(target, draft, target_model, draft_model, decoder_options, prompt,
                                 options);
    }
    case drafter_kind::ngram: {
      specdec::NgramDrafter drafter;
      return detail::run_decoder(target, nullptr, target_model, drafter, decoder_options, prompt,
                                 options);
    }
    case drafter_kind::prompt_lookup: {
      specdec::PromptLookupDrafter drafter;
      return detail::run_decoder(target, nullptr, target_model, drafter, decoder_options, prompt,
                                 options);
    }
  }
  throw std::invalid_argument("unknown drafter");
}

}  // namespace llama
