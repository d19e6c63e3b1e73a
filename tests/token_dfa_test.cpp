// Tests for include/specdec/token_dfa.hpp: ByteDfa agrees with std::regex_match on every
// feature of its syntax, syntax errors name the offset, and TokenDfa's masks equal a
// brute-force search over token continuations, never lead into a dead end and never
// allocate while decoding.
#include <array>
#include <cstdint>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/token_dfa.hpp"
#include "support/counting_allocator.hpp"

namespace {

using specdec::ByteDfa;
using specdec::token_id;
using specdec::TokenDfa;

/// Every string of length <= max_length over `alphabet`.
std::vector<std::string> all_strings(std::string_view alphabet, std::size_t max_length) {
  std::vector<std::string> result{""};
  std::size_t begin = 0;
  for (std::size_t length = 1; length <= max_length; ++length) {
    const std::size_t end = result.size();
    for (std::size_t i = begin; i < end; ++i) {
      for (const char c : alphabet) result.push_back(result[i] + c);
    }
    begin = end;
  }
  return result;
}

struct PatternCase {
  std::string pattern;
  std::string alphabet;
  std::vector<std::string> extra;  // strings worth checking beyond the enumerated ones
};

}  // namespace

TEST_CASE("ByteDfa full match agrees with std::regex_match", "[token_dfa][byte_dfa]") {
  // '.' excludes '\n' only here while std::regex also excludes '\r': no '\r' in the
  // alphabets of patterns with '.' or negated classes.
  const std::vector<PatternCase> cases = {
      {"abc", "abc", {"abc"}},
      {"", "a", {}},
      {"a.c", "ac\nx", {"a.c", "a c"}},
      {"[a-cx-z]+", "abcxyzd", {"abcxyz"}},
      {"[^ab]*", "abc\n", {}},
      {"[-a]b[a-]", "-ab", {"-b-", "aba"}},
      {R"(\d+(\.\d+)?)", "1.a", {"12.5", "3.", ".5"}},
      {R"(\w\s\W\S)", "a_ \t-", {"a -a", "_\t!!"}},
      {R"(\D\x41\t)", "1aA\t", {"aA\t"}},
      {"(ab|cd)*", "abcd", {"abcdab", "abcdabd"}},
      {"a+b?|c", "abc", {"aaab"}},
      {"(a|b)c*|d", "abcd", {"acccc"}},
      {"(|a)b|()", "ab", {}},
      {"(?:ab)+x?", "abx", {"ababx"}},
      {"a{2}b{2,}c{1,3}", "abc", {"aabbc", "aabbbbccc", "aabbcccc"}},
      {"(ab){1,3}|x{0,2}y", "abxy", {"ababab", "abababab", "xxy", "xxxy"}},
      {"((a|b)+c){2}", "abc", {"abcbac", "acbc"}},
      {"(a*)*b", "ab", {"aaaab"}},
      {R"(\(\)\[\]\{\}\\\|\*\+\?\-\.)", "()[]{}\\|*+?-.", {R"(()[]{}\|*+?-.)"}},
      {R"([\d\-.]+[\]\\]?)", "1-.a]\\", {"1.-]"}},
      {"[^\\n]{2}\\n", "a\nb", {"ab\n"}},
  };
  std::mt19937_64 rng(20240601);
  for (const auto& c : cases) {
    INFO("pattern " << c.pattern);
    const auto dfa = ByteDfa::compile(c.pattern);
    const std::regex reference(c.pattern, std::regex::ECMAScript);
    std::vector<std::string> texts = all_strings(c.alphabet, 4);
    texts.insert(texts.end(), c.extra.begin(), c.extra.end());
    std::uniform_int_distribution<std::size_t> pick(0, c.alphabet.size() - 1);
    std::uniform_int_distribution<std::size_t> length(5, 14);
    for (int i = 0; i < 300; ++i) {
      std::string text;
      for (std::size_t n = length(rng); n > 0; --n) text += c.alphabet[pick(rng)];
      texts.push_back(text);
    }
    // Random walks through the DFA give texts it accepts (most of the above do not).
    for (int i = 0; i < 200; ++i) {
      std::string text;
      std::size_t s = dfa.start();
      for (int step = 0; step < 16; ++step) {
        if (dfa.accepting(s) && rng() % 4 == 0) break;
        std::vector<unsigned char> moves;
        for (const char b : c.alphabet) {
          if (dfa.next(s, static_cast<unsigned char>(b)) != ByteDfa::dead) {
            moves.push_back(static_cast<unsigned char>(b));
          }
        }
        if (moves.empty()) break;
        const auto b = moves[rng() % moves.size()];
        text += static_cast<char>(b);
        s = dfa.next(s, b);
      }
      texts.push_back(text);
    }
    std::size_t disagreements = 0;
    std::size_t matched = 0;
    for (const auto& text : texts) {
      const bool expected = std::regex_match(text, reference);
      matched += expected ? 1 : 0;
      if (dfa.matches(text) != expected) {
        ++disagreements;
        UNSCOPED_INFO("text \"" << text << "\": regex_match " << expected);
      }
    }
    CHECK(disagreements == 0);
    if (c.pattern != "") CHECK(matched > 0);
  }
}

