// Thread safety of specdec (run under ThreadSanitizer by scripts/test.sh, stage "tsan").
//
// The rules (docs/errors.md, "Threads"):
//  - A SpeculativeDecoder is not thread-safe; one decoder per thread. Independent decoders
//    with their own models and generators share nothing: run concurrently they produce
//    exactly what they produce one after another (same seeds).
//  - Models may be shared between decoders on different threads only if calling them
//    concurrently is safe: the decoder calls `next_token_probabilities` / `score_draft` /
//    `propose` through a non-const reference, so the library cannot check this; a model
//    that reads immutable tables (and returns views of them) is fine, a model that writes
//    its rows into a member buffer (the usual score_draft) is not.
//  - The free functions (verification, residual draws, validation, standardize) keep no
//    state: concurrent calls on shared read-only rows with per-thread generators are safe.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/residual_distribution.hpp"
#include "specdec/rows.hpp"
#include "specdec/speculative_decoder.hpp"
#include "specdec/speculative_sampling.hpp"
#include "specdec/validation.hpp"

namespace {

using specdec::token_id;

constexpr std::size_t thread_count = 4;

/// An order-1 Markov model over V tokens whose rows live in an immutable table:
/// next_token_probabilities is const and returns a view of the table, so one instance may
/// be shared by decoders on several threads.
template <class T>
class TableModel {
 public:
  TableModel(std::size_t vocab, std::uint64_t seed, double sharpness) : vocab_(vocab) {
    specdec::xoshiro256pp g(seed);
    table_.resize(vocab * vocab);
    for (std::size_t s = 0; s < vocab; ++s) {
      double total = 0.0;
      std::vector<double> row(vocab);
      for (double& w : row) {
        w = std::exp(sharpness * specdec::uniform01<double>(g));
        total += w;
      }
      for (std::size_t j = 0; j < vocab; ++j)
        table_[s * vocab + j] = static_cast<T>(row[j] / total);
    }
  }

  [[nodiscard]] std::size_t vocab_size() const { return vocab_; }
  [[nodiscard]] std::span<const T> next_token_probabilities(
      std::span<const token_id> context) const {
    return row(context.empty() ? 0 : static_cast<std::size_t>(context.back()));
  }
  [[nodiscard]] std::span<const T> row(std::size_t state) const {
    return {table_.data() + state * vocab_, vocab_};
  }

 private:
  std::size_t vocab_;
  std::vector<T> table_;
};

/// TableModel plus score_draft, which writes into a member buffer: one instance per decoder.
template <class T>
class BatchedTableModel : public TableModel<T> {
 public:
  using TableModel<T>::TableModel;

  specdec::RowsView<const T> score_draft(std::span<const token_id> context,
                                         std::span<const token_id> draft) {
    const std::size_t vocab = this->vocab_size();
    rows_.resize((draft.size() + 1) * vocab);
    std::size_t state = context.empty() ? 0 : static_cast<std::size_t>(context.back());
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const auto row = this->row(state);
      std::copy(row.begin(), row.end(), rows_.begin() + static_cast<std::ptrdiff_t>(i * vocab));
      if (i < draft.size()) state = static_cast<std::size_t>(draft[i]);
    }
    return {rows_.data(), draft.size() + 1, vocab};
  }

 private:
  std::vector<T> rows_;
};

/// A stateless proposal drafter: (last token * 3 + 1 + i) mod V.
struct StrideDrafter {
  std::size_t vocab = 1;
  std::size_t propose(std::span<const token_id> context, std::span<token_id> out) const {
    const std::size_t last = context.empty() ? 0 : static_cast<std::size_t>(context.back());
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = static_cast<token_id>((last * 3 + 1 + i) % vocab);
    }
    return out.size();
  }
};

/// Runs job(i) for i in [0, thread_count) on separate threads.
void run_concurrently(const std::function<void(std::size_t)>& job) {
  std::vector<std::thread> threads;
  threads.reserve(thread_count);
  for (std::size_t i = 0; i < thread_count; ++i) threads.emplace_back(job, i);
  for (std::thread& thread : threads) thread.join();
}

