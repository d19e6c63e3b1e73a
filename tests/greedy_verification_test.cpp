// Tests for include/specdec/greedy_verification.hpp: argmax with lowest-id ties, exact-match
// verification equal to plain greedy decoding and to Algorithm 1 on one-hot rows, laziness,
// and the checked entry point.
#include <algorithm>
#include <cstddef>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Core>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/speculative_sampling.hpp"
#include "support/guarded_memory.hpp"
#include "support/kernel_path_listener.hpp"

namespace {

using specdec::token_id;
using specdec::token_source;

/// A random row with entries on a coarse grid (so that ties are common), normalised.
template <class T>
std::vector<T> random_row(std::size_t size, specdec::xoshiro256pp& g, std::uint64_t levels = 8) {
  std::vector<T> row(size);
  T sum = 0;
  for (auto& entry : row) {
    entry = static_cast<T>(specdec::uniform_below(g, levels));
    sum += entry;
  }
  if (sum == T(0)) {
    row[0] = T(1);
    sum = T(1);
  }
  for (auto& entry : row) entry /= sum;
  return row;
}

template <class T>
std::size_t reference_argmax(const std::vector<T>& row) {
  // std::max_element returns the first of several equal maxima.
  return static_cast<std::size_t>(
      std::distance(row.begin(), std::max_element(row.begin(), row.end())));
}

/// Target model for decoding tests: a Markov chain, row = table[previous token].
template <class T>
struct MarkovTarget {
  std::size_t vocab_size;
  std::vector<std::vector<T>> table;
  MarkovTarget(std::size_t v, specdec::xoshiro256pp& g) : vocab_size(v) {
    for (std::size_t i = 0; i < v; ++i) table.push_back(random_row<T>(v, g, 4));
  }
  const std::vector<T>& next(token_id previous) const {
    return table[static_cast<std::size_t>(previous)];
  }
};

}  // namespace

TEMPLATE_TEST_CASE("argmax returns the lowest id among ties", "[greedy_verification]", float,
                   double) {
  using T = TestType;
  const std::vector<T> tie = {T(0.1), T(0.4), T(0.1), T(0.4)};
  CHECK(specdec::argmax(tie) == 1);
  CHECK(specdec::argmax(std::span<const T>(tie)) == 1);
  const std::vector<T> single = {T(1)};
  CHECK(specdec::argmax(single) == 0);
  specdec::xoshiro256pp g(11);
  for (const std::size_t size :
       {1UL, 2UL, 15UL, 16UL, 17UL, 63UL, 64UL, 65UL, 127UL, 1000UL, 4099UL}) {
    for (int trial = 0; trial < 20; ++trial) {
      auto row = random_row<T>(size, g, trial % 2 == 0 ? 3 : 1000);
      INFO("size " << size << " trial " << trial);
      CHECK(static_cast<std::size_t>(specdec::argmax(row)) == reference_argmax(row));
      // The maximum at the very end and at the very start.
      row.back() = T(2);
      CHECK(static_cast<std::size_t>(specdec::argmax(row)) == size - 1);
      row.front() = T(2);
      CHECK(specdec::argmax(row) == 0);
    }
  }
  const Eigen::VectorXd eigen_row = Eigen::VectorXd::LinSpaced(10, 0.0, 1.0);
  CHECK(specdec::argmax(eigen_row) == 9);
}

TEMPLATE_TEST_CASE("is_row_argmax honours ties", "[greedy_verification]", float, double) {
  using T = TestType;
  std::vector<T> row(200, T(0.001));
  row[70] = T(0.5);
  row[150] = T(0.5);
  CHECK(specdec::detail::is_row_argmax(row.data(), row.size(), 70));
  CHECK_FALSE(specdec::detail::is_row_argmax(row.data(), row.size(), 150));  // tie, later id
  CHECK_FALSE(specdec::detail::is_row_argmax(row.data(), row.size(), 3));
  row[199] = T(0.6);
  CHECK_FALSE(specdec::detail::is_row_argmax(row.data(), row.size(), 70));
  CHECK(specdec::detail::is_row_argmax(row.data(), row.size(), 199));
}

