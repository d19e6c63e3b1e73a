// Tests for include/specdec/batch_verification.hpp and include/specdec/executor.hpp: every
// sequence of a ragged batch gets exactly the single-sequence verification of its rows
// standardized by its options (bitwise), whatever the batch around it, its position and the
// number of threads; the emitted tokens follow the standardized target (chi-square, with the
// broken variant "options applied to p only" caught); greedy sequences equal plain greedy;
// no allocation once warm; the padded form; the random streams.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <set>
#include <span>
#include <thread>
#include <vector>

#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include "specdec/batch_verification.hpp"
#include "specdec/executor.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_sampling.hpp"
#include "support/batch_sequences.hpp"
#include "support/kernel_path_listener.hpp"
#include "support/scripted_uniforms.hpp"
#include "support/statistics.hpp"

namespace {
using specdec::BatchVerification;
using specdec::BatchVerifier;
using specdec::RaggedBatch;
using specdec::RowsView;
using specdec::SamplingOptions;
using specdec::SequenceOptions;
using specdec::StreamKey;
using specdec::token_id;
using specdec::VerificationResult;
using specdec::testing::Batch;
using specdec::testing::random_row;
using specdec::testing::random_sequences;
using specdec::testing::Sequence;

/// What verify_speculative / _proposals / verify_greedy return for the sequence's rows
/// standardized by its options (Standardizer::apply, row by row), with stream_engine(key).
template <class T>
VerificationResult single_sequence(const Sequence<T>& s, std::size_t vocab) {
  const std::size_t gamma = s.drafts.size();
  const RowsView<const T> target(s.target.data(), gamma + 1, vocab);
  if (s.options.sampling.greedy()) return specdec::verify_greedy(s.drafts, target);
  std::vector<T> p(s.target.size());
  std::vector<T> q(s.draft.size());
  specdec::Standardizer<T> standardizer(s.options.sampling);
  for (std::size_t i = 0; i <= gamma; ++i) {
    standardizer.apply(std::span<const T>(s.target.data() + i * vocab, vocab),
                       std::span<T>(p.data() + i * vocab, vocab));
  }
  for (std::size_t i = 0; i < gamma; ++i) {
    standardizer.apply(std::span<const T>(s.draft.data() + i * vocab, vocab),
                       std::span<T>(q.data() + i * vocab, vocab));
  }
  auto g = specdec::stream_engine(s.options.stream);
  const specdec::SpeculativeSamplingOptions options{s.options.lenience};
  const RowsView<const T> standardized(p.data(), gamma + 1, vocab);
  if (s.options.uses_block()) {
    return specdec::verify_block(s.drafts, RowsView<const T>(q.data(), gamma, vocab), standardized,
                                 g);
  }
  if (s.options.proposals) {
    return specdec::verify_speculative_proposals(s.drafts, standardized, g, options);
  }
  return specdec::verify_speculative(s.drafts, RowsView<const T>(q.data(), gamma, vocab),
                                     standardized, g, options);
}

std::vector<token_id> emitted_by(const std::vector<token_id>& drafts,
                                 const VerificationResult& result) {
  std::vector<token_id> tokens(drafts.begin(),
                               drafts.begin() + static_cast<std::ptrdiff_t>(result.accepted));
  tokens.push_back(result.token);
  return tokens;
}

std::vector<token_id> as_vector(std::span<const token_id> tokens) {
  return {tokens.begin(), tokens.end()};
}

}  // namespace

TEST_CASE("stream_engine is a pure function of the key and the purpose", "[batch][random]") {
  const StreamKey key{7, 42, 3};
  auto a = specdec::stream_engine(key);
  auto b = specdec::stream_engine(key);
  for (int k = 0; k < 100; ++k) CHECK(a() == b());
  // Every part of the key and the purpose changes the stream.
  std::set<std::uint64_t> first;
  for (std::uint64_t part = 0; part < 200; ++part) {
    first.insert(specdec::stream_engine({part, 42, 3})());
    first.insert(specdec::stream_engine({7, part + 1000, 3})());
    first.insert(specdec::stream_engine({7, 42, part + 1000})());
  }
  first.insert(specdec::stream_engine(key, specdec::stream_purpose::draft)());
  CHECK(first.size() == 601);
  CHECK(specdec::stream_engine(key)() !=
        specdec::stream_engine(key, specdec::stream_purpose::draft)());
}

