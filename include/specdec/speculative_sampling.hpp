// specdec — the verification step of speculative sampling (paper Algorithm 1, Sec. 2.3).
//
// Given draft tokens x_1..x_gamma sampled from the draft rows q_1..q_gamma, and the target
// rows p_1..p_{gamma+1} of all gamma+1 prefixes, decide how many drafts to accept (n) and
// draw the one target-side token t. The emitted tokens x_1..x_n, t are distributed exactly
// as n+1 tokens sampled autoregressively from the target (paper App. A.1).
//
// Lazy and single-pass: position i needs only p_i(x_i) and q_i(x_i); the loop stops at the
// first rejection; a full row is read only for the one draw at the end (the residual at
// position n+1 after a rejection: one streaming pass over p_{n+1} and q_{n+1}; or the bonus
// token from p_{gamma+1}). Rows after the first rejection are never touched.
//
// Acceptance (App. A.1, with lenience l from App. A.5): draw u ~ U[0,1) (53-bit double) and
// accept x_i iff u * l * q_i(x_i) < p_i(x_i), evaluated in double without a division.
// This accepts with probability min(1, p/(l q)) and settles the edge cases:
//  - l q(x) <= p(x): always accepted (u < 1);
//  - q(x) = 0 < p(x) (a draft that q gave no mass but proposed anyway): the ratio is +inf,
//    always accepted;
//  - p(x) = 0: never accepted, even if q(x) = 0 too, so a token the target rules out is
//    never emitted.
// Random numbers: one uniform01<double>(g) per examined position (n+1 of them after a
// rejection, gamma when all are accepted), then one for the final draw.
#pragma once

#include <cstddef>
#include <random>
#include <span>
#include <type_traits>
#include <utility>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

/// Options of the stochastic verification step.
struct SpeculativeSamplingOptions {
  /// Lenience l in (0, 1] (paper App. A.5). l = 1 is exact Algorithm 1. For l < 1 a draft x
  /// is accepted if l q(x) <= p(x), else with probability p(x) / (l q(x)), and a rejection
  /// draws from norm(max(0, p - l q)). This CHANGES the output distribution: the guarantee
  /// left is that no token is sampled with probability more than p(x) / l.
  double lenience = 1.0;
};

