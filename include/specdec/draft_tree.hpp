// specdec — token trees of draft candidates (SpecInfer, Sequoia, EAGLE-2, Medusa trees) and
// the builders that draft them.
//
// A draft tree holds several candidates per position: node 0 is the root (the accepted
// context, no token); every other node is one draft token whose parent is the node before
// it on its path. A tree is verified in one target call (tree_verification.hpp) and emits
// the tokens of one accepted root-to-node path plus one target-side token, exactly as if
// sampled from the target (SpecInfer's recursive rejection sampling, which reduces to the
// paper's Algorithm 1 for a chain).
//
// How the children of a node were proposed decides which draft distribution q_i enters the
// i-th acceptance ratio, so every expanded node records its `expansion`:
//  - with_replacement: children drawn i.i.d. from the node's q row. A draw that repeats an
//    earlier child is kept as a *repeat* (a count, not a node): it can never be accepted
//    (the residual of a rejected token is 0) but it still subtracts q from the residual,
//    which exactness requires. Storing it as a count saves a scored node;
//  - without_replacement: child i drawn from q with children 1..i-1 removed and the rest
//    renormalised (q_i); no duplicates;
//  - one_hot: deterministic candidates (proposal-only drafters such as n-gram
//    continuations), q_i = e_{c_i}.
// Exactness needs the children to be drawn from exactly the q_i the verifier uses: the
// builders here draw them from the q row they store in the tree. A hand-built tree must do
// the same (or use one_hot, which is exact for any candidate chosen without looking at the
// target). The number of children may depend on the draft tokens drawn before, never on p.
//
// Node order: parents come before children (parent(i) < i), so a model can score the nodes
// in index order with a tree-attention mask (see TokenTreeView).
//
// Proposal trees: a MultiProposalDrafter (n-gram tables, prompt lookup) offers several
// continuations of the context at once; build_proposal_tree inserts them as one_hot paths
// (a trie: equal prefixes share nodes), likeliest first, within a node budget.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/validation.hpp"

namespace specdec {

/// How the children of a tree node were proposed (which q_i enters each acceptance ratio).
enum class expansion : std::uint8_t {
  none,                 ///< not expanded: a leaf (no children)
  with_replacement,     ///< children drawn i.i.d. from the node's q row; repeats counted
  without_replacement,  ///< child i drawn from q without children 1..i-1, renormalised
  one_hot,              ///< deterministic candidates (proposal-only): q_i = e_{c_i}
};

/// "none", "with_replacement", "without_replacement" or "one_hot".
[[nodiscard]] constexpr std::string_view to_string(expansion kind) noexcept {
  switch (kind) {
    case expansion::none:
      return "none";
    case expansion::with_replacement:
      return "with_replacement";
    case expansion::without_replacement:
      return "without_replacement";
    case expansion::one_hot:
      return "one_hot";
  }
  return "unknown";
}

/// Largest number of nodes (root included) of a TreeShape or a DraftTree.
inline constexpr std::size_t max_tree_nodes = std::size_t{1} << 16;

/// The token id stored for the root, which stands for the context and has no token.
inline constexpr token_id no_token = -1;

// ---------------------------------------------------------------------------------------
// Tree shapes
// ---------------------------------------------------------------------------------------

/// The static shape a sampled tree is drafted in: how many candidates to draw at each
/// node, and the shape below the k-th child. Node 0 is the root; shape nodes are stored
/// parents first. A chain of gamma nodes is Algorithm 1's draft; `branching({4, 2, 1, 1})`
/// draws 4 children at the root, 2 under each of those, then single continuations.
/// When a node gets fewer distinct children than its shape allows (repeats drawn with
/// replacement, exhausted support without replacement), the k-th distinct child takes
/// the shape of the k-th shape child and the last shape children go unused.
class TreeShape {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  /// The root alone (no draft tokens).
  TreeShape() : TreeShape(std::vector<std::size_t>{npos}, 0) {}

  /// A chain of `gamma` draft tokens (Algorithm 1). Throws errc::invalid_option if the
  /// shape would exceed max_tree_nodes.
  [[nodiscard]] static TreeShape chain(std::size_t gamma) {
    check_node_count(gamma, "TreeShape::chain");
    std::vector<std::size_t> parents(gamma + 1);
    parents[0] = npos;
    for (std::size_t i = 1; i <= gamma; ++i) parents[i] = i - 1;
    return TreeShape(std::move(parents), 0);
  }

