// acceptance_plots: the data behind the paper's Figures 2, 3 and 4 (Leviathan et al. 2023,
// Sec. 3), computed with specdec/analysis.hpp and written as CSV for gnuplot
// (scripts/plots.sh draws them; scripts/plots/*.gnuplot are the drawings).
//
//   acceptance_plots [OUTPUT_DIR] [--measured BM_SPEEDUP_CSV]
//
// OUTPUT_DIR defaults to build/plots. Files written:
//   figure2_expected_tokens.csv   Eq. 1 vs alpha for gamma 1, 2, 3, 5, 7, 10, and the
//                                 oracle bound 1 / (1 - alpha)
//   figure3_optimal_gamma.csv     optimal gamma (Sec. 3.5) vs alpha for several c (NaN
//                                 where alpha <= c: no gamma helps, Cor. 3.9)
//   figure4_speed_operations.csv  walltime (Thm 3.8) and operations (Thm 3.11) factors
//                                 vs alpha for gamma 2, 3, 5, 10, c = c_hat = 0
//   table1_points.csv             the paper's Table 1 as printed (points on Figure 4)
//   theory_walltime.csv           Thm 3.8 for the measured grid: gamma 1, 2, 4, 8 and
//                                 c 0, 0.05, 0.2
//   measured_speedup.csv          with --measured: the table written by
//                                 SPECDEC_SPEEDUP_CSV=... bm_speedup (alpha, gamma, c,
//                                 measured, predicted, ratio), checked and copied
// Values that do not exist (infinite oracle, no improving gamma) are written as NaN,
// which gnuplot skips.
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "specdec/analysis.hpp"

namespace {

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();

/// alpha on [first, last] in `count` equal steps (endpoints included).
std::vector<double> alpha_grid(double first, double last, int count) {
  std::vector<double> grid;
  for (int i = 0; i <= count; ++i) {
    grid.push_back(first + (last - first) * static_cast<double>(i) / static_cast<double>(count));
  }
  return grid;
}

class CsvFile {
 public:
  CsvFile(const std::filesystem::path& path, const std::string& header) : path_(path), out_(path) {
    if (!out_) throw std::runtime_error("cannot write " + path.string());
    out_ << header << '\n';
  }

  void row(const std::vector<double>& values) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (i > 0) out_ << ',';
      if (std::isnan(values[i])) {
        out_ << "NaN";
      } else {
        out_ << values[i];
      }
    }
    out_ << '\n';
  }

  ~CsvFile() { std::printf("wrote %s\n", path_.string().c_str()); }
  CsvFile(const CsvFile&) = delete;
  CsvFile& operator=(const CsvFile&) = delete;

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

void write_figure2(const std::filesystem::path& directory) {
  constexpr std::array<std::size_t, 6> gammas = {1, 2, 3, 5, 7, 10};
  CsvFile csv(directory / "figure2_expected_tokens.csv",
              "alpha,gamma=1,gamma=2,gamma=3,gamma=5,gamma=7,gamma=10,oracle 1/(1-alpha)");
  for (const double alpha : alpha_grid(0.0, 1.0, 200)) {
    std::vector<double> values = {alpha};
    for (const std::size_t gamma : gammas) {
      values.push_back(specdec::expected_tokens_per_step(alpha, gamma));
    }
    const double oracle = specdec::oracle_improvement_bound(alpha);
    values.push_back(std::isinf(oracle) ? not_a_number : oracle);
    csv.row(values);
  }
}

void write_figure3(const std::filesystem::path& directory) {
  constexpr std::array<double, 6> costs = {0.01, 0.02, 0.05, 0.1, 0.2, 0.5};
  CsvFile csv(directory / "figure3_optimal_gamma.csv",
              "alpha,c=0.01,c=0.02,c=0.05,c=0.1,c=0.2,c=0.5");
  for (const double alpha : alpha_grid(0.005, 0.995, 198)) {
    std::vector<double> values = {alpha};
    for (const double c : costs) {
      const auto choice = specdec::optimal_gamma(alpha, c, 1000);
      values.push_back(choice.improvement > 1.0 ? static_cast<double>(choice.gamma) : not_a_number);
    }
    csv.row(values);
  }
}

