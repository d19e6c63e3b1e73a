// Bad-input catalogue, batch verification (docs/errors.md, rows B*):
// BatchVerifier::verify_checked, BatchVerifier::verify, BatchVerification::write_padded,
// BatchGammaPlanner (B13; rows B10-B12 are in batch_decoder_test.cpp).
// One test case per catalogue row; each names the row.
#include <catch2/catch_test_macros.hpp>

#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "errors_catalogue.hpp"
#include "specdec/batch_gamma.hpp"
#include "specdec/batch_verification.hpp"

namespace {

using specdec::BatchVerification;
using specdec::BatchVerifier;
using specdec::errc;
using specdec::RaggedBatch;
using specdec::RowsView;
using specdec::SequenceOptions;
using specdec::token_id;
using specdec::testing::check_error;

// Three sequences over V = 4: 2 drafts, 0 drafts, 1 draft (ids 7, 8, 9, step 3).
struct ThreeSequences {
  std::vector<token_id> drafts{1, 2, 3};
  std::vector<std::size_t> offsets{0, 2, 2, 3};
  std::vector<float> target = std::vector<float>(6 * 4, 0.25F);  // N + B = 6 rows
  std::vector<float> draft = std::vector<float>(3 * 4, 0.25F);   // N = 3 rows
  std::size_t target_rows = 6;
  std::size_t draft_rows = 3;
  std::size_t draft_width = 4;
  std::vector<SequenceOptions> options = {
      {.stream = {1, 7, 3}}, {.stream = {1, 8, 3}}, {.stream = {1, 9, 3}}};
  BatchVerifier<float> verifier{2};
  BatchVerification out;

  RaggedBatch<float> batch() const {
    return {drafts, offsets, RowsView<const float>(target.data(), target_rows, 4),
            RowsView<const float>(draft.data(), draft_rows, draft_width)};
  }
  void verify_checked() { verifier.verify_checked(batch(), options, out); }
};

}  // namespace

TEST_CASE("B1 verify_checked: draft_offsets empty or not matching the options", "[errors][batch]") {
  ThreeSequences s;
  s.offsets.clear();
  check_error(
      "B1", [&] { s.verify_checked(); }, errc::invalid_size, "batch: draft_offsets is empty");
  ThreeSequences t;
  t.options.pop_back();
  check_error(
      "B1", [&] { t.verify_checked(); }, errc::invalid_size,
      "batch: 2 sequence options for 3 sequences (4 draft offsets)");
}

TEST_CASE("B2 verify_checked: draft_offsets not from 0 to N, or decreasing", "[errors][batch]") {
  ThreeSequences s;
  s.offsets = {1, 2, 2, 3};
  check_error(
      "B2", [&] { s.verify_checked(); }, errc::invalid_size,
      "batch: draft_offsets starts at 1, not 0");
  ThreeSequences t;
  t.offsets = {0, 2, 1, 3};
  check_error(
      "B2", [&] { t.verify_checked(); }, errc::invalid_size,
      "batch: draft_offsets decreases at batch position 1 (2 then 1)");
  ThreeSequences u;
  u.offsets = {0, 2, 2, 2};
  check_error(
      "B2", [&] { u.verify_checked(); }, errc::invalid_size,
      "batch: draft_offsets ends at 2 but there are 3 draft tokens");
}

TEST_CASE("B3 verify_checked: target rows not N + B, V = 0", "[errors][batch]") {
  ThreeSequences s;
  s.target_rows = 5;
  check_error(
      "B3", [&] { s.verify_checked(); }, errc::invalid_size,
      "batch: 5 target rows, expected 6 (3 draft tokens plus one row per sequence)");
  ThreeSequences t;
  const std::vector<float> none;
  BatchVerification out;
  check_error(
      "B3",
      [&] {
        t.verifier.verify_checked({t.drafts, t.offsets, RowsView<const float>(none.data(), 6, 0),
                                   RowsView<const float>(none.data(), 0, 0)},
                                  t.options, out);
      },
      errc::invalid_size, "batch: the vocabulary size is 0");
}

