// specdec — private, vectorized kernels over probability rows: block sums, the two-level
// mass table behind every inverse-CDF draw, and argmax scans for greedy verification.
//
// Vectorization without -ffast-math: every kernel works on blocks of `kernel_block`
// entries through plain loops over `kernel_lanes` independent accumulators (4 SSE float
// packets, 8 SSE double packets, fewer with AVX), combined in a fixed order.
// No floating-point addition is ever reassociated by the compiler, so results are identical
// under GCC and Clang and for every instruction set without FMA contraction.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "specdec/kernel_path.hpp"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#endif

namespace specdec::detail {

SPECDEC_KERNELS_BEGIN

/// Entries summed (or scanned) by one block kernel call (a multiple of `kernel_lanes`).
inline constexpr std::size_t kernel_block = 128;
/// Independent accumulators per kernel.
inline constexpr std::size_t kernel_lanes = 16;
/// Superblock masses kept on the stack by a mass table (2 KiB).
inline constexpr std::size_t max_superblocks = 256;
/// "No index".
inline constexpr std::size_t no_index = static_cast<std::size_t>(-1);

static_assert(kernel_block % kernel_lanes == 0);
static_assert(kernel_lanes == 16, "reduce_lanes (pairwise_sum16) is written for 16 lanes");

/// The accumulators of a kernel.
template <class T>
using lane_array = std::array<T, kernel_lanes>;

/// max(0, value) that maps NaN to 0 (a NaN compares false), so that one bad entry can
/// never poison a mass: the caller sees at worst a zero mass and takes its fallback.
template <class T>
[[nodiscard]] inline T clamp_nonnegative(T value) noexcept {
  return value > T(0) ? value : T(0);
}

/// Sum of 16 lanes in a fixed pairwise order: eight[k] = lanes[k] + lanes[k + 8],
/// four[k] = eight[k] + eight[k + 4], then (four[0] + four[2]) + (four[1] + four[3]).
/// With GCC and Clang the first two levels are written on 16-byte packs (the same
/// additions, lane for lane), which compilers otherwise scalarize: a pass that reduces per
/// block then spends a few instructions per block on it, not some thirty.
template <class T>
[[nodiscard]] inline T pairwise_sum16(const T* lanes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "float or double lanes");
  using pack [[gnu::vector_size(16)]] = T;
  constexpr std::size_t packs = 16 * sizeof(T) / 16;  // 4 (float), 8 (double)
  pack in[packs];
  std::memcpy(in, lanes, sizeof in);
  pack eight[packs / 2];
  for (std::size_t j = 0; j < packs / 2; ++j) eight[j] = in[j] + in[j + packs / 2];
  pack four_packs[packs / 4];
  for (std::size_t j = 0; j < packs / 4; ++j) four_packs[j] = eight[j] + eight[j + packs / 4];
  std::array<T, 4> four;
  std::memcpy(four.data(), four_packs, sizeof four_packs);
#else
  std::array<T, 8> eight;
  for (std::size_t k = 0; k < 8; ++k) eight[k] = lanes[k] + lanes[k + 8];
  std::array<T, 4> four;
  for (std::size_t k = 0; k < 4; ++k) four[k] = eight[k] + eight[k + 4];
#endif
  return (four[0] + four[2]) + (four[1] + four[3]);
}

/// Sum of the lanes (pairwise_sum16), widened to double at the end.
template <class T>
[[nodiscard]] inline double reduce_lanes(const lane_array<T>& lanes) noexcept {
  return static_cast<double>(pairwise_sum16(lanes.data()));
}

/// Sum of weight(j) over the full block of kernel_block entries at `first`: entry
/// first + i goes to lane i % kernel_lanes, lanes added in entry order, then reduce_lanes.
/// Plain loops over fixed lanes (the compiler keeps the lanes in registers and vectorizes).
template <class T, class Weight>
[[nodiscard]] inline double full_block_lanes(std::size_t first, Weight weight) noexcept {
  lane_array<T> lanes{};
  for (std::size_t i = first; i < first + kernel_block; i += kernel_lanes) {
    for (std::size_t k = 0; k < kernel_lanes; ++k) lanes[k] += weight(i + k);
  }
  return reduce_lanes(lanes);
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
  [[nodiscard]] inline T element(std::size_t j) const noexcept { return clamp_nonnegative(row[j]); }
  [[nodiscard]] inline double full_block_sum(std::size_t first) const noexcept {
    const T* values = row;
    return full_block_lanes<T>(first, [values](std::size_t j) SPECDEC_LAMBDA_INLINE {
      return clamp_nonnegative(values[j]);
    });
  }
};

