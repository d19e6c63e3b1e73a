// Tokens per target call of token trees vs chains at equal numbers of scored draft nodes
// (8 and 16), on toy Markov models of controlled alpha, against the chain formula of the
// paper's Eq. 1: E[tokens] = (1 - alpha^(gamma + 1)) / (1 - alpha).
//
// Models: a bigram target and draft over V = 64 tokens whose rows after token t are one
// fixed pair of base distributions (b_p, b_q) permuted by a permutation sigma_t. Every
// position then has beta = sum_x min(p(x), q(x)) = sum_x min(b_p(x), b_q(x)) = alpha
// exactly, which is Eq. 1's i.i.d. assumption. b_p is Zipf-like; b_q mixes b_p with a
// reversed Zipf row, the mixing weight found by bisection to hit alpha.
//
// Each benchmark iteration is one tree_step (draft the tree, score it in one score_tree call,
// verify by recursive rejection, names ending in /recursive, or by traversal verification,
// /traversal; a chain under traversal is block verification). Counters (averages over the
// iterations run):
//   tokens_per_call  emitted tokens per target call (accepted depth + 1)
//   nodes            draft nodes scored per call (with replacement: fewer than the shape,
//                    repeats are not scored)
//   eq1_chain        Eq. 1 for a chain of gamma = the shape's node count
//   vs_eq1           tokens_per_call / eq1_chain
// Run with e.g. --benchmark_min_time=0.5 for stable counters (the table in the notes).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "specdec/draft_tree.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/traversal_verification.hpp"
#include "specdec/tree_verification.hpp"

namespace {

using specdec::expansion;
using specdec::token_id;
using specdec::TreeShape;

constexpr std::size_t vocab = 64;

/// Target and draft bigram tables (row t = distribution after token t) with beta = alpha.
struct MarkovPair {
  std::vector<double> target;
  std::vector<double> draft;
  double alpha = 0.0;
};

double overlap(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0.0;
  for (std::size_t j = 0; j < a.size(); ++j) sum += std::min(a[j], b[j]);
  return sum;
}

MarkovPair make_markov_pair(double alpha) {
  std::vector<double> base_p(vocab);
  std::vector<double> other(vocab);
  double total = 0.0;
  for (std::size_t k = 0; k < vocab; ++k) {
    base_p[k] = 1.0 / std::pow(static_cast<double>(k + 1), 1.1);
    total += base_p[k];
  }
  for (std::size_t k = 0; k < vocab; ++k) base_p[k] /= total;
  for (std::size_t k = 0; k < vocab; ++k) other[k] = base_p[vocab - 1 - k];
  const auto mix = [&](double weight) {
    std::vector<double> q(vocab);
    for (std::size_t k = 0; k < vocab; ++k) q[k] = (1.0 - weight) * base_p[k] + weight * other[k];
    return q;
  };
  double lo = 0.0;  // overlap 1
  double hi = 1.0;  // overlap of b_p with the reversed row
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (lo + hi);
    (overlap(base_p, mix(mid)) > alpha ? lo : hi) = mid;
  }
  const std::vector<double> base_q = mix(0.5 * (lo + hi));

  MarkovPair pair;
  pair.alpha = overlap(base_p, base_q);
  pair.target.resize(vocab * vocab);
  pair.draft.resize(vocab * vocab);
  specdec::xoshiro256pp g(2024);
  std::vector<std::size_t> permutation(vocab);
  for (std::size_t t = 0; t < vocab; ++t) {
    for (std::size_t k = 0; k < vocab; ++k) permutation[k] = k;
    for (std::size_t k = vocab - 1; k > 0; --k) {
      std::swap(permutation[k], permutation[specdec::uniform_below(g, k + 1)]);
    }
    for (std::size_t k = 0; k < vocab; ++k) {
      pair.target[t * vocab + permutation[k]] = base_p[k];
      pair.draft[t * vocab + permutation[k]] = base_q[k];
    }
  }
  return pair;
}

const MarkovPair& markov_pair(int alpha_percent) {
  static std::map<int, std::unique_ptr<MarkovPair>> cache;
  auto& entry = cache[alpha_percent];
  if (!entry) entry = std::make_unique<MarkovPair>(make_markov_pair(alpha_percent / 100.0));
  return *entry;
}

