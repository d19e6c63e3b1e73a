// Tests for include/specdec/draft_tree.hpp: tree shapes, the DraftTree type (links, paths,
// repeats, proposal tries, the model-facing view), and the builders (sampled with and
// without replacement, top-k), including the law of the drawn children.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::expansion;
using specdec::token_id;
using specdec::TreeShape;

/// A draft whose row depends on the last token only (row 0 for the empty context) and
/// which records every context it is asked about.
template <class T>
struct RecordingBigram {
  std::vector<std::vector<T>> table;
  std::vector<std::vector<token_id>> contexts;
  bool record = true;

  [[nodiscard]] std::size_t vocab_size() const { return table.size(); }
  std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    if (record) contexts.emplace_back(context.begin(), context.end());
    return table[context.empty() ? 0 : static_cast<std::size_t>(context.back())];
  }
};

template <class T>
RecordingBigram<T> make_bigram() {
  RecordingBigram<T> model;
  model.table = {{T(0.5), T(0.25), T(0.125), T(0.125)},
                 {T(0.1), T(0.2), T(0.3), T(0.4)},
                 {T(0), T(0), T(1), T(0)},
                 {T(0.25), T(0.25), T(0.25), T(0.25)}};
  return model;
}

template <class T>
std::vector<token_id> path_of(const specdec::DraftTree<T>& tree, std::size_t node) {
  std::vector<token_id> out;
  tree.append_path(node, out);
  return out;
}

}  // namespace

TEST_CASE("TreeShape: chains, per-depth branching and explicit parents", "[draft_tree]") {
  const TreeShape root_only;
  CHECK(root_only.size() == 1);
  CHECK(root_only.draft_size() == 0);
  CHECK(root_only.max_depth() == 0);

  const TreeShape chain = TreeShape::chain(5);
  CHECK(chain.draft_size() == 5);
  CHECK(chain.max_depth() == 5);
  CHECK(chain.is_chain());
  CHECK(chain == TreeShape::branching({1, 1, 1, 1, 1}));

  const TreeShape shape = TreeShape::branching({4, 2, 1, 1});
  CHECK(shape.draft_size() == 4 + 8 + 8 + 8);
  CHECK(shape.max_depth() == 4);
  CHECK_FALSE(shape.is_chain());
  CHECK(shape.child_count(0) == 4);
  for (const std::size_t child : shape.children(0)) {
    CHECK(shape.depth(child) == 1);
    CHECK(shape.child_count(child) == 2);
    CHECK(shape.parent(child) == 0);
  }
  const std::size_t leaf = shape.size() - 1;
  CHECK(shape.depth(leaf) == 4);
  CHECK(shape.child_count(leaf) == 0);

  // A spine with an extra sibling at the root: 0 -> {1, 2}, 1 -> 3 -> 4.
  const TreeShape spine = TreeShape::from_parents({TreeShape::npos, 0, 0, 1, 3});
  CHECK(spine.draft_size() == 4);
  CHECK(spine.max_depth() == 3);
  CHECK(spine.children(0).size() == 2);
  CHECK(spine.children(1)[0] == 3);
  CHECK(spine.child_count(2) == 0);
}

TEST_CASE("TreeShape rejects bad shapes with clear errors", "[draft_tree][errors]") {
  CHECK_THROWS_WITH(TreeShape::branching({2, 0, 1}),
                    Catch::Matchers::ContainsSubstring("entry 1 (depth 1) is 0"));
  CHECK_THROWS_WITH(TreeShape::from_parents({TreeShape::npos, 0, 2}),
                    Catch::Matchers::ContainsSubstring("node 2 has parent 2"));
  CHECK_THROWS_AS(TreeShape::from_parents({0, 0}), specdec::error);
  CHECK_THROWS_AS(TreeShape::branching({256, 256, 256}), specdec::error);
  CHECK_THROWS_AS(TreeShape::chain(specdec::max_tree_nodes), specdec::error);
  try {
    (void)TreeShape::branching({3, 0});
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::invalid_option);
  }
}

