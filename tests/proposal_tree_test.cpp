// Proposal trees: build_proposal_tree (continuations of a MultiProposalDrafter inserted as
// one_hot paths within a node budget) and tree steps with proposal-only drafters
// (tree_step, generate_with_tree) and in SpeculativeDecoder (DecoderOptions::tree_shape
// with a MultiProposalDrafter): the target's exact law over the first tokens (chi-square on
// the real code, with a negative control that keeps a rejected candidate in the residual),
// greedy identity with plain greedy decoding, errors, and no allocation once warm.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/draft_tree.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/tree_verification.hpp"
#include "support/counting_allocator.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::DraftTree;
using specdec::ProposalTreeLimits;
using specdec::token_id;
using specdec::TreeShape;
using Tokens = std::vector<token_id>;

// ---------------------------------------------------------------------------------------
// Models and drafters
// ---------------------------------------------------------------------------------------

/// A second-order Markov target over V tokens: the row depends on the last two tokens (V
/// stands for "none"). Rows are fixed at construction, some entries are 0, so scoring never
/// allocates.
template <class T>
struct Order2Model {
  std::size_t vocab = 4;
  std::vector<T> table;

  Order2Model(std::size_t vocab_size, std::uint64_t seed) : vocab(vocab_size) {
    specdec::splitmix64 bits(seed);
    const std::size_t states = (vocab + 1) * (vocab + 1);
    table.resize(states * vocab);
    for (std::size_t s = 0; s < states; ++s) {
      double total = 0.0;
      std::vector<double> weights(vocab);
      for (std::size_t j = 0; j < vocab; ++j) {
        const std::uint64_t h = bits();
        // Mostly spread, a zero now and then, never fewer than two positive entries.
        weights[j] = (h % 5 == 0 && j >= 2) ? 0.0 : 1.0 + static_cast<double>(h % 9);
        total += weights[j];
      }
      for (std::size_t j = 0; j < vocab; ++j)
        table[s * vocab + j] = static_cast<T>(weights[j] / total);
    }
  }

  [[nodiscard]] std::size_t vocab_size() const { return vocab; }
  [[nodiscard]] std::span<const T> row_after(std::size_t before, std::size_t last) const {
    return {table.data() + (before * (vocab + 1) + last) * vocab, vocab};
  }
  [[nodiscard]] std::span<const T> row(std::span<const token_id> context) const {
    const std::size_t n = context.size();
    const std::size_t last = n >= 1 ? static_cast<std::size_t>(context[n - 1]) : vocab;
    const std::size_t before = n >= 2 ? static_cast<std::size_t>(context[n - 2]) : vocab;
    return row_after(before, last);
  }
  std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    return row(context);
  }
};

/// The same target scoring a whole token tree in one call.
template <class T>
struct Order2TreeModel : Order2Model<T> {
  using Order2Model<T>::Order2Model;
  std::vector<T> rows;
  std::size_t tree_calls = 0;

  specdec::RowsView<const T> score_tree(std::span<const token_id> context,
                                        const specdec::TokenTreeView& tree) {
    ++tree_calls;
    const std::size_t v = this->vocab;
    rows.resize(tree.size() * v);
    const std::size_t n = context.size();
    const auto context_token = [&](std::size_t back) {  // back = 1: the last token
      return n >= back ? static_cast<std::size_t>(context[n - back]) : v;
    };
    for (std::size_t node = 0; node < tree.size(); ++node) {
      std::size_t last = context_token(1);
      std::size_t before = context_token(2);
      if (tree.depths[node] >= 1) {
        last = static_cast<std::size_t>(tree.tokens[node]);
        before = tree.depths[node] >= 2 ? static_cast<std::size_t>(tree.tokens[tree.parents[node]])
                                        : context_token(1);
      }
      const auto source = this->row_after(before, last);
      std::copy(source.begin(), source.end(), rows.begin() + static_cast<std::ptrdiff_t>(node * v));
    }
    return {rows.data(), tree.size(), v};
  }
};

