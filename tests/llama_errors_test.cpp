// Bad-input catalogue of the llama engine example (docs/errors.md, section "Engine example
// (examples/llama)", rows L*): malformed GGUF files, metadata and tensors the loader must
// reject, vocabularies that do not match, requests the engine cannot serve, and how an
// engine failure surfaces through the speculative decoder. One test case per catalogue row.
//
// Every rejection is a llama::model_error or llama::engine_error (not specdec::error) whose
// message names the file. With SPECDEC_ERRORS_DUMP=<file> set, every message is appended to
// that file as "<row>\t<what()>", as tests/errors_catalogue.hpp does for the library's rows.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "errors_catalogue.hpp"
#include "llama/engine.hpp"
#include "llama/generate.hpp"
#include "llama/gguf.hpp"
#include "llama/model.hpp"
#include "specdec/error.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/sampling.hpp"
#include "specdec/speculative_decoder.hpp"
#include "support/gguf_writer.hpp"

namespace {

using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::StartsWith;
using specdec::testing::GgufWriter;
using specdec::testing::TinyLlama;

/// A directory of its own for one test case, removed with everything in it at the end.
class Scratch {
 public:
  explicit Scratch(const std::string& row)
      : directory_(specdec::testing::scratch_directory("llama-errors-" + row)) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(directory_, ignored);
  }
  [[nodiscard]] std::string file(const std::string& name) const {
    return (directory_ / name).string();
  }
  [[nodiscard]] std::string directory() const { return directory_.string(); }

 private:
  std::filesystem::path directory_;
};

/// prefix + n. Appended rather than written "prefix" + std::to_string(n): GCC 12 at -O3 gives
/// a false -Wrestrict warning for that (GCC bug 105329), an error with -Werror.
std::string numbered(std::string prefix, std::uint64_t n) {
  return prefix.append(std::to_string(n));
}

/// A model small enough to write thousands of times: vocabulary 40 (tiny_vocabulary: <unk>
/// <s> </s>, a..z, U+2581, newline, then pairs), dim 8, one layer, 2 heads over 1 KV head
/// (head dimension 4), ffn 8, context 16.
TinyLlama small_shape() {
  TinyLlama shape;
  shape.vocab = 40;
  shape.dim = 8;
  shape.layers = 1;
  shape.heads = 2;
  shape.kv_heads = 1;
  shape.ffn = 8;
  shape.context = 16;
  return shape;
}

/// The file of a small model as `edit` changes it.
std::vector<unsigned char> model_bytes(const std::function<void(GgufWriter&)>& edit = {},
                                       const TinyLlama& shape = small_shape()) {
  GgufWriter w;
  specdec::testing::add_tiny_llama(w, shape);
  if (edit) edit(w);
  return w.bytes();
}

std::string write_file(const std::string& path, const std::vector<unsigned char>& bytes) {
  GgufWriter::write_bytes(path, bytes);
  return path;
}

std::string write_model(const std::string& path, const std::function<void(GgufWriter&)>& edit = {},
                        const TinyLlama& shape = small_shape()) {
  return write_file(path, model_bytes(edit, shape));
}

/// Appends the bytes of `value` (little-endian on the machines the tests run on, as GGUF).
template <class T>
void append(std::vector<unsigned char>& out, T value) {
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

template <class T>
std::vector<unsigned char> bytes_of(std::initializer_list<T> values) {
  std::vector<unsigned char> out;
  for (const T v : values) append(out, v);
  return out;
}

/// The byte strings one after another.
std::vector<unsigned char> concat(std::initializer_list<std::vector<unsigned char>> parts) {
  std::vector<unsigned char> out;
  for (const std::vector<unsigned char>& part : parts)
    out.insert(out.end(), part.begin(), part.end());
  return out;
}

void patch_u64(std::vector<unsigned char>& bytes, std::size_t at, std::uint64_t value) {
  REQUIRE(at + 8 <= bytes.size());
  std::memcpy(bytes.data() + at, &value, 8);
}

/// Where `text` first occurs in `bytes` (it must occur).
std::size_t find_bytes(const std::vector<unsigned char>& bytes, std::string_view text) {
  const auto it =
      std::search(bytes.begin(), bytes.end(), text.begin(), text.end(),
                  [](unsigned char a, char b) { return a == static_cast<unsigned char>(b); });
  REQUIRE(it != bytes.end());
  return static_cast<std::size_t>(it - bytes.begin());
}

/// The value type ids of GGUF metadata and the tensor type ids of ggml.
constexpr std::uint32_t gguf_uint32 = 4, gguf_bool = 7, gguf_string = 8, gguf_array = 9;
constexpr std::uint32_t ggml_f32 = 0, ggml_f16 = 1, ggml_q8_0 = 8, ggml_q4_k = 12;

/// Replaces the vocabulary arrays by `tokens` with zero scores and normal types.
void replace_vocabulary(GgufWriter& w, const std::vector<std::string>& tokens) {
  REQUIRE(w.remove_metadata("tokenizer.ggml.tokens"));
  REQUIRE(w.remove_metadata("tokenizer.ggml.scores"));
  REQUIRE(w.remove_metadata("tokenizer.ggml.token_type"));
  w.add_strings("tokenizer.ggml.tokens", tokens);
  w.add_f32s("tokenizer.ggml.scores", std::vector<float>(tokens.size(), 0.0F));
  w.add_i32s("tokenizer.ggml.token_type", std::vector<std::int32_t>(tokens.size(), 1));
}

/// Runs `call` and requires an `Error` (llama::model_error or llama::engine_error) whose
/// what() names `file` and contains `fragment`; for a model_error also file() == `file` and
/// what() == "<file>: <problem>". Dumps the message (SPECDEC_ERRORS_DUMP) and returns it.
template <class Error, class Call>
std::string check_llama_error(std::string_view row, Call&& call, const std::string& file,
                              std::string_view fragment) {
  INFO("catalogue row " << row);
  std::string what;
  bool thrown = false;
  try {
    std::forward<Call>(call)();
  } catch (const Error& e) {
    thrown = true;
    what = e.what();
    if constexpr (std::is_same_v<Error, llama::model_error>) {
      CHECK(e.file() == file);
      CHECK_THAT(what, StartsWith(file + ": "));
    }
  } catch (const std::exception& e) {
    FAIL_CHECK("another exception type: " << e.what());
  }
  REQUIRE(thrown);
  CHECK_THAT(what, ContainsSubstring(file));
  CHECK_THAT(what, ContainsSubstring(std::string(fragment)));
  specdec::testing::dump_error_message(row, what);
  return what;
}

/// Loading `path` as a model fails with a model_error naming it and saying `fragment`.
std::string check_model_error(std::string_view row, const std::string& path,
                              std::string_view fragment) {
  return check_llama_error<llama::model_error>(
      row, [&] { const llama::Model model(path); }, path, fragment);
}

/// The model written with `edit` fails to load, saying `fragment`.
std::string check_edit(std::string_view row, const Scratch& scratch,
                       const std::function<void(GgufWriter&)>& edit, std::string_view fragment,
                       const TinyLlama& shape = small_shape()) {
  return check_model_error(row, write_model(scratch.file("model.gguf"), edit, shape), fragment);
}

/// Replaces metadata `key` by whatever `add` writes.
std::function<void(GgufWriter&)> replace_key(const std::string& key,
                                             std::function<void(GgufWriter&)> add) {
  return [key, add = std::move(add)](GgufWriter& w) {
    REQUIRE(w.remove_metadata(key));
    add(w);
  };
}

/// Replaces tensor `name` by one with the given dims, type and bytes.
std::function<void(GgufWriter&)> replace_tensor(const std::string& name,
                                                std::vector<std::uint64_t> dims, std::uint32_t type,
                                                std::vector<unsigned char> data) {
  return [=](GgufWriter& w) {
    REQUIRE(w.remove_tensor(name));
    w.add_tensor(name, dims, type, data);
  };
}

std::vector<unsigned char> f32_bytes(std::size_t count) {
  return GgufWriter::encode(std::vector<float>(count, 0.5F), false);
}

/// The tensors the small model needs (output.weight is optional: tied when absent).
std::vector<std::string> required_tensors() {
  return {"token_embd.weight",     "blk.0.attn_norm.weight", "blk.0.attn_q.weight",
          "blk.0.attn_k.weight",   "blk.0.attn_v.weight",    "blk.0.attn_output.weight",
          "blk.0.ffn_norm.weight", "blk.0.ffn_gate.weight",  "blk.0.ffn_up.weight",
          "blk.0.ffn_down.weight", "output_norm.weight"};
}

}  // namespace

