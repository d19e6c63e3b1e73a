// specdec — the n-gram drafter: next-token counts of orders 2..N over a sliding window of
// the accepted context, used either as a proposal-only drafter (one-hot q) or, through
// `as_model`, as a draft LanguageModel whose q rows are the smoothed counts.
//
// A draft is always exact to use: speculative sampling (Sec. 2.3) reproduces the target
// distribution for any q, so everything here only affects speed. What matters for speed:
// the tables follow the context online, propose() allocates nothing, and memory is bounded.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/drafters/detail/flat_index_table.hpp"
#include "specdec/error.hpp"

namespace specdec {

/// Configuration of an NgramDrafter.
struct NgramOptions {
  /// N: tables for n-gram orders 2..N, i.e. contexts of 1..N-1 tokens. 2 <= N <= 32.
  std::size_t max_order = 4;
  /// W: the tables count the n-grams lying entirely in the last W tokens of the context.
  /// W >= N.
  std::size_t window = 512;
};

template <class T>
requires ProbabilityScalar<T>
class NgramDraftModel;

/// N-gram drafter over a sliding window of the accepted context.
///
/// **State.** The tables hold, for every order k = 2..N, the count of each (context of k-1
/// tokens, next token) pair among the n-grams that lie entirely inside the last W tokens of
/// the context (the history window). They are therefore a function of those W tokens only.
/// Each call (`propose`, `update`, the model view) passes the whole context; the drafter
/// brings its tables to that context incrementally:
///  - an extension of the context it saw last: only the new tokens are added, evicting the
///    n-grams that leave the window (O(N) hash operations per token);
///  - any other context (a new prompt, a rollback after rejected drafts, an edit): the
///    tokens after the first difference are removed again (O(N) per token) and the window
///    is refilled from the context; a context sharing nothing with the window is rebuilt
///    from scratch (O(N W)).
/// Detecting the difference compares the overlapping window with the context (a memcmp of
/// at most W tokens per call). So the tables never describe anything but the context given.
///
/// **Proposals** (`propose`). Longest context first: the last N-1 tokens are looked up, then
/// N-2, ..., then 1 (backoff); the first context found proposes its most frequent next
/// token, ties going to the one seen most recently. The proposal is appended to the
/// lookup context and the drafter chains on, up to `out.size()` tokens; it stops early as
/// soon as no context matches. The proposed tokens are never added to the tables.
///
/// **Several proposals** (`propose_many`, a MultiProposalDrafter for token trees). The
/// first tokens of the continuations are the successors of the longest matching context,
/// most frequent first (ties to the most recent); when it has fewer than asked for, the
/// successors of the next shorter matching context that are not yet taken follow, and so
/// on down to 1 token (backoff). Each first token is then chained exactly as `propose`
/// does, so the first continuation is `propose`'s proposal. Costs O(B L N) hash lookups
/// plus the successor lists of the matching contexts (B continuations of up to L tokens);
/// allocates only when B exceeds every earlier call's.
///
/// **Memory bound.** A window of W tokens holds at most W - k + 1 n-grams of order k, so at
/// most E = (N-1) W context records and E (context, token) records are live. Every
/// structure is sized for E at construction (hash tables at load <= 1/2) and never grows,
/// and `contexts()`, `successors()` <= `max_entries()` = E at all times. `memory_bytes()` is
/// fixed by (N, W): on 64-bit platforms 100 bytes of records and links per entry, 64 to 128
/// for the two hash tables (power-of-two capacity >= 2E) and 4 W for the ring, i.e. 168 to
/// 232 bytes per entry (N = 4: 280 KiB at W = 512, 4.4 MiB at W = 8192), plus 4 bytes per
/// continuation of the largest propose_many call.
///
/// **Hashing.** Contexts are keyed by 64-bit hashes (mix64 chains). Two contexts with the
/// same hash share counts; that can only make a proposal worse, never the output wrong.
///
/// @code
/// specdec::NgramDrafter drafter;                 // N = 4, W = 512
/// std::array<specdec::token_id, 8> draft{};
/// std::size_t drafted = drafter.propose(context, draft);  // proposal-only: one-hot q
/// auto draft_model = drafter.as_model<float>(vocab_size); // or: smoothed q rows
/// @endcode
class NgramDrafter {
 public:
  static constexpr std::size_t max_supported_order = 32;

