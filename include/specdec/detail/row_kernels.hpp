// specdec — private, vectorized kernels over probability rows: block sums, the two-level
// mass table behind every inverse-CDF draw, and argmax scans for greedy verification.
//
// Vectorization without -ffast-math: every kernel keeps `kernel_lanes` independent
// accumulators and combines them in a fixed order. Each lane is a separate variable, so the
// compiler maps the lanes onto SIMD registers (SSE2 and up) without reassociating a single
// floating-point addition; results are identical under GCC and Clang.
#pragma once

#include <array>
#include <cstddef>
#include <limits>
#include <utility>

namespace specdec::detail {

/// Elements summed by one block kernel call (a multiple of `kernel_lanes`).
inline constexpr std::size_t kernel_block = 64;
/// Independent accumulators per kernel: 4 SSE float vectors or 8 SSE double vectors.
inline constexpr std::size_t kernel_lanes = 16;
/// Superblock masses kept on the stack by a mass table (2 KiB).
inline constexpr std::size_t max_superblocks = 256;
/// "No index".
inline constexpr std::size_t no_index = static_cast<std::size_t>(-1);

static_assert(kernel_block % kernel_lanes == 0);
static_assert(kernel_lanes == 16, "reduce_lanes is written for 16 lanes");

/// max(0, value) that maps NaN to 0 (a NaN compares false), so that one bad entry can
/// never poison a mass: the caller sees at worst a zero mass and takes its fallback.
template <class T>
[[nodiscard]] inline T clamp_nonnegative(T value) noexcept {
  return value > T(0) ? value : T(0);
}

/// Sum of the `kernel_lanes` accumulators in a fixed pairwise order, then widened to double.
template <class T>
[[nodiscard]] inline double reduce_lanes(const std::array<T, kernel_lanes>& accumulators) noexcept {
  std::array<T, kernel_lanes / 2> level{};
  for (std::size_t k = 0; k < kernel_lanes / 2; ++k)
    level[k] = accumulators[k] + accumulators[k + kernel_lanes / 2];
  for (std::size_t k = 0; k < 4; ++k) level[k] += level[k + 4];
  for (std::size_t k = 0; k < 2; ++k) level[k] += level[k + 2];
  return static_cast<double>(level[0] + level[1]);
}

// ---------------------------------------------------------------------------------------
// Element sources: the non-negative weights an inverse-CDF draw walks over. Each source
// gives `size()`, `element(j)` and `full_block_sum(first)` (a block of kernel_block
// entries starting at `first`, entirely inside the row). Every pass over a source calls
// the same functions, so all passes see bitwise identical block sums.
// ---------------------------------------------------------------------------------------

/// Weights max(0, row[j]): plain sampling from a row (p for a bonus token or a fallback).
template <class T>
struct row_source {
  const T* row;
  std::size_t count;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] T element(std::size_t j) const noexcept { return clamp_nonnegative(row[j]); }
  [[nodiscard]] double full_block_sum(std::size_t first) const noexcept {
    std::array<T, kernel_lanes> accumulators{};
    const T* block = row + first;
    for (std::size_t i = 0; i < kernel_block; i += kernel_lanes) {
      for (std::size_t k = 0; k < kernel_lanes; ++k) {
        accumulators[k] += clamp_nonnegative(block[i + k]);
      }
    }
    return reduce_lanes(accumulators);
  }
};

/// Weights max(0, p[j] - q[j]): the residual of Algorithm 1 (paper Sec. 2.3).
template <class T>
struct difference_source {
  const T* target;
  const T* draft;
  std::size_t count;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] T element(std::size_t j) const noexcept {
    return clamp_nonnegative(target[j] - draft[j]);
  }
  [[nodiscard]] double full_block_sum(std::size_t first) const noexcept {
    std::array<T, kernel_lanes> accumulators{};
    const T* p = target + first;
    const T* q = draft + first;
    for (std::size_t i = 0; i < kernel_block; i += kernel_lanes) {
      for (std::size_t k = 0; k < kernel_lanes; ++k) {
        accumulators[k] += clamp_nonnegative(p[i + k] - q[i + k]);
      }
    }
    return reduce_lanes(accumulators);
  }
};