// ---- the GGUF structure (llama::GgufFile) --------------------------------------------------

TEST_CASE("L1 file cannot be opened: missing, or a directory") {
  const Scratch scratch("L1");
  const std::string missing = scratch.file("absent.gguf");
  check_model_error("L1", missing, "cannot open the file (No such file or directory)");
  check_llama_error<llama::model_error>(
      "L1", [&] { const llama::GgufFile file(missing); }, missing, "cannot open the file");
  // A directory opened as a stream reported a size of 2^63 - 1 and the loader threw
  // std::bad_alloc; it is refused before reading.
  check_model_error("L1", scratch.directory(), "cannot open the file: not a regular file");
}

TEST_CASE("L2 bad magic: empty, short or foreign file") {
  const Scratch scratch("L2");
  const std::string path = scratch.file("model.gguf");
  check_model_error("L2", write_file(path, {}),
                    "not a GGUF file: bad magic \"\" (expected \"GGUF\")");
  check_model_error("L2", write_file(path, {'G', 'G', 'U'}), "bad magic \"GGU\"");
  GgufWriter w;
  specdec::testing::add_tiny_llama(w, small_shape());
  check_model_error("L2", write_file(path, w.bytes(3, "GGML")), "bad magic \"GGML\"");
  check_model_error("L2",
                    write_file(path, w.bytes(3,
                                             "\x7F"
                                             "ELF")),
                    "bad magic \"\\x7fELF\"");
  check_model_error("L2", write_file(path, bytes_of<std::uint32_t>({0, 3})),
                    "bad magic \"\\x00\\x00\\x00\\x00\"");
}

TEST_CASE("L3 unsupported GGUF version") {
  const Scratch scratch("L3");
  const std::string path = scratch.file("model.gguf");
  GgufWriter w;
  specdec::testing::add_tiny_llama(w, small_shape());
  check_model_error("L3", write_file(path, w.bytes(1)),
                    "unsupported GGUF version 1 (supported: 2, 3)");
  check_model_error("L3", write_file(path, w.bytes(4)), "unsupported GGUF version 4");
  check_model_error("L3", write_file(path, w.bytes(0xFFFFFFFFU)),
                    "unsupported GGUF version 4294967295");
  write_file(path, w.bytes(2));  // the control: version 2 loads
  CHECK(llama::Model(path).config().vocab == 40);
}