  /// Throws specdec::error (invalid_option) unless 2 <= max_order <= 32 and
  /// max_order <= window < 2^32 / (max_order - 1).
  explicit NgramDrafter(NgramOptions options = {}) : options_(options) {
    if (options.max_order < 2 || options.max_order > max_supported_order)
      detail::throw_error(errc::invalid_option, "NgramDrafter: max_order must be in [2, ",
                          max_supported_order, "], got ", options.max_order);
    if (options.window < options.max_order)
      detail::throw_error(errc::invalid_option, "NgramDrafter: window (", options.window,
                          ") must be >= max_order (", options.max_order, ")");
    const std::size_t orders = options.max_order - 1;
    if (options.window > (std::size_t{detail::FlatIndexTable::npos} - 1) / orders)
      detail::throw_error(errc::invalid_option, "NgramDrafter: window ", options.window,
                          " is too large for 32-bit record indices");
    window_ = options.window;
    orders_ = orders;
    const std::size_t entries = orders_ * window_;
    ring_.assign(window_, 0);
    entry_node_.assign(entries, npos);
    entry_previous_.assign(entries, no_position);
    entry_next_.assign(entries, no_position);
    contexts_.assign(entries, ContextRecord{});
    nodes_.assign(entries, SuccessorNode{});
    free_contexts_.reserve(entries);
    free_nodes_.reserve(entries);
    context_table_ = detail::FlatIndexTable(entries);
    successor_table_ = detail::FlatIndexTable(entries);
    recent_.assign(orders_, 0);
    keys_.assign(orders_, 0);
    matched_.assign(orders_, npos);
    reset();
  }

  /// Brings the tables to `context` (see the class comment), then writes up to
  /// `out.size()` chained proposals into `out` and returns how many it wrote (0 if the last
  /// token's context has never been seen). Allocates nothing.
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) {
    update(context);
    return chain(load_recent(context), out);
  }

  /// Brings the tables to `context`, then writes up to B = `lengths.size()` continuations
  /// of up to L = `out.size() / B` tokens each (see the class comment): continuation b goes
  /// to out[b L, b L + lengths[b]), 1 <= lengths[b] <= L. Returns how many it wrote (0 if
  /// the last token's context has never been seen, or L = 0). The continuations start with
  /// distinct tokens, likeliest first. Allocates only when B exceeds every earlier call's.
  std::size_t propose_many(std::span<const token_id> context, std::span<token_id> out,
                           std::span<std::size_t> lengths) {
    update(context);
    if (lengths.empty()) return 0;
    const std::size_t max_length = out.size() / lengths.size();
    if (max_length == 0) return 0;
    const std::size_t branches = rank_first_tokens(context, lengths.size());
    for (std::size_t b = 0; b < branches; ++b) {
      const std::span<token_id> slot = out.subspan(b * max_length, max_length);
      slot[0] = nodes_[first_[b]].token;
      std::size_t recent = load_recent(context);
      push_recent(recent, slot[0]);
      lengths[b] = 1 + chain(recent, slot.subspan(1));
    }
    return branches;
  }

