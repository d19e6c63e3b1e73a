// specdec — the batch decoder: many sequences, one target call per step for all of them.
//
// A serving engine keeps a set of active sequences; each step drafts for every one of them,
// scores every drafted prefix of every sequence in ONE target call (a BatchScoringModel;
// models without batch scoring are called per sequence), verifies the ragged batch
// (batch_verification.hpp, on the verifier's threads) and appends each sequence's tokens.
// Sequences join (add) and leave (finishing: max tokens, a stop token, or an error of their
// own) between steps: continuous batching.
//
// Each sequence is decoded exactly as speculative sampling from its own target law: its
// drafts are sampled from its draft rows standardized by its options with the stream
// stream_engine({seed, id, step}, draft), verified with stream_engine({seed, id, step}),
// where step counts that sequence's own steps. With models whose rows depend only on the
// context (the LanguageModel contract), a sequence's tokens therefore depend only on its
// request: never on the other sequences, on when it joined, or on the number of threads
// (tests/batch_decoder_test.cpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/batch_gamma.hpp"
#include "specdec/batch_verification.hpp"
#include "specdec/concepts.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/stop_conditions.hpp"
#include "specdec/validation.hpp"

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

/// Options of a BatchDecoder.
struct BatchDecoderOptions {
  /// Threads of the verifier's pool (0: one per hardware thread).
  std::size_t threads = 0;
  /// BatchVerifier::set_parallel_threshold: steps whose verification reads fewer entries run
  /// on the calling thread (0: always on the pool).
  std::size_t parallel_threshold = std::size_t{1} << 20U;
  /// Validate every row a step reads (BatchVerifier::verify_checked): a sequence with a bad
  /// row fails alone. Off: rows are preconditions.
  bool validate_rows = true;
  /// Called after every step for each sequence that emitted tokens, with its id and them,
  /// once the step is complete (an exception from it propagates out of step(), every
  /// sequence's tokens already in place; the step's later callbacks are skipped).
  std::function<void(std::uint64_t id, std::span<const token_id> tokens)> on_tokens{};
  /// Draft lengths chosen for the whole batch each step (batch_gamma.hpp): from each
  /// sequence's measured acceptance and the measured (or given) cost of a target call as a
  /// function of the positions it scores. Empty: each sequence's own gamma_policy decides.
  /// Steps in which a sequence takes its first step are not measured: a KV-cache engine
  /// evaluates that sequence's prompt in them (prefill), which drafting does not cost.
  std::optional<BatchGammaOptions> batch_gamma{};
  /// Time source of the planner's measurements (read only with batch_gamma and no given
  /// target_cost): before drafting, before scoring and after verification. Seconds on any
  /// monotonic scale; empty is std::chrono::steady_clock. A simulated clock makes measured
  /// costs, and so the planner's choices, reproducible.
  std::function<double()> clock{};
};

/// Decodes many sequences together. `Target` is a LanguageModel (BatchScoringModel: one call
/// per step; BatchedLanguageModel: score_draft per sequence; else one call per prefix);
/// `Draft` a LanguageModel (drafts sampled from its rows) or a ProposalDrafter. Both models
/// are called on the thread calling step(); verification runs on the verifier's threads.
template <LanguageModel Target, Drafter Draft>
class BatchDecoder {
 public:
  using value_type = typename detail::model_row_traits<Target>::scalar;

  /// Throws specdec::error (errc::vocab_mismatch) if a draft LanguageModel's vocabulary
  /// differs from the target's, errc::invalid_size if the target's is 0.
  BatchDecoder(Target& target, Draft& draft, BatchDecoderOptions options = {})
      : target_(&target),
        draft_(&draft),
        options_(std::move(options)),
        verifier_(options_.threads),
        vocab_size_(target.vocab_size()) {
    if (options_.batch_gamma) planner_.emplace(*options_.batch_gamma);
    verifier_.set_parallel_threshold(options_.parallel_threshold);
    if (vocab_size_ == 0)
      detail::throw_error(errc::invalid_size, "target model: vocab_size() is 0");
    if constexpr (LanguageModel<Draft>) {
      if (static_cast<std::size_t>(draft.vocab_size()) != vocab_size_) {
        detail::throw_error(errc::vocab_mismatch, "draft model has vocab_size() ",
                            draft.vocab_size(), " but the target model has ", vocab_size_);
      }
    }
  }

