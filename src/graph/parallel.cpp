#include "graph/parallel.h"

#include <algorithm>

#include "common/checked.h"

namespace trainmem::graph {
namespace {

constexpr std::int32_t kNoLayer = -1;

// Note [DDP buckets]
// DistributedDataParallel(model) with its defaults (torch 2.13, torch/nn/parallel/distributed.py
// and the C++ Reducer; measured: docs/parallelism.md, "DDP: what it allocates"):
//  * construction: one bucket, a flat buffer of every trainable parameter in its gradient
//    dtype. Without find_unused_parameters the first assignment uses an unbounded limit
//    (_BucketConfig.compute_bucket_size_limits), since the buckets are rebuilt from the real
//    gradient order anyway. The broadcast of rank 0's parameters (_sync_module_states) is
//    transient and happens before the step;
//  * every backward: the Reducer's hook after each AccumulateGrad copies grad / world into the
//    parameter's slot of its bucket and, once a bucket is full, all-reduces it; at the end the
//    buckets are copied back into the .grads. All in place: nothing is allocated
//    (gradient_as_bucket_view=False, the default, keeps .grad and bucket apart);
//  * the first forward after a backward (_pre_forward → reducer._rebuild_buckets, once per run):
//    the bucket assignment is broadcast (sync_bucket_indices: small int32 tensors, made on the
//    host and copied to the device), the bucket is freed, then buckets are made in the order the
//    gradients became ready, a bucket closing after the parameter that takes it to 1 MiB (the
//    first, dist._DEFAULT_FIRST_BUCKET_BYTES) or 25 MiB (bucket_cap_mb), one block each;
//  * every forward (broadcast_buffers=True): the module's buffers are broadcast from rank 0
//    through one flattened temporary per dtype (_sync_buffers → _broadcast_coalesced).
// The optimizer is untouched: every rank holds full states.
constexpr std::uint64_t kFirstBucketBytes = std::uint64_t{1} << 20;
constexpr std::uint64_t kBucketCapBytes = std::uint64_t{25} << 20;

// Note [DDP find_unused_parameters]
// DistributedDataParallel(find_unused_parameters=True), what Hugging Face's Trainer passes for a
// peft model, and for a plain model unless it is checkpointed (transformers 5.25,
// Trainer._build_accelerator_args). What changes against Note [DDP buckets] (torch 2.13,
// nn/parallel/distributed.py, c10d reducer; measured on gloo ranks: data/ground_truth/parallel/
// cpu-ddp-*-findunused*):
//  * construction: BucketCapacityConfig.compute_bucket_size_limits gives [1 MiB, 25 MiB] instead
//    of one unlimited bucket, so compute_bucket_assignment_by_size closes a bucket after the
//    parameter that takes it to its limit, walking the trainable parameters in module.parameters()
//    order; the list is reversed before the Reducer allocates the buckets, so the last parameters'
//    bucket is allocated first;
//  * the buckets are never rebuilt (the Reducer rebuilds only for a static graph or without
//    find_unused_parameters), so the second forward frees and allocates nothing;
//  * every forward routes the module's output tensors through _DDPSink, which clones each of them
//    (_ddp_sink_clone): for the CausalLM's output the loss and the logits, cloned in that order
//    once the model has returned; the originals go (the output object is rebuilt from the
//    clones), and so does the logits' clone, which the step drops with the output. The loss'
//    clone is the loss backward starts from; _DDPSink's backward hands the gradient on;
//  * the Reducer keeps a map of locally used parameters, an int32 each: on the host (not pinned)
//    and on the parameters' device (initialize_local_used_map), so one tensor on a GPU and both
//    on the CPU; prepare_for_backward walks the autograd graph to mark unused parameters and
//    allocates nothing.

// Note [FSDP2 units]
// fully_shard(layer) on every decoder layer, then fully_shard(model) for the root (torch 2.13,
// torch/distributed/fsdp/_fully_shard/; measured: docs/parallelism.md, "FSDP2: what it
// allocates"). One FSDPParamGroup per unit:
//  * fully_shard: each parameter's dim 0 is split in `world` chunks of ceil(dim0 / world) rows and
//    this rank's chunk lives in a padded buffer of that size (_fsdp_param.py,
//    _init_sharded_param): the sharded parameters, weights for the whole run; the original
//    parameters are freed. The engine never gives the full parameters memory: a model too big
//    for one GPU is built on the meta device (or the CPU) and sharded before it reaches the GPU,
//    and the measuring side starts tracking after fully_shard. Rank 0 holds the first, full-size
//    chunk, so it is the rank with the most memory (its optimizer states are the largest);
//  * all-gather (the unit's pre-forward, pre-backward or a prefetch): one flat buffer of world x
//    Σ padded shard elements (foreach_all_gather), then every parameter's unsharded storage,
//    world x its padded shard, is (re)allocated with storage.resize_ and filled from the buffer
//    (foreach_all_gather_copy_out), and the buffer is freed. The unsharded storages are freed
//    again with resize_(0) whatever still references them (autograd's saved weights are the same
//    storages): Tape::resize. In forward (implicit prefetch, wait_for_unshard) the flat buffer is
//    not freed after the copy-out but kept in comm_ctx.all_gather_state until the next unit's
//    copy-out has run (the walrus local in wait_for_unshard holds it to the end of the call) or the
//    root's post-forward, after the model's loss; in backward it is freed after the copy-out;
//  * forward: the root gathers in its pre-forward, before the embedding, and keeps its
//    parameters until its post-backward (the root is never resharded after forward: lazy init
//    sets its post_forward_mesh_info to None); each layer gathers in its pre-forward and frees in
//    its post-forward (reshard_after_forward=True);
//  * backward: a unit's pre-backward (a hook on its forward outputs, so before its last node
//    runs) waits for its gather and then prefetches the unit before it in post-forward order:
//    the root's pre-backward, at the loss, issues the last layer's all-gather buffer, layer k's
//    issues layer k-1's. Its post-backward (RegisterPostBackwardFunction on its forward inputs,
//    so after its first node) takes the unsharded .grads, reshards, drops the previous unit's
//    reduce-scatter state and runs foreach_reduce: the reduce-scatter input (world x Σ padded
//    shard, the gradients copied in and then freed), the output (Σ padded shard), whose views are
//    the sharded .grads (added into existing ones under gradient accumulation). The input is kept
//    in comm_ctx.reduce_scatter_state until the next unit's post-backward. The root has no input
//    that requires grad: it reduces in the final callback of the backward, which then drops the
//    last reduce-scatter state (_fsdp_param_group.py post_backward, _fsdp_state.py);
//  * gloo's reduce_scatter_tensor makes a world x output temporary that the CPU measurements see
//    inside the collective (gradients; Note [gloo's reduce-scatter temporary]); NCCL allocates
//    nothing through the caching allocator. See Note [Collectives on CUDA].
// Everything a collective allocates is weights (all-gather) or gradients (reduce-scatter), as
// the measuring side counts it (docs/parallelism.md, "Categories"). A pipeline stage's units run
// their post-backward without reduction or reshard until perform_reduce_grad: See Note [Pipeline
// with FSDP2] in pipeline.cpp.

// Note [FSDP2 variants]
// The knobs of Recipe::fsdp, as torch 2.13's FSDP2 runs them (torch/distributed/fsdp/_fully_shard/):
//  * reshard_after_forward=False on the layers (_fsdp_init.py _get_post_forward_mesh_info: no
//    post_forward_mesh_info): FSDPParamGroup.reshard returns at once in forward, so every layer
//    stays gathered from its pre-forward to its post-backward. In backward, unshard() of a group
//    that is unsharded is a no-op, so neither the pre-backward nor the prefetch all-gathers; the
//    post-backward reshards (reshard_after_backward) and reduce-scatters as with full sharding.
//    The integer form (reshard to a smaller mesh) is not a knob;
//  * HSDP, a 2-D mesh (replicate, shard) (_fsdp_init.py _get_mesh_info: HSDPMeshInfo): parameters
//    are sharded over the shard group only (gpus / replicate ranks), the all-gathers and the
//    reduce-scatter run in it, and foreach_reduce then all-reduces the reduce-scatter output across
//    the replicate group in place (_fsdp_collectives.py). With a reduce_dtype other than the
//    parameters' dtype that reduce-dtype output is held in the group's _all_reduce_state until
//    finalize_backward at the end of backward; otherwise it is the sharded gradient itself;
//  * MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype) over an fp32 model (_fsdp_param.py
//    init_dtype_attrs; a reduce_dtype equal to param_dtype is clamped to None): the sharded
//    parameters, their gradients and the optimizer's states stay fp32; the all-gather first casts
//    the unit's shards into one flat bf16 buffer (_get_param_all_gather_inputs, foreach copy),
//    freed when foreach_all_gather returns after allocating the bf16 all-gather output; the
//    unsharded parameters, the compute and autograd's gradients are bf16 (the step is built as
//    bf16-true's); foreach_reduce makes its input and output in reduce_dtype (None: bf16) and, when
//    that is not fp32, casts the output to a new fp32 shard (_to_dtype_if_needed) whose views are
//    the sharded .grads. output_dtype stays None and cast_forward_inputs True (the defaults): the
//    layers' floating inputs are bf16 already, so it casts nothing. A parameter that is bf16
//    already has its param_dtype set to None by init_dtype_attrs: it is sharded, all-gathered and
//    used as it is, and only the others go through the foreach copy (WrappedParam::keeps_dtype):
//    a half-loaded LoRA model's frozen weights (Note [Autocast over an FSDP2 policy] in
//    step_parameters.cpp), a QLoRA base's packed weights stored as bf16 (its fp32 rest and the
//    adapters are cast). Packed uint8 weights under a policy are refused (recipe validation).

// Note [FSDP2 CPU offload]
// fully_shard(..., offload_policy=CPUOffloadPolicy()) on every unit, pin_memory=True by default
// (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_collectives.py). What
// changes against Note [FSDP2 units]; MIRRORED FROM THE SOURCE, NOT MEASURED (a CPU run cannot
// tell host copies from device ones: docs/parallelism.md):
//  * fully_shard: each padded shard is moved to the CPU and pinned (_init_sharded_param:
//    .cpu().pin_memory(), one pinned tensor per parameter); the GPU holds no sharded parameter;
//  * all-gather: FSDPParam.all_gather_inputs copies each shard to the GPU
//    (.to(device, non_blocking=True), one tensor per parameter in fsdp_params order: the foreach
//    copy of _get_param_all_gather_inputs is off under offload) and, with a param_dtype policy,
//    casts it (_to_dtype_if_needed: the cast is made while the fp32 copy is alive, which goes when
//    all_gather_inputs returns). foreach_all_gather then allocates the flat output as without
//    offload and copies the inputs into this rank's slice of it in place; the inputs live until
//    foreach_all_gather returns (its flattened all_gather_inputs list holds them);
//  * reduce-scatter: as without offload up to the sharded gradient (the reduce-scatter output, or
//    its cast to the parameters' dtype); foreach_reduce then copies each parameter's view of it to
//    the CPU (.to("cpu", non_blocking=True) into pinned memory while no .grad exists; under
//    gradient accumulation later micro-batches copy to pageable memory and add into the .grad) and
//    keeps no reference to the GPU output, which is freed when foreach_reduce returns;
//  * the optimizer holds the CPU DTensors: its states are created on the host (pageable,
//    zeros_like the shard) and its step runs there (AdamW and SGD take the single-tensor path
//    on CPU tensors, foreach being a CUDA default; adamw-fused runs the fused CPU kernel, which
//    torch's fused optimizers support on the CPU; either keeps a 4-byte fp32 step per tensor);
//    nothing of it is on the GPU.
// Host memory of the rank (Estimate::host): each parameter's pinned shard and its pinned sharded
// .grad (CachingHostAllocator rounds each pinned tensor up to a power of two; the .grads' blocks
// go back to its cache at zero_grad and are taken again by the next step's copies) and the
// optimizer states. Transients are not counted (the pageable .cpu() copy before pinning, the
// pageable gradient copies under accumulation, the CPU optimizer's per-parameter temporaries).
// On CUDA the copies run on the all-gather copy-in and reduce-scatter streams (the replay has
// one: Note [Collectives on CUDA]).

// Note [LoRA under FSDP2]
// fully_shard over a peft model (torch 2.13's _fully_shard, peft 0.21), as Accelerate and
// torchtune run LoRA on several GPUs; measured on gloo ranks (data/ground_truth/parallel/
// cpu-fsdp-*-lora*, cpu-hsdp-*-lora*), every rank exact. What changes against Note [FSDP2 units]:
//  * the units hold the frozen base and the adapters alike: a lora.Linear registers base_layer,
//    then lora_A and lora_B, so each projection's adapters follow its weight and bias in
//    fsdp_params (module.parameters()); every parameter is sharded, adapters included, and only
//    the shards ever reach the device;
//  * the all-gather gathers every parameter. Under bf16-true the base is bf16 and peft's adapters
//    fp32 (cast_adapter_dtype), and an all-gather input of several dtypes is gathered as bytes
//    (_get_all_gather_input_metadatas: uint8), so the flat buffer is world x the unit's shard
//    bytes. A param_dtype policy casts base and adapters alike;
//  * post_backward reduce-scatters the parameters that have a gradient, the adapters: the input
//    is world x their padded shards and the output their shards, in the adapters' dtype
//    (_init_mp_dtypes takes the original and reduce dtypes of the trainable parameters only). The
//    root's parameters (embedding, final norm, lm_head) are all frozen: it reduces nothing, but
//    its post-backward still recycles the previous reduce-scatter input
//    (reduce_scatter_max_input_buffers 1) before it finds nothing to reduce;
//  * a unit's post-backward hook is registered on forward inputs that require grad
//    (_register_post_backward_hook). Layer 0's input is the frozen embedding's output, which
//    requires grad only under checkpointing (enable_input_require_grads, Note [LoRA]); without it
//    layer 0 has no hook and _root_post_backward_final_callback runs its post-backward, after the
//    root's (all_states order);
//  * the optimizer holds the adapters' shards (local_numel), fp32;
//  * under CPUOffloadPolicy (Note [FSDP2 CPU offload], mirrored, not measured) every shard is
//    pinned on the host, the frozen ones too, and only the adapters have host .grads and states.
// DeepSpeed's offload with LoRA stays refused (unmeasured).
//
// Note [QLoRA under FSDP2]
// fully_shard over get_peft_model(prepare_model_for_kbit_training(<4-bit base>)), bitsandbytes
// 0.50 (measured: data/ground_truth/parallel/cpu-fsdp-*-qlora*, *-4bit*, cpu-hsdp-*-4bit*, every
// rank exact). What changes against Note [LoRA under FSDP2]:
//  * a Params4bit is a parameter like any other to FSDP2: its packed uint8 storage, shape
//    (packed bytes, 1), is sharded along dim 0 and gathered as bytes with the unit's fp32 rest
//    and adapters (stored as bf16: rows of two bytes, Note [The packed weights' storage dtype]).
//    Only the shard reaches the device (StepBuilder::add_param);
//  * its QuantState (absmax, code, and with double quant the offset and the nested state) is no
//    parameter: it stays whole on every rank, where it was loaded, and Linear4bit keeps it as the
//    module's quant_state, which it hands back to the gathered weight before each matmul
//    (fix_4bit_weight_quant_state_from_module). The measuring side reads it from the module once
//    the parameter is a DTensor (models.quant_state_tensors);
//  * a biased 4-bit layer under a half compute dtype recasts its fp32 bias in step 1's first
//    forward (Note [Quantized linear biases]); the recast swaps the data of FSDP2's unsharded
//    parameter for a half copy that FSDP2 never frees, so the copy lives for the run on every
//    rank while the fp32 bias is still gathered and freed with its unit;
//  * a param_dtype policy would cast the packed weights for the all-gather: refused.
// The time model's all-gathers carry half a byte per packed element (plan/time.cpp). ZeRO-3 over
// a 4-bit base: Note [QLoRA under ZeRO-3] in zero3.cpp.

// Note [Collectives on CUDA]
// The ground truth for data parallelism is CPU (gloo) only; what the engine assumes on CUDA is
// read from torch 2.13's sources and not measured. DDP's buckets and FSDP2's buffers are the
// same tensors there. NCCL keeps its own buffers outside the caching allocator (they belong with
// the CUDA context), so the engine adds nothing for them. FSDP2 runs its all-gathers and
// reduce-scatters on separate streams (all_gather_copy_in/all_gather/reduce_scatter streams in
// FSDPCommContext) and frees their buffers with record_stream semantics: a block freed on one
// stream is reused by another only after the collective's event, which can keep blocks reserved
// longer than the CPU order shows. The replay has one stream and frees at the CPU order, so on
// CUDA its reserved bytes can be below the real ones by about one unit's buffers. The caching
// allocator keys free blocks by stream, so each of those streams also has its own pool on CUDA:
// the all-gather copy-in stream allocates the flat all-gather input and, under CPU offload (Note
// [FSDP2 CPU offload]), every shard's host-to-device copy and its cast; the reduce-scatter stream
// allocates the reduce-scatter output (with offload the sharded gradient's only GPU copy, freed
// once the device-to-host copy is queued). The replay's one pool lets the compute stream reuse
// those blocks, which the real allocator does not, so this is one more way its reserved bytes
// can fall short on CUDA. DDP's all-reduces run in place on the buckets.

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0); }

}  // namespace

