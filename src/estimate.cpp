// trainmem::estimate: model → op graph (graph/) → allocator replay (sim/), every layer replayed
// (Note [Estimates are not extrapolated over layers] in model/depth.cpp says why).
#include "graph/step.h"
#include "sim/simulator.h"

namespace trainmem {

Estimate estimate(const Model& model, const Recipe& recipe, const EstimateOptions& options) {
  recipe.validate();
  const Gpu& gpu = find_gpu(recipe.gpu);
  Recipe resolved = recipe;
  if (resolved.lora.enabled()) resolved.lora.targets = resolve_lora_targets(model.arch, recipe.lora.targets);
  sim::Replay replay(resolved, options);
  graph::Trace trace = graph::build_training_trace(
      model, resolved, gpu, [&replay](const graph::Trace& t, std::uint32_t step, std::uint32_t micro) {
        return replay.micro_batch_done(t, step, micro);
      });
  Estimate est = replay.finish(trace);
  est.model = model.name;
  est.parameters = model.parameter_count;
  est.trainable_parameters = trace.trainable_parameters;
  est.gpu = gpu;
  return est;
}

}  // namespace trainmem