namespace detail {

template <class T>
void assert_step_shapes([[maybe_unused]] std::size_t gamma,
                        [[maybe_unused]] RowsView<const T> target_rows,
                        [[maybe_unused]] const SpeculativeSamplingOptions& options) noexcept {
  SPECDEC_ASSERT(target_rows.rows() == gamma + 1);
  SPECDEC_ASSERT(target_rows.cols() > 0);
  SPECDEC_ASSERT(options.lenience > 0.0 && options.lenience <= 1.0);
}

/// Draft rows stored normalised: q_i(x) = draft_rows(i, x).
struct unit_scales {
  [[nodiscard]] constexpr double operator[](std::size_t /*row*/) const noexcept { return 1.0; }
};

/// Algorithm 1's decisions: examines x_1, x_2, ... with one uniform each and returns n,
/// the number accepted before the first rejection (gamma if none). p_at(i, x) and
/// q_at(i, x) give p_i(x) and q_i(x) (dense rows, survivors of truncated rows, rows kept
/// unnormalised with a scalar normaliser). Reads two entries per examined position.
/// `CheckedEntries`: debug builds assert that the entries read are non-negative (the
/// precondition of verify_speculative); the decoder reads rows it validates afterwards, in
/// the passes that read them whole, and a bad entry only makes a position reject.
template <bool CheckedEntries = true, class G, class TargetAt, class DraftAt>
[[nodiscard]] std::size_t accept_drafts_with(std::span<const token_id> draft_tokens,
                                             TargetAt&& p_at, DraftAt&& q_at, G& g,
                                             double lenience) {
  const std::size_t gamma = draft_tokens.size();
  for (std::size_t i = 0; i < gamma; ++i) {
    const auto x = static_cast<std::size_t>(draft_tokens[i]);
    const double p = p_at(i, x);
    const double q = q_at(i, x);
    if constexpr (CheckedEntries) SPECDEC_ASSERT(p >= 0.0 && q >= 0.0);
    const double u = uniform01<double>(g);
    if (!(u * (lenience * q) < p)) return i;  // reject x_{i+1}
  }
  return gamma;
}

/// The decisions for one-hot drafts: x_i is accepted iff u * l < p_i(x_i).
template <bool CheckedEntries = true, class G, class TargetAt>
[[nodiscard]] std::size_t accept_proposals_with(std::span<const token_id> draft_tokens,
                                                TargetAt&& p_at, G& g, double lenience) {
  const std::size_t gamma = draft_tokens.size();
  for (std::size_t i = 0; i < gamma; ++i) {
    const double p = p_at(i, static_cast<std::size_t>(draft_tokens[i]));
    if constexpr (CheckedEntries) SPECDEC_ASSERT(p >= 0.0);
    const double u = uniform01<double>(g);
    if (!(u * lenience < p)) return i;
  }
  return gamma;
}

/// accept_drafts_with over dense rows, q_i(x) = draft_rows(i, x) * scales[i] (the decoder
/// keeps its draft rows at T = 1 unnormalised and their normalisers as scalars). `draft_rows`
/// is a RowsView or any (i, x) accessor (the decoder's rows may each live elsewhere).
template <bool CheckedEntries = true, class T, class DraftRows, class G, class Scales>
[[nodiscard]] std::size_t accept_drafts(std::span<const token_id> draft_tokens,
                                        const DraftRows& draft_rows, const Scales& scales,
                                        RowsView<const T> target_rows, G& g, double lenience) {
  return accept_drafts_with<CheckedEntries>(
      draft_tokens,
      [&](std::size_t i, std::size_t x) {
        SPECDEC_ASSERT(x < target_rows.cols());
        return static_cast<double>(target_rows(i, x));
      },
      [&](std::size_t i, std::size_t x) {
        return static_cast<double>(draft_rows(i, x)) * scales[i];
      },
      g, lenience);
}

/// accept_proposals_with over dense rows.
template <bool CheckedEntries = true, class T, class G>
[[nodiscard]] std::size_t accept_proposals(std::span<const token_id> draft_tokens,
                                           RowsView<const T> target_rows, G& g, double lenience) {
  return accept_proposals_with<CheckedEntries>(
      draft_tokens,
      [&](std::size_t i, std::size_t x) {
        SPECDEC_ASSERT(x < target_rows.cols());
        return static_cast<double>(target_rows(i, x));
      },
      g, lenience);
}

/// The bonus token after accepting every draft: t ~ p_{gamma+1}.
/// The checks of a checked verifier's inputs, in the catalogue's order: draft/target width,
/// target rows (count, then each row), draft rows, draft tokens. `step` labels messages.
template <class T>
void validate_step_inputs(std::span<const token_id> draft_tokens, RowsView<const T> draft_rows,
                          RowsView<const T> target_rows, std::size_t step) {
  const std::size_t vocab_size = target_rows.cols();
  if (draft_rows.cols() != vocab_size && draft_rows.rows() != 0) {
    throw_error(errc::vocab_mismatch, "draft rows have ", draft_rows.cols(),
                " entries but target rows have ", vocab_size);
  }
  const std::size_t gamma = draft_tokens.size();
  validate_probability_rows(target_rows, gamma + 1, vocab_size, {"target", step});
  validate_probability_rows(draft_rows, gamma, vocab_size, {"draft", step});
  validate_tokens(draft_tokens, vocab_size, {"draft", step});
}

/// validate_step_inputs for proposals (no draft rows).
template <class T>
void validate_step_inputs(std::span<const token_id> draft_tokens, RowsView<const T> target_rows,
                          std::size_t step) {
  const std::size_t vocab_size = target_rows.cols();
  validate_probability_rows(target_rows, draft_tokens.size() + 1, vocab_size, {"target", step});
  validate_tokens(draft_tokens, vocab_size, {"draft", step});
}

template <class T, class G>
VerificationResult bonus_step(std::size_t gamma, RowsView<const T> target_rows, G& g) {
  VerificationResult result;
  result.accepted = gamma;
  result.token = sample_from_row(std::span<const T>(target_rows.row(gamma)), g);
  result.source = token_source::bonus;
  return result;
}

}  // namespace detail