  /// Every node at depth d gets `per_depth[d]` children (d = 0 is the root); the tree has
  /// per_depth.size() levels of draft tokens. Throws errc::invalid_option for a zero
  /// entry or a shape exceeding max_tree_nodes.
  [[nodiscard]] static TreeShape branching(std::span<const std::size_t> per_depth) {
    std::vector<std::size_t> parents{npos};
    std::size_t level_first = 0;
    std::size_t level_size = 1;
    for (std::size_t d = 0; d < per_depth.size(); ++d) {
      if (per_depth[d] == 0) {
        detail::throw_error(errc::invalid_option, "TreeShape::branching: entry ", d, " (depth ", d,
                            ") is 0; every level needs at least one child");
      }
      if (per_depth[d] > max_tree_nodes ||
          level_size * per_depth[d] > max_tree_nodes - parents.size()) {
        detail::throw_error(errc::invalid_option, "TreeShape::branching: more than ",
                            max_tree_nodes, " nodes at depth ", d + 1);
      }
      const std::size_t next_first = parents.size();
      for (std::size_t node = level_first; node < level_first + level_size; ++node) {
        for (std::size_t k = 0; k < per_depth[d]; ++k) parents.push_back(node);
      }
      level_first = next_first;
      level_size = parents.size() - next_first;
    }
    return TreeShape(std::move(parents), 0);
  }
  [[nodiscard]] static TreeShape branching(std::initializer_list<std::size_t> per_depth) {
    return branching(std::span<const std::size_t>(per_depth.begin(), per_depth.size()));
  }

  /// Any shape given by the parent of each node: parents[0] == npos (the root) and
  /// parents[i] < i for i > 0. The children of a node are ordered by index. Throws
  /// errc::invalid_option naming the first bad entry.
  [[nodiscard]] static TreeShape from_parents(std::span<const std::size_t> parents) {
    if (parents.empty() || parents[0] != npos) {
      detail::throw_error(errc::invalid_option,
                          "TreeShape::from_parents: entry 0 must be npos (the root)");
    }
    check_node_count(parents.size() - 1, "TreeShape::from_parents");
    for (std::size_t i = 1; i < parents.size(); ++i) {
      if (parents[i] >= i) {
        detail::throw_error(errc::invalid_option, "TreeShape::from_parents: node ", i,
                            " has parent ", parents[i], "; parents must come first");
      }
    }
    return TreeShape(std::vector<std::size_t>(parents.begin(), parents.end()), 0);
  }
  [[nodiscard]] static TreeShape from_parents(std::initializer_list<std::size_t> parents) {
    return from_parents(std::span<const std::size_t>(parents.begin(), parents.size()));
  }

  /// Nodes including the root.
  [[nodiscard]] std::size_t size() const noexcept { return parents_.size(); }
  /// Draft tokens (nodes without the root): the nodes a full tree of this shape scores.
  [[nodiscard]] std::size_t draft_size() const noexcept { return parents_.size() - 1; }
  [[nodiscard]] std::size_t parent(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return parents_[node];
  }
  [[nodiscard]] std::size_t depth(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return depths_[node];
  }
  /// Depth of the deepest node (0 for the root alone): the most draft tokens a step accepts.
  [[nodiscard]] std::size_t max_depth() const noexcept { return max_depth_; }
  /// The children of `node`, in order.
  [[nodiscard]] std::span<const std::size_t> children(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return {children_.data() + child_offsets_[node],
            child_offsets_[node + 1] - child_offsets_[node]};
  }
  [[nodiscard]] std::size_t child_count(std::size_t node) const noexcept {
    return children(node).size();
  }
  /// Whether every node has at most one child (Algorithm 1's draft).
  [[nodiscard]] bool is_chain() const noexcept { return max_depth_ == draft_size(); }
  /// The parent of every node (parents()[0] == npos).
  [[nodiscard]] std::span<const std::size_t> parents() const noexcept { return parents_; }

  friend bool operator==(const TreeShape& a, const TreeShape& b) noexcept {
    return a.parents_ == b.parents_;
  }

 private:
  TreeShape(std::vector<std::size_t> parents, int /*validated*/) : parents_(std::move(parents)) {
    const std::size_t n = parents_.size();
    depths_.assign(n, 0);
    child_offsets_.assign(n + 1, 0);
    for (std::size_t i = 1; i < n; ++i) {
      depths_[i] = depths_[parents_[i]] + 1;
      max_depth_ = std::max(max_depth_, depths_[i]);
      ++child_offsets_[parents_[i] + 1];
    }
    for (std::size_t i = 0; i < n; ++i) child_offsets_[i + 1] += child_offsets_[i];
    children_.assign(n > 0 ? n - 1 : 0, 0);
    std::vector<std::size_t> fill(child_offsets_.begin(), child_offsets_.end() - 1);
    for (std::size_t i = 1; i < n; ++i) children_[fill[parents_[i]]++] = i;
  }

