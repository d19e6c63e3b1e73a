// specdec — constrained and biased sampling that stays exact: logit bias, banned tokens
// and a position-dependent TokenConstraint (token_constraint.hpp), applied alike to the
// target p and the draft q at every position.
//
// Speculative sampling reproduces the target's law exactly whatever the draft is, as long
// as every row the decoder uses is "the model's row after this prefix". A constraint whose
// mask depends on the tokens before it is a function of the prefix too, so the exact way
// to constrain a speculative decoder is to constrain the rows themselves:
//
//   ConstrainedSampling<C> rules(vocab, constraint, bias);   // one per generation
//   rules.start(prompt);
//   auto target = rules.target(target_model);                 // ConstrainedModel adaptors
//   auto draft = rules.draft(draft_model);
//   SpeculativeDecoder decoder(target, draft, options);       // temperature, top-k, ...
//   decoder.generate(prompt, n, seed);
//
// Both adaptors share `rules`, which walks ONE constraint along every prefix the decoder
// asks about: the draft's positions as they are drafted, the target's gamma + 1 checks of
// the same prefixes (the same states, so p_i and q_i get the same mask), a token tree's
// branches (restoring the state where a branch leaves the path walked last), and the next
// step's context after a rejection (restoring the state at the rejected position and
// advancing with the correction). The constraint's state is therefore always the one the
// emitted tokens reach: it cannot drift from the output, for chains, trees, greedy
// decoding, proposal drafters and every verification rule, because the decoder never
// sees an unconstrained row.
//
// The transform of a row, in the order engines apply logit processors:
//   1. logit bias: p(t) *= exp(bias(t))   (logits + bias, before softmax);
//   2. banned tokens and the constraint's mask: p(t) = 0 for every forbidden t;
//   3. renormalisation to sum 1;
// then the decoder's SamplingOptions: temperature, top-k, top-p, min-p (standardization
// acts on the biased, masked row: bias and masks come before temperature and truncation,
// as in Hugging Face's and vLLM's logits processors). Logits models: wrap the
// LogitsModel adapter (sampling.hpp); logits + b is p * exp(b) after the softmax.
//
// Positions a proposal drafter fills with a forbidden token: q is one-hot there and p is
// 0, so the token is rejected with probability 1 and nothing after it is used; the rows
// the target scores after a forbidden token (its state is undefined) are returned as the
// model gives them, only to keep the decoder's row checks meaningful.
//
// Dead ends: a target row that gives no probability to any allowed token is an error
// (errc::zero_mass, naming the generated position: the constrained target law does not
// exist there). A draft row in that situation is replaced by the uniform law over the
// allowed tokens: q may be any law the drafts are sampled from, so the output stays
// exact. A state that allows no token at all is an error for both models.
//
// Cost per row: one pass reading the model's row and writing the masked row with its sum
// (blocks of 64 tokens whose mask word is empty are written as zeros without reading the
// row), then one scaling pass over the (cache-resident) output; the bias list is applied
// per biased token. The mask of a state is computed once per step and position (a small
// cache keyed by depth, shared by the target and the draft). Nothing allocates once warm
// (reserve, or the first step of a given depth), for constraints that do not allocate.
// Not thread-safe: the adaptors share `rules` (SpeculativeDecoder calls its models one at
// a time). One ConstrainedSampling follows one sequence: a BatchDecoder needs one per
// sequence, which these adaptors do not route (left for the batch path).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/error.hpp"
#include "specdec/rows.hpp"
#include "specdec/token_constraint.hpp"

namespace specdec {

/// One token's logit bias: its logit gets `bias` added (its probability is multiplied by
/// exp(bias)) before temperature and truncation.
struct LogitBias {
  token_id token = 0;
  double bias = 0.0;  ///< in [-100, 100], or -infinity (the token is banned)
  friend constexpr bool operator==(const LogitBias&, const LogitBias&) = default;
};

/// Logit bias and banned tokens, applied alike to the target and the draft rows.
struct BiasOptions {
  std::vector<LogitBias> logit_bias;    ///< a token listed twice: the biases add up
  std::vector<token_id> banned_tokens;  ///< never emitted (probability 0)

  [[nodiscard]] bool empty() const noexcept { return logit_bias.empty() && banned_tokens.empty(); }

  /// Throws specdec::error naming the first bad entry: an id outside [0, vocab_size)
  /// (invalid_token) or a bias that is NaN, +infinity or outside [-100, 100] other than
  /// -infinity (invalid_option).
  void validate(std::size_t vocab_size) const {
    for (std::size_t i = 0; i < logit_bias.size(); ++i) {
      const LogitBias& entry = logit_bias[i];
      check_token(entry.token, "logit_bias", i, vocab_size);
      const double b = entry.bias;
      if (!(b == -std::numeric_limits<double>::infinity() || (b >= -100.0 && b <= 100.0))) {
        detail::throw_error(errc::invalid_option, "logit_bias[", i, "] (token ", entry.token,
                            "): bias ", b, " must be in [-100, 100] or -infinity");
      }
    }
    for (std::size_t i = 0; i < banned_tokens.size(); ++i) {
      check_token(banned_tokens[i], "banned_tokens", i, vocab_size);
    }
  }

