// Tests for propose_many (MultiProposalDrafter) of NgramDrafter and PromptLookupDrafter:
// which continuations come out and in which order (against brute-force references over
// random contexts, rollbacks included), the bounds (B, L, window, min/max ngram), the
// first continuation equalling propose(), linear comparison counts and no allocation once
// warm.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/concepts.hpp"
#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/random.hpp"
#include "support/counting_allocator.hpp"

namespace {

using specdec::token_id;
using Tokens = std::vector<token_id>;
using Continuations = std::vector<Tokens>;

template <class Drafter>
Continuations propose_many(Drafter& drafter, const Tokens& context, std::size_t branches,
                           std::size_t length) {
  Tokens out(branches * length, -1);
  std::vector<std::size_t> lengths(branches, 0);
  const std::size_t count = drafter.propose_many(context, out, lengths);
  REQUIRE(count <= branches);
  Continuations result;
  for (std::size_t b = 0; b < count; ++b) {
    REQUIRE(lengths[b] >= 1);
    REQUIRE(lengths[b] <= length);
    const auto first = out.begin() + static_cast<std::ptrdiff_t>(b * length);
    result.emplace_back(first, first + static_cast<std::ptrdiff_t>(lengths[b]));
  }
  return result;
}

template <class Drafter>
Tokens propose(Drafter& drafter, const Tokens& context, std::size_t length) {
  Tokens out(length, -1);
  out.resize(drafter.propose(context, out));
  return out;
}

Tokens random_tokens(specdec::xoshiro256pp& g, std::size_t length, std::size_t vocab) {
  Tokens tokens(length);
  for (token_id& token : tokens) token = static_cast<token_id>(specdec::uniform_below(g, vocab));
  return tokens;
}

// ---------------------------------------------------------------------------------------
// N-gram reference: counts recomputed from the window for every lookup
// ---------------------------------------------------------------------------------------

struct Successor {
  token_id token = 0;
  std::size_t count = 0;
  std::size_t newest = 0;
};

// Successors of `lookup` (its whole length is the n-gram context) among the n-grams lying
// in window positions [begin, end) of `text`, ranked by count, then newest occurrence.
std::vector<Successor> reference_successors(const Tokens& text, std::size_t begin, std::size_t end,
                                            std::span<const token_id> lookup) {
  std::vector<Successor> found;
  const std::size_t m = lookup.size();
  for (std::size_t p = begin + m; p < end; ++p) {
    if (!std::equal(lookup.begin(), lookup.end(),
                    text.begin() + static_cast<std::ptrdiff_t>(p - m)))
      continue;
    auto it = std::find_if(found.begin(), found.end(),
                           [&](const Successor& s) { return s.token == text[p]; });
    if (it == found.end()) {
      found.push_back({text[p], 1, p});
    } else {
      ++it->count;
      it->newest = p;
    }
  }
  std::sort(found.begin(), found.end(), [](const Successor& a, const Successor& b) {
    return a.count > b.count || (a.count == b.count && a.newest > b.newest);
  });
  return found;
}

struct NgramReference {
  const Tokens& context;
  std::size_t orders;  // N - 1
  std::size_t window;
  [[nodiscard]] std::size_t begin() const {
    return context.size() > window ? context.size() - window : 0;
  }

  // Chains from `lookup` (context tail plus proposals) as propose() does.
  void chain(Tokens lookup, std::size_t count, Tokens& out) const {
    for (std::size_t k = 0; k < count; ++k) {
      bool found = false;
      for (std::size_t m = std::min(orders, lookup.size()); m >= 1 && !found; --m) {
        const auto successors =
            reference_successors(context, begin(), context.size(),
                                 std::span<const token_id>(lookup.data() + lookup.size() - m, m));
        if (successors.empty()) continue;
        out.push_back(successors[0].token);
        lookup.push_back(successors[0].token);
        found = true;
      }
      if (!found) return;
    }
  }

