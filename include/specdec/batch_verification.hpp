// specdec — batch verification: Algorithm 1 for many sequences in one call, laid out
// raggedly, on several threads, each sequence's result independent of the batch.
//
// A serving engine scores the drafts of every active sequence in one target call and holds
// the rows flattened, the way vLLM's rejection sampler takes them:
//
//   draft_tokens   x of sequence 0 | x of sequence 1 | ...            N = sum of n_b tokens
//   draft_offsets  0 = o_0 <= o_1 <= ... <= o_B = N                    sequence b drafted
//                                                                      draft_tokens[o_b, o_{b+1})
//   target_rows    N + B rows: sequence b's n_b + 1 rows p_1..p_{n_b + 1} start at row o_b + b
//   draft_rows     N rows, row k the q that draft_tokens[k] was sampled from (or no rows
//                  at all when every sequence proposes its drafts)
//
// Every sequence has its own draft count (0 = nothing drafted this step: one token from
// p_1), its own SamplingOptions (applied alike to its p and q rows, as the decoder applies
// them), its own lenience, proposals or model drafts, and its own random stream
// stream_engine(key). A sequence's result is exactly what verify_speculative,
// verify_speculative_proposals or verify_greedy returns for its rows (standardized by its
// options) with the generator stream_engine(key) (top-k rows: see below), and it is
// bit-identical alone or in any batch, at any position, on one thread or many
// (tests/batch_verification_test.cpp).
//
// Work: sequences are handed to the executor's tasks one at a time (an atomic counter), each
// task with its own workspace (a Standardizer and two rows), so that after the first batch
// of a given V and options nothing allocates. Rows are read lazily, as verify_speculative
// reads them: at T = 1 without truncation the rows are used as given (normalised rows, the
// precondition of verify_speculative); otherwise p_i and q_i are standardized when the
// decisions first read position i, and rows after the first rejection are never touched.
// Rows truncated by top-k (0 < top_k < V) are kept as their survivors, as the decoder keeps
// them (Standardizer::apply_sparse: one selection pass per row; the decisions, the residual
// and the bonus read the survivors only). Their decisions equal the dense path's bitwise;
// their final draw sums the survivors in id order (the dense kernels sum in lanes), so its
// token can differ from verify_speculative's on the dense rows only where u falls within
// rounding of a boundary between two tokens.
//
// Block verification (SequenceOptions::verification, BatchDecoder's default): a sequence's
// model drafts at T > 0 are decided as a block, exactly as verify_block decides them on its
// standardized rows (dense rows are then all standardized first, since the block rule reads
// the drafted entry of every row); top-k rows as the decoder's verify_survivors_block.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "specdec/block_verification.hpp"
#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/detail/sparse_rows.hpp"
#include "specdec/error.hpp"
#include "specdec/executor.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/validation.hpp"
#include "specdec/verification_result.hpp"
#include "specdec/verify_stage.hpp"

namespace specdec {

/// Written after a sequence's emitted tokens in the padded form (BatchVerification::
/// write_padded): never a valid token id.
inline constexpr token_id padding_token = -1;

/// A view of a ragged batch (layout at the top of this header). Nothing is copied.
template <ProbabilityScalar T>
struct RaggedBatch {
  std::span<const token_id> draft_tokens;
  std::span<const std::size_t> draft_offsets;  ///< B + 1 offsets into draft_tokens
  RowsView<const T> target_rows;               ///< N + B rows
  RowsView<const T> draft_rows;                ///< N rows, or none (every sequence proposes)

