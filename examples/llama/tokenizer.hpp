// The tokenizer stored in a GGUF file: llama.cpp's "llama" (SentencePiece) model.
//
// Encoding follows llama.cpp's SPM tokenizer: spaces become U+2581 (with one prepended
// when tokenizer.ggml.add_space_prefix is true, llama.cpp's default); the text is split
// into UTF-8 characters; the adjacent pair whose concatenation is a vocabulary string with
// the highest score is merged (ties: the leftmost) until no pair merges; a symbol that is
// not a token is emitted as its bytes' <0xXX> tokens (or <unk> without byte tokens).
// Decoding maps U+2581 back to a space and byte tokens to their bytes; control tokens
// decode to nothing.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "gguf.hpp"

namespace llama {

using token = std::int32_t;

/// llama.cpp's token types (tokenizer.ggml.token_type).
enum class token_kind : std::int32_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

class Tokenizer {
 public:
  static constexpr std::string_view space_marker = "\xE2\x96\x81";  // U+2581

  Tokenizer() = default;

  /// Reads tokenizer.ggml.* from `file`. Throws model_error for a missing or malformed
  /// vocabulary. A tokenizer model other than "llama" (e.g. "gpt2" BPE) loads: its vocabulary
  /// serves generation from token ids and check_pair; encode() throws model_error for it.
  explicit Tokenizer(const GgufFile& file) {
    const std::string model = file.string("tokenizer.ggml.model");
    if (model != "llama") {
      path_ = file.path();
      unsupported_ = "tokenizer.ggml.model is \"" + model +
                     "\": this engine implements the SentencePiece tokenizer (\"llama\") only; "
                     "use token ids (--prompt-ids) with this model";
    }
    tokens_ = file.array("tokenizer.ggml.tokens", value_type::string).strings;
    if (tokens_.empty()) file.fail("tokenizer.ggml.tokens is empty");
    const std::size_t n = tokens_.size();
    if (file.find("tokenizer.ggml.scores") != nullptr) {
      scores_.assign(file.array("tokenizer.ggml.scores", value_type::float32).reals.begin(),
                     file.array("tokenizer.ggml.scores", value_type::float32).reals.end());
      if (scores_.size() != n) {
        file.fail("tokenizer.ggml.scores has " + std::to_string(scores_.size()) + " entries for " +
                  std::to_string(n) + " tokens");
      }
      // The merge queue orders by score: a NaN breaks its strict weak ordering.
      for (std::size_t i = 0; i < n; ++i) {
        if (std::isnan(scores_[i])) {
          file.fail("tokenizer.ggml.scores entry " + std::to_string(i) + " (token \"" + tokens_[i] +
                    "\") is NaN");
        }
      }
    } else {
      scores_.assign(n, 0.0);
    }
    kinds_.assign(n, token_kind::normal);
    if (file.find("tokenizer.ggml.token_type") != nullptr) {
      const auto& types = file.array("tokenizer.ggml.token_type", value_type::int32).integers;
      if (types.size() != n) {
        file.fail("tokenizer.ggml.token_type has " + std::to_string(types.size()) +
                  " entries for " + std::to_string(n) + " tokens");
      }
      for (std::size_t i = 0; i < n; ++i) kinds_[i] = static_cast<token_kind>(types[i]);
    }
    const auto id = [&](std::string_view key,
                        std::optional<token> fallback) -> std::optional<token> {
      const auto value = file.optional_unsigned(key);
      if (!value) return fallback;
      if (*value >= n) {
        file.fail(std::string(key) + " is " + std::to_string(*value) + ", outside the " +
                  std::to_string(n) + "-token vocabulary");
      }
      return static_cast<token>(*value);
    };
    bos_ = id("tokenizer.ggml.bos_token_id", n > 1 ? std::optional<token>(1) : std::nullopt);
    eos_ = id("tokenizer.ggml.eos_token_id", n > 2 ? std::optional<token>(2) : std::nullopt);
    unk_ = id("tokenizer.ggml.unknown_token_id", std::optional<token>(0));
    add_bos_ = file.optional_bool("tokenizer.ggml.add_bos_token").value_or(true);
    add_eos_ = file.optional_bool("tokenizer.ggml.add_eos_token").value_or(false);
    add_space_prefix_ = file.optional_bool("tokenizer.ggml.add_space_prefix").value_or(true);
    ids_.reserve(n);
    // A string listed twice maps to its last id, as in llama.cpp.
    for (std::size_t i = 0; i < n; ++i) ids_[tokens_[i]] = static_cast<token>(i);
    byte_tokens_.fill(-1);
    for (unsigned b = 0; b < 256; ++b) {
      const auto it = ids_.find(byte_name(b));
      if (it != ids_.end()) byte_tokens_[b] = it->second;
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return tokens_.size(); }
  [[nodiscard]] std::optional<token> bos() const noexcept { return bos_; }
  [[nodiscard]] std::optional<token> eos() const noexcept { return eos_; }
  [[nodiscard]] bool add_space_prefix() const noexcept { return add_space_prefix_; }
  /// Whether encode() can serve this vocabulary (tokenizer.ggml.model "llama").
  [[nodiscard]] bool encodes_text() const noexcept { return unsupported_.empty(); }
  [[nodiscard]] const std::string& text(token id) const {
    return tokens_.at(static_cast<std::size_t>(id));
  }
  [[nodiscard]] std::span<const std::string> tokens() const noexcept { return tokens_; }
  [[nodiscard]] token_kind kind(token id) const { return kinds_.at(static_cast<std::size_t>(id)); }

  /// The token ids of `text`, with BOS first when the file asks for it (add_bos_token,
  /// true by default) and `add_special` is true. Throws model_error for a tokenizer model
  /// other than "llama".
  [[nodiscard]] std::vector<token> encode(std::string_view text, bool add_special = true) const {
    if (!unsupported_.empty()) throw model_error(path_, unsupported_);
    std::vector<token> out;
    if (add_special && add_bos_ && bos_) out.push_back(*bos_);
    if (!text.empty()) {
      std::string escaped;
      if (add_space_prefix_) escaped += space_marker;
      for (const char c : text) {
        if (c == ' ') {
          escaped += space_marker;
        } else {
          escaped += c;
        }
      }
      encode_spm(escaped, out);
    }
    if (add_special && add_eos_ && eos_) out.push_back(*eos_);
    return out;
  }

  /// The bytes token `id` stands for: its text with U+2581 as spaces, a byte token's byte,
  /// nothing for control, unknown and unused tokens.
  [[nodiscard]] std::string piece(token id) const {
    const auto i = static_cast<std::size_t>(id);
    if (i >= tokens_.size()) return {};
    switch (kinds_[i]) {
      case token_kind::control:
      case token_kind::unknown:
      case token_kind::unused:
        return {};
      case token_kind::byte: {
        const std::string& t = tokens_[i];
        // Two hex digits, checked first: std::stoi throws std::invalid_argument for "<0xZZ>".
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
            std::isxdigit(static_cast<unsigned char>(t[3])) != 0 &&
            std::isxdigit(static_cast<unsigned char>(t[4])) != 0) {
          return std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
        }
        return {};
      }
      default:
        break;
    }
    std::string out;
    const std::string& t = tokens_[i];
    for (std::size_t at = 0; at < t.size();) {
      if (t.compare(at, space_marker.size(), space_marker) == 0) {
        out += ' ';
        at += space_marker.size();
      } else {
        out += t[at++];
      }
    }
    return out;
  }

