// Bad-input catalogue, token trees (docs/errors.md, rows T*): TreeShape, DraftTree,
// build_sampled_tree, build_top_k_tree, build_proposal_tree, verify_tree_checked,
// verify_tree_greedy_checked, score_tree_rows, tree_step, verify_tree_step,
// generate_with_tree, SpeculativeDecoder with a tree shape. One test case per catalogue row.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_exception.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors_catalogue.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/traversal_verification.hpp"
#include "specdec/tree_verification.hpp"

namespace {

using specdec::errc;
using specdec::token_id;
using specdec::testing::check_error;
using Tree = specdec::DraftTree<double>;
constexpr std::size_t npos = Tree::npos;

// A draft LanguageModel over V = 4 returning a fixed row (valid unless changed).
struct FixedRowModel {
  std::vector<double> row = std::vector<double>(4, 0.25);
  std::size_t vocab = 4;
  [[nodiscard]] std::size_t vocab_size() const { return vocab; }
  std::span<const double> next_token_probabilities(std::span<const token_id>) { return row; }
};

// A tree over V = 4: root sampled without replacement from q = (0.5, 0.5, 0, 0) with
// children 0 and 1.
Tree two_children() {
  Tree tree(4);
  const std::vector<double> q{0.5, 0.5, 0.0, 0.0};
  tree.expand(Tree::root, specdec::expansion::without_replacement, q);
  tree.add_child(Tree::root, 0);
  tree.add_child(Tree::root, 1);
  return tree;
}

// Valid target rows for a tree of `nodes` nodes.
std::vector<double> uniform_rows(std::size_t nodes) {
  return std::vector<double>(nodes * 4, 0.25);
}

}  // namespace

TEST_CASE("T1 TreeShape: a level with no children / too many nodes / or bad parents",
          "[errors][draft_tree]") {
  check_error(
      "T1",
      [] {
        (void)specdec::TreeShape::branching({2, 0, 1});
      },
      errc::invalid_option, "TreeShape::branching: entry 1 (depth 1) is 0");
  check_error(
      "T1",
      [] {
        (void)specdec::TreeShape::branching({1000, 1000});
      },
      errc::invalid_option, "TreeShape::branching: more than ");
  check_error(
      "T1", [] { (void)specdec::TreeShape::chain(std::size_t{1} << 20); }, errc::invalid_option,
      "TreeShape::chain: ");
  check_error(
      "T1",
      [] {
        (void)specdec::TreeShape::from_parents({0, 0});
      },
      errc::invalid_option, "TreeShape::from_parents: entry 0 must be npos (the root)");
  check_error(
      "T1",
      [] {
        (void)specdec::TreeShape::from_parents({npos, 0, 2});
      },
      errc::invalid_option, "TreeShape::from_parents: node 2 has parent 2");
}

TEST_CASE("T2 DraftTree::expand: bad node / wrong row length / wrong kind / expanded twice",
          "[errors][draft_tree]") {
  Tree tree(4);
  const std::vector<double> q{0.25, 0.25, 0.25, 0.25};
  const std::vector<double> short_q{0.5, 0.5};
  check_error(
      "T2", [&] { tree.expand(5, specdec::expansion::with_replacement, q); }, errc::invalid_size,
      "DraftTree::expand: node 5 does not exist (the tree has 1 nodes)");
  check_error(
      "T2", [&] { tree.expand(Tree::root, specdec::expansion::with_replacement, short_q); },
      errc::invalid_size, "DraftTree::expand: draft row of node 0 has 2 entries");
  check_error(
      "T2", [&] { tree.expand(Tree::root, specdec::expansion::one_hot, q); }, errc::invalid_option,
      "a q row belongs to with_replacement or without_replacement");
  check_error(
      "T2", [&] { tree.expand(Tree::root, specdec::expansion::with_replacement); },
      errc::invalid_option, "needs the q row its children are drawn from");
  tree.expand(Tree::root, specdec::expansion::with_replacement, q);
  check_error(
      "T2", [&] { tree.expand(Tree::root, specdec::expansion::with_replacement, q); },
      errc::invalid_option, "DraftTree::expand: node 0");
}