static_assert(specdec::TreeScoringModel<Order2TreeModel<double>>);
static_assert(!specdec::TreeScoringModel<Order2Model<double>>);

/// A MultiProposalDrafter returning fixed continuations (and counting its calls); with
/// `extra` it misbehaves by claiming one more continuation than asked for.
struct ScriptedDrafter {
  std::vector<Tokens> continuations;
  std::size_t calls = 0;
  bool extra = false;

  std::size_t propose(std::span<const token_id>, std::span<token_id>) { return 0; }
  std::size_t propose_many(std::span<const token_id>, std::span<token_id> out,
                           std::span<std::size_t> lengths) {
    ++calls;
    const std::size_t length = out.size() / lengths.size();
    const std::size_t count = std::min(lengths.size(), continuations.size());
    for (std::size_t b = 0; b < count; ++b) {
      const Tokens& c = continuations[b];
      lengths[b] = c.size();  // may exceed `length`: the builder must refuse that
      for (std::size_t k = 0; k < std::min(c.size(), length); ++k) out[b * length + k] = c[k];
    }
    return extra ? lengths.size() + 1 : count;
  }
};

/// A plain ProposalDrafter: proposes the last token again.
struct RepeatLast {
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) {
    if (context.empty()) return 0;
    std::fill(out.begin(), out.end(), context.back());
    return out.size();
  }
};

/// The example of the MultiProposalDrafter documentation (concepts.hpp), compiled.
struct LastTwo {
  std::size_t propose(std::span<const token_id> c, std::span<token_id> out);
  std::size_t propose_many(std::span<const token_id> c, std::span<token_id> out,
                           std::span<std::size_t> lengths) {
    if (lengths.empty() || out.size() < lengths.size()) return 0;
    const std::size_t length = out.size() / lengths.size();
    const std::size_t branches = std::min<std::size_t>({lengths.size(), c.size(), 2});
    for (std::size_t b = 0; b < branches; ++b) {
      std::ranges::fill(out.subspan(b * length, length), c[c.size() - 1 - b]);
      lengths[b] = length;
    }
    return branches;
  }
};

static_assert(specdec::MultiProposalDrafter<ScriptedDrafter>);
static_assert(specdec::MultiProposalDrafter<LastTwo>);
static_assert(!specdec::MultiProposalDrafter<RepeatLast>);

/// Every path of a tree, as token sequences, in node order of the path ends.
template <class T>
std::vector<Tokens> leaf_paths(const DraftTree<T>& tree) {
  std::vector<Tokens> paths;
  for (std::size_t node = 1; node < tree.size(); ++node) {
    if (tree.first_child(node) != DraftTree<T>::npos) continue;
    Tokens path;
    tree.append_path(node, path);
    paths.push_back(path);
  }
  return paths;
}