TEST_CASE("L4 truncated file: every cut before the end of the tensor data is a model_error") {
  const Scratch scratch("L4");
  const std::string path = scratch.file("model.gguf");
  const std::vector<unsigned char> full = model_bytes();
  write_file(path, full);
  std::uint64_t data_end = 0;
  std::uint64_t data_start = full.size();
  {
    const llama::GgufFile file(path);  // the uncut file loads
    for (const llama::TensorInfo& t : file.tensors()) {
      data_end = std::max(data_end, t.offset + t.bytes);
      data_start = std::min(data_start, t.offset);
    }
    CHECK(llama::Model(file).config().vocab == 40);
  }
  REQUIRE(data_end <= full.size());
  REQUIRE(data_end > data_start);
  // Each cut goes to a new file: rewriting one file in place made ext4 flush it to disk on
  // every close (auto_da_alloc), about 2 ms a cut.
  const auto cut = [&](std::size_t length) {
    const std::string cut_path = scratch.file(numbered("cut-", length) + ".gguf");
    return write_file(
        cut_path, std::vector<unsigned char>(full.begin(),
                                             full.begin() + static_cast<std::ptrdiff_t>(length)));
  };

  // One named cut in each part of the file, messages recorded for the catalogue.
  check_model_error("L4", cut(10),
                    "truncated: tensor count at byte 8 needs 8 bytes, the file has 10");
  check_model_error("L4", cut(40), "truncated: header declares");
  // A string value: tokenizer.ggml.model (key 20 bytes, value type, length) = "llama".
  const std::size_t model_key = find_bytes(full, "tokenizer.ggml.model");
  check_model_error("L4", cut(model_key + 20 + 12 + 2), "truncated: tokenizer.ggml.model at byte");
  // The token array: key (21 bytes), value type, element type, count, then 40 strings.
  const std::size_t tokens_array = find_bytes(full, "tokenizer.ggml.tokens");
  check_model_error("L4", cut(tokens_array + 21 + 16 + 10),
                    "metadata key tokenizer.ggml.tokens: array of 40 elements runs past the end "
                    "of the file");
  check_model_error("L4", cut(tokens_array + 200), "truncated: tokenizer.ggml.tokens at byte");
  // The first tensor info: name (17 bytes), n_dims at +17, dims at +21, type at +37, offset
  // at +41.
  const std::size_t first_info = find_bytes(full, "token_embd.weight");
  check_model_error("L4", cut(first_info + 3), "truncated: tensor name 0 at byte");
  check_model_error("L4", cut(first_info + 43), "truncated: token_embd.weight (offset) at byte");
  check_model_error("L4", cut(static_cast<std::size_t>(data_end) - 1),
                    "truncated: tensor output.weight (");

  // Every cut from the header to the last byte of tensor data: a model_error that names the
  // file and says the file is too short; never another exception, a crash or a hang.
  std::vector<std::string> wrong;
  std::size_t cuts = 0;
  for (std::size_t length = 4; length < data_end; ++length, ++cuts) {
    const std::string cut_path = cut(length);
    try {
      const llama::Model model(cut_path);
      wrong.push_back(numbered("cut at ", length) + ": loaded");
    } catch (const llama::model_error& e) {
      const std::string what = e.what();
      const bool says_short = what.find("truncated") != std::string::npos ||
                              what.find("past the end of the file") != std::string::npos;
      if (e.file() != cut_path || what.rfind(cut_path + ": ", 0) != 0 || !says_short) {
        wrong.push_back(numbered("cut at ", length) + ": " + what);
      }
    } catch (const std::exception& e) {
      wrong.push_back(numbered("cut at ", length) + ": another exception: " + e.what());
    }
    std::filesystem::remove(cut_path);
  }
  INFO("first wrong cut: " << (wrong.empty() ? std::string("none") : wrong.front()));
  CHECK(wrong.empty());
  CHECK(cuts == data_end - 4);
  // A cut in the padding after the last tensor's data leaves a valid file.
  if (data_end < full.size()) {
    CHECK(llama::Model(cut(static_cast<std::size_t>(data_end))).config().vocab == 40);
  }
}

TEST_CASE("L5 unknown metadata value type, array element type or bool value") {
  const Scratch scratch("L5");
  check_edit(
      "L5", scratch,
      [](GgufWriter& w) {
        w.add_raw("general.odd", 13, {0, 0, 0, 0});
      },
      "metadata key general.odd has unknown value type 13");
  check_edit(
      "L5", scratch,
      [](GgufWriter& w) {
        w.add_raw("general.odd", gguf_array,
                  concat({bytes_of<std::uint32_t>({99}), bytes_of<std::uint64_t>({1})}));
      },
      "metadata key general.odd is an array of unknown value type 99");
  check_edit(
      "L5", scratch, [](GgufWriter& w) { w.add_raw("general.flag", gguf_bool, {2}); },
      "metadata key general.flag: bool value 2");
  check_edit(
      "L5", scratch,
      [](GgufWriter& w) {
        w.add_raw("general.flags", gguf_array,
                  concat({bytes_of<std::uint32_t>({gguf_bool}), bytes_of<std::uint64_t>({2}),
                          std::vector<unsigned char>{1, 255}}));
      },
      "metadata key general.flags: bool value 255");
}

TEST_CASE("L6 nested metadata array") {
  const Scratch scratch("L6");
  check_edit(
      "L6", scratch,
      [](GgufWriter& w) {
        w.add_raw("general.nested", gguf_array,
                  concat({bytes_of<std::uint32_t>({gguf_array}), bytes_of<std::uint64_t>({1}),
                          bytes_of<std::uint32_t>({gguf_uint32}), bytes_of<std::uint64_t>({1}),
                          bytes_of<std::uint32_t>({7})}));
      },
      "metadata key general.nested: nested arrays are not supported");
}

TEST_CASE("L7 counts and lengths beyond the end of the file") {
  const Scratch scratch("L7");
  const std::string path = scratch.file("model.gguf");
  check_edit(
      "L7", scratch,
      [](GgufWriter& w) {
        w.add_raw("general.huge", gguf_array,
                  concat({bytes_of<std::uint32_t>({gguf_uint32}),
                          bytes_of<std::uint64_t>({1ULL << 62U})}));
      },
      "metadata key general.huge: array of 4611686018427387904 elements runs past the end of "
      "the file");
  check_edit(
      "L7", scratch,
      [](GgufWriter& w) {
        w.add_raw("general.long", gguf_string, bytes_of<std::uint64_t>({1ULL << 63U}));
      },
      "truncated: general.long at byte");
  check_edit(
      "L7", scratch,
      [](GgufWriter& w) {
        w.add_raw(
            "general.long_strings", gguf_array,
            concat({bytes_of<std::uint32_t>({gguf_string}), bytes_of<std::uint64_t>({1, ~0ULL})}));
      },
      "needs 18446744073709551615 bytes");
  // A metadata key whose length is 2^64 - 1.
  const std::vector<unsigned char> key_too_long =
      concat({std::vector<unsigned char>{'G', 'G', 'U', 'F'}, bytes_of<std::uint32_t>({3}),
              bytes_of<std::uint64_t>({0, 1, ~0ULL})});
  check_model_error("L7", write_file(path, key_too_long),
                    "truncated: metadata key 0 at byte 32 needs 18446744073709551615 bytes, the "
                    "file has 32");
  // Header counts larger than the file could hold.
  std::vector<unsigned char> bytes = model_bytes();
  patch_u64(bytes, 8, 1ULL << 40U);
  check_model_error("L7", write_file(path, bytes),
                    "truncated: header declares 1099511627776 tensors and");
  bytes = model_bytes();
  patch_u64(bytes, 16, ~0ULL);
  check_model_error("L7", write_file(path, bytes),
                    "18446744073709551615 metadata entries, more "
                    "than the file can hold");
}