TEST_CASE("T3 DraftTree::add_child / add_repeat / insert_path: misuse", "[errors][draft_tree]") {
  Tree tree(4);
  check_error(
      "T3", [&] { (void)tree.add_child(Tree::root, 1); }, errc::invalid_option,
      "DraftTree::add_child: node 0 is not expanded; call expand() first");
  tree.expand(Tree::root, specdec::expansion::one_hot);
  for (const token_id bad : {4, -1}) {
    check_error(
        "T3", [&] { (void)tree.add_child(Tree::root, bad); }, errc::invalid_token,
        "DraftTree::add_child: token ");
  }
  check_error(
      "T3", [&] { (void)tree.add_child(9, 1); }, errc::invalid_size,
      "DraftTree::add_child: node 9 does not exist");
  check_error(
      "T3", [&] { tree.add_repeat(Tree::root); }, errc::invalid_option,
      "DraftTree::add_repeat: node 0 is not a with_replacement node with children");
  Tree sampled = two_children();
  const std::vector<token_id> path{2};
  check_error(
      "T3", [&] { (void)sampled.insert_path(path); }, errc::invalid_option,
      "DraftTree::insert_path: node 0 has sampled children");
  // A full tree: max_tree_nodes nodes, root included.
  Tree full(4);
  full.expand(Tree::root, specdec::expansion::one_hot);
  while (full.size() < specdec::max_tree_nodes) (void)full.add_child(Tree::root, 2);
  check_error(
      "T3", [&] { (void)full.add_child(Tree::root, 2); }, errc::invalid_size,
      "DraftTree::add_child: the tree already has 65536 nodes");
  CHECK(full.size() == specdec::max_tree_nodes);  // nothing was added
}

TEST_CASE("T4 build_sampled_tree: invalid q row from the draft model", "[errors][draft_tree]") {
  FixedRowModel draft;
  draft.row = {0.5, 0.5, 0.5, 0.0};
  Tree tree;
  specdec::DraftTreeWorkspace<double> workspace;
  specdec::xoshiro256pp g(1);
  const std::vector<token_id> context{1};
  const auto shape = specdec::TreeShape::branching({2});
  check_error(
      "T4",
      [&] {
        (void)specdec::build_sampled_tree(draft, std::span<const token_id>(context), shape, g, tree,
                                          workspace);
      },
      errc::not_normalized, "draft row 0: entries sum to 1.5");
}

TEST_CASE("T5 verify_tree_checked / verify_tree_greedy_checked: row width or count wrong",
          "[errors][tree_verification]") {
  const Tree tree = two_children();
  specdec::TreeVerificationWorkspace<double> workspace;
  specdec::xoshiro256pp g(2);
  const std::vector<double> wide(3 * 5, 0.2);
  check_error(
      "T5",
      [&] {
        (void)specdec::verify_tree_checked(tree, specdec::RowsView<const double>(wide.data(), 3, 5),
                                           g, workspace, 6);
      },
      errc::vocab_mismatch, "target rows have 5 entries but the draft tree's vocabulary size is 4");
  const std::vector<double> two = uniform_rows(2);
  check_error(
      "T5",
      [&] {
        (void)specdec::verify_tree_greedy_checked(
            tree, specdec::RowsView<const double>(two.data(), 2, 4), 6);
      },
      errc::invalid_size, "target rows (step 6): got 2 rows, expected 3");
}

TEST_CASE("T6 verify_tree_checked: invalid target or stored q row", "[errors][tree_verification]") {
  const Tree tree = two_children();
  specdec::TreeVerificationWorkspace<double> workspace;
  specdec::xoshiro256pp g(3);
  std::vector<double> rows = uniform_rows(3);
  rows[4 + 2] = std::numeric_limits<double>::quiet_NaN();
  check_error(
      "T6",
      [&] {
        (void)specdec::verify_tree_checked(tree, specdec::RowsView<const double>(rows.data(), 3, 4),
                                           g, workspace, 6);
      },
      errc::invalid_probability, "target row 1 (step 6): entry for token 2 is NaN");
  Tree bad_q(4);
  const std::vector<double> q{0.5, 0.7, 0.0, 0.0};  // sums to 1.2
  bad_q.expand(Tree::root, specdec::expansion::with_replacement, q);
  bad_q.add_child(Tree::root, 0);
  const std::vector<double> valid = uniform_rows(2);
  check_error(
      "T6",
      [&] {
        (void)specdec::verify_tree_checked(
            bad_q, specdec::RowsView<const double>(valid.data(), 2, 4), g, workspace, 6);
      },
      errc::not_normalized, "draft row 0 (step 6): entries sum to 1.2");
}

