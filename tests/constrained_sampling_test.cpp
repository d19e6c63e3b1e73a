// Constrained and biased speculative sampling (constrained_model.hpp): the decoder on
// constrained models emits exactly the law of plain constrained sampling from the target.
//
// The law of plain constrained sampling is the definition, computed here directly: after
// each prefix, the target's row times exp(bias), with the tokens the constraint (a toy
// automaton over 4 tokens, its state a function of the generated tokens) or the ban list
// forbids set to zero, renormalised, then the decoder's SamplingOptions (Standardizer).
// The decoder's law is the real code's: a scripted generator feeds SpeculativeDecoder::
// generate on the constrained adaptors, and every breakpoint of every uniform is found by
// bisection over the 53-bit values (as in traversal_verification_test), so the law below is
// the exact law of what the code does: drafting, verification, rollback and all.
//
// Broken walks (detail::constraint_walk) are each shown to be caught, by the enumeration and
// by the chi-square: the mask applied to q only, the state not rolled back after a
// rejection, and the state advanced with the rejected draft token.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "errors_catalogue.hpp"
#include "specdec/batch_decoder.hpp"
#include "specdec/constrained_model.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/statistics.hpp"
#include "specdec/token_dfa.hpp"
#include "speculative_decoder_models.hpp"
#include "support/counting_allocator.hpp"
#include "support/prefix_model.hpp"
#include "support/scripted_uniforms.hpp"
#include "support/token_law.hpp"

namespace {

using specdec::BiasOptions;
using specdec::ConstrainedSampling;
using specdec::DecoderOptions;
using specdec::LogitBias;
using specdec::SamplingOptions;
using specdec::token_id;
using specdec::detail::constraint_walk;
using specdec::testing::first_true;
using specdec::testing::PrefixModel;
using specdec::testing::ScriptedGenerator;
using specdec::testing::uniform_grid;
using Law = specdec::testing::TokenLaw;

constexpr std::size_t vocab = 4;

/// A constraint over 4 tokens with 3 states, each allowing a different set:
///   state 0 allows {0, 1, 2}: 0 -> 1, 1 -> 0, 2 -> 2
///   state 1 allows {1, 3}:    1 -> 2, 3 -> 0
///   state 2 allows {0, 2, 3}: 0 -> 0, 2 -> 1, 3 -> 2
struct ToyAutomaton {
  using state_type = int;
  static constexpr int next[3][4] = {{1, 0, 2, -1}, {-1, 2, -1, 0}, {0, -1, 1, 2}};
  int at = 0;
  int advances = 0;  // counts calls, to see the walk is lazy
  [[nodiscard]] int state() const { return at; }
  void restore(int s) { at = s; }
  bool advance(token_id t) {
    ++advances;
    if (t < 0 || t >= 4 || next[at][t] < 0) return false;
    at = next[at][t];
    return true;
  }
  void allowed_tokens(std::span<std::uint64_t> words) const {
    words[0] = 0;
    for (int t = 0; t < 4; ++t) {
      if (next[at][t] >= 0) words[0] |= std::uint64_t{1} << t;
    }
  }
};
static_assert(specdec::TokenConstraint<ToyAutomaton>);
static_assert(specdec::TokenConstraint<specdec::Unconstrained>);

/// The automaton's state after `generated` from `start` (or -1 after a forbidden token).
int toy_state(std::span<const token_id> generated, int start = 0) {
  int s = start;
  for (const token_id t : generated) {
    s = ToyAutomaton::next[s][t];
    if (s < 0) return -1;
  }
  return s;
}

/// A PrefixModel as a LanguageModel that logs every context it is asked about (what the
/// enumeration tells runs apart by: the contexts reveal every drafted token).
struct LoggedModel {
  const PrefixModel* model = nullptr;
  std::vector<std::int64_t>* log = nullptr;
  std::int64_t tag = 0;
  [[nodiscard]] std::size_t vocab_size() const { return model->vocab; }
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    if (log != nullptr) {
      log->push_back(tag);
      log->insert(log->end(), context.begin(), context.end());
    }
    const auto& row = (*model)(context);
    return row;
  }
};

/// The same with score_draft (one call for the gamma + 1 prefixes).
struct LoggedBatchedModel : LoggedModel {
  std::vector<double> rows;
  std::vector<token_id> prefix;
  specdec::RowsView<const double> score_draft(std::span<const token_id> context,
                                              std::span<const token_id> draft) {
    rows.clear();
    prefix.assign(context.begin(), context.end());
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const auto row = next_token_probabilities(prefix);
      rows.insert(rows.end(), row.begin(), row.end());
      if (i < draft.size()) prefix.push_back(draft[i]);
    }
    return {rows.data(), draft.size() + 1, model->vocab};
  }
};

struct Setting {
  std::string name;
  PrefixModel target;
  PrefixModel draft;
  DecoderOptions options;
  BiasOptions bias;
  bool proposals = false;  // a proposal drafter (counting up, often forbidden) instead
  bool batched = false;    // the target scores the gamma + 1 prefixes in one call
  bool constrained = true;
};

const std::vector<token_id> prompt = {1, 3};
constexpr std::size_t generated_length = 2;