 private:
  static void check_token(token_id t, const char* list, std::size_t i, std::size_t vocab_size) {
    if (t < 0 || static_cast<std::size_t>(t) >= vocab_size) {
      detail::throw_error(errc::invalid_token, list, "[", i, "]: token id ", t,
                          " is outside the vocabulary [0, ", vocab_size, ")");
    }
  }
};

/// Which model an adapter wraps: a draft row at a dead end becomes uniform over the
/// allowed tokens, a target row there is an error.
enum class model_role { target, draft };

namespace detail {

#if defined(__GNUC__) || defined(__clang__)
using mask_pack_f [[gnu::vector_size(16)]] = float;
using mask_pack_u [[gnu::vector_size(16)]] = std::uint32_t;
using mask_pack_i [[gnu::vector_size(16)]] = std::int32_t;

/// Lane masks of a 4-bit nibble of a token bitmask (lane j: all ones if bit j is set).
[[nodiscard]] inline mask_pack_u nibble_lanes(std::uint64_t nibble) noexcept {
  alignas(16) static constexpr std::uint32_t table[16][4] = {
      {0, 0, 0, 0},     {~0U, 0, 0, 0},     {0, ~0U, 0, 0},     {~0U, ~0U, 0, 0},
      {0, 0, ~0U, 0},   {~0U, 0, ~0U, 0},   {0, ~0U, ~0U, 0},   {~0U, ~0U, ~0U, 0},
      {0, 0, 0, ~0U},   {~0U, 0, 0, ~0U},   {0, ~0U, 0, ~0U},   {~0U, ~0U, 0, ~0U},
      {0, 0, ~0U, ~0U}, {~0U, 0, ~0U, ~0U}, {0, ~0U, ~0U, ~0U}, {~0U, ~0U, ~0U, ~0U}};
  mask_pack_u lanes;
  std::memcpy(&lanes, table[nibble], sizeof lanes);
  return lanes;
}
#endif

/// Sum (in double) of the entries of `row` whose bit is set in `words`; `bad` is set when
/// one of them is NaN or negative. Blocks whose word is 0 are not read.
template <ProbabilityScalar U>
[[nodiscard]] double masked_sum(std::span<const U> row, std::span<const std::uint64_t> words,
                                bool& bad) noexcept {
  const std::size_t full = row.size() / 64;
  double sum = 0.0;
  std::size_t w = 0;
#if defined(__GNUC__) || defined(__clang__)
  if constexpr (std::same_as<U, float>) {
    mask_pack_i flags{};
    for (; w < full; ++w) {
      const std::uint64_t bits = words[w];
      if (bits == 0) continue;
      const float* x = row.data() + 64 * w;
      mask_pack_f a0{}, a1{}, a2{}, a3{};
      const bool all = bits == ~std::uint64_t{0};  // no lane masks needed
      for (std::size_t k = 0; k < 16; k += 4) {
        mask_pack_f y0, y1, y2, y3;
        std::memcpy(&y0, x + 4 * k, sizeof y0);
        std::memcpy(&y1, x + 4 * k + 4, sizeof y1);
        std::memcpy(&y2, x + 4 * k + 8, sizeof y2);
        std::memcpy(&y3, x + 4 * k + 12, sizeof y3);
        if (!all) {
          y0 = reinterpret_cast<mask_pack_f>(reinterpret_cast<mask_pack_u>(y0) &
                                             nibble_lanes((bits >> (4 * k)) & 15U));
          y1 = reinterpret_cast<mask_pack_f>(reinterpret_cast<mask_pack_u>(y1) &
                                             nibble_lanes((bits >> (4 * k + 4)) & 15U));
          y2 = reinterpret_cast<mask_pack_f>(reinterpret_cast<mask_pack_u>(y2) &
                                             nibble_lanes((bits >> (4 * k + 8)) & 15U));
          y3 = reinterpret_cast<mask_pack_f>(reinterpret_cast<mask_pack_u>(y3) &
                                             nibble_lanes((bits >> (4 * k + 12)) & 15U));
        }
        // NaN and negative entries: !(y >= 0) (a masked-out lane is +0).
        flags |= ~(y0 >= 0.0F) | ~(y1 >= 0.0F) | ~(y2 >= 0.0F) | ~(y3 >= 0.0F);
        a0 += y0;
        a1 += y1;
        a2 += y2;
        a3 += y3;
      }
      const mask_pack_f a = (a0 + a1) + (a2 + a3);
      sum += static_cast<double>((a[0] + a[1]) + (a[2] + a[3]));
    }
    bad = bad || (flags[0] | flags[1] | flags[2] | flags[3]) != 0;
  }
#endif
  for (; w < words.size(); ++w) {
    const std::uint64_t bits = words[w];
    if (bits == 0) continue;
    const std::size_t first = 64 * w;
    const std::size_t last = std::min(first + 64, row.size());
    double s = 0.0;
    for (std::size_t i = first; i < last; ++i) {
      if (((bits >> (i - first)) & 1U) == 0) continue;
      const U x = row[i];
      bad = bad || !(x >= U(0));
      s += static_cast<double>(x);
    }
    sum += s;
  }
  return sum;
}

/// out[i] = row[i] * scale where bit i of `words` is set, else 0. `before` (empty, or one
/// word per block): the mask `out` was last written with; a block whose word is 0 there and
/// here is all zero already and is not written again.
template <ProbabilityScalar U, ProbabilityScalar T>
void masked_scale(std::span<const U> row, std::span<const std::uint64_t> words, double scale,
                  std::span<T> out, std::span<const std::uint64_t> before = {}) noexcept {
  const std::size_t full = row.size() / 64;
  std::size_t w = 0;
#if defined(__GNUC__) || defined(__clang__)
  if constexpr (std::same_as<U, float> && std::same_as<T, float>) {
    const auto s = static_cast<float>(scale);
    const mask_pack_f factor{s, s, s, s};
    for (; w < full; ++w) {
      const std::uint64_t bits = words[w];
      float* y = out.data() + 64 * w;
      if (bits == 0) {
        if (before.empty() || before[w] != 0) std::memset(y, 0, 64 * sizeof(float));
        continue;
      }
      const float* x = row.data() + 64 * w;
      if (bits == ~std::uint64_t{0}) {
        for (std::size_t k = 0; k < 16; ++k) {
          mask_pack_f v;
          std::memcpy(&v, x + 4 * k, sizeof v);
          v *= factor;
          std::memcpy(y + 4 * k, &v, sizeof v);
        }
        continue;
      }
      for (std::size_t k = 0; k < 16; ++k) {
        mask_pack_f v;
        std::memcpy(&v, x + 4 * k, sizeof v);
        v = reinterpret_cast<mask_pack_f>(reinterpret_cast<mask_pack_u>(v) &
                                          nibble_lanes((bits >> (4 * k)) & 15U)) *
            factor;
        std::memcpy(y + 4 * k, &v, sizeof v);
      }
    }
  }
#endif
  for (; w < words.size(); ++w) {
    const std::uint64_t bits = words[w];
    const std::size_t first = 64 * w;
    const std::size_t last = std::min(first + 64, row.size());
    for (std::size_t i = first; i < last; ++i) {
      const bool keep = ((bits >> (i - first)) & 1U) != 0;
      out[i] = keep ? static_cast<T>(static_cast<double>(row[i]) * scale) : T(0);
    }
  }
}

}  // namespace detail

template <class M, class C>
class ConstrainedModel;

namespace detail {

/// Broken walks that the exactness tests show they catch; the library uses `exact` only.
enum class constraint_walk : std::uint8_t {
  exact,
  no_rollback,            ///< the state is not restored where a context leaves the path
  advance_with_rejected,  ///< restored one token late: the rejected draft token is kept
  target_unmasked,        ///< target rows are not masked (the mask applied to q only)
};

/// The adapters' check that the model and the constraint share one vocabulary.
template <class Size>
void check_adapter_vocab(const char* adapter, model_role role, Size model_vocab,
                         std::size_t vocab) {
  if (static_cast<std::size_t>(model_vocab) != vocab) {
    throw_error(errc::vocab_mismatch, adapter, ": the ",
                role == model_role::target ? "target" : "draft", " model's vocab_size ",
                model_vocab, " differs from the constraint's ", vocab);
  }
}

struct constrained_sampling_access {
  template <class S>
  static void set_walk(S& sampling, constraint_walk walk) noexcept {
    sampling.walk_rule_ = walk;
  }
};

}  // namespace detail

/// The shared state of constrained sampling for one sequence: the constraint walked along
/// the prefixes the models are asked about, the logit bias and the banned tokens. See the
/// file comment. Make one, call start(prompt) before each generation, and wrap both
/// models with target() / draft().
template <TokenConstraint C = Unconstrained>
class ConstrainedSampling {
 public:
  using state_type = typename C::state_type;