TEST_CASE("L8 duplicate metadata key") {
  const Scratch scratch("L8");
  check_edit(
      "L8", scratch, [](GgufWriter& w) { w.add_string("general.name", "again"); },
      "duplicate metadata key general.name");
}

TEST_CASE("L9 duplicate tensor") {
  const Scratch scratch("L9");
  check_edit(
      "L9", scratch,
      [](GgufWriter& w) { w.add_vector("output_norm.weight", std::vector<float>(8, 1.0F)); },
      "duplicate tensor output_norm.weight");
}

TEST_CASE("L10 general.alignment zero, not a power of two, or not a uint32") {
  const Scratch scratch("L10");
  const std::string_view message = "general.alignment must be a power of two (uint32)";
  for (const std::uint32_t alignment : {0U, 3U, 48U}) {
    check_edit(
        "L10", scratch, [&](GgufWriter& w) { w.add_u32("general.alignment", alignment); }, message);
  }
  check_edit(
      "L10", scratch, [](GgufWriter& w) { w.add_u64("general.alignment", 32); }, message);
  check_edit(
      "L10", scratch, [](GgufWriter& w) { w.add_string("general.alignment", "32"); }, message);
}

TEST_CASE("L11 tensor with 0 or more than 4 dimensions, a zero dimension or too many elements") {
  const Scratch scratch("L11");
  const auto extra = [](std::vector<std::uint64_t> dims) {
    return [dims](GgufWriter& w) { w.add_tensor("extra.weight", dims, ggml_f32, f32_bytes(8)); };
  };
  check_edit("L11", scratch, extra({}), "tensor extra.weight has 0 dimensions (1 to 4)");
  check_edit("L11", scratch, extra({1, 1, 1, 1, 8}),
             "tensor extra.weight has 5 dimensions (1 to 4)");
  check_edit("L11", scratch, extra({8, 0}), "tensor extra.weight has an invalid dimension 0");
  check_edit("L11", scratch, extra({1ULL << 32U, 1ULL << 32U}),
             "tensor extra.weight has an invalid dimension 4294967296");  // 2^64 elements
}

TEST_CASE("L12 unknown ggml type id") {
  const Scratch scratch("L12");
  for (const std::uint32_t type : {4U, 5U, 31U, 40U, 1000U}) {
    check_edit("L12", scratch, replace_tensor("output_norm.weight", {8}, type, f32_bytes(8)),
               numbered("tensor output_norm.weight has unknown ggml type ", type));
  }
}

TEST_CASE("L13 a ggml type the engine does not load") {
  const Scratch scratch("L13");
  // ffn 256: ffn_down.weight has dims {256, 8}, a whole number of blocks of every type.
  TinyLlama shape = small_shape();
  shape.ffn = 256;
  std::size_t checked = 0;
  for (std::uint32_t type = 0; type < 64; ++type) {
    const llama::TypeTraits traits = llama::type_traits(type);
    const bool loaded = type == 0 || type == 1 || type == 2 || type == 3 || type == 8 || type == 30;
    if (traits.block_bytes == 0 || loaded) continue;
    const std::size_t bytes =
        static_cast<std::size_t>(8 * 256 / traits.block_elements * traits.block_bytes);
    check_edit(
        "L13", scratch,
        replace_tensor("blk.0.ffn_down.weight", {256, 8}, type, std::vector<unsigned char>(bytes)),
        "tensor blk.0.ffn_down.weight has type " + std::string(traits.name) +
            ", which this engine does not load (F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
        shape);
    ++checked;
  }
  CHECK(checked == 26);  // every type ggml names but the six the engine loads
}

TEST_CASE("L14 first dimension not a multiple of the block size") {
  const Scratch scratch("L14");
  check_edit(
      "L14", scratch,
      replace_tensor("blk.0.attn_q.weight", {33, 8}, ggml_q8_0, std::vector<unsigned char>(34 * 8)),
      "tensor blk.0.attn_q.weight of type Q8_0: first dimension 33 is not a multiple of the "
      "block size 32");
  check_edit("L14", scratch,
             replace_tensor("output_norm.weight", {8}, ggml_q4_k, std::vector<unsigned char>(144)),
             "tensor output_norm.weight of type Q4_K: first dimension 8 is not a multiple of the "
             "block size 256");
}

TEST_CASE("L15 misaligned tensor offset") {
  const Scratch scratch("L15");
  check_edit(
      "L15", scratch,
      [](GgufWriter& w) { w.add_tensor("extra.weight", {2}, ggml_f32, f32_bytes(2), 4); },
      "tensor extra.weight has offset 4, not a multiple of the alignment 32");
  GgufWriter w;
  w.set_alignment(64);
  w.add_u32("general.alignment", 64);
  specdec::testing::add_tiny_llama(w, small_shape());
  w.add_tensor("extra.weight", {2}, ggml_f32, f32_bytes(2), 96);
  check_model_error("L15", write_file(scratch.file("model.gguf"), w.bytes()),
                    "tensor extra.weight has offset 96, not a multiple of the alignment 64");
}

TEST_CASE("L16 tensor data past the end of the file") {
  const Scratch scratch("L16");
  const std::string path = scratch.file("model.gguf");
  // More elements than the data written.
  check_edit(
      "L16", scratch,
      [](GgufWriter& w) { w.add_tensor("extra.weight", {1000000}, ggml_f32, f32_bytes(8)); },
      "truncated: tensor extra.weight (4000000 bytes at data offset");
  // An offset near 2^64: the bounds check must not wrap around.
  std::vector<unsigned char> bytes =
      model_bytes([](GgufWriter& w) { w.add_tensor("extra.weight", {2}, ggml_f32, f32_bytes(2)); });
  const std::size_t name = find_bytes(bytes, "extra.weight");
  patch_u64(bytes, name + 12 + 4 + 8 + 4, ~0ULL - 31);  // after name, n_dims, dims, type
  check_model_error("L16", write_file(path, bytes),
                    "truncated: tensor extra.weight (8 bytes at data offset 18446744073709551584) "
                    "runs past the end of the file");
  // A byte size beyond 2^64 wrapped around to 0 and passed the check (fixed).
  check_edit(
      "L16", scratch,
      [](GgufWriter& w) { w.add_tensor("extra.weight", {1ULL << 63U}, ggml_f16, {}); },
      "tensor extra.weight of shape [9223372036854775808] and type F16 is larger than any "
      "file (its size overflows 64 bits)");
  check_edit(
      "L16", scratch,
      [](GgufWriter& w) {
        w.add_tensor("extra.weight", {1ULL << 31U, 1ULL << 31U}, ggml_f32, {});
      },
      "is larger than any file");
}

