// Bad-input catalogue, decoder side (docs/errors.md, rows D* and P*): SpeculativeDecoder
// construction, generate() and step() with misbehaving models, SamplingOptions /
// Standardizer, and the gamma policies. One test case per catalogue row.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_exception.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors_catalogue.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "support/kernel_path_listener.hpp"
#include "support/sequence_law.hpp"

namespace {

using specdec::errc;
using specdec::token_id;
using specdec::testing::check_error;

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
constexpr double infinity = std::numeric_limits<double>::infinity();

/// How a model call misbehaves.
enum class fault {
  none,
  short_row,     // V - 1 entries
  nan_entry,     // entry 1 is NaN
  infinite,      // entry 1 is +infinity
  negative,      // entry 1 is -0.25
  zero_row,      // all zero
  unnormalized,  // sums to 1.5
  throw_std,     // throws std::runtime_error
  throw_other,   // throws an int
};

/// Writes a content fault (NaN, negative, zero row, unnormalised) into `row`; other kinds
/// leave it alone.
template <class T>
void poison(std::span<T> row, fault how) {
  switch (how) {
    case fault::nan_entry:
      row[1] = std::numeric_limits<T>::quiet_NaN();
      break;
    case fault::infinite:
      row[1] = std::numeric_limits<T>::infinity();
      break;
    case fault::negative:
      row[1] = T(-0.25);
      break;
    case fault::zero_row:
      std::fill(row.begin(), row.end(), T(0));
      break;
    case fault::unnormalized:
      row[0] += T(0.5);
      break;
    default:
      break;
  }
}

/// A LanguageModel over V = 4 with context-dependent valid rows; call number `fail_at`
/// (0-based) misbehaves as `how`. Records every context it is given.
template <class T>
struct ScriptedModel {
  std::size_t vocab = 4;
  std::size_t reported_vocab = 4;
  std::size_t fail_at = std::numeric_limits<std::size_t>::max();
  fault how = fault::none;
  std::size_t calls = 0;
  std::vector<std::vector<token_id>> contexts;
  std::vector<T> row;

  [[nodiscard]] std::size_t vocab_size() const { return reported_vocab; }

  std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    contexts.emplace_back(context.begin(), context.end());
    const std::size_t call = calls++;
    row.assign(vocab, T(0));
    // A valid row depending on the last token: mass 0.7 on (last + 1) mod V.
    const std::size_t last = context.empty() ? 0 : static_cast<std::size_t>(context.back()) % vocab;
    for (std::size_t j = 0; j < vocab; ++j)
      row[j] = static_cast<T>(0.3 / static_cast<double>(vocab));
    row[(last + 1) % vocab] += static_cast<T>(0.7);
    if (call != fail_at) return row;
    switch (how) {
      case fault::short_row:
        return std::span<const T>(row.data(), vocab - 1);
      case fault::throw_std:
        throw std::runtime_error("engine out of memory");
      case fault::throw_other:
        throw 42;
      default:
        poison(std::span<T>(row), how);
    }
    return row;
  }
};

/// ScriptedModel plus score_draft returning `extra_rows` more rows than asked for.
template <class T>
struct ScriptedBatchedModel : ScriptedModel<T> {
  std::ptrdiff_t extra_rows = 0;
  std::vector<T> block;
  specdec::RowsView<const T> score_draft(std::span<const token_id> context,
                                         std::span<const token_id> draft) {
    const auto rows =
        static_cast<std::size_t>(static_cast<std::ptrdiff_t>(draft.size() + 1) + extra_rows);
    block.clear();
    std::vector<token_id> prefix(context.begin(), context.end());
    for (std::size_t i = 0; i < rows; ++i) {
      const auto scored = this->next_token_probabilities(prefix);
      block.insert(block.end(), scored.begin(), scored.end());
      if (i < draft.size()) prefix.push_back(draft[i]);
    }
    return {block.data(), rows, this->vocab};
  }
};

/// A proposal drafter proposing `count` tokens (capped at out.size() unless `overflow`),
/// with `bad_token` at position `bad_at`.
struct ScriptedDrafter {
  std::size_t count = 2;
  bool overflow = false;
  std::size_t bad_at = std::numeric_limits<std::size_t>::max();
  token_id bad_token = 0;
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) const {
    const std::size_t n = std::min(count, out.size());
    const token_id last = context.empty() ? 0 : context.back();
    for (std::size_t i = 0; i < n; ++i)
      out[i] = static_cast<token_id>((last + 1 + static_cast<token_id>(i)) % 4);
    if (bad_at < n) out[bad_at] = bad_token;
    return overflow ? out.size() + 1 : n;
  }
};

specdec::DecoderOptions fixed(std::size_t gamma) {
  specdec::DecoderOptions options;
  options.gamma_policy = specdec::FixedGamma(gamma);
  return options;
}

const std::vector<token_id> prompt{1, 2};

/// A gamma policy whose first gamma is `first`, then `later` for every further step.
struct TwoPhaseGamma {
  std::size_t first = 1;
  std::size_t later = 1;
  std::size_t steps = 0;
  [[nodiscard]] std::size_t next_gamma() const { return steps == 0 ? first : later; }
  [[nodiscard]] bool continue_drafting(double, std::size_t) const { return true; }
  void observe(const specdec::StepFeedback&) { ++steps; }
  [[nodiscard]] bool needs_timing() const { return false; }
};

/// A logits engine over V = 4 for LogitsModel (context-dependent finite logits); call
/// `fail_at` (0-based) puts `poison` into entry 1, or into every entry with `all`.
template <class T>
struct LogitsEngine {
  std::size_t fail_at = std::numeric_limits<std::size_t>::max();
  T poison = T(0);
  bool all = false;
  std::size_t calls = 0;
  std::vector<T> out{};
  [[nodiscard]] std::size_t vocab_size() const { return 4; }
  std::span<const T> next_token_logits(std::span<const token_id> context) {
    out = {T(0.5), T(-1), T(2), T(0)};
    out[context.size() % 4] += T(0.75);
    if (calls++ == fail_at) {
      if (all) {
        std::fill(out.begin(), out.end(), poison);
      } else {
        out[1] = poison;
      }
    }
    return out;
  }
};

}  // namespace

// --- construction -------------------------------------------------------------------------

TEST_CASE("D1 SpeculativeDecoder: lenience outside 0 < x <= 1", "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  for (const double lenience : {0.0, -1.0, 1.5, not_a_number}) {
    specdec::DecoderOptions options;
    options.lenience = lenience;
    check_error(
        "D1", [&] { specdec::SpeculativeDecoder decoder(target, draft, options); },
        errc::invalid_option, "decoder option lenience = ");
  }
}

