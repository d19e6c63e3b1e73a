// GGUF (version 2 and 3) reader: the file format of llama.cpp and ggml.
//
// Layout, all little-endian: "GGUF", uint32 version, uint64 tensor count, uint64 metadata
// count; the metadata (key string, uint32 value type, value); the tensor infos (name
// string, uint32 n_dims, uint64 dims[n_dims] with the fastest-varying dimension first,
// uint32 ggml type, uint64 offset into the data section); padding to `general.alignment`
// (32 by default); the data section. Strings are a uint64 length and UTF-8 bytes.
//
// The whole file is read into memory and every read is bounds-checked: a malformed file
// raises llama::model_error naming the file and what is wrong, never undefined behaviour.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace llama {

/// What the engine example throws for a file it cannot use (GGUF structure, metadata,
/// tensors, tokenizer, a model pair that does not match). what() reads "<file>: <problem>".
class model_error : public std::runtime_error {
 public:
  model_error(std::string file, const std::string& problem)
      : std::runtime_error(file + ": " + problem), file_(std::move(file)) {}
  [[nodiscard]] const std::string& file() const noexcept { return file_; }

 private:
  std::string file_;
};

/// The value types of GGUF metadata.
enum class value_type : std::uint32_t {
  uint8 = 0,
  int8 = 1,
  uint16 = 2,
  int16 = 3,
  uint32 = 4,
  int32 = 5,
  float32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  uint64 = 10,
  int64 = 11,
  float64 = 12,
};

[[nodiscard]] inline std::string_view to_string(value_type type) noexcept {
  switch (type) {
    case value_type::uint8:
      return "uint8";
    case value_type::int8:
      return "int8";
    case value_type::uint16:
      return "uint16";
    case value_type::int16:
      return "int16";
    case value_type::uint32:
      return "uint32";
    case value_type::int32:
      return "int32";
    case value_type::float32:
      return "float32";
    case value_type::boolean:
      return "bool";
    case value_type::string:
      return "string";
    case value_type::array:
      return "array";
    case value_type::uint64:
      return "uint64";
    case value_type::int64:
      return "int64";
    case value_type::float64:
      return "float64";
  }
  return "unknown";
}

/// The tensor types of ggml that a GGUF file may name (ids from ggml.h). The engine loads
/// F32, F16, BF16, Q8_0, Q4_0 and Q4_1; the others are recognised so that the error can
/// name them.
enum class tensor_type : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
};

/// Block layout of a tensor type: `block_elements` values stored in `block_bytes` bytes;
/// 0 bytes for ids this reader does not know.
struct TypeTraits {
  std::string_view name = "unknown";
  std::uint64_t block_elements = 1;
  std::uint64_t block_bytes = 0;
};

[[nodiscard]] inline TypeTraits type_traits(std::uint32_t id) noexcept {
  switch (static_cast<tensor_type>(id)) {
    case tensor_type::f32:
      return {"F32", 1, 4};
    case tensor_type::f16:
      return {"F16", 1, 2};
    case tensor_type::bf16:
      return {"BF16", 1, 2};
    case tensor_type::q4_0:
      return {"Q4_0", 32, 18};
    case tensor_type::q4_1:
      return {"Q4_1", 32, 20};
    case tensor_type::q5_0:
      return {"Q5_0", 32, 22};
    case tensor_type::q5_1:
      return {"Q5_1", 32, 24};
    case tensor_type::q8_0:
      return {"Q8_0", 32, 34};
    case tensor_type::q8_1:
      return {"Q8_1", 32, 36};
    case tensor_type::q2_k:
      return {"Q2_K", 256, 84};
    case tensor_type::q3_k:
      return {"Q3_K", 256, 110};
    case tensor_type::q4_k:
      return {"Q4_K", 256, 144};
    case tensor_type::q5_k:
      return {"Q5_K", 256, 176};
    case tensor_type::q6_k:
      return {"Q6_K", 256, 210};
    case tensor_type::q8_k:
      return {"Q8_K", 256, 292};
    case tensor_type::iq2_xxs:
      return {"IQ2_XXS", 256, 66};
    case tensor_type::iq2_xs:
      return {"IQ2_XS", 256, 74};
    case tensor_type::iq3_xxs:
      return {"IQ3_XXS", 256, 98};
    case tensor_type::iq1_s:
      return {"IQ1_S", 256, 50};
    case tensor_type::iq4_nl:
      return {"IQ4_NL", 32, 18};
    case tensor_type::iq3_s:
      return {"IQ3_S", 256, 110};
    case tensor_type::iq2_s:
      return {"IQ2_S", 256, 82};
    case tensor_type::iq4_xs:
      return {"IQ4_XS", 256, 136};
    case tensor_type::i8:
      return {"I8", 1, 1};
    case tensor_type::i16:
      return {"I16", 1, 2};
    case tensor_type::i32:
      return {"I32", 1, 4};
    case tensor_type::i64:
      return {"I64", 1, 8};
    case tensor_type::f64:
      return {"F64", 1, 8};
    case tensor_type::iq1_m:
      return {"IQ1_M", 256, 56};
    case tensor_type::tq1_0:
      return {"TQ1_0", 256, 54};
    case tensor_type::tq2_0:
      return {"TQ2_0", 256, 66};
    case tensor_type::mxfp4:
      return {"MXFP4", 32, 17};
  }
  return {};
}

