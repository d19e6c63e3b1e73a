// specdec demo — command-line options.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace specdec_demo {

/// A bad command line; `what()` is the one-line message shown to the user.
class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class drafter_kind { bigram, ngram, prompt_lookup };

struct DemoOptions {
  std::size_t gamma = 4;     // draft tokens per step
  double temperature = 1.0;  // of the sampled run (the greedy run is T = 0)
  std::size_t top_k = 0;     // 0: off
  double top_p = 1.0;        // 1: off
  std::size_t tokens = 80;   // new tokens per generation
  std::uint64_t seed = 42;
  drafter_kind drafter = drafter_kind::bigram;
  std::string prompt = "Speculative sampling ";
  std::string corpus;             // empty: the repository's own text
  std::string html;               // empty: no HTML page
  std::size_t order = 7;          // order of the Kneser-Ney target
  std::size_t runs = 20000;       // first-token samples of the exactness check (0: skip)
  std::size_t draft_order = 2;    // order of the Kneser-Ney draft (--drafter bigram)
  double target_cost_us = 200.0;  // simulated extra cost of each target call (0: none)
  bool help = false;
};

inline constexpr std::string_view help_text =
    R"(usage: demo [options]

Speculative decoding (Leviathan, Kalman, Matias 2023) on real text with specdec.
The target M_p is a byte-level interpolated Kneser-Ney n-gram model, the draft M_q a
weaker model; both are trained at start-up. The demo generates text with speculative
sampling (Algorithm 1) and greedily, prints a Figure-1-style trace (one line per step:
accepted drafts green, the rejected draft red, the target's correction blue, the bonus
token after a fully accepted draft magenta), a table of measured vs predicted figures
(alpha, tokens per target call, wall-time speedup) and an exactness check.

options:
  --gamma N            draft tokens per step (default 4)
  --temperature T      temperature of the sampled run, T > 0 (default 1); the greedy
                       run always uses T = 0. Applied alike to target and draft
  --top-k K            keep the K most likely tokens (default 0: off)
  --top-p P            keep the smallest set of tokens with mass >= P (default 1: off)
  --tokens N           new tokens per generation (default 80)
  --seed S             random seed (default 42)
  --drafter D          bigram (default: the target's estimator at order 2, a real model
                       with full q rows), ngram (specdec::NgramDrafter over the context,
                       proposal-only) or prompt-lookup (specdec::PromptLookupDrafter:
                       copies what followed an earlier match in the context)
  --draft-order N      order of the Kneser-Ney draft of --drafter bigram, 1..order-1
                       (default 2; 3 or 4 draft better and cost more: try it)
  --prompt TEXT        the prompt (default "Speculative sampling ")
  --corpus PATH        train both models on this text file instead of the repository's
                       own text (README.md, docs/*.md, include/specdec/**/*.hpp)
  --order N            order of the Kneser-Ney target, 3..8 (default 7)
  --runs N             samples of the first generated token for the exactness check
                       (default 20000; 0 skips the check)
  --target-cost-us N   also time a target made expensive: every call (single or
                       batched) streams through a buffer for about N microseconds, as
                       a large memory-bound model reads its weights once per forward
                       pass (default 200; 0 skips it)
  --html FILE          also write the trace and tables as a self-contained HTML page
  --help               show this help

Colours are used when standard output is a terminal (and NO_COLOR is unset).
)";

namespace detail {

inline std::uint64_t parse_unsigned(std::string_view name, const std::string& text,
                                    std::uint64_t min, std::uint64_t max) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || end != text.c_str() + text.size() || errno == ERANGE ||
      value < min || value > max)
    throw usage_error(std::string(name) + " expects an integer in " + std::to_string(min) + ".." +
                      std::to_string(max) + ", got '" + text + "'");
  return value;
}

