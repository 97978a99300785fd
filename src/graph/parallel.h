// Data parallelism on one rank: what DDP and FSDP2 add to the training step of step.cpp
// (docs/parallelism.md records what each allocates, measured; parallel.cpp mirrors it).
//
// The step builder calls the hooks below at the points where the wrappers' own hooks run in
// PyTorch: after the model is built, at the wrapped module's forward, around each decoder
// layer's forward, when backward enters and leaves a layer (Tape::on_layer_change), when a
// parameter's gradient is ready (Tape::on_param_ready), at the end of backward and before the
// optimizer. With Parallel::kNone every hook does nothing.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "graph/tape.h"

namespace trainmem::graph {

// A parameter as the wrapper sees it; `storage` is what the model's ops read.
struct WrappedParam {
  std::uint32_t slot = kNone;  // the tape's .grad slot
  TensorId storage = kNone;
  std::uint64_t numel = 0;
  std::uint64_t rows = 0;  // dim 0 as stored (FSDP2 shards it); 0 for 1-D tensors
  DType dtype = DType::kF32;
  // A Partial DTensor .grad on the tensor-parallel mesh (a SequenceParallel norm's weight under
  // TP x DP): FSDP2 all-reduces it before the reduce-scatter (See Note [Partial gradients under FSDP2]).
  bool partial_grad = false;
  // requires_grad: false for a LoRA base's frozen weights, which DDP leaves out of its buckets.
  bool trainable = true;
  // Its dtype before fully_shard is its unsharded one even under a param_dtype policy, which then
  // leaves it alone (a half-loaded model's frozen weight, a 4-bit base's bf16-stored packed weight:
  // Note [FSDP2 variants]); the others are fp32 there.
  bool keeps_dtype = false;
};

class DataParallel {
 public:
  // `rank`: the rank whose memory is built (ZeRO's partition; the others use rank 0).
  DataParallel(Tape& tape, const Recipe& recipe, bool cuda, std::uint64_t rank = 0);

  // After the model is built, before the optimizer exists. `layers[l]` are the indices (into
  // `params`) of decoder layer l's parameters, `root` the others (embeddings, final norm,
  // lm_head); `buffers` the bytes of the module's buffers by dtype. FSDP2 points every
  // parameter's `storage` at its unsharded parameter (freed until it is gathered).
  // `registration`: every index in module.parameters() order (DDP's bucket assignment at
  // construction with find_unused_parameters; empty: the table's order).
  void wrap(std::vector<WrappedParam>& params, const std::vector<std::vector<std::uint32_t>>& layers,
            const std::vector<std::uint32_t>& root, const std::vector<std::pair<DType, std::uint64_t>>& buffers,
            const std::vector<std::uint32_t>& registration = {});

  void pre_forward();                    // the wrapped module is called
  void post_forward();                   // the wrapped module returns (after the model's loss)
  void layer_pre_forward(std::uint32_t layer);
  void layer_post_forward(std::uint32_t layer);
  void backward_begin();                 // backward() is called
  void root_pre_backward();              // FSDP2's root pre-backward hook (on the root's outputs)
  void layer_change(std::int32_t from, std::int32_t to);  // backward moves between layers
  void param_ready(std::uint32_t slot);  // AccumulateGrad has run for this parameter
  void final_callback();                 // the autograd engine's final callbacks (FSDP2's root)
  void backward_end();                   // after the engine has run every node
  void before_optimizer();               // sharded gradients into the .grad slots
  // A pipeline stage's perform_reduce_grad, after the schedule's last backward (FSDP2: the
  // deferred post-backwards and the root's final callback; See Note [Pipeline with FSDP2] in
  // pipeline.cpp). A no-op for DDP and without a pipeline.
  void pipeline_reduce_grad();
  // Several pipeline stages per rank, one wrapper per local stage (See Note [Interleaved pipeline
  // schedules with FSDP2] in pipeline.cpp): the schedule's UNSHARD action (every unit of the stage
  // issues its all-gather, the root first), the wait before the stage's next F or B
  // (_assert_unsharded: the copy-outs, the buffers freed at once), and its RESHARD action.
  void pp_unshard();
  void pp_wait_unshard();
  void pp_reshard();
  // Whether this wrapper holds the parameter of `slot` (a stage's wrapper holds only the stage's).
  // FSDP2: whether the first decoder layer's forward input requires grad (false under LoRA without
  // checkpointing: the frozen embedding's output), so that its post-backward hook exists.
  void set_first_layer_hooked(bool hooked) { first_layer_hooked_ = hooked; }
  bool holds(std::uint32_t slot) const { return slot < param_of_slot_.size() && param_of_slot_[slot] != kNone; }