/// Weights max(0, p[j] - q[j]): the residual of Algorithm 1 (paper Sec. 2.3).
template <class T>
struct difference_source {
  const T* target;
  const T* draft;
  std::size_t count;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] inline T element(std::size_t j) const noexcept {
    return clamp_nonnegative(target[j] - draft[j]);
  }
  [[nodiscard]] inline double full_block_sum(std::size_t first) const noexcept {
    const T* p = target;
    const T* q = draft;
    return full_block_lanes<T>(first, [p, q](std::size_t j) SPECDEC_LAMBDA_INLINE {
      return clamp_nonnegative(p[j] - q[j]);
    });
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
  [[nodiscard]] inline T element(std::size_t j) const noexcept {
    return clamp_nonnegative(target[j] - lenience * draft[j]);
  }
  [[nodiscard]] inline double full_block_sum(std::size_t first) const noexcept {
    const T* p = target;
    const T* q = draft;
    const T l = lenience;
    return full_block_lanes<T>(first, [p, q, l](std::size_t j) SPECDEC_LAMBDA_INLINE {
      return clamp_nonnegative(p[j] - l * q[j]);
    });
  }
};

/// Weights max(0, s * p[j] - q[j]) with s in (0, 1): block verification's residual
/// (block_verification.hpp) for normalised draft rows, s the prefix ratio rho_n.
template <class T>
struct scaled_target_difference_source {
  const T* target;
  const T* draft;
  std::size_t count;
  T scale;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] inline T element(std::size_t j) const noexcept {
    return clamp_nonnegative(scale * target[j] - draft[j]);
  }
  [[nodiscard]] inline double full_block_sum(std::size_t first) const noexcept {
    const T* p = target;
    const T* q = draft;
    const T s = scale;
    return full_block_lanes<T>(first, [p, q, s](std::size_t j) SPECDEC_LAMBDA_INLINE {
      return clamp_nonnegative(s * p[j] - q[j]);
    });
  }
};

/// Weights max(0, s * p[j] - f * c[j]) with s in (0, 1]: block verification's residual
/// (block_verification.hpp), s the prefix ratio rho_n, q = f * c the draft row (f = 1 for
/// normalised rows; the decoder keeps draft rows unnormalised with a scalar factor).
template <class T>
struct scaled_difference_source {
  const T* target;
  const T* draft;
  std::size_t count;
  T scale;
  T draft_scale;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] inline T element(std::size_t j) const noexcept {
    return clamp_nonnegative(scale * target[j] - draft_scale * draft[j]);
  }
  [[nodiscard]] inline double full_block_sum(std::size_t first) const noexcept {
    const T* p = target;
    const T* q = draft;
    const T s = scale;
    const T f = draft_scale;
    return full_block_lanes<T>(first, [p, q, s, f](std::size_t j) SPECDEC_LAMBDA_INLINE {
      return clamp_nonnegative(s * p[j] - f * q[j]);
    });
  }
};

/// A row of top-p alone at T = 1 read in place (the decoder's target rows): entry j of the
/// standardized row is row[j] * scale for the tokens the nucleus keeps (row[j] above
/// last_key, or equal to it at an id <= last) and 0 for every other token, bitwise the
/// entry detail::nucleus_keep writes. The sources below read it as their p, each bitwise
/// the source of the same name over the written row, so that every draw, residual and beta
/// is the one the written row gives.
template <class T>
struct nucleus_view {
  const T* row;
  T last_key;
  std::size_t last;
  T scale;

  [[nodiscard]] inline T at(std::size_t j) const noexcept {
    const T value = row[j];
    const bool kept = j <= last ? value >= last_key : value > last_key;
    const T scaled = value * scale;
    return kept ? scaled : T(0);
  }

  /// Sum of the weights over the full block at `first` in 16 lanes (entry j in lane j % 16,
  /// as full_block_lanes adds): weigh(p, c) turns p, entries of the standardized row, into
  /// their weights, c the same entries of `draft` (null: none), on values or on packs
  /// (each lane as the scalar form computes it; in place, since a function that returns
  /// an AVX pack outside AVX code changes the ABI). The packs are GNU vectors: a comparison
  /// and a select per entry, which compilers do not vectorize from the scalar loop. A block
  /// that straddles `last` is summed entry by entry.
  template <std::size_t Bytes, class Weigh>
  [[nodiscard]] SPECDEC_KERNEL_INLINE double block_sum(std::size_t first, const T* draft,
                                                       Weigh weigh) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
    if (first + kernel_block <= last + 1) {
      return packed_block_sum<Bytes, true>(first, draft, weigh);
    }
    if (first > last) return packed_block_sum<Bytes, false>(first, draft, weigh);
#endif
    lane_array<T> lanes{};
    for (std::size_t j = first; j < first + kernel_block; ++j) {
      T weight = at(j);
      weigh(weight, draft != nullptr ? draft[j] : T(0));
      lanes[j % kernel_lanes] += weight;
    }
    return reduce_lanes(lanes);
  }