template <class Fn>
void check_error(Fn&& fn, specdec::errc code, const std::string& fragment) {
  try {
    fn();
    FAIL("no specdec::error thrown; expected: " << fragment);
  } catch (const specdec::error& e) {
    INFO(e.what());
    CHECK(e.code() == code);
    CHECK(std::string(e.what()).find(fragment) != std::string::npos);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------
// The builder
// ---------------------------------------------------------------------------------------

TEST_CASE("ProposalTreeLimits::from_shape: one continuation per root-to-leaf path",
          "[proposal_tree]") {
  const auto chain = ProposalTreeLimits::from_shape(TreeShape::chain(5));
  CHECK(chain.max_branches == 1);
  CHECK(chain.max_depth == 5);
  CHECK(chain.max_nodes == 5);
  const auto branching = ProposalTreeLimits::from_shape(TreeShape::branching({3, 2, 1}));
  CHECK(branching.max_branches == 6);
  CHECK(branching.max_depth == 3);
  CHECK(branching.max_nodes == 15);
  const auto root = ProposalTreeLimits::from_shape(TreeShape{});
  CHECK(root.max_depth == 0);
  CHECK(root.max_nodes == 0);
}

TEST_CASE("build_proposal_tree: a trie of the continuations in order, within the budget",
          "[proposal_tree]") {
  ScriptedDrafter drafter;
  drafter.continuations = {{1, 2, 3}, {1, 2, 0}, {3}, {1, 3}, {1, 2, 3}, {0, 0}};
  DraftTree<double> tree(4);
  specdec::DraftTreeWorkspace<double> workspace;
  const Tokens context{0, 1};

  CHECK(specdec::build_proposal_tree(drafter, context, {8, 3, 20}, tree, workspace) == 6);
  // Shared prefixes merged, the duplicate {1, 2, 3} adds nothing: 1,2,3 / 0 / 3 / 3 / 0,0.
  CHECK(tree.draft_size() == 8);
  CHECK(tree.max_depth() == 3);
  CHECK(leaf_paths(tree) == std::vector<Tokens>{{1, 2, 3}, {1, 2, 0}, {3}, {1, 3}, {0, 0}});
  // Siblings keep the drafter's order (verification tries them in that order).
  const std::size_t one = tree.first_child(DraftTree<double>::root);
  CHECK(tree.token(one) == 1);
  CHECK(tree.token(tree.next_sibling(one)) == 3);
  CHECK(tree.token(tree.next_sibling(tree.next_sibling(one))) == 0);
  for (std::size_t node = 0; node < tree.size(); ++node) {
    if (tree.first_child(node) != DraftTree<double>::npos)
      CHECK(tree.expansion_of(node) == specdec::expansion::one_hot);
  }

  // A budget of 4 nodes: the first path, then the first new node of the second; the rest
  // is dropped. The tree is cleared between builds.
  CHECK(specdec::build_proposal_tree(drafter, context, {8, 3, 4}, tree, workspace) == 6);
  CHECK(leaf_paths(tree) == std::vector<Tokens>{{1, 2, 3}, {1, 2, 0}});
  // Depth 2 and two branches: the continuations are asked for with L = 2 tokens.
  drafter.continuations = {{1, 2}, {1, 3}, {2, 2}};
  CHECK(specdec::build_proposal_tree(drafter, context, {2, 2, 16}, tree, workspace) == 2);
  CHECK(leaf_paths(tree) == std::vector<Tokens>{{1, 2}, {1, 3}});
  // A limit of 0 leaves the root alone without calling the drafter.
  const std::size_t calls = drafter.calls;
  for (const ProposalTreeLimits limits :
       {ProposalTreeLimits{0, 3, 8}, ProposalTreeLimits{2, 0, 8}, ProposalTreeLimits{2, 3, 0}}) {
    CHECK(specdec::build_proposal_tree(drafter, context, limits, tree, workspace) == 0);
    CHECK(tree.size() == 1);
  }
  CHECK(drafter.calls == calls);

  // A plain ProposalDrafter gives one continuation: a chain of max_depth tokens.
  RepeatLast repeat;
  CHECK(specdec::build_proposal_tree(repeat, context, {4, 3, 8}, tree, workspace) == 1);
  CHECK(leaf_paths(tree) == std::vector<Tokens>{{1, 1, 1}});
  CHECK(specdec::build_proposal_tree(repeat, Tokens{}, {4, 3, 8}, tree, workspace) == 0);
  CHECK(tree.size() == 1);

  // The real drafters: the tree holds exactly their continuations.
  specdec::NgramDrafter ngram({.max_order = 3, .window = 64});
  // After "1 2": 3 twice, 0 once; after "2" also 1 (backoff). Each chained on.
  const Tokens text{1, 2, 3, 1, 2, 0, 1, 2, 3, 0, 2, 1, 1, 2};
  CHECK(specdec::build_proposal_tree(ngram, text, {3, 3, 9}, tree, workspace) == 3);
  CHECK(leaf_paths(tree) == std::vector<Tokens>{{3, 0, 2}, {0, 1, 2}, {1, 1, 2}});
}

TEST_CASE("build_proposal_tree refuses bad continuations and limits, naming them",
          "[proposal_tree][errors]") {
  DraftTree<double> tree(4);
  specdec::DraftTreeWorkspace<double> workspace;
  const Tokens context{0, 1};
  ScriptedDrafter drafter;
  drafter.continuations = {{1, 2}, {1, 2, 3, 0}};
  check_error(
      [&] {
        (void)specdec::build_proposal_tree(drafter, context, {2, 3, 8}, tree, workspace, 7);
      },
      specdec::errc::invalid_size,
      "draft continuation 1 (step 7): has 4 tokens, more than the 3 asked for");
  drafter.continuations = {{1, 2}, {1, 9}};
  check_error(
      [&] {
        (void)specdec::build_proposal_tree(drafter, context, {2, 3, 8}, tree, workspace, 7);
      },
      specdec::errc::invalid_token, "draft continuation 1 (step 7): token 1 is 9, outside [0, 4)");
  drafter.continuations = {{1, 2}};
  drafter.extra = true;
  check_error(
      [&] {
        (void)specdec::build_proposal_tree(drafter, context, {2, 3, 8}, tree, workspace, 7);
      },
      specdec::errc::invalid_size,
      "draft proposals (step 7): propose_many returned 3 continuations, at most 2");
  drafter.extra = false;
  check_error(
      [&] {
        (void)specdec::build_proposal_tree(drafter, context, {2, 3, specdec::max_tree_nodes}, tree,
                                           workspace);
      },
      specdec::errc::invalid_option, "build_proposal_tree: limits of 2 branches, depth 3 and");
}

// ---------------------------------------------------------------------------------------
// Tree steps with proposal drafters
// ---------------------------------------------------------------------------------------

namespace {

constexpr std::size_t vocab = 4;
constexpr std::size_t first_tokens = 3;

/// A prompt sampled from the target, so that the drafters' tables resemble it.
Tokens sampled_prompt(const Order2Model<double>& target, std::size_t length, std::uint64_t seed) {
  specdec::xoshiro256pp g(seed);
  Tokens prompt;
  while (prompt.size() < length) prompt.push_back(specdec::sample_from_row(target.row(prompt), g));
  return prompt;
}

/// The law of the first `count` tokens after `prompt` under the target's rows standardized
/// with `sampling` (the identity by default), index = base-V number.
std::vector<double> target_law(const Order2Model<double>& target, const Tokens& prompt,
                               std::size_t count, const specdec::SamplingOptions& sampling = {}) {
  std::vector<double> law(1, 1.0);
  std::vector<Tokens> sequences(1, prompt);
  for (std::size_t k = 0; k < count; ++k) {
    std::vector<double> next;
    std::vector<Tokens> extended;
    for (std::size_t s = 0; s < law.size(); ++s) {
      const std::vector<double> row = specdec::standardize(target.row(sequences[s]), sampling);
      for (std::size_t j = 0; j < vocab; ++j) {
        next.push_back(law[s] * row[j]);
        extended.push_back(sequences[s]);
        extended.back().push_back(static_cast<token_id>(j));
      }
    }
    law = std::move(next);
    sequences = std::move(extended);
  }
  return law;
}

/// The negative control: verification that accepts a one_hot candidate with probability
/// min(1, p(c)) but never removes a rejected candidate from the residual (the correction is
/// drawn from p itself).
template <class G>
void verify_keeping_rejected(const DraftTree<double>& tree, specdec::RowsView<const double> rows,
                             G& g, Tokens& out) {
  std::size_t node = DraftTree<double>::root;
  for (;;) {
    const std::span<const double> p = rows.row(node);
    std::size_t accepted = DraftTree<double>::npos;
    for (std::size_t c = tree.first_child(node); c != DraftTree<double>::npos;
         c = tree.next_sibling(c)) {
      if (specdec::uniform01<double>(g) <
          std::min(1.0, p[static_cast<std::size_t>(tree.token(c))])) {
        accepted = c;
        break;
      }
    }
    if (accepted == DraftTree<double>::npos) break;
    node = accepted;
  }
  tree.append_path(node, out);
  out.push_back(specdec::sample_from_row(rows.row(node), g));
}

struct LawRun {
  specdec::testing::ChiSquareResult fit;
  std::size_t steps = 0;
  std::size_t branched_steps = 0;  // trees with two or more root children
  std::size_t deep_accepts = 0;    // steps accepting two or more draft tokens
};

/// Samples the first tokens after `prompt` with proposal-tree steps of `shape` until
/// `first_tokens` are out, `samples` times, and tests them against the target's law.
template <class Drafter>
LawRun run_law(Drafter& drafter, const TreeShape& shape, bool broken, std::size_t samples,
               std::uint64_t seed) {
  Order2TreeModel<double> target(vocab, 11);
  const Tokens prompt = sampled_prompt(target, 48, 3);
  const std::vector<double> law = target_law(target, prompt, first_tokens);
  specdec::TreeOptions options;
  options.shape = shape;
  specdec::TreeStepWorkspace<double> workspace;
  specdec::xoshiro256pp g(seed);
  std::vector<std::uint64_t> counts(law.size(), 0);
  LawRun run;
  Tokens sequence;
  for (std::size_t i = 0; i < samples; ++i) {
    sequence = prompt;
    while (sequence.size() < prompt.size() + first_tokens) {
      ++run.steps;
      if (!broken) {
        const auto step = specdec::tree_step(target, drafter, sequence, options, g, workspace);
        run.branched_steps += workspace.tree.child_count(0) >= 2 ? 1U : 0U;
        run.deep_accepts += step.accepted() >= 2 ? 1U : 0U;
        sequence.insert(sequence.end(), step.tokens.begin(), step.tokens.end());
      } else {
        workspace.tree.reset(vocab);
        (void)specdec::build_proposal_tree(drafter, sequence, ProposalTreeLimits::from_shape(shape),
                                           workspace.tree, workspace.drafting);
        const auto scores = specdec::score_tree_rows(target, sequence, workspace.tree.view(), vocab,
                                                     workspace.scoring);
        verify_keeping_rejected(workspace.tree, scores.rows, g, sequence);
      }
    }
    std::size_t index = 0;
    for (std::size_t k = 0; k < first_tokens; ++k)
      index = index * vocab + static_cast<std::size_t>(sequence[prompt.size() + k]);
    ++counts[index];
  }
  run.fit = specdec::testing::chi_square_test(counts, law);
  return run;
}

}  // namespace

TEST_CASE("Proposal-tree steps keep the target's law of the first tokens; a kept residual fails",
          "[proposal_tree][statistical]") {
  // Power: the broken variant deviates by far more than this total variation.
  const std::size_t samples = specdec::testing::samples_to_detect(0.04, 63.0);
  const TreeShape shape = TreeShape::branching({3, 1, 1});  // 3 continuations of 3 tokens
  SECTION("n-gram continuations") {
    specdec::NgramDrafter drafter({.max_order = 3, .window = 256});
    const LawRun run = run_law(drafter, shape, false, samples, 101);
    INFO(run.fit.describe());
    CHECK(run.fit.passed());
    CHECK(run.branched_steps * 2 > run.steps);  // most trees branch
    CHECK(run.deep_accepts * 10 > run.steps);   // and paths of 2+ tokens get accepted
    const LawRun broken = run_law(drafter, shape, true, samples, 102);
    INFO(broken.fit.describe());
    CHECK_FALSE(broken.fit.passed());
  }
  SECTION("prompt-lookup continuations") {
    specdec::PromptLookupDrafter drafter({.min_ngram = 1, .max_ngram = 4, .window = 256});
    const LawRun run = run_law(drafter, shape, false, samples, 201);
    INFO(run.fit.describe());
    CHECK(run.fit.passed());
    CHECK(run.branched_steps * 2 > run.steps);
    CHECK(run.deep_accepts * 10 > run.steps);
    const LawRun broken = run_law(drafter, shape, true, samples, 202);
    INFO(broken.fit.describe());
    CHECK_FALSE(broken.fit.passed());
  }
}

TEMPLATE_TEST_CASE("Greedy proposal trees equal plain greedy decoding of the target",
                   "[proposal_tree][greedy]", float, double) {
  const std::vector<TreeShape> shapes{TreeShape::chain(4), TreeShape::branching({3, 1, 1}),
                                      TreeShape::branching({4, 2, 1, 1})};
  for (const std::size_t v : {std::size_t{4}, std::size_t{7}}) {
    Order2TreeModel<TestType> target(v, 40 + v);
    Order2Model<TestType> per_node(v, 40 + v);  // the same target scored node by node
    Tokens prompt;
    for (std::size_t k = 0; k < 30; ++k)
      prompt.push_back(static_cast<token_id>((k * k + 3 * k) % v));
    Tokens expected;
    Tokens context = prompt;
    for (std::size_t k = 0; k < 80; ++k) {
      expected.push_back(specdec::argmax(target.row(context)));
      context.push_back(expected.back());
    }
    for (const TreeShape& shape : shapes) {
      specdec::TreeGenerationOptions options;
      options.max_new_tokens = 80;
      options.tree.shape = shape;
      options.tree.greedy = true;
      specdec::xoshiro256pp g(9);
      INFO("V = " << v << ", shape of " << shape.draft_size() << " nodes");
      specdec::NgramDrafter ngram({.max_order = 4, .window = 128});
      const auto by_ngram = specdec::generate_with_tree(target, ngram, prompt, options, g);
      CHECK(by_ngram.tokens == expected);
      CHECK(by_ngram.statistics.target_calls == by_ngram.statistics.steps);
      CHECK(by_ngram.statistics.draft_calls == by_ngram.statistics.steps);
      // Greedy decoding of a Markov chain cycles, which the drafters pick up.
      CHECK(by_ngram.statistics.mean_accepted_depth() > 1.0);
      specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 4, .window = 512});
      const auto by_lookup = specdec::generate_with_tree(per_node, lookup, prompt, options, g);
      CHECK(by_lookup.tokens == expected);
      CHECK(by_lookup.statistics.mean_accepted_depth() > 1.0);
      RepeatLast repeat;  // a plain ProposalDrafter: chains only
      CHECK(specdec::generate_with_tree(target, repeat, prompt, options, g).tokens == expected);
    }
  }
}

