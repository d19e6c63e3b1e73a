// The llama engine example (examples/llama) against its promises:
//  - its logits equal the float64 reference logits of the shipped model pair;
//  - its KV cache is invisible: incremental, batched (score_draft_logits), rolled back and
//    tree-shaped (score_tree_logits) evaluations give the logits of a fresh engine that
//    evaluates the whole context, bit for bit (the kernels' batch invariance), in one forward
//    pass per call and with every position evaluated once;
//  - greedy speculative decoding reproduces greedy plain decoding token for token, for every
//    drafter, on both kernel paths;
//  - at T > 0 speculative sampling on the engine reproduces the law of plain sampling
//    (chi-square at a false-failure rate of 1e-9, with broken variants it is shown to reject);
//  - after an exception the engine recovers.
// Malformed files and requests are catalogued in llama_gguf_test.cpp / llama_errors_test.cpp.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>

#include "llama/engine.hpp"
#include "llama/generate.hpp"
#include "llama/gguf.hpp"
#include "llama/kernels.hpp"
#include "llama/model.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/random.hpp"
#include "specdec/sampling.hpp"
#include "specdec/statistics.hpp"
#include "support/gguf_writer.hpp"

// Sanitized and unoptimized builds run the shipped target (millions of parameters) slowly: it
// generates fewer tokens there.
#if defined(__OPTIMIZE__)
#define LLAMA_ENGINE_TEST_OPTIMIZED 1
#else
#define LLAMA_ENGINE_TEST_OPTIMIZED 0
#endif
#if defined(__SANITIZE_ADDRESS__)
#define LLAMA_ENGINE_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LLAMA_ENGINE_TEST_SANITIZED 1
#endif
#endif
#ifndef LLAMA_ENGINE_TEST_SANITIZED
#define LLAMA_ENGINE_TEST_SANITIZED 0
#endif

