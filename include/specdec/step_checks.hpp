// specdec — the checks of a decoding step, and how its errors are located: every row a
// step reads is named by the model it came from, the step, its row within the step and the
// sequence position it predicts ("draft row 2 (step 7, sequence position 45): ..."), and
// anything a model throws becomes a decoding_error naming the same place with the model's
// exception nested. The draft, score and verify stages (draft_stage.hpp, score_stage.hpp,
// verify_stage.hpp) report through one StepChecks, which the decoder points at each step.
#pragma once

#include <cstddef>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/decoder_kernels.hpp"
#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/validation.hpp"

namespace specdec {

template <LanguageModel TargetModel, Drafter DraftModel>
class SpeculativeDecoder;

/// Thrown by a decoder when a model misbehaves: a row of the wrong size, NaN/Inf/negative
/// entries, zero mass or a bad sum (the errc of validation.hpp), an invalid proposed token
/// (invalid_token), or a model that threw (model_failure; the model's exception is nested:
/// std::rethrow_if_nested). The message names the model (target or draft), the step, the
/// row within the step and the sequence position the row predicts.
///
/// tokens() holds the tokens generate() had emitted before the failing step (empty when
/// thrown from step(): a failed step emits nothing). The decoder stays usable; the failed
/// step changes neither the statistics nor the gamma policy.
class decoding_error : public error {
 public:
  decoding_error(errc code, const std::string& message, std::size_t step)
      : error(code, message), step_(step) {}

  [[nodiscard]] std::span<const token_id> tokens() const noexcept { return tokens_; }
  [[nodiscard]] std::size_t step() const noexcept { return step_; }

 private:
  template <LanguageModel TargetModel, Drafter DraftModel>
  friend class SpeculativeDecoder;
  std::vector<token_id> tokens_;
  std::size_t step_;
};

namespace detail {

/// What GuardedModel throws when the model it wraps throws: the model's own exception.
struct guarded_model_failure {
  std::string_view model;  ///< "target" or "draft"
  std::exception_ptr original;
};

}  // namespace detail

/// The checks of one decoder's steps and the location of their errors. `validate_rows` and
/// `greedy` are the decoder's options: greedy steps validate inside their argmax scans
/// (reject_greedy_row), so check_row checks only sizes there. begin() points it at a step.
class StepChecks {
 public:
  StepChecks(std::size_t vocab_size, bool validate_rows, bool greedy) noexcept
      : vocab_size_(vocab_size), validate_rows_(validate_rows), greedy_(greedy) {}

  /// The step now running: its index and the context length at its start.
  void begin(std::size_t step, std::size_t base_length) noexcept {
    step_ = step;
    base_length_ = base_length;
  }
  [[nodiscard]] std::size_t step() const noexcept { return step_; }
  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_size_; }
  [[nodiscard]] bool validate_rows() const noexcept { return validate_rows_; }

  [[noreturn]] void fail(errc code, const std::string& message) const {
    throw decoding_error(code, message, step_);
  }

  /// Every id of a prompt (generate) or context (step) must lie in [0, V): the models are
  /// never given an id outside their vocabulary. Throws invalid_token naming the position.
  void check_context(std::span<const token_id> context, std::string_view what,
                     std::size_t step) const {
    for (std::size_t i = 0; i < context.size(); ++i) {
      const token_id id = context[i];
      if (id < 0 || static_cast<std::size_t>(id) >= vocab_size_) {
        throw decoding_error(errc::invalid_token,
                             std::string(what) + " token at position " + std::to_string(i) +
                                 ": id " + std::to_string(id) + " is outside [0, " +
                                 std::to_string(vocab_size_) + ")",
                             step);
      }
    }
  }

  /// Runs a model call; any exception becomes a decoding_error (model_failure) naming the
  /// model, step, row and position, with the original exception nested.
  template <class Call>
  decltype(auto) call_model(std::string_view model, std::size_t row, Call&& call) const {
    try {
      return std::forward<Call>(call)();
    } catch (const std::exception& e) {
      std::throw_with_nested(decoding_error(
          errc::model_failure, describe(model, row) + ": the model threw: " + e.what(), step_));
    } catch (...) {
      std::throw_with_nested(
          decoding_error(errc::model_failure,
                         describe(model, row) + ": the model threw a non-std exception", step_));
    }
  }

  /// Runs a tree step: its specdec::error keeps its code under the tree step's location;
  /// what a model threw (detail::guarded_model_failure) becomes model_failure with the
  /// model's exception nested.
  template <class Call>
  decltype(auto) call_tree(Call&& call) const {
    try {
      return std::forward<Call>(call)();
    } catch (const error& e) {
      fail(e.code(), tree_location() + ": " + detail::bare_message(e));
    } catch (const detail::guarded_model_failure& failure) {
      // Rethrown so that the model's exception is nested in the decoding_error.
      const std::string model(failure.model);
      try {
        std::rethrow_exception(failure.original);
      } catch (const std::exception& e) {
        std::throw_with_nested(decoding_error(
            errc::model_failure, tree_location() + ": the " + model + " model threw: " + e.what(),
            step_));
      } catch (...) {
        std::throw_with_nested(decoding_error(
            errc::model_failure,
            tree_location() + ": the " + model + " model threw a non-std exception", step_));
      }
    }
  }