// ---- metadata (llama::Model, llama::Tokenizer) ---------------------------------------------

TEST_CASE("L17 architecture other than llama") {
  const Scratch scratch("L17");
  check_edit("L17", scratch,
             replace_key("general.architecture",
                         [](GgufWriter& w) { w.add_string("general.architecture", "gpt2"); }),
             "architecture \"gpt2\" is not supported (this engine runs llama)");
}

TEST_CASE("L18 tokenizer model other than llama: the model loads, encode() refuses text") {
  const Scratch scratch("L18");
  const std::string path = write_model(scratch.file("model.gguf"),
                                       replace_key("tokenizer.ggml.model", [](GgufWriter& w) {
                                         w.add_string("tokenizer.ggml.model", "gpt2");
                                       }));
  // The model loads (encode() once refused it at load time, contradicting its own advice to
  // use token ids) and generates from token ids; only text needs the SentencePiece model.
  const llama::Model model(path);
  CHECK(model.config().vocab == 40);
  CHECK(model.tokenizer().size() == 40);
  llama::Engine engine(model, 8);
  const std::vector<specdec::token_id> ids = {1, 5, 9};
  CHECK(engine.next_token_logits(ids).size() == 40);
  check_llama_error<llama::model_error>(
      "L18", [&] { (void)model.tokenizer().encode("def main():"); }, path,
      "tokenizer.ggml.model is \"gpt2\": this engine implements the SentencePiece tokenizer "
      "(\"llama\") only; use token ids (--prompt-ids) with this model");
  // The vocabulary is still checked like any other.
  check_edit(
      "L18", scratch,
      [](GgufWriter& w) {
        REQUIRE(w.remove_metadata("tokenizer.ggml.model"));
        w.add_string("tokenizer.ggml.model", "gpt2");
        REQUIRE(w.remove_metadata("tokenizer.ggml.tokens"));
      },
      "missing metadata key tokenizer.ggml.tokens");
}

TEST_CASE("L19 missing required metadata key") {
  const Scratch scratch("L19");
  for (const char* key : {"general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
                          "llama.embedding_length", "llama.block_count",
                          "llama.feed_forward_length", "llama.attention.head_count",
                          "llama.context_length", "llama.attention.layer_norm_rms_epsilon"}) {
    check_edit(
        "L19", scratch, [&](GgufWriter& w) { REQUIRE(w.remove_metadata(key)); },
        std::string("missing metadata key ") + key);
  }
}

TEST_CASE("L20 metadata key of the wrong type") {
  const Scratch scratch("L20");
  check_edit("L20", scratch,
             replace_key("llama.embedding_length",
                         [](GgufWriter& w) { w.add_string("llama.embedding_length", "8"); }),
             "metadata key llama.embedding_length is string, expected a non-negative integer");
  check_edit("L20", scratch,
             replace_key("llama.attention.head_count",
                         [](GgufWriter& w) { w.add_i32("llama.attention.head_count", -2); }),
             "metadata key llama.attention.head_count is int32, expected a non-negative integer");
  check_edit("L20", scratch,
             replace_key("llama.block_count",
                         [](GgufWriter& w) { w.add_bool("llama.block_count", true); }),
             "metadata key llama.block_count is bool, expected a non-negative integer");
  check_edit(
      "L20", scratch,
      replace_key("llama.attention.layer_norm_rms_epsilon",
                  [](GgufWriter& w) { w.add_u32("llama.attention.layer_norm_rms_epsilon", 0); }),
      "metadata key llama.attention.layer_norm_rms_epsilon is uint32, expected a "
      "floating-point number");
  check_edit("L20", scratch,
             replace_key("general.architecture",
                         [](GgufWriter& w) { w.add_u32("general.architecture", 1); }),
             "metadata key general.architecture is uint32, expected a string");
  check_edit("L20", scratch,
             replace_key("tokenizer.ggml.tokens",
                         [](GgufWriter& w) {
                           w.add_i32s("tokenizer.ggml.tokens", std::vector<std::int32_t>(40, 1));
                         }),
             "metadata key tokenizer.ggml.tokens is array of int32, expected an array of string");
  check_edit("L20", scratch,
             replace_key("tokenizer.ggml.token_type",
                         [](GgufWriter& w) {
                           w.add_f32s("tokenizer.ggml.token_type", std::vector<float>(40, 1.0F));
                         }),
             "metadata key tokenizer.ggml.token_type is array of float32, expected an array of "
             "int32");
  check_edit(
      "L20", scratch, [](GgufWriter& w) { w.add_u32("tokenizer.ggml.add_bos_token", 1); },
      "metadata key tokenizer.ggml.add_bos_token is uint32, expected a bool");
}

TEST_CASE("L21 size hyperparameter zero or beyond 2^24") {
  const Scratch scratch("L21");
  check_edit("L21", scratch,
             replace_key("llama.embedding_length",
                         [](GgufWriter& w) { w.add_u32("llama.embedding_length", 0); }),
             "metadata key llama.embedding_length is 0, expected a positive size");
  check_edit("L21", scratch,
             replace_key("llama.attention.head_count_kv",
                         [](GgufWriter& w) { w.add_u32("llama.attention.head_count_kv", 0); }),
             "metadata key llama.attention.head_count_kv is 0, expected a positive size");
  check_edit("L21", scratch,
             replace_key("llama.context_length",
                         [](GgufWriter& w) { w.add_u64("llama.context_length", 1ULL << 32U); }),
             "metadata key llama.context_length is 4294967296, expected a positive size");
  check_edit("L21", scratch,
             replace_key("llama.block_count",
                         [](GgufWriter& w) { w.add_u32("llama.block_count", (1U << 24U) + 1); }),
             "metadata key llama.block_count is 16777217, expected a positive size");
  // The largest block_count accepted, in a file with one block: the loader stops at the
  // first missing tensor (it allocated 2^24 empty layers, 5.5 GB, first; fixed).
  check_edit("L21", scratch,
             replace_key("llama.block_count",
                         [](GgufWriter& w) { w.add_u32("llama.block_count", 1U << 24U); }),
             "missing tensor blk.1.attn_norm.weight");
}

