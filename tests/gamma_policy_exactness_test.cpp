// A gamma policy never changes the output distribution: the sequence-level chi-square of
// speculative_decoder_exactness_test.cpp (tests/support/sequence_law.hpp) passes with every
// policy of gamma_policy.hpp — FixedGamma, AdditiveGamma, ConfidenceStop and
// OptimalGammaController with a given c and with a c it measures. Each policy runs on Markov
// targets of order 1 and 2, V = 4, 16 and 64, at T = 1 and at T = 0.7 with top-k and top-p
// on both sides, with batched and per-prefix targets.
//
// The decoder is reused across samples, so an adaptive policy carries what it learned from
// one generated sequence to the next and picks different gammas along the run (checked: the
// drafted lengths vary). The measured c comes from DecoderOptions::clock, a simulated clock
// that the models advance by a fixed cost per call, so the run is deterministic (no wall
// time), and the measured c is checked against the simulated costs.
//
// Negative control: a loop that lets a step's own verdict decide whether to keep it (a step
// that accepted no draft is thrown away and redone, up to 4 times, as an adaptive loop
// retrying with a different gamma would) fails the same statistic with the same sample size.
// Policies only ever act on later steps.
#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>

#include "specdec/concepts.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "speculative_decoder_models.hpp"
#include "support/sequence_law.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::SamplingOptions;
using specdec::token_id;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::MarkovModel;
using specdec::testing::SequenceLaw;

// Simulated costs: a draft call costs draft_cost, a target call (batched or per prefix) 1.
constexpr double draft_cost = 0.05;

// Forwards every call to a model and advances the simulated time by `cost` first.
template <class Model>
struct TimedModel {
  Model* model;
  double* time;
  double cost;

  [[nodiscard]] std::size_t vocab_size() const { return model->vocab_size(); }
  decltype(auto) next_token_probabilities(std::span<const token_id> context) {
    *time += cost;
    return model->next_token_probabilities(context);
  }
  decltype(auto) score_draft(
      std::span<const token_id> context,
      std::span<const token_id> draft) requires specdec::HasDraftScoring<Model> {
    *time += cost;
    return model->score_draft(context, draft);
  }
};

// What a traced policy saw along a run.
struct Trace {
  std::array<std::size_t, 17> drafted_histogram{};  // steps by drafted length (16: 16 or more)
  double cost_ratio = -1.0;                         // the controller's c after the last step

  [[nodiscard]] std::size_t distinct_drafted_lengths() const {
    std::size_t distinct = 0;
    for (const std::size_t count : drafted_histogram) distinct += count > 0 ? 1 : 0;
    return distinct;
  }
};

// Forwards to a policy and records what it observes in a Trace shared by its copies (the
// decoder holds a copy of the policy it is given).
template <class Policy>
struct Traced {
  Policy policy;
  std::shared_ptr<Trace> trace;

  [[nodiscard]] std::size_t next_gamma() const { return policy.next_gamma(); }
  [[nodiscard]] bool continue_drafting(double top_probability, std::size_t drafted) const {
    return policy.continue_drafting(top_probability, drafted);
  }
  void observe(const specdec::StepFeedback& feedback) {
    auto& histogram = trace->drafted_histogram;
    ++histogram[std::min(feedback.drafted, histogram.size() - 1)];
    policy.observe(feedback);
    if constexpr (std::same_as<Policy, specdec::OptimalGammaController>) {
      trace->cost_ratio = policy.cost_ratio();
    }
  }
  [[nodiscard]] bool needs_timing() const { return policy.needs_timing(); }
};

struct PolicyCase {
  std::string name;
  specdec::AnyGammaPolicy policy;
  std::shared_ptr<Trace> trace;
  bool adaptive;  // the drafted length must vary along the run
  bool measured;  // the policy measures c: check it against the simulated costs
};

template <class Policy>
PolicyCase traced(std::string name, Policy policy, bool adaptive, bool measured = false) {
  auto trace = std::make_shared<Trace>();
  return {std::move(name), Traced<Policy>{std::move(policy), trace}, trace, adaptive, measured};
}