  // The elements of this rank's parameter that the optimizer sees (FSDP2: this rank's chunk of
  // it, unpadded: Note [Uneven shards] in parallel.cpp).
  std::uint64_t local_numel(std::uint32_t slot, std::uint64_t numel) const;
  // Its dtype: the sharded parameter's (FSDP2 with a param_dtype policy: fp32 under a bf16 model).
  DType local_dtype(std::uint32_t slot, DType dtype) const;

  // DeepSpeed ZeRO-1/2 (zero.cpp, Note [DeepSpeed ZeRO-1/2]). The torch optimizer holds one
  // parameter, this rank's fp32 master partition of zero_partition_numel() elements; its
  // gradient exists between zero_before_optimizer() (which also runs the gradient norm) and
  // zero_after_optimizer().
  bool zero() const { return is_zero(kind_); }
  std::uint64_t zero_partition_numel() const { return partition_numel_; }
  // The fp32 master partition as the torch optimizer steps it, one sub-group at a time (ZeRO-1/2:
  // the whole partition; ZeRO-3: sub_group_size elements each). Around each sub-group's step:
  // ZeRO-3 makes and drops its fp32 gradient.
  const std::vector<std::uint64_t>& zero_sub_groups() const { return sub_group_numel_; }
  void zero_before_sub_group(std::size_t i) {
    if (zero3()) zero3_before_sub_group(i);
  }
  void zero_after_sub_group(std::size_t i) {
    if (zero3()) zero3_after_sub_group(i);
  }
  void zero_after_optimizer();

  // DeepSpeed ZeRO-3 (zero3.cpp, Note [DeepSpeed ZeRO-3]): every parameter is partitioned and
  // gathered around the forward and backward of the module that owns it. The step builder
  // registers each module with parameters (its direct ones, as iter_params(recurse=False) sees
  // them; `key` tells two modules over the same parameter apart, a tied lm_head) and calls the
  // forward hooks around it; the tape calls module_backward when the module's first backward
  // node is about to run (begin) and after its last one ran. `input_requires_grad` false: the
  // module's post-backward hook never fires (an embedding over token ids).
  bool zero3() const { return kind_ == Parallel::kZero3; }
  std::uint32_t zero3_module(const std::vector<std::uint32_t>& params, std::uint32_t key, bool input_requires_grad);
  void module_pre_forward(std::uint32_t module);
  void module_post_forward(std::uint32_t module);
  void module_backward(std::uint32_t module, bool begin);
  // ZeROOrderedDict's getter: `module`'s forward reads another module's parameter (peft's
  // lora.Linear reads lora_A.weight.dtype). It becomes an external parameter of `module`, fetched
  // and released with it from then on, and is gathered now if it is partitioned (See Note [LoRA
  // under ZeRO-3] in zero3.cpp).
  void zero3_external_param(std::uint32_t module, std::uint32_t param);
  // The storage a gathered parameter's .data is now (the parameter index of wrap()).
  TensorId zero3_data(std::uint32_t param) const { return z3_data_[param]; }
  // Exposed for tests and the planner: DeepSpeed's per-parameter partition (ceil(numel / world)
  // elements) and whether a parameter stays gathered (ds_persist: numel <= 1e5).
  static std::uint64_t zero3_partition_numel(std::uint64_t numel, std::uint64_t world);
  static bool zero3_persistent(std::uint64_t numel);