TEST_CASE("T7 verify_tree_checked: a sampled child its q cannot produce",
          "[errors][tree_verification]") {
  specdec::TreeVerificationWorkspace<double> workspace;
  specdec::xoshiro256pp g(4);
  const std::vector<double> q{0.5, 0.5, 0.0, 0.0};
  Tree zero_q(4);
  zero_q.expand(Tree::root, specdec::expansion::with_replacement, q);
  zero_q.add_child(Tree::root, 3);  // q(3) = 0
  const std::vector<double> rows = uniform_rows(2);
  check_error(
      "T7",
      [&] {
        (void)specdec::verify_tree_checked(
            zero_q, specdec::RowsView<const double>(rows.data(), 2, 4), g, workspace, 1);
      },
      errc::invalid_token, "draft node 1 (step 1): token 3 has q = 0 at its parent 0");
  Tree repeated(4);
  repeated.expand(Tree::root, specdec::expansion::without_replacement, q);
  repeated.add_child(Tree::root, 1);
  repeated.add_child(Tree::root, 1);
  const std::vector<double> three = uniform_rows(3);
  check_error(
      "T7",
      [&] {
        (void)specdec::verify_tree_checked(
            repeated, specdec::RowsView<const double>(three.data(), 3, 4), g, workspace, 1);
      },
      errc::invalid_token, "token 1 repeats sibling 1 under a without_replacement node");
}

TEST_CASE("T5-T7 verify_traversal_checked: the errors of verify_tree_checked",
          "[errors][traversal_verification]") {
  specdec::TraversalWorkspace<double> workspace;
  specdec::xoshiro256pp g(5);
  const Tree tree = two_children();
  const std::vector<double> wide(3 * 5, 0.2);
  check_error(
      "T5",
      [&] {
        (void)specdec::verify_traversal_checked(
            tree, specdec::RowsView<const double>(wide.data(), 3, 5), g, workspace, 6);
      },
      errc::vocab_mismatch, "target rows have 5 entries but the draft tree's vocabulary size is 4");
  const std::vector<double> two = uniform_rows(2);
  check_error(
      "T5",
      [&] {
        (void)specdec::verify_traversal_checked(
            tree, specdec::RowsView<const double>(two.data(), 2, 4), g, workspace, 6);
      },
      errc::invalid_size, "target rows (step 6): got 2 rows, expected 3");
  std::vector<double> rows = uniform_rows(3);
  rows[4 + 2] = std::numeric_limits<double>::quiet_NaN();
  check_error(
      "T6",
      [&] {
        (void)specdec::verify_traversal_checked(
            tree, specdec::RowsView<const double>(rows.data(), 3, 4), g, workspace, 6);
      },
      errc::invalid_probability, "target row 1 (step 6): entry for token 2 is NaN");
  const std::vector<double> q{0.5, 0.5, 0.0, 0.0};
  Tree zero_q(4);
  zero_q.expand(Tree::root, specdec::expansion::with_replacement, q);
  zero_q.add_child(Tree::root, 3);  // q(3) = 0
  const std::vector<double> valid = uniform_rows(2);
  check_error(
      "T7",
      [&] {
        (void)specdec::verify_traversal_checked(
            zero_q, specdec::RowsView<const double>(valid.data(), 2, 4), g, workspace, 1);
      },
      errc::invalid_token, "draft node 1 (step 1): token 3 has q = 0 at its parent 0");
  // Valid inputs verify (the checks pass a good tree through).
  const std::vector<double> good = uniform_rows(3);
  const auto result = specdec::verify_traversal_checked(
      tree, specdec::RowsView<const double>(good.data(), 3, 4), g, workspace, 1);
  CHECK(result.accepted <= 1);
}