  /// Brings the tables to `context` without proposing (e.g. to seed them from a prompt).
  void update(std::span<const token_id> context) {
    const std::size_t length = context.size();
    const std::size_t target_begin = length > window_ ? length - window_ : 0;
    // First position where the window and the context disagree (or the overlap ends).
    const std::size_t overlap_end = std::min(end_, length);
    std::size_t agree_end = begin_;
    if (overlap_end > begin_) agree_end = first_difference(context, overlap_end);
    if (agree_end <= target_begin || agree_end == begin_) {
      // Nothing in the window survives into the new window: rebuild.
      clear_tables();
      begin_ = end_ = target_begin;
    } else {
      while (end_ > agree_end) pop_back();
      while (begin_ < target_begin) pop_front();
      while (begin_ > target_begin) push_front(context[begin_ - 1]);
    }
    while (end_ < length) {
      if (end_ - begin_ == window_) pop_front();
      push_back(context[end_]);
    }
  }

  /// Forgets everything (as if constructed anew). Allocates nothing.
  void reset() noexcept {
    clear_tables();
    begin_ = end_ = 0;
  }

  /// A draft LanguageModel over the same tables: q(x | context) is the Witten–Bell
  /// interpolation of the counts of every matching order, down to a uniform distribution
  /// over `vocab_size` tokens (see NgramDraftModel). The view refers to this drafter, which
  /// must outlive it. Throws specdec::error (invalid_size) if vocab_size == 0.
  template <class T = float>
  requires ProbabilityScalar<T>
  [[nodiscard]] NgramDraftModel<T> as_model(std::size_t vocab_size) {
    return NgramDraftModel<T>(*this, vocab_size);
  }

  [[nodiscard]] const NgramOptions& options() const noexcept { return options_; }
  /// Length of the context the tables currently describe.
  [[nodiscard]] std::size_t context_length() const noexcept { return end_; }
  /// Tokens in the history window: min(W, context_length()).
  [[nodiscard]] std::size_t history_size() const noexcept { return end_ - begin_; }
  /// Live context records (distinct hashed contexts over all orders).
  [[nodiscard]] std::size_t contexts() const noexcept { return context_table_.size(); }
  /// Live (context, next token) records over all orders.
  [[nodiscard]] std::size_t successors() const noexcept { return successor_table_.size(); }
  /// The bound E = (N-1) W on contexts() and successors().
  [[nodiscard]] std::size_t max_entries() const noexcept { return orders_ * window_; }
  /// Bytes held by all tables and buffers; fixed at construction, except for 4 bytes per
  /// continuation of the largest propose_many call so far.
  [[nodiscard]] std::size_t memory_bytes() const noexcept {
    return ring_.capacity() * sizeof(token_id) + entry_node_.capacity() * sizeof(std::uint32_t) +
           (entry_previous_.capacity() + entry_next_.capacity()) * sizeof(std::size_t) +
           contexts_.capacity() * sizeof(ContextRecord) +
           nodes_.capacity() * sizeof(SuccessorNode) +
           (free_contexts_.capacity() + free_nodes_.capacity()) * sizeof(std::uint32_t) +
           context_table_.memory_bytes() + successor_table_.memory_bytes() +
           recent_.capacity() * sizeof(token_id) + keys_.capacity() * sizeof(std::uint64_t) +
           (matched_.capacity() + first_.capacity()) * sizeof(std::uint32_t);
  }

  /// Count of `next` after the last `context.size()` tokens (1 <= size <= N-1) in the
  /// current tables (for tests and diagnostics).
  [[nodiscard]] std::size_t count(std::span<const token_id> context, token_id next) const {
    if (context.empty() || context.size() > orders_) return 0;
    const std::uint32_t record = find_context(context_key_of(context));
    if (record == npos) return 0;
    for (std::uint32_t node = contexts_[record].head; node != npos; node = nodes_[node].next)
      if (nodes_[node].token == next) return nodes_[node].count;
    return 0;
  }

 private:
  template <class T>
  requires ProbabilityScalar<T>
  friend class NgramDraftModel;

  static constexpr std::uint32_t npos = detail::FlatIndexTable::npos;
  static constexpr std::size_t no_position = std::numeric_limits<std::size_t>::max();
  static constexpr std::uint64_t golden = 0x9e3779b97f4a7c15ULL;

