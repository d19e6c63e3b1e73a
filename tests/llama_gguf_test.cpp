// The loading side of the llama engine example (examples/llama): the GGUF reader
// (llama::GgufFile), tensor dequantisation (F32, F16, BF16, Q8_0, Q4_0, Q4_1) through
// llama::Model, the model configuration read from metadata, and the SentencePiece tokenizer,
// checked against the token ids the training script's Python tokenizer stored in the
// shipped reference.gguf. The rejected inputs are the catalogue in tests/llama_errors_test.cpp.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "llama/gguf.hpp"
#include "llama/model.hpp"
#include "llama/tokenizer.hpp"
#include "support/gguf_writer.hpp"

namespace {

using specdec::testing::GgufWriter;
using specdec::testing::TinyLlama;

// ggml tensor type ids (llama::tensor_type) as GgufWriter::add_tensor takes them.
constexpr std::uint32_t ggml_f32 = 0;
constexpr std::uint32_t ggml_f16 = 1;
constexpr std::uint32_t ggml_q4_0 = 2;
constexpr std::uint32_t ggml_q4_1 = 3;
constexpr std::uint32_t ggml_q8_0 = 8;
constexpr std::uint32_t ggml_q4_k = 12;
constexpr std::uint32_t ggml_i8 = 24;
constexpr std::uint32_t ggml_i32 = 26;
constexpr std::uint32_t ggml_bf16 = 30;

/// A directory of its own for one test case, removed with everything in it at the end.
class Scratch {
 public:
  explicit Scratch(const std::string& name)
      : directory_(specdec::testing::scratch_directory("llama-gguf-" + name)) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(directory_, ignored);
  }
  [[nodiscard]] std::string file(const std::string& name) const {
    return (directory_ / name).string();
  }

 private:
  std::filesystem::path directory_;
};

/// Appends the bytes of `value` (little-endian on the machines the tests run on, as GGUF).
template <class T>
void append(std::vector<unsigned char>& out, T value) {
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

/// The value bytes of a GGUF array (element type, count, elements) for GgufWriter::add_raw.
template <class T>
std::vector<unsigned char> array_bytes(llama::value_type element, const std::vector<T>& values) {
  std::vector<unsigned char> out;
  append(out, static_cast<std::uint32_t>(element));
  append(out, static_cast<std::uint64_t>(values.size()));
  for (const T& v : values) append(out, v);
  return out;
}

constexpr auto array_type = static_cast<std::uint32_t>(llama::value_type::array);

/// prefix + n. Appended rather than written "prefix" + std::to_string(n): GCC 12 at -O3 gives
/// a false -Wrestrict warning for that (GCC bug 105329), an error with -Werror.
std::string numbered(std::string prefix, std::uint64_t n) {
  return prefix.append(std::to_string(n));
}

float bits_to_float(std::uint32_t bits) {
  return std::bit_cast<float>(bits);
}

/// Equal as stored values: the same bits, or both NaN (a NaN's payload is not compared).
bool same_value(float actual, float expected) {
  if (std::isnan(expected)) return std::isnan(actual);
  return std::bit_cast<std::uint32_t>(actual) == std::bit_cast<std::uint32_t>(expected);
}

/// "none" when every actual[i] is same_value as expected(i); otherwise the first difference,
/// as "value <i>: <actual>, expected <expected>" (one line in a failure, not one per value).
template <class Expected>
std::string first_difference(const std::vector<float>& actual, const Expected& expected) {
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const float wanted = expected(i);
    if (!same_value(actual[i], wanted)) {
      return numbered("value ", i) + ": " + std::to_string(actual[i]) + ", expected " +
             std::to_string(wanted);
    }
  }
  return "none";
}

// ---- hand-made quantised blocks ------------------------------------------------------------

// Block scales as IEEE half bit patterns and their exact values: products with small
// integers are exact in float, so the expected values below are exact.
constexpr std::uint16_t scale_bits[] = {0x3C00, 0x3800, 0x4000, 0xB400};  // 1, 0.5, 2, -0.25
constexpr float scale_values[] = {1.0F, 0.5F, 2.0F, -0.25F};
constexpr std::uint16_t minimum_bits[] = {0xBC00, 0x3800, 0x4200};  // -1, 0.5, 3
constexpr float minimum_values[] = {-1.0F, 0.5F, 3.0F};

/// Q8_0 quant j of block b: every int8 from -128 to 127 occurs.
std::int8_t q8_quant(std::size_t block, std::size_t j) {
  return static_cast<std::int8_t>(static_cast<int>((j * 8 + block) % 256) - 128);
}
/// 4-bit quant j of block b; values j and 16 + j differ, so a wrong nibble order shows.
unsigned q4_quant(std::size_t block, std::size_t j) {
  return static_cast<unsigned>((j + 5 * (j / 16) + block) % 16);
}

std::vector<unsigned char> q8_0_blocks(std::size_t blocks) {
  std::vector<unsigned char> out;
  for (std::size_t b = 0; b < blocks; ++b) {
    append(out, scale_bits[b % 4]);
    for (std::size_t j = 0; j < 32; ++j) append(out, q8_quant(b, j));
  }
  return out;
}
/// Q4_0 / Q4_1 packing: byte i holds value i in its low nibble and value 16 + i in its high.
void append_nibbles(std::vector<unsigned char>& out, std::size_t block) {
  for (std::size_t i = 0; i < 16; ++i) {
    out.push_back(static_cast<unsigned char>(q4_quant(block, i) | (q4_quant(block, 16 + i) << 4U)));
  }
}
std::vector<unsigned char> q4_0_blocks(std::size_t blocks) {
  std::vector<unsigned char> out;
  for (std::size_t b = 0; b < blocks; ++b) {
    append(out, scale_bits[b % 4]);
    append_nibbles(out, b);
  }
  return out;
}
std::vector<unsigned char> q4_1_blocks(std::size_t blocks) {
  std::vector<unsigned char> out;
  for (std::size_t b = 0; b < blocks; ++b) {
    append(out, scale_bits[b % 4]);
    append(out, minimum_bits[b % 3]);
    append_nibbles(out, b);
  }
  return out;
}
float q8_0_value(std::size_t i) {
  return scale_values[(i / 32) % 4] * static_cast<float>(q8_quant(i / 32, i % 32));
}
float q4_0_value(std::size_t i) {
  return scale_values[(i / 32) % 4] *
         static_cast<float>(static_cast<int>(q4_quant(i / 32, i % 32)) - 8);
}
float q4_1_value(std::size_t i) {
  return scale_values[(i / 32) % 4] * static_cast<float>(q4_quant(i / 32, i % 32)) +
         minimum_values[(i / 32) % 3];
}

/// Half bit patterns with every kind of value first (zeros, subnormals, the normal
/// boundary, the largest finite, infinities, quiet and signalling NaN), then a spread.
std::vector<std::uint16_t> half_patterns(std::size_t count) {
  std::vector<std::uint16_t> out = {0x0000, 0x8000, 0x0001, 0x8001, 0x0200, 0x03FF, 0x0400, 0x3C00,
                                    0xC000, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x3555};
  for (std::size_t i = out.size(); i < count; ++i) {
    out.push_back(static_cast<std::uint16_t>((i * 40503U) & 0xFFFFU));
  }
  out.resize(count);
  return out;
}
/// BF16 patterns: 1, -3, pi's 3.140625, +-inf, NaN, the smallest subnormal, -0, then a spread.
std::vector<std::uint16_t> bfloat_patterns(std::size_t count) {
  std::vector<std::uint16_t> out = {0x3F80, 0xC040, 0x4049, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x8000};
  for (std::size_t i = out.size(); i < count; ++i) {
    out.push_back(static_cast<std::uint16_t>((i * 52711U) & 0xFFFFU));
  }
  out.resize(count);
  return out;
}
std::vector<unsigned char> sixteen_bit_bytes(const std::vector<std::uint16_t>& patterns) {
  std::vector<unsigned char> out;
  for (const std::uint16_t p : patterns) append(out, p);
  return out;
}
float bfloat_value(std::uint16_t bits) {
  return bits_to_float(static_cast<std::uint32_t>(bits) << 16U);
}