std::vector<Setting> settings() {
  specdec::xoshiro256pp g(2027);
  std::vector<Setting> out;
  const auto add = [&](std::string name, DecoderOptions options, BiasOptions bias,
                       double draft_zeros) {
    Setting s;
    s.name = std::move(name);
    s.target = specdec::testing::random_model(vocab, g, 0.0);
    s.draft = specdec::testing::random_model(vocab, g, draft_zeros);
    s.options = std::move(options);
    s.bias = std::move(bias);
    out.push_back(std::move(s));
    return out.size() - 1;
  };
  const BiasOptions bias{{{1, 0.7}, {3, -1.2}, {1, 0.2}}, {}};
  const BiasOptions ban{{{3, 0.5}}, {2}};
  DecoderOptions chain;
  chain.gamma_policy = specdec::FixedGamma{2};
  add("chain 2, T = 1, block verification, bias", chain, bias, 0.0);
  add("chain 2, T = 1, ban, draft rows with zeros (dead ends become uniform)", chain, ban, 0.4);
  DecoderOptions token = chain;
  token.verification = specdec::verification_rule::token;
  add("chain 2, Algorithm 1, bias", token, bias, 0.2);
  DecoderOptions truncated = chain;
  truncated.sampling = SamplingOptions{.temperature = 0.8, .top_k = 2};
  const std::size_t batched =
      add("chain 2, T = 0.8, top-k 2, batched target", truncated, bias, 0.0);
  out[batched].batched = true;
  DecoderOptions tree = chain;
  const std::vector<std::size_t> shape{2, 1};
  tree.tree_shape = specdec::TreeShape::branching(shape);
  add("tree {2, 1}, traversal verification, ban", tree, ban, 0.0);
  DecoderOptions recursive = tree;
  recursive.verification = specdec::verification_rule::token;
  add("tree {2, 1}, recursive rejection, bias", recursive, bias, 0.0);
  const std::size_t proposals = add("proposal drafter, forbidden proposals", chain, bias, 0.0);
  out[proposals].proposals = true;
  const std::size_t plain = add("bias and ban only (Unconstrained)", chain, ban, 0.0);
  out[plain].constrained = false;
  return out;
}

/// The law of plain constrained sampling of generated_length tokens after the prompt.
Law reference_law(const Setting& setting, int start_state = 0) {
  specdec::Standardizer<double> standardizer(setting.options.sampling);
  Law law;
  std::vector<std::pair<std::vector<token_id>, double>> stack{{{}, 1.0}};
  std::vector<double> row(vocab), standardized(vocab);
  while (!stack.empty()) {
    auto [generated, mass] = stack.back();
    stack.pop_back();
    if (generated.size() == generated_length) {
      law[generated] += mass;
      continue;
    }
    std::vector<token_id> context = prompt;
    context.insert(context.end(), generated.begin(), generated.end());
    const auto& p = setting.target(context);
    const int state = setting.constrained ? toy_state(generated, start_state) : 0;
    double total = 0.0;
    for (std::size_t t = 0; t < vocab; ++t) {
      const auto id = static_cast<token_id>(t);
      double factor = 1.0;
      for (const LogitBias& b : setting.bias.logit_bias) {
        if (b.token == id) factor *= std::exp(b.bias);
      }
      const bool banned =
          std::find(setting.bias.banned_tokens.begin(), setting.bias.banned_tokens.end(), id) !=
          setting.bias.banned_tokens.end();
      const bool allowed = !setting.constrained || ToyAutomaton::next[state][t] >= 0;
      row[t] = banned || !allowed ? 0.0 : p[t] * factor;
      total += row[t];
    }
    for (double& x : row) x /= total;
    standardizer.apply(std::span<const double>(row), std::span<double>(standardized));
    for (std::size_t t = 0; t < vocab; ++t) {
      if (standardized[t] == 0.0) continue;
      auto next = generated;
      next.push_back(static_cast<token_id>(t));
      stack.emplace_back(std::move(next), mass * standardized[t]);
    }
  }
  return law;
}

/// The real decoder on the constrained adaptors, built once per setting and walk (runs
/// reuse it: start() then generate()).
template <class C>
struct Harness {
  const Setting* setting;
  std::vector<std::int64_t> log;
  const std::size_t* consumed = nullptr;  // the scripted generator's count, for the log
  bool logging = false;
  ConstrainedSampling<C> rules;
  LoggedModel draft_model;
  LoggedBatchedModel target_model;
  specdec::ConstrainedModel<LoggedModel, C> draft;
  specdec::ConstrainedModel<LoggedBatchedModel, C> batched_target;
  specdec::ConstrainedModel<LoggedModel, C> target;
  specdec::testing::CountingUpDrafter proposer{vocab};
  DecoderOptions options;
  // Built on first use (the one the setting needs).
  std::optional<specdec::SpeculativeDecoder<specdec::ConstrainedModel<LoggedModel, C>,
                                            specdec::ConstrainedModel<LoggedModel, C>>>
      chain_decoder;
  std::optional<specdec::SpeculativeDecoder<specdec::ConstrainedModel<LoggedBatchedModel, C>,
                                            specdec::ConstrainedModel<LoggedModel, C>>>
      batched_decoder;
  std::optional<specdec::SpeculativeDecoder<specdec::ConstrainedModel<LoggedModel, C>,
                                            specdec::testing::CountingUpDrafter>>
      proposal_decoder;

  Harness(const Setting& s, constraint_walk walk)
      : setting(&s),
        rules(vocab, C{}, s.bias),
        draft_model{&s.draft, &log, 2},
        target_model(batched(s.target, log)),
        draft(rules.draft(draft_model)),
        batched_target(rules.target(target_model)),
        target(rules.target(static_cast<LoggedModel&>(target_model))),
        options(with_log(s.options)) {
    specdec::detail::constrained_sampling_access::set_walk(rules, walk);
  }

  // What tells runs apart beyond the contexts: each emitted token's source and how many
  // uniforms were used when it was emitted.
  DecoderOptions with_log(DecoderOptions o) {
    o.on_token = [this](const specdec::EmittedToken& e) {
      if (!logging) return;
      log.push_back(-2);
      log.push_back(static_cast<std::int64_t>(e.source));
      log.push_back(static_cast<std::int64_t>(consumed == nullptr ? 0 : *consumed));
    };
    return o;
  }

  static LoggedBatchedModel batched(const PrefixModel& model, std::vector<std::int64_t>& log) {
    LoggedBatchedModel out;
    out.model = &model;
    out.log = &log;
    out.tag = 1;
    return out;
  }

  template <class G>
  std::vector<token_id> generate(G& g) {
    rules.start(prompt);
    log.clear();
    if (setting->proposals) {
      if (!proposal_decoder) proposal_decoder.emplace(target, proposer, options);
      return proposal_decoder->generate(prompt, generated_length, g).tokens;
    }
    if (setting->batched) {
      if (!batched_decoder) batched_decoder.emplace(batched_target, draft, options);
      return batched_decoder->generate(prompt, generated_length, g).tokens;
    }
    if (!chain_decoder) chain_decoder.emplace(target, draft, options);
    return chain_decoder->generate(prompt, generated_length, g).tokens;
  }
};

