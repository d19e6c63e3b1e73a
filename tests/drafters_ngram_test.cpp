// Tests for include/specdec/drafters/ngram.hpp: proposals on constructed sequences, the
// online window (extension, rollback, new prompt), the memory bound and the smoothed rows.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <new>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/concepts.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/error.hpp"
#include "specdec/random.hpp"
#include "support/counting_allocator.hpp"

namespace {

using specdec::token_id;
using Tokens = std::vector<token_id>;

Tokens propose(specdec::NgramDrafter& drafter, const Tokens& context, std::size_t gamma) {
  Tokens out(gamma, -1);
  out.resize(drafter.propose(context, out));
  return out;
}

Tokens periodic(std::size_t period, std::size_t length) {
  Tokens tokens(length);
  for (std::size_t i = 0; i < length; ++i) tokens[i] = static_cast<token_id>(10 + i % period);
  return tokens;
}

// Brute-force reference: counts of every n-gram inside the last W tokens, most frequent
// successor with ties to the most recent, longest context first, chained.
Tokens reference_proposal(const Tokens& context, std::size_t max_order, std::size_t window,
                          std::size_t gamma) {
  const std::size_t begin = context.size() > window ? context.size() - window : 0;
  // context tokens -> next token -> (count, newest position)
  std::map<Tokens, std::map<token_id, std::pair<std::size_t, std::size_t>>> table;
  for (std::size_t position = begin; position < context.size(); ++position) {
    for (std::size_t length = 1; length < max_order && position >= begin + length; ++length) {
      Tokens key(context.begin() + static_cast<std::ptrdiff_t>(position - length),
                 context.begin() + static_cast<std::ptrdiff_t>(position));
      auto& entry = table[key][context[position]];
      ++entry.first;
      entry.second = position;
    }
  }
  Tokens extended = context;
  Tokens out;
  while (out.size() < gamma) {
    bool found = false;
    for (std::size_t length = std::min(max_order - 1, extended.size()); length >= 1; --length) {
      const Tokens key(extended.end() - static_cast<std::ptrdiff_t>(length), extended.end());
      const auto it = table.find(key);
      if (it == table.end()) continue;
      const auto best =
          std::max_element(it->second.begin(), it->second.end(),
                           [](const auto& a, const auto& b) { return a.second < b.second; });
      out.push_back(best->first);
      extended.push_back(best->first);
      found = true;
      break;
    }
    if (!found) break;
  }
  return out;
}

// Distinct n-grams (per order) inside the window: the exact number of live records.
std::pair<std::size_t, std::size_t> reference_sizes(const Tokens& context, std::size_t max_order,
                                                    std::size_t window) {
  const std::size_t begin = context.size() > window ? context.size() - window : 0;
  std::map<Tokens, int> contexts;
  std::map<Tokens, int> pairs;
  for (std::size_t position = begin; position < context.size(); ++position) {
    for (std::size_t length = 1; length < max_order && position >= begin + length; ++length) {
      Tokens key(context.begin() + static_cast<std::ptrdiff_t>(position - length),
                 context.begin() + static_cast<std::ptrdiff_t>(position + 1));
      pairs[key] = 1;
      key.pop_back();
      contexts[key] = 1;
    }
  }
  return {contexts.size(), pairs.size()};
}

}  // namespace

TEST_CASE("NgramDrafter satisfies the drafter concepts", "[drafters][ngram]") {
  STATIC_REQUIRE(specdec::ProposalDrafter<specdec::NgramDrafter>);
  STATIC_REQUIRE(specdec::Drafter<specdec::NgramDrafter>);
  STATIC_REQUIRE(specdec::LanguageModel<specdec::NgramDraftModel<float>>);
  STATIC_REQUIRE(specdec::Drafter<specdec::NgramDraftModel<double>>);
}

