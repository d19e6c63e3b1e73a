// specdec — traversal verification of draft token trees (Weng, Hu, Chen, Liu, Mei, Qiu, Tian,
// Shi, "Traversal Verification for Speculative Tree Decoding", NeurIPS 2025): the tree is
// decided from the leaves towards the root on whole paths instead of token by token from
// the root (verify_tree, tree_verification.hpp). Same inputs and result as verify_tree; the
// output has exactly the target's law; on a chain it is block verification
// (block_verification.hpp), step for step.
//
// The rule. Every node c with parent b carries a weight w_c (the capped ratio of its path,
// block verification's rho) and every internal node b a state (w_b, P_b, Q_b): P_b starts as
// b's target row p_b, Q_b is the law its next child was drawn from (q_b; without
// replacement q_b without the children drawn before, renormalised; e_c for a one_hot
// child). The children are tried in the order they were drawn, each subtree before the next
// child (post-order):
//  - w_root = 1; a child c of b gets w_c = min(1, w_b P_b(c) / Q_b(c)) from b's state when c
//    is reached (0 if P_b(c) = 0; 1 if Q_b(c) = 0 < P_b(c));
//  - a leaf c is accepted with probability w_c: the path of c is emitted with a bonus token
//    drawn from p_c, and the step ends;
//  - when the subtree of child c fails, b's state absorbs the failure:
//    Z = sum_x max(0, w_b P_b(x) - Q_b(x)),  P_b := norm(max(0, w_b P_b - Q_b)) (P_b(c) := 0),
//    w_b := Z / (Z + 1 - w_b) (1 where the denominator is 0), Q_b := the next child's law;
//    a repeated draw (with replacement, merged into a repeat count) is a child of weight 0
//    and only absorbs;
//  - when every child of b has failed, b itself is accepted with probability w_b (the root
//    always: its weight stays 1) and emits its path with a correction drawn from P_b;
//    otherwise b fails towards its parent.
//
// Why it is exact (our proof; the paper proves its own formulation). Claim: for a node b in
// state (w, P, Q) whose remaining children are drawn as described, the procedure below b
// succeeds with probability w, and given success its first emitted token has law P and the
// rest the target's law after it. A leaf: accepted with probability w, bonus from p_b. A
// node with a next child c ~ Q: the subtree of c succeeds with probability
// E[w_c] = sum_x min(Q(x), w P(x)) (induction) and emits x with mass min(Q(x), w P(x)). It
// fails with probability D = sum_x max(0, Q(x) - w P(x)) = Z + 1 - w; the update sets b's
// new weight to Z / D and its P to max(0, w P - Q) / Z, so by induction over the remaining
// children the rest succeeds with probability Z / D and emits x with mass
// D (Z / D) max(0, w P(x) - Q(x)) / Z. Together: success w, and x with mass
// min(Q, w P) + max(0, w P - Q) = w P(x). At the root w = 1, so the step always emits, with
// the target's law. The claim needs only that each child was drawn from the Q_b used here
// and that subtrees were drafted from their own contexts, independently of the verification;
// so every tree specdec builds qualifies: build_sampled_tree with and without replacement
// (merged repeats or not), build_top_k_tree and proposal trees (one_hot), and mixed
// trees. A failed child c has w P(c) < Q(c) (w_c < 1), so P_b(c) = 0 from then on and a
// repeated draw of c is never accepted. Verified by enumeration of the real code in
// tests/traversal_verification_test.cpp (every acceptance threshold and every draw
// breakpoint found by bisection over the 53-bit uniforms).
//
// Cost: one uniform01<double> per non-root node of positive weight reached (a leaf when it
// is decided, an internal node after its children failed), then one for the final draw; a
// subtree whose root has weight 0 cannot succeed and is skipped unread; a node whose first
// path is accepted reads its rows at the drafted entries only. Each failed child costs its
// parent one vectorised pass over P_b and Q_b that builds the mass table of
// max(0, w_b P_b - Q_b) (its total is Z; an accepted parent draws from it, walking one
// superblock); the residual is written out only when a second child fails at the same node.
// On a chain this is block verification's cost: gamma - n + 1 row pairs. Allocation-free
// once warm (buffers per depth).
//
// Rounding: weights in double, rows in T (a failed child's residual entry is 0 in exact
// arithmetic and is zeroed when the residual is written out; a pending draw carries the
// rows' rounding there, as every draw from float rows does). If Z + 1 - w_b is 0 after a
// failure (w_b = 1 and Z = 0: p_b = Q_b, where no child can fail in exact arithmetic), the
// node stops trying children, is accepted, and draws from p_b; residual_fallback reports it,
// as it reports a residual whose mass table has no drawable mass.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/detail/tree_node_residual.hpp"
#include "specdec/detail/tree_validation.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

