// The fair peer the benchmarks compare specdec with: Algorithm 1 written the way vLLM's
// rejection sampler, Hugging Face's _speculative_sampling and FlashInfer structure it, by a
// competent C++ engineer, with none of specdec's checks.
//
//   chain:  for each draft x_i, accept when u_i * q_i(x_i) < p_i(x_i) (u_i < p/q without a
//           division); at the first rejection one pass writes max(0, p_i - q_i) into a
//           buffer allocated once, with its sum in sixteen float accumulators and the mass
//           of every block of 1024 entries, then one inverse-CDF draw walks the block masses
//           and then the entries of one block; after gamma acceptances the bonus token is
//           drawn from p_{gamma+1} the same way (its block masses summed first).
//   greedy: the argmax of each target row in turn (std::max_element), accepting while it
//           equals the draft; the argmax of the first mismatching row (or of p_{gamma+1})
//           is the token.
//   draft:  sampling x_i from a draft row: its block masses, then one inverse-CDF draw.
//   truncation (Truncation): top-k, temperature and top-p applied to every row before the
//           steps above, the way llama.cpp, vLLM and Hugging Face apply them: the k largest
//           entries in order over the whole row (std::partial_sort over the ids: a heap of
//           k, as llama.cpp's top-k), tempered weights for them, top-p over the sorted k,
//           and a dense row written (zeros elsewhere) for the dense Algorithm 1.
//
// Rows are trusted: no validation, no statistics.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/verification_result.hpp"