  /// Throws specdec::error for bad bias options or vocab_size 0. The constraint's state as
  /// given is its start state: start() restores it.
  explicit ConstrainedSampling(std::size_t vocab_size, C constraint = C{}, BiasOptions bias = {},
                               std::size_t mask_cache_slots = 32)
      : vocab_(vocab_size),
        words_(mask_words(vocab_size)),
        constraint_(std::move(constraint)),
        bias_(std::move(bias)),
        slots_(std::max<std::size_t>(mask_cache_slots, 2)) {
    if (vocab_ == 0) {
      detail::throw_error(errc::invalid_size, "ConstrainedSampling: vocab_size must be positive");
    }
    bias_.validate(vocab_);
    initial_ = constraint_.state();
    allowed_.assign(words_, ~std::uint64_t{0});
    if (vocab_ % 64 != 0) allowed_.back() = (std::uint64_t{1} << (vocab_ % 64)) - 1;
    for (const token_id t : bias_.banned_tokens) mask_clear(allowed_, t);
    for (const LogitBias& b : bias_.logit_bias) {
      if (b.bias == -std::numeric_limits<double>::infinity()) mask_clear(allowed_, b.token);
    }
    // Merged bias list: one factor per token, banned ones dropped.
    for (const LogitBias& b : bias_.logit_bias) {
      if (!mask_test(allowed_, b.token)) continue;
      auto it = std::find_if(factors_.begin(), factors_.end(),
                             [&](const auto& f) { return f.first == b.token; });
      if (it == factors_.end()) {
        factors_.emplace_back(b.token, b.bias);
      } else {
        it->second += b.bias;
      }
    }
    for (auto& f : factors_) f.second = std::exp(std::clamp(f.second, -700.0, 700.0));
    std::sort(factors_.begin(), factors_.end());
    masks_.assign(slots_ * words_, 0);
    slot_depth_.assign(slots_, npos);
  }

