// Tests for include/specdec/tree_verification.hpp (and the per-node residual in
// detail/tree_node_residual.hpp): exactness of tree verification analytically (every draw
// of every tree enumerated, to 1e-12) and statistically on the real code (chi-square at a
// 1e-9 false-failure rate), negative controls caught by both, proposal-only trees, greedy
// trees against plain greedy decoding, tree scoring fallbacks, edge cases and errors.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <Eigen/Core>

#include "specdec/detail/tree_node_residual.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/tree_verification.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::expansion;
using specdec::token_id;
using specdec::TreeShape;

// ---------------------------------------------------------------------------------------
// Toy models: rows are deterministic functions of the whole context.
// ---------------------------------------------------------------------------------------

std::uint64_t hash_context(std::span<const token_id> context, std::uint64_t salt) {
  std::uint64_t h = salt * 0x9e3779b97f4a7c15ULL + 0x1234567ULL;
  for (const token_id token : context) {
    specdec::splitmix64 mix(h ^ (static_cast<std::uint64_t>(token) + 1) * 0xbf58476d1ce4e5b9ULL);
    h = mix();
  }
  return h;
}

/// A random row (Dirichlet(1)-like weights), each entry zero with probability `zeros`.
std::vector<double> random_row(std::size_t vocab, std::uint64_t seed, double zeros) {
  specdec::splitmix64 g(seed);
  std::vector<double> row(vocab, 0.0);
  double total = 0.0;
  for (double& value : row) {
    const double keep = specdec::uniform01<double>(g);
    const double weight = 0.05 - std::log(1.0 - specdec::uniform01<double>(g));
    value = keep < zeros ? 0.0 : weight;
    total += value;
  }
  if (total == 0.0) {
    row[seed % vocab] = 1.0;
    total = 1.0;
  }
  for (double& value : row) value /= total;
  return row;
}

/// Families of (p, q) pairs, chosen per context.
enum class family : int { independent, close, identical, disjoint, peaked, mixed };
constexpr std::array<family, 6> all_families{family::independent, family::close,  family::identical,
                                             family::disjoint,    family::peaked, family::mixed};

struct RowPair {
  std::vector<double> target;
  std::vector<double> draft;
};

/// Temperature 1/2: p^2 renormalised (the test's stand-in for standardization).
template <class U, class T>
void sharpen_row(std::span<const U> raw, std::span<T> out) {
  double total = 0.0;
  for (const U value : raw) total += static_cast<double>(value) * static_cast<double>(value);
  for (std::size_t j = 0; j < raw.size(); ++j) {
    out[j] = static_cast<T>(static_cast<double>(raw[j]) * static_cast<double>(raw[j]) / total);
  }
}

RowPair make_rows(family kind, std::size_t vocab, std::span<const token_id> context, bool sharpen);

RowPair make_rows(family kind, std::size_t vocab, std::span<const token_id> context) {
  const std::uint64_t h = hash_context(context, 17);
  if (kind == family::mixed) kind = static_cast<family>(h % 5);
  RowPair rows;
  rows.target = random_row(vocab, h, 0.25);
  switch (kind) {
    case family::independent:
      rows.draft = random_row(vocab, h ^ 0xabcdefULL, 0.25);
      break;
    case family::close: {
      const std::vector<double> noise = random_row(vocab, h ^ 0x5151ULL, 0.0);
      rows.draft.resize(vocab);
      for (std::size_t j = 0; j < vocab; ++j) {
        rows.draft[j] = 0.75 * rows.target[j] + 0.25 * noise[j];
      }
      break;
    }
    case family::identical:
      rows.draft = rows.target;
      break;
    case family::disjoint: {
      // p on one parity of token ids, q on the other.
      const std::size_t parity = h % 2;
      rows.target = random_row(vocab, h ^ 0x77ULL, 0.0);
      rows.draft = random_row(vocab, h ^ 0x99ULL, 0.0);
      double target_total = 0.0;
      double draft_total = 0.0;
      for (std::size_t j = 0; j < vocab; ++j) {
        (j % 2 == parity ? rows.draft[j] : rows.target[j]) = 0.0;
        target_total += rows.target[j];
        draft_total += rows.draft[j];
      }
      for (std::size_t j = 0; j < vocab; ++j) {
        rows.target[j] /= target_total;
        rows.draft[j] /= draft_total;
      }
      break;
    }
    case family::peaked: {
      // A confident draft, often on a token the target dislikes.
      rows.draft = random_row(vocab, h ^ 0x3333ULL, 0.0);
      const std::size_t favourite = (h >> 8) % vocab;
      for (std::size_t j = 0; j < vocab; ++j) {
        rows.draft[j] = 0.1 * rows.draft[j] + (j == favourite ? 0.9 : 0.0);
      }
      break;
    }
    case family::mixed:
      break;
  }
  return rows;
}

RowPair make_rows(family kind, std::size_t vocab, std::span<const token_id> context, bool sharpen) {
  RowPair rows = make_rows(kind, vocab, context);
  if (sharpen) {
    sharpen_row(std::span<const double>(rows.target), std::span<double>(rows.target));
    sharpen_row(std::span<const double>(rows.draft), std::span<double>(rows.draft));
  }
  return rows;
}

/// A LanguageModel over make_rows (target or draft side), rows cached per context.
template <class T>
struct ToyModel {
  family kind = family::independent;
  std::size_t vocab = 4;
  bool is_target = true;
  std::size_t calls = 0;
  std::unordered_map<std::uint64_t, std::vector<T>> cache;

  [[nodiscard]] std::size_t vocab_size() const { return vocab; }
  std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    ++calls;
    return row(context);
  }
  std::span<const T> row(std::span<const token_id> context) {
    const std::uint64_t key = hash_context(context, 99);
    auto found = cache.find(key);
    if (found == cache.end()) {
      const RowPair rows = make_rows(kind, vocab, context);
      const std::vector<double>& source = is_target ? rows.target : rows.draft;
      found = cache.emplace(key, std::vector<T>(source.begin(), source.end())).first;
    }
    return found->second;
  }
};

/// The same target, scoring whole trees in one call.
template <class T>
struct ToyTreeModel : ToyModel<T> {
  std::size_t tree_calls = 0;
  std::vector<T> rows;
  std::vector<token_id> sequence;

  specdec::RowsView<const T> score_tree(std::span<const token_id> context,
                                        const specdec::TokenTreeView& tree) {
    ++tree_calls;
    rows.resize(tree.size() * this->vocab);
    for (std::size_t node = 0; node < tree.size(); ++node) {
      sequence.assign(context.begin(), context.end());
      tree.append_path(node, sequence);
      const auto row = this->row(sequence);
      std::copy(row.begin(), row.end(),
                rows.begin() + static_cast<std::ptrdiff_t>(node * this->vocab));
    }
    return {rows.data(), tree.size(), this->vocab};
  }
};

/// The same target with score_draft only (a BatchedLanguageModel).
template <class T>
struct ToyBatchedModel : ToyModel<T> {
  std::size_t draft_scoring_calls = 0;
  std::vector<T> rows;
  std::vector<token_id> sequence;

  specdec::RowsView<const T> score_draft(std::span<const token_id> context,
                                         std::span<const token_id> draft) {
    ++draft_scoring_calls;
    rows.resize((draft.size() + 1) * this->vocab);
    sequence.assign(context.begin(), context.end());
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const auto row = this->row(sequence);
      std::copy(row.begin(), row.end(),
                rows.begin() + static_cast<std::ptrdiff_t>(i * this->vocab));
      if (i < draft.size()) sequence.push_back(draft[i]);
    }
    return {rows.data(), draft.size() + 1, this->vocab};
  }
};

static_assert(specdec::TreeScoringModel<ToyTreeModel<float>>);
static_assert(!specdec::TreeScoringModel<ToyModel<float>>);
static_assert(specdec::BatchedLanguageModel<ToyBatchedModel<double>>);

// ---------------------------------------------------------------------------------------
// Exact laws by enumeration
// ---------------------------------------------------------------------------------------

