// Tests for include/specdec/gamma_policy.hpp: the concept, FixedGamma, AnyGammaPolicy, and
// the gamma trajectories of the adaptive policies on simulated acceptance streams.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/analysis.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"

namespace {

struct CountingPolicy {
  std::size_t gamma = 3;
  std::size_t observed = 0;
  std::size_t next_gamma() const { return gamma; }
  bool continue_drafting(double top_probability, std::size_t) const {
    return top_probability > 0.5;
  }
  void observe(const specdec::StepFeedback& feedback) {
    ++observed;
    gamma = feedback.accepted + 1;
  }
  bool needs_timing() const { return true; }
};

struct NoObserve {
  std::size_t next_gamma() const { return 1; }
  bool continue_drafting(double, std::size_t) const { return true; }
  bool needs_timing() const { return false; }
};

}  // namespace

TEST_CASE("GammaPolicy concept names each clause", "[gamma_policy]") {
  STATIC_REQUIRE(specdec::GammaPolicy<CountingPolicy>);
  STATIC_REQUIRE(specdec::GammaPolicy<specdec::FixedGamma>);
  STATIC_REQUIRE_FALSE(specdec::GammaPolicy<NoObserve>);
  STATIC_REQUIRE_FALSE(specdec::HasObserve<NoObserve>);
  STATIC_REQUIRE(specdec::HasNextGamma<NoObserve>);
}

TEST_CASE("FixedGamma always drafts gamma tokens and rejects gamma = 0", "[gamma_policy]") {
  specdec::FixedGamma fixed(5);
  fixed.observe({.drafted = 5, .accepted = 0});
  CHECK(fixed.next_gamma() == 5);
  CHECK(fixed.continue_drafting(0.01, 4));
  CHECK_FALSE(fixed.needs_timing());
  CHECK_THROWS_AS(specdec::FixedGamma(0), specdec::error);
}

TEST_CASE("AnyGammaPolicy forwards to the held policy and copies deeply", "[gamma_policy]") {
  specdec::AnyGammaPolicy any = CountingPolicy{};
  CHECK(any.next_gamma() == 3);
  CHECK(any.needs_timing());
  CHECK_FALSE(any.continue_drafting(0.2, 1));
  any.observe({.drafted = 3, .accepted = 2});
  CHECK(any.next_gamma() == 3);
  specdec::AnyGammaPolicy copy = any;
  copy.observe({.drafted = 3, .accepted = 0});
  CHECK(copy.next_gamma() == 1);
  CHECK(any.next_gamma() == 3);  // the original is untouched
  REQUIRE(copy.target<CountingPolicy>() != nullptr);
  CHECK(copy.target<CountingPolicy>()->observed == 2);
  CHECK(copy.target<specdec::FixedGamma>() == nullptr);
  specdec::AnyGammaPolicy defaulted;
  CHECK(defaulted.next_gamma() == 4);
}

namespace {

// One simulated step: each drafted token is accepted i.i.d. with probability alpha until
// the first rejection (Sec. 3.1); returns n, the number of accepted drafts.
std::size_t simulate_accepted(specdec::xoshiro256pp& rng, double alpha, std::size_t drafted) {
  std::size_t accepted = 0;
  while (accepted < drafted && specdec::uniform01<double>(rng) < alpha) ++accepted;
  return accepted;
}

}  // namespace

TEST_CASE("needs_top_probability: policies that ignore it say so, others default to true",
          "[gamma_policy]") {
  CHECK_FALSE(specdec::FixedGamma(3).needs_top_probability());
  CHECK_FALSE(specdec::AdditiveGamma{}.needs_top_probability());
  CHECK_FALSE(specdec::OptimalGammaController{}.needs_top_probability());
  CHECK(specdec::ConfidenceStop(0.4, 8).needs_top_probability());
  // A policy without the member reads it (the safe default), through AnyGammaPolicy too.
  CHECK(specdec::needs_top_probability(CountingPolicy{}));
  CHECK(specdec::AnyGammaPolicy(CountingPolicy{}).needs_top_probability());
  CHECK_FALSE(specdec::AnyGammaPolicy(specdec::FixedGamma(2)).needs_top_probability());
  CHECK(specdec::AnyGammaPolicy(specdec::ConfidenceStop(0.4, 8)).needs_top_probability());
}

