// Tests for include/specdec/batch_gamma.hpp: the planner's draft lengths maximise expected
// tokens per modelled cost over every assignment within the caps (brute force over all of
// them, per sequence and shared, for several cost shapes); with one sequence and a flat
// cost it is Theorem 3.8's optimal_gamma; the measured cost curve (buckets, interpolation,
// envelope, optimistic extrapolation, forgetting); acceptance evidence shrinks to the pool
// and decays. The BatchDecoder with a planner: every sequence still follows its target law
// (chi-square, with the broken variant that shifts rows), greedy sequences equal plain
// greedy decoding, a memory-bound target makes it draft and a compute-bound one makes it
// decode plainly, and a simulated clock makes its choices reproducible.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/analysis.hpp"
#include "specdec/batch_decoder.hpp"
#include "specdec/batch_gamma.hpp"
#include "specdec/greedy_verification.hpp"
#include "speculative_decoder_models.hpp"
#include "support/batch_markov.hpp"
#include "support/sequence_law.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::BatchGammaOptions;
using specdec::BatchGammaPlanner;
using specdec::SamplingOptions;
using specdec::token_id;
using specdec::testing::MarkovModel;

using Cost = std::function<double(std::size_t)>;

struct Objective {
  double tokens = 0.0;
  double cost = 0.0;
};

// E and C of an assignment, straight from their definitions.
Objective objective(const std::vector<double>& alphas, const std::vector<std::size_t>& gammas,
                    const Cost& target_cost, double draft_cost) {
  Objective o;
  std::size_t drafts = 0;
  for (std::size_t b = 0; b < alphas.size(); ++b) {
    for (std::size_t k = 0; k <= gammas[b]; ++k) o.tokens += std::pow(alphas[b], k);
    drafts += gammas[b];
  }
  o.cost = draft_cost * static_cast<double>(drafts) + target_cost(alphas.size() + drafts);
  return o;
}

// The best E / C over every assignment with gammas[b] <= min(caps[b], max_gamma) (shared:
// one gamma for all, capped per sequence).
double best_rate(const std::vector<double>& alphas, const std::vector<std::size_t>& caps,
                 std::size_t max_gamma, bool shared, const Cost& target_cost, double draft_cost) {
  double best = 0.0;
  if (shared) {
    for (std::size_t g = 0; g <= max_gamma; ++g) {
      std::vector<std::size_t> gammas(alphas.size());
      for (std::size_t b = 0; b < alphas.size(); ++b) gammas[b] = std::min(g, caps[b]);
      const Objective o = objective(alphas, gammas, target_cost, draft_cost);
      best = std::max(best, o.tokens / o.cost);
    }
    return best;
  }
  std::vector<std::size_t> gammas(alphas.size(), 0);
  while (true) {
    const Objective o = objective(alphas, gammas, target_cost, draft_cost);
    best = std::max(best, o.tokens / o.cost);
    std::size_t b = 0;
    while (b < gammas.size() && gammas[b] == std::min(caps[b], max_gamma)) gammas[b++] = 0;
    if (b == gammas.size()) return best;
    ++gammas[b];
  }
}

const std::vector<std::pair<const char*, Cost>>& cost_shapes() {
  static const std::vector<std::pair<const char*, Cost>> shapes{
      {"flat", [](std::size_t) { return 1.0; }},
      {"affine", [](std::size_t p) { return 1.0 + 0.05 * static_cast<double>(p); }},
      {"roofline", [](std::size_t p) { return std::max(1.0, static_cast<double>(p) / 8.0); }},
      {"concave", [](std::size_t p) { return std::sqrt(static_cast<double>(p)); }},
      {"linear", [](std::size_t p) { return static_cast<double>(p); }},
  };
  return shapes;
}

}  // namespace

