// Bad-input catalogue, exact core (docs/errors.md, rows C*): validation.hpp,
// speculative_sampling.hpp, greedy_verification.hpp, residual_distribution.hpp. One test
// case per catalogue row; each names the row.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <span>
#include <vector>

#include "errors_catalogue.hpp"
#include "specdec/block_verification.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/validation.hpp"

namespace {

using specdec::errc;
using specdec::RowsView;
using specdec::token_id;
using specdec::testing::check_error;

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
constexpr double infinity = std::numeric_limits<double>::infinity();

// A row of T from double literals (no narrowing warnings for float).
template <class T>
std::vector<T> make(std::initializer_list<double> values) {
  std::vector<T> row;
  for (const double value : values) row.push_back(static_cast<T>(value));
  return row;
}

// gamma = 2 drafts over V = 4, valid rows: q_1, q_2 and p_1, p_2, p_3.
template <class T>
struct Step {
  std::vector<token_id> drafts{1, 2};
  std::vector<T> draft = make<T>({0.25, 0.25, 0.25, 0.25, 0.1, 0.2, 0.3, 0.4});
  std::vector<T> target = make<T>({0.4, 0.3, 0.2, 0.1, 0.1, 0.1, 0.4, 0.4, 0.5, 0.5, 0.0, 0.0});
  std::size_t draft_rows = 2;
  std::size_t target_rows = 3;
  std::size_t vocab = 4;
  specdec::SpeculativeSamplingOptions options{};
  specdec::xoshiro256pp g{1};

  specdec::VerificationResult speculative() {
    return specdec::verify_speculative_checked(
        std::span<const token_id>(drafts),
        RowsView<const T>(draft.data(), draft_rows,
                          draft.size() / std::max<std::size_t>(draft_rows, 1)),
        RowsView<const T>(target.data(), target_rows, vocab), g, options, 3);
  }
  specdec::VerificationResult proposals() {
    return specdec::verify_speculative_proposals_checked(
        std::span<const token_id>(drafts), RowsView<const T>(target.data(), target_rows, vocab), g,
        options, 3);
  }
  specdec::VerificationResult block() {
    return specdec::verify_block_checked(
        std::span<const token_id>(drafts),
        RowsView<const T>(draft.data(), draft_rows,
                          draft.size() / std::max<std::size_t>(draft_rows, 1)),
        RowsView<const T>(target.data(), target_rows, vocab), g, 3);
  }
  specdec::VerificationResult block_proposals() {
    return specdec::verify_block_proposals_checked(
        std::span<const token_id>(drafts), RowsView<const T>(target.data(), target_rows, vocab), g,
        3);
  }
  specdec::VerificationResult greedy() {
    return specdec::verify_greedy_checked(std::span<const token_id>(drafts),
                                          RowsView<const T>(target.data(), target_rows, vocab), 3);
  }
};

}  // namespace

// --- validation.hpp ------------------------------------------------------------------------

TEMPLATE_TEST_CASE("C1 validate_probability_row: vocabulary size 0", "[errors][validation]", float,
                   double) {
  const std::vector<TestType> row;
  check_error(
      "C1",
      [&] {
        specdec::validate_probability_row(std::span<const TestType>(row), 0, {"target", 7, 2});
      },
      errc::invalid_size, "target row 2 (step 7): the vocabulary size is 0");
}

TEMPLATE_TEST_CASE("C2 validate_probability_row: row of the wrong length", "[errors][validation]",
                   float, double) {
  const std::vector<TestType> row = make<TestType>({0.5, 0.5, 0.0});
  check_error(
      "C2",
      [&] {
        specdec::validate_probability_row(std::span<const TestType>(row), 4, {"draft", 1, 0});
      },
      errc::invalid_size, "draft row 0 (step 1): has 3 entries, expected the vocabulary size 4");
}

