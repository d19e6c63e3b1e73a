// specdec demo — the default mode: speculative decoding of a real transformer.
//
// The shipped pair (examples/llama/models, trained by scripts/train_llama_pair.py on the
// Python 3.11 standard library) runs in the example engine (examples/llama): a 12.6M-parameter
// llama target whose F32 weights (50 MB) do not fit this machine's 32 MiB L3 cache, so one
// token's forward pass is memory-bound as in the paper's regime, and a 1.4M-parameter draft.
// The demo prints the paper's Figure 1 over the model's own output, measures plain against
// speculative wall time in the same run (medians of alternating runs), compares the speedup
// with Theorem 3.8 once the measured cost of the batched target call is charged, checks that
// speculative sampling leaves the target's distribution unchanged, and compares specdec's
// drafters on the same prompt.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "demo/options.hpp"

#ifndef SPECDEC_LLAMA_MODELS
#define SPECDEC_LLAMA_MODELS "examples/llama/models"
#endif

namespace specdec_demo {

struct LlamaDemoOptions {
  std::string target = SPECDEC_LLAMA_MODELS "/target.gguf";
  std::string draft = SPECDEC_LLAMA_MODELS "/draft.gguf";
  std::string prompt =
      "class Stack:\n"
      "    \"\"\"A last-in, first-out stack of items.\"\"\"\n"
      "\n"
      "    def __init__(self):\n"
      "        self.items = []\n"
      "\n"
      "    def push(self, item):\n";
  std::size_t tokens = 128;     // new tokens per generation
  std::size_t gamma = 4;        // drafts per step
  double temperature = 1.0;     // the sampled runs (greedy runs use T = 0)
  std::size_t repetitions = 5;  // timed runs of each kind (medians)
  std::size_t exactness_runs = 2000;
  std::uint64_t seed = 7;
  std::size_t threads = 0;  // for the matrix products (0: one per hardware thread)
  std::string html;
  bool help = false;
};

inline constexpr std::string_view llama_help_text =
    R"(usage: demo [options]            (the transformer demo, the default)
       demo --kneser-ney [options]  (the byte-level n-gram demo; --kneser-ney --help)

Speculative decoding (Leviathan, Kalman, Matias 2023) of a real transformer with specdec:
the shipped llama-architecture pair (examples/llama/models: a 12.6M-parameter target, a
1.4M-parameter draft distilled from it, trained on the Python 3.11 standard library) runs
in the example engine (examples/llama, a KV-cached Eigen/AVX2 llama that loads GGUF).
The demo prints the paper's Figure 1 over the model's own output, plain vs speculative
wall time measured in the same run (medians of alternating runs), Theorem 3.8's prediction
from the measured alpha, c and batched-call cost, an exactness check, a constrained
generation (a regular expression over the generated text, the same mask on p and q), and a
comparison of specdec's drafters (draft model, n-gram, prompt lookup, token tree,
optimal-gamma controller) on the same prompt.

options:
  --target FILE        target model (default: the shipped target.gguf)
  --draft FILE         draft model (default: the shipped draft.gguf)
  --prompt TEXT        the prompt (default: the start of a Python class)
  --tokens N           new tokens per generation (default 128)
  --gamma N            draft tokens per step (default 4)
  --temperature T      temperature of the sampled runs, T > 0 (default 1); greedy runs
                       use T = 0
  --repetitions N      timed runs of each kind, medians reported (default 5, at least 3)
  --exactness-runs N   samples of the first generated token for the exactness check
                       (default 2000; 0 skips it)
  --seed S             random seed (default 7)
  --threads N          threads for the engine's matrix products, plain and speculative
                       runs alike (default 0: one per hardware thread)
  --html FILE          also write the traces and tables as an HTML page
  --help               show this help
)";

inline LlamaDemoOptions parse_llama_options(const std::vector<std::string>& args) {
  LlamaDemoOptions options;
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
    static const std::vector<std::string> known = {
        "--target",      "--draft",          "--prompt", "--tokens",  "--gamma", "--temperature",
        "--repetitions", "--exactness-runs", "--seed",   "--threads", "--html"};
    if (std::find(known.begin(), known.end(), name) == known.end())
      throw usage_error("unknown option '" + name + "'");
    if (!has_value) {
      if (i + 1 >= args.size()) throw usage_error(name + " needs a value");
      value = args[++i];
    }
    if (name == "--target") {
      options.target = value;
    } else if (name == "--draft") {
      options.draft = value;
    } else if (name == "--prompt") {
      options.prompt = value;
    } else if (name == "--tokens") {
      options.tokens = detail::parse_unsigned(name, value, 1, 4096);
    } else if (name == "--gamma") {
      options.gamma = detail::parse_unsigned(name, value, 1, 32);
    } else if (name == "--temperature") {
      options.temperature = detail::parse_real(name, value, 0.0, 100.0, false);
    } else if (name == "--repetitions") {
      options.repetitions = detail::parse_unsigned(name, value, 3, 1000);
    } else if (name == "--exactness-runs") {
      options.exactness_runs = detail::parse_unsigned(name, value, 0, 10000000);
    } else if (name == "--seed") {
      options.seed = detail::parse_unsigned(name, value, 0, ~std::uint64_t{0});
    } else if (name == "--threads") {
      options.threads = detail::parse_unsigned(name, value, 0, 1024);
    } else if (name == "--html") {
      if (value.empty()) throw usage_error("--html needs a file name");
      options.html = value;
    }
  }
  return options;
}

/// Runs the transformer demo (demo/llama_demo.cpp); returns the exit status. Throws for a
/// model that cannot be loaded.
int run_llama_demo(const LlamaDemoOptions& options);

}  // namespace specdec_demo
