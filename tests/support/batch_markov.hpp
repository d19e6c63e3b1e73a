// Test support for the batch decoder: a Markov chain that answers a ragged batch, as a
// BatchScoringModel (score_batch: the rows of every drafted prefix of every request) and a
// BatchDraftModel (draft_batch: one row per request), with switches that break it on purpose.
// Shared by batch_decoder_test.cpp, batch_gamma_test.cpp and batch_allocation_test.cpp.
// Allocation-free once its row buffer has grown (and `released` has room).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "specdec/batch_decoder.hpp"
#include "specdec/rows.hpp"
#include "speculative_decoder_models.hpp"

namespace specdec::testing {

class BatchMarkov : public MarkovModel<double> {
 public:
  explicit BatchMarkov(MarkovModel<double> model, std::string failure = "device lost")
      : MarkovModel<double>(std::move(model)), failure_(std::move(failure)) {}

  RowsView<const double> score_batch(std::span<const BatchScoreRequest> requests) {
    ++score_calls;
    return answer(requests, true);
  }
  RowsView<const double> draft_batch(std::span<const BatchScoreRequest> requests) {
    ++draft_calls;
    return answer(requests, false);
  }
  void release_sequence(std::uint64_t id) { released.push_back(id); }

  /// score_batch's row k of a request is the row of context + drafts[0..k + 1) where that
  /// exists: the wrong prefix, a broken target.
  bool shift = false;
  /// The next call throws std::runtime_error(failure) (given at construction).
  bool fail_next = false;
  /// Calls return one row too few.
  bool drop_row = false;
  /// score_batch writes a NaN into row 0 of requests whose context starts with this token.
  token_id poison = -1;
  /// Called with the number of rows of each call (e.g. to advance a simulated clock).
  std::function<void(std::size_t rows)> on_call{};

  std::size_t score_calls = 0;
  std::size_t draft_calls = 0;
  std::vector<std::uint64_t> released;

 private:
  // score_batch (all: every prefix) or draft_batch (the last prefix of each request).
  RowsView<const double> answer(std::span<const BatchScoreRequest> requests, bool all) {
    if (fail_next) {
      fail_next = false;
      throw std::runtime_error(failure_);
    }
    const std::size_t vocab = vocab_size();
    std::size_t rows = 0;
    for (const auto& request : requests) rows += all ? request.drafts.size() + 1 : 1;
    if (on_call) on_call(rows);
    if (rows_.size() < rows * vocab) rows_.resize(rows * vocab);
    std::size_t at = 0;
    for (const auto& request : requests) {
      std::size_t s = state(request.context);
      const std::size_t drafted = request.drafts.size();
      for (std::size_t k = 0; k <= drafted; ++k) {
        const std::size_t next =
            k < drafted ? next_state(s, static_cast<std::size_t>(request.drafts[k])) : s;
        if (all || k == drafted) {
          const auto source = row(all && shift && k < drafted ? next : s);
          std::copy(source.begin(), source.end(), rows_.begin() + static_cast<std::ptrdiff_t>(at));
          if (all && poison >= 0 && k == 0 && !request.context.empty() &&
              request.context.front() == poison) {
            rows_[at] = std::nan("");
          }
          at += vocab;
        }
        s = next;
      }
    }
    return {rows_.data(), drop_row ? rows - 1 : rows, vocab};
  }

  std::string failure_;
  std::vector<double> rows_;
};

}  // namespace specdec::testing
