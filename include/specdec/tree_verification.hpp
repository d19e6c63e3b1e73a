// specdec — exact verification of draft token trees in one target call (SpecInfer-style
// recursive rejection sampling), greedy tree verification, batched tree scoring, and a
// self-contained tree decoding step and loop.
//
// Verification walks down from the root. At a node with target row p (the row of the
// node's context), r starts as p and the children c_1, c_2, ... are tried in order: c_i is
// accepted with probability min(1, r(c_i) / q_i(c_i)) and the walk descends into it; on
// rejection r := norm(max(0, r - q_i)). q_i depends on how the children were drafted
// (draft_tree.hpp): q (with replacement; a repeated draw is never accepted but still
// subtracts q), q without c_1..c_{i-1} renormalised (without replacement), or e_{c_i}
// (one_hot proposals: accept with probability r(c_i), then drop c_i from r). If no child is
// accepted, the node emits a *correction* drawn from the final r and the step ends; at an
// accepted leaf it emits a *bonus* drawn from the leaf's p.
//
// Why it is exact: each candidate is one step of the paper's speculative sampling (Sec.
// 2.3, App. A.1) with target r and draft q_i, which produces r exactly; by induction the
// token leaving a node has law p. The subtree under an accepted child was drafted from the
// child's context independently of the acceptance decisions, so by induction over depth the
// whole emission, continued by ordinary target sampling, has the target's autoregressive
// law. A chain (one child per node) is exactly Algorithm 1. Edge cases (q_i(c) = 0,
// repeats, zero residual mass) are documented in detail/tree_node_residual.hpp.
//
// Greedy trees (T = 0): follow the child equal to the target argmax (lowest id among ties)
// and emit the argmax at the first node without such a child: identical to plain greedy
// decoding for any tree.
//
// Random numbers: one uniform01<double> per candidate tried and one per emitted draw.
//
// Drafts: tree_step drafts sampled or top-k trees from a draft LanguageModel, or proposal
// trees (one_hot continuations, build_proposal_tree) from a proposal-only drafter.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <random>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/tree_node_residual.hpp"
#include "specdec/detail/tree_validation.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/traversal_verification.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

// ---------------------------------------------------------------------------------------
// Verification
// ---------------------------------------------------------------------------------------

/// Appends the tokens a verification emits (path of result.node, then result.token).
template <ProbabilityScalar T>
void append_emitted(const DraftTree<T>& tree, const TreeVerificationResult& result,
                    std::vector<token_id>& out) {
  tree.append_path(result.node, out);
  out.push_back(result.token);
}

/// Reusable buffers of verify_tree (the residual and the masked q; no allocation once warm).
template <ProbabilityScalar T>
struct TreeVerificationWorkspace {
  detail::tree_node_residual<T> residual;
};

/// Exact tree verification (unchecked fast path). `target_rows` has one row per tree node
/// (row i = p after context + path(i); row 0 for the root), as score_tree returns them.
/// The children of every sampled node must have been drawn from the q row stored at it, as
/// the builders do (this is what makes the result exact).
/// Preconditions (asserted in debug builds): target_rows.rows() == tree.size(),
/// target_rows.cols() == tree.vocab_size() > 0; rows finite, non-negative, normalised.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
TreeVerificationResult verify_tree(const DraftTree<T>& tree, RowsView<const T> target_rows, G& g,
                                   TreeVerificationWorkspace<T>& workspace) {
  SPECDEC_ASSERT(target_rows.rows() == tree.size());
  SPECDEC_ASSERT(target_rows.cols() == tree.vocab_size() && tree.vocab_size() > 0);
  constexpr std::size_t npos = DraftTree<T>::npos;
  auto& residual = workspace.residual;
  TreeVerificationResult result;
  std::size_t node = DraftTree<T>::root;
  for (;;) {
    const std::span<const T> target = target_rows.row(node);
    if (tree.first_child(node) == npos) {  // an accepted leaf (or a bare root): bonus
      result.token = sample_from_row(target, g);
      result.source = token_source::bonus;
      break;
    }
    const expansion kind = tree.expansion_of(node);
    residual.start(target, tree.draft_row(node), kind);
    const bool counts_repeats = kind == expansion::with_replacement;
    std::size_t accepted_child = npos;
    // fallback() is asked before each use of r, never right after a rejection, so that the
    // last rejection at a node stays pending and is fused into the draw below.
    for (std::size_t child = tree.first_child(node); child != npos;
         child = tree.next_sibling(child)) {
      if (counts_repeats) {
        for (std::size_t k = tree.repeats_before(child); k > 0 && !residual.fallback(); --k) {
          residual.reject_repeat();
        }
      }
      if (residual.fallback()) break;
      const token_id candidate = tree.token(child);
      if (uniform01<double>(g) < residual.acceptance_probability(candidate)) {
        accepted_child = child;
        break;
      }
      residual.reject(candidate);
    }
    if (accepted_child != npos) {
      node = accepted_child;
      continue;
    }
    if (counts_repeats) {
      for (std::size_t k = tree.trailing_repeats(node); k > 0 && !residual.fallback(); --k) {
        residual.reject_repeat();
      }
    }
    result.token = residual.sample(g);
    result.source = token_source::correction;
    result.residual_fallback = residual.fallback();  // set by sample() if it had to
    break;
  }
  result.node = node;
  result.accepted = tree.depth(node);
  return result;
}

