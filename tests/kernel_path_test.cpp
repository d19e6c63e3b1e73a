// Tests for include/specdec/kernel_path.hpp: choosing, forcing and resetting the kernel
// path, and the dispatched kernels giving identical answers on every path this CPU has.
// (The exactness suites that include the kernel path listener of tests/support run whole on each
// path: tests/CMakeLists.txt.)
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/detail/decoder_kernels.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/error.hpp"
#include "specdec/kernel_path.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/sampling.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::kernel_path;

/// Restores the unforced state when a test ends, whatever it forced.
struct ResetKernelPath {
  ResetKernelPath() = default;
  ResetKernelPath(const ResetKernelPath&) = delete;
  ResetKernelPath& operator=(const ResetKernelPath&) = delete;
  ~ResetKernelPath() { specdec::reset_kernel_path(); }
};

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// Divides a row by its sum (taken in double), as a model's softmax leaves it.
template <class T>
void normalise(std::vector<T>& row) {
  double total = 0.0;
  for (const T x : row) total += static_cast<double>(x);
  for (T& x : row) x = static_cast<T>(static_cast<double>(x) / total);
}

/// A normalised row of log-normal weights (a language model's, sigma 2.5), with every fifth
/// entry 0 (`zeros`) or every third equal to the one before it (`ties`); never all 0.
template <class T>
std::vector<T> top_p_row(specdec::xoshiro256pp& g, std::size_t size, bool zeros, bool ties,
                         bool levels = false) {
  // levels: logits rounded to quarters, so that every value recurs all over the row and
  // the nucleus ends inside a run of ties whose other members lie in blocks before and
  // after its last id.
  std::vector<T> row(size);
  for (std::size_t j = 0; j < size; ++j) {
    const double logit = 2.5 * specdec::testing::standard_normal(g);
    row[j] = static_cast<T>(std::exp(levels ? std::round(4.0 * logit) / 4.0 : logit));
    if (zeros && j % 5 == 0) row[j] = T(0);
    if (ties && j > 0 && j % 3 == 0) row[j] = row[j - 1];
  }
  if (std::all_of(row.begin(), row.end(), [](T x) { return x == T(0); })) row[0] = T(1);
  normalise(row);
  return row;
}

std::vector<kernel_path> supported_paths() {
  std::vector<kernel_path> paths{kernel_path::portable};
  for (const auto path : {kernel_path::avx2, kernel_path::avx512}) {
    if (specdec::kernel_path_supported(path)) paths.push_back(path);
  }
  return paths;
}

}  // namespace

TEST_CASE("kernel_path: the best path is used unless one is forced", "[kernel_path]") {
  const ResetKernelPath reset;
  specdec::reset_kernel_path();
  CHECK(specdec::kernel_path_supported(kernel_path::portable));
  CHECK(specdec::active_kernel_path() == specdec::best_kernel_path());
  CHECK(specdec::to_string(kernel_path::portable) == "portable");
  CHECK(specdec::to_string(kernel_path::avx2) == "avx2");
  CHECK(specdec::to_string(kernel_path::avx512) == "avx512");
#if SPECDEC_DISPATCH_AVX2
  // On x86 with GCC or Clang the best path follows the CPU: AVX-512 (F, BW, DQ, VL), else
  // AVX2, else portable.
  const bool avx512 =
      __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
      __builtin_cpu_supports("avx512dq") != 0 && __builtin_cpu_supports("avx512vl") != 0;
  CHECK(specdec::kernel_path_supported(kernel_path::avx512) == avx512);
  CHECK((specdec::best_kernel_path() == kernel_path::avx512) == avx512);
  CHECK((specdec::best_kernel_path() == kernel_path::avx2) ==
        (!avx512 && __builtin_cpu_supports("avx2") != 0));
#else
  CHECK(specdec::best_kernel_path() == kernel_path::portable);
#endif
  const kernel_path before = specdec::force_kernel_path(kernel_path::portable);
  CHECK(before == specdec::best_kernel_path());
  CHECK(specdec::active_kernel_path() == kernel_path::portable);
  CHECK(!specdec::detail::use_avx2());
  CHECK(!specdec::detail::use_avx512());
  specdec::reset_kernel_path();
  CHECK(specdec::active_kernel_path() == specdec::best_kernel_path());
}