TEST_CASE("B4 verify_checked: draft rows neither N nor none; of another width", "[errors][batch]") {
  ThreeSequences s;
  s.draft_rows = 2;
  check_error(
      "B4", [&] { s.verify_checked(); }, errc::invalid_size,
      "batch: 2 draft rows, expected one per draft token (3) or none");
  ThreeSequences t;
  t.draft_rows = 2;
  t.draft_width = 6;  // the same 12 floats seen as 2 rows of 6
  t.draft_rows = 2;
  t.drafts = {1, 2};
  t.offsets = {0, 1, 1, 2};
  t.target_rows = 5;
  check_error(
      "B4", [&] { t.verify_checked(); }, errc::vocab_mismatch,
      "batch: draft rows have 6 entries but target rows have 4");
}

TEST_CASE("B5 verify_checked: a bad row of one sequence; the others are verified",
          "[errors][batch]") {
  // Sequence 9 (batch position 2): its target row 1 (batch row 5) holds a NaN. The other two
  // sequences are verified exactly as verify() verifies them without it.
  ThreeSequences s;
  s.target[5 * 4 + 2] = std::numeric_limits<float>::quiet_NaN();
  check_error(
      "B5", [&] { s.verify_checked(); }, errc::invalid_probability,
      "sequence 9 (batch position 2): target row 1 (step 3): entry for token 2 is NaN");
  REQUIRE(s.out.size() == 3);
  CHECK(s.out.ok(0));
  CHECK(s.out.ok(1));
  CHECK_FALSE(s.out.ok(2));
  CHECK(s.out.emitted(2).empty());
  ThreeSequences clean;
  clean.verifier.verify(clean.batch(), clean.options, clean.out);
  CHECK(s.out.result(0) == clean.out.result(0));
  CHECK(s.out.result(1) == clean.out.result(1));
  // A draft row that does not sum to 1, a zero target row.
  ThreeSequences t;
  t.draft[1 * 4] = 0.5F;
  check_error(
      "B5", [&] { t.verify_checked(); }, errc::not_normalized,
      "sequence 7 (batch position 0): draft row 1 (step 3): entries sum to 1.25");
  ThreeSequences u;
  for (std::size_t j = 0; j < 4; ++j) u.target[3 * 4 + j] = 0.0F;
  check_error(
      "B5", [&] { u.verify_checked(); }, errc::zero_mass,
      "sequence 8 (batch position 1): target row 0 (step 3): all entries are zero");
}

TEST_CASE("B6 verify_checked: a draft token outside the vocabulary", "[errors][batch]") {
  ThreeSequences s;
  s.drafts[1] = 4;
  check_error(
      "B6", [&] { s.verify_checked(); }, errc::invalid_token,
      "sequence 7 (batch position 0): draft token at position 1 (step 3): id 4 is "
      "outside [0, 4)");
  CHECK(s.out.ok(2));
}

TEST_CASE("B7 verify, verify_checked: sampling options or lenience out of range",
          "[errors][batch]") {
  ThreeSequences s;
  s.options[1].sampling.top_p = 0.0;
  check_error(
      "B7", [&] { s.verify_checked(); }, errc::invalid_option,
      "sequence 8 (batch position 1): sampling option top_p = 0 must be in (0, 1]");
  check_error(
      "B7", [&] { s.verifier.verify(s.batch(), s.options, s.out); }, errc::invalid_option,
      "sequence 8 (batch position 1): sampling option top_p = 0 must be in (0, 1]");
  ThreeSequences t;
  t.options[0].lenience = 0.0;
  check_error(
      "B7", [&] { t.verifier.verify(t.batch(), t.options, t.out); }, errc::domain,
      "sequence 7 (batch position 0): lenience 0 is outside (0, 1]");
  ThreeSequences u;
  u.options[1].lenience = 0.5;
  u.options[1].verification = specdec::verification_rule::block;
  check_error(
      "B7", [&] { u.verifier.verify(u.batch(), u.options, u.out); }, errc::invalid_option,
      "sequence 8 (batch position 1): verification = block needs lenience = 1 (block "
      "verification is defined for exact sampling), not 0.5");
}

