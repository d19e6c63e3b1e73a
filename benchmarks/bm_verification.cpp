// Cost of one verification step (Algorithm 1 and greedy) and of the residual draw, for float
// rows with V in {32k, 128k, 256k} and gamma in {1, 4, 8}, against two references measured
// in the same run:
//   BM_MemoryBaseline  reading the two rows a rejecting step must touch (p_gamma and
//                      q_gamma summed by a vectorized 16-lane float loop): the floor for
//                      any exact residual draw;
//   BM_NaiveStep       a straightforward implementation: normalise every row into doubles,
//                      accept with a division, build a std::discrete_distribution for the
//                      residual.
// The inputs make the stochastic step reject at position gamma deterministically (x_i with
// q_i(x_i) <= p_i(x_i) before it, then x_gamma with p(x_gamma) = 0), so every step does the
// gamma acceptance tests and one full residual draw over p_gamma and q_gamma; the
// accept-all variant instead draws the bonus token from p_{gamma+1}. Rows are LLM-like
// (Zipf over a random permutation per row, q a perturbed copy of p).
//
// Counters (times per step are CPU times of each benchmark's own loop):
//   vs_memory      step time / memory-baseline time (target: <= 2 at V = 128k, gamma = 8)
//   naive_speedup  naive-step time / step time      (target: >= 10 at V = 128k, gamma = 8)
//   greedy: vs_memory is relative to reading the gamma rows it must scan once each.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_sampling.hpp"

namespace {

using specdec::token_id;

constexpr std::size_t max_gamma = 8;

/// Rows for one vocabulary size: p_1..p_9 and q_1..q_8, and per position a token that is
/// accepted for sure (0 < q(x) <= p(x)), one rejected for sure (p(x) = 0 < q(x)), and the
/// target argmax (for greedy).
struct Fixture {
  std::size_t vocab_size = 0;
  std::vector<float> target;  // (max_gamma + 1) x V
  std::vector<float> draft;   // max_gamma x V
  std::array<token_id, max_gamma + 1> accepted{};
  std::array<token_id, max_gamma + 1> rejected{};
  std::array<token_id, max_gamma + 1> argmax{};

  explicit Fixture(std::size_t size) : vocab_size(size) {
    specdec::xoshiro256pp g(size);
    target.resize((max_gamma + 1) * size);
    draft.resize(max_gamma * size);
    std::vector<std::size_t> order(size);
    for (std::size_t i = 0; i <= max_gamma; ++i) {
      std::iota(order.begin(), order.end(), 0);
      for (std::size_t k = size - 1; k > 0; --k) {
        std::swap(order[k], order[specdec::uniform_below(g, k + 1)]);
      }
      std::vector<double> p(size);
      std::vector<double> q(size);
      for (std::size_t rank = 0; rank < size; ++rank) {
        p[order[rank]] = 1.0 / std::pow(static_cast<double>(rank + 1), 1.1);
      }
      for (std::size_t j = 0; j < size; ++j) {
        q[j] = p[j] * (0.75 + 0.5 * specdec::uniform01<double>(g));
      }
      for (std::size_t j = 5; j < size; j += 97) p[j] = 0.0;  // tokens the target rules out
      const double p_sum = std::accumulate(p.begin(), p.end(), 0.0);
      const double q_sum = std::accumulate(q.begin(), q.end(), 0.0);
      float* p_row = target.data() + i * size;
      for (std::size_t j = 0; j < size; ++j) p_row[j] = static_cast<float>(p[j] / p_sum);
      argmax[i] = specdec::argmax(std::span<const float>(p_row, size));
      if (i == max_gamma) break;
      float* q_row = draft.data() + i * size;
      for (std::size_t j = 0; j < size; ++j) q_row[j] = static_cast<float>(q[j] / q_sum);
      rejected[i] = 5;
      for (const std::size_t j : order) {  // most likely first
        if (q_row[j] > 0.0F && q_row[j] <= p_row[j]) {
          accepted[i] = static_cast<token_id>(j);
          break;
        }
      }
    }
  }