inline std::string shortest(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

inline double parse_real(std::string_view name, const std::string& text, double min, double max,
                         bool min_inclusive) {
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const bool below = min_inclusive ? value < min : value <= min;
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE ||
      !std::isfinite(value) || below || value > max) {
    throw usage_error(std::string(name) + " expects a number in " + (min_inclusive ? "[" : "(") +
                      shortest(min) + ", " + shortest(max) + "], got '" + text + "'");
  }
  return value;
}

}  // namespace detail

/// Parses argv. Accepts "--name value" and "--name=value". Throws usage_error.
inline DemoOptions parse_options(int argc, char** argv) {
  DemoOptions options;
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i];
    std::string value;
    bool has_value = false;
    if (const auto equals = name.find('=');
        name.rfind("--", 0) == 0 && equals != std::string::npos) {
      value = name.substr(equals + 1);
      name.resize(equals);
      has_value = true;
    }
    if (name == "--help" || name == "-h") {
      options.help = true;
      continue;
    }
    if (name.rfind("--", 0) != 0) throw usage_error("unexpected argument '" + name + "'");
    static const std::vector<std::string> known = {
        "--gamma", "--temperature",    "--top-k",  "--top-p",      "--tokens",
        "--seed",  "--drafter",        "--prompt", "--corpus",     "--order",
        "--runs",  "--target-cost-us", "--html",   "--draft-order"};
    bool is_known = false;
    for (const auto& k : known) is_known = is_known || k == name;
    if (!is_known) throw usage_error("unknown option '" + name + "'");
    if (!has_value) {
      if (i + 1 >= args.size()) throw usage_error(name + " needs a value");
      value = args[++i];
    }
    if (name == "--gamma") {
      options.gamma = detail::parse_unsigned(name, value, 1, 64);
    } else if (name == "--temperature") {
      options.temperature = detail::parse_real(name, value, 0.0, 100.0, false);
    } else if (name == "--top-k") {
      options.top_k = detail::parse_unsigned(name, value, 0, 256);
    } else if (name == "--top-p") {
      options.top_p = detail::parse_real(name, value, 0.0, 1.0, false);
    } else if (name == "--tokens") {
      options.tokens = detail::parse_unsigned(name, value, 1, 100000);
    } else if (name == "--seed") {
      options.seed =
          detail::parse_unsigned(name, value, 0, std::numeric_limits<std::uint64_t>::max());
    } else if (name == "--drafter") {
      if (value == "bigram") {
        options.drafter = drafter_kind::bigram;
      } else if (value == "ngram") {
        options.drafter = drafter_kind::ngram;
      } else if (value == "prompt-lookup") {
        options.drafter = drafter_kind::prompt_lookup;
      } else {
        throw usage_error("--drafter expects bigram, ngram or prompt-lookup, got '" + value + "'");
      }
    } else if (name == "--prompt") {
      options.prompt = value;
    } else if (name == "--corpus") {
      if (value.empty()) throw usage_error("--corpus needs a file name");
      options.corpus = value;
    } else if (name == "--order") {
      options.order = detail::parse_unsigned(name, value, 3, 8);
    } else if (name == "--draft-order") {
      options.draft_order = detail::parse_unsigned(name, value, 1, 7);
    } else if (name == "--runs") {
      options.runs = detail::parse_unsigned(name, value, 0, 10000000);
    } else if (name == "--target-cost-us") {
      options.target_cost_us = detail::parse_real(name, value, 0.0, 1e6, true);
    } else if (name == "--html") {
      if (value.empty()) throw usage_error("--html needs a file name");
      options.html = value;
    }
  }
  if (options.draft_order >= options.order)
    throw usage_error("--draft-order " + std::to_string(options.draft_order) +
                      " must be below the target's order " + std::to_string(options.order));
  return options;
}

[[nodiscard]] constexpr std::string_view to_string(drafter_kind kind) noexcept {
  switch (kind) {
    case drafter_kind::bigram:
      return "bigram";
    case drafter_kind::ngram:
      return "ngram";
    case drafter_kind::prompt_lookup:
      return "prompt-lookup";
  }
  return "?";
}

}  // namespace specdec_demo