struct Run {
  std::vector<token_id> tokens;
  std::vector<std::int64_t> signature;
  std::size_t consumed = 0;
};

template <class C>
Run scripted(Harness<C>& harness, const std::vector<std::uint64_t>& ks) {
  ScriptedGenerator g;
  for (const std::uint64_t k : ks) g.outputs.push_back(k << 11U);
  g.outputs.resize(ks.size() + 64, 0);
  harness.consumed = &g.next;
  harness.logging = true;
  Run run;
  run.tokens = harness.generate(g);
  harness.logging = false;
  harness.consumed = nullptr;
  run.signature = harness.log;
  run.signature.push_back(-1);
  run.signature.insert(run.signature.end(), run.tokens.begin(), run.tokens.end());
  run.consumed = g.next;
  return run;
}

template <class C>
void explore(Harness<C>& harness, std::vector<std::uint64_t>& prefix, double weight, Law& law) {
  const Run here = scripted(harness, prefix);
  if (here.consumed <= prefix.size()) {
    law[here.tokens] += weight;
    return;
  }
  std::uint64_t from = 0;
  while (from < uniform_grid) {
    prefix.push_back(from);
    const Run first = scripted(harness, prefix);
    prefix.pop_back();
    const std::uint64_t to = first_true(from + 1, [&](std::uint64_t k) {
      prefix.push_back(k);
      const bool differs = scripted(harness, prefix).signature != first.signature;
      prefix.pop_back();
      return differs;
    });
    prefix.push_back(from);
    explore(harness, prefix,
            weight * static_cast<double>(to - from) / static_cast<double>(uniform_grid), law);
    prefix.pop_back();
    from = to;
  }
}

Law enumerate(const Setting& setting, constraint_walk walk = constraint_walk::exact) {
  Law law;
  std::vector<std::uint64_t> prefix;
  if (setting.constrained) {
    Harness<ToyAutomaton> harness(setting, walk);
    explore(harness, prefix, 1.0, law);
  } else {
    Harness<specdec::Unconstrained> harness(setting, walk);
    explore(harness, prefix, 1.0, law);
  }
  return law;
}

}  // namespace

TEST_CASE(
    "Constrained speculative sampling, enumerated on the real code: the law of plain "
    "constrained sampling from the target, for chains, trees, both verification rules, "
    "truncation, batched targets and proposal drafters",
    "[constrained][exactness]") {
  for (const Setting& setting : settings()) {
    const Law law = enumerate(setting);
    const Law reference = reference_law(setting);
    INFO(setting.name);
    CHECK(specdec::testing::max_difference(law, reference) < 1e-12);
    // Every emitted sequence obeys the constraint and the ban list.
    for (const auto& [tokens, probability] : law) {
      if (setting.constrained) CHECK(toy_state(tokens) >= 0);
      for (const token_id banned : setting.bias.banned_tokens) {
        CHECK(std::find(tokens.begin(), tokens.end(), banned) == tokens.end());
      }
    }
  }
}

TEST_CASE("Constrained speculative sampling: each broken walk is caught by the enumeration",
          "[constrained][exactness]") {
  const auto all = settings();
  for (const constraint_walk walk :
       {constraint_walk::no_rollback, constraint_walk::advance_with_rejected,
        constraint_walk::target_unmasked}) {
    // Chains and trees, each broken walk must move the law of at least one of them.
    double worst = 0.0;
    for (std::size_t k : {std::size_t{0}, std::size_t{2}, std::size_t{4}}) {
      Law law;
      try {
        law = enumerate(all[k], walk);
      } catch (const specdec::error&) {
        worst = 1.0;  // a dead end the exact walk never meets: caught as well
        continue;
      }
      worst = std::max(worst, specdec::testing::law_total_variation(law, reference_law(all[k])));
    }
    INFO("walk " << static_cast<int>(walk) << ": total variation " << worst);
    CHECK(worst > 0.02);
  }
}

namespace {

/// Chi-square of the decoder's generated sequences (16 outcomes) against plain constrained
/// sampling, with the sample size that detects a total variation of `tv`.
specdec::stats::ChiSquareResult sampled(const Setting& setting, constraint_walk walk, double tv,
                                        std::uint64_t seed) {
  const Law reference = reference_law(setting);
  constexpr std::size_t cells = vocab * vocab;
  std::vector<double> expected(cells, 0.0);
  const auto cell = [](std::span<const token_id> tokens) {
    return static_cast<std::size_t>(tokens[0]) * vocab + static_cast<std::size_t>(tokens[1]);
  };
  for (const auto& [tokens, probability] : reference) expected[cell(tokens)] = probability;
  std::vector<std::uint64_t> counts(cells, 0);
  const std::size_t samples = specdec::testing::scaled_samples_to_detect(tv, cells - 1);
  specdec::default_engine g(seed);
  const auto count = [&](auto& harness) {
    for (std::size_t i = 0; i < samples; ++i) ++counts[cell(harness.generate(g))];
  };
  if (setting.constrained) {
    Harness<ToyAutomaton> harness(setting, walk);
    count(harness);
  } else {
    Harness<specdec::Unconstrained> harness(setting, walk);
    count(harness);
  }
  return specdec::stats::chi_square_test(counts, expected);
}

}  // namespace

TEST_CASE(
    "Constrained speculative sampling, sampled: chi-square of the generated sequences "
    "against plain constrained sampling (false failure 1e-9), and the broken walks fail it",
    "[constrained][exactness][statistical]") {
  const auto all = settings();
  for (const std::size_t k : {std::size_t{0}, std::size_t{4}, std::size_t{6}}) {
    const auto result = sampled(all[k], constraint_walk::exact, 0.02, 11 + k);
    INFO(all[k].name << ": statistic " << result.statistic << ", df " << result.degrees_of_freedom
                     << ", samples " << result.samples << ", critical " << result.critical_value);
    CHECK(result.passed());
  }
  // Each broken walk at a setting where the enumeration shows it moves the law.
  for (const auto& [walk, k] : {std::pair{constraint_walk::no_rollback, std::size_t{0}},
                                std::pair{constraint_walk::advance_with_rejected, std::size_t{0}},
                                std::pair{constraint_walk::target_unmasked, std::size_t{0}}}) {
    const double tv =
        specdec::testing::law_total_variation(enumerate(all[k], walk), reference_law(all[k]));
    const auto result = sampled(all[k], walk, std::min(tv, 0.05), 99);
    INFO("walk " << static_cast<int>(walk) << " on " << all[k].name << ": tv " << tv);
    CHECK(!result.passed());
  }
}

