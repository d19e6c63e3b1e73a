// specdec — regular-expression constraints: ByteDfa, a deterministic automaton over bytes
// compiled from a regular expression, and TokenDfa, the TokenConstraint that lets a decoder
// generate only text the expression matches in full.
//
// ByteDfa is built once (Thompson NFA, subset construction over byte classes, pruning of
// the states that cannot reach an accepting state, Moore minimisation) and stores a
// 256-entry transition row per state, so matching costs one table load per byte.
// TokenDfa lifts it to a vocabulary: in each state it reaches it precomputes the bitmask of
// the allowed tokens and the (token, next state) transitions. A token is allowed only when
// its bytes lead to a state from which some sequence of tokens reaches an accepting state
// (co-reachability over tokens, not bytes: a vocabulary may lack the bytes a state needs),
// so a constrained decoder never walks into a dead end. Nothing is computed while decoding:
// allowed_tokens copies a mask, advance binary-searches one state's transitions; neither
// allocates.
//
// Cost: ByteDfa::compile is O(DFA states x byte classes x NFA states) at worst, bounded by
// the state cap. TokenDfa's constructor is O(DFA states x total bytes of the vocabulary)
// (the token strings are walked in sorted order, sharing common prefixes) and keeps
// mask_words(V) words plus the allowed transitions per reachable state. Per step: a copy of
// mask_words(V) words (allowed_tokens), O(log allowed) (advance).
#pragma once

#include <algorithm>
#include <array>
#include <bitset>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/config.hpp"
#include "specdec/error.hpp"
#include "specdec/token_constraint.hpp"

namespace specdec {

namespace detail {

/// Thompson NFA under construction: a state has one byte-set edge or up to two epsilon
/// edges (the constructions below never need more).
struct regex_nfa {
  static constexpr std::uint32_t none = std::numeric_limits<std::uint32_t>::max();
  struct state {
    std::uint32_t set = none;  ///< index into sets, none: no byte edge
    std::uint32_t target = none;
    std::array<std::uint32_t, 2> eps{none, none};
  };
  struct fragment {
    std::uint32_t start;
    std::uint32_t end;  ///< has no outgoing edge until linked
  };
  std::vector<state> states;
  std::vector<std::bitset<256>> sets;
  std::uint32_t start = 0;
  std::uint32_t accept = 0;
};

/// The states from which a state marked in `accepting` is reachable, given each state's
/// predecessors (repeats allowed).
[[nodiscard]] inline std::vector<bool> co_reachable(
    const std::vector<std::vector<std::uint32_t>>& predecessors, std::vector<bool> accepting) {
  std::vector<std::uint32_t> stack;
  for (std::size_t s = 0; s < accepting.size(); ++s) {
    if (accepting[s]) stack.push_back(static_cast<std::uint32_t>(s));
  }
  while (!stack.empty()) {
    const auto s = stack.back();
    stack.pop_back();
    for (const auto from : predecessors[s]) {
      if (!accepting[from]) {
        accepting[from] = true;
        stack.push_back(from);
      }
    }
  }
  return accepting;
}

/// Recursive-descent parser of ByteDfa's syntax that emits the NFA as it goes.
class regex_parser {
 public:
  static constexpr std::size_t max_nfa_states = std::size_t{1} << 20;
  static constexpr std::size_t max_depth = 256;
  static constexpr int max_repeat = 64;

  explicit regex_parser(std::string_view pattern) : pattern_(pattern) {}

  [[nodiscard]] regex_nfa parse() {
    const auto whole = parse_alternation(0);
    if (pos_ < pattern_.size()) fail(pos_, "unmatched ')'");
    nfa_.start = whole.start;
    nfa_.accept = whole.end;
    return std::move(nfa_);
  }

 private:
  using fragment = regex_nfa::fragment;
  using byte_set = std::bitset<256>;

  [[noreturn]] void fail(std::size_t offset, std::string_view what) const {
    throw_error(errc::invalid_option, "regex \"", pattern_, "\" at offset ", offset, ": ", what);
  }

  [[nodiscard]] bool at_end() const noexcept { return pos_ >= pattern_.size(); }
  [[nodiscard]] char peek() const noexcept { return pattern_[pos_]; }

