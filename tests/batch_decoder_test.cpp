// Tests for include/specdec/batch_decoder.hpp: each sequence of a batch follows its target
// law (sequence-level chi-square; a target returning rows of the wrong prefix is caught),
// with model drafts and with proposals, under continuous batching; a sequence's tokens do
// not depend on the batch, on when it joined or on the threads; greedy sequences equal plain
// greedy decoding; stop tokens and max_new_tokens; one target call per step; a sequence's
// own failure leaves the others whole; a failing target call changes nothing.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "errors_catalogue.hpp"
#include "specdec/batch_decoder.hpp"
#include "specdec/greedy_verification.hpp"
#include "speculative_decoder_models.hpp"
#include "support/batch_markov.hpp"
#include "support/sequence_law.hpp"
#include "support/statistics.hpp"

namespace {

using specdec::BatchDecoder;
using specdec::BatchScoreRequest;
using specdec::FinishedSequence;
using specdec::RowsView;
using specdec::SamplingOptions;
using specdec::SequenceRequest;
using specdec::token_id;
using specdec::testing::BatchMarkov;
using specdec::testing::MarkovModel;

/// A draft model that throws for contexts starting with `fatal`.
class ThrowingDraft : public MarkovModel<double> {
 public:
  ThrowingDraft(MarkovModel<double> model, token_id fatal_token)
      : MarkovModel<double>(std::move(model)), fatal(fatal_token) {}
  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    if (!context.empty() && context.front() == fatal)
      throw std::runtime_error("draft engine fault");
    return MarkovModel<double>::next_token_probabilities(context);
  }
  token_id fatal;
};

/// Proposes `out.size()` copies of `token` after contexts starting with `bad_start`, nothing
/// otherwise.
struct BadProposer {
  token_id bad_start;
  token_id token;
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) const {
    if (context.empty() || context.front() != bad_start) return 0;
    std::fill(out.begin(), out.end(), token);
    return out.size();
  }
};

/// Proposes the target's most likely continuation under another chain (a stand-in for an
/// n-gram drafter): deterministic, sometimes right.
struct ChainProposer {
  const MarkovModel<double>* chain;
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) const {
    std::size_t s = chain->state(context);
    for (auto& token : out) {
      const auto row = chain->row(s);
      token = static_cast<token_id>(std::max_element(row.begin(), row.end()) - row.begin());
      s = chain->next_state(s, static_cast<std::size_t>(token));
    }
    return out.size();
  }
};

SequenceRequest request(std::uint64_t id, std::size_t length, const SamplingOptions& sampling,
                        std::size_t gamma = 3) {
  SequenceRequest r;
  r.id = id;
  r.prompt = specdec::testing::sequence_prompt;
  r.max_new_tokens = length;
  r.seed = 2026;
  r.sampling = sampling;
  r.gamma_policy = specdec::FixedGamma(gamma);
  return r;
}

/// request() with a gamma policy chosen by id: fixed 1..4, additive, or a confidence stop
/// (which reads the draft's top probability) over fixed 4.
SequenceRequest mixed_request(std::uint64_t id, std::size_t length,
                              const SamplingOptions& sampling) {
  SequenceRequest r = request(id, length, sampling, 1 + id % 4);
  if (id % 3 == 1) r.gamma_policy = specdec::AdditiveGamma();
  if (id % 3 == 2) r.gamma_policy = specdec::ConfidenceStop(0.4, 4);
  return r;
}

/// Decodes `count` sequences of `length` tokens (mixed_request), `wave` of them joining
/// every step (continuous batching); returns their tokens by id.
template <class Decoder>
std::map<std::uint64_t, std::vector<token_id>> decode_all(Decoder& decoder, std::size_t count,
                                                          std::size_t length,
                                                          const SamplingOptions& sampling,
                                                          std::size_t wave) {
  std::map<std::uint64_t, std::vector<token_id>> tokens;
  std::uint64_t next = 0;
  while (next < count || decoder.active() > 0) {
    for (std::size_t k = 0; k < wave && next < count; ++k) {
      const std::uint64_t id = next++;
      decoder.add(mixed_request(id, length, sampling));
    }
    decoder.step();
    for (auto& done : decoder.take_finished()) {
      REQUIRE(done.end != specdec::sequence_end::failed);
      tokens[done.id] = std::move(done.tokens);
    }
  }
  return tokens;
}

}  // namespace

