// specdec — draft lengths for a whole batch: how many tokens each sequence drafts when one
// target call scores every sequence's drafts together.
//
// For one sequence the paper's Theorem 3.8 picks gamma from alpha and the cost ratio c,
// assuming the target call costs the same whatever it scores. A batched target call does
// not: while few positions are scored it is bound by reading the weights (extra positions
// are almost free), and once the batch is large each extra position costs compute. vLLM
// keys its draft length on the batch size for this reason. BatchGammaPlanner applies the
// theorem's reasoning to the batch instead of one sequence:
//
//   one step with draft lengths gamma_1..gamma_B yields in expectation
//     E = sum_b (1 - alpha_b^(gamma_b + 1)) / (1 - alpha_b)      tokens      (Eq. 1 per sequence)
//   and costs
//     C = d * sum_b gamma_b + T(B + sum_b gamma_b)                seconds
//   with d the cost of drafting one token and T(P) the cost of a target call (and its
//   verification) that scores P positions; the planner maximises E / C.
//
// Sequence b's k-th draft adds alpha_b^k expected tokens and one position, so for a given
// total of positions E is largest when the drafts taken are the largest of all values
// alpha_b^k: the planner merges the B decreasing sequences alpha_b, alpha_b^2, ... and
// evaluates E / C after each draft taken, keeping the best prefix. That is the exact optimum
// of E / C over all (gamma_1..gamma_B) within the caps, in O(K log B) for K candidate drafts.
// gamma_b = 0 for every sequence is plain decoding, chosen when drafting does not pay (a
// compute-bound target at large batch). A shared mode gives every sequence the same gamma.
//
// T(P) is given (`target_cost`) or measured: each step's (positions, seconds) is averaged in
// a bucket of nearby position counts (eight buckets per doubling), the costs between measured
// buckets are interpolated linearly and made non-decreasing in P (a bucket not visited for
// long is interpolated over, so that it is measured again), and outside the measured
// range the planner is optimistic (T(P) = T(P_min) P / P_min below it, T(P_max) above it,
// both lower bounds when cost per position does not grow), so it tries an unmeasured batch
// size once and learns its cost instead of never visiting it. d is given or measured alike
// (seconds per drafted token).
//
// alpha_b: each sequence keeps discounted counts of accepted drafts and rejections
// (SequenceAcceptance), shrunk towards the batch's pooled estimate (every sequence's
// evidence, discounted once per batch step), which is shrunk towards the prior. A sequence's counts
// decay every step, also steps it drafts nothing in, so a sequence given gamma 0 drifts back to the
// pooled alpha and is tried again.
//
// Like every gamma policy, the planner changes speed only: each sequence's step is an exact
// speculative sampling step whatever gamma it gets (gamma 0: one token sampled from p).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "specdec/analysis.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"

