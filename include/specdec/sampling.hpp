// specdec — standardized sampling (paper Sec. 2.2): temperature, top-k, top-p (nucleus),
// min-p and greedy as ONE transform of a probability row, applied identically to the
// target's p rows and the draft's q rows.
//
// Speculative sampling reproduces exactly the distribution of the target rows it verifies
// against. Sampling settings are therefore not a property of the decoder's draw but a
// transform of the rows: SpeculativeDecoder applies the same Standardizer to p and to q,
// so the output follows standardize(p) while the drafts come from standardize(q).
//
// The transform, in this order (each step on the result of the previous one):
//  1. temperature T: w(x) = p(x)^(1/T) (== softmax(logits / T) for logits; computed as
//     exp((log p(x) - log max p) / T), so it never overflows, with specdec's own vectorized
//     log and exp: detail/vector_math.hpp, bitwise the same under every compiler, C library
//     and kernel path). T = 1 leaves the row as is.
//     T = 0 means greedy: the result is one-hot at the argmax, the lowest id among ties,
//     and SpeculativeDecoder then verifies by exact match. As T -> 0 (T > 0) the result
//     approaches the uniform distribution over the tokens tied at the maximum (the one-hot
//     argmax when the maximum is unique). Zero entries stay zero for every T.
//  2. top-k (k > 0): keep the k most probable tokens. Ties are broken by token id, lower
//     id first, so exactly min(k, #non-zero) tokens survive. k = 0 or k >= V: no-op.
//     Ranks come from the input probabilities (or logits), which temperature does not
//     reorder, so rounding in the tempered weights never changes which tokens survive.
//  3. top-p (nucleus, p < 1): keep the smallest set of most probable tokens whose mass
//     reaches p times the mass surviving step 2 (the set is a prefix of the order "higher
//     probability first, lower id first"; masses are accumulated in double). p = 1: no-op
//     (even tokens of zero probability stay, trivially).
//  4. min-p (m > 0): keep tokens whose weight is >= m times the largest weight. The
//     largest token always survives every step.
//  5. renormalize to sum 1.
// Because steps 2-4 keep a prefix of one order, min-p commutes with top-k and top-p;
// top-p after top-k measures mass within the top k (as in most inference engines).
//
// Models that produce logits or log-probabilities plug in through `LogitsModel`, which
// turns them into probabilities with a numerically stable softmax; temperature on logits
// and the power transform on probabilities agree (tested).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/detail/vector_math.hpp"
#include "specdec/error.hpp"
#include "specdec/rows.hpp"

namespace specdec {

/// The standardization of paper Sec. 2.2. Defaults are plain sampling (identity).
/// Ranges (checked by `validate()`, which SpeculativeDecoder and Standardizer call):
/// `temperature` finite and >= 0 (0 = greedy); `top_p` in (0, 1]; `min_p` in [0, 1].
struct SamplingOptions {
  double temperature = 1.0;  ///< T; 0 selects greedy decoding (exact-match verification)
  std::size_t top_k = 0;     ///< keep the k most probable tokens; 0 = no top-k
  double top_p = 1.0;        ///< nucleus mass; 1 = no top-p
  double min_p = 0.0;        ///< keep tokens >= min_p * max probability; 0 = no min-p

  /// Whether T == 0 (greedy; truncation settings do not matter then).
  [[nodiscard]] constexpr bool greedy() const noexcept { return temperature == 0.0; }

  /// Whether the transform leaves every valid row unchanged (T = 1, no truncation). Rows
  /// are then used as the models return them, without a copy.
  [[nodiscard]] constexpr bool identity() const noexcept {
    return temperature == 1.0 && top_k == 0 && top_p == 1.0 && min_p == 0.0;
  }

  /// Whether rows of `vocab_size` entries are truncated by top-k (0 < top_k < vocab_size) at
  /// T > 0, so that at most top_k tokens survive (Standardizer::apply_sparse applies).
  [[nodiscard]] constexpr bool sparse_for(std::size_t vocab_size) const noexcept {
    return !greedy() && top_k != 0 && top_k < vocab_size;
  }

  /// Throws specdec::error (errc::invalid_option) naming the first option out of range.
  void validate() const {
    if (!(temperature >= 0.0 && temperature <= std::numeric_limits<double>::max())) {
      detail::throw_error(errc::invalid_option, "sampling option temperature = ", temperature,
                          " must be finite and >= 0 (0 = greedy)");
    }
    if (!(top_p > 0.0 && top_p <= 1.0)) {
      detail::throw_error(errc::invalid_option, "sampling option top_p = ", top_p,
                          " must be in (0, 1]");
    }
    if (!(min_p >= 0.0 && min_p <= 1.0)) {
      detail::throw_error(errc::invalid_option, "sampling option min_p = ", min_p,
                          " must be in [0, 1]");
    }
  }

  friend constexpr bool operator==(const SamplingOptions&, const SamplingOptions&) = default;
};

/// Applies one SamplingOptions to rows, reusing its scratch buffers: after the first row
/// of a given size (or `reserve`), standardizing never allocates.
///
/// Input rows need finite, non-negative entries with a positive sum (they need not sum to
/// 1 exactly); a row without a positive entry is copied through unchanged (the decoder
/// validates rows before standardizing). `out` has the input's size and must not overlap
/// it.
///
/// Cost per row of V entries: T = 1 without truncation: ~4 streaming passes. T != 1: one
/// vectorized log and exp per entry (dispatched to AVX2 where the CPU has it), except that with
/// top-k they are computed for the k survivors only (the order is taken from the input, which
/// temperature does not change). Top-k: one pass with a heap for k <= V/16, else nth_element;
/// apply_sparse (top-k rows kept as their survivors, as the decoder keeps them): one vectorized
/// pass of block maxima, then only the blocks that can hold the top k are read again. Top-p on
/// rows of at least 4096 probabilities: one pass for the row's mass, a sample of about 2048
/// evenly spaced entries that places the end of the nucleus in a band, one pass summing the
/// keys above the band and listing the band (both sums in double lanes), a histogram and a
/// selection within the band only, then one pass writing the kept weights normalised by the
/// nucleus mass. At T = 1 the sample comes first (placing the band as for a row of mass 1),
/// so that the row's maximum, mass and screen are taken in the band's pass: two passes in
/// all. Where a band misses the end (most often a row where a few heavy tokens the sample
/// did not hold carry much of the mass, the common shape of a language model's row), the
/// entries of the top buckets the sample barely holds are listed in one pass and a second
/// band is placed with their exact masses (nucleus_retries() counts the rows it placed);
/// at T = 1 where that misses too (a row whose mass is far from 1), the search runs again
/// knowing the mass. nucleus_fallbacks() counts the rows where every band missed the end
/// and the full histogram ran instead. Shorter rows and
/// logits: one histogram pass over the binary exponents of the weights (it also writes each
/// entry's bucket, 2 bytes), a selection among the tokens of the bucket where the nucleus
/// ends (expected linear time), then the same writing pass. At T = 1 the weights are read from the
/// input itself (no copy first).
template <ProbabilityScalar T>
class Standardizer {
 public:
  using value_type = T;

  /// Throws specdec::error (errc::invalid_option) for options out of range.
  explicit Standardizer(const SamplingOptions& options = {}) : options_(options) {
    options_.validate();
  }

  [[nodiscard]] const SamplingOptions& options() const noexcept { return options_; }

  /// Replaces the options and keeps the scratch buffers (a worker standardizing rows of
  /// sequences with different options allocates nothing once its buffers have grown).
  /// Throws specdec::error (errc::invalid_option) for options out of range, leaving the
  /// current ones in place.
  void set_options(const SamplingOptions& options) {
    options.validate();
    options_ = options;
  }
  [[nodiscard]] bool identity() const noexcept { return options_.identity(); }
  [[nodiscard]] bool greedy() const noexcept { return options_.greedy(); }

  /// Allocates the scratch space for rows of `vocab_size` entries now.
  void reserve(std::size_t vocab_size) {
    if (options_.top_k != 0 || options_.top_p < 1.0) index_.reserve(vocab_size);
    if (options_.top_p < 1.0) {
      histogram_.reserve(2 * detail::nucleus_histogram_size);
      codes_.reserve(vocab_size);
      if (vocab_size >= nucleus_sampled_from) {
        band_.reserve(vocab_size + detail::nucleus_band_slack);
        band_weight_.reserve(vocab_size);
        sample_.reserve(nucleus_sample);  // the weight of each sampled entry
        run_mass_.reserve(nucleus_sample);
        run_left_.reserve(nucleus_sample);
        exact_.reserve(detail::nucleus_buckets);
        sample_head_.reserve(detail::nucleus_buckets + 1);
        sample_next_.reserve(nucleus_sample);
      }
    }
    if (sparse_for(vocab_size)) {
      const std::size_t blocks = (vocab_size + select_block - 1) / select_block;
      block_max_.reserve(blocks);
      block_order_.reserve(blocks);
      block_ids_.reserve(blocks);
    }
  }

