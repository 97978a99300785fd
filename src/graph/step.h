// One training step as an event trace: model + recipe + GPU → Trace (see tape.h).
#pragma once

#include <functional>

#include "graph/tape.h"

namespace trainmem::graph {

// Called after each micro-batch's backward but the last of a step, with the trace so far.
// Returning true says the remaining micro-batches of the step would repeat the one just built
// exactly (the simulator proves it: Note [Repeated micro-batches] in sim/simulator.cpp); the
// builder then goes straight to the optimizer step.
using MicroBatchHook = std::function<bool(const Trace&, std::uint32_t step, std::uint32_t micro)>;

Trace build_training_trace(const Model& model, const Recipe& recipe, const Gpu& gpu,
                           const MicroBatchHook& hook = {});

}  // namespace trainmem::graph
