// Constrained generation with the llama engine example (examples/llama/constraints.hpp) on
// the shipped pair:
//  - greedy speculative output under a regular expression (TokenDfa), with and without a
//    logit bias and a banned token, equals greedy plain decoding on the same constrained
//    target rows token for token, for chain, tree and proposal drafters, and the text it
//    ends with </s> matches the expression in full (std::regex_match);
//  - sampled (T = 1) generation under BalancedBrackets keeps the brackets valid (checked by
//    an independent replay of the text), stops right after the expression closes, and is
//    balanced when it ends with </s>;
//  - the token strings concatenate to the tokenizer's decoding;
//  - BalancedBrackets and TextConstraint on a toy vocabulary: the mask names exactly the
//    tokens advance() accepts, in every state a random walk reaches.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <regex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "llama/constraints.hpp"
#include "llama/engine.hpp"
#include "llama/generate.hpp"
#include "llama/model.hpp"
#include "specdec/constrained_model.hpp"
#include "specdec/random.hpp"
#include "specdec/token_constraint.hpp"
#include "specdec/token_dfa.hpp"

// Unoptimised and sanitized builds run the shipped target slowly: shorter generations there.
#if defined(__OPTIMIZE__) && !defined(__SANITIZE_ADDRESS__)
#define LLAMA_CONSTRAINED_TEST_FAST 1
#else
#define LLAMA_CONSTRAINED_TEST_FAST 0
#endif

namespace {

using llama::BalancedBrackets;
using llama::drafter_kind;
using llama::Engine;
using llama::Model;
using llama::TextConstraint;
using specdec::token_id;
using Tokens = std::vector<token_id>;

constexpr std::size_t max_new_tokens = LLAMA_CONSTRAINED_TEST_FAST != 0 ? 48 : 16;

Model shipped_model(const std::string& name) {
  return Model(std::string(SPECDEC_LLAMA_MODELS) + "/" + name + ".gguf");
}

// The shipped pair, loaded once for the whole program.
struct Pair {
  Model target_model = shipped_model("target");
  Model draft_model = shipped_model("draft");
  std::vector<std::string> strings = llama::token_strings(target_model.tokenizer());
  token_id eos = *target_model.tokenizer().eos();
};

Pair& pair() {
  static Pair shared;
  return shared;
}

std::string text_of(std::span<const token_id> tokens) {
  std::string out;
  for (const token_id t : tokens) out += pair().strings[static_cast<std::size_t>(t)];
  return out;
}

llama::RunOptions run_options(double temperature, std::uint64_t seed) {
  llama::RunOptions options;
  options.sampling.temperature = temperature;
  options.max_new_tokens = max_new_tokens;
  options.seed = seed;
  options.stop_tokens = {pair().eos};
  return options;
}

// An independent check of a bracket text: replays `text` on top of the brackets `open_text`
// leaves open. Returns false at the first closing bracket that does not match, a depth above
// BalancedBrackets::capacity or a byte after the expression closed; `depth` and `closed` tell
// where the text ends.
bool brackets_valid(std::string_view open_text, std::string_view text, std::size_t& depth,
                    bool& closed) {
  const std::string_view opening = "([{";
  const std::string_view closing = ")]}";
  std::string stack;
  for (const char c : open_text) {
    if (opening.find(c) != std::string_view::npos) stack.push_back(c);
    const auto k = closing.find(c);
    if (k != std::string_view::npos && !stack.empty() && stack.back() == opening[k]) {
      stack.pop_back();
    }
  }
  closed = false;
  for (const char c : text) {
    if (closed) return false;
    if (opening.find(c) != std::string_view::npos) {
      if (stack.size() == BalancedBrackets::capacity) return false;
      stack.push_back(c);
    }
    const auto k = closing.find(c);
    if (k != std::string_view::npos) {
      if (stack.empty() || stack.back() != opening[k]) return false;
      stack.pop_back();
      closed = stack.empty();
    }
  }
  depth = stack.size();
  return true;
}

}  // namespace

