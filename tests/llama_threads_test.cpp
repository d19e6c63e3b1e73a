// The llama engine's thread pool (examples/llama/threads.hpp), also run under
// ThreadSanitizer by scripts/test.sh (stage "tsan"):
//  - every task of a job runs exactly once, for any number of tasks and threads, with
//    workers spinning or asleep between jobs, and when callers on several threads share one
//    pool (a caller that finds it busy runs its tasks itself);
//  - an engine whose products run on a pool gives the logits of the engine without one, bit
//    for bit (rows split over threads are computed by the same operations), for single
//    positions, batched drafts and token trees, on every kernel path; so greedy decoding
//    of the shipped pair is token for token the same with and without threads.
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "llama/engine.hpp"
#include "llama/generate.hpp"
#include "llama/kernels.hpp"
#include "llama/model.hpp"
#include "llama/threads.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/random.hpp"
#include "support/gguf_writer.hpp"

namespace {

using llama::Engine;
using llama::Model;
using llama::ThreadPool;
using llama::kernels::isa;
using specdec::token_id;
using Tokens = std::vector<token_id>;
using Logits = std::vector<float>;

#if defined(__OPTIMIZE__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
constexpr bool fast_build = true;
#else
constexpr bool fast_build = false;
#endif

// Runs `jobs` jobs of 0, 1, 2, ... tasks on `pool` and checks each task ran exactly once.
void check_every_task_once(ThreadPool& pool, std::size_t jobs) {
  std::vector<std::atomic<int>> runs(64);
  std::size_t wrong = 0;
  for (std::size_t job = 0; job < jobs; ++job) {
    const std::size_t tasks = job % runs.size();
    for (auto& r : runs) r.store(0, std::memory_order_relaxed);
    pool.run(tasks, [&](std::size_t i) { runs[i].fetch_add(1, std::memory_order_relaxed); });
    for (std::size_t i = 0; i < runs.size(); ++i) {
      if (runs[i].load(std::memory_order_relaxed) != (i < tasks ? 1 : 0)) ++wrong;
    }
  }
  CHECK(wrong == 0);
}

TEST_CASE("llama thread pool: every task runs exactly once, for any number of tasks and threads") {
  for (const std::size_t threads : {1U, 2U, 3U, 5U}) {
    // Workers that spin between jobs, and workers that go to sleep at once (each job then
    // wakes them up).
    for (const auto spin : {std::chrono::microseconds(200), std::chrono::microseconds(0)}) {
      INFO(threads << " threads, spinning " << spin.count() << " us");
      ThreadPool pool(threads, spin);
      CHECK(pool.size() == threads);
      check_every_task_once(pool, 300);
    }
  }
  ThreadPool machine;  // one thread per hardware thread
  CHECK(machine.size() == std::max(1U, std::thread::hardware_concurrency()));
  check_every_task_once(machine, 50);
}

TEST_CASE(
    "llama thread pool: callers on several threads may share one pool, and each gets all "
    "its tasks run") {
  ThreadPool pool(3);
  std::vector<std::size_t> wrong(3, 0);
  std::vector<std::thread> callers;
  for (std::size_t c = 0; c < wrong.size(); ++c) {
    callers.emplace_back([&pool, &wrong, c] {
      for (std::size_t job = 0; job < 200; ++job) {
        const std::size_t tasks = 1 + (job + c) % 17;
        std::vector<int> runs(tasks, 0);  // each task writes only its own element
        pool.run(tasks, [&](std::size_t i) { ++runs[i]; });
        for (const int r : runs) wrong[c] += r != 1 ? 1 : 0;
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (std::size_t c = 0; c < wrong.size(); ++c) {
    INFO("caller " << c);
    CHECK(wrong[c] == 0);
  }
}

// A model whose larger products (SwiGLU, output) pass the engine's threshold for splitting
// at a single position and all of them do in a batch; row counts that are not multiples of
// the chunk height.
Model load_model() {
  return specdec::testing::load_tiny_llama({.vocab = 403,
                                            .dim = 96,
                                            .layers = 2,
                                            .heads = 4,
                                            .kv_heads = 2,
                                            .ffn = 358,
                                            .context = 96,
                                            .tied = false,
                                            .f16 = false,
                                            .weight_scale = 0.25F,
                                            .seed = 7},
                                           "threads");
}

Logits to_logits(specdec::RowsView<const float> rows) {
  Logits out;
  for (std::size_t i = 0; i < rows.rows(); ++i) {
    const auto row = rows.row(i);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

Tokens random_tokens(std::size_t count, std::size_t vocab, specdec::default_engine& g) {
  Tokens tokens(count);
  for (token_id& t : tokens) t = static_cast<token_id>(specdec::uniform_below(g, vocab));
  return tokens;
}

TEST_CASE(
    "llama engine: products split over a thread pool give the logits of one thread, bit "
    "for bit, in single, batched and tree passes, on every kernel path") {
  const Model model = load_model();
  const std::size_t vocab = model.config().vocab;
  ThreadPool pool(3);
  const isa default_path = llama::kernels::active();
  for (const isa path : {isa::portable, isa::avx2}) {
    if (!llama::kernels::select(path)) continue;  // a CPU without AVX2 and FMA
    specdec::default_engine g(3);
    Engine alone(model);
    Engine pooled(model, 0, &pool);
    Tokens context = random_tokens(6, vocab, g);
    context.front() = 1;
    std::size_t differing = 0;
    for (std::size_t step = 0; step < 14; ++step) {
      // Drafts of every length 0..13: every column grouping of the kernels.
      const Tokens draft = random_tokens(step, vocab, g);
      INFO(llama::kernels::to_string(path) << ", step " << step);
      const Logits expected = to_logits(alone.score_draft_logits(context, draft));
      if (to_logits(pooled.score_draft_logits(context, draft)) != expected) ++differing;
      context.insert(context.end(), draft.begin(), draft.begin() + static_cast<long>(step / 2));
      context.push_back(static_cast<token_id>(specdec::uniform_below(g, vocab)));
      if (context.size() > 70) context.resize(8);
    }
    CHECK(differing == 0);
    // A token tree: a chain of three with two more candidates at the root and one below.
    const Tokens t = random_tokens(6, vocab, g);
    const std::vector<std::size_t> parents{specdec::TokenTreeView::npos, 0, 1, 2, 0, 0, 4};
    const std::vector<std::size_t> depths{0, 1, 2, 3, 1, 1, 2};
    const Tokens tokens{0, t[0], t[1], t[2], t[3], t[4], t[5]};
    const specdec::TokenTreeView tree{tokens, parents, depths};
    CHECK(to_logits(pooled.score_tree_logits(context, tree)) ==
          to_logits(alone.score_tree_logits(context, tree)));
  }
  llama::kernels::select(default_path);
  CHECK(llama::kernels::active() == default_path);
}

TEST_CASE(
    "llama engine: greedy decoding of the shipped pair is token for token the same with "
    "and without a thread pool") {
  const Model target_model(std::string(SPECDEC_LLAMA_MODELS) + "/target.gguf");
  const Model draft_model(std::string(SPECDEC_LLAMA_MODELS) + "/draft.gguf");
  ThreadPool pool(2);
  Engine target(target_model), draft(draft_model);
  Engine pooled_target(target_model, 0, &pool), pooled_draft(draft_model, 0, &pool);
  const Tokens prompt = target_model.tokenizer().encode("def fibonacci(n):\n    ");
  llama::RunOptions options;
  options.sampling.temperature = 0.0;
  options.max_new_tokens = fast_build ? 48 : 8;
  const auto plain = llama::generate_plain(target, prompt, options);
  CHECK(llama::generate_plain(pooled_target, prompt, options).tokens == plain.tokens);
  for (const llama::drafter_kind kind : {llama::drafter_kind::model, llama::drafter_kind::tree}) {
    INFO(llama::to_string(kind));
    const auto run =
        llama::generate_speculative(pooled_target, &pooled_draft, kind, prompt, options);
    CHECK(run.tokens == plain.tokens);
  }
}

}  // namespace