  static void check_node_count(std::size_t draft_nodes, const char* where) {
    if (draft_nodes >= max_tree_nodes) {
      detail::throw_error(errc::invalid_option, where, ": ", draft_nodes,
                          " draft nodes exceed the limit of ", max_tree_nodes - 1);
    }
  }

  std::vector<std::size_t> parents_;
  std::vector<std::size_t> depths_;
  std::vector<std::size_t> child_offsets_;
  std::vector<std::size_t> children_;
  std::size_t max_depth_ = 0;
};

// ---------------------------------------------------------------------------------------
// The tree as a model sees it
// ---------------------------------------------------------------------------------------

/// The structure of a token tree, as passed to `model.score_tree(context, tree)`.
///
/// Layout (all spans have size() entries; node 0 is the root):
///  - tokens[0] == no_token; tokens[i] is the draft token of node i;
///  - parents[0] == npos; parents[i] < i is the node before i on its path;
///  - depths[0] == 0; depths[i] == depths[parents[i]] + 1.
/// The path of node i is the tokens of its ancestors below the root, then tokens[i]; node
/// i stands for the sequence context + path(i) and sits at absolute position
/// context.size() + depths[i] - 1. Under tree attention node i attends to the context and
/// to its ancestors (and itself), never to other branches.
struct TokenTreeView {
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::span<const token_id> tokens;
  std::span<const std::size_t> parents;
  std::span<const std::size_t> depths;

  [[nodiscard]] std::size_t size() const noexcept { return tokens.size(); }

  /// Appends the path of `node` (root excluded, `node` last) to `out`.
  void append_path(std::size_t node, std::vector<token_id>& out) const {
    SPECDEC_ASSERT(node < size());
    const std::size_t first = out.size();
    out.resize(first + depths[node]);
    for (std::size_t at = node; at != 0; at = parents[at]) out[first + depths[at] - 1] = tokens[at];
  }
};

// ---------------------------------------------------------------------------------------
// Draft trees
// ---------------------------------------------------------------------------------------

/// A token tree with the draft-side q row at every sampled node. Node 0 is the root; nodes
/// are added parents first, and the children of a node keep the order they were added in
/// (the order verification tries them). Reusing one tree (`reset`) keeps its memory.
///
/// Building by hand: `expand(node, kind, q_row)` (sampled kinds, stores a copy of q) or
/// `expand(node, expansion::one_hot)`, then `add_child(node, token)` per candidate and, with
/// replacement, `add_repeat(node)` for each draw that repeated an earlier child, at the
/// position it was drawn. `insert_path(tokens)` adds a proposal as a one_hot path, sharing
/// existing prefixes (a trie). The builders below do all of this.
template <ProbabilityScalar T>
class DraftTree {
 public:
  using scalar_type = T;
  static constexpr std::size_t root = 0;
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  explicit DraftTree(std::size_t vocab_size = 0) { reset(vocab_size); }

  /// Back to the root alone, for vocabulary size `vocab_size`; keeps the memory.
  void reset(std::size_t vocab_size) {
    vocab_size_ = vocab_size;
    tokens_.assign(1, no_token);
    parents_.assign(1, npos);
    depths_.assign(1, 0);
    nodes_.assign(1, Node{});
    rows_.clear();
    max_depth_ = 0;
  }
  void clear() { reset(vocab_size_); }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_size_; }
  /// Nodes including the root: the number of target rows that verification needs.
  [[nodiscard]] std::size_t size() const noexcept { return tokens_.size(); }
  /// Draft tokens (nodes without the root): the nodes scored besides the root.
  [[nodiscard]] std::size_t draft_size() const noexcept { return tokens_.size() - 1; }
  [[nodiscard]] std::size_t max_depth() const noexcept { return max_depth_; }