namespace {

using llama::drafter_kind;
using llama::Engine;
using llama::Model;
using llama::kernels::isa;
using specdec::token_id;
using specdec::testing::TinyLlama;
using Tokens = std::vector<token_id>;
using Logits = std::vector<float>;

constexpr bool slow_build = LLAMA_ENGINE_TEST_SANITIZED != 0 || LLAMA_ENGINE_TEST_OPTIMIZED == 0;
constexpr token_id bos = 1;  // <s> of the tiny models

// ---- models ------------------------------------------------------------------------------

std::string name_of(const TinyLlama& s) {
  return "v" + std::to_string(s.vocab) + "-d" + std::to_string(s.dim) + "-l" +
         std::to_string(s.layers) + "-h" + std::to_string(s.heads) + "-kv" +
         std::to_string(s.kv_heads) + "-f" + std::to_string(s.ffn) + (s.tied ? "-tied" : "") +
         (s.f16 ? "-f16" : "-f32") + "-w" + std::to_string(s.weight_scale) + "-s" +
         std::to_string(s.seed);
}

// A tiny random model with `shape`.
Model load_tiny(const TinyLlama& shape) {
  return specdec::testing::load_tiny_llama(shape, name_of(shape));
}

// The shipped pair and its reference logits (examples/llama/models, see
// scripts/train_llama_pair.py stage_export).
Model shipped_model(const std::string& name) {
  return Model(std::string(SPECDEC_LLAMA_MODELS) + "/" + name + ".gguf");
}

llama::GgufFile shipped_reference() {
  return llama::GgufFile(std::string(SPECDEC_LLAMA_MODELS) + "/reference.gguf");
}

std::size_t reference_contexts(const llama::GgufFile& reference) {
  return static_cast<std::size_t>(reference.unsigned_integer("reference.context_count"));
}

// Context `index` of reference.gguf (an I32 tensor).
Tokens reference_context(const llama::GgufFile& reference, std::size_t index) {
  const llama::TensorInfo* tensor = reference.find_tensor("context." + std::to_string(index));
  REQUIRE(tensor != nullptr);
  REQUIRE(tensor->type == static_cast<std::uint32_t>(llama::tensor_type::i32));
  Tokens context(static_cast<std::size_t>(tensor->elements()));
  std::memcpy(context.data(), reference.data(*tensor), context.size() * sizeof(token_id));
  return context;
}

// The longest reference context: real text for prompts.
Tokens longest_reference_context() {
  const llama::GgufFile reference = shipped_reference();
  Tokens longest;
  for (std::size_t i = 0; i < reference_contexts(reference); ++i) {
    Tokens context = reference_context(reference, i);
    if (context.size() > longest.size()) longest = std::move(context);
  }
  return longest;
}

// The configurations under test: grouped-query (2:1 and 4:1) and plain multi-head attention,
// tied and untied output, F32 and F16 weights. Model, head and feed-forward dimensions that
// are not multiples of 8 (36 / 12 / 44, 40 / 10, 24 / 12) run the kernels' scalar tails; a
// head of 72 runs attention's blocks of 64 value lanes and a tail.
std::vector<TinyLlama> engine_shapes() {
  return {
      {.vocab = 64,
       .dim = 32,
       .layers = 2,
       .heads = 4,
       .kv_heads = 2,
       .ffn = 48,
       .context = 96,
       .tied = false,
       .f16 = false,
       .weight_scale = 0.25F,
       .seed = 1},
      {.vocab = 50,
       .dim = 36,
       .layers = 2,
       .heads = 3,
       .kv_heads = 3,
       .ffn = 44,
       .context = 96,
       .tied = true,
       .f16 = true,
       .weight_scale = 0.3F,
       .seed = 2},
      {.vocab = 61,
       .dim = 40,
       .layers = 3,
       .heads = 4,
       .kv_heads = 1,
       .ffn = 72,
       .context = 96,
       .tied = false,
       .f16 = true,
       .weight_scale = 0.25F,
       .seed = 3},
      {.vocab = 64,
       .dim = 24,
       .layers = 1,
       .heads = 2,
       .kv_heads = 2,
       .ffn = 64,
       .context = 96,
       .tied = true,
       .f16 = false,
       .weight_scale = 0.5F,
       .seed = 4},
      {.vocab = 48,
       .dim = 144,
       .layers = 1,
       .heads = 2,
       .kv_heads = 1,
       .ffn = 96,
       .context = 96,
       .tied = false,
       .f16 = false,
       .weight_scale = 0.15F,
       .seed = 5},
  };
}

// ---- tokens and logits -------------------------------------------------------------------

Tokens random_tokens(std::size_t count, std::size_t vocab, specdec::default_engine& g) {
  Tokens tokens(count);
  for (token_id& t : tokens) t = static_cast<token_id>(specdec::uniform_below(g, vocab));
  return tokens;
}

Tokens random_context(std::size_t length, std::size_t vocab, specdec::default_engine& g) {
  Tokens context = random_tokens(length, vocab, g);
  context.front() = bos;
  return context;
}

Tokens concat(std::span<const token_id> a, std::span<const token_id> b) {
  Tokens out(a.begin(), a.end());
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

Tokens prefix_of(std::span<const token_id> tokens, std::size_t length) {
  return {tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(length)};
}

Logits to_logits(std::span<const float> row) {
  return {row.begin(), row.end()};
}

// The logits after `context` from an engine that has seen nothing: the whole context in one
// forward pass, no cache involved.
Logits fresh_logits(const Model& model, std::span<const token_id> context) {
  Engine engine(model);
  return to_logits(engine.next_token_logits(context));
}

// Checks every row of `rows` (row i: after context + extension[0..i)) against a fresh engine.
void check_rows_against_fresh(const Model& model, specdec::RowsView<const float> rows,
                              std::span<const token_id> context,
                              std::span<const token_id> extension) {
  REQUIRE(rows.rows() == extension.size() + 1);
  for (std::size_t i = 0; i < rows.rows(); ++i) {
    INFO("row " << i);
    CHECK(to_logits(rows.row(i)) == fresh_logits(model, concat(context, prefix_of(extension, i))));
  }
}

// Selects a kernel path for one scope and restores the previous one afterwards (also when a
// REQUIRE leaves the scope early).
class KernelPathScope {
 public:
  explicit KernelPathScope(isa path)
      : previous_(llama::kernels::active()), selected_(llama::kernels::select(path)) {}
  ~KernelPathScope() { llama::kernels::select(previous_); }
  KernelPathScope(const KernelPathScope&) = delete;
  KernelPathScope& operator=(const KernelPathScope&) = delete;
  // False when the CPU cannot run the path (then nothing changed).
  [[nodiscard]] bool selected() const noexcept { return selected_; }

 private:
  isa previous_;
  bool selected_;
};

// ---- token trees -------------------------------------------------------------------------

// A token tree as TokenTreeView describes it: node 0 the root, parents before children.
struct TokenTree {
  Tokens tokens{0};
  std::vector<std::size_t> parents{specdec::TokenTreeView::npos};
  std::vector<std::size_t> depths{0};

  std::size_t add(std::size_t parent, token_id token) {
    tokens.push_back(token);
    parents.push_back(parent);
    depths.push_back(depths[parent] + 1);
    return tokens.size() - 1;
  }
  [[nodiscard]] std::size_t size() const { return tokens.size(); }
  [[nodiscard]] specdec::TokenTreeView view() const { return {tokens, parents, depths}; }
  [[nodiscard]] Tokens path(std::size_t node) const {
    Tokens out;
    view().append_path(node, out);
    return out;
  }
  // Whether the path of `node` occupies the first tree slots in order (nodes 1, 2, ...,
  // depth): the cache keeps such a path where it is (truncate), any other is moved
  // (keep_tree_path).
  [[nodiscard]] bool path_in_place(std::size_t node) const {
    for (std::size_t at = node; at != 0; at = parents[at]) {
      if (at != depths[at]) return false;
    }
    return true;
  }
  // How many leading tokens of `continuation` the cache can keep: it walks from the root
  // along the tokens, taking the first child with each token (equal siblings have identical
  // entries).
  [[nodiscard]] std::size_t kept_depth(std::span<const token_id> continuation) const {
    std::size_t node = 0;
    std::size_t depth = 0;
    for (std::size_t i = 1; i < size() && depth < continuation.size(); ++i) {
      if (parents[i] == node && tokens[i] == continuation[depth]) {
        node = i;
        ++depth;
      }
    }
    return depth;
  }
};

TokenTree chain_tree(std::span<const token_id> tokens) {
  TokenTree tree;
  for (const token_id t : tokens) tree.add(tree.size() - 1, t);
  return tree;
}

// Named trees of several shapes over tokens drawn from `g`: chains, wide, deep with branches,
// duplicate siblings, random.
std::vector<std::pair<std::string, TokenTree>> test_trees(std::size_t vocab,
                                                          specdec::default_engine& g) {
  std::vector<std::pair<std::string, TokenTree>> trees;
  const auto token = [&] { return static_cast<token_id>(specdec::uniform_below(g, vocab)); };
  trees.emplace_back("the root alone", TokenTree{});
  trees.emplace_back("chain of 1", chain_tree(random_tokens(1, vocab, g)));
  trees.emplace_back("chain of 5", chain_tree(random_tokens(5, vocab, g)));
  TokenTree wide;
  for (int i = 0; i < 6; ++i) wide.add(0, token());
  trees.emplace_back("six children of the root", wide);
  TokenTree deep = chain_tree(random_tokens(4, vocab, g));
  deep.add(0, token());
  deep.add(1, token());
  deep.add(2, token());
  deep.add(5, token());
  deep.add(8, token());
  trees.emplace_back("chain of 4 with branches", deep);
  // Siblings with equal tokens: the path through the second copy of `a` to `c` is kept
  // through the first copy; the one through it to `d` only up to `a`.
  const token_id a = token();
  const token_id b = (a + 1) % static_cast<token_id>(vocab);
  const token_id c = token();
  const token_id d = (c + 1) % static_cast<token_id>(vocab);
  TokenTree duplicates;
  const std::size_t first_a = duplicates.add(0, a);
  const std::size_t second_a = duplicates.add(0, a);
  duplicates.add(0, b);
  duplicates.add(first_a, c);
  const std::size_t second_d = duplicates.add(second_a, d);
  duplicates.add(second_a, c);
  duplicates.add(second_d, token());
  trees.emplace_back("duplicate siblings", duplicates);
  for (int r = 0; r < 3; ++r) {
    // Tokens from a set of four, so that equal siblings are common.
    const Tokens alphabet = random_tokens(4, vocab, g);
    TokenTree tree;
    for (std::size_t i = 1; i < 10; ++i) {
      tree.add(specdec::uniform_below(g, i), alphabet[specdec::uniform_below(g, 4)]);
    }
    trees.emplace_back("random tree " + std::to_string(r), tree);
  }
  return trees;
}

}  // namespace

// ---- 1. reference logits ---------------------------------------------------------------

TEST_CASE("llama engine: logits of the shipped pair equal the float64 reference logits") {
  const llama::GgufFile reference = shipped_reference();
  const auto rows_per_context =
      static_cast<std::size_t>(reference.unsigned_integer("reference.rows"));
  const std::size_t contexts = reference_contexts(reference);
  REQUIRE(rows_per_context > 0);
  REQUIRE(contexts > 0);
  constexpr double tolerance = 1e-3;
  for (const std::string name : {"target", "draft"}) {
    const Model model = shipped_model(name);
    const std::size_t vocab = model.config().vocab;
    double max_difference = 0.0;
    for (std::size_t i = 0; i < contexts; ++i) {
      INFO(name << ", context " << i);
      const Tokens context = reference_context(reference, i);
      const llama::TensorInfo* logits_tensor =
          reference.find_tensor(name + ".logits." + std::to_string(i));
      REQUIRE(logits_tensor != nullptr);
      REQUIRE(logits_tensor->type == static_cast<std::uint32_t>(llama::tensor_type::f32));
      // One row per position of the last rows_per_context (all of a shorter context).
      const std::size_t rows = std::min(rows_per_context, context.size());
      REQUIRE(logits_tensor->dims == std::vector<std::uint64_t>{vocab, rows});
      std::vector<float> expected(rows * vocab);
      std::memcpy(expected.data(), reference.data(*logits_tensor), expected.size() * sizeof(float));
      // The rows after context[0..L-rows+1), ..., context: the last rows - 1 tokens as a draft.
      const std::size_t scored_from = context.size() - rows + 1;
      Engine engine(model);
      const auto logits =
          engine.score_draft_logits(std::span<const token_id>(context).first(scored_from),
                                    std::span<const token_id>(context).subspan(scored_from));
      REQUIRE(logits.rows() == rows);
      double difference = 0.0;
      for (std::size_t r = 0; r < rows; ++r) {
        for (std::size_t v = 0; v < vocab; ++v) {
          difference = std::max(
              difference, std::abs(static_cast<double>(logits(r, v)) - expected[r * vocab + v]));
        }
      }
      CHECK(difference <= tolerance);
      max_difference = std::max(max_difference, difference);
    }
    INFO(name << ": max |engine - reference| over all contexts");
    CHECK(max_difference <= tolerance);
  }
}

// ---- 2. incremental decoding -------------------------------------------------------------

TEST_CASE(
    "llama engine: extending a context one token at a time equals a fresh evaluation, "
    "bit for bit") {
  for (const TinyLlama& shape : engine_shapes()) {
    const Model model = load_tiny(shape);
    for (const std::uint64_t seed : {11U, 12U}) {
      INFO(name_of(shape) << ", context seed " << seed);
      specdec::default_engine g(seed);
      const Tokens context = random_context(40, shape.vocab, g);
      Engine engine(model);
      for (std::size_t n = 1; n <= context.size(); ++n) {
        INFO("prefix of " << n);
        const std::span<const token_id> prefix(context.data(), n);
        CHECK(to_logits(engine.next_token_logits(prefix)) == fresh_logits(model, prefix));
      }
      // One new position per call: the rows came from the cache, not from recomputation.
      CHECK(engine.counters().forward_passes == context.size());
      CHECK(engine.counters().positions == context.size());
      // Back to an earlier prefix and off in another direction: the cache drops what follows
      // the common prefix and evaluates only the new token.
      for (const std::size_t kept : {30U, 7U, 1U}) {
        INFO("back to a prefix of " << kept);
        Tokens other = prefix_of(context, kept);
        other.push_back((context[kept] + 1) % static_cast<token_id>(shape.vocab));
        engine.reset_counters();
        CHECK(to_logits(engine.next_token_logits(other)) == fresh_logits(model, other));
        CHECK(engine.counters().positions == 1);
      }
    }
  }
}

// ---- 3. batched drafts -------------------------------------------------------------------

TEST_CASE(
    "llama engine: score_draft_logits rows equal next_token_logits of each prefix, in one "
    "forward pass") {
  for (const TinyLlama& shape : engine_shapes()) {
    const Model model = load_tiny(shape);
    specdec::default_engine g(21);
    for (std::size_t gamma = 0; gamma <= 12; ++gamma) {
      const Tokens context = random_context(3 + 2 * gamma, shape.vocab, g);
      const Tokens draft = random_tokens(gamma, shape.vocab, g);
      // Cold: context and draft in one pass. Warm: the cache holds the context already (the
      // last context position is evaluated again: its row is row 0).
      for (const bool warm : {false, true}) {
        INFO(name_of(shape) << ", gamma " << gamma << (warm ? ", warm" : ", cold"));
        Engine engine(model);
        if (warm) (void)engine.next_token_logits(context);
        engine.reset_counters();
        const auto rows = engine.score_draft_logits(context, draft);
        CHECK(engine.counters().forward_passes == 1);
        CHECK(engine.counters().logit_rows == gamma + 1);
        CHECK(engine.counters().positions == (warm ? 1 : context.size()) + gamma);
        check_rows_against_fresh(model, rows, context, draft);
      }
    }
  }
}

// ---- 3b. many sequences (lanes) -----------------------------------------------------------

TEST_CASE(
    "llama engine: score_batch_logits and draft_batch_logits rows equal each sequence's own "
    "rows, bit for bit, in one forward pass per call") {
  // Five sequences in an engine of six lanes, over several steps as the batch decoder makes
  // them: each step every sequence drafts, keeps a random prefix of its drafts plus one
  // token, and is scored with the others in one pass (its lane's cache rolled back and
  // extended); sequences leave and new ones take their lanes, keeping the shared prompt.
  for (const TinyLlama& shape : engine_shapes()) {
    const Model model = load_tiny(shape);
    specdec::default_engine g(31);
    Engine engine(model, 96, nullptr, 6);
    REQUIRE(engine.lanes() == 6);
    const Tokens prompt = random_context(9, shape.vocab, g);
    std::vector<std::uint64_t> ids{10, 11, 12, 13, 14};
    std::vector<Tokens> contexts(ids.size(), prompt);
    for (std::size_t b = 1; b < contexts.size(); ++b) {
      contexts[b].push_back(static_cast<token_id>(b));  // not all alike
    }
    for (int step = 0; step < 5; ++step) {
      std::vector<Tokens> drafts;
      std::vector<specdec::BatchScoreRequest> requests;
      for (std::size_t b = 0; b < ids.size(); ++b) {
        drafts.push_back(random_tokens((b + static_cast<std::size_t>(step)) % 4, shape.vocab, g));
      }
      for (std::size_t b = 0; b < ids.size(); ++b)
        requests.push_back({contexts[b], drafts[b], ids[b]});
      // Drafting: one row per sequence after context + its first drafts.
      std::vector<specdec::BatchScoreRequest> partial;
      for (std::size_t b = 0; b < ids.size(); ++b) {
        partial.push_back({contexts[b],
                           std::span<const token_id>(drafts[b]).first(drafts[b].size() / 2),
                           ids[b]});
      }
      engine.reset_counters();
      const auto drafted = engine.draft_batch_logits(partial);
      CHECK(engine.counters().forward_passes == 1);
      REQUIRE(drafted.rows() == ids.size());
      for (std::size_t b = 0; b < ids.size(); ++b) {
        INFO(name_of(shape) << ", step " << step << ", sequence " << ids[b] << ", draft row");
        CHECK(to_logits(drafted.row(b)) ==
              fresh_logits(model, concat(contexts[b], partial[b].drafts)));
      }
      engine.reset_counters();
      const auto rows = engine.score_batch_logits(requests);
      CHECK(engine.counters().forward_passes == 1);
      std::size_t at = 0;
      for (std::size_t b = 0; b < ids.size(); ++b) {
        INFO(name_of(shape) << ", step " << step << ", sequence " << ids[b]);
        const std::size_t n = drafts[b].size() + 1;
        check_rows_against_fresh(
            model, specdec::RowsView<const float>(rows.row(at).data(), n, rows.cols()), contexts[b],
            drafts[b]);
        at += n;
      }
      REQUIRE(at == rows.rows());
      // Each sequence keeps a random prefix of its drafts and one more token.
      for (std::size_t b = 0; b < ids.size(); ++b) {
        const std::size_t kept = specdec::uniform_below(g, drafts[b].size() + 1);
        contexts[b].insert(contexts[b].end(), drafts[b].begin(),
                           drafts[b].begin() + static_cast<std::ptrdiff_t>(kept));
        contexts[b].push_back(random_tokens(1, shape.vocab, g).front());
      }
      // Sequence ids[step % 5] leaves; a new one with the bare prompt takes a lane.
      engine.release_sequence(ids[static_cast<std::size_t>(step) % ids.size()]);
      ids[static_cast<std::size_t>(step) % ids.size()] = 100 + static_cast<std::uint64_t>(step);
      contexts[static_cast<std::size_t>(step) % ids.size()] = prompt;
    }
  }
}

TEST_CASE("llama engine: a batch call for more sequences than lanes names the sequence") {
  const TinyLlama shape = engine_shapes().front();
  const Model model = load_tiny(shape);
  Engine engine(model, 32, nullptr, 2);
  const Tokens context{bos, 3, 4};
  const Tokens none;
  const std::vector<specdec::BatchScoreRequest> three{
      {context, none, 1}, {context, none, 2}, {context, none, 3}};
  try {
    (void)engine.score_batch_logits(three);
    FAIL("no exception");
  } catch (const llama::engine_error& e) {
    CHECK(std::string(e.what()).find("sequence 3: all 2 lanes of the engine are taken") !=
          std::string::npos);
  }
  // After the error the engine serves again; released lanes are reused.
  engine.release_sequence(1);
  engine.release_sequence(2);
  const std::vector<specdec::BatchScoreRequest> two{{context, none, 3}, {context, none, 4}};
  const auto rows = engine.score_batch_logits(two);
  CHECK(rows.rows() == 2);
  CHECK(to_logits(rows.row(1)) == fresh_logits(model, context));
}

// ---- 4. rollback -------------------------------------------------------------------------

TEST_CASE(
    "llama engine: after a rejection the cache rolls back to the accepted prefix, equals "
    "a fresh run and evaluates nothing twice") {
  for (const TinyLlama& shape : engine_shapes()) {
    const Model model = load_tiny(shape);
    const auto vocab = static_cast<token_id>(shape.vocab);
    specdec::default_engine g(31);
    const Tokens context = random_context(17, shape.vocab, g);
    constexpr std::size_t gamma = 6;
    const Tokens draft = random_tokens(gamma, shape.vocab, g);
    for (std::size_t accepted = 0; accepted <= gamma; ++accepted) {
      // The decoder's next context: the accepted drafts and a correction t, which differs
      // from the rejected draft (or, at T > 0, may equal it; then one fewer is rolled back).
      for (const bool correction_equals_draft : {false, true}) {
        if (correction_equals_draft && accepted == gamma) continue;
        for (const bool batched : {true, false}) {
          INFO(name_of(shape) << ", " << accepted << " of " << gamma << " accepted"
                              << (correction_equals_draft ? ", t equal to the draft" : "")
                              << (batched ? ", then score_draft_logits"
                                          : ", then next_token_logits"));
          Engine engine(model);
          (void)engine.score_draft_logits(context, draft);
          Tokens next = concat(context, prefix_of(draft, accepted));
          const token_id rejected = accepted < gamma ? draft[accepted] : 0;
          next.push_back(correction_equals_draft ? rejected : (rejected + 1) % vocab);
          const Tokens next_draft = batched ? random_tokens(3, shape.vocab, g) : Tokens{};
          engine.reset_counters();
          const auto rows = batched ? engine.score_draft_logits(next, next_draft)
                                    : specdec::RowsView<const float>(
                                          engine.next_token_logits(next).data(), 1, shape.vocab);
          // Only the correction and the new drafts are evaluated: the rejected drafts are
          // dropped, the accepted ones kept. (The correction is evaluated even when its entry
          // exists: the engine keeps the logits of its latest pass only.)
          CHECK(engine.counters().forward_passes == 1);
          CHECK(engine.counters().positions == 1 + next_draft.size());
          CHECK(engine.cached() == next.size() + next_draft.size());
          check_rows_against_fresh(model, rows, next, next_draft);
        }
      }
    }
  }
}

TEST_CASE(
    "llama engine: a decode with random draft lengths and rejections evaluates every "
    "position once and matches a fresh engine at every step") {
  for (const TinyLlama& shape : engine_shapes()) {
    const Model model = load_tiny(shape);
    specdec::default_engine g(41);
    Tokens context = random_context(5, shape.vocab, g);
    Engine engine(model);
    for (std::size_t step = 0; step < 12; ++step) {
      INFO(name_of(shape) << ", step " << step);
      const Tokens draft = random_tokens(specdec::uniform_below(g, 7), shape.vocab, g);
      engine.reset_counters();
      const auto rows = engine.score_draft_logits(context, draft);
      // Step 0 evaluates the prompt; later steps the previous correction and the drafts.
      CHECK(engine.counters().positions == (step == 0 ? context.size() : 1) + draft.size());
      check_rows_against_fresh(model, rows, context, draft);
      const std::size_t accepted = specdec::uniform_below(g, draft.size() + 1);
      context.insert(context.end(), draft.begin(),
                     draft.begin() + static_cast<std::ptrdiff_t>(accepted));
      context.push_back(static_cast<token_id>(specdec::uniform_below(g, shape.vocab)));
    }
  }
}

// ---- 5. token trees ----------------------------------------------------------------------

TEST_CASE(
    "llama engine: a token tree pass equals its paths scored one by one, and the accepted "
    "path is kept without recomputation") {
  std::size_t paths_in_place = 0;  // accepted paths kept where they were (chain prefixes)
  std::size_t paths_moved = 0;     // accepted paths kept by keep_tree_path
  for (const TinyLlama& shape : engine_shapes()) {
    const Model model = load_tiny(shape);
    specdec::default_engine g(51);
    for (const auto& [tree_name, tree] : test_trees(shape.vocab, g)) {
      const Tokens context = random_context(9, shape.vocab, g);
      // Warm: the cache holds the context, as in decoding (its last position is evaluated
      // again: its row is the root's). Cold: the context and the tree in one pass.
      for (const bool warm : {true, false}) {
        INFO(name_of(shape) << ", " << tree_name << (warm ? ", warm" : ", cold"));
        Engine engine(model);
        if (warm) (void)engine.next_token_logits(context);
        engine.reset_counters();
        const auto rows = engine.score_tree_logits(context, tree.view());
        CHECK(engine.counters().forward_passes == 1);
        CHECK(engine.counters().positions == (warm ? 1 : context.size()) + tree.size() - 1);
        CHECK(engine.counters().logit_rows == tree.size());
        REQUIRE(rows.rows() == tree.size());
        for (std::size_t node = 0; node < tree.size(); ++node) {
          INFO("node " << node);
          CHECK(to_logits(rows.row(node)) == fresh_logits(model, concat(context, tree.path(node))));
        }
      }
      {
        // A context that leaves the tree's context before its end drops every tree slot.
        INFO(name_of(shape) << ", " << tree_name << ", then a shorter context");
        Engine engine(model);
        (void)engine.score_tree_logits(context, tree.view());
        Tokens other = prefix_of(context, 5);
        other.push_back((context[5] + 1) % static_cast<token_id>(shape.vocab));
        engine.reset_counters();
        CHECK(to_logits(engine.next_token_logits(other)) == fresh_logits(model, other));
        CHECK(engine.counters().positions == 1);
      }
      // Every node as the accepted one, then a correction t, then each of the three calls.
      for (std::size_t case_index = 0; case_index < 3 * tree.size(); ++case_index) {
        const std::size_t node = case_index / 3;
        const std::size_t call = case_index % 3;
        const Tokens path = tree.path(node);
        Tokens continuation = path;
        continuation.push_back(static_cast<token_id>(specdec::uniform_below(g, shape.vocab)));
        const Tokens next = concat(context, continuation);
        const std::size_t kept = std::min(tree.kept_depth(continuation), path.size());
        if (node != 0 && kept == path.size()) {
          ++(tree.path_in_place(node) ? paths_in_place : paths_moved);
        }
        INFO(name_of(shape) << ", " << tree_name << ", accepted node " << node << " (depth "
                            << path.size() << ", kept " << kept << "), then "
                            << (call == 0   ? "next_token_logits"
                                : call == 1 ? "score_draft_logits"
                                            : "score_tree_logits"));
        Engine engine(model);
        (void)engine.next_token_logits(context);
        (void)engine.score_tree_logits(context, tree.view());
        engine.reset_counters();
        // Evaluated: the part of the path the cache could not keep (only after a duplicate
        // sibling), the correction t, and what the call scores.
        const std::size_t recomputed = path.size() - kept + 1;
        if (call == 0) {
          const Logits row = to_logits(engine.next_token_logits(next));
          CHECK(engine.counters().positions == recomputed);
          CHECK(row == fresh_logits(model, next));
        } else if (call == 1) {
          const Tokens draft = random_tokens(2, shape.vocab, g);
          const auto rows = engine.score_draft_logits(next, draft);
          CHECK(engine.counters().positions == recomputed + draft.size());
          check_rows_against_fresh(model, rows, next, draft);
        } else {
          TokenTree second;
          const std::size_t first_child =
              second.add(0, static_cast<token_id>(specdec::uniform_below(g, shape.vocab)));
          second.add(0, static_cast<token_id>(specdec::uniform_below(g, shape.vocab)));
          second.add(first_child, static_cast<token_id>(specdec::uniform_below(g, shape.vocab)));
          const auto rows = engine.score_tree_logits(next, second.view());
          CHECK(engine.counters().positions == recomputed + second.size() - 1);
          REQUIRE(rows.rows() == second.size());
          for (std::size_t i = 0; i < second.size(); ++i) {
            CHECK(to_logits(rows.row(i)) == fresh_logits(model, concat(next, second.path(i))));
          }
        }
        CHECK(engine.counters().forward_passes == 1);
      }
    }
  }
  // Both ways of keeping a path were exercised.
  CHECK(paths_in_place > 0);
  CHECK(paths_moved > 0);
}

// ---- 6. kernels --------------------------------------------------------------------------

TEST_CASE(
    "llama kernels: every column of a batched matmul equals the single-column product, "
    "and dot equals one element, on every path") {
  struct Size {
    std::size_t rows, cols;
  };
  // Rows that are not multiples of any tile height (8, 4, 3, 2), columns with scalar tails.
  // With more than 6 columns, rows go in blocks of about 16 KiB (a multiple of 6 rows):
  // 61 x 1000 and 300 x 129 take several blocks, the last one partial.
  const std::vector<Size> sizes = {{1, 1},   {7, 5},    {13, 31},   {29, 67},
                                   {64, 40}, {37, 123}, {61, 1000}, {300, 129}};
  constexpr std::size_t max_columns = 20;
  const isa default_path = llama::kernels::active();
  for (const isa path : {isa::portable, isa::avx2}) {
    const KernelPathScope scope(path);
    if (!scope.selected()) continue;  // a CPU without AVX2 and FMA
    REQUIRE(llama::kernels::active() == path);
    specdec::default_engine g(61);
    for (const Size size : sizes) {
      // Strides larger than the vectors, as the engine's buffers may have.
      const std::size_t x_stride = size.cols + 3;
      const std::size_t y_stride = size.rows + 5;
      std::vector<float> w(size.rows * size.cols);
      std::vector<float> x(max_columns * x_stride);
      for (float& v : w) v = specdec::uniform01<float>(g) * 2.0F - 1.0F;
      for (float& v : x) v = specdec::uniform01<float>(g) * 2.0F - 1.0F;
      // The single-column products.
      std::vector<float> single(max_columns * size.rows);
      for (std::size_t j = 0; j < max_columns; ++j) {
        llama::kernels::matmul(w.data(), size.rows, size.cols, x.data() + j * x_stride, x_stride, 1,
                               single.data() + j * size.rows, size.rows);
      }
      for (std::size_t j = 0; j < max_columns; ++j) {
        for (std::size_t o = 0; o < size.rows; ++o) {
          const float* row = w.data() + o * size.cols;
          const float* column = x.data() + j * x_stride;
          const float value = single[j * size.rows + o];
          // dot() is one element of the product, and the product is the product.
          CHECK(llama::kernels::dot(row, column, size.cols) == value);
          double exact = 0.0;
          double magnitude = 0.0;
          for (std::size_t k = 0; k < size.cols; ++k) {
            exact += static_cast<double>(row[k]) * column[k];
            magnitude += std::abs(static_cast<double>(row[k]) * column[k]);
          }
          CHECK(std::abs(value - exact) <= 1e-6 * magnitude + 1e-30);
        }
      }
      for (std::size_t b = 1; b <= max_columns; ++b) {
        INFO(llama::kernels::to_string(path)
             << ", " << size.rows << " x " << size.cols << ", " << b << " columns");
        std::vector<float> y(b * y_stride, -1.0F);
        llama::kernels::matmul(w.data(), size.rows, size.cols, x.data(), x_stride, b, y.data(),
                               y_stride);
        std::size_t differing = 0;
        for (std::size_t j = 0; j < b; ++j) {
          for (std::size_t o = 0; o < size.rows; ++o) {
            if (y[j * y_stride + o] != single[j * size.rows + o]) ++differing;
          }
          // The stride gap is not written.
          for (std::size_t o = size.rows; o < y_stride && j + 1 < b; ++o) {
            if (y[j * y_stride + o] != -1.0F) ++differing;
          }
        }
        CHECK(differing == 0);
      }
    }
  }
  CHECK(llama::kernels::active() == default_path);  // restored
}

TEST_CASE(
    "llama kernels: attention scores and values equal dot and axpy key by key, in one call "
    "or in several, on every path") {
  constexpr std::size_t keys = 23;
  constexpr float scale = 0.375F;
  // Head sizes below, at and above the 64 value lanes held in registers, with tails.
  for (const std::size_t dim : {5U, 8U, 12U, 64U, 72U, 136U}) {
    const std::size_t stride = dim + 7;  // keys and values of other heads in between
    specdec::default_engine g(dim);
    std::vector<float> q(dim);
    std::vector<float> cache(keys * stride);
    std::vector<float> weights(keys);
    for (float& v : q) v = specdec::uniform01<float>(g) * 2.0F - 1.0F;
    for (float& v : cache) v = specdec::uniform01<float>(g) * 2.0F - 1.0F;
    for (float& v : weights) v = specdec::uniform01<float>(g);
    for (const isa path : {isa::portable, isa::avx2}) {
      const KernelPathScope scope(path);
      if (!scope.selected()) continue;
      INFO(llama::kernels::to_string(path) << ", head of " << dim);
      std::vector<float> scores(keys);
      llama::kernels::attention_scores(q.data(), cache.data(), stride, keys, dim, scale,
                                       scores.data());
      std::vector<float> by_dot(keys);
      for (std::size_t t = 0; t < keys; ++t) {
        by_dot[t] = llama::kernels::dot(q.data(), cache.data() + t * stride, dim) * scale;
      }
      CHECK(scores == by_dot);
      // All keys in one call, key by key (as tree ancestors are), and by axpy.
      std::vector<float> together(dim, 0.5F);
      llama::kernels::attention_values(weights.data(), cache.data(), stride, keys, dim,
                                       together.data());
      std::vector<float> one_by_one(dim, 0.5F);
      std::vector<float> by_axpy(dim, 0.5F);
      for (std::size_t t = 0; t < keys; ++t) {
        llama::kernels::attention_values(weights.data() + t, cache.data() + t * stride, stride, 1,
                                         dim, one_by_one.data());
        llama::kernels::axpy(weights[t], cache.data() + t * stride, by_axpy.data(), dim);
      }
      CHECK(together == one_by_one);
      CHECK(together == by_axpy);
      double largest_error = 0.0;
      for (std::size_t k = 0; k < dim; ++k) {
        double exact = 0.5;
        for (std::size_t t = 0; t < keys; ++t) {
          exact += static_cast<double>(weights[t]) * cache[t * stride + k];
        }
        largest_error = std::max(largest_error, std::abs(together[k] - exact));
      }
      CHECK(largest_error <= 1e-5);
    }
  }
}

TEST_CASE(
    "llama kernels: element-wise exp and SwiGLU give the same value in a vector lane and "
    "in the scalar tail, on every path") {
  // silu_mul runs over all columns of a pass as one array: whether an element falls into a
  // vector lane or into the tail depends on the batch width, so both must agree bit for bit.
  constexpr std::size_t n = 45;
  specdec::default_engine g(63);
  std::vector<float> gate(n);
  std::vector<float> up(n);
  std::vector<float> scores(n);
  for (std::size_t i = 0; i < n; ++i) {
    // Gates from -100 to 100 (saturated SiLU included), scores down to -120 below the maximum.
    gate[i] = (specdec::uniform01<float>(g) * 2.0F - 1.0F) * (i % 3 == 0 ? 100.0F : 6.0F);
    up[i] = specdec::uniform01<float>(g) * 2.0F - 1.0F;
    scores[i] = -specdec::uniform01<float>(g) * (i % 4 == 0 ? 120.0F : 8.0F);
  }
  constexpr float shift = 0.25F;
  for (const isa path : {isa::portable, isa::avx2}) {
    const KernelPathScope scope(path);
    if (!scope.selected()) continue;
    INFO(llama::kernels::to_string(path));
    std::vector<float> silu_whole = gate;
    llama::kernels::silu_mul(silu_whole.data(), up.data(), n);
    std::vector<float> exp_whole = scores;
    llama::kernels::exp_shifted(exp_whole.data(), n, shift);
    // Every split point: the elements before it in one call, the rest one at a time.
    for (std::size_t split = 0; split <= n; ++split) {
      INFO("first " << split << " in one call");
      std::vector<float> silu_split = gate;
      llama::kernels::silu_mul(silu_split.data(), up.data(), split);
      std::vector<float> exp_split = scores;
      llama::kernels::exp_shifted(exp_split.data(), split, shift);
      for (std::size_t i = split; i < n; ++i) {
        llama::kernels::silu_mul(silu_split.data() + i, up.data() + i, 1);
        llama::kernels::exp_shifted(exp_split.data() + i, 1, shift);
      }
      CHECK(silu_split == silu_whole);
      CHECK(exp_split == exp_whole);
    }
    // And they compute what they say. The AVX2 exp is a polynomial (relative error ~2e-7)
    // with its argument clamped to [-87, 88]: exp of less than -87 comes out as ~1.6e-38, and
    // a gate below -88 as at most |gate| / e^88 ~ 1e-36 instead of ~0.
    for (std::size_t i = 0; i < n; ++i) {
      const double exp_exact = std::exp(static_cast<double>(scores[i]) - shift);
      CHECK(std::abs(exp_whole[i] - exp_exact) <= 1e-6 * exp_exact + 1e-37);
      const double g_i = gate[i];
      const double silu_exact = g_i / (1.0 + std::exp(-g_i)) * up[i];
      CHECK(std::abs(silu_whole[i] - silu_exact) <= 1e-6 * std::abs(silu_exact) + 1e-35);
    }
  }
}

TEST_CASE("llama kernels: exp and SwiGLU pass NaN through, in vector lanes and tails alike") {
  // A corrupt model (NaN weights) must give NaN logits, which the decoder's row validation
  // rejects, never finite rows built from a NaN clamped away (found by fuzz_gguf: the scalar
  // tail converted NaN to an integer, undefined behaviour).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const isa path : {isa::portable, isa::avx2}) {
    const KernelPathScope scope(path);
    if (!scope.selected()) continue;
    INFO(llama::kernels::to_string(path));
    for (const std::size_t n : {1U, 8U, 11U}) {  // a tail alone, a vector alone, both
      std::vector<float> scores(n, -1.0F);
      std::vector<float> gate(n, 0.5F);
      const std::vector<float> up(n, 1.0F);
      scores[n - 1] = nan;
      gate[n - 1] = nan;
      if (n > 1) scores[0] = nan;
      llama::kernels::exp_shifted(scores.data(), n, 0.0F);
      llama::kernels::silu_mul(gate.data(), up.data(), n);
      CHECK(std::isnan(scores[n - 1]));
      CHECK(std::isnan(scores[0]));
      CHECK(std::isnan(gate[n - 1]));
      if (n > 2) CHECK(scores[1] == Catch::Approx(std::exp(-1.0)).epsilon(1e-6));
    }
  }
}

