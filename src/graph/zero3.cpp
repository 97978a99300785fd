// DeepSpeed ZeRO stage 3 on one rank: the DataParallel hooks for Parallel::kZero3
// (graph/parallel.h). docs/parallelism.md, "ZeRO-3 in the engine", has what was measured.
#include <algorithm>

#include "common/checked.h"
#include "graph/parallel.h"

namespace trainmem::graph {
namespace {

constexpr std::int32_t kNoLayer = -1;

// Note [DeepSpeed ZeRO-3]
// deepspeed.initialize(model, optimizer=torch AdamW/SGD over model.parameters(), config) with
// zero_optimization.stage 3 and DeepSpeed's defaults (0.19.8, deepspeed/runtime/zero/config.py:
// reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, stage3_param_persistence_threshold
// 1e5, stage3_model_persistence_threshold sys.maxsize, stage3_max_live_parameters 1e9,
// stage3_max_reuse_distance 1e9, sub_group_size 1e9, contiguous_gradients and reduce_scatter
// true, no offload: Note [ZeRO-3 offload] in zero3_offload.cpp has what offload changes), rank 0.
// What allocates, in order:
//  * initialize (partition_parameters.py Init(module=...), stage3.py __init__): every
//    parameter keeps a partition of ceil(numel / world) elements (ds_tensor); its .data becomes
//    an empty placeholder (free_param) — also for the persistent ones (ds_persist: numel <=
//    param_persistence_threshold), which create_reduce_and_remove_grad_hooks gathers and
//    partitions again. The partitions are defragmented into one lp_param_buffer (Σ partitions,
//    model dtype) and cut into sub-groups of sub_group_size elements; each sub-group's fp32
//    master is a .to(fp32).clone() of its slice (_create_fp32_partitions). The ipg bucket
//    (torch.empty(reduce_bucket_size) in the communication dtype, the model dtype) and
//    grad_partitions_flat_buffer (torch.zeros(Σ partitions) in gradient_accumulation_dtype, the
//    model dtype here) are made in _setup_for_real_optimizer and live for the run; the bool
//    inf_or_nan_tracker (1 B) too. initialize_optimizer_states' zero gradient buffer is dropped
//    before initialize returns: the states are made lazily at the first step;
//  * every module has hooks (parameter_offload.py _register_deepspeed_module), containers
//    too: the model, its base model, each decoder layer, attention, MLP, activation and dropout
//    modules, the rotary embedding. Only the parameters a module owns directly are fetched for
//    it (iter_params(recurse=False)), but every fetch counts as a step of the trace and may
//    prefetch. A fetch (partitioned_param_coordinator.py fetch_sub_module) all-gathers the
//    module's parameters that are not available in one call: one parameter → a buffer of
//    ceil(numel / world) x world elements whose narrow is the .data (_all_gather_sequential);
//    several → one flat buffer of Σ partitions x world, and at the first wait each parameter's
//    .data is a torch.cat of its pieces (numel elements; AllGatherCoalescedHandle.wait), the
//    flat buffer lives until the handle's last parameter was waited for. A release
//    (release_sub_module → __release_param → partition → free_param) replaces .data by an
//    empty tensor, which frees the gathered storage: what autograd saved of a parameter
//    (LayerNorm's weight and bias, Conv1D's weight, RMSNorm's weight, and every nn.Linear's
//    weight through Init's LinearFunctionForZeroStage3) is the parameter itself, a leaf, whose
//    .data the next fetch fills again. In a checkpoint's recompute, though, torch's
//    saved-tensor hook keeps a detached alias of what it saves: a trainable weight released
//    after the recomputed module's forward keeps its storage until the node that saved it runs
//    (measured: a LoRA adapter's gathered weights until lora_B's and lora_A's backward; the
//    frozen ones stay gathered for the module in backward anyway). Until 2026-12-06 the
//    measuring side's saved-tensor hook kept a detached alias of each saved tensor, and with it
//    every saved weight's storage to its backward, and gloo's all-gather Work held released
//    buffers to the next collective (Notes [Saved leaves] in python/trainmem/measure/tracker.py
//    and [Settled release] in parallel.py); the ZeRO-3 corpus was measured again without either;
//  * trace (ZeRoTraceMode): the first forward+backward runs with no trace (INVALID → RECORD at
//    the first reset_step, in the model's forward pre-hook): every module's parameters, the
//    persistent ones included, are released after its forward and after its backward. The
//    second reset_step freezes the recorded module order: from then on each fetch also pops the
//    fetched parameters off the parameter queue and prefetches the next ones until
//    prefetch_bucket_size elements are in flight (bounded by max_live_parameters minus those
//    available), and a release keeps every non-persistent parameter that the next
//    max_reuse_distance elements of the order use again (__params_to_release); persistent ones
//    are never released by a module. Backward: a module's pre-backward hook (a Function on its
//    outputs) fetches before its first backward node, its post-backward hook (a Function on its
//    inputs that require grad) releases after its last; a module whose inputs do not require
//    grad (an embedding over token ids) is released by backward_epilogue →
//    release_backward_leftovers after the backward;
//  * gradients (stage3.py reduce_independent_p_g_buckets_and_remove_grads, __add_grad_to_ipg_
//    bucket, __reduce_and_partition_ipg_grads): after each AccumulateGrad the .grad is copied into
//    the bucket and becomes a view of it (autograd's storage is freed); a parameter that does not
//    fit first reduces the bucket. A reduction (here at the end of the backward, the queued
//    independent_gradient_partition_epilogue, unless the bucket fills) sorts the bucket's
//    parameters by ds_id and reduce_scatter_coalesced (runtime/comm/coalesced_collectives.py)
//    cats every rank's chunk of every gradient, padded to ceil(numel / world), into one flat
//    buffer (no copy for one gradient that divides), reduce-scatters it and copies this rank's
//    chunks into grad_partitions_flat_buffer (partition_grads; add_ under accumulation);
//    On the CPU gloo's reduce_scatter_tensor hands back a temporary of the flat buffer's size
//    (seen at the split that follows; Note [gloo's reduce-scatter temporary]); NCCL makes none;
//  * step (stage3.py step): _partition_all_parameters releases every gathered parameter; the
//    norm converts each parameter's gradient partition to float64 one at a time
//    (get_grad_norm_direct), combine_grad_norm_groups and is_invalid_grad_norm make their 0-dim
//    tensors, _global_grad_norm is kept to the next step; per sub-group
//    _prepare_fp32_grad_for_sub_group flattens the partitions (a copy) and converts them to
//    fp32, unscale_and_clip_grads makes the clip factor's scalars, the torch optimizer steps
//    the fp32 master (its states made at the first step), its gradient goes
//    (_release_sub_group); _post_step gathers the persistent parameters again
//    (_allgather_params_coalesced: one buffer of partition x world per parameter). With more
//    than one sub-group (more than sub_group_size partition elements) DeepSpeed takes one norm
//    per sub-group; the engine takes one over all (a few 0-dim tensors apart, unmeasured).
// Measured to the byte on two CPU ranks (docs/parallelism.md, "ZeRO-3 in the engine"): GPT-2
// bf16-master AdamW and a 4-layer Llama fp32 SGD. Unmeasured: gradient accumulation (partition_
// grads adds into grad_partitions_flat_buffer, no allocation), checkpointing (the recompute's
// module hooks fetch again, as DeepSpeed's do), models over 1e9 reuse-distance elements.
// The CPU accelerator has no streams (is_synchronized_device): the order above is the CPU one,
// measured. On CUDA (unmeasured) the all-gathers run on the allgather stream and the reductions
// on reduce_and_partition_stream (overlap_comm is on by default for stage 3) with record_stream:
// a freed gathered buffer or flat is reused only after its stream's work, so reserved bytes can
// be higher than this single-stream replay; the allocations themselves are the same.
// Note [LoRA under ZeRO-3]
// deepspeed.initialize over a peft model, the client optimizer over the adapters (DeepSpeed 0.19.8,
// peft 0.21); measured on two gloo ranks (data/ground_truth/parallel/cpu-zero3-*-lora*), every rank
// exact. What changes against Note [DeepSpeed ZeRO-3]:
//  * Init partitions every parameter, the frozen base too; the optimizer's groups (lp_param_buffer,
//    the fp32 sub-groups, grad_partitions_flat_buffer) hold the trainable ones only, and a frozen
//    parameter keeps the partition Init made for it. The gradient norm walks the trainable ones;
//    _post_step gathers every persistent parameter again, frozen or not. bf16-master is DeepSpeed's
//    bf16 mode, which casts the adapters to bf16 too;
//  * Init replaces torch.nn.functional.linear by LinearFunctionForZeroStage3 (zero/linear.py,
//    mem_efficient_linear), which saves the input, the weight and the bias whatever needs a
//    gradient: a frozen projection whose input requires grad keeps its input too, an adapter whose
//    input does not (layer 0 before the first adapter) keeps its gathered weight to its backward.
//    GPT-2's Conv1D runs torch.addmm and saves as autograd does;
//  * every module has hooks, so peft's lora.Linear and its lora_dropout (nn.Identity or
//    nn.Dropout) are trace steps too, and so are the PeftModel and its LoraModel at the top (whose
//    forward calls the CausalLM's .forward, so that module's own hooks never fire);
//  * lora.Linear's forward reads lora_A.weight.dtype while the engine's forward flag is on:
//    ZeROOrderedDict's getter makes lora_A.weight an external parameter of the lora.Linear and,
//    while it is partitioned, gathers it at once with Init's own single-parameter all-gather (the
//    coordinator's count of available elements does not see it). From then on the lora.Linear's
//    fetches and releases, forward and backward, include it (zero3_external_param);
//  * under checkpointing, enable_input_require_grads' forward hook runs before DeepSpeed's, so the
//    embedding module's output requires grad and gets a pre-backward Function: the backward
//    fetches the embedding again at its very end (released there as a leftover), and the complete
//    trace keeps it gathered from its forward on.
//  * a checkpointed layer's pre-backward fetches run before its recompute (Tape::recompute_hooks);
//    what the recompute gathers of the frozen base DeepSpeed also attributes to the innermost module
//    in backward (update_recompute_parameters), which releases it with its post-backward
//    (z3_recompute_params_).
// DeepSpeed's offload with adapters stays refused (unmeasured).
// Note [QLoRA under ZeRO-3]
// deepspeed.initialize over get_peft_model(prepare_model_for_kbit_training(<4-bit base>)), the
// optimizer over the adapters (DeepSpeed 0.19.8, bitsandbytes 0.50; measured on two gloo ranks:
// data/ground_truth/parallel/cpu-zero3-*-qlora*, *-4bit*, every rank exact). On top of Note
// [LoRA under ZeRO-3]:
//  * Init partitions each Params4bit like any parameter: its packed uint8 storage, shape
//    (packed bytes, 1), keeps ceil(bytes / world) bytes per rank and is gathered as bytes (stored
//    as bf16: ceil(bytes / 2 / world) bf16 elements, gathered in the bf16 flat buffer, and
//    persistent when at most 100,000 of them: Note [The packed weights' storage dtype]). Its
//    QuantState is no parameter: it stays whole on every rank, and Linear4bit's forward hands it
//    back to the gathered weight (fix_4bit_weight_quant_state_from_module);
//  * the parameters' dtypes now differ (uint8 packed weights beside the fp32, or in DeepSpeed's
//    bf16 mode bf16, rest; Note [QLoRA under ZeRO-1/2] has that cast). A partition and a gather are
//    sized by the parameter's own dtype; the optimizer's groups, the ipg bucket and the gradient
//    partitions by the adapters' (stage3.py's self.dtype);
//  * a coalesced fetch of several parameters (_all_gather_coalesced) groups them by dtype: one flat
//    buffer per dtype, the groups in str(dtype) order (sort_dtypes, so float32 before uint8), in
//    one MultipleAllGatherHandles whose first wait cats every parameter's pieces group by group.
//    Every flat buffer lives until the handle's last parameter was waited for. A biased 4-bit
//    layer (Qwen2.5's q/k/v, GPT-2's) gathers two flat buffers;
//  * peft's lora.Linear4bit reads lora_A.weight.dtype unless autocast is on (to convert x), which
//    gathers lora_A.weight as an external parameter as lora.Linear does; its lora_dropout is a
//    module with hooks too.
constexpr std::uint64_t kReduceBucketElements = 500'000'000;
constexpr std::uint64_t kPrefetchBucketElements = 50'000'000;
constexpr std::uint64_t kPersistenceThreshold = 100'000;
constexpr std::uint64_t kMaxLiveParameters = 1'000'000'000;
constexpr std::uint64_t kMaxReuseDistance = 1'000'000'000;
constexpr std::uint64_t kSubGroupElements = 1'000'000'000;
constexpr std::int64_t kNeverFetched = -10'000'000'000;

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0); }

}  // namespace

