// Speculative decoding of a real transformer: the shipped llama pair (examples/llama/models)
// in the example engine (examples/llama), on this machine.
//
// Threads: the engines' matrix products run on a llama::ThreadPool of LLAMA_THREADS threads
// (default: one per hardware thread), as llama_generate and the demo run them.
//
// BM_Forward/<model>/t<threads>/<b>: one forward pass of b new positions at context 128
//   (b = 1: what plain decoding costs per token; b = gamma + 1: what one speculative step
//   costs the target), on one thread (t1) and on all of the pool's. Time per pass.
//   Counters, all ratios of medians measured interleaved in the same loop:
//     vs_one_position  this pass / a pass of 1 position (Theorem 3.8 assumes 1)
//     vs_weight_read   this pass / a pure streaming read of the model's F32 weights on as
//                      many threads (the bytes one pass must touch: the memory-bound floor)
// BM_Generate/<drafter>/<T0|T1>: generation of 128 tokens after a fixed prompt (no stop
//   token), plain and speculative runs alternating, one of each per iteration. The time is
//   the speculative run's. Counters:
//     tokens_per_s, plain_tokens_per_s   of the speculative and the plain runs (medians)
//     speedup                            median plain time / median speculative time
//     tokens_per_call                    emitted tokens per target forward pass
//     accepted_per_drafted, alpha        accepted / drafted; mean beta (Cor. 3.6)
//     c, batched_ratio                   measured at context 128 (llama::measure_costs): one
//                                        draft position / one target position; the target's
//                                        gamma + 1 = 5 position pass / one position
//     predicted                          Theorem 3.8 charged with the measured batched call:
//                                        E[tokens](alpha, gamma) / (gamma c + batched_ratio)
//                                        (chain drafters with a fixed gamma: model, ngram,
//                                        prompt lookup; the proposal drafters' c is 0)
//     predicted_from_tokens              the same cost model with the measured tokens per
//                                        step instead of Eq. 1 (isolates the cost model from
//                                        the i.i.d. assumption)
//     c_in_loop, predicted_in_loop       c for a draft position right after a target pass
//                                        (as decoding meets it: the target's weight stream
//                                        has evicted the draft's weights), and `predicted`
//                                        charged with it
// BM_Rule/<model|tree>/<T1|T0.7>: the default path-level verification (block verification
//   for the model drafter's chains, traversal verification for the tree drafter) against the
//   token-level rule (Algorithm 1, recursive rejection) on the same seeds, alternating; the
//   counters are described at BM_Rule.
// Run it with --benchmark_min_time=<seconds> for more iterations; scripts/test.sh smoke-runs
// it with one.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "baseline.hpp"
#include "llama/generate.hpp"
#include "specdec/analysis.hpp"

namespace {

using specdec::token_id;
using clock_type = std::chrono::steady_clock;

constexpr std::size_t gamma = 4;
// 128 new tokens and a context of 128 for the forward passes, or less where the model's
// context is shorter (tokens() and forward_context() below).
constexpr std::size_t wanted_tokens = 128;

const char* const prompt_text = llama::stack_prompt;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

using llama::median;

// Threads of the engines' matrix products: LLAMA_THREADS, or one per hardware thread.
std::size_t env_threads() {
  const char* t = std::getenv("LLAMA_THREADS");
  return t != nullptr ? std::strtoul(t, nullptr, 10) : 0;
}

struct Pair {
  llama::ThreadPool pool{env_threads()};
  llama::Model target_model{std::string(SPECDEC_LLAMA_MODELS) + "/target.gguf"};
  llama::Model draft_model{std::string(SPECDEC_LLAMA_MODELS) + "/draft.gguf"};
  llama::Engine target{target_model, 0, &pool};
  llama::Engine draft{draft_model, 0, &pool};
  llama::ThreadPool one_thread{1};  // BM_Forward's single-thread variant
  llama::Engine target_one{target_model, 0, &one_thread};
  llama::Engine draft_one{draft_model, 0, &one_thread};
  std::vector<token_id> prompt = target_model.tokenizer().encode(prompt_text);
  std::vector<token_id> context;  // the prompt and a greedy continuation
  std::size_t new_tokens = 0;     // per generation
  llama::Costs costs;

