// Control twin of stable_rows_fail.cpp: the same draft returning a view of rows it keeps
// compiles, and its rows are read in place; by value without the promise compiles too.
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
  std::vector<float> row{0.5F, 0.5F};
  std::size_t vocab_size() const { return 2; }
  std::span<const float> next_token_probabilities(std::span<const specdec::token_id>) {
    return row;
  }
};

struct ByValueDraft {
  std::size_t vocab_size() const { return 2; }
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) {
    return {0.5F, 0.5F};
  }
};

static_assert(specdec::SpeculativeDecoder<Target, Draft>::draft_rows_in_place);
static_assert(!specdec::SpeculativeDecoder<Target, ByValueDraft>::draft_rows_in_place);

}  // namespace

std::size_t stable_rows_ok_control() {
  Target target;
  Draft draft;
  specdec::SpeculativeDecoder<Target, Draft> decoder(target, draft);
  return decoder.vocab_size();
}
