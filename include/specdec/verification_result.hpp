// specdec — the outcome of one verification step (Algorithm 1 or exact-match greedy).
//
// A step emits n accepted draft tokens x_1..x_n followed by one token t from the target
// side: a *correction* drawn from the residual at position n+1 when x_{n+1} was rejected,
// or a *bonus* drawn from p_{gamma+1} when every draft was accepted (paper, Algorithm 1).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "specdec/concepts.hpp"

namespace specdec {

/// Where an emitted token came from.
enum class token_source : std::uint8_t {
  draft,       ///< an accepted draft token x_i (i <= n)
  correction,  ///< t after a rejection: drawn from the residual at position n+1
  bonus,       ///< t after accepting all gamma drafts: drawn from p_{gamma+1}
};

/// Which rule verifies model drafts: token by token, or whole paths.
enum class verification_rule : std::uint8_t {
  /// The default: the path-level rule where it applies (model drafts at T > 0, lenience 1:
  /// block verification for chains, traversal verification for sampled trees), else the
  /// token-level rule (proposals, top-k trees, greedy, lenience < 1).
  automatic,
  /// Token-level: Algorithm 1 (verify_speculative) for chains, recursive rejection
  /// (verify_tree) for trees; each draft decided alone.
  token,
  /// Path-level: block verification (block_verification.hpp) for chains, traversal
  /// verification (traversal_verification.hpp) for trees.
  block,
};

/// "automatic", "token" or "block".
[[nodiscard]] constexpr std::string_view to_string(verification_rule rule) noexcept {
  switch (rule) {
    case verification_rule::automatic:
      return "automatic";
    case verification_rule::token:
      return "token";
    case verification_rule::block:
      return "block";
  }
  return "unknown";
}

/// "draft", "correction" or "bonus".
[[nodiscard]] constexpr std::string_view to_string(token_source source) noexcept {
  switch (source) {
    case token_source::draft:
      return "draft";
    case token_source::correction:
      return "correction";
    case token_source::bonus:
      return "bonus";
  }
  return "unknown";
}

/// Result of verifying gamma draft tokens: the step emits `draft_tokens[0..accepted)`
/// followed by `token`.
struct VerificationResult {
  std::size_t accepted = 0;                   ///< n: accepted drafts, 0..gamma
  token_id token = 0;                         ///< t: the correction or bonus token
  token_source source = token_source::bonus;  ///< correction or bonus (never draft)
  /// The residual at position n+1 had zero or non-finite mass (possible only through
  /// rounding, or when p == q there), so t was drawn from p_{n+1} instead; see
  /// residual_distribution.hpp. Always false for greedy verification.
  bool residual_fallback = false;

  friend constexpr bool operator==(const VerificationResult&, const VerificationResult&) = default;
};

/// Result of verifying a draft tree: the step emits the path of `node` (its `accepted`
/// tokens, root excluded) followed by `token`.
struct TreeVerificationResult {
  std::size_t accepted = 0;  ///< n: accepted draft tokens, the depth of `node`
  std::size_t node = 0;      ///< last accepted node (0, the root, if none was accepted)
  token_id token = 0;        ///< t: correction (a node's children all rejected) or bonus
  token_source source = token_source::bonus;  ///< correction or bonus (never draft)
  /// Some node's residual had zero or non-finite mass, so t was drawn from that node's p.
  bool residual_fallback = false;

  friend constexpr bool operator==(const TreeVerificationResult&,
                                   const TreeVerificationResult&) = default;
};

}  // namespace specdec
