// Shared helper of the tests/errors_*_test.cpp files: one test per row of docs/errors.md.
//
// `check_error(row, call, code, fragment)` runs `call`, requires a specdec::error (or a class
// derived from it) with `code` whose what() contains `fragment`, and returns the exception's
// message. With SPECDEC_ERRORS_DUMP=<file> set in the environment every message is
// appended to that file as "<row>\t<what()>", which is how the messages quoted in
// docs/errors.md were collected.
#pragma once

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>

#include "specdec/error.hpp"

namespace specdec::testing {

inline void dump_error_message(std::string_view row, const std::string& what) {
  const char* path = std::getenv("SPECDEC_ERRORS_DUMP");
  if (path == nullptr || *path == '\0') return;
  std::ofstream out(path, std::ios::app);
  out << row << '\t' << what << '\n';
}

template <class Call>
std::string check_error(std::string_view row, Call&& call, errc code, std::string_view fragment) {
  std::string what;
  bool thrown = false;
  try {
    std::forward<Call>(call)();
  } catch (const error& e) {
    thrown = true;
    what = e.what();
    CHECK(to_string(e.code()) == to_string(code));
  }
  INFO("catalogue row " << row);
  REQUIRE(thrown);
  CHECK_THAT(what, Catch::Matchers::ContainsSubstring(std::string(fragment)));
  CHECK_THAT(what, Catch::Matchers::StartsWith("specdec: " + std::string(to_string(code)) + ": "));
  dump_error_message(row, what);
  return what;
}

}  // namespace specdec::testing
