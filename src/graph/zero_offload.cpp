// DeepSpeed ZeRO-Offload (zero_optimization.offload_optimizer {device: cpu}) on one ZeRO-1/2 rank:
// what stays on the GPU and the host memory it needs. The hooks are DataParallel's (graph/parallel.h);
// zero.cpp calls them where DeepSpeed's cpu_offload branches. Unmeasured (see the Note).
#include <algorithm>

#include "common/checked.h"
#include "graph/parallel.h"

namespace trainmem::graph {
namespace {

constexpr std::int32_t kNoLayer = -1;

// Note [ZeRO-Offload]
// DeepSpeedZeroOptimizer with cpu_offload (DeepSpeed 0.19.8, deepspeed/runtime/zero/
// stage_1_and_2.py; offload_config.py: offload_optimizer device cpu, pin_memory true, ratio 1 by
// default), over what Note [DeepSpeed ZeRO-1/2] builds. DeepSpeed refuses a torch optimizer under
// offload (engine.py, zero_force_ds_cpu_optimizer true by default): the config's AdamW is
// DeepSpeedCPUAdam (deepspeed/ops/adam/cpu_adam.py), whose fp32 exp_avg / exp_avg_sq are
// torch.zeros_like the fp32 partition on the CPU at the first step (pageable). The engine mirrors:
//  * __init__: the flat 16-bit group stays on the GPU as without offload (the parameters are views
//    of it); the fp32 master partition (single_partition_of_fp32_groups) is cloned to the CPU and
//    pinned, beside a pinned 16-bit copy of the partition (param_buffer_of_bit16_for_cpu_offload_
//    groups, the model dtype). temp_grad_buffer_for_cpu_offload (pinned) and
//    temp_grad_buffer_for_gpu_offload (on the GPU, for the whole run) are zeros of the largest
//    parameter's numel in the model dtype. initialize_optimizer_states gives the fp32 partition a
//    pinned zeros .grad, kept for the run (cpu_offload keeps it; without offload it goes);
//  * backward: the ipg bucket and the reduction as without offload (contiguous_gradients is forced
//    on), but copy_grads_in_partition takes the cpu_offload branch: no grads_in_partition on the
//    GPU. Under ZeRO-2 outside the boundary micro-batch (gradient accumulation), each parameter of the
//    partition is accumulated through temp_grad_buffer_for_gpu_offload (a view, no allocation)
//    into accumulated_grads_in_cpu[param] (pinned zeros of the whole parameter, model dtype, made
//    at its first copy and kept). At the boundary, per parameter: set_norm_for_param_grad_in_gpu
//    (its slice .to(float64), then .norm(2): a 0-dim float64 kept in norm_for_param_grads until
//    reset_cpu_buffers after the step), the overflow check (has_inf_or_nan, deepspeed/runtime/
//    utils.py: amax / amin scalars), async_inplace_copy_grad_to_fp32_buffer_from_gpu (.to(fp32)
//    of the slice for a 16-bit model, copied into the pinned fp32 .grad, then dropped), and the
//    .grad is cleared. The epilogue builds no averaged_gradients (and no padding zeros);
//  * step: complete_grad_norm_calculation_for_cpu_offload reads the norms with .item() and
//    all-reduces a 1-element FloatTensor, returned as a 0-dim fp32 (the group norm);
//    its result and _global_grad_norm are kept as without offload; unscale_and_clip, the
//    CPUAdam step and the fp32 → 16-bit staging copy run on the host; the staging copy goes into
//    this rank's slice of the flat group in place (non_blocking) and all_gather_dp_groups fills
//    the rest in place. No fp32 gradient partition is made on the GPU.
// Pinned memory comes from PyTorch's CachingHostAllocator, which rounds every block up to the
// next power of two (torch 2.13, ATen/core/CachingHostAllocator.h, allocate: PowerOf2Ceil while
// the size is under pinned_max_round_threshold, unlimited by default); the host figures are each
// pinned tensor's rounded size plus the pageable Adam states. The 16-bit clones that pin_memory()
// copies from, and the model loaded before deepspeed.initialize, are transient and not counted.
// Not modelled: the scalar temporaries of the overflow check and of combine_grad_norm_groups
// (0-dim, one 512-byte block each on CUDA), ratio < 1 (partial offload), NVMe (ZeRO-3's
// offload_optimizer and offload_param: Note [ZeRO-3 offload] in zero3_offload.cpp). DeepSpeed's
// estimate_zero2_model_states_mem_needs(cpu_offload=True) gives 2N bytes per GPU and
// N x max(4 x GPUs, 16) x 1.5 per node; the engine's GPU weights are the 2N flat group (padded)
// and its host model states 16 bytes per element of the flat group summed over the ranks (4
// master + 4 gradient + 8 Adam) plus the 16-bit staging copy and the buffers above, before the
// power-of-two rounding; tests/cpp/test_zero_offload.cpp checks both.
std::uint64_t power_of_two_ceil(std::uint64_t bytes) {
  std::uint64_t block = 1;
  while (block < bytes) block = detail::mul(block, 2, "pinned block bytes");
  return block;
}

}  // namespace

std::uint64_t DataParallel::pinned_block_bytes(std::uint64_t bytes) { return bytes == 0 ? 0 : power_of_two_ceil(bytes); }

void DataParallel::host_pinned(std::uint64_t bytes, std::uint64_t HostMemory::*category) {
  host_.pinned_bytes = detail::add(host_.pinned_bytes, pinned_block_bytes(bytes), "host pinned bytes");
  host_.pinned_requested_bytes = detail::add(host_.pinned_requested_bytes, bytes, "host pinned bytes");
  host_.*category = detail::add(host_.*category, bytes, "host bytes");
}

void DataParallel::host_pageable(std::uint64_t bytes, std::uint64_t HostMemory::*category) {
  host_.pageable_bytes = detail::add(host_.pageable_bytes, bytes, "host pageable bytes");
  host_.*category = detail::add(host_.*category, bytes, "host bytes");
}

// See Note [ZeRO-Offload]: __init__ and initialize_optimizer_states.
void DataParallel::offload_wrap() {
  const std::uint64_t item = zero_item_bytes();
  std::uint64_t largest = 0;
  for (const WrappedParam& p : params_) largest = std::max(largest, p.numel);
  host_ = HostMemory{};
  host_pinned(detail::mul(partition_numel_, 4, "fp32 partition bytes"), &HostMemory::weights_bytes);
  host_pinned(detail::mul(partition_numel_, item, "16-bit staging bytes"), &HostMemory::weights_bytes);
  host_pinned(detail::mul(largest, item, "temp_grad_buffer_for_cpu_offload bytes"), &HostMemory::gradients_bytes);
  host_pinned(detail::mul(partition_numel_, 4, "fp32 partition gradient bytes"), &HostMemory::gradients_bytes);
  // DeepSpeedCPUAdam's exp_avg and exp_avg_sq, pageable.
  host_pageable(detail::mul(partition_numel_, 8, "CPUAdam state bytes"), &HostMemory::optimizer_states_bytes);
  // accumulated_grads_in_cpu: one per parameter of the partition, under gradient accumulation
  // with ZeRO-2. ZeRO-1 reduces once, at the boundary, in the step's first ipg round
  // (micro_step_id 0): copy_grads_in_partition then skips the host accumulation.
  if (grad_accum_ > 1 && kind_ == Parallel::kZero2) {
    for (std::uint32_t pi : in_partition_) {
      host_pinned(detail::mul(params_[pi].numel, item, "accumulated_grads_in_cpu bytes"), &HostMemory::gradients_bytes);
    }
  }
  t_.at(Phase::kSetup, kNoLayer, "zero.temp_grad_buffer_for_gpu_offload");
  t_.alloc_bytes(detail::mul(largest, item, "temp_grad_buffer_for_gpu_offload bytes"), Category::kGradients);
}

// copy_grads_in_partition's cpu_offload branch for one parameter of this partition.
void DataParallel::offload_grad(std::uint32_t pi) {
  const bool boundary = kind_ == Parallel::kZero1 || offload_boundary_;
  if (boundary) {
    const std::uint64_t begin = std::max(flat_offset_[pi], partition_begin_);
    const std::uint64_t end = std::min(flat_offset_[pi] + params_[pi].numel, partition_begin_ + partition_numel_);
    const std::uint64_t n = end - begin;
    t_.at(t_.phase(), kNoLayer, "zero.offload_grad_to_cpu");
    TensorId wide = t_.alloc_bytes(detail::mul(n, 8, "grad norm bytes"), Category::kTemporaries);
    offload_norms_.push_back(t_.alloc_bytes(8, Category::kTemporaries));  // norm_for_param_grads
    t_.release(wide);
    if (zero_item_bytes() != 4) {  // .to(fp32) before the copy into the pinned fp32 .grad
      t_.release(t_.alloc_bytes(detail::mul(n, 4, "fp32 gradient slice bytes"), Category::kTemporaries));
    }
  }
  if (pi == extra_large_) {  // its own .grad, cleared (clear_grad_attribute) once copied
    const std::uint32_t slot = params_[pi].slot;
    if (t_.param_grad(slot) != kNone) t_.release(t_.param_grad(slot));
    t_.set_param_grad(slot, kNone);
  }
}

// step() up to the host optimizer (see Note [ZeRO-Offload]).
void DataParallel::offload_before_optimizer() {
  t_.at(Phase::kOptimizer, kNoLayer, "zero.grad_norm");
  t_.release(t_.alloc_bytes(4, Category::kTemporaries));  // total_dev_norm, all-reduced
  TensorId group = t_.alloc_bytes(4, Category::kTemporaries);  // torch.tensor(total_norm)
  scaled_norm_ = t_.alloc_bytes(4, Category::kTemporaries);    // combine_grad_norm_groups
  t_.release(group);
  TensorId norm = t_.alloc_bytes(4, Category::kTemporaries);  // _global_grad_norm
  set_global_grad_norm(norm);
}

void DataParallel::offload_after_optimizer() {
  for (TensorId id : offload_norms_) t_.release(id);  // reset_cpu_buffers
  offload_norms_.clear();
}

void DataParallel::skip_to_last_micro() { micro_ = grad_accum_ - 1; }

}  // namespace trainmem::graph
