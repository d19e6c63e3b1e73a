// specdec — the verify stage of a decoding step: Algorithm 1's decisions
// (detail::accept_drafts_with for model drafts, accept_proposals_with for proposals: the loops
// of verify_speculative and verify_speculative_proposals) and the one residual or bonus draw,
// with the step's other reads of whole target rows fused into them; exact match for greedy.
//
// Three row forms, one rule:
//  - verify_dense: dense rows (the model's own in place, or the score stage's). Accepted rows
//    p_1..p_n are read whole only for beta (collect_beta) and validation (in-place rows), in
//    one pass each; p_{n+1} in the residual or bonus draw's pass, which also gives beta_{n+1}
//    (= sum p - residual mass) and the row's screen. Rows after it are never read.
//  - verify_survivors: rows truncated by top-k, kept as their survivors; shared with
//    BatchVerifier (batch_verification.hpp).
//  - verify_greedy_rows: argmax scans until the first mismatch, validation inside them.
// `load_through(i)` makes rows 0..i readable (the score stage loads lazily) and is called
// before any read of row i. The per-row callbacks are function_refs, not template
// parameters, so that each kernel is compiled once per scalar type and generator rather
// than once per decoder type (detail/function_ref.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/block_verification.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/decoder_kernels.hpp"
#include "specdec/detail/function_ref.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/detail/sparse_rows.hpp"
#include "specdec/draft_stage.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/step_checks.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace specdec {

/// What a step's verification decided: n accepted drafts, then t, and beta (collect_beta).
struct StepVerdict {
  std::size_t accepted = 0;
  token_id token = 0;
  token_source source = token_source::bonus;
  bool fallback = false;           ///< a correction drawn from p: zero residual mass
  double beta_sum = 0.0;           ///< beta_1..beta_{min(n+1, drafted)} (collect_beta)
  std::size_t beta_positions = 0;  ///< how many positions beta_sum covers (collect_beta)
};

/// Row i's survivors (rows truncated by top-k), loading them when first asked.
template <class T>
using survivor_rows = detail::function_ref<detail::sparse_row<T>(std::size_t)>;

/// The rules of a step's verification (DecoderOptions' lenience, collect_beta).
struct VerifyRules {
  double lenience = 1.0;
  bool collect_beta = true;
};

/// Greedy verification over dense rows: exact match (verify_greedy), validated inside its
/// argmax scans (validate_rows). Beta with one-hot p and q: 1 where x_i matched, else 0.
template <class T>
StepVerdict verify_greedy_rows(std::span<const token_id> drafts, RowsView<const T> target_rows,
                               const VerifyRules& rules, const StepChecks& checks,
                               detail::row_loader load_through) {
  load_through(drafts.size());  // verify_greedy takes the rows as one view
  VerificationResult verdict;
  if (checks.validate_rows()) {
    std::size_t bad_row = detail::no_index;
    verdict = detail::verify_greedy_screened(drafts, target_rows, bad_row);
    if (bad_row != detail::no_index) {
      checks.reject_greedy_row(std::span<const T>(target_rows.row(bad_row)), "target", bad_row);
    }
  } else {
    verdict = verify_greedy(drafts, target_rows);
  }
  StepVerdict out{verdict.accepted, verdict.token, verdict.source, false, 0.0, 0};
  if (rules.collect_beta) {
    out.beta_positions = std::min(out.accepted + 1, drafts.size());
    out.beta_sum = static_cast<double>(out.accepted);
  }
  return out;
}

