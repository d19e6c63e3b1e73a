// A llama-architecture model loaded from GGUF with llama.cpp's names and semantics:
//
//   token_embd.weight            [dim, vocab]       (GGUF order: fastest dimension first)
//   blk.N.attn_norm.weight       [dim]
//   blk.N.attn_q.weight          [dim, heads * head_dim]
//   blk.N.attn_k.weight          [dim, kv_heads * head_dim]   (grouped KV heads allowed)
//   blk.N.attn_v.weight          [dim, kv_heads * head_dim]
//   blk.N.attn_output.weight     [heads * head_dim, dim]
//   blk.N.ffn_norm.weight        [dim]
//   blk.N.ffn_gate.weight        [dim, ffn]      SwiGLU: down(silu(gate x) * up x)
//   blk.N.ffn_up.weight          [dim, ffn]
//   blk.N.ffn_down.weight        [ffn, dim]
//   output_norm.weight           [dim]
//   output.weight                [dim, vocab]    absent: tied to token_embd.weight
//   rope_freqs.weight            [rope_dims / 2] optional per-pair frequency divisors
//
// Hyperparameters come from llama.* metadata: embedding_length, block_count,
// feed_forward_length, attention.head_count, attention.head_count_kv (default: head_count),
// attention.layer_norm_rms_epsilon, rope.freq_base (default 10000), rope.dimension_count
// (must equal head_dim), rope.scaling.type (linear by default, or none) with
// rope.scaling.factor or the older rope.scale_linear (as llama.cpp reads them),
// context_length. Rotary positions use llama.cpp's "normal" mode for this architecture:
// adjacent pairs (x[2i], x[2i+1]) rotate by p * scale * base^(-2i / rope_dims).
//
// Weights are converted to F32 at load (F32, F16, BF16, Q8_0, Q4_0, Q4_1 are read): the
// engine streams F32 rows, so the 12.6M-parameter example target occupies 50 MB, more
// than this machine's 32 MiB L3 cache, and one token's forward pass is memory-bound.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gguf.hpp"
#include "tokenizer.hpp"

namespace llama {

/// A row-major F32 matrix.
struct Matrix {
  std::vector<float> data;
  std::size_t rows = 0;
  std::size_t cols = 0;
  [[nodiscard]] const float* row(std::size_t r) const noexcept { return data.data() + r * cols; }
};

struct Config {
  std::size_t vocab = 0;
  std::size_t dim = 0;
  std::size_t layers = 0;
  std::size_t heads = 0;
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t ffn = 0;
  std::size_t context_length = 0;
  std::size_t rope_dims = 0;
  double rms_eps = 1e-5;
  double rope_base = 10000.0;
  double rope_scale = 1.0;            ///< position multiplier (1 / linear scaling factor)
  std::vector<double> rope_divisors;  ///< rope_freqs.weight, empty when absent
  bool tied_output = false;
  std::string name;

  [[nodiscard]] std::size_t kv_dim() const noexcept { return kv_heads * head_dim; }
  [[nodiscard]] std::size_t q_dim() const noexcept { return heads * head_dim; }
};

struct Layer {
  std::vector<float> attn_norm, ffn_norm;
  Matrix q, k, v, o, gate, up, down;
};

/// IEEE half -> float (subnormals, infinities and NaN included).
[[nodiscard]] inline float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16U;
  std::uint32_t exponent = (h >> 10U) & 0x1FU;
  std::uint32_t mantissa = h & 0x3FFU;
  std::uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 113;
      while ((mantissa & 0x400U) == 0) {
        mantissa <<= 1U;
        --exponent;
      }
      bits = sign | (exponent << 23U) | ((mantissa & 0x3FFU) << 13U);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7F800000U | (mantissa << 13U);
  } else {
    bits = sign | ((exponent + 112U) << 23U) | (mantissa << 13U);
  }
  return std::bit_cast<float>(bits);
}

/// float -> IEEE half, round to nearest even (for writing test files).
[[nodiscard]] inline std::uint16_t float_to_half(float value) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16U) & 0x8000U);
  const std::uint32_t exponent = (bits >> 23U) & 0xFFU;
  std::uint32_t mantissa = bits & 0x7FFFFFU;
  if (exponent == 0xFF) {
    return static_cast<std::uint16_t>(sign | 0x7C00U | (mantissa != 0 ? 0x200U : 0U));
  }
  const int e = static_cast<int>(exponent) - 127 + 15;
  if (e >= 31) return static_cast<std::uint16_t>(sign | 0x7C00U);
  if (e <= 0) {
    if (e < -10) return sign;
    mantissa |= 0x800000U;
    const auto shift = static_cast<std::uint32_t>(14 - e);
    std::uint32_t half = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1U << shift) - 1U);
    const std::uint32_t halfway = 1U << (shift - 1U);
    if (rest > halfway || (rest == halfway && (half & 1U) != 0)) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t half = (static_cast<std::uint32_t>(e) << 10U) | (mantissa >> 13U);
  const std::uint32_t rest = mantissa & 0x1FFFU;
  if (rest > 0x1000U || (rest == 0x1000U && (half & 1U) != 0)) ++half;
  return static_cast<std::uint16_t>(sign | half);
}

