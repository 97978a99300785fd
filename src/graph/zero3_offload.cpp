// DeepSpeed ZeRO-3 with CPU offload (zero_optimization.offload_optimizer and / or offload_param
// {device: cpu}) on one rank: what leaves the GPU, what the host holds, and what the gradient
// path and the step still allocate on the GPU. zero3.cpp calls these where DeepSpeed's stage3.py
// and partition_parameters.py branch on offload_optimizer / offload_param. Unmeasured (see the Note).
#include <algorithm>

#include "common/checked.h"
#include "graph/parallel.h"

namespace trainmem::graph {
namespace {

constexpr std::int32_t kNoLayer = -1;
// _constant_buffered_norm2's buffer_size: the norm is taken over chunks of this many elements.
constexpr std::uint64_t kNormChunkElements = 250'000'000;

// Note [ZeRO-3 offload]
// DeepSpeedZeroOptimizer_Stage3 over what Note [DeepSpeed ZeRO-3] builds, with
// offload_optimizer {device: cpu} and / or offload_param {device: cpu} (DeepSpeed 0.19.8,
// deepspeed/runtime/zero/stage3.py, partition_parameters.py, parameter_offload.py; offload_config.py:
// pin_memory true for both, ratio 1, no NVMe). As for ZeRO-1/2 (Note [ZeRO-Offload]) the
// config's AdamW becomes DeepSpeedCPUAdam under offload_optimizer (zero_force_ds_cpu_optimizer);
// offload_param alone keeps the torch optimizer on the GPU.
//  * offload_param, initialize: DeepSpeedZeRoOffload runs Init(module, remote_device=cpu,
//    pin_memory=true), so _partition_param makes every partition (persistent ones too: ds_persist
//    is set later) a pinned host tensor of ceil(numel / world) elements. stage3's
//    _create_fp16_partitions_with_defragmentation then takes the offload_param branch: no
//    lp_param_buffer on the GPU; one pinned flat per param group (_create_param_groups_fp16_flat_
//    cpu_memory, Σ partitions of the model dtype) and _move_to_flat_buffer copies each partition
//    into it and repoints ds_tensor. The per-parameter pinned tensors are freed; PyTorch's
//    CachingHostAllocator keeps their blocks cached (it frees to the OS only on empty_cache), so
//    they stay in the host figure as pinned blocks (not as requested bytes).
//  * offload_param, fetch: every all-gather reads a host partition. all_gather_coalesced:
//    the flat buffer (Σ partitions x world) first, then torch.cat([p.ds_tensor.to(device) ...],
//    out=this rank's slice): one GPU copy of each partition, freed after the cat;
//    _all_gather_sequential (one parameter): the buffer, then ds_tensor.to(device) as the
//    all-gather's input, freed after it. _post_step's gather of the persistent parameters is the
//    same. The optimizer step writes the host partitions (fp16_partitioned_groups_flat is the
//    pinned flat) from the fp32 master with copy_: a host-side conversion, nothing on the GPU.
//  * offload_optimizer, initialize: self.device is the CPU. _create_fp32_partitions: each
//    sub-group's fp32 master is .to(cpu, fp32).clone() (pageable). _setup_for_real_optimizer:
//    grad_partitions_flat_buffer (Σ partitions, model dtype) is made on the CPU and pinned; the
//    ipg bucket stays on the GPU; inf_or_nan_tracker is on the CPU. initialize_optimizer_states
//    gives each sub-group's fp32 master a pinned zeros .grad (kept: _release_sub_group keeps it
//    under offload). DeepSpeedCPUAdam's exp_avg / exp_avg_sq are zeros_like the fp32 master on
//    the host at the first step (pageable).
//  * offload_optimizer, backward: the reduce-scatter as without offload, then partition_grads
//    per parameter of the bucket (by ds_id): the pinned partition buffer receives the reduced
//    chunk (copy_; add_ through a device copy under accumulation), and grad_buffer.to(device)
//    makes a GPU copy of the partition (model dtype) that lives until the next parameter's
//    iteration rebinds the local (the last one until partition_grads returns). At the
//    accumulation boundary (_offload_grad_partition_at_boundary): _constant_buffered_norm2 (per
//    chunk of 250M elements .to(float64), .norm(2), ** 2, summed in place, then ** 0.5: a 0-dim
//    float64 kept in norm_for_param_grads until reset_cpu_buffers in _post_step) and
//    grad_buffer.to(fp32) (a GPU temporary for a bf16 model) copied into the pinned fp32 .grad.
//    Outside the boundary micro-batch the norm and the fp32 copy do not run.
//  * offload_optimizer, step: _partition_all_parameters as without offload; per sub-group
//    complete_grad_norm_calculation_for_cpu_offload sums norm ** 2 on the GPU (0-dim float64s),
//    makes a 1-element FloatTensor on the GPU for the all-reduce, its [0] ** 0.5 and
//    mask_nan_or_inf_with_val_inplace's isinf / isnan / logical_or / tensor(-1.0), then .cpu():
//    combine_grad_norm_groups, the clip factor, unscale_and_clip_grads, CPUAdam and
//    _global_grad_norm all run on the host. _reassign_or_swap_out_partitioned_parameters copies the
//    fp32 master into the 16-bit partition (host → GPU, converted on the host; host → host under
//    offload_param). No fp32 gradient, no fp32 master and no gradient partitions on the GPU.
// What stays on the GPU: the ipg bucket (reduce_bucket_size elements: 1 GB in bf16, whatever
// the model), the gathered parameters of the modules in use and the prefetch, the persistent
// parameters (numel <= 1e5) gathered for the whole run, the 16-bit partitions without
// offload_param, the fp32 masters and gradient partitions without offload_optimizer, and the
// temporaries above. The host figures are each pinned tensor's power-of-two block (CachingHost
// Allocator, Note [ZeRO-Offload]) plus the pageable fp32 masters and Adam states; transient host
// copies (the 16-bit clones pin_memory() copies from, the conversion temporaries of copy_) are
// not counted. Rank 0 is modelled: on a rank whose partition of a tiny parameter is all
// padding, partition_grads skips it (a few bytes less). Not modelled: NVMe (offload device nvme,
// the partitioned_param_swapper / optimizer swapper: refused by the recipe), ratio < 1,
// max_in_cpu, CUDA streams (as Note [DeepSpeed ZeRO-3]).
// DeepSpeed's estimate_zero3_model_states_mem_needs (stage3.py; zero_init, the factor 1.5)
// says, per GPU: 4 x the largest module's own parameters, + 2N / GPUs with offload_optimizer
// alone; per node: N x 18 x 1.5 host bytes with both, N x 16 x 1.5 with offload_optimizer alone.
// The engine's host model states per rank are 4 (fp32 master) + 8 (Adam) + 4 (fp32 gradient) + 2
// (the pinned gradient partitions, model dtype: what DeepSpeed's 16 leaves out) per partition
// element, + 2 (the pinned 16-bit partitions) under offload_param, before the power-of-two
// rounding and the cached blocks; its GPU weights are the 2N / GPUs partitions without
// offload_param and the gathered modules. tests/cpp/test_zero3_offload.cpp holds both.
}  // namespace

// See Note [ZeRO-3 offload]: the host side of initialize (the GPU side is zero3_wrap's).
void DataParallel::zero3_offload_wrap() {
  host_ = HostMemory{};
  const std::uint64_t total = partition_numel_;
  if (offload_params_) {
    for (std::size_t i = 0; i < params_.size(); ++i) {  // Init's pinned partitions, freed but cached
      host_.pinned_bytes = detail::add(
          host_.pinned_bytes,
          pinned_block_bytes(detail::mul(z3_partition_[i], z3_item(static_cast<std::uint32_t>(i)), "partition bytes")),
          "host pinned bytes");
    }
    host_pinned(detail::mul(total, z3_item_, "param_groups_fp16_flat_cpu_memory bytes"), &HostMemory::weights_bytes);
  }
  if (!offload_) return;
  for (std::uint64_t g : sub_group_numel_) {
    host_pageable(detail::mul(g, 4, "fp32 partition bytes"), &HostMemory::weights_bytes);
  }
  host_pinned(detail::mul(total, z3_accum_item_, "grad_partitions_flat_buffer bytes"), &HostMemory::gradients_bytes);
  for (std::uint64_t g : sub_group_numel_) {
    host_pinned(detail::mul(g, 4, "fp32 partition gradient bytes"), &HostMemory::gradients_bytes);
  }
  host_pageable(detail::mul(total, 8, "CPUAdam state bytes"), &HostMemory::optimizer_states_bytes);
}

// ds_tensor.to(device) of a host partition (offload_param), kNone when the partition is on the GPU.
TensorId DataParallel::zero3_copy_in(std::uint32_t pi) {
  if (!offload_params_) return kNone;
  return t_.alloc_bytes(detail::mul(z3_partition_[pi], z3_item(pi), "partition copy bytes"), Category::kWeights);
}

// partition_grads' offload_optimizer branch over the bucket (sorted by ds_id), after the
// reduce-scatter (See Note [ZeRO-3 offload]).
void DataParallel::zero3_offload_partition_grads() {
  const bool boundary = micro_ + 1 >= grad_accum_;
  TensorId copy = kNone;
  for (std::uint32_t p : z3_bucket_params_) {
    const std::uint64_t n = z3_partition_[p];
    if (copy != kNone) t_.release(copy);  // the previous parameter's grad_buffer local
    copy = t_.alloc_bytes(detail::mul(n, z3_accum_item_, "gradient partition copy bytes"), Category::kGradients);
    if (!boundary) continue;
    TensorId norm = kNone;  // _constant_buffered_norm2
    for (std::uint64_t done = 0; done < n || (n == 0 && norm == kNone); done += kNormChunkElements) {
      const std::uint64_t chunk = std::min(kNormChunkElements, n - done);
      TensorId wide = t_.alloc_bytes(detail::mul(chunk, 8, "grad norm bytes"), Category::kTemporaries);
      TensorId part = t_.alloc_bytes(8, Category::kTemporaries);  // .norm(2)
      t_.release(wide);
      TensorId squared = t_.alloc_bytes(8, Category::kTemporaries);  // ** 2.0
      t_.release(part);
      if (norm == kNone) {
        norm = squared;
      } else {
        t_.release(squared);  // norm += it, in place
      }
      if (n == 0) break;
    }
    offload_norms_.push_back(t_.alloc_bytes(8, Category::kTemporaries));  // norm ** 0.5, kept
    t_.release(norm);
    if (z3_accum_item_ != 4) {  // grad_buffer.to(fp32), copied into the pinned fp32 .grad
      t_.release(t_.alloc_bytes(detail::mul(n, 4, "fp32 gradient partition bytes"), Category::kTemporaries));
    }
  }
  if (copy != kNone) t_.release(copy);  // partition_grads returns
}

// complete_grad_norm_calculation_for_cpu_offload, once per sub-group (See Note [ZeRO-3 offload]).
// Every parameter's norm is in one sub-group's list; the engine sums them over the first.
void DataParallel::zero3_offload_grad_norm() {
  t_.at(Phase::kOptimizer, kNoLayer, "zero3.offload_grad_norm");
  for (std::size_t g = 0; g < sub_group_numel_.size(); ++g) {
    TensorId total = kNone;  // 0.0 + the first norm ** 2, then += in place
    if (g == 0) {
      for (std::size_t k = 0; k < offload_norms_.size(); ++k) {
        TensorId squared = scalar(8);
        if (total == kNone) {
          total = scalar(8);
        }
        t_.release(squared);
      }
    }
    TensorId cuda = scalar(4);   // FloatTensor([float(total_norm)]), all-reduced in place
    TensorId root = scalar(4);   // total_norm_cuda[0] ** (1 / 2)
    TensorId inf = scalar(1), nan = scalar(1), either = scalar(1), err = scalar(4);  // mask_nan_or_inf_with_val_inplace
    for (TensorId id : {inf, nan, either, err}) t_.release(id);
    for (TensorId id : {root, cuda}) t_.release(id);  // .cpu() returned, the locals go
    if (total != kNone) t_.release(total);
  }
}

}  // namespace trainmem::graph
