// An inference engine for one llama model: a KV cache and a forward pass that evaluates any
// number of new positions, linear or as a token tree, in one pass. It offers specdec what an
// engine offers (specdec::LogitsModel turns the logits into probability rows):
//
//   next_token_logits(context)          logits after `context`
//   score_draft_logits(context, draft)  the gamma + 1 rows after context, context + x_1, ...,
//                                       context + x_1..x_gamma: ONE forward pass over the new
//                                       tokens (causal attention over cache + new tokens)
//   score_tree_logits(context, tree)    the rows of every node of a token tree: ONE forward
//                                       pass with the tree attention mask
//
// and keeps its cache in line with the decoder's context through specdec::CachedContext:
// rejected drafts are truncated, a tree's accepted path is moved into place
// (keep_tree_path), and no accepted position is evaluated twice. The CachedContext hooks
// only stage work; the forward pass runs once per call, over every staged position (the
// previous step's correction token, the drafts, the tree nodes) together.
//
// Many sequences (lanes): an engine built with `lanes` > 1 also serves specdec's batch
// decoder (batch_decoder.hpp), one KV cache region per sequence, keyed by the sequence id:
//
//   score_batch_logits(requests)  every request's drafted prefixes (drafts + 1 rows each),
//                                 all sequences in ONE forward pass: the weights are read
//                                 once for every position of every sequence
//   draft_batch_logits(requests)  one row per request (after context + drafts), one pass
//   release_sequence(id)          the sequence left: its lane is free for another
//
// Each lane keeps its cache in line with its sequence's context through its own
// CachedContext; a free lane taken by a new sequence keeps the prefix they share (a common
// prompt is not evaluated again).
//
// Every position's result is bit-identical whether evaluated alone, in a batch or in a tree
// (kernels.hpp, "Batch invariance"), so greedy speculative decoding reproduces greedy plain
// decoding token for token. Given a ThreadPool (threads.hpp), the engine splits its larger
// matrix products by rows over the pool's threads; results do not change with the number of
// threads either.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "model.hpp"
#include "specdec/batch_decoder.hpp"
#include "specdec/cached_context.hpp"
#include "specdec/concepts.hpp"
#include "specdec/draft_tree.hpp"
#include "specdec/rows.hpp"
#include "threads.hpp"

namespace llama {

/// What the engine throws for a request it cannot serve (a context longer than the cache,
/// an empty context, a token id outside the vocabulary).
class engine_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Engine {
 public:
  /// Work done since construction or reset_counters().
  struct Counters {
    std::size_t forward_passes = 0;  ///< calls that ran the network
    std::size_t positions = 0;       ///< positions evaluated (KV entries written)
    std::size_t logit_rows = 0;      ///< rows of the output projection computed
  };