#if defined(__GNUC__) || defined(__clang__)
  // block_sum of a block on one side of `last`: keys compared with >= (WithTies) or >, on
  // packs of `Bytes`, the calling path's vector width (GCC compares wider GNU vectors lane
  // by lane).
  template <std::size_t Bytes, bool WithTies, class Weigh>
  [[nodiscard]] SPECDEC_KERNEL_INLINE double packed_block_sum(std::size_t first, const T* draft,
                                                              Weigh weigh) const noexcept {
    using pack [[gnu::vector_size(Bytes)]] = T;
    constexpr std::size_t width = Bytes / sizeof(T);
    constexpr std::size_t packs = kernel_lanes / width;
    pack lanes[packs] = {};
    const pack bound = pack{} + last_key;
    for (std::size_t i = first; i < first + kernel_block; i += kernel_lanes) {
      for (std::size_t h = 0; h < packs; ++h) {
        pack value;
        std::memcpy(&value, row + i + h * width, sizeof value);
        pack p = value * scale;
        if constexpr (WithTies) {
          p = value >= bound ? p : pack{};
        } else {
          p = value > bound ? p : pack{};
        }
        pack c{};
        if (draft != nullptr) std::memcpy(&c, draft + i + h * width, sizeof c);
        weigh(p, c);
        lanes[h] += p;
      }
    }
    lane_array<T> out;
    std::memcpy(out.data(), lanes, sizeof lanes);
    return reduce_lanes(out);
  }
#endif
};

/// row_source over a nucleus_view: weights max(0, p[j]).
template <class T>
struct nucleus_row_source {
  nucleus_view<T> p;
  std::size_t count;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] inline T element(std::size_t j) const noexcept {
    return clamp_nonnegative(p.at(j));
  }
  template <std::size_t Bytes = 16>
  [[nodiscard]] SPECDEC_KERNEL_INLINE double full_block_sum(std::size_t first) const noexcept {
    return p.template block_sum<Bytes>(
        first, nullptr, [](auto& value, const auto&) SPECDEC_LAMBDA_INLINE {
          using V = std::remove_cvref_t<decltype(value)>;
          value = value > V{} ? value : V{};  // clamp_nonnegative, lane by lane
        });
  }
};

/// scaled_difference_source over a nucleus_view: weights max(0, s * p[j] - f * c[j]). With
/// s = 1 also difference_source (f = 1) and lenient_difference_source (f = l), bitwise: 1 * p
/// is p and 1 * c is c.
template <class T>
struct nucleus_scaled_difference_source {
  nucleus_view<T> p;
  const T* draft;
  std::size_t count;
  T scale;
  T draft_scale;

