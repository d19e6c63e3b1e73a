// specdec demo — output helpers shared by the demo's modes: a printf-style format(), the
// report (terminal output plus an optional HTML page), tables, durations and medians.
#pragma once

#include <unistd.h>

#include <sys/ioctl.h>

#include <algorithm>
#include <array>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "demo/trace.hpp"

namespace specdec_demo {

// ---------------------------------------------------------------------------------------
// Output: everything printed also goes into the optional HTML page.
// ---------------------------------------------------------------------------------------

__attribute__((format(printf, 1, 2))) inline std::string format(const char* pattern, ...) {
  std::va_list arguments;
  va_start(arguments, pattern);
  std::array<char, 1024> buffer{};
  const int length = std::vsnprintf(buffer.data(), buffer.size(), pattern, arguments);
  va_end(arguments);
  return std::string(buffer.data(),
                     static_cast<std::size_t>(std::clamp(length, 0, int{buffer.size()} - 1)));
}

class Report {
 public:
  explicit Report(TerminalStyle style) : style_(style) {}

  [[nodiscard]] const TerminalStyle& style() const noexcept { return style_; }

  void heading(const std::string& text) {
    if (style_.colour) {
      std::printf("\n\x1b[1m%s\x1b[0m\n", text.c_str());
    } else {
      std::printf("\n%s\n", text.c_str());
    }
    html_ += "<h2>" + html_escape(text) + "</h2>\n";
  }

  // A block of preformatted lines (tables, notes).
  void block(const std::vector<std::string>& lines) {
    html_ += "<pre>";
    for (const auto& line : lines) {
      std::printf("%s\n", line.c_str());
      html_ += html_escape(line) + "\n";
    }
    html_ += "</pre>\n";
  }

  void trace(std::span<const token_id> prompt, std::span<const TraceStep> steps,
             const TokenText& shown = {}) {
    std::printf("%s\n", trace_legend(style_).c_str());
    print_trace(stdout, prompt, steps, style_, shown);
    html_ += trace_html(prompt, steps, shown);
  }

  [[nodiscard]] std::string page(
      const std::string& title = "specdec demo: speculative decoding on real text") const {
    return html_page(title,
                     "<h1>" + html_escape(title) +
                         "</h1>\n"
                         "<p>Each line is one step of Algorithm 1 (one target call): "
                         "<span class=\"accepted\">accepted drafts</span>, "
                         "<span class=\"rejected\">the rejected draft</span>, "
                         "<span class=\"correction\">the target's correction</span>, "
                         "<span class=\"bonus\">the bonus token</span> after a fully accepted "
                         "draft (Leviathan et al. 2023, Figure 1).</p>\n" +
                         html_);
  }

 private:
  TerminalStyle style_;
  std::string html_;
};

inline TerminalStyle terminal_style() {
  TerminalStyle style;
  const bool terminal = isatty(STDOUT_FILENO) != 0;
  const char* no_colour = std::getenv("NO_COLOR");
  const char* term = std::getenv("TERM");
  style.colour = terminal && (no_colour == nullptr || *no_colour == '\0') &&
                 !(term != nullptr && std::strcmp(term, "dumb") == 0);
  winsize size{};
  if (terminal && ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col >= 40) {
    style.width = std::min<std::size_t>(size.ws_col, 160);
  }
  return style;
}

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

inline std::string duration(double seconds) {
  if (seconds < 1e-3) return format("%.1f us", seconds * 1e6);
  if (seconds < 1.0) return format("%.2f ms", seconds * 1e3);
  return format("%.2f s", seconds);
}

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;

  [[nodiscard]] std::vector<std::string> lines() const {
    std::vector<std::size_t> widths(header.size(), 0);
    const auto measure = [&](const std::vector<std::string>& row) {
      for (std::size_t i = 0; i < row.size() && i < widths.size(); ++i)
        widths[i] = std::max(widths[i], row[i].size());
    };
    measure(header);
    for (const auto& row : rows) measure(row);
    const auto render = [&](const std::vector<std::string>& row) {
      std::string line = "  ";
      for (std::size_t i = 0; i < row.size(); ++i) {
        const std::size_t pad = widths[i] - row[i].size();
        line += i == 0 ? row[i] + std::string(pad, ' ') : std::string(pad + 3, ' ') + row[i];
      }
      return line;
    };
    std::vector<std::string> out = {render(header)};
    std::size_t total = 2;
    for (std::size_t i = 0; i < widths.size(); ++i) total += widths[i] + (i == 0 ? 0 : 3);
    out.push_back("  " + std::string(total - 2, '-'));
    for (const auto& row : rows) out.push_back(render(row));
    return out;
  }
};

}  // namespace specdec_demo
