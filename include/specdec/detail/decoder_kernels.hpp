// specdec — private helpers of SpeculativeDecoder: row validation fused into passes that
// read a row anyway, the overlap sum_x min(p(x), q(x)) behind the beta statistic, and the
// rethrow helpers that put a location on errors.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/error.hpp"

namespace specdec::detail {

SPECDEC_KERNELS_BEGIN

/// The largest entry seen by a pass, block by block (lanes of running maxima; NaN entries
/// are passed over).
template <class T>
struct row_maximum {
  std::array<T, sampling_lanes> lanes;

  row_maximum() noexcept { lanes.fill(-std::numeric_limits<T>::infinity()); }

  SPECDEC_KERNEL_INLINE void add(const T* row, std::size_t count) noexcept {
    const std::size_t full = count / sampling_lanes * sampling_lanes;
    for (std::size_t j = 0; j < full; j += sampling_lanes) {
      for (std::size_t k = 0; k < sampling_lanes; ++k) {
        lanes[k] = lanes[k] < row[j + k] ? row[j + k] : lanes[k];
      }
    }
    for (std::size_t j = full; j < count; ++j) {
      lanes[j - full] = lanes[j - full] < row[j] ? row[j] : lanes[j - full];
    }
  }

  [[nodiscard]] T value() const noexcept {
    T best = lanes[0];
    for (const T value : lanes) best = best < value ? value : best;
    return best;
  }
};

/// Fast screen of a probability row in one vectorizable pass (row_screen::plausible).
template <class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE bool plausible_probability_row_body(const T* row,
                                                                        std::size_t size,
                                                                        double tolerance) noexcept {
  row_screen<T> screen;
  constexpr std::size_t block = 16 * sampling_lanes;  // 16 terms per T lane
  for (std::size_t i = 0; i < size; i += block) {
    screen.add(row + i, size - i < block ? size - i : block);
  }
  return screen.plausible(tolerance);
}

#if SPECDEC_DISPATCH_AVX2
template <class T>
[[nodiscard]] SPECDEC_TARGET_AVX2 bool plausible_probability_row_avx2(const T* row,
                                                                      std::size_t size,
                                                                      double tolerance) noexcept {
  return plausible_probability_row_body(row, size, tolerance);
}
#endif

// The portable builds: out of line like any inline function (not inlined at every
// dispatching call site, which would double the code the compiler optimizes).
template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline bool plausible_probability_row_portable(
    const T* row, std::size_t size, double tolerance) noexcept {
  return plausible_probability_row_body(row, size, tolerance);
}

/// plausible_probability_row_body on the active kernel path (the same verdict on every path).
template <class T>
[[nodiscard]] bool plausible_probability_row(const T* row, std::size_t size,
                                             double tolerance) noexcept {
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2_build()) return plausible_probability_row_avx2(row, size, tolerance);
#endif
  return plausible_probability_row_portable(row, size, tolerance);
}

/// beta = sum_x min(p(x), q(x)) (paper Def. 3.1 / Thm. 3.5) with q = factor * draft (the
/// decoder keeps draft rows unnormalised; factor 1 multiplies nothing), summed like
/// lane_sum: T lanes per block of 16 terms each, widened into double lanes (vectorizes
/// without -ffast-math). With `Screen`, the target row is also screened into `screen`
/// while each block is in L1 (validation fused into the beta pass).
template <bool Screen, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE double overlap_mass_body(const T* target, const T* draft,
                                                             T factor, std::size_t size,
                                                             row_screen<T>& screen) noexcept {
  constexpr std::size_t block = 16 * sampling_lanes;
  std::array<double, sampling_lanes> total{};
  for (std::size_t i = 0; i < size; i += block) {
    const std::size_t count = size - i < block ? size - i : block;
    const std::size_t full = count / sampling_lanes * sampling_lanes;
    std::array<T, sampling_lanes> lanes{};
    const T* p = target + i;
    const T* c = draft + i;
    if (factor == T(1)) {
      for (std::size_t j = 0; j < full; j += sampling_lanes) {
        for (std::size_t k = 0; k < sampling_lanes; ++k) {
          const T q = c[j + k];
          lanes[k] += p[j + k] < q ? p[j + k] : q;
        }
      }
    } else {
      for (std::size_t j = 0; j < full; j += sampling_lanes) {
        for (std::size_t k = 0; k < sampling_lanes; ++k) {
          const T q = factor * c[j + k];
          lanes[k] += p[j + k] < q ? p[j + k] : q;
        }
      }
    }
    for (std::size_t j = full; j < count; ++j) {
      const T q = factor * c[j];
      lanes[j - full] += p[j] < q ? p[j] : q;
    }
    for (std::size_t k = 0; k < sampling_lanes; ++k) total[k] += static_cast<double>(lanes[k]);
    if constexpr (Screen) screen.add(p, count);
  }
  return reduce_sampling_lanes(total);
}