  /// An engine over `model` (which must outlive it) with room for `capacity` cached
  /// positions (0: the model's context length, at most 4096) per lane. With `threads` (which
  /// must outlive it too; several engines may share one) its matrix products run on all of
  /// the pool's threads; without, on the calling thread. Results are the same either way.
  /// `lanes` sequences can be served at once by the batch calls; the single-sequence calls
  /// use lane 0.
  explicit Engine(const Model& model, std::size_t capacity = 0, ThreadPool* threads = nullptr,
                  std::size_t lanes = 1)
      : model_(&model),
        threads_(threads),
        config_(model.config()),
        capacity_(capacity != 0 ? capacity : std::min<std::size_t>(config_.context_length, 4096)),
        lanes_(std::max<std::size_t>(lanes, 1)) {
    slots_ = lanes_.size() * capacity_;
    const std::size_t kv = config_.layers * slots_ * config_.kv_dim();
    keys_.assign(kv, 0.0F);
    values_.assign(kv, 0.0F);
    scores_.resize(attention_tasks * capacity_);
    const std::size_t pairs = config_.rope_dims / 2;
    inverse_frequencies_.resize(pairs);
    for (std::size_t i = 0; i < pairs; ++i) {
      double f = config_.rope_scale *
                 std::pow(config_.rope_base,
                          -2.0 * static_cast<double>(i) / static_cast<double>(config_.rope_dims));
      if (!config_.rope_divisors.empty()) f /= config_.rope_divisors[i];
      inverse_frequencies_[i] = f;
    }
    for (Lane& lane : lanes_) lane.cache.reserve(capacity_, lanes_.size() == 1 ? 64 : 0);
    order_.reserve(lanes_.size());
    reserve_columns(16);
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  [[nodiscard]] std::size_t vocab_size() const noexcept { return config_.vocab; }
  [[nodiscard]] const Model& model() const noexcept { return *model_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::size_t lanes() const noexcept { return lanes_.size(); }
  /// Positions lane 0's KV cache holds (without a pending tree's slots).
  [[nodiscard]] std::size_t cached() const noexcept { return lanes_[0].cached; }
  [[nodiscard]] const Counters& counters() const noexcept { return counters_; }
  void reset_counters() noexcept { counters_ = {}; }
  /// Forgets the cache (the next call evaluates its whole context).
  void reset() noexcept {
    for (Lane& lane : lanes_) {
      lane.cache.clear();
      lane.cached = 0;
      lane.pending.clear();
      lane.rows = 0;
    }
    tree_slots_ = 0;
    pending_tree_ = false;
  }

  // ---- what the decoder calls (through specdec::LogitsModel) ---------------------------

  /// The logits after `context` (one row of vocab_size()).
  std::span<const float> next_token_logits(std::span<const specdec::token_id> context) {
    check_context(context, 0);
    lanes_[0].cache.sync(context, *this, 1);  // re-evaluates the last position if it is cached
    single(1, false);
    return {logits_.data(), config_.vocab};
  }

  /// Rows p_1..p_{gamma+1}: after context, context + draft[0], ..., context + draft.
  specdec::RowsView<const float> score_draft_logits(std::span<const specdec::token_id> context,
                                                    std::span<const specdec::token_id> draft) {
    check_context(context, draft.size());
    Lane& lane = lanes_[0];
    lane.joined.assign(context.begin(), context.end());
    lane.joined.insert(lane.joined.end(), draft.begin(), draft.end());
    lane.cache.sync(lane.joined, *this, draft.size() + 1);
    single(draft.size() + 1, false);
    return {logits_.data(), draft.size() + 1, config_.vocab};
  }

  /// Row 0: after `context` (the root); row i: after context + path(i).
  specdec::RowsView<const float> score_tree_logits(std::span<const specdec::token_id> context,
                                                   const specdec::TokenTreeView& tree) {
    check_context(context, tree.size() > 0 ? tree.size() - 1 : 0);
    lanes_[0].cache.sync(context, *this, 1);
    lanes_[0].cache.append_tree(tree, *this);  // stages the nodes: the pass below evaluates them
    single(1, tree.size() > 1);
    return {logits_.data(), std::max<std::size_t>(tree.size(), 1), config_.vocab};
  }

  // ---- many sequences (specdec::BatchDecoder, through specdec::LogitsModel) ------------

  /// For each request in order, the logits after context, context + drafts[0], ...,
  /// context + drafts (drafts + 1 rows): every request's new positions in one forward pass.
  /// Throws engine_error for more sequences than lanes, an empty context, a context longer
  /// than a lane's capacity or a token outside the vocabulary (the caches are then reset).
  specdec::RowsView<const float> score_batch_logits(
      std::span<const specdec::BatchScoreRequest> requests) {
    return batch(requests, true);
  }

  /// For each request in order, the logits after context + drafts: one row per request,
  /// one forward pass.
  specdec::RowsView<const float> draft_batch_logits(
      std::span<const specdec::BatchScoreRequest> requests) {
    return batch(requests, false);
  }

  /// Sequence `id` left the batch: its lane is free (its cache is kept until another
  /// sequence takes the lane, which reuses the prefix they share). Unknown ids are ignored.
  void release_sequence(std::uint64_t id) noexcept {
    for (Lane& lane : lanes_) {
      if (lane.used && lane.id == id) lane.used = false;
    }
  }

  // ---- the hooks specdec::CachedContext calls on lane 0 (they stage; run() evaluates) ----

  /// Forgets cached positions >= n. Tree slots below n stay: CachedContext truncates to the
  /// end of an accepted tree path that already sits at positions base, base + 1, ...
  void truncate(std::size_t n) noexcept {
    lanes_[0].cached = std::min(n, lanes_[0].cached + tree_slots_);
    tree_slots_ = 0;
  }
  /// Stages `tokens` at the next positions. Tree slots still held here are an accepted path
  /// that was the whole tree and already in place (CachedContext then calls neither truncate
  /// nor keep_tree_path): they are cached positions now, and `tokens` go after them.
  void append(std::span<const specdec::token_id> tokens) {
    lanes_[0].cached += tree_slots_;
    tree_slots_ = 0;
    lanes_[0].pending.insert(lanes_[0].pending.end(), tokens.begin(), tokens.end());
  }
  /// Stages the nodes of `tree` past the root: node i at slot base + i - 1 and position
  /// base + depth(i) - 1, base = the context length.
  void append_tree(const specdec::TokenTreeView& tree) {
    tree_tokens_.assign(tree.tokens.begin(), tree.tokens.end());
    tree_parents_.assign(tree.parents.begin(), tree.parents.end());
    tree_depths_.assign(tree.depths.begin(), tree.depths.end());
    pending_tree_ = tree.size() > 1;
  }
  /// Moves the KV entries of the accepted tree path to positions base, base + 1, ... and
  /// forgets the other tree slots.
  void keep_tree_path(std::size_t base, std::span<const std::size_t> slots) noexcept {
    const std::size_t kv_dim = config_.kv_dim();
    for (std::size_t k = 0; k < slots.size(); ++k) {
      if (slots[k] == base + k) continue;
      for (std::size_t layer = 0; layer < config_.layers; ++layer) {
        std::copy_n(key(layer, slots[k]), kv_dim, key(layer, base + k));
        std::copy_n(value(layer, slots[k]), kv_dim, value(layer, base + k));
      }
    }
    lanes_[0].cached = base + slots.size();
    tree_slots_ = 0;
  }

 private:
  // One sequence's region of the KV cache: slots [index * capacity_, (index + 1) * capacity_).
  struct Lane {
    specdec::CachedContext cache;
    std::size_t cached = 0;                  // positions 0 .. cached - 1 are in the cache
    std::vector<specdec::token_id> pending;  // staged positions cached, cached + 1, ...
    std::size_t rows = 0;                    // logits wanted: the last `rows` staged positions
    std::uint64_t id = 0;                    // the sequence holding the lane (if used)
    bool used = false;
    std::vector<specdec::token_id> joined;  // context + drafts
  };

  // One staged position of a forward pass.
  struct Entry {
    specdec::token_id token = 0;
    std::size_t position = 0;      // rotary position
    std::size_t slot = 0;          // cache row its K and V go to
    std::size_t prefix_begin = 0;  // attends to slots [prefix_begin, prefix) (its lane's) ...
    std::size_t prefix = 0;
    std::size_t extra_begin = 0;  // ... and to extra_slots_[extra_begin, extra_end)
    std::size_t extra_end = 0;
  };

  void check_context(std::span<const specdec::token_id> context, std::size_t extra) const {
    if (context.empty()) {
      throw engine_error("empty context: the llama model " + model_->path() +
                         " needs at least one token (BOS)");
    }
    if (context.size() + extra > capacity_) {
      throw engine_error("context of " + std::to_string(context.size()) + " tokens (+" +
                         std::to_string(extra) + " scored) exceeds the engine's capacity of " +
                         std::to_string(capacity_) + " positions (" + model_->path() + ")");
    }
  }

  float* key(std::size_t layer, std::size_t slot) noexcept {
    return keys_.data() + (layer * slots_ + slot) * config_.kv_dim();
  }
  float* value(std::size_t layer, std::size_t slot) noexcept {
    return values_.data() + (layer * slots_ + slot) * config_.kv_dim();
  }

  void reserve_columns(std::size_t columns) {
    if (columns <= reserved_columns_) return;
    const Config& c = config_;
    x_.resize(columns * c.dim);
    h_.resize(columns * c.dim);
    t_.resize(columns * c.dim);
    q_.resize(columns * c.q_dim());
    k_.resize(columns * c.kv_dim());
    v_.resize(columns * c.kv_dim());
    a_.resize(columns * c.q_dim());
    gate_.resize(columns * c.ffn);
    up_.resize(columns * c.ffn);
    rope_.resize(columns * c.rope_dims);
    entries_.reserve(columns);
    reserved_columns_ = columns;
  }

  // A single-sequence call: lane 0's staged positions (logits for the last `linear_rows`),
  // then a staged tree's nodes.
  void single(std::size_t linear_rows, bool tree) {
    lanes_[0].rows = linear_rows;
    order_.assign(1, 0);
    run(tree);
  }

  // The batch calls: each request's lane synced to context + drafts, its new positions
  // staged, and `all_rows` ? drafts + 1 : 1 rows of logits, in request order.
  specdec::RowsView<const float> batch(std::span<const specdec::BatchScoreRequest> requests,
                                       bool all_rows) {
    order_.clear();
    try {
      for (const specdec::BatchScoreRequest& request : requests) {
        check_context(request.context, request.drafts.size());
        const std::size_t index = lane_of(request.id);
        for (const std::size_t taken : order_) {
          if (taken == index) {
            throw engine_error("sequence " + std::to_string(request.id) +
                               " appears twice in one batch call");
          }
        }
        Lane& lane = lanes_[index];
        lane.joined.assign(request.context.begin(), request.context.end());
        lane.joined.insert(lane.joined.end(), request.drafts.begin(), request.drafts.end());
        const std::size_t rows = all_rows ? request.drafts.size() + 1 : 1;
        lane.cache.sync(
            std::span<const specdec::token_id>(lane.joined),
            [&lane](std::size_t n) { lane.cached = std::min(n, lane.cached); },
            [&lane](std::span<const specdec::token_id> tokens) {
              lane.pending.insert(lane.pending.end(), tokens.begin(), tokens.end());
            },
            rows);
        lane.rows = rows;
        order_.push_back(index);
      }
    } catch (...) {
      reset();
      throw;
    }
    run(false);
    std::size_t rows = 0;
    for (const std::size_t index : order_) rows += lanes_[index].rows;
    return {logits_.data(), rows, config_.vocab};
  }

  // The lane of sequence `id`: its own, else a free one (preferring a never-used one is not
  // needed: a lane's cache only helps the next sequence that shares its prefix).
  std::size_t lane_of(std::uint64_t id) {
    std::size_t free = lanes_.size();
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      if (lanes_[i].used && lanes_[i].id == id) return i;
      if (!lanes_[i].used && free == lanes_.size()) free = i;
    }
    if (free == lanes_.size()) {
      throw engine_error("sequence " + std::to_string(id) + ": all " +
                         std::to_string(lanes_.size()) + " lanes of the engine are taken (" +
                         model_->path() + "); build it with more lanes");
    }
    lanes_[free].used = true;
    lanes_[free].id = id;
    return free;
  }

  // Evaluates everything staged in one forward pass: for each lane in order_, its staged
  // positions (logits for the last `rows`), then lane 0's staged tree if `tree`.
  void run(bool tree) {
    try {
      evaluate(tree);
    } catch (...) {
      reset();  // the cache's state is unknown: start over on the next call
      throw;
    }
  }

  void evaluate(bool tree) {
    const std::size_t nodes = (tree && pending_tree_) ? tree_tokens_.size() - 1 : 0;
    std::size_t columns = nodes;
    std::size_t output_rows = nodes;
    for (const std::size_t index : order_) {
      const Lane& lane = lanes_[index];
      const std::size_t linear = lane.pending.size();
      const std::size_t extra = index == 0 ? nodes : 0;
      if (lane.cached + linear + extra > capacity_) {
        throw engine_error("the cache would hold " + std::to_string(lane.cached + linear + extra) +
                           " positions, more than its capacity of " + std::to_string(capacity_));
      }
      if (lane.rows > linear) {
        throw engine_error("internal: " + std::to_string(lane.rows) + " rows asked of " +
                           std::to_string(linear) + " new positions");
      }
      columns += linear;
      output_rows += lane.rows;
    }
    reserve_columns(columns);
    entries_.clear();
    extra_slots_.clear();
    for (const std::size_t index : order_) {
      const Lane& lane = lanes_[index];
      const std::size_t region = index * capacity_;
      for (std::size_t i = 0; i < lane.pending.size(); ++i) {
        const std::size_t position = lane.cached + i;
        entries_.push_back(
            {lane.pending[i], position, region + position, region, region + position + 1, 0, 0});
      }
    }
    const std::size_t tree_base = lanes_[0].cached + lanes_[0].pending.size();  // node 1's slot
    for (std::size_t i = 1; i <= nodes; ++i) {
      Entry e{
          tree_tokens_[i], tree_base + tree_depths_[i] - 1, tree_base + i - 1, 0, tree_base, 0, 0};
      // Ancestors below the root, root side first (their slots increase along the path),
      // then the node itself: keys in position order, as a linear context would have them.
      e.extra_begin = extra_slots_.size();
      const std::size_t depth = tree_depths_[i];
      extra_slots_.resize(extra_slots_.size() + depth);
      std::size_t at = i;
      for (std::size_t d = depth; d > 0; --d) {
        extra_slots_[e.extra_begin + d - 1] = tree_base + at - 1;
        at = tree_parents_[at];
      }
      e.extra_end = extra_slots_.size();
      entries_.push_back(e);
    }
    for (const Entry& e : entries_) {
      if (e.token < 0 || static_cast<std::size_t>(e.token) >= config_.vocab) {
        throw engine_error("token id " + std::to_string(e.token) +
                           " is outside the vocabulary [0, " + std::to_string(config_.vocab) +
                           ") of " + model_->path());
      }
    }
    forward(columns);
    // Output rows, through one product so that the output matrix is streamed once: each
    // lane's last `rows` entries in order, then the tree nodes (a long prompt needs one row,
    // not one per position).
    if (logits_.size() < output_rows * config_.vocab) logits_.resize(output_rows * config_.vocab);
    std::size_t rows = 0;
    std::size_t column = 0;
    for (const std::size_t index : order_) {
      const Lane& lane = lanes_[index];
      column += lane.pending.size();
      for (std::size_t i = column - lane.rows; i < column; ++i, ++rows) {
        rms_norm(x_.data() + i * config_.dim, model_->output_norm().data(),
                 t_.data() + rows * config_.dim, config_.dim, config_.rms_eps);
      }
    }
    for (std::size_t i = column; i < columns; ++i, ++rows) {
      rms_norm(x_.data() + i * config_.dim, model_->output_norm().data(),
               t_.data() + rows * config_.dim, config_.dim, config_.rms_eps);
    }
    product(model_->output().data.data(), config_.vocab, config_.dim, t_.data(), config_.dim, rows,
            logits_.data(), config_.vocab);
    counters_.logit_rows += rows;
    ++counters_.forward_passes;
    counters_.positions += columns;
    for (const std::size_t index : order_) {
      Lane& lane = lanes_[index];
      lane.cached += lane.pending.size();
      lane.pending.clear();
    }
    tree_slots_ = nodes;
    pending_tree_ = false;
  }

  // task(0), ..., task(tasks - 1): on the pool's threads if the engine has a pool.
  template <class Task>
  void parallel(std::size_t tasks, Task&& task) {
    if (threads_ != nullptr) {
      threads_->run(tasks, task);
    } else {
      for (std::size_t i = 0; i < tasks; ++i) task(i);
    }
  }

  // y = W x for `columns` columns (kernels::matmul), split by rows over the thread pool
  // when there is enough work to share: every output element is computed the same way
  // whichever thread computes it.
  void product(const float* w, std::size_t rows, std::size_t cols, const float* x,
               std::size_t x_stride, std::size_t columns, float* y, std::size_t y_stride) {
    const std::size_t threads = threads_ != nullptr ? threads_->size() : 1;
    if (threads == 1 || rows * cols * columns < parallel_work || rows < 2 * row_quantum) {
      kernels::matmul(w, rows, cols, x, x_stride, columns, y, y_stride);
      return;
    }
    // Chunks of whole row tiles, a few per thread, handed out as threads become free.
    const std::size_t wanted =
        (rows + chunks_per_thread * threads - 1) / (chunks_per_thread * threads);
    const std::size_t chunk = (wanted + row_quantum - 1) / row_quantum * row_quantum;
    const std::size_t tasks = (rows + chunk - 1) / chunk;
    parallel(tasks, [&](std::size_t i) {
      const std::size_t begin = i * chunk;
      const std::size_t n = std::min(chunk, rows - begin);
      kernels::matmul(w + begin * cols, n, cols, x, x_stride, columns, y + begin, y_stride);
    });
  }

  static void rms_norm(const float* in, const float* weight, float* out, std::size_t n,
                       double eps) noexcept {
    double sum = 0.0;
    for (std::size_t i = 0; i < n; ++i) sum += static_cast<double>(in[i]) * in[i];
    const auto scale = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(n) + eps));
    for (std::size_t i = 0; i < n; ++i) out[i] = in[i] * scale * weight[i];
  }

