// Constrained generation with the llama engine: the vocabulary's token strings for
// specdec::TokenDfa (a regular expression the generated text must match in full), the
// BalancedBrackets constraint, TextConstraint (either, both or neither, the one type
// llama_generate instantiates), and plain / speculative generation on constrained rows.
//
//   const auto strings = llama::token_strings(model.tokenizer());
//   specdec::TokenDfa regex(specdec::ByteDfa::compile(R"([a-z_]+\(\):)"), strings,
//                           std::array{*model.tokenizer().eos()});
//   specdec::ConstrainedSampling<specdec::TokenDfa> rules(engine.vocab_size(), regex, bias);
//   auto result = llama::generate_speculative_constrained(target, &draft, kind, rules,
//                                                          prompt, options);
//
// The constraint applies to the generated tokens only: their text is the concatenation of
// their token strings, which is exactly what llama_generate prints after the prompt. Both
// the target's and (for the drafters that use the draft model) the draft's rows are masked
// by one shared specdec::ConstrainedSampling, so speculative decoding stays exact: its
// output law is the law of plain decoding on the same constrained target rows, and greedy
// speculative output equals greedy plain output on them token for token
// (tests/llama_constrained_test.cpp). Proposal drafters (n-gram, prompt lookup) draft
// unconstrained; a draft token the constraint forbids has target probability 0 and is
// rejected.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "generate.hpp"
#include "specdec/constrained_model.hpp"
#include "specdec/token_constraint.hpp"
#include "specdec/token_dfa.hpp"
#include "tokenizer.hpp"

namespace llama {

/// The bytes each token id decodes to, for specdec::TokenDfa and BalancedBrackets:
/// Tokenizer::piece(id) for every id, that is the token's text with U+2581 as a space, a
/// byte token <0xXX> as that byte, and the empty string for control, unknown and unused
/// tokens (<s>, </s>, <unk>). Concatenating the strings of a token sequence gives
/// tokenizer.decode(ids, false) byte for byte (decode(ids) additionally drops the space that
/// encode() puts in front of a prompt; generated text gets no such prefix). Only meaningful
/// for the SentencePiece ("llama") tokenizer (Tokenizer::encodes_text()): throws
/// std::invalid_argument otherwise, since another model's token texts are not its bytes.
[[nodiscard]] inline std::vector<std::string> token_strings(const Tokenizer& tokenizer) {
  if (!tokenizer.encodes_text()) {
    throw std::invalid_argument(
        "token strings need the SentencePiece (\"llama\") tokenizer: this model's token texts "
        "are not the bytes they decode to");
  }
  std::vector<std::string> strings;
  strings.reserve(tokenizer.size());
  for (std::size_t id = 0; id < tokenizer.size(); ++id) {
    strings.push_back(tokenizer.piece(static_cast<token>(id)));
  }
  return strings;
}

/// A TokenConstraint that keeps the brackets ()[]{} of the generated text balanced, and
/// ends the text with an end token (EOS) once the brackets are closed:
///  - the state is the stack of the open brackets (at most `capacity`, 32, deep);
///  - a text token is allowed when its bytes, in order, keep the stack valid: every closing
///    bracket matches the open bracket on top, the depth never exceeds `capacity`;
///  - when a closing bracket empties the stack (the expression is closed), the text is done:
///    nothing may follow it, in that token or after it, but an end token (so a token that
///    closes the expression and goes on, "]," or ")\n", is not allowed);
///  - end tokens: allowed when the text is done (again and again: a decoder may draft past
///    EOS), and, with `end_when_empty` (the default), whenever the stack is empty;
///  - tokens with an empty string (control tokens other than the end tokens) are never
///    allowed.
/// Every bracket byte counts, including those in string literals and comments: the
/// constraint does not lex Python. Brackets are ASCII, so the multi-byte UTF-8 pieces of
/// other characters never contain one.
///
/// `open_text` (e.g. the prompt's text) puts the brackets it leaves open on the stack at the
/// start, so that they have to be closed too ("x = [" generates up to the matching "]"). Its
/// closing brackets pop a matching open bracket and are otherwise ignored.
///
/// state_type is 16 trivially copyable bytes (the stack, 2 bits per level, in one word);
/// nothing allocates after construction. Cost: the constructor scans every token string
/// once and keeps, per token, the bracket bytes it contains. allowed_tokens (and
/// restrict_tokens) is one pass over mask_words(V) words (the tokens without brackets are
/// allowed or not as a whole block of 64) plus a replay of each bracket-containing token's
/// few bracket bytes against the stack: a few hundred of the shipped 4096-token vocabulary,
/// microseconds per call. advance(t) replays t's bracket bytes.
class BalancedBrackets {
 public:
  static constexpr std::size_t capacity = 32;