  /// Diagnostics: how many rows' top-p nucleus the sample did not place, so that the full
  /// histogram found it (long rows of probabilities; see find_nucleus_sampled). A few in a
  /// thousand on language-model rows; each costs a few more passes over its row.
  [[nodiscard]] std::size_t nucleus_fallbacks() const noexcept { return nucleus_fallbacks_; }
  /// Rows whose first band missed the end of the nucleus and whose second band, placed with
  /// the entries of the top buckets listed exactly (those holding fewer than 4 sampled
  /// entries: a row's heavy tokens, the common shape of a language model's row), held it.
  [[nodiscard]] std::size_t nucleus_retries() const noexcept { return nucleus_retries_; }

  /// Whether apply() screens rows of `size` entries of U in its first pass, so that a
  /// caller validating the rows can take the screen from apply instead of a pass of its own:
  /// the pass that takes the row's maximum takes its sum and signs too. That is top-p alone
  /// at T = 1 on rows of at least 4096 probabilities (the pass places the nucleus's band as
  /// well), and every row at T != 1 (the maximum the tempered weights are scaled by), when
  /// apply is given a screen to fill.
  template <ProbabilityScalar U>
  [[nodiscard]] bool screens_first_pass(std::size_t size) const noexcept {
    if (!std::is_same_v<U, T> || options_.greedy()) return false;
    if (options_.temperature != 1.0) return true;
    return options_.top_p < 1.0 && options_.min_p == 0.0 &&
           (options_.top_k == 0 || options_.top_k >= size) && size >= nucleus_sampled_from;
  }

  /// Writes the standardized `probabilities` into `out` (same size, not overlapping) and
  /// returns the largest standardized probability. With `screen` and
  /// screens_first_pass(size), also fills *screen (whether every entry is >= 0, and the
  /// row's sum then); apply is safe on any row, so a caller may validate after it.
  /// With `deferred`, when apply's last pass would only write the nucleus of top-p alone at
  /// T = 1 (reading the keys, writing `out`), it leaves that pass to the caller instead:
  /// deferred->out is then set (else null), and `out` holds the row only once the hook has
  /// run over every entry, in blocks (a build_mass_table hook: the draft stage's draw
  /// writes the row as it sums it). At T != 1 the weights are already in `out` and the
  /// pass rewrites them in place: fusing it into the draw measured slower in the step.
  template <ProbabilityScalar U>
  double apply(std::span<const U> probabilities, std::span<T> out,
               detail::first_pass_screen* screen = nullptr,
               detail::nucleus_keep_hook<U, T>* deferred = nullptr) {
    if (deferred != nullptr) deferred->out = nullptr;
    SPECDEC_ASSERT(out.size() == probabilities.size());
    const std::size_t size = probabilities.size();
    if (size == 0) return 0.0;
    if (options_.greedy()) return one_hot_argmax(probabilities, out);
    // The first pass takes the row's maximum. With a screen to fill at T != 1 it takes the
    // row's mass and signs too; top-p alone at T = 1 on a long row takes the maximum, the
    // mass and the nucleus's band in one pass (nucleus_first_pass), then one pass writes
    // the nucleus.
    double known_total = std::numeric_limits<double>::quiet_NaN();
    U maximum;
    bool logs_written = false;  // out holds log2 of every entry (T != 1)
    if constexpr (std::is_same_v<U, T>) {
      // The fused first passes find the maximum as span_max does (NaN entries passed over,
      // -infinity when there is none); a row of only NaN and -infinity then takes
      // max_entry, which reports the NaN.
      const auto with_nan_rule = [probabilities, size](U found) {
        return found == -std::numeric_limits<U>::infinity()
                   ? detail::max_entry(probabilities.data(), size)
                   : found;
      };
      const bool every_weight = options_.top_k == 0 || options_.top_k >= size;
      if (options_.temperature != 1.0 && every_weight) {
        // Every tempered weight will be written: the pass that takes the maximum (and the
        // caller's validation screen, the row's mass and signs: screens_first_pass holds at
        // T != 1) writes the entries' log2 into `out` (the first half of each weight;
        // exp2_shifted does the rest in place), so that no pass reads the row for its
        // maximum alone.
        if (screen != nullptr) {
          const auto first = detail::log2_with_max_screen(probabilities.data(), out.data(), size);
          maximum = with_nan_rule(first.maximum);
          *screen = {first.signs_passed, first.total};
        } else {
          maximum = with_nan_rule(detail::log2_with_max(probabilities.data(), out.data(), size));
        }
        logs_written = true;
      } else if (options_.temperature != 1.0 && screen != nullptr && screens_first_pass<U>(size)) {
        // Top-k rows: the maximum with the row's mass and signs.
        const auto first = detail::nucleus_max_total(probabilities.data(), size);
        maximum = with_nan_rule(first.maximum);
        *screen = {first.signs_passed, first.total};
      } else if (options_.temperature == 1.0 && screens_first_pass<U>(size)) {
        const auto first = nucleus_first_pass(probabilities);
        maximum = with_nan_rule(first.screen.maximum);
        known_total = first.screen.total;
        if (screen != nullptr) *screen = {first.screen.signs_passed, first.screen.total};
        if (first.found) {  // a positive mass: the maximum and the kept mass are positive
          keep_nucleus(probabilities.data(), probabilities.data(), out.data(), size,
                       first.kept.last_key, first.kept.last, static_cast<T>(1.0 / first.kept.mass),
                       deferred);
          return static_cast<double>(maximum) / first.kept.mass;
        }
      } else {
        maximum = detail::max_entry(probabilities.data(), size);
      }
    } else {
      maximum = detail::max_entry(probabilities.data(), size);
    }
    if (!(maximum > U(0))) {
      std::transform(probabilities.begin(), probabilities.end(), out.begin(),
                     [](U value) { return static_cast<T>(value); });
      return 0.0;
    }
    const double temperature = options_.temperature;
    const bool use_min_p = options_.min_p > 0.0;
    if (options_.identity()) {
      // Only the normalization: one pass for the sum, one scaled copy.
      const double total = detail::sum_in_double(probabilities.data(), size);
      map(out) = cmap(probabilities).template cast<T>() * static_cast<T>(1.0 / total);
      return static_cast<double>(maximum) / total;
    }
    if (temperature == 1.0) {
      const auto min_key = static_cast<U>(options_.min_p * static_cast<double>(maximum));
      // The keys are the weights when no conversion is needed: top-p reads them in place.
      const T* key_weights = nullptr;
      if constexpr (std::is_same_v<U, T>) key_weights = probabilities.data();
      return finish(
          probabilities, out, U(0), maximum, min_key, use_min_p, static_cast<T>(maximum),
          [probabilities](std::size_t j) { return static_cast<T>(probabilities[j]); },
          [probabilities](std::span<T> all) {
            std::transform(probabilities.begin(), probabilities.end(), all.begin(),
                           [](U value) { return static_cast<T>(value); });
          },
          key_weights, known_total, deferred);
    }
    const double inverse_temperature = 1.0 / temperature;
    if (!(inverse_temperature <= static_cast<double>(std::numeric_limits<T>::max()))) {
      return uniform_over_maxima(probabilities, out, maximum, U(0));
    }
    // p^(1/T) = exp(log(p / max) / T): the maximum maps to exactly 1, nothing overflows.
    // Tempered w >= min_p * 1  <=>  p >= max * min_p^T.
    const auto min_key =
        static_cast<U>(static_cast<double>(maximum) * std::pow(options_.min_p, temperature));
    // 1/T can round to 0 in T (float, T > ~7e44); a zero scale would turn log(0) = -inf
    // into NaN. The smallest positive scale gives the same limit (uniform over the support).
    const T scale =
        std::max(static_cast<T>(inverse_temperature), std::numeric_limits<T>::denorm_min());
    const T log_top = detail::log2_positive(static_cast<T>(maximum));
    T* const logs = logs_written ? out.data() : nullptr;
    return finish(
        probabilities, out, U(0), maximum, min_key, use_min_p, T(1),
        [probabilities, log_top, scale](std::size_t j) {
          return detail::tempered_weight(static_cast<T>(probabilities[j]), log_top, scale);
        },
        [probabilities, log_top, scale, logs](std::span<T> all, bool mass) {
          if (logs != nullptr) {  // the log2 values the first pass wrote into `out` (= all)
            SPECDEC_ASSERT(all.data() == logs);
            if (mass)
              return detail::exp2_shifted_mass(logs, all.data(), all.size(), log_top, scale);
            detail::exp2_shifted(logs, all.data(), all.size(), log_top, scale);
          } else {
            const U* const in = probabilities.data();
            if (mass)
              return detail::tempered_weights_mass(in, all.data(), all.size(), log_top, scale);
            detail::tempered_weights(in, all.data(), all.size(), log_top, scale);
          }
          return std::numeric_limits<double>::quiet_NaN();
        });
  }