/// F32 values with the corner cases a byte-wise copy must keep.
std::vector<float> float_values(std::size_t count) {
  std::vector<float> out = {0.0F,
                            -0.0F,
                            1.5F,
                            -1e-30F,
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (std::size_t i = out.size(); i < count; ++i) {
    out.push_back(static_cast<float>(i) * 0.25F - 7.0F);
  }
  out.resize(count);
  return out;
}
std::vector<unsigned char> float_bytes(const std::vector<float>& values) {
  std::vector<unsigned char> out;
  for (const float v : values) append(out, v);
  return out;
}

/// Writes a tiny model (`shape`, then `edit`) and loads it.
llama::Model load_model(const std::string& path, const TinyLlama& shape,
                        const std::function<void(GgufWriter&)>& edit = {}) {
  GgufWriter w;
  specdec::testing::add_tiny_llama(w, shape);
  if (edit) edit(w);
  w.write(path);
  return llama::Model(path);
}

/// A tokenizer from a file holding only tokenizer.ggml.* (model "llama", add_space_prefix
/// false unless `edit` says otherwise).
llama::Tokenizer make_tokenizer(const std::string& path, const std::vector<std::string>& tokens,
                                const std::vector<float>& scores,
                                const std::vector<std::int32_t>& types,
                                const std::function<void(GgufWriter&)>& edit = {}) {
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_strings("tokenizer.ggml.tokens", tokens);
  w.add_f32s("tokenizer.ggml.scores", scores);
  w.add_i32s("tokenizer.ggml.token_type", types);
  w.add_bool("tokenizer.ggml.add_space_prefix", false);
  if (edit) edit(w);
  w.write(path);
  return llama::Tokenizer(llama::GgufFile(path));
}

/// The token strings of `ids` (readable failure messages for the merge-order checks).
std::vector<std::string> texts(const llama::Tokenizer& tokenizer,
                               const std::vector<llama::token>& ids) {
  std::vector<std::string> out;
  for (const llama::token id : ids) out.push_back(tokenizer.text(id));
  return out;
}

constexpr std::int32_t kind_normal = 1, kind_unknown = 2, kind_control = 3, kind_user = 4,
                       kind_unused = 5, kind_byte = 6;

const std::string space = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

}  // namespace

// ---- GgufFile ------------------------------------------------------------------------------

TEST_CASE("GgufFile reads every metadata value type") {
  const Scratch scratch("values");
  GgufWriter w;
  w.add_u8("t.u8", 200);
  w.add_i8("t.i8", -100);
  w.add_u16("t.u16", 60000);
  w.add_i16("t.i16", -30000);
  w.add_u32("t.u32", 4000000000U);
  w.add_i32("t.i32", -2000000000);
  w.add_i32("t.i32_positive", 7);
  w.add_f32("t.f32", 1.5F);
  w.add_bool("t.true", true);
  w.add_bool("t.false", false);
  w.add_string("t.string", "h\xC3\xA9llo");
  w.add_string("t.empty_string", "");
  w.add_u64("t.u64", (std::uint64_t{1} << 63U) + 5);
  w.add_i64("t.i64", -(std::int64_t{1} << 62U));
  w.add_f64("t.f64", 0.1);
  w.add_strings("t.strings", {"a", "", space + "b"});
  w.add_i32s("t.i32s", {-1, 0, 7});
  w.add_f32s("t.f32s", {0.5F, -2.0F});
  w.add_raw("t.u8s", array_type, array_bytes<std::uint8_t>(llama::value_type::uint8, {1, 2, 255}));
  w.add_raw("t.i8s", array_type, array_bytes<std::int8_t>(llama::value_type::int8, {-3, 4}));
  w.add_raw("t.u16s", array_type, array_bytes<std::uint16_t>(llama::value_type::uint16, {65535}));
  w.add_raw("t.i16s", array_type, array_bytes<std::int16_t>(llama::value_type::int16, {-32768}));
  w.add_raw("t.u32s", array_type, array_bytes<std::uint32_t>(llama::value_type::uint32, {7, 8}));
  w.add_raw("t.u64s", array_type,
            array_bytes<std::uint64_t>(llama::value_type::uint64, {5, std::uint64_t{1} << 40U}));
  w.add_raw("t.i64s", array_type, array_bytes<std::int64_t>(llama::value_type::int64, {-9, 9}));
  w.add_raw("t.bools", array_type, array_bytes<std::uint8_t>(llama::value_type::boolean, {1, 0}));
  w.add_raw("t.f64s", array_type, array_bytes<double>(llama::value_type::float64, {0.25, 1e300}));
  w.add_raw("t.no_strings", array_type,
            array_bytes<std::uint64_t>(llama::value_type::string, {}));  // an empty array
  const std::string path = scratch.file("values.gguf");
  w.write(path);
  const llama::GgufFile file(path);

  CHECK(file.path() == path);
  CHECK(file.version() == 3);
  CHECK(file.alignment() == 32);
  CHECK(file.tensors().empty());
  CHECK(file.metadata().size() == 28);
  using llama::value_type;
  const auto value = [&](const std::string& key) -> const llama::Value& {
    const llama::Value* v = file.find(key);
    REQUIRE(v != nullptr);
    return *v;
  };
  CHECK(value("t.u8").type == value_type::uint8);
  CHECK(value("t.u8").unsigned_value == 200);
  CHECK(value("t.i8").type == value_type::int8);
  CHECK(value("t.i8").signed_value == -100);
  CHECK(value("t.u16").type == value_type::uint16);
  CHECK(value("t.u16").unsigned_value == 60000);
  CHECK(value("t.i16").type == value_type::int16);
  CHECK(value("t.i16").signed_value == -30000);
  CHECK(value("t.u32").type == value_type::uint32);
  CHECK(value("t.u32").unsigned_value == 4000000000U);
  CHECK(value("t.i32").type == value_type::int32);
  CHECK(value("t.i32").signed_value == -2000000000);
  CHECK(value("t.f32").type == value_type::float32);
  CHECK(value("t.f32").real_value == 1.5);
  CHECK(value("t.true").type == value_type::boolean);
  CHECK(value("t.true").unsigned_value == 1);
  CHECK(value("t.false").unsigned_value == 0);
  CHECK(value("t.string").type == value_type::string);
  CHECK(value("t.string").string_value == "h\xC3\xA9llo");
  CHECK(value("t.empty_string").string_value.empty());
  CHECK(value("t.u64").type == value_type::uint64);
  CHECK(value("t.u64").unsigned_value == (std::uint64_t{1} << 63U) + 5);
  CHECK(value("t.i64").type == value_type::int64);
  CHECK(value("t.i64").signed_value == -(std::int64_t{1} << 62U));
  CHECK(value("t.f64").type == value_type::float64);
  CHECK(value("t.f64").real_value == 0.1);

  const llama::Value& strings = value("t.strings");
  CHECK(strings.type == value_type::array);
  CHECK(strings.element_type == value_type::string);
  CHECK(strings.element_count == 3);
  CHECK(strings.strings == std::vector<std::string>{"a", "", space + "b"});
  CHECK(value("t.i32s").element_type == value_type::int32);
  CHECK(value("t.i32s").integers == std::vector<std::int64_t>{-1, 0, 7});
  CHECK(value("t.f32s").element_type == value_type::float32);
  CHECK(value("t.f32s").reals == std::vector<double>{0.5, -2.0});
  CHECK(value("t.u8s").integers == std::vector<std::int64_t>{1, 2, 255});
  CHECK(value("t.i8s").integers == std::vector<std::int64_t>{-3, 4});
  CHECK(value("t.u16s").integers == std::vector<std::int64_t>{65535});
  CHECK(value("t.i16s").integers == std::vector<std::int64_t>{-32768});
  CHECK(value("t.u32s").integers == std::vector<std::int64_t>{7, 8});
  CHECK(value("t.u64s").integers == std::vector<std::int64_t>{5, std::int64_t{1} << 40U});
  CHECK(value("t.i64s").integers == std::vector<std::int64_t>{-9, 9});
  CHECK(value("t.bools").element_type == value_type::boolean);
  CHECK(value("t.bools").integers == std::vector<std::int64_t>{1, 0});
  CHECK(value("t.f64s").reals == std::vector<double>{0.25, 1e300});
  CHECK(value("t.no_strings").element_count == 0);
  CHECK(value("t.no_strings").strings.empty());
  CHECK(file.find("t.absent") == nullptr);
}