TEMPLATE_TEST_CASE("C3 validate_probability_row: NaN / infinite or negative entry",
                   "[errors][validation]", float, double) {
  const auto check = [](TestType bad, const char* fragment) {
    std::vector<TestType> row = make<TestType>({0.5, 0.25, 0.25, 0.0});
    row[2] = bad;
    check_error(
        "C3",
        [&] {
          specdec::validate_probability_row(std::span<const TestType>(row), 4, {"target", 7, 2});
        },
        errc::invalid_probability, fragment);
  };
  check(static_cast<TestType>(not_a_number), "target row 2 (step 7): entry for token 2 is NaN");
  check(static_cast<TestType>(infinity), "entry for token 2 is infinite");
  check(static_cast<TestType>(-infinity), "entry for token 2 is infinite");
  check(static_cast<TestType>(-0.25), "entry for token 2 is negative (-0.25)");
  check(-std::numeric_limits<TestType>::denorm_min(), "entry for token 2 is negative");
}

TEMPLATE_TEST_CASE("C4 validate_probability_row: all-zero row", "[errors][validation]", float,
                   double) {
  const std::vector<TestType> row(5, TestType(0));
  check_error(
      "C4",
      [&] {
        specdec::validate_probability_row(std::span<const TestType>(row), 5, {"draft", 0, 1});
      },
      errc::zero_mass, "draft row 1 (step 0): all entries are zero");
}

TEMPLATE_TEST_CASE("C5 validate_probability_row: row that does not sum to 1",
                   "[errors][validation]", float, double) {
  const std::vector<TestType> low = make<TestType>({0.5, 0.25, 0.2});   // 0.95
  const std::vector<TestType> high = make<TestType>({0.5, 0.5, 0.25});  // 1.25
  const std::vector<TestType> logits =
      make<TestType>({2.0, -1.0, 0.5});  // scores, not probabilities
  check_error(
      "C5", [&] { specdec::validate_probability_row(std::span<const TestType>(low), 3, {}); },
      errc::not_normalized, "row: entries sum to 0.95");
  check_error(
      "C5", [&] { specdec::validate_probability_row(std::span<const TestType>(high), 3, {}); },
      errc::not_normalized, "off 1 by more than the tolerance");
  check_error(
      "C5", [&] { specdec::validate_probability_row(std::span<const TestType>(logits), 3, {}); },
      errc::invalid_probability, "entry for token 1 is negative");
  // An explicit tolerance of 0 accepts only sums of exactly 1 (in double).
  const std::vector<TestType> near = make<TestType>({0.5, 0.5000001, 0.0});
  check_error(
      "C5", [&] { specdec::validate_probability_row(std::span<const TestType>(near), 3, {}, 0.0); },
      errc::not_normalized, "tolerance 0");
}

TEMPLATE_TEST_CASE("C6 validate_probability_rows: wrong number of rows", "[errors][validation]",
                   float, double) {
  const std::vector<TestType> rows = make<TestType>({0.5, 0.5, 1.0, 0.0});
  check_error(
      "C6",
      [&] {
        specdec::validate_probability_rows(RowsView<const TestType>(rows.data(), 2, 2), 3, 2,
                                           {"target", 4});
      },
      errc::invalid_size, "target rows (step 4): got 2 rows, expected 3");
}

TEST_CASE("C7 validate_token: token id outside 0..V-1", "[errors][validation]") {
  check_error(
      "C7",
      [] {
        specdec::validate_token(4, 4, {"draft", 2, 1});
      },
      errc::invalid_token, "draft token at position 1 (step 2): id 4 is outside [0, 4)");
  check_error(
      "C7", [] { specdec::validate_token(-1, 4, {}); }, errc::invalid_token,
      "token at position: id -1 is outside [0, 4)");
  const std::vector<token_id> tokens{0, 3, 7};
  check_error(
      "C7", [&] { specdec::validate_tokens(std::span<const token_id>(tokens), 4, {"draft"}); },
      errc::invalid_token, "draft token at position 2: id 7");
}