  /// Whether apply_sparse applies to rows of `vocab_size` entries: truncation by top-k
  /// (0 < top_k < vocab_size) at T > 0, so that at most top_k tokens survive.
  [[nodiscard]] bool sparse_for(std::size_t vocab_size) const noexcept {
    return options_.sparse_for(vocab_size);
  }

  /// apply() for rows truncated by top-k (sparse_for(size) must hold), without writing the
  /// row: writes the surviving tokens in increasing id order to `ids` and their standardized
  /// probabilities to `weights` (room for top_k each) and returns their count. They are
  /// exactly the non-zero entries apply() writes, bitwise. `scratch` has the row's size; it
  /// is written and read at the candidates' positions only (no pass over it). A row without
  /// a positive entry has no survivor (0). Sets `top_probability` as apply() returns it.
  template <ProbabilityScalar U>
  std::size_t apply_sparse(std::span<const U> probabilities, std::span<T> scratch,
                           std::uint32_t* ids, T* weights, double& top_probability,
                           detail::row_screen<U>* screen = nullptr) {
    SPECDEC_ASSERT(sparse_for(probabilities.size()));
    SPECDEC_ASSERT(scratch.size() == probabilities.size());
    top_probability = 0.0;
    // The row's only full pass; `screen` (validation) rides on it. Whatever the row holds,
    // the selection below stays in range (NaN keys never become candidates).
    const U maximum = block_maxima(probabilities, screen);
    if (!(maximum > U(0))) return 0;
    const double temperature = options_.temperature;
    const bool use_min_p = options_.min_p > 0.0;
    const sparse_output out{scratch, ids, weights, &top_probability};
    if (temperature == 1.0) {
      const auto min_key = static_cast<U>(options_.min_p * static_cast<double>(maximum));
      return finish_sparse(
          probabilities, out, U(0), min_key, use_min_p, static_cast<T>(maximum),
          [probabilities](std::size_t j) { return static_cast<T>(probabilities[j]); });
    }
    const double inverse_temperature = 1.0 / temperature;
    if (!(inverse_temperature <= static_cast<double>(std::numeric_limits<T>::max()))) {
      return finish_sparse(probabilities, out, U(0), maximum, false, T(1),
                           [probabilities, maximum](std::size_t j) {
                             return probabilities[j] == maximum ? T(1) : T(0);
                           });
    }
    const auto min_key =
        static_cast<U>(static_cast<double>(maximum) * std::pow(options_.min_p, temperature));
    const T scale =
        std::max(static_cast<T>(inverse_temperature), std::numeric_limits<T>::denorm_min());
    const T log_top = detail::log2_positive(static_cast<T>(maximum));
    return finish_sparse(probabilities, out, U(0), min_key, use_min_p, T(1),
                         [probabilities, log_top, scale](std::size_t j) {
                           return detail::tempered_weight(static_cast<T>(probabilities[j]), log_top,
                                                          scale);
                         });
  }

  /// Writes standardize(softmax(logits)) into `out` (same size, not overlapping): logits
  /// (or log-probabilities; any additive constant cancels) with -inf for impossible
  /// tokens, computed stably as exp((logit - max logit) / T). Returns the largest
  /// standardized probability. All entries -inf gives a zero row; a NaN or +inf logit
  /// gives NaN entries.
  template <ProbabilityScalar U>
  double apply_logits(std::span<const U> logits, std::span<T> out) {
    SPECDEC_ASSERT(out.size() == logits.size());
    const std::size_t size = logits.size();
    if (size == 0) return 0.0;
    if (options_.greedy()) return one_hot_argmax(logits, out);
    const U maximum = detail::max_entry(logits.data(), size);
    constexpr U impossible = -std::numeric_limits<U>::infinity();
    if (maximum == impossible) {
      std::fill(out.begin(), out.end(), T(0));
      return 0.0;
    }
    if (!(maximum < std::numeric_limits<U>::infinity())) {  // +inf or NaN: NaN row
      std::fill(out.begin(), out.end(), std::numeric_limits<T>::quiet_NaN());
      return 0.0;
    }
    const double temperature = options_.temperature;
    const double inverse_temperature = 1.0 / temperature;
    if (!(inverse_temperature <= static_cast<double>(std::numeric_limits<T>::max()))) {
      return uniform_over_maxima(logits, out, maximum, impossible);
    }
    // Tempered w >= min_p  <=>  logit >= max + T log(min_p).
    const bool use_min_p = options_.min_p > 0.0;
    const auto min_key =
        use_min_p
            ? static_cast<U>(static_cast<double>(maximum) + temperature * std::log(options_.min_p))
            : impossible;
    // 1/T can round to 0 in T (float, T > ~7e44); a zero scale would turn log(0) = -inf
    // into NaN. The smallest positive scale gives the same limit (uniform over the support).
    const T scale =
        std::max(static_cast<T>(inverse_temperature), std::numeric_limits<T>::denorm_min());
    const auto top = static_cast<T>(maximum);
    return finish(
        logits, out, impossible, maximum, min_key, use_min_p, T(1),
        [logits, top, scale](std::size_t j) {
          return detail::exp_nonpositive((static_cast<T>(logits[j]) - top) * scale);
        },
        [logits, top, scale](std::span<T> all) {
          detail::shifted_exp(logits.data(), all.data(), all.size(), top, scale);
        });
  }

 private:
  using array_map = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
  using index_iterator = std::vector<std::uint32_t>::iterator;

  [[nodiscard]] static array_map map(std::span<T> row) noexcept {
    return array_map(row.data(), static_cast<Eigen::Index>(row.size()));
  }
  template <class U>
  [[nodiscard]] static auto cmap(std::span<const U> row) noexcept {
    return Eigen::Map<const Eigen::Array<U, Eigen::Dynamic, 1>>(
        row.data(), static_cast<Eigen::Index>(row.size()));
  }

  template <class U>
  static double one_hot_argmax(std::span<const U> in, std::span<T> out) noexcept {
    const std::size_t best = detail::first_argmax(in.data(), in.size());
    std::fill(out.begin(), out.end(), T(0));
    out[best] = T(1);
    return 1.0;
  }

  // The T -> 0 limit when 1/T is not representable: weight 1 for the maximal entries.
  template <class U>
  double uniform_over_maxima(std::span<const U> key, std::span<T> out, U maximum, U floor) {
    return finish(
        key, out, floor, maximum, maximum, false, T(1),
        [key, maximum](std::size_t j) { return key[j] == maximum ? T(1) : T(0); },
        [key, maximum](std::span<T> all) {
          std::transform(key.begin(), key.end(), all.begin(),
                         [maximum](U value) { return value == maximum ? T(1) : T(0); });
        });
  }

