// Batch verification allocates nothing once warm (include/specdec/batch_verification.hpp),
// counted by replacing the global operator new (support/counting_allocator.hpp): a program
// of its own, because a ThreadSanitizer build defines operator new itself and runs
// batch_verification_test.
#include <cstddef>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/batch_verification.hpp"
#include "support/batch_sequences.hpp"
#include "support/counting_allocator.hpp"

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