  void rotate(float* vector, const float* table, std::size_t heads) const noexcept {
    const std::size_t pairs = config_.rope_dims / 2;
    for (std::size_t h = 0; h < heads; ++h) {
      float* x = vector + h * config_.head_dim;
      for (std::size_t i = 0; i < pairs; ++i) {
        const float cos = table[2 * i];
        const float sin = table[2 * i + 1];
        const float x0 = x[2 * i];
        const float x1 = x[2 * i + 1];
        x[2 * i] = x0 * cos - x1 * sin;
        x[2 * i + 1] = x0 * sin + x1 * cos;
      }
    }
  }

  void forward(std::size_t columns) {
    const Config& c = config_;
    const std::size_t dim = c.dim, q_dim = c.q_dim(), kv_dim = c.kv_dim(), ffn = c.ffn;
    for (std::size_t j = 0; j < columns; ++j) {
      const float* row = model_->embedding().row(static_cast<std::size_t>(entries_[j].token));
      std::copy_n(row, dim, x_.data() + j * dim);
      float* table = rope_.data() + j * c.rope_dims;
      for (std::size_t i = 0; i < c.rope_dims / 2; ++i) {
        const double angle = static_cast<double>(entries_[j].position) * inverse_frequencies_[i];
        table[2 * i] = static_cast<float>(std::cos(angle));
        table[2 * i + 1] = static_cast<float>(std::sin(angle));
      }
    }
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
    const std::size_t group = c.heads / c.kv_heads;
    for (std::size_t layer = 0; layer < c.layers; ++layer) {
      const Layer& w = model_->layers()[layer];
      for (std::size_t j = 0; j < columns; ++j) {
        rms_norm(x_.data() + j * dim, w.attn_norm.data(), h_.data() + j * dim, dim, c.rms_eps);
      }
      product(w.q.data.data(), q_dim, dim, h_.data(), dim, columns, q_.data(), q_dim);
      product(w.k.data.data(), kv_dim, dim, h_.data(), dim, columns, k_.data(), kv_dim);
      product(w.v.data.data(), kv_dim, dim, h_.data(), dim, columns, v_.data(), kv_dim);
      for (std::size_t j = 0; j < columns; ++j) {
        const float* table = rope_.data() + j * c.rope_dims;
        rotate(q_.data() + j * q_dim, table, c.heads);
        rotate(k_.data() + j * kv_dim, table, c.kv_heads);
        std::copy_n(k_.data() + j * kv_dim, kv_dim, key(layer, entries_[j].slot));
        std::copy_n(v_.data() + j * kv_dim, kv_dim, value(layer, entries_[j].slot));
      }
      // Each column attends on its own, so runs of columns go to the pool's threads, each
      // with a scores row of its own.
      const std::size_t tasks =
          threads_ != nullptr ? std::min(columns, attention_tasks) : std::size_t{1};
      parallel(tasks, [&](std::size_t i) {
        float* scores = scores_.data() + i * capacity_;
        for (std::size_t j = i * columns / tasks; j < (i + 1) * columns / tasks; ++j) {
          attend(layer, j, group, scale, scores);
        }
      });
      product(w.o.data.data(), dim, q_dim, a_.data(), q_dim, columns, t_.data(), dim);
      for (std::size_t i = 0; i < columns * dim; ++i) x_[i] += t_[i];
      for (std::size_t j = 0; j < columns; ++j) {
        rms_norm(x_.data() + j * dim, w.ffn_norm.data(), h_.data() + j * dim, dim, c.rms_eps);
      }
      product(w.gate.data.data(), ffn, dim, h_.data(), dim, columns, gate_.data(), ffn);
      product(w.up.data.data(), ffn, dim, h_.data(), dim, columns, up_.data(), ffn);
      kernels::silu_mul(gate_.data(), up_.data(), columns * ffn);
      product(w.down.data.data(), dim, ffn, gate_.data(), ffn, columns, t_.data(), dim);
      for (std::size_t i = 0; i < columns * dim; ++i) x_[i] += t_[i];
    }
  }