// ---- 7. greedy speculative decoding ------------------------------------------------------

namespace {

struct DrafterCase {
  std::string name;
  drafter_kind kind = drafter_kind::model;
  std::size_t gamma = 4;
  specdec::TreeShape tree_shape = llama::default_tree_shape();
};

DrafterCase drafter_case(drafter_kind kind, std::size_t gamma) {
  return {std::string(llama::to_string(kind)) + ", gamma " + std::to_string(gamma), kind, gamma,
          llama::default_tree_shape()};
}

DrafterCase tree_case(std::string name, specdec::TreeShape shape) {
  return {"tree, " + std::move(name), drafter_kind::tree, 4, std::move(shape)};
}

// Chains of several gammas for every drafter kind, and trees: chains (a fully accepted chain
// sits in place in the cache) and branching shapes (accepted paths are moved).
std::vector<DrafterCase> greedy_drafter_cases() {
  std::vector<DrafterCase> cases;
  for (const std::size_t gamma : {1U, 3U, 5U}) {
    for (const drafter_kind kind : {drafter_kind::model, drafter_kind::ngram,
                                    drafter_kind::prompt_lookup, drafter_kind::controller}) {
      cases.push_back(drafter_case(kind, gamma));
    }
  }
  cases.push_back(tree_case("chain of 1", specdec::TreeShape::chain(1)));
  cases.push_back(tree_case("chain of 4", specdec::TreeShape::chain(4)));
  cases.push_back(tree_case("default shape", llama::default_tree_shape()));
  cases.push_back(tree_case("branching 2 2 1", specdec::TreeShape::branching({2, 2, 1})));
  cases.push_back(tree_case("four children of the root", specdec::TreeShape::branching({4})));
  return cases;
}

// Runs every case on one pair and prompt and checks the output against plain greedy
// decoding, and the target's work: one forward pass per step, every position evaluated once
// (the prompt, then per step the previous correction and the scored draft tokens). The
// controller measures its cost in wall time, so its gammas vary from run to run; its output
// must not. Returns the drafts accepted in all.
std::size_t check_greedy_speculative(Engine& target, Engine& draft, const Tokens& prompt,
                                     std::size_t new_tokens,
                                     const std::vector<DrafterCase>& cases) {
  llama::RunOptions options;
  options.sampling.temperature = 0.0;
  options.max_new_tokens = new_tokens;
  const llama::RunResult plain = llama::generate_plain(target, prompt, options);
  REQUIRE(plain.tokens.size() == new_tokens);
  std::size_t accepted = 0;
  for (const DrafterCase& c : cases) {
    INFO(c.name);
    options.gamma = c.gamma;
    options.tree_shape = c.tree_shape;
    const llama::RunResult speculative =
        llama::generate_speculative(target, &draft, c.kind, prompt, options);
    CHECK(speculative.tokens == plain.tokens);
    const specdec::DecoderStatistics& statistics = speculative.statistics;
    REQUIRE(statistics.steps > 0);
    CHECK(speculative.target.forward_passes == statistics.steps);
    CHECK(speculative.target.positions ==
          prompt.size() + (statistics.steps - 1) + statistics.nodes_scored);
    accepted += statistics.accepted_tokens;
  }
  return accepted;
}

// The pair's greedy output, for prompts of random tokens and a repetitive one (which prompt
// lookup and n-grams draft from), on both kernel paths; returns the drafts accepted in all.
std::size_t check_greedy_pair(const TinyLlama& target_shape, const TinyLlama& draft_shape) {
  const Model target_model = load_tiny(target_shape);
  const Model draft_model = load_tiny(draft_shape);
  Engine target(target_model);
  Engine draft(draft_model);
  specdec::default_engine g(71);
  const std::vector<Tokens> prompts = {random_context(4, target_shape.vocab, g),
                                       random_context(11, target_shape.vocab, g),
                                       {bos, 7, 8, 9, 7, 8, 9, 7, 8}};
  const std::vector<DrafterCase> cases = greedy_drafter_cases();
  std::size_t accepted = 0;
  for (const isa path : {isa::portable, isa::avx2}) {
    const KernelPathScope scope(path);
    if (!scope.selected()) continue;
    for (const Tokens& prompt : prompts) {
      INFO(llama::kernels::to_string(path) << ", prompt of " << prompt.size());
      accepted += check_greedy_speculative(target, draft, prompt, 40, cases);
    }
  }
  return accepted;
}

}  // namespace

