// Control twin of language_model_fail.cpp: the same code with vocab_size() compiles.
#include <cstddef>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"

namespace {

struct AModel {
  std::size_t vocab_size() const { return 1; }
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) { return {1.0F}; }
};

template <specdec::LanguageModel M>
std::size_t vocabulary_of(const M& model) {
  return model.vocab_size();
}

}  // namespace

std::size_t language_model_ok_control() { return vocabulary_of(AModel{}); }