namespace detail {

inline std::uint16_t load_u16(const unsigned char* p) noexcept {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8U));
}

/// Converts `count` values of a tensor to F32; false for a type this engine does not load.
inline bool to_f32(std::uint32_t type, const unsigned char* in, std::size_t count, float* out) {
  switch (static_cast<tensor_type>(type)) {
    case tensor_type::f32:
      for (std::size_t i = 0; i < count; ++i) {
        std::uint32_t bits = 0;
        std::memcpy(&bits, in + 4 * i, 4);
        out[i] = std::bit_cast<float>(bits);
      }
      return true;
    case tensor_type::f16:
      for (std::size_t i = 0; i < count; ++i) out[i] = half_to_float(load_u16(in + 2 * i));
      return true;
    case tensor_type::bf16:
      for (std::size_t i = 0; i < count; ++i) {
        out[i] = std::bit_cast<float>(static_cast<std::uint32_t>(load_u16(in + 2 * i)) << 16U);
      }
      return true;
    case tensor_type::q8_0:  // blocks of 32: f16 scale d, 32 int8 q; x = d q
      for (std::size_t b = 0; b < count / 32; ++b) {
        const unsigned char* block = in + 34 * b;
        const float d = half_to_float(load_u16(block));
        for (std::size_t i = 0; i < 32; ++i) {
          out[32 * b + i] = d * static_cast<float>(static_cast<std::int8_t>(block[2 + i]));
        }
      }
      return true;
    case tensor_type::q4_0:  // f16 d, 16 bytes: value i in the low nibble of byte i,
                             // value 16 + i in its high nibble; x = d (q - 8)
      for (std::size_t b = 0; b < count / 32; ++b) {
        const unsigned char* block = in + 18 * b;
        const float d = half_to_float(load_u16(block));
        for (std::size_t i = 0; i < 16; ++i) {
          const unsigned char q = block[2 + i];
          out[32 * b + i] = d * static_cast<float>(static_cast<int>(q & 15U) - 8);
          out[32 * b + 16 + i] = d * static_cast<float>(static_cast<int>(q >> 4U) - 8);
        }
      }
      return true;
    case tensor_type::q4_1:  // f16 d, f16 m, 16 bytes as Q4_0; x = d q + m
      for (std::size_t b = 0; b < count / 32; ++b) {
        const unsigned char* block = in + 20 * b;
        const float d = half_to_float(load_u16(block));
        const float m = half_to_float(load_u16(block + 2));
        for (std::size_t i = 0; i < 16; ++i) {
          const unsigned char q = block[4 + i];
          out[32 * b + i] = d * static_cast<float>(q & 15U) + m;
          out[32 * b + 16 + i] = d * static_cast<float>(q >> 4U) + m;
        }
      }
      return true;
    default:
      return false;
  }
}

}  // namespace detail

/// A llama model: configuration, F32 weights and tokenizer. Immutable once loaded, so
/// several engines (and threads) can share one.
class Model {
 public:
  /// Loads `path`. Throws model_error naming the file and the problem: not GGUF, an
  /// architecture other than llama, a missing or malformed key, a missing tensor, a tensor
  /// of the wrong shape or of a type this engine does not load, a tokenizer that does not
  /// match the embedding.
  explicit Model(const std::string& path) : Model(GgufFile(path)) {}

