// Test support for the exact-law tests of block and traversal verification: toy models whose
// rows depend on the drafted prefix, sequence laws extended by target sampling, and the
// bisection over the 53-bit uniforms that finds where the real code's outcome changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/random.hpp"
#include "support/token_law.hpp"

namespace specdec::testing {

/// uniform01<double> values per unit: the grid the bisections run over.
inline constexpr std::uint64_t uniform_grid = std::uint64_t{1} << 53U;

/// A model whose next-token row depends on the drafted prefix (its length and last two
/// tokens): rows drawn at random, with zeros, or given.
struct PrefixModel {
  std::size_t vocab = 0;
  std::vector<std::vector<double>> rows;

  [[nodiscard]] const std::vector<double>& operator()(std::span<const token_id> prefix) const {
    std::size_t key = prefix.size() * 7;
    if (!prefix.empty()) key += 3 * static_cast<std::size_t>(prefix.back());
    if (prefix.size() > 1) key += 5 * static_cast<std::size_t>(prefix[prefix.size() - 2]);
    return rows[key % rows.size()];
  }
};

inline std::vector<double> random_row(std::size_t vocab, xoshiro256pp& g, double zeros) {
  std::vector<double> row(vocab);
  double total = 0.0;
  for (auto& x : row) {
    const double u = uniform01<double>(g);
    x = uniform01<double>(g) < zeros ? 0.0 : u * u * u + 1e-3;
    total += x;
  }
  if (total == 0.0) {
    row[uniform_below(g, vocab)] = 1.0;
    total = 1.0;
  }
  for (auto& x : row) x /= total;
  return row;
}

inline PrefixModel random_model(std::size_t vocab, xoshiro256pp& g, double zeros) {
  PrefixModel model{vocab, {}};
  for (int k = 0; k < 11; ++k) model.rows.push_back(random_row(vocab, g, zeros));
  return model;
}

/// The smallest k in [low, grid] with stop(k) true (stop monotone; grid if none).
template <class Stop>
std::uint64_t first_true(std::uint64_t low, Stop&& stop) {
  std::uint64_t high = uniform_grid;  // stop(grid) counts as true
  while (low < high) {
    const std::uint64_t mid = low + (high - low) / 2;
    if (stop(mid)) {
      high = mid;
    } else {
      low = mid + 1;
    }
  }
  return low;
}

/// Extends every sequence to `length` tokens by sampling from the target.
inline TokenLaw extend(const TokenLaw& law, const PrefixModel& target, std::size_t length) {
  TokenLaw extended;
  for (const auto& [sequence, probability] : law) {
    std::vector<std::pair<std::vector<token_id>, double>> stack{{sequence, probability}};
    while (!stack.empty()) {
      auto [prefix, mass] = stack.back();
      stack.pop_back();
      if (prefix.size() >= length) {
        extended[prefix] += mass;
        continue;
      }
      const auto& p = target(prefix);
      for (std::size_t t = 0; t < p.size(); ++t) {
        if (p[t] == 0.0) continue;
        auto next = prefix;
        next.push_back(static_cast<token_id>(t));
        stack.emplace_back(std::move(next), mass * p[t]);
      }
    }
  }
  return extended;
}

}  // namespace specdec::testing
