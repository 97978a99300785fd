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

// `recipe` as estimate() builds it for `model`: its LoRA targets resolved to the model's module
// paths, Gemma-2's attention to eager (Note [Gemma-2's attention] in estimate.cpp).
Recipe resolved_for_model(const Model& model, Recipe recipe);

// The most bytes the live tensors of `rank`'s trace request at once, each rounded up to 512 B as
// the caching allocator rounds a request (Note [Requested bytes] in estimate.cpp): no allocator
// behind it, so it is a lower bound of the peak allocated bytes, and of the reserved ones, under
// every allocator setting. With `stop_above` > 0 the graph stage stops once they pass it (the
// result is then above it, and no more than the bytes at that moment; `*before_optimizer` says
// whether that came before any optimizer event, as Estimate::stopped_before_optimizer does).
// `recipe` as estimate() takes it.
std::uint64_t peak_requested_bytes(const Model& model, const Recipe& recipe, std::uint64_t rank,
                                   std::uint64_t stop_above = 0, bool* before_optimizer = nullptr);

}  // namespace trainmem::detail
