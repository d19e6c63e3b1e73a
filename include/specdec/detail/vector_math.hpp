// specdec — private: the log and exp behind temperature and softmax, written once as
// branch-free scalar code that GCC and Clang vectorize, and dispatched (kernel_path.hpp) to
// a portable and an AVX2 build of the same loops.
//
// Why not std::exp / std::log: they are scalar calls, and their last bit differs between C
// libraries. Why not Eigen's: its instruction set is fixed when the translation unit is
// compiled (SSE2 by default), so it cannot be dispatched. These functions use only +, -, *,
// /, comparisons and bit operations in a fixed order, so a tempered row is bitwise the same
// under GCC and Clang, every C library and every kernel path (without FMA contraction).
// Measured on a 128k float row (2-core AMD EPYC VM, T = 0.7): Eigen's SSE2 log + exp
// ~920 us, this code ~590 us on the portable (SSE2) path and ~265 us with AVX2.
//
// Accuracy (tests/vector_math_test.cpp, against long double): log within 2 ulp, log2 within
// 3 ulp, exp and exp2 within 2.5 ulp of T; a tempered weight 2^(s (log2 x - log2 top)) then
// carries the unavoidable relative error of about |s log x| ulp that any exp(s log x) has.
//
// Methods (textbook): log(x) = e ln 2 + log(m) with m in [sqrt(1/2), sqrt(2)) taken from the
// bits of x, and log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716, by its Taylor
// series (terms to s^9 for float, s^21 for double). exp(y) = 2^n exp(r), n = round(y / ln 2),
// r = y - n ln 2 in two parts, |r| <= ln(2) / 2, by its Taylor series (to r^7 for float,
// r^13 for double), and 2^n added to the exponent bits. Tempered weights use the base-2
// forms: log2 is the same series scaled by 1 / ln 2 plus the exponent as it is, and exp2
// splits y = n + r exactly, so neither multiplies by ln 2 in two parts.
#pragma once
// Packs passed between always-inlined functions trigger the compilers' notes on the vector
// ABI (-Wpsabi); nothing here crosses an ABI boundary.
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "specdec/detail/row_kernels.hpp"
#include "specdec/kernel_path.hpp"

// A bit cast that instantiates no function (std::bit_cast returning a 32-byte pack from a
// function compiled without AVX would draw GCC's vector ABI warning in users' builds).
#if defined(__GNUC__) || defined(__clang__)
#define SPECDEC_BIT_CAST(To, from) __builtin_bit_cast(To, from)
#else
#define SPECDEC_BIT_CAST(To, from) std::bit_cast<To>(from)
#endif

