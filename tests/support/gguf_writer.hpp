// Test support: writes GGUF files (version 3) — tiny random llama models for the engine
// tests, and malformed files for the error tests (the writer puts down whatever it is told,
// so a test can declare a wrong shape, an unknown type or a bad offset).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <unistd.h>

#include "llama/model.hpp"
#include "specdec/random.hpp"

namespace specdec::testing {

/// Collects metadata and tensors, then serialises them (bytes() / write()).
class GgufWriter {
 public:
  // ---- metadata -------------------------------------------------------------------------
  void add_u32(const std::string& key, std::uint32_t v) { scalar(key, 4, &v, 4); }
  void add_i32(const std::string& key, std::int32_t v) { scalar(key, 5, &v, 4); }
  void add_f32(const std::string& key, float v) { scalar(key, 6, &v, 4); }
  void add_u8(const std::string& key, std::uint8_t v) { scalar(key, 0, &v, 1); }
  void add_i8(const std::string& key, std::int8_t v) { scalar(key, 1, &v, 1); }
  void add_u16(const std::string& key, std::uint16_t v) { scalar(key, 2, &v, 2); }
  void add_i16(const std::string& key, std::int16_t v) { scalar(key, 3, &v, 2); }
  void add_u64(const std::string& key, std::uint64_t v) { scalar(key, 10, &v, 8); }
  void add_i64(const std::string& key, std::int64_t v) { scalar(key, 11, &v, 8); }
  void add_f64(const std::string& key, double v) { scalar(key, 12, &v, 8); }
  void add_bool(const std::string& key, bool v) {
    const std::uint8_t b = v ? 1 : 0;
    scalar(key, 7, &b, 1);
  }
  void add_string(const std::string& key, const std::string& v) {
    key_(key);
    put_u32(8);
    string_(v);
    ++metadata_count_;
  }
  void add_strings(const std::string& key, const std::vector<std::string>& v) {
    key_(key);
    put_u32(9);
    put_u32(8);
    put_u64(v.size());
    for (const std::string& s : v) string_(s);
    ++metadata_count_;
  }
  void add_f32s(const std::string& key, const std::vector<float>& v) {
    key_(key);
    put_u32(9);
    put_u32(6);
    put_u64(v.size());
    for (const float f : v) raw(&f, 4);
    ++metadata_count_;
  }
  void add_i32s(const std::string& key, const std::vector<std::int32_t>& v) {
    key_(key);
    put_u32(9);
    put_u32(5);
    put_u64(v.size());
    for (const std::int32_t i : v) raw(&i, 4);
    ++metadata_count_;
  }
  /// A metadata entry with raw bytes after its type (for malformed files).
  void add_raw(const std::string& key, std::uint32_t type,
               const std::vector<unsigned char>& bytes) {
    key_(key);
    put_u32(type);
    raw(bytes.data(), bytes.size());
    ++metadata_count_;
  }

  /// Removes every metadata entry named `key` (to leave a key out of a model that
  /// add_tiny_llama wrote, or to add it again with another type); false when there is none.
  bool remove_metadata(const std::string& key) {
    bool removed = false;
    for (std::size_t i = entry_starts_.size(); i-- > 0;) {
      if (entry_starts_[i].first != key) continue;
      const std::size_t begin = entry_starts_[i].second;
      const std::size_t end =
          i + 1 < entry_starts_.size() ? entry_starts_[i + 1].second : metadata_.size();
      metadata_.erase(metadata_.begin() + static_cast<std::ptrdiff_t>(begin),
                      metadata_.begin() + static_cast<std::ptrdiff_t>(end));
      for (std::size_t j = i + 1; j < entry_starts_.size(); ++j) {
        entry_starts_[j].second -= end - begin;
      }
      entry_starts_.erase(entry_starts_.begin() + static_cast<std::ptrdiff_t>(i));
      --metadata_count_;
      removed = true;
    }
    return removed;
  }

  // ---- tensors --------------------------------------------------------------------------
  /// Pads the tensor infos and each tensor's data to `alignment` bytes instead of 32. Call it
  /// before adding tensors; the file must also declare general.alignment for a reader to
  /// find the data.
  void set_alignment(std::uint64_t alignment) { alignment_ = alignment; }
  /// Removes tensor `name` from the file (its data slot stays, unused); false when absent.
  bool remove_tensor(const std::string& name) {
    const auto it = std::find_if(tensors_.begin(), tensors_.end(),
                                 [&](const Tensor& t) { return t.name == name; });
    if (it == tensors_.end()) return false;
    tensors_.erase(it);
    return true;
  }
  /// A tensor with explicit GGUF dims (fastest first), ggml type id and data bytes. The
  /// offset is the next aligned one unless `offset` is given.
  void add_tensor(const std::string& name, std::vector<std::uint64_t> dims, std::uint32_t type,
                  std::vector<unsigned char> data, std::optional<std::uint64_t> offset = {}) {
    Tensor t{name, std::move(dims), type, std::move(data), offset.value_or(next_offset_)};
    next_offset_ = t.offset + t.data.size();
    next_offset_ = (next_offset_ + alignment_ - 1) / alignment_ * alignment_;
    tensors_.push_back(std::move(t));
  }
  /// An F32 or F16 matrix of `rows` x `cols` (GGUF dims {cols, rows}).
  void add_matrix(const std::string& name, std::size_t rows, std::size_t cols,
                  const std::vector<float>& values, bool f16) {
    add_tensor(name, {cols, rows}, f16 ? 1U : 0U, encode(values, f16));
  }
  void add_vector(const std::string& name, const std::vector<float>& values) {
    add_tensor(name, {values.size()}, 0U, encode(values, false));
  }

