// Test support for exact enumerations: the law of token sequences (sequence -> probability)
// and its distances. Shared by speculative_sampling_test.cpp and block_verification_test.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "specdec/concepts.hpp"

namespace specdec::testing {

/// Probability of each token sequence.
using TokenLaw = std::map<std::vector<token_id>, double>;

/// Calls visit(|a(s) - b(s)|) for every sequence s in either law (a missing one counts 0).
template <class Visit>
void for_each_difference(const TokenLaw& a, const TokenLaw& b, Visit&& visit) {
  for (const auto& [sequence, probability] : a) {
    const auto other = b.find(sequence);
    visit(std::abs(probability - (other == b.end() ? 0.0 : other->second)));
  }
  for (const auto& [sequence, probability] : b) {
    if (a.find(sequence) == a.end()) visit(probability);
  }
}

/// The largest difference of one sequence's probability.
inline double max_difference(const TokenLaw& a, const TokenLaw& b) {
  double worst = 0.0;
  for_each_difference(a, b, [&](double d) { worst = std::max(worst, d); });
  return worst;
}

/// The total-variation distance.
inline double law_total_variation(const TokenLaw& a, const TokenLaw& b) {
  double sum = 0.0;
  for_each_difference(a, b, [&](double d) { sum += d; });
  return sum / 2.0;
}

}  // namespace specdec::testing
