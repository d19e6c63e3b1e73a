// libFuzzer harness: SpeculativeDecoder with models whose outputs come from the fuzzer.
//
// The input chooses V (0 included, and target/draft vocabularies that disagree), the scalar
// type, the draft kind (LanguageModel, proposal drafter, or one with propose_many for
// proposal trees), a per-prefix, batched
// (score_draft) or tree-scoring (score_tree, with faulty block shapes too) target,
// the options (sampling, gamma policy including one that changes gamma every step, stop
// tokens up to "every token", stop sequences, lenience, validate_rows, token-tree shapes),
// the prompt (empty, out-of-range ids), max_new_tokens (0 included), and then, call by call,
// what the models return: valid rows (random, sparse, one-hot, denormal, off 1 by about the
// tolerance), rows of the wrong size, NaN/Inf/negative entries, zero rows, garbage,
// exceptions (std and non-std), drafters proposing too many tokens or ids out of range. A
// "pure" input uses models whose rows are a fixed function of the context, and checks
// greedy decoding against plain greedy decoding of the target.
//
// Invariants (a violation aborts):
//  - construction throws specdec::error exactly when an option or vocabulary is bad, with
//    the code of one of the problems;
//  - generate() returns at most max_new_tokens tokens, each in [0, V); a stop token is only
//    ever the last token; the result equals the streamed tokens and generated();
//  - a model fault makes generate() throw decoding_error with the code of an injected fault
//    (model_failure for a throwing model, with the model's exception nested); no fault, no
//    exception; e.tokens() equals the tokens streamed before the failure (tokens already
//    generated are intact);
//  - after any failure the decoder generates again normally with well-behaved models;
//  - pure greedy runs equal plain greedy decoding of the target.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

#include "fuzz_support.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/validation.hpp"

