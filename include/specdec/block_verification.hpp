// specdec — block verification (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh,
// "Block Verification Accelerates Speculative Decoding", ICLR 2025): a verification step
// that decides on the drafted block as a whole instead of on each draft alone. Its output
// has exactly the target's law, like Algorithm 1 (speculative_sampling.hpp), and it never
// accepts fewer drafts in expectation; among verifiers that see the drafted block it accepts
// the most. The paper's example (p = (1/3, 2/3), q = (2/3, 1/3), gamma 2) accepts 10/9
// drafts per step with Algorithm 1 and 11/9 with block verification
// (analysis.hpp, expected_accepted_drafts). With a one-hot q (proposals) and for greedy
// decoding the expectation is Algorithm 1's.
//
// The rule, with drafts x_1..x_gamma, draft rows q_1..q_gamma and target rows
// p_1..p_{gamma+1}:
//  - prefix ratios: rho_0 = 1, rho_i = min(1, rho_{i-1} p_i(x_i) / q_i(x_i)), with the token
//    rule's conventions: p_i(x_i) = 0 gives 0; q_i(x_i) = 0 < p_i(x_i) gives 1;
//  - acceptance weights: h_gamma = rho_gamma; for 0 < i < gamma,
//    h_i = Z_{i+1} / (Z_{i+1} + 1 - rho_i) with Z_{i+1} = sum_x max(0, rho_i p_{i+1}(x) -
//    q_{i+1}(x)) (1 where the denominator is 0); h_0 = 1;
//  - n = the largest i with u_i < h_i: the scan starts at i = gamma and stops at the first
//    success, one uniform per examined position;
//  - t ~ p_{gamma+1} if n = gamma, else t ~ norm(max(0, rho_n p_{n+1} - q_{n+1})) (the
//    documented fallback of residual_distribution.hpp: p_{n+1} when that mass is 0).
// Verified by enumeration (tests/block_verification_test.cpp) on the real code: every
// acceptance threshold and every breakpoint of the final draw is found by bisection over the
// 53-bit uniforms, so the law enumerated is the implementation's own.
//
// Lazy: rho needs only the drafted entries p_i(x_i), q_i(x_i), and none after rho reaches 0
// (a draft p rules out): from there on h_i = 0, so those positions read no row. Position
// i < gamma with rho_i > 0 reads its row pair p_{i+1}, q_{i+1} once, in one pass that builds the
// mass table of max(0, rho_i p_{i+1} - q_{i+1}): its total is Z_{i+1}, and if the scan stops at i
// the residual draw walks the same table (one superblock). Row pairs below n are never read whole:
// the step reads at most gamma - n row pairs (n < gamma), or p_{gamma+1} for the bonus. Position
// i's uniform is drawn before its pair is read: h_i <= Z_max / (Z_max + 1 - rho_i) with Z_max =
// rho_i - min(rho_i p_{i+1}(x_{i+1}), q_{i+1}(x_{i+1})) (plus the rows' mass tolerance), so a
// uniform at or above that rejects i unread (detail::block_weight_bound): where rho_i is small,
// most positions the scan passes read nothing.
//
// Random numbers: one uniform01<double>(g) per examined position (gamma - n + 1 of them when
// n > 0, gamma when n = 0), then one for the final draw. Allocation-free for gamma <= 256
// (longer drafts keep their ratios in a vector allocated per call).
//
// Rounding: rho and h are computed in double; the residual's weights in the rows' type T
// (rho_i rounded to T), so for float rows Z and the residual carry float rounding, as every
// draw from float rows does (see mass_table in detail/row_kernels.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

