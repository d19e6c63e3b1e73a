// specdec — the exception type thrown by validating entry points.
//
// Every error names what was wrong and where (model, step, row, position). The unchecked
// fast paths never throw; they document preconditions and check them with SPECDEC_ASSERT.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace specdec {

/// What kind of problem an `error` reports. Stable numbering: the values may be logged.
enum class errc : int {
  invalid_size = 1,         ///< a row, matrix or buffer has the wrong length or count
  invalid_token = 2,        ///< a token id outside [0, vocab_size)
  invalid_probability = 3,  ///< a NaN, infinite or negative entry
  zero_mass = 4,            ///< a row whose entries sum to zero
  not_normalized = 5,       ///< a row whose sum is off 1 by more than the tolerance
  vocab_mismatch = 6,       ///< target and draft disagree on the vocabulary size
  domain = 7,               ///< a math argument outside its domain (alpha, c, gamma, lenience)
  invalid_option = 8,       ///< a configuration value outside its documented range
  model_failure = 9,        ///< a user model threw from inside a step
};

/// Short stable name of an error code ("invalid_size", ...).
[[nodiscard]] constexpr std::string_view to_string(errc code) noexcept {
  switch (code) {
    case errc::invalid_size:
      return "invalid_size";
    case errc::invalid_token:
      return "invalid_token";
    case errc::invalid_probability:
      return "invalid_probability";
    case errc::zero_mass:
      return "zero_mass";
    case errc::not_normalized:
      return "not_normalized";
    case errc::vocab_mismatch:
      return "vocab_mismatch";
    case errc::domain:
      return "domain";
    case errc::invalid_option:
      return "invalid_option";
    case errc::model_failure:
      return "model_failure";
  }
  return "unknown";
}

/// The one exception type of the library. `what()` reads
/// "specdec: <code>: <message>", e.g.
/// "specdec: invalid_probability: target row 2, token 17: probability is NaN".
class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message)
      : std::runtime_error(compose(code, message)), code_(code) {}

  [[nodiscard]] errc code() const noexcept { return code_; }

 private:
  static std::string compose(errc code, const std::string& message) {
    std::string text = "specdec: ";
    text += to_string(code);
    text += ": ";
    text += message;
    return text;
  }

  errc code_;
};

namespace detail {

/// A message part as throw_error streams it: character arrays (string literals) as
/// string_views, so that literals of different lengths share one instantiation of the
/// message builder; anything else as it is.
template <class Part>
[[nodiscard]] decltype(auto) message_part(const Part& part) noexcept {
  if constexpr (std::is_array_v<Part>) {
    return std::string_view(part);
  } else {
    return (part);
  }
}

/// throw_error's message builder, for parts whose arrays are already views.
template <class... Parts>
[[noreturn]] void throw_error_from_parts(errc code, const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw error(code, message.str());
}

/// Builds the message from streamable parts and throws `specdec::error`.
template <class... Parts>
[[noreturn]] void throw_error(errc code, const Parts&... parts) {
  throw_error_from_parts(code, message_part(parts)...);
}

/// The message of a specdec::error without the "specdec: <code>: " prefix error adds.
[[nodiscard]] inline std::string bare_message(const error& e) {
  const std::string_view text = e.what();
  std::string prefix = "specdec: ";
  prefix += to_string(e.code());
  prefix += ": ";
  if (text.substr(0, prefix.size()) == prefix) return std::string(text.substr(prefix.size()));
  return std::string(text);
}

}  // namespace detail
}  // namespace specdec
