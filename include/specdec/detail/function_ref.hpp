// specdec — a non-owning reference to a callable, for the per-row callbacks the decoder's
// stages hand to the verify kernels (load row i, give row i's survivors).
//
// The kernels take these callbacks as function_ref rather than as template parameters:
// the callbacks are lambdas local to each decoder type, so a template parameter would
// compile a separate copy of every verify kernel (and the mass-table passes inside it) for
// every decoder a program instantiates. They are called once per row, never per entry, so
// the indirect call costs nothing measurable.
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

namespace specdec::detail {

template <class Signature>
class function_ref;

/// A reference to a callable `R(Args...)` that does not own it: the callable must outlive
/// every call (as a lambda does for the duration of the call it is passed to).
template <class R, class... Args>
class function_ref<R(Args...)> {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, function_ref> &&
           std::is_invocable_r_v<R, F&, Args...>) function_ref(F&& f)
  noexcept  // NOLINT(google-explicit-constructor): a parameter type
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(object))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

/// `load_through(i)`: makes rows 0..i readable (the score stage's lazy loading).
using row_loader = function_ref<void(std::size_t)>;

}  // namespace specdec::detail
