// Greedy code completion with proposal-only drafters: specdec's PromptLookupDrafter and
// NgramDrafter need no draft model at all, they propose continuations of patterns already
// in the context. Code repeats itself, so many proposals are accepted and each target call
// yields several tokens. Greedy speculative decoding returns exactly the target's own greedy
// completion, which the example checks.
//
// The target is a byte-level model of a small code base: it predicts the bytes that
// followed the longest suffix of the context (up to 64 bytes) found in the code base.
#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "specdec/drafters/ngram.hpp"
#include "specdec/drafters/prompt_lookup.hpp"
#include "specdec/greedy_verification.hpp"
#include "specdec/speculative_decoder.hpp"

using specdec::token_id;

constexpr std::string_view code_base = R"(struct Vec3 {
  double x = 0.0;
  double y = 0.0;
  double z = 0.0;
};

Vec3 operator+(const Vec3& a, const Vec3& b) { return {a.x + b.x, a.y + b.y, a.z + b.z}; }
Vec3 operator-(const Vec3& a, const Vec3& b) { return {a.x - b.x, a.y - b.y, a.z - b.z}; }
Vec3 operator*(const Vec3& a, double s) { return {a.x * s, a.y * s, a.z * s}; }
Vec3 operator/(const Vec3& a, double s) { return {a.x / s, a.y / s, a.z / s}; }
double dot(const Vec3& a, const Vec3& b) { return a.x * b.x + a.y * b.y + a.z * b.z; }
Vec3 cross(const Vec3& a, const Vec3& b) {
  return {a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}
double length(const Vec3& a) { return std::sqrt(dot(a, a)); }
Vec3 normalized(const Vec3& a) { return a / length(a); }
)";

// The target M_p: longest-suffix-match statistics of the code base, smoothed over all 256
// byte values so that every row is a full probability vector.
class CodeModel {
 public:
  explicit CodeModel(std::string_view text) : text_(text), row_(256) {}
  [[nodiscard]] std::size_t vocab_size() const { return 256; }

  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    std::vector<double> counts(256, 0.0);
    for (std::size_t length = std::min<std::size_t>(64, context.size()); length > 0; --length) {
      const auto suffix = context.subspan(context.size() - length);
      for (std::size_t end = length; end < text_.size(); ++end) {  // text_[end] follows
        if (std::equal(suffix.begin(), suffix.end(), text_.begin() + (end - length),
                       [](token_id t, char c) { return t == static_cast<unsigned char>(c); }))
          counts[static_cast<unsigned char>(text_[end])] += 1.0;
      }
      if (std::any_of(counts.begin(), counts.end(), [](double c) { return c > 0.0; })) break;
    }
    double total = 0.0;
    for (std::size_t b = 0; b < 256; ++b) total += row_[b] = counts[b] + 0.01;
    for (double& p : row_) p /= total;
    return row_;
  }

  // All gamma + 1 prefixes in one call (a real engine would run them as one batch).
  specdec::RowsView<const double> score_draft(std::span<const token_id> context,
                                              std::span<const token_id> draft) {
    joined_.assign(context.begin(), context.end());
    joined_.insert(joined_.end(), draft.begin(), draft.end());
    rows_.resize((draft.size() + 1) * 256);
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const auto row = next_token_probabilities(std::span(joined_).first(context.size() + i));
      std::copy(row.begin(), row.end(), rows_.begin() + static_cast<std::ptrdiff_t>(i * 256));
    }
    return {rows_.data(), draft.size() + 1, 256};
  }

 private:
  std::string_view text_;
  std::vector<double> row_, rows_;
  std::vector<token_id> joined_;
};
static_assert(specdec::BatchedLanguageModel<CodeModel>);

std::vector<token_id> to_tokens(std::string_view text) {
  std::vector<token_id> tokens;
  for (const char c : text) tokens.push_back(static_cast<unsigned char>(c));
  return tokens;
}

template <class Drafter>
std::vector<token_id> complete(const char* name, CodeModel& target, Drafter& drafter,
                               std::span<const token_id> prompt, std::size_t tokens) {
  specdec::DecoderOptions options;
  options.sampling.temperature = 0.0;  // greedy: exact-match verification
  options.gamma_policy = specdec::FixedGamma{8};
  specdec::SpeculativeDecoder decoder(target, drafter, options);
  const auto result = decoder.generate(prompt, tokens, /*seed=*/0);
  const auto& stats = result.statistics;
  std::printf(
      "%-22s %4zu tokens, %4zu target calls: %5.2f tokens per target call, %4.0f%% of "
      "verified proposals accepted\n",
      name, stats.emitted_tokens, stats.target_calls, stats.tokens_per_target_call(),
      100.0 * stats.mean_beta());
  return result.tokens;
}

int main() {
  CodeModel target(code_base);
  // The file being edited: the code base up to "Vec3 operator-("; the model completes it.
  const std::vector<token_id> prompt =
      to_tokens(code_base.substr(0, code_base.find("Vec3 operator-(") + 15));
  const std::size_t new_tokens = 400;

  // Plain greedy decoding: one target call per token.
  std::vector<token_id> plain(prompt);
  for (std::size_t i = 0; i < new_tokens; ++i)
    plain.push_back(specdec::argmax(target.next_token_probabilities(plain)));
  const std::span<const token_id> expected = std::span(plain).subspan(prompt.size());
  std::printf("%-22s %4zu tokens, %4zu target calls:  1.00 tokens per target call\n",
              "plain greedy decoding", new_tokens, new_tokens);

  specdec::PromptLookupDrafter lookup({.min_ngram = 2, .max_ngram = 12});
  specdec::NgramDrafter ngram({.max_order = 8, .window = 4096});
  const auto by_lookup = complete("prompt lookup", target, lookup, prompt, new_tokens);
  const auto by_ngram = complete("n-gram drafter", target, ngram, prompt, new_tokens);
  const bool identical =
      std::ranges::equal(by_lookup, expected) && std::ranges::equal(by_ngram, expected);
  std::printf(
      "\nidentical to plain greedy decoding: %s\n\nthe prompt ends in \"Vec3 operator-(\"; the "
      "completion:\n%s\n",
      identical ? "yes" : "NO",
      std::string(plain.begin() + static_cast<std::ptrdiff_t>(prompt.size()), plain.end()).c_str());
  return identical ? 0 : 1;
}