TEST_CASE("D2 SpeculativeDecoder: lenience below 1 with greedy decoding",
          "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::DecoderOptions options;
  options.sampling.temperature = 0.0;
  options.lenience = 0.5;
  check_error(
      "D2", [&] { specdec::SpeculativeDecoder decoder(target, draft, options); },
      errc::invalid_option, "needs temperature > 0");
}

TEST_CASE("D3 SpeculativeDecoder: gamma = 0 from the gamma policy at construction",
          "[errors][speculative_decoder][gamma_policy]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::DecoderOptions options;
  options.gamma_policy = TwoPhaseGamma{0, 1};
  check_error(
      "D3", [&] { specdec::SpeculativeDecoder decoder(target, draft, options); },
      errc::invalid_option, "next_gamma() is 0, must be >= 1");
}

TEST_CASE("D4 SpeculativeDecoder: target vocabulary size 0", "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  target.reported_vocab = 0;
  ScriptedModel<float> draft;
  draft.reported_vocab = 0;
  check_error(
      "D4", [&] { specdec::SpeculativeDecoder decoder(target, draft); }, errc::invalid_size,
      "target model: vocab_size() is 0");
  ScriptedDrafter drafter;
  check_error(
      "D4", [&] { specdec::SpeculativeDecoder decoder(target, drafter); }, errc::invalid_size,
      "vocab_size() is 0");
}

TEST_CASE("D5 SpeculativeDecoder: vocabulary mismatch between the models",
          "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  draft.reported_vocab = 5;
  check_error(
      "D5", [&] { specdec::SpeculativeDecoder decoder(target, draft); }, errc::vocab_mismatch,
      "draft model has vocab_size() 5 but the target model has 4");
}

TEST_CASE("D6 SpeculativeDecoder: stop token outside 0..V-1", "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  for (const token_id stop : {4, -1}) {
    specdec::DecoderOptions options;
    options.stop_tokens = {0, stop};
    check_error(
        "D6", [&] { specdec::SpeculativeDecoder decoder(target, draft, options); },
        errc::invalid_option, "decoder option stop_tokens: token ");
  }
}

TEST_CASE("D7 SpeculativeDecoder: empty stop sequence or one with a token outside 0..V-1",
          "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::DecoderOptions empty;
  empty.stop_sequences = {{1, 2}, {}};
  check_error(
      "D7", [&] { specdec::SpeculativeDecoder decoder(target, draft, empty); },
      errc::invalid_option, "decoder option stop_sequences[1] is empty");
  specdec::DecoderOptions outside;
  outside.stop_sequences = {{1, 9}};
  check_error(
      "D7", [&] { specdec::SpeculativeDecoder decoder(target, draft, outside); },
      errc::invalid_option, "stop_sequences[0]: token 9 is outside [0, 4)");
}

TEST_CASE(
    "D8 SamplingOptions / Standardizer / standardize / LogitsModel / SpeculativeDecoder: "
    "sampling option out of range",
    "[errors][sampling][speculative_decoder]") {
  const auto check = [](specdec::SamplingOptions sampling, const char* fragment) {
    check_error(
        "D8", [&] { sampling.validate(); }, errc::invalid_option, fragment);
    check_error(
        "D8", [&] { specdec::Standardizer<float> standardizer(sampling); }, errc::invalid_option,
        fragment);
    const std::vector<double> row{0.25, 0.25, 0.5};
    check_error(
        "D8", [&] { (void)specdec::standardize(row, sampling); }, errc::invalid_option, fragment);
    check_error(
        "D8", [&] { (void)specdec::standardize_logits(row, sampling); }, errc::invalid_option,
        fragment);
    LogitsEngine<float> engine;
    check_error(
        "D8", [&] { specdec::LogitsModel adapter(engine, sampling); }, errc::invalid_option,
        fragment);
    ScriptedModel<float> target;
    ScriptedModel<float> draft;
    specdec::DecoderOptions options;
    options.sampling = sampling;
    check_error(
        "D8", [&] { specdec::SpeculativeDecoder decoder(target, draft, options); },
        errc::invalid_option, fragment);
  };
  for (const double temperature : {-1.0, not_a_number, infinity}) {
    check({.temperature = temperature}, "sampling option temperature = ");
  }
  for (const double top_p : {0.0, 1.5, not_a_number}) {
    check({.top_p = top_p}, "sampling option top_p = ");
  }
  for (const double min_p : {-0.1, 1.5, not_a_number}) {
    check({.min_p = min_p}, "sampling option min_p = ");
  }
}

// --- generate() inputs ----------------------------------------------------------------------

TEST_CASE("D9 generate: max_new_tokens = 0", "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::SpeculativeDecoder decoder(target, draft);
  const auto result = decoder.generate(prompt, 0, std::uint64_t{1});
  CHECK(result.tokens.empty());
  CHECK(result.stop == specdec::stop_reason::max_new_tokens);
  CHECK(target.calls == 0);
  CHECK(draft.calls == 0);
  specdec::xoshiro256pp g(1);
  const auto step = decoder.step(prompt, g, 0);  // step() with no budget: the same
  CHECK(step.tokens.empty());
  CHECK(step.stop == specdec::stop_reason::max_new_tokens);
}

TEST_CASE("D10 generate: empty prompt", "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
  const auto result = decoder.generate({}, 5, std::uint64_t{3});
  CHECK(result.tokens.size() == 5);
  REQUIRE_FALSE(target.contexts.empty());
  CHECK(target.contexts.front().empty());  // the models see an empty context first
  CHECK(draft.contexts.front().empty());
}

TEST_CASE("D11 generate and step: prompt or context ids outside 0..V-1",
          "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
  const auto first = decoder.generate(prompt, 3, std::uint64_t{3});
  const std::vector<token_id> kept(first.tokens.begin(), first.tokens.end());
  const std::size_t calls = target.calls + draft.calls;
  check_error(
      "D11",
      [&] {
        (void)decoder.generate(std::vector<token_id>{1, 7, -3}, 3, std::uint64_t{3});
      },
      errc::invalid_token, "prompt token at position 1: id 7 is outside [0, 4)");
  check_error(
      "D11", [&] { (void)decoder.generate(std::vector<token_id>{-3}, 3, std::uint64_t{3}); },
      errc::invalid_token, "prompt token at position 0: id -3 is outside [0, 4)");
  CHECK(target.calls + draft.calls == calls);  // the models never saw the bad ids
  // Nothing already generated is lost: the last result is still readable.
  CHECK(std::vector<token_id>(decoder.generated().begin(), decoder.generated().end()) == kept);
  try {
    (void)decoder.generate(std::vector<token_id>{4}, 3, std::uint64_t{3});
    FAIL("no exception");
  } catch (const specdec::decoding_error& e) {
    CHECK(e.tokens().empty());
    CHECK(e.step() == 0);
  }
  specdec::xoshiro256pp g(1);
  check_error(
      "D11",
      [&] {
        (void)decoder.step(std::vector<token_id>{0, 1, 2, 3, 4}, g);
      },
      errc::invalid_token, "context token at position 4: id 4 is outside [0, 4)");
  CHECK(target.calls + draft.calls == calls);
  // The decoder stays usable.
  CHECK(decoder.generate(prompt, 3, std::uint64_t{3}).tokens == kept);
}