TEST_CASE("GgufFile typed accessors convert what fits and name the key otherwise") {
  const Scratch scratch("accessors");
  GgufWriter w;
  w.add_u8("t.u8", 200);
  w.add_u16("t.u16", 60000);
  w.add_u64("t.u64", std::uint64_t{1} << 40U);
  w.add_i32("t.i32_positive", 7);
  w.add_i8("t.i8_negative", -1);
  w.add_f32("t.f32", 0.75F);
  w.add_f64("t.f64", -2.5);
  w.add_bool("t.bool", true);
  w.add_string("t.string", "text");
  w.add_strings("t.strings", {"x", "y"});
  w.add_i32s("t.i32s", {3, -4});
  w.add_f32s("t.f32s", {0.5F});
  w.add_raw("t.u8s", array_type, array_bytes<std::uint8_t>(llama::value_type::uint8, {9}));
  w.add_raw("t.f64s", array_type, array_bytes<double>(llama::value_type::float64, {0.125}));
  w.add_raw("t.bools", array_type, array_bytes<std::uint8_t>(llama::value_type::boolean, {1}));
  const std::string path = scratch.file("accessors.gguf");
  w.write(path);
  const llama::GgufFile file(path);
  using Catch::Matchers::Equals;
  using llama::value_type;

  CHECK(file.string("t.string") == "text");
  CHECK(file.optional_string("t.string") == "text");
  CHECK_FALSE(file.optional_string("t.absent").has_value());
  CHECK(file.unsigned_integer("t.u8") == 200);
  CHECK(file.unsigned_integer("t.u16") == 60000);
  CHECK(file.unsigned_integer("t.u64") == std::uint64_t{1} << 40U);
  CHECK(file.unsigned_integer("t.i32_positive") == 7);  // a signed value that fits
  CHECK(file.optional_unsigned("t.u8") == 200U);
  CHECK_FALSE(file.optional_unsigned("t.absent").has_value());
  CHECK(file.real("t.f32") == 0.75);
  CHECK(file.real("t.f64") == -2.5);
  CHECK(file.optional_real("t.f64") == -2.5);
  CHECK_FALSE(file.optional_real("t.absent").has_value());
  CHECK(file.optional_bool("t.bool") == true);
  CHECK_FALSE(file.optional_bool("t.absent").has_value());
  CHECK(file.array("t.strings", value_type::string).strings == std::vector<std::string>{"x", "y"});
  CHECK(file.array("t.i32s", value_type::int32).integers == std::vector<std::int64_t>{3, -4});
  // Integer arrays of any width (bool included) serve an integer request; float32 and
  // float64 arrays serve either float request.
  CHECK(file.array("t.u8s", value_type::int32).integers == std::vector<std::int64_t>{9});
  CHECK(file.array("t.bools", value_type::int32).integers == std::vector<std::int64_t>{1});
  CHECK(file.array("t.f32s", value_type::float64).reals == std::vector<double>{0.5});
  CHECK(file.array("t.f64s", value_type::float32).reals == std::vector<double>{0.125});

  // Every failure is a model_error "<file>: <problem>" naming the key.
  const auto failure = [&](const std::function<void()>& call) {
    try {
      call();
    } catch (const llama::model_error& e) {
      CHECK(e.file() == path);
      return std::string(e.what());
    }
    FAIL("no model_error");
    return std::string();
  };
  CHECK_THAT(failure([&] { (void)file.string("t.absent"); }),
             Equals(path + ": missing metadata key t.absent"));
  CHECK_THAT(failure([&] { (void)file.unsigned_integer("t.absent"); }),
             Equals(path + ": missing metadata key t.absent"));
  CHECK_THAT(failure([&] { (void)file.array("t.absent", value_type::string); }),
             Equals(path + ": missing metadata key t.absent"));
  CHECK_THAT(failure([&] { (void)file.string("t.u8"); }),
             Equals(path + ": metadata key t.u8 is uint8, expected a string"));
  CHECK_THAT(failure([&] { (void)file.optional_string("t.u8"); }),
             Equals(path + ": metadata key t.u8 is uint8, expected a string"));
  CHECK_THAT(
      failure([&] { (void)file.unsigned_integer("t.i8_negative"); }),
      Equals(path + ": metadata key t.i8_negative is int8, expected a non-negative integer"));
  CHECK_THAT(failure([&] { (void)file.unsigned_integer("t.bool"); }),
             Equals(path + ": metadata key t.bool is bool, expected a non-negative integer"));
  CHECK_THAT(failure([&] { (void)file.unsigned_integer("t.f32"); }),
             Equals(path + ": metadata key t.f32 is float32, expected a non-negative integer"));
  CHECK_THAT(failure([&] { (void)file.real("t.u16"); }),
             Equals(path + ": metadata key t.u16 is uint16, expected a floating-point number"));
  CHECK_THAT(failure([&] { (void)file.optional_bool("t.u8"); }),
             Equals(path + ": metadata key t.u8 is uint8, expected a bool"));
  CHECK_THAT(failure([&] { (void)file.array("t.string", value_type::string); }),
             Equals(path + ": metadata key t.string is string, expected an array of string"));
  CHECK_THAT(
      failure([&] { (void)file.array("t.strings", value_type::int32); }),
      Equals(path + ": metadata key t.strings is array of string, expected an array of int32"));
  CHECK_THAT(
      failure([&] { (void)file.array("t.i32s", value_type::float32); }),
      Equals(path + ": metadata key t.i32s is array of int32, expected an array of float32"));
  CHECK_THAT(
      failure([&] { (void)file.array("t.f32s", value_type::string); }),
      Equals(path + ": metadata key t.f32s is array of float32, expected an array of string"));
}