namespace {

// A proposal-only drafter over V = 4 (proposes token 1 again and again).
struct OnesDrafter {
  std::size_t propose(std::span<const token_id>, std::span<token_id> out) {
    for (token_id& token : out) token = 1;
    return out.size();
  }
};

// The same with several continuations (1 1 1 ..., 2 2 2 ...): a MultiProposalDrafter.
struct OnesAndTwosDrafter : OnesDrafter {
  std::size_t propose_many(std::span<const token_id>, std::span<token_id> out,
                           std::span<std::size_t> lengths) {
    if (lengths.empty() || out.size() < lengths.size()) return 0;
    const std::size_t length = out.size() / lengths.size();
    const std::size_t count = lengths.size() < 2 ? lengths.size() : 2;
    for (std::size_t b = 0; b < count; ++b) {
      for (std::size_t k = 0; k < length; ++k) out[b * length + k] = static_cast<token_id>(1 + b);
      lengths[b] = length;
    }
    return count;
  }
};

// A MultiProposalDrafter over V = 4 offering `continuations` (each claimed at its full
// length, written up to the length asked for), one more continuation than asked for with
// `extra`; its call `fail_at` (0-based) throws std::runtime_error("table corrupted").
struct ScriptedProposals {
  std::vector<std::vector<token_id>> continuations{{1, 2}, {2, 3}};
  bool extra = false;
  std::size_t fail_at = std::numeric_limits<std::size_t>::max();
  std::size_t calls = 0;
  std::size_t propose(std::span<const token_id>, std::span<token_id> out) {
    const std::vector<token_id>& first = continuations.front();
    const std::size_t n = std::min(first.size(), out.size());
    std::copy_n(first.begin(), n, out.begin());
    return first.size();
  }
  std::size_t propose_many(std::span<const token_id>, std::span<token_id> out,
                           std::span<std::size_t> lengths) {
    if (calls++ == fail_at) throw std::runtime_error("table corrupted");
    if (lengths.empty()) return 0;
    const std::size_t length = out.size() / lengths.size();
    const std::size_t count = std::min(continuations.size(), lengths.size());
    for (std::size_t b = 0; b < count; ++b) {
      const std::vector<token_id>& path = continuations[b];
      std::copy_n(path.begin(), std::min(path.size(), length),
                  out.begin() + static_cast<std::ptrdiff_t>(b * length));
      lengths[b] = path.size();
    }
    return extra ? lengths.size() + 1 : count;
  }
};
static_assert(specdec::MultiProposalDrafter<ScriptedProposals>);

// A LanguageModel over V = 4 whose `fail_at`-th call (0-based) misbehaves: throws a
// std::runtime_error, throws a specdec::error of its own, or returns a row summing to 1.5.
struct FailingRowModel {
  enum class fault { runtime_error, specdec_error, unnormalized };
  std::size_t fail_at = 0;
  fault how = fault::runtime_error;
  std::size_t calls = 0;
  std::vector<double> row{0.25, 0.25, 0.25, 0.25};
  std::vector<double> bad{0.5, 0.5, 0.25, 0.25};
  [[nodiscard]] std::size_t vocab_size() const { return 4; }
  std::span<const double> next_token_probabilities(std::span<const token_id>) {
    if (calls++ != fail_at) return row;
    if (how == fault::runtime_error) throw std::runtime_error("device lost");
    if (how == fault::specdec_error) {
      throw specdec::error(errc::invalid_token, "engine: token not in the cache");
    }
    return bad;
  }
};

}  // namespace

TEST_CASE("T8 SpeculativeDecoder with tree_shape: options a tree cannot use",
          "[errors][speculative_decoder][tree_verification]") {
  FixedRowModel target;
  FixedRowModel draft;
  OnesDrafter drafter;
  specdec::DecoderOptions options;
  options.tree_shape = specdec::TreeShape::branching({2, 1});
  check_error(
      "T8", [&] { specdec::SpeculativeDecoder decoder(target, drafter, options); },
      errc::invalid_option,
      "decoder option tree_shape (4 draft nodes) needs a LanguageModel draft or a "
      "MultiProposalDrafter (propose_many); a drafter with propose() alone uses the chain path");
  // A MultiProposalDrafter drafts proposal trees within the shape.
  OnesAndTwosDrafter multi;
  specdec::SpeculativeDecoder proposal_trees(target, multi, options);
  const auto generated = proposal_trees.generate(std::vector<token_id>{0}, 6, 1);
  CHECK(generated.tokens.size() == 6);
  CHECK(generated.statistics.nodes_scored == 4 * generated.statistics.steps);
  options.lenience = 0.5;
  check_error(
      "T8", [&] { specdec::SpeculativeDecoder decoder(target, draft, options); },
      errc::invalid_option, "decoder option tree_shape (4 draft nodes) needs lenience = 1");
  check_error(
      "T8", [&] { specdec::SpeculativeDecoder decoder(target, multi, options); },
      errc::invalid_option, "decoder option tree_shape (4 draft nodes) needs lenience = 1");
  options.lenience = 1.0;
  options.tree_sampling = specdec::expansion::one_hot;
  check_error(
      "T8", [&] { specdec::SpeculativeDecoder decoder(target, draft, options); },
      errc::invalid_option, "decoder option tree_sampling = ");
}

