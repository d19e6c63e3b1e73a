// Tests for include/specdec/gamma_policy.hpp: the concept, FixedGamma and AnyGammaPolicy.
#include <cstddef>

#include <catch2/catch_test_macros.hpp>

#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"

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