TEST_CASE("BatchDecoder: every sequence follows its target law", "[batch_decoder][statistical]") {
  // V = 4, order-2 target, order-1 draft: the full law of 4 generated tokens, chi-square at
  // false failure 1e-9, over 7000 sequences decoded in waves of 300 joining each step, at
  // T = 1 and at T = 0.7 with top-k 3 and top-p 0.9, with model drafts and with proposals.
  // The broken variant scores each prefix with the row of the next one (an engine that
  // puts the rows one position off), which the same test catches.
  constexpr std::size_t vocab = 4;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 11);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 12);
  for (const SamplingOptions& sampling :
       {SamplingOptions{}, specdec::testing::truncated_sampling(vocab)}) {
    const specdec::testing::SequenceLaw law(target_chain, sampling, 4);
    const std::size_t samples = std::max<std::size_t>(specdec::testing::samples_for(law), 7000);
    const auto check = [&](auto& decoder, const char* what, bool expect_pass) {
      const auto tokens = decode_all(decoder, samples, law.length(), sampling, 300);
      std::vector<std::uint64_t> counts(law.cells(), 0);
      for (const auto& [id, sequence] : tokens) {
        REQUIRE(sequence.size() == law.length());
        ++counts[law.cell_of(sequence)];
      }
      const auto test = specdec::testing::chi_square_test(counts, law.expected());
      INFO(what << ", T = " << sampling.temperature << ": " << test.describe());
      CHECK(test.passed() == expect_pass);
    };
    BatchMarkov target(target_chain);
    MarkovModel<double> draft = draft_chain;
    BatchDecoder models(target, draft, {.threads = 2, .parallel_threshold = 0});
    check(models, "model drafts", true);
    CHECK(target.score_calls == models.steps());  // one target call per step
    ChainProposer proposer{&draft_chain};
    BatchMarkov target2(target_chain);
    BatchDecoder proposals(target2, proposer, {.threads = 2, .parallel_threshold = 0});
    check(proposals, "proposals", true);
    BatchMarkov target3(target_chain);
    BatchMarkov batched_draft(draft_chain, "draft device lost");
    BatchDecoder batched(target3, batched_draft, {.threads = 2, .parallel_threshold = 0});
    check(batched, "batched drafts (draft_batch)", true);
    CHECK(batched_draft.draft_calls <= 4 * batched.steps());  // gamma <= 4: per position
    BatchMarkov shifted(target_chain);
    shifted.shift = true;
    MarkovModel<double> draft2 = draft_chain;
    BatchDecoder broken(shifted, draft2, {.threads = 2, .parallel_threshold = 0});
    check(broken, "rows one prefix off", false);
  }
}

TEST_CASE("BatchDecoder: a sequence's tokens do not depend on the batch, joining or threads",
          "[batch_decoder][exactness]") {
  constexpr std::size_t vocab = 16;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 21);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 22);
  const SamplingOptions sampling{.temperature = 0.8, .top_k = 8};
  // Reference: every sequence decoded alone on one thread.
  std::map<std::uint64_t, std::vector<token_id>> alone;
  for (std::uint64_t id = 0; id < 24; ++id) {
    BatchMarkov target(target_chain);
    MarkovModel<double> draft = draft_chain;
    BatchDecoder decoder(target, draft, {.threads = 1, .parallel_threshold = 0});
    decoder.add(mixed_request(id, 20, sampling));
    decoder.run();
    alone[id] = decoder.take_finished().at(0).tokens;
  }
  for (const std::size_t threads : {1UL, 2UL, 4UL}) {
    for (const std::size_t wave : {1UL, 5UL, 24UL}) {
      BatchMarkov target(target_chain);
      MarkovModel<double> draft = draft_chain;
      BatchDecoder decoder(target, draft, {.threads = threads, .parallel_threshold = 0});
      const auto together = decode_all(decoder, 24, 20, sampling, wave);
      INFO(threads << " threads, " << wave << " joining per step");
      CHECK(together == alone);
    }
  }
}