namespace {

using specdec::errc;
using specdec::token_id;
using specdec::fuzzing::expected_row_error;

constexpr std::size_t max_vocab = 48;
constexpr std::size_t max_gamma = 12;

/// What the models did wrong so far in one generate() call: codes the decoder must (or may)
/// report. Shared by both models of one input.
struct FaultLog {
  FuzzedDataProvider* in = nullptr;
  bool faults_enabled = true;  // off: every output is valid (the "clean" rerun)
  bool content_faults = true;  // off when validate_rows is off (content is a precondition)
  std::vector<errc> must;      // at least one of these was injected and is always detected
  std::vector<errc> may;       // injected, detected only if the decoder looks at it
  // Off when the decoder may legitimately ignore a produced row (token trees scored path by
  // path with score_draft: a node shared by several paths is read from the first call only),
  // so an undetected fault there is no violation; every detected one must still be allowed.
  bool strict = true;
  // Greedy chain decoding validates inside its argmax scans: only the rows it takes a token
  // from, and not their sums, so a content fault is detected only if its row is read.
  bool greedy_scan = false;
  // Sampling (not greedy) reads score_draft's rows lazily: at T = 1 without truncation in
  // place, validated in the passes that read them; otherwise each row is standardized, with
  // its checks, when the decisions first read it. Rows after the one the final token is
  // drawn from are never read, so a content fault in a block row is detected only if its
  // row is read.
  bool lazy_block_rows = false;
  bool in_block = false;  // inside score_draft
  [[nodiscard]] bool lazy() const { return greedy_scan || (lazy_block_rows && in_block); }
  [[nodiscard]] bool any() const { return strict && !must.empty(); }
  void clear() {
    must.clear();
    may.clear();
  }
  [[nodiscard]] bool allowed(errc code) const {
    return std::find(must.begin(), must.end(), code) != must.end() ||
           std::find(may.begin(), may.end(), code) != may.end();
  }
};

struct FuzzModelFailure : std::runtime_error {
  FuzzModelFailure() : std::runtime_error("fuzz model failure") {}
};

/// The well-behaved row of a pure model: a fixed function of (seed, context).
template <class T>
void pure_row(std::uint64_t seed, std::span<const token_id> context, std::span<T> row) {
  if (row.empty()) return;
  std::uint64_t state = seed;
  for (const token_id token : context) {
    state = (state ^ static_cast<std::uint64_t>(static_cast<std::uint32_t>(token))) *
            0x9E3779B97F4A7C15ULL;
  }
  specdec::xoshiro256pp g(state);
  double total = 0.0;
  std::vector<double> weights(row.size());
  for (double& w : weights) {
    const double u = specdec::uniform01<double>(g);
    w = u < 0.3 ? 0.0 : std::exp(6.0 * u);
    total += w;
  }
  if (total == 0.0) {
    weights[0] = 1.0;
    total = 1.0;
  }
  for (std::size_t j = 0; j < row.size(); ++j) row[j] = static_cast<T>(weights[j] / total);
}

/// Writes one model row: valid (pure or fuzzer-chosen) or, when faults are on, any
/// malformed kind; returns the row to hand out (it may have the wrong size).
template <class T>
std::span<const T> produce_row(FaultLog& log, std::uint64_t seed, bool pure, std::size_t vocab,
                               std::span<const token_id> context, std::vector<T>& buffer) {
  buffer.resize(vocab + 2);
  std::span<T> row(buffer.data(), vocab);
  FuzzedDataProvider& in = *log.in;
  if (!log.faults_enabled || pure || in.remaining_bytes() == 0) {
    pure_row(seed, context, row);
    return row;
  }
  const auto action = in.ConsumeIntegral<std::uint8_t>();
  if (action >= 244) {  // a call that fails outright
    log.must.push_back(errc::model_failure);
    if (action % 2 == 0) throw FuzzModelFailure();
    throw 42;  // a non-std exception
  }
  if (action >= 236) {  // the wrong number of entries
    log.must.push_back(errc::invalid_size);
    const std::size_t sizes[] = {0, vocab - 1, vocab + 1, vocab + 2};
    row = std::span<T>(buffer.data(), sizes[action % 4]);
    pure_row(seed, context, row);
    return row;
  }
  specdec::fuzzing::fill_row(in, specdec::fuzzing::pick_row_kind(in), row, std::span<const T>());
  bool ambiguous = false;
  const auto code = expected_row_error(std::span<const T>(row), vocab,
                                       specdec::default_sum_tolerance<T>, ambiguous);
  if (code && !log.content_faults) {
    pure_row(seed, context, row);  // unchecked rows must be valid: replace the bad one
  } else if (code) {
    (ambiguous || log.lazy() ? log.may : log.must).push_back(*code);
  } else if (ambiguous) {
    log.may.push_back(errc::not_normalized);
  }
  return row;
}

/// A LanguageModel whose rows come from the fuzzer (see produce_row).
template <class T>
class FuzzModel {
 public:
  FuzzModel(FaultLog& log, std::uint64_t seed, bool pure, std::size_t vocab,
            std::size_t reported_vocab)
      : log_(&log), seed_(seed), pure_(pure), vocab_(vocab), reported_vocab_(reported_vocab) {}

  [[nodiscard]] std::size_t vocab_size() const { return reported_vocab_; }

  std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    return produce_row(*log_, seed_, pure_, vocab_, context, buffer_);
  }

  /// The plain greedy decoding of this (pure) model, for the greedy reference.
  [[nodiscard]] std::vector<token_id> greedy_reference(std::vector<token_id> context,
                                                       std::size_t count,
                                                       const std::vector<token_id>& stops) const {
    std::vector<token_id> out;
    std::vector<T> row(vocab_);
    while (out.size() < count) {
      pure_row(seed_, std::span<const token_id>(context), std::span<T>(row));
      const auto best =
          static_cast<token_id>(std::max_element(row.begin(), row.end()) - row.begin());
      out.push_back(best);
      context.push_back(best);
      if (std::find(stops.begin(), stops.end(), best) != stops.end()) break;
    }
    return out;
  }

 protected:
  FaultLog* log_;
  std::uint64_t seed_;
  bool pure_;
  std::size_t vocab_;
  std::size_t reported_vocab_;
  std::vector<T> buffer_;
};

/// FuzzModel plus score_draft (one call for all prefixes), which may also return the wrong
/// number of rows or columns.
template <class T>
class FuzzBatchedModel : public FuzzModel<T> {
 public:
  using FuzzModel<T>::FuzzModel;