TEST_CASE("BatchGammaPlanner: its plan maximises expected tokens per cost over every assignment",
          "[batch_gamma][exactness]") {
  std::mt19937_64 rng(2026);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::size_t plans = 0;
  std::size_t drafting = 0;  // plans that draft at all, and plans that stay plain
  std::size_t plain = 0;
  for (const bool shared : {false, true}) {
    for (const auto& [shape, target_cost] : cost_shapes()) {
      for (const double draft_cost : {0.0, 0.02, 0.3}) {
        for (int trial = 0; trial < 12; ++trial) {
          const std::size_t sequences = 1 + static_cast<std::size_t>(trial % 3);
          std::vector<double> alphas(sequences);
          std::vector<std::size_t> caps(sequences);
          for (std::size_t b = 0; b < sequences; ++b) {
            alphas[b] = trial == 0 ? 1.0 : trial == 1 ? 0.0 : uniform(rng);
            caps[b] = static_cast<std::size_t>(uniform(rng) * 6.0);  // 0..5, max_gamma is 4
          }
          BatchGammaPlanner planner(BatchGammaOptions{.max_gamma = 4,
                                                      .shared = shared,
                                                      .target_cost = target_cost,
                                                      .draft_cost = draft_cost});
          std::vector<std::size_t> gammas(sequences, 99);
          const auto plan = planner.plan(alphas, caps, gammas);
          const Objective o = objective(alphas, gammas, target_cost, draft_cost);
          const double best = best_rate(alphas, caps, 4, shared, target_cost, draft_cost);
          INFO((shared ? "shared, " : "per sequence, ")
               << shape << " cost, d = " << draft_cost << ", trial " << trial);
          for (std::size_t b = 0; b < sequences; ++b) {
            CHECK(gammas[b] <= std::min<std::size_t>(caps[b], 4));
            if (shared && b > 0 && caps[b] >= 4 && caps[0] >= 4) CHECK(gammas[b] == gammas[0]);
          }
          CHECK(o.tokens / o.cost == Catch::Approx(best).epsilon(1e-12));
          CHECK(plan.expected_tokens == Catch::Approx(o.tokens).epsilon(1e-12));
          CHECK(plan.expected_cost == Catch::Approx(o.cost).epsilon(1e-12));
          std::size_t drafts = 0;
          for (const std::size_t g : gammas) drafts += g;
          CHECK(plan.drafts == drafts);
          CHECK(plan.positions == sequences + drafts);
          const Objective none =
              objective(alphas, std::vector<std::size_t>(sequences, 0), target_cost, draft_cost);
          CHECK(plan.improvement ==
                Catch::Approx((o.tokens / o.cost) / (none.tokens / none.cost)).epsilon(1e-12));
          ++plans;
          (drafts > 0 ? drafting : plain) += 1;
        }
      }
    }
  }
  CHECK(plans == 360);
  CHECK(drafting > 60);  // the cases are not all one way
  CHECK(plain > 60);
}

TEST_CASE("BatchGammaPlanner: one sequence at a flat cost is Theorem 3.8's optimal gamma",
          "[batch_gamma]") {
  for (const double alpha : {0.0, 0.3, 0.6, 0.8, 0.9, 0.97, 1.0}) {
    for (const double c : {0.0, 0.01, 0.05, 0.2, 0.5}) {
      BatchGammaPlanner planner(
          {.max_gamma = 16, .target_cost = [](std::size_t) { return 1.0; }, .draft_cost = c});
      std::vector<std::size_t> gamma(1);
      const std::vector<double> alphas{alpha};
      const std::vector<std::size_t> caps{100};
      const auto plan = planner.plan(alphas, caps, gamma);
      const auto theorem = specdec::optimal_gamma(alpha, c, 16);
      INFO("alpha = " << alpha << ", c = " << c);
      if (theorem.improvement > 1.0 + 1e-12) {
        CHECK(gamma[0] == theorem.gamma);
        CHECK(plan.improvement == Catch::Approx(theorem.improvement).epsilon(1e-12));
      } else {
        CHECK(gamma[0] == 0);  // drafting does not pay: plain decoding
        CHECK(plan.improvement == 1.0);
      }
    }
  }
}

