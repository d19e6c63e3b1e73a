// specdec — random numbers that give the same results under every standard library.
//
// Algorithms never use std::uniform_real_distribution or std::discrete_distribution:
// their output differs between libstdc++ and libc++, and the real distribution can return
// 1.0 for float. Instead we turn raw generator bits into U[0,1) ourselves, so a given seed
// gives identical tokens under GCC and Clang. Any std::uniform_random_bit_generator works;
// `xoshiro256pp` is the fast default.
#pragma once

#include <bit>
#include <concepts>
#include <cstdint>
#include <limits>
#include <random>

namespace specdec {

/// SplitMix64 (Steele, Lea, Flood 2014): used to expand one 64-bit seed into engine state.
class splitmix64 {
 public:
  using result_type = std::uint64_t;

  constexpr explicit splitmix64(std::uint64_t seed = 0) noexcept : state_(seed) {}

  static constexpr result_type min() noexcept { return 0; }
  static constexpr result_type max() noexcept { return std::numeric_limits<result_type>::max(); }

  constexpr result_type operator()() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30U)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27U)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31U);
  }

 private:
  std::uint64_t state_;
};

/// xoshiro256++ (Blackman, Vigna 2019): 256-bit state, period 2^256 - 1, a few cycles per
/// 64-bit output. Seeded from one 64-bit value through SplitMix64, as its authors advise.
class xoshiro256pp {
 public:
  using result_type = std::uint64_t;

  constexpr explicit xoshiro256pp(std::uint64_t seed = 0x5eed5eed5eed5eedULL) noexcept {
    this->seed(seed);
  }

  constexpr void seed(std::uint64_t seed) noexcept {
    splitmix64 expand(seed);
    for (auto& word : state_) word = expand();
  }

  /// An engine with the given state words (not all zero; stream_engine builds them).
  [[nodiscard]] static constexpr xoshiro256pp from_state(std::uint64_t s0, std::uint64_t s1,
                                                         std::uint64_t s2,
                                                         std::uint64_t s3) noexcept {
    xoshiro256pp engine;
    engine.state_[0] = s0;
    engine.state_[1] = s1;
    engine.state_[2] = s2;
    engine.state_[3] = s3;
    return engine;
  }

  static constexpr result_type min() noexcept { return 0; }
  static constexpr result_type max() noexcept { return std::numeric_limits<result_type>::max(); }

  constexpr result_type operator()() noexcept {
    const std::uint64_t result = std::rotl(state_[0] + state_[3], 23) + state_[0];
    const std::uint64_t shifted = state_[1] << 17U;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= shifted;
    state_[3] = std::rotl(state_[3], 45);
    return result;
  }

  /// Advances the engine by `count` outputs.
  constexpr void discard(unsigned long long count) noexcept {
    for (; count != 0; --count) (*this)();
  }

  friend constexpr bool operator==(const xoshiro256pp&, const xoshiro256pp&) = default;

 private:
  std::uint64_t state_[4]{};
};

/// The generator used when the caller gives only a seed.
using default_engine = xoshiro256pp;

/// Names one random stream of a served sequence: the request's seed, the sequence's id
/// (the engine's request id, not its position in a batch) and the step. Batch verification
/// draws a sequence's uniforms from stream_engine(key), so a sequence's tokens depend only
/// on its key and its own rows: never on the batch around it, its position there or the
/// number of threads. An engine that keeps (seed, sequence, step) for a request replays it
/// token for token after a restart.
struct StreamKey {
  std::uint64_t seed = 0;
  std::uint64_t sequence = 0;
  std::uint64_t step = 0;

  friend constexpr bool operator==(const StreamKey&, const StreamKey&) = default;
};

/// Which of a step's streams: verification's uniforms, or the draft tokens an engine samples
/// before it (so that drafting and verifying never share numbers).
enum class stream_purpose : std::uint64_t { verify = 0, draft = 1 };

