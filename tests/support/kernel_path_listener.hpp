// A Catch2 listener that pins specdec's kernel path (kernel_path.hpp) for the whole test
// run when the environment variable SPECDEC_KERNEL_PATH names one ("portable" or "avx2").
// tests/CMakeLists.txt runs the test programs that include this header twice: with the
// best path (the default) and with SPECDEC_KERNEL_PATH=portable, so both paths pass every
// exactness test in them. A path this CPU cannot run fails the run (never a silent skip).
#pragma once

#include <catch2/interfaces/catch_interfaces_reporter.hpp>
#include <catch2/reporters/catch_reporter_event_listener.hpp>
#include <catch2/reporters/catch_reporter_registrars.hpp>
#include <cstdlib>
#include <string_view>

#include "specdec/kernel_path.hpp"

namespace specdec::testing {

class KernelPathListener : public Catch::EventListenerBase {
 public:
  using Catch::EventListenerBase::EventListenerBase;

  void testRunStarting(const Catch::TestRunInfo& /*info*/) override {
    const char* requested = std::getenv("SPECDEC_KERNEL_PATH");
    if (requested == nullptr) return;
    const std::string_view name(requested);
    // Throws specdec::error when the CPU lacks the path: the run fails.
    specdec::force_kernel_path(name == "avx2" ? specdec::kernel_path::avx2
                                              : specdec::kernel_path::portable);
  }
};

}  // namespace specdec::testing

CATCH_REGISTER_LISTENER(specdec::testing::KernelPathListener)