namespace specdec {

/// Configuration of a BatchGammaPlanner. Checked at construction (errc::invalid_option).
struct BatchGammaOptions {
  /// Largest draft length given to a sequence (>= 1).
  std::size_t max_gamma = 8;
  /// One gamma for every sequence (capped per sequence) instead of one per sequence.
  bool shared = false;
  /// Prior alpha in [0, 1] and its weight in pseudo-trials (>= 0, finite).
  double prior_alpha = 0.5;
  double prior_trials = 4.0;
  /// Per-step discount of evidence in (0, 1]: acceptance counts and measured costs average
  /// over roughly the last 1 / (1 - forgetting) steps (a sequence's own counts: its steps;
  /// the pooled counts and the costs: batch steps, i.e. plans).
  double forgetting = 0.98;
  /// The cost T(P) of a target call scoring P positions (and verifying them), in seconds or
  /// any unit shared with draft_cost. Empty: measured from observe_step.
  std::function<double(std::size_t positions)> target_cost{};
  /// Cost of drafting one token, in target_cost's unit (>= 0, finite). Used as given when
  /// target_cost is given, else as the starting value until a step with drafts is observed.
  double draft_cost = 0.0;
};

/// What a plan expects of the step it planned.
struct BatchGammaPlan {
  std::size_t drafts = 0;        ///< sum of the gammas
  std::size_t positions = 0;     ///< positions the target call scores: sequences + drafts
  double expected_tokens = 0.0;  ///< E: tokens the step emits in expectation
  double expected_cost = 0.0;    ///< C: its modelled cost
  /// (E / C) / (B / T(B)): expected throughput over plain decoding's by the cost model
  /// (1 when every gamma is 0).
  double improvement = 1.0;
};

/// Chooses each sequence's draft length for one batched step; see the file comment.
/// @code
/// specdec::BatchGammaPlanner planner({.max_gamma = 8});
/// // each step: alphas[b] = planner.alpha(acceptance[b]); caps[b] = tokens b may still take - 1
/// planner.plan(alphas, caps, gammas);
/// // ... draft, score, verify; then
/// planner.observe_step(drafts, draft_seconds, positions, target_seconds);
/// planner.observe_acceptance(acceptance[b], drafted_b, accepted_b);  // for each sequence
/// @endcode
class BatchGammaPlanner {
 public:
  /// Throws specdec::error (invalid_option) naming a value out of range.
  explicit BatchGammaPlanner(BatchGammaOptions options = {}) : options_(std::move(options)) {
    const auto invalid = [](const char* name, auto value, const char* range) {
      detail::throw_error(errc::invalid_option, "BatchGammaPlanner: ", name, " = ", value,
                          " must be ", range);
    };
    if (options_.max_gamma == 0) invalid("max_gamma", options_.max_gamma, ">= 1");
    if (!(options_.prior_alpha >= 0.0 && options_.prior_alpha <= 1.0))
      invalid("prior_alpha", options_.prior_alpha, "in [0, 1]");
    if (!(options_.prior_trials >= 0.0 && std::isfinite(options_.prior_trials)))
      invalid("prior_trials", options_.prior_trials, "finite and >= 0");
    if (!(options_.forgetting > 0.0 && options_.forgetting <= 1.0))
      invalid("forgetting", options_.forgetting, "in (0, 1]");
    if (!(options_.draft_cost >= 0.0 && std::isfinite(options_.draft_cost)))
      invalid("draft_cost", options_.draft_cost, "finite and >= 0");
    curve_.reserve(buckets);
    std::size_t low = 1;  // bucket i holds position counts [lows_[i], lows_[i + 1])
    for (std::size_t i = 0; i < buckets; ++i) {
      lows_[i] = low;
      low = std::max(low + 1, static_cast<std::size_t>(std::ceil(static_cast<double>(low) *
                                                                 std::exp2(1.0 / per_doubling))));
    }
  }

  [[nodiscard]] const BatchGammaOptions& options() const noexcept { return options_; }

  /// Sequence b's alpha: its counts shrunk towards the pooled estimate.
  [[nodiscard]] double alpha(const SequenceAcceptance& sequence) const noexcept {
    return sequence.alpha(pooled_alpha(), options_.prior_trials);
  }
  /// The batch's pooled alpha (every sequence's evidence, shrunk towards the prior).
  [[nodiscard]] double pooled_alpha() const noexcept {
    return pooled_.alpha(options_.prior_alpha, options_.prior_trials);
  }

  /// Records a sequence's step in its own counts and in the pooled ones (which decay once
  /// per plan, i.e. per batch step, not per sequence).
  void observe_acceptance(SequenceAcceptance& sequence, std::size_t drafted,
                          std::size_t accepted) noexcept {
    sequence.observe(drafted, accepted, options_.forgetting);
    if (drafted > 0) pooled_.observe(drafted, accepted, 1.0);
  }

  /// Records a step's costs: `drafts` tokens drafted in `draft_seconds`, a target call
  /// (with verification) over `positions` positions in `target_seconds`. Ignored for a
  /// given target_cost, and for times that are negative or not finite. The evidence decays
  /// once per plan (per batch step); a bucket inside the measured range whose weight fell
  /// below 0.1 (not visited for about log(0.1) / log(forgetting) steps, 114 at 0.98) is
  /// interpolated over until measured again, so one slow measurement cannot keep the
  /// planner away from a number of positions for good.
  void observe_step(std::size_t drafts, double draft_seconds, std::size_t positions,
                    double target_seconds) noexcept {
    if (options_.target_cost) return;
    if (drafts > 0 && draft_seconds >= 0.0 && std::isfinite(draft_seconds)) {
      draft_seconds_ += draft_seconds;
      drafted_ += static_cast<double>(drafts);
    }
    if (positions == 0 || !(target_seconds >= 0.0) || !std::isfinite(target_seconds)) return;
    Bucket& bucket = buckets_[bucket_of(positions)];
    bucket.weight += 1.0;
    bucket.positions += static_cast<double>(positions);
    bucket.seconds += target_seconds;
  }

  /// T(P) as the planner models it (given, measured, or 1 before any measurement).
  [[nodiscard]] double target_cost(std::size_t positions) {
    if (options_.target_cost) return options_.target_cost(positions);
    build_curve();
    std::size_t at = 0;
    return curve_cost(static_cast<double>(positions), at);
  }
  /// d: the cost of drafting one token (given, or measured once a step drafted).
  [[nodiscard]] double draft_cost() const noexcept {
    if (options_.target_cost || drafted_ <= 0.0) return options_.draft_cost;
    return draft_seconds_ / drafted_;
  }