TEST_CASE("NgramDrafter continues periodic text", "[drafters][ngram]") {
  specdec::NgramDrafter drafter;
  const Tokens context = periodic(5, 23);  // 10 11 12 13 14 10 ... 12
  CHECK(propose(drafter, context, 8) == Tokens{13, 14, 10, 11, 12, 13, 14, 10});
  // Proposals are never ingested: the tables describe the context only.
  CHECK(drafter.context_length() == context.size());
  CHECK(drafter.count(Tokens{12}, 13) == 4);
  // Period 1 ("aaaa") chains forever.
  CHECK(propose(drafter, Tokens(6, 7), 5) == Tokens(5, 7));
}

TEST_CASE("NgramDrafter proposes the rest of a repeated code block", "[drafters][ngram]") {
  // "for ( i = 0 ; i < n ; ++ i ) {" as ids, then other code, then the block's start again.
  const Tokens block = {40, 1, 50, 2, 3, 4, 50, 5, 51, 4, 6, 50, 7, 8};
  Tokens context = block;
  for (token_id t = 100; t < 130; ++t) context.push_back(t);
  context.insert(context.end(), block.begin(), block.begin() + 3);  // "for ( i"
  specdec::NgramDrafter drafter;
  CHECK(propose(drafter, context, 11) == Tokens(block.begin() + 3, block.end()));
}

TEST_CASE("NgramDrafter has nothing to propose without repetition", "[drafters][ngram]") {
  Tokens context(300);
  std::iota(context.begin(), context.end(), 0);
  specdec::NgramDrafter drafter;
  CHECK(propose(drafter, context, 4).empty());
  CHECK(propose(drafter, Tokens{}, 4).empty());
  CHECK(propose(drafter, Tokens{5}, 4).empty());
}

TEST_CASE("NgramDrafter backs off, stops, and breaks ties by recency", "[drafters][ngram]") {
  specdec::NgramDrafter drafter;
  SECTION("longest context first") {
    // After (1 2): 3; after (2) alone: 9 twice. The 3-token context (5 1 2) decides first.
    const Tokens context = {5, 1, 2, 3, 7, 2, 9, 8, 2, 9, 6, 5, 1, 2};
    CHECK(propose(drafter, context, 1) == Tokens{3});
    // Backoff to one token: (4 2) and (x 4 2) are unseen, (2) is followed by 9 most often.
    const Tokens backoff = {5, 1, 2, 3, 7, 2, 9, 8, 2, 9, 6, 4, 2};
    CHECK(propose(drafter, backoff, 1) == Tokens{9});
  }
  SECTION("chains its own proposals, stops when no context matches") {
    // Once the last token has been followed by something, every token of the window but
    // the last has a successor, so the chain runs to gamma; an unseen last token stops it.
    CHECK(propose(drafter, Tokens{1, 2, 3, 0, 1}, 8) == Tokens{2, 3, 0, 1, 2, 3, 0, 1});
    CHECK(propose(drafter, Tokens{1, 2, 3, 0, 4}, 8).empty());
  }
  SECTION("frequency first, then the most recent") {
    CHECK(propose(drafter, Tokens{1, 2, 3, 1, 2, 4, 1, 2}, 1) == Tokens{4});
    CHECK(propose(drafter, Tokens{1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2}, 1) == Tokens{3});
  }
}

TEST_CASE("NgramDrafter forgets what leaves the window", "[drafters][ngram]") {
  specdec::NgramDrafter drafter({.max_order = 3, .window = 8});
  Tokens context = {7, 8, 9};
  for (token_id t = 20; t < 30; ++t) context.push_back(t);
  context.push_back(7);
  CHECK(propose(drafter, context, 3).empty());  // 7 -> 8 fell out of the window
  CHECK(drafter.history_size() == 8);
  Tokens recent = {7, 8, 9, 20, 21, 7};
  CHECK(propose(drafter, recent, 3) == Tokens{8, 9, 20});
}