  /// B, the number of sequences.
  [[nodiscard]] std::size_t size() const noexcept {
    return draft_offsets.empty() ? 0 : draft_offsets.size() - 1;
  }
  [[nodiscard]] std::size_t vocab_size() const noexcept { return target_rows.cols(); }
  /// n_b, the number of drafts of sequence b.
  [[nodiscard]] std::size_t drafted(std::size_t b) const noexcept {
    return draft_offsets[b + 1] - draft_offsets[b];
  }
  [[nodiscard]] std::span<const token_id> drafts(std::size_t b) const noexcept {
    return draft_tokens.subspan(draft_offsets[b], drafted(b));
  }
  /// p_1..p_{n_b + 1} of sequence b.
  [[nodiscard]] RowsView<const T> target(std::size_t b) const noexcept {
    return target_rows.subrows(draft_offsets[b] + b, drafted(b) + 1);
  }
  /// q_1..q_{n_b} of sequence b (no rows if the batch has none).
  [[nodiscard]] RowsView<const T> draft(std::size_t b) const noexcept {
    if (draft_rows.rows() == 0) return RowsView<const T>(draft_rows.data(), 0, target_rows.cols());
    return draft_rows.subrows(draft_offsets[b], drafted(b));
  }
};

/// One sequence's part in a batch.
struct SequenceOptions {
  SamplingOptions sampling{};  ///< applied alike to its p and q rows (T = 0: greedy)
  double lenience = 1.0;       ///< paper App. A.5; 1 = exact Algorithm 1
  bool proposals = false;      ///< drafts proposed without rows (n-gram, prompt lookup): q one-hot
  StreamKey stream{};          ///< its uniforms: stream_engine(stream)
  /// token (the default here): Algorithm 1, bitwise verify_speculative. automatic or block:
  /// block verification (verify_block: the drafted block decided as a whole; exact, never
  /// fewer accepted drafts in expectation) for model drafts at T > 0; proposals, greedy
  /// sequences and lenience < 1 keep Algorithm 1 (block with lenience < 1 is an
  /// invalid_option error). BatchDecoder passes its requests' rule (automatic by default).
  verification_rule verification = verification_rule::token;

  /// Whether this sequence's model drafts are verified by blocks.
  [[nodiscard]] bool uses_block() const noexcept {
    return verification != verification_rule::token && !proposals && !sampling.greedy() &&
           lenience == 1.0;
  }
};

/// The outcome of one batch: per sequence its VerificationResult and the tokens it emits
/// (its accepted drafts, then t). Reused across calls: once grown it does not allocate.
class BatchVerification {
 public:
  [[nodiscard]] std::size_t size() const noexcept { return results_.size(); }

  /// Whether sequence b was verified (always, except for the sequences verify_checked
  /// rejected).
  [[nodiscard]] bool ok(std::size_t b) const noexcept { return ok_[b] != 0; }

  [[nodiscard]] const VerificationResult& result(std::size_t b) const noexcept {
    SPECDEC_ASSERT(b < size());
    return results_[b];
  }

  /// The tokens sequence b emits: accepted drafts x_1..x_n, then t (empty if !ok(b)).
  [[nodiscard]] std::span<const token_id> emitted(std::size_t b) const noexcept {
    SPECDEC_ASSERT(b < size());
    if (!ok(b)) return {};
    return {tokens_.data() + first_[b], results_[b].accepted + 1};
  }

  /// Why verify_checked rejected sequence b (null if ok(b)): a specdec::error naming it.
  [[nodiscard]] std::exception_ptr error(std::size_t b) const noexcept {
    SPECDEC_ASSERT(b < size());
    return errors_[b];
  }

  /// The longest emitted(b) of the batch.
  [[nodiscard]] std::size_t max_emitted() const noexcept {
    std::size_t longest = 0;
    for (std::size_t b = 0; b < size(); ++b) longest = std::max(longest, emitted(b).size());
    return longest;
  }

  /// The padded form engines keep: `out` holds size() rows of `width` tokens, row b being
  /// emitted(b) followed by padding_token. Throws specdec::error (errc::invalid_size) if
  /// out.size() != size() * width or width < max_emitted().
  void write_padded(std::span<token_id> out, std::size_t width) const {
    if (out.size() != size() * width) {
      detail::throw_error(errc::invalid_size, "padded output: has ", out.size(),
                          " entries, expected ", size(), " sequences times the width ", width);
    }
    if (width < max_emitted()) {
      detail::throw_error(errc::invalid_size, "padded output: width ", width,
                          " is less than the longest emitted sequence (", max_emitted(),
                          " tokens)");
    }
    for (std::size_t b = 0; b < size(); ++b) {
      const std::span<const token_id> tokens = emitted(b);
      const auto row = out.subspan(b * width, width);
      std::copy(tokens.begin(), tokens.end(), row.begin());
      std::fill(row.begin() + static_cast<std::ptrdiff_t>(tokens.size()), row.end(), padding_token);
    }
  }

 private:
  template <ProbabilityScalar>
  friend class BatchVerifier;

