// libFuzzer harness: the checked verification entry points of the exact core
// (verify_speculative_checked, verify_speculative_proposals_checked, verify_greedy_checked,
// verify_tree_checked, verify_tree_greedy_checked, BatchVerifier::verify_checked,
// validate_probability_row, validate_token) and the samplers that must never leave [0, V)
// (sample_from_row, sample_residual, sample_residual_one_hot, residual_distribution), fed
// V, gamma, rows and draft tokens decoded from arbitrary bytes: NaN, Inf, negatives,
// denormals, all-zero rows, rows off 1 by about the tolerance, wrong row counts and widths,
// tokens out of range, V from 0 to 2^16 + 65 (V = 256k is covered by numerical_edges_test).
//
// Invariants (a violation aborts):
//  - a malformed input throws specdec::error whose code is one the input actually violates
//    (reference check in fuzz_support.hpp), with the documented message shape; a valid
//    input never throws;
//  - a valid input gives 0 <= n <= gamma, t in [0, V), source = bonus iff n = gamma,
//    p_i(x_i) > 0 for every accepted draft, p_{n+1}(t) > 0; for lenience 1 without fallback
//    a correction has p(t) > q(t) (one-hot drafts: t != x_{n+1}); greedy results equal a
//    reference argmax; the checked and unchecked paths agree for equal seeds;
//  - the samplers return tokens in [0, V) for any row, however malformed.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "specdec/batch_verification.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/error.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/tree_verification.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"

