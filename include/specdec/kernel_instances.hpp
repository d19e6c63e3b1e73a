// specdec — the row kernels compiled once for a whole program (optional).
//
// specdec is header-only, so every translation unit that standardizes, verifies or draws
// from rows compiles the row kernels it uses (kernel_path.hpp: the tempered weights and
// softmax, top-k's and top-p's passes, the mass tables of the draws, the maximum scans and
// the decoder's row screens, each in its portable, AVX2 and AVX-512 builds) for the row
// types it uses: seconds of compile time per unit with GCC, more with sanitizers. A program
// with many such units can compile them once instead:
//
//   1. define SPECDEC_EXTERN_KERNELS=1 in every translation unit of the program (before any
//      specdec header): the kernel headers then declare their dispatchers' instances for
//      float and double rows `extern template`, and no unit compiles them;
//   2. include this header in exactly one source file of the program: it defines those
//      instances (explicit instantiations).
//
// In a CMake build that adds specdec with add_subdirectory, linking the target
// specdec::kernels does both. Results are bitwise the same either way (the kernels are
// written to be, whatever the flags of the unit that compiles them); only the unit that
// includes this header decides the portable path's instruction set. Kernels of other
// instances (a user's own mass-table source, hook or row type) are still compiled where they
// are used.
#pragma once

#include "specdec/detail/decoder_kernels.hpp"
#include "specdec/detail/row_kernels.hpp"
#include "specdec/detail/sampling_kernels.hpp"
#include "specdec/detail/vector_math.hpp"
#include "specdec/draft_stage.hpp"

namespace specdec::detail {

SPECDEC_ROW_KERNEL_INSTANCES()
SPECDEC_VECTOR_MATH_INSTANCES()
SPECDEC_SAMPLING_INSTANCES()
SPECDEC_DECODER_KERNEL_INSTANCES()

}  // namespace specdec::detail

namespace specdec {

SPECDEC_DRAFT_STAGE_INSTANCES()

}  // namespace specdec