namespace {

/// A constraint for any V: in state s (the last token mod 3, 0 at the start) token t is
/// allowed unless (t + s) % 3 == 0.
struct ModuloAutomaton {
  using state_type = int;
  std::size_t vocab = 40;
  int at = 0;
  [[nodiscard]] int state() const { return at; }
  void restore(int s) { at = s; }
  bool advance(token_id t) {
    if ((t + at) % 3 == 0) return false;
    at = t % 3;
    return true;
  }
  void allowed_tokens(std::span<std::uint64_t> words) const {
    std::fill(words.begin(), words.end(), 0);
    for (std::size_t t = 0; t < vocab; ++t) {
      if ((static_cast<int>(t) + at) % 3 != 0) specdec::mask_set(words, static_cast<token_id>(t));
    }
  }
};

/// A PrefixModel as a LanguageModel of float rows (what engines return).
struct FloatModel {
  std::vector<std::vector<float>> rows;
  std::size_t vocab = 0;
  [[nodiscard]] std::size_t vocab_size() const { return vocab; }
  std::span<const float> next_token_probabilities(std::span<const token_id> context) {
    std::size_t key = context.size() * 7;
    if (!context.empty()) key += 3 * static_cast<std::size_t>(context.back());
    return rows[key % rows.size()];
  }
};

FloatModel float_model(std::size_t size, std::uint64_t seed) {
  specdec::xoshiro256pp g(seed);
  FloatModel model{{}, size};
  for (int k = 0; k < 13; ++k) {
    const auto row = specdec::testing::random_row(size, g, 0.0);
    model.rows.emplace_back(row.begin(), row.end());
  }
  return model;
}

}  // namespace

TEST_CASE(
    "Constrained greedy decoding: speculative output equals plain greedy decoding of the "
    "constrained target, for model drafts, trees and proposal drafters",
    "[constrained][greedy]") {
  constexpr std::size_t v = 40;
  FloatModel target_model = float_model(v, 5);
  FloatModel draft_model = float_model(v, 6);
  const BiasOptions bias{{{7, 2.0}, {11, -3.0}}, {13, 14}};
  ConstrainedSampling<ModuloAutomaton> rules(v, ModuloAutomaton{v}, bias);
  auto target = rules.target(target_model);
  auto draft = rules.draft(draft_model);
  const std::vector<token_id> start = {3, 9, 1};
  constexpr std::size_t length = 60;
  // Plain greedy decoding of the constrained target.
  rules.start(start);
  std::vector<token_id> context = start;
  for (std::size_t i = 0; i < length; ++i) {
    const auto row = target.next_token_probabilities(context);
    context.push_back(
        static_cast<token_id>(std::max_element(row.begin(), row.end()) - row.begin()));
  }
  const std::vector<token_id> plain(context.begin() + 3, context.end());
  CHECK(std::find(plain.begin(), plain.end(), 13) == plain.end());
  DecoderOptions options;
  options.sampling.temperature = 0.0;
  options.gamma_policy = specdec::FixedGamma{3};
  {
    rules.start(start);
    specdec::SpeculativeDecoder decoder(target, draft, options);
    CHECK(decoder.generate(start, length, 1).tokens == plain);
  }
  {
    DecoderOptions tree = options;
    const std::vector<std::size_t> shape{3, 2};
    tree.tree_shape = specdec::TreeShape::branching(shape);
    rules.start(start);
    specdec::SpeculativeDecoder decoder(target, draft, tree);
    CHECK(decoder.generate(start, length, 2).tokens == plain);
  }
  {
    specdec::testing::CountingUpDrafter proposer{v};  // mostly forbidden or wrong proposals
    rules.start(start);
    specdec::SpeculativeDecoder decoder(target, proposer, options);
    CHECK(decoder.generate(start, length, 3).tokens == plain);
  }
}

TEST_CASE(
    "Constrained sampling states, fuzzed: the mask and the row after any context equal a "
    "fresh walk from the start, whatever contexts came before (branches, rollbacks, "
    "forbidden tokens)",
    "[constrained][fuzz]") {
  constexpr std::size_t v = 40;
  FloatModel model = float_model(v, 8);
  const BiasOptions bias{{{4, 1.0}, {5, -100.0}, {6, -std::numeric_limits<double>::infinity()}},
                         {7}};
  ConstrainedSampling<ModuloAutomaton> walked(v, ModuloAutomaton{v}, bias, 4);
  const std::vector<token_id> start = {2, 2};
  walked.start(start);
  specdec::xoshiro256pp g(99);
  std::vector<token_id> context = start;
  std::vector<float> a(v), b(v);
  std::size_t dead = 0;
  for (int iteration = 0; iteration < 20000; ++iteration) {
    // Move: cut back a few tokens (a rejection, another branch) and extend by a few, now and
    // then with a forbidden token.
    const std::size_t cut = specdec::uniform_below(g, 4);
    context.resize(std::max(start.size(), context.size() - std::min(cut, context.size())));
    const std::size_t grow = specdec::uniform_below(g, 4);
    for (std::size_t k = 0; k < grow; ++k) {
      context.push_back(static_cast<token_id>(specdec::uniform_below(g, v)));
    }
    if (context.size() > 40) context.resize(start.size() + 2);
    ConstrainedSampling<ModuloAutomaton> fresh(v, ModuloAutomaton{v}, bias);
    fresh.start(start);
    const auto expected = fresh.mask(context);
    const auto got = walked.mask(context);
    REQUIRE(got.size() == expected.size());
    REQUIRE(std::equal(got.begin(), got.end(), expected.begin()));
    if (got.empty()) {
      ++dead;
      continue;
    }
    REQUIRE(walked.constraint().state() == fresh.constraint().state());
    const auto row = model.next_token_probabilities(context);
    walked.apply(std::span<const token_id>(context), row, std::span<float>(a),
                 specdec::model_role::target);
    fresh.apply(std::span<const token_id>(context), row, std::span<float>(b),
                specdec::model_role::target);
    REQUIRE(a == b);
    REQUIRE(a[6] == 0.0F);
    REQUIRE(a[7] == 0.0F);
  }
  CHECK(dead > 1000);  // forbidden tokens were met often
  CHECK(dead < 19000);
}