TEST_CASE(
    "llama generation: greedy speculative output equals plain greedy output for every "
    "drafter, with an unrelated draft") {
  const TinyLlama unrelated_draft = {.vocab = 64,
                                     .dim = 16,
                                     .layers = 1,
                                     .heads = 2,
                                     .kv_heads = 1,
                                     .ffn = 32,
                                     .context = 96,
                                     .tied = true,
                                     .f16 = false,
                                     .weight_scale = 0.25F,
                                     .seed = 21};
  // Most drafts are rejected; some are accepted, so the comparison means something.
  CHECK(check_greedy_pair(engine_shapes()[0], unrelated_draft) > 0);
}

TEST_CASE(
    "llama generation: greedy speculative output equals plain greedy output for every "
    "drafter, with the F32 twin of an F16 target") {
  const TinyLlama target = engine_shapes()[1];
  TinyLlama f32_twin = target;
  f32_twin.f16 = false;
  // Most drafts are accepted, whole chains and trees often.
  CHECK(check_greedy_pair(target, f32_twin) > 0);
}

TEST_CASE(
    "llama generation: greedy speculative output equals plain greedy output for every "
    "drafter, with an identical draft") {
  // Every model draft is accepted: every chain tree is kept whole, in place.
  const TinyLlama target = engine_shapes()[2];
  CHECK(check_greedy_pair(target, target) > 0);
}

