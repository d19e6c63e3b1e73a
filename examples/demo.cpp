// specdec demo: speculative decoding (Leviathan, Kalman, Matias 2023) on real models.
//
// By default the demo runs a real transformer: the shipped llama pair in the example engine
// (demo/llama_demo.hpp). With --kneser-ney it runs the n-gram mode below instead: a
// byte-level interpolated Kneser-Ney model of order 7 is the target M_p; a bigram (the
// same estimator at order 2) or one of specdec's proposal drafters is the draft. Both
// models are trained at start-up on the repository's own text (or --corpus). The demo
// generates with speculative sampling (Algorithm 1) and greedily, prints the paper's
// Figure 1 as a trace, compares measured acceptance, tokens per target call and wall-time
// speedup with Cor. 3.6, Eq. 1 and Theorem 3.8, and spot-checks that speculative sampling
// leaves the target's distribution unchanged. Run with --help for the options.
#include <unistd.h>

#include <sys/ioctl.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "demo/instruments.hpp"
#include "demo/kneser_ney.hpp"
#include "demo/llama_demo.hpp"
#include "demo/options.hpp"
#include "demo/report.hpp"
#include "demo/trace.hpp"
#include "specdec/analysis.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/statistics.hpp"

namespace {

using specdec::token_id;
using namespace specdec_demo;  // NOLINT(google-build-using-namespace): the demo's own helpers

// ---------------------------------------------------------------------------------------
// The corpus
// ---------------------------------------------------------------------------------------

struct Corpus {
  std::string text;
  std::string description;
};

std::string read_text_file(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error))
    throw std::runtime_error("cannot read corpus '" + path.string() + "': no such file");
  if (!std::filesystem::is_regular_file(path, error))
    throw std::runtime_error("cannot read corpus '" + path.string() + "': not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error("cannot read corpus '" + path.string() + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw std::runtime_error("cannot read corpus '" + path.string() + "': read error");
  return text.str();
}

Corpus load_corpus(const DemoOptions& options) {
  Corpus corpus;
  if (!options.corpus.empty()) {
    corpus.text = read_text_file(options.corpus);
    if (corpus.text.empty()) throw std::runtime_error("corpus '" + options.corpus + "' is empty");
    corpus.description = options.corpus;
  } else {
    // The repository's own prose and headers: present on every fresh clone.
    const std::filesystem::path root = SPECDEC_SOURCE_DIR;
    std::vector<std::filesystem::path> files;
    std::error_code error;
    if (std::filesystem::is_regular_file(root / "README.md", error))
      files.push_back(root / "README.md");
    std::size_t docs = 0;
    std::size_t headers = 0;
    const auto collect = [&](const std::filesystem::path& directory, const std::string& extension,
                             bool recursive, std::size_t& count) {
      std::vector<std::filesystem::path> found;
      if (!std::filesystem::is_directory(directory, error)) return;
      const auto visit = [&](const std::filesystem::directory_entry& entry) {
        if (entry.is_regular_file() && entry.path().extension() == extension)
          found.push_back(entry.path());
      };
      if (recursive) {
        for (const auto& entry : std::filesystem::recursive_directory_iterator(directory))
          visit(entry);
      } else {
        for (const auto& entry : std::filesystem::directory_iterator(directory)) visit(entry);
      }
      std::sort(found.begin(), found.end());  // a deterministic corpus
      count = found.size();
      files.insert(files.end(), found.begin(), found.end());
    };
    collect(root / "docs", ".md", false, docs);
    collect(root / "include" / "specdec", ".hpp", true, headers);
    if (files.empty())
      throw std::runtime_error("cannot find the repository's text under '" + root.string() +
                               "'; pass --corpus PATH");
    for (const auto& file : files) corpus.text += read_text_file(file) + "\n";
    corpus.description =
        format("the repository's own text: README.md, %zu docs/*.md, %zu headers", docs, headers);
  }
  corpus.description += format(" (%.0f KB)", static_cast<double>(corpus.text.size()) / 1024.0);
  return corpus;
}

// ---------------------------------------------------------------------------------------
// Per-mode bookkeeping
// ---------------------------------------------------------------------------------------

struct Mode {
  std::string name;
  specdec::SamplingOptions sampling;
};

