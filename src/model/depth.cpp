// with_layers: the same model cut (or grown) to another depth. The corpus's reduced-depth
// variants and bench/depth_study.cpp use it.
#include "model/model.h"

namespace trainmem::model {

// Note [Estimates are not extrapolated over layers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every decoder layer repeats the same ops, so a tempting shortcut is to simulate models cut to
// k, k+1 and k+2 layers, check that every number has zero second difference, and extrapolate
// linearly to the real depth. For the caching-allocator replay that is not exact, and no check on
// a few cut models can make it so:
//  * Reserved bytes grow as a staircase. Tensors of 1 MiB or less share 2 MiB small-pool segments
//    (and large requests under 10 MiB share 20 MiB segments), so a new segment opens every few
//    layers. llama-3.1-70b at seq 4096 with the default recipe: peak reserved bytes grow by
//    19,719,520,256 B, then 19,585,302,528 B, then 19,717,423,104 B, 19,719,520,256 B,
//    19,717,423,104 B, ... per added layer. Three depths can sit on one tread and pass the check.
//  * Fragmentation changes with depth. Best fit searches the holes left by every earlier layer;
//    which block it takes, and whether the remainder is split off (which changes allocated bytes
//    too, Note [Caching allocator replay]), changes as the holes multiply.
//  * The peak is a maximum over moments that grow at different rates, so the moment that peaks in
//    a 4-layer model can be overtaken at depth. mistral-7b-v0.3, fp32, full checkpointing, eager,
//    expandable, cpu, seq 4096: up to 6 layers the peak is in the backward of layer 0 (3.49 GB per
//    layer), from 7 layers on it is optimizer.foreach_sqrt (4.36 GB per layer).
// At the time of writing, over the 15 catalog models × 288 recipes at seq 128, 1024 and 4096
// (12,960 estimates), the check above with k = 2, then 4, then 8, accepted 1,703 extrapolations
// that were wrong (by up to 39.5% of peak allocated and 37.4% of peak reserved) and 2 that were
// right. Even asking all nine depths 2..10 to lie on one line let 23 wrong ones through (up to
// 15.1% of reserved). bench/depth_study.cpp is the program, bench/README.md the table.
// Extrapolation would be exact only if the allocator's state were shown to repeat from layer to
// layer, and samples of its outputs cannot show that. So trainmem::estimate replays every layer.

Model with_layers(const Model& model, std::uint64_t layers) {
  if (layers == 0) throw Error("layers: must be at least 1, got 0");
  Model cut = model;
  cut.arch.num_layers = layers;
  // As a config of that depth lists them (the corpus's cut configs truncate layer_types).
  if (layers < cut.arch.sliding_layer_types.size()) cut.arch.sliding_layer_types.resize(layers);
  cut.parameters = parameter_groups(cut.arch);
  cut.parameter_count = count_parameters(cut.parameters);
  cut.from_safetensors = false;  // the count is the architecture's now, not the checkpoint's
  return cut;
}

}  // namespace trainmem::model
