// Tests for include/specdec/drafters/count_models.hpp: add-k unigram and bigram rows, the
// unigram backoff, and boundary errors.
#include <cstddef>
#include <numeric>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/concepts.hpp"
#include "specdec/drafters/count_models.hpp"
#include "specdec/error.hpp"

namespace {

using specdec::token_id;
using Tokens = std::vector<token_id>;

template <class T>
void check_row(std::span<const T> row, const std::vector<double>& expected) {
  const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-14;
  REQUIRE(row.size() == expected.size());
  for (std::size_t x = 0; x < row.size(); ++x)
    CHECK(static_cast<double>(row[x]) == Catch::Approx(expected[x]).margin(tolerance));
  const double sum = std::accumulate(row.begin(), row.end(), 0.0,
                                     [](double s, T v) { return s + static_cast<double>(v); });
  CHECK(sum == Catch::Approx(1.0).margin(tolerance * 10));
}

template <class E>
specdec::errc error_code(E&& expression) {
  try {
    expression();
  } catch (const specdec::error& e) {
    return e.code();
  }
  FAIL("expected specdec::error");
  return specdec::errc::model_failure;
}

}  // namespace

TEMPLATE_TEST_CASE("UnigramModel is add-k smoothed frequency", "[drafters][count_models]", float,
                   double) {
  STATIC_REQUIRE(specdec::LanguageModel<specdec::UnigramModel<TestType>>);
  STATIC_REQUIRE(specdec::Drafter<specdec::UnigramModel<TestType>>);
  const Tokens corpus = {0, 0, 1, 2, 2, 2};
  const specdec::UnigramModel<TestType> laplace(corpus, 4);
  CHECK(laplace.vocab_size() == 4);
  CHECK(laplace.count(2) == 3);
  CHECK(laplace.corpus_size() == 6);
  check_row(laplace.next_token_probabilities(Tokens{1, 2}), {0.3, 0.2, 0.4, 0.1});
  const specdec::UnigramModel<TestType> raw(corpus, 4, 0.0);
  check_row(raw.next_token_probabilities(Tokens{}), {2.0 / 6, 1.0 / 6, 3.0 / 6, 0.0});
  const specdec::UnigramModel<TestType> empty(Tokens{}, 5, 0.25);
  check_row(empty.next_token_probabilities(Tokens{}), {0.2, 0.2, 0.2, 0.2, 0.2});
}

TEMPLATE_TEST_CASE("BigramModel is add-k smoothed pair frequency with unigram backoff",
                   "[drafters][count_models]", float, double) {
  STATIC_REQUIRE(specdec::LanguageModel<specdec::BigramModel<TestType>>);
  // Pairs: 0->1 twice, 1->0 twice, 0->2 once, 2->3 once; 3 is never followed.
  const Tokens corpus = {0, 1, 0, 1, 0, 2, 3};
  specdec::BigramModel<TestType> bigram(corpus, 4, 0.5);
  CHECK(bigram.count(0, 1) == 2);
  CHECK(bigram.count(0, 2) == 1);
  CHECK(bigram.count(0, 3) == 0);
  check_row(bigram.next_token_probabilities(Tokens{3, 0}), {0.1, 0.5, 0.3, 0.1});
  check_row(bigram.next_token_probabilities(Tokens{2}), {0.5 / 3, 0.5 / 3, 0.5 / 3, 1.5 / 3});
  const std::vector<double> unigram = {3.5 / 9, 2.5 / 9, 1.5 / 9, 1.5 / 9};
  check_row(bigram.next_token_probabilities(Tokens{0, 3}), unigram);  // 3 never followed
  check_row(bigram.next_token_probabilities(Tokens{}), unigram);
  // k = 0: exact conditional frequencies.
  specdec::BigramModel<TestType> raw(corpus, 4, 0.0);
  check_row(raw.next_token_probabilities(Tokens{0}), {0.0, 2.0 / 3, 1.0 / 3, 0.0});
}

TEST_CASE("BigramModel stores counts sparsely", "[drafters][count_models]") {
  constexpr std::size_t vocab = 200000;
  Tokens corpus;
  for (int i = 0; i < 1000; ++i) corpus.push_back(static_cast<token_id>((i * 7919) % 200000));
  specdec::BigramModel<float> bigram(corpus, vocab, 0.01);
  const auto row = bigram.next_token_probabilities(Tokens{corpus[10]});
  REQUIRE(row.size() == vocab);
  const double denominator = 1.0 + 0.01 * static_cast<double>(vocab);
  CHECK(static_cast<double>(row[static_cast<std::size_t>(corpus[11])]) ==
        Catch::Approx(1.01 / denominator));
}

TEST_CASE("Count models reject bad corpora, options and contexts", "[drafters][count_models]") {
  const Tokens corpus = {0, 1, 2};
  CHECK(error_code([&] { specdec::UnigramModel<float>(corpus, 0); }) ==
        specdec::errc::invalid_size);
  CHECK(error_code([&] { specdec::UnigramModel<float>(corpus, 3, -1.0); }) ==
        specdec::errc::invalid_option);
  CHECK(error_code([&] {
          specdec::BigramModel<float>(Tokens{0, 5, 1}, 3);
        }) == specdec::errc::invalid_token);
  CHECK(error_code([&] { specdec::BigramModel<double>(Tokens{}, 3, 0.0); }) ==
        specdec::errc::zero_mass);
  specdec::BigramModel<float> bigram(corpus, 3);
  CHECK(error_code([&] {
          static_cast<void>(bigram.next_token_probabilities(Tokens{0, 3}));
        }) == specdec::errc::invalid_token);
  try {
    specdec::UnigramModel<float>(Tokens{0, 1, -4}, 3);
    FAIL("expected specdec::error");
  } catch (const specdec::error& e) {
    CHECK(std::string_view(e.what()).find("position 2") != std::string_view::npos);
  }
}