  static std::vector<unsigned char> encode(const std::vector<float>& values, bool f16) {
    std::vector<unsigned char> out(values.size() * (f16 ? 2 : 4));
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (f16) {
        const std::uint16_t h = llama::float_to_half(values[i]);
        std::memcpy(out.data() + 2 * i, &h, 2);
      } else {
        std::memcpy(out.data() + 4 * i, &values[i], 4);
      }
    }
    return out;
  }

  // ---- output ---------------------------------------------------------------------------
  /// The file's bytes. `version` and `magic` may be overridden for malformed files.
  [[nodiscard]] std::vector<unsigned char> bytes(std::uint32_t version = 3,
                                                 const char* magic = "GGUF") const {
    std::vector<unsigned char> out;
    const auto put = [&out](const void* p, std::size_t n) {
      const auto* b = static_cast<const unsigned char*>(p);
      out.insert(out.end(), b, b + n);
    };
    put(magic, 4);
    put(&version, 4);
    const std::uint64_t tensor_count = tensors_.size();
    put(&tensor_count, 8);
    put(&metadata_count_, 8);
    out.insert(out.end(), metadata_.begin(), metadata_.end());
    for (const Tensor& t : tensors_) {
      const std::uint64_t length = t.name.size();
      put(&length, 8);
      put(t.name.data(), t.name.size());
      const auto n_dims = static_cast<std::uint32_t>(t.dims.size());
      put(&n_dims, 4);
      for (const std::uint64_t d : t.dims) put(&d, 8);
      put(&t.type, 4);
      put(&t.offset, 8);
    }
    out.resize(static_cast<std::size_t>((out.size() + alignment_ - 1) / alignment_ * alignment_),
               0);
    const std::size_t data_start = out.size();
    for (const Tensor& t : tensors_) {
      if (out.size() < data_start + t.offset + t.data.size()) {
        out.resize(data_start + t.offset + t.data.size(), 0);
      }
      if (t.data.empty()) continue;  // memcpy from an empty vector's null data() is undefined
      std::memcpy(out.data() + data_start + t.offset, t.data.data(), t.data.size());
    }
    out.resize(static_cast<std::size_t>((out.size() + alignment_ - 1) / alignment_ * alignment_),
               0);
    return out;
  }

  void write(const std::filesystem::path& path, std::uint32_t version = 3,
             const char* magic = "GGUF") const {
    write_bytes(path, bytes(version, magic));
  }

  static void write_bytes(const std::filesystem::path& path, const std::vector<unsigned char>& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<std::uint64_t> dims;
    std::uint32_t type;
    std::vector<unsigned char> data;
    std::uint64_t offset;
  };

  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    metadata_.insert(metadata_.end(), b, b + n);
  }
  void put_u32(std::uint32_t v) { raw(&v, 4); }
  void put_u64(std::uint64_t v) { raw(&v, 8); }
  void string_(const std::string& s) {
    put_u64(s.size());
    raw(s.data(), s.size());
  }
  void key_(const std::string& key) {
    entry_starts_.emplace_back(key, metadata_.size());
    string_(key);
  }
  void scalar(const std::string& key, std::uint32_t type, const void* p, std::size_t n) {
    key_(key);
    put_u32(type);
    raw(p, n);
    ++metadata_count_;
  }

  std::vector<unsigned char> metadata_;
  std::uint64_t metadata_count_ = 0;
  std::vector<Tensor> tensors_;
  std::uint64_t next_offset_ = 0;
  std::uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, std::size_t>> entry_starts_;  // key, first byte
};

/// The shape of a synthetic llama model.
struct TinyLlama {
  std::size_t vocab = 64;  ///< >= 3 + 256 byte tokens is not needed: the vocabulary is
                           ///< <unk> <s> </s>, then single characters, then merges
  std::size_t dim = 32;
  std::size_t layers = 2;
  std::size_t heads = 4;
  std::size_t kv_heads = 2;
  std::size_t ffn = 48;
  std::size_t context = 96;
  bool tied = false;
  bool f16 = false;
  float weight_scale = 0.25F;  ///< larger weights give peakier, more varied rows
  std::uint64_t seed = 1;
};