  // Attention of entry j in `layer`: softmax(q k / sqrt(d)) v over its allowed slots, in
  // slot order (the prefix [0, prefix), then the tree ancestors); each entry on its own, so
  // the result does not depend on the batch. Writes only column j of a_ and `scores` (room
  // for capacity_ values), so entries with their own `scores` may attend concurrently.
  void attend(std::size_t layer, std::size_t j, std::size_t group, float scale,
              float* scores) noexcept {
    const Config& c = config_;
    const Entry& e = entries_[j];
    const std::size_t hd = c.head_dim, kv_dim = c.kv_dim();
    const std::size_t extras = e.extra_end - e.extra_begin;
    const std::size_t prefix = e.prefix - e.prefix_begin;
    const std::size_t count = prefix + extras;
    const float* keys = keys_.data() + layer * slots_ * kv_dim;
    const float* values = values_.data() + layer * slots_ * kv_dim;
    for (std::size_t h = 0; h < c.heads; ++h) {
      const float* q = q_.data() + j * c.q_dim() + h * hd;
      const std::size_t offset = (h / group) * hd;
      const std::size_t first = e.prefix_begin * kv_dim + offset;
      kernels::attention_scores(q, keys + first, kv_dim, prefix, hd, scale, scores);
      for (std::size_t x = 0; x < extras; ++x) {
        const std::size_t slot = extra_slots_[e.extra_begin + x];
        kernels::attention_scores(q, keys + slot * kv_dim + offset, kv_dim, 1, hd, scale,
                                  scores + prefix + x);
      }
      float maximum = -std::numeric_limits<float>::infinity();
      for (std::size_t t = 0; t < count; ++t) maximum = std::max(maximum, scores[t]);
      kernels::exp_shifted(scores, count, maximum);
      float sum = 0.0F;
      for (std::size_t t = 0; t < count; ++t) sum += scores[t];
      const float inverse = 1.0F / sum;
      for (std::size_t t = 0; t < count; ++t) scores[t] *= inverse;
      float* out = a_.data() + j * c.q_dim() + h * hd;
      std::fill_n(out, hd, 0.0F);
      kernels::attention_values(scores, values + first, kv_dim, prefix, hd, out);
      for (std::size_t x = 0; x < extras; ++x) {
        const std::size_t slot = extra_slots_[e.extra_begin + x];
        kernels::attention_values(scores + prefix + x, values + slot * kv_dim + offset, kv_dim, 1,
                                  hd, out);
      }
    }
  }

