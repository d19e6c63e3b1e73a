// specdec — configuration macros shared by every header.
//
// SPECDEC_ASSERT(cond) checks the documented preconditions of the unchecked fast paths.
// It is active unless NDEBUG is defined. Define SPECDEC_ASSERT yourself before including
// any specdec header to route failures elsewhere (for example into your engine's logger).
#pragma once

#include <cstdio>
#include <cstdlib>

namespace specdec::detail {

[[noreturn]] inline void assertion_failed(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "specdec: assertion failed: %s (%s:%d)\n", condition, file, line);
  std::abort();
}

}  // namespace specdec::detail

#ifndef SPECDEC_ASSERT
#ifdef NDEBUG
#define SPECDEC_ASSERT(condition) static_cast<void>(0)
#else
#define SPECDEC_ASSERT(condition) \
  ((condition) ? static_cast<void>(0)  \
               : ::specdec::detail::assertion_failed(#condition, __FILE__, __LINE__))
#endif
#endif