TEST_CASE(
    "llama generation: greedy speculative output equals plain greedy output on the shipped "
    "pair") {
  const Model target_model = shipped_model("target");
  const Model draft_model = shipped_model("draft");
  llama::check_pair(target_model, draft_model);
  Engine target(target_model);
  Engine draft(draft_model);
  const std::size_t new_tokens = slow_build ? 12 : 64;
  Tokens prompt = longest_reference_context();
  prompt.resize(std::min<std::size_t>(prompt.size(), 32));
  // Room for the controller's longest draft (RunOptions::max_gamma).
  const std::size_t room = prompt.size() + new_tokens + llama::RunOptions{}.max_gamma;
  REQUIRE(room <= target.capacity());
  REQUIRE(room <= draft.capacity());
  const std::vector<DrafterCase> cases = {
      drafter_case(drafter_kind::model, 4),
      drafter_case(drafter_kind::ngram, 4),
      drafter_case(drafter_kind::prompt_lookup, 4),
      drafter_case(drafter_kind::controller, 4),
      tree_case("default shape", llama::default_tree_shape()),
      tree_case("chain of 4", specdec::TreeShape::chain(4)),
  };
  CHECK(check_greedy_speculative(target, draft, prompt, new_tokens, cases) > 0);
}

// ---- 8. exactness at T > 0 ----------------------------------------------------------------

