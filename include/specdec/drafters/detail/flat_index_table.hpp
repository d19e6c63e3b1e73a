// specdec — a fixed-capacity open-addressing table of record indices, used by the n-gram
// drafter so that its memory is reserved once and never grows while decoding.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "specdec/config.hpp"

namespace specdec::detail {

/// SplitMix64's finaliser: a cheap, well-mixing 64-bit bijection used for context hashes.
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x ^= x >> 30U;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27U;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31U;
  return x;
}

/// Maps 64-bit hashes to 32-bit indices of records the caller owns (linear probing,
/// backward-shift deletion, so there are no tombstones and probe lengths never degrade).
/// The capacity is a power of two of at least twice `max_entries`, fixed at construction;
/// the caller guarantees that it never holds more than `max_entries` indices, so the load
/// factor stays <= 1/2. Several indices may share a hash: `find` asks the caller which one
/// it wants.
class FlatIndexTable {
 public:
  static constexpr std::uint32_t npos = 0xffffffffU;

  FlatIndexTable() = default;

  explicit FlatIndexTable(std::size_t max_entries)
      : slots_(std::bit_ceil(std::max<std::size_t>(2 * max_entries, 8))),
        mask_(slots_.size() - 1) {}

  /// The first index stored under `hash` for which `matches(index)` is true, else npos.
  template <class Matches>
  [[nodiscard]] std::uint32_t find(std::uint64_t hash, Matches&& matches) const {
    for (std::size_t i = home(hash);; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.index == npos) return npos;
      if (slot.hash == hash && matches(slot.index)) return slot.index;
    }
  }

  /// Stores `index` under `hash`. Precondition: size() < max entries (load <= 1/2).
  void insert(std::uint64_t hash, std::uint32_t index) noexcept {
    SPECDEC_ASSERT(2 * (size_ + 1) <= slots_.size());
    std::size_t i = home(hash);
    while (slots_[i].index != npos) i = (i + 1) & mask_;
    slots_[i] = {hash, index};
    ++size_;
  }

  /// Removes `index`, stored under `hash`. Precondition: it is present.
  void erase(std::uint64_t hash, std::uint32_t index) noexcept {
    std::size_t hole = home(hash);
    while (slots_[hole].index != index) {
      SPECDEC_ASSERT(slots_[hole].index != npos);
      hole = (hole + 1) & mask_;
    }
    // Backward shift: move later entries of the probe run into the hole when their home
    // slot does not lie cyclically in (hole, next].
    for (std::size_t next = (hole + 1) & mask_; slots_[next].index != npos;
         next = (next + 1) & mask_) {
      const std::size_t next_home = home(slots_[next].hash);
      if (((next - next_home) & mask_) >= ((next - hole) & mask_)) {
        slots_[hole] = slots_[next];
        hole = next;
      }
    }
    slots_[hole] = Slot{};
    --size_;
  }

  void clear() noexcept {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    size_ = 0;
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return slots_.size(); }
  [[nodiscard]] std::size_t memory_bytes() const noexcept {
    return slots_.capacity() * sizeof(Slot);
  }

 private:
  struct Slot {
    std::uint64_t hash = 0;
    std::uint32_t index = npos;
  };

  [[nodiscard]] std::size_t home(std::uint64_t hash) const noexcept {
    return static_cast<std::size_t>(hash) & mask_;
  }

  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

}  // namespace specdec::detail
