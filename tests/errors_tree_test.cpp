// Bad-input catalogue, token trees (docs/errors.md, rows T*): TreeShape, DraftTree,
// build_sampled_tree, verify_tree_checked, verify_tree_greedy_checked, SpeculativeDecoder
// with a tree shape. One test case per catalogue row.
#include <catch2/catch_test_macros.hpp>

#include <cstddef>
#include <cstdint>
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
#include "specdec/tree_verification.hpp"

namespace {

using specdec::errc;
using specdec::token_id;
using specdec::testing::check_error;
using Tree = specdec::DraftTree<double>;
constexpr std::size_t npos = Tree::npos;

// A draft LanguageModel over V = 4 returning a fixed row (valid unless changed).
struct FixedRowModel {
  std::vector<double> row{0.25, 0.25, 0.25, 0.25};
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
}
