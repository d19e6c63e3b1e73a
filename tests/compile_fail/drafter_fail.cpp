// Must not compile: the draft of a SpeculativeDecoder is neither a LanguageModel nor a
// ProposalDrafter (its propose() takes a std::vector instead of a std::span). The
// diagnostic must name the Drafter concept (clang also names HasPropose and HasVocabSize).
// Twin: drafter_ok.cpp.
// expect-diagnostic: satisfaction of .?.?.?Drafter<|does not satisfy .Drafter.
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

struct WrongProposer {  // `out` must be a std::span<specdec::token_id>
  std::size_t propose(std::span<const specdec::token_id>, std::vector<specdec::token_id>& out) {
    out.push_back(1);
    return 1;
  }
};

}  // namespace

int main() {
  Target target;
  WrongProposer draft;
  specdec::SpeculativeDecoder<Target, WrongProposer> decoder(target, draft);
  return static_cast<int>(decoder.vocab_size());
}