TEST_CASE("L22 embedding_length not a multiple of head_count") {
  const Scratch scratch("L22");
  check_edit("L22", scratch,
             replace_key("llama.attention.head_count",
                         [](GgufWriter& w) { w.add_u32("llama.attention.head_count", 3); }),
             "llama.embedding_length 8 is not a multiple of llama.attention.head_count 3");
}

TEST_CASE("L23 head_count not a multiple of head_count_kv") {
  const Scratch scratch("L23");
  check_edit("L23", scratch,
             replace_key("llama.attention.head_count_kv",
                         [](GgufWriter& w) { w.add_u32("llama.attention.head_count_kv", 3); }),
             "llama.attention.head_count 2 is not a multiple of llama.attention.head_count_kv 3");
}

TEST_CASE("L24 rope.dimension_count other than the head dimension") {
  const Scratch scratch("L24");
  for (const std::uint32_t dims : {2U, 3U, 6U}) {
    check_edit(
        "L24", scratch, [&](GgufWriter& w) { w.add_u32("llama.rope.dimension_count", dims); },
        numbered("llama.rope.dimension_count ", dims) +
            " differs from the head dimension 4 (the llama architecture rotates whole heads)");
  }
}

TEST_CASE("L25 rms epsilon, rope base or rope scaling factor not positive") {
  const Scratch scratch("L25");
  for (const float value : {0.0F, -1.0F, std::numeric_limits<float>::quiet_NaN()}) {
    const bool zero = value == 0.0F;  // a zero scaling factor means no scaling (llama.cpp)
    check_edit("L25", scratch,
               replace_key("llama.attention.layer_norm_rms_epsilon",
                           [&](GgufWriter& w) {
                             w.add_f32("llama.attention.layer_norm_rms_epsilon", value);
                           }),
               "llama.attention.layer_norm_rms_epsilon and llama.rope.freq_base must be positive");
    check_edit("L25", scratch,
               replace_key("llama.rope.freq_base",
                           [&](GgufWriter& w) { w.add_f32("llama.rope.freq_base", value); }),
               "llama.attention.layer_norm_rms_epsilon and llama.rope.freq_base must be positive");
    if (zero) continue;
    check_edit(
        "L25", scratch,
        [&](GgufWriter& w) {
          w.add_string("llama.rope.scaling.type", "linear");
          w.add_f32("llama.rope.scaling.factor", value);
        },
        "llama.rope.scaling.factor must be positive (or 0: no scaling)");
    check_edit(
        "L25", scratch, [&](GgufWriter& w) { w.add_f32("llama.rope.scale_linear", value); },
        "llama.rope.scale_linear must be positive (or 0: no scaling)");
  }
}

TEST_CASE("L26 rope scaling type not none or linear") {
  const Scratch scratch("L26");
  for (const char* type : {"yarn", "longrope", ""}) {
    check_edit(
        "L26", scratch, [&](GgufWriter& w) { w.add_string("llama.rope.scaling.type", type); },
        std::string("llama.rope.scaling.type \"") + type + "\" is not supported (none, linear)");
  }
}

// ---- tensors -------------------------------------------------------------------------------

TEST_CASE("L27 missing tensor") {
  const Scratch scratch("L27");
  for (const std::string& name : required_tensors()) {
    check_edit(
        "L27", scratch, [&](GgufWriter& w) { REQUIRE(w.remove_tensor(name)); },
        "missing tensor " + name);
  }
}

TEST_CASE("L28 tensor of the wrong shape") {
  const Scratch scratch("L28");
  // attn_k is [kv_dim 4 rows x dim 8 cols]: GGUF dims {8, 4}; transposed {4, 8}.
  check_edit("L28", scratch, replace_tensor("blk.0.attn_k.weight", {4, 8}, ggml_f32, f32_bytes(32)),
             "tensor blk.0.attn_k.weight has shape [4, 8], expected [8, 4]");
  check_edit("L28", scratch,
             replace_tensor("token_embd.weight", {9, 40}, ggml_f32, f32_bytes(9 * 40)),
             "tensor token_embd.weight has shape [9, 40], expected [8, vocabulary size]");
  check_edit("L28", scratch, replace_tensor("token_embd.weight", {8}, ggml_f32, f32_bytes(8)),
             "tensor token_embd.weight has shape [8], expected [8, vocabulary size]");
  check_edit("L28", scratch, replace_tensor("output_norm.weight", {9}, ggml_f32, f32_bytes(9)),
             "tensor output_norm.weight has shape [9], expected [8]");
  check_edit("L28", scratch,
             replace_tensor("blk.0.attn_norm.weight", {8, 1}, ggml_f32, f32_bytes(8)),
             "tensor blk.0.attn_norm.weight has shape [8, 1], expected [8]");
  check_edit("L28", scratch, replace_tensor("output.weight", {8, 39}, ggml_f32, f32_bytes(8 * 39)),
             "tensor output.weight has shape [8, 39], expected [8, 40]");
  check_edit("L28", scratch,
             replace_tensor("blk.0.ffn_down.weight", {8, 8, 1}, ggml_f32, f32_bytes(64)),
             "tensor blk.0.ffn_down.weight has shape [8, 8, 1], expected [8, 8]");
  check_edit(
      "L28", scratch,
      [](GgufWriter& w) {
        w.add_vector("rope_freqs.weight", {1.0F, 2.0F, 3.0F});
      },
      "tensor rope_freqs.weight has shape [3], expected [2]");
}

// ---- vocabulary ----------------------------------------------------------------------------

TEST_CASE("L29 vocabulary mismatch inside a file") {
  const Scratch scratch("L29");
  check_edit(
      "L29", scratch,
      [](GgufWriter& w) { replace_vocabulary(w, specdec::testing::tiny_vocabulary(41)); },
      "vocabulary mismatch inside the file: tokenizer.ggml.tokens has 41 tokens but "
      "token_embd.weight has 40 rows");
  check_edit(
      "L29", scratch, [](GgufWriter& w) { w.add_u32("llama.vocab_size", 50); },
      "llama.vocab_size is 50 but token_embd.weight has 40 rows");
}