// Acceptance statistics over several generations of one mode.
struct AcceptanceRecord {
  specdec::AcceptanceEstimator acceptance;  // accepted drafts, verified drafts, steps
  double beta_sum = 0.0;                    // alpha predicted: mean beta (Cor. 3.6)
  std::size_t beta_positions = 0;
  std::size_t drafted = 0;  // all drafted tokens, the untried ones after a rejection too
  std::vector<std::size_t> drafted_histogram;  // steps by number of drafted tokens
  std::size_t generations = 0;

  void record(const specdec::StepResult& step) {
    acceptance.observe_step(step.drafted, step.accepted);
    beta_sum += step.beta_sum;
    beta_positions += step.beta_positions;
    drafted += step.drafted;
    if (drafted_histogram.size() <= step.drafted) drafted_histogram.resize(step.drafted + 1, 0);
    ++drafted_histogram[step.drafted];
  }

  // accepted / drafted: the share of all drafted tokens that were accepted.
  [[nodiscard]] double accepted_per_drafted() const {
    return drafted == 0 ? 0.0
                        : static_cast<double>(acceptance.accepted()) / static_cast<double>(drafted);
  }
  // accepted / verified drafts: a step tries x_1..x_{n+1} and stops at the first rejection,
  // so these are Bernoulli(alpha) trials when the betas are i.i.d. (maximum likelihood).
  [[nodiscard]] double alpha_per_verified() const { return acceptance.estimate().alpha; }
  [[nodiscard]] double alpha_predicted() const {
    if (beta_positions == 0) return 0.0;
    return std::clamp(beta_sum / static_cast<double>(beta_positions), 0.0, 1.0);
  }
  // Eq. 1 with the predicted alpha, averaged over the steps' actual draft lengths (a
  // proposal drafter may draft fewer than gamma tokens, or none).
  [[nodiscard]] double tokens_per_step_predicted() const {
    double sum = 0.0;
    std::size_t steps = 0;
    for (std::size_t d = 0; d < drafted_histogram.size(); ++d) {
      sum += static_cast<double>(drafted_histogram[d]) * expected_tokens(d);
      steps += drafted_histogram[d];
    }
    return steps == 0 ? 0.0 : sum / static_cast<double>(steps);
  }
  // The prediction of accepted / drafted: a step of d drafts accepts Eq. 1 - 1 =
  // alpha + alpha^2 + ... + alpha^d of them on average.
  [[nodiscard]] double accepted_per_drafted_predicted() const {
    double accepted = 0.0;
    for (std::size_t d = 0; d < drafted_histogram.size(); ++d)
      accepted += static_cast<double>(drafted_histogram[d]) * (expected_tokens(d) - 1.0);
    return drafted == 0 ? 0.0 : accepted / static_cast<double>(drafted);
  }

 private:
  [[nodiscard]] double expected_tokens(std::size_t d) const {
    return d == 0 ? 1.0 : specdec::expected_tokens_per_step(alpha_predicted(), d);
  }
};

// Wall time of plain vs speculative decoding for one mode and one target flavour.
struct TimingRecord {
  bool measured = false;
  std::size_t repetitions = 0;
  double plain_seconds = 0.0;         // median over repetitions
  double speculative_seconds = 0.0;   // median over repetitions
  double target_call_seconds = 0.0;   // T: one single-position target call (plain decoding)
  double batched_call_seconds = 0.0;  // one score_draft call of gamma + 1 positions
  double draft_seconds_per_step = 0.0;
  double tokens_per_step = 0.0;
  std::size_t gamma = 0;

  [[nodiscard]] double speedup() const { return plain_seconds / speculative_seconds; }
  // Definition 3.7: draft cost per drafted token over the cost of one target run.
  [[nodiscard]] double c() const {
    return draft_seconds_per_step / static_cast<double>(gamma) / target_call_seconds;
  }
  [[nodiscard]] double batched_over_single() const {
    return batched_call_seconds / target_call_seconds;
  }
};

// Draft timing, for model drafts (Timed) and proposal drafters (TimedDrafter) alike.
template <class Model>
double draft_seconds(const Timed<Model>& draft) {
  return draft.total().seconds;
}
template <class Drafter>
double draft_seconds(const TimedDrafter<Drafter>& draft) {
  return draft.stats().seconds;
}

// ---------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------

