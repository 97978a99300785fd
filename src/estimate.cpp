// trainmem::estimate: model → op graph (graph/) → allocator replay (sim/), every layer replayed
// (Note [Estimates are not extrapolated over layers] in model/depth.cpp says why).
#include "graph/step.h"
#include "sim/simulator.h"

namespace trainmem {

Estimate estimate(const Model& model, const Recipe& recipe, const EstimateOptions& options) {
  recipe.validate();
  const Gpu& gpu = find_gpu(recipe.gpu);
  graph::Trace trace = graph::build_training_trace(model, recipe, gpu);
  Estimate est = sim::simulate(trace, recipe, options);
  est.model = model.name;
  est.parameters = model.parameter_count;
  est.trainable_parameters = model.parameter_count;
  est.gpu = gpu;
  return est;
}

}  // namespace trainmem
