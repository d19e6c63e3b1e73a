// specdec — boundary validation of probability rows, token ids and options.
//
// The checked entry points (verify_speculative_checked, verify_greedy_checked, ...) and the
// decoder call these before anything else; the unchecked fast paths only assert their
// preconditions in debug builds. Every failure throws `specdec::error` with a message that
// names the model, step, row and token, e.g.
//   "specdec: invalid_probability: target row 2 (step 7): entry for token 17 is NaN".
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "specdec/concepts.hpp"
#include "specdec/detail/decoder_kernels.hpp"
#include "specdec/error.hpp"
#include "specdec/rows.hpp"

namespace specdec {

/// Where a row (or token) came from, for error messages. Unknown parts are left out.
struct RowLocation {
  std::string_view model = "";  ///< "target" / "draft" / "" (unknown)
  std::size_t step = npos;      ///< decoder step, npos if not applicable
  std::size_t row = npos;       ///< row/position within the step, npos if n/a
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
};

/// How far the sum of a row may be from 1. Float rows get 1e-3: a float softmax over a
/// 256k vocabulary typically normalises to within 1e-4, and the sampler renormalises by the
/// sum it computes anyway; what the check catches are unnormalised scores (logits, counts).
/// Double rows get 1e-6, far above double rounding (V * 2^-53 < 1e-10 for V <= 256k) but
/// loose enough for float rows widened to double.
template <class T>
inline constexpr double default_sum_tolerance = 1e-6;
template <>
inline constexpr double default_sum_tolerance<float> = 1e-3;

namespace detail {

/// "target row 2 (step 7)"; parts that are unknown are left out ("row 2", "target row").
inline std::string describe_location(const RowLocation& where, std::string_view noun) {
  std::string text(where.model);
  if (!text.empty()) text += ' ';
  text += noun;
  if (where.row != RowLocation::npos) {
    text += ' ';
    text += std::to_string(where.row);
  }
  if (where.step != RowLocation::npos) {
    text += " (step ";
    text += std::to_string(where.step);
    text += ')';
  }
  return text;
}

}  // namespace detail

/// Checks one probability row. Throws `specdec::error` with
///  - errc::invalid_size if `row.size() != vocab_size` (or vocab_size is 0),
///  - errc::invalid_probability for the first NaN, infinite or negative entry (naming its
///    token id),
///  - errc::zero_mass if all entries are zero,
///  - errc::not_normalized if the sum (accumulated in double) is off 1 by more than
///    `tolerance`.
/// Cost: one vectorized screening pass (the kernel path's) for a valid row; the exact scalar
/// scan in index order only for rows the screen does not clear.
template <ProbabilityScalar T>
void validate_probability_row(std::span<const T> row, std::size_t vocab_size,
                              const RowLocation& where,
                              double tolerance = default_sum_tolerance<T>) {
  if (vocab_size == 0) {
    detail::throw_error(errc::invalid_size, detail::describe_location(where, "row"),
                        ": the vocabulary size is 0");
  }
  if (row.size() != vocab_size) {
    detail::throw_error(errc::invalid_size, detail::describe_location(where, "row"), ": has ",
                        row.size(), " entries, expected the vocabulary size ", vocab_size);
  }
  // One vectorized pass decides almost every valid row; a row it does not clear (a bad
  // entry, a sum near the tolerance, -0.0 entries) goes to the exact scan below, which names
  // the problem or accepts the row. The screen is conservative: the verdicts are the scan's.
  // Its tolerance is capped at 0.5 so that a cleared row has positive mass (the screen does
  // not look for zero rows; greedy checks pass an infinite tolerance).
  if (detail::plausible_probability_row(row.data(), row.size(), std::min(tolerance, 0.5))) {
    return;
  }
  double sum = 0.0;
  for (std::size_t j = 0; j < row.size(); ++j) {
    const T value = row[j];
    if (std::isnan(value)) {
      detail::throw_error(errc::invalid_probability, detail::describe_location(where, "row"),
                          ": entry for token ", j, " is NaN");
    }
    if (std::isinf(value)) {
      detail::throw_error(errc::invalid_probability, detail::describe_location(where, "row"),
                          ": entry for token ", j, " is infinite");
    }
    if (value < T(0)) {
      detail::throw_error(errc::invalid_probability, detail::describe_location(where, "row"),
                          ": entry for token ", j, " is negative (", value, ")");
    }
    sum += static_cast<double>(value);
  }
  if (sum == 0.0) {
    detail::throw_error(errc::zero_mass, detail::describe_location(where, "row"),
                        ": all entries are zero");
  }
  if (!(std::abs(sum - 1.0) <= tolerance)) {
    detail::throw_error(errc::not_normalized, detail::describe_location(where, "row"),
                        ": entries sum to ", sum, ", off 1 by more than the tolerance ", tolerance);
  }
}

/// Checks one row for greedy decoding, where only the argmax matters: every check of
/// validate_probability_row (size, NaN, infinite or negative entries, all zero: greedy
/// would pick token 0 of a row that rules out every token) except the sum, which argmax
/// does not need. Same codes and messages.
template <ProbabilityScalar T>
void validate_greedy_row(std::span<const T> row, std::size_t vocab_size, const RowLocation& where) {
  validate_probability_row(row, vocab_size, where, std::numeric_limits<double>::infinity());
}

/// Checks a block of rows: exactly `expected_rows` rows of `vocab_size` entries each
/// (errc::invalid_size otherwise), then every row as validate_probability_row does, with
/// `where.row` set to the row's index.
template <ProbabilityScalar T>
void validate_probability_rows(RowsView<const T> rows, std::size_t expected_rows,
                               std::size_t vocab_size, const RowLocation& where,
                               double tolerance = default_sum_tolerance<T>) {
  RowLocation block = where;
  block.row = RowLocation::npos;
  if (rows.rows() != expected_rows) {
    detail::throw_error(errc::invalid_size, detail::describe_location(block, "rows"), ": got ",
                        rows.rows(), " rows, expected ", expected_rows);
  }
  for (std::size_t i = 0; i < rows.rows(); ++i) {
    RowLocation at = where;
    at.row = i;
    validate_probability_row(std::span<const T>(rows.row(i)), vocab_size, at, tolerance);
  }
}

/// Checks a token id: errc::invalid_token unless 0 <= token < vocab_size.
inline void validate_token(token_id token, std::size_t vocab_size, const RowLocation& where) {
  if (token < 0 || static_cast<std::size_t>(token) >= vocab_size) {
    detail::throw_error(errc::invalid_token, detail::describe_location(where, "token at position"),
                        ": id ", token, " is outside [0, ", vocab_size, ")");
  }
}

/// Checks every token of a sequence; `where.row` is set to each token's position.
inline void validate_tokens(std::span<const token_id> tokens, std::size_t vocab_size,
                            const RowLocation& where) {
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    RowLocation at = where;
    at.row = i;
    validate_token(tokens[i], vocab_size, at);
  }
}

/// Checks a lenience factor (paper App. A.5): errc::domain unless 0 < lenience <= 1.
inline void validate_lenience(double lenience) {
  if (!(lenience > 0.0 && lenience <= 1.0)) {
    detail::throw_error(errc::domain, "lenience ", lenience, " is outside (0, 1]");
  }
}

}  // namespace specdec
