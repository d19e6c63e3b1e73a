// Drafting cost of every drafter in include/specdec/drafters/, per proposed token, with a
// history of 512 and 8192 tokens, on a deterministic synthetic code-like token stream
// (functions built from statement templates, many of them repeated later with edits).
//
// Each iteration is one drafting call of up to 8 tokens as a decoder makes it: the context
// is the stream so far, and the decoder then advances by the drafts that match the stream
// plus one token (as if the target were the stream itself, greedy). Counters:
//   time_per_token CPU seconds per proposed (or drafted) token
//   proposed       mean tokens proposed per call
//   matched        mean proposed tokens matching the stream (the accepted drafts of a
//                  greedy target that generated this stream)
//
// BM_TokensPerTargetCall runs SpeculativeDecoder with each drafter against a synthetic
// code model (a static order-5 Witten-Bell model of the training half of the stream, mixed
// with an in-context copy head like an LLM's induction heads), greedy and at T = 1, and
// reports tokens per target call (the target scores all prefixes in one call).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <unordered_map>
#include <vector>

#include <benchmark/benchmark.h>

#include "specdec/drafters/count_models.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_decoder.hpp"

namespace {

using specdec::token_id;

// ---------------------------------------------------------------------------------------
// A synthetic code-like token stream
// ---------------------------------------------------------------------------------------

constexpr std::size_t code_vocab = 1024;
// Token classes: punctuation and keywords [0, 48), identifiers [48, 816), numbers [816, 1024).
constexpr token_id first_identifier = 48;
constexpr std::uint64_t identifier_count = 768;
constexpr token_id first_number = 816;
constexpr std::uint64_t number_count = 208;

// Keywords and punctuation used by the templates.
enum keyword : token_id {
  kw_int = 0,
  kw_for,
  kw_if,
  kw_return,
  kw_static,
  kw_const,
  kw_auto,
  kw_while,
  kw_else,
  p_open,
  p_close,
  p_brace_open,
  p_brace_close,
  p_semicolon,
  p_comma,
  p_assign,
  p_plus,
  p_less,
  p_equal,
  p_increment,
  p_dot,
  p_bracket_open,
  p_bracket_close,
  p_star,
  p_minus,
  kw_push_back,
  kw_size,
  kw_std,
  kw_vector,
  p_scope,
  p_angle_open,
  p_angle_close,
  kw_break,
  kw_continue
};

// Slots in a statement template: a keyword, the i-th identifier of the function, a number.
constexpr token_id slot_identifier = -1000;  // -1000 - i: identifier i of the function
constexpr token_id slot_number = -2000;      // -2000 - i: number i of the function

struct StreamBuilder {
  specdec::xoshiro256pp rng{20230518};
  std::vector<std::vector<token_id>> templates;

  StreamBuilder() {
    const token_id a = slot_identifier, b = slot_identifier - 1, c = slot_identifier - 2,
                   d = slot_identifier - 3, n0 = slot_number, n1 = slot_number - 1;
    templates = {
        {kw_int, a, p_assign, n0, p_semicolon},
        {a, p_assign, b, p_plus, c, p_semicolon},
        {kw_for, p_open, kw_int, d, p_assign, n1, p_semicolon, d, p_less, b, p_semicolon,
         p_increment, d, p_close, p_brace_open},
        {p_brace_close},
        {kw_if, p_open, a, p_equal, n0, p_close, p_brace_open, kw_return, b, p_semicolon,
         p_brace_close},
        {c, p_dot, kw_push_back, p_open, a, p_close, p_semicolon},
        {a, p_bracket_open, d, p_bracket_close, p_assign, b, p_star, c, p_semicolon},
        {kw_auto, b, p_assign, c, p_dot, kw_size, p_open, p_close, p_semicolon},
        {kw_std, p_scope, kw_vector, p_angle_open, kw_int, p_angle_close, c, p_semicolon},
        {a, p_assign, a, p_minus, n1, p_semicolon},
        {kw_while, p_open, a, p_less, b, p_close, p_brace_open, p_increment, a, p_semicolon,
         p_brace_close},
    };
  }

  struct Function {
    std::vector<token_id> identifiers;  // name, then locals
    std::vector<token_id> numbers;
    std::vector<std::size_t> statements;  // template indices
  };