DataParallel::DataParallel(Tape& tape, const Recipe& recipe, bool cuda, std::uint64_t rank)
    : t_(tape), kind_(recipe.parallel), world_(recipe.gpus), cuda_(cuda), rank_(rank), grad_accum_(recipe.grad_accum) {
  TRAINMEM_ASSERT(rank < world_, "rank outside the world");
  // offload_optimizer (zero_offload.cpp, zero3_offload.cpp) and ZeRO-3's offload_param.
  offload_ = recipe.offload == Offload::kOptimizer || recipe.offload == Offload::kBoth;
  offload_params_ = recipe.offload == Offload::kParams || recipe.offload == Offload::kBoth;
  forward_no_sync_ = recipe.pp > 1;  // See Note [Pipeline with DDP] in pipeline.cpp
  find_unused_ = recipe.ddp_find_unused_parameters;  // See Note [DDP find_unused_parameters]
  bucket_view_ = recipe.ddp_gradient_as_bucket_view;  // See Note [DDP gradient_as_bucket_view]
  ddp_no_sync_ = kind_ == Parallel::kDdp && recipe.ddp_no_sync;  // See Note [DDP no_sync]
  if (kind_ != Parallel::kFsdp) return;
  fsdp_offload_ = recipe.offload == Offload::kBoth;  // See Note [FSDP2 CPU offload]
  optimizer_ = recipe.optimizer;
  // See Note [FSDP2 variants].
  const Fsdp& f = recipe.fsdp;
  // Under context parallelism FSDP2 shards over every rank of the dp_shard x cp mesh (Note
  // [Context parallelism under FSDP2] in context_parallel.h).
  shard_world_ = world_ / f.replicate * recipe.cp;
  // The mesh (replicate, shard) is row-major: rank r's place in its shard group is r % shard size.
  // Under CP the dp_shard x cp mesh's order is not modelled: every rank takes rank 0's chunks.
  shard_rank_ = recipe.cp > 1 ? 0 : rank_ % shard_world_;
  hsdp_ = f.replicate > 1;
  // TP x DP (a tensor-parallel model under FSDP2): FSDP2 shards each rank's TP-local parameters
  // over the dp group, which is what wrap() does with the local model the step builder passes.
  reshard_after_forward_ = f.reshard_after_forward;
  pp_no_sync_ = recipe.pp > 1;  // See Note [Pipeline with FSDP2] in pipeline.cpp
  fsdp_no_sync_ = f.no_sync;    // See Note [FSDP2 no_sync]
  cast_params_ = f.param_dtype != FsdpDtype::kNone;
  // init_dtype_attrs clamps a reduce_dtype equal to param_dtype to None.
  if (f.reduce_dtype != FsdpDtype::kNone && f.reduce_dtype != f.param_dtype) {
    reduce_dtype_ = f.reduce_dtype == FsdpDtype::kFp32 ? DType::kF32 : DType::kBF16;
  }
}