/// Algorithm 1 over dense target rows; q from the draft stage (model_drafts), else one-hot
/// on each proposal. `screen`: the rows are the model's own and not yet validated; each row
/// the step reads is then screened in the pass that reads it (p_1..p_n in their beta pass or
/// a pass of their own, p_{n+1} in the draw's pass), and only those rows. With model drafts,
/// rows with a view in `nucleus` are read through it (the score stage keeps views for model
/// drafts only: proposals never consult them).
template <bool model_drafts, class T, class G>
StepVerdict verify_dense(std::span<const token_id> drafts, RowsView<const T> target_rows,
                         const DraftStage<T>& q, bool screen, const VerifyRules& rules,
                         const StepChecks& checks, G& g, detail::row_loader load_through,
                         nucleus_rows<T> nucleus = {}) {
  const std::size_t drafted = drafts.size();
  const std::size_t vocab_size = target_rows.cols();
  const double lenience = rules.lenience;
  // Row i's view, row i loaded (model drafts only).
  const auto view_of = [&](std::size_t i) -> const detail::nucleus_view<T>* {
    if constexpr (model_drafts) return nucleus.at(i);
    static_cast<void>(i);
    return nullptr;
  };
  const auto p_at = [&](std::size_t i, std::size_t x) {
    load_through(i);
    const detail::nucleus_view<T>* view = view_of(i);
    return static_cast<double>(view != nullptr ? view->at(x) : target_rows(i, x));
  };
  // Unchecked entries: in-place rows are validated after the decisions (see above).
  std::size_t n = 0;
  if constexpr (model_drafts) {
    n = detail::accept_drafts_with<false>(
        drafts, p_at, [&q](std::size_t i, std::size_t x) { return q.q(i, x); }, g, lenience);
  } else {
    n = detail::accept_proposals_with<false>(drafts, p_at, g, lenience);
  }
  load_through(n);  // the row of the final draw (rows before it were read by the decisions)
  const bool beta = rules.collect_beta;
  double beta_sum = 0.0;
  // The whole-row reads of accepted positions: beta_i (fused with the screen), else the
  // screen alone.
  for (std::size_t i = 0; i < n; ++i) {
    if (const detail::nucleus_view<T>* view = view_of(i)) {  // validated when loaded
      if (beta) {
        beta_sum += detail::overlap_mass_nucleus(*view, q.row_at(i), static_cast<T>(q.scale(i)),
                                                 vocab_size);
      }
      continue;
    }
    const std::span<const T> p(target_rows.row(i));
    if (beta) {
      if constexpr (model_drafts) {
        detail::row_screen<T> p_screen;
        const auto factor = static_cast<T>(q.scale(i));
        if (screen) {
          beta_sum +=
              detail::overlap_mass<true>(p.data(), q.row_at(i), factor, vocab_size, p_screen);
          checks.check_screen(p_screen, p, "target", i);
        } else {
          beta_sum +=
              detail::overlap_mass<false>(p.data(), q.row_at(i), factor, vocab_size, p_screen);
        }
        continue;
      } else {
        beta_sum += static_cast<double>(p[static_cast<std::size_t>(drafts[i])]);
      }
    }
    if (screen &&
        !detail::plausible_probability_row(p.data(), vocab_size, default_sum_tolerance<T>)) {
      checks.reject_probability_row(p, "target", i);
    }
  }
  // The one draw: from the residual at position n + 1, or the bonus token from p_{gamma+1}.
  const double u = uniform01<double>(g);
  StepVerdict out;
  out.accepted = n;
  if (const detail::nucleus_view<T>* view = view_of(n)) {  // validated when loaded
    if (n < drafted) {
      const std::span<const T> c(q.row_at(n), vocab_size);
      const auto factor = static_cast<T>(lenience * q.scale(n));
      detail::residual_outcome draw{};
      if (beta && lenience == 1.0) {  // beta_{n+1} = sum p - the residual's mass
        detail::row_screen<T> p_screen;
        draw = detail::residual_draw_nucleus(*view, vocab_size, c, factor, u,
                                             detail::nucleus_screen_hook<T>{&p_screen, *view});
        beta_sum += p_screen.total() - draw.mass;
      } else {
        draw = detail::residual_draw_nucleus(*view, vocab_size, c, factor, u);
        if (beta) {
          beta_sum += detail::overlap_mass_nucleus(*view, q.row_at(n), static_cast<T>(q.scale(n)),
                                                   vocab_size);
        }
      }
      out.token = draw.token;
      out.source = token_source::correction;
      out.fallback = draw.fallback;
    } else {
      out.token = detail::draw_from_nucleus(*view, vocab_size, u);
      out.source = token_source::bonus;
    }
    if (beta) {
      out.beta_positions = std::min(n + 1, drafted);
      out.beta_sum = beta_sum;
    }
    return out;
  }
  const std::span<const T> p(target_rows.row(n));
  detail::row_screen<T> p_screen;
  detail::row_screen_hook<T> screen_block{&p_screen, p.data()};
  if (n < drafted) {
    detail::residual_outcome draw{};
    if constexpr (model_drafts) {
      // beta_{n+1} = sum min(p, q) = sum p - sum max(0, p - q): from the residual's pass.
      const bool sum_p = screen || (beta && lenience == 1.0);
      const std::span<const T> c(q.row_at(n), vocab_size);
      const auto factor = static_cast<T>(lenience * q.scale(n));
      draw = sum_p ? detail::residual_draw(p, c, factor, u, screen_block)
                   : detail::residual_draw(p, c, factor, u);
      if (beta) {
        if (lenience == 1.0) {
          beta_sum += p_screen.total() - draw.mass;
        } else {  // a lenient residual's mass is not 1 - beta: a pass of its own
          detail::row_screen<T> unused;
          beta_sum += detail::overlap_mass<false>(p.data(), q.row_at(n), static_cast<T>(q.scale(n)),
                                                  vocab_size, unused);
        }
      }
    } else {
      const auto x = static_cast<std::size_t>(drafts[n]);
      draw = screen ? detail::residual_one_hot_draw(p, x, lenience, u, screen_block)
                    : detail::residual_one_hot_draw(p, x, lenience, u);
      if (beta) beta_sum += static_cast<double>(p[x]);
    }
    if (screen) checks.check_screen(p_screen, p, "target", n);
    out.token = draw.token;
    out.source = token_source::correction;
    out.fallback = draw.fallback;
  } else {
    out.token =
        screen ? detail::draw_from_target(p, u, screen_block) : detail::draw_from_target(p, u);
    if (screen) checks.check_screen(p_screen, p, "target", n);
    out.source = token_source::bonus;
  }
  if (beta) {
    out.beta_positions = std::min(n + 1, drafted);
    out.beta_sum = beta_sum;
  }
  return out;
}