  // Steps 2-5 (file comment). `key` ranks the tokens (probabilities or logits; higher
  // first, lower id first among equal keys; temperature keeps this order) and tokens with
  // key <= floor are impossible. weight_of(j) is the tempered weight of token j, fill_all
  // writes every weight (fill_all(out), or fill_all(out, mass) where the pass can take the
  // written weights' mass too: it returns it when `mass` asks, in the order of
  // detail::tempered_weights_mass); top_weight is the weight of the top token. min-p keeps
  // key >= min_key.
  template <class U, class WeightOf, class FillAll>
  double finish(std::span<const U> key, std::span<T> out, U floor, U top_key, U min_key,
                bool use_min_p, T top_weight, WeightOf weight_of, FillAll fill_all,
                const T* key_weights = nullptr,
                double known_total = std::numeric_limits<double>::quiet_NaN(),
                detail::nucleus_keep_hook<U, T>* deferred = nullptr) {
    const std::size_t size = key.size();
    const auto fill = [&fill_all, out](bool mass) -> double {
      if constexpr (std::is_invocable_v<FillAll&, std::span<T>, bool>) {
        return fill_all(out, mass);
      } else {
        fill_all(out);
        return std::numeric_limits<double>::quiet_NaN();
      }
    };
    const std::size_t k = options_.top_k;
    if (k != 0 && k < size) {
      // Top-k from the keys, weights only for the survivors (in increasing id order, so that
      // every sum below has one order whichever selection found them: apply_sparse matches).
      select_top_k(key, floor, k);
      std::sort(index_.begin(), index_.end());
      std::fill(out.begin(), out.end(), T(0));
      for (const std::uint32_t j : index_) out[j] = weight_of(j);
      auto kept = index_.end();
      if (options_.top_p < 1.0) {
        double mass = 0.0;
        for (const std::uint32_t j : index_) mass += static_cast<double>(out[j]);
        kept = nucleus_end(key, out, index_.begin(), index_.end(), options_.top_p * mass).first;
        for (auto it = kept; it != index_.end(); ++it) out[*it] = T(0);
      }
      double total = 0.0;
      for (auto it = index_.begin(); it != kept; ++it) {
        if (use_min_p && key[*it] < min_key) out[*it] = T(0);
        total += static_cast<double>(out[*it]);
      }
      if (!(total > 0.0)) return 0.0;
      const auto scale = static_cast<T>(1.0 / total);
      for (auto it = index_.begin(); it != kept; ++it) out[*it] *= scale;
      return static_cast<double>(top_weight) / total;
    }
    if (options_.top_p < 1.0 && !use_min_p) {
      // Top-p alone: the nucleus from the weights (the keys themselves at T = 1, else
      // written into `out` first, with their mass where the pass takes it), then one pass
      // writing the kept weights normalised by the nucleus mass.
      const T* weights = key_weights;
      if (weights == nullptr) {
        const double mass = fill(true);
        if (mass == mass) known_total = mass;
        weights = out.data();
      }
      const auto kept = find_nucleus(key, std::span<const T>(weights, size), floor, top_key,
                                     top_weight, known_total);
      if (!(kept.mass > 0.0)) {
        std::fill(out.begin(), out.end(), T(0));
        return 0.0;
      }
      keep_nucleus(key.data(), weights, out.data(), size, kept.last_key, kept.last,
                   static_cast<T>(1.0 / kept.mass), deferred);
      return static_cast<double>(top_weight) / kept.mass;
    }
    (void)fill(false);
    if (options_.top_p < 1.0) {
      const auto kept = find_nucleus(key, std::span<const T>(out), floor, top_key, top_weight);
      detail::nucleus_keep(key.data(), out.data(), out.data(), size, kept.last_key, kept.last,
                           T(1));
    }
    if (use_min_p) {
      for (std::size_t j = 0; j < size; ++j) out[j] = key[j] >= min_key ? out[j] : T(0);
    }
    const double total = detail::sum_in_double(out.data(), size);
    if (!(total > 0.0)) return 0.0;
    map(out) *= static_cast<T>(1.0 / total);
    return static_cast<double>(top_weight) / total;
  }

  // nucleus_keep, or with `deferred` handed to the caller (apply's comment).
  template <class U>
  static void keep_nucleus(const U* key, const T* weights, T* out, std::size_t size, U last_key,
                           std::size_t last, T scale, detail::nucleus_keep_hook<U, T>* deferred) {
    if (deferred != nullptr) {
      *deferred = {key, weights, out, last_key, last, scale};
      return;
    }
    detail::nucleus_keep(key, weights, out, size, last_key, last, scale);
  }

  struct sparse_output {
    std::span<T> scratch;
    std::uint32_t* ids;
    T* weights;
    double* top_probability;
  };

  // finish()'s top-k branch with sparse output: the same survivors, weights and total, in
  // the same order of operations, so the kept weights are bitwise those apply() writes.
  template <class U, class WeightOf>
  std::size_t finish_sparse(std::span<const U> key, const sparse_output& out, U floor, U min_key,
                            bool use_min_p, T top_weight, WeightOf weight_of) {
    const std::span<T> weight = out.scratch;
    select_top_k_from_blocks(key, floor, options_.top_k);
    std::sort(index_.begin(), index_.end());  // the order of finish()
    for (const std::uint32_t j : index_) weight[j] = weight_of(j);
    auto kept = index_.end();
    if (options_.top_p < 1.0) {
      double mass = 0.0;
      for (const std::uint32_t j : index_) mass += static_cast<double>(weight[j]);
      kept = nucleus_end(key, std::span<const T>(weight), index_.begin(), index_.end(),
                         options_.top_p * mass)
                 .first;
    }
    double total = 0.0;
    for (auto it = index_.begin(); it != kept; ++it) {
      if (use_min_p && key[*it] < min_key) weight[*it] = T(0);
      total += static_cast<double>(weight[*it]);
    }
    if (!(total > 0.0)) return 0;
    const auto scale = static_cast<T>(1.0 / total);
    std::sort(index_.begin(), kept);  // nucleus_end reordered them
    std::size_t count = 0;
    for (auto it = index_.begin(); it != kept; ++it) {
      const T value = weight[*it];
      if (!(value > T(0))) continue;
      out.ids[count] = *it;
      out.weights[count] = value * scale;
      ++count;
    }
    *out.top_probability = static_cast<double>(top_weight) / total;
    return count;
  }

  static constexpr std::size_t select_block = detail::select_block;
  // Every select_sample-th block maximum is sampled for select_top_k_from_blocks' guess.
  static constexpr std::size_t select_sample = 8;

  // block_max_[b] = the largest key of block b (select_block entries, NaN keys passed over);
  // returns the largest key of the row. One dispatched pass (detail::block_maxima) with
  // `screen` (validation) fused into it.
  template <class U>
  U block_maxima(std::span<const U> key, detail::row_screen<U>* screen) {
    block_max_.resize((key.size() + select_block - 1) / select_block);
    return detail::block_maxima(key.data(), key.size(), block_max_.data(), screen);
  }

  // select_top_k for the key whose block maxima block_maxima() just computed: the k-th
  // largest block maximum t is at most the k-th largest key (the k largest block maxima are
  // k distinct entries), so every token of the top k has key >= t and lies in a block whose
  // maximum is >= t. Only those blocks are read again (about k blocks for a peaked row).
  // t comes from a short list: the blocks whose maximum reaches a guess g, the maximum of
  // rank about 2k / select_sample among every select_sample-th block. When at least k blocks
  // reach g, t >= g and the list holds every block that can matter; otherwise (rows whose
  // large entries cluster) the list is every block.
  template <class U>
  void select_top_k_from_blocks(std::span<const U> key, U floor, std::size_t k) {
    const std::size_t blocks = block_max_.size();
    if (blocks < k) {
      select_top_k(key, floor, k);
      return;
    }
    const double* const maxima = block_max_.data();
    block_order_.clear();
    for (std::size_t b = 0; b < blocks; b += select_sample) block_order_.push_back(maxima[b]);
    const std::size_t rank = std::min(block_order_.size(), 2 * k / select_sample + 2);
    std::nth_element(block_order_.begin(),
                     block_order_.begin() + static_cast<std::ptrdiff_t>(rank - 1),
                     block_order_.end(), std::greater<>());
    const double guess = block_order_[rank - 1];
    // Branch-free compaction (every id is written, the count advances when it qualifies):
    // the qualifying fraction is small and unpredictable.
    block_ids_.resize(blocks);
    std::size_t listed = 0;
    for (std::size_t b = 0; b < blocks; ++b) {
      block_ids_[listed] = static_cast<std::uint32_t>(b);
      listed += maxima[b] >= guess ? std::size_t{1} : std::size_t{0};
    }
    block_ids_.resize(listed);
    if (listed < k) {
      block_ids_.resize(blocks);
      std::iota(block_ids_.begin(), block_ids_.end(), std::uint32_t{0});
    }
    block_order_.clear();
    for (const std::uint32_t b : block_ids_) block_order_.push_back(maxima[b]);
    std::nth_element(block_order_.begin(),
                     block_order_.begin() + static_cast<std::ptrdiff_t>(k - 1), block_order_.end(),
                     std::greater<>());
    const double threshold = block_order_[k - 1];
    // Block maxima are keys converted exactly, so key >= t compares as U.
    const auto t = static_cast<U>(threshold);
    // The blocks that reach t, compacted in place, then their keys that reach it.
    std::size_t candidates = 0;
    for (const std::uint32_t b : block_ids_) {
      block_ids_[candidates] = b;
      candidates += maxima[b] >= threshold ? std::size_t{1} : std::size_t{0};
    }
    block_ids_.resize(candidates);
    const std::size_t size = key.size();
    index_.resize(std::min(size, candidates * select_block));
    std::size_t found = 0;
    for (const std::uint32_t b : block_ids_) {
      const std::size_t last = std::min(size, (b + std::size_t{1}) * select_block);
      for (std::size_t j = b * select_block; j < last; ++j) {
        index_[found] = static_cast<std::uint32_t>(j);
        found += key[j] >= t && key[j] > floor ? std::size_t{1} : std::size_t{0};
      }
    }
    index_.resize(found);
    if (index_.size() > k) {
      const detail::more_probable_first<U> before{key.data()};
      std::nth_element(index_.begin(), index_.begin() + static_cast<std::ptrdiff_t>(k),
                       index_.end(), before);
      index_.resize(k);
    }
  }

