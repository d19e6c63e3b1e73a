// Toy models shared by the speculative_decoder_*_test.cpp files: Markov chains of order 1
// and 2 (target and draft), a batched twin that scores all prefixes in one call, a KV-cache
// twin that scores a whole token tree in one call, and deterministic proposal drafters.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "specdec/cached_context.hpp"
#include "specdec/concepts.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "support/statistics.hpp"

namespace specdec::testing {

/// An order-k Markov chain over V tokens: the next-token row depends on the last k tokens
/// of the context (missing tokens before the start count as token 0). Rows live in one table
/// and are returned as spans (valid as long as the model).
template <class T>
class MarkovModel {
 public:
  MarkovModel(std::size_t vocab, std::size_t order, std::vector<T> table)
      : vocab_(vocab), order_(order), table_(std::move(table)) {}

  /// Rows proportional to exp(sharpness * N(0,1)) with each entry zero with probability
  /// `zero_fraction` (at least one non-zero entry per row).
  static MarkovModel random(std::size_t vocab, std::size_t order, std::uint64_t seed,
                            double sharpness = 2.0, double zero_fraction = 0.0) {
    xoshiro256pp g(seed);
    const std::size_t states = power(vocab, order);
    std::vector<T> table(states * vocab);
    for (std::size_t s = 0; s < states; ++s) {
      std::vector<double> row(vocab);
      for (auto& x : row) {
        const double normal = standard_normal(g);
        x = uniform01<double>(g) < zero_fraction ? 0.0 : std::exp(sharpness * normal);
      }
      if (*std::max_element(row.begin(), row.end()) == 0.0) row[uniform_below(g, vocab)] = 1.0;
      normalize_into(row, std::span<T>(table.data() + s * vocab, vocab));
    }
    return {vocab, order, std::move(table)};
  }

  /// An order-1 chain whose row for token a is weight * (average over states ending in a of
  /// this chain's rows) + (1 - weight) * other's row for a: a draft that resembles the
  /// target without matching it. `other` must be order 1.
  [[nodiscard]] MarkovModel order1_blend(const MarkovModel& other, double weight) const {
    std::vector<T> table(vocab_ * vocab_);
    const std::size_t states = power(vocab_, order_);
    for (std::size_t a = 0; a < vocab_; ++a) {
      std::vector<double> row(vocab_, 0.0);
      std::size_t count = 0;
      for (std::size_t s = 0; s < states; ++s) {
        if (s % vocab_ != a) continue;  // the last token of state s is s % V
        ++count;
        for (std::size_t j = 0; j < vocab_; ++j)
          row[j] += static_cast<double>(table_[s * vocab_ + j]);
      }
      for (std::size_t j = 0; j < vocab_; ++j) {
        row[j] = weight * row[j] / static_cast<double>(count) +
                 (1.0 - weight) * static_cast<double>(other.table_[a * vocab_ + j]);
      }
      normalize_into(row, std::span<T>(table.data() + a * vocab_, vocab_));
    }
    return {vocab_, 1, std::move(table)};
  }

  [[nodiscard]] std::size_t vocab_size() const { return vocab_; }
  [[nodiscard]] std::size_t order() const { return order_; }

  std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    ++calls;
    return row(state(context));
  }

  /// The state index of a context: its last `order` tokens in base V (0-padded).
  [[nodiscard]] std::size_t state(std::span<const token_id> context) const {
    std::size_t s = 0;
    for (std::size_t k = order_; k > 0; --k) {
      const std::size_t back = k;  // k-th token from the end
      const std::size_t token =
          context.size() >= back ? static_cast<std::size_t>(context[context.size() - back]) : 0;
      s = s * vocab_ + token;
    }
    return s;
  }
  [[nodiscard]] std::size_t states() const { return power(vocab_, order_); }
  [[nodiscard]] std::span<const T> row(std::size_t state) const {
    return {table_.data() + state * vocab_, vocab_};
  }
  /// The state after appending `token` to a context in state `s`.
  [[nodiscard]] std::size_t next_state(std::size_t s, std::size_t token) const {
    if (order_ == 0) return 0;
    return (s * vocab_ + token) % states();
  }