/// verify_tree with a temporary workspace (allocates when a residual is needed).
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
TreeVerificationResult verify_tree(const DraftTree<T>& tree, RowsView<const T> target_rows, G& g) {
  TreeVerificationWorkspace<T> workspace;
  return verify_tree(tree, target_rows, g, workspace);
}

/// Greedy (T = 0) tree verification: from the root, descend into the child whose token is
/// the argmax of the node's target row (lowest id among ties); at the first node without
/// such a child emit that argmax (a correction if the node has children, a bonus at a
/// leaf). The emitted tokens equal plain greedy decoding. Unnormalised scores (logits)
/// work too. Preconditions as verify_tree (no NaN entries).
template <ProbabilityScalar T>
[[nodiscard]] TreeVerificationResult verify_tree_greedy(const DraftTree<T>& tree,
                                                        RowsView<const T> target_rows) noexcept {
  SPECDEC_ASSERT(target_rows.rows() == tree.size());
  SPECDEC_ASSERT(target_rows.cols() == tree.vocab_size() && tree.vocab_size() > 0);
  TreeVerificationResult result;
  std::size_t node = DraftTree<T>::root;
  for (;;) {
    const token_id best = argmax(std::span<const T>(target_rows.row(node)));
    const std::size_t child = tree.find_child(node, best);
    if (child == DraftTree<T>::npos) {
      result.token = best;
      result.source = tree.first_child(node) == DraftTree<T>::npos ? token_source::bonus
                                                                   : token_source::correction;
      break;
    }
    node = child;
  }
  result.node = node;
  result.accepted = tree.depth(node);
  return result;
}

/// Validates the tree and the rows, then runs verify_tree. Throws `specdec::error`:
/// errc::vocab_mismatch (row width != tree vocabulary), errc::invalid_size (rows !=
/// tree.size()), every row error of validate_probability_row for target rows (row = node)
/// and stored q rows, and errc::invalid_token for a sampled candidate its q_i cannot
/// produce (q = 0, or a repeat under without_replacement).
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
TreeVerificationResult verify_tree_checked(const DraftTree<T>& tree, RowsView<const T> target_rows,
                                           G& g, TreeVerificationWorkspace<T>& workspace,
                                           std::size_t step = RowLocation::npos) {
  detail::validate_target_rows_for_tree(tree, target_rows, step);
  detail::validate_draft_tree(tree, step);
  return verify_tree(tree, target_rows, g, workspace);
}

/// Validates the rows (as verify_tree_checked), then runs verify_tree_greedy.
template <ProbabilityScalar T>
[[nodiscard]] TreeVerificationResult verify_tree_greedy_checked(
    const DraftTree<T>& tree, RowsView<const T> target_rows, std::size_t step = RowLocation::npos) {
  detail::validate_target_rows_for_tree(tree, target_rows, step);
  return verify_tree_greedy(tree, target_rows);
}