  /// Starts a generation after `prompt`: the constraint goes back to its start state and
  /// applies to the tokens after the prompt. Every context the models are then asked
  /// about must begin with this prompt.
  void start(std::span<const token_id> prompt) {
    prompt_.assign(prompt.begin(), prompt.end());
    constraint_.restore(initial_);
    path_.clear();
    states_.assign(1, initial_);
    live_ = 0;
    std::fill(slot_depth_.begin(), slot_depth_.end(), npos);
    started_ = true;
  }

  /// Reserves the walk for `depth` generated tokens, so that steps do not allocate.
  void reserve(std::size_t depth) {
    path_.reserve(depth);
    states_.reserve(depth + 1);
  }

  /// Adapters for the two models (they hold references: `model` and this object must
  /// outlive them).
  template <LanguageModel M>
  [[nodiscard]] ConstrainedModel<M, C> target(M& model) {
    return ConstrainedModel<M, C>(model, *this, model_role::target);
  }
  template <LanguageModel M>
  [[nodiscard]] ConstrainedModel<M, C> draft(M& model) {
    return ConstrainedModel<M, C>(model, *this, model_role::draft);
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_; }
  [[nodiscard]] const BiasOptions& bias() const noexcept { return bias_; }
  [[nodiscard]] std::span<const token_id> prompt() const noexcept { return prompt_; }
  /// The constraint, in the state of the last prefix walked.
  [[nodiscard]] const C& constraint() const noexcept { return constraint_; }

  /// Walks the constraint to the end of `context` (which must begin with the prompt) and
  /// returns whether every generated token on the way was allowed. After it, constraint()
  /// is in the state `context` reaches (or the state before its first forbidden token).
  bool walk(std::span<const token_id> context) {
    if (!started_) {
      detail::throw_error(errc::invalid_option,
                          "ConstrainedSampling: start(prompt) must be called before the models "
                          "are asked for rows");
    }
    if (context.size() < prompt_.size() ||
        !std::equal(prompt_.begin(), prompt_.end(), context.begin())) {
      detail::throw_error(errc::invalid_option, "ConstrainedSampling: a context of ",
                          context.size(), " tokens does not begin with the prompt of ",
                          prompt_.size(), " tokens given to start()");
    }
    const auto generated = context.subspan(prompt_.size());
    const std::size_t common = static_cast<std::size_t>(
        std::mismatch(path_.begin(), path_.end(), generated.begin(), generated.end()).first -
        path_.begin());
    if (common < path_.size()) {
      path_.resize(common);
      for (std::size_t s = 0; s < slots_; ++s) {
        if (slot_depth_[s] != npos && slot_depth_[s] > common) slot_depth_[s] = npos;
      }
      if (live_ > common) {
        if (walk_rule_ == detail::constraint_walk::no_rollback) {
          states_.resize(common + 1);  // the constraint stays where the old path ended
        } else if (walk_rule_ == detail::constraint_walk::advance_with_rejected) {
          constraint_.restore(states_[common + 1]);
          states_.resize(common + 1);
        } else {
          states_.resize(common + 1);
          constraint_.restore(states_[common]);
        }
        live_ = common;
      }
    }
    try {
      for (std::size_t j = common; j < generated.size(); ++j) {
        const token_id t = generated[j];
        if (live_ == path_.size()) {
          const bool ok = t >= 0 && static_cast<std::size_t>(t) < vocab_ &&
                          mask_test(allowed_, t) && constraint_.advance(t);
          if (ok) {
            states_.push_back(constraint_.state());
            ++live_;
          }
        }
        path_.push_back(t);
      }
    } catch (...) {
      // A constraint (or an allocation) that threw mid-walk: back to the start, so that the
      // next walk replays the context from a consistent state.
      path_.clear();
      states_.assign(1, initial_);
      live_ = 0;
      constraint_.restore(initial_);
      std::fill(slot_depth_.begin(), slot_depth_.end(), npos);
      throw;
    }
    return live_ == path_.size();
  }

