// Tests for the token-tree path of include/specdec/speculative_decoder.hpp
// (DecoderOptions::tree_shape): greedy identity, the exact output law for branching trees
// with and without replacement and for chain shapes, stop conditions, statistics, option
// checks and model errors; a KV-cache target with score_tree (one call per step, only the
// accepted path kept in its cache, the same tokens as per-node and batched targets).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "specdec/cached_context.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/tree_verification.hpp"
#include "speculative_decoder_models.hpp"
#include "support/statistics.hpp"

namespace {

using Catch::Matchers::ContainsSubstring;
using specdec::DecoderOptions;
using specdec::expansion;
using specdec::SpeculativeDecoder;
using specdec::stop_reason;
using specdec::token_id;
using specdec::TreeShape;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::CountingUpDrafter;
using specdec::testing::MarkovModel;

// Plain greedy decoding of the target (argmax, lowest id among ties).
template <class Model>
std::vector<token_id> greedy_reference(Model& target, std::vector<token_id> context,
                                       std::size_t count) {
  std::vector<token_id> out;
  for (std::size_t i = 0; i < count; ++i) {
    const auto row = target.next_token_probabilities(context);
    const auto best = static_cast<token_id>(std::max_element(row.begin(), row.end()) - row.begin());
    out.push_back(best);
    context.push_back(best);
  }
  return out;
}

// Law of the first `length` tokens after `prompt` under standardized rows of `model`:
// index = sum tokens[k] * V^(length-1-k).
template <class T>
std::vector<double> sequence_law(MarkovModel<T>& model, const std::vector<token_id>& prompt,
                                 std::size_t length, const specdec::SamplingOptions& sampling) {
  const std::size_t vocab = model.vocab_size();
  std::vector<double> law{1.0};
  std::vector<std::vector<token_id>> contexts{prompt};
  for (std::size_t k = 0; k < length; ++k) {
    std::vector<double> next;
    std::vector<std::vector<token_id>> next_contexts;
    for (std::size_t s = 0; s < law.size(); ++s) {
      const auto row = specdec::standardize(model.next_token_probabilities(contexts[s]), sampling);
      for (std::size_t x = 0; x < vocab; ++x) {
        next.push_back(law[s] * static_cast<double>(row[x]));
        next_contexts.push_back(contexts[s]);
        next_contexts.back().push_back(static_cast<token_id>(x));
      }
    }
    law = std::move(next);
    contexts = std::move(next_contexts);
  }
  double total = 0.0;
  for (const double x : law) total += x;
  for (double& x : law) x /= total;  // rounding of float rows
  return law;
}

std::size_t sequence_index(std::span<const token_id> tokens, std::size_t vocab) {
  std::size_t index = 0;
  for (const token_id t : tokens) index = index * vocab + static_cast<std::size_t>(t);
  return index;
}

// The errc of the specdec::error `call` throws, or 0 if it throws none.
int error_code_of(auto&& call) {
  try {
    call();
  } catch (const specdec::error& e) {
    return static_cast<int>(e.code());
  }
  return 0;
}

constexpr int invalid_option = static_cast<int>(specdec::errc::invalid_option);

}  // namespace

TEMPLATE_TEST_CASE("SpeculativeDecoder tree: greedy trees reproduce greedy decoding of the target",
                   "[speculative_decoder][tree][greedy]", float, double) {
  auto target = MarkovModel<TestType>::random(8, 2, 101, 1.5);
  auto draft = MarkovModel<TestType>::random(8, 1, 202, 1.5).order1_blend(target, 0.5);
  BatchedMarkovModel<TestType> batched(target);
  DecoderOptions options;
  options.sampling.temperature = 0.0;
  options.tree_shape = TreeShape::branching({3, 2, 1});
  SpeculativeDecoder decoder(target, draft, options);
  SpeculativeDecoder batched_decoder(batched, draft, options);
  specdec::xoshiro256pp prompts(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<token_id> prompt(1 + specdec::uniform_below(prompts, 4));
    for (auto& t : prompt) t = static_cast<token_id>(specdec::uniform_below(prompts, 8));
    const auto expected = greedy_reference(target, prompt, 12);
    const auto result = decoder.generate(prompt, 12, static_cast<std::uint64_t>(trial));
    REQUIRE(result.tokens == expected);
    CHECK(result.stop == stop_reason::max_new_tokens);
    REQUIRE(batched_decoder.generate(prompt, 12, std::uint64_t{1}).tokens == expected);
  }
  // Greedy trees accept along the argmax path: depth > 0 happens with a resembling draft.
  CHECK(decoder.statistics().accepted_tokens > 0);
}