// `registration` (module.parameters() order), or the table's order when the caller gave none.
static std::vector<std::uint32_t> registration_or_table(const std::vector<std::uint32_t>& registration, std::size_t n) {
  if (!registration.empty()) {
    std::vector<bool> seen(n, false);
    for (std::uint32_t i : registration) {
      TRAINMEM_ASSERT(i < n && !seen[i], "the registration order is not a permutation of the parameters");
      seen[i] = true;
    }
    TRAINMEM_ASSERT(registration.size() == n, "the registration order misses parameters");
    return registration;
  }
  std::vector<std::uint32_t> order(n);
  for (std::uint32_t i = 0; i < n; ++i) order[i] = i;
  return order;
}

void DataParallel::wrap(std::vector<WrappedParam>& params, const std::vector<std::vector<std::uint32_t>>& layers,
                        const std::vector<std::uint32_t>& root,
                        const std::vector<std::pair<DType, std::uint64_t>>& buffers,
                        const std::vector<std::uint32_t>& registration) {
  if (kind_ == Parallel::kNone) return;
  params_ = params;
  buffers_ = buffers;
  for (std::uint32_t i = 0; i < params.size(); ++i) {
    const std::uint32_t slot = params[i].slot;
    if (param_of_slot_.size() <= slot) param_of_slot_.resize(slot + 1, kNone);
    param_of_slot_[slot] = i;
  }
  if (zero3()) {
    registration_ = registration_or_table(registration, params.size());
    z3_ds_id_.assign(params.size(), 0);
    for (std::uint32_t k = 0; k < registration_.size(); ++k) z3_ds_id_[registration_[k]] = k;
    zero3_wrap();
    return;
  }
  if (zero()) {
    // The ZeRO optimizer's flat group holds what the client optimizer was handed: the trainable
    // parameters (LoRA: the adapters, whose own storages go once they are views of it; See Note
    // [DeepSpeed ZeRO-1/2]), in its order, module.parameters() (measured: rank 1 of a ZeRO-1
    // Qwen3, whose partition begins with a q_proj). The frozen base keeps its storages.
    std::vector<std::uint32_t> kept;
    for (std::uint32_t i : registration_or_table(registration, params.size())) {
      if (params[i].trainable) kept.push_back(i);
    }
    const bool frozen = kept.size() < params.size();
    params_.clear();
    param_of_slot_.assign(param_of_slot_.size(), kNone);
    for (std::uint32_t i : kept) {
      param_of_slot_[params[i].slot] = static_cast<std::uint32_t>(params_.size());
      params_.push_back(params[i]);
    }
    zero_wrap();
    for (std::size_t k = 0; k < kept.size(); ++k) {
      if (frozen) t_.release(params[kept[k]].storage);  // the adapter's own storage
      params[kept[k]].storage = params_[k].storage;
    }
    return;
  }
  if (kind_ == Parallel::kDdp) {  // See Note [DDP buckets]
    t_.at(Phase::kSetup, kNoLayer, "ddp.reducer");
    if (find_unused_) {  // See Note [DDP find_unused_parameters]
      std::vector<std::uint64_t> sizes = bucket_sizes(registration_or_table(registration, params.size()));
      for (std::size_t b = sizes.size(); b-- > 0;) buckets_.push_back(t_.alloc_bytes(sizes[b], Category::kGradients));
      // initialize_local_used_map: an int32 per trainable parameter on the host (never pinned),
      // and its copy on the parameters' device; on the CPU both are.
      std::uint64_t used = 0;
      for (const WrappedParam& p : params) used += p.storage != kNone && p.trainable;
      for (int copies = cuda_ ? 1 : 2; copies-- > 0;) t_.alloc_bytes(used * 4, Category::kOther);
      return;
    }
    std::uint64_t bytes = 0;
    for (const WrappedParam& p : params) {
      if (p.storage == kNone || !p.trainable) continue;  // another pipeline stage's, or frozen (LoRA)
      bytes = detail::add(bytes, p.numel * dtype_bytes(p.dtype), "bucket bytes");
    }
    buckets_.push_back(t_.alloc_bytes(bytes, Category::kGradients));
    bucket_of_.assign(params_.size(), 0);
    return;
  }
  // See Note [FSDP2 units]: the layers are wrapped first, then the root.
  t_.at(Phase::kSetup, kNoLayer, "fsdp.fully_shard");
  shard_numel_.assign(params.size(), 0);
  unsharded_.assign(params.size(), kNone);
  fsdp_accumulated_.assign(params.size(), kNone);
  units_.clear();
  host_ = HostMemory{};
  for (const auto& l : layers) units_.emplace_back().params = l;
  units_.emplace_back().params = root;
  for (Unit& u : units_) {
    // Another pipeline stage's parameter is not in this stage's module: no shard, not in the unit.
    u.params.erase(std::remove_if(u.params.begin(), u.params.end(),
                                  [&](std::uint32_t pi) { return params[pi].storage == kNone; }),
                   u.params.end());
    for (std::uint32_t pi : u.params) {
      WrappedParam& p = params[pi];
      TRAINMEM_ASSERT(p.rows == 0 || p.numel % p.rows == 0, "parameter rows do not divide its size");
      const std::uint64_t shard = chunk_numel(p, 0);  // padded to rank 0's, the full chunk
      shard_numel_[pi] = shard;
      u.gather_bytes = detail::add(u.gather_bytes, detail::mul(shard, dtype_bytes(p.dtype), "shard bytes"), "shard bytes");
      if (orig_dtype(p) != p.dtype) {
        u.cast_bytes = detail::add(u.cast_bytes, detail::mul(shard, dtype_bytes(p.dtype), "shard bytes"), "shard bytes");
      }
      if (p.trainable) {  // the dtypes FSDP2 reduces in (uniform over the trainable: _init_mp_dtypes)
        u.dtype = p.dtype;  // the model's dtype: with a param_dtype policy the compute's, over fp32 shards
        orig_dtype_ = orig_dtype(p);
      }
      if (fsdp_offload_) {
        fsdp_offload_host(shard, p);  // the shard, its .grad and its optimizer states on the host
      } else {
        t_.alloc_bytes(detail::mul(shard, dtype_bytes(orig_dtype(p)), "shard bytes"), Category::kWeights);  // the run
      }
      unsharded_[pi] = t_.reserve(detail::mul({shard, shard_world_, dtype_bytes(p.dtype)}, "unsharded parameter bytes"),
                                  Category::kWeights);
      p.storage = unsharded_[pi];  // the full parameter's storage never had memory (step_parameters.cpp add_param)
      params_[pi].storage = p.storage;
    }
  }
}