  Pair() {
    llama::check_pair(target_model, draft_model);
    const std::size_t capacity = std::min(target.capacity(), draft.capacity());
    // Room for the longest step: the controller's largest gamma or the tree's nodes.
    const std::size_t step_room =
        std::max(llama::RunOptions{}.max_gamma, llama::default_tree_shape().size()) + 2;
    new_tokens = std::min(wanted_tokens, capacity - prompt.size() - step_room);
    const std::size_t forward_context = std::min<std::size_t>(128, capacity / 2);
    llama::RunOptions greedy;
    greedy.sampling.temperature = 0.0;
    greedy.max_new_tokens = forward_context > prompt.size() ? forward_context - prompt.size() : 1;
    const auto run = llama::generate_plain(target, prompt, greedy);
    context = prompt;
    context.insert(context.end(), run.tokens.begin(), run.tokens.end());
    context.resize(std::min(context.size(), forward_context));
    costs = llama::measure_costs(target, draft, context, gamma);
  }
};

Pair& pair() {
  static Pair instance;
  return instance;
}

// Reads every weight matrix of `model` once, as fast as the cores can (baseline::or_bits:
// an integer OR of the bits, no arithmetic dependency), on every thread of `pool`, each
// reading its share of each matrix; returns a value that depends on all of it.
std::uint32_t read_weights(const llama::Model& model, llama::ThreadPool& pool) {
  std::atomic<std::uint32_t> out{0};
  const auto read = [&](const std::vector<float>& m) {
    const std::size_t n = pool.size();
    const std::size_t share = (m.size() / n + 31) / 32 * 32;
    pool.run(n, [&](std::size_t i) {
      const std::size_t begin = std::min(m.size(), i * share);
      const std::size_t end = i + 1 == n ? m.size() : std::min(m.size(), begin + share);
      out.fetch_or(specdec::baseline::or_bits(m.data() + begin, end - begin),
                   std::memory_order_relaxed);
    });
  };
  read(model.output().data);
  for (const llama::Layer& l : model.layers()) {
    for (const llama::Matrix* m : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down}) read(m->data);
  }
  return out.load();
}

// ---- one forward pass of b positions ----------------------------------------------------

void BM_Forward(benchmark::State& state, bool of_target, bool all_threads) {
  Pair& p = pair();
  llama::Engine& engine =
      of_target ? (all_threads ? p.target : p.target_one) : (all_threads ? p.draft : p.draft_one);
  llama::ThreadPool& pool = all_threads ? p.pool : p.one_thread;
  const llama::Model& model = of_target ? p.target_model : p.draft_model;
  const auto b = static_cast<std::size_t>(state.range(0));
  std::vector<token_id> a = p.context;
  std::vector<token_id> other = p.context;
  other.back() = a.back() == 3 ? 4 : 3;  // alternate: every call evaluates new positions
  const std::vector<token_id> drafts(b - 1, a.back());
  const std::vector<token_id> none;
  engine.reset();
  (void)engine.next_token_logits(other);
  std::vector<double> pass, single, read;
  std::size_t i = 0;
  for (auto _ : state) {
    const std::vector<token_id>& context = (i++ % 2 == 0) ? a : other;
    auto start = clock_type::now();
    benchmark::DoNotOptimize(engine.score_draft_logits(context, drafts).data());
    const double seconds = seconds_since(start);
    state.SetIterationTime(seconds);
    pass.push_back(seconds);
    start = clock_type::now();
    benchmark::DoNotOptimize(engine.score_draft_logits(context == a ? other : a, none).data());
    single.push_back(seconds_since(start));
    start = clock_type::now();
    benchmark::DoNotOptimize(read_weights(model, pool));
    read.push_back(seconds_since(start));
  }
  state.counters["vs_one_position"] = median(pass) / median(single);
  state.counters["vs_weight_read"] = median(pass) / median(read);
  state.counters["weight_MB"] = static_cast<double>(model.streamed_bytes()) / 1e6;
  state.SetLabel(std::string(of_target ? "target, " : "draft, ") + std::to_string(pool.size()) +
                 (pool.size() == 1 ? " thread" : " threads"));
}