namespace detail {

/// The rule traversal verification runs: `exact`, or a broken variant the tests must catch
/// (never used by the library).
enum class traversal_rule : std::uint8_t {
  exact,
  skip_sibling_update,      ///< a failed child leaves its parent's weight and P unchanged
  residual_without_weight,  ///< P_b := norm(max(0, P_b - Q_b)), ignoring w_b
};

/// The state (w, P, Q) of one internal node on the current path, with P = a * R for a row R
/// and a scalar a, so that the update after a failure is w P - Q = a R - Q. The update is
/// lazy: a failure builds the mass table of max(0, a R - Q) (one vectorised pass: Z, and the
/// table a draw from P walks) and keeps it pending; the residual is written out only when a
/// further failure at the node needs it as its R.
template <class T>
class traversal_node {
 public:
  static constexpr std::size_t no_candidate = static_cast<std::size_t>(-1);

  void start(std::span<const T> target, std::span<const T> draft, expansion kind, double weight,
             std::vector<T>& buffer, std::vector<T>& remaining) noexcept {
    target_ = target;
    draft_ = draft;
    kind_ = kind;
    weight_ = weight;
    base_ = target.data();
    scale_ = weight;
    draft_data_ = draft.data();
    draft_inverse_ = 1.0;
    buffer_ = &buffer;
    remaining_ = &remaining;
    masked_ = false;
    pending_ = false;
    fallback_ = false;
  }

  [[nodiscard]] double weight() const noexcept { return weight_; }
  [[nodiscard]] bool fallback() const noexcept { return fallback_; }

  /// w_c = min(1, w P(c) / Q(c)) of the child with token c reached next.
  [[nodiscard]] double child_weight(token_id candidate) const noexcept {
    const auto j = static_cast<std::size_t>(candidate);
    const double mass = scale_ * residual_entry(j);  // w P(c)
    if (!(mass > 0.0)) return 0.0;
    double draft = 1.0;  // one_hot: Q = e_c
    if (kind_ != expansion::one_hot) {
      draft = static_cast<double>(draft_data_[j]) * draft_inverse_;
    }
    if (!(draft > mass)) return 1.0;
    return mass / draft;
  }

  /// The child with token c (no_candidate: a repeated draw) failed: Z from the mass table of
  /// max(0, a R - Q), w := Z / (Z + 1 - w); `more` says whether another child follows (then
  /// Q moves on to its law).
  template <traversal_rule Rule>
  void reject(std::size_t candidate, bool more) {
    if constexpr (Rule == traversal_rule::skip_sibling_update) {
      if (more && kind_ == expansion::without_replacement && candidate != no_candidate) {
        mask(candidate);
      }
      return;
    }
    if (pending_) materialize();
    const double a = Rule == traversal_rule::residual_without_weight ? 1.0 : scale_;
    pending_a_ = static_cast<T>(a);
    pending_candidate_ = candidate;
    pending_draft_ = draft_data_;
    pending_inverse_ = static_cast<T>(draft_inverse_);
    pending_ = true;
    double z = 0.0;
    if (kind_ == expansion::one_hot) {  // max(0, a R - e_c): a R(c) <= 1, so R without c
      build_mass_table(one_hot_source(), table_);
      z = a * table_.total;
    } else {
      const auto source = difference_source();
      build_mass_table(source, table_);
      z = table_.total;
      if (candidate != no_candidate) z -= static_cast<double>(source.element(candidate));
    }
    if (more && kind_ == expansion::without_replacement && candidate != no_candidate) {
      mask(candidate);
    }
    const double denominator = z + (1.0 - weight_);
    if (!(denominator > 0.0)) {  // w = 1 and Z = 0: reachable only through rounding
      fallback_ = true;
      weight_ = 1.0;
      return;
    }
    weight_ = z / denominator;
    if (weight_ > 1.0) weight_ = 1.0;
    scale_ = 1.0 / denominator;  // w P = (Z / D) * (residual / Z) = residual / D
  }

  /// The correction of an accepted node: a draw from P (from p after a fallback), and
  /// whether it fell back.
  template <std::uniform_random_bit_generator G>
  [[nodiscard]] ResidualDraw sample(G& g) const {
    if (fallback_) return {sample_from_row(target_, g), true};
    if (!pending_) return {sample_from_row(std::span<const T>(base_, target_.size()), g), false};
    const double u = uniform01<double>(g);
    std::size_t index = no_index;
    if (table_.drawable()) {
      index = kind_ == expansion::one_hot ? draw_from_table(one_hot_source(), table_, u)
                                          : draw_from_table(difference_source(), table_, u);
    }
    if (index == no_index) return {draw_from_target(target_, u), true};  // zero mass
    return {static_cast<token_id>(index), false};
  }

