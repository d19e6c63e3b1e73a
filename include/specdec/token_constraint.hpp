// specdec — the TokenConstraint concept: a position-dependent set of allowed tokens (a
// grammar, a regular expression over token strings, a JSON shape) with checkpoint and
// rollback, and the token bitmask it fills.
//
// A constraint is a state machine over token ids. In a state it names the tokens allowed
// next (a bitmask over the vocabulary); `advance(t)` moves it by one allowed token;
// `state()` / `restore(s)` save and restore it. The constrained law of the next token after
// a prefix is the model's row with the forbidden tokens set to zero, renormalised, where
// the constraint's state is the one reached from its start by the prefix's generated
// tokens. constrained_model.hpp walks one constraint along every prefix the decoder asks
// its models about (the draft, the target's checks, a tree's branches) and restores it
// after a rejection, so the target and the draft are masked alike at every position.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "specdec/concepts.hpp"

namespace specdec {

/// Number of 64-bit words of a token bitmask over `vocab_size` tokens.
[[nodiscard]] constexpr std::size_t mask_words(std::size_t vocab_size) noexcept {
  return (vocab_size + 63) / 64;
}

/// Whether token `t` is set in a token bitmask (bit t % 64 of word t / 64).
[[nodiscard]] constexpr bool mask_test(std::span<const std::uint64_t> words, token_id t) noexcept {
  const auto index = static_cast<std::size_t>(t);
  return ((words[index / 64] >> (index % 64)) & 1U) != 0;
}

/// Sets token `t` in a token bitmask.
constexpr void mask_set(std::span<std::uint64_t> words, token_id t) noexcept {
  const auto index = static_cast<std::size_t>(t);
  words[index / 64] |= std::uint64_t{1} << (index % 64);
}

/// Clears token `t` in a token bitmask.
constexpr void mask_clear(std::span<std::uint64_t> words, token_id t) noexcept {
  const auto index = static_cast<std::size_t>(t);
  words[index / 64] &= ~(std::uint64_t{1} << (index % 64));
}

/// A position-dependent token constraint with checkpoint and rollback:
///  - `typename C::state_type`: a copyable snapshot of the constraint's state;
///  - `c.state()`: the current state (checkpoint);
///  - `c.restore(s)`: go back to a state `state()` returned (rollback, or another branch
///    of a token tree);
///  - `c.advance(t)`: move by one token; returns false, leaving the state unchanged, when
///    `t` is not allowed in the current state;
///  - `c.allowed_tokens(words)`: write the bitmask of the tokens allowed in the current
///    state into `words` (mask_words(vocab_size) words, bit t % 64 of word t / 64; bits past
///    the vocabulary are ignored). A state that allows no token is a dead end.
/// `allowed_tokens` and `advance` must depend on the state only (the same state gives the
/// same mask), which is what makes the target and the draft see the same transform.
/// For a constraint that never allocates (e.g. TokenDfa), a decoder step allocates
/// nothing once warm.
/// @code
/// struct EvenTokensOnly {  // allows even ids, forever
///   using state_type = int;
///   int state() const { return 0; }
///   void restore(int) {}
///   bool advance(specdec::token_id t) { return t % 2 == 0; }
///   void allowed_tokens(std::span<std::uint64_t> words) const {
///     for (auto& w : words) w = 0x5555555555555555ULL;
///   }
/// };
/// static_assert(specdec::TokenConstraint<EvenTokensOnly>);
/// @endcode
// clang-format off
template <class C>
concept TokenConstraint = requires(C& c, const C& cc, const typename C::state_type& s,
                                   token_id t, std::span<std::uint64_t> words) {
  requires std::copyable<typename C::state_type>;
  { cc.state() } -> std::convertible_to<typename C::state_type>;
  c.restore(s);
  { c.advance(t) } -> std::same_as<bool>;
  cc.allowed_tokens(words);
};
// clang-format on

/// The constraint that allows every token (logit bias and banned tokens alone).
struct Unconstrained {
  using state_type = unsigned char;
  [[nodiscard]] state_type state() const noexcept { return 0; }
  void restore(state_type /*state*/) noexcept {}
  [[nodiscard]] bool advance(token_id /*token*/) noexcept { return true; }
  void allowed_tokens(std::span<std::uint64_t> words) const noexcept {
    for (auto& word : words) word = ~std::uint64_t{0};
  }
};

}  // namespace specdec