TEST_CASE("kernel_path: forcing a path the CPU lacks throws and changes nothing", "[kernel_path]") {
  const ResetKernelPath reset;
  for (const auto path : {kernel_path::avx2, kernel_path::avx512}) {
    INFO("path " << specdec::to_string(path));
    specdec::reset_kernel_path();
    if (specdec::kernel_path_supported(path)) {
      CHECK(specdec::force_kernel_path(path) == specdec::best_kernel_path());
      CHECK(specdec::active_kernel_path() == path);
      CHECK(specdec::detail::use_avx2() == (path == kernel_path::avx2));
      CHECK(specdec::detail::use_avx512() == (path == kernel_path::avx512));
    } else {
      specdec::force_kernel_path(kernel_path::portable);
      try {
        specdec::force_kernel_path(path);
        FAIL("forcing an unsupported path did not throw");
      } catch (const specdec::error& e) {
        CHECK(e.code() == specdec::errc::invalid_option);
        CHECK(std::string(e.what()).find(specdec::to_string(path)) != std::string::npos);
      }
      CHECK(specdec::active_kernel_path() == kernel_path::portable);
    }
  }
}

TEMPLATE_TEST_CASE("kernel_path: every path finds the same argmax and the same bad entries",
                   "[kernel_path]", float, double) {
  // Rows of every length around the lane and chunk sizes, values on a coarse grid (ties
  // within and across chunks), sometimes one NaN or negative entry anywhere: the argmax,
  // the screen verdict and is_row_argmax must agree on all paths with a plain scan.
  using T = TestType;
  const ResetKernelPath reset;
  const auto paths = supported_paths();
  specdec::xoshiro256pp g(2026);
  constexpr std::size_t chunk = specdec::detail::scan_chunk;
  std::size_t poisoned_rows = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::size_t size = 1 + specdec::uniform_below(g, 3 * chunk + 100);
    std::vector<T> row(size);
    for (auto& entry : row) entry = static_cast<T>(specdec::uniform_below(g, 6));
    bool bad = false;
    if (trial % 3 == 0) {
      const std::size_t at = specdec::uniform_below(g, size);
      row[at] = trial % 2 == 0 ? std::numeric_limits<T>::quiet_NaN() : T(-1);
      bad = true;
      ++poisoned_rows;
    }
    // The plain answers: first maximal entry (NaN skipped), every entry >= 0.
    std::size_t expected = 0;
    bool expected_valid = true;
    for (std::size_t j = 0; j < size; ++j) {
      if (!(row[j] >= T(0))) expected_valid = false;
      if (row[j] > row[expected] || (row[expected] != row[expected] && row[j] == row[j])) {
        expected = j;
      }
    }
    REQUIRE(expected_valid == !bad);
    const std::size_t candidate = specdec::uniform_below(g, size);
    for (const kernel_path path : paths) {
      specdec::force_kernel_path(path);
      INFO("path " << specdec::to_string(path) << ", size " << size << ", trial " << trial);
      bool valid = true;
      const std::size_t found = specdec::detail::row_argmax<true>(row.data(), size, valid);
      CHECK(valid == expected_valid);
      if (!bad) {
        CHECK(found == expected);
        bool unused = true;
        CHECK(specdec::detail::is_row_argmax<false>(row.data(), size, candidate, unused) ==
              (candidate == expected));
        CHECK(specdec::detail::is_row_argmax<false>(row.data(), size, expected, unused));
      }
    }
  }
  CHECK(poisoned_rows > 100);
}