 private:
  [[nodiscard]] replaced_entry_source<T> one_hot_source() const noexcept {
    return {base_, target_.size(), pending_candidate_, T(0)};
  }
  [[nodiscard]] scaled_difference_source<T> difference_source() const noexcept {
    return {base_, pending_draft_, target_.size(), pending_a_, pending_inverse_};
  }

  /// R(j) of the current residual (pending or written out), unscaled.
  [[nodiscard]] double residual_entry(std::size_t j) const noexcept {
    if (!pending_) return static_cast<double>(base_[j]);
    if (j == pending_candidate_) return 0.0;
    if (kind_ == expansion::one_hot) return static_cast<double>(pending_a_ * base_[j]);
    return static_cast<double>(difference_source().element(j));
  }

  /// Writes the pending residual out as the new R (a := 1 is folded into scale_ already).
  void materialize() {
    const std::size_t size = target_.size();
    std::vector<T>& buffer = *buffer_;
    buffer.resize(size);
    T* out = buffer.data();
    if (kind_ == expansion::one_hot) {
      const T a = pending_a_;
      const T* base = base_;
      for (std::size_t j = 0; j < size; ++j) out[j] = a * base[j];
    } else {
      const auto source = difference_source();
      for (std::size_t j = 0; j < size; ++j) out[j] = source.element(j);
    }
    if (pending_candidate_ != no_candidate) out[pending_candidate_] = T(0);
    base_ = out;
    pending_ = false;
  }

  /// Without replacement: Q := q without the children drawn so far, renormalised.
  void mask(std::size_t candidate) {
    std::vector<T>& remaining = *remaining_;
    if (!masked_) {
      remaining.assign(draft_.begin(), draft_.end());
      masked_ = true;
    }
    remaining[candidate] = T(0);
    draft_data_ = remaining.data();
    const double mass = tree_row_sum(std::span<const T>(remaining));
    draft_inverse_ = mass > 0.0 ? 1.0 / mass : 0.0;
  }

  std::span<const T> target_;
  std::span<const T> draft_;
  expansion kind_ = expansion::none;
  double weight_ = 1.0;
  const T* base_ = nullptr;  ///< R: p, or the buffer once a residual was written out
  double scale_ = 1.0;       ///< a: w P = a R
  const T* draft_data_ = nullptr;
  double draft_inverse_ = 1.0;  ///< Q = draft_data_ * draft_inverse_
  std::vector<T>* buffer_ = nullptr;
  std::vector<T>* remaining_ = nullptr;
  bool masked_ = false;
  bool fallback_ = false;
  // The pending residual max(0, a R - Q) (entry c zeroed) and its mass table.
  bool pending_ = false;
  T pending_a_ = T(1);
  std::size_t pending_candidate_ = no_candidate;
  const T* pending_draft_ = nullptr;
  T pending_inverse_ = T(1);
  mass_table table_{};
};

}  // namespace detail

/// Reusable buffers of verify_traversal: one node state and two rows per tree depth (no
/// allocation once warm).
template <ProbabilityScalar T>
struct TraversalWorkspace {
  std::vector<detail::traversal_node<T>> nodes;
  std::vector<std::vector<T>> residuals;
  std::vector<std::vector<T>> remaining;
};