void write_figure4(const std::filesystem::path& directory) {
  constexpr std::array<std::size_t, 4> gammas = {2, 3, 5, 10};
  CsvFile csv(directory / "figure4_speed_operations.csv",
              "alpha,speed gamma=2,speed gamma=3,speed gamma=5,speed gamma=10,"
              "operations gamma=2,operations gamma=3,operations gamma=5,operations gamma=10");
  for (const double alpha : alpha_grid(0.0, 1.0, 200)) {
    std::vector<double> values = {alpha};
    for (const std::size_t gamma : gammas) {
      values.push_back(specdec::walltime_improvement(alpha, gamma, 0.0));
    }
    for (const std::size_t gamma : gammas) {
      values.push_back(specdec::arithmetic_operations_factor(alpha, gamma, 0.0));
    }
    csv.row(values);
  }
  CsvFile table(directory / "table1_points.csv", "alpha,gamma,operations,speed");
  table.row({0.6, 2, 1.53, 1.96});
  table.row({0.7, 3, 1.58, 2.53});
  table.row({0.8, 2, 1.23, 2.44});
  table.row({0.8, 5, 1.63, 3.69});
  table.row({0.9, 2, 1.11, 2.71});
  table.row({0.9, 10, 1.60, 6.86});
}

void write_theory_for_measurements(const std::filesystem::path& directory) {
  constexpr std::array<double, 3> costs = {0.0, 0.05, 0.2};
  constexpr std::array<std::size_t, 4> gammas = {1, 2, 4, 8};
  std::string header = "alpha";
  for (const double c : costs) {
    for (const std::size_t gamma : gammas) {
      std::ostringstream name;
      name << ",c=" << c << " gamma=" << gamma;
      header += name.str();
    }
  }
  CsvFile csv(directory / "theory_walltime.csv", header);
  for (const double alpha : alpha_grid(0.4, 0.95, 110)) {
    std::vector<double> values = {alpha};
    for (const double c : costs) {
      for (const std::size_t gamma : gammas) {
        values.push_back(specdec::walltime_improvement(alpha, gamma, c));
      }
    }
    csv.row(values);
  }
}

/// Reads bm_speedup's CSV (header alpha,gamma,c,measured,predicted,ratio,...), checks each
/// row's prediction against Theorem 3.8, writes the first six columns and prints a table.
void copy_measurements(const std::filesystem::path& source,
                       const std::filesystem::path& directory) {
  std::ifstream in(source);
  if (!in) throw std::runtime_error("cannot read measurements from " + source.string());
  std::string line;
  if (!std::getline(in, line) || line.rfind("alpha,gamma,c,measured,predicted,ratio", 0) != 0) {
    throw std::runtime_error(source.string() + " is not a bm_speedup table");
  }
  CsvFile csv(directory / "measured_speedup.csv", "alpha,gamma,c,measured,predicted,ratio");
  std::printf("\nmeasured speedup vs Theorem 3.8 (%s)\n", source.string().c_str());
  std::printf("%6s %6s %6s %9s %10s %7s\n", "alpha", "gamma", "c", "measured", "predicted",
              "ratio");
  std::size_t line_number = 1;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::array<double, 6> values{};
    for (double& value : values) {
      std::string field;
      if (!std::getline(fields, field, ',')) {
        throw std::runtime_error(source.string() + ":" + std::to_string(line_number) +
                                 ": expected six fields");
      }
      value = std::stod(field);
    }
    const auto gamma = static_cast<std::size_t>(values[1]);
    const double predicted = specdec::walltime_improvement(values[0], gamma, values[2]);
    if (std::abs(predicted - values[4]) > 1e-4 * predicted) {
      throw std::runtime_error(source.string() + ":" + std::to_string(line_number) +
                               ": prediction differs from Theorem 3.8");
    }
    csv.row(std::vector<double>(values.begin(), values.end()));
    std::printf("%6.2f %6zu %6.2f %9.3f %10.3f %7.3f\n", values[0], gamma, values[2], values[3],
                values[4], values[5]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::filesystem::path directory = "build/plots";
    std::filesystem::path measured;
    for (int i = 1; i < argc; ++i) {
      const std::string argument = argv[i];
      if (argument == "--help" || argument == "-h") {
        std::puts("usage: acceptance_plots [OUTPUT_DIR] [--measured BM_SPEEDUP_CSV]");
        return 0;
      }
      if (argument == "--measured") {
        if (i + 1 >= argc) throw std::runtime_error("--measured needs a file");
        measured = argv[++i];
      } else if (argument.rfind("--", 0) == 0) {
        throw std::runtime_error("unknown option '" + argument + "'");
      } else {
        directory = argument;
      }
    }
    std::filesystem::create_directories(directory);
    write_figure2(directory);
    write_figure3(directory);
    write_figure4(directory);
    write_theory_for_measurements(directory);
    if (!measured.empty()) copy_measurements(measured, directory);
    return 0;
  } catch (const std::exception& problem) {
    std::fprintf(stderr, "acceptance_plots: error: %s\n", problem.what());
    return 1;
  }
}