  /// The text of a token sequence (as generated: without the space prefix encode() added
  /// when `strip_space_prefix` and add_space_prefix are true).
  [[nodiscard]] std::string decode(std::span<const token> ids,
                                   bool strip_space_prefix = true) const {
    std::string out;
    for (const token id : ids) out += piece(id);
    if (strip_space_prefix && add_space_prefix_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
    return out;
  }

 private:
  static std::string byte_name(unsigned b) {
    const char* digits = "0123456789ABCDEF";
    return std::string("<0x") + digits[b >> 4U] + digits[b & 15U] + ">";
  }

  // llama.cpp's rule: the length of a UTF-8 sequence by the lead byte's high four bits
  // (continuation and invalid bytes count as a symbol of their own, 0xF8-0xFF as four).
  static std::size_t utf8_length(unsigned char lead) noexcept {
    static constexpr std::array<std::size_t, 16> lengths = {1, 1, 1, 1, 1, 1, 1, 1,
                                                            1, 1, 1, 1, 2, 2, 3, 4};
    return lengths[lead >> 4U];
  }

  struct Symbol {
    std::size_t start = 0;
    std::size_t length = 0;  // bytes; 0 once merged into the symbol on its left
    long prev = -1;
    long next = -1;
  };
  struct Bigram {
    double score = 0.0;
    long left = 0;
    long right = 0;
    std::size_t length = 0;
    // priority_queue pops the largest: the higher score, then the smaller left index
    bool operator<(const Bigram& other) const noexcept {
      return score < other.score || (score == other.score && left > other.left);
    }
  };

  void encode_spm(const std::string& text, std::vector<token>& out) const {
    std::vector<Symbol> symbols;
    for (std::size_t at = 0; at < text.size();) {
      const std::size_t length =
          std::min(utf8_length(static_cast<unsigned char>(text[at])), text.size() - at);
      const auto index = static_cast<long>(symbols.size());
      symbols.push_back({at, length, index - 1, at + length == text.size() ? -1 : index + 1});
      at += length;
    }
    std::priority_queue<Bigram> queue;
    const auto try_add = [&](long left, long right) {
      if (left < 0 || right < 0) return;
      const Symbol& l = symbols[static_cast<std::size_t>(left)];
      const Symbol& r = symbols[static_cast<std::size_t>(right)];
      const auto it = ids_.find(std::string_view(text).substr(l.start, l.length + r.length));
      if (it == ids_.end()) return;
      queue.push({scores_[static_cast<std::size_t>(it->second)], left, right, l.length + r.length});
    };
    for (std::size_t i = 1; i < symbols.size(); ++i) {
      try_add(static_cast<long>(i) - 1, static_cast<long>(i));
    }
    while (!queue.empty()) {
      const Bigram bigram = queue.top();
      queue.pop();
      Symbol& left = symbols[static_cast<std::size_t>(bigram.left)];
      Symbol& right = symbols[static_cast<std::size_t>(bigram.right)];
      if (left.length == 0 || right.length == 0 || left.length + right.length != bigram.length) {
        continue;  // outdated: one side was merged since
      }
      left.length += right.length;
      right.length = 0;
      left.next = right.next;
      if (right.next >= 0) symbols[static_cast<std::size_t>(right.next)].prev = bigram.left;
      try_add(left.prev, bigram.left);
      try_add(bigram.left, left.next);
    }
    for (long i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[static_cast<std::size_t>(i)].next) {
      const Symbol& s = symbols[static_cast<std::size_t>(i)];
      const std::string_view piece = std::string_view(text).substr(s.start, s.length);
      const auto it = ids_.find(piece);
      if (it != ids_.end()) {
        out.push_back(it->second);
        continue;
      }
      // Merged symbols are vocabulary strings, so only single characters get here.
      for (const char c : piece) {
        const token b = byte_tokens_[static_cast<unsigned char>(c)];
        if (b >= 0) {
          out.push_back(b);
        } else if (unk_) {
          out.push_back(*unk_);
        }
      }
    }
  }

  struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };

  std::vector<std::string> tokens_;
  std::vector<double> scores_;
  std::vector<token_kind> kinds_;
  std::unordered_map<std::string, token, StringHash, std::equal_to<>> ids_;
  std::array<token, 256> byte_tokens_{};
  std::optional<token> bos_, eos_, unk_;
  bool add_bos_ = true;
  bool add_eos_ = false;
  bool add_space_prefix_ = true;
  std::string path_, unsupported_;  // the file and why encode() cannot serve it; empty: it can
};

}  // namespace llama