TEST_CASE("BatchGammaPlanner: larger batches draft less on a roofline target", "[batch_gamma]") {
  // T(P) = max(1, P / 16): free positions until 16, then compute-bound. alpha = 0.8,
  // d = 0.01. Sequences draft the most at B = 1 and nothing once B alone fills the roofline.
  const Cost roofline = [](std::size_t p) { return std::max(1.0, static_cast<double>(p) / 16.0); };
  std::vector<std::size_t> drafts_per_sequence;
  for (const std::size_t batch : {1UL, 2UL, 4UL, 8UL, 16UL, 32UL}) {
    BatchGammaPlanner planner({.max_gamma = 8, .target_cost = roofline, .draft_cost = 0.01});
    const std::vector<double> alphas(batch, 0.8);
    const std::vector<std::size_t> caps(batch, 100);
    std::vector<std::size_t> gammas(batch);
    const auto plan = planner.plan(alphas, caps, gammas);
    drafts_per_sequence.push_back(plan.drafts / batch);
    INFO("B = " << batch << ": " << plan.drafts << " drafts, improvement " << plan.improvement);
    CHECK(plan.improvement >= 1.0);
  }
  CHECK(std::is_sorted(drafts_per_sequence.rbegin(), drafts_per_sequence.rend()));
  CHECK(drafts_per_sequence.front() >= 6);
  CHECK(drafts_per_sequence.back() == 0);
}

TEST_CASE("BatchGammaPlanner: higher alpha gets more drafts within one batch", "[batch_gamma]") {
  BatchGammaPlanner planner(
      {.max_gamma = 8,
       .target_cost = [](std::size_t p) { return 1.0 + 0.1 * static_cast<double>(p); },
       .draft_cost = 0.0});
  const std::vector<double> alphas{0.95, 0.2, 0.7, 0.5};
  const std::vector<std::size_t> caps(4, 100);
  std::vector<std::size_t> gammas(4);
  (void)planner.plan(alphas, caps, gammas);
  CHECK(gammas[0] > gammas[2]);
  CHECK(gammas[2] > gammas[3]);
  CHECK(gammas[3] >= gammas[1]);
  CHECK(gammas[0] > 0);
}

TEST_CASE("BatchGammaPlanner: the measured cost curve", "[batch_gamma]") {
  BatchGammaPlanner planner({.forgetting = 0.5});
  CHECK(planner.target_cost(7) == 1.0);  // nothing measured: flat
  CHECK(planner.draft_cost() == 0.0);
  const auto affine = [](std::size_t p) { return 1.0 + 0.1 * static_cast<double>(p); };
  for (const std::size_t p : {4UL, 16UL, 64UL}) planner.observe_step(0, 0.0, p, affine(p));
  CHECK(planner.target_cost(16) == Catch::Approx(2.6));
  CHECK(planner.target_cost(40) == Catch::Approx(5.0));    // interpolated (exact for affine)
  CHECK(planner.target_cost(2) == Catch::Approx(0.7));     // below: T(4) * 2 / 4
  CHECK(planner.target_cost(1000) == Catch::Approx(7.4));  // above: T(64)
  // A cheaper measurement at a larger P does not make the curve decrease.
  planner.observe_step(0, 0.0, 32, 1.0);
  CHECK(planner.target_cost(32) == Catch::Approx(2.6));
  // Within a step (no plan between) observations of a bucket average evenly ...
  planner.observe_step(0, 0.0, 16, 5.6);
  CHECK(planner.target_cost(16) == Catch::Approx(4.1));
  // ... and every plan (batch step) discounts the evidence by `forgetting`.
  std::vector<std::size_t> none;
  (void)planner.plan({}, none, none);
  planner.observe_step(0, 0.0, 16, 1.1);
  CHECK(planner.target_cost(16) == Catch::Approx((0.5 * (2.6 + 5.6) + 1.1) / (0.5 * 2 + 1)));
  // Draft cost: seconds per drafted token, discounted alike.
  planner.observe_step(10, 0.5, 20, 3.0);
  CHECK(planner.draft_cost() == Catch::Approx(0.05));
  (void)planner.plan({}, none, none);
  planner.observe_step(10, 1.5, 20, 3.0);
  CHECK(planner.draft_cost() == Catch::Approx((0.5 * 0.5 + 1.5) / (0.5 * 10 + 10)));
  // Bad times are ignored.
  const double before = planner.target_cost(64);
  planner.observe_step(10, std::nan(""), 64, -1.0);
  CHECK(planner.target_cost(64) == before);
  // A given cost is used as given and never measured.
  BatchGammaPlanner given(
      {.target_cost = [](std::size_t p) { return 2.0 * static_cast<double>(p); },
       .draft_cost = 0.3});
  given.observe_step(10, 100.0, 4, 100.0);
  CHECK(given.target_cost(4) == 8.0);
  CHECK(given.draft_cost() == 0.3);
}