TEST_CASE("L30 tokenizer arrays: empty, of the wrong length, or a NaN score") {
  const Scratch scratch("L30");
  check_edit("L30", scratch,
             replace_key("tokenizer.ggml.scores",
                         [](GgufWriter& w) {
                           w.add_f32s("tokenizer.ggml.scores", std::vector<float>(39, 0.0F));
                         }),
             "tokenizer.ggml.scores has 39 entries for 40 tokens");
  check_edit("L30", scratch,
             replace_key("tokenizer.ggml.token_type",
                         [](GgufWriter& w) {
                           w.add_i32s("tokenizer.ggml.token_type",
                                      std::vector<std::int32_t>(41, 1));
                         }),
             "tokenizer.ggml.token_type has 41 entries for 40 tokens");
  check_edit(
      "L30", scratch, [](GgufWriter& w) { replace_vocabulary(w, {}); },
      "tokenizer.ggml.tokens is empty");
  // A NaN score broke the merge queue's ordering (undefined behaviour); now rejected.
  check_edit("L30", scratch,
             replace_key("tokenizer.ggml.scores",
                         [](GgufWriter& w) {
                           std::vector<float> scores(40, 0.0F);
                           scores[35] = std::numeric_limits<float>::quiet_NaN();
                           w.add_f32s("tokenizer.ggml.scores", scores);
                         }),
             "tokenizer.ggml.scores entry 35 (token \"ae\") is NaN");
}

TEST_CASE("L31 special token id outside the vocabulary") {
  const Scratch scratch("L31");
  check_edit("L31", scratch,
             replace_key("tokenizer.ggml.bos_token_id",
                         [](GgufWriter& w) { w.add_u32("tokenizer.ggml.bos_token_id", 40); }),
             "tokenizer.ggml.bos_token_id is 40, outside the 40-token vocabulary");
  check_edit("L31", scratch,
             replace_key("tokenizer.ggml.eos_token_id",
                         [](GgufWriter& w) { w.add_u32("tokenizer.ggml.eos_token_id", 1000); }),
             "tokenizer.ggml.eos_token_id is 1000, outside the 40-token vocabulary");
  check_edit(
      "L31", scratch, [](GgufWriter& w) { w.add_u32("tokenizer.ggml.unknown_token_id", 40); },
      "tokenizer.ggml.unknown_token_id is 40, outside the 40-token vocabulary");
  check_edit("L31", scratch,
             replace_key("tokenizer.ggml.bos_token_id",
                         [](GgufWriter& w) { w.add_i32("tokenizer.ggml.bos_token_id", -1); }),
             "metadata key tokenizer.ggml.bos_token_id is int32, expected a non-negative integer");
}

TEST_CASE("L32 vocabulary mismatch between target and draft") {
  const Scratch scratch("L32");
  const std::string target_path = write_model(scratch.file("target.gguf"));
  const llama::Model target(target_path);
  TinyLlama draft_shape = small_shape();
  draft_shape.seed = 2;

  SECTION("a different size") {
    draft_shape.vocab = 41;
    const std::string draft_path = write_model(scratch.file("draft.gguf"), {}, draft_shape);
    const llama::Model draft(draft_path);
    const std::string what = check_llama_error<llama::model_error>(
        "L32", [&] { llama::check_pair(target, draft); }, draft_path,
        ": the draft has 41 tokens, the target 40");
    CHECK_THAT(what, ContainsSubstring("vocabulary mismatch with the target " + target_path));
  }
  SECTION("the same size, one token different") {
    std::vector<std::string> tokens = specdec::testing::tiny_vocabulary(40);
    tokens[7] = "zz";
    const std::string draft_path = write_model(
        scratch.file("draft.gguf"), [&](GgufWriter& w) { replace_vocabulary(w, tokens); },
        draft_shape);
    const llama::Model draft(draft_path);
    const std::string what = check_llama_error<llama::model_error>(
        "L32", [&] { llama::check_pair(target, draft); }, draft_path,
        ": token 7 is \"zz\" in the draft and \"e\" in the target");
    CHECK_THAT(what, ContainsSubstring(target_path));
  }
  SECTION("the control: the same vocabulary passes") {
    const llama::Model draft(write_model(scratch.file("draft.gguf"), {}, draft_shape));
    CHECK_NOTHROW(llama::check_pair(target, draft));
  }
}

// ---- the engine ----------------------------------------------------------------------------

TEST_CASE("L33 empty context") {
  const Scratch scratch("L33");
  const std::string path = write_model(scratch.file("model.gguf"));
  const llama::Model model(path);
  llama::Engine engine(model, 8);
  const std::vector<specdec::token_id> empty;
  const std::vector<specdec::token_id> draft = {3, 4};
  check_llama_error<llama::engine_error>(
      "L33", [&] { (void)engine.next_token_logits(empty); }, path,
      "empty context: the llama model " + path + " needs at least one token (BOS)");
  check_llama_error<llama::engine_error>(
      "L33", [&] { (void)engine.score_draft_logits(empty, draft); }, path, "empty context");
  // Plain decoding passes the engine's error on; the speculative decoder wraps it
  // (model_failure, nothing generated).
  llama::RunOptions options;
  options.sampling.temperature = 0.0;
  options.max_new_tokens = 4;
  check_llama_error<llama::engine_error>(
      "L33", [&] { (void)llama::generate_plain(engine, empty, options); }, path, "empty context");
  llama::Engine draft_engine(model, 8);
  try {
    (void)llama::generate_speculative(engine, &draft_engine, llama::drafter_kind::model, empty,
                                      options);
    FAIL("no decoding_error");
  } catch (const specdec::decoding_error& e) {
    CHECK(e.code() == specdec::errc::model_failure);
    CHECK(e.tokens().empty());
    CHECK_THAT(std::string(e.what()), ContainsSubstring("the model threw: empty context"));
    CHECK_THROWS_AS(std::rethrow_if_nested(e), llama::engine_error);
    specdec::testing::dump_error_message("L33", e.what());
  }
}