  specdec::RowsView<const T> score_draft(std::span<const token_id> context,
                                         std::span<const token_id> draft) {
    const auto [rows, cols] = block_shape(draft.size() + 1);
    storage_.resize(rows * cols);
    prefix_.assign(context.begin(), context.end());
    for (std::size_t i = 0; i < rows; ++i) {
      fill_block_row(i, cols);
      if (i < draft.size()) prefix_.push_back(draft[i]);
    }
    return {storage_.data(), rows, cols};
  }

 protected:
  /// The shape of a block of `rows` rows, sometimes off by one row or column (a fault).
  std::pair<std::size_t, std::size_t> block_shape(std::size_t rows) {
    std::size_t cols = this->vocab_;
    FaultLog& log = *this->log_;
    if (log.faults_enabled && !this->pure_ && log.in->remaining_bytes() > 0) {
      const auto action = log.in->ConsumeIntegral<std::uint8_t>();
      if (action >= 248) {
        log.must.push_back(errc::invalid_size);
        if (action % 2 == 0) {
          rows = action % 4 == 0 ? rows + 1 : rows - 1;
        } else {
          cols = action % 4 == 1 ? cols + 1 : cols - 1;
        }
      }
    }
    return {rows, cols};
  }

  /// Row i of the block: the model's row for prefix_, cut or padded to `cols` entries.
  void fill_block_row(std::size_t i, std::size_t cols) {
    FaultLog& log = *this->log_;
    const std::size_t must_before = log.must.size();
    const std::size_t may_before = log.may.size();
    const std::span<const T> row = [&] {
      struct Scope {  // in_block is cleared even when the call throws
        FaultLog& log;
        explicit Scope(FaultLog& l) : log(l) { log.in_block = true; }
        Scope(const Scope&) = delete;
        Scope& operator=(const Scope&) = delete;
        ~Scope() { log.in_block = false; }
      } scope(log);
      return this->next_token_probabilities(prefix_);
    }();
    const std::span<T> stored(storage_.data() + i * cols, cols);
    std::fill(stored.begin(), stored.end(), T(0));
    std::copy_n(row.begin(), std::min(cols, row.size()), stored.begin());
    if (row.size() != cols) {
      // A short or long row copied into the block: judge the row as stored.
      log.must.resize(must_before);
      log.may.resize(may_before);
      bool ambiguous = false;
      const auto code = expected_row_error(std::span<const T>(stored), cols,
                                           specdec::default_sum_tolerance<T>, ambiguous);
      if (code && !log.content_faults) {
        pure_row(this->seed_, std::span<const token_id>(prefix_), stored);
      } else if (code) {  // a block row: lazily validated rows may go unread
        (ambiguous || log.greedy_scan || log.lazy_block_rows ? log.may : log.must).push_back(*code);
      } else if (ambiguous) {
        log.may.push_back(errc::not_normalized);
      }
    }
  }

  std::vector<T> storage_;
  std::vector<token_id> prefix_;
};

/// FuzzBatchedModel plus score_tree (one call for every node of a token tree), with the same
/// faults: rows from the fuzzer, and blocks with a row or a column too many or too few.
template <class T>
class FuzzTreeModel : public FuzzBatchedModel<T> {
 public:
  using FuzzBatchedModel<T>::FuzzBatchedModel;

  specdec::RowsView<const T> score_tree(std::span<const token_id> context,
                                        const specdec::TokenTreeView& tree) {
    const auto [rows, cols] = this->block_shape(tree.size());
    this->storage_.resize(rows * cols);
    for (std::size_t i = 0; i < rows; ++i) {
      this->prefix_.assign(context.begin(), context.end());
      // A row past the tree (a fault) is scored as the last node's path.
      tree.append_path(std::min(i, tree.size() - 1), this->prefix_);
      this->fill_block_row(i, cols);
    }
    return {this->storage_.data(), rows, cols};
  }
};