  // index_ = the ids of the k largest keys above floor (unordered; fewer if fewer exist).
  template <class U>
  void select_top_k(std::span<const U> key, U floor, std::size_t k) {
    index_.clear();
    const detail::more_probable_first<U> before{key.data()};
    const std::size_t size = key.size();
    if (k <= size / 16) {
      // A heap of the k best so far with the worst on top. Ids arrive in increasing order,
      // so an equal key never displaces an earlier id. Once the heap is full, blocks with
      // no key above the worst kept one are skipped after one vectorizable count.
      U worst{};
      const auto offer = [&](std::size_t j) {
        std::pop_heap(index_.begin(), index_.end(), before);
        index_.back() = static_cast<std::uint32_t>(j);
        std::push_heap(index_.begin(), index_.end(), before);
        worst = key[index_.front()];
      };
      std::size_t j = 0;
      for (; j < size && index_.size() < k; ++j) {
        if (!(key[j] > floor)) continue;
        index_.push_back(static_cast<std::uint32_t>(j));
        std::push_heap(index_.begin(), index_.end(), before);
        worst = key[index_.front()];
      }
      constexpr std::size_t block = 64;
      for (; j + block <= size; j += block) {
        unsigned above = 0;
        for (std::size_t t = j; t < j + block; ++t) above += key[t] > worst ? 1U : 0U;
        if (above == 0) continue;
        for (std::size_t t = j; t < j + block; ++t) {
          if (key[t] > worst) offer(t);
        }
      }
      for (; j < size; ++j) {
        if (key[j] > worst) offer(j);
      }
      return;
    }
    for (std::size_t j = 0; j < size; ++j) {
      if (key[j] > floor) index_.push_back(static_cast<std::uint32_t>(j));
    }
    if (index_.size() > k) {
      std::nth_element(index_.begin(), index_.begin() + static_cast<std::ptrdiff_t>(k),
                       index_.end(), before);
      index_.resize(k);
    }
  }

  // The nucleus of a row: the tokens ranked up to the one at `last` (key last_key), and
  // their mass: the buckets above the boundary's, then the boundary's kept tokens in id
  // order (one order of additions on every platform and kernel path).
  template <class U>
  struct nucleus {
    U last_key;
    std::size_t last;
    double mass;
  };

  // Top-p over a full row of weights (monotone in the keys): finds the nucleus.
  template <class U>
  nucleus<U> find_nucleus(std::span<const U> key, std::span<const T> weights, U floor, U top_key,
                          T top_weight,
                          double known_total = std::numeric_limits<double>::quiet_NaN()) {
    const std::size_t size = key.size();
    if (floor == U(0) && size >= nucleus_sampled_from) {
      const auto found = find_nucleus_sampled(key, weights, top_key, known_total);
      if (found.second) return found.first;
      ++nucleus_fallbacks_;
    }
    // Histogram of the mass over buckets of width 2^(1/16) below the top weight (binary
    // exponent and 4 mantissa bits; detail::nucleus_histogram). Weights are monotone in the
    // key, so the buckets above the one where the cumulated mass reaches `needed` hold a
    // prefix of the ranking, kept whole; only the tokens of that boundary bucket need ranking.
    constexpr std::size_t buckets = detail::nucleus_buckets;
    const auto top_code = static_cast<std::int32_t>(detail::magnitude_code(top_weight));
    histogram_.assign(2 * detail::nucleus_histogram_size, 0.0);
    codes_.resize(size);
    detail::nucleus_histogram(weights.data(), size, top_code, histogram_.data(), codes_.data());
    double total = 0.0;
    for (std::size_t b = 0; b < buckets; ++b) {
      histogram_[b] += histogram_[detail::nucleus_histogram_size + b];
      total += histogram_[b];
    }
    const double needed = options_.top_p * total;
    std::size_t boundary = 0;
    double above = 0.0;  // mass of the buckets before the boundary bucket
    for (; boundary + 1 < buckets; ++boundary) {
      if (above + histogram_[boundary] >= needed) break;
      above += histogram_[boundary];
    }
    index_.clear();
    detail::nucleus_collect(codes_.data(), size, static_cast<std::uint16_t>(boundary), index_);
    auto [end, reached] = nucleus_end(key, weights, index_.begin(), index_.end(), needed - above);
    if (!reached || index_.empty()) {  // rounding: rank every possible token instead
      index_.clear();
      for (std::size_t j = 0; j < size; ++j) {
        if (key[j] > floor && weights[j] > T(0)) index_.push_back(static_cast<std::uint32_t>(j));
      }
      above = 0.0;
      end = nucleus_end(key, weights, index_.begin(), index_.end(), needed).first;
    }
    // No positive weight at all (an infinite maximum makes every finite entry's tempered
    // weight 0 and its own NaN): no nucleus, a zero mass (the caller's zero row). A caller
    // validating after the standardization refuses such a row then.
    if (index_.empty()) return {U(0), 0, 0.0};
    const std::uint32_t last = *(end - 1);
    std::sort(index_.begin(), end);
    double mass = above;
    for (auto it = index_.begin(); it != end; ++it) mass += static_cast<double>(weights[*it]);
    return {key[last], last, mass};
  }

  // Rows of probabilities at least this long look for the nucleus from a sample first.
  static constexpr std::size_t nucleus_sampled_from = 4096;
  // This many entries are sampled, in evenly spaced runs of adjacent entries.
  static constexpr std::size_t nucleus_sample = 2048;
  // The band reaches this many standard errors of the sampled mass on either side.
  static constexpr double nucleus_band_width = 3.5;
  // The sample's runs: one cache line of keys each.
  template <class U>
  static constexpr std::size_t sample_run = detail::nucleus_sample_run<U>;
  static_assert(nucleus_sample % sample_run<float> == 0 &&
                nucleus_sample % sample_run<double> == 0);
  // heavy_retry lists the entries of the top buckets holding fewer sampled entries.
  static constexpr std::size_t heavy_sampled = 4;
  // How many runs ahead sampled_band asks for the next one.
  static constexpr std::size_t sampled_ahead = 8;
  static constexpr std::int32_t no_entry = -1;
  // Buckets of the band's own histogram.
  static constexpr std::size_t band_buckets = 1024;

  // find_nucleus for a long row of probabilities (key > 0 for every possible token):
  //  1. the mass of the row (taken by an earlier pass: at T = 1 apply's first pass, at
  //     T != 1 the pass that wrote the tempered weights; else a pass in double lanes,
  //     detail::nucleus_total);
  //  2. 2048 entries, in evenly spaced runs of one cache line, estimate the mass below each
  //     bucket of width 2^(1/16) under the top key, with its standard error (from the
  //     spread of the runs' sampled weights below); the band is the buckets where the end of
  //     the nucleus may lie within nucleus_band_width standard errors;
  //  3. one pass sums the keys above the band exactly and lists the band's ids
  //     (detail::nucleus_band);
  //  4. a histogram of the band alone (buckets of its key bits) finds the bucket where the
  //     mass reaches p times the total; only that bucket's tokens are ranked.
  // When the end is not in the band after all (a rare sample), .second is false and the
  // caller builds the full histogram. The mass is the one above the band, then the band's
  // buckets above the end's, then its kept tokens in id order: one order on every path, and
  // one band in every build (the estimates are never contracted into FMA, whatever the flags).
  template <class U>
  SPECDEC_NO_CONTRACT std::pair<nucleus<U>, bool> find_nucleus_sampled(std::span<const U> key,
                                                                       std::span<const T> weights,
                                                                       U top_key,
                                                                       double known_total) {
    const std::size_t size = key.size();
    const nucleus<U> none{U(0), 0, 0.0};
    // known_total: the row's mass from an earlier pass (at T = 1 apply's first pass; at
    // T != 1 the pass that wrote the tempered weights, detail::tempered_weights_mass).
    const double total =
        known_total == known_total ? known_total : detail::nucleus_total(weights.data(), size);
    if (!(total > 0.0 && total <= std::numeric_limits<double>::max())) return {none, false};
    const double needed = options_.top_p * total;
    U high{};
    U low{};
    if (!sampled_band(key, weights, detail::magnitude_code(top_key), total, high, low)) {
      return {none, false};
    }
    reserve_band(size);
    const auto found =
        detail::nucleus_band(key.data(), weights.data(), size, high, low, band_.data());
    const auto kept = resolve_band(key, weights, found, needed, high, low);
    if (kept.second) return kept;
    return heavy_retry(key, weights, detail::magnitude_code(top_key), total);
  }

