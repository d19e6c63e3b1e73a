// specdec — CachedContext: turns "here is the whole accepted context" into KV-cache
// rollback calls for stateful models, for linear drafts and for token trees.
//
// The decoder always passes a model the whole context (prompt + accepted tokens, plus the
// drafts being scored). A model with a KV cache keeps a CachedContext next to its cache
// and calls `sync(context, *this)` at the top of next_token_probabilities / score_draft /
// score_tree. sync compares the context with the tokens the cache holds, keeps their
// longest common prefix, and calls the model's hooks:
//   truncate(n)      drop cached positions >= n (only if something must go),
//   append(tokens)   evaluate `tokens` at positions kept, kept + 1, ... (only if non-empty).
// After a speculative step the cache of the target holds context + x_1..x_gamma; the next
// context is context + x_1..x_n + t, so exactly the gamma - n rejected drafts are dropped
// (one fewer when the correction t happens to equal x_{n+1}) and nothing accepted is
// evaluated twice.
//
// Token trees (score_tree, tree_verification.hpp): after `sync(context, *this)` the model
// evaluates every node past the root in one pass and reports it with
// `append_tree(tree, *this)`, which calls
//   append_tree(tree)             evaluate node i at cache slot base + i - 1 (base =
//                                 context.size()) with the tree mask,
// and remembers the tree (tokens and parents). The next sync, given context + path + t,
// walks the pending tree from the root along the new tokens and keeps the accepted path:
//   keep_tree_path(base, slots)   position base + k takes the entry at slots[k]; every other
//                                 tree slot is dropped (positions >= base + slots.size()),
// or truncate(base + depth) when the path already sits at base, base + 1, ... (a chain);
// then appends t as usual. Only the accepted path survives and none of it is evaluated
// again. A context that does not extend the tree's context drops every tree slot.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/draft_tree.hpp"

namespace specdec {

/// `model.truncate(n)` and `model.append(tokens)`: the hooks CachedContext calls.
template <class M>
concept KvCacheHooks = requires(M& model, std::size_t n, std::span<const token_id> tokens) {
  model.truncate(n);
  model.append(tokens);
};

/// KvCacheHooks plus `model.append_tree(tree)` and `model.keep_tree_path(base, slots)`: the
/// hooks of a model that scores a whole token tree in one call (see CachedContext).
template <class M>
concept KvCacheTreeHooks = KvCacheHooks<M> &&
    requires(M& model, const TokenTreeView& tree, std::size_t base,
             std::span<const std::size_t> slots) {
  model.append_tree(tree);
  model.keep_tree_path(base, slots);
};

/// What one `CachedContext::sync` did. Before the sync the model held kept + truncated
/// positions and tree slots; afterwards it holds kept + appended == context.size().
struct CacheSync {
  std::size_t kept = 0;       ///< cached positions reused (the common prefix)
  std::size_t truncated = 0;  ///< cached positions and tree slots dropped (rolled back)
  std::size_t appended = 0;   ///< positions evaluated by `append`
  std::size_t tree_path = 0;  ///< of `kept`: accepted-path entries kept from a pending tree
  friend constexpr bool operator==(const CacheSync&, const CacheSync&) = default;
};

/// The tokens a model's KV cache holds, and the logic that brings it in line with a new
/// context. No allocation once `reserve`d (or once the context and the trees stopped
/// growing).
///
/// Linear contexts (next_token_probabilities, score_draft):
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
///
/// Token trees (score_tree): node i of the tree (i >= 1) lives in cache slot
/// base + i - 1, base = context.size(), and has the absolute position base + depth(i) - 1
/// (what its positional encoding uses). Its attention covers the context and its own
/// ancestors. After the step, the decoder's next context is context + path(n) + t; the
/// next sync gathers the path's slots to positions base, base + 1, ... (their positions
/// already match) and appends t.
/// @code
/// struct KvTreeModel {
///   specdec::CachedContext cache;
///   void truncate(std::size_t n);
///   void append(std::span<const specdec::token_id> new_tokens);
///   // Evaluate nodes 1..tree.size()-1 at slots size .. size + tree.size() - 2 in one pass,
///   // node i at position size + tree.depths[i] - 1, attending to the context and to the
///   // slots of its ancestors.
///   void append_tree(const specdec::TokenTreeView& tree);
///   // Move the entry at slots[k] to position base + k (in increasing k: slots[k] >= base + k,
///   // so an in-place forward copy is safe), then forget positions >= base + slots.size().
///   void keep_tree_path(std::size_t base, std::span<const std::size_t> slots);
///   std::size_t vocab_size() const;
///   std::span<const float> next_token_probabilities(std::span<const specdec::token_id> c);
///   specdec::RowsView<const float> score_tree(std::span<const specdec::token_id> context,
///                                             const specdec::TokenTreeView& tree) {
///     cache.sync(context, *this);        // keeps the last step's accepted path, appends t
///     cache.append_tree(tree, *this);    // one pass over the tree, remembered until next sync
///     return rows_of(context.size(), tree);  // root: the last context position; node i: slot
///   }
/// };
/// static_assert(specdec::KvCacheTreeHooks<KvTreeModel>);
/// @endcode
class CachedContext {
 public:
  CachedContext() = default;

