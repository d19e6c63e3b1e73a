// Batch verification (batch_verification.hpp): B sequences of gamma = 4 drafts each over
// float rows of V in {32k, 128k}, on 1 or 2 threads, at T = 1 and at T = 0.7 with top-k 50,
// against three references timed interleaved with the batch in the same loop, on the same
// statistic (the median of wall time: the batch runs on several threads):
//   the pure read    an integer OR over exactly the rows the batch must touch (each
//                    sequence's rows read whole: p_{n+1} and q_{n+1} after a rejection,
//                    p_{gamma+1} for a bonus; at T != 1 also the rows standardized before
//                    them), split over the same threads the same way, or on the calling
//                    thread where the batch runs there (the physical limit);
//   the loop         specdec's single-sequence verify_speculative (T = 1) or Standardizer +
//                    verify_speculative per sequence, one after another on one thread: what
//                    an engine writes without batch verification;
//   the peer         the fair peer (peer.hpp) per sequence on one thread: Algorithm 1 as vLLM
//                    and Hugging Face structure it, at T != 1 after truncating every row of
//                    the sequence first (vLLM processes all target logits before its
//                    rejection sampler).
// Rows are LLM-like (Zipf over a random permutation per row, q a perturbed copy of p);
// drafts are sampled from the standardized q with each sequence's draft stream, so about
// 80% of drafts are accepted, as in serving.
//
// Counters: batch_us (median per batch), vs_read (batch / pure read), vs_loop (loop / batch:
// above 1, batch verification is faster), vs_peer (peer / batch), seq_per_s.
#include <algorithm>
#include <atomic>
#include <chrono>
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
#include "specdec/batch_verification.hpp"
#include "specdec/executor.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_sampling.hpp"

namespace {

using specdec::RowsView;
using specdec::SequenceOptions;
using specdec::token_id;

constexpr std::size_t gamma = 4;
constexpr std::size_t distinct_rows = 8;  // rows cycled through the batch

/// distinct_rows target rows and draft rows of V entries (built once per V).
struct RowPool {
  std::vector<float> target;
  std::vector<float> draft;

  explicit RowPool(std::size_t size) : target(distinct_rows * size), draft(distinct_rows * size) {
    specdec::xoshiro256pp g(size);
    std::vector<std::size_t> order(size);
    std::vector<double> p(size);
    std::vector<double> q(size);
    for (std::size_t r = 0; r < distinct_rows; ++r) {
      std::iota(order.begin(), order.end(), 0);
      for (std::size_t k = size - 1; k > 0; --k) {
        std::swap(order[k], order[specdec::uniform_below(g, k + 1)]);
      }
      for (std::size_t rank = 0; rank < size; ++rank) {
        p[order[rank]] = 1.0 / std::pow(static_cast<double>(rank + 1), 1.1);
      }
      for (std::size_t j = 0; j < size; ++j) {
        q[j] = p[j] * (0.75 + 0.5 * specdec::uniform01<double>(g));
      }
      const double p_total = std::accumulate(p.begin(), p.end(), 0.0);
      const double q_total = std::accumulate(q.begin(), q.end(), 0.0);
      for (std::size_t j = 0; j < size; ++j) {
        target[r * size + j] = static_cast<float>(p[j] / p_total);
        draft[r * size + j] = static_cast<float>(q[j] / q_total);
      }
    }
  }
};

const RowPool& row_pool(std::size_t size) {
  static std::map<std::size_t, std::unique_ptr<RowPool>> pools;
  auto& pool = pools[size];
  if (!pool) pool = std::make_unique<RowPool>(size);
  return *pool;
}

/// One batch: B sequences of gamma drafts, rows copied from the pool (each sequence its own
/// memory), drafts sampled from the standardized q.
struct BatchData {
  std::size_t vocab = 0;
  std::vector<token_id> drafts;
  std::vector<std::size_t> offsets{0};
  std::vector<float> target;
  std::vector<float> draft;
  std::vector<SequenceOptions> options;