TEST_CASE("T9 SpeculativeDecoder tree step: a model throws or returns a bad row",
          "[errors][speculative_decoder][tree_verification]") {
  using fault = FailingRowModel::fault;
  specdec::DecoderOptions options;
  options.tree_shape = specdec::TreeShape::branching({2, 1});  // 3 draft calls a step
  const std::vector<token_id> prompt{0, 1};
  for (const fault how : {fault::runtime_error, fault::specdec_error, fault::unnormalized}) {
    FixedRowModel target;
    FailingRowModel draft{.fail_at = 4, .how = how};  // in the second step
    specdec::SpeculativeDecoder decoder(target, draft, options);
    std::size_t emitted_before = 0;
    const std::string what = check_error(
        "T9",
        [&] {
          try {
            (void)decoder.generate(prompt, 50, std::uint64_t{3});
          } catch (const specdec::decoding_error& e) {
            emitted_before = e.tokens().size();
            CHECK(e.step() == 1);
            throw;
          }
        },
        how == fault::unnormalized ? errc::not_normalized : errc::model_failure,
        how == fault::runtime_error   ? "tree step 1 (sequence position "
        : how == fault::specdec_error ? "the draft model threw: specdec: invalid_token: engine:"
                                      : "draft row ");
    CHECK(emitted_before >= 1);  // the first step's tokens are kept
    if (how == fault::runtime_error) {
      CHECK_THAT(what, Catch::Matchers::ContainsSubstring("the draft model threw: device lost"));
    }
    if (how == fault::unnormalized) {
      CHECK_THAT(what, Catch::Matchers::ContainsSubstring("entries sum to 1.5"));
    }
    // The decoder stays usable.
    draft.fail_at = std::numeric_limits<std::size_t>::max();
    CHECK(decoder.generate(prompt, 5, std::uint64_t{3}).tokens.size() == 5);
  }
  // A MultiProposalDrafter (proposal trees) that throws in the second step: the same.
  FixedRowModel target;
  ScriptedProposals drafter;
  drafter.fail_at = 1;
  specdec::SpeculativeDecoder decoder(target, drafter, options);
  std::size_t emitted_before = 0;
  check_error(
      "T9",
      [&] {
        try {
          (void)decoder.generate(prompt, 50, std::uint64_t{3});
        } catch (const specdec::decoding_error& e) {
          emitted_before = e.tokens().size();
          CHECK(e.step() == 1);
          CHECK_THROWS_MATCHES(std::rethrow_if_nested(e), std::runtime_error,
                               Catch::Matchers::Message("table corrupted"));
          throw;
        }
      },
      errc::model_failure, "the draft model threw: table corrupted");
  CHECK(emitted_before >= 1);
  drafter.fail_at = std::numeric_limits<std::size_t>::max();
  CHECK(decoder.generate(prompt, 5, std::uint64_t{3}).tokens.size() == 5);
}

namespace {

// A target over V = 4 with the three ways of scoring a tree; each returns `extra` rows more
// than asked for (or, for next_token_probabilities, `extra` more entries).
struct ShapedRows {
  std::ptrdiff_t extra = 0;
  std::vector<double> rows{};
  [[nodiscard]] std::size_t vocab_size() const { return 4; }
  std::span<const double> next_token_probabilities(std::span<const token_id>) {
    rows.assign(static_cast<std::size_t>(4 + extra), 0.25);
    return rows;
  }
  specdec::RowsView<const double> block(std::size_t wanted) {
    const auto count = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(wanted) + extra);
    rows.assign(count * 4, 0.25);
    return {rows.data(), count, 4};
  }
};
struct TreeScorer : ShapedRows {
  specdec::RowsView<const double> score_tree(std::span<const token_id>,
                                             const specdec::TokenTreeView& tree) {
    return block(tree.size());
  }
};
struct DraftScorer : ShapedRows {
  specdec::RowsView<const double> score_draft(std::span<const token_id>,
                                              std::span<const token_id> draft) {
    return block(draft.size() + 1);
  }
};
static_assert(specdec::TreeScoringModel<TreeScorer>);
static_assert(specdec::BatchedLanguageModel<DraftScorer>);

}  // namespace