TEST_CASE(
    "NgramDrafter tables follow the context through extensions, rollbacks and new "
    "prompts",
    "[drafters][ngram]") {
  specdec::xoshiro256pp rng(42);
  for (const std::size_t window : {std::size_t{6}, std::size_t{16}, std::size_t{64}}) {
    for (const std::size_t max_order : {std::size_t{2}, std::size_t{4}, std::size_t{6}}) {
      if (window < max_order) continue;
      specdec::NgramDrafter drafter({.max_order = max_order, .window = window});
      Tokens context;
      for (int step = 0; step < 300; ++step) {
        const auto action = specdec::uniform_below(rng, 10);
        if (action < 6) {  // extend by a few tokens from a small alphabet (lots of repeats)
          const auto added = 1 + specdec::uniform_below(rng, 5);
          for (std::uint64_t i = 0; i < added; ++i)
            context.push_back(static_cast<token_id>(specdec::uniform_below(rng, 4)));
        } else if (action < 9) {  // roll back (rejected drafts) or edit the tail
          const auto removed =
              specdec::uniform_below(rng, std::min<std::uint64_t>(context.size(), 2 * window) + 1);
          context.resize(context.size() - removed);
          if (action == 8 && !context.empty()) context.back() ^= 1;
        } else {  // a new prompt
          context.assign(specdec::uniform_below(rng, 3 * window), 0);
          for (auto& t : context) t = static_cast<token_id>(specdec::uniform_below(rng, 4));
        }
        const Tokens proposal = propose(drafter, context, 6);
        INFO("window " << window << ", order " << max_order << ", step " << step);
        REQUIRE(proposal == reference_proposal(context, max_order, window, 6));
        const auto [contexts, pairs] = reference_sizes(context, max_order, window);
        REQUIRE(drafter.contexts() == contexts);
        REQUIRE(drafter.successors() == pairs);
        REQUIRE(drafter.context_length() == context.size());
      }
    }
  }
}

TEST_CASE("NgramDrafter memory is bounded by (N-1) W entries and never grows",
          "[drafters][ngram]") {
  for (const std::size_t max_order : {std::size_t{2}, std::size_t{4}}) {
    specdec::NgramDrafter drafter({.max_order = max_order, .window = 512});
    const std::size_t bytes = drafter.memory_bytes();
    CHECK(drafter.max_entries() == (max_order - 1) * 512);
    if constexpr (sizeof(std::size_t) == 8) {  // documented: 168 to 232 bytes per entry
      CHECK(bytes <= 232 * drafter.max_entries());
      CHECK(bytes >= 168 * drafter.max_entries());
    }
    specdec::xoshiro256pp rng(7);
    Tokens context;
    std::size_t peak_contexts = 0;
    std::size_t peak_successors = 0;
    std::array<token_id, 4> out{};
    for (int i = 0; i < 20000; ++i) {
      // Mostly fresh tokens from a large vocabulary (worst case: every n-gram distinct),
      // occasionally periodic stretches and rollbacks.
      if (i % 1000 < 900) {
        context.push_back(static_cast<token_id>(specdec::uniform_below(rng, 1u << 20)));
      } else {
        context.push_back(static_cast<token_id>(i % 7));
      }
      if (i % 97 == 0) context.resize(context.size() - std::min<std::size_t>(context.size(), 5));
      static_cast<void>(drafter.propose(context, out));
      peak_contexts = std::max(peak_contexts, drafter.contexts());
      peak_successors = std::max(peak_successors, drafter.successors());
    }
    CHECK(peak_contexts <= drafter.max_entries());
    CHECK(peak_successors <= drafter.max_entries());
    CHECK(peak_successors >= drafter.max_entries() - max_order * max_order);  // bound is tight
    CHECK(drafter.memory_bytes() == bytes);
  }
}