TEMPLATE_TEST_CASE("DraftTree: links, depths, paths and the model view", "[draft_tree]", float,
                   double) {
  using Tree = specdec::DraftTree<TestType>;
  Tree tree(4);
  CHECK(tree.size() == 1);
  CHECK(tree.token(Tree::root) == specdec::no_token);
  const std::vector<TestType> q{TestType(0.25), TestType(0.25), TestType(0.25), TestType(0.25)};
  tree.expand(Tree::root, expansion::without_replacement, q);
  const std::size_t a = tree.add_child(Tree::root, 2);
  const std::size_t b = tree.add_child(Tree::root, 0);
  tree.expand(a, expansion::one_hot);
  const std::size_t c = tree.add_child(a, 3);
  const std::size_t d = tree.add_child(a, 1);

  CHECK(tree.size() == 5);
  CHECK(tree.draft_size() == 4);
  CHECK(tree.max_depth() == 2);
  CHECK(tree.first_child(Tree::root) == a);
  CHECK(tree.next_sibling(a) == b);
  CHECK(tree.next_sibling(b) == Tree::npos);
  CHECK(tree.child_count(a) == 2);
  CHECK(tree.parent(d) == a);
  CHECK(tree.depth(d) == 2);
  CHECK(tree.expansion_of(Tree::root) == expansion::without_replacement);
  CHECK(tree.expansion_of(a) == expansion::one_hot);
  CHECK(tree.expansion_of(b) == expansion::none);
  CHECK(tree.draft_row(Tree::root).size() == 4);
  CHECK(tree.draft_row(a).empty());
  CHECK(path_of(tree, d) == std::vector<token_id>{2, 1});
  CHECK(path_of(tree, Tree::root).empty());
  CHECK(tree.find_child(a, 3) == c);
  CHECK(tree.find_child(a, 0) == Tree::npos);

  const specdec::TokenTreeView view = tree.view();
  REQUIRE(view.size() == 5);
  CHECK(view.tokens[0] == specdec::no_token);
  CHECK(view.parents[0] == specdec::TokenTreeView::npos);
  for (std::size_t i = 1; i < view.size(); ++i) {
    CHECK(view.parents[i] < i);
    CHECK(view.depths[i] == view.depths[view.parents[i]] + 1);
  }

  tree.clear();
  CHECK(tree.size() == 1);
  CHECK(tree.first_child(Tree::root) == Tree::npos);
  CHECK(tree.expansion_of(Tree::root) == expansion::none);
}

TEST_CASE("DraftTree: repeats are counted at the position they were drawn", "[draft_tree]") {
  specdec::DraftTree<double> tree(3);
  tree.expand(0, expansion::with_replacement, std::vector<double>{0.5, 0.3, 0.2});
  // Draw sequence: 1, 1, 2, 1, 2.
  const std::size_t first = tree.add_child(0, 1);
  tree.add_repeat(0);
  const std::size_t second = tree.add_child(0, 2);
  tree.add_repeat(0);
  tree.add_repeat(0);
  CHECK(tree.repeats_before(first) == 0);
  CHECK(tree.repeats_before(second) == 1);
  CHECK(tree.trailing_repeats(0) == 2);
  CHECK(tree.draws(0) == 5);
}

TEST_CASE("DraftTree: insert_path builds a one_hot trie of proposals", "[draft_tree]") {
  specdec::DraftTree<float> tree(10);
  const std::array<token_id, 3> first{4, 5, 6};
  const std::array<token_id, 3> second{4, 5, 7};
  const std::array<token_id, 2> third{8, 1};
  const std::size_t end1 = tree.insert_path(first);
  const std::size_t end2 = tree.insert_path(second);
  const std::size_t end3 = tree.insert_path(third);
  CHECK(tree.insert_path(first) == end1);  // already present
  CHECK(tree.draft_size() == 6);           // 4, 5, 6, 7, 8, 1
  CHECK(path_of(tree, end1) == std::vector<token_id>(first.begin(), first.end()));
  CHECK(path_of(tree, end2) == std::vector<token_id>(second.begin(), second.end()));
  CHECK(path_of(tree, end3) == std::vector<token_id>(third.begin(), third.end()));
  CHECK(tree.parent(end1) == tree.parent(end2));
  CHECK(tree.child_count(0) == 2);
  for (std::size_t node = 0; node < tree.size(); ++node) {
    if (tree.child_count(node) > 0) CHECK(tree.expansion_of(node) == expansion::one_hot);
  }
}

TEST_CASE("DraftTree: misuse throws errors naming the node", "[draft_tree][errors]") {
  specdec::DraftTree<double> tree(3);
  const std::vector<double> q{0.2, 0.3, 0.5};
  CHECK_THROWS_WITH(tree.add_child(0, 1),
                    Catch::Matchers::ContainsSubstring("node 0 is not expanded"));
  tree.expand(0, expansion::with_replacement, q);
  CHECK_THROWS_AS(tree.expand(0, expansion::one_hot), specdec::error);
  CHECK_THROWS_WITH(tree.add_child(0, 3),
                    Catch::Matchers::ContainsSubstring("token 3 under node 0"));
  CHECK_THROWS_AS(tree.add_child(7, 0), specdec::error);
  CHECK_THROWS_AS(tree.add_repeat(0), specdec::error);  // no child yet
  const std::size_t child = tree.add_child(0, 1);
  CHECK_THROWS_AS(tree.expand(child, expansion::with_replacement, std::vector<double>{1.0}),
                  specdec::error);                                       // wrong row length
  CHECK_THROWS_AS(tree.expand(child, expansion::none), specdec::error);  // needs a q row
  CHECK_THROWS_AS(tree.insert_path(std::array<token_id, 1>{2}), specdec::error);  // sampled root
}