  void prepare(std::size_t sequences, std::span<const std::size_t> offsets, std::size_t slots) {
    results_.assign(sequences, VerificationResult{});
    ok_.assign(sequences, 1);
    errors_.resize(sequences);
    std::fill(errors_.begin(), errors_.end(), nullptr);
    first_.resize(sequences);
    for (std::size_t b = 0; b < sequences; ++b) first_[b] = offsets[b] + b;
    tokens_.resize(slots);
  }

  void store(std::size_t b, const VerificationResult& result, std::span<const token_id> drafts,
             std::size_t drafted) noexcept {
    results_[b] = result;
    token_id* out = tokens_.data() + first_[b];
    std::copy(drafts.begin(), drafts.begin() + static_cast<std::ptrdiff_t>(result.accepted), out);
    out[result.accepted] = result.token;
    std::fill(out + result.accepted + 1, out + drafted + 1, padding_token);
  }

  void fail(std::size_t b, std::exception_ptr error, std::size_t drafted) noexcept {
    results_[b] = VerificationResult{};
    ok_[b] = 0;
    errors_[b] = std::move(error);
    std::fill(tokens_.data() + first_[b], tokens_.data() + first_[b] + drafted + 1, padding_token);
  }

  std::vector<VerificationResult> results_;
  std::vector<unsigned char> ok_;
  std::vector<std::exception_ptr> errors_;  // verify_checked: why sequence b failed
  std::vector<std::size_t> first_;          // where sequence b's tokens start in tokens_
  std::vector<token_id> tokens_;            // N + B slots
};

/// A draft token for a sequence, sampled from its q standardized exactly as BatchVerifier
/// standardizes it (greedy: the argmax; T = 1 without truncation: q as given). `scratch` has
/// the row's size. `top_probability`, if given, receives the largest standardized
/// probability (what a gamma policy's continue_drafting reads). Drafts an engine samples this way,
/// with stream_engine(key, stream_purpose::draft), make batch verification exact.
template <ProbabilityScalar T, std::uniform_random_bit_generator G>
[[nodiscard]] token_id sample_standardized(Standardizer<T>& standardizer, std::span<const T> row,
                                           std::span<T> scratch, G& g,
                                           double* top_probability = nullptr) {
  SPECDEC_ASSERT(scratch.size() == row.size());
  if (standardizer.greedy()) {
    const token_id best = argmax(row);
    if (top_probability != nullptr) {
      *top_probability = static_cast<double>(row[static_cast<std::size_t>(best)]);
    }
    return best;
  }
  if (standardizer.identity()) {
    if (top_probability != nullptr) {
      *top_probability = static_cast<double>(detail::max_entry(row.data(), row.size()));
    }
    return sample_from_row(row, g);
  }
  const double top = standardizer.apply(row, scratch);
  if (top_probability != nullptr) *top_probability = top;
  return sample_from_row(std::span<const T>(scratch), g);
}

/// Verifies ragged batches (layout at the top of this header) on an executor's threads.
///
/// @code
/// specdec::BatchVerifier<float> verifier;          // a ThreadPool, one task per core
/// specdec::BatchVerification out;
/// verifier.verify(batch, options, out);            // options: one SequenceOptions each
/// for (std::size_t b = 0; b < out.size(); ++b) append(b, out.emitted(b));
/// @endcode
template <ProbabilityScalar T>
class BatchVerifier {
 public:
  /// Owns a ThreadPool of `threads` threads (0: one per hardware thread; 1: the caller's).
  explicit BatchVerifier(std::size_t threads = 0)
      : pool_(std::make_unique<ThreadPool>(threads)),
        executor_(*pool_),
        workspaces_(executor_.concurrency()) {}

  /// Runs on `executor` (which must outlive the verifier), with executor.concurrency()
  /// workspaces.
  explicit BatchVerifier(executor_ref executor)
      : executor_(executor), workspaces_(std::max<std::size_t>(1, executor_.concurrency())) {}

  /// How many sequences can be verified at once.
  [[nodiscard]] std::size_t concurrency() const noexcept { return workspaces_.size(); }

  /// The default of set_parallel_threshold: 2^20 entries.
  static constexpr std::size_t default_parallel_threshold = std::size_t{1} << 20U;

  /// A batch runs on the executor's threads when the entries it reads at least (per
  /// sequence: the 2 rows of its final draw at T = 1 without truncation, else its 2 (n_b + 1)
  /// rows, each standardized whole, times V) reach `entries`, else on the calling thread: waking a
  /// sleeping worker costs tens of microseconds (35-45 us for an empty run of a 2-thread pool on
  /// the 2-core benchmark host), as much as a small batch's whole work. Results do not depend on
  /// it. 0: always on the executor.
  void set_parallel_threshold(std::size_t entries) noexcept { parallel_entries_ = entries; }

