// specdec — the draft stage of the batch decoder (batch_decoder.hpp): this step's drafts
// for every active sequence, laid out as the ragged batch BatchVerifier reads (the drafts of
// sequence b at offsets[b]..offsets[b + 1], one draft row per model draft in the same
// order). A draft LanguageModel is called per sequence and token; a BatchDraftModel once
// per draft position for every sequence still drafting; a ProposalDrafter once per sequence
// (its proposals checked by keep_proposals, draft_stage.hpp). Each sequence samples its
// drafts from its rows standardized by its options with its own draft stream, so its drafts
// are the same whichever way the model is called. A sequence's own draft failure fails it
// alone; a failing draft_batch call fails the step.
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "specdec/batch_sequence.hpp"
#include "specdec/batch_verification.hpp"
#include "specdec/concepts.hpp"
#include "specdec/draft_stage.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"

namespace specdec {

/// The batch decoder's draft stage for a draft of type Draft (T: the target's scalar type).
template <class Draft, class T>
class BatchDraftStage {
 public:
  BatchDraftStage(Draft& model, std::size_t vocab_size) : model_(&model), vocab_size_(vocab_size) {}

  /// Drafts up to gammas[b] tokens for each sequence b (step `step_number` of the batch).
  /// Throws only for a failing draft_batch call (every context restored); a sequence's own
  /// failure is left in its `failure`.
  void draft(std::vector<detail::BatchSequence<T>>& sequences, std::span<const std::size_t> gammas,
             std::size_t step_number) {
    sequences_ = &sequences;
    gammas_ = gammas;
    step_number_ = step_number;
    draft_all();
  }

  /// The step's drafts, their offsets per sequence (B + 1) and their rows (model drafts).
  [[nodiscard]] std::span<const token_id> tokens() const noexcept { return draft_tokens_; }
  [[nodiscard]] std::span<const std::size_t> offsets() const noexcept { return offsets_; }
  [[nodiscard]] RowsView<const T> rows() const noexcept {
    return {draft_rows_.data(), LanguageModel<Draft> ? draft_tokens_.size() : 0, vocab_size_};
  }

 private:
  // Drafts for every sequence into draft_tokens_ / draft_rows_ (one row per model draft)
  // and offsets_. A draft model that throws, or a drafter's bad proposal, fails only that
  // sequence (its drafts are dropped; it leaves the batch after this step).
  void draft_all() {
    offsets_.assign(1, 0);
    draft_tokens_.clear();
    draft_rows_.clear();
    if constexpr (BatchDraftModel<Draft>) {
      draft_batched();
      return;
    }
    for (std::size_t b = 0; b < (*sequences_).size(); ++b) {
      detail::BatchSequence<T>& sequence = (*sequences_)[b];
      sequence.failure = nullptr;
      const std::size_t gamma = gammas_[b];
      const std::size_t base = sequence.context.size();
      std::size_t drafted = 0;
      try {
        drafted = draft_one(sequence, gamma);
      } catch (...) {
        sequence.failure = wrap_failure(sequence);
        draft_call_ = false;
        draft_rows_.resize(draft_tokens_.size() * vocab_size_);
      }
      draft_tokens_.insert(draft_tokens_.end(),
                           sequence.context.begin() + static_cast<std::ptrdiff_t>(base),
                           sequence.context.begin() + static_cast<std::ptrdiff_t>(base + drafted));
      sequence.context.resize(base);
      offsets_.push_back(draft_tokens_.size());
    }
  }

  // The draft stage's one step, shared by both drafting paths: copies draft row i of
  // `sequence` into draft_rows_ at entry `at`, samples the draft from it standardized by the
  // sequence's options with its draft stream `g`, appends it to the context, and returns
  // whether drafting goes on (not a stop token, and the policy wants draft i + 2 of `gamma`).
  template <class Row>
  bool take_draft(detail::BatchSequence<T>& sequence, const Row& row, std::size_t at,
                  xoshiro256pp& g, std::size_t i, std::size_t gamma) {
    std::transform(row.begin(), row.end(), draft_rows_.begin() + static_cast<std::ptrdiff_t>(at),
                   [](auto value) { return static_cast<T>(value); });
    const AnyGammaPolicy& policy = sequence.request.gamma_policy;
    double top_probability = 1.0;
    const token_id drafted = sample_standardized(
        sequence.standardizer, std::span<const T>(draft_rows_.data() + at, vocab_size_),
        std::span<T>(scratch_), g, policy.needs_top_probability() ? &top_probability : nullptr);
    sequence.context.push_back(drafted);
    return !is_stop(sequence, drafted) &&
           (i + 1 >= gamma || policy.continue_drafting(top_probability, i + 1));
  }

