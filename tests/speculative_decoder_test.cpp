// Tests for include/specdec/speculative_decoder.hpp: type-level checks, option checks, the
// token budget, stop tokens and sequences, streaming provenance, statistics, the step API,
// the gamma policy protocol, model errors and recovery. Exactness, greedy identity, KV
// rollback and allocation live in the other speculative_decoder_*_test.cpp files.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "specdec/gamma_policy.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "speculative_decoder_models.hpp"

namespace {

using Catch::Matchers::ContainsSubstring;
using specdec::DecoderOptions;
using specdec::SpeculativeDecoder;
using specdec::stop_reason;
using specdec::token_id;
using specdec::token_source;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::CountingUpDrafter;
using specdec::testing::GreedyChainDrafter;
using specdec::testing::MarkovModel;

// A context-free model: the same row after every context.
template <class T>
struct UnigramModel {
  std::vector<T> row;
  std::size_t calls = 0;
  std::size_t vocab_size() const { return row.size(); }
  std::span<const T> next_token_probabilities(std::span<const token_id>) {
    ++calls;
    return row;
  }
};

struct NotAModel {
  std::vector<float> next_token_probabilities(std::span<const token_id>) { return {1.0F}; }
};

template <class Target, class Draft>
concept decoder_instantiable = requires {
  typename SpeculativeDecoder<Target, Draft>;
};

// Wraps a model and corrupts the row of its `fail_at`-th call (0-based).
template <class Model>
struct FaultyModel {
  enum class fault { none, nan, infinity, negative, zero, unnormalized, wrong_size, throws };
  Model* inner;
  fault kind = fault::none;
  std::size_t fail_at = 0;
  std::size_t calls = 0;
  std::vector<double> buffer{};

  std::size_t vocab_size() const { return inner->vocab_size(); }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    const auto row = inner->next_token_probabilities(context);
    buffer.assign(row.begin(), row.end());
    if (calls++ == fail_at) {
      switch (kind) {
        case fault::none:
          break;
        case fault::nan:
          buffer[1] = std::numeric_limits<double>::quiet_NaN();
          break;
        case fault::infinity:
          buffer[2] = std::numeric_limits<double>::infinity();
          break;
        case fault::negative:
          buffer[0] = -0.25;
          break;
        case fault::zero:
          std::fill(buffer.begin(), buffer.end(), 0.0);
          break;
        case fault::unnormalized:
          buffer[0] += 0.5;
          break;
        case fault::wrong_size:
          buffer.push_back(0.0);
          break;
        case fault::throws:
          throw std::runtime_error("out of device memory");
      }
    }
    return buffer;
  }
};

// Records how the decoder drives a gamma policy.
struct RecordingPolicy {
  std::size_t gamma = 3;
  double stop_below = 0.0;  // continue_drafting is false when top_probability < stop_below
  bool timing = false;
  mutable std::size_t next_gamma_calls = 0;
  mutable std::vector<std::pair<double, std::size_t>> continue_calls{};
  std::vector<specdec::StepFeedback> observed{};

  std::size_t next_gamma() const {
    ++next_gamma_calls;
    return gamma;
  }
  bool continue_drafting(double top_probability, std::size_t drafted) const {
    continue_calls.emplace_back(top_probability, drafted);
    return top_probability >= stop_below;
  }
  void observe(const specdec::StepFeedback& feedback) { observed.push_back(feedback); }
  bool needs_timing() const { return timing; }
};

MarkovModel<double> target_chain(std::size_t vocab = 8, std::uint64_t seed = 1) {
  return MarkovModel<double>::random(vocab, 2, seed, 1.5, 0.1);
}
MarkovModel<double> draft_chain(const MarkovModel<double>& target, std::uint64_t seed = 2) {
  return target.order1_blend(MarkovModel<double>::random(target.vocab_size(), 1, seed), 0.6);
}

const std::vector<token_id> prompt = {1, 2, 3};

template <class Function>
specdec::errc error_code_of(Function&& function) {
  try {
    function();
  } catch (const specdec::error& e) {
    return e.code();
  }
  return specdec::errc{};
}

}  // namespace

TEST_CASE("SpeculativeDecoder: type-level checks", "[speculative_decoder]") {
  using Target = MarkovModel<double>;
  using Batched = BatchedMarkovModel<float>;
  STATIC_REQUIRE(decoder_instantiable<Target, Target>);
  STATIC_REQUIRE(decoder_instantiable<Target, CountingUpDrafter>);
  STATIC_REQUIRE_FALSE(decoder_instantiable<NotAModel, Target>);
  STATIC_REQUIRE_FALSE(decoder_instantiable<Target, NotAModel>);
  STATIC_REQUIRE_FALSE(decoder_instantiable<CountingUpDrafter, Target>);  // drafters cannot verify
  STATIC_REQUIRE(SpeculativeDecoder<Target, Target>::draft_is_model);
  STATIC_REQUIRE_FALSE(SpeculativeDecoder<Target, CountingUpDrafter>::draft_is_model);
  STATIC_REQUIRE(SpeculativeDecoder<Batched, Target>::target_is_batched);
  STATIC_REQUIRE_FALSE(SpeculativeDecoder<Target, Batched>::target_is_batched);
  STATIC_REQUIRE(std::is_same_v<SpeculativeDecoder<Batched, Target>::value_type, float>);
  STATIC_REQUIRE(std::is_same_v<SpeculativeDecoder<Target, Batched>::value_type, double>);
  STATIC_REQUIRE(specdec::to_string(stop_reason::stop_sequence) == "stop_sequence");
}