#if SPECDEC_DISPATCH_AVX2
template <bool Screen, class T>
[[nodiscard]] SPECDEC_TARGET_AVX2 double overlap_mass_avx2(const T* target, const T* draft,
                                                           T factor, std::size_t size,
                                                           row_screen<T>& screen) noexcept {
  return overlap_mass_body<Screen>(target, draft, factor, size, screen);
}
#endif

template <bool Screen, class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline double overlap_mass_portable(
    const T* target, const T* draft, T factor, std::size_t size, row_screen<T>& screen) noexcept {
  return overlap_mass_body<Screen>(target, draft, factor, size, screen);
}

/// overlap_mass_body on the active kernel path (the same sums on every path).
template <bool Screen, class T>
[[nodiscard]] double overlap_mass(const T* target, const T* draft, T factor, std::size_t size,
                                  row_screen<T>& screen) noexcept {
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2_build()) return overlap_mass_avx2<Screen>(target, draft, factor, size, screen);
#endif
  return overlap_mass_portable<Screen>(target, draft, factor, size, screen);
}

/// One block of overlap_mass_nucleus_body: overlap_mass_body's loops over the `count`
/// entries at `first`, p's entries those of the view: kept with >= (Side 1) or > (Side -1)
/// last_key for a block on one side of the last id, on GNU vector packs of `Bytes` (lane
/// for lane the scalar loops' operations: compilers do not vectorize their select), and
/// one by one (view.at) for the block that straddles it (Side 0).
template <int Side, std::size_t Bytes, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE std::array<T, sampling_lanes> overlap_nucleus_block(
    const nucleus_view<T>& view, const T* draft, T factor, std::size_t first,
    std::size_t count) noexcept {
  const std::size_t full = count / sampling_lanes * sampling_lanes;
  std::array<T, sampling_lanes> lanes{};
  bool packed = false;  // [0, full) summed on packs
#if defined(__GNUC__) || defined(__clang__)
  if constexpr (Side != 0) {
    using pack [[gnu::vector_size(Bytes)]] = T;
    constexpr std::size_t width = Bytes / sizeof(T);
    constexpr std::size_t packs = sampling_lanes / width;
    pack sum[packs] = {};
    const pack bound = pack{} + view.last_key;
    for (std::size_t j = 0; j < full; j += sampling_lanes) {
      for (std::size_t h = 0; h < packs; ++h) {
        pack value;
        pack c;
        std::memcpy(&value, view.row + first + j + h * width, sizeof value);
        std::memcpy(&c, draft + first + j + h * width, sizeof c);
        pack p = value * view.scale;
        if constexpr (Side > 0) {
          p = value >= bound ? p : pack{};
        } else {
          p = value > bound ? p : pack{};
        }
        const pack q = factor == T(1) ? c : factor * c;
        sum[h] += p < q ? p : q;
      }
    }
    std::memcpy(lanes.data(), sum, sizeof sum);
    packed = true;
  }
#endif
  for (std::size_t j = 0; j < full && !packed; j += sampling_lanes) {
    for (std::size_t k = 0; k < sampling_lanes; ++k) {
      const T entry = view.at(first + j + k);
      const T q = factor == T(1) ? draft[first + j + k] : factor * draft[first + j + k];
      lanes[k] += entry < q ? entry : q;
    }
  }
  for (std::size_t j = full; j < count; ++j) {  // overlap_mass_body's tail
    const T entry = view.at(first + j);
    const T q = factor * draft[first + j];
    lanes[j - full] += entry < q ? entry : q;
  }
  return lanes;
}

