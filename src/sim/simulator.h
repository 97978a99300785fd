// Replays a graph::Trace through the caching-allocator model and accounts every byte to its
// category: peak allocated and reserved bytes, the breakdown at the peak, where it happened.
#pragma once

#include "graph/tape.h"

namespace trainmem::sim {

Estimate simulate(const graph::Trace& trace, const Recipe& recipe, const EstimateOptions& options);

}  // namespace trainmem::sim