TEMPLATE_TEST_CASE("kernel_path: every path builds the same mass tables and screens bitwise",
                   "[kernel_path]", float, double) {
  // The streaming passes behind every draw and every fused validation (build_mass_table
  // with a screening hook and without one, overlap_mass, plausible_probability_row) and the
  // draws from the tables: totals, superblock masses, beta, screen verdicts and tokens
  // must be equal, bitwise, on all paths, for rows of every length around the block
  // sizes, with negative and NaN entries sometimes.
  using T = TestType;
  const ResetKernelPath reset;
  const auto paths = supported_paths();
  specdec::xoshiro256pp g(77);
  for (int trial = 0; trial < 120; ++trial) {
    const std::size_t size = 1 + specdec::uniform_below(g, 5000);
    std::vector<T> p(size);
    std::vector<T> q(size);
    for (std::size_t j = 0; j < size; ++j) {
      p[j] = static_cast<T>(specdec::uniform01<double>(g));
      q[j] = static_cast<T>(specdec::uniform01<double>(g));
    }
    normalise(p);
    normalise(q);
    if (trial % 4 == 1) p[specdec::uniform_below(g, size)] = T(-0.25);
    if (trial % 4 == 2) p[specdec::uniform_below(g, size)] = std::numeric_limits<T>::quiet_NaN();
    struct Outcome {
      double total = 0.0;
      std::vector<double> cumulative;
      double screened_sum = 0.0;
      bool signs = false;
      double overlap = 0.0;
      bool plausible = false;
      std::vector<double> plain;  // hookless tables: totals and cumulative masses
      std::vector<std::size_t> draws;
    };
    std::vector<Outcome> outcomes;
    for (const kernel_path path : paths) {
      specdec::force_kernel_path(path);
      Outcome outcome;
      specdec::detail::mass_table table;
      specdec::detail::row_screen<T> screen;
      specdec::detail::build_mass_table(
          specdec::detail::difference_source<T>{p.data(), q.data(), size}, table,
          [&](std::size_t first, std::size_t count) { screen.add(p.data() + first, count); });
      outcome.total = table.total;
      outcome.cumulative.assign(
          table.cumulative_mass.begin(),
          table.cumulative_mass.begin() + static_cast<std::ptrdiff_t>(table.superblocks));
      outcome.screened_sum = screen.total();
      outcome.signs = screen.signs.passed();
      specdec::detail::row_screen<T> overlap_screen;
      outcome.overlap =
          specdec::detail::overlap_mass<true>(p.data(), q.data(), T(0.75), size, overlap_screen);
      outcome.plausible = specdec::detail::plausible_probability_row(p.data(), size, 1e-3);
      // Passes without a hook (an AVX-512 build of their own on the AVX-512 path): the
      // table and a draw for each source the decoder draws from.
      const double u = static_cast<double>(trial) / 120.0;
      const auto plain = [&](const auto& source) {
        specdec::detail::mass_table plain_table;
        specdec::detail::build_mass_table(source, plain_table);
        outcome.plain.push_back(plain_table.total);
        for (std::size_t s = 0; s < plain_table.superblocks; ++s) {
          outcome.plain.push_back(plain_table.cumulative_mass[s]);
        }
        outcome.draws.push_back(specdec::detail::draw_index(source, u));
      };
      plain(specdec::detail::row_source<T>{p.data(), size});
      plain(specdec::detail::difference_source<T>{p.data(), q.data(), size});
      plain(
          specdec::detail::scaled_difference_source<T>{p.data(), q.data(), size, T(0.75), T(1.25)});
      outcomes.push_back(outcome);
    }
    INFO("size " << size << ", trial " << trial);
    CHECK(outcomes.front().signs == (trial % 4 == 0 || trial % 4 == 3));
    for (const Outcome& outcome : outcomes) {
      CHECK(same_bits(outcome.total, outcomes.front().total));
      CHECK(outcome.cumulative.size() == outcomes.front().cumulative.size());
      for (std::size_t s = 0; s < outcome.cumulative.size(); ++s) {
        CHECK(same_bits(outcome.cumulative[s], outcomes.front().cumulative[s]));
      }
      CHECK(same_bits(outcome.screened_sum, outcomes.front().screened_sum));
      CHECK(outcome.signs == outcomes.front().signs);
      CHECK(same_bits(outcome.overlap, outcomes.front().overlap));
      CHECK(outcome.plausible == outcomes.front().plausible);
      REQUIRE(outcome.plain.size() == outcomes.front().plain.size());
      for (std::size_t k = 0; k < outcome.plain.size(); ++k) {
        CHECK(same_bits(outcome.plain[k], outcomes.front().plain[k]));
      }
      CHECK(outcome.draws == outcomes.front().draws);
    }
  }
}

TEMPLATE_TEST_CASE("kernel_path: every path standardizes top-p rows bitwise", "[kernel_path]",
                   float, double) {
  // Top-p without top-k runs on dispatched passes (histogram with bucket codes, collection,
  // the normalising keep pass; temperature's log and exp): every entry of the standardized
  // row and the top probability must be bitwise equal on all paths, for rows of every length
  // around the pack and chunk sizes, with ties at the nucleus boundary and zeros.
  using T = TestType;
  const ResetKernelPath reset;
  const auto paths = supported_paths();
  specdec::xoshiro256pp g(78);
  const specdec::SamplingOptions settings[] = {
      {.top_p = 0.9},
      {.top_p = 0.3},
      {.temperature = 0.7, .top_p = 0.9},
      {.temperature = 0.8, .top_p = 0.85, .min_p = 0.02},
  };
  for (int trial = 0; trial < 160; ++trial) {
    // One row in five is a long one (language-model vocabularies).
    const std::size_t size = trial % 5 == 4 ? 8192 + specdec::uniform_below(g, 40000)
                                            : 1 + specdec::uniform_below(g, 3000);
    const std::vector<T> row = top_p_row<T>(g, size, trial % 3 == 1, trial % 3 == 2);
    const specdec::SamplingOptions& options = settings[trial % 4];
    std::vector<std::vector<T>> outputs;
    std::vector<double> tops;
    for (const kernel_path path : paths) {
      specdec::force_kernel_path(path);
      specdec::Standardizer<T> standardizer(options);
      std::vector<T> out(size);
      tops.push_back(standardizer.apply(std::span<const T>(row), std::span<T>(out)));
      outputs.push_back(std::move(out));
    }
    INFO("size " << size << ", trial " << trial);
    for (std::size_t k = 1; k < outputs.size(); ++k) {
      CHECK(same_bits(tops[k], tops.front()));
      std::size_t differing = 0;
      for (std::size_t j = 0; j < size; ++j) {
        if (!same_bits(outputs[k][j], outputs.front()[j])) ++differing;
      }
      CHECK(differing == 0);
    }
  }
}

