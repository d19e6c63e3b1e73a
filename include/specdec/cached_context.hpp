// specdec — CachedContext: turns "here is the whole accepted context" into KV-cache
// rollback calls for stateful models.
//
// The decoder always passes a model the whole context (prompt + accepted tokens, plus the
// drafts being scored). A model with a KV cache keeps a CachedContext next to its cache
// and calls `sync(context, *this)` at the top of next_token_probabilities / score_draft.
// sync compares the context with the tokens the cache holds, keeps their longest common
// prefix, and calls the model's hooks:
//   truncate(n)      drop cached positions >= n (only if something must go),
//   append(tokens)   evaluate `tokens` at positions kept, kept + 1, ... (only if non-empty).
// After a speculative step the cache of the target holds context + x_1..x_gamma; the next
// context is context + x_1..x_n + t, so exactly the gamma - n rejected drafts are dropped
// (one fewer when the correction t happens to equal x_{n+1}) and nothing accepted is
// evaluated twice.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"

namespace specdec {

/// `model.truncate(n)` and `model.append(tokens)`: the hooks CachedContext calls.
template <class M>
concept KvCacheHooks = requires(M& model, std::size_t n, std::span<const token_id> tokens) {
  model.truncate(n);
  model.append(tokens);
};

/// What one `CachedContext::sync` did.
struct CacheSync {
  std::size_t kept = 0;       ///< cached positions reused (the common prefix)
  std::size_t truncated = 0;  ///< cached positions dropped (rolled back)
  std::size_t appended = 0;   ///< positions evaluated by `append`
  friend constexpr bool operator==(const CacheSync&, const CacheSync&) = default;
};

/// The tokens a model's KV cache holds, and the logic that brings it in line with a new
/// context. No allocation once `reserve`d (or once the context stopped growing).
/// @code
/// struct KvModel {
///   specdec::CachedContext cache;
///   void truncate(std::size_t n);                          // forget positions >= n
///   void append(std::span<const specdec::token_id> new_tokens);  // run the network
///   std::size_t vocab_size() const;
///   std::span<const float> next_token_probabilities(std::span<const specdec::token_id> c) {
///     cache.sync(c, *this);
///     return output_at(c.size() - 1);                      // row of the last position
///   }
/// };
/// @endcode
class CachedContext {
 public:
  CachedContext() = default;

  /// Reserves room for `positions` cached tokens.
  void reserve(std::size_t positions) { tokens_.reserve(positions); }

  /// The tokens the cache holds, position 0 first.
  [[nodiscard]] std::span<const token_id> tokens() const noexcept { return tokens_; }
  [[nodiscard]] std::size_t size() const noexcept { return tokens_.size(); }

  /// Forgets everything without calling hooks (e.g. after the model reset its cache).
  void clear() noexcept {
    tokens_.clear();
    dirty_ = false;
  }

  /// Brings the cache in line with `context` through the model's truncate/append hooks.
  /// `min_appended` > 0 re-evaluates at least that many final positions even when they are
  /// cached (for models that keep outputs only for the positions of the latest append).
  /// If a hook throws, the cache is marked unknown beyond the kept prefix: the next sync
  /// truncates to that prefix before appending again.
  template <KvCacheHooks Model>
  CacheSync sync(std::span<const token_id> context, Model& model, std::size_t min_appended = 0) {
    return sync(
        context, [&model](std::size_t n) { model.truncate(n); },
        [&model](std::span<const token_id> tokens) { model.append(tokens); }, min_appended);
  }

  /// As above with separate callables `truncate(std::size_t)` and
  /// `append(std::span<const token_id>)`.
  template <class Truncate, class Append>
  requires std::invocable<Truncate&, std::size_t> &&
      std::invocable<Append&, std::span<const token_id>>
          CacheSync sync(std::span<const token_id> context, Truncate&& truncate, Append&& append,
                         std::size_t min_appended = 0) {
    const std::size_t common = common_prefix(context);
    CacheSync result;
    result.kept = std::min(common, context.size() - std::min(min_appended, context.size()));
    result.truncated = tokens_.size() - result.kept;
    result.appended = context.size() - result.kept;
    if (result.truncated != 0 || dirty_) {
      // Record the kept prefix first: if the hook throws, the next sync truncates again.
      tokens_.resize(result.kept);
      dirty_ = true;
      truncate(result.kept);
      dirty_ = false;
    }
    if (result.appended != 0) {
      dirty_ = true;
      append(context.subspan(result.kept));
      tokens_.insert(tokens_.end(), context.begin() + static_cast<std::ptrdiff_t>(result.kept),
                     context.end());
      dirty_ = false;
    }
    return result;
  }

 private:
  [[nodiscard]] std::size_t common_prefix(std::span<const token_id> context) const noexcept {
    const std::size_t limit = std::min(context.size(), tokens_.size());
    const auto mismatch = std::mismatch(
        tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(limit), context.begin());
    return static_cast<std::size_t>(mismatch.first - tokens_.begin());
  }

  std::vector<token_id> tokens_;
  bool dirty_ = false;  // a hook threw: the model's state past tokens_ is unknown
};

}  // namespace specdec