  /// Allocates every workspace's rows, survivor lists and standardization scratch for rows of
  /// `vocab_size` entries and any options now, so that no batch of that V allocates in the verifier
  /// (the BatchVerification grows on its first batch of a given size).
  void reserve(std::size_t vocab_size) {
    for (workspace& work : workspaces_) {
      if (work.p.size() < vocab_size) work.p.resize(vocab_size);
      if (work.q.size() < vocab_size) work.q.resize(vocab_size);
      work.each_survivor_buffer([&](auto& buffer) { buffer.reserve(vocab_size); });
      const SamplingOptions kept = work.standardizer.options();
      // Top-k below V and top-p together reserve every buffer apply() may use.
      work.standardizer.set_options({.top_k = 1, .top_p = 0.5});
      work.standardizer.reserve(vocab_size);
      work.standardizer.set_options(kept);
    }
  }

  /// Verifies every sequence of `batch` (unchecked fast path) into `out`. `options` has one
  /// entry per sequence. Throws specdec::error (errc::invalid_option) only for sampling
  /// options or a lenience out of range, naming the sequence, before anything is verified.
  /// Preconditions (asserted in debug builds; verify_checked validates all of them): the
  /// layout above; draft tokens in [0, V); the rows a sequence reads finite, non-negative
  /// and normalised; sequences without proposals have draft rows.
  void verify(const RaggedBatch<T>& batch, std::span<const SequenceOptions> options,
              BatchVerification& out) {
    assert_layout(batch, options);
    for (std::size_t b = 0; b < options.size(); ++b) check_options(b, options[b]);
    out.prepare(batch.size(), batch.draft_offsets, batch.target_rows.rows());
    run(batch, options, [&](std::size_t b, workspace& work) {
      out.store(b, verify_sequence(batch, b, options[b], work), batch.drafts(b), batch.drafted(b));
    });
  }

  /// Validates, then verifies. A malformed layout (offsets, row counts, widths, options
  /// count) throws specdec::error before anything is verified. Then every sequence is
  /// validated (its options, draft tokens and the rows it may read) and, if valid, verified;
  /// if any failed, `out` holds the others' results (out.ok(b) false for the failed ones)
  /// and the error of the first failing sequence is thrown, naming it:
  /// "specdec: invalid_probability: sequence 7 (batch position 2): target row 1: entry for
  /// token 4 is NaN". Rows are validated as validate_probability_row does (greedy
  /// sequences: validate_greedy_row, sums not checked).
  void verify_checked(const RaggedBatch<T>& batch, std::span<const SequenceOptions> options,
                      BatchVerification& out) {
    check_layout(batch, options);
    out.prepare(batch.size(), batch.draft_offsets, batch.target_rows.rows());
    run(batch, options, [&](std::size_t b, workspace& work) {
      try {
        validate_sequence(batch, b, options[b]);
      } catch (const error& e) {
        out.fail(b, std::make_exception_ptr(naming_sequence(e, b, options[b])), batch.drafted(b));
        return;
      } catch (...) {
        out.fail(b, std::current_exception(), batch.drafted(b));
        return;
      }
      out.store(b, verify_sequence(batch, b, options[b], work), batch.drafts(b), batch.drafted(b));
    });
    for (std::size_t b = 0; b < out.size(); ++b) {
      if (!out.ok(b)) std::rethrow_exception(out.errors_[b]);
    }
  }

 private:
  struct workspace {
    Standardizer<T> standardizer;
    std::vector<T> p;  // the standardized target row last read (dense rows)
    std::vector<T> q;  // the standardized draft row last read; sparse rows: apply_sparse's
                       // scratch row
    // Rows truncated by top-k, kept as their survivors: ids and weights of the p and q rows
    // last read, and the residual's weights.
    std::vector<std::uint32_t> p_ids, q_ids;
    std::vector<T> p_weights, q_weights, residual;
    // Block verification over standardized dense rows: all p and q rows of the sequence.
    std::vector<T> block_p, block_q;

