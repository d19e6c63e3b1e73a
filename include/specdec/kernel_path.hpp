// specdec — which instruction set the row kernels run on.
//
// The kernels that touch every entry of a row (tempered weights and softmax: a log and an
// exp per entry; top-p's passes; top-k's block maxima; the mass tables of the draws;
// greedy's argmax scan) exist twice or three times on x86-64 with GCC or Clang: the
// portable build (whatever the translation unit is compiled for, SSE2 by default), an AVX2
// build and, for the log and exp, top-k's block maxima, the maximum scans (greedy's
// argmax, a row's maximum), top-p's band passes and the mass tables of passes without a
// fused screen, an AVX-512 build (F, BW, DQ and VL) of the same source, chosen at run time
// from what the CPU has; on the AVX-512 path the other kernels run their AVX2 build
// (detail::use_avx2_build). All are compiled from the same plain loops without
// contracting multiply-adds into FMA (AVX-512 implies FMA, and a translation unit built
// with -march=native may have it on every path, so every build forbids it explicitly:
// GCC's optimize("fp-contract=off") on the kernels' functions and on the scalar forms of
// the vector math, Clang's `#pragma clang fp contract(off)` around the kernels' source), so
// they compute bitwise identical results: the path changes the speed, never a token.
//
// active_kernel_path() says which path runs; force_kernel_path() pins one (tests run every
// sampling path under each; benchmarks compare them).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "specdec/error.hpp"

#if defined(__GNUC__) && !defined(__clang__)
/// GCC: multiply-adds in this function (and in the kernel bodies inlined into it) are never
/// contracted into FMA, whatever the translation unit's flags (-march=native included).
#define SPECDEC_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define SPECDEC_NO_CONTRACT
#endif
/// Attribute of a kernel's portable build (and of the scalar forms of the vector math).
#define SPECDEC_PORTABLE_KERNEL SPECDEC_NO_CONTRACT

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
/// 1 when the AVX2 kernels are compiled in (GCC or Clang on x86).
#define SPECDEC_DISPATCH_AVX2 1
/// Attribute of a kernel compiled for AVX2 (no FMA: results equal the portable path's).
#define SPECDEC_TARGET_AVX2 __attribute__((target("avx2"))) SPECDEC_NO_CONTRACT
#else
#define SPECDEC_DISPATCH_AVX2 0
#define SPECDEC_TARGET_AVX2
#endif

#if SPECDEC_DISPATCH_AVX2
/// 1 when the AVX-512 kernels are compiled in (GCC or Clang on x86).
#define SPECDEC_DISPATCH_AVX512 1
#if defined(__clang__)
/// Attribute of a kernel compiled for AVX-512 (no FMA contraction: see the file comment).
#define SPECDEC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#else
#define SPECDEC_TARGET_AVX512                                                          \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512"), \
                 optimize("fp-contract=off")))
#endif
#else
#define SPECDEC_DISPATCH_AVX512 0
#define SPECDEC_TARGET_AVX512
#endif

// Clang contracts a * b + c into an FMA wherever the target has FMA (AVX-512 implies it)
// unless told not to, per expression where it is written: the kernel headers wrap their
// source in SPECDEC_KERNELS_BEGIN / SPECDEC_KERNELS_END.
#if defined(__clang__)
#define SPECDEC_KERNELS_BEGIN _Pragma("float_control(push)") _Pragma("clang fp contract(off)")
#define SPECDEC_KERNELS_END _Pragma("float_control(pop)")
#else
#define SPECDEC_KERNELS_BEGIN
#define SPECDEC_KERNELS_END
#endif

// Compiling the kernels once (specdec/kernel_instances.hpp): every kernel header lists its
// dispatchers' instances for float and double rows in a macro taking the word that goes
// before `template` (`extern` for a declaration, nothing for a definition). Where
// SPECDEC_EXTERN_KERNELS is 1 the headers declare them extern, so that the translation
// unit compiles none of them.
#if defined(SPECDEC_EXTERN_KERNELS) && SPECDEC_EXTERN_KERNELS
#define SPECDEC_DECLARE_KERNEL_INSTANCES(list) list(extern)
#else
#define SPECDEC_DECLARE_KERNEL_INSTANCES(list)
#endif
/// `m(prefix, T)` for both row types, and `m(prefix, T, U)` for the four pairs of them.
#define SPECDEC_FOR_ROW_TYPES(m, prefix) m(prefix, float) m(prefix, double)
#define SPECDEC_FOR_ROW_TYPE_PAIRS(m, prefix)                               \
  m(prefix, float, float) m(prefix, float, double) m(prefix, double, float) \
      m(prefix, double, double)

#if defined(__GNUC__) || defined(__clang__)
/// Inlined into its caller whatever the caller's instruction set (a kernel body).
#define SPECDEC_KERNEL_INLINE [[gnu::always_inline]] inline
/// The same for a lambda (after its parameter list).
#define SPECDEC_LAMBDA_INLINE __attribute__((always_inline))
#else
#define SPECDEC_KERNEL_INLINE inline
#define SPECDEC_LAMBDA_INLINE
#endif