std::size_t power(std::size_t base, std::size_t exponent) {
  std::size_t result = 1;
  for (std::size_t i = 0; i < exponent; ++i) result *= base;
  return result;
}

/// Deterministic one_hot candidates for the enumeration and the samplers: the top-k of q
/// (as build_top_k_tree) or hash-chosen tokens that may repeat or have p = 0.
enum class proposals : int { top_k, hashed };

std::vector<token_id> proposal_candidates(proposals how, std::span<const double> q,
                                          std::size_t wanted, std::span<const token_id> context) {
  std::vector<token_id> out;
  if (how == proposals::hashed) {
    std::uint64_t h = hash_context(context, 4242);
    for (std::size_t k = 0; k < wanted; ++k) {
      out.push_back(static_cast<token_id>(h % q.size()));
      h = specdec::splitmix64(h)();
    }
    return out;
  }
  std::vector<token_id> order;
  for (std::size_t j = 0; j < q.size(); ++j) {
    if (q[j] > 0.0) order.push_back(static_cast<token_id>(j));
  }
  std::stable_sort(order.begin(), order.end(), [&](token_id a, token_id b) {
    return q[static_cast<std::size_t>(a)] > q[static_cast<std::size_t>(b)];
  });
  order.resize(std::min(order.size(), wanted));
  return order;
}

/// Deliberate bugs for the negative controls.
struct Faults {
  bool keep_residual = false;         ///< forget to subtract q_i from the residual
  bool shared_uniform = false;        ///< reuse one uniform across siblings
  bool unnormalized_without = false;  ///< without replacement: q_i not renormalised
  [[nodiscard]] bool any() const { return keep_residual || shared_uniform || unnormalized_without; }
};

/// A straightforward reference of one node's residual, with optional bugs. Same interface
/// as detail::tree_node_residual.
class ReferenceNode {
 public:
  explicit ReferenceNode(Faults faults = {}) : faults_(faults) {}

  void start(std::span<const double> target, std::span<const double> draft, expansion kind) {
    target_.assign(target.begin(), target.end());
    draft_.assign(draft.begin(), draft.end());
    residual_ = target_;
    removed_.assign(target.size(), false);
    kind_ = kind;
    fallback_ = false;
  }
  [[nodiscard]] double probability(token_id x) const {
    return (fallback_ ? target_ : residual_)[static_cast<std::size_t>(x)];
  }
  [[nodiscard]] double draft_probability(token_id c) const {
    const auto j = static_cast<std::size_t>(c);
    if (kind_ == expansion::one_hot) return 1.0;
    if (kind_ == expansion::with_replacement) return draft_[j];
    if (removed_[j]) return 0.0;
    if (faults_.unnormalized_without) return draft_[j];
    double mass = 0.0;
    for (std::size_t x = 0; x < draft_.size(); ++x) mass += removed_[x] ? 0.0 : draft_[x];
    return draft_[j] / mass;
  }
  [[nodiscard]] double acceptance_probability(token_id c) const {
    const double r = probability(c);
    const double q = draft_probability(c);
    if (r <= 0.0) return 0.0;
    if (q <= 0.0) return 1.0;
    return std::min(1.0, r / q);
  }
  void reject(token_id c) {
    std::vector<double> q_i(target_.size(), 0.0);
    if (kind_ == expansion::one_hot) {
      q_i[static_cast<std::size_t>(c)] = 1.0;
    } else {
      for (std::size_t x = 0; x < q_i.size(); ++x) {
        q_i[x] = draft_probability(static_cast<token_id>(x));
      }
    }
    subtract(q_i);
    if (kind_ == expansion::without_replacement) removed_[static_cast<std::size_t>(c)] = true;
  }
  void reject_repeat() { subtract(draft_); }
  [[nodiscard]] bool fallback() const { return fallback_; }
  template <class G>
  token_id sample(G& g) const {
    return specdec::sample_from_row(std::span<const double>(fallback_ ? target_ : residual_), g);
  }

 private:
  void subtract(const std::vector<double>& q_i) {
    if (faults_.keep_residual) return;
    double mass = 0.0;
    for (std::size_t x = 0; x < q_i.size(); ++x) {
      residual_[x] = std::max(0.0, residual_[x] - q_i[x]);
      mass += residual_[x];
    }
    if (!(mass > 0.0)) {
      fallback_ = true;
      return;
    }
    for (double& value : residual_) value /= mass;
  }

  Faults faults_;
  std::vector<double> target_;
  std::vector<double> draft_;
  std::vector<double> residual_;
  std::vector<bool> removed_;
  expansion kind_ = expansion::none;
  bool fallback_ = false;
};

/// One enumeration setting: a shape, how children are proposed, the model family.
struct Setting {
  std::size_t vocab = 4;
  family kind = family::independent;
  TreeShape shape = TreeShape::chain(1);
  expansion sampling = expansion::without_replacement;  // or with_replacement / one_hot
  bool merge_repeats = true;
  proposals how = proposals::top_k;  // for one_hot
  std::vector<token_id> prompt{1, 0};
  bool sharpen = false;  ///< the law of rows after sharpen_row (enumeration only)
};

/// Exact output laws of a tree step followed by plain target sampling to a fixed length.
/// `Node` is detail::tree_node_residual<double> (the library) or ReferenceNode.
template <class Node>
class Enumerator {
 public:
  Enumerator(const Setting& setting, Faults faults = {}) : setting_(setting), faults_(faults) {}

  /// Law of the target's own autoregressive sampling of `length` tokens after `context`.
  const std::vector<double>& target_law(const std::vector<token_id>& context, std::size_t length) {
    const auto key = std::make_pair(context, length);
    if (auto found = target_memo_.find(key); found != target_memo_.end()) return found->second;
    std::vector<double> law(power(setting_.vocab, length), 0.0);
    if (length == 0) {
      law[0] = 1.0;
    } else {
      const std::vector<double> p =
          make_rows(setting_.kind, setting_.vocab, context, setting_.sharpen).target;
      const std::size_t block = power(setting_.vocab, length - 1);
      for (std::size_t x = 0; x < setting_.vocab; ++x) {
        if (p[x] == 0.0) continue;
        std::vector<token_id> next = context;
        next.push_back(static_cast<token_id>(x));
        const std::vector<double>& rest = target_law(next, length - 1);
        for (std::size_t i = 0; i < block; ++i) law[x * block + i] += p[x] * rest[i];
      }
    }
    return target_memo_.emplace(key, std::move(law)).first->second;
  }

  /// Law of the tokens emitted from shape node `shape_node` at `context`, continued by
  /// target sampling to `length` tokens, averaged over every draw of the subtree.
  const std::vector<double>& tree_law(const std::vector<token_id>& context, std::size_t shape_node,
                                      std::size_t length) {
    const auto key = std::make_pair(context, shape_node * 64 + length);
    if (auto found = tree_memo_.find(key); found != tree_memo_.end()) return found->second;
    std::vector<double> law(power(setting_.vocab, length), 0.0);
    const std::size_t wanted = setting_.shape.child_count(shape_node);
    if (wanted == 0) {
      law = target_law(context, length);  // bonus draw from p, then target sampling
    } else {
      const RowPair rows = make_rows(setting_.kind, setting_.vocab, context, setting_.sharpen);
      std::vector<token_id> drawn;
      for_each_draw(rows.draft, wanted, context, drawn, 1.0, [&](double weight) {
        node_law(context, shape_node, length, rows, drawn, weight, law);
      });
    }
    return tree_memo_.emplace(key, std::move(law)).first->second;
  }

