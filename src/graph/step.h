// One training step as an event trace: model + recipe + GPU → Trace (see tape.h).
#pragma once

#include <functional>

#include "graph/tape.h"

namespace trainmem::graph {

// Called after each micro-batch's backward with the trace so far; the answer says how to go on:
// kSkipRest (only before a step's last micro-batch): the rest of the step's micro-batches would
// repeat the one just built exactly (the simulator proves it: Note [Repeated micro-batches] in
// sim/simulator.cpp), so the builder goes straight to the optimizer step; kStop: the replay
// needs no more events (it was asked to stop once reserved bytes passed a limit).
enum class MicroBatchNext : std::uint8_t { kGoOn, kSkipRest, kStop };
using MicroBatchHook = std::function<MicroBatchNext(const Trace&, std::uint32_t step, std::uint32_t micro)>;
// `micro` of a call between a pipeline schedule's actions (Note [Peeks inside a schedule] in
// graph/pipeline.cpp): only kGoOn or kStop comes back.
constexpr std::uint32_t kMidSchedule = UINT32_MAX;

// Throws Error where a sequence reaches the model's sliding window under SDPA with context
// parallelism: the materialised mask is not modelled in its ring (Note [Training masks] in
// step.cpp). The planner asks it before it replays such a recipe.
void check_sliding_window(const Model& model, const Recipe& recipe);

// Throws Error for SDPA with attention dropout on the CPU where a reached sliding window hands
// torch's math kernel HF's mask, which is not modelled (Note [Dropout probabilities] in
// model/config.cpp).
void check_attention_dropout(const Model& model, const Recipe& recipe, const Gpu& gpu);

// `rank`: the data-parallel rank whose memory is built (ZeRO's partitions differ by rank; the
// estimate is rank 0's).
Trace build_training_trace(const Model& model, const Recipe& recipe, const Gpu& gpu,
                           const MicroBatchHook& hook = {}, std::uint64_t rank = 0);

// Layer stamping (Note [Stamped decoder layers] in tape.h) on this thread: on unless a test or
// benchmark turns it off to compare with every layer built. The count is of the layers stamped
// on this thread so far.
void set_layer_stamping(bool on);
bool layer_stamping();
std::uint64_t stamped_layers();
// The same for the stamped layers' backwards (Note [Stamped layer backwards] in tape.h): only
// where layers are stamped; counted by stamped_backwards() (tape.h).
void set_backward_stamping(bool on);
bool backward_stamping();

}  // namespace trainmem::graph