  std::uint32_t new_state() {
    if (nfa_.states.size() >= max_nfa_states) fail(pos_, "pattern too large");
    nfa_.states.emplace_back();
    return static_cast<std::uint32_t>(nfa_.states.size() - 1);
  }
  void link(std::uint32_t from, std::uint32_t to) {
    auto& eps = nfa_.states[from].eps;
    (eps[0] == regex_nfa::none ? eps[0] : eps[1]) = to;
  }
  fragment empty() {
    const auto s = new_state();
    return {s, s};
  }
  fragment bytes(const byte_set& set) {
    const auto s = new_state();
    const auto e = new_state();
    nfa_.states[s].set = static_cast<std::uint32_t>(nfa_.sets.size());
    nfa_.states[s].target = e;
    nfa_.sets.push_back(set);
    return {s, e};
  }
  fragment concat(fragment a, fragment b) {
    link(a.end, b.start);
    return {a.start, b.end};
  }
  fragment alternate(fragment a, fragment b) {
    const auto s = new_state();
    const auto e = new_state();
    link(s, a.start);
    link(s, b.start);
    link(a.end, e);
    link(b.end, e);
    return {s, e};
  }
  fragment star(fragment f) {
    const auto s = new_state();
    const auto e = new_state();
    link(s, f.start);
    link(s, e);
    link(f.end, f.start);
    link(f.end, e);
    return {s, e};
  }
  fragment plus(fragment f) {
    const auto e = new_state();
    link(f.end, f.start);
    link(f.end, e);
    return {f.start, e};
  }
  fragment optional(fragment f) {
    const auto s = new_state();
    const auto e = new_state();
    link(s, f.start);
    link(s, e);
    link(f.end, e);
    return {s, e};
  }
  /// A copy of the fragment whose states are [first, last).
  fragment clone(fragment f, std::uint32_t first, std::uint32_t last) {
    if (nfa_.states.size() + (last - first) > max_nfa_states) fail(pos_, "pattern too large");
    const auto shift = static_cast<std::uint32_t>(nfa_.states.size()) - first;
    auto moved = [shift](std::uint32_t i) { return i == regex_nfa::none ? i : i + shift; };
    for (std::uint32_t i = first; i < last; ++i) {
      regex_nfa::state copy = nfa_.states[i];
      copy.target = moved(copy.target);
      copy.eps = {moved(copy.eps[0]), moved(copy.eps[1])};
      nfa_.states.push_back(copy);
    }
    return {f.start + shift, f.end + shift};
  }

  fragment parse_alternation(std::size_t depth) {
    auto result = parse_concatenation(depth);
    while (!at_end() && peek() == '|') {
      ++pos_;
      result = alternate(result, parse_concatenation(depth));
    }
    return result;
  }

  fragment parse_concatenation(std::size_t depth) {
    fragment result = empty();
    while (!at_end() && peek() != '|' && peek() != ')') {
      result = concat(result, parse_repetition(depth));
    }
    return result;
  }