    // `f(buffer)` for each of the survivor buffers above.
    template <class F>
    void each_survivor_buffer(F&& f) {
      f(p_ids);
      f(q_ids);
      f(p_weights);
      f(q_weights);
      f(residual);
    }
    // Survivors the buffers hold room for: the smallest of their sizes.
    [[nodiscard]] std::size_t survivor_width() const noexcept {
      return std::min(
          {p_ids.size(), q_ids.size(), p_weights.size(), q_weights.size(), residual.size()});
    }
  };

  // Whether a sequence with these options is verified by verify_block_standardized (its rows
  // standardized whole into the workspace's block rows).
  static bool uses_block_rows(const SequenceOptions& options, std::size_t vocab_size) noexcept {
    const SamplingOptions& s = options.sampling;
    return options.uses_block() && !s.identity() && !s.sparse_for(vocab_size);
  }

  // Sizes every workspace for this batch here, in the calling thread: which workspace meets
  // which sequence depends on the threads' timing, so a workspace grown lazily inside a task
  // could first grow in any later batch of the same shape, and a warm step must not allocate.
  // Standardized sequences need reserve(V); block-verified ones the block rows of the largest
  // gamma among them; top-k ones (verify_sparse) survivor buffers of the largest top_k.
  void prepare_workspaces(const RaggedBatch<T>& batch, std::span<const SequenceOptions> options) {
    const std::size_t vocab_size = batch.vocab_size();
    bool standardized = false;
    std::size_t rows = 0;   // target rows of the block-verified sequences: gamma + 1
    std::size_t width = 0;  // survivors per row of the top-k sequences (verify_sparse)
    for (std::size_t b = 0; b < options.size(); ++b) {
      const SamplingOptions& s = options[b].sampling;
      if (s.greedy() || s.identity()) continue;
      standardized = true;
      if (s.sparse_for(vocab_size)) width = std::max(width, s.top_k);
      if (uses_block_rows(options[b], vocab_size)) {
        rows = std::max(rows, batch.drafts(b).size() + 1);
      }
    }
    if (!standardized) return;
    if (std::ranges::any_of(workspaces_,
                            [&](const workspace& work) { return work.p.size() < vocab_size; })) {
      reserve(vocab_size);
    }
    for (workspace& work : workspaces_) {
      work.each_survivor_buffer([&](auto& buffer) {
        if (buffer.size() < width) buffer.resize(width);
      });
      if (work.block_p.size() < rows * vocab_size) work.block_p.resize(rows * vocab_size);
      if (rows > 0 && work.block_q.size() < (rows - 1) * vocab_size) {
        work.block_q.resize((rows - 1) * vocab_size);
      }
    }
  }

  // Hands sequences 0..count-1 to the executor's tasks, one at a time; task k works with
  // workspace k. `verify_one` must not throw.
  // The entries a batch reads at least: the two rows of each sequence's final draw at T = 1
  // without truncation, every row pair up to it (each standardized whole) otherwise.
  static std::size_t work_entries(const RaggedBatch<T>& batch,
                                  std::span<const SequenceOptions> options) noexcept {
    std::size_t rows = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      rows += options[b].sampling.identity() ? 2 : 2 * (batch.drafted(b) + 1);
    }
    return rows * batch.vocab_size();
  }

  template <class VerifyOne>
  void run(const RaggedBatch<T>& batch, std::span<const SequenceOptions> options,
           VerifyOne&& verify_one) {
    const std::size_t count = batch.size();
    if (count == 0) return;
    prepare_workspaces(batch, options);
    std::atomic<std::size_t> next{0};
    // Nothing may leave a task (a worker thread would terminate): an exception (only
    // std::bad_alloc, while a workspace grows) stops the batch and is rethrown here.
    std::atomic<bool> failed{false};
    std::exception_ptr failure;
    auto task = [&](std::size_t k) {
      workspace& work = workspaces_[k];
      try {
        for (std::size_t b = next.fetch_add(1, std::memory_order_relaxed); b < count;
             b = next.fetch_add(1, std::memory_order_relaxed)) {
          verify_one(b, work);
        }
      } catch (...) {
        if (!failed.exchange(true)) failure = std::current_exception();
        next.store(count, std::memory_order_relaxed);
      }
    };
    if (work_entries(batch, options) < parallel_entries_) {
      task(0);
    } else {
      executor_.run(std::min(count, workspaces_.size()), task);
    }
    if (failure) std::rethrow_exception(failure);
  }

