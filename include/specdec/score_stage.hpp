// specdec — the score stage of a decoding step: the target's rows p_1..p_{gamma+1} for the
// drafted prefixes. A BatchedLanguageModel target scores all of them in ONE score_draft
// call; any other target is called once per prefix. Target rows get the same
// standardization as the draft's rows. A batched target's rows are used in place where the
// standardization is the identity (or greedy) and their scalar type is the step's; else each
// is standardized (or copied) into the stage when verification first reads it, so rows after
// the first rejection cost nothing and are never checked, as when they are used in place.
// Per-prefix rows are loaded as they come (a model's view dies at its next call). With top-k
// truncation rows are kept as their survivors (SurvivorRows). With top-p alone at T = 1, a
// batched target's rows of the step's scalar type are read in place where the stage is asked
// to (`nucleus_in_place`): loading such a row finds its nucleus (Standardizer::apply's first
// pass and band) and keeps the row's bounds and scale (nucleus_rows), instead of writing it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/function_ref.hpp"
#include "specdec/error.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/step_checks.hpp"
#include "specdec/step_rows.hpp"

namespace specdec {

/// One step's target rows (T is the target's scalar type).
template <class T>
class ScoreStage {
 public:
  /// Whether a target of type Model has its rows used in place under `sampling`: batched,
  /// of scalar type T, and standardized by the identity (or greedy decoding).
  template <class Model>
  [[nodiscard]] static bool in_place(const SamplingOptions& sampling) noexcept {
    if constexpr (BatchedLanguageModel<Model>) {
      using scored = typename decltype(as_rows(std::declval<Model&>().score_draft(
          std::span<const token_id>(), std::span<const token_id>())))::value_type;
      if constexpr (std::is_same_v<scored, T>) return sampling.identity() || sampling.greedy();
    }
    return false;
  }

  /// Room for `rows` rows of V entries: survivors of `width` when `sparse`, else dense
  /// copies unless the rows are used in place. `nucleus_in_place`: a batched target's top-p
  /// rows at T = 1 may be read in place (the verifier then reads nucleus_rows()).
  void resize(std::size_t rows, std::size_t vocab_size, bool sparse, std::size_t width,
              bool in_place_rows, bool nucleus_in_place = false) {
    vocab_size_ = vocab_size;
    sparse_ = sparse;
    views_.resize(nucleus_in_place ? rows : 0);
    if (sparse) {
      survivors_.resize(rows, width);
      scratch_.resize(vocab_size);
    } else if (!in_place_rows) {
      rows_.resize(rows * vocab_size);
    }
  }

