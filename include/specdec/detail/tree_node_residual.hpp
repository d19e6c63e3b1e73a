// specdec — private: the residual r of recursive rejection sampling at one tree node
// (SpecInfer's multi-candidate speculative sampling), shared by verify_tree and by the
// analytic tests, which enumerate its branches instead of drawing uniforms.
//
// At a node with target row p, r starts as p. Candidate c_i (drawn from q_i) is accepted
// with probability min(1, r(c_i) / q_i(c_i)); on rejection r := norm(max(0, r - q_i)).
// One step is Algorithm 1's single-token speculative sampling with target r and draft q_i
// (paper Sec. 2.3, App. A.1), so the token finally emitted at the node - an accepted
// candidate or a draw from the last r - has law p, for any sequence of q_i as long as c_i
// was drawn from the q_i used here (q_i may depend on c_1..c_{i-1}).
//
// q_i by expansion kind:
//   with_replacement      q_i = q
//   without_replacement   q_i = q with c_1..c_{i-1} zeroed, divided by its remaining mass
//   one_hot               q_i = e_{c_i}: accept with probability r(c_i); r := r without c_i
//
// Facts the implementation relies on (all exact, documented for the tests):
//  - after c is rejected, r(c) = 0 and stays 0 (rejection needs r(c) < q_i(c), so the clamp
//    zeroes it; later subtractions keep 0). The entry is zeroed explicitly as well, so that
//    rounding cannot leave a crumb. Hence a repeated candidate (with replacement) is
//    accepted with probability 0, but its draw still subtracts q: reject_repeat();
//  - q_i(c) = 0 with r(c) > 0 (a candidate that q_i cannot produce; probability zero if the
//    tree was drawn correctly) is accepted: the ratio is +infinity. r(c) = 0 rejects;
//  - zero or non-finite residual mass after a rejection (only through rounding, or p == q
//    at a node where nothing can be rejected in exact arithmetic): the node stops trying
//    candidates and draws from p instead; fallback() reports it.
// The residual is materialised lazily: a node whose first candidate is accepted reads two
// entries only; the subtraction of a rejection that is followed directly by the node's
// draw (every chain position, the last sibling) is fused into that draw by the core's
// one-pass residual samplers (residual_distribution.hpp); any other rejection costs one
// fused subtract-and-sum pass plus a scaling pass over the row.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/residual_distribution.hpp"

