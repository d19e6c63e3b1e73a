// Many sequences at once on a real transformer: the shipped llama pair (examples/llama/models)
// in lane engines (one KV cache region per sequence), decoded by specdec::BatchDecoder.
//
// BM_BatchDecode/<B>: B sequences of 32 new tokens each at T = 1 after a fixed prompt, every
//   sequence its own random stream, decoded to completion by each of these, one after the
//   other in every iteration, starting from a different one each time (so their ratios are
//   measured in the same run, interleaved):
//     plain      one target pass over the B positions per token (drafts: none); run twice
//                by two decoders, plain and plain_again, whose ratio is the noise floor
//     g1 .. g8   speculative, a fixed gamma for every sequence, drafts from the draft model
//                in one batched draft pass per draft position
//     planner    speculative, gamma per sequence chosen each step by BatchGammaPlanner from
//                each sequence's measured acceptance and the measured wall time of target
//                passes as a function of the positions they score (its decoder lives across
//                iterations, as a server's would: it keeps learning)
//   The time is the planner's. Counters (medians over iterations):
//     <mode>_tok_s        generated tokens per second of each mode
//     best_fixed_gamma    the fixed mode with the most tokens/s (0: plain)
//     planner_vs_best     planner tokens/s / the best fixed mode's (plain included)
//     planner_gamma       drafts per sequence step the planner chose (mean)
//     best_vs_plain       the best fixed mode's tokens/s / plain's
//     plain_aa            plain_again / plain: the same mode twice (an A/A check)
// Threads: the engines' matrix products run on LLAMA_THREADS threads (default: one per
// hardware thread); verification on the decoder's calling thread.
// Run it with --benchmark_min_time=<seconds> for more iterations; scripts/test.sh smoke-runs
// it with one.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "llama/engine.hpp"
#include "llama/generate.hpp"
#include "specdec/batch_decoder.hpp"
#include "specdec/sampling.hpp"

namespace {

using specdec::token_id;
using clock_type = std::chrono::steady_clock;

constexpr std::size_t new_tokens = 32;
constexpr std::size_t max_batch = 32;
constexpr std::size_t fixed_gammas[] = {1, 2, 4, 8};

const char* const prompt_text = llama::stack_prompt;

std::size_t env_threads() {
  const char* t = std::getenv("LLAMA_THREADS");
  return t != nullptr ? std::strtoul(t, nullptr, 10) : 0;
}

/// No drafts: the batch decoder then scores one position per sequence and samples from p.
struct NoDrafts {
  std::size_t propose(std::span<const token_id> /*context*/, std::span<token_id> /*out*/) const {
    return 0;
  }
};

using Logits = specdec::LogitsModel<llama::Engine>;
using PlainDecoder = specdec::BatchDecoder<Logits, NoDrafts>;
using SpeculativeDecoder = specdec::BatchDecoder<Logits, Logits>;

struct Setup {
  llama::ThreadPool pool{env_threads()};
  llama::Model target_model{std::string(SPECDEC_LLAMA_MODELS) + "/target.gguf"};
  llama::Model draft_model{std::string(SPECDEC_LLAMA_MODELS) + "/draft.gguf"};
  std::vector<token_id> prompt = target_model.tokenizer().encode(prompt_text);
  std::size_t capacity = prompt.size() + new_tokens + 16;
  llama::Engine target_engine{target_model, capacity, &pool, max_batch};
  llama::Engine draft_engine{draft_model, capacity, &pool, max_batch};
  Logits target{target_engine};
  Logits draft{draft_engine};
  NoDrafts none;

