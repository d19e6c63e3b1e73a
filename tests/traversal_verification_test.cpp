// Tests for include/specdec/traversal_verification.hpp: traversal verification's output law
// is the target's (exact enumeration of the real code, drafting included, and chi-square of
// sampled steps), it accepts at least as many drafts as recursive rejection (verify_tree) and,
// on a chain, exactly block verification's expectation (analysis.hpp), and each broken
// variant (a traversal that skips the sibling update, a residual that ignores the weight)
// fails a test here, as the token-level rule fails the expectation tests.
//
// The enumeration drives the real code: one scripted generator feeds the tree builder and
// the verifier, and every breakpoint of every uniform they consume (the builder's draws, the
// acceptance decisions, the final draw) is found by bisection over the 53-bit values, so the
// law enumerated is the implementation's own, for every tree the builder can draft.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "specdec/analysis.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/statistics.hpp"
#include "specdec/traversal_verification.hpp"
#include "specdec/tree_verification.hpp"
#include "support/counting_allocator.hpp"
#include "support/prefix_model.hpp"
#include "support/scripted_uniforms.hpp"
#include "support/token_law.hpp"

namespace {

using specdec::DraftTree;
using specdec::expansion;
using specdec::RowsView;
using specdec::token_id;
using specdec::TreeShape;
using specdec::TreeVerificationResult;
using specdec::detail::traversal_rule;
using specdec::testing::ScriptedGenerator;
using Law = specdec::testing::TokenLaw;
using specdec::testing::law_total_variation;
using specdec::testing::max_difference;

constexpr std::uint64_t grid = specdec::testing::uniform_grid;
using specdec::testing::extend;
using specdec::testing::first_true;
using specdec::testing::PrefixModel;
using specdec::testing::random_model;

/// PrefixModel as a LanguageModel (the tree builders' draft).
struct PrefixLanguageModel {
  const PrefixModel* model = nullptr;
  [[nodiscard]] std::size_t vocab_size() const { return model->vocab; }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    return (*model)(context);
  }
};

/// How a setting drafts its trees.
enum class drafting {
  without_replacement,
  with_replacement,        ///< repeats merged into counts
  with_replacement_nodes,  ///< repeats kept as duplicate nodes
  top_k,                   ///< one_hot children: q's most probable tokens
};

struct Setting {
  std::string name;
  PrefixModel draft;
  PrefixModel target;
  TreeShape shape;
  drafting how = drafting::without_replacement;
  std::size_t gamma = 0;  ///< the chain length when the shape is a chain, else 0
};

/// Chains (gamma 2, 3) and trees of depth <= 2 with V = 2..4, every drafting kind, rows with
/// zeros on either side, q = p, and the block verification paper's example.
std::vector<Setting> settings() {
  specdec::xoshiro256pp g(4711);
  std::vector<Setting> out;
  const std::vector<std::pair<std::vector<std::size_t>, drafting>> shapes = {
      {{2}, drafting::without_replacement},
      {{2, 1}, drafting::without_replacement},
      {{1, 2}, drafting::without_replacement},
      {{3}, drafting::with_replacement},
      {{2, 1}, drafting::with_replacement},
      {{2, 1}, drafting::with_replacement_nodes},
      {{2, 1}, drafting::top_k},
      {{2, 2}, drafting::without_replacement},
  };
  for (std::size_t k = 0; k < shapes.size(); ++k) {
    const auto& [levels, how] = shapes[k];
    const std::size_t vocab = levels.size() == 2 && levels[0] * levels[1] >= 4 ? 2 : 3;
    const double zeros = k % 2 == 0 ? 0.0 : 0.3;
    out.push_back({"tree " + std::to_string(k), random_model(vocab, g, zeros),
                   random_model(vocab, g, zeros),
                   TreeShape::branching(std::span<const std::size_t>(levels)), how, 0});
  }
  for (const std::size_t gamma : {2UL, 3UL}) {
    out.push_back({"chain " + std::to_string(gamma), random_model(3, g, 0.0),
                   random_model(3, g, 0.0), TreeShape::chain(gamma), drafting::without_replacement,
                   gamma});
  }
  const PrefixModel same = random_model(3, g, 0.2);
  const std::vector<std::size_t> two_by_one{2, 1};
  out.push_back(
      {"q = p", same, same, TreeShape::branching(two_by_one), drafting::without_replacement, 0});
  out.push_back({"paper example", PrefixModel{2, {{2.0 / 3.0, 1.0 / 3.0}}},
                 PrefixModel{2, {{1.0 / 3.0, 2.0 / 3.0}}}, TreeShape::chain(2),
                 drafting::with_replacement, 2});
  return out;
}

/// The verifier under test.
enum class verifier { traversal, skip_sibling_update, residual_without_weight, recursive };

