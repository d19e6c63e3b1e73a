// specdec — the residual distribution norm(max(0, p - l q)) of speculative sampling
// (paper Sec. 2.3 and Algorithm 1; lenience l from App. A.5, l = 1 is exact), and plain
// inverse-CDF draws from a probability row.
//
// Every draw is one streaming pass over the row(s) plus a short walk:
//  1. the pass computes the clamped weights w_j = max(0, p_j - l q_j) and sums them, a block
//     of 128 entries at a time in 16 independent lanes (SIMD packets through fixed-size Eigen
//     arrays, no -ffast-math needed), accumulating the block sums in double and storing the
//     cumulative masses of at most 256 superblocks; the total is the normaliser Z. Z is the
//     sum of the clamped differences itself, never 1 - sum(min(p, q)), which would cancel
//     catastrophically when p and q are close;
//  2. the draw takes u ~ U[0,1) and returns the first token whose cumulative weight exceeds
//     u Z: a binary search over the superblocks, then a walk over the block sums of the one
//     chosen superblock (recomputed by the same kernel, hence equal to those of the pass;
//     any rounding mismatch, e.g. from FMA contraction in a user's build, is absorbed by the
//     overrun rule of detail::walk_masses), then over the entries of one block. At V = 256k the
//     walk reads 1024 entries of each row again; the pass reads each row once.
// Accuracy: see detail::mass_table (for float rows every mass is within 6.6e-7 relative of
// the exact sum of the given entries, for any V; for double rows within about 1e-15).
// NaN entries weigh nothing (max(0, NaN) = 0).
//
// Zero or non-finite residual mass. Under exact arithmetic the residual at a rejected
// position has positive mass (a rejection needs some q(x) > p(x), so some p(y) > q(y)).
// Z can still come out zero through rounding, or when p == q (then nothing is rejected in
// exact arithmetic, but a direct call may ask anyway), or non-finite for rows that violate
// the preconditions. Policy: the draw then falls back to sampling p itself (for a one-hot
// draft: p without the drafted token, and if that has no mass either, p) and reports the
// event (`ResidualDraw::fallback`, `residual_distribution::fallback_count`). The result is
// never NaN-driven, never an index of zero weight (unless every fallback has zero mass:
// then the argmax of p, lowest id among ties) and never outside [0, V).
//
// Random numbers: every draw consumes exactly one specdec::uniform01<double>(g).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/random.hpp"

namespace specdec {

/// A token drawn from a residual, and whether the documented fallback was taken.
struct ResidualDraw {
  token_id token = 0;
  bool fallback = false;  ///< the residual had zero or non-finite mass: drawn from p instead

