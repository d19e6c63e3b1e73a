// Must not compile: a type without vocab_size() is passed as the target of a
// SpeculativeDecoder. The diagnostic must name the LanguageModel concept.
// Twin: speculative_decoder_ok.cpp.
// expect-diagnostic: LanguageModel
#include <cstddef>
#include <span>
#include <vector>

#include "specdec/speculative_decoder.hpp"

namespace {

struct NotAModel {  // no vocab_size()
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) { return {1.0F}; }
};

struct Draft {
  std::size_t vocab_size() const { return 1; }
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) { return {1.0F}; }
};

}  // namespace

int main() {
  NotAModel target;
  Draft draft;
  specdec::SpeculativeDecoder<NotAModel, Draft> decoder(target, draft);
  return static_cast<int>(decoder.vocab_size());
}