  [[nodiscard]] std::size_t size() const noexcept { return count; }
  [[nodiscard]] inline T element(std::size_t j) const noexcept {
    return clamp_nonnegative(scale * p.at(j) - draft_scale * draft[j]);
  }
  template <std::size_t Bytes = 16>
  [[nodiscard]] SPECDEC_KERNEL_INLINE double full_block_sum(std::size_t first) const noexcept {
    const T s = scale;
    const T f = draft_scale;
    return p.template block_sum<Bytes>(first, draft,
                                       [s, f](auto& value, const auto& c) SPECDEC_LAMBDA_INLINE {
                                         using V = std::remove_cvref_t<decltype(value)>;
                                         value = s * value - f * c;
                                         value = value > V{} ? value : V{};
                                       });
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
  [[nodiscard]] inline T element(std::size_t j) const noexcept {
    return j == replaced ? replacement : clamp_nonnegative(row[j]);
  }
  [[nodiscard]] inline double full_block_sum(std::size_t first) const noexcept;
};

/// Sum of `count` <= kernel_block weights starting at `first`, element by element into the
/// lanes (entry j goes to lane j % kernel_lanes), for the last partial block and for blocks
/// needing per-element treatment. Deterministic, so every pass gets the same value for the
/// same block.
template <class T, class Source>
[[nodiscard]] inline double elementwise_block_sum(const Source& source, std::size_t first,
                                                  std::size_t count) noexcept {
  lane_array<T> lanes{};
  for (std::size_t j = 0; j < count; ++j) lanes[j % kernel_lanes] += source.element(first + j);
  return reduce_lanes(lanes);
}

template <class T>
inline double replaced_entry_source<T>::full_block_sum(std::size_t first) const noexcept {
  if (replaced - first < kernel_block) {  // unsigned: also false when replaced < first
    return elementwise_block_sum<T>(*this, first, kernel_block);
  }
  return row_source<T>{row, count}.full_block_sum(first);
}

/// The scalar type of a source's weights.
template <class Source>
using source_scalar_t = decltype(std::declval<const Source&>().element(0));

/// Mass of the block starting at `first` (full, or the last partial block). `Bytes`: the
/// calling path's vector width, for the sources whose full blocks are written on GNU
/// vector packs (the nucleus sources; the same sums at every width).
template <std::size_t Bytes = 16, class Source>
[[nodiscard]] SPECDEC_KERNEL_INLINE double block_sum(const Source& source,
                                                     std::size_t first) noexcept {
  const std::size_t remaining = source.size() - first;
  if (remaining >= kernel_block) {
    if constexpr (requires { source.template full_block_sum<Bytes>(first); }) {
      return source.template full_block_sum<Bytes>(first);
    } else {
      return source.full_block_sum(first);
    }
  }
  return elementwise_block_sum<source_scalar_t<Source>>(source, first, remaining);
}

/// Masses of a row's weights in two levels: blocks of `kernel_block` entries, grouped
/// into at most `max_superblocks` superblocks whose cumulative masses are stored. One
/// streaming pass builds it; a draw then finds its superblock by binary search and reads
/// only that superblock of the row again.
///
/// Accuracy: a block sum adds every weight through at most 11 roundings of T (8 terms per
/// lane, then a 4-level tree), so its relative error is at most 11 u_T (u_float = 2^-24,
/// u_double = 2^-53); block sums are then accumulated in double, adding at most
/// (V / 128) u_double. For float rows with any V (256k included) the total mass is
/// therefore accurate to 6.6e-7 relative in the worst case, independent of V; a plain float
/// running sum could be off by V u_float = 1.6% at V = 256k. A token's probability is off by
/// at most the same relative amount of its block's mass.
struct mass_table {
  double total = 0.0;
  std::size_t superblock_elements = 0;  ///< a multiple of kernel_block
  std::size_t superblocks = 0;
  /// cumulative_mass[s] = masses of superblocks 0..s, added in order in double. Only the
  /// first `superblocks` entries are written and read; a default-initialized table leaves
  /// the array uninitialized so that a draw does not pay for clearing 2 KiB.
  std::array<double, max_superblocks> cumulative_mass;

