// Tests for include/specdec/speculative_sampling.hpp (Algorithm 1's verification step).
//
//  - Deterministic: the acceptance rule at its boundaries with scripted uniforms, random
//    number consumption, laziness (rows after the first rejection are never touched, only
//    p_i(x_i) and q_i(x_i) matter before it), golden output, input overloads, bad input.
//  - Analytic exactness: every outcome of one step enumerated in double precision; the law
//    of gamma+1 emitted tokens equals the target's to 1e-12, and broken variants do not.
//  - Statistical exactness of the real code: chi-square of single positions over 20+ (p, q)
//    pairs and of whole steps (the joint law of n and the emitted tokens), with broken
//    variants that the same statistic rejects.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Core>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/random.hpp"
#include "specdec/speculative_sampling.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::token_id;
using specdec::token_source;
using specdec::VerificationResult;

/// A generator replaying given 64-bit outputs, to script the uniforms a step sees.
struct ScriptedGenerator {
  using result_type = std::uint64_t;
  std::vector<std::uint64_t> outputs;
  std::size_t next = 0;
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return std::numeric_limits<result_type>::max(); }
  result_type operator()() { return outputs.at(next++); }
};

/// The raw output for which uniform01<double> returns exactly u (u a multiple of 2^-53).
std::uint64_t bits_for(double u) {
  return static_cast<std::uint64_t>(std::ldexp(u, 53)) << 11U;
}
constexpr std::uint64_t all_ones = ~std::uint64_t{0};       // u = 1 - 2^-53
constexpr std::uint64_t one_ulp = std::uint64_t{1} << 11U;  // 2^-53 in u

