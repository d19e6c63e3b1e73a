// Batch verification and the batch decoder's steps allocate nothing once warm
// (include/specdec/batch_verification.hpp, batch_decoder.hpp),
// counted by replacing the global operator new (support/counting_allocator.hpp): a program
// of its own, because a ThreadSanitizer build defines operator new itself and runs
// batch_verification_test.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/batch_decoder.hpp"
#include "specdec/batch_verification.hpp"
#include "speculative_decoder_models.hpp"
#include "support/batch_markov.hpp"
#include "support/batch_sequences.hpp"
#include "support/counting_allocator.hpp"
#include "support/sequence_law.hpp"

using specdec::BatchVerification;
using specdec::BatchVerifier;
using specdec::testing::Batch;
using specdec::testing::random_sequences;
using specdec::testing::Sequence;

TEST_CASE("Batch: no allocation once warm", "[batch][allocation]") {
  // After reserve(V) and one batch of a given shape, verifying allocates nothing, whichever
  // worker takes which sequence and whatever their options.
  for (const std::size_t vocab : {50UL, 6000UL}) {
    const auto sequences = random_sequences<float>(32, vocab, 5, 4);
    std::vector<const Sequence<float>*> all;
    for (const auto& s : sequences) all.push_back(&s);
    const Batch<float> batch(vocab, all);
    BatchVerifier<float> verifier(2);
    verifier.set_parallel_threshold(0);  // threads even for small batches
    verifier.reserve(vocab);
    BatchVerification out;
    verifier.verify(batch.view(), batch.options, out);
    specdec::testing::AllocationCounter counter;
    for (int repeat = 0; repeat < 5; ++repeat) {
      verifier.verify(batch.view(), batch.options, out);
      verifier.verify_checked(batch.view(), batch.options, out);
    }
    const std::size_t allocations = counter.stop();
    INFO("V = " << vocab);
    CHECK(allocations == 0);
  }
}

TEST_CASE("BatchDecoder: steps allocate nothing once warm", "[batch][allocation]") {
  // A second batch of sequences like the first (added, then decoded to the end): its steps,
  // with a batch gamma planner measuring a simulated clock, a batched draft model, stop
  // tokens, sequences finishing and leaving, and top-k sequences, allocate nothing. add() and
  // take_finished() may (the sequences' own storage).
  constexpr std::size_t vocab = 12;
  const auto target_chain = specdec::testing::make_markov_target(vocab, 2, 71);
  const auto draft_chain = specdec::testing::make_markov_draft(target_chain, 72);
  specdec::testing::BatchMarkov target(target_chain);
  specdec::testing::BatchMarkov draft(draft_chain);
  target.released.reserve(64);  // the release log: room for every sequence of both rounds
  draft.released.reserve(64);
  double clock = 0.0;
  specdec::BatchDecoder decoder(target, draft,
                                {.threads = 2,
                                 .parallel_threshold = 0,
                                 .batch_gamma = specdec::BatchGammaOptions{.max_gamma = 5},
                                 .clock = [&clock] { return clock += 0.001; }});
  const auto add_round = [&](std::uint64_t first) {
    for (std::uint64_t id = first; id < first + 16; ++id) {
      specdec::SequenceRequest request;
      request.id = id;
      request.prompt = {1, 2, static_cast<specdec::token_id>(id % vocab)};
      request.max_new_tokens = 10 + id % 7;
      request.seed = 5;
      if (id % 3 == 1) request.sampling = {.temperature = 0.8, .top_k = 4};
      if (id % 4 == 2) request.stop_tokens = {3};
      decoder.add(std::move(request));
    }
  };
  for (std::uint64_t round = 0; round < 2; ++round) {  // warm-up
    add_round(round * 16);
    decoder.run();
    (void)decoder.take_finished();
  }
  add_round(32);
  specdec::testing::AllocationCounter counter;
  std::size_t steps = 0;
  while (decoder.active() > 0) {
    decoder.step();
    ++steps;
  }
  const std::size_t allocations = counter.stop();
  INFO(steps << " steps");
  CHECK(allocations == 0);
  CHECK(decoder.take_finished().size() == 16);
}