  // One sequence: exactly verify_speculative / verify_speculative_proposals / verify_greedy
  // on its rows standardized by its options, with the generator stream_engine(key).
  static VerificationResult verify_sequence(const RaggedBatch<T>& batch, std::size_t b,
                                            const SequenceOptions& options, workspace& work) {
    const std::span<const token_id> drafts = batch.drafts(b);
    const RowsView<const T> target = batch.target(b);
    if (options.sampling.greedy()) return verify_greedy(drafts, target);
    xoshiro256pp g = stream_engine(options.stream);
    const SpeculativeSamplingOptions verification{options.lenience};
    const bool block = options.uses_block();
    if (options.sampling.identity()) {
      if (block) return verify_block(drafts, batch.draft(b), target, g);
      if (options.proposals) return verify_speculative_proposals(drafts, target, g, verification);
      return verify_speculative(drafts, batch.draft(b), target, g, verification);
    }
    // Standardized rows, each when the decisions first read it (as the decoder does), in the
    // workspace prepare_workspaces sized.
    const std::size_t vocab_size = batch.vocab_size();
    SPECDEC_ASSERT(work.p.size() >= vocab_size && work.q.size() >= vocab_size);
    if (!(work.standardizer.options() == options.sampling)) {
      work.standardizer.set_options(options.sampling);  // validated by the caller
    }
    if (work.standardizer.sparse_for(vocab_size)) {
      return verify_sparse(batch, b, options, work, g);
    }
    if (block) return verify_block_standardized(batch, b, work, g);
    const std::span<T> p(work.p.data(), vocab_size);
    const std::span<T> q(work.q.data(), vocab_size);
    std::size_t p_row = detail::no_index;
    std::size_t q_row = detail::no_index;
    const auto standardized_p = [&](std::size_t i) {
      if (p_row != i) {
        work.standardizer.apply(std::span<const T>(target.row(i)), p);
        p_row = i;
      }
      return std::span<const T>(p);
    };
    const RowsView<const T> draft = batch.draft(b);
    const auto standardized_q = [&](std::size_t i) {
      if (q_row != i) {
        work.standardizer.apply(std::span<const T>(draft.row(i)), q);
        q_row = i;
      }
      return std::span<const T>(q);
    };
    const std::size_t gamma = drafts.size();
    const auto p_at = [&](std::size_t i, std::size_t x) {
      return static_cast<double>(standardized_p(i)[x]);
    };
    if (options.proposals) {
      const std::size_t n = detail::accept_proposals_with(drafts, p_at, g, options.lenience);
      if (n < gamma) {
        const ResidualDraw draw =
            sample_residual_one_hot(standardized_p(n), drafts[n], g, options.lenience);
        return {n, draw.token, token_source::correction, draw.fallback};
      }
    } else {
      const std::size_t n = detail::accept_drafts_with(
          drafts, p_at,
          [&](std::size_t i, std::size_t x) { return static_cast<double>(standardized_q(i)[x]); },
          g, options.lenience);
      if (n < gamma) {
        const ResidualDraw draw =
            sample_residual(standardized_p(n), standardized_q(n), g, options.lenience);
        return {n, draw.token, token_source::correction, draw.fallback};
      }
    }
    return {gamma, sample_from_row(standardized_p(gamma), g), token_source::bonus, false};
  }

  // Block verification of a sequence's standardized dense rows: every row standardized once
  // into the workspace (block verification reads the drafted entries of all of them), then
  // exactly verify_block on them.
  static VerificationResult verify_block_standardized(const RaggedBatch<T>& batch, std::size_t b,
                                                      workspace& work, xoshiro256pp& g) {
    const std::span<const token_id> drafts = batch.drafts(b);
    const RowsView<const T> target = batch.target(b);
    const RowsView<const T> draft = batch.draft(b);
    const std::size_t vocab_size = batch.vocab_size();
    const std::size_t gamma = drafts.size();
    SPECDEC_ASSERT(work.block_p.size() >= (gamma + 1) * vocab_size &&
                   work.block_q.size() >= gamma * vocab_size);  // prepare_workspaces
    for (std::size_t i = 0; i <= gamma; ++i) {
      work.standardizer.apply(std::span<const T>(target.row(i)),
                              std::span<T>(work.block_p.data() + i * vocab_size, vocab_size));
      if (i < gamma) {
        work.standardizer.apply(std::span<const T>(draft.row(i)),
                                std::span<T>(work.block_q.data() + i * vocab_size, vocab_size));
      }
    }
    return verify_block(drafts, RowsView<const T>(work.block_q.data(), gamma, vocab_size),
                        RowsView<const T>(work.block_p.data(), gamma + 1, vocab_size), g);
  }