TEST_CASE("SpeculativeDecoder: bad options throw invalid_option naming the option",
          "[speculative_decoder]") {
  auto target = target_chain();
  auto draft = draft_chain(target);
  const auto rejects = [&](DecoderOptions options, const std::string& name) {
    try {
      SpeculativeDecoder decoder(target, draft, std::move(options));
      FAIL("accepted a bad " << name);
    } catch (const specdec::error& e) {
      CHECK(e.code() == specdec::errc::invalid_option);
      CHECK_THAT(e.what(), ContainsSubstring(name));
    }
  };
  rejects({.sampling = {.temperature = -1.0}}, "temperature");
  rejects({.sampling = {.top_p = 0.0}}, "top_p");
  rejects({.sampling = {.top_p = 1.5}}, "top_p");
  rejects({.sampling = {.min_p = 2.0}}, "min_p");
  rejects({.lenience = 0.0}, "lenience");
  rejects({.lenience = 1.5}, "lenience");
  rejects({.sampling = {.temperature = 0.0}, .lenience = 0.5}, "lenience");
  rejects({.gamma_policy = RecordingPolicy{.gamma = 0}}, "gamma_policy");
  rejects({.stop_tokens = {3, 8}}, "stop_tokens");
  rejects({.stop_tokens = {-1}}, "stop_tokens");
  rejects({.stop_sequences = {{1, 2}, {}}}, "stop_sequences[1]");
  rejects({.stop_sequences = {{1, 99}}}, "stop_sequences[0]");
  CHECK(error_code_of([] { specdec::FixedGamma zero(0); }) == specdec::errc::invalid_option);
}

TEST_CASE("SpeculativeDecoder: vocabulary checks at construction", "[speculative_decoder]") {
  auto target = target_chain(8);
  auto small = MarkovModel<double>::random(7, 1, 3);
  const auto mismatch = error_code_of([&] { SpeculativeDecoder decoder(target, small); });
  CHECK(mismatch == specdec::errc::vocab_mismatch);
  UnigramModel<float> empty;
  UnigramModel<float> other{{1.0F}};
  CHECK(error_code_of([&] { SpeculativeDecoder decoder(empty, other); }) ==
        specdec::errc::invalid_size);
  // proposal drafters have no vocabulary: nothing to compare
  CountingUpDrafter drafter{8};
  CHECK_NOTHROW(SpeculativeDecoder(target, drafter));
}

TEST_CASE("SpeculativeDecoder: exactly max_new_tokens, never more", "[speculative_decoder]") {
  auto target = target_chain();
  auto copy = target;  // draft == target: every draft is accepted, steps emit gamma + 1
  auto draft = draft_chain(target);
  for (const std::size_t gamma : {1U, 4U, 6U}) {
    DecoderOptions options{.gamma_policy = specdec::FixedGamma(gamma)};
    SpeculativeDecoder perfect(target, copy, options);
    SpeculativeDecoder mixed(target, draft, options);
    for (const std::size_t budget : {0U, 1U, 2U, 4U, 5U, 6U, 7U, 13U, 40U}) {
      for (std::uint64_t seed = 0; seed < 5; ++seed) {
        const auto a = perfect.generate(prompt, budget, seed);
        const auto b = mixed.generate(prompt, budget, seed);
        CHECK(a.tokens.size() == budget);
        CHECK(b.tokens.size() == budget);
        CHECK(a.stop == stop_reason::max_new_tokens);
        CHECK(b.stop == stop_reason::max_new_tokens);
        // with a perfect draft every step but the last emits gamma + 1
        const std::size_t steps = (budget + gamma) / (gamma + 1);
        CHECK(a.statistics.steps == steps);
        CHECK(a.statistics.accepted_tokens == steps * gamma);
      }
    }
  }
}

TEST_CASE("SpeculativeDecoder: a stop token ends generation right after it",
          "[speculative_decoder]") {
  auto target = target_chain(8, 5);
  auto copy = target;
  const token_id stop = 4;
  DecoderOptions options{.gamma_policy = specdec::FixedGamma(6), .stop_tokens = {stop}};
  std::vector<specdec::EmittedToken> streamed;
  options.on_token = [&](const specdec::EmittedToken& token) { streamed.push_back(token); };
  SpeculativeDecoder decoder(target, copy, options);
  std::size_t stopped_inside_drafts = 0;
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    streamed.clear();
    const auto result = decoder.generate(prompt, 60, seed);
    const auto first_stop = std::find(result.tokens.begin(), result.tokens.end(), stop);
    if (first_stop == result.tokens.end()) {
      CHECK(result.stop == stop_reason::max_new_tokens);
      continue;
    }
    CHECK(result.stop == stop_reason::stop_token);
    CHECK(first_stop + 1 == result.tokens.end());  // nothing after it
    REQUIRE(streamed.size() == result.tokens.size());
    if (streamed.back().source == token_source::draft) ++stopped_inside_drafts;
  }
  CHECK(stopped_inside_drafts > 20);  // the stop token was often an accepted draft
}

TEST_CASE("SpeculativeDecoder: drafting stops at a drafted stop token", "[speculative_decoder]") {
  // The draft always proposes the stop token; the target gives it probability 1/4.
  UnigramModel<double> target{{0.25, 0.25, 0.25, 0.25}};
  UnigramModel<double> draft{{0.0, 0.0, 1.0, 0.0}};
  SpeculativeDecoder decoder(target, draft,
                             {.gamma_policy = specdec::FixedGamma(5), .stop_tokens = {2}});
  specdec::xoshiro256pp g(3);
  for (int trial = 0; trial < 100; ++trial) {
    const auto step = decoder.step(prompt, g);
    CHECK(step.drafted == 1);  // x_1 is the stop token: no x_2
    CHECK(step.draft_calls == 1);
    if (step.accepted == 1) {
      CHECK(step.tokens.size() == 1);  // the bonus after the stop token is dropped
      CHECK(step.stop == stop_reason::stop_token);
    } else {
      CHECK(step.tokens.size() == 1);
      CHECK(step.tokens[0] != 2);  // correction from p without the stop token
      CHECK(step.stop == stop_reason::none);
    }
  }
  CHECK(decoder.statistics().drafted_tokens == 100);
}

