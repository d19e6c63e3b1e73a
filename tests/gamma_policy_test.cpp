// Tests for include/specdec/gamma_policy.hpp: the concept, FixedGamma, AnyGammaPolicy, and
// the gamma trajectories of the adaptive policies on simulated acceptance streams.
#include <cstddef>
#include <type_traits>
#include <vector>

#include <catch2/catch_test_macros.hpp>

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