/// Block verification (block_verification.hpp) over dense target rows with model drafts
/// from the draft stage: rho from the drafted entries (every row's, loaded through
/// load_through), then the scan from gamma down; row pair i < gamma is read once, in the pass
/// that builds the mass table of max(0, rho_i p_{i+1} - q_{i+1}) (Z_{i+1}, screened there
/// when `screen`), which the residual draw walks if the scan stops at i. Accepted rows are
/// read whole only for beta and validation, as in verify_dense; beta_{n+1} takes a pass of
/// its own (the block residual's mass is not 1 - beta). Rows with a view in `nucleus` are
/// read through it.
template <class T, class G>
StepVerdict verify_dense_block(std::span<const token_id> drafts, RowsView<const T> target_rows,
                               const DraftStage<T>& q, bool screen, const VerifyRules& rules,
                               const StepChecks& checks, G& g, detail::row_loader load_through,
                               nucleus_rows<T> nucleus = {}) {
  const std::size_t drafted = drafts.size();
  const std::size_t vocab_size = target_rows.cols();
  // p_i(x), row i loaded.
  const auto p_at = [&](std::size_t i, std::size_t x) {
    const detail::nucleus_view<T>* view = nucleus.at(i);
    return static_cast<double>(view != nullptr ? view->at(x) : target_rows(i, x));
  };
  // A draw from p_i (a bonus token, or a fallback), row i loaded and, unless read through a
  // view, screened when `screened`.
  detail::row_screen<T> p_screen;
  const auto draw_from_p = [&](std::size_t i, double u, bool screened) {
    if (const detail::nucleus_view<T>* view = nucleus.at(i)) {
      return detail::draw_from_nucleus(*view, vocab_size, u);
    }
    const std::span<const T> p = target_rows.row(i);
    if (!screened) return detail::draw_from_target(p, u);
    const token_id token =
        detail::draw_from_target(p, u, detail::row_screen_hook<T>{&p_screen, p.data()});
    checks.check_screen(p_screen, p, "target", i);
    return token;
  };
  // beta_i = sum min(p_i, q_i), row i loaded; with `screened` (rows read in place) the
  // target row is screened in the same pass.
  const auto overlap = [&](std::size_t i, bool screened) {
    const auto factor = static_cast<T>(q.scale(i));
    if (const detail::nucleus_view<T>* view = nucleus.at(i)) {
      return detail::overlap_mass_nucleus(*view, q.row_at(i), factor, vocab_size);
    }
    const std::span<const T> row(target_rows.row(i));
    detail::row_screen<T> row_screen;
    if (!screened) {
      return detail::overlap_mass<false>(row.data(), q.row_at(i), factor, vocab_size, row_screen);
    }
    const double mass =
        detail::overlap_mass<true>(row.data(), q.row_at(i), factor, vocab_size, row_screen);
    checks.check_screen(row_screen, row, "target", i);
    return mass;
  };
  detail::prefix_ratios rho(drafted);
  rho[0] = 1.0;
  for (std::size_t i = 1; i <= drafted; ++i) {
    if (rho[i - 1] == 0.0) {  // stays 0 (a draft p rules out): later rows are not read
      rho[i] = 0.0;
      continue;
    }
    load_through(i - 1);
    const auto x = static_cast<std::size_t>(drafts[i - 1]);
    rho[i] = detail::next_prefix_ratio(rho[i - 1], p_at(i - 1, x), q.q(i - 1, x));
  }
  StepVerdict out;
  std::size_t n = drafted;
  if (drafted > 0 && uniform01<double>(g) < rho[drafted]) {  // h_gamma = rho_gamma
    load_through(drafted);
    const double u = uniform01<double>(g);
    out.token = draw_from_p(drafted, u, screen);
    out.source = token_source::bonus;
  } else {
    for (std::size_t i = drafted; i-- > 0;) {
      if (i > 0 && rho[i] == 0.0) {  // Z = 0, so h_i = 0: the row pair is not read
        (void)uniform01<double>(g);
        continue;
      }
      // The decision's uniform first: at or above the bound on h_i the pair is not read
      // (detail::block_weight_bound; rows the scan does not read are not validated either).
      const double decision = i > 0 ? uniform01<double>(g) : 0.0;
      if (i > 0) {
        const auto x = static_cast<std::size_t>(drafts[i]);
        const double bound = detail::block_weight_bound<T>(rho[i], p_at(i, x), q.q(i, x));
        if (!(decision < bound)) continue;
      }
      // The mass table of max(0, rho_i p_{i+1} - q_{i+1}), then, if the scan stops here, the
      // residual's draw (a fallback from p when its mass is 0).
      const auto residual = [&](const auto& source, auto&& build) {
        detail::mass_table table;
        build(table);
        if (i > 0 && !(decision < detail::block_weight(table.total, rho[i]))) return false;
        n = i;
        const double u = uniform01<double>(g);
        const std::size_t index =
            table.drawable() ? detail::draw_from_table(source, table, u) : detail::no_index;
        out.fallback = index == detail::no_index;
        out.token = out.fallback ? draw_from_p(i, u, false) : static_cast<token_id>(index);
        out.source = token_source::correction;
        return true;
      };
      const auto rho_i = static_cast<T>(rho[i]);
      const auto q_scale = static_cast<T>(q.scale(i));
      bool stopped = false;
      if (const detail::nucleus_view<T>* view = nucleus.at(i)) {
        const detail::nucleus_scaled_difference_source<T> source{*view, q.row_at(i), vocab_size,
                                                                 rho_i, q_scale};
        stopped = residual(
            source, [&](detail::mass_table& table) { detail::build_mass_table(source, table); });
      } else {
        const std::span<const T> p = target_rows.row(i);
        const detail::scaled_difference_source<T> source{p.data(), q.row_at(i), vocab_size, rho_i,
                                                         q_scale};
        stopped = residual(source, [&](detail::mass_table& table) {
          if (screen) {
            p_screen = {};
            detail::build_mass_table(source, table,
                                     detail::row_screen_hook<T>{&p_screen, p.data()});
            checks.check_screen(p_screen, p, "target", i);
          } else {
            detail::build_mass_table(source, table);
          }
        });
      }
      if (stopped) break;
    }
    if (drafted == 0) {  // no drafts: the bonus token from p_1
      load_through(0);
      const double u = uniform01<double>(g);
      out.token = draw_from_p(0, u, screen);
      out.source = token_source::bonus;
      n = 0;
    }
  }
  out.accepted = n;
  // Accepted rows: beta (fused with their screen), else the screen alone; then beta_{n+1}.
  double beta_sum = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    if (rules.collect_beta) {
      beta_sum += overlap(i, screen);
    } else if (screen && nucleus.at(i) == nullptr) {
      const std::span<const T> row(target_rows.row(i));
      if (!detail::plausible_probability_row(row.data(), vocab_size, default_sum_tolerance<T>)) {
        checks.reject_probability_row(row, "target", i);
      }
    }
  }
  if (rules.collect_beta) {
    if (n < drafted) beta_sum += overlap(n, false);
    out.beta_positions = std::min(n + 1, drafted);
    out.beta_sum = beta_sum;
  }
  return out;
}

