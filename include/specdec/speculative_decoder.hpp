// specdec — SpeculativeDecoder: the generation loop of speculative decoding (paper Sec. 2.3,
// Algorithm 1 applied step after step), with standardized sampling on both sides, stop
// conditions, statistics, streaming, and a step-wise API for engines with their own loop.
//
// One step (DESIGN.md "One decoding step"), each stage in its own header (docs/pipeline.md):
//  1. gamma = gamma_policy.next_gamma(). A step emits up to gamma + 1 tokens; what would pass
//     max_new_tokens is dropped (a prefix of an exact sample is exact), never emitted.
//  2. Draft (draft_stage.hpp), from any Drafter (concepts.hpp). A LanguageModel draft is
//     called once per token on context + x_1..x_{i-1}; its row is standardized
//     (sampling.hpp) into the stage (at T = 1: copied, its normaliser kept as a scalar), and
//     the stage itself draws x_i from it — so the q in the acceptance ratio is always the q
//     the token came from.
//     Greedy (T = 0) drafts the argmax. A ProposalDrafter is called once and its tokens are
//     verified with a one-hot q. After each drafted token the policy's
//     continue_drafting(top probability of the standardized q row, drafted) may end drafting
//     (greedy LM drafts pass the raw row's top probability, proposal drafters pass 1.0, and
//     at T = 1 a policy whose needs_top_probability() is false gets 1.0: the maximum is not
//     taken); drafting also ends right after a stop token.
//  3. Score (score_stage.hpp). A BatchedLanguageModel target scores all gamma + 1 prefixes in
//     ONE score_draft call; any other target is called once per prefix. Target rows get the
//     same standardization as draft rows; a batched target's rows are standardized (with
//     their checks) when verification first reads them, so rows after the first rejection
//     cost nothing and are not checked, as when its rows are used in place.
//  4. Verify (verify_stage.hpp): Algorithm 1's decisions (detail::accept_drafts for a
//     LanguageModel draft, accept_proposals for a proposal drafter: the loops of
//     verify_speculative and verify_speculative_proposals) and the residual or bonus draw,
//     with validation and beta fused into the passes over whole rows; exact match for
//     T = 0 (verify_greedy).
//  5. Emit (stop_conditions.hpp): x_1..x_n, t, cut right after a stop token or stop sequence;
//     the policy observes the outcome; statistics are recorded; the streaming callback sees
//     each token.
// Errors of every stage are located by StepChecks (step_checks.hpp).
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
// draft or a MultiProposalDrafter): steps 1-4 are replaced by one tree step
// (tree_stage.hpp, tree_verification.hpp): a tree of that shape is drafted from the standardized q
// rows (top-k for greedy), or a proposal tree of the drafter's continuations within the shape's
// limits (ProposalTreeLimits::from_shape: one continuation per root-to-leaf path, its
// depth, its node count) is built, scored by the target (one score_tree call for a
// TreeScoringModel) and verified exactly (traversal verification for sampled trees under the
// default DecoderOptions::verification); the emitted path and t then go through step 5
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
#include "specdec/draft_stage.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/score_stage.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/step_checks.hpp"
#include "specdec/stop_conditions.hpp"
#include "specdec/tree_stage.hpp"
#include "specdec/tree_verification.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"
#include "specdec/verify_stage.hpp"

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
  ///    screening pass for an accepted row without beta. Algorithm 1 reads p_1..p_{n+1},
  ///    so checks them; rows after the one the final token comes from are never read, so
  ///    not checked. Block verification (the default for model drafts at T > 0) reads
  ///    p_{n+1}..p_gamma whole too (the residual masses Z of its scan, from the top down)
  ///    and checks them in those passes, so a bad row above n can be the first reported;
  ///    rows after a draft that p rules out are not read;
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
  /// How steps verify a LanguageModel draft's tokens at T > 0. automatic (the default):
  /// the path-level rules at lenience 1, exact and never fewer accepted drafts in
  /// expectation: block verification for chains (block_verification.hpp: the drafted block
  /// decided as a whole), traversal verification for tree steps (traversal_verification.hpp:
  /// whole paths from the leaves up); Algorithm 1 with lenience < 1 (the path-level rules
  /// are defined for exact sampling only). token: Algorithm 1 for chains and recursive
  /// rejection for trees (to reproduce token-level runs). block: the path-level rules, also
  /// for proposal trees; an invalid_option error with lenience < 1. Proposal drafters and
  /// greedy decoding verify token by token under automatic (with one-hot drafts the
  /// path-level rule accepts the same number of drafts in expectation on a chain).
  verification_rule verification = verification_rule::automatic;
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
  /// Accepted drafts per step: what block verification raises over Algorithm 1
  /// (DecoderOptions::verification); 0 before the first step.
  [[nodiscard]] double accepted_per_step() const noexcept {
    return steps == 0 ? 0.0 : static_cast<double>(accepted_tokens) / static_cast<double>(steps);
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

// DecoderOptions' own checks (errc::invalid_option naming the option), then the
// vocabularies (errc::invalid_size for V = 0, errc::vocab_mismatch for a LanguageModel draft
// of another size); the decoder adds the stop conditions.
inline void check_decoder_options(const DecoderOptions& options, std::size_t vocab_size,
                                  std::size_t draft_vocab_size, bool draft_is_model,
                                  bool draft_proposes_trees) {
  if (!(options.lenience > 0.0 && options.lenience <= 1.0)) {
    detail::throw_error(errc::invalid_option, "decoder option lenience = ", options.lenience,
                        " must be in (0, 1]");
  }
  if (options.sampling.greedy() && options.lenience != 1.0) {
    detail::throw_error(errc::invalid_option, "decoder option lenience = ", options.lenience,
                        " needs temperature > 0 (greedy decoding verifies by exact match)");
  }
  if (options.tree_shape.draft_size() > 0) {
    if (!draft_is_model && !draft_proposes_trees) {
      detail::throw_error(errc::invalid_option, "decoder option tree_shape (",
                          options.tree_shape.draft_size(),
                          " draft nodes) needs a LanguageModel draft or a MultiProposalDrafter "
                          "(propose_many); a drafter with propose() alone uses the chain path "
                          "(leave tree_shape at the root alone)");
    }
    if (options.lenience != 1.0) {
      detail::throw_error(errc::invalid_option, "decoder option tree_shape (",
                          options.tree_shape.draft_size(), " draft nodes) needs lenience = 1, not ",
                          options.lenience);
    }
    if (options.tree_sampling != expansion::with_replacement &&
        options.tree_sampling != expansion::without_replacement) {
      detail::throw_error(errc::invalid_option,
                          "decoder option tree_sampling = ", to_string(options.tree_sampling),
                          " must be with_replacement or without_replacement");
    }
  }
  if (options.verification == verification_rule::block && options.lenience != 1.0) {
    detail::throw_error(errc::invalid_option,
                        "decoder option verification = block needs lenience = 1 (block "
                        "verification is defined for exact sampling), not ",
                        options.lenience);
  }
  if (options.gamma_policy.next_gamma() == 0) {
    detail::throw_error(errc::invalid_option,
                        "decoder option gamma_policy: next_gamma() is 0, must be >= 1");
  }
  if (vocab_size == 0) detail::throw_error(errc::invalid_size, "target model: vocab_size() is 0");
  if (draft_is_model && draft_vocab_size != vocab_size) {
    detail::throw_error(errc::vocab_mismatch, "draft model has vocab_size() ", draft_vocab_size,
                        " but the target model has ", vocab_size);
  }
}

}  // namespace detail

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
        standardizer_(checked_sampling(options_.sampling)),
        checks_(vocab_size_, options_.validate_rows, options_.sampling.greedy()) {
    check_options();
    standardizer_.reserve(vocab_size_);
    if (tree_mode()) {
      // A step emits at most max_depth + 1 tokens; the tree buffers warm up on first use.
      const std::size_t depth = options_.tree_shape.max_depth();
      step_tokens_.resize(depth + 1);
      step_sources_.resize(depth + 1);
      statistics_.accepted_histogram.reserve(depth + 1);
      workspace_gamma_ = depth;
      tree_stage_ = TreeStage<value_type>(
          TreeOptions{options_.tree_shape, options_.tree_sampling, options_.tree_merge_repeats,
                      options_.sampling.greedy(), options_.validate_rows, options_.verification});
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
    // Before anything changes: the last result stays intact.
    checks_.check_context(prompt, "prompt", 0);
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
    checks_.check_context(context, "context", step_index_);
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
    if (tree_mode()) tree_stage_.reserve(length);
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
    std::size_t draft_vocab = vocab_size_;
    if constexpr (draft_is_model) draft_vocab = static_cast<std::size_t>(draft_->vocab_size());
    detail::check_decoder_options(options_, vocab_size_, draft_vocab, draft_is_model,
                                  draft_proposes_trees);
    stops_.assign(options_.stop_tokens, options_.stop_sequences, vocab_size_, "decoder option ");
  }

  [[nodiscard]] bool tree_mode() const noexcept {
    return (draft_is_model || draft_proposes_trees) && options_.tree_shape.draft_size() > 0;
  }
  // Block verification for this decoder's chain steps (DecoderOptions::verification): model
  // drafts at T > 0 and lenience 1, unless the token rule is asked for.
  [[nodiscard]] bool uses_block() const noexcept {
    return draft_is_model && !options_.sampling.greedy() && options_.lenience == 1.0 &&
           options_.verification != verification_rule::token;
  }
  // Rows truncated by top-k are kept as their survivors (chain steps).
  [[nodiscard]] bool sparse_mode() const noexcept {
    return standardizer_.sparse_for(vocab_size_) && !tree_mode();
  }

  // Sizes the stages for steps of up to `gamma` drafts (a steady state allocates nothing).
  void grow_workspace(std::size_t gamma) {
    if (gamma <= workspace_gamma_ && !step_tokens_.empty()) return;
    gamma = std::max(gamma, workspace_gamma_);
    const bool sparse = sparse_mode();
    const std::size_t width = options_.sampling.top_k;
    if constexpr (draft_is_model) {
      using keeping = typename DraftStage<value_type>::keeping;
      keeping how = keeping::copies;
      if (options_.sampling.greedy()) {
        how = keeping::none;
      } else if (sparse) {
        how = keeping::survivors;
      } else if (draft_rows_in_place && options_.sampling.identity()) {
        how = keeping::in_place;  // the model's rows, no copies to keep
      }
      draft_stage_.resize(gamma, vocab_size_, how, width);
    }
    // Top-p rows at T = 1 are read in place by the chain's verification of model drafts.
    score_stage_.resize(gamma + 1, vocab_size_, sparse, width,
                        ScoreStage<value_type>::template in_place<TargetModel>(options_.sampling),
                        draft_is_model && !sparse);
    if (sparse) residual_.resize(width);
    step_tokens_.resize(gamma + 1);
    step_sources_.resize(gamma + 1);
    statistics_.accepted_histogram.reserve(gamma + 1);
    sequence_.reserve(sequence_.size() + gamma + 1);
    workspace_gamma_ = gamma;
  }

  // --- the step: draft -> score -> verify -> emit, then the bookkeeping ----------------------

  template <class G>
  StepResult run_step(G& g, std::size_t max_tokens, std::size_t stop_floor) {
    base_length_ = sequence_.size();
    checks_.begin(step_index_, base_length_);
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

  [[nodiscard]] double now() const { return detail::clock_seconds(options_.clock); }

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

  // Draft stage (draft_stage.hpp): up to `gamma` tokens into sequence_ after the context;
  // returns how many.
  template <class G>
  std::size_t draft_tokens(std::size_t gamma, G& g, StepResult& result) {
    if (gamma == 0) return 0;
    if constexpr (draft_is_model) {
      return draft_stage_.template draft<draft_rows_in_place>(
          *draft_, sequence_, gamma, g, options_.gamma_policy, stops_, standardizer_, checks_,
          result.draft_calls);
    } else {
      return propose(*draft_, sequence_, gamma, options_.gamma_policy, stops_, checks_,
                     result.draft_calls);
    }
  }

  // Score and verify stages (score_stage.hpp, verify_stage.hpp): the target's rows for the
  // drafted prefixes, verified as they are loaded; the verdict goes to result and t to
  // step_tokens_[n].
  template <class G>
  void score_and_verify(G& g, StepResult& result) {
    const std::size_t drafted = result.drafted;
    const std::span<const token_id> context(sequence_.data(), base_length_);
    const std::span<const token_id> drafts(sequence_.data() + base_length_, drafted);
    result.nodes_scored = drafted;
    const VerifyRules rules{options_.lenience, options_.collect_beta};
    StepVerdict verdict;
    score_stage_.score(
        *target_, context, drafts, standardizer_, checks_, result.target_calls,
        [&](RowsView<const value_type> rows, bool in_place, detail::row_loader load_through) {
          if (options_.sampling.greedy()) {
            verdict = verify_greedy_rows(drafts, rows, rules, checks_, load_through);
          } else if (sparse_mode()) {
            const auto p = [&](std::size_t i) {
              load_through(i);
              return score_stage_.survivors(i);
            };
            const auto q = [&](std::size_t i) {
              if constexpr (draft_is_model) return draft_stage_.survivors(i);
              return detail::sparse_row<value_type>{};
            };
            verdict =
                uses_block()
                    ? verify_survivors_block(drafts, p, q, rules, g, residual_.data())
                    : verify_survivors(drafts, p, q, !draft_is_model, rules, g, residual_.data());
          } else if (uses_block()) {
            verdict =
                verify_dense_block(drafts, rows, draft_stage_, in_place && options_.validate_rows,
                                   rules, checks_, g, load_through, score_stage_.nucleus());
          } else {
            verdict = verify_dense<draft_is_model>(
                drafts, rows, draft_stage_, in_place && options_.validate_rows, rules, checks_, g,
                load_through, score_stage_.nucleus());
          }
        });
    result.accepted = verdict.accepted;
    result.residual_fallback = verdict.fallback;
    result.beta_sum = verdict.beta_sum;
    result.beta_positions = verdict.beta_positions;
    step_tokens_[verdict.accepted] = verdict.token;
    step_sources_[verdict.accepted] = verdict.source;
  }

  // One tree step (tree_stage.hpp) in place of drafting, scoring and verification: leaves
  // the accepted path in sequence_ and t in step_tokens_[n], as score_and_verify() does,
  // then emits through the common cut.
  template <class G>
  StepResult run_tree_step(G& g, std::size_t max_tokens, std::size_t stop_floor) {
    StepResult result;
    if constexpr (draft_is_model || draft_proposes_trees) {
      try {
        const TreeStepResult tree = tree_stage_.step(
            *target_, *draft_, std::span<const token_id>(sequence_.data(), base_length_), g,
            step_index_, standardizer_, checks_);
        result.drafted = tree.nodes_scored;
        result.nodes_scored = tree.nodes_scored;
        result.accepted = tree.accepted();
        result.residual_fallback = tree.verification.residual_fallback;
        result.target_calls = tree.target_calls;
        result.draft_calls = tree.draft_calls;
        for (std::size_t k = 0; k < result.accepted; ++k) sequence_.push_back(tree.tokens[k]);
        step_tokens_[result.accepted] = tree.tokens[result.accepted];
        step_sources_[result.accepted] = tree.source(result.accepted);
        emit(result, max_tokens, stop_floor);
        statistics_.record(result);
      } catch (...) {
        sequence_.resize(base_length_);
        throw;
      }
    }
    return result;
  }

  // Emit stage (stop_conditions.hpp): x_1..x_n, t into sequence_ (replacing the drafts) and
  // step_tokens_, cut after a stop condition; sets result.tokens, result.sources and
  // result.stop.
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
  StepChecks checks_;
  StopConditions stops_;
  DraftStage<value_type> draft_stage_;
  ScoreStage<value_type> score_stage_;
  std::vector<value_type> residual_;   // top-k: the residual's weights
  std::vector<token_id> sequence_;     // context, then drafts / emitted tokens
  std::vector<token_id> step_tokens_;  // x_1..x_n, t of the step
  std::vector<token_source> step_sources_;
  TreeStage<value_type> tree_stage_;  // tree steps only
  std::size_t workspace_gamma_ = 0;
  std::size_t prompt_length_ = 0;
  std::size_t base_length_ = 0;  // context length at the start of the current step
  std::size_t step_index_ = 0;
  DecoderStatistics statistics_;
};

}  // namespace specdec