TEST_CASE("C8 validate_lenience: lenience outside 0 < x <= 1", "[errors][validation]") {
  for (const double lenience : {0.0, -0.5, 1.5, not_a_number, infinity}) {
    check_error(
        "C8", [&] { specdec::validate_lenience(lenience); }, errc::domain, "is outside (0, 1]");
  }
}

// --- speculative_sampling.hpp --------------------------------------------------------------

TEMPLATE_TEST_CASE("C9 verify_speculative_checked: lenience outside 0 < x <= 1",
                   "[errors][speculative_sampling]", float, double) {
  for (const double lenience : {0.0, 2.0, not_a_number}) {
    Step<TestType> step;
    step.options.lenience = lenience;
    check_error(
        "C9", [&] { (void)step.speculative(); }, errc::domain, "lenience");
    check_error(
        "C9", [&] { (void)step.proposals(); }, errc::domain, "lenience");
  }
}

TEMPLATE_TEST_CASE("C10 verify_speculative_checked: draft and target rows of different widths",
                   "[errors][speculative_sampling]", float, double) {
  Step<TestType> step;
  step.draft.resize(10, TestType(0));  // two rows of 5 entries
  check_error(
      "C10", [&] { (void)step.speculative(); }, errc::vocab_mismatch,
      "draft rows have 5 entries but target rows have 4");
  check_error(
      "C10", [&] { (void)step.block(); }, errc::vocab_mismatch,
      "draft rows have 5 entries but target rows have 4");
}

TEMPLATE_TEST_CASE("C11 checked verifiers: wrong number of target rows",
                   "[errors][speculative_sampling][greedy_verification]", float, double) {
  Step<TestType> step;
  step.target_rows = 2;  // gamma + 1 = 3 expected
  check_error(
      "C11", [&] { (void)step.speculative(); }, errc::invalid_size,
      "target rows (step 3): got 2 rows, expected 3");
  check_error(
      "C11", [&] { (void)step.block(); }, errc::invalid_size,
      "target rows (step 3): got 2 rows, expected 3");
  check_error(
      "C11", [&] { (void)step.proposals(); }, errc::invalid_size, "got 2 rows, expected 3");
  check_error(
      "C11", [&] { (void)step.block_proposals(); }, errc::invalid_size, "got 2 rows, expected 3");
  check_error(
      "C11", [&] { (void)step.greedy(); }, errc::invalid_size, "got 2 rows, expected 3");
}

TEMPLATE_TEST_CASE("C12 verify_speculative_checked: wrong number of draft rows",
                   "[errors][speculative_sampling]", float, double) {
  Step<TestType> step;
  step.draft_rows = 1;
  step.draft.resize(4);
  check_error(
      "C12", [&] { (void)step.speculative(); }, errc::invalid_size,
      "draft rows (step 3): got 1 rows, expected 2");
  check_error(
      "C12", [&] { (void)step.block(); }, errc::invalid_size,
      "draft rows (step 3): got 1 rows, expected 2");
}

TEMPLATE_TEST_CASE("C13 checked verifiers: V = 0 (empty rows)",
                   "[errors][speculative_sampling][greedy_verification]", float, double) {
  Step<TestType> step;
  step.drafts.clear();
  step.draft.clear();
  step.draft_rows = 0;
  step.target.clear();
  step.target_rows = 1;
  step.vocab = 0;
  check_error(
      "C13", [&] { (void)step.speculative(); }, errc::invalid_size,
      "target row 0 (step 3): the vocabulary size is 0");
  check_error(
      "C13", [&] { (void)step.block(); }, errc::invalid_size,
      "target row 0 (step 3): the vocabulary size is 0");
  check_error(
      "C13", [&] { (void)step.proposals(); }, errc::invalid_size, "vocabulary size is 0");
  check_error(
      "C13", [&] { (void)step.block_proposals(); }, errc::invalid_size, "vocabulary size is 0");
  check_error(
      "C13", [&] { (void)step.greedy(); }, errc::invalid_size, "vocabulary size is 0");
}