  [[nodiscard]] specdec::RowsView<const float> target_rows(std::size_t gamma) const {
    return {target.data(), gamma + 1, vocab_size};
  }
  [[nodiscard]] specdec::RowsView<const float> draft_rows(std::size_t gamma) const {
    return {draft.data(), gamma, vocab_size};
  }
  /// Drafts accepted up to position gamma - 1, rejected at position gamma.
  [[nodiscard]] std::vector<token_id> rejecting_drafts(std::size_t gamma) const {
    std::vector<token_id> drafts(accepted.begin(),
                                 accepted.begin() + static_cast<std::ptrdiff_t>(gamma));
    drafts.back() = rejected[gamma - 1];
    return drafts;
  }
  [[nodiscard]] std::vector<token_id> accepted_drafts(std::size_t gamma) const {
    return {accepted.begin(), accepted.begin() + static_cast<std::ptrdiff_t>(gamma)};
  }
  /// Greedy: argmax drafts, except a non-argmax at position gamma.
  [[nodiscard]] std::vector<token_id> greedy_drafts(std::size_t gamma) const {
    std::vector<token_id> drafts(argmax.begin(),
                                 argmax.begin() + static_cast<std::ptrdiff_t>(gamma));
    drafts.back() = rejected[gamma - 1];
    return drafts;
  }
};

const Fixture& fixture(std::size_t size) {
  static std::map<std::size_t, std::unique_ptr<Fixture>> fixtures;
  auto& slot = fixtures[size];
  if (!slot) slot = std::make_unique<Fixture>(size);
  return *slot;
}

/// CPU seconds of the calling thread (robust to other load on the machine).
double thread_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

/// Per-step CPU seconds of the reference benchmarks, recorded when they run (they are
/// registered first) and read by the benchmarks that report ratios.
std::map<std::string, double>& recorded_seconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

std::string key(const char* what, std::size_t size, std::size_t gamma) {
  return std::string(what) + "/" + std::to_string(size) + "/" + std::to_string(gamma);
}

/// Runs the benchmark loop around `step`, returning CPU seconds per iteration.
template <class Step>
double timed_loop(benchmark::State& state, Step&& step) {
  const double start = thread_seconds();
  for (auto _ : state) step();
  const double elapsed = thread_seconds() - start;
  return state.iterations() == 0 ? 0.0 : elapsed / static_cast<double>(state.iterations());
}

/// A reference's seconds per call: recorded by its own benchmark in this run, or measured
/// here (for at least 20 ms) if that benchmark was filtered out.
template <class Reference>
double reference_seconds(const std::string& name, Reference&& reference) {
  auto& seconds = recorded_seconds();
  if (const auto found = seconds.find(name); found != seconds.end()) return found->second;
  std::size_t calls = 0;
  const double start = thread_seconds();
  double elapsed = 0.0;
  while (elapsed < 0.02 || calls < 3) {
    reference();
    ++calls;
    elapsed = thread_seconds() - start;
  }
  return seconds[name] = elapsed / static_cast<double>(calls);
}

// ---------------------------------------------------------------------------------------
// References
// ---------------------------------------------------------------------------------------

/// Sum of a float row with 16 independent lanes (vectorized; as fast as reading it).
float row_sum(const float* row, std::size_t size) {
  std::array<float, 16> lanes{};
  std::size_t i = 0;
  for (; i + 16 <= size; i += 16) {
    for (std::size_t k = 0; k < 16; ++k) lanes[k] += row[i + k];
  }
  for (; i < size; ++i) lanes[0] += row[i];
  return std::accumulate(lanes.begin(), lanes.end(), 0.0F);
}

float memory_baseline(const Fixture& f, std::size_t gamma) {
  const std::size_t row = gamma - 1;
  return row_sum(f.target.data() + row * f.vocab_size, f.vocab_size) +
         row_sum(f.draft.data() + row * f.vocab_size, f.vocab_size);
}

/// The naive step: normalise every row into doubles, accept with a division, residual via
/// std::discrete_distribution.
template <class G>
specdec::VerificationResult naive_step(const Fixture& f, std::span<const token_id> drafts, G& g) {
  const std::size_t gamma = drafts.size();
  const std::size_t size = f.vocab_size;
  auto normalise = [size](const float* row) {
    std::vector<double> out(row, row + size);
    const double sum = std::accumulate(out.begin(), out.end(), 0.0);
    for (auto& value : out) value /= sum;
    return out;
  };
  std::vector<std::vector<double>> p;
  std::vector<std::vector<double>> q;
  for (std::size_t i = 0; i <= gamma; ++i) p.push_back(normalise(f.target.data() + i * size));
  for (std::size_t i = 0; i < gamma; ++i) q.push_back(normalise(f.draft.data() + i * size));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (std::size_t i = 0; i < gamma; ++i) {
    const auto x = static_cast<std::size_t>(drafts[i]);
    if (uniform(g) > p[i][x] / q[i][x]) {
      std::vector<double> residual(size);
      for (std::size_t j = 0; j < size; ++j) residual[j] = std::max(0.0, p[i][j] - q[i][j]);
      std::discrete_distribution<token_id> distribution(residual.begin(), residual.end());
      return {i, distribution(g), specdec::token_source::correction};
    }
  }
  std::discrete_distribution<token_id> bonus(p[gamma].begin(), p[gamma].end());
  return {gamma, bonus(g), specdec::token_source::bonus};
}

// ---------------------------------------------------------------------------------------
// Benchmarks
// ---------------------------------------------------------------------------------------

void set_common(benchmark::State& state, const Fixture& f) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  state.counters["V"] = static_cast<double>(f.vocab_size);
}

