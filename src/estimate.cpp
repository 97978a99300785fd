// trainmem::estimate: model → op graph (graph/) → allocator replay (sim/), every layer replayed
// (Note [Estimates are not extrapolated over layers] in model/depth.cpp says why). The replay
// follows the graph stage micro-batch by micro-batch, so repeated micro-batches are skipped
// (Note [Repeated micro-batches] in sim/simulator.cpp).
#include <stdexcept>
#include <string>

#include "graph/step.h"
#include "sim/simulator.h"

namespace trainmem {
namespace {

Estimate run(const Model& model, const Recipe& resolved, const Gpu& gpu, const EstimateOptions& options) {
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
  graph::recycle(std::move(trace));
  return est;
}

}  // namespace

Estimate estimate(const Model& model, const Recipe& recipe, const EstimateOptions& options) {
  recipe.validate();
  const Gpu& gpu = find_gpu(recipe.gpu);
  Recipe resolved = recipe;
  if (resolved.lora.enabled()) resolved.lora.targets = resolve_lora_targets(model.arch, recipe.lora.targets);
  // The allocator model places blocks in a 2^63-byte address space; a step that outgrows it is
  // bad input (absurd sizes), reported as such rather than as an allocator detail.
  try {
    return run(model, resolved, gpu, options);
  } catch (const std::overflow_error& e) {
    throw Error(std::string("the step needs more memory than trainmem models (2^63 bytes): ") + e.what());
  }
}

}  // namespace trainmem