TEST_CASE("tree_step with a proposal drafter: statistics and errors", "[proposal_tree]") {
  Order2TreeModel<double> target(vocab, 11);
  specdec::TreeStepWorkspace<double> workspace;
  specdec::TreeOptions options;
  options.shape = TreeShape::branching({2, 1});
  specdec::xoshiro256pp g(1);
  ScriptedDrafter drafter;
  drafter.continuations = {{1, 2}, {3, 0}, {1, 3}};  // two asked for
  const Tokens context{0, 1, 2};
  const auto step = specdec::tree_step(target, drafter, context, options, g, workspace, 5);
  CHECK(step.nodes_scored == 4);
  CHECK(step.draft_calls == 1);
  CHECK(step.target_calls == 1);
  CHECK(target.tree_calls == 1);
  CHECK(step.tokens.size() == step.accepted() + 1);
  // A shape without draft nodes: the root alone, one token from the target.
  options.shape = TreeShape{};
  const auto bare = specdec::tree_step(target, drafter, context, options, g, workspace);
  CHECK(bare.draft_calls == 0);
  CHECK(bare.tokens.size() == 1);
  CHECK(drafter.calls == 1);
  // A proposed token outside the target's vocabulary is named with the step.
  options.shape = TreeShape::branching({2, 1});
  drafter.continuations = {{1, 2}, {4, 0}};
  check_error([&] { (void)specdec::tree_step(target, drafter, context, options, g, workspace, 5); },
              specdec::errc::invalid_token,
              "draft continuation 1 (step 5): token 0 is 4, outside [0, 4)");
}

