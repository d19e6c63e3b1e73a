// specdec demo — a character-level (byte, V = 256) interpolated Kneser-Ney n-gram model.
//
// The demo's target M_p is this model at order 7 and its default draft M_q the same
// estimator at order 2 (a bigram), both trained at start-up from text. Each returns full
// probability vectors over all 256 byte values, so both are real specdec::LanguageModels;
// the target also scores all gamma + 1 prefixes of a draft in one call
// (specdec::BatchedLanguageModel).
//
// The estimate for a history h (the last k - 1 bytes) and a next byte w interpolates down
// to the uniform distribution over the 256 bytes (Chen & Goodman's interpolated KN):
//
//   P_k(w | h) = max(c_k(h w) - D_k, 0) / c_k(h .) + D_k * N_k(h .) / c_k(h .) * P_{k-1}(w | h')
//   P_0(w)     = 1 / 256
//
// where h' drops the oldest byte of h, c_k(h .) = sum_w c_k(h w) and N_k(h .) counts the w
// with c_k(h w) > 0. The highest level used for a query counts raw occurrences; every
// lower level counts continuations, c_k(h w) = |{a : a h w occurs}|, because it only speaks
// for contexts the higher level has not seen often. A level whose history never occurred is
// skipped (P_k = P_{k-1}). The discount of each level and kind of count is
// D = n1 / (n1 + 2 n2) from its counts-of-counts (0.5 if n1 or n2 is 0). Every row is
// strictly positive and sums to 1 up to rounding.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/rows.hpp"

namespace specdec_demo {

using specdec::token_id;

/// Maps bytes to token ids 0..255 and back.
inline std::vector<token_id> to_tokens(std::string_view text) {
  std::vector<token_id> tokens;
  tokens.reserve(text.size());
  for (const char c : text) tokens.push_back(static_cast<token_id>(static_cast<unsigned char>(c)));
  return tokens;
}

inline std::string to_text(std::span<const token_id> tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (const token_id t : tokens) text.push_back(static_cast<char>(static_cast<unsigned char>(t)));
  return text;
}

class KneserNeyModel {
 public:
  static constexpr std::size_t vocabulary = 256;
  static constexpr std::size_t max_order = 8;  // a history of up to 7 bytes packs into 64 bits

  /// Trains a model of the given order (1..8) on `corpus`, read as bytes.
  /// Throws std::invalid_argument for an order outside 1..8 or an empty corpus.
  KneserNeyModel(std::string_view corpus, std::size_t order) : order_(order) {
    if (order < 1 || order > max_order)
      throw std::invalid_argument("Kneser-Ney order must be in 1.." + std::to_string(max_order) +
                                  ", got " + std::to_string(order));
    if (corpus.empty()) throw std::invalid_argument("Kneser-Ney corpus is empty");
    train(corpus);
    row_.resize(vocabulary);
    if (order_ <= 2) {
      // A bigram has only 256 full-length histories: tabulate them, so that a call is a
      // lookup, as cheap as a draft model should be.
      table_.resize(vocabulary * vocabulary);
      for (std::size_t previous = 0; previous < vocabulary; ++previous) {
        const auto token = static_cast<token_id>(previous);
        probabilities(std::span<const token_id>(&token, 1),
                      std::span<double>(table_.data() + previous * vocabulary, vocabulary));
      }
    }
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocabulary; }
  [[nodiscard]] std::size_t order() const noexcept { return order_; }

  /// The discount of level `k` (1..order) for raw (`raw` = true) or continuation counts.
  [[nodiscard]] double discount(std::size_t k, bool raw) const {
    return raw ? levels_.at(k - 1).raw_discount : levels_.at(k - 1).continuation_discount;
  }