// The median over the draft's rows of the largest standardized q entry: a ConfidenceStop
// threshold that ends drafting at about half of the drafted positions.
double median_top_probability(const MarkovModel<double>& draft, const SamplingOptions& sampling) {
  specdec::Standardizer<double> standardizer(sampling);
  std::vector<double> row(draft.vocab_size());
  std::vector<double> tops;
  for (std::size_t s = 0; s < draft.states(); ++s) {
    tops.push_back(standardizer.apply(draft.row(s), std::span<double>(row)));
  }
  const auto middle = tops.begin() + static_cast<std::ptrdiff_t>(tops.size() / 2);
  std::nth_element(tops.begin(), middle, tops.end());
  return *middle;
}

// Fresh policies (and traces) for one configuration; `threshold` for ConfidenceStop.
std::vector<PolicyCase> policy_cases(double threshold) {
  std::vector<PolicyCase> cases;
  cases.push_back(traced("FixedGamma(3)", specdec::FixedGamma(3), false));
  cases.push_back(
      traced("AdditiveGamma", specdec::AdditiveGamma({.initial = 2, .max_gamma = 8}), true));
  cases.push_back(traced("ConfidenceStop(" + std::to_string(threshold) + ", 6)",
                         specdec::ConfidenceStop(threshold, 6), true));
  cases.push_back(traced("OptimalGammaController, given c = 0.05",
                         specdec::OptimalGammaController({.max_gamma = 8, .cost_ratio = 0.05}),
                         true));
  cases.push_back(traced(
      "OptimalGammaController, measured c",
      specdec::OptimalGammaController({.max_gamma = 8, .cost_ratio = 0.5, .measure_cost = true}),
      true, true));
  return cases;
}

struct Configuration {
  std::size_t vocab;
  std::size_t order;
  bool truncated;  // T = 0.7 with top-k and top-p, else T = 1
  bool batched;    // the target scores all prefixes in one call

  [[nodiscard]] SamplingOptions sampling() const {
    return truncated ? specdec::testing::truncated_sampling(vocab) : SamplingOptions{};
  }
  /// The law of the target's first sequence_length_for(vocab) tokens under sampling().
  [[nodiscard]] SequenceLaw law(const MarkovModel<double>& target) const {
    return SequenceLaw(target, sampling(), specdec::testing::sequence_length_for(vocab));
  }
};

// Order 1 and 2, both temperatures, V up to 64, batched and per-prefix targets.
constexpr std::array<Configuration, 4> configurations = {{
    {4, 1, false, false},
    {16, 2, true, true},
    {64, 1, true, true},
    {64, 2, false, false},
}};

std::string describe(const Configuration& configuration) {
  return "V = " + std::to_string(configuration.vocab) + ", order " +
         std::to_string(configuration.order) +
         (configuration.truncated ? ", T = 0.7 top-k top-p" : ", T = 1") +
         (configuration.batched ? ", batched target" : ", per-prefix target");
}

}  // namespace

