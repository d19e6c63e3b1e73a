// llama_generate: runs a llama-architecture GGUF model with plain or speculative decoding.
//
//   llama_generate                                  the shipped pair on a built-in prompt
//   llama_generate --model target.gguf --draft draft.gguf --prompt "def main():" -n 64
//   llama_generate --model m.gguf --drafter prompt-lookup --temperature 0 --stats
//   llama_generate --model m.gguf --plain --ids --seed 3
//   llama_generate --prompt "print(" --balanced --seed 2
//   llama_generate --prompt "def" --regex ' [a-z_]+\(([a-z_]+(, [a-z_]+)*)?\):' --temperature 0
//
// Run with --help for every option. The generated text goes to stdout (the prompt first);
// --stats prints the measurements to stderr.
#include <array>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "llama/constraints.hpp"
#include "llama/generate.hpp"
#include "specdec/constrained_model.hpp"
#include "specdec/error.hpp"
#include "specdec/token_dfa.hpp"

#ifndef SPECDEC_LLAMA_MODELS
#define SPECDEC_LLAMA_MODELS "examples/llama/models"
#endif

namespace {

constexpr std::string_view default_prompt =
    "import os\n\n\ndef list_files(directory):\n"
    "    \"\"\"Return the names of the regular files in directory.\"\"\"\n";

constexpr std::string_view usage = R"(usage: llama_generate [options]

Generates text with a llama-architecture GGUF model (llama.cpp's format), with plain
decoding or with specdec's speculative decoding. Without options it runs the shipped
target/draft pair (examples/llama/models) on a built-in prompt.

models and drafting:
  --model FILE         target model (default: the shipped target.gguf)
  --draft FILE         draft model for the model, tree and controller drafters
                       (default: the shipped draft.gguf when --model is not given)
  --drafter KIND       model (default with a draft model), ngram, prompt-lookup, tree,
                       controller (the draft model with the optimal-gamma controller);
                       without a draft model the default is prompt-lookup
  --plain              plain decoding of the target, no speculation (the baseline)
  --gamma N            draft tokens per step (default 4)
  --tree-shape LIST    token tree for --drafter tree: children per depth, e.g. 2,2,1
                       (default: a chain of 4 with second candidates at depths 1 and 2)
  --ctx N              KV cache positions (default: the model's context length)
  --threads N          threads for the matrix products (default 0: one per hardware
                       thread; 1: the calling thread only). Output does not depend on it.

prompt and sampling:
  --prompt TEXT        prompt text (encoded with the model's tokenizer, BOS first)
  --prompt-ids LIST    prompt as token ids, e.g. "1 405 22" (no tokenizer needed)
  -n N                 tokens to generate (default 128)
  --temperature T      0 selects greedy decoding (default 1)
  --top-k K            keep the K likeliest tokens (0: all)
  --top-p P            keep the smallest set with mass >= P (1: all)
  --seed S             random seed (default 0)
  --verification RULE  automatic (default: block verification for model drafts at T > 0,
                       traversal verification for --drafter tree), token (Algorithm 1,
                       recursive rejection for trees) or block
  --ignore-eos         do not stop at the end-of-sequence token

constrained sampling (applied alike to the target's and the draft model's rows; plain
decoding draws from the same constrained target rows; combinable with every drafter):
  --regex PATTERN      the generated text (not the prompt) must match PATTERN in full:
                       </s> is allowed exactly where the text so far is a full match, and
                       generation stops at it. Syntax (over bytes): literals, ., [...]
                       [^...], \d \w \s (\D \W \S), \n \t \xHH, groups (...) (?:...), |,
                       * + ? {m} {m,} {m,n}; no anchors (the whole text always matches)
  --balanced           keep the brackets ()[]{} valid: generate until the brackets left
                       open (by the prompt or by the generated text) are closed, then </s>
                       (</s> is also allowed while no bracket is open). Every bracket byte
                       counts, also inside string literals; at most 32 open
  --logit-bias ID=B    add B (in [-100, 100], or -inf to ban) to token ID's logit before
                       temperature and truncation; repeatable or a comma list: 13=2,40=-1
  --ban ID             never generate token ID; repeatable or a comma list
  (--regex and --balanced may be combined; a state where they allow no common token is
  reported as an error. Both need the SentencePiece tokenizer and </s>, and end at </s>:
  not with --ignore-eos)

output:
  --ids                print only the generated token ids, space-separated, one line
  --stats              print alpha, tokens per target call, tokens/s, ... to stderr
  -h, --help           this text
)";

struct Arguments {
  std::string model, draft, prompt = std::string(default_prompt), prompt_ids;
  std::optional<llama::drafter_kind> drafter;
  bool plain = false, ids = false, stats = false, ignore_eos = false;
  bool model_given = false, draft_given = false;
  std::size_t n = 128, gamma = 4, ctx = 0, threads = 0;
  double temperature = 1.0, top_p = 1.0;
  std::size_t top_k = 0;
  std::uint64_t seed = 0;
  std::vector<std::size_t> tree_shape;
  specdec::verification_rule verification = specdec::verification_rule::automatic;
  std::string regex;
  std::optional<specdec::ByteDfa> dfa;  // --regex, compiled
  bool balanced = false;
  std::vector<specdec::LogitBias> logit_bias;
  std::vector<std::size_t> banned;
  [[nodiscard]] bool constrained() const {
    return dfa.has_value() || balanced || !logit_bias.empty() || !banned.empty();
  }
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "llama_generate: %s\n(run with --help for the options)\n", message.c_str());
  std::exit(2);
}

std::size_t parse_size(std::string_view flag, const std::string& text) {
  try {
    std::size_t used = 0;
    const unsigned long long value = std::stoull(text, &used);
    if (used == text.size() && text[0] != '-') return static_cast<std::size_t>(value);
  } catch (const std::exception&) {
  }
  usage_error(std::string(flag) + " expects a non-negative integer, got \"" + text + "\"");
}

double parse_real(std::string_view flag, const std::string& text) {
  try {
    std::size_t used = 0;
    const double value = std::stod(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  usage_error(std::string(flag) + " expects a number, got \"" + text + "\"");
}

std::vector<std::size_t> parse_list(std::string_view flag, std::string text) {
  for (char& c : text) {
    if (c == ',') c = ' ';
  }
  std::istringstream in(text);
  std::vector<std::size_t> out;
  std::string item;
  while (in >> item) out.push_back(parse_size(flag, item));
  if (out.empty()) usage_error(std::string(flag) + " expects a list of integers");
  return out;
}

// "ID=B" items, comma- or space-separated.
void parse_logit_bias(const std::string& text, std::vector<specdec::LogitBias>& out) {
  std::string items = text;
  for (char& c : items) {
    if (c == ',') c = ' ';
  }
  std::istringstream in(items);
  std::string item;
  bool any = false;
  while (in >> item) {
    const std::size_t equals = item.find('=');
    if (equals == std::string::npos || equals == 0 || equals + 1 == item.size()) {
      usage_error("--logit-bias expects ID=BIAS items (e.g. 13=-2.5,40=1), got \"" + item + "\"");
    }
    const std::size_t id = parse_size("--logit-bias (token id)", item.substr(0, equals));
    const double bias = parse_real("--logit-bias (bias)", item.substr(equals + 1));
    if (!(bias == -std::numeric_limits<double>::infinity() || (bias >= -100.0 && bias <= 100.0))) {
      usage_error("--logit-bias: the bias of token " + std::to_string(id) + " is " +
                  item.substr(equals + 1) + ", it must be in [-100, 100] or -inf");
    }
    if (id > static_cast<std::size_t>(std::numeric_limits<specdec::token_id>::max())) {
      usage_error("--logit-bias: token id " + std::to_string(id) + " is too large");
    }
    out.push_back({static_cast<specdec::token_id>(id), bias});
    any = true;
  }
  if (!any) usage_error("--logit-bias expects ID=BIAS items (e.g. 13=-2.5)");
}

Arguments parse(int argc, char** argv) {
  Arguments a;
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    const auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) usage_error(flag + " needs a value");
      return args[++i];
    };
    if (flag == "-h" || flag == "--help") {
      std::fputs(usage.data(), stdout);
      std::exit(0);
    } else if (flag == "--model") {
      a.model = value();
      a.model_given = true;
    } else if (flag == "--draft") {
      a.draft = value();
      a.draft_given = true;
    } else if (flag == "--drafter") {
      const std::string& name = value();
      a.drafter = llama::parse_drafter(name);
      if (!a.drafter) {
        usage_error("unknown drafter \"" + name +
                    "\" (model, ngram, prompt-lookup, tree, controller)");
      }
    } else if (flag == "--plain") {
      a.plain = true;
    } else if (flag == "--prompt") {
      a.prompt = value();
    } else if (flag == "--prompt-ids") {
      a.prompt_ids = value();
    } else if (flag == "-n") {
      a.n = parse_size(flag, value());
    } else if (flag == "--verification") {
      const std::string& name = value();
      if (name == "automatic") {
        a.verification = specdec::verification_rule::automatic;
      } else if (name == "token") {
        a.verification = specdec::verification_rule::token;
      } else if (name == "block") {
        a.verification = specdec::verification_rule::block;
      } else {
        usage_error("--verification expects automatic, token or block, got \"" + name + "\"");
      }
    } else if (flag == "--temperature") {
      a.temperature = parse_real(flag, value());
    } else if (flag == "--top-k") {
      a.top_k = parse_size(flag, value());
    } else if (flag == "--top-p") {
      a.top_p = parse_real(flag, value());
    } else if (flag == "--seed") {
      a.seed = parse_size(flag, value());
    } else if (flag == "--gamma") {
      a.gamma = parse_size(flag, value());
      if (a.gamma == 0) usage_error("--gamma must be at least 1");
    } else if (flag == "--tree-shape") {
      a.tree_shape = parse_list(flag, value());
    } else if (flag == "--ctx") {
      a.ctx = parse_size(flag, value());
    } else if (flag == "--threads") {
      a.threads = parse_size(flag, value());
    } else if (flag == "--ids") {
      a.ids = true;
    } else if (flag == "--stats") {
      a.stats = true;
    } else if (flag == "--ignore-eos") {
      a.ignore_eos = true;
    } else if (flag == "--regex") {
      a.regex = value();
      try {
        a.dfa.emplace(specdec::ByteDfa::compile(a.regex));
      } catch (const specdec::error& failure) {
        usage_error(std::string("--regex: ") + failure.what());
      }
    } else if (flag == "--balanced") {
      a.balanced = true;
    } else if (flag == "--logit-bias") {
      parse_logit_bias(value(), a.logit_bias);
    } else if (flag == "--ban") {
      for (const std::size_t id : parse_list(flag, value())) a.banned.push_back(id);
    } else {
      usage_error("unknown option " + flag);
    }
  }
  const std::string models = SPECDEC_LLAMA_MODELS;
  if (!a.model_given) {
    a.model = models + "/target.gguf";
    if (!a.draft_given) a.draft = models + "/draft.gguf";
  }
  if (a.plain && (a.drafter || a.draft_given))
    usage_error("--plain takes no draft model or drafter");
  if (!a.drafter) {
    a.drafter = a.draft.empty() ? llama::drafter_kind::prompt_lookup : llama::drafter_kind::model;
  }
  if (!a.plain && llama::uses_draft_model(*a.drafter) && a.draft.empty()) {
    usage_error("--drafter " + std::string(llama::to_string(*a.drafter)) +
                " needs a draft model (--draft FILE)");
  }
  if (!a.tree_shape.empty() && *a.drafter != llama::drafter_kind::tree) {
    usage_error("--tree-shape is for --drafter tree");
  }
  if ((a.dfa || a.balanced) && a.ignore_eos) {
    usage_error(std::string(a.dfa ? "--regex" : "--balanced") +
                " ends the text with </s>: it cannot be combined with --ignore-eos");
  }
  return a;
}

// Prints token pieces as they come, holding back an incomplete UTF-8 sequence (byte
// tokens split characters) until its last byte arrives.
class TextStream {
 public:
  explicit TextStream(const llama::Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  void put(specdec::token_id token) {
    pending_ += tokenizer_->piece(token);
    std::size_t complete = pending_.size();
    // Find the start of a trailing incomplete sequence, if any.
    for (std::size_t back = 1; back <= 4 && back <= pending_.size(); ++back) {
      const auto c = static_cast<unsigned char>(pending_[pending_.size() - back]);
      if ((c & 0xC0U) == 0x80U) continue;  // continuation byte
      std::size_t need = 1;
      if ((c & 0xE0U) == 0xC0U) need = 2;
      if ((c & 0xF0U) == 0xE0U) need = 3;
      if ((c & 0xF8U) == 0xF0U) need = 4;
      if (need > back) complete = pending_.size() - back;
      break;
    }
    std::fwrite(pending_.data(), 1, complete, stdout);
    std::fflush(stdout);
    pending_.erase(0, complete);
  }
  void finish() {
    std::fwrite(pending_.data(), 1, pending_.size(), stdout);
    pending_.clear();
    std::fflush(stdout);
  }

 private:
  const llama::Tokenizer* tokenizer_;
  std::string pending_;
};

using Rules = specdec::ConstrainedSampling<llama::TextConstraint>;

// The constrained sampling of --regex, --balanced, --logit-bias and --ban: one
// ConstrainedSampling whose adapters wrap the target and the draft model. Bad ids and
// patterns no token sequence can complete are usage errors.
Rules make_rules(const Arguments& a, const llama::Model& model,
                 std::span<const specdec::token_id> prompt) {
  const std::size_t vocab = model.config().vocab;
  const auto check_id = [&](std::string_view flag, std::size_t id) {
    if (id >= vocab) {
      usage_error(std::string(flag) + ": token id " + std::to_string(id) +
                  " is outside the vocabulary of " + std::to_string(vocab) + " tokens");
    }
    return static_cast<specdec::token_id>(id);
  };
  specdec::BiasOptions bias;
  for (const specdec::LogitBias& entry : a.logit_bias) {
    check_id("--logit-bias", static_cast<std::size_t>(entry.token));
    bias.logit_bias.push_back(entry);
  }
  for (const std::size_t id : a.banned) bias.banned_tokens.push_back(check_id("--ban", id));
  std::optional<specdec::TokenDfa> regex;
  std::optional<llama::BalancedBrackets> brackets;
  if (a.dfa || a.balanced) {
    const char* flag = a.dfa ? "--regex" : "--balanced";
    const llama::Tokenizer& tokenizer = model.tokenizer();
    if (!tokenizer.encodes_text()) {
      usage_error(std::string(flag) +
                  " needs the SentencePiece (\"llama\") tokenizer: this model's token texts are "
                  "not the bytes they decode to");
    }
    if (!tokenizer.eos()) usage_error(std::string(flag) + " needs an end-of-sequence token");
    const std::vector<std::string> strings = llama::token_strings(tokenizer);
    const std::array<specdec::token_id, 1> ends{*tokenizer.eos()};
    if (a.dfa) {
      try {
        regex.emplace(*a.dfa, strings, ends);
      } catch (const specdec::error& failure) {
        usage_error("--regex \"" + a.regex + "\": " + failure.what());
      }
    }
    if (a.balanced) {
      try {
        // The brackets the prompt leaves open have to be closed too.
        brackets.emplace(strings, ends, tokenizer.decode(prompt));
      } catch (const std::invalid_argument& failure) {
        usage_error(std::string("--balanced: ") + failure.what());
      }
    }
  }
  return Rules(vocab, llama::TextConstraint(std::move(regex), std::move(brackets)),
               std::move(bias));
}

std::string describe(const Arguments& a, const Rules& rules) {
  std::string out;
  const auto add = [&out](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
  const llama::TextConstraint& c = rules.constraint();
  if (c.regex()) {
    add("regex \"" + a.regex + "\" (" + std::to_string(c.regex()->state_count()) +
        " token-automaton states)");
  }
  if (c.brackets()) {
    add("balanced brackets (" + std::to_string(c.brackets()->bracket_token_count()) + " of " +
        std::to_string(c.brackets()->vocab_size()) + " tokens contain one)");
  }
  if (!a.logit_bias.empty()) add(std::to_string(a.logit_bias.size()) + " logit biases");
  if (!a.banned.empty()) add(std::to_string(a.banned.size()) + " banned tokens");
  return out;
}

void print_ids(std::span<const specdec::token_id> tokens) {
  for (std::size_t i = 0; i < tokens.size(); ++i) std::printf("%s%d", i ? " " : "", tokens[i]);
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  Arguments a = parse(argc, argv);
  try {
    const llama::Model target_model(a.model);
    std::optional<llama::Model> draft_model;
    const bool speculative = !a.plain;
    if (speculative && llama::uses_draft_model(*a.drafter)) {
      draft_model.emplace(a.draft);
      llama::check_pair(target_model, *draft_model);
    }
    const llama::Tokenizer& tokenizer = target_model.tokenizer();
    if (!tokenizer.encodes_text() && !a.ids) {
      // Without the SentencePiece tokenizer the pieces are not text this program can show.
      std::fprintf(stderr,
                   "llama_generate: %s has no SentencePiece (\"llama\") tokenizer: "
                   "printing token ids\n",
                   a.model.c_str());
      a.ids = true;
    }
    std::vector<specdec::token_id> prompt;
    if (!a.prompt_ids.empty()) {
      for (const std::size_t id : parse_list("--prompt-ids", a.prompt_ids)) {
        if (id >= target_model.config().vocab) {
          usage_error("--prompt-ids: id " + std::to_string(id) + " is outside the vocabulary of " +
                      std::to_string(target_model.config().vocab) + " tokens");
        }
        prompt.push_back(static_cast<specdec::token_id>(id));
      }
    } else {
      prompt = tokenizer.encode(a.prompt);
    }
    if (prompt.empty()) usage_error("the prompt is empty (the model has no BOS token)");
    std::optional<Rules> rules;
    if (a.constrained()) rules.emplace(make_rules(a, target_model, prompt));

    llama::RunOptions options;
    options.sampling.temperature = a.temperature;
    options.sampling.top_k = a.top_k;
    options.sampling.top_p = a.top_p;
    options.max_new_tokens = a.n;
    options.seed = a.seed;
    options.gamma = a.gamma;
    options.verification = a.verification;
    if (!a.tree_shape.empty()) options.tree_shape = specdec::TreeShape::branching(a.tree_shape);
    if (!a.ignore_eos && tokenizer.eos()) options.stop_tokens.push_back(*tokenizer.eos());
    options.sampling.validate();

    TextStream text(tokenizer);
    std::vector<specdec::token_id> streamed;
    options.on_token = [&](const specdec::EmittedToken& emitted) {
      streamed.push_back(emitted.token);
      if (!a.ids) text.put(emitted.token);
    };
    if (!a.ids) {
      std::fputs(tokenizer.decode(prompt).c_str(), stdout);
      std::fflush(stdout);
    }

    llama::ThreadPool pool(a.threads);
    llama::Engine target(target_model, a.ctx, &pool);
    std::optional<llama::Engine> draft;
    if (draft_model) draft.emplace(*draft_model, a.ctx, &pool);
    llama::RunResult result;
    try {
      llama::Engine* draft_engine = draft ? &*draft : nullptr;
      if (rules) {  // plain decoding draws from the same constrained target rows
        result = a.plain ? llama::generate_plain_constrained(target, *rules, prompt, options)
                         : llama::generate_speculative_constrained(target, draft_engine, *a.drafter,
                                                                   *rules, prompt, options);
      } else {
        result = a.plain ? llama::generate_plain(target, prompt, options)
                         : llama::generate_speculative(target, draft_engine, *a.drafter, prompt,
                                                       options);
      }
    } catch (const std::exception& failure) {
      // Keep what was generated before the failure.
      if (a.ids) {
        print_ids(streamed);
      } else {
        text.finish();
        std::printf("\n");
      }
      std::fprintf(stderr, "llama_generate: generation stopped after %zu tokens: %s\n",
                   streamed.size(), failure.what());
      return 1;
    }
    if (a.ids) {
      print_ids(result.tokens);
    } else {
      text.finish();
      std::printf("\n");
    }
    if ((a.dfa || a.balanced) && result.stop != specdec::stop_reason::stop_token) {
      std::fflush(stdout);
      std::fprintf(stderr,
                   "llama_generate: note: stopped after %zu tokens (-n) before the constraint "
                   "ended the text with </s>: the text is incomplete\n",
                   result.tokens.size());
    }
    if (a.stats) {
      const auto& s = result.statistics;
      std::fprintf(
          stderr, "mode: %s\n",
          a.plain ? "plain"
                  : ("speculative, drafter " + std::string(llama::to_string(*a.drafter))).c_str());
      if (rules) std::fprintf(stderr, "constraint: %s\n", describe(a, *rules).c_str());
      std::fprintf(stderr, "threads: %zu\n", pool.size());
      std::fprintf(stderr, "tokens: %zu in %.3f s: %.1f tokens/s (stop: %s)\n",
                   result.tokens.size(), result.seconds, result.tokens_per_second(),
                   std::string(specdec::to_string(result.stop)).c_str());
      std::fprintf(stderr, "target: %zu forward passes, %.2f tokens per target call\n",
                   result.target.forward_passes,
                   result.target.forward_passes
                       ? static_cast<double>(result.tokens.size()) /
                             static_cast<double>(result.target.forward_passes)
                       : 0.0);
      if (!a.plain) {
        std::fprintf(stderr,
                     "steps: %zu, drafted %zu, accepted %zu (%.3f), alpha (mean beta) %.3f, "
                     "tokens per step %.2f\n",
                     s.steps, s.drafted_tokens, s.accepted_tokens, s.acceptance_rate(),
                     s.mean_beta(), s.tokens_per_step());
        if (draft) {
          std::fprintf(stderr, "draft: %zu forward passes\n", result.draft.forward_passes);
        }
      }
    }
  } catch (const llama::model_error& failure) {
    std::fprintf(stderr, "llama_generate: %s\n", failure.what());
    return 1;
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "llama_generate: %s\n", failure.what());
    return 1;
  }
  return 0;
}
