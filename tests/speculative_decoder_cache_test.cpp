// KV-cache rollback under SpeculativeDecoder: stateful models built on CachedContext
// evaluate every position once, and after each step exactly the rejected drafts are rolled
// back (recomputed) — no accepted position is evaluated twice. The cached models compute
// their rows from their own cache, so a wrong rollback would also change the output, which
// is compared with stateless twins.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/cached_context.hpp"
#include "specdec/gamma_policy.hpp"
#include "specdec/random.hpp"
#include "specdec/speculative_decoder.hpp"
#include "speculative_decoder_models.hpp"

namespace {

using specdec::CacheSync;
using specdec::token_id;
using specdec::testing::BatchedMarkovModel;
using specdec::testing::GreedyChainDrafter;
using specdec::testing::MarkovModel;

// A Markov model with a "KV cache": the state after each cached position, computed only by
// append() from the previous position's state. Rows are read from the cache, never from the
// context directly.
class KvMarkovModel {
 public:
  explicit KvMarkovModel(MarkovModel<double> model) : model_(std::move(model)) {
    states_.reserve(4096);
    cache_.reserve(4096);
    buffer_.reserve(4096);
  }

  [[nodiscard]] std::size_t vocab_size() const { return model_.vocab_size(); }

  std::span<const double> next_token_probabilities(std::span<const token_id> context) {
    syncs.push_back(cache_.sync(context, *this));
    return row_after(context.size());
  }

  void truncate(std::size_t n) { states_.resize(n); }
  void append(std::span<const token_id> tokens) {
    for (const token_id token : tokens) {
      const std::size_t previous = states_.empty() ? 0 : states_.back();
      states_.push_back(model_.next_state(previous, static_cast<std::size_t>(token)));
      ++evaluated_positions;
    }
  }

  std::vector<CacheSync> syncs;
  std::size_t evaluated_positions = 0;

 protected:
  // The row for the token after `length` cached positions.
  std::span<const double> row_after(std::size_t length) const {
    return model_.row(length == 0 ? 0 : states_[length - 1]);
  }

  MarkovModel<double> model_;
  specdec::CachedContext cache_;
  std::vector<std::size_t> states_;
  std::vector<token_id> buffer_;
};

// The batched twin: score_draft syncs the cache to context + draft in one call.
class BatchedKvMarkovModel : public KvMarkovModel {
 public:
  using KvMarkovModel::KvMarkovModel;

  std::vector<token_id> last_draft;  // the drafts of the last score_draft call

  specdec::RowsView<const double> score_draft(std::span<const token_id> context,
                                              std::span<const token_id> draft) {
    last_draft.assign(draft.begin(), draft.end());
    buffer_.assign(context.begin(), context.end());
    buffer_.insert(buffer_.end(), draft.begin(), draft.end());
    syncs.push_back(cache_.sync(buffer_, *this));
    const std::size_t vocab = vocab_size();
    rows_.resize((draft.size() + 1) * vocab);
    for (std::size_t i = 0; i <= draft.size(); ++i) {
      const auto row = row_after(context.size() + i);
      std::copy(row.begin(), row.end(), rows_.begin() + static_cast<std::ptrdiff_t>(i * vocab));
    }
    return {rows_.data(), draft.size() + 1, vocab};
  }

 private:
  std::vector<double> rows_;
};

MarkovModel<double> target_chain() {
  return MarkovModel<double>::random(12, 2, 17, 1.5, 0.1);
}
MarkovModel<double> draft_chain(const MarkovModel<double>& target) {
  return target.order1_blend(MarkovModel<double>::random(12, 1, 18), 0.6);
}

const std::vector<token_id> prompt = {3, 1, 4, 1, 5};

}  // namespace