TEST_CASE(
    "Constrained decoding allocates nothing per step once warm, with a bitmask constraint "
    "(TokenDfa) and a logit bias",
    "[constrained][allocation]") {
  // A vocabulary of letters, merged pieces and an end token.
  const std::vector<std::string> strings = {"a", "b", "c", "d", "ab", "ba", "cd", "abc", ""};
  const std::vector<token_id> end = {8};
  const specdec::ByteDfa dfa = specdec::ByteDfa::compile("((ab|c)*d)+");
  FloatModel target_model = float_model(strings.size(), 21);
  FloatModel draft_model = float_model(strings.size(), 22);
  const BiasOptions bias{{{2, 1.0}}, {}};
  ConstrainedSampling<specdec::TokenDfa> rules(strings.size(), specdec::TokenDfa(dfa, strings, end),
                                               bias);
  auto target = rules.target(target_model);
  auto draft = rules.draft(draft_model);
  DecoderOptions options;
  options.gamma_policy = specdec::FixedGamma{3};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  std::vector<token_id> context = {0};
  context.reserve(8192);
  decoder.reserve(8192);
  rules.reserve(8192);
  rules.start(context);
  specdec::xoshiro256pp g(4);
  const auto run = [&](std::size_t steps) {
    for (std::size_t s = 0; s < steps; ++s) {
      const auto result = decoder.step(context, g);
      context.insert(context.end(), result.tokens.begin(), result.tokens.end());
    }
  };
  run(20);
  specdec::testing::AllocationCounter counter;
  run(200);
  const std::size_t allocations = counter.stop();
  CHECK(allocations == 0);
  // The text obeys the pattern: up to the first end token, a prefix of a full match.
  std::string text;
  bool ended = false;
  for (std::size_t i = 1; i < context.size(); ++i) {
    if (context[i] == 8) {
      ended = true;
      break;
    }
    text += strings[static_cast<std::size_t>(context[i])];
  }
  if (ended) CHECK(dfa.matches(text));
}

// ---------------------------------------------------------------------------------------
// Catalogue rows K1-K8 (docs/errors.md, "Constrained sampling")
// ---------------------------------------------------------------------------------------

using specdec::errc;
using specdec::testing::check_error;

TEST_CASE("K1 ConstrainedSampling: bad bias options or vocabulary size", "[errors][constrained]") {
  check_error(
      "K1",
      [] {
        ConstrainedSampling<> rules(4, {}, BiasOptions{{{4, 1.0}}, {}});
      },
      errc::invalid_token, "logit_bias[0]: token id 4 is outside the vocabulary [0, 4)");
  check_error(
      "K1",
      [] {
        ConstrainedSampling<> rules(4, {}, BiasOptions{{}, {0, -1}});
      },
      errc::invalid_token, "banned_tokens[1]: token id -1");
  check_error(
      "K1",
      [] {
        ConstrainedSampling<> rules(
            4, {}, BiasOptions{{{1, std::numeric_limits<double>::quiet_NaN()}}, {}});
      },
      errc::invalid_option, "logit_bias[0] (token 1): bias nan must be in [-100, 100]");
  check_error(
      "K1",
      [] {
        ConstrainedSampling<> rules(4, {}, BiasOptions{{{1, 101.0}}, {}});
      },
      errc::invalid_option, "bias 101 must be in [-100, 100] or -infinity");
  check_error(
      "K1", [] { ConstrainedSampling<> rules(0); }, errc::invalid_size,
      "vocab_size must be positive");
}

TEST_CASE("K2 Constrained models asked for rows before start() or after another prompt",
          "[errors][constrained]") {
  FloatModel target_model = float_model(6, 1);
  FloatModel draft_model = float_model(6, 2);
  ConstrainedSampling<> rules(6);
  auto target = rules.target(target_model);
  auto draft = rules.draft(draft_model);
  specdec::SpeculativeDecoder decoder(target, draft);
  const std::vector<token_id> prompt_a = {1, 2}, prompt_b = {2, 1};
  check_error(
      "K2", [&] { (void)decoder.generate(prompt_a, 5, 1); }, errc::model_failure,
      "start(prompt) must be called before the models are asked for rows");
  rules.start(prompt_a);
  check_error(
      "K2", [&] { (void)decoder.generate(prompt_b, 5, 1); }, errc::model_failure,
      "does not begin with the prompt of 2 tokens given to start()");
}

TEST_CASE("K3 ConstrainedModel: the model's vocabulary differs from the constraint's",
          "[errors][constrained]") {
  FloatModel model = float_model(6, 1);
  ConstrainedSampling<> rules(7);
  check_error(
      "K3", [&] { (void)rules.target(model); }, errc::vocab_mismatch,
      "the target model's vocab_size 6 differs from the constraint's 7");
}