  /// Largest absolute difference between the tree step's law and the target's.
  double max_deviation() {
    const std::size_t length = setting_.shape.max_depth() + 1;
    const std::vector<double>& expected = target_law(setting_.prompt, length);
    const std::vector<double>& actual = tree_law(setting_.prompt, 0, length);
    double worst = 0.0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      worst = std::max(worst, std::abs(expected[i] - actual[i]));
    }
    return worst;
  }
  double total_variation() {
    const std::size_t length = setting_.shape.max_depth() + 1;
    return specdec::testing::total_variation(target_law(setting_.prompt, length),
                                             tree_law(setting_.prompt, 0, length));
  }

 private:
  /// Calls `visit(weight)` for every sequence of draws at a node (in `drawn`).
  template <class Visit>
  void for_each_draw(const std::vector<double>& q, std::size_t wanted,
                     const std::vector<token_id>& context, std::vector<token_id>& drawn,
                     double weight, Visit&& visit) {
    if (setting_.sampling == expansion::one_hot) {
      drawn = proposal_candidates(setting_.how, q, wanted, context);
      visit(1.0);
      return;
    }
    if (drawn.size() == wanted) {
      visit(weight);
      return;
    }
    double remaining = 0.0;
    for (std::size_t x = 0; x < q.size(); ++x) {
      const bool taken =
          std::find(drawn.begin(), drawn.end(), static_cast<token_id>(x)) != drawn.end();
      if (setting_.sampling == expansion::with_replacement || !taken) remaining += q[x];
    }
    if (setting_.sampling == expansion::without_replacement && remaining <= 0.0) {
      visit(weight);  // support exhausted: fewer children
      return;
    }
    for (std::size_t x = 0; x < q.size(); ++x) {
      const auto token = static_cast<token_id>(x);
      if (q[x] == 0.0) continue;
      if (setting_.sampling == expansion::without_replacement &&
          std::find(drawn.begin(), drawn.end(), token) != drawn.end()) {
        continue;
      }
      const double probability =
          setting_.sampling == expansion::with_replacement ? q[x] : q[x] / remaining;
      drawn.push_back(token);
      for_each_draw(q, wanted, context, drawn, weight * probability, visit);
      drawn.pop_back();
    }
  }

  /// Adds the law of one node with a fixed sequence of draws, weighted.
  void node_law(const std::vector<token_id>& context, std::size_t shape_node, std::size_t length,
                const RowPair& rows, const std::vector<token_id>& drawn, double weight,
                std::vector<double>& law) {
    const std::size_t vocab = setting_.vocab;
    const std::size_t block = power(vocab, length - 1);
    const auto shape_children = setting_.shape.children(shape_node);
    Node node = new_node();
    node.start(std::span<const double>(rows.target),
               setting_.sampling == expansion::one_hot ? std::span<const double>{}
                                                       : std::span<const double>(rows.draft),
               setting_.sampling);
    // P(reaching the next candidate): a product of rejection probabilities, or with one
    // shared uniform u, P(u >= largest acceptance probability so far).
    double reach = 1.0;
    double shared_lower = 0.0;
    std::size_t child_index = 0;
    for (std::size_t i = 0; i < drawn.size(); ++i) {
      if (node.fallback()) break;
      const token_id candidate = drawn[i];
      const bool repeat =
          setting_.sampling == expansion::with_replacement && setting_.merge_repeats &&
          std::find(drawn.begin(), drawn.begin() + static_cast<std::ptrdiff_t>(i), candidate) !=
              drawn.begin() + static_cast<std::ptrdiff_t>(i);
      if (repeat) {
        node.reject_repeat();
        continue;
      }
      const double acceptance = node.acceptance_probability(candidate);
      double accepted_mass = 0.0;
      if (faults_.shared_uniform) {
        accepted_mass = std::max(0.0, acceptance - shared_lower);
        shared_lower = std::max(shared_lower, acceptance);
        reach = 1.0 - shared_lower;
      } else {
        accepted_mass = reach * acceptance;
        reach *= 1.0 - acceptance;
      }
      // The k-th child node (a duplicate proposal or unmerged repeat is a node too) takes
      // the k-th shape child.
      const std::size_t shape_child = shape_children[child_index++];
      if (accepted_mass > 0.0) {
        std::vector<token_id> next = context;
        next.push_back(candidate);
        const std::vector<double>& rest = tree_law(next, shape_child, length - 1);
        const std::size_t base = static_cast<std::size_t>(candidate) * block;
        for (std::size_t j = 0; j < block; ++j) law[base + j] += weight * accepted_mass * rest[j];
      }
      node.reject(candidate);
    }
    for (std::size_t x = 0; x < vocab; ++x) {
      const double residual = node.probability(static_cast<token_id>(x));
      if (residual == 0.0 || reach == 0.0) continue;
      std::vector<token_id> next = context;
      next.push_back(static_cast<token_id>(x));
      const std::vector<double>& rest = target_law(next, length - 1);
      for (std::size_t j = 0; j < block; ++j)
        law[x * block + j] += weight * reach * residual * rest[j];
    }
  }

  Node new_node() const {
    if constexpr (std::is_same_v<Node, ReferenceNode>) {
      return Node(faults_);
    } else {
      return Node{};
    }
  }

  Setting setting_;
  Faults faults_;
  std::map<std::pair<std::vector<token_id>, std::size_t>, std::vector<double>> target_memo_;
  std::map<std::pair<std::vector<token_id>, std::size_t>, std::vector<double>> tree_memo_;
};

}  // namespace

namespace {

using RealEnumerator = Enumerator<specdec::detail::tree_node_residual<double>>;
using ReferenceEnumerator = Enumerator<ReferenceNode>;

/// Depth <= 2, branching <= 3 (the enumeration range).
std::vector<TreeShape> enumeration_shapes() {
  return {TreeShape::branching({1}),
          TreeShape::branching({2}),
          TreeShape::branching({3}),
          TreeShape::branching({1, 1}),
          TreeShape::branching({2, 1}),
          TreeShape::branching({1, 3}),
          TreeShape::branching({3, 2}),
          TreeShape::branching({2, 3}),
          TreeShape::branching({3, 3}),
          TreeShape::from_parents({TreeShape::npos, 0, 0, 1, 1, 1})};  // {2: 3, 0}
}

struct Mode {
  expansion sampling;
  bool merge_repeats;
  proposals how;
  const char* name;
};
constexpr std::array<Mode, 5> all_modes{{
    {expansion::with_replacement, true, proposals::top_k, "with replacement, repeats merged"},
    {expansion::with_replacement, false, proposals::top_k, "with replacement, duplicate nodes"},
    {expansion::without_replacement, true, proposals::top_k, "without replacement"},
    {expansion::one_hot, true, proposals::top_k, "one_hot top-k proposals"},
    {expansion::one_hot, true, proposals::hashed, "one_hot hashed proposals"},
}};

Setting make_setting(std::size_t vocab, family kind, const TreeShape& shape, const Mode& mode) {
  Setting setting;
  setting.vocab = vocab;
  setting.kind = kind;
  setting.shape = shape;
  setting.sampling = mode.sampling;
  setting.merge_repeats = mode.merge_repeats;
  setting.how = mode.how;
  return setting;
}

struct NegativeControl {
  const char* name;
  Setting setting;
  Faults faults;
};

/// Each bug of the issue in a setting where it shows (found by enumeration: a shared
/// uniform is nearly harmless with replacement, very visible without).
std::vector<NegativeControl> negative_controls() {
  Faults keep;
  keep.keep_residual = true;
  Faults shared;
  shared.shared_uniform = true;
  Faults unnormalized;
  unnormalized.unnormalized_without = true;
  return {
      {"residual not reduced by q_i",
       make_setting(4, family::independent, TreeShape::branching({3, 1}), all_modes[0]), keep},
      {"one uniform shared by siblings",
       make_setting(4, family::peaked, TreeShape::branching({3, 1}), all_modes[2]), shared},
      {"without replacement, q_i not renormalised",
       make_setting(4, family::independent, TreeShape::branching({3, 1}), all_modes[2]),
       unnormalized},
  };
}

}  // namespace