/// A proposal drafter driven by the fuzzer: counts up to and beyond gamma, ids out of range.
class FuzzDrafter {
 public:
  FuzzDrafter(FaultLog& log, std::size_t vocab, bool pure)
      : log_(&log), vocab_(vocab), pure_(pure) {}

  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) {
    FaultLog& log = *log_;
    const bool faulty = log.faults_enabled && !pure_ && log.in->remaining_bytes() > 0;
    if (!faulty) {  // a deterministic, always valid proposal
      const std::size_t last =
          context.empty() ? 0 : static_cast<std::size_t>(std::max(context.back(), 0));
      for (std::size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<token_id>((last * 7 + i + 1) % vocab_);
      }
      return out.size();
    }
    FuzzedDataProvider& in = *log.in;
    const auto action = in.ConsumeIntegral<std::uint8_t>();
    if (action >= 250) {
      log.must.push_back(errc::model_failure);
      throw FuzzModelFailure();
    }
    std::size_t count = in.ConsumeIntegralInRange<std::size_t>(0, out.size());
    for (std::size_t i = 0; i < count; ++i) {
      out[i] = static_cast<token_id>(in.ConsumeIntegralInRange<std::size_t>(0, vocab_ - 1));
    }
    if (action >= 240 && count > 0) {  // an id out of range (detected unless cut by a stop)
      const std::size_t at = in.ConsumeIntegralInRange<std::size_t>(0, count - 1);
      out[at] =
          action % 2 == 0 ? -1 - static_cast<token_id>(action) : static_cast<token_id>(vocab_);
      (at == 0 ? log.must : log.may).push_back(errc::invalid_token);
    }
    if (action >= 232 && action < 240) {  // more tokens than asked for
      log.must.push_back(errc::invalid_size);
      return out.size() + 1 + action % 3;
    }
    return count;
  }

 protected:
  FaultLog* log_;
  std::size_t vocab_;
  bool pure_;
};

/// FuzzDrafter plus propose_many (proposal trees): several continuations, and as faults a
/// throwing call, more continuations or longer ones than asked for, ids out of range.
class FuzzMultiDrafter : public FuzzDrafter {
 public:
  using FuzzDrafter::FuzzDrafter;

  std::size_t propose_many(std::span<const token_id> context, std::span<token_id> out,
                           std::span<std::size_t> lengths) {
    const std::size_t branches = lengths.size();
    if (branches == 0 || out.size() < branches) return 0;
    const std::size_t length = out.size() / branches;
    FaultLog& log = *log_;
    const bool faulty = log.faults_enabled && !pure_ && log.in->remaining_bytes() > 0;
    if (!faulty) {  // deterministic, always valid: up to three continuations of full length
      const std::size_t last =
          context.empty() ? 0 : static_cast<std::size_t>(std::max(context.back(), 0));
      const std::size_t count = std::min<std::size_t>(branches, 1 + last % 3);
      for (std::size_t b = 0; b < count; ++b) {
        for (std::size_t i = 0; i < length; ++i) {
          out[b * length + i] = static_cast<token_id>((last * 7 + b * 3 + i + 1) % vocab_);
        }
        lengths[b] = length;
      }
      return count;
    }
    FuzzedDataProvider& in = *log.in;
    const auto action = in.ConsumeIntegral<std::uint8_t>();
    if (action >= 250) {
      log.must.push_back(errc::model_failure);
      throw FuzzModelFailure();
    }
    const std::size_t count = in.ConsumeIntegralInRange<std::size_t>(0, branches);
    for (std::size_t b = 0; b < count; ++b) {
      lengths[b] = in.ConsumeIntegralInRange<std::size_t>(0, length);
      for (std::size_t i = 0; i < lengths[b]; ++i) {
        out[b * length + i] =
            static_cast<token_id>(in.ConsumeIntegralInRange<std::size_t>(0, vocab_ - 1));
      }
    }
    if (action >= 240 && count > 0) {  // an id out of range: every continuation is checked
      const std::size_t b = in.ConsumeIntegralInRange<std::size_t>(0, count - 1);
      if (lengths[b] == 0) lengths[b] = 1;
      out[b * length + in.ConsumeIntegralInRange<std::size_t>(0, lengths[b] - 1)] =
          action % 2 == 0 ? -1 - static_cast<token_id>(action) : static_cast<token_id>(vocab_);
      log.must.push_back(errc::invalid_token);
    }
    if (action >= 232 && action < 240) {  // more continuations, or a longer one, than asked
      log.must.push_back(errc::invalid_size);
      if (action % 2 == 0 || count == 0) return branches + 1 + action % 3;
      lengths[in.ConsumeIntegralInRange<std::size_t>(0, count - 1)] = length + 1 + action % 3;
    }
    return count;
  }
};