TEST_CASE("AdditiveGamma: +2 after a fully accepted step, -1 otherwise, bounded",
          "[gamma_policy]") {
  STATIC_REQUIRE(specdec::GammaPolicy<specdec::AdditiveGamma>);
  specdec::AdditiveGamma additive({.initial = 4, .min_gamma = 2, .max_gamma = 9});
  CHECK_FALSE(additive.needs_timing());
  CHECK(additive.continue_drafting(0.0, 100));
  std::vector<std::size_t> trajectory = {additive.next_gamma()};
  // accepted drafts of each step, drafting next_gamma() tokens each time
  const std::vector<int> outcome = {1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1};  // 1 = all accepted
  for (const int all : outcome) {
    const std::size_t gamma = additive.next_gamma();
    additive.observe({.drafted = gamma, .accepted = all == 1 ? gamma : gamma / 2});
    trajectory.push_back(additive.next_gamma());
  }
  CHECK(trajectory == std::vector<std::size_t>{4, 6, 8, 9, 8, 9, 8, 7, 6, 5, 4, 3, 5});
  additive.observe({.drafted = 0, .accepted = 0});  // no proposal: no information
  CHECK(additive.next_gamma() == 5);
  additive.observe({.drafted = 3, .accepted = 3});  // a short draft, all accepted, counts
  CHECK(additive.next_gamma() == 7);
  CHECK_THROWS_AS(specdec::AdditiveGamma({.initial = 1, .min_gamma = 2}), specdec::error);
  CHECK_THROWS_AS(specdec::AdditiveGamma({.min_gamma = 0}), specdec::error);
  CHECK_THROWS_AS(specdec::AdditiveGamma({.initial = 4, .min_gamma = 5, .max_gamma = 3}),
                  specdec::error);
}

TEST_CASE("AdditiveGamma settles where full acceptance is as likely as 1 in 3", "[gamma_policy]") {
  // Drift: +2 alpha^gamma - 1 (1 - alpha^gamma) = 0 at alpha^gamma = 1/3. With alpha = 0.9
  // that is gamma = ln 3 / -ln 0.9 = 10.4; the trajectory stays in its neighbourhood.
  specdec::xoshiro256pp rng(11);
  specdec::AdditiveGamma additive({.initial = 1, .min_gamma = 1, .max_gamma = 32});
  double mean = 0.0;
  constexpr int steps = 4000;
  for (int step = 0; step < steps; ++step) {
    const std::size_t gamma = additive.next_gamma();
    CHECK((gamma >= 1 && gamma <= 32));
    additive.observe({.drafted = gamma, .accepted = simulate_accepted(rng, 0.9, gamma)});
    if (step >= steps / 2) mean += static_cast<double>(gamma) / (steps / 2);
  }
  CHECK(mean > 8.0);
  CHECK(mean < 13.0);
}

TEST_CASE("ConfidenceStop stops below the threshold and composes with another policy",
          "[gamma_policy]") {
  STATIC_REQUIRE(specdec::GammaPolicy<specdec::ConfidenceStop<>>);
  STATIC_REQUIRE(specdec::GammaPolicy<specdec::ConfidenceStop<specdec::AdditiveGamma>>);
  specdec::ConfidenceStop stop(0.4, 12);
  STATIC_REQUIRE(std::is_same_v<decltype(stop), specdec::ConfidenceStop<specdec::FixedGamma>>);
  CHECK(stop.next_gamma() == 12);
  CHECK(stop.continue_drafting(0.4, 3));
  CHECK_FALSE(stop.continue_drafting(0.39, 3));
  CHECK(stop.continue_drafting(1.0, 11));  // proposal-only drafters are never stopped
  CHECK_FALSE(stop.needs_timing());

  // Drafting loop as the decoder runs it: draft, then ask whether to go on.
  const std::vector<double> top_probabilities = {0.9, 0.8, 0.7, 0.35, 0.95, 0.9};
  std::size_t drafted = 0;
  while (drafted < stop.next_gamma() && drafted < top_probabilities.size()) {
    ++drafted;
    if (!stop.continue_drafting(top_probabilities[drafted - 1], drafted)) break;
  }
  CHECK(drafted == 4);  // the unsure fourth token is drafted, nothing after it

  specdec::ConfidenceStop adaptive(0.5, specdec::AdditiveGamma({.initial = 2}));
  adaptive.observe({.drafted = 2, .accepted = 2});
  CHECK(adaptive.next_gamma() == 4);
  CHECK(adaptive.inner().next_gamma() == 4);
  CHECK(adaptive.threshold() == 0.5);
  specdec::AnyGammaPolicy any = adaptive;
  any.observe({.drafted = 4, .accepted = 1});
  CHECK(any.next_gamma() == 3);
  CHECK_FALSE(any.continue_drafting(0.2, 1));
  CHECK_THROWS_AS(specdec::ConfidenceStop(1.5, 4), specdec::error);
  CHECK_THROWS_AS(specdec::ConfidenceStop(-0.1, specdec::FixedGamma(2)), specdec::error);
}