  // Drafting with a BatchDraftModel: position i of every sequence still drafting in one
  // draft_batch call, for i = 0, 1, ... Each sequence's drafts are sampled with its own
  // draft stream exactly as one at a time, so its tokens are the same either way. Rows go
  // to draft_rows_ at slots reserved for gamma_b rows per sequence, compacted at the end. A
  // failing call throws errc::model_failure from step() with every context restored.
  void draft_batched() {
    const std::size_t sequences = (*sequences_).size();
    slots_.assign(sequences + 1, 0);
    for (std::size_t b = 0; b < sequences; ++b) {
      detail::BatchSequence<T>& sequence = (*sequences_)[b];
      sequence.failure = nullptr;
      sequence.base = sequence.context.size();
      sequence.goal = gammas_[b];
      sequence.draft_stream =
          stream_engine({sequence.request.seed, sequence.request.id, sequence.result.steps},
                        stream_purpose::draft);
      slots_[b + 1] = slots_[b] + sequence.goal;
    }
    draft_rows_.resize(slots_[sequences] * vocab_size_);
    scratch_.resize(vocab_size_);
    try {
      for (std::size_t i = 0;; ++i) {
        requests_.clear();
        drafting_.clear();
        for (std::size_t b = 0; b < sequences; ++b) {
          detail::BatchSequence<T>& sequence = (*sequences_)[b];
          if (i >= sequence.goal) continue;
          requests_.push_back(
              {std::span<const token_id>(sequence.context.data(), sequence.base),
               std::span<const token_id>(sequence.context.data() + sequence.base, i),
               sequence.request.id});
          drafting_.push_back(b);
        }
        if (requests_.empty()) break;
        draft_call_ = true;
        auto&& returned = model_->draft_batch(std::span<const BatchScoreRequest>(requests_));
        draft_call_ = false;
        const auto rows = as_rows(returned);
        if (rows.rows() != requests_.size() || rows.cols() != vocab_size_) {
          detail::throw_error(errc::invalid_size, "batch step ", step_number_,
                              ": the draft model's draft_batch returned ", rows.rows(), " x ",
                              rows.cols(), " entries, expected ", requests_.size(), " x ",
                              vocab_size_);
        }
        for (std::size_t k = 0; k < drafting_.size(); ++k) {
          detail::BatchSequence<T>& sequence = (*sequences_)[drafting_[k]];
          const std::size_t at = (slots_[drafting_[k]] + i) * vocab_size_;
          if (!take_draft(sequence, rows.row(k), at, sequence.draft_stream, i, sequence.goal)) {
            sequence.goal = i + 1;  // drafting ends here
          }
        }
      }
    } catch (...) {
      const bool model = draft_call_;
      draft_call_ = false;
      for (detail::BatchSequence<T>& sequence : (*sequences_))
        sequence.context.resize(sequence.base);
      if (!model) throw;
      try {
        throw;
      } catch (const std::exception& e) {
        std::throw_with_nested(error(
            errc::model_failure,
            "batch step " + std::to_string(step_number_) + ": the draft model threw: " + e.what()));
      } catch (...) {
        std::throw_with_nested(
            error(errc::model_failure, "batch step " + std::to_string(step_number_) +
                                           ": the draft model threw a non-std exception"));
      }
    }
    // Compact: sequence b's rows from slot slots_[b] to the batch layout (rows only move
    // towards the front).
    std::size_t row = 0;
    for (std::size_t b = 0; b < sequences; ++b) {
      detail::BatchSequence<T>& sequence = (*sequences_)[b];
      const std::size_t drafted = sequence.context.size() - sequence.base;
      if (row != slots_[b]) {
        std::copy_n(draft_rows_.begin() + static_cast<std::ptrdiff_t>(slots_[b] * vocab_size_),
                    drafted * vocab_size_,
                    draft_rows_.begin() + static_cast<std::ptrdiff_t>(row * vocab_size_));
      }
      row += drafted;
      draft_tokens_.insert(draft_tokens_.end(),
                           sequence.context.begin() + static_cast<std::ptrdiff_t>(sequence.base),
                           sequence.context.end());
      sequence.context.resize(sequence.base);
      offsets_.push_back(draft_tokens_.size());
    }
    draft_rows_.resize(row * vocab_size_);
  }