  /// Reserves room for `positions` cached tokens and trees of `tree_nodes` nodes (root
  /// included).
  void reserve(std::size_t positions, std::size_t tree_nodes = 0) {
    tokens_.reserve(positions);
    tree_tokens_.reserve(tree_nodes);
    tree_parents_.reserve(tree_nodes);
    path_slots_.reserve(tree_nodes);
  }

  /// The tokens the cache holds at positions 0, 1, ..., without a pending tree's slots.
  [[nodiscard]] std::span<const token_id> tokens() const noexcept { return tokens_; }
  [[nodiscard]] std::size_t size() const noexcept { return tokens_.size(); }
  /// Tree slots the model holds after size() until the next sync (0 without a pending tree).
  [[nodiscard]] std::size_t tree_slots() const noexcept {
    return tree_tokens_.empty() ? 0 : tree_tokens_.size() - 1;
  }

  /// Forgets everything, a pending tree too, without calling hooks (e.g. after the model
  /// reset its cache).
  void clear() noexcept {
    tokens_.clear();
    drop_tree();
    dirty_ = false;
  }

  /// Brings the cache in line with `context` through the model's hooks. With a pending
  /// tree (append_tree) and KvCacheTreeHooks, the tree's accepted path is kept first (see
  /// the class comment); a model with only truncate/append drops every tree slot.
  /// `min_appended` > 0 re-evaluates at least that many final positions even when they are
  /// cached (for models that keep outputs only for the positions of the latest append).
  /// If a hook throws, the cache is marked unknown beyond the kept prefix: the next sync
  /// truncates to that prefix before appending again.
  template <KvCacheHooks Model>
  CacheSync sync(std::span<const token_id> context, Model& model, std::size_t min_appended = 0) {
    const auto truncate = [&model](std::size_t n) { model.truncate(n); };
    const auto append = [&model](std::span<const token_id> tokens) { model.append(tokens); };
    if constexpr (KvCacheTreeHooks<Model>) {
      return sync_impl(
          context, truncate, append,
          [&model](std::size_t base, std::span<const std::size_t> slots) {
            model.keep_tree_path(base, slots);
          },
          min_appended);
    } else {
      return sync_impl(context, truncate, append, no_tree_path{}, min_appended);
    }
  }

  /// As above with separate callables `truncate(std::size_t)` and
  /// `append(std::span<const token_id>)`; a pending tree is dropped whole.
  template <class Truncate, class Append>
  requires std::invocable<Truncate&, std::size_t> &&
      std::invocable<Append&, std::span<const token_id>>
          CacheSync sync(std::span<const token_id> context, Truncate&& truncate, Append&& append,
                         std::size_t min_appended = 0) {
    return sync_impl(context, truncate, append, no_tree_path{}, min_appended);
  }

  /// As above plus `keep_tree_path(std::size_t base, std::span<const std::size_t> slots)`,
  /// which keeps a pending tree's accepted path.
  template <class Truncate, class Append, class KeepTreePath>
  requires std::invocable<Truncate&, std::size_t> &&
      std::invocable<Append&, std::span<const token_id>> &&
      std::invocable<KeepTreePath&, std::size_t, std::span<const std::size_t>>
          CacheSync sync(std::span<const token_id> context, Truncate&& truncate, Append&& append,
                         KeepTreePath&& keep_tree_path, std::size_t min_appended = 0) {
    return sync_impl(context, truncate, append, keep_tree_path, min_appended);
  }

  /// Has the model evaluate the nodes of `tree` past the root (`model.append_tree(tree)`,
  /// node i at slot size() + i - 1) and remembers the tree until the next sync, which keeps
  /// the accepted path. A tree of the root alone calls nothing. Precondition (asserted in
  /// debug builds): the cache was synced to the tree's context (call sync first), so no
  /// other tree is pending. If the hook throws, the next sync truncates to size().
  template <KvCacheTreeHooks Model>
  void append_tree(const TokenTreeView& tree, Model& model) {
    append_tree(tree, [&model](const TokenTreeView& t) { model.append_tree(t); });
  }

