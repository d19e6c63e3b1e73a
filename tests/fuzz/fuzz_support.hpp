// Shared pieces of the specdec fuzz harnesses: turning fuzzer bytes into probability rows
// (valid ones most of the time, so that inputs get past validation; every kind of malformed
// row on request), a reference row check that mirrors validation.hpp's documented order,
// and an invariant check that aborts (libFuzzer then records the input as a crash).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "specdec/validation.hpp"

namespace specdec::fuzzing {

[[noreturn]] inline void invariant_violated(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "specdec fuzz: invariant violated: %s (%s:%d)\n", condition, file, line);
  std::abort();
}

// An invariant of the harness; a violation aborts so that libFuzzer saves the input.
#define SPECDEC_FUZZ_CHECK(condition) \
  ((condition) ? static_cast<void>(0) \
               : ::specdec::fuzzing::invariant_violated(#condition, __FILE__, __LINE__))

/// A value that probability code must cope with: NaN, infinities, negatives, denormals,
/// extremes, signed zero, or raw bits.
template <class T>
T special_value(FuzzedDataProvider& in) {
  using limits = std::numeric_limits<T>;
  switch (in.ConsumeIntegralInRange<int>(0, 11)) {
    case 0:
      return limits::quiet_NaN();
    case 1:
      return limits::infinity();
    case 2:
      return -limits::infinity();
    case 3:
      return T(-1e-30);
    case 4:
      return limits::denorm_min();
    case 5:
      return limits::min();
    case 6:
      return limits::max();
    case 7:
      return T(0);
    case 8:
      return -T(0);
    case 9:
      return T(-0.5);
    case 10:
      return T(2);
    default: {
      T value{};
      if constexpr (sizeof(T) == 4) {
        const auto bits = in.ConsumeIntegral<std::uint32_t>();
        std::memcpy(&value, &bits, sizeof value);
      } else {
        const auto bits = in.ConsumeIntegral<std::uint64_t>();
        std::memcpy(&value, &bits, sizeof value);
      }
      return value;
    }
  }
}

/// How a row is filled. Most kinds are valid rows (sum 1 within the default tolerance).
enum class row_kind : std::uint8_t {
  random_valid,     // positive weights from a seeded generator, normalised in double
  sparse_valid,     // most entries exactly zero
  one_hot,          // a single 1
  uniform,          // 1/V everywhere
  denormal_valid,   // valid, with denormal entries sprinkled in
  copy_previous,    // identical to the previous row (p == q: zero residual)
  near_one,         // valid row scaled by 1 + eps, eps around the tolerance
  special_entries,  // valid row with a few special values written over it
  all_zero,         // zero mass
  garbage,          // raw bytes
  count
};

/// Fills `row` (V entries) of the given kind from the fuzzer's bytes. `previous` is the
/// row before it (or empty).
template <class T>
void fill_row(FuzzedDataProvider& in, row_kind kind, std::span<T> row,
              std::span<const T> previous) {
  const std::size_t vocab = row.size();
  if (vocab == 0) return;
  xoshiro256pp g(in.ConsumeIntegral<std::uint64_t>());
  const auto normalise = [&](const std::vector<double>& weights) {
    double total = 0.0;
    for (const double w : weights) total += w;
    if (!(total > 0.0)) {
      std::fill(row.begin(), row.end(), T(0));
      row[0] = T(1);
      return;
    }
    for (std::size_t j = 0; j < vocab; ++j) row[j] = static_cast<T>(weights[j] / total);
  };
  switch (kind) {
    case row_kind::random_valid:
    case row_kind::near_one:
    case row_kind::special_entries: {
      std::vector<double> weights(vocab);
      const double sharpness = static_cast<double>(in.ConsumeIntegralInRange<int>(0, 40));
      for (double& w : weights) {
        const double u = uniform01<double>(g);
        w = sharpness == 0.0 ? u : std::exp(sharpness * (u - 1.0));
      }
      normalise(weights);
      if (kind == row_kind::near_one) {
        // 1 +- 1e-6 (the double tolerance), 1 +- 1e-3 (float), or anything in between.
        static constexpr double offsets[] = {1e-6,  -1e-6, 9e-7,   -9e-7, 1.1e-6, 1e-3,
                                             -1e-3, 9e-4,  1.1e-3, 1e-2,  -0.5,   0.25};
        const double offset =
            offsets[in.ConsumeIntegralInRange<std::size_t>(0, std::size(offsets) - 1)];
        for (T& value : row) value = static_cast<T>(static_cast<double>(value) * (1.0 + offset));
      } else if (kind == row_kind::special_entries) {
        const int specials = in.ConsumeIntegralInRange<int>(1, 3);
        for (int k = 0; k < specials; ++k) {
          row[in.ConsumeIntegralInRange<std::size_t>(0, vocab - 1)] = special_value<T>(in);
        }
      }
      return;
    }
    case row_kind::sparse_valid: {
      std::vector<double> weights(vocab, 0.0);
      const std::size_t nonzero =
          in.ConsumeIntegralInRange<std::size_t>(1, std::min<std::size_t>(vocab, 8));
      for (std::size_t k = 0; k < nonzero; ++k) {
        weights[uniform_below(g, vocab)] = 0.05 + uniform01<double>(g);
      }
      normalise(weights);
      return;
    }
    case row_kind::one_hot:
      std::fill(row.begin(), row.end(), T(0));
      row[in.ConsumeIntegralInRange<std::size_t>(0, vocab - 1)] = T(1);
      return;
    case row_kind::uniform:
      std::fill(row.begin(), row.end(), static_cast<T>(1.0 / static_cast<double>(vocab)));
      return;
    case row_kind::denormal_valid: {
      std::vector<double> weights(vocab);
      for (double& w : weights) w = uniform01<double>(g);
      normalise(weights);
      for (std::size_t j = 0; j < vocab; ++j) {
        if (uniform_below(g, 4) == 0) row[j] = std::numeric_limits<T>::denorm_min();
      }
      return;
    }
    case row_kind::copy_previous:
      if (previous.size() == vocab) {
        std::copy(previous.begin(), previous.end(), row.begin());
      } else {
        std::fill(row.begin(), row.end(), static_cast<T>(1.0 / static_cast<double>(vocab)));
      }
      return;
    case row_kind::all_zero:
      std::fill(row.begin(), row.end(), T(0));
      return;
    case row_kind::garbage:
    case row_kind::count:
      for (T& value : row) {
        value =
            in.remaining_bytes() > 0 ? special_value<T>(in) : static_cast<T>(uniform01<double>(g));
      }
      return;
  }
}

/// Picks a row kind: valid kinds most of the time, so that steps get verified.
inline row_kind pick_row_kind(FuzzedDataProvider& in) {
  const auto byte = in.ConsumeIntegral<std::uint8_t>();
  if (byte < 160) {
    static constexpr row_kind valid[] = {row_kind::random_valid,   row_kind::sparse_valid,
                                         row_kind::one_hot,        row_kind::uniform,
                                         row_kind::denormal_valid, row_kind::copy_previous};
    return valid[byte % std::size(valid)];
  }
  return static_cast<row_kind>(byte % static_cast<std::uint8_t>(row_kind::count));
}

/// The errc validate_probability_row must raise for `row` (nullopt: valid), following its
/// documented order: size, then the first NaN/Inf/negative entry, then zero mass, then the
/// normalisation (sum accumulated in double, in index order). `ambiguous` is set when the
/// sum is so close to the tolerance that either verdict is acceptable.
template <class T>
std::optional<errc> expected_row_error(std::span<const T> row, std::size_t vocab_size,
                                       double tolerance, bool& ambiguous) {
  if (vocab_size == 0 || row.size() != vocab_size) return errc::invalid_size;
  double sum = 0.0;
  for (const T value : row) {
    if (std::isnan(value) || std::isinf(value) || value < T(0)) return errc::invalid_probability;
    sum += static_cast<double>(value);
  }
  if (sum == 0.0) return errc::zero_mass;
  const double off = std::abs(sum - 1.0);
  if (std::abs(off - tolerance) <= 1e-12) ambiguous = true;
  if (!(off <= tolerance)) return errc::not_normalized;
  return std::nullopt;
}

/// Checks that a thrown specdec::error has one of the allowed codes and the documented
/// message shape "specdec: <code>: <non-empty message>".
inline void check_error(const error& e, const std::vector<errc>& allowed) {
  SPECDEC_FUZZ_CHECK(!allowed.empty());
  SPECDEC_FUZZ_CHECK(std::find(allowed.begin(), allowed.end(), e.code()) != allowed.end());
  const std::string prefix = std::string("specdec: ") + std::string(to_string(e.code())) + ": ";
  const std::string what = e.what();
  SPECDEC_FUZZ_CHECK(what.size() > prefix.size() && what.compare(0, prefix.size(), prefix) == 0);
}

}  // namespace specdec::fuzzing