std::uint64_t DataParallel::z3_gathered_bytes(std::uint32_t p) const {
  return detail::mul({z3_partition_[p], world_, z3_item(p)}, "gathered parameter bytes");
}

std::uint64_t DataParallel::zero3_partition_numel(std::uint64_t numel, std::uint64_t world) {
  return ceil_div(numel, world);
}

bool DataParallel::zero3_persistent(std::uint64_t numel) { return numel <= kPersistenceThreshold; }

// See Note [DeepSpeed ZeRO-3].
void DataParallel::zero3_wrap() {
  TRAINMEM_ASSERT(!params_.empty(), "ZeRO-3 wraps no parameters");
  t_.at(Phase::kSetup, kNoLayer, "zero3.partition_parameters");
  const auto first_trainable =
      std::find_if(params_.begin(), params_.end(), [](const WrappedParam& p) { return p.trainable; });
  TRAINMEM_ASSERT(first_trainable != params_.end(), "ZeRO-3 wraps no trainable parameter");
  z3_item_ = dtype_bytes(first_trainable->dtype);  // stage3.py's self.dtype: the optimizer's first parameter's
  z3_accum_item_ = z3_item_;  // gradient_accumulation_dtype: the model dtype (bf16 or fp32)
  const std::size_t n = params_.size();
  z3_partition_.assign(n, 0);
  z3_persist_.assign(n, false);
  z3_status_.assign(n, Z3Status::kNotAvailable);
  z3_data_.assign(n, kNone);
  z3_active_.assign(n, {});
  z3_inflight_.assign(n, kNone);
  z3_most_recent_.assign(n, kNeverFetched);
  std::uint64_t total = 0;
  sub_group_numel_.clear();
  std::uint64_t group = 0;
  std::size_t last_trainable = n;
  for (std::size_t i = 0; i < n; ++i) {
    if (params_[i].trainable) last_trainable = i;
  }
  for (std::size_t i = 0; i < n; ++i) {
    // The frozen ones may differ: a 4-bit base's packed uint8 weights (Note [QLoRA under ZeRO-3]).
    TRAINMEM_ASSERT(!params_[i].trainable || params_[i].dtype == first_trainable->dtype,
                    "ZeRO-3's optimizer groups mix dtypes");
    z3_partition_[i] = zero3_partition_numel(params_[i].numel, world_);
    z3_persist_[i] = zero3_persistent(params_[i].numel);
    // A frozen parameter (a LoRA base, Note [LoRA under ZeRO-3]) keeps the partition Init made
    // for it; the optimizer's groups, their buffers and sub-groups hold the trainable ones.
    if (!params_[i].trainable) {
      if (!offload_params_) {
        t_.alloc_bytes(detail::mul(z3_partition_[i], z3_item(static_cast<std::uint32_t>(i)), "ZeRO-3 partition bytes"),
                       Category::kWeights);
      }
      continue;
    }
    total = detail::add(total, z3_partition_[i], "ZeRO-3 partition elements");
    // _create_fp16_sub_groups: a sub-group closes at the parameter that takes it to sub_group_size.
    group += z3_partition_[i];
    if (group >= kSubGroupElements || i == last_trainable) {
      sub_group_numel_.push_back(group);
      group = 0;
    }
  }
  if (total <= kSubGroupElements) sub_group_numel_.assign(1, total);  // one group, not cut
  partition_numel_ = total;
  // CPU offload moves the partitions, the fp32 masters and the gradient partitions to the host
  // (See Note [ZeRO-3 offload] in zero3_offload.cpp).
  if (offload_ || offload_params_) zero3_offload_wrap();
  if (!offload_params_) t_.alloc_bytes(detail::mul(total, z3_item_, "lp_param_buffer bytes"), Category::kWeights);
  if (!offload_) {
    t_.at(Phase::kSetup, kNoLayer, "zero3.fp32_partitions");
    for (std::uint64_t g : sub_group_numel_) t_.alloc_bytes(detail::mul(g, 4, "ZeRO-3 fp32 bytes"), Category::kWeights);
  }
  t_.at(Phase::kSetup, kNoLayer, "zero3.ipg_bucket");
  z3_bucket_ = t_.alloc_bytes(detail::mul(kReduceBucketElements, z3_item_, "ZeRO-3 bucket bytes"), Category::kGradients);
  if (!offload_) {
    t_.at(Phase::kSetup, kNoLayer, "zero3.grad_partitions");
    t_.alloc_bytes(detail::mul(total, z3_accum_item_, "grad_partitions_flat_buffer bytes"), Category::kGradients);
    t_.alloc_bytes(1, Category::kOther);  // inf_or_nan_tracker
  }
}

