// Tests for include/specdec/stop_conditions.hpp, the emission stage SpeculativeDecoder and
// BatchDecoder share: a step's tokens are appended one at a time up to a stop token, the
// token completing a stop sequence (matched on the generated tokens only) or the budget, in
// that order of precedence; the conditions are checked against the vocabulary with messages
// naming where they came from. The decoders' own tests (stop tokens, stop sequences and
// max_new_tokens in speculative_decoder_test.cpp and batch_decoder_test.cpp) cover the same
// stage inside a step.
#include <cstddef>
#include <span>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "errors_catalogue.hpp"
#include "specdec/stop_conditions.hpp"

namespace {

using specdec::stop_reason;
using specdec::StopConditions;
using specdec::token_id;
using Tokens = std::vector<token_id>;

StopConditions conditions(const Tokens& tokens, const std::vector<Tokens>& sequences) {
  StopConditions stops;
  stops.assign(tokens, sequences, 10, "decoder option ");
  return stops;
}

}  // namespace

TEST_CASE("StopConditions::emit cuts a step's tokens at the first stop", "[stop_conditions]") {
  const StopConditions stops = conditions({7, 2}, {{4, 5}, {9}});
  CHECK(stops.is_stop_token(7));
  CHECK(stops.is_stop_token(2));
  CHECK_FALSE(stops.is_stop_token(4));
  struct Case {
    Tokens sequence;  // before the step (floor: its first `floor` tokens are the prompt)
    std::size_t floor;
    Tokens step;
    std::size_t budget;
    std::size_t taken;
    stop_reason reason;
  };
  const std::vector<Case> cases{
      {{1, 1}, 2, {3, 6, 8}, 10, 3, stop_reason::none},              // nothing stops
      {{1, 1}, 2, {3, 7, 8}, 10, 2, stop_reason::stop_token},        // the stop token is emitted
      {{1, 1}, 2, {3, 6, 8}, 2, 2, stop_reason::max_new_tokens},     // budget inside the step
      {{1, 1}, 2, {3, 6, 8}, 3, 3, stop_reason::max_new_tokens},     // budget at its end
      {{1, 1}, 2, {3, 2}, 2, 2, stop_reason::stop_token},            // stop token beats budget
      {{1, 1}, 2, {3, 4, 5, 6}, 10, 3, stop_reason::stop_sequence},  // completed in the step
      {{1, 1, 4}, 2, {5, 6}, 10, 1, stop_reason::stop_sequence},     // begun before the step
      {{1, 4}, 2, {5, 6}, 10, 2, stop_reason::none},                 // the 4 is prompt: no match
      {{1, 4}, 1, {5, 6}, 10, 1, stop_reason::stop_sequence},        // ... unless generated
      {{1, 1}, 2, {9}, 1, 1, stop_reason::stop_sequence},            // sequence beats budget
      {{}, 0, {3}, 10, 1, stop_reason::none},
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    Tokens sequence = k.sequence;
    const auto cut = stops.emit(k.step, sequence, k.floor, k.budget);
    INFO("case " << c);
    CHECK(cut.taken == k.taken);
    CHECK(cut.reason == k.reason);
    Tokens expected = k.sequence;
    expected.insert(expected.end(), k.step.begin(),
                    k.step.begin() + static_cast<std::ptrdiff_t>(k.taken));
    CHECK(sequence == expected);
  }
  // No conditions: only the budget cuts.
  const StopConditions none;
  CHECK(none.empty());
  Tokens sequence;
  CHECK(none.emit(Tokens{7, 9, 2}, sequence, 0, 5).reason == stop_reason::none);
  CHECK(sequence == Tokens{7, 9, 2});
}

TEST_CASE("StopConditions::assign checks the conditions against the vocabulary",
          "[stop_conditions][errors]") {
  using specdec::errc;
  using specdec::testing::check_error;
  StopConditions stops = conditions({3}, {});
  check_error(
      "D6",
      [&] {
        stops.assign(Tokens{3, 10}, {}, 10, "decoder option ");
      },
      errc::invalid_option, "decoder option stop_tokens: token 10 is outside [0, 10)");
  check_error(
      "B10", [&] { stops.assign(Tokens{-1}, {}, 10, "sequence 7: "); }, errc::invalid_option,
      "sequence 7: stop_tokens: token -1 is outside [0, 10)");
  const std::vector<Tokens> empty_one{{1}, {}};
  check_error(
      "D7", [&] { stops.assign(Tokens{}, empty_one, 10, "decoder option "); }, errc::invalid_option,
      "decoder option stop_sequences[1] is empty");
  const std::vector<Tokens> outside{{1, 12}};
  check_error(
      "B10", [&] { stops.assign(Tokens{}, outside, 10, "sequence 7: "); }, errc::invalid_option,
      "sequence 7: stop_sequences[0]: token 12 is outside [0, 10)");
  // A failed assign keeps the previous conditions.
  CHECK(stops.is_stop_token(3));
}