  struct ContextRecord {
    std::uint64_t key = 0;
    std::uint32_t head = npos;   // first successor node of this context
    std::uint32_t total = 0;     // occurrences of the context (sum of successor counts)
    std::uint32_t distinct = 0;  // number of successor nodes
    std::uint32_t best = npos;   // cached most frequent successor; npos = recompute
  };

  // One (context, next token) pair. Its occurrences in the window form a list in position
  // order, threaded through entry_previous_/entry_next_, so the newest one is known exactly
  // even after the newest occurrence is removed again (rollback).
  struct SuccessorNode {
    std::uint64_t pair_hash = 0;
    std::uint32_t context = npos;
    token_id token = 0;
    std::uint32_t count = 0;
    std::uint32_t previous = npos;  // sibling list of the context
    std::uint32_t next = npos;
    std::size_t newest = 0;  // position of the newest occurrence's next token
    std::size_t oldest = 0;
  };

  // Hash of a context, built from its newest token backwards so that all orders of one
  // position share the work.
  [[nodiscard]] static std::uint64_t extend_hash(std::uint64_t hash, token_id token) noexcept {
    return detail::mix64(hash + golden + static_cast<std::uint32_t>(token));
  }
  [[nodiscard]] static std::uint64_t context_key(std::uint64_t hash, std::size_t length) noexcept {
    return hash ^ (static_cast<std::uint64_t>(length) * 0xd1b54a32d192ed03ULL);
  }
  [[nodiscard]] static std::uint64_t pair_hash_of(std::uint64_t key, token_id token) noexcept {
    return detail::mix64(key ^
                         (static_cast<std::uint64_t>(static_cast<std::uint32_t>(token)) * golden));
  }
  [[nodiscard]] static std::uint64_t context_key_of(std::span<const token_id> context) noexcept {
    std::uint64_t hash = 0;
    for (std::size_t m = 1; m <= context.size(); ++m)
      hash = extend_hash(hash, context[context.size() - m]);
    return context_key(hash, context.size());
  }

  [[nodiscard]] std::size_t entry(std::size_t order_index, std::size_t position) const noexcept {
    return order_index * window_ + position % window_;
  }
  [[nodiscard]] token_id token_at(std::size_t position) const noexcept {
    return ring_[position % window_];
  }

  [[nodiscard]] std::size_t first_difference(std::span<const token_id> context,
                                             std::size_t overlap_end) const noexcept {
    // The overlap [begin_, overlap_end) lies in the ring in at most two pieces.
    std::size_t position = begin_;
    while (position < overlap_end) {
      const std::size_t slot = position % window_;
      const std::size_t piece = std::min(overlap_end - position, window_ - slot);
      const token_id* ring_first = ring_.data() + slot;
      const token_id* context_first = context.data() + position;
      // memcmp runs vectorized; only the first unequal block is searched token by token.
      constexpr std::size_t block = 64;
      for (std::size_t done = 0; done < piece; done += block) {
        const std::size_t size = std::min(block, piece - done);
        if (std::memcmp(ring_first + done, context_first + done, size * sizeof(token_id)) != 0) {
          std::size_t matched = done;
          while (ring_first[matched] == context_first[matched]) ++matched;
          return position + matched;
        }
      }
      position += piece;
    }
    return overlap_end;
  }

  void clear_tables() noexcept {
    context_table_.clear();
    successor_table_.clear();
    std::fill(entry_node_.begin(), entry_node_.end(), npos);
    free_contexts_.clear();
    free_nodes_.clear();
    for (std::size_t i = contexts_.size(); i-- > 0;)
      free_contexts_.push_back(static_cast<std::uint32_t>(i));
    for (std::size_t i = nodes_.size(); i-- > 0;)
      free_nodes_.push_back(static_cast<std::uint32_t>(i));
  }