  // Top-p alone at T = 1 on a long row of probabilities (screens_first_pass): the band is
  // placed from the sample before any pass, as for a row that sums to 1 (a validated row
  // does, within its tolerance), so that ONE pass takes the row's maximum, mass and screen
  // (apply's first pass) together with the band (detail::nucleus_screened_band). .found is
  // false when the band does not hold the end (a misleading sample, or a row whose mass is
  // far from 1): the caller then searches again knowing the mass.
  struct first_pass_nucleus {
    detail::max_and_total<T> screen;
    nucleus<T> kept;
    bool found;
  };
  SPECDEC_NO_CONTRACT first_pass_nucleus nucleus_first_pass(std::span<const T> row) {
    const std::size_t size = row.size();
    const nucleus<T> none{T(0), 0, 0.0};
    // Every probability is at most the mass: buckets counted down from the mass's code.
    constexpr double assumed_total = 1.0;
    T high{};
    T low{};
    if (!sampled_band(row, row, detail::magnitude_code(static_cast<T>(assumed_total)),
                      assumed_total, high, low)) {
      // Keys near the smallest positive number: no band; the first pass alone.
      return {detail::nucleus_max_total(row.data(), size), none, false};
    }
    reserve_band(size);
    const auto pass = detail::nucleus_screened_band(row.data(), size, high, low, band_.data());
    const double total = pass.screen.total;
    if (!(total > 0.0 && total <= std::numeric_limits<double>::max())) {
      return {pass.screen, none, false};
    }
    auto kept = resolve_band(row, row, pass.band, options_.top_p * total, high, low);
    if (!kept.second) {
      kept = heavy_retry(row, row, detail::magnitude_code(static_cast<T>(assumed_total)), total);
    }
    return {pass.screen, kept.first, kept.second};
  }

  // The band storage (room for every entry of a row of `size` and the vector builds' slack).
  void reserve_band(std::size_t size) {
    if (band_.size() < size + detail::nucleus_band_slack) {
      band_.resize(size + detail::nucleus_band_slack);
    }
  }

  // Step 2 of find_nucleus_sampled: the band [low, high) from the sampled runs, for a
  // row of mass `total` (buckets counted down from `top_code`, the code of a key at least
  // as large as most keys: larger ones count in the top bucket). False if the band would
  // be empty (keys near the smallest positive number).
  template <class U>
  SPECDEC_NO_CONTRACT bool sampled_band(std::span<const U> key, std::span<const T> weights,
                                        std::int64_t top_code, double total, U& high, U& low) {
    take_sample(key, weights, top_code);
    return place_band(key.size(), top_code, total, nullptr, 0, high, low);
  }

  // The sample: `clusters` runs of `run` adjacent entries (one cache line of keys when the
  // row is aligned), evenly spaced: 2048 entries from 128 lines of a float row, where 2048
  // entries a stride apart cost about as much as reading a quarter of the row. Each
  // entry's weight and bucket go to sample_ and codes_ (detail::sample_runs), each run's
  // sampled weight below bucket 0 to run_mass_, the buckets' sampled weights to
  // histogram_ with a list per bucket of its entries (sample_next_ from sample_head_).
  template <class U>
  void take_sample(std::span<const U> key, std::span<const T> weights, std::int64_t top_code) {
    const std::size_t size = key.size();
    constexpr std::size_t buckets = detail::nucleus_buckets;
    histogram_.assign(buckets + 1, 0.0);  // and a last bucket for entries without weight
    double* const sampled = histogram_.data();
    constexpr std::size_t run = sample_run<U>;
    constexpr std::size_t clusters = nucleus_sample / run;
    const std::size_t spacing = size / clusters;
    SPECDEC_ASSERT(spacing >= 2 * run);                    // size >= nucleus_sampled_from
    const auto top = static_cast<std::int32_t>(top_code);  // a magnitude code: 16 bits at most
    sample_.resize(nucleus_sample);
    codes_.resize(nucleus_sample);
    run_mass_.resize(clusters);
    T* const weight_of = sample_.data();
    std::uint16_t* const code_of = codes_.data();
    detail::sample_runs(key.data(), weights.data(), spacing, clusters, sampled_ahead, top,
                        weight_of, code_of, run_mass_.data());
    sample_head_.assign(buckets + 1, no_entry);
    sample_next_.resize(nucleus_sample);
    for (std::size_t e = 0; e < nucleus_sample; ++e) {
      const std::uint16_t code = code_of[e];
      sampled[code] += static_cast<double>(weight_of[e]);
      sample_next_[e] = sample_head_[code];
      sample_head_[code] = static_cast<std::int32_t>(e);
    }
  }

  // The band from take_sample's sample for a row of `size` entries and mass `total`.
  // `exact` (or null): the exact mass per bucket of the entries of the top `heavy` buckets,
  // listed apart (heavy_retry); the sampled entries of those buckets then count for nothing.
  //
  // H(b), the mass of the buckets up to b, grows with b. The mass below b (the buckets
  // after it) is estimated as scale * (sampled weight below b), plus the exact mass below
  // b, with the standard error of a sample of `clusters` runs: scale * sqrt(C / (C - 1) *
  // (sum of the squared runs' weights below b - (their sum)^2 / C)), so that adjacent
  // entries whose weights move together (vocabularies order related tokens together) widen
  // the band rather than mislead it. b is surely short when even the estimate plus the
  // margin misses `needed`, surely enough when the estimate minus the margin reaches it
  // (compared squared: no square root per bucket); the band runs from after the last short
  // bucket to the first enough one.
  template <class U>
  SPECDEC_NO_CONTRACT bool place_band(std::size_t size, std::int64_t top_code, double total,
                                      const double* exact, std::size_t heavy, U& high, U& low) {
    constexpr std::size_t buckets = detail::nucleus_buckets;
    constexpr std::size_t run = sample_run<U>;
    constexpr std::size_t clusters = nucleus_sample / run;
    const double needed = options_.top_p * total;
    const double* const sampled = histogram_.data();
    const T* const weight_of = sample_.data();
    // The walk moves each run's weight below b down as the buckets pass: a copy.
    run_left_.assign(run_mass_.begin(), run_mass_.end());
    const double scale = static_cast<double>(size) / static_cast<double>(nucleus_sample);
    constexpr auto runs = static_cast<double>(clusters);
    const double factor =
        nucleus_band_width * nucleus_band_width * scale * scale * (runs / (runs - 1.0));
    double below = 0.0;          // sampled weight in the buckets after b
    double below_squared = 0.0;  // the sum of the squared runs' weights there
    for (std::size_t c = 0; c < clusters; ++c) {
      below += run_left_[c];
      below_squared += run_left_[c] * run_left_[c];
    }
    // The entries of bucket b leave the sampled weights below (and the runs' weights).
    const auto leave = [&](std::size_t b) {
      below = std::max(below - sampled[b], 0.0);
      for (std::int32_t e = sample_head_[b]; e != no_entry;
           e = sample_next_[static_cast<std::size_t>(e)]) {
        const auto entry = static_cast<std::size_t>(e);
        double& mass = run_left_[entry / run];
        const double left = std::max(mass - static_cast<double>(weight_of[entry]), 0.0);
        below_squared = std::max(below_squared - (mass * mass - left * left), 0.0);
        mass = left;
      }
    };
    double exact_below = 0.0;  // the exact mass in the buckets after b
    if (exact == nullptr) heavy = 0;
    for (std::size_t b = 1; b < heavy; ++b) {
      exact_below += exact[b];
      leave(b);  // counted exactly instead
    }
    std::size_t first = 0;
    std::size_t last = buckets - 1;
    for (std::size_t b = 0; b < buckets; ++b) {
      const double gap = total - (scale * below + exact_below) - needed;  // estimate - needed
      const double margin_squared =
          factor * std::max(below_squared - below * below * (1.0 / runs), 0.0);
      const double gap_squared = gap * gap;
      if (gap >= 0.0 && gap_squared >= margin_squared) {
        last = b;
        break;
      }
      if (gap < 0.0 && gap_squared > margin_squared) first = b + 1;
      if (b + 1 < heavy) {
        exact_below = std::max(exact_below - exact[b + 1], 0.0);
      } else if (b + 1 < buckets) {
        leave(b + 1);
      }
    }
    first = std::min(first, last);
    high = detail::from_magnitude_code<U>(top_code - static_cast<std::int64_t>(first) + 1);
    low = std::max(last + 1 == buckets
                       ? U(0)
                       : detail::from_magnitude_code<U>(top_code - static_cast<std::int64_t>(last)),
                   std::numeric_limits<U>::denorm_min());
    return low < high;
  }