void DataParallel::pre_forward() {
  if (zero3()) return zero3_reset_step();
  if (kind_ == Parallel::kDdp) {
    if (backward_seen_ && !rebuilt_ && !find_unused_) rebuild_buckets();
    // require_forward_param_sync: _post_forward sets it after a forward that synchronizes and
    // clears it after one under no_sync, so a pipeline's stage broadcasts its buffers in the run's
    // first forward only, and no_sync accumulation in each step's first (Note [DDP no_sync]).
    const bool broadcast = !buffers_.empty() && forward_param_sync_;
    forward_param_sync_ = ddp_sync_ && !forward_no_sync_;
    if (!broadcast) return;
    t_.at(Phase::kForward, kNoLayer, "ddp.broadcast_buffers");
    std::vector<std::pair<DType, std::uint64_t>> flat;  // one flattened tensor per dtype
    for (const auto& buffer : buffers_) {
      const DType d = buffer.first;  // (not a structured binding: clang 14 cannot capture one)
      auto it = std::find_if(flat.begin(), flat.end(), [&](const auto& f) { return f.first == d; });
      if (it == flat.end()) flat.push_back(buffer);
      else it->second += buffer.second;
    }
    std::vector<TensorId> ids;
    for (const auto& f : flat) ids.push_back(t_.alloc_bytes(f.second, Category::kTemporaries));
    for (TensorId id : ids) t_.release(id);
  } else if (kind_ == Parallel::kFsdp) {
    Unit& root = units_.back();
    t_.at(Phase::kForward, kNoLayer, "fsdp.all_gather");  // the root's pre-forward: the forward has begun
    if (!root.gathered && !root.params.empty()) {  // a middle pipeline stage's root holds none
      if (root.flat == kNone) all_gather(root);
      copy_out(root);
    }
  }
}

void DataParallel::layer_pre_forward(std::uint32_t layer) {
  if (kind_ != Parallel::kFsdp) return;
  Unit& u = units_[layer];
  if (u.gathered) return;
  if (u.flat == kNone) all_gather(u);
  copy_out(u);
}

void DataParallel::layer_post_forward(std::uint32_t layer) {
  // reshard_after_forward=False: the post-forward reshard returns at once (See Note [FSDP2 variants]).
  if (kind_ == Parallel::kFsdp && reshard_after_forward_) reshard(units_[layer]);
}

void DataParallel::post_forward() {
  if (kind_ != Parallel::kFsdp || forward_all_gather_ == kNone) return;
  // The root's post-forward frees the last all_gather_state (See Note [FSDP2 units]).
  t_.release(forward_all_gather_);
  forward_all_gather_ = kNone;
}

void DataParallel::backward_begin() {
  post_forward();  // a no-op where the step builder has called it
}

void DataParallel::root_pre_backward() {
  if (kind_ != Parallel::kFsdp || units_.size() < 2) return;
  // The root's pre-backward prefetches the last layer (see Note [FSDP2 units]): a pipeline
  // stage's own last layer.
  auto it = std::find_if(units_.rbegin() + 1, units_.rend(), [](const Unit& u) { return !u.params.empty(); });
  if (it == units_.rend()) return;
  Unit& last = *it;
  if (last.gathered || last.flat != kNone) return;
  t_.at(Phase::kBackward, kNoLayer, "fsdp.all_gather");
  all_gather(last);
}

