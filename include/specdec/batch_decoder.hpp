// specdec — the batch decoder: many sequences, one target call per step for all of them.
//
// A serving engine keeps a set of active sequences; each step drafts for every one of them
// (batch_draft_stage.hpp), scores every drafted prefix of every sequence in ONE target call
// (batch_score_stage.hpp: a BatchScoringModel; models without batch scoring are called per
// sequence), verifies the ragged batch (batch_verification.hpp, on the verifier's threads)
// and appends each sequence's tokens (StopConditions::emit). docs/pipeline.md maps the
// stages it shares with SpeculativeDecoder.
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

#include "specdec/batch_draft_stage.hpp"
#include "specdec/batch_gamma.hpp"
#include "specdec/batch_score_stage.hpp"
#include "specdec/batch_sequence.hpp"
#include "specdec/batch_verification.hpp"
#include "specdec/concepts.hpp"
#include "specdec/draft_stage.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/stop_conditions.hpp"
#include "specdec/validation.hpp"

namespace specdec {

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
        vocab_size_(target.vocab_size()),
        drafting_(draft, vocab_size_),
        scoring_(target, vocab_size_) {
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
    plan_gammas();
    const double started = timed ? now() : 0.0;
    drafting_.draft(active_, step_gammas_, steps_);
    const std::size_t drafts = drafting_.tokens().size();
    const std::size_t positions = drafts + active_.size();
    const double drafted = timed ? now() : 0.0;
    const std::size_t emitted = scoring_.score(
        active_, drafting_.tokens(), drafting_.offsets(), steps_, target_calls_,
        [this](RowsView<const value_type> target_rows) { return verify_and_emit(target_rows); });
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
  using Active = detail::BatchSequence<value_type>;

  static constexpr bool draft_is_model = LanguageModel<Draft>;

  [[nodiscard]] double now() const { return detail::clock_seconds(options_.clock); }

  // This step's draft length of every sequence (before early stops) into step_gammas_: the
  // planner's (also kept in gammas_), else each sequence's policy's, within max_new_tokens.
  void plan_gammas() {
    const std::size_t sequences = active_.size();
    step_gammas_.resize(sequences);
    if (!planner_) {
      for (std::size_t b = 0; b < sequences; ++b) {
        const Active& sequence = active_[b];
        const std::size_t remaining =
            sequence.request.max_new_tokens - sequence.result.tokens.size();
        step_gammas_[b] = std::min(sequence.request.gamma_policy.next_gamma(), remaining - 1);
      }
      return;
    }
    alphas_.resize(sequences);
    caps_.resize(sequences);
    gammas_.resize(sequences);
    for (std::size_t b = 0; b < sequences; ++b) {
      const Active& sequence = active_[b];
      alphas_[b] = planner_->alpha(sequence.acceptance);
      caps_[b] = sequence.request.max_new_tokens - sequence.result.tokens.size() - 1;
    }
    plan_ = planner_->plan(alphas_, caps_, gammas_);
    std::copy(gammas_.begin(), gammas_.end(), step_gammas_.begin());
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

  // Verifies the batch, appends each sequence's tokens (cut at a stop token and at
  // max_new_tokens), and moves finished sequences out.
  std::size_t verify_and_emit(RowsView<const value_type> target_rows) {
    const std::size_t sequences = active_.size();
    options_buffer_.resize(sequences);
    for (std::size_t b = 0; b < sequences; ++b) {
      const Active& sequence = active_[b];
      options_buffer_[b] = SequenceOptions{
          sequence.request.sampling, 1.0, !draft_is_model,
          StreamKey{sequence.request.seed, sequence.request.id, sequence.result.steps},
          sequence.request.verification};
    }
    const RaggedBatch<value_type> batch{drafting_.tokens(), drafting_.offsets(), target_rows,
                                        drafting_.rows()};
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
  BatchDraftStage<Draft, value_type> drafting_;
  BatchScoreStage<Target, value_type> scoring_;
  std::vector<SequenceOptions> options_buffer_;
  std::vector<std::pair<std::uint64_t, std::span<const token_id>>> streamed_;  // for on_tokens
  BatchVerification out_;
  std::optional<BatchGammaPlanner> planner_;
  BatchGammaPlan plan_{};
  std::vector<double> alphas_;
  std::vector<std::size_t> caps_;
  std::vector<std::size_t> gammas_;
  std::vector<std::size_t> step_gammas_;  // this step's draft lengths (planner or policies)
};

}  // namespace specdec