namespace detail {

/// The rule block verification runs: `exact`, or a broken variant that the tests must catch
/// (never used by the library).
enum class block_rule : std::uint8_t {
  exact,
  residual_without_rho,  ///< the residual max(0, p - q) whatever rho_n is
  h_without_z,           ///< h_i = rho_i (the weight ignores the residual mass Z)
  uncapped_rho,          ///< rho_i = rho_{i-1} p / q, not capped at 1
};

/// rho_i from rho_{i-1} and the drafted entries p_i(x_i), q_i(x_i).
template <block_rule Rule = block_rule::exact>
[[nodiscard]] inline double next_prefix_ratio(double rho, double p, double q) noexcept {
  if (!(rho > 0.0) || !(p > 0.0)) return 0.0;
  if (!(q > 0.0)) return 1.0;  // q(x) = 0 < p(x): the ratio is +inf, as in Algorithm 1
  const double ratio = rho * p / q;
  if constexpr (Rule == block_rule::uncapped_rho) return ratio;
  return ratio < 1.0 ? ratio : 1.0;
}

/// h_i = Z / (Z + 1 - rho) (1 where the denominator is 0).
[[nodiscard]] inline double block_weight(double z, double rho) noexcept {
  const double denominator = z + (1.0 - rho);
  return denominator > 0.0 ? z / denominator : 1.0;
}

/// An upper bound of h_i before its row pair is read, from the drafted entries p(x), q(x)
/// of row pair i + 1 alone: Z = rho sum_x p(x) - sum_x min(rho p(x), q(x)) <= rho (1 + slack)
/// - min(rho p(x_i), q(x_i)) for a row whose mass is within the validator's tolerance of 1
/// (`slack` adds that tolerance and the mass table's rounding), and h = Z / (Z + 1 - rho)
/// grows with Z. A uniform at or above it rejects position i whatever Z is, so the scan
/// skips the pair: the same decisions and the same random numbers as reading it.
template <class T>
[[nodiscard]] inline double block_weight_bound(double rho, double p_x, double q_x) noexcept {
  constexpr double slack = default_sum_tolerance<T> + 1e-5;
  const double z = rho * (1.0 + slack) - std::min(rho * p_x, q_x);
  return block_weight(z > 0.0 ? z : 0.0, rho);
}

/// The prefix ratios rho_0..rho_gamma of one step: on the stack for gamma <= 256.
class prefix_ratios {
 public:
  explicit prefix_ratios(std::size_t gamma) : gamma_(gamma) {
    if (gamma + 1 > inline_size) heap_.resize(gamma + 1);
  }
  double& operator[](std::size_t i) noexcept {
    return gamma_ + 1 > inline_size ? heap_[i] : inline_[i];
  }