  /// Whether a draw is possible: a positive, finite total.
  [[nodiscard]] bool drawable() const noexcept {
    return total > 0.0 && total <= std::numeric_limits<double>::max();
  }
};

/// A build_mass_table hook that does nothing.
struct no_block_hook {
  inline void operator()(std::size_t /*first*/, std::size_t /*count*/) const noexcept {}
};

/// A table's superblocks for a row of `size` entries: whole blocks of kernel_block entries,
/// at most max_superblocks of them (superblock_elements and superblocks; the passes then
/// fill cumulative_mass and total).
SPECDEC_KERNEL_INLINE void lay_out_superblocks(mass_table& table, std::size_t size) noexcept {
  const std::size_t blocks = (size + kernel_block - 1) / kernel_block;
  const std::size_t blocks_per_superblock =
      blocks == 0 ? 1 : (blocks + max_superblocks - 1) / max_superblocks;
  table.superblock_elements = blocks_per_superblock * kernel_block;
  table.superblocks = (blocks + blocks_per_superblock - 1) / blocks_per_superblock;
}

/// One streaming pass over the source: block sums, cumulative superblock masses, total.
/// `before_block(first, count)` runs before each block [first, first + count) is summed
/// (count <= kernel_block, blocks in order): work fused into the pass while the block is
/// in L1, e.g. writing the block's entries that the source then reads, or screening a row
/// for validation. It may write only the block it is given.
template <std::size_t Bytes, class Source, class BeforeBlock>
SPECDEC_KERNEL_INLINE void build_mass_table_body(const Source& source, mass_table& table,
                                                 BeforeBlock& before_block) noexcept {
  const std::size_t size = source.size();
  lay_out_superblocks(table, size);
  double total = 0.0;
  for (std::size_t s = 0; s < table.superblocks; ++s) {
    const std::size_t first = s * table.superblock_elements;
    const std::size_t last =
        first + table.superblock_elements < size ? first + table.superblock_elements : size;
    double mass = 0.0;
    for (std::size_t b = first; b < last; b += kernel_block) {
      before_block(b, last - b < kernel_block ? last - b : kernel_block);
      mass += block_sum<Bytes>(source, b);
    }
    total += mass;
    table.cumulative_mass[s] = total;
  }
  table.total = total;
}

#if SPECDEC_DISPATCH_AVX512
// Passes without a hook only: a hook's screens compare, which AVX-512 does into mask
// registers that they turn back into vectors (measured slower than their AVX2 build), and
// the draft's fused copy measured no faster (docs/performance.md).
template <class Source>
SPECDEC_TARGET_AVX512 void build_mass_table_avx512(const Source& source,
                                                   mass_table& table) noexcept {
  no_block_hook none;
  build_mass_table_body<32>(source, table, none);
}
#endif
#if SPECDEC_DISPATCH_AVX2
template <class Source, class BeforeBlock>
SPECDEC_TARGET_AVX2 void build_mass_table_avx2(const Source& source, mass_table& table,
                                               BeforeBlock& before_block) noexcept {
  build_mass_table_body<32>(source, table, before_block);
}
#endif

#if SPECDEC_DISPATCH_AVX2
/// Whether build_float_table_avx2 builds a Source's tables: a float row's max(0, row[j]) and
/// the float residual's max(0, s p[j] - f q[j]).
template <class Source>
inline constexpr bool explicit_float_table =
    std::is_same_v<Source, row_source<float>> ||
    std::is_same_v<Source, scaled_difference_source<float>>;

/// The weights of the 8 entries at j of an explicit_float_table source, as its element(j)
/// gives them (a function of the same target as its caller, not a lambda: a lambda does not
/// take its enclosing function's target).
template <class Source>
SPECDEC_TARGET_AVX2 __attribute__((always_inline)) inline __m256 float_table_weights(
    const Source& source, std::size_t j, __m256 zero) noexcept {
  if constexpr (std::is_same_v<Source, row_source<float>>) {
    return _mm256_max_ps(_mm256_loadu_ps(source.row + j), zero);
  } else {
    const __m256 p =
        _mm256_mul_ps(_mm256_set1_ps(source.scale), _mm256_loadu_ps(source.target + j));
    const __m256 q =
        _mm256_mul_ps(_mm256_set1_ps(source.draft_scale), _mm256_loadu_ps(source.draft + j));
    return _mm256_max_ps(_mm256_sub_ps(p, q), zero);
  }
}

/// A block's 16 float lanes (lanes 0-7 in `low`, 8-15 in `high`) reduced in
/// pairwise_sum16's order: eight = lanes k + k + 8, four = eight k + k + 4, then
/// (four 0 + four 2) + (four 1 + four 3).
SPECDEC_TARGET_AVX2 __attribute__((always_inline)) inline double reduce_block_lanes_avx2(
    __m256 low, __m256 high) noexcept {
  const __m256 eight = _mm256_add_ps(low, high);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 pairs = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return static_cast<double>(_mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1))));
}

