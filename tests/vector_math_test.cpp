// Tests for include/specdec/detail/vector_math.hpp, the log and exp behind temperature and
// softmax: accuracy against long double (with a check that the bound rejects a function
// off by 4 ulp), special values, and bitwise agreement of the scalar code with the
// vectorized loops on every kernel path and for every length.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/detail/vector_math.hpp"
#include "specdec/kernel_path.hpp"
#include "specdec/random.hpp"
#include "support/statistics.hpp"

namespace {

namespace sd = specdec::detail;

/// |got - exact| in units of the last place of T at the exact value.
template <class T>
long double ulp_error(T got, long double exact) {
  const auto magnitude = static_cast<T>(std::fabs(exact));
  const T next = std::nextafter(magnitude, std::numeric_limits<T>::infinity());
  return std::fabs(static_cast<long double>(got) - exact) /
         (static_cast<long double>(next) - static_cast<long double>(magnitude));
}

/// The largest ulp error of `f` (exp-like: exact(y) = expl(y), base2: 2^y) over `count`
/// arguments in [floor, 0] whose exact result is a normal T.
template <class T, bool base2 = false, class F>
long double worst_exp_error(F f, std::size_t count, specdec::xoshiro256pp& g) {
  const auto smallest = static_cast<long double>(std::numeric_limits<T>::min());
  const long double floor = base2 ? std::log2(smallest) : std::log(smallest);
  long double worst = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const auto y = static_cast<T>(floor * static_cast<long double>(specdec::uniform01<double>(g)));
    const auto wide = static_cast<long double>(y);
    const long double exact = base2 ? std::exp2(wide) : std::exp(wide);
    if (exact < smallest * 1.001L) continue;
    worst = std::max(worst, ulp_error(f(y), exact));
  }
  return worst;
}

/// The largest ulp error of `f` (log-like: exact(x) = logl(x), base2: log2l(x)) over 200
/// arguments in every binade of positive finite T, subnormals included (x = 1, where the
/// exact result is 0, is left to the special values).
template <class T, bool base2 = false, class F>
long double worst_log_error(F f, specdec::xoshiro256pp& g) {
  long double worst = 0;
  const int lowest = std::numeric_limits<T>::min_exponent - std::numeric_limits<T>::digits;
  const int highest = std::numeric_limits<T>::max_exponent;
  for (int exponent = lowest; exponent < highest; ++exponent) {
    for (int i = 0; i < 200; ++i) {
      const T x = std::ldexp(static_cast<T>(1.0 + specdec::uniform01<double>(g)), exponent);
      if (!(x > T(0)) || !(x < std::numeric_limits<T>::infinity()) || x == T(1)) continue;
      const auto wide = static_cast<long double>(x);
      worst = std::max(worst, ulp_error(f(x), base2 ? std::log2(wide) : std::log(wide)));
    }
  }
  return worst;
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

}  // namespace

TEMPLATE_TEST_CASE("vector_math: log within 2 ulp over every binade, subnormals included",
                   "[vector_math]", float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(11);
  const long double worst = worst_log_error<T>([](T x) { return sd::log_positive(x); }, g);
  INFO("worst log error " << static_cast<double>(worst) << " ulp");
  CHECK(worst <= 2.0L);
  CHECK(worst > 0.5L);  // the measurement sees rounding at all
}

TEMPLATE_TEST_CASE(
    "vector_math: exp within 2.5 ulp where the result is normal, and the bound "
    "rejects a function 4 ulp off",
    "[vector_math]", float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(12);
  const auto ours = [](T y) { return sd::exp_nonpositive(y); };
  const long double worst = worst_exp_error<T>(ours, 400000, g);
  INFO("worst exp error " << static_cast<double>(worst) << " ulp");
  CHECK(worst <= 2.5L);
  // Broken variant: the same function scaled by (1 + 4 eps) must fail the same bound.
  const auto off = [](T y) {
    return sd::exp_nonpositive(y) * (T(1) + 4 * std::numeric_limits<T>::epsilon());
  };
  specdec::xoshiro256pp g2(12);
  CHECK(worst_exp_error<T>(off, 400000, g2) > 2.5L);
}