/// A gamma policy that changes gamma every step (0 and max_gamma included after the first).
struct ScriptedGamma {
  std::vector<std::size_t> gammas{1};
  std::size_t steps = 0;
  [[nodiscard]] std::size_t next_gamma() const { return gammas[steps % gammas.size()]; }
  [[nodiscard]] bool continue_drafting(double, std::size_t) const { return true; }
  void observe(const specdec::StepFeedback&) { ++steps; }
  [[nodiscard]] bool needs_timing() const { return steps % 2 == 1; }
};

struct Setup {
  specdec::DecoderOptions options;
  std::vector<errc> construction_problems;
  std::vector<token_id> prompt;
  bool prompt_out_of_range = false;  // some id outside [0, V): every generate() must refuse it
  bool tree = false;                 // a token-tree shape (DecoderOptions::tree_shape)
  std::size_t max_new_tokens = 0;
};

Setup make_setup(FuzzedDataProvider& in, std::size_t vocab, bool pure) {
  Setup setup;
  specdec::DecoderOptions& options = setup.options;
  std::vector<errc>& problems = setup.construction_problems;
  // Sampling: mostly valid, sometimes out of range.
  const auto sampling = in.ConsumeIntegral<std::uint8_t>();
  if (pure || sampling < 64) {
    options.sampling.temperature = 0.0;  // greedy
  } else if (sampling < 128) {
    options.sampling.temperature = 1.0;
  } else {
    // 1e300 and 1e45: 1/T rounds to 0 in float (finding F2, fixed).
    static constexpr double temperatures[] = {0.7, 1.5, 1e-300, 1e300, 0.05, 1e45};
    options.sampling.temperature = temperatures[sampling % std::size(temperatures)];
    options.sampling.top_k = in.ConsumeIntegralInRange<std::size_t>(0, vocab + 1);
    static constexpr double top_ps[] = {1.0, 0.9, 0.5, 1e-9};
    options.sampling.top_p = top_ps[in.ConsumeIntegralInRange<std::size_t>(0, 3)];
    static constexpr double min_ps[] = {0.0, 0.1, 1.0};
    options.sampling.min_p = min_ps[in.ConsumeIntegralInRange<std::size_t>(0, 2)];
  }
  if (sampling >= 250) {  // an option out of range
    switch (sampling % 3) {
      case 0:
        options.sampling.temperature = -1.0;
        break;
      case 1:
        options.sampling.top_p = 0.0;
        break;
      default:
        options.sampling.min_p = std::nan("");
        break;
    }
    problems.push_back(errc::invalid_option);
  }
  // Gamma policy.
  const auto policy = in.ConsumeIntegralInRange<int>(0, 5);
  if (policy <= 1) {
    options.gamma_policy =
        specdec::FixedGamma(in.ConsumeIntegralInRange<std::size_t>(1, max_gamma));
  } else if (policy == 2) {
    options.gamma_policy = specdec::AdditiveGamma(specdec::AdditiveGammaOptions{
        .initial = 2, .min_gamma = 1, .max_gamma = max_gamma, .increase = 2, .decrease = 1});
  } else if (policy == 3) {
    options.gamma_policy = specdec::ConfidenceStop(
        in.ConsumeProbability<double>(), in.ConsumeIntegralInRange<std::size_t>(1, max_gamma));
  } else {
    ScriptedGamma scripted;
    scripted.gammas.clear();
    scripted.gammas.push_back(
        in.ConsumeIntegralInRange<std::size_t>(policy == 5 ? 0 : 1, max_gamma));
    const std::size_t count = in.ConsumeIntegralInRange<std::size_t>(0, 6);
    for (std::size_t k = 0; k < count; ++k) {
      scripted.gammas.push_back(in.ConsumeIntegralInRange<std::size_t>(0, max_gamma));
    }
    if (scripted.gammas.front() == 0) problems.push_back(errc::invalid_option);
    options.gamma_policy = scripted;
  }
  // Stop tokens: none, a few, or every token.
  const auto stops = in.ConsumeIntegralInRange<int>(0, 7);
  if (stops == 7) {
    for (std::size_t t = 0; t < vocab; ++t) options.stop_tokens.push_back(static_cast<token_id>(t));
  } else if (stops >= 4) {
    const std::size_t count = in.ConsumeIntegralInRange<std::size_t>(1, 4);
    for (std::size_t k = 0; k < count; ++k) {
      const auto token = in.ConsumeIntegralInRange<token_id>(-2, static_cast<token_id>(vocab) + 1);
      if (token < 0 || static_cast<std::size_t>(token) >= vocab)
        problems.push_back(errc::invalid_option);
      options.stop_tokens.push_back(token);
    }
  }
  // Stop sequences (an empty one is an error).
  const std::size_t sequences = in.ConsumeIntegralInRange<std::size_t>(0, 2);
  for (std::size_t s = 0; s < sequences; ++s) {
    std::vector<token_id> sequence(in.ConsumeIntegralInRange<std::size_t>(0, 3));
    if (sequence.empty()) problems.push_back(errc::invalid_option);
    for (token_id& token : sequence) {
      token = in.ConsumeIntegralInRange<token_id>(-1, static_cast<token_id>(vocab));
      if (token < 0 || static_cast<std::size_t>(token) >= vocab)
        problems.push_back(errc::invalid_option);
    }
    options.stop_sequences.push_back(sequence);
  }
  // Lenience: 1 mostly.
  const auto lenience = in.ConsumeIntegral<std::uint8_t>();
  if (lenience >= 224) {
    static constexpr double values[] = {0.5, 0.0, 1.5, -0.0, 0.999};
    options.lenience = values[lenience % std::size(values)];
    if (!(options.lenience > 0.0 && options.lenience <= 1.0))
      problems.push_back(errc::invalid_option);
    if (options.sampling.greedy() && options.lenience != 1.0)
      problems.push_back(errc::invalid_option);
  }
  options.validate_rows = in.ConsumeIntegral<std::uint8_t>() >= 32;
  options.collect_beta = in.ConsumeBool();
  // Prompt: empty, ordinary, or with ids the models must cope with.
  setup.prompt.resize(in.ConsumeIntegralInRange<std::size_t>(0, 8));
  const bool wild_prompt = in.ConsumeIntegral<std::uint8_t>() >= 240;
  for (token_id& token : setup.prompt) {
    token = wild_prompt ? in.ConsumeIntegral<token_id>()
                        : in.ConsumeIntegralInRange<token_id>(0, static_cast<token_id>(vocab) - 1);
    if (token < 0 || static_cast<std::size_t>(token) >= vocab) setup.prompt_out_of_range = true;
  }
  setup.max_new_tokens = in.ConsumeIntegralInRange<std::size_t>(0, 40);
  // Token trees: sometimes a branching shape instead of the gamma-policy chain.
  const auto tree = in.ConsumeIntegral<std::uint8_t>();
  if (tree >= 176) {
    static const std::vector<std::vector<std::size_t>> shapes{{2},    {2, 1},    {3, 2, 1},
                                                              {1, 3}, {4, 1, 1}, {2, 2, 2}};
    options.tree_shape = specdec::TreeShape::branching(shapes[tree % shapes.size()]);
    options.tree_sampling = in.ConsumeBool() ? specdec::expansion::with_replacement
                                             : specdec::expansion::without_replacement;
    options.tree_merge_repeats = in.ConsumeBool();
    setup.tree = true;
    if (options.lenience != 1.0) problems.push_back(errc::invalid_option);
  }
  return setup;
}