/// One tree step: the builder drafts from `g`, the target scores every node, the verifier
/// decides with the same `g`.
struct Step {
  DraftTree<double> tree;
  specdec::DraftTreeWorkspace<double> drafting_workspace;
  specdec::TraversalWorkspace<double> traversal_workspace;
  specdec::TreeVerificationWorkspace<double> recursive_workspace;
  std::vector<double> rows;
  std::vector<token_id> path;

  template <class G>
  TreeVerificationResult run(const Setting& setting, verifier which, G& g) {
    PrefixLanguageModel draft{&setting.draft};
    const std::span<const token_id> prompt;
    if (setting.how == drafting::top_k) {
      (void)specdec::build_top_k_tree(draft, prompt, setting.shape, tree, drafting_workspace);
    } else {
      specdec::DraftTreeOptions options;
      options.sampling = setting.how == drafting::without_replacement
                             ? expansion::without_replacement
                             : expansion::with_replacement;
      options.merge_repeats = setting.how != drafting::with_replacement_nodes;
      (void)specdec::build_sampled_tree(draft, prompt, setting.shape, g, tree, drafting_workspace,
                                        options);
    }
    const std::size_t vocab = setting.target.vocab;
    rows.clear();
    for (std::size_t node = 0; node < tree.size(); ++node) {
      path.clear();
      tree.append_path(node, path);
      const auto& p = setting.target(path);
      rows.insert(rows.end(), p.begin(), p.end());
    }
    const RowsView<const double> target(rows.data(), tree.size(), vocab);
    switch (which) {
      case verifier::traversal:
        return specdec::verify_traversal(tree, target, g, traversal_workspace);
      case verifier::skip_sibling_update:
        return specdec::detail::traverse<traversal_rule::skip_sibling_update>(tree, target, g,
                                                                              traversal_workspace);
      case verifier::residual_without_weight:
        return specdec::detail::traverse<traversal_rule::residual_without_weight>(
            tree, target, g, traversal_workspace);
      case verifier::recursive:
        return specdec::verify_tree(tree, target, g, recursive_workspace);
    }
    return {};
  }

  /// The emitted tokens of a result on the current tree.
  [[nodiscard]] std::vector<token_id> emitted(const TreeVerificationResult& result) const {
    std::vector<token_id> out;
    specdec::append_emitted(tree, result, out);
    return out;
  }
};

/// What a scripted run did: how many uniforms it consumed and everything that tells runs
/// apart (the tree drafted and the verification's result).
struct Outcome {
  std::size_t consumed = 0;
  std::vector<std::int64_t> signature;
  std::vector<token_id> emitted;
  std::size_t accepted = 0;
};

Outcome scripted(Step& step, const Setting& setting, verifier which,
                 const std::vector<std::uint64_t>& ks) {
  ScriptedGenerator g;
  for (const std::uint64_t k : ks) g.outputs.push_back(k << 11U);
  g.outputs.resize(ks.size() + 64, 0);
  const TreeVerificationResult result = step.run(setting, which, g);
  Outcome out;
  out.consumed = g.next;
  for (std::size_t node = 0; node < step.tree.size(); ++node) {
    out.signature.push_back(step.tree.token(node));
    out.signature.push_back(static_cast<std::int64_t>(step.tree.parent(node)));
    out.signature.push_back(static_cast<std::int64_t>(step.tree.draws(node)));
  }
  out.signature.push_back(static_cast<std::int64_t>(result.node));
  out.signature.push_back(result.token);
  out.emitted = step.emitted(result);
  out.accepted = result.accepted;
  return out;
}

struct Enumerated {
  Law law;  ///< emitted tokens of one step
  double mean_accepted = 0.0;
  double mean_square = 0.0;
};

/// Every run the scripted uniforms can produce: at the first uniform not fixed by `prefix`,
/// [0, 2^53) splits into the intervals on which the run's outcome is constant (each draw is an
/// inverse CDF, each decision a threshold), and each interval is followed further.
void explore(Step& step, const Setting& setting, verifier which, std::vector<std::uint64_t>& prefix,
             double weight, Enumerated& out) {
  const Outcome here = scripted(step, setting, which, prefix);
  if (here.consumed <= prefix.size()) {
    out.law[here.emitted] += weight;
    const auto n = static_cast<double>(here.accepted);
    out.mean_accepted += weight * n;
    out.mean_square += weight * n * n;
    return;
  }
  std::uint64_t from = 0;
  while (from < grid) {
    prefix.push_back(from);
    const Outcome first = scripted(step, setting, which, prefix);
    prefix.pop_back();
    const std::uint64_t to = first_true(from + 1, [&](std::uint64_t k) {
      prefix.push_back(k);
      const bool differs = scripted(step, setting, which, prefix).signature != first.signature;
      prefix.pop_back();
      return differs;
    });
    prefix.push_back(from);
    explore(step, setting, which, prefix,
            weight * static_cast<double>(to - from) / static_cast<double>(grid), out);
    prefix.pop_back();
    from = to;
  }
}