TEST_CASE("stream_engine: the first uniform of consecutive sequence ids is uniform",
          "[batch][random][statistical]") {
  // Engines number sequences 0, 1, 2, ...: the streams of neighbouring ids must look
  // independent. Chi-square of the first uniform over 64 bins (false failure 1e-9); the
  // broken variant seeds the state with the id itself (no hash), which it catches.
  constexpr std::size_t bins = 64;
  constexpr std::uint64_t samples = 200'000;
  std::vector<std::uint64_t> counts(bins, 0);
  std::vector<std::uint64_t> broken(bins, 0);
  for (std::uint64_t id = 0; id < samples; ++id) {
    auto g = specdec::stream_engine({1, id, 0});
    ++counts[static_cast<std::size_t>(specdec::uniform01<double>(g) * bins)];
    auto weak = specdec::xoshiro256pp::from_state(id, 0, 0, 1);
    ++broken[static_cast<std::size_t>(specdec::uniform01<double>(weak) * bins)];
  }
  const std::vector<double> uniform(bins, 1.0 / bins);
  const auto test = specdec::testing::chi_square_test(counts, uniform);
  INFO(test.describe());
  CHECK(test.passed());
  const auto weak_test = specdec::testing::chi_square_test(broken, uniform);
  INFO("state = id: " << weak_test.describe());
  CHECK_FALSE(weak_test.passed());
}

TEST_CASE("Executors run every task exactly once", "[batch][executor]") {
  specdec::InlineExecutor inline_executor;
  specdec::ThreadPool one(1);
  specdec::ThreadPool four(4);
  CHECK(inline_executor.concurrency() == 1);
  CHECK(one.concurrency() == 1);
  CHECK(four.concurrency() == 4);
  CHECK(specdec::ThreadPool().concurrency() >= 1);
  const auto check = [](specdec::executor_ref executor) {
    for (const std::size_t count : {0UL, 1UL, 3UL, 4UL, 7UL, 100UL}) {
      for (int repeat = 0; repeat < 20; ++repeat) {
        std::vector<std::atomic<int>> calls(count);
        auto task = [&](std::size_t k) { calls[k].fetch_add(1); };
        executor.run(count, task);
        for (std::size_t k = 0; k < count; ++k) REQUIRE(calls[k].load() == 1);
      }
    }
  };
  check(inline_executor);
  check(one);
  check(four);
  // An engine's own parallel-for (here: two std::threads splitting the indices).
  auto parallel_for = specdec::FunctionExecutor(
      [](std::size_t count, specdec::task_ref task) {
        std::thread other([&] {
          for (std::size_t k = 1; k < count; k += 2) task(k);
        });
        for (std::size_t k = 0; k < count; k += 2) task(k);
        other.join();
      },
      2);
  CHECK(parallel_for.concurrency() == 2);
  check(parallel_for);
}

TEST_CASE("Batch: small batches run on the calling thread", "[batch][executor]") {
  // Below the parallel threshold (2^20 entries read by default) the executor is not called;
  // at a threshold the batch reaches it is. The results are the same.
  struct CountingExecutor {
    specdec::ThreadPool pool{2};
    std::size_t runs = 0;
    void run(std::size_t count, specdec::task_ref task) {
      ++runs;
      pool.run(count, task);
    }
    [[nodiscard]] std::size_t concurrency() const noexcept { return 2; }
  } executor;
  constexpr std::size_t vocab = 64;
  const auto sequences = random_sequences<float>(8, vocab, 4, 3);
  std::vector<const Sequence<float>*> all;
  for (const auto& s : sequences) all.push_back(&s);
  const Batch<float> batch(vocab, all);
  BatchVerifier<float> verifier{specdec::executor_ref(executor)};
  BatchVerification inline_out;
  verifier.verify(batch.view(), batch.options, inline_out);
  CHECK(executor.runs == 0);
  verifier.set_parallel_threshold(2 * 8 * vocab);  // reached by the final draws alone
  BatchVerification parallel_out;
  verifier.verify(batch.view(), batch.options, parallel_out);
  CHECK(executor.runs == 1);
  for (std::size_t b = 0; b < sequences.size(); ++b) {
    CHECK(parallel_out.result(b) == inline_out.result(b));
  }
}