/// One metadata value. Arrays hold their elements in `strings` (string arrays), `integers`
/// (integer and bool arrays) or `reals` (float arrays); nested arrays are rejected.
struct Value {
  value_type type = value_type::uint8;
  std::uint64_t unsigned_value = 0;  // uint8..uint64, bool
  std::int64_t signed_value = 0;     // int8..int64
  double real_value = 0.0;           // float32, float64
  std::string string_value;
  value_type element_type = value_type::uint8;  // arrays
  std::uint64_t element_count = 0;
  std::vector<std::string> strings;
  std::vector<std::int64_t> integers;
  std::vector<double> reals;
};

/// A tensor as the file describes it. `dims[0]` is the fastest-varying dimension (a 2-D
/// weight [rows = outputs, cols = inputs] has dims {cols, rows}).
struct TensorInfo {
  std::string name;
  std::vector<std::uint64_t> dims;
  std::uint32_t type = 0;
  std::uint64_t offset = 0;  ///< absolute, in the file
  std::uint64_t bytes = 0;

  [[nodiscard]] std::uint64_t elements() const noexcept {
    std::uint64_t n = 1;
    for (const std::uint64_t d : dims) n *= d;
    return n;
  }
  /// "[384, 1024]" (GGUF order, fastest dimension first).
  [[nodiscard]] std::string shape() const {
    std::string out = "[";
    for (std::size_t i = 0; i < dims.size(); ++i) {
      out += (i ? ", " : "") + std::to_string(dims[i]);
    }
    return out + "]";
  }
};

/// A GGUF file read into memory.
class GgufFile {
 public:
  /// Reads and parses `path`. Throws model_error for a file that cannot be read or is not a
  /// well-formed GGUF file of version 2 or 3.
  explicit GgufFile(std::string path) : path_(std::move(path)) {
    // Regular files only: a directory opens as a stream whose size reads as 2^63 - 1 (the
    // read then failed with std::bad_alloc), and a pipe or a device has no size.
    std::error_code status;
    if (!std::filesystem::is_regular_file(path_, status)) {
      fail(status ? "cannot open the file (" + status.message() + ")"
                  : "cannot open the file: not a regular file");
    }
    std::ifstream in(path_, std::ios::binary | std::ios::ate);
    if (!in) fail("cannot open the file");
    const std::streamoff size = in.tellg();
    if (size < 0) fail("cannot read the file");
    bytes_.resize(static_cast<std::size_t>(size));
    in.seekg(0);
    if (size > 0 && !in.read(reinterpret_cast<char*>(bytes_.data()), size)) {
      fail("cannot read the file");
    }
    parse();
  }