TEMPLATE_TEST_CASE("vector_math: log2 within 3 ulp over every binade, subnormals included",
                   "[vector_math]", float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(14);
  const long double worst = worst_log_error<T, true>([](T x) { return sd::log2_positive(x); }, g);
  // 2.45 (float) and 2.54 (double) measured: the series' leading term c1 s rounds twice
  // where log's 2 s is exact; tempered weights carry |s log x| ulp from the exponent anyway.
  INFO("worst log2 error " << static_cast<double>(worst) << " ulp");
  CHECK(worst <= 3.0L);
  CHECK(worst > 0.5L);  // the measurement sees rounding at all
}

TEMPLATE_TEST_CASE(
    "vector_math: exp2 within 2.5 ulp where the result is normal, and the bound "
    "rejects a function 4 ulp off",
    "[vector_math]", float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(15);
  const auto ours = [](T y) { return sd::exp2_nonpositive(y); };
  const long double worst = worst_exp_error<T, true>(ours, 400000, g);
  INFO("worst exp2 error " << static_cast<double>(worst) << " ulp");
  CHECK(worst <= 2.5L);
  const auto off = [](T y) {
    return sd::exp2_nonpositive(y) * (T(1) + 4 * std::numeric_limits<T>::epsilon());
  };
  specdec::xoshiro256pp g2(15);
  CHECK(worst_exp_error<T, true>(off, 400000, g2) > 2.5L);
  // Exact at integers: 2^-k is a power of two.
  for (int k = 0; k <= 100; ++k)
    CHECK(sd::exp2_nonpositive(static_cast<T>(-k)) == std::ldexp(T(1), -k));
}

TEMPLATE_TEST_CASE("vector_math: special values", "[vector_math]", float, double) {
  using T = TestType;
  constexpr T inf = std::numeric_limits<T>::infinity();
  constexpr T nan = std::numeric_limits<T>::quiet_NaN();
  constexpr T smallest = std::numeric_limits<T>::min();
  CHECK(sd::log_positive(T(1)) == T(0));
  CHECK(sd::log_positive(T(0)) == -inf);
  CHECK(sd::log_positive(T(-2)) == -inf);
  CHECK(sd::log_positive(inf) == inf);
  CHECK(std::isnan(sd::log_positive(nan)));
  const T tiny = std::numeric_limits<T>::denorm_min();
  CHECK(ulp_error(sd::log_positive(tiny), std::log(static_cast<long double>(tiny))) <= 2.0L);
  CHECK(sd::exp_nonpositive(T(0)) == T(1));
  CHECK(sd::exp_nonpositive(-T(0)) == T(1));
  CHECK(sd::exp_nonpositive(-inf) == T(0));
  CHECK(std::isnan(sd::exp_nonpositive(nan)));
  CHECK(sd::exp_nonpositive(T(-1e6)) == T(0));
  // Flushing: no result between 0 and the smallest normal number.
  const T edge = static_cast<T>(std::log(static_cast<long double>(smallest)));
  for (T y = edge - T(1); y < edge + T(1); y += T(1) / 64) {
    const T e = sd::exp_nonpositive(y);
    CHECK((e == T(0) || e >= smallest));
    // Zero exactly where the exact result is below the smallest normal (up to rounding).
    const long double ratio = std::exp(static_cast<long double>(y)) / smallest;
    if (std::fabs(ratio - 1) > 1e-5L) CHECK((e == T(0)) == (ratio < 1));
  }
  CHECK(sd::log2_positive(T(1)) == T(0));
  CHECK(sd::log2_positive(T(0.25)) == T(-2));
  CHECK(sd::log2_positive(T(0)) == -inf);
  CHECK(sd::log2_positive(T(-2)) == -inf);
  CHECK(sd::log2_positive(inf) == inf);
  CHECK(std::isnan(sd::log2_positive(nan)));
  CHECK(ulp_error(sd::log2_positive(tiny), std::log2(static_cast<long double>(tiny))) <= 2.0L);
  CHECK(sd::exp2_nonpositive(T(0)) == T(1));
  CHECK(sd::exp2_nonpositive(-T(0)) == T(1));
  CHECK(sd::exp2_nonpositive(-inf) == T(0));
  CHECK(std::isnan(sd::exp2_nonpositive(nan)));
  CHECK(sd::exp2_nonpositive(T(-1e6)) == T(0));
  // Flushing as exp's: no result between 0 and the smallest normal number.
  const T edge2 = static_cast<T>(std::numeric_limits<T>::min_exponent - 1);
  for (T y = edge2 - T(1); y < edge2 + T(1); y += T(1) / 64) {
    const T e = sd::exp2_nonpositive(y);
    CHECK((e == T(0) || e >= smallest));
    if (std::fabs(static_cast<long double>(y - edge2)) > 1e-5L) CHECK((e == T(0)) == (y < edge2));
  }
  // A tempered weight: the maximum maps to exactly 1, zero to zero, a NaN stays NaN.
  const T log_top = sd::log2_positive(T(0.25));
  CHECK(sd::tempered_weight(T(0.25), log_top, T(1.0 / 0.7)) == T(1));
  CHECK(sd::tempered_weight(T(0), log_top, T(1.0 / 0.7)) == T(0));
  CHECK(std::isnan(sd::tempered_weight(nan, log_top, T(2))));
  // (x / top)^s for T = 0.7 and T = 3.
  for (const T x : {T(0.125), T(1e-3), T(1e-20)}) {
    for (const T s : {T(1.0 / 0.7), T(1.0 / 3.0)}) {
      const long double exact = std::pow(static_cast<long double>(x) / 0.25L, s);
      if (exact < smallest) continue;
      const long double bound =
          3 + std::fabs(static_cast<long double>(s) * std::log(static_cast<long double>(x))) * 2;
      CHECK(ulp_error(sd::tempered_weight(x, log_top, s), exact) <= bound);
    }
  }
}