specdec::DecoderOptions decoder_options(const Mode& mode, std::size_t gamma, bool fast) {
  specdec::DecoderOptions options;
  options.sampling = mode.sampling;
  options.gamma_policy = specdec::FixedGamma{gamma};
  if (fast) {  // the production path: no row validation, no beta statistics
    options.validate_rows = false;
    options.collect_beta = false;
  }
  return options;
}

// Plain autoregressive decoding from the target with the same standardization: the
// baseline every speedup is measured against.
template <class Target, class Generator>
void decode_plain(Target& target, specdec::Standardizer<double>& standardizer,
                  std::vector<double>& row_buffer, std::span<const token_id> prompt,
                  std::size_t tokens, std::vector<token_id>& context, Generator& g) {
  context.assign(prompt.begin(), prompt.end());
  for (std::size_t i = 0; i < tokens; ++i) {
    const auto row = specdec::as_span(target.next_token_probabilities(context));
    token_id next = 0;
    if (standardizer.greedy()) {
      next = specdec::argmax(row);
    } else if (standardizer.identity()) {
      next = specdec::sample_from_row(row, g);
    } else {
      standardizer.apply(row, std::span<double>(row_buffer));
      next = specdec::sample_from_row(std::span<const double>(row_buffer), g);
    }
    context.push_back(next);
  }
}

// One generation through the step-wise API, recording the trace and the statistics.
template <class Decoder, class Target>
std::vector<TraceStep> generate_traced(Decoder& decoder, Target& target,
                                       std::span<const token_id> prompt, std::size_t tokens,
                                       std::uint64_t seed, AcceptanceRecord& record,
                                       std::vector<token_id>* text) {
  specdec::default_engine g(seed);
  std::vector<token_id> context(prompt.begin(), prompt.end());
  std::vector<TraceStep> steps;
  std::size_t generated = 0;
  while (generated < tokens) {
    const specdec::StepResult result = decoder.step(context, g, tokens - generated);
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
    // The rejected draft x_{n+1} is the draft the target scored at position n.
    if (step.token && result.accepted < result.drafted &&
        result.accepted < target.last_draft().size())
      step.rejected = target.last_draft()[result.accepted];
    record.record(result);
    steps.push_back(std::move(step));
    context.insert(context.end(), result.tokens.begin(), result.tokens.end());
    generated += result.tokens.size();
    if (result.stop != specdec::stop_reason::none &&
        result.stop != specdec::stop_reason::max_new_tokens)
      break;
  }
  ++record.generations;
  if (text != nullptr)
    text->assign(context.begin() + static_cast<std::ptrdiff_t>(prompt.size()), context.end());
  return steps;
}

// Alternating plain and speculative generations of the same prompt and length until the
// time budget is spent (at least 3, at most 200 of each); medians are reported.
template <class Target, class Draft>
TimingRecord measure_wall_time(Target& target, Draft& draft, const Mode& mode, std::size_t gamma,
                               std::span<const token_id> prompt, std::size_t tokens,
                               std::uint64_t seed, double budget_seconds) {
  specdec::SpeculativeDecoder decoder(target, draft, decoder_options(mode, gamma, true));
  specdec::Standardizer<double> standardizer(mode.sampling);
  std::vector<double> row_buffer(target.vocab_size());
  std::vector<token_id> context;
  context.reserve(prompt.size() + tokens);
  decoder.reserve(prompt.size() + tokens);
  // Per-repetition figures; medians resist the odd slow run (page faults, a busy machine).
  std::vector<double> plain_times;
  std::vector<double> speculative_times;
  std::vector<double> target_call_times;
  std::vector<double> batched_call_times;
  std::vector<double> draft_times_per_step;
  std::vector<double> tokens_per_step;
  const auto start = clock_type::now();
  for (std::size_t r = 0; r < 200 && (r < 3 || seconds_since(start) < budget_seconds); ++r) {
    for (int half = 0; half < 2; ++half) {
      const bool plain = (half == 0) == (r % 2 == 0);  // alternate which runs first
      target.reset();
      draft.reset();
      specdec::default_engine g(seed + r);
      if (plain) {
        const auto t0 = clock_type::now();
        decode_plain(target, standardizer, row_buffer, prompt, tokens, context, g);
        plain_times.push_back(seconds_since(t0));
        target_call_times.push_back(target.single().seconds_per_call());
      } else {
        const auto t0 = clock_type::now();
        const specdec::GenerationResult result = decoder.generate(prompt, tokens, g);
        speculative_times.push_back(seconds_since(t0));
        const auto steps = static_cast<double>(result.statistics.steps);
        batched_call_times.push_back(target.batched().seconds_per_call());
        draft_times_per_step.push_back(draft_seconds(draft) / steps);
        tokens_per_step.push_back(static_cast<double>(result.statistics.emitted_tokens) / steps);
      }
    }
  }
  TimingRecord record;
  record.measured = true;
  record.repetitions = plain_times.size();
  record.plain_seconds = median(plain_times);
  record.speculative_seconds = median(speculative_times);
  record.target_call_seconds = median(target_call_times);
  record.batched_call_seconds = median(batched_call_times);
  record.draft_seconds_per_step = median(draft_times_per_step);
  record.tokens_per_step = median(tokens_per_step);
  record.gamma = gamma;
  return record;
}