TEST_CASE("BatchDecoder: a batched draft model drafts the tokens one-at-a-time drafting does",
          "[batch_decoder][exactness]") {
  // Each sequence's drafts come from its own draft stream whichever way the draft model is
  // called, so batched drafting (one draft_batch call per draft position for the whole
  // batch) reproduces per-sequence drafting token for token, with every kind of gamma
  // policy (early stops included) and sequences joining each step.
  constexpr std::size_t vocab = 16;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 23);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 24);
  for (const SamplingOptions& sampling :
       {SamplingOptions{}, SamplingOptions{.temperature = 0.8, .top_k = 8},
        SamplingOptions{.temperature = 0.0}}) {
    BatchMarkov target(target_chain);
    MarkovModel<double> draft = draft_chain;
    BatchDecoder one_at_a_time(target, draft, {.threads = 2, .parallel_threshold = 0});
    const auto expected = decode_all(one_at_a_time, 30, 20, sampling, 6);
    BatchMarkov target2(target_chain);
    BatchMarkov batched_draft(draft_chain, "draft device lost");
    BatchDecoder batched(target2, batched_draft, {.threads = 2, .parallel_threshold = 0});
    const auto tokens = decode_all(batched, 30, 20, sampling, 6);
    INFO("T = " << sampling.temperature);
    CHECK(tokens == expected);
    CHECK(batched.steps() == one_at_a_time.steps());
    CHECK(batched_draft.draft_calls <= 4 * batched.steps());
    // Every sequence is released once, when it leaves.
    std::vector<std::uint64_t> released = batched_draft.released;
    std::sort(released.begin(), released.end());
    std::vector<std::uint64_t> ids(30);
    for (std::uint64_t id = 0; id < 30; ++id) ids[id] = id;
    CHECK(released == ids);
  }
}

TEST_CASE("BatchDecoder: greedy sequences emit plain greedy decoding",
          "[batch_decoder][exactness]") {
  constexpr std::size_t vocab = 16;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 31);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 32);
  BatchMarkov target(target_chain);
  MarkovModel<double> draft = draft_chain;
  BatchDecoder decoder(target, draft, {.threads = 2, .parallel_threshold = 0});
  const auto tokens = decode_all(decoder, 12, 25, SamplingOptions{.temperature = 0.0}, 4);
  for (const auto& [id, sequence] : tokens) {
    std::vector<token_id> context = specdec::testing::sequence_prompt;
    std::vector<token_id> plain;
    for (std::size_t j = 0; j < 25; ++j) {
      plain.push_back(specdec::argmax(target_chain.row(target_chain.state(context))));
      context.push_back(plain.back());
    }
    INFO("sequence " << id);
    CHECK(sequence == plain);
  }
}

TEST_CASE("BatchDecoder: stop tokens, stop sequences and max_new_tokens", "[batch_decoder]") {
  constexpr std::size_t vocab = 8;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 1, 41);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 42);
  BatchMarkov target(target_chain);
  MarkovModel<double> draft = draft_chain;
  std::map<std::uint64_t, std::vector<token_id>> streamed;
  BatchDecoder decoder(target, draft,
                       {.threads = 2,
                        .parallel_threshold = 0,
                        .on_tokens = [&](std::uint64_t id, std::span<const token_id> t) {
                          streamed[id].insert(streamed[id].end(), t.begin(), t.end());
                        }});
  for (std::uint64_t id = 0; id < 40; ++id) {
    auto r = request(id, 1 + id % 13, SamplingOptions{}, 4);
    r.stop_tokens = {3};
    r.stop_sequences = {{1, 2}, {5, 5, 5}};
    // Both verification rules: block (the default) and Algorithm 1.
    if (id % 2 == 1) r.verification = specdec::verification_rule::token;
    decoder.add(r);
  }
  decoder.run();
  const auto done = decoder.take_finished();
  REQUIRE(done.size() == 40);
  std::size_t stopped = 0;
  std::size_t ended_by_sequence = 0;
  for (const FinishedSequence& f : done) {
    INFO("sequence " << f.id);
    const std::size_t limit = 1 + f.id % 13;
    CHECK(f.tokens == streamed[f.id]);
    const auto stop = std::find(f.tokens.begin(), f.tokens.end(), 3);
    // The first prefix that ends with a stop sequence (its length, 0 if none).
    std::size_t sequence_end_at = 0;
    for (std::size_t k = 1; k <= f.tokens.size() && sequence_end_at == 0; ++k) {
      for (const std::vector<token_id>& s : {std::vector<token_id>{1, 2}, {5, 5, 5}}) {
        if (k >= s.size() &&
            std::equal(s.begin(), s.end(),
                       f.tokens.begin() + static_cast<std::ptrdiff_t>(k - s.size()))) {
          sequence_end_at = k;
        }
      }
    }
    if (f.end == specdec::sequence_end::stop_token) {
      ++stopped;
      CHECK(stop == f.tokens.end() - 1);  // the stop token ends the output
      CHECK(sequence_end_at == 0);
      CHECK(f.tokens.size() <= limit);
    } else if (f.end == specdec::sequence_end::stop_sequence) {
      ++ended_by_sequence;
      CHECK(sequence_end_at == f.tokens.size());  // the first completed stop sequence ends it
      CHECK(stop == f.tokens.end());
      CHECK(f.tokens.size() <= limit);
    } else {
      CHECK(f.end == specdec::sequence_end::max_new_tokens);
      CHECK(f.tokens.size() == limit);
      CHECK(stop == f.tokens.end());
      CHECK(sequence_end_at == 0);
    }
    CHECK(f.accepted <= f.drafted);
  }
  CHECK(stopped > 0);
  CHECK(ended_by_sequence > 0);
  CHECK(stopped + ended_by_sequence < 40);
}

