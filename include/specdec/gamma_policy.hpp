// specdec — how many tokens to draft per step (gamma) and when to stop drafting early.
//
// A gamma policy never changes the output distribution: whatever gamma it picks, each step
// is an exact speculative sampling step. It only changes speed. The decoder asks
// `next_gamma()` before a step, `continue_drafting(top_probability, drafted)` after each
// drafted token (top_probability = the draft's largest standardized q entry at that
// position, 1.0 for proposal-only drafters), and reports the outcome with `observe`.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include "specdec/analysis.hpp"
#include "specdec/error.hpp"

namespace specdec {

/// What happened in one decoding step, reported to the policy after verification.
struct StepFeedback {
  std::size_t drafted = 0;   ///< tokens drafted this step (the gamma actually used)
  std::size_t accepted = 0;  ///< n: drafts accepted by the verifier, 0..drafted
  /// Time of this step's draft calls and of its target call(s) plus verification, by
  /// DecoderOptions::clock (wall time by default); both 0 unless the policy needs_timing().
  double draft_seconds = 0.0;
  double target_seconds = 0.0;
};

namespace detail {

/// Seconds from a decoder's clock option (DecoderOptions::clock, BatchDecoderOptions::clock),
/// else from std::chrono::steady_clock.
[[nodiscard]] inline double clock_seconds(const std::function<double()>& clock) {
  if (clock) return clock();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace detail

/// `policy.next_gamma()` (const): the number of tokens to draft next step, >= 1.
template <class P>
concept HasNextGamma = requires(const P& policy) {
  { policy.next_gamma() } -> std::convertible_to<std::size_t>;
};

/// `policy.continue_drafting(top_probability, drafted)` (const): whether to draft another
/// token after `drafted` tokens, the last of which had draft top probability
/// `top_probability`.
template <class P>
concept HasContinueDrafting = requires(const P& policy, double top_probability,
                                       std::size_t drafted) {
  { policy.continue_drafting(top_probability, drafted) } -> std::convertible_to<bool>;
};

/// `policy.observe(feedback)`: learns from a finished step.
template <class P>
concept HasObserve = requires(P& policy, const StepFeedback& feedback) {
  policy.observe(feedback);
};

/// `policy.needs_timing()` (const): whether the decoder should time draft and target calls
/// and fill StepFeedback's seconds fields (three clock reads per step; the clock is
/// DecoderOptions::clock, std::chrono::steady_clock by default).
template <class P>
concept HasNeedsTiming = requires(const P& policy) {
  { policy.needs_timing() } -> std::convertible_to<bool>;
};

/// Optional: `policy.needs_top_probability()` (const): false when continue_drafting never
/// reads its top_probability argument. The decoder then skips the maximum over each draft
/// row (fused into its one pass over the row, it still costs compares) and passes 1.0.
/// A policy without the member is given the true top probability.
template <class P>
concept HasNeedsTopProbability = requires(const P& policy) {
  { policy.needs_top_probability() } -> std::convertible_to<bool>;
};

/// Whether `policy` reads the top probability (true unless it says otherwise).
template <class P>
[[nodiscard]] bool needs_top_probability(const P& policy) {
  if constexpr (HasNeedsTopProbability<P>) {
    return static_cast<bool>(policy.needs_top_probability());
  } else {
    return true;
  }
}

/// A draft-length policy. See the file comment for the protocol.
/// @code
/// struct Halving {  // drafts 8 tokens, 1 after a step with no accepted draft
///   std::size_t gamma = 8;
///   std::size_t next_gamma() const { return gamma; }
///   bool continue_drafting(double, std::size_t) const { return true; }
///   void observe(const specdec::StepFeedback& f) { gamma = f.accepted == 0 ? 1 : 8; }
///   bool needs_timing() const { return false; }
/// };
/// static_assert(specdec::GammaPolicy<Halving>);
/// @endcode
template <class P>
concept GammaPolicy = std::copy_constructible<P> && HasNextGamma<P> && HasContinueDrafting<P> &&
    HasObserve<P> && HasNeedsTiming<P>;

/// Always drafts the same number of tokens (the paper's setting).
class FixedGamma {
 public:
  /// Throws specdec::error (invalid_option) if gamma == 0.
  explicit FixedGamma(std::size_t gamma = 4) : gamma_(gamma) {
    if (gamma == 0) detail::throw_error(errc::invalid_option, "FixedGamma: gamma must be >= 1");
  }
  [[nodiscard]] std::size_t next_gamma() const noexcept { return gamma_; }
  [[nodiscard]] bool continue_drafting(double /*top_probability*/,
                                       std::size_t /*drafted*/) const noexcept {
    return true;
  }
  void observe(const StepFeedback& /*feedback*/) noexcept {}
  [[nodiscard]] bool needs_timing() const noexcept { return false; }
  [[nodiscard]] bool needs_top_probability() const noexcept { return false; }

 private:
  std::size_t gamma_;
};

/// Holds any GammaPolicy behind one type, so the decoder's options can select a policy at
/// run time. Allocates once when constructed or copied, never per step.
class AnyGammaPolicy {
 public:
  AnyGammaPolicy() : AnyGammaPolicy(FixedGamma{}) {}

  template <class P>
  requires(!std::same_as<std::decay_t<P>, AnyGammaPolicy> && GammaPolicy<std::decay_t<P>>)
      AnyGammaPolicy(P&& policy)  // NOLINT(google-explicit-constructor): implicit by design
      : holder_(std::make_unique<model<std::decay_t<P>>>(std::forward<P>(policy))) {}

  AnyGammaPolicy(const AnyGammaPolicy& other) : holder_(other.holder_->clone()) {}
  AnyGammaPolicy(AnyGammaPolicy&&) noexcept = default;
  AnyGammaPolicy& operator=(const AnyGammaPolicy& other) {
    if (this != &other) holder_ = other.holder_->clone();
    return *this;
  }
  AnyGammaPolicy& operator=(AnyGammaPolicy&&) noexcept = default;
  ~AnyGammaPolicy() = default;

  [[nodiscard]] std::size_t next_gamma() const { return holder_->next_gamma(); }
  [[nodiscard]] bool continue_drafting(double top_probability, std::size_t drafted) const {
    return holder_->continue_drafting(top_probability, drafted);
  }
  void observe(const StepFeedback& feedback) { holder_->observe(feedback); }
  [[nodiscard]] bool needs_timing() const { return holder_->needs_timing(); }
  /// The held policy's needs_top_probability(), true if it has none.
  [[nodiscard]] bool needs_top_probability() const { return holder_->needs_top_probability(); }

  /// The held policy if it is a `P`, else nullptr.
  template <class P>
  [[nodiscard]] const P* target() const noexcept {
    const auto* held = dynamic_cast<const model<P>*>(holder_.get());
    return held != nullptr ? &held->policy : nullptr;
  }

 private:
  struct concept_base {
    concept_base() = default;
    concept_base(const concept_base&) = default;
    concept_base& operator=(const concept_base&) = default;
    virtual ~concept_base() = default;
    [[nodiscard]] virtual std::unique_ptr<concept_base> clone() const = 0;
    [[nodiscard]] virtual std::size_t next_gamma() const = 0;
    [[nodiscard]] virtual bool continue_drafting(double, std::size_t) const = 0;
    virtual void observe(const StepFeedback&) = 0;
    [[nodiscard]] virtual bool needs_timing() const = 0;
    [[nodiscard]] virtual bool needs_top_probability() const = 0;
  };

  template <class P>
  struct model final : concept_base {
    explicit model(P value) : policy(std::move(value)) {}
    [[nodiscard]] std::unique_ptr<concept_base> clone() const override {
      return std::make_unique<model>(policy);
    }
    [[nodiscard]] std::size_t next_gamma() const override {
      return static_cast<std::size_t>(policy.next_gamma());
    }
    [[nodiscard]] bool continue_drafting(double top_probability,
                                         std::size_t drafted) const override {
      return static_cast<bool>(policy.continue_drafting(top_probability, drafted));
    }
    void observe(const StepFeedback& feedback) override { policy.observe(feedback); }
    [[nodiscard]] bool needs_timing() const override {
      return static_cast<bool>(policy.needs_timing());
    }
    [[nodiscard]] bool needs_top_probability() const override {
      return specdec::needs_top_probability(policy);
    }
    P policy;
  };

  std::unique_ptr<concept_base> holder_;
};

/// Configuration of AdditiveGamma.
struct AdditiveGammaOptions {
  std::size_t initial = 4;    ///< gamma of the first step, within [min_gamma, max_gamma]
  std::size_t min_gamma = 1;  ///< >= 1
  std::size_t max_gamma = 16;
  std::size_t increase = 2;  ///< added after a step whose drafts were all accepted
  std::size_t decrease = 1;  ///< subtracted after a step with a rejection
};

/// The additive heuristic: gamma grows by 2 after a step in which every drafted token was
/// accepted and shrinks by 1 after a step with a rejection, within [min_gamma, max_gamma].
/// A step that drafted nothing (a proposal drafter with no proposal) leaves gamma alone:
/// it says nothing about acceptance.
class AdditiveGamma {
 public:
  /// Throws specdec::error (invalid_option) unless 1 <= min_gamma <= initial <= max_gamma.
  explicit AdditiveGamma(AdditiveGammaOptions options = {}) : options_(options) {
    if (options.min_gamma == 0 || options.min_gamma > options.max_gamma ||
        options.initial < options.min_gamma || options.initial > options.max_gamma)
      detail::throw_error(
          errc::invalid_option,
          "AdditiveGamma: need 1 <= min_gamma <= initial <= max_gamma, got min_gamma ",
          options.min_gamma, ", initial ", options.initial, ", max_gamma ", options.max_gamma);
    gamma_ = options.initial;
  }

  [[nodiscard]] std::size_t next_gamma() const noexcept { return gamma_; }
  [[nodiscard]] bool continue_drafting(double /*top_probability*/,
                                       std::size_t /*drafted*/) const noexcept {
    return true;
  }
  void observe(const StepFeedback& feedback) noexcept {
    if (feedback.drafted == 0) return;
    if (feedback.accepted >= feedback.drafted) {
      gamma_ = options_.max_gamma - gamma_ > options_.increase ? gamma_ + options_.increase
                                                               : options_.max_gamma;
    } else {
      gamma_ = gamma_ - options_.min_gamma > options_.decrease ? gamma_ - options_.decrease
                                                               : options_.min_gamma;
    }
  }
  [[nodiscard]] bool needs_timing() const noexcept { return false; }
  [[nodiscard]] bool needs_top_probability() const noexcept { return false; }

  [[nodiscard]] const AdditiveGammaOptions& options() const noexcept { return options_; }

 private:
  AdditiveGammaOptions options_;
  std::size_t gamma_ = 4;
};

/// Stops drafting as soon as the draft is unsure: after a drafted token whose draft top
/// probability (the largest standardized q entry at its position) is below `threshold`,
/// no further token is drafted this step. Low draft confidence predicts rejection, and a
/// token after a likely rejection is likely wasted. How many tokens to draft at most comes
/// from the inner policy (FixedGamma(max_gamma) by default; any GammaPolicy composes, e.g.
/// ConfidenceStop<OptimalGammaController>), which also receives every observation.
/// Proposal-only drafters report top probability 1 and are never stopped.
/// @code
/// specdec::ConfidenceStop stop(0.4, 12);  // up to 12 tokens, stop below q_max = 0.4
/// specdec::ConfidenceStop adaptive(0.3, specdec::AdditiveGamma{});
/// @endcode
template <class Inner = FixedGamma>
requires GammaPolicy<Inner>
class ConfidenceStop {
 public:
  /// Throws specdec::error (invalid_option) unless 0 <= threshold <= 1.
  ConfidenceStop(double threshold, Inner inner) : threshold_(threshold), inner_(std::move(inner)) {
    if (!(threshold >= 0.0 && threshold <= 1.0))
      detail::throw_error(errc::invalid_option, "ConfidenceStop: threshold ", threshold,
                          " is outside [0, 1]");
  }

  /// Drafts up to `max_gamma` tokens (FixedGamma(max_gamma) inside).
  ConfidenceStop(double threshold, std::size_t max_gamma) requires std::same_as<Inner, FixedGamma>
      : ConfidenceStop(threshold, FixedGamma(max_gamma)) {}

  [[nodiscard]] std::size_t next_gamma() const {
    return static_cast<std::size_t>(inner_.next_gamma());
  }
  [[nodiscard]] bool continue_drafting(double top_probability, std::size_t drafted) const {
    return top_probability >= threshold_ &&
           static_cast<bool>(inner_.continue_drafting(top_probability, drafted));
  }
  void observe(const StepFeedback& feedback) { inner_.observe(feedback); }
  [[nodiscard]] bool needs_timing() const { return static_cast<bool>(inner_.needs_timing()); }
  [[nodiscard]] bool needs_top_probability() const noexcept { return true; }

  [[nodiscard]] double threshold() const noexcept { return threshold_; }
  [[nodiscard]] const Inner& inner() const noexcept { return inner_; }

 private:
  double threshold_;
  Inner inner_;
};

template <class Inner>
ConfidenceStop(double, Inner) -> ConfidenceStop<Inner>;
ConfidenceStop(double, std::size_t)->ConfidenceStop<FixedGamma>;
ConfidenceStop(double, int)->ConfidenceStop<FixedGamma>;

/// Acceptance evidence of one sequence: discounted accepted drafts and rejections (under
/// the i.i.d. model of Sec. 3.1, n accepted of gamma drafted is n successful trials and, if
/// n < gamma, one failure). OptimalGammaController and BatchGammaPlanner estimate alpha
/// with it.
class SequenceAcceptance {
 public:
  /// Records a step that drafted `drafted` and accepted `accepted` (<= drafted); a step
  /// with no drafts only discounts the evidence.
  void observe(std::size_t drafted, std::size_t accepted, double forgetting) noexcept {
    accepted = std::min(accepted, drafted);
    accepted_ = forgetting * accepted_ + static_cast<double>(accepted);
    rejections_ = forgetting * rejections_ + (accepted < drafted ? 1.0 : 0.0);
  }
  /// alpha estimated from the counts, shrunk towards `prior` with `prior_trials` weight.
  [[nodiscard]] double alpha(double prior, double prior_trials) const noexcept {
    const double trials = accepted_ + rejections_ + prior_trials;
    if (trials <= 0.0) return prior;
    return std::clamp((accepted_ + prior * prior_trials) / trials, 0.0, 1.0);
  }
  [[nodiscard]] double accepted() const noexcept { return accepted_; }
  [[nodiscard]] double rejections() const noexcept { return rejections_; }

 private:
  double accepted_ = 0.0;
  double rejections_ = 0.0;
};

/// Configuration of OptimalGammaController.
struct OptimalGammaOptions {
  /// Largest gamma considered (>= 1); the controller searches [1, max_gamma].
  std::size_t max_gamma = 16;
  /// Prior guess of alpha in [0, 1] and its weight in pseudo-trials (>= 0): the estimate
  /// starts there and is pulled towards it while evidence is scarce.
  double prior_alpha = 0.5;
  double prior_trials = 4.0;
  /// Per-step discount of past evidence in (0, 1]: the estimates average over roughly the
  /// last 1 / (1 - forgetting) steps, so they follow a drifting alpha or c. 1 = never forget.
  double forgetting = 0.99;
  /// The cost ratio c = (time of one draft call) / (time of one target call), Def. 3.7,
  /// finite and >= 0. Used as given when `measure_cost` is false, else as the starting value
  /// until the first timed step.
  double cost_ratio = 0.0;
  /// Measure c from the decoder's timings (needs_timing() becomes true). The decoder reads
  /// DecoderOptions::clock: wall time by default, or a simulated clock for reproducible runs.
  bool measure_cost = false;
};

/// Picks gamma every step by Theorem 3.8 — the paper fixes gamma and leaves choosing it
/// during inference to future work (Sec. 3.5, 7).
///
/// **alpha.** Under the i.i.d. model of Sec. 3.1 a step that drafted gamma tokens and
/// accepted n of them made n successful Bernoulli(alpha) trials and, if n < gamma, one
/// failure; later positions were never tried. The controller keeps exponentially
/// discounted sums A (accepted drafts) and R (rejections), A <- f A + n, R <- f R + [n <
/// gamma] with f = `forgetting`, and estimates
///   alpha = (A + prior_alpha prior_trials) / (A + R + prior_trials),
/// the maximum-likelihood estimate over the recent window, shrunk towards the prior.
///
/// **c.** Given, or measured (`measure_cost`): with discounted sums of draft seconds D,
/// drafted tokens G, target seconds S and timed steps K, c = (D / G) / (S / K), the mean
/// time per drafted token over the mean target time per step (one batched target call;
/// Theorem 3.8 assumes its cost does not grow with gamma).
///
/// **gamma.** After each observation, gamma = optimal_gamma(alpha, c, max_gamma) from
/// analysis.hpp: the integer in [1, max_gamma] maximising
/// (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)). The first step uses the prior and
/// the given c. O(max_gamma) work per step at most, no allocation.
/// @code
/// specdec::OptimalGammaController controller({.max_gamma = 12, .measure_cost = true});
/// options.gamma_policy = controller;  // the decoder reports timings to it
/// @endcode
class OptimalGammaController {
 public:
  /// Throws specdec::error (invalid_option) for max_gamma == 0, prior_alpha outside [0, 1],
  /// prior_trials negative or not finite, forgetting outside (0, 1], or cost_ratio
  /// negative or not finite.
  explicit OptimalGammaController(OptimalGammaOptions options = {}) : options_(options) {
    const auto invalid = [](const char* name, auto value, const char* range) {
      detail::throw_error(errc::invalid_option, "OptimalGammaController: ", name, " = ", value,
                          " must be ", range);
    };
    if (options.max_gamma == 0) invalid("max_gamma", options.max_gamma, ">= 1");
    if (!(options.prior_alpha >= 0.0 && options.prior_alpha <= 1.0))
      invalid("prior_alpha", options.prior_alpha, "in [0, 1]");
    if (!(options.prior_trials >= 0.0 && std::isfinite(options.prior_trials)))
      invalid("prior_trials", options.prior_trials, "finite and >= 0");
    if (!(options.forgetting > 0.0 && options.forgetting <= 1.0))
      invalid("forgetting", options.forgetting, "in (0, 1]");
    if (!(options.cost_ratio >= 0.0 && std::isfinite(options.cost_ratio)))
      invalid("cost_ratio", options.cost_ratio, "finite and >= 0");
    choose();
  }

  [[nodiscard]] std::size_t next_gamma() const noexcept { return gamma_; }
  [[nodiscard]] bool continue_drafting(double /*top_probability*/,
                                       std::size_t /*drafted*/) const noexcept {
    return true;
  }

  void observe(const StepFeedback& feedback) {
    const double f = options_.forgetting;
    acceptance_.observe(feedback.drafted, feedback.accepted, f);
    if (options_.measure_cost) {
      // Discount every sum each step so that all of them cover the same recent window.
      draft_seconds_ *= f;
      drafted_ *= f;
      target_seconds_ *= f;
      timed_steps_ *= f;
      if (feedback.target_seconds > 0.0 && std::isfinite(feedback.target_seconds) &&
          feedback.draft_seconds >= 0.0 && std::isfinite(feedback.draft_seconds)) {
        target_seconds_ += feedback.target_seconds;
        timed_steps_ += 1.0;
        draft_seconds_ += feedback.draft_seconds;
        drafted_ += static_cast<double>(feedback.drafted);
      }
    }
    choose();
  }

  [[nodiscard]] bool needs_timing() const noexcept { return options_.measure_cost; }
  [[nodiscard]] bool needs_top_probability() const noexcept { return false; }

  /// The current alpha estimate (see the class comment).
  [[nodiscard]] double alpha() const noexcept {
    return acceptance_.alpha(options_.prior_alpha, options_.prior_trials);
  }

  /// The cost ratio in use: measured once a timed step with drafted tokens has been seen,
  /// else the configured one.
  [[nodiscard]] double cost_ratio() const noexcept {
    if (!options_.measure_cost || drafted_ <= 0.0 || timed_steps_ <= 0.0 || target_seconds_ <= 0.0)
      return options_.cost_ratio;
    const double c = (draft_seconds_ / drafted_) / (target_seconds_ / timed_steps_);
    return std::isfinite(c) && c >= 0.0 ? c : options_.cost_ratio;
  }

  /// Theorem 3.8's expected walltime improvement at the current estimates and gamma.
  [[nodiscard]] double expected_improvement() const noexcept { return improvement_; }

  [[nodiscard]] const OptimalGammaOptions& options() const noexcept { return options_; }

 private:
  void choose() {
    const GammaChoice choice = optimal_gamma(alpha(), cost_ratio(), options_.max_gamma);
    gamma_ = choice.gamma;
    improvement_ = choice.improvement;
  }

  OptimalGammaOptions options_;
  SequenceAcceptance acceptance_;  // discounted accepted drafts and rejections
  double draft_seconds_ = 0.0;
  double drafted_ = 0.0;
  double target_seconds_ = 0.0;
  double timed_steps_ = 0.0;
  std::size_t gamma_ = 1;
  double improvement_ = 1.0;
};

static_assert(GammaPolicy<FixedGamma>);
static_assert(GammaPolicy<AnyGammaPolicy>);
static_assert(GammaPolicy<AdditiveGamma>);
static_assert(GammaPolicy<ConfidenceStop<>>);
static_assert(GammaPolicy<ConfidenceStop<AdditiveGamma>>);
static_assert(GammaPolicy<OptimalGammaController>);

}  // namespace specdec
