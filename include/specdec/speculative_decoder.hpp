// specdec — SpeculativeDecoder: the generation loop of speculative decoding (paper Sec. 2.3,
// Algorithm 1 applied step after step), with standardized sampling on both sides, stop
// conditions, statistics, streaming, and a step-wise API for engines with their own loop.
//
// One step (DESIGN.md "One decoding step"):
//  1. gamma = gamma_policy.next_gamma(). A step emits up to gamma + 1 tokens; what would pass
//     max_new_tokens is dropped (a prefix of an exact sample is exact), never emitted.
//  2. Drafting, from any Drafter (concepts.hpp). A LanguageModel draft is adapted here: it
//     is called once per token on context + x_1..x_{i-1}; its row is standardized
//     (sampling.hpp) into the decoder's workspace (at T = 1: copied, its normaliser kept as
//     a scalar), and the decoder itself draws x_i from it — so the q in the acceptance
//     ratio is always the q the token came from.
//     Greedy (T = 0) drafts the argmax. A ProposalDrafter is called once and its tokens are
//     verified with a one-hot q. After each drafted token the policy's
//     continue_drafting(top probability of the standardized q row, drafted) may end drafting
//     (greedy LM drafts pass the raw row's top probability, proposal drafters pass 1.0, and
//     at T = 1 a policy whose needs_top_probability() is false gets 1.0: the maximum is not
//     taken); drafting also ends right after a stop token.
//  3. Scoring. A BatchedLanguageModel target scores all gamma + 1 prefixes in ONE score_draft
//     call; any other target is called once per prefix. Target rows get the same
//     standardization as draft rows; a batched target's rows are standardized (with their
//     checks) when verification first reads them, so rows after the first rejection cost
//     nothing and are not checked, as when its rows are used in place.
//  4. Verification by the exact core: Algorithm 1's decisions (detail::accept_drafts for a
//     LanguageModel draft, accept_proposals for a proposal drafter: the loops of
//     verify_speculative and verify_speculative_proposals) and the residual or bonus draw,
//     with validation and beta fused into the passes over whole rows; exact match for
//     T = 0 (verify_greedy).
//  5. Emission of x_1..x_n, t, cut right after a stop token or stop sequence; the policy
//     observes the outcome; statistics are recorded; the streaming callback sees each token.
//
// Rows are used in place (no copy) only when the target is batched and the standardization
// is the identity (T = 1, no truncation) or greedy. Draft rows and per-prefix target rows
// are copied once into the decoder's workspace: a model's returned view is only valid until
// its next call. At T = 1 without truncation a draft row costs ONE pass (copy, validation,
// maximum if the gamma policy reads it, and the sampling table, fused); its normaliser is
// kept as a scalar rather than rescaling the row. A draft that declares stable_rows
// (concepts.hpp: its rows outlive the step) is read in place there: no copy. Verification then
// reads target rows whole only where it must (the draw of the final token; beta and validation of
// accepted rows), each in one pass. With top-k truncation every row is kept as its survivors
// (Standardizer::apply_sparse: one pass of block maxima with validation fused into it), and
// verification, beta and the draws run over at most top_k entries per row. The workspace is
// sized at construction for the policy's first gamma and grows only if a later gamma is
// larger: a steady-state step allocates nothing (tested with a counting allocator).
//
// Stateful (KV-cache) models receive the whole context on every call; CachedContext
// (cached_context.hpp) turns it into truncate/append calls.
//
// Token trees (DecoderOptions::tree_shape with draft nodes, lenience 1, a LanguageModel
// draft or a MultiProposalDrafter): steps 1-4 are replaced by one tree_step
// (tree_verification.hpp): a tree of that shape is drafted from the standardized q rows
// (top-k for greedy), or a proposal tree of the drafter's continuations within the shape's
// limits (ProposalTreeLimits::from_shape: one continuation per root-to-leaf path, its
// depth, its node count) is built, scored by the target (one score_tree call for a
// TreeScoringModel) and verified exactly; the emitted path and t then go through step 5
// unchanged. The gamma policy is not consulted. TreeShape::chain(gamma) gives the same
// output law as the chain path with FixedGamma{gamma}.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/cached_context.hpp"  // IWYU pragma: export (for stateful models)
#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/decoder_kernels.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/detail/sparse_rows.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/stop_conditions.hpp"
#include "specdec/tree_verification.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

/// One emitted token as the streaming callback sees it: enough to draw the paper's Fig. 1.
struct EmittedToken {
  token_id token = 0;
  token_source source = token_source::draft;  ///< accepted draft, correction or bonus
  std::size_t step = 0;      ///< step index: within the generate() call, or counted by step()
  std::size_t position = 0;  ///< index of the token in the whole sequence (prompt included)
  friend constexpr bool operator==(const EmittedToken&, const EmittedToken&) = default;
};

/// Configuration of a SpeculativeDecoder. Checked at construction (errc::invalid_option
/// naming the option).
struct DecoderOptions {
  /// Standardization applied identically to target and draft rows; temperature 0 selects
  /// greedy decoding with exact-match verification.
  SamplingOptions sampling{};
  /// Draft length per step; FixedGamma{4} by default. See gamma_policy.hpp for the protocol.
  AnyGammaPolicy gamma_policy = FixedGamma{4};
  /// Time source of the StepFeedback seconds, read only for a policy whose needs_timing()
  /// is true: before drafting, before scoring and after verification. Returns seconds on
  /// any monotonic scale; empty (the default) is std::chrono::steady_clock. A simulated
  /// clock (advanced by the models, say) makes measured costs reproducible, e.g. in tests,
  /// or counts cost in work units instead of wall time. Exceptions from it propagate; the
  /// step then emits nothing.
  std::function<double()> clock{};
  /// Generation ends right after any of these tokens (it is emitted, nothing after it).
  std::vector<token_id> stop_tokens{};
  /// Generation ends right after the generated tokens end with any of these sequences
  /// (non-empty; matched on generated tokens only in generate(), on the whole context in
  /// step()).
  std::vector<std::vector<token_id>> stop_sequences{};
  /// Lenience l in (0, 1] (paper App. A.5), forwarded to the verifier; 1 = exact. Must be 1
  /// for greedy decoding.
  double lenience = 1.0;
  /// Validate every model row the step reads (size always; NaN/Inf/negative entries, zero
  /// mass and normalization here). The checks ride on passes that read the rows anyway:
  ///  - draft rows at T = 1 without truncation: in the one pass that copies the row and
  ///    builds its sampling table; other draft rows and target rows the decoder copies or
  ///    standardizes (per-prefix targets, T != 1, truncation): one screening pass first;
  ///  - target rows used in place (a batched target at T = 1 without truncation): in the
  ///    pass that reads each row whole anyway (beta, the residual or bonus draw), or a
  ///    screening pass for an accepted row without beta. p_1..p_{n+1} are read, so checked;
  ///    rows after the one the final token comes from are never read, so not checked;
  ///  - greedy decoding (temperature 0): inside its argmax scans, every row it takes a token
  ///    from, for NaN, negative and infinite entries and all-zero rows, not for the sum
  ///    (argmax does not need it); target rows after the first mismatch are not read.
  /// Off: rows are the caller's documented precondition.
  bool validate_rows = true;
  /// Collect the mean beta statistic (LanguageModel drafts at T > 0): sum_x min(p_i, q_i)
  /// for the accepted positions (a pass over each row pair, which also validates the
  /// target row) and, at the rejected position, 1 - beta from the residual draw's own pass.
  /// Nothing extra for greedy or proposal drafters.
  bool collect_beta = true;
  /// Called for every emitted token, in order, after the step's bookkeeping. Invoking it
  /// never allocates; exceptions from it propagate unchanged (tokens stay in generated()).
  std::function<void(const EmittedToken&)> on_token{};
  /// Draft token tree of every step. The root alone (the default) selects the chain path
  /// with gamma_policy; a shape with draft nodes selects tree steps (tree_step), which need
  /// lenience 1 and a LanguageModel draft (trees of this shape; top-k trees for greedy
  /// decoding) or a MultiProposalDrafter (proposal trees of one continuation per
  /// root-to-leaf path of the shape, within its depth and node count); else
  /// errc::invalid_option. gamma_policy is then not used.
  TreeShape tree_shape{};
  /// How tree children are drawn at T > 0: without_replacement or with_replacement.
  expansion tree_sampling = expansion::without_replacement;
  /// With replacement: repeated draws become repeat counts (true) or duplicate nodes.
  bool tree_merge_repeats = true;
};