  /// Adds a sequence; it takes part from the next step. Throws specdec::error, adding
  /// nothing: errc::invalid_option for sampling options out of range, a gamma policy starting
  /// at 0 or needing timing, max_new_tokens
  /// 0, an id already active, or a stop token outside [0, V); errc::invalid_token for a
  /// prompt token outside [0, V).
  void add(SequenceRequest request) {
    const auto where = "sequence " + std::to_string(request.id) + ": ";
    try {
      request.sampling.validate();
    } catch (const error& e) {
      throw error(e.code(), where + detail::bare_message(e));
    }
    if (request.gamma_policy.next_gamma() == 0) {
      detail::throw_error(errc::invalid_option, where,
                          "gamma_policy: next_gamma() is 0, must be >= 1");
    }
    if (request.gamma_policy.needs_timing()) {
      detail::throw_error(errc::invalid_option, where,
                          "gamma_policy needs timing, which the batch decoder does not measure "
                          "per sequence");
    }
    if (request.max_new_tokens == 0) {
      detail::throw_error(errc::invalid_option, where, "max_new_tokens must be >= 1");
    }
    for (const Active& active : active_) {
      if (active.request.id == request.id) {
        detail::throw_error(errc::invalid_option, where, "the id is already in the batch");
      }
    }
    StopConditions stops;
    stops.assign(request.stop_tokens, request.stop_sequences, vocab_size_, where);
    for (std::size_t j = 0; j < request.prompt.size(); ++j) {
      const token_id token = request.prompt[j];
      if (token < 0 || static_cast<std::size_t>(token) >= vocab_size_) {
        detail::throw_error(errc::invalid_token, where, "prompt token at position ", j, ": id ",
                            token, " is outside [0, ", vocab_size_, ")");
      }
    }
    Active active;
    active.stops = std::move(stops);
    // Room for the whole sequence and the buffers its standardization uses: its steps do not
    // allocate (a step's drafts stop short of max_new_tokens).
    active.context.reserve(request.prompt.size() + request.max_new_tokens);
    active.context = request.prompt;
    active.result.tokens.reserve(request.max_new_tokens);
    active.standardizer.set_options(request.sampling);
    active.standardizer.reserve(vocab_size_);
    active.request = std::move(request);
    active_.push_back(std::move(active));
  }

  /// Sequences in the batch.
  [[nodiscard]] std::size_t active() const noexcept { return active_.size(); }
  /// Target calls so far (one per step with a BatchScoringModel).
  [[nodiscard]] std::size_t target_calls() const noexcept { return target_calls_; }
  /// Steps so far.
  [[nodiscard]] std::size_t steps() const noexcept { return steps_; }

  /// One step for every active sequence; returns the tokens emitted. Sequences that finish
  /// leave the batch (take_finished). If the target model throws (or returns rows of the
  /// wrong shape) the step throws specdec::error (errc::model_failure with the model's
  /// exception nested, or errc::invalid_size) and changes nothing: every sequence keeps
  /// its tokens and its step count, so the next step() retries it.
  std::size_t step() {
    if (active_.empty()) return 0;
    ++steps_;
    // A sequence's first step also evaluates its prompt in a KV-cache engine (prefill):
    // such steps would charge that work to the drafts, so their costs are not measured.
    const bool timed = planner_ && !options_.batch_gamma->target_cost &&
                       std::none_of(active_.begin(), active_.end(),
                                    [](const Active& a) { return a.result.steps == 0; });
    if (planner_) plan_gammas();
    const double started = timed ? now() : 0.0;
    draft_all();
    const std::size_t drafts = draft_tokens_.size();
    const std::size_t positions = drafts + active_.size();
    const double drafted = timed ? now() : 0.0;
    const std::size_t emitted = score_verify_and_emit();
    if (timed) planner_->observe_step(drafts, drafted - started, positions, now() - drafted);
    return emitted;
  }