TEST_CASE(
    "llama constrained: greedy speculative output under a regex equals greedy plain output on "
    "the same constrained target rows, and matches the regex in full") {
  Pair& p = pair();
  const llama::Tokenizer& tokenizer = p.target_model.tokenizer();
  Engine target(p.target_model);
  Engine draft(p.draft_model);
  const std::string pattern = R"( [a-z_]+\(([a-z_]+(, [a-z_]+)*)?\):)";
  const specdec::ByteDfa dfa = specdec::ByteDfa::compile(pattern);
  const std::regex reference(pattern);
  const std::array<token_id, 1> ends{p.eos};
  const llama::RunOptions options = run_options(0.0, 0);

  struct Case {
    std::string prompt;
    specdec::BiasOptions bias;
  };
  std::vector<Case> cases = {{"def", {}}, {"class Stack:\n    def", {}}};
  // The same first prompt with the first greedy token banned and another token biased.
  {
    specdec::ConstrainedSampling<specdec::TokenDfa> rules(target.vocab_size(),
                                                          specdec::TokenDfa(dfa, p.strings, ends));
    const Tokens prompt = tokenizer.encode("def");
    const auto first = llama::generate_plain_constrained(target, rules, prompt, options);
    REQUIRE(!first.tokens.empty());
    specdec::BiasOptions bias;
    bias.banned_tokens = {first.tokens[0]};
    bias.logit_bias = {{tokenizer.encode(" get", false).at(0), 3.0}};
    cases.push_back({"def", bias});
  }

  std::size_t ended = 0;
  for (const Case& c : cases) {
    const Tokens prompt = tokenizer.encode(c.prompt);
    specdec::ConstrainedSampling<specdec::TokenDfa> rules(
        target.vocab_size(), specdec::TokenDfa(dfa, p.strings, ends), c.bias);
    const auto plain = llama::generate_plain_constrained(target, rules, prompt, options);
    const std::string text = text_of(plain.tokens);
    INFO("prompt \"" << c.prompt << "\", " << c.bias.banned_tokens.size()
                     << " banned, plain text \"" << text << "\"");
    CHECK(plain.tokens.size() <= max_new_tokens);
    if (!plain.tokens.empty() && plain.tokens.back() == p.eos) {
      ++ended;
      CHECK(std::regex_match(text, reference));
      CHECK(plain.stop == specdec::stop_reason::stop_token);
    }
    for (const token_id banned : c.bias.banned_tokens) {
      CHECK(std::find(plain.tokens.begin(), plain.tokens.end(), banned) == plain.tokens.end());
    }
    for (const drafter_kind kind : {drafter_kind::model, drafter_kind::tree,
                                    drafter_kind::prompt_lookup, drafter_kind::ngram}) {
      INFO("drafter " << llama::to_string(kind));
      const auto speculative = llama::generate_speculative_constrained(
          target, llama::uses_draft_model(kind) ? &draft : nullptr, kind, rules, prompt, options);
      CHECK(speculative.tokens == plain.tokens);
      CHECK(speculative.stop == plain.stop);
    }
  }
  // At least the unbiased prompts end with a full match within max_new_tokens.
  CHECK(ended >= 2);
}