TEST_CASE("ByteDfa is minimal and drops the states that cannot match", "[token_dfa][byte_dfa]") {
  CHECK(ByteDfa::compile("(a|b)*abb").states() == 4);
  CHECK(ByteDfa::compile("a*|a*a*").states() == 1);
  const auto dfa = ByteDfa::compile("ab");
  CHECK(dfa.next(dfa.start(), 'b') == ByteDfa::dead);
  CHECK(dfa.next(dfa.next(dfa.start(), 'a'), 'b') != ByteDfa::dead);
  const auto nothing = ByteDfa::compile("[^\\s\\S]");
  CHECK(nothing.states() == 1);
  CHECK(!nothing.matches(""));
  CHECK(nothing.next(nothing.start(), 'a') == ByteDfa::dead);
  // High bytes and NUL are ordinary bytes.
  const auto bytes = ByteDfa::compile("\\x00[\\x80-\\xff]+.");
  CHECK(bytes.matches(std::string("\0\x80\xff\xfe", 4)));
  CHECK(!bytes.matches(std::string("\0\x7f\xff", 3)));
}

TEST_CASE("ByteDfa syntax errors name the offset and the problem", "[token_dfa][byte_dfa]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"a(b", "regex \"a(b\" at offset 3: missing ')'"},
      {"a)b", "at offset 1: unmatched ')'"},
      {"(a|b))", "at offset 5: unmatched ')'"},
      {"*a", "at offset 0: nothing to repeat"},
      {"a|*", "at offset 2: nothing to repeat"},
      {"(+)", "at offset 1: nothing to repeat"},
      {"a**", "at offset 2: nothing to repeat"},
      {"a+?", "at offset 2: nothing to repeat"},
      {"[z-a]", "at offset 1: bad range"},
      {"[a-\\d]", "at offset 1: bad range"},
      {"[abc", "at offset 4: missing ']'"},
      {"a[^", "at offset 3: missing ']'"},
      {"[]", "at offset 1: empty character class"},
      {"a{", "at offset 1: bad repetition"},
      {"a{}", "at offset 1: bad repetition"},
      {"a{2", "at offset 1: bad repetition"},
      {"a{,2}", "at offset 1: bad repetition"},
      {"ab{3,2}", "at offset 2: bad repetition"},
      {"a{65}", "at offset 1: bad repetition"},
      {"a{x}", "at offset 1: bad repetition"},
      {"{2}", "at offset 0: nothing to repeat"},
      {"a}", "at offset 1: unmatched '}'"},
      {"a]", "at offset 1: unmatched ']'"},
      {"\\q", "at offset 0: unknown escape"},
      {"(a)\\1", "at offset 3: unknown escape"},
      {"\\x4", "at offset 0: '\\x' needs two hexadecimal digits"},
      {"a\\", "at offset 1: trailing '\\'"},
      {"(?=a)", "at offset 1: unsupported group"},
      {"^a", "at offset 0: anchors are not supported"},
      {"a$", "at offset 1: anchors are not supported"},
  };
  for (const auto& [pattern, expected] : cases) {
    INFO("pattern " << pattern);
    bool threw = false;
    try {
      static_cast<void>(ByteDfa::compile(pattern));
    } catch (const specdec::error& e) {
      threw = true;
      CHECK(e.code() == specdec::errc::invalid_option);
      const std::string message = e.what();
      INFO("message " << message);
      CHECK(message.find(expected) != std::string::npos);
    }
    CHECK(threw);
  }
}