  // The flat group's layout (exposed for tests): flat elements, padded to 2 x world
  // (nccl_start_alignment_factor), and rank r's partition, flat / world elements.
  static std::uint64_t zero_flat_numel(std::uint64_t numel, std::uint64_t world);
  // The ipg bucket setup_buckets allocates in every backward: reduce_bucket_size elements of the
  // model dtype, whatever the model's size (exposed for the planner's floor).
  static std::uint64_t zero_bucket_bytes(std::uint64_t item_bytes);

  // ZeRO-Offload (zero_offload.cpp, Note [ZeRO-Offload]; ZeRO-3: zero3_offload.cpp, Note [ZeRO-3
  // offload]): whether the optimizer steps on the host (offload_optimizer), the host memory this
  // rank holds, and whether the step's last micro-batch differs from the ones before it (the
  // replay must not skip it). pinned_block_bytes: what CachingHostAllocator hands out for a
  // pinned tensor.
  bool offload() const { return offload_; }
  bool fsdp_offload() const { return fsdp_offload_; }  // FSDP2's CPUOffloadPolicy: the optimizer steps on the host
  const HostMemory& host_memory() const { return host_; }
  bool boundary_micro_batch_differs() const {
    return (offload_ && (kind_ == Parallel::kZero2 || kind_ == Parallel::kZero3)) || ddp_no_sync_ || fsdp_no_sync_;
  }
  // Micro-batch `micro` (1-based) of a step outside a pipeline begins: under no_sync accumulation
  // only the step's last synchronizes (Note [DDP no_sync], Note [FSDP2 no_sync]).
  void begin_micro_batch(std::uint64_t micro) {
    ddp_sync_ = !ddp_no_sync_ || micro >= grad_accum_;
    fsdp_sync_ = !fsdp_no_sync_ || micro >= grad_accum_;
  }
  void skip_to_last_micro();
  static std::uint64_t pinned_block_bytes(std::uint64_t bytes);

 private:
  struct Unit {
    std::vector<std::uint32_t> params;
    std::uint64_t gather_bytes = 0;  // Σ padded shard bytes in the unsharded dtypes: one rank's all-gather input
    std::uint64_t cast_bytes = 0;    // the part of it a param_dtype policy casts (foreach-copies) first
    DType dtype = DType::kF32;       // the unsharded trainable parameters' (param_dtype, or their own)
    std::vector<std::uint32_t> reduced;  // the parameters whose gradients it reduce-scatters, in order
    bool posted = false;                 // its post-backward ran in this backward
    TensorId flat = kNone;          // all-gather buffer in flight
    bool gathered = false;
    TensorId sharded_grad = kNone;  // reduce-scatter output (the sharded .grads are views)
  };

  void rebuild_buckets();
  // compute_bucket_assignment_by_size; `of`, when given, gets each parameter's bucket.
  std::vector<std::uint64_t> bucket_sizes(const std::vector<std::uint32_t>& order,
                                          std::vector<std::uint32_t>* of = nullptr) const;
  void grad_to_bucket_view(std::uint32_t slot, std::uint32_t pi);
  void all_gather(Unit& u);
  void copy_out(Unit& u, bool waited_by_schedule = false);
  void reshard(Unit& u);
  void reduce(Unit& u);
  void pp_post_backward(Unit& u);
  void no_sync_post_backward(Unit& u);
  void accumulate_unsharded_grads(Unit& u);
  void to_accumulated_grads(Unit& u);
  void drop_reduce_states();
  // FSDP2's all_states order: the root's param group first, then the layers' in forward order.
  template <typename F>
  void for_all_states(F&& f) {
    f(units_.back());
    for (std::size_t i = 0; i + 1 < units_.size(); ++i) f(units_[i]);
  }