// --- misbehaving models during generate() -------------------------------------------------

TEMPLATE_TEST_CASE("D12 generate: a model row of the wrong length", "[errors][speculative_decoder]",
                   float, double) {
  ScriptedModel<TestType> target;
  ScriptedModel<TestType> draft;
  draft.fail_at = 0;
  draft.how = fault::short_row;
  specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
  check_error(
      "D12", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, errc::invalid_size,
      "draft row 0 (step 0, sequence position 2): has 3 entries, expected the vocabulary "
      "size 4");
  // Also with validate_rows off: sizes are always checked.
  ScriptedModel<TestType> target2;
  target2.fail_at = 2;
  target2.how = fault::short_row;
  ScriptedModel<TestType> draft2;
  specdec::DecoderOptions options = fixed(2);
  options.validate_rows = false;
  specdec::SpeculativeDecoder unchecked(target2, draft2, options);
  check_error(
      "D12", [&] { (void)unchecked.generate(prompt, 8, std::uint64_t{1}); }, errc::invalid_size,
      "target row 2 (step 0, sequence position 4): has 3 entries");
}

TEMPLATE_TEST_CASE("D13 generate: NaN / infinite or negative probability from a model",
                   "[errors][speculative_decoder]", float, double) {
  for (const fault how : {fault::nan_entry, fault::negative}) {
    ScriptedModel<TestType> target;
    target.fail_at = 1;
    target.how = how;
    ScriptedModel<TestType> draft;
    specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
    check_error(
        "D13", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); },
        errc::invalid_probability,
        how == fault::nan_entry
            ? "target row 1 (step 0, sequence position 3): entry for token 1 is NaN"
            : "target row 1 (step 0, sequence position 3): entry for token 1 is negative");
  }
}

TEMPLATE_TEST_CASE("D14 generate: all-zero row from a model", "[errors][speculative_decoder]",
                   float, double) {
  ScriptedModel<TestType> target;
  ScriptedModel<TestType> draft;
  draft.fail_at = 1;
  draft.how = fault::zero_row;
  specdec::SpeculativeDecoder decoder(target, draft, fixed(3));
  check_error(
      "D14", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, errc::zero_mass,
      "draft row 1 (step 0, sequence position 3): all entries are zero");
}

TEMPLATE_TEST_CASE("D15 generate: row that does not sum to 1 from a model",
                   "[errors][speculative_decoder]", float, double) {
  ScriptedModel<TestType> target;
  target.fail_at = 0;
  target.how = fault::unnormalized;
  ScriptedModel<TestType> draft;
  specdec::SpeculativeDecoder decoder(target, draft, fixed(1));
  check_error(
      "D15", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, errc::not_normalized,
      "target row 0 (step 0, sequence position 2): entries sum to 1.5");
}

TEMPLATE_TEST_CASE("D13-D15 greedy: the argmax scans validate the rows they take tokens from",
                   "[errors][speculative_decoder]", float, double) {
  // Greedy decoding checks rows inside its argmax scans (no separate pass): the same codes
  // and messages as sampling for NaN, negative and all-zero rows of either model, and no
  // sum check (argmax does not need one), so an unnormalised row decodes as plain greedy.
  struct Case {
    fault how;
    bool in_target;
    errc code;
    const char* message;
  };
  for (const Case c :
       {Case{fault::nan_entry, true, errc::invalid_probability,
             "target row 1 (step 0, sequence position 3): entry for token 1 is NaN"},
        Case{fault::negative, true, errc::invalid_probability,
             "target row 1 (step 0, sequence position 3): entry for token 1 is negative"},
        Case{fault::zero_row, true, errc::zero_mass,
             "target row 1 (step 0, sequence position 3): all entries are zero"},
        Case{fault::nan_entry, false, errc::invalid_probability,
             "draft row 1 (step 0, sequence position 3): entry for token 1 is NaN"},
        Case{fault::negative, false, errc::invalid_probability,
             "draft row 1 (step 0, sequence position 3): entry for token 1 is negative"},
        Case{fault::zero_row, false, errc::zero_mass,
             "draft row 1 (step 0, sequence position 3): all entries are zero"}}) {
    ScriptedModel<TestType> target;
    ScriptedModel<TestType> draft;
    (c.in_target ? target : draft).fail_at = 1;
    (c.in_target ? target : draft).how = c.how;
    specdec::DecoderOptions options = fixed(2);
    options.sampling.temperature = 0.0;
    specdec::SpeculativeDecoder decoder(target, draft, options);
    check_error(
        "D13", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, c.code, c.message);
  }
  for (const bool in_target : {true, false}) {
    ScriptedModel<TestType> target;
    ScriptedModel<TestType> draft;
    (in_target ? target : draft).fail_at = 1;
    (in_target ? target : draft).how = fault::unnormalized;
    specdec::DecoderOptions options = fixed(2);
    options.sampling.temperature = 0.0;
    specdec::SpeculativeDecoder decoder(target, draft, options);
    ScriptedModel<TestType> clean_target;
    ScriptedModel<TestType> clean_draft;
    specdec::SpeculativeDecoder reference(clean_target, clean_draft, options);
    INFO("unnormalised row in the " << (in_target ? "target" : "draft"));
    CHECK(decoder.generate(prompt, 8, std::uint64_t{1}).tokens ==
          reference.generate(prompt, 8, std::uint64_t{1}).tokens);
  }
}

namespace {

/// A batched target over V = 4 whose every row is {0.5, 0.5, 0, 0}; in its first
/// score_draft call row `bad` misbehaves as `how`.
template <class T>
struct HalvesTarget {
  HalvesTarget(std::size_t bad_row, fault kind) : bad(bad_row), how(kind) {}
  std::size_t bad;
  fault how;
  std::size_t calls = 0;
  std::vector<T> row{T(0.5), T(0.5), T(0), T(0)};
  std::vector<T> block;
  [[nodiscard]] std::size_t vocab_size() const { return 4; }
  std::span<const T> next_token_probabilities(std::span<const token_id>) { return row; }
  specdec::RowsView<const T> score_draft(std::span<const token_id>,
                                         std::span<const token_id> draft) {
    const std::size_t rows = draft.size() + 1;
    block.clear();
    for (std::size_t i = 0; i < rows; ++i) block.insert(block.end(), row.begin(), row.end());
    if (calls++ == 0 && bad < rows) poison(std::span<T>(block.data() + bad * 4, 4), how);
    return {block.data(), rows, 4};
  }
};

/// A draft model with one fixed row.
template <class T>
struct FixedRowDraft {
  std::vector<T> row;
  [[nodiscard]] std::size_t vocab_size() const { return 4; }
  std::span<const T> next_token_probabilities(std::span<const token_id>) { return row; }
};

/// Proposes token 3 (which the target rules out) at every position.
struct ProposesThree {
  std::size_t propose(std::span<const token_id>, std::span<token_id> out) const {
    std::fill(out.begin(), out.end(), token_id{3});
    return out.size();
  }
};

}  // namespace

