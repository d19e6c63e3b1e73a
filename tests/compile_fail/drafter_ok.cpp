// Control twin of drafter_fail.cpp: the same code with propose() taking a std::span compiles.
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

struct Proposer {
  std::size_t propose(std::span<const specdec::token_id>, std::span<specdec::token_id> out) {
    if (out.empty()) return 0;
    out[0] = 1;
    return 1;
  }
};

}  // namespace

std::size_t drafter_ok_control() {
  Target target;
  Proposer draft;
  specdec::SpeculativeDecoder<Target, Proposer> decoder(target, draft);
  return decoder.vocab_size();
}