  Tape& t_;
  Parallel kind_;
  std::uint64_t world_;
  bool cuda_;
  std::vector<WrappedParam> params_;
  std::vector<std::pair<DType, std::uint64_t>> buffers_;
  // DDP
  std::vector<TensorId> buckets_;
  std::vector<std::uint32_t> ready_order_;  // parameter indices, first backward
  std::vector<std::uint32_t> param_of_slot_;
  bool backward_seen_ = false, rebuilt_ = false;
  bool forward_no_sync_ = false;     // a pipeline stage: every forward runs under no_sync
  bool forward_param_sync_ = true;   // require_forward_param_sync: broadcast the buffers
  bool find_unused_ = false;         // find_unused_parameters: size-limited buckets, never rebuilt
  bool bucket_view_ = false;         // gradient_as_bucket_view: the .grads are views of the buckets
  bool ddp_no_sync_ = false;         // no_sync() on every micro-batch but the step's last
  bool ddp_sync_ = true;             // this micro-batch synchronizes: require_backward_grad_sync
  std::vector<std::uint32_t> bucket_of_;  // parameter index -> its bucket in buckets_
  bool pp_no_sync_ = false;  // FSDP2 in a pipeline stage: no gradient sync, no reshard after backward
  bool fsdp_no_sync_ = false;  // set_requires_gradient_sync(False) on every micro-batch but the last
  bool fsdp_sync_ = true;      // this micro-batch reduce-scatters (reduce_grads)
  // FSDP2
  std::vector<Unit> units_;  // decoder layers, then the root
  std::uint64_t shard_world_ = 1;       // ranks of a shard group: gpus / fsdp_replicate (x cp)
  std::uint64_t shard_rank_ = 0;        // this rank's place in it (See Note [Uneven shards])
  // The elements of `p`'s torch.chunk for place `shard_rank` of the shard group (rank 0's: the
  // full chunk every shard is padded to).
  std::uint64_t chunk_numel(const WrappedParam& p, std::uint64_t shard_rank) const;
  bool hsdp_ = false;                   // fsdp_replicate > 1: the reduced shards are all-reduced across replicas
  bool first_layer_hooked_ = true;      // See set_first_layer_hooked
  bool reshard_after_forward_ = true;   // the decoder layers'
  bool cast_params_ = false;            // a param_dtype policy: all-gather inputs cast from the fp32 shards
  DType orig_dtype_ = DType::kF32;      // the sharded trainable parameters' (and the sharded gradients')
  // A parameter's sharded dtype: fp32 under a param_dtype policy (but what keeps its dtype), else
  // its own.
  DType orig_dtype(const WrappedParam& p) const { return cast_params_ && !p.keeps_dtype ? DType::kF32 : p.dtype; }
  std::optional<DType> reduce_dtype_;   // the policy's reduce_dtype; none: the gradients' dtype
  TensorId forward_all_gather_ = kNone;  // comm_ctx.all_gather_state: the last forward all-gather's buffer
  std::vector<TensorId> all_reduce_inputs_;  // HSDP: reduce-dtype outputs held until the end of backward
  std::vector<std::uint64_t> shard_numel_;  // per parameter, padded
  std::vector<TensorId> unsharded_;         // per parameter
  std::vector<TensorId> fsdp_accumulated_;  // per parameter: unsharded_accumulated_grad (pipeline, reduce_dtype)
  TensorId pending_reduce_input_ = kNone;   // the last reduce-scatter's input, kept until the next
  std::vector<std::size_t> pp_unshard_ops_;  // units whose UNSHARD all-gather waits (the schedule's unshard_ops)
  // ZeRO-1/2 (zero.cpp)
  void zero_wrap();
  void zero_param_ready(std::uint32_t slot);
  void zero_backward_end();
  void zero_epilogue();
  void zero_pad(const std::vector<std::uint64_t>& slices);
  void zero_before_optimizer();
  // A temporary of `bytes` (DeepSpeed's step makes many 0-dim ones).
  TensorId scalar(std::uint64_t bytes) { return t_.alloc_bytes(bytes, Category::kTemporaries); }
  void clip_factor(std::uint64_t bytes, bool checks_norm);
  TensorId isfinite_of(std::uint64_t bytes);
  TensorId invalid_norm(std::uint64_t bytes);
  void mask_invalid_norm();
  void zero_to_bucket(std::uint32_t pi);
  void zero_reduce_ipg();
  std::uint64_t zero_item_bytes() const;
  std::uint64_t rank_ = 0;
  std::uint64_t partition_numel_ = 0;
  std::uint64_t partition_begin_ = 0;
  std::vector<bool> is_in_partition_;
  std::vector<std::uint64_t> flat_offset_;   // per parameter, in the flat group
  std::vector<std::uint32_t> in_partition_;  // rank 0's params_in_partition, flat order
  TensorId zero_flat_ = kNone;               // bit16_groups_flat (the parameters are views)
  TensorId zero_bucket_ = kNone;             // the ipg bucket's buffer
  std::uint64_t bucket_elements_ = 0;
  std::vector<std::uint32_t> bucket_params_;  // in the order they entered the bucket
  std::uint32_t extra_large_ = kNone;         // a parameter larger than the bucket, reduced alone
  std::vector<TensorId> kept_grads_;          // .grads of other partitions, cleared at the epilogue
  TensorId grads_in_partition_ = kNone;
  static constexpr TensorId kNoPad = kNone - 1;  // zero_pad_: the partition needs none
  TensorId zero_pad_ = kNone;  // the last rank's zeros for the padding, with averaged_gradients
  TensorId accumulated_ = kNone;  // averaged_gradients / all_grad_tensors: views of a grads_in_partition
  TensorId fp32_grad_ = kNone;    // single_grad_partition
  TensorId grad_norm_ = kNone;    // the optimizer's _global_grad_norm, kept until the next step's
  TensorId engine_norm_ = kNone;  // the DeepSpeedEngine's: the previous step's until step() returns
  void set_global_grad_norm(TensorId norm);
  void engine_takes_global_grad_norm();
  TensorId scaled_norm_ = kNone;  // step()'s scaled_global_grad_norm
  std::uint64_t micro_ = 0;       // micro-batches since the last step
  std::uint64_t grad_accum_ = 1;