  // verify_sequence for rows truncated by top-k (0 < top_k < V), kept as their survivors
  // (Standardizer::apply_sparse: one selection pass per row, then nothing reads V entries):
  // the same decisions as on the dense standardized rows (the survivors' weights are the
  // dense row's non-zero entries bitwise) and the same uniforms; the final draw sums the
  // survivors' masses in id order.
  static VerificationResult verify_sparse(const RaggedBatch<T>& batch, std::size_t b,
                                          const SequenceOptions& options, workspace& work,
                                          xoshiro256pp& g) {
    SPECDEC_ASSERT(work.survivor_width() >= options.sampling.top_k);  // prepare_workspaces
    const std::span<const token_id> drafts = batch.drafts(b);
    const RowsView<const T> target = batch.target(b);
    const RowsView<const T> draft = batch.draft(b);
    const std::span<T> scratch(work.q.data(), batch.vocab_size());
    const auto load = [&](const RowsView<const T>& rows, std::size_t i, std::size_t& loaded,
                          std::vector<std::uint32_t>& ids, std::vector<T>& weights,
                          std::size_t& count) {
      if (loaded == i) return;
      double top = 0.0;
      count = work.standardizer.apply_sparse(std::span<const T>(rows.row(i)), scratch, ids.data(),
                                             weights.data(), top);
      loaded = i;
    };
    std::size_t p_row = detail::no_index;
    std::size_t q_row = detail::no_index;
    std::size_t p_count = 0;
    std::size_t q_count = 0;
    const auto p_at = [&](std::size_t i) {
      load(target, i, p_row, work.p_ids, work.p_weights, p_count);
      return detail::sparse_row<T>{work.p_ids.data(), work.p_weights.data(), p_count};
    };
    const auto q_at = [&](std::size_t i) {
      load(draft, i, q_row, work.q_ids, work.q_weights, q_count);
      return detail::sparse_row<T>{work.q_ids.data(), work.q_weights.data(), q_count};
    };
    // The decoder's verification of survivors (verify_stage.hpp), without beta.
    const StepVerdict verdict =
        options.uses_block()
            ? verify_survivors_block(drafts, p_at, q_at, VerifyRules{options.lenience, false}, g,
                                     work.residual.data())
            : verify_survivors(drafts, p_at, q_at, options.proposals,
                               VerifyRules{options.lenience, false}, g, work.residual.data());
    return {verdict.accepted, verdict.token, verdict.source, verdict.fallback};
  }

  static void check_options(std::size_t b, const SequenceOptions& options) {
    try {
      options.sampling.validate();
      validate_lenience(options.lenience);
      if (options.verification == verification_rule::block && options.lenience != 1.0) {
        detail::throw_error(errc::invalid_option,
                            "verification = block needs lenience = 1 (block verification is "
                            "defined for exact sampling), not ",
                            options.lenience);
      }
    } catch (const error& e) {
      throw naming_sequence(e, b, options);
    }
  }

  // `e` with "sequence <id> (batch position <b>): " before its message.
  static error naming_sequence(const error& e, std::size_t b, const SequenceOptions& options) {
    return error(e.code(), "sequence " + std::to_string(options.stream.sequence) +
                               " (batch position " + std::to_string(b) +
                               "): " + detail::bare_message(e));
  }