TEST_CASE("SpeculativeDecoder: stop sequences", "[speculative_decoder]") {
  // A deterministic cycle 0 -> 1 -> 2 -> 3 -> 0 decoded greedily.
  std::vector<double> table(16, 0.0);
  for (std::size_t a = 0; a < 4; ++a) table[a * 4 + (a + 1) % 4] = 1.0;
  MarkovModel<double> cycle(4, 1, table);
  auto draft = MarkovModel<double>::random(4, 1, 9);
  DecoderOptions options{.sampling = {.temperature = 0.0},
                         .gamma_policy = specdec::FixedGamma(3),
                         .stop_sequences = {{2, 3}}};
  SpeculativeDecoder decoder(cycle, draft, options);
  const std::vector<token_id> starts_at_2 = {0, 1, 2};
  auto result = decoder.generate(starts_at_2, 20, 1);
  // generated 3, 0, 1, 2, 3: "2 3" across the prompt boundary does not count
  CHECK(result.tokens == std::vector<token_id>{3, 0, 1, 2, 3});
  CHECK(result.stop == stop_reason::stop_sequence);
  // step(): stop sequences are matched on the whole context
  specdec::xoshiro256pp g(1);
  const auto step = decoder.step(starts_at_2, g);
  CHECK(std::vector<token_id>(step.tokens.begin(), step.tokens.end()) == std::vector<token_id>{3});
  CHECK(step.stop == stop_reason::stop_sequence);
}

TEMPLATE_TEST_CASE("SpeculativeDecoder: streaming provenance and statistics agree",
                   "[speculative_decoder]", float, double) {
  auto target_double = target_chain(16, 7);
  auto draft_double = draft_chain(target_double, 8);
  // rebuild in TestType
  const auto convert = [](const MarkovModel<double>& model) {
    std::vector<TestType> table;
    for (std::size_t s = 0; s < model.states(); ++s) {
      for (const double x : model.row(s)) table.push_back(static_cast<TestType>(x));
    }
    return MarkovModel<TestType>(model.vocab_size(), model.order(), table);
  };
  BatchedMarkovModel<TestType> target(convert(target_double));
  auto draft = convert(draft_double);
  std::vector<specdec::EmittedToken> streamed;
  DecoderOptions options{.sampling = {.temperature = 0.8, .top_k = 10},
                         .gamma_policy = specdec::FixedGamma(4)};
  options.on_token = [&](const specdec::EmittedToken& token) { streamed.push_back(token); };
  SpeculativeDecoder decoder(target, draft, options);
  const auto result = decoder.generate(prompt, 500, 11);
  REQUIRE(streamed.size() == result.tokens.size());
  const auto& stats = result.statistics;
  std::size_t step = 0;
  std::size_t drafts_in_step = 0;
  std::size_t corrections = 0;
  std::size_t bonuses = 0;
  for (std::size_t k = 0; k < streamed.size(); ++k) {
    const auto& token = streamed[k];
    CHECK(token.token == result.tokens[k]);
    CHECK(token.position == prompt.size() + k);
    CHECK(token.step == step);
    if (token.source == token_source::draft) {
      ++drafts_in_step;
      continue;
    }
    // a step is x_1..x_n then exactly one correction or bonus
    if (token.source == token_source::bonus) {
      CHECK(drafts_in_step == 4);
      ++bonuses;
    } else {
      CHECK(drafts_in_step < 4);
      ++corrections;
    }
    drafts_in_step = 0;
    ++step;
  }
  // the last step may have been cut by the budget
  CHECK((step == stats.steps || step + 1 == stats.steps));
  CHECK(stats.emitted_tokens == result.tokens.size());
  CHECK(stats.accepted_tokens + stats.steps >= stats.emitted_tokens);
  CHECK(stats.accepted_tokens + stats.steps - stats.emitted_tokens <= 4);
  CHECK(stats.drafted_tokens == 4 * stats.steps);
  CHECK(stats.draft_calls == stats.drafted_tokens);
  CHECK(stats.target_calls == stats.steps);  // batched: one call per step
  CHECK(target.batched_calls == stats.steps);
  CHECK(target.calls == 0);
  std::size_t histogram_steps = 0;
  std::size_t histogram_accepted = 0;
  for (std::size_t n = 0; n < stats.accepted_histogram.size(); ++n) {
    histogram_steps += stats.accepted_histogram[n];
    histogram_accepted += n * stats.accepted_histogram[n];
  }
  CHECK(histogram_steps == stats.steps);
  CHECK(histogram_accepted == stats.accepted_tokens);
  REQUIRE(stats.accepted_histogram.size() == 5);
  CHECK(bonuses <= stats.accepted_histogram[4]);
  CHECK(corrections <= stats.steps - stats.accepted_histogram[4]);
  CHECK(stats.residual_fallbacks == 0);
  CHECK(stats.tokens_per_target_call() == Catch::Approx(stats.tokens_per_step()));
  CHECK(stats.acceptance_rate() == Catch::Approx(static_cast<double>(stats.accepted_tokens) /
                                                 (4.0 * static_cast<double>(stats.steps))));
  CHECK(stats.mean_beta() > 0.0);
  CHECK(stats.mean_beta() < 1.0);
  // the decoder's lifetime statistics saw the same steps
  CHECK(decoder.statistics().steps == stats.steps);
  CHECK(decoder.statistics().emitted_tokens == stats.emitted_tokens);
}

