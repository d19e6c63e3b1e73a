// SpeculativeDecoder overhead per emitted token, excluding model time: the models return
// precomputed float rows (a batched target scoring gamma + 1 prefixes in one call, a draft
// returning one row per call), V = 32000 and 128000, gamma = 4, alpha about 0.8.
//
// Each iteration is one decoder.step() on a fixed context. Counters:
//   tokens_per_step  emitted tokens per step
//   ns_per_token     decoder time per emitted token (all of it is overhead: the models
//                    only return views of stored rows)
//   vs_row_read      decoder time per step / time of one streaming read (a sum) of the
//                    2 gamma + 1 rows the step is given, measured in the same run: the
//                    floor for any code that looks at every row once
//   allocs_per_step  heap allocations per step (global operator new is replaced by
//                    tests/support/counting_allocator.hpp, counted during the timed
//                    loop); must be 0
// Variants: sampling identity (T = 1), truncated (T = 0.7, top-k 50, top-p 0.9) and greedy;
// "novalidate" turns validate_rows and collect_beta off (the cheapest configuration).
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <span>
#include <vector>

#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "support/counting_allocator.hpp"

namespace {

using specdec::token_id;

constexpr std::size_t gamma = 4;
constexpr std::size_t distinct_rows = 8;  // positions cycle through this many row pairs

// Target rows p and draft rows q for `distinct_rows` positions, each stored twice in a
// row so that gamma + 1 consecutive positions are one contiguous block. p is a softmax of
// Gaussian logits; q perturbs the logits so that sum min(p, q) is about 0.8.
struct RowBank {
  std::size_t vocab = 0;
  std::vector<float> target;  // 2 * distinct_rows rows
  std::vector<float> draft;

  explicit RowBank(std::size_t vocab_size) : vocab(vocab_size) {
    target.resize(2 * distinct_rows * vocab);
    draft.resize(2 * distinct_rows * vocab);
    specdec::xoshiro256pp g(vocab);
    std::vector<double> logits(vocab);
    std::vector<double> perturbed(vocab);
    for (std::size_t r = 0; r < distinct_rows; ++r) {
      for (std::size_t j = 0; j < vocab; ++j) {
        const auto normal = [&g] {
          const double u1 = specdec::uniform01<double>(g);
          const double u2 = specdec::uniform01<double>(g);
          return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2);
        };
        logits[j] = 2.5 * normal();
        perturbed[j] = logits[j] + 0.35 * normal();
      }
      write_softmax(logits, r, target);
      write_softmax(perturbed, r, draft);
    }
  }

  void write_softmax(const std::vector<double>& logits, std::size_t r, std::vector<float>& bank) {
    const double maximum = *std::max_element(logits.begin(), logits.end());
    double total = 0.0;
    for (const double l : logits) total += std::exp(l - maximum);
    for (std::size_t j = 0; j < vocab; ++j) {
      const auto value = static_cast<float>(std::exp(logits[j] - maximum) / total);
      bank[r * vocab + j] = value;
      bank[(r + distinct_rows) * vocab + j] = value;
    }
  }

  [[nodiscard]] std::span<const float> row(const std::vector<float>& bank,
                                           std::size_t position) const {
    return {bank.data() + (position % distinct_rows) * vocab, vocab};
  }
};

const RowBank& bank(std::size_t vocab) {
  static std::map<std::size_t, std::unique_ptr<RowBank>> banks;
  auto& slot = banks[vocab];
  if (!slot) slot = std::make_unique<RowBank>(vocab);
  return *slot;
}

// The target: rows of the bank by position, all gamma + 1 prefixes in one call.
struct PrecomputedTarget {
  const RowBank* rows;
  [[nodiscard]] std::size_t vocab_size() const { return rows->vocab; }
  std::span<const float> next_token_probabilities(std::span<const token_id> context) {
    return rows->row(rows->target, context.size());
  }
  specdec::RowsView<const float> score_draft(std::span<const token_id> context,
                                             std::span<const token_id> draft) {
    return {rows->row(rows->target, context.size()).data(), draft.size() + 1, rows->vocab};
  }
};

struct PrecomputedDraft {
  const RowBank* rows;
  [[nodiscard]] std::size_t vocab_size() const { return rows->vocab; }
  std::span<const float> next_token_probabilities(std::span<const token_id> context) {
    return rows->row(rows->draft, context.size());
  }
};

// Seconds for one streaming read (a vectorized sum) of the 2 gamma + 1 rows a step is
// given: the fastest of several repetitions.
double row_read_seconds(const RowBank& rows) {
  const auto sum = [](std::span<const float> values) {
    return Eigen::Map<const Eigen::ArrayXf>(values.data(), static_cast<Eigen::Index>(values.size()))
        .sum();
  };
  double best = 1e9;
  for (int repetition = 0; repetition < 9; ++repetition) {
    const auto start = std::chrono::steady_clock::now();
    float total = 0.0F;
    for (std::size_t i = 0; i < gamma; ++i) total += sum(rows.row(rows.draft, i));
    total += sum({rows.row(rows.target, 0).data(), (gamma + 1) * rows.vocab});
    benchmark::DoNotOptimize(total);
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

enum class mode { identity, truncated, greedy };

void BM_DecoderStep(benchmark::State& state) {
  const auto vocab = static_cast<std::size_t>(state.range(0));
  const auto sampling_mode = static_cast<mode>(state.range(1));
  const bool checks = state.range(2) != 0;
  const RowBank& rows = bank(vocab);
  PrecomputedTarget target{&rows};
  PrecomputedDraft draft{&rows};
  specdec::DecoderOptions options;
  options.gamma_policy = specdec::FixedGamma(gamma);
  options.validate_rows = checks;
  options.collect_beta = checks;
  if (sampling_mode == mode::truncated)
    options.sampling = {.temperature = 0.7, .top_k = 50, .top_p = 0.9};
  if (sampling_mode == mode::greedy) options.sampling = {.temperature = 0.0};
  specdec::SpeculativeDecoder decoder(target, draft, options);
  const std::vector<token_id> context(128, 1);
  decoder.reserve(context.size());
  specdec::xoshiro256pp g(7);
  (void)decoder.step(context, g);  // warm up the workspace

  const double read_seconds = row_read_seconds(rows);
  std::size_t tokens = 0;
  std::size_t steps = 0;
  specdec::testing::AllocationCounter counter;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    const auto result = decoder.step(context, g);
    tokens += result.tokens.size();
    ++steps;
    benchmark::DoNotOptimize(result.tokens.data());
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::size_t allocations = counter.stop();
  state.SetItemsProcessed(static_cast<std::int64_t>(tokens));
  const auto step_count = static_cast<double>(steps);
  state.counters["tokens_per_step"] = static_cast<double>(tokens) / step_count;
  state.counters["ns_per_token"] = 1e9 * elapsed / static_cast<double>(tokens);
  state.counters["vs_row_read"] = elapsed / step_count / read_seconds;
  state.counters["allocs_per_step"] = static_cast<double>(allocations) / step_count;
  state.counters["acceptance"] = decoder.statistics().acceptance_rate();
}

void decoder_arguments(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"V", "mode", "checks"});
  for (const std::int64_t vocab : {32000, 128000}) {
    for (const std::int64_t sampling : {0, 1, 2}) {
      for (const std::int64_t checks : {1, 0}) benchmark->Args({vocab, sampling, checks});
    }
  }
}

BENCHMARK(BM_DecoderStep)->Apply(decoder_arguments)->Unit(benchmark::kMicrosecond);

}  // namespace