  struct state_type {
    std::uint64_t stack = 0;  ///< level i (0: bottom) in bits 2i, 2i+1: 1 '(', 2 '[', 3 '{'
    std::uint8_t depth = 0;   ///< open brackets
    bool done = false;        ///< the expression closed (or an end token came): end tokens only
    friend constexpr bool operator==(const state_type&, const state_type&) = default;
  };

  /// Throws std::invalid_argument for an end token outside [0, V), a vocabulary too large
  /// for token ids, or an `open_text` leaving more than `capacity` brackets open.
  BalancedBrackets(std::span<const std::string> token_strings,
                   std::span<const specdec::token_id> end_tokens, std::string_view open_text = {},
                   bool end_when_empty = true)
      : vocab_(token_strings.size()),
        words_(specdec::mask_words(token_strings.size())),
        end_when_empty_(end_when_empty) {
    if (vocab_ > static_cast<std::size_t>(std::numeric_limits<specdec::token_id>::max())) {
      throw std::invalid_argument("BalancedBrackets: the vocabulary is too large for token ids");
    }
    plain_.assign(words_, 0);
    brackets_.assign(words_, 0);
    ends_.assign(words_, 0);
    for (const specdec::token_id t : end_tokens) {
      if (t < 0 || static_cast<std::size_t>(t) >= vocab_) {
        throw std::invalid_argument("BalancedBrackets: end token " + std::to_string(t) +
                                    " is outside the vocabulary of " + std::to_string(vocab_) +
                                    " tokens");
      }
      specdec::mask_set(ends_, t);
    }
    op_begin_.reserve(vocab_ + 1);
    op_begin_.push_back(0);
    trailing_.assign(vocab_, 0);
    for (std::size_t i = 0; i < vocab_; ++i) {
      const auto t = static_cast<specdec::token_id>(i);
      const std::string& text = token_strings[i];
      if (!specdec::mask_test(ends_, t) && !text.empty()) {
        std::size_t after_last = 0;  // bytes after the last bracket byte
        const std::size_t before = ops_.size();
        for (const char c : text) {
          const std::uint8_t op = bracket_op(c);
          if (op != 0) {
            ops_.push_back(op);
            after_last = 0;
          } else {
            ++after_last;
          }
        }
        if (ops_.size() == before) {
          specdec::mask_set(plain_, t);
        } else {
          specdec::mask_set(brackets_, t);
          bracket_tokens_.push_back(t);
          trailing_[i] = after_last > 0 ? 1 : 0;
        }
      }
      op_begin_.push_back(static_cast<std::uint32_t>(ops_.size()));
    }
    for (const char c : open_text) {
      const std::uint8_t op = bracket_op(c);
      if (op == 0) continue;
      if (op < close) {
        if (start_.depth == capacity) {
          throw std::invalid_argument("BalancedBrackets: the opening text leaves more than " +
                                      std::to_string(capacity) + " brackets open");
        }
        push(start_, op);
      } else if (start_.depth > 0 && top(start_) == (op & 3U)) {
        pop(start_);
      }
    }
    state_ = start_;
  }