std::uint32_t DataParallel::zero3_module(const std::vector<std::uint32_t>& params, std::uint32_t key,
                                         bool input_requires_grad) {
  std::vector<std::uint32_t> own = params;
  std::sort(own.begin(), own.end());
  // A module is the same module when it is entered again (the backward, a recompute, the next
  // micro-batch or step): looked up by its key and parameters, not by a walk over every module
  // (a 70B model enters ~1,000 of them several times a step).
  const auto [it, added] = z3_module_ids_.try_emplace({key, own}, static_cast<std::uint32_t>(z3_modules_.size()));
  if (!added) return it->second;
  Z3Module mod;
  mod.params = std::move(own);
  mod.key = key;
  mod.input_requires_grad = input_requires_grad;
  for (std::uint32_t p : mod.params) mod.numel += params_[p].numel;
  z3_modules_.push_back(std::move(mod));
  z3_fetched_for_.emplace_back();
  z3_recompute_params_.emplace_back();
  return it->second;
}

// reset_step, in the model's forward pre-hook (parameter_offload.py _start_of_forward_hook).
// Until the trace is complete it checks that the ranks recorded the same orders
// (assert_ints_same_as_other_ranks): the module order, and once recorded the parameter order's
// ds_ids and step ids (measured: ZeRO-3 traces, the int64 tensors at each forward's start).
void DataParallel::zero3_reset_step() {
  zero3_clean_inflight();
  if (z3_trace_ != Z3Trace::kComplete) {
    zero3_same_on_all_ranks(z3_order_.size());
    if (z3_trace_ == Z3Trace::kRecord) {
      // construct_parameter_trace_from_module_trace: every module's parameters, by ds_id, with
      // the step the module was fetched at.
      z3_param_order_.clear();
      std::vector<std::size_t> next(z3_modules_.size(), 0);
      for (std::uint32_t m : z3_order_) {
        const std::int64_t step = z3_fetched_for_[m][next[m]++];
        for (std::uint32_t p : z3_modules_[m].params) z3_param_order_.push_back({p, step});
      }
      zero3_same_on_all_ranks(z3_param_order_.size());  // their ds_ids
      zero3_same_on_all_ranks(z3_param_order_.size());  // the steps they were used at
      z3_trace_ = Z3Trace::kComplete;
    } else {
      z3_trace_ = Z3Trace::kRecord;
    }
  }
  z3_queue_ = 0;
  std::fill(z3_most_recent_.begin(), z3_most_recent_.end(), kNeverFetched);
  z3_step_id_ = 0;
  z3_available_ = 0;
}