/// Algorithm 1's verification step (unchecked, lazy fast path).
///
/// `draft_rows` holds q_1..q_gamma (gamma = draft_tokens.size()), `target_rows` holds
/// p_1..p_{gamma+1}, all of width V; draft token x_i must have been sampled from q_i (this is
/// what makes the result exact; the decoder samples drafts itself to guarantee it).
/// Returns n (accepted), t and its source (correction or bonus); `residual_fallback` is set
/// when the residual had zero mass (see residual_distribution.hpp).
///
/// Preconditions (the checked twin verify_speculative_checked validates all of them; debug
/// builds assert the shapes, the token ids and the entries actually read): draft_rows has
/// gamma rows and target_rows gamma+1 rows of the same width V > 0; 0 <= x_i < V; rows are
/// finite, non-negative and normalised; 0 < lenience <= 1.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_speculative(std::span<const token_id> draft_tokens,
                                      RowsView<const T> draft_rows, RowsView<const T> target_rows,
                                      G& g, const SpeculativeSamplingOptions& options = {}) {
  const std::size_t gamma = draft_tokens.size();
  detail::assert_step_shapes(gamma, target_rows, options);
  SPECDEC_ASSERT(draft_rows.rows() == gamma);
  SPECDEC_ASSERT(gamma == 0 || draft_rows.cols() == target_rows.cols());  // no rows: any width
  const std::size_t n = detail::accept_drafts(draft_tokens, draft_rows, detail::unit_scales{},
                                              target_rows, g, options.lenience);
  if (n < gamma) {  // x_{n+1} rejected: draw the correction at position n+1
    const ResidualDraw draw =
        sample_residual(std::span<const T>(target_rows.row(n)),
                        std::span<const T>(draft_rows.row(n)), g, options.lenience);
    return {n, draw.token, token_source::correction, draw.fallback};
  }
  return detail::bonus_step(gamma, target_rows, g);
}

/// Algorithm 1 for proposal-only drafts (n-gram, prompt lookup): q_i is one-hot on x_i, so
/// x_i is accepted with probability min(1, p_i(x_i) / l) and the residual after a rejection
/// is p_{n+1} with x_{n+1} removed (weight max(0, p(x) - l) in general). Exact for l = 1,
/// whatever proposed the tokens. Preconditions as for verify_speculative (no draft rows).
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_speculative_proposals(std::span<const token_id> draft_tokens,
                                                RowsView<const T> target_rows, G& g,
                                                const SpeculativeSamplingOptions& options = {}) {
  const std::size_t gamma = draft_tokens.size();
  detail::assert_step_shapes(gamma, target_rows, options);
  const std::size_t n = detail::accept_proposals(draft_tokens, target_rows, g, options.lenience);
  if (n < gamma) {
    const ResidualDraw draw = sample_residual_one_hot(std::span<const T>(target_rows.row(n)),
                                                      draft_tokens[n], g, options.lenience);
    return {n, draw.token, token_source::correction, draw.fallback};
  }
  return detail::bonus_step(gamma, target_rows, g);
}

/// verify_speculative for any probability matrices (row-major Eigen matrices, RowsView of
/// non-const data, ...): views them as RowsView<const T> and forwards.
template <ProbabilityMatrix DraftRows, ProbabilityMatrix TargetRows,
          std::uniform_random_bit_generator G>