TEST_CASE("SpeculativeDecoder: mean beta is sum min(p, q) of the standardized rows",
          "[speculative_decoder]") {
  UnigramModel<double> target{{0.5, 0.2, 0.2, 0.1, 0.0}};
  UnigramModel<double> draft{{0.1, 0.1, 0.3, 0.3, 0.2}};
  for (const auto& sampling :
       {specdec::SamplingOptions{}, specdec::SamplingOptions{.temperature = 0.6, .top_k = 3}}) {
    const auto p = specdec::standardize(target.row, sampling);
    const auto q = specdec::standardize(draft.row, sampling);
    double beta = 0.0;
    for (std::size_t j = 0; j < p.size(); ++j) beta += std::min(p[j], q[j]);
    SpeculativeDecoder decoder(target, draft, {.sampling = sampling});
    const auto result = decoder.generate(prompt, 2000, 5);
    const auto& stats = result.statistics;
    CHECK(stats.beta_positions > 0);
    CHECK(stats.mean_beta() == Catch::Approx(beta).epsilon(1e-12));
    // beta is the acceptance probability per verified position
    CHECK(static_cast<double>(stats.accepted_tokens) / static_cast<double>(stats.beta_positions) ==
          Catch::Approx(beta).margin(0.06));
  }
  // proposal-only drafter proposing token 0 + ... : beta = p(x) at the proposed token
  struct AlwaysZero {
    std::size_t propose(std::span<const token_id>, std::span<token_id> out) {
      std::fill(out.begin(), out.end(), 0);
      return out.size();
    }
  } zeros;
  SpeculativeDecoder proposals(target, zeros);
  CHECK(proposals.generate(prompt, 300, 5).statistics.mean_beta() == Catch::Approx(0.5));
  // greedy: beta is the match indicator; the argmax of both is token 2 vs 0 -> 0
  SpeculativeDecoder greedy(target, draft, {.sampling = {.temperature = 0.0}});
  const auto greedy_result = greedy.generate(prompt, 50, 5);
  CHECK(greedy_result.statistics.mean_beta() == 0.0);
  CHECK(greedy_result.tokens == std::vector<token_id>(50, 0));
  // collect_beta off
  SpeculativeDecoder quiet(target, draft, {.collect_beta = false});
  CHECK(quiet.generate(prompt, 50, 5).statistics.beta_positions == 0);
}

TEST_CASE("SpeculativeDecoder: mean beta at T = 1 with in-place rows and unnormalised drafts",
          "[speculative_decoder]") {
  // At T = 1 beta comes from two passes: sum min(p, q) over each accepted row pair and
  // sum p - Z from the residual draw's pass at the rejected position (lenience 1), with q the
  // draft row over its sum (kept as a scalar). Both must give the same beta, for a batched
  // target used in place and for per-prefix copies, for draft rows off by a factor.
  const std::vector<double> p{0.5, 0.2, 0.2, 0.1, 0.0};
  const std::vector<double> q{0.1, 0.1, 0.3, 0.3, 0.2};
  double beta = 0.0;
  for (std::size_t j = 0; j < p.size(); ++j) beta += std::min(p[j], q[j]);
  for (const double factor : {1.0, 1.7, 0.6}) {
    std::vector<double> scaled = q;
    for (double& x : scaled) x *= factor;
    UnigramModel<double> draft{scaled};
    UnigramModel<double> per_prefix{p};
    specdec::testing::BatchedMarkovModel<double> batched(
        specdec::testing::MarkovModel<double>(p.size(), 0, p));
    for (const double lenience : {1.0, 0.5}) {
      INFO("factor " << factor << ", lenience " << lenience);
      const specdec::DecoderOptions options{.gamma_policy = specdec::FixedGamma(3),
                                            .lenience = lenience,
                                            .validate_rows = factor == 1.0};
      SpeculativeDecoder in_place(batched, draft, options);
      SpeculativeDecoder copied(per_prefix, draft, options);
      const auto in_place_stats = in_place.generate(prompt, 2000, 7).statistics;
      CHECK(in_place_stats.beta_positions > 0);
      CHECK(in_place_stats.mean_beta() == Catch::Approx(beta).epsilon(1e-12));
      const auto copied_stats = copied.generate(prompt, 2000, 7).statistics;
      CHECK(copied_stats.beta_positions > 0);
      CHECK(copied_stats.mean_beta() == Catch::Approx(beta).epsilon(1e-12));
    }
  }
}

namespace {

/// Drafts up to 3 tokens and records every top probability continue_drafting is given;
/// says it needs them or not (`declares`), or has no needs_top_probability at all.
template <int Declares>  // -1: no member, 0: false, 1: true
struct TopRecorder {
  std::vector<double>* seen;
  [[nodiscard]] std::size_t next_gamma() const { return 3; }
  [[nodiscard]] bool continue_drafting(double top_probability, std::size_t) const {
    seen->push_back(top_probability);
    return true;
  }
  void observe(const specdec::StepFeedback&) {}
  [[nodiscard]] bool needs_timing() const { return false; }
  [[nodiscard]] bool needs_top_probability() const requires(Declares >= 0) { return Declares == 1; }
};

}  // namespace