  [[nodiscard]] token_id token(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return tokens_[node];
  }
  [[nodiscard]] std::size_t parent(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return parents_[node];
  }
  [[nodiscard]] std::size_t depth(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return depths_[node];
  }
  /// First child of `node`, npos for a leaf; then next_sibling(child) until npos.
  [[nodiscard]] std::size_t first_child(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return nodes_[node].first_child;
  }
  [[nodiscard]] std::size_t next_sibling(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return nodes_[node].next_sibling;
  }
  [[nodiscard]] std::size_t child_count(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return nodes_[node].child_count;
  }
  [[nodiscard]] expansion expansion_of(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return nodes_[node].kind;
  }
  /// The q row the children of `node` were drawn from (with_replacement and
  /// without_replacement); empty for one_hot and unexpanded nodes.
  [[nodiscard]] std::span<const T> draft_row(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    const std::size_t offset = nodes_[node].row_offset;
    if (offset == npos) return {};
    return {rows_.data() + offset, vocab_size_};
  }
  /// With replacement: draws at the parent that repeated an earlier child, made right
  /// before `node` was drawn.
  [[nodiscard]] std::size_t repeats_before(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return nodes_[node].repeats_before;
  }
  /// With replacement: repeated draws at `node` after its last child.
  [[nodiscard]] std::size_t trailing_repeats(std::size_t node) const noexcept {
    SPECDEC_ASSERT(node < size());
    return nodes_[node].trailing_repeats;
  }
  /// All draws made at `node` (children plus repeats).
  [[nodiscard]] std::size_t draws(std::size_t node) const noexcept {
    std::size_t total = trailing_repeats(node);
    for (std::size_t c = first_child(node); c != npos; c = next_sibling(c)) {
      total += 1 + repeats_before(c);
    }
    return total;
  }

  /// The structure handed to `score_tree` (valid until the tree changes).
  [[nodiscard]] TokenTreeView view() const noexcept { return {tokens_, parents_, depths_}; }

  /// Appends the path of `node` (root excluded, `node` last) to `out`.
  void append_path(std::size_t node, std::vector<token_id>& out) const {
    view().append_path(node, out);
  }

  /// Marks `node` as sampled with `kind` (with_replacement or without_replacement) and
  /// stores a copy of its q row (any ProbabilityVector; converted to T). Throws
  /// errc::invalid_size for a bad node or row length, errc::invalid_option for a wrong
  /// kind or a node that is already expanded.
  template <ProbabilityVector Row>
  void expand(std::size_t node, expansion kind, const Row& draft_row) {
    const auto row = as_span(draft_row);
    if (row.size() != vocab_size_) {
      detail::throw_error(errc::invalid_size, "DraftTree::expand: draft row of node ", node,
                          " has ", row.size(), " entries, expected the vocabulary size ",
                          vocab_size_);
    }
    const std::span<T> stored = expand_row(node, kind);
    std::copy(row.begin(), row.end(), stored.begin());
  }

  /// As expand, but returns the (zeroed) storage of the node's q row for the caller to
  /// fill, e.g. with a standardized row, before drawing children from it. The span is
  /// valid until the next expand.
  [[nodiscard]] std::span<T> expand_row(std::size_t node, expansion kind) {
    check_node(node, "expand");
    if (kind != expansion::with_replacement && kind != expansion::without_replacement) {
      detail::throw_error(errc::invalid_option, "DraftTree::expand: node ", node,
                          ": a q row belongs to with_replacement or without_replacement, not ",
                          to_string(kind));
    }
    check_unexpanded(node);
    nodes_[node].kind = kind;
    nodes_[node].row_offset = rows_.size();
    rows_.resize(rows_.size() + vocab_size_, T(0));
    return {rows_.data() + nodes_[node].row_offset, vocab_size_};
  }

  /// Marks `node` as expanded with deterministic (one_hot) candidates.
  void expand(std::size_t node, expansion kind) {
    check_node(node, "expand");
    if (kind != expansion::one_hot) {
      detail::throw_error(errc::invalid_option, "DraftTree::expand: node ", node, ": ",
                          to_string(kind), " needs the q row its children are drawn from");
    }
    check_unexpanded(node);
    nodes_[node].kind = kind;
  }

