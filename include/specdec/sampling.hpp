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
//     exp(log(p(x) / max p) / T), so it never overflows). T = 1 leaves the row as is.
//     T = 0 means greedy: the result is one-hot at the argmax, the lowest id among ties,
//     and SpeculativeDecoder then verifies by exact match. As T -> 0 (T > 0) the result
//     approaches the uniform distribution over the tokens tied at the maximum (the one-hot
//     argmax when the maximum is unique). Zero entries stay zero for every T.
//  2. top-k (k > 0): keep the k most probable tokens. Ties are broken by token id, lower
//     id first, so exactly min(k, #non-zero) tokens survive. k = 0 or k >= V: no-op.
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
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/sampling_kernels.hpp"
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
/// validates rows before standardizing). The output always has the input's size.
template <ProbabilityScalar T>
class Standardizer {
 public:
  using value_type = T;

  /// Throws specdec::error (errc::invalid_option) for options out of range.
  explicit Standardizer(const SamplingOptions& options = {}) : options_(options) {
    options_.validate();
  }

  [[nodiscard]] const SamplingOptions& options() const noexcept { return options_; }
  [[nodiscard]] bool identity() const noexcept { return options_.identity(); }
  [[nodiscard]] bool greedy() const noexcept { return options_.greedy(); }

  /// Allocates the scratch space for rows of `vocab_size` entries now.
  void reserve(std::size_t vocab_size) {
    if (needs_index()) index_.reserve(vocab_size);
  }

  /// Writes the standardized `probabilities` into `out` (same size, may not alias unless
  /// it is the same row) and returns the largest standardized probability.
  template <ProbabilityScalar U>
  double apply(std::span<const U> probabilities, std::span<T> out) {
    SPECDEC_ASSERT(out.size() == probabilities.size());
    const std::size_t size = probabilities.size();
    if (size == 0) return 0.0;
    if (options_.greedy()) return one_hot_argmax(probabilities, out);
    const auto maximum = static_cast<T>(detail::max_entry(probabilities.data(), size));
    if (!(maximum > T(0))) {
      copy(probabilities, out);
      return 0.0;
    }
    if (options_.temperature == 1.0) {
      copy(probabilities, out);
    } else {
      const double inverse_temperature = 1.0 / options_.temperature;
      if (!(inverse_temperature <= static_cast<double>(std::numeric_limits<T>::max()))) {
        return uniform_over_maxima(probabilities, out);
      }
      // p^(1/T) = exp(log(p / max) / T): the maximum maps to exactly 1, nothing overflows.
      map(out) = (cmap(probabilities).template cast<T>() / maximum).log() *
                 static_cast<T>(inverse_temperature);
      exponentiate(out);
    }
    return truncate_and_normalize(out);
  }

  /// Writes standardize(softmax(logits)) into `out`: logits (or log-probabilities; any
  /// additive constant cancels) with -inf for impossible tokens. Computed stably as
  /// exp((logit - max logit) / T). Returns the largest standardized probability. All
  /// entries -inf gives a zero row; a NaN or +inf logit gives NaN entries.
  template <ProbabilityScalar U>
  double apply_logits(std::span<const U> logits, std::span<T> out) {
    SPECDEC_ASSERT(out.size() == logits.size());
    const std::size_t size = logits.size();
    if (size == 0) return 0.0;
    if (options_.greedy()) return one_hot_argmax(logits, out);
    const auto maximum = static_cast<T>(detail::max_entry(logits.data(), size));
    if (maximum == -std::numeric_limits<T>::infinity()) {
      std::fill(out.begin(), out.end(), T(0));
      return 0.0;
    }
    const double inverse_temperature = 1.0 / options_.temperature;
    if (!(inverse_temperature <= static_cast<double>(std::numeric_limits<T>::max()))) {
      return uniform_over_maxima(logits, out);
    }
    map(out) = (cmap(logits).template cast<T>() - maximum) * static_cast<T>(inverse_temperature);
    exponentiate(out);
    return truncate_and_normalize(out);
  }

 private:
  using array_map = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

  [[nodiscard]] static array_map map(std::span<T> row) noexcept {
    return array_map(row.data(), static_cast<Eigen::Index>(row.size()));
  }
  template <class U>
  [[nodiscard]] static auto cmap(std::span<const U> row) noexcept {
    return Eigen::Map<const Eigen::Array<U, Eigen::Dynamic, 1>>(
        row.data(), static_cast<Eigen::Index>(row.size()));
  }

  // In place: x -> exp(x) for exponents x <= 0. Exponents below log(smallest normal T),
  // -inf included, give exactly 0 (vectorized exp clamps its argument, so exp(-inf) would
  // otherwise come out as a tiny positive number and zeros would gain support).
  static void exponentiate(std::span<T> exponents) noexcept {
    detail::exponentiate_flushing(exponents.data(), exponents.size());
  }

  template <class U>
  static void copy(std::span<const U> in, std::span<T> out) noexcept {
    if (static_cast<const void*>(in.data()) == static_cast<const void*>(out.data())) return;
    std::transform(in.begin(), in.end(), out.begin(),
                   [](U value) { return static_cast<T>(value); });
  }

  [[nodiscard]] bool needs_index() const noexcept {
    return options_.top_k != 0 || options_.top_p < 1.0;
  }

  template <class U>
  static double one_hot_argmax(std::span<const U> in, std::span<T> out) noexcept {
    const std::size_t best = detail::first_argmax(in.data(), in.size());
    std::fill(out.begin(), out.end(), T(0));
    out[best] = T(1);
    return 1.0;
  }