TEST_CASE("SpeculativeDecoder: the draft top probability reaches policies that read it",
          "[speculative_decoder]") {
  // T = 1: max q over the row's sum (the fused draft pass takes the maximum only when the
  // policy needs it; an unnormalised row with validation off shows the normaliser applies).
  UnigramModel<double> target{{0.4, 0.3, 0.2, 0.1}};
  for (const bool normalised : {true, false}) {
    UnigramModel<double> draft{normalised ? std::vector<double>{0.1, 0.6, 0.2, 0.1}
                                          : std::vector<double>{0.2, 1.2, 0.4, 0.2}};
    for (const double temperature : {1.0, 0.5}) {
      const auto q = specdec::standardize(std::vector<double>{0.1, 0.6, 0.2, 0.1},
                                          specdec::SamplingOptions{.temperature = temperature});
      const double top = *std::max_element(q.begin(), q.end());
      INFO("normalised " << normalised << ", T = " << temperature);
      std::vector<double> seen_default;
      std::vector<double> seen_true;
      std::vector<double> seen_false;
      const auto run = [&](specdec::AnyGammaPolicy policy) {
        SpeculativeDecoder decoder(target, draft,
                                   {.sampling = {.temperature = temperature},
                                    .gamma_policy = std::move(policy),
                                    .validate_rows = normalised});
        (void)decoder.generate(prompt, 20, 3);
      };
      run(TopRecorder<-1>{&seen_default});
      run(TopRecorder<1>{&seen_true});
      run(TopRecorder<0>{&seen_false});
      REQUIRE(!seen_default.empty());
      REQUIRE(!seen_false.empty());
      for (const double value : seen_default) CHECK(value == Catch::Approx(top).epsilon(1e-12));
      for (const double value : seen_true) CHECK(value == Catch::Approx(top).epsilon(1e-12));
      // A policy that says it ignores the value is given 1 at T = 1 (not computed); at
      // other temperatures the standardizer computes it anyway.
      for (const double value : seen_false) {
        CHECK(value == Catch::Approx(temperature == 1.0 ? 1.0 : top).epsilon(1e-12));
      }
    }
  }
}

TEST_CASE("SpeculativeDecoder: zero-residual fallbacks are counted", "[speculative_decoder]") {
  // Target rows at half scale (a violated precondition, so validation is off): every
  // rejection finds max(0, p - q) == 0 and the core falls back to p.
  struct HalfScaled {
    std::vector<double> row = {0.125, 0.125, 0.125, 0.125};
    std::size_t vocab_size() const { return 4; }
    std::span<const double> next_token_probabilities(std::span<const token_id>) { return row; }
  } target;
  UnigramModel<double> draft{{0.25, 0.25, 0.25, 0.25}};
  std::size_t corrections = 0;
  DecoderOptions counting{.validate_rows = false};
  counting.on_token = [&](const specdec::EmittedToken& token) {
    corrections += token.source == token_source::correction ? 1U : 0U;
  };
  SpeculativeDecoder counted(target, draft, counting);
  const auto result = counted.generate(prompt, 200, 3);
  CHECK(result.statistics.residual_fallbacks > 0);
  // every correction came from the fallback (one more if the budget cut the last one)
  CHECK(result.statistics.residual_fallbacks >= corrections);
  CHECK(result.statistics.residual_fallbacks <= corrections + 1);
}

TEST_CASE("SpeculativeDecoder: step() reproduces generate() with the same generator",
          "[speculative_decoder]") {
  auto target_model = target_chain(12, 21);
  BatchedMarkovModel<double> target(target_model);
  auto draft = draft_chain(target_model, 22);
  DecoderOptions options{.sampling = {.temperature = 0.9, .top_p = 0.95},
                         .gamma_policy = specdec::FixedGamma(3),
                         .stop_tokens = {11}};
  SpeculativeDecoder decoder(target, draft, options);
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    specdec::xoshiro256pp g1(seed);
    const auto generated = decoder.generate(prompt, 30, g1);
    specdec::xoshiro256pp g2(seed);
    std::vector<token_id> context = prompt;
    stop_reason stop = stop_reason::max_new_tokens;
    while (context.size() - prompt.size() < 30) {
      const auto step = decoder.step(context, g2, 30 - (context.size() - prompt.size()));
      context.insert(context.end(), step.tokens.begin(), step.tokens.end());
      if (step.stop != stop_reason::none) {
        stop = step.stop;
        break;
      }
    }
    CHECK(std::vector<token_id>(context.begin() + 3, context.end()) == generated.tokens);
    CHECK(stop == generated.stop);
    CHECK(g1 == g2);
  }
  specdec::xoshiro256pp g0(1);
  const auto nothing = decoder.step(prompt, g0, 0);
  CHECK(nothing.tokens.empty());
  CHECK(nothing.stop == stop_reason::max_new_tokens);
  CHECK(g0 == specdec::xoshiro256pp(1));
}

TEST_CASE("SpeculativeDecoder: batched and per-prefix targets give identical output",
          "[speculative_decoder]") {
  // A batched target's rows are standardized when verification first reads them, a
  // per-prefix target's as they arrive: the same tokens. The second draft is the target
  // itself, so that every draft is accepted and the bonus row is read too.
  auto model = target_chain(10, 31);
  BatchedMarkovModel<double> batched(model);
  const MarkovModel<double> drafts[] = {draft_chain(model, 32), model};
  for (const auto& sampling :
       {specdec::SamplingOptions{}, specdec::SamplingOptions{.temperature = 0.7, .top_p = 0.8},
        specdec::SamplingOptions{.temperature = 0.7, .top_k = 3},
        specdec::SamplingOptions{.temperature = 0.0}}) {
    for (MarkovModel<double> draft : drafts) {
      DecoderOptions options{.sampling = sampling, .gamma_policy = specdec::FixedGamma(4)};
      SpeculativeDecoder one_call(batched, draft, options);
      SpeculativeDecoder per_prefix(model, draft, options);
      const auto a = one_call.generate(prompt, 100, 77);
      const auto b = per_prefix.generate(prompt, 100, 77);
      CHECK(a.tokens == b.tokens);
      CHECK(a.statistics.target_calls == a.statistics.steps);
      CHECK(b.statistics.target_calls == b.statistics.drafted_tokens + b.statistics.steps);
    }
  }
}