namespace {

// The statistic: the first three generated tokens as one of V^3 cells. With V = 10 and
// top-k 4 the law has at most 64 cells of positive probability.
constexpr std::size_t law_length = 3;

std::size_t cell_of(std::span<const token_id> tokens, std::size_t vocab) {
  std::size_t cell = 0;
  for (std::size_t j = 0; j < law_length; ++j) {
    cell = cell * vocab + static_cast<std::size_t>(tokens[j]);
  }
  return cell;
}

// The exact law of the first law_length tokens of plain sampling from `model`'s standardized
// rows after `prompt`: every sequence enumerated with the product of its rows.
std::vector<double> sequence_law(Engine& model, const Tokens& prompt,
                                 const specdec::SamplingOptions& sampling) {
  const std::size_t vocab = model.vocab_size();
  std::size_t cells = 1;
  for (std::size_t j = 0; j < law_length; ++j) cells *= vocab;
  std::vector<double> law(cells, 0.0);
  specdec::Standardizer<double> standardizer(sampling);
  Tokens context = prompt;
  const auto enumerate = [&](const auto& self, std::size_t depth, double probability,
                             std::size_t cell) -> void {
    if (depth == law_length) {
      law[cell] += probability;
      return;
    }
    std::vector<double> row(vocab);
    standardizer.apply_logits(model.next_token_logits(context), std::span<double>(row));
    for (std::size_t x = 0; x < vocab; ++x) {
      if (row[x] == 0.0) continue;
      context.push_back(static_cast<token_id>(x));
      self(self, depth + 1, probability * row[x], cell * vocab + x);
      context.pop_back();
    }
  };
  enumerate(enumerate, 0, 1.0, 0);
  return law;
}

// The exactness setup: a small vocabulary so that the law is enumerated cheaply; a draft with
// the target's random directions at a smaller scale, so that it is related (drafts are often
// accepted, also whole chains) but not equal (often rejected too).
struct ExactnessSetup {
  TinyLlama target_shape{.vocab = 10,
                         .dim = 16,
                         .layers = 1,
                         .heads = 2,
                         .kv_heads = 1,
                         .ffn = 24,
                         .context = 32,
                         .tied = false,
                         .f16 = false,
                         .weight_scale = 0.6F,
                         .seed = 81};
  TinyLlama draft_shape = [this] {
    TinyLlama shape = target_shape;
    shape.weight_scale = 0.45F;
    return shape;
  }();
  Model target_model = load_tiny(target_shape);
  Model draft_model = load_tiny(draft_shape);
  Engine target{target_model};
  Engine draft{draft_model};
  // Repeats "3 4" so that prompt lookup proposes drafts.
  Tokens prompt{bos, 3, 4, 5, 3, 4};
  specdec::SamplingOptions sampling{.temperature = 0.8, .top_k = 4};
  std::vector<double> law = sequence_law(target, prompt, sampling);
  // Samples that detect a deviation of total variation 0.075 from the law at the 1e-9
  // threshold with near certainty (statistics.hpp): about 12k for 64 cells.
  double detectable_distance = 0.075;
  std::size_t samples =
      specdec::stats::samples_to_detect(detectable_distance, static_cast<double>(support() - 1));