TEST_CASE("GgufFile reads versions 2 and 3") {
  const Scratch scratch("versions");
  GgufWriter w;
  w.add_u32("t.value", 5);
  w.add_tensor("t.weight", {2}, ggml_f32, float_bytes({1.0F, 2.0F}));
  for (const std::uint32_t version : {2U, 3U}) {
    const std::string path = scratch.file(numbered("v", version) + ".gguf");
    w.write(path, version);
    const llama::GgufFile file(path);
    CHECK(file.version() == version);
    CHECK(file.unsigned_integer("t.value") == 5);
    REQUIRE(file.tensors().size() == 1);
    CHECK(file.tensors()[0].bytes == 8);
  }
}

TEST_CASE("GgufFile tensor infos: dims, type, absolute offsets and byte sizes") {
  const Scratch scratch("tensors");
  struct Expected {
    std::string name;
    std::vector<std::uint64_t> dims;
    std::uint32_t type;
    std::uint64_t bytes;
    std::string shape;
  };
  // Byte sizes by hand: blocks of 32 (Q8_0 34 bytes, Q4_0 18, Q4_1 20), Q4_K blocks of 256
  // in 144 bytes; a file may hold types the engine does not load (Q4_K, I8, I32).
  const std::vector<Expected> expected = {
      {"f32.weight", {3, 2}, ggml_f32, 24, "[3, 2]"},
      {"f16.weight", {5}, ggml_f16, 10, "[5]"},
      {"bf16.weight", {4, 1}, ggml_bf16, 8, "[4, 1]"},
      {"q8_0.weight", {64, 2}, ggml_q8_0, 136, "[64, 2]"},
      {"q4_0.weight", {32, 3}, ggml_q4_0, 54, "[32, 3]"},
      {"q4_1.weight", {32}, ggml_q4_1, 20, "[32]"},
      {"q4_k.weight", {256}, ggml_q4_k, 144, "[256]"},
      {"i8.weight", {7}, ggml_i8, 7, "[7]"},
      {"i32.weight", {2, 3, 4}, ggml_i32, 96, "[2, 3, 4]"},
      {"four.weight", {1, 2, 1, 3}, ggml_f32, 24, "[1, 2, 1, 3]"},
  };
  GgufWriter w;
  std::vector<std::vector<unsigned char>> payloads;
  std::uint64_t infos = 0;  // bytes of the tensor infos
  for (std::size_t i = 0; i < expected.size(); ++i) {
    std::vector<unsigned char> payload(expected[i].bytes);
    for (std::size_t b = 0; b < payload.size(); ++b) {
      payload[b] = static_cast<unsigned char>(i * 31 + b);
    }
    w.add_tensor(expected[i].name, expected[i].dims, expected[i].type, payload);
    payloads.push_back(payload);
    infos += 8 + expected[i].name.size() + 4 + 8 * expected[i].dims.size() + 4 + 8;
  }
  const std::string path = scratch.file("tensors.gguf");
  w.write(path);
  const llama::GgufFile file(path);

  REQUIRE(file.tensors().size() == expected.size());
  // The data section starts at the first multiple of 32 after the 24-byte header (no
  // metadata here) and the infos; each tensor's data at the next multiple of 32.
  std::uint64_t offset = (24 + infos + 31) / 32 * 32;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const llama::TensorInfo& t = file.tensors()[i];
    INFO("tensor " << expected[i].name);
    CHECK(t.name == expected[i].name);
    CHECK(t.dims == expected[i].dims);
    CHECK(t.type == expected[i].type);
    CHECK(t.bytes == expected[i].bytes);
    CHECK(t.shape() == expected[i].shape);
    CHECK(t.offset == offset);
    CHECK(file.find_tensor(expected[i].name) == &t);
    CHECK(std::memcmp(file.data(t), payloads[i].data(), payloads[i].size()) == 0);
    offset = (offset + t.bytes + 31) / 32 * 32;
  }
  CHECK(file.tensors()[8].elements() == 24);
  CHECK(file.tensors()[3].elements() == 128);
  CHECK(file.find_tensor("absent.weight") == nullptr);
  CHECK(std::filesystem::file_size(path) == offset);
}

TEST_CASE("GgufFile alignment: 32 by default, general.alignment when given") {
  const Scratch scratch("alignment");
  for (const std::uint32_t alignment : {0U, 1U, 8U, 64U, 256U}) {  // 0: no general.alignment
    INFO("general.alignment " << alignment);
    GgufWriter w;
    if (alignment != 0) {
      w.add_u32("general.alignment", alignment);
      w.set_alignment(alignment);
    }
    w.add_string("general.name", "aligned");
    const std::vector<std::uint64_t> sizes = {3, 5, 1, 7};  // I8: one byte per element
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<unsigned char> payload(sizes[i], static_cast<unsigned char>(0xA0 + i));
      w.add_tensor(numbered("t", i), {sizes[i]}, ggml_i8, payload);
    }
    const std::string path = scratch.file("aligned.gguf");
    w.write(path);
    const llama::GgufFile file(path);
    const std::uint64_t used = alignment != 0 ? alignment : 32;
    CHECK(file.alignment() == used);
    REQUIRE(file.tensors().size() == sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const llama::TensorInfo& t = file.tensors()[i];
      CHECK(t.offset % used == 0);
      CHECK(t.bytes == sizes[i]);
      if (i > 0) {
        const llama::TensorInfo& previous = file.tensors()[i - 1];
        CHECK(t.offset == (previous.offset + previous.bytes + used - 1) / used * used);
      }
      const unsigned char* data = file.data(t);
      for (std::size_t b = 0; b < sizes[i]; ++b)
        CHECK(static_cast<std::size_t>(data[b]) == 0xA0 + i);
    }
  }
}

// ---- dequantisation ------------------------------------------------------------------------