TEST_CASE("L34 context longer than the engine's capacity") {
  const Scratch scratch("L34");
  const std::string path = write_model(scratch.file("model.gguf"));
  const llama::Model model(path);
  llama::Engine engine(model, 8);
  const std::vector<specdec::token_id> nine(9, 3);
  const std::vector<specdec::token_id> six(6, 3);
  const std::vector<specdec::token_id> three = {4, 5, 6};
  check_llama_error<llama::engine_error>(
      "L34", [&] { (void)engine.next_token_logits(nine); }, path,
      "context of 9 tokens (+0 scored) exceeds the engine's capacity of 8 positions (" + path +
          ")");
  check_llama_error<llama::engine_error>(
      "L34", [&] { (void)engine.score_draft_logits(six, three); }, path,
      "context of 6 tokens (+3 scored) exceeds the engine's capacity of 8 positions");
  // The capacity is inclusive, and the engine serves requests after a refused one.
  const std::vector<specdec::token_id> eight(8, 3);
  const std::span<const float> row = engine.next_token_logits(eight);
  CHECK(row.size() == 40);
  CHECK(engine.cached() == 8);
}

TEST_CASE("L35 token id outside the vocabulary") {
  const Scratch scratch("L35");
  const std::string path = write_model(scratch.file("model.gguf"));
  const llama::Model model(path);
  const std::vector<specdec::token_id> valid = {1, 5, 9};
  llama::Engine fresh(model, 16);
  const std::span<const float> fresh_row = fresh.next_token_logits(valid);
  const std::vector<float> expected(fresh_row.begin(), fresh_row.end());

  llama::Engine engine(model, 16);
  (void)engine.next_token_logits(valid);  // something cached before the failure
  const std::vector<specdec::token_id> too_large = {1, 5, 9, 40};
  const std::vector<specdec::token_id> negative = {1, -1};
  check_llama_error<llama::engine_error>(
      "L35", [&] { (void)engine.next_token_logits(too_large); }, path,
      "token id 40 is outside the vocabulary [0, 40) of " + path);
  check_llama_error<llama::engine_error>(
      "L35", [&] { (void)engine.next_token_logits(negative); }, path,
      "token id -1 is outside the vocabulary [0, 40)");
  const std::vector<specdec::token_id> bad_draft = {7, 1000};
  check_llama_error<llama::engine_error>(
      "L35", [&] { (void)engine.score_draft_logits(valid, bad_draft); }, path,
      "token id 1000 is outside the vocabulary");
  // The failed pass reset the cache: the next request is served as by a fresh engine.
  const std::span<const float> after = engine.next_token_logits(valid);
  CHECK(std::vector<float>(after.begin(), after.end()) == expected);

  // Inside the decoder the prompt is checked before any model sees it (row D11).
  llama::Engine draft(model, 16);
  llama::RunOptions options;
  options.max_new_tokens = 4;
  try {
    (void)llama::generate_speculative(engine, &draft, llama::drafter_kind::model, too_large,
                                      options);
    FAIL("no decoding_error");
  } catch (const specdec::decoding_error& e) {
    CHECK(e.code() == specdec::errc::invalid_token);
    CHECK_THAT(std::string(e.what()), ContainsSubstring("prompt token at position 3: id 40"));
  }
}

TEST_CASE("L36 engine failure inside the speculative decoder keeps the tokens generated") {
  const Scratch scratch("L36");
  const std::string target_path = write_model(scratch.file("target.gguf"));
  TinyLlama draft_shape = small_shape();
  draft_shape.seed = 2;
  const std::string draft_path = write_model(scratch.file("draft.gguf"), {}, draft_shape);
  const llama::Model target(target_path);
  const llama::Model draft(draft_path);
  llama::check_pair(target, draft);
  const std::vector<specdec::token_id> prompt = {1, 5, 9};
  llama::RunOptions options;
  options.sampling.temperature = 0.0;  // greedy: the speculative output is the plain one
  options.max_new_tokens = 24;
  options.gamma = 4;
  llama::Engine roomy(target, 64);
  const llama::RunResult plain = llama::generate_plain(roomy, prompt, options);
  REQUIRE(plain.tokens.size() == 24);

  // 16 positions: the first steps fit, a later step asks for more than the cache holds.
  llama::Engine target_engine(target, 16);
  llama::Engine draft_engine(draft, 16);
  const auto check_failure = [&](const specdec::decoding_error& e) {
    CHECK(e.code() == specdec::errc::model_failure);
    const std::span<const specdec::token_id> kept = e.tokens();
    INFO("tokens kept: " << kept.size());
    CHECK_FALSE(kept.empty());
    CHECK(kept.size() + prompt.size() <= 16);
    REQUIRE(kept.size() <= plain.tokens.size());
    CHECK(std::equal(kept.begin(), kept.end(), plain.tokens.begin()));
    const std::string what = e.what();
    CHECK_THAT(what, ContainsSubstring("the model threw: context of"));
    CHECK_THAT(what, ContainsSubstring("exceeds the engine's capacity of 16 positions"));
    CHECK((what.find(target_path) != std::string::npos ||
           what.find(draft_path) != std::string::npos));
    CHECK_THROWS_AS(std::rethrow_if_nested(e), llama::engine_error);
    specdec::testing::dump_error_message("L36", what);
  };
  SECTION("llama::generate_speculative") {
    bool thrown = false;
    try {
      (void)llama::generate_speculative(target_engine, &draft_engine, llama::drafter_kind::model,
                                        prompt, options);
    } catch (const specdec::decoding_error& e) {
      thrown = true;
      check_failure(e);
    }
    CHECK(thrown);
  }
  SECTION("specdec::SpeculativeDecoder over specdec::LogitsModel<llama::Engine>") {
    specdec::LogitsModel target_model(target_engine);
    specdec::LogitsModel draft_model(draft_engine);
    specdec::DecoderOptions decoder_options;
    decoder_options.sampling.temperature = 0.0;
    decoder_options.gamma_policy = specdec::FixedGamma{4};
    specdec::SpeculativeDecoder decoder(target_model, draft_model, decoder_options);
    bool thrown = false;
    try {
      (void)decoder.generate(prompt, 24, 7);
    } catch (const specdec::decoding_error& e) {
      thrown = true;
      check_failure(e);
    }
    CHECK(thrown);
    // The decoder and the engines stay usable: a run that fits reproduces the plain one.
    const auto short_run = decoder.generate(prompt, 8, 7);
    CHECK(std::equal(short_run.tokens.begin(), short_run.tokens.end(), plain.tokens.begin(),
                     plain.tokens.begin() + 8));
    CHECK(short_run.tokens.size() == 8);
  }
}