  [[nodiscard]] std::uint32_t find_context(std::uint64_t key) const {
    return context_table_.find(key,
                               [&](std::uint32_t record) { return contexts_[record].key == key; });
  }

  [[nodiscard]] bool outranks(std::uint32_t a, std::uint32_t b) const noexcept {
    const SuccessorNode& left = nodes_[a];
    const SuccessorNode& right = nodes_[b];
    return left.count > right.count || (left.count == right.count && left.newest > right.newest);
  }

  [[nodiscard]] std::uint32_t best_successor(std::uint32_t record) {
    ContextRecord& context = contexts_[record];
    if (context.best == npos) {
      std::uint32_t best = context.head;
      for (std::uint32_t node = nodes_[best].next; node != npos; node = nodes_[node].next)
        if (outranks(node, best)) best = node;
      context.best = best;
    }
    return context.best;
  }

  // Fills keys_[m - 1] with the key of the last m tokens of `recent`, m = 1..size.
  void compute_keys(std::span<const token_id> recent) noexcept {
    std::uint64_t hash = 0;
    for (std::size_t m = 1; m <= recent.size(); ++m) {
      hash = extend_hash(hash, recent[recent.size() - m]);
      keys_[m - 1] = context_key(hash, m);
    }
  }

  // The record of the longest suffix (at most N-1 tokens) of `recent` with a table entry.
  [[nodiscard]] std::uint32_t longest_match(std::span<const token_id> recent) {
    compute_keys(recent);
    for (std::size_t m = recent.size(); m >= 1; --m) {
      const std::uint32_t record = find_context(keys_[m - 1]);
      if (record != npos) return record;
    }
    return npos;
  }

  // Copies the last min(N-1, context.size()) tokens of `context` into recent_; returns
  // how many.
  std::size_t load_recent(std::span<const token_id> context) noexcept {
    const std::size_t recent = std::min(orders_, context.size());
    std::copy(context.end() - static_cast<std::ptrdiff_t>(recent), context.end(), recent_.begin());
    return recent;
  }

  // Appends `next` to the lookup context recent_[0, recent), dropping its oldest token
  // when it holds N-1 already.
  void push_recent(std::size_t& recent, token_id next) noexcept {
    if (recent < orders_) {
      recent_[recent++] = next;
    } else {
      std::copy(recent_.begin() + 1, recent_.end(), recent_.begin());
      recent_.back() = next;
    }
  }

  // Chains proposals after the lookup context recent_[0, recent) into `out`: the best
  // successor of the longest match, appended and looked up again. Returns how many.
  std::size_t chain(std::size_t recent, std::span<token_id> out) {
    for (std::size_t k = 0; k < out.size(); ++k) {
      const std::uint32_t found = longest_match(std::span<const token_id>(recent_.data(), recent));
      if (found == npos) return k;
      out[k] = nodes_[best_successor(found)].token;
      push_recent(recent, out[k]);
    }
    return out.size();
  }

  // Ranks up to `wanted` distinct first tokens into first_ (successor nodes): the matching
  // contexts of `context` longest first, the successors of each in outranks order. Returns
  // how many.
  std::size_t rank_first_tokens(std::span<const token_id> context, std::size_t wanted) {
    if (first_.size() < wanted) first_.resize(wanted);
    const std::size_t recent = load_recent(context);
    compute_keys(std::span<const token_id>(recent_.data(), recent));
    std::size_t taken = 0;
    for (std::size_t m = recent; m >= 1 && taken < wanted; --m) {
      const std::uint32_t record = find_context(keys_[m - 1]);
      if (record == npos) continue;
      // Insertion into the sorted tail first_[taken, filled): at most wanted - taken nodes.
      const std::size_t tier = taken;
      std::size_t filled = tier;
      for (std::uint32_t node = contexts_[record].head; node != npos; node = nodes_[node].next) {
        const token_id token = nodes_[node].token;
        bool seen = false;
        for (std::size_t k = 0; k < tier && !seen; ++k) seen = nodes_[first_[k]].token == token;
        if (seen) continue;
        if (filled == wanted && !outranks(node, first_[wanted - 1])) continue;
        std::size_t at = filled == wanted ? wanted - 1 : filled++;
        for (; at > tier && outranks(node, first_[at - 1]); --at) first_[at] = first_[at - 1];
        first_[at] = node;
      }
      taken = filled;
    }
    return taken;
  }