TEST_CASE("T10 tree_step / verify_tree_step / generate_with_tree: vocabulary mismatch",
          "[errors][tree_verification]") {
  FixedRowModel target;
  FixedRowModel draft;
  draft.vocab = 5;
  draft.row = {0.2, 0.2, 0.2, 0.2, 0.2};
  specdec::TreeOptions options;
  options.shape = specdec::TreeShape::branching({2, 1});
  specdec::TreeStepWorkspace<double> workspace;
  specdec::xoshiro256pp g(10);
  const std::vector<token_id> context{1, 2};
  check_error(
      "T10", [&] { (void)specdec::tree_step(target, draft, context, options, g, workspace, 3); },
      errc::vocab_mismatch, "draft model has vocabulary size 5, the target 4");
  specdec::TreeGenerationOptions generation;
  generation.max_new_tokens = 8;
  generation.tree = options;
  check_error(
      "T10", [&] { (void)specdec::generate_with_tree(target, draft, context, generation, g); },
      errc::vocab_mismatch, "draft model has vocabulary size 5, the target 4");
  // A caller-built tree over another vocabulary than the target's.
  Tree tree(5);
  const std::vector<token_id> path{4, 1};
  (void)tree.insert_path(path);
  check_error(
      "T10",
      [&] { (void)specdec::verify_tree_step(target, context, tree, options, g, workspace, 3); },
      errc::vocab_mismatch, "target model has vocabulary size 4, the draft tree 5");
  // Greedy trees are checked the same way.
  options.greedy = true;
  check_error(
      "T10", [&] { (void)specdec::tree_step(target, draft, context, options, g, workspace, 3); },
      errc::vocab_mismatch, "draft model has vocabulary size 5, the target 4");
  // Matching vocabularies work with the same workspace afterwards.
  FixedRowModel good_draft;
  CHECK(specdec::tree_step(target, good_draft, context, options, g, workspace, 3).tokens.size() >=
        1);
}

TEST_CASE(
    "T11 score_tree_rows: score_tree / score_draft / next_token_probabilities of the "
    "wrong shape",
    "[errors][tree_verification]") {
  const Tree tree = two_children();  // 3 nodes, 2 leaves
  specdec::TreeScoringWorkspace<double> workspace;
  const std::vector<token_id> context{1};
  for (const std::ptrdiff_t extra : {-1, 1}) {
    TreeScorer scorer{{.extra = extra}};
    check_error(
        "T11",
        [&] { (void)specdec::score_tree_rows(scorer, context, tree.view(), 4, workspace, 2); },
        errc::invalid_size,
        extra < 0 ? "target rows (step 2): score_tree returned 2 x 4 entries, expected 3 x 4"
                  : "target rows (step 2): score_tree returned 4 x 4 entries, expected 3 x 4");
    DraftScorer batched{{.extra = extra}};
    check_error(
        "T11",
        [&] { (void)specdec::score_tree_rows(batched, context, tree.view(), 4, workspace, 2); },
        errc::invalid_size,
        extra < 0 ? "target rows (step 2): score_draft returned 1 x 4 entries, expected 2 x 4"
                  : "target rows (step 2): score_draft returned 3 x 4 entries, expected 2 x 4");
    ShapedRows plain{.extra = extra};
    check_error(
        "T11",
        [&] { (void)specdec::score_tree_rows(plain, context, tree.view(), 4, workspace, 2); },
        errc::invalid_size,
        extra < 0 ? "target rows (step 2): next_token_probabilities returned 1 x 3 entries, "
                    "expected 1 x 4"
                  : "target rows (step 2): next_token_probabilities returned 1 x 5 entries, "
                    "expected 1 x 4");
  }
  // The same check inside a tree step, and inside the decoder (named by the tree step).
  TreeScorer scorer{{.extra = 1}};
  FixedRowModel draft;
  specdec::TreeOptions options;
  options.shape = specdec::TreeShape::branching({2});
  specdec::TreeStepWorkspace<double> step_workspace;
  specdec::xoshiro256pp g(11);
  check_error(
      "T11",
      [&] { (void)specdec::tree_step(scorer, draft, context, options, g, step_workspace, 5); },
      errc::invalid_size,
      "target rows (step 5): score_tree returned 4 x 4 entries, expected 3 x 4");
  specdec::DecoderOptions decoder_options;
  decoder_options.tree_shape = specdec::TreeShape::branching({2});
  specdec::SpeculativeDecoder decoder(scorer, draft, decoder_options);
  check_error(
      "T11", [&] { (void)decoder.generate(context, 8, std::uint64_t{1}); }, errc::invalid_size,
      "tree step 0 (sequence position 1): target rows (step 0): score_tree returned 4 x 4 "
      "entries, expected 3 x 4");
}