TEST_CASE("B10 BatchDecoder::add: a request out of range adds nothing", "[batch_decoder][errors]") {
  MarkovModel<double> target = specdec::testing::make_markov_target(4, 1, 1);
  MarkovModel<double> draft = target;
  BatchDecoder decoder(target, draft, {.threads = 1, .parallel_threshold = 0});
  using specdec::errc;
  using specdec::testing::check_error;
  auto bad = request(7, 5, SamplingOptions{.top_p = 0.0});
  check_error(
      "B10", [&] { decoder.add(bad); }, errc::invalid_option,
      "sequence 7: sampling option top_p = 0 must be in (0, 1]");
  struct Policy {  // a GammaPolicy whose answers the test sets
    std::size_t gamma = 0;
    bool timed = false;
    [[nodiscard]] std::size_t next_gamma() const { return gamma; }
    [[nodiscard]] bool continue_drafting(double, std::size_t) const { return true; }
    void observe(const specdec::StepFeedback&) {}
    [[nodiscard]] bool needs_timing() const { return timed; }
  };
  auto timed = request(7, 5, {});
  timed.gamma_policy = Policy{4, true};
  check_error(
      "B10", [&] { decoder.add(timed); }, errc::invalid_option,
      "sequence 7: gamma_policy needs timing, which the batch decoder does not measure");
  auto zero = request(7, 5, {});
  zero.gamma_policy = Policy{0, false};
  check_error(
      "B10", [&] { decoder.add(zero); }, errc::invalid_option,
      "sequence 7: gamma_policy: next_gamma() is 0, must be >= 1");
  check_error(
      "B10", [&] { decoder.add(request(7, 0, {})); }, errc::invalid_option,
      "sequence 7: max_new_tokens must be >= 1");
  auto stop = request(7, 5, {});
  stop.stop_tokens = {4};
  check_error(
      "B10", [&] { decoder.add(stop); }, errc::invalid_option,
      "sequence 7: stop_tokens: token 4 is outside [0, 4)");
  auto empty = request(7, 5, {});
  empty.stop_sequences = {{1}, {}};
  check_error(
      "B10", [&] { decoder.add(empty); }, errc::invalid_option,
      "sequence 7: stop_sequences[1] is empty");
  auto outside = request(7, 5, {});
  outside.stop_sequences = {{1, 6}};
  check_error(
      "B10", [&] { decoder.add(outside); }, errc::invalid_option,
      "sequence 7: stop_sequences[0]: token 6 is outside [0, 4)");
  auto prompt = request(7, 5, {});
  prompt.prompt = {1, 9};
  check_error(
      "B10", [&] { decoder.add(prompt); }, errc::invalid_token,
      "sequence 7: prompt token at position 1: id 9 is outside [0, 4)");
  decoder.add(request(7, 5, {}));
  check_error(
      "B10", [&] { decoder.add(request(7, 5, {})); }, errc::invalid_option,
      "sequence 7: the id is already in the batch");
  CHECK(decoder.active() == 1);
  MarkovModel<double> wide = specdec::testing::make_markov_target(5, 1, 1);
  check_error(
      "B10",
      [&] {
        BatchDecoder<MarkovModel<double>, MarkovModel<double>> mismatch(target, wide);
        (void)mismatch;
      },
      errc::vocab_mismatch, "draft model has vocab_size() 5 but the target model has 4");
}