  /// Scores context + drafts[0..i) for i = 0..drafts.size() and hands the rows to
  /// `verify(rows, in_place, load_through)`: `rows` are the model's own rows (`in_place`:
  /// not yet validated, so the passes that read them screen them) or the stage's dense rows
  /// (in sparse mode read survivors(i) instead); `load_through(i)` (a detail::row_loader) must be
  /// called before any read of row i. `calls` counts the target calls.
  template <class Model, class Verify>
  void score(Model& target, std::span<const token_id> context, std::span<const token_id> drafts,
             Standardizer<T>& standardizer, const StepChecks& checks, std::size_t& calls,
             Verify&& verify) {
    const std::size_t count = drafts.size() + 1;
    const auto loaded_already = [](std::size_t) {};
    for (auto& view : views_) view.row = nullptr;  // no view of an earlier step's rows
    // Empty where rows are used in place or kept as survivors.
    const RowsView<const T> stage_rows(rows_.data(), rows_.empty() ? 0 : count, vocab_size_);
    if constexpr (BatchedLanguageModel<Model>) {
      auto&& scored = checks.call_model(
          "target", 0, [&]() -> decltype(auto) { return target.score_draft(context, drafts); });
      calls = 1;
      const auto rows = as_rows(scored);
      using scored_scalar = typename std::remove_cvref_t<decltype(rows)>::value_type;
      if (rows.rows() != count || rows.cols() != vocab_size_) {
        checks.fail(errc::invalid_size,
                    checks.describe_block("target", count) + ": score_draft returned " +
                        std::to_string(rows.rows()) + " x " + std::to_string(rows.cols()) +
                        ", expected " + std::to_string(count) + " x " +
                        std::to_string(vocab_size_));
      }
      if constexpr (std::is_same_v<scored_scalar, T>) {
        if (in_place<Model>(standardizer.options())) {
          verify(rows, true, detail::row_loader(loaded_already));
          return;
        }
      }
      // Lazily: the scored block outlives the verification (so rows read in place do too).
      std::size_t loaded = 0;
      const auto load_through = [&](std::size_t i) {
        for (; loaded <= i; ++loaded) {
          load(std::span<const scored_scalar>(rows.row(loaded)), loaded, standardizer, checks,
               !views_.empty());
        }
      };
      verify(stage_rows, false, detail::row_loader(load_through));
    } else {
      for (std::size_t i = 0; i < count; ++i) {
        const std::span<const token_id> prefix(context.data(), context.size() + i);
        auto&& returned = checks.call_model("target", i, [&]() -> decltype(auto) {
          return target.next_token_probabilities(prefix);
        });
        ++calls;
        load(as_span(returned), i, standardizer, checks, false);  // the view dies
      }
      verify(stage_rows, false, detail::row_loader(loaded_already));
    }
  }

  /// Row i's survivors (sparse mode).
  [[nodiscard]] detail::sparse_row<T> survivors(std::size_t i) const noexcept {
    return survivors_[i];
  }

  /// The rows of the last score() read in place (nucleus_in_place): row i's view once it is
  /// loaded, null where the stage wrote it.
  [[nodiscard]] nucleus_rows<T> nucleus() const noexcept {
    return {views_.empty() ? nullptr : views_.data()};
  }

 private:
  // Checks and copies (greedy, identity) or standardizes a target row into the stage
  // (sparse: its survivors, validated inside the selection pass).
  template <class U>
  void load(std::span<const U> row, std::size_t i, Standardizer<T>& standardizer,
            const StepChecks& checks, bool nucleus_in_place) {
    if (sparse_) {
      double unused = 0.0;
      (void)survivors_.load(row, i, standardizer, std::span<T>(scratch_), checks, "target", unused);
      return;
    }
    const std::span<T> destination(rows_.data() + i * vocab_size_, vocab_size_);
    const SamplingOptions& sampling = standardizer.options();
    if (sampling.greedy() || sampling.identity()) {
      checks.check_row(row, "target", i);
      std::transform(row.begin(), row.end(), destination.begin(),
                     [](U value) { return static_cast<T>(value); });
    } else if constexpr (std::is_same_v<U, T>) {
      if (nucleus_in_place) {
        // Top-p alone at T = 1 leaves the nucleus's write to its caller (apply's `deferred`):
        // the row is then read through its view.
        detail::nucleus_keep_hook<T, T> keep;
        (void)standardize_checked(standardizer, row, destination, checks, "target", i, &keep);
        if (keep.out != nullptr) views_[i] = {keep.key, keep.last_key, keep.last, keep.scale};
      } else {
        (void)standardize_checked(standardizer, row, destination, checks, "target", i);
      }
    } else {
      (void)standardize_checked(standardizer, row, destination, checks, "target", i);
    }
  }

  std::size_t vocab_size_ = 0;
  bool sparse_ = false;
  std::vector<T> rows_;  // p_1..p_{gamma+1} when not used in place
  SurvivorRows<T> survivors_;
  std::vector<T> scratch_;  // V entries: apply_sparse's scratch
  // Rows read in place (row null: written); empty unless resize asked for them.
  std::vector<detail::nucleus_view<T>> views_;
};

}  // namespace specdec