TEST_CASE("T12 build_top_k_tree / build_sampled_tree: bad q rows from the draft model",
          "[errors][draft_tree]") {
  const auto shape = specdec::TreeShape::branching({2, 1});
  const std::vector<token_id> context{1};
  Tree tree;
  specdec::DraftTreeWorkspace<double> workspace;
  specdec::xoshiro256pp g(12);
  specdec::DraftTreeOptions options;
  options.step = 4;
  // Validated rows (the default): every row error of validate_probability_row, naming the
  // node whose children the row would draw.
  FixedRowModel nan_row;
  nan_row.row = {0.25, std::numeric_limits<double>::quiet_NaN(), 0.25, 0.25};
  check_error(
      "T12",
      [&] { (void)specdec::build_top_k_tree(nan_row, context, shape, tree, workspace, options); },
      errc::invalid_probability, "draft row 0 (step 4): entry for token 1 is NaN");
  FixedRowModel zero_row;
  zero_row.row = {0.0, 0.0, 0.0, 0.0};
  check_error(
      "T12",
      [&] { (void)specdec::build_top_k_tree(zero_row, context, shape, tree, workspace, options); },
      errc::zero_mass, "draft row 0 (step 4): all entries are zero");
  FixedRowModel short_row;
  short_row.row = {0.5, 0.5, 0.0};
  check_error(
      "T12",
      [&] { (void)specdec::build_top_k_tree(short_row, context, shape, tree, workspace, options); },
      errc::invalid_size, "draft row 0 (step 4): has 3 entries, expected the vocabulary size 4");
  // Without validation the length is still checked, by both builders (same message).
  options.validate_rows = false;
  check_error(
      "T12",
      [&] { (void)specdec::build_top_k_tree(short_row, context, shape, tree, workspace, options); },
      errc::invalid_size, "draft row 0 (step 4): has 3 entries, expected the vocabulary size 4");
  check_error(
      "T12",
      [&] {
        (void)specdec::build_sampled_tree(short_row, context, shape, g, tree, workspace, options);
      },
      errc::invalid_size, "draft row 0 (step 4): has 3 entries, expected the vocabulary size 4");
}

TEST_CASE("T13 build_sampled_tree / tree_step: sampling kind that is not a sampled one",
          "[errors][draft_tree]") {
  FixedRowModel draft;
  FixedRowModel target;
  const auto shape = specdec::TreeShape::branching({2});
  const std::vector<token_id> context{1};
  Tree tree;
  specdec::DraftTreeWorkspace<double> workspace;
  specdec::xoshiro256pp g(13);
  for (const specdec::expansion kind : {specdec::expansion::one_hot, specdec::expansion::none}) {
    specdec::DraftTreeOptions options;
    options.sampling = kind;
    check_error(
        "T13",
        [&] {
          (void)specdec::build_sampled_tree(draft, context, shape, g, tree, workspace, options);
        },
        errc::invalid_option,
        "build_sampled_tree: sampling must be with_replacement or without_replacement, not ");
  }
  specdec::TreeOptions options;
  options.shape = shape;
  options.sampling = specdec::expansion::one_hot;
  specdec::TreeStepWorkspace<double> step_workspace;
  check_error(
      "T13", [&] { (void)specdec::tree_step(target, draft, context, options, g, step_workspace); },
      errc::invalid_option,
      "build_sampled_tree: sampling must be with_replacement or without_replacement, not "
      "one_hot");
  // Greedy tree steps draft top-k (one_hot) trees and ignore options.sampling.
  options.greedy = true;
  CHECK_NOTHROW(specdec::tree_step(target, draft, context, options, g, step_workspace));
}

TEST_CASE("T14 tree_step / verify_tree_step / generate_with_tree: bad rows from the models",
          "[errors][tree_verification]") {
  const std::vector<token_id> context{1, 2};
  specdec::TreeOptions options;
  options.shape = specdec::TreeShape::branching({2, 1});
  specdec::TreeStepWorkspace<double> workspace;
  specdec::xoshiro256pp g(14);
  // A target row with a NaN entry: every target row is validated before verification.
  FixedRowModel nan_target;
  nan_target.row = {0.25, 0.25, std::numeric_limits<double>::quiet_NaN(), 0.25};
  FixedRowModel draft;
  check_error(
      "T14",
      [&] { (void)specdec::tree_step(nan_target, draft, context, options, g, workspace, 7); },
      errc::invalid_probability, "target row 0 (step 7): entry for token 2 is NaN");
  Tree tree(4);
  const std::vector<token_id> path{3, 1};
  (void)tree.insert_path(path);
  check_error(
      "T14",
      [&] { (void)specdec::verify_tree_step(nan_target, context, tree, options, g, workspace, 7); },
      errc::invalid_probability, "target row 0 (step 7): entry for token 2 is NaN");
  // A draft row that does not sum to 1, through the generation loop (step numbers count
  // from 0).
  FixedRowModel target;
  FixedRowModel bad_draft;
  bad_draft.row = {0.5, 0.5, 0.5, 0.0};
  specdec::TreeGenerationOptions generation;
  generation.max_new_tokens = 8;
  generation.tree = options;
  check_error(
      "T14", [&] { (void)specdec::generate_with_tree(target, bad_draft, context, generation, g); },
      errc::not_normalized, "draft row 0 (step 0): entries sum to 1.5");
  // A caller-built tree whose stored q row is bad (verify_tree_step checks the draft side).
  Tree sampled(4);
  const std::vector<double> q{0.5, 0.7, 0.0, 0.0};
  sampled.expand(Tree::root, specdec::expansion::with_replacement, q);
  sampled.add_child(Tree::root, 0);
  check_error(
      "T14",
      [&] { (void)specdec::verify_tree_step(target, context, sampled, options, g, workspace, 7); },
      errc::not_normalized, "draft row 0 (step 7): entries sum to 1.2");
}

