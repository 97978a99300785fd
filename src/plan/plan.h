// Internals of the planner that tests look at.
#pragma once

#include "trainmem/trainmem.h"

namespace trainmem::plan {

// Bytes alive together when step 2's optimizer step starts (weights, fp32 masters, every
// parameter's gradient, optimizer states): the peak of a two-step estimate is never below it.
std::uint64_t persistent_floor(const Model& m, const Recipe& r);

}  // namespace trainmem::plan