  [[nodiscard]] state_type state() const noexcept { return state_; }
  void restore(const state_type& s) noexcept { state_ = s; }
  /// Goes back to the start state (the stack `open_text` left).
  void reset() noexcept { state_ = start_; }

  /// Moves by token `t`; returns false, leaving the state unchanged, when `t` is not
  /// allowed (see the class comment). Never allocates.
  [[nodiscard]] bool advance(specdec::token_id t) noexcept {
    if (t < 0 || static_cast<std::size_t>(t) >= vocab_) return false;
    if (specdec::mask_test(ends_, t)) {
      if (!end_allowed(state_)) return false;
      state_.done = true;
      return true;
    }
    if (state_.done) return false;
    if (specdec::mask_test(plain_, t)) return true;
    if (!specdec::mask_test(brackets_, t)) return false;  // an empty string: a control token
    state_type next = state_;
    if (!replay(next, static_cast<std::size_t>(t))) return false;
    state_ = next;
    return true;
  }

  /// Writes the bitmask of the allowed tokens (mask_words(vocab_size()) words). Never
  /// allocates.
  void allowed_tokens(std::span<std::uint64_t> words) const noexcept {
    std::fill(words.begin(), words.end(), ~std::uint64_t{0});
    restrict_tokens(words);
  }

  /// Clears in `words` the tokens this constraint forbids (an intersection with another
  /// constraint's mask; bracket tokens already cleared are not replayed). Never allocates.
  void restrict_tokens(std::span<std::uint64_t> words) const noexcept {
    if (state_.done) {
      for (std::size_t w = 0; w < words_; ++w) words[w] &= ends_[w];
      return;
    }
    const std::uint64_t end_bits = end_allowed(state_) ? ~std::uint64_t{0} : 0;
    for (std::size_t w = 0; w < words_; ++w) {
      words[w] &= plain_[w] | brackets_[w] | (ends_[w] & end_bits);
    }
    for (const specdec::token_id t : bracket_tokens_) {
      if (!specdec::mask_test(words, t)) continue;
      state_type next = state_;
      if (!replay(next, static_cast<std::size_t>(t))) specdec::mask_clear(words, t);
    }
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_; }
  /// Number of tokens whose strings contain a bracket (the per-call replay work).
  [[nodiscard]] std::size_t bracket_token_count() const noexcept { return bracket_tokens_.size(); }
  /// Open brackets now.
  [[nodiscard]] std::size_t depth() const noexcept { return state_.depth; }
  /// Whether the expression closed (or an end token came): only end tokens remain.
  [[nodiscard]] bool done() const noexcept { return state_.done; }

 private:
  static constexpr std::uint8_t close = 4;  // op: 1..3 open, 5..7 close (kind + close)

  static constexpr std::uint8_t bracket_op(char c) noexcept {
    switch (c) {
      case '(':
        return 1;
      case '[':
        return 2;
      case '{':
        return 3;
      case ')':
        return 1 + close;
      case ']':
        return 2 + close;
      case '}':
        return 3 + close;
      default:
        return 0;
    }
  }
  static constexpr std::uint64_t top(const state_type& s) noexcept {
    return (s.stack >> (2U * (s.depth - 1U))) & 3U;
  }
  static constexpr void push(state_type& s, std::uint8_t kind) noexcept {
    s.stack |= std::uint64_t{kind} << (2U * s.depth);
    ++s.depth;
  }
  static constexpr void pop(state_type& s) noexcept {
    --s.depth;
    s.stack &= ~(std::uint64_t{3} << (2U * s.depth));
  }

  [[nodiscard]] bool end_allowed(const state_type& s) const noexcept {
    return s.done || (end_when_empty_ && s.depth == 0);
  }