// ---------------------------------------------------------------------------------------
// Scoring a tree with the target
// ---------------------------------------------------------------------------------------

/// `model.score_tree(context, tree)` with a TokenTreeView, returning a ProbabilityMatrix.
template <class M>
concept HasTreeScoring = requires(M& model, std::span<const token_id> context,
                                  const TokenTreeView& tree) {
  { model.score_tree(context, tree) } -> ProbabilityMatrix;
};

/// A LanguageModel that scores every node of a token tree in one call (one forward pass
/// with a tree-attention mask; the mask is the model's business).
///
/// Layout of the result: exactly `tree.size()` rows of `vocab_size()` entries, row i is the
/// distribution of the token following `context + path(i)` and must equal
/// `next_token_probabilities` of that sequence (see TokenTreeView for paths, parents and
/// positions). Row 0 (the root, i.e. the context itself) verifies the root's children;
/// every internal row verifies its node's children; the row of a leaf is what a bonus draw
/// needs when that leaf is accepted. Node indices are topological (parent(i) < i).
///
/// Stateful models (KV caches): the next call always receives the accepted context
/// (context + accepted path + t, possibly cut by a stop condition, or a new prompt). With
/// a CachedContext (cached_context.hpp) the model calls `cache.sync(context, *this)` and then
/// `cache.append_tree(tree, *this)` inside score_tree: its `append_tree(tree)` hook
/// evaluates node i at cache slot context.size() + i - 1 (position context.size() +
/// depths[i] - 1, tree mask), and the next sync walks that tree along the new context,
/// calls `keep_tree_path(base, slots)` to gather the accepted path's entries to positions
/// base, base + 1, ... (or just truncates when they are already there), drops every other
/// slot and appends t. So a decoder step costs one score_tree call evaluating the tree's
/// nodes plus the previous step's t, and no accepted token is evaluated twice. A model
/// with only truncate/append drops the whole tree instead and re-evaluates the path.
/// Models without score_tree still work: `score_tree_rows` falls back to one `score_draft`
/// per root-to-leaf path (BatchedLanguageModel) or one `next_token_probabilities` per node.
/// @code
/// struct Engine {
///   std::vector<float> rows;
///   std::size_t vocab_size() const;
///   std::span<const float> next_token_probabilities(std::span<const specdec::token_id>);
///   specdec::RowsView<const float> score_tree(std::span<const specdec::token_id> context,
///                                             const specdec::TokenTreeView& tree) {
///     rows.resize(tree.size() * vocab_size());
///     // ... one forward pass over context + tree.tokens[1..] with the tree mask ...
///     return {rows.data(), tree.size(), vocab_size()};
///   }
/// };
/// static_assert(specdec::TreeScoringModel<Engine>);
/// @endcode
template <class M>
concept TreeScoringModel = LanguageModel<M> && HasTreeScoring<M>;

/// Reusable buffers of score_tree_rows.
template <ProbabilityScalar T>
struct TreeScoringWorkspace {
  std::vector<T> rows;                ///< scored rows when they must be copied
  std::vector<token_id> sequence;     ///< context + path for the fallbacks
  std::vector<token_id> path;         ///< a root-to-leaf path for score_draft
  std::vector<unsigned char> filled;  ///< which rows the score_draft fallback has filled
};

/// Target rows for every node of a tree and how many target calls produced them.
template <ProbabilityScalar T>
struct TreeScores {
  RowsView<const T> rows;        ///< tree.size() rows of vocab_size entries, row i = node i
  std::size_t target_calls = 0;  ///< 1 (score_tree), leaves (score_draft) or tree.size()
};

namespace detail {

template <class M>
using model_row_scalar_t =
    probability_scalar_t<decltype(std::declval<M&>().next_token_probabilities(
        std::declval<std::span<const token_id>>()))>;

template <class T, class U>
void copy_row_into(std::span<const U> source, std::vector<T>& rows, std::size_t row,
                   std::size_t vocab_size) {
  std::copy(source.begin(), source.end(),
            rows.begin() + static_cast<std::ptrdiff_t>(row * vocab_size));
}

inline void check_scored_shape(std::size_t rows, std::size_t cols, std::size_t expected_rows,
                               std::size_t vocab_size, const char* entry_point, std::size_t step) {
  if (rows != expected_rows || cols != vocab_size) {
    throw_error(errc::invalid_size, describe_location({"target", step}, "rows"), ": ", entry_point,
                " returned ", rows, " x ", cols, " entries, expected ", expected_rows, " x ",
                vocab_size);
  }
}

}  // namespace detail