TEST_CASE("BatchGammaPlanner: a slow measurement not revisited is interpolated over again",
          "[batch_gamma]") {
  // P = 8 measured once at 10 (a noisy step); P = 4 and 16 keep being measured at their
  // affine costs. While the slow point is fresh the curve holds it; after ~114 steps
  // (forgetting 0.98: weight below 0.1) it is interpolated over, the range's ends stay.
  BatchGammaPlanner planner({.forgetting = 0.98});
  std::vector<std::size_t> none;
  planner.observe_step(0, 0.0, 8, 10.0);
  planner.observe_step(0, 0.0, 64, 7.4);  // the range's end, never visited again
  std::size_t steps = 0;
  for (; steps < 300 && planner.target_cost(8) > 9.0; ++steps) {
    (void)planner.plan({}, none, none);
    planner.observe_step(0, 0.0, 4, 1.4);
    planner.observe_step(0, 0.0, 16, 2.6);
  }
  INFO("stale after " << steps << " steps");
  CHECK(steps >= 100);
  CHECK(steps <= 120);
  CHECK(planner.target_cost(8) == Catch::Approx(1.4 + 1.2 * 4.0 / 12.0));
  CHECK(planner.target_cost(64) == Catch::Approx(7.4));  // the end stays, stale or not
}

TEST_CASE("BatchGammaPlanner: unmeasured batch sizes are tried, then judged by their cost",
          "[batch_gamma]") {
  // A compute-bound target (T = P) with alpha 0.6: nothing measured, the planner is
  // optimistic and drafts max_gamma; once the costs of what it tried are known it decodes
  // plainly, the best choice for this target.
  BatchGammaPlanner planner({.max_gamma = 4});
  const std::vector<double> alphas(4, 0.6);
  const std::vector<std::size_t> caps(4, 100);
  std::vector<std::size_t> gammas(4);
  std::vector<std::size_t> drafts;
  for (int step = 0; step < 6; ++step) {
    const auto plan = planner.plan(alphas, caps, gammas);
    drafts.push_back(plan.drafts);
    planner.observe_step(plan.drafts, 0.0, plan.positions, static_cast<double>(plan.positions));
  }
  CHECK(drafts.front() == 16);
  CHECK(drafts.back() == 0);
}