void BM_MemoryBaseline(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const double seconds =
      timed_loop(state, [&] { benchmark::DoNotOptimize(memory_baseline(f, gamma)); });
  recorded_seconds()[key("memory", f.vocab_size, gamma)] = seconds;
  set_common(state, f);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 *
                          static_cast<std::int64_t>(f.vocab_size * sizeof(float)));
}

void BM_NaiveStep(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.rejecting_drafts(gamma);
  std::mt19937_64 g(1);
  const double seconds =
      timed_loop(state, [&] { benchmark::DoNotOptimize(naive_step(f, drafts, g)); });
  recorded_seconds()[key("naive", f.vocab_size, gamma)] = seconds;
  set_common(state, f);
}

/// Sets vs_memory and naive_speedup from this benchmark's seconds per step.
void set_ratios(benchmark::State& state, const Fixture& f, std::size_t gamma, double seconds) {
  std::mt19937_64 g(2);
  const auto drafts = f.rejecting_drafts(gamma);
  const double memory = reference_seconds(key("memory", f.vocab_size, gamma), [&] {
    benchmark::DoNotOptimize(memory_baseline(f, gamma));
  });
  const double naive = reference_seconds(key("naive", f.vocab_size, gamma), [&] {
    benchmark::DoNotOptimize(naive_step(f, drafts, g));
  });
  if (seconds > 0.0) {
    state.counters["vs_memory"] = seconds / memory;
    state.counters["naive_speedup"] = naive / seconds;
  }
}

void BM_StochasticStep(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.rejecting_drafts(gamma);
  const auto draft_rows = f.draft_rows(gamma);
  const auto target_rows = f.target_rows(gamma);
  specdec::xoshiro256pp g(3);
  std::size_t accepted = 0;
  const double seconds = timed_loop(state, [&] {
    const auto result = specdec::verify_speculative(drafts, draft_rows, target_rows, g);
    accepted += result.accepted;
    benchmark::DoNotOptimize(result);
  });
  set_common(state, f);
  state.counters["accepted"] =
      benchmark::Counter(static_cast<double>(accepted), benchmark::Counter::kAvgIterations);
  set_ratios(state, f, gamma, seconds);
}