TEMPLATE_TEST_CASE("C14 checked verifiers: NaN / infinite or negative probability in a row",
                   "[errors][speculative_sampling][greedy_verification]", float, double) {
  Step<TestType> step;
  step.target[4 + 2] = static_cast<TestType>(not_a_number);
  check_error(
      "C14", [&] { (void)step.speculative(); }, errc::invalid_probability,
      "target row 1 (step 3): entry for token 2 is NaN");
  check_error(
      "C14", [&] { (void)step.block(); }, errc::invalid_probability,
      "target row 1 (step 3): entry for token 2 is NaN");
  check_error(
      "C14", [&] { (void)step.proposals(); }, errc::invalid_probability,
      "target row 1 (step 3): entry for token 2 is NaN");
  check_error(
      "C14", [&] { (void)step.block_proposals(); }, errc::invalid_probability,
      "target row 1 (step 3): entry for token 2 is NaN");
  check_error(
      "C14", [&] { (void)step.greedy(); }, errc::invalid_probability, "is NaN");
  Step<TestType> negative;
  negative.draft[3] = TestType(-0.25);
  check_error(
      "C14", [&] { (void)negative.speculative(); }, errc::invalid_probability,
      "draft row 0 (step 3): entry for token 3 is negative");
  check_error(
      "C14", [&] { (void)negative.block(); }, errc::invalid_probability,
      "draft row 0 (step 3): entry for token 3 is negative");
  Step<TestType> infinite;
  infinite.target[0] = static_cast<TestType>(infinity);
  check_error(
      "C14", [&] { (void)infinite.greedy(); }, errc::invalid_probability,
      "target row 0 (step 3): entry for token 0 is infinite");
}

TEMPLATE_TEST_CASE("C15 checked verifiers: all-zero row",
                   "[errors][speculative_sampling][greedy_verification]", float, double) {
  Step<TestType> step;
  std::fill(step.target.begin() + 8, step.target.end(), TestType(0));
  check_error(
      "C15", [&] { (void)step.speculative(); }, errc::zero_mass,
      "target row 2 (step 3): all entries are zero");
  check_error(
      "C15", [&] { (void)step.block(); }, errc::zero_mass,
      "target row 2 (step 3): all entries are zero");
  check_error(
      "C15", [&] { (void)step.proposals(); }, errc::zero_mass, "all entries are zero");
  check_error(
      "C15", [&] { (void)step.block_proposals(); }, errc::zero_mass, "all entries are zero");
  check_error(
      "C15", [&] { (void)step.greedy(); }, errc::zero_mass, "all entries are zero");
  Step<TestType> draft;
  std::fill(draft.draft.begin(), draft.draft.begin() + 4, TestType(0));
  check_error(
      "C15", [&] { (void)draft.speculative(); }, errc::zero_mass,
      "draft row 0 (step 3): all entries are zero");
  check_error(
      "C15", [&] { (void)draft.block(); }, errc::zero_mass,
      "draft row 0 (step 3): all entries are zero");
}

TEMPLATE_TEST_CASE("C16 checked verifiers: row that does not sum to 1",
                   "[errors][speculative_sampling][greedy_verification]", float, double) {
  Step<TestType> step;
  step.draft[4] = TestType(0.2);  // draft row 1 sums to 1.1
  check_error(
      "C16", [&] { (void)step.speculative(); }, errc::not_normalized,
      "draft row 1 (step 3): entries sum to 1.1");
  check_error(
      "C16", [&] { (void)step.block(); }, errc::not_normalized,
      "draft row 1 (step 3): entries sum to 1.1");
  Step<TestType> logits;  // greedy: unnormalised scores are rejected by the checked twin ...
  for (auto& x : logits.target) x *= TestType(3);
  check_error(
      "C16", [&] { (void)logits.greedy(); }, errc::not_normalized, "entries sum to");
  // ... but the unchecked verify_greedy documents that scores work.
  const auto result = specdec::verify_greedy(std::span<const token_id>(logits.drafts),
                                             RowsView<const TestType>(logits.target.data(), 3, 4));
  CHECK(result.accepted == 0);
  CHECK(result.token == 0);
}