  [[nodiscard]] Continuations many(std::size_t branches, std::size_t length) const {
    Continuations result;
    if (length == 0) return result;
    Tokens firsts;
    for (std::size_t m = std::min(orders, context.size()); m >= 1; --m) {
      const auto successors =
          reference_successors(context, begin(), context.size(),
                               std::span<const token_id>(context.data() + context.size() - m, m));
      for (const Successor& s : successors) {
        if (firsts.size() < branches &&
            std::find(firsts.begin(), firsts.end(), s.token) == firsts.end())
          firsts.push_back(s.token);
      }
    }
    for (const token_id first : firsts) {
      Tokens lookup(context.end() - static_cast<std::ptrdiff_t>(std::min(orders, context.size())),
                    context.end());
      lookup.push_back(first);
      Tokens continuation{first};
      chain(lookup, length - 1, continuation);
      result.push_back(continuation);
    }
    return result;
  }
};

// ---------------------------------------------------------------------------------------
// Prompt-lookup reference: every occurrence's match length, sorted, first B distinct
// ---------------------------------------------------------------------------------------

Continuations reference_lookup_many(const Tokens& context,
                                    const specdec::PromptLookupOptions& options,
                                    std::size_t branches, std::size_t length) {
  Continuations result;
  const std::size_t n = context.size();
  const std::size_t searched = std::min(n, options.window);
  if (length == 0 || searched < 2) return result;
  const std::size_t pattern = std::min(options.max_ngram, searched - 1);
  if (pattern < options.min_ngram) return result;
  struct Candidate {
    std::size_t length;
    std::size_t i;
  };
  std::vector<Candidate> candidates;
  for (std::size_t i = 1; i < searched; ++i) {  // the occurrence ends at n - 1 - i
    std::size_t common = 0;
    while (common < pattern && i + common < searched &&
           context[n - 1 - i - common] == context[n - 1 - common])
      ++common;
    if (common >= options.min_ngram) candidates.push_back({common, i});
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.length > b.length; });
  for (const Candidate& c : candidates) {
    // Overlapping copy from position n - i, continuing with its own tokens.
    Tokens continuation;
    for (std::size_t k = 0; k < length; ++k) {
      const std::size_t position = n - c.i + k;
      continuation.push_back(position < n ? context[position] : continuation[position - n]);
    }
    if (std::find(result.begin(), result.end(), continuation) == result.end())
      result.push_back(continuation);
    if (result.size() == branches) break;
  }
  return result;
}

}  // namespace

TEST_CASE("Both drafters are multi-proposal drafters", "[drafters][proposal_tree]") {
  STATIC_REQUIRE(specdec::MultiProposalDrafter<specdec::NgramDrafter>);
  STATIC_REQUIRE(specdec::MultiProposalDrafter<specdec::PromptLookupDrafter>);
  struct OneOnly {
    std::size_t propose(std::span<const token_id>, std::span<token_id>) { return 0; }
  };
  STATIC_REQUIRE(specdec::ProposalDrafter<OneOnly>);
  STATIC_REQUIRE_FALSE(specdec::MultiProposalDrafter<OneOnly>);
}

TEST_CASE("NgramDrafter::propose_many: longest context first, then backoff, each chained",
          "[drafters][ngram][proposal_tree]") {
  specdec::NgramDrafter drafter({.max_order = 3, .window = 64});
  // After "1 2": 3 twice (newest at position 8), 4 once. After "2": also 7 (via "5 2 7").
  const Tokens context{1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 2, 7, 1, 2};
  const Continuations three = propose_many(drafter, context, 3, 4);
  REQUIRE(three.size() == 3);
  CHECK(three[0] == Tokens{3, 5, 2, 7});  // "2 3" was last followed by 5
  CHECK(three[1] == Tokens{4, 1, 2, 3});
  CHECK(three[2] == Tokens{7, 1, 2, 3});
  CHECK(three[0] == propose(drafter, context, 4));
  // B larger than the candidates: only the distinct successors of "1 2" and "2".
  CHECK(propose_many(drafter, context, 6, 4).size() == 3);
  // B = 1 is propose(); L = 1 gives the first tokens alone.
  CHECK(propose_many(drafter, context, 1, 4) == Continuations{three[0]});
  CHECK(propose_many(drafter, context, 3, 1) == Continuations{{3}, {4}, {7}});
  // L = 0 (out shorter than B) and B = 0 propose nothing; an unseen last token neither.
  Tokens out(2);
  std::vector<std::size_t> lengths(3);
  CHECK(drafter.propose_many(context, out, lengths) == 0);
  CHECK(drafter.propose_many(context, out, std::span<std::size_t>{}) == 0);
  CHECK(propose_many(drafter, Tokens{1, 2, 3, 9}, 3, 4).empty());
  CHECK(propose_many(drafter, Tokens{}, 3, 4).empty());
}

