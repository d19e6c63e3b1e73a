// Test support for batch verification: random sequences of a ragged batch (rows, drafts
// sampled the way an engine samples them, mixed options) and their assembly into the
// layout. Shared by batch_verification_test.cpp and batch_allocation_test.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "specdec/batch_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "support/statistics.hpp"

namespace specdec::testing {

using specdec::RaggedBatch;
using specdec::RowsView;
using specdec::SamplingOptions;
using specdec::SequenceOptions;
using specdec::token_id;

/// A softmax row of Gaussian logits (scale `sigma`), normalised in T.
template <class T>
std::vector<T> random_row(std::size_t size, specdec::xoshiro256pp& g, double sigma = 2.0) {
  std::vector<double> weights(size);
  for (auto& w : weights) w = std::exp(sigma * specdec::testing::standard_normal(g));
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<T> row(size);
  for (std::size_t j = 0; j < size; ++j) row[j] = static_cast<T>(weights[j] / total);
  return row;
}

/// One sequence of a batch: its drafts, its rows (n + 1 target rows, n draft rows) and
/// options.
template <class T>
struct Sequence {
  std::vector<token_id> drafts;
  std::vector<T> target;  // (n + 1) x V
  std::vector<T> draft;   // n x V
  SequenceOptions options;
};

/// A batch assembled from sequences (copies their rows into the ragged layout).
template <class T>
struct Batch {
  std::size_t vocab = 0;
  std::vector<token_id> drafts;
  std::vector<std::size_t> offsets{0};
  std::vector<T> target;
  std::vector<T> draft;
  std::vector<SequenceOptions> options;

  explicit Batch(std::size_t vocab_size, const std::vector<const Sequence<T>*>& sequences)
      : vocab(vocab_size) {
    for (const Sequence<T>* s : sequences) {
      drafts.insert(drafts.end(), s->drafts.begin(), s->drafts.end());
      offsets.push_back(drafts.size());
      target.insert(target.end(), s->target.begin(), s->target.end());
      draft.insert(draft.end(), s->draft.begin(), s->draft.end());
      options.push_back(s->options);
    }
  }

  [[nodiscard]] RaggedBatch<T> view() const {
    return {drafts, offsets, RowsView<const T>(target.data(), target.size() / vocab, vocab),
            RowsView<const T>(draft.data(), draft.size() / vocab, vocab)};
  }
};

/// Draws sequence drafts the way an engine would: from q standardized by the sequence's
/// options (sample_standardized), with the sequence's draft stream. Proposals: any tokens.
template <class T>
Sequence<T> make_sequence(std::size_t vocab, std::size_t drafted, const SequenceOptions& options,
                          specdec::xoshiro256pp& g) {
  Sequence<T> s;
  s.options = options;
  specdec::Standardizer<T> standardizer(options.sampling);
  std::vector<T> scratch(vocab);
  specdec::xoshiro256pp draw =
      specdec::stream_engine(options.stream, specdec::stream_purpose::draft);
  for (std::size_t i = 0; i <= drafted; ++i) {
    const auto p = random_row<T>(vocab, g);
    s.target.insert(s.target.end(), p.begin(), p.end());
  }
  for (std::size_t i = 0; i < drafted; ++i) {
    // Drafts close to the target half of the time, so that long acceptances happen.
    auto q = random_row<T>(vocab, g);
    if (specdec::uniform_below(g, 2) == 0) {
      std::copy(s.target.begin() + static_cast<std::ptrdiff_t>(i * vocab),
                s.target.begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab), q.begin());
    }
    s.draft.insert(s.draft.end(), q.begin(), q.end());
    if (options.proposals) {
      s.drafts.push_back(static_cast<token_id>(specdec::uniform_below(g, vocab)));
    } else {
      s.drafts.push_back(specdec::sample_standardized(standardizer, std::span<const T>(q),
                                                      std::span<T>(scratch), draw));
    }
  }
  return s;
}

/// Options of every kind a batch mixes.
inline std::vector<SamplingOptions> sampling_kinds() {
  return {{},
          {.temperature = 0.7},
          {.temperature = 1.3, .top_k = 5},
          {.top_p = 0.8},
          {.temperature = 0.8, .top_p = 0.9},
          {.min_p = 0.05},
          {.temperature = 0.9, .top_k = 8, .top_p = 0.9, .min_p = 0.02},
          {.temperature = 0.0}};
}

template <class T>
std::vector<Sequence<T>> random_sequences(std::size_t count, std::size_t vocab,
                                          std::size_t max_drafts, std::uint64_t seed) {
  specdec::xoshiro256pp g(seed);
  const auto kinds = sampling_kinds();
  std::vector<Sequence<T>> sequences;
  for (std::size_t k = 0; k < count; ++k) {
    SequenceOptions options;
    options.sampling = kinds[specdec::uniform_below(g, kinds.size())];
    options.proposals = specdec::uniform_below(g, 4) == 0;
    options.lenience = specdec::uniform_below(g, 6) == 0 ? 0.5 : 1.0;
    options.stream = {seed, 1000 + k, specdec::uniform_below(g, 50)};
    const auto drafted = static_cast<std::size_t>(specdec::uniform_below(g, max_drafts + 1));
    sequences.push_back(make_sequence<T>(vocab, drafted, options, g));
  }
  return sequences;
}

}  // namespace specdec::testing