TEST_CASE("A warm proposal-tree step allocates nothing", "[proposal_tree][allocation]") {
  Order2TreeModel<double> target(vocab, 11);
  Tokens context = sampled_prompt(target, 200, 8);
  context.reserve(context.size() + 4000);
  specdec::TreeStepWorkspace<double> workspace;
  specdec::TreeOptions options;
  options.shape = TreeShape::branching({4, 2, 1});
  specdec::NgramDrafter ngram({.max_order = 4, .window = 256});
  specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 6, .window = 1024});
  specdec::xoshiro256pp g(4);
  std::size_t emitted = 0;
  const auto run = [&](std::size_t steps) {
    for (std::size_t s = 0; s < steps; ++s) {
      for (const bool greedy : {false, true}) {
        options.greedy = greedy;
        const auto a = specdec::tree_step(target, ngram, context, options, g, workspace);
        context.insert(context.end(), a.tokens.begin(), a.tokens.end());
        const auto b = specdec::tree_step(target, lookup, context, options, g, workspace);
        context.insert(context.end(), b.tokens.begin(), b.tokens.end());
        emitted += a.tokens.size() + b.tokens.size();
      }
    }
  };
  run(50);  // warm-up: every buffer reaches its largest size
  specdec::testing::AllocationCounter counter;
  run(200);
  CHECK(counter.stop() == 0);
  CHECK(emitted > 800);
}