/// Scores every node of `tree` with the target given `context`: one `score_tree` call for a
/// TreeScoringModel; otherwise one `score_draft(context, path)` per root-to-leaf path for a
/// BatchedLanguageModel; otherwise one `next_token_probabilities` per node. Rows come back
/// as views of the model's storage when it returns a reference or a RowsView of scalar T,
/// otherwise they are copied (converted) into `workspace.rows`; they stay valid until the
/// next call on the model or the workspace. Throws errc::invalid_size if the model returns
/// the wrong number or width of rows. Row contents are not validated here.
template <ProbabilityScalar T, LanguageModel Target>
TreeScores<T> score_tree_rows(Target& target, std::span<const token_id> context,
                              const TokenTreeView& tree, std::size_t vocab_size,
                              TreeScoringWorkspace<T>& workspace,
                              std::size_t step = RowLocation::npos) {
  const std::size_t nodes = tree.size();
  if constexpr (TreeScoringModel<Target>) {
    using Result = decltype(target.score_tree(context, tree));
    decltype(auto) scored = target.score_tree(context, tree);
    const auto view = as_rows(scored);
    detail::check_scored_shape(view.rows(), view.cols(), nodes, vocab_size, "score_tree", step);
    using U = typename decltype(view)::value_type;
    constexpr bool is_view = std::is_lvalue_reference_v<Result> ||
                             std::is_same_v<std::remove_cvref_t<Result>, RowsView<const U>> ||
                             std::is_same_v<std::remove_cvref_t<Result>, RowsView<U>>;
    if constexpr (is_view && std::is_same_v<U, T>) {
      return {view, 1};
    } else {
      workspace.rows.resize(nodes * vocab_size);
      for (std::size_t i = 0; i < nodes; ++i) {
        detail::copy_row_into(std::span<const U>(view.row(i)), workspace.rows, i, vocab_size);
      }
      return {RowsView<const T>(workspace.rows.data(), nodes, vocab_size), 1};
    }
  } else if constexpr (BatchedLanguageModel<Target>) {
    workspace.rows.resize(nodes * vocab_size);
    workspace.filled.assign(nodes, 0);
    // Leaves are the nodes that are nobody's parent.
    std::vector<unsigned char>& is_parent = workspace.filled;
    for (std::size_t i = 1; i < nodes; ++i) is_parent[tree.parents[i]] = 1;
    std::size_t calls = 0;
    for (std::size_t leaf = 0; leaf < nodes; ++leaf) {
      if (is_parent[leaf] & 1U) continue;
      workspace.path.clear();
      tree.append_path(leaf, workspace.path);
      decltype(auto) scored = target.score_draft(
          context, std::span<const token_id>(workspace.path.data(), workspace.path.size()));
      ++calls;
      const auto view = as_rows(scored);
      using U = typename decltype(view)::value_type;
      detail::check_scored_shape(view.rows(), view.cols(), workspace.path.size() + 1, vocab_size,
                                 "score_draft", step);
      for (std::size_t at = leaf;; at = tree.parents[at]) {
        if ((is_parent[at] & 2U) == 0) {
          detail::copy_row_into(std::span<const U>(view.row(tree.depths[at])), workspace.rows, at,
                                vocab_size);
          is_parent[at] = static_cast<unsigned char>(is_parent[at] | 2U);
        }
        if (at == 0) break;
      }
    }
    return {RowsView<const T>(workspace.rows.data(), nodes, vocab_size), calls};
  } else {
    workspace.rows.resize(nodes * vocab_size);
    workspace.sequence.assign(context.begin(), context.end());
    for (std::size_t node = 0; node < nodes; ++node) {
      workspace.sequence.resize(context.size());
      tree.append_path(node, workspace.sequence);
      decltype(auto) row = target.next_token_probabilities(
          std::span<const token_id>(workspace.sequence.data(), workspace.sequence.size()));
      const auto values = as_span(row);
      detail::check_scored_shape(1, values.size(), 1, vocab_size, "next_token_probabilities", step);
      detail::copy_row_into(values, workspace.rows, node, vocab_size);
    }
    return {RowsView<const T>(workspace.rows.data(), nodes, vocab_size), nodes};
  }
}