TEST_CASE("NgramDrafter::propose_many matches a brute-force reference",
          "[drafters][ngram][proposal_tree]") {
  specdec::xoshiro256pp g(2024);
  std::size_t rounds = 0;
  std::size_t branched = 0;
  for (const std::size_t max_order : {std::size_t{2}, std::size_t{3}, std::size_t{5}}) {
    for (const std::size_t window : {std::size_t{8}, std::size_t{40}}) {
      if (window < max_order) continue;
      specdec::NgramDrafter drafter({.max_order = max_order, .window = window});
      Tokens context;
      for (std::size_t round = 0; round < 150; ++round) {
        // Extend, roll back or replace the context, so that the tables follow it
        // incrementally as in decoding.
        const auto action = specdec::uniform_below(g, 4);
        if (action == 0 || context.empty()) {
          context = random_tokens(g, specdec::uniform_below(g, 60), 3 + round % 3);
        } else if (action == 1) {
          context.resize(context.size() - specdec::uniform_below(g, context.size()));
        } else {
          const Tokens more = random_tokens(g, 1 + specdec::uniform_below(g, 6), 3 + round % 3);
          context.insert(context.end(), more.begin(), more.end());
        }
        const std::size_t branches = 1 + specdec::uniform_below(g, 5);
        const std::size_t length = specdec::uniform_below(g, 7);
        const NgramReference reference{context, max_order - 1, window};
        INFO("N = " << max_order << ", W = " << window << ", round " << round << ", B = "
                    << branches << ", L = " << length << ", context size " << context.size());
        const Continuations got = propose_many(drafter, context, branches, length);
        REQUIRE(got == reference.many(branches, length));
        if (!got.empty()) REQUIRE(got[0] == propose(drafter, context, length));
        branched += got.size() >= 2 ? 1U : 0U;
        rounds += 1;
      }
    }
  }
  CHECK(branched * 3 > rounds);  // the comparisons covered several continuations
}

TEST_CASE("PromptLookupDrafter::propose_many: longest match first, most recent first, distinct",
          "[drafters][prompt_lookup][proposal_tree]") {
  specdec::PromptLookupDrafter drafter({.min_ngram = 1, .max_ngram = 3, .window = 1024});
  const Tokens context{7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 6, 8, 1, 2};
  // The suffix "8 1 2" occurs nowhere else; "1 2" ends at positions 10, 6 and 2, whose
  // continuations are "3 6", "4 5" and "3 9" (most recent first). Every "2" ends a "1 2",
  // so there are no shorter matches.
  const Continuations two = propose_many(drafter, context, 4, 2);
  CHECK(two == Continuations{{3, 6}, {4, 5}, {3, 9}});
  CHECK(drafter.last_match().length == 2);
  CHECK(drafter.last_match().source == 11);
  CHECK(two[0] == propose(drafter, context, 2));
  // With L = 1 the continuations "3", "4" are all there is: duplicates are merged.
  CHECK(propose_many(drafter, context, 4, 1) == Continuations{{3}, {4}});
  // B = 2 keeps the best two.
  CHECK(propose_many(drafter, context, 2, 2) == Continuations{{3, 6}, {4, 5}});
  // min_ngram = 3 excludes every match; a context of one token has no earlier position.
  specdec::PromptLookupDrafter strict({.min_ngram = 3, .max_ngram = 3, .window = 1024});
  CHECK(propose_many(strict, context, 4, 2).empty());
  CHECK(propose_many(drafter, Tokens{5}, 4, 2).empty());
  // The overlapping copy: a period-2 tail continues periodically in every continuation.
  const Continuations periodic = propose_many(drafter, Tokens{4, 1, 2, 1, 2}, 3, 5);
  REQUIRE(!periodic.empty());
  CHECK(periodic[0] == Tokens{1, 2, 1, 2, 1});
  CHECK(periodic == reference_lookup_many(Tokens{4, 1, 2, 1, 2}, drafter.options(), 3, 5));
}