TEST_CASE("SpeculativeDecoder tree: the first tokens have the target's exact law",
          "[speculative_decoder][tree][exactness]") {
  constexpr std::size_t vocab = 6;
  constexpr std::size_t length = 3;
  auto target = MarkovModel<double>::random(vocab, 2, 303, 1.5);
  auto draft = MarkovModel<double>::random(vocab, 1, 404, 1.5).order1_blend(target, 0.4);
  const std::vector<token_id> prompt{2, 4};
  specdec::SamplingOptions sampling;
  sampling.temperature = 0.8;
  sampling.top_k = 5;
  const auto expected = sequence_law(target, prompt, length, sampling);
  const auto draft_law = sequence_law(draft, prompt, length, sampling);
  const double tv = specdec::testing::total_variation(expected, draft_law);
  INFO("TV(target, draft) = " << tv);
  REQUIRE(tv > 0.1);
  const std::size_t samples = 30000;

  struct Case {
    const char* name;
    TreeShape shape;
    expansion kind;
    bool merge;
    specdec::verification_rule rule;
  };
  // automatic: traversal verification; token: recursive rejection.
  const Case cases[] = {
      {"branching {3,2,1} without replacement", TreeShape::branching({3, 2, 1}),
       expansion::without_replacement, true, specdec::verification_rule::automatic},
      {"branching {3,2,1} with replacement, merged", TreeShape::branching({3, 2, 1}),
       expansion::with_replacement, true, specdec::verification_rule::automatic},
      {"branching {2,2} with replacement, duplicates", TreeShape::branching({2, 2}),
       expansion::with_replacement, false, specdec::verification_rule::automatic},
      {"chain(3) (block verification)", TreeShape::chain(3), expansion::without_replacement, true,
       specdec::verification_rule::automatic},
      {"branching {3,2,1} without replacement, recursive rejection",
       TreeShape::branching({3, 2, 1}), expansion::without_replacement, true,
       specdec::verification_rule::token},
      {"branching {3,2,1} with replacement, merged, recursive rejection",
       TreeShape::branching({3, 2, 1}), expansion::with_replacement, true,
       specdec::verification_rule::token},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    DecoderOptions options;
    options.sampling = sampling;
    options.tree_shape = c.shape;
    options.tree_sampling = c.kind;
    options.tree_merge_repeats = c.merge;
    options.verification = c.rule;
    SpeculativeDecoder decoder(target, draft, options);
    specdec::xoshiro256pp g(55);
    std::vector<std::uint64_t> counts(expected.size(), 0);
    for (std::size_t i = 0; i < samples; ++i) {
      const auto result = decoder.generate(prompt, length, g);
      REQUIRE(result.tokens.size() == length);
      ++counts[sequence_index(result.tokens, vocab)];
    }
    const auto test = specdec::testing::chi_square_test(counts, expected);
    INFO(test.describe());
    CHECK(test.passed());
    // The tree does work: some steps accept draft tokens.
    CHECK(decoder.statistics().accepted_tokens > 0);
  }

  {
    INFO("negative control: the draft tree's first path, unverified");
    // Draws the first root-to-leaf path of a sampled {3,2,1} tree (its first children are
    // plain draws from the standardized q rows): the draft's law, not the target's.
    specdec::TreeStepWorkspace<double> workspace;
    specdec::Standardizer<double> standardizer(sampling);
    specdec::xoshiro256pp g(56);
    const TreeShape shape = TreeShape::branching({3, 2, 1});
    std::vector<std::uint64_t> counts(expected.size(), 0);
    std::vector<token_id> path;
    for (std::size_t i = 0; i < samples; ++i) {
      specdec::build_sampled_tree(
          draft, std::span<const token_id>(prompt), shape, g, workspace.tree, workspace.drafting,
          specdec::DraftTreeOptions{},
          [&](auto raw, std::span<double> out) { standardizer.apply(raw, out); });
      path.clear();
      std::size_t node = 0;
      for (std::size_t k = 0; k < length; ++k) {
        node = workspace.tree.first_child(node);
        path.push_back(workspace.tree.token(node));
      }
      ++counts[sequence_index(path, vocab)];
    }
    const auto test = specdec::testing::chi_square_test(counts, expected);
    INFO(test.describe());
    CHECK_FALSE(test.passed());
  }
}

