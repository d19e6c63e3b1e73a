// specdec — exact-match verification for greedy decoding (temperature 0).
//
// Greedy decoding emits the argmax of each target row. Speculative greedy decoding keeps
// draft x_i while it is the argmax of p_i and then emits the argmax of the first mismatching
// row (a correction) or of p_{gamma+1} (a bonus); the output is token-for-token identical to
// plain greedy decoding. This is Algorithm 1 in the limit T -> 0, where p and q become
// one-hot, and works for any drafter (no draft distribution needed).
//
// Ties are broken by the lowest token id, here and in `argmax`, so that the result never
// depends on how a scan is vectorized.
#pragma once

#include <cstddef>
#include <limits>
#include <span>
#include <type_traits>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/rows.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

/// Index of the largest entry, the lowest id among ties (vectorized two-pass scan: the
/// maximum, then its first occurrence). Preconditions: non-empty row, no NaN entries.
template <ProbabilityScalar T>
[[nodiscard]] token_id argmax(std::span<const T> row) noexcept {
  SPECDEC_ASSERT(!row.empty());
  return static_cast<token_id>(detail::row_argmax(row.data(), row.size()));
}

/// argmax for any probability vector (std::vector, Eigen vectors, ...).
template <ProbabilityVector Row>
[[nodiscard]] token_id argmax(const Row& row) noexcept {
  return argmax(as_span(row));
}

namespace detail {

/// Whether the largest entry of a screened row is one greedy decoding can take: positive
/// (else the row is all zero) and finite.
template <class T>
[[nodiscard]] inline bool greedy_pick_valid(T largest) noexcept {
  return largest > T(0) && largest <= std::numeric_limits<T>::max();
}

/// The argmax of a row greedy decoding takes a token from, with its validation fused into
/// the scan: no_index if the row holds a NaN or negative entry, an infinite maximum or only
/// zeros (the caller names the problem with validate_greedy_row).
template <class T>
[[nodiscard]] inline std::size_t screened_argmax(const T* row, std::size_t size) noexcept {
  bool valid = true;
  const std::size_t best = row_argmax<true>(row, size, valid);
  return valid && greedy_pick_valid(row[best]) ? best : no_index;
}

/// Exact-match verification (verify_greedy's rule). With `Screen`, greedy decoding's row
/// validation is fused into the scans: every row a token is taken from is read entirely,
/// and a row holding a NaN or negative entry, an infinite maximum or only zeros stops it
/// with `bad_row` set to that row's index (else no_index). Rows after the first mismatch
/// are never read.
template <bool Screen, class T>
[[nodiscard]] VerificationResult greedy_verify_rows(std::span<const token_id> draft_tokens,
                                                    RowsView<const T> target_rows,
                                                    std::size_t& bad_row) noexcept {
  const std::size_t gamma = draft_tokens.size();
  const std::size_t vocab_size = target_rows.cols();
  SPECDEC_ASSERT(target_rows.rows() == gamma + 1);
  SPECDEC_ASSERT(vocab_size > 0);
  bad_row = no_index;
  // t = the argmax of row i (correction or bonus).
  const auto take = [&](std::size_t i, token_source source) -> VerificationResult {
    const T* row = target_rows.row(i).data();
    const std::size_t best =
        Screen ? screened_argmax(row, vocab_size) : row_argmax(row, vocab_size);
    if (Screen && best == no_index) {
      bad_row = i;
      return {};
    }
    return {i, static_cast<token_id>(best), source, false};
  };
  for (std::size_t i = 0; i < gamma; ++i) {
    const token_id drafted = draft_tokens[i];
    SPECDEC_ASSERT(drafted >= 0 && static_cast<std::size_t>(drafted) < vocab_size);
    const T* row = target_rows.row(i).data();
    const auto x = static_cast<std::size_t>(drafted);
    bool valid = true;
    if (!is_row_argmax<Screen>(row, vocab_size, x, valid)) {
      return take(i, token_source::correction);
    }
    if (Screen && !(valid && greedy_pick_valid(row[x]))) {
      bad_row = i;
      return {};
    }
  }
  return take(gamma, token_source::bonus);
}

/// greedy_verify_rows with the validation fused in (the decoder's greedy path).
template <class T>
[[nodiscard]] VerificationResult verify_greedy_screened(std::span<const token_id> draft_tokens,
                                                        RowsView<const T> target_rows,
                                                        std::size_t& bad_row) noexcept {
  return greedy_verify_rows<true>(draft_tokens, target_rows, bad_row);
}

}  // namespace detail

/// Exact-match verification (unchecked fast path): accepts x_i while x_i is the argmax of
/// p_i (lowest id among ties), then t = argmax of the first mismatching row (correction) or
/// of p_{gamma+1} (bonus). Proving that x_i is not the argmax stops at the first entry that
/// beats p_i(x_i); rows after the first mismatch are never read. residual_fallback is always
/// false. Preconditions (asserted in debug builds where cheap): target_rows has gamma+1 rows
/// of width V > 0 (gamma = draft_tokens.size()), 0 <= x_i < V, no NaN entries. Row sums do
/// not matter here, so unnormalised scores (logits) work too.
template <ProbabilityScalar T>
[[nodiscard]] VerificationResult verify_greedy(std::span<const token_id> draft_tokens,
                                               RowsView<const T> target_rows) noexcept {
  std::size_t unused = 0;
  return detail::greedy_verify_rows<false>(draft_tokens, target_rows, unused);
}

/// verify_greedy for any probability matrix (row-major Eigen matrices, RowsView of
/// non-const data, ...).
template <ProbabilityMatrix TargetRows>
[[nodiscard]] VerificationResult verify_greedy(std::span<const token_id> draft_tokens,
                                               const TargetRows& target_rows) noexcept {
  return verify_greedy(draft_tokens, as_rows(target_rows));
}

/// Validates the inputs, then runs verify_greedy. Throws `specdec::error`: errc::invalid_size
/// for a wrong number of rows or V = 0, errc::invalid_token for a draft token outside
/// [0, V), and every row error of validate_probability_row (V is the width of the rows;
/// `step` only labels messages).
template <ProbabilityScalar T>
[[nodiscard]] VerificationResult verify_greedy_checked(std::span<const token_id> draft_tokens,
                                                       RowsView<const T> target_rows,
                                                       std::size_t step = RowLocation::npos) {
  const std::size_t vocab_size = target_rows.cols();
  validate_probability_rows(target_rows, draft_tokens.size() + 1, vocab_size, {"target", step});
  validate_tokens(draft_tokens, vocab_size, {"draft", step});
  return verify_greedy(draft_tokens, target_rows);
}

/// Checked twin of the generic verify_greedy overload.
template <ProbabilityMatrix TargetRows>
[[nodiscard]] VerificationResult verify_greedy_checked(std::span<const token_id> draft_tokens,
                                                       const TargetRows& target_rows,
                                                       std::size_t step = RowLocation::npos) {
  return verify_greedy_checked(draft_tokens, as_rows(target_rows), step);
}

}  // namespace specdec