TEMPLATE_TEST_CASE("build_sampled_tree without replacement follows the shape depth-first",
                   "[draft_tree][builders]", float, double) {
  auto draft = make_bigram<TestType>();
  specdec::DraftTree<TestType> tree(4);
  specdec::DraftTreeWorkspace<TestType> workspace;
  specdec::xoshiro256pp g(11);
  const std::vector<token_id> context{3, 1};
  const TreeShape shape = TreeShape::branching({3, 2});
  for (int round = 0; round < 50; ++round) {
    draft.contexts.clear();
    const std::size_t calls =
        specdec::build_sampled_tree(draft, context, shape, g, tree, workspace);
    CHECK(calls == draft.contexts.size());
    CHECK(tree.expansion_of(0) == expansion::without_replacement);
    CHECK(tree.child_count(0) == 3);
    std::size_t expanded = 0;
    for (std::size_t node = 0; node < tree.size(); ++node) {
      if (tree.child_count(node) == 0) continue;
      ++expanded;
      CHECK(tree.depth(node) < 2);
      // The stored row is the draft's row for context + path(node).
      std::vector<token_id> sequence = context;
      tree.append_path(node, sequence);
      const auto& expected = draft.table[static_cast<std::size_t>(sequence.back())];
      const auto stored = tree.draft_row(node);
      CHECK(std::vector<TestType>(stored.begin(), stored.end()) == expected);
      // Children are distinct and have q > 0; as many as the support allows.
      std::size_t positive = 0;
      for (const TestType value : expected) positive += value > 0 ? 1U : 0U;
      const std::size_t wanted = tree.depth(node) == 0 ? 3 : 2;
      CHECK(tree.child_count(node) == std::min(wanted, positive));
      for (std::size_t c = tree.first_child(node); c != tree.npos; c = tree.next_sibling(c)) {
        CHECK(expected[static_cast<std::size_t>(tree.token(c))] > 0);
        for (std::size_t e = tree.first_child(node); e != c; e = tree.next_sibling(e)) {
          CHECK(tree.token(e) != tree.token(c));
        }
      }
    }
    CHECK(calls == expanded);
    // Depth-first: the context itself first, then context + first root child.
    REQUIRE(draft.contexts.size() >= 2);
    CHECK(draft.contexts[0] == context);
    std::vector<token_id> first_child_context = context;
    first_child_context.push_back(tree.token(tree.first_child(0)));
    CHECK(draft.contexts[1] == first_child_context);
  }
}

TEST_CASE("build_sampled_tree with replacement: repeats merged or kept as nodes",
          "[draft_tree][builders]") {
  auto draft = make_bigram<double>();
  draft.record = false;
  specdec::DraftTree<double> tree(4);
  specdec::DraftTreeWorkspace<double> workspace;
  specdec::xoshiro256pp g(5);
  const std::vector<token_id> context{2};  // row 2 is one-hot on token 2
  const TreeShape shape = TreeShape::branching({4, 3});
  specdec::DraftTreeOptions options;
  options.sampling = expansion::with_replacement;
  (void)specdec::build_sampled_tree(draft, context, shape, g, tree, workspace, options);
  CHECK(tree.child_count(0) == 1);  // four draws of token 2: one child, three repeats
  CHECK(tree.trailing_repeats(0) == 3);
  CHECK(tree.draws(0) == 4);
  for (std::size_t node = 0; node < tree.size(); ++node) {
    if (tree.child_count(node) > 0) CHECK(tree.draws(node) == (node == 0 ? 4U : 3U));
  }
  options.merge_repeats = false;
  (void)specdec::build_sampled_tree(draft, context, shape, g, tree, workspace, options);
  CHECK(tree.child_count(0) == 4);
  CHECK(tree.draft_size() == 4 + 4 * 3);
  for (std::size_t c = tree.first_child(0); c != tree.npos; c = tree.next_sibling(c)) {
    CHECK(tree.token(c) == 2);
  }
}

namespace {

/// Counts the ordered pair of the first two draws at the root (a repeat shows as b == a)
/// over `samples` trees built with `sampling` (merge_repeats on).
std::vector<std::uint64_t> count_root_pairs(expansion sampling, std::size_t samples,
                                            std::uint64_t seed) {
  auto draft = make_bigram<double>();
  draft.record = false;
  specdec::DraftTree<double> tree(4);
  specdec::DraftTreeWorkspace<double> workspace;
  specdec::xoshiro256pp g(seed);
  specdec::DraftTreeOptions options;
  options.sampling = sampling;
  const TreeShape shape = TreeShape::branching({2});
  std::vector<std::uint64_t> counts(16, 0);
  for (std::size_t i = 0; i < samples; ++i) {
    (void)specdec::build_sampled_tree(draft, std::span<const token_id>{}, shape, g, tree, workspace,
                                      options);
    const std::size_t first = tree.first_child(0);
    const std::size_t second = tree.next_sibling(first);
    const auto a = static_cast<std::size_t>(tree.token(first));
    const auto b = second == tree.npos ? a : static_cast<std::size_t>(tree.token(second));
    ++counts[a * 4 + b];
  }
  return counts;
}

}  // namespace