  /// Adds a child with `token` under the expanded `node` and returns its index. Throws
  /// errc::invalid_size (bad node, tree full), errc::invalid_token (token outside
  /// [0, vocab_size)), errc::invalid_option (node not expanded).
  std::size_t add_child(std::size_t node, token_id token) {
    check_node(node, "add_child");
    if (nodes_[node].kind == expansion::none) {
      detail::throw_error(errc::invalid_option, "DraftTree::add_child: node ", node,
                          " is not expanded; call expand() first");
    }
    if (token < 0 || static_cast<std::size_t>(token) >= vocab_size_) {
      detail::throw_error(errc::invalid_token, "DraftTree::add_child: token ", token,
                          " under node ", node, " is outside [0, ", vocab_size_, ")");
    }
    if (size() >= max_tree_nodes) {
      detail::throw_error(errc::invalid_size, "DraftTree::add_child: the tree already has ",
                          max_tree_nodes, " nodes");
    }
    const std::size_t child = size();
    tokens_.push_back(token);
    parents_.push_back(node);
    depths_.push_back(depths_[node] + 1);
    max_depth_ = std::max(max_depth_, depths_[node] + 1);
    Node& entry = nodes_.emplace_back();
    Node& parent_entry = nodes_[node];
    entry.repeats_before = parent_entry.trailing_repeats;
    parent_entry.trailing_repeats = 0;
    if (parent_entry.first_child == npos) {
      parent_entry.first_child = child;
    } else {
      nodes_[parent_entry.last_child].next_sibling = child;
    }
    parent_entry.last_child = child;
    ++parent_entry.child_count;
    return child;
  }

  /// Records a with_replacement draw at `node` that repeated one of its children. Throws
  /// errc::invalid_option unless `node` is with_replacement and has a child.
  void add_repeat(std::size_t node) {
    check_node(node, "add_repeat");
    if (nodes_[node].kind != expansion::with_replacement || nodes_[node].child_count == 0) {
      detail::throw_error(errc::invalid_option, "DraftTree::add_repeat: node ", node,
                          " is not a with_replacement node with children");
    }
    ++nodes_[node].trailing_repeats;
  }

  /// The child of `node` with `token` (the first one), npos if none.
  [[nodiscard]] std::size_t find_child(std::size_t node, token_id token) const noexcept {
    for (std::size_t c = first_child(node); c != npos; c = next_sibling(c)) {
      if (tokens_[c] == token) return c;
    }
    return npos;
  }

  /// Inserts a proposal (e.g. an n-gram continuation) as a path of one_hot candidates from
  /// the root, reusing existing nodes with the same tokens; returns the last node of the
  /// path. New candidates go after existing siblings (put likelier proposals first).
  /// Throws errc::invalid_option if a new candidate would go under a sampled node.
  std::size_t insert_path(std::span<const token_id> path) {
    std::size_t node = root;
    for (const token_id token : path) {
      const std::size_t existing = find_child(node, token);
      if (existing != npos) {
        node = existing;
        continue;
      }
      if (nodes_[node].kind == expansion::none) nodes_[node].kind = expansion::one_hot;
      if (nodes_[node].kind != expansion::one_hot) {
        detail::throw_error(errc::invalid_option, "DraftTree::insert_path: node ", node,
                            " has sampled children; proposals cannot be added to it");
      }
      node = add_child(node, token);
    }
    return node;
  }

 private:
  struct Node {
    std::size_t first_child = npos;
    std::size_t last_child = npos;
    std::size_t next_sibling = npos;
    std::size_t child_count = 0;
    std::size_t row_offset = npos;
    std::size_t repeats_before = 0;
    std::size_t trailing_repeats = 0;
    expansion kind = expansion::none;
  };

  void check_node(std::size_t node, const char* what) const {
    if (node >= size()) {
      detail::throw_error(errc::invalid_size, "DraftTree::", what, ": node ", node,
                          " does not exist (the tree has ", size(), " nodes)");
    }
  }
  void check_unexpanded(std::size_t node) const {
    if (nodes_[node].kind != expansion::none) {
      detail::throw_error(errc::invalid_option, "DraftTree::expand: node ", node,
                          " is already expanded (", to_string(nodes_[node].kind), ")");
    }
  }

  std::size_t vocab_size_ = 0;
  std::vector<token_id> tokens_;
  std::vector<std::size_t> parents_;
  std::vector<std::size_t> depths_;
  std::vector<Node> nodes_;
  std::vector<T> rows_;
  std::size_t max_depth_ = 0;
};

// ---------------------------------------------------------------------------------------
// Builders
// ---------------------------------------------------------------------------------------

/// Options of the tree builders.
struct DraftTreeOptions {
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  /// with_replacement or without_replacement (build_sampled_tree).
  expansion sampling = expansion::without_replacement;
  /// With replacement: record a draw that repeats an earlier child as a repeat count
  /// (true, no scored node wasted) or as a duplicate node (false; it is never accepted).
  bool merge_repeats = true;
  /// Check every q row the draft model returns (throws specdec::error naming the draft
  /// row, i.e. the node, and the step).
  bool validate_rows = true;
  /// Decoder step, for error messages.
  std::size_t step = npos;
};

