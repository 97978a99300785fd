// Internals of the planner that tests look at.
#pragma once

#include "trainmem/trainmem.h"

namespace trainmem::plan {

// Bytes that stay allocated from the optimizer's first step on (weights, fp32 masters,
// optimizer states): the peak of a two-step estimate is never below it.
std::uint64_t persistent_floor(const Model& m, const Recipe& r);

}  // namespace trainmem::plan