  // ZeRO-3 (zero3.cpp)
  enum class Z3Status : std::uint8_t { kNotAvailable, kInflight, kAvailable };
  enum class Z3Trace : std::uint8_t { kInvalid, kRecord, kComplete };
  struct Z3Module {
    std::vector<std::uint32_t> params;  // by ds_id (parameter index)
    std::uint32_t key = 0;
    bool input_requires_grad = true;
    std::uint64_t numel = 0;            // Σ ds_numel of its parameters
  };
  struct Z3Handle {  // a MultipleAllGatherHandles (or one AllGatherHandle)
    std::vector<std::uint32_t> params;  // by dtype group, then by ds_id: the order wait() fills them
    // The coalesced flat buffers, one per dtype group, kept until the last parameter is waited for.
    std::vector<TensorId> flats;
    std::uint32_t pending = 0;
    bool waited = false;
  };
  struct Z3ParamUse {
    std::uint32_t param;
    std::int64_t step;
  };
  void zero3_wrap();
  void zero3_param_ready(std::uint32_t pi);
  void zero3_backward_end();
  void zero3_before_optimizer();
  void zero3_same_on_all_ranks(std::uint64_t n);
  std::vector<std::uint32_t> registration_;  // ZeRO-3: the parameters in module.parameters() order
  std::vector<std::uint32_t> z3_ds_id_;      // ZeRO-3: each parameter's place in it, DeepSpeed's ds_id
  void zero3_before_sub_group(std::size_t i);  // the fp32 gradient of sub-group i
  void zero3_after_sub_group(std::size_t i);
  void zero3_reset_step();
  void zero3_fetch(std::uint32_t m, bool forward);
  void zero3_release_module(std::uint32_t m, bool forward);
  void zero3_all_gather(std::vector<std::uint32_t> params);
  void zero3_wait(std::uint32_t pi);
  void zero3_release_param(std::uint32_t pi);
  void zero3_invalidate_trace();
  void zero3_clean_inflight();
  void zero3_reduce_ipg();
  void zero3_partition_all();
  void zero3_gather_persistent();
  std::vector<bool> zero3_params_to_release(std::uint32_t m) const;
  // The trainable parameters' dtype (the optimizer's groups, the bucket, the gradient partitions),
  // and each parameter's own (its partition and what gathers it): a 4-bit base's are uint8.
  std::uint64_t z3_item_ = 2, z3_accum_item_ = 2;
  std::uint64_t z3_item(std::uint32_t p) const { return dtype_bytes(params_[p].dtype); }
  std::uint64_t z3_gathered_bytes(std::uint32_t p) const;  // ceil(numel / world) x world of its dtype
  std::vector<std::uint64_t> z3_partition_;  // per parameter, ceil(numel / world)
  std::vector<bool> z3_persist_;
  std::vector<Z3Status> z3_status_;
  std::vector<TensorId> z3_data_;               // the gathered .data (held here), kNone when partitioned
  std::vector<std::vector<std::uint32_t>> z3_active_;  // ds_active_sub_modules
  std::vector<std::uint32_t> z3_inflight_;      // parameter → handle index, kNone when not in flight
  std::vector<Z3Handle> z3_handles_;
  std::vector<Z3Module> z3_modules_;
  std::map<std::pair<std::uint32_t, std::vector<std::uint32_t>>, std::uint32_t> z3_module_ids_;  // (key, params)
  Z3Trace z3_trace_ = Z3Trace::kInvalid;
  std::vector<std::uint32_t> z3_order_;         // __submodule_order
  std::vector<std::vector<std::int64_t>> z3_fetched_for_;  // __step_id_module_fetched_for, per module
  std::vector<Z3ParamUse> z3_param_order_;
  std::size_t z3_queue_ = 0;                    // __param_queue: the next entry of z3_param_order_
  std::vector<std::int64_t> z3_most_recent_;    // __most_recent_step_id_param_fetched_for
  std::int64_t z3_step_id_ = 0;
  // __n_available_params: what the coordinator gathered less what it released; a parameter gathered
  // outside it (an external parameter's getter) is released by it too, so this can go below 0.
  std::int64_t z3_available_ = 0;
  std::vector<std::uint32_t> z3_backward_active_;  // __active_backward_submodules
  // ds_recompute_parameters per module: frozen parameters a checkpoint's recompute fetched while
  // the module was the innermost in backward, released with it (Note [LoRA under ZeRO-3]).
  std::vector<std::vector<std::uint32_t>> z3_recompute_params_;
  std::vector<std::uint32_t> zero3_take_recompute_params(std::uint32_t module, std::vector<std::uint32_t>& params);
  std::vector<std::uint64_t> sub_group_numel_;
  TensorId z3_bucket_ = kNone;
  std::uint64_t z3_bucket_elements_ = 0;
  std::vector<std::uint32_t> z3_bucket_params_;
  std::vector<TensorId> z3_kept_grads_;         // .grads larger than the bucket, until reduced
  TensorId z3_fp32_grad_ = kNone;
  TensorId z3_norm_group_ = kNone;  // the sub-group's gradient norm, until step() returns
  // ZeRO-3 offload (zero3_offload.cpp, Note [ZeRO-3 offload])
  void zero3_offload_wrap();
  TensorId zero3_copy_in(std::uint32_t pi);  // ds_tensor.to(device) of a host partition (kNone: on the GPU)
  void zero3_offload_partition_grads();
  void zero3_offload_grad_norm();
  bool offload_params_ = false;  // offload_param: the 16-bit partitions live on the host
  // FSDP2's CPUOffloadPolicy (Note [FSDP2 CPU offload] in parallel.cpp)
  void fsdp_offload_host(std::uint64_t shard, const WrappedParam& p);
  bool fsdp_offload_ = false;
  Optimizer optimizer_ = Optimizer::kAdamW;
  // ZeRO-Offload (zero_offload.cpp)
  void offload_wrap();
  void offload_grad(std::uint32_t pi);
  void offload_before_optimizer();
  void offload_after_optimizer();
  void host_pinned(std::uint64_t bytes, std::uint64_t HostMemory::*category);
  void host_pageable(std::uint64_t bytes, std::uint64_t HostMemory::*category);
  bool offload_ = false;
  bool offload_boundary_ = false;     // this backward is the accumulation boundary
  std::vector<TensorId> offload_norms_;  // norm_for_param_grads, until reset_cpu_buffers
  HostMemory host_;
};

}  // namespace trainmem::graph