  fragment parse_repetition(std::size_t depth) {
    const auto first = static_cast<std::uint32_t>(nfa_.states.size());
    const fragment atom = parse_atom(depth);
    if (at_end()) return atom;
    int min = 0;
    int max = -1;  // -1: unbounded
    switch (peek()) {
      case '*':
        ++pos_;
        break;
      case '+':
        ++pos_;
        min = 1;
        break;
      case '?':
        ++pos_;
        max = 1;
        break;
      case '{':
        parse_bounds(min, max);
        break;
      default:
        return atom;
    }
    if (!at_end() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{')) {
      fail(pos_, "nothing to repeat (a quantifier follows a quantifier)");
    }
    // All copies first, from the untouched atom; then link them.
    const int copies = max < 0 ? std::max(min, 1) : max;
    if (copies == 0) return empty();
    std::vector<fragment> parts{atom};
    const auto last = static_cast<std::uint32_t>(nfa_.states.size());
    for (int i = 1; i < copies; ++i) parts.push_back(clone(atom, first, last));
    if (max < 0) {
      if (min == 0) return star(parts[0]);
      parts.back() = plus(parts.back());
      fragment result = parts[0];
      for (std::size_t i = 1; i < parts.size(); ++i) result = concat(result, parts[i]);
      return result;
    }
    // x{m,n} = x...x (x(x(x)?)?)?: nested optionals keep the NFA's state sets small.
    const auto required = static_cast<std::size_t>(min);
    fragment tail{};
    bool has_tail = false;
    for (std::size_t i = parts.size(); i-- > required;) {
      tail = optional(has_tail ? concat(parts[i], tail) : parts[i]);
      has_tail = true;
    }
    fragment result = required > 0 ? parts[0] : tail;
    for (std::size_t i = 1; i < required; ++i) result = concat(result, parts[i]);
    if (required > 0 && has_tail) result = concat(result, tail);
    return result;
  }

  /// {m}, {m,} or {m,n} at pos_, with m <= n <= max_repeat.
  void parse_bounds(int& min, int& max) {
    const std::size_t open = pos_++;
    auto number = [&](int& value) {
      const std::size_t begin = pos_;
      value = 0;
      while (!at_end() && peek() >= '0' && peek() <= '9') {
        value = std::min(value * 10 + (peek() - '0'), 100000);
        ++pos_;
      }
      return pos_ > begin;
    };
    if (!number(min)) fail(open, "bad repetition: expected a count after '{'");
    max = min;
    if (!at_end() && peek() == ',') {
      ++pos_;
      if (!number(max)) max = -1;
    }
    if (at_end() || peek() != '}') fail(open, "bad repetition: missing '}'");
    ++pos_;
    if (max >= 0 && max < min) fail(open, "bad repetition: {m,n} with n < m");
    if (min > max_repeat || max > max_repeat) fail(open, "bad repetition: a count above 64");
  }

  fragment parse_atom(std::size_t depth) {
    const std::size_t at = pos_;
    const char c = peek();
    switch (c) {
      case '(': {
        if (depth >= max_depth) fail(at, "groups nested too deeply");
        ++pos_;
        if (!at_end() && peek() == '?') {
          if (pos_ + 1 < pattern_.size() && pattern_[pos_ + 1] == ':') {
            pos_ += 2;
          } else {
            fail(pos_, "unsupported group '(?': only '(?:' is supported");
          }
        }
        const fragment inner = parse_alternation(depth + 1);
        if (at_end()) fail(pos_, "missing ')'");
        ++pos_;
        return inner;
      }
      case '[':
        return bytes(parse_class());
      case '.': {
        ++pos_;
        byte_set any;
        any.set();
        any.reset('\n');
        return bytes(any);
      }
      case '\\':
        return bytes(parse_escape());
      case '*':
      case '+':
      case '?':
      case '{':
        fail(at, "nothing to repeat");
      case ']':
      case '}':
        fail(at, std::string("unmatched '") + c + "' (escape it as '\\" + c + "')");
      case '^':
      case '$':
        fail(at, "anchors are not supported (the whole text always has to match)");
      default: {
        ++pos_;
        byte_set one;
        one.set(static_cast<unsigned char>(c));
        return bytes(one);
      }
    }
  }

  /// The bytes the escape at pos_ (a backslash) stands for.
  byte_set parse_escape() {
    const std::size_t at = pos_++;
    if (at_end()) fail(at, "trailing '\\'");
    const char c = pattern_[pos_++];
    byte_set set;
    auto range = [&set](int lo, int hi) {
      for (int b = lo; b <= hi; ++b) set.set(static_cast<std::size_t>(b));
    };
    switch (c) {
      case 'd':
      case 'D':
        range('0', '9');
        break;
      case 'w':
      case 'W':
        range('0', '9');
        range('A', 'Z');
        range('a', 'z');
        range('_', '_');
        break;
      case 's':
      case 'S':
        range('\t', '\r');
        range(' ', ' ');
        break;
      case 'n':
        return byte_set{}.set('\n');
      case 't':
        return byte_set{}.set('\t');
      case 'r':
        return byte_set{}.set('\r');
      case 'f':
        return byte_set{}.set('\f');
      case 'v':
        return byte_set{}.set('\v');
      case '0':
        return byte_set{}.set(0);
      case 'x': {
        auto hex = [](char h) {
          if (h >= '0' && h <= '9') return h - '0';
          if (h >= 'a' && h <= 'f') return h - 'a' + 10;
          if (h >= 'A' && h <= 'F') return h - 'A' + 10;
          return -1;
        };
        if (pos_ + 2 > pattern_.size() || hex(pattern_[pos_]) < 0 || hex(pattern_[pos_ + 1]) < 0) {
          fail(at, "'\\x' needs two hexadecimal digits");
        }
        const int value = hex(pattern_[pos_]) * 16 + hex(pattern_[pos_ + 1]);
        pos_ += 2;
        return byte_set{}.set(static_cast<std::size_t>(value));
      }
      default: {
        const bool alnum =
            (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
        if (alnum) fail(at, std::string("unknown escape '\\") + c + "'");
        return byte_set{}.set(static_cast<unsigned char>(c));
      }
    }
    if (c == 'D' || c == 'W' || c == 'S') set.flip();
    return set;
  }

  /// A bracket expression at pos_ ('[').
  byte_set parse_class() {
    const std::size_t open = pos_++;
    const bool negate = !at_end() && peek() == '^';
    if (negate) ++pos_;
    if (!at_end() && peek() == ']') fail(pos_, "empty character class (escape ']' as '\\]')");
    byte_set set;
    // One element: a byte (returned in `byte`, set true) or a class escape.
    auto element = [&](int& byte) {
      if (peek() == '\\') {
        const auto escaped = parse_escape();
        if (escaped.count() == 1) {
          for (int b = 0; b < 256; ++b) {
            if (escaped.test(static_cast<std::size_t>(b))) byte = b;
          }
        } else {
          byte = -1;
        }
        return escaped;
      }
      byte = static_cast<unsigned char>(pattern_[pos_++]);
      return byte_set{}.set(static_cast<std::size_t>(byte));
    };
    while (true) {
      if (at_end())
        fail(pos_,
             "missing ']' (the class opened at offset " + std::to_string(open) + " is not closed)");
      if (peek() == ']') break;
      const std::size_t at = pos_;
      int lo = 0;
      const byte_set first = element(lo);
      if (pos_ + 1 < pattern_.size() && peek() == '-' && pattern_[pos_ + 1] != ']') {
        ++pos_;
        int hi = 0;
        static_cast<void>(element(hi));
        if (lo < 0 || hi < 0) fail(at, "bad range: an endpoint is a class escape");
        if (hi < lo) fail(at, "bad range: its end is below its start");
        for (int b = lo; b <= hi; ++b) set.set(static_cast<std::size_t>(b));
      } else {
        set |= first;
      }
    }
    ++pos_;
    if (negate) set.flip();
    return set;
  }

  std::string_view pattern_;
  std::size_t pos_ = 0;
  regex_nfa nfa_;
};

}  // namespace detail

/// A deterministic finite automaton over bytes that accepts exactly the texts a regular
/// expression matches in full (as std::regex_match does, ECMAScript grammar, for the syntax
/// below). States are [0, states()); start() is 0; every state can reach an accepting one
/// (the others are pruned: next() returns `dead` instead), and the automaton is minimal. A
/// pattern that matches nothing (`[^\s\S]`) gives one rejecting state.
///
/// Syntax (bytes, not Unicode code points):
///  - a literal byte; `.` any byte except '\n' ('\r' included, unlike ECMAScript's `.`);
///  - `[abc]`, ranges `[a-z0-9_]`, negation `[^...]` (over all 256 bytes); '-' is literal
///    first or last; ']' inside a class must be escaped; `[]` is an error;
///  - escapes, inside and outside classes: `\d \D \w \W \s \S` (ASCII: [0-9],
///    [A-Za-z0-9_], [\t\n\v\f\r ]), `\n \t \r \f \v \0`, `\xHH`, and a backslash before any
///    byte that is not a letter or digit means that byte (`\. \( \) \[ \] \{ \} \\ \| \* \+
///    \? \- \^ \$ \/ ...`); other letter or digit escapes (back-references) are errors;
///  - grouping `( )` and `(?: )`; alternation `|` (empty alternatives allowed: `(|a)`);
///  - postfix `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` with m <= n <= 64; a quantifier after a
///    quantifier (lazy `*?`) is an error;
///  - unescaped `]`, `}`, `^`, `$` outside a class are errors (no anchors: the whole text
///    always has to match).
/// Errors throw specdec::error (errc::invalid_option) naming the pattern, the byte offset
/// and the problem, e.g. `regex "a(b" at offset 3: missing ')'`.
class ByteDfa {
 public:
  /// Returned by next() where no text continuing that way can match.
  static constexpr std::size_t dead = static_cast<std::size_t>(-1);
  /// The default cap on the number of DFA states built (before minimisation).
  static constexpr std::size_t default_max_states = 4096;

