// speedup_calculator: what speculative decoding should buy for a given acceptance rate.
//
//   speedup_calculator --alpha 0.8 --c 0.05 [--c-hat 0.05] [--max-gamma 20]
//   speedup_calculator --target-probs p.txt --draft-probs q.txt [--c 0.05] ...
//
// Prints the optimal gamma (Sec. 3.5) and, for every gamma up to --max-gamma, the
// expected tokens per step (Eq. 1), the walltime improvement (Thm. 3.8) and the factor of
// extra arithmetic operations (Thm. 3.11). With probability files, alpha is computed as
// beta(p, q) = sum_x min(p(x), q(x)) (Thm. 3.5); files with several lines are read as
// one distribution per line (position) and alpha is the mean beta (Cor. 3.6).
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "specdec/analysis.hpp"
#include "specdec/error.hpp"

namespace {

constexpr std::string_view usage =
    "usage: speedup_calculator --alpha A [--c C] [--c-hat C_HAT] [--max-gamma N]\n"
    "       speedup_calculator --target-probs FILE --draft-probs FILE [--c C] ...\n"
    "\n"
    "Expected benefit of speculative decoding (Leviathan et al. 2023, Sec. 3).\n"
    "  --alpha A            acceptance rate alpha = E[beta] in [0, 1]\n"
    "  --target-probs FILE  target distribution p: whitespace-separated probabilities,\n"
    "                       one distribution per line (several lines = several positions)\n"
    "  --draft-probs FILE   draft distribution q, same shape; alpha = mean of\n"
    "                       beta = sum_x min(p(x), q(x)) over the lines\n"
    "  --c C                draft/target time per call (Def. 3.7), default 0\n"
    "  --c-hat C_HAT        draft/target arithmetic operations (Def. 3.10), default C\n"
    "  --max-gamma N        largest gamma to tabulate and search, default 20\n"
    "  --help               this text\n";

/// Thrown for bad command lines and files; main prints it on one line.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

double parse_number(const std::string& option, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
    throw usage_error(option + " expects a number, got '" + text + "'");
  }
  return value;
}

std::size_t parse_count(const std::string& option, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || end != text.c_str() + text.size() || errno == ERANGE ||
      value == 0 || value > 100000) {
    throw usage_error(option + " expects a whole number in [1, 100000], got '" + text + "'");
  }
  return static_cast<std::size_t>(value);
}

/// One probability row per non-blank line.
std::vector<std::vector<double>> read_rows(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw usage_error("cannot open '" + path + "'");
  std::vector<std::vector<double>> rows;
  std::string line;
  std::size_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    std::istringstream words(line);
    std::vector<double> row;
    std::string word;
    while (words >> word) {
      const std::string where = path + ":" + std::to_string(line_number);
      const double value = parse_number(where, word);
      if (!std::isfinite(value) || value < 0.0) {
        throw usage_error(where + ": probability " + word + " is not finite and >= 0");
      }
      row.push_back(value);
    }
    if (row.empty()) continue;
    double total = 0.0;
    for (const double value : row) total += value;
    if (std::abs(total - 1.0) > 1e-6) {
      std::ostringstream message;
      message << path << ":" << line_number << ": probabilities sum to " << total << ", not 1";
      throw usage_error(message.str());
    }
    rows.push_back(std::move(row));
  }
  if (rows.empty()) throw usage_error("'" + path + "' holds no probabilities");
  return rows;
}

struct Options {
  double alpha = -1.0;
  double c = 0.0;
  double c_hat = 0.0;
  bool have_c_hat = false;  // default: c_hat = c
  std::size_t max_gamma = 20;
  std::string target_path;
  std::string draft_path;
  bool help = false;
};