/// Weights max(0, p[j] - l * q[j]): the lenient residual (paper App. A.5), l in (0, 1).
template <class T>
struct lenient_difference_source {
  const T* target;
  const T* draft;
  std::size_t count;
  T lenience;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] T element(std::size_t j) const noexcept {
    return clamp_nonnegative(target[j] - lenience * draft[j]);
  }
  [[nodiscard]] double full_block_sum(std::size_t first) const noexcept {
    std::array<T, kernel_lanes> accumulators{};
    const T* p = target + first;
    const T* q = draft + first;
    for (std::size_t i = 0; i < kernel_block; i += kernel_lanes) {
      for (std::size_t k = 0; k < kernel_lanes; ++k) {
        accumulators[k] += clamp_nonnegative(p[i + k] - lenience * q[i + k]);
      }
    }
    return reduce_lanes(accumulators);
  }
};

/// Weights max(0, row[j]) except at `replaced`, whose weight is `replacement`: the residual
/// of a one-hot draft q = e_x, max(0, p - l e_x), i.e. p with x removed when l = 1.
template <class T>
struct replaced_entry_source {
  const T* row;
  std::size_t count;
  std::size_t replaced;
  T replacement;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] T element(std::size_t j) const noexcept {
    return j == replaced ? replacement : clamp_nonnegative(row[j]);
  }
  [[nodiscard]] double full_block_sum(std::size_t first) const noexcept;
};

/// Sum of `count` <= kernel_block weights starting at `first`, element by element into the
/// same lanes as a full block (entry j goes to lane j % kernel_lanes), for the last partial
/// block and for blocks needing per-element treatment. Deterministic, so every pass gets
/// the same value for the same block.
template <class T, class Source>
[[nodiscard]] inline double elementwise_block_sum(const Source& source, std::size_t first,
                                                  std::size_t count) noexcept {
  std::array<T, kernel_lanes> accumulators{};
  for (std::size_t j = 0; j < count; ++j) {
    accumulators[j % kernel_lanes] += source.element(first + j);
  }
  return reduce_lanes(accumulators);
}

template <class T>
double replaced_entry_source<T>::full_block_sum(std::size_t first) const noexcept {
  if (replaced - first < kernel_block) {  // unsigned: also false when replaced < first
    return elementwise_block_sum<T>(*this, first, kernel_block);
  }
  return row_source<T>{row, count}.full_block_sum(first);
}

/// The scalar type of a source's weights.
template <class Source>
using source_scalar_t = decltype(std::declval<const Source&>().element(0));

/// Mass of the block starting at `first` (full or the zero-padded last partial block).
template <class Source>
[[nodiscard]] inline double block_sum(const Source& source, std::size_t first) noexcept {
  const std::size_t remaining = source.size() - first;
  if (remaining >= kernel_block) return source.full_block_sum(first);
  return elementwise_block_sum<source_scalar_t<Source>>(source, first, remaining);
}

/// Masses of a row's weights in two levels: blocks of `kernel_block` entries, grouped
/// into at most `max_superblocks` superblocks whose cumulative masses are stored. One
/// streaming pass builds it; a draw then finds its superblock by binary search and reads
/// only that superblock of the row again.
///
/// Accuracy: a block sum adds every weight through at most 7 roundings of T (4 terms per
/// lane, then a 4-level tree), so its relative error is at most 7 u_T (u_float = 2^-24,
/// u_double = 2^-53); block sums are then accumulated in double, adding at most
/// (V / 64) u_double. For float rows with V = 256k the total mass is therefore accurate to
/// about 4.2e-7 relative (worst case), independent of V; a plain float running sum could
/// be off by V u_float = 1.6%. The probability of drawing a token is off by the same
/// relative amount of its block's mass at most.
struct mass_table {
  double total = 0.0;
  std::size_t superblock_elements = 0;  ///< a multiple of kernel_block
  std::size_t superblocks = 0;
  /// cumulative_mass[s] = masses of superblocks 0..s, added in order in double.
  std::array<double, max_superblocks> cumulative_mass{};