bool is_stop(const std::vector<token_id>& stops, token_id token) {
  return std::find(stops.begin(), stops.end(), token) != stops.end();
}

// The tokens of a successful generation: bounded, in range, stop tokens only at the end.
void check_tokens(const std::vector<token_id>& tokens, std::size_t max_new_tokens,
                  std::size_t vocab, const specdec::DecoderOptions& options) {
  SPECDEC_FUZZ_CHECK(tokens.size() <= max_new_tokens);
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    SPECDEC_FUZZ_CHECK(tokens[k] >= 0 && static_cast<std::size_t>(tokens[k]) < vocab);
    if (k + 1 < tokens.size()) SPECDEC_FUZZ_CHECK(!is_stop(options.stop_tokens, tokens[k]));
  }
}

template <class Decoder, class Target>
void exercise(FuzzedDataProvider& in, FaultLog& log, Decoder& decoder, const Target& target,
              const Setup& setup, std::vector<token_id>& streamed, std::size_t vocab, bool pure) {
  for (int round = 0; round < 2; ++round) {
    streamed.clear();
    log.clear();
    specdec::xoshiro256pp g(in.ConsumeIntegral<std::uint64_t>());
    const std::size_t max_new_tokens = round == 0 ? setup.max_new_tokens : 12;
    if (setup.prompt_out_of_range) {
      // Refused before any model call, in every round, with nothing emitted.
      bool refused = false;
      try {
        (void)decoder.generate(setup.prompt, max_new_tokens, g);
      } catch (const specdec::decoding_error& e) {
        refused = true;
        specdec::fuzzing::check_error(e, {errc::invalid_token});
        SPECDEC_FUZZ_CHECK(e.tokens().empty());
      }
      SPECDEC_FUZZ_CHECK(refused);
      SPECDEC_FUZZ_CHECK(streamed.empty());
      SPECDEC_FUZZ_CHECK(!log.any());
      log.faults_enabled = false;
      continue;
    }
    try {
      const specdec::GenerationResult result = decoder.generate(setup.prompt, max_new_tokens, g);
      SPECDEC_FUZZ_CHECK(!log.any());
      check_tokens(result.tokens, max_new_tokens, vocab, decoder.options());
      SPECDEC_FUZZ_CHECK(result.tokens == streamed);
      SPECDEC_FUZZ_CHECK(std::equal(result.tokens.begin(), result.tokens.end(),
                                    decoder.generated().begin(), decoder.generated().end()));
      SPECDEC_FUZZ_CHECK(result.statistics.emitted_tokens == result.tokens.size());
      if (result.stop == specdec::stop_reason::max_new_tokens) {
        SPECDEC_FUZZ_CHECK(result.tokens.size() == max_new_tokens);
      }
      if (result.stop == specdec::stop_reason::stop_token) {
        SPECDEC_FUZZ_CHECK(!result.tokens.empty() &&
                           is_stop(decoder.options().stop_tokens, result.tokens.back()));
      }
      if (pure && decoder.options().sampling.greedy() && decoder.options().stop_sequences.empty()) {
        SPECDEC_FUZZ_CHECK(result.tokens == target.greedy_reference(setup.prompt, max_new_tokens,
                                                                    decoder.options().stop_tokens));
      }
    } catch (const specdec::decoding_error& e) {
      SPECDEC_FUZZ_CHECK(round == 0);
      SPECDEC_FUZZ_CHECK(log.allowed(e.code()));
      specdec::fuzzing::check_error(e, {e.code()});
      // Tokens already generated are intact: exactly those streamed before the failing step.
      SPECDEC_FUZZ_CHECK(std::vector<token_id>(e.tokens().begin(), e.tokens().end()) == streamed);
      check_tokens(streamed, max_new_tokens, vocab, decoder.options());
      if (e.code() == errc::model_failure) {
        bool nested = false;
        try {
          std::rethrow_if_nested(e);
        } catch (const FuzzModelFailure&) {
          nested = true;
        } catch (int) {
          nested = true;
        }
        SPECDEC_FUZZ_CHECK(nested);
      }
    }
    log.faults_enabled = false;  // second round: well-behaved models; the decoder must work
  }
}