  /// The mask of the tokens allowed after `context` (constraint, banned tokens), or an
  /// empty span when a generated token of `context` was forbidden.
  std::span<const std::uint64_t> mask(std::span<const token_id> context) {
    if (!walk(context)) return {};
    const std::size_t depth = path_.size();
    const std::size_t slot = depth % slots_;
    std::span<std::uint64_t> words(masks_.data() + slot * words_, words_);
    if (slot_depth_[slot] != depth) {
      constraint_.allowed_tokens(words);
      for (std::size_t w = 0; w < words_; ++w) words[w] &= allowed_[w];
      slot_depth_[slot] = depth;
    }
    return words;
  }

  /// The constrained row after `context`: `row` (the model's, vocab_size() entries) with
  /// the bias and the mask applied, renormalised, into `out` (vocab_size() entries).
  /// `role` decides what a dead end does (see the file comment). Throws specdec::error
  /// naming the model, the generated position and the token for a bad entry.
  template <ProbabilityScalar U, ProbabilityScalar T>
  void apply(std::span<const token_id> context, std::span<const U> row, std::span<T> out,
             model_role role) {
    apply(context, row, out, role, false);
  }

  /// apply() where a target dead end writes an all-zero row instead of throwing (`zero_row`
  /// true): the batch adapter's way to fail that sequence alone (BatchDecoder validates rows
  /// by default and fails a sequence whose row has no mass, naming it).
  ///
  /// `written` (empty, or mask_words(V) words the caller keeps with `out`): the mask `out`
  /// was last written with, updated here. Blocks of 64 tokens that were zero and stay zero
  /// are then not written again (a grammar state allowing few tokens writes little). Start
  /// it with every bit set (nothing known about `out`).
  template <ProbabilityScalar U, ProbabilityScalar T>
  void apply(std::span<const token_id> context, std::span<const U> row, std::span<T> out,
             model_role role, bool zero_row, std::span<std::uint64_t> written = {}) {
    if (!written.empty() && written.size() != words_) {
      detail::throw_error(errc::invalid_size, "ConstrainedSampling::apply: ", written.size(),
                          " written-mask words, expected ", words_);
    }
    const auto remember = [&](std::span<const std::uint64_t> mask_words_written) {
      if (written.empty()) return;
      if (mask_words_written.empty()) {
        std::fill(written.begin(), written.end(), ~std::uint64_t{0});
      } else {
        std::copy(mask_words_written.begin(), mask_words_written.end(), written.begin());
      }
    };
    const char* who = role == model_role::target ? "target" : "draft";
    if (row.size() != vocab_ || out.size() != vocab_) {
      detail::throw_error(errc::invalid_size, "constrained ", who, " row: ", row.size(),
                          " entries, expected vocab_size ", vocab_);
    }
    if (role == model_role::target && walk_rule_ == detail::constraint_walk::target_unmasked) {
      std::copy(row.begin(), row.end(), out.begin());
      remember({});
      return;
    }
    const auto words = mask(context);
    const std::size_t position = context.size() - prompt_.size();
    if (words.empty()) {  // after a forbidden token: never used for an emitted token
      std::copy(row.begin(), row.end(), out.begin());
      remember({});
      return;
    }
    // Pass 1 reads the allowed entries (their sum, and whether one is NaN or negative);
    // pass 2 writes the row scaled by 1 / mass. Blocks of 64 forbidden tokens are not read.
    bool bad = false;
    const double sum = detail::masked_sum(row, words, bad);
    if (bad || !std::isfinite(sum)) report_bad_entry(row, words, who, position);
    // The bias, in double: a biased entry may exceed T's range before normalisation.
    double biased = sum;
    for (const auto& [t, factor] : factors_) {
      if (!mask_test(words, t)) continue;
      const auto x = static_cast<double>(row[static_cast<std::size_t>(t)]);
      biased += x * factor - x;
    }
    if (!(biased > 0.0)) {
      if (zero_row && role == model_role::target) {
        std::fill(out.begin(), out.end(), T(0));
        remember({});  // conservative
        return;
      }
      dead_end(words, out, who, position, role, context.size());
      remember(words);
      return;
    }
    if (!std::isfinite(biased)) {
      detail::throw_error(errc::invalid_probability, "constrained ", who,
                          " row at generated position ", position,
                          ": the logit bias makes the row's mass overflow");
    }
    const double scale = 1.0 / biased;
    detail::masked_scale(row, words, scale, out, std::span<const std::uint64_t>(written));
    remember(words);
    for (const auto& [t, factor] : factors_) {
      if (!mask_test(words, t)) continue;
      const auto i = static_cast<std::size_t>(t);
      out[i] = static_cast<T>(static_cast<double>(row[i]) * factor * scale);
    }
  }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  template <class U>
  [[noreturn]] void report_bad_entry(std::span<const U> row, std::span<const std::uint64_t> words,
                                     const char* who, std::size_t position) const {
    for (std::size_t i = 0; i < vocab_; ++i) {
      if (!mask_test(words, static_cast<token_id>(i))) continue;
      const U x = row[i];
      if (!(x >= U(0)) || !std::isfinite(static_cast<double>(x))) {
        detail::throw_error(errc::invalid_probability, "constrained ", who,
                            " row at generated position ", position, ", token ", i,
                            ": probability is ", static_cast<double>(x),
                            " (entries must be finite and >= 0)");
      }
    }
    detail::throw_error(errc::invalid_probability, "constrained ", who,
                        " row at generated position ", position,
                        ": the allowed entries sum to infinity");
  }