specdec::DecoderOptions options_for(std::size_t i) {
  specdec::DecoderOptions options;
  options.sampling.temperature = i % 2 == 0 ? 1.0 : 0.8;
  options.sampling.top_k = i % 2 == 0 ? 0 : 20;
  options.gamma_policy = specdec::AdditiveGamma{};
  options.stop_tokens = {0};
  return options;
}

constexpr std::size_t vocab = 64;
constexpr std::size_t new_tokens = 300;

}  // namespace

TEMPLATE_TEST_CASE("independent decoders on separate threads match sequential runs",
                   "[thread_safety][speculative_decoder]", float, double) {
  // Everything per decoder: its own models, decoder, generator (seed = its index).
  const auto generate = [](std::size_t i) {
    TableModel<TestType> target(vocab, 100 + i, 3.0);
    TableModel<TestType> draft(vocab, 200 + i, 2.0);
    specdec::SpeculativeDecoder decoder(target, draft, options_for(i));
    const std::vector<token_id> prompt{static_cast<token_id>(1 + i)};
    return decoder.generate(prompt, new_tokens, std::uint64_t{7 + i}).tokens;
  };
  std::vector<std::vector<token_id>> sequential(thread_count);
  for (std::size_t i = 0; i < thread_count; ++i) sequential[i] = generate(i);
  std::vector<std::vector<token_id>> concurrent(thread_count);
  run_concurrently([&](std::size_t i) { concurrent[i] = generate(i); });
  for (std::size_t i = 0; i < thread_count; ++i) {
    CHECK_FALSE(sequential[i].empty());
    CHECK(concurrent[i] == sequential[i]);
  }
}

TEMPLATE_TEST_CASE("independent batched-target and proposal-drafter decoders on threads",
                   "[thread_safety][speculative_decoder]", float, double) {
  const auto generate = [](std::size_t i) {
    BatchedTableModel<TestType> target(vocab, 300 + i, 3.0);
    std::vector<token_id> tokens;
    const std::vector<token_id> prompt{static_cast<token_id>(2 + i)};
    if (i % 2 == 0) {
      StrideDrafter drafter{vocab};
      specdec::SpeculativeDecoder decoder(target, drafter, options_for(i));
      tokens = decoder.generate(prompt, new_tokens, std::uint64_t{11 + i}).tokens;
    } else {
      TableModel<TestType> draft(vocab, 400 + i, 2.0);
      specdec::DecoderOptions options = options_for(i);
      options.sampling = {};
      options.sampling.temperature = 0.0;  // greedy: exact-match verification
      specdec::SpeculativeDecoder decoder(target, draft, options);
      tokens = decoder.generate(prompt, new_tokens, std::uint64_t{11 + i}).tokens;
    }
    return tokens;
  };
  std::vector<std::vector<token_id>> sequential(thread_count);
  for (std::size_t i = 0; i < thread_count; ++i) sequential[i] = generate(i);
  std::vector<std::vector<token_id>> concurrent(thread_count);
  run_concurrently([&](std::size_t i) { concurrent[i] = generate(i); });
  for (std::size_t i = 0; i < thread_count; ++i) CHECK(concurrent[i] == sequential[i]);
}

TEMPLATE_TEST_CASE("decoders on threads may share models whose calls are thread-safe",
                   "[thread_safety][speculative_decoder]", float, double) {
  // One target and one draft for all threads: TableModel only reads its immutable table.
  const TableModel<TestType> target(vocab, 500, 3.0);
  const TableModel<TestType> draft(vocab, 600, 2.0);
  const auto generate = [&](std::size_t i) {
    specdec::SpeculativeDecoder decoder(target, draft, options_for(i));
    const std::vector<token_id> prompt{static_cast<token_id>(3 + i)};
    return decoder.generate(prompt, new_tokens, std::uint64_t{13 + i}).tokens;
  };
  std::vector<std::vector<token_id>> sequential(thread_count);
  for (std::size_t i = 0; i < thread_count; ++i) sequential[i] = generate(i);
  std::vector<std::vector<token_id>> concurrent(thread_count);
  run_concurrently([&](std::size_t i) { concurrent[i] = generate(i); });
  for (std::size_t i = 0; i < thread_count; ++i) CHECK(concurrent[i] == sequential[i]);
}