namespace specdec::detail {

SPECDEC_KERNELS_BEGIN

template <class T>
struct float_bits;

template <>
struct float_bits<float> {
  using uint = std::uint32_t;
  static constexpr int mantissa = 23;
  static constexpr uint exponent_mask = 0xffU;
  static constexpr int bias = 127;
  static constexpr uint one = 0x3f800000U;
  static constexpr uint sqrt_half = 0x3f3504f3U;       // the float nearest sqrt(1/2)
  static constexpr float ln2_hi = 0.693145751953125f;  // 15 significant bits: e ln2_hi is exact
  static constexpr float ln2_lo = 1.428606765330187e-06f;
  static constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23
  // Below this exponent exp(y) is under the smallest normal float (and n >= -126 above it).
  static constexpr float exp_floor = -87.6f;
  // Below this, 2^y is under the smallest normal float (and round(y) >= -126 above it).
  static constexpr float exp2_floor = -126.4f;
  static constexpr float subnormal_scale = 8388608.0f;  // 2^23
  static constexpr float int_magic = 8388608.0f;        // 2^23: bits | k read as 2^23 + k
};

template <>
struct float_bits<double> {
  using uint = std::uint64_t;
  static constexpr int mantissa = 52;
  static constexpr uint exponent_mask = 0x7ffU;
  static constexpr int bias = 1023;
  static constexpr uint one = 0x3ff0000000000000ULL;
  static constexpr uint sqrt_half = 0x3fe6a09e667f3bcdULL;      // the double nearest sqrt(1/2)
  static constexpr double ln2_hi = 6.93147180369123816490e-01;  // 21 trailing zero bits
  static constexpr double ln2_lo = 1.90821492927058770002e-10;
  static constexpr double round_magic = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr double exp_floor = -708.7;
  static constexpr double exp2_floor = -1022.4;
  static constexpr double subnormal_scale = 4503599627370496.0;  // 2^52
  static constexpr double int_magic = 4503599627370496.0;        // 2^52
};

/// The arithmetic of the functions below on a scalar T or on a pack of T (GCC / Clang
/// vector extension): the same source, so a pack's lanes equal the scalar results bitwise.
/// Packs never pass by value between functions (every function works in place on a
/// reference): a 32-byte pack argument of a function compiled without AVX would draw GCC's
/// vector ABI warning, inlined or not.
template <class T>
struct lanes_of {
  using scalar = T;
  using uint = typename float_bits<T>::uint;
};

#if defined(__GNUC__) || defined(__clang__)
#define SPECDEC_VECTOR_MATH_PACKS 1
/// Packs of one register: 16 bytes on the portable (SSE2) path, 32 on the AVX2 path, 64 on the
/// AVX-512 path (packs wider than a register make GCC split compares and selects).
template <class T, std::size_t Bytes>
using pack_t [[gnu::vector_size(Bytes)]] = T;
template <class T, std::size_t Bytes>
using pack_uint_t [[gnu::vector_size(Bytes)]] = typename float_bits<T>::uint;

template <class T, std::size_t Bytes>
struct pack_lanes {
  using scalar = T;
  using uint = pack_uint_t<T, Bytes>;
};
template <>
struct lanes_of<pack_t<float, 16>> : pack_lanes<float, 16> {};
template <>
struct lanes_of<pack_t<double, 16>> : pack_lanes<double, 16> {};
template <>
struct lanes_of<pack_t<float, 32>> : pack_lanes<float, 32> {};
template <>
struct lanes_of<pack_t<double, 32>> : pack_lanes<double, 32> {};
template <>
struct lanes_of<pack_t<float, 64>> : pack_lanes<float, 64> {};
template <>
struct lanes_of<pack_t<double, 64>> : pack_lanes<double, 64> {};
#else
#define SPECDEC_VECTOR_MATH_PACKS 0
#endif

/// Coefficient k of the logarithms' series in s (log(m) = 2 atanh(s) = sum of c[k] s^k over
/// odd k): 2 / k, in base 2 scaled by 1 / ln 2.
template <class T, bool base2>
[[nodiscard]] consteval std::array<T, 22> atanh_coefficients() noexcept {
  constexpr long double log2e = 1.44269504088896340735992468100189214L;
  std::array<T, 22> c{};
  for (int k = 1; k < 22; k += 2) {
    c[static_cast<std::size_t>(k)] =
        base2 ? static_cast<T>(2 * log2e / k) : static_cast<T>(2.0 / k);
  }
  return c;
}

/// Coefficient k of the exponentials' Taylor series in r: 1 / k!, in base 2 (ln 2)^k / k!.
template <class T, bool base2>
[[nodiscard]] consteval std::array<T, 14> exp_coefficients() noexcept {
  constexpr long double ln2 = 0.693147180559945309417232121458176568L;
  std::array<T, 14> c{};
  long double power = 1;  // (ln 2)^k / k!
  double factorial = 1;   // k!, exact in double up to 13!
  for (int k = 0; k < 14; ++k) {
    c[static_cast<std::size_t>(k)] =
        base2 ? static_cast<T>(power) : static_cast<T>(1.0 / factorial);
    power = power * ln2 / (k + 1);
    factorial *= k + 1;
  }
  return c;
}

/// x = log(x) (base2: log2(x)) lane by lane for x >= 0 (including subnormal x); log(1) = 0
/// exactly. x = 0 gives -infinity, +infinity and NaN give themselves, negative x give
/// -infinity (a weight of 0). Selections are `?:` (a blend on packs, no branch). Base 2
/// scales the series by 1 / ln 2 and adds the exponent as it is, where base e adds it times
/// ln 2 in two parts: tempered weights use base 2, whose exp2 needs no ln 2 reduction either.
/// Plain: every lane is known to be a normal positive finite number, so the selections
/// for subnormal, zero, infinite and NaN lanes are left out (they would keep every lane as
/// it is: the results are bitwise the same).
template <bool base2, bool plain = false, class V>
SPECDEC_KERNEL_INLINE void logarithm_lanes(V& x) noexcept {
  using T = typename lanes_of<V>::scalar;
  using bits = float_bits<T>;
  using uint = typename lanes_of<V>::uint;
  using word = typename bits::uint;
  constexpr T smallest_normal = std::numeric_limits<T>::min();
  constexpr std::array<T, 22> c = atanh_coefficients<T, base2>();
  const V zero{};
  V scaled = x;
  V extra = zero;
  if constexpr (!plain) {
    const auto subnormal = x < smallest_normal;
    scaled = subnormal ? x * bits::subnormal_scale : x;
    extra = subnormal ? zero + T(-bits::mantissa) : zero;
  }
  // Shift the mantissa range [1, 2) to [sqrt(1/2), sqrt(2)) by an integer offset.
  const uint offset = SPECDEC_BIT_CAST(uint, scaled) + word(bits::one - bits::sqrt_half);
  const uint field = (offset >> static_cast<word>(bits::mantissa)) & bits::exponent_mask;
  // The exponent field as T without an integer conversion (none exists for 64-bit lanes
  // before AVX-512): the bits of 2^mantissa with the field in the low bits, minus 2^mantissa.
  const V with_magic = SPECDEC_BIT_CAST(V, SPECDEC_BIT_CAST(word, bits::int_magic) | field);
  V e;
  if constexpr (plain) {
    // One subtraction: every value here is an integer below 2^(mantissa + 1), so both
    // forms are exact and give the same bits (the zero `extra` adds none: +0 stays +0).
    e = with_magic - T(bits::int_magic + T(bits::bias));
  } else {
    e = ((with_magic - bits::int_magic) - T(bits::bias)) + extra;
  }
  constexpr word mantissa_mask = (word{1} << static_cast<unsigned>(bits::mantissa)) - 1;
  const V m = SPECDEC_BIT_CAST(V, (offset & mantissa_mask) + bits::sqrt_half);
  const V f = m - T(1);
  const V s = f / (T(2) + f);
  const V z = s * s;
  V series;  // (log(m) - c1 s) / (s z)
  if constexpr (sizeof(T) == 4) {
    series = c[3] + z * (c[5] + z * (c[7] + z * c[9]));
  } else {
    const V z2 = z * z;  // two interleaved Horner chains (even and odd powers of z)
    const V even = c[3] + z2 * (c[7] + z2 * (c[11] + z2 * (c[15] + z2 * c[19])));
    const V odd = c[5] + z2 * (c[9] + z2 * (c[13] + z2 * (c[17] + z2 * c[21])));
    series = even + z * odd;
  }
  const V log_m = c[1] * s + s * z * series;
  V result;
  if constexpr (base2) {
    result = e + log_m;
  } else {
    result = e * bits::ln2_hi + (log_m + e * bits::ln2_lo);
  }
  if constexpr (plain) {
    x = result;
  } else {
    const V finite = x > T(0) ? result : zero - std::numeric_limits<T>::infinity();
    x = x < std::numeric_limits<T>::infinity() ? finite : x;  // NaN and +inf stay
  }
}

/// y = exp(y) (base2: 2^y) lane by lane for y <= 0, flushed: results below the smallest
/// normal number (exp(-infinity) included) are exactly 0; exp(0) = 1 exactly; NaN stays NaN.
/// y = n ln 2 + r with n = round(y / ln 2) and r in two parts (base 2: y = n + r, exact),
/// then the Taylor series of exp(r) (base 2: of exp(r ln 2)).
/// Precondition: y is not positive beyond rounding (larger y give wrong values, never UB).
/// Plain: every lane is known to be a number whose result is a normal number (y at least
/// the floor plus one), so the clamp, the flush and the NaN selection are left out (bitwise
/// the same results there).
template <bool base2, bool plain = false, class V>
SPECDEC_KERNEL_INLINE void exponential_lanes(V& y) noexcept {
  using T = typename lanes_of<V>::scalar;
  using bits = float_bits<T>;
  using uint = typename lanes_of<V>::uint;
  using word = typename bits::uint;
  constexpr T log2e = T(1.4426950408889634074);
  constexpr std::array<T, 14> c = exp_coefficients<T, base2>();
  constexpr T floor = base2 ? bits::exp2_floor : bits::exp_floor;
  const V zero{};
  // Clamping keeps the bit arithmetic below in range (NaN passes, handled at the end).
  V clamped = y;
  if constexpr (!plain) clamped = y < floor ? zero + floor : y;
  V shifted;
  if constexpr (base2) {
    shifted = clamped + bits::round_magic;
  } else {
    shifted = clamped * log2e + bits::round_magic;
  }
  const V n = shifted - bits::round_magic;  // round(y / ln 2), exactly an integer
  const uint n_bits = SPECDEC_BIT_CAST(uint, shifted) - SPECDEC_BIT_CAST(word, bits::round_magic);
  V r;
  if constexpr (base2) {
    r = clamped - n;
  } else {
    r = (clamped - n * bits::ln2_hi) - n * bits::ln2_lo;
  }
  // The Taylor series, as two interleaved Horner chains in r^2.
  const V r2 = r * r;
  V p;
  if constexpr (sizeof(T) == 4) {
    const V even = c[0] + r2 * (c[2] + r2 * (c[4] + r2 * c[6]));
    const V odd = c[1] + r2 * (c[3] + r2 * (c[5] + r2 * c[7]));
    p = even + r * odd;
  } else {
    const V even =
        c[0] + r2 * (c[2] + r2 * (c[4] + r2 * (c[6] + r2 * (c[8] + r2 * (c[10] + r2 * c[12])))));
    const V odd =
        c[1] + r2 * (c[3] + r2 * (c[5] + r2 * (c[7] + r2 * (c[9] + r2 * (c[11] + r2 * c[13])))));
    p = even + r * odd;
  }
  // n >= -126 (float) / -1022 (double) here and p >= 0.7, so the biased exponent stays >= 0;
  // where it reaches 0 the bits read as a number below the smallest normal, flushed below
  // (2^n p at the floor is below it too, so clamped exponents come out as 0).
  const V scaled = SPECDEC_BIT_CAST(
      V, SPECDEC_BIT_CAST(uint, p) + (n_bits << static_cast<word>(bits::mantissa)));
  if constexpr (plain) {
    y = scaled;
  } else {
    const V result = scaled < std::numeric_limits<T>::min() ? zero : scaled;
    y = y == y ? result : y;
  }
}

template <class V>
SPECDEC_KERNEL_INLINE void log_lanes(V& x) noexcept {
  logarithm_lanes<false>(x);
}
template <class V>
SPECDEC_KERNEL_INLINE void log2_lanes(V& x) noexcept {
  logarithm_lanes<true>(x);
}
template <class V>
SPECDEC_KERNEL_INLINE void exp_lanes(V& y) noexcept {
  exponential_lanes<false>(y);
}
template <class V>
SPECDEC_KERNEL_INLINE void exp2_lanes(V& y) noexcept {
  exponential_lanes<true>(y);
}

/// x = (x / top)^scale = 2^((log2(x) - log2_top) * scale) lane by lane, with log2_top =
/// log2_positive(top), flushed like exp2_lanes, for 0 <= x <= top and scale > 0: x = top
/// gives exactly 1. (No division: the difference of logs is off by about ulp(log2_top),
/// which adds about |log2_top| scale ulp to the weight's relative error.) Base 2 rather than
/// e: neither function multiplies by ln 2 in two parts (measured on a 128k float row, Intel
/// Xeon VM: AVX-512 147 -> 121 us, AVX2 265 -> 234 us, portable 509 -> 451 us).
template <bool plain = false, class V, class T>
SPECDEC_KERNEL_INLINE void tempered_lanes(V& x, T log2_top, T scale) noexcept {
  logarithm_lanes<true, plain>(x);
  x = (x - log2_top) * scale;
  exponential_lanes<true, plain>(x);
}

/// Scalar forms (what a single weight uses; bitwise equal to the packs' lanes: out of line
/// under GCC, so that they never take FMA contractions from a caller's -march=native).
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline T log_positive(T x) noexcept {
  static_assert(std::is_floating_point_v<T>);
  log_lanes(x);
  return x;
}
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline T exp_nonpositive(T y) noexcept {
  static_assert(std::is_floating_point_v<T>);
  exp_lanes(y);
  return y;
}
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline T log2_positive(T x) noexcept {
  static_assert(std::is_floating_point_v<T>);
  log2_lanes(x);
  return x;
}
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline T exp2_nonpositive(T y) noexcept {
  static_assert(std::is_floating_point_v<T>);
  exp2_lanes(y);
  return y;
}
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline T tempered_weight(T x, T log2_top, T scale) noexcept {
  static_assert(std::is_floating_point_v<T>);
  tempered_lanes(x, log2_top, scale);
  return x;
}

#if SPECDEC_VECTOR_MATH_PACKS
/// Applies `lane(x)` (in place on x) to every entry of `in` (as T) into `out`: whole packs,
/// then scalars.
template <std::size_t Bytes, class T, class U, class Lane>
SPECDEC_KERNEL_INLINE void map_lanes(const U* in, T* out, std::size_t size, Lane lane) noexcept {
  using pack = pack_t<T, Bytes>;
  constexpr std::size_t width = Bytes / sizeof(T);
  const auto load = [in](pack& x, std::size_t at) SPECDEC_LAMBDA_INLINE {
    if constexpr (std::is_same_v<T, U>) {
      std::memcpy(&x, in + at, sizeof x);
    } else {
      for (std::size_t k = 0; k < width; ++k) x[k] = static_cast<T>(in[at + k]);
    }
  };
  std::size_t j = 0;
  // Two packs per iteration: the long dependent chains of the two overlap.
  for (; j + 2 * width <= size; j += 2 * width) {
    pack x;
    pack y;
    load(x, j);
    load(y, j + width);
    lane(x);
    lane(y);
    std::memcpy(out + j, &x, sizeof x);
    std::memcpy(out + j + width, &y, sizeof y);
  }
  for (; j + width <= size; j += width) {
    pack x;
    load(x, j);
    lane(x);
    std::memcpy(out + j, &x, sizeof x);
  }
  for (; j < size; ++j) {
    T x = static_cast<T>(in[j]);
    lane(x);
    out[j] = x;
  }
}
#else
template <std::size_t Bytes, class T, class U, class Lane>
inline void map_lanes(const U* in, T* out, std::size_t size, Lane lane) noexcept {
  for (std::size_t j = 0; j < size; ++j) {
    T x = static_cast<T>(in[j]);
    lane(x);
    out[j] = x;
  }
}
#endif

/// Entries per block of the screened passes below.
inline constexpr std::size_t tempered_block = 256;
static_assert(tempered_block % kernel_block == 0);

/// The positive mass of a written row as nucleus_screened_band sums a row's total
/// (sampling_kernels.hpp): each block of kernel_block entries in 16 lanes of T (entry j in
/// lane j % 16, each lane in entry order; a NaN, zero or negative entry adds +0), the
/// block's lanes widened into 16 double lanes, combined by pairwise_sum16 at the end. The
/// mass-taking forms of the screened passes (tempered_weights_mass, exp2_shifted_mass) add
/// each block while it is in L1, instead of a pass of their caller's over the row.
using mass_lanes = std::array<double, kernel_lanes>;

/// One block's lanes: 16 T lanes of kernel_block entries (also nucleus_screened_band's).
template <class T>
using block_lanes = std::array<T, kernel_lanes>;

/// Adds a block's lanes into the double lanes.
template <class T>
SPECDEC_KERNEL_INLINE void widen_block_lanes(const block_lanes<T>& block,
                                             mass_lanes& lanes) noexcept {
  for (std::size_t k = 0; k < kernel_lanes; ++k) lanes[k] += static_cast<double>(block[k]);
}

/// A row's largest entry (NaN entries passed over, -infinity when there is none: span_max's),
/// its positive mass and whether every entry is >= 0 (no NaN, no negative entry: then the
/// mass is the row's sum, and with it the decoder's validation screen), in one pass
/// (nucleus_max_total, nucleus_screened_band, log2_with_max_screen).
template <class T>
struct max_and_total {
  T maximum;
  double total;
  bool signs_passed;
};

/// Adds the `count` entries at `from` (count <= kernel_block; `from` starts a block) as one
/// block, one entry at a time.
template <class T>
SPECDEC_KERNEL_INLINE void add_mass_entries(const T* from, std::size_t count,
                                            mass_lanes& lanes) noexcept {
  block_lanes<T> block{};
  for (std::size_t i = 0; i < count; ++i) {
    const T value = from[i];
    block[i % kernel_lanes] += value > T(0) ? value : T(0);
  }
  widen_block_lanes(block, lanes);
}

/// Adds the `count` entries at `from` (a block start) block by block and returns the mass.
template <class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE double finish_mass(const T* from, std::size_t count,
                                                       mass_lanes& lanes) noexcept {
  std::size_t j = 0;
  for (; j + kernel_block <= count; j += kernel_block)
    add_mass_entries(from + j, kernel_block, lanes);
  add_mass_entries(from + j, count - j, lanes);
  return pairwise_sum16(lanes.data());
}

#if SPECDEC_VECTOR_MATH_PACKS
/// add_mass_entries for a full block, on packs of `Bytes` (the same additions, lane for lane).
template <std::size_t Bytes, class T>
SPECDEC_KERNEL_INLINE void add_mass_block(const T* from, mass_lanes& lanes) noexcept {
  using pack = pack_t<T, Bytes>;
  constexpr std::size_t width = Bytes / sizeof(T);
  static_assert(kernel_lanes % width == 0);
  constexpr std::size_t packs = kernel_lanes / width;
  pack sum[packs] = {};
  for (std::size_t g = 0; g < kernel_block; g += kernel_lanes) {
    for (std::size_t h = 0; h < packs; ++h) {
      pack x;
      std::memcpy(&x, from + g + h * width, sizeof x);
      sum[h] += x > pack{} ? x : pack{};  // NaN, -0 and negative lanes add +0
    }
  }
  block_lanes<T> block;
  std::memcpy(block.data(), sum, sizeof sum);
  widen_block_lanes(block, lanes);
}
#endif

/// The range of entries a screened pass may give its plain form (tempered_weights,
/// exp2_shifted and shifted_exp compute it): [from, to], where every lane the form sees is
/// an ordinary number whose result needs none of the special-value selections. `to` <
/// `from`: none.
template <class T>
struct plain_range {
  T from;
  T to;
};

#if SPECDEC_VECTOR_MATH_PACKS
/// The screened passes: blocks of tempered_block entries, each screened first (one integer
/// subtraction and maximum per pack, `fits`); a block that fits takes `plain` (the lanes
/// without the selections for special values, bitwise the same results on such entries) two
/// packs per iteration, so that their two long chains of dependent operations overlap (a
/// 64k float row in L2: 52.3 -> 49.0 us with AVX-512, best of 3000 runs); any other block,
/// and the tail, takes `full` (map_lanes). `written(out + j)` sees each block once it is
/// written, while it is in L1. In place works (a block is read whole before it is
/// written). Returns where the tail starts.
template <std::size_t Bytes, class T, class Fits, class Plain, class Full, class Written>
SPECDEC_KERNEL_INLINE std::size_t screened_blocks(const T* in, T* out, std::size_t size, Fits fits,
                                                  Plain plain, Full full,
                                                  Written written) noexcept {
  using pack = pack_t<T, Bytes>;
  constexpr std::size_t width = Bytes / sizeof(T);
  static_assert(tempered_block % (2 * width) == 0);
  std::size_t j = 0;
  for (; j + tempered_block <= size; j += tempered_block) {
    // The block prefetch_distance ahead asked for, line by line (kernel_path.hpp).
    for (std::size_t h = j; h < j + tempered_block; h += cache_line / sizeof(T)) {
      prefetch_ahead(in, h);
      prefetch_ahead<true>(out, h);
    }
    if (fits(in + j)) {
      for (std::size_t h = j; h < j + tempered_block; h += 2 * width) {
        pack x;
        pack y;
        std::memcpy(&x, in + h, sizeof x);
        std::memcpy(&y, in + h + width, sizeof y);
        plain(x);
        plain(y);
        std::memcpy(out + h, &x, sizeof x);
        std::memcpy(out + h + width, &y, sizeof y);
      }
    } else {
      map_lanes<Bytes>(in + j, out + j, tempered_block, full);
    }
    written(out + j);
  }
  map_lanes<Bytes>(in + j, out + j, size - j, full);
  return j;
}

/// screened_blocks' `written`, and log2_with_max's screen of the blocks it reads: adds a
/// block of tempered_block entries into the mass lanes (Mass), or nothing.
template <std::size_t Bytes, bool Mass>
struct block_mass {
  mass_lanes* lanes;
  template <class T>
  SPECDEC_KERNEL_INLINE void operator()(const T* block) const noexcept {
    if constexpr (Mass) {
      for (std::size_t b = 0; b < tempered_block; b += kernel_block) {
        add_mass_block<Bytes>(block + b, *lanes);
      }
    }
  }
};

/// The largest of a pack's unsigned lanes.
template <std::size_t Bytes, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE typename float_bits<T>::uint largest_lane(
    const pack_uint_t<T, Bytes>& lanes) noexcept {
  typename float_bits<T>::uint largest = 0;
  for (std::size_t k = 0; k < Bytes / sizeof(T); ++k) {
    largest = lanes[k] > largest ? lanes[k] : largest;
  }
  return largest;
}

/// Whether a block of non-negative numbers lies in [from, from + room in bits]: positive
/// numbers order as their bits, so x lies there iff bits(x) - bits(from) (unsigned,
/// wrapping below `from`) is at most `room`. Negative and NaN x never do (their bits lie
/// above those of +inf). `each` sees every pack on the way (log2_with_max's maximum).
template <std::size_t Bytes, class T, class Each>
[[nodiscard]] SPECDEC_KERNEL_INLINE bool block_in_bits_range(const T* block,
                                                             typename float_bits<T>::uint from,
                                                             typename float_bits<T>::uint room,
                                                             Each each) noexcept {
  using pack = pack_t<T, Bytes>;
  using upack = pack_uint_t<T, Bytes>;
  upack widest{};
  for (std::size_t h = 0; h < tempered_block; h += Bytes / sizeof(T)) {
    pack x;
    std::memcpy(&x, block + h, sizeof x);
    each(x);
    const upack distance = SPECDEC_BIT_CAST(upack, x) - from;
    widest = distance > widest ? distance : widest;
  }
  return largest_lane<Bytes, T>(widest) <= room;
}

/// An unsigned key in the order of the numbers (NaN keys beyond those of the infinities):
/// all bits flipped where the sign bit is set, else the sign bit set.
template <class T>
[[nodiscard]] inline typename float_bits<T>::uint order_key(T value) noexcept {
  using word = typename float_bits<T>::uint;
  constexpr word sign_bit = word{1} << (8 * sizeof(word) - 1);
  const auto bits = SPECDEC_BIT_CAST(word, value);
  return (bits & sign_bit) != 0 ? static_cast<word>(~bits) : static_cast<word>(bits | sign_bit);
}

/// Whether a block of numbers of either sign lies in [from, to]: their order keys (an
/// arithmetic shift, an OR and an XOR per pack), then block_in_bits_range's test on the
/// keys (comparisons of 64-byte packs would go through mask registers, which GCC
/// scalarizes here).
template <std::size_t Bytes, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE bool block_in_key_range(
    const T* block, typename float_bits<T>::uint from, typename float_bits<T>::uint room) noexcept {
  using upack = pack_uint_t<T, Bytes>;
  using word = typename float_bits<T>::uint;
  using signed_word = std::make_signed_t<word>;
  using spack [[gnu::vector_size(Bytes)]] = signed_word;
  constexpr unsigned last_bit = 8 * sizeof(word) - 1;
  constexpr word sign_bit = word{1} << last_bit;
  upack widest{};
  for (std::size_t h = 0; h < tempered_block; h += Bytes / sizeof(T)) {
    upack bits;
    std::memcpy(&bits, block + h, sizeof bits);
    const upack flip =
        SPECDEC_BIT_CAST(upack, SPECDEC_BIT_CAST(spack, bits) >> signed_word{last_bit}) | sign_bit;
    const upack distance = (bits ^ flip) - from;
    widest = distance > widest ? distance : widest;
  }
  return largest_lane<Bytes, T>(widest) <= room;
}
#endif

/// tempered_weights: blocks whose entries all lie in the plain range (normal, exponent in
/// [floor + 1, 64]) take tempered_lanes<true>. With `Mass`, returns the written row's
/// positive mass (mass_lanes' order), else 0.
template <std::size_t Bytes, bool Mass, class T, class U>
SPECDEC_KERNEL_INLINE double tempered_weights_body(const U* in, T* out, std::size_t size, T log_top,
                                                   T scale, plain_range<T> plain) noexcept {
  const auto full = [log_top, scale](auto& x)
                        SPECDEC_LAMBDA_INLINE { tempered_lanes(x, log_top, scale); };
  mass_lanes lanes{};
#if SPECDEC_VECTOR_MATH_PACKS
  if constexpr (std::is_same_v<T, U>) {
    using word = typename float_bits<T>::uint;
    const bool any = plain.from <= plain.to;
    const auto from = SPECDEC_BIT_CAST(word, plain.from);
    const word room = any ? SPECDEC_BIT_CAST(word, plain.to) - from : word{0};
    const auto fits = [any, from, room](const T* block) SPECDEC_LAMBDA_INLINE {
      return any && block_in_bits_range<Bytes>(block, from, room,
                                               [](const auto&) SPECDEC_LAMBDA_INLINE {});
    };
    const auto plain_lanes = [log_top, scale](auto& x)
                                 SPECDEC_LAMBDA_INLINE { tempered_lanes<true>(x, log_top, scale); };
    const std::size_t j = screened_blocks<Bytes>(in, out, size, fits, plain_lanes, full,
                                                 block_mass<Bytes, Mass>{&lanes});
    if constexpr (Mass) return finish_mass(out + j, size - j, lanes);
    return 0.0;
  }
#endif
  static_cast<void>(plain);
  map_lanes<Bytes>(in, out, size, full);
  if constexpr (Mass) return finish_mass(out, size, lanes);
  return 0.0;
}

/// log2_with_max: out[j] = log2(in[j]) as log2_lanes, blocks of normal positive finite
/// entries without the special-value selections; the largest entry as span_max finds it,
/// and with `Screen` the row's mass and signs (a block of normal positive entries passes
/// its signs as it is screened; any other block is checked entry by entry).
template <std::size_t Bytes, bool Screen, class T>
SPECDEC_KERNEL_INLINE max_and_total<T> log2_with_max_body(const T* in, T* out,
                                                          std::size_t size) noexcept {
  const auto full = [](auto& x) SPECDEC_LAMBDA_INLINE { logarithm_lanes<true>(x); };
  T maximum = -std::numeric_limits<T>::infinity();
  mass_lanes lanes{};
  bool signs_passed = true;
  std::size_t j = 0;
#if SPECDEC_VECTOR_MATH_PACKS
  using pack = pack_t<T, Bytes>;
  using word = typename float_bits<T>::uint;
  constexpr word from = SPECDEC_BIT_CAST(word, std::numeric_limits<T>::min());
  constexpr word room = SPECDEC_BIT_CAST(word, std::numeric_limits<T>::max()) - from;
  pack best = pack{} - std::numeric_limits<T>::infinity();
  j = screened_blocks<Bytes>(
      in, out, size,
      [&](const T* block) SPECDEC_LAMBDA_INLINE {  // best; with Screen, lanes and signs_passed
        const bool fits = block_in_bits_range<Bytes>(
            block, from, room,
            [&best](const pack& x) SPECDEC_LAMBDA_INLINE { best = x > best ? x : best; });
        block_mass<Bytes, Screen>{&lanes}(block);
        if constexpr (Screen) {
          if (!fits) {
            for (std::size_t i = 0; i < tempered_block; ++i) {
              signs_passed = signs_passed && block[i] >= T(0);
            }
          }
        }
        return fits;
      },
      [](auto& x) SPECDEC_LAMBDA_INLINE { logarithm_lanes<true, true>(x); }, full,
      block_mass<Bytes, false>{nullptr});
  for (std::size_t k = 0; k < Bytes / sizeof(T); ++k) {
    maximum = best[k] > maximum ? best[k] : maximum;  // NaN passed over
  }
#else
  map_lanes<Bytes>(in, out, size, full);
#endif
  double total = 0.0;
  if constexpr (Screen) {
    for (std::size_t i = j; i < size; ++i) signs_passed = signs_passed && in[i] >= T(0);
    total = finish_mass(in + j, size - j, lanes);
  }
  for (; j < size; ++j) maximum = in[j] > maximum ? in[j] : maximum;
  return {maximum, total, signs_passed};
}

/// exp_lanes (base e) or exp2_lanes (base2) of (x - top) * scale: blocks of finite x whose
/// exponent lies in [floor + 1, 64] (screened on their order keys: x takes either sign)
/// without the clamp, flush and NaN selections. shifted_exp (logits) and exp2_shifted (the
/// log2 values of log2_with_max). With `Mass`, returns the written row's positive mass
/// (mass_lanes' order), else 0.
template <std::size_t Bytes, bool base2, bool Mass, class T, class U>
SPECDEC_KERNEL_INLINE double shifted_exp_lanes_body(const U* in, T* out, std::size_t size, T top,
                                                    T scale, plain_range<T> plain) noexcept {
  const auto full = [top, scale](auto& x) SPECDEC_LAMBDA_INLINE {
    x = (x - top) * scale;
    exponential_lanes<base2>(x);
  };
  mass_lanes lanes{};
#if SPECDEC_VECTOR_MATH_PACKS
  if constexpr (std::is_same_v<T, U>) {
    using word = typename float_bits<T>::uint;
    const bool any = plain.from <= plain.to;
    const word from = order_key(plain.from);
    const word room = any ? static_cast<word>(order_key(plain.to) - from) : word{0};
    const auto fits = [any, from, room](const T* block) SPECDEC_LAMBDA_INLINE {
      return any && block_in_key_range<Bytes>(block, from, room);
    };
    const auto plain_lanes = [top, scale](auto& x) SPECDEC_LAMBDA_INLINE {
      x = (x - top) * scale;
      exponential_lanes<base2, true>(x);
    };
    const std::size_t j = screened_blocks<Bytes>(in, out, size, fits, plain_lanes, full,
                                                 block_mass<Bytes, Mass>{&lanes});
    if constexpr (Mass) return finish_mass(out + j, size - j, lanes);
    return 0.0;
  }
#endif
  static_cast<void>(plain);
  map_lanes<Bytes>(in, out, size, full);
  if constexpr (Mass) return finish_mass(out, size, lanes);
  return 0.0;
}

template <std::size_t Bytes, bool Mass, class T>
SPECDEC_KERNEL_INLINE double exp2_shifted_body(const T* in, T* out, std::size_t size, T top,
                                               T scale, plain_range<T> plain) noexcept {
  return shifted_exp_lanes_body<Bytes, true, Mass>(in, out, size, top, scale, plain);
}

template <std::size_t Bytes, class T, class U>
SPECDEC_KERNEL_INLINE void shifted_exp_body(const U* in, T* out, std::size_t size, T top, T scale,
                                            plain_range<T> plain) noexcept {
  (void)shifted_exp_lanes_body<Bytes, false, false>(in, out, size, top, scale, plain);
}

#if SPECDEC_DISPATCH_AVX2
template <bool Mass, class T, class U>
SPECDEC_TARGET_AVX2 double tempered_weights_avx2(const U* in, T* out, std::size_t size, T log_top,
                                                 T scale, plain_range<T> plain) noexcept {
  return tempered_weights_body<32, Mass>(in, out, size, log_top, scale, plain);
}
template <bool Screen, class T>
SPECDEC_TARGET_AVX2 max_and_total<T> log2_with_max_avx2(const T* in, T* out,
                                                        std::size_t size) noexcept {
  return log2_with_max_body<32, Screen>(in, out, size);
}
template <bool Mass, class T>
SPECDEC_TARGET_AVX2 double exp2_shifted_avx2(const T* in, T* out, std::size_t size, T top, T scale,
                                             plain_range<T> plain) noexcept {
  return exp2_shifted_body<32, Mass>(in, out, size, top, scale, plain);
}
template <class T, class U>
SPECDEC_TARGET_AVX2 void shifted_exp_avx2(const U* in, T* out, std::size_t size, T top, T scale,
                                          plain_range<T> plain) noexcept {
  shifted_exp_body<32>(in, out, size, top, scale, plain);
}
#endif
#if SPECDEC_DISPATCH_AVX512
template <bool Mass, class T, class U>
SPECDEC_TARGET_AVX512 double tempered_weights_avx512(const U* in, T* out, std::size_t size,
                                                     T log_top, T scale,
                                                     plain_range<T> plain) noexcept {
  return tempered_weights_body<64, Mass>(in, out, size, log_top, scale, plain);
}
template <bool Screen, class T>
SPECDEC_TARGET_AVX512 max_and_total<T> log2_with_max_avx512(const T* in, T* out,
                                                            std::size_t size) noexcept {
  return log2_with_max_body<64, Screen>(in, out, size);
}
template <bool Mass, class T>
SPECDEC_TARGET_AVX512 double exp2_shifted_avx512(const T* in, T* out, std::size_t size, T top,
                                                 T scale, plain_range<T> plain) noexcept {
  return exp2_shifted_body<64, Mass>(in, out, size, top, scale, plain);
}
template <class T, class U>
SPECDEC_TARGET_AVX512 void shifted_exp_avx512(const U* in, T* out, std::size_t size, T top, T scale,
                                              plain_range<T> plain) noexcept {
  shifted_exp_body<64>(in, out, size, top, scale, plain);
}
#endif

// The portable builds: out of line like any inline function (not inlined at every
// dispatching call site, which would double the code the compiler optimizes).
template <bool Mass, class T, class U>
SPECDEC_PORTABLE_KERNEL inline double tempered_weights_portable(const U* in, T* out,
                                                                std::size_t size, T log_top,
                                                                T scale,
                                                                plain_range<T> plain) noexcept {
  return tempered_weights_body<16, Mass>(in, out, size, log_top, scale, plain);
}

template <bool Screen, class T>
SPECDEC_PORTABLE_KERNEL inline max_and_total<T> log2_with_max_portable(const T* in, T* out,
                                                                       std::size_t size) noexcept {
  return log2_with_max_body<16, Screen>(in, out, size);
}

template <bool Mass, class T>
SPECDEC_PORTABLE_KERNEL inline double exp2_shifted_portable(const T* in, T* out, std::size_t size,
                                                            T top, T scale,
                                                            plain_range<T> plain) noexcept {
  return exp2_shifted_body<16, Mass>(in, out, size, top, scale, plain);
}

template <class T, class U>
SPECDEC_PORTABLE_KERNEL inline void shifted_exp_portable(const U* in, T* out, std::size_t size,
                                                         T top, T scale,
                                                         plain_range<T> plain) noexcept {
  shifted_exp_body<16>(in, out, size, top, scale, plain);
}

/// The plain range of tempered_weights.
template <class T>
[[nodiscard]] inline plain_range<T> tempered_plain_range(T log_top, T scale) noexcept {
  // The plain range: x whose exponent (log2(x) - log2_top) * scale lies in [floor + 1, 64]
  // (exp2_lanes's floor; 2^64 p stays far from overflowing), from the smallest normal
  // number on. A whole unit of exponent spare at the bottom (and the top far above any
  // entry of a row whose maximum is top), so that neither the rounding of log2_lanes nor a
  // last-bit difference of std::exp2 between C libraries can put a screened lane outside.
  // The computed exponent is off by at most scale * eps * (4 |log2 x| + |log2_top|) (log2
  // within 3 ulp, the subtraction and product rounded; |log2 x| <= 128 for normal float
  // x, 1024 for double): no plain range where that could reach a quarter of the spare
  // unit (a very low temperature).
  const double top = static_cast<double>(log_top);
  const double inverse = 1.0 / static_cast<double>(scale);
  const double low =
      std::exp2(top + (static_cast<double>(float_bits<T>::exp2_floor) + 1.0) * inverse);
  const double high = std::exp2(top + 64.0 * inverse);
  constexpr double largest = static_cast<double>(std::numeric_limits<T>::max());
  constexpr double largest_log = sizeof(T) == 4 ? 128.0 : 1024.0;
  const double exponent_error = static_cast<double>(scale) *
                                static_cast<double>(std::numeric_limits<T>::epsilon()) *
                                (4.0 * largest_log + std::fabs(top));
  plain_range<T> plain{T(1), T(0)};  // none
  if (low <= largest && low == low && high == high && exponent_error <= 0.25) {
    plain.from = std::max(static_cast<T>(low), std::numeric_limits<T>::min());
    plain.to = static_cast<T>(std::min(high, largest));
  }
  return plain;
}

/// tempered_weights on the active kernel path, with the written row's mass (Mass) or not.
template <bool Mass, class T, class U>
double tempered_weights_path(const U* in, T* out, std::size_t size, T log_top, T scale) noexcept {
  const auto plain = tempered_plain_range(log_top, scale);
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) return tempered_weights_avx512<Mass>(in, out, size, log_top, scale, plain);
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2()) return tempered_weights_avx2<Mass>(in, out, size, log_top, scale, plain);
#endif
  return tempered_weights_portable<Mass>(in, out, size, log_top, scale, plain);
}