TEMPLATE_TEST_CASE("kernel_path: a top-p nucleus left to the draw's pass is the row apply writes",
                   "[kernel_path]", float, double) {
  // The draft stage asks apply() to leave top-p's writing pass to it (the `deferred` hook)
  // and runs that pass inside its draw (detail::draw_from_target with the hook): the row
  // it leaves and the token it draws must be bitwise those of apply() writing the row and
  // sample_from_row drawing from it, on every path. Only top-p alone at T = 1 defers (not
  // with min-p, not tempered); rows short and long (the sampled band's first pass), with
  // ties and zeros, and rows of a few recurring values (the nucleus ending inside a run of
  // ties spread over the row: the fused AVX2 pass keeps the ties of the blocks before its
  // last id and drops those after).
  using T = TestType;
  const ResetKernelPath reset;
  const auto paths = supported_paths();
  specdec::xoshiro256pp g(83);
  const specdec::SamplingOptions settings[] = {
      {.top_p = 0.9},
      {.top_p = 0.3},
      {.temperature = 0.7, .top_p = 0.9},
      {.temperature = 0.8, .top_p = 0.85, .min_p = 0.02},
  };
  std::size_t deferred_rows = 0;
  for (int trial = 0; trial < 96; ++trial) {
    const std::size_t size = trial % 3 == 2 ? 4096 + specdec::uniform_below(g, 40000)
                                            : 1 + specdec::uniform_below(g, 3000);
    const std::vector<T> row =
        top_p_row<T>(g, size, trial % 5 == 1, trial % 5 == 2, trial % 5 == 3);
    const specdec::SamplingOptions& options = settings[trial % 4];
    const auto seed = g();
    std::vector<T> first_row;
    specdec::token_id first_token = 0;
    for (const kernel_path path : paths) {
      specdec::force_kernel_path(path);
      INFO("size " << size << ", trial " << trial << ", path " << static_cast<int>(path));
      specdec::Standardizer<T> standardizer(options);
      std::vector<T> written(size);
      const double top = standardizer.apply(std::span<const T>(row), std::span<T>(written));
      specdec::xoshiro256pp g_written(seed);
      const specdec::token_id expected =
          specdec::sample_from_row(std::span<const T>(written), g_written);
      // The deferred pass writes over stale entries, as the draft stage's copies hold.
      std::vector<T> left(size, T(0.5));
      specdec::detail::nucleus_keep_hook<T, T> keep;
      const double deferred_top =
          standardizer.apply(std::span<const T>(row), std::span<T>(left), nullptr, &keep);
      CHECK(same_bits(deferred_top, top));
      CHECK((keep.out != nullptr) == (options.min_p == 0.0 && options.temperature == 1.0));
      specdec::xoshiro256pp g_left(seed);
      specdec::token_id drawn = 0;
      if (keep.out != nullptr) {
        ++deferred_rows;
        CHECK(keep.out == left.data());
        drawn = specdec::detail::draw_from_target(std::span<const T>(left),
                                                  specdec::uniform01<double>(g_left), keep);
      } else {
        drawn = specdec::sample_from_row(std::span<const T>(left), g_left);
      }
      CHECK(drawn == expected);
      std::size_t differing = 0;
      for (std::size_t j = 0; j < size; ++j) {
        if (!same_bits(left[j], written[j])) ++differing;
      }
      CHECK(differing == 0);
      if (first_row.empty()) {
        first_row = written;
        first_token = expected;
      } else {
        CHECK(expected == first_token);
        CHECK(std::equal(written.begin(), written.end(), first_row.begin(),
                         [](T a, T b) { return same_bits(a, b); }));
      }
    }
  }
  CHECK(deferred_rows == 48 * paths.size());
}