TEMPLATE_TEST_CASE("NgramDraftModel rows are Witten-Bell smoothed counts", "[drafters][ngram]",
                   float, double) {
  specdec::NgramDrafter drafter({.max_order = 3, .window = 64});
  auto model = drafter.as_model<TestType>(6);
  STATIC_REQUIRE(specdec::LanguageModel<decltype(model)>);
  CHECK(model.vocab_size() == 6);
  // After (1): 2 twice, 3 once  -> t1 = 3, u1 = 2. After (0 1): 2 twice -> t2 = 2, u2 = 1.
  const Tokens context = {0, 1, 2, 0, 1, 2, 4, 1, 3, 0, 1};
  const auto row = model.next_token_probabilities(context);
  REQUIRE(row.size() == 6);
  std::array<double, 6> q1{};
  for (std::size_t x = 0; x < 6; ++x) q1[x] = (2.0 / 5.0) * (1.0 / 6.0);
  q1[2] += 2.0 / 5.0;
  q1[3] += 1.0 / 5.0;
  std::array<double, 6> q2{};
  for (std::size_t x = 0; x < 6; ++x) q2[x] = (1.0 / 3.0) * q1[x];
  q2[2] += 2.0 / 3.0;
  const double tolerance = std::is_same_v<TestType, float> ? 1e-6 : 1e-12;
  double sum = 0.0;
  for (std::size_t x = 0; x < 6; ++x) {
    CHECK(static_cast<double>(row[x]) == Catch::Approx(q2[x]).margin(tolerance));
    CHECK(row[x] > 0);
    sum += static_cast<double>(row[x]);
  }
  CHECK(sum == Catch::Approx(1.0).margin(tolerance));
  // A deterministic function of the context, whatever was asked in between.
  const std::vector<TestType> first(row.begin(), row.end());
  static_cast<void>(model.next_token_probabilities(Tokens{5, 5, 5, 5}));
  Tokens extended = context;
  extended.push_back(2);
  static_cast<void>(model.next_token_probabilities(extended));
  const auto again = model.next_token_probabilities(context);
  CHECK(std::equal(first.begin(), first.end(), again.begin(), again.end()));
  // No context seen: uniform.
  const auto uniform = model.next_token_probabilities(Tokens{});
  for (const auto value : uniform)
    CHECK(static_cast<double>(value) == Catch::Approx(1.0 / 6.0).margin(tolerance));
}

TEST_CASE("NgramDraftModel and NgramDrafter validate their inputs", "[drafters][ngram]") {
  CHECK_THROWS_AS(specdec::NgramDrafter({.max_order = 1}), specdec::error);
  CHECK_THROWS_AS(specdec::NgramDrafter({.max_order = 33, .window = 512}), specdec::error);
  CHECK_THROWS_AS(specdec::NgramDrafter({.max_order = 4, .window = 3}), specdec::error);
  specdec::NgramDrafter drafter;
  CHECK_THROWS_AS(drafter.as_model<float>(0), specdec::error);
  auto model = drafter.as_model<float>(4);
  try {
    static_cast<void>(model.next_token_probabilities(Tokens{9, 1, 9, 1}));
    FAIL("expected specdec::error");
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::invalid_token);
  }
}

TEST_CASE("NgramDrafter reset forgets the tables", "[drafters][ngram]") {
  specdec::NgramDrafter drafter;
  CHECK(propose(drafter, periodic(3, 12), 2).size() == 2);
  drafter.reset();
  CHECK(drafter.contexts() == 0);
  CHECK(drafter.successors() == 0);
  CHECK(drafter.context_length() == 0);
}

TEST_CASE("NgramDrafter and its model view allocate nothing after construction",
          "[drafters][ngram]") {
  specdec::NgramDrafter drafter({.max_order = 4, .window = 64});
  auto model = drafter.as_model<float>(16);
  specdec::xoshiro256pp rng(5);
  Tokens context;
  context.reserve(5000);
  std::array<token_id, 8> out{};
  specdec::testing::AllocationCounter counter;
  ::operator delete(::operator new(16));  // the counter works
  REQUIRE(counter.count() == 1);
  for (int i = 0; i < 2000; ++i) {
    context.push_back(static_cast<token_id>(specdec::uniform_below(rng, i % 300 < 200 ? 4 : 16)));
    if (i % 50 == 0) context.resize(context.size() / 2);  // rollbacks and rebuilds
    static_cast<void>(drafter.propose(context, out));
    context.push_back(3);  // a drafted token scored by the model view, then rejected
    static_cast<void>(model.next_token_probabilities(context));
    context.pop_back();
  }
  CHECK(counter.stop() == 1);
}