TEST_CASE(
    "SpeculativeDecoder tree: sampled trees verify by traversal by default (as "
    "verification = block), token selects recursive rejection, as tree_step does",
    "[speculative_decoder][tree][traversal]") {
  auto target = MarkovModel<double>::random(6, 2, 717, 1.0);
  auto draft = MarkovModel<double>::random(6, 1, 818, 1.0).order1_blend(target, 0.5);
  const std::vector<token_id> prompt{0};
  const auto run = [&](specdec::verification_rule rule) {
    DecoderOptions options;
    options.tree_shape = TreeShape::branching({3, 2, 1});
    options.verification = rule;
    SpeculativeDecoder decoder(target, draft, options);
    return decoder.generate(prompt, 300, std::uint64_t{21}).tokens;
  };
  const auto automatic = run(specdec::verification_rule::automatic);
  CHECK(automatic == run(specdec::verification_rule::block));
  CHECK(automatic != run(specdec::verification_rule::token));
  // The same step through tree_step with TreeOptions::verification: the same tokens.
  const auto loop = [&](specdec::verification_rule rule) {
    specdec::TreeGenerationOptions options;
    options.max_new_tokens = 300;
    options.tree.shape = TreeShape::branching({3, 2, 1});
    options.tree.verification = rule;
    specdec::xoshiro256pp g(21);
    return specdec::generate_with_tree<double>(target, draft, prompt, options, g).tokens;
  };
  CHECK(loop(specdec::verification_rule::automatic) == loop(specdec::verification_rule::block));
  CHECK(loop(specdec::verification_rule::automatic) != loop(specdec::verification_rule::token));
}

TEST_CASE("SpeculativeDecoder tree: stop tokens, stop sequences and max_new_tokens are exact",
          "[speculative_decoder][tree][stop]") {
  auto target = MarkovModel<double>::random(6, 2, 505, 1.0);
  auto draft = MarkovModel<double>::random(6, 1, 606, 1.0).order1_blend(target, 0.6);
  SECTION("stop tokens and max_new_tokens, sampled and greedy") {
    for (const bool greedy : {false, true}) {
      INFO("greedy " << greedy);
      DecoderOptions options;
      options.sampling.temperature = greedy ? 0.0 : 1.0;
      options.tree_shape = TreeShape::branching({2, 2, 1});
      options.stop_tokens = {5};
      std::vector<specdec::EmittedToken> streamed;
      options.on_token = [&](const specdec::EmittedToken& e) { streamed.push_back(e); };
      SpeculativeDecoder decoder(target, draft, options);
      std::size_t stopped = 0;
      const std::vector<token_id> prompt{1, 3};
      for (std::uint64_t seed = 0; seed < 200; ++seed) {
        streamed.clear();
        const std::size_t budget = 1 + seed % 9;
        const auto result = decoder.generate(prompt, budget, seed);
        REQUIRE(result.tokens.size() <= budget);
        REQUIRE(streamed.size() == result.tokens.size());
        for (std::size_t k = 0; k < streamed.size(); ++k) {
          CHECK(streamed[k].token == result.tokens[k]);
          CHECK(streamed[k].position == prompt.size() + k);
        }
        const auto first_stop = std::find(result.tokens.begin(), result.tokens.end(), 5);
        if (result.stop == stop_reason::stop_token) {
          ++stopped;
          REQUIRE(first_stop == result.tokens.end() - 1);
        } else {
          REQUIRE(result.stop == stop_reason::max_new_tokens);
          REQUIRE(first_stop == result.tokens.end());
          REQUIRE(result.tokens.size() == budget);
        }
      }
      if (!greedy) CHECK(stopped > 0);
    }
  }

  SECTION("stop sequences") {
    DecoderOptions options;
    options.tree_shape = TreeShape::branching({3, 1});
    options.stop_sequences = {{0, 1}};
    SpeculativeDecoder decoder(target, draft, options);
    std::size_t stopped = 0;
    for (std::uint64_t seed = 0; seed < 200; ++seed) {
      const auto result = decoder.generate(std::vector<token_id>{2}, 10, seed);
      const auto& t = result.tokens;
      if (result.stop == stop_reason::stop_sequence) {
        ++stopped;
        REQUIRE(t.size() >= 2);
        CHECK(t[t.size() - 2] == 0);
        CHECK(t.back() == 1);
      } else {
        CHECK(t.size() == 10);
      }
      for (std::size_t k = 0; k + 2 < t.size(); ++k) CHECK_FALSE((t[k] == 0 && t[k + 1] == 1));
    }
    CHECK(stopped > 0);
  }

  SECTION("step() with a token limit") {
    DecoderOptions options;
    options.tree_shape = TreeShape::chain(4);
    SpeculativeDecoder decoder(target, draft, options);
    specdec::xoshiro256pp g(9);
    const std::vector<token_id> context{1, 2, 3};
    for (int i = 0; i < 100; ++i) {
      const auto step = decoder.step(context, g, 2);
      REQUIRE(step.tokens.size() >= 1);
      REQUIRE(step.tokens.size() <= 2);
      if (step.tokens.size() == 2) CHECK(step.stop == stop_reason::max_new_tokens);
    }
  }
}