/// The portable path and every dispatched path this CPU supports.
std::vector<specdec::kernel_path> supported_paths() {
  std::vector<specdec::kernel_path> paths{specdec::kernel_path::portable};
  for (const auto path : {specdec::kernel_path::avx2, specdec::kernel_path::avx512}) {
    if (specdec::kernel_path_supported(path)) paths.push_back(path);
  }
  return paths;
}

TEMPLATE_TEST_CASE("vector_math: tempered rows take the plain form only in blocks it fits",
                   "[vector_math]", float, double) {
  // tempered_weights screens each block of tempered_block entries and runs the form without
  // selections for special lanes on blocks whose entries all lie in the plain range (normal,
  // exponent at least the floor plus one). Long rows of normal entries, with one special
  // entry planted in some blocks: 0, a subnormal, a NaN, +inf, a negative number, or a
  // normal number whose weight flushes to 0 (below the floor); every weight must equal the
  // scalar tempered_weight bitwise, on every path, in place too, and so must the two-pass
  // form (log2_with_max, whose maximum passes NaN over, then exp2_shifted, screened alike
  // on the log2 values). Temperatures from 0.25
  // (scale 4: the row's small entries flush) to 3. A screen that let a special lane into a
  // plain block (a wrong bound, or no screen) gives that lane a finite garbage weight.
  using T = TestType;
  specdec::xoshiro256pp g(29);
  const std::vector<specdec::kernel_path> paths = supported_paths();
  constexpr std::size_t block = sd::tempered_block;
  for (int trial = 0; trial < 24; ++trial) {
    const std::size_t size = block * (4 + specdec::uniform_below(g, 40)) +
                             (trial % 2 == 0 ? 0 : specdec::uniform_below(g, block));
    const double temperature =
        std::array{0.25, 0.7, 1.0, 1.5, 3.0}[static_cast<std::size_t>(trial % 5)];
    const double spread = 4.0 + 4.0 * static_cast<double>(trial % 3);  // e^-20 .. e^-60 below top
    std::vector<T> row(size);
    for (auto& x : row) {
      x = static_cast<T>(std::exp(-spread * std::fabs(specdec::testing::standard_normal(g))));
    }
    const T top = *std::max_element(row.begin(), row.end());
    const T log_top = sd::log2_positive(top);
    const T scale = static_cast<T>(1.0 / temperature);
    // Below this a weight flushes to 0 (an exponent under exp2's floor, 4 below it here);
    // one such entry is planted in the first block (where it is a normal number).
    const double flushing = std::max(
        static_cast<double>(top) *
            std::exp2((static_cast<double>(sd::float_bits<T>::exp2_floor) - 4.0) * temperature),
        2.0 * static_cast<double>(std::numeric_limits<T>::min()));
    row[specdec::uniform_below(g, block)] = static_cast<T>(flushing);
    std::size_t planted = 0;
    for (std::size_t b = 0; b + block <= size; b += block) {
      const std::size_t at = b + specdec::uniform_below(g, block);
      const std::uint64_t kind = specdec::uniform_below(g, 8);  // 6 and 7: the block stays plain
      if (kind < 6) ++planted;
      if (kind == 0) row[at] = T(0);
      if (kind == 1) row[at] = std::numeric_limits<T>::denorm_min() * T(3);
      if (kind == 2) row[at] = std::numeric_limits<T>::quiet_NaN();
      if (kind == 3) row[at] = std::numeric_limits<T>::infinity();
      if (kind == 4) row[at] = T(-0.25);
      if (kind == 5) row[at] = static_cast<T>(flushing);
    }
    REQUIRE(planted > 0);
    for (const auto path : paths) {
      specdec::force_kernel_path(path);
      INFO("path " << specdec::to_string(path) << ", trial " << trial << ", V = " << size
                   << ", T = " << temperature);
      std::vector<T> weights(size);
      sd::tempered_weights(row.data(), weights.data(), size, log_top, scale);
      std::vector<T> in_place = row;
      sd::tempered_weights(in_place.data(), in_place.data(), size, log_top, scale);
      // The same weights in two passes: log2 values with the row's maximum, then 2^(...).
      std::vector<T> halves(size);
      const T found = sd::log2_with_max(row.data(), halves.data(), size);
      std::size_t log_mismatches = 0;
      for (std::size_t j = 0; j < size; ++j) {
        if (!same_bits(halves[j], sd::log2_positive(row[j]))) ++log_mismatches;
      }
      CHECK(log_mismatches == 0);
      T largest = -std::numeric_limits<T>::infinity();  // NaN entries passed over
      for (const T x : row) largest = x > largest ? x : largest;
      CHECK(same_bits(found, largest));
      sd::exp2_shifted(halves.data(), halves.data(), size, log_top, scale);
      std::size_t mismatches = 0;
      std::size_t flushed = 0;
      for (std::size_t j = 0; j < size; ++j) {
        const T expected = sd::tempered_weight(row[j], log_top, scale);
        if (!same_bits(weights[j], expected)) ++mismatches;
        if (!same_bits(in_place[j], expected)) ++mismatches;
        if (!same_bits(halves[j], expected)) ++mismatches;
        if (expected == T(0) && row[j] > T(0)) ++flushed;
      }
      CHECK(mismatches == 0);
      if (temperature == 0.25) CHECK(flushed > 0);  // rows that reach the floor are covered

      // The mass-taking forms (top-p's mass at T != 1, and the validation screen of the
      // first pass): the same rows bitwise, and each mass bitwise the scalar definition of
      // its order over the row it sums (detail::finish_mass: blocks of 128 in 16 lanes of
      // T, widened per block), which is also the total nucleus_screened_band takes.
      const auto mass_of = [size](const std::vector<T>& v) {
        sd::mass_lanes lanes{};
        return sd::finish_mass(v.data(), size, lanes);
      };
      std::vector<T> with_mass(size);
      const double mass =
          sd::tempered_weights_mass(row.data(), with_mass.data(), size, log_top, scale);
      const auto same_row = [size](const std::vector<T>& a, const std::vector<T>& b) {
        return std::memcmp(a.data(), b.data(), size * sizeof(T)) == 0;  // NaN lanes too
      };
      CHECK(same_row(with_mass, weights));
      CHECK(same_bits(mass, mass_of(weights)));
      std::vector<T> screened_halves(size);
      const auto screened = sd::log2_with_max_screen(row.data(), screened_halves.data(), size);
      CHECK(same_bits(screened.maximum, largest));
      bool signs = true;  // every entry >= 0: no NaN, no negative entry
      for (const T x : row) signs = signs && x >= T(0);
      CHECK(screened.signs_passed == signs);
      CHECK(same_bits(screened.total, mass_of(row)));
      const double shifted_mass = sd::exp2_shifted_mass(
          screened_halves.data(), screened_halves.data(), size, log_top, scale);
      CHECK(same_row(screened_halves, weights));
      CHECK(same_bits(shifted_mass, mass));
      std::vector<std::uint32_t> band(size + sd::nucleus_band_slack);
      const auto fused = sd::nucleus_screened_band(row.data(), size, T(0.5), T(0.25), band.data());
      CHECK(same_bits(fused.screen.total, screened.total));
      // Within the order's error bound of the exact mass (8 u_T for non-negative terms).
      long double exact = 0.0L;
      for (const T x : weights) exact += x > T(0) ? static_cast<long double>(x) : 0.0L;
      if (std::isfinite(static_cast<double>(exact))) {
        CHECK(std::fabs(static_cast<double>(exact) - mass) <=
              8.0 * static_cast<double>(std::numeric_limits<T>::epsilon()) *
                  static_cast<double>(exact));
      }
    }
    specdec::reset_kernel_path();
  }
}

