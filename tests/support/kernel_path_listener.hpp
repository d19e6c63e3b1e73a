// A Catch2 listener that pins specdec's kernel path (kernel_path.hpp) for the whole test
// run when the environment variable SPECDEC_KERNEL_PATH names one ("portable", "avx2" or
// "avx512"). tests/CMakeLists.txt runs the test programs that include this header with the
// best path (the default), again with SPECDEC_KERNEL_PATH=portable, and, on a machine with
// AVX-512 (where the best path is AVX-512), a third time with SPECDEC_KERNEL_PATH=avx2, so
// every path the machine has passes every exactness test in them. A path this CPU cannot
// run, or a name that is none of these, fails the run (never a silent skip).
#pragma once

#include <catch2/interfaces/catch_interfaces_reporter.hpp>
#include <catch2/reporters/catch_reporter_event_listener.hpp>
#include <catch2/reporters/catch_reporter_registrars.hpp>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "specdec/kernel_path.hpp"

namespace specdec::testing {

class KernelPathListener : public Catch::EventListenerBase {
 public:
  using Catch::EventListenerBase::EventListenerBase;

  void testRunStarting(const Catch::TestRunInfo& /*info*/) override {
    const char* requested = std::getenv("SPECDEC_KERNEL_PATH");
    if (requested == nullptr || *requested == '\0') return;  // unset or empty: the best path
    const std::string_view name(requested);
    for (const auto path : {specdec::kernel_path::portable, specdec::kernel_path::avx2,
                            specdec::kernel_path::avx512}) {
      if (name == specdec::to_string(path)) {
        // Throws specdec::error when the CPU lacks the path: the run fails.
        specdec::force_kernel_path(path);
        return;
      }
    }
    throw std::invalid_argument("SPECDEC_KERNEL_PATH=" + std::string(name) +
                                " names no kernel path (portable, avx2, avx512)");
  }
};

}  // namespace specdec::testing

CATCH_REGISTER_LISTENER(specdec::testing::KernelPathListener)