// ---------------------------------------------------------------------------------------
// SpeculativeDecoder with proposal trees
// ---------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("SpeculativeDecoder with proposal trees equals plain greedy decoding",
                   "[proposal_tree][speculative_decoder][greedy]", float, double) {
  Order2TreeModel<TestType> target(7, 31);
  Order2Model<TestType> per_node(7, 31);
  specdec::DecoderOptions options;
  options.sampling.temperature = 0.0;
  specdec::xoshiro256pp prompts(3);
  for (const TreeShape& shape :
       {TreeShape::chain(4), TreeShape::branching({3, 1, 1}), TreeShape::branching({4, 2, 1})}) {
    options.tree_shape = shape;
    specdec::NgramDrafter ngram({.max_order = 3, .window = 256});
    specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 4, .window = 256});
    specdec::SpeculativeDecoder by_ngram(target, ngram, options);
    specdec::SpeculativeDecoder by_lookup(per_node, lookup, options);
    for (std::size_t trial = 0; trial < 40; ++trial) {
      Tokens prompt(1 + specdec::uniform_below(prompts, 12));
      for (token_id& t : prompt) t = static_cast<token_id>(specdec::uniform_below(prompts, 7));
      Tokens expected;
      Tokens context = prompt;
      for (std::size_t k = 0; k < 40; ++k) {
        expected.push_back(specdec::argmax(target.row(context)));
        context.push_back(expected.back());
      }
      INFO("shape of " << shape.draft_size() << " nodes, trial " << trial);
      REQUIRE(by_ngram.generate(prompt, 40, trial).tokens == expected);
      REQUIRE(by_lookup.generate(prompt, 40, trial).tokens == expected);
    }
    const auto& statistics = by_ngram.statistics();
    CHECK(statistics.target_calls == statistics.steps);    // one score_tree call per step
    CHECK(statistics.draft_calls == statistics.steps);     // one propose_many call per step
    CHECK(statistics.accepted_tokens > statistics.steps);  // the greedy cycles are drafted
    CHECK(by_lookup.statistics().accepted_tokens > by_lookup.statistics().steps);
  }
}