/// out[j] = tempered_weight(in[j], log2_top, scale) for j < size (`in` may be `out`).
template <class T, class U>
void tempered_weights(const U* in, T* out, std::size_t size, T log_top, T scale) noexcept {
  (void)tempered_weights_path<false>(in, out, size, log_top, scale);
}

/// tempered_weights, returning the positive mass of the written row (mass_lanes' order:
/// bitwise what nucleus_screened_band's total would be over it) from each block while it
/// is in L1: top-p's mass at T != 1 without a pass of its own.
template <class T, class U>
double tempered_weights_mass(const U* in, T* out, std::size_t size, T log_top, T scale) noexcept {
  return tempered_weights_path<true>(in, out, size, log_top, scale);
}

/// The plain range of (x - top) * scale fed to an exponential whose floor is `floor`
/// (exp_lanes's or exp2_lanes's): x whose exponent lies in [floor + 1, 64]. Only where
/// x - top cannot overflow (|top| and |from| under a quarter of the largest T), and where
/// rounding the bound to T moves the exponent by at most a quarter of the spare unit
/// (scale * |from| * eps); x - top and the product are rounded relative to the exponent
/// itself, far inside the unit. -inf and NaN never lie in it.
template <class T>
[[nodiscard]] inline plain_range<T> shifted_plain_range(T top, T scale, T floor) noexcept {
  const double t = static_cast<double>(top);
  const double inverse = 1.0 / static_cast<double>(scale);
  const double low = t + (static_cast<double>(floor) + 1.0) * inverse;
  const double high = t + 64.0 * inverse;
  constexpr double quarter = static_cast<double>(std::numeric_limits<T>::max()) / 4;
  const double bound_error = static_cast<double>(scale) * std::fabs(low) *
                             static_cast<double>(std::numeric_limits<T>::epsilon());
  if (!(std::fabs(t) <= quarter && low >= -quarter && low <= high && bound_error <= 0.25)) {
    return {T(1), T(0)};  // none
  }
  return {static_cast<T>(low), static_cast<T>(std::min(high, quarter))};
}