  explicit Model(const GgufFile& file) : path_(file.path()) {
    const std::string architecture = file.string("general.architecture");
    if (architecture != "llama") {
      file.fail("architecture \"" + architecture + "\" is not supported (this engine runs llama)");
    }
    tokenizer_ = Tokenizer(file);
    Config& c = config_;
    c.name = file.optional_string("general.name").value_or(path_);
    c.dim = positive(file, "llama.embedding_length");
    c.layers = positive(file, "llama.block_count");
    c.ffn = positive(file, "llama.feed_forward_length");
    c.heads = positive(file, "llama.attention.head_count");
    c.kv_heads = file.find("llama.attention.head_count_kv")
                     ? positive(file, "llama.attention.head_count_kv")
                     : c.heads;
    c.context_length = positive(file, "llama.context_length");
    c.rms_eps = file.real("llama.attention.layer_norm_rms_epsilon");
    c.rope_base = file.optional_real("llama.rope.freq_base").value_or(10000.0);
    if (c.dim % c.heads != 0) {
      file.fail("llama.embedding_length " + std::to_string(c.dim) +
                " is not a multiple of llama.attention.head_count " + std::to_string(c.heads));
    }
    if (c.heads % c.kv_heads != 0) {
      file.fail("llama.attention.head_count " + std::to_string(c.heads) +
                " is not a multiple of llama.attention.head_count_kv " +
                std::to_string(c.kv_heads));
    }
    c.head_dim = c.dim / c.heads;
    c.rope_dims =
        file.find("llama.rope.dimension_count")
            ? static_cast<std::size_t>(file.unsigned_integer("llama.rope.dimension_count"))
            : c.head_dim;
    if (c.rope_dims != c.head_dim) {  // llama.cpp rotates whole heads for this architecture
      file.fail("llama.rope.dimension_count " + std::to_string(c.rope_dims) +
                " differs from the head dimension " + std::to_string(c.head_dim) +
                " (the llama architecture rotates whole heads)");
    }
    if (!(c.rms_eps > 0.0) || !(c.rope_base > 0.0)) {
      file.fail("llama.attention.layer_norm_rms_epsilon and llama.rope.freq_base must be positive");
    }
    // As llama.cpp: the factor comes from llama.rope.scaling.factor, else from the older
    // llama.rope.scale_linear; 0 or absent means none; the type defaults to linear and
    // "none" switches the scaling off.
    const std::string scaling = file.optional_string("llama.rope.scaling.type").value_or("linear");
    if (scaling != "linear" && scaling != "none") {
      file.fail("llama.rope.scaling.type \"" + scaling + "\" is not supported (none, linear)");
    }
    const char* factor_key = file.find("llama.rope.scaling.factor") != nullptr
                                 ? "llama.rope.scaling.factor"
                                 : "llama.rope.scale_linear";
    const double factor = file.optional_real(factor_key).value_or(0.0);
    if (!(factor >= 0.0)) {
      file.fail(std::string(factor_key) + " must be positive (or 0: no scaling)");
    }
    if (scaling == "linear" && factor > 0.0) c.rope_scale = 1.0 / factor;

    const TensorInfo* embedding = file.find_tensor("token_embd.weight");
    if (embedding == nullptr) file.fail("missing tensor token_embd.weight");
    if (embedding->dims.size() != 2 || embedding->dims[0] != c.dim) {
      file.fail("tensor token_embd.weight has shape " + embedding->shape() + ", expected [" +
                std::to_string(c.dim) + ", vocabulary size]");
    }
    c.vocab = static_cast<std::size_t>(embedding->dims[1]);
    if (c.vocab != tokenizer_.size()) {
      file.fail("vocabulary mismatch inside the file: tokenizer.ggml.tokens has " +
                std::to_string(tokenizer_.size()) + " tokens but token_embd.weight has " +
                std::to_string(c.vocab) + " rows");
    }
    if (const auto declared = file.optional_unsigned("llama.vocab_size");
        declared && *declared != c.vocab) {
      file.fail("llama.vocab_size is " + std::to_string(*declared) + " but token_embd.weight has " +
                std::to_string(c.vocab) + " rows");
    }
    embedding_ = matrix(file, "token_embd.weight", c.vocab, c.dim);
    // Layers are added as they load: a block_count beyond the tensors in the file (up to
    // 2^24) fails at the first missing tensor instead of allocating gigabytes of empty layers.
    for (std::size_t i = 0; i < c.layers; ++i) {
      const std::string p = "blk." + std::to_string(i) + ".";
      Layer& l = layers_.emplace_back();
      l.attn_norm = vector(file, p + "attn_norm.weight", c.dim);
      l.q = matrix(file, p + "attn_q.weight", c.q_dim(), c.dim);
      l.k = matrix(file, p + "attn_k.weight", c.kv_dim(), c.dim);
      l.v = matrix(file, p + "attn_v.weight", c.kv_dim(), c.dim);
      l.o = matrix(file, p + "attn_output.weight", c.dim, c.q_dim());
      l.ffn_norm = vector(file, p + "ffn_norm.weight", c.dim);
      l.gate = matrix(file, p + "ffn_gate.weight", c.ffn, c.dim);
      l.up = matrix(file, p + "ffn_up.weight", c.ffn, c.dim);
      l.down = matrix(file, p + "ffn_down.weight", c.dim, c.ffn);
    }
    output_norm_ = vector(file, "output_norm.weight", c.dim);
    c.tied_output = file.find_tensor("output.weight") == nullptr;
    if (!c.tied_output) output_ = matrix(file, "output.weight", c.vocab, c.dim);
    if (file.find_tensor("rope_freqs.weight") != nullptr) {
      const std::vector<float> divisors = vector(file, "rope_freqs.weight", c.rope_dims / 2);
      c.rope_divisors.assign(divisors.begin(), divisors.end());
    }
  }