  // Adds the n-gram of order index `order_index` whose next token is at `position`.
  void add_occurrence(std::size_t order_index, std::size_t position, std::uint64_t key,
                      bool at_back) {
    const token_id next = token_at(position);
    std::uint32_t record = find_context(key);
    if (record == npos) {
      SPECDEC_ASSERT(!free_contexts_.empty());
      record = free_contexts_.back();
      free_contexts_.pop_back();
      contexts_[record] = ContextRecord{};
      contexts_[record].key = key;
      context_table_.insert(key, record);
    }
    ContextRecord& context = contexts_[record];
    const std::uint64_t pair_hash = pair_hash_of(key, next);
    std::uint32_t node = successor_table_.find(pair_hash, [&](std::uint32_t candidate) {
      return nodes_[candidate].context == record && nodes_[candidate].token == next;
    });
    const std::size_t slot = entry(order_index, position);
    if (node == npos) {
      SPECDEC_ASSERT(!free_nodes_.empty());
      node = free_nodes_.back();
      free_nodes_.pop_back();
      SuccessorNode& fresh = nodes_[node];
      fresh = SuccessorNode{};
      fresh.pair_hash = pair_hash;
      fresh.context = record;
      fresh.token = next;
      fresh.newest = fresh.oldest = position;
      fresh.next = context.head;
      if (context.head != npos) nodes_[context.head].previous = node;
      context.head = node;
      ++context.distinct;
      successor_table_.insert(pair_hash, node);
      entry_previous_[slot] = entry_next_[slot] = no_position;
    } else if (at_back) {
      SuccessorNode& existing = nodes_[node];
      SPECDEC_ASSERT(existing.newest < position);
      entry_previous_[slot] = existing.newest;
      entry_next_[slot] = no_position;
      entry_next_[entry(order_index, existing.newest)] = position;
      existing.newest = position;
    } else {
      SuccessorNode& existing = nodes_[node];
      SPECDEC_ASSERT(existing.oldest > position);
      entry_next_[slot] = existing.oldest;
      entry_previous_[slot] = no_position;
      entry_previous_[entry(order_index, existing.oldest)] = position;
      existing.oldest = position;
    }
    ++nodes_[node].count;
    entry_node_[slot] = node;
    ++context.total;
    if (context.total == 1) {
      context.best = node;
    } else if (context.best != npos && context.best != node && outranks(node, context.best)) {
      context.best = node;
    }
  }

  void remove_occurrence(std::size_t order_index, std::size_t position, bool at_back) {
    const std::size_t slot = entry(order_index, position);
    const std::uint32_t node = entry_node_[slot];
    SPECDEC_ASSERT(node != npos);
    SuccessorNode& successor = nodes_[node];
    if (at_back) {
      SPECDEC_ASSERT(successor.newest == position);
      successor.newest = entry_previous_[slot];
      if (successor.newest != no_position)
        entry_next_[entry(order_index, successor.newest)] = no_position;
    } else {
      SPECDEC_ASSERT(successor.oldest == position);
      successor.oldest = entry_next_[slot];
      if (successor.oldest != no_position)
        entry_previous_[entry(order_index, successor.oldest)] = no_position;
    }
    entry_node_[slot] = npos;
    const std::uint32_t record = successor.context;
    ContextRecord& context = contexts_[record];
    --successor.count;
    --context.total;
    if (context.best == node) context.best = npos;  // it may have lost the lead
    if (successor.count == 0) {
      if (successor.previous != npos)
        nodes_[successor.previous].next = successor.next;
      else
        context.head = successor.next;
      if (successor.next != npos) nodes_[successor.next].previous = successor.previous;
      successor_table_.erase(successor.pair_hash, node);
      free_nodes_.push_back(node);
      --context.distinct;
    }
    if (context.total == 0) {
      context_table_.erase(context.key, record);
      free_contexts_.push_back(record);
    }
  }