TEST_CASE("SpeculativeDecoder tree: statistics count nodes, calls and accepted depths",
          "[speculative_decoder][tree][statistics]") {
  auto target = MarkovModel<double>::random(6, 2, 707, 1.0);
  auto draft = MarkovModel<double>::random(6, 1, 808, 1.0).order1_blend(target, 0.5);
  BatchedMarkovModel<double> batched(target);
  DecoderOptions options;
  options.tree_shape = TreeShape::branching({3, 2, 1});  // 15 draft nodes, 6 leaves
  options.tree_sampling = expansion::without_replacement;

  const auto check_common = [](const specdec::DecoderStatistics& s) {
    CHECK(s.steps > 0);
    CHECK(s.nodes_scored == s.drafted_tokens);
    CHECK(s.nodes_scored == 15 * s.steps);  // full-support rows: every tree is full
    CHECK(s.draft_calls == 10 * s.steps);   // the root, 3 children, 6 grandchildren
    CHECK(s.beta_positions == 0);
    std::size_t steps = 0;
    std::size_t accepted = 0;
    for (std::size_t n = 0; n < s.accepted_histogram.size(); ++n) {
      steps += s.accepted_histogram[n];
      accepted += n * s.accepted_histogram[n];
    }
    CHECK(steps == s.steps);
    CHECK(accepted == s.accepted_tokens);
    CHECK(s.accepted_histogram.size() <= 4);  // depth <= 3
    CHECK(s.emitted_tokens <= s.accepted_tokens + s.steps);
  };

  SECTION("per-node target (one call per node)") {
    SpeculativeDecoder decoder(target, draft, options);
    const auto result = decoder.generate(std::vector<token_id>{0}, 60, std::uint64_t{3});
    const auto& s = result.statistics;
    check_common(s);
    CHECK(s.target_calls == 16 * s.steps);
    CHECK(s.nodes_per_target_call() == Catch::Approx(15.0 / 16.0));
    CHECK(s.emitted_tokens == 60);
    CHECK(decoder.statistics().steps == s.steps);
  }
  SECTION("score_draft target (one call per root-to-leaf path)") {
    SpeculativeDecoder decoder(batched, draft, options);
    const auto result = decoder.generate(std::vector<token_id>{0}, 60, std::uint64_t{3});
    check_common(result.statistics);
    CHECK(result.statistics.target_calls == 6 * result.statistics.steps);
  }
  SECTION("step results") {
    SpeculativeDecoder decoder(target, draft, options);
    specdec::xoshiro256pp g(4);
    const auto step = decoder.step(std::vector<token_id>{1, 2}, g);
    CHECK(step.nodes_scored == 15);
    CHECK(step.drafted == 15);
    CHECK(step.target_calls == 16);
    CHECK(step.draft_calls == 10);
    CHECK(step.tokens.size() == step.accepted + 1);
    CHECK(step.beta_positions == 0);
    for (std::size_t k = 0; k < step.tokens.size(); ++k) {
      CHECK((step.sources[k] == specdec::token_source::draft) == (k < step.accepted));
    }
  }
  SECTION("chain path: nodes_scored == drafted") {
    DecoderOptions chain;
    chain.gamma_policy = specdec::FixedGamma{3};
    SpeculativeDecoder decoder(target, draft, chain);
    const auto result = decoder.generate(std::vector<token_id>{0}, 40, std::uint64_t{3});
    CHECK(result.statistics.nodes_scored == result.statistics.drafted_tokens);
    CHECK(result.statistics.nodes_per_target_call() ==
          Catch::Approx(static_cast<double>(result.statistics.drafted_tokens) /
                        static_cast<double>(result.statistics.target_calls)));
  }
}