TEST_CASE("ThreadPool: tasks run on several threads at once", "[batch][executor]") {
  // Four tasks that each wait until all four have started finish only if four threads run
  // them concurrently (the caller and three workers).
  specdec::ThreadPool pool(4);
  std::atomic<int> started{0};
  std::atomic<int> finished{0};
  auto task = [&](std::size_t) {
    started.fetch_add(1);
    while (started.load() < 4) {
    }
    finished.fetch_add(1);
  };
  pool.run(4, task);
  CHECK(finished.load() == 4);
}

TEMPLATE_TEST_CASE("Batch: each sequence gets the single-sequence verification of its rows",
                   "[batch][exactness]", float, double) {
  // Mixed options (T = 1, tempered, top-k, top-p, min-p, all of them, greedy), proposals,
  // lenience 0.5, 0..6 drafts: bitwise equal to verify_speculative(_proposals) or
  // verify_greedy on the rows standardized by Standardizer::apply, with stream_engine(key).
  // Top-k sequences (V = 40, 5000) run on their survivors: the same decisions bitwise, and a
  // final draw whose masses are summed in another order (a different token only where u
  // falls within rounding of a boundary: none here).
  for (const std::size_t vocab : {2UL, 40UL, 5000UL}) {
    const auto sequences = random_sequences<TestType>(vocab > 1000 ? 24 : 96, vocab, 6, vocab);
    std::vector<const Sequence<TestType>*> all;
    for (const auto& s : sequences) all.push_back(&s);
    const Batch<TestType> batch(vocab, all);
    BatchVerifier<TestType> verifier(2);
    verifier.set_parallel_threshold(0);  // threads even for small batches
    BatchVerification out;
    verifier.verify(batch.view(), batch.options, out);
    REQUIRE(out.size() == sequences.size());
    std::size_t corrections = 0;
    std::size_t bonuses = 0;
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      INFO("V = " << vocab << ", sequence " << b);
      const VerificationResult expected = single_sequence(sequences[b], vocab);
      CHECK(out.ok(b));
      CHECK(out.result(b) == expected);
      CHECK(as_vector(out.emitted(b)) == emitted_by(sequences[b].drafts, expected));
      (expected.source == specdec::token_source::bonus ? bonuses : corrections) += 1;
    }
    CHECK(corrections > 0);
    CHECK(bonuses > 0);
    BatchVerification checked;
    verifier.verify_checked(batch.view(), batch.options, checked);
    for (std::size_t b = 0; b < sequences.size(); ++b) CHECK(checked.result(b) == out.result(b));
  }
}

TEMPLATE_TEST_CASE(
    "Batch: with verification = block, each sequence gets verify_block of its standardized "
    "rows",
    "[batch][exactness][block_verification]", float, double) {
  // The mixed sequences of the test above with the block rule: model drafts at T > 0 and
  // lenience 1 are verified by verify_block (dense, and top-k survivors: the same decisions,
  // the draw summed in id order), the others as before; automatic is the same here.
  for (const std::size_t vocab : {2UL, 40UL, 5000UL}) {
    auto sequences = random_sequences<TestType>(vocab > 1000 ? 24 : 96, vocab, 6, vocab + 7);
    std::size_t blocks = 0;
    for (auto& s : sequences) {
      s.options.verification = specdec::verification_rule::block;
      if (s.options.lenience != 1.0) s.options.verification = specdec::verification_rule::automatic;
      blocks += s.options.uses_block() && !s.drafts.empty() ? 1U : 0U;
    }
    REQUIRE(blocks > 0);
    std::vector<const Sequence<TestType>*> all;
    for (const auto& s : sequences) all.push_back(&s);
    const Batch<TestType> batch(vocab, all);
    BatchVerifier<TestType> verifier(2);
    verifier.set_parallel_threshold(0);
    BatchVerification out;
    verifier.verify(batch.view(), batch.options, out);
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      INFO("V = " << vocab << ", sequence " << b);
      CHECK(out.result(b) == single_sequence(sequences[b], vocab));
    }
  }
  // Block with lenience < 1 is an option error naming the sequence.
  const auto sequences = random_sequences<TestType>(4, 8, 3, 5);
  std::vector<const Sequence<TestType>*> all;
  for (const auto& s : sequences) all.push_back(&s);
  Batch<TestType> batch(8, all);
  batch.options[2].verification = specdec::verification_rule::block;
  batch.options[2].lenience = 0.5;
  BatchVerifier<TestType> verifier(1);
  BatchVerification out;
  CHECK_THROWS_WITH(
      verifier.verify(batch.view(), batch.options, out),
      Catch::Matchers::ContainsSubstring("batch position 2") &&
          Catch::Matchers::ContainsSubstring("verification = block needs lenience = 1"));
}