// ---------------------------------------------------------------------------------------
// Tables
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// The demo for one kind of draft
// ---------------------------------------------------------------------------------------

struct Setup {
  DemoOptions options;
  std::vector<token_id> prompt;
  KneserNeyModel* target = nullptr;
  std::string draft_description;
};

template <class Draft>
int run_demo(Setup& setup, Draft& draft, Report& report) {
  const DemoOptions& options = setup.options;
  const std::span<const token_id> prompt(setup.prompt);
  Timed<KneserNeyModel> target(*setup.target);
  SimulatedCost cost(options.target_cost_us);
  Timed<KneserNeyModel> expensive_target(*setup.target, &cost);

  specdec::SamplingOptions sampled;
  sampled.temperature = options.temperature;
  sampled.top_k = options.top_k;
  sampled.top_p = options.top_p;
  specdec::SamplingOptions greedy;
  greedy.temperature = 0.0;
  const std::string sampled_name = format("sampled, T = %g", options.temperature);
  const std::array<Mode, 2> modes = {Mode{sampled_name, sampled}, Mode{"greedy, T = 0", greedy}};

  std::array<AcceptanceRecord, 2> acceptance{};
  std::array<TimingRecord, 2> cheap{};
  std::array<TimingRecord, 2> expensive{};
  std::vector<token_id> greedy_text;
  constexpr std::size_t statistics_generations = 20;

  for (std::size_t m = 0; m < modes.size(); ++m) {
    const Mode& mode = modes[m];
    specdec::SpeculativeDecoder decoder(target, draft, decoder_options(mode, options.gamma, false));
    // The trace: the first generation.
    std::vector<token_id> text;
    const auto steps = generate_traced(decoder, target, prompt, options.tokens, options.seed,
                                       acceptance[m], &text);
    if (m == 0) {
      report.heading(
          format("Speculative sampling (Algorithm 1), %s: one line per step = one "
                 "target call",
                 mode.name.c_str()));
    } else {
      report.heading("Greedy speculative decoding (T = 0, exact-match verification)");
    }
    report.trace(prompt, steps);
    std::vector<std::string> summary = {
        format("=> %zu tokens in %zu target calls; plain decoding needs %zu.", text.size(),
               steps.size(), text.size())};
    if (m == 1) {
      // Greedy speculative decoding must reproduce plain greedy decoding token for token.
      specdec::Standardizer<double> standardizer(mode.sampling);
      std::vector<double> buffer(256);
      std::vector<token_id> plain;
      specdec::default_engine unused(0);
      decode_plain(target, standardizer, buffer, prompt, options.tokens, plain, unused);
      const bool identical =
          std::equal(text.begin(), text.end(),
                     plain.begin() + static_cast<std::ptrdiff_t>(prompt.size()), plain.end());
      summary.push_back(format("=> identical to plain greedy decoding of the target: %s",
                               identical ? "yes" : "NO (this is a bug)"));
      greedy_text = text;
    }
    report.block(summary);
    // More generations for the acceptance statistics (greedy ones are all alike).
    const std::size_t more = m == 1 ? 0 : statistics_generations - 1;
    for (std::size_t r = 1; r <= more; ++r)
      generate_traced(decoder, target, prompt, options.tokens, options.seed + r, acceptance[m],
                      nullptr);
    cheap[m] = measure_wall_time(target, draft, mode, options.gamma, prompt, options.tokens,
                                 options.seed, 0.4);
    if (cost.active())
      expensive[m] = measure_wall_time(expensive_target, draft, mode, options.gamma, prompt,
                                       options.tokens, options.seed, 0.4);
  }

  // --- summary ---------------------------------------------------------------------------
  report.heading(
      format("Summary: measured vs predicted (%zu sampled generations of %zu tokens; "
             "greedy is deterministic)",
             acceptance[0].generations, options.tokens));
  Table rates;
  rates.header = {"", modes[0].name, modes[1].name};
  const auto both = [&](const std::string& label, auto value) {
    rates.rows.push_back({label, value(0), value(1)});
  };
  both("accepted / drafted, measured",
       [&](std::size_t m) { return format("%.3f", acceptance[m].accepted_per_drafted()); });
  both("accepted / drafted, predicted ((Eq. 1 - 1) / gamma)", [&](std::size_t m) {
    return format("%.3f", acceptance[m].accepted_per_drafted_predicted());
  });
  both("alpha measured (accepted / verified drafts)",
       [&](std::size_t m) { return format("%.3f", acceptance[m].alpha_per_verified()); });
  both("alpha predicted (mean beta = sum min(p, q), Cor. 3.6)",
       [&](std::size_t m) { return format("%.3f", acceptance[m].alpha_predicted()); });
  both("tokens per target call, measured (n + 1 per step)", [&](std::size_t m) {
    return format("%.3f", acceptance[m].acceptance.mean_tokens_per_step());
  });
  both("tokens per target call, predicted (Eq. 1)",
       [&](std::size_t m) { return format("%.3f", acceptance[m].tokens_per_step_predicted()); });
  std::vector<std::string> lines = rates.lines();

  const auto timing_rows = [&](const std::array<TimingRecord, 2>& timing,
                               const std::string& title) {
    Table table;
    table.header = {title, modes[0].name, modes[1].name};
    const auto row = [&](const std::string& label, auto value) {
      table.rows.push_back(
          {label, value(timing[0], acceptance[0]), value(timing[1], acceptance[1])});
    };
    row("plain target decoding (median)",
        [](const TimingRecord& t, const AcceptanceRecord&) { return duration(t.plain_seconds); });
    row("speculative decoding (median)", [](const TimingRecord& t, const AcceptanceRecord&) {
      return duration(t.speculative_seconds);
    });
    row("speedup, measured", [](const TimingRecord& t, const AcceptanceRecord&) {
      return format("%.2fx", t.speedup());
    });
    row("c = draft cost per token / target call (Def. 3.7)",
        [](const TimingRecord& t, const AcceptanceRecord&) { return format("%.2g", t.c()); });
    row("speedup predicted, Thm 3.8 with measured c",
        [&](const TimingRecord& t, const AcceptanceRecord& a) {
          return format("%.2fx", specdec::walltime_improvement(a.alpha_predicted(), t.gamma,
                                                               std::max(0.0, t.c())));
        });
    row("batched call of gamma + 1 positions / single call",
        [](const TimingRecord& t, const AcceptanceRecord&) {
          return format("%.2f", t.batched_over_single());
        });
    row("speedup predicted, charging that batched cost",
        [](const TimingRecord& t, const AcceptanceRecord& a) {
          // Theorem 3.8's cost model with the batched call costing b target calls instead
          // of one: E[tokens] T / (gamma c T + b T).
          const double per_step = static_cast<double>(t.gamma) * t.c() + t.batched_over_single();
          return format("%.2fx", a.tokens_per_step_predicted() / per_step);
        });
    return table.lines();
  };
  lines.emplace_back("");
  const auto cheap_lines =
      timing_rows(cheap, format("wall time, %zu tokens, cheap target (%.1f us/call)",
                                options.tokens, cheap[0].target_call_seconds * 1e6));
  lines.insert(lines.end(), cheap_lines.begin(), cheap_lines.end());
  if (cost.active()) {
    lines.emplace_back("");
    const auto expensive_lines = timing_rows(
        expensive,
        format("wall time, target made expensive (+%.0f us/call)", options.target_cost_us));
    lines.insert(lines.end(), expensive_lines.begin(), expensive_lines.end());
  }
  report.block(lines);

  std::vector<std::string> notes = {
      "Notes:",
      "- accepted / drafted counts the drafts after a step's first rejection, which are never "
      "tried, as",
      "  failures: with i.i.d. betas it is (alpha + alpha^2 + ... + alpha^gamma) / gamma, below "
      "alpha.",
      "  accepted / verified drafts (a step verifies x_1..x_{n+1}) estimates alpha itself "
      "(Cor. 3.6).",
      "- Eq. 1 and Thm 3.8 assume i.i.d. betas; along real text beta varies from position to "
      "position.",
      "  Greedy: beta is 1 if the draft is the target's argmax, else 0, so both alphas agree.",
      "- A bigram is a weak draft (the paper's Table 5: alpha = 0.19 for a bigram draft of "
      "T5-XXL);",
      "  --draft-order 3 or 4 drafts better and costs more (c grows): Thm 3.8's trade-off.",
      "- Thm 3.8 assumes the target scores gamma + 1 positions for the price of one call. This "
      "n-gram",
      format("  target computes each position separately (a batched call costs %.1f calls of "
             "%s), and",
             cheap[0].batched_over_single(), duration(cheap[0].target_call_seconds).c_str()),
      "  the decoder's sampling and verification are not negligible next to it: with a target "
      "this cheap,",
      "  speculative decoding cannot pay off. The paper's targets cost milliseconds per call."};
  if (cost.active()) {
    notes.push_back(
        format("- The expensive target also streams %.1f MB per call (about %.0f us "
               "here), once per call",
               cost.megabytes_per_run(), options.target_cost_us));
    notes.emplace_back(
        "  whatever the number of positions, as a large memory-bound model reads "
        "its weights: the");
    notes.emplace_back(
        "  regime of the paper, where speculative decoding wins. The outputs are "
        "the same.");
  } else {
    notes.emplace_back(
        "- Try --target-cost-us 200 to make each target call as expensive as a "
        "memory-bound model.");
  }
  report.block(notes);

  // --- exactness -------------------------------------------------------------------------
  if (options.runs > 0) {
    const std::size_t runs = options.runs;
    specdec::SpeculativeDecoder decoder(target, draft,
                                        decoder_options(modes[0], options.gamma, false));
    specdec::default_engine g(options.seed ^ 0x5eedf00dULL);
    std::vector<std::uint64_t> speculative(256, 0);
    std::vector<std::uint64_t> plain(256, 0);
    std::vector<std::uint64_t> plain_again(256, 0);
    for (std::size_t r = 0; r < runs; ++r) {
      const specdec::StepResult result = decoder.step(prompt, g, 1);
      ++speculative[static_cast<std::size_t>(result.tokens[0])];
    }
    // The exact law of the first token: the standardized target row after the prompt.
    specdec::Standardizer<double> standardizer(modes[0].sampling);
    std::vector<double> exact(256);
    standardizer.apply(specdec::as_span(setup.target->next_token_probabilities(prompt)),
                       std::span<double>(exact));
    double total = 0.0;
    for (const double p : exact) total += p;
    for (double& p : exact) p /= total;
    for (std::size_t r = 0; r < runs; ++r) {
      ++plain[static_cast<std::size_t>(
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
    const auto plain_frequency = frequencies(plain);
    const auto plain_again_frequency = frequencies(plain_again);
    const auto chi_square = specdec::stats::chi_square_test(speculative, exact);
    report.heading(format("Exactness spot check: the first generated token over %zu runs (%s)",
                          runs, modes[0].name.c_str()));
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
    std::vector<std::size_t> order(256);
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return exact[a] > exact[b] || (exact[a] == exact[b] && a < b);
    });
    for (std::size_t k = 0; k < 6; ++k) {
      const std::size_t token = order[k];
      top.rows.push_back(
          {"'" + printable(static_cast<token_id>(token)) + "'", format("%.4f", exact[token]),
           format("%.4f", speculative_frequency[token]), format("%.4f", plain_frequency[token])});
    }
    const auto top_lines = top.lines();
    check.insert(check.end(), top_lines.begin(), top_lines.end());
    check.emplace_back("");
    check.emplace_back(chi_square.p_value > 1e-3 ? "  => speculative sampling draws from the "
                                                   "target's distribution, within sampling noise."
                                                 : "  => the speculative distribution deviates "
                                                   "from the target's beyond sampling noise!");
    report.block(check);
  }

  if (!options.html.empty()) {
    std::ofstream out(options.html, std::ios::binary);
    out << report.page();
    if (!out) throw std::runtime_error("cannot write '" + options.html + "'");
    std::printf("\nHTML trace written to %s\n", options.html.c_str());
  }
  return 0;
}

}  // namespace