TEMPLATE_TEST_CASE("kernel_path: every path sums and lists top-p's band bitwise", "[kernel_path]",
                   float, double) {
  // Long rows of probabilities look for the nucleus from a sample, then take two passes:
  // the positive mass of the row (detail::nucleus_total, or with the row's maximum:
  // detail::nucleus_max_total, with the sign screen) and the mass of the keys above a
  // band with the band's ids listed (detail::nucleus_band); at T = 1 both in one
  // pass (detail::nucleus_screened_band, whose masses are summed in blocks of 128 entries
  // in lanes of T, widened into double lanes per block). Float rows take
  // intrinsics builds (SSE2, AVX2, AVX-512) whose lanes must add exactly what the
  // portable loops add: every sum bitwise, the same ids in the same order, for
  // lengths around the 16-entry chunks and the 128-entry blocks, the weights the keys
  // themselves (T = 1) or another row (tempered), with zero, negative and NaN entries.
  using T = TestType;
  const ResetKernelPath reset;
  const auto paths = supported_paths();
  specdec::xoshiro256pp g(91);
  for (int trial = 0; trial < 120; ++trial) {
    const std::size_t size = trial % 6 == 5 ? 8192 + specdec::uniform_below(g, 60000)
                                            : 1 + specdec::uniform_below(g, 700);
    std::vector<T> key(size);
    std::vector<T> weight(size);
    for (std::size_t j = 0; j < size; ++j) {
      key[j] = static_cast<T>(std::exp(2.5 * specdec::testing::standard_normal(g)));
      weight[j] = static_cast<T>(std::pow(static_cast<double>(key[j]), 1.4));
    }
    if (trial % 4 == 1) key[specdec::uniform_below(g, size)] = T(-0.25);
    if (trial % 4 == 2) key[specdec::uniform_below(g, size)] = std::numeric_limits<T>::quiet_NaN();
    if (trial % 4 == 3) key[specdec::uniform_below(g, size)] = T(0);
    const bool tempered = trial % 2 == 1;
    const T* weights = tempered ? weight.data() : key.data();
    // A band around the middle of the sorted keys, between two keys of the row.
    std::vector<T> sorted;
    for (const T x : key) {
      if (x > T(0)) sorted.push_back(x);
    }
    if (sorted.size() < 2) continue;
    std::sort(sorted.begin(), sorted.end());
    const T low = sorted[sorted.size() / 3];
    const T high = sorted[sorted.size() / 3 + 1 + specdec::uniform_below(g, sorted.size() / 2)];
    struct outcome {
      double total;
      double screened_total;
      double screened_head;
      T maximum;
      double head;
      std::vector<std::uint32_t> ids;
    };
    std::vector<outcome> outcomes;
    for (const kernel_path path : paths) {
      specdec::force_kernel_path(path);
      std::vector<std::uint32_t> ids(size + specdec::detail::nucleus_band_slack);
      const double total = specdec::detail::nucleus_total(weights, size);
      // The same total taken with the maximum (apply's first pass for top-p at T = 1).
      const auto fused = specdec::detail::nucleus_max_total(key.data(), size);
      bool valid = true;  // no NaN, no negative entry: the decoder's sign screen
      CHECK(same_bits(fused.total, specdec::detail::nucleus_total(key.data(), size)));
      CHECK(same_bits(fused.maximum, specdec::detail::span_max<true>(key.data(), size, valid)));
      CHECK(fused.signs_passed == valid);
      CHECK(valid == (trial % 4 != 1 && trial % 4 != 2));
      const auto found =
          specdec::detail::nucleus_band(key.data(), weights, size, high, low, ids.data());
      double screened_total = 0.0;
      double screened_head = 0.0;
      if (!tempered) {
        // At T = 1 the band's pass takes the first pass's maximum, screen and mass too
        // (nucleus_screened_band): the same maximum, verdict and ids; its head and mass are
        // summed in blocks of T lanes, so they agree with the double sums within the
        // blocks' rounding (7 roundings of T per lane: 8 u_T relative, sums of
        // non-negative terms).
        std::vector<std::uint32_t> fused_ids(size + specdec::detail::nucleus_band_slack);
        const auto both =
            specdec::detail::nucleus_screened_band(key.data(), size, high, low, fused_ids.data());
        const double block_error = 8.0 * std::numeric_limits<T>::epsilon() / 2.0;
        CHECK(std::abs(both.screen.total - fused.total) <= block_error * fused.total);
        CHECK(std::abs(both.band.head - found.head) <= block_error * found.head);
        CHECK(same_bits(both.screen.maximum, fused.maximum));
        CHECK(both.screen.signs_passed == fused.signs_passed);
        REQUIRE(both.band.count == found.count);
        CHECK(std::equal(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(found.count),
                         fused_ids.begin()));
        screened_total = both.screen.total;
        screened_head = both.band.head;
      }
      ids.resize(found.count);
      outcomes.push_back(
          {total, screened_total, screened_head, fused.maximum, found.head, std::move(ids)});
    }
    // The portable result against a plain reading of the definition.
    double head = 0.0;
    std::vector<std::uint32_t> expected_ids;
    for (std::size_t j = 0; j < size; ++j) {
      if (key[j] >= high) head += static_cast<double>(weights[j]);
      if (key[j] >= low && key[j] < high) expected_ids.push_back(static_cast<std::uint32_t>(j));
    }
    INFO("trial " << trial << ", size " << size << (tempered ? ", tempered" : ""));
    const outcome& first = outcomes.front();
    CHECK(first.ids == expected_ids);
    CHECK(first.head == Catch::Approx(head).epsilon(1e-12));
    for (std::size_t k = 1; k < outcomes.size(); ++k) {
      CHECK(same_bits(outcomes[k].total, first.total));
      CHECK(same_bits(outcomes[k].screened_total, first.screened_total));
      CHECK(same_bits(outcomes[k].screened_head, first.screened_head));
      CHECK(same_bits(outcomes[k].maximum, first.maximum));
      CHECK(same_bits(outcomes[k].head, first.head));
      CHECK(outcomes[k].ids == first.ids);
    }
  }
}

