// specdec demo (placeholder until the full demo lands): builds two toy bigram models that
// satisfy specdec::LanguageModel and samples text from the target with the library's
// portable random numbers, printing the sequence and the exact acceptance rate
// beta = sum_x min(p(x), q(x)) of the first position.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/random.hpp"

namespace {

using specdec::token_id;

// A bigram model over a tiny alphabet; `sharpness` makes the target more peaked.
class BigramModel {
 public:
  BigramModel(std::string alphabet, double sharpness) : alphabet_(std::move(alphabet)) {
    const std::size_t v = alphabet_.size();
    table_.assign(v * v, 0.0);
    for (std::size_t previous = 0; previous < v; ++previous) {
      double total = 0.0;
      for (std::size_t next = 0; next < v; ++next) {
        const double weight =
            1.0 / (1.0 + sharpness * static_cast<double>((next + v - previous - 1) % v));
        table_[previous * v + next] = weight;
        total += weight;
      }
      for (std::size_t next = 0; next < v; ++next) table_[previous * v + next] /= total;
    }
  }

  [[nodiscard]] std::size_t vocab_size() const { return alphabet_.size(); }

  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    const auto previous =
        context.empty() ? std::size_t{0} : static_cast<std::size_t>(context.back());
    return {table_.data() + previous * vocab_size(), vocab_size()};
  }

  [[nodiscard]] char letter(token_id id) const { return alphabet_[static_cast<std::size_t>(id)]; }

 private:
  std::string alphabet_;
  std::vector<double> table_;
};

static_assert(specdec::LanguageModel<BigramModel>);

template <specdec::LanguageModel Model, class Generator>
token_id sample_next(Model& model, std::span<const token_id> context, Generator& g) {
  const auto row = specdec::as_span(model.next_token_probabilities(context));
  const double u = specdec::uniform01<double>(g);
  double cumulative = 0.0;
  for (std::size_t i = 0; i < row.size(); ++i) {
    cumulative += row[i];
    if (u < cumulative) return static_cast<token_id>(i);
  }
  // u fell in the rounding gap above the last partial sum: take the last non-zero entry.
  for (std::size_t i = row.size(); i-- > 0;)
    if (row[i] > 0.0) return static_cast<token_id>(i);
  return 0;
}

}  // namespace

int main() {
  BigramModel target("abcdefgh", 4.0);
  BigramModel draft("abcdefgh", 1.0);
  specdec::xoshiro256pp g(2026);
  std::vector<token_id> text = {0};
  for (int i = 0; i < 40; ++i) text.push_back(sample_next(target, text, g));
  std::string letters;
  for (token_id t : text) letters += target.letter(t);
  const auto p = target.next_token_probabilities(std::span<const token_id>(text.data(), 1));
  const auto q = draft.next_token_probabilities(std::span<const token_id>(text.data(), 1));
  double beta = 0.0;
  for (std::size_t i = 0; i < p.size(); ++i) beta += std::min(p[i], q[i]);
  std::printf("specdec demo (toy bigram target and draft, V = %zu)\n", target.vocab_size());
  std::printf("sampled from the target: %s\n", letters.c_str());
  std::printf("acceptance rate beta = sum_x min(p, q) after 'a': %.4f\n", beta);
  return 0;
}