TEST_CASE("Enumeration: every tree step has exactly the target's law (V <= 5, depth <= 2)",
          "[tree_verification][analytic]") {
  std::size_t checked = 0;
  double worst = 0.0;
  for (const std::size_t vocab : {2U, 3U, 5U}) {
    for (const family kind : all_families) {
      for (const TreeShape& shape : enumeration_shapes()) {
        for (const Mode& mode : all_modes) {
          // V = 5 with 3 x 3 i.i.d. draws is the largest case; keep it to two families.
          if (vocab == 5 && shape.draft_size() > 6 && kind != family::mixed &&
              kind != family::independent) {
            continue;
          }
          const Setting setting = make_setting(vocab, kind, shape, mode);
          RealEnumerator real(setting);
          const double deviation = real.max_deviation();
          INFO("V = " << vocab << ", family " << static_cast<int>(kind) << ", "
                      << shape.draft_size() << " nodes, " << mode.name);
          CHECK(deviation < 1e-12);
          worst = std::max(worst, deviation);
          ++checked;
        }
      }
    }
  }
  INFO("settings: " << checked << ", worst deviation " << worst);
  CHECK(checked > 500);
}

TEST_CASE("Enumeration: the reference matches, and each negative control is caught",
          "[tree_verification][analytic][negative]") {
  // The test-side reference (used for the statistical negative controls) is exact without
  // faults...
  for (const Mode& mode : all_modes) {
    const Setting setting = make_setting(4, family::mixed, TreeShape::branching({3, 2}), mode);
    ReferenceEnumerator reference(setting);
    INFO(mode.name);
    CHECK(reference.max_deviation() < 1e-12);
  }
  // ...and every fault moves the law far from the target's (the settings used by the
  // statistical negative controls below).
  for (const auto& control : negative_controls()) {
    const double tv = ReferenceEnumerator(control.setting, control.faults).total_variation();
    INFO(control.name << ": TV " << tv);
    CHECK(tv > 0.1);
  }
}

// ---------------------------------------------------------------------------------------
// Statistical tests on the real sampling code
// ---------------------------------------------------------------------------------------

namespace {

/// A one_hot tree of hashed proposals (duplicates kept as nodes), built breadth-first.
template <class T>
void build_hashed_tree(const Setting& setting, std::span<const token_id> prompt,
                       specdec::DraftTree<T>& tree) {
  tree.reset(setting.vocab);
  std::vector<std::size_t> shape_of{0};
  std::vector<token_id> context;
  const std::vector<double> width(setting.vocab, 0.0);
  for (std::size_t node = 0; node < tree.size(); ++node) {
    const auto children = setting.shape.children(shape_of[node]);
    if (children.empty()) continue;
    context.assign(prompt.begin(), prompt.end());
    tree.append_path(node, context);
    tree.expand(node, expansion::one_hot);
    const auto candidates = proposal_candidates(proposals::hashed, width, children.size(), context);
    for (std::size_t k = 0; k < candidates.size(); ++k) {
      (void)tree.add_child(node, candidates[k]);
      shape_of.push_back(children[k]);
    }
  }
}

/// The test-side verifier with optional faults (ReferenceNode), over a real tree.
template <class T, class G>
void reference_verify(const specdec::DraftTree<T>& tree, ToyModel<T>& target,
                      std::span<const token_id> prompt, const Faults& faults, G& g,
                      std::vector<token_id>& emitted) {
  constexpr std::size_t npos = specdec::DraftTree<T>::npos;
  std::size_t node = 0;
  std::vector<token_id> context;
  for (;;) {
    context.assign(prompt.begin(), prompt.end());
    tree.append_path(node, context);
    const auto row = target.row(context);
    const std::vector<double> p(row.begin(), row.end());
    if (tree.first_child(node) == npos) {
      tree.append_path(node, emitted);
      emitted.push_back(specdec::sample_from_row(std::span<const double>(p), g));
      return;
    }
    const auto stored = tree.draft_row(node);
    const std::vector<double> q(stored.begin(), stored.end());
    ReferenceNode reference(faults);
    reference.start(p, q, tree.expansion_of(node));
    const double shared_u = specdec::uniform01<double>(g);
    std::size_t accepted = npos;
    for (std::size_t child = tree.first_child(node); child != npos;
         child = tree.next_sibling(child)) {
      for (std::size_t k = tree.repeats_before(child); k > 0 && !reference.fallback(); --k) {
        reference.reject_repeat();
      }
      if (reference.fallback()) break;
      const double u = faults.shared_uniform ? shared_u : specdec::uniform01<double>(g);
      if (u < reference.acceptance_probability(tree.token(child))) {
        accepted = child;
        break;
      }
      reference.reject(tree.token(child));
      if (reference.fallback()) break;
    }
    if (accepted != npos) {
      node = accepted;
      continue;
    }
    for (std::size_t k = tree.trailing_repeats(node); k > 0 && !reference.fallback(); --k) {
      reference.reject_repeat();
    }
    tree.append_path(node, emitted);
    emitted.push_back(reference.sample(g));
    return;
  }
}

/// Counts the first max_depth + 1 tokens of `samples` tree steps (each continued by target
/// sampling) from the prompt: the real code, or the reference verifier when `faults` is set.
template <class T>
std::vector<std::uint64_t> sample_tree_steps(const Setting& setting, std::size_t samples,
                                             std::uint64_t seed, const Faults* faults = nullptr) {
  ToyTreeModel<T> target;
  target.kind = setting.kind;
  target.vocab = setting.vocab;
  ToyModel<T> draft;
  draft.kind = setting.kind;
  draft.vocab = setting.vocab;
  draft.is_target = false;
  specdec::TreeOptions options;
  options.shape = setting.shape;
  options.sampling = setting.sampling;
  options.merge_repeats = setting.merge_repeats;
  specdec::TreeStepWorkspace<T> workspace;
  specdec::DraftTree<T> tree(setting.vocab);
  specdec::DraftTreeOptions drafting;
  drafting.sampling = setting.sampling;
  drafting.merge_repeats = setting.merge_repeats;
  specdec::xoshiro256pp g(seed);
  const std::size_t length = setting.shape.max_depth() + 1;
  std::vector<std::uint64_t> counts(power(setting.vocab, length), 0);
  std::vector<token_id> sequence;
  const std::span<const token_id> prompt(setting.prompt);
  for (std::size_t i = 0; i < samples; ++i) {
    sequence.assign(prompt.begin(), prompt.end());
    const bool one_hot = setting.sampling == expansion::one_hot;
    if (one_hot) {
      if (setting.how == proposals::top_k) {
        (void)specdec::build_top_k_tree(draft, prompt, setting.shape, tree, workspace.drafting);
      } else {
        build_hashed_tree(setting, prompt, tree);
      }
    } else if (faults != nullptr) {
      (void)specdec::build_sampled_tree(draft, prompt, setting.shape, g, tree, workspace.drafting,
                                        drafting);
    }
    if (faults != nullptr) {
      reference_verify(tree, static_cast<ToyModel<T>&>(target), prompt, *faults, g, sequence);
    } else if (one_hot) {
      const auto step = specdec::verify_tree_step(target, prompt, tree, options, g, workspace);
      sequence.insert(sequence.end(), step.tokens.begin(), step.tokens.end());
    } else {
      const auto step = specdec::tree_step(target, draft, prompt, options, g, workspace);
      sequence.insert(sequence.end(), step.tokens.begin(), step.tokens.end());
    }
    while (sequence.size() < prompt.size() + length) {
      sequence.push_back(specdec::sample_from_row(target.row(sequence), g));
    }
    std::size_t index = 0;
    for (std::size_t k = 0; k < length; ++k) {
      index = index * setting.vocab + static_cast<std::size_t>(sequence[prompt.size() + k]);
    }
    ++counts[index];
  }
  return counts;
}

specdec::testing::ChiSquareResult fit_to_target(const Setting& setting,
                                                const std::vector<std::uint64_t>& counts) {
  RealEnumerator exact(setting);
  const std::vector<double>& law = exact.target_law(setting.prompt, setting.shape.max_depth() + 1);
  return specdec::testing::chi_square_test(counts, law);
}

std::vector<Setting> statistical_settings() {
  return {
      make_setting(4, family::mixed, TreeShape::branching({3, 2}), all_modes[2]),
      make_setting(4, family::independent, TreeShape::branching({3, 2}), all_modes[0]),
      make_setting(4, family::close, TreeShape::branching({2, 2}), all_modes[1]),
      make_setting(4, family::peaked, TreeShape::branching({3, 1}), all_modes[3]),
      make_setting(4, family::mixed, TreeShape::branching({2, 2}), all_modes[4]),
      make_setting(4, family::disjoint, TreeShape::branching({3, 1}), all_modes[2]),
      make_setting(4, family::identical, TreeShape::branching({2, 1}), all_modes[0]),
      make_setting(4, family::peaked, TreeShape::chain(2), all_modes[2]),  // Algorithm 1
  };
}

/// Samples per chi-square test: enough to catch a TV deviation of 0.03 over 64 outcomes.
std::size_t statistical_samples() {
  return specdec::testing::samples_to_detect(0.03, 63.0);
}

}  // namespace