TEMPLATE_TEST_CASE(
    "Batch: a sequence's result does not depend on the batch, its position or threads",
    "[batch][exactness]", float, double) {
  constexpr std::size_t vocab = 64;
  const auto sequences = random_sequences<TestType>(40, vocab, 8, 99);
  const auto others = random_sequences<TestType>(40, vocab, 8, 100);
  std::vector<const Sequence<TestType>*> all;
  for (const auto& s : sequences) all.push_back(&s);
  // The reference: one thread, the batch in order.
  specdec::InlineExecutor serial;
  BatchVerifier<TestType> one_thread{specdec::executor_ref(serial)};
  BatchVerification reference;
  one_thread.verify(Batch<TestType>(vocab, all).view(), Batch<TestType>(vocab, all).options,
                    reference);
  const auto expect_same = [&](const BatchVerification& out,
                               const std::vector<const Sequence<TestType>*>& order) {
    for (std::size_t b = 0; b < order.size(); ++b) {
      const auto it = std::find(all.begin(), all.end(), order[b]);
      if (it == all.end()) continue;  // one of the others
      const auto k = static_cast<std::size_t>(it - all.begin());
      INFO("sequence " << k << " at batch position " << b);
      REQUIRE(out.result(b) == reference.result(k));
      REQUIRE(as_vector(out.emitted(b)) == as_vector(reference.emitted(k)));
    }
  };
  for (const std::size_t threads : {1UL, 2UL, 4UL}) {
    BatchVerifier<TestType> verifier(threads);
    verifier.set_parallel_threshold(0);  // threads even for small batches
    BatchVerification out;
    // In order, reversed, interleaved with other sequences, and each alone.
    const Batch<TestType> in_order(vocab, all);
    verifier.verify(in_order.view(), in_order.options, out);
    expect_same(out, all);
    auto reversed = all;
    std::reverse(reversed.begin(), reversed.end());
    const Batch<TestType> backwards(vocab, reversed);
    verifier.verify(backwards.view(), backwards.options, out);
    expect_same(out, reversed);
    std::vector<const Sequence<TestType>*> mixed;
    for (std::size_t k = 0; k < all.size(); ++k) {
      mixed.push_back(&others[k]);
      mixed.push_back(all[all.size() - 1 - k]);
    }
    const Batch<TestType> interleaved(vocab, mixed);
    verifier.verify(interleaved.view(), interleaved.options, out);
    expect_same(out, mixed);
    for (const auto* s : all) {
      const Batch<TestType> alone(vocab, {s});
      verifier.verify(alone.view(), alone.options, out);
      expect_same(out, {s});
    }
  }
}

TEST_CASE("Batch: greedy sequences emit exactly what plain greedy decoding emits",
          "[batch][exactness]") {
  // Drafts that are the argmax of their rows up to a planted mismatch: the emitted tokens
  // are the argmax of every row up to and including the first mismatching one.
  constexpr std::size_t vocab = 30;
  specdec::xoshiro256pp g(5);
  std::vector<Sequence<float>> sequences;
  for (std::size_t k = 0; k < 30; ++k) {
    Sequence<float> s;
    s.options.sampling.temperature = 0.0;
    s.options.stream = {1, k, 0};
    const std::size_t drafted = k % 6;
    const std::size_t mismatch = k % 7;  // >= drafted: no mismatch
    for (std::size_t i = 0; i <= drafted; ++i) {
      const auto p = random_row<float>(vocab, g);
      s.target.insert(s.target.end(), p.begin(), p.end());
      if (i < drafted) {
        const token_id best = specdec::argmax(std::span<const float>(p));
        s.drafts.push_back(i == mismatch ? (best + 1) % static_cast<token_id>(vocab) : best);
      }
    }
    s.draft.assign(drafted * vocab, 1.0F / vocab);
    sequences.push_back(std::move(s));
  }
  std::vector<const Sequence<float>*> all;
  for (const auto& s : sequences) all.push_back(&s);
  const Batch<float> batch(vocab, all);
  BatchVerifier<float> verifier(2);
  verifier.set_parallel_threshold(0);  // threads even for small batches
  BatchVerification out;
  verifier.verify(batch.view(), batch.options, out);
  for (std::size_t k = 0; k < sequences.size(); ++k) {
    const Sequence<float>& s = sequences[k];
    const std::size_t drafted = s.drafts.size();
    std::vector<token_id> plain;
    for (std::size_t i = 0; i <= drafted; ++i) {
      plain.push_back(specdec::argmax(std::span<const float>(s.target.data() + i * vocab, vocab)));
      if (i < drafted && plain.back() != s.drafts[i]) break;
    }
    INFO("sequence " << k);
    CHECK(as_vector(out.emitted(k)) == plain);
  }
}