TEST_CASE(
    "K4 Constraint dead end in the target: no allowed token has probability; the tokens "
    "generated before it are kept",
    "[errors][constrained]") {
  // The target gives token 3 no probability; the constraint allows only token 3 after
  // token 0.
  struct OnlyThreeAfterZero {
    using state_type = int;
    int last = -1;
    [[nodiscard]] int state() const { return last; }
    void restore(int s) { last = s; }
    bool advance(token_id t) {
      if (last == 0 && t != 3) return false;
      last = t;
      return true;
    }
    void allowed_tokens(std::span<std::uint64_t> words) const {
      words[0] = last == 0 ? 0x8U : 0xFU;
    }
  };
  struct NoThree {
    [[nodiscard]] std::size_t vocab_size() const { return 4; }
    std::span<const double> next_token_probabilities(std::span<const token_id> context) {
      row = {context.size() > 4 ? 0.9 : 0.05, 0.5, 0.45, 0.0};
      const double total = row[0] + row[1] + row[2];
      for (double& x : row) x /= total;
      return row;
    }
    std::vector<double> row;
  };
  NoThree target_model, draft_model;
  ConstrainedSampling<OnlyThreeAfterZero> rules(4);
  auto target = rules.target(target_model);
  auto draft = rules.draft(draft_model);
  const std::vector<token_id> start = {1, 1};
  rules.start(start);
  DecoderOptions options;
  options.gamma_policy = specdec::FixedGamma{2};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  std::vector<token_id> kept;
  const std::string what = check_error(
      "K4",
      [&] {
        try {
          (void)decoder.generate(start, 50, 5);
        } catch (const specdec::decoding_error& e) {
          kept.assign(e.tokens().begin(), e.tokens().end());
          throw;
        }
      },
      errc::model_failure, "constraint dead end at generated position");
  CHECK_THAT(what, Catch::Matchers::ContainsSubstring("model gives probability 0 to all 1 tokens"));
  // Everything before the dead end was emitted and kept: the position where token 0 came.
  REQUIRE(!kept.empty());
  CHECK(kept.back() == 0);
}

TEST_CASE("K5 A constraint state that allows no token (after the banned tokens)",
          "[errors][constrained]") {
  struct AllowsOnlyTwo {
    using state_type = int;
    [[nodiscard]] int state() const { return 0; }
    void restore(int) {}
    bool advance(token_id t) { return t == 2; }
    void allowed_tokens(std::span<std::uint64_t> words) const { words[0] = 0x4U; }
  };
  FloatModel model = float_model(6, 3);
  ConstrainedSampling<AllowsOnlyTwo> rules(6, {}, BiasOptions{{}, {2}});
  const std::vector<token_id> start = {0};
  rules.start(start);
  std::vector<float> out(6);
  for (const auto role : {specdec::model_role::target, specdec::model_role::draft}) {
    check_error(
        "K5",
        [&] {
          rules.apply(std::span<const token_id>(start), model.next_token_probabilities(start),
                      std::span<float>(out), role);
        },
        errc::zero_mass,
        "constraint dead end at generated position 0 (context of 1 tokens): "
        "the constraint allows no token");
  }
}

TEST_CASE(
    "K6 A NaN, negative or infinite entry at an allowed token; a bad entry at a forbidden "
    "token is never read",
    "[errors][constrained]") {
  ConstrainedSampling<specdec::Unconstrained> rules(70, {}, BiasOptions{{}, {5}});
  const std::vector<token_id> start = {0};
  rules.start(start);
  std::vector<float> row(70, 1.0F / 70.0F), out(70);
  const auto apply = [&] {
    rules.apply(std::span<const token_id>(start), std::span<const float>(row),
                std::span<float>(out), specdec::model_role::draft);
  };
  row[66] = std::numeric_limits<float>::quiet_NaN();
  check_error("K6", apply, errc::invalid_probability,
              "constrained draft row at generated position 0, token 66: probability is nan");
  row[66] = -0.25F;
  check_error("K6", apply, errc::invalid_probability, "token 66: probability is -0.25");
  row[66] = 1.0F / 70.0F;
  // Negative entries in every lane group of the vectorised block (tokens 0-63) and the tail.
  for (const std::size_t t : {1U, 6U, 10U, 13U, 50U, 63U}) {
    row[t] = -1e-30F;
    check_error("K6", apply, errc::invalid_probability,
                "token " + std::to_string(t) + ": probability is -1e-30");
    row[t] = 1.0F / 70.0F;
  }
  row[3] = std::numeric_limits<float>::infinity();
  check_error("K6", apply, errc::invalid_probability, "token 3: probability is inf");
  row[3] = 1.0F / 70.0F;
  row[5] = std::numeric_limits<float>::quiet_NaN();  // banned: never read
  apply();
  CHECK(out[5] == 0.0F);
}

TEST_CASE("K7 A model row whose length is not the vocabulary size", "[errors][constrained]") {
  struct ShortRows {
    [[nodiscard]] std::size_t vocab_size() const { return 5; }
    std::span<const float> next_token_probabilities(std::span<const token_id>) { return row; }
    std::vector<float> row{0.5F, 0.5F};
  };
  ShortRows model;
  ConstrainedSampling<> rules(5);
  auto target = rules.target(model);
  const std::vector<token_id> start = {0};
  rules.start(start);
  check_error(
      "K7", [&] { (void)target.next_token_probabilities(start); }, errc::invalid_size,
      "constrained target row: 2 entries, expected vocab_size 5");
}

TEST_CASE("K8 Malformed regular expressions and TokenDfa vocabularies", "[errors][constrained]") {
  check_error(
      "K8", [] { (void)specdec::ByteDfa::compile("a(b"); }, errc::invalid_option,
      "regex \"a(b\" at offset 3: missing ')'");
  check_error(
      "K8", [] { (void)specdec::ByteDfa::compile("[z-a]"); }, errc::invalid_option,
      "regex \"[z-a]\" at offset");
  check_error(
      "K8", [] { (void)specdec::ByteDfa::compile("*a"); }, errc::invalid_option,
      "regex \"*a\" at offset 0");
  const std::vector<std::string> strings = {"a", "b", ""};
  check_error(
      "K8",
      [&] {
        const std::vector<token_id> end = {3};
        (void)specdec::TokenDfa(specdec::ByteDfa::compile("a+"), strings, end);
      },
      errc::invalid_option, "end token");
  check_error(
      "K8", [&] { (void)specdec::TokenDfa(specdec::ByteDfa::compile("c"), strings); },
      errc::invalid_option, "start state allows no token");
}