TEST_CASE("ByteDfa caps the number of states", "[token_dfa][byte_dfa]") {
  // The 13th byte from the end is an 'a': 2^13 states.
  try {
    static_cast<void>(ByteDfa::compile("(a|b)*a(a|b){12}"));
    FAIL("no error");
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::invalid_option);
    CHECK(std::string(e.what()).find("more than 4096 DFA states") != std::string::npos);
  }
  CHECK_THROWS_AS(ByteDfa::compile("(a|b)*a(a|b){3}", 8), specdec::error);
  CHECK(ByteDfa::compile("(a|b)*a(a|b){3}", 64).states() == 16);
  // Bounded repetition copies the repeated part once per count, not more.
  const auto sixty_four = ByteDfa::compile("a{64}");
  CHECK(sixty_four.states() == 65);
  CHECK(sixty_four.matches(std::string(64, 'a')));
  CHECK(!sixty_four.matches(std::string(63, 'a')));
  const auto nested = ByteDfa::compile("((a{8}){8}b{0,64}){1,2}");
  CHECK(nested.matches(std::string(64, 'a') + std::string(64, 'b') + std::string(64, 'a')));
  CHECK(!nested.matches(std::string(64, 'a') + std::string(65, 'b')));
  try {
    static_cast<void>(ByteDfa::compile("(((a{64}){64}){64}){64}"));
    FAIL("no error");
  } catch (const specdec::error& e) {
    CHECK(std::string(e.what()).find("pattern too large") != std::string::npos);
  }
}

namespace {

// The handmade vocabulary: 0 is a control token (no text), 11 is the end token.
const std::vector<std::string> vocabulary = {"",  "a",  "b",  "ab", "ba", "(",
                                             ")", "()", "x(", "1",  "12", "</s>"};
constexpr token_id end_token = 11;
constexpr std::size_t search_depth = 6;

/// A continuation (token strings) of at most search_depth tokens that takes the DFA from
/// state `from` to an accepting state, if any (breadth-first: independent of TokenDfa).
bool completion(const ByteDfa& dfa, std::size_t from, std::string& witness) {
  std::map<std::size_t, std::string> seen{{from, ""}};
  std::vector<std::size_t> frontier{from};
  for (std::size_t depth = 0; depth <= search_depth; ++depth) {
    std::vector<std::size_t> next_frontier;
    for (const auto s : frontier) {
      if (dfa.accepting(s)) {
        witness = seen[s];
        return true;
      }
      for (std::size_t t = 0; t < vocabulary.size(); ++t) {
        if (static_cast<token_id>(t) == end_token || vocabulary[t].empty()) continue;
        std::size_t to = s;
        for (const char c : vocabulary[t]) {
          to = dfa.next(to, static_cast<unsigned char>(c));
          if (to == ByteDfa::dead) break;
        }
        if (to == ByteDfa::dead || seen.count(to) != 0) continue;
        seen[to] = seen[s] + vocabulary[t];
        next_frontier.push_back(to);
      }
    }
    frontier = std::move(next_frontier);
  }
  return false;
}

std::size_t walk(const ByteDfa& dfa, std::string_view text) {
  std::size_t s = dfa.start();
  for (const char c : text) {
    if (s == ByteDfa::dead) return s;
    s = dfa.next(s, static_cast<unsigned char>(c));
  }
  return s;
}

/// The allowed set after `text` (not finished), by brute force, checked with std::regex.
std::vector<bool> brute_force_mask(const ByteDfa& dfa, const std::regex& reference,
                                   const std::string& text) {
  std::vector<bool> allowed(vocabulary.size(), false);
  for (std::size_t t = 0; t < vocabulary.size(); ++t) {
    if (static_cast<token_id>(t) == end_token) {
      allowed[t] = std::regex_match(text, reference);
      continue;
    }
    if (vocabulary[t].empty()) continue;
    const std::string longer = text + vocabulary[t];
    const std::size_t s = walk(dfa, longer);
    std::string witness;
    if (s != ByteDfa::dead && completion(dfa, s, witness)) {
      allowed[t] = true;
      CHECK(std::regex_match(longer + witness, reference));
    }
  }
  return allowed;
}

std::vector<bool> mask_of(const TokenDfa& constraint) {
  std::vector<std::uint64_t> words(specdec::mask_words(constraint.vocab_size()), 0);
  constraint.allowed_tokens(words);
  std::vector<bool> allowed(constraint.vocab_size());
  for (std::size_t t = 0; t < allowed.size(); ++t) {
    allowed[t] = specdec::mask_test(words, static_cast<token_id>(t));
  }
  return allowed;
}

}  // namespace

