// Tests for include/specdec/drafters/prompt_lookup.hpp: the longest, most recent match,
// the overlapping copy, the window, and linear comparison counts on adversarial input.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <numeric>
#include <span>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/concepts.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "support/counting_allocator.hpp"

namespace {

using specdec::token_id;
using Tokens = std::vector<token_id>;

Tokens propose(specdec::PromptLookupDrafter& drafter, const Tokens& context, std::size_t gamma) {
  Tokens out(gamma, -1);
  out.resize(drafter.propose(context, out));
  return out;
}

struct ReferenceMatch {
  std::size_t length = 0;
  std::size_t source = 0;
};

// Quadratic reference: every earlier end position, longest common suffix capped at
// max_ngram, ties to the most recent; restricted to the last `window` tokens.
ReferenceMatch reference_match(const Tokens& context, std::size_t max_ngram, std::size_t window) {
  ReferenceMatch best;
  const std::size_t length = context.size();
  if (length < 2) return best;
  const std::size_t begin = length > window ? length - window : 0;
  for (std::size_t end = length - 1; end-- > begin;) {  // most recent first
    std::size_t common = 0;
    while (common < max_ngram && end >= begin + common &&
           context[end - common] == context[length - 1 - common])
      ++common;
    if (common > best.length) best = {common, end + 1};
  }
  return best;
}

}  // namespace

TEST_CASE("PromptLookupDrafter is a proposal drafter", "[drafters][prompt_lookup]") {
  STATIC_REQUIRE(specdec::ProposalDrafter<specdec::PromptLookupDrafter>);
  STATIC_REQUIRE_FALSE(specdec::LanguageModel<specdec::PromptLookupDrafter>);
}

TEST_CASE("PromptLookupDrafter copies after the longest match, most recent on ties",
          "[drafters][prompt_lookup]") {
  specdec::PromptLookupDrafter lookup;
  SECTION("longer beats more recent") {
    const Tokens context = {2, 3, 4, 200, 201, 9, 3, 4, 100, 101, 9, 2, 3, 4};
    CHECK(propose(lookup, context, 3) == Tokens{200, 201, 9});
    CHECK(lookup.last_match().length == 3);
    CHECK(lookup.last_match().source == 3);
  }
  SECTION("equal length: the most recent occurrence") {
    const Tokens context = {5, 1, 7, 5, 1, 8, 5, 1};
    CHECK(propose(lookup, context, 2) == Tokens{8, 5});
    CHECK(lookup.last_match().length == 2);
  }
  SECTION("a repeated code block is copied") {
    const Tokens block = {40, 1, 50, 2, 3, 4, 50, 5, 51, 4, 6, 50, 7, 8};
    Tokens context = block;
    for (token_id t = 100; t < 130; ++t) context.push_back(t);
    context.insert(context.end(), block.begin(), block.begin() + 4);
    CHECK(propose(lookup, context, 10) == Tokens(block.begin() + 4, block.end()));
  }
  SECTION("no repetition: nothing to propose") {
    Tokens context(100);
    std::iota(context.begin(), context.end(), 0);
    CHECK(propose(lookup, context, 4).empty());
    CHECK(propose(lookup, Tokens{3}, 4).empty());
    CHECK(propose(lookup, Tokens{}, 4).empty());
  }
}

TEST_CASE("PromptLookupDrafter copies periodic text past the end of the context",
          "[drafters][prompt_lookup]") {
  specdec::PromptLookupDrafter lookup;
  CHECK(propose(lookup, Tokens{1, 2, 3, 1, 2, 3, 1, 2}, 8) == Tokens{3, 1, 2, 3, 1, 2, 3, 1});
  CHECK(lookup.last_match().length == 5);
  CHECK(propose(lookup, Tokens{7, 7, 7, 7}, 6) == Tokens(6, 7));
}

TEST_CASE("PromptLookupDrafter honours min_ngram, max_ngram and the window",
          "[drafters][prompt_lookup]") {
  const Tokens context = {9, 4, 5, 0, 0, 0, 0, 0, 0, 6, 4};
  specdec::PromptLookupDrafter any({.min_ngram = 1});
  CHECK(propose(any, context, 2) == Tokens{5, 0});
  specdec::PromptLookupDrafter pairs({.min_ngram = 2});
  CHECK(propose(pairs, context, 2).empty());
  specdec::PromptLookupDrafter narrow({.min_ngram = 1, .max_ngram = 8, .window = 9});
  CHECK(propose(narrow, context, 2).empty());  // the earlier "4" is outside the last 9
  // max_ngram caps the compared suffix: with 1 the most recent single-token match wins.
  const Tokens both = {1, 2, 30, 5, 2, 40, 1, 2};
  specdec::PromptLookupDrafter longest({.max_ngram = 2});
  CHECK(propose(longest, both, 1) == Tokens{30});
  specdec::PromptLookupDrafter shortest({.max_ngram = 1});
  CHECK(propose(shortest, both, 1) == Tokens{40});
}

