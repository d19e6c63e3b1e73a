// A downstream program that uses specdec the way an engine would: include the umbrella
// header, define a model, draw tokens with the library's generator and decode with tempered
// rows (the row kernels: compiled here, or once in specdec::kernels for consumer_kernels).
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
  UniformModel target;
  UniformModel draft;
  specdec::DecoderOptions options;
  options.sampling.temperature = 0.8;
  specdec::SpeculativeDecoder decoder(target, draft, options);
  const std::vector<specdec::token_id> prompt{1, 2};
  const auto result = decoder.generate(prompt, 16, 7);
  std::printf("specdec consumer: drew token %llu, decoded %zu tokens\n",
              static_cast<unsigned long long>(index), result.tokens.size());
  return index < 4 && result.tokens.size() == 16 ? 0 : 1;
}
