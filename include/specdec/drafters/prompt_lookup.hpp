// specdec — the prompt-lookup (copy) drafter: find the longest suffix of the context that
// occurred earlier and propose what followed it. Proposal-only (one-hot q, exact under both
// verifiers); strong wherever the output copies from the prompt (editing, summarising,
// code with repeated blocks).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/error.hpp"

namespace specdec {

/// Configuration of a PromptLookupDrafter.
struct PromptLookupOptions {
  /// Shortest suffix worth copying from (>= 1).
  std::size_t min_ngram = 1;
  /// Longest suffix compared (>= min_ngram); the search stops at the most recent match of
  /// this length.
  std::size_t max_ngram = 8;
  /// Only the last `window` tokens of the context are searched (>= 2).
  std::size_t window = 8192;
};

/// What the last `propose` call found.
struct PromptLookupMatch {
  std::size_t length = 0;       ///< length of the matched suffix (0: no match)
  std::size_t source = 0;       ///< context position of the first copied token
  std::size_t comparisons = 0;  ///< token comparisons spent (failure function + scan)
};

/// Prompt-lookup drafter.
///
/// **Match.** Among the last `window` tokens of the context, find the longest suffix of the
/// context, at most `max_ngram` tokens long, that also ends at an earlier position; among
/// equally long matches take the most recent earlier occurrence (recent text is the better
/// predictor). If the match is at least `min_ngram` long, propose the tokens that followed
/// it, as an overlapping copy: a proposal that runs past the end of the context continues
/// with the proposal's own tokens, exactly as if the copied text repeated (so a period-p
/// tail proposes its continuation, not a truncated draft).
///
/// **Linear time.** Reading the context backwards turns "suffix ending at an earlier
/// position" into "prefix of the reversed text starting at a later position", which is
/// Knuth–Morris–Pratt matching of the pattern P = reversed suffix (max_ngram tokens) against
/// the reversed window: at most 2 window + 2 max_ngram token comparisons, whatever the input
/// (a naive scan needs Theta(window * max_ngram), quadratic for a^n b a^n and large
/// max_ngram). The failure function is computed lazily, only as far as the match gets, and
/// the scan stops at the first (most recent) match of full length max_ngram. Memory: one
/// failure array of min(max_ngram, window) entries, grown on demand and then reused, so
/// steady-state propose() calls allocate nothing. No state is carried between calls: the
/// whole context is searched each time (rollbacks and new prompts need no care).
///
/// **Several proposals** (`propose_many`, a MultiProposalDrafter for token trees). Every
/// earlier position of the window is an occurrence whose match length is how many tokens
/// before it agree with the suffix (at most `max_ngram`); occurrences of at least
/// `min_ngram` tokens are ranked longest first, then most recent first, and the first B
/// whose continuations (L tokens, overlapping copies as above) differ are proposed, so the
/// first is `propose`'s. The match lengths come from one Z-function pass over the reversed
/// window, capped at max_ngram (at most 2 window token comparisons; only max_ngram values
/// are stored); telling continuations apart costs at most B L comparisons for an
/// occurrence that could enter the top B, and the scan stops once B occurrences of full
/// length max_ngram are held. Allocates only when B or max_ngram exceed every earlier
/// call's.
/// @code
/// specdec::PromptLookupDrafter lookup({.min_ngram = 2, .max_ngram = 6});
/// std::size_t drafted = lookup.propose(context, draft);
/// @endcode
class PromptLookupDrafter {
 public:
  /// Throws specdec::error (invalid_option) unless 1 <= min_ngram <= max_ngram and
  /// window >= 2.
  explicit PromptLookupDrafter(PromptLookupOptions options = {}) : options_(options) {
    if (options.min_ngram == 0 || options.max_ngram < options.min_ngram)
      detail::throw_error(errc::invalid_option,
                          "PromptLookupDrafter: need 1 <= min_ngram <= max_ngram, got min_ngram ",
                          options.min_ngram, ", max_ngram ", options.max_ngram);
    if (options.window < 2)
      detail::throw_error(errc::invalid_option, "PromptLookupDrafter: window must be >= 2, got ",
                          options.window);
  }