  friend constexpr bool operator==(const ResidualDraw&, const ResidualDraw&) = default;
};

namespace detail {

/// Calls `action` with the residual source for lenience l: the exact source for l == 1
/// (no multiplication at all), the lenient one otherwise.
template <class T, class Action>
decltype(auto) with_residual_source(std::span<const T> target, std::span<const T> draft,
                                    double lenience, Action&& action) {
  if (lenience == 1.0) {
    return action(difference_source<T>{target.data(), draft.data(), target.size()});
  }
  return action(lenient_difference_source<T>{target.data(), draft.data(), target.size(),
                                             static_cast<T>(lenience)});
}

/// An index drawn from a source (no_index if its mass is zero or non-finite) and the mass.
struct indexed_draw {
  std::size_t index;
  double mass;
};

/// One full draw from a source: builds the mass table (the streaming pass, with
/// `before_block` fused into it, see build_mass_table) and walks it.
template <class Source, class BeforeBlock>
[[nodiscard]] indexed_draw draw_index(const Source& source, double u,
                                      BeforeBlock&& before_block) noexcept {
  mass_table table;
  build_mass_table(source, table, before_block);
  if (!table.drawable()) return {no_index, table.total};
  return {draw_from_table(source, table, u), table.total};
}

/// One full draw from a source; no_index if the mass is zero or non-finite.
template <class Source>
[[nodiscard]] std::size_t draw_index(const Source& source, double u) noexcept {
  return draw_index(source, u, no_block_hook{}).index;
}

/// The last resort when even p has no positive finite mass (a violated precondition):
/// the argmax of p, lowest id among ties, always in range.
template <class T>
[[nodiscard]] token_id last_resort(std::span<const T> target) noexcept {
  return static_cast<token_id>(row_argmax(target.data(), target.size()));
}

/// A draw from p (the fallback of every residual, and the bonus token), `before_block`
/// fused into its pass over p.
template <class T, class BeforeBlock = no_block_hook>
[[nodiscard]] token_id draw_from_target(std::span<const T> target, double u,
                                        BeforeBlock&& before_block = {}) noexcept {
  const std::size_t index =
      draw_index(row_source<T>{target.data(), target.size()}, u, before_block).index;
  return index == no_index ? last_resort(target) : static_cast<token_id>(index);
}

/// A residual draw, its fallback flag and the residual mass Z as computed.
struct residual_outcome {
  token_id token;
  bool fallback;
  double mass;
};

/// t ~ norm(max(0, p - f c)) for draft entries c and a factor f in T: f = l for a
/// normalised draft row (sample_residual), f = l / s for a draft row kept unnormalised
/// with sum s (the decoder's draft rows). f == 1 subtracts without multiplying.
/// `before_block` is fused into the pass over the rows. Fallback as sample_residual.
template <class T, class BeforeBlock = no_block_hook>
[[nodiscard]] residual_outcome residual_draw(std::span<const T> target, std::span<const T> draft,
                                             T factor, double u,
                                             BeforeBlock&& before_block = {}) noexcept {
  const indexed_draw draw =
      factor == T(1) ? draw_index(difference_source<T>{target.data(), draft.data(), target.size()},
                                  u, before_block)
                     : draw_index(lenient_difference_source<T>{target.data(), draft.data(),
                                                               target.size(), factor},
                                  u, before_block);
  if (draw.index != no_index) return {static_cast<token_id>(draw.index), false, draw.mass};
  return {draw_from_target(target, u), true, draw.mass};
}

/// draw_from_target for a top-p row read in place (nucleus_view, `size` entries): the
/// token the written row gives, last resort included (the written row's argmax, lowest id
/// among ties).
template <class T>
[[nodiscard]] token_id draw_from_nucleus(const nucleus_view<T>& p, std::size_t size,
                                         double u) noexcept {
  const std::size_t index = draw_index(nucleus_row_source<T>{p, size}, u);
  if (index != no_index) return static_cast<token_id>(index);
  std::size_t best = 0;
  T top = p.at(0);
  for (std::size_t j = 1; j < size; ++j) {
    const T value = p.at(j);
    if (value > top) {
      top = value;
      best = j;
    }
  }
  return static_cast<token_id>(best);
}

/// residual_draw for a top-p row read in place: t ~ norm(max(0, p - f c)), bitwise the
/// outcome of residual_draw over the written row, `before_block` fused into its pass.
template <class T, class BeforeBlock = no_block_hook>
[[nodiscard]] residual_outcome residual_draw_nucleus(const nucleus_view<T>& p, std::size_t size,
                                                     std::span<const T> draft, T factor, double u,
                                                     BeforeBlock&& before_block = {}) noexcept {
  const indexed_draw draw = draw_index(
      nucleus_scaled_difference_source<T>{p, draft.data(), size, T(1), factor}, u, before_block);
  if (draw.index != no_index) return {static_cast<token_id>(draw.index), false, draw.mass};
  return {draw_from_nucleus(p, size, u), true, draw.mass};
}

/// t ~ norm(max(0, p - l e_x)) (sample_residual_one_hot), `before_block` fused into its
/// first pass over p.
template <class T, class BeforeBlock = no_block_hook>
[[nodiscard]] residual_outcome residual_one_hot_draw(std::span<const T> target, std::size_t x,
                                                     double lenience, double u,
                                                     BeforeBlock&& before_block = {}) noexcept {
  const T remaining =
      lenience == 1.0 ? T(0) : clamp_nonnegative(target[x] - static_cast<T>(lenience));
  const indexed_draw draw = draw_index(
      replaced_entry_source<T>{target.data(), target.size(), x, remaining}, u, before_block);
  if (draw.index != no_index) return {static_cast<token_id>(draw.index), false, draw.mass};
  if (remaining != T(0)) {  // lenient residual empty: try p without x
    const std::size_t index =
        draw_index(replaced_entry_source<T>{target.data(), target.size(), x, T(0)}, u);
    if (index != no_index) return {static_cast<token_id>(index), true, draw.mass};
  }
  return {draw_from_target(target, u), true, draw.mass};
}

}  // namespace detail

/// Draws a token from `row` normalised by its own sum (an inverse-CDF draw; the row need
/// not sum to exactly 1). Used for the bonus token from p_{gamma+1}. Preconditions: the
/// row is non-empty with finite, non-negative entries and a positive sum (negative and NaN
/// entries are treated as 0; a row without positive finite mass yields its argmax).
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
[[nodiscard]] token_id sample_from_row(std::span<const T> row, G& g) {
  SPECDEC_ASSERT(!row.empty());
  return detail::draw_from_target(row, uniform01<double>(g));
}

/// The residual mass Z = sum_j max(0, p_j - l q_j), computed as the sampler computes it.
/// For l = 1 it equals 1 - beta (paper A.1) up to rounding.
template <ProbabilityScalar T>
[[nodiscard]] double residual_mass(std::span<const T> target, std::span<const T> draft,
                                   double lenience = 1.0) noexcept {
  SPECDEC_ASSERT(target.size() == draft.size());
  return detail::with_residual_source(target, draft, lenience, [](const auto& source) {
    detail::mass_table table;
    detail::build_mass_table(source, table);
    return table.total;
  });
}

/// Draws t ~ norm(max(0, p - l q)) with p = `target`, q = `draft` (Algorithm 1's
/// correction after a rejection). One streaming pass over both rows plus a walk over one
/// superblock. Falls back to p when the residual has zero or non-finite mass (see the top
/// of this header). Preconditions (asserted in debug builds): equal, non-zero lengths;
/// 0 < lenience <= 1; entries finite and non-negative.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
[[nodiscard]] ResidualDraw sample_residual(std::span<const T> target, std::span<const T> draft,
                                           G& g, double lenience = 1.0) {
  SPECDEC_ASSERT(target.size() == draft.size());
  SPECDEC_ASSERT(!target.empty());
  SPECDEC_ASSERT(lenience > 0.0 && lenience <= 1.0);
  const detail::residual_outcome draw =
      detail::residual_draw(target, draft, static_cast<T>(lenience), uniform01<double>(g));
  return {draw.token, draw.fallback};
}

/// Draws t ~ norm(max(0, p - l e_x)): the residual of a one-hot draft q = e_x, i.e. p with
/// the drafted token x removed when l = 1 (its weight becomes max(0, p(x) - l) in general).
/// Fallback chain for zero mass: p without x, then p. Preconditions (asserted in debug
/// builds): non-empty row, 0 <= drafted < size, 0 < lenience <= 1.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
[[nodiscard]] ResidualDraw sample_residual_one_hot(std::span<const T> target, token_id drafted,
                                                   G& g, double lenience = 1.0) {
  SPECDEC_ASSERT(!target.empty());
  SPECDEC_ASSERT(drafted >= 0 && static_cast<std::size_t>(drafted) < target.size());
  SPECDEC_ASSERT(lenience > 0.0 && lenience <= 1.0);
  const detail::residual_outcome draw = detail::residual_one_hot_draw(
      target, static_cast<std::size_t>(drafted), lenience, uniform01<double>(g));
  return {draw.token, draw.fallback};
}

/// The residual distribution norm(max(0, p - l q)) as a distribution object, shaped like
/// the standard ones (`param_type`, `operator()(g)`, `operator()(g, param)`, `min`, `max`).
/// Setting the parameters runs the streaming pass once and keeps the superblock masses, so
/// repeated draws from the same rows cost a walk over one superblock each. The rows are
/// referenced, not copied: they must outlive the distribution and stay unchanged.
/// Zero or non-finite residual mass: every draw comes from p and is counted in
/// fallback_count() (see the top of this header).
/// @code
/// specdec::residual_distribution<float> residual(p_row, q_row);
/// specdec::xoshiro256pp g(7);
/// specdec::token_id t = residual(g);
/// @endcode
template <ProbabilityScalar T>
class residual_distribution {
 public:
  using result_type = token_id;
  using scalar_type = T;