/// A bigram model over a table; the target also scores whole trees in one call.
struct TableModel {
  const std::vector<double>* table = nullptr;
  std::vector<double> rows;

  [[nodiscard]] std::size_t vocab_size() const { return vocab; }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    const auto last = static_cast<std::size_t>(context.back());
    return {table->data() + last * vocab, vocab};
  }
  specdec::RowsView<const double> score_tree(std::span<const token_id> context,
                                             const specdec::TokenTreeView& tree) {
    rows.resize(tree.size() * vocab);
    for (std::size_t node = 0; node < tree.size(); ++node) {
      const token_id last = node == 0 ? context.back() : tree.tokens[node];
      const double* source = table->data() + static_cast<std::size_t>(last) * vocab;
      std::copy(source, source + vocab, rows.begin() + static_cast<std::ptrdiff_t>(node * vocab));
    }
    return {rows.data(), tree.size(), vocab};
  }
};

/// A spine: a chain of `length` nodes with one extra sibling at each of the first `extra`
/// depths (the extra siblings are leaves).
TreeShape spine(std::size_t length, std::size_t extra) {
  std::vector<std::size_t> parents{TreeShape::npos};
  for (std::size_t d = 0; d < length; ++d) parents.push_back(d == 0 ? 0 : parents.size() - 1);
  // parents[1..length] form the chain 0 -> 1 -> 2 -> ...; add siblings under 0, 1, ...
  for (std::size_t d = 0; d < extra; ++d) parents.push_back(d);
  // Children are ordered by index: the chain child comes first at every node.
  return TreeShape::from_parents(parents);
}

struct ShapeCase {
  std::string name;
  TreeShape shape;
};

std::vector<ShapeCase> shapes_with(std::size_t nodes) {
  if (nodes == 8) {
    return {{"chain8", TreeShape::chain(8)},
            {"b2x1x1x1", TreeShape::branching({2, 1, 1, 1})},
            {"b4x1", TreeShape::branching({4, 1})},
            {"b2x3", TreeShape::branching({2, 3})},
            {"spine6+2", spine(6, 2)},
            {"spine5+3", spine(5, 3)}};
  }
  return {{"chain16", TreeShape::chain(16)},
          {"b2x1x1x1x1x1x1x1", TreeShape::branching({2, 1, 1, 1, 1, 1, 1, 1})},
          {"b4x1x1x1", TreeShape::branching({4, 1, 1, 1})},
          {"b2x2x1x1+2", TreeShape::from_parents(
                             {TreeShape::npos, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10, 3, 4})},
          {"spine10+6", spine(10, 6)},
          {"spine12+4", spine(12, 4)}};
}

struct Mode {
  const char* name;
  expansion sampling;
};
constexpr Mode modes[] = {{"with", expansion::with_replacement},
                          {"without", expansion::without_replacement},
                          {"topk", expansion::one_hot}};

void tree_tokens_per_call(benchmark::State& state, int alpha_percent, TreeShape shape, Mode mode,
                          specdec::verification_rule rule) {
  const MarkovPair& pair = markov_pair(alpha_percent);
  TableModel target{&pair.target, {}};
  TableModel draft{&pair.draft, {}};
  specdec::TreeOptions options;
  options.shape = shape;
  options.verification = rule;  // token: recursive rejection; block: traversal
  options.sampling =
      mode.sampling == expansion::one_hot ? expansion::without_replacement : mode.sampling;
  options.validate = false;
  specdec::TreeStepWorkspace<double> workspace;
  specdec::TreeStatistics statistics;
  specdec::xoshiro256pp g(7);
  std::vector<token_id> context{0};
  for (auto _ : state) {
    specdec::TreeStepResult step;
    if (mode.sampling == expansion::one_hot) {
      // Deterministic top-k candidates (one_hot), verified stochastically: also exact.
      const std::size_t draft_calls = specdec::build_top_k_tree(draft, context, options.shape,
                                                                workspace.tree, workspace.drafting);
      step = specdec::verify_tree_step(target, context, workspace.tree, options, g, workspace);
      step.draft_calls = draft_calls;
    } else {
      step = specdec::tree_step(target, draft, context, options, g, workspace);
    }
    benchmark::DoNotOptimize(step.verification.token);
    statistics.record(step);
    context.assign(1, step.tokens.back());  // Markov: only the last token matters
  }
  const auto gamma = static_cast<double>(shape.draft_size());
  const double alpha = pair.alpha;
  const double eq1 = (1.0 - std::pow(alpha, gamma + 1.0)) / (1.0 - alpha);
  state.counters["alpha"] = alpha;
  state.counters["tokens_per_call"] = statistics.tokens_per_target_call();
  state.counters["nodes"] = statistics.nodes_per_step();
  state.counters["eq1_chain"] = eq1;
  state.counters["vs_eq1"] = statistics.tokens_per_target_call() / eq1;
  state.SetItemsProcessed(static_cast<std::int64_t>(statistics.emitted_tokens));
}

