// Test support: an array whose entries are followed by inaccessible memory (guard pages).
//
// Laziness tests ("rows after the first rejection are never read", "the scan stops at the
// first witness") put the entries a function may read in front of the guard and pass sizes
// that reach into it: reading an entry the function must not read then crashes the test
// (SIGSEGV) in every build, not only under AddressSanitizer, and a test whose function
// reads too far cannot pass. On systems without mmap the array is ordinary heap memory and
// `GuardedArray::enforced` is false (the test then checks results only).
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>
#include <span>
#include <stdexcept>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define SPECDEC_TEST_GUARD_PAGES 1
#else
#define SPECDEC_TEST_GUARD_PAGES 0
#endif

namespace specdec::testing {

/// `readable` value-initialised entries of T, immediately followed by at least `guarded`
/// entries' worth of memory that cannot be read or written.
template <class T>
class GuardedArray {
 public:
  static constexpr bool enforced = SPECDEC_TEST_GUARD_PAGES != 0;

  GuardedArray(std::size_t readable, std::size_t guarded) : readable_(readable) {
#if SPECDEC_TEST_GUARD_PAGES
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const auto pages_for = [page](std::size_t bytes) { return (bytes + page - 1) / page; };
    const std::size_t front_pages = std::max<std::size_t>(1, pages_for(readable * sizeof(T)));
    const std::size_t guard_pages = std::max<std::size_t>(1, pages_for(guarded * sizeof(T)));
    bytes_ = (front_pages + guard_pages) * page;
    void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<unsigned char*>(base);
    if (mprotect(base_ + front_pages * page, guard_pages * page, PROT_NONE) != 0) {
      munmap(base_, bytes_);
      throw std::runtime_error("GuardedArray: mprotect failed");
    }
    data_ = reinterpret_cast<T*>(base_ + front_pages * page) - readable;
#else
    base_ = new unsigned char[(readable + guarded) * sizeof(T) + alignof(T)];
    data_ = reinterpret_cast<T*>(base_);
#endif
    std::fill(data_, data_ + readable, T{});
  }

  GuardedArray(const GuardedArray&) = delete;
  GuardedArray& operator=(const GuardedArray&) = delete;

  ~GuardedArray() {
#if SPECDEC_TEST_GUARD_PAGES
    munmap(base_, bytes_);
#else
    delete[] base_;
#endif
  }

  /// The first readable entry; data() + readable() is the first guarded one.
  [[nodiscard]] T* data() noexcept {
    return data_;
  }
  [[nodiscard]] const T* data() const noexcept {
    return data_;
  }
  [[nodiscard]] std::size_t readable() const noexcept {
    return readable_;
  }
  [[nodiscard]] std::span<T> readable_span() noexcept {
    return {data_, readable_};
  }
  T& operator[](std::size_t i) noexcept {
    return data_[i];
  }

 private:
  unsigned char* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t readable_ = 0;
  T* data_ = nullptr;
};

}  // namespace specdec::testing