// assert_ints_same_as_other_ranks on a list of n ints (runtime/zero/utils.py): rank 0's length as
// a 0-dim int64 tensor, broadcast and read; then the list as an int64 tensor (none of no bytes),
// broadcast and read into Python ints; each goes when its function returns.
void DataParallel::zero3_same_on_all_ranks(std::uint64_t n) {
  t_.release(scalar(8));
  if (n > 0) t_.release(scalar(detail::mul(n, 8, "ZeRO-3 trace bytes")));
}

void DataParallel::zero3_invalidate_trace() {
  z3_trace_ = Z3Trace::kInvalid;
  z3_order_.clear();
  z3_param_order_.clear();
  for (auto& f : z3_fetched_for_) f.clear();
  std::fill(z3_most_recent_.begin(), z3_most_recent_.end(), kNeverFetched);
  z3_queue_ = 0;
  zero3_clean_inflight();
}

// _clean_inflight_param_registry: wait for what is in flight and release it.
void DataParallel::zero3_clean_inflight() {
  for (std::uint32_t p = 0; p < z3_inflight_.size(); ++p) {
    if (z3_inflight_[p] == kNone) continue;
    zero3_wait(p);
    zero3_release_param(p);
  }
}

// A recompute's hooks past its early stop never fire (See Note [Checkpoint tails] in tape.h).
void DataParallel::module_pre_forward(std::uint32_t m) {
  if (!zero3() || t_.past_recompute_stop()) return;
  // trace_prologue: a module out of the recorded order invalidates the trace.
  if (z3_trace_ == Z3Trace::kComplete &&
      (z3_order_.size() <= static_cast<std::size_t>(z3_step_id_) || z3_order_[z3_step_id_] != m)) {
    zero3_invalidate_trace();
  }
  if (z3_trace_ == Z3Trace::kRecord) {
    z3_order_.push_back(m);
    z3_fetched_for_[m].push_back(z3_step_id_);
  }
  zero3_fetch(m, true);
}

