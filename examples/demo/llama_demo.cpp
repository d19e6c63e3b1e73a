// specdec demo — the transformer mode (see demo/llama_demo.hpp). A translation unit of its
// own, so that it compiles in parallel with the rest of the demo.
#include "demo/llama_demo.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "demo/instruments.hpp"
#include "demo/report.hpp"
#include "demo/trace.hpp"
#include "llama/constraints.hpp"
#include "llama/generate.hpp"
#include "specdec/analysis.hpp"
#include "specdec/constrained_model.hpp"
#include "specdec/statistics.hpp"
#include "specdec/token_dfa.hpp"

namespace specdec_demo {

namespace llama_demo {

using specdec::token_id;

// The target as the decoder sees it, remembering the last draft it scored (the trace shows
// the rejected draft x_{n+1}).
class RecordingTarget {
 public:
  explicit RecordingTarget(llama::Engine& engine) : model_(engine) {}
  [[nodiscard]] std::size_t vocab_size() const { return model_.vocab_size(); }
  std::span<const float> next_token_probabilities(std::span<const token_id> context) {
    return model_.next_token_probabilities(context);
  }
  specdec::RowsView<const float> score_draft(std::span<const token_id> context,
                                             std::span<const token_id> draft) {
    last_draft_.assign(draft.begin(), draft.end());
    return model_.score_draft(context, draft);
  }
  [[nodiscard]] std::span<const token_id> last_draft() const { return last_draft_; }