TEST_CASE(
    "Constrained batches: each sequence of a BatchDecoder follows plain constrained sampling "
    "under its own constraint, bias and bans (chi-square, false failure 1e-9); routing a "
    "sequence to another's constraint is caught",
    "[constrained][batch][statistical]") {
  const auto all = settings();
  const Setting& setting = all[0];  // T = 1, the target and the draft of setting 0
  // Three sequences: start states 0, 1, 2 of the automaton, different biases and bans.
  const std::vector<BiasOptions> biases = {setting.bias, BiasOptions{{}, {2}},
                                           BiasOptions{{{0, -2.0}}, {}}};
  std::vector<Setting> per_sequence(3, setting);
  for (std::size_t b = 0; b < 3; ++b) per_sequence[b].bias = biases[b];
  const auto run = [&](bool misrouted, std::size_t b_checked, double tv) {
    std::vector<double> expected(vocab * vocab, 0.0);
    for (const auto& [tokens, probability] :
         reference_law(per_sequence[b_checked], static_cast<int>(b_checked))) {
      expected[static_cast<std::size_t>(tokens[0]) * vocab + static_cast<std::size_t>(tokens[1])] =
          probability;
    }
    LoggedBatchedModel target_model;  // score_draft: the adapter's per-sequence scoring path
    target_model.model = &setting.target;
    LoggedModel draft_model{&setting.draft, nullptr, 2};
    specdec::BatchConstrainedSampling<ToyAutomaton> rules(vocab);
    auto target = rules.target(target_model);
    auto draft = rules.draft(draft_model);
    specdec::BatchDecoder decoder(target, draft);
    std::vector<std::uint64_t> counts(vocab * vocab, 0);
    const std::size_t samples = specdec::testing::scaled_samples_to_detect(tv, vocab * vocab - 1);
    for (std::size_t i = 0; i < samples; ++i) {
      for (std::uint64_t b = 0; b < 3; ++b) {
        const std::uint64_t id = 3 * i + b;
        // The broken variant gives sequence 1 the constraint state and bias of sequence 0.
        const std::size_t source = misrouted && b == 1 ? 0 : b;
        rules.start(id, prompt, ToyAutomaton{static_cast<int>(source)}, biases[source]);
        specdec::SequenceRequest request;
        request.id = id;
        request.prompt = prompt;
        request.max_new_tokens = generated_length;
        request.seed = 1000 + i;
        request.gamma_policy = specdec::FixedGamma{2};
        decoder.add(std::move(request));
      }
      decoder.run();
      for (const auto& finished : decoder.take_finished()) {
        REQUIRE(finished.end != specdec::sequence_end::failed);
        if (finished.id % 3 != b_checked) continue;
        REQUIRE(finished.tokens.size() == generated_length);
        ++counts[static_cast<std::size_t>(finished.tokens[0]) * vocab +
                 static_cast<std::size_t>(finished.tokens[1])];
      }
    }
    CHECK(rules.size() == 0);  // every sequence released
    return specdec::stats::chi_square_test(counts, expected);
  };
  for (std::size_t b = 0; b < 3; ++b) {
    const auto result = run(false, b, 0.02);
    INFO("sequence " << b << ": statistic " << result.statistic << ", critical "
                     << result.critical_value);
    CHECK(result.passed());
  }
  const auto broken = run(true, 1, 0.1);
  INFO("misrouted: statistic " << broken.statistic << ", critical " << broken.critical_value);
  CHECK(!broken.passed());
}

TEST_CASE(
    "K9 Constrained batches: a sequence never started; a target dead end fails that sequence "
    "alone",
    "[errors][constrained][batch]") {
  FloatModel target_model = float_model(6, 1);
  FloatModel draft_model = float_model(6, 2);
  // A constraint that allows every token, or (only_five) token 5 alone.
  struct OnlyFive {
    using state_type = int;
    bool only_five = false;
    [[nodiscard]] int state() const { return 0; }
    void restore(int) {}
    bool advance(token_id t) { return !only_five || t == 5; }
    void allowed_tokens(std::span<std::uint64_t> words) const {
      words[0] = only_five ? 0x20U : 0x3FU;
    }
  };
  specdec::BatchConstrainedSampling<OnlyFive> rules(6);
  auto target = rules.target(target_model);
  auto draft = rules.draft(draft_model);
  specdec::BatchDecoder decoder(target, draft);
  const std::vector<token_id> start = {1};
  specdec::SequenceRequest request;
  request.prompt = start;
  request.max_new_tokens = 8;
  request.id = 7;
  decoder.add(request);
  check_error(
      "K9", [&] { (void)decoder.step(); }, errc::model_failure,
      "BatchConstrainedSampling: sequence 7 was not started");
  rules.start(7, start);
  // Sequence 2 may only emit token 5: the draft model's rows are positive there, and so are
  // the target's; it completes with 5s.
  rules.start(2, start, OnlyFive{true});
  request.id = 2;
  decoder.add(request);
  decoder.run();
  for (const auto& finished : decoder.take_finished()) {
    CHECK(finished.end != specdec::sequence_end::failed);
    CHECK(finished.tokens.size() == 8);
    if (finished.id == 2) CHECK(finished.tokens == std::vector<token_id>(8, 5));
  }
  // A target without mass at token 5: sequence 2's target rows are all zero, the decoder
  // fails it alone, sequence 7 completes.
  struct NoFive {
    FloatModel* base;
    std::vector<float> row;
    [[nodiscard]] std::size_t vocab_size() const { return 6; }
    std::span<const float> next_token_probabilities(std::span<const token_id> context) {
      const auto r = base->next_token_probabilities(context);
      row.assign(r.begin(), r.end());
      row[5] = 0.0F;
      return row;
    }
    // One call for the whole batch: the adapter's score_batch path over the model's own.
    specdec::RowsView<const float> score_batch(
        std::span<const specdec::BatchScoreRequest> requests) {
      rows.clear();
      for (const auto& r : requests) {
        std::vector<token_id> prefix(r.context.begin(), r.context.end());
        for (std::size_t k = 0; k <= r.drafts.size(); ++k) {
          const auto p = next_token_probabilities(prefix);
          rows.insert(rows.end(), p.begin(), p.end());
          if (k < r.drafts.size()) prefix.push_back(r.drafts[k]);
        }
      }
      return {rows.data(), rows.size() / 6, 6};
    }
    std::vector<float> rows;
  };
  NoFive no_five{&target_model, {}, {}};
  specdec::BatchConstrainedSampling<OnlyFive> rules2(6);
  auto target2 = rules2.target(no_five);
  auto draft2 = rules2.draft(draft_model);
  specdec::BatchDecoder decoder2(target2, draft2);
  rules2.start(2, start, OnlyFive{true});
  rules2.start(7, start);
  decoder2.add(request);
  request.id = 7;
  decoder2.add(request);
  decoder2.run();
  for (const auto& finished : decoder2.take_finished()) {
    if (finished.id == 7) {
      CHECK(finished.end != specdec::sequence_end::failed);
      CHECK(finished.tokens.size() == 8);
    } else {
      REQUIRE(finished.end == specdec::sequence_end::failed);
      check_error(
          "K9", [&] { std::rethrow_exception(finished.error); }, errc::zero_mass,
          "all entries are zero");
    }
  }
}