void DataParallel::module_post_forward(std::uint32_t m) {
  if (zero3() && !t_.past_recompute_stop()) zero3_release_module(m, true);
}

void DataParallel::module_backward(std::uint32_t m, bool begin) {
  if (!zero3()) return;
  if (begin) {
    module_pre_forward(m);  // pre_sub_module_backward_function: the same prologue and fetch
    if (std::find(z3_backward_active_.begin(), z3_backward_active_.end(), m) == z3_backward_active_.end()) {
      z3_backward_active_.push_back(m);
    }
    return;
  }
  if (!z3_modules_[m].input_requires_grad) return;  // no post-backward hook: a leftover
  zero3_release_module(m, false);
}

void DataParallel::zero3_external_param(std::uint32_t m, std::uint32_t pi) {
  if (!zero3() || m == kNone || t_.past_recompute_stop()) return;
  Z3Module& mod = z3_modules_[m];
  if (std::find(mod.params.begin(), mod.params.end(), pi) == mod.params.end()) {
    mod.params.push_back(pi);  // ds_external_parameters, after the module's own in iter_params
    mod.numel += params_[pi].numel;
  }
  if (z3_status_[pi] != Z3Status::kNotAvailable) return;
  // param.all_gather(): Init's own single-parameter gather, not the coordinator's (no count).
  t_.at(t_.phase(), kNoLayer, "zero3.external_parameter");
  z3_data_[pi] = t_.alloc_bytes(z3_gathered_bytes(pi), Category::kWeights);
  z3_status_[pi] = Z3Status::kAvailable;
}

void DataParallel::zero3_fetch(std::uint32_t m, bool forward) {
  const Z3Module& mod = z3_modules_[m];
  std::vector<std::uint32_t> missing;
  for (std::uint32_t p : mod.params) {
    if (z3_status_[p] == Z3Status::kNotAvailable) missing.push_back(p);
  }
  if (!missing.empty()) zero3_all_gather(missing);
  // update_recompute_parameters: what a checkpoint's recompute fetches of the frozen parameters
  // belongs to the innermost module in backward too, and is released with it.
  const std::uint32_t owner = forward && t_.recomputing && !z3_backward_active_.empty() ? z3_backward_active_.back() : kNone;
  for (std::uint32_t p : mod.params) {
    auto& active = z3_active_[p];
    if (std::find(active.begin(), active.end(), m) == active.end()) active.push_back(m);
    if (owner != kNone && !params_[p].trainable) {
      if (std::find(active.begin(), active.end(), owner) == active.end()) active.push_back(owner);
      auto& owned = z3_recompute_params_[owner];
      if (std::find(owned.begin(), owned.end(), p) == owned.end()) owned.push_back(p);
    }
    if (z3_inflight_[p] != kNone) zero3_wait(p);
  }
  if (z3_trace_ == Z3Trace::kComplete) {
    // Pop the fetched parameters off the queue, then prefetch the next ones.
    std::size_t not_yet = 0;
    for (std::uint32_t p : mod.params) {
      if (z3_most_recent_[p] < z3_step_id_) ++not_yet;
    }
    for (std::size_t k = 0; k < not_yet && z3_queue_ < z3_param_order_.size(); ++k) {
      const Z3ParamUse& u = z3_param_order_[z3_queue_++];
      z3_most_recent_[u.param] = u.step;
    }
    const std::int64_t live = static_cast<std::int64_t>(kMaxLiveParameters);
    const std::uint64_t room = live > z3_available_ ? static_cast<std::uint64_t>(live - z3_available_) : 0;
    const std::uint64_t limit = std::min(room, kPrefetchBucketElements);
    std::vector<std::uint32_t> prefetch;
    std::uint64_t numel = 0;
    while (z3_queue_ < z3_param_order_.size() && numel < limit) {
      const Z3ParamUse& u = z3_param_order_[z3_queue_++];
      const bool fresh = std::find(prefetch.begin(), prefetch.end(), u.param) == prefetch.end();
      z3_most_recent_[u.param] = std::max(z3_most_recent_[u.param], u.step);
      if (z3_status_[u.param] == Z3Status::kNotAvailable && fresh) {
        prefetch.push_back(u.param);
        numel += params_[u.param].numel;
      }
    }
    if (!prefetch.empty()) {
      // ds_id order: module.parameters() (measured: Phi-3's o_proj, registered before qkv_proj,
      // first in the prefetch's flat buffer).
      std::sort(prefetch.begin(), prefetch.end(), [&](std::uint32_t a, std::uint32_t b) { return z3_ds_id_[a] < z3_ds_id_[b]; });
      zero3_all_gather(prefetch);
    }
  }
  ++z3_step_id_;
}