TEMPLATE_TEST_CASE("is_row_argmax stops at the first witness", "[greedy_verification]", float,
                   double) {
  // Only the entries up to the end of the scan chunk holding the first witness (or the
  // candidate's chunk, whichever is later) are readable; the rest of the row lies in a guard
  // page (support/guarded_memory.hpp), so a scan that went on past the witness would crash
  // the test. The answer itself cannot tell: with a witness it is false whatever follows.
  using T = TestType;
  constexpr std::size_t block = specdec::detail::scan_chunk;
  struct Case {
    std::size_t candidate;
    std::size_t witness;
    T witness_value;  // the candidate's value is 0.3
    std::size_t readable;
    const char* what;
  };
  const std::vector<Case> cases = {
      {10, 2 * block + 5, T(0.5), 3 * block, "witness two blocks after the candidate"},
      {10, 50, T(0.5), block, "witness later in the candidate's block"},
      {10, 3, T(0.3), block, "tie with an earlier id in the candidate's block"},
      {block + 10, 7, T(0.3), 2 * block, "tie with an earlier id in an earlier block"},
      {2 * block + 1, block + 9, T(0.9), 3 * block, "witness in an earlier block"},
  };
  for (const std::size_t size : {5 * block, 5 * block + 44, 40 * block + 3}) {
    for (const Case& c : cases) {
      INFO(c.what << ", row size " << size);
      specdec::testing::GuardedArray<T> row(c.readable, size - c.readable);
      std::fill(row.data(), row.data() + c.readable, T(0.001));
      row[c.candidate] = T(0.3);
      row[c.witness] = c.witness_value;
      CHECK_FALSE(specdec::detail::is_row_argmax(row.data(), size, c.candidate));
    }
  }
  CHECK(specdec::testing::GuardedArray<T>::enforced);
}

TEMPLATE_TEST_CASE("verify_greedy accepts exact matches and corrects the first mismatch",
                   "[greedy_verification]", float, double) {
  using T = TestType;
  // V = 4, gamma = 3; argmaxes of the rows: 2, 0, 3, 1.
  const std::vector<T> rows = {T(0.1),  T(0.2), T(0.6),  T(0.1),  //
                               T(0.4),  T(0.3), T(0.2),  T(0.1),  //
                               T(0.1),  T(0.1), T(0.1),  T(0.7),  //
                               T(0.25), T(0.5), T(0.25), T(0)};   //
  const specdec::RowsView<const T> target(rows.data(), 4, 4);
  using R = specdec::VerificationResult;
  CHECK(specdec::verify_greedy(std::vector<token_id>{2, 0, 3}, target) ==
        R{3, 1, token_source::bonus, false});
  CHECK(specdec::verify_greedy(std::vector<token_id>{2, 1, 3}, target) ==
        R{1, 0, token_source::correction, false});
  CHECK(specdec::verify_greedy(std::vector<token_id>{0, 0, 3}, target) ==
        R{0, 2, token_source::correction, false});
  CHECK(specdec::verify_greedy(std::vector<token_id>{2, 0, 1}, target) ==
        R{2, 3, token_source::correction, false});
  // gamma = 0: just the argmax of p_1.
  CHECK(specdec::verify_greedy(std::vector<token_id>{}, target.subrows(0, 1)) ==
        R{0, 2, token_source::bonus, false});
  // Eigen row-major matrices and views of non-const data work too.
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> matrix(4, 4);
  std::copy(rows.begin(), rows.end(), matrix.data());
  CHECK(specdec::verify_greedy(std::vector<token_id>{2, 1, 3}, matrix) ==
        R{1, 0, token_source::correction, false});
  std::vector<T> mutable_rows = rows;
  const specdec::RowsView<T> mutable_view(mutable_rows.data(), 4, 4);
  CHECK(specdec::verify_greedy(std::vector<token_id>{2, 0, 3}, mutable_view).accepted == 3);
}

TEMPLATE_TEST_CASE("Speculative greedy decoding equals plain greedy decoding",
                   "[greedy_verification]", float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(2024);
  for (const std::size_t vocab_size : {2UL, 5UL, 70UL, 300UL}) {
    const MarkovTarget<T> target(vocab_size, g);
    constexpr std::size_t length = 200;
    // Plain greedy decoding.
    std::vector<token_id> plain = {0};
    while (plain.size() < length) plain.push_back(specdec::argmax(target.next(plain.back())));
    // Speculative: drafts are right with probability 1/2, else a random token.
    std::vector<token_id> speculative = {0};
    while (speculative.size() < length) {
      const std::size_t gamma = 1 + specdec::uniform_below(g, 5);
      std::vector<token_id> draft;
      std::vector<T> rows;
      token_id previous = speculative.back();
      for (std::size_t i = 0; i <= gamma; ++i) {
        const auto& row = target.next(previous);
        rows.insert(rows.end(), row.begin(), row.end());
        if (i == gamma) break;
        const token_id guess = specdec::uniform_below(g, 2) == 0
                                   ? specdec::argmax(row)
                                   : static_cast<token_id>(specdec::uniform_below(g, vocab_size));
        draft.push_back(guess);
        previous = guess;
      }
      const auto result = specdec::verify_greedy(
          draft, specdec::RowsView<const T>(rows.data(), gamma + 1, vocab_size));
      REQUIRE(result.accepted <= gamma);
      speculative.insert(speculative.end(), draft.begin(),
                         draft.begin() + static_cast<std::ptrdiff_t>(result.accepted));
      speculative.push_back(result.token);
    }
    speculative.resize(length);
    INFO("V = " << vocab_size);
    CHECK(speculative == plain);
  }
}

