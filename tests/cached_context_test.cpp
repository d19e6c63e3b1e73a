// Tests for include/specdec/cached_context.hpp: which hooks sync calls for extensions,
// rollbacks, identical contexts and forced re-evaluation, and recovery after a hook
// throws; for token trees, which slots keep_tree_path receives for accepted paths of every
// depth, dropping a tree the context does not extend, throwing tree hooks and no
// allocation once warm. The decoder-level proofs (recomputed positions == rejected drafts
// per step; one score_tree call per tree step keeping the accepted path) are in
// speculative_decoder_cache_test.cpp and speculative_decoder_tree_test.cpp.
#include <cstddef>
#include <span>
#include <stdexcept>
#include <vector>

#include <catch2/catch_test_macros.hpp>

#include "specdec/cached_context.hpp"
#include "specdec/draft_tree.hpp"
#include "support/counting_allocator.hpp"

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

namespace {

using specdec::TokenTreeView;
constexpr std::size_t npos = TokenTreeView::npos;

// A "KV cache" for trees. Each entry is the whole sequence it was evaluated for (the
// context prefix it attends to plus its own token), so a slot gathered from the wrong node
// shows up even when two nodes carry the same token.
struct TreeRecordingModel {
  std::vector<std::vector<token_id>> entries;  // position or slot -> its sequence
  std::vector<std::size_t> truncations;
  std::vector<std::size_t> kept_bases;
  std::vector<std::vector<std::size_t>> kept_slots;
  std::size_t evaluated = 0;  // positions evaluated by append and append_tree
  bool fail_next_keep = false;
  bool fail_next_tree = false;

  void truncate(std::size_t n) {
    truncations.push_back(n);
    if (entries.size() > n) entries.resize(n);
  }
  void append(std::span<const token_id> tokens) {
    for (const token_id token : tokens) {
      std::vector<token_id> sequence = entries.empty() ? std::vector<token_id>{} : entries.back();
      sequence.push_back(token);
      entries.push_back(std::move(sequence));
      ++evaluated;
    }
  }
  void append_tree(const TokenTreeView& tree) {
    const std::size_t base = entries.size();
    for (std::size_t i = 1; i < tree.size(); ++i) {
      const std::size_t parent = tree.parents[i];
      std::vector<token_id> sequence;
      if (parent != 0) {
        sequence = entries[base + parent - 1];
      } else if (base > 0) {
        sequence = entries[base - 1];
      }
      sequence.push_back(tree.tokens[i]);
      entries.push_back(std::move(sequence));
      ++evaluated;
      if (fail_next_tree && i == 2) {  // two slots evaluated, then the device fails
        fail_next_tree = false;
        throw std::runtime_error("tree pass failed");
      }
    }
  }
  void keep_tree_path(std::size_t base, std::span<const std::size_t> slots) {
    kept_bases.push_back(base);
    kept_slots.emplace_back(slots.begin(), slots.end());
    for (std::size_t k = 0; k < slots.size(); ++k) {
      REQUIRE(slots[k] >= base + k);  // the documented in-place forward copy is safe
      entries[base + k] = entries[slots[k]];
      if (fail_next_keep && k == 0) {  // half gathered, then the device fails
        fail_next_keep = false;
        throw std::runtime_error("gather failed");
      }
    }
    entries.resize(base + slots.size());
  }