  template <class T>
  void dead_end(std::span<const std::uint64_t> words, std::span<T> out, const char* who,
                std::size_t position, model_role role, std::size_t context_size) const {
    std::size_t allowed = 0;
    for (const std::uint64_t w : words) allowed += static_cast<std::size_t>(std::popcount(w));
    if (allowed == 0) {
      detail::throw_error(errc::zero_mass, "constraint dead end at generated position ", position,
                          " (context of ", context_size,
                          " tokens): the constraint allows no token (after banned tokens)");
    }
    if (role == model_role::target) {
      detail::throw_error(errc::zero_mass, "constraint dead end at generated position ", position,
                          " (context of ", context_size, " tokens): the ", who,
                          " model gives probability 0 to all ", allowed,
                          " tokens the constraint allows");
    }
    const T u = static_cast<T>(1.0 / static_cast<double>(allowed));
    for (std::size_t i = 0; i < vocab_; ++i) {
      out[i] = mask_test(words, static_cast<token_id>(i)) ? u : T(0);
    }
  }

  std::size_t vocab_;
  std::size_t words_;
  C constraint_;
  BiasOptions bias_;
  std::size_t slots_;
  state_type initial_{};
  std::vector<std::uint64_t> allowed_;                // not banned
  std::vector<std::pair<token_id, double>> factors_;  // exp(bias), sorted by token
  std::vector<token_id> prompt_;
  std::vector<token_id> path_;        // generated tokens walked (after the prompt)
  std::vector<state_type> states_;    // states_[j]: after path_[0..j), j <= live_
  std::size_t live_ = 0;              // path_[0..live_) were allowed
  std::vector<std::uint64_t> masks_;  // slots_ cached masks
  std::vector<std::size_t> slot_depth_;
  bool started_ = false;
  detail::constraint_walk walk_rule_ = detail::constraint_walk::exact;
  friend struct detail::constrained_sampling_access;
};

/// A LanguageModel whose rows are the wrapped model's, constrained by a shared
/// ConstrainedSampling (see the file comment). Has score_draft / score_tree when the
/// model has them. Rows stay valid until the next call on the adapter.
template <class M, class C>
class ConstrainedModel {
  using model_row = decltype(std::declval<M&>().next_token_probabilities(
      std::declval<std::span<const token_id>>()));

 public:
  using scalar_type = probability_scalar_t<model_row>;

  ConstrainedModel(M& model, ConstrainedSampling<C>& rules, model_role role)
      : model_(&model), rules_(&rules), role_(role) {
    detail::check_adapter_vocab("ConstrainedModel", role, model.vocab_size(), rules.vocab_size());
    row_.resize(rules.vocab_size());
    row_written_.assign(mask_words(rules.vocab_size()), ~std::uint64_t{0});
  }

  [[nodiscard]] std::size_t vocab_size() const { return rules_->vocab_size(); }

  std::span<const scalar_type> next_token_probabilities(std::span<const token_id> context) {
    const auto& returned = model_->next_token_probabilities(context);
    rules_->apply(context, as_span(returned), std::span<scalar_type>(row_), role_, false,
                  std::span<std::uint64_t>(row_written_));
    return row_;
  }

  /// Row i: the constrained row after context + draft[0..i).
  RowsView<const scalar_type> score_draft(std::span<const token_id> context,
                                          std::span<const token_id> draft) requires
      HasDraftScoring<M> {
    const auto& scored = model_->score_draft(context, draft);
    const auto rows = as_rows(scored);
    prefix_.assign(context.begin(), context.end());
    return convert(rows, [&](std::size_t i) {
      if (i > 0) prefix_.push_back(draft[i - 1]);
    });
  }

  /// Row i: the constrained row after context + path(i) (root first).
  template <class Tree>
  requires requires(M& model, std::span<const token_id> context, const Tree& tree) {
    { model.score_tree(context, tree) } -> ProbabilityMatrix;
  }
  RowsView<const scalar_type> score_tree(std::span<const token_id> context, const Tree& tree) {
    const auto& scored = model_->score_tree(context, tree);
    const auto rows = as_rows(scored);
    prefix_.assign(context.begin(), context.end());
    return convert(rows, [&](std::size_t i) {
      prefix_.resize(context.size());  // the context is copied once, each node's path after it
      if (i > 0) tree.append_path(i, prefix_);
    });
  }

  [[nodiscard]] M& model() const noexcept { return *model_; }
  [[nodiscard]] model_role role() const noexcept { return role_; }