requires std::is_same_v<typename decltype(as_rows(std::declval<const DraftRows&>()))::value_type,
                        typename decltype(as_rows(std::declval<const TargetRows&>()))::value_type>
    VerificationResult verify_speculative(std::span<const token_id> draft_tokens,
                                          const DraftRows& draft_rows,
                                          const TargetRows& target_rows, G& g,
                                          const SpeculativeSamplingOptions& options = {}) {
  return verify_speculative(draft_tokens, as_rows(draft_rows), as_rows(target_rows), g, options);
}

/// verify_speculative_proposals for any probability matrix.
template <ProbabilityMatrix TargetRows, std::uniform_random_bit_generator G>
VerificationResult verify_speculative_proposals(std::span<const token_id> draft_tokens,
                                                const TargetRows& target_rows, G& g,
                                                const SpeculativeSamplingOptions& options = {}) {
  return verify_speculative_proposals(draft_tokens, as_rows(target_rows), g, options);
}

/// Validates all inputs of a stochastic step, then runs verify_speculative. Throws
/// `specdec::error` (naming the model, step, row and token): errc::domain for a lenience
/// outside (0, 1]; errc::invalid_size for a wrong number of rows or V = 0;
/// errc::vocab_mismatch if draft and target rows differ in width; errc::invalid_token for a
/// draft token outside [0, V); and every row error of validate_probability_row. V is the
/// width of the target rows. `step` only labels messages.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_speculative_checked(std::span<const token_id> draft_tokens,
                                              RowsView<const T> draft_rows,
                                              RowsView<const T> target_rows, G& g,
                                              const SpeculativeSamplingOptions& options = {},
                                              std::size_t step = RowLocation::npos) {
  validate_lenience(options.lenience);
  detail::validate_step_inputs(draft_tokens, draft_rows, target_rows, step);
  return verify_speculative(draft_tokens, draft_rows, target_rows, g, options);
}

/// Validates all inputs of a proposal-only step (as verify_speculative_checked, without
/// draft rows), then runs verify_speculative_proposals.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_speculative_proposals_checked(
    std::span<const token_id> draft_tokens, RowsView<const T> target_rows, G& g,
    const SpeculativeSamplingOptions& options = {}, std::size_t step = RowLocation::npos) {
  validate_lenience(options.lenience);
  detail::validate_step_inputs(draft_tokens, target_rows, step);
  return verify_speculative_proposals(draft_tokens, target_rows, g, options);
}

/// Checked twin of the generic verify_speculative overload.
template <ProbabilityMatrix DraftRows, ProbabilityMatrix TargetRows,
          std::uniform_random_bit_generator G>
requires std::is_same_v<typename decltype(as_rows(std::declval<const DraftRows&>()))::value_type,
                        typename decltype(as_rows(std::declval<const TargetRows&>()))::value_type>
    VerificationResult verify_speculative_checked(std::span<const token_id> draft_tokens,
                                                  const DraftRows& draft_rows,
                                                  const TargetRows& target_rows, G& g,
                                                  const SpeculativeSamplingOptions& options = {},
                                                  std::size_t step = RowLocation::npos) {
  return verify_speculative_checked(draft_tokens, as_rows(draft_rows), as_rows(target_rows), g,
                                    options, step);
}

/// Checked twin of the generic verify_speculative_proposals overload.
template <ProbabilityMatrix TargetRows, std::uniform_random_bit_generator G>
VerificationResult verify_speculative_proposals_checked(
    std::span<const token_id> draft_tokens, const TargetRows& target_rows, G& g,
    const SpeculativeSamplingOptions& options = {}, std::size_t step = RowLocation::npos) {
  return verify_speculative_proposals_checked(draft_tokens, as_rows(target_rows), g, options, step);
}

}  // namespace specdec