  // The model holds exactly `context`, every entry evaluated for its own prefix.
  [[nodiscard]] bool holds(const std::vector<token_id>& context) const {
    if (entries.size() != context.size()) return false;
    for (std::size_t k = 0; k < context.size(); ++k) {
      if (entries[k] != std::vector<token_id>(context.begin(),
                                              context.begin() + static_cast<std::ptrdiff_t>(k + 1)))
        return false;
    }
    return true;
  }
};

// root
// ├─ 1: 7 ─┬─ 3: 7 ── 6: 2
// │        └─ 4: 9
// └─ 2: 8 ─── 5: 1 ── 7: 3
// Node i sits in slot base + i - 1. Node 3 repeats node 1's token one level down.
const std::vector<token_id> tree_tokens = {specdec::no_token, 7, 8, 7, 9, 1, 2, 3};
const std::vector<std::size_t> tree_parents = {npos, 0, 0, 1, 1, 2, 3, 5};
const std::vector<std::size_t> tree_depths = {0, 1, 1, 2, 2, 2, 3, 3};

TokenTreeView example_tree() {
  return {tree_tokens, tree_parents, tree_depths};
}

const std::vector<token_id> base_context = {5, 6};

// A cache and model that hold base_context plus the pending example tree.
struct PendingTree {
  specdec::CachedContext cache;
  TreeRecordingModel model;
  PendingTree() {
    cache.sync(view(base_context), model);
    cache.append_tree(example_tree(), model);
    REQUIRE(cache.size() == 2);
    REQUIRE(cache.tree_slots() == 7);
    REQUIRE(model.entries.size() == 9);
    REQUIRE(model.evaluated == 9);
    model.truncations.clear();
  }
};

}  // namespace

TEST_CASE("CachedContext tree: concept", "[cached_context][tree]") {
  STATIC_REQUIRE(specdec::KvCacheTreeHooks<TreeRecordingModel>);
  STATIC_REQUIRE_FALSE(specdec::KvCacheTreeHooks<RecordingModel>);
}