/// out[j] = exp_nonpositive((in[j] - top) * scale) for j < size (`in` may be `out`): the
/// tempered softmax numerators of logits whose maximum is top.
template <class T, class U>
void shifted_exp(const U* in, T* out, std::size_t size, T top, T scale) noexcept {
  // (A very low temperature on large logits has no plain range.)
  const auto plain = shifted_plain_range(top, scale, float_bits<T>::exp_floor);
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) return shifted_exp_avx512(in, out, size, top, scale, plain);
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2()) return shifted_exp_avx2(in, out, size, top, scale, plain);
#endif
  shifted_exp_portable(in, out, size, top, scale, plain);
}

/// log2_with_max_body on the active kernel path.
template <bool Screen, class T>
max_and_total<T> log2_with_max_path(const T* in, T* out, std::size_t size) noexcept {
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) return log2_with_max_avx512<Screen>(in, out, size);
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2()) return log2_with_max_avx2<Screen>(in, out, size);
#endif
  return log2_with_max_portable<Screen>(in, out, size);
}

/// out[j] = log2_positive(in[j]) for j < size (`in` and `out` apart: the largest entry is
/// read from `in` after the pass), and the largest entry as span_max finds it (NaN entries
/// passed over, -infinity when there is none), in one pass: the first half of
/// tempered_weights for a row whose maximum is not known yet.
/// exp2_shifted(out, out, size, log2_positive(maximum), scale) then writes bitwise
/// tempered_weights(in, out, size, log2_positive(maximum), scale).
template <class T>
T log2_with_max(const T* in, T* out, std::size_t size) noexcept {
  return log2_with_max_path<false>(in, out, size).maximum;
}