// __all_gather_params_ → all_gather_coalesced (see Note [DeepSpeed ZeRO-3]).
void DataParallel::zero3_all_gather(std::vector<std::uint32_t> params) {
  Z3Handle h;
  h.pending = static_cast<std::uint32_t>(params.size());
  for (std::uint32_t p : params) {
    z3_available_ += static_cast<std::int64_t>(params_[p].numel);
    z3_status_[p] = Z3Status::kInflight;
  }
  if (params.size() == 1) {  // _all_gather_sequential: .data is a narrow of the buffer
    const std::uint32_t p = params.front();
    z3_data_[p] = t_.alloc_bytes(z3_gathered_bytes(p), Category::kWeights);
    const TensorId in = zero3_copy_in(p);  // offload_param: the host partition's GPU copy
    if (in != kNone) t_.release(in);
    h.waited = true;
  } else {
    // _all_gather_coalesced: one flat buffer per dtype, the groups in str(dtype) order
    // (sort_dtypes), each parameter's ds_id order kept within its group.
    std::stable_sort(params.begin(), params.end(), [&](std::uint32_t a, std::uint32_t b) {
      return dtype_name(params_[a].dtype) < dtype_name(params_[b].dtype);
    });
    for (std::size_t begin = 0; begin < params.size();) {
      std::size_t end = begin;
      std::uint64_t flat = 0;
      for (; end < params.size() && params_[params[end]].dtype == params_[params[begin]].dtype; ++end) {
        flat += z3_partition_[params[end]];
      }
      h.flats.push_back(t_.alloc_bytes(detail::mul({flat, world_, z3_item(params[begin])}, "all-gather bytes"),
                                       Category::kWeights));
      std::vector<TensorId> copies;  // offload_param: torch.cat of the partitions' GPU copies
      for (std::size_t k = begin; k < end; ++k) {
        const TensorId in = zero3_copy_in(params[k]);
        if (in != kNone) copies.push_back(in);
      }
      for (TensorId in : copies) t_.release(in);
      begin = end;
    }
  }
  h.params = params;
  const std::uint32_t id = static_cast<std::uint32_t>(z3_handles_.size());
  z3_handles_.push_back(std::move(h));
  for (std::uint32_t p : params) z3_inflight_[p] = id;
}

// registry.pop(param).wait(): the first wait gives every parameter of the handle its .data.
void DataParallel::zero3_wait(std::uint32_t pi) {
  Z3Handle& h = z3_handles_[z3_inflight_[pi]];
  z3_inflight_[pi] = kNone;
  if (!h.waited) {
    for (std::uint32_t p : h.params) {
      z3_data_[p] = t_.alloc_bytes(detail::mul(params_[p].numel, z3_item(p), "gathered parameter bytes"),
                                   Category::kWeights);  // torch.cat of its pieces
      z3_status_[p] = Z3Status::kAvailable;
    }
    h.waited = true;
  }
  z3_status_[pi] = Z3Status::kAvailable;
  if (--h.pending == 0) {
    for (TensorId flat : h.flats) t_.release(flat);  // the handle is gone
    h.flats.clear();
  }
}

void DataParallel::zero3_release_param(std::uint32_t pi) {
  if (z3_status_[pi] != Z3Status::kAvailable || !z3_active_[pi].empty()) return;
  t_.release(z3_data_[pi]);  // free_param: the gathered storage goes unless still referenced
  z3_data_[pi] = kNone;
  z3_status_[pi] = Z3Status::kNotAvailable;
  z3_available_ -= static_cast<std::int64_t>(params_[pi].numel);
}

// Hands over what a recompute attributed to module m (its ds_recompute_parameters, which it no
// longer owns afterwards), adding those not among `params` to them.
std::vector<std::uint32_t> DataParallel::zero3_take_recompute_params(std::uint32_t m, std::vector<std::uint32_t>& params) {
  std::vector<std::uint32_t> owned = std::move(z3_recompute_params_[m]);
  z3_recompute_params_[m].clear();
  for (std::uint32_t p : owned) {
    if (std::find(params.begin(), params.end(), p) == params.end()) params.push_back(p);
  }
  return owned;
}

// __params_to_release (a complete trace): the module's non-persistent parameters that no module
// within max_reuse_distance elements of the rest of the order uses again.
std::vector<bool> DataParallel::zero3_params_to_release(std::uint32_t m) const {
  std::vector<bool> out(params_.size(), false);
  for (std::uint32_t p : z3_modules_[m].params) {
    out[p] = !z3_persist_[p] && !(z3_most_recent_[p] > z3_step_id_);
  }
  std::uint64_t traversed = 0;
  for (std::size_t k = static_cast<std::size_t>(z3_step_id_); k < z3_order_.size(); ++k) {
    if (traversed >= kMaxReuseDistance) break;
    for (std::uint32_t p : z3_modules_[z3_order_[k]].params) {
      out[p] = false;
      traversed += params_[p].numel;
    }
  }
  return out;
}