  /// As above with a callable `append_tree(const TokenTreeView&)`.
  template <class AppendTree>
  requires std::invocable<AppendTree&, const TokenTreeView&>
  void append_tree(const TokenTreeView& tree, AppendTree&& evaluate) {
    SPECDEC_ASSERT(tree_tokens_.empty() && !dirty_);
    SPECDEC_ASSERT(tree.parents.size() == tree.size());
    if (tree.size() <= 1) return;
    // Room first: once the hook has run, recording the tree cannot fail.
    tree_tokens_.reserve(tree.size());
    tree_parents_.reserve(tree.size());
    path_slots_.reserve(tree.size());
    dirty_ = true;
    evaluate(tree);
    tree_tokens_.assign(tree.tokens.begin(), tree.tokens.end());
    tree_parents_.assign(tree.parents.begin(), tree.parents.end());
    dirty_ = false;
  }

 private:
  struct no_tree_path {};

  template <class Truncate, class Append, class KeepTreePath>
  CacheSync sync_impl(std::span<const token_id> context, Truncate& truncate, Append& append,
                      KeepTreePath&& keep_tree_path, std::size_t min_appended) {
    constexpr bool keeps_paths = !std::is_same_v<std::remove_cvref_t<KeepTreePath>, no_tree_path>;
    const std::size_t held = tokens_.size() + tree_slots();  // what the model holds now
    bool must_truncate = dirty_;  // entries past tokens_ that the linear logic cannot see
    std::size_t path = 0;
    if (!tree_tokens_.empty()) {
      const std::size_t base = tokens_.size();
      if constexpr (keeps_paths) {
        if (context.size() > base && common_prefix(context) == base) {
          path = follow_tree(context.subspan(base));
        }
      }
      const std::size_t slots = tree_slots();
      drop_tree();  // resolved here, whatever happens next
      if (path == 0) {
        must_truncate = true;  // no path entry survives: the truncate below drops the slots
      } else if constexpr (keeps_paths) {
        dirty_ = true;  // if a hook throws, nothing past base is known
        if (!path_in_place(base)) {
          keep_tree_path(base, std::span<const std::size_t>(path_slots_.data(), path));
        } else if (slots > path) {
          truncate(base + path);
        }
        tokens_.insert(tokens_.end(), context.begin() + static_cast<std::ptrdiff_t>(base),
                       context.begin() + static_cast<std::ptrdiff_t>(base + path));
        dirty_ = false;
      }
    }
    const std::size_t common = common_prefix(context);
    CacheSync result;
    result.kept = std::min(common, context.size() - std::min(min_appended, context.size()));
    result.truncated = held - result.kept;
    result.appended = context.size() - result.kept;
    const std::size_t path_start = tokens_.size() - path;
    result.tree_path = result.kept > path_start ? result.kept - path_start : 0;
    if (result.kept != tokens_.size() || must_truncate) {
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

  // Walks the pending tree from the root along `continuation`; path_slots_ receives the
  // slot of each matched node. Parents precede children, so one forward sweep finds every
  // child of the current node after it; among siblings with equal tokens (identical
  // entries) the first is taken.
  std::size_t follow_tree(std::span<const token_id> continuation) {
    path_slots_.clear();
    const std::size_t base = tokens_.size();
    std::size_t node = 0;
    for (std::size_t i = 1; i < tree_tokens_.size() && path_slots_.size() < continuation.size();
         ++i) {
      if (tree_parents_[i] == node && tree_tokens_[i] == continuation[path_slots_.size()]) {
        node = i;
        path_slots_.push_back(base + i - 1);
      }
    }
    return path_slots_.size();
  }

  [[nodiscard]] bool path_in_place(std::size_t base) const noexcept {
    for (std::size_t k = 0; k < path_slots_.size(); ++k) {
      if (path_slots_[k] != base + k) return false;
    }
    return true;
  }

  void drop_tree() noexcept {
    tree_tokens_.clear();
    tree_parents_.clear();
  }

  [[nodiscard]] std::size_t common_prefix(std::span<const token_id> context) const noexcept {
    const std::size_t limit = std::min(context.size(), tokens_.size());
    const auto mismatch = std::mismatch(
        tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(limit), context.begin());
    return static_cast<std::size_t>(mismatch.first - tokens_.begin());
  }

  std::vector<token_id> tokens_;
  std::vector<token_id> tree_tokens_;      // pending tree (empty: none), node 0 the root
  std::vector<std::size_t> tree_parents_;  // its parents
  std::vector<std::size_t> path_slots_;    // slots of the accepted path (scratch)
  bool dirty_ = false;  // a hook threw: the model's state past tokens_ is unknown
};

}  // namespace specdec