Enumerated enumerate(const Setting& setting, verifier which) {
  Step step;
  Enumerated out;
  std::vector<std::uint64_t> prefix;
  explore(step, setting, which, prefix, 1.0, out);
  return out;
}

std::size_t law_length(const Setting& setting) {
  return setting.shape.max_depth() + 1;
}

Law target_law(const Setting& setting) {
  return extend(Law{{{}, 1.0}}, setting.target, law_length(setting));
}

double distance_to_target(const Setting& setting, const Enumerated& enumerated) {
  return max_difference(extend(enumerated.law, setting.target, law_length(setting)),
                        target_law(setting));
}

}  // namespace

TEST_CASE(
    "Traversal verification, enumerated on the real code with every drafted tree: the "
    "target law, never fewer accepted drafts than recursive rejection, block verification's "
    "expectation on chains",
    "[traversal_verification][exactness]") {
  std::size_t gains = 0;
  for (const Setting& setting : settings()) {
    const Enumerated traversal = enumerate(setting, verifier::traversal);
    const Enumerated recursive = enumerate(setting, verifier::recursive);
    INFO(setting.name << ": E[n] traversal " << traversal.mean_accepted << ", recursive "
                      << recursive.mean_accepted);
    CHECK(distance_to_target(setting, traversal) < 1e-12);
    CHECK(distance_to_target(setting, recursive) < 1e-12);
    CHECK(traversal.mean_accepted >= recursive.mean_accepted - 1e-12);
    if (traversal.mean_accepted > recursive.mean_accepted + 1e-3) ++gains;
    if (setting.gamma > 0) {  // a chain: block verification, exactly
      const double block =
          specdec::expected_accepted_drafts(setting.draft, setting.target, setting.target.vocab,
                                            setting.gamma, specdec::verification_rule::block);
      CHECK(std::abs(traversal.mean_accepted - block) < 1e-12);
    }
    if (setting.name == "paper example") {
      CHECK(std::abs(traversal.mean_accepted - 11.0 / 9.0) < 1e-12);
      CHECK(std::abs(recursive.mean_accepted - 10.0 / 9.0) < 1e-12);
    }
    if (setting.name == "q = p") {  // every path is accepted: the full depth
      CHECK(std::abs(traversal.mean_accepted - static_cast<double>(setting.shape.max_depth())) <
            1e-12);
    }
  }
  CHECK(gains >= 5);  // the settings show the gain, not only ties
}

TEST_CASE("Traversal verification enumeration catches every broken variant",
          "[traversal_verification][exactness]") {
  for (const verifier broken : {verifier::skip_sibling_update, verifier::residual_without_weight}) {
    double worst_chain = 0.0;
    double worst_tree = 0.0;  // trees with siblings below the root
    for (const Setting& setting : settings()) {
      const double distance = distance_to_target(setting, enumerate(setting, broken));
      double& worst = setting.shape.is_chain() ? worst_chain : worst_tree;
      worst = std::max(worst, distance);
    }
    INFO("variant " << static_cast<int>(broken));
    CHECK(worst_chain > 1e-3);
    CHECK(worst_tree > 1e-3);
  }
}

namespace {

/// Every sequence of `length` tokens over V, numbered.
std::map<std::vector<token_id>, std::size_t> all_cells(std::size_t vocab, std::size_t length) {
  std::map<std::vector<token_id>, std::size_t> cells;
  std::size_t total = 1;
  for (std::size_t i = 0; i < length; ++i) total *= vocab;
  for (std::size_t code = 0; code < total; ++code) {
    std::vector<token_id> sequence(length);
    std::size_t rest = code;
    for (auto& token : sequence) {
      token = static_cast<token_id>(rest % vocab);
      rest /= vocab;
    }
    cells.emplace(sequence, code);
  }
  return cells;
}

struct Sampled {
  std::vector<std::uint64_t> counts;
  double mean_accepted = 0.0;
};

/// `samples` real tree steps (drafting, scoring, verification from one generator), each
/// continued by target sampling to the law's length.
Sampled sample_steps(const Setting& setting, verifier which, std::size_t samples,
                     std::uint64_t seed) {
  const std::size_t length = law_length(setting);
  const auto cells = all_cells(setting.target.vocab, length);
  specdec::xoshiro256pp g(seed);
  Step step;
  Sampled out;
  out.counts.assign(cells.size(), 0);
  double accepted = 0.0;
  for (std::size_t s = 0; s < samples; ++s) {
    const TreeVerificationResult result = step.run(setting, which, g);
    accepted += static_cast<double>(result.accepted);
    std::vector<token_id> sequence = step.emitted(result);
    while (sequence.size() < length) {
      sequence.push_back(
          specdec::sample_from_row(std::span<const double>(setting.target(sequence)), g));
    }
    ++out.counts[cells.at(sequence)];
  }
  out.mean_accepted = accepted / static_cast<double>(samples);
  return out;
}

specdec::stats::ChiSquareResult fit(const Setting& setting, const Sampled& sampled) {
  const auto cells = all_cells(setting.target.vocab, law_length(setting));
  const Law expected = target_law(setting);
  std::vector<double> probabilities(cells.size(), 0.0);
  for (const auto& [sequence, cell] : cells) {
    const auto it = expected.find(sequence);
    probabilities[cell] = it == expected.end() ? 0.0 : it->second;
  }
  return specdec::stats::chi_square_test(sampled.counts, probabilities);
}

}  // namespace