  std::size_t calls = 0;

 private:
  static std::size_t power(std::size_t base, std::size_t exponent) {
    std::size_t result = 1;
    for (std::size_t k = 0; k < exponent; ++k) result *= base;
    return result;
  }
  static void normalize_into(const std::vector<double>& row, std::span<T> out) {
    double total = 0.0;
    for (const double x : row) total += x;
    for (std::size_t j = 0; j < row.size(); ++j) out[j] = static_cast<T>(row[j] / total);
  }

  std::size_t vocab_;
  std::size_t order_;
  std::vector<T> table_;
};

/// A MarkovModel that declares stable_rows (concepts.hpp): its rows are rows of its table,
/// valid as long as the model, so the decoder reads them in place at T = 1.
template <class T>
class StableMarkovModel : public MarkovModel<T> {
 public:
  static constexpr bool stable_rows = true;
  explicit StableMarkovModel(MarkovModel<T> model) : MarkovModel<T>(std::move(model)) {}
};

/// MarkovModel plus score_draft: all prefixes of context + draft in one call.
template <class T>
class BatchedMarkovModel : public MarkovModel<T> {
 public:
  explicit BatchedMarkovModel(MarkovModel<T> model) : MarkovModel<T>(std::move(model)) {}

  RowsView<const T> score_draft(std::span<const token_id> context,
                                std::span<const token_id> draft) {
    ++batched_calls;
    const std::size_t vocab = this->vocab_size();
    rows_.resize((draft.size() + 1) * vocab);
    std::size_t s = this->state(context);
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const auto row = this->row(s);
      std::copy(row.begin(), row.end(), rows_.begin() + static_cast<std::ptrdiff_t>(i * vocab));
      if (i < draft.size()) s = this->next_state(s, static_cast<std::size_t>(draft[i]));
    }
    return {rows_.data(), draft.size() + 1, vocab};
  }

  std::size_t batched_calls = 0;

 private:
  std::vector<T> rows_;
};

/// A MarkovModel with a KV cache kept in line by CachedContext, scoring a whole token tree
/// in one call (a TreeScoringModel with KvCacheTreeHooks). Its "cache" holds the chain state
/// after each position, computed only by the hooks from the state of the entry before it
/// (the previous position, or the parent's slot in a tree); rows are read from the cache,
/// never from the context, so a wrong rollback or gather changes the rows it returns. It
/// counts its calls and every evaluated position.
template <class T>
class KvTreeMarkovModel {
 public:
  explicit KvTreeMarkovModel(MarkovModel<T> model, std::size_t capacity = 4096)
      : model_(std::move(model)) {
    states_.reserve(capacity);
    held_.reserve(capacity);
    before_append_.reserve(capacity);
    cache_.reserve(capacity);
  }

  [[nodiscard]] std::size_t vocab_size() const { return model_.vocab_size(); }