TEMPLATE_TEST_CASE("verify_greedy equals Algorithm 1 fed one-hot rows", "[greedy_verification]",
                   float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(99);
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t vocab_size = 1 + specdec::uniform_below(g, 40);
    const std::size_t gamma = specdec::uniform_below(g, 6);
    std::vector<T> target_rows;
    std::vector<T> one_hot_target((gamma + 1) * vocab_size, T(0));
    std::vector<T> one_hot_draft(gamma * vocab_size, T(0));
    std::vector<token_id> draft;
    for (std::size_t i = 0; i <= gamma; ++i) {
      const auto row = random_row<T>(vocab_size, g, 3);
      target_rows.insert(target_rows.end(), row.begin(), row.end());
      const auto best = static_cast<std::size_t>(specdec::argmax(row));
      one_hot_target[i * vocab_size + best] = T(1);
      if (i < gamma) {
        // Mostly the argmax so that runs of acceptances happen.
        const auto x =
            specdec::uniform_below(g, 3) != 0 ? best : specdec::uniform_below(g, vocab_size);
        draft.push_back(static_cast<token_id>(x));
        one_hot_draft[i * vocab_size + x] = T(1);
      }
    }
    const auto greedy = specdec::verify_greedy(
        draft, specdec::RowsView<const T>(target_rows.data(), gamma + 1, vocab_size));
    const specdec::RowsView<const T> p(one_hot_target.data(), gamma + 1, vocab_size);
    const specdec::RowsView<const T> q(one_hot_draft.data(), gamma, vocab_size);
    INFO("trial " << trial);
    CHECK(specdec::verify_speculative(draft, q, p, g) == greedy);
    CHECK(specdec::verify_speculative_proposals(draft, p, g) == greedy);
  }
}

TEMPLATE_TEST_CASE("verify_greedy never reads rows after the first mismatch",
                   "[greedy_verification]", float, double) {
  using T = TestType;
  // gamma = 6 but only rows 0..2 are readable: x_3 is not the argmax of row 2. Rows 3..6 lie
  // in a guard page (support/guarded_memory.hpp): reading them would crash the test.
  constexpr std::size_t vocab_size = 300;
  specdec::testing::GuardedArray<T> rows(3 * vocab_size, 4 * vocab_size);
  std::fill(rows.data(), rows.data() + 3 * vocab_size, T(0.5) / T(vocab_size - 1));
  rows[0 * vocab_size + 10] = T(0.5);
  rows[1 * vocab_size + 20] = T(0.5);
  rows[2 * vocab_size + 290] = T(0.5);
  const specdec::RowsView<const T> target(rows.data(), 7, vocab_size);
  const std::vector<token_id> draft = {10, 20, 31, 40, 50, 60};
  const auto result = specdec::verify_greedy(draft, target);
  CHECK(result == specdec::VerificationResult{2, 290, token_source::correction, false});
  CHECK(specdec::testing::GuardedArray<T>::enforced);
}

TEMPLATE_TEST_CASE("verify_greedy_checked rejects bad input", "[greedy_verification]", float,
                   double) {
  using T = TestType;
  std::vector<T> rows = {T(0.5), T(0.5), T(0.75), T(0.25)};
  const specdec::RowsView<const T> target(rows.data(), 2, 2);
  CHECK(specdec::verify_greedy_checked(std::vector<token_id>{0}, target).accepted == 1);
  auto code_of = [&](std::vector<token_id> draft, specdec::RowsView<const T> view) {
    try {
      (void)specdec::verify_greedy_checked(draft, view, 3);
    } catch (const specdec::error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find("(step 3)") != std::string::npos);
      return e.code();
    }
    return specdec::errc{};
  };
  CHECK(code_of({0, 1}, target) == specdec::errc::invalid_size);  // 2 rows for gamma 2
  CHECK(code_of({2}, target) == specdec::errc::invalid_token);
  CHECK(code_of({-1}, target) == specdec::errc::invalid_token);
  rows[3] = std::numeric_limits<T>::quiet_NaN();
  CHECK(code_of({0}, target) == specdec::errc::invalid_probability);
  rows[2] = T(0);
  rows[3] = T(0);
  CHECK(code_of({0}, target) == specdec::errc::zero_mass);
  rows[2] = T(3);
  CHECK(code_of({0}, target) == specdec::errc::not_normalized);
  CHECK(code_of({}, specdec::RowsView<const T>(rows.data(), 1, 0)) == specdec::errc::invalid_size);
}