TEST_CASE("SpeculativeDecoder tree: tree options are checked at construction",
          "[speculative_decoder][tree][options]") {
  auto target = MarkovModel<double>::random(4, 1, 909, 1.0);
  auto draft = MarkovModel<double>::random(4, 1, 910, 1.0);
  CountingUpDrafter drafter{4};
  DecoderOptions options;
  options.tree_shape = TreeShape::branching({2, 1});
  try {
    SpeculativeDecoder decoder(target, drafter, options);
    FAIL("a proposal drafter with a tree shape was accepted");
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::invalid_option);
    CHECK_THAT(e.what(), ContainsSubstring("tree_shape"));
  }
  options.lenience = 0.5;
  try {
    SpeculativeDecoder decoder(target, draft, options);
    FAIL("lenience < 1 with a tree shape was accepted");
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::invalid_option);
    CHECK_THAT(e.what(), ContainsSubstring("tree_shape"));
    CHECK_THAT(e.what(), ContainsSubstring("lenience"));
  }
  options.lenience = 1.0;
  options.tree_sampling = expansion::one_hot;
  CHECK(error_code_of([&] { SpeculativeDecoder decoder(target, draft, options); }) ==
        invalid_option);
  // The root alone is the chain path: fine for drafters and lenient verification.
  DecoderOptions chain;
  chain.lenience = 0.5;
  CHECK(error_code_of([&] { SpeculativeDecoder decoder(target, drafter, chain); }) == 0);
}

namespace {

// Throws on its `fail_at`-th call (0-based), or returns a row of the wrong size.
struct FailingModel {
  MarkovModel<double>* inner;
  std::size_t fail_at = 0;
  bool wrong_size = false;
  std::size_t calls = 0;
  std::vector<double> buffer{};
  std::size_t vocab_size() const { return inner->vocab_size(); }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    const auto row = inner->next_token_probabilities(context);
    buffer.assign(row.begin(), row.end());
    if (calls++ == fail_at) {
      if (!wrong_size) throw std::runtime_error("device lost");
      buffer.push_back(0.0);
    }
    return buffer;
  }
};

}  // namespace