[[maybe_unused]] const bool registered = [] {
  for (const int alpha : {60, 80, 90}) {
    for (const std::size_t nodes : {8U, 16U}) {
      for (const ShapeCase& shape : shapes_with(nodes)) {
        for (const Mode& mode : modes) {
          if (shape.shape.is_chain() && mode.sampling != expansion::without_replacement) {
            continue;  // a chain is the same for every mode
          }
          for (const auto rule :
               {specdec::verification_rule::token, specdec::verification_rule::block}) {
            const std::string name =
                "tree/alpha" + std::to_string(alpha) + "/" + shape.name + "/" +
                (shape.shape.is_chain() ? "chain" : mode.name) + "/" +
                (rule == specdec::verification_rule::token ? "recursive" : "traversal");
            benchmark::RegisterBenchmark(name.c_str(), tree_tokens_per_call, alpha, shape.shape,
                                         mode, rule);
          }
        }
      }
    }
  }
  return true;
}();

}  // namespace

// ---------------------------------------------------------------------------------------
// Verification cost at a realistic vocabulary: verify_tree (recursive rejection) and
// verify_traversal on a chain and on trees vs the core's verify_speculative on the same chain
// (V = 32000, rows with beta around 0.7). Each benchmark verifies one fixed drafted tree, so
// tokens_per_verify is conditional on that draft (the expected gain of traversal is in the
// tree/ rows above). Traversal reads a row pair per failed child, from the leaves up: on the
// chain of 16, where the deep drafts' path ratios are small, it examines most positions
// (block verification's gamma - n + 1 row pairs).
// ---------------------------------------------------------------------------------------