TEMPLATE_TEST_CASE("kernel_path: every path samples top-p's runs and reads its band bitwise",
                   "[kernel_path]", float, double) {
  // The sampled search for the nucleus (Standardizer::sampled_band, resolve_band) reads the
  // sample's runs (detail::sample_runs: each entry's weight and bucket, each run's weight
  // below bucket 0), then each band entry's bucket and weight (detail::band_codes: vector
  // gathers on the AVX2 and AVX-512 paths for float rows) and the ids of one bucket
  // (detail::list_bucket: a compress on the AVX-512 path). Every path must give what the
  // definitions give, bitwise, with the weights the keys (T = 1) or another row, and with
  // zero, negative and NaN entries in the sample.
  using T = TestType;
  using word = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
  namespace sd = specdec::detail;
  constexpr std::size_t run = sd::nucleus_sample_run<T>;
  constexpr std::size_t runs = 2048 / run;
  constexpr unsigned code_shift = sizeof(T) == 8 ? 48U : 19U;
  const ResetKernelPath reset;
  const auto paths = supported_paths();
  specdec::xoshiro256pp g(97);
  for (int trial = 0; trial < 24; ++trial) {
    const std::size_t size = 4096 + specdec::uniform_below(g, 70000);
    std::vector<T> key(size);
    std::vector<T> weight(size);
    for (std::size_t j = 0; j < size; ++j) {
      key[j] = static_cast<T>(std::exp(2.5 * specdec::testing::standard_normal(g)));
      weight[j] = static_cast<T>(std::pow(static_cast<double>(key[j]), 1.4));
    }
    const std::size_t spacing = size / runs;
    // Entries without weight where the sample reads: a zero, negative or NaN key or weight.
    for (int k = 0; k < 12; ++k) {
      const std::size_t j = sd::sample_run_start<T>(specdec::uniform_below(g, runs), spacing) +
                            specdec::uniform_below(g, run);
      const T bad =
          k % 3 == 0 ? T(0) : (k % 3 == 1 ? T(-0.5) : std::numeric_limits<T>::quiet_NaN());
      (k % 2 == 0 ? key : weight)[j] = bad;
    }
    const bool tempered = trial % 2 == 1;
    const T* weights = tempered ? weight.data() : key.data();
    const T top = *std::max_element(key.begin(), key.end(), [](T a, T b) { return a < b; });
    const auto top_code = static_cast<std::int32_t>(sd::magnitude_code(top)) -
                          static_cast<std::int32_t>(trial % 3);  // some keys above the top
    // The definitions.
    std::vector<T> expected_weight(2048);
    std::vector<std::uint16_t> expected_code(2048);
    std::vector<double> expected_run_mass(runs);
    for (std::size_t c = 0; c < runs; ++c) {
      double part[4] = {0.0, 0.0, 0.0, 0.0};
      for (std::size_t i = 0; i < run; ++i) {
        const std::size_t j = sd::sample_run_start<T>(c, spacing) + i;
        const std::size_t e = c * run + i;
        const bool counted = key[j] > T(0) && weights[j] > T(0);
        const std::int32_t below =
            top_code - static_cast<std::int32_t>(std::bit_cast<word>(key[j]) >> code_shift);
        const std::int32_t bucket = std::clamp(below, 0, std::int32_t{sd::nucleus_buckets - 1});
        expected_weight[e] = counted ? weights[j] : T(0);
        expected_code[e] = static_cast<std::uint16_t>(counted ? static_cast<std::size_t>(bucket)
                                                              : sd::nucleus_buckets);
        if (expected_code[e] > 0) part[i % 4] += static_cast<double>(expected_weight[e]);
      }
      expected_run_mass[c] = (part[0] + part[1]) + (part[2] + part[3]);
    }
    // A band between two keys of the row, its buckets as resolve_band takes them.
    std::vector<T> sorted;
    for (const T x : key) {
      if (x > T(0)) sorted.push_back(x);
    }
    std::sort(sorted.begin(), sorted.end());
    const T low = sorted[sorted.size() / 2];
    const T high = sorted[sorted.size() / 2 + 1 + specdec::uniform_below(g, sorted.size() / 3)];
    std::vector<std::uint32_t> band(size + sd::nucleus_band_slack);
    const std::size_t count =
        sd::nucleus_band(key.data(), weights, size, high, low, band.data()).count;
    REQUIRE(count > 16);
    const auto low_bits = std::bit_cast<word>(low);
    const word span = std::bit_cast<word>(high) - low_bits;
    const auto shift =
        static_cast<unsigned>(std::max(0, static_cast<int>(std::bit_width(span)) - 10));
    std::vector<std::uint16_t> expected_band_code(count);
    std::vector<T> expected_band_weight(count);
    for (std::size_t i = 0; i < count; ++i) {
      expected_band_code[i] =
          static_cast<std::uint16_t>((std::bit_cast<word>(key[band[i]]) - low_bits) >> shift);
      expected_band_weight[i] = weights[band[i]];
    }
    // The most common bucket and one that may hold a single id or none.
    std::vector<std::size_t> members(std::size_t{1} << 10U);
    for (const std::uint16_t c : expected_band_code) ++members[c];
    const auto common = static_cast<std::uint16_t>(
        std::max_element(members.begin(), members.end()) - members.begin());
    const auto rare = static_cast<std::uint16_t>(specdec::uniform_below(g, 1024));
    INFO("trial " << trial << ", size " << size << (tempered ? ", tempered" : ""));
    for (const kernel_path path : paths) {
      specdec::force_kernel_path(path);
      INFO("path " << specdec::to_string(path));
      std::vector<T> weight_of(2048);
      std::vector<std::uint16_t> code_of(2048);
      std::vector<double> run_mass(runs);
      sd::sample_runs(key.data(), weights, spacing, runs, 8, top_code, weight_of.data(),
                      code_of.data(), run_mass.data());
      CHECK(std::equal(weight_of.begin(), weight_of.end(), expected_weight.begin(),
                       [](T a, T b) { return same_bits(a, b); }));
      CHECK(code_of == expected_code);
      CHECK(std::equal(run_mass.begin(), run_mass.end(), expected_run_mass.begin(),
                       [](double a, double b) { return same_bits(a, b); }));
      std::vector<std::uint16_t> band_code(count);
      std::vector<T> band_weight(count);
      sd::band_codes(key.data(), weights, band.data(), count, low_bits, shift, band_code.data(),
                     band_weight.data(), size);
      CHECK(band_code == expected_band_code);
      CHECK(std::equal(band_weight.begin(), band_weight.end(), expected_band_weight.begin(),
                       [](T a, T b) { return same_bits(a, b); }));
      for (const std::uint16_t bucket : {common, rare}) {
        std::vector<std::uint32_t> listed(count + sd::nucleus_band_slack);
        listed.resize(
            sd::list_bucket(expected_band_code.data(), band.data(), count, bucket, listed.data()));
        std::vector<std::uint32_t> expected_listed;
        for (std::size_t i = 0; i < count; ++i) {
          if (expected_band_code[i] == bucket) expected_listed.push_back(band[i]);
        }
        CHECK(listed == expected_listed);
      }
    }
  }
}

