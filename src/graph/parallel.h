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
};

class DataParallel {
 public:
  // `rank`: the rank whose memory is built (ZeRO's partition; the others use rank 0).
  DataParallel(Tape& tape, const Recipe& recipe, bool cuda, std::uint64_t rank = 0);

  // After the model is built, before the optimizer exists. `layers[l]` are the indices (into
  // `params`) of decoder layer l's parameters, `root` the others (embeddings, final norm,
  // lm_head); `buffers` the bytes of the module's buffers by dtype. FSDP2 points every
  // parameter's `storage` at its unsharded parameter (freed until it is gathered).
  void wrap(std::vector<WrappedParam>& params, const std::vector<std::vector<std::uint32_t>>& layers,
            const std::vector<std::uint32_t>& root, const std::vector<std::pair<DType, std::uint64_t>>& buffers);

  void pre_forward();                    // the wrapped module is called
  void layer_pre_forward(std::uint32_t layer);
  void layer_post_forward(std::uint32_t layer);
  void backward_begin();                 // the loss' gradient exists
  void layer_change(std::int32_t from, std::int32_t to);  // backward moves between layers
  void param_ready(std::uint32_t slot);  // AccumulateGrad has run for this parameter
  void backward_end();                   // after the engine has run every node
  void before_optimizer();               // sharded gradients into the .grad slots

  // The elements of this rank's parameter that the optimizer sees (FSDP2: rank 0's shard).
  std::uint64_t local_numel(std::uint32_t slot, std::uint64_t numel) const;

  // DeepSpeed ZeRO-1/2 (zero.cpp, Note [DeepSpeed ZeRO-1/2]). The torch optimizer holds one
  // parameter, this rank's fp32 master partition of zero_partition_numel() elements; its
  // gradient exists between zero_before_optimizer() (which also runs the gradient norm) and
  // zero_after_optimizer().
  bool zero() const { return is_zero(kind_); }
  std::uint64_t zero_partition_numel() const { return partition_numel_; }
  void zero_after_optimizer();

  // The flat group's layout (exposed for tests): flat elements, padded to 2 x world
  // (nccl_start_alignment_factor), and rank r's partition, flat / world elements.
  static std::uint64_t zero_flat_numel(std::uint64_t numel, std::uint64_t world);
  // The ipg bucket setup_buckets allocates in every backward: reduce_bucket_size elements of the
  // model dtype, whatever the model's size (exposed for the planner's floor).
  static std::uint64_t zero_bucket_bytes(std::uint64_t item_bytes);

  // ZeRO-Offload (zero_offload.cpp, Note [ZeRO-Offload]): the host memory this rank holds, and
  // whether the step's last micro-batch differs from the ones before it (the replay must not skip
  // it). pinned_block_bytes: what CachingHostAllocator hands out for a pinned tensor.
  bool offload() const { return offload_; }
  const HostMemory& host_memory() const { return host_; }
  bool boundary_micro_batch_differs() const { return offload_ && kind_ == Parallel::kZero2; }
  void skip_to_last_micro();
  static std::uint64_t pinned_block_bytes(std::uint64_t bytes);

 private:
  struct Unit {
    std::vector<std::uint32_t> params;
    std::uint64_t shard_numel = 0;  // Σ padded shard elements
    DType dtype = DType::kF32;
    TensorId flat = kNone;          // all-gather buffer in flight
    bool gathered = false;
    TensorId sharded_grad = kNone;  // reduce-scatter output (the sharded .grads are views)
  };

  void rebuild_buckets();
  void all_gather(Unit& u);
  void copy_out(Unit& u);
  void reshard(Unit& u);
  void reduce(Unit& u);
  void release_gloo_temporary();

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
  // FSDP2
  std::vector<Unit> units_;  // decoder layers, then the root
  std::vector<std::uint64_t> shard_numel_;  // per parameter, padded
  std::vector<TensorId> unsharded_;         // per parameter
  TensorId pending_reduce_input_ = kNone;   // the last reduce-scatter's input, kept until the next
  TensorId gloo_temporary_ = kNone;         // CPU: gloo's reduce-scatter temporary still alive
  // ZeRO-1/2 (zero.cpp)
  void zero_wrap();
  void zero_param_ready(std::uint32_t slot);
  void zero_backward_end();
  void zero_epilogue();
  void zero_pad(const std::vector<std::uint64_t>& slices);
  void zero_before_optimizer();
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
  TensorId grad_norm_ = kNone;    // _global_grad_norm, kept until the next step's
  TensorId scaled_norm_ = kNone;  // step()'s scaled_global_grad_norm
  std::uint64_t micro_ = 0;       // micro-batches since the last step
  std::uint64_t grad_accum_ = 1;
  // ZeRO-Offload (zero_offload.cpp)
  void offload_wrap();
  void offload_grad(std::uint32_t pi);
  void offload_before_optimizer();
  void offload_after_optimizer();
  void host_pinned(std::uint64_t bytes, std::uint64_t HostMemory::*category);
  bool offload_ = false;
  bool offload_boundary_ = false;     // this backward is the accumulation boundary
  std::vector<TensorId> offload_norms_;  // norm_for_param_grads, until reset_cpu_buffers
  HostMemory host_;
};

}  // namespace trainmem::graph