TEST_CASE("CachedContext under the decoder: rollback == rejected drafts, batched target",
          "[speculative_decoder][cached_context]") {
  for (const double temperature : {0.0, 1.0}) {
    INFO("T = " << temperature);
    const auto target_model = target_chain();
    const auto draft_model = draft_chain(target_model);
    BatchedKvMarkovModel target(target_model);
    KvMarkovModel draft(draft_model);
    const std::size_t gamma = 4;
    specdec::SpeculativeDecoder decoder(
        target, draft,
        {.sampling = {.temperature = temperature}, .gamma_policy = specdec::FixedGamma(gamma)});
    // stateless twins with the same seed must give the same tokens
    BatchedMarkovModel<double> plain_target(target_model);
    auto plain_draft = draft_model;
    specdec::SpeculativeDecoder reference(
        plain_target, plain_draft,
        {.sampling = {.temperature = temperature}, .gamma_policy = specdec::FixedGamma(gamma)});

    specdec::xoshiro256pp g(5);
    specdec::xoshiro256pp g_reference(5);
    std::vector<token_id> context = prompt;
    std::size_t previous_accepted = 0;
    std::size_t coincidences = 0;
    std::size_t rolled_back = 0;
    std::size_t fresh_positions = 0;
    for (int step = 0; step < 300; ++step) {
      const std::vector<token_id> previous_drafts = target.last_draft;  // scored last step
      const std::size_t draft_syncs_before = draft.syncs.size();
      const auto result = decoder.step(context, g);
      const auto expected = reference.step(context, g_reference);
      REQUIRE(std::vector<token_id>(result.tokens.begin(), result.tokens.end()) ==
              std::vector<token_id>(expected.tokens.begin(), expected.tokens.end()));
      REQUIRE(target.syncs.size() == static_cast<std::size_t>(step) + 1);  // one call per step
      const CacheSync sync = target.syncs.back();
      if (step == 0) {
        CHECK(sync.truncated == 0);
        CHECK(sync.appended == prompt.size() + result.drafted);
      } else {
        // Rolled back: the drafts rejected last step. Only at T > 0 can the correction t
        // (now the last context token) equal the rejected x_{n+1} and keep its position.
        const std::size_t rejected = previous_drafts.size() - previous_accepted;
        const bool coincidence =
            rejected > 0 && context.back() == previous_drafts[previous_accepted];
        if (temperature == 0.0) REQUIRE_FALSE(coincidence);
        if (coincidence) {
          ++coincidences;
          CHECK(sync.truncated < rejected);
        } else {
          CHECK(sync.truncated == rejected);
          // evaluated fresh: the correction/bonus t plus this step's drafts
          CHECK(sync.appended == 1 + result.drafted);
        }
        // The draft evaluated the context plus its first gamma - 1 drafts last step; its
        // first call of this step rolls back those that were rejected.
        const CacheSync first_draft_sync = draft.syncs[draft_syncs_before];
        const std::size_t cached_drafts = previous_drafts.size() - 1;
        const std::size_t draft_rejected =
            cached_drafts > previous_accepted ? cached_drafts - previous_accepted : 0;
        if (coincidence) {
          CHECK(first_draft_sync.truncated <= draft_rejected);
        } else {
          CHECK(first_draft_sync.truncated == draft_rejected);
        }
      }
      rolled_back += sync.truncated;
      fresh_positions += sync.appended;
      previous_accepted = result.accepted;
      context.insert(context.end(), result.tokens.begin(), result.tokens.end());
    }
    // every position was evaluated once, plus once more for each rolled-back position
    CHECK(target.evaluated_positions == fresh_positions);
    CHECK(fresh_positions == target.syncs.back().kept + target.syncs.back().appended + rolled_back);
    if (temperature == 0.0) CHECK(coincidences == 0);
    if (temperature == 1.0) CHECK(coincidences < 30);  // rare, but possible
  }
}

TEST_CASE("CachedContext under the decoder: proposal drafter and per-prefix target",
          "[speculative_decoder][cached_context]") {
  // Proposal-only drafts at T > 0: the correction excludes x_{n+1}, so exactly the
  // rejected drafts are rolled back. A per-prefix target syncs once per prefix.
  const auto target_model = target_chain();
  KvMarkovModel target(target_model);
  const auto other = draft_chain(target_model);
  GreedyChainDrafter<double> drafter(other);
  specdec::SpeculativeDecoder decoder(
      target, drafter,
      {.sampling = {.temperature = 0.8, .top_p = 0.95}, .gamma_policy = specdec::FixedGamma(3)});
  auto plain = target_model;
  GreedyChainDrafter<double> plain_drafter(other);
  specdec::SpeculativeDecoder reference(
      plain, plain_drafter,
      {.sampling = {.temperature = 0.8, .top_p = 0.95}, .gamma_policy = specdec::FixedGamma(3)});
  specdec::xoshiro256pp g(9);
  specdec::xoshiro256pp g_reference(9);
  std::vector<token_id> context = prompt;
  std::size_t previous_rejected = 0;
  std::size_t total_rejected = 0;
  for (int step = 0; step < 300; ++step) {
    const std::size_t syncs_before = target.syncs.size();
    const auto result = decoder.step(context, g);
    const auto expected = reference.step(context, g_reference);
    REQUIRE(std::vector<token_id>(result.tokens.begin(), result.tokens.end()) ==
            std::vector<token_id>(expected.tokens.begin(), expected.tokens.end()));
    REQUIRE(target.syncs.size() - syncs_before == result.drafted + 1);
    // the first prefix call rolls back last step's rejected drafts; the others append one
    CHECK(target.syncs[syncs_before].truncated == previous_rejected);
    for (std::size_t i = syncs_before + 1; i < target.syncs.size(); ++i) {
      CHECK(target.syncs[i].truncated == 0);
      CHECK(target.syncs[i].appended == 1);
    }
    // after the per-prefix calls the cache holds context + all drafts but the last
    // after the prefix calls the cache holds the context and all drafts
    previous_rejected = result.drafted - result.accepted;
    total_rejected += previous_rejected;
    context.insert(context.end(), result.tokens.begin(), result.tokens.end());
  }
  CHECK(total_rejected > 100);  // rollbacks really happened
}