  // Applies token i's bracket bytes to `s`; false when one of them is not allowed.
  [[nodiscard]] bool replay(state_type& s, std::size_t i) const noexcept {
    for (std::uint32_t k = op_begin_[i]; k < op_begin_[i + 1]; ++k) {
      if (s.done) return false;  // a bracket after the expression closed
      const std::uint8_t op = ops_[k];
      if (op < close) {
        if (s.depth == capacity) return false;
        push(s, op);
      } else {
        if (s.depth == 0 || top(s) != (op & 3U)) return false;
        pop(s);
        s.done = s.depth == 0;
      }
    }
    return !(s.done && trailing_[i] != 0);
  }

  std::size_t vocab_;
  std::size_t words_;
  bool end_when_empty_;
  std::vector<std::uint64_t> plain_;     // text tokens without brackets
  std::vector<std::uint64_t> brackets_;  // text tokens with brackets
  std::vector<std::uint64_t> ends_;      // end tokens
  std::vector<specdec::token_id> bracket_tokens_;
  std::vector<std::uint32_t> op_begin_;  // token i's bracket ops: ops_[begin[i], begin[i+1])
  std::vector<std::uint8_t> ops_;
  std::vector<std::uint8_t> trailing_;  // whether token i has bytes after its last bracket
  state_type start_{};
  state_type state_{};
};

static_assert(specdec::TokenConstraint<BalancedBrackets>);
static_assert(std::is_trivially_copyable_v<BalancedBrackets::state_type>);

/// A regular expression (specdec::TokenDfa), balanced brackets, both (a token must be
/// allowed by each), or neither (every token: logit bias and banned tokens alone): the one
/// constraint type llama_generate instantiates its decoders with. With both, a state where
/// their masks do not meet is a dead end (e.g. a pattern that needs a bracket left open),
/// which constrained decoding reports as an error (specdec::errc::zero_mass).
class TextConstraint {
 public:
  struct state_type {
    specdec::TokenDfa::state_type regex = 0;
    BalancedBrackets::state_type brackets{};
    friend constexpr bool operator==(const state_type&, const state_type&) = default;
  };

  TextConstraint() = default;
  TextConstraint(std::optional<specdec::TokenDfa> regex, std::optional<BalancedBrackets> brackets)
      : regex_(std::move(regex)), brackets_(std::move(brackets)) {}

  [[nodiscard]] state_type state() const noexcept {
    return {regex_ ? regex_->state() : 0U,
            brackets_ ? brackets_->state() : BalancedBrackets::state_type{}};
  }
  void restore(const state_type& s) noexcept {
    if (regex_) regex_->restore(s.regex);
    if (brackets_) brackets_->restore(s.brackets);
  }
  [[nodiscard]] bool advance(specdec::token_id t) noexcept {
    const state_type before = state();
    if (regex_ && !regex_->advance(t)) return false;
    if (brackets_ && !brackets_->advance(t)) {
      restore(before);
      return false;
    }
    return true;
  }
  void allowed_tokens(std::span<std::uint64_t> words) const noexcept {
    if (regex_) {
      regex_->allowed_tokens(words);
    } else {
      std::fill(words.begin(), words.end(), ~std::uint64_t{0});
    }
    if (brackets_) brackets_->restrict_tokens(words);
  }

  [[nodiscard]] const std::optional<specdec::TokenDfa>& regex() const noexcept { return regex_; }
  [[nodiscard]] const std::optional<BalancedBrackets>& brackets() const noexcept {
    return brackets_;
  }
  /// Whether it constrains anything.
  [[nodiscard]] bool active() const noexcept { return regex_.has_value() || brackets_.has_value(); }

