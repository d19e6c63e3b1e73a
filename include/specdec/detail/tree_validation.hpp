// specdec — private: the consistency checks of a draft tree and of its target rows, shared
// by the checked tree verifiers (verify_tree_checked, verify_traversal_checked) and the tree
// step.
#pragma once

#include <cstddef>
#include <span>

#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/rows.hpp"
#include "specdec/validation.hpp"

namespace specdec {

namespace detail {

/// The draft-side consistency checks of a tree: stored q rows are valid probability rows
/// and every sampled candidate can come from its q_i (q_i(c) > 0; no duplicates without
/// replacement).
template <class T>
void validate_draft_tree(const DraftTree<T>& tree, std::size_t step) {
  constexpr std::size_t npos = DraftTree<T>::npos;
  for (std::size_t node = 0; node < tree.size(); ++node) {
    const expansion kind = tree.expansion_of(node);
    if (kind != expansion::with_replacement && kind != expansion::without_replacement) continue;
    const std::span<const T> q = tree.draft_row(node);
    validate_probability_row(q, tree.vocab_size(), RowLocation{"draft", step, node});
    for (std::size_t child = tree.first_child(node); child != npos;
         child = tree.next_sibling(child)) {
      const token_id token = tree.token(child);
      if (!(q[static_cast<std::size_t>(token)] > T(0))) {
        throw_error(errc::invalid_token, describe_location({"draft", step, child}, "node"),
                    ": token ", token, " has q = 0 at its parent ", node,
                    ", so it cannot have been drawn from q");
      }
      if (kind == expansion::without_replacement) {
        for (std::size_t earlier = tree.first_child(node); earlier != child;
             earlier = tree.next_sibling(earlier)) {
          if (tree.token(earlier) == token) {
            throw_error(errc::invalid_token, describe_location({"draft", step, child}, "node"),
                        ": token ", token, " repeats sibling ", earlier,
                        " under a without_replacement node");
          }
        }
      }
    }
  }
}

template <class T>
void validate_target_rows_for_tree(const DraftTree<T>& tree, RowsView<const T> target_rows,
                                   std::size_t step) {
  if (target_rows.cols() != tree.vocab_size()) {
    throw_error(errc::vocab_mismatch, "target rows have ", target_rows.cols(),
                " entries but the draft tree's vocabulary size is ", tree.vocab_size());
  }
  validate_probability_rows(target_rows, tree.size(), tree.vocab_size(), {"target", step});
}

}  // namespace detail

}  // namespace specdec
