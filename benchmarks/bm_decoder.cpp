// SpeculativeDecoder overhead per step, excluding model time: the models return
// precomputed float rows (a batched target scoring gamma + 1 prefixes in one call, a draft
// returning one row per call), V = 32000 and 128000, gamma = 4, alpha about 0.8 at T = 1
// (BM_DecoderVsPeer: V up to 256000, gamma 1, 4 and 8).
//
// Each iteration times, interleaved and in a rotating order (baseline.hpp), on thread CPU
// time: one decoder.step() on a fixed context; the pure read of the 2 gamma + 1 rows the
// step is given (an integer OR over their bits: the floor for any code that looks at every
// row once); and the fair peer's step (peer.hpp: gamma draws from the draft rows, then
// Algorithm 1 as vLLM and Hugging Face structure it, no checks; truncated mode: every row
// first truncated into a dense row as they do it; a draft without stable_rows: each draft
// row copied after its draw, as they stack the draft's probabilities, since its view dies at
// the next draft call for the peer as for the decoder). The rows
// are either in cache or evicted to DRAM before each timed call. The time reported is the
// decoder step's median. Counters:
//   tokens_per_step  emitted tokens per step
//   vs_read          decoder step / pure read of its rows (medians)
//   vs_peer          peer step / decoder step (above 1: specdec is faster)
//   vs_peer_per_token  the same per emitted token (peer time / peer tokens over step time /
//                    step tokens): block verification emits more tokens per step
//   allocs_per_step  heap allocations per decoder step (global operator new is replaced by
//                    tests/support/counting_allocator.hpp); must be 0
//   read_us, read_GBps  the pure read's median time and the rate it read the rows at
// The context (printed before the results) names the CPU and the best kernel path.
// Variants (mode): 0 sampling identity (T = 1), 1 truncated (T = 0.7, top-k 50, top-p 0.9),
// 3 top-p alone (T = 1, top-p 0.9), 4 tempered top-p (T = 0.7, top-p 0.9; the peer sorts
// the whole row, as Hugging Face and vLLM do for top-p) and 2 greedy
// (the draft's argmax differs from the target's at the fourth position: 3 drafts accepted
// and a correction every step); "checks 0" turns validate_rows and collect_beta off (the
// cheapest configuration; the peer never checks). "kernels 1" runs the best kernel path the
// CPU has (kernel_path.hpp: AVX-512, else AVX2, where present), "kernels 0" forces the
// portable kernels, "kernels 2" the AVX2 kernels (run where the best path is AVX-512).
// "stable 1" (T = 1 only): the draft declares stable_rows (concepts.hpp), so the decoder
// reads its rows in place instead of copying each into its workspace.
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "baseline.hpp"
#include "peer.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/kernel_path.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "support/counting_allocator.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::token_id;

constexpr std::size_t default_gamma = 4;  // BM_DecoderStep's draft length

// The host in the benchmark's context: the CPU's model name (Linux's /proc/cpuinfo, where
// there is one) and the kernel path kernels:1 runs.
[[maybe_unused]] const bool host_context = [] {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const std::size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) {
        benchmark::AddCustomContext("cpu_model", line.substr(colon + 2));
      }
      break;
    }
  }
  benchmark::AddCustomContext("kernel_path",
                              std::string(specdec::to_string(specdec::best_kernel_path())));
  return true;
}();

// Target rows p and draft rows q for `distinct` positions (8, or gamma for BM_DecoderScaling),
// each stored twice in a row so that gamma + 1 consecutive positions are one contiguous block. p is
// a softmax of Gaussian logits; q perturbs the logits so that sum min(p, q) is about 0.8.
struct RowBank {
  std::size_t vocab = 0;
  std::size_t distinct_rows = 8;  // positions cycle through this many row pairs
  std::vector<float> target;      // 2 * distinct_rows rows
  std::vector<float> draft;

