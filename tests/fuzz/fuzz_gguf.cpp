// libFuzzer harness: the llama engine example's loading path (examples/llama), where
// untrusted bytes enter an engine. The input is a GGUF file: GgufFile parses it,
// llama::Model loads it (metadata, tensor shapes and types, dequantisation, tokenizer), and a
// model that loads runs: a forward pass of a few positions, a batched pass of a draft, a
// token tree, and the tokenizer on a fixed text.
//
// Invariants (abort on violation): a malformed file throws llama::model_error and nothing
// else (no other exception, no sanitizer report, no hang); every tensor of a parsed file lies
// inside it; a loaded model's tensors have the shapes its configuration implies; logits rows
// have vocab_size entries and the batched rows equal the one-at-a-time rows bit for bit; the
// engine throws only llama::engine_error; encoded ids lie in [0, vocab) and decode without
// throwing.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "llama/engine.hpp"
#include "llama/gguf.hpp"
#include "llama/model.hpp"
#include "specdec/draft_tree.hpp"

namespace {

void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

void run(const llama::Model& model) {
  const llama::Config& c = model.config();
  require(model.embedding().rows == c.vocab && model.embedding().cols == c.dim, "embedding shape");
  require(model.output().rows == c.vocab && model.output().cols == c.dim, "output shape");
  require(model.layers().size() == c.layers, "layer count");
  if (c.vocab * c.dim > (std::size_t{1} << 22) || c.layers > 64) return;  // keep runs fast
  llama::Engine engine(model, 24);
  const std::vector<specdec::token_id> context = {0, static_cast<specdec::token_id>(c.vocab - 1)};
  std::vector<float> single;
  try {
    for (std::size_t n = 1; n <= context.size(); ++n) {
      const auto row = engine.next_token_logits(std::span(context).first(n));
      require(row.size() == c.vocab, "logits row size");
      single.insert(single.end(), row.begin(), row.end());
    }
    llama::Engine fresh(model, 24);
    const auto rows =
        fresh.score_draft_logits(std::span(context).first(1), std::span(context).subspan(1));
    require(rows.rows() == 2 && rows.cols() == c.vocab, "batched rows shape");
    for (std::size_t i = 0; i < single.size(); ++i) {
      const float a = single[i];
      const float b = rows.data()[i];
      require(a == b || (a != a && b != b), "batched rows equal one-at-a-time rows");
    }
    const std::vector<specdec::token_id> tokens = {specdec::no_token, 0, 0, 0};
    const std::vector<std::size_t> parents = {specdec::TokenTreeView::npos, 0, 0, 1};
    const std::vector<std::size_t> depths = {0, 1, 1, 2};
    const auto tree = fresh.score_tree_logits(context, {tokens, parents, depths});
    require(tree.rows() == 4, "tree rows");
  } catch (const llama::engine_error&) {
  }
  const llama::Tokenizer& tokenizer = model.tokenizer();
  if (tokenizer.encodes_text()) {
    const std::string text = "def f(x):\n    return x  # \xC3\xA9\xE2\x98\x83\xF8!";
    const std::vector<llama::token> ids = tokenizer.encode(text);
    for (const llama::token id : ids) {
      require(id >= 0 && static_cast<std::size_t>(id) < c.vocab, "encoded id in range");
    }
    (void)tokenizer.decode(ids);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<unsigned char> bytes(data, data + size);
  try {
    const llama::GgufFile file = llama::GgufFile::from_bytes("fuzz.gguf", bytes);
    for (const llama::TensorInfo& t : file.tensors()) {
      require(t.offset <= size && t.bytes <= size - t.offset, "tensor inside the file");
    }
    const llama::Model model(file);
    run(model);
  } catch (const llama::model_error&) {
  }
  return 0;
}