  BatchData(std::size_t size, std::size_t sequences, const specdec::SamplingOptions& sampling)
      : vocab(size) {
    const RowPool& pool = row_pool(size);
    specdec::Standardizer<float> standardizer(sampling);
    std::vector<float> scratch(size);
    for (std::size_t b = 0; b < sequences; ++b) {
      SequenceOptions sequence;
      sequence.sampling = sampling;
      sequence.stream = {2026, b, 0};
      auto g = specdec::stream_engine(sequence.stream, specdec::stream_purpose::draft);
      for (std::size_t i = 0; i <= gamma; ++i) {
        const std::size_t r = (b * (gamma + 1) + i) % distinct_rows;
        target.insert(target.end(), pool.target.begin() + static_cast<std::ptrdiff_t>(r * size),
                      pool.target.begin() + static_cast<std::ptrdiff_t>((r + 1) * size));
        if (i == gamma) break;
        const auto q = std::span<const float>(pool.draft.data() + r * size, size);
        draft.insert(draft.end(), q.begin(), q.end());
        drafts.push_back(
            specdec::sample_standardized(standardizer, q, std::span<float>(scratch), g));
      }
      offsets.push_back(drafts.size());
      options.push_back(sequence);
    }
  }

  [[nodiscard]] specdec::RaggedBatch<float> view() const {
    return {drafts, offsets, RowsView<const float>(target.data(), target.size() / vocab, vocab),
            RowsView<const float>(draft.data(), draft.size() / vocab, vocab)};
  }
};

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class Operation>
double wall_sample(std::size_t repetitions, Operation&& operation) {
  operation();
  const double start = wall_seconds();
  for (std::size_t r = 0; r < repetitions; ++r) operation();
  return (wall_seconds() - start) / static_cast<double>(repetitions);
}

// Arguments: V, B, threads, sampling (0: T = 1; 1: T = 0.7 with top-k 50).
void BM_BatchVerify(benchmark::State& state) {
  const auto vocab = static_cast<std::size_t>(state.range(0));
  const auto sequences = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const bool truncated = state.range(3) != 0;
  const specdec::SamplingOptions sampling =
      truncated ? specdec::SamplingOptions{.temperature = 0.7, .top_k = 50}
                : specdec::SamplingOptions{};
  const BatchData data(vocab, sequences, sampling);
  const auto batch = data.view();
  specdec::ThreadPool pool(threads);
  specdec::BatchVerifier<float> verifier{specdec::executor_ref(pool)};
  verifier.reserve(vocab);
  specdec::BatchVerification out;
  verifier.verify(batch, data.options, out);

  // The rows each sequence reads whole (from its result): split over the same threads.
  std::vector<std::vector<std::span<const float>>> touched(sequences);
  std::size_t accepted = 0;
  for (std::size_t b = 0; b < sequences; ++b) {
    const auto n = out.result(b).accepted;
    accepted += n;
    const auto p = batch.target(b);
    const auto q = batch.draft(b);
    const std::size_t last = n < gamma ? n : gamma;
    const std::size_t first = truncated ? 0 : last;  // standardized rows: all up to it
    for (std::size_t i = first; i <= last; ++i) {
      touched[b].emplace_back(p.row(i));
      if (i < gamma) touched[b].emplace_back(q.row(i));
    }
  }
  // On the threads when the batch is (the verifier's rule: the rows it reads at least).
  const std::size_t least_rows = sequences * (truncated ? 2 * (gamma + 1) : 2);
  const bool parallel =
      least_rows * vocab >= specdec::BatchVerifier<float>::default_parallel_threshold;
  std::uint32_t sink = 0;
  std::vector<std::uint32_t> bits(threads, 0);
  const auto read = [&] {
    std::atomic<std::size_t> next{0};
    auto task = [&](std::size_t k) {
      for (std::size_t b = next.fetch_add(1); b < sequences; b = next.fetch_add(1)) {
        bits[k] |= specdec::baseline::read_rows(touched[b]);
      }
    };
    if (parallel) {
      pool.run(std::min(threads, sequences), task);
    } else {
      task(0);
    }
    for (const auto value : bits) sink |= value;
  };
  // The loop and the peer, one sequence after another on this thread.
  specdec::Standardizer<float> standardizer(sampling);
  standardizer.reserve(vocab);
  std::vector<float> p_rows((gamma + 1) * vocab);
  std::vector<float> q_rows(gamma * vocab);
  const auto standardize_all = [&](auto&& apply, std::size_t b) {
    const auto p = batch.target(b);
    const auto q = batch.draft(b);
    for (std::size_t i = 0; i <= gamma; ++i) apply(p.row(i).data(), p_rows.data() + i * vocab);
    for (std::size_t i = 0; i < gamma; ++i) apply(q.row(i).data(), q_rows.data() + i * vocab);
  };
  const auto loop = [&] {
    for (std::size_t b = 0; b < sequences; ++b) {
      auto g = specdec::stream_engine(data.options[b].stream);
      if (!truncated) {
        sink += static_cast<std::uint32_t>(
            specdec::verify_speculative(batch.drafts(b), batch.draft(b), batch.target(b), g).token);
        continue;
      }
      standardize_all(
          [&](const float* in, float* to) {
            standardizer.apply(std::span<const float>(in, vocab), std::span<float>(to, vocab));
          },
          b);
      sink += static_cast<std::uint32_t>(
          specdec::verify_speculative(batch.drafts(b),
                                      RowsView<const float>(q_rows.data(), gamma, vocab),
                                      RowsView<const float>(p_rows.data(), gamma + 1, vocab), g)
              .token);
    }
  };
  specdec::peer::Algorithm1 peer(vocab);
  specdec::peer::Truncation truncation(vocab, sampling.temperature, sampling.top_k, 1.0);
  const auto peer_loop = [&] {
    for (std::size_t b = 0; b < sequences; ++b) {
      auto g = specdec::stream_engine(data.options[b].stream);
      if (!truncated) {
        sink += static_cast<std::uint32_t>(
            peer.verify(batch.drafts(b), batch.draft(b), batch.target(b), g).token);
        continue;
      }
      standardize_all([&](const float* in, float* to) { truncation.apply(in, to); }, b);
      sink += static_cast<std::uint32_t>(
          peer.verify(batch.drafts(b), RowsView<const float>(q_rows.data(), gamma, vocab),
                      RowsView<const float>(p_rows.data(), gamma + 1, vocab), g)
              .token);
    }
  };
  const auto verify = [&] { verifier.verify(batch, data.options, out); };

  const double once = wall_sample(1, verify);
  const std::size_t repetitions =
      once <= 0.0 ? 8 : std::clamp<std::size_t>(static_cast<std::size_t>(200e-6 / once), 1, 16);
  std::vector<double> batches, reads, loops, peers;
  std::size_t turn = 0;
  for (auto _ : state) {
    double batch_seconds = 0.0;
    for (std::size_t k = 0; k < 4; ++k) {
      switch ((turn + k) % 4) {
        case 0:
          batch_seconds = wall_sample(repetitions, verify);
          batches.push_back(batch_seconds);
          break;
        case 1:
          reads.push_back(wall_sample(repetitions, read));
          break;
        case 2:
          loops.push_back(wall_sample(repetitions, loop));
          break;
        default:
          peers.push_back(wall_sample(repetitions, peer_loop));
          break;
      }
    }
    ++turn;
    state.SetIterationTime(batch_seconds);
  }
  benchmark::DoNotOptimize(sink);
  const double batch_median = specdec::baseline::median(batches);
  state.counters["batch_us"] = 1e6 * batch_median;
  if (batch_median > 0.0) {
    state.counters["vs_read"] = batch_median / specdec::baseline::median(reads);
    state.counters["vs_loop"] = specdec::baseline::median(loops) / batch_median;
    state.counters["vs_peer"] = specdec::baseline::median(peers) / batch_median;
    state.counters["seq_per_s"] = static_cast<double>(sequences) / batch_median;
  }
  state.counters["accepted"] =
      static_cast<double>(accepted) / static_cast<double>(sequences * gamma);
  state.SetLabel(truncated ? "T = 0.7, top-k 50" : "T = 1");
}

BENCHMARK(BM_BatchVerify)
    ->ArgNames({"V", "B", "threads", "topk"})
    ->ArgsProduct({{32768, 131072}, {1, 8, 32}, {1, 2}, {0, 1}})
    ->ArgsProduct({{32768}, {128, 256}, {1, 2}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