TEMPLATE_TEST_CASE("kernel_path: every path selects the same top-k survivors and screens bitwise",
                   "[kernel_path]", float, double) {
  // Top-k rows (the decoder's sparse rows) go through one dispatched pass of block maxima
  // with the validation screen fused into it: survivors, their weights, the top probability
  // and the screen's sum and sign verdict must be bitwise equal on all paths, for rows of
  // every length around the block and group sizes, with negative and NaN entries sometimes.
  using T = TestType;
  const ResetKernelPath reset;
  const auto paths = supported_paths();
  specdec::xoshiro256pp g(79);
  for (int trial = 0; trial < 120; ++trial) {
    const std::size_t size = trial % 6 == 5 ? 8192 + specdec::uniform_below(g, 60000)
                                            : 2 + specdec::uniform_below(g, 3000);
    std::vector<T> row(size);
    for (T& x : row) x = static_cast<T>(std::exp(2.5 * specdec::testing::standard_normal(g)));
    normalise(row);
    if (trial % 4 == 1) row[specdec::uniform_below(g, size)] = T(-0.25);
    if (trial % 4 == 2) row[specdec::uniform_below(g, size)] = std::numeric_limits<T>::quiet_NaN();
    const std::size_t k = 1 + specdec::uniform_below(g, std::min<std::size_t>(size - 1, 120));
    const specdec::SamplingOptions options{
        .temperature = trial % 3 == 0 ? 1.0 : 0.7, .top_k = k, .top_p = trial % 2 == 0 ? 1.0 : 0.9};
    struct Outcome {
      std::vector<std::uint32_t> ids;
      std::vector<T> weights;
      double top = 0.0;
      double screened_sum = 0.0;
      bool signs = false;
    };
    std::vector<Outcome> outcomes;
    for (const kernel_path path : paths) {
      specdec::force_kernel_path(path);
      specdec::Standardizer<T> standardizer(options);
      std::vector<T> scratch(size);
      Outcome outcome;
      outcome.ids.resize(k);
      outcome.weights.resize(k);
      specdec::detail::row_screen<T> screen;
      const std::size_t count = standardizer.apply_sparse(
          std::span<const T>(row), std::span<T>(scratch), outcome.ids.data(),
          outcome.weights.data(), outcome.top, &screen);
      outcome.ids.resize(count);
      outcome.weights.resize(count);
      outcome.screened_sum = screen.total();
      outcome.signs = screen.signs.passed();
      outcomes.push_back(std::move(outcome));
    }
    INFO("size " << size << ", k " << k << ", trial " << trial);
    CHECK(outcomes.front().signs == (trial % 4 == 0 || trial % 4 == 3));
    CHECK_FALSE(outcomes.front().ids.empty());
    for (const Outcome& outcome : outcomes) {
      CHECK(outcome.ids == outcomes.front().ids);
      REQUIRE(outcome.weights.size() == outcomes.front().weights.size());
      for (std::size_t j = 0; j < outcome.weights.size(); ++j) {
        CHECK(same_bits(outcome.weights[j], outcomes.front().weights[j]));
      }
      CHECK(same_bits(outcome.top, outcomes.front().top));
      CHECK(same_bits(outcome.screened_sum, outcomes.front().screened_sum));
      CHECK(outcome.signs == outcomes.front().signs);
    }
  }
}