TEMPLATE_TEST_CASE("Chi-square: real tree steps have the target's law",
                   "[tree_verification][statistical]", float, double) {
  std::uint64_t seed = std::is_same_v<TestType, float> ? 1000 : 1100;
  std::vector<Setting> settings = statistical_settings();
  // Float rows run the same code with rounding of 1e-7; half of the settings suffice.
  if (std::is_same_v<TestType, float>) settings.resize(settings.size() / 2);
  for (const Setting& setting : settings) {
    const auto counts = sample_tree_steps<TestType>(setting, statistical_samples(), ++seed);
    const auto fit = fit_to_target(setting, counts);
    INFO("family " << static_cast<int>(setting.kind) << ", " << setting.shape.draft_size()
                   << " nodes, " << specdec::to_string(setting.sampling) << ": " << fit.describe());
    CHECK(fit.passed());
  }
}

TEST_CASE("Chi-square: each negative control fails the same statistic",
          "[tree_verification][statistical][negative]") {
  // Every fault is at TV > 0.1 (checked by enumeration above): a smaller sample than the
  // real code's suffices to catch it; the faultless reference passes at the same size.
  const std::size_t samples = specdec::testing::samples_to_detect(0.05, 63.0);
  std::uint64_t seed = 2000;
  for (const auto& control : negative_controls()) {
    const Faults none;
    const auto sane = sample_tree_steps<double>(control.setting, samples, ++seed, &none);
    const auto sane_fit = fit_to_target(control.setting, sane);
    const auto broken =
        sample_tree_steps<double>(control.setting, samples, ++seed, &control.faults);
    const auto broken_fit = fit_to_target(control.setting, broken);
    INFO(control.name << ": reference " << sane_fit.describe() << "; broken "
                      << broken_fit.describe());
    CHECK(sane_fit.passed());
    CHECK_FALSE(broken_fit.passed());
  }
}

// ---------------------------------------------------------------------------------------
// Proposal-only trees
// ---------------------------------------------------------------------------------------

namespace {

/// Exact law of verifying one fixed one_hot tree (no draws to enumerate), continued by
/// target sampling to `length` tokens, using the library's node residual.
class FixedTreeLaw {
 public:
  FixedTreeLaw(const specdec::DraftTree<double>& tree, const Setting& setting)
      : tree_(tree), targets_(setting) {}

  std::vector<double> law(const std::vector<token_id>& context, std::size_t node,
                          std::size_t length) {
    const std::size_t vocab = tree_.vocab_size();
    const std::size_t block = power(vocab, length - 1);
    std::vector<double> out(power(vocab, length), 0.0);
    const RowPair rows = make_rows(family_, vocab, context);
    if (tree_.first_child(node) == specdec::DraftTree<double>::npos) {
      return targets_.target_law(context, length);
    }
    specdec::detail::tree_node_residual<double> residual;
    residual.start(rows.target, {}, expansion::one_hot);
    double reach = 1.0;
    for (std::size_t child = tree_.first_child(node); child != specdec::DraftTree<double>::npos;
         child = tree_.next_sibling(child)) {
      const token_id token = tree_.token(child);
      const double accepted = reach * residual.acceptance_probability(token);
      reach -= accepted;
      if (accepted > 0.0) {
        std::vector<token_id> next = context;
        next.push_back(token);
        const std::vector<double> rest = law(next, child, length - 1);
        for (std::size_t j = 0; j < block; ++j) {
          out[static_cast<std::size_t>(token) * block + j] += accepted * rest[j];
        }
      }
      residual.reject(token);
      if (residual.fallback()) break;  // only when nothing is left to reach (reach == 0)
    }
    for (std::size_t x = 0; x < vocab; ++x) {
      const double r = residual.probability(static_cast<token_id>(x));
      if (r == 0.0) continue;
      std::vector<token_id> next = context;
      next.push_back(static_cast<token_id>(x));
      const std::vector<double>& rest = targets_.target_law(next, length - 1);
      for (std::size_t j = 0; j < block; ++j) out[x * block + j] += reach * r * rest[j];
    }
    return out;
  }

 private:
  const specdec::DraftTree<double>& tree_;
  RealEnumerator targets_;
  family family_ = family::independent;
};

}  // namespace

TEST_CASE("Proposal-only trees (n-gram continuations in a trie) are exact",
          "[tree_verification][proposals]") {
  Setting setting = make_setting(4, family::independent, TreeShape::chain(3), all_modes[3]);
  // Continuations sharing prefixes, including tokens the target may give p = 0.
  const std::vector<std::vector<token_id>> continuations{{2, 1, 3}, {2, 1, 0}, {2, 3},
                                                         {0, 0, 0}, {3},       {1, 2}};
  specdec::DraftTree<double> tree(setting.vocab);
  for (const auto& continuation : continuations) (void)tree.insert_path(continuation);
  REQUIRE(tree.max_depth() == 3);
  const std::size_t length = 4;

  RealEnumerator targets(setting);
  FixedTreeLaw exact(tree, setting);
  const std::vector<double> law = exact.law(setting.prompt, 0, length);
  const std::vector<double>& expected = targets.target_law(setting.prompt, length);
  double worst = 0.0;
  for (std::size_t i = 0; i < law.size(); ++i)
    worst = std::max(worst, std::abs(law[i] - expected[i]));
  CHECK(worst < 1e-12);

  // The real verify_tree_step, and the dropped-residual bug, against the same chi-square.
  ToyTreeModel<double> target;
  target.vocab = setting.vocab;
  specdec::TreeStepWorkspace<double> workspace;
  specdec::TreeOptions options;
  const std::size_t samples = specdec::testing::samples_to_detect(0.05, 255.0);
  const auto run = [&](const Faults* faults, std::uint64_t seed) {
    specdec::xoshiro256pp g(seed);
    std::vector<std::uint64_t> counts(expected.size(), 0);
    std::vector<token_id> sequence;
    for (std::size_t i = 0; i < samples; ++i) {
      sequence = setting.prompt;
      if (faults == nullptr) {
        const auto step =
            specdec::verify_tree_step(target, setting.prompt, tree, options, g, workspace);
        sequence.insert(sequence.end(), step.tokens.begin(), step.tokens.end());
      } else {
        reference_verify(tree, static_cast<ToyModel<double>&>(target), setting.prompt, *faults, g,
                         sequence);
      }
      while (sequence.size() < setting.prompt.size() + length) {
        sequence.push_back(specdec::sample_from_row(target.row(sequence), g));
      }
      std::size_t index = 0;
      for (std::size_t k = 0; k < length; ++k) {
        index =
            index * setting.vocab + static_cast<std::size_t>(sequence[setting.prompt.size() + k]);
      }
      ++counts[index];
    }
    return specdec::testing::chi_square_test(counts, expected);
  };
  const auto fit = run(nullptr, 31);
  INFO(fit.describe());
  CHECK(fit.passed());
  Faults keep;
  keep.keep_residual = true;  // accept with p(c) but never drop c from r
  const auto broken = run(&keep, 32);
  INFO(broken.describe());
  CHECK_FALSE(broken.passed());
}

// ---------------------------------------------------------------------------------------
// Greedy trees
// ---------------------------------------------------------------------------------------

