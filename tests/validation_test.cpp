// Tests for include/specdec/validation.hpp: every boundary check throws specdec::error with
// the documented code and a message naming the model, step, row and token.
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/validation.hpp"

namespace {

using specdec::errc;
using specdec::RowLocation;

/// Runs `action`, requires a specdec::error with `code` whose message contains `text`.
template <class Action>
void require_error(Action&& action, errc code, const std::string& text) {
  try {
    action();
  } catch (const specdec::error& e) {
    INFO("what(): " << e.what());
    CHECK(e.code() == code);
    CHECK(std::string(e.what()).find(text) != std::string::npos);
    return;
  }
  FAIL("no specdec::error thrown; expected " << specdec::to_string(code) << ": " << text);
}

}  // namespace

TEMPLATE_TEST_CASE("validate_probability_row accepts valid rows", "[validation]", float, double) {
  const std::vector<TestType> row = {TestType(0.25), TestType(0.5), TestType(0), TestType(0.25)};
  CHECK_NOTHROW(specdec::validate_probability_row<TestType>(row, 4, {"target", 7, 2}));
  // A sum off 1 by less than the tolerance passes; zeros are fine.
  const TestType nudge = TestType(specdec::default_sum_tolerance<TestType> / 2);
  const std::vector<TestType> close = {TestType(0.5) + nudge, TestType(0.5)};
  CHECK_NOTHROW(specdec::validate_probability_row<TestType>(close, 2, {}));
  const std::vector<TestType> one_hot = {TestType(0), TestType(1)};
  CHECK_NOTHROW(specdec::validate_probability_row<TestType>(one_hot, 2, {}));
}

TEMPLATE_TEST_CASE("validate_probability_row names each problem and where it is", "[validation]",
                   float, double) {
  using T = TestType;
  const RowLocation where{"target", 7, 2};
  auto check = [&](const std::vector<T>& row, std::size_t vocab_size) {
    return
        [row, vocab_size, where] { specdec::validate_probability_row<T>(row, vocab_size, where); };
  };
  require_error(check({T(0.5), T(0.5), T(0)}, 4), errc::invalid_size,
                "target row 2 (step 7): has 3 entries, expected the vocabulary size 4");
  require_error(check({}, 0), errc::invalid_size, "vocabulary size is 0");
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T inf = std::numeric_limits<T>::infinity();
  require_error(check({T(0.5), nan, T(0.5)}, 3), errc::invalid_probability,
                "target row 2 (step 7): entry for token 1 is NaN");
  require_error(check({T(0.5), T(0.5), inf}, 3), errc::invalid_probability,
                "entry for token 2 is infinite");
  require_error(check({-inf, T(0.5), T(0.5)}, 3), errc::invalid_probability,
                "entry for token 0 is infinite");
  require_error(check({T(0.75), T(0.5), T(-0.25)}, 3), errc::invalid_probability,
                "entry for token 2 is negative (-0.25)");
  require_error(check({T(0), T(0), T(0)}, 3), errc::zero_mass,
                "target row 2 (step 7): all entries are zero");
  require_error(check({T(0.5), T(0.5), T(0.1)}, 3), errc::not_normalized,
                "target row 2 (step 7): entries sum to 1.1");
  require_error(check({T(2), T(3)}, 2), errc::not_normalized, "entries sum to 5");
  // A custom tolerance.
  const std::vector<T> off = {T(0.5), T(0.52)};
  CHECK_NOTHROW(specdec::validate_probability_row<T>(off, 2, where, 0.05));
  require_error([&] { specdec::validate_probability_row<T>(off, 2, where, 0.01); },
                errc::not_normalized, "tolerance 0.01");
}

TEST_CASE("Locations leave out what is unknown", "[validation]") {
  using specdec::detail::describe_location;
  CHECK(describe_location({"draft", 3, 1}, "row") == "draft row 1 (step 3)");
  CHECK(describe_location({"draft", RowLocation::npos, 1}, "row") == "draft row 1");
  CHECK(describe_location({"", RowLocation::npos, 4}, "row") == "row 4");
  CHECK(describe_location({"target", 9, RowLocation::npos}, "rows") == "target rows (step 9)");
  CHECK(describe_location({}, "row") == "row");
}

TEST_CASE("Default sum tolerances", "[validation]") {
  STATIC_REQUIRE(specdec::default_sum_tolerance<float> == 1e-3);
  STATIC_REQUIRE(specdec::default_sum_tolerance<double> == 1e-6);
}

TEMPLATE_TEST_CASE("validate_probability_rows checks the row count and every row", "[validation]",
                   float, double) {
  using T = TestType;
  std::vector<T> storage = {T(0.5), T(0.5), T(1), T(0), T(0.25), T(0.75)};
  const specdec::RowsView<const T> rows(storage.data(), 3, 2);
  CHECK_NOTHROW(specdec::validate_probability_rows(rows, 3, 2, {"draft", 5}));
  require_error(
      [&] {
        specdec::validate_probability_rows(rows, 4, 2, {"draft", 5});
      },
      errc::invalid_size, "draft rows (step 5): got 3 rows, expected 4");
  require_error(
      [&] {
        specdec::validate_probability_rows(rows, 3, 3, {"draft", 5});
      },
      errc::invalid_size, "draft row 0 (step 5): has 2 entries");
  storage[5] = T(-1);
  require_error(
      [&] {
        specdec::validate_probability_rows(rows, 3, 2, {"draft", 5});
      },
      errc::invalid_probability, "draft row 2 (step 5): entry for token 1 is negative");
}

TEST_CASE("validate_token and validate_tokens reject ids outside the vocabulary 0..V-1",
          "[validation]") {
  CHECK_NOTHROW(specdec::validate_token(0, 5, {}));
  CHECK_NOTHROW(specdec::validate_token(4, 5, {}));
  require_error(
      [] {
        specdec::validate_token(5, 5, {"draft", 2, 3});
      },
      errc::invalid_token, "draft token at position 3 (step 2): id 5 is outside [0, 5)");
  require_error([] { specdec::validate_token(-1, 5, {}); }, errc::invalid_token,
                "id -1 is outside [0, 5)");
  const std::vector<specdec::token_id> tokens = {1, 2, 7, 0};
  require_error(
      [&] {
        specdec::validate_tokens(tokens, 5, {"draft", 4});
      },
      errc::invalid_token, "draft token at position 2 (step 4): id 7");
  CHECK_NOTHROW(specdec::validate_tokens(tokens, 8, {}));
}

TEST_CASE("validate_lenience accepts only 0 < l <= 1", "[validation]") {
  CHECK_NOTHROW(specdec::validate_lenience(1.0));
  CHECK_NOTHROW(specdec::validate_lenience(0.1));
  for (const double bad : {0.0, -0.5, 1.5, std::nan("")}) {
    require_error([bad] { specdec::validate_lenience(bad); }, errc::domain, "lenience");
  }
}