TEMPLATE_TEST_CASE("Block sums: pairwise_sum16 adds the lanes in its documented order",
                   "[kernel_path]", float, double) {
  // Every mass table and row sum relies on one summation order, whatever the compiler makes
  // of the packs: eight[k] = l[k] + l[k + 8], four[k] = eight[k] + eight[k + 4], then
  // (four[0] + four[2]) + (four[1] + four[3]). Lanes of mixed signs and magnitudes from 2^-30
  // to 2^30 make almost every other pairing round differently.
  using T = TestType;
  specdec::xoshiro256pp g(2024);
  std::size_t mismatches = 0;
  std::size_t order_sensitive = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::array<T, 16> lanes{};
    for (T& lane : lanes) {
      const int exponent = static_cast<int>(specdec::uniform_below(g, 61)) - 30;
      const T magnitude = std::ldexp(T(1) + specdec::uniform01<T>(g), exponent);
      lane = specdec::uniform_below(g, 2) == 0 ? magnitude : -magnitude;
    }
    std::array<T, 8> eight{};
    for (std::size_t k = 0; k < 8; ++k) eight[k] = lanes[k] + lanes[k + 8];
    std::array<T, 4> four{};
    for (std::size_t k = 0; k < 4; ++k) four[k] = eight[k] + eight[k + 4];
    const T documented = (four[0] + four[2]) + (four[1] + four[3]);
    T in_order = 0;  // a plain left-to-right sum: how often the order matters at all
    for (const T lane : lanes) in_order += lane;
    if (in_order != documented) ++order_sensitive;
    const T got = specdec::detail::pairwise_sum16(lanes.data());
    if (std::memcmp(&got, &documented, sizeof got) != 0) ++mismatches;
    const double widened = specdec::detail::reduce_lanes(lanes);
    if (widened != static_cast<double>(documented)) ++mismatches;
  }
  CHECK(mismatches == 0);
  CHECK(order_sensitive > 5000);  // the inputs tell orders apart (float 9592, double more)
}