  Function fresh_function() {
    Function f;
    for (int i = 0; i < 5; ++i)
      f.identifiers.push_back(first_identifier +
                              static_cast<token_id>(specdec::uniform_below(rng, identifier_count)));
    for (int i = 0; i < 2; ++i)
      f.numbers.push_back(first_number +
                          static_cast<token_id>(specdec::uniform_below(rng, number_count)));
    const auto statements = 4 + specdec::uniform_below(rng, 8);
    for (std::uint64_t i = 0; i < statements; ++i)
      f.statements.push_back(
          static_cast<std::size_t>(specdec::uniform_below(rng, templates.size())));
    return f;
  }

  // An edited copy: renamed identifiers, changed numbers, a statement added or removed.
  Function edited(Function f) {
    if (specdec::uniform_below(rng, 2) == 0)
      f.identifiers[1 + specdec::uniform_below(rng, 4)] =
          first_identifier + static_cast<token_id>(specdec::uniform_below(rng, identifier_count));
    if (specdec::uniform_below(rng, 2) == 0)
      f.numbers[specdec::uniform_below(rng, 2)] =
          first_number + static_cast<token_id>(specdec::uniform_below(rng, number_count));
    const auto where = specdec::uniform_below(rng, f.statements.size());
    if (specdec::uniform_below(rng, 2) == 0 && f.statements.size() > 2) {
      f.statements.erase(f.statements.begin() + static_cast<std::ptrdiff_t>(where));
    } else {
      f.statements.insert(f.statements.begin() + static_cast<std::ptrdiff_t>(where),
                          static_cast<std::size_t>(specdec::uniform_below(rng, templates.size())));
    }
    return f;
  }

  void emit(const Function& f, std::vector<token_id>& out) const {
    out.insert(out.end(), {kw_static, kw_int, f.identifiers[0], p_open, kw_int, f.identifiers[1],
                           p_comma, kw_int, f.identifiers[2], p_close, p_brace_open});
    for (const std::size_t s : f.statements) {
      for (const token_id t : templates[s]) {
        if (t <= slot_number) {
          out.push_back(f.numbers[static_cast<std::size_t>(slot_number - t)]);
        } else if (t <= slot_identifier) {
          out.push_back(f.identifiers[static_cast<std::size_t>(slot_identifier - t)]);
        } else {
          out.push_back(t);
        }
      }
    }
    out.push_back(p_brace_close);
  }