 private:
  std::optional<specdec::TokenDfa> regex_;
  std::optional<BalancedBrackets> brackets_;
};

static_assert(specdec::TokenConstraint<TextConstraint>);

/// Plain decoding on constrained rows: generate_plain's loop, but each token is drawn from
/// the constrained target adapter's row (rules.target(LogitsModel(target))), standardized
/// by RunOptions::sampling (greedy: its argmax, lowest id on ties). The same rows the
/// speculative decoder verifies against, so the two are comparable token for token at
/// temperature 0 and in law at T > 0. Calls rules.start(prompt).
template <specdec::TokenConstraint C>
RunResult generate_plain_constrained(Engine& target, specdec::ConstrainedSampling<C>& rules,
                                     std::span<const specdec::token_id> prompt,
                                     const RunOptions& options) {
  rules.start(prompt);
  rules.reserve(options.max_new_tokens);
  specdec::LogitsModel logits(target);
  auto model = rules.target(logits);
  specdec::Standardizer<float> standardizer(options.sampling);
  std::vector<float> row(target.vocab_size());
  return detail::plain_loop(
      target, prompt, options,
      [&](std::span<const specdec::token_id> context, specdec::default_engine& g) {
        const auto probabilities = model.next_token_probabilities(context);
        if (options.sampling.greedy()) {
          return static_cast<specdec::token_id>(
              std::max_element(probabilities.begin(), probabilities.end()) - probabilities.begin());
        }
        if (standardizer.identity()) return specdec::sample_from_row(probabilities, g);
        standardizer.apply(probabilities, std::span<float>(row));
        return specdec::sample_from_row(std::span<const float>(row), g);
      });
}

/// generate_speculative (generate.hpp) on constrained rows: the target is always the
/// constrained adapter rules.target(LogitsModel(target)); the draft model, for the
/// drafters that use it (model, tree, controller), is rules.draft(LogitsModel(draft)); the
/// n-gram and prompt-lookup drafters propose unconstrained tokens, which the constrained
/// target rejects where they are forbidden. Calls rules.start(prompt). Throws what
/// generate_speculative throws, and specdec::decoding_error wrapping errc::zero_mass when
/// the target gives no probability to any allowed token.
template <specdec::TokenConstraint C>
RunResult generate_speculative_constrained(Engine& target, Engine* draft, drafter_kind kind,
                                           specdec::ConstrainedSampling<C>& rules,
                                           std::span<const specdec::token_id> prompt,
                                           const RunOptions& options) {
  if (uses_draft_model(kind) && draft == nullptr) {
    throw std::invalid_argument("the " + std::string(to_string(kind)) +
                                " drafter needs a draft model");
  }
  rules.start(prompt);
  rules.reserve(options.max_new_tokens + std::max(options.max_gamma, options.gamma) +
                options.tree_shape.max_depth() + 1);
  specdec::LogitsModel target_logits(target);
  auto target_model = rules.target(target_logits);
  specdec::DecoderOptions decoder_options;
  decoder_options.gamma_policy = specdec::FixedGamma{options.gamma};
  const auto with_draft_model = [&](specdec::DecoderOptions decoder) {
    specdec::LogitsModel draft_logits(*draft);
    auto draft_model = rules.draft(draft_logits);
    return detail::run_decoder(target, draft, target_model, draft_model, std::move(decoder), prompt,
                               options);
  };
  switch (kind) {
    case drafter_kind::model:
      return with_draft_model(std::move(decoder_options));
    case drafter_kind::tree:
      decoder_options.tree_shape = options.tree_shape;
      return with_draft_model(std::move(decoder_options));
    case drafter_kind::controller: {
      specdec::OptimalGammaOptions controller;
      controller.max_gamma = options.max_gamma;
      controller.measure_cost = true;
      controller.prior_alpha = 0.7;
      decoder_options.gamma_policy = specdec::OptimalGammaController(controller);
      return with_draft_model(std::move(decoder_options));
    }
    case drafter_kind::ngram: {
      specdec::NgramDrafter drafter;
      return detail::run_decoder(target, nullptr, target_model, drafter, decoder_options, prompt,
                                 options);
    }
    case drafter_kind::prompt_lookup: {
      specdec::PromptLookupDrafter drafter;
      return detail::run_decoder(target, nullptr, target_model, drafter, decoder_options, prompt,
                                 options);
    }
  }
  throw std::invalid_argument("unknown drafter");
}

}  // namespace llama