  /// "draft row 2 (step 7, sequence position 45)"
  [[nodiscard]] std::string describe(std::string_view model, std::size_t row) const {
    std::string text(model);
    text += " row ";
    text += std::to_string(row);
    text += " (step ";
    text += std::to_string(step_);
    text += ", sequence position ";
    text += std::to_string(base_length_ + row);
    text += ')';
    return text;
  }

  /// A block of `count` rows from one call, as describe() names one row:
  /// "target rows 0..3 (step 7, sequence positions 45..48)"; describe(model, 0) for one row.
  [[nodiscard]] std::string describe_block(std::string_view model, std::size_t count) const {
    if (count == 1) return describe(model, 0);
    std::string text(model);
    text += " rows 0..";
    text += std::to_string(count - 1);
    text += " (step ";
    text += std::to_string(step_);
    text += ", sequence positions ";
    text += std::to_string(base_length_);
    text += "..";
    text += std::to_string(base_length_ + count - 1);
    text += ')';
    return text;
  }

  /// "tree step 7 (sequence position 45)"
  [[nodiscard]] std::string tree_location() const {
    return "tree step " + std::to_string(step_) + " (sequence position " +
           std::to_string(base_length_) + ")";
  }

  template <class U>
  void check_size(std::span<const U> row, std::string_view model, std::size_t index) const {
    if (row.size() != vocab_size_) {
      fail(errc::invalid_size, describe(model, index) + ": has " + std::to_string(row.size()) +
                                   " entries, expected the vocabulary size " +
                                   std::to_string(vocab_size_));
    }
  }

  /// Size check (always) and full validation (validate_rows) of one model row, for rows the
  /// step reads whole before using them (standardized or copied). Greedy decoding validates
  /// inside its argmax scans (reject_greedy_row); rows read by the fused passes are screened
  /// there (check_screen).
  template <class U>
  void check_row(std::span<const U> row, std::string_view model, std::size_t index) const {
    check_size(row, model, index);
    if (!validate_rows_ || greedy_) return;
    if (!detail::plausible_probability_row(row.data(), row.size(), default_sum_tolerance<U>)) {
      reject_probability_row(row, model, index);
    }
  }

  /// The verdict of a screen fused into a pass over a row: an implausible row goes to the
  /// full validator, which names the problem (or accepts the row: -0.0 entries, a sum at the
  /// edge of the tolerance).
  template <class U>
  void check_screen(const detail::row_screen<U>& screen, std::span<const U> row,
                    std::string_view model, std::size_t index) const {
    if (!screen.plausible(default_sum_tolerance<U>)) reject_probability_row(row, model, index);
  }

  template <class U>
  void reject_probability_row(std::span<const U> row, std::string_view model,
                              std::size_t index) const {
    reject_row(row, model, index, [this](std::span<const U> r, const RowLocation& where) {
      validate_probability_row(r, vocab_size_, where);
    });
  }

  /// Greedy decoding's validation failed on a row (its argmax scan met a NaN or negative
  /// entry, an infinite maximum or an all-zero row): throws the error validate_greedy_row
  /// names, located like every row error.
  template <class U>
  [[noreturn]] void reject_greedy_row(std::span<const U> row, std::string_view model,
                                      std::size_t index) const {
    reject_row(row, model, index, [this](std::span<const U> r, const RowLocation& where) {
      validate_greedy_row(r, vocab_size_, where);
    });
    fail(errc::invalid_probability, describe(model, index) + ": rejected by the greedy scan");
  }

 private:
  // Runs `validator` on a row known or suspected to be bad and rethrows its error with the
  // step's location ("<model> row i (step s, sequence position k): ...").
  template <class U, class Validator>
  void reject_row(std::span<const U> row, std::string_view model, std::size_t index,
                  Validator&& validator) const {
    const RowLocation where{model, step_, index};
    try {
      validator(row, where);
    } catch (const error& e) {
      // Same layout as the size errors: "<model> row i (step s, sequence position k): ..."
      std::string problem = detail::bare_message(e);
      const std::string prefix = detail::describe_location(where, "row") + ": ";
      if (problem.starts_with(prefix)) problem.erase(0, prefix.size());
      fail(e.code(), describe(model, index) + ": " + problem);
    }
  }

  std::size_t vocab_size_;
  bool validate_rows_;
  bool greedy_;
  std::size_t step_ = 0;
  std::size_t base_length_ = 0;
};

}  // namespace specdec