  /// Compiles `pattern`; throws specdec::error (errc::invalid_option) on a syntax error or
  /// when the subset construction needs more than `max_states` states.
  [[nodiscard]] static ByteDfa compile(std::string_view pattern,
                                       std::size_t max_states = default_max_states) {
    const detail::regex_nfa nfa = detail::regex_parser(pattern).parse();
    const std::size_t n = nfa.states.size();

    // Byte classes: bytes no byte set of the pattern tells apart share a class.
    std::array<std::uint16_t, 256> byte_class{};
    std::size_t classes = 1;
    for (const auto& set : nfa.sets) {
      std::array<int, 512> renamed;
      renamed.fill(-1);
      std::size_t next_class = 0;
      for (std::size_t b = 0; b < 256; ++b) {
        const std::size_t key = std::size_t{byte_class[b]} * 2 + (set.test(b) ? 1U : 0U);
        if (renamed[key] < 0) renamed[key] = static_cast<int>(next_class++);
        byte_class[b] = static_cast<std::uint16_t>(renamed[key]);
      }
      classes = next_class;
    }
    std::vector<unsigned char> representative(classes);
    for (std::size_t b = 256; b-- > 0;)
      representative[byte_class[b]] = static_cast<unsigned char>(b);

    // Subset construction.
    std::vector<std::uint32_t> mark(n, 0);
    std::uint32_t generation = 0;
    std::vector<std::uint32_t> stack;
    auto closure = [&](std::vector<std::uint32_t>& set) {
      ++generation;
      stack = set;
      set.clear();
      for (const auto s : stack) mark[s] = generation;
      while (!stack.empty()) {
        const auto s = stack.back();
        stack.pop_back();
        set.push_back(s);
        for (const auto e : nfa.states[s].eps) {
          if (e != detail::regex_nfa::none && mark[e] != generation) {
            mark[e] = generation;
            stack.push_back(e);
          }
        }
      }
      std::sort(set.begin(), set.end());
    };
    constexpr auto none = detail::regex_nfa::none;
    std::map<std::vector<std::uint32_t>, std::uint32_t> ids;
    std::vector<const std::vector<std::uint32_t>*> subsets;
    std::vector<std::uint32_t> moves;  // subsets x classes
    std::vector<bool> accepts;
    auto intern = [&](std::vector<std::uint32_t>&& set) {
      const auto found = ids.find(set);
      if (found != ids.end()) return found->second;
      if (subsets.size() >= max_states) {
        detail::throw_error(errc::invalid_option, "regex \"", pattern, "\": more than ", max_states,
                            " DFA states");
      }
      const auto id = static_cast<std::uint32_t>(subsets.size());
      accepts.push_back(std::binary_search(set.begin(), set.end(), nfa.accept));
      subsets.push_back(&ids.emplace(std::move(set), id).first->first);
      return id;
    };
    std::vector<std::uint32_t> work{nfa.start};
    closure(work);
    static_cast<void>(intern(std::move(work)));
    for (std::size_t d = 0; d < subsets.size(); ++d) {
      for (std::size_t c = 0; c < classes; ++c) {
        work.clear();
        for (const auto s : *subsets[d]) {
          const auto& state = nfa.states[s];
          if (state.set != none && nfa.sets[state.set].test(representative[c])) {
            work.push_back(state.target);
          }
        }
        moves.push_back(work.empty() ? none : (closure(work), intern(std::move(work))));
      }
    }
    const std::size_t built = subsets.size();

    // Keep the states that reach an accepting state (reverse search).
    std::vector<std::vector<std::uint32_t>> reverse(built);
    for (std::size_t d = 0; d < built; ++d) {
      for (std::size_t c = 0; c < classes; ++c) {
        const auto to = moves[d * classes + c];
        if (to != none) reverse[to].push_back(static_cast<std::uint32_t>(d));
      }
    }
    const std::vector<bool> live = detail::co_reachable(reverse, accepts);

    // Moore minimisation over the live states (a dead target is its own block).
    std::vector<std::int64_t> block(built, -1);
    for (std::size_t d = 0; d < built; ++d) {
      if (live[d]) block[d] = accepts[d] ? 1 : 0;
    }
    std::size_t blocks = 0;
    while (true) {
      std::map<std::vector<std::int64_t>, std::int64_t> signatures;
      std::vector<std::int64_t> refined(built, -1);
      std::vector<std::int64_t> signature(classes + 1);
      for (std::size_t d = 0; d < built; ++d) {
        if (!live[d]) continue;
        signature[0] = block[d];
        for (std::size_t c = 0; c < classes; ++c) {
          const auto to = moves[d * classes + c];
          signature[c + 1] = to == none ? -1 : block[to];
        }
        const auto size = static_cast<std::int64_t>(signatures.size());
        refined[d] = signatures.emplace(signature, size).first->second;
      }
      const std::size_t count = signatures.size();
      block = std::move(refined);
      if (count == blocks) break;
      blocks = count;
    }

    // Number the blocks breadth-first from the start's (so start() is 0).
    ByteDfa dfa;
    if (!live[0]) {  // the pattern matches nothing: one rejecting state
      dfa.table_.assign(256, none);
      dfa.accepting_.assign(1, 0);
      return dfa;
    }
    std::vector<std::uint32_t> number(blocks, none);
    std::vector<std::uint32_t> member;  // one subset per numbered block
    number[static_cast<std::size_t>(block[0])] = 0;
    member.push_back(0);
    for (std::size_t i = 0; i < member.size(); ++i) {
      const auto d = member[i];
      for (std::size_t b = 0; b < 256; ++b) {
        const auto to = moves[std::size_t{d} * classes + byte_class[b]];
        std::uint32_t target = none;
        if (to != none && live[to]) {
          auto& id = number[static_cast<std::size_t>(block[to])];
          if (id == none) {
            id = static_cast<std::uint32_t>(member.size());
            member.push_back(to);
          }
          target = id;
        }
        dfa.table_.push_back(target);
      }
      dfa.accepting_.push_back(accepts[d] ? 1 : 0);
    }
    return dfa;
  }