 private:
  template <class U, class Prefix>
  RowsView<const scalar_type> convert(RowsView<const U> rows, Prefix&& prefix_of) {
    const std::size_t words = mask_words(rules_->vocab_size());
    if (rows_.size() != rows.rows() * rows.cols()) {  // a new layout: nothing known of it
      rows_.resize(rows.rows() * rows.cols());
      rows_written_.assign(rows.rows() * words, ~std::uint64_t{0});
    }
    for (std::size_t i = 0; i < rows.rows(); ++i) {
      prefix_of(i);
      rules_->apply(std::span<const token_id>(prefix_), std::span<const U>(rows.row(i)),
                    std::span<scalar_type>(rows_.data() + i * rows.cols(), rows.cols()), role_,
                    false, std::span<std::uint64_t>(rows_written_.data() + i * words, words));
    }
    return {rows_.data(), rows.rows(), rows.cols()};
  }

  M* model_;
  ConstrainedSampling<C>* rules_;
  model_role role_;
  std::vector<scalar_type> row_;
  std::vector<scalar_type> rows_;
  std::vector<std::uint64_t> row_written_;   // the mask row_ was last written with
  std::vector<std::uint64_t> rows_written_;  // the same per row of rows_
  std::vector<token_id> prefix_;
};

template <class M, class C>
class BatchConstrainedModel;

/// Constrained sampling for the sequences of a BatchDecoder: one ConstrainedSampling per
/// sequence id, each with its own constraint, bias and banned tokens. start(id, prompt, ...)
/// before adding the sequence to the decoder (SequenceRequest::id, the same prompt); the
/// adapters from target() / draft() route every request of score_batch / draft_batch to its
/// sequence by id, and forget a sequence when the decoder releases it. The adapters always
/// offer score_batch and draft_batch (calling the model's own batched methods when it has
/// them, else its score_draft or one call per prefix), so that the decoder always names the
/// sequence. A target dead end gives that sequence an all-zero row: BatchDecoder (rows
/// validated, the default) fails that sequence alone with zero_mass and goes on with the
/// others.
template <TokenConstraint C = Unconstrained>
class BatchConstrainedSampling {
 public:
  explicit BatchConstrainedSampling(std::size_t vocab_size) : vocab_(vocab_size) {
    if (vocab_ == 0) {
      detail::throw_error(errc::invalid_size,
                          "BatchConstrainedSampling: vocab_size must be positive");
    }
  }

  /// Constrains sequence `id` after `prompt` (replacing what it had). Throws like
  /// ConstrainedSampling's constructor.
  void start(std::uint64_t id, std::span<const token_id> prompt, C constraint = C{},
             BiasOptions bias = {}) {
    const auto slot = sequences_.insert_or_assign(
        id,
        std::make_unique<ConstrainedSampling<C>>(vocab_, std::move(constraint), std::move(bias)));
    slot.first->second->start(prompt);
  }

  /// Forgets sequence `id` (the adapters call it when the decoder releases the sequence).
  void release(std::uint64_t id) { sequences_.erase(id); }

  /// The sequence's constrained sampling; throws errc::invalid_option for an id never
  /// started (or released).
  [[nodiscard]] ConstrainedSampling<C>& sequence(std::uint64_t id) {
    const auto found = sequences_.find(id);
    if (found == sequences_.end()) {
      detail::throw_error(errc::invalid_option, "BatchConstrainedSampling: sequence ", id,
                          " was not started (call start(id, prompt, ...) before adding it)");
    }
    return *found->second;
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_; }
  [[nodiscard]] std::size_t size() const noexcept { return sequences_.size(); }

  template <LanguageModel M>
  [[nodiscard]] BatchConstrainedModel<M, C> target(M& model) {
    return BatchConstrainedModel<M, C>(model, *this, model_role::target);
  }
  template <LanguageModel M>
  [[nodiscard]] BatchConstrainedModel<M, C> draft(M& model) {
    return BatchConstrainedModel<M, C>(model, *this, model_role::draft);
  }

 private:
  std::size_t vocab_;
  std::map<std::uint64_t, std::unique_ptr<ConstrainedSampling<C>>> sequences_;
};

/// A LanguageModel for BatchDecoder whose rows are the wrapped model's, constrained per
/// sequence by a shared BatchConstrainedSampling. Rows stay valid until the next call.
template <class M, class C>
class BatchConstrainedModel {
  using model_row = decltype(std::declval<M&>().next_token_probabilities(
      std::declval<std::span<const token_id>>()));

 public:
  using scalar_type = probability_scalar_t<model_row>;

  BatchConstrainedModel(M& model, BatchConstrainedSampling<C>& rules, model_role role)
      : model_(&model), rules_(&rules), role_(role) {
    detail::check_adapter_vocab("BatchConstrainedModel", role, model.vocab_size(),
                                rules.vocab_size());
  }

  [[nodiscard]] std::size_t vocab_size() const { return rules_->vocab_size(); }

