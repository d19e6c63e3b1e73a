// Tests for examples/demo/kneser_ney.hpp, the demo's byte-level interpolated Kneser-Ney
// model: every row is a probability vector, hand-computed values on tiny corpora, the
// batched rows equal the single rows, and the model is a (Batched)LanguageModel.
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include "../examples/demo/kneser_ney.hpp"
#include "specdec/concepts.hpp"
#include "specdec/random.hpp"

namespace {

using specdec_demo::KneserNeyModel;
using specdec_demo::to_tokens;

constexpr std::string_view paragraph =
    "Speculative sampling drafts a few tokens with a cheap model and lets the expensive "
    "model check all of them in one call. Accepted tokens are kept; the first rejected one "
    "is replaced by a sample from the residual distribution, so the text has exactly the "
    "distribution of the expensive model.\n\tfor (int i = 0; i < n; ++i) sum += p[i];\n";

std::vector<double> row_of(KneserNeyModel& model, std::string_view context) {
  const auto tokens = to_tokens(context);
  const auto row = model.next_token_probabilities(tokens);
  return {row.begin(), row.end()};
}

}  // namespace

TEST_CASE("the Kneser-Ney model is a batched language model over 256 bytes", "[demo][kneser_ney]") {
  STATIC_REQUIRE(specdec::LanguageModel<KneserNeyModel>);
  STATIC_REQUIRE(specdec::BatchedLanguageModel<KneserNeyModel>);
  KneserNeyModel model(paragraph, 7);
  CHECK(model.vocab_size() == 256);
  CHECK(model.order() == 7);
}

TEST_CASE("Kneser-Ney rows are strictly positive and sum to 1 for every order and context",
          "[demo][kneser_ney]") {
  const auto corpus = to_tokens(paragraph);
  specdec::xoshiro256pp g(11);
  for (std::size_t order = 1; order <= KneserNeyModel::max_order; ++order) {
    KneserNeyModel model(paragraph, order);
    for (int trial = 0; trial < 200; ++trial) {
      // Half the contexts are pieces of the corpus (seen histories), half random bytes.
      const auto length = static_cast<std::size_t>(specdec::uniform_below(g, 12));
      std::vector<specdec::token_id> context;
      if (trial % 2 == 0) {
        const auto start = static_cast<std::size_t>(specdec::uniform_below(g, corpus.size() - 12));
        context.assign(corpus.begin() + static_cast<std::ptrdiff_t>(start),
                       corpus.begin() + static_cast<std::ptrdiff_t>(start + length));
      } else {
        for (std::size_t i = 0; i < length; ++i)
          context.push_back(static_cast<specdec::token_id>(specdec::uniform_below(g, 256)));
      }
      const auto row = model.next_token_probabilities(context);
      REQUIRE(row.size() == 256);
      double sum = 0.0;
      bool positive_and_finite = true;
      for (const double entry : row) {
        positive_and_finite = positive_and_finite && std::isfinite(entry) && entry > 0.0;
        sum += entry;
      }
      INFO("order " << order << ", context length " << length);
      REQUIRE(positive_and_finite);
      REQUIRE(sum == Catch::Approx(1.0).margin(1e-12));
    }
  }
}

TEST_CASE("Kneser-Ney hand-computed values on the corpus \"abab\" (order 2)",
          "[demo][kneser_ney]") {
  // Bigrams ab:2, ba:1 -> raw discount 1/(1 + 2) = 1/3 at level 2. Unigram continuation
  // counts a:1 (after b), b:1 (after a): no doubletons, so the fallback discount 0.5.
  KneserNeyModel model("abab", 2);
  CHECK(model.discount(2, true) == Catch::Approx(1.0 / 3.0));
  CHECK(model.discount(1, false) == 0.5);
  CHECK(model.discount(1, true) == 0.5);  // raw unigrams a:2, b:2 have no singletons

  // Continuation unigram: total 2, 2 types, backoff 0.5 * 2 / 2 to the uniform 1/256.
  const double unigram_a = (1.0 - 0.5) / 2.0 + 0.5 / 256.0;
  const double unigram_other = 0.5 / 256.0;

  const auto after_a = row_of(model, "a");  // c(a .) = 2 (b twice), 1 type
  CHECK(after_a['b'] == Catch::Approx((2.0 - 1.0 / 3.0) / 2.0 + (1.0 / 6.0) * unigram_a));
  CHECK(after_a['a'] == Catch::Approx((1.0 / 6.0) * unigram_a));
  CHECK(after_a['z'] == Catch::Approx((1.0 / 6.0) * unigram_other));

  const auto after_b = row_of(model, "b");  // c(b .) = 1 (a once), 1 type
  CHECK(after_b['a'] == Catch::Approx((1.0 - 1.0 / 3.0) + (1.0 / 3.0) * unigram_a));

  // An unseen history skips level 2: the continuation unigram itself.
  const auto after_c = row_of(model, "c");
  CHECK(after_c['a'] == Catch::Approx(unigram_a));
  CHECK(after_c['b'] == Catch::Approx(unigram_a));
  CHECK(after_c['c'] == Catch::Approx(unigram_other));

  // The empty context uses raw unigram counts (total 4, 2 types, discount 0.5).
  const auto first = row_of(model, "");
  CHECK(first['a'] == Catch::Approx((2.0 - 0.5) / 4.0 + 0.25 / 256.0));
  CHECK(first['q'] == Catch::Approx(0.25 / 256.0));
}