  /// Parses a GGUF file already in memory; `name` stands for the file in messages.
  [[nodiscard]] static GgufFile from_bytes(std::string name, std::vector<unsigned char> bytes) {
    return GgufFile(std::move(name), std::move(bytes));
  }

  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] std::uint32_t version() const noexcept { return version_; }
  [[nodiscard]] std::uint64_t alignment() const noexcept { return alignment_; }
  [[nodiscard]] const std::map<std::string, Value>& metadata() const noexcept { return metadata_; }
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }

  [[nodiscard]] const Value* find(std::string_view key) const {
    const auto it = metadata_.find(std::string(key));
    return it == metadata_.end() ? nullptr : &it->second;
  }
  [[nodiscard]] const TensorInfo* find_tensor(std::string_view name) const {
    const auto it = tensor_index_.find(std::string(name));
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  /// The tensor's bytes (bounds were checked when the file was parsed).
  [[nodiscard]] const unsigned char* data(const TensorInfo& tensor) const noexcept {
    return bytes_.data() + tensor.offset;
  }

  // Typed metadata access. The required forms throw model_error naming the key when it is
  // missing or of another type; integers of any width convert when the value fits.
  [[nodiscard]] std::string string(std::string_view key) const {
    const Value& v = require(key);
    if (v.type != value_type::string) wrong_type(key, v, "a string");
    return v.string_value;
  }
  [[nodiscard]] std::optional<std::string> optional_string(std::string_view key) const {
    if (find(key) == nullptr) return std::nullopt;
    return string(key);
  }
  [[nodiscard]] std::uint64_t unsigned_integer(std::string_view key) const {
    const Value& v = require(key);
    if (is_unsigned(v.type) && v.type != value_type::boolean) return v.unsigned_value;
    if (is_signed(v.type) && v.signed_value >= 0) return static_cast<std::uint64_t>(v.signed_value);
    wrong_type(key, v, "a non-negative integer");
  }
  [[nodiscard]] std::optional<std::uint64_t> optional_unsigned(std::string_view key) const {
    if (find(key) == nullptr) return std::nullopt;
    return unsigned_integer(key);
  }
  [[nodiscard]] double real(std::string_view key) const {
    const Value& v = require(key);
    if (v.type == value_type::float32 || v.type == value_type::float64) return v.real_value;
    wrong_type(key, v, "a floating-point number");
  }
  [[nodiscard]] std::optional<double> optional_real(std::string_view key) const {
    if (find(key) == nullptr) return std::nullopt;
    return real(key);
  }
  [[nodiscard]] std::optional<bool> optional_bool(std::string_view key) const {
    const Value* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (v->type != value_type::boolean) wrong_type(key, *v, "a bool");
    return v->unsigned_value != 0;
  }
  /// An array value of the given element kind ("strings", "integers" or "reals").
  [[nodiscard]] const Value& array(std::string_view key, value_type element) const {
    const Value& v = require(key);
    const bool integer_wanted = element != value_type::string && element != value_type::float32 &&
                                element != value_type::float64;
    const bool matches =
        v.type == value_type::array &&
        (v.element_type == element ||
         (integer_wanted && (is_unsigned(v.element_type) || is_signed(v.element_type))) ||
         ((element == value_type::float32 || element == value_type::float64) &&
          (v.element_type == value_type::float32 || v.element_type == value_type::float64)));
    if (!matches) {
      wrong_type(key, v, std::string("an array of ") + std::string(to_string(element)));
    }
    return v;
  }

  /// Throws model_error("<file>: <problem>").
  [[noreturn]] void fail(const std::string& problem) const { throw model_error(path_, problem); }

 private:
  GgufFile(std::string name, std::vector<unsigned char> bytes)
      : path_(std::move(name)), bytes_(std::move(bytes)) {
    parse();
  }

  static bool is_unsigned(value_type t) noexcept {
    return t == value_type::uint8 || t == value_type::uint16 || t == value_type::uint32 ||
           t == value_type::uint64 || t == value_type::boolean;
  }
  static bool is_signed(value_type t) noexcept {
    return t == value_type::int8 || t == value_type::int16 || t == value_type::int32 ||
           t == value_type::int64;
  }

  const Value& require(std::string_view key) const {
    const Value* v = find(key);
    if (v == nullptr) fail("missing metadata key " + std::string(key));
    return *v;
  }
  [[noreturn]] void wrong_type(std::string_view key, const Value& v,
                               const std::string& wanted) const {
    std::string got(to_string(v.type));
    if (v.type == value_type::array) got += " of " + std::string(to_string(v.element_type));
    fail("metadata key " + std::string(key) + " is " + got + ", expected " + wanted);
  }

  // --- bounds-checked reading ----------------------------------------------------------
  void need(std::uint64_t count, std::string_view what) const {
    if (count > bytes_.size() || at_ > bytes_.size() - count) {
      fail("truncated: " + std::string(what) + " at byte " + std::to_string(at_) + " needs " +
           std::to_string(count) + " bytes, the file has " + std::to_string(bytes_.size()));
    }
  }
  template <class T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) {
      value = byteswap(value);
    }
    return value;
  }
  template <class T>
  static T byteswap(T value) noexcept {
    unsigned char raw[sizeof(T)];
    std::memcpy(raw, &value, sizeof(T));
    std::reverse(raw, raw + sizeof(T));
    std::memcpy(&value, raw, sizeof(T));
    return value;
  }
  std::string read_string(std::string_view what) {
    const auto length = read<std::uint64_t>(what);
    need(length, what);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + at_),
                  static_cast<std::size_t>(length));
    at_ += length;
    return s;
  }

  void read_scalar(Value& v, value_type type, const std::string& key) {
    switch (type) {
      case value_type::uint8:
        v.unsigned_value = read<std::uint8_t>(key);
        break;
      case value_type::int8:
        v.signed_value = read<std::int8_t>(key);
        break;
      case value_type::uint16:
        v.unsigned_value = read<std::uint16_t>(key);
        break;
      case value_type::int16:
        v.signed_value = read<std::int16_t>(key);
        break;
      case value_type::uint32:
        v.unsigned_value = read<std::uint32_t>(key);
        break;
      case value_type::int32:
        v.signed_value = read<std::int32_t>(key);
        break;
      case value_type::float32:
        v.real_value = static_cast<double>(read<float>(key));
        break;
      case value_type::boolean: {
        const auto b = read<std::uint8_t>(key);
        if (b > 1) fail("metadata key " + key + ": bool value " + std::to_string(b));
        v.unsigned_value = b;
        break;
      }
      case value_type::string:
        v.string_value = read_string(key);
        break;
      case value_type::uint64:
        v.unsigned_value = read<std::uint64_t>(key);
        break;
      case value_type::int64:
        v.signed_value = read<std::int64_t>(key);
        break;
      case value_type::float64:
        v.real_value = read<double>(key);
        break;
      case value_type::array:
        fail("metadata key " + key + ": nested arrays are not supported");
    }
  }

  static bool known_value_type(std::uint32_t t) noexcept { return t <= 12; }

  Value read_value(const std::string& key) {
    Value v;
    const auto raw_type = read<std::uint32_t>(key + " (value type)");
    if (!known_value_type(raw_type)) {
      fail("metadata key " + key + " has unknown value type " + std::to_string(raw_type));
    }
    v.type = static_cast<value_type>(raw_type);
    if (v.type != value_type::array) {
      read_scalar(v, v.type, key);
      return v;
    }
    const auto raw_element = read<std::uint32_t>(key + " (array type)");
    if (!known_value_type(raw_element)) {
      fail("metadata key " + key + " is an array of unknown value type " +
           std::to_string(raw_element));
    }
    v.element_type = static_cast<value_type>(raw_element);
    v.element_count = read<std::uint64_t>(key + " (array length)");
    // Every element takes at least one byte: a larger count cannot be in the file.
    if (v.element_count > bytes_.size() - at_) {
      fail("metadata key " + key + ": array of " + std::to_string(v.element_count) +
           " elements runs past the end of the file");
    }
    const auto count = static_cast<std::size_t>(v.element_count);
    Value element;
    if (v.element_type == value_type::string) {
      v.strings.reserve(count);
      for (std::size_t i = 0; i < count; ++i) v.strings.push_back(read_string(key));
    } else if (v.element_type == value_type::float32 || v.element_type == value_type::float64) {
      v.reals.reserve(count);
      for (std::size_t i = 0; i < count; ++i) {
        read_scalar(element, v.element_type, key);
        v.reals.push_back(element.real_value);
      }
    } else if (v.element_type == value_type::array) {
      fail("metadata key " + key + ": nested arrays are not supported");
    } else {
      v.integers.reserve(count);
      for (std::size_t i = 0; i < count; ++i) {
        read_scalar(element, v.element_type, key);
        v.integers.push_back(is_signed(v.element_type)
                                 ? element.signed_value
                                 : static_cast<std::int64_t>(element.unsigned_value));
      }
    }
    return v;
  }

  void parse() {
    if (bytes_.size() < 4 || std::memcmp(bytes_.data(), "GGUF", 4) != 0) {
      std::string seen;
      for (std::size_t i = 0; i < std::min<std::size_t>(4, bytes_.size()); ++i) {
        const unsigned char c = bytes_[i];
        seen += (c >= 32 && c < 127) ? std::string(1, static_cast<char>(c)) : "\\x" + hex(c);
      }
      fail("not a GGUF file: bad magic \"" + seen + "\" (expected \"GGUF\")");
    }
    at_ = 4;
    version_ = read<std::uint32_t>("version");
    if (version_ != 2 && version_ != 3) {
      fail("unsupported GGUF version " + std::to_string(version_) + " (supported: 2, 3)");
    }
    const auto tensor_count = read<std::uint64_t>("tensor count");
    const auto metadata_count = read<std::uint64_t>("metadata count");
    // Each entry takes more than 8 bytes: larger counts cannot be in the file.
    if (tensor_count > bytes_.size() / 8 || metadata_count > bytes_.size() / 8) {
      fail("truncated: header declares " + std::to_string(tensor_count) + " tensors and " +
           std::to_string(metadata_count) + " metadata entries, more than the file can hold");
    }
    for (std::uint64_t i = 0; i < metadata_count; ++i) {
      std::string key = read_string("metadata key " + std::to_string(i));
      Value value = read_value(key);
      if (!metadata_.emplace(key, std::move(value)).second) {
        fail("duplicate metadata key " + key);
      }
    }
    if (const Value* a = find("general.alignment")) {
      if (a->type != value_type::uint32 || a->unsigned_value == 0 ||
          !std::has_single_bit(a->unsigned_value)) {
        fail("general.alignment must be a power of two (uint32)");
      }
      alignment_ = a->unsigned_value;
    }
    tensors_.reserve(static_cast<std::size_t>(tensor_count));
    for (std::uint64_t i = 0; i < tensor_count; ++i) {
      TensorInfo t;
      t.name = read_string("tensor name " + std::to_string(i));
      const auto n_dims = read<std::uint32_t>(t.name + " (dimension count)");
      if (n_dims == 0 || n_dims > 4) {
        fail("tensor " + t.name + " has " + std::to_string(n_dims) + " dimensions (1 to 4)");
      }
      std::uint64_t elements = 1;
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        const auto dim = read<std::uint64_t>(t.name + " (dimension)");
        if (dim == 0 || elements > std::numeric_limits<std::uint64_t>::max() / dim) {
          fail("tensor " + t.name + " has an invalid dimension " + std::to_string(dim));
        }
        elements *= dim;
        t.dims.push_back(dim);
      }
      t.type = read<std::uint32_t>(t.name + " (type)");
      t.offset = read<std::uint64_t>(t.name + " (offset)");
      const TypeTraits traits = type_traits(t.type);
      if (traits.block_bytes == 0) {
        fail("tensor " + t.name + " has unknown ggml type " + std::to_string(t.type));
      }
      if (t.dims[0] % traits.block_elements != 0) {
        fail("tensor " + t.name + " of type " + std::string(traits.name) + ": first dimension " +
             std::to_string(t.dims[0]) + " is not a multiple of the block size " +
             std::to_string(traits.block_elements));
      }
      // The byte size must not wrap around: a wrapped size would pass the bounds check below.
      if (elements / traits.block_elements >
          std::numeric_limits<std::uint64_t>::max() / traits.block_bytes) {
        fail("tensor " + t.name + " of shape " + t.shape() + " and type " +
             std::string(traits.name) + " is larger than any file (its size overflows 64 bits)");
      }
      t.bytes = elements / traits.block_elements * traits.block_bytes;
      if (t.offset % alignment_ != 0) {
        fail("tensor " + t.name + " has offset " + std::to_string(t.offset) +
             ", not a multiple of the alignment " + std::to_string(alignment_));
      }
      if (!tensor_index_.emplace(t.name, tensors_.size()).second) {
        fail("duplicate tensor " + t.name);
      }
      tensors_.push_back(std::move(t));
    }
    const std::uint64_t data_start = (at_ + alignment_ - 1) / alignment_ * alignment_;
    for (TensorInfo& t : tensors_) {
      const std::uint64_t size = bytes_.size();
      if (data_start > size || t.offset > size - data_start ||
          t.bytes > size - data_start - t.offset) {
        fail("truncated: tensor " + t.name + " (" + std::to_string(t.bytes) +
             " bytes at data offset " + std::to_string(t.offset) +
             ") runs past the end of the file (" + std::to_string(size) + " bytes)");
      }
      t.offset += data_start;
    }
  }

  static std::string hex(unsigned char c) {
    const char* digits = "0123456789abcdef";
    return {digits[c >> 4U], digits[c & 15U]};
  }

  std::string path_;
  std::vector<unsigned char> bytes_;
  std::size_t at_ = 0;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> tensor_index_;
};

}  // namespace llama