 private:
  specdec::LogitsModel<llama::Engine> model_;
  std::vector<token_id> last_draft_;
};

// One traced generation with the draft model through the step-wise API.
inline std::vector<TraceStep> traced_generation(
    llama::Engine& target_engine, llama::Engine& draft_engine, std::span<const token_id> prompt,
    const specdec::SamplingOptions& sampling, std::size_t gamma, std::size_t tokens,
    std::uint64_t seed, std::vector<token_id>& generated, specdec::DecoderStatistics& statistics) {
  target_engine.reset();
  draft_engine.reset();
  RecordingTarget target(target_engine);
  specdec::LogitsModel draft(draft_engine);
  specdec::DecoderOptions options;
  options.sampling = sampling;
  options.gamma_policy = specdec::FixedGamma{gamma};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  specdec::default_engine g(seed);
  std::vector<token_id> context(prompt.begin(), prompt.end());
  std::vector<TraceStep> steps;
  generated.clear();
  while (generated.size() < tokens) {
    const specdec::StepResult result = decoder.step(context, g, tokens - generated.size());
    TraceStep step;
    step.drafted = result.drafted;
    for (std::size_t k = 0; k < result.tokens.size(); ++k) {
      if (result.sources[k] == specdec::token_source::draft) {
        step.accepted.push_back(result.tokens[k]);
      } else {
        step.token = result.tokens[k];
        step.bonus = result.sources[k] == specdec::token_source::bonus;
      }
    }
    if (step.token && result.accepted < result.drafted &&
        result.accepted < target.last_draft().size()) {
      step.rejected = target.last_draft()[result.accepted];
    }
    steps.push_back(std::move(step));
    context.insert(context.end(), result.tokens.begin(), result.tokens.end());
    generated.insert(generated.end(), result.tokens.begin(), result.tokens.end());
  }
  statistics = decoder.statistics();
  return steps;
}

struct Timing {
  std::vector<double> plain, speculative;                  // seconds per run
  specdec::DecoderStatistics statistics;                   // over the speculative runs
  std::vector<token_id> plain_tokens, speculative_tokens;  // of the first run
};

// Alternating plain and speculative runs of the same prompt and length (no stop token, so
// every run generates exactly `tokens`).
inline Timing time_runs(llama::Engine& target, llama::Engine* draft, llama::drafter_kind kind,
                        std::span<const token_id> prompt, llama::RunOptions options,
                        std::size_t repetitions, bool with_plain) {
  Timing timing;
  options.stop_tokens.clear();
  const std::uint64_t seed = options.seed;
  for (std::size_t r = 0; r < repetitions; ++r) {
    options.seed = seed + r;
    for (int half = 0; half < 2; ++half) {
      const bool plain = (half == 0) == (r % 2 == 0);  // alternate which runs first
      if (plain) {
        if (!with_plain) continue;
        const llama::RunResult result = llama::generate_plain(target, prompt, options);
        timing.plain.push_back(result.seconds);
        if (r == 0) timing.plain_tokens = result.tokens;
      } else {
        const llama::RunResult result =
            llama::generate_speculative(target, draft, kind, prompt, options);
        timing.speculative.push_back(result.seconds);
        if (r == 0) timing.speculative_tokens = result.tokens;
        const auto& s = result.statistics;
        timing.statistics.steps += s.steps;
        timing.statistics.target_calls += s.target_calls;
        timing.statistics.drafted_tokens += s.drafted_tokens;
        timing.statistics.nodes_scored += s.nodes_scored;
        timing.statistics.accepted_tokens += s.accepted_tokens;
        timing.statistics.emitted_tokens += s.emitted_tokens;
        timing.statistics.beta_sum += s.beta_sum;
        timing.statistics.beta_positions += s.beta_positions;
      }
    }
  }
  return timing;
}

inline TokenText token_text(const llama::Tokenizer& tokenizer) {
  return TokenText{[&tokenizer](token_id t) { return visible_piece(tokenizer.piece(t)); }};
}

inline std::string model_line(const char* role, const llama::Model& m) {
  const llama::Config& c = m.config();
  return format(
      "%s %s: %.2fM parameters, %zu layers, d %zu, %zu heads (%zu KV), FFN %zu, V %zu, "
      "context %zu%s; streams %.1f MB of F32 weights per forward pass",
      role, c.name.c_str(), static_cast<double>(m.parameters()) / 1e6, c.layers, c.dim, c.heads,
      c.kv_heads, c.ffn, c.vocab, c.context_length, c.tied_output ? ", tied output" : "",
      static_cast<double>(m.streamed_bytes()) / 1e6);
}

}  // namespace llama_demo

int run_llama_demo(const LlamaDemoOptions& options) {
  using namespace llama_demo;  // NOLINT(google-build-using-namespace)
  Report report(terminal_style());
  const auto load_start = clock_type::now();
  const llama::Model target_model(options.target);
  const llama::Model draft_model(options.draft);
  llama::check_pair(target_model, draft_model);
  const double load_seconds = seconds_since(load_start);
  const llama::Tokenizer& tokenizer = target_model.tokenizer();
  const std::vector<token_id> prompt = tokenizer.encode(options.prompt);
  llama::ThreadPool pool(options.threads);
  llama::Engine target(target_model, 0, &pool);
  llama::Engine draft(draft_model, 0, &pool);
  const TokenText shown = token_text(tokenizer);
  std::string description;
  if (const auto file = llama::GgufFile(options.target); file.find("general.description")) {
    description = file.string("general.description");
  }

  specdec::SamplingOptions sampled;
  sampled.temperature = options.temperature;
  specdec::SamplingOptions greedy;
  greedy.temperature = 0.0;
  const std::string sampled_name = format("sampled, T = %g", options.temperature);

  report.block({
      "specdec demo: speculative decoding (Leviathan, Kalman, Matias 2023) of a transformer",
      "",
      model_line("target  M_p", target_model),
      model_line("draft   M_q", draft_model),
      description.empty() ? "" : "models  " + description,
      format("engine  examples/llama: KV cache, one forward pass per target call, %s kernels, "
             "%zu thread%s; loaded in %.2f s",
             std::string(llama::kernels::to_string(llama::kernels::active())).c_str(), pool.size(),
             pool.size() == 1 ? "" : "s", load_seconds),
      format("prompt  %zu tokens; %zu new tokens per generation, gamma = %zu", prompt.size(),
             options.tokens, options.gamma),
  });

  // --- Figure 1 ---------------------------------------------------------------------------
  std::vector<token_id> text;
  specdec::DecoderStatistics trace_statistics;
  const auto steps = traced_generation(target, draft, prompt, sampled, options.gamma,
                                       options.tokens, options.seed, text, trace_statistics);
  report.heading(
      format("Speculative sampling (Algorithm 1), %s, draft model: one line per "
             "step = one target call",
             sampled_name.c_str()));
  report.trace(prompt, steps, shown);
  report.block({format("=> %zu tokens in %zu target calls (plain decoding needs %zu); "
                       "alpha (mean beta) %.3f",
                       text.size(), steps.size(), text.size(), trace_statistics.mean_beta()),
                "", "The text:", "", tokenizer.decode(prompt) + tokenizer.decode(text)});

  std::vector<token_id> greedy_text;
  specdec::DecoderStatistics greedy_statistics;
  const auto greedy_steps =
      traced_generation(target, draft, prompt, greedy, options.gamma, options.tokens, options.seed,
                        greedy_text, greedy_statistics);
  report.heading("Greedy speculative decoding (T = 0, exact-match verification)");
  report.trace(prompt, greedy_steps, shown);
  llama::RunOptions plain_greedy;
  plain_greedy.sampling = greedy;
  plain_greedy.max_new_tokens = options.tokens;
  const llama::RunResult plain = llama::generate_plain(target, prompt, plain_greedy);
  report.block(
      {format("=> %zu tokens in %zu target calls; identical to plain greedy decoding "
              "of the target: %s",
              greedy_text.size(), greedy_steps.size(),
              plain.tokens == greedy_text ? "yes" : "NO (this is a bug)")});

  // --- constrained generation: a regular expression, the same mask on p and q -------------
  if (const auto eos = tokenizer.eos(); eos && tokenizer.encodes_text()) {
    const char* pattern = R"( [a-z_]+\(([a-z_]+(, [a-z_]+)*)?\):)";
    const std::vector<token_id> def_prompt = tokenizer.encode("def");
    const std::vector<token_id> ends = {*eos};
    specdec::ConstrainedSampling<specdec::TokenDfa> rules(
        target.vocab_size(), specdec::TokenDfa(specdec::ByteDfa::compile(pattern),
                                               llama::token_strings(tokenizer), ends));
    llama::RunOptions run;
    run.sampling = greedy;
    run.max_new_tokens = 32;
    run.gamma = options.gamma;
    run.stop_tokens = ends;
    const auto constrained_text = [&](const std::vector<token_id>& tokens) {
      std::vector<token_id> shown_tokens = tokens;
      if (!shown_tokens.empty() && shown_tokens.back() == *eos) shown_tokens.pop_back();
      return tokenizer.decode(def_prompt) + tokenizer.decode(shown_tokens, false);
    };
    const llama::RunResult spec = llama::generate_speculative_constrained(
        target, &draft, llama::drafter_kind::model, rules, def_prompt, run);
    const llama::RunResult plain_constrained =
        llama::generate_plain_constrained(target, rules, def_prompt, run);
    report.heading(
        format("Constrained generation: the text after \"def\" must match the regular "
               "expression '%s' in full, then </s> (TokenDfa; one mask on p and q at every "
               "position)",
               pattern));
    std::vector<std::string> lines = {format(
        "greedy:  %s   (%zu tokens in %zu target calls; identical to plain greedy "
        "decoding of the constrained target: %s)",
        constrained_text(spec.tokens).c_str(), spec.tokens.size(), spec.statistics.target_calls,
        spec.tokens == plain_constrained.tokens ? "yes" : "NO (this is a bug)")};
    run.sampling = sampled;
    for (const std::uint64_t seed : {1U, 2U, 3U}) {
      run.seed = seed;
      const llama::RunResult drawn = llama::generate_speculative_constrained(
          target, &draft, llama::drafter_kind::model, rules, def_prompt, run);
      lines.push_back(format(
          "%s, seed %llu:  %s%s", sampled_name.c_str(), static_cast<unsigned long long>(seed),
          constrained_text(drawn.tokens).c_str(),
          drawn.stop == specdec::stop_reason::stop_token ? "" : "   (not finished in 32 tokens)"));
    }
    report.block(lines);
  }

  // --- wall time: plain vs speculative, measured in the same run ----------------------------
  std::vector<token_id> cost_context = prompt;
  cost_context.insert(cost_context.end(), greedy_text.begin(),
                      greedy_text.begin() + static_cast<std::ptrdiff_t>(
                                                std::min<std::size_t>(64, greedy_text.size())));
  const llama::Costs costs = llama::measure_costs(target, draft, cost_context, options.gamma);
  struct ModeTiming {
    std::string name;
    specdec::SamplingOptions sampling;
    Timing timing;
  };
  std::vector<ModeTiming> modes = {{"greedy, T = 0", greedy, {}}, {sampled_name, sampled, {}}};
  for (ModeTiming& mode : modes) {
    llama::RunOptions run;
    run.sampling = mode.sampling;
    run.max_new_tokens = options.tokens;
    run.gamma = options.gamma;
    run.seed = options.seed;
    mode.timing = time_runs(target, &draft, llama::drafter_kind::model, prompt, run,
                            options.repetitions, true);
  }
  report.heading(
      format("Wall time: plain vs speculative decoding (draft model, gamma = %zu), "
             "%zu tokens, median of %zu alternating runs each",
             options.gamma, options.tokens, options.repetitions));
  Table wall;
  wall.header = {"", modes[0].name, modes[1].name};
  const auto row = [&](const std::string& label, auto value) {
    wall.rows.push_back({label, value(modes[0]), value(modes[1])});
  };
  const auto plain_median = [](const ModeTiming& m) { return median(m.timing.plain); };
  const auto speculative_median = [](const ModeTiming& m) { return median(m.timing.speculative); };
  const auto alpha_of = [](const ModeTiming& m) {
    return std::clamp(m.timing.statistics.mean_beta(), 0.0, 1.0);
  };
  row("plain decoding of the target", [&](const ModeTiming& m) {
    return format("%s (%.0f tokens/s)", duration(plain_median(m)).c_str(),
                  static_cast<double>(options.tokens) / plain_median(m));
  });
  row("speculative decoding", [&](const ModeTiming& m) {
    return format("%s (%.0f tokens/s)", duration(speculative_median(m)).c_str(),
                  static_cast<double>(options.tokens) / speculative_median(m));
  });
  row("speedup, measured", [&](const ModeTiming& m) {
    return format("%.2fx", plain_median(m) / speculative_median(m));
  });
  row("alpha measured (mean beta, Cor. 3.6)",
      [&](const ModeTiming& m) { return format("%.3f", alpha_of(m)); });
  row("tokens per target call: measured / Eq. 1", [&](const ModeTiming& m) {
    return format("%.2f / %.2f", m.timing.statistics.tokens_per_step(),
                  specdec::expected_tokens_per_step(alpha_of(m), options.gamma));
  });
  row("speedup predicted, Thm 3.8 (batched call = 1 call)", [&](const ModeTiming& m) {
    return format("%.2fx", specdec::walltime_improvement(alpha_of(m), options.gamma, costs.c()));
  });
  const auto charged = [&](const ModeTiming& m, double c) {
    return format("%.2fx", specdec::expected_tokens_per_step(alpha_of(m), options.gamma) /
                               costs.step_cost(options.gamma, c));
  };
  row("speedup predicted, charging the measured batched call",
      [&](const ModeTiming& m) { return charged(m, costs.c()); });
  row("... and the draft's cost in the loop (c after a target pass)",
      [&](const ModeTiming& m) { return charged(m, costs.c_in_loop()); });
  std::vector<std::string> lines = wall.lines();
  lines.emplace_back("");
  lines.push_back(
      format("  measured costs (medians of 31 interleaved rounds at context %zu): target %s per "
             "position, draft %s (c = %.3f),",
             cost_context.size(), duration(costs.target_single).c_str(),
             duration(costs.draft_single).c_str(), costs.c()));
  lines.push_back(
      format("  a draft position right after a target pass (as decoding meets it): %s (c = %.3f; "
             "the target's weight stream evicts the draft's weights from cache)",
             duration(costs.draft_in_loop).c_str(), costs.c_in_loop()));
  lines.push_back(
      format("  target call of gamma + 1 = %zu positions %s = %.2fx one position "
             "(the weights are streamed once per call)",
             options.gamma + 1, duration(costs.target_batched).c_str(), costs.batched_ratio()));
  lines.push_back(format(
      "  greedy speculative output identical to plain greedy output in every timed run: %s",
      modes[0].timing.plain_tokens == modes[0].timing.speculative_tokens ? "yes" : "NO (a bug)"));
  report.block(lines);

  // --- exactness -----------------------------------------------------------------------------
  if (options.exactness_runs > 0) {
    const std::size_t runs = options.exactness_runs;
    target.reset();
    draft.reset();
    specdec::LogitsModel target_rows(target);
    specdec::LogitsModel draft_rows(draft);
    specdec::DecoderOptions decoder_options;
    decoder_options.sampling = sampled;
    decoder_options.gamma_policy = specdec::FixedGamma{options.gamma};
    specdec::SpeculativeDecoder decoder(target_rows, draft_rows, decoder_options);
    specdec::default_engine g(options.seed ^ 0x5eedf00dULL);
    const std::size_t vocab = target_model.config().vocab;
    std::vector<std::uint64_t> speculative(vocab, 0), plain_counts(vocab, 0), plain_again(vocab, 0);
    const auto started = clock_type::now();
    for (std::size_t r = 0; r < runs; ++r) {
      const specdec::StepResult result = decoder.step(prompt, g, 1);
      ++speculative[static_cast<std::size_t>(result.tokens[0])];
    }
    const double seconds = seconds_since(started);
    specdec::Standardizer<double> standardizer(sampled);
    const auto logits = target.next_token_logits(prompt);
    std::vector<double> exact(vocab);
    standardizer.apply_logits(logits, std::span<double>(exact));
    for (std::size_t r = 0; r < runs; ++r) {
      ++plain_counts[static_cast<std::size_t>(
          specdec::sample_from_row(std::span<const double>(exact), g))];
      ++plain_again[static_cast<std::size_t>(
          specdec::sample_from_row(std::span<const double>(exact), g))];
    }
    const auto frequencies = [runs](const std::vector<std::uint64_t>& counts) {
      std::vector<double> out(counts.size());
      for (std::size_t i = 0; i < counts.size(); ++i)
        out[i] = static_cast<double>(counts[i]) / static_cast<double>(runs);
      return out;
    };
    const auto speculative_frequency = frequencies(speculative);
    const auto plain_frequency = frequencies(plain_counts);
    const auto plain_again_frequency = frequencies(plain_again);
    const auto chi_square = specdec::stats::chi_square_test(speculative, exact);
    report.heading(
        format("Exactness spot check: the first generated token of %zu speculative "
               "steps (%s, %.1f s)",
               runs, sampled_name.c_str(), seconds));
    std::vector<std::string> check = {
        format("  TV distance, speculative vs plain sampling:       %.4f",
               specdec::stats::total_variation(speculative_frequency, plain_frequency)),
        format("  TV distance, plain vs plain (sampling noise):     %.4f",
               specdec::stats::total_variation(plain_frequency, plain_again_frequency)),
        format("  chi-square, speculative vs the exact target row:  chi2 = %.1f, df = %zu, "
               "p-value = %.3f",
               chi_square.statistic, chi_square.degrees_of_freedom, chi_square.p_value),
        ""};
    Table top;
    top.header = {"most likely first tokens", "target p", "speculative", "plain"};
    std::vector<std::size_t> order(vocab);
    for (std::size_t i = 0; i < vocab; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
      return exact[x] > exact[y] || (exact[x] == exact[y] && x < y);
    });
    for (std::size_t k = 0; k < 6; ++k) {
      const std::size_t token = order[k];
      top.rows.push_back(
          {"'" + shown.text(static_cast<token_id>(token)) + "'", format("%.4f", exact[token]),
           format("%.4f", speculative_frequency[token]), format("%.4f", plain_frequency[token])});
    }
    const auto top_lines = top.lines();
    check.insert(check.end(), top_lines.begin(), top_lines.end());
    check.emplace_back("");
    check.emplace_back(chi_square.p_value > 1e-3
                           ? "  => speculative sampling draws from the target's distribution, "
                             "within sampling noise."
                           : "  => the speculative distribution deviates from the target's "
                             "beyond sampling noise!");
    report.block(check);
  }