  /// Fills gammas[b] in [0, min(caps[b], max_gamma)] for sequences with acceptance
  /// estimates alphas[b] (in [0, 1]), maximising expected tokens per modelled cost. Throws
  /// specdec::error (invalid_size) if the spans' sizes differ, (domain) for an alpha outside
  /// [0, 1] or a target_cost that returns a negative or non-finite value. Allocates only
  /// when the batch is larger than any before.
  BatchGammaPlan plan(std::span<const double> alphas, std::span<const std::size_t> caps,
                      std::span<std::size_t> gammas) {
    if (alphas.size() != caps.size() || alphas.size() != gammas.size()) {
      detail::throw_error(errc::invalid_size, "BatchGammaPlanner::plan: ", alphas.size(),
                          " alphas, ", caps.size(), " caps and ", gammas.size(), " gammas");
    }
    for (std::size_t b = 0; b < alphas.size(); ++b) {
      if (!(alphas[b] >= 0.0 && alphas[b] <= 1.0)) {
        detail::throw_error(errc::domain, "BatchGammaPlanner::plan: alphas[", b, "] = ", alphas[b],
                            " is outside [0, 1]");
      }
    }
    std::fill(gammas.begin(), gammas.end(), std::size_t{0});
    const std::size_t sequences = alphas.size();
    BatchGammaPlan plan;
    plan.positions = sequences;
    plan.expected_tokens = static_cast<double>(sequences);
    if (sequences == 0) {
      decay();
      return plan;
    }
    if (!options_.target_cost) build_curve();
    at_ = 0;
    const double d = draft_cost();
    plan.expected_cost = cost(sequences);
    const double plain_rate = plan.expected_tokens / plan.expected_cost;
    if (options_.shared) {
      plan_shared(alphas, caps, gammas, d, plan);
    } else {
      plan_each(alphas, caps, gammas, d, plan);
    }
    const double rate = plan.expected_tokens / plan.expected_cost;
    plan.improvement = plain_rate > 0.0 && std::isfinite(plain_rate) && std::isfinite(rate)
                           ? rate / plain_rate
                           : 1.0;
    decay();
    return plan;
  }

 private:
  static constexpr std::size_t buckets = 96;  // up to ~4 million positions
  static constexpr double per_doubling = 8.0;
  static constexpr double stale_weight = 0.1;  // buckets below it count as unmeasured

  struct Bucket {
    double weight = 0.0;
    double positions = 0.0;  // weighted sums
    double seconds = 0.0;
  };
  struct Candidate {  // the next draft of sequence b and the tokens it adds
    double value;
    std::size_t sequence;
  };

  // One batch step's discount of the pooled acceptance and of the measured costs.
  void decay() noexcept {
    const double f = options_.forgetting;
    pooled_.observe(0, 0, f);
    if (options_.target_cost || f == 1.0) return;
    draft_seconds_ *= f;
    drafted_ *= f;
    for (Bucket& bucket : buckets_) {
      bucket.weight *= f;
      bucket.positions *= f;
      bucket.seconds *= f;
    }
  }

  // Whether `tokens` for `cost` is a strictly higher rate than `best_tokens` for
  // `best_cost` (costs >= 0; at zero cost, more tokens is better).
  [[nodiscard]] static bool better(double tokens, double cost, double best_tokens,
                                   double best_cost) noexcept {
    if (cost <= 0.0 && best_cost <= 0.0) return tokens > best_tokens;
    return tokens * best_cost > best_tokens * cost;
  }

  [[nodiscard]] std::size_t bucket_of(std::size_t positions) const noexcept {
    const auto it = std::upper_bound(lows_.begin(), lows_.end(), positions);
    return static_cast<std::size_t>(it - lows_.begin()) - 1;
  }

  // The measured points (mean positions, mean seconds) in order, non-decreasing in seconds:
  // every bucket with evidence, except stale ones between the first and the last (those
  // are interpolated over until measured again; the ends stay, so the measured range does
  // not shrink into optimistic extrapolation).
  void build_curve() {
    curve_.clear();
    std::size_t first = buckets;
    std::size_t last = 0;
    for (std::size_t i = 0; i < buckets; ++i) {
      if (buckets_[i].weight <= 0.0) continue;
      first = std::min(first, i);
      last = i;
    }
    double highest = 0.0;
    for (std::size_t i = first; i < buckets && i <= last; ++i) {
      const Bucket& bucket = buckets_[i];
      if (bucket.weight <= 0.0) continue;
      if (bucket.weight < stale_weight && i != first && i != last) continue;
      highest = std::max(highest, bucket.seconds / bucket.weight);
      curve_.emplace_back(bucket.positions / bucket.weight, highest);
    }
  }