TEST_CASE(
    "llama constrained: sampled generation under BalancedBrackets keeps the brackets valid and "
    "ends balanced") {
  Pair& p = pair();
  const llama::Tokenizer& tokenizer = p.target_model.tokenizer();
  Engine target(p.target_model);
  Engine draft(p.draft_model);
  const std::array<token_id, 1> ends{p.eos};
  std::size_t ended = 0;
  std::size_t runs = 0;
  for (const std::string prompt_text : {"print(", "    return {", "x = "}) {
    const Tokens prompt = tokenizer.encode(prompt_text);
    specdec::ConstrainedSampling<BalancedBrackets> rules(
        target.vocab_size(), BalancedBrackets(p.strings, ends, tokenizer.decode(prompt)));
    // Seeds 1, 2: the draft model; 3: prompt lookup; 4: plain sampling on the same rows.
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      const drafter_kind kind = seed == 3 ? drafter_kind::prompt_lookup : drafter_kind::model;
      const auto result = seed == 4 ? llama::generate_plain_constrained(target, rules, prompt,
                                                                        run_options(1.0, seed))
                                    : llama::generate_speculative_constrained(
                                          target, kind == drafter_kind::model ? &draft : nullptr,
                                          kind, rules, prompt, run_options(1.0, seed));
      ++runs;
      const bool eos = !result.tokens.empty() && result.tokens.back() == p.eos;
      const std::string text = text_of(result.tokens);
      INFO("prompt \"" << prompt_text << "\", seed " << seed << ", text \"" << text << "\"");
      std::size_t depth = 0;
      bool closed = false;
      CHECK(brackets_valid(tokenizer.decode(prompt), text, depth, closed));
      // </s> only at the end, and once the expression closed nothing but </s> follows.
      CHECK(std::count(result.tokens.begin(), result.tokens.end(), p.eos) == (eos ? 1 : 0));
      if (closed) CHECK((eos || result.tokens.size() == max_new_tokens));
      if (eos) {
        ++ended;
        CHECK(depth == 0);
      }
    }
  }
  CHECK(runs == 12);
  CHECK(ended >= 1);
}

TEST_CASE("llama constrained: the token strings concatenate to the tokenizer's decoding") {
  Pair& p = pair();
  const llama::Tokenizer& tokenizer = p.target_model.tokenizer();
  REQUIRE(p.strings.size() == tokenizer.size());
  CHECK(p.strings[static_cast<std::size_t>(p.eos)].empty());
  CHECK(p.strings[static_cast<std::size_t>(*tokenizer.bos())].empty());
  for (const std::string text :
       {"def f(x):\n    return x + 1\n", "    self.items = []  # \ttabs\tand  spaces",
        "print(\"caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x90\x8D\")", "x = {'a': [1, 2], 'b': (3,)}"}) {
    const Tokens ids = tokenizer.encode(text);
    std::string joined;
    for (const token_id t : ids) joined += p.strings[static_cast<std::size_t>(t)];
    INFO("text \"" << text << "\"");
    CHECK(joined == tokenizer.decode(ids, false));
    CHECK(joined == text);
  }
}

namespace {

// A toy vocabulary: end token 0, a control token 1, then text tokens with and without
// brackets.
const std::vector<std::string>& toy_strings() {
  static const std::vector<std::string> strings = {
      "",   "",   "a",  " ",  "(",  ")",   "[",  "]",  "{",  "}",  "()",  "(a",
      "a)", "),", "])", "})", "([", "])x", ")]", "x(", "[(", "))", "a\n", "{[("};
  return strings;
}

// Checks that `c`'s mask names exactly the tokens advance() accepts in its current state,
// without moving it; returns the allowed tokens.
template <class C>
std::vector<token_id> check_mask(C& c, std::size_t vocab) {
  std::vector<std::uint64_t> words(specdec::mask_words(vocab));
  c.allowed_tokens(words);
  std::vector<token_id> allowed;
  const auto before = c.state();
  for (std::size_t i = 0; i < vocab; ++i) {
    const auto t = static_cast<token_id>(i);
    const bool accepted = c.advance(t);
    CHECK(accepted == specdec::mask_test(words, t));
    if (accepted) allowed.push_back(t);
    c.restore(before);
    CHECK(c.state() == before);
  }
  return allowed;
}

}  // namespace