TEST_CASE("TokenDfa masks equal a brute-force search in every reachable state", "[token_dfa]") {
  STATIC_REQUIRE(specdec::TokenConstraint<TokenDfa>);
  const std::array<token_id, 1> ends{end_token};
  const std::vector<std::string> patterns = {
      R"((ab|ba)*\(1*2?\))",  // "()" and "(" + ... + ")"
      R"(x\(a+\))",           // "x" alone is no token: only "x(" starts it
      R"(a(b|12))",           // "1" after "a" reaches a byte-live state no token completes
      "(a|b)*",               // accepting start
      R"((\(\))+a?)",         // "(" + ")" and "()" reach the same states
  };
  for (const auto& pattern : patterns) {
    INFO("pattern " << pattern);
    const auto dfa = ByteDfa::compile(pattern);
    const std::regex reference(pattern, std::regex::ECMAScript);
    TokenDfa constraint(dfa, vocabulary, ends);
    CHECK(constraint.vocab_size() == vocabulary.size());
    CHECK(!constraint.finished());

    // Breadth-first over the constraint's states, with the text that first reached each.
    std::map<TokenDfa::state_type, std::string> text_of{{constraint.state(), ""}};
    std::vector<TokenDfa::state_type> queue{constraint.state()};
    std::size_t finished_states = 0;
    for (std::size_t i = 0; i < queue.size(); ++i) {
      const auto s = queue[i];
      constraint.restore(s);
      REQUIRE(constraint.state() == s);
      const auto& text = text_of[s];
      INFO("text \"" << text << "\"");
      const auto allowed = mask_of(constraint);
      if (constraint.finished()) {
        ++finished_states;
        for (std::size_t t = 0; t < allowed.size(); ++t) {
          CHECK(allowed[t] == (static_cast<token_id>(t) == end_token));
        }
        CHECK(constraint.accepting());
      } else {
        CHECK(allowed == brute_force_mask(dfa, reference, text));
        CHECK(constraint.accepting() == std::regex_match(text, reference));
      }
      bool any = false;
      for (std::size_t t = 0; t < allowed.size(); ++t) any = any || allowed[t];
      CHECK(any);
      for (token_id t = -2; t < static_cast<token_id>(allowed.size()) + 2; ++t) {
        constraint.restore(s);
        const bool in_vocab = t >= 0 && static_cast<std::size_t>(t) < allowed.size();
        const bool ok = constraint.advance(t);
        CHECK(ok == (in_vocab && allowed[static_cast<std::size_t>(t)]));
        if (!ok) {
          CHECK(constraint.state() == s);
          continue;
        }
        const auto to = constraint.state();
        if (t == end_token) CHECK(constraint.finished());
        if (text_of.count(to) == 0) {
          text_of[to] = t == end_token || constraint.finished()
                            ? text
                            : text + vocabulary[static_cast<std::size_t>(t)];
          queue.push_back(to);
        }
      }
    }
    CHECK(queue.size() == constraint.state_count());
    CHECK(finished_states == 1);
  }
}

TEST_CASE("TokenDfa random walks never reach a dead end", "[token_dfa]") {
  const std::array<token_id, 1> ends{end_token};
  std::mt19937_64 rng(7);
  for (const std::string pattern :
       {R"((ab|ba)*\(1*2?\))", R"(x\(a+\)(\(\))*)", R"(a(b|12)+)", "(a|b|12)*"}) {
    INFO("pattern " << pattern);
    const auto dfa = ByteDfa::compile(pattern);
    const std::regex reference(pattern, std::regex::ECMAScript);
    TokenDfa constraint(dfa, vocabulary, ends);
    std::size_t completed = 0;
    for (int walk_index = 0; walk_index < 200; ++walk_index) {
      constraint.reset();
      std::string text;
      for (int step = 0; step < 30; ++step) {
        const auto allowed = mask_of(constraint);
        std::vector<token_id> choices;
        for (std::size_t t = 0; t < allowed.size(); ++t) {
          if (allowed[t]) choices.push_back(static_cast<token_id>(t));
        }
        REQUIRE(!choices.empty());
        const token_id t = choices[rng() % choices.size()];
        const auto before = constraint.state();
        REQUIRE(constraint.advance(t));
        if (t == end_token) {
          CHECK(std::regex_match(text, reference));
          CHECK(constraint.finished());
          ++completed;
          // Finished is absorbing: end tokens only, forever.
          CHECK(constraint.advance(end_token));
          CHECK(!constraint.advance(1));
          CHECK(constraint.finished());
          break;
        }
        text += vocabulary[static_cast<std::size_t>(t)];
        std::string witness;
        const std::size_t s = walk(dfa, text);
        REQUIRE(s != ByteDfa::dead);
        CHECK(completion(dfa, s, witness));
        CHECK(std::regex_match(text + witness, reference));
        CHECK(constraint.accepting() == std::regex_match(text, reference));
        // restore round-trips.
        const auto after = constraint.state();
        constraint.restore(before);
        CHECK(constraint.state() == before);
        constraint.restore(after);
      }
    }
    CHECK(completed > 0);
  }
}