TEST_CASE("Sampled children follow q_i: i.i.d. with replacement, renormalised without",
          "[draft_tree][builders][statistical]") {
  const std::array<double, 4> q{0.5, 0.25, 0.125, 0.125};  // make_bigram's row 0
  std::vector<double> with_law(16, 0.0);
  std::vector<double> without_law(16, 0.0);
  for (std::size_t a = 0; a < 4; ++a) {
    for (std::size_t b = 0; b < 4; ++b) {
      with_law[a * 4 + b] = q[a] * q[b];
      if (a != b) without_law[a * 4 + b] = q[a] * q[b] / (1.0 - q[a]);
    }
  }
  // The two laws differ by TV 0.34375 (all repeats); detect a tenth of that.
  const std::size_t samples = specdec::testing::samples_to_detect(0.03, 15.0);
  const auto with_counts = count_root_pairs(expansion::with_replacement, samples, 21);
  const auto without_counts = count_root_pairs(expansion::without_replacement, samples, 22);

  const auto with_fit = specdec::testing::chi_square_test(with_counts, with_law);
  INFO(with_fit.describe());
  CHECK(with_fit.passed());
  const auto without_fit = specdec::testing::chi_square_test(without_counts, without_law);
  INFO(without_fit.describe());
  CHECK(without_fit.passed());

  // Negative controls: each sampler judged by the other's law fails.
  CHECK_FALSE(specdec::testing::chi_square_test(with_counts, without_law).passed());
  CHECK_FALSE(specdec::testing::chi_square_test(without_counts, with_law).passed());
}

TEST_CASE("build_top_k_tree proposes the most probable tokens, lowest id among ties",
          "[draft_tree][builders]") {
  auto draft = make_bigram<float>();
  specdec::DraftTree<float> tree(4);
  specdec::DraftTreeWorkspace<float> workspace;
  const std::vector<token_id> context{3};  // uniform row: ties everywhere
  const std::size_t calls =
      specdec::build_top_k_tree(draft, context, TreeShape::branching({3, 2}), tree, workspace);
  REQUIRE(tree.child_count(0) == 3);
  CHECK(tree.expansion_of(0) == expansion::one_hot);
  CHECK(tree.draft_row(0).empty());
  std::vector<token_id> root_children;
  for (std::size_t c = tree.first_child(0); c != tree.npos; c = tree.next_sibling(c)) {
    root_children.push_back(tree.token(c));
  }
  CHECK(root_children == std::vector<token_id>{0, 1, 2});
  // Under token 1 (row {0.1, 0.2, 0.3, 0.4}): 3 then 2. Under token 2 (one-hot): only 2.
  const std::size_t under1 = tree.find_child(0, 1);
  CHECK(tree.token(tree.first_child(under1)) == 3);
  CHECK(tree.token(tree.next_sibling(tree.first_child(under1))) == 2);
  const std::size_t under2 = tree.find_child(0, 2);
  CHECK(tree.child_count(under2) == 1);
  CHECK(tree.token(tree.first_child(under2)) == 2);
  CHECK(calls == 4);
}

TEST_CASE("Builders validate draft rows", "[draft_tree][builders][errors]") {
  auto draft = make_bigram<double>();
  draft.table[1][2] = std::numeric_limits<double>::quiet_NaN();
  specdec::DraftTree<double> tree(4);
  specdec::DraftTreeWorkspace<double> workspace;
  specdec::xoshiro256pp g(1);
  specdec::DraftTreeOptions options;
  options.step = 7;
  const std::vector<token_id> context{1};
  CHECK_THROWS_WITH(
      specdec::build_sampled_tree(draft, context, TreeShape::chain(2), g, tree, workspace, options),
      Catch::Matchers::ContainsSubstring("draft row 0 (step 7): entry for token 2 is NaN"));
  // The tree adopts the draft's vocabulary.
  specdec::DraftTree<double> other(5);
  auto other_draft = make_bigram<double>();
  (void)specdec::build_top_k_tree(other_draft, context, TreeShape::chain(2), other, workspace);
  CHECK(other.vocab_size() == 4);
  options.sampling = expansion::one_hot;
  CHECK_THROWS_AS(
      specdec::build_sampled_tree(draft, context, TreeShape::chain(2), g, tree, workspace, options),
      specdec::error);
}