  /// Number of states (at least 1).
  [[nodiscard]] std::size_t states() const noexcept { return accepting_.size(); }
  /// The start state (0).
  [[nodiscard]] std::size_t start() const noexcept { return 0; }
  /// Whether the text that led to state `s` is a full match.
  [[nodiscard]] bool accepting(std::size_t s) const noexcept {
    SPECDEC_ASSERT(s < states());
    return accepting_[s] != 0;
  }
  /// The state after `byte` from `s`, or `dead` when no text continuing so can match.
  [[nodiscard]] std::size_t next(std::size_t s, unsigned char byte) const noexcept {
    SPECDEC_ASSERT(s < states());
    const auto to = table_[s * 256 + byte];
    return to == detail::regex_nfa::none ? dead : std::size_t{to};
  }
  /// Whether the pattern matches all of `text`.
  [[nodiscard]] bool matches(std::string_view text) const noexcept {
    std::size_t s = start();
    for (const char c : text) {
      s = next(s, static_cast<unsigned char>(c));
      if (s == dead) return false;
    }
    return accepting(s);
  }

 private:
  ByteDfa() = default;

  std::vector<std::uint32_t> table_;  ///< states() x 256, detail::regex_nfa::none: dead
  std::vector<unsigned char> accepting_;
};

/// The TokenConstraint of a regular expression over a vocabulary: the generated tokens'
/// text (the concatenation of their strings) stays a prefix of a full match, and an end
/// token (EOS) is allowed exactly where the text is a full match.
///  - `token_strings[t]` is the text token t decodes to (bytes). A token with an empty
///    string (a control token) is never allowed unless it is an end token. An end token is
///    only ever an end token: its string is ignored.
///  - A text token is allowed in a state when its bytes lead to a state from which some
///    sequence of tokens reaches a full match (so every allowed token keeps the text
///    completable, and no state reached through allowed tokens is a dead end, except an
///    accepting state without continuations when no end token is given).
///  - After an end token the constraint is finished: only end tokens are allowed (a decoder
///    may keep drafting past EOS), and advancing one stays finished.
/// state_type is a small integer; states are [0, state_count()), 0 is the start and the
/// last is the finished state. Construction throws specdec::error (errc::invalid_option)
/// for an end token outside [0, V), a vocabulary too large for token_id, or when the start
/// allows no token (no token sequence can complete the pattern).
/// @code
/// const auto dfa = specdec::ByteDfa::compile(R"(\{"n":\d+\})");
/// specdec::TokenDfa constraint(dfa, vocabulary_strings, std::array{eos});
/// // pass `constraint` to the decoder's constrained models
/// @endcode
class TokenDfa {
 public:
  using state_type = std::uint32_t;

