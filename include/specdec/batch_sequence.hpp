// specdec — the sequences of a batch decoder (batch_decoder.hpp): what an engine asks for
// (SequenceRequest), what it gets back (FinishedSequence), the model concepts of batched
// scoring and drafting, and the state the decoder's stages keep per active sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/stop_conditions.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

/// One sequence's part of a batched target call: its context (prompt and generated tokens)
/// and this step's drafts.
struct BatchScoreRequest {
  std::span<const token_id> context;
  std::span<const token_id> drafts;
  /// The sequence's id (SequenceRequest::id): what an engine keys its KV cache on. A
  /// sequence keeps its id until it leaves the batch (release_sequence).
  std::uint64_t id = 0;
};

/// `model.score_batch(requests)`: for each request in order, the rows of the prefixes
/// context, context + drafts[0..1), ..., context + drafts: sum of (drafts + 1) rows.
// clang-format off
template <class M>
concept HasBatchScoring = requires(M& model, std::span<const BatchScoreRequest> requests) {
  { model.score_batch(requests) } -> ProbabilityMatrix;
};
// clang-format on

/// A LanguageModel that scores the drafted prefixes of many sequences in one call (one
/// forward pass over the ragged batch). Row k of request b's block must equal
/// next_token_probabilities of context + drafts[0..k).
template <class M>
concept BatchScoringModel = LanguageModel<M> && HasBatchScoring<M>;

/// `model.draft_batch(requests)`: for each request in order, ONE row: the next-token row
/// after context + drafts (the drafts made so far this step).
// clang-format off
template <class M>
concept HasBatchDrafting = requires(M& model, std::span<const BatchScoreRequest> requests) {
  { model.draft_batch(requests) } -> ProbabilityMatrix;
};
// clang-format on

/// A draft LanguageModel that drafts the next token of many sequences in one call. The
/// batch decoder then drafts position by position for every sequence together: gamma_max
/// calls per step instead of one per drafted token. Row b must equal
/// next_token_probabilities of request b's context + drafts.
template <class M>
concept BatchDraftModel = LanguageModel<M> && HasBatchDrafting<M>;

/// `model.release_sequence(id)`: the sequence left the batch; a model with per-sequence
/// state (a KV cache per sequence) frees it. Optional; called on the target and the draft
/// model (once if they are the same object) when a sequence finishes or fails.
template <class M>
concept HasSequenceRelease = requires(M& model, std::uint64_t id) {
  model.release_sequence(id);
};

/// What a sequence asks for.
struct SequenceRequest {
  std::uint64_t id = 0;            ///< the engine's id: names the sequence, keys its stream
  std::vector<token_id> prompt{};  ///< the context before the first generated token
  std::size_t max_new_tokens = 64;
  std::uint64_t seed = 0;
  SamplingOptions sampling{};  ///< applied alike to its p and q rows (T = 0: greedy)
  /// Drafts per step (fewer near max_new_tokens): any GammaPolicy, observed after each of
  /// the sequence's steps; FixedGamma{4} by default. Policies that need timing are rejected
  /// (the batch decoder does not time sequences one by one). With a batch gamma planner
  /// (BatchDecoderOptions::batch_gamma) the planner chooses the draft length instead and
  /// only the policy's continue_drafting is asked (a ConfidenceStop still stops early).
  AnyGammaPolicy gamma_policy{};
  std::vector<token_id> stop_tokens{};  ///< generation ends after emitting one of these
  /// Generation ends right after its generated tokens end with one of these (non-empty;
  /// the prompt is not matched).
  std::vector<std::vector<token_id>> stop_sequences{};
  /// How its model drafts are verified at T > 0 (DecoderOptions::verification): automatic
  /// and block use block verification, token Algorithm 1.
  verification_rule verification = verification_rule::automatic;
};

/// Why a sequence left the batch.
enum class sequence_end : std::uint8_t {
  max_new_tokens,  ///< it generated max_new_tokens tokens
  stop_token,      ///< it emitted one of its stop tokens (the last token of its output)
  stop_sequence,   ///< its output ends with one of its stop sequences
  failed,          ///< an error of its own (its model rows, its draft model); see error
};

/// A sequence that left the batch: its tokens and how it went.
struct FinishedSequence {
  std::uint64_t id = 0;
  std::vector<token_id> tokens;  ///< generated tokens (the prompt excluded)
  sequence_end end = sequence_end::max_new_tokens;
  std::size_t steps = 0;     ///< its decoding steps
  std::size_t drafted = 0;   ///< drafts verified
  std::size_t accepted = 0;  ///< drafts accepted
  std::exception_ptr error;  ///< a specdec::error naming it when end == failed
};

namespace detail {

/// An active sequence of a BatchDecoder, as its stages see it (T: the target's scalar type).
template <class T>
struct BatchSequence {
  SequenceRequest request;
  std::vector<token_id> context;  ///< prompt + generated (+ this step's drafts while drafting)
  FinishedSequence result;
  Standardizer<T> standardizer;
  std::exception_ptr failure;     ///< this step's draft failure
  std::size_t base = 0;           ///< batched drafting: context size before the drafts
  std::size_t goal = 0;           ///< batched drafting: drafts wanted (cut by early stops)
  xoshiro256pp draft_stream{0};   ///< batched drafting: the step's draft stream
  SequenceAcceptance acceptance;  ///< for the batch gamma planner
  StopConditions stops;

  /// "sequence 7 (step 3)": how its errors name it.
  [[nodiscard]] std::string name() const {
    return "sequence " + std::to_string(request.id) + " (step " + std::to_string(result.steps) +
           ")";
  }
};

}  // namespace detail

}  // namespace specdec
