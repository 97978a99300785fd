// Internals of trainmem::estimate that the planner shares (Note [The worst rank] in estimate.cpp):
// which ranks an estimate replays and which of them it reports, so that plan/fit.cpp can replay a
// pipeline's stages on several threads and still pick the rank estimate() would.
#pragma once

#include <cstdint>
#include <vector>

#include "trainmem/trainmem.h"

namespace trainmem::detail {

// The ranks estimate() replays when no rank is asked for, in the order it replays them: rank 0
// alone where every rank allocates the same, every rank under ZeRO-1/2, each stage's data-parallel
// rank 0 for a pipeline.
std::vector<std::uint64_t> replayed_ranks(const Recipe& r);

// Whether rank estimate `a` needs more memory than `b`: more reserved bytes at its peak, then more
// allocated bytes. Of equals the one replayed first is reported; after a rank that stopped above
// the stop limit no other rank is replayed.
bool worse_rank(const Estimate& a, const Estimate& b);

}  // namespace trainmem::detail