  /// Fills `out` (256 entries) with P(. | context). Uses only the last order - 1 tokens.
  void probabilities(std::span<const token_id> context, std::span<double> out) const {
    const std::size_t history_length = std::min(context.size(), order_ - 1);
    const auto history = context.subspan(context.size() - history_length);
    std::fill(out.begin(), out.end(), 1.0 / static_cast<double>(vocabulary));
    // From the unigram level (k = 1, empty history) up to the highest level this context
    // supports (k = history_length + 1), each level interpolating with the one below.
    for (std::size_t k = 1; k <= history_length + 1; ++k) {
      const Level& level = levels_[k - 1];
      const auto found = level.nodes.find(history_key(history.subspan(history_length - (k - 1))));
      if (found == level.nodes.end()) continue;  // history never seen: P_k = P_{k-1}
      const Node& node = found->second;
      const bool raw = (k == history_length + 1);
      const Counts& counts = raw ? node.raw : node.continuation;
      if (counts.total == 0) continue;
      const double discount = raw ? level.raw_discount : level.continuation_discount;
      const double total = static_cast<double>(counts.total);
      const double backoff = discount * static_cast<double>(counts.types) / total;
      for (double& entry : out) entry *= backoff;
      for (std::size_t e = node.first; e < node.first + node.size; ++e) {
        const Entry& entry = level.entries[e];
        const std::uint32_t count = raw ? entry.raw : entry.continuation;
        if (count > 0) out[entry.byte] += (static_cast<double>(count) - discount) / total;
      }
    }
  }

  /// P(. | context): a view into a buffer owned by the model, valid until the next call.
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    if (!table_.empty() && !context.empty()) {
      const auto previous = static_cast<std::size_t>(context.back() & 0xff);
      return {table_.data() + previous * vocabulary, vocabulary};
    }
    probabilities(context, row_);
    return row_;
  }

  /// Rows P(. | context + draft[0..i)) for i = 0..draft.size(), in one call (the batched
  /// entry point of specdec::BatchedLanguageModel). Valid until the next call.
  specdec::RowsView<const double> score_draft(std::span<const token_id> context,
                                              std::span<const token_id> draft) {
    // Only the last order - 1 tokens of each prefix matter: join that tail of the context
    // with the draft once and slide over it.
    const std::size_t tail = std::min(context.size(), order_ - 1);
    joined_.assign(context.end() - static_cast<std::ptrdiff_t>(tail), context.end());
    joined_.insert(joined_.end(), draft.begin(), draft.end());
    const std::size_t rows = draft.size() + 1;
    batch_.resize(rows * vocabulary);
    for (std::size_t i = 0; i < rows; ++i) {
      // Prefix i ends after joined_[tail + i); a short tail at the very start of the text is
      // exactly what next_token_probabilities would see too.
      probabilities(std::span<const token_id>(joined_.data(), tail + i),
                    std::span<double>(batch_.data() + i * vocabulary, vocabulary));
    }
    return {batch_.data(), rows, vocabulary};
  }

 private:
  struct Entry {
    std::uint8_t byte = 0;
    std::uint32_t raw = 0;           // c(h w)
    std::uint32_t continuation = 0;  // |{a : a h w occurs}|
  };
  struct Counts {
    std::uint64_t total = 0;  // sum over w
    std::uint64_t types = 0;  // number of w with a non-zero count
  };
  struct Node {  // one history h of a level: entries [first, first + size) of the level
    std::size_t first = 0;
    std::size_t size = 0;
    Counts raw;
    Counts continuation;
  };
  struct Level {  // level k: histories of k - 1 bytes
    std::unordered_map<std::uint64_t, Node> nodes;
    std::vector<Entry> entries;  // grouped by history, bytes ascending within a group
    double raw_discount = 0.5;
    double continuation_discount = 0.5;
  };
  using GramCounts = std::vector<std::pair<std::uint64_t, std::uint32_t>>;  // sorted by gram

  static std::uint64_t history_key(std::span<const token_id> history) {
    std::uint64_t key = 0;
    for (const token_id t : history) key = (key << 8U) | static_cast<std::uint64_t>(t & 0xff);
    return key;  // levels are stored separately, so the length need not be encoded
  }