  // --- drafters ----------------------------------------------------------------------------
  report.heading(
      format("specdec's drafters on the same prompt (%zu tokens, median of 3 runs; "
             "speedup against the plain medians above)",
             options.tokens));
  Table drafters;
  drafters.header = {"drafter",
                     "mode",
                     "tokens/s",
                     "speedup",
                     "tokens / target call",
                     "accepted / drafted",
                     "alpha",
                     "= plain greedy"};
  // The default verification (block for chains, traversal for trees at T > 0), and the
  // token-level rules beside it for the model and tree drafters at T > 0.
  struct DrafterRow {
    llama::drafter_kind kind;
    std::string label;
    specdec::verification_rule rule = specdec::verification_rule::automatic;
  };
  const std::vector<DrafterRow> kinds = {
      {llama::drafter_kind::model, format("draft model, gamma %zu", options.gamma)},
      {llama::drafter_kind::model,
       format("draft model, gamma %zu, token rule (Algorithm 1)", options.gamma),
       specdec::verification_rule::token},
      {llama::drafter_kind::ngram, format("n-gram (NgramDrafter), gamma %zu", options.gamma)},
      {llama::drafter_kind::prompt_lookup,
       format("prompt lookup (PromptLookupDrafter), gamma %zu", options.gamma)},
      {llama::drafter_kind::tree, "token tree, 7 nodes, depth 4 (draft model)"},
      {llama::drafter_kind::tree, "token tree, 7 nodes, recursive rejection",
       specdec::verification_rule::token},
      {llama::drafter_kind::controller, "draft model, optimal-gamma controller (c measured)"},
  };
  for (const auto& [kind, label, rule] : kinds) {
    for (const ModeTiming& mode : modes) {
      // Greedy decoding verifies by exact match under every rule.
      if (rule == specdec::verification_rule::token && mode.sampling.greedy()) continue;
      llama::RunOptions run;
      run.sampling = mode.sampling;
      run.max_new_tokens = options.tokens;
      run.gamma = options.gamma;
      run.seed = options.seed;
      run.verification = rule;
      const Timing timing = time_runs(target, &draft, kind, prompt, run, 3, false);
      const double seconds = median(timing.speculative);
      const auto& s = timing.statistics;
      const bool greedy_mode = mode.sampling.greedy();
      drafters.rows.push_back(
          {label, greedy_mode ? "T = 0" : format("T = %g", options.temperature),
           format("%.0f", static_cast<double>(options.tokens) / seconds),
           format("%.2fx", median(mode.timing.plain) / seconds),
           format("%.2f",
                  static_cast<double>(s.emitted_tokens) / static_cast<double>(s.target_calls)),
           format("%.3f", s.acceptance_rate()),
           s.beta_positions > 0 ? format("%.3f", s.mean_beta()) : std::string("-"),
           greedy_mode
               ? (timing.speculative_tokens == modes[0].timing.plain_tokens ? "yes" : "NO (a bug)")
               : std::string("-")});
    }
  }
  auto drafter_lines = drafters.lines();
  drafter_lines.emplace_back("");
  drafter_lines.emplace_back(
      "  n-gram and prompt lookup draft for free (c = 0) but only where the text repeats; the "
      "draft model");
  drafter_lines.emplace_back(
      "  costs c per token and drafts everywhere; a token tree verifies several candidates in "
      "one wider");
  drafter_lines.emplace_back(
      "  target pass; the controller picks gamma each step from the measured alpha and c (Thm "
      "3.8).");
  drafter_lines.emplace_back(
      "  At T > 0 model drafts are verified on whole paths by default (block verification for "
      "chains,");
  drafter_lines.emplace_back(
      "  traversal verification for trees); the token-rule rows show what Algorithm 1 and "
      "recursive");
  drafter_lines.emplace_back("  rejection give on the same seeds.");
  report.block(drafter_lines);

  if (!options.html.empty()) {
    std::ofstream out(options.html, std::ios::binary);
    out << report.page("specdec demo: speculative decoding of a transformer");
    if (!out) throw std::runtime_error("cannot write '" + options.html + "'");
    std::printf("\nHTML report written to %s\n", options.html.c_str());
  }
  return 0;
}

}  // namespace specdec_demo