TEST_CASE("Kneser-Ney lower levels count continuations, not occurrences", "[demo][kneser_ney]") {
  // "xabyab": a follows x and y (continuation 2), b follows only a (continuation 1 although
  // "ab" occurs twice), y follows b (1), x starts the text (continuation 0 although it
  // occurs once). Counts-of-counts n1 = 2, n2 = 1 give D = 2 / (2 + 2) = 0.5; total 4,
  // 3 types.
  KneserNeyModel model("xabyab", 2);
  CHECK(model.discount(1, false) == Catch::Approx(0.5));
  const double to_uniform = 0.5 * 3.0 / 4.0 / 256.0;
  const auto unseen = row_of(model, "q");
  CHECK(unseen['a'] == Catch::Approx((2.0 - 0.5) / 4.0 + to_uniform));
  CHECK(unseen['b'] == Catch::Approx((1.0 - 0.5) / 4.0 + to_uniform));
  CHECK(unseen['x'] == Catch::Approx(to_uniform));
}

TEST_CASE("Kneser-Ney score_draft rows equal next_token_probabilities of each prefix",
          "[demo][kneser_ney]") {
  KneserNeyModel model(paragraph, 6);
  const auto context = to_tokens("the expensive m");
  const auto draft = to_tokens("odel check");
  const auto batched = model.score_draft(context, draft);
  REQUIRE(batched.rows() == draft.size() + 1);
  REQUIRE(batched.cols() == 256);
  std::vector<double> rows(batched.data(), batched.data() + batched.rows() * 256);
  for (std::size_t i = 0; i <= draft.size(); ++i) {
    std::vector<specdec::token_id> prefix = context;
    prefix.insert(prefix.end(), draft.begin(), draft.begin() + static_cast<std::ptrdiff_t>(i));
    const auto single = model.next_token_probabilities(prefix);
    const std::vector<double> expected(single.begin(), single.end());
    const std::vector<double> actual(rows.begin() + static_cast<std::ptrdiff_t>(i * 256),
                                     rows.begin() + static_cast<std::ptrdiff_t>((i + 1) * 256));
    REQUIRE(actual == expected);
  }
  // A context shorter than the order is scored as it stands.
  const auto short_batch = model.score_draft(to_tokens("t"), to_tokens("he"));
  std::vector<double> short_rows(short_batch.data(), short_batch.data() + 3 * 256);
  const auto single = model.next_token_probabilities(to_tokens("th"));
  CHECK(std::vector<double>(short_rows.begin() + 256, short_rows.begin() + 512) ==
        std::vector<double>(single.begin(), single.end()));
}

TEST_CASE("a higher-order Kneser-Ney model predicts its training text better",
          "[demo][kneser_ney]") {
  KneserNeyModel bigram(paragraph, 2);
  KneserNeyModel seven(paragraph, 7);
  const auto text = to_tokens(paragraph);
  double bigram_log_likelihood = 0.0;
  double seven_log_likelihood = 0.0;
  for (std::size_t i = 1; i < text.size(); ++i) {
    const std::span<const specdec::token_id> context(text.data(), i);
    const auto next = static_cast<std::size_t>(text[i]);
    bigram_log_likelihood += std::log(bigram.next_token_probabilities(context)[next]);
    seven_log_likelihood += std::log(seven.next_token_probabilities(context)[next]);
  }
  CHECK(seven_log_likelihood > bigram_log_likelihood);
}

TEST_CASE("Kneser-Ney rejects a bad order and an empty corpus", "[demo][kneser_ney]") {
  CHECK_THROWS_AS(KneserNeyModel("abc", 0), std::invalid_argument);
  CHECK_THROWS_AS(KneserNeyModel("abc", 9), std::invalid_argument);
  CHECK_THROWS_AS(KneserNeyModel("", 3), std::invalid_argument);
}