/// Block verification over rows truncated by top-k, kept as their survivors: rho from two
/// survivors' weights per position, Z and the residual over p's survivors
/// (sparse_scaled_residual into `residual`, top_k weights).
template <class T, class G>
StepVerdict verify_survivors_block(std::span<const token_id> drafts,
                                   std::type_identity_t<survivor_rows<T>> p,
                                   std::type_identity_t<survivor_rows<T>> q,
                                   const VerifyRules& rules, G& g, T* residual) {
  const std::size_t drafted = drafts.size();
  detail::prefix_ratios rho(drafted);
  rho[0] = 1.0;
  for (std::size_t i = 1; i <= drafted; ++i) {
    if (rho[i - 1] == 0.0) {  // stays 0: later rows are not loaded
      rho[i] = 0.0;
      continue;
    }
    const auto x = static_cast<std::size_t>(drafts[i - 1]);
    rho[i] = detail::next_prefix_ratio(rho[i - 1], static_cast<double>(p(i - 1).at(x)),
                                       static_cast<double>(q(i - 1).at(x)));
  }
  StepVerdict out;
  std::size_t n = drafted;
  if (drafted == 0 || uniform01<double>(g) < rho[drafted]) {
    out.token = static_cast<token_id>(detail::sparse_draw(p(drafted), uniform01<double>(g), 0));
    out.source = token_source::bonus;
  } else {
    for (std::size_t i = drafted; i-- > 0;) {
      if (i > 0 && rho[i] == 0.0) {  // Z = 0, so h_i = 0: the rows are not loaded
        (void)uniform01<double>(g);
        continue;
      }
      const auto p_row = p(i);
      const double z =
          detail::sparse_scaled_residual(p_row, q(i), static_cast<T>(rho[i]), residual);
      if (i > 0 && !(uniform01<double>(g) < detail::block_weight(z, rho[i]))) continue;
      n = i;
      const double u = uniform01<double>(g);
      const detail::indexed_mass_draw draw =
          detail::sparse_draw_index(p_row.count, u, [&](std::size_t k) { return residual[k]; });
      out.fallback = draw.index == detail::no_index;
      out.token = static_cast<token_id>(out.fallback ? detail::sparse_draw(p_row, u, 0)
                                                     : p_row.ids[draw.index]);
      out.source = token_source::correction;
      break;
    }
  }
  out.accepted = n;
  if (rules.collect_beta) {
    double beta_sum = 0.0;
    for (std::size_t i = 0; i < std::min(n + 1, drafted); ++i) {
      beta_sum += detail::sparse_overlap(p(i), q(i));
    }
    out.beta_positions = std::min(n + 1, drafted);
    out.beta_sum = beta_sum;
  }
  return out;
}