template <class T, class Target, class Draft>
void run_with(FuzzedDataProvider& in, FaultLog& log, Target& target, Draft& draft,
              std::size_t target_vocab, std::size_t draft_vocab, bool pure) {
  Setup setup = make_setup(in, target_vocab == 0 ? 1 : target_vocab, pure);
  if (target_vocab == 0) setup.construction_problems.push_back(errc::invalid_size);
  if constexpr (specdec::LanguageModel<Draft>) {
    if (draft_vocab != target_vocab) setup.construction_problems.push_back(errc::vocab_mismatch);
  }
  std::vector<token_id> streamed;
  setup.options.on_token = [&streamed](const specdec::EmittedToken& emitted) {
    streamed.push_back(emitted.token);
  };
  log.content_faults = setup.options.validate_rows;
  log.greedy_scan = setup.options.validate_rows && setup.options.sampling.greedy() && !setup.tree;
  log.lazy_block_rows =
      setup.options.validate_rows && !setup.options.sampling.greedy() && !setup.tree;
  if constexpr (!specdec::LanguageModel<Draft> && !specdec::MultiProposalDrafter<Draft>) {
    if (setup.tree) setup.construction_problems.push_back(errc::invalid_option);
  }
  log.strict =
      !(setup.tree && specdec::BatchedLanguageModel<Target> && !specdec::TreeScoringModel<Target>);
  std::optional<specdec::SpeculativeDecoder<Target, Draft>> decoder;
  try {
    decoder.emplace(target, draft, setup.options);
  } catch (const specdec::error& e) {
    specdec::fuzzing::check_error(e, setup.construction_problems);
    return;
  }
  SPECDEC_FUZZ_CHECK(setup.construction_problems.empty());
  exercise(in, log, *decoder, target, setup, streamed, target_vocab, pure);
}

