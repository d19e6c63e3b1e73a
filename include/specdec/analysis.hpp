// specdec — acceptance-rate mathematics of speculative decoding (paper Sec. 3, App. A.5).
//
// Notation: p = target distribution, q = draft distribution, beta = sum_x min(p(x), q(x))
// the acceptance rate at one position (Def. 3.1, Thm. 3.5), alpha = E[beta] (Cor. 3.6),
// gamma the number of drafted tokens per step, c the draft/target walltime cost ratio
// (Def. 3.7), c_hat the draft/target arithmetic-operations ratio (Def. 3.10).
//
// Everything here is pure math. The scalar formulas are constexpr (integer powers by
// squaring instead of std::pow, which is not constexpr in GCC 12 / Clang 14) and generic
// over the floating-point type of alpha: they accept float, double (and long double) and
// return that type, computing in at least double precision and rounding once at the end,
// so a float result is the double result rounded to float. Other real arguments (c,
// c_hat) convert to alpha's type. The functions that take rows accept any
// ProbabilityVector of float or double and accumulate in double; the estimators take
// double (a float beta converts exactly) and report double. Arguments outside their
// domain throw `specdec::error` with code `errc::domain` (probability rows: `invalid_size`,
// `invalid_probability`); the message names the function, the argument and its value:
//   - alpha (and every beta) outside [0, 1], NaN included;
//   - gamma < 1 (gamma is a std::size_t, so gamma == 0);
//   - c or c_hat negative, NaN or infinite;
//   - lenience l outside (0, 1];
//   - a confidence level outside (0, 1).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ranges>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/error.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

