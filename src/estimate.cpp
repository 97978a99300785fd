// trainmem::estimate: model → op graph (graph/) → allocator replay (sim/), every layer replayed
// (Note [Estimates are not extrapolated over layers] in model/depth.cpp says why). The replay
// follows the graph stage micro-batch by micro-batch, so repeated micro-batches are skipped
// (Note [Repeated micro-batches] in sim/simulator.cpp).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "estimate.h"
#include "graph/step.h"
#include "sim/caching_allocator.h"
#include "sim/simulator.h"

namespace trainmem {
namespace {

// The allocator model places blocks in a 2^63-byte address space; a step that outgrows it is
// bad input (absurd sizes), reported as such rather than as an allocator detail.
[[noreturn]] void too_big(const std::overflow_error& e) {
  throw Error(std::string("the step needs more memory than trainmem models (2^63 bytes): ") + e.what());
}

Estimate run(const Model& model, const Recipe& resolved, const Gpu& gpu, const EstimateOptions& options,
             std::uint64_t rank, bool peeks = true) {
  sim::Replay replay(resolved, options);
  if (!peeks) replay.no_peeks();
  graph::Trace trace = graph::build_training_trace(
      model, resolved, gpu,
      [&replay](const graph::Trace& t, std::uint32_t step, std::uint32_t micro) {
        return replay.micro_batch_done(t, step, micro);
      },
      rank);
  Estimate est = replay.finish(trace);
  if (est.complete && trace.stale_categories && replay.peeked()) {
    // See Note [Peeks inside a schedule] in graph/pipeline.cpp: the breakdown read a category
    // that changed later; the peaks are right, the breakdown is taken again without peeks.
    graph::recycle(std::move(trace));
    return run(model, resolved, gpu, options, rank, false);
  }
  est.model = model.name;
  est.parameters = model.parameter_count;
  est.trainable_parameters = trace.trainable_parameters;
  est.host = trace.host;
  est.gpu = gpu;
  est.rank = rank;
  graph::recycle(std::move(trace));
  return est;
}

// Note [The worst rank]
// The estimate is per GPU, and a recipe fits only if it fits on every GPU: with no rank asked
// for, it reports the rank that needs the most memory. Which ranks can differ is decided by what
// the wrappers give each rank:
//  * DDP replicates the model and its buckets, and FSDP2 pads every shard to the same size
//    (Note [FSDP2 units] in graph/parallel.cpp): every rank runs the same ops on tensors of the same
//    sizes, so rank 0 stands for all of them. Only the optimizer's states follow a sharded
//    parameter's own rows, fewer on the last ranks when the rows do not divide (Note [Uneven
//    shards] in graph/parallel.cpp): rank 0's are never fewer. (gloo's reduce-scatter temporary is measured inside
//    the collective on every rank: Note [gloo's reduce-scatter temporary] in graph/parallel.cpp.)
//  * DeepSpeed ZeRO cuts the flat group into equal partitions, but which parameters overlap a
//    partition differs by rank, and with them the whole-parameter gradient copies
//    (grads_in_partition) and the moments they happen (Note [DeepSpeed ZeRO-1/2]): every rank is
//    replayed. Measured, a 2-rank gpt2 ZeRO-2 run with grad_accum 2 peaks 29.9 MB higher on rank 1
//    than on rank 0. ZeRO-3 partitions every parameter on its own into equal, padded partitions
//    and gathers whole parameters (Note [DeepSpeed ZeRO-3] in graph/zero3.cpp): every rank
//    allocates the same, so rank 0 stands for all (its three measurements: ranks identical).
//  * Pipeline stages hold different layers, the first the embedding and the last the head and the
//    loss, and 1F1B keeps a different number of micro-batches in flight on each (Note [Pipeline
//    parallelism] in graph/pipeline.cpp): every stage is replayed, the stage being the rank. Under
//    PP x DP (rank = stage x gpus + dp rank) a stage's DDP replicas allocate the same (Note
//    [Pipeline with DDP]), and so do its FSDP2 ranks, over the same padded shards (Note [Pipeline
//    with FSDP2]): each stage's data-parallel rank 0 stands for its replicas. Under PP x TP a
//    stage's tp ranks hold the same shards of the same layers and run the same sizes (Note
//    [Pipeline with tensor parallelism]): as under TP alone they are not ranks of the estimate,
//    and each stage is replayed once.
// The worst rank is the one with the most reserved bytes at its peak (what must fit), then the most
// allocated bytes, then the lowest rank.
bool ranks_differ(const Recipe& r) {
  return r.pp > 1 || (r.gpus > 1 && is_zero(r.parallel) && r.parallel != Parallel::kZero3);
}

// Ranks of the estimate: data-parallel ranks, or pipeline stages (one per GPU) times their
// data-parallel replicas.
std::uint64_t rank_count(const Recipe& r) { return r.gpus * r.pp; }

}  // namespace

std::vector<std::uint64_t> detail::replayed_ranks(const Recipe& r) {
  if (!ranks_differ(r)) return {0};
  // See Note [The worst rank]: a stage's replicas are the same, so each stage is replayed once.
  const std::uint64_t stride = r.pp > 1 ? r.gpus : 1;
  std::vector<std::uint64_t> ranks;
  for (std::uint64_t rank = 0; rank < rank_count(r); rank += stride) ranks.push_back(rank);
  return ranks;
}

bool detail::worse_rank(const Estimate& a, const Estimate& b) {
  if (a.peak_reserved_bytes != b.peak_reserved_bytes) return a.peak_reserved_bytes > b.peak_reserved_bytes;
  return a.peak_allocated_bytes > b.peak_allocated_bytes;
}

namespace {

// The positions a step feeds after its seq tokens: a generation's new tokens but the last.
std::uint64_t positions_after_prompt(const Recipe& recipe) {
  return recipe.mode == Mode::kInference ? recipe.new_tokens - 1 : 0;
}

Estimate run_ranks(const Model& model, const Recipe& resolved, const Gpu& gpu, const EstimateOptions& options) {
  const std::uint64_t ranks = rank_count(resolved);
  if (options.rank >= 0 && static_cast<std::uint64_t>(options.rank) >= ranks) {
    throw Error("rank " + std::to_string(options.rank) + " is not one of the " + std::to_string(ranks) +
                " ranks (0.." + std::to_string(ranks - 1) + ")");
  }
  const std::vector<std::uint64_t> replayed =
      options.rank >= 0 ? std::vector<std::uint64_t>{static_cast<std::uint64_t>(options.rank)}
                        : detail::replayed_ranks(resolved);
  // With several ranks, find the worst without a timeline or an event trace, then replay it
  // again with them.
  const bool extras = replayed.size() > 1 && (options.timeline || options.phases || !options.trace_path.empty());
  EstimateOptions probe = options;
  if (extras) {
    probe.timeline = false;
    probe.phases = false;
    probe.trace_path.clear();
  }
  std::vector<RankPeak> peaks;
  std::uint64_t events = 0;
  Estimate best;
  for (std::uint64_t rank : replayed) {
    Estimate est = run(model, resolved, gpu, probe, rank);
    peaks.push_back({rank, est.peak_allocated_bytes, est.peak_reserved_bytes});
    events += est.events;
    const bool stopped = !est.complete;  // past the caller's limit: no rank can undo that
    if (rank == replayed.front() || detail::worse_rank(est, best)) best = std::move(est);
    if (stopped) break;
  }
  if (extras) {
    best = run(model, resolved, gpu, options, best.rank);
    events += best.events;
  }
  if (ranks > 1) best.ranks = std::move(peaks);
  best.events = events;
  return best;
}

}  // namespace

// Note [Requested bytes]
// Every live tensor holds a block of at least its request rounded up to 512 B (round_size; a
// power-of-two division only rounds further), whatever the allocator does around it, and blocks
// do not overlap: the sum over the live tensors of a trace, taken after each event, is at most
// the allocated bytes at that moment, which are at most the reserved ones. It needs the graph
// stage only. The planner uses it where the allocator's replay would cost more than it can tell:
// a recipe whose requests alone pass the usable memory does not fit under any allocator setting
// (Note [Requests that do not fit] in plan/fit.cpp). The sum cannot skip a repeated micro-batch
// (that takes the allocator's state, Note [Repeated micro-batches] in sim/simulator.cpp), so every
// micro-batch is built. Checked against the replay's peaks: Estimate.RequestedBytesBoundTheReplay.
// Note [Gemma-2's attention]
// transformers declares no SDPA for Gemma-2 (`_supports_sdpa = False`: SDPA has no logit
// softcapping), so a model built without attn_implementation runs eager attention, and one asked
// for "sdpa" is refused at construction (transformers 5.24 and 5.25; the measuring side resolves
// sdpa to eager the same way, python/trainmem/measure/models.py resolved_for_model). The recipe's sdpa, the default, is therefore resolved to eager, and the
// estimate says so. flash_attention_2 it does take (softcapping inside the kernel), but the engine
// models Gemma-2's eager attention only, so flash is refused rather than estimated as eager.
Recipe detail::resolved_for_model(const Model& model, Recipe recipe) {
  if (recipe.lora.enabled()) recipe.lora.targets = resolve_lora_targets(model.arch, recipe.lora.targets);
  if (model.arch.family == Family::kGemma2 && recipe.attention == Attention::kSdpa) recipe.attention = Attention::kEager;
  if (model.arch.family == Family::kGemma2 && recipe.attention == Attention::kFlash) {
    throw Error("attention: flash (flash_attention_2) for Gemma-2 is not modelled; its eager attention is, which "
                "transformers runs by default (it has no SDPA for Gemma-2)");
  }
  // flash-attn 2 takes head dims up to 256; the ring of context parallelism is not modelled over
  // the K/V that SDPA repeats for wider heads (Note [SDPA kernels on CUDA] in step_builder.h).
  if (recipe.attention == Attention::kFlash && model.arch.head_dim > 256) {
    throw Error("attention: flash takes a head dim of at most 256 (flash-attn 2), got " +
                std::to_string(model.arch.head_dim) + "; use sdpa or eager");
  }
  if (recipe.cp > 1 && model.arch.head_dim > 256 && model.arch.num_kv_heads != model.arch.num_heads) {
    throw Error("cp: " + std::to_string(recipe.cp) + " with a head dim above 256 and grouped key/value heads is "
                "not modelled (SDPA repeats K and V there)");
  }
  // GPT2Attention's _upcast_and_reordered_attn (eager only) computes the scores from fp32 copies of
  // q and k: the same as the engine's eager attention in fp32, not in half (found by a probe).
  if (model.arch.reorder_and_upcast_attn && recipe.attention == Attention::kEager &&
      (recipe.precision != Precision::kFp32 || recipe.fsdp.param_dtype == FsdpDtype::kBf16)) {
    throw Error("config.json: reorder_and_upcast_attn with eager attention in half precision is not modelled "
                "(GPT-2 upcasts q and k to fp32 there); use sdpa, fp32, or set it false");
  }
  if (model.arch.rope_rescales_past > 0 && recipe.seq + positions_after_prompt(recipe) > model.arch.rope_rescales_past) {
    throw Error("seq: the rotary embedding's rope_type (dynamic / longrope) replaces inv_freq past " +
                std::to_string(model.arch.rope_rescales_past) + " positions, which is not modelled; use seq " +
                std::to_string(model.arch.rope_rescales_past) + " or less");
  }
  if (recipe.mode == Mode::kInference && !model.arch.generation_unmodelled.empty()) {
    throw Error("config.json: " + model.arch.generation_unmodelled +
                " changes what generate() does (its generation settings or its cache), which is not modelled; "
                "remove it to estimate plain generation");
  }
  if (recipe.mode == Mode::kInference && model.arch.generation_refills_past > 0 &&
      recipe.seq + positions_after_prompt(recipe) > model.arch.generation_refills_past) {
    throw Error("seq + new_tokens: Phi-3's generate() runs the whole sequence again once it passes "
                "original_max_position_embeddings " + std::to_string(model.arch.generation_refills_past) +
                ", which is not modelled");
  }
  // GPT-2's learned position embedding (wpe) has n_positions rows, and a position past them is an
  // IndexError in transformers (generate() does not check it either); rotary models have no table.
  // A generation feeds the prompt, then each new token but the last.
  if (model.arch.family == Family::kGpt2) {
    const std::uint64_t positions = recipe.seq + positions_after_prompt(recipe);
    if (positions > model.arch.max_positions) {
      const std::string limit = std::to_string(model.arch.max_positions);
      throw Error(recipe.mode == Mode::kInference
                      ? "seq + new_tokens: a " + std::to_string(recipe.seq) + "-token prompt and " +
                            std::to_string(recipe.new_tokens) + " new tokens feed " + std::to_string(positions) +
                            " positions, past the model's " + limit +
                            " (n_positions: GPT-2's position embedding has no row past them)"
                      : "seq: " + std::to_string(recipe.seq) + " is past the model's " + limit +
                            " positions (n_positions: GPT-2's position embedding has no row past them); use seq " +
                            limit + " or less");
    }
  }
  return recipe;
}

std::uint64_t default_seq(const Model& model, const Recipe& recipe) {
  const std::uint64_t seq = Recipe{}.seq;
  if (model.arch.family != Family::kGpt2) return seq;
  const std::uint64_t after = positions_after_prompt(recipe);
  const std::uint64_t room = model.arch.max_positions > after ? model.arch.max_positions - after : 1;
  return std::min(seq, room);
}

std::uint64_t detail::peak_requested_bytes(const Model& model, const Recipe& recipe, std::uint64_t rank,
                                           std::uint64_t stop_above, bool* before_optimizer) {
  recipe.validate();
  const Gpu& gpu = find_gpu(recipe.gpu);
  const Recipe resolved = resolved_for_model(model, recipe);
  const sim::AllocatorConfig plain;  // 512 B steps: every config rounds to them or coarser
  std::size_t next = 0;
  std::uint64_t live = 0, peak = 0;
  bool stopped = false;  // what the graph stage adds after a stop is not the step's
  bool optimizer_seen = false;
  auto read = [&](const graph::Trace& t) {
    for (; !stopped && next < t.events.size(); ++next) {
      const graph::Event& e = t.events[next];
      optimizer_seen = optimizer_seen || t.moments[e.moment].phase == Phase::kOptimizer;
      const std::uint64_t block = sim::CachingAllocator::round_size(t.storages[e.tensor].bytes, plain);
      if (e.alloc) {
        // Saturating: past 2^64 the replay would have refused the step long before.
        live = live > UINT64_MAX - block ? UINT64_MAX : live + block;
        peak = std::max(peak, live);
        if (stop_above && live > stop_above) stopped = true;
      } else {
        live -= block;
      }
    }
    return stopped ? graph::MicroBatchNext::kStop : graph::MicroBatchNext::kGoOn;
  };
  try {
    graph::Trace trace = graph::build_training_trace(
        model, resolved, gpu, [&read](const graph::Trace& t, std::uint32_t, std::uint32_t) { return read(t); },
        rank);
    read(trace);
    graph::recycle(std::move(trace));
  } catch (const std::overflow_error& e) {
    too_big(e);
  }
  if (before_optimizer) *before_optimizer = stopped && !optimizer_seen;
  return peak;
}

Estimate estimate(const Model& model, const Recipe& recipe, const EstimateOptions& options) {
  recipe.validate();
  const Gpu& gpu = find_gpu(recipe.gpu);
  try {
    return run_ranks(model, detail::resolved_for_model(model, recipe), gpu, options);
  } catch (const std::overflow_error& e) {
    too_big(e);
  }
}

}  // namespace trainmem
