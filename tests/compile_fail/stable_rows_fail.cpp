// Must not compile: a draft declares stable_rows (its rows outlive the step, read in place)
// but returns its rows by value, so they die before verification reads them. The
// diagnostic must name the promise. Twin: stable_rows_ok.cpp.
// expect-diagnostic: stable_rows: the draft's next_token_probabilities must return a view
#include <cstddef>
#include <span>
#include <vector>

#include "specdec/speculative_decoder.hpp"

namespace {

struct Target {
  std::size_t vocab_size() const { return 2; }
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) {
    return {0.5F, 0.5F};
  }
};

struct Draft {
  static constexpr bool stable_rows = true;
  std::size_t vocab_size() const { return 2; }
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) {
    return {0.5F, 0.5F};
  }
};

}  // namespace

int main() {
  Target target;
  Draft draft;
  specdec::SpeculativeDecoder<Target, Draft> decoder(target, draft);
  return static_cast<int>(decoder.vocab_size());
}
