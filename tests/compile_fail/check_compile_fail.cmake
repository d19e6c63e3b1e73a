# Runs the compiler on SOURCE and succeeds only if compilation fails AND the diagnostics
# match EXPECTED (a regular expression). Invoked by ctest, see tests/CMakeLists.txt.
set(args -std=c++20 -fsyntax-only)
foreach(dir IN LISTS INCLUDES)
  list(APPEND args "-I${dir}")
endforeach()
execute_process(
  COMMAND "${COMPILER}" ${args} "${SOURCE}"
  RESULT_VARIABLE result
  OUTPUT_VARIABLE output
  ERROR_VARIABLE output)
if(result EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it must be rejected")
endif()
if(NOT output MATCHES "${EXPECTED}")
  message(FATAL_ERROR "${SOURCE} was rejected without the expected diagnostic "
                      "'${EXPECTED}'. Compiler output:\n${output}")
endif()
message(STATUS "rejected with the expected diagnostic '${EXPECTED}'")