 private:
  static constexpr std::size_t inline_size = 257;
  std::size_t gamma_;
  std::array<double, inline_size> inline_;
  std::vector<double> heap_;
};

/// Block verification with q_i given by the draft rows (`one_hot` false) or one-hot on x_i
/// (proposals). p_at(i, x) / q_at(i, x): the drafted entries; rows: whole rows for Z and
/// the draws.
template <block_rule Rule, bool one_hot, class T, class G>
VerificationResult verify_block_rows(std::span<const token_id> draft_tokens,
                                     RowsView<const T> draft_rows, RowsView<const T> target_rows,
                                     G& g) {
  const std::size_t gamma = draft_tokens.size();
  const std::size_t vocab_size = target_rows.cols();
  prefix_ratios rho(gamma);
  rho[0] = 1.0;
  for (std::size_t i = 1; i <= gamma; ++i) {
    if (rho[i - 1] == 0.0) {  // stays 0: rows from here on are not read
      rho[i] = 0.0;
      continue;
    }
    const auto x = static_cast<std::size_t>(draft_tokens[i - 1]);
    const double p = static_cast<double>(target_rows(i - 1, x));
    const double q = one_hot ? 1.0 : static_cast<double>(draft_rows(i - 1, x));
    rho[i] = next_prefix_ratio<Rule>(rho[i - 1], p, q);
  }
  if (gamma > 0 && uniform01<double>(g) < rho[gamma]) {  // h_gamma = rho_gamma
    return {gamma, sample_from_row(std::span<const T>(target_rows.row(gamma)), g),
            token_source::bonus, false};
  }
  // Positions i = gamma - 1 .. 1, then 0 (h_0 = 1): the first success is n.
  for (std::size_t i = gamma; i-- > 0;) {
    if (i > 0 && rho[i] == 0.0) {  // Z = 0, so h_i = 0: the row pair is not read
      (void)uniform01<double>(g);
      continue;
    }
    const std::span<const T> p(target_rows.row(i));
    const auto x = static_cast<std::size_t>(draft_tokens[i]);
    const double scale = Rule == block_rule::residual_without_rho ? 1.0 : rho[i];
    if constexpr (one_hot) {
      // max(0, s p - e_x) is s p without x (s p(x) <= 1): Z = s (1 - p(x)) for a row of
      // mass 1, and the residual is p without x.
      if (i > 0) {
        const double z = scale * (1.0 - static_cast<double>(p[x]));
        const double h = Rule == block_rule::h_without_z ? rho[i] : block_weight(z, rho[i]);
        if (!(uniform01<double>(g) < h)) continue;
      }
      const ResidualDraw draw = sample_residual_one_hot(p, draft_tokens[i], g);
      return {i, draw.token, token_source::correction, draw.fallback};
    } else {
      const std::span<const T> q(draft_rows.row(i));
      // The decision's uniform first: where it reaches the bound on h_i, no Z can accept, and
      // the pair is not read.
      const double decision = i > 0 ? uniform01<double>(g) : 0.0;
      if constexpr (Rule == block_rule::exact) {
        if (i > 0 && !(decision < block_weight_bound<T>(rho[i], static_cast<double>(p[x]),
                                                        static_cast<double>(q[x])))) {
          continue;
        }
      }
      // One pass builds the mass table of max(0, rho_i p - q): its total is Z, and a stop
      // at i draws from it. rho_i = 1 (drafts the target favours) takes Algorithm 1's
      // residual kernel, without the scaling.
      const auto at = [&](const auto& source) -> std::pair<bool, VerificationResult> {
        mass_table table;
        build_mass_table(source, table);
        if (i > 0) {
          const double h =
              Rule == block_rule::h_without_z ? rho[i] : block_weight(table.total, rho[i]);
          if (!(decision < h)) return {false, {}};
        }
        const double u = uniform01<double>(g);
        const std::size_t index = table.drawable() ? draw_from_table(source, table, u) : no_index;
        if (index != no_index) {
          return {true, {i, static_cast<token_id>(index), token_source::correction, false}};
        }
        return {true, {i, draw_from_target(p, u), token_source::correction, true}};  // zero mass
      };
      const auto [stop, result] = scale == 1.0
                                      ? at(difference_source<T>{p.data(), q.data(), vocab_size})
                                      : at(scaled_target_difference_source<T>{
                                            p.data(), q.data(), vocab_size, static_cast<T>(scale)});
      if (stop) return result;
    }
  }
  // gamma = 0: the bonus token from p_1.
  return {0, sample_from_row(std::span<const T>(target_rows.row(0)), g), token_source::bonus,
          false};
}

}  // namespace detail

/// Block verification of a drafted block (unchecked, lazy fast path): same inputs,
/// preconditions and result as verify_speculative (lenience 1): `draft_rows` holds
/// q_1..q_gamma, `target_rows` p_1..p_{gamma+1}, draft token x_i was sampled from q_i.
/// Returns n, t and its source; `residual_fallback` is set when the residual at n + 1 had
/// zero mass.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_block(std::span<const token_id> draft_tokens,
                                RowsView<const T> draft_rows, RowsView<const T> target_rows, G& g) {
  SPECDEC_ASSERT(target_rows.rows() == draft_tokens.size() + 1 && target_rows.cols() > 0);
  SPECDEC_ASSERT(draft_rows.rows() == draft_tokens.size());
  SPECDEC_ASSERT(draft_tokens.empty() || draft_rows.cols() == target_rows.cols());
  return detail::verify_block_rows<detail::block_rule::exact, false>(draft_tokens, draft_rows,
                                                                     target_rows, g);
}