// ---------------------------------------------------------------------------------------
// One tree decoding step and a small generation loop
// ---------------------------------------------------------------------------------------

/// Options of a tree decoding step.
struct TreeOptions {
  /// The draft tree shape; a chain (TreeShape::chain(gamma)) is Algorithm 1.
  TreeShape shape = TreeShape::chain(4);
  /// How sampled trees draw children: without_replacement or with_replacement.
  expansion sampling = expansion::without_replacement;
  /// With replacement: repeated draws as counts (true) or duplicate nodes (false).
  bool merge_repeats = true;
  /// Greedy decoding (T = 0): top-k drafting (one_hot) and argmax verification.
  bool greedy = false;
  /// Validate every model row (draft rows as drawn, target rows after scoring).
  bool validate = true;
  /// How stochastic steps verify the tree: automatic (the default) and block use traversal
  /// verification (traversal_verification.hpp: whole paths from the leaves up; exact, and
  /// never fewer accepted drafts in expectation) for sampled trees; token uses recursive
  /// rejection (verify_tree). Trees of one_hot candidates (proposal trees) use recursive
  /// rejection under automatic, traversal under block.
  verification_rule verification = verification_rule::automatic;
};

/// Every buffer a tree step needs; reuse one per decoding loop (no allocation once warm).
template <ProbabilityScalar T>
struct TreeStepWorkspace {
  DraftTree<T> tree;
  DraftTreeWorkspace<T> drafting;
  TreeScoringWorkspace<T> scoring;
  TreeVerificationWorkspace<T> verification;
  TraversalWorkspace<T> traversal;
  std::vector<T> transformed_rows;  ///< target rows after a non-identity row transform
  std::vector<token_id> emitted;
};

/// What one tree step emitted and cost.
struct TreeStepResult {
  /// Emitted tokens: the accepted draft path, then t. A view of the workspace, valid until
  /// the next step with it.
  std::span<const token_id> tokens;
  TreeVerificationResult verification;  ///< n (accepted depth), last node, t, source
  std::size_t nodes_scored = 0;         ///< draft nodes in the tree (target rows - 1)
  std::size_t target_calls = 0;         ///< 1 with score_tree (see score_tree_rows)
  std::size_t draft_calls = 0;          ///< expanded nodes (0 for a caller-built tree)

  /// n: accepted draft tokens (tokens.size() == accepted() + 1).
  [[nodiscard]] std::size_t accepted() const noexcept { return verification.accepted; }
  /// Provenance of tokens[i]: draft for i < n, then correction or bonus.
  [[nodiscard]] token_source source(std::size_t i) const noexcept {
    return i < verification.accepted ? token_source::draft : verification.source;
  }
};