/// build_mass_table_body (the same superblocks, hook calls and sums) for the sources of
/// explicit_float_table (the draft's table at T = 1, the bonus, fallback and residual draws),
/// with each full block summed by explicit AVX2 code: lanes 0-7 and 8-15 in two registers, the
/// weight's max(x, 0) in one instruction (a NaN x gives the second operand, +0, as
/// clamp_nonnegative does; s p and f q are two products and a difference, never contracted), the
/// lanes added in entry order and reduced in pairwise_sum16's order. Bitwise the generic body's
/// block sums, which the draws' walks recompute (full_block_sum). Used on the AVX2 and AVX-512
/// paths. On a 2-vCPU AMD EPYC (Zen 5), the compilers' build of the generic body compares and masks
/// instead of taking the maximum: one 128k float row took 8.4-8.6 us as its AVX2 code and 11.7-13.0
/// as its AVX-512 code (all 16 lanes in one register), 7.2-7.5 here (the pure read of the row:
/// about 7); a residual over two such rows 13.5-14.3 and 17.6-17.8 us, 12.9-13.0 here.
template <class Source, class BeforeBlock>
SPECDEC_TARGET_AVX2 void build_float_table_avx2(const Source& source, mass_table& table,
                                                BeforeBlock& before_block) noexcept {
  static_assert(explicit_float_table<Source>);
  const std::size_t size = source.size();
  lay_out_superblocks(table, size);
  const __m256 zero = _mm256_setzero_ps();
  double total = 0.0;
  for (std::size_t s = 0; s < table.superblocks; ++s) {
    const std::size_t first = s * table.superblock_elements;
    const std::size_t last =
        first + table.superblock_elements < size ? first + table.superblock_elements : size;
    double mass = 0.0;
    for (std::size_t b = first; b < last; b += kernel_block) {
      if constexpr (requires(double& sum) {
                      before_block.write_and_sum_block_avx2(source, b, sum);
                    }) {
        // A hook writing the block that the source reads may write and sum a full block in
        // one loop (nucleus_keep_hook); it declines the blocks it does not take.
        if (size - b >= kernel_block && before_block.write_and_sum_block_avx2(source, b, mass)) {
          continue;
        }
      }
      before_block(b, last - b < kernel_block ? last - b : kernel_block);
      if (size - b < kernel_block) {
        mass += elementwise_block_sum<float>(source, b, size - b);
        continue;
      }
      __m256 low = zero;
      __m256 high = zero;
      for (std::size_t i = b; i < b + kernel_block; i += kernel_lanes) {
        low = _mm256_add_ps(low, float_table_weights(source, i, zero));
        high = _mm256_add_ps(high, float_table_weights(source, i + 8, zero));
      }
      mass += reduce_block_lanes_avx2(low, high);
    }
    total += mass;
    table.cumulative_mass[s] = total;
  }
  table.total = total;
}
#endif

// The portable builds: out of line like any inline function (not inlined at every
// dispatching call site, which would double the code the compiler optimizes).
template <class Source, class BeforeBlock>
SPECDEC_PORTABLE_KERNEL inline void build_mass_table_portable(const Source& source,
                                                              mass_table& table,
                                                              BeforeBlock& before_block) noexcept {
  build_mass_table_body<16>(source, table, before_block);
}

/// build_mass_table_body on the active kernel path (kernel_path.hpp): the pass, its sums
/// and a hook whose call operator is always inlined (SPECDEC_KERNEL_INLINE) run as AVX2 code
/// where the CPU has it (a pass without a hook as AVX-512 code on the AVX-512 path, except
/// for a float row and the float residual: build_float_table_avx2 on both), with the same
/// results on every path. The library's hooks are named types templated on what
/// they read (row_screen_hook, the draft stage's pass hook): a lambda local to a function
/// template would compile the pass again for every instantiation of that function.
template <class Source, class BeforeBlock>
void build_mass_table_dispatch(const Source& source, mass_table& table,
                               BeforeBlock& before_block) noexcept {
#if SPECDEC_DISPATCH_AVX2
  if constexpr (explicit_float_table<Source>) {
    if (use_avx2_build()) return build_float_table_avx2(source, table, before_block);
  }
#endif
#if SPECDEC_DISPATCH_AVX512
  if constexpr (std::is_same_v<std::remove_cv_t<BeforeBlock>, no_block_hook>) {
    if (use_avx512()) return build_mass_table_avx512(source, table);
  }
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2_build()) return build_mass_table_avx2(source, table, before_block);
#endif
  build_mass_table_portable(source, table, before_block);
}

template <class Source, class BeforeBlock>
inline void build_mass_table(const Source& source, mass_table& table,
                             BeforeBlock&& before_block) noexcept {
  build_mass_table_dispatch(source, table, before_block);
}