/// What one speculative step did. The spans view the decoder's storage and stay valid until
/// its next step or generate call.
struct StepResult {
  std::span<const token_id> tokens{};       ///< x_1..x_n, t — cut after a stop condition
  std::span<const token_source> sources{};  ///< provenance of each token
  std::size_t drafted = 0;                  ///< gamma actually drafted (tree: nodes_scored)
  std::size_t nodes_scored = 0;             ///< draft tokens scored by the target
  std::size_t accepted = 0;                 ///< n: drafts accepted (tree: accepted depth)
  bool residual_fallback = false;           ///< the correction came from p (zero residual)
  stop_reason stop = stop_reason::none;     ///< the stop condition that ended generation, if any
  /// 1 with score_draft, else drafted + 1; tree: 1 with score_tree, one per root-to-leaf
  /// path with score_draft, else one per node (root included).
  std::size_t target_calls = 0;
  std::size_t draft_calls = 0;     ///< drafted for LanguageModel drafts, 1 for proposal drafters;
                                   ///< tree: expanded nodes (proposal trees: 1)
  double beta_sum = 0.0;           ///< sum of beta over this step's verified positions
  std::size_t beta_positions = 0;  ///< verified positions with a beta (see statistics)
};

/// Counters over the steps of a decoder (since construction or reset_statistics()), or of
/// one generate() call (GenerationResult::statistics).
///
/// Invariant: emitted_tokens == accepted_tokens + steps, except for the tokens dropped from
/// the last step of a generation by max_new_tokens, a stop token or a stop sequence.
///
/// beta (the paper's acceptance rate at one position, Def. 3.1) is collected over verified
/// positions i = 1..min(n + 1, gamma) of each step:
///  - LanguageModel draft, T > 0: beta_i = sum_x min(p_i(x), q_i(x)) of the standardized rows
///    (Thm. 3.5); mean_beta() is the paper's estimator of alpha = E[beta] (Cor. 3.6). Note
///    that positions after accepted drafts are conditioned on those acceptances, so with
///    context-dependent models the mean is weighted toward contexts the draft predicts well.
///  - ProposalDrafter, T > 0: q_i is one-hot on x_i, so beta_i = p_i(x_i) (the probability
///    of accepting the proposal).
///  - greedy (T = 0): p and q are one-hot, beta_i = 1 if x_i matched the target's argmax,
///    else 0.
///  - token trees: no beta is collected (beta_positions stays 0).
///
/// With token trees (DecoderOptions::tree_shape), drafted_tokens == nodes_scored counts the
/// draft nodes scored, accepted_tokens sums the accepted depths and accepted_histogram[n]
/// counts the steps whose accepted depth was n.
struct DecoderStatistics {
  std::size_t steps = 0;
  std::size_t target_calls = 0;
  std::size_t draft_calls = 0;
  std::size_t drafted_tokens = 0;
  std::size_t nodes_scored = 0;  ///< draft tokens scored by the target (chains: drafted)
  std::size_t accepted_tokens = 0;
  std::size_t emitted_tokens = 0;
  std::size_t residual_fallbacks = 0;  ///< corrections drawn from p: zero residual mass
  /// accepted_histogram[n] = number of steps that accepted exactly n drafts.
  std::vector<std::size_t> accepted_histogram{};
  double beta_sum = 0.0;
  std::size_t beta_positions = 0;

  /// Adds one step.
  void record(const StepResult& step) {
    ++steps;
    target_calls += step.target_calls;
    draft_calls += step.draft_calls;
    drafted_tokens += step.drafted;
    nodes_scored += step.nodes_scored;
    accepted_tokens += step.accepted;
    emitted_tokens += step.tokens.size();
    residual_fallbacks += step.residual_fallback ? 1U : 0U;
    if (accepted_histogram.size() <= step.accepted) {
      accepted_histogram.resize(step.accepted + 1, 0);
    }
    ++accepted_histogram[step.accepted];
    beta_sum += step.beta_sum;
    beta_positions += step.beta_positions;
  }

  /// Mean beta over verified positions (the alpha estimator); 0 if none were seen.
  [[nodiscard]] double mean_beta() const noexcept {
    return beta_positions == 0 ? 0.0 : beta_sum / static_cast<double>(beta_positions);
  }
  /// Emitted tokens per target call (per step for batched targets).
  [[nodiscard]] double tokens_per_target_call() const noexcept {
    return target_calls == 0
               ? 0.0
               : static_cast<double>(emitted_tokens) / static_cast<double>(target_calls);
  }
  /// Draft tokens scored per target call (the width of the target's work per call).
  [[nodiscard]] double nodes_per_target_call() const noexcept {
    return target_calls == 0
               ? 0.0
               : static_cast<double>(nodes_scored) / static_cast<double>(target_calls);
  }
  /// Emitted tokens per step (the paper's improvement factor in target calls, Eq. 1).
  [[nodiscard]] double tokens_per_step() const noexcept {
    return steps == 0 ? 0.0 : static_cast<double>(emitted_tokens) / static_cast<double>(steps);
  }
  /// Accepted over drafted tokens.
  [[nodiscard]] double acceptance_rate() const noexcept {
    return drafted_tokens == 0
               ? 0.0
               : static_cast<double>(accepted_tokens) / static_cast<double>(drafted_tokens);
  }
};

/// What generate() returns.
struct GenerationResult {
  std::vector<token_id> tokens{};  ///< the new tokens (prompt excluded)
  stop_reason stop = stop_reason::max_new_tokens;
  DecoderStatistics statistics{};  ///< of this call only
};

namespace detail {

/// What GuardedModel throws when the model it wraps throws: the model's own exception.
struct guarded_model_failure {
  std::string_view model;  ///< "target" or "draft"
  std::exception_ptr original;
};

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

/// Speculative decoding of `TargetModel` (M_p) with `DraftModel` (M_q), any Drafter
/// (concepts.hpp): a LanguageModel, adapted by the decoder, which samples the drafts from
/// its standardized q rows itself, or a ProposalDrafter, whose proposals are verified with a
/// one-hot q (a type that is both is used as a LanguageModel).
/// Holds references: both models must outlive the decoder. Not thread-safe (one decoder per
/// thread; models are called from the calling thread only).
///
/// Output law: for T > 0 and lenience 1, the generated sequence is distributed exactly as
/// autoregressive sampling from the standardized target rows (paper App. A.1), whatever the
/// draft and the gamma policy; for T = 0 it equals greedy decoding of the target token for
/// token (ties: lowest id).
/// @code
/// specdec::DecoderOptions options;
/// options.sampling.temperature = 0.7;
/// options.sampling.top_p = 0.9;
/// options.stop_tokens = {eos};
/// specdec::SpeculativeDecoder decoder(target, draft, options);
/// auto result = decoder.generate(prompt, 128, /*seed=*/42);
/// // result.tokens, result.stop, result.statistics.mean_beta(), ...
/// @endcode
template <LanguageModel TargetModel, Drafter DraftModel>
class SpeculativeDecoder {
  using target_row_type =
      decltype(std::declval<TargetModel&>().next_token_probabilities(std::span<const token_id>()));

