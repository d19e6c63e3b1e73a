// Must not compile: a type without vocab_size() is passed where a LanguageModel is needed.
// The diagnostic must name the concept. Twin: language_model_ok.cpp.
// expect-diagnostic: LanguageModel
#include <span>
#include <vector>

#include "specdec/concepts.hpp"

struct NotAModel {
  std::vector<float> next_token_probabilities(std::span<const specdec::token_id>) { return {1.0F}; }
};

template <specdec::LanguageModel M>
std::size_t vocabulary_of(const M& model) {
  return model.vocab_size();
}

int main() { return static_cast<int>(vocabulary_of(NotAModel{})); }