TEST_CASE("SpeculativeDecoder tree: model failures become decoding_error",
          "[speculative_decoder][tree][errors]") {
  auto inner_target = MarkovModel<double>::random(5, 2, 111, 1.0);
  auto draft = MarkovModel<double>::random(5, 1, 112, 1.0).order1_blend(inner_target, 0.5);
  DecoderOptions options;
  options.tree_shape = TreeShape::branching({2, 1});  // 4 draft nodes, 5 target calls
  for (const bool wrong_size : {false, true}) {
    INFO("wrong size " << wrong_size);
    FailingModel target{&inner_target, 12, wrong_size};  // in the third step
    SpeculativeDecoder decoder(target, draft, options);
    try {
      (void)decoder.generate(std::vector<token_id>{0}, 100, std::uint64_t{8});
      FAIL("no error");
    } catch (const specdec::decoding_error& e) {
      CHECK(e.code() == (wrong_size ? specdec::errc::invalid_size : specdec::errc::model_failure));
      CHECK(e.step() == 2);
      CHECK_THAT(e.what(), ContainsSubstring("tree step 2 (sequence position "));
      if (!wrong_size) {
        CHECK_THAT(e.what(), ContainsSubstring("the target model threw: device lost"));
        CHECK_THROWS_AS(std::rethrow_if_nested(e), std::runtime_error);
      }
      // Tokens of the two completed steps are kept; the statistics of those steps too.
      CHECK(e.tokens().size() >= 2);
      CHECK(std::vector<token_id>(e.tokens().begin(), e.tokens().end()) ==
            std::vector<token_id>(decoder.generated().begin(), decoder.generated().end()));
      CHECK(decoder.statistics().steps == 2);
    }
    // The decoder stays usable.
    target.fail_at = static_cast<std::size_t>(-1);
    CHECK(decoder.generate(std::vector<token_id>{0}, 10, std::uint64_t{9}).tokens.size() == 10);
  }
}

namespace {

// A batched target (score_draft) or a draft that throws a specdec::error of its own on its
// `fail_at`-th call: a model's exception, not a bad row.
struct ThrowingSpecdecErrorModel {
  MarkovModel<double>* inner;
  std::size_t fail_at = 0;
  std::size_t calls = 0;
  std::vector<double> rows{};
  std::size_t vocab_size() const { return inner->vocab_size(); }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    if (calls++ == fail_at) {
      throw specdec::error(specdec::errc::invalid_token, "engine: token not in the cache");
    }
    return inner->next_token_probabilities(context);
  }
  specdec::RowsView<const double> score_draft(std::span<const token_id> context,
                                              std::span<const token_id> draft) {
    if (calls++ == fail_at) throw std::runtime_error("batch too large");
    rows.clear();
    std::vector<token_id> prefix(context.begin(), context.end());
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const auto row = inner->next_token_probabilities(prefix);
      rows.insert(rows.end(), row.begin(), row.end());
      if (i < draft.size()) prefix.push_back(draft[i]);
    }
    return {rows.data(), draft.size() + 1, vocab_size()};
  }
};

}  // namespace

TEST_CASE("SpeculativeDecoder tree: any exception of a model is model_failure, naming the model",
          "[speculative_decoder][tree][errors]") {
  auto inner_target = MarkovModel<double>::random(5, 2, 121, 1.0);
  auto inner_draft = MarkovModel<double>::random(5, 1, 122, 1.0).order1_blend(inner_target, 0.5);
  DecoderOptions options;
  options.tree_shape = TreeShape::branching({2, 1});
  {  // the draft throws a specdec::error: model_failure, the error nested with its own code
    auto target = inner_target;
    ThrowingSpecdecErrorModel draft{&inner_draft, 7};
    SpeculativeDecoder decoder(target, draft, options);
    try {
      (void)decoder.generate(std::vector<token_id>{0}, 100, std::uint64_t{5});
      FAIL("no error");
    } catch (const specdec::decoding_error& e) {
      CHECK(e.code() == specdec::errc::model_failure);
      CHECK_THAT(e.what(),
                 ContainsSubstring("the draft model threw: specdec: invalid_token: engine:"));
      try {
        std::rethrow_if_nested(e);
        FAIL("nothing nested");
      } catch (const specdec::error& nested) {
        CHECK(nested.code() == specdec::errc::invalid_token);
      }
      CHECK(std::vector<token_id>(e.tokens().begin(), e.tokens().end()) ==
            std::vector<token_id>(decoder.generated().begin(), decoder.generated().end()));
    }
    draft.fail_at = static_cast<std::size_t>(-1);
    CHECK(decoder.generate(std::vector<token_id>{0}, 10, std::uint64_t{9}).tokens.size() == 10);
  }
  {  // a batched target throwing from score_draft
    ThrowingSpecdecErrorModel target{&inner_target, 3};
    static_assert(specdec::BatchedLanguageModel<ThrowingSpecdecErrorModel>);
    auto draft = inner_draft;
    SpeculativeDecoder decoder(target, draft, options);
    try {
      (void)decoder.generate(std::vector<token_id>{0}, 100, std::uint64_t{5});
      FAIL("no error");
    } catch (const specdec::decoding_error& e) {
      CHECK(e.code() == specdec::errc::model_failure);
      CHECK_THAT(e.what(), ContainsSubstring("the target model threw: batch too large"));
      CHECK_THROWS_AS(std::rethrow_if_nested(e), std::runtime_error);
    }
  }
}