TEMPLATE_TEST_CASE("vector_math: very low temperatures keep the special-value selections",
                   "[vector_math]", float, double) {
  // At scale 1/T of about 1e6, log2(x) near -100 is a multiple of 2^-17 for float, so the
  // exponent (log2 x + 100) / T moves in steps of about 7.5: T = 1.02126e-6 puts a step at
  // -127, under the floor (-126.4), and rounds every exponent from -125.4 (where the plain
  // range starts) to -123.2 down to it. Rows crowding there (and logits around the floor
  // with a large top) must still match the scalar code bitwise on every path: the plain
  // form must not run at such temperatures (it would not flush those lanes). The same for
  // the weights in two passes (log2_with_max, then exp2_shifted from the log2 values).
  using T = TestType;
  specdec::xoshiro256pp g(37);
  const std::vector<specdec::kernel_path> paths = supported_paths();
  const double floor2 = static_cast<double>(sd::float_bits<T>::exp2_floor);
  const double floor_e = static_cast<double>(sd::float_bits<T>::exp_floor);
  for (const double temperature : {1.02126e-6, 1e-4}) {
    const std::size_t size = 16 * sd::tempered_block;
    const T top = static_cast<T>(std::exp2(sizeof(T) == 4 ? -100.0 : -900.0));
    const T log_top = sd::log2_positive(top);
    const T scale = static_cast<T>(1.0 / temperature);
    std::vector<T> row(size);
    std::vector<T> logits(size);
    const T logit_top = T(1e4);
    for (std::size_t j = 0; j < size; ++j) {
      // Even blocks: exponents from floor + 1 to floor + 1.5 (inside the plain range as the
      // screen sees it, but within the exponent's rounding of the floor); odd blocks: from
      // floor - 2 to floor + 2.
      const double v = specdec::uniform01<double>(g);
      const double u = (j / sd::tempered_block) % 2 == 0 ? 1.0 + 0.5 * v : -2.0 + 4.0 * v;
      row[j] = static_cast<T>(static_cast<double>(top) * std::exp2((floor2 + u) * temperature));
      logits[j] = static_cast<T>(static_cast<double>(logit_top) + (floor_e + u) * temperature);
    }
    row[size - 1] = top;
    logits[size - 1] = logit_top;
    for (const auto path : paths) {
      specdec::force_kernel_path(path);
      INFO("path " << specdec::to_string(path) << ", T = " << temperature);
      std::vector<T> weights(size);
      std::vector<T> exps(size);
      std::vector<T> halves(size);
      sd::tempered_weights(row.data(), weights.data(), size, log_top, scale);
      sd::shifted_exp(logits.data(), exps.data(), size, logit_top, scale);
      CHECK(same_bits(sd::log2_with_max(row.data(), halves.data(), size), top));
      sd::exp2_shifted(halves.data(), halves.data(), size, log_top, scale);
      std::size_t mismatches = 0;
      std::size_t flushed = 0;
      for (std::size_t j = 0; j < size; ++j) {
        const T expected = sd::tempered_weight(row[j], log_top, scale);
        if (!same_bits(weights[j], expected)) ++mismatches;
        if (!same_bits(halves[j], expected)) ++mismatches;
        if (!same_bits(exps[j], sd::exp_nonpositive((logits[j] - logit_top) * scale))) {
          ++mismatches;
        }
        if (expected == T(0)) ++flushed;
      }
      CHECK(mismatches == 0);
      CHECK(flushed > 0);
    }
    specdec::reset_kernel_path();
  }
}