TEST_CASE("PromptLookupDrafter::propose_many matches a brute-force reference",
          "[drafters][prompt_lookup][proposal_tree]") {
  specdec::xoshiro256pp g(77);
  std::size_t branched = 0;
  for (std::size_t round = 0; round < 600; ++round) {
    specdec::PromptLookupOptions options;
    options.min_ngram = 1 + specdec::uniform_below(g, 3);
    options.max_ngram = options.min_ngram + specdec::uniform_below(g, 5);
    options.window = 2 + specdec::uniform_below(g, 60);
    specdec::PromptLookupDrafter drafter(options);
    const std::size_t vocab = 2 + specdec::uniform_below(g, 3);
    const Tokens context = random_tokens(g, specdec::uniform_below(g, 80), vocab);
    const std::size_t branches = 1 + specdec::uniform_below(g, 6);
    const std::size_t length = specdec::uniform_below(g, 7);
    INFO("round " << round << ": min " << options.min_ngram << ", max " << options.max_ngram
                  << ", window " << options.window << ", B " << branches << ", L " << length);
    const Continuations got = propose_many(drafter, context, branches, length);
    REQUIRE(got == reference_lookup_many(context, options, branches, length));
    if (!got.empty()) REQUIRE(got[0] == propose(drafter, context, length));
    branched += got.size() >= 2 ? 1U : 0U;
  }
  CHECK(branched > 200);  // the comparisons covered several continuations
}

TEST_CASE("PromptLookupDrafter::propose_many stays linear and stops early",
          "[drafters][prompt_lookup][proposal_tree]") {
  const std::size_t branches = 4;
  const std::size_t length = 8;
  specdec::PromptLookupDrafter drafter({.min_ngram = 1, .max_ngram = 8, .window = 1 << 14});
  // All-equal text: every position is a full-length occurrence with the same continuation,
  // so no scan can stop early and each occurrence is compared once with the one held.
  for (const std::size_t n : {std::size_t{2000}, std::size_t{8000}}) {
    const Tokens same(n, 3);
    CHECK(propose_many(drafter, same, branches, length) == Continuations{Tokens(length, 3)});
    CHECK(drafter.last_match().comparisons <= (2 + branches * length) * n);
  }
  // Distinct full-length continuations near the end: the scan stops after B of them.
  Tokens text;
  for (int k = 0; k < 3000; ++k) {
    text.insert(text.end(), {1, 2, 3, 4, 5, 6, 7, 8, static_cast<token_id>(10 + k % 50)});
  }
  text.insert(text.end(), {1, 2, 3, 4, 5, 6, 7, 8});
  const Continuations got = propose_many(drafter, text, branches, 1);
  CHECK(got == Continuations{{59}, {58}, {57}, {56}});
  CHECK(drafter.last_match().comparisons < 200);
}

TEST_CASE("propose_many allocates nothing once warm", "[drafters][proposal_tree][allocation]") {
  specdec::xoshiro256pp g(5);
  Tokens context = random_tokens(g, 3000, 6);
  context.reserve(context.size() + 1000);
  Tokens out(6 * 8);
  std::vector<std::size_t> lengths(6);
  specdec::NgramDrafter ngram({.max_order = 4, .window = 512});
  specdec::PromptLookupDrafter lookup({.min_ngram = 1, .max_ngram = 6, .window = 4096});
  std::size_t proposed = 0;
  proposed += ngram.propose_many(context, out, lengths);
  proposed += lookup.propose_many(context, out, lengths);
  specdec::testing::AllocationCounter counter;
  for (int k = 0; k < 200; ++k) {
    context.push_back(static_cast<token_id>(specdec::uniform_below(g, 6)));
    proposed += ngram.propose_many(context, out, lengths);
    proposed += lookup.propose_many(context, out, lengths);
    // Fewer branches and shorter continuations reuse the same buffers.
    proposed += ngram.propose_many(context, std::span<token_id>(out).first(8),
                                   std::span<std::size_t>(lengths).first(2));
    proposed += lookup.propose_many(context, std::span<token_id>(out).first(8),
                                    std::span<std::size_t>(lengths).first(2));
  }
  CHECK(counter.stop() == 0);
  CHECK(proposed > 400);
}