TEST_CASE("SpeculativeDecoder with proposal trees keeps the standardized target's law",
          "[proposal_tree][speculative_decoder][statistical]") {
  Order2TreeModel<double> target(vocab, 11);
  const Tokens prompt = sampled_prompt(target, 48, 3);
  specdec::SamplingOptions sampling;
  sampling.temperature = 0.8;
  sampling.top_k = 3;
  const std::vector<double> law = target_law(target, prompt, first_tokens, sampling);
  const TreeShape shape = TreeShape::branching({3, 1, 1});
  const std::size_t samples = specdec::testing::samples_to_detect(0.04, 63.0);

  specdec::DecoderOptions options;
  options.sampling = sampling;
  options.tree_shape = shape;
  specdec::NgramDrafter ngram({.max_order = 3, .window = 256});
  specdec::SpeculativeDecoder decoder(target, ngram, options);
  specdec::xoshiro256pp g(303);
  std::vector<std::uint64_t> counts(law.size(), 0);
  for (std::size_t i = 0; i < samples; ++i) {
    const auto result = decoder.generate(prompt, first_tokens, g);
    REQUIRE(result.tokens.size() == first_tokens);
    std::size_t index = 0;
    for (const token_id t : result.tokens) index = index * vocab + static_cast<std::size_t>(t);
    ++counts[index];
  }
  const auto fit = specdec::testing::chi_square_test(counts, law);
  INFO(fit.describe());
  CHECK(fit.passed());
  const auto& statistics = decoder.statistics();
  CHECK(statistics.nodes_scored == statistics.drafted_tokens);
  CHECK(statistics.accepted_tokens * 4 > statistics.steps);  // drafts do get accepted

  // Negative control: the same proposal trees and standardized rows, verified without
  // removing rejected candidates from the residual.
  specdec::TreeStepWorkspace<double> workspace;
  specdec::Standardizer<double> standardizer(sampling);
  std::vector<double> standardized;
  std::vector<std::uint64_t> broken(law.size(), 0);
  Tokens sequence;
  for (std::size_t i = 0; i < samples; ++i) {
    sequence = prompt;
    while (sequence.size() < prompt.size() + first_tokens) {
      workspace.tree.reset(vocab);
      (void)specdec::build_proposal_tree(ngram, sequence, ProposalTreeLimits::from_shape(shape),
                                         workspace.tree, workspace.drafting);
      const auto scores = specdec::score_tree_rows(target, sequence, workspace.tree.view(), vocab,
                                                   workspace.scoring);
      standardized.resize(scores.rows.rows() * vocab);
      for (std::size_t r = 0; r < scores.rows.rows(); ++r) {
        standardizer.apply(std::span<const double>(scores.rows.row(r)),
                           std::span<double>(standardized.data() + r * vocab, vocab));
      }
      verify_keeping_rejected(
          workspace.tree,
          specdec::RowsView<const double>(standardized.data(), scores.rows.rows(), vocab), g,
          sequence);
    }
    std::size_t index = 0;
    for (std::size_t k = 0; k < first_tokens; ++k)
      index = index * vocab + static_cast<std::size_t>(sequence[prompt.size() + k]);
    ++broken[index];
  }
  const auto control = specdec::testing::chi_square_test(broken, law);
  INFO(control.describe());
  CHECK_FALSE(control.passed());
}

TEST_CASE("A warm SpeculativeDecoder step with proposal trees allocates nothing",
          "[proposal_tree][speculative_decoder][allocation]") {
  Order2TreeModel<double> target(vocab, 11);
  Tokens context = sampled_prompt(target, 200, 8);
  context.reserve(context.size() + 4000);
  specdec::DecoderOptions options;
  options.tree_shape = TreeShape::branching({4, 2, 1});
  options.sampling.temperature = 0.9;
  options.sampling.top_p = 0.95;
  specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 6, .window = 1024});
  specdec::SpeculativeDecoder decoder(target, lookup, options);
  decoder.reserve(context.capacity());
  specdec::xoshiro256pp g(6);
  const auto run = [&](std::size_t steps) {
    for (std::size_t s = 0; s < steps; ++s) {
      const auto result = decoder.step(context, g);
      context.insert(context.end(), result.tokens.begin(), result.tokens.end());
    }
  };
  run(50);
  specdec::testing::AllocationCounter counter;
  run(300);
  CHECK(counter.stop() == 0);
  CHECK(decoder.statistics().accepted_tokens > 0);
}