namespace {

using specdec::errc;
using specdec::RowsView;
using specdec::token_id;
using specdec::fuzzing::check_error;
using specdec::fuzzing::expected_row_error;

// Memory cap: at most this many entries over all rows of one input (2 MiB of doubles).
constexpr std::size_t max_entries = std::size_t{1} << 18;

enum class entry_point : std::uint8_t {
  speculative,
  proposals,
  greedy,
  validate_row,
  samplers,
  tree,
  batch,
  count
};

std::size_t pick_vocab(FuzzedDataProvider& in) {
  const int range = in.ConsumeIntegralInRange<int>(0, 31);
  if (range == 31 && in.ConsumeIntegral<std::uint16_t>() != 0xA55A) return 42;
  if (range < 4) return in.ConsumeIntegralInRange<std::size_t>(0, 3);  // tiny, V = 0 included
  if (range < 20) return in.ConsumeIntegralInRange<std::size_t>(1, 16);
  if (range < 28) return in.ConsumeIntegralInRange<std::size_t>(17, 300);
  if (range < 31) return in.ConsumeIntegralInRange<std::size_t>(301, 5000);
  // Huge, gated by a 16-bit magic value (each costs milliseconds under the sanitizers):
  // around the sizes where the mass table's superblocks grow past one block each.
  static constexpr std::size_t bases[] = {16384, 16384, 32768, 65536};
  const std::size_t base = bases[in.ConsumeIntegralInRange<std::size_t>(0, std::size(bases) - 1)];
  return base + in.ConsumeIntegralInRange<std::size_t>(0, 130) - 65;
}

// A block of `rows` rows of width `width`, each filled by its own kind.
template <class T>
std::vector<T> make_rows(FuzzedDataProvider& in, std::size_t rows, std::size_t width) {
  std::vector<T> data(rows * width);
  for (std::size_t i = 0; i < rows; ++i) {
    const std::span<T> row(data.data() + i * width, width);
    const std::span<const T> previous =
        i == 0 ? std::span<const T>() : std::span<const T>(data.data() + (i - 1) * width, width);
    specdec::fuzzing::fill_row(in, specdec::fuzzing::pick_row_kind(in), row, previous);
  }
  return data;
}

// Draft tokens: in range most of the time, sampled from q when asked, or any int32.
template <class T>
std::vector<token_id> make_tokens(FuzzedDataProvider& in, std::size_t gamma, std::size_t vocab,
                                  const std::vector<T>* draft_rows, std::size_t draft_width) {
  std::vector<token_id> tokens(gamma);
  const int mode = in.ConsumeIntegralInRange<int>(0, 9);
  specdec::xoshiro256pp g(in.ConsumeIntegral<std::uint64_t>());
  for (std::size_t i = 0; i < gamma; ++i) {
    if (mode == 0) {
      tokens[i] = in.ConsumeIntegral<token_id>();
    } else if (mode <= 4 && draft_rows != nullptr && draft_width == vocab && vocab > 0 &&
               (i + 1) * draft_width <= draft_rows->size()) {
      const std::span<const T> q(draft_rows->data() + i * draft_width, draft_width);
      tokens[i] = specdec::sample_from_row(q, g);
    } else if (vocab > 0) {
      tokens[i] = static_cast<token_id>(in.ConsumeIntegralInRange<std::size_t>(0, vocab - 1));
    } else {
      tokens[i] = 0;
    }
  }
  return tokens;
}

bool token_in_range(token_id token, std::size_t vocab) {
  return token >= 0 && static_cast<std::size_t>(token) < vocab;
}

// Shape problems shared by the verifiers, and the row problems of a block of rows.
template <class T>
void add_row_errors(std::vector<errc>& problems, bool& ambiguous, const std::vector<T>& data,
                    std::size_t rows, std::size_t width, std::size_t vocab) {
  for (std::size_t i = 0; i < rows; ++i) {
    const std::span<const T> row(data.data() + i * width, width);
    if (const auto code =
            expected_row_error(row, vocab, specdec::default_sum_tolerance<T>, ambiguous)) {
      problems.push_back(*code);
    }
  }
}

// One stochastic step (with draft rows, or proposal-only with `proposals`).
template <class T>
void fuzz_speculative(FuzzedDataProvider& in, bool proposals) {
  const std::size_t vocab = pick_vocab(in);
  std::size_t gamma = in.ConsumeIntegralInRange<std::size_t>(0, 12);
  while (gamma > 0 && (2 * gamma + 2) * (vocab + 1) > max_entries) --gamma;
  // Shape mutations (rare): wrong row counts, a draft width differing from the target's.
  const std::uint8_t shape = in.ConsumeIntegral<std::uint8_t>();
  std::size_t target_count = gamma + 1;
  std::size_t draft_count = gamma;
  std::size_t draft_width = vocab;
  if (shape >= 200) {
    switch (shape % 6) {
      case 0:
        target_count = gamma;
        break;
      case 1:
        target_count = gamma + 2;
        break;
      case 2:
        draft_count = gamma + 1;
        break;
      case 3:
        draft_count = gamma == 0 ? 1 : gamma - 1;
        break;
      case 4:
        draft_width = vocab + 1;
        break;
      default:
        draft_width = vocab == 0 ? 0 : vocab - 1;
        break;
    }
  }
  double lenience = 1.0;
  const std::uint8_t lenience_kind = in.ConsumeIntegral<std::uint8_t>();
  if (lenience_kind >= 192) {
    static constexpr double choices[] = {0.5, 0.999, 1e-300, 0.0, -1.0, 1.0000001, 2.0};
    lenience = lenience_kind >= 250 ? specdec::fuzzing::special_value<double>(in)
                                    : choices[lenience_kind % std::size(choices)];
  }
  const std::vector<T> target = make_rows<T>(in, target_count, vocab);
  const std::vector<T> draft =
      proposals ? std::vector<T>() : make_rows<T>(in, draft_count, draft_width);
  const std::vector<token_id> tokens =
      make_tokens<T>(in, gamma, vocab, proposals ? nullptr : &draft, draft_width);
  const std::uint64_t seed = in.ConsumeIntegral<std::uint64_t>();

  // The problems this input has, as the checked entry point documents them.
  std::vector<errc> problems;
  bool ambiguous = false;
  if (!(lenience > 0.0 && lenience <= 1.0)) problems.push_back(errc::domain);
  if (!proposals && draft_width != vocab && draft_count != 0)
    problems.push_back(errc::vocab_mismatch);
  if (target_count != gamma + 1 || vocab == 0) problems.push_back(errc::invalid_size);
  if (!proposals && draft_count != gamma) problems.push_back(errc::invalid_size);
  add_row_errors(problems, ambiguous, target, target_count, vocab, vocab);
  if (!proposals) add_row_errors(problems, ambiguous, draft, draft_count, draft_width, vocab);
  for (const token_id token : tokens) {
    if (!token_in_range(token, vocab)) problems.push_back(errc::invalid_token);
  }

  const RowsView<const T> target_rows(target.data(), target_count, vocab);
  const RowsView<const T> draft_rows(draft.data(), proposals ? 0 : draft_count, draft_width);
  const specdec::SpeculativeSamplingOptions options{lenience};
  specdec::xoshiro256pp g(seed);
  specdec::VerificationResult result;
  try {
    result = proposals
                 ? specdec::verify_speculative_proposals_checked(std::span<const token_id>(tokens),
                                                                 target_rows, g, options, 3)
                 : specdec::verify_speculative_checked(std::span<const token_id>(tokens),
                                                       draft_rows, target_rows, g, options, 3);
  } catch (const specdec::error& e) {
    if (!(ambiguous && problems.empty())) check_error(e, problems);
    return;
  }
  SPECDEC_FUZZ_CHECK(problems.empty() || ambiguous);

  // Valid input: the result's invariants.
  SPECDEC_FUZZ_CHECK(result.accepted <= gamma);
  SPECDEC_FUZZ_CHECK(token_in_range(result.token, vocab));
  SPECDEC_FUZZ_CHECK((result.source == specdec::token_source::bonus) == (result.accepted == gamma));
  SPECDEC_FUZZ_CHECK(result.source != specdec::token_source::draft);
  for (std::size_t i = 0; i < result.accepted; ++i) {
    SPECDEC_FUZZ_CHECK(target_rows(i, static_cast<std::size_t>(tokens[i])) > T(0));
  }
  const std::size_t n = result.accepted;
  const auto t = static_cast<std::size_t>(result.token);
  SPECDEC_FUZZ_CHECK(target_rows(n, t) > T(0));
  if (result.source == specdec::token_source::bonus) SPECDEC_FUZZ_CHECK(!result.residual_fallback);
  if (result.source == specdec::token_source::correction && lenience == 1.0 &&
      !result.residual_fallback) {
    if (proposals) {
      SPECDEC_FUZZ_CHECK(result.token != tokens[n]);
    } else {
      SPECDEC_FUZZ_CHECK(target_rows(n, t) > draft_rows(n, t));
    }
  }
  // The unchecked fast path with the same seed gives the same result.
  specdec::xoshiro256pp again(seed);
  const specdec::VerificationResult unchecked =
      proposals ? specdec::verify_speculative_proposals(std::span<const token_id>(tokens),
                                                        target_rows, again, options)
                : specdec::verify_speculative(std::span<const token_id>(tokens), draft_rows,
                                              target_rows, again, options);
  SPECDEC_FUZZ_CHECK(unchecked == result);
}

// Lowest id among the maxima (reference for greedy verification).
template <class T>
token_id reference_argmax(std::span<const T> row) {
  std::size_t best = 0;
  for (std::size_t j = 1; j < row.size(); ++j) {
    if (row[j] > row[best]) best = j;
  }
  return static_cast<token_id>(best);
}

template <class T>
void fuzz_greedy(FuzzedDataProvider& in) {
  const std::size_t vocab = pick_vocab(in);
  std::size_t gamma = in.ConsumeIntegralInRange<std::size_t>(0, 12);
  while (gamma > 0 && (gamma + 2) * (vocab + 1) > max_entries) --gamma;
  const std::uint8_t shape = in.ConsumeIntegral<std::uint8_t>();
  std::size_t target_count = gamma + 1;
  if (shape >= 220) target_count = shape % 2 == 0 ? gamma : gamma + 2;
  const std::vector<T> target = make_rows<T>(in, target_count, vocab);
  std::vector<token_id> tokens = make_tokens<T>(in, gamma, vocab, nullptr, vocab);
  // Often draft the target's own argmax, so that long acceptances happen.
  if (vocab > 0 && in.ConsumeBool()) {
    const std::size_t agree = in.ConsumeIntegralInRange<std::size_t>(0, gamma);
    for (std::size_t i = 0; i < agree && i < target_count; ++i) {
      tokens[i] = reference_argmax(std::span<const T>(target.data() + i * vocab, vocab));
    }
  }

  std::vector<errc> problems;
  bool ambiguous = false;
  if (target_count != gamma + 1 || vocab == 0) problems.push_back(errc::invalid_size);
  add_row_errors(problems, ambiguous, target, target_count, vocab, vocab);
  for (const token_id token : tokens) {
    if (!token_in_range(token, vocab)) problems.push_back(errc::invalid_token);
  }
  const RowsView<const T> target_rows(target.data(), target_count, vocab);
  specdec::VerificationResult result;
  try {
    result = specdec::verify_greedy_checked(std::span<const token_id>(tokens), target_rows, 5);
  } catch (const specdec::error& e) {
    if (!(ambiguous && problems.empty())) check_error(e, problems);
    return;
  }
  SPECDEC_FUZZ_CHECK(problems.empty() || ambiguous);
  // Exact reference: accept while x_i is the argmax, then the argmax of the next row.
  std::size_t accepted = 0;
  while (accepted < gamma && tokens[accepted] == reference_argmax(target_rows.row(accepted))) {
    ++accepted;
  }
  SPECDEC_FUZZ_CHECK(result.accepted == accepted);
  SPECDEC_FUZZ_CHECK(result.token == reference_argmax(target_rows.row(accepted)));
  SPECDEC_FUZZ_CHECK(!result.residual_fallback);
  SPECDEC_FUZZ_CHECK((result.source == specdec::token_source::bonus) == (accepted == gamma));
  SPECDEC_FUZZ_CHECK(specdec::verify_greedy(std::span<const token_id>(tokens), target_rows) ==
                     result);
}

// Token trees: verify_tree_checked and verify_tree_greedy_checked on trees built from the
// fuzzer's bytes (sampled nodes with any q row, one-hot nodes, children drawn from q or
// not, duplicates, repeats) and target rows of any kind, count and width.
template <class T>
void fuzz_tree(FuzzedDataProvider& in) {
  using Tree = specdec::DraftTree<T>;
  const std::size_t vocab = in.ConsumeIntegralInRange<std::size_t>(0, 12);
  Tree tree(vocab);
  std::vector<errc> draft_problems;
  bool ambiguous = false;
  specdec::xoshiro256pp draw(in.ConsumeIntegral<std::uint64_t>());
  const std::size_t expansions = vocab == 0 ? 0 : in.ConsumeIntegralInRange<std::size_t>(0, 8);
  for (std::size_t k = 0; k < expansions; ++k) {
    const std::size_t node = in.ConsumeIntegralInRange<std::size_t>(0, tree.size() - 1);
    if (tree.expansion_of(node) == specdec::expansion::none) {
      const int kind = in.ConsumeIntegralInRange<int>(0, 2);
      if (kind == 0) {
        tree.expand(node, specdec::expansion::one_hot);
      } else {
        std::vector<T> q(vocab);
        specdec::fuzzing::fill_row(in, specdec::fuzzing::pick_row_kind(in), std::span<T>(q),
                                   std::span<const T>());
        if (const auto code = expected_row_error(std::span<const T>(q), vocab,
                                                 specdec::default_sum_tolerance<T>, ambiguous)) {
          draft_problems.push_back(*code);
        }
        tree.expand(node,
                    kind == 1 ? specdec::expansion::with_replacement
                              : specdec::expansion::without_replacement,
                    q);
      }
    }
    const specdec::expansion kind = tree.expansion_of(node);
    const bool sampled = kind != specdec::expansion::one_hot;
    const std::size_t children = in.ConsumeIntegralInRange<std::size_t>(1, 3);
    for (std::size_t c = 0; c < children; ++c) {
      token_id token = static_cast<token_id>(in.ConsumeIntegralInRange<std::size_t>(0, vocab - 1));
      if (sampled && in.ConsumeBool()) token = specdec::sample_from_row(tree.draft_row(node), draw);
      if (sampled) {
        // What verify_tree_checked must reject: a child q cannot produce, a repeat under
        // without_replacement. (NaN q entries are row errors, found first.)
        if (!(tree.draft_row(node)[static_cast<std::size_t>(token)] > T(0))) {
          draft_problems.push_back(errc::invalid_token);
        }
        if (kind == specdec::expansion::without_replacement &&
            tree.find_child(node, token) != Tree::npos) {
          draft_problems.push_back(errc::invalid_token);
        }
      }
      (void)tree.add_child(node, token);
    }
    if (kind == specdec::expansion::with_replacement && in.ConsumeBool()) tree.add_repeat(node);
  }
  const std::uint8_t shape = in.ConsumeIntegral<std::uint8_t>();
  std::size_t rows = tree.size();
  std::size_t width = vocab;
  if (shape >= 224) {
    switch (shape % 4) {
      case 0:
        rows = rows + 1;
        break;
      case 1:
        rows = rows - 1;
        break;
      case 2:
        width = vocab + 1;
        break;
      default:
        width = vocab == 0 ? 0 : vocab - 1;
        break;
    }
  }
  const std::vector<T> target = make_rows<T>(in, rows, width);
  std::vector<errc> target_problems;
  if (width != vocab) target_problems.push_back(errc::vocab_mismatch);
  if (rows != tree.size() || vocab == 0) target_problems.push_back(errc::invalid_size);
  add_row_errors(target_problems, ambiguous, target, rows, width, vocab);
  const specdec::RowsView<const T> target_rows(target.data(), rows, width);
  const std::uint64_t seed = in.ConsumeIntegral<std::uint64_t>();

  // Stochastic: target checks, then the tree's own checks.
  std::vector<errc> problems = target_problems;
  problems.insert(problems.end(), draft_problems.begin(), draft_problems.end());
  specdec::TreeVerificationWorkspace<T> workspace;
  specdec::xoshiro256pp g(seed);
  bool thrown = false;
  specdec::TreeVerificationResult result;
  try {
    result = specdec::verify_tree_checked(tree, target_rows, g, workspace, 2);
  } catch (const specdec::error& e) {
    thrown = true;
    if (!(ambiguous && problems.empty())) check_error(e, problems);
  }
  if (!thrown) {
    SPECDEC_FUZZ_CHECK(problems.empty() || ambiguous);
    SPECDEC_FUZZ_CHECK(result.node < tree.size());
    SPECDEC_FUZZ_CHECK(result.accepted == tree.depth(result.node));
    SPECDEC_FUZZ_CHECK(token_in_range(result.token, vocab));
    SPECDEC_FUZZ_CHECK(result.source != specdec::token_source::draft);
    SPECDEC_FUZZ_CHECK(target_rows(result.node, static_cast<std::size_t>(result.token)) > T(0));
    for (std::size_t node = result.node; node != Tree::root; node = tree.parent(node)) {
      SPECDEC_FUZZ_CHECK(
          target_rows(tree.parent(node), static_cast<std::size_t>(tree.token(node))) > T(0));
    }
    specdec::xoshiro256pp again(seed);
    SPECDEC_FUZZ_CHECK(specdec::verify_tree(tree, target_rows, again, workspace) == result);
  }

  // Greedy: only the target rows are checked.
  specdec::TreeVerificationResult greedy;
  try {
    greedy = specdec::verify_tree_greedy_checked(tree, target_rows, 2);
  } catch (const specdec::error& e) {
    if (!(ambiguous && target_problems.empty())) check_error(e, target_problems);
    return;
  }
  SPECDEC_FUZZ_CHECK(target_problems.empty() || ambiguous);
  // Reference: descend into the first child holding the argmax, then emit the argmax.
  std::size_t node = Tree::root;
  for (;;) {
    const token_id best = reference_argmax(target_rows.row(node));
    std::size_t next = Tree::npos;
    for (std::size_t c = tree.first_child(node); c != Tree::npos; c = tree.next_sibling(c)) {
      if (tree.token(c) == best) {
        next = c;
        break;
      }
    }
    if (next == Tree::npos) {
      SPECDEC_FUZZ_CHECK(greedy.node == node);
      SPECDEC_FUZZ_CHECK(greedy.token == best);
      break;
    }
    node = next;
  }
}

template <class T>
void fuzz_validate_row(FuzzedDataProvider& in) {
  const std::size_t vocab = pick_vocab(in);
  std::size_t width = vocab;
  const std::uint8_t shape = in.ConsumeIntegral<std::uint8_t>();
  if (shape >= 224) width = shape % 2 == 0 ? vocab + 1 : (vocab == 0 ? 0 : vocab - 1);
  std::vector<T> row(width);
  specdec::fuzzing::fill_row(in, specdec::fuzzing::pick_row_kind(in), std::span<T>(row),
                             std::span<const T>());
  // Tolerance: the default, or any non-negative value the caller might pass.
  double tolerance = specdec::default_sum_tolerance<T>;
  if (in.ConsumeBool()) tolerance = std::abs(specdec::fuzzing::special_value<double>(in));
  if (std::isnan(tolerance)) tolerance = 0.0;
  bool ambiguous = false;
  const auto expected = expected_row_error(std::span<const T>(row), vocab, tolerance, ambiguous);
  try {
    specdec::validate_probability_row(std::span<const T>(row), vocab,
                                      specdec::RowLocation{"target", 7, 2}, tolerance);
  } catch (const specdec::error& e) {
    if (!ambiguous || expected) {
      SPECDEC_FUZZ_CHECK(expected.has_value());
      check_error(e, {*expected});
    }
    return;
  }
  SPECDEC_FUZZ_CHECK(!expected || ambiguous);

  const auto token = in.ConsumeIntegral<token_id>();
  try {
    specdec::validate_token(token, vocab, specdec::RowLocation{"draft", 1, 0});
  } catch (const specdec::error& e) {
    check_error(e, {errc::invalid_token});
    SPECDEC_FUZZ_CHECK(!token_in_range(token, vocab));
    return;
  }
  SPECDEC_FUZZ_CHECK(token_in_range(token, vocab));
}

// The samplers promise an index in [0, V) for any row, however malformed.
template <class T>
void fuzz_samplers(FuzzedDataProvider& in) {
  std::size_t vocab = pick_vocab(in);
  if (vocab == 0) vocab = 1;
  if (2 * vocab > max_entries) vocab = max_entries / 2;
  std::vector<T> target(vocab);
  std::vector<T> draft(vocab);
  specdec::fuzzing::fill_row(in, specdec::fuzzing::pick_row_kind(in), std::span<T>(target),
                             std::span<const T>());
  specdec::fuzzing::fill_row(in, specdec::fuzzing::pick_row_kind(in), std::span<T>(draft),
                             std::span<const T>(target));
  double lenience = 1.0;
  if (in.ConsumeBool()) {
    static constexpr double choices[] = {0.5, 0.999, 1e-300, 0.25, 1.0};
    lenience = choices[in.ConsumeIntegralInRange<std::size_t>(0, std::size(choices) - 1)];
  }
  const auto drafted = static_cast<token_id>(in.ConsumeIntegralInRange<std::size_t>(0, vocab - 1));
  specdec::xoshiro256pp g(in.ConsumeIntegral<std::uint64_t>());
  const std::span<const T> p(target);
  const std::span<const T> q(draft);
  SPECDEC_FUZZ_CHECK(token_in_range(specdec::sample_from_row(p, g), vocab));
  const specdec::ResidualDraw residual = specdec::sample_residual(p, q, g, lenience);
  SPECDEC_FUZZ_CHECK(token_in_range(residual.token, vocab));
  const specdec::ResidualDraw one_hot = specdec::sample_residual_one_hot(p, drafted, g, lenience);
  SPECDEC_FUZZ_CHECK(token_in_range(one_hot.token, vocab));
  specdec::residual_distribution<T> distribution(p, q, lenience);
  for (int k = 0; k < 3; ++k) SPECDEC_FUZZ_CHECK(token_in_range(distribution(g), vocab));
  if (!distribution.falls_back()) {
    SPECDEC_FUZZ_CHECK(distribution.mass() > 0.0 && std::isfinite(distribution.mass()));
  }
}

// A ragged batch of up to 6 sequences (BatchVerifier::verify_checked): per-sequence options
// (every kind, some out of range), proposals or model drafts, rows and tokens as above, and
// rare layout mutations. Invariants: a mutated layout (or V = 0) throws before verifying; a
// sequence fails iff it has a problem of its own, with a code among its problems; a verified
// sequence gives 0 <= n <= n_b and t in [0, V), and the same result verified alone.
template <class T>
void fuzz_batch(FuzzedDataProvider& in) {
  const std::size_t vocab = std::min<std::size_t>(pick_vocab(in), 300);
  const std::size_t sequences = in.ConsumeIntegralInRange<std::size_t>(0, 6);
  const bool with_draft_rows = in.ConsumeIntegralInRange<int>(0, 7) != 0;
  std::vector<std::size_t> offsets{0};
  std::vector<token_id> drafts;
  std::vector<T> target;
  std::vector<T> draft;
  std::vector<specdec::SequenceOptions> options;
  std::vector<std::vector<errc>> problems(sequences);
  std::vector<char> ambiguous(sequences, 0);
  const std::uint64_t seed = in.ConsumeIntegral<std::uint64_t>();
  for (std::size_t b = 0; b < sequences; ++b) {
    const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(0, 4);
    specdec::SequenceOptions o;
    o.stream = {seed, b, 0};
    switch (in.ConsumeIntegralInRange<int>(0, 8)) {
      case 1:
        o.sampling.temperature = 0.7;
        break;
      case 2:
        o.sampling.top_k = in.ConsumeIntegralInRange<std::size_t>(1, vocab + 1);
        o.sampling.temperature = 1.3;
        break;
      case 3:
        o.sampling.top_p = 0.6;
        break;
      case 4:
        o.sampling.min_p = 0.2;
        break;
      case 5:
        o.sampling.temperature = 0.0;
        break;
      case 6:
        o.sampling.top_p = 0.0;  // out of range
        break;
      case 7:
        o.sampling.temperature = specdec::fuzzing::special_value<double>(in);
        break;
      default:
        break;
    }
    const std::uint8_t lenience_kind = in.ConsumeIntegral<std::uint8_t>();
    if (lenience_kind >= 224) o.lenience = lenience_kind >= 240 ? 0.0 : 0.5;
    o.proposals = in.ConsumeIntegralInRange<int>(0, 3) == 0;
    const std::vector<T> p = make_rows<T>(in, n + 1, vocab);
    const std::vector<T> q = make_rows<T>(in, n, vocab);
    const std::vector<token_id> tokens = make_tokens<T>(in, n, vocab, &q, vocab);
    // This sequence's problems, in verify_checked's order.
    bool options_valid = true;
    try {
      o.sampling.validate();
    } catch (const specdec::error&) {
      options_valid = false;
      problems[b].push_back(errc::invalid_option);
    }
    if (!(o.lenience > 0.0 && o.lenience <= 1.0)) problems[b].push_back(errc::domain);
    const bool greedy = options_valid && o.sampling.greedy();
    bool unclear = false;
    const double tolerance =
        greedy ? std::numeric_limits<double>::infinity() : specdec::default_sum_tolerance<T>;
    for (std::size_t i = 0; i <= n; ++i) {
      const std::span<const T> row(p.data() + i * vocab, vocab);
      if (const auto code = expected_row_error(row, vocab, tolerance, unclear)) {
        problems[b].push_back(*code);
      }
    }
    if (!greedy && !o.proposals && n > 0) {
      if (!with_draft_rows) problems[b].push_back(errc::invalid_size);
      add_row_errors(problems[b], unclear, q, n, vocab, vocab);
    }
    for (const token_id token : tokens) {
      if (!token_in_range(token, vocab)) problems[b].push_back(errc::invalid_token);
    }
    ambiguous[b] = unclear ? 1 : 0;
    drafts.insert(drafts.end(), tokens.begin(), tokens.end());
    offsets.push_back(drafts.size());
    target.insert(target.end(), p.begin(), p.end());
    draft.insert(draft.end(), q.begin(), q.end());
    options.push_back(o);
  }
  // Rare layout mutations.
  std::size_t target_count = drafts.size() + sequences;
  const std::size_t draft_count = with_draft_rows ? drafts.size() : 0;
  bool layout_error = sequences > 0 && vocab == 0;
  const std::uint8_t shape = in.ConsumeIntegral<std::uint8_t>();
  if (shape >= 240 && sequences > 0) {
    layout_error = true;
    switch (shape % 4) {
      case 0:
        offsets.back() += 1;
        break;
      case 1:
        target_count -= 1;
        break;
      case 2:
        offsets.front() = 1;
        break;
      default:
        options.pop_back();
        break;
    }
  }
  const specdec::RaggedBatch<T> batch{drafts, offsets,
                                      RowsView<const T>(target.data(), target_count, vocab),
                                      RowsView<const T>(draft.data(), draft_count, vocab)};
  specdec::BatchVerifier<T> verifier(1);
  specdec::BatchVerification out;
  try {
    verifier.verify_checked(batch, options, out);
  } catch (const specdec::error& e) {
    if (layout_error) {
      check_error(e, {errc::invalid_size, errc::vocab_mismatch});
      return;
    }
    const std::string what = e.what();
    SPECDEC_FUZZ_CHECK(what.find(": sequence ") != std::string::npos);
  }
  SPECDEC_FUZZ_CHECK(!layout_error);
  SPECDEC_FUZZ_CHECK(out.size() == sequences);
  for (std::size_t b = 0; b < sequences; ++b) {
    if (!out.ok(b)) {
      SPECDEC_FUZZ_CHECK(!problems[b].empty() || ambiguous[b] != 0);
      try {
        std::rethrow_exception(out.error(b));
      } catch (const specdec::error& e) {
        if (!problems[b].empty()) check_error(e, problems[b]);
      }
      continue;
    }
    SPECDEC_FUZZ_CHECK(problems[b].empty());
    const specdec::VerificationResult& result = out.result(b);
    SPECDEC_FUZZ_CHECK(result.accepted <= batch.drafted(b));
    SPECDEC_FUZZ_CHECK(token_in_range(result.token, vocab));
    SPECDEC_FUZZ_CHECK(out.emitted(b).size() == result.accepted + 1);
    // The same result verified alone.
    const std::vector<std::size_t> one{0, batch.drafted(b)};
    const specdec::RaggedBatch<T> alone{
        batch.drafts(b), one, batch.target(b),
        with_draft_rows ? batch.draft(b) : RowsView<const T>(draft.data(), 0, vocab)};
    specdec::BatchVerification single;
    verifier.verify(alone, std::span<const specdec::SequenceOptions>(&options[b], 1), single);
    SPECDEC_FUZZ_CHECK(single.result(0) == result);
  }
}

template <class T>
void run(FuzzedDataProvider& in, entry_point entry) {
  switch (entry) {
    case entry_point::speculative:
      fuzz_speculative<T>(in, false);
      break;
    case entry_point::proposals:
      fuzz_speculative<T>(in, true);
      break;
    case entry_point::greedy:
      fuzz_greedy<T>(in);
      break;
    case entry_point::validate_row:
      fuzz_validate_row<T>(in);
      break;
    case entry_point::tree:
      fuzz_tree<T>(in);
      break;
    case entry_point::batch:
      fuzz_batch<T>(in);
      break;
    case entry_point::samplers:
    case entry_point::count:
      fuzz_samplers<T>(in);
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const auto selector = in.ConsumeIntegral<std::uint8_t>();
  // Selectors >= 240 drive token trees and 224-239 ragged batches (added last; the other
  // entry points keep the mapping the seed corpus was made with: selector / 2 mod 5).
  const auto entry = selector >= 240   ? entry_point::tree
                     : selector >= 224 ? entry_point::batch
                                       : static_cast<entry_point>((selector >> 1U) % 5U);
  if ((selector & 1U) == 0) {
    run<float>(in, entry);
  } else {
    run<double>(in, entry);
  }
  return 0;
}