  // A second band when the first missed the end, for rows where a few heavy entries hold
  // much of the mass (the common shape of a language model's row): the sample rarely holds
  // them (and scales one it holds up as if it stood for size / 2048 entries), and its
  // estimate places their mass in the top bucket, wherever they lie. The entries of the
  // top buckets, which hold fewer than heavy_sampled sampled entries (about
  // heavy_sampled * size / 2048 entries expected), are listed in one pass over the keys, their
  // exact masses per bucket replace the sample there, and the band placed from that is passed and
  // resolved as the first was. False when it misses too (the caller's full histogram).
  template <class U>
  SPECDEC_NO_CONTRACT std::pair<nucleus<U>, bool> heavy_retry(std::span<const U> key,
                                                              std::span<const T> weights,
                                                              std::int64_t top_code, double total) {
    constexpr std::size_t buckets = detail::nucleus_buckets;
    const nucleus<U> none{U(0), 0, 0.0};
    const std::size_t size = key.size();
    // The heavy buckets: the top ones, holding fewer than heavy_sampled sampled entries.
    std::size_t seen = 0;
    std::size_t heavy_buckets = 0;
    for (; heavy_buckets < buckets; ++heavy_buckets) {
      for (std::int32_t e = sample_head_[heavy_buckets]; e != no_entry;
           e = sample_next_[static_cast<std::size_t>(e)]) {
        ++seen;
      }
      if (seen >= heavy_sampled) break;
    }
    if (heavy_buckets == 0) return {none, false};
    // The top buckets: keys from this one up (larger keys count in bucket 0), or every
    // positive key when the sample holds fewer than heavy_sampled entries with weight.
    const U from = heavy_buckets >= buckets
                       ? std::numeric_limits<U>::denorm_min()
                       : detail::from_magnitude_code<U>(
                             top_code - static_cast<std::int64_t>(heavy_buckets) + 1);
    if (!(from > U(0))) return {none, false};
    reserve_band(size);
    const auto heavy = detail::nucleus_band(key.data(), key.data(), size,
                                            std::numeric_limits<U>::infinity(), from, band_.data());
    exact_.assign(buckets, 0.0);
    const auto top = static_cast<std::int32_t>(top_code);
    for (std::size_t i = 0; i < heavy.count; ++i) {
      const std::uint32_t id = band_[i];
      const auto weight = static_cast<double>(weights[id]);
      if (weight > 0.0) {
        exact_[static_cast<std::size_t>(detail::nucleus_bucket(key[id], top))] += weight;
      }
    }
    U high{};
    U low{};
    if (!place_band(size, top_code, total, exact_.data(), heavy_buckets, high, low)) {
      return {none, false};
    }
    const auto found =
        detail::nucleus_band(key.data(), weights.data(), size, high, low, band_.data());
    const auto kept = resolve_band(key, weights, found, options_.top_p * total, high, low);
    if (kept.second) ++nucleus_retries_;
    return kept;
  }

  // Steps 3-4 of find_nucleus_sampled once the band pass `found` ran: the nucleus if its
  // end lies in the band.
  template <class U>
  SPECDEC_NO_CONTRACT std::pair<nucleus<U>, bool> resolve_band(std::span<const U> key,
                                                               std::span<const T> weights,
                                                               detail::nucleus_band_found found,
                                                               double needed, U high, U low) {
    using word = std::conditional_t<sizeof(U) == 8, std::uint64_t, std::uint32_t>;
    const nucleus<U> none{U(0), 0, 0.0};
    if (!(found.head < needed)) return {none, false};
    // The band's histogram: buckets of equal width in the key bits (monotone in the key for
    // positive keys), the highest keys in the highest bucket.
    const auto low_bits = std::bit_cast<word>(low);
    const word span = std::bit_cast<word>(high) - low_bits;
    const auto shift =
        static_cast<unsigned>(std::max(0, static_cast<int>(std::bit_width(span)) -
                                              static_cast<int>(std::bit_width(band_buckets - 1))));
    const auto used = static_cast<std::size_t>(((span - 1) >> shift) + 1);  // <= band_buckets
    histogram_.assign(used, 0.0);
    double* const band_mass = histogram_.data();
    const std::uint32_t* const band = band_.data();
    // codes_ and band_weight_: each band entry's bucket and weight, read once (the ids are
    // scattered over the row; vector gathers on the AVX2 and AVX-512 paths), so that the
    // histogram's additions wait on no read of the row.
    codes_.resize(found.count);
    std::uint16_t* const code = codes_.data();
    band_weight_.resize(found.count);
    T* const band_weight = band_weight_.data();
    detail::band_codes(key.data(), weights.data(), band, found.count, low_bits, shift, code,
                       band_weight, key.size());
    for (std::size_t i = 0; i < found.count; ++i) {
      band_mass[code[i]] += static_cast<double>(band_weight[i]);
    }
    double above = found.head;
    std::size_t boundary = used;
    while (boundary-- > 0) {
      if (above + band_mass[boundary] >= needed) break;
      above += band_mass[boundary];
    }
    if (boundary >= used) return {none, false};  // the end lies below the band
    // The boundary bucket's ids, in band order, listed over the band's own front (the band
    // is not read again; its storage has the list's slack).
    const auto listed = band_.begin();
    const auto listed_end =
        listed + static_cast<std::ptrdiff_t>(detail::list_bucket(
                     code, band, found.count, static_cast<std::uint16_t>(boundary), band_.data()));
    const auto [end, reached] = nucleus_end(key, weights, listed, listed_end, needed - above);
    if (!reached) return {none, false};  // rounding between the two orders of addition
    const std::uint32_t end_id = *(end - 1);
    std::sort(listed, end);
    double mass = above;
    for (auto it = listed; it != end; ++it) mass += static_cast<double>(weights[*it]);
    return {{key[end_id], end_id, mass}, true};
  }

  // Ranks [first, last) (higher key first, lower id first) far enough to find the end of
  // the shortest prefix whose weight reaches `needed` (> 0): halving with nth_element
  // (expected linear time), then sorting only the final short range. Returns that end and
  // whether `needed` was reached (else the end is `last`).
  template <class U>
  std::pair<index_iterator, bool> nucleus_end(std::span<const U> key, std::span<const T> weights,
                                              index_iterator first, index_iterator last,
                                              double needed) const {
    const auto mass = [&](index_iterator from, index_iterator to) {
      double sum = 0.0;
      for (auto it = from; it != to; ++it) sum += static_cast<double>(weights[*it]);
      return sum;
    };
    const detail::more_probable_first<U> before{key.data()};
    constexpr std::ptrdiff_t sort_below = 32;
    double reached = 0.0;  // mass of the ranked prefix before `low`
    auto low = first;
    auto high = last;
    while (high - low > sort_below) {
      const auto middle = low + (high - low) / 2;
      std::nth_element(low, middle, high, before);
      const double lower_mass = mass(low, middle);
      if (reached + lower_mass >= needed) {
        high = middle;
      } else {
        reached += lower_mass;
        low = middle;
      }
    }
    std::sort(low, high, before);
    for (auto it = low; it != high; ++it) {
      reached += static_cast<double>(weights[*it]);
      if (reached >= needed) return {it + 1, true};
    }
    return {high, high != last};
  }