// ---------------------------------------------------------------------------------------
// A KV-cache target that scores the whole tree in one call (score_tree + CachedContext)
// ---------------------------------------------------------------------------------------

TEST_CASE(
    "SpeculativeDecoder tree: a KV-cache score_tree target, one call per step, keeps only "
    "the accepted path",
    "[speculative_decoder][tree][cached_context]") {
  using specdec::CacheSync;
  using specdec::testing::KvTreeMarkovModel;
  STATIC_REQUIRE(specdec::TreeScoringModel<KvTreeMarkovModel<double>>);
  STATIC_REQUIRE(specdec::KvCacheTreeHooks<KvTreeMarkovModel<double>>);
  const auto chain = MarkovModel<double>::random(8, 2, 131, 1.5);
  const auto draft_chain = MarkovModel<double>::random(8, 1, 132, 1.5).order1_blend(chain, 0.5);
  for (const double temperature : {0.0, 1.0}) {
    INFO("T = " << temperature);
    KvTreeMarkovModel<double> target(chain);
    auto draft = draft_chain;
    DecoderOptions options;
    options.sampling.temperature = temperature;
    options.tree_shape = TreeShape::branching({3, 2, 1});  // 15 draft nodes
    SpeculativeDecoder decoder(target, draft, options);
    specdec::xoshiro256pp g(21);
    std::vector<token_id> context{3, 1, 4};
    const std::size_t prompt_length = context.size();
    std::size_t steps = 0;
    std::size_t discarded = 0;  // tree nodes not on an accepted path
    std::size_t previous_nodes = 0;
    std::size_t previous_accepted = 0;
    while (context.size() < prompt_length + 300) {
      INFO("step " << steps);
      const std::size_t evaluated_before = target.evaluated_positions;
      const auto step = decoder.step(context, g);
      // (a) one target call per step, by the decoder's count and the model's.
      REQUIRE(step.target_calls == 1);
      REQUIRE(target.tree_calls == steps + 1);
      REQUIRE(step.nodes_scored == 15);
      // The correction never repeats a child of the last accepted node (rejected children
      // have no residual mass; greedy follows the argmax child), so t is never in the tree.
      REQUIRE_FALSE(step.residual_fallback);
      if (steps > 0) {
        // (b) resolving the previous tree left exactly the context minus its last token t:
        // the accepted path was kept, every other tree slot dropped, then t appended.
        const std::vector<token_id> without_t(context.begin(), context.end() - 1);
        REQUIRE(std::vector<token_id>(target.resolved().begin(), target.resolved().end()) ==
                without_t);
        REQUIRE(target.last_sync() == CacheSync{.kept = context.size() - 1,
                                                .truncated = previous_nodes - previous_accepted,
                                                .appended = 1,
                                                .tree_path = previous_accepted});
      }
      // (c) positions evaluated in step k: the 15 tree nodes plus t of step k - 1 (the whole
      // prompt in step 0). No accepted token is evaluated again.
      REQUIRE(target.evaluated_positions - evaluated_before ==
              step.nodes_scored + (steps == 0 ? prompt_length : 1));
      // After the step the cache holds the context, then the pending tree's slots.
      REQUIRE(target.held().size() == context.size() + step.nodes_scored);
      REQUIRE(std::equal(context.begin(), context.end(), target.held().begin()));
      REQUIRE(step.tokens.size() == step.accepted + 1);
      context.insert(context.end(), step.tokens.begin(), step.tokens.end());
      discarded += step.nodes_scored - step.accepted;
      previous_nodes = step.nodes_scored;
      previous_accepted = step.accepted;
      ++steps;
    }
    // A last plain call resolves the last tree the same way.
    (void)target.next_token_probabilities(context);
    CHECK(std::vector<token_id>(target.resolved().begin(), target.resolved().end()) ==
          std::vector<token_id>(context.begin(), context.end() - 1));
    CHECK(std::vector<token_id>(target.held().begin(), target.held().end()) == context);
    // Every position of the final sequence was evaluated exactly once, plus the tree nodes
    // that were not accepted: sum over steps of (15 + 1) + prompt - 1 in total.
    CHECK(target.evaluated_positions == context.size() + discarded);
    CHECK(target.evaluated_positions == prompt_length + 16 * steps);
    CHECK(target.calls == 1);  // only the resolving call above: the decoder used score_tree
    const auto& statistics = decoder.statistics();
    CHECK(statistics.steps == steps);
    CHECK(statistics.target_calls == steps);
    CHECK(statistics.nodes_scored == 15 * steps);
    // Paths below node 1 or through nodes 2 and 3 must be gathered; depth > 1 happens.
    CHECK(statistics.accepted_histogram.size() > 2);
    CHECK(target.gathers > 0);
  }
}