void DataParallel::layer_change(std::int32_t from, std::int32_t to) {
  if (kind_ != Parallel::kFsdp) return;
  // Under a pipeline the post-backward neither reduces nor reshards (See Note [Pipeline with FSDP2]).
  // A unit whose forward inputs require no grad has no post-backward hook (_register_post_backward_hook):
  // the root's final callback runs it (See Note [LoRA under FSDP2]).
  if (from >= 0 && (from > 0 || first_layer_hooked_)) {
    Unit& u = units_[static_cast<std::size_t>(from)];
    if (pp_no_sync_) {
      pp_post_backward(u);
    } else if (!fsdp_sync_) {
      no_sync_post_backward(u);
    } else {
      reduce(u);
    }
  }
  if (to >= 0) {
    Unit& u = units_[static_cast<std::size_t>(to)];
    if (!u.gathered) {
      if (u.flat == kNone) all_gather(u);
      copy_out(u);
    }
    if (to > 0) {  // not into another pipeline stage's layer: the stage's first prefetches its root
      Unit& prev = units_[static_cast<std::size_t>(to - 1)];
      if (!prev.params.empty() && !prev.gathered && prev.flat == kNone) all_gather(prev);
    }
  }
}

void DataParallel::param_ready(std::uint32_t slot) {
  if (zero3()) {
    const std::uint32_t pi = slot < param_of_slot_.size() ? param_of_slot_[slot] : kNone;
    if (pi != kNone) zero3_param_ready(pi);
    return;
  }
  if (zero()) return zero_param_ready(slot);
  if (kind_ != Parallel::kDdp || !ddp_sync_) return;  // under no_sync the Reducer's hooks return at once
  const std::uint32_t pi = slot < param_of_slot_.size() ? param_of_slot_[slot] : kNone;
  if (pi == kNone) return;
  if (bucket_view_) grad_to_bucket_view(slot, pi);
  if (backward_seen_) return;
  if (std::find(ready_order_.begin(), ready_order_.end(), pi) == ready_order_.end()) ready_order_.push_back(pi);
}

// Note [DDP no_sync]
// Accelerate's accumulate() and Hugging Face's Trainer (its training loop calls accelerator.no_sync
// itself, trainer.py) run the forward and the backward of every micro-batch but the step's last
// inside DistributedDataParallel.no_sync(), which clears require_backward_grad_sync (torch 2.13,
// torch/nn/parallel/distributed.py; measured on gloo ranks: data/ground_truth/parallel/
// cpu-ddp-*-nosync-*). In those micro-batches:
//  * _pre_forward neither prepares the Reducer nor, once the buckets are rebuilt, rebuilds them;
//    _post_forward calls no prepare_for_backward and clears require_forward_param_sync, so the
//    next forward broadcasts no buffers (the step's first forward does: the last one set it);
//  * the Reducer's autograd hooks return at once (expect_autograd_hooks_ is false): the .grads
//    accumulate as on one GPU, and nothing is copied into the buckets or recorded for the rebuild.
//    With gradient_as_bucket_view the .grads are then tensors of their own beside the buckets
//    (two copies of the gradients) until the last micro-batch's hooks copy them into their slots;
//  * the rebuild waits for the first forward after a synchronizing backward: the second step's
//    first, where without no_sync it is the first step's second micro-batch.
// The last micro-batch runs as without no_sync. Its .grads are those of every micro-batch, so the
// step's one all-reduce moves what every micro-batch's used to (the planner's time, plan/time.cpp).
// The replay skips repeated micro-batches up to the last, which it replays (step.cpp).

// Note [DDP gradient_as_bucket_view]
// DistributedDataParallel(gradient_as_bucket_view=True) (torch 2.13, the c10d Reducer; measured on
// gloo ranks: data/ground_truth/parallel/cpu-ddp-*-gradview-*). What changes against Note [DDP
// buckets]:
//  * the Reducer's hook after a parameter's AccumulateGrad copies the .grad into its slot of the
//    bucket and, unless the .grad is that slot already, makes it the slot (a view), so the
//    gradient autograd made goes there and then: it was never a .grad for long (temporaries). From
//    then on the next micro-batch's gradient is added into the view in place, and the optimizer
//    reads the views; zero_grad(set_to_none=True) drops them and the next step starts over;
//  * nothing is copied back into the .grads at the end of the backward (in place either way);
//  * the rebuild (the first forward after a backward) drops the old buckets, makes the new ones and
//    points each .grad at its new slot: where .grads are views of the old bucket (a second
//    micro-batch's forward), it goes after the last new bucket is made, not before the first.
// So a rank holds one copy of its gradients, the buckets, where the default holds two.
void DataParallel::grad_to_bucket_view(std::uint32_t slot, std::uint32_t pi) {
  TRAINMEM_ASSERT(pi < bucket_of_.size(), "a parameter without a bucket");
  const TensorId bucket = buckets_[bucket_of_[pi]];
  const TensorId g = t_.param_grad(slot);
  if (g == kNone || g == bucket) return;
  // The gradient AccumulateGrad has just made is a temporary; under no_sync the .grad the earlier
  // micro-batches accumulated was a gradient all along (Note [DDP no_sync]).
  if (!ddp_no_sync_ || grad_accum_ == 1) t_.set_category(g, Category::kTemporaries);
  t_.release(g);
  t_.retain(bucket);
  t_.set_param_grad(slot, bucket);
}

void DataParallel::backward_end() {
  if (zero3()) return zero3_backward_end();
  if (zero()) return zero_backward_end();
  if (kind_ == Parallel::kDdp && ddp_sync_) backward_seen_ = true;  // the Reducer saw its ready order
}

void DataParallel::final_callback() {
  if (kind_ != Parallel::kFsdp) return;
  if (pp_no_sync_) {
    // Under a pipeline is_last_backward is False and reduce_grads off: the post-backwards left to
    // the callback (the root's, all_states' first) reduce nothing, and nothing is finalized (See
    // Note [Pipeline with FSDP2]).
    for_all_states([this](Unit& u) { pp_post_backward(u); });
    return;
  }
  if (!fsdp_sync_) {
    // is_last_backward stays True under set_requires_gradient_sync(False): the post-backwards no
    // hook ran reduce nothing, then finalize_backward (See Note [FSDP2 no_sync]).
    for_all_states([this](Unit& u) {
      if (!u.posted) no_sync_post_backward(u);
    });
    drop_reduce_states();
    return;
  }
  // _root_post_backward_final_callback, queued by the root's pre-backward: it runs inside the
  // backward call (the seed gradient is still held); the root (and any unit whose post-backward
  // did not run) reduces, then the last reduce-scatter state is dropped.
  for_all_states([this](Unit& u) {
    if (!u.posted) reduce(u);
  });
  drop_reduce_states();
}

// finalize_backward: _all_reduce_state goes (HSDP's reduce-dtype outputs), and so does the last
// reduce-scatter's input.
void DataParallel::drop_reduce_states() {
  for (Unit& u : units_) u.posted = false;  // the groups are IDLE again
  for (TensorId id : all_reduce_inputs_) t_.release(id);
  all_reduce_inputs_.clear();
  if (pending_reduce_input_ != kNone) {
    t_.release(pending_reduce_input_);
    pending_reduce_input_ = kNone;
  }
}