/// log2_with_max with the validation screen of the row in the same pass: its positive mass
/// (mass_lanes' order, within screen_sum_error of the exact sum) and whether every entry is
/// >= 0. The first pass of a validated row at T != 1.
template <class T>
max_and_total<T> log2_with_max_screen(const T* in, T* out, std::size_t size) noexcept {
  return log2_with_max_path<true>(in, out, size);
}

/// out[j] = exp2_nonpositive((in[j] - log2_top) * scale) for j < size (`in` may be `out`):
/// the second half of tempered_weights, from the log2 values log2_with_max wrote.
/// exp2_shifted on the active kernel path, with the written row's mass (Mass) or not.
template <bool Mass, class T>
double exp2_shifted_path(const T* in, T* out, std::size_t size, T log2_top, T scale) noexcept {
  // The log2 values are screened themselves, so the logarithm's own rounding does not enter.
  const auto plain = shifted_plain_range(log2_top, scale, float_bits<T>::exp2_floor);
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) return exp2_shifted_avx512<Mass>(in, out, size, log2_top, scale, plain);
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2()) return exp2_shifted_avx2<Mass>(in, out, size, log2_top, scale, plain);
#endif
  return exp2_shifted_portable<Mass>(in, out, size, log2_top, scale, plain);
}

template <class T>
void exp2_shifted(const T* in, T* out, std::size_t size, T log2_top, T scale) noexcept {
  (void)exp2_shifted_path<false>(in, out, size, log2_top, scale);
}