// The byte-level Kneser-Ney demo (demo --kneser-ney ...).
int kneser_ney_main(int argc, char** argv) {
  DemoOptions options;
  try {
    options = parse_options(argc, argv);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "demo: %s (see --help)\n", e.what());
    return 2;
  }
  if (options.help) {
    std::fputs(help_text.data(), stdout);
    return 0;
  }
  try {
    if (!options.html.empty()) {  // fail before the work, not after it
      std::ofstream probe(options.html, std::ios::binary | std::ios::app);
      if (!probe)
        throw std::runtime_error("cannot write '" + options.html + "': " + std::strerror(errno));
    }
    Report report(terminal_style());
    const auto load_start = clock_type::now();
    const Corpus corpus = load_corpus(options);
    Setup setup;
    setup.options = options;
    setup.prompt = to_tokens(options.prompt);
    KneserNeyModel target(corpus.text, options.order);
    const double target_training = seconds_since(load_start);

    std::vector<std::string> header = {
        "specdec demo: speculative decoding (Leviathan, Kalman, Matias 2023) on real text",
        "",
        "corpus   " + corpus.description,
        format("target   M_p: interpolated Kneser-Ney, order %zu, over bytes (V = 256); "
               "trained in %.2f s",
               options.order, target_training),
    };
    setup.target = &target;
    const std::string settings = format(
        "settings gamma = %zu, %zu new tokens, seed %llu; sampled run: temperature %g, "
        "top-k %s, top-p %s",
        options.gamma, options.tokens, static_cast<unsigned long long>(options.seed),
        options.temperature, options.top_k == 0 ? "off" : std::to_string(options.top_k).c_str(),
        options.top_p >= 1.0 ? "off" : format("%g", options.top_p).c_str());
    const std::string prompt_line = "prompt   \"" + [&] {
      std::string text;
      for (const token_id t : setup.prompt) text += printable(t);
      return text;
    }() + "\"";
    int status = 0;
    switch (options.drafter) {
      case drafter_kind::bigram: {
        KneserNeyModel small(corpus.text, options.draft_order);
        Timed<KneserNeyModel> draft(small);
        header.push_back(
            options.draft_order == 2
                ? std::string("draft    M_q: the same estimator at order 2 (a "
                              "bigram), tabulated: a 256 x 256 table")
                : format("draft    M_q: the same estimator at order %zu", options.draft_order));
        header.push_back(prompt_line);
        header.push_back(settings);
        report.block(header);
        status = run_demo(setup, draft, report);
        break;
      }
      case drafter_kind::ngram: {
        specdec::NgramDrafter ngram(specdec::NgramOptions{.max_order = 6, .window = 4096});
        TimedDrafter<specdec::NgramDrafter> draft(ngram);
        header.emplace_back(
            "draft    specdec::NgramDrafter (orders 2..6 over the context so "
            "far), proposal-only: one-hot q");
        header.push_back(prompt_line);
        header.push_back(settings);
        report.block(header);
        status = run_demo(setup, draft, report);
        break;
      }
      case drafter_kind::prompt_lookup: {
        specdec::PromptLookupDrafter lookup;
        TimedDrafter<specdec::PromptLookupDrafter> draft(lookup);
        header.emplace_back(
            "draft    specdec::PromptLookupDrafter (copies what followed the "
            "longest earlier match), one-hot q");
        header.push_back(prompt_line);
        header.push_back(settings);
        report.block(header);
        status = run_demo(setup, draft, report);
        break;
      }
    }
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "demo: %s\n", e.what());
    return 1;
  }
}

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const auto mode = std::find(args.begin(), args.end(), "--kneser-ney");
  if (mode != args.end()) {  // the n-gram demo, with the remaining options
    std::vector<char*> rest = {argv[0]};
    for (int i = 1; i < argc; ++i) {
      if (std::string_view(argv[i]) != "--kneser-ney") rest.push_back(argv[i]);
    }
    return kneser_ney_main(static_cast<int>(rest.size()), rest.data());
  }
  LlamaDemoOptions options;
  try {
    options = parse_llama_options(args);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "demo: %s (see --help)\n", e.what());
    return 2;
  }
  if (options.help) {
    std::fputs(llama_help_text.data(), stdout);
    return 0;
  }
  try {
    return run_llama_demo(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "demo: %s\n", e.what());
    return 1;
  }
}
