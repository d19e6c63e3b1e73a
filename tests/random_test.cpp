// Tests for include/specdec/random.hpp: engine golden values, U[0,1) conversion, bounded
// integers, and the same results for every generator shape.
#include <array>
#include <cstdint>
#include <random>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/random.hpp"
#include "support/statistics.hpp"

TEST_CASE("splitmix64 matches the published reference output", "[random]") {
  specdec::splitmix64 g(0);
  CHECK(g() == 0xe220a8397b1dcdafULL);
  CHECK(g() == 0x6e789e6aa1b965f4ULL);
  CHECK(g() == 0x06c45d188009454fULL);
}

TEST_CASE("xoshiro256++ golden output for seed 42 (identical under every compiler)",
          "[random][golden]") {
  specdec::xoshiro256pp g(42);
  CHECK(g() == 0xd0764d4f4476689fULL);
  CHECK(g() == 0x519e4174576f3791ULL);
  CHECK(g() == 0xfbe07cfb0c24ed8cULL);
  CHECK(g() == 0xb37d9f600cd835b8ULL);
}

TEST_CASE("xoshiro256++ is a constexpr uniform_random_bit_generator", "[random]") {
  STATIC_REQUIRE(std::uniform_random_bit_generator<specdec::xoshiro256pp>);
  constexpr auto first = [] {
    specdec::xoshiro256pp g(42);
    return g();
  }();
  STATIC_REQUIRE(first == 0xd0764d4f4476689fULL);
  specdec::xoshiro256pp a(7);
  specdec::xoshiro256pp b(7);
  a.discard(10);
  for (int i = 0; i < 10; ++i) (void)b();
  CHECK(a == b);
}

TEST_CASE("uniform01 golden values and range", "[random][golden]") {
  specdec::xoshiro256pp g(42);
  CHECK(specdec::uniform01<double>(g) == 0.8143051451229099);
  CHECK(specdec::uniform01<double>(g) == 0.3188210400616611);
  specdec::xoshiro256pp h(42);
  CHECK(specdec::uniform01<float>(h) == 0.8143051266670227F);

  // The largest possible raw value maps strictly below 1.
  struct AllOnes {
    using result_type = std::uint64_t;
    static constexpr result_type min() { return 0; }
    static constexpr result_type max() { return ~result_type{0}; }
    result_type operator()() { return ~result_type{0}; }
  } ones;
  CHECK(specdec::uniform01<float>(ones) < 1.0F);
  CHECK(specdec::uniform01<double>(ones) < 1.0);
}

TEST_CASE("random_bits64 composes 32-bit and odd-range engines without bias",
          "[random][statistical]") {
  // std::mt19937 (32-bit) and std::minstd_rand (range [1, 2^31 - 2]) must give uniform
  // bytes in every byte position of the 64-bit result.
  auto check_bytes = [](auto& engine) {
    constexpr std::size_t draws = 200000;
    for (int byte = 0; byte < 8; byte += 7) {
      std::vector<std::uint64_t> counts(256, 0);
      auto copy = engine;
      for (std::size_t i = 0; i < draws; ++i) {
        ++counts[(specdec::random_bits64(copy) >> (8 * byte)) & 0xFFU];
      }
      const std::vector<double> expected(256, 1.0 / 256.0);
      const auto result = specdec::testing::chi_square_test(counts, expected);
      INFO("byte " << byte << ": " << result.describe());
      CHECK(result.passed());
    }
  };
  std::mt19937 mt(1);
  std::minstd_rand minstd(1);
  check_bytes(mt);
  check_bytes(minstd);

  // Broken variant: using minstd_rand's raw 31-bit output as if it were 64 bits leaves the
  // top byte always zero, which the same statistic rejects.
  std::vector<std::uint64_t> counts(256, 0);
  std::minstd_rand raw(1);
  for (int i = 0; i < 200000; ++i) ++counts[(static_cast<std::uint64_t>(raw()) >> 56) & 0xFFU];
  const std::vector<double> expected(256, 1.0 / 256.0);
  CHECK_FALSE(specdec::testing::chi_square_test(counts, expected).passed());
}

TEST_CASE("uniform_below is unbiased for a non-power-of-two bound", "[random][statistical]") {
  specdec::xoshiro256pp g(3);
  constexpr std::uint64_t bound = 37;
  std::vector<std::uint64_t> counts(bound, 0);
  for (int i = 0; i < 370000; ++i) {
    const auto value = specdec::uniform_below(g, bound);
    REQUIRE(value < bound);
    ++counts[value];
  }
  const std::vector<double> expected(bound, 1.0 / static_cast<double>(bound));
  const auto result = specdec::testing::chi_square_test(counts, expected);
  INFO(result.describe());
  CHECK(result.passed());

  // Broken variant: a biased modulo of an 8-bit value (256 % 37 != 0) is caught.
  std::vector<std::uint64_t> biased(bound, 0);
  for (int i = 0; i < 370000; ++i) ++biased[(g() & 0xFFU) % bound];
  CHECK_FALSE(specdec::testing::chi_square_test(biased, expected).passed());
}
