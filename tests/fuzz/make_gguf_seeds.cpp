// Writes the seed corpus of fuzz_gguf (tests/fuzz/corpus/fuzz_gguf): tiny llama models that
// load, in several layouts, so the fuzzer starts from files that reach the loader and the
// engine. Usage: make_gguf_seeds <directory>
#include <cstdio>
#include <filesystem>
#include <string>

#include "support/gguf_writer.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_gguf_seeds <directory>\n");
    return 2;
  }
  const std::filesystem::path directory = argv[1];
  std::filesystem::create_directories(directory);
  using specdec::testing::GgufWriter;
  using specdec::testing::TinyLlama;
  // The smallest shapes the loader accepts: every tensor present, a few bytes each.
  const TinyLlama base{.vocab = 8,
                       .dim = 4,
                       .layers = 1,
                       .heads = 2,
                       .kv_heads = 1,
                       .ffn = 4,
                       .context = 16,
                       .tied = true,
                       .f16 = true,
                       .weight_scale = 0.5F,
                       .seed = 3};
  const auto write = [&](const std::string& name, TinyLlama shape, auto&& extra) {
    GgufWriter w;
    specdec::testing::add_tiny_llama(w, shape);
    extra(w);
    w.write(directory / name);
  };
  write("tied-f16.gguf", base, [](GgufWriter&) {});
  TinyLlama untied = base;
  untied.tied = false;
  untied.f16 = false;
  untied.kv_heads = 2;
  write("untied-f32.gguf", untied, [](GgufWriter&) {});
  write("rope-scaling.gguf", base, [](GgufWriter& w) {
    w.add_string("llama.rope.scaling.type", "linear");
    w.add_f32("llama.rope.scaling.factor", 2.0F);
    w.add_vector("rope_freqs.weight", {1.0F});
  });
  TinyLlama two_layers = base;
  two_layers.layers = 2;
  two_layers.vocab = 12;
  write("two-layers.gguf", two_layers, [](GgufWriter& w) {
    w.add_u32("llama.vocab_size", 12);
    w.add_bool("tokenizer.ggml.add_bos_token", true);
  });
  return 0;
}