  /// Whether a draw is possible: a positive, finite total.
  [[nodiscard]] bool drawable() const noexcept {
    return total > 0.0 && total <= std::numeric_limits<double>::max();
  }
};

/// One streaming pass over the source: block sums, cumulative superblock masses, total.
template <class Source>
inline void build_mass_table(const Source& source, mass_table& table) noexcept {
  const std::size_t size = source.size();
  const std::size_t blocks = (size + kernel_block - 1) / kernel_block;
  const std::size_t blocks_per_superblock =
      blocks == 0 ? 1 : (blocks + max_superblocks - 1) / max_superblocks;
  table.superblock_elements = blocks_per_superblock * kernel_block;
  table.superblocks = (blocks + blocks_per_superblock - 1) / blocks_per_superblock;
  double total = 0.0;
  for (std::size_t s = 0; s < table.superblocks; ++s) {
    const std::size_t first = s * table.superblock_elements;
    const std::size_t last =
        first + table.superblock_elements < size ? first + table.superblock_elements : size;
    double mass = 0.0;
    for (std::size_t b = first; b < last; b += kernel_block) mass += block_sum(source, b);
    total += mass;
    table.cumulative_mass[s] = total;
  }
  table.total = total;
}

/// Index of the first item whose running mass exceeds `target`, walking items that
/// `mass_of(i)` weighs in order over [0, count): returns {index, target - mass before it}.
/// Items of zero mass are never chosen (adding zero never crosses the target). If rounding
/// lets the walk run past the end, the last item of positive mass is chosen with an
/// infinite remaining target, so that the next level again takes its last positive item.
/// Returns no_index only if no item has positive mass.
struct walk_position {
  std::size_t index;
  double remaining;
};

template <class MassOf>
[[nodiscard]] inline walk_position walk_masses(std::size_t count, double target,
                                               MassOf mass_of) noexcept {
  double running = 0.0;
  std::size_t last_positive = no_index;
  for (std::size_t i = 0; i < count; ++i) {
    const double mass = mass_of(i);
    if (mass > 0.0) {
      const double next = running + mass;
      if (next > target) return {i, target - running};
      running = next;
      last_positive = i;
    }
  }
  return {last_positive, std::numeric_limits<double>::infinity()};
}

/// The superblock holding `target`: the first whose cumulative mass exceeds it (binary
/// search; a superblock of zero mass never does), with the target left for its blocks.
/// Overrun through rounding: the last superblock of positive mass, infinite remainder.
[[nodiscard]] inline walk_position find_superblock(const mass_table& table,
                                                   double target) noexcept {
  std::size_t low = 0;  // invariant: the answer is in [low, high]; high = count = none
  std::size_t high = table.superblocks;
  while (low < high) {
    const std::size_t middle = low + (high - low) / 2;
    if (table.cumulative_mass[middle] > target) {
      high = middle;
    } else {
      low = middle + 1;
    }
  }
  if (low < table.superblocks) {
    return {low, target - (low == 0 ? 0.0 : table.cumulative_mass[low - 1])};
  }
  for (std::size_t s = table.superblocks; s-- > 0;) {
    if (table.cumulative_mass[s] > (s == 0 ? 0.0 : table.cumulative_mass[s - 1])) {
      return {s, std::numeric_limits<double>::infinity()};
    }
  }
  return {no_index, 0.0};
}