TEST_CASE("PromptLookupDrafter agrees with a quadratic reference", "[drafters][prompt_lookup]") {
  specdec::xoshiro256pp rng(2024);
  for (int trial = 0; trial < 400; ++trial) {
    const auto alphabet = 1 + specdec::uniform_below(rng, 3);
    Tokens context(specdec::uniform_below(rng, 120));
    for (auto& t : context) t = static_cast<token_id>(specdec::uniform_below(rng, alphabet));
    const std::size_t max_ngram = 1 + specdec::uniform_below(rng, 12);
    const std::size_t window = 2 + specdec::uniform_below(rng, 150);
    specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = max_ngram, .window = window});
    Tokens out(5);
    const std::size_t drafted = lookup.propose(context, out);
    const ReferenceMatch expected = reference_match(context, max_ngram, window);
    INFO("trial " << trial);
    REQUIRE(lookup.last_match().length == expected.length);
    REQUIRE(drafted == (expected.length > 0 ? out.size() : 0));
    if (expected.length > 0) {
      REQUIRE(lookup.last_match().source == expected.source);
      for (std::size_t k = 0; k < out.size(); ++k) {
        const std::size_t position = expected.source + k;
        REQUIRE(out[k] ==
                (position < context.size() ? context[position] : out[position - context.size()]));
      }
    }
    const std::size_t searched = std::min(context.size(), window);
    REQUIRE(lookup.last_match().comparisons <= 2 * searched + 2 * max_ngram);
  }
}

TEST_CASE("PromptLookupDrafter is linear on adversarial input", "[drafters][prompt_lookup]") {
  constexpr std::size_t n = 20000;
  const specdec::PromptLookupOptions unbounded{
      .min_ngram = 1, .max_ngram = 1000000, .window = 1000000};
  SECTION("a^n b: the suffix never occurred") {
    Tokens context(n, 0);
    context.push_back(1);
    specdec::PromptLookupDrafter lookup(unbounded);
    CHECK(propose(lookup, context, 4).empty());
    CHECK(lookup.last_match().comparisons <= 2 * context.size());
  }
  SECTION("a^n b a^n: the longest match is the first run, with long partial matches everywhere") {
    // A naive scan compares ~n^2 = 4e8 tokens here.
    Tokens context(n, 0);
    context.push_back(1);
    context.insert(context.end(), n, 0);
    specdec::PromptLookupDrafter lookup(unbounded);
    CHECK(propose(lookup, context, 3) == Tokens{1, 0, 0});
    CHECK(lookup.last_match().length == n);
    CHECK(lookup.last_match().source == n);
    CHECK(lookup.last_match().comparisons <= 4 * context.size());
  }
  SECTION("aaaa...a: stops at the most recent full-length match") {
    Tokens context(n, 0);
    specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 8});
    CHECK(propose(lookup, context, 2) == Tokens{0, 0});
    CHECK(lookup.last_match().length == 8);
    CHECK(lookup.last_match().source == n - 1);
    CHECK(lookup.last_match().comparisons <= 40);
  }
}

TEST_CASE("PromptLookupDrafter validates its options", "[drafters][prompt_lookup]") {
  CHECK_THROWS_AS(specdec::PromptLookupDrafter({.min_ngram = 0}), specdec::error);
  CHECK_THROWS_AS(specdec::PromptLookupDrafter({.min_ngram = 3, .max_ngram = 2}), specdec::error);
  CHECK_THROWS_AS(specdec::PromptLookupDrafter({.min_ngram = 1, .max_ngram = 2, .window = 1}),
                  specdec::error);
}

TEST_CASE("PromptLookupDrafter allocates nothing once its failure array has grown",
          "[drafters][prompt_lookup]") {
  specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 16, .window = 256});
  specdec::xoshiro256pp rng(8);
  Tokens context(1000);
  for (auto& t : context) t = static_cast<token_id>(specdec::uniform_below(rng, 3));
  std::array<token_id, 8> out{};
  static_cast<void>(lookup.propose(Tokens(40, 0), out));  // grows the array to max_ngram
  specdec::testing::AllocationCounter counter;
  ::operator delete(::operator new(16));  // the counter works
  REQUIRE(counter.count() == 1);
  for (std::size_t length = 2; length <= context.size(); ++length)
    static_cast<void>(lookup.propose(std::span<const token_id>(context).first(length), out));
  CHECK(counter.stop() == 1);
}