/// Rows stored densely, viewed as RowsView.
template <class T>
struct Rows {
  std::size_t cols = 0;
  std::vector<T> data;
  Rows(std::size_t rows, std::size_t vocab_size, T fill = T(0))
      : cols(vocab_size), data(rows * vocab_size, fill) {}
  T& at(std::size_t row, std::size_t token) { return data[row * cols + token]; }
  [[nodiscard]] specdec::RowsView<const T> view() const {
    return {data.data(), data.size() / cols, cols};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Deterministic behaviour
// ---------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Acceptance is u * l * q(x) < p(x), evaluated without division",
                   "[speculative_sampling]", float, double) {
  using T = TestType;
  // Position 0 (token 1): p = 0.3, q = 0.6 (q = 2p exactly in T), ratio 1/2.
  Rows<T> p(2, 3);
  Rows<T> q(1, 3);
  p.at(0, 0) = T(0.7);
  p.at(0, 1) = T(0.3);
  q.at(0, 1) = T(0.6);
  q.at(0, 2) = T(1) - T(0.6);
  p.at(1, 2) = T(1);
  const std::vector<token_id> draft = {1};
  auto step = [&](std::vector<std::uint64_t> outputs, double lenience = 1.0) {
    ScriptedGenerator g{std::move(outputs)};
    const auto result = specdec::verify_speculative(draft, q.view(), p.view(), g, {lenience});
    CHECK(g.next == g.outputs.size());  // one uniform per examined position, one per draw
    return result;
  };
  // u just below 1/2 accepts; u = 1/2 rejects (u q == p); the bonus comes from p_2 = e_2.
  CHECK(step({bits_for(0.5) - one_ulp, 0}) == VerificationResult{1, 2, token_source::bonus});
  // Rejected: the residual max(0, p - q) = {0.7, 0, 0} gives token 0.
  CHECK(step({bits_for(0.5), all_ones}) == VerificationResult{0, 0, token_source::correction});
  // Lenience 1/2: l q(x) = 0.3 <= p(x), accepted even for the largest u.
  CHECK(step({all_ones, 0}, 0.5) == VerificationResult{1, 2, token_source::bonus});
  // Lenience 0.6: accept iff u < 0.3 / 0.36.
  CHECK(step({bits_for(0.8125), 0}, 0.6).accepted == 1);
  CHECK(step({bits_for(0.84375), all_ones}, 0.6).accepted == 0);
}

TEMPLATE_TEST_CASE("Edge cases of the ratio: q(x) = 0 accepts, p(x) = 0 rejects",
                   "[speculative_sampling]", float, double) {
  using T = TestType;
  Rows<T> p(2, 4);
  Rows<T> q(1, 4);
  auto step = [&](token_id x, std::uint64_t u_bits) {
    ScriptedGenerator g{{u_bits, bits_for(0.5)}};
    const std::vector<token_id> draft = {x};
    return specdec::verify_speculative(draft, q.view(), p.view(), g);
  };
  p.at(0, 0) = T(0.5);
  p.at(0, 1) = T(0.5);
  q.at(0, 1) = T(0.5);
  q.at(0, 2) = T(0.5);
  p.at(1, 3) = T(1);
  // q(0) = 0 < p(0): the ratio is +inf; accepted even for the largest u.
  CHECK(step(0, all_ones).accepted == 1);
  // q(1) = p(1): accepted for every u < 1.
  CHECK(step(1, all_ones).accepted == 1);
  // p(2) = 0 < q(2): rejected even for u = 0; the residual is {0.5, 0, 0, 0}.
  CHECK(step(2, 0) == VerificationResult{0, 0, token_source::correction, false});
  // p(3) = q(3) = 0 (proposed although neither model allows it): rejected; the residual
  // {0.5, 0, 0, 0} is not empty here...
  CHECK(step(3, 0) == VerificationResult{0, 0, token_source::correction, false});
  // ...but with p == q it is: the documented fallback draws from p and says so.
  Rows<T> same(1, 4);
  same.at(0, 0) = T(0.5);
  same.at(0, 1) = T(0.5);
  ScriptedGenerator g{{0, bits_for(0.75)}};
  const std::vector<token_id> impossible = {3};
  const auto fallback = specdec::verify_speculative(impossible, same.view(), Rows<T>(p).view(), g);
  CHECK(fallback == VerificationResult{0, 1, token_source::correction, true});
}

TEMPLATE_TEST_CASE("Proposal-only drafts: accept with p(x), residual p without x",
                   "[speculative_sampling]", float, double) {
  using T = TestType;
  Rows<T> p(3, 4);
  p.at(0, 0) = T(0.25);
  p.at(0, 1) = T(0.75);
  p.at(1, 2) = T(0.5);
  p.at(1, 3) = T(0.5);
  p.at(2, 0) = T(1);
  const std::vector<token_id> draft = {1, 2};
  auto step = [&](std::vector<std::uint64_t> outputs, double lenience = 1.0) {
    ScriptedGenerator g{std::move(outputs)};
    const auto result = specdec::verify_speculative_proposals(draft, p.view(), g, {lenience});
    CHECK(g.next == g.outputs.size());
    return result;
  };
  // Accept x_1 iff u < 0.75, x_2 iff u < 0.5.
  CHECK(step({bits_for(0.75) - one_ulp, bits_for(0.5) - one_ulp, 0}) ==
        VerificationResult{2, 0, token_source::bonus});
  // x_2 rejected: p_2 without token 2 is e_3.
  CHECK(step({0, bits_for(0.5), 0}) == VerificationResult{1, 3, token_source::correction});
  // x_1 rejected: p_1 without token 1 is e_0.
  CHECK(step({bits_for(0.75), all_ones}) == VerificationResult{0, 0, token_source::correction});
  // Lenience 0.5: accept iff u * 0.5 < p(x): x_2 always; x_1 always.
  CHECK(step({all_ones, all_ones, 0}, 0.5).accepted == 2);
  // Lenience 0.8: x_2 accepted iff u < 0.625; after a rejection token 2 keeps weight 0.
  CHECK(step({0, bits_for(0.625), all_ones}, 0.8) ==
        VerificationResult{1, 3, token_source::correction});
  CHECK(step({0, bits_for(0.625) - one_ulp, 0}, 0.8).accepted == 2);
}

TEMPLATE_TEST_CASE("Verification is lazy: rows after the first rejection are never read",
                   "[speculative_sampling]", float, double) {
  using T = TestType;
  // gamma = 8, the third draft is impossible under p (always rejected). Only rows 0..2 are
  // allocated; touching rows 3.. would run off the buffers (AddressSanitizer catches it).
  constexpr std::size_t vocab_size = 300;
  constexpr std::size_t gamma = 8;
  std::vector<T> p(3 * vocab_size, T(1) / T(vocab_size));
  std::vector<T> q(3 * vocab_size, T(1) / T(vocab_size));
  const std::vector<token_id> draft = {4, 5, 6, 7, 8, 9, 10, 11};
  p[2 * vocab_size + 6] = T(0);
  p[2 * vocab_size + 7] += T(1) / T(vocab_size);
  const specdec::RowsView<const T> target(p.data(), gamma + 1, vocab_size);
  const specdec::RowsView<const T> drafts(q.data(), gamma, vocab_size);
  specdec::xoshiro256pp g(1);
  for (int i = 0; i < 20; ++i) {
    const auto result = specdec::verify_speculative(draft, drafts, target, g);
    CHECK(result.accepted == 2);
    CHECK(result.token == 7);  // the only token with residual mass
    CHECK(result.source == token_source::correction);
    const auto proposals = specdec::verify_speculative_proposals(draft, target, g);
    CHECK(proposals.accepted <= 2);
  }
}

TEMPLATE_TEST_CASE("Before the rejection only p_i(x_i) and q_i(x_i) matter",
                   "[speculative_sampling]", float, double) {
  using T = TestType;
  // The same step on clean rows and on rows whose other entries at accepted positions are
  // NaN gives the same result for the same generator state.
  constexpr std::size_t vocab_size = 100;
  constexpr std::size_t gamma = 4;
  specdec::xoshiro256pp setup(9);
  Rows<T> p(gamma + 1, vocab_size);
  Rows<T> q(gamma, vocab_size);
  for (auto* rows : {&p.data, &q.data}) {
    for (auto& value : *rows) value = static_cast<T>(specdec::uniform01<double>(setup) / 50);
  }
  const std::vector<token_id> draft = {3, 1, 4, 1};
  for (int trial = 0; trial < 200; ++trial) {
    specdec::xoshiro256pp a(static_cast<std::uint64_t>(trial));
    const auto clean = specdec::verify_speculative(draft, q.view(), p.view(), a);
    Rows<T> poisoned_p = p;
    Rows<T> poisoned_q = q;
    for (std::size_t i = 0; i < clean.accepted; ++i) {
      for (std::size_t j = 0; j < vocab_size; ++j) {
        if (j == static_cast<std::size_t>(draft[i])) continue;
        poisoned_p.at(i, j) = std::numeric_limits<T>::quiet_NaN();
        poisoned_q.at(i, j) = std::numeric_limits<T>::quiet_NaN();
      }
    }
    specdec::xoshiro256pp b(static_cast<std::uint64_t>(trial));
    CHECK(specdec::verify_speculative(draft, poisoned_q.view(), poisoned_p.view(), b) == clean);
  }
}

TEMPLATE_TEST_CASE("Rows come as RowsView, Eigen row-major matrices or mutable views",
                   "[speculative_sampling]", float, double) {
  using T = TestType;
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Matrix p = Matrix::Constant(3, 5, T(0.2));
  Matrix q = Matrix::Constant(2, 5, T(0.2));
  const std::vector<token_id> draft = {1, 2};
  specdec::xoshiro256pp a(4);
  specdec::xoshiro256pp b(4);
  specdec::xoshiro256pp c(4);
  const auto from_eigen = specdec::verify_speculative(draft, q, p, a);
  const auto from_view =
      specdec::verify_speculative(draft, specdec::as_rows(q), specdec::as_rows(p), b);
  const specdec::RowsView<T> mutable_p(p.data(), 3, 5);
  const specdec::RowsView<T> mutable_q(q.data(), 2, 5);
  const auto from_mutable = specdec::verify_speculative(draft, mutable_q, mutable_p, c);
  CHECK(from_eigen == from_view);
  CHECK(from_eigen == from_mutable);
  CHECK(from_eigen.accepted == 2);  // p == q: always accepted
  CHECK(from_eigen.source == token_source::bonus);
  CHECK(specdec::verify_speculative_checked(draft, q, p, a).accepted == 2);
  CHECK(specdec::verify_speculative_proposals(draft, p, a).accepted <= 2);
  CHECK(specdec::verify_speculative_proposals_checked(draft, p, a).accepted <= 2);
  // gamma = 0: the bonus token from p_1.
  const std::vector<token_id> none;
  const auto bonus = specdec::verify_speculative(none, q.topRows(0), p.topRows(1), a);
  CHECK(bonus.accepted == 0);
  CHECK(bonus.source == token_source::bonus);
}

TEMPLATE_TEST_CASE("verify_speculative_checked rejects every kind of bad input",
                   "[speculative_sampling]", float, double) {
  using T = TestType;
  Rows<T> p(3, 4, T(0.25));
  Rows<T> q(2, 4, T(0.25));
  std::vector<token_id> draft = {1, 2};
  specdec::xoshiro256pp g(1);
  auto error_of = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const specdec::error& e) {
      return e.what();
    }
    return "no error";
  };
  auto checked = [&](double lenience = 1.0) {
    return error_of([&] {
      (void)specdec::verify_speculative_checked(draft, q.view(), p.view(), g, {lenience}, 7);
    });
  };
  auto contains = [](const std::string& text, const std::string& part) {
    INFO(text);
    return text.find(part) != std::string::npos;
  };
  CHECK(checked() == "no error");
  CHECK(contains(checked(0.0), "specdec: domain: lenience 0"));
  CHECK(contains(checked(1.5), "specdec: domain: lenience 1.5"));
  // Wrong number of rows.
  CHECK(contains(error_of([&] {
                   (void)specdec::verify_speculative_checked(draft, q.view(),
                                                             p.view().subrows(0, 2), g, {}, 7);
                 }),
                 "invalid_size: target rows (step 7): got 2 rows, expected 3"));
  CHECK(contains(error_of([&] {
                   (void)specdec::verify_speculative_checked(draft, q.view().subrows(0, 1),
                                                             p.view(), g, {}, 7);
                 }),
                 "invalid_size: draft rows (step 7): got 1 rows, expected 2"));
  // Row length != V (draft and target disagree).
  Rows<T> narrow(2, 3, T(1.0 / 3));
  CHECK(contains(error_of([&] {
                   (void)specdec::verify_speculative_checked(draft, narrow.view(), p.view(), g);
                 }),
                 "vocab_mismatch: draft rows have 3 entries but target rows have 4"));
  // Token ids.
  draft = {1, 4};
  CHECK(contains(checked(), "invalid_token: draft token at position 1 (step 7): id 4"));
  draft = {-2, 1};
  CHECK(contains(checked(), "invalid_token: draft token at position 0 (step 7): id -2"));
  draft = {1, 2};
  // Entries.
  p.at(2, 3) = std::numeric_limits<T>::quiet_NaN();
  CHECK(
      contains(checked(), "invalid_probability: target row 2 (step 7): entry for token 3 is NaN"));
  p.at(2, 3) = std::numeric_limits<T>::infinity();
  CHECK(contains(checked(), "target row 2 (step 7): entry for token 3 is infinite"));
  p.at(2, 3) = T(0.25);
  q.at(1, 0) = T(-0.25);
  CHECK(contains(checked(), "draft row 1 (step 7): entry for token 0 is negative"));
  q.at(1, 0) = T(0.25);
  for (std::size_t j = 0; j < 4; ++j) q.at(0, j) = T(0);
  CHECK(contains(checked(), "zero_mass: draft row 0 (step 7): all entries are zero"));
  for (std::size_t j = 0; j < 4; ++j) q.at(0, j) = T(0.3);
  CHECK(contains(checked(), "not_normalized: draft row 0 (step 7): entries sum to 1.2"));
  for (std::size_t j = 0; j < 4; ++j) q.at(0, j) = T(0.25);
  CHECK(checked() == "no error");
  // The proposal-only twin.
  auto proposals = [&](std::vector<token_id> tokens, specdec::RowsView<const T> rows) {
    return error_of(
        [&] { (void)specdec::verify_speculative_proposals_checked(tokens, rows, g, {}, 3); });
  };
  CHECK(proposals({1, 2}, p.view()) == "no error");
  CHECK(contains(proposals({1, 9}, p.view()), "invalid_token: draft token at position 1 (step 3)"));
  CHECK(contains(proposals({1}, p.view()),
                 "invalid_size: target rows (step 3): got 3 rows, expected 2"));
  p.at(1, 1) = T(2);
  CHECK(contains(proposals({1, 2}, p.view()), "not_normalized: target row 1 (step 3)"));
  CHECK(contains(error_of([&] {
                   (void)specdec::verify_speculative_proposals_checked(
                       std::vector<token_id>{}, p.view().subrows(0, 1), g, {-1.0});
                 }),
                 "domain"));
}