  // The modelled cost at `positions` from curve_, walking `at` forward (positions asked in
  // increasing order within a plan).
  [[nodiscard]] double curve_cost(double positions, std::size_t& at) const noexcept {
    if (curve_.empty()) return 1.0;
    const auto [first_p, first_t] = curve_.front();
    if (positions <= first_p) return first_t * positions / first_p;
    const auto [last_p, last_t] = curve_.back();
    if (positions >= last_p) return last_t;
    while (at + 1 < curve_.size() && curve_[at + 1].first < positions) ++at;
    const auto [p0, t0] = curve_[at];
    const auto [p1, t1] = curve_[at + 1];
    return t0 + (t1 - t0) * (positions - p0) / (p1 - p0);
  }

  double cost(std::size_t positions) {
    double t = 0.0;
    if (options_.target_cost) {
      t = options_.target_cost(positions);
      if (!(t >= 0.0) || !std::isfinite(t)) {
        detail::throw_error(errc::domain, "BatchGammaPlanner: target_cost(", positions, ") = ", t,
                            " must be finite and >= 0");
      }
    } else {
      t = curve_cost(static_cast<double>(positions), at_);
    }
    return t;
  }

  void plan_each(std::span<const double> alphas, std::span<const std::size_t> caps,
                 std::span<std::size_t> gammas, double d, BatchGammaPlan& plan) {
    const std::size_t sequences = alphas.size();
    const auto less = [](const Candidate& a, const Candidate& b) {
      return a.value < b.value || (a.value == b.value && a.sequence > b.sequence);
    };
    heap_.clear();
    for (std::size_t b = 0; b < sequences; ++b) {
      if (std::min(caps[b], options_.max_gamma) > 0) heap_.push_back({alphas[b], b});
    }
    std::make_heap(heap_.begin(), heap_.end(), less);
    taken_.assign(sequences, 0);
    popped_.clear();
    double tokens = plan.expected_tokens;
    std::size_t drafts = 0;
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), less);
      const Candidate next = heap_.back();
      heap_.pop_back();
      const std::size_t b = next.sequence;
      tokens += next.value;
      ++drafts;
      ++taken_[b];
      popped_.push_back(b);
      if (taken_[b] < std::min(caps[b], options_.max_gamma)) {
        heap_.push_back({next.value * alphas[b], b});
        std::push_heap(heap_.begin(), heap_.end(), less);
      }
      const double c = d * static_cast<double>(drafts) + cost(sequences + drafts);
      if (better(tokens, c, plan.expected_tokens, plan.expected_cost)) {
        plan.drafts = drafts;
        plan.expected_tokens = tokens;
        plan.expected_cost = c;
      }
    }
    // The best prefix of the merge: its first plan.drafts drafts.
    for (std::size_t j = 0; j < plan.drafts; ++j) ++gammas[popped_[j]];
    plan.positions = sequences + plan.drafts;
  }

  void plan_shared(std::span<const double> alphas, std::span<const std::size_t> caps,
                   std::span<std::size_t> gammas, double d, BatchGammaPlan& plan) {
    const std::size_t sequences = alphas.size();
    std::size_t best_gamma = 0;
    for (std::size_t gamma = 1; gamma <= options_.max_gamma; ++gamma) {
      double tokens = 0.0;
      std::size_t drafts = 0;
      for (std::size_t b = 0; b < sequences; ++b) {
        const std::size_t g = std::min(gamma, caps[b]);
        tokens += detail::geometric_sum(alphas[b], g);  // Eq. 1: sum of alpha^k, k = 0..g
        drafts += g;
      }
      const double c = d * static_cast<double>(drafts) + cost(sequences + drafts);
      if (better(tokens, c, plan.expected_tokens, plan.expected_cost)) {
        best_gamma = gamma;
        plan.drafts = drafts;
        plan.expected_tokens = tokens;
        plan.expected_cost = c;
      }
    }
    for (std::size_t b = 0; b < sequences; ++b) gammas[b] = std::min(best_gamma, caps[b]);
    plan.positions = sequences + plan.drafts;
  }

  BatchGammaOptions options_;
  SequenceAcceptance pooled_;
  std::array<std::size_t, buckets> lows_{};
  std::array<Bucket, buckets> buckets_{};
  double draft_seconds_ = 0.0;
  double drafted_ = 0.0;
  std::vector<std::pair<double, double>> curve_;
  std::vector<Candidate> heap_;
  std::vector<std::size_t> taken_;
  std::vector<std::size_t> popped_;  // the merge's drafts in order (their sequences)
  std::size_t at_ = 0;               // curve_cost's walk within one plan
};

}  // namespace specdec