TEMPLATE_TEST_CASE("vector_math: shifted exponentials take the plain form only in blocks it fits",
                   "[vector_math]", float, double) {
  // shifted_exp screens blocks as tempered_weights does, comparing logits as numbers (they
  // take any sign): long rows of finite logits with one special entry planted in some
  // blocks (-inf, NaN, +inf, the most negative finite number, a logit whose numerator
  // flushes to 0, one just above the plain range's floor); every numerator must equal the
  // scalar exp_nonpositive((x - top) * scale) bitwise on every path, in place too. A
  // screen that let such a lane into a plain block gives it a garbage numerator.
  using T = TestType;
  specdec::xoshiro256pp g(31);
  const std::vector<specdec::kernel_path> paths = supported_paths();
  constexpr std::size_t block = sd::tempered_block;
  for (int trial = 0; trial < 20; ++trial) {
    const std::size_t size = block * (4 + specdec::uniform_below(g, 30)) +
                             (trial % 2 == 0 ? 0 : specdec::uniform_below(g, block));
    const double temperature = std::array{0.25, 0.7, 1.0, 3.0}[static_cast<std::size_t>(trial % 4)];
    const double offset = std::array{0.0, 40.0, -1e4}[static_cast<std::size_t>(trial % 3)];
    std::vector<T> logits(size);
    for (auto& x : logits) {
      x = static_cast<T>(offset - 8.0 * std::fabs(specdec::testing::standard_normal(g)));
    }
    const T top = *std::max_element(logits.begin(), logits.end());
    const T scale = static_cast<T>(1.0 / temperature);
    const double floor = static_cast<double>(sd::float_bits<T>::exp_floor);
    const auto flushing = static_cast<T>(static_cast<double>(top) + (floor - 4.0) * temperature);
    const auto edge = static_cast<T>(static_cast<double>(top) + (floor + 1.5) * temperature);
    logits[specdec::uniform_below(g, block)] = flushing;
    for (std::size_t b = 0; b + block <= size; b += block) {
      const std::size_t at = b + specdec::uniform_below(g, block);
      const std::uint64_t kind = specdec::uniform_below(g, 8);  // 6 and 7: the block stays plain
      if (kind == 0) logits[at] = -std::numeric_limits<T>::infinity();
      if (kind == 1) logits[at] = std::numeric_limits<T>::quiet_NaN();
      if (kind == 2) logits[at] = std::numeric_limits<T>::lowest();
      if (kind == 3) logits[at] = flushing;
      if (kind == 4) logits[at] = edge;
      if (kind == 5 && b > 0) logits[at] = std::numeric_limits<T>::infinity();
    }
    for (const auto path : paths) {
      specdec::force_kernel_path(path);
      INFO("path " << specdec::to_string(path) << ", trial " << trial << ", V = " << size
                   << ", T = " << temperature);
      std::vector<T> exps(size);
      sd::shifted_exp(logits.data(), exps.data(), size, top, scale);
      std::vector<T> in_place = logits;
      sd::shifted_exp(in_place.data(), in_place.data(), size, top, scale);
      std::size_t mismatches = 0;
      std::size_t flushed = 0;
      for (std::size_t j = 0; j < size; ++j) {
        const T expected = sd::exp_nonpositive((logits[j] - top) * scale);
        if (!same_bits(exps[j], expected)) ++mismatches;
        if (!same_bits(in_place[j], expected)) ++mismatches;
        if (expected == T(0) && logits[j] > -std::numeric_limits<T>::infinity()) ++flushed;
      }
      CHECK(mismatches == 0);
      CHECK(flushed > 0);
    }
    specdec::reset_kernel_path();
  }
}

