// specdec — when generation ends: stop tokens, stop sequences and a token budget, and the
// emission stage that appends a step's tokens one at a time up to the first of them.
//
// Shared by SpeculativeDecoder (chain and tree steps) and BatchDecoder (each sequence), so
// that a step's tokens are cut the same way everywhere: after a stop token (which is
// emitted), after the token that completes a stop sequence (matched on the generated tokens
// only, never on the prompt), or when the budget is used up. A drafted stop token also ends
// that step's drafting (is_stop_token), since nothing after it can be emitted.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/error.hpp"

namespace specdec {

/// Why generation (or a step) ended.
enum class stop_reason : std::uint8_t {
  none,            ///< a step that did not end generation
  max_new_tokens,  ///< the token budget is used up exactly
  stop_token,      ///< a stop token was emitted (it is the last token)
  stop_sequence,   ///< a stop sequence was completed (its tokens are the last tokens)
};

/// "none", "max_new_tokens", "stop_token" or "stop_sequence".
[[nodiscard]] constexpr std::string_view to_string(stop_reason reason) noexcept {
  switch (reason) {
    case stop_reason::none:
      return "none";
    case stop_reason::max_new_tokens:
      return "max_new_tokens";
    case stop_reason::stop_token:
      return "stop_token";
    case stop_reason::stop_sequence:
      return "stop_sequence";
  }
  return "unknown";
}

/// A sequence's stop tokens and stop sequences, checked once against the vocabulary.
class StopConditions {
 public:
  StopConditions() = default;

  /// Throws specdec::error (errc::invalid_option), `where` first in the message (e.g.
  /// "decoder option " or "sequence 7: "), for a stop token or stop-sequence token outside
  /// [0, vocab) or an empty stop sequence; keeps the previous conditions then.
  void assign(std::span<const token_id> tokens, std::span<const std::vector<token_id>> sequences,
              std::size_t vocab, std::string_view where) {
    for (const token_id token : tokens) {
      if (token < 0 || static_cast<std::size_t>(token) >= vocab) {
        detail::throw_error(errc::invalid_option, where, "stop_tokens: token ", token,
                            " is outside [0, ", vocab, ")");
      }
    }
    for (std::size_t s = 0; s < sequences.size(); ++s) {
      if (sequences[s].empty()) {
        detail::throw_error(errc::invalid_option, where, "stop_sequences[", s, "] is empty");
      }
      for (const token_id token : sequences[s]) {
        if (token < 0 || static_cast<std::size_t>(token) >= vocab) {
          detail::throw_error(errc::invalid_option, where, "stop_sequences[", s, "]: token ", token,
                              " is outside [0, ", vocab, ")");
        }
      }
    }
    tokens_.assign(tokens.begin(), tokens.end());
    std::sort(tokens_.begin(), tokens_.end());
    sequences_.assign(sequences.begin(), sequences.end());
  }

  [[nodiscard]] bool empty() const noexcept { return tokens_.empty() && sequences_.empty(); }

  /// Whether `token` is a stop token.
  [[nodiscard]] bool is_stop_token(token_id token) const noexcept {
    return std::binary_search(tokens_.begin(), tokens_.end(), token);
  }

  /// Whether `generated` (the tokens stop sequences may match) ends with a stop sequence.
  [[nodiscard]] bool ends_with_stop_sequence(std::span<const token_id> generated) const noexcept {
    for (const auto& stop : sequences_) {
      if (stop.size() <= generated.size() &&
          std::equal(stop.begin(), stop.end(),
                     generated.end() - static_cast<std::ptrdiff_t>(stop.size()))) {
        return true;
      }
    }
    return false;
  }

  /// How much of a step's tokens is emitted.
  struct Cut {
    std::size_t taken = 0;                   ///< tokens appended
    stop_reason reason = stop_reason::none;  ///< what ended generation, if anything
  };

  /// The emission stage: appends `tokens` to `sequence` one at a time and stops after the
  /// first one that is a stop token, completes a stop sequence (matched on
  /// sequence[floor..], the generated tokens) or is the `budget`-th. Never allocates once
  /// `sequence` has room.
  Cut emit(std::span<const token_id> tokens, std::vector<token_id>& sequence, std::size_t floor,
           std::size_t budget) const {
    Cut cut;
    while (cut.taken < tokens.size() && cut.taken < budget) {
      const token_id token = tokens[cut.taken++];
      sequence.push_back(token);
      if (is_stop_token(token)) {
        cut.reason = stop_reason::stop_token;
        return cut;
      }
      if (!sequences_.empty() &&
          ends_with_stop_sequence(std::span<const token_id>(sequence).subspan(floor))) {
        cut.reason = stop_reason::stop_sequence;
        return cut;
      }
    }
    if (cut.taken == budget) cut.reason = stop_reason::max_new_tokens;
    return cut;
  }

 private:
  std::vector<token_id> tokens_;  // sorted
  std::vector<std::vector<token_id>> sequences_;
};

}  // namespace specdec