TEST_CASE("SequenceAcceptance: shrinks to the pool and decays without drafts", "[batch_gamma]") {
  BatchGammaPlanner planner({.prior_alpha = 0.5, .prior_trials = 4.0, .forgetting = 0.9});
  specdec::SequenceAcceptance good;
  specdec::SequenceAcceptance bad;
  specdec::SequenceAcceptance fresh;
  CHECK(planner.alpha(fresh) == 0.5);
  for (int i = 0; i < 50; ++i) {
    planner.observe_acceptance(good, 4, 4);
    planner.observe_acceptance(bad, 4, 0);
  }
  CHECK(good.rejections() == 0.0);
  const double pooled = planner.pooled_alpha();  // 4 accepted per 5 trials
  CHECK(pooled == Catch::Approx(0.8).margin(0.07));
  CHECK(planner.alpha(fresh) == pooled);  // a new sequence starts at the pool
  CHECK(planner.alpha(good) > 0.95);
  const double low = planner.alpha(bad);
  CHECK(low < 0.3);
  for (int i = 0; i < 60; ++i) {
    planner.observe_acceptance(good, 4, 4);
    planner.observe_acceptance(bad, 0, 0);  // gamma 0 steps: no trials, the counts decay
  }
  // Drifted back to the pool: it will be tried again.
  CHECK(planner.alpha(bad) == Catch::Approx(planner.pooled_alpha()).margin(0.01));
  CHECK(planner.alpha(bad) > 0.85);
}

namespace {

/// A batch-scoring Markov target whose calls advance a simulated clock by T(rows), and a
/// draft whose calls advance it by d.
class CostedDraft : public MarkovModel<double> {
 public:
  CostedDraft(MarkovModel<double> model, double* clock, double cost)
      : MarkovModel<double>(std::move(model)), clock_(clock), cost_(cost) {}
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    *clock_ += cost_;
    return MarkovModel<double>::next_token_probabilities(context);
  }

 private:
  double* clock_;
  double cost_;
};

struct PlannedRun {
  std::map<std::uint64_t, std::vector<token_id>> tokens;
  std::size_t drafted = 0;
  std::size_t steps = 0;        // sequence steps
  std::size_t mixed_plans = 0;  // batch steps that gave sequences different draft lengths
};

/// Decodes `count` sequences of `length` tokens with a measuring planner and a simulated
/// clock, `wave` joining each step.
PlannedRun decode_planned(const MarkovModel<double>& target_chain,
                          const MarkovModel<double>& draft_chain, const Cost& cost,
                          double draft_cost, std::size_t count, std::size_t length,
                          const SamplingOptions& sampling, std::size_t wave, bool shift = false) {
  double clock = 0.0;
  specdec::testing::BatchMarkov target(target_chain);
  target.on_call = [&](std::size_t rows) { clock += cost(rows); };
  target.shift = shift;
  CostedDraft draft(draft_chain, &clock, draft_cost);
  specdec::BatchDecoder decoder(target, draft,
                                {.threads = 2,
                                 .parallel_threshold = 0,
                                 .batch_gamma = BatchGammaOptions{.max_gamma = 6},
                                 .clock = [&clock] { return clock; }});
  PlannedRun run;
  std::uint64_t next = 0;
  while (next < count || decoder.active() > 0) {
    for (std::size_t k = 0; k < wave && next < count; ++k) {
      specdec::SequenceRequest r;
      r.id = next++;
      r.prompt = specdec::testing::sequence_prompt;
      r.max_new_tokens = length;
      r.seed = 77;
      r.sampling = sampling;
      decoder.add(std::move(r));
    }
    decoder.step();
    const auto gammas = decoder.last_gammas();
    if (std::minmax_element(gammas.begin(), gammas.end()) !=
        std::pair{gammas.begin(), gammas.begin()}) {
      const auto [low, high] = std::minmax_element(gammas.begin(), gammas.end());
      if (*low != *high) ++run.mixed_plans;
    }
    for (auto& done : decoder.take_finished()) {
      REQUIRE(done.end != specdec::sequence_end::failed);
      run.drafted += done.drafted;
      run.steps += done.steps;
      run.tokens[done.id] = std::move(done.tokens);
    }
  }
  return run;
}

}  // namespace