void DataParallel::pipeline_reduce_grad() {
  if (kind_ != Parallel::kFsdp) return;
  // See Note [Pipeline with FSDP2]: post_backward over all_states, the root's first and then the
  // layers' in forward order, each resharding and reduce-scattering what its gradients
  // accumulated; then the final callback (is_last_backward) drops the last reduce-scatter state.
  t_.at(t_.phase(), kNoLayer, "fsdp.post_backward");
  for_all_states([this](Unit& u) { reduce(u); });
  drop_reduce_states();
}

// The UNSHARD action: unshard(async_op=True) on every FSDPModule of the stage module, in
// modules() order (the stage module, the root, then its decoder layers): each unit not gathered
// issues its all-gather, and its buffer waits in the group's _all_gather_result.
void DataParallel::pp_unshard() {
  if (kind_ != Parallel::kFsdp) return;
  t_.at(t_.phase(), kNoLayer, "pipeline.unshard");
  // modules() order here is all_states' order: the root first, then the layers.
  for_all_states([this](Unit& u) {
    if (u.params.empty() || u.gathered || u.flat != kNone) return;
    all_gather(u);
    pp_unshard_ops_.push_back(static_cast<std::size_t>(&u - units_.data()));
  });
}

// _assert_unsharded before the stage's F or B: each handle's wait_for_unshard, outside a forward
// (the group is IDLE), so the all-gather buffer is freed right after its copy-out.
void DataParallel::pp_wait_unshard() {
  for (std::size_t i : pp_unshard_ops_) copy_out(units_[i], /*waited_by_schedule=*/true);
  pp_unshard_ops_.clear();
}

// The RESHARD action: reshard() on every FSDPModule of the stage (the root too).
void DataParallel::pp_reshard() {
  if (kind_ != Parallel::kFsdp) return;
  t_.at(t_.phase(), kNoLayer, "pipeline.reshard");
  for_all_states([this](Unit& u) { reshard(u); });
}

void DataParallel::before_optimizer() {
  if (zero3()) return zero3_before_optimizer();
  if (zero()) return zero_before_optimizer();
  if (kind_ != Parallel::kFsdp) return;
  for (Unit& u : units_) {
    if (u.sharded_grad == kNone) continue;
    for (std::uint32_t pi : u.reduced) {
      t_.retain(u.sharded_grad);
      t_.set_param_grad(params_[pi].slot, u.sharded_grad);
    }
    t_.release(u.sharded_grad);  // the .grads (views) hold it until zero_grad
    u.sharded_grad = kNone;
  }
}

// Note [Uneven shards]
// FSDP2 (_fsdp_param.py _init_sharded_param) cuts dim 0 with torch.chunk: chunks of
// ceil(rows / world) rows, the last ones shorter or empty when the rows do not divide. Every
// rank's shard storage is padded to the full chunk (the all-gather input and the reduce-scatter
// output, so weights and gradients are the same on every rank), but the sharded parameter is a
// view of its own rows only, and the optimizer's zeros_like / clone of it (Adam's moments, SGD's
// momentum) have those rows: the last ranks of a shard group hold less optimizer state. Measured
// on three ranks (cpu-fsdp3-*: rank 2's rank-16 LoRA matrices have 4 of 16 rows, and its Adam
// states 327,680 B less at the peak). Rank 0's chunks are full, so rank 0 is never lighter than
// another rank and stands for the worst (Note [The worst rank] in estimate.cpp); `--rank` gives the
// others (under PP x FSDP2 the rank's place among its stage's replicas; not under CP, whose
// dp_shard x cp mesh order is not modelled).
std::uint64_t DataParallel::chunk_numel(const WrappedParam& p, std::uint64_t shard_rank) const {
  const std::uint64_t rows = p.rows > 0 ? p.rows : p.numel;  // a 1-D parameter: rows of one element
  if (rows == 0) return 0;
  const std::uint64_t chunk = ceil_div(rows, shard_world_);
  const std::uint64_t begin = detail::mul(chunk, shard_rank, "shard offset");
  const std::uint64_t own = begin >= rows ? 0 : std::min(chunk, rows - begin);
  return detail::mul(own, p.numel / rows, "shard elements");
}

std::uint64_t DataParallel::local_numel(std::uint32_t slot, std::uint64_t numel) const {
  if (kind_ != Parallel::kFsdp || slot >= param_of_slot_.size() || param_of_slot_[slot] == kNone) return numel;
  return chunk_numel(params_[param_of_slot_[slot]], shard_rank_);
}

DType DataParallel::local_dtype(std::uint32_t slot, DType dtype) const {
  if (kind_ != Parallel::kFsdp || slot >= param_of_slot_.size() || param_of_slot_[slot] == kNone) return dtype;
  return orig_dtype(params_[param_of_slot_[slot]]);
}

// Note [gloo's reduce-scatter temporary]
// On the CPU, gloo's reduce_scatter_tensor makes a world x output tensor (the reduce-scatter
// input's size, of the shard group) that the tracker sees when it surfaces in Python, at a
// `split` on gloo's worker thread. Its free needs the last reference to go: gloo's Work owns it,
// the worker thread may still hold the Work when reduce_scatter_single returns, and the free
// (the storage's Python object, so it needs the GIL) lands wherever the main thread is: at once,
// or after the next unit's all-gather copy-out, changing from rank to rank and run to run (the
// traces of the first 1-D and TP x DP measurements: docs/parallelism.md "In the engine" and
// "TP x DP"). Every FSDP2 run is measured with the wait of Note [Settled reduce-scatter]
// (python/trainmem/measure/parallel.py): the measuring side sleeps after FSDP2's reduce-scatter
// until what the call made is freed, so the temporary lives inside the collective only, and the
// engine allocates it after the output and frees it at once, the one rule for 1-D FSDP2, HSDP and
// TP x DP. On CUDA NCCL makes no such tensor (Note [Collectives on CUDA]): its buffers are
// outside the caching allocator, so "gone when the collective returns" is the CUDA timeline
// without the instant the temporary exists.

void DataParallel::rebuild_buckets() {
  t_.at(Phase::kForward, kNoLayer, "ddp.rebuild_buckets");
  std::vector<std::uint32_t> order = ready_order_;
  for (std::uint32_t pi = static_cast<std::uint32_t>(params_.size()); pi-- > 0;) {
    if (std::find(order.begin(), order.end(), pi) == order.end()) order.push_back(pi);  // never ready
  }
  std::vector<std::uint32_t> of;
  const std::vector<std::uint64_t> sizes = bucket_sizes(order, &of);
  // Reducer::sync_bucket_indices broadcasts the assignment from rank 0 first: the parameter
  // indices (one int32 each, and the bucket count) and the bucket sizes, each made on the host
  // and copied to the device, all gone before the buckets are rebuilt (measured on the CPU, where
  // the host copies are tracked too).
  std::vector<TensorId> assignment;
  for (std::uint64_t n : {order.size() + 1, sizes.size()}) {
    if (!cuda_) assignment.push_back(t_.alloc_bytes(n * 4, Category::kTemporaries));
    assignment.push_back(t_.alloc_bytes(n * 4, Category::kTemporaries));
  }
  for (auto it = assignment.rbegin(); it != assignment.rend(); ++it) t_.release(*it);
  for (TensorId b : buckets_) t_.release(b);  // .grads that are views of it keep it
  buckets_.clear();
  for (std::uint64_t bytes : sizes) buckets_.push_back(t_.alloc_bytes(bytes, Category::kGradients));
  bucket_of_ = std::move(of);
  if (bucket_view_) {  // See Note [DDP gradient_as_bucket_view]: the .grads move to the new slots
    for (std::uint32_t pi = 0; pi < params_.size(); ++pi) {
      const std::uint32_t slot = params_[pi].slot;
      const TensorId g = t_.param_grad(slot);
      if (params_[pi].storage == kNone || !params_[pi].trainable || g == kNone) continue;
      t_.retain(buckets_[bucket_of_[pi]]);
      t_.set_param_grad(slot, buckets_[bucket_of_[pi]]);
      t_.release(g);  // an old view: the old bucket goes with the last of them
    }
  }
  rebuilt_ = true;
}