namespace detail {

template <traversal_rule Rule, class T, class G>
TreeVerificationResult traverse(const DraftTree<T>& tree, RowsView<const T> target_rows, G& g,
                                TraversalWorkspace<T>& workspace) {
  constexpr std::size_t npos = DraftTree<T>::npos;
  constexpr std::size_t root = DraftTree<T>::root;
  constexpr std::size_t no_candidate = traversal_node<T>::no_candidate;
  const std::size_t levels = tree.max_depth() + 1;
  if (workspace.nodes.size() < levels) {
    workspace.nodes.resize(levels);
    workspace.residuals.resize(levels);
    workspace.remaining.resize(levels);
  }
  const auto state = [&](std::size_t node) -> traversal_node<T>& {
    return workspace.nodes[tree.depth(node)];
  };
  const auto reject = [&](std::size_t parent, std::size_t candidate, bool more) {
    workspace.nodes[tree.depth(parent)].template reject<Rule>(candidate, more);
  };
  // Reaches child `child` of `parent`: absorbs the repeated draws before it, then its weight.
  const auto reach = [&](std::size_t parent, std::size_t child) {
    traversal_node<T>& s = state(parent);
    if (tree.expansion_of(parent) == expansion::with_replacement) {
      for (std::size_t k = tree.repeats_before(child); k > 0 && !s.fallback(); --k) {
        reject(parent, no_candidate, true);
      }
    }
    return s.fallback() ? -1.0 : s.child_weight(tree.token(child));
  };

  TreeVerificationResult result;
  std::size_t node = root;
  double weight = 1.0;
  bool descending = true;
  for (;;) {
    if (descending && node != root && !(weight > 0.0)) {
      descending = false;  // weight 0: the subtree cannot succeed; no uniform, no row read
    }
    if (descending) {
      if (tree.first_child(node) == npos) {  // a leaf: accepted with probability w
        if (node == root || uniform01<double>(g) < weight) {
          result.token = sample_from_row(std::span<const T>(target_rows.row(node)), g);
          result.source = token_source::bonus;
          break;
        }
        descending = false;  // failed: back to the parent
        continue;
      }
      traversal_node<T>& s = state(node);
      const std::size_t d = tree.depth(node);
      s.start(target_rows.row(node), tree.draft_row(node), tree.expansion_of(node), weight,
              workspace.residuals[d], workspace.remaining[d]);
      const std::size_t child = tree.first_child(node);
      weight = reach(node, child);
      if (weight >= 0.0) {
        node = child;
        continue;
      }
      descending = false;  // a fallback while absorbing repeats: accept `node` below
      node = child;
    }
    // `node` failed (or its parent fell back): its parent absorbs it and goes on.
    const std::size_t parent = tree.parent(node);
    traversal_node<T>& s = state(parent);
    const std::size_t sibling = tree.next_sibling(node);
    if (!s.fallback()) {
      const bool more =
          sibling != npos || (tree.expansion_of(parent) == expansion::with_replacement &&
                              tree.trailing_repeats(parent) > 0);
      reject(parent, static_cast<std::size_t>(tree.token(node)), more);
    }
    const std::size_t next = s.fallback() ? npos : sibling;
    if (next != npos) {
      weight = reach(parent, next);
      node = next;
      if (weight >= 0.0) descending = true;
      continue;
    }
    if (!s.fallback() && tree.expansion_of(parent) == expansion::with_replacement) {
      for (std::size_t k = tree.trailing_repeats(parent); k > 0 && !s.fallback(); --k) {
        reject(parent, no_candidate, k > 1);
      }
    }
    if (parent == root || s.fallback() || uniform01<double>(g) < s.weight()) {
      node = parent;
      const ResidualDraw draw = s.sample(g);
      result.token = draw.token;
      result.source = token_source::correction;
      result.residual_fallback = draw.fallback;
      break;
    }
    node = parent;  // every path below `parent` failed, and so did `parent`
  }
  result.node = node;
  result.accepted = tree.depth(node);
  return result;
}

}  // namespace detail

/// Traversal verification of a draft tree (unchecked fast path): same inputs, preconditions
/// and result as verify_tree (tree_verification.hpp): `target_rows` has one row per tree node
/// (row i = p after context + path(i)), and the children of every sampled node were drawn
/// from the q row stored at it. Every tree kind qualifies (with and without replacement,
/// one_hot, mixed); see the header comment.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
TreeVerificationResult verify_traversal(const DraftTree<T>& tree, RowsView<const T> target_rows,
                                        G& g, TraversalWorkspace<T>& workspace) {
  SPECDEC_ASSERT(target_rows.rows() == tree.size());
  SPECDEC_ASSERT(target_rows.cols() == tree.vocab_size() && tree.vocab_size() > 0);
  return detail::traverse<detail::traversal_rule::exact>(tree, target_rows, g, workspace);
}

/// verify_traversal with a temporary workspace (allocates).
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
TreeVerificationResult verify_traversal(const DraftTree<T>& tree, RowsView<const T> target_rows,
                                        G& g) {
  TraversalWorkspace<T> workspace;
  return verify_traversal(tree, target_rows, g, workspace);
}

/// Validates the tree and the rows (as verify_tree_checked: errc::vocab_mismatch,
/// errc::invalid_size, row errors of target rows and stored q rows, errc::invalid_token for
/// a sampled child its q cannot produce), then runs verify_traversal. `step` labels messages.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
TreeVerificationResult verify_traversal_checked(const DraftTree<T>& tree,
                                                RowsView<const T> target_rows, G& g,
                                                TraversalWorkspace<T>& workspace,
                                                std::size_t step = RowLocation::npos) {
  detail::validate_target_rows_for_tree(tree, target_rows, step);
  detail::validate_draft_tree(tree, step);
  return verify_traversal(tree, target_rows, g, workspace);
}

}  // namespace specdec