void DataParallel::zero3_release_module(std::uint32_t m, bool forward) {
  std::vector<bool> release;
  if (z3_trace_ == Z3Trace::kComplete) {
    release = zero3_params_to_release(m);
  } else {
    release.assign(params_.size(), false);
    for (std::uint32_t p : z3_modules_[m].params) release[p] = true;
  }
  std::vector<std::uint32_t> params = z3_modules_[m].params;
  if (!forward) {
    z3_backward_active_.erase(std::remove(z3_backward_active_.begin(), z3_backward_active_.end(), m),
                              z3_backward_active_.end());
    // The recompute's frozen parameters this module owns, persistent ones kept.
    for (std::uint32_t p : zero3_take_recompute_params(m, params)) {
      if (!z3_persist_[p]) release[p] = true;
    }
  }
  for (std::uint32_t p : params) {
    auto& active = z3_active_[p];
    active.erase(std::remove(active.begin(), active.end(), m), active.end());
    if (release[p]) zero3_release_param(p);
  }
}

// The grad hook (reduce_partition_and_remove_grads) after AccumulateGrad.
void DataParallel::zero3_param_ready(std::uint32_t pi) {
  const std::uint64_t numel = params_[pi].numel;
  if (z3_bucket_elements_ + numel > kReduceBucketElements && z3_bucket_elements_ > 0) zero3_reduce_ipg();
  const std::uint32_t slot = params_[pi].slot;
  if (z3_bucket_elements_ + numel <= kReduceBucketElements) {
    if (t_.param_grad(slot) != kNone) t_.release(t_.param_grad(slot));  // .grad.data = a bucket view
    t_.set_param_grad(slot, kNone);
  } else {
    z3_kept_grads_.push_back(t_.param_grad(slot));  // larger than the bucket: reduced as it is
    t_.set_param_grad(slot, kNone);
  }
  z3_bucket_params_.push_back(pi);
  z3_bucket_elements_ += numel;
}

// __reduce_and_partition_ipg_grads → __avg_scatter_grads → reduce_scatter_coalesced, then
// partition_grads (see Note [DeepSpeed ZeRO-3]).
void DataParallel::zero3_reduce_ipg() {
  if (z3_bucket_params_.empty()) return;
  t_.at(t_.phase(), kNoLayer, "zero3.reduce_ipg_grads");
  const bool one_divides = z3_bucket_params_.size() == 1 && params_[z3_bucket_params_.front()].numel % world_ == 0;
  std::uint64_t flat = 0;
  for (std::uint32_t p : z3_bucket_params_) flat += z3_partition_[p] * world_;
  TensorId cat = kNone;
  std::vector<TensorId> pads;
  if (!one_divides) {
    // reduce_scatter_coalesced interleaves rank by rank, tensor by tensor: a torch.empty(padding)
    // beside each short chunk (the last rank's, and any rank past the end of a small tensor).
    for (std::uint64_t r = 0; r < world_; ++r) {
      for (std::uint32_t p : z3_bucket_params_) {
        const std::uint64_t begin = std::min(params_[p].numel, r * z3_partition_[p]);
        const std::uint64_t end = std::min(params_[p].numel, begin + z3_partition_[p]);
        if (end - begin < z3_partition_[p]) {
          pads.push_back(t_.alloc_bytes((z3_partition_[p] - (end - begin)) * z3_item_, Category::kGradients));
        }
      }
    }
    cat = t_.alloc_bytes(detail::mul(flat, z3_item_, "reduce-scatter bytes"), Category::kGradients);
  }
  // gloo's reduce_scatter_tensor hands back a world x output temporary, freed once this rank's
  // chunks are copied out (the measured trace: at the copy_); NCCL makes none. See Note [gloo's
  // reduce-scatter temporary] in parallel.cpp.
  if (!cuda_) t_.release(t_.alloc_bytes(detail::mul(flat, z3_item_, "reduce-scatter bytes"), Category::kGradients));
  // reduce_scatter_coalesced returns: its list of chunks and pads goes, last first (measured:
  // world 3, the pads freed after gloo's temporary).
  for (auto it = pads.rbegin(); it != pads.rend(); ++it) t_.release(*it);
  if (offload_) zero3_offload_partition_grads();  // to the pinned host partitions: See Note [ZeRO-3 offload]
  if (cat != kNone) t_.release(cat);  // the partitions are in grad_partitions_flat_buffer, the list goes
  for (TensorId g : z3_kept_grads_) t_.release(g);
  z3_kept_grads_.clear();
  z3_bucket_params_.clear();
  z3_bucket_elements_ = 0;
}

// The queued independent_gradient_partition_epilogue, then backward_epilogue's
// release_backward_leftovers.
void DataParallel::zero3_backward_end() {
  t_.at(t_.phase(), kNoLayer, "zero3.gradient_partition_epilogue");
  zero3_reduce_ipg();
  t_.at(t_.phase(), kNoLayer, "zero3.release_backward_leftovers");
  for (std::uint32_t m : z3_backward_active_) {
    std::vector<std::uint32_t> params = z3_modules_[m].params;
    zero3_take_recompute_params(m, params);
    for (std::uint32_t p : params) {
      auto& active = z3_active_[p];
      active.erase(std::remove(active.begin(), active.end(), m), active.end());
      if (!z3_persist_[p]) zero3_release_param(p);
    }
  }
  z3_backward_active_.clear();
  ++micro_;  // the accumulation boundary of offload_optimizer (See Note [ZeRO-3 offload])
}

// _partition_all_parameters → release_and_reset_all: everything gathered goes, persistent too.
void DataParallel::zero3_partition_all() {
  for (std::uint32_t p = 0; p < params_.size(); ++p) {
    if (z3_inflight_[p] != kNone) zero3_wait(p);
    z3_active_[p].clear();
    zero3_release_param(p);
  }
}