  SamplingOptions options_;
  std::vector<std::uint32_t> index_;
  std::vector<double> block_max_;          // apply_sparse: maxima of blocks of select_block keys
  std::vector<double> block_order_;        // their selection
  std::vector<std::uint32_t> block_ids_;   // the blocks select_top_k_from_blocks ranks
  std::vector<double> histogram_;          // find_nucleus: two histograms of bucket masses
  std::vector<std::uint16_t> codes_;       // find_nucleus: the bucket of every entry
  std::size_t nucleus_fallbacks_ = 0;      // rows find_nucleus_sampled did not place
  std::size_t nucleus_retries_ = 0;        // rows heavy_retry placed
  std::vector<std::uint32_t> band_;        // find_nucleus_sampled: the band's ids
  std::vector<T> band_weight_;             // resolve_band: the band's weights
  std::vector<T> sample_;                  // sampled_band: the sampled entries' weights
  std::vector<double> run_mass_;           // its runs' weights below bucket 0
  std::vector<double> run_left_;           // place_band: the runs' weights below its bucket
  std::vector<double> exact_;              // heavy_retry: the listed entries' mass per bucket
  std::vector<std::int32_t> sample_head_;  // the first sampled entry of each bucket
  std::vector<std::int32_t> sample_next_;  // the next sampled entry of the same bucket
};

/// Convenience: the standardized copy of one row (allocates; use a Standardizer in loops).
template <ProbabilityVector V>
[[nodiscard]] std::vector<probability_scalar_t<V>> standardize(const V& probabilities,
                                                               const SamplingOptions& options) {
  using scalar = probability_scalar_t<V>;
  const auto row = as_span(probabilities);
  std::vector<scalar> out(row.size());
  Standardizer<scalar>(options).apply(row, std::span<scalar>(out));
  return out;
}

/// Convenience: standardize(softmax(logits)) of one row (allocates).
template <ProbabilityVector V>
[[nodiscard]] std::vector<probability_scalar_t<V>> standardize_logits(
    const V& logits, const SamplingOptions& options) {
  using scalar = probability_scalar_t<V>;
  const auto row = as_span(logits);
  std::vector<scalar> out(row.size());
  Standardizer<scalar>(options).apply_logits(row, std::span<scalar>(out));
  return out;
}

/// Numerically stable softmax: out[j] = exp(logits[j] - max) / sum. -inf logits give 0;
/// all -inf gives a zero row (the decoder then reports zero mass). Precondition:
/// out.size() == logits.size().
template <ProbabilityScalar U, ProbabilityScalar T>
void softmax(std::span<const U> logits, std::span<T> out) {
  SPECDEC_ASSERT(out.size() == logits.size());
  if (logits.empty()) return;
  const auto maximum = static_cast<T>(detail::max_entry(logits.data(), logits.size()));
  if (maximum == -std::numeric_limits<T>::infinity()) {
    std::fill(out.begin(), out.end(), T(0));
    return;
  }
  detail::shifted_exp(logits.data(), out.data(), out.size(), maximum, T(1));
  const double total = detail::sum_in_double(out.data(), out.size());
  if (total > 0.0) {
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(
        out.data(), static_cast<Eigen::Index>(out.size())) *= static_cast<T>(1.0 / total);
  }
}

// ---------------------------------------------------------------------------------------
// Models that return logits
// ---------------------------------------------------------------------------------------

/// `model.next_token_logits(context)`: logits or log-probabilities of the next token as a
/// float/double vector (any ProbabilityVector-shaped type; the entries are logits).
template <class M>
concept HasNextTokenLogits = requires(M& model, std::span<const token_id> context) {
  { model.next_token_logits(context) } -> ProbabilityVector;
};

/// `model.score_draft_logits(context, draft)`: the logits of all draft.size() + 1
/// prefixes in one call, row-major (the logits twin of BatchedLanguageModel::score_draft).
template <class M>
concept HasDraftLogitsScoring = requires(M& model, std::span<const token_id> context,
                                         std::span<const token_id> draft) {
  { model.score_draft_logits(context, draft) } -> ProbabilityMatrix;
};

/// `model.score_tree_logits(context, tree)` with a `Tree` (TokenTreeView, draft_tree.hpp):
/// the logits of every node of a token tree in one call, row-major (the logits twin of
/// TreeScoringModel::score_tree, tree_verification.hpp).
template <class M, class Tree>
concept HasTreeLogitsScoring = requires(M& model, std::span<const token_id> context,
                                        const Tree& tree) {
  { model.score_tree_logits(context, tree) } -> ProbabilityMatrix;
};

/// A model of the next token that returns logits: `vocab_size()` and
/// `next_token_logits(context)`; optionally `score_draft_logits(context, draft)` and
/// `score_tree_logits(context, tree)`.
template <class M>
concept LogitsLanguageModel = HasVocabSize<M> && HasNextTokenLogits<M>;

/// Adapts a LogitsLanguageModel to LanguageModel (and to BatchedLanguageModel when the
/// model has score_draft_logits, to TreeScoringModel when it has score_tree_logits) with a
/// numerically stable softmax into rows the adapter owns. Holds a reference: the model must
/// outlive the adapter. Returned rows stay valid until the next call on the adapter.
///
/// Two ways to sample with temperature / truncation, with the same output law:
///  - plain adapters (softmax only) and the SamplingOptions in DecoderOptions: the decoder
///    standardizes the probabilities (temperature on logits == power on probabilities);
///  - the SamplingOptions given to BOTH adapters (target and draft) and identity options in
///    the decoder: the adapters apply standardize_logits, which saves a log and an exp per
///    entry. This is exact because the decoder draws each draft from the very q rows it
///    verifies with, and the output follows the (standardized) target rows; T = 0 then
///    gives one-hot rows, which verify like greedy decoding.
/// @code
/// specdec::LogitsModel target(my_logits_engine);
/// specdec::SpeculativeDecoder decoder(target, draft, options);
/// @endcode
template <LogitsLanguageModel M>
class LogitsModel {
 public:
  using scalar_type = probability_scalar_t<decltype(std::declval<M&>().next_token_logits(
      std::declval<std::span<const token_id>>()))>;

  /// Softmax only; `sampling` != identity applies that standardization to every row (see
  /// the class comment). Throws specdec::error (errc::invalid_option) for bad options.
  explicit LogitsModel(M& model, const SamplingOptions& sampling = {})
      : model_(&model), standardizer_(sampling) {
    standardizer_.reserve(static_cast<std::size_t>(model.vocab_size()));
  }

  [[nodiscard]] std::size_t vocab_size() const {
    return static_cast<std::size_t>(model_->vocab_size());
  }

  /// standardize(softmax(next_token_logits(context))).
  std::span<const scalar_type> next_token_probabilities(std::span<const token_id> context) {
    const auto& logits = model_->next_token_logits(context);
    const auto row = as_span(logits);
    row_.resize(row.size());
    convert(row, std::span<scalar_type>(row_));
    return row_;
  }

  /// Row-wise standardize(softmax(...)) of score_draft_logits(context, draft).
  RowsView<const scalar_type> score_draft(std::span<const token_id> context,
                                          std::span<const token_id> draft) requires
      HasDraftLogitsScoring<M> {
    const auto& scored = model_->score_draft_logits(context, draft);
    return convert_rows(as_rows(scored));
  }

  /// Row-wise standardize(softmax(...)) of score_tree_logits(context, tree): one row per
  /// tree node, root first (what TreeScoringModel::score_tree returns).
  template <class Tree>
  requires HasTreeLogitsScoring<M, Tree> RowsView<const scalar_type> score_tree(
      std::span<const token_id> context, const Tree& tree) {
    const auto& scored = model_->score_tree_logits(context, tree);
    return convert_rows(as_rows(scored));
  }

  /// Row-wise standardize(softmax(...)) of score_batch_logits(requests): the batch
  /// decoder's BatchScoringModel::score_batch (batch_decoder.hpp) for an engine of logits.
  template <class Requests>
  requires requires(M& model, const Requests& requests) {
    { model.score_batch_logits(requests) } -> ProbabilityMatrix;
  }
  RowsView<const scalar_type> score_batch(const Requests& requests) {
    const auto& scored = model_->score_batch_logits(requests);
    return convert_rows(as_rows(scored));
  }

  /// Row-wise standardize(softmax(...)) of draft_batch_logits(requests): the batch
  /// decoder's BatchDraftModel::draft_batch.
  template <class Requests>
  requires requires(M& model, const Requests& requests) {
    { model.draft_batch_logits(requests) } -> ProbabilityMatrix;
  }
  RowsView<const scalar_type> draft_batch(const Requests& requests) {
    const auto& scored = model_->draft_batch_logits(requests);
    return convert_rows(as_rows(scored));
  }

  /// Forwards release_sequence(id) to a model that has it.
  template <std::same_as<std::uint64_t> Id>
  requires requires(M& model, Id id) { model.release_sequence(id); }
  void release_sequence(Id id) { model_->release_sequence(id); }

  [[nodiscard]] M& model() const noexcept { return *model_; }
  [[nodiscard]] const SamplingOptions& sampling() const noexcept { return standardizer_.options(); }

 private:
  template <class U>
  RowsView<const scalar_type> convert_rows(RowsView<const U> logits) {
    rows_.resize(logits.rows() * logits.cols());
    for (std::size_t i = 0; i < logits.rows(); ++i) {
      convert(std::span<const U>(logits.row(i)),
              std::span<scalar_type>(rows_.data() + i * logits.cols(), logits.cols()));
    }
    return {rows_.data(), logits.rows(), logits.cols()};
  }

  template <class U>
  void convert(std::span<const U> logits, std::span<scalar_type> out) {
    if (standardizer_.identity()) {
      softmax(logits, out);
    } else {
      standardizer_.apply_logits(logits, out);
    }
  }

  M* model_;
  Standardizer<scalar_type> standardizer_;
  std::vector<scalar_type> row_;
  std::vector<scalar_type> rows_;
};

}  // namespace specdec