TEST_CASE("SpeculativeDecoder: proposal-only drafters", "[speculative_decoder]") {
  auto model = target_chain(8, 41);
  GreedyChainDrafter<double> good(model);
  CountingUpDrafter bad{8};
  SpeculativeDecoder with_good(model, good, {.gamma_policy = specdec::FixedGamma(4)});
  SpeculativeDecoder with_bad(model, bad, {.gamma_policy = specdec::FixedGamma(4)});
  const auto a = with_good.generate(prompt, 200, 1);
  const auto b = with_bad.generate(prompt, 200, 1);
  CHECK(a.tokens.size() == 200);
  CHECK(a.statistics.draft_calls == a.statistics.steps);  // one propose() per step
  CHECK(good.calls == a.statistics.steps);
  CHECK(a.statistics.acceptance_rate() > b.statistics.acceptance_rate());

  // a drafter with no proposal: the step samples t from p_1 alone
  struct Silent {
    std::size_t propose(std::span<const token_id>, std::span<token_id>) { return 0; }
  } silent;
  SpeculativeDecoder plain(model, silent);
  const auto c = plain.generate(prompt, 20, 1);
  CHECK(c.tokens.size() == 20);
  CHECK(c.statistics.steps == 20);
  CHECK(c.statistics.drafted_tokens == 0);
}

TEST_CASE("SpeculativeDecoder: the gamma policy protocol", "[speculative_decoder]") {
  UnigramModel<double> target{{0.4, 0.3, 0.2, 0.1}};
  UnigramModel<double> draft{{0.1, 0.2, 0.3, 0.4}};
  for (const bool timing : {false, true}) {
    SpeculativeDecoder decoder(target, draft,
                               {.sampling = {.temperature = 1.0, .top_k = 2},
                                .gamma_policy = RecordingPolicy{.gamma = 3, .timing = timing}});
    specdec::xoshiro256pp g(5);
    std::size_t drafted = 0;
    for (int s = 0; s < 10; ++s) drafted += decoder.step(prompt, g).drafted;
    const auto* policy = decoder.gamma_policy().target<RecordingPolicy>();
    REQUIRE(policy != nullptr);
    CHECK(policy->observed.size() == 10);
    CHECK(policy->next_gamma_calls >= 10);
    // asked after each drafted token but the last: (gamma - 1) per step
    CHECK(policy->continue_calls.size() == 20);
    for (const auto& [top, count] : policy->continue_calls) {
      CHECK(top == Catch::Approx(4.0 / 7.0));  // max of the standardized q (top-2: .4/.7)
      CHECK((count == 1 || count == 2));
    }
    std::size_t observed_drafted = 0;
    for (const auto& feedback : policy->observed) {
      observed_drafted += feedback.drafted;
      CHECK(feedback.accepted <= feedback.drafted);
      if (!timing) {
        CHECK(feedback.draft_seconds == 0.0);
        CHECK(feedback.target_seconds == 0.0);
      } else {
        CHECK(feedback.draft_seconds >= 0.0);
        CHECK(feedback.target_seconds >= 0.0);
      }
    }
    CHECK(observed_drafted == drafted);
  }
  // continue_drafting == false ends drafting after the first token
  SpeculativeDecoder confident(target, draft,
                               {.gamma_policy = RecordingPolicy{.gamma = 5, .stop_below = 0.9}});
  specdec::xoshiro256pp g(6);
  CHECK(confident.step(prompt, g).drafted == 1);
  // proposal drafters report top probability 1.0
  CountingUpDrafter drafter{4};
  SpeculativeDecoder proposing(target, drafter, {.gamma_policy = RecordingPolicy{.gamma = 3}});
  (void)proposing.step(prompt, g);
  for (const auto& call : proposing.gamma_policy().target<RecordingPolicy>()->continue_calls) {
    CHECK(call.first == 1.0);
  }
}

TEST_CASE("SpeculativeDecoder: varying gamma grows the workspace", "[speculative_decoder]") {
  struct Cycling {
    std::size_t gamma = 1;
    std::size_t next_gamma() const { return gamma; }
    bool continue_drafting(double, std::size_t) const { return true; }
    void observe(const specdec::StepFeedback&) { gamma = gamma % 9 + 1; }
    bool needs_timing() const { return false; }
  };
  auto model = target_chain(8, 51);
  auto draft = draft_chain(model, 52);
  SpeculativeDecoder decoder(model, draft, {.gamma_policy = Cycling{}});
  const auto result = decoder.generate(prompt, 300, 2);
  CHECK(result.tokens.size() == 300);
  CHECK(result.statistics.accepted_histogram.size() <= 10);
}

TEST_CASE("SpeculativeDecoder: lenience is forwarded to the verifier", "[speculative_decoder]") {
  UnigramModel<double> target{{0.7, 0.1, 0.1, 0.1}};
  UnigramModel<double> draft{{0.1, 0.1, 0.1, 0.7}};
  // Algorithm 1 at lenience 1 (the default verifies by blocks, which accepts more) against
  // lenience 0.2, which the decoder verifies with Algorithm 1's lenient rule.
  SpeculativeDecoder exact(target, draft, {.verification = specdec::verification_rule::token});
  SpeculativeDecoder lenient(target, draft, {.lenience = 0.2});
  // accepted drafts per verified position: beta = 0.4 exactly; with l = 0.2 tokens 0-2 are
  // always accepted and token 3 with probability 0.1 / 0.14: 0.3 + 0.7 * 0.714 = 0.8
  const auto rate = [&](auto& decoder) {
    const auto stats = decoder.generate(prompt, 3000, 1).statistics;
    return static_cast<double>(stats.accepted_tokens) / static_cast<double>(stats.beta_positions);
  };
  CHECK(rate(exact) == Catch::Approx(0.4).margin(0.05));
  CHECK(rate(lenient) == Catch::Approx(0.8).margin(0.05));
}