TEST_CASE("CachedContext tree: the accepted path is gathered to the front, nothing re-evaluated",
          "[cached_context][tree]") {
  PendingTree p;
  SECTION("depth 3 through nodes 2, 5, 7, then a bonus") {
    const std::vector<token_id> next = {5, 6, 8, 1, 3, 4};
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 5, .truncated = 4, .appended = 1, .tree_path = 3});
    CHECK(p.model.kept_bases == std::vector<std::size_t>{2});
    CHECK(p.model.kept_slots == std::vector<std::vector<std::size_t>>{{3, 6, 8}});
    CHECK(p.model.truncations.empty());  // keep_tree_path dropped the other slots itself
    CHECK(p.model.evaluated == 9 + 1);   // only the bonus token
  }
  SECTION("depth 3 through nodes 1, 3, 6: the walk follows parents, not equal tokens") {
    const std::vector<token_id> next = {5, 6, 7, 7, 2, 0};
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 5, .truncated = 4, .appended = 1, .tree_path = 3});
    CHECK(p.model.kept_slots == std::vector<std::vector<std::size_t>>{{2, 4, 7}});
    CHECK(p.model.evaluated == 10);
  }
  SECTION("depth 1 at node 1, already in place: a truncate, no gather") {
    const std::vector<token_id> next = {5, 6, 7, 5};  // 5 is no child of node 1
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 3, .truncated = 6, .appended = 1, .tree_path = 1});
    CHECK(p.model.kept_slots.empty());
    CHECK(p.model.truncations == std::vector<std::size_t>{3});
    CHECK(p.model.evaluated == 10);
  }
  SECTION("depth 1 at node 2, then a correction") {
    const std::vector<token_id> next = {5, 6, 8, 2};
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 3, .truncated = 6, .appended = 1, .tree_path = 1});
    CHECK(p.model.kept_slots == std::vector<std::vector<std::size_t>>{{3}});
    CHECK(p.model.truncations.empty());
  }
  SECTION("depth 0: every tree slot is dropped, the correction appended") {
    const std::vector<token_id> next = {5, 6, 4};
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 2, .truncated = 7, .appended = 1, .tree_path = 0});
    CHECK(p.model.kept_slots.empty());
    CHECK(p.model.truncations == std::vector<std::size_t>{2});
    CHECK(p.model.evaluated == 10);
    std::vector<token_id> check = next;
    CHECK(p.model.holds(check));
  }
  SECTION("the tree's own context again: every tree slot is dropped") {
    CHECK(p.cache.sync(view(base_context), p.model) ==
          CacheSync{.kept = 2, .truncated = 7, .appended = 0, .tree_path = 0});
    CHECK(p.model.truncations == std::vector<std::size_t>{2});
    CHECK(p.model.holds(base_context));
  }
  SECTION("an emission cut inside the path: the prefix is kept, nothing appended") {
    const std::vector<token_id> next = {5, 6, 8, 1};
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 4, .truncated = 5, .appended = 0, .tree_path = 2});
    CHECK(p.model.kept_slots == std::vector<std::vector<std::size_t>>{{3, 6}});
    CHECK(p.model.evaluated == 9);
  }
  SECTION("min_appended re-evaluates the end of a kept path") {
    const std::vector<token_id> next = {5, 6, 8, 1, 3, 4};
    CHECK(p.cache.sync(view(next), p.model, 2) ==
          CacheSync{.kept = 4, .truncated = 5, .appended = 2, .tree_path = 2});
    CHECK(p.model.kept_slots == std::vector<std::vector<std::size_t>>{{3, 6, 8}});
    CHECK(p.model.truncations == std::vector<std::size_t>{4});
    CHECK(p.model.evaluated == 11);
  }
  SECTION("a context that diverges before the tree: the tree is dropped with the rollback") {
    const std::vector<token_id> next = {5, 9, 8, 1};  // 8, 1 would match the tree's tokens
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 1, .truncated = 8, .appended = 3, .tree_path = 0});
    CHECK(p.model.kept_slots.empty());
    CHECK(p.model.truncations == std::vector<std::size_t>{1});
    CHECK(p.model.evaluated == 12);
  }
  SECTION("a context shorter than the tree's context") {
    const std::vector<token_id> next = {5};
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 1, .truncated = 8, .appended = 0, .tree_path = 0});
    CHECK(p.model.truncations == std::vector<std::size_t>{1});
  }
  // In every case the model ends up holding exactly the cached context, each entry computed
  // for its own prefix (a wrong gather would leave a foreign sequence behind), and the tree
  // is resolved.
  CHECK(p.model.holds(std::vector<token_id>(p.cache.tokens().begin(), p.cache.tokens().end())));
  CHECK(p.cache.tree_slots() == 0);
  // A second sync with the same context calls nothing.
  const std::vector<token_id> same(p.cache.tokens().begin(), p.cache.tokens().end());
  const std::size_t truncations = p.model.truncations.size();
  const std::size_t keeps = p.model.kept_slots.size();
  CHECK(p.cache.sync(view(same), p.model) ==
        CacheSync{.kept = same.size(), .truncated = 0, .appended = 0, .tree_path = 0});
  CHECK(p.model.truncations.size() == truncations);
  CHECK(p.model.kept_slots.size() == keeps);
}

TEST_CASE("CachedContext tree: a full-depth chain already in place needs no hook",
          "[cached_context][tree]") {
  specdec::CachedContext cache;
  TreeRecordingModel model;
  const std::vector<token_id> tokens = {specdec::no_token, 4, 5, 6};
  const std::vector<std::size_t> parents = {npos, 0, 1, 2};
  const std::vector<std::size_t> depths = {0, 1, 2, 3};
  cache.sync(view(base_context), model);
  cache.append_tree({tokens, parents, depths}, model);
  const std::vector<token_id> next = {5, 6, 4, 5, 6, 1};
  CHECK(cache.sync(view(next), model) ==
        CacheSync{.kept = 5, .truncated = 0, .appended = 1, .tree_path = 3});
  CHECK(model.truncations.empty());
  CHECK(model.kept_slots.empty());
  CHECK(model.evaluated == 2 + 3 + 1);
  CHECK(model.holds(next));

  // The next chain is accepted up to depth 2: the leaf's slot is truncated, no gather.
  cache.append_tree({tokens, parents, depths}, model);
  std::vector<token_id> after = next;
  after.insert(after.end(), {4, 5, 0});
  CHECK(cache.sync(view(after), model) ==
        CacheSync{.kept = 8, .truncated = 1, .appended = 1, .tree_path = 2});
  CHECK(model.truncations == std::vector<std::size_t>{8});
  CHECK(model.kept_slots.empty());
  CHECK(model.holds(after));
}