TEMPLATE_TEST_CASE("C17 checked verifiers: draft token id outside 0..V-1",
                   "[errors][speculative_sampling][greedy_verification]", float, double) {
  for (const token_id bad : {4, -1, std::numeric_limits<token_id>::max()}) {
    Step<TestType> step;
    step.drafts[1] = bad;
    check_error(
        "C17", [&] { (void)step.speculative(); }, errc::invalid_token,
        "draft token at position 1 (step 3): id");
    check_error(
        "C17", [&] { (void)step.block(); }, errc::invalid_token,
        "draft token at position 1 (step 3): id");
    check_error(
        "C17", [&] { (void)step.proposals(); }, errc::invalid_token, "is outside [0, 4)");
    check_error(
        "C17", [&] { (void)step.block_proposals(); }, errc::invalid_token, "is outside [0, 4)");
    check_error(
        "C17", [&] { (void)step.greedy(); }, errc::invalid_token, "is outside [0, 4)");
  }
}

TEMPLATE_TEST_CASE("C18 checked verifiers: gamma = 0 is valid (bonus token from p_1)",
                   "[errors][speculative_sampling][greedy_verification]", float, double) {
  Step<TestType> step;
  step.drafts.clear();
  step.draft.clear();
  step.draft_rows = 0;
  step.target.resize(4);
  step.target_rows = 1;
  const auto speculative = step.speculative();
  CHECK(speculative.accepted == 0);
  CHECK(speculative.source == specdec::token_source::bonus);
  CHECK(step.target[static_cast<std::size_t>(speculative.token)] > TestType(0));
  CHECK(step.proposals().source == specdec::token_source::bonus);
  CHECK(step.block().source == specdec::token_source::bonus);
  CHECK(step.block_proposals().source == specdec::token_source::bonus);
  CHECK(step.greedy().token == 0);
}

TEMPLATE_TEST_CASE("C19 zero residual mass: correction drawn from p / residual_fallback set",
                   "[errors][speculative_sampling][residual_distribution]", float, double) {
  // x_1 = 3 has p(3) = q(3) = 0 (a valid row pair that did not produce the token): p = 0
  // rejects it, and the residual max(0, p - q) is zero everywhere because p == q.
  const std::vector<TestType> row = make<TestType>({0.5, 0.25, 0.25, 0.0});
  std::vector<TestType> target = row;
  target.insert(target.end(), row.begin(), row.end());
  const std::vector<token_id> drafts{3};
  specdec::xoshiro256pp g(5);
  const auto result = specdec::verify_speculative_checked(
      std::span<const token_id>(drafts), RowsView<const TestType>(row.data(), 1, 4),
      RowsView<const TestType>(target.data(), 2, 4), g);
  CHECK(result.accepted == 0);
  CHECK(result.source == specdec::token_source::correction);
  CHECK(result.residual_fallback);
  CHECK(row[static_cast<std::size_t>(result.token)] > TestType(0));
  // Block verification: rho_1 = 0 (p(3) = 0), so n = 0, and the residual max(0, p_1 - q_1)
  // has no mass either.
  const auto block = specdec::verify_block_checked(
      std::span<const token_id>(drafts), RowsView<const TestType>(row.data(), 1, 4),
      RowsView<const TestType>(target.data(), 2, 4), g);
  CHECK(block.accepted == 0);
  CHECK(block.residual_fallback);
  CHECK(row[static_cast<std::size_t>(block.token)] > TestType(0));
  // The samplers report the same through ResidualDraw::fallback and the distribution object.
  const auto draw =
      specdec::sample_residual(std::span<const TestType>(row), std::span<const TestType>(row), g);
  CHECK(draw.fallback);
  const std::span<const TestType> row_view(row);
  specdec::residual_distribution<TestType> residual(row_view, row_view);
  CHECK(residual.falls_back());
  CHECK(residual.mass() == 0.0);
  (void)residual(g);
  CHECK(residual.fallback_count() == 1);
}
