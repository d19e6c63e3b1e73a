// specdec — RowsView: a light, non-owning view of probability rows stored row-major.
//
// Verification takes its target rows p_1..p_{gamma+1} and draft rows q_1..q_gamma as
// RowsView. Any contiguous buffer works (V given explicitly); Eigen row-major matrices
// convert through `as_rows` in concepts.hpp.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include "specdec/config.hpp"

namespace specdec {

/// Row-major view of `rows()` rows of `cols()` entries; row i starts at
/// `data() + i * row_stride()`. `T` is `float`, `double` or a const version of them.
/// The view never owns memory; the buffer must outlive it.
template <class T>
  requires std::is_floating_point_v<std::remove_const_t<T>>
class RowsView {
 public:
  using element_type = T;
  using value_type = std::remove_const_t<T>;

  constexpr RowsView() noexcept = default;

  /// `row_stride` defaults to `cols` (densely packed rows).
  constexpr RowsView(T* data, std::size_t rows, std::size_t cols) noexcept
      : RowsView(data, rows, cols, cols) {}

  constexpr RowsView(T* data, std::size_t rows, std::size_t cols, std::size_t row_stride) noexcept
      : data_(data), rows_(rows), cols_(cols), row_stride_(row_stride) {
    SPECDEC_ASSERT(row_stride >= cols);
    SPECDEC_ASSERT(data != nullptr || rows == 0 || cols == 0);
  }

  /// A view of a single row.
  constexpr explicit RowsView(std::span<T> row) noexcept
      : RowsView(row.data(), 1, row.size(), row.size()) {}

  /// Views of non-const rows convert to views of const rows.
  template <class U>
    requires(std::is_const_v<T> && std::is_same_v<U, value_type>)
  constexpr RowsView(const RowsView<U>& other) noexcept  // NOLINT(google-explicit-constructor)
      : data_(other.data()), rows_(other.rows()), cols_(other.cols()),
        row_stride_(other.row_stride()) {}

  [[nodiscard]] constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] constexpr std::size_t rows() const noexcept { return rows_; }
  [[nodiscard]] constexpr std::size_t cols() const noexcept { return cols_; }
  [[nodiscard]] constexpr std::size_t row_stride() const noexcept { return row_stride_; }
  [[nodiscard]] constexpr bool empty() const noexcept { return rows_ == 0; }

  /// Row `i` as a span of `cols()` entries. Precondition: i < rows().
  [[nodiscard]] constexpr std::span<T> row(std::size_t i) const noexcept {
    SPECDEC_ASSERT(i < rows_);
    return {data_ + i * row_stride_, cols_};
  }

  /// Entry (i, j). Precondition: i < rows(), j < cols().
  [[nodiscard]] constexpr T& operator()(std::size_t i, std::size_t j) const noexcept {
    SPECDEC_ASSERT(i < rows_ && j < cols_);
    return data_[i * row_stride_ + j];
  }

  /// Rows [first, first + count). Precondition: first + count <= rows().
  [[nodiscard]] constexpr RowsView subrows(std::size_t first, std::size_t count) const noexcept {
    SPECDEC_ASSERT(first + count <= rows_);
    return RowsView(data_ + first * row_stride_, count, cols_, row_stride_);
  }

 private:
  T* data_ = nullptr;
  std::size_t rows_ = 0;
  std::size_t cols_ = 0;
  std::size_t row_stride_ = 0;
};

template <class T>
RowsView(T*, std::size_t, std::size_t) -> RowsView<T>;
template <class T>
RowsView(T*, std::size_t, std::size_t, std::size_t) -> RowsView<T>;

}  // namespace specdec