namespace specdec {

/// An instruction-set path of the row kernels.
enum class kernel_path : unsigned char {
  portable,  ///< the translation unit's own instruction set (SSE2 on x86-64 by default)
  avx2,      ///< AVX2 (x86-64 with GCC or Clang, on CPUs that have it)
  avx512,    ///< AVX-512 F, BW, DQ and VL (x86-64 with GCC or Clang, on CPUs that have them)
};

[[nodiscard]] constexpr std::string_view to_string(kernel_path path) noexcept {
  switch (path) {
    case kernel_path::avx2:
      return "avx2";
    case kernel_path::avx512:
      return "avx512";
    default:
      return "portable";
  }
}

/// Whether this CPU and this build can run `path`.
[[nodiscard]] inline bool kernel_path_supported(kernel_path path) noexcept {
  switch (path) {
    case kernel_path::portable:
      return true;
    case kernel_path::avx2:
#if SPECDEC_DISPATCH_AVX2
      return __builtin_cpu_supports("avx2") != 0;
#else
      return false;
#endif
    case kernel_path::avx512:
#if SPECDEC_DISPATCH_AVX512
      return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
             __builtin_cpu_supports("avx512dq") != 0 && __builtin_cpu_supports("avx512vl") != 0;
#else
      return false;
#endif
  }
  return false;
}

/// The fastest path this CPU and this build can run.
[[nodiscard]] inline kernel_path best_kernel_path() noexcept {
  static const kernel_path best = kernel_path_supported(kernel_path::avx512) ? kernel_path::avx512
                                  : kernel_path_supported(kernel_path::avx2)
                                      ? kernel_path::avx2
                                      : kernel_path::portable;
  return best;
}

namespace detail {

// 0: not forced (the best path); else 1 + the forced path.
inline std::atomic<unsigned char> forced_kernel_path{0};

[[nodiscard]] inline kernel_path dispatched_path() noexcept {
  const unsigned char forced = forced_kernel_path.load(std::memory_order_relaxed);
  if (forced != 0) return static_cast<kernel_path>(forced - 1);
  return best_kernel_path();
}

[[nodiscard]] inline bool use_avx2() noexcept {
#if SPECDEC_DISPATCH_AVX2
  return dispatched_path() == kernel_path::avx2;
#else
  return false;
#endif
}

// Kernels with no AVX-512 build of their own run their AVX2 build on the AVX-512 path too:
// as 512-bit code they measured no faster, and their fused screens slower (comparisons
// become mask registers that must be turned back into vectors; docs/performance.md).
[[nodiscard]] inline bool use_avx2_build() noexcept {
#if SPECDEC_DISPATCH_AVX2
  const kernel_path path = dispatched_path();
  return path == kernel_path::avx2 || path == kernel_path::avx512;
#else
  return false;
#endif
}

[[nodiscard]] inline bool use_avx512() noexcept {
#if SPECDEC_DISPATCH_AVX512
  return dispatched_path() == kernel_path::avx512;
#else
  return false;
#endif
}

/// The cache line the prefetch hints are issued per, in bytes (x86-64, ARMv8 cores).
inline constexpr std::size_t cache_line = 64;
/// How far ahead of a streaming pass prefetch_ahead asks for the row: 4 KiB, 64 cache lines.
inline constexpr std::uintptr_t prefetch_distance = 64 * cache_line;

/// Asks for the cache line `offset` bytes after entry `index` of `row` (a hint, as
/// prefetch_ahead; offset 0: the entry's own line, for scattered reads whose positions are
/// known ahead, such as top-p's sample).
template <bool for_write = false, class T>
SPECDEC_KERNEL_INLINE void prefetch_entry(const T* row, std::size_t index,
                                          std::uintptr_t offset = 0) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(row) + index * sizeof(T) + offset;
  __builtin_prefetch(reinterpret_cast<const void*>(address), for_write ? 1 : 0, 3);
#else
  static_cast<void>(row);
  static_cast<void>(index);
  static_cast<void>(offset);
#endif
}

/// Asks for the cache line prefetch_distance bytes after entry `index` of `row` (`for_write`:
/// the pass will store there). The passes that do more work per entry than a plain read
/// (top-p's band and writing passes, the screens that sum, the tempered weights) issued
/// their reads too slowly for the hardware prefetcher to keep the row ahead of them; the
/// lighter passes at T = 1 measured no faster with it and do without (docs/performance.md,
/// "Passes that ask for their rows ahead"). A hint only: it changes no result and never
/// faults, also past a row's end, where the address is formed as an integer, never as a
/// pointer into or past the row.
template <bool for_write = false, class T>
SPECDEC_KERNEL_INLINE void prefetch_ahead(const T* row, std::size_t index) noexcept {
  prefetch_entry<for_write>(row, index, prefetch_distance);
}

}  // namespace detail

/// The path the kernels take now: the forced one, else best_kernel_path().
[[nodiscard]] inline kernel_path active_kernel_path() noexcept {
  return detail::dispatched_path();
}

/// Pins the kernels of the whole process to `path` and returns the path that was active.
/// Every path computes the same results, so this is safe while other threads decode; it is
/// meant for tests and benchmarks. Throws specdec::error (errc::invalid_option) if this CPU
/// or build cannot run `path` (nothing changes then).
inline kernel_path force_kernel_path(kernel_path path) {
  if (!kernel_path_supported(path)) {
    detail::throw_error(errc::invalid_option, "kernel path ", to_string(path),
                        " is not supported by this CPU or build");
  }
  const kernel_path before = active_kernel_path();
  detail::forced_kernel_path.store(static_cast<unsigned char>(1 + static_cast<unsigned>(path)),
                                   std::memory_order_relaxed);
  return before;
}

/// Undoes force_kernel_path: the kernels take best_kernel_path() again.
inline void reset_kernel_path() noexcept {
  detail::forced_kernel_path.store(0, std::memory_order_relaxed);
}

}  // namespace specdec
