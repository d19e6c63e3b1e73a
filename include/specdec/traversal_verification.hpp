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
// subtree whose root has weight 0 cannot succeed and is skipped unread; a node whose
// first path is accepted reads its rows at the drafted entries only; each failed child costs
// its parent one fused pass over P_b and Q_b (the clamped difference, its sum Z and, without
// replacement, the remaining draft mass). Allocation-free once warm (buffers per depth).
//
// Rounding: weights in double, rows in T. If Z + 1 - w_b is 0 after a failure (w_b = 1 and
// Z = 0: p_b = Q_b, where no child can fail in exact arithmetic), the node stops trying
// children, is accepted, and draws from p_b; residual_fallback reports it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
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

/// The state (w, P, Q) of one internal node on the current path. P is kept as a * R, with R
/// a row (p itself until the first failure, then the buffer) and a a scalar, so that an
/// update is one pass: w P - Q = a R - Q.
template <class T>
class traversal_node {
 public:
  void start(std::span<const T> target, std::span<const T> draft, expansion kind,
             double weight) noexcept {
    target_ = target;
    draft_ = draft;
    kind_ = kind;
    weight_ = weight;
    scale_ = weight;
    materialized_ = false;
    masked_ = false;
    fallback_ = false;
    draft_mass_ = 1.0;
  }

  [[nodiscard]] double weight() const noexcept { return weight_; }
  [[nodiscard]] bool fallback() const noexcept { return fallback_; }

  /// w_c = min(1, w P(c) / Q(c)) of the child with token c reached next.
  [[nodiscard]] double child_weight(token_id candidate) const noexcept {
    const auto j = static_cast<std::size_t>(candidate);
    const double mass = scale_ * static_cast<double>(row()[j]);  // w P(c)
    if (!(mass > 0.0)) return 0.0;
    const double draft = draft_probability(j);
    if (!(draft > mass)) return 1.0;
    return mass / draft;
  }

  /// The child with token c (no_candidate: a repeated draw) failed: one pass computes
  /// max(0, a R - Q) into the buffer and its sum Z; w := Z / (Z + 1 - w).
  template <traversal_rule Rule>
  void reject(std::size_t candidate, std::vector<T>& buffer, std::vector<T>& remaining) {
    if constexpr (Rule == traversal_rule::skip_sibling_update) {
      if (kind_ == expansion::without_replacement && candidate != no_candidate) {
        mask(candidate, remaining);
      }
      return;
    }
    const std::size_t size = target_.size();
    const T* source = row().data();
    buffer.resize(size);
    T* out = buffer.data();
    const T scale = static_cast<T>(Rule == traversal_rule::residual_without_weight ? 1.0 : scale_);
    double z = 0.0;
    if (kind_ == expansion::one_hot) {
      for (std::size_t j = 0; j < size; ++j) {
        const T value = scale * source[j];
        out[j] = value > T(0) ? value : T(0);
        z += static_cast<double>(out[j]);
      }
      // max(0, w P - e_c): w P(c) <= 1, so entry c is 0.
      z -= static_cast<double>(out[candidate]);
      out[candidate] = T(0);
    } else {
      const T* draft = draft_.data();
      if (kind_ == expansion::without_replacement && masked_) draft = remaining.data();
      const T inverse = static_cast<T>(1.0 / draft_mass_);
      for (std::size_t j = 0; j < size; ++j) {
        const T value = scale * source[j] - inverse * draft[j];
        out[j] = value > T(0) ? value : T(0);
        z += static_cast<double>(out[j]);
      }
      if (candidate != no_candidate) {  // failed: w P(c) < Q(c) in exact arithmetic
        z -= static_cast<double>(out[candidate]);
        out[candidate] = T(0);
        if (kind_ == expansion::without_replacement) mask(candidate, remaining);
      }
    }
    materialized_ = true;
    const double denominator = z + (1.0 - weight_);
    if (!(denominator > 0.0)) {  // w = 1 and Z = 0: reachable only through rounding
      fallback_ = true;
      weight_ = 1.0;
      return;
    }
    weight_ = z / denominator;
    if (weight_ > 1.0) weight_ = 1.0;
    scale_ = 1.0 / denominator;  // w P = (Z / D) * (R / Z) = R / D
  }

  /// The correction of an accepted node: a draw from P (from p after a fallback).
  template <std::uniform_random_bit_generator G>
  [[nodiscard]] token_id sample(G& g) const {
    return sample_from_row(fallback_ ? target_ : row(), g);
  }

  static constexpr std::size_t no_candidate = static_cast<std::size_t>(-1);

  void bind(std::vector<T>& buffer) noexcept { buffer_ = &buffer; }

 private:
  [[nodiscard]] std::span<const T> row() const noexcept {
    return materialized_ ? std::span<const T>(*buffer_) : target_;
  }

  [[nodiscard]] double draft_probability(std::size_t j) const noexcept {
    switch (kind_) {
      case expansion::one_hot:
        return 1.0;
      case expansion::without_replacement:
        if (masked_) {
          const auto value = static_cast<double>((*remaining_)[j]);
          return value > 0.0 ? value / draft_mass_ : 0.0;
        }
        return static_cast<double>(draft_[j]);
      default:
        return static_cast<double>(draft_[j]);
    }
  }

  void mask(std::size_t candidate, std::vector<T>& remaining) {
    if (!masked_) {
      remaining.assign(draft_.begin(), draft_.end());
      masked_ = true;
    }
    remaining_ = &remaining;
    remaining[candidate] = T(0);
    draft_mass_ = tree_row_sum(std::span<const T>(remaining));
  }

  std::span<const T> target_;
  std::span<const T> draft_;
  expansion kind_ = expansion::none;
  double weight_ = 1.0;
  double scale_ = 1.0;
  double draft_mass_ = 1.0;
  bool materialized_ = false;
  bool masked_ = false;
  bool fallback_ = false;
  std::vector<T>* buffer_ = nullptr;
  const std::vector<T>* remaining_ = nullptr;
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
  const auto reject = [&](std::size_t parent, std::size_t candidate) {
    const std::size_t d = tree.depth(parent);
    workspace.nodes[d].template reject<Rule>(candidate, workspace.residuals[d],
                                             workspace.remaining[d]);
  };
  // Reaches child `child` of `parent`: absorbs the repeated draws before it, then its weight.
  const auto reach = [&](std::size_t parent, std::size_t child) {
    traversal_node<T>& s = state(parent);
    if (tree.expansion_of(parent) == expansion::with_replacement) {
      for (std::size_t k = tree.repeats_before(child); k > 0 && !s.fallback(); --k) {
        reject(parent, no_candidate);
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
      s.bind(workspace.residuals[tree.depth(node)]);
      s.start(target_rows.row(node), tree.draft_row(node), tree.expansion_of(node), weight);
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
    if (!s.fallback()) reject(parent, static_cast<std::size_t>(tree.token(node)));
    const std::size_t next = s.fallback() ? npos : tree.next_sibling(node);
    if (next != npos) {
      weight = reach(parent, next);
      node = next;
      if (weight >= 0.0) descending = true;
      continue;
    }
    if (!s.fallback() && tree.expansion_of(parent) == expansion::with_replacement) {
      for (std::size_t k = tree.trailing_repeats(parent); k > 0 && !s.fallback(); --k) {
        reject(parent, no_candidate);
      }
    }
    if (parent == root || s.fallback() || uniform01<double>(g) < s.weight()) {
      node = parent;
      result.token = s.sample(g);
      result.source = token_source::correction;
      result.residual_fallback = s.fallback();
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