/// The vocabulary of a synthetic model: <unk>, <s>, </s>, then "a", "b", ... and pairs of
/// them ("aa", "ab", ...) with decreasing scores, `vocab` tokens in all.
inline std::vector<std::string> tiny_vocabulary(std::size_t vocab) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  const std::string letters = "abcdefghijklmnopqrstuvwxyz \n";
  for (const char c : letters) {
    if (tokens.size() == vocab) break;
    tokens.emplace_back(c == ' ' ? std::string("\xE2\x96\x81") : std::string(1, c));
  }
  for (std::size_t i = 0; tokens.size() < vocab; ++i) {
    const char a = letters[(i / letters.size()) % 26];
    const char b = letters[i % 26];
    tokens.push_back(std::string(1, a) + b + (i >= 26 * 26 ? std::to_string(i) : ""));
  }
  return tokens;
}

/// Adds the metadata and tensors of a random llama model with shape `shape` to `w`;
/// `skip_tensor` leaves one tensor out (for missing-tensor tests).
inline void add_tiny_llama(GgufWriter& w, const TinyLlama& shape,
                           const std::string& skip_tensor = "") {
  const std::size_t head_dim = shape.dim / shape.heads;
  w.add_string("general.architecture", "llama");
  w.add_string("general.name", "tiny-test-llama");
  w.add_u32("llama.context_length", static_cast<std::uint32_t>(shape.context));
  w.add_u32("llama.embedding_length", static_cast<std::uint32_t>(shape.dim));
  w.add_u32("llama.block_count", static_cast<std::uint32_t>(shape.layers));
  w.add_u32("llama.feed_forward_length", static_cast<std::uint32_t>(shape.ffn));
  w.add_u32("llama.attention.head_count", static_cast<std::uint32_t>(shape.heads));
  w.add_u32("llama.attention.head_count_kv", static_cast<std::uint32_t>(shape.kv_heads));
  w.add_f32("llama.attention.layer_norm_rms_epsilon", 1e-5F);
  w.add_f32("llama.rope.freq_base", 10000.0F);
  const std::vector<std::string> tokens = tiny_vocabulary(shape.vocab);
  std::vector<float> scores(tokens.size(), 0.0F);
  std::vector<std::int32_t> types(tokens.size(), 1);
  types[0] = 2;
  types[1] = 3;
  types[2] = 3;
  for (std::size_t i = 31; i < tokens.size(); ++i) scores[i] = -static_cast<float>(i);
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_strings("tokenizer.ggml.tokens", tokens);
  w.add_f32s("tokenizer.ggml.scores", scores);
  w.add_i32s("tokenizer.ggml.token_type", types);
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.add_bool("tokenizer.ggml.add_space_prefix", false);

  specdec::xoshiro256pp g(shape.seed);
  const auto random = [&](std::size_t n, double scale) {
    std::vector<float> v(n);
    for (float& x : v) x = static_cast<float>(scale * (2.0 * specdec::uniform01<double>(g) - 1.0));
    return v;
  };
  const double s = shape.weight_scale;
  const auto matrix = [&](const std::string& name, std::size_t rows, std::size_t cols) {
    if (name != skip_tensor) w.add_matrix(name, rows, cols, random(rows * cols, s), shape.f16);
  };
  const auto norm = [&](const std::string& name) {
    std::vector<float> v = random(shape.dim, 0.2);
    for (float& x : v) x += 1.0F;
    if (name != skip_tensor) w.add_vector(name, v);
  };
  matrix("token_embd.weight", shape.vocab, shape.dim);
  for (std::size_t l = 0; l < shape.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    norm(p + "attn_norm.weight");
    matrix(p + "attn_q.weight", shape.heads * head_dim, shape.dim);
    matrix(p + "attn_k.weight", shape.kv_heads * head_dim, shape.dim);
    matrix(p + "attn_v.weight", shape.kv_heads * head_dim, shape.dim);
    matrix(p + "attn_output.weight", shape.dim, shape.heads * head_dim);
    norm(p + "ffn_norm.weight");
    matrix(p + "ffn_gate.weight", shape.ffn, shape.dim);
    matrix(p + "ffn_up.weight", shape.ffn, shape.dim);
    matrix(p + "ffn_down.weight", shape.dim, shape.ffn);
  }
  norm("output_norm.weight");
  if (!shape.tied) matrix("output.weight", shape.vocab, shape.dim);
}

/// Writes a random tiny llama model to `path` and returns the path.
inline std::filesystem::path write_tiny_llama(const std::filesystem::path& path,
                                              const TinyLlama& shape = {}) {
  GgufWriter w;
  add_tiny_llama(w, shape);
  w.write(path);
  return path;
}

/// A fresh directory under the system temporary directory for one test's files.
inline std::filesystem::path scratch_directory(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("specdec-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

/// A random tiny llama model with `shape`, written to a scratch file named `name` and loaded.
/// The model holds its weights in memory, so the file (and its directory, if empty) goes
/// right away; a file left behind in the temporary directory would be harmless.
inline llama::Model load_tiny_llama(const TinyLlama& shape, const std::string& name) {
  const auto directory = scratch_directory("tiny-llama");
  const auto path = directory / (name + ".gguf");
  llama::Model model(write_tiny_llama(path, shape).string());
  std::error_code ignored;
  std::filesystem::remove(path, ignored);
  std::filesystem::remove(directory, ignored);  // only if empty
  return model;
}

}  // namespace specdec::testing