TEST_CASE(
    "llama constrained: BalancedBrackets and TextConstraint masks name exactly the tokens "
    "advance accepts") {
  const auto& strings = toy_strings();
  const std::size_t vocab = strings.size();
  const std::array<token_id, 1> ends{0};
  specdec::default_engine g(7);

  SECTION("BalancedBrackets along random walks") {
    for (const bool end_when_empty : {true, false}) {
      BalancedBrackets c(strings, ends, "f(x, [", end_when_empty);
      CHECK(c.depth() == 2);
      for (int walk = 0; walk < 40; ++walk) {
        c.reset();
        std::string text;
        for (int step = 0; step < 30; ++step) {
          const auto allowed = check_mask(c, vocab);
          REQUIRE(!allowed.empty());  // never a dead end
          const token_id t = allowed[g() % allowed.size()];
          REQUIRE(c.advance(t));
          if (t == 0) {
            CHECK(c.done());
            CHECK(c.depth() == 0);
            break;
          }
          text += strings[static_cast<std::size_t>(t)];
          std::size_t depth = 0;
          bool closed = false;
          INFO("text \"" << text << "\"");
          REQUIRE(brackets_valid("f(x, [", text, depth, closed));
          CHECK(c.depth() == depth);
          CHECK(c.done() == closed);
        }
      }
    }
  }

  SECTION("the expression closed: only the end token, again and again") {
    BalancedBrackets c(strings, ends);
    CHECK(check_mask(c, vocab).size() > 10);  // the end token too: the stack is empty
    REQUIRE(c.advance(4));                    // "("
    CHECK_FALSE(c.advance(0));                // not while a bracket is open
    CHECK_FALSE(c.advance(13));               // "),": text after the closing bracket
    CHECK_FALSE(c.advance(1));                // a control token
    REQUIRE(c.advance(5));                    // ")"
    CHECK(c.done());
    CHECK(check_mask(c, vocab) == std::vector<token_id>{0});
    REQUIRE(c.advance(0));
    CHECK(check_mask(c, vocab) == std::vector<token_id>{0});
    BalancedBrackets without(strings, ends, {}, false);
    CHECK_FALSE(without.advance(0));  // the stack is empty, but nothing was closed yet
  }

  SECTION("the depth is capped") {
    const std::string open(BalancedBrackets::capacity, '(');
    BalancedBrackets c(strings, ends, open);
    CHECK(c.depth() == BalancedBrackets::capacity);
    CHECK_FALSE(c.advance(4));
    CHECK(c.advance(2));
    CHECK(c.advance(5));
    CHECK(c.advance(4));
    CHECK_THROWS_AS(BalancedBrackets(strings, ends, open + "("), std::invalid_argument);
    const std::array<token_id, 1> bad{static_cast<token_id>(vocab)};
    CHECK_THROWS_AS(BalancedBrackets(strings, bad), std::invalid_argument);
  }

  SECTION("TextConstraint: the intersection of a regex and the brackets") {
    const specdec::ByteDfa dfa = specdec::ByteDfa::compile(R"(a?\((a|\[\]|\(\))*\)x?)");
    TextConstraint c(specdec::TokenDfa(dfa, strings, ends), BalancedBrackets(strings, ends));
    specdec::TokenDfa regex(dfa, strings, ends);
    BalancedBrackets brackets(strings, ends);
    for (int walk = 0; walk < 40; ++walk) {
      c.restore(TextConstraint::state_type{0, BalancedBrackets(strings, ends).state()});
      regex.reset();
      brackets.reset();
      for (int step = 0; step < 12; ++step) {
        const auto allowed = check_mask(c, vocab);
        // Exactly the tokens both parts allow.
        std::vector<std::uint64_t> a(specdec::mask_words(vocab)), b(a.size());
        regex.allowed_tokens(a);
        brackets.allowed_tokens(b);
        for (std::size_t i = 0; i < vocab; ++i) {
          const auto t = static_cast<token_id>(i);
          const bool both = specdec::mask_test(a, t) && specdec::mask_test(b, t);
          CHECK(both == (std::find(allowed.begin(), allowed.end(), t) != allowed.end()));
        }
        if (allowed.empty()) break;  // a dead end of the intersection: allowed to happen
        const token_id t = allowed[g() % allowed.size()];
        REQUIRE(c.advance(t));
        REQUIRE(regex.advance(t));
        REQUIRE(brackets.advance(t));
        CHECK(c.state() == TextConstraint::state_type{regex.state(), brackets.state()});
      }
    }
    TextConstraint none;
    CHECK_FALSE(none.active());
    CHECK(check_mask(none, vocab).size() == vocab);
  }
}