 public:
  /// The scalar type of the target's rows; every workspace row uses it.
  using value_type = probability_scalar_t<target_row_type>;
  /// Whether the draft is used as a LanguageModel (else as a ProposalDrafter).
  static constexpr bool draft_is_model = drafts_from_rows<DraftModel>;
  /// Whether the draft is used as a MultiProposalDrafter, which can draft proposal trees.
  static constexpr bool draft_proposes_trees = !draft_is_model && MultiProposalDrafter<DraftModel>;
  /// Whether the target scores all prefixes in one call.
  static constexpr bool target_is_batched = BatchedLanguageModel<TargetModel>;
  /// Whether the draft's rows are read in place where a step would copy them unchanged (T = 1
  /// without truncation): the draft declares stable_rows (concepts.hpp) and its rows have
  /// the target's scalar type.
  static constexpr bool draft_rows_in_place =
      draft_is_model && stable_rows<DraftModel> &&
      std::is_same_v<typename detail::model_row_traits<DraftModel>::scalar, value_type>;
  static_assert(!(draft_is_model && stable_rows<DraftModel>) ||
                    detail::model_row_traits<DraftModel>::non_owning,
                "stable_rows: the draft's next_token_probabilities must return a view or a "
                "reference (std::span, const std::vector<T>&, Eigen::Map); a row returned by "
                "value is gone before verification reads it");
  /// "No token limit" for step().
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();

  /// Checks the options (errc::invalid_option naming the option) and the vocabularies
  /// (errc::invalid_size for V = 0; errc::vocab_mismatch if a LanguageModel draft has a
  /// different vocab_size()), then sizes the workspace for the policy's first gamma.
  SpeculativeDecoder(TargetModel& target, DraftModel& draft, DecoderOptions options = {})
      : target_(&target),
        draft_(&draft),
        options_(std::move(options)),
        vocab_size_(static_cast<std::size_t>(target.vocab_size())),
        standardizer_(checked_sampling(options_.sampling)) {
    check_options();
    standardizer_.reserve(vocab_size_);
    if (tree_mode()) {
      // A step emits at most max_depth + 1 tokens; the tree buffers warm up on first use.
      const std::size_t depth = options_.tree_shape.max_depth();
      step_tokens_.resize(depth + 1);
      step_sources_.resize(depth + 1);
      statistics_.accepted_histogram.reserve(depth + 1);
      workspace_gamma_ = depth;
      // Built once: a per-step copy of the shape would allocate.
      tree_options_ =
          TreeOptions{options_.tree_shape, options_.tree_sampling, options_.tree_merge_repeats,
                      options_.sampling.greedy(), options_.validate_rows};
    } else {
      grow_workspace(options_.gamma_policy.next_gamma());
    }
  }

  SpeculativeDecoder(const SpeculativeDecoder&) = delete;
  SpeculativeDecoder& operator=(const SpeculativeDecoder&) = delete;
  SpeculativeDecoder(SpeculativeDecoder&&) noexcept = default;
  SpeculativeDecoder& operator=(SpeculativeDecoder&&) noexcept = default;
  ~SpeculativeDecoder() = default;

  /// Generates up to `max_new_tokens` tokens after `prompt` (never more, even when a step
  /// accepts gamma + 1), ending early right after a stop token or stop sequence.
  /// Throws decoding_error (carrying the tokens emitted before the failing step) when a
  /// model misbehaves.
  template <std::uniform_random_bit_generator G>
  GenerationResult generate(std::span<const token_id> prompt, std::size_t max_new_tokens, G& g) {
    check_context(prompt, "prompt", 0);  // before anything changes: the last result stays intact
    GenerationResult result;
    result.statistics.accepted_histogram.reserve(workspace_gamma_ + 1);
    sequence_.clear();
    reserve(prompt.size() + std::min<std::size_t>(max_new_tokens, 1U << 16U));
    sequence_.assign(prompt.begin(), prompt.end());
    prompt_length_ = prompt.size();
    step_index_ = 0;
    try {
      while (generated().size() < max_new_tokens) {
        const StepResult step = run_step(g, max_new_tokens - generated().size(), prompt_length_);
        result.statistics.record(step);
        if (step.stop != stop_reason::none) {
          result.stop = step.stop;
          break;
        }
      }
    } catch (decoding_error& failure) {
      failure.tokens_.assign(generated().begin(), generated().end());
      throw;
    }
    result.tokens.assign(generated().begin(), generated().end());
    return result;
  }

  /// generate() with a default_engine seeded by `seed`.
  GenerationResult generate(std::span<const token_id> prompt, std::size_t max_new_tokens,
                            std::uint64_t seed) {
    default_engine g(seed);
    return generate(prompt, max_new_tokens, g);
  }

  /// One speculative step after `context` (the whole accepted sequence), emitting at most
  /// `max_tokens` (>= 1) tokens; stop tokens and stop sequences (matched on the context
  /// plus the new tokens) cut the step as in generate(). The engine appends result.tokens
  /// to its context itself. Throws decoding_error (with no tokens: a failed step emits
  /// nothing).
  template <std::uniform_random_bit_generator G>
  StepResult step(std::span<const token_id> context, G& g, std::size_t max_tokens = unlimited) {
    check_context(context, "context", step_index_);
    if (max_tokens == 0) return StepResult{.stop = stop_reason::max_new_tokens};
    sequence_.assign(context.begin(), context.end());
    prompt_length_ = context.size();
    return run_step(g, max_tokens, 0);
  }

  /// Reserves room for contexts of `context_length` tokens (plus a step's drafts), so that
  /// step() does not allocate for contexts up to that length.
  void reserve(std::size_t context_length) {
    const std::size_t length = context_length + workspace_gamma_ + 1;
    sequence_.reserve(length);
    if (tree_mode()) {  // the tree builders and the per-node fallback hold context + path
      tree_workspace_.drafting.sequence.reserve(length);
      tree_workspace_.scoring.sequence.reserve(length);
    }
  }

  /// The tokens generated by the current or last generate() call (also after an exception).
  [[nodiscard]] std::span<const token_id> generated() const noexcept {
    return std::span<const token_id>(sequence_).subspan(std::min(prompt_length_, sequence_.size()));
  }

  /// Statistics over every step since construction or the last reset_statistics().
  [[nodiscard]] const DecoderStatistics& statistics() const noexcept { return statistics_; }
  void reset_statistics() {
    statistics_ = DecoderStatistics{};
    statistics_.accepted_histogram.reserve(workspace_gamma_ + 1);
  }

  [[nodiscard]] const DecoderOptions& options() const noexcept { return options_; }
  /// The gamma policy with its learned state (e.g. to inspect an adaptive policy).
  [[nodiscard]] AnyGammaPolicy& gamma_policy() noexcept { return options_.gamma_policy; }
  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_size_; }
  [[nodiscard]] TargetModel& target() const noexcept { return *target_; }
  [[nodiscard]] DraftModel& draft() const noexcept { return *draft_; }

 private:
  static const SamplingOptions& checked_sampling(const SamplingOptions& sampling) {
    sampling.validate();
    return sampling;
  }