/// Each content fault in row 0, 1 or 2 of a batched target's block, decoded with
/// `options` (gamma 2): reported, named like any row error, when the step reads the row;
/// decoded as if it were fine when the row comes after the final token's.
template <class T>
void check_block_row_faults(const specdec::DecoderOptions& options) {
  struct Fault {
    fault how;
    errc code;
    const char* problem;
  };
  const Fault faults[] = {
      {fault::nan_entry, errc::invalid_probability, "entry for token 1 is NaN"},
      {fault::negative, errc::invalid_probability, "entry for token 1 is negative"},
      {fault::zero_row, errc::zero_mass, "all entries are zero"},
      {fault::unnormalized, errc::not_normalized, "entries sum to 1.5"}};
  const auto expected = [](std::size_t row, const char* problem) {
    return "target row " + std::to_string(row) + " (step 0, sequence position " +
           std::to_string(2 + row) + "): " + problem;
  };
  for (const Fault f : faults) {
    for (std::size_t bad = 0; bad <= 2; ++bad) {
      INFO("row " << bad);
      // Draft = target: both drafts accepted, rows 0, 1 (accepted) and 2 (bonus) read.
      HalvesTarget<T> target{bad, f.how};
      FixedRowDraft<T> same{{T(0.5), T(0.5), T(0), T(0)}};
      specdec::SpeculativeDecoder accepting(target, same, options);
      check_error(
          "D13", [&] { (void)accepting.generate(prompt, 8, std::uint64_t{1}); }, f.code,
          expected(bad, f.problem));
      // Drafts of token 3, which p rules out: rejected at once; row 0 (the residual's) is
      // read, rows 1 and 2 never are.
      HalvesTarget<T> target2{bad, f.how};
      FixedRowDraft<T> threes{{T(0), T(0), T(0), T(1)}};
      specdec::SpeculativeDecoder rejecting(target2, threes, options);
      HalvesTarget<T> target3{bad, f.how};
      ProposesThree proposer;
      specdec::SpeculativeDecoder proposing(target3, proposer, options);
      if (bad == 0) {
        check_error(
            "D13", [&] { (void)rejecting.generate(prompt, 8, std::uint64_t{1}); }, f.code,
            expected(0, f.problem));
        check_error(
            "D13", [&] { (void)proposing.generate(prompt, 8, std::uint64_t{1}); }, f.code,
            expected(0, f.problem));
      } else {
        const auto tokens = rejecting.generate(prompt, 8, std::uint64_t{1}).tokens;
        const auto proposed = proposing.generate(prompt, 8, std::uint64_t{1}).tokens;
        CHECK(tokens.size() == 8);
        CHECK(proposed.size() == 8);
        for (const token_id t : tokens) CHECK((t == 0 || t == 1));
        for (const token_id t : proposed) CHECK((t == 0 || t == 1));
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "D13-D15 sampling: a batched target's rows are checked when first read, rows after "
    "the final token's never",
    "[errors][speculative_decoder]", float, double) {
  // A batched target at T = 1 without truncation is verified on its own rows: each row the
  // step reads whole is screened in that pass (beta or a screen of its own for accepted
  // rows, the residual or bonus draw for the last). With any other standardization (dense
  // tempered or top-p rows, top-k survivors) row i is standardized, with its checks, when
  // the decisions first read it. p_1..p_{n+1} are read, so a bad one is named like any row
  // error; rows after the final token's row are never read, so not checked, and the step
  // decodes as if they were fine.
  for (const specdec::SamplingOptions& sampling :
       {specdec::SamplingOptions{}, specdec::SamplingOptions{.temperature = 0.7},
        specdec::SamplingOptions{.top_p = 0.9}, specdec::SamplingOptions{.top_k = 2}}) {
    for (const bool beta : {true, false}) {
      INFO("T " << sampling.temperature << ", top-p " << sampling.top_p << ", top-k "
                << sampling.top_k << ", collect_beta " << beta);
      specdec::DecoderOptions options = fixed(2);
      options.sampling = sampling;
      options.collect_beta = beta;
      check_block_row_faults<TestType>(options);
    }
  }
}

/// Every content fault (NaN, negative, zero row, unnormalised) and a short row, in draft
/// rows, per-prefix target rows and batched target rows of `vocab` entries, decoded with
/// `sampling`: the same codes and messages as every other path.
template <class T>
void check_row_faults(const specdec::SamplingOptions& sampling, std::size_t vocab) {
  struct Case {
    fault how;
    errc code;
    std::string problem;
  };
  for (const Case& c :
       {Case{fault::nan_entry, errc::invalid_probability, "entry for token 1 is NaN"},
        Case{fault::infinite, errc::invalid_probability, "entry for token 1 is infinite"},
        Case{fault::negative, errc::invalid_probability, "entry for token 1 is negative"},
        Case{fault::zero_row, errc::zero_mass, "all entries are zero"},
        Case{fault::unnormalized, errc::not_normalized, "entries sum to 1.5"},
        Case{fault::short_row, errc::invalid_size,
             "has " + std::to_string(vocab - 1) + " entries"}}) {
    specdec::DecoderOptions options = fixed(2);
    options.sampling = sampling;
    for (const int where : {0, 1, 2}) {  // draft, per-prefix target, batched target
      if (where == 2 && c.how == fault::short_row) continue;  // a block has no short rows
      INFO("fault in " << (where == 0 ? "the draft" : where == 1 ? "a target row" : "a block row"));
      ScriptedModel<T> draft;
      ScriptedModel<T> target;
      ScriptedBatchedModel<T> batched;
      for (ScriptedModel<T>* model : {&draft, &target, static_cast<ScriptedModel<T>*>(&batched)}) {
        model->vocab = vocab;
        model->reported_vocab = vocab;
      }
      (where == 0 ? draft : where == 1 ? target : batched).fail_at = 1;
      (where == 0 ? draft : where == 1 ? target : batched).how = c.how;
      const std::string row = where == 0 ? "draft row 1" : "target row 1";
      const std::string expected = row + " (step 0, sequence position 3): " + c.problem;
      if (where == 2) {
        specdec::SpeculativeDecoder decoder(batched, draft, options);
        check_error(
            "D13", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, c.code, expected);
      } else {
        specdec::SpeculativeDecoder decoder(target, draft, options);
        check_error(
            "D13", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, c.code, expected);
      }
    }
  }
}

TEMPLATE_TEST_CASE("D13-D15 top-k: rows kept as survivors are validated in the selection pass",
                   "[errors][speculative_decoder]", float, double) {
  // With top-k truncation the decoder reads each model row once, selecting its survivors;
  // validation rides on that pass.
  check_row_faults<TestType>({.temperature = 0.7, .top_k = 2, .top_p = 0.95}, 4);
}

TEMPLATE_TEST_CASE("D13-D15 top-p: long rows are screened in the standardization's first pass",
                   "[errors][speculative_decoder]", float, double) {
  // Top-p alone at T = 1 on rows of at least 4096 entries takes the validation screen (signs
  // and sum) in the pass that finds the row's maximum and mass
  // (Standardizer::screens_first_pass), after which the decoder judges the row; a short row
  // is still refused before anything reads it.
  constexpr std::size_t vocab = 5000;
  check_row_faults<TestType>({.top_p = 0.9}, vocab);
  // Valid long rows pass the screen: the decoder generates.
  ScriptedModel<TestType> draft;
  ScriptedModel<TestType> target;
  draft.vocab = draft.reported_vocab = vocab;
  target.vocab = target.reported_vocab = vocab;
  specdec::DecoderOptions options = fixed(2);
  options.sampling = {.top_p = 0.9};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  CHECK(decoder.generate(prompt, 8, std::uint64_t{1}).tokens.size() == 8);
}

TEMPLATE_TEST_CASE("D13-D15 T != 1: dense rows are screened in the pass that takes their maximum",
                   "[errors][speculative_decoder]", float, double) {
  // At T != 1 the standardization's first pass takes the row's maximum (the tempered
  // weights are scaled by it); with validation on it takes the row's sum and signs too
  // (Standardizer::screens_first_pass) instead of a validation pass before it, and the
  // decoder judges the row after it: the standardization must survive any row (an
  // infinite entry makes every other tempered weight 0; top-p then finds no nucleus, where
  // it once read before its list, found by fuzz_decoder). Short and long rows, with top-p
  // and min-p.
  check_row_faults<TestType>({.temperature = 0.7}, 64);
  check_row_faults<TestType>({.temperature = 1.3, .min_p = 0.05}, 100);
  check_row_faults<TestType>({.temperature = 0.7, .top_p = 0.9}, 5000);
  // Valid rows pass the screen: the decoder generates.
  ScriptedModel<TestType> draft;
  ScriptedModel<TestType> target;
  draft.vocab = draft.reported_vocab = 5000;
  target.vocab = target.reported_vocab = 5000;
  specdec::DecoderOptions options = fixed(2);
  options.sampling = {.temperature = 0.7, .top_p = 0.9};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  CHECK(decoder.generate(prompt, 8, std::uint64_t{1}).tokens.size() == 8);
}

TEST_CASE("D15 generate: a float row off 1 by just over the tolerance is rejected on every path",
          "[errors][speculative_decoder]") {
  // These 16 floats sum to 1.00100001 (in double), just over 1 + 1e-3, but a float sum can
  // round to 1.00099993: the screens fused into the passes must leave such a row to the
  // full validator rather than accept it (found by fuzz_decoder). Draft rows at T = 1 (the
  // fused copy), target rows used in place, and top-k rows.
  const std::vector<float> row{0.0916475207F,  0.0625133067F,   0.0673373789F,  0.000124599988F,
                               0.190588057F,   0.000334512093F, 0.00317792245F, 0.366811424F,
                               0.0551080555F,  7.84827353e-05F, 0.00275950041F, 0.112128817F,
                               0.00293888152F, 0.0355510041F,   0.00548819406F, 0.00441235723F};
  double total = 0.0;
  for (const float x : row) total += static_cast<double>(x);
  REQUIRE(total - 1.0 > 1e-3);
  struct Fixed {
    std::vector<float> row;
    std::vector<float> block{};
    [[nodiscard]] std::size_t vocab_size() const { return 16; }
    std::span<const float> next_token_probabilities(std::span<const token_id>) { return row; }
    specdec::RowsView<const float> score_draft(std::span<const token_id>,
                                               std::span<const token_id> draft) {
      block.clear();
      for (std::size_t i = 0; i <= draft.size(); ++i)
        block.insert(block.end(), row.begin(), row.end());
      return {block.data(), draft.size() + 1, 16};
    }
  };
  const std::vector<float> uniform(16, 1.0F / 16.0F);
  for (const bool top_k : {false, true}) {
    specdec::DecoderOptions options = fixed(2);
    if (top_k) options.sampling = {.temperature = 0.9, .top_k = 4};
    INFO((top_k ? "top-k" : "T = 1"));
    Fixed bad_draft{row};
    Fixed good_target{uniform};
    specdec::SpeculativeDecoder draft_side(good_target, bad_draft, options);
    check_error(
        "D15", [&] { (void)draft_side.generate(prompt, 8, std::uint64_t{1}); },
        errc::not_normalized, "draft row 0 (step 0, sequence position 2): entries sum to 1.001");
    Fixed good_draft{uniform};
    Fixed bad_target{row};
    // Algorithm 1 reads p_1 first; block verification (the default) reads the rows from
    // the top of the block down, so the first row it rejects depends on the uniforms.
    specdec::DecoderOptions token_rule = options;
    token_rule.verification = specdec::verification_rule::token;
    specdec::SpeculativeDecoder target_side(bad_target, good_draft, token_rule);
    check_error(
        "D15", [&] { (void)target_side.generate(prompt, 8, std::uint64_t{1}); },
        errc::not_normalized, "target row 0 (step 0, sequence position 2): entries sum to 1.001");
    specdec::SpeculativeDecoder block_side(bad_target, good_draft, options);
    check_error(
        "D15", [&] { (void)block_side.generate(prompt, 8, std::uint64_t{1}); },
        errc::not_normalized, "(step 0, sequence position ");
    const std::string what = check_error(
        "D15", [&] { (void)block_side.generate(prompt, 8, std::uint64_t{1}); },
        errc::not_normalized, "entries sum to 1.001");
    CHECK(what.find("target row ") != std::string::npos);
  }
}

TEMPLATE_TEST_CASE("D16 generate: score_draft returns the wrong number of rows",
                   "[errors][speculative_decoder]", float, double) {
  for (const std::ptrdiff_t extra : {-1, 1}) {
    ScriptedBatchedModel<TestType> target;
    target.extra_rows = extra;
    ScriptedModel<TestType> draft;
    specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
    check_error(
        "D16", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, errc::invalid_size,
        extra < 0 ? "target rows 0..2 (step 0, sequence positions 2..4): score_draft returned "
                    "2 x 4, expected 3 x 4"
                  : "target rows 0..2 (step 0, sequence positions 2..4): score_draft returned "
                    "4 x 4, expected 3 x 4");
  }
}

TEST_CASE("D17 generate: a drafter proposing more tokens than asked for",
          "[errors][speculative_decoder]") {
  ScriptedModel<float> target;
  ScriptedDrafter drafter;
  drafter.overflow = true;
  specdec::SpeculativeDecoder decoder(target, drafter, fixed(3));
  check_error(
      "D17", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, errc::invalid_size,
      "the drafter proposed 4 tokens, more than the 3 asked for");
}

TEST_CASE("D18 generate: a drafter proposing a token id outside 0..V-1",
          "[errors][speculative_decoder]") {
  for (const token_id bad : {4, -1}) {
    ScriptedModel<float> target;
    ScriptedDrafter drafter;
    drafter.bad_at = 1;
    drafter.bad_token = bad;
    specdec::SpeculativeDecoder decoder(target, drafter, fixed(3));
    check_error(
        "D18", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, errc::invalid_token,
        "draft row 1 (step 0, sequence position 3): proposed token ");
  }
  // A bad id after a stop token is never looked at (the proposal is cut at the stop token).
  ScriptedModel<float> target;
  ScriptedDrafter drafter;
  drafter.count = 3;
  drafter.bad_at = 2;
  drafter.bad_token = -7;
  specdec::DecoderOptions options = fixed(3);
  options.stop_tokens = {static_cast<token_id>((prompt.back() + 2) % 4)};  // the 2nd proposal
  specdec::SpeculativeDecoder decoder(target, drafter, options);
  CHECK_NOTHROW(decoder.generate(prompt, 8, std::uint64_t{1}));
}

TEMPLATE_TEST_CASE("D19 generate: a model that throws inside a step",
                   "[errors][speculative_decoder]", float, double) {
  ScriptedModel<TestType> target;
  ScriptedModel<TestType> draft;
  specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
  // A first generation establishes what the decoder emits with these seeds.
  const auto reference = decoder.generate(prompt, 12, std::uint64_t{9});
  REQUIRE(reference.tokens.size() == 12);
  decoder.reset_statistics();
  // Fail in a later step (after a few steps have emitted tokens).
  target.calls = 0;
  target.fail_at = 7;
  target.how = fault::throw_std;
  std::vector<token_id> streamed;
  std::string what;
  std::size_t failed_step = 0;
  std::vector<token_id> preserved;
  try {
    (void)decoder.generate(prompt, 12, std::uint64_t{9});
  } catch (const specdec::decoding_error& e) {
    what = e.what();
    failed_step = e.step();
    preserved.assign(e.tokens().begin(), e.tokens().end());
    CHECK(e.code() == errc::model_failure);
    // The model's exception is nested.
    CHECK_THROWS_MATCHES(std::rethrow_if_nested(e), std::runtime_error,
                         Catch::Matchers::Message("engine out of memory"));
  }
  specdec::testing::dump_error_message("D19", what);
  CHECK_THAT(what, Catch::Matchers::StartsWith("specdec: model_failure: target row "));
  CHECK_THAT(what, Catch::Matchers::ContainsSubstring("the model threw: engine out of memory"));
  // Tokens generated before the failing step are preserved, and are a prefix of the
  // reference (same seed): the failure did not disturb them.
  CHECK(failed_step > 0);
  REQUIRE_FALSE(preserved.empty());
  CHECK(std::equal(preserved.begin(), preserved.end(), reference.tokens.begin()));
  CHECK(std::equal(preserved.begin(), preserved.end(), decoder.generated().begin(),
                   decoder.generated().end()));
  // The failed step changed no statistics: only the completed steps are counted.
  CHECK(decoder.statistics().steps == failed_step);
  CHECK(decoder.statistics().emitted_tokens == preserved.size());
  // The decoder remains usable: the same call now reproduces the reference.
  target.fail_at = std::numeric_limits<std::size_t>::max();
  CHECK(decoder.generate(prompt, 12, std::uint64_t{9}).tokens == reference.tokens);
}

namespace {

/// A proposal drafter over V = 4 (proposes last + 1, last + 2, ... mod 4) whose call
/// `fail_at` (0-based) throws: a std::runtime_error, or an int with `non_std`.
struct ThrowingDrafter {
  std::size_t fail_at = std::numeric_limits<std::size_t>::max();
  bool non_std = false;
  std::size_t calls = 0;
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) {
    if (calls++ == fail_at) {
      if (non_std) throw 7;
      throw std::runtime_error("drafter index corrupted");
    }
    const token_id last = context.empty() ? 0 : context.back();
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<token_id>((last + 1 + static_cast<token_id>(i)) % 4);
    }
    return out.size();
  }
};

/// Runs `decoder.generate` once cleanly (the reference), then again with the same seed after
/// `arm(true)` made the draft side fail in a later step: the catalogue's promises for a
/// model failure (row D19) must hold for the draft side too. `nested` checks the nested
/// exception; `arm(false)` disarms it again.
template <class Decoder, class Arm, class Nested>
void check_draft_failure(Decoder& decoder, Arm&& arm, const std::string& fragment,
                         Nested&& nested) {
  const auto reference = decoder.generate(prompt, 12, std::uint64_t{9});
  REQUIRE(reference.tokens.size() == 12);
  decoder.reset_statistics();
  arm(true);
  std::size_t failed_step = 0;
  std::vector<token_id> preserved;
  const std::string what = check_error(
      "D20",
      [&] {
        try {
          (void)decoder.generate(prompt, 12, std::uint64_t{9});
        } catch (const specdec::decoding_error& e) {
          failed_step = e.step();
          preserved.assign(e.tokens().begin(), e.tokens().end());
          nested(e);
          throw;
        }
      },
      errc::model_failure, fragment);
  CHECK_THAT(what, Catch::Matchers::StartsWith("specdec: model_failure: draft row "));
  // The tokens of the completed steps are kept: a prefix of the reference.
  CHECK(failed_step > 0);
  REQUIRE_FALSE(preserved.empty());
  CHECK(std::equal(preserved.begin(), preserved.end(), reference.tokens.begin()));
  CHECK(decoder.statistics().steps == failed_step);
  CHECK(decoder.statistics().emitted_tokens == preserved.size());
  // The decoder stays usable: the rerun reproduces the reference.
  arm(false);
  CHECK(decoder.generate(prompt, 12, std::uint64_t{9}).tokens == reference.tokens);
}

}  // namespace

TEST_CASE("D20 generate: a draft model or proposal drafter that throws, a non-std exception too",
          "[errors][speculative_decoder]") {
  constexpr std::size_t never = std::numeric_limits<std::size_t>::max();
  SECTION("a draft model throwing an int on its first call") {
    ScriptedModel<float> target;
    ScriptedModel<float> draft;
    draft.fail_at = 0;
    draft.how = fault::throw_other;
    specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
    check_error(
        "D20", [&] { (void)decoder.generate(prompt, 8, std::uint64_t{1}); }, errc::model_failure,
        "draft row 0 (step 0, sequence position 2): the model threw a non-std exception");
    CHECK(decoder.generate(prompt, 8, std::uint64_t{1}).tokens.size() == 8);  // usable
  }
  SECTION("a draft model throwing a std exception in a later step") {
    ScriptedModel<double> target;
    ScriptedModel<double> draft;
    specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
    check_draft_failure(
        decoder,
        [&](bool failing) {
          draft.calls = 0;
          draft.fail_at = failing ? 5 : never;  // the second row of the third step
          draft.how = fault::throw_std;
        },
        "draft row 1 (step 2, sequence position ",
        [](const specdec::decoding_error& e) {
          CHECK_THROWS_MATCHES(std::rethrow_if_nested(e), std::runtime_error,
                               Catch::Matchers::Message("engine out of memory"));
        });
  }
  SECTION("a proposal drafter throwing a std exception in a later step") {
    ScriptedModel<float> target;
    ThrowingDrafter drafter;
    specdec::SpeculativeDecoder decoder(target, drafter, fixed(3));
    check_draft_failure(
        decoder,
        [&](bool failing) {
          drafter.calls = 0;
          drafter.fail_at = failing ? 2 : never;
        },
        "draft row 0 (step 2, sequence position ",
        [](const specdec::decoding_error& e) {
          CHECK_THAT(e.what(), Catch::Matchers::ContainsSubstring(
                                   "the model threw: drafter index corrupted"));
          CHECK_THROWS_MATCHES(std::rethrow_if_nested(e), std::runtime_error,
                               Catch::Matchers::Message("drafter index corrupted"));
        });
  }
  SECTION("a proposal drafter throwing a non-std exception in a later step") {
    ScriptedModel<float> target;
    ThrowingDrafter drafter;
    drafter.non_std = true;
    specdec::SpeculativeDecoder decoder(target, drafter, fixed(3));
    check_draft_failure(
        decoder,
        [&](bool failing) {
          drafter.calls = 0;
          drafter.fail_at = failing ? 3 : never;
        },
        "the model threw a non-std exception",
        [](const specdec::decoding_error& e) {
          CHECK_THAT(e.what(), Catch::Matchers::ContainsSubstring("draft row 0 (step 3, "));
          CHECK_THROWS_AS(std::rethrow_if_nested(e), int);
        });
  }
}

TEST_CASE("D21 generate: the on_token callback throws", "[errors][speculative_decoder]") {
  struct callback_failure {};
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::DecoderOptions options = fixed(2);
  std::size_t seen = 0;
  options.on_token = [&seen](const specdec::EmittedToken&) {
    if (++seen == 4) throw callback_failure{};
  };
  specdec::SpeculativeDecoder decoder(target, draft, options);
  // Propagates unchanged (not wrapped into a specdec::error) ...
  CHECK_THROWS_AS(decoder.generate(prompt, 10, std::uint64_t{2}), callback_failure);
  // ... and the tokens of the step whose callback threw are already in generated().
  CHECK(decoder.generated().size() >= 4);
}

TEMPLATE_TEST_CASE("D22 step: a failing step emits nothing", "[errors][speculative_decoder]", float,
                   double) {
  ScriptedModel<TestType> target;
  target.fail_at = 0;
  target.how = fault::nan_entry;
  ScriptedModel<TestType> draft;
  specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
  specdec::xoshiro256pp g(4);
  try {
    (void)decoder.step(prompt, g);
    FAIL("step() should throw");
  } catch (const specdec::decoding_error& e) {
    CHECK(e.code() == errc::invalid_probability);
    CHECK(e.tokens().empty());
  }
  const auto next = decoder.step(prompt, g);  // usable afterwards
  CHECK_FALSE(next.tokens.empty());
}

TEST_CASE("D23 generate: a gamma policy returning 0 after the first step",
          "[errors][speculative_decoder][gamma_policy]") {
  // Not an error: a step with gamma = 0 drafts nothing and emits one target token.
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  specdec::DecoderOptions options;
  options.gamma_policy = TwoPhaseGamma{2, 0};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  const auto result = decoder.generate(prompt, 6, std::uint64_t{5});
  CHECK(result.tokens.size() == 6);
  CHECK(result.statistics.drafted_tokens <= 2);  // only the first step drafted
  CHECK(result.statistics.steps == 1 + 6 - (result.statistics.accepted_tokens + 1));
}

TEMPLATE_TEST_CASE("D24 generate: NaN, +inf or all -inf logits through LogitsModel",
                   "[errors][speculative_decoder][sampling]", float, double) {
  // LogitsModel's softmax passes NaN on (a +inf logit becomes NaN too: inf - inf) and turns an
  // all -inf row into zeros; row validation then names the row, never a token id.
  // (tests/speculative_decoder_test.cpp checks the same through the sampled and greedy paths
  // with more steps.)
  using T = TestType;
  constexpr T inf = std::numeric_limits<T>::infinity();
  struct Case {
    T poison;
    bool all;
    errc code;
    const char* problem;
  };
  for (const Case c : {Case{std::numeric_limits<T>::quiet_NaN(), false, errc::invalid_probability,
                            "entry for token 1 is NaN"},
                       Case{inf, false, errc::invalid_probability, "entry for token 1 is NaN"},
                       Case{-inf, true, errc::zero_mass, "all entries are zero"}}) {
    for (const bool greedy : {false, true}) {
      INFO("poison " << c.poison << (c.all ? " (whole row)" : "") << ", greedy " << greedy);
      LogitsEngine<T> target_engine{.fail_at = 3, .poison = c.poison, .all = c.all};
      LogitsEngine<T> draft_engine;
      specdec::LogitsModel target(target_engine);
      specdec::LogitsModel draft(draft_engine);
      specdec::DecoderOptions options = fixed(2);
      options.sampling.temperature = greedy ? 0.0 : 0.8;
      specdec::SpeculativeDecoder decoder(target, draft, options);
      // Three target calls a step: call 3 is the first row of step 1.
      const std::string what = check_error(
          "D24",
          [&] {
            try {
              (void)decoder.generate(prompt, 30, std::uint64_t{4});
            } catch (const specdec::decoding_error& e) {
              CHECK(e.step() == 1);
              CHECK_FALSE(e.tokens().empty());
              for (const token_id token : e.tokens()) CHECK((token >= 0 && token < 4));
              throw;
            }
          },
          c.code, "target row 0 (step 1, sequence position ");
      CHECK_THAT(what, Catch::Matchers::ContainsSubstring(c.problem));
      // The decoder stays usable once the engine behaves.
      target_engine.fail_at = std::numeric_limits<std::size_t>::max();
      CHECK(decoder.generate(prompt, 6, std::uint64_t{4}).tokens.size() == 6);
    }
  }
  // The draft side likewise; a single -inf logit is valid (a masked token, probability 0).
  LogitsEngine<T> target_engine;
  LogitsEngine<T> draft_engine{.fail_at = 1, .poison = std::numeric_limits<T>::quiet_NaN()};
  specdec::LogitsModel target(target_engine);
  specdec::LogitsModel draft(draft_engine);
  specdec::SpeculativeDecoder decoder(target, draft, fixed(2));
  check_error(
      "D24", [&] { (void)decoder.generate(prompt, 30, std::uint64_t{4}); },
      errc::invalid_probability,
      "draft row 1 (step 0, sequence position 3): entry for token 1 is NaN");
  LogitsEngine<T> masked_engine{.fail_at = 0, .poison = -inf};
  specdec::LogitsModel masked(masked_engine);
  specdec::SpeculativeDecoder masked_decoder(masked, draft, fixed(2));
  draft_engine.fail_at = std::numeric_limits<std::size_t>::max();
  CHECK(masked_decoder.generate(prompt, 6, std::uint64_t{4}).tokens.size() == 6);
}

TEST_CASE("D25 generate: the DecoderOptions::clock throws", "[errors][speculative_decoder]") {
  // The clock is read only for a policy whose needs_timing() is true: three times a step
  // (before drafting, before scoring, after verification). Its exception propagates
  // unchanged and the failing step emits nothing.
  struct clock_failure {};
  struct TimedGamma {
    [[nodiscard]] std::size_t next_gamma() const { return 2; }
    [[nodiscard]] bool continue_drafting(double, std::size_t) const { return true; }
    void observe(const specdec::StepFeedback&) {}
    [[nodiscard]] bool needs_timing() const { return true; }
  };
  ScriptedModel<float> target;
  ScriptedModel<float> draft;
  std::size_t reads = 0;
  std::size_t fail_at = std::numeric_limits<std::size_t>::max();
  specdec::DecoderOptions options;
  options.gamma_policy = TimedGamma{};
  options.clock = [&reads, &fail_at] {
    if (++reads == fail_at) throw clock_failure{};
    return static_cast<double>(reads);
  };
  specdec::SpeculativeDecoder decoder(target, draft, options);
  const auto reference = decoder.generate(prompt, 12, std::uint64_t{6});
  REQUIRE(reference.tokens.size() == 12);
  REQUIRE(reads >= 9);  // at least three steps
  decoder.reset_statistics();
  reads = 0;
  fail_at = 9;  // the last read of the third step, after its verification
  CHECK_THROWS_AS(decoder.generate(prompt, 12, std::uint64_t{6}), clock_failure);
  // Two steps completed: their tokens are kept (a prefix of the reference), the third
  // emitted nothing and is not counted.
  const std::vector<token_id> kept(decoder.generated().begin(), decoder.generated().end());
  CHECK(decoder.statistics().steps == 2);
  CHECK(kept.size() == decoder.statistics().emitted_tokens);
  REQUIRE_FALSE(kept.empty());
  CHECK(std::equal(kept.begin(), kept.end(), reference.tokens.begin()));
  // The decoder stays usable.
  fail_at = std::numeric_limits<std::size_t>::max();
  CHECK(decoder.generate(prompt, 12, std::uint64_t{6}).tokens == reference.tokens);
}

// --- gamma policies -----------------------------------------------------------------------

TEST_CASE("P1 FixedGamma: gamma = 0", "[errors][gamma_policy]") {
  check_error(
      "P1", [] { specdec::FixedGamma gamma(0); }, errc::invalid_option,
      "FixedGamma: gamma must be >= 1");
}

TEST_CASE("P2 AdditiveGamma: bounds not ordered 1 <= min_gamma <= initial <= max_gamma",
          "[errors][gamma_policy]") {
  for (const auto& options :
       {specdec::AdditiveGammaOptions{.initial = 4, .min_gamma = 0},
        specdec::AdditiveGammaOptions{.initial = 1, .min_gamma = 2},
        specdec::AdditiveGammaOptions{.initial = 20, .max_gamma = 16},
        specdec::AdditiveGammaOptions{.initial = 4, .min_gamma = 8, .max_gamma = 6}}) {
    check_error(
        "P2", [&] { specdec::AdditiveGamma gamma(options); }, errc::invalid_option,
        "AdditiveGamma: need 1 <= min_gamma <= initial <= max_gamma");
  }
}

TEST_CASE("P3 ConfidenceStop: threshold outside 0..1", "[errors][gamma_policy]") {
  for (const double threshold : {-0.1, 1.5, not_a_number}) {
    check_error(
        "P3", [&] { specdec::ConfidenceStop stop(threshold, std::size_t{4}); },
        errc::invalid_option, "ConfidenceStop: threshold ");
  }
}

TEST_CASE("P4 OptimalGammaController: option out of range", "[errors][gamma_policy]") {
  const auto check = [](specdec::OptimalGammaOptions options, const char* fragment) {
    check_error(
        "P4", [&] { specdec::OptimalGammaController controller(options); }, errc::invalid_option,
        fragment);
  };
  check({.max_gamma = 0}, "OptimalGammaController: max_gamma = 0 must be >= 1");
  check({.prior_alpha = 1.5}, "prior_alpha = 1.5 must be in [0, 1]");
  check({.prior_alpha = not_a_number}, "prior_alpha");
  check({.prior_trials = -1.0}, "prior_trials = -1 must be finite and >= 0");
  check({.prior_trials = infinity}, "prior_trials");
  check({.forgetting = 0.0}, "forgetting = 0 must be in (0, 1]");
  check({.forgetting = 1.5}, "forgetting");
  check({.cost_ratio = -0.5}, "cost_ratio");
  check({.cost_ratio = infinity}, "cost_ratio");
}

TEST_CASE("D26 SpeculativeDecoder: verification = block with lenience < 1",
          "[errors][speculative_decoder]") {
  auto target = specdec::testing::make_markov_target(4, 1, 1);
  auto draft = specdec::testing::make_markov_draft(target, 2);
  specdec::DecoderOptions lenient{.lenience = 0.5};
  lenient.verification = specdec::verification_rule::block;
  check_error(
      "D26", [&] { specdec::SpeculativeDecoder decoder(target, draft, lenient); },
      errc::invalid_option,
      "decoder option verification = block needs lenience = 1 (block verification is defined "
      "for exact sampling), not 0.5");
  lenient.verification = specdec::verification_rule::automatic;  // Algorithm 1, lenient
  CHECK_NOTHROW(specdec::SpeculativeDecoder(target, draft, lenient));
  // Trees take the path-level rule too (traversal verification): no error.
  specdec::DecoderOptions tree{.tree_shape = specdec::TreeShape::branching({2, 2})};
  tree.verification = specdec::verification_rule::block;
  CHECK_NOTHROW(specdec::SpeculativeDecoder(target, draft, tree));
}
