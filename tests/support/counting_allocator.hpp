// Counting replacements of the global operator new / delete, for the "no allocation per
// step" tests and the allocs_per_step benchmark counter: deterministic, unlike timing.
//
//   #include "support/counting_allocator.hpp"   // in exactly ONE translation unit
//   ...
//   specdec::testing::AllocationCounter counter;   // counts from here
//   run_steps();
//   CHECK(counter.count() == 0);
//
// The header defines the replacement functions themselves, so a program includes it in
// one translation unit only (every test and benchmark here is a single file).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

namespace specdec::testing {

/// Allocations seen while counting is on (see AllocationCounter).
inline std::size_t allocation_count = 0;
inline bool counting_allocations = false;

/// Counts the heap allocations made during its lifetime. Not nestable.
class AllocationCounter {
 public:
  AllocationCounter() noexcept {
    allocation_count = 0;
    counting_allocations = true;
  }
  ~AllocationCounter() { counting_allocations = false; }
  AllocationCounter(const AllocationCounter&) = delete;
  AllocationCounter& operator=(const AllocationCounter&) = delete;
  AllocationCounter(AllocationCounter&&) = delete;
  AllocationCounter& operator=(AllocationCounter&&) = delete;

  /// Allocations so far (counting goes on).
  [[nodiscard]] std::size_t count() const noexcept { return allocation_count; }
  /// Stops counting and returns the total.
  std::size_t stop() noexcept {
    counting_allocations = false;
    return allocation_count;
  }
};

namespace detail {

inline void* counted_allocation(std::size_t size) {
  if (counting_allocations) ++allocation_count;
  void* memory = std::malloc(size == 0 ? 1 : size);
  if (memory == nullptr) throw std::bad_alloc();
  return memory;
}

inline void* counted_aligned_allocation(std::size_t size, std::align_val_t alignment) {
  if (counting_allocations) ++allocation_count;
  const auto align = static_cast<std::size_t>(alignment);
  const std::size_t rounded = (size + align - 1) / align * align;
  void* memory = std::aligned_alloc(align, rounded == 0 ? align : rounded);
  if (memory == nullptr) throw std::bad_alloc();
  return memory;
}

}  // namespace detail
}  // namespace specdec::testing

// Out of line (noinline), so that GCC does not pair an inlined malloc/free with the
// new/delete calls it sees elsewhere.
[[gnu::noinline]] void* operator new(std::size_t size) {
  return specdec::testing::detail::counted_allocation(size);
}
[[gnu::noinline]] void* operator new[](std::size_t size) {
  return specdec::testing::detail::counted_allocation(size);
}
[[gnu::noinline]] void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return specdec::testing::detail::counted_allocation(size);
  } catch (...) {
    return nullptr;
  }
}
[[gnu::noinline]] void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return specdec::testing::detail::counted_allocation(size);
  } catch (...) {
    return nullptr;
  }
}
[[gnu::noinline]] void* operator new(std::size_t size, std::align_val_t alignment) {
  return specdec::testing::detail::counted_aligned_allocation(size, alignment);
}
[[gnu::noinline]] void* operator new[](std::size_t size, std::align_val_t alignment) {
  return specdec::testing::detail::counted_aligned_allocation(size, alignment);
}
[[gnu::noinline]] void operator delete(void* memory) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete[](void* memory) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete(void* memory, std::size_t) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete[](void* memory, std::size_t) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete(void* memory, std::align_val_t) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete[](void* memory, std::align_val_t) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete(void* memory, std::size_t, std::align_val_t) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete[](void* memory, std::size_t, std::align_val_t) noexcept {
  std::free(memory);
}