/// exp2_shifted, returning the written row's positive mass as tempered_weights_mass does.
template <class T>
double exp2_shifted_mass(const T* in, T* out, std::size_t size, T log2_top, T scale) noexcept {
  return exp2_shifted_path<true>(in, out, size, log2_top, scale);
}

SPECDEC_KERNELS_END

// The dispatchers' instances for float and double rows (specdec/kernel_instances.hpp).
#define SPECDEC_VECTOR_MATH_PAIR_INSTANCES(prefix, T, U)                                        \
  prefix template void tempered_weights<T, U>(const U*, T*, std::size_t, T, T) noexcept;        \
  prefix template double tempered_weights_mass<T, U>(const U*, T*, std::size_t, T, T) noexcept; \
  prefix template void shifted_exp<T, U>(const U*, T*, std::size_t, T, T) noexcept;
#define SPECDEC_VECTOR_MATH_ROW_INSTANCES(prefix, T)                                            \
  prefix template T log2_with_max<T>(const T*, T*, std::size_t) noexcept;                       \
  prefix template max_and_total<T> log2_with_max_screen<T>(const T*, T*, std::size_t) noexcept; \
  prefix template void exp2_shifted<T>(const T*, T*, std::size_t, T, T) noexcept;               \
  prefix template double exp2_shifted_mass<T>(const T*, T*, std::size_t, T, T) noexcept;
#define SPECDEC_VECTOR_MATH_INSTANCES(prefix)                            \
  SPECDEC_FOR_ROW_TYPE_PAIRS(SPECDEC_VECTOR_MATH_PAIR_INSTANCES, prefix) \
  SPECDEC_FOR_ROW_TYPES(SPECDEC_VECTOR_MATH_ROW_INSTANCES, prefix)
SPECDEC_DECLARE_KERNEL_INSTANCES(SPECDEC_VECTOR_MATH_INSTANCES)

}  // namespace specdec::detail

#if defined(__clang__)
#pragma clang diagnostic pop
#elif defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