  TokenDfa(const ByteDfa& dfa, std::span<const std::string> token_strings,
           std::span<const token_id> end_tokens = {})
      : vocab_(token_strings.size()), words_(mask_words(token_strings.size())) {
    constexpr auto none = std::numeric_limits<std::uint32_t>::max();
    if (vocab_ > static_cast<std::size_t>(std::numeric_limits<token_id>::max())) {
      detail::throw_error(errc::invalid_option, "token_dfa: vocabulary of ", vocab_,
                          " tokens does not fit token_id");
    }
    std::vector<bool> is_end(vocab_, false);
    for (const token_id t : end_tokens) {
      if (t < 0 || static_cast<std::size_t>(t) >= vocab_) {
        detail::throw_error(errc::invalid_option, "token_dfa: end token ", t, " is outside [0, ",
                            vocab_, ")");
      }
      is_end[static_cast<std::size_t>(t)] = true;
    }

    // The text tokens sorted by string, with the prefix each shares with the one before.
    std::vector<token_id> sorted;
    for (std::size_t t = 0; t < vocab_; ++t) {
      if (!is_end[t] && !token_strings[t].empty()) sorted.push_back(static_cast<token_id>(t));
    }
    auto text = [&](token_id t) -> const std::string& {
      return token_strings[static_cast<std::size_t>(t)];
    };
    std::sort(sorted.begin(), sorted.end(),
              [&](token_id a, token_id b) { return text(a) < text(b); });
    std::vector<std::size_t> shared(sorted.size(), 0);
    for (std::size_t i = 1; i < sorted.size(); ++i) {
      const auto& a = text(sorted[i - 1]);
      const auto& b = text(sorted[i]);
      std::size_t k = 0;
      while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
      shared[i] = k;
    }

    // Explore the DFA states the tokens reach from the start; edges[x] = (token, DFA state).
    std::vector<std::uint32_t> explored(dfa.states(), none);
    std::vector<std::size_t> order{dfa.start()};
    std::vector<std::vector<std::pair<token_id, std::uint32_t>>> edges;
    explored[dfa.start()] = 0;
    std::vector<std::size_t> path;  // path[k]: state after k bytes of the current token
    for (std::size_t x = 0; x < order.size(); ++x) {
      edges.emplace_back();
      path.assign(1, order[x]);
      std::size_t good = 0;  // bytes of the previous token walked without dying
      for (std::size_t i = 0; i < sorted.size(); ++i) {
        const auto& bytes = text(sorted[i]);
        if (shared[i] > good) continue;  // shares the previous token's dead prefix
        good = shared[i];
        path.resize(good + 1);
        while (good < bytes.size()) {
          const auto to = dfa.next(path[good], static_cast<unsigned char>(bytes[good]));
          if (to == ByteDfa::dead) break;
          path.push_back(to);
          ++good;
        }
        if (good < bytes.size()) continue;
        const std::size_t to = path[good];
        if (explored[to] == none) {
          explored[to] = static_cast<std::uint32_t>(order.size());
          order.push_back(to);
        }
        edges[x].emplace_back(sorted[i], explored[to]);
      }
    }

    // Live: an accepting state is reachable through tokens (reverse search).
    const std::size_t reached = order.size();
    std::vector<std::vector<std::uint32_t>> reverse(reached);
    for (std::size_t x = 0; x < reached; ++x) {
      for (const auto& edge : edges[x]) {
        reverse[edge.second].push_back(static_cast<std::uint32_t>(x));
      }
    }
    std::vector<bool> accepting_states(reached);
    for (std::size_t x = 0; x < reached; ++x) accepting_states[x] = dfa.accepting(order[x]);
    const std::vector<bool> live = detail::co_reachable(reverse, std::move(accepting_states));

    // Materialise the states reachable from the start through allowed tokens.
    std::vector<token_id> ends;
    for (std::size_t t = 0; t < vocab_; ++t) {
      if (is_end[t]) ends.push_back(static_cast<token_id>(t));
    }
    auto nothing_allowed = [&] {
      detail::throw_error(errc::invalid_option,
                          "token_dfa: the start state allows no token (no sequence of the ", vocab_,
                          " token strings completes the pattern)");
    };
    if (!live[0]) nothing_allowed();
    std::vector<std::uint32_t> number(reached, none);
    std::vector<std::uint32_t> member{0};
    number[0] = 0;
    for (std::size_t i = 0; i < member.size(); ++i) {
      for (const auto& edge : edges[member[i]]) {
        if (live[edge.second] && number[edge.second] == none) {
          number[edge.second] = static_cast<std::uint32_t>(member.size());
          member.push_back(edge.second);
        }
      }
    }
    finished_ = static_cast<state_type>(member.size());
    const std::size_t count = member.size() + 1;
    masks_.assign(count * words_, 0);
    accepting_.assign(count, 0);
    edge_begin_.assign(1, 0);
    std::vector<std::pair<token_id, std::uint32_t>> out;
    for (std::size_t s = 0; s < count; ++s) {
      out.clear();
      const bool is_finished = s == finished_;
      const bool accepts = is_finished || dfa.accepting(order[member[s]]);
      if (!is_finished) {
        for (const auto& edge : edges[member[s]]) {
          if (live[edge.second]) out.emplace_back(edge.first, number[edge.second]);
        }
      }
      if (accepts) {
        for (const token_id t : ends) out.emplace_back(t, finished_);
      }
      std::sort(out.begin(), out.end());
      const std::span<std::uint64_t> mask(masks_.data() + s * words_, words_);
      for (const auto& edge : out) {
        mask_set(mask, edge.first);
        edge_token_.push_back(edge.first);
        edge_next_.push_back(edge.second);
      }
      edge_begin_.push_back(static_cast<std::uint32_t>(edge_token_.size()));
      accepting_[s] = accepts ? 1 : 0;
    }
    if (edge_begin_[1] == 0) nothing_allowed();
  }