Options parse(int argc, char** argv) {
  Options options;
  bool have_alpha = false;
  for (int i = 1; i < argc; ++i) {
    const std::string option = argv[i];
    if (option == "--help" || option == "-h") {
      options.help = true;
      return options;
    }
    if (i + 1 >= argc) throw usage_error("unknown option or missing value: '" + option + "'");
    const std::string value = argv[++i];
    if (option == "--alpha") {
      options.alpha = parse_number(option, value);
      have_alpha = true;
    } else if (option == "--c") {
      options.c = parse_number(option, value);
    } else if (option == "--c-hat") {
      options.c_hat = parse_number(option, value);
      options.have_c_hat = true;
    } else if (option == "--max-gamma") {
      options.max_gamma = parse_count(option, value);
    } else if (option == "--target-probs") {
      options.target_path = value;
    } else if (option == "--draft-probs") {
      options.draft_path = value;
    } else {
      throw usage_error("unknown option '" + option + "' (try --help)");
    }
  }
  const bool have_files = !options.target_path.empty() || !options.draft_path.empty();
  if (have_alpha == have_files) {
    throw usage_error("give either --alpha or both --target-probs and --draft-probs");
  }
  if (have_files && (options.target_path.empty() || options.draft_path.empty())) {
    throw usage_error("--target-probs and --draft-probs go together");
  }
  if (!options.have_c_hat) options.c_hat = options.c;
  return options;
}

int run(const Options& options) {
  double alpha = options.alpha;
  if (!options.target_path.empty()) {
    const auto target = read_rows(options.target_path);
    const auto draft = read_rows(options.draft_path);
    if (target.size() != draft.size()) {
      throw usage_error("target file has " + std::to_string(target.size()) +
                        " distributions but draft file has " + std::to_string(draft.size()));
    }
    specdec::BetaEstimator betas;
    for (std::size_t i = 0; i < target.size(); ++i) {
      if (target[i].size() != draft[i].size()) {
        throw usage_error("distribution " + std::to_string(i + 1) + ": target has " +
                          std::to_string(target[i].size()) + " probabilities but draft has " +
                          std::to_string(draft[i].size()));
      }
      betas.observe(specdec::beta(target[i], draft[i]));
    }
    const auto estimate = betas.estimate();
    alpha = estimate.alpha;
    if (target.size() == 1) {
      std::printf("alpha = beta(p, q) = sum_x min(p(x), q(x)) = %.6f  (D_LK = %.6f)\n", alpha,
                  1.0 - alpha);
    } else {
      std::printf("alpha = mean beta over %zu positions = %.6f (standard error %.6f)\n",
                  target.size(), alpha, estimate.standard_error);
    }
  }
  const auto best = specdec::optimal_gamma(alpha, options.c, options.max_gamma);
  // Validate c_hat through the library as well (it throws for a bad value).
  (void)specdec::arithmetic_operations_factor(alpha, 1, options.c_hat);

  std::printf("alpha %.4f, c %.4g, c_hat %.4g\n", alpha, options.c, options.c_hat);
  std::printf("optimal gamma (1..%zu): %zu, walltime improvement %.3fx\n", options.max_gamma,
              best.gamma, best.improvement);
  std::printf("Cor. 3.9 lower bound (gamma = 1): %.3fx%s\n",
              specdec::min_improvement_bound(alpha, options.c),
              alpha > options.c ? "" : "  (alpha <= c: no gamma helps)");
  const double oracle = specdec::oracle_improvement_bound(alpha);
  if (std::isinf(oracle)) {
    std::printf("oracle bound 1 / (1 - alpha): unbounded\n\n");
  } else {
    std::printf("oracle bound 1 / (1 - alpha): %.3f tokens per target call\n\n", oracle);
  }
  std::printf("%6s  %14s  %10s  %11s\n", "gamma", "tokens/step", "walltime", "operations");
  std::printf("%6s  %14s  %10s  %11s\n", "", "(Eq. 1)", "(Thm 3.8)", "(Thm 3.11)");
  for (std::size_t gamma = 1; gamma <= options.max_gamma; ++gamma) {
    std::printf("%6zu  %14.3f  %9.3fx  %10.3fx%s\n", gamma,
                specdec::expected_tokens_per_step(alpha, gamma),
                specdec::walltime_improvement(alpha, gamma, options.c),
                specdec::arithmetic_operations_factor(alpha, gamma, options.c_hat),
                gamma == best.gamma ? "  <- optimal" : "");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options options = parse(argc, argv);
    if (options.help) {
      std::fputs(usage.data(), stdout);
      return 0;
    }
    return run(options);
  } catch (const usage_error& problem) {
    std::fprintf(stderr, "speedup_calculator: error: %s\n", problem.what());
  } catch (const specdec::error& problem) {
    std::fprintf(stderr, "speedup_calculator: error: %s\n", problem.what());
  } catch (const std::exception& problem) {
    std::fprintf(stderr, "speedup_calculator: error: %s\n", problem.what());
  }
  return 2;
}