namespace {

constexpr std::size_t large_vocab = 32000;

std::vector<double> dirichlet_row(std::size_t size, specdec::xoshiro256pp& g) {
  std::vector<double> row(size);
  double total = 0.0;
  for (double& value : row) {
    const double u = specdec::uniform01<double>(g);
    value = -std::log(1.0 - u) * (u < 0.01 ? 200.0 : 1.0);  // a few heavy entries
    total += value;
  }
  for (double& value : row) value /= total;
  return row;
}

/// p and q rows for `nodes` + 1 positions; q = 0.7 p + 0.3 noise (beta >= 0.7).
struct LargeRows {
  std::vector<float> target;  // (nodes + 1) x V
  std::vector<std::vector<float>> draft;
};

LargeRows make_large_rows(std::size_t nodes) {
  specdec::xoshiro256pp g(99);
  LargeRows rows;
  rows.target.reserve((nodes + 1) * large_vocab);
  for (std::size_t i = 0; i <= nodes; ++i) {
    const std::vector<double> p = dirichlet_row(large_vocab, g);
    const std::vector<double> noise = dirichlet_row(large_vocab, g);
    std::vector<float> q(large_vocab);
    for (std::size_t j = 0; j < large_vocab; ++j) {
      rows.target.push_back(static_cast<float>(p[j]));
      q[j] = static_cast<float>(0.7 * p[j] + 0.3 * noise[j]);
    }
    rows.draft.push_back(std::move(q));
  }
  return rows;
}

/// A tree of `shape` over the rows (node i uses target row i and draft row i), children
/// drawn without replacement from the stored rows.
specdec::DraftTree<float> make_large_tree(const TreeShape& shape, const LargeRows& rows) {
  specdec::DraftTree<float> tree(large_vocab);
  specdec::xoshiro256pp g(5);
  std::vector<float> remaining;
  for (std::size_t node = 0; node < tree.size(); ++node) {
    const std::size_t wanted = shape.child_count(node);
    if (wanted == 0) continue;
    tree.expand(node, expansion::without_replacement, rows.draft[node]);
    remaining.assign(rows.draft[node].begin(), rows.draft[node].end());
    for (std::size_t k = 0; k < wanted; ++k) {
      const token_id token = specdec::sample_from_row(std::span<const float>(remaining), g);
      remaining[static_cast<std::size_t>(token)] = 0.0F;
      (void)tree.add_child(node, token);
    }
  }
  return tree;
}

const LargeRows& large_rows() {
  static const LargeRows rows = make_large_rows(16);
  return rows;
}

void verify_tree_cost(benchmark::State& state, TreeShape shape, bool traversal) {
  const LargeRows& rows = large_rows();
  static std::map<std::vector<std::size_t>, specdec::DraftTree<float>> trees;
  const std::vector<std::size_t> key(shape.parents().begin(), shape.parents().end());
  auto [entry, inserted] = trees.try_emplace(key, large_vocab);
  if (inserted) entry->second = make_large_tree(shape, rows);
  const specdec::DraftTree<float>& tree = entry->second;
  const specdec::RowsView<const float> target(rows.target.data(), tree.size(), large_vocab);
  specdec::TreeVerificationWorkspace<float> workspace;
  specdec::TraversalWorkspace<float> traversal_workspace;
  specdec::xoshiro256pp g(3);
  std::size_t emitted = 0;
  for (auto _ : state) {
    const auto result = traversal ? specdec::verify_traversal(tree, target, g, traversal_workspace)
                                  : specdec::verify_tree(tree, target, g, workspace);
    benchmark::DoNotOptimize(result.token);
    emitted += result.accepted + 1;
  }
  state.counters["tokens_per_verify"] =
      static_cast<double>(emitted) / static_cast<double>(state.iterations());
  state.SetItemsProcessed(state.iterations());
}

void verify_chain_core_cost(benchmark::State& state) {
  const LargeRows& rows = large_rows();
  static const specdec::DraftTree<float> chain = make_large_tree(TreeShape::chain(16), rows);
  std::vector<token_id> tokens;
  std::vector<float> draft_rows;
  for (std::size_t node = 1; node < chain.size(); ++node) {
    tokens.push_back(chain.token(node));
    const auto q = chain.draft_row(node - 1);
    draft_rows.insert(draft_rows.end(), q.begin(), q.end());
  }
  const specdec::RowsView<const float> target(rows.target.data(), chain.size(), large_vocab);
  const specdec::RowsView<const float> draft(draft_rows.data(), tokens.size(), large_vocab);
  specdec::xoshiro256pp g(3);
  std::size_t emitted = 0;
  for (auto _ : state) {
    const auto result =
        specdec::verify_speculative(std::span<const token_id>(tokens), draft, target, g);
    benchmark::DoNotOptimize(result.token);
    emitted += result.accepted + 1;
  }
  state.counters["tokens_per_verify"] =
      static_cast<double>(emitted) / static_cast<double>(state.iterations());
  state.SetItemsProcessed(state.iterations());
}

[[maybe_unused]] const bool registered_cost = [] {
  benchmark::RegisterBenchmark("verify/V32000/chain16/verify_speculative", verify_chain_core_cost);
  const TreeShape b2x2 =
      TreeShape::from_parents({TreeShape::npos, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10, 3, 4});
  for (const bool traversal : {false, true}) {
    const std::string rule = traversal ? "verify_traversal" : "verify_tree";
    benchmark::RegisterBenchmark(("verify/V32000/chain16/" + rule).c_str(), verify_tree_cost,
                                 TreeShape::chain(16), traversal);
    benchmark::RegisterBenchmark(("verify/V32000/b4x1x1x1/" + rule).c_str(), verify_tree_cost,
                                 TreeShape::branching({4, 1, 1, 1}), traversal);
    benchmark::RegisterBenchmark(("verify/V32000/b2x2x1x1+2/" + rule).c_str(), verify_tree_cost,
                                 b2x2, traversal);
  }
  return true;
}();

}  // namespace