TEST_CASE("BatchDecoder with a batch gamma planner: every sequence follows its target law",
          "[batch_gamma][statistical]") {
  // V = 4, order-2 target, order-1 draft: the law of 4 generated tokens, chi-square at false
  // failure 1e-9, over 7000 sequences joining 300 per step, on a target whose
  // measured cost makes the planner give some sequences drafts and others none. The broken
  // variant (rows one prefix off) is caught by the same test.
  constexpr std::size_t vocab = 4;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 11);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 12);
  const Cost affine = [](std::size_t p) { return 1.0 + static_cast<double>(p) / 2000.0; };
  for (const SamplingOptions& sampling :
       {SamplingOptions{}, specdec::testing::truncated_sampling(vocab)}) {
    const specdec::testing::SequenceLaw law(target_chain, sampling, 4);
    const std::size_t samples = std::max<std::size_t>(specdec::testing::samples_for(law), 7000);
    for (const bool shift : {false, true}) {
      const auto run = decode_planned(target_chain, draft_chain, affine, 1e-4, samples,
                                      law.length(), sampling, 300, shift);
      std::vector<std::uint64_t> counts(law.cells(), 0);
      for (const auto& [id, sequence] : run.tokens) {
        REQUIRE(sequence.size() == law.length());
        ++counts[law.cell_of(sequence)];
      }
      const auto test = specdec::testing::chi_square_test(counts, law.expected());
      INFO((shift ? "rows one prefix off" : "planned")
           << ", T = " << sampling.temperature << ": " << test.describe() << ", drafted "
           << run.drafted << " in " << run.steps << " sequence steps");
      CHECK(test.passed() == !shift);
      CHECK(run.drafted > run.steps / 20);  // the planner drafted (T = 1: ~0.8 per step)
      CHECK(run.mixed_plans > 0);
    }
  }
}

TEST_CASE("BatchDecoder with a batch gamma planner: greedy sequences emit plain greedy decoding",
          "[batch_gamma][exactness]") {
  constexpr std::size_t vocab = 16;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 31);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 32);
  const Cost affine = [](std::size_t p) { return 1.0 + 0.2 * static_cast<double>(p); };
  const auto run = decode_planned(target_chain, draft_chain, affine, 0.01, 12, 25,
                                  SamplingOptions{.temperature = 0.0}, 4);
  CHECK(run.drafted > 0);
  for (const auto& [id, sequence] : run.tokens) {
    std::vector<token_id> context = specdec::testing::sequence_prompt;
    std::vector<token_id> plain;
    for (std::size_t j = 0; j < 25; ++j) {
      plain.push_back(specdec::argmax(target_chain.row(target_chain.state(context))));
      context.push_back(plain.back());
    }
    INFO("sequence " << id);
    CHECK(sequence == plain);
  }
}

TEST_CASE(
    "BatchDecoder with a batch gamma planner: drafts on a memory-bound target, not on a "
    "compute-bound one, reproducibly",
    "[batch_gamma]") {
  constexpr std::size_t vocab = 16;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 41);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 42);
  const SamplingOptions sampling{.temperature = 0.9};
  const Cost flat = [](std::size_t) { return 1.0; };
  const Cost linear = [](std::size_t p) { return static_cast<double>(p); };
  const auto memory = decode_planned(target_chain, draft_chain, flat, 0.001, 16, 40, sampling, 16);
  const auto compute =
      decode_planned(target_chain, draft_chain, linear, 0.001, 16, 40, sampling, 16);
  INFO("memory-bound: " << memory.drafted << " drafts in " << memory.steps
                        << " sequence steps; compute-bound: " << compute.drafted << " in "
                        << compute.steps);
  CHECK(memory.drafted > 2 * memory.steps);
  // The first two, optimistic steps only: nothing is measured before the second, since the
  // first is every sequence's first step (a KV-cache engine's prefill).
  CHECK(compute.drafted <= 2 * 16 * 6);
  CHECK(compute.steps >= 16 * 38);  // about one token per step
  const auto again = decode_planned(target_chain, draft_chain, flat, 0.001, 16, 40, sampling, 16);
  CHECK(again.tokens == memory.tokens);
  CHECK(again.drafted == memory.drafted);
}