template <class Source>
inline void build_mass_table(const Source& source, mass_table& table) noexcept {
  build_mass_table(source, table, no_block_hook{});
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

/// The mass to walk to for a uniform u in [0, 1): u * total. When the total is subnormal
/// (a double row whose whole mass is below DBL_MIN) every mass is a whole multiple of
/// denorm_min and sums and differences of them are exact, but u * total would be rounded
/// to such a multiple, giving the first and last positive entries half and 1.5 times their
/// share. There the target is floor(u * N) units of denorm_min, N = total / denorm_min:
/// uniform over {0, ..., N - 1}, so entry j is chosen with probability n_j / N exactly.
[[nodiscard]] inline double draw_target(double total, double u) noexcept {
  if (!(total < std::numeric_limits<double>::min())) return u * total;
  constexpr double quantum = std::numeric_limits<double>::denorm_min();
  const double units = total / quantum;  // exact: a whole number below 2^52
  double k = std::floor(u * units);
  if (k > units - 1.0) k = units - 1.0;
  return k * quantum;
}

/// Inverse-CDF draw for `u` in [0, 1): the token whose cumulative weight first exceeds
/// draw_target(total, u). Exact up to the rounding stated at mass_table; never returns an index of
/// zero weight, never one outside [0, size). Precondition: table.drawable() and the table
/// was built from `source`. Returns no_index only if the row changed since (no weight
/// found positive), which callers treat like zero mass.
template <class Source>
[[nodiscard]] inline std::size_t draw_from_table(const Source& source, const mass_table& table,
                                                 double u) noexcept {
  const std::size_t size = source.size();
  const walk_position superblock = find_superblock(table, draw_target(table.total, u));
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
// Argmax scans (greedy verification). Preconditions: no NaN entries. A block's maximum is
// one packet max per 16 entries and a short reduction; scans exit between blocks.
// ---------------------------------------------------------------------------------------

/// Entries the argmax kernels scan between two horizontal reductions (and the granularity
/// at which is_row_argmax stops), and their independent accumulators (128 bytes of lanes:
/// 8 SSE or 4 AVX registers of maxima, as many of screen masks).
inline constexpr std::size_t scan_chunk = 1024;
template <class T>
inline constexpr std::size_t scan_lanes = 128 / sizeof(T);

/// Largest of the `count` entries at `first` (NaN entries are passed over; -infinity when
/// count is 0). With `Screen`, also clears `valid` if any of them is NaN or negative (an
/// entry e with !(e >= 0)): greedy decoding's validation fused into its scan, at the cost of
/// one compare and one AND per packet. One vectorizable pass (plain loops over fixed lanes:
/// GCC and Clang turn them into max and compare instructions; the maximum is exact, so the
/// order of the lanes cannot change it).
template <bool Screen, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE T span_max_body(const T* first, std::size_t count,
                                                    bool& valid) noexcept {
  constexpr std::size_t lanes = scan_lanes<T>;
  using mask = std::conditional_t<sizeof(T) == 8, std::int64_t, std::int32_t>;
  std::array<T, lanes> best;
  best.fill(-std::numeric_limits<T>::infinity());
  std::array<mask, lanes> good;
  good.fill(mask{-1});
  const std::size_t full = count / lanes * lanes;
  for (std::size_t j = 0; j < full; j += lanes) {
    for (std::size_t k = 0; k < lanes; ++k) {
      const T value = first[j + k];
      best[k] = best[k] < value ? value : best[k];
      if constexpr (Screen) good[k] &= value >= T(0) ? mask{-1} : mask{0};
    }
  }
  T result = best[0];
  for (const T value : best) result = result < value ? value : result;
  mask all = mask{-1};
  if constexpr (Screen) {
    for (const mask value : good) all &= value;
  }
  const T* tail = first + full;
  for (std::size_t j = 0; j < count - full; ++j) {
    const T value = tail[j];
    result = result < value ? value : result;
    if constexpr (Screen) all &= value >= T(0) ? mask{-1} : mask{0};
  }
  if (Screen && all == 0) valid = false;
  return result;
}

#if SPECDEC_DISPATCH_AVX2
template <bool Screen, class T>
[[nodiscard]] SPECDEC_TARGET_AVX2 T span_max_avx2(const T* first, std::size_t count,
                                                  bool& valid) noexcept {
  return span_max_body<Screen>(first, count, valid);
}
#endif
#if SPECDEC_DISPATCH_AVX512
template <bool Screen, class T>
[[nodiscard]] SPECDEC_TARGET_AVX512 T span_max_avx512(const T* first, std::size_t count,
                                                      bool& valid) noexcept {
  return span_max_body<Screen>(first, count, valid);
}
#endif

template <bool Screen, class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline T span_max_portable(const T* first, std::size_t count,
                                                                 bool& valid) noexcept {
  return span_max_body<Screen>(first, count, valid);
}

/// span_max_body on the active kernel path (kernel_path.hpp): the same maximum and the same
/// screen verdict on every path (a maximum is exact whatever the lane count).
template <bool Screen, class T>
[[nodiscard]] T span_max(const T* first, std::size_t count, bool& valid) noexcept {
#if SPECDEC_DISPATCH_AVX512
  if (use_avx512()) return span_max_avx512<Screen>(first, count, valid);
#endif
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2()) return span_max_avx2<Screen>(first, count, valid);
#endif
  return span_max_portable<Screen>(first, count, valid);
}

/// Argmax of a non-empty row, lowest index among ties: one pass of chunk maxima (keeping
/// the first chunk that reaches the largest), then the first index of that chunk holding
/// the value. Always in range, even for rows that violate the preconditions. With `Screen`,
/// clears `valid` if the row holds a NaN or negative entry.
template <bool Screen = false, class T>
[[nodiscard]] inline std::size_t row_argmax(const T* row, std::size_t size, bool& valid) noexcept {
  std::size_t best_first = 0;
  T best = row[0];
  for (std::size_t first = 0; first < size; first += scan_chunk) {
    const std::size_t count = size - first < scan_chunk ? size - first : scan_chunk;
    const T value = span_max<Screen>(row + first, count, valid);
    if (value > best) {
      best = value;
      best_first = first;
    }
  }
  const std::size_t best_last = best_first + scan_chunk < size ? best_first + scan_chunk : size;
  for (std::size_t j = best_first; j < best_last; ++j) {
    if (row[j] == best) return j;
  }
  return best_first;
}

template <class T>
[[nodiscard]] inline std::size_t row_argmax(const T* row, std::size_t size) noexcept {
  bool valid = true;
  return row_argmax<false>(row, size, valid);
}

/// Whether `candidate` is the argmax of the row (lowest index among ties): no earlier
/// entry reaches its value and no later entry exceeds it. Stops at the first chunk holding
/// a witness. With `Screen`, clears `valid` if an entry it read is NaN or negative; a true
/// answer reads the whole row, so then every entry has been screened.
template <bool Screen = false, class T>
[[nodiscard]] inline bool is_row_argmax(const T* row, std::size_t size, std::size_t candidate,
                                        bool& valid) noexcept {
  const T value = row[candidate];
  if (Screen && !(value >= T(0))) valid = false;
  const std::size_t own_first = candidate / scan_chunk * scan_chunk;
  const std::size_t own_last = own_first + scan_chunk < size ? own_first + scan_chunk : size;
  for (std::size_t first = 0; first < own_first; first += scan_chunk) {
    if (span_max<Screen>(row + first, scan_chunk, valid) >= value) return false;
  }
  if (span_max<Screen>(row + own_first, candidate - own_first, valid) >= value) return false;
  if (span_max<Screen>(row + candidate + 1, own_last - candidate - 1, valid) > value) return false;
  for (std::size_t first = own_last; first < size; first += scan_chunk) {
    const std::size_t count = size - first < scan_chunk ? size - first : scan_chunk;
    if (span_max<Screen>(row + first, count, valid) > value) return false;
  }
  return true;
}

template <class T>
[[nodiscard]] inline bool is_row_argmax(const T* row, std::size_t size,
                                        std::size_t candidate) noexcept {
  bool valid = true;
  return is_row_argmax<false>(row, size, candidate, valid);
}

SPECDEC_KERNELS_END

// The dispatchers' instances for float and double rows (specdec/kernel_instances.hpp): the
// mass tables of the library's sources with hook Hook, and the maximum scans.
#define SPECDEC_MASS_TABLE_INSTANCE(prefix, Source, Hook)                                  \
  prefix template void build_mass_table_dispatch<Source, Hook>(const Source&, mass_table&, \
                                                               Hook&) noexcept;
#define SPECDEC_MASS_TABLE_INSTANCES(prefix, Hook, T)                           \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, row_source<T>, Hook)                      \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, difference_source<T>, Hook)               \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, lenient_difference_source<T>, Hook)       \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, scaled_target_difference_source<T>, Hook) \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, scaled_difference_source<T>, Hook)        \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, replaced_entry_source<T>, Hook)           \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, nucleus_row_source<T>, Hook)              \
  SPECDEC_MASS_TABLE_INSTANCE(prefix, nucleus_scaled_difference_source<T>, Hook)
#define SPECDEC_ROW_KERNEL_INSTANCES_OF(prefix, T)                            \
  SPECDEC_MASS_TABLE_INSTANCES(prefix, no_block_hook, T)                      \
  prefix template T span_max<true, T>(const T*, std::size_t, bool&) noexcept; \
  prefix template T span_max<false, T>(const T*, std::size_t, bool&) noexcept;
#define SPECDEC_ROW_KERNEL_INSTANCES(prefix) \
  SPECDEC_FOR_ROW_TYPES(SPECDEC_ROW_KERNEL_INSTANCES_OF, prefix)
SPECDEC_DECLARE_KERNEL_INSTANCES(SPECDEC_ROW_KERNEL_INSTANCES)

}  // namespace specdec::detail