TEST_CASE(
    "Traversal verification, sampled: chi-square against the target law; each broken "
    "variant fails it",
    "[traversal_verification][exactness][statistical]") {
  const auto all = settings();
  for (const std::size_t index : {1UL, 4UL, 7UL}) {
    const Setting& setting = all[index];
    const std::size_t cells = all_cells(setting.target.vocab, law_length(setting)).size();
    const std::size_t samples = specdec::testing::scaled_samples_to_detect(0.01, cells);
    const auto result =
        fit(setting, sample_steps(setting, verifier::traversal, samples, 31 + index));
    INFO(setting.name << ": " << result.describe());
    CHECK(result.passed());
  }
  for (const verifier broken : {verifier::skip_sibling_update, verifier::residual_without_weight}) {
    std::size_t worst_index = 0;
    double worst = 0.0;
    for (std::size_t k = 0; k < all.size(); ++k) {
      const double tv = law_total_variation(
          extend(enumerate(all[k], broken).law, all[k].target, law_length(all[k])),
          target_law(all[k]));
      if (tv > worst) {
        worst = tv;
        worst_index = k;
      }
    }
    const Setting& setting = all[worst_index];
    const std::size_t cells = all_cells(setting.target.vocab, law_length(setting)).size();
    const std::size_t samples =
        specdec::stats::samples_to_detect(worst, static_cast<double>(cells));
    const auto result = fit(setting, sample_steps(setting, broken, samples, 97));
    INFO("variant " << static_cast<int>(broken) << " on " << setting.name << " (TV " << worst
                    << "): " << result.describe());
    CHECK_FALSE(result.passed());
  }
}

TEST_CASE(
    "Traversal verification, sampled: the mean accepted drafts per step are the exact "
    "expectation; recursive rejection falls short of it",
    "[traversal_verification][statistical]") {
  const double z_critical = 6.1094;  // two-sided false-failure rate 1e-9
  const auto all = settings();
  // The setting with the largest gain over recursive rejection.
  std::size_t best = 0;
  double best_gap = 0.0;
  std::vector<Enumerated> exact;
  for (std::size_t k = 0; k < all.size(); ++k) {
    exact.push_back(enumerate(all[k], verifier::traversal));
    const double gap =
        exact[k].mean_accepted - enumerate(all[k], verifier::recursive).mean_accepted;
    if (gap > best_gap) {
      best_gap = gap;
      best = k;
    }
  }
  REQUIRE(best_gap > 0.01);
  const Setting& setting = all[best];
  const double mean = exact[best].mean_accepted;
  const double variance = exact[best].mean_square - mean * mean;
  const auto samples = static_cast<std::size_t>(
      std::ceil(std::pow(2.0 * z_critical, 2.0) * variance / (best_gap * best_gap)));
  const Sampled traversal = sample_steps(setting, verifier::traversal, samples, 5);
  const Sampled recursive = sample_steps(setting, verifier::recursive, samples, 5);
  const double error = std::sqrt(variance / static_cast<double>(samples));
  INFO(setting.name << ": E[n] " << mean << ", traversal " << traversal.mean_accepted
                    << ", recursive " << recursive.mean_accepted << ", standard error " << error
                    << ", " << samples << " steps");
  CHECK(std::abs(traversal.mean_accepted - mean) <= z_critical * error);
  CHECK(std::abs(recursive.mean_accepted - mean) > z_critical * error);
}

TEST_CASE("Traversal verification allocates nothing once its workspace is warm",
          "[traversal_verification][allocation]") {
  for (const Setting& setting : settings()) {
    Step step;
    specdec::xoshiro256pp g(8);
    for (int warm = 0; warm < 200; ++warm) (void)step.run(setting, verifier::traversal, g);
    std::size_t allocations = 0;
    {
      specdec::testing::AllocationCounter counter;
      for (int s = 0; s < 500; ++s) (void)step.run(setting, verifier::traversal, g);
      allocations = counter.stop();
    }
    INFO(setting.name);  // INFO allocates: after the count
    CHECK(allocations == 0);
  }
}
