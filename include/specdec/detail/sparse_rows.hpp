// specdec — private kernels over sparse rows: the survivors of a row truncated by top-k
// (ids in increasing order and their probabilities, Standardizer::apply_sparse), and the
// draws, residuals and overlaps of Algorithm 1 computed over survivors only. A truncated row
// of V entries has at most top_k survivors, so after the one pass that selects them nothing
// in a step reads or writes V entries again.
//
// Every draw walks survivors in increasing id order, the order in which the dense kernels
// (row_kernels.hpp) walk a row, and consumes no random numbers itself (the caller passes u).
// Masses are summed in double in that order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "specdec/detail/row_kernels.hpp"

namespace specdec::detail {

/// The survivors of a truncated row: `count` ids in increasing order and their weights.
template <class T>
struct sparse_row {
  const std::uint32_t* ids = nullptr;
  const T* weights = nullptr;
  std::size_t count = 0;

  /// The weight of token `id` (0 if it did not survive): a binary search.
  [[nodiscard]] T at(std::size_t id) const noexcept {
    std::size_t low = 0;
    std::size_t high = count;
    while (low < high) {
      const std::size_t middle = low + (high - low) / 2;
      if (ids[middle] < id) {
        low = middle + 1;
      } else {
        high = middle;
      }
    }
    return low < count && ids[low] == id ? weights[low] : T(0);
  }
};

/// An index drawn over survivors (no_index if their mass is zero or non-finite) and the
/// mass it was drawn from.
struct indexed_mass_draw {
  std::size_t index;
  double mass;
};

/// A residual draw over sparse rows: the token id, whether the fallback to p was taken, and
/// the residual mass as computed.
struct sparse_residual_outcome {
  std::size_t token;
  bool fallback;
  double mass;
};

/// Inverse-CDF draw over `count` weights given by weight_of(k) (clamped at 0): the first
/// whose running mass exceeds u * total, total = their sum in order. Returns no_index if the
/// mass is zero or non-finite; an overrun through rounding takes the last positive weight.
template <class WeightOf>
[[nodiscard]] inline indexed_mass_draw sparse_draw_index(std::size_t count, double u,
                                                         WeightOf weight_of) noexcept {
  double total = 0.0;
  for (std::size_t k = 0; k < count; ++k) total += static_cast<double>(weight_of(k));
  if (!(total > 0.0 && total <= std::numeric_limits<double>::max())) return {no_index, total};
  const walk_position position = walk_masses(count, draw_target(total, u), [&](std::size_t k) {
    return static_cast<double>(weight_of(k));
  });
  return {position.index, total};
}

/// A token drawn from a sparse row (the bonus token, a draft, a fallback); the first
/// survivor if the row has no positive mass, `fallback_id` if it has no survivor.
template <class T>
[[nodiscard]] inline std::size_t sparse_draw(sparse_row<T> row, double u,
                                             std::size_t fallback_id) noexcept {
  const indexed_mass_draw draw = sparse_draw_index(
      row.count, u, [&](std::size_t k) { return clamp_nonnegative(row.weights[k]); });
  if (draw.index != no_index) return row.ids[draw.index];
  return row.count > 0 ? row.ids[0] : fallback_id;
}

/// For each survivor k of p, calls visit(k, q(ids[k])) with q's weight at the same id (0 if
/// it did not survive in q): one merge of the two increasing id lists.
template <class T, class Visit>
inline void merge_weights(sparse_row<T> p, sparse_row<T> q, Visit&& visit) noexcept {
  std::size_t b = 0;
  for (std::size_t k = 0; k < p.count; ++k) {
    const std::uint32_t id = p.ids[k];
    while (b < q.count && q.ids[b] < id) ++b;
    visit(k, b < q.count && q.ids[b] == id ? q.weights[b] : T(0));
  }
}

/// beta = sum_x min(p(x), q(x)) over the survivors both rows share.
template <class T>
[[nodiscard]] inline double sparse_overlap(sparse_row<T> p, sparse_row<T> q) noexcept {
  double total = 0.0;
  merge_weights(p, q, [&](std::size_t k, T q_weight) {
    const T p_weight = p.weights[k];
    total += static_cast<double>(p_weight < q_weight ? p_weight : q_weight);
  });
  return total;
}

/// A residual draw over sparse rows: t ~ norm(max(0, p - l q)) with the residual weights
/// written to `scratch` (p.count entries); falls back to p when that mass is zero or
/// non-finite. Returns the token, the fallback flag and the residual mass.
template <class T>
[[nodiscard]] inline sparse_residual_outcome sparse_residual_draw(sparse_row<T> p, sparse_row<T> q,
                                                                  T lenience, double u,
                                                                  T* scratch) noexcept {
  merge_weights(p, q, [&](std::size_t k, T q_weight) {
    scratch[k] = clamp_nonnegative(p.weights[k] - lenience * q_weight);
  });
  const indexed_mass_draw draw =
      sparse_draw_index(p.count, u, [&](std::size_t k) { return scratch[k]; });
  if (draw.index != no_index) return {p.ids[draw.index], false, draw.mass};
  return {sparse_draw(p, u, 0), true, draw.mass};
}

/// Block verification's residual over sparse rows: the weights max(0, s p - q) of p's
/// survivors (s = rho_n; q's weight at the same id, 0 if it did not survive) written to
/// `scratch` (p.count entries); returns their mass Z, summed in id order in double.
template <class T>
[[nodiscard]] inline double sparse_scaled_residual(sparse_row<T> p, sparse_row<T> q, T s,
                                                   T* scratch) noexcept {
  double total = 0.0;
  merge_weights(p, q, [&](std::size_t k, T q_weight) {
    scratch[k] = clamp_nonnegative(s * p.weights[k] - q_weight);
    total += static_cast<double>(scratch[k]);
  });
  return total;
}

/// The residual of a one-hot draft e_x over a sparse p: p without x (weight
/// max(0, p(x) - l) in general); fallback chain as sample_residual_one_hot: p without x,
/// then p.
template <class T>
[[nodiscard]] inline sparse_residual_outcome sparse_residual_one_hot_draw(sparse_row<T> p,
                                                                          std::size_t x,
                                                                          double lenience,
                                                                          double u) noexcept {
  const auto weight_without = [&](T remaining) {
    return [&p, x, remaining](std::size_t k) {
      return p.ids[k] == x ? remaining : clamp_nonnegative(p.weights[k]);
    };
  };
  const T remaining =
      lenience == 1.0 ? T(0) : clamp_nonnegative(p.at(x) - static_cast<T>(lenience));
  const indexed_mass_draw draw = sparse_draw_index(p.count, u, weight_without(remaining));
  if (draw.index != no_index) return {p.ids[draw.index], false, draw.mass};
  if (remaining != T(0)) {
    const indexed_mass_draw again = sparse_draw_index(p.count, u, weight_without(T(0)));
    if (again.index != no_index) return {p.ids[again.index], true, draw.mass};
  }
  return {sparse_draw(p, u, 0), true, draw.mass};
}

}  // namespace specdec::detail
