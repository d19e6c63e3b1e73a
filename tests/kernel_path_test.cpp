// Tests for include/specdec/kernel_path.hpp: choosing, forcing and resetting the kernel
// path, and the dispatched kernels giving identical answers on every path this CPU has.
// (The exactness suites that include the kernel path listener of tests/support run whole on each
// path: tests/CMakeLists.txt.)
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/detail/row_kernels.hpp"
#include "specdec/error.hpp"
#include "specdec/kernel_path.hpp"
#include "specdec/random.hpp"

namespace {

using specdec::kernel_path;

/// Restores the unforced state when a test ends, whatever it forced.
struct ResetKernelPath {
  ResetKernelPath() = default;
  ResetKernelPath(const ResetKernelPath&) = delete;
  ResetKernelPath& operator=(const ResetKernelPath&) = delete;
  ~ResetKernelPath() { specdec::reset_kernel_path(); }
};

std::vector<kernel_path> supported_paths() {
  std::vector<kernel_path> paths{kernel_path::portable};
  if (specdec::kernel_path_supported(kernel_path::avx2)) paths.push_back(kernel_path::avx2);
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
#if SPECDEC_DISPATCH_AVX2
  // On x86 with GCC or Clang the best path follows the CPU.
  CHECK((specdec::best_kernel_path() == kernel_path::avx2) ==
        (__builtin_cpu_supports("avx2") != 0));
#else
  CHECK(specdec::best_kernel_path() == kernel_path::portable);
#endif
  const kernel_path before = specdec::force_kernel_path(kernel_path::portable);
  CHECK(before == specdec::best_kernel_path());
  CHECK(specdec::active_kernel_path() == kernel_path::portable);
  CHECK(!specdec::detail::use_avx2());
  specdec::reset_kernel_path();
  CHECK(specdec::active_kernel_path() == specdec::best_kernel_path());
}

TEST_CASE("kernel_path: forcing a path the CPU lacks throws and changes nothing", "[kernel_path]") {
  const ResetKernelPath reset;
  if (specdec::kernel_path_supported(kernel_path::avx2)) {
    CHECK(specdec::force_kernel_path(kernel_path::avx2) == specdec::best_kernel_path());
    CHECK(specdec::active_kernel_path() == kernel_path::avx2);
    CHECK(specdec::detail::use_avx2());
  } else {
    specdec::force_kernel_path(kernel_path::portable);
    try {
      specdec::force_kernel_path(kernel_path::avx2);
      FAIL("forcing an unsupported path did not throw");
    } catch (const specdec::error& e) {
      CHECK(e.code() == specdec::errc::invalid_option);
      CHECK(std::string(e.what()).find("avx2") != std::string::npos);
    }
    CHECK(specdec::active_kernel_path() == kernel_path::portable);
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
