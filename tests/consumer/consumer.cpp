// A downstream program that uses specdec the way an engine would: include the umbrella
// header, define a model, draw tokens with the library's generator.
#include <cstdio>
#include <span>
#include <vector>

#include <specdec/specdec.hpp>

namespace {

struct UniformModel {
  std::vector<float> row = std::vector<float>(4, 0.25F);
  std::size_t vocab_size() const { return row.size(); }
  std::span<const float> next_token_probabilities(std::span<const specdec::token_id>) {
    return row;
  }
};

static_assert(specdec::LanguageModel<UniformModel>);

}  // namespace

int main() {
  specdec::xoshiro256pp g(1);
  const auto index = specdec::uniform_below(g, UniformModel{}.vocab_size());
  std::printf("specdec consumer: drew token %llu\n", static_cast<unsigned long long>(index));
  return index < 4 ? 0 : 1;
}
