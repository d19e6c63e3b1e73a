// Cost of one verification step (Algorithm 1, block verification and greedy) and of the
// residual draw, for float rows with V in {32k, 128k, 256k} and gamma in {1, 4, 8}, the
// rows either in cache or evicted to DRAM before each timed call, against two references
// timed interleaved with the step in the same loop (baseline.hpp), on the same statistic,
// the median of thread CPU time:
//   the pure read   an integer OR over exactly the rows the step must touch (the physical
//                   limit of any exact implementation);
//   the peer        Algorithm 1 as vLLM, Hugging Face and FlashInfer structure it, written
//                   by a competent C++ engineer (peer.hpp): ratios at the draft tokens, one
//                   residual pass into a preallocated buffer at the first rejection, an
//                   inverse-CDF draw over block masses; greedy as std::max_element per row.
// The inputs make the stochastic step reject at position gamma deterministically (x_i with
// q_i(x_i) <= p_i(x_i) before it, then x_gamma with p(x_gamma) = 0), so every step does the
// gamma acceptance tests and one full residual draw over p_gamma and q_gamma (2 rows); the
// accept-all variant instead draws the bonus token from p_{gamma+1} (1 row); greedy accepts
// gamma - 1 argmax drafts and rejects the last one (gamma rows). Rows are LLM-like (Zipf
// over a random permutation per row, q a perturbed copy of p).
//
// The time reported is the step's (median per call). Counters:
//   vs_read      step / pure read of the rows it must touch
//   vs_peer      peer / step (above 1: specdec is faster); for BM_BlockStep the "peer" is
//                Algorithm 1 (verify_speculative) on the same inputs
//   read_GBps    bandwidth of the pure read
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "baseline.hpp"
#include "peer.hpp"
#include "specdec/block_verification.hpp"
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

using specdec::baseline::residence;

/// Times `step`, the pure read of `rows` and `peer` interleaved (baseline::interleave) and
/// adds V and the read's bandwidth to the counters.
template <class Step, class Peer>
void interleaved(benchmark::State& state, const Fixture& f,
                 std::vector<std::span<const float>> rows, Step&& step, Peer&& peer) {
  namespace bl = specdec::baseline;
  const auto where = static_cast<residence>(state.range(2));
  const auto read = [&] { benchmark::DoNotOptimize(bl::read_rows(rows)); };
  const std::size_t repetitions = where == residence::cache ? bl::calibrate(read) : 1;
  const bl::Medians medians = bl::interleave(state, where, repetitions, step, read, peer);
  std::size_t bytes = 0;
  for (const auto row : rows) bytes += row.size_bytes();
  state.counters["V"] = static_cast<double>(f.vocab_size);
  if (medians.read > 0.0) {
    state.counters["read_GBps"] = static_cast<double>(bytes) / medians.read / 1e9;
  }
}

std::span<const float> target_row(const Fixture& f, std::size_t i) {
  return {f.target.data() + i * f.vocab_size, f.vocab_size};
}
std::span<const float> draft_row(const Fixture& f, std::size_t i) {
  return {f.draft.data() + i * f.vocab_size, f.vocab_size};
}

// ---------------------------------------------------------------------------------------
// Benchmarks
// ---------------------------------------------------------------------------------------

void BM_StochasticStep(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.rejecting_drafts(gamma);
  const auto draft_rows = f.draft_rows(gamma);
  const auto target_rows = f.target_rows(gamma);
  specdec::xoshiro256pp g(3);
  specdec::xoshiro256pp peer_g(3);
  specdec::peer::Algorithm1 peer(f.vocab_size);
  std::size_t accepted = 0;
  std::size_t calls = 0;
  interleaved(
      state, f, {target_row(f, gamma - 1), draft_row(f, gamma - 1)},
      [&] {
        const auto result = specdec::verify_speculative(drafts, draft_rows, target_rows, g);
        accepted += result.accepted;
        ++calls;
        benchmark::DoNotOptimize(result);
      },
      [&] { benchmark::DoNotOptimize(peer.verify(drafts, draft_rows, target_rows, peer_g)); });
  state.counters["accepted"] = static_cast<double>(accepted) / static_cast<double>(calls);
}

