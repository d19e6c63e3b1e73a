// specdec — loading a model row into a decoding step, the same way for draft rows (q) and
// target rows (p): standardized with its checks (standardize_checked), or, with top-k
// truncation, kept as its survivors (SurvivorRows: one selection pass with validation fused
// into it; verification, beta and the draws then read at most top_k entries per row).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/detail/sparse_rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/step_checks.hpp"
#include "specdec/validation.hpp"

namespace specdec {

/// Standardizes a model row into `out` with its checks: the size always (first), and with
/// validate_rows the screen, taken from the standardization's first pass where it takes one
/// (Standardizer::screens_first_pass: the row is then checked after it, which is safe on any
/// row), else a pass of its own before. Returns the top standardized probability.
/// `deferred`: as Standardizer::apply's (the caller writes top-p's nucleus).
template <class T, class U>
double standardize_checked(Standardizer<T>& standardizer, std::span<const U> row, std::span<T> out,
                           const StepChecks& checks, std::string_view model, std::size_t index,
                           detail::nucleus_keep_hook<U, T>* deferred = nullptr) {
  const bool validate = checks.validate_rows() && !standardizer.options().greedy();
  if (!validate || !standardizer.template screens_first_pass<U>(row.size())) {
    checks.check_row(row, model, index);
    return standardizer.apply(row, out, nullptr, deferred);
  }
  checks.check_size(row, model, index);
  detail::first_pass_screen screen;
  const double top = standardizer.apply(row, out, &screen, deferred);
  if (!detail::plausible_total<U>(screen.signs_passed, screen.total, default_sum_tolerance<U>)) {
    checks.reject_probability_row(row, model, index);
  }
  return top;
}

/// Target rows of top-p alone at T = 1 that the score stage reads in place (ScoreStage): the
/// model's row with its nucleus's bounds and scale (detail::nucleus_view), which every pass
/// reads as the written row, bitwise. at(i) is row i's view, or null where the stage wrote
/// row i (or for every row when `views` is null); called after load_through(i).
template <class T>
struct nucleus_rows {
  const detail::nucleus_view<T>* views = nullptr;

  [[nodiscard]] const detail::nucleus_view<T>* at(std::size_t i) const noexcept {
    return views != nullptr && views[i].row != nullptr ? views + i : nullptr;
  }
};

/// The survivors of a step's rows truncated by top-k (Standardizer::apply_sparse), top_k
/// slots per row: ids in increasing order and their standardized weights.
template <class T>
class SurvivorRows {
 public:
  /// Room for `rows` rows of `width` (= top_k) survivors.
  void resize(std::size_t rows, std::size_t width) {
    width_ = width;
    ids_.resize(rows * width);
    weights_.resize(rows * width);
    counts_.resize(rows);
  }

  /// Standardizes a model row into slot i: size check, then the selection pass with
  /// validation (validate_rows) fused into it. `scratch` holds V entries. Returns the number
  /// of survivors (0 only for a row without positive mass, which validation rejects).
  template <class U>
  std::size_t load(std::span<const U> row, std::size_t i, Standardizer<T>& standardizer,
                   std::span<T> scratch, const StepChecks& checks, std::string_view model,
                   double& top_probability) {
    checks.check_size(row, model, i);
    detail::row_screen<U> screen;
    const bool validate = checks.validate_rows();
    const std::size_t count = standardizer.apply_sparse(
        row, scratch, ids_.data() + i * width_, weights_.data() + i * width_, top_probability,
        validate ? &screen : nullptr);
    if (validate) checks.check_screen(screen, row, model, i);
    counts_[i] = count;
    return count;
  }

  [[nodiscard]] detail::sparse_row<T> operator[](std::size_t i) const noexcept {
    return {ids_.data() + i * width_, weights_.data() + i * width_, counts_[i]};
  }

 private:
  std::size_t width_ = 0;
  std::vector<std::uint32_t> ids_;
  std::vector<T> weights_;
  std::vector<std::size_t> counts_;
};

}  // namespace specdec