  // Appends the token at position end_ (n-grams ending there).
  void push_back(token_id token) {
    const std::size_t position = end_;
    ring_[position % window_] = token;
    ++end_;
    std::uint64_t hash = 0;
    for (std::size_t o = 0; o < orders_; ++o) {
      const std::size_t length = o + 1;
      if (position < begin_ + length) break;
      hash = extend_hash(hash, token_at(position - length));
      add_occurrence(o, position, context_key(hash, length), true);
    }
  }

  // Removes the token at position end_ - 1 (n-grams ending there).
  void pop_back() {
    const std::size_t position = end_ - 1;
    for (std::size_t o = 0; o < orders_; ++o) {
      if (position < begin_ + o + 1) break;
      remove_occurrence(o, position, true);
    }
    --end_;
  }

  // Prepends the token at position begin_ - 1 (n-grams starting there). Precondition: the
  // window holds fewer than W tokens.
  void push_front(token_id token) {
    SPECDEC_ASSERT(begin_ > 0 && end_ - begin_ < window_);
    const std::size_t start = begin_ - 1;
    ring_[start % window_] = token;
    --begin_;
    for (std::size_t o = 0; o < orders_; ++o) {
      const std::size_t length = o + 1;
      const std::size_t position = start + length;  // of the n-gram's next token
      if (position >= end_) break;
      std::uint64_t hash = 0;
      for (std::size_t m = 1; m <= length; ++m) hash = extend_hash(hash, token_at(position - m));
      add_occurrence(o, position, context_key(hash, length), false);
    }
  }

  // Removes the token at position begin_ (n-grams starting there).
  void pop_front() {
    const std::size_t start = begin_;
    for (std::size_t o = 0; o < orders_; ++o) {
      const std::size_t position = start + o + 1;
      if (position >= end_) break;
      remove_occurrence(o, position, false);
    }
    ++begin_;
  }

  NgramOptions options_;
  std::size_t window_ = 0;
  std::size_t orders_ = 0;
  std::size_t begin_ = 0;  // window = context positions [begin_, end_)
  std::size_t end_ = 0;
  std::vector<token_id> ring_;  // token at position p lives in ring_[p % W]
  // Per (order, position of the next token): the node of that n-gram and the neighbouring
  // occurrences of the same node.
  std::vector<std::uint32_t> entry_node_;
  std::vector<std::size_t> entry_previous_;
  std::vector<std::size_t> entry_next_;
  std::vector<ContextRecord> contexts_;
  std::vector<SuccessorNode> nodes_;
  std::vector<std::uint32_t> free_contexts_;
  std::vector<std::uint32_t> free_nodes_;
  detail::FlatIndexTable context_table_;
  detail::FlatIndexTable successor_table_;
  std::vector<token_id> recent_;        // propose(): lookup context, scratch
  std::vector<std::uint64_t> keys_;     // propose(): context keys per length, scratch
  std::vector<std::uint32_t> matched_;  // model view: matched records per length, scratch
  std::vector<std::uint32_t> first_;    // propose_many(): ranked first tokens, scratch
};