  // Products with fewer multiply-adds than this run on one thread (the draft's small
  // matrices: handing them out would cost more than it saves).
  static constexpr std::size_t parallel_work = std::size_t{1} << 15;
  static constexpr std::size_t row_quantum = 24;  // a multiple of every kernel tile height
  static constexpr std::size_t chunks_per_thread = 2;
  static constexpr std::size_t attention_tasks = 16;  // runs of columns per attention step

  const Model* model_;
  ThreadPool* threads_;
  Config config_;
  std::size_t capacity_;  // per lane
  std::vector<Lane> lanes_;
  std::size_t slots_ = 0;             // lanes * capacity
  std::vector<std::size_t> order_;    // the lanes of this pass, in output order
  std::size_t tree_slots_ = 0;        // lane 0's tree node slots after its cached positions
  std::vector<float> keys_, values_;  // [layer][slot][kv_dim]
  std::vector<double> inverse_frequencies_;
  // staged work (linear positions: in the lanes)
  bool pending_tree_ = false;
  std::vector<specdec::token_id> tree_tokens_;
  std::vector<std::size_t> tree_parents_, tree_depths_;
  // forward-pass buffers, [column][...]
  std::size_t reserved_columns_ = 0;
  std::vector<Entry> entries_;
  std::vector<std::size_t> extra_slots_;
  std::vector<float> x_, h_, t_, q_, k_, v_, a_, gate_, up_, logits_, rope_, scores_;
  Counters counters_;
};

}  // namespace llama