/// Inverse-CDF draw for `u` in [0, 1): the token whose cumulative weight first exceeds
/// u * total. Exact up to the rounding stated at mass_table; never returns an index of
/// zero weight, never one outside [0, size). Precondition: table.drawable() and the table
/// was built from `source`. Returns no_index only if the row changed since (no weight
/// found positive), which callers treat like zero mass.
template <class Source>
[[nodiscard]] inline std::size_t draw_from_table(const Source& source, const mass_table& table,
                                                 double u) noexcept {
  const std::size_t size = source.size();
  const walk_position superblock = find_superblock(table, u * table.total);
  if (superblock.index == no_index) return no_index;
  const std::size_t first = superblock.index * table.superblock_elements;
  const std::size_t remaining_elements = size - first;
  const std::size_t span = table.superblock_elements < remaining_elements
                               ? table.superblock_elements
                               : remaining_elements;
  const walk_position block =
      walk_masses((span + kernel_block - 1) / kernel_block, superblock.remaining,
                  [&](std::size_t b) { return block_sum(source, first + b * kernel_block); });
  if (block.index == no_index) return no_index;
  const std::size_t block_first = first + block.index * kernel_block;
  const std::size_t block_count =
      size - block_first < kernel_block ? size - block_first : kernel_block;
  const walk_position element = walk_masses(block_count, block.remaining, [&](std::size_t j) {
    return static_cast<double>(source.element(block_first + j));
  });
  if (element.index == no_index) return no_index;
  return block_first + element.index;
}

// ---------------------------------------------------------------------------------------
// Argmax scans (greedy verification). Preconditions: no NaN entries.
// ---------------------------------------------------------------------------------------

/// Largest entry of a non-empty row.
template <class T>
[[nodiscard]] inline T row_max(const T* row, std::size_t size) noexcept {
  std::array<T, kernel_lanes> maxima;
  maxima.fill(row[0]);
  std::size_t i = 0;
  for (; i + kernel_lanes <= size; i += kernel_lanes) {
    for (std::size_t k = 0; k < kernel_lanes; ++k) {
      maxima[k] = row[i + k] > maxima[k] ? row[i + k] : maxima[k];
    }
  }
  for (; i < size; ++i) maxima[0] = row[i] > maxima[0] ? row[i] : maxima[0];
  T best = maxima[0];
  for (std::size_t k = 1; k < kernel_lanes; ++k) best = maxima[k] > best ? maxima[k] : best;
  return best;
}

/// First index in [first, last) whose entry satisfies `pred`, checked a block at a time
/// (branch-free inside a block, early exit between blocks); no_index if none.
template <class T, class Predicate>
[[nodiscard]] inline std::size_t find_first_where(const T* row, std::size_t first, std::size_t last,
                                                  Predicate pred) noexcept {
  if (first >= last) return no_index;
  const std::size_t full_blocks = (last - first) / kernel_block;
  std::size_t i = first;
  for (std::size_t b = 0; b < full_blocks; ++b, i += kernel_block) {
    const T* block = row + i;
    bool hit = false;
    for (std::size_t k = 0; k < kernel_block; ++k) hit |= pred(block[k]);
    if (hit) break;
  }
  for (; i < last; ++i) {
    if (pred(row[i])) return i;
  }
  return no_index;
}

/// Argmax of a non-empty row, lowest index among ties.
template <class T>
[[nodiscard]] inline std::size_t row_argmax(const T* row, std::size_t size) noexcept {
  const T best = row_max(row, size);
  const std::size_t index =
      find_first_where(row, 0, size, [best](T value) { return value == best; });
  return index == no_index ? 0 : index;
}

/// Whether `candidate` is the argmax of the row (lowest index among ties): no earlier
/// entry reaches its value and no later entry exceeds it. Stops at the first witness.
template <class T>
[[nodiscard]] inline bool is_row_argmax(const T* row, std::size_t size,
                                        std::size_t candidate) noexcept {
  const T value = row[candidate];
  if (find_first_where(row, 0, candidate, [value](T entry) { return entry >= value; }) !=
      no_index) {
    return false;
  }
  return find_first_where(row, candidate + 1, size, [value](T entry) { return entry > value; }) ==
         no_index;
}

}  // namespace specdec::detail