TEST_CASE("SpeculativeDecoder: logits models and mixed scalar types", "[speculative_decoder]") {
  struct LogitsUnigram {
    std::vector<double> logits;
    std::size_t vocab_size() const { return logits.size(); }
    std::span<const double> next_token_logits(std::span<const token_id>) { return logits; }
  };
  LogitsUnigram target_logits{{std::log(0.5), std::log(0.3), std::log(0.2)}};
  LogitsUnigram draft_logits{{std::log(0.2), std::log(0.3), std::log(0.5)}};
  specdec::LogitsModel target(target_logits);
  specdec::LogitsModel draft(draft_logits);
  UnigramModel<double> target_probabilities{{0.5, 0.3, 0.2}};
  UnigramModel<float> draft_probabilities{{0.2F, 0.3F, 0.5F}};
  const DecoderOptions options{.sampling = {.temperature = 0.5}};
  const std::vector<token_id> small_prompt = {1, 2, 0};  // ids of this V = 3 vocabulary
  SpeculativeDecoder from_logits(target, draft, options);
  SpeculativeDecoder from_probabilities(target_probabilities, draft_probabilities, options);
  const auto a = from_logits.generate(small_prompt, 400, 8);
  const auto b = from_probabilities.generate(small_prompt, 400, 8);
  CHECK(a.statistics.mean_beta() == Catch::Approx(b.statistics.mean_beta()).epsilon(1e-6));
  std::size_t same = 0;
  for (std::size_t k = 0; k < 400; ++k) same += a.tokens[k] == b.tokens[k] ? 1U : 0U;
  CHECK(same >= 390);  // float draft rows round differently, rarely flipping a draw

  // greedy inside the adapters (one-hot rows), identity in the decoder: greedy decoding
  specdec::LogitsModel greedy_target(target_logits, {.temperature = 0.0});
  specdec::LogitsModel greedy_draft(draft_logits, {.temperature = 0.0});
  SpeculativeDecoder in_models(greedy_target, greedy_draft);
  const auto greedy = in_models.generate(small_prompt, 20, 3);
  CHECK(greedy.tokens == std::vector<token_id>(20, 0));
  CHECK(greedy.statistics.mean_beta() == 0.0);  // argmax q = 2 never matches
}

TEST_CASE("SpeculativeDecoder: model errors name model, step and position",
          "[speculative_decoder]") {
  using Fault = FaultyModel<MarkovModel<double>>::fault;
  auto inner_target = target_chain(8, 61);
  auto inner_draft = draft_chain(inner_target, 62);
  struct Case {
    Fault kind;
    specdec::errc code;
    const char* text;
  };
  const Case cases[] = {
      {Fault::nan, specdec::errc::invalid_probability, "NaN"},
      {Fault::infinity, specdec::errc::invalid_probability, "infinite"},
      {Fault::negative, specdec::errc::invalid_probability, "negative"},
      {Fault::zero, specdec::errc::zero_mass, "zero"},
      {Fault::unnormalized, specdec::errc::not_normalized, "sum"},
      {Fault::wrong_size, specdec::errc::invalid_size, "entries"},
      {Fault::throws, specdec::errc::model_failure, "out of device memory"},
  };
  for (const bool fault_in_target : {true, false}) {
    for (const Case& c : cases) {
      INFO((fault_in_target ? "target " : "draft ") << static_cast<int>(c.kind));
      FaultyModel<MarkovModel<double>> target{&inner_target};
      FaultyModel<MarkovModel<double>> draft{&inner_draft};
      auto& faulty = fault_in_target ? target : draft;
      faulty.kind = c.kind;
      faulty.fail_at = 23;
      SpeculativeDecoder decoder(target, draft, {.gamma_policy = specdec::FixedGamma(3)});
      // the same run without the fault, for comparison
      SpeculativeDecoder reference(inner_target, inner_draft,
                                   {.gamma_policy = specdec::FixedGamma(3)});
      const auto clean = reference.generate(prompt, 100, 4);
      try {
        (void)decoder.generate(prompt, 100, 4);
        FAIL("no error");
      } catch (const specdec::decoding_error& e) {
        CHECK(e.code() == c.code);
        const std::string message = e.what();
        CHECK_THAT(message, ContainsSubstring(fault_in_target ? "target row" : "draft row"));
        CHECK_THAT(message, ContainsSubstring("step " + std::to_string(e.step())));
        CHECK_THAT(message, ContainsSubstring("sequence position"));
        CHECK_THAT(message, ContainsSubstring(c.text));
        CHECK(e.step() > 0);
        // tokens before the failing step: a prefix of the clean run, also in generated()
        REQUIRE(!e.tokens().empty());
        CHECK(std::equal(e.tokens().begin(), e.tokens().end(), clean.tokens.begin()));
        CHECK(std::equal(e.tokens().begin(), e.tokens().end(), decoder.generated().begin(),
                         decoder.generated().end()));
        CHECK(decoder.statistics().steps == e.step());  // the failed step is not counted
        if (c.kind == Fault::throws) {
          try {
            std::rethrow_if_nested(e);
            FAIL("nothing nested");
          } catch (const std::runtime_error& nested) {
            CHECK(std::string(nested.what()) == "out of device memory");
          }
        }
      }
      // the decoder stays usable: the fault fired once
      const auto again = decoder.generate(prompt, 100, 4);
      CHECK(again.tokens == clean.tokens);
    }
  }
}