  /// Writes up to `out.size()` tokens copied from after the most recent longest earlier
  /// occurrence of the context's suffix; returns how many (0: no match of min_ngram tokens).
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) {
    last_ = PromptLookupMatch{};
    if (out.empty()) return 0;
    const std::size_t length = context.size();
    const auto [searched, pattern] = search_window(length);
    if (pattern == 0) return 0;
    // reversed[k] = context[length - 1 - k], k < searched. An earlier occurrence of the
    // suffix of length s ending at position j is reversed[i, i + s) == reversed[0, s) with
    // i = length - 1 - j >= 1; the token after it is context[length - i].
    const token_id* last = context.data() + (length - 1);
    const auto reversed = [last](std::size_t k) { return *(last - k); };
    failure_computed_ = 0;
    if (failure_.size() < pattern) failure_.resize(pattern);

    std::size_t comparisons = 0;
    std::size_t state = 0;  // longest prefix of P ending at the current text position
    std::size_t best = 0;
    std::size_t best_end = 0;
    for (std::size_t t = 1; t < searched; ++t) {
      const token_id current = reversed(t);
      while (state > 0) {
        ++comparisons;
        if (current == reversed(state)) break;
        state = failure(state - 1, reversed, comparisons);
      }
      if (state == 0) {
        ++comparisons;
        if (current != reversed(0)) continue;
      }
      ++state;
      if (state > best) {
        best = state;
        best_end = t;
        // A full-length match cannot be beaten; the first one found is the most recent.
        if (best == pattern) break;
      }
    }
    last_.comparisons = comparisons;
    if (best < options_.min_ngram) return 0;
    const std::size_t start = best_end + 1 - best;  // i of the most recent occurrence
    const std::size_t source = length - start;
    last_.length = best;
    last_.source = source;
    for (std::size_t k = 0; k < out.size(); ++k) {
      const std::size_t position = source + k;
      out[k] = position < length ? context[position] : out[position - length];
    }
    return out.size();
  }

  /// Writes up to B = `lengths.size()` continuations of L = `out.size() / B` tokens each
  /// (see the class comment): continuation b goes to out[b L, b L + lengths[b]) and
  /// lengths[b] = L. Returns how many (0: no match of min_ngram tokens, or L = 0). The
  /// continuations differ pairwise, best match first; the first equals what propose()
  /// writes into L tokens. last_match() describes the first continuation's occurrence and
  /// counts every comparison of the call.
  std::size_t propose_many(std::span<const token_id> context, std::span<token_id> out,
                           std::span<std::size_t> lengths) {
    last_ = PromptLookupMatch{};
    if (lengths.empty()) return 0;
    const std::size_t max_length = out.size() / lengths.size();
    if (max_length == 0) return 0;
    const std::size_t length = context.size();
    const auto [searched, pattern] = search_window(length);
    if (pattern == 0) return 0;
    const token_id* last = context.data() + (length - 1);  // reversed as in propose()
    const auto reversed = [last](std::size_t k) { return *(last - k); };
    const std::size_t wanted = lengths.size();
    if (z_.size() < pattern) z_.resize(pattern);
    if (kept_.size() < wanted) kept_.resize(wanted);
    // The continuation of the occurrence at i (reversed index, i.e. copying from context
    // position length - i) has period i: token k is context[length - i + k mod i].
    const auto continuation = [&](std::size_t i, std::size_t k) {
      return context[length - i + k % i];
    };

    std::size_t comparisons = 0;
    std::size_t held = 0;
    // Z-function of the reversed window capped at `pattern`: matched = the longest common
    // prefix of reversed[i, searched) and reversed[0, pattern). [box_begin, box_end) is the
    // rightmost window known to equal reversed[0, box_end - box_begin).
    std::size_t box_begin = 0;
    std::size_t box_end = 0;
    for (std::size_t i = 1; i < searched; ++i) {
      std::size_t matched = 0;
      if (i < box_end && z_[i - box_begin] < box_end - i) {
        matched = z_[i - box_begin];
      } else {
        matched = i < box_end ? box_end - i : 0;
        while (matched < pattern && i + matched < searched) {
          ++comparisons;
          if (reversed(i + matched) != reversed(matched)) break;
          ++matched;
        }
        if (i + matched > box_end) {
          box_begin = i;
          box_end = i + matched;
        }
      }
      if (i < pattern) z_[i] = matched;
      if (matched < options_.min_ngram) continue;
      // Occurrences arrive most recent first, so this one ranks below every held one of
      // the same length or longer.
      if (held == wanted && matched <= kept_[wanted - 1].length) continue;
      std::size_t same = held;
      for (std::size_t h = 0; h < held && same == held; ++h) {
        std::size_t k = 0;
        while (k < max_length) {
          ++comparisons;
          if (continuation(kept_[h].position, k) != continuation(i, k)) break;
          ++k;
        }
        if (k == max_length) same = h;
      }
      std::size_t at = 0;
      if (same < held) {
        if (matched <= kept_[same].length) continue;
        at = same;  // the same continuation from a longer match: move it up
      } else {
        at = held < wanted ? held++ : wanted - 1;
      }
      for (; at > 0 && kept_[at - 1].length < matched; --at) kept_[at] = kept_[at - 1];
      kept_[at] = Occurrence{matched, i};
      if (held == wanted && kept_[wanted - 1].length == pattern) break;  // none can enter
    }
    last_.comparisons = comparisons;
    if (held == 0) return 0;
    last_.length = kept_[0].length;
    last_.source = length - kept_[0].position;
    for (std::size_t b = 0; b < held; ++b) {
      const std::span<token_id> slot = out.subspan(b * max_length, max_length);
      for (std::size_t k = 0; k < max_length; ++k) slot[k] = continuation(kept_[b].position, k);
      lengths[b] = max_length;
    }
    return held;
  }