// compute_bucket_assignment_by_size over the parameters in `order` (the trainable ones of this
// stage): a bucket closes after the parameter that takes it to 1 MiB (the first) or 25 MiB.
std::vector<std::uint64_t> DataParallel::bucket_sizes(const std::vector<std::uint32_t>& order,
                                                      std::vector<std::uint32_t>* of) const {
  std::vector<std::uint64_t> out;
  std::uint64_t limit = kFirstBucketBytes, bytes = 0;
  if (of != nullptr) of->assign(params_.size(), 0);
  for (std::uint32_t pi : order) {
    if (params_[pi].storage == kNone || !params_[pi].trainable) continue;  // another stage's, or frozen
    if (of != nullptr) (*of)[pi] = static_cast<std::uint32_t>(out.size());
    bytes = detail::add(bytes, params_[pi].numel * dtype_bytes(params_[pi].dtype), "bucket bytes");
    if (bytes >= limit) {
      out.push_back(bytes);
      bytes = 0;
      limit = kBucketCapBytes;
    }
  }
  if (bytes > 0) out.push_back(bytes);
  return out;
}

// What one parameter's shard holds on the host under CPUOffloadPolicy (See Note [FSDP2 CPU
// offload]): the pinned shard, and for a trainable parameter the pinned sharded .grad (this rank's
// chunk: rank 0's is the padded size) and the host optimizer's states, zeros_like the shard
// (AdamW's step is a 0-dim fp32). A LoRA base's frozen shards get neither (Note [LoRA under FSDP2]).
void DataParallel::fsdp_offload_host(std::uint64_t shard, const WrappedParam& p) {
  const std::uint64_t bytes = detail::mul(shard, dtype_bytes(orig_dtype(p)), "shard bytes");
  host_pinned(bytes, &HostMemory::weights_bytes);
  if (!p.trainable) return;
  host_pinned(bytes, &HostMemory::gradients_bytes);
  switch (optimizer_) {
    case Optimizer::kAdamW:
    case Optimizer::kAdamWFused:
      host_pageable(detail::add(detail::mul(bytes, 2, "state bytes"), 4, "state bytes"), &HostMemory::optimizer_states_bytes);
      break;
    case Optimizer::kSgd: host_pageable(bytes, &HostMemory::optimizer_states_bytes); break;
    default: TRAINMEM_ASSERT(false, "FSDP2 takes a torch optimizer (recipe validation)");
  }
}

void DataParallel::all_gather(Unit& u) {
  t_.at(t_.phase(), kNoLayer, "fsdp.all_gather");
  // The flat buffer holds every shard in its unsharded dtype; dtypes that differ (a LoRA model's
  // half base and fp32 adapters) are gathered as bytes (_get_all_gather_input_metadatas).
  const std::uint64_t flat_bytes = detail::mul(u.gather_bytes, shard_world_, "all-gather bytes");
  if (fsdp_offload_) {
    // Each shard copied to the GPU (and cast), then the flat output; the copies go when
    // foreach_all_gather returns (See Note [FSDP2 CPU offload]).
    std::vector<TensorId> inputs;
    inputs.reserve(u.params.size());
    for (std::uint32_t pi : u.params) {
      const WrappedParam& p = params_[pi];
      TensorId in = t_.alloc_bytes(detail::mul(shard_numel_[pi], dtype_bytes(orig_dtype(p)), "shard bytes"), Category::kWeights);
      if (orig_dtype(p) != p.dtype) {
        const TensorId cast = t_.alloc_bytes(detail::mul(shard_numel_[pi], dtype_bytes(p.dtype), "shard bytes"), Category::kWeights);
        t_.release(in);
        in = cast;
      }
      inputs.push_back(in);
    }
    u.flat = t_.alloc_bytes(flat_bytes, Category::kWeights);
    for (TensorId in : inputs) t_.release(in);
    return;
  }
  // A param_dtype policy: the shards it casts are copied into one flat buffer first, freed when
  // foreach_all_gather returns (See Note [FSDP2 variants]).
  const TensorId cast = u.cast_bytes != 0 ? t_.alloc_bytes(u.cast_bytes, Category::kWeights) : kNone;
  u.flat = t_.alloc_bytes(flat_bytes, Category::kWeights);
  if (cast != kNone) t_.release(cast);
}

void DataParallel::copy_out(Unit& u, bool waited_by_schedule) {
  t_.at(t_.phase(), kNoLayer, "fsdp.all_gather_copy_out");
  for (std::uint32_t pi : u.params) t_.resize(unsharded_[pi], true);
  if (t_.phase() == Phase::kForward && !waited_by_schedule) {
    // In forward the buffer is kept in all_gather_state until the next unit's copy-out or the
    // root's post-forward (See Note [FSDP2 units]).
    if (forward_all_gather_ != kNone) t_.release(forward_all_gather_);
    forward_all_gather_ = u.flat;
  } else {
    t_.release(u.flat);
  }
  u.flat = kNone;
  u.gathered = true;
}

void DataParallel::reshard(Unit& u) {
  if (!u.gathered) return;
  for (std::uint32_t pi : u.params) t_.resize(unsharded_[pi], false);
  u.gathered = false;
}

// Note [Partial gradients under FSDP2]
// TP x DP with sequence parallelism: a SequenceParallel norm's weight is a Replicate DTensor on
// the tensor-parallel mesh, and its .grad comes out of backward as a Partial DTensor (each rank
// summed over its own sequence shard). FSDP2's post_backward (torch 2.13,
// torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) reads each gradient through
// FSDPParam.unsharded_grad_data (_fsdp_param.py _get_grad_inner_tensor), which redistributes a
// gradient whose placements differ from the parameter's on the non-dp mesh dimensions: Partial ->
// Replicate, a functional all_reduce into a new tensor of the weight's size; then
// `unsharded_param.grad = None` frees the Partial one. One after the other, in fsdp_params order,
// before the reshard; the all-reduced tensors (the tracker counts them as temporaries: nothing
// marks them as gradients) then go into the reduce-scatter's copy-in like any gradient, the last
// one of the unit held to the end of foreach_reduce as always. Measured:
// data/ground_truth/parallel/cpu-tp2dp2sp-* (docs/parallelism.md "TP x DP"). Qwen3's q_norm and
// k_norm weights are Replicate with a Partial gradient under any tensor parallelism (their input
// is a head Shard: Note [Tensor parallelism] in tensor_parallel.h), all-reduced the same way
// (measured: cpu-tp2dp2-qwen3w512l2-fp32-adamw-b1s64 traced, every rank).

// A unit's post-backward with reduce_grads off, in a pipeline's schedule (See Note [Pipeline with
// FSDP2]): no reshard, no reduction; with a reduce_dtype the unsharded .grads are accumulated in it.
void DataParallel::pp_post_backward(Unit& u) {
  accumulate_unsharded_grads(u);
  to_accumulated_grads(u);
}