namespace {

template <class T>
std::vector<token_id> plain_greedy(ToyModel<T>& target, std::vector<token_id> context,
                                   std::size_t count) {
  std::vector<token_id> out;
  for (std::size_t i = 0; i < count; ++i) {
    const token_id next = specdec::argmax(target.row(context));
    out.push_back(next);
    context.push_back(next);
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("Greedy tree decoding equals plain greedy decoding",
                   "[tree_verification][greedy]", float, double) {
  const std::vector<TreeShape> shapes{TreeShape::chain(3), TreeShape::branching({3, 2}),
                                      TreeShape::branching({2, 2, 2}),
                                      TreeShape::from_parents({TreeShape::npos, 0, 0, 1, 3, 2})};
  for (const family kind : {family::independent, family::close, family::identical}) {
    for (const TreeShape& shape : shapes) {
      ToyTreeModel<TestType> target;
      target.kind = kind;
      target.vocab = 8;
      ToyModel<TestType> draft;
      draft.kind = kind;
      draft.vocab = 8;
      draft.is_target = false;
      const std::vector<token_id> prompt{3, 1, 4};
      specdec::TreeGenerationOptions options;
      options.max_new_tokens = 60;
      options.tree.shape = shape;
      options.tree.greedy = true;
      specdec::xoshiro256pp g(5);
      const auto generation = specdec::generate_with_tree(target, draft, prompt, options, g);
      const auto expected = plain_greedy<TestType>(target, prompt, 60);
      INFO("family " << static_cast<int>(kind) << ", " << shape.draft_size() << " nodes");
      CHECK(generation.tokens == expected);
      CHECK(generation.statistics.target_calls == generation.statistics.steps);
      if (kind == family::identical) {
        CHECK(generation.statistics.mean_accepted_depth() ==
              static_cast<double>(shape.max_depth()));
      }
    }
  }
}

TEST_CASE("Greedy verification of any tree follows the target argmax, lowest id on ties",
          "[tree_verification][greedy]") {
  // Root row ties tokens 0 and 1: the child with token 0 must be followed even though
  // token 1 comes first among the children.
  specdec::DraftTree<double> tree(3);
  tree.expand(0, expansion::one_hot);
  const std::size_t first = tree.add_child(0, 1);
  const std::size_t second = tree.add_child(0, 0);
  (void)first;
  const std::vector<double> rows{0.4, 0.4, 0.2,   // root
                                 1.0, 0.0, 0.0,   // after token 1
                                 0.1, 0.2, 0.7};  // after token 0
  const specdec::RowsView<const double> view(rows.data(), 3, 3);
  const auto result = specdec::verify_tree_greedy(tree, view);
  CHECK(result.node == second);
  CHECK(result.accepted == 1);
  CHECK(result.token == 2);
  CHECK(result.source == specdec::token_source::bonus);

  // Sampled trees verified greedily emit the greedy continuation.
  ToyTreeModel<double> target;
  target.vocab = 5;
  ToyModel<double> draft;
  draft.vocab = 5;
  draft.is_target = false;
  specdec::TreeStepWorkspace<double> workspace;
  specdec::xoshiro256pp g(8);
  const std::vector<token_id> prompt{2};
  const auto expected = plain_greedy<double>(target, prompt, 4);
  specdec::TreeOptions options;
  options.greedy = true;
  for (int round = 0; round < 100; ++round) {
    (void)specdec::build_sampled_tree(draft, prompt, TreeShape::branching({3, 2, 1}), g,
                                      workspace.tree, workspace.drafting);
    const auto step =
        specdec::verify_tree_step(target, prompt, workspace.tree, options, g, workspace);
    const std::vector<token_id> emitted(step.tokens.begin(), step.tokens.end());
    CHECK(emitted ==
          std::vector<token_id>(expected.begin(),
                                expected.begin() + static_cast<std::ptrdiff_t>(emitted.size())));
  }
}

// ---------------------------------------------------------------------------------------
// Scoring
// ---------------------------------------------------------------------------------------

namespace {

/// score_tree returning an Eigen matrix by value (the rows must be copied).
struct EigenTreeModel : ToyModel<double> {
  using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Matrix score_tree(std::span<const token_id> context, const specdec::TokenTreeView& tree) {
    Matrix rows(static_cast<Eigen::Index>(tree.size()), static_cast<Eigen::Index>(vocab));
    std::vector<token_id> sequence;
    for (std::size_t node = 0; node < tree.size(); ++node) {
      sequence.assign(context.begin(), context.end());
      tree.append_path(node, sequence);
      const auto row = this->row(sequence);
      for (std::size_t j = 0; j < vocab; ++j) {
        rows(static_cast<Eigen::Index>(node), static_cast<Eigen::Index>(j)) = row[j];
      }
    }
    return rows;
  }
};
static_assert(specdec::TreeScoringModel<EigenTreeModel>);

}  // namespace

TEST_CASE("Scoring: score_tree, score_draft per path and per-node calls agree",
          "[tree_verification][scoring]") {
  ToyModel<double> draft;
  draft.vocab = 5;
  draft.is_target = false;
  specdec::DraftTree<double> tree(5);
  specdec::DraftTreeWorkspace<double> drafting;
  specdec::xoshiro256pp g(3);
  const std::vector<token_id> context{4, 4};
  (void)specdec::build_sampled_tree(draft, context, TreeShape::branching({3, 2}), g, tree,
                                    drafting);
  std::size_t leaves = 0;
  for (std::size_t node = 0; node < tree.size(); ++node) leaves += tree.child_count(node) == 0;

  ToyTreeModel<double> tree_model;
  tree_model.vocab = 5;
  ToyBatchedModel<double> batched;
  batched.vocab = 5;
  ToyModel<double> plain;
  plain.vocab = 5;
  EigenTreeModel eigen;
  eigen.vocab = 5;
  ToyTreeModel<float> float_model;  // rows converted to double
  float_model.vocab = 5;

  specdec::TreeScoringWorkspace<double> w1;
  specdec::TreeScoringWorkspace<double> w2;
  specdec::TreeScoringWorkspace<double> w3;
  specdec::TreeScoringWorkspace<double> w4;
  specdec::TreeScoringWorkspace<double> w5;
  const auto by_tree = specdec::score_tree_rows(tree_model, context, tree.view(), 5, w1);
  const auto by_path = specdec::score_tree_rows(batched, context, tree.view(), 5, w2);
  const auto by_node = specdec::score_tree_rows(plain, context, tree.view(), 5, w3);
  const auto by_eigen = specdec::score_tree_rows(eigen, context, tree.view(), 5, w4);
  const auto by_float = specdec::score_tree_rows(float_model, context, tree.view(), 5, w5);
  CHECK(by_tree.target_calls == 1);
  CHECK(tree_model.tree_calls == 1);
  CHECK(by_tree.rows.data() == tree_model.rows.data());  // a view, no copy
  CHECK(by_path.target_calls == leaves);
  CHECK(batched.draft_scoring_calls == leaves);
  CHECK(by_node.target_calls == tree.size());
  CHECK(by_eigen.target_calls == 1);
  CHECK(by_eigen.rows.data() == w4.rows.data());  // copied out of the temporary
  for (std::size_t node = 0; node < tree.size(); ++node) {
    for (std::size_t j = 0; j < 5; ++j) {
      CHECK(by_path.rows(node, j) == by_tree.rows(node, j));
      CHECK(by_node.rows(node, j) == by_tree.rows(node, j));
      CHECK(by_eigen.rows(node, j) == by_tree.rows(node, j));
      CHECK(by_float.rows(node, j) ==
            static_cast<double>(static_cast<float>(by_tree.rows(node, j))));
    }
  }

  // Same rows, same seed: the same verification whichever way the rows were scored.
  specdec::TreeStepWorkspace<double> s1;
  specdec::TreeStepWorkspace<double> s2;
  const specdec::TreeOptions options;
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    specdec::xoshiro256pp g1(seed);
    specdec::xoshiro256pp g2(seed);
    const auto a = specdec::verify_tree_step(tree_model, context, tree, options, g1, s1);
    const auto b = specdec::verify_tree_step(plain, context, tree, options, g2, s2);
    CHECK(a.verification == b.verification);
  }
}

// ---------------------------------------------------------------------------------------
// Edge cases of the node residual
// ---------------------------------------------------------------------------------------

TEST_CASE("Node residual: rejected tokens, repeats, q_i(c) = 0 and zero residual mass",
          "[tree_verification][edge]") {
  const std::vector<double> p{0.1, 0.2, 0.3, 0.4};
  const std::vector<double> q{0.5, 0.3, 0.2, 0.0};
  specdec::detail::tree_node_residual<double> residual;

  SECTION("a rejected token has residual 0, so a repeat is never accepted") {
    residual.start(p, q, expansion::with_replacement);
    CHECK(residual.acceptance_probability(0) == 0.1 / 0.5);
    residual.reject(0);
    CHECK(residual.probability(0) == 0.0);
    CHECK(residual.acceptance_probability(0) == 0.0);
    // norm(max(0, p - q)) = (0, 0, 0.1, 0.4) / 0.5
    CHECK(std::abs(residual.probability(2) - 0.2) < 1e-15);
    CHECK(std::abs(residual.probability(3) - 0.8) < 1e-15);
    residual.reject_repeat();  // max(0, r - q) = (0, 0, 0, 0.8) -> (0, 0, 0, 1)
    CHECK(residual.probability(3) == 1.0);
    CHECK(residual.acceptance_probability(0) == 0.0);
    CHECK_FALSE(residual.fallback());
  }
  SECTION("q_i(c) = 0 < r(c) accepts; r(c) = 0 rejects") {
    residual.start(p, q, expansion::with_replacement);
    CHECK(residual.acceptance_probability(3) == 1.0);
    const std::vector<double> p_zero{0.5, 0.5, 0.0, 0.0};
    residual.start(p_zero, q, expansion::with_replacement);
    CHECK(residual.acceptance_probability(2) == 0.0);
    CHECK(residual.acceptance_probability(3) == 0.0);
  }
  SECTION("without replacement, q_{i+1} is q without the rejected candidate, renormalised") {
    residual.start(p, q, expansion::without_replacement);
    CHECK(residual.draft_probability(1) == 0.3);
    residual.reject(0);
    CHECK(residual.draft_probability(0) == 0.0);
    CHECK(std::abs(residual.draft_probability(1) - 0.6) < 1e-15);
    CHECK(std::abs(residual.draft_probability(2) - 0.4) < 1e-15);
  }
  SECTION("one_hot: accept with r(c), then drop c from r") {
    residual.start(p, {}, expansion::one_hot);
    CHECK(residual.acceptance_probability(3) == 0.4);
    residual.reject(3);
    CHECK(residual.probability(3) == 0.0);
    CHECK(std::abs(residual.probability(2) - 0.5) < 1e-15);
    residual.reject(3);  // a duplicate proposal changes nothing
    CHECK(std::abs(residual.probability(2) - 0.5) < 1e-15);
  }
  SECTION("zero residual mass falls back to p") {
    residual.start(p, p, expansion::with_replacement);
    CHECK(residual.acceptance_probability(1) == 1.0);
    residual.reject(1);  // impossible in exact arithmetic: max(0, p - p) = 0
    CHECK(residual.fallback());
    CHECK(residual.probability(3) == 0.4);
  }
}

TEST_CASE("verify_tree reports the zero-mass fallback and draws from p",
          "[tree_verification][edge]") {
  // q = p at the root and a candidate with q = 0 = p (a tree that was not drawn from q):
  // it is rejected and the residual max(0, p - q) is empty.
  const std::vector<double> p{0.0, 0.25, 0.75};
  specdec::DraftTree<double> tree(3);
  tree.expand(0, expansion::with_replacement, p);
  (void)tree.add_child(0, 0);
  const std::vector<double> rows{0.0, 0.25, 0.75, 0.3, 0.3, 0.4};
  const specdec::RowsView<const double> view(rows.data(), 2, 3);
  specdec::xoshiro256pp g(4);
  specdec::TreeVerificationWorkspace<double> workspace;
  std::array<std::uint64_t, 3> counts{};
  for (int i = 0; i < 4000; ++i) {
    const auto result = specdec::verify_tree(tree, view, g, workspace);
    CHECK(result.residual_fallback);
    CHECK(result.source == specdec::token_source::correction);
    CHECK(result.accepted == 0);
    ++counts[static_cast<std::size_t>(result.token)];
  }
  CHECK(counts[0] == 0);
  const std::array<double, 3> law{0.0, 0.25, 0.75};
  const auto fit = specdec::testing::chi_square_test(counts, law);
  INFO(fit.describe());
  CHECK(fit.passed());
  // The checked entry point refuses such a tree.
  CHECK_THROWS_WITH(specdec::verify_tree_checked(tree, view, g, workspace, 3),
                    Catch::Matchers::ContainsSubstring("draft node 1 (step 3): token 0 has q = 0"));
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

TEST_CASE("Checked entry points name what is wrong and where", "[tree_verification][errors]") {
  specdec::DraftTree<double> tree(3);
  tree.expand(0, expansion::without_replacement, std::vector<double>{0.5, 0.25, 0.25});
  (void)tree.add_child(0, 1);
  (void)tree.add_child(0, 2);
  specdec::xoshiro256pp g(1);
  specdec::TreeVerificationWorkspace<double> workspace;
  std::vector<double> rows{0.2, 0.3, 0.5, 0.2, 0.3, 0.5, 0.2, 0.3, 0.5};

  const specdec::RowsView<const double> good(rows.data(), 3, 3);
  CHECK_NOTHROW(specdec::verify_tree_checked(tree, good, g, workspace));
  CHECK_THROWS_WITH(specdec::verify_tree_checked(
                        tree, specdec::RowsView<const double>(rows.data(), 2, 3), g, workspace),
                    Catch::Matchers::ContainsSubstring("got 2 rows, expected 3"));
  CHECK_THROWS_WITH(
      specdec::verify_tree_greedy_checked(tree, specdec::RowsView<const double>(rows.data(), 2, 4)),
      Catch::Matchers::ContainsSubstring("vocabulary size is 3"));
  rows[7] = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH(
      specdec::verify_tree_checked(tree, good, g, workspace, 9),
      Catch::Matchers::ContainsSubstring("target row 2 (step 9): entry for token 1 is NaN"));
  rows[7] = 0.3;

  specdec::DraftTree<double> duplicated(3);
  duplicated.expand(0, expansion::without_replacement, std::vector<double>{0.5, 0.25, 0.25});
  (void)duplicated.add_child(0, 1);
  (void)duplicated.add_child(0, 1);
  CHECK_THROWS_WITH(specdec::verify_tree_checked(duplicated, good, g, workspace),
                    Catch::Matchers::ContainsSubstring("repeats sibling 1"));

  // Models: vocabulary mismatch and a wrong number of scored rows.
  ToyTreeModel<double> target;
  target.vocab = 3;
  ToyModel<double> draft;
  draft.vocab = 4;
  specdec::TreeStepWorkspace<double> step_workspace;
  const std::vector<token_id> context{0};
  try {
    (void)specdec::tree_step(target, draft, context, specdec::TreeOptions{}, g, step_workspace);
    FAIL("expected a vocab_mismatch error");
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::vocab_mismatch);
  }
  struct ShortScorer : ToyModel<double> {
    std::vector<double> rows = std::vector<double>(3, 1.0 / 3.0);
    specdec::RowsView<const double> score_tree(std::span<const token_id>,
                                               const specdec::TokenTreeView&) {
      return {rows.data(), 1, 3};
    }
  } short_scorer;
  short_scorer.vocab = 3;
  CHECK_THROWS_WITH(
      specdec::verify_tree_step(short_scorer, context, tree, specdec::TreeOptions{}, g,
                                step_workspace, 4),
      Catch::Matchers::ContainsSubstring("target rows (step 4): score_tree returned 1 x 3"));
}

// ---------------------------------------------------------------------------------------
// The generation loop
// ---------------------------------------------------------------------------------------

namespace {

/// Records the context of every score_tree call (a KV-cached model would keep exactly the
/// cache of that context between calls).
struct RecordingTreeModel : ToyTreeModel<double> {
  std::vector<std::vector<token_id>> contexts;
  specdec::RowsView<const double> score_tree(std::span<const token_id> context,
                                             const specdec::TokenTreeView& tree) {
    contexts.emplace_back(context.begin(), context.end());
    return ToyTreeModel<double>::score_tree(context, tree);
  }
};

}  // namespace

TEST_CASE("generate_with_tree: limits, stop tokens, statistics, accepted contexts",
          "[tree_verification][generate]") {
  RecordingTreeModel target;
  target.kind = family::close;
  target.vocab = 6;
  ToyModel<double> draft;
  draft.kind = family::close;
  draft.vocab = 6;
  draft.is_target = false;
  const std::vector<token_id> prompt{1, 2, 3};
  specdec::TreeGenerationOptions options;
  options.max_new_tokens = 37;
  options.tree.shape = TreeShape::branching({3, 2, 1});
  specdec::xoshiro256pp g(12);
  const auto generation = specdec::generate_with_tree(target, draft, prompt, options, g);
  CHECK(generation.tokens.size() == 37);
  CHECK_FALSE(generation.stopped);

  const auto& stats = generation.statistics;
  CHECK(stats.target_calls == stats.steps);
  CHECK(target.contexts.size() == stats.steps);
  CHECK(stats.emitted_tokens == stats.accepted_tokens + stats.steps);
  CHECK(stats.emitted_tokens >= 37);
  CHECK(stats.nodes_scored <= stats.steps * options.tree.shape.draft_size());
  std::size_t steps = 0;
  std::size_t accepted = 0;
  for (std::size_t n = 0; n < stats.accepted_depth_histogram.size(); ++n) {
    steps += stats.accepted_depth_histogram[n];
    accepted += n * stats.accepted_depth_histogram[n];
  }
  CHECK(steps == stats.steps);
  CHECK(accepted == stats.accepted_tokens);
  CHECK(stats.accepted_depth_histogram.size() <= 4);
  CHECK(stats.tokens_per_target_call() == stats.tokens_per_step());

  // Every call saw exactly the accepted context so far: prompt + a prefix of the output.
  std::vector<token_id> full = prompt;
  full.insert(full.end(), generation.tokens.begin(), generation.tokens.end());
  std::size_t previous = 0;
  for (const auto& context : target.contexts) {
    CHECK(context.size() > previous);
    previous = context.size();
    REQUIRE(context.size() <= full.size());
    CHECK(std::equal(context.begin(), context.end(), full.begin()));
  }

  // Same seed, same tokens.
  specdec::xoshiro256pp again(12);
  CHECK(specdec::generate_with_tree(target, draft, prompt, options, again).tokens ==
        generation.tokens);

  // Stop tokens end generation right after the first one emitted.
  specdec::TreeGenerationOptions stopping = options;
  stopping.max_new_tokens = 500;
  stopping.stop_tokens = {generation.tokens[10]};
  specdec::xoshiro256pp third(12);
  const auto stopped = specdec::generate_with_tree(target, draft, prompt, stopping, third);
  CHECK(stopped.stopped);
  REQUIRE_FALSE(stopped.tokens.empty());
  CHECK(stopped.tokens.back() == generation.tokens[10]);
  CHECK(std::count(stopped.tokens.begin(), stopped.tokens.end(), generation.tokens[10]) == 1);
  CHECK(stopped.tokens.size() <= 11);
}

TEST_CASE("tree_step applies the row transform to both sides: the transformed target's law",
          "[tree_verification][statistical]") {
  Setting setting = make_setting(4, family::close, TreeShape::branching({3, 2}), all_modes[2]);
  setting.sharpen = true;
  RealEnumerator exact(setting);
  CHECK(exact.max_deviation() < 1e-12);
  const std::vector<double>& sharpened = exact.target_law(setting.prompt, 3);
  Setting raw_setting = setting;
  raw_setting.sharpen = false;
  RealEnumerator raw_exact(raw_setting);
  const std::vector<double>& raw_law = raw_exact.target_law(setting.prompt, 3);
  REQUIRE(specdec::testing::total_variation(sharpened, raw_law) > 0.1);

  ToyTreeModel<double> target;
  target.kind = setting.kind;
  ToyModel<double> draft;
  draft.kind = setting.kind;
  draft.is_target = false;
  specdec::TreeOptions options;
  options.shape = setting.shape;
  specdec::TreeStepWorkspace<double> workspace;
  const auto sharpen = [](auto raw, auto out) { sharpen_row(raw, out); };
  const std::size_t samples = specdec::testing::samples_to_detect(0.05, 63.0);
  const auto run = [&](bool transform, std::uint64_t seed) {
    specdec::xoshiro256pp g(seed);
    std::vector<std::uint64_t> counts(64, 0);
    std::vector<token_id> sequence;
    std::vector<double> row(4);
    for (std::size_t i = 0; i < samples; ++i) {
      sequence = setting.prompt;
      const auto step =
          transform ? specdec::tree_step(target, draft, setting.prompt, options, g, workspace,
                                         specdec::RowLocation::npos, sharpen)
                    : specdec::tree_step(target, draft, setting.prompt, options, g, workspace);
      sequence.insert(sequence.end(), step.tokens.begin(), step.tokens.end());
      while (sequence.size() < setting.prompt.size() + 3) {
        sharpen_row(target.row(sequence), std::span<double>(row));
        sequence.push_back(specdec::sample_from_row(std::span<const double>(row), g));
      }
      std::size_t index = 0;
      for (std::size_t k = 0; k < 3; ++k) {
        index = index * 4 + static_cast<std::size_t>(sequence[setting.prompt.size() + k]);
      }
      ++counts[index];
    }
    return specdec::testing::chi_square_test(counts, sharpened);
  };
  const auto fit = run(true, 77);
  INFO(fit.describe());
  CHECK(fit.passed());
  const auto untransformed = run(false, 78);  // negative control: raw rows in the tree step
  INFO(untransformed.describe());
  CHECK_FALSE(untransformed.passed());
}

// ---------------------------------------------------------------------------------------
// No allocation in the steady state
// ---------------------------------------------------------------------------------------

namespace {
std::size_t allocations = 0;
bool counting_allocations = false;
}  // namespace

// noinline keeps GCC from pairing the inlined malloc/free with new/delete expressions.
[[gnu::noinline]] void* operator new(std::size_t size) {
  if (counting_allocations) ++allocations;
  if (void* memory = std::malloc(size == 0 ? 1 : size)) return memory;
  throw std::bad_alloc();
}
[[gnu::noinline]] void* operator new(std::size_t size, const std::nothrow_t& /*tag*/) noexcept {
  if (counting_allocations) ++allocations;
  return std::malloc(size == 0 ? 1 : size);
}
[[gnu::noinline]] void operator delete(void* memory) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete(void* memory, const std::nothrow_t& /*tag*/) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete(void* memory, std::size_t /*size*/) noexcept {
  std::free(memory);
}

TEST_CASE("A warm tree step allocates nothing", "[tree_verification][allocation]") {
  for (const expansion sampling : {expansion::with_replacement, expansion::without_replacement}) {
    ToyTreeModel<float> target;
    target.kind = family::mixed;
    ToyModel<float> draft;
    draft.kind = family::mixed;
    draft.is_target = false;
    specdec::TreeOptions options;
    options.shape = TreeShape::branching({3, 2});
    options.sampling = sampling;
    specdec::TreeStepWorkspace<float> workspace;
    specdec::xoshiro256pp g(9);
    const std::vector<token_id> context{2, 2};
    std::size_t emitted = 0;
    for (int i = 0; i < 500; ++i) {  // warm up: every context of the toy models is cached
      emitted += specdec::tree_step(target, draft, context, options, g, workspace).tokens.size();
    }
    allocations = 0;
    counting_allocations = true;
    ::operator delete(::operator new(16));  // the counter works
    const std::size_t baseline = allocations;
    for (int i = 0; i < 200; ++i) {
      emitted += specdec::tree_step(target, draft, context, options, g, workspace).tokens.size();
    }
    counting_allocations = false;
    CHECK(baseline == 1);
    CHECK(allocations == baseline);
    CHECK(emitted >= 700);
  }
}