  static double kneser_ney_discount(std::uint64_t singletons, std::uint64_t doubletons) {
    if (singletons == 0 || doubletons == 0) return 0.5;
    return static_cast<double>(singletons) /
           (static_cast<double>(singletons) + 2.0 * static_cast<double>(doubletons));
  }

  // Sorts the keys and counts equal runs.
  static GramCounts count_sorted(std::vector<std::uint64_t>& keys) {
    std::sort(keys.begin(), keys.end());
    GramCounts counts;
    for (std::size_t i = 0; i < keys.size();) {
      std::size_t j = i;
      while (j < keys.size() && keys[j] == keys[i]) ++j;
      counts.emplace_back(keys[i], static_cast<std::uint32_t>(j - i));
      i = j;
    }
    return counts;
  }

  void train(std::string_view corpus) {
    const std::vector<token_id> text = to_tokens(corpus);
    // grams[k - 1]: the distinct k-grams (k packed bytes, oldest byte highest) with their
    // raw counts, sorted, so the k-grams sharing a history are adjacent.
    std::vector<GramCounts> grams(order_);
    std::vector<std::uint64_t> keys;
    for (std::size_t k = 1; k <= order_; ++k) {
      keys.clear();
      for (std::size_t end = k; end <= text.size(); ++end)
        keys.push_back(history_key(std::span<const token_id>(text.data() + end - k, k)));
      grams[k - 1] = count_sorted(keys);
    }
    levels_.resize(order_);
    for (std::size_t k = 1; k <= order_; ++k) {
      // Continuation counts of the k-grams h w: the number of distinct (k+1)-grams a h w.
      GramCounts continuations;
      if (k < order_) {
        const std::uint64_t mask = (std::uint64_t{1} << (8 * k)) - 1;  // k <= 7 here
        keys.clear();
        for (const auto& gram : grams[k]) keys.push_back(gram.first & mask);
        continuations = count_sorted(keys);
      }
      Level& level = levels_[k - 1];
      level.entries.reserve(grams[k - 1].size());
      level.nodes.reserve(grams[k - 1].size());
      std::uint64_t raw_counts_of_count[3] = {0, 0, 0};
      std::uint64_t continuation_counts_of_count[3] = {0, 0, 0};
      std::size_t next_continuation = 0;  // both lists are sorted: merge them
      Node* node = nullptr;
      std::uint64_t node_history = 0;
      for (const auto& [gram, count] : grams[k - 1]) {
        std::uint32_t continuation = 0;
        if (next_continuation < continuations.size() &&
            continuations[next_continuation].first == gram)
          continuation = continuations[next_continuation++].second;
        const std::uint64_t history = gram >> 8U;
        if (node == nullptr || history != node_history) {
          node = &level.nodes[history];
          node->first = level.entries.size();
          node_history = history;
        }
        level.entries.push_back(
            Entry{static_cast<std::uint8_t>(gram & 0xffU), count, continuation});
        ++node->size;
        node->raw.total += count;
        ++node->raw.types;
        node->continuation.total += continuation;
        node->continuation.types += continuation > 0 ? 1 : 0;
        if (count <= 2) ++raw_counts_of_count[count];
        if (continuation >= 1 && continuation <= 2) ++continuation_counts_of_count[continuation];
      }
      level.raw_discount = kneser_ney_discount(raw_counts_of_count[1], raw_counts_of_count[2]);
      level.continuation_discount =
          kneser_ney_discount(continuation_counts_of_count[1], continuation_counts_of_count[2]);
    }
  }

  std::size_t order_;
  std::vector<Level> levels_;
  std::vector<double> row_;
  std::vector<double> table_;  // order <= 2: every row with a one-byte history
  std::vector<token_id> joined_;
  std::vector<double> batch_;
};

static_assert(specdec::LanguageModel<KneserNeyModel>);
static_assert(specdec::BatchedLanguageModel<KneserNeyModel>);

}  // namespace specdec_demo