/// The row transform that leaves rows as they are (copies them, converting the scalar).
/// A transform is any callable `transform(std::span<const U> raw, std::span<T> out)` that
/// writes the row to use into `out` (same size), e.g. the decoder's standardization.
struct IdentityRows {
  template <class U, class T>
  void operator()(std::span<const U> raw, std::span<T> out) const {
    std::copy(raw.begin(), raw.end(), out.begin());
  }
};

/// Reusable buffers of the builders (no allocation once warm).
template <ProbabilityScalar T>
struct DraftTreeWorkspace {
  std::vector<token_id> sequence;             ///< context + path of the node being expanded
  std::vector<std::size_t> pending;           ///< tree nodes still to expand (a DFS stack)
  std::vector<std::size_t> shape_of;          ///< shape node of every tree node
  std::vector<T> remaining;                   ///< without replacement: q minus drawn children
  std::vector<token_id> best;                 ///< top-k candidates
  std::vector<token_id> proposals;            ///< proposal trees: B continuations of L tokens
  std::vector<std::size_t> proposal_lengths;  ///< proposal trees: length of each continuation
};

namespace detail {

/// Drives a DFS over the shape: expands every tree node whose shape node has children,
/// calling `draw_children(node, shape_node, q_span, count)` after the q row of the node's
/// context has been fetched (and validated). Returns the number of draft calls.
template <class T, class Draft, class DrawChildren>
std::size_t expand_by_shape(Draft& draft, std::span<const token_id> context, const TreeShape& shape,
                            DraftTree<T>& tree, DraftTreeWorkspace<T>& workspace,
                            const DraftTreeOptions& options, DrawChildren&& draw_children) {
  tree.reset(static_cast<std::size_t>(draft.vocab_size()));
  workspace.shape_of.assign(1, 0);
  workspace.pending.assign(1, DraftTree<T>::root);
  workspace.sequence.assign(context.begin(), context.end());
  std::size_t draft_calls = 0;
  while (!workspace.pending.empty()) {
    const std::size_t node = workspace.pending.back();
    workspace.pending.pop_back();
    const std::size_t shape_node = workspace.shape_of[node];
    const std::size_t wanted = shape.child_count(shape_node);
    if (wanted == 0) continue;
    workspace.sequence.resize(context.size());
    tree.append_path(node, workspace.sequence);
    decltype(auto) row = draft.next_token_probabilities(
        std::span<const token_id>(workspace.sequence.data(), workspace.sequence.size()));
    ++draft_calls;
    const auto q = as_span(row);
    if (options.validate_rows) {
      validate_probability_row(q, tree.vocab_size(), RowLocation{"draft", options.step, node});
    } else if (q.size() != tree.vocab_size()) {
      throw_error(errc::invalid_size,
                  describe_location(RowLocation{"draft", options.step, node}, "row"), ": has ",
                  q.size(), " entries, expected the vocabulary size ", tree.vocab_size());
    }
    const std::size_t first_new = tree.size();
    draw_children(node, q, wanted);
    const std::size_t added = tree.size() - first_new;
    const auto shape_children = shape.children(shape_node);
    for (std::size_t k = 0; k < added; ++k) workspace.shape_of.push_back(shape_children[k]);
    // Push in reverse so that the first child is expanded first (depth-first: each draft
    // call extends or shortens the previous context, which suits a KV-cached draft).
    for (std::size_t k = added; k > 0; --k) workspace.pending.push_back(first_new + k - 1);
  }
  return draft_calls;
}

}  // namespace detail

/// Drafts a tree of `shape` from a draft LanguageModel: at every node with shape children it
/// calls `draft.next_token_probabilities(context + path)` once, validates the row (when
/// options.validate_rows), stores `transform` of it in the tree (IdentityRows: the row
/// itself) and draws the node's children from that stored row, i.i.d. (with_replacement; repeated
/// draws become repeat counts unless options.merge_repeats is false) or without
/// replacement (each draw from q minus the children drawn so far, renormalised; fewer
/// children when q has fewer positive entries). Nodes are expanded depth-first.
/// The tree is reset to the draft's vocabulary first. Returns the number of draft calls.
/// Throws specdec::error for a bad q row (when options.validate_rows) or options.sampling
/// not a sampled kind.
template <ProbabilityScalar T, LanguageModel Draft, std::uniform_random_bit_generator G,
          class RowTransform = IdentityRows>