TEST_CASE("half_to_float of known bit patterns") {
  CHECK(same_value(llama::half_to_float(0x0000), 0.0F));
  CHECK(same_value(llama::half_to_float(0x8000), -0.0F));
  CHECK(std::signbit(llama::half_to_float(0x8000)));
  CHECK(llama::half_to_float(0x3C00) == 1.0F);
  CHECK(llama::half_to_float(0xC000) == -2.0F);
  CHECK(llama::half_to_float(0x3555) == 0.333251953125F);
  CHECK(llama::half_to_float(0x7BFF) == 65504.0F);
  CHECK(llama::half_to_float(0xFBFF) == -65504.0F);
  CHECK(llama::half_to_float(0x0400) == std::ldexp(1.0F, -14));  // smallest normal
  // Subnormals: m * 2^-24.
  CHECK(llama::half_to_float(0x0001) == std::ldexp(1.0F, -24));
  CHECK(llama::half_to_float(0x8001) == -std::ldexp(1.0F, -24));
  CHECK(llama::half_to_float(0x0200) == std::ldexp(1.0F, -15));
  CHECK(llama::half_to_float(0x03FF) == std::ldexp(1023.0F, -24));
  CHECK(llama::half_to_float(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(llama::half_to_float(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(llama::half_to_float(0x7E00)));
  CHECK(std::isnan(llama::half_to_float(0x7C01)));  // signalling: still a NaN
  CHECK(std::isnan(llama::half_to_float(0xFFFF)));
}

TEST_CASE("float_to_half rounds to nearest even and round-trips every half") {
  // Every non-NaN pattern comes back unchanged; a NaN comes back a NaN of the same sign.
  std::size_t round_trips = 0;
  std::string first_wrong = "none";
  for (std::uint32_t bits = 0; bits <= 0xFFFFU; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f = llama::half_to_float(h);
    const std::uint16_t back = llama::float_to_half(f);
    const bool ok = std::isnan(f) ? (back & 0x7C00U) == 0x7C00U && (back & 0x03FFU) != 0 &&
                                        (back & 0x8000U) == (h & 0x8000U)
                                  : back == h;
    if (!ok && first_wrong == "none") {
      first_wrong = numbered("pattern ", h) + numbered(" came back as ", back);
    }
    if (ok && !std::isnan(f)) ++round_trips;
  }
  CHECK(first_wrong == "none");
  CHECK(round_trips == 65536 - 2 * 1023);  // all but the NaNs (2 signs x 1023 payloads)

  const float ulp = std::ldexp(1.0F, -10);                             // of halves in [1, 2)
  CHECK(llama::float_to_half(1.0F + ulp / 2) == 0x3C00);               // tie: to the even 1.0
  CHECK(llama::float_to_half(1.0F + 3 * ulp / 2) == 0x3C02);           // tie: to the even 1 + 2 ulp
  CHECK(llama::float_to_half(1.0F + ulp / 2 + ulp / 1024) == 0x3C01);  // above the tie
  CHECK(llama::float_to_half(65519.0F) == 0x7BFF);
  CHECK(llama::float_to_half(65520.0F) == 0x7C00);  // the tie above 65504 goes to infinity
  CHECK(llama::float_to_half(1e9F) == 0x7C00);
  CHECK(llama::float_to_half(-1e9F) == 0xFC00);
  CHECK(llama::float_to_half(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK(llama::float_to_half(-0.0F) == 0x8000);
  CHECK(llama::float_to_half(std::ldexp(1.0F, -25)) == 0x0000);   // tie: to the even 0
  CHECK(llama::float_to_half(-std::ldexp(1.0F, -25)) == 0x8000);  // keeps the sign
  CHECK(llama::float_to_half(std::ldexp(3.0F, -26)) == 0x0001);   // 1.5 x 2^-25
  CHECK(llama::float_to_half(std::ldexp(5.0F, -25)) == 0x0002);   // 2.5 subnormal units
  CHECK(llama::float_to_half(std::ldexp(7.0F, -25)) == 0x0004);   // 3.5 subnormal units
  CHECK(llama::float_to_half(std::ldexp(1.0F, -14) - std::ldexp(1.0F, -25)) == 0x0400);
  CHECK(llama::float_to_half(std::numeric_limits<float>::denorm_min()) == 0x0000);
  const std::uint16_t nan = llama::float_to_half(std::numeric_limits<float>::quiet_NaN());
  CHECK((nan & 0x7C00U) == 0x7C00U);
  CHECK((nan & 0x03FFU) != 0);
}

TEST_CASE("Model dequantises F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors") {
  const Scratch scratch("dequantise");
  TinyLlama shape;
  shape.vocab = 64;
  shape.dim = 32;
  shape.layers = 1;
  shape.heads = 2;
  shape.kv_heads = 2;
  shape.ffn = 32;
  const std::size_t square = 32 * 32;
  const std::vector<std::uint16_t> halves = half_patterns(square);
  const std::vector<std::uint16_t> bfloats = bfloat_patterns(square);
  const std::vector<float> floats = float_values(square);
  const std::vector<std::uint16_t> norm_halves = half_patterns(32);
  const std::vector<std::uint16_t> norm_bfloats = bfloat_patterns(32);
  const llama::Model model = load_model(scratch.file("quantised.gguf"), shape, [&](GgufWriter& w) {
    const auto replace = [&](const std::string& name, std::vector<std::uint64_t> dims,
                             std::uint32_t type, std::vector<unsigned char> data) {
      REQUIRE(w.remove_tensor(name));
      w.add_tensor(name, std::move(dims), type, std::move(data));
    };
    replace("token_embd.weight", {32, 64}, ggml_q8_0, q8_0_blocks(64));
    replace("blk.0.attn_q.weight", {32, 32}, ggml_q4_0, q4_0_blocks(32));
    replace("blk.0.attn_k.weight", {32, 32}, ggml_q4_1, q4_1_blocks(32));
    replace("blk.0.attn_v.weight", {32, 32}, ggml_f16, sixteen_bit_bytes(halves));
    replace("blk.0.attn_output.weight", {32, 32}, ggml_bf16, sixteen_bit_bytes(bfloats));
    replace("blk.0.ffn_gate.weight", {32, 32}, ggml_f32, float_bytes(floats));
    replace("blk.0.attn_norm.weight", {32}, ggml_f16, sixteen_bit_bytes(norm_halves));
    replace("output_norm.weight", {32}, ggml_bf16, sixteen_bit_bytes(norm_bfloats));
  });
  const llama::Layer& layer = model.layers().at(0);

  SECTION("Q8_0: x = d q, int8 q, one f16 scale per 32 values") {
    const llama::Matrix& m = model.embedding();
    REQUIRE(m.rows == 64);
    REQUIRE(m.cols == 32);
    CHECK(m.row(0)[0] == -128.0F);  // q = -128, d = 1
    CHECK(m.row(0)[31] == 120.0F);
    CHECK(m.row(1)[0] == -63.5F);    // q = -127, d = 0.5
    CHECK(m.row(3)[1] == 29.25F);    // q = -117, d = -0.25
    CHECK(m.row(7)[31] == -31.75F);  // q = 127, d = -0.25
    CHECK(first_difference(m.data, q8_0_value) == "none");
  }
  SECTION("Q4_0: x = d (q - 8), byte i holds values i (low nibble) and 16 + i (high)") {
    const llama::Matrix& m = layer.q;
    REQUIRE(m.rows == 32);
    REQUIRE(m.cols == 32);
    CHECK(m.row(0)[0] == -8.0F);   // q = 0
    CHECK(m.row(0)[15] == 7.0F);   // q = 15
    CHECK(m.row(0)[16] == -3.0F);  // q = 5
    CHECK(m.row(1)[0] == -3.5F);   // q = 1, d = 0.5
    CHECK(first_difference(m.data, q4_0_value) == "none");
  }
  SECTION("Q4_1: x = d q + m") {
    const llama::Matrix& m = layer.k;
    CHECK(m.row(0)[0] == -1.0F);   // q = 0, m = -1
    CHECK(m.row(0)[15] == 14.0F);  // q = 15
    CHECK(m.row(1)[16] == 3.5F);   // q = 6, d = 0.5, m = 0.5
    CHECK(m.row(2)[0] == 7.0F);    // q = 2, d = 2, m = 3
    CHECK(first_difference(m.data, q4_1_value) == "none");
  }
  SECTION("F16: zeros, subnormals, infinities and NaN as half_to_float reads them") {
    const llama::Matrix& m = layer.v;
    CHECK(std::signbit(m.data[1]));  // -0
    CHECK(m.data[2] == std::ldexp(1.0F, -24));
    CHECK(m.data[11] == std::numeric_limits<float>::infinity());
    CHECK(std::isnan(m.data[13]));
    CHECK(first_difference(
              m.data, [&](std::size_t i) { return llama::half_to_float(halves[i]); }) == "none");
    CHECK(first_difference(layer.attn_norm, [&](std::size_t i) {
            return llama::half_to_float(norm_halves[i]);
          }) == "none");
  }
  SECTION("BF16: the upper 16 bits of a float") {
    const llama::Matrix& m = layer.o;
    CHECK(m.data[0] == 1.0F);
    CHECK(m.data[1] == -3.0F);
    CHECK(m.data[2] == 3.140625F);
    CHECK(m.data[3] == std::numeric_limits<float>::infinity());
    CHECK(m.data[4] == -std::numeric_limits<float>::infinity());
    CHECK(std::isnan(m.data[5]));
    CHECK(m.data[6] == std::ldexp(1.0F, -133));
    CHECK(std::signbit(m.data[7]));
    CHECK(first_difference(m.data, [&](std::size_t i) { return bfloat_value(bfloats[i]); }) ==
          "none");
    CHECK(first_difference(model.output_norm(),
                           [&](std::size_t i) { return bfloat_value(norm_bfloats[i]); }) == "none");
  }
  SECTION("F32: bit for bit") {
    const llama::Matrix& m = layer.gate;
    CHECK(first_difference(m.data, [&](std::size_t i) { return floats[i]; }) == "none");
    CHECK(std::signbit(m.data[1]));
    CHECK(m.data[4] == std::numeric_limits<float>::denorm_min());
  }
}

// ---- model configuration -------------------------------------------------------------------

TEST_CASE("Model reads its configuration from the metadata") {
  const Scratch scratch("config");
  TinyLlama shape;  // vocab 64, dim 32, 2 layers, 4 heads, 2 KV heads, ffn 48, context 96
  const std::string path = scratch.file("model.gguf");

  SECTION("the tiny model as written") {
    const llama::Model model = load_model(path, shape);
    const llama::Config& c = model.config();
    CHECK(model.path() == path);
    CHECK(c.name == "tiny-test-llama");
    CHECK(c.vocab == 64);
    CHECK(c.dim == 32);
    CHECK(c.layers == 2);
    CHECK(c.heads == 4);
    CHECK(c.kv_heads == 2);
    CHECK(c.head_dim == 8);
    CHECK(c.q_dim() == 32);
    CHECK(c.kv_dim() == 16);
    CHECK(c.ffn == 48);
    CHECK(c.context_length == 96);
    CHECK(c.rope_dims == 8);  // no llama.rope.dimension_count: the head dimension
    CHECK(c.rms_eps == static_cast<double>(1e-5F));
    CHECK(c.rope_base == 10000.0);
    CHECK(c.rope_scale == 1.0);
    CHECK(c.rope_divisors.empty());
    CHECK_FALSE(c.tied_output);
    CHECK(model.layers().size() == 2);
    CHECK(model.tokenizer().size() == 64);
  }
  SECTION("head_count_kv defaults to head_count") {
    shape.kv_heads = shape.heads;
    const llama::Model model = load_model(path, shape, [](GgufWriter& w) {
      REQUIRE(w.remove_metadata("llama.attention.head_count_kv"));
    });
    CHECK(model.config().kv_heads == 4);
    CHECK(model.config().kv_dim() == 32);
  }
  SECTION("rope.dimension_count, rope.freq_base default, general.name default") {
    const llama::Model model = load_model(path, shape, [](GgufWriter& w) {
      w.add_u32("llama.rope.dimension_count", 8);  // the head dimension, as llama.cpp requires
      REQUIRE(w.remove_metadata("llama.rope.freq_base"));
      REQUIRE(w.remove_metadata("general.name"));
    });
    CHECK(model.config().rope_dims == 8);
    CHECK(model.config().rope_base == 10000.0);
    CHECK(model.config().name == path);
  }
  SECTION("rope scaling: linear divides positions by the factor, none leaves them") {
    const llama::Model linear = load_model(path, shape, [](GgufWriter& w) {
      w.add_string("llama.rope.scaling.type", "linear");
      w.add_f32("llama.rope.scaling.factor", 4.0F);
      REQUIRE(w.remove_metadata("llama.rope.freq_base"));
      w.add_f32("llama.rope.freq_base", 500.0F);
    });
    CHECK(linear.config().rope_scale == 0.25);
    CHECK(linear.config().rope_base == 500.0);
    const llama::Model none = load_model(path, shape, [](GgufWriter& w) {
      w.add_string("llama.rope.scaling.type", "none");
      w.add_f32("llama.rope.scaling.factor", 4.0F);  // ignored without linear scaling
    });
    CHECK(none.config().rope_scale == 1.0);
  }
  SECTION("rope scaling as llama.cpp reads it: linear by default, the older scale_linear key") {
    const llama::Model factor_only = load_model(
        path, shape, [](GgufWriter& w) { w.add_f32("llama.rope.scaling.factor", 2.0F); });
    CHECK(factor_only.config().rope_scale == 0.5);
    const llama::Model old_key =
        load_model(path, shape, [](GgufWriter& w) { w.add_f32("llama.rope.scale_linear", 8.0F); });
    CHECK(old_key.config().rope_scale == 0.125);
    const llama::Model linear_without_factor = load_model(
        path, shape, [](GgufWriter& w) { w.add_string("llama.rope.scaling.type", "linear"); });
    CHECK(linear_without_factor.config().rope_scale == 1.0);
    const llama::Model zero = load_model(
        path, shape, [](GgufWriter& w) { w.add_f32("llama.rope.scaling.factor", 0.0F); });
    CHECK(zero.config().rope_scale == 1.0);
  }
  SECTION("rope_freqs.weight: one divisor per rotated pair") {
    const llama::Model model = load_model(path, shape, [](GgufWriter& w) {
      w.add_vector("rope_freqs.weight", {1.0F, 2.0F, 4.5F, 8.0F});  // rope_dims 8: 4 pairs
    });
    CHECK(model.config().rope_divisors == std::vector<double>{1.0, 2.0, 4.5, 8.0});
  }
  SECTION("llama.vocab_size, when present, agrees") {
    const llama::Model model =
        load_model(path, shape, [](GgufWriter& w) { w.add_u32("llama.vocab_size", 64); });
    CHECK(model.config().vocab == 64);
  }
}

TEST_CASE("Model output: tied to the embedding without output.weight, its own otherwise") {
  const Scratch scratch("output");
  TinyLlama shape;
  const std::size_t per_layer = 2 * shape.dim + 2 * shape.dim * shape.dim +
                                2 * (shape.dim / shape.heads) * shape.kv_heads * shape.dim +
                                3 * shape.ffn * shape.dim;
  const std::size_t shared = shape.vocab * shape.dim + shape.layers * per_layer + shape.dim;

  SECTION("tied") {
    shape.tied = true;
    const std::string path = scratch.file("tied.gguf");
    const llama::Model model = load_model(path, shape);
    CHECK(model.config().tied_output);
    CHECK(&model.output() == &model.embedding());
    CHECK(model.parameters() == shared);  // the embedding counted once
    // The embedding holds token_embd.weight as written.
    const llama::GgufFile file(path);
    const llama::TensorInfo* embedding = file.find_tensor("token_embd.weight");
    REQUIRE(embedding != nullptr);
    REQUIRE(embedding->bytes == model.embedding().data.size() * sizeof(float));
    CHECK(std::memcmp(file.data(*embedding), model.embedding().data.data(), embedding->bytes) == 0);
  }
  SECTION("untied") {
    std::vector<float> output(shape.vocab * shape.dim);
    for (std::size_t i = 0; i < output.size(); ++i) output[i] = static_cast<float>(i) / 1024.0F;
    const llama::Model model = load_model(scratch.file("untied.gguf"), shape, [&](GgufWriter& w) {
      REQUIRE(w.remove_tensor("output.weight"));
      w.add_matrix("output.weight", shape.vocab, shape.dim, output, false);
    });
    CHECK_FALSE(model.config().tied_output);
    CHECK(&model.output() != &model.embedding());
    CHECK(model.output().rows == shape.vocab);
    CHECK(model.output().cols == shape.dim);
    CHECK(model.output().data == output);
    CHECK(model.output().data != model.embedding().data);
    CHECK(model.parameters() == shared + shape.vocab * shape.dim);
  }
}

// ---- tokenizer -----------------------------------------------------------------------------

TEST_CASE("Tokenizer reproduces the training script's ids for every reference text") {
  const std::string models = SPECDEC_LLAMA_MODELS;
  const llama::GgufFile reference(models + "/reference.gguf");
  const llama::Tokenizer tokenizer{llama::GgufFile(models + "/target.gguf")};
  const llama::Tokenizer draft_tokenizer{llama::GgufFile(models + "/draft.gguf")};
  CHECK(std::equal(tokenizer.tokens().begin(), tokenizer.tokens().end(),
                   draft_tokenizer.tokens().begin(), draft_tokenizer.tokens().end()));
  const std::uint64_t count = reference.unsigned_integer("reference.text_count");
  REQUIRE(count > 0);
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::string text = reference.string(numbered("reference.text.", i));
    const llama::TensorInfo* stored = reference.find_tensor(numbered("text_ids.", i));
    REQUIRE(stored != nullptr);
    REQUIRE(stored->type == ggml_i32);
    REQUIRE(stored->dims.size() == 1);
    std::vector<llama::token> ids(static_cast<std::size_t>(stored->dims[0]));
    std::memcpy(ids.data(), reference.data(*stored), ids.size() * sizeof(llama::token));
    INFO("reference text " << i << ": \"" << text << "\"");
    const std::vector<llama::token> encoded = tokenizer.encode(text);
    CHECK(encoded == ids);
    CHECK(tokenizer.decode(encoded) == text);
  }
}

TEST_CASE("Tokenizer byte fallback: byte tokens for characters without a token, else unk") {
  const Scratch scratch("bytes");
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<std::int32_t> types = {kind_unknown, kind_control, kind_control};
  const char* digits = "0123456789ABCDEF";
  for (unsigned b = 0; b < 256; ++b) {
    tokens.push_back(std::string("<0x") + digits[b >> 4U] + digits[b & 15U] + ">");
    types.push_back(kind_byte);
  }
  for (const std::string& t : {space, std::string("a"), std::string("b")}) {
    tokens.push_back(t);
    types.push_back(kind_normal);
  }
  const std::vector<float> scores(tokens.size(), 0.0F);
  const llama::Tokenizer with_bytes =
      make_tokenizer(scratch.file("bytes.gguf"), tokens, scores, types);
  const llama::token a = 260, b = 261;
  const auto byte = [](unsigned value) { return static_cast<llama::token>(3 + value); };

  // e-acute is C3 A9, the snowman E2 98 83, the grinning face F0 9F 98 80.
  CHECK(with_bytes.encode("a\xC3\xA9"
                          "b",
                          false) == std::vector<llama::token>{a, byte(0xC3), byte(0xA9), b});
  CHECK(with_bytes.encode("\xE2\x98\x83", false) ==
        std::vector<llama::token>{byte(0xE2), byte(0x98), byte(0x83)});
  CHECK(with_bytes.encode("\xF0\x9F\x98\x80", false) ==
        std::vector<llama::token>{byte(0xF0), byte(0x9F), byte(0x98), byte(0x80)});
  // Not UTF-8: as in llama.cpp, a lead byte 0xF8-0xFF opens a 4-byte symbol like 0xF0-0xF7,
  // which swallows the next bytes; such a symbol is no token, so all its bytes fall back.
  CHECK(with_bytes.encode("\xFF"
                          "a",
                          false) == std::vector<llama::token>{byte(0xFF), byte('a')});
  CHECK(with_bytes.encode("\xF8"
                          "abab",
                          false) ==
        std::vector<llama::token>{byte(0xF8), byte('a'), byte('b'), byte('a'), b});
  CHECK(with_bytes.encode("\n", false) == std::vector<llama::token>{byte(0x0A)});
  for (const std::string& text :
       {std::string("a\xC3\xA9 b\n"), std::string("\xF0\x9F\x98\x80\xE2\x98\x83"),
        std::string("\xFF\xFE"), std::string(1, '\0') + "a"}) {
    CHECK(with_bytes.decode(with_bytes.encode(text)) == text);
  }

  // Without byte tokens every byte of such a character becomes the unknown token.
  const llama::Tokenizer without_bytes = make_tokenizer(
      scratch.file("unk.gguf"), {"<unk>", "<s>", "</s>", "a"}, {0.0F, 0.0F, 0.0F, 0.0F},
      {kind_unknown, kind_control, kind_control, kind_normal});
  CHECK(without_bytes.encode("a\xC3\xA9", false) == std::vector<llama::token>{3, 0, 0});
  CHECK(without_bytes.encode("a\xC3\xA9") == std::vector<llama::token>{1, 3, 0, 0});  // BOS
  CHECK(without_bytes.decode(std::vector<llama::token>{1, 3, 0, 0}) == "a");
  // tokenizer.ggml.unknown_token_id chooses that token.
  const llama::Tokenizer other_unknown = make_tokenizer(
      scratch.file("unk3.gguf"), {"<s>", "</s>", "a", "<unk>"}, {0.0F, 0.0F, 0.0F, 0.0F},
      {kind_control, kind_control, kind_normal, kind_unknown},
      [](GgufWriter& w) { w.add_u32("tokenizer.ggml.unknown_token_id", 3); });
  CHECK(other_unknown.encode("\xC3\xA9"
                             "a",
                             false) == std::vector<llama::token>{3, 3, 2});
}

TEST_CASE("Tokenizer maps a string listed twice to its last id, as llama.cpp") {
  const Scratch scratch("duplicates");
  const llama::Tokenizer tokenizer = make_tokenizer(
      scratch.file("duplicates.gguf"), {"<unk>", "<s>", "</s>", "a", "b", "a"},
      {0.0F, 0.0F, 0.0F, 0.0F, 0.0F, 0.0F},
      {kind_unknown, kind_control, kind_control, kind_normal, kind_normal, kind_normal});
  CHECK(tokenizer.encode("ab", false) == std::vector<llama::token>{5, 4});
  CHECK(tokenizer.decode(std::vector<llama::token>{3, 5}) == "aa");
}

TEST_CASE("Tokenizer add_space_prefix, BOS and EOS") {
  const Scratch scratch("prefix");
  // "▁a" outscores "ab", which outscores "▁ab": the merges run ▁a, ▁a, then ▁ab twice.
  const std::vector<std::string> tokens = {"<unk>", "<s>",       "</s>", space,       "a",
                                           "b",     space + "a", "ab",   space + "ab"};
  const std::vector<float> scores = {0, 0, 0, 0, 0, 0, -1, -2, -3};
  const std::vector<std::int32_t> types = {kind_unknown, kind_control, kind_control,
                                           kind_normal,  kind_normal,  kind_normal,
                                           kind_normal,  kind_normal,  kind_normal};
  const llama::token bos = 1, eos = 2, marker = 3, a = 4, space_a = 6, ab = 7, space_ab = 8;

  const llama::Tokenizer prefixed =
      make_tokenizer(scratch.file("prefix.gguf"), tokens, scores, types, [](GgufWriter& w) {
        REQUIRE(w.remove_metadata("tokenizer.ggml.add_space_prefix"));  // true by default
      });
  CHECK(prefixed.add_space_prefix());
  CHECK(prefixed.encode("ab ab") == std::vector<llama::token>{bos, space_ab, space_ab});
  CHECK(prefixed.encode("ab ab", false) == std::vector<llama::token>{space_ab, space_ab});
  CHECK(prefixed.decode(prefixed.encode("ab ab")) == "ab ab");  // the added space is dropped
  CHECK(prefixed.decode(prefixed.encode("ab ab"), false) == " ab ab");
  CHECK(prefixed.encode(" a", false) == std::vector<llama::token>{marker, space_a});
  CHECK(prefixed.decode(prefixed.encode(" a")) == " a");         // only one space is dropped
  CHECK(prefixed.encode("") == std::vector<llama::token>{bos});  // nothing to prefix

  const llama::Tokenizer plain = make_tokenizer(scratch.file("plain.gguf"), tokens, scores, types);
  CHECK_FALSE(plain.add_space_prefix());
  CHECK(plain.encode("ab ab", false) == std::vector<llama::token>{ab, space_ab});
  CHECK(plain.decode(plain.encode("ab ab")) == "ab ab");
  CHECK(plain.encode(" a", false) == std::vector<llama::token>{space_a});
  CHECK(plain.decode(plain.encode(" a")) == " a");
  CHECK(plain.encode("a", false) == std::vector<llama::token>{a});
  CHECK(plain.bos() == bos);
  CHECK(plain.eos() == eos);

  // add_bos_token false, add_eos_token true, special ids from the file.
  const llama::Tokenizer specials =
      make_tokenizer(scratch.file("specials.gguf"), tokens, scores, types, [](GgufWriter& w) {
        w.add_bool("tokenizer.ggml.add_bos_token", false);
        w.add_bool("tokenizer.ggml.add_eos_token", true);
        w.add_u32("tokenizer.ggml.eos_token_id", 0);
      });
  CHECK(specials.encode("a") == std::vector<llama::token>{a, 0});
  CHECK(specials.encode("a", false) == std::vector<llama::token>{a});
  CHECK(specials.eos() == 0);
}

TEST_CASE("Tokenizer piece of control, byte, normal and other tokens") {
  const Scratch scratch("pieces");
  const std::vector<std::string> tokens = {"<unk>",
                                           "<s>",
                                           "</s>",
                                           "<0x41>",
                                           "<0x0A>",
                                           "<0xe9>",
                                           "<0xZZ>",
                                           "<0x4>",
                                           "ab",
                                           space + "ab",
                                           "a" + space + "b" + space,
                                           "<tag>",
                                           "<unused0>",
                                           "x" + space};
  const std::vector<std::int32_t> types = {kind_unknown, kind_control,
                                           kind_control, kind_byte,
                                           kind_byte,    kind_byte,
                                           kind_byte,    kind_byte,
                                           kind_normal,  kind_normal,
                                           kind_normal,  kind_user,
                                           kind_unused,  0 /* undefined */};
  const std::vector<float> scores(tokens.size(), 0.0F);
  const llama::Tokenizer tokenizer =
      make_tokenizer(scratch.file("pieces.gguf"), tokens, scores, types);

  CHECK(tokenizer.piece(0).empty());  // unknown
  CHECK(tokenizer.piece(1).empty());  // control
  CHECK(tokenizer.piece(2).empty());
  CHECK(tokenizer.piece(3) == "A");
  CHECK(tokenizer.piece(4) == "\n");
  CHECK(tokenizer.piece(5) == "\xE9");  // lower-case hex digits read too
  CHECK(tokenizer.piece(6).empty());    // not hex: no byte (and no exception)
  CHECK(tokenizer.piece(7).empty());    // one digit: no byte
  CHECK(tokenizer.piece(8) == "ab");
  CHECK(tokenizer.piece(9) == " ab");
  CHECK(tokenizer.piece(10) == "a b ");
  CHECK(tokenizer.piece(11) == "<tag>");  // user-defined: its text
  CHECK(tokenizer.piece(12).empty());     // unused
  CHECK(tokenizer.piece(13) == "x ");     // undefined type: read as normal text
  CHECK(tokenizer.piece(-1).empty());
  CHECK(tokenizer.piece(14).empty());
  CHECK(tokenizer.kind(1) == llama::token_kind::control);
  CHECK(tokenizer.kind(3) == llama::token_kind::byte);
  CHECK(tokenizer.kind(11) == llama::token_kind::user_defined);
  CHECK(tokenizer.text(9) == space + "ab");
  CHECK(tokenizer.decode(std::vector<llama::token>{1, 8, 3, 6, 4, 2, 9}) == "abA\n ab");
}

TEST_CASE("Tokenizer merges the highest-scoring pair first, the leftmost on ties") {
  const Scratch scratch("merges");
  std::size_t file_number = 0;
  // A vocabulary of <unk> <s> </s>, single characters (score 0) and `merges` with scores.
  const auto tokenizer = [&](const std::vector<std::pair<std::string, float>>& merges) {
    std::vector<std::string> tokens = {"<unk>", "<s>", "</s>", "a", "b", "c", "d"};
    std::vector<float> scores(tokens.size(), 0.0F);
    for (const auto& [text, score] : merges) {
      tokens.push_back(text);
      scores.push_back(score);
    }
    std::vector<std::int32_t> types(tokens.size(), kind_normal);
    types[0] = kind_unknown;
    types[1] = types[2] = kind_control;
    return make_tokenizer(scratch.file(std::to_string(file_number++) + ".gguf"), tokens, scores,
                          types);
  };
  using strings = std::vector<std::string>;
  // The right pair wins on score, though the left one comes first.
  const llama::Tokenizer right_better = tokenizer({{"ab", -1.0F}, {"bc", 0.0F}});
  CHECK(texts(right_better, right_better.encode("abc", false)) == strings{"a", "bc"});
  const llama::Tokenizer left_better = tokenizer({{"ab", 0.0F}, {"bc", -1.0F}});
  CHECK(texts(left_better, left_better.encode("abc", false)) == strings{"ab", "c"});
  // Ties go to the leftmost pair.
  const llama::Tokenizer tie = tokenizer({{"ab", -1.0F}, {"bc", -1.0F}});
  CHECK(texts(tie, tie.encode("abc", false)) == strings{"ab", "c"});
  const llama::Tokenizer repeats = tokenizer({{"aa", 0.0F}});
  CHECK(texts(repeats, repeats.encode("aaa", false)) == strings{"aa", "a"});
  CHECK(texts(repeats, repeats.encode("aaaaa", false)) == strings{"aa", "aa", "a"});
  // Merging bc first blocks ab + cd -> abcd; with bc scored lowest, abcd forms.
  const llama::Tokenizer blocked =
      tokenizer({{"ab", -2.0F}, {"cd", -2.0F}, {"abcd", -3.0F}, {"bc", -1.0F}});
  CHECK(texts(blocked, blocked.encode("abcd", false)) == strings{"a", "bc", "d"});
  const llama::Tokenizer unblocked =
      tokenizer({{"ab", -2.0F}, {"cd", -2.0F}, {"abcd", -3.0F}, {"bc", -4.0F}});
  CHECK(texts(unblocked, unblocked.encode("abcd", false)) == strings{"abcd"});
  // A merged symbol merges again: a + b -> ab, ab + c -> abc, abc + d -> abcd.
  const llama::Tokenizer chain = tokenizer({{"ab", -1.0F}, {"abc", -2.0F}, {"abcd", -3.0F}});
  CHECK(texts(chain, chain.encode("abcdab", false)) == strings{"abcd", "ab"});
}