TEMPLATE_TEST_CASE("free verification functions on shared rows with per-thread generators",
                   "[thread_safety][speculative_sampling]", float, double) {
  // Shared, read-only rows: gamma = 3 draft rows and 4 target rows over V = 64.
  const TableModel<TestType> rows_source(vocab, 700, 2.0);
  constexpr std::size_t gamma = 3;
  std::vector<TestType> target_data;
  std::vector<TestType> draft_data;
  for (std::size_t i = 0; i <= gamma; ++i) {
    const auto p = rows_source.row(i);
    target_data.insert(target_data.end(), p.begin(), p.end());
    if (i < gamma) {
      const auto q = rows_source.row(10 + i);
      draft_data.insert(draft_data.end(), q.begin(), q.end());
    }
  }
  const specdec::RowsView<const TestType> target_rows(target_data.data(), gamma + 1, vocab);
  const specdec::RowsView<const TestType> draft_rows(draft_data.data(), gamma, vocab);
  const std::vector<token_id> drafts{5, 17, 33};
  constexpr std::size_t draws = 2000;
  const auto verify_many = [&](std::size_t i) {
    specdec::xoshiro256pp g(900 + i);
    std::vector<std::int64_t> outcomes;
    outcomes.reserve(3 * draws);
    for (std::size_t k = 0; k < draws; ++k) {
      const auto result = specdec::verify_speculative_checked(std::span<const token_id>(drafts),
                                                              draft_rows, target_rows, g);
      const auto proposals =
          specdec::verify_speculative_proposals(std::span<const token_id>(drafts), target_rows, g);
      const auto residual = specdec::sample_residual(target_rows.row(0), draft_rows.row(0), g);
      outcomes.push_back(static_cast<std::int64_t>(result.accepted) * 1000 + result.token);
      outcomes.push_back(static_cast<std::int64_t>(proposals.accepted) * 1000 + proposals.token);
      outcomes.push_back(residual.token);
    }
    return outcomes;
  };
  std::vector<std::vector<std::int64_t>> sequential(thread_count);
  for (std::size_t i = 0; i < thread_count; ++i) sequential[i] = verify_many(i);
  std::vector<std::vector<std::int64_t>> concurrent(thread_count);
  run_concurrently([&](std::size_t i) { concurrent[i] = verify_many(i); });
  for (std::size_t i = 0; i < thread_count; ++i) CHECK(concurrent[i] == sequential[i]);
}

TEST_CASE("a decoder moved to another thread keeps working",
          "[thread_safety][speculative_decoder]") {
  // One decoder per thread at a time: handing a decoder over (after join) is fine.
  TableModel<float> target(vocab, 800, 3.0);
  TableModel<float> draft(vocab, 801, 2.0);
  specdec::SpeculativeDecoder decoder(target, draft, options_for(0));
  const std::vector<token_id> prompt{4};
  const auto first = decoder.generate(prompt, 50, std::uint64_t{1}).tokens;
  std::vector<token_id> second;
  std::thread worker([&] { second = decoder.generate(prompt, 50, std::uint64_t{1}).tokens; });
  worker.join();
  CHECK(first == second);
}

TEST_CASE("a shared model that writes a member buffer is a data race (hidden: TSan demo)",
          "[.][thread_safety_race_demo]") {
  // Not run by default: it shows that the TSan stage detects what the rule forbids. Run as
  //   build/tsan/tests/thread_safety_test "[thread_safety_race_demo]"
  // and ThreadSanitizer reports a data race on BatchedTableModel's row buffer.
  BatchedTableModel<float> target(vocab, 900, 3.0);
  const TableModel<float> draft(vocab, 901, 2.0);
  run_concurrently([&](std::size_t i) {
    specdec::SpeculativeDecoder decoder(target, draft, options_for(i));
    const std::vector<token_id> prompt{static_cast<token_id>(i)};
    (void)decoder.generate(prompt, 50, std::uint64_t{i});
  });
}