std::size_t build_sampled_tree(Draft& draft, std::span<const token_id> context,
                               const TreeShape& shape, G& g, DraftTree<T>& tree,
                               DraftTreeWorkspace<T>& workspace,
                               const DraftTreeOptions& options = {},
                               RowTransform&& transform = {}) {
  if (options.sampling != expansion::with_replacement &&
      options.sampling != expansion::without_replacement) {
    detail::throw_error(errc::invalid_option, "build_sampled_tree: sampling must be ",
                        "with_replacement or without_replacement, not ",
                        to_string(options.sampling));
  }
  return detail::expand_by_shape(
      draft, context, shape, tree, workspace, options,
      [&](std::size_t node, auto q, std::size_t wanted) {
        transform(q, tree.expand_row(node, options.sampling));
        const std::span<const T> stored = tree.draft_row(node);
        if (options.sampling == expansion::with_replacement) {
          for (std::size_t k = 0; k < wanted; ++k) {
            const token_id token = sample_from_row(stored, g);
            if (options.merge_repeats && tree.find_child(node, token) != DraftTree<T>::npos) {
              tree.add_repeat(node);
            } else {
              tree.add_child(node, token);
            }
          }
          return;
        }
        // Without replacement: child k is drawn from the stored row with children 1..k-1
        // zeroed; sample_from_row normalises by the remaining mass, which is q_k.
        std::size_t positive = 0;
        for (const T value : stored) positive += value > T(0) ? 1U : 0U;
        const std::size_t count = std::min(wanted, positive);
        if (count == 0) return;
        workspace.remaining.assign(stored.begin(), stored.end());
        for (std::size_t k = 0; k < count; ++k) {
          const token_id token = sample_from_row(std::span<const T>(workspace.remaining), g);
          tree.add_child(node, token);
          workspace.remaining[static_cast<std::size_t>(token)] = T(0);
        }
      });
}

/// Drafts a tree of `shape` whose children are the draft's most probable tokens (top-k of
/// q with k = the shape's child count; higher probability first, lower id first among
/// ties; tokens with q = 0 are never proposed). The candidates are deterministic, so nodes
/// are one_hot: exact under stochastic verification too, and the natural tree for greedy
/// (T = 0) decoding. No q rows are stored. The tree is reset to the draft's vocabulary
/// first. Returns the number of draft calls.
template <ProbabilityScalar T, LanguageModel Draft>
std::size_t build_top_k_tree(Draft& draft, std::span<const token_id> context,
                             const TreeShape& shape, DraftTree<T>& tree,
                             DraftTreeWorkspace<T>& workspace,
                             const DraftTreeOptions& options = {}) {
  return detail::expand_by_shape(
      draft, context, shape, tree, workspace, options,
      [&](std::size_t node, auto q, std::size_t wanted) {
        tree.expand(node, expansion::one_hot);
        // Insertion into a short sorted list: k is small (a handful of candidates).
        auto& best = workspace.best;
        best.clear();
        const auto more_probable = [&q](token_id a, token_id b) {
          const auto pa = q[static_cast<std::size_t>(a)];
          const auto pb = q[static_cast<std::size_t>(b)];
          return pa > pb || (pa == pb && a < b);
        };
        for (std::size_t j = 0; j < q.size(); ++j) {
          if (!(q[j] > 0)) continue;
          const auto token = static_cast<token_id>(j);
          if (best.size() == wanted && !more_probable(token, best.back())) continue;
          if (best.size() == wanted) best.pop_back();
          best.insert(std::upper_bound(best.begin(), best.end(), token, more_probable), token);
        }
        for (const token_id token : best) tree.add_child(node, token);
      });
}

// ---------------------------------------------------------------------------------------
// Proposal trees
// ---------------------------------------------------------------------------------------

/// How large build_proposal_tree lets a proposal tree grow.
struct ProposalTreeLimits {
  /// B: continuations asked for (a plain ProposalDrafter offers one).
  std::size_t max_branches = 4;
  /// L: tokens per continuation, i.e. the tree's depth.
  std::size_t max_depth = 4;
  /// Draft nodes (root excluded). Continuations are inserted in order and the one that
  /// reaches the budget is cut there; later ones are dropped.
  std::size_t max_nodes = 16;

  /// The limits a TreeShape stands for: one continuation per root-to-leaf path of the
  /// shape, its depth and its draft node count (a chain of gamma: one continuation of
  /// gamma tokens, as the chain path drafts).
  [[nodiscard]] static ProposalTreeLimits from_shape(const TreeShape& shape) noexcept {
    std::size_t leaves = 0;
    for (std::size_t node = 0; node < shape.size(); ++node) {
      leaves += shape.child_count(node) == 0 ? 1U : 0U;
    }
    return {leaves, shape.max_depth(), shape.draft_size()};
  }
};

