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
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "specdec/constrained_model.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/statistics.hpp"
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

/// The automaton's state after `generated` (or -1 after a forbidden token).
int toy_state(std::span<const token_id> generated) {
  int s = 0;
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
Law reference_law(const Setting& setting) {
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
    const int state = setting.constrained ? toy_state(generated) : 0;
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
    INFO(all[k].name << ": statistic " << result.statistic << ", critical "
                     << result.critical_value);
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