namespace detail {

/// The type the scalar formulas compute in for arguments of type T: T widened to at
/// least double (float -> double; double and long double unchanged).
template <std::floating_point T>
using computation_type = std::common_type_t<T, double>;

template <std::floating_point T>
constexpr void check_alpha(const char* function, const char* name, T value) {
  if (!(value >= T{0} && value <= T{1})) {  // also rejects NaN
    throw_error(errc::domain, function, ": ", name, " = ", value, " is outside [0, 1]");
  }
}

constexpr void check_gamma(const char* function, std::size_t gamma) {
  if (gamma == 0) throw_error(errc::domain, function, ": gamma = ", gamma, " must be >= 1");
}

template <std::floating_point T>
constexpr void check_cost(const char* function, const char* name, T value) {
  if (!(value >= T{0} && value <= std::numeric_limits<T>::max())) {
    throw_error(errc::domain, function, ": ", name, " = ", value, " must be finite and >= 0");
  }
}

/// x^n by repeated squaring (constexpr, unlike std::pow).
template <std::floating_point T>
constexpr T integer_power(T x, std::size_t n) noexcept {
  T result = 1;
  while (n != 0) {
    if ((n & 1U) != 0) result *= x;
    x *= x;
    n >>= 1U;
  }
  return result;
}

/// (1 - alpha^(gamma+1)) / (1 - alpha) = 1 + alpha + ... + alpha^gamma, accurate for every
/// alpha in [0, 1] including alpha -> 1 (limit gamma + 1), where the closed form would
/// cancel catastrophically. Three regimes, with relative error below 1e-13 in double for
/// gamma up to the thousands (tested against a long double sum up to gamma = 2048):
///  - gamma <= 64: Horner's rule on the sum (positive terms, exact for gamma = 1);
///  - n d < 2 with n = gamma + 1, d = 1 - alpha: the binomial series
///    (1 - (1 - d)^n) / d = sum_{k>=1} (-1)^(k+1) C(n, k) d^(k-1), whose cancellation
///    costs at most a factor e^(n d) < 7.4 in rounding error;
///  - otherwise alpha^n <= e^-2, so the closed form (1 - alpha^n) / d cancels little and
///    the rounding of alpha^n by squaring (about n ulps of alpha^n) is damped by e^-2.
/// Callers pass computation_type<T> (double or long double).
template <std::floating_point T>
constexpr T geometric_sum(T alpha, std::size_t gamma) noexcept {
  if (gamma <= 64) {
    T sum = 1;
    for (std::size_t k = 0; k < gamma; ++k) sum = T{1} + alpha * sum;
    return sum;
  }
  const T n = static_cast<T>(gamma) + T{1};
  const T d = T{1} - alpha;
  if (n * d < T{2}) {
    // Terms below this share of the sum no longer change it.
    constexpr T negligible = std::numeric_limits<T>::epsilon() / T{256};
    T term = n;  // C(n, 1) d^0
    T sum = term;
    for (T k = 1; k < n; k += T{1}) {
      term *= -(n - k) / (k + T{1}) * d;  // (-1)^k C(n, k + 1) d^k
      sum += term;
      if (!(term > negligible * sum || -term > negligible * sum)) break;
    }
    return sum;
  }
  return (T{1} - integer_power(alpha, gamma) * alpha) / d;
}

/// The best gamma in [1, max_gamma] for Theorem 3.8, in the computation type T (see
/// optimal_gamma for the cases and the search).
template <std::floating_point T>
constexpr std::pair<std::size_t, T> optimal_gamma_search(T alpha, T c,
                                                         std::size_t max_gamma) noexcept {
  const auto improvement_at = [&](std::size_t gamma) {
    return geometric_sum(alpha, gamma) / (static_cast<T>(gamma) * c + T{1});
  };
  const bool increasing = (c == T{0} && alpha > T{0}) || (alpha == T{1} && c < T{1});
  const bool flat_or_decreasing = alpha == T{0} || alpha == T{1};
  if (increasing || flat_or_decreasing) {
    const std::size_t gamma = increasing ? max_gamma : 1;
    return {gamma, improvement_at(gamma)};
  }
  std::pair<std::size_t, T> best{1, improvement_at(1)};
  for (std::size_t gamma = 2; gamma <= max_gamma; ++gamma) {
    const T cost = static_cast<T>(gamma) * c + T{1};
    // Later gammas cannot beat the best, not even by rounding noise.
    if (T{1} / ((T{1} - alpha) * cost) < best.second * (T{1} - static_cast<T>(1e-12))) break;
    const T improvement = geometric_sum(alpha, gamma) / cost;
    if (improvement > best.second) best = {gamma, improvement};
  }
  return best;
}

/// Sum over x of f(p(x), q(x)) in double with four accumulators, after checking sizes and
/// that every entry is finite and >= 0.
template <class F, ProbabilityVector P, ProbabilityVector Q>
double sum_over_pairs(const char* function, const P& p, const Q& q, F pair_term) {
  const auto target = as_span(p);
  const auto draft = as_span(q);
  if (target.size() != draft.size()) {
    throw_error(errc::invalid_size, function, ": target p has ", target.size(),
                " entries but draft q has ", draft.size());
  }
  constexpr double largest = std::numeric_limits<double>::max();
  double partial[4] = {0.0, 0.0, 0.0, 0.0};
  bool valid = true;
  const auto accumulate = [&](std::size_t x, std::size_t lane) {
    const auto px = static_cast<double>(target[x]);
    const auto qx = static_cast<double>(draft[x]);
    valid &= (px >= 0.0) & (px <= largest) & (qx >= 0.0) & (qx <= largest);
    partial[lane] += pair_term(px, qx);
  };
  const std::size_t size = target.size();
  const std::size_t blocked = size - size % 4;
  for (std::size_t x = 0; x < blocked; x += 4) {
    for (std::size_t lane = 0; lane < 4; ++lane) accumulate(x + lane, lane);
  }
  for (std::size_t x = blocked; x < size; ++x) accumulate(x, x - blocked);
  if (!valid) {  // locate the first offender only on the error path
    const auto check = [&](const auto& row, const char* name, std::size_t x) {
      const auto value = static_cast<double>(row[x]);
      if (!(value >= 0.0 && value <= largest)) {
        throw_error(errc::invalid_probability, function, ": ", name, ", token ", x,
                    ": probability ", value, " is not finite and >= 0");
      }
    };
    for (std::size_t x = 0; x < size; ++x) {
      check(target, "target p", x);
      check(draft, "draft q", x);
    }
  }
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------
// Acceptance rate of one position (Sec. 3.2, App. A.5)
// ---------------------------------------------------------------------------------------

/// beta = sum_x min(p(x), q(x)): the probability that speculative sampling accepts
/// x ~ q (Definition 3.1, Theorem 3.5). `p` is the target row, `q` the draft row, both of
/// the same length; float and double rows may be mixed. Rows are expected to sum to 1
/// (not checked). Throws `invalid_size` for different lengths and `invalid_probability`
/// for a NaN, infinite or negative entry.
template <ProbabilityVector P, ProbabilityVector Q>
[[nodiscard]] double beta(const P& p, const Q& q) {
  return detail::sum_over_pairs("beta", p, q,
                                [](double px, double qx) { return px < qx ? px : qx; });
}

/// D_LK(p, q) = sum_x |p(x) - M(x)| with M = (p + q) / 2, which equals 1 - beta
/// (Definition 3.2, Lemma 3.3): a symmetric divergence in [0, 1] (Cor. 3.4), 0 iff p = q,
/// 1 iff p and q have disjoint supports. Same requirements and errors as `beta`.
template <ProbabilityVector P, ProbabilityVector Q>
[[nodiscard]] double lk_divergence(const P& p, const Q& q) {
  return 1.0 - beta(p, q);
}

/// Acceptance rate with lenience l in (0, 1] (App. A.5): q is multiplied by l before the
/// comparison with p, so x ~ q is accepted with probability min(1, p(x) / (l q(x))) and
/// the acceptance rate is sum_x min(p(x) / l, q(x)). With l = 1 this is `beta`. Lenience
/// changes the output distribution: no token is sampled with probability above p(x) / l.
/// Throws `domain` for l outside (0, 1], otherwise as `beta`.
template <ProbabilityVector P, ProbabilityVector Q>
[[nodiscard]] double lenient_beta(const P& p, const Q& q, double lenience) {
  if (!(lenience > 0.0 && lenience <= 1.0)) {
    detail::throw_error(errc::domain, "lenient_beta: lenience l = ", lenience,
                        " is outside (0, 1]");
  }
  return detail::sum_over_pairs("lenient_beta", p, q, [lenience](double px, double qx) {
    const double scaled = px / lenience;
    return scaled < qx ? scaled : qx;
  });
}

// ---------------------------------------------------------------------------------------
// Tokens per step, walltime and operations (Sec. 3.1, 3.3, 3.4, 3.5)
// ---------------------------------------------------------------------------------------

/// Expected number of tokens one run of Algorithm 1 produces when the betas are i.i.d.
/// with mean alpha: (1 - alpha^(gamma+1)) / (1 - alpha) (Equation 1), a capped geometric
/// variable. Equals gamma + 1 at alpha = 1 (the limit) and 1 at alpha = 0; accurate
/// near alpha = 1 (no cancellation). It is also the factor by which the number of serial
/// target calls shrinks. Returns alpha's type. Throws `domain` for alpha outside [0, 1]
/// or gamma < 1.
template <std::floating_point T>
[[nodiscard]] constexpr T expected_tokens_per_step(T alpha, std::size_t gamma) {
  detail::check_alpha("expected_tokens_per_step", "alpha", alpha);
  detail::check_gamma("expected_tokens_per_step", gamma);
  using W = detail::computation_type<T>;
  return static_cast<T>(detail::geometric_sum(static_cast<W>(alpha), gamma));
}

/// Expected tokens per step without the i.i.d. assumption (Sec. 3.1): `betas[i]` is the
/// acceptance rate at draft position i + 1 (gamma = betas.size() >= 1), e.g. computed
/// with `beta(p_i, q_i)` along a drafted sequence. Position i is reached only if all
/// earlier drafts were accepted, so
/// E[# tokens] = 1 + beta_1 + beta_1 beta_2 + ... + beta_1 ... beta_gamma.
/// With all betas equal to alpha this is Equation 1. Returns the betas' value type.
/// Throws `domain` for an empty range or a beta outside [0, 1].
template <std::ranges::input_range R>
requires std::floating_point<std::ranges::range_value_t<R>>
[[nodiscard]] constexpr std::ranges::range_value_t<R> expected_tokens_per_step(R&& betas) {
  using T = std::ranges::range_value_t<R>;
  using W = detail::computation_type<T>;
  W tokens = 1;
  W reach = 1;  // probability that every draft so far was accepted
  std::size_t count = 0;
  for (const auto value : betas) {
    const auto position_beta = static_cast<T>(value);
    detail::check_alpha("expected_tokens_per_step", "a per-position beta", position_beta);
    reach *= static_cast<W>(position_beta);
    tokens += reach;
    ++count;
  }
  detail::check_gamma("expected_tokens_per_step (number of betas)", count);
  return static_cast<T>(tokens);
}

namespace detail {

/// Row access for expected_accepted_drafts: model(prefix) returns a probability vector.
template <class Model>
struct prefix_rows {
  Model* model;
  std::vector<token_id>* prefix;

  [[nodiscard]] std::vector<double> operator()() const {
    const auto& row = (*model)(std::span<const token_id>(*prefix));
    std::vector<double> out(std::ranges::size(row));
    std::size_t j = 0;
    for (const auto value : row) out[j++] = static_cast<double>(value);
    return out;
  }
};

template <class Draft, class Target>
struct accepted_drafts_enumeration {
  Draft* draft;
  Target* target;
  std::size_t vocab_size;
  std::size_t gamma;
  verification_rule rule;
  std::vector<token_id> prefix;
  std::vector<double> rho;  // rho_0..rho_i along the prefix
  std::vector<double> h;    // h_1..h_{gamma-1} along the prefix (block rule)

  std::vector<double> row(bool of_target) {
    std::vector<double> out;
    if (of_target) {
      out = prefix_rows<Target>{target, &prefix}();
    } else {
      out = prefix_rows<Draft>{draft, &prefix}();
    }
    if (out.size() != vocab_size) {
      throw_error(errc::invalid_size, "expected_accepted_drafts: the ",
                  of_target ? "target" : "draft", " row after ", prefix.size(),
                  " drafted tokens has ", out.size(), " entries, expected ", vocab_size);
    }
    for (const double value : out) {
      if (!(value >= 0.0 && value <= std::numeric_limits<double>::max())) {
        throw_error(errc::invalid_probability, "expected_accepted_drafts: a ",
                    of_target ? "target" : "draft", " row after ", prefix.size(),
                    " drafted tokens has the entry ", value);
      }
    }
    return out;
  }

  // E[n | prefix] weighted by the prefix's draft probability, summed over its completions.
  double expand(double weight) {
    const std::size_t depth = prefix.size();
    if (depth == gamma) return weight * leaf();
    const std::vector<double> q = row(false);
    const std::vector<double> p = row(true);
    if (rule != verification_rule::token && depth > 0) {
      double z = 0.0;
      for (std::size_t x = 0; x < vocab_size; ++x) {
        const double d = rho[depth] * p[x] - q[x];
        if (d > 0.0) z += d;
      }
      const double denominator = z + (1.0 - rho[depth]);
      h[depth] = denominator > 0.0 ? z / denominator : 1.0;
    }
    double total = 0.0;
    for (std::size_t x = 0; x < vocab_size; ++x) {
      if (!(q[x] > 0.0)) continue;
      double next = 0.0;  // rho_{depth+1} (block) or the token rule's acceptance probability
      if (rho[depth] > 0.0 && p[x] > 0.0) next = std::min(1.0, rho[depth] * p[x] / q[x]);
      if (rule == verification_rule::token) next = std::min(1.0, p[x] / q[x]) * rho[depth];
      prefix.push_back(static_cast<token_id>(x));
      rho.push_back(next);
      total += expand(weight * q[x]);
      rho.pop_back();
      prefix.pop_back();
    }
    return total;
  }

  // E[n | x_1..x_gamma].
  double leaf() {
    if (rule == verification_rule::token) {  // rho_i = P(x_1..x_i all accepted)
      double expected = 0.0;
      for (std::size_t i = 1; i <= gamma; ++i) expected += rho[i];
      return expected;
    }
    double expected = 0.0;
    double none_above = 1.0;  // P(the scan fails at every position above i)
    for (std::size_t i = gamma; i >= 1; --i) {
      const double weight = i == gamma ? rho[gamma] : h[i];
      expected += static_cast<double>(i) * none_above * weight;
      none_above *= 1.0 - weight;
    }
    return expected;
  }
};

}  // namespace detail

/// The exact expected number of drafts accepted in one step, for a draft model and a
/// target model given as functions of the drafted prefix: draft(prefix) and target(prefix)
/// return the q and p rows (any range of float or double of `vocab_size` entries, summing
/// to 1) after the step's context followed by `prefix` = x_1..x_i (i = 0..gamma - 1; the
/// context is the caller's, fixed). Drafts are x_i ~ q_i. `rule`: Algorithm 1 (token) or
/// block verification (block; automatic counts as block). By enumeration of every drafted block of
/// positive draft probability: at most vocab_size^gamma blocks, each costing O(vocab_size) per
/// position; the enumeration is limited to vocab_size^gamma <= 2^24 blocks (errc::domain beyond).
/// Throws errc::domain for gamma < 1, errc::invalid_size / invalid_probability for a row of the
/// wrong size or with a negative, NaN or infinite entry.
///
/// The paper's example (Sun et al.): p = (1/3, 2/3) and q = (2/3, 1/3) at every position,
/// gamma 2: 10/9 under the token rule, 11/9 under block verification.
template <class Draft, class Target>
[[nodiscard]] double expected_accepted_drafts(Draft&& draft, Target&& target,
                                              std::size_t vocab_size, std::size_t gamma,
                                              verification_rule rule) {
  if (gamma < 1) {
    detail::throw_error(errc::domain, "expected_accepted_drafts: gamma = 0, must be >= 1");
  }
  if (vocab_size == 0) {
    detail::throw_error(errc::invalid_size, "expected_accepted_drafts: vocab_size is 0");
  }
  double blocks = 1.0;
  for (std::size_t i = 0; i < gamma; ++i) blocks *= static_cast<double>(vocab_size);
  if (blocks > 16777216.0) {
    detail::throw_error(errc::domain, "expected_accepted_drafts: ", vocab_size, "^", gamma,
                        " blocks, more than the 2^24 the enumeration allows");
  }
  using draft_type = std::remove_reference_t<Draft>;
  using target_type = std::remove_reference_t<Target>;
  detail::accepted_drafts_enumeration<draft_type, target_type> enumeration{
      &draft, &target, vocab_size, gamma, rule, {}, {1.0}, std::vector<double>(gamma + 1, 1.0)};
  enumeration.prefix.reserve(gamma);
  enumeration.rho.reserve(gamma + 1);
  return enumeration.expand(1.0);
}

/// Expected walltime improvement factor over standard decoding (Theorem 3.8):
/// (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)). Assumes the gamma + 1 target
/// evaluations of one step run in parallel in the time of one, and long generations.
/// Returns alpha's type (c converts to it). Throws `domain` for alpha outside [0, 1],
/// gamma < 1, or c negative / not finite.
template <std::floating_point T>
[[nodiscard]] constexpr T walltime_improvement(T alpha, std::size_t gamma,
                                               std::type_identity_t<T> c) {
  detail::check_alpha("walltime_improvement", "alpha", alpha);
  detail::check_gamma("walltime_improvement", gamma);
  detail::check_cost("walltime_improvement", "c", c);
  using W = detail::computation_type<T>;
  return static_cast<T>(detail::geometric_sum(static_cast<W>(alpha), gamma) /
                        (static_cast<W>(gamma) * static_cast<W>(c) + W{1}));
}

/// Expected factor of increase in total arithmetic operations (Theorem 3.11):
/// (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1)). At alpha = 1 it is
/// (gamma c_hat + gamma + 1) / (gamma + 1). Returns alpha's type (c_hat converts to it).
/// Throws `domain` for alpha outside [0, 1], gamma < 1, or c_hat negative / not finite.
template <std::floating_point T>
[[nodiscard]] constexpr T arithmetic_operations_factor(T alpha, std::size_t gamma,
                                                       std::type_identity_t<T> c_hat) {
  detail::check_alpha("arithmetic_operations_factor", "alpha", alpha);
  detail::check_gamma("arithmetic_operations_factor", gamma);
  detail::check_cost("arithmetic_operations_factor", "c_hat", c_hat);
  using W = detail::computation_type<T>;
  const auto g = static_cast<W>(gamma);
  return static_cast<T>((g * static_cast<W>(c_hat) + g + W{1}) /
                        detail::geometric_sum(static_cast<W>(alpha), gamma));
}

/// The walltime improvement at gamma = 1, (1 + alpha) / (1 + c) (Corollary 3.9). The best
/// gamma is at least this good; if alpha > c the bound exceeds 1, i.e. some gamma gives a
/// real improvement. Returns alpha's type (c converts to it). Throws `domain` for alpha
/// outside [0, 1] or c negative / not finite.
template <std::floating_point T>
[[nodiscard]] constexpr T min_improvement_bound(T alpha, std::type_identity_t<T> c) {
  detail::check_alpha("min_improvement_bound", "alpha", alpha);
  detail::check_cost("min_improvement_bound", "c", c);
  using W = detail::computation_type<T>;
  return static_cast<T>((W{1} + static_cast<W>(alpha)) / (W{1} + static_cast<W>(c)));
}

/// Upper bound 1 / (1 - alpha) on the expected tokens per target call, reached by a
/// gamma oracle or in the limit gamma -> infinity with c = 0 (Sec. 3.5, 3.6).
/// +infinity at alpha = 1. Returns alpha's type. Throws `domain` for alpha outside
/// [0, 1].
template <std::floating_point T>
[[nodiscard]] constexpr T oracle_improvement_bound(T alpha) {
  detail::check_alpha("oracle_improvement_bound", "alpha", alpha);
  using W = detail::computation_type<T>;
  return alpha == T{1} ? std::numeric_limits<T>::infinity()
                       : static_cast<T>(W{1} / (W{1} - static_cast<W>(alpha)));
}

/// The result of `optimal_gamma` for arguments of type T.
template <std::floating_point T>
struct BasicGammaChoice {
  std::size_t gamma = 1;  ///< the gamma in [1, max_gamma] maximising Theorem 3.8
  T improvement = 1;      ///< walltime_improvement(alpha, gamma, c) at that gamma
};

/// The result of `optimal_gamma` for double arguments.
using GammaChoice = BasicGammaChoice<double>;

/// The integer gamma in [1, max_gamma] maximising the walltime improvement of
/// Theorem 3.8 (Sec. 3.5, Figure 3). Cases with a closed answer: with c = 0 (and
/// alpha > 0) or alpha = 1 (and c < 1) the factor grows with gamma, so the answer is
/// max_gamma; with alpha = 0 or c >= 1 at alpha = 1 it is 1. Otherwise an exhaustive
/// search that takes the smallest gamma attaining the largest computed factor and stops
/// once even the bound 1 / ((1 - alpha)(gamma c + 1)) falls clearly below the best so far
/// (so its cost is bounded by about 1 / ((1 - alpha) c) steps, whatever max_gamma). If
/// alpha <= c no gamma improves on standard decoding and the improvement is <= 1
/// (Cor. 3.9). The search runs in at least double precision, so float arguments choose
/// the gamma their double values would; the improvement has alpha's type (c converts to
/// it). Throws `domain` for alpha outside [0, 1], c negative / not finite, or
/// max_gamma < 1.
template <std::floating_point T>
[[nodiscard]] constexpr BasicGammaChoice<T> optimal_gamma(T alpha, std::type_identity_t<T> c,
                                                          std::size_t max_gamma) {
  detail::check_alpha("optimal_gamma", "alpha", alpha);
  detail::check_cost("optimal_gamma", "c", c);
  if (max_gamma == 0) {
    detail::throw_error(errc::domain, "optimal_gamma: max_gamma = ", max_gamma, " must be >= 1");
  }
  using W = detail::computation_type<T>;
  const auto [gamma, improvement] =
      detail::optimal_gamma_search(static_cast<W>(alpha), static_cast<W>(c), max_gamma);
  return {gamma, static_cast<T>(improvement)};
}

// ---------------------------------------------------------------------------------------
// Estimating alpha online
// ---------------------------------------------------------------------------------------

/// A point estimate of alpha with a two-sided confidence interval.
struct AlphaEstimate {
  double alpha = std::numeric_limits<double>::quiet_NaN();  ///< NaN before any observation
  double lower = 0.0;                                       ///< interval, within [0, 1]
  double upper = 1.0;
  double standard_error = std::numeric_limits<double>::infinity();
  std::uint64_t observations = 0;  ///< Bernoulli trials or betas seen
};

namespace detail {

/// z with P(|Z| > z) = 1 - confidence for a standard normal Z, by bisection on erfc.
inline double two_sided_normal_quantile(const char* function, double confidence) {
  if (!(confidence > 0.0 && confidence < 1.0)) {
    throw_error(errc::domain, function, ": confidence = ", confidence, " is outside (0, 1)");
  }
  const double tail = 1.0 - confidence;
  double lo = 0.0;
  double hi = 40.0;
  for (int i = 0; i < 200 && hi - lo > 1e-15 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (std::erfc(mid / std::sqrt(2.0)) > tail ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

}  // namespace detail

/// Online estimate of alpha from the accept/reject outcomes of speculative steps.
///
/// One step that drafted gamma tokens and accepted n of them observed n accepted drafts
/// and, if n < gamma, one rejection at position n + 1; positions after a rejection are
/// never tried. Under the i.i.d. assumption of Sec. 3.1 these are Bernoulli(alpha)
/// trials stopped at the first failure (a truncated geometric per step), so
/// alpha_hat = accepted / (accepted + rejections) is the maximum-likelihood estimate and
/// is consistent. Counting the untried positions as rejections (accepted / (steps gamma))
/// would be biased low. The interval is Wilson's score interval on those trials.
/// @code
/// specdec::AcceptanceEstimator estimator;
/// estimator.observe_step(/*drafted=*/4, /*accepted=*/2);
/// auto gamma = specdec::optimal_gamma(estimator.estimate().alpha, 0.05, 16).gamma;
/// @endcode
class AcceptanceEstimator {
 public:
  /// Records one step. Throws `domain` if accepted > drafted. A step with drafted == 0
  /// (no proposal) counts as a step that produced one token and no trial.
  void observe_step(std::size_t drafted, std::size_t accepted) {
    if (accepted > drafted) {
      detail::throw_error(errc::domain, "AcceptanceEstimator::observe_step: accepted = ", accepted,
                          " exceeds drafted = ", drafted);
    }
    accepted_ += accepted;
    if (accepted < drafted) ++rejections_;
    ++steps_;
  }

  [[nodiscard]] std::uint64_t accepted() const noexcept { return accepted_; }
  [[nodiscard]] std::uint64_t rejections() const noexcept { return rejections_; }
  [[nodiscard]] std::uint64_t trials() const noexcept { return accepted_ + rejections_; }
  [[nodiscard]] std::uint64_t steps() const noexcept { return steps_; }

  /// Observed mean tokens per step (accepted drafts plus one target token per step), the
  /// empirical counterpart of Equation 1. NaN before any step.
  [[nodiscard]] double mean_tokens_per_step() const noexcept {
    if (steps_ == 0) return std::numeric_limits<double>::quiet_NaN();
    return static_cast<double>(accepted_ + steps_) / static_cast<double>(steps_);
  }

  /// alpha_hat with Wilson's score interval at the given confidence (default 95%); with
  /// no trials yet, alpha is NaN and the interval is [0, 1]. Throws `domain` for a
  /// confidence outside (0, 1).
  [[nodiscard]] AlphaEstimate estimate(double confidence = 0.95) const {
    const double z = detail::two_sided_normal_quantile("AcceptanceEstimator::estimate", confidence);
    AlphaEstimate result;
    result.observations = trials();
    if (result.observations == 0) return result;
    const auto n = static_cast<double>(result.observations);
    const double share = static_cast<double>(accepted_) / n;
    result.alpha = share;
    result.standard_error = std::sqrt(share * (1.0 - share) / n);
    const double z2 = z * z;
    const double center = (share + z2 / (2.0 * n)) / (1.0 + z2 / n);
    const double half =
        z / (1.0 + z2 / n) * std::sqrt(share * (1.0 - share) / n + z2 / (4.0 * n * n));
    result.lower = center - half < 0.0 ? 0.0 : center - half;
    result.upper = center + half > 1.0 ? 1.0 : center + half;
    return result;
  }

  void reset() noexcept { *this = AcceptanceEstimator{}; }

 private:
  std::uint64_t accepted_ = 0;
  std::uint64_t rejections_ = 0;
  std::uint64_t steps_ = 0;
};

/// Online estimate of alpha = E[beta] (Cor. 3.6) from observed per-position betas, e.g.
/// `beta(p_i, q_i)` computed for the positions a decoder verified. Keeps a running mean
/// and variance (Welford); the interval is mean +- z * standard error, clipped to [0, 1].
/// This estimator has lower variance than counting accepts, since each beta is the
/// exact acceptance probability at its position rather than one coin flip.
class BetaEstimator {
 public:
  /// Records one beta. Throws `domain` if it is outside [0, 1].
  void observe(double position_beta) {
    detail::check_alpha("BetaEstimator::observe", "beta", position_beta);
    ++count_;
    const double delta = position_beta - mean_;
    mean_ += delta / static_cast<double>(count_);
    sum_squared_deviations_ += delta * (position_beta - mean_);
  }

  [[nodiscard]] std::uint64_t count() const noexcept { return count_; }

  /// Mean beta with a normal-approximation interval; the standard error needs two
  /// observations (before that it is infinite and the interval [0, 1]; with none, alpha
  /// is NaN). Throws `domain` for a confidence outside (0, 1).
  [[nodiscard]] AlphaEstimate estimate(double confidence = 0.95) const {
    const double z = detail::two_sided_normal_quantile("BetaEstimator::estimate", confidence);
    AlphaEstimate result;
    result.observations = count_;
    if (count_ == 0) return result;
    result.alpha = mean_;
    if (count_ < 2) return result;
    const auto n = static_cast<double>(count_);
    result.standard_error = std::sqrt(sum_squared_deviations_ / (n - 1.0) / n);
    const double half = z * result.standard_error;
    result.lower = mean_ - half < 0.0 ? 0.0 : mean_ - half;
    result.upper = mean_ + half > 1.0 ? 1.0 : mean_ + half;
    return result;
  }

  void reset() noexcept { *this = BetaEstimator{}; }

 private:
  std::uint64_t count_ = 0;
  double mean_ = 0.0;
  double sum_squared_deviations_ = 0.0;
};

}  // namespace specdec