TEST_CASE("CachedContext tree: a tree of the root alone and consecutive trees",
          "[cached_context][tree]") {
  specdec::CachedContext cache;
  TreeRecordingModel model;
  cache.sync(view(base_context), model);
  const std::vector<token_id> root_token = {specdec::no_token};
  const std::vector<std::size_t> root_parent = {npos};
  const std::vector<std::size_t> root_depth = {0};
  cache.append_tree({root_token, root_parent, root_depth}, model);
  CHECK(cache.tree_slots() == 0);
  CHECK(model.evaluated == 2);

  // Three steps in a row, each keeping a path and appending t, as a decoder drives it.
  std::vector<token_id> context = base_context;
  const std::vector<std::vector<token_id>> emitted = {{8, 1, 3, 0}, {7, 9, 2}, {4}};
  for (const auto& tokens : emitted) {
    cache.append_tree(example_tree(), model);
    const std::size_t before = model.evaluated;
    context.insert(context.end(), tokens.begin(), tokens.end());
    const CacheSync s = cache.sync(view(context), model);
    CHECK(s.tree_path == tokens.size() - 1);
    CHECK(s.appended == 1);
    CHECK(s.kept + s.truncated == context.size() - tokens.size() + 7);
    CHECK(model.evaluated == before + 1);
    CHECK(model.holds(context));
  }
}

TEST_CASE("CachedContext tree: separate callables", "[cached_context][tree]") {
  specdec::CachedContext cache;
  std::vector<std::size_t> truncations;
  std::vector<std::size_t> kept;
  std::size_t appended = 0;
  std::size_t tree_nodes = 0;
  const auto truncate = [&](std::size_t n) { truncations.push_back(n); };
  const auto append = [&](std::span<const token_id> tokens) { appended += tokens.size(); };
  const auto keep = [&](std::size_t base, std::span<const std::size_t> slots) {
    kept.push_back(base);
    kept.insert(kept.end(), slots.begin(), slots.end());
  };
  const auto evaluate_tree = [&](const TokenTreeView& tree) { tree_nodes += tree.size() - 1; };
  const std::vector<token_id> next = {5, 6, 8, 1, 3, 4};

  // With keep_tree_path: the path is kept.
  cache.sync(view(base_context), truncate, append, keep);
  cache.append_tree(example_tree(), evaluate_tree);
  CHECK(tree_nodes == 7);
  CHECK(cache.sync(view(next), truncate, append, keep) ==
        CacheSync{.kept = 5, .truncated = 4, .appended = 1, .tree_path = 3});
  CHECK(kept == std::vector<std::size_t>{2, 3, 6, 8});
  CHECK(appended == 3);

  // Without it the whole tree is dropped and the path evaluated again.
  cache.clear();
  truncations.clear();
  appended = 0;
  cache.sync(view(base_context), truncate, append);
  cache.append_tree(example_tree(), evaluate_tree);
  CHECK(cache.sync(view(next), truncate, append) ==
        CacheSync{.kept = 2, .truncated = 7, .appended = 4, .tree_path = 0});
  CHECK(truncations == std::vector<std::size_t>{2});
  CHECK(appended == 2 + 4);

  // clear() forgets a pending tree.
  cache.append_tree(example_tree(), evaluate_tree);
  CHECK(cache.tree_slots() == 7);
  cache.clear();
  CHECK(cache.tree_slots() == 0);
  CHECK(cache.size() == 0);
}