/// Drafts a proposal tree: asks `drafter` once for up to limits.max_branches continuations
/// of `context` of up to limits.max_depth tokens (`propose_many`; a plain ProposalDrafter's
/// `propose` gives one) and inserts them into `tree` as one_hot paths in the order given
/// (insert_path: equal prefixes share nodes, so duplicates cost nothing), stopping when
/// limits.max_nodes draft nodes are used. The tree is cleared first and keeps its
/// vocabulary size (reset it to the target's). Verification of a one_hot tree is exact
/// whatever the drafter proposes. Allocates only when B L grows beyond every earlier call
/// with this workspace (and the tree beyond its largest size).
/// Returns the number of continuations the drafter offered (0: the tree is the root alone;
/// the drafter is not called when a limit is 0).
/// Throws specdec::error: errc::invalid_option for max_nodes >= max_tree_nodes or
/// max_branches / max_depth above max_tree_nodes; errc::invalid_size when the drafter
/// returns more continuations or longer ones than asked for; errc::invalid_token for a
/// proposed token outside [0, tree.vocab_size()). `step` labels the messages.
template <ProbabilityScalar T, ProposalDrafter Drafter>
std::size_t build_proposal_tree(Drafter& drafter, std::span<const token_id> context,
                                const ProposalTreeLimits& limits, DraftTree<T>& tree,
                                DraftTreeWorkspace<T>& workspace,
                                std::size_t step = RowLocation::npos) {
  if (limits.max_nodes >= max_tree_nodes || limits.max_branches > max_tree_nodes ||
      limits.max_depth > max_tree_nodes) {
    detail::throw_error(errc::invalid_option, "build_proposal_tree: limits of ",
                        limits.max_branches, " branches, depth ", limits.max_depth, " and ",
                        limits.max_nodes, " nodes exceed the tree limit of ", max_tree_nodes - 1,
                        " draft nodes");
  }
  tree.clear();
  const std::size_t branches = MultiProposalDrafter<Drafter>
                                   ? limits.max_branches
                                   : std::min<std::size_t>(1, limits.max_branches);
  const std::size_t length = limits.max_depth;
  if (branches == 0 || length == 0 || limits.max_nodes == 0) return 0;
  workspace.proposals.resize(branches * length);
  workspace.proposal_lengths.assign(branches, 0);
  const std::span<token_id> out(workspace.proposals.data(), branches * length);
  const std::span<std::size_t> lengths(workspace.proposal_lengths.data(), branches);
  std::size_t count = 0;
  if constexpr (MultiProposalDrafter<Drafter>) {
    count = static_cast<std::size_t>(drafter.propose_many(context, out, lengths));
    if (count > branches) {
      detail::throw_error(errc::invalid_size,
                          detail::describe_location(RowLocation{"draft", step}, "proposals"),
                          ": propose_many returned ", count, " continuations, at most ", branches,
                          " were asked for");
    }
  } else {
    lengths[0] = static_cast<std::size_t>(drafter.propose(context, out));
    count = lengths[0] > 0 ? 1 : 0;
  }
  const std::size_t vocab_size = tree.vocab_size();
  for (std::size_t b = 0; b < count; ++b) {
    const RowLocation where{"draft", step, b};
    if (lengths[b] > length) {
      detail::throw_error(errc::invalid_size, detail::describe_location(where, "continuation"),
                          ": has ", lengths[b], " tokens, more than the ", length, " asked for");
    }
    for (std::size_t k = 0; k < lengths[b]; ++k) {
      const token_id token = out[b * length + k];
      if (token < 0 || static_cast<std::size_t>(token) >= vocab_size) {
        detail::throw_error(errc::invalid_token, detail::describe_location(where, "continuation"),
                            ": token ", k, " is ", token, ", outside [0, ", vocab_size, ")");
      }
    }
  }
  std::size_t budget = limits.max_nodes;
  for (std::size_t b = 0; b < count && budget > 0; ++b) {
    const std::span<const token_id> path(out.data() + b * length, lengths[b]);
    std::size_t node = DraftTree<T>::root;
    std::size_t shared = 0;
    for (; shared < path.size(); ++shared) {
      const std::size_t child = tree.find_child(node, path[shared]);
      if (child == DraftTree<T>::npos) break;
      node = child;
    }
    const std::size_t fits = std::min(path.size(), shared + budget);
    if (fits > shared) {
      (void)tree.insert_path(path.first(fits));
      budget -= fits - shared;
    }
  }
  return count;
}

}  // namespace specdec
