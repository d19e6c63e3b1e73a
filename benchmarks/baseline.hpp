// The physical-limit baseline of the row benchmarks (bm_verification, bm_decoder): a pure
// streaming read of exactly the rows an operation must touch, timed interleaved with the
// operation and the fair peer (peer.hpp) in the same loop, on the same statistic (the
// median of thread CPU time), with the rows either cache-resident or evicted to DRAM.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <span>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPECDEC_BASELINE_AVX2 1
#endif

namespace specdec::baseline {

#if defined(SPECDEC_BASELINE_AVX2)
__attribute__((target("avx2"))) inline std::uint32_t or_bits_avx2(const float* data,
                                                                  std::size_t n) noexcept {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = _mm256_or_si256(a, _mm256_castps_si256(_mm256_loadu_ps(data + i)));
    b = _mm256_or_si256(b, _mm256_castps_si256(_mm256_loadu_ps(data + i + 8)));
    c = _mm256_or_si256(c, _mm256_castps_si256(_mm256_loadu_ps(data + i + 16)));
    d = _mm256_or_si256(d, _mm256_castps_si256(_mm256_loadu_ps(data + i + 24)));
  }
  const __m256i all = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
  const __m128i half = _mm_or_si128(_mm256_castsi256_si128(all), _mm256_extracti128_si256(all, 1));
  std::uint32_t out = static_cast<std::uint32_t>(_mm_cvtsi128_si32(half)) |
                      static_cast<std::uint32_t>(_mm_extract_epi32(half, 1)) |
                      static_cast<std::uint32_t>(_mm_extract_epi32(half, 2)) |
                      static_cast<std::uint32_t>(_mm_extract_epi32(half, 3));
  for (; i < n; ++i) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, data + i, sizeof bits);
    out |= bits;
  }
  return out;
}
#endif

/// OR of the bits of `n` floats: every byte read once, no arithmetic dependency (256-bit
/// loads where the CPU has AVX2, else a 64-bit loop in eight accumulators).
[[nodiscard]] inline std::uint32_t or_bits(const float* data, std::size_t n) noexcept {
#if defined(SPECDEC_BASELINE_AVX2)
  static const bool avx2 = __builtin_cpu_supports("avx2") != 0;
  if (avx2) return or_bits_avx2(data, n);
#endif
  std::uint64_t lanes[8] = {};
  const std::size_t words = n / 2;
  const auto* bytes = reinterpret_cast<const unsigned char*>(data);
  std::size_t w = 0;
  for (; w + 8 <= words; w += 8) {
    for (std::size_t k = 0; k < 8; ++k) {
      std::uint64_t word = 0;
      std::memcpy(&word, bytes + 8 * (w + k), sizeof word);
      lanes[k] |= word;
    }
  }
  std::uint64_t all = 0;
  for (const std::uint64_t lane : lanes) all |= lane;
  for (std::size_t i = 2 * w; i < n; ++i) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, data + i, sizeof bits);
    all |= bits;
  }
  return static_cast<std::uint32_t>(all) | static_cast<std::uint32_t>(all >> 32U);
}

/// The pure read of several rows (spans of floats).
[[nodiscard]] inline std::uint32_t read_rows(
    std::span<const std::span<const float>> rows) noexcept {
  std::uint32_t out = 0;
  for (const auto row : rows) out |= or_bits(row.data(), row.size());
  return out;
}

/// CPU time of the calling thread: the time it actually ran, memory stalls included, but
/// not the time other processes held the core (wall time where the clock is missing).
[[nodiscard]] inline double thread_seconds() noexcept {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
#else
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
#endif
}

/// Median of `values` (mean of the middle two for an even count; 0 when empty).
[[nodiscard]] inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

/// Evicts the caches: streams (reads and writes) a buffer of twice the last-level cache
/// (64 MiB: this machine's L3 is 32 MiB) so that rows read afterwards come from DRAM.
class Evictor {
 public:
  Evictor() : buffer_(64U << 20U, 1) {}
  void evict() noexcept {
    for (std::size_t i = 0; i < buffer_.size(); i += 64)
      buffer_[i] = static_cast<unsigned char>(buffer_[i] + 1);
  }

 private:
  std::vector<unsigned char> buffer_;
};

[[nodiscard]] inline Evictor& evictor() {
  static Evictor instance;
  return instance;
}

/// Samples per rows-in-DRAM benchmark: SPECDEC_DRAM_SAMPLES, else 31.
[[nodiscard]] inline std::int64_t dram_samples() {
  const char* text = std::getenv("SPECDEC_DRAM_SAMPLES");
  const long value = text == nullptr ? 0 : std::strtol(text, nullptr, 10);
  return value > 0 ? static_cast<std::int64_t>(value) : 31;
}

/// Where the rows are when an operation starts.
enum class residence { cache, dram };

/// Seconds of thread CPU time per call of `operation`, one sample: `repetitions` calls in a
/// row with the rows in cache (after one untimed warm call), or one call after evicting.
template <class Operation>
double sample(residence where, std::size_t repetitions, Operation&& operation) {
  if (where == residence::dram) {
    evictor().evict();
    const double start = thread_seconds();
    operation();
    return thread_seconds() - start;
  }
  operation();
  const double start = thread_seconds();
  for (std::size_t r = 0; r < repetitions; ++r) operation();
  return (thread_seconds() - start) / static_cast<double>(repetitions);
}

/// Calls per cache-resident sample so that one sample lasts about 50 us (the clock costs
/// well under 1 us a read).
template <class Operation>
std::size_t calibrate(Operation&& operation) {
  operation();
  const double start = thread_seconds();
  operation();
  const double once = thread_seconds() - start;
  if (once <= 0.0) return 64;
  return std::clamp<std::size_t>(static_cast<std::size_t>(50e-6 / once), 1, 64);
}

/// Medians of an interleaved run, seconds per call (peer: 0 without a peer).
struct Medians {
  double step = 0.0;
  double read = 0.0;
  double peer = 0.0;
};

/// The benchmark loop of an operation timed against the pure read and the peer: every
/// iteration takes one sample (see `sample`) of `step`, of `read` and, if `with_peer`, of
/// `peer`, in an order that rotates each iteration, and reports the step's sample as the
/// iteration time (UseManualTime). Sets the counters step_us, vs_read (step / read) and
/// vs_peer (peer / step: above 1, specdec is faster) and labels the residence.
template <class Step, class Read, class Peer>
Medians interleave(benchmark::State& state, residence where, std::size_t repetitions, Step&& step,
                   Read&& read, Peer&& peer, bool with_peer = true) {
  std::vector<double> steps, reads, peers;
  std::size_t turn = 0;
  for (auto _ : state) {
    double step_seconds = 0.0;
    for (std::size_t k = 0; k < 3; ++k) {
      switch ((turn + k) % 3) {
        case 0:
          step_seconds = sample(where, repetitions, step);
          steps.push_back(step_seconds);
          break;
        case 1:
          reads.push_back(sample(where, repetitions, read));
          break;
        default:
          if (with_peer) peers.push_back(sample(where, repetitions, peer));
          break;
      }
    }
    ++turn;
    state.SetIterationTime(step_seconds);
  }
  const Medians medians{median(steps), median(reads), median(peers)};
  state.counters["step_us"] = 1e6 * medians.step;
  if (medians.step > 0.0 && medians.read > 0.0) {
    state.counters["vs_read"] = medians.step / medians.read;
    if (with_peer) state.counters["vs_peer"] = medians.peer / medians.step;
  }
  state.SetLabel(where == residence::cache ? "rows in cache" : "rows in DRAM");
  return medians;
}

}  // namespace specdec::baseline