TEST_CASE("CachedContext tree: throwing tree hooks force a truncate on the next sync",
          "[cached_context][tree]") {
  const std::vector<token_id> next = {5, 6, 8, 1, 3, 4};
  SECTION("keep_tree_path throws half-way") {
    PendingTree p;
    p.model.fail_next_keep = true;
    CHECK_THROWS_AS(p.cache.sync(view(next), p.model), std::runtime_error);
    CHECK(p.cache.size() == 2);  // only the tree's context is trusted
    CHECK(p.cache.tree_slots() == 0);
    CHECK(p.cache.sync(view(next), p.model) ==
          CacheSync{.kept = 2, .truncated = 0, .appended = 4, .tree_path = 0});
    CHECK(p.model.truncations == std::vector<std::size_t>{2});  // cleaned up first
    CHECK(p.model.holds(next));
  }
  SECTION("append_tree throws half-way") {
    specdec::CachedContext cache;
    TreeRecordingModel model;
    cache.sync(view(base_context), model);
    model.fail_next_tree = true;
    CHECK_THROWS_AS(cache.append_tree(example_tree(), model), std::runtime_error);
    CHECK(cache.tree_slots() == 0);  // no tree is pending
    CHECK(model.entries.size() == 4);
    CHECK(cache.sync(view(next), model) ==
          CacheSync{.kept = 2, .truncated = 0, .appended = 4, .tree_path = 0});
    CHECK(model.truncations == std::vector<std::size_t>{2});
    CHECK(model.holds(next));
  }
  SECTION("the truncate after an unmatched tree throws") {
    specdec::CachedContext cache;
    std::size_t held = 0;
    bool fail = false;
    const auto truncate = [&](std::size_t n) {
      if (fail) {
        fail = false;
        throw std::runtime_error("truncate failed");
      }
      held = n;
    };
    const auto append = [&](std::span<const token_id> tokens) { held += tokens.size(); };
    const auto keep = [&](std::size_t, std::span<const std::size_t>) { FAIL("no path to keep"); };
    cache.sync(view(base_context), truncate, append, keep);
    cache.append_tree(example_tree(), [&](const TokenTreeView& tree) { held += tree.size() - 1; });
    fail = true;
    const std::vector<token_id> diverged = {5, 6, 4};
    CHECK_THROWS_AS(cache.sync(view(diverged), truncate, append, keep), std::runtime_error);
    CHECK(held == 9);  // the slots are still there...
    CHECK(cache.sync(view(diverged), truncate, append, keep) ==
          CacheSync{.kept = 2, .truncated = 0, .appended = 1, .tree_path = 0});
    CHECK(held == 3);  // ...until the retry truncates
  }
}

TEST_CASE("CachedContext tree: no allocation once reserved", "[cached_context][tree]") {
  specdec::CachedContext cache;
  cache.reserve(64, tree_tokens.size());
  std::size_t work = 0;
  const auto truncate = [&](std::size_t n) { work += n; };
  const auto append = [&](std::span<const token_id> tokens) { work += tokens.size(); };
  const auto keep = [&](std::size_t base, std::span<const std::size_t> slots) {
    work += base + slots.size();
  };
  const auto evaluate_tree = [&](const TokenTreeView& tree) { work += tree.size(); };
  std::vector<token_id> context = base_context;
  context.reserve(64);
  const token_id steps[][4] = {{8, 1, 3, 0}, {7, 9, 2, 2}, {4, 4, 4, 4}};
  const std::size_t lengths[] = {4, 3, 1};
  specdec::testing::AllocationCounter counter;
  for (int round = 0; round < 4; ++round) {
    for (std::size_t k = 0; k < 3; ++k) {
      cache.sync(std::span<const token_id>(context), truncate, append, keep);
      cache.append_tree(example_tree(), evaluate_tree);
      context.insert(context.end(), steps[k], steps[k] + lengths[k]);
    }
    cache.sync(std::span<const token_id>(context), truncate, append, keep);
    context.resize(base_context.size());  // a new prompt: roll everything back
  }
  CHECK(counter.stop() == 0);
  CHECK(work > 0);
}