TEST_CASE(
    "Constrained rows on the vectorised path (float rows, full 64-token blocks): every row "
    "the adapter returns is the definition, as masks change and its output rows are reused",
    "[constrained]") {
  constexpr std::size_t v = 1000;  // 15 full blocks and a tail of 40
  specdec::xoshiro256pp g(31);
  // Five masks: all allowed, none but a few, random words, whole blocks on/off, one bit.
  std::vector<std::vector<std::uint64_t>> masks(5,
                                                std::vector<std::uint64_t>(specdec::mask_words(v)));
  for (std::size_t w = 0; w < masks[0].size(); ++w) {
    masks[0][w] = ~std::uint64_t{0};
    masks[1][w] = w % 7 == 3 ? 0x8000000000000001ULL : 0;
    masks[2][w] = g();
    masks[3][w] = (w / 2) % 2 == 0 ? ~std::uint64_t{0} : 0;
    masks[4][w] = w == 9 ? 0x10U : 0;
  }
  struct MaskByState {
    using state_type = std::size_t;
    const std::vector<std::vector<std::uint64_t>>* masks = nullptr;
    std::size_t at = 0;
    [[nodiscard]] std::size_t state() const { return at; }
    void restore(std::size_t s) { at = s; }
    bool advance(token_id t) {
      if (!specdec::mask_test((*masks)[at], t)) return false;
      at = static_cast<std::size_t>(t) % masks->size();
      return true;
    }
    void allowed_tokens(std::span<std::uint64_t> words) const {
      std::copy((*masks)[at].begin(), (*masks)[at].end(), words.begin());
    }
  };
  FloatModel model = float_model(v, 41);
  const BiasOptions bias{{{3, 1.5}, {640, -2.0}, {577, 0.5}}, {0, 999}};
  ConstrainedSampling<MaskByState> rules(v, MaskByState{&masks}, bias);
  auto adapted = rules.target(model);
  const std::vector<token_id> start = {5};
  rules.start(start);
  std::vector<token_id> context = start;
  std::size_t state = 0;
  std::size_t checked = 0;
  for (int step = 0; step < 400; ++step) {
    const auto got = adapted.next_token_probabilities(context);
    // The definition, in double.
    const auto row = model.next_token_probabilities(context);
    std::vector<double> expected(v, 0.0);
    double total = 0.0;
    for (std::size_t t = 0; t < v; ++t) {
      const auto id = static_cast<token_id>(t);
      if (!specdec::mask_test(masks[state], id) || t == 0 || t == 999) continue;
      double factor = 1.0;
      for (const LogitBias& b : bias.logit_bias) {
        if (b.token == id) factor = std::exp(b.bias);
      }
      expected[t] = static_cast<double>(row[t]) * factor;
      total += expected[t];
    }
    for (std::size_t t = 0; t < v; ++t) {
      if (expected[t] == 0.0) {
        REQUIRE(got[t] == 0.0F);
      } else {
        REQUIRE(std::abs(static_cast<double>(got[t]) - expected[t] / total) <=
                1e-6 * expected[t] / total + 1e-9);
      }
    }
    ++checked;
    // Next: an allowed token drawn from the row (the state moves), or a rollback.
    if (context.size() > 6 && specdec::uniform_below(g, 3) == 0) {
      context.resize(start.size() + specdec::uniform_below(g, context.size() - start.size()));
    } else {
      context.push_back(specdec::sample_from_row(got, g));
    }
    state = 0;
    for (std::size_t i = start.size(); i < context.size(); ++i) {
      state = static_cast<std::size_t>(context[i]) % masks.size();
    }
  }
  CHECK(checked == 400);
}

TEST_CASE(
    "K10 A constraint that throws: its exception reaches the caller (inside generate: "
    "model_failure, nested) and the walk stays consistent afterwards",
    "[errors][constrained]") {
  struct ThrowsOnThree {
    using state_type = int;
    int at = 0;
    bool armed = true;
    [[nodiscard]] int state() const { return at; }
    void restore(int s) { at = s; }
    bool advance(token_id t) {
      if (armed && t == 3) throw std::runtime_error("grammar engine: token 3 not supported");
      at = (at + static_cast<int>(t)) % 5;
      return true;
    }
    void allowed_tokens(std::span<std::uint64_t> words) const { words[0] = at == 4 ? 0x3U : 0x3FU; }
  };
  ConstrainedSampling<ThrowsOnThree> rules(6);
  const std::vector<token_id> start = {1};
  rules.start(start);
  const std::vector<token_id> bad = {1, 2, 3, 1};
  REQUIRE_THROWS_WITH((void)rules.mask(bad), "grammar engine: token 3 not supported");
  // The walk went back to the start: masks after it equal a fresh walk's.
  for (const std::vector<token_id>& context :
       {std::vector<token_id>{1, 2}, std::vector<token_id>{1, 2, 4, 4}, std::vector<token_id>{1}}) {
    ConstrainedSampling<ThrowsOnThree> fresh(6);
    fresh.start(start);
    const auto expected = fresh.mask(context);
    const auto got = rules.mask(context);
    REQUIRE(std::equal(got.begin(), got.end(), expected.begin(), expected.end()));
  }
  // Inside the decoder: model_failure naming the model's row, the constraint's message nested.
  FloatModel target_model = float_model(6, 11);
  FloatModel draft_model = float_model(6, 12);
  auto target = rules.target(target_model);
  auto draft = rules.draft(draft_model);
  specdec::SpeculativeDecoder decoder(target, draft);
  rules.start(start);
  check_error(
      "K10", [&] { (void)decoder.generate(start, 200, 3); }, errc::model_failure,
      "the model threw: grammar engine: token 3 not supported");
}