namespace detail {

/// A proposal-only drafter that is not also a LanguageModel (such a type drafts from its
/// q rows).
template <class D>
concept proposal_only_drafter = ProposalDrafter<D> && !LanguageModel<D>;

/// Whether a caller-built tree is verified by traversal: always under block, never under
/// token; under automatic when its root's children were sampled (not one_hot proposals).
template <class T>
[[nodiscard]] bool uses_traversal(const DraftTree<T>& tree, const TreeOptions& options) noexcept {
  if (options.verification != verification_rule::automatic) {
    return options.verification == verification_rule::block;
  }
  const expansion kind = tree.expansion_of(DraftTree<T>::root);
  return kind == expansion::with_replacement || kind == expansion::without_replacement;
}

template <class Draft>
void check_draft_vocabulary(const Draft& draft, std::size_t vocab_size) {
  const auto draft_vocab = static_cast<std::size_t>(draft.vocab_size());
  if (draft_vocab != vocab_size) {
    throw_error(errc::vocab_mismatch, "draft model has vocabulary size ", draft_vocab,
                ", the target ", vocab_size);
  }
}

template <class T, class Target, class G, class RowTransform>
TreeStepResult score_and_verify(Target& target, std::span<const token_id> context,
                                const DraftTree<T>& tree, bool greedy, bool traversal,
                                bool validate_target, bool validate_tree, G& g,
                                TreeStepWorkspace<T>& workspace, std::size_t step,
                                RowTransform& transform) {
  const auto target_vocab = static_cast<std::size_t>(target.vocab_size());
  if (target_vocab != tree.vocab_size()) {
    throw_error(errc::vocab_mismatch, "target model has vocabulary size ", target_vocab,
                ", the draft tree ", tree.vocab_size());
  }
  TreeScores<T> scores =
      score_tree_rows(target, context, tree.view(), tree.vocab_size(), workspace.scoring, step);
  if (validate_target) validate_target_rows_for_tree(tree, scores.rows, step);
  if (validate_tree && !greedy) validate_draft_tree(tree, step);
  if constexpr (!std::is_same_v<std::remove_cvref_t<RowTransform>, IdentityRows>) {
    // Greedy verification needs only the argmax, which standardization keeps.
    if (!greedy) {
      const std::size_t vocab_size = tree.vocab_size();
      workspace.transformed_rows.resize(scores.rows.rows() * vocab_size);
      for (std::size_t i = 0; i < scores.rows.rows(); ++i) {
        transform(std::span<const T>(scores.rows.row(i)),
                  std::span<T>(workspace.transformed_rows.data() + i * vocab_size, vocab_size));
      }
      scores.rows =
          RowsView<const T>(workspace.transformed_rows.data(), scores.rows.rows(), vocab_size);
    }
  }
  TreeStepResult result;
  result.verification = greedy      ? verify_tree_greedy(tree, scores.rows)
                        : traversal ? verify_traversal(tree, scores.rows, g, workspace.traversal)
                                    : verify_tree(tree, scores.rows, g, workspace.verification);
  workspace.emitted.clear();
  append_emitted(tree, result.verification, workspace.emitted);
  result.tokens = workspace.emitted;
  result.nodes_scored = tree.draft_size();
  result.target_calls = scores.target_calls;
  return result;
}

}  // namespace detail

/// Scores a caller-built tree (e.g. n-gram proposals inserted with insert_path) with the
/// target and verifies it: stochastically (verify_tree) or, with options.greedy, by argmax.
/// With options.validate, checks the target rows and the tree's draft side first (as
/// verify_tree_checked). `options.shape` and `options.sampling` are not used. `step` labels
/// error messages. Throws specdec::error (vocab_mismatch, invalid_size, row errors).
template <ProbabilityScalar T, LanguageModel Target, std::uniform_random_bit_generator G>
TreeStepResult verify_tree_step(Target& target, std::span<const token_id> context,
                                const DraftTree<T>& tree, const TreeOptions& options, G& g,
                                TreeStepWorkspace<T>& workspace,
                                std::size_t step = RowLocation::npos) {
  IdentityRows identity;
  return detail::score_and_verify(target, context, tree, options.greedy,
                                  detail::uses_traversal(tree, options), options.validate,
                                  options.validate, g, workspace, step, identity);
}

/// One tree decoding step: drafts a tree of options.shape from `draft` (sampled, or top-k
/// when options.greedy) given the accepted `context`, scores it with `target` (one call
/// for a TreeScoringModel) and verifies it.
///
/// `transform(raw, out)` is applied to every draft row before children are drawn from it
/// and to every target row before verification: pass the decoder's standardization
/// (temperature, top-k, top-p, ...) so both sides get the same transform (paper Sec. 2.2).
/// It is not applied with options.greedy (top-k drafting and argmax verification use the
/// raw order). With options.validate every raw draft row is checked as it arrives and every
/// raw target row before verification. Throws specdec::error for a vocabulary mismatch,
/// bad rows and bad options. `step` labels error messages.
template <ProbabilityScalar T, LanguageModel Target, LanguageModel Draft,
          std::uniform_random_bit_generator G, class RowTransform = IdentityRows>