/// The generator of one stream: an xoshiro256pp whose 256-bit state is the SplitMix64
/// finaliser (a bijection of 64-bit words) of each part of the key, then of the purpose
/// mixed with all of them. Distinct keys or purposes give distinct states; the state is
/// never all zero. A pure
/// function of its arguments: no shared counter, no dependence on call order.
[[nodiscard]] constexpr xoshiro256pp stream_engine(
    const StreamKey& key, stream_purpose purpose = stream_purpose::verify) noexcept {
  const auto finalise = [](std::uint64_t z) {
    z = (z ^ (z >> 30U)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27U)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31U);
  };
  const auto tag = static_cast<std::uint64_t>(purpose);
  std::uint64_t state[4] = {
      finalise(key.seed + 0x9e3779b97f4a7c15ULL),
      finalise(key.sequence + 0x3c6ef372fe94f82aULL),
      finalise(key.step + 0xdaa66d2c7ddf743fULL),
      finalise(tag ^ finalise(key.seed ^ finalise(key.sequence ^ finalise(key.step)))),
  };
  if ((state[0] | state[1] | state[2] | state[3]) == 0) state[0] = 1;
  return xoshiro256pp::from_state(state[0], state[1], state[2], state[3]);
}

/// 64 uniformly random bits from any uniform_random_bit_generator. Engines with a full
/// 64-bit or 32-bit range are used directly; others (e.g. std::minstd_rand) are combined
/// from their largest power-of-two sub-range by rejection, so every bit is unbiased.
template <std::uniform_random_bit_generator G>
[[nodiscard]] constexpr std::uint64_t random_bits64(G& g) {
  using result_t = typename G::result_type;
  constexpr auto lo = static_cast<std::uint64_t>(G::min());
  constexpr auto hi = static_cast<std::uint64_t>(G::max());
  if constexpr (lo == 0 && hi == std::numeric_limits<std::uint64_t>::max()) {
    return static_cast<std::uint64_t>(g());
  } else if constexpr (lo == 0 && hi == std::numeric_limits<std::uint32_t>::max()) {
    const auto high = static_cast<std::uint64_t>(g());
    return (high << 32U) | static_cast<std::uint64_t>(g());
  } else {
    static_assert(hi > lo, "a generator must produce at least two values");
    constexpr std::uint64_t range = hi - lo;             // number of values minus one
    constexpr int bits = std::bit_width(range + 1) - 1;  // largest 2^bits <= range + 1
    constexpr std::uint64_t limit = std::uint64_t{1} << bits;
    std::uint64_t out = 0;
    int have = 0;
    while (have < 64) {
      const std::uint64_t value = static_cast<std::uint64_t>(static_cast<result_t>(g())) - lo;
      if (value >= limit) continue;  // reject the values above the power of two
      out = (bits >= 64) ? value : ((out << bits) | value);
      have += bits;
    }
    return out;
  }
}

/// A uniform draw from [0, 1) of type T (float: 24 random bits, double: 53), never 1.0.
/// Identical for a given generator state under every compiler and standard library.
template <std::floating_point T, std::uniform_random_bit_generator G>
[[nodiscard]] constexpr T uniform01(G& g) {
  const std::uint64_t bits = random_bits64(g);
  if constexpr (std::numeric_limits<T>::digits <= 24) {
    return static_cast<T>(static_cast<float>(bits >> 40U) * 0x1.0p-24F);
  } else {
    return static_cast<T>(static_cast<double>(bits >> 11U) * 0x1.0p-53);
  }
}

/// A uniform integer in [0, n) (Lemire's multiply-and-reject method; unbiased).
/// Precondition: n > 0.
template <std::uniform_random_bit_generator G>
[[nodiscard]] constexpr std::uint64_t uniform_below(G& g, std::uint64_t n) {
#if defined(__SIZEOF_INT128__)
  __extension__ using wide = unsigned __int128;
  wide product = static_cast<wide>(random_bits64(g)) * n;
  auto low = static_cast<std::uint64_t>(product);
  if (low < n) {
    const std::uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      product = static_cast<wide>(random_bits64(g)) * n;
      low = static_cast<std::uint64_t>(product);
    }
  }
  return static_cast<std::uint64_t>(product >> 64U);
#else
  const std::uint64_t threshold = (0 - n) % n;
  std::uint64_t bits = random_bits64(g);
  while (bits < threshold) bits = random_bits64(g);
  return bits % n;
#endif
}

static_assert(std::uniform_random_bit_generator<xoshiro256pp>);
static_assert(std::uniform_random_bit_generator<splitmix64>);

}  // namespace specdec
