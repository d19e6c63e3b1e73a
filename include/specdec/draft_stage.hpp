// specdec — the draft stage of a decoding step: x_1..x_gamma from the draft, and the q rows
// verification reads them with.
//
// A LanguageModel draft is called once per token on context + x_1..x_{i-1}; the stage
// samples x_i itself from the row standardized exactly as the target's rows will be, so the
// q in the acceptance ratio is always the q the token came from. How a row is kept depends
// on the sampling options:
//  - T = 1 without truncation (draw_identity): ONE pass copies the row into the stage (a
//    model's view is valid only until its next call), screens it (validate_rows), takes its
//    maximum when the gamma policy reads it, and builds the mass table the draw walks. The
//    row is not rescaled: its normaliser is kept as a scalar (q = scale * row). A draft that
//    declares stable_rows is read in place: the same pass without the copy.
//  - top-k truncation: the survivors (SurvivorRows, step_rows.hpp);
//  - other T / top-p / min-p: the standardized row (standardize_checked);
//  - greedy: the argmax, validated inside the scan.
// A ProposalDrafter is called once; keep_proposals checks and cuts its tokens (also for
// BatchDecoder). Drafting ends right after a stop token, or where the gamma policy's
// continue_drafting says so.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/decoder_kernels.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/detail/sparse_rows.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/step_checks.hpp"
#include "specdec/step_rows.hpp"
#include "specdec/stop_conditions.hpp"

namespace specdec {

/// The checks of a drafter's proposals, shared by the decoders: `tokens` holds `proposed`
/// of the `gamma` asked for. too_many() is called (and must throw) if proposed > gamma,
/// bad_token(i, token) (must throw) for an id outside [0, V) before the cut. Returns how
/// many are kept: all, or up to and including the first stop token or the first position
/// where the policy's continue_drafting(1.0, drafted) ends drafting (ids after the cut are
/// never read).
template <class TooMany, class BadToken>
std::size_t keep_proposals(std::span<const token_id> tokens, std::size_t proposed,
                           std::size_t gamma, std::size_t vocab_size, const StopConditions& stops,
                           const AnyGammaPolicy& policy, TooMany&& too_many, BadToken&& bad_token) {
  if (proposed > gamma) too_many();
  for (std::size_t i = 0; i < proposed; ++i) {
    const token_id token = tokens[i];
    if (token < 0 || static_cast<std::size_t>(token) >= vocab_size) bad_token(i, token);
    if (stops.is_stop_token(token) || (i + 1 < proposed && !policy.continue_drafting(1.0, i + 1))) {
      return i + 1;
    }
  }
  return proposed;
}

/// Drafts with a ProposalDrafter: one propose() call for up to `gamma` tokens after
/// `sequence` (the context), which keeps the kept proposals appended; returns how many.
/// Errors name the draft row (StepChecks): a model that throws, too many tokens, an id
/// outside [0, V).
template <class Drafter>
std::size_t propose(Drafter& drafter, std::vector<token_id>& sequence, std::size_t gamma,
                    const AnyGammaPolicy& policy, const StopConditions& stops,
                    const StepChecks& checks, std::size_t& calls) {
  const std::size_t base = sequence.size();
  sequence.resize(base + gamma);
  const std::span<const token_id> context(sequence.data(), base);
  const std::span<token_id> out(sequence.data() + base, gamma);
  const auto proposed = static_cast<std::size_t>(checks.call_model(
      "draft", 0, [&]() -> std::size_t { return drafter.propose(context, out); }));
  calls = 1;
  const std::size_t kept = keep_proposals(
      out, proposed, gamma, checks.vocab_size(), stops, policy,
      [&] {
        checks.fail(errc::invalid_size, checks.describe("draft", 0) + ": the drafter proposed " +
                                            std::to_string(proposed) + " tokens, more than the " +
                                            std::to_string(gamma) + " asked for");
      },
      [&](std::size_t i, token_id token) {
        checks.fail(errc::invalid_token, checks.describe("draft", i) + ": proposed token " +
                                             std::to_string(token) + " is outside [0, " +
                                             std::to_string(checks.vocab_size()) + ")");
      });
  sequence.resize(base + kept);
  return kept;
}

/// One step's drafted q rows (T is the target's scalar type) and the draws from them.
template <class T>
class DraftStage {
 public:
  /// How the stage keeps rows: copies (dense), the model's own rows (in place), survivors
  /// of `width` (top-k), or none (greedy and proposals).
  enum class keeping { none, copies, in_place, survivors };

  /// Room for `gamma` rows of V entries kept as `how`.
  void resize(std::size_t gamma, std::size_t vocab_size, keeping how, std::size_t width) {
    vocab_size_ = vocab_size;
    if (how == keeping::survivors) {
      survivors_.resize(gamma, width);
      scratch_.resize(vocab_size);
      return;
    }
    if (how == keeping::none) return;
    if (how == keeping::copies) copies_.resize(gamma * vocab_size);
    scales_.resize(gamma);
    row_at_.resize(gamma);
  }

