// specdec demo — the Figure-1-style trace: one line per decoding step, accepted drafts
// green, the first rejected draft red, the target's correction blue, and the bonus token
// (drawn from p_{gamma+1} when every draft was accepted) magenta. Rendered for a terminal
// (ANSI colours, or word-diff markup [-rejected-]{+correction+}{^bonus^} without colours)
// and as HTML.
#pragma once

#include <cstddef>
#include <cstdio>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "specdec/concepts.hpp"

namespace specdec_demo {

using specdec::token_id;

/// One step of Algorithm 1 as the trace shows it.
struct TraceStep {
  std::vector<token_id> accepted;    ///< x_1..x_n
  std::optional<token_id> rejected;  ///< x_{n+1} if a draft was rejected
  std::optional<token_id> token;     ///< t (absent if the token budget cut the step short)
  bool bonus = false;                ///< t is the bonus token (all drafts accepted)
  std::size_t drafted = 0;           ///< drafts proposed this step
};

/// A byte as the trace prints it: printable ASCII as is, newline and tab as visible
/// symbols (so every step stays on one line), other bytes as \xHH.
inline std::string printable(token_id token) {
  const auto byte = static_cast<unsigned char>(token);
  if (byte == '\n') return "\u21b5";  // ↵
  if (byte == '\t') return "\u21e5";  // ⇥
  if (byte >= 0x20 && byte < 0x7f) return std::string(1, static_cast<char>(byte));
  static constexpr char hex[] = "0123456789ABCDEF";
  return std::string("\\x") + hex[byte >> 4U] + hex[byte & 0xfU];
}

/// Terminal columns `printable(token)` occupies.
inline std::size_t printable_width(token_id token) {
  const auto byte = static_cast<unsigned char>(token);
  if (byte == '\n' || byte == '\t' || (byte >= 0x20 && byte < 0x7f)) return 1;
  return 4;
}

/// How a trace shows tokens: `text(token)` gives the visible text of one token (one line
/// per step, so newlines and tabs must come out as symbols). Byte-level models use
/// printable(); the llama demo shows token pieces. Widths are counted in UTF-8 code points.
struct TokenText {
  std::function<std::string(token_id)> text = [](token_id t) { return printable(t); };
};

/// Terminal columns of a UTF-8 string (code points; every character one column).
inline std::size_t display_width(const std::string& text) {
  std::size_t width = 0;
  for (const char c : text) width += (static_cast<unsigned char>(c) & 0xC0U) != 0x80U ? 1 : 0;
  return width;
}

/// A token piece as the trace prints it: newline and tab as symbols, other control bytes
/// and bytes that do not form valid UTF-8 as \xHH.
inline std::string visible_piece(const std::string& piece) {
  std::string out;
  for (std::size_t i = 0; i < piece.size();) {
    const auto byte = static_cast<unsigned char>(piece[i]);
    std::size_t length = 1;
    if (byte >= 0xC0 && byte < 0xE0) length = 2;
    if (byte >= 0xE0 && byte < 0xF0) length = 3;
    if (byte >= 0xF0 && byte < 0xF8) length = 4;
    bool valid = byte < 0x80 || (length > 1 && i + length <= piece.size());
    for (std::size_t k = 1; valid && k < length; ++k)
      valid = (static_cast<unsigned char>(piece[i + k]) & 0xC0U) == 0x80U;
    if (byte == '\n') {
      out += "\u21b5";
    } else if (byte == '\t') {
      out += "\u21e5";
    } else if (byte < 0x20 || byte == 0x7f || !valid) {
      out += printable(static_cast<token_id>(byte));
      length = 1;
    } else {
      out += piece.substr(i, length);
    }
    i += valid ? length : 1;
  }
  return out;
}

inline std::string html_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

struct TerminalStyle {
  bool colour = false;
  std::size_t width = 100;  // columns available for one trace line
};

namespace detail {

inline std::string printable(std::span<const token_id> tokens, const TokenText& shown) {
  std::string text;
  for (const token_id t : tokens) text += shown.text(t);
  return text;
}

inline std::size_t printable_width(std::span<const token_id> tokens, const TokenText& shown) {
  std::size_t width = 0;
  for (const token_id t : tokens) width += display_width(shown.text(t));
  return width;
}

// The last tokens of `text` that fit into `columns`, prefixed with "…" if cut.
inline std::string tail(std::span<const token_id> text, std::size_t columns,
                        const TokenText& shown) {
  std::size_t used = 0;
  std::size_t first = text.size();
  while (first > 0 && used + display_width(shown.text(text[first - 1])) <= columns) {
    used += display_width(shown.text(text[first - 1]));
    --first;
  }
  std::string out = first > 0 ? "\u2026" : "";
  if (first > 0 && first < text.size()) {
    used -= display_width(shown.text(text[first]));  // make room for the ellipsis
    ++first;
  }
  return out + printable(text.subspan(first), shown);
}

}  // namespace detail

/// The legend printed above a trace.
inline std::string trace_legend(const TerminalStyle& style) {
  if (style.colour) {
    return "\x1b[32;4maccepted draft\x1b[0m  \x1b[31;9mrejected draft\x1b[0m  "
           "\x1b[34;1;4mcorrection\x1b[0m  \x1b[35;1;4mbonus\x1b[0m  \x1b[2m(context)\x1b[0m  "
           "\u21b5 = newline, \u21e5 = tab";
  }
  return "accepted drafts plain after '|', [-rejected draft-], {+correction+}, {^bonus^}; "
         "\u21b5 = newline, \u21e5 = tab";
}

/// Prints one line per step: step number, the tail of the text before the step (dim),
/// then the step's tokens.
inline void print_trace(std::FILE* out, std::span<const token_id> prompt,
                        std::span<const TraceStep> steps, const TerminalStyle& style,
                        const TokenText& shown = {}) {
  std::vector<token_id> text(prompt.begin(), prompt.end());
  for (std::size_t s = 0; s < steps.size(); ++s) {
    const TraceStep& step = steps[s];
    const std::string accepted = detail::printable(step.accepted, shown);
    const std::string rejected = step.rejected ? shown.text(*step.rejected) : "";
    const std::string token = step.token ? shown.text(*step.token) : "";
    std::size_t added_width = detail::printable_width(step.accepted, shown) +
                              display_width(rejected) + display_width(token);
    std::string added;
    if (style.colour) {
      if (!accepted.empty()) added += "\x1b[32;4m" + accepted + "\x1b[0m";
      if (step.rejected) added += "\x1b[31;9m" + rejected + "\x1b[0m";
      if (step.token) added += (step.bonus ? "\x1b[35;1;4m" : "\x1b[34;1;4m") + token + "\x1b[0m";
    } else {
      added += "|" + accepted;
      added_width += 1;
      if (step.rejected) {
        added += "[-" + rejected + "-]";
        added_width += 4;
      }
      if (step.token) {
        added += (step.bonus ? "{^" : "{+") + token + (step.bonus ? "^}" : "+}");
        added_width += 4;
      }
    }
    const std::size_t prefix_width = 5;  // "%3zu  "
    const std::size_t context_columns = style.width > prefix_width + added_width + 10
                                            ? style.width - prefix_width - added_width
                                            : 10;
    const std::string context = detail::tail(text, context_columns, shown);
    if (style.colour) {
      std::fprintf(out, "%3zu  \x1b[2m%s\x1b[0m%s\n", s + 1, context.c_str(), added.c_str());
    } else {
      std::fprintf(out, "%3zu  %s%s\n", s + 1, context.c_str(), added.c_str());
    }
    text.insert(text.end(), step.accepted.begin(), step.accepted.end());
    if (step.token) text.push_back(*step.token);
  }
}

/// The same trace as HTML: every line shows the whole text so far, as Figure 1 does.
inline std::string trace_html(std::span<const token_id> prompt, std::span<const TraceStep> steps,
                              const TokenText& shown = {}) {
  std::string html = "<ol class=\"trace\">\n";
  std::string context = html_escape(detail::printable(prompt, shown));
  for (const TraceStep& step : steps) {
    std::string added;
    if (!step.accepted.empty())
      added += "<span class=\"accepted\">" + html_escape(detail::printable(step.accepted, shown)) +
               "</span>";
    if (step.rejected)
      added += "<span class=\"rejected\">" + html_escape(shown.text(*step.rejected)) + "</span>";
    if (step.token)
      added += std::string("<span class=\"") + (step.bonus ? "bonus" : "correction") + "\">" +
               html_escape(shown.text(*step.token)) + "</span>";
    html += "<li><span class=\"context\">" + context + "</span>" + added + "</li>\n";
    context += html_escape(detail::printable(step.accepted, shown));
    if (step.token) context += html_escape(shown.text(*step.token));
  }
  html += "</ol>\n";
  return html;
}

/// A self-contained HTML page around `body`.
inline std::string html_page(const std::string& title, const std::string& body) {
  return "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>" +
         html_escape(title) +
         "</title>\n<style>\n"
         "body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; "
         "color: #222; }\n"
         "ol.trace { font-family: ui-monospace, monospace; font-size: 0.9em; "
         "white-space: pre-wrap; word-break: break-all; }\n"
         "ol.trace li { margin-bottom: 0.35em; }\n"
         ".context { color: #555; }\n"
         ".accepted { color: #0a7d20; font-weight: 600; text-decoration: underline; }\n"
         ".rejected { color: #c8102e; text-decoration: line-through; font-weight: 600; }\n"
         ".correction { color: #1446d6; font-weight: 700; text-decoration: underline; }\n"
         ".bonus { color: #a0179c; font-weight: 700; text-decoration: underline; }\n"
         "pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }\n"
         "</style>\n</head>\n<body>\n" +
         body + "</body>\n</html>\n";
}

}  // namespace specdec_demo