  Setup() { llama::check_pair(target_model, draft_model); }
};

Setup& setup() {
  static Setup instance;
  return instance;
}

struct Outcome {
  double seconds = 0.0;
  std::size_t steps = 0;    // sequence steps
  std::size_t drafted = 0;  // drafts verified
};

// Decodes `batch` sequences to completion with `decoder` (ids from `next_id`, seed `seed`).
template <class Decoder>
Outcome decode(Decoder& decoder, std::size_t batch, std::uint64_t& next_id, std::uint64_t seed,
               std::size_t gamma) {
  Setup& s = setup();
  for (std::size_t b = 0; b < batch; ++b) {
    specdec::SequenceRequest request;
    request.id = next_id++;
    request.prompt = s.prompt;
    request.max_new_tokens = new_tokens;
    request.seed = seed;
    request.gamma_policy = specdec::FixedGamma(std::max<std::size_t>(gamma, 1));
    decoder.add(std::move(request));
  }
  Outcome outcome;
  const auto start = clock_type::now();
  decoder.run();
  outcome.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  for (const auto& done : decoder.take_finished()) {
    if (done.end == specdec::sequence_end::failed) std::rethrow_exception(done.error);
    outcome.steps += done.steps;
    outcome.drafted += done.drafted;
  }
  return outcome;
}

using llama::median;

void BM_BatchDecode(benchmark::State& state) {
  Setup& s = setup();
  const auto batch = static_cast<std::size_t>(state.range(0));
  PlainDecoder plain(s.target, s.none, {.threads = 1});
  PlainDecoder plain_again(s.target, s.none, {.threads = 1});
  std::vector<std::unique_ptr<SpeculativeDecoder>> fixed;
  for (std::size_t i = 0; i < std::size(fixed_gammas); ++i) {
    fixed.push_back(std::make_unique<SpeculativeDecoder>(
        s.target, s.draft, specdec::BatchDecoderOptions{.threads = 1}));
  }
  SpeculativeDecoder planner(
      s.target, s.draft, {.threads = 1, .batch_gamma = specdec::BatchGammaOptions{.max_gamma = 8}});
  // plain, fixed gammas, planner, plain_again
  std::vector<std::vector<double>> rates(std::size(fixed_gammas) + 3);
  std::size_t planner_steps = 0;
  std::size_t planner_drafted = 0;
  std::uint64_t id = 0;
  std::uint64_t seed = 1;
  const double tokens = static_cast<double>(batch * new_tokens);
  // One untimed round: caches warm, the planner's first (exploring) steps behind it.
  (void)decode(planner, batch, id, seed++, 0);
  const std::size_t modes = rates.size();
  std::size_t iteration = 0;
  for (auto _ : state) {
    // Every mode once, starting from a different one each iteration (no mode always runs
    // first, after the same neighbour).
    for (std::size_t k = 0; k < modes; ++k) {
      const std::size_t mode = (k + iteration) % modes;
      if (mode == 0) {
        rates[0].push_back(tokens / decode(plain, batch, id, seed, 0).seconds);
      } else if (mode == modes - 1) {
        rates[mode].push_back(tokens / decode(plain_again, batch, id, seed, 0).seconds);
      } else if (mode < modes - 2) {
        rates[mode].push_back(
            tokens / decode(*fixed[mode - 1], batch, id, seed, fixed_gammas[mode - 1]).seconds);
      } else {
        const Outcome planned = decode(planner, batch, id, seed, 0);
        state.SetIterationTime(planned.seconds);
        rates[mode].push_back(tokens / planned.seconds);
        planner_steps += planned.steps;
        planner_drafted += planned.drafted;
      }
    }
    ++seed;
    ++iteration;
  }
  std::vector<double> medians;
  for (const auto& r : rates) medians.push_back(median(r));
  state.counters["plain_tok_s"] = medians[0];
  std::size_t best = 0;
  for (std::size_t i = 0; i < std::size(fixed_gammas); ++i) {
    state.counters["g" + std::to_string(fixed_gammas[i]) + "_tok_s"] = medians[i + 1];
    if (medians[i + 1] > medians[best]) best = i + 1;
  }
  const double planner_rate = medians[modes - 2];
  state.counters["planner_tok_s"] = planner_rate;
  state.counters["plain_aa"] = medians[modes - 1] / medians[0];
  state.counters["best_fixed_gamma"] =
      best == 0 ? 0.0 : static_cast<double>(fixed_gammas[best - 1]);
  state.counters["planner_vs_best"] = planner_rate / medians[best];
  state.counters["best_vs_plain"] = medians[best] / medians[0];
  state.counters["planner_gamma"] = static_cast<double>(planner_drafted) /
                                    static_cast<double>(std::max<std::size_t>(planner_steps, 1));
  state.SetLabel(std::to_string(batch) + " sequences, " + std::to_string(s.pool.size()) +
                 " threads");
}

BENCHMARK(BM_BatchDecode)
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Arg(32)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