TEMPLATE_TEST_CASE("verify_greedy_screened: verify_greedy's answer, and every bad row it reads",
                   "[greedy_verification]", float, double) {
  // The decoder's greedy validation is fused into the argmax scans: on valid rows the
  // screened verification must give exactly verify_greedy's result, and a NaN, negative or
  // infinite entry anywhere in a row it takes a token from (every lane, the tails of every
  // chunk, the candidate itself), or an all-zero row, must stop it at that row.
  using T = TestType;
  constexpr T nan = std::numeric_limits<T>::quiet_NaN();
  constexpr T inf = std::numeric_limits<T>::infinity();
  constexpr std::size_t chunk = specdec::detail::scan_chunk;
  specdec::xoshiro256pp g(91);
  for (const std::size_t size : {std::size_t{1}, std::size_t{7}, std::size_t{33}, chunk - 1, chunk,
                                 chunk + 1, 3 * chunk + 45}) {
    for (int trial = 0; trial < 12; ++trial) {
      const std::size_t gamma = specdec::uniform_below(g, 4);
      std::vector<T> rows;
      for (std::size_t i = 0; i <= gamma; ++i) {
        const auto row = random_row<T>(size, g, trial % 2 == 0 ? 3 : 64);
        rows.insert(rows.end(), row.begin(), row.end());
      }
      // Drafts: the argmax (accepted) until a random position, then a random token.
      const std::size_t mismatch = specdec::uniform_below(g, gamma + 1);
      std::vector<token_id> drafts;
      for (std::size_t i = 0; i < gamma; ++i) {
        const std::span<const T> row(rows.data() + i * size, size);
        drafts.push_back(i < mismatch ? specdec::argmax(row)
                                      : static_cast<token_id>(specdec::uniform_below(g, size)));
      }
      const specdec::RowsView<const T> view(rows.data(), gamma + 1, size);
      std::size_t bad = 0;
      const auto screened = specdec::detail::verify_greedy_screened<T>(drafts, view, bad);
      const auto plain = specdec::verify_greedy(std::span<const token_id>(drafts), view);
      INFO("size " << size << ", gamma " << gamma << ", trial " << trial);
      REQUIRE(bad == specdec::detail::no_index);
      CHECK(screened.accepted == plain.accepted);
      CHECK(screened.token == plain.token);
      CHECK(screened.source == plain.source);
      // Poison one entry of a row the verification takes a token from.
      const std::size_t poisoned_row = specdec::uniform_below(g, plain.accepted + 1);
      const std::size_t entry =
          trial < 3 ? (poisoned_row < gamma ? static_cast<std::size_t>(drafts[poisoned_row])
                                            : specdec::uniform_below(g, size))
                    : specdec::uniform_below(g, size);
      for (const T poison : {nan, T(-0.25), -inf, inf}) {
        std::vector<T> bad_rows = rows;
        bad_rows[poisoned_row * size + entry] = poison;
        std::size_t where = 0;
        (void)specdec::detail::verify_greedy_screened<T>(
            drafts, specdec::RowsView<const T>(bad_rows.data(), gamma + 1, size), where);
        INFO("poison " << poison << " at row " << poisoned_row << ", entry " << entry);
        CHECK(where == poisoned_row);
      }
      std::vector<T> zero_rows = rows;
      std::fill(zero_rows.begin() + static_cast<std::ptrdiff_t>(poisoned_row * size),
                zero_rows.begin() + static_cast<std::ptrdiff_t>((poisoned_row + 1) * size), T(0));
      std::size_t where = 0;
      (void)specdec::detail::verify_greedy_screened<T>(
          drafts, specdec::RowsView<const T>(zero_rows.data(), gamma + 1, size), where);
      CHECK(where == poisoned_row);
      // -0.0 is a valid zero; a row only of them and one positive entry is valid.
      std::vector<T> signed_zero_rows = rows;
      for (std::size_t j = 0; j < size; ++j) {
        T& value = signed_zero_rows[poisoned_row * size + j];
        if (value == T(0)) value = -T(0);
      }
      (void)specdec::detail::verify_greedy_screened<T>(
          drafts, specdec::RowsView<const T>(signed_zero_rows.data(), gamma + 1, size), where);
      CHECK(where == specdec::detail::no_index);
    }
  }
}