TEST_CASE("B11 BatchDecoder: a sequence's bad row or failing draft fails it alone",
          "[batch_decoder][errors]") {
  // Sequence id's prompt starts with token id % 8: sequences whose prompt starts with 2 get a
  // NaN target row, and the draft model throws for those starting with 3. Those sequences
  // fail (named; the model's exception nested); every other sequence decodes exactly as in a
  // run without the faults.
  constexpr std::size_t vocab = 8;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 1, 51);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 52);
  const auto decode = [&](bool faults) {
    BatchMarkov target(target_chain);
    ThrowingDraft draft(draft_chain, faults ? 3 : -1);
    if (faults) target.poison = 2;
    BatchDecoder decoder(target, draft, {.threads = 2, .parallel_threshold = 0});
    for (std::uint64_t id = 0; id < 30; ++id) {
      auto r = request(id, 12, {}, 3);
      r.prompt = {static_cast<token_id>(id % 8), 1};
      decoder.add(r);
    }
    decoder.run();
    return decoder.take_finished();
  };
  const auto clean = decode(false);
  const auto faulty = decode(true);
  std::map<std::uint64_t, std::vector<token_id>> reference;
  for (const auto& f : clean) reference[f.id] = f.tokens;
  std::size_t failed = 0;
  std::size_t nan_rows = 0;
  std::size_t throws = 0;
  for (const auto& f : faulty) {
    INFO("sequence " << f.id);
    if (f.end != specdec::sequence_end::failed) {
      CHECK(f.tokens == reference[f.id]);
      continue;
    }
    ++failed;
    // What it generated before failing is kept: a prefix of the clean run's tokens.
    CHECK(std::equal(f.tokens.begin(), f.tokens.end(), reference[f.id].begin()));
    try {
      std::rethrow_exception(f.error);
    } catch (const specdec::error& e) {
      const std::string what = e.what();
      specdec::testing::dump_error_message("B11", what);
      CHECK(what.find("sequence " + std::to_string(f.id) + " (") != std::string::npos);
      if (e.code() == specdec::errc::invalid_probability) {
        ++nan_rows;
        CHECK(what.find("target row 0") != std::string::npos);
      } else {
        CHECK(e.code() == specdec::errc::model_failure);
        CHECK(what.find("the draft model threw: draft engine fault") != std::string::npos);
        ++throws;
      }
    }
  }
  CHECK(nan_rows > 0);
  CHECK(throws > 0);
  CHECK(failed == 8);  // ids 2, 3, 10, 11, 18, 19, 26, 27
  CHECK(faulty.size() == 30);
}

TEST_CASE("B11 BatchDecoder: a drafter's out-of-range proposal fails its sequence alone",
          "[batch_decoder][errors]") {
  const auto target_chain = specdec::testing::make_markov_target(8, 1, 71);
  BatchMarkov target(target_chain);
  BadProposer proposer{5, 8};
  BatchDecoder decoder(target, proposer, {.threads = 1, .parallel_threshold = 0});
  for (std::uint64_t id = 0; id < 8; ++id) {
    auto r = request(id, 6, {}, 2);
    r.prompt = {static_cast<token_id>(id), 1};
    decoder.add(r);
  }
  decoder.run();
  for (const auto& f : decoder.take_finished()) {
    INFO("sequence " << f.id);
    if (f.id != 5) {
      CHECK(f.tokens.size() == 6);
      continue;
    }
    CHECK(f.end == specdec::sequence_end::failed);
    specdec::testing::check_error(
        "B11", [&] { std::rethrow_exception(f.error); }, specdec::errc::invalid_token,
        "sequence 5 (step 0): draft token at position 0: id 8 is outside [0, 8)");
  }
}

TEST_CASE("B12 BatchDecoder: a failing target call changes nothing", "[batch_decoder][errors]") {
  constexpr std::size_t vocab = 8;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 1, 61);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 62);
  const auto decode = [&](bool fail) {
    BatchMarkov target(target_chain);
    MarkovModel<double> draft = draft_chain;
    BatchDecoder decoder(target, draft, {.threads = 2, .parallel_threshold = 0});
    for (std::uint64_t id = 0; id < 10; ++id) decoder.add(request(id, 15, {}, 3));
    decoder.step();
    if (fail) {
      target.fail_next = true;
      specdec::testing::check_error(
          "B12", [&] { decoder.step(); }, specdec::errc::model_failure,
          ": the target model threw: device lost");
      CHECK(decoder.active() == 10);
      target.drop_row = true;
      specdec::testing::check_error(
          "B12", [&] { decoder.step(); }, specdec::errc::invalid_size,
          "the target's score_batch returned");
      target.drop_row = false;
      CHECK(decoder.active() == 10);
    }
    decoder.run();
    std::map<std::uint64_t, std::vector<token_id>> tokens;
    for (auto& f : decoder.take_finished()) tokens[f.id] = f.tokens;
    return tokens;
  };
  CHECK(decode(true) == decode(false));
}