TreeStepResult tree_step(Target& target, Draft& draft, std::span<const token_id> context,
                         const TreeOptions& options, G& g, TreeStepWorkspace<T>& workspace,
                         std::size_t step = RowLocation::npos, RowTransform&& transform = {}) {
  const auto vocab_size = static_cast<std::size_t>(target.vocab_size());
  detail::check_draft_vocabulary(draft, vocab_size);
  workspace.tree.reset(vocab_size);
  DraftTreeOptions drafting;
  drafting.sampling = options.sampling;
  drafting.merge_repeats = options.merge_repeats;
  drafting.validate_rows = options.validate;
  drafting.step = step;
  const std::size_t draft_calls =
      options.greedy ? build_top_k_tree(draft, context, options.shape, workspace.tree,
                                        workspace.drafting, drafting)
                     : build_sampled_tree(draft, context, options.shape, g, workspace.tree,
                                          workspace.drafting, drafting, transform);
  // The builders drew every candidate from the row they stored: no tree check needed.
  TreeStepResult result =
      detail::score_and_verify(target, context, workspace.tree, options.greedy,
                               options.verification != verification_rule::token, options.validate,
                               false, g, workspace, step, transform);
  result.draft_calls = draft_calls;
  return result;
}

/// One tree decoding step with a proposal-only drafter (n-gram tables, prompt lookup): a
/// proposal tree of ProposalTreeLimits::from_shape(options.shape) (one continuation per
/// root-to-leaf path of the shape, its depth, its node count; build_proposal_tree, several
/// continuations from a MultiProposalDrafter, one from a plain ProposalDrafter) is drafted
/// from the accepted `context`, scored with `target` (one call for a TreeScoringModel) and
/// verified exactly (one_hot candidates: accept c with probability r(c), then drop c from
/// r) or, with options.greedy, by argmax. `transform` applies to the target rows only (the
/// candidates carry no q rows) and not with options.greedy; options.sampling and
/// options.merge_repeats are not used. draft_calls is 1 (0 for a shape without draft
/// nodes). A type that is also a LanguageModel takes the overload above. Throws
/// specdec::error as build_proposal_tree (bad continuations) and tree_step (bad target
/// rows, vocabulary size) do.
template <ProbabilityScalar T, LanguageModel Target, detail::proposal_only_drafter Draft,
          std::uniform_random_bit_generator G, class RowTransform = IdentityRows>
TreeStepResult tree_step(Target& target, Draft& drafter, std::span<const token_id> context,
                         const TreeOptions& options, G& g, TreeStepWorkspace<T>& workspace,
                         std::size_t step = RowLocation::npos, RowTransform&& transform = {}) {
  workspace.tree.reset(static_cast<std::size_t>(target.vocab_size()));
  const ProposalTreeLimits limits = ProposalTreeLimits::from_shape(options.shape);
  (void)build_proposal_tree(drafter, context, limits, workspace.tree, workspace.drafting, step);
  // One_hot candidates have no stored rows to check.
  TreeStepResult result =
      detail::score_and_verify(target, context, workspace.tree, options.greedy,
                               options.verification == verification_rule::block, options.validate,
                               false, g, workspace, step, transform);
  result.draft_calls = limits.max_depth > 0 ? 1 : 0;
  return result;
}

/// Running totals over tree steps; what SpeculativeDecoder reports for trees.
struct TreeStatistics {
  std::size_t steps = 0;
  std::size_t target_calls = 0;
  std::size_t draft_calls = 0;
  std::size_t nodes_scored = 0;     ///< draft nodes scored, summed over steps
  std::size_t accepted_tokens = 0;  ///< accepted draft tokens, summed over steps
  std::size_t emitted_tokens = 0;   ///< accepted + 1 per step (before max/stop truncation)
  std::size_t residual_fallbacks = 0;
  /// accepted_depth_histogram[n] = steps whose accepted depth was n.
  std::vector<std::size_t> accepted_depth_histogram;