TEST_CASE("B8 verify_checked: model drafts in a batch without draft rows", "[errors][batch]") {
  ThreeSequences s;
  s.draft_rows = 0;
  s.options[2].proposals = true;
  check_error(
      "B8", [&] { s.verify_checked(); }, errc::invalid_size,
      "sequence 7 (batch position 0): draft rows: the batch has none, but the sequence "
      "drafted 2 tokens with a model (set proposals for drafts without rows)");
  CHECK(s.out.ok(1));  // nothing drafted: no rows needed
  CHECK(s.out.ok(2));  // proposals
}

TEST_CASE("B9 write_padded: output of the wrong size or too narrow", "[errors][batch]") {
  ThreeSequences s;
  s.options[0].sampling.temperature = 0.0;  // greedy: accepts while the draft is the argmax
  s.target[1] = 0.5F;                       // p_1 of sequence 7 peaks at its draft 1
  s.target[1 * 4 + 2] = 0.5F;               // p_2 peaks at its draft 2: a bonus, 3 tokens
  s.verify_checked();
  REQUIRE(s.out.max_emitted() == 3);
  std::vector<token_id> padded(3 * 3);
  check_error(
      "B9", [&] { s.out.write_padded(std::span<token_id>(padded).first(8), 3); },
      errc::invalid_size, "padded output: has 8 entries, expected 3 sequences times the width 3");
  std::vector<token_id> narrow(3 * 2);
  check_error(
      "B9", [&] { s.out.write_padded(narrow, 2); }, errc::invalid_size,
      "padded output: width 2 is less than the longest emitted sequence (3 tokens)");
  s.out.write_padded(padded, 3);
  CHECK(padded == std::vector<token_id>{1, 2, 0, padded[3], specdec::padding_token,
                                        specdec::padding_token, padded[6], padded[7], padded[8]});
}

TEST_CASE("B13 BatchGammaPlanner: options out of range, plan inputs that disagree",
          "[errors][batch]") {
  using specdec::BatchGammaOptions;
  using specdec::BatchGammaPlanner;
  check_error(
      "B13", [] { BatchGammaPlanner planner(BatchGammaOptions{.max_gamma = 0}); },
      errc::invalid_option, "BatchGammaPlanner: max_gamma = 0 must be >= 1");
  check_error(
      "B13", [] { BatchGammaPlanner planner(BatchGammaOptions{.prior_alpha = 1.5}); },
      errc::invalid_option, "BatchGammaPlanner: prior_alpha = 1.5 must be in [0, 1]");
  check_error(
      "B13", [] { BatchGammaPlanner planner(BatchGammaOptions{.prior_trials = -1.0}); },
      errc::invalid_option, "prior_trials = -1 must be finite and >= 0");
  check_error(
      "B13", [] { BatchGammaPlanner planner(BatchGammaOptions{.forgetting = 0.0}); },
      errc::invalid_option, "forgetting = 0 must be in (0, 1]");
  check_error(
      "B13",
      [] {
        BatchGammaPlanner planner(
            BatchGammaOptions{.draft_cost = std::numeric_limits<double>::infinity()});
      },
      errc::invalid_option, "draft_cost = inf must be finite and >= 0");
  BatchGammaPlanner planner;
  std::vector<double> alphas{0.5, 0.7};
  std::vector<std::size_t> caps{4, 4};
  std::vector<std::size_t> gammas(3);
  check_error(
      "B13", [&] { (void)planner.plan(alphas, caps, gammas); }, errc::invalid_size,
      "BatchGammaPlanner::plan: 2 alphas, 2 caps and 3 gammas");
  gammas.resize(2);
  alphas[1] = std::numeric_limits<double>::quiet_NaN();
  check_error(
      "B13", [&] { (void)planner.plan(alphas, caps, gammas); }, errc::domain,
      "BatchGammaPlanner::plan: alphas[1] = nan is outside [0, 1]");
  alphas[1] = 0.7;
  BatchGammaPlanner negative(
      BatchGammaOptions{.target_cost = [](std::size_t p) { return p > 2 ? -1.0 : 1.0; }});
  check_error(
      "B13", [&] { (void)negative.plan(alphas, caps, gammas); }, errc::domain,
      "BatchGammaPlanner: target_cost(3) = -1 must be finite and >= 0");
}