  std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    ++calls;
    sync(context);
    return row_at(context.size());
  }

  /// Row i is the row after context + path(i): the root's from the last context position,
  /// node i's from its slot context.size() + i - 1.
  RowsView<const T> score_tree(std::span<const token_id> context, const TokenTreeView& tree) {
    ++tree_calls;
    sync(context);
    cache_.append_tree(tree, *this);
    const std::size_t vocab = vocab_size();
    rows_.resize(tree.size() * vocab);
    for (std::size_t i = 0; i < tree.size(); ++i) {
      const auto row = row_at(context.size() + i);
      std::copy(row.begin(), row.end(), rows_.begin() + static_cast<std::ptrdiff_t>(i * vocab));
    }
    return {rows_.data(), tree.size(), vocab};
  }

  // --- KV-cache hooks (called by CachedContext) ---
  void truncate(std::size_t n) {
    states_.resize(std::min(n, states_.size()));
    held_.resize(states_.size());
  }
  void append(std::span<const token_id> tokens) {
    if (!appended_in_sync_) before_append_.assign(held_.begin(), held_.end());
    appended_in_sync_ = true;
    for (const token_id token : tokens) push(states_.empty() ? 0 : states_.back(), token);
  }
  void append_tree(const TokenTreeView& tree) {
    const std::size_t base = states_.size();
    for (std::size_t i = 1; i < tree.size(); ++i) {
      const std::size_t parent = tree.parents[i];
      const std::size_t from =
          parent == 0 ? (base == 0 ? 0 : states_[base - 1]) : states_[base + parent - 1];
      push(from, tree.tokens[i]);
    }
  }
  void keep_tree_path(std::size_t base, std::span<const std::size_t> slots) {
    ++gathers;
    for (std::size_t k = 0; k < slots.size(); ++k) {
      states_[base + k] = states_[slots[k]];
      held_[base + k] = held_[slots[k]];
    }
    states_.resize(base + slots.size());
    held_.resize(base + slots.size());
  }

  /// The tokens whose entries the cache holds, positions and tree slots (slot order).
  [[nodiscard]] std::span<const token_id> held() const noexcept { return held_; }
  /// What the cache held in the last sync once the previous tree was resolved and before
  /// anything was appended (the whole cache after that sync if it appended nothing).
  [[nodiscard]] std::span<const token_id> resolved() const noexcept { return before_append_; }
  [[nodiscard]] const CacheSync& last_sync() const noexcept { return last_sync_; }

  std::size_t calls = 0;                ///< next_token_probabilities calls
  std::size_t tree_calls = 0;           ///< score_tree calls
  std::size_t gathers = 0;              ///< keep_tree_path calls
  std::size_t evaluated_positions = 0;  ///< entries computed by append and append_tree

 private:
  void sync(std::span<const token_id> context) {
    appended_in_sync_ = false;
    last_sync_ = cache_.sync(context, *this);
    if (!appended_in_sync_) before_append_.assign(held_.begin(), held_.end());
  }
  void push(std::size_t from, token_id token) {
    states_.push_back(model_.next_state(from, static_cast<std::size_t>(token)));
    held_.push_back(token);
    ++evaluated_positions;
  }
  // The row after the entry at `slot` - 1 (the empty context's row for slot 0).
  [[nodiscard]] std::span<const T> row_at(std::size_t slot) const {
    return model_.row(slot == 0 ? 0 : states_[slot - 1]);
  }

  MarkovModel<T> model_;
  CachedContext cache_;
  std::vector<std::size_t> states_;  // chain state after each position / tree slot
  std::vector<token_id> held_;       // the token of each entry
  std::vector<token_id> before_append_;
  std::vector<T> rows_;
  CacheSync last_sync_{};
  bool appended_in_sync_ = false;
};

/// A proposal-only drafter that proposes the greedy continuation of a Markov table
/// (deterministic): a good drafter when the table is the target's, a poor one otherwise.
template <class T>
class GreedyChainDrafter {
 public:
  explicit GreedyChainDrafter(const MarkovModel<T>& model, std::size_t max_proposals = 1000)
      : model_(&model), max_proposals_(max_proposals) {}

  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) {
    ++calls;
    std::size_t s = model_->state(context);
    const std::size_t count = std::min(out.size(), max_proposals_);
    for (std::size_t i = 0; i < count; ++i) {
      const auto row = model_->row(s);
      const auto best =
          static_cast<std::size_t>(std::max_element(row.begin(), row.end()) - row.begin());
      out[i] = static_cast<token_id>(best);
      s = model_->next_state(s, best);
    }
    return count;
  }

  std::size_t calls = 0;

 private:
  const MarkovModel<T>* model_;
  std::size_t max_proposals_;
};

/// A proposal-only drafter that proposes (last token + 1 + i) mod V: unrelated to any model.
struct CountingUpDrafter {
  std::size_t vocab = 4;
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) const {
    const std::size_t last = context.empty() ? 0 : static_cast<std::size_t>(context.back());
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<token_id>((last + 1 + i) % vocab);
    }
    return out.size();
  }
};

}  // namespace specdec::testing