  static void assert_layout([[maybe_unused]] const RaggedBatch<T>& batch,
                            [[maybe_unused]] std::span<const SequenceOptions> options) noexcept {
#ifndef NDEBUG
    SPECDEC_ASSERT(options.size() == batch.size());
    if (batch.draft_offsets.empty()) return;
    SPECDEC_ASSERT(batch.draft_offsets.front() == 0);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      SPECDEC_ASSERT(batch.draft_offsets[b] <= batch.draft_offsets[b + 1]);
      SPECDEC_ASSERT(batch.draft_rows.rows() != 0 || options[b].proposals ||
                     options[b].sampling.greedy() || batch.drafted(b) == 0);
    }
    SPECDEC_ASSERT(batch.draft_offsets.back() == batch.draft_tokens.size());
    SPECDEC_ASSERT(batch.target_rows.rows() == batch.draft_tokens.size() + batch.size());
    SPECDEC_ASSERT(batch.vocab_size() > 0 || batch.size() == 0);
    SPECDEC_ASSERT(batch.draft_rows.rows() == 0 ||
                   (batch.draft_rows.rows() == batch.draft_tokens.size() &&
                    batch.draft_rows.cols() == batch.vocab_size()));
#endif
  }

  static void check_layout(const RaggedBatch<T>& batch, std::span<const SequenceOptions> options) {
    const std::span<const std::size_t> offsets = batch.draft_offsets;
    if (offsets.empty()) {
      detail::throw_error(errc::invalid_size,
                          "batch: draft_offsets is empty (a batch of B sequences has B + 1 "
                          "offsets, starting at 0)");
    }
    const std::size_t sequences = offsets.size() - 1;
    if (options.size() != sequences) {
      detail::throw_error(errc::invalid_size, "batch: ", options.size(), " sequence options for ",
                          sequences, " sequences (", offsets.size(), " draft offsets)");
    }
    if (offsets.front() != 0) {
      detail::throw_error(errc::invalid_size, "batch: draft_offsets starts at ", offsets.front(),
                          ", not 0");
    }
    for (std::size_t b = 0; b < sequences; ++b) {
      if (offsets[b + 1] < offsets[b]) {
        detail::throw_error(errc::invalid_size, "batch: draft_offsets decreases at batch position ",
                            b, " (", offsets[b], " then ", offsets[b + 1], ")");
      }
    }
    const std::size_t drafts = batch.draft_tokens.size();
    if (offsets.back() != drafts) {
      detail::throw_error(errc::invalid_size, "batch: draft_offsets ends at ", offsets.back(),
                          " but there are ", drafts, " draft tokens");
    }
    if (batch.target_rows.rows() != drafts + sequences) {
      detail::throw_error(errc::invalid_size, "batch: ", batch.target_rows.rows(),
                          " target rows, expected ", drafts + sequences, " (", drafts,
                          " draft tokens plus one row per sequence)");
    }
    if (sequences > 0 && batch.vocab_size() == 0) {
      detail::throw_error(errc::invalid_size, "batch: the vocabulary size is 0");
    }
    if (batch.draft_rows.rows() != 0) {
      if (batch.draft_rows.rows() != drafts) {
        detail::throw_error(errc::invalid_size, "batch: ", batch.draft_rows.rows(),
                            " draft rows, expected one per draft token (", drafts,
                            ") or none (every sequence proposes)");
      }
      if (batch.draft_rows.cols() != batch.vocab_size()) {
        detail::throw_error(errc::vocab_mismatch, "batch: draft rows have ",
                            batch.draft_rows.cols(), " entries but target rows have ",
                            batch.vocab_size());
      }
    }
  }

  static void validate_sequence(const RaggedBatch<T>& batch, std::size_t b,
                                const SequenceOptions& options) {
    options.sampling.validate();
    validate_lenience(options.lenience);
    const std::size_t vocab_size = batch.vocab_size();
    const std::size_t step = options.stream.step;
    const RowsView<const T> target = batch.target(b);
    const bool greedy = options.sampling.greedy();
    for (std::size_t i = 0; i < target.rows(); ++i) {
      const RowLocation where{"target", step, i};
      if (greedy) {
        validate_greedy_row(std::span<const T>(target.row(i)), vocab_size, where);
      } else {
        validate_probability_row(std::span<const T>(target.row(i)), vocab_size, where);
      }
    }
    if (!greedy && !options.proposals) {
      if (batch.draft_rows.rows() == 0 && batch.drafted(b) > 0) {
        detail::throw_error(errc::invalid_size, "draft rows: the batch has none, but the sequence ",
                            "drafted ", batch.drafted(b),
                            " tokens with a model (set proposals for drafts without rows)");
      }
      validate_probability_rows(batch.draft(b), batch.drafted(b), vocab_size, {"draft", step});
    }
    validate_tokens(batch.drafts(b), vocab_size, {"draft", step});
  }

  std::size_t parallel_entries_ = default_parallel_threshold;
  std::unique_ptr<ThreadPool> pool_;  // the default executor (empty with an external one)
  executor_ref executor_;
  std::vector<workspace> workspaces_;
};

}  // namespace specdec