TEST_CASE("Every gamma policy keeps the target's sequence law", "[gamma_policy][exactness]") {
  std::uint64_t seed = 700;
  for (const Configuration& configuration : configurations) {
    const auto target_model =
        specdec::testing::make_markov_target(configuration.vocab, configuration.order, ++seed);
    auto draft_model = specdec::testing::make_markov_draft(target_model, ++seed);
    BatchedMarkovModel<double> batched_model(target_model);
    auto per_prefix_model = target_model;
    const SamplingOptions sampling = configuration.sampling();
    const SequenceLaw law = configuration.law(target_model);
    const std::size_t samples = specdec::testing::samples_for(law);
    const double threshold = median_top_probability(draft_model, sampling);
    for (const PolicyCase& policy_case : policy_cases(threshold)) {
      double simulated_time = 0.0;
      TimedModel<MarkovModel<double>> draft{&draft_model, &simulated_time, draft_cost};
      const specdec::DecoderOptions options{.sampling = sampling,
                                            .gamma_policy = policy_case.policy,
                                            .clock = [&simulated_time] { return simulated_time; }};
      INFO(policy_case.name << ", " << describe(configuration));
      const auto check_law = [&](auto& target) {
        specdec::SpeculativeDecoder decoder(target, draft, options);
        const auto result = specdec::testing::sample_decoder(decoder, law, samples, ++seed);
        INFO(result.describe() << "; drafted " << decoder.statistics().drafted_tokens
                               << ", accepted " << decoder.statistics().accepted_tokens);
        CHECK(result.passed());
        CHECK(decoder.statistics().accepted_tokens > 0);
      };
      if (configuration.batched) {
        TimedModel<BatchedMarkovModel<double>> target{&batched_model, &simulated_time, 1.0};
        check_law(target);
      } else {
        TimedModel<MarkovModel<double>> target{&per_prefix_model, &simulated_time, 1.0};
        check_law(target);
      }
      const Trace& trace = *policy_case.trace;
      // The policy really steered the run: adaptive policies drafted several lengths.
      if (policy_case.adaptive) {
        CHECK(trace.distinct_drafted_lengths() >= 2);
      } else {
        CHECK(trace.distinct_drafted_lengths() == 1);
      }
      if (policy_case.measured) {
        // c = (draft time per drafted token) / (target time per step): 0.05 / 1 with one
        // batched call per step, at most 0.05 / 2 with at least two per-prefix calls.
        if (configuration.batched) {
          CHECK_THAT(trace.cost_ratio, Catch::Matchers::WithinRel(draft_cost, 1e-9));
        } else {
          CHECK(trace.cost_ratio > 0.0);
          CHECK(trace.cost_ratio <= draft_cost / 2.0 * (1.0 + 1e-9));
        }
      }
    }
  }
}

TEST_CASE("The statistic catches a loop that lets a step's own verdict decide whether to keep it",
          "[gamma_policy][exactness]") {
  // Every step is exact, but redoing a step that accepted no draft (as a loop retrying with
  // another gamma would) emits accepted drafts more often than the law allows. The same loop
  // without the redo passes: the loop itself is sound.
  std::uint64_t seed = 900;
  for (const Configuration& configuration : {configurations[1], configurations[3]}) {
    const auto target_model =
        specdec::testing::make_markov_target(configuration.vocab, configuration.order, ++seed);
    auto draft = specdec::testing::make_markov_draft(target_model, ++seed);
    auto target = target_model;
    const SamplingOptions sampling = configuration.sampling();
    const SequenceLaw law = configuration.law(target_model);
    const std::size_t samples = specdec::testing::samples_for(law);
    specdec::SpeculativeDecoder decoder(
        target, draft, {.sampling = sampling, .gamma_policy = specdec::FixedGamma(3)});
    const auto loop = [&](bool redo_rejected_steps) {
      return [&decoder, &law, redo_rejected_steps](specdec::xoshiro256pp& g) {
        const auto& prompt = specdec::testing::sequence_prompt;
        std::vector<token_id> sequence = prompt;
        const std::size_t end = prompt.size() + law.length();
        while (sequence.size() < end) {
          auto step = decoder.step(sequence, g, end - sequence.size());
          for (int redo = 0; redo_rejected_steps && step.accepted == 0 && redo < 4; ++redo) {
            step = decoder.step(sequence, g, end - sequence.size());
          }
          sequence.insert(sequence.end(), step.tokens.begin(), step.tokens.end());
        }
        return std::vector<token_id>(sequence.begin() + static_cast<std::ptrdiff_t>(prompt.size()),
                                     sequence.end());
      };
    };
    INFO(describe(configuration));
    const auto sound = specdec::testing::sample_sequences(loop(false), law, samples, ++seed);
    INFO("every step kept: " << sound.describe());
    CHECK(sound.passed());
    const auto broken = specdec::testing::sample_sequences(loop(true), law, samples, ++seed);
    INFO("rejected steps redone: " << broken.describe());
    CHECK_FALSE(broken.passed());
  }
}
