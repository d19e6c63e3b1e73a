// Control twin of speculative_decoder_fail.cpp: the same code with vocab_size() compiles.
#include <cstddef>
#include <span>
#include <vector>

#include "specdec/speculative_decoder.hpp"

namespace {

struct AModel {
  std::size_t vocab_size() const { return 1; }
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) { return {1.0F}; }
};

struct Draft {
  std::size_t vocab_size() const { return 1; }
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) { return {1.0F}; }
};

}  // namespace

std::size_t speculative_decoder_ok_control() {
  AModel target;
  Draft draft;
  specdec::SpeculativeDecoder<AModel, Draft> decoder(target, draft);
  return decoder.vocab_size();
}