// Block verification (block_verification.hpp) on the same rejecting drafts: rho stays 1
// up to position gamma - 1 and drops to 0 at x_gamma (p = 0), so the scan reads no row at
// gamma, accepts n = gamma - 1 with h = 1, and builds the one mass table of p_gamma and
// q_gamma that gives Z and the residual's draw: the same two rows Algorithm 1 reads. The
// peer slot runs Algorithm 1 (verify_speculative) on the same inputs, so vs_peer is
// token rule / block rule.
void BM_BlockStep(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.rejecting_drafts(gamma);
  const auto draft_rows = f.draft_rows(gamma);
  const auto target_rows = f.target_rows(gamma);
  specdec::xoshiro256pp g(6);
  specdec::xoshiro256pp token_g(6);
  std::size_t accepted = 0;
  std::size_t calls = 0;
  interleaved(
      state, f, {target_row(f, gamma - 1), draft_row(f, gamma - 1)},
      [&] {
        const auto result = specdec::verify_block(drafts, draft_rows, target_rows, g);
        accepted += result.accepted;
        ++calls;
        benchmark::DoNotOptimize(result);
      },
      [&] {
        benchmark::DoNotOptimize(
            specdec::verify_speculative(drafts, draft_rows, target_rows, token_g));
      });
  state.counters["accepted"] = static_cast<double>(accepted) / static_cast<double>(calls);
}

void BM_StochasticAcceptAll(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.accepted_drafts(gamma);
  const auto draft_rows = f.draft_rows(gamma);
  const auto target_rows = f.target_rows(gamma);
  specdec::xoshiro256pp g(4);
  specdec::xoshiro256pp peer_g(4);
  specdec::peer::Algorithm1 peer(f.vocab_size);
  interleaved(
      state, f, {target_row(f, gamma)},
      [&] {
        benchmark::DoNotOptimize(specdec::verify_speculative(drafts, draft_rows, target_rows, g));
      },
      [&] { benchmark::DoNotOptimize(peer.verify(drafts, draft_rows, target_rows, peer_g)); });
}

void BM_ResidualDraw(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const std::size_t row = gamma - 1;
  const std::span<const float> p = target_row(f, row);
  const std::span<const float> q = draft_row(f, row);
  // The peer's residual draw: its step rejecting at once on these two rows.
  const std::vector<token_id> rejected{f.rejected[row]};
  const specdec::RowsView<const float> p_rows(f.target.data() + row * f.vocab_size, 2,
                                              f.vocab_size);
  const specdec::RowsView<const float> q_rows(q.data(), 1, f.vocab_size);
  specdec::xoshiro256pp g(5);
  specdec::xoshiro256pp peer_g(5);
  specdec::peer::Algorithm1 peer(f.vocab_size);
  interleaved(
      state, f, {p, q}, [&] { benchmark::DoNotOptimize(specdec::sample_residual(p, q, g)); },
      [&] { benchmark::DoNotOptimize(peer.verify(rejected, q_rows, p_rows, peer_g)); });
}

void BM_GreedyStep(benchmark::State& state) {
  const auto& f = fixture(static_cast<std::size_t>(state.range(0)));
  const auto gamma = static_cast<std::size_t>(state.range(1));
  const auto drafts = f.greedy_drafts(gamma);
  const auto target_rows = f.target_rows(gamma);
  const specdec::peer::Algorithm1 peer(f.vocab_size);
  std::vector<std::span<const float>> rows;
  for (std::size_t i = 0; i < gamma; ++i) rows.push_back(target_row(f, i));
  interleaved(
      state, f, rows,
      [&] { benchmark::DoNotOptimize(specdec::verify_greedy(drafts, target_rows)); },
      [&] { benchmark::DoNotOptimize(peer.verify_greedy(drafts, target_rows)); });
}

// Rows in cache: Google Benchmark picks the iteration count. Rows in DRAM: every sample
// first streams 64 MiB through the caches (milliseconds), so a fixed number of samples per
// benchmark, whatever --benchmark_min_time says: baseline::dram_samples() (31, or
// SPECDEC_DRAM_SAMPLES; scripts/test.sh's smoke run takes 3).
template <std::int64_t Where>
void arguments(benchmark::internal::Benchmark* benchmark) {
  for (const std::int64_t size : {32768, 131072, 262144}) {
    for (const std::int64_t gamma : {1, 4, 8}) benchmark->Args({size, gamma, Where});
  }
  benchmark->ArgNames({"V", "gamma", "dram"})->UseManualTime()->Unit(benchmark::kMicrosecond);
  if (Where == 1) benchmark->Iterations(specdec::baseline::dram_samples());
}

}  // namespace

BENCHMARK(BM_StochasticStep)->Apply(arguments<0>);
BENCHMARK(BM_StochasticStep)->Apply(arguments<1>);
BENCHMARK(BM_BlockStep)->Apply(arguments<0>);
BENCHMARK(BM_BlockStep)->Apply(arguments<1>);
BENCHMARK(BM_StochasticAcceptAll)->Apply(arguments<0>);
BENCHMARK(BM_StochasticAcceptAll)->Apply(arguments<1>);
BENCHMARK(BM_ResidualDraw)->Apply(arguments<0>);
BENCHMARK(BM_ResidualDraw)->Apply(arguments<1>);
BENCHMARK(BM_GreedyStep)->Apply(arguments<0>);
BENCHMARK(BM_GreedyStep)->Apply(arguments<1>);
