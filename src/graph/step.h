// One training step as an event trace: model + recipe + GPU → Trace (see tape.h).
#pragma once

#include "graph/tape.h"

namespace trainmem::graph {

Trace build_training_trace(const Model& model, const Recipe& recipe, const Gpu& gpu);

}  // namespace trainmem::graph