namespace {

struct ControllerRun {
  std::size_t steps_at_optimum = 0;
  std::size_t steps_near_optimum = 0;  // within 1% of the optimal improvement
  std::size_t steps_checked = 0;
  double worst_improvement_ratio = 1.0;  // Thm 3.8 improvement of the chosen gamma / optimum
};

// Runs the controller on an i.i.d. acceptance stream with fixed alpha and c; from step
// `settle` on, compares each chosen gamma with the Theorem 3.8 optimum for the true alpha, c.
ControllerRun run_controller(specdec::OptimalGammaController& controller, double alpha, double c,
                             std::size_t steps, std::size_t settle, std::uint64_t seed,
                             bool report_timings) {
  specdec::xoshiro256pp rng(seed);
  const auto best = specdec::optimal_gamma(alpha, c, controller.options().max_gamma);
  ControllerRun run;
  for (std::size_t step = 0; step < steps; ++step) {
    const std::size_t gamma = controller.next_gamma();
    if (step >= settle) {
      ++run.steps_checked;
      if (gamma == best.gamma) ++run.steps_at_optimum;
      const double ratio = specdec::walltime_improvement(alpha, gamma, c) / best.improvement;
      if (ratio >= 0.99) ++run.steps_near_optimum;
      run.worst_improvement_ratio = std::min(run.worst_improvement_ratio, ratio);
    }
    specdec::StepFeedback feedback{.drafted = gamma,
                                   .accepted = simulate_accepted(rng, alpha, gamma)};
    if (report_timings) {
      // A target call of about 20 ms, draft calls of about c * 20 ms, +-20% jitter each.
      const auto jitter = [&] { return 0.8 + 0.4 * specdec::uniform01<double>(rng); };
      feedback.target_seconds = 0.02 * jitter();
      for (std::size_t i = 0; i < gamma; ++i) feedback.draft_seconds += c * 0.02 * jitter();
    }
    controller.observe(feedback);
  }
  return run;
}

}  // namespace

TEST_CASE("OptimalGammaController converges to the Theorem 3.8 optimum for fixed alpha and c",
          "[gamma_policy]") {
  STATIC_REQUIRE(specdec::GammaPolicy<specdec::OptimalGammaController>);
  struct Case {
    double alpha;
    double c;
  };
  const std::vector<Case> cases = {{0.8, 0.05}, {0.6, 0.1},  {0.9, 0.02}, {0.5, 0.25},
                                   {0.7, 0.0},  {0.3, 0.05}, {0.95, 0.1}};
  std::uint64_t seed = 100;
  for (const auto& [alpha, c] : cases) {
    for (const bool measured : {false, true}) {
      specdec::OptimalGammaController controller(
          {.max_gamma = 16, .cost_ratio = measured ? 0.5 : c, .measure_cost = measured});
      CHECK(controller.needs_timing() == measured);
      const ControllerRun run = run_controller(controller, alpha, c, 600, 300, ++seed, measured);
      const auto best = specdec::optimal_gamma(alpha, c, 16);
      INFO("alpha " << alpha << ", c " << c << (measured ? ", c measured" : ", c given")
                    << ": optimum gamma " << best.gamma << ", final gamma "
                    << controller.next_gamma() << ", alpha estimate " << controller.alpha()
                    << ", c estimate " << controller.cost_ratio());
      // Near the optimum Theorem 3.8 is flat (alpha = 0.95, c = 0.1: gamma 13..18 are all
      // within 1%), so the exact optimum is not always picked; what matters is the speed.
      CHECK(run.worst_improvement_ratio > 0.95);
      CHECK(10 * run.steps_near_optimum >= 9 * run.steps_checked);
      CHECK(4 * run.steps_at_optimum >= run.steps_checked);
      CHECK(controller.alpha() == Catch::Approx(alpha).margin(0.06));
      if (measured) CHECK(controller.cost_ratio() == Catch::Approx(c).margin(0.2 * c + 1e-12));
    }
  }
}