  void record(const TreeStepResult& step) {
    ++steps;
    target_calls += step.target_calls;
    draft_calls += step.draft_calls;
    nodes_scored += step.nodes_scored;
    accepted_tokens += step.accepted();
    emitted_tokens += step.tokens.size();
    residual_fallbacks += step.verification.residual_fallback ? 1U : 0U;
    if (accepted_depth_histogram.size() <= step.accepted()) {
      accepted_depth_histogram.resize(step.accepted() + 1, 0);
    }
    ++accepted_depth_histogram[step.accepted()];
  }
  /// Mean tokens per step (accepted depth + 1): tokens per target call with score_tree.
  [[nodiscard]] double tokens_per_step() const noexcept {
    return steps == 0 ? 0.0 : static_cast<double>(emitted_tokens) / static_cast<double>(steps);
  }
  [[nodiscard]] double tokens_per_target_call() const noexcept {
    return target_calls == 0
               ? 0.0
               : static_cast<double>(emitted_tokens) / static_cast<double>(target_calls);
  }
  [[nodiscard]] double mean_accepted_depth() const noexcept {
    return steps == 0 ? 0.0 : static_cast<double>(accepted_tokens) / static_cast<double>(steps);
  }
  /// Draft nodes scored per step (= per target call with score_tree).
  [[nodiscard]] double nodes_per_step() const noexcept {
    return steps == 0 ? 0.0 : static_cast<double>(nodes_scored) / static_cast<double>(steps);
  }
};

/// Options of generate_with_tree.
struct TreeGenerationOptions {
  std::size_t max_new_tokens = 64;
  std::vector<token_id> stop_tokens;  ///< generation ends after emitting any of these
  TreeOptions tree;
};

/// Output of generate_with_tree: the new tokens (prompt excluded) and the statistics.
struct TreeGeneration {
  std::vector<token_id> tokens;
  TreeStatistics statistics;
  bool stopped = false;  ///< ended at a stop token (the stop token is included)
};

/// Generates up to max_new_tokens after `prompt` with tree steps (tree_step), stopping
/// after a stop token. `draft` is a draft LanguageModel (sampled or top-k trees) or a
/// proposal-only drafter (proposal trees; MultiProposalDrafter for several branches).
/// Tokens of a step beyond the limit or after a stop token are dropped (a prefix of an
/// exact sample is exact). Rows are used in scalar type T (default: the target's). Throws
/// specdec::error as tree_step does.
template <ProbabilityScalar T, LanguageModel Target, Drafter Draft,
          std::uniform_random_bit_generator G>
TreeGeneration generate_with_tree(Target& target, Draft& draft, std::span<const token_id> prompt,
                                  const TreeGenerationOptions& options, G& g) {
  TreeGeneration generation;
  TreeStepWorkspace<T> workspace;
  std::vector<token_id> context(prompt.begin(), prompt.end());
  context.reserve(prompt.size() + options.max_new_tokens + options.tree.shape.max_depth() + 1);
  const auto is_stop = [&](token_id token) {
    return std::find(options.stop_tokens.begin(), options.stop_tokens.end(), token) !=
           options.stop_tokens.end();
  };
  while (generation.tokens.size() < options.max_new_tokens && !generation.stopped) {
    const TreeStepResult step =
        tree_step(target, draft, std::span<const token_id>(context.data(), context.size()),
                  options.tree, g, workspace, generation.statistics.steps);
    generation.statistics.record(step);
    for (const token_id token : step.tokens) {
      if (generation.tokens.size() == options.max_new_tokens) break;
      generation.tokens.push_back(token);
      context.push_back(token);
      if (is_stop(token)) {
        generation.stopped = true;
        break;
      }
    }
  }
  return generation;
}

/// generate_with_tree with rows in the target's scalar type.
template <LanguageModel Target, Drafter Draft, std::uniform_random_bit_generator G>
TreeGeneration generate_with_tree(Target& target, Draft& draft, std::span<const token_id> prompt,
                                  const TreeGenerationOptions& options, G& g) {
  return generate_with_tree<detail::model_row_scalar_t<Target>>(target, draft, prompt, options, g);
}

}  // namespace specdec