  void check_options() {
    if (!(options_.lenience > 0.0 && options_.lenience <= 1.0)) {
      detail::throw_error(errc::invalid_option, "decoder option lenience = ", options_.lenience,
                          " must be in (0, 1]");
    }
    if (options_.sampling.greedy() && options_.lenience != 1.0) {
      detail::throw_error(errc::invalid_option, "decoder option lenience = ", options_.lenience,
                          " needs temperature > 0 (greedy decoding verifies by exact match)");
    }
    if (options_.tree_shape.draft_size() > 0) {
      if (!draft_is_model && !draft_proposes_trees) {
        detail::throw_error(errc::invalid_option, "decoder option tree_shape (",
                            options_.tree_shape.draft_size(),
                            " draft nodes) needs a LanguageModel draft or a MultiProposalDrafter "
                            "(propose_many); a drafter with propose() alone uses the chain path "
                            "(leave tree_shape at the root alone)");
      }
      if (options_.lenience != 1.0) {
        detail::throw_error(errc::invalid_option, "decoder option tree_shape (",
                            options_.tree_shape.draft_size(),
                            " draft nodes) needs lenience = 1, not ", options_.lenience);
      }
      if (options_.tree_sampling != expansion::with_replacement &&
          options_.tree_sampling != expansion::without_replacement) {
        detail::throw_error(errc::invalid_option,
                            "decoder option tree_sampling = ", to_string(options_.tree_sampling),
                            " must be with_replacement or without_replacement");
      }
    }
    if (options_.gamma_policy.next_gamma() == 0) {
      detail::throw_error(errc::invalid_option,
                          "decoder option gamma_policy: next_gamma() is 0, must be >= 1");
    }
    if (vocab_size_ == 0) {
      detail::throw_error(errc::invalid_size, "target model: vocab_size() is 0");
    }
    if constexpr (draft_is_model) {
      const auto draft_vocab = static_cast<std::size_t>(draft_->vocab_size());
      if (draft_vocab != vocab_size_) {
        detail::throw_error(errc::vocab_mismatch, "draft model has vocab_size() ", draft_vocab,
                            " but the target model has ", vocab_size_);
      }
    }
    stops_.assign(options_.stop_tokens, options_.stop_sequences, vocab_size_, "decoder option ");
  }

  // Which row copies a step needs: draft rows always for LanguageModel drafts at T > 0;
  // target rows unless the target is batched and its rows can be used in place.
  [[nodiscard]] bool tree_mode() const noexcept {
    return (draft_is_model || draft_proposes_trees) && options_.tree_shape.draft_size() > 0;
  }
  [[nodiscard]] bool needs_draft_rows() const noexcept {
    return draft_is_model && !options_.sampling.greedy();
  }
  [[nodiscard]] bool reads_draft_in_place() const noexcept {
    return draft_rows_in_place && options_.sampling.identity() && !tree_mode();
  }
  [[nodiscard]] bool needs_target_rows() const noexcept {
    if constexpr (target_is_batched) {
      using batched_scalar = typename decltype(as_rows(std::declval<TargetModel&>().score_draft(
          std::span<const token_id>(), std::span<const token_id>())))::value_type;
      if constexpr (!std::is_same_v<batched_scalar, value_type>) return true;
      return !(options_.sampling.identity() || options_.sampling.greedy());
    }
    return true;
  }

  void grow_workspace(std::size_t gamma) {
    if (gamma <= workspace_gamma_ && !step_tokens_.empty()) return;
    gamma = std::max(gamma, workspace_gamma_);
    if (sparse_mode()) {  // survivors only, and one scratch row for their selection
      const std::size_t width = sparse_width();
      if (needs_draft_rows()) {
        draft_ids_.resize(gamma * width);
        draft_weights_.resize(gamma * width);
        draft_counts_.resize(gamma);
      }
      target_ids_.resize((gamma + 1) * width);
      target_weights_.resize((gamma + 1) * width);
      target_counts_.resize(gamma + 1);
      sparse_scratch_.resize(width);
      sparse_scratch_row_.resize(vocab_size_);
    } else {
      if (needs_draft_rows()) {
        // In place (stable_rows): the model's rows, no copies to keep.
        if (!reads_draft_in_place()) draft_rows_.resize(gamma * vocab_size_);
        draft_scales_.resize(gamma);
        draft_row_at_.resize(gamma);
      }
      if (needs_target_rows()) target_rows_.resize((gamma + 1) * vocab_size_);
    }
    step_tokens_.resize(gamma + 1);
    step_sources_.resize(gamma + 1);
    statistics_.accepted_histogram.reserve(gamma + 1);
    sequence_.reserve(sequence_.size() + gamma + 1);
    workspace_gamma_ = gamma;
  }

  [[nodiscard]] std::span<value_type> draft_row(std::size_t i) noexcept {
    return {draft_rows_.data() + i * vocab_size_, vocab_size_};
  }
  [[nodiscard]] std::span<value_type> target_row(std::size_t i) noexcept {
    return {target_rows_.data() + i * vocab_size_, vocab_size_};
  }

  // --- errors ----------------------------------------------------------------------------

  [[noreturn]] void fail(errc code, const std::string& message) const {
    throw decoding_error(code, message, step_index_);
  }

  // Every id of a prompt (generate) or context (step) must lie in [0, V): the models are
  // never given an id outside their vocabulary. Throws invalid_token naming the position.
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

  // Runs a model call; any exception becomes a decoding_error (model_failure) naming the
  // model, step, row and position, with the original exception nested.
  template <class Call>
  decltype(auto) call_model(std::string_view model, std::size_t row, Call&& call) {
    try {
      return std::forward<Call>(call)();
    } catch (const std::exception& e) {
      std::throw_with_nested(decoding_error(errc::model_failure,
                                            describe(model, row) + ": the model threw: " + e.what(),
                                            step_index_));
    } catch (...) {
      std::throw_with_nested(decoding_error(
          errc::model_failure, describe(model, row) + ": the model threw a non-std exception",
          step_index_));
    }
  }

  // "draft row 2 (step 7, sequence position 45)"
  [[nodiscard]] std::string describe(std::string_view model, std::size_t row) const {
    std::string text(model);
    text += " row ";
    text += std::to_string(row);
    text += " (step ";
    text += std::to_string(step_index_);
    text += ", sequence position ";
    text += std::to_string(base_length_ + row);
    text += ')';
    return text;
  }

  // A block of `count` rows from one call, as describe() names one row:
  // "target rows 0..3 (step 7, sequence positions 45..48)"; describe(model, 0) for one row.
  [[nodiscard]] std::string describe_block(std::string_view model, std::size_t count) const {
    if (count == 1) return describe(model, 0);
    std::string text(model);
    text += " rows 0..";
    text += std::to_string(count - 1);
    text += " (step ";
    text += std::to_string(step_index_);
    text += ", sequence positions ";
    text += std::to_string(base_length_);
    text += "..";
    text += std::to_string(base_length_ + count - 1);
    text += ')';
    return text;
  }

  template <class U>
  void check_size(std::span<const U> row, std::string_view model, std::size_t index) const {
    if (row.size() != vocab_size_) {
      fail(errc::invalid_size, describe(model, index) + ": has " + std::to_string(row.size()) +
                                   " entries, expected the vocabulary size " +
                                   std::to_string(vocab_size_));
    }
  }

  // Size check (always) and full validation (validate_rows) of one model row, for rows the
  // step reads whole before using them (standardized or copied). Greedy decoding validates
  // inside its argmax scans (reject_greedy_row); rows read by the fused passes are screened
  // there (check_screen).
  template <class U>
  void check_row(std::span<const U> row, std::string_view model, std::size_t index) const {
    check_size(row, model, index);
    if (!options_.validate_rows || options_.sampling.greedy()) return;
    if (!detail::plausible_probability_row(row.data(), row.size(), default_sum_tolerance<U>)) {
      reject_probability_row(row, model, index);
    }
  }

  // The verdict of a screen fused into a pass over a row: an implausible row goes to the
  // full validator, which names the problem (or accepts the row: -0.0 entries, a sum at the
  // edge of the tolerance).
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