template <class T>
void run(FuzzedDataProvider& in) {
  FaultLog log;
  log.in = &in;
  const bool pure = in.ConsumeIntegral<std::uint8_t>() < 48;
  const auto vocab_choice = in.ConsumeIntegral<std::uint8_t>();
  std::size_t target_vocab = in.ConsumeIntegralInRange<std::size_t>(1, max_vocab);
  if (vocab_choice == 255) target_vocab = 0;
  std::size_t draft_vocab = target_vocab;
  if (vocab_choice >= 248 && vocab_choice < 255) draft_vocab = target_vocab + 1;
  const auto target_seed = in.ConsumeIntegral<std::uint64_t>();
  // The draft shares the target's rows sometimes (everything accepted).
  const auto draft_seed = in.ConsumeBool() ? target_seed : in.ConsumeIntegral<std::uint64_t>();
  const std::size_t row_vocab = std::max<std::size_t>(target_vocab, 1);
  const int kind = in.ConsumeIntegralInRange<int>(0, 5);
  FuzzDrafter drafter(log, row_vocab, pure);
  FuzzMultiDrafter multi_drafter(log, row_vocab, pure);
  if (kind == 0) {
    FuzzModel<T> target(log, target_seed, pure, row_vocab, target_vocab);
    FuzzModel<T> draft(log, draft_seed, pure, row_vocab, draft_vocab);
    run_with<T>(in, log, target, draft, target_vocab, draft_vocab, pure);
  } else if (kind == 1) {
    FuzzBatchedModel<T> target(log, target_seed, pure, row_vocab, target_vocab);
    FuzzModel<T> draft(log, draft_seed, pure, row_vocab, draft_vocab);
    run_with<T>(in, log, target, draft, target_vocab, draft_vocab, pure);
  } else if (kind == 2) {
    FuzzModel<T> target(log, target_seed, pure, row_vocab, target_vocab);
    run_with<T>(in, log, target, drafter, target_vocab, draft_vocab, pure);
  } else if (kind == 3) {
    FuzzBatchedModel<T> target(log, target_seed, pure, row_vocab, target_vocab);
    run_with<T>(in, log, target, multi_drafter, target_vocab, draft_vocab, pure);
  } else if (kind == 4) {
    FuzzTreeModel<T> target(log, target_seed, pure, row_vocab, target_vocab);
    FuzzModel<T> draft(log, draft_seed, pure, row_vocab, draft_vocab);
    run_with<T>(in, log, target, draft, target_vocab, draft_vocab, pure);
  } else {
    FuzzTreeModel<T> target(log, target_seed, pure, row_vocab, target_vocab);
    run_with<T>(in, log, target, multi_drafter, target_vocab, draft_vocab, pure);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    run<float>(in);
  } else {
    run<double>(in);
  }
  return 0;
}