/// overlap_mass<false> with p a nucleus_view (a top-p target row read in place): bitwise
/// overlap_mass over the written row. `Bytes`: the calling path's vector width.
template <std::size_t Bytes, class T>
[[nodiscard]] SPECDEC_KERNEL_INLINE double overlap_mass_nucleus_body(const nucleus_view<T>& view,
                                                                     const T* draft, T factor,
                                                                     std::size_t size) noexcept {
  constexpr std::size_t block = 16 * sampling_lanes;
  std::array<double, sampling_lanes> total{};
  for (std::size_t i = 0; i < size; i += block) {
    const std::size_t count = size - i < block ? size - i : block;
    std::array<T, sampling_lanes> lanes;
    if (i + count <= view.last + 1) {
      lanes = overlap_nucleus_block<1, Bytes>(view, draft, factor, i, count);
    } else if (i > view.last) {
      lanes = overlap_nucleus_block<-1, Bytes>(view, draft, factor, i, count);
    } else {
      lanes = overlap_nucleus_block<0, Bytes>(view, draft, factor, i, count);
    }
    for (std::size_t k = 0; k < sampling_lanes; ++k) total[k] += static_cast<double>(lanes[k]);
  }
  return reduce_sampling_lanes(total);
}

#if SPECDEC_DISPATCH_AVX2
template <class T>
[[nodiscard]] SPECDEC_TARGET_AVX2 double overlap_mass_nucleus_avx2(const nucleus_view<T>& view,
                                                                   const T* draft, T factor,
                                                                   std::size_t size) noexcept {
  return overlap_mass_nucleus_body<32>(view, draft, factor, size);
}
#endif

template <class T>
[[nodiscard]] SPECDEC_PORTABLE_KERNEL inline double overlap_mass_nucleus_portable(
    const nucleus_view<T>& view, const T* draft, T factor, std::size_t size) noexcept {
  return overlap_mass_nucleus_body<16>(view, draft, factor, size);
}

/// overlap_mass_nucleus_body on the active kernel path (the same sums on every path).
template <class T>
[[nodiscard]] double overlap_mass_nucleus(const nucleus_view<T>& view, const T* draft, T factor,
                                          std::size_t size) noexcept {
#if SPECDEC_DISPATCH_AVX2
  if (use_avx2_build()) return overlap_mass_nucleus_avx2(view, draft, factor, size);
#endif
  return overlap_mass_nucleus_portable(view, draft, factor, size);
}

SPECDEC_KERNELS_END

// The dispatchers' instances for float and double rows (specdec/kernel_instances.hpp).
#define SPECDEC_DECODER_KERNEL_INSTANCES_OF(prefix, T)                                       \
  prefix template bool plausible_probability_row<T>(const T*, std::size_t, double) noexcept; \
  prefix template double overlap_mass<true, T>(const T*, const T*, T, std::size_t,           \
                                               row_screen<T>&) noexcept;                     \
  prefix template double overlap_mass<false, T>(const T*, const T*, T, std::size_t,          \
                                                row_screen<T>&) noexcept;                    \
  prefix template double overlap_mass_nucleus<T>(const nucleus_view<T>&, const T*, T,        \
                                                 std::size_t) noexcept;
#define SPECDEC_DECODER_KERNEL_INSTANCES(prefix) \
  SPECDEC_FOR_ROW_TYPES(SPECDEC_DECODER_KERNEL_INSTANCES_OF, prefix)
SPECDEC_DECLARE_KERNEL_INSTANCES(SPECDEC_DECODER_KERNEL_INSTANCES)

}  // namespace specdec::detail