TEST_CASE("SpeculativeDecoder: errors from step() and from drafters", "[speculative_decoder]") {
  auto model = target_chain(8, 71);
  struct BadTokens {
    token_id token = 8;
    std::size_t count = 2;
    std::size_t propose(std::span<const token_id>, std::span<token_id> out) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = token;
      return count;
    }
  } bad;
  SpeculativeDecoder decoder(model, bad, {.gamma_policy = specdec::FixedGamma(3)});
  specdec::xoshiro256pp g(1);
  try {
    (void)decoder.step(prompt, g);
    FAIL("no error");
  } catch (const specdec::decoding_error& e) {
    CHECK(e.code() == specdec::errc::invalid_token);
    CHECK_THAT(e.what(), ContainsSubstring("draft row 0"));
    CHECK(e.tokens().empty());
  }
  bad.token = 1;
  bad.count = 4;  // more than the 3 asked for
  CHECK(error_code_of([&] { (void)decoder.step(prompt, g); }) == specdec::errc::invalid_size);
  bad.count = 2;
  CHECK(decoder.step(prompt, g).drafted == 2);

  // a batched target returning the wrong number of rows
  struct ShortBatch : MarkovModel<double> {
    std::vector<double> rows = std::vector<double>(8, 0.125);
    specdec::RowsView<const double> score_draft(std::span<const token_id>,
                                                std::span<const token_id>) {
      return {rows.data(), 1, 8};
    }
  } short_batch{model};
  auto draft = draft_chain(model);
  SpeculativeDecoder batched(short_batch, draft);
  try {
    (void)batched.step(prompt, g);
    FAIL("no error");
  } catch (const specdec::decoding_error& e) {
    CHECK(e.code() == specdec::errc::invalid_size);
    CHECK_THAT(e.what(), ContainsSubstring("score_draft returned 1 x 8, expected 5 x 8"));
  }
  // size checks stay on without validation
  using Fault = FaultyModel<MarkovModel<double>>::fault;
  FaultyModel<MarkovModel<double>> wrong{&model, Fault::wrong_size, 0};
  SpeculativeDecoder unchecked(wrong, draft, {.validate_rows = false});
  CHECK(error_code_of([&] { (void)unchecked.step(prompt, g); }) == specdec::errc::invalid_size);
}

TEST_CASE("SpeculativeDecoder: empty prompt and generate overloads", "[speculative_decoder]") {
  auto model = target_chain(8, 81);
  auto draft = draft_chain(model, 82);
  SpeculativeDecoder decoder(model, draft);
  const auto a = decoder.generate({}, 10, 5);
  specdec::default_engine g(5);
  const auto b = decoder.generate({}, 10, g);
  CHECK(a.tokens == b.tokens);
  CHECK(a.tokens.size() == 10);
  std::minstd_rand small_engine(3);  // any uniform_random_bit_generator works
  CHECK(decoder.generate(prompt, 10, small_engine).tokens.size() == 10);
}

TEST_CASE("SpeculativeDecoder: NaN or infinite logits never become token ids",
          "[speculative_decoder][sampling]") {
  // A logits engine that goes bad on its `fail_at`-th call: a NaN, +inf or -inf-only row.
  struct BadLogits {
    std::size_t fail_at = 3;
    double poison = std::numeric_limits<double>::quiet_NaN();
    bool all_poison = false;
    std::size_t calls = 0;
    std::vector<double> logits{0.5, -1.0, 2.0, 0.0};
    std::vector<double> out{};
    std::size_t vocab_size() const { return logits.size(); }
    std::span<const double> next_token_logits(std::span<const token_id> context) {
      out = logits;
      out[context.size() % out.size()] += 0.25;
      if (calls++ == fail_at) {
        if (all_poison) {
          std::fill(out.begin(), out.end(), poison);
        } else {
          out[1] = poison;
        }
      }
      return out;
    }
  };
  constexpr double inf = std::numeric_limits<double>::infinity();
  struct Case {
    double poison;
    bool all;
    specdec::errc code;
  };
  for (const Case c :
       {Case{std::numeric_limits<double>::quiet_NaN(), false, specdec::errc::invalid_probability},
        Case{inf, false, specdec::errc::invalid_probability},
        Case{-inf, true, specdec::errc::zero_mass}}) {
    for (const bool greedy : {false, true}) {
      BadLogits target_engine{.poison = c.poison, .all_poison = c.all};
      BadLogits draft_engine{.fail_at = static_cast<std::size_t>(-1)};
      draft_engine.logits = {0.0, 0.0, 1.0, 0.5};
      specdec::LogitsModel target(target_engine);
      specdec::LogitsModel draft(draft_engine);
      SpeculativeDecoder decoder(target, draft,
                                 {.sampling = {.temperature = greedy ? 0.0 : 0.8},
                                  .gamma_policy = specdec::FixedGamma(2)});
      INFO("poison " << c.poison << (c.all ? " (whole row)" : "") << ", greedy " << greedy);
      try {
        (void)decoder.generate(std::vector<token_id>{0}, 30, std::uint64_t{4});
        FAIL("no error");
      } catch (const specdec::decoding_error& e) {
        CHECK(e.code() == c.code);
        CHECK_THAT(e.what(), ContainsSubstring("target row"));
        for (const token_id token : e.tokens()) CHECK((token >= 0 && token < 4));
      }
    }
  }
}