/// Algorithm 1 over rows truncated by top-k and kept as their survivors: the same decisions
/// (two survivors' weights per position), then the residual or bonus draw and beta over the
/// survivors. `p(i)` / `q(i)` give row i's survivors (loading them when first asked; q is
/// not called for proposals), `residual` holds top_k weights. Decisions, uniforms and draws
/// are those of the dense standardized rows (the survivors' weights are the dense row's
/// non-zero entries bitwise; the final draw sums the survivors in id order).
template <class T, class G>
StepVerdict verify_survivors(std::span<const token_id> drafts,
                             std::type_identity_t<survivor_rows<T>> p,
                             std::type_identity_t<survivor_rows<T>> q, bool proposals,
                             const VerifyRules& rules, G& g, T* residual) {
  const std::size_t drafted = drafts.size();
  const double lenience = rules.lenience;
  const auto p_entry = [&](std::size_t i, std::size_t x) {
    return static_cast<double>(p(i).at(x));
  };
  const std::size_t n =
      proposals ? detail::accept_proposals_with(drafts, p_entry, g, lenience)
                : detail::accept_drafts_with(
                      drafts, p_entry,
                      [&](std::size_t i, std::size_t x) { return static_cast<double>(q(i).at(x)); },
                      g, lenience);
  const bool beta = rules.collect_beta;
  const auto beta_at = [&](std::size_t i) {
    return proposals ? static_cast<double>(p(i).at(static_cast<std::size_t>(drafts[i])))
                     : detail::sparse_overlap(p(i), q(i));
  };
  double beta_sum = 0.0;
  if (beta) {
    for (std::size_t i = 0; i < n; ++i) beta_sum += beta_at(i);
  }
  const double u = uniform01<double>(g);
  StepVerdict out;
  out.accepted = n;
  if (n < drafted) {
    const detail::sparse_residual_outcome draw =
        proposals ? detail::sparse_residual_one_hot_draw(p(n), static_cast<std::size_t>(drafts[n]),
                                                         lenience, u)
                  : detail::sparse_residual_draw(p(n), q(n), static_cast<T>(lenience), u, residual);
    if (beta) beta_sum += beta_at(n);
    out.token = static_cast<token_id>(draw.token);
    out.source = token_source::correction;
    out.fallback = draw.fallback;
  } else {
    out.token = static_cast<token_id>(detail::sparse_draw(p(n), u, 0));
    out.source = token_source::bonus;
  }
  if (beta) {
    out.beta_positions = std::min(n + 1, drafted);
    out.beta_sum = beta_sum;
  }
  return out;
}

}  // namespace specdec