  [[nodiscard]] const Config& config() const noexcept { return config_; }
  [[nodiscard]] const Tokenizer& tokenizer() const noexcept { return tokenizer_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] const Matrix& embedding() const noexcept { return embedding_; }
  [[nodiscard]] const std::vector<Layer>& layers() const noexcept { return layers_; }
  [[nodiscard]] const std::vector<float>& output_norm() const noexcept { return output_norm_; }
  /// The output projection (vocab x dim): output.weight, or token_embd.weight when tied.
  [[nodiscard]] const Matrix& output() const noexcept {
    return config_.tied_output ? embedding_ : output_;
  }

  /// Parameters (the tied output counted once).
  [[nodiscard]] std::size_t parameters() const noexcept {
    std::size_t n = embedding_.data.size() + output_norm_.size() + output_.data.size();
    for (const Layer& l : layers_) {
      n += l.attn_norm.size() + l.ffn_norm.size() + l.q.data.size() + l.k.data.size() +
           l.v.data.size() + l.o.data.size() + l.gate.data.size() + l.up.data.size() +
           l.down.data.size();
    }
    return n;
  }
  /// Bytes of F32 weights one token's forward pass streams: every layer matrix and the
  /// output projection (the embedding row and the norms are negligible).
  [[nodiscard]] std::size_t streamed_bytes() const noexcept {
    std::size_t n = output().data.size();
    for (const Layer& l : layers_) {
      n += l.q.data.size() + l.k.data.size() + l.v.data.size() + l.o.data.size() +
           l.gate.data.size() + l.up.data.size() + l.down.data.size();
    }
    return n * sizeof(float);
  }

 private:
  static std::size_t positive(const GgufFile& file, std::string_view key) {
    const std::uint64_t value = file.unsigned_integer(key);
    if (value == 0 || value > (std::uint64_t{1} << 24U)) {
      file.fail("metadata key " + std::string(key) + " is " + std::to_string(value) +
                ", expected a positive size");
    }
    return static_cast<std::size_t>(value);
  }

  // The expected shape is spelt only on failure, by TensorInfo::shape(): spelling it at every
  // call as "[" + std::to_string(n) + "]" tripped GCC 12's false -Wrestrict warning at -O3.
  static const TensorInfo& tensor(const GgufFile& file, const std::string& name,
                                  std::vector<std::uint64_t> dims) {
    const TensorInfo* t = file.find_tensor(name);
    if (t == nullptr) file.fail("missing tensor " + name);
    if (t->dims != dims) {
      TensorInfo expected;
      expected.dims = std::move(dims);
      file.fail("tensor " + name + " has shape " + t->shape() + ", expected " + expected.shape());
    }
    return *t;
  }

  static void convert(const GgufFile& file, const TensorInfo& t, float* out) {
    if (!detail::to_f32(t.type, file.data(t), static_cast<std::size_t>(t.elements()), out)) {
      file.fail("tensor " + t.name + " has type " + std::string(type_traits(t.type).name) +
                ", which this engine does not load (F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
    }
  }

  static Matrix matrix(const GgufFile& file, const std::string& name, std::size_t rows,
                       std::size_t cols) {
    const TensorInfo& t = tensor(file, name, {cols, rows});
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.data.resize(rows * cols);
    convert(file, t, m.data.data());
    return m;
  }

  static std::vector<float> vector(const GgufFile& file, const std::string& name, std::size_t n) {
    const TensorInfo& t = tensor(file, name, {n});
    std::vector<float> v(n);
    convert(file, t, v.data());
    return v;
  }

  std::string path_;
  Config config_;
  Tokenizer tokenizer_;
  Matrix embedding_, output_;
  std::vector<Layer> layers_;
  std::vector<float> output_norm_;
};

/// Checks that a draft can serve a target: the same vocabulary, token for token. Throws
/// model_error naming both files and the first difference.
inline void check_pair(const Model& target, const Model& draft) {
  const auto& t = target.tokenizer().tokens();
  const auto& d = draft.tokenizer().tokens();
  if (t.size() != d.size()) {
    throw model_error(draft.path(), "vocabulary mismatch with the target " + target.path() +
                                        ": the draft has " + std::to_string(d.size()) +
                                        " tokens, the target " + std::to_string(t.size()));
  }
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i] != d[i]) {
      throw model_error(draft.path(), "vocabulary mismatch with the target " + target.path() +
                                          ": token " + std::to_string(i) + " is \"" + d[i] +
                                          "\" in the draft and \"" + t[i] + "\" in the target");
    }
  }
}

}  // namespace llama