namespace specdec::peer {

inline constexpr std::size_t peer_block = 1024;

/// Sum of `count` floats in sixteen accumulators (vectorises without -ffast-math; with eight
/// and an unrolled reduction, GCC 12 under -march=native mixed scalar adds and shuffles into
/// the loop, 5x slower than the default build; sixteen with a loop reduction is the fastest
/// of 8, 16, 32 and 64 lanes in both builds).
[[nodiscard]] inline float block_sum(const float* values, std::size_t count) noexcept {
  constexpr std::size_t lanes_count = 16;
  std::array<float, lanes_count> lanes{};
  std::size_t j = 0;
  for (; j + lanes_count <= count; j += lanes_count) {
    for (std::size_t k = 0; k < lanes_count; ++k) lanes[k] += values[j + k];
  }
  for (; j < count; ++j) lanes[0] += values[j];
  for (std::size_t width = lanes_count / 2; width != 0; width /= 2) {
    for (std::size_t k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  }
  return lanes[0];
}

class Algorithm1 {
 public:
  explicit Algorithm1(std::size_t vocab_size)
      : vocab_(vocab_size),
        residual_(vocab_size),
        masses_((vocab_size + peer_block - 1) / peer_block) {}

  /// Algorithm 1 over gamma draft rows and gamma + 1 target rows (row-major, width V).
  template <class G>
  VerificationResult verify(std::span<const token_id> drafts, RowsView<const float> q,
                            RowsView<const float> p, G& g) {
    const std::size_t gamma = drafts.size();
    for (std::size_t i = 0; i < gamma; ++i) {
      const auto x = static_cast<std::size_t>(drafts[i]);
      const float p_x = p(i, x);
      const float q_x = q(i, x);
      if (uniform01<float>(g) * q_x < p_x) continue;
      // The residual max(0, p - q) and its block masses in one pass.
      const float* p_row = p.row(i).data();
      const float* q_row = q.row(i).data();
      float total = 0.0F;
      for (std::size_t b = 0; b < masses_.size(); ++b) {
        const std::size_t first = b * peer_block;
        const std::size_t count = std::min(peer_block, vocab_ - first);
        for (std::size_t j = first; j < first + count; ++j) {
          const float d = p_row[j] - q_row[j];
          residual_[j] = d > 0.0F ? d : 0.0F;
        }
        masses_[b] = block_sum(residual_.data() + first, count);
        total += masses_[b];
      }
      if (!(total > 0.0F)) return {i, draw(p_row, g), token_source::correction, true};
      return {i, walk(residual_.data(), total, g), token_source::correction, false};
    }
    return {gamma, draw(p.row(gamma).data(), g), token_source::bonus, false};
  }

  /// A sample from a row of weights (its block masses, then an inverse-CDF walk).
  template <class G>
  token_id draw(const float* row, G& g) {
    float total = 0.0F;
    for (std::size_t b = 0; b < masses_.size(); ++b) {
      const std::size_t first = b * peer_block;
      masses_[b] = block_sum(row + first, std::min(peer_block, vocab_ - first));
      total += masses_[b];
    }
    return walk(row, total, g);
  }

  /// Greedy verification: argmax per row, accepting while it equals the draft.
  [[nodiscard]] VerificationResult verify_greedy(std::span<const token_id> drafts,
                                                 RowsView<const float> p) const {
    const std::size_t gamma = drafts.size();
    for (std::size_t i = 0; i <= gamma; ++i) {
      const float* row = p.row(i).data();
      const auto best = static_cast<token_id>(std::max_element(row, row + vocab_) - row);
      if (i == gamma) return {gamma, best, token_source::bonus, false};
      if (best != drafts[i]) return {i, best, token_source::correction, false};
    }
    return {};
  }

 private:
  // Inverse CDF over the block masses just computed for `row`.
  template <class G>
  token_id walk(const float* row, float total, G& g) const {
    const float target = uniform01<float>(g) * total;
    float below = 0.0F;
    std::size_t b = 0;
    for (; b + 1 < masses_.size() && below + masses_[b] <= target; ++b) below += masses_[b];
    const std::size_t first = b * peer_block;
    const std::size_t last = std::min(first + peer_block, vocab_);
    std::size_t j = first;
    for (; j + 1 < last; ++j) {
      below += row[j] > 0.0F ? row[j] : 0.0F;
      if (below > target) break;
    }
    return static_cast<token_id>(j);
  }

  std::size_t vocab_;
  std::vector<float> residual_;
  std::vector<float> masses_;
};

/// Top-k, temperature, then top-p over a probability row, written densely (see the top).
class Truncation {
 public:
  /// top_k = 0: no top-k; the whole row is sorted (as Hugging Face's and vLLM's top-p sort
  /// the whole row before the cumulative sum).
  Truncation(std::size_t vocab_size, double temperature, std::size_t top_k, double top_p)
      : vocab_(vocab_size),
        inverse_temperature_(static_cast<float>(1.0 / temperature)),
        top_k_(top_k == 0 ? vocab_size : std::min(top_k, vocab_size)),
        top_p_(top_p),
        ids_(vocab_size),
        weights_(top_k_) {}

  void apply(const float* in, float* out) {
    for (std::size_t j = 0; j < vocab_; ++j) ids_[j] = static_cast<std::uint32_t>(j);
    const auto more = [in](std::uint32_t a, std::uint32_t b) {
      return in[a] > in[b] || (in[a] == in[b] && a < b);
    };
    // The k best in order over the whole row, as llama.cpp's top-k does (a heap of k); the
    // whole row sorted without top-k.
    if (top_k_ == vocab_) {
      std::sort(ids_.begin(), ids_.end(), more);
    } else {
      std::partial_sort(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(top_k_),
                        ids_.end(), more);
    }
    const float top = in[ids_[0]];
    float total = 0.0F;
    for (std::size_t k = 0; k < top_k_; ++k) {
      weights_[k] = inverse_temperature_ == 1.0F
                        ? in[ids_[k]]
                        : std::exp(std::log(in[ids_[k]] / top) * inverse_temperature_);
      total += weights_[k];
    }
    std::size_t kept = 0;
    float mass = 0.0F;
    while (kept < top_k_ && mass < static_cast<float>(top_p_) * total) mass += weights_[kept++];
    std::fill(out, out + vocab_, 0.0F);
    for (std::size_t k = 0; k < kept; ++k) out[ids_[k]] = weights_[k] / mass;
  }

 private:
  std::size_t vocab_;
  float inverse_temperature_;
  std::size_t top_k_;
  double top_p_;
  std::vector<std::uint32_t> ids_;
  std::vector<float> weights_;
};

}  // namespace specdec::peer
