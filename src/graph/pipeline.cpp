// Pipeline parallelism: the training step of one pipeline rank (pipeline.h), as
// torch.distributed.pipelining runs it with a hand-built PipelineStage per stage (one or several per rank)
// (python/trainmem/measure/pipeline.py is the measured code).
#include "graph/pipeline.h"

#include <algorithm>
#include <string>

#include "graph/step_builder.h"

namespace trainmem::graph {

// Note [Pipeline parallelism]
// What torch.distributed.pipelining (torch 2.13: torch/distributed/pipelining/schedules.py,
// stage.py, _backward.py) allocates on the rank of stage s of N, with a PipelineStage built with
// static metadata (input_args / output_args of one micro-batch, plain tensors: no metadata
// inference runs) and Schedule1F1B or ScheduleGPipe(stage, n_microbatches = M, loss_fn), stepped
// with return_outputs=False; measured on gloo CPU ranks (data/ground_truth/parallel/):
//  * the batch: schedule.step splits the whole batch (M micro-batches of `batch` sequences) into
//    views along dim 0. Stage 0 holds the input ids, the last stage the labels, others neither.
//  * first step only (_initialize_pp_stages): the P2P warm-up vote (_warmup_forward_vote /
//    _warmup_backward_result: a few one-element tensors, freed at once), then the receive
//    buffers, one per micro-batch and kept for the run (_make_tensor_from_meta, empty_strided):
//    a non-first stage's activation buffers (_setup_forward_recv_info), then a non-last stage's
//    gradient buffers (_setup_backward_recv_info). Category other, like the input batch.
//  * the gradient a non-first stage sends back is the .grad autograd accumulated into its receive
//    buffer (a leaf that requires grad, _retrieve_recv_activations); stage_backward takes it and
//    sets .grad to None (_backward.py), and it lives on in the send's P2P ops and works: in
//    Schedule1F1B `bwd_sends` / `send_work` hold micro-batch k's until the backward of k + 1 has
//    made its own (the last one to the end of step()); ScheduleGPipe keeps every backward's send
//    works (bwd_sends_to_wait) to the end of step().
//  * forward_one_chunk: the stage module's forward on the receive buffer (or the ids' view);
//    fwd_cache keeps the output and the inputs until that micro-batch's backward_one_chunk,
//    which runs torch.autograd.backward(output, grad_tensors=[the gradient receive buffer]) on a
//    non-last stage and backward from the loss (a ones seed) on the last. The last stage's loss
//    is the schedule's loss_fn(output, target) right after the forward; the schedule keeps every
//    micro-batch's loss to the end of step() (_internal_losses).
//  * Python references that keep a stage output past its backward: the schedule's `output`
//    variable (and for a non-last stage `fwd_sends`, the P2P ops of its send) hold the latest
//    forward's output until the next forward returns, or to the end of step(); in Schedule1F1B the
//    warm-up's `send_work` keeps the works of its last fired send (micro-batch W - 2) until the
//    steady phase ends; ScheduleGPipe keeps every forward's send works (fwd_sends_to_wait) to the
//    end of step(). A gloo send work holds the tensor it sends.
//  * the order of the actions (pipeline_order): Schedule1F1B runs W = min(M, N - s) warm-up
//    forwards (torch's code: the last stage 1, the first N), then a backward and a forward while
//    forwards remain, then the remaining backwards; so stage s holds at most N - s micro-batches'
//    activations, stage 0 the most. ScheduleGPipe runs M forwards, then M backwards.
//  * after the last backward, perform_reduce_grad scales the gradients by 1 / M in place
//    (scale_grads); then the caller's optimizer.step() and zero_grad() over the stage's parameters
//    (bf16-master: the fp32 masters' .grad made from the half ones first, the masters copied back
//    after, as on one GPU: python/trainmem/measure/training.py grads_to_masters).
//  * the stage module is the HF model's own modules called in LlamaModel.forward's order
//    (pipeline.py _StageModule): position ids, create_causal_mask (the causal kind alone, for every
//    layer, made by each forward: Note [Training masks] in step.cpp), the rotary cos/sin, the
//    stage's layers.
//    Checkpointing (HF's gradient_checkpointing_enable, non-reentrant, before the stage is cut) wraps
//    each of those layers as GradientCheckpointingLayer.__call__ does on one GPU: the checkpoint
//    keeps the layer input, the mask and cos/sin are held by its closure, and the backward of a
//    micro-batch recomputes its layers.
//  * bf16-mixed: where the autocast context sits is the caller's choice, as torch leaves it; the
//    measured code (pipeline.py stage_autocast) gives each stage forward a torch.autocast context
//    of its own, and the last stage's loss_fn another (torch's amp docs: autocast wraps the
//    forward and the loss, not the backward; NeMo's PipelineMixedPrecisionPlugin likewise wraps the
//    per-micro-batch forward-and-loss function instead of the whole step). So the cached weight
//    casts go when each forward returns (exit_autocast), unless a backward node saved them, and the
//    backward runs outside autocast. The residual stream, and so what a stage sends and receives,
//    stays fp32; the last stage's logits are bf16 (lm_head under autocast). torchtitan has no
//    autocast with pipelining (it refuses mixed precision with PP unless FSDP does it):
//    torchtitan/distributed/utils.py maybe_enable_amp.
// Several stages per rank: Note [Interleaved pipeline schedules] below; with tensor parallelism:
// Note [Pipeline with tensor parallelism].
// Not modelled (refused): pipeline with ZeRO, zero-bubble schedules
// (split input / weight backwards), fp16-mixed (a GradScaler inside loss_fn), LoRA and
// quantized bases, flash attention, tied embeddings, other families, inference. On CUDA the P2P
// sends run on NCCL's streams (record_stream): unmeasured.

// Note [Pipeline with DDP]
// PP x DP with DDP (--pp P --gpus D --parallel ddp: P x D ranks, rank = stage x D + dp rank, a 2-D
// mesh (pp, dp) as torchtitan's, pp outermost): each stage module is wrapped by
// DistributedDataParallel over its stage's D replicas (PyTorch's defaults, as on one stage: Note
// [DDP buckets] in parallel.cpp) and the PipelineStage drives it (torch 2.13,
// torch/distributed/pipelining/stage.py):
//  * forward_maybe_with_nosync runs every forward under DDP's no_sync(): _post_forward then clears
//    require_forward_param_sync, so the buffers are broadcast in the run's first forward only,
//    and no forward calls prepare_for_backward;
//  * backward_maybe_with_nosync runs every backward under no_sync but the step's last one
//    (last_backward: the schedule's micro-batch M - 1), which calls reducer.prepare_for_backward
//    on the stage's output by hand: only that backward's AccumulateGrad hooks reach the Reducer,
//    which copies the accumulated .grads (divided by D) into its buckets, all-reduces them and
//    copies them back, all in place. The gradients of the earlier micro-batches accumulate in .grad
//    as on one stage;
//  * that backward also records the gradients' order, so the buckets are rebuilt in the next
//    forward (the second step's first), as on one GPU;
//  * perform_reduce_grad then only scales the gradients by 1 / M (scale_grads: DDP has already
//    divided by D).
// The replicas of a stage run the same ops on the same sizes (each draws its own batch): the
// stage's data-parallel rank 0 stands for all of them (Note [The worst rank] in estimate.cpp).
// Measured on pp2 x dp2 and pp3 x dp2 gloo ranks, Llama and Qwen2 (data/ground_truth/parallel/cpu-pp2dp2-*,
// cpu-pp3dp2-*).

// Note [Pipeline with FSDP2]
// PP x DP with FSDP2 (--pp P --gpus D --parallel fsdp; ranks as in Note [Pipeline with DDP]): the
// units of Note [FSDP2 units], per stage: fully_shard on each decoder layer the stage holds, then on
// the stage module (the root: whichever of the embedding, the final norm and lm_head the stage
// keeps; a middle stage's root manages no parameter and has no param group), over the dp dimension
// of the (pp, dp) mesh (HSDP, fsdp_replicate R: the (replicate, shard) dimensions of a (pp, R,
// D / R) mesh, as torchtitan's dp_replicate x fsdp; Note [FSDP2 variants]). torchtitan
// (torchtitan/models/llama3/infra/parallelize.py apply_fsdp, on each pipeline model part) shards
// the layers and the part the same way, but gives the embedding and [norm, output] units of their
// own (not measured here) and, under PP, defaults to reshard_after_forward=False (measured). The
// PipelineStage drives the units (torch 2.13, torch/distributed/pipelining/stage.py; the FSDP2
// side in torch/distributed/fsdp/_fully_shard/):
//  * forward_maybe_with_nosync does nothing for an FSDPModule: each forward runs FSDP2's hooks as
//    on one stage (the root gathers in its pre-forward and stays gathered, each layer gathers in
//    its pre-forward and reshards in its post-forward; the root's post-forward frees the last
//    all_gather_state when the stage module returns, before the last stage's loss_fn);
//  * backward_maybe_with_nosync calls set_is_last_backward(False), set_reshard_after_backward(False)
//    and set_requires_gradient_sync(False) (_fully_shard.py: reduce_grads off on every param
//    group) before every backward. So a unit's post_backward (_fsdp_param_group.py) returns
//    before its reduction and without resharding: the unsharded .grads (whole parameters, in the
//    compute dtype) accumulate over the micro-batches as on one GPU, and the units stay gathered.
//    The root's final callback (_fsdp_state.py _root_post_backward_final_callback) runs the
//    post-backwards no hook ran (the root's on the first stage, whose input ids need no grad),
//    reducing nothing, and, not in a last backward, finalizes nothing;
//  * with a MixedPrecisionPolicy whose reduce_dtype differs from param_dtype (torchtitan's bf16 /
//    fp32), that early-returning post_backward still runs accumulate_unsharded_grad_if_needed (the
//    new .grad added in place into unsharded_accumulated_grad, then dropped) and
//    to_accumulated_grad_if_needed (a .grad with no accumulated one becomes an fp32 copy, the bf16
//    one dropped: _fsdp_param.py), so after the first backward the gradients are held in fp32 and
//    each later one's bf16 .grads live from their AccumulateGrad to their unit's post-backward.
//    The stage computes in param_dtype, so what it sends and receives is bf16 (the measured
//    PipelineStage's metadata says so, as inference from a real forward would);
//  * a gathered unit's unshard is a no-op: a forward after a backward gathers nothing and then
//    reshards each layer in its post-forward (reshard_after_forward), so the next backward gathers
//    those layers again (1F1B's steady phase on the later stages). With reshard_after_forward=False
//    (Note [FSDP2 variants]) a layer gathered once stays gathered to perform_reduce_grad, so the
//    stage holds its whole parameters through the schedule, as without FSDP2. The root's
//    pre-backward is a hook on the stage module's output: on the last stage after the loss_fn's
//    backward nodes, elsewhere before the stage's first node; it and the layers' pre-backwards
//    prefetch as in Note [FSDP2 units] (post_forward_order is cleared only by a last backward, so a
//    stage's first layer may prefetch its root, which is gathered: nothing);
//  * perform_reduce_grad runs after the last backward and _update_losses, inside
//    _step_microbatches, whose locals still hold the last output, the send works and `loss`, the
//    last backward's (the last stage's last micro-batch loss). It turns the three back on and
//    calls post_backward on every param group of state._state_ctx.all_states: the root's first,
//    then the layers' in forward order (_lazy_init lists the states in named_modules order). Each
//    takes the accumulated gradients (unsharded_accumulated_grad, else .grad), reshards and
//    reduce-scatters them as in Note [FSDP2 units] (the previous unit's reduce-scatter input freed
//    first). Then _root_post_backward_final_callback with is_last_backward: finalize_backward, and
//    the last reduce-scatter state is dropped. scale_grads then divides the sharded .grads in place.
//  * HSDP: finalize_backward, which frees a reduce-dtype all-reduce state (Note [FSDP2 variants]),
//    runs in that last callback only, so every unit's is held to the end of perform_reduce_grad.
// Measured on pp2 x dp2 (Llama, Qwen2, Qwen3), pp3 x dp2 and pp2 x (2 x 2) HSDP gloo ranks (data/ground_truth/parallel/
// cpu-pp2fsdp2-*, cpu-pp3fsdp2-*, cpu-pp2hsdp4-*, every rank exact), with the settle wait of Note
// [gloo's reduce-scatter temporary]. gpus 1 is refused (nothing to shard over; measured nowhere).

// Note [Pipeline with tensor parallelism]
// PP x TP (--pp P --tp T: P x T ranks, rank = stage x T + tp rank, a 2-D mesh (pp, tp) with tp
// innermost, as torchtitan's ParallelDims orders it): each rank prunes the model to its stage, then
// parallelizes what it keeps over the tp dimension exactly as the TP path parallelizes the whole
// model (python/trainmem/measure/pipeline.py make_stage -> parallel.py tensor_parallelize: the
// Megatron plan on each of its decoder layers, the embedding, norms and lm_head it keeps
// replicated, with sequence_parallel the SequenceParallel / Shard(1) styles), and builds its
// PipelineStage over the pp dimension's group, so each tp rank exchanges with the same tp rank of
// the neighbouring stages. torchtitan does the same in that order: pipeline_llm
// (torchtitan/distributed/pipeline_parallel.py) cuts the model parts and builds a PipelineStage per
// part over pp_mesh's group, then applies parallelize_fn (apply_tp over the tp mesh,
// torchtitan/models/llama3/infra/parallelize.py) to each part; it gives PipelineStage no
// input_args, so its first step infers the metadata with a real micro-batch (not modelled: the
// measured stages are static, Note [Pipeline parallelism]). What a rank holds, measured on
// pp2 x tp2 and pp3 x tp2 gloo ranks (data/ground_truth/parallel/cpu-pp2tp2-*, cpu-pp2tp2sp-*,
// cpu-pp2tp2lp-*, cpu-pp2tp2splp-*, cpu-pp3tp2-*), every rank exact:
//  * its stage's parameters as the tensor-parallel local model (tensor_parallel_model: every
//    colwise and rowwise projection of its layers 1/T, the embedding, the norms and lm_head whole,
//    Replicate), and their gradients and optimizer states;
//  * inside the stage, its layers as under TP alone (Notes [Tensor parallelism], [Sequence
//    parallelism]), the first layer's input being the receive leaf instead of the embedding's output;
//  * without sequence parallelism the residual stream is a plain, replicated tensor
//    (RowwiseParallel's use_local_output=True), so what a stage sends and receives is the whole
//    [b, s, h] micro-batch on every tp rank, and so are its receive buffers;
//  * with sequence parallelism the stream is a Shard(1) DTensor, which torch 2.13's PipelineStage
//    (torch/distributed/pipelining/stage.py) handles from DTensor metadata (the measured stage
//    gives input/output args and grads as meta DTensors: static DTensor mode needs all four,
//    _utils.py InferenceMode.needs_dynamic): get_fwd_send_ops and get_bwd_send_ops send
//    to_local_if_dtensor of the output and of the input's gradient, the local [b, s / T, h] shard;
//    the receive buffers are made from the metadata's local shape (_make_tensor_from_meta), and
//    _retrieve_recv_activations wraps the buffer in DTensor.from_local, made the leaf that
//    requires grad (so its gradient is a DTensor whose local tensor is what is sent back), as
//    _retrieve_recv_grads wraps the gradient buffer. Buffers and sends are 1/T of the micro-batch.
//    torchtitan's plan (sequence parallel whenever TP is on, rowwise outputs use_local_output=True)
//    hands plain local [b, s / T, h] tensors between its stages: the same bytes. Stage 0 shards
//    the embedding's output (PrepareModuleOutput) as TP's forward does; the last stage all-gathers
//    lm_head's input (PrepareModuleInput), and the final norm's output shard is the stage
//    module's local until it returns, before the schedule's loss_fn (in the HF model's forward it
//    lives to the end of the loss).
//  * with loss parallelism the last stage's lm_head is ColwiseParallel with Shard(-1) logits (Note
//    [Loss parallel] in tensor_parallel.h): vocab / T rows of its weight, and its output, the
//    stage's (a DTensor whose local [b, s, vocab / T] shard fwd_cache and the schedule's `output`
//    hold), no stage receiving its gradient (the measured stage's output metadata is a Shard(-1)
//    meta DTensor). The measured loop runs each schedule step inside loss_parallel(), as
//    torchtitan does (torchtitan/train.py runs pp_schedule.step under its train context, which
//    torchtitan/distributed/utils.py get_train_context makes enter loss_parallel()), so the
//    schedule's loss_fn and the loss's backward run the vocab-parallel handlers, whose buffers are
//    those of the TP path; the optimizer step is outside it.
// PP x TP x DP (--gpus D --parallel fsdp, P x D x T ranks, a (pp, dp, tp) mesh, torchtitan's order of
// the three): after the plan, each stage is sharded over the dp dimension as in Note [Pipeline with
// FSDP2] (fully_shard on each of its decoder layers, then on the stage module; FSDP2's default
// knobs, as TP x DP allows them), over the DTensor parameters the plan made: the units of TP x DP
// (docs/parallelism.md "TP x DP"), driven by the PipelineStage as without TP (no reduction and no
// reshard after backward during the schedule, every unit reduced at perform_reduce_grad), with
// sequence parallelism's Partial norm gradients redistributed there (Note [Partial gradients under
// FSDP2] in parallel.cpp). Measured on pp2 x dp2 x tp2 (cpu-pp2tp2fsdp2-*, cpu-pp2tp2spfsdp2-*,
// cpu-pp2tp2splpfsdp2-*).
// A stage's tp ranks draw the same batch and run the same ops on the same sizes, so each stage is
// replayed once, as its rank (Note [The worst rank] in estimate.cpp: rank = stage x gpus + dp
// rank, the tp ranks folded in as under TP alone); `trainmem compare` replays process p as p / T.
// Not modelled (refused in recipe validation): whatever TP alone or TP x DP refuses (DDP or ZeRO
// over a tensor-parallel model, FSDP2's non-default knobs and HSDP, fp16-mixed (the pipeline's
// own rule), GPT-2 and Phi-3).

StageLayers pipeline_stage_layers(std::uint64_t num_layers, std::uint64_t stages, std::uint64_t stage) {
  const std::uint64_t base = num_layers / stages, extra = num_layers % stages;
  StageLayers s;
  s.begin = stage * base + (stage < extra ? stage : extra);
  s.end = s.begin + base + (stage < extra ? 1 : 0);
  return s;
}

std::vector<PipelineAction> pipeline_order(PipelineSchedule schedule, std::uint64_t stages, std::uint64_t stage,
                                           std::uint64_t micro_batches) {
  std::vector<PipelineAction> out;
  const std::uint64_t m = micro_batches;
  if (schedule == PipelineSchedule::kGPipe) {
    for (std::uint64_t i = 0; i < m; ++i) out.push_back({true, i});
    for (std::uint64_t i = 0; i < m; ++i) out.push_back({false, i});
    return out;
  }
  const std::uint64_t warmup = std::min(m, stages - stage);
  std::uint64_t f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({true, f});
  while (true) {
    out.push_back({false, b++});
    if (f == m) break;
    out.push_back({true, f++});
  }
  while (b < m) out.push_back({false, b++});
  return out;
}

// Note [Interleaved pipeline schedules]
// Several stages per rank (pp_stages_per_rank V >= 2, torch 2.13's PipelineScheduleMulti subclasses
// in torch/distributed/pipelining/schedules.py; measured by python/trainmem/measure/pipeline.py
// make_virtual_stages on gloo CPU ranks, data/ground_truth/parallel/cpu-pp2v2-*):
//  * the layout: the decoder layers split over pp x V stages by Note [Pipeline split]; rank r holds
//    stages r, r + pp, ..., r + (V - 1) pp (generate_stage_to_rank_mapping's loop style, as
//    torchtitan's stage_ids_this_rank), one PipelineStage per stage, each over its own modules. So
//    rank 0 keeps the embedding (stage 0), rank pp - 1 the final norm and lm_head (the last stage),
//    and every rank the parameters and gradients of all its stages.
//  * the order: each schedule computes every rank's list of actions (stage, F or B, micro-batch) in
//    __init__ (pipeline_multi_order mirrors it without the idle slots). ScheduleInterleaved1F1B
//    (_calculate_single_rank_operations, _get_1f1b_rank_ops): rounds = max(1, M // pp) (M must be
//    a multiple of it, else ValueError), micro-batches per round R = M // rounds, W = min((V - 1) R
//    + 2 (pp - 1 - r), V M) warm-up forwards, then M V - W pairs of a forward and a backward, then
//    W backwards; the forward of op i runs on local stage (i // R) mod V, the backward of op i on
//    local stage V - 1 - ((i - W) // R) mod V, each stage's micro-batches in order. ScheduleLoopedBFS:
//    every micro-batch's forward on each local stage in turn, then the backwards stage by stage
//    from the last, the micro-batches in reverse order.
//  * the runtime (_PipelineScheduleRuntime._step_microbatches, over the lowered schedule of
//    _add_send_recv / _add_reduce_grad): forward_one_chunk and backward_one_chunk as with one stage
//    (fwd_cache, the received leaf and its .grad, the last stage's loss_fn right after its forward:
//    Note [Pipeline parallelism]), but `output` and `loss` are locals of _perform_action, gone
//    when the action returns. Each SEND_F / SEND_B follows its compute action and its works are
//    appended to `send_ops`, waited and dropped only at the end of the step: every forward output
//    a non-last stage sends and every input gradient a non-first stage sends lives to the end of
//    step(). Then _update_losses clears the last stage's kept losses. REDUCE_GRAD follows each
//    stage's M-th backward (perform_reduce_grad: scale_grads, in place).
//  * first step: the warm-up vote over the rank's stages (_warmup_p2p: _warmup_forward_vote for
//    each stage in order, each multiplying the accumulated vote received from the stage before,
//    then _warmup_backward_result in reverse, each receiving the result into a fresh one-element
//    tensor unless it holds the last stage); then _prepare_forward_infra for each stage in order
//    (a non-first stage's M activation receive buffers), then _prepare_backward_infra in reverse
//    (a non-last stage's M gradient receive buffers).
// With DDP or FSDP2 replicas of every stage: Notes [Interleaved pipeline schedules with DDP] and
// [Interleaved pipeline schedules with FSDP2] below.
// Over tensor-parallel stages (PP x TP, and PP x TP x FSDP2) every local stage is parallelized as
// Note [Pipeline with tensor parallelism] says, its receive buffers 1/T of the micro-batch under
// sequence parallelism (measured: cpu-pp2v2tp2-*, cpu-pp2v2tp2sp-*, cpu-pp2v2tp2fsdp2-*, every rank
// exact; before the measurement the engine gave the sequence-parallel run whole-width receive
// buffers, 786,432 B high).
// Not modelled (refused): ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and DualPipeV (split
// backwards, V-shaped layouts).

// Note [Interleaved pipeline schedules with DDP]
// PP x DP with several stages per rank (--pp P --pp-stages-per-rank V --gpus D --parallel ddp: the
// (pp, dp) mesh of Note [Pipeline with DDP]): every local stage module is wrapped by a
// DistributedDataParallel of its own over the stage's dp group, as torchtitan parallelizes each
// model part and torch's pipelining tests wrap each stage module (python/trainmem/measure/pipeline.py
// make_virtual_stages); the engine gives each local stage a DataParallel of its own (pp_dps_,
// StepBuilder::wrap_pipeline_stages), made in stage order. What torch 2.13 does with them
// (torch/distributed/pipelining/stage.py, schedules.py _PipelineScheduleRuntime._step_microbatches):
//  * construction: each Reducer makes its one bucket over its stage's parameters only (Note [DDP
//    buckets]), stage after stage. The stage modules register no buffers (_VirtualStageModule holds
//    its parts only, not the rotary embedding), so no forward broadcasts anything;
//  * forward_maybe_with_nosync: every forward under no_sync, as with one stage;
//  * backward_maybe_with_nosync(last_backward): the runtime counts each stage's backwards
//    (backward_counter) and passes last_backward to the stage's M-th, which calls its own Reducer's
//    prepare_for_backward and all-reduces that stage's buckets in place (Note [Pipeline with DDP]);
//    the other backwards run under no_sync. So a stage synchronizes at its own last backward, in the
//    middle of the step for every stage but the one whose backwards end the schedule;
//  * that backward records the stage's gradient order, and the stage's first forward of the next
//    step rebuilds its buckets (_pre_forward → _rebuild_buckets), each stage at its own forward;
//  * REDUCE_GRAD right after the stage's last backward (_add_reduce_grad): perform_reduce_grad only
//    scales the stage's gradients by 1 / M in place.
// Measured on pp2 x dp2 (interleaved-1f1b and looped-bfs, V = 2 and 3) and pp3 x dp2 gloo ranks
// (data/ground_truth/parallel/cpu-pp2v2dp2-*, cpu-pp2v3dp2-*, cpu-pp3v2dp2-*), every rank exact.

// Note [Interleaved pipeline schedules with FSDP2]
// PP x DP with FSDP2 and several stages per rank (--parallel fsdp, the (pp, dp) mesh of Note
// [Pipeline with FSDP2]): each local stage is sharded on its own, fully_shard on each of its decoder
// layers and then on the stage module, so every local stage is an FSDP2 root with its own
// communication context (_fsdp_state.py _lazy_init: the root's FSDPCommContext goes to the groups of
// its own tree only), its own all_gather_state, reduce_scatter_state and post-forward order; the
// engine gives each a DataParallel of its own (pp_dps_), whose units are the stage's layers and its
// root. The PipelineStage drives each as in Note [Pipeline with FSDP2] (every backward with
// reduce_grads off, no reshard after backward, is_last_backward False). What the multi-stage
// runtime adds (torch 2.13, torch/distributed/pipelining/schedules.py):
//  * the lowering (_PipelineScheduleRuntime._prepare_schedule_with_comms) runs
//    _add_unshard_reshard over each rank's compute actions: before action i it takes the next
//    max_active_stages = 3 distinct stages from i on (next_stage_indices), issues a RESHARD for
//    every active stage not among them and then an UNSHARD for each of them not active, in that
//    order (pipeline_add_unshard_reshard), and after the last action a RESHARD of every stage still
//    active. With V <= 3 every local stage is fetched before the step's first action and evicted
//    only once no action of it is left, after its REDUCE_GRAD (_add_reduce_grad runs on the
//    lowered list); with V >= 4 a stage is also evicted between its forwards and its backwards, and
//    fetched again before them;
//  * UNSHARD: unshard(async_op=True) on every FSDPModule of the stage module in modules() order
//    (the root, then its layers): each group that is not unsharded issues its all-gather and the
//    buffer waits in its _all_gather_result. So at the step's start a rank holds the all-gather
//    buffers of all its active stages at once (DataParallel::pp_unshard);
//  * _assert_unsharded before each F or B of a stage waits its handles: wait_for_unshard of each
//    group, outside any forward (the group is IDLE), so each copy-out allocates the unsharded
//    parameters and frees the buffer at once, none kept in all_gather_state
//    (DataParallel::pp_wait_unshard). A stage's first forward thus gathers nothing itself; its
//    layers reshard in their post-forwards as usual (reshard_after_forward) and gather again in
//    the later forwards and backwards as with one stage; the root stays gathered;
//  * RESHARD: reshard() on every FSDPModule of the stage (the root too) frees what is unsharded
//    (DataParallel::pp_reshard): after a stage's last action everything was already resharded by
//    its perform_reduce_grad, so it frees nothing; between its forwards and its backwards (V >= 4)
//    it frees the root and, with reshard_after_forward=False, the layers, which the next UNSHARD
//    gathers again;
//  * REDUCE_GRAD follows each stage's M-th backward (_add_reduce_grad), not the end of the step:
//    perform_reduce_grad runs the stage's post-backwards (its root first, then its layers: its own
//    all_states), reduce-scatters what its gradients accumulated and runs its root's final
//    callback, then scale_grads, while the rank's other stages may still have micro-batches to run;
// Measured on pp2 x dp2 (interleaved-1f1b and looped-bfs, V = 2, 3 and 4, reshard_after_forward on
// and off, checkpointing) and pp3 x dp2 gloo ranks (data/ground_truth/parallel/cpu-pp2v2fsdp2-*,
// cpu-pp2v3fsdp2-*, cpu-pp2v4fsdp2-*, cpu-pp3v2fsdp2-*), every rank exact (the V = 4 run with
// reshard_after_forward off is 14 to 16 MB high without the evictions' RESHARD), with the settle wait of Note [gloo's
// reduce-scatter temporary].
// HSDP and a MixedPrecisionPolicy apply to every local stage's units as with one stage (Note
// [Pipeline with FSDP2]); measured on pp2 x (2 x 2) HSDP and pp2 x dp2 gloo ranks with bf16
// parameters (fp32 or bf16 reduction), interleaved-1f1b and looped-bfs
// (cpu-pp2v2hsdp4-*, cpu-pp2v2fsdp2-*-bf16params-*), every rank exact at the first replay.

std::vector<PipelineStageAction> pipeline_multi_order(PipelineSchedule schedule, std::uint64_t ranks,
                                                      std::uint64_t stages_per_rank, std::uint64_t rank,
                                                      std::uint64_t micro_batches) {
  std::vector<PipelineStageAction> out;
  const std::uint64_t P = ranks, V = stages_per_rank, M = micro_batches;
  if (schedule == PipelineSchedule::kLoopedBFS) {
    for (std::uint64_t v = 0; v < V; ++v) {
      for (std::uint64_t k = 0; k < M; ++k) out.push_back({rank + v * P, true, k});
    }
    for (std::uint64_t v = V; v-- > 0;) {
      for (std::uint64_t k = M; k-- > 0;) out.push_back({rank + v * P, false, k});
    }
    return out;
  }
  const std::uint64_t rounds = std::max<std::uint64_t>(1, M / P), per_round = M / rounds;
  const std::uint64_t warmup = std::min((V - 1) * per_round + 2 * (P - 1 - rank), M * V);
  const std::uint64_t ops = M * V, fwd_bwd = ops - warmup;
  std::vector<std::uint64_t> next_fwd(V, 0), next_bwd(V, 0);
  auto forward = [&](std::uint64_t op) {
    const std::uint64_t v = (op / per_round) % V;
    out.push_back({rank + v * P, true, next_fwd[v]++});
  };
  auto backward = [&](std::uint64_t op) {
    const std::uint64_t v = V - 1 - ((op - warmup) / per_round) % V;
    out.push_back({rank + v * P, false, next_bwd[v]++});
  };
  for (std::uint64_t op = 0; op < warmup + fwd_bwd + warmup; ++op) {
    if (op < warmup) {
      forward(op);
    } else if (op < warmup + fwd_bwd) {
      forward(op);
      backward(op);
    } else {
      backward(op);
    }
  }
  return out;
}

std::vector<PipelineLoweredAction> pipeline_add_unshard_reshard(const std::vector<PipelineStageAction>& order) {
  constexpr std::size_t kMaxActiveStages = 3;  // _add_unshard_reshard's max_active_stages default
  using Kind = PipelineLoweredAction::Kind;
  std::vector<PipelineLoweredAction> out;
  std::vector<std::uint64_t> active;  // kept sorted: a set of small ints iterates in ascending order
  for (std::size_t i = 0; i < order.size(); ++i) {
    std::vector<std::uint64_t> next;  // next_stage_indices
    for (std::size_t j = i; j < order.size() && next.size() < kMaxActiveStages; ++j) {
      if (std::find(next.begin(), next.end(), order[j].stage) == next.end()) next.push_back(order[j].stage);
    }
    std::vector<std::uint64_t> evict, fetch;
    for (std::uint64_t s : active) {
      if (std::find(next.begin(), next.end(), s) == next.end()) evict.push_back(s);
    }
    for (std::uint64_t s : next) {
      if (std::find(active.begin(), active.end(), s) == active.end()) fetch.push_back(s);
    }
    for (std::uint64_t s : evict) {
      out.push_back({Kind::kReshard, s, 0});
      active.erase(std::find(active.begin(), active.end(), s));
    }
    for (std::uint64_t s : fetch) {
      out.push_back({Kind::kUnshard, s, 0});
      active.insert(std::upper_bound(active.begin(), active.end(), s), s);
    }
    out.push_back({Kind::kCompute, order[i].stage, i});
  }
  for (std::uint64_t s : active) out.push_back({Kind::kReshard, s, 0});
  return out;
}

void check_pipeline_model(const Architecture& a, const Recipe& r) {
  const std::string pp = "pp: " + std::to_string(r.pp);
  // Phi3Model.forward is Mistral's, with fused projections inside the layers, which a stage calls
  // as they are. GPT-2 and Gemma-2 tie lm_head to the embedding (refused below anyway).
  if (a.family != Family::kLlama && a.family != Family::kMistral && a.family != Family::kQwen2 &&
      a.family != Family::kQwen3 && a.family != Family::kPhi3) {
    throw Error(pp + " with " + std::string(family_name(a.family)) +
                " is not modelled; the stages are split from Llama, Mistral, Qwen2, Qwen3 and Phi-3 models");
  }
  if (a.tie_word_embeddings) {
    throw Error(pp + ": the model ties lm_head to the embedding, which the first and the last stage would each "
                     "need; pipelining tied weights is not modelled");
  }
  if (a.num_layers < r.pp) {
    throw Error(pp + ": the model has " + std::to_string(a.num_layers) + " decoder layers, fewer than the stages");
  }
  if (a.num_layers < r.pp * r.pp_stages_per_rank) {
    throw Error(pp + " x pp_stages_per_rank " + std::to_string(r.pp_stages_per_rank) + ": the model has " +
                std::to_string(a.num_layers) + " decoder layers, fewer than the " +
                std::to_string(r.pp * r.pp_stages_per_rank) + " stages");
  }
}

namespace step {

namespace {
// The module id of the stage module in the tape's module marks (on_module_backward: FSDP2's
// root hooks under a pipeline; ZeRO-3 is not pipelined).
constexpr std::uint32_t kStageModule = 0;
}  // namespace

bool StepBuilder::pp_holds_global(const std::string& name) const {
  if (r_.pp <= 1) return true;
  if (ends_with(name, "embed_tokens.weight")) return rank_ == 0;
  return rank_ == r_.pp - 1;  // the final norm and lm_head
}

bool StepBuilder::pp_holds_layer(std::uint64_t layer) const {
  if (r_.pp <= 1) return true;
  // See Note [Interleaved pipeline schedules]: the rank holds stages rank, rank + pp, ...
  for (std::uint64_t v = 0; v < r_.pp_stages_per_rank; ++v) {
    if (pipeline_stage_layers(a_.num_layers, pp_num_stages(), rank_ + v * r_.pp).holds(layer)) return true;
  }
  return false;
}

std::uint64_t StepBuilder::pp_num_stages() const { return r_.pp * r_.pp_stages_per_rank; }

// See Note [Pipeline parallelism]: the P2P warm-up vote of the first step.
void StepBuilder::pp_warmup_vote(bool first, bool last) {
  op("pipeline.warmup_vote");
  std::vector<TensorId> live;
  const TensorId vote = t_.alloc_bytes(4, Category::kTemporaries);  // torch.tensor([vote])
  live.push_back(vote);
  if (!first) {
    const TensorId received = t_.alloc_bytes(4, Category::kTemporaries);  // zeros(1), received into
    live.push_back(t_.alloc_bytes(4, Category::kTemporaries));           // acc = received * vote
    t_.release(received);
    t_.release(vote);  // the forward vote's local
    live.erase(live.begin());
  }
  if (!last) live.push_back(t_.alloc_bytes(4, Category::kTemporaries));  // the result, received into
  for (TensorId id : live) t_.release(id);
}

// forward_one_chunk of micro-batch `k` (0-based): the stage module's forward (pipeline.py
// _StageModule), and on the last stage the schedule's loss_fn. The graph is taken off the tape.
void StepBuilder::pp_forward(std::uint64_t k, PipelineMicro& mb) {
  const bool first = pp_stage_ == 0, last = pp_stage_ + 1 == pp_num_stages();
  const StageLayers layers = pipeline_stage_layers(a_.num_layers, pp_num_stages(), pp_stage_);
  phase_ = Phase::kForward;
  layer_ = kNoLayer;
  t_.micro = static_cast<std::uint32_t>(k + 1);
  // DDP's forward, under no_sync (See Note [Pipeline with DDP]); FSDP2's root pre-forward.
  dp_->pre_forward();
  // The stage module's nodes: FSDP2's root pre-backward hook sits on its output (See Note
  // [Pipeline with FSDP2]).
  t_.module_begin(kStageModule);
  T hs;
  if (first) {
    op("embed_tokens");
    T ids = input_ids_;  // this micro-batch's rows: a view of the batch
    ids.numel = tok_;
    hs = embedding(global("embed_tokens.weight"), ids, tok_);
    if (sp_ > 1) hs = pp_shard_embedding(hs);  // See Note [Pipeline with tensor parallelism]
  } else {
    op("pipeline.recv");
    // The receive buffer made a leaf that requires grad; fwd_cache keeps it as an input value.
    // Under sequence parallelism the buffer is this rank's shard, the leaf a DTensor around it
    // (See Note [Pipeline with tensor parallelism]).
    mb.leaf = T{pp_recv_act_[pp_slot_ + k], res_tok_ * a_.hidden_size, pol_.param};
    t_.retain(mb.leaf.id);
    requires_grad(mb.leaf);
    hs = t_.ref(mb.leaf);
    dtensor_ = sp_ > 1;
  }
  // position_ids = arange(s).unsqueeze(0) (a view), then the masks the model's own forward builds
  // (Note [Training masks] in step.cpp: a causal one, and Phi-3's, Mistral v0.1's or a sliding
  // Qwen's sliding one), each layer taking its kind's, and cos/sin.
  op("position_ids");
  position_ids_ = fresh(S_, DType::kI64);
  training_masks(hs.dtype);
  rotary_embedding(hs.dtype);
  for (std::uint64_t l = layers.begin; l < layers.end; ++l) {
    const auto layer = static_cast<std::uint32_t>(l);
    mask_ = layer_mask(layer);
    // HF's checkpointing wraps each layer the stage calls (See Note [Pipeline parallelism]).
    dp_->layer_pre_forward(layer);  // FSDP2's unit of the layer (See Note [Pipeline with FSDP2])
    T next = r_.checkpointing != Checkpointing::kNone ? checkpointed_layer(hs, layer) : decoder_layer(hs, layer);
    dp_->layer_post_forward(layer);
    t_.drop(hs);
    hs = next;
  }
  layer_ = kNoLayer;
  if (last) {
    T normed = rms_norm(hs, global("norm.weight"), res_tok_, "norm");
    t_.drop(hs);
    op("lm_head");
    if (r_.loss_parallel) {
      mb.out = pp_vocab_parallel_head(normed);
    } else {
      // Sequence parallelism: PrepareModuleInput all-gathers lm_head's input; the norm's output
      // shard is the stage module's local until it returns (See Note [Pipeline with tensor parallelism]).
      T gathered = sp_ > 1 ? seq_all_gather(normed, /*partial_grad=*/false) : T{};
      dtensor_ = false;
      mb.out = linear(sp_ > 1 ? gathered : normed, global("lm_head.weight"), kNone, a_.vocab_size);
      if (gathered.id != kNone) t_.drop(gathered);
    }
    t_.drop(normed);
  } else {
    mb.out = hs;
  }
  dtensor_ = false;
  t_.module_end();
  t_.drop(cos_);
  t_.drop(sin_);
  drop_training_masks();
  t_.drop(position_ids_);
  exit_autocast();  // bf16-mixed: the stage forward's own autocast context (Note [Pipeline parallelism])
  dp_->post_forward();  // FSDP2's root post-forward: the module has returned
}

// Stage 0 under sequence parallelism: PrepareModuleOutput's hook on the embedding makes its
// output this rank's Shard(1) DTensor, as in the whole model's forward (See Note [Sequence
// parallelism] in tensor_parallel.h); the full output dies.
T StepBuilder::pp_shard_embedding(T& hs) {
  T shard = seq_shard(hs);
  t_.drop(hs);
  dtensor_ = true;
  return shard;
}

// The last stage's lm_head under loss parallelism: ColwiseParallel with Shard(-1) logits, the
// vocab / tp columns of this rank, its input gathered from Shard(1) under sequence parallelism, as
// in vocab_parallel_loss (See Notes [Loss parallel] in tensor_parallel.h and [Pipeline with tensor
// parallelism]); the schedule's loss_fn then runs the vocab-parallel handlers on them.
T StepBuilder::pp_vocab_parallel_head(const T& normed) {
  in_lm_head_ = true;
  dtensor_ = false;
  T logits = colwise_linear(normed, global("lm_head.weight"), kNone, a_.vocab_size / r_.tp);
  in_lm_head_ = false;
  return logits;
}

// backward_one_chunk of micro-batch `k`: its graph put back and run from the loss (last stage) or
// from the output with the received gradient; the received activation's gradient is kept as its .grad.
TensorId StepBuilder::pp_backward(std::uint64_t k, PipelineMicro& mb) {
  const bool last = pp_stage_ + 1 == pp_num_stages();
  phase_ = Phase::kBackward;
  layer_ = kNoLayer;
  t_.micro = static_cast<std::uint32_t>(k + 1);
  t_.put_graph(std::move(mb.graph));
  t_.at(Phase::kBackward, kNoLayer, last ? "loss" : "pipeline.recv_grad");
  ensure_workspace(true);
  TensorId kept = kNone;
  if (last) {
    t_.backward(mb.loss.value, kNone, mb.leaf.value, &kept);
  } else {
    t_.backward(mb.out.value, pp_recv_grad_[pp_slot_ + k], mb.leaf.value, &kept);
  }
  // fwd_cache's entry goes with the call: the output and the input values.
  t_.drop(mb.out);
  if (mb.leaf.id != kNone) t_.drop(mb.leaf);
  return kept;  // the gradient to send back (kNone on the first stage)
}

// Note [Peeks inside a schedule]
// A pipeline stage builds a whole step of M micro-batches before its micro-batch hook runs (the
// schedule's actions interleave micro-batches, so there is no boundary where one micro-batch's
// work is done and the next one's not begun). A probe of the planner that passes its stop limit
// early in the step (Note [Stopping early] in sim/simulator.cpp) used to pay for the whole step
// first: at 64 micro-batches most of the cost of a 70B PP x TP probe. So after every compute
// action the builder lets the replay read the events so far (the hook with micro
// kMidSchedule), which it does only under a stop limit, and stops when it says so.
// What the replay reads early is a storage's category, at its allocation: later changes would
// have been refused by seal_categories' assert, and some happen (with checkpointing, a
// micro-batch's RoPE cos and sin, made once by the stage's forward and only kept by the
// layers' checkpoints, become activations when the first recompute of its backward saves them).
// Such a change marks the trace's categories stale instead (Tape::peeked); the peaks are
// unaffected (they do not depend on categories), and a replay that stays under its limit and so
// reports its breakdown is run again without peeks (estimate.cpp's run). A stopped one reports
// no breakdown anyone reads. Measured on a 70B search over 8 GPUs, the stopped pipeline probes
// now build about a third of the events they built before (bench/README.md, "Peeks inside a
// schedule").
bool StepBuilder::pp_peek(std::uint32_t step) {
  if (!hook_) return false;
  t_.peeked();
  return hook_(t_.trace(), step, kMidSchedule) == MicroBatchNext::kStop;
}

// What a stage sends: the hidden states of a micro-batch, under sequence parallelism this rank's
// shard of them (See Note [Pipeline with tensor parallelism]).
std::uint64_t StepBuilder::pp_act_bytes() const { return res_tok_ * a_.hidden_size * dtype_bytes(pol_.param); }

// The step's batch, every micro-batch at once: the input ids on the rank holding the first stage,
// the labels on the one holding the last.
void StepBuilder::pp_batch(bool first, bool last) {
  t_.at(Phase::kSetup, kNoLayer, "batch");
  if (first) input_ids_ = t_.make(tok_ * r_.grad_accum, DType::kI64, Category::kOther);
  if (last) labels_ = t_.make(tok_ * r_.grad_accum, DType::kI64, Category::kOther);
}

void StepBuilder::pp_begin_step(std::uint32_t step) {
  t_.step = step;
  t_.micro = 1;
  phase_ = Phase::kForward;
  layer_ = kNoLayer;
}

// After the schedule: every micro-batch is in, the step's categories are sealed, and the hook may
// stop the replay (true) before the optimizer steps.
bool StepBuilder::pp_end_step(std::uint32_t step) {
  t_.micro = static_cast<std::uint32_t>(r_.grad_accum);
  t_.seal_categories();
  if (hook_ && hook_(t_.trace(), step, t_.micro) == MicroBatchNext::kStop) return true;
  optimizer_step(step == 1);
  return false;
}

Trace StepBuilder::build_pipeline() {
  check_pipeline_model(a_, r_);
  if (is_multi_stage(r_.pp_schedule)) return build_pipeline_multi();
  pp_stage_ = rank_;
  const bool first = rank_ == 0, last = rank_ == r_.pp - 1;
  const std::uint64_t M = r_.grad_accum;
  const std::uint64_t act_bytes = pp_act_bytes();
  const bool gpipe = r_.pp_schedule == PipelineSchedule::kGPipe;
  const std::uint64_t warmup = std::min<std::uint64_t>(M, r_.pp - rank_);
  pp_batch(first, last);
  for (std::uint32_t step = 1; step <= r_.steps; ++step) {
    pp_begin_step(step);
    if (step == 1) {
      pp_warmup_vote(first, last);
      op("pipeline.recv_buffers");
      if (!first) {
        for (std::uint64_t k = 0; k < M; ++k) pp_recv_act_.push_back(t_.alloc_bytes(act_bytes, Category::kOther));
      }
      if (!last) {
        for (std::uint64_t k = 0; k < M; ++k) pp_recv_grad_.push_back(t_.alloc_bytes(act_bytes, Category::kOther));
      }
    }
    std::vector<PipelineMicro> mbs(M);
    T output;     // the schedule's `output` (and fwd_sends): the latest forward's output
    T warm_send;  // 1F1B: the warm-up's send_work (the last send fired in the warm-up)
    std::vector<TensorId> grad_sends;  // the sent gradients the schedule's variables still hold
    std::vector<T> gpipe_sends;  // GPipe: fwd_sends_to_wait, every forward's send
    std::uint64_t forwards = 0, backwards = 0;
    for (const PipelineAction& act : pipeline_order(r_.pp_schedule, r_.pp, rank_, M)) {
      PipelineMicro& mb = mbs[act.micro];
      if (act.forward) {
        pp_forward(act.micro, mb);
        if (output.id != kNone) t_.drop(output);
        output = t_.ref(mb.out);
        if (!last && gpipe) gpipe_sends.push_back(t_.ref(mb.out));
        if (!last && !gpipe && forwards + 1 < warmup) {
          if (warm_send.id != kNone) t_.drop(warm_send);
          warm_send = t_.ref(mb.out);
        }
        ++forwards;
        if (last) mb.loss = causal_lm_loss(mb.out, /*vocab_parallel=*/r_.loss_parallel);
        mb.graph = t_.take_graph();
      } else {
        const TensorId sent = pp_backward(act.micro, mb);
        // 1F1B: this backward's sends replace the previous one's (bwd_sends, send_work).
        if (!gpipe) {
          for (TensorId g : grad_sends) t_.release(g);
          grad_sends.clear();
        }
        if (sent != kNone) grad_sends.push_back(sent);
        // DDP: the last backward synchronized; the buckets are rebuilt in the next forward
        // (See Note [Pipeline with DDP]).
        if (act.micro + 1 == M) dp_->backward_end();
        ++backwards;
        // 1F1B: after the steady phase's last backward, send_work is rebound to that backward's sends.
        if (!gpipe && forwards == M && backwards == M - warmup + 1 && warm_send.id != kNone) t_.drop(warm_send);
      }
      if (pp_peek(step)) return finish_trace();
    }
    // _update_losses clears _internal_losses; perform_reduce_grad (FSDP2's reductions, then the
    // scaling in place); then the schedule's locals go when _step_microbatches returns: the last
    // output, the send works and `loss`, the last backward's (_maybe_get_loss).
    phase_ = Phase::kBackward;
    op("pipeline.reduce_grad");
    for (std::uint64_t k = 0; k + 1 < M; ++k) {
      if (mbs[k].loss.id != kNone) t_.drop(mbs[k].loss);
    }
    dp_->pipeline_reduce_grad();  // See Note [Pipeline with FSDP2]
    if (mbs[M - 1].loss.id != kNone) t_.drop(mbs[M - 1].loss);
    if (output.id != kNone) t_.drop(output);
    if (warm_send.id != kNone) t_.drop(warm_send);
    for (T& s : gpipe_sends) t_.drop(s);
    for (TensorId g : grad_sends) t_.release(g);
    if (pp_end_step(step)) break;
  }
  return finish_trace();
}

// See Note [Interleaved pipeline schedules]: the P2P warm-up vote of the first step over the
// rank's stages, and what each of its one-element tensors lives for.
void StepBuilder::pp_warmup_vote_multi() {
  op("pipeline.warmup_vote");
  const std::uint64_t stages = pp_num_stages();
  TensorId acc = kNone;  // _warmup_p2p's `acc`
  for (std::uint64_t v = 0; v < r_.pp_stages_per_rank; ++v) {
    const std::uint64_t s = rank_ + v * r_.pp;
    const TensorId vote = t_.alloc_bytes(4, Category::kTemporaries);  // torch.tensor([my_vote])
    TensorId next = vote;                                              // stage 0: acc = my_vote_t
    if (s != 0) {  // the stage before is on another rank (pp >= 2)
      const TensorId received = t_.alloc_bytes(4, Category::kTemporaries);  // zeros(1), received into
      next = t_.alloc_bytes(4, Category::kTemporaries);                     // acc * my_vote_t
      t_.release(received);
      t_.release(vote);  // the call's local, at its return
    }
    if (acc != kNone) t_.release(acc);  // the caller's `acc` rebound
    acc = next;
  }
  TensorId result = acc;  // _warmup_p2p's `result`, first the same tensor as `acc`
  for (std::uint64_t v = r_.pp_stages_per_rank; v-- > 0;) {
    const std::uint64_t s = rank_ + v * r_.pp;
    if (s + 1 == stages) continue;  // the last stage hands on what it was given
    const TensorId received = t_.alloc_bytes(4, Category::kTemporaries);  // zeros(1), received into
    if (result != acc) t_.release(result);  // the caller's `result` rebound
    result = received;
  }
  if (result != acc) t_.release(result);
  t_.release(acc);
}

// See Note [Interleaved pipeline schedules]: a rank holding several stages.
Trace StepBuilder::build_pipeline_multi() {
  const std::uint64_t P = r_.pp, V = r_.pp_stages_per_rank, M = r_.grad_accum;
  const std::uint64_t stages = pp_num_stages();
  const bool first = rank_ == 0, last = rank_ == P - 1;  // holds stage 0 / the last stage
  const std::uint64_t act_bytes = pp_act_bytes();
  const std::vector<PipelineStageAction> order = pipeline_multi_order(r_.pp_schedule, P, V, rank_, M);
  std::vector<PipelineLoweredAction> lowered;
  if (r_.parallel == Parallel::kFsdp) {
    lowered = pipeline_add_unshard_reshard(order);
  } else {
    for (std::size_t i = 0; i < order.size(); ++i) {
      lowered.push_back({PipelineLoweredAction::Kind::kCompute, order[i].stage, i});
    }
  }
  pp_batch(first, last);
  for (std::uint32_t step = 1; step <= r_.steps; ++step) {
    pp_begin_step(step);
    // The schedule's first actions (FSDP2's unshards) are the step's forward, as the tracker
    // labels them, not the previous step's optimizer.
    t_.at(phase_, layer_, "pipeline.step");
    if (step == 1) {
      pp_warmup_vote_multi();
      op("pipeline.recv_buffers");
      pp_recv_act_.assign(V * M, kNone);
      pp_recv_grad_.assign(V * M, kNone);
      for (std::uint64_t v = 0; v < V; ++v) {  // _prepare_forward_infra, stage by stage
        if (rank_ + v * P == 0) continue;
        for (std::uint64_t k = 0; k < M; ++k) pp_recv_act_[v * M + k] = t_.alloc_bytes(act_bytes, Category::kOther);
      }
      for (std::uint64_t v = V; v-- > 0;) {  // _prepare_backward_infra, in reverse
        if (rank_ + v * P + 1 == stages) continue;
        for (std::uint64_t k = 0; k < M; ++k) pp_recv_grad_[v * M + k] = t_.alloc_bytes(act_bytes, Category::kOther);
      }
    }
    std::vector<PipelineMicro> mbs(V * M);
    std::vector<T> sent_outputs;     // send_ops: every SEND_F's works, to the end of step()
    std::vector<TensorId> sent_grads;  // and every SEND_B's
    std::vector<std::uint64_t> backwards(V, 0);
    for (const PipelineLoweredAction& low : lowered) {
      const std::uint64_t v = (low.stage - rank_) / P;
      // FSDP2: the lowering's UNSHARD / RESHARD (See Note [Interleaved pipeline schedules with FSDP2]);
      // a RESHARD after the stage's REDUCE_GRAD frees nothing, one before its backwards what is gathered.
      if (low.kind == PipelineLoweredAction::Kind::kUnshard) {
        pp_dps_[v].pp_unshard();
        continue;
      }
      if (low.kind == PipelineLoweredAction::Kind::kReshard) {
        pp_dps_[v].pp_reshard();
        continue;
      }
      const PipelineStageAction& act = order[low.compute];
      pp_stage_ = act.stage;
      pp_slot_ = v * M;
      PipelineMicro& mb = mbs[v * M + act.micro];
      if (!pp_dps_.empty()) dp_ = &pp_dps_[v];
      dp_->pp_wait_unshard();  // _assert_unsharded
      if (act.forward) {
        pp_forward(act.micro, mb);
        if (act.stage + 1 == stages) {
          mb.loss = causal_lm_loss(mb.out);  // _maybe_compute_loss; _internal_losses keeps it
        } else {
          sent_outputs.push_back(t_.ref(mb.out));  // SEND_F
        }
        mb.graph = t_.take_graph();
      } else {
        const TensorId sent = pp_backward(act.micro, mb);
        if (sent != kNone) sent_grads.push_back(sent);  // SEND_B
        if (++backwards[v] == M) {
          // The stage's last backward (DDP: synchronized; its buckets are rebuilt in its next
          // forward), then REDUCE_GRAD: perform_reduce_grad (FSDP2's deferred post-backwards and
          // final callback), scale_grads in place.
          dp_->backward_end();
          op("pipeline.reduce_grad");
          dp_->pipeline_reduce_grad();
        }
      }
      if (pp_peek(step)) {
        dp_ = &dp_rank_;
        return finish_trace();
      }
    }
    dp_ = &dp_rank_;
    // The end of _step_microbatches: the send works waited and dropped, then _update_losses.
    phase_ = Phase::kBackward;
    for (T& out : sent_outputs) t_.drop(out);
    for (TensorId g : sent_grads) t_.release(g);
    for (PipelineMicro& mb : mbs) {
      if (mb.loss.id != kNone) t_.drop(mb.loss);
    }
    if (pp_end_step(step)) break;
  }
  return finish_trace();
}

}  // namespace step
}  // namespace trainmem::graph
