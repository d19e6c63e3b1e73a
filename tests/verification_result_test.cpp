// Tests for include/specdec/verification_result.hpp: token provenance names and the
// result's defaults.
#include <type_traits>

#include <catch2/catch_test_macros.hpp>

#include "specdec/verification_result.hpp"

TEST_CASE("token_source names", "[verification_result]") {
  STATIC_REQUIRE(specdec::to_string(specdec::token_source::draft) == "draft");
  STATIC_REQUIRE(specdec::to_string(specdec::token_source::correction) == "correction");
  STATIC_REQUIRE(specdec::to_string(specdec::token_source::bonus) == "bonus");
  STATIC_REQUIRE(sizeof(specdec::token_source) == 1);
}

TEST_CASE("VerificationResult defaults and comparison", "[verification_result]") {
  STATIC_REQUIRE(std::is_aggregate_v<specdec::VerificationResult>);
  constexpr specdec::VerificationResult result;
  STATIC_REQUIRE(result.accepted == 0);
  STATIC_REQUIRE(result.token == 0);
  STATIC_REQUIRE(result.source == specdec::token_source::bonus);
  STATIC_REQUIRE(!result.residual_fallback);
  const specdec::VerificationResult correction{2, 17, specdec::token_source::correction, false};
  CHECK(correction == specdec::VerificationResult{2, 17, specdec::token_source::correction});
  CHECK_FALSE(correction == result);
}
