// Tests for include/specdec/cached_context.hpp: which hooks sync calls for extensions,
// rollbacks, identical contexts and forced re-evaluation, and recovery after a hook
// throws. The decoder-level proof (recomputed positions == rejected drafts per step) is in
// speculative_decoder_cache_test.cpp.
#include <cstddef>
#include <span>
#include <stdexcept>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/cached_context.hpp"

namespace {

using specdec::CacheSync;
using specdec::token_id;

// A "KV cache" that records every hook call and holds the evaluated tokens.
struct RecordingModel {
  std::vector<token_id> evaluated;  // what the model believes it has cached
  std::vector<std::size_t> truncations;
  std::size_t appended_positions = 0;
  bool fail_next_append = false;

  void truncate(std::size_t n) {
    truncations.push_back(n);
    if (evaluated.size() > n) evaluated.resize(n);
  }
  void append(std::span<const token_id> tokens) {
    if (fail_next_append) {
      fail_next_append = false;
      evaluated.push_back(tokens[0]);  // partially evaluated before failing
      throw std::runtime_error("device lost");
    }
    evaluated.insert(evaluated.end(), tokens.begin(), tokens.end());
    appended_positions += tokens.size();
  }
};

std::span<const token_id> view(const std::vector<token_id>& tokens) {
  return tokens;
}

}  // namespace

TEST_CASE("CachedContext: concept", "[cached_context]") {
  STATIC_REQUIRE(specdec::KvCacheHooks<RecordingModel>);
  STATIC_REQUIRE_FALSE(specdec::KvCacheHooks<int>);
}

TEST_CASE("CachedContext: extends, rolls back and reuses the common prefix", "[cached_context]") {
  specdec::CachedContext cache;
  RecordingModel model;

  const std::vector<token_id> prompt = {5, 6, 7};
  CHECK(cache.sync(view(prompt), model) == CacheSync{.kept = 0, .truncated = 0, .appended = 3});
  CHECK(model.truncations.empty());  // nothing to drop: no truncate call

  // target scores context + 3 drafts
  const std::vector<token_id> drafted = {5, 6, 7, 1, 2, 3};
  CHECK(cache.sync(view(drafted), model) == CacheSync{.kept = 3, .truncated = 0, .appended = 3});

  // one draft accepted, correction 9: the two rejected drafts are dropped
  const std::vector<token_id> next = {5, 6, 7, 1, 9};
  CHECK(cache.sync(view(next), model) == CacheSync{.kept = 4, .truncated = 2, .appended = 1});
  CHECK(model.truncations == std::vector<std::size_t>{4});
  CHECK(model.evaluated == next);

  // identical context: no hook at all
  CHECK(cache.sync(view(next), model) == CacheSync{.kept = 5, .truncated = 0, .appended = 0});
  CHECK(model.truncations.size() == 1);

  // shorter context (engine rewound): truncate only
  const std::vector<token_id> rewound = {5, 6};
  CHECK(cache.sync(view(rewound), model) == CacheSync{.kept = 2, .truncated = 3, .appended = 0});
  CHECK(model.evaluated == rewound);
  CHECK(std::vector<token_id>(cache.tokens().begin(), cache.tokens().end()) == rewound);

  // min_appended re-evaluates the last position even though it is cached
  CHECK(cache.sync(view(rewound), model, 1) == CacheSync{.kept = 1, .truncated = 1, .appended = 1});
  CHECK(model.evaluated == rewound);
  CHECK(cache.sync(view(rewound), model, 5) == CacheSync{.kept = 0, .truncated = 2, .appended = 2});

  // empty context
  CHECK(cache.sync({}, model) == CacheSync{.kept = 0, .truncated = 2, .appended = 0});
  CHECK(cache.size() == 0);
}

TEST_CASE("CachedContext: separate callables and clear", "[cached_context]") {
  specdec::CachedContext cache;
  cache.reserve(16);
  std::size_t truncated_to = 99;
  std::size_t appended = 0;
  const auto truncate = [&](std::size_t n) { truncated_to = n; };
  const auto append = [&](std::span<const token_id> tokens) { appended += tokens.size(); };
  const std::vector<token_id> a = {1, 2, 3};
  const std::vector<token_id> b = {1, 4};
  cache.sync(view(a), truncate, append);
  cache.sync(view(b), truncate, append);
  CHECK(truncated_to == 1);
  CHECK(appended == 4);
  cache.clear();
  CHECK(cache.sync(view(b), truncate, append).appended == 2);
}

TEST_CASE("CachedContext: a throwing hook forces a truncate on the next sync", "[cached_context]") {
  specdec::CachedContext cache;
  RecordingModel model;
  const std::vector<token_id> first = {1, 2};
  cache.sync(view(first), model);
  model.fail_next_append = true;
  const std::vector<token_id> longer = {1, 2, 3, 4};
  CHECK_THROWS_AS(cache.sync(view(longer), model), std::runtime_error);
  CHECK(cache.size() == 2);            // only the kept prefix is trusted
  CHECK(model.evaluated.size() == 3);  // the model holds a half-finished append
  const auto result = cache.sync(view(longer), model);
  CHECK(result == CacheSync{.kept = 2, .truncated = 0, .appended = 2});
  CHECK(model.truncations == std::vector<std::size_t>{2});  // cleaned up first
  CHECK(model.evaluated == longer);
}