// ---- generation, plain vs speculative ---------------------------------------------------

void BM_Generate(benchmark::State& state, llama::drafter_kind kind, double temperature) {
  Pair& p = pair();
  llama::RunOptions options;
  options.sampling.temperature = temperature;
  options.max_new_tokens = p.new_tokens;
  options.gamma = gamma;
  std::vector<double> plain, speculative;
  specdec::DecoderStatistics total;
  std::uint64_t seed = 1;
  bool identical = true;
  for (auto _ : state) {
    options.seed = seed++;
    const bool plain_first = seed % 2 == 0;
    llama::RunResult plain_run, speculative_run;
    if (plain_first) plain_run = llama::generate_plain(p.target, p.prompt, options);
    speculative_run = llama::generate_speculative(p.target, &p.draft, kind, p.prompt, options);
    if (!plain_first) plain_run = llama::generate_plain(p.target, p.prompt, options);
    state.SetIterationTime(speculative_run.seconds);
    plain.push_back(plain_run.seconds);
    speculative.push_back(speculative_run.seconds);
    if (temperature == 0.0) identical = identical && plain_run.tokens == speculative_run.tokens;
    const auto& s = speculative_run.statistics;
    total.steps += s.steps;
    total.drafted_tokens += s.drafted_tokens;
    total.accepted_tokens += s.accepted_tokens;
    total.emitted_tokens += s.emitted_tokens;
    total.beta_sum += s.beta_sum;
    total.beta_positions += s.beta_positions;
    total.target_calls += speculative_run.target.forward_passes;
  }
  if (!identical) state.SkipWithError("greedy speculative output differs from plain greedy output");
  const double tokens = static_cast<double>(p.new_tokens);
  state.counters["tokens_per_s"] = tokens / median(speculative);
  state.counters["plain_tokens_per_s"] = tokens / median(plain);
  state.counters["speedup"] = median(plain) / median(speculative);
  state.counters["tokens_per_call"] =
      static_cast<double>(total.emitted_tokens) / static_cast<double>(total.target_calls);
  state.counters["accepted_per_drafted"] = total.acceptance_rate();
  const double alpha = std::clamp(total.mean_beta(), 0.0, 1.0);
  if (total.beta_positions > 0) state.counters["alpha"] = alpha;
  const bool chain = kind == llama::drafter_kind::model || kind == llama::drafter_kind::ngram ||
                     kind == llama::drafter_kind::prompt_lookup;
  if (chain) {
    const bool model = kind == llama::drafter_kind::model;
    const double c = model ? p.costs.c() : 0.0;
    // The draft's cost as the loop pays it (its weights evicted by the target's pass).
    const double c_loop = model ? p.costs.c_in_loop() : 0.0;
    const double expected = specdec::expected_tokens_per_step(alpha, gamma);
    state.counters["c"] = c;
    state.counters["c_in_loop"] = c_loop;
    state.counters["batched_ratio"] = p.costs.batched_ratio();
    state.counters["predicted"] = expected / p.costs.step_cost(gamma, c);
    state.counters["predicted_from_tokens"] = total.tokens_per_step() / p.costs.step_cost(gamma, c);
    state.counters["predicted_in_loop"] = expected / p.costs.step_cost(gamma, c_loop);
  }
  state.SetLabel(std::string(llama::to_string(kind)) +
                 (temperature == 0.0 ? ", T = 0" : ", T = 1"));
}

// ---- verification rules: token level vs path level ---------------------------------------