  /// Steps until no sequence is active.
  void run() {
    while (!active_.empty()) step();
  }

  /// The batch gamma planner (BatchDecoderOptions::batch_gamma), else null.
  [[nodiscard]] const BatchGammaPlanner* planner() const noexcept {
    return planner_ ? &*planner_ : nullptr;
  }
  /// The planner's plan for the last step (default-constructed without a planner).
  [[nodiscard]] const BatchGammaPlan& last_plan() const noexcept { return plan_; }
  /// The draft lengths the planner chose for the last step, in the order the sequences were
  /// in the batch then (empty without a planner). Fewer may have been drafted: a stop token,
  /// a policy's continue_drafting or a drafter proposing less ends drafting early.
  [[nodiscard]] std::span<const std::size_t> last_gammas() const noexcept { return gammas_; }

  /// The sequences that left the batch since the last call, in the order they left.
  [[nodiscard]] std::vector<FinishedSequence> take_finished() {
    std::vector<FinishedSequence> out(std::make_move_iterator(finished_.begin()),
                                      std::make_move_iterator(finished_.end()));
    finished_.clear();  // keeps its capacity: steps that finish sequences do not allocate
    return out;
  }

 private:
  struct Active {
    SequenceRequest request;
    std::vector<token_id> context;  // prompt + generated (+ this step's drafts while drafting)
    FinishedSequence result;
    Standardizer<value_type> standardizer;
    std::exception_ptr failure;     // this step's draft failure
    std::size_t base = 0;           // batched drafting: context size before the drafts
    std::size_t goal = 0;           // batched drafting: drafts wanted (cut by early stops)
    xoshiro256pp draft_stream{0};   // batched drafting: the step's draft stream
    SequenceAcceptance acceptance;  // for the batch gamma planner
    StopConditions stops;
  };

  static constexpr bool draft_is_model = LanguageModel<Draft>;

  [[nodiscard]] std::string name(const Active& sequence) const {
    return "sequence " + std::to_string(sequence.request.id) + " (step " +
           std::to_string(sequence.result.steps) + ")";
  }

