// specdec demo — wrappers that time model calls (to measure the cost ratio c of
// Definition 3.7) and an optional simulated cost that makes every target call as expensive
// as streaming a large model's weights from memory once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"

namespace specdec_demo {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

/// Calls and time spent in them.
struct CallStats {
  std::uint64_t calls = 0;
  std::uint64_t rows = 0;  // probability rows returned (a batched call returns several)
  double seconds = 0.0;
  [[nodiscard]] double seconds_per_call() const {
    return calls == 0 ? 0.0 : seconds / static_cast<double>(calls);
  }
};

/// Real memory-bound work standing in for an expensive target: each `run()` streams
/// through a buffer sized (by calibration on this machine) to take about the requested
/// time, as a large model reads its weights once per forward pass, whether that pass
/// scores one position or gamma + 1 of them.
class SimulatedCost {
 public:
  SimulatedCost() = default;

  /// Sizes the work for about `microseconds` per run (0: no extra work).
  explicit SimulatedCost(double microseconds) {
    if (microseconds <= 0.0) return;
    // Start from 4 GB/s and refine from measured passes; the buffer is allocated once.
    double bytes_per_microsecond = 4000.0;
    for (int round = 0; round < 3; ++round) {
      words_per_run_ = std::max<std::size_t>(
          64,
          static_cast<std::size_t>(microseconds * bytes_per_microsecond / sizeof(std::uint64_t)));
      if (buffer_.size() < words_per_run_) buffer_.assign(words_per_run_, 0x9e3779b97f4a7c15ULL);
      run();  // warm up (page faults)
      double best = 1e300;
      for (int i = 0; i < 5; ++i) {
        const auto start = clock_type::now();
        run();
        best = std::min(best, seconds_since(start));
      }
      bytes_per_microsecond =
          static_cast<double>(words_per_run_ * sizeof(std::uint64_t)) / (best * 1e6);
    }
    words_per_run_ = std::max<std::size_t>(
        64, static_cast<std::size_t>(microseconds * bytes_per_microsecond / sizeof(std::uint64_t)));
    if (buffer_.size() < words_per_run_) buffer_.assign(words_per_run_, 0x9e3779b97f4a7c15ULL);
  }

  [[nodiscard]] bool active() const noexcept { return words_per_run_ > 0; }
  [[nodiscard]] double megabytes_per_run() const noexcept {
    return static_cast<double>(words_per_run_ * sizeof(std::uint64_t)) / 1e6;
  }

  void run() {
    // Four independent accumulators keep the loop bound by memory, not by the adds.
    std::uint64_t sums[4] = {0, 0, 0, 0};
    const std::size_t words = words_per_run_ - words_per_run_ % 4;
    for (std::size_t i = 0; i < words; i += 4) {
      sums[0] += buffer_[i];
      sums[1] ^= buffer_[i + 1];
      sums[2] += buffer_[i + 2];
      sums[3] ^= buffer_[i + 3];
    }
    sink_ = sink_ + sums[0] + sums[1] + sums[2] + sums[3];
  }

  [[nodiscard]] std::uint64_t sink() const noexcept { return sink_; }

 private:
  std::vector<std::uint64_t> buffer_;
  std::size_t words_per_run_ = 0;
  volatile std::uint64_t sink_ = 0;  // keeps the reads observable
};

/// A LanguageModel wrapper that times every call (and adds the simulated cost, if any).
/// Batched calls are counted separately: the paper charges a parallel run of the target
/// as one run (Sec. 3.3), and the demo reports how far that holds here.
template <specdec::LanguageModel Model>
class Timed {
 public:
  explicit Timed(Model& model, SimulatedCost* cost = nullptr) : model_(&model), cost_(cost) {}

  [[nodiscard]] std::size_t vocab_size() const { return model_->vocab_size(); }

  decltype(auto) next_token_probabilities(std::span<const specdec::token_id> context) {
    const auto start = clock_type::now();
    if (cost_ != nullptr) cost_->run();
    decltype(auto) row = model_->next_token_probabilities(context);
    single_.seconds += seconds_since(start);
    ++single_.calls;
    ++single_.rows;
    return row;
  }

  decltype(auto) score_draft(
      std::span<const specdec::token_id> context,
      std::span<const specdec::token_id> draft) requires specdec::HasDraftScoring<Model> {
    const auto start = clock_type::now();
    if (cost_ != nullptr) cost_->run();
    decltype(auto) rows = model_->score_draft(context, draft);
    batched_.seconds += seconds_since(start);
    ++batched_.calls;
    batched_.rows += draft.size() + 1;
    last_draft_.assign(draft.begin(), draft.end());
    return rows;
  }

  [[nodiscard]] const CallStats& single() const noexcept { return single_; }
  [[nodiscard]] const CallStats& batched() const noexcept { return batched_; }
  /// The draft x_1..x_gamma of the last score_draft call (the trace reads the rejected
  /// x_{n+1} from it).
  [[nodiscard]] std::span<const specdec::token_id> last_draft() const noexcept {
    return last_draft_;
  }
  [[nodiscard]] Model& model() const noexcept { return *model_; }
  [[nodiscard]] CallStats total() const noexcept {
    return {single_.calls + batched_.calls, single_.rows + batched_.rows,
            single_.seconds + batched_.seconds};
  }
  void reset() noexcept { single_ = batched_ = CallStats{}; }

 private:
  Model* model_;
  SimulatedCost* cost_;
  CallStats single_;
  CallStats batched_;
  std::vector<specdec::token_id> last_draft_;
};

/// A ProposalDrafter wrapper that times every `propose` call.
template <specdec::ProposalDrafter Drafter>
class TimedDrafter {
 public:
  explicit TimedDrafter(Drafter& drafter) : drafter_(&drafter) {}

  std::size_t propose(std::span<const specdec::token_id> context,
                      std::span<specdec::token_id> out) {
    const auto start = clock_type::now();
    const std::size_t written = static_cast<std::size_t>(drafter_->propose(context, out));
    stats_.seconds += seconds_since(start);
    ++stats_.calls;
    stats_.rows += written;
    return written;
  }

  [[nodiscard]] const CallStats& stats() const noexcept { return stats_; }
  void reset() noexcept { stats_ = CallStats{}; }

 private:
  Drafter* drafter_;
  CallStats stats_;
};

}  // namespace specdec_demo
