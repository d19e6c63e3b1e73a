// specdec — umbrella header: includes every public header, nothing else.
#pragma once

#include "specdec/analysis.hpp"                // IWYU pragma: export
#include "specdec/batch_decoder.hpp"           // IWYU pragma: export
#include "specdec/batch_gamma.hpp"             // IWYU pragma: export
#include "specdec/batch_verification.hpp"      // IWYU pragma: export
#include "specdec/cached_context.hpp"          // IWYU pragma: export
#include "specdec/concepts.hpp"                // IWYU pragma: export
#include "specdec/config.hpp"                  // IWYU pragma: export
#include "specdec/draft_tree.hpp"              // IWYU pragma: export
#include "specdec/drafters/count_models.hpp"   // IWYU pragma: export
#include "specdec/drafters/ngram.hpp"          // IWYU pragma: export
#include "specdec/drafters/prompt_lookup.hpp"  // IWYU pragma: export
#include "specdec/error.hpp"                   // IWYU pragma: export
#include "specdec/executor.hpp"                // IWYU pragma: export
#include "specdec/gamma_policy.hpp"            // IWYU pragma: export
#include "specdec/greedy_verification.hpp"     // IWYU pragma: export
#include "specdec/kernel_path.hpp"             // IWYU pragma: export
#include "specdec/random.hpp"                  // IWYU pragma: export
#include "specdec/residual_distribution.hpp"   // IWYU pragma: export
#include "specdec/rows.hpp"                    // IWYU pragma: export
#include "specdec/sampling.hpp"                // IWYU pragma: export
#include "specdec/speculative_decoder.hpp"     // IWYU pragma: export
#include "specdec/speculative_sampling.hpp"    // IWYU pragma: export
#include "specdec/statistics.hpp"              // IWYU pragma: export
#include "specdec/stop_conditions.hpp"         // IWYU pragma: export
#include "specdec/tree_verification.hpp"       // IWYU pragma: export
#include "specdec/validation.hpp"              // IWYU pragma: export
#include "specdec/verification_result.hpp"     // IWYU pragma: export
