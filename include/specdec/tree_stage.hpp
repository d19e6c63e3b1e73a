// specdec — the tree step as a stage of SpeculativeDecoder (DecoderOptions::tree_shape):
// drafting a token tree of the decoder's shape from the standardized q rows (or a proposal
// tree from a MultiProposalDrafter), scoring it and verifying it exactly, in one tree_step
// (tree_verification.hpp). The tree code's own specdec::error keeps its code under the tree
// step's location; anything a model throws (a specdec::error too) becomes model_failure with
// the model's exception nested (StepChecks::call_tree), told apart by the guards below.
#pragma once

#include <cstddef>
#include <exception>
#include <span>
#include <string_view>
#include <utility>

#include "specdec/concepts.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/sampling.hpp"
#include "specdec/step_checks.hpp"
#include "specdec/tree_verification.hpp"

namespace specdec {

namespace detail {

/// Forwards every call to a model and turns anything the model throws into
/// guarded_model_failure, so that the tree code's own specdec::error (bad rows) and an
/// exception of the model (even a specdec::error) stay apart. Models the same concepts
/// (BatchedLanguageModel, TreeScoringModel) as the model it wraps; results are forwarded
/// unchanged (views stay views).
template <class M>
class GuardedModel {
 public:
  GuardedModel(M& model, std::string_view name) noexcept : model_(&model), name_(name) {}

  [[nodiscard]] decltype(auto) vocab_size() const {
    return guard([this]() -> decltype(auto) { return std::as_const(*model_).vocab_size(); });
  }
  decltype(auto) next_token_probabilities(std::span<const token_id> context) {
    return guard([&]() -> decltype(auto) { return model_->next_token_probabilities(context); });
  }
  decltype(auto) score_draft(std::span<const token_id> context,
                             std::span<const token_id> draft) requires HasDraftScoring<M> {
    return guard([&]() -> decltype(auto) { return model_->score_draft(context, draft); });
  }
  decltype(auto) score_tree(std::span<const token_id> context,
                            const TokenTreeView& tree) requires HasTreeScoring<M> {
    return guard([&]() -> decltype(auto) { return model_->score_tree(context, tree); });
  }

 private:
  template <class Call>
  decltype(auto) guard(Call&& call) const {
    try {
      return std::forward<Call>(call)();
    } catch (...) {
      throw guarded_model_failure{name_, std::current_exception()};
    }
  }

  M* model_;
  std::string_view name_;
};

/// GuardedModel for a proposal-only drafter (the "draft" model): forwards propose and
/// propose_many.
template <class D>
class GuardedProposalDrafter {
 public:
  explicit GuardedProposalDrafter(D& drafter) noexcept : drafter_(&drafter) {}

  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) {
    return guard([&] { return static_cast<std::size_t>(drafter_->propose(context, out)); });
  }
  std::size_t propose_many(std::span<const token_id> context, std::span<token_id> out,
                           std::span<std::size_t> lengths) requires HasProposeMany<D> {
    return guard(
        [&] { return static_cast<std::size_t>(drafter_->propose_many(context, out, lengths)); });
  }

 private:
  template <class Call>
  std::size_t guard(Call&& call) {
    try {
      return std::forward<Call>(call)();
    } catch (...) {
      throw guarded_model_failure{"draft", std::current_exception()};
    }
  }

  D* drafter_;
};

}  // namespace detail

/// One decoder's tree steps: the tree options (built once: a per-step copy of the shape
/// would allocate) and the workspace the steps reuse.
template <class T>
class TreeStage {
 public:
  TreeStage() = default;
  explicit TreeStage(const TreeOptions& options) : options_(options) {}

  /// Room for contexts of `length` tokens in the tree builders and the per-node fallback.
  void reserve(std::size_t length) {
    workspace_.drafting.sequence.reserve(length);
    workspace_.scoring.sequence.reserve(length);
  }

  /// One tree step after `context` (step `step` of the decoder), target and draft rows
  /// standardized by `standardizer` (greedy trees ignore it: top-k drafting, argmax of the
  /// raw rows). `draft` is a LanguageModel or a MultiProposalDrafter.
  template <class Target, class Draft, class G>
  TreeStepResult step(Target& target, Draft& draft, std::span<const token_id> context, G& g,
                      std::size_t step, Standardizer<T>& standardizer, const StepChecks& checks) {
    detail::GuardedModel<Target> guarded_target(target, "target");
    const auto standardize = [&standardizer](auto raw, std::span<T> out) {
      standardizer.apply(raw, out);
    };
    const auto run = [&](auto& guarded_draft) {
      return checks.call_tree([&] {
        return tree_step(guarded_target, guarded_draft, context, options_, g, workspace_, step,
                         standardize);
      });
    };
    if constexpr (drafts_from_rows<Draft>) {
      detail::GuardedModel<Draft> guarded_draft(draft, "draft");
      return run(guarded_draft);
    } else {
      detail::GuardedProposalDrafter<Draft> guarded_draft(draft);
      return run(guarded_draft);
    }
  }

 private:
  TreeOptions options_{};
  TreeStepWorkspace<T> workspace_;
};

}  // namespace specdec