/// The probabilistic mode of an NgramDrafter: a draft LanguageModel whose rows are smoothed
/// counts, so that the decoder samples x ~ q itself and speculative sampling stays exact.
///
/// q(x | context) is the Witten–Bell interpolation over the orders whose context (the last
/// 1, 2, ..., N-1 tokens) occurs in the tables, shortest first, starting from the uniform
/// distribution over the vocabulary:
///   q_0(x) = 1 / V,   q_m(x) = (c_m(x) + u_m q_{m-1}(x)) / (t_m + u_m),
/// with c_m(x) the count of x after the last m tokens, t_m = sum_x c_m(x) and u_m the number
/// of distinct x with c_m(x) > 0. Every row has full support and sums to 1.
///
/// Before scoring, the drafter's tables are brought to `context` exactly as `propose` does,
/// so a row is a deterministic function of the context (the decoder's calls with drafted
/// tokens appended are undone cheaply when the drafts are rejected). Costs O(V + distinct
/// successors of the matched contexts) per row; allocates nothing after construction.
/// Refers to its drafter (which must outlive it); copies share the drafter.
template <class T>
requires ProbabilityScalar<T>
class NgramDraftModel {
 public:
  /// Throws specdec::error (invalid_size) if vocab_size == 0.
  NgramDraftModel(NgramDrafter& drafter, std::size_t vocab_size)
      : drafter_(&drafter), row_(vocab_size) {
    if (vocab_size == 0)
      detail::throw_error(errc::invalid_size, "ngram draft model: vocab_size must be > 0");
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return row_.size(); }

  /// Throws specdec::error (invalid_token) if a token of the context that the row depends
  /// on lies outside [0, vocab_size()).
  [[nodiscard]] std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    NgramDrafter& drafter = *drafter_;
    drafter.update(context);
    const std::size_t longest = std::min(drafter.orders_, context.size());
    // Matched records, shortest context first; a longer context can only occur if its
    // suffix does, so the first miss ends the search.
    std::size_t matched = 0;
    std::uint64_t hash = 0;
    for (std::size_t m = 1; m <= longest; ++m) {
      hash = NgramDrafter::extend_hash(hash, context[context.size() - m]);
      const std::uint32_t record = drafter.find_context(NgramDrafter::context_key(hash, m));
      if (record == NgramDrafter::npos) break;
      drafter.matched_[matched++] = record;
    }
    // Unrolled recursion: q_M = prod_m s_m / V + sum_m c_m(x) / (t_m + u_m) prod_{j>m} s_j
    // with s_m = u_m / (t_m + u_m).
    double weight_above = 1.0;  // prod_{j>m} s_j while walking m downwards
    for (std::size_t m = matched; m-- > 0;) {
      const auto& record = drafter.contexts_[drafter.matched_[m]];
      weight_above *= static_cast<double>(record.distinct) /
                      static_cast<double>(record.total + record.distinct);
    }
    const double vocab = static_cast<double>(row_.size());
    std::fill(row_.begin(), row_.end(), static_cast<T>(weight_above / vocab));
    weight_above = 1.0;
    for (std::size_t m = matched; m-- > 0;) {
      const auto& record = drafter.contexts_[drafter.matched_[m]];
      const double denominator = static_cast<double>(record.total + record.distinct);
      const double scale = weight_above / denominator;
      for (std::uint32_t node = record.head; node != NgramDrafter::npos;
           node = drafter.nodes_[node].next) {
        const auto& successor = drafter.nodes_[node];
        if (successor.token < 0 || static_cast<std::size_t>(successor.token) >= row_.size())
          detail::throw_error(errc::invalid_token, "ngram draft model: context token ",
                              successor.token, " is outside the vocabulary [0, ", row_.size(), ")");
        row_[static_cast<std::size_t>(successor.token)] +=
            static_cast<T>(scale * static_cast<double>(successor.count));
      }
      weight_above *= static_cast<double>(record.distinct) / denominator;
    }
    return row_;
  }

  [[nodiscard]] NgramDrafter& drafter() const noexcept { return *drafter_; }

 private:
  NgramDrafter* drafter_;
  std::vector<T> row_;
};

static_assert(MultiProposalDrafter<NgramDrafter>);
static_assert(LanguageModel<NgramDraftModel<float>>);
static_assert(LanguageModel<NgramDraftModel<double>>);

}  // namespace specdec