namespace {

/// Fixed rows of one position-dependent (context-free) pair: p_1..p_3 and q_1, q_2 at V = 4.
struct LawCase {
  std::vector<double> target{0.10, 0.20, 0.30, 0.40, 0.45, 0.05,
                             0.25, 0.25, 0.30, 0.30, 0.30, 0.10};
  std::vector<double> draft{0.40, 0.40, 0.10, 0.10, 0.10, 0.60, 0.20, 0.10};
};

/// The law of 3 tokens sampled from the standardized p_1, p_2, p_3 (a product law).
std::vector<double> product_law(const std::vector<double>& standardized, std::size_t vocab) {
  std::vector<double> law(vocab * vocab * vocab);
  for (std::size_t a = 0; a < vocab; ++a) {
    for (std::size_t b = 0; b < vocab; ++b) {
      for (std::size_t c = 0; c < vocab; ++c) {
        law[(a * vocab + b) * vocab + c] =
            standardized[a] * standardized[vocab + b] * standardized[2 * vocab + c];
      }
    }
  }
  return law;
}

/// Counts of 3-token outcomes: each sequence's emitted tokens, completed to 3 tokens by
/// plain sampling from the standardized p rows after them. `verify_options` are the options
/// the batch verifies with, `draft_options` those the drafts were sampled with.
std::vector<std::uint64_t> three_token_counts(const LawCase& rows,
                                              const SamplingOptions& draft_options,
                                              const SequenceOptions& verify_options,
                                              const std::vector<double>& verify_target,
                                              const std::vector<double>& standardized_target,
                                              std::size_t samples) {
  constexpr std::size_t vocab = 4;
  constexpr std::size_t gamma = 2;
  constexpr std::size_t batch_size = 4000;
  specdec::Standardizer<double> standardizer(draft_options);
  std::vector<double> scratch(vocab);
  BatchVerifier<double> verifier(2);
  verifier.set_parallel_threshold(0);  // threads even for small batches
  BatchVerification out;
  specdec::xoshiro256pp completion(77);
  std::vector<std::uint64_t> counts(vocab * vocab * vocab, 0);
  std::vector<token_id> drafts;
  std::vector<std::size_t> offsets;
  std::vector<double> target;
  std::vector<double> draft;
  std::vector<SequenceOptions> options;
  for (std::size_t done = 0; done < samples; done += batch_size) {
    drafts.clear();
    offsets.assign(1, 0);
    target.clear();
    draft.clear();
    options.clear();
    for (std::size_t k = 0; k < batch_size; ++k) {
      SequenceOptions sequence = verify_options;
      sequence.stream = {3, done + k, 0};
      auto draw = specdec::stream_engine(sequence.stream, specdec::stream_purpose::draft);
      for (std::size_t i = 0; i < gamma; ++i) {
        drafts.push_back(specdec::sample_standardized(
            standardizer, std::span<const double>(rows.draft.data() + i * vocab, vocab),
            std::span<double>(scratch), draw));
      }
      offsets.push_back(drafts.size());
      target.insert(target.end(), verify_target.begin(), verify_target.end());
      draft.insert(draft.end(), rows.draft.begin(), rows.draft.end());
      options.push_back(sequence);
    }
    const RaggedBatch<double> batch{
        drafts, offsets, RowsView<const double>(target.data(), target.size() / vocab, vocab),
        RowsView<const double>(draft.data(), draft.size() / vocab, vocab)};
    verifier.verify(batch, options, out);
    for (std::size_t k = 0; k < batch_size; ++k) {
      std::vector<token_id> tokens = as_vector(out.emitted(k));
      while (tokens.size() < gamma + 1) {
        const std::size_t i = tokens.size();
        tokens.push_back(specdec::sample_from_row(
            std::span<const double>(standardized_target.data() + i * vocab, vocab), completion));
      }
      ++counts[(static_cast<std::size_t>(tokens[0]) * vocab + static_cast<std::size_t>(tokens[1])) *
                   vocab +
               static_cast<std::size_t>(tokens[2])];
    }
  }
  return counts;
}

}  // namespace