  /// The current state (a checkpoint for restore).
  [[nodiscard]] state_type state() const noexcept { return state_; }
  /// Goes back to a state state() returned.
  void restore(state_type s) noexcept {
    SPECDEC_ASSERT(s < state_count());
    state_ = s;
  }
  /// Goes back to the start (no text generated).
  void reset() noexcept { state_ = 0; }

  /// Moves by token `t`; returns false, leaving the state unchanged, when `t` is outside
  /// [0, V) or not allowed. Never allocates.
  [[nodiscard]] bool advance(token_id t) noexcept {
    if (t < 0 || static_cast<std::size_t>(t) >= vocab_) return false;
    const auto begin = edge_token_.begin() + edge_begin_[state_];
    const auto end = edge_token_.begin() + edge_begin_[state_ + 1];
    const auto found = std::lower_bound(begin, end, t);
    if (found == end || *found != t) return false;
    state_ = edge_next_[static_cast<std::size_t>(found - edge_token_.begin())];
    return true;
  }

  /// Writes the allowed tokens' bitmask (mask_words(vocab_size()) words). Never allocates.
  void allowed_tokens(std::span<std::uint64_t> words) const noexcept {
    SPECDEC_ASSERT(words.size() >= words_);
    const auto* mask = masks_.data() + std::size_t{state_} * words_;
    std::copy(mask, mask + words_, words.begin());
  }

  /// Number of tokens V of the vocabulary.
  [[nodiscard]] std::size_t vocab_size() const noexcept { return vocab_; }
  /// Number of states materialised, the finished state included.
  [[nodiscard]] std::size_t state_count() const noexcept { return accepting_.size(); }
  /// Whether the text so far is a full match (true in the finished state too).
  [[nodiscard]] bool accepting() const noexcept { return accepting_[state_] != 0; }
  /// Whether an end token was generated.
  [[nodiscard]] bool finished() const noexcept { return state_ == finished_; }

 private:
  std::size_t vocab_;
  std::size_t words_;
  std::vector<std::uint64_t> masks_;       ///< state_count() x words_
  std::vector<std::uint32_t> edge_begin_;  ///< state s's transitions: [begin[s], begin[s+1])
  std::vector<token_id> edge_token_;       ///< sorted by token within a state
  std::vector<state_type> edge_next_;
  std::vector<unsigned char> accepting_;
  state_type finished_ = 0;
  state_type state_ = 0;
};

static_assert(TokenConstraint<TokenDfa>);

}  // namespace specdec
