// Test support: the sequence-level chi-square of the decoder's exactness tests
// (speculative_decoder_exactness_test.cpp, gamma_policy_exactness_test.cpp): Markov targets
// and drafts of order 1 and 2, the exact law of a statistic of the generated sequence, and
// the sampling loop that tests a decoder against it.
//
// The statistic. V = 4: the full law of the 4 generated tokens (256 outcomes, exact
// probabilities by enumeration). V = 16 and 64 (4096 / 262144 outcomes of length 3): the
// sequence is mapped to its "rank profile" — for each position j the rank of x_j under the
// standardized target row given the true history x_<j, grouped as {1st}, {2nd}, {3rd-4th},
// {5th or lower} — 64 cells whose exact probabilities come from enumerating all V^3
// sequences. This is a function of the whole sequence, so under exactness its law is known
// exactly; a decoder that distorts any conditional law (too much or too little mass on the
// probable tokens, a row taken from the wrong prefix across a step boundary, a bonus from the
// wrong row) moves mass between rank groups, which is what the test sees.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "speculative_decoder_models.hpp"
#include "support/statistics.hpp"

namespace specdec::testing {

/// The prompt every generation of these tests starts from.
inline const std::vector<token_id> sequence_prompt = {1, 2};

/// Generated tokens per sample: 4 for V <= 4 (full law), else 3 (rank profile).
inline std::size_t sequence_length_for(std::size_t vocab) {
  return vocab <= 4 ? 4 : 3;
}

/// The exact law of the statistic of `length` tokens generated after sequence_prompt by
/// autoregressive sampling from the standardized rows of `target`, and the map
/// sequence -> cell.
class SequenceLaw {
 public:
  SequenceLaw(const MarkovModel<double>& target, const SamplingOptions& sampling,
              std::size_t length)
      : target_(&target), vocab_(target.vocab_size()), length_(length) {
    full_law_ = vocab_ <= 4;
    standardized_.resize(target.states() * vocab_);
    rank_.resize(target.states() * vocab_);
    Standardizer<double> standardizer(sampling);
    for (std::size_t s = 0; s < target.states(); ++s) {
      const std::span<double> row(standardized_.data() + s * vocab_, vocab_);
      standardizer.apply(target.row(s), row);
      std::vector<std::size_t> order(vocab_);
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return row[a] > row[b]; });
      for (std::size_t r = 0; r < vocab_; ++r) rank_[s * vocab_ + order[r]] = r;
    }
    std::size_t cells = 1;
    for (std::size_t j = 0; j < length_; ++j) cells *= full_law_ ? vocab_ : 4;
    expected_.assign(cells, 0.0);
    enumerate(target.state(sequence_prompt), 0, 1.0, 0);
  }

  [[nodiscard]] std::size_t length() const { return length_; }
  [[nodiscard]] std::size_t cells() const { return expected_.size(); }
  [[nodiscard]] const std::vector<double>& expected() const { return expected_; }

  /// The cell of the first length() generated tokens (the prompt excluded).
  [[nodiscard]] std::size_t cell_of(std::span<const token_id> tokens) const {
    std::size_t s = target_->state(sequence_prompt);
    std::size_t cell = 0;
    for (std::size_t j = 0; j < length_; ++j) {
      const auto x = static_cast<std::size_t>(tokens[j]);
      cell = cell * (full_law_ ? vocab_ : 4) + digit(s, x);
      s = target_->next_state(s, x);
    }
    return cell;
  }

 private:
  [[nodiscard]] std::size_t digit(std::size_t s, std::size_t x) const {
    if (full_law_) return x;
    const std::size_t rank = rank_[s * vocab_ + x];
    return rank == 0 ? 0 : rank == 1 ? 1 : rank <= 3 ? 2 : 3;
  }

  void enumerate(std::size_t s, std::size_t depth, double probability, std::size_t cell) {
    if (depth == length_) {
      expected_[cell] += probability;
      return;
    }
    for (std::size_t x = 0; x < vocab_; ++x) {
      const double p = standardized_[s * vocab_ + x];
      if (p == 0.0) continue;
      enumerate(target_->next_state(s, x), depth + 1, probability * p,
                cell * (full_law_ ? vocab_ : 4) + digit(s, x));
    }
  }

  const MarkovModel<double>* target_;
  std::size_t vocab_;
  std::size_t length_;
  bool full_law_ = false;
  std::vector<double> standardized_;
  std::vector<std::size_t> rank_;
  std::vector<double> expected_;
};

/// Samples to detect a deviation of total variation 0.1 in the statistic's law (about 6.9k
/// for 64 cells).
inline std::size_t samples_for(const SequenceLaw& law) {
  return samples_to_detect(0.1, static_cast<double>(std::min<std::size_t>(law.cells() - 1, 63)));
}

/// Counts the cells of `samples` generations of law.length() tokens with one engine seeded
/// by `seed`. `generate(g)` returns the generated tokens (the prompt excluded).
template <class Generate>
ChiSquareResult sample_sequences(Generate&& generate, const SequenceLaw& law, std::size_t samples,
                                 std::uint64_t seed) {
  std::vector<std::uint64_t> counts(law.cells(), 0);
  xoshiro256pp g(seed);
  for (std::size_t k = 0; k < samples; ++k) ++counts[law.cell_of(generate(g))];
  return chi_square_test(counts, law.expected());
}

/// sample_sequences with decoder.generate(sequence_prompt, law.length(), g). The decoder is
/// reused across samples, so an adaptive gamma policy carries its state from one sample to
/// the next (the samples stay independent draws of the target law if the decoder is exact).
template <class Decoder>
ChiSquareResult sample_decoder(Decoder& decoder, const SequenceLaw& law, std::size_t samples,
                               std::uint64_t seed) {
  return sample_sequences(
      [&](xoshiro256pp& g) { return decoder.generate(sequence_prompt, law.length(), g).tokens; },
      law, samples, seed);
}

/// A random target of the given order: peaked rows with some zeros.
inline MarkovModel<double> make_markov_target(std::size_t vocab, std::size_t order,
                                              std::uint64_t seed) {
  return MarkovModel<double>::random(vocab, order, seed, 1.5, 0.15);
}

/// A draft that differs from the target on purpose: for an order-2 target an order-1 blend
/// of the target with noise; for an order-1 target an unrelated order-2 chain.
inline MarkovModel<double> make_markov_draft(const MarkovModel<double>& target,
                                             std::uint64_t seed) {
  const std::size_t vocab = target.vocab_size();
  if (target.order() == 2) {
    return target.order1_blend(MarkovModel<double>::random(vocab, 1, seed, 1.5, 0.15), 0.5);
  }
  return MarkovModel<double>::random(vocab, 2, seed, 1.0, 0.15);
}

/// T = 0.7 with top-k (3 for V = 4, else V / 2) and top-p 0.9, applied to both sides.
inline SamplingOptions truncated_sampling(std::size_t vocab) {
  return {.temperature = 0.7, .top_k = vocab <= 4 ? 3 : vocab / 2, .top_p = 0.9};
}

}  // namespace specdec::testing