  explicit RowBank(std::size_t vocab_size, std::size_t distinct = 8)
      : vocab(vocab_size), distinct_rows(distinct) {
    target.resize(2 * distinct_rows * vocab);
    draft.resize(2 * distinct_rows * vocab);
    specdec::xoshiro256pp g(vocab);
    std::vector<double> logits(vocab);
    std::vector<double> perturbed(vocab);
    for (std::size_t r = 0; r < distinct_rows; ++r) {
      for (std::size_t j = 0; j < vocab; ++j) {
        logits[j] = 2.5 * specdec::testing::standard_normal(g);
        perturbed[j] = logits[j] + 0.35 * specdec::testing::standard_normal(g);
      }
      // Greedy drafts agree with the target's argmax except at position 3 (mod 8), where
      // the draft's argmax is the target's second choice.
      const auto top =
          static_cast<std::size_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      const double draft_top = *std::max_element(perturbed.begin(), perturbed.end());
      perturbed[top] = draft_top + 1.0;
      if (r == 3) {
        std::size_t second = top == 0 ? 1 : 0;
        for (std::size_t j = 0; j < vocab; ++j) {
          if (j != top && logits[j] > logits[second]) second = j;
        }
        perturbed[second] = draft_top + 2.0;
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

const RowBank& bank(std::size_t vocab, std::size_t distinct = 8) {
  static std::map<std::pair<std::size_t, std::size_t>, std::unique_ptr<RowBank>> banks;
  auto& slot = banks[{vocab, distinct}];
  if (!slot) slot = std::make_unique<RowBank>(vocab, distinct);
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

// The same draft declaring stable_rows (concepts.hpp): its rows are rows of the bank, valid
// through the step, so the decoder reads them in place at T = 1 instead of copying them.
struct StableDraft : PrecomputedDraft {
  static constexpr bool stable_rows = true;
};

enum class mode { identity, truncated, greedy, top_p, tempered_top_p };

// The peer's step over the same rows: gamma draft tokens drawn from (or, greedy, the
// argmax of) q rows, then its Algorithm 1. Returns the emitted token count.
// With truncation (the truncated mode), every row is first truncated into a dense buffer
// (peer::Truncation), as vLLM and Hugging Face do before their rejection samplers.
// With `copy_drafts` (a draft whose rows are not stable_rows: the row a draft call returns
// dies at its next call, the contract the decoder works under), the peer keeps each draft row
// it will verify against by copying it after its draw, as vLLM and Hugging Face stack the
// draft's probabilities into a (gamma, V) tensor; a truncated row is already kept in
// q_dense, and greedy verification needs no draft row.
struct PeerStep {
  const RowBank* rows;
  std::size_t gamma;
  specdec::peer::Algorithm1 algorithm;
  std::vector<token_id> drafts;
  std::unique_ptr<specdec::peer::Truncation> truncation{};
  std::vector<float> q_dense{};
  std::vector<float> p_dense{};
  bool copy_drafts = false;
  std::size_t operator()(std::size_t position, bool greedy, specdec::xoshiro256pp& g) {
    drafts.clear();
    const std::size_t vocab = rows->vocab;
    const bool copying = copy_drafts && !truncation && !greedy;
    for (std::size_t i = 0; i < gamma; ++i) {
      const float* q = rows->row(rows->draft, position + i).data();
      if (truncation) {
        truncation->apply(q, q_dense.data() + i * vocab);
        q = q_dense.data() + i * vocab;
      }
      drafts.push_back(greedy ? static_cast<token_id>(std::max_element(q, q + vocab) - q)
                              : algorithm.draw(q, g));
      if (copying) std::memcpy(q_dense.data() + i * vocab, q, vocab * sizeof(float));
    }
    const float* p_rows = rows->row(rows->target, position).data();
    const float* q_rows = copying ? q_dense.data() : rows->row(rows->draft, position).data();
    if (truncation) {
      for (std::size_t i = 0; i <= gamma; ++i) {
        truncation->apply(p_rows + i * vocab, p_dense.data() + i * vocab);
      }
      p_rows = p_dense.data();
      q_rows = q_dense.data();
    }
    const specdec::RowsView<const float> p(p_rows, gamma + 1, vocab);
    const specdec::RowsView<const float> q(q_rows, gamma, vocab);
    const auto verdict =
        greedy ? algorithm.verify_greedy(drafts, p) : algorithm.verify(drafts, q, p, g);
    return verdict.accepted + 1;
  }
};

// One configuration of the step: V, sampling, checks, where the rows are, kernel path
// (0: the portable kernels forced; 1: the best path this CPU has, kernel_path.hpp; 2: the
// AVX2 kernels forced) and gamma.
struct StepSetup {
  std::size_t vocab;
  mode sampling_mode;
  bool checks;
  specdec::baseline::residence where;
  std::int64_t kernels;
  std::size_t gamma;
};

template <class Draft>
void decoder_step(benchmark::State& state, const StepSetup& setup) {
  namespace bl = specdec::baseline;
  const std::size_t vocab = setup.vocab;
  const mode sampling_mode = setup.sampling_mode;
  const bool checks = setup.checks;
  const bl::residence where = setup.where;
  const std::size_t gamma = setup.gamma;
  if (setup.kernels == 0) specdec::force_kernel_path(specdec::kernel_path::portable);
  if (setup.kernels == 2) specdec::force_kernel_path(specdec::kernel_path::avx2);
  const RowBank& rows = bank(vocab, std::max<std::size_t>(8, gamma));
  PrecomputedTarget target{&rows};
  Draft draft{{&rows}};
  specdec::DecoderOptions options;
  options.gamma_policy = specdec::FixedGamma(gamma);
  options.validate_rows = checks;
  options.collect_beta = checks;
  if (sampling_mode == mode::truncated)
    options.sampling = {.temperature = 0.7, .top_k = 50, .top_p = 0.9};
  if (sampling_mode == mode::greedy) options.sampling = {.temperature = 0.0};
  if (sampling_mode == mode::top_p) options.sampling = {.temperature = 1.0, .top_p = 0.9};
  if (sampling_mode == mode::tempered_top_p) options.sampling = {.temperature = 0.7, .top_p = 0.9};
  const bool truncating = sampling_mode == mode::truncated || sampling_mode == mode::top_p ||
                          sampling_mode == mode::tempered_top_p;
  specdec::SpeculativeDecoder decoder(target, draft, options);
  const std::vector<token_id> context(128, 1);
  decoder.reserve(context.size());
  specdec::xoshiro256pp g(7);
  specdec::xoshiro256pp peer_g(7);
  PeerStep peer{&rows, gamma, specdec::peer::Algorithm1(vocab), {}};
  peer.drafts.reserve(gamma);
  if (truncating) {
    peer.truncation = std::make_unique<specdec::peer::Truncation>(
        vocab, options.sampling.temperature, options.sampling.top_k, options.sampling.top_p);
    peer.q_dense.resize(gamma * vocab);
    peer.p_dense.resize((gamma + 1) * vocab);
  }
  if (!specdec::stable_rows<Draft>) {
    peer.copy_drafts = true;
    peer.q_dense.resize(gamma * vocab);
  }
  (void)decoder.step(context, g);  // warm up the workspace

  // The rows the step is given: gamma draft rows, the target's gamma + 1.
  std::vector<std::span<const float>> given;
  for (std::size_t i = 0; i < gamma; ++i) given.push_back(rows.row(rows.draft, context.size() + i));
  given.emplace_back(rows.row(rows.target, context.size()).data(), (gamma + 1) * vocab);

  std::size_t tokens = 0;
  std::size_t steps = 0;
  std::size_t peer_tokens = 0;
  std::size_t peer_steps = 0;
  std::size_t allocations = 0;
  const auto step = [&] {
    const std::size_t before = specdec::testing::allocation_count;
    const auto result = decoder.step(context, g);
    allocations += specdec::testing::allocation_count - before;
    tokens += result.tokens.size();
    ++steps;
    benchmark::DoNotOptimize(result.tokens.data());
  };
  const auto read = [&] { benchmark::DoNotOptimize(bl::read_rows(given)); };
  const auto peer_step = [&] {
    peer_tokens += peer(context.size(), sampling_mode == mode::greedy, peer_g);
    ++peer_steps;
  };
  specdec::testing::AllocationCounter counter;
  const bl::Medians medians = bl::interleave(state, where, 1, step, read, peer_step, true);
  (void)counter.stop();
  const auto step_count = static_cast<double>(steps);
  const double tokens_per_step = static_cast<double>(tokens) / step_count;
  const double peer_tokens_per_step =
      static_cast<double>(peer_tokens) / static_cast<double>(peer_steps);
  state.counters["tokens_per_step"] = tokens_per_step;
  state.counters["peer_tokens_per_step"] = peer_tokens_per_step;
  // The peer's time per emitted token over specdec's (above 1: specdec is faster): steps of
  // the two emit different token counts where their verification rules differ (block
  // verification accepts more than Algorithm 1).
  state.counters["vs_peer_per_token"] =
      (medians.peer / peer_tokens_per_step) / (medians.step / tokens_per_step);
  state.counters["allocs_per_step"] = static_cast<double>(allocations) / step_count;
  state.counters["acceptance"] = decoder.statistics().acceptance_rate();
  // The read the ratios are taken against, as this host does it: hosts differ mostly here
  // (docs/performance.md), so the same step time gives different vs_read on different hosts.
  std::size_t bytes = 0;
  for (const auto row : given) bytes += row.size_bytes();
  state.counters["read_us"] = 1e6 * medians.read;
  if (medians.read > 0.0) {
    state.counters["read_GBps"] = static_cast<double>(bytes) / medians.read / 1e9;
  }
  specdec::reset_kernel_path();
}

// stable: the draft declares stable_rows (read in place at T = 1, else no effect).
void run_step(benchmark::State& state, const StepSetup& setup, bool stable) {
  if (stable) {
    decoder_step<StableDraft>(state, setup);
  } else {
    decoder_step<PrecomputedDraft>(state, setup);
  }
}

void BM_DecoderStep(benchmark::State& state) {
  run_step(state,
           {static_cast<std::size_t>(state.range(0)), static_cast<mode>(state.range(1)),
            state.range(2) != 0, static_cast<specdec::baseline::residence>(state.range(3)),
            state.range(4), default_gamma},
           state.range(5) != 0);
}

// Rows in cache: Google Benchmark picks the iteration count. Rows in DRAM: every sample
// first streams 64 MiB through the caches (milliseconds), so a fixed number of samples per
// benchmark, whatever --benchmark_min_time says: baseline::dram_samples() (31, or
// SPECDEC_DRAM_SAMPLES; scripts/test.sh's smoke run takes 3).
template <std::int64_t Where>
void decoder_arguments(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"V", "mode", "checks", "dram", "kernels", "stable"});
  for (const std::int64_t vocab : {32000, 128000}) {
    for (const std::int64_t sampling : {0, 1, 2, 3, 4}) {
      for (const std::int64_t checks : {1, 0}) {
        benchmark->Args({vocab, sampling, checks, Where, 1, 0});
        // T = 1: the draft's rows read in place (stable_rows) instead of copied.
        if (sampling == 0) benchmark->Args({vocab, sampling, checks, Where, 1, 1});
        // The row passes are dispatched (kernel_path.hpp): the portable kernels too, in the
        // same run (rows in cache).
        if (Where == 0) {
          benchmark->Args({vocab, sampling, checks, Where, 0, 0});
          if (specdec::best_kernel_path() == specdec::kernel_path::avx512) {
            benchmark->Args({vocab, sampling, checks, Where, 2, 0});
          }
        }
      }
    }
  }
  benchmark->UseManualTime()->Unit(benchmark::kMicrosecond);
  if (Where == 1) benchmark->Iterations(specdec::baseline::dram_samples());
}

BENCHMARK(BM_DecoderStep)->Apply(decoder_arguments<0>);
BENCHMARK(BM_DecoderStep)->Apply(decoder_arguments<1>);

// specdec against the fair peer at every V in {32k, 128k, 256k} and gamma in {1, 4, 8}, rows
// in cache, best kernel path: T = 1 (checks on and off, the draft copied or read in place),
// T = 0.7 + top-k 50 + top-p 0.9 and greedy (checks on and off). The same step, read and
// peer as BM_DecoderStep; vs_peer above 1 means specdec is faster. (Top-p without top-k is
// left to BM_DecoderStep: its peer sorts whole rows, 100x slower than specdec there.)
void BM_DecoderVsPeer(benchmark::State& state) {
  run_step(state,
           {static_cast<std::size_t>(state.range(0)), static_cast<mode>(state.range(2)),
            state.range(3) != 0, specdec::baseline::residence::cache, 1,
            static_cast<std::size_t>(state.range(1))},
           state.range(4) != 0);
}

void peer_arguments(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"V", "gamma", "mode", "checks", "stable"});
  for (const std::int64_t vocab : {32000, 128000, 256000}) {
    for (const std::int64_t draft_length : {1, 4, 8}) {
      for (const std::int64_t sampling : {0, 1, 2}) {
        for (const std::int64_t checks : {1, 0}) {
          benchmark->Args({vocab, draft_length, sampling, checks, 0});
          if (sampling == 0) benchmark->Args({vocab, draft_length, sampling, checks, 1});
        }
      }
    }
  }
  benchmark->UseManualTime()->Unit(benchmark::kMicrosecond);
}
BENCHMARK(BM_DecoderVsPeer)->Apply(peer_arguments);

// How the step's cost per entry scales with V and gamma (T = 1, checks on, rows in cache,
// the same context every step): ns_per_entry = step time / ((2 gamma + 1) V), and vs_read
// as above. Flat ns_per_entry means the workspace does not fall out of cache before the
// rows do. "stable 1": the draft declares stable_rows, so its rows are read in place and the
// workspace holds no row at all (the target's are in place too: batched, T = 1).
template <class Draft>
void decoder_scaling(benchmark::State& state) {
  namespace bl = specdec::baseline;
  const auto vocab = static_cast<std::size_t>(state.range(0));
  const auto draft_length = static_cast<std::size_t>(state.range(1));
  const RowBank& rows = bank(vocab, std::max<std::size_t>(8, draft_length));
  PrecomputedTarget target{&rows};
  Draft draft{{&rows}};
  specdec::DecoderOptions options;
  options.gamma_policy = specdec::FixedGamma(draft_length);
  specdec::SpeculativeDecoder decoder(target, draft, options);
  const std::vector<token_id> context(128, 1);
  decoder.reserve(context.size());
  specdec::xoshiro256pp g(7);
  (void)decoder.step(context, g);
  std::vector<std::span<const float>> given;
  for (std::size_t i = 0; i < draft_length; ++i) {
    given.push_back(rows.row(rows.draft, context.size() + i));
  }
  given.emplace_back(rows.row(rows.target, context.size()).data(), (draft_length + 1) * vocab);
  std::size_t tokens = 0;
  std::size_t steps = 0;
  const auto step = [&] {
    tokens += decoder.step(context, g).tokens.size();
    ++steps;
  };
  const auto read = [&] { benchmark::DoNotOptimize(bl::read_rows(given)); };
  const auto medians = bl::interleave(
      state, bl::residence::cache, 1, step, read, [] {}, false);
  state.counters["ns_per_entry"] =
      medians.step * 1e9 / static_cast<double>((2 * draft_length + 1) * vocab);
  state.counters["tokens_per_step"] = static_cast<double>(tokens) / static_cast<double>(steps);
}
void BM_DecoderScaling(benchmark::State& state) {
  if (state.range(2) != 0) {
    decoder_scaling<StableDraft>(state);
  } else {
    decoder_scaling<PrecomputedDraft>(state);
  }
}
BENCHMARK(BM_DecoderScaling)
    ->ArgNames({"V", "gamma", "stable"})
    ->ArgsProduct({{32000, 128000, 256000}, {4, 16}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