  [[nodiscard]] const PromptLookupOptions& options() const noexcept { return options_; }
  /// The match of the last propose() or propose_many() call and the token comparisons it
  /// spent.
  [[nodiscard]] const PromptLookupMatch& last_match() const noexcept { return last_; }

 private:
  /// How much of a context of `length` tokens is searched (its last `searched` tokens) and
  /// the longest suffix looked for in it (`pattern`); pattern = 0 when no match of
  /// min_ngram tokens fits (min_ngram >= 1, so 0 never is a real pattern length).
  struct SearchWindow {
    std::size_t searched = 0;
    std::size_t pattern = 0;
  };
  [[nodiscard]] SearchWindow search_window(std::size_t length) const noexcept {
    const std::size_t searched = std::min(length, options_.window);
    if (searched < 2) return {};
    const std::size_t pattern = std::min(options_.max_ngram, searched - 1);
    if (pattern < options_.min_ngram) return {};
    return {searched, pattern};
  }

  struct Occurrence {
    std::size_t length = 0;    // match length
    std::size_t position = 0;  // i: the occurrence ends at context position length - 1 - i
  };

  // failure_[q] = length of the longest proper border of P[0, q], computed on demand.
  template <class Reversed>
  std::size_t failure(std::size_t q, const Reversed& reversed, std::size_t& comparisons) {
    if (failure_computed_ == 0) {
      failure_[0] = 0;
      failure_computed_ = 1;
    }
    while (failure_computed_ <= q) {
      const std::size_t index = failure_computed_;
      std::size_t border = failure_[index - 1];
      for (;;) {
        ++comparisons;
        if (reversed(index) == reversed(border)) {
          ++border;
          break;
        }
        if (border == 0) break;
        border = failure_[border - 1];
      }
      failure_[index] = border;
      ++failure_computed_;
    }
    return failure_[q];
  }

  PromptLookupOptions options_;
  std::vector<std::size_t> failure_;
  std::size_t failure_computed_ = 0;
  std::vector<std::size_t> z_;    // propose_many(): capped Z values of indices < max_ngram
  std::vector<Occurrence> kept_;  // propose_many(): the best occurrences so far, ranked
  PromptLookupMatch last_;
};

static_assert(MultiProposalDrafter<PromptLookupDrafter>);

}  // namespace specdec