  [[nodiscard]] double now() const {
    if (options_.clock) return options_.clock();
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // The planner's draft length for every sequence, into gammas_.
  void plan_gammas() {
    const std::size_t sequences = active_.size();
    alphas_.resize(sequences);
    caps_.resize(sequences);
    gammas_.resize(sequences);
    for (std::size_t b = 0; b < sequences; ++b) {
      const Active& sequence = active_[b];
      alphas_[b] = planner_->alpha(sequence.acceptance);
      caps_[b] = sequence.request.max_new_tokens - sequence.result.tokens.size() - 1;
    }
    plan_ = planner_->plan(alphas_, caps_, gammas_);
  }

  // Tells the models (those with release_sequence) that sequence `id` left. What they
  // throw is ignored: the sequence is finished either way, and its state is theirs.
  void release(std::uint64_t id) noexcept {
    if constexpr (HasSequenceRelease<Target>) {
      try {
        target_->release_sequence(id);
      } catch (...) {  // NOLINT(bugprone-empty-catch)
      }
    }
    if constexpr (HasSequenceRelease<Draft>) {
      if (static_cast<const void*>(draft_) != static_cast<const void*>(target_)) {
        try {
          draft_->release_sequence(id);
        } catch (...) {  // NOLINT(bugprone-empty-catch)
        }
      }
    }
  }

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
    for (std::size_t b = 0; b < active_.size(); ++b) {
      Active& sequence = active_[b];
      sequence.failure = nullptr;
      const std::size_t gamma = gamma_of(b);
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
  bool take_draft(Active& sequence, const Row& row, std::size_t at, xoshiro256pp& g, std::size_t i,
                  std::size_t gamma) {
    std::transform(row.begin(), row.end(), draft_rows_.begin() + static_cast<std::ptrdiff_t>(at),
                   [](auto value) { return static_cast<value_type>(value); });
    const AnyGammaPolicy& policy = sequence.request.gamma_policy;
    double top_probability = 1.0;
    const token_id drafted = sample_standardized(
        sequence.standardizer, std::span<const value_type>(draft_rows_.data() + at, vocab_size_),
        std::span<value_type>(scratch_), g,
        policy.needs_top_probability() ? &top_probability : nullptr);
    sequence.context.push_back(drafted);
    return !is_stop(sequence, drafted) &&
           (i + 1 >= gamma || policy.continue_drafting(top_probability, i + 1));
  }

  // This step's draft length of sequence b (before early stops).
  [[nodiscard]] std::size_t gamma_of(std::size_t b) const {
    const Active& sequence = active_[b];
    const std::size_t remaining = sequence.request.max_new_tokens - sequence.result.tokens.size();
    return planner_ ? gammas_[b]
                    : std::min(sequence.request.gamma_policy.next_gamma(), remaining - 1);
  }

  // Drafting with a BatchDraftModel: position i of every sequence still drafting in one
  // draft_batch call, for i = 0, 1, ... Each sequence's drafts are sampled with its own
  // draft stream exactly as one at a time, so its tokens are the same either way. Rows go
  // to draft_rows_ at slots reserved for gamma_b rows per sequence, compacted at the end. A
  // failing call throws errc::model_failure from step() with every context restored.
  void draft_batched() {
    const std::size_t sequences = active_.size();
    slots_.assign(sequences + 1, 0);
    for (std::size_t b = 0; b < sequences; ++b) {
      Active& sequence = active_[b];
      sequence.failure = nullptr;
      sequence.base = sequence.context.size();
      sequence.goal = gamma_of(b);
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
          Active& sequence = active_[b];
          if (i >= sequence.goal) continue;
          requests_.push_back(
              {std::span<const token_id>(sequence.context.data(), sequence.base),
               std::span<const token_id>(sequence.context.data() + sequence.base, i),
               sequence.request.id});
          drafting_.push_back(b);
        }
        if (requests_.empty()) break;
        draft_call_ = true;
        auto&& returned = draft_->draft_batch(std::span<const BatchScoreRequest>(requests_));
        draft_call_ = false;
        const auto rows = as_rows(returned);
        if (rows.rows() != requests_.size() || rows.cols() != vocab_size_) {
          detail::throw_error(errc::invalid_size, "batch step ", steps_,
                              ": the draft model's draft_batch returned ", rows.rows(), " x ",
                              rows.cols(), " entries, expected ", requests_.size(), " x ",
                              vocab_size_);
        }
        for (std::size_t k = 0; k < drafting_.size(); ++k) {
          Active& sequence = active_[drafting_[k]];
          const std::size_t at = (slots_[drafting_[k]] + i) * vocab_size_;
          if (!take_draft(sequence, rows.row(k), at, sequence.draft_stream, i, sequence.goal)) {
            sequence.goal = i + 1;  // drafting ends here
          }
        }
      }
    } catch (...) {
      const bool model = draft_call_;
      draft_call_ = false;
      for (Active& sequence : active_) sequence.context.resize(sequence.base);
      if (!model) throw;
      try {
        throw;
      } catch (const std::exception& e) {
        std::throw_with_nested(
            error(errc::model_failure,
                  "batch step " + std::to_string(steps_) + ": the draft model threw: " + e.what()));
      } catch (...) {
        std::throw_with_nested(
            error(errc::model_failure, "batch step " + std::to_string(steps_) +
                                           ": the draft model threw a non-std exception"));
      }
    }
    // Compact: sequence b's rows from slot slots_[b] to the batch layout (rows only move
    // towards the front).
    std::size_t row = 0;
    for (std::size_t b = 0; b < sequences; ++b) {
      Active& sequence = active_[b];
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
  std::size_t draft_one(Active& sequence, std::size_t gamma) {
    if (gamma == 0) return 0;
    const std::size_t base = sequence.context.size();
    if constexpr (draft_is_model) {
      const StreamKey key{sequence.request.seed, sequence.request.id, sequence.result.steps};
      xoshiro256pp g = stream_engine(key, stream_purpose::draft);
      scratch_.resize(vocab_size_);
      for (std::size_t i = 0; i < gamma; ++i) {
        draft_call_ = true;
        auto&& returned = draft_->next_token_probabilities(
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
      const std::size_t proposed = static_cast<std::size_t>(
          draft_->propose(std::span<const token_id>(sequence.context.data(), base),
                          std::span<token_id>(sequence.context.data() + base, gamma)));
      draft_call_ = false;
      if (proposed > gamma) {
        detail::throw_error(errc::invalid_size, "the drafter proposed ", proposed,
                            " tokens, more than the ", gamma, " asked for");
      }
      sequence.context.resize(base + proposed);
      for (std::size_t i = 0; i < proposed; ++i) {
        const token_id token = sequence.context[base + i];
        if (token < 0 || static_cast<std::size_t>(token) >= vocab_size_) {
          detail::throw_error(errc::invalid_token, "draft token at position ", i, ": id ", token,
                              " is outside [0, ", vocab_size_, ")");
        }
        if (is_stop(sequence, token) ||
            (i + 1 < proposed && !sequence.request.gamma_policy.continue_drafting(1.0, i + 1))) {
          sequence.context.resize(base + i + 1);
          break;
        }
      }
    }
    return sequence.context.size() - base;
  }

  [[nodiscard]] static bool is_stop(const Active& sequence, token_id token) noexcept {
    return sequence.stops.is_stop_token(token);
  }

  // The error that fails a sequence (called inside a catch handler): a specdec::error
  // naming it; a model's own exception is nested inside an errc::model_failure.
  std::exception_ptr wrap_failure(const Active& sequence) const {
    try {
      try {
        throw;
      } catch (const error& e) {
        if (!draft_call_) throw error(e.code(), name(sequence) + ": " + detail::bare_message(e));
        std::throw_with_nested(
            error(errc::model_failure, name(sequence) + ": the draft model threw: " + e.what()));
      } catch (const std::exception& e) {
        std::throw_with_nested(
            error(errc::model_failure, name(sequence) + ": the draft model threw: " + e.what()));
      } catch (...) {
        std::throw_with_nested(error(
            errc::model_failure, name(sequence) + ": the draft model threw a non-std exception"));
      }
    } catch (...) {
      return std::current_exception();
    }
  }

  // Calls the target (or the draft), turning anything it throws into errc::model_failure
  // with the exception nested.
  template <class Call>
  decltype(auto) call_target(Call&& call) {
    try {
      return std::forward<Call>(call)();
    } catch (const std::exception& e) {
      std::throw_with_nested(
          error(errc::model_failure,
                "batch step " + std::to_string(steps_) + ": the target model threw: " + e.what()));
    } catch (...) {
      std::throw_with_nested(error(
          errc::model_failure,
          "batch step " + std::to_string(steps_) + ": the target model threw a non-std exception"));
    }
  }

  // Scores every sequence's drafted prefixes, then verifies and emits. A BatchScoringModel's
  // rows of the target's scalar type are verified in place (the result lives through the
  // verification); other rows are copied into target_rows_ in the batch's layout. Throws
  // without changing any sequence when the target fails.
  std::size_t score_verify_and_emit() {
    const std::size_t rows = draft_tokens_.size() + active_.size();
    if constexpr (BatchScoringModel<Target>) {
      requests_.clear();
      for (std::size_t b = 0; b < active_.size(); ++b) {
        requests_.push_back({std::span<const token_id>(active_[b].context),
                             std::span<const token_id>(draft_tokens_)
                                 .subspan(offsets_[b], offsets_[b + 1] - offsets_[b]),
                             active_[b].request.id});
      }
      auto&& returned = call_target([&]() -> decltype(auto) {
        return target_->score_batch(std::span<const BatchScoreRequest>(requests_));
      });
      ++target_calls_;
      const auto scored = as_rows(returned);
      check_shape(scored, rows, "score_batch");
      if constexpr (std::is_same_v<typename decltype(scored)::value_type, value_type>) {
        return verify_and_emit(scored);
      } else {
        target_rows_.resize(rows * vocab_size_);
        copy_rows(scored, 0);
      }
    } else {
      target_rows_.resize(rows * vocab_size_);
      for (std::size_t b = 0; b < active_.size(); ++b) score_one(b);
    }
    return verify_and_emit(RowsView<const value_type>(target_rows_.data(), rows, vocab_size_));
  }

  // Rows of sequence b without batch scoring: score_draft, else one call per prefix.
  void score_one(std::size_t b) {
    const Active& sequence = active_[b];
    const std::size_t first = offsets_[b] + b;
    const auto drafts = std::span<const token_id>(draft_tokens_)
                            .subspan(offsets_[b], offsets_[b + 1] - offsets_[b]);
    if constexpr (BatchedLanguageModel<Target>) {
      auto&& returned = call_target([&]() -> decltype(auto) {
        return target_->score_draft(std::span<const token_id>(sequence.context), drafts);
      });
      ++target_calls_;
      const auto scored = as_rows(returned);
      check_shape(scored, drafts.size() + 1, "score_draft");
      copy_rows(scored, first);
    } else {
      prefix_.assign(sequence.context.begin(), sequence.context.end());
      for (std::size_t i = 0; i <= drafts.size(); ++i) {
        if (i > 0) prefix_.push_back(drafts[i - 1]);
        auto&& returned = call_target([&]() -> decltype(auto) {
          return target_->next_token_probabilities(std::span<const token_id>(prefix_));
        });
        ++target_calls_;
        const auto row = as_span(returned);
        const RowsView<const typename decltype(row)::value_type> scored(row.data(), 1, row.size());
        check_shape(scored, 1, "next_token_probabilities");
        copy_rows(scored, first + i);
      }
    }
  }

  template <class U>
  void check_shape(RowsView<U> rows, std::size_t count, std::string_view call) const {
    if (rows.rows() != count || rows.cols() != vocab_size_) {
      detail::throw_error(errc::invalid_size, "batch step ", steps_, ": the target's ", call,
                          " returned ", rows.rows(), " x ", rows.cols(), " entries, expected ",
                          count, " x ", vocab_size_);
    }
  }

  // Copies rows (converted to value_type) into target_rows_ from batch row `first` on.
  template <class U>
  void copy_rows(RowsView<U> rows, std::size_t first) {
    for (std::size_t i = 0; i < rows.rows(); ++i) {
      const auto row = rows.row(i);
      std::transform(row.begin(), row.end(),
                     target_rows_.begin() + static_cast<std::ptrdiff_t>((first + i) * vocab_size_),
                     [](auto value) { return static_cast<value_type>(value); });
    }
  }

  // Verifies the batch, appends each sequence's tokens (cut at a stop token and at
  // max_new_tokens), and moves finished sequences out.
  std::size_t verify_and_emit(RowsView<const value_type> target_rows) {
    const std::size_t sequences = active_.size();
    options_buffer_.resize(sequences);
    for (std::size_t b = 0; b < sequences; ++b) {
      const Active& sequence = active_[b];
      options_buffer_[b] = SequenceOptions{
          sequence.request.sampling, 1.0, !draft_is_model,
          StreamKey{sequence.request.seed, sequence.request.id, sequence.result.steps}};
    }
    const std::size_t drafts = draft_tokens_.size();
    const RaggedBatch<value_type> batch{
        draft_tokens_, offsets_, target_rows,
        RowsView<const value_type>(draft_rows_.data(), draft_is_model ? drafts : 0, vocab_size_)};
    if (options_.validate_rows) {
      try {
        verifier_.verify_checked(batch, options_buffer_, out_);
      } catch (const error&) {  // failed sequences are marked in out_
      }
    } else {
      verifier_.verify(batch, options_buffer_, out_);
    }
    std::size_t emitted_total = 0;
    std::size_t kept = 0;
    streamed_.clear();
    for (std::size_t b = 0; b < sequences; ++b) {
      Active& sequence = active_[b];
      FinishedSequence& result = sequence.result;
      std::exception_ptr failure = sequence.failure;
      if (!failure && !out_.ok(b)) failure = out_.error(b);
      bool finished = false;
      if (failure) {
        result.end = sequence_end::failed;
        result.error = failure;
        finished = true;
      } else {
        // The emission stage (stop_conditions.hpp): tokens one at a time up to a stop
        // token, a completed stop sequence or max_new_tokens.
        const std::span<const token_id> tokens = out_.emitted(b);
        const StopConditions::Cut cut = sequence.stops.emit(
            tokens, result.tokens, 0, sequence.request.max_new_tokens - result.tokens.size());
        const std::size_t take = cut.taken;
        finished = cut.reason != stop_reason::none;
        if (cut.reason == stop_reason::stop_token) result.end = sequence_end::stop_token;
        if (cut.reason == stop_reason::stop_sequence) result.end = sequence_end::stop_sequence;
        if (cut.reason == stop_reason::max_new_tokens) result.end = sequence_end::max_new_tokens;
        sequence.context.insert(sequence.context.end(), tokens.begin(),
                                tokens.begin() + static_cast<std::ptrdiff_t>(take));
        ++result.steps;
        result.drafted += batch.drafted(b);
        result.accepted += out_.result(b).accepted;
        sequence.request.gamma_policy.observe(
            StepFeedback{batch.drafted(b), out_.result(b).accepted, 0.0, 0.0});
        if (planner_) {
          planner_->observe_acceptance(sequence.acceptance, batch.drafted(b),
                                       out_.result(b).accepted);
        }
        emitted_total += take;
        if (take > 0) streamed_.push_back({sequence.request.id, tokens.first(take)});
      }
      if (finished) {
        result.id = sequence.request.id;
        release(result.id);
        finished_.push_back(std::move(result));
      } else {
        if (kept != b) active_[kept] = std::move(active_[b]);
        ++kept;
      }
    }
    active_.resize(kept);
    // The step is complete before any callback runs: a callback that throws leaves every
    // sequence's tokens in place (later callbacks of this step are skipped).
    if (options_.on_tokens) {
      for (const auto& [id, tokens] : streamed_) options_.on_tokens(id, tokens);
    }
    return emitted_total;
  }

  Target* target_;
  Draft* draft_;
  BatchDecoderOptions options_;
  BatchVerifier<value_type> verifier_;
  std::size_t vocab_size_;
  std::vector<Active> active_;
  std::vector<FinishedSequence> finished_;
  std::size_t target_calls_ = 0;
  std::size_t steps_ = 0;
  // One step's batch.
  std::vector<std::size_t> offsets_;
  std::vector<token_id> draft_tokens_;
  std::vector<value_type> draft_rows_;
  std::vector<value_type> target_rows_;  // rows copied from per-sequence or converted scoring
  std::vector<value_type> scratch_;
  std::vector<BatchScoreRequest> requests_;
  std::vector<SequenceOptions> options_buffer_;
  std::vector<token_id> prefix_;  // a prefix scored alone
  std::vector<std::pair<std::uint64_t, std::span<const token_id>>> streamed_;  // for on_tokens
  BatchVerification out_;
  std::optional<BatchGammaPlanner> planner_;
  BatchGammaPlan plan_{};
  std::vector<double> alphas_;
  std::vector<std::size_t> caps_;
  std::vector<std::size_t> gammas_;
  std::vector<std::size_t> slots_;     // batched drafting: first row slot of each sequence
  std::vector<std::size_t> drafting_;  // batched drafting: sequences in this draft call
  bool draft_call_ = false;            // inside a draft model call (its exceptions are the model's)
};

}  // namespace specdec