TEMPLATE_TEST_CASE("vector_math: the vector loops equal the scalar code bitwise on every path",
                   "[vector_math]", float, double) {
  using T = TestType;
  specdec::xoshiro256pp g(13);
  const std::vector<specdec::kernel_path> paths = supported_paths();
  std::vector<std::size_t> sizes;
  for (std::size_t n = 0; n <= 40; ++n) sizes.push_back(n);
  sizes.push_back(1000);
  sizes.push_back(4099);
  for (const std::size_t size : sizes) {
    // Probabilities over many magnitudes (zeros, subnormals, a NaN sometimes) and logits.
    std::vector<T> probabilities(size);
    std::vector<double> wide(size);
    std::vector<T> logits(size);
    for (std::size_t j = 0; j < size; ++j) {
      const double u = specdec::uniform01<double>(g);
      probabilities[j] =
          j % 7 == 3
              ? T(0)
              : static_cast<T>(std::exp(-std::fabs(std::log(u) * (sizeof(T) == 4 ? 20.0 : 160.0))));
      wide[j] = static_cast<double>(probabilities[j]) * 0.999;
      logits[j] = j % 9 == 4 ? -std::numeric_limits<T>::infinity() : static_cast<T>(-40.0 * u);
    }
    if (size > 10) probabilities[size / 2] = std::numeric_limits<T>::quiet_NaN();
    const T log_top = sd::log2_positive(T(1));
    const T scale = T(1.0 / 0.7);
    for (const auto path : paths) {
      specdec::force_kernel_path(path);
      INFO("path " << specdec::to_string(path) << ", size " << size);
      std::vector<T> weights(size);
      std::vector<T> from_wide(size);
      std::vector<T> exps(size);
      sd::tempered_weights(probabilities.data(), weights.data(), size, log_top, scale);
      sd::tempered_weights(wide.data(), from_wide.data(), size, log_top, scale);
      sd::shifted_exp(logits.data(), exps.data(), size, T(0), scale);
      std::size_t mismatches = 0;
      for (std::size_t j = 0; j < size; ++j) {
        if (!same_bits(weights[j], sd::tempered_weight(probabilities[j], log_top, scale))) {
          ++mismatches;
        }
        if (!same_bits(from_wide[j],
                       sd::tempered_weight(static_cast<T>(wide[j]), log_top, scale))) {
          ++mismatches;
        }
        if (!same_bits(exps[j], sd::exp_nonpositive((logits[j] - T(0)) * scale))) ++mismatches;
      }
      CHECK(mismatches == 0);
      // In place (`in` == `out`), as the standardizer may call it.
      std::vector<T> in_place = probabilities;
      sd::tempered_weights(in_place.data(), in_place.data(), size, log_top, scale);
      std::size_t in_place_mismatches = 0;  // (memcmp would get null pointers at size 0)
      for (std::size_t j = 0; j < size; ++j) {
        if (!same_bits(in_place[j], weights[j])) ++in_place_mismatches;
      }
      CHECK(in_place_mismatches == 0);
    }
    specdec::reset_kernel_path();
  }
}