namespace specdec::detail {

/// Sum of a row widened to double, in independent lanes (vectorizes without -ffast-math).
template <class T>
[[nodiscard]] double tree_row_sum(std::span<const T> row) noexcept {
  constexpr std::size_t lanes = 8;
  double lane[lanes] = {};
  std::size_t j = 0;
  for (; j + lanes <= row.size(); j += lanes) {
    for (std::size_t k = 0; k < lanes; ++k) lane[k] += static_cast<double>(row[j + k]);
  }
  for (; j < row.size(); ++j) lane[0] += static_cast<double>(row[j]);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

template <class T>
class tree_node_residual {
 public:
  /// Starts a node: r := p = `target`. `draft` is the node's stored q row (ignored for
  /// one_hot). The spans must outlive the use of this object for the node.
  void start(std::span<const T> target, std::span<const T> draft, expansion kind) noexcept {
    SPECDEC_ASSERT(kind != expansion::none);
    SPECDEC_ASSERT(kind == expansion::one_hot || draft.size() == target.size());
    target_ = target;
    draft_ = draft;
    kind_ = kind;
    materialized_ = false;
    masked_ = false;
    fallback_ = false;
    pending_ = false;
    draft_mass_ = 1.0;
  }

  /// r(x): the current residual (normalised), or p(x) after a fallback.
  [[nodiscard]] double probability(token_id x) {
    const auto j = static_cast<std::size_t>(x);
    SPECDEC_ASSERT(j < target_.size());
    resolve();
    return (materialized_ && !fallback_) ? static_cast<double>(residual_[j])
                                         : static_cast<double>(target_[j]);
  }

  /// q_i(c) of the candidate tried next.
  [[nodiscard]] double draft_probability(token_id candidate) {
    const auto j = static_cast<std::size_t>(candidate);
    resolve();
    switch (kind_) {
      case expansion::one_hot:
        return 1.0;
      case expansion::without_replacement:
        if (masked_) {
          const auto value = static_cast<double>(remaining_draft_[j]);
          return value > 0.0 ? value / draft_mass_ : 0.0;
        }
        return static_cast<double>(draft_[j]);
      default:
        return static_cast<double>(draft_[j]);
    }
  }

  /// min(1, r(c) / q_i(c)) for the candidate tried next; 1 if q_i(c) = 0 < r(c), 0 if
  /// r(c) = 0. Precondition: !fallback().
  [[nodiscard]] double acceptance_probability(token_id candidate) {
    const double residual = probability(candidate);
    SPECDEC_ASSERT(!fallback_);
    if (!(residual > 0.0)) return 0.0;
    const double draft = draft_probability(candidate);
    if (!(draft > residual)) return 1.0;
    return residual / draft;
  }

  /// The candidate was rejected: r := norm(max(0, r - q_i)) with r(c) := 0; without
  /// replacement, then q_{i+1} := q_i without c. Sets fallback() on zero residual mass.
  /// The subtraction is deferred until r is next needed: when a draw follows directly (the
  /// last candidate of a node, e.g. every chain position) it is fused into that draw.
  void reject(token_id candidate) {
    resolve();
    SPECDEC_ASSERT(!fallback_);
    pending_ = true;
    pending_candidate_ = static_cast<std::size_t>(candidate);
  }

  /// With replacement: a draw that repeated an already rejected candidate (accepted with
  /// probability 0): r := norm(max(0, r - q)).
  void reject_repeat() {
    SPECDEC_ASSERT(kind_ == expansion::with_replacement);
    resolve();
    SPECDEC_ASSERT(!fallback_);
    pending_ = true;
    pending_candidate_ = no_candidate;
  }

  /// Whether the residual lost its mass; the node then draws from p.
  [[nodiscard]] bool fallback() {
    resolve();
    return fallback_;
  }

  /// A draw from r (from p after a fallback or before any rejection). Sets fallback() if the
  /// residual turns out to have no mass. One uniform, two on a fallback after an earlier
  /// rejection at the node (the second for the draw from p).
  template <std::uniform_random_bit_generator G>
  [[nodiscard]] token_id sample(G& g) {
    if (pending_ && fusable()) {
      pending_ = false;
      const std::span<const T> source = materialized_ ? std::span<const T>(residual_) : target_;
      const ResidualDraw draw =
          kind_ == expansion::one_hot
              ? sample_residual_one_hot(source, static_cast<token_id>(pending_candidate_), g)
              : sample_residual(source, draft_, g);
      if (!draw.fallback) return draw.token;
      fallback_ = true;
      // The core's fallback drew from `source`; the node's fallback is p.
      return materialized_ ? sample_from_row(target_, g) : draw.token;
    }
    resolve();
    if (materialized_ && !fallback_) return sample_from_row(std::span<const T>(residual_), g);
    return sample_from_row(target_, g);
  }

 private:
  static constexpr std::size_t no_candidate = static_cast<std::size_t>(-1);

  /// Whether the pending subtraction is one the core's one-pass residual samplers do:
  /// norm(max(0, r - q)) with q the stored row, or r without one token. (A rejected
  /// candidate c has r(c) < q_i(c), so its clamped difference is exactly 0 already.)
  [[nodiscard]] bool fusable() const noexcept {
    if (kind_ == expansion::one_hot) return pending_candidate_ != no_candidate;
    if (kind_ == expansion::with_replacement) return true;
    return !masked_;  // without replacement: q_1 = q itself
  }

  void resolve() {
    if (!pending_) return;
    pending_ = false;
    subtract(pending_candidate_);
  }

  void subtract(std::size_t candidate) {
    const std::size_t size = target_.size();
    const T* source = materialized_ ? residual_.data() : target_.data();
    residual_.resize(size);
    T* residual = residual_.data();
    // One pass: the clamped difference and its sum (independent lanes: vectorizes without
    // -ffast-math); q_i = draft / draft_mass (draft_mass = 1 except without replacement).
    constexpr std::size_t lanes = 8;
    std::array<double, lanes> lane{};
    const auto kernel = [&](auto difference) {
      std::size_t j = 0;
      for (; j + lanes <= size; j += lanes) {
        for (std::size_t k = 0; k < lanes; ++k) {
          const T value = difference(j + k);
          residual[j + k] = value;
          lane[k] += static_cast<double>(value);
        }
      }
      for (; j < size; ++j) {
        const T value = difference(j);
        residual[j] = value;
        lane[0] += static_cast<double>(value);
      }
    };
    if (kind_ == expansion::one_hot) {
      kernel([source](std::size_t j) { return source[j] > T(0) ? source[j] : T(0); });
    } else {
      const T* draft = draft_.data();
      if (kind_ == expansion::without_replacement) {
        if (!masked_) {
          remaining_draft_.assign(draft_.begin(), draft_.end());
          masked_ = true;
        }
        draft = remaining_draft_.data();
      }
      const T scale = static_cast<T>(1.0 / draft_mass_);
      kernel([source, draft, scale](std::size_t j) {
        const T difference = source[j] - scale * draft[j];
        return difference > T(0) ? difference : T(0);
      });
    }
    materialized_ = true;
    double mass =
        ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    if (candidate != no_candidate) {
      mass -= static_cast<double>(residual[candidate]);
      residual[candidate] = T(0);
    }
    if (!(mass > 0.0 && mass <= std::numeric_limits<double>::max())) {
      fallback_ = true;
      return;
    }
    const T inverse = static_cast<T>(1.0 / mass);
    for (std::size_t j = 0; j < size; ++j) residual[j] *= inverse;
    if (kind_ == expansion::without_replacement && candidate != no_candidate) {
      remaining_draft_[candidate] = T(0);
      draft_mass_ = tree_row_sum(std::span<const T>(remaining_draft_));
    }
  }

  std::span<const T> target_;
  std::span<const T> draft_;
  expansion kind_ = expansion::none;
  std::vector<T> residual_;
  std::vector<T> remaining_draft_;
  double draft_mass_ = 1.0;
  std::size_t pending_candidate_ = no_candidate;
  bool pending_ = false;
  bool materialized_ = false;
  bool masked_ = false;
  bool fallback_ = false;
};

}  // namespace specdec::detail