  // Greedy decoding's validation failed on a row (its argmax scan met a NaN or negative
  // entry, an infinite maximum or an all-zero row): throws the error validate_greedy_row
  // names, located like every row error.
  template <class U>
  [[noreturn]] void reject_greedy_row(std::span<const U> row, std::string_view model,
                                      std::size_t index) const {
    reject_row(row, model, index, [this](std::span<const U> r, const RowLocation& where) {
      validate_greedy_row(r, vocab_size_, where);
    });
    fail(errc::invalid_probability, describe(model, index) + ": rejected by the greedy scan");
  }

  // Runs `validator` on a row known or suspected to be bad and rethrows its error with the
  // decoder's location ("<model> row i (step s, sequence position k): ...").
  template <class U, class Validator>
  void reject_row(std::span<const U> row, std::string_view model, std::size_t index,
                  Validator&& validator) const {
    const RowLocation where{model, step_index_, index};
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

  // --- the step --------------------------------------------------------------------------

  template <class G>
  StepResult run_step(G& g, std::size_t max_tokens, std::size_t stop_floor) {
    base_length_ = sequence_.size();
    if (tree_mode()) return finish_step(run_tree_step(g, max_tokens, stop_floor));
    const bool timed = options_.gamma_policy.needs_timing();
    const std::size_t gamma = options_.gamma_policy.next_gamma();
    grow_workspace(gamma);
    StepResult result;
    try {
      const double draft_start = timed ? now() : 0.0;
      result.drafted = draft_tokens(gamma, g, result);
      const double target_start = timed ? now() : 0.0;
      score_and_verify(g, result);
      const double target_end = timed ? now() : 0.0;
      emit(result, max_tokens, stop_floor);
      statistics_.record(result);
      StepFeedback feedback;
      feedback.drafted = result.drafted;
      feedback.accepted = result.accepted;
      if (timed) {
        feedback.draft_seconds = target_start - draft_start;
        feedback.target_seconds = target_end - target_start;
      }
      options_.gamma_policy.observe(feedback);
    } catch (...) {
      sequence_.resize(base_length_);
      throw;
    }
    return finish_step(result);
  }

  // Seconds from DecoderOptions::clock, else from std::chrono::steady_clock.
  [[nodiscard]] double now() const {
    if (options_.clock) return options_.clock();
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Counts the step and streams its tokens.
  StepResult finish_step(const StepResult& result) {
    const std::size_t step = step_index_++;
    if (options_.on_token) {
      for (std::size_t k = 0; k < result.tokens.size(); ++k) {
        options_.on_token(
            EmittedToken{result.tokens[k], result.sources[k], step, base_length_ + k});
      }
    }
    return result;
  }

  // One tree step (tree_verification.hpp) in place of drafting, scoring and verification:
  // leaves the accepted path in sequence_ and t in step_tokens_[n], as verify() does, then
  // emits through the common cut. specdec::error from the tree code keeps its code; anything
  // a model throws (a specdec::error too) becomes model_failure with the exception nested.
  template <class G>
  StepResult run_tree_step(G& g, std::size_t max_tokens, std::size_t stop_floor) {
    StepResult result;
    try {
      if constexpr (draft_is_model) {
        const std::span<const token_id> context(sequence_.data(), base_length_);
        // Greedy trees ignore the transform (top-k drafting, argmax of the raw rows).
        detail::GuardedModel<TargetModel> target(*target_, "target");
        detail::GuardedModel<DraftModel> draft(*draft_, "draft");
        const TreeStepResult tree_result = call_tree([&] {
          return tree_step(
              target, draft, context, tree_options_, g, tree_workspace_, step_index_,
              [this](auto raw, std::span<value_type> out) { standardizer_.apply(raw, out); });
        });
        record_tree_step(tree_result, result);
      } else if constexpr (draft_proposes_trees) {
        const std::span<const token_id> context(sequence_.data(), base_length_);
        detail::GuardedModel<TargetModel> target(*target_, "target");
        detail::GuardedProposalDrafter<DraftModel> draft(*draft_);
        const TreeStepResult tree_result = call_tree([&] {
          return tree_step(
              target, draft, context, tree_options_, g, tree_workspace_, step_index_,
              [this](auto raw, std::span<value_type> out) { standardizer_.apply(raw, out); });
        });
        record_tree_step(tree_result, result);
      }
      emit(result, max_tokens, stop_floor);
      statistics_.record(result);
    } catch (...) {
      sequence_.resize(base_length_);
      throw;
    }
    return result;
  }

  // Leaves a tree step's accepted path in sequence_ and t in step_tokens_[n].
  void record_tree_step(const TreeStepResult& tree_result, StepResult& result) {
    result.drafted = tree_result.nodes_scored;
    result.nodes_scored = tree_result.nodes_scored;
    result.accepted = tree_result.accepted();
    result.residual_fallback = tree_result.verification.residual_fallback;
    result.target_calls = tree_result.target_calls;
    result.draft_calls = tree_result.draft_calls;
    for (std::size_t k = 0; k < result.accepted; ++k) sequence_.push_back(tree_result.tokens[k]);
    step_tokens_[result.accepted] = tree_result.tokens[result.accepted];
    step_sources_[result.accepted] = tree_result.source(result.accepted);
  }

  template <class Call>
  decltype(auto) call_tree(Call&& call) {
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
            step_index_));
      } catch (...) {
        std::throw_with_nested(decoding_error(
            errc::model_failure,
            tree_location() + ": the " + model + " model threw a non-std exception", step_index_));
      }
    }
  }

  // "tree step 7 (sequence position 45)"
  [[nodiscard]] std::string tree_location() const {
    return "tree step " + std::to_string(step_index_) + " (sequence position " +
           std::to_string(base_length_) + ")";
  }

  [[nodiscard]] bool is_stop_token(token_id token) const noexcept {
    return stops_.is_stop_token(token);
  }

  // Drafts up to `gamma` tokens into sequence_ (after the context); returns how many.
  template <class G>
  std::size_t draft_tokens(std::size_t gamma, G& g, StepResult& result) {
    if (gamma == 0) return 0;
    if constexpr (draft_is_model) {
      const bool want_top = options_.gamma_policy.needs_top_probability();
      for (std::size_t i = 0; i < gamma; ++i) {
        const std::span<const token_id> prefix(sequence_);
        auto&& returned = call_model("draft", i, [&]() -> decltype(auto) {
          return draft_->next_token_probabilities(prefix);
        });
        const auto row = as_span(returned);
        ++result.draft_calls;
        token_id drafted = 0;
        double top_probability = 0.0;
        if (options_.sampling.identity()) {
          check_size(row, "draft", i);
          drafted = draft_identity(row, i, g, want_top, top_probability);
        } else if (options_.sampling.greedy()) {
          check_size(row, "draft", i);
          if (options_.validate_rows) {
            const std::size_t best = detail::screened_argmax(row.data(), row.size());
            if (best == detail::no_index) reject_greedy_row(row, "draft", i);
            drafted = static_cast<token_id>(best);
          } else {
            drafted = argmax(row);
          }
          top_probability = static_cast<double>(row[static_cast<std::size_t>(drafted)]);
        } else if (sparse_mode()) {
          const std::size_t count = load_sparse(row, true, i, top_probability);
          const double u = uniform01<double>(g);
          // No survivor (a row without positive mass, only without validation): its argmax.
          drafted = static_cast<token_id>(count == 0 ? detail::row_argmax(row.data(), row.size())
                                                     : detail::sparse_draw(sparse_draft(i), u, 0));
        } else {
          const std::span<value_type> q = draft_row(i);
          top_probability = standardize_checked(row, q, "draft", i);
          draft_scales_[i] = 1.0;
          draft_row_at_[i] = q.data();
          drafted = sample_from_row(std::span<const value_type>(q), g);
        }
        sequence_.push_back(drafted);
        if (is_stop_token(drafted)) return i + 1;
        if (i + 1 < gamma && !options_.gamma_policy.continue_drafting(top_probability, i + 1)) {
          return i + 1;
        }
      }
      return gamma;
    } else {
      sequence_.resize(base_length_ + gamma);
      const std::span<const token_id> context(sequence_.data(), base_length_);
      const std::span<token_id> out(sequence_.data() + base_length_, gamma);
      const std::size_t proposed = static_cast<std::size_t>(
          call_model("draft", 0, [&]() -> std::size_t { return draft_->propose(context, out); }));
      result.draft_calls = 1;
      if (proposed > gamma) {
        fail(errc::invalid_size, describe("draft", 0) + ": the drafter proposed " +
                                     std::to_string(proposed) + " tokens, more than the " +
                                     std::to_string(gamma) + " asked for");
      }
      std::size_t kept = proposed;
      for (std::size_t i = 0; i < proposed; ++i) {
        const token_id token = out[i];
        if (token < 0 || static_cast<std::size_t>(token) >= vocab_size_) {
          fail(errc::invalid_token, describe("draft", i) + ": proposed token " +
                                        std::to_string(token) + " is outside [0, " +
                                        std::to_string(vocab_size_) + ")");
        }
        if (is_stop_token(token) ||
            (i + 1 < proposed && !options_.gamma_policy.continue_drafting(1.0, i + 1))) {
          kept = i + 1;
          break;
        }
      }
      sequence_.resize(base_length_ + kept);
      return kept;
    }
  }

  // A draft token from a row at T = 1 without truncation, in ONE pass over the row: it is
  // copied into the workspace (a model's row is valid only until its next call) while the
  // same pass screens it for validation (validate_rows), takes its maximum (for a policy
  // that reads the top probability) and builds the mass table of the copy; then one draw
  // walks one superblock. The row is not rescaled: its normaliser s (the table's total) is
  // kept as the scalar draft_scales_[i] = 1 / s, and verification reads q = c / s. A draft
  // with stable_rows is read in place: the same pass without the copy.
  template <class U, class G>
  token_id draft_identity(std::span<const U> row, std::size_t i, G& g, bool want_top,
                          double& top_probability) {
    constexpr bool in_place = draft_rows_in_place;
    static_assert(!in_place || std::is_same_v<U, value_type>);  // implied by draft_rows_in_place
    [[maybe_unused]] value_type* copy = nullptr;
    const value_type* q = nullptr;
    if constexpr (in_place) {
      q = row.data();
    } else {
      copy = draft_rows_.data() + i * vocab_size_;
      q = copy;
    }
    draft_row_at_[i] = q;
    const detail::row_source<value_type> source{q, vocab_size_};
    // The sum is the table's total (entries >= 0 once the screen passed), unless the row is
    // converted to another type: then the row's own sum, as the validator computes it.
    constexpr bool converted = !std::is_same_v<U, value_type>;
    detail::sign_screen<U> screen;
    detail::lane_sum<U> raw_sum;
    detail::row_maximum<U> maximum;
    detail::mass_table table;
    const auto pass = [&](auto screened, auto with_maximum) {
      detail::build_mass_table(source, table,
                               [&](std::size_t first, std::size_t count) SPECDEC_LAMBDA_INLINE {
                                 const U* in = row.data() + first;
                                 if constexpr (!in_place) {
                                   for (std::size_t j = 0; j < count; ++j)
                                     copy[first + j] = static_cast<value_type>(in[j]);
                                 }
                                 if constexpr (decltype(screened)::value) {
                                   screen.add(in, count);
                                   if constexpr (converted) raw_sum.add(in, count);
                                 }
                                 if constexpr (decltype(with_maximum)::value)
                                   maximum.add(in, count);
                               });
    };
    if (options_.validate_rows) {
      if (want_top) {
        pass(std::true_type{}, std::true_type{});
      } else {
        pass(std::true_type{}, std::false_type{});
      }
      const double total = converted ? raw_sum.value() : table.total;
      // The table sums the copy (value_type), the raw sum sums the row (U).
      using summed = std::conditional_t<converted, U, value_type>;
      if (!detail::plausible_total<summed>(screen.passed(), total, default_sum_tolerance<U>)) {
        reject_probability_row(row, "draft", i);
      }
    } else if (want_top) {
      pass(std::false_type{}, std::true_type{});
    } else {
      pass(std::false_type{}, std::false_type{});
    }
    const double u = uniform01<double>(g);
    double scale = 1.0;
    std::size_t index = detail::no_index;
    if (table.drawable()) {
      scale = 1.0 / table.total;
      index = detail::draw_from_table(source, table, u);
    }
    // No positive finite mass (only without validation): the argmax, as sample_from_row.
    if (index == detail::no_index) index = detail::row_argmax(q, vocab_size_);
    draft_scales_[i] = scale;
    top_probability = want_top ? static_cast<double>(maximum.value()) * scale : 1.0;
    return static_cast<token_id>(index);
  }

  // Scores the drafted prefixes with the target and verifies (result.accepted, the token t
  // in step_tokens_[drafted], sources), collecting beta.
  template <class G>
  void score_and_verify(G& g, StepResult& result) {
    const std::size_t drafted = result.drafted;
    const std::span<const token_id> context(sequence_.data(), base_length_);
    const std::span<const token_id> drafts(sequence_.data() + base_length_, drafted);
    if constexpr (target_is_batched) {
      auto&& scored = call_model(
          "target", 0, [&]() -> decltype(auto) { return target_->score_draft(context, drafts); });
      result.target_calls = 1;
      const auto rows = as_rows(scored);
      using scored_scalar = typename std::remove_cvref_t<decltype(rows)>::value_type;
      if (rows.rows() != drafted + 1 || rows.cols() != vocab_size_) {
        fail(errc::invalid_size,
             describe_block("target", drafted + 1) + ": score_draft returned " +
                 std::to_string(rows.rows()) + " x " + std::to_string(rows.cols()) + ", expected " +
                 std::to_string(drafted + 1) + " x " + std::to_string(vocab_size_));
      }
      if constexpr (std::is_same_v<scored_scalar, value_type>) {
        if (!needs_target_rows()) {  // in place: validated by the passes that read them
          verify(g, result, rows, options_.validate_rows, no_target_loads{});
          return;
        }
      }
      // Lazily: row i is standardized (or copied) when verification first reads it, so
      // rows after the first rejection are never touched (the scored block outlives the
      // verification).
      std::size_t loaded = 0;
      verify_workspace(g, result, [&](std::size_t i) {
        for (; loaded <= i; ++loaded) {
          load_target_row(std::span<const scored_scalar>(rows.row(loaded)), loaded);
        }
      });
    } else {
      for (std::size_t i = 0; i <= drafted; ++i) {
        const std::span<const token_id> prefix(sequence_.data(), base_length_ + i);
        auto&& returned = call_model("target", i, [&]() -> decltype(auto) {
          return target_->next_token_probabilities(prefix);
        });
        ++result.target_calls;
        load_target_row(as_span(returned), i);
      }
      verify_workspace(g, result, no_target_loads{});
    }
  }

  // Target rows already in place or in the workspace: nothing to load before reading row i.
  struct no_target_loads {
    constexpr void operator()(std::size_t /*row*/) const noexcept {}
  };

  // Verification over the workspace's target rows (survivors in sparse mode), which
  // load_through(i) fills up to row i before any read of it.
  template <class G, class LoadThrough>
  void verify_workspace(G& g, StepResult& result, LoadThrough&& load_through) {
    if (sparse_mode()) {
      verify_sparse(g, result, load_through);
    } else {
      verify(g, result,
             RowsView<const value_type>(target_rows_.data(), result.drafted + 1, vocab_size_),
             false, load_through);
    }
  }

  // Checks and copies (greedy, identity) or standardizes a target row into the workspace
  // (sparse: its survivors, validated inside the selection pass).
  template <class U>
  void load_target_row(std::span<const U> row, std::size_t i) {
    if (sparse_mode()) {
      double unused = 0.0;
      (void)load_sparse(row, false, i, unused);
      return;
    }
    if (options_.sampling.greedy() || options_.sampling.identity()) {
      check_row(row, "target", i);
      const std::span<value_type> destination = target_row(i);
      std::transform(row.begin(), row.end(), destination.begin(),
                     [](U value) { return static_cast<value_type>(value); });
    } else {
      (void)standardize_checked(row, target_row(i), "target", i);
    }
  }

  // Standardizes a model row into `out` with its checks: the size always (first), and with
  // validate_rows the screen, taken from the standardization's first pass where it takes
  // one (Standardizer::screens_first_pass: the row is then checked after it, which is safe
  // on any row), else a pass of its own before. Returns the top standardized probability.
  template <class U>
  double standardize_checked(std::span<const U> row, std::span<value_type> out,
                             std::string_view model, std::size_t index) {
    const bool validate = options_.validate_rows && !options_.sampling.greedy();
    if (!validate || !standardizer_.template screens_first_pass<U>(row.size())) {
      check_row(row, model, index);
      return standardizer_.apply(row, out);
    }
    check_size(row, model, index);
    detail::first_pass_screen screen;
    const double top = standardizer_.apply(row, out, &screen);
    if (!detail::plausible_total<U>(screen.signs_passed, screen.total, default_sum_tolerance<U>)) {
      reject_probability_row(row, model, index);
    }
    return top;
  }

  // Verification (Algorithm 1: detail::accept_drafts / accept_proposals, then the residual
  // or bonus draw; exact match for greedy) with the step's other reads of whole target rows
  // fused into it. `screen`: the rows are the model's own (in place) and not yet validated;
  // each row the step reads is then screened in the pass that reads it, and only those
  // rows: p_1..p_n (accepted) in their beta pass or a pass of their own, p_{n+1} in the
  // residual or bonus draw's pass. Rows after it are never read, so never checked.
  // `load_through(i)`: makes target rows 0..i readable (a batched target's rows are
  // standardized when first read); called before any read of row i.
  template <class G, class LoadThrough>
  void verify(G& g, StepResult& result, RowsView<const value_type> target_rows, bool screen,
              LoadThrough&& load_through) {
    const std::size_t drafted = result.drafted;
    const std::span<const token_id> drafts(sequence_.data() + base_length_, drafted);
    result.nodes_scored = drafted;
    if (options_.sampling.greedy()) {
      load_through(drafted);  // verify_greedy takes the rows as one view
      VerificationResult verdict;
      if (options_.validate_rows) {
        std::size_t bad_row = detail::no_index;
        verdict = detail::verify_greedy_screened(drafts, target_rows, bad_row);
        if (bad_row != detail::no_index) {
          reject_greedy_row(std::span<const value_type>(target_rows.row(bad_row)), "target",
                            bad_row);
        }
      } else {
        verdict = verify_greedy(drafts, target_rows);
      }
      record_verdict(result, verdict.accepted, verdict.token, verdict.source, false);
      if (options_.collect_beta) {  // p and q one-hot: beta_i = 1 if x_i matched, else 0
        result.beta_positions = std::min(result.accepted + 1, drafted);
        result.beta_sum = static_cast<double>(result.accepted);
      }
      return;
    }
    const double lenience = options_.lenience;
    std::size_t n = 0;
    const auto p_at = [&](std::size_t i, std::size_t x) {
      load_through(i);
      return static_cast<double>(target_rows(i, x));
    };
    // Unchecked entries: in-place rows are validated after the decisions (see above).
    if constexpr (draft_is_model) {
      n = detail::accept_drafts_with<false>(
          drafts, p_at,
          [this](std::size_t i, std::size_t x) {
            return static_cast<double>(draft_row_at_[i][x]) * draft_scales_[i];
          },
          g, lenience);
    } else {
      n = detail::accept_proposals_with<false>(drafts, p_at, g, lenience);
    }
    load_through(n);  // the row of the final draw (rows before it were read by the decisions)
    const bool beta = options_.collect_beta;
    double beta_sum = 0.0;
    for (std::size_t i = 0; i < n; ++i) beta_sum += read_accepted_row(i, target_rows, screen);
    // The one draw: from the residual at position n + 1, or the bonus token from p_{gamma+1}.
    const std::span<const value_type> p(target_rows.row(n));
    detail::row_screen<value_type> p_screen;
    const auto screen_block = [&](std::size_t first, std::size_t count)
                                  SPECDEC_LAMBDA_INLINE { p_screen.add(p.data() + first, count); };
    const double u = uniform01<double>(g);
    if (n < drafted) {
      detail::residual_outcome draw{};
      if constexpr (draft_is_model) {
        // beta_{n+1} = sum min(p, q) = sum p - sum max(0, p - q): from the residual's pass.
        const bool sum_p = screen || (beta && lenience == 1.0);
        const std::span<const value_type> c(draft_row_at_[n], vocab_size_);
        const auto factor = static_cast<value_type>(lenience * draft_scales_[n]);
        draw = sum_p ? detail::residual_draw(p, c, factor, u, screen_block)
                     : detail::residual_draw(p, c, factor, u);
        if (beta) {
          beta_sum += lenience == 1.0 ? p_screen.total() - draw.mass : beta_of_row(n, target_rows);
        }
      } else {
        const auto x = static_cast<std::size_t>(drafts[n]);
        draw = screen ? detail::residual_one_hot_draw(p, x, lenience, u, screen_block)
                      : detail::residual_one_hot_draw(p, x, lenience, u);
        if (beta) beta_sum += static_cast<double>(p[x]);
      }
      if (screen) check_screen(p_screen, p, "target", n);
      record_verdict(result, n, draw.token, token_source::correction, draw.fallback);
    } else {
      const token_id token =
          screen ? detail::draw_from_target(p, u, screen_block) : detail::draw_from_target(p, u);
      if (screen) check_screen(p_screen, p, "target", n);
      record_verdict(result, n, token, token_source::bonus, false);
    }
    if (beta) {
      result.beta_positions = std::min(n + 1, drafted);
      result.beta_sum = beta_sum;
    }
  }

  void record_verdict(StepResult& result, std::size_t accepted, token_id token, token_source source,
                      bool fallback) {
    result.accepted = accepted;
    result.residual_fallback = fallback;
    step_tokens_[accepted] = token;
    step_sources_[accepted] = source;
  }

  // The whole-row reads of accepted position i: beta_i (collect_beta; fused with the
  // screen) and the screen alone otherwise. Returns beta_i (0 without collect_beta).
  double read_accepted_row(std::size_t i, RowsView<const value_type> target_rows, bool screen) {
    const std::span<const value_type> p(target_rows.row(i));
    double beta = 0.0;
    if (options_.collect_beta) {
      if constexpr (draft_is_model) {
        const value_type* c = draft_row_at_[i];
        const auto factor = static_cast<value_type>(draft_scales_[i]);
        detail::row_screen<value_type> p_screen;
        if (screen) {
          beta = detail::overlap_mass<true>(p.data(), c, factor, vocab_size_, p_screen);
          check_screen(p_screen, p, "target", i);
        } else {
          beta = detail::overlap_mass<false>(p.data(), c, factor, vocab_size_, p_screen);
        }
        return beta;
      } else {
        beta = static_cast<double>(p[static_cast<std::size_t>(sequence_[base_length_ + i])]);
      }
    }
    if (screen && !detail::plausible_probability_row(p.data(), vocab_size_,
                                                     default_sum_tolerance<value_type>)) {
      reject_probability_row(p, "target", i);
    }
    return beta;
  }

  // beta_i = sum min(p_i, q_i) in a pass of its own (a lenient residual's mass is not 1 - beta).
  [[nodiscard]] double beta_of_row(std::size_t i, RowsView<const value_type> target_rows) const {
    detail::row_screen<value_type> unused;
    return detail::overlap_mass<false>(target_rows.row(i).data(), draft_row_at_[i],
                                       static_cast<value_type>(draft_scales_[i]), vocab_size_,
                                       unused);
  }

  // --- sparse rows (top-k truncation) ------------------------------------------------------

  // Rows truncated by top-k are kept as their survivors (Standardizer::apply_sparse): a
  // step reads each model row once (validation, then the selection), and verification,
  // beta and the draws run over at most top_k entries per row.
  [[nodiscard]] bool sparse_mode() const noexcept {
    return standardizer_.sparse_for(vocab_size_) && !tree_mode();
  }
  [[nodiscard]] std::size_t sparse_width() const noexcept { return options_.sampling.top_k; }
  [[nodiscard]] detail::sparse_row<value_type> sparse_draft(std::size_t i) const noexcept {
    return {draft_ids_.data() + i * sparse_width(), draft_weights_.data() + i * sparse_width(),
            draft_counts_[i]};
  }
  [[nodiscard]] detail::sparse_row<value_type> sparse_target(std::size_t i) const noexcept {
    return {target_ids_.data() + i * sparse_width(), target_weights_.data() + i * sparse_width(),
            target_counts_[i]};
  }

  // Standardizes a model row into sparse slot i of the draft or target side.
  // Size check, then the selection pass, with validation (validate_rows) fused into it.
  template <class U>
  std::size_t load_sparse(std::span<const U> row, bool draft_side, std::size_t i,
                          double& top_probability) {
    const std::string_view model = draft_side ? "draft" : "target";
    check_size(row, model, i);
    const std::size_t width = sparse_width();
    std::uint32_t* ids = (draft_side ? draft_ids_ : target_ids_).data() + i * width;
    value_type* weights = (draft_side ? draft_weights_ : target_weights_).data() + i * width;
    detail::row_screen<U> screen;
    const std::size_t count =
        standardizer_.apply_sparse(row, std::span<value_type>(sparse_scratch_row_), ids, weights,
                                   top_probability, options_.validate_rows ? &screen : nullptr);
    if (options_.validate_rows) check_screen(screen, row, model, i);
    (draft_side ? draft_counts_ : target_counts_)[i] = count;
    return count;
  }

  // verify() over sparse rows: the same decisions (detail::accept_drafts_with and
  // accept_proposals_with read two survivors' weights per position), then the residual or
  // bonus draw and beta over survivors.
  template <class G, class LoadThrough>
  void verify_sparse(G& g, StepResult& result, LoadThrough&& load_through) {
    const std::size_t drafted = result.drafted;
    const std::span<const token_id> drafts(sequence_.data() + base_length_, drafted);
    result.nodes_scored = drafted;
    const double lenience = options_.lenience;
    const auto p_at = [&](std::size_t i, std::size_t x) {
      load_through(i);
      return static_cast<double>(sparse_target(i).at(x));
    };
    std::size_t n = 0;
    if constexpr (draft_is_model) {
      n = detail::accept_drafts_with(
          drafts, p_at,
          [this](std::size_t i, std::size_t x) {
            return static_cast<double>(sparse_draft(i).at(x));
          },
          g, lenience);
    } else {
      n = detail::accept_proposals_with(drafts, p_at, g, lenience);
    }
    load_through(n);  // the row of the final draw
    const bool beta = options_.collect_beta;
    double beta_sum = 0.0;
    const auto beta_at = [&](std::size_t i) {
      if constexpr (draft_is_model) {
        return detail::sparse_overlap(sparse_target(i), sparse_draft(i));
      } else {
        return p_at(i, static_cast<std::size_t>(drafts[i]));
      }
    };
    if (beta) {
      for (std::size_t i = 0; i < n; ++i) beta_sum += beta_at(i);
    }
    const double u = uniform01<double>(g);
    if (n < drafted) {
      detail::sparse_residual_outcome draw{};
      if constexpr (draft_is_model) {
        draw = detail::sparse_residual_draw(sparse_target(n), sparse_draft(n),
                                            static_cast<value_type>(lenience), u,
                                            sparse_scratch_.data());
      } else {
        draw = detail::sparse_residual_one_hot_draw(
            sparse_target(n), static_cast<std::size_t>(drafts[n]), lenience, u);
      }
      if (beta) beta_sum += beta_at(n);
      record_verdict(result, n, static_cast<token_id>(draw.token), token_source::correction,
                     draw.fallback);
    } else {
      const auto token = static_cast<token_id>(detail::sparse_draw(sparse_target(n), u, 0));
      record_verdict(result, n, token, token_source::bonus, false);
    }
    if (beta) {
      result.beta_positions = std::min(n + 1, drafted);
      result.beta_sum = beta_sum;
    }
  }

  // Emits x_1..x_n, t into sequence_ (replacing the drafts) and step_tokens_, cut after a
  // stop condition; sets result.tokens, result.sources and result.stop.
  void emit(StepResult& result, std::size_t max_tokens, std::size_t stop_floor) {
    const std::size_t count = result.accepted + 1;
    for (std::size_t k = 0; k < result.accepted; ++k) {
      step_tokens_[k] = sequence_[base_length_ + k];
      step_sources_[k] = token_source::draft;
    }
    sequence_.resize(base_length_);
    const StopConditions::Cut cut = stops_.emit(
        std::span<const token_id>(step_tokens_.data(), count), sequence_, stop_floor, max_tokens);
    result.stop = cut.reason;
    result.tokens = std::span<const token_id>(step_tokens_.data(), cut.taken);
    result.sources = std::span<const token_source>(step_sources_.data(), cut.taken);
  }

  TargetModel* target_;
  DraftModel* draft_;
  DecoderOptions options_;
  std::size_t vocab_size_;
  Standardizer<value_type> standardizer_;
  StopConditions stops_;
  std::vector<value_type> draft_rows_;  // q_1..q_gamma up to a factor (draft_scales_)
  std::vector<double> draft_scales_;    // q_i = draft_scales_[i] * draft row i
  // Draft row i of the step: in draft_rows_, or the model's own row (stable_rows).
  std::vector<const value_type*> draft_row_at_;
  // Sparse mode (top-k truncation): the survivors of each row, top_k slots per row.
  std::vector<std::uint32_t> draft_ids_;
  std::vector<value_type> draft_weights_;
  std::vector<std::size_t> draft_counts_;
  std::vector<std::uint32_t> target_ids_;
  std::vector<value_type> target_weights_;
  std::vector<std::size_t> target_counts_;
  std::vector<value_type> sparse_scratch_;      // top_k residual weights
  std::vector<value_type> sparse_scratch_row_;  // V entries: apply_sparse's scratch
  std::vector<value_type> target_rows_;         // p_1..p_{gamma+1} when not used in place
  std::vector<token_id> sequence_;              // context, then drafts / emitted tokens
  std::vector<token_id> step_tokens_;
  std::vector<token_source> step_sources_;
  TreeOptions tree_options_{};                    // tree steps only
  TreeStepWorkspace<value_type> tree_workspace_;  // tree steps only
  std::size_t workspace_gamma_ = 0;
  std::size_t prompt_length_ = 0;
  std::size_t base_length_ = 0;  // context length at the start of the current step
  std::size_t step_index_ = 0;
  DecoderStatistics statistics_;
};

}  // namespace specdec