  [[nodiscard]] std::size_t support() const {
    return static_cast<std::size_t>(
        std::count_if(law.begin(), law.end(), [](double p) { return p > 0.0; }));
  }

  // Cell counts of `samples` runs, run k with seed first_seed + k; `generate(seed)` returns
  // the generated tokens.
  template <class Generate>
  std::vector<std::uint64_t> count_cells(Generate&& generate, std::uint64_t first_seed) const {
    std::vector<std::uint64_t> counts(law.size(), 0);
    for (std::size_t k = 0; k < samples; ++k) {
      const Tokens tokens = generate(first_seed + k);
      REQUIRE(tokens.size() == law_length);
      ++counts[cell_of(tokens, target_shape.vocab)];
    }
    return counts;
  }

  [[nodiscard]] llama::RunOptions options(std::uint64_t seed) const {
    llama::RunOptions run;
    run.sampling = sampling;
    run.max_new_tokens = law_length;
    run.seed = seed;
    return run;
  }

  // Speculative samples with drafter `kind`; `acceptance` receives drafts accepted / scored.
  std::vector<std::uint64_t> speculative_counts(drafter_kind kind, std::size_t gamma,
                                                const specdec::TreeShape& shape,
                                                std::uint64_t first_seed, double& acceptance) {
    std::size_t accepted = 0;
    std::size_t scored = 0;
    auto counts = count_cells(
        [&](std::uint64_t seed) {
          llama::RunOptions run = options(seed);
          run.gamma = gamma;
          run.tree_shape = shape;
          llama::RunResult result = llama::generate_speculative(target, &draft, kind, prompt, run);
          accepted += result.statistics.accepted_tokens;
          scored += result.statistics.nodes_scored;
          return std::move(result.tokens);
        },
        first_seed);
    acceptance =
        static_cast<double>(accepted) / static_cast<double>(std::max<std::size_t>(scored, 1));
    return counts;
  }
};

}  // namespace

TEST_CASE(
    "llama generation: at T > 0 speculative sampling with the model drafter follows the "
    "target's law, and the test rejects other laws") {
  ExactnessSetup setup;
  INFO("support " << setup.support() << " cells, " << setup.samples << " samples per law");
  // The enumerated law is the law of the engine's own plain sampling.
  const auto plain = setup.count_cells(
      [&](std::uint64_t seed) {
        return llama::generate_plain(setup.target, setup.prompt, setup.options(seed)).tokens;
      },
      1'000'000);
  const auto plain_result = specdec::stats::chi_square_test(plain, setup.law);
  INFO("plain: " << plain_result.describe());
  CHECK(plain_result.passed());

  double acceptance = 0.0;
  const auto speculative =
      setup.speculative_counts(drafter_kind::model, 2, specdec::TreeShape{}, 2'000'000, acceptance);
  const auto result = specdec::stats::chi_square_test(speculative, setup.law);
  INFO("model drafter, gamma 2, acceptance " << acceptance << ": " << result.describe());
  CHECK(result.passed());

  // The broken variants change the law itself: a misbehaving draft (a stale cache, say)
  // cannot break exactness, since every draft is verified with the q it was drawn from.
  // Power, 1: the same samples against the law at T = 1 (what a decoder standardizing at the
  // wrong temperature would produce), at least the detectable distance away.
  specdec::SamplingOptions hotter = setup.sampling;
  hotter.temperature = 1.0;
  const std::vector<double> hotter_law = sequence_law(setup.target, setup.prompt, hotter);
  const double hotter_distance = specdec::stats::total_variation(setup.law, hotter_law);
  const auto hotter_result = specdec::stats::chi_square_test(speculative, hotter_law);
  INFO("against the law at T = 1 (TV " << hotter_distance << "): " << hotter_result.describe());
  CHECK(hotter_distance >= setup.detectable_distance);
  CHECK_FALSE(hotter_result.passed());

  // Power, 2: the draft's own law (what a decoder that accepted every draft would produce).
  const auto draft_only = setup.count_cells(
      [&](std::uint64_t seed) {
        return llama::generate_plain(setup.draft, setup.prompt, setup.options(seed)).tokens;
      },
      3'000'000);
  const std::vector<double> draft_law = sequence_law(setup.draft, setup.prompt, setup.sampling);
  const auto draft_result = specdec::stats::chi_square_test(draft_only, setup.law);
  INFO("draft samples against the target law (TV "
       << specdec::stats::total_variation(setup.law, draft_law)
       << "): " << draft_result.describe());
  CHECK_FALSE(draft_result.passed());
}

TEST_CASE(
    "llama generation: at T > 0 speculative sampling with a chain tree of one follows "
    "the target's law") {
  // An accepted draft is the whole tree and stays in place in the cache; the next step's rows
  // (for the third token) are computed after it.
  ExactnessSetup setup;
  double acceptance = 0.0;
  const auto counts = setup.speculative_counts(drafter_kind::tree, 4, specdec::TreeShape::chain(1),
                                               4'000'000, acceptance);
  const auto result = specdec::stats::chi_square_test(counts, setup.law);
  INFO("tree chain of 1, acceptance " << acceptance << ": " << result.describe());
  CHECK(result.passed());
}

TEST_CASE(
    "llama generation: at T > 0 speculative sampling with a branching tree follows the "
    "target's law") {
  // Accepted paths other than the first child's are moved into place (keep_tree_path).
  ExactnessSetup setup;
  double acceptance = 0.0;
  const auto counts = setup.speculative_counts(
      drafter_kind::tree, 4, specdec::TreeShape::branching({2, 2}), 5'000'000, acceptance);
  const auto result = specdec::stats::chi_square_test(counts, setup.law);
  INFO("tree branching 2 2, acceptance " << acceptance << ": " << result.describe());
  CHECK(result.passed());
}