  /// Not routable (no sequence id): throws errc::invalid_option. BatchDecoder calls
  /// score_batch and draft_batch instead.
  std::span<const scalar_type> next_token_probabilities(std::span<const token_id> /*context*/) {
    detail::throw_error(errc::invalid_option,
                        "BatchConstrainedModel: next_token_probabilities has no sequence id; "
                        "use it through BatchDecoder (score_batch, draft_batch) or use "
                        "ConstrainedSampling for one sequence");
  }

  /// For each request, the constrained rows of context + drafts[0..k), k = 0..drafts.size().
  template <class Requests>
  RowsView<const scalar_type> score_batch(const Requests& requests) {
    std::size_t total = 0;
    for (const auto& r : requests) total += r.drafts.size() + 1;
    rows_.resize(total * rules_->vocab_size());
    std::size_t at = 0;
    if constexpr (requires { model_->score_batch(requests); }) {
      const auto rows = checked_rows(model_->score_batch(requests), total, "score_batch");
      for (const auto& r : requests) {
        walk_prefixes(r, r.drafts.size(), [&](auto& rules) {
          put(rules, rows.row(at), at);
          ++at;
        });
      }
    } else {
      for (const auto& r : requests) {
        if constexpr (HasDraftScoring<M>) {
          const auto rows = checked_rows(model_->score_draft(r.context, r.drafts),
                                         r.drafts.size() + 1, "score_draft");
          std::size_t k = 0;
          walk_prefixes(r, r.drafts.size(), [&](auto& rules) { put(rules, rows.row(k++), at++); });
        } else {
          walk_prefixes(r, r.drafts.size(), [&](auto& rules) {
            put(rules, as_span(model_->next_token_probabilities(prefix_)), at++);
          });
        }
      }
    }
    return {rows_.data(), total, rules_->vocab_size()};
  }

  /// For each request, ONE constrained row: after context + drafts.
  template <class Requests>
  RowsView<const scalar_type> draft_batch(const Requests& requests) {
    const std::size_t count = std::ranges::size(requests);
    rows_.resize(count * rules_->vocab_size());
    std::size_t at = 0;
    if constexpr (requires { model_->draft_batch(requests); }) {
      const auto rows = checked_rows(model_->draft_batch(requests), count, "draft_batch");
      for (const auto& r : requests) {
        last_prefix(r, [&](auto& rules) { put(rules, rows.row(at), at); });
        ++at;
      }
    } else {
      for (const auto& r : requests) {
        last_prefix(r, [&](auto& rules) {
          put(rules, as_span(model_->next_token_probabilities(prefix_)), at);
        });
        ++at;
      }
    }
    return {rows_.data(), count, rules_->vocab_size()};
  }

  /// Forgets the sequence's constraint and forwards to a model that has release_sequence.
  template <std::same_as<std::uint64_t> Id>
  void release_sequence(Id id) {
    rules_->release(id);
    if constexpr (requires { model_->release_sequence(id); }) model_->release_sequence(id);
  }

  [[nodiscard]] M& model() const noexcept { return *model_; }

 private:
  template <class Scored>
  auto checked_rows(const Scored& scored, std::size_t expected, const char* call) const {
    const auto rows = as_rows(scored);
    if (rows.rows() != expected || rows.cols() != rules_->vocab_size()) {
      detail::throw_error(errc::invalid_size, "BatchConstrainedModel: the model's ", call,
                          " returned ", rows.rows(), " x ", rows.cols(), " entries, expected ",
                          expected, " x ", rules_->vocab_size());
    }
    return rows;
  }

  // Calls each(rules) with prefix_ = context + drafts[0..k) for k = 0..last, the prefix
  // grown one token at a time; the sequence is looked up once.
  template <class Request, class Each>
  void walk_prefixes(const Request& r, std::size_t last, Each&& each) {
    ConstrainedSampling<C>& rules = rules_->sequence(r.id);
    prefix_.assign(r.context.begin(), r.context.end());
    for (std::size_t k = 0; k <= last; ++k) {
      if (k > 0) prefix_.push_back(r.drafts[k - 1]);
      each(rules);
    }
  }

  // Calls each(rules) once, with prefix_ = context + drafts.
  template <class Request, class Each>
  void last_prefix(const Request& r, Each&& each) {
    ConstrainedSampling<C>& rules = rules_->sequence(r.id);
    prefix_.assign(r.context.begin(), r.context.end());
    prefix_.insert(prefix_.end(), r.drafts.begin(), r.drafts.end());
    each(rules);
  }

  // The constrained row after prefix_ into rows_ row `at`.
  template <class Row>
  void put(ConstrainedSampling<C>& rules, const Row& row, std::size_t at) {
    const std::size_t v = rules_->vocab_size();
    rules.apply(std::span<const token_id>(prefix_), std::span(row),
                std::span<scalar_type>(rows_.data() + at * v, v), role_, true);
  }

  M* model_;
  BatchConstrainedSampling<C>* rules_;
  model_role role_;
  std::vector<scalar_type> rows_;
  std::vector<token_id> prefix_;
};

}  // namespace specdec