  // The T -> 0 limit when 1/T is not representable: uniform over the maximal entries.
  template <class U>
  double uniform_over_maxima(std::span<const U> in, std::span<T> out) {
    const U best = detail::max_entry(in.data(), in.size());
    std::transform(in.begin(), in.end(), out.begin(),
                   [best](U value) { return value == best ? T(1) : T(0); });
    return truncate_and_normalize(out);
  }

  // Steps 2-5 on non-negative weights whose maximum is positive.
  double truncate_and_normalize(std::span<T> weights) {
    const std::size_t size = weights.size();
    const T maximum = detail::max_entry(weights.data(), size);
    if (needs_index()) truncate_ranked(weights);
    if (options_.min_p > 0.0) {
      const T threshold = static_cast<T>(options_.min_p) * maximum;
      for (T& weight : weights) weight = weight >= threshold ? weight : T(0);
    }
    const double total = detail::sum_in_double(weights.data(), size);
    if (!(total > 0.0)) return 0.0;
    const T scale = static_cast<T>(1.0 / total);
    map(weights) *= scale;
    return static_cast<double>(maximum) / total;
  }

  // Top-k then top-p on the ids of the non-zero weights, ordered "more probable first,
  // lower id first". Both keep a prefix of that order; everything else is set to zero.
  void truncate_ranked(std::span<T> weights) {
    index_.clear();
    for (std::size_t j = 0; j < weights.size(); ++j) {
      if (weights[j] > T(0)) index_.push_back(static_cast<std::uint32_t>(j));
    }
    const detail::more_probable_first<T> before{weights.data()};
    auto first = index_.begin();
    auto kept = index_.end();
    const std::size_t k = options_.top_k;
    if (k != 0 && k < index_.size()) {
      kept = first + static_cast<std::ptrdiff_t>(k);
      std::nth_element(first, kept, index_.end(), before);
    }
    if (options_.top_p < 1.0) kept = nucleus_end(weights, first, kept);
    for (auto it = kept; it != index_.end(); ++it) weights[*it] = T(0);
  }

  // End of the smallest prefix (in rank order) of [first, last) whose mass reaches top_p
  // times the mass of [first, last). Selects by halving with nth_element (expected linear
  // time), then sorts only the final short range.
  using index_iterator = std::vector<std::uint32_t>::iterator;
  index_iterator nucleus_end(std::span<const T> weights, index_iterator first,
                             index_iterator last) const {
    const auto mass = [&](index_iterator from, index_iterator to) {
      double sum = 0.0;
      for (auto it = from; it != to; ++it) sum += static_cast<double>(weights[*it]);
      return sum;
    };
    const double needed = options_.top_p * mass(first, last);
    const detail::more_probable_first<T> before{weights.data()};
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
      if (reached >= needed) return it + 1;
    }
    return high;
  }

  SamplingOptions options_;
  std::vector<std::uint32_t> index_;
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
  const auto size = static_cast<Eigen::Index>(logits.size());
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> result(out.data(), size);
  result =
      Eigen::Map<const Eigen::Array<U, Eigen::Dynamic, 1>>(logits.data(), size).template cast<T>() -
      maximum;
  detail::exponentiate_flushing(out.data(), out.size());
  const double total = detail::sum_in_double(out.data(), out.size());
  if (total > 0.0) result *= static_cast<T>(1.0 / total);
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

/// A model of the next token that returns logits: `vocab_size()` and
/// `next_token_logits(context)`; optionally `score_draft_logits(context, draft)`.
template <class M>
concept LogitsLanguageModel = HasVocabSize<M> && HasNextTokenLogits<M>;

/// Adapts a LogitsLanguageModel to LanguageModel (and to BatchedLanguageModel when the
/// model has score_draft_logits) with a numerically stable softmax into rows the adapter
/// owns. Holds a reference: the model must outlive the adapter. Returned rows stay valid
/// until the next call on the adapter. Temperature and truncation are not applied here;
/// the decoder standardizes the probabilities (temperature on logits == power on
/// probabilities).
/// @code
/// specdec::LogitsModel target(my_logits_engine);
/// specdec::SpeculativeDecoder decoder(target, draft, options);
/// @endcode
template <LogitsLanguageModel M>
class LogitsModel {
 public:
  using scalar_type = probability_scalar_t<decltype(std::declval<M&>().next_token_logits(
      std::declval<std::span<const token_id>>()))>;

  explicit LogitsModel(M& model) : model_(&model) {}

  [[nodiscard]] std::size_t vocab_size() const {
    return static_cast<std::size_t>(model_->vocab_size());
  }

  /// softmax(next_token_logits(context)).
  std::span<const scalar_type> next_token_probabilities(std::span<const token_id> context) {
    const auto& logits = model_->next_token_logits(context);
    const auto row = as_span(logits);
    row_.resize(row.size());
    softmax(row, std::span<scalar_type>(row_));
    return row_;
  }

  /// Row-wise softmax of score_draft_logits(context, draft).
  RowsView<const scalar_type> score_draft(std::span<const token_id> context,
                                          std::span<const token_id> draft) requires
      HasDraftLogitsScoring<M> {
    const auto& scored = model_->score_draft_logits(context, draft);
    const auto logits = as_rows(scored);
    using logit_scalar = typename std::remove_cvref_t<decltype(logits)>::value_type;
    rows_.resize(logits.rows() * logits.cols());
    for (std::size_t i = 0; i < logits.rows(); ++i) {
      softmax(std::span<const logit_scalar>(logits.row(i)),
              std::span<scalar_type>(rows_.data() + i * logits.cols(), logits.cols()));
    }
    return {rows_.data(), logits.rows(), logits.cols()};
  }

  [[nodiscard]] M& model() const noexcept { return *model_; }

 private:
  M* model_;
  std::vector<scalar_type> row_;
  std::vector<scalar_type> rows_;
};

}  // namespace specdec