TEST_CASE(
    "llama generation: at T > 0 speculative sampling with prompt lookup follows the "
    "target's law") {
  ExactnessSetup setup;
  double acceptance = 0.0;
  const auto counts = setup.speculative_counts(drafter_kind::prompt_lookup, 3, specdec::TreeShape{},
                                               6'000'000, acceptance);
  const auto result = specdec::stats::chi_square_test(counts, setup.law);
  INFO("prompt lookup, gamma 3, acceptance " << acceptance << ": " << result.describe());
  CHECK(acceptance > 0.0);  // drafts were proposed and some accepted
  CHECK(result.passed());
}

// ---- 9. recovery after exceptions -----------------------------------------------------------

TEST_CASE(
    "llama engine: after an exception in a forward pass the next call recomputes and is "
    "correct") {
  const TinyLlama shape = engine_shapes()[0];
  const Model model = load_tiny(shape);
  specdec::default_engine g(91);
  const Tokens context = random_context(12, shape.vocab, g);
  const Tokens draft = random_tokens(3, shape.vocab, g);
  // An id outside the vocabulary is found inside the pass, after the cache was brought in
  // line with the request: the engine must forget what it staged.
  const auto outside = static_cast<token_id>(shape.vocab);
  Tokens bad_draft = draft;
  bad_draft[1] = outside;

  SECTION("a draft") {
    Engine engine(model);
    (void)engine.score_draft_logits(context, draft);
    REQUIRE_THROWS_AS(engine.score_draft_logits(context, bad_draft), llama::engine_error);
    engine.reset_counters();
    const auto rows = engine.score_draft_logits(context, draft);
    CHECK(engine.counters().positions == context.size() + draft.size());
    check_rows_against_fresh(model, rows, context, draft);
  }
  SECTION("a token tree") {
    TokenTree tree;
    const std::size_t child = tree.add(0, draft[0]);
    tree.add(0, draft[1]);
    tree.add(child, draft[2]);
    TokenTree bad_tree = tree;
    bad_tree.tokens[3] = outside;
    Engine engine(model);
    (void)engine.next_token_logits(context);
    REQUIRE_THROWS_AS(engine.score_tree_logits(context, bad_tree.view()), llama::engine_error);
    engine.reset_counters();
    const auto rows = engine.score_tree_logits(context, tree.view());
    CHECK(engine.counters().positions == context.size() + tree.size() - 1);
    REQUIRE(rows.rows() == tree.size());
    for (std::size_t i = 0; i < tree.size(); ++i) {
      CHECK(to_logits(rows.row(i)) == fresh_logits(model, concat(context, tree.path(i))));
    }
  }
  SECTION("a correction after a token tree, once its accepted path was moved") {
    TokenTree tree;
    tree.add(0, draft[0]);
    const std::size_t second = tree.add(0, draft[1]);
    const std::size_t leaf = tree.add(second, draft[2]);
    Engine engine(model);
    (void)engine.score_tree_logits(context, tree.view());
    const Tokens accepted = concat(context, tree.path(leaf));
    REQUIRE_THROWS_AS(engine.next_token_logits(concat(accepted, Tokens{outside})),
                      llama::engine_error);
    engine.reset_counters();
    const Tokens next = concat(accepted, Tokens{draft[0]});
    CHECK(to_logits(engine.next_token_logits(next)) == fresh_logits(model, next));
    CHECK(engine.counters().positions == next.size());
  }
  SECTION("a request beyond the capacity is refused before the pass and the cache stays") {
    Engine engine(model, context.size() + draft.size());
    (void)engine.next_token_logits(context);
    Tokens longer_draft = draft;
    longer_draft.push_back(draft[0]);
    REQUIRE_THROWS_AS(engine.score_draft_logits(context, longer_draft), llama::engine_error);
    TokenTree too_wide;
    for (const token_id t : longer_draft) too_wide.add(0, t);
    REQUIRE_THROWS_AS(engine.score_tree_logits(context, too_wide.view()), llama::engine_error);
    engine.reset_counters();
    const auto rows = engine.score_draft_logits(context, draft);
    CHECK(engine.counters().positions == 1 + draft.size());
    check_rows_against_fresh(model, rows, context, draft);
  }
}

// ---- many sequences: the batch decoder over lane engines -----------------------------------

namespace {

// Decodes `count` sequences (prompt `prompts[k % size]`, seed `seed`, id k) with a
// BatchDecoder over engines of `lanes` lanes, `lanes` sequences at a time (continuous
// batching: a new one joins when one leaves); returns the tokens by id.
std::vector<Tokens> decode_batch(const Model& target_model, const Model& draft_model,
                                 const std::vector<Tokens>& prompts, std::size_t count,
                                 std::size_t new_tokens, const specdec::SamplingOptions& sampling,
                                 std::size_t lanes, std::uint64_t seed, std::size_t gamma) {
  Engine target_engine(target_model, 0, nullptr, lanes);
  Engine draft_engine(draft_model, 0, nullptr, lanes);
  specdec::LogitsModel target(target_engine);
  specdec::LogitsModel draft(draft_engine);
  static_assert(specdec::BatchScoringModel<decltype(target)>);
  static_assert(specdec::BatchDraftModel<decltype(draft)>);
  static_assert(specdec::HasSequenceRelease<decltype(target)>);
  specdec::BatchDecoder decoder(target, draft, {.threads = 1});
  std::vector<Tokens> tokens(count);
  std::size_t next = 0;
  while (next < count || decoder.active() > 0) {
    while (next < count && decoder.active() < lanes) {
      specdec::SequenceRequest request;
      request.id = next;
      request.prompt = prompts[next % prompts.size()];
      request.max_new_tokens = new_tokens;
      request.seed = seed;
      request.sampling = sampling;
      request.gamma_policy = specdec::FixedGamma(gamma);
      decoder.add(std::move(request));
      ++next;
    }
    decoder.step();
    for (auto& done : decoder.take_finished()) {
      REQUIRE(done.end == specdec::sequence_end::max_new_tokens);
      tokens[done.id] = std::move(done.tokens);
    }
  }
  CHECK(decoder.target_calls() == decoder.steps());  // one forward pass of the target per step
  return tokens;
}

}  // namespace

TEST_CASE(
    "llama batch decoding: greedy sequences decoded together on lane engines equal plain "
    "greedy decoding") {
  const TinyLlama target_shape = engine_shapes()[1];
  TinyLlama draft_shape = target_shape;
  draft_shape.f16 = false;  // the F32 twin: most drafts accepted
  const Model target_model = load_tiny(target_shape);
  const Model draft_model = load_tiny(draft_shape);
  specdec::default_engine g(41);
  std::vector<Tokens> prompts;
  for (std::size_t k = 0; k < 5; ++k)
    prompts.push_back(random_context(4 + 3 * k, target_shape.vocab, g));
  const std::size_t new_tokens = slow_build ? 8 : 24;
  const auto tokens = decode_batch(target_model, draft_model, prompts, 9, new_tokens,
                                   {.temperature = 0.0}, 4, 7, 4);
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    Engine engine(target_model);
    llama::RunOptions run;
    run.sampling = {.temperature = 0.0};
    run.max_new_tokens = new_tokens;
    INFO("sequence " << k);
    CHECK(tokens[k] == llama::generate_plain(engine, prompts[k % prompts.size()], run).tokens);
  }
}

TEST_CASE(
    "llama batch decoding: at T > 0 every sequence decoded together on lane engines follows "
    "the target's law") {
  ExactnessSetup setup;
  const std::vector<Tokens> prompts{setup.prompt};
  const auto tokens = decode_batch(setup.target_model, setup.draft_model, prompts, setup.samples,
                                   law_length, setup.sampling, 32, 2027, 2);
  std::vector<std::uint64_t> counts(setup.law.size(), 0);
  for (const Tokens& sequence : tokens) {
    REQUIRE(sequence.size() == law_length);
    ++counts[cell_of(sequence, setup.target_shape.vocab)];
  }
  const auto result = specdec::stats::chi_square_test(counts, setup.law);
  INFO(setup.samples << " sequences, 32 at a time: " << result.describe());
  CHECK(result.passed());
  // Power: the same counts against the draft's law.
  const std::vector<double> draft_law = sequence_law(setup.draft, setup.prompt, setup.sampling);
  CHECK_FALSE(specdec::stats::chi_square_test(counts, draft_law).passed());
}