TEST_CASE("TokenDfa rejects a pattern no token sequence can start", "[token_dfa]") {
  const std::array<token_id, 1> ends{end_token};
  // "2" exists only after "1", which b*2 cannot match.
  const auto dfa = ByteDfa::compile("b*2");
  try {
    TokenDfa constraint(dfa, vocabulary, ends);
    FAIL("no error");
  } catch (const specdec::error& e) {
    CHECK(e.code() == specdec::errc::invalid_option);
    CHECK(std::string(e.what()).find("start state allows no token") != std::string::npos);
  }
  // An empty-only pattern with no end token allows nothing either.
  CHECK_THROWS_AS(TokenDfa(ByteDfa::compile(""), vocabulary), specdec::error);
  // An end token outside the vocabulary.
  const std::array<token_id, 1> bad{static_cast<token_id>(vocabulary.size())};
  CHECK_THROWS_AS(TokenDfa(ByteDfa::compile("a"), vocabulary, bad), specdec::error);
  // The empty pattern with an end token: only the end token.
  TokenDfa only_end(ByteDfa::compile(""), vocabulary, ends);
  const auto allowed = mask_of(only_end);
  for (std::size_t t = 0; t < allowed.size(); ++t) {
    CHECK(allowed[t] == (static_cast<token_id>(t) == end_token));
  }
  CHECK(only_end.accepting());
}

TEST_CASE("TokenDfa on a byte-level vocabulary generates only full matches", "[token_dfa]") {
  // Every single byte plus a few merged tokens, EOS last.
  std::vector<std::string> strings;
  for (int b = 0; b < 256; ++b) strings.emplace_back(1, static_cast<char>(b));
  for (const char* merged : {"{\"", "\":", "\"}", "12", "true", "false", "name", "\",\""}) {
    strings.emplace_back(merged);
  }
  strings.emplace_back("");  // a control token
  strings.emplace_back("<eos>");
  const std::array<token_id, 1> ends{static_cast<token_id>(strings.size() - 1)};
  const std::string pattern =
      R"(\{"[a-z]{1,8}":(\d{1,4}|true|false)(,"[a-z]{1,8}":\d{1,4}){0,2}\})";
  const auto dfa = ByteDfa::compile(pattern);
  const std::regex reference(pattern, std::regex::ECMAScript);
  TokenDfa constraint(dfa, strings, ends);
  std::mt19937_64 rng(99);
  std::size_t completed = 0;
  for (int walk_index = 0; walk_index < 100; ++walk_index) {
    constraint.reset();
    std::string text;
    for (int step = 0; step < 200 && !constraint.finished(); ++step) {
      const auto allowed = mask_of(constraint);
      std::vector<token_id> choices;
      for (std::size_t t = 0; t < allowed.size(); ++t) {
        if (allowed[t]) choices.push_back(static_cast<token_id>(t));
      }
      REQUIRE(!choices.empty());
      const token_id t = choices[rng() % choices.size()];
      REQUIRE(constraint.advance(t));
      if (!constraint.finished()) text += strings[static_cast<std::size_t>(t)];
    }
    if (constraint.finished()) {
      ++completed;
      CHECK(std::regex_match(text, reference));
    }
  }
  CHECK(completed > 50);
}

TEST_CASE("TokenDfa advance and allowed_tokens do not allocate", "[token_dfa][allocation]") {
  const std::array<token_id, 1> ends{end_token};
  const auto dfa = ByteDfa::compile(R"((ab|ba)*\(1*2?\))");
  TokenDfa constraint(dfa, vocabulary, ends);
  std::vector<std::uint64_t> words(specdec::mask_words(constraint.vocab_size()), 0);
  std::mt19937_64 rng(3);
  std::size_t steps = 0;
  std::size_t allocations = 0;
  {
    specdec::testing::AllocationCounter counter;
    for (int walk_index = 0; walk_index < 100; ++walk_index) {
      constraint.reset();
      for (int step = 0; step < 20; ++step) {
        constraint.allowed_tokens(words);
        const auto checkpoint = constraint.state();
        static_cast<void>(constraint.advance(static_cast<token_id>(rng() % 14) - 1));
        if (rng() % 3 == 0) constraint.restore(checkpoint);
        // Some allowed token, the first one.
        for (token_id t = 0; t < static_cast<token_id>(constraint.vocab_size()); ++t) {
          if (specdec::mask_test(words, t)) {
            constraint.restore(checkpoint);
            static_cast<void>(constraint.advance(t));
            ++steps;
            break;
          }
        }
      }
    }
    allocations = counter.stop();
  }
  CHECK(steps > 0);
  CHECK(allocations == 0);
}