  class param_type {
   public:
    using distribution_type = residual_distribution;

    param_type() noexcept = default;
    /// Preconditions (asserted in debug builds): equal, non-zero lengths, 0 < lenience <= 1.
    param_type(std::span<const T> target, std::span<const T> draft, double lenience = 1.0) noexcept
        : target_(target), draft_(draft), lenience_(lenience) {
      SPECDEC_ASSERT(target.size() == draft.size());
      SPECDEC_ASSERT(!target.empty());
      SPECDEC_ASSERT(lenience > 0.0 && lenience <= 1.0);
    }

    [[nodiscard]] std::span<const T> target() const noexcept { return target_; }
    [[nodiscard]] std::span<const T> draft() const noexcept { return draft_; }
    [[nodiscard]] double lenience() const noexcept { return lenience_; }

    /// Same rows (by identity) and same lenience.
    friend bool operator==(const param_type& a, const param_type& b) noexcept {
      return a.target_.data() == b.target_.data() && a.target_.size() == b.target_.size() &&
             a.draft_.data() == b.draft_.data() && a.lenience_ == b.lenience_;
    }

   private:
    std::span<const T> target_;
    std::span<const T> draft_;
    double lenience_ = 1.0;
  };

  residual_distribution() noexcept = default;
  residual_distribution(std::span<const T> target, std::span<const T> draft,
                        double lenience = 1.0) noexcept
      : residual_distribution(param_type(target, draft, lenience)) {}
  explicit residual_distribution(const param_type& param) noexcept { this->param(param); }