TEST_CASE("B12 BatchDecoder: a failing batched draft call changes nothing",
          "[batch_decoder][errors]") {
  constexpr std::size_t vocab = 8;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 1, 63);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 64);
  const auto decode = [&](bool fail) {
    BatchMarkov target(target_chain);
    BatchMarkov draft(draft_chain, "draft device lost");
    BatchDecoder decoder(target, draft, {.threads = 2, .parallel_threshold = 0});
    for (std::uint64_t id = 0; id < 10; ++id) decoder.add(request(id, 15, {}, 3));
    decoder.step();
    if (fail) {
      draft.fail_next = true;
      specdec::testing::check_error(
          "B12", [&] { decoder.step(); }, specdec::errc::model_failure,
          ": the draft model threw: draft device lost");
      CHECK(decoder.active() == 10);
      draft.drop_row = true;
      specdec::testing::check_error(
          "B12", [&] { decoder.step(); }, specdec::errc::invalid_size,
          "the draft model's draft_batch returned 9 x 8 entries, expected 10 x 8");
      draft.drop_row = false;
      CHECK(decoder.active() == 10);
    }
    decoder.run();
    std::map<std::uint64_t, std::vector<token_id>> tokens;
    for (auto& f : decoder.take_finished()) tokens[f.id] = f.tokens;
    return tokens;
  };
  CHECK(decode(true) == decode(false));
}

TEST_CASE("BatchDecoder: each sequence's gamma policy sets its drafts", "[batch_decoder]") {
  // The draft is the target itself (every draft accepted at T = 1): fixed 4 takes 20 steps
  // for 100 tokens; additive (4, 6, 8, ... 16) takes 9; a confidence stop at 1 (the top
  // probability of these rows is below 1) drafts one token per step.
  const auto chain = specdec::testing::make_markov_target(8, 1, 81);
  BatchMarkov target(chain);
  MarkovModel<double> draft = chain;
  BatchDecoder decoder(target, draft, {.threads = 2, .parallel_threshold = 0});
  auto fixed = request(0, 100, {}, 4);
  auto additive = request(1, 100, {});
  additive.gamma_policy = specdec::AdditiveGamma();
  auto confident = request(2, 100, {});
  confident.gamma_policy = specdec::ConfidenceStop(1.0, 4);
  decoder.add(fixed);
  decoder.add(additive);
  decoder.add(confident);
  decoder.run();
  std::map<std::uint64_t, FinishedSequence> done;
  for (auto& f : decoder.take_finished()) done[f.id] = std::move(f);
  REQUIRE(done.size() == 3);
  CHECK(done[0].steps == 20);
  CHECK(done[0].accepted == 80);
  CHECK(done[1].steps == 9);
  CHECK(done[1].drafted == 91);
  CHECK(done[2].drafted == 50);  // one draft a step, accepted: 2 tokens a step
  CHECK(done[2].steps == 50);
}

TEST_CASE("BatchDecoder: a throwing on_tokens callback loses no token", "[batch_decoder][errors]") {
  // The callback throws once, for sequence 3's first tokens: step() throws the callback's
  // exception, unchanged, after the step is complete; decoding then goes on, and every
  // sequence's output is that of a run whose callback never throws.
  const auto target_chain = specdec::testing::make_markov_target(8, 1, 91);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 92);
  const auto decode = [&](bool throw_once) {
    BatchMarkov target(target_chain);
    MarkovModel<double> draft = draft_chain;
    bool armed = throw_once;
    BatchDecoder decoder(target, draft,
                         {.threads = 2,
                          .parallel_threshold = 0,
                          .on_tokens = [&](std::uint64_t id, std::span<const token_id>) {
                            if (armed && id == 3) {
                              armed = false;
                              throw std::runtime_error("client went away");
                            }
                          }});
    for (std::uint64_t id = 0; id < 6; ++id) decoder.add(request(id, 10, {}, 3));
    if (throw_once) CHECK_THROWS_AS(decoder.step(), std::runtime_error);
    decoder.run();
    std::map<std::uint64_t, std::vector<token_id>> tokens;
    for (auto& f : decoder.take_finished()) tokens[f.id] = f.tokens;
    return tokens;
  };
  CHECK(decode(true) == decode(false));
}