// stage3.py step up to the torch optimizer's (see Note [DeepSpeed ZeRO-3]); the 0-dim tensors
// are those of the measured trace (each a 512 B block on the CPU).
void DataParallel::zero3_before_optimizer() {
  t_.at(Phase::kOptimizer, kNoLayer, "zero3.partition_all_parameters");
  zero3_partition_all();
  micro_ = 0;  // _pre_step: micro_step_id 0
  if (offload_) return zero3_offload_grad_norm();  // the rest of step() runs on the host
  t_.at(Phase::kOptimizer, kNoLayer, "zero3.grad_norm");
  auto drop = [&](std::initializer_list<TensorId> ids) {
    for (TensorId id : ids) t_.release(id);
  };
  // get_grad_norm_direct: each gradient partition .to(float64).norm(2), one at a time, then
  // sum(pow(stack(norms), 2)) ** (1 / 2) and torch.where(isnan | isinf, -1.0, norm).
  // The optimizer's groups hold the trainable parameters in module.parameters() order (measured:
  // a Llama layer's q_proj first, its norms last).
  std::vector<TensorId> norms;
  for (std::uint32_t p : registration_) {
    if (!params_[p].trainable) continue;
    TensorId wide = t_.alloc_bytes(detail::mul(z3_partition_[p], 8, "grad norm bytes"), Category::kTemporaries);
    norms.push_back(scalar(8));
    t_.release(wide);
  }
  TensorId stacked = scalar(8 * norms.size()), pow = scalar(8 * norms.size());
  drop({stacked});
  TensorId sum = scalar(8);
  drop({pow});
  TensorId root = scalar(8), inf = scalar(1), nan = scalar(1), either = scalar(1), err = scalar(4);
  TensorId group = scalar(8);  // the sub-group's norm, in norm_groups until step() returns
  drop({root, sum});
  for (TensorId id : norms) t_.release(id);
  drop({inf, nan, either, err});
  // combine_grad_norm_groups (runtime/utils.py): stack, ~isfinite | < 0, any, vector_norm, where.
  TensorId stack1 = scalar(8);
  TensorId bad = invalid_norm(8);
  TensorId combined = scalar(8), full = scalar(8), where = scalar(8);
  drop({full, stack1, bad, combined});
  scaled_norm_ = where;  // scaled_global_grad_norm, a local of step()
  drop({invalid_norm(8)});  // is_invalid_grad_norm
  // self._global_grad_norm = scaled_global_grad_norm / loss_scale, kept until the next step's
  // (and the previous one by the DeepSpeedEngine until step() returns: set_global_grad_norm).
  TensorId global = scalar(8);
  set_global_grad_norm(global);
  z3_norm_group_ = group;
}

void DataParallel::zero3_before_sub_group(std::size_t i) {
  if (offload_) return;  // the pinned fp32 .grad on the host: See Note [ZeRO-3 offload]
  // _prepare_fp32_grad_for_sub_group: flatten (a copy of the partitions, a temporary: made
  // outside the gradient hooks) and .to(fp32).
  t_.at(Phase::kOptimizer, kNoLayer, "zero3.fp32_grad_partition");
  const std::uint64_t n = sub_group_numel_[i];
  TensorId flat = t_.alloc_bytes(detail::mul(n, z3_accum_item_, "ZeRO-3 flat gradient bytes"), Category::kTemporaries);
  if (z3_accum_item_ != 4) {
    z3_fp32_grad_ = t_.alloc_bytes(detail::mul(n, 4, "ZeRO-3 fp32 gradient bytes"), Category::kGradients);
    t_.release(flat);
  } else {
    t_.set_category(flat, Category::kGradients);  // .to(fp32) of an fp32 flat is the flat
    z3_fp32_grad_ = flat;
  }
  t_.at(Phase::kOptimizer, kNoLayer, "zero3.unscale_and_clip_grads");
  clip_factor(8, /*checks_norm=*/false);
}

void DataParallel::zero3_after_sub_group(std::size_t) {
  if (z3_fp32_grad_ != kNone) t_.release(z3_fp32_grad_);  // _release_sub_group
  z3_fp32_grad_ = kNone;
}

// After the last sub-group: _post_step gathers the persistent parameters, step() returns.
void DataParallel::zero3_gather_persistent() {
  if (offload_) offload_after_optimizer();  // reset_cpu_buffers: norm_for_param_grads goes
  t_.at(Phase::kOptimizer, kNoLayer, "zero3.gather_persistent");
  for (std::uint32_t p : registration_) {  // persistent_parameters: module.parameters()
    if (!z3_persist_[p] || z3_status_[p] != Z3Status::kNotAvailable) continue;
    z3_data_[p] = t_.alloc_bytes(z3_gathered_bytes(p), Category::kWeights);
    const TensorId in = zero3_copy_in(p);  // offload_param: the host partition's GPU copy
    if (in != kNone) t_.release(in);
    z3_status_[p] = Z3Status::kAvailable;
  }
  if (scaled_norm_ != kNone) t_.release(scaled_norm_);  // step() returns: its locals go
  scaled_norm_ = kNone;
  if (z3_norm_group_ != kNone) t_.release(z3_norm_group_);
  z3_norm_group_ = kNone;
  engine_takes_global_grad_norm();
}

}  // namespace trainmem::graph