TEST_CASE("Batch: emitted tokens follow the standardized target law", "[batch][statistical]") {
  // Three tokens (gamma = 2, completed by plain sampling after the emitted ones) against the
  // product of the standardized target rows: chi-square over 64 cells, false failure 1e-9,
  // for model drafts and proposals. The broken variant verifies with the options applied to
  // p only (the target's rows standardized, q as the model gave it, drafts sampled from the
  // standardized q): a known gap of peers, which the same test catches.
  constexpr std::size_t vocab = 4;
  const LawCase rows;
  const SamplingOptions sampling{.temperature = 0.6, .top_k = 3};
  std::vector<double> standardized(rows.target.size());
  specdec::Standardizer<double> standardizer(sampling);
  for (std::size_t i = 0; i < 3; ++i) {
    standardizer.apply(std::span<const double>(rows.target.data() + i * vocab, vocab),
                       std::span<double>(standardized.data() + i * vocab, vocab));
  }
  const auto law = product_law(standardized, vocab);
  const std::size_t samples = std::max<std::size_t>(
      specdec::testing::scaled_samples_to_detect(0.01, law.size() - 1), 40'000);
  for (const bool proposals : {false, true}) {
    SequenceOptions options;
    options.sampling = sampling;
    options.proposals = proposals;
    const auto counts =
        three_token_counts(rows, sampling, options, rows.target, standardized, samples);
    const auto test = specdec::testing::chi_square_test(counts, law);
    INFO((proposals ? "proposals: " : "model drafts: ") << test.describe());
    CHECK(test.passed());
  }
  // Broken: the options reach p only.
  SequenceOptions p_only;  // identity: rows as given
  const auto broken =
      three_token_counts(rows, sampling, p_only, standardized, standardized, samples);
  const auto broken_test = specdec::testing::chi_square_test(broken, law);
  INFO("options applied to p only: " << broken_test.describe());
  CHECK_FALSE(broken_test.passed());
}

TEST_CASE("Batch: the padded form", "[batch]") {
  constexpr std::size_t vocab = 8;
  const auto sequences = random_sequences<float>(5, vocab, 3, 11);
  std::vector<const Sequence<float>*> all;
  for (const auto& s : sequences) all.push_back(&s);
  const Batch<float> batch(vocab, all);
  BatchVerifier<float> verifier(1);
  BatchVerification out;
  verifier.verify(batch.view(), batch.options, out);
  const std::size_t width = 4;  // gamma_max + 1
  std::vector<token_id> padded(sequences.size() * width, 99);
  out.write_padded(padded, width);
  for (std::size_t b = 0; b < sequences.size(); ++b) {
    const auto tokens = out.emitted(b);
    for (std::size_t j = 0; j < width; ++j) {
      CHECK(padded[b * width + j] == (j < tokens.size() ? tokens[j] : specdec::padding_token));
    }
  }
  CHECK(out.max_emitted() <= width);
  CHECK_THROWS_AS(out.write_padded(std::span<token_id>(padded).first(padded.size() - 1), width),
                  specdec::error);
}

TEST_CASE("Batch: an empty batch and sequences without drafts", "[batch]") {
  BatchVerifier<float> verifier(2);
  BatchVerification out;
  const std::vector<std::size_t> no_sequences{0};
  verifier.verify({{}, no_sequences, RowsView<const float>(), RowsView<const float>()}, {}, out);
  CHECK(out.size() == 0);
  // Two sequences with nothing drafted: one token each from p_1, no draft rows needed.
  const std::vector<float> target{0.0F, 1.0F, 0.0F, 0.0F, 0.0F, 1.0F};
  const std::vector<std::size_t> offsets{0, 0, 0};
  const std::vector<SequenceOptions> options(2);
  verifier.verify_checked({{}, offsets, RowsView<const float>(target.data(), 2, 3), {}}, options,
                          out);
  REQUIRE(out.size() == 2);
  CHECK(as_vector(out.emitted(0)) == std::vector<token_id>{1});
  CHECK(as_vector(out.emitted(1)) == std::vector<token_id>{2});
  CHECK(out.result(0).source == specdec::token_source::bonus);
}