TEST_CASE(
    "T15 build_proposal_tree (tree steps with proposal drafters): bad continuations or "
    "limits",
    "[errors][draft_tree][tree_verification]") {
  Tree tree(4);
  specdec::DraftTreeWorkspace<double> workspace;
  const std::vector<token_id> context{0, 1};
  const specdec::ProposalTreeLimits limits{.max_branches = 2, .max_depth = 3, .max_nodes = 8};
  ScriptedProposals drafter;
  drafter.continuations = {{1, 2}, {1, 2, 3, 0}};
  check_error(
      "T15",
      [&] { (void)specdec::build_proposal_tree(drafter, context, limits, tree, workspace, 7); },
      errc::invalid_size, "draft continuation 1 (step 7): has 4 tokens, more than the 3 asked for");
  drafter.continuations = {{1, 2}, {1, 9}};
  check_error(
      "T15",
      [&] { (void)specdec::build_proposal_tree(drafter, context, limits, tree, workspace, 7); },
      errc::invalid_token, "draft continuation 1 (step 7): token 1 is 9, outside [0, 4)");
  drafter.continuations = {{1, 2}, {-1}};
  check_error(
      "T15",
      [&] { (void)specdec::build_proposal_tree(drafter, context, limits, tree, workspace, 7); },
      errc::invalid_token, "draft continuation 1 (step 7): token 0 is -1, outside [0, 4)");
  drafter.continuations = {{1, 2}};
  drafter.extra = true;
  check_error(
      "T15",
      [&] { (void)specdec::build_proposal_tree(drafter, context, limits, tree, workspace, 7); },
      errc::invalid_size,
      "draft proposals (step 7): propose_many returned 3 continuations, at most 2 were asked for");
  drafter.extra = false;
  for (const specdec::ProposalTreeLimits too_large :
       {specdec::ProposalTreeLimits{.max_nodes = specdec::max_tree_nodes},
        specdec::ProposalTreeLimits{.max_branches = specdec::max_tree_nodes + 1},
        specdec::ProposalTreeLimits{.max_depth = specdec::max_tree_nodes + 1}}) {
    check_error(
        "T15",
        [&] { (void)specdec::build_proposal_tree(drafter, context, too_large, tree, workspace); },
        errc::invalid_option, "build_proposal_tree: limits of ");
  }
  // Through tree_step and the decoder (tree_shape with a MultiProposalDrafter): the same
  // errors, the decoder's named by its tree step.
  FixedRowModel target;
  drafter.continuations = {{1, 2}, {3, 7}};
  specdec::TreeOptions options;
  options.shape = specdec::TreeShape::branching({2, 1});
  specdec::TreeStepWorkspace<double> step_workspace;
  specdec::xoshiro256pp g(15);
  check_error(
      "T15",
      [&] { (void)specdec::tree_step(target, drafter, context, options, g, step_workspace, 2); },
      errc::invalid_token, "draft continuation 1 (step 2): token 1 is 7, outside [0, 4)");
  specdec::DecoderOptions decoder_options;
  decoder_options.tree_shape = specdec::TreeShape::branching({2, 1});
  specdec::SpeculativeDecoder decoder(target, drafter, decoder_options);
  check_error(
      "T15", [&] { (void)decoder.generate(context, 8, std::uint64_t{1}); }, errc::invalid_token,
      "tree step 0 (sequence position 2): draft continuation 1 (step 0): token 1 is 7, outside "
      "[0, 4)");
  // Valid continuations work with the same objects afterwards.
  drafter.continuations = {{1, 2}, {3, 0}};
  CHECK(decoder.generate(context, 8, std::uint64_t{1}).tokens.size() == 8);
}