  /// Draws are independent; nothing to reset.
  void reset() noexcept {}

  [[nodiscard]] const param_type& param() const noexcept { return param_; }
  /// Sets the rows and runs the streaming pass over them.
  void param(const param_type& param) noexcept {
    param_ = param;
    fallback_ = false;
    if (param_.target().empty()) {
      table_ = {};
      return;
    }
    detail::with_residual_source(param_.target(), param_.draft(), param_.lenience(),
                                 [this](const auto& source) {
                                   detail::build_mass_table(source, table_);
                                   return 0;
                                 });
    if (!table_.drawable()) {
      fallback_ = true;
      detail::build_mass_table(target_source(), table_);
    }
  }

  [[nodiscard]] result_type min() const noexcept { return 0; }
  [[nodiscard]] result_type max() const noexcept {
    return param_.target().empty() ? 0 : static_cast<result_type>(param_.target().size() - 1);
  }

  /// The residual mass Z as computed (0 if it was zero or non-finite, see falls_back()).
  [[nodiscard]] double mass() const noexcept { return fallback_ ? 0.0 : table_.total; }
  /// Whether the residual has zero or non-finite mass, so that draws come from p.
  [[nodiscard]] bool falls_back() const noexcept { return fallback_; }
  /// How many draws so far came from the fallback.
  [[nodiscard]] std::uint64_t fallback_count() const noexcept { return fallback_count_; }

  /// Draws from the current parameters (reusing the stored superblock masses).
  /// Precondition: parameters were set (non-empty rows).
  template <std::uniform_random_bit_generator G>
  [[nodiscard]] result_type operator()(G& g) {
    SPECDEC_ASSERT(!param_.target().empty());
    const double u = uniform01<double>(g);
    std::size_t index = detail::no_index;
    if (fallback_) {
      ++fallback_count_;
      if (table_.drawable()) index = detail::draw_from_table(target_source(), table_, u);
      return index == detail::no_index ? detail::last_resort(param_.target())
                                       : static_cast<result_type>(index);
    }
    index = detail::with_residual_source(
        param_.target(), param_.draft(), param_.lenience(),
        [&](const auto& source) { return detail::draw_from_table(source, table_, u); });
    if (index != detail::no_index) return static_cast<result_type>(index);
    ++fallback_count_;  // the rows changed under us; behave like sample_residual
    return detail::draw_from_target(param_.target(), u);
  }

  /// Draws from `param` (one streaming pass; the stored parameters are untouched).
  template <std::uniform_random_bit_generator G>
  [[nodiscard]] result_type operator()(G& g, const param_type& param) {
    const ResidualDraw draw = sample_residual(param.target(), param.draft(), g, param.lenience());
    if (draw.fallback) ++fallback_count_;
    return draw.token;
  }

  friend bool operator==(const residual_distribution& a, const residual_distribution& b) noexcept {
    return a.param_ == b.param_;
  }

 private:
  [[nodiscard]] detail::row_source<T> target_source() const noexcept {
    return {param_.target().data(), param_.target().size()};
  }

  param_type param_;
  detail::mass_table table_{};  // of the residual, or of p when fallback_
  bool fallback_ = false;
  std::uint64_t fallback_count_ = 0;
};

}  // namespace specdec