TEST_CASE("OptimalGammaController follows a change of alpha", "[gamma_policy]") {
  specdec::OptimalGammaController controller({.max_gamma = 16, .cost_ratio = 0.05});
  const std::size_t start = controller.next_gamma();
  CHECK(start == specdec::optimal_gamma(0.5, 0.05, 16).gamma);  // the prior decides at first
  const ControllerRun before = run_controller(controller, 0.9, 0.05, 600, 300, 5, false);
  CHECK(10 * before.steps_near_optimum >= 9 * before.steps_checked);
  const std::size_t high = controller.next_gamma();
  CHECK(high >= 10);  // the optimum is 13
  const ControllerRun after = run_controller(controller, 0.4, 0.05, 600, 300, 6, false);
  CHECK(controller.next_gamma() < high);
  CHECK(controller.next_gamma() <= 3);  // the optimum is 2
  CHECK(10 * after.steps_near_optimum >= 9 * after.steps_checked);
}

TEST_CASE("OptimalGammaController estimates alpha by accepted / (accepted + rejections)",
          "[gamma_policy]") {
  specdec::OptimalGammaController controller(
      {.max_gamma = 4, .prior_alpha = 0.5, .prior_trials = 2.0, .forgetting = 1.0});
  CHECK(controller.alpha() == 0.5);
  controller.observe({.drafted = 4, .accepted = 4});  // 4 successes, no failure
  controller.observe({.drafted = 4, .accepted = 1});  // 1 success, 1 failure
  controller.observe({.drafted = 0, .accepted = 0});  // nothing tried
  CHECK(controller.alpha() == Catch::Approx((5.0 + 1.0) / (6.0 + 2.0)));
  CHECK(controller.next_gamma() == specdec::optimal_gamma(0.75, 0.0, 4).gamma);
  CHECK(controller.expected_improvement() ==
        Catch::Approx(specdec::walltime_improvement(0.75, controller.next_gamma(), 0.0)));
  // Untimed steps leave the measured c at its starting value.
  specdec::OptimalGammaController measured({.cost_ratio = 0.3, .measure_cost = true});
  measured.observe({.drafted = 3, .accepted = 1});
  CHECK(measured.cost_ratio() == 0.3);
  measured.observe({.drafted = 2, .accepted = 1, .draft_seconds = 0.002, .target_seconds = 0.1});
  CHECK(measured.cost_ratio() == Catch::Approx(0.01));
  specdec::AnyGammaPolicy any = measured;
  CHECK(any.needs_timing());
  CHECK(any.target<specdec::OptimalGammaController>() != nullptr);
}

TEST_CASE("OptimalGammaController validates its options", "[gamma_policy]") {
  using Options = specdec::OptimalGammaOptions;
  CHECK_THROWS_AS(specdec::OptimalGammaController(Options{.max_gamma = 0}), specdec::error);
  CHECK_THROWS_AS(specdec::OptimalGammaController(Options{.prior_alpha = 1.5}), specdec::error);
  CHECK_THROWS_AS(specdec::OptimalGammaController(Options{.prior_trials = -1.0}), specdec::error);
  CHECK_THROWS_AS(specdec::OptimalGammaController(Options{.forgetting = 0.0}), specdec::error);
  CHECK_THROWS_AS(specdec::OptimalGammaController(Options{.cost_ratio = -0.1}), specdec::error);
}