  // Functions; each is fresh with probability 0.4, else an edited copy of a recent one.
  std::vector<token_id> build(std::size_t length) {
    std::vector<token_id> out;
    std::vector<Function> recent;
    while (out.size() < length) {
      Function f =
          recent.empty() || specdec::uniform_below(rng, 10) < 4
              ? fresh_function()
              : edited(
                    recent[recent.size() - 1 -
                           specdec::uniform_below(rng, std::min<std::size_t>(recent.size(), 12))]);
      emit(f, out);
      recent.push_back(std::move(f));
    }
    out.resize(length);
    return out;
  }
};

const std::vector<token_id>& code_stream() {
  static const std::vector<token_id> stream = StreamBuilder{}.build(1U << 17U);
  return stream;
}

// The first half trains the count models; drafting runs over the second half.
std::span<const token_id> training_part() {
  return std::span<const token_id>(code_stream()).first(code_stream().size() / 2);
}

// ---------------------------------------------------------------------------------------
// Drafting cost
// ---------------------------------------------------------------------------------------

constexpr std::size_t draft_length = 8;

// Runs drafting calls over the stream. `draft(sequence, out)` drafts after `sequence` (the
// decoder's accepted context, which it may temporarily extend) and returns the count.
template <class Draft>
void run_drafting(benchmark::State& state, Draft&& draft) {
  const auto& stream = code_stream();
  const std::size_t begin = stream.size() / 2;
  std::vector<token_id> sequence(stream.begin(),
                                 stream.begin() + static_cast<std::ptrdiff_t>(begin));
  sequence.reserve(stream.size() + draft_length);
  std::array<token_id, draft_length> out{};
  std::size_t proposed = 0;
  std::size_t matched = 0;
  std::size_t calls = 0;
  static_cast<void>(draft(sequence, std::span<token_id>(out)));  // seeds the history, untimed
  for (auto _ : state) {
    const std::size_t count = draft(sequence, std::span<token_id>(out));
    benchmark::DoNotOptimize(out.data());
    proposed += count;
    ++calls;
    // Advance like greedy decoding of the stream: matching drafts plus one token.
    std::size_t advance = 0;
    while (advance < count && sequence.size() + advance < stream.size() &&
           out[advance] == stream[sequence.size() + advance])
      ++advance;
    matched += advance;
    const std::size_t next = std::min(sequence.size() + advance + 1, stream.size());
    if (next == stream.size()) {  // wrap around: start again in the middle (a new prompt)
      sequence.resize(begin);
    } else {
      sequence.insert(sequence.end(), stream.begin() + static_cast<std::ptrdiff_t>(sequence.size()),
                      stream.begin() + static_cast<std::ptrdiff_t>(next));
    }
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(proposed));
  state.counters["time_per_token"] = benchmark::Counter(
      static_cast<double>(proposed), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["proposed"] =
      static_cast<double>(proposed) / static_cast<double>(std::max<std::size_t>(calls, 1));
  state.counters["matched"] =
      static_cast<double>(matched) / static_cast<double>(std::max<std::size_t>(calls, 1));
}

void BM_NgramPropose(benchmark::State& state) {
  const auto history = static_cast<std::size_t>(state.range(0));
  specdec::NgramDrafter drafter({.max_order = 4, .window = history});
  run_drafting(state, [&](const std::vector<token_id>& sequence, std::span<token_id> out) {
    return drafter.propose(sequence, out);
  });
  state.counters["memory_kib"] = static_cast<double>(drafter.memory_bytes()) / 1024.0;
}

void BM_PromptLookupPropose(benchmark::State& state) {
  const auto history = static_cast<std::size_t>(state.range(0));
  specdec::PromptLookupDrafter drafter({.min_ngram = 1, .max_ngram = 8, .window = history});
  run_drafting(state, [&](const std::vector<token_id>& sequence, std::span<token_id> out) {
    return drafter.propose(sequence, out);
  });
}

// A draft LanguageModel drafts greedily here: one row and one argmax per drafted token,
// the drafted token appended to the context for the next row (as the decoder does). The
// model sees the last `history` tokens of the sequence (all of them by default).
template <class Model>
std::size_t draft_from_model(Model& model, std::vector<token_id>& sequence, std::span<token_id> out,
                             std::size_t history = std::numeric_limits<std::size_t>::max()) {
  const std::size_t accepted_length = sequence.size();
  for (auto& token : out) {
    const auto row = model.next_token_probabilities(
        std::span<const token_id>(sequence).last(std::min(history, sequence.size())));
    token = static_cast<token_id>(std::max_element(row.begin(), row.end()) - row.begin());
    sequence.push_back(token);
  }
  sequence.resize(accepted_length);
  return out.size();
}

void BM_NgramModelDraft(benchmark::State& state) {
  const auto history = static_cast<std::size_t>(state.range(0));
  specdec::NgramDrafter drafter({.max_order = 4, .window = history});
  auto model = drafter.as_model<float>(code_vocab);
  run_drafting(state, [&](std::vector<token_id>& sequence, std::span<token_id> out) {
    return draft_from_model(model, sequence, out);
  });
}

// The count models (the paper's trivial drafts, trained on the first half of the stream)
// are given the last `history` tokens of the context as their history: they read at most
// the last token, so their cost must not grow with it (the 512 and 8192 rows show that).
void BM_BigramDraft(benchmark::State& state) {
  const auto history = static_cast<std::size_t>(state.range(0));
  static specdec::BigramModel<float> bigram(training_part(), code_vocab, 0.1);
  run_drafting(state, [&](std::vector<token_id>& sequence, std::span<token_id> out) {
    return draft_from_model(bigram, sequence, out, history);
  });
}

void BM_UnigramDraft(benchmark::State& state) {
  const auto history = static_cast<std::size_t>(state.range(0));
  static specdec::UnigramModel<float> unigram(training_part(), code_vocab, 0.1);
  run_drafting(state, [&](std::vector<token_id>& sequence, std::span<token_id> out) {
    return draft_from_model(unigram, sequence, out, history);
  });
}

// ---------------------------------------------------------------------------------------
// Tokens per target call with the decoder
// ---------------------------------------------------------------------------------------

// The target: q_corpus interpolated Witten-Bell over contexts of 1..4 tokens (counts from the
// training half) down to add-one unigram, mixed 60/40 with a copy head that puts its mass
// on the token that followed the most recent earlier occurrence of the last 3 context
// tokens (when there is one). A deterministic function of the context; scores all drafted
// prefixes in one call.
class CodeTarget {
 public:
  static constexpr std::size_t max_context = 4;
  static constexpr std::size_t copy_match = 3;
  static constexpr double copy_weight = 0.4;

  CodeTarget() {
    const auto corpus = training_part();
    for (std::size_t position = 1; position < corpus.size(); ++position) {
      std::uint64_t hash = 0;
      for (std::size_t m = 1; m <= max_context && m <= position; ++m) {
        hash = extend(hash, corpus[position - m], m);
        auto& successors = tables_[hash];
        const auto it = std::find_if(successors.begin(), successors.end(),
                                     [&](const auto& s) { return s.first == corpus[position]; });
        if (it == successors.end()) {
          successors.emplace_back(corpus[position], 1);
        } else {
          ++it->second;
        }
      }
    }
    unigram_.assign(code_vocab, 1.0);
    for (const token_id t : corpus) unigram_[static_cast<std::size_t>(t)] += 1.0;
    const double total = static_cast<double>(corpus.size() + code_vocab);
    for (auto& value : unigram_) value /= total;
    work_.resize(code_vocab);
  }

  [[nodiscard]] std::size_t vocab_size() const { return code_vocab; }

  std::span<const float> next_token_probabilities(std::span<const token_id> context) {
    rows_.resize(code_vocab);
    fill_row(context, std::span<float>(rows_));
    return rows_;
  }

  specdec::RowsView<const float> score_draft(std::span<const token_id> context,
                                             std::span<const token_id> draft) {
    scratch_.assign(context.begin(), context.end());
    scratch_.insert(scratch_.end(), draft.begin(), draft.end());
    rows_.resize((draft.size() + 1) * code_vocab);
    for (std::size_t i = 0; i <= draft.size(); ++i)
      fill_row(std::span<const token_id>(scratch_).first(context.size() + i),
               std::span<float>(rows_).subspan(i * code_vocab, code_vocab));
    return {rows_.data(), draft.size() + 1, code_vocab};
  }

 private:
  static std::uint64_t extend(std::uint64_t hash, token_id token, std::size_t length) {
    return specdec::detail::mix64(hash * 31 + static_cast<std::uint64_t>(token) + length);
  }

  void fill_row(std::span<const token_id> context, std::span<float> row) {
    std::copy(unigram_.begin(), unigram_.end(), work_.begin());
    std::uint64_t hash = 0;
    for (std::size_t m = 1; m <= max_context && m <= context.size(); ++m) {
      hash = extend(hash, context[context.size() - m], m);
      const auto it = tables_.find(hash);
      if (it == tables_.end()) break;
      double total = 0.0;
      for (const auto& s : it->second) total += static_cast<double>(s.second);
      const double distinct = static_cast<double>(it->second.size());
      const double keep = distinct / (total + distinct);
      for (auto& value : work_) value *= keep;
      for (const auto& s : it->second)
        work_[static_cast<std::size_t>(s.first)] +=
            static_cast<double>(s.second) / (total + distinct);
    }
    // Copy head: the most recent earlier occurrence of the last copy_match tokens.
    const std::size_t n = context.size();
    bool copied = false;
    if (n > copy_match) {
      for (std::size_t end = n - 1; end-- > copy_match - 1 && !copied;) {
        std::size_t k = 0;
        while (k < copy_match && context[end - k] == context[n - 1 - k]) ++k;
        if (k == copy_match) {
          for (auto& value : work_) value *= 1.0 - copy_weight;
          work_[static_cast<std::size_t>(context[end + 1])] += copy_weight;
          copied = true;
        }
      }
    }
    for (std::size_t x = 0; x < row.size(); ++x) row[x] = static_cast<float>(work_[x]);
  }

  std::unordered_map<std::uint64_t, std::vector<std::pair<token_id, std::uint32_t>>> tables_;
  std::vector<double> unigram_;
  std::vector<double> work_;
  std::vector<float> rows_;
  std::vector<token_id> scratch_;
};

CodeTarget& code_target() {
  static CodeTarget target;
  return target;
}

enum class drafter_kind { ngram_proposals, ngram_model, prompt_lookup, bigram, unigram };

constexpr std::size_t prompt_length = 1024;
constexpr std::size_t generated_per_iteration = 128;

template <class Draft>
void run_decoder(benchmark::State& state, Draft& draft) {
  const double temperature = static_cast<double>(state.range(1));
  specdec::DecoderOptions options;
  options.sampling.temperature = temperature;
  if (state.range(2) == 0) {
    options.gamma_policy = specdec::FixedGamma(4);
  } else {
    options.gamma_policy = specdec::OptimalGammaController({.max_gamma = 12, .measure_cost = true});
  }
  specdec::SpeculativeDecoder decoder(code_target(), draft, options);
  const auto& stream = code_stream();
  std::size_t emitted = 0;
  std::size_t target_calls = 0;
  std::size_t accepted = 0;
  std::size_t drafted = 0;
  std::uint64_t iteration = 0;
  for (auto _ : state) {
    // A different prompt each iteration, all from the held-out half of the stream.
    const std::size_t offset =
        stream.size() / 2 + (iteration * 7919) % (stream.size() / 2 - prompt_length);
    const std::span<const token_id> prompt(stream.data() + offset, prompt_length);
    const auto result = decoder.generate(prompt, generated_per_iteration, ++iteration);
    emitted += result.statistics.emitted_tokens;
    target_calls += result.statistics.target_calls;
    accepted += result.statistics.accepted_tokens;
    drafted += result.statistics.drafted_tokens;
  }
  state.counters["tokens_per_target_call"] =
      static_cast<double>(emitted) / static_cast<double>(std::max<std::size_t>(target_calls, 1));
  state.counters["acceptance"] =
      static_cast<double>(accepted) / static_cast<double>(std::max<std::size_t>(drafted, 1));
  state.counters["drafted_per_call"] =
      static_cast<double>(drafted) / static_cast<double>(std::max<std::size_t>(target_calls, 1));
  state.SetItemsProcessed(static_cast<std::int64_t>(emitted));
}

// Args: drafter kind, temperature (0 = greedy, 1), gamma policy (0 = FixedGamma(4),
// 1 = OptimalGammaController with measured c, max_gamma 12).
void BM_TokensPerTargetCall(benchmark::State& state) {
  switch (static_cast<drafter_kind>(state.range(0))) {
    case drafter_kind::ngram_proposals: {
      specdec::NgramDrafter ngram;
      state.SetLabel("ngram proposals");
      run_decoder(state, ngram);
      break;
    }
    case drafter_kind::ngram_model: {
      specdec::NgramDrafter ngram;
      auto model = ngram.as_model<float>(code_vocab);
      state.SetLabel("ngram q rows");
      run_decoder(state, model);
      break;
    }
    case drafter_kind::prompt_lookup: {
      specdec::PromptLookupDrafter lookup;
      state.SetLabel("prompt lookup");
      run_decoder(state, lookup);
      break;
    }
    case drafter_kind::bigram: {
      static specdec::BigramModel<float> bigram(training_part(), code_vocab, 0.1);
      state.SetLabel("bigram");
      run_decoder(state, bigram);
      break;
    }
    case drafter_kind::unigram: {
      static specdec::UnigramModel<float> unigram(training_part(), code_vocab, 0.1);
      state.SetLabel("unigram");
      run_decoder(state, unigram);
      break;
    }
  }
}

}  // namespace

BENCHMARK(BM_NgramPropose)->Arg(512)->Arg(8192);
BENCHMARK(BM_PromptLookupPropose)->Arg(512)->Arg(8192);
BENCHMARK(BM_NgramModelDraft)->Arg(512)->Arg(8192);
BENCHMARK(BM_BigramDraft)->Arg(512)->Arg(8192);
BENCHMARK(BM_UnigramDraft)->Arg(512)->Arg(8192);
BENCHMARK(BM_TokensPerTargetCall)
    ->ArgsProduct({{0, 1, 2, 3, 4}, {0, 1}, {0, 1}})
    ->ArgNames({"drafter", "T", "policy"})
    ->Unit(benchmark::kMillisecond);