  /// Drafts up to `gamma` tokens from a LanguageModel draft, appending them to `sequence`
  /// (context + x_1..x_{i-1} is what the model sees); returns how many. `in_place`: the
  /// draft's rows outlive the step (stable_rows) and have the scalar type T.
  template <bool in_place, class Model, class G>
  std::size_t draft(Model& model, std::vector<token_id>& sequence, std::size_t gamma, G& g,
                    const AnyGammaPolicy& policy, const StopConditions& stops,
                    Standardizer<T>& standardizer, const StepChecks& checks, std::size_t& calls) {
    const SamplingOptions& sampling = standardizer.options();
    const bool want_top = policy.needs_top_probability();
    const bool sparse = standardizer.sparse_for(vocab_size_);
    for (std::size_t i = 0; i < gamma; ++i) {
      const std::span<const token_id> prefix(sequence);
      auto&& returned = checks.call_model(
          "draft", i, [&]() -> decltype(auto) { return model.next_token_probabilities(prefix); });
      const auto row = as_span(returned);
      ++calls;
      token_id drafted = 0;
      double top_probability = 0.0;
      if (sampling.identity()) {
        checks.check_size(row, "draft", i);
        drafted = draw_identity<in_place>(row, i, g, want_top, top_probability, checks);
      } else if (sampling.greedy()) {
        checks.check_size(row, "draft", i);
        if (checks.validate_rows()) {
          const std::size_t best = detail::screened_argmax(row.data(), row.size());
          if (best == detail::no_index) checks.reject_greedy_row(row, "draft", i);
          drafted = static_cast<token_id>(best);
        } else {
          drafted = argmax(row);
        }
        top_probability = static_cast<double>(row[static_cast<std::size_t>(drafted)]);
      } else if (sparse) {
        const std::size_t count = survivors_.load(row, i, standardizer, std::span<T>(scratch_),
                                                  checks, "draft", top_probability);
        const double u = uniform01<double>(g);
        // No survivor (a row without positive mass, only without validation): its argmax.
        drafted = static_cast<token_id>(count == 0 ? detail::row_argmax(row.data(), row.size())
                                                   : detail::sparse_draw(survivors_[i], u, 0));
      } else {
        const std::span<T> q(copies_.data() + i * vocab_size_, vocab_size_);
        // Top-p alone at T = 1: the nucleus is written by the draw's pass, as it sums
        // each block (one pass over the copy instead of a write, then a read).
        detail::nucleus_keep_hook<typename decltype(row)::value_type, T> keep;
        top_probability = standardize_checked(standardizer, row, q, checks, "draft", i, &keep);
        scales_[i] = 1.0;
        row_at_[i] = q.data();
        drafted = keep.out == nullptr
                      ? sample_from_row(std::span<const T>(q), g)
                      : detail::draw_from_target(std::span<const T>(q), uniform01<double>(g), keep);
      }
      sequence.push_back(drafted);
      if (stops.is_stop_token(drafted)) return i + 1;
      if (i + 1 < gamma && !policy.continue_drafting(top_probability, i + 1)) return i + 1;
    }
    return gamma;
  }

  /// q_i(x) of a dense row (copied, in place or standardized).
  [[nodiscard]] double q(std::size_t i, std::size_t x) const noexcept {
    return static_cast<double>(row_at_[i][x]) * scales_[i];
  }
  /// Dense row i as stored (q_i = scale(i) * row_at(i)).
  [[nodiscard]] const T* row_at(std::size_t i) const noexcept { return row_at_[i]; }
  [[nodiscard]] double scale(std::size_t i) const noexcept { return scales_[i]; }
  /// Row i's survivors (top-k).
  [[nodiscard]] detail::sparse_row<T> survivors(std::size_t i) const noexcept {
    return survivors_[i];
  }

 private:
  // What draw_identity's pass does with each block of the row before summing it: copy it
  // (unless in place), screen it, take its maximum. A named type rather than a lambda in
  // draw_identity, so that the pass is compiled once per row form, not once per generator.
  template <bool in_place, class U, bool screened, bool with_maximum>
  struct identity_pass_hook {
    const U* row;
    T* copy;
    detail::sign_screen<U>* screen;
    detail::lane_sum<U>* raw_sum;
    detail::row_maximum<U>* maximum;

    SPECDEC_KERNEL_INLINE void operator()(std::size_t first, std::size_t count) const noexcept {
      const U* in = row + first;
      if constexpr (!in_place) {
        for (std::size_t j = 0; j < count; ++j) copy[first + j] = static_cast<T>(in[j]);
      }
      if constexpr (screened) {
        screen->add(in, count);
        if constexpr (!std::is_same_v<U, T>) raw_sum->add(in, count);
      }
      if constexpr (with_maximum) maximum->add(in, count);
    }
  };