// Note [FSDP2 no_sync]
// Accelerate's no_sync on an FSDP2 model (run by its accumulate() and by Hugging Face's Trainer on
// every micro-batch but the step's last) is set_requires_gradient_sync(False): reduce_grads off on
// every parameter group, reshard_after_backward and is_last_backward as they were (torch 2.13,
// torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward). A unit's post-backward
// then accumulates into a reduce-dtype .grad if it keeps one, reshards the unit's parameters and
// makes a .grad still there a reduce-dtype copy, and returns before the reduce-scatter: each rank
// keeps every parameter's unsharded gradient (the whole model's, in the compute dtype) until the
// last micro-batch reduce-scatters what they accumulated. The root's final callback runs the
// post-backwards no hook ran, the same way, and finalizes. Measured on gloo ranks:
// data/ground_truth/parallel/cpu-fsdp-*-nosync-*.
void DataParallel::no_sync_post_backward(Unit& u) {
  if (u.params.empty()) return;
  u.posted = true;
  accumulate_unsharded_grads(u);
  reshard(u);
  to_accumulated_grads(u);
}

void DataParallel::accumulate_unsharded_grads(Unit& u) {
  if (!reduce_dtype_ || *reduce_dtype_ == u.dtype) return;
  // accumulate_unsharded_grad_if_needed: the new .grad added into the accumulated one in place.
  for (std::uint32_t pi : u.params) {
    const std::uint32_t slot = params_[pi].slot;
    if (fsdp_accumulated_[pi] == kNone || t_.param_grad(slot) == kNone) continue;
    t_.at(t_.phase(), kNoLayer, "fsdp.accumulate_grad");
    t_.release(t_.param_grad(slot));
    t_.set_param_grad(slot, kNone);
  }
}

void DataParallel::to_accumulated_grads(Unit& u) {
  if (!reduce_dtype_ || *reduce_dtype_ == u.dtype) return;
  // to_accumulated_grad_if_needed: a .grad still there becomes a reduce-dtype copy.
  for (std::uint32_t pi : u.params) {
    const std::uint32_t slot = params_[pi].slot;
    if (t_.param_grad(slot) == kNone) continue;
    t_.at(t_.phase(), kNoLayer, "fsdp.accumulate_grad");
    fsdp_accumulated_[pi] = t_.alloc_bytes(
        detail::mul(params_[pi].numel, dtype_bytes(*reduce_dtype_), "gradient bytes"), Category::kGradients);
    t_.release(t_.param_grad(slot));
    t_.set_param_grad(slot, kNone);
  }
}

// A unit's post-backward (see Note [FSDP2 units]).
void DataParallel::reduce(Unit& u) {
  if (u.params.empty()) return;  // a middle pipeline stage's root: no parameter group
  u.posted = true;
  // post_backward's accumulate_unsharded_grad_if_needed comes first, reducing or not: after
  // no_sync micro-batches the last one's .grads join the reduce-dtype accumulation (Note [FSDP2
  // no_sync]); a pipeline's post-backwards did it already.
  accumulate_unsharded_grads(u);
  std::vector<TensorId> grads;  // in fsdp_params order, the unit's parameter order
  for (std::uint32_t pi : u.params) {
    const std::uint32_t slot = params_[pi].slot;
    if (fsdp_accumulated_[pi] != kNone) {  // a pipeline's reduce-dtype accumulation (See Note [Pipeline with FSDP2])
      if (std::find(u.reduced.begin(), u.reduced.end(), pi) == u.reduced.end()) u.reduced.push_back(pi);
      grads.push_back(fsdp_accumulated_[pi]);
      fsdp_accumulated_[pi] = kNone;
      continue;
    }
    if (t_.param_grad(slot) == kNone) continue;
    TensorId g = t_.param_grad(slot);
    t_.set_param_grad(slot, kNone);
    if (std::find(u.reduced.begin(), u.reduced.end(), pi) == u.reduced.end()) u.reduced.push_back(pi);
    if (params_[pi].partial_grad) {  // See Note [Partial gradients under FSDP2]
      t_.at(t_.phase(), kNoLayer, "fsdp.redistribute_grad");
      const TensorId replicated = t_.alloc_bytes(
          detail::mul(params_[pi].numel, dtype_bytes(params_[pi].dtype), "gradient bytes"), Category::kTemporaries);
      t_.release(g);
      g = replicated;
    }
    grads.push_back(g);
  }
  reshard(u);
  // Every post-backward recycles the previous reduce-scatter input (reduce_scatter_max_input_buffers
  // 1), gradients or not: under LoRA the root has none (See Note [LoRA under FSDP2]).
  if (pending_reduce_input_ != kNone) {
    t_.release(pending_reduce_input_);
    pending_reduce_input_ = kNone;
  }
  if (grads.empty()) return;
  t_.at(t_.phase(), kNoLayer, "fsdp.reduce_scatter");
  // The gradients are in the unsharded parameters' dtype; reduced in reduce_dtype when the policy
  // has one, then cast to the sharded parameters' dtype (See Note [FSDP2 variants]).
  std::uint64_t shard_numel = 0;  // the parameters with a gradient (under LoRA the adapters)
  for (std::uint32_t pi : u.reduced) shard_numel += shard_numel_[pi];
  const DType reduce_dtype = reduce_dtype_.value_or(u.dtype);
  const std::uint64_t out_bytes = detail::mul(shard_numel, dtype_bytes(reduce_dtype), "reduce-scatter bytes");
  TensorId in = t_.alloc_bytes(detail::mul(out_bytes, shard_world_, "reduce-scatter bytes"), Category::kGradients);
  // unsharded_grads.clear() after the copy-in frees them, all but the last: the loop variable of
  // foreach_reduce's first loop (over the Shard(i > 0) parameters) still holds it until the
  // function returns (measured: cpu-fsdp-gpt2l2-fp32-adamw-bf16params-b2s32, whose peak is there).
  // CPython's list clear drops the items from the last to the first (the traces of
  // cpu-pp2fsdp2-*: a unit's MLP gradients go before its attention's).
  for (std::size_t k = grads.size() - 1; k-- > 0;) t_.release(grads[k]);
  TensorId out = t_.alloc_bytes(out_bytes, Category::kGradients);
  if (!cuda_) {  // gloo's temporary, gone inside the collective: See Note [gloo's reduce-scatter temporary]
    t_.release(t_.alloc_bytes(detail::mul(out_bytes, shard_world_, "reduce-scatter bytes"), Category::kGradients));
  }
  if (reduce_dtype != orig_dtype_) {
    const TensorId cast =
        t_.alloc_bytes(detail::mul(shard_numel, dtype_bytes(orig_dtype_), "sharded gradient bytes"), Category::kGradients);
    if (hsdp_) {
      all_reduce_inputs_.push_back(out);  // HSDP: the all-reduced buffer is held until the end of backward
    } else {
      t_.release(out);
    }
    out = cast;
  }
  if (fsdp_offload_) {
    // The .grads are host copies of the output's views; nothing keeps the output (See Note
    // [FSDP2 CPU offload]).
    t_.release(grads.back());  // foreach_reduce returns
    // HSDP keeps the reduce-dtype output in _all_reduce_state until finalize_backward (already
    // pushed above when a cast replaced it).
    if (hsdp_ && reduce_dtype == orig_dtype_) {
      all_reduce_inputs_.push_back(out);
    } else {
      t_.release(out);
    }
    pending_reduce_input_ = in;
    return;
  }
  if (u.sharded_grad == kNone) {
    u.sharded_grad = out;
  } else {
    t_.release(out);  // added into the existing sharded .grads
  }
  t_.release(grads.back());  // foreach_reduce returns
  pending_reduce_input_ = in;
}

}  // namespace trainmem::graph