// One run with the token-level rule (Algorithm 1 / recursive rejection) and one with the
// default path-level rule (block verification / traversal verification) per iteration, same
// seed, order alternating. The time is the path-level run's. Counters:
//   tokens_per_call, token_tokens_per_call   emitted tokens per target pass (path, token)
//   accepted_per_step, token_accepted_per_step
//   calls_ratio    token-rule target passes / path-rule target passes (above 1: fewer passes)
//   wall_ratio     median token-rule time / median path-rule time (above 1: faster)
void BM_Rule(benchmark::State& state, llama::drafter_kind kind, double temperature) {
  Pair& p = pair();
  llama::RunOptions options;
  options.sampling.temperature = temperature;
  options.max_new_tokens = p.new_tokens;
  options.gamma = gamma;
  std::vector<double> token_seconds, path_seconds;
  specdec::DecoderStatistics token_total, path_total;
  std::size_t token_calls = 0;
  std::size_t path_calls = 0;
  std::uint64_t seed = 1;
  const auto add = [](specdec::DecoderStatistics& total, const llama::RunResult& run) {
    total.steps += run.statistics.steps;
    total.accepted_tokens += run.statistics.accepted_tokens;
    total.emitted_tokens += run.statistics.emitted_tokens;
  };
  for (auto _ : state) {
    options.seed = seed++;
    const bool token_first = seed % 2 == 0;
    llama::RunResult token_run, path_run;
    options.verification = specdec::verification_rule::token;
    if (token_first)
      token_run = llama::generate_speculative(p.target, &p.draft, kind, p.prompt, options);
    options.verification = specdec::verification_rule::automatic;
    path_run = llama::generate_speculative(p.target, &p.draft, kind, p.prompt, options);
    options.verification = specdec::verification_rule::token;
    if (!token_first)
      token_run = llama::generate_speculative(p.target, &p.draft, kind, p.prompt, options);
    state.SetIterationTime(path_run.seconds);
    token_seconds.push_back(token_run.seconds);
    path_seconds.push_back(path_run.seconds);
    add(token_total, token_run);
    add(path_total, path_run);
    token_calls += token_run.target.forward_passes;
    path_calls += path_run.target.forward_passes;
  }
  const auto per = [](std::size_t a, std::size_t b) {
    return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b);
  };
  state.counters["tokens_per_call"] = per(path_total.emitted_tokens, path_calls);
  state.counters["token_tokens_per_call"] = per(token_total.emitted_tokens, token_calls);
  state.counters["accepted_per_step"] = per(path_total.accepted_tokens, path_total.steps);
  state.counters["token_accepted_per_step"] = per(token_total.accepted_tokens, token_total.steps);
  state.counters["calls_ratio"] = per(token_calls, path_calls);
  state.counters["wall_ratio"] = median(token_seconds) / median(path_seconds);
  state.SetLabel(
      std::string(llama::to_string(kind)) +
      (kind == llama::drafter_kind::tree ? ": traversal vs recursive" : ": block vs Algorithm 1") +
      ", T = " + (temperature == 1.0 ? "1" : "0.7"));
}

void register_benchmarks() {
  const std::size_t threads =
      env_threads() != 0 ? env_threads() : std::max(1U, std::thread::hardware_concurrency());
  for (const bool all_threads : {false, true}) {
    if (all_threads && threads == 1) continue;
    for (const bool of_target : {true, false}) {
      const std::string name = std::string(of_target ? "BM_Forward/target" : "BM_Forward/draft") +
                               "/t" + std::to_string(all_threads ? threads : 1);
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Forward, of_target, all_threads);
      for (const int width : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16}) b->Arg(width);
      b->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
  }
  for (const double temperature : {0.0, 1.0}) {
    for (const llama::drafter_kind kind :
         {llama::drafter_kind::model, llama::drafter_kind::ngram,
          llama::drafter_kind::prompt_lookup, llama::drafter_kind::tree,
          llama::drafter_kind::controller}) {
      const std::string name = "BM_Generate/" + std::string(llama::to_string(kind)) +
                               (temperature == 0.0 ? "/T0" : "/T1");
      benchmark::RegisterBenchmark(name.c_str(), BM_Generate, kind, temperature)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (const double temperature : {1.0, 0.7}) {
    for (const llama::drafter_kind kind : {llama::drafter_kind::model, llama::drafter_kind::tree}) {
      const std::string name =
          "BM_Rule/" + std::string(llama::to_string(kind)) + (temperature == 1.0 ? "/T1" : "/T0.7");
      benchmark::RegisterBenchmark(name.c_str(), BM_Rule, kind, temperature)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

[[maybe_unused]] const bool registered = (register_benchmarks(), true);

}  // namespace