  // A draft token from a row at T = 1 without truncation, in ONE pass over the row (see the
  // header comment); then one draw walks one superblock of the mass table.
  template <bool in_place, class U, class G>
  token_id draw_identity(std::span<const U> row, std::size_t i, G& g, bool want_top,
                         double& top_probability, const StepChecks& checks) {
    static_assert(!in_place || std::is_same_v<U, T>);
    [[maybe_unused]] T* copy = nullptr;
    const T* q = nullptr;
    if constexpr (in_place) {
      q = row.data();
    } else {
      copy = copies_.data() + i * vocab_size_;
      q = copy;
    }
    row_at_[i] = q;
    const detail::row_source<T> source{q, vocab_size_};
    // The sum is the table's total (entries >= 0 once the screen passed), unless the row is
    // converted to another type: then the row's own sum, as the validator computes it.
    constexpr bool converted = !std::is_same_v<U, T>;
    detail::sign_screen<U> screen;
    detail::lane_sum<U> raw_sum;
    detail::row_maximum<U> maximum;
    detail::mass_table table;
    const auto pass = [&](auto screened, auto with_maximum) {
      if constexpr (in_place && !decltype(screened)::value && !decltype(with_maximum)::value) {
        detail::build_mass_table(source, table);  // nothing to fuse
      } else {
        identity_pass_hook<in_place, U, decltype(screened)::value, decltype(with_maximum)::value>
            hook{row.data(), copy, &screen, &raw_sum, &maximum};
        detail::build_mass_table(source, table, hook);
      }
    };
    if (checks.validate_rows()) {
      if (want_top) {
        pass(std::true_type{}, std::true_type{});
      } else {
        pass(std::true_type{}, std::false_type{});
      }
      const double total = converted ? raw_sum.value() : table.total;
      // The table sums the copy (T), the raw sum sums the row (U).
      using summed = std::conditional_t<converted, U, T>;
      if (!detail::plausible_total<summed>(screen.passed(), total, default_sum_tolerance<U>)) {
        checks.reject_probability_row(row, "draft", i);
      }
    } else if (want_top) {
      pass(std::false_type{}, std::true_type{});
    } else {
      pass(std::false_type{}, std::false_type{});
    }
    const double u = uniform01<double>(g);
    double scale = 1.0;
    std::size_t index = detail::no_index;
    if (table.drawable()) {
      scale = 1.0 / table.total;
      index = detail::draw_from_table(source, table, u);
    }
    // No positive finite mass (only without validation): the argmax, as sample_from_row.
    if (index == detail::no_index) index = detail::row_argmax(q, vocab_size_);
    scales_[i] = scale;
    top_probability = want_top ? static_cast<double>(maximum.value()) * scale : 1.0;
    return static_cast<token_id>(index);
  }

  std::size_t vocab_size_ = 0;
  std::vector<T> copies_;         // q_1..q_gamma up to a factor (scales_)
  std::vector<double> scales_;    // q_i = scales_[i] * row_at_[i]
  std::vector<const T*> row_at_;  // in copies_, or the model's own row (in place)
  SurvivorRows<T> survivors_;     // top-k
  std::vector<T> scratch_;        // top-k: V entries, apply_sparse's scratch
};

// draw_identity's fused passes for float and double rows (specdec/kernel_instances.hpp).
#define SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, in_place, U, screened, with_maximum) \
  prefix template void detail::build_mass_table_dispatch<                           \
      detail::row_source<T>,                                                        \
      DraftStage<T>::identity_pass_hook<in_place, U, screened, with_maximum>>(      \
      const detail::row_source<T>&, detail::mass_table&,                            \
      DraftStage<T>::identity_pass_hook<in_place, U, screened, with_maximum>&) noexcept;
#define SPECDEC_DRAFT_PASS_COPY_INSTANCES(prefix, T, U)          \
  SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, false, U, false, false) \
  SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, false, U, false, true)  \
  SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, false, U, true, false)  \
  SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, false, U, true, true)
#define SPECDEC_DRAFT_PASS_INSTANCES_OF(prefix, T)             \
  SPECDEC_DRAFT_PASS_COPY_INSTANCES(prefix, T, float)          \
  SPECDEC_DRAFT_PASS_COPY_INSTANCES(prefix, T, double)         \
  SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, true, T, false, true) \
  SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, true, T, true, false) \
  SPECDEC_DRAFT_PASS_INSTANCE(prefix, T, true, T, true, true)
#define SPECDEC_DRAFT_STAGE_INSTANCES(prefix) \
  SPECDEC_FOR_ROW_TYPES(SPECDEC_DRAFT_PASS_INSTANCES_OF, prefix)
SPECDEC_DECLARE_KERNEL_INSTANCES(SPECDEC_DRAFT_STAGE_INSTANCES)

}  // namespace specdec
