// Pipeline parallelism on one rank: which part of the model a stage of a torch.distributed.pipelining
// run holds (one stage per rank, or several: Note [Interleaved pipeline schedules] in pipeline.cpp),
// and the order in which its schedule runs the micro-batches' forwards and backwards
// (docs/parallelism.md, "Pipeline parallelism"; python/trainmem/measure/pipeline.py is the
// measured code). The step of one stage is built by StepBuilder::build_pipeline (pipeline.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "trainmem/trainmem.h"

namespace trainmem::graph {

// Note [Pipeline split]
// The decoder layers are cut into `stages` contiguous groups as evenly as possible, the first
// num_layers % stages stages taking one layer more (python/trainmem/measure/pipeline.py
// split_layers; torch's pipelining leaves the split to the user). Stage 0 also holds the token
// embedding, the last stage the final norm and lm_head; every stage holds the rotary embedding's
// buffers (inv_freq, original_inv_freq) and computes the position ids and cos/sin for its own
// layers, as LlamaModel.forward does. Tied embeddings (lm_head is the embedding's weight) would be
// needed on the first and the last stage: refused.
struct StageLayers {
  std::uint64_t begin = 0, end = 0;  // [begin, end)
  bool holds(std::uint64_t layer) const { return layer >= begin && layer < end; }
};
StageLayers pipeline_stage_layers(std::uint64_t num_layers, std::uint64_t stages, std::uint64_t stage);

// One action of a stage's schedule: the forward or the (full) backward of a micro-batch (0-based).
struct PipelineAction {
  bool forward = true;
  std::uint64_t micro = 0;
};

// The order of a stage's actions in one schedule step (Note [Pipeline parallelism] in pipeline.cpp):
// Schedule1F1B: min(M, stages - stage) warm-up forwards, then one backward and one forward while
// forwards remain, then the remaining backwards; ScheduleGPipe: every forward, then every backward.
std::vector<PipelineAction> pipeline_order(PipelineSchedule schedule, std::uint64_t stages, std::uint64_t stage,
                                           std::uint64_t micro_batches);

// One compute action of a rank running several stages (Note [Interleaved pipeline schedules] in
// pipeline.cpp): the forward or full backward of micro-batch `micro` (0-based) on global stage `stage`.
struct PipelineStageAction {
  std::uint64_t stage = 0;
  bool forward = true;
  std::uint64_t micro = 0;
  bool operator==(const PipelineStageAction&) const = default;
};

// The compute actions of pipeline rank `rank` of `ranks` holding `stages_per_rank` stages in one
// step of a multi-stage schedule, in the order the rank runs them (torch's pipeline_order without
// its idle slots): ScheduleInterleaved1F1B (_get_1f1b_rank_ops over _get_warmup_ops) or
// ScheduleLoopedBFS (every forward stage by stage, then every backward in reverse).
std::vector<PipelineStageAction> pipeline_multi_order(PipelineSchedule schedule, std::uint64_t ranks,
                                                      std::uint64_t stages_per_rank, std::uint64_t rank,
                                                      std::uint64_t micro_batches);

// One action of a rank's FSDP2-aware schedule (See Note [Interleaved pipeline schedules with
// FSDP2] in pipeline.cpp): the compute action order[compute], or an UNSHARD / RESHARD of `stage`.
struct PipelineLoweredAction {
  enum class Kind : std::uint8_t { kCompute, kUnshard, kReshard };
  Kind kind = Kind::kCompute;
  std::uint64_t stage = 0;  // the global stage
  std::size_t compute = 0;  // kCompute: the index into the compute actions
  bool operator==(const PipelineLoweredAction&) const = default;
};

// torch 2.13's _add_unshard_reshard over a rank's compute actions (max_active_stages 3): before
// each action the RESHARD of every active stage not among the next three distinct stages (in
// ascending order, as the active set iterates), then the UNSHARD of each of those not active (in
// the order they come); a RESHARD of every stage still active after the last action.
std::vector<PipelineLoweredAction> pipeline_add_unshard_reshard(const std::vector<PipelineStageAction>& order);

// Throws Error for a model the engine does not split (see Note [Pipeline split]).
void check_pipeline_model(const Architecture& a, const Recipe& r);

}  // namespace trainmem::graph