void BM_StochasticAcceptAll(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.accepted_drafts(gamma);
  const auto draft_rows = f.draft_rows(gamma);
  const auto target_rows = f.target_rows(gamma);
  specdec::xoshiro256pp g(4);
  const double seconds = timed_loop(state, [&] {
    benchmark::DoNotOptimize(specdec::verify_speculative(drafts, draft_rows, target_rows, g));
  });
  set_common(state, f);
  // The bonus draw reads one row: compare with half the two-row baseline.
  const double memory = reference_seconds(key("memory", f.vocab_size, gamma), [&] {
    benchmark::DoNotOptimize(memory_baseline(f, gamma));
  });
  if (seconds > 0.0) state.counters["vs_memory"] = seconds / (memory / 2);
}

void BM_ResidualDraw(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const std::size_t row = gamma - 1;
  const std::span<const float> p(f.target.data() + row * f.vocab_size, f.vocab_size);
  const std::span<const float> q(f.draft.data() + row * f.vocab_size, f.vocab_size);
  specdec::xoshiro256pp g(5);
  const double seconds =
      timed_loop(state, [&] { benchmark::DoNotOptimize(specdec::sample_residual(p, q, g)); });
  set_common(state, f);
  const double memory = reference_seconds(key("memory", f.vocab_size, gamma), [&] {
    benchmark::DoNotOptimize(memory_baseline(f, gamma));
  });
  if (seconds > 0.0) state.counters["vs_memory"] = seconds / memory;
}

void BM_GreedyStep(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.greedy_drafts(gamma);
  const auto target_rows = f.target_rows(gamma);
  const double seconds = timed_loop(
      state, [&] { benchmark::DoNotOptimize(specdec::verify_greedy(drafts, target_rows)); });
  set_common(state, f);
  // Greedy reads gamma - 1 accepted rows and the argmax of row gamma: compare with reading
  // gamma rows once (half the two-row baseline each), and with std::max_element per row.
  const double memory = reference_seconds(key("memory", f.vocab_size, gamma), [&] {
    benchmark::DoNotOptimize(memory_baseline(f, gamma));
  });
  const double naive = reference_seconds(key("naive_greedy", f.vocab_size, gamma), [&] {
    std::size_t total = 0;
    for (std::size_t i = 0; i < gamma; ++i) {
      const float* row = f.target.data() + i * f.vocab_size;
      total += static_cast<std::size_t>(std::max_element(row, row + f.vocab_size) - row);
    }
    benchmark::DoNotOptimize(total);
  });
  if (seconds > 0.0) {
    state.counters["vs_memory"] = seconds / (static_cast<double>(gamma) * memory / 2);
    state.counters["naive_speedup"] = naive / seconds;
  }
}

void vocabularies_and_gammas(benchmark::internal::Benchmark* benchmark) {
  for (const std::int64_t size : {32768, 131072, 262144}) {
    for (const std::int64_t gamma : {1, 4, 8}) benchmark->Args({size, gamma});
  }
  benchmark->ArgNames({"V", "gamma"});
}

}  // namespace

// The references first: the ratio counters of the later benchmarks read their times.
BENCHMARK(BM_MemoryBaseline)->Apply(vocabularies_and_gammas);
BENCHMARK(BM_NaiveStep)->Apply(vocabularies_and_gammas);
BENCHMARK(BM_StochasticStep)->Apply(vocabularies_and_gammas);
BENCHMARK(BM_StochasticAcceptAll)->Apply(vocabularies_and_gammas);
BENCHMARK(BM_ResidualDraw)->Apply(vocabularies_and_gammas);
BENCHMARK(BM_GreedyStep)->Apply(vocabularies_and_gammas);
