// specdec — the score stage of the batch decoder (batch_decoder.hpp): the target's rows for
// every drafted prefix of every active sequence, in the ragged batch's layout (sequence b's
// rows at offsets[b] + b). A BatchScoringModel scores all of them in ONE score_batch call;
// without it, a BatchedLanguageModel is called once per sequence (score_draft) and any other
// target once per prefix. Rows of the target's scalar type from score_batch are verified in
// place (the call's result lives through the verification); other rows are copied into the
// stage. A failing call or a misshapen result throws (errc::model_failure with the model's
// exception nested, errc::invalid_size) before any sequence changes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/batch_sequence.hpp"
#include "specdec/concepts.hpp"
#include "specdec/error.hpp"
#include "specdec/rows.hpp"

namespace specdec {

/// The batch decoder's score stage for a target of type Target (T: its scalar type).
template <class Target, class T>
class BatchScoreStage {
 public:
  BatchScoreStage(Target& model, std::size_t vocab_size)
      : model_(&model), vocab_size_(vocab_size) {}

  /// Scores the drafted prefixes of `sequences` (drafts at offsets[b]..offsets[b + 1]) in
  /// step `step_number` of the batch and returns verify(rows) (the batch's rows). `calls`
  /// counts the target calls.
  template <class Verify>
  std::size_t score(const std::vector<detail::BatchSequence<T>>& sequences,
                    std::span<const token_id> drafts, std::span<const std::size_t> offsets,
                    std::size_t step_number, std::size_t& calls, Verify&& verify) {
    step_number_ = step_number;
    const std::size_t rows = drafts.size() + sequences.size();
    const auto drafts_of = [&](std::size_t b) {
      return drafts.subspan(offsets[b], offsets[b + 1] - offsets[b]);
    };
    if constexpr (BatchScoringModel<Target>) {
      requests_.clear();
      for (std::size_t b = 0; b < sequences.size(); ++b) {
        requests_.push_back({std::span<const token_id>(sequences[b].context), drafts_of(b),
                             sequences[b].request.id});
      }
      auto&& returned = call_target([&]() -> decltype(auto) {
        return model_->score_batch(std::span<const BatchScoreRequest>(requests_));
      });
      ++calls;
      const auto scored = as_rows(returned);
      check_shape(scored, rows, "score_batch");
      if constexpr (std::is_same_v<typename decltype(scored)::value_type, T>) {
        return verify(scored);
      } else {
        rows_.resize(rows * vocab_size_);
        copy_rows(scored, 0);
      }
    } else {
      rows_.resize(rows * vocab_size_);
      for (std::size_t b = 0; b < sequences.size(); ++b) {
        score_one(sequences[b].context, drafts_of(b), offsets[b] + b, calls);
      }
    }
    return verify(RowsView<const T>(rows_.data(), rows, vocab_size_));
  }

 private:
  // The rows of one sequence without batch scoring, from batch row `first` on: score_draft,
  // else one call per prefix.
  void score_one(std::span<const token_id> context, std::span<const token_id> drafts,
                 std::size_t first, std::size_t& calls) {
    if constexpr (BatchedLanguageModel<Target>) {
      auto&& returned =
          call_target([&]() -> decltype(auto) { return model_->score_draft(context, drafts); });
      ++calls;
      const auto scored = as_rows(returned);
      check_shape(scored, drafts.size() + 1, "score_draft");
      copy_rows(scored, first);
    } else {
      prefix_.assign(context.begin(), context.end());
      for (std::size_t i = 0; i <= drafts.size(); ++i) {
        if (i > 0) prefix_.push_back(drafts[i - 1]);
        auto&& returned = call_target([&]() -> decltype(auto) {
          return model_->next_token_probabilities(std::span<const token_id>(prefix_));
        });
        ++calls;
        const auto row = as_span(returned);
        const RowsView<const typename decltype(row)::value_type> scored(row.data(), 1, row.size());
        check_shape(scored, 1, "next_token_probabilities");
        copy_rows(scored, first + i);
      }
    }
  }

  // Calls the target, turning anything it throws into errc::model_failure with the
  // exception nested.
  template <class Call>
  decltype(auto) call_target(Call&& call) const {
    try {
      return std::forward<Call>(call)();
    } catch (const std::exception& e) {
      std::throw_with_nested(error(
          errc::model_failure,
          "batch step " + std::to_string(step_number_) + ": the target model threw: " + e.what()));
    } catch (...) {
      std::throw_with_nested(
          error(errc::model_failure, "batch step " + std::to_string(step_number_) +
                                         ": the target model threw a non-std exception"));
    }
  }

  template <class U>
  void check_shape(RowsView<U> rows, std::size_t count, std::string_view call) const {
    if (rows.rows() != count || rows.cols() != vocab_size_) {
      detail::throw_error(errc::invalid_size, "batch step ", step_number_, ": the target's ", call,
                          " returned ", rows.rows(), " x ", rows.cols(), " entries, expected ",
                          count, " x ", vocab_size_);
    }
  }

  // Copies rows (converted to T) into the stage from batch row `first` on.
  template <class U>
  void copy_rows(RowsView<U> rows, std::size_t first) {
    for (std::size_t i = 0; i < rows.rows(); ++i) {
      const auto row = rows.row(i);
      std::transform(row.begin(), row.end(),
                     rows_.begin() + static_cast<std::ptrdiff_t>((first + i) * vocab_size_),
                     [](auto value) { return static_cast<T>(value); });
    }
  }

  Target* model_;
  std::size_t vocab_size_;
  std::size_t step_number_ = 0;
  std::vector<T> rows_;  // rows copied from per-sequence or converted scoring
  std::vector<BatchScoreRequest> requests_;
  std::vector<token_id> prefix_;  // a prefix scored alone
};

}  // namespace specdec