TEMPLATE_TEST_CASE(
    "SpeculativeDecoder tree: a KV-cache score_tree target gives the tokens of the "
    "per-node and batched targets",
    "[speculative_decoder][tree][cached_context]", float, double) {
  using specdec::testing::KvTreeMarkovModel;
  const auto chain = MarkovModel<TestType>::random(8, 2, 141, 1.5);
  const auto draft_chain = MarkovModel<TestType>::random(8, 1, 142, 1.5).order1_blend(chain, 0.5);
  struct Case {
    const char* name;
    double temperature;
    expansion kind;
    bool merge;
  };
  const Case cases[] = {
      {"greedy", 0.0, expansion::without_replacement, true},
      {"T = 1 without replacement", 1.0, expansion::without_replacement, true},
      {"T = 1 with replacement, merged", 1.0, expansion::with_replacement, true},
      // Duplicate siblings: the cache keeps the first of equal siblings (identical entries)
      // even when verification accepted a later one.
      {"T = 1 with replacement, duplicates", 1.0, expansion::with_replacement, false},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    DecoderOptions options;
    options.sampling.temperature = c.temperature;
    options.tree_shape = TreeShape::branching({3, 2, 1});
    options.tree_sampling = c.kind;
    options.tree_merge_repeats = c.merge;
    KvTreeMarkovModel<TestType> cached(chain);
    auto plain = chain;
    BatchedMarkovModel<TestType> batched(chain);
    auto draft_a = draft_chain;
    auto draft_b = draft_chain;
    auto draft_c = draft_chain;
    SpeculativeDecoder cached_decoder(cached, draft_a, options);
    SpeculativeDecoder plain_decoder(plain, draft_b, options);
    SpeculativeDecoder batched_decoder(batched, draft_c, options);
    specdec::xoshiro256pp prompts(8);
    std::size_t steps = 0;
    for (std::uint64_t trial = 0; trial < 40; ++trial) {
      // Each prompt diverges from the cache somewhere: the pending tree is dropped.
      std::vector<token_id> prompt(1 + specdec::uniform_below(prompts, 5));
      for (auto& t : prompt) t = static_cast<token_id>(specdec::uniform_below(prompts, 8));
      const auto result = cached_decoder.generate(prompt, 40, trial);
      // (d) the same tokens as the per-node and the batched targets with the same seed.
      REQUIRE(result.tokens == plain_decoder.generate(prompt, 40, trial).tokens);
      REQUIRE(result.tokens == batched_decoder.generate(prompt, 40, trial).tokens);
      // (e) greedy trees: plain greedy decoding of the target.
      if (c.temperature == 0.0) REQUIRE(result.tokens == greedy_reference(plain, prompt, 40));
      // (a) one target call per step.
      CHECK(result.statistics.target_calls == result.statistics.steps);
      steps += result.statistics.steps;
    }
    CHECK(cached.tree_calls == steps);
    CHECK(cached.calls == 0);
    CHECK(cached_decoder.statistics().accepted_tokens > 0);
  }
}