  // Appends up to `gamma` drafts to sequence.context (and, for a draft model, their rows to
  // draft_rows_); returns how many.
  std::size_t draft_one(detail::BatchSequence<T>& sequence, std::size_t gamma) {
    if (gamma == 0) return 0;
    const std::size_t base = sequence.context.size();
    if constexpr (LanguageModel<Draft>) {
      const StreamKey key{sequence.request.seed, sequence.request.id, sequence.result.steps};
      xoshiro256pp g = stream_engine(key, stream_purpose::draft);
      scratch_.resize(vocab_size_);
      for (std::size_t i = 0; i < gamma; ++i) {
        draft_call_ = true;
        auto&& returned = model_->next_token_probabilities(
            std::span<const token_id>(sequence.context.data(), sequence.context.size()));
        draft_call_ = false;
        const auto row = as_span(returned);
        if (row.size() != vocab_size_) {
          detail::throw_error(errc::invalid_size, "draft row ", i, ": has ", row.size(),
                              " entries, expected the vocabulary size ", vocab_size_);
        }
        const std::size_t at = draft_rows_.size();
        draft_rows_.resize(at + vocab_size_);
        if (!take_draft(sequence, row, at, g, i, gamma)) break;
      }
    } else {
      sequence.context.resize(base + gamma);
      draft_call_ = true;
      const auto proposed = static_cast<std::size_t>(
          model_->propose(std::span<const token_id>(sequence.context.data(), base),
                          std::span<token_id>(sequence.context.data() + base, gamma)));
      draft_call_ = false;
      const std::size_t kept = keep_proposals(
          std::span<const token_id>(sequence.context).subspan(base), proposed, gamma, vocab_size_,
          sequence.stops, sequence.request.gamma_policy,
          [&] {
            detail::throw_error(errc::invalid_size, "the drafter proposed ", proposed,
                                " tokens, more than the ", gamma, " asked for");
          },
          [this](std::size_t i, token_id token) {
            detail::throw_error(errc::invalid_token, "draft token at position ", i, ": id ", token,
                                " is outside [0, ", vocab_size_, ")");
          });
      sequence.context.resize(base + kept);
    }
    return sequence.context.size() - base;
  }

  [[nodiscard]] static bool is_stop(const detail::BatchSequence<T>& sequence,
                                    token_id token) noexcept {
    return sequence.stops.is_stop_token(token);
  }

  // The error that fails a sequence (called inside a catch handler): a specdec::error
  // naming it; a model's own exception is nested inside an errc::model_failure.
  std::exception_ptr wrap_failure(const detail::BatchSequence<T>& sequence) const {
    try {
      try {
        throw;
      } catch (const error& e) {
        if (!draft_call_) throw error(e.code(), sequence.name() + ": " + detail::bare_message(e));
        std::throw_with_nested(
            error(errc::model_failure, sequence.name() + ": the draft model threw: " + e.what()));
      } catch (const std::exception& e) {
        std::throw_with_nested(
            error(errc::model_failure, sequence.name() + ": the draft model threw: " + e.what()));
      } catch (...) {
        std::throw_with_nested(error(
            errc::model_failure, sequence.name() + ": the draft model threw a non-std exception"));
      }
    } catch (...) {
      return std::current_exception();
    }
  }

  Draft* model_;
  std::size_t vocab_size_;
  std::vector<detail::BatchSequence<T>>* sequences_ = nullptr;  // during draft()
  std::span<const std::size_t> gammas_;                         // during draft()
  std::size_t step_number_ = 0;                                 // during draft()
  std::vector<std::size_t> offsets_;
  std::vector<token_id> draft_tokens_;
  std::vector<T> draft_rows_;
  std::vector<T> scratch_;
  std::vector<BatchScoreRequest> requests_;
  std::vector<std::size_t> slots_;     // batched drafting: first row slot of each sequence
  std::vector<std::size_t> drafting_;  // batched drafting: sequences in this draft call
  bool draft_call_ = false;            // inside a draft model call (its exceptions are the model's)
};

}  // namespace specdec