/// Block verification of proposals (q_i one-hot on x_i: n-gram, prompt lookup). Its
/// expected number of accepted drafts equals Algorithm 1's (verify_speculative_proposals);
/// the output law is the target's either way. Preconditions as verify_speculative_proposals
/// (lenience 1).
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_block_proposals(std::span<const token_id> draft_tokens,
                                          RowsView<const T> target_rows, G& g) {
  SPECDEC_ASSERT(target_rows.rows() == draft_tokens.size() + 1 && target_rows.cols() > 0);
  return detail::verify_block_rows<detail::block_rule::exact, true>(
      draft_tokens, RowsView<const T>(), target_rows, g);
}

/// verify_block for any probability matrices (row-major Eigen matrices, RowsView of
/// non-const data, ...).
template <ProbabilityMatrix DraftRows, ProbabilityMatrix TargetRows,
          std::uniform_random_bit_generator G>
requires std::is_same_v<typename decltype(as_rows(std::declval<const DraftRows&>()))::value_type,
                        typename decltype(as_rows(std::declval<const TargetRows&>()))::value_type>
    VerificationResult verify_block(std::span<const token_id> draft_tokens,
                                    const DraftRows& draft_rows, const TargetRows& target_rows,
                                    G& g) {
  return verify_block(draft_tokens, as_rows(draft_rows), as_rows(target_rows), g);
}

/// verify_block_proposals for any probability matrix.
template <ProbabilityMatrix TargetRows, std::uniform_random_bit_generator G>
VerificationResult verify_block_proposals(std::span<const token_id> draft_tokens,
                                          const TargetRows& target_rows, G& g) {
  return verify_block_proposals(draft_tokens, as_rows(target_rows), g);
}

/// Validates all inputs (as verify_speculative_checked: errc::invalid_size for a wrong
/// number of rows or V = 0, errc::vocab_mismatch for rows of different widths,
/// errc::invalid_token for a draft token outside [0, V), every row error of
/// validate_probability_row), then runs verify_block. `step` only labels messages.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_block_checked(std::span<const token_id> draft_tokens,
                                        RowsView<const T> draft_rows, RowsView<const T> target_rows,
                                        G& g, std::size_t step = RowLocation::npos) {
  detail::validate_step_inputs(draft_tokens, draft_rows, target_rows, step);
  return verify_block(draft_tokens, draft_rows, target_rows, g);
}

/// Validates all inputs of a proposal step (as verify_block_checked, without draft rows),
/// then runs verify_block_proposals.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
VerificationResult verify_block_proposals_checked(std::span<const token_id> draft_tokens,
                                                  RowsView<const T> target_rows, G& g,
                                                  std::size_t step = RowLocation::npos) {
  detail::validate_step_inputs(draft_tokens, target_rows, step);
  return verify_block_proposals(draft_tokens, target_rows, g);
}

/// Checked twin of the generic verify_block overload.
template <ProbabilityMatrix DraftRows, ProbabilityMatrix TargetRows,
          std::uniform_random_bit_generator G>
requires std::is_same_v<typename decltype(as_rows(std::declval<const DraftRows&>()))::value_type,
                        typename decltype(as_rows(std::declval<const TargetRows&>()))::value_type>
    VerificationResult verify_block_checked(std::span<const token_id> draft_tokens,
                                            const DraftRows& draft_rows,
                                            const TargetRows& target_rows, G& g,
                                            std::size_t step = RowLocation::npos) {
  return verify_block_checked(draft_tokens, as_rows(draft_rows), as_rows(target_rows), g, step);
}

/// Checked twin of the generic verify_block_proposals overload.
template <ProbabilityMatrix TargetRows, std::uniform_random_bit_generator G>
VerificationResult verify_block_proposals_checked(std::span<const token_id> draft_tokens,
                                                  const TargetRows& target_rows, G& g,
                                                  std::size_t step = RowLocation::npos) {
  return verify_block_proposals_checked(draft_tokens, as_rows(target_rows), g, step);
}

}  // namespace specdec
