// DeepSpeed ZeRO stages 1 and 2 on one rank: the DataParallel hooks for Parallel::kZero1 and
// kZero2 (graph/parallel.h). docs/parallelism.md, "DeepSpeed ZeRO", has what was measured.
#include <algorithm>

#include "common/checked.h"
#include "graph/parallel.h"

namespace trainmem::graph {
namespace {

constexpr std::int32_t kNoLayer = -1;

// Note [DeepSpeed ZeRO-1/2]
// deepspeed.initialize(model, optimizer=torch AdamW/SGD over model.parameters(), config) with
// zero_optimization.stage 1 or 2 and DeepSpeed's defaults (0.19.8,
// deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer; engine.py backward/step):
// contiguous_gradients true, overlap_comm false for stages 1/2, reduce_bucket_size =
// allgather_bucket_size = 5e8 elements, round_robin_gradients false, no offload, one param group.
// The engine mirrors rank 0, which holds the first partition:
//  * __init__: the group's parameters are flattened into one buffer (flatten_dense_tensors_aligned
//    → _flatten_dense_tensors), padded to a multiple of nccl_start_alignment_factor (2) x world,
//    and every parameter's .data becomes a view of it (_update_model_bit16_weights): the model's
//    own parameter storages are freed. The flat buffer is split in `world` equal partitions
//    (get_data_parallel_partitions); this rank's partition is cloned into the fp32 master
//    partition (single_partition_of_fp32_groups: .detach().clone().to(fp32), also for an fp32
//    model), the one parameter the torch optimizer holds. params_in_partition are the parameters
//    that overlap it (get_partition_info). Both are weights for the run;
//  * backward: every parameter's grad hook (after AccumulateGrad) runs process_gradients →
//    setup_buckets, which at the first hook of a backward allocates the ipg bucket, torch.empty(
//    reduce_bucket_size) in the model dtype (_gradient_reduction_buffer_dtype: gradient
//    accumulation in the model dtype, as measured). ZeRO-2 (partition_gradients) then copies the
//    .grad into the bucket and repoints .grad at the bucket slice, so autograd's gradient is
//    freed (reduce_independent_p_g_buckets_and_remove_grads); a parameter that does not fit in
//    what is left of the bucket first reduces the bucket (reduce_ipg_grads), and one larger than
//    the bucket keeps its own .grad and is reduced alone (extra_large_param_to_reduce). ZeRO-1
//    leaves the .grads where autograd made them until the end of the backward, where
//    reduce_gradients moves them into the bucket the same way, in parameter order; under gradient
//    accumulation only at the boundary (engine.allreduce_gradients), so the .grads accumulate
//    in place and the first micro-batch's bucket stays until then;
//  * reduce_ipg_grads → average_tensor: the bucket is cut into per-rank slices (consecutive
//    slices of one rank merged) and, with use_multi_rank_bucket_allreduce (default true), all of
//    them go to allreduce_and_scatter, which flattens them in chunks that close after passing
//    reduce_bucket_size (allreduce_bucket → _flatten_dense_tensors: a copy, except for a single
//    slice, which is a view; measured: a torch.cat of the whole bucket), all-reduces the chunk
//    and copies this rank's slices back; the flat copy goes when that returns. Then every
//    parameter of this rank's partition is copied into grads_in_partition (copy_grads_in_partition:
//    torch.empty of Σ params_in_partition numel, in the model dtype, allocated at the first
//    reduction) and its .grad repointed there; the others keep their bucket views;
//  * the epilogue (independent_gradient_partition_epilogue, at the end of every backward): reduce
//    what is left in the bucket, take views of grads_in_partition (all_grad_tensors, then
//    averaged_gradients at the accumulation boundary; under accumulation a later micro-batch's
//    grads_in_partition is added into the first one's and dropped), release the bucket
//    (_release_ipg_buffers) and set every .grad to None (_clear_param_grad_only): the bucket is
//    freed, grads_in_partition lives on in the views;
//  * step: the gradient norm (scaled_global_norm → get_grad_norm_direct) converts each of this
//    partition's gradient slices to get_norm_dtype() (float64 where the device has it, CPU and
//    CUDA alike) for its vector_norm, one at a time, and keeps a 0-dim norm per slice; the total
//    (combine_grad_norm_groups, runtime/utils.py) lives until step() returns, and the total over
//    the loss scale is kept as the optimizer's _global_grad_norm until the next step's, and as the
//    DeepSpeedEngine's (_take_model_step copies it after step() returns): the previous step's
//    norm lives through the next step() (measured: step 2's optimizer phase, 512 B on the CPU,
//    every ZeRO stage; set_global_grad_norm). The norm's own 0-dim bookkeeping: the -1 mask of
//    an invalid norm, combine_grad_norm_groups' and step()'s validity checks (is_invalid_grad_norm
//    for a 32-bit model), and unscale_and_clip_grads at DeepSpeed's default gradient_clipping 1.0
//    (clip_factor; measured: every allocation of cpu-zero1-gpt2l2-fp32-sgd-b2s32 and the ZeRO
//    LoRA entries, session 26). Then the slices are flattened (a view for
//    one slice) and .to(fp32) (single_grad_partition: a copy for a 16-bit model, the flat itself
//    for fp32), averaged_gradients dropped (grads_in_partition goes), the torch optimizer steps
//    the fp32 partition (its states are sized by it), the fp32 gradient is dropped, the partition
//    is copied into this rank's slice of the flat buffer and all_gather_dp_groups gathers the
//    other slices into it in place.
// Gradient accumulation (both stages) is modelled this way but unmeasured. Not modelled: gloo's
// or NCCL's own buffers (none go through PyTorch's allocator that the CPU measurements see) and
// the transient second copy of the parameters while deepspeed.initialize
// flattens them (before tracking starts, as the measurements do). On CUDA the reduction runs on
// the current stream (overlap_comm off, so reduction_stream is unused) and get_norm_dtype() is
// float64 too: the order is the CPU one; unmeasured there.
//
// Note [QLoRA under ZeRO-1/2]
// deepspeed.initialize over get_peft_model(prepare_model_for_kbit_training(<4-bit base>)) with
// the optimizer over the adapters (measured: data/ground_truth/parallel/cpu-zero*-*qlora*,
// *-4bit*). The flat group, the partitions and the bucket hold the adapters only, as over any
// peft model; the packed Params4bit weights and their QuantState tensors stay where they are on
// every rank. What DeepSpeed's bf16 mode (our bf16-master) does on top: the engine casts the
// parameters to bf16 (engine.py _cast_module_mixed_precision, `p.data = p.data.to(bf16)` for
// floating dtypes only: not the uint8 packed weights; the QuantState is no parameter, and the
// buffers are not cast), so the fp32
// embeddings, norms and lm_head of prepare_model_for_kbit_training and peft's fp32 adapters are
// bf16 again. The step is then a bf16-true QLoRA step with bf16 adapters: the 4-bit matmuls'
// casts of x and of the output are no-ops, the weight was loaded and is dequantized in bf16.
// In fp32 mode nothing is cast. (StepBuilder's policy: bf16-master's, not QLoRA's fp32 rest.)
constexpr std::uint64_t kReduceBucketElements = 500'000'000;
constexpr std::uint64_t kNcclStartAlignment = 2;

}  // namespace

std::uint64_t DataParallel::zero_flat_numel(std::uint64_t numel, std::uint64_t world) {
  const std::uint64_t align = detail::mul(kNcclStartAlignment, world, "ZeRO alignment");
  return detail::mul(numel / align + (numel % align != 0), align, "ZeRO flat group elements");
}

std::uint64_t DataParallel::zero_bucket_bytes(std::uint64_t item_bytes) {
  return detail::mul(kReduceBucketElements, item_bytes, "ZeRO bucket bytes");
}

std::uint64_t DataParallel::zero_item_bytes() const { return dtype_bytes(params_.front().dtype); }

// See Note [DeepSpeed ZeRO-1/2].
void DataParallel::zero_wrap() {
  TRAINMEM_ASSERT(!params_.empty(), "ZeRO wraps no parameters");
  t_.at(Phase::kSetup, kNoLayer, "zero.flatten_params");
  std::uint64_t numel = 0;
  flat_offset_.clear();
  for (const WrappedParam& p : params_) {
    TRAINMEM_ASSERT(p.dtype == params_.front().dtype, "ZeRO's flat group mixes dtypes");
    flat_offset_.push_back(numel);
    numel = detail::add(numel, p.numel, "ZeRO group elements");
  }
  const std::uint64_t flat = zero_flat_numel(numel, world_);
  partition_numel_ = flat / world_;
  zero_flat_ = t_.alloc_bytes(detail::mul(flat, zero_item_bytes(), "ZeRO flat group bytes"), Category::kWeights);
  for (WrappedParam& p : params_) p.storage = zero_flat_;  // views; the flat buffer lives for the run
  // This rank's partition [rank x partition, (rank + 1) x partition) and the parameters that
  // overlap it (get_partition_info); the last rank's ends in the group's padding.
  partition_begin_ = detail::mul(rank_, partition_numel_, "ZeRO partition offset");
  const std::uint64_t partition_end = partition_begin_ + partition_numel_;
  in_partition_.clear();
  is_in_partition_.assign(params_.size(), false);
  for (std::uint32_t i = 0; i < params_.size(); ++i) {
    if (flat_offset_[i] < partition_end && flat_offset_[i] + params_[i].numel > partition_begin_) {
      in_partition_.push_back(i);
      is_in_partition_[i] = true;
    }
  }
  sub_group_numel_.assign(1, partition_numel_);  // the torch optimizer steps it whole
  if (offload_) return offload_wrap();  // the fp32 partition lives on the host: Note [ZeRO-Offload]
  t_.at(Phase::kSetup, kNoLayer, "zero.fp32_partition");
  t_.alloc_bytes(detail::mul(partition_numel_, 4, "ZeRO fp32 partition bytes"), Category::kWeights);
}

void DataParallel::zero_param_ready(std::uint32_t slot) {
  const std::uint32_t pi = slot < param_of_slot_.size() ? param_of_slot_[slot] : kNone;
  if (pi == kNone) return;
  if (zero_bucket_ == kNone) {  // setup_buckets, at the first hook of the backward
    t_.at(t_.phase(), kNoLayer, "zero.setup_buckets");
    zero_bucket_ = t_.alloc_bytes(zero_bucket_bytes(zero_item_bytes()), Category::kGradients);
    bucket_elements_ = 0;
    offload_boundary_ = micro_ + 1 >= grad_accum_;  // See Note [ZeRO-Offload]
  }
  if (kind_ == Parallel::kZero2) zero_to_bucket(pi);
}

// reduce_independent_p_g_buckets_and_remove_grads.
void DataParallel::zero_to_bucket(std::uint32_t pi) {
  const std::uint64_t numel = params_[pi].numel;
  if (bucket_elements_ + numel > kReduceBucketElements) zero_reduce_ipg();
  const std::uint32_t slot = params_[pi].slot;
  if (numel > kReduceBucketElements) {
    extra_large_ = pi;  // keeps its own .grad
  } else if (t_.param_grad(slot) != kNone) {
    t_.release(t_.param_grad(slot));  // .grad is now a view of the bucket
    t_.set_param_grad(slot, kNone);
  }
  bucket_elements_ += numel;
  bucket_params_.push_back(pi);
}

// reduce_ipg_grads: average_tensor, then this partition's gradients into grads_in_partition.
void DataParallel::zero_reduce_ipg() {
  if (bucket_params_.empty()) return;
  t_.at(t_.phase(), kNoLayer, "zero.reduce_ipg_grads");
  const std::uint64_t item = zero_item_bytes();
  // rank_and_offsets: (destination rank, elements), consecutive slices of one rank merged.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> slices;
  for (std::uint32_t pi : bucket_params_) {
    const std::uint64_t begin = flat_offset_[pi], end = begin + params_[pi].numel;
    for (std::uint64_t at = begin; at < end;) {
      const std::uint64_t rank = std::min(at / partition_numel_, world_ - 1);
      const std::uint64_t stop = rank == world_ - 1 ? end : std::min(end, (rank + 1) * partition_numel_);
      if (!slices.empty() && slices.back().first == rank) {
        slices.back().second += stop - at;
      } else {
        slices.emplace_back(rank, stop - at);
      }
      at = stop;
    }
  }
  // use_multi_rank_bucket_allreduce (default true): every slice goes to one all-reduce bucket,
  // flattened in chunks that close after passing the bucket size (allreduce_and_scatter).
  std::uint64_t count = 0, elements = 0;
  auto flush = [&] {
    if (count > 1) t_.release(t_.alloc_bytes(detail::mul(elements, item, "ZeRO reduce bytes"), Category::kGradients));
    count = 0;
    elements = 0;
  };
  for (const auto& s : slices) {
    ++count;
    elements += s.second;
    if (elements > kReduceBucketElements) flush();
  }
  if (count > 0) flush();
  for (std::uint32_t pi : bucket_params_) {
    if (!is_in_partition_[pi]) continue;  // other partitions keep their bucket views
    if (offload_) {  // to the host's fp32 .grad: See Note [ZeRO-Offload]
      offload_grad(pi);
      continue;
    }
    if (grads_in_partition_ == kNone) {
      std::uint64_t total = 0;
      for (std::uint32_t q : in_partition_) total += params_[q].numel;
      grads_in_partition_ = t_.alloc_bytes(detail::mul(total, item, "grads_in_partition bytes"), Category::kGradients);
    }
    if (pi == extra_large_) {  // its own .grad, copied into grads_in_partition
      const std::uint32_t slot = params_[pi].slot;
      t_.release(t_.param_grad(slot));
      t_.set_param_grad(slot, kNone);
    }
  }
  bucket_elements_ = 0;
  bucket_params_.clear();
  extra_large_ = kNone;
}

// engine.backward → allreduce_gradients: ZeRO-1's reduce_gradients (at the accumulation
// boundary only), then independent_gradient_partition_epilogue for both stages (see Note
// [DeepSpeed ZeRO-1/2]).
void DataParallel::zero_backward_end() {
  ++micro_;
  // ZeRO-1 reduces only at the accumulation boundary (engine.allreduce_gradients): until then the
  // .grads accumulate as without DeepSpeed and the bucket of the first hook stays.
  if (kind_ == Parallel::kZero1 && micro_ < grad_accum_) return;
  zero_epilogue();
}

void DataParallel::zero_epilogue() {
  if (kind_ == Parallel::kZero1) {
    t_.at(t_.phase(), kNoLayer, "zero.reduce_gradients");
    for (std::uint32_t pi = 0; pi < params_.size(); ++pi) {
      if (t_.param_grad(params_[pi].slot) != kNone) zero_to_bucket(pi);
    }
  }
  t_.at(t_.phase(), kNoLayer, "zero.gradient_partition_epilogue");
  zero_reduce_ipg();
  t_.at(t_.phase(), kNoLayer, "zero.gradient_partition_epilogue");
  if (grads_in_partition_ != kNone) {
    if (accumulated_ == kNone) {
      accumulated_ = grads_in_partition_;  // the views in all_grad_tensors / averaged_gradients
    } else {
      t_.release(grads_in_partition_);  // added into the first micro-batch's
    }
    grads_in_partition_ = kNone;
  }
  if (micro_ >= grad_accum_ && !offload_) {  // averaged_gradients = get_flat_partition(...) at the boundary
    std::vector<std::uint64_t> slices;
    for (std::uint32_t pi : in_partition_) {
      const std::uint64_t begin = std::max(flat_offset_[pi], partition_begin_);
      const std::uint64_t end = std::min(flat_offset_[pi] + params_[pi].numel, partition_begin_ + partition_numel_);
      slices.push_back(end - begin);
    }
    zero_pad(slices);
  }
  if (zero_bucket_ != kNone) t_.release(zero_bucket_);  // _release_ipg_buffers
  zero_bucket_ = kNone;
  for (const WrappedParam& p : params_) {  // _clear_param_grad_only
    if (t_.param_grad(p.slot) == kNone) continue;
    t_.release(t_.param_grad(p.slot));
    t_.set_param_grad(p.slot, kNone);
  }
}

// _get_flat_partition_unpadded: the slices of this partition fall short of it only on the last
// rank, in the group's padding, which becomes a torch.zeros kept with averaged_gradients.
void DataParallel::zero_pad(const std::vector<std::uint64_t>& slices) {
  std::uint64_t covered = 0;
  for (std::uint64_t n : slices) covered += n;
  zero_pad_ = kNoPad;
  if (covered < partition_numel_) {
    zero_pad_ = t_.alloc_bytes(detail::mul(partition_numel_ - covered, zero_item_bytes(), "ZeRO padding bytes"),
                               Category::kGradients);
  }
}

// DeepSpeedZeroOptimizer.step up to the torch optimizer's step (see Note [DeepSpeed ZeRO-1/2]).
void DataParallel::zero_before_optimizer() {
  // The replay skipped the step's last micro-batches (they repeat the one before): ZeRO-1's
  // boundary reduction is still to run.
  if (kind_ == Parallel::kZero1 && zero_bucket_ != kNone) zero_epilogue();
  micro_ = 0;
  const std::uint64_t item = zero_item_bytes();
  // This partition's slices of params_in_partition (rank 0: from the start of each).
  std::vector<std::uint64_t> slices;
  for (std::uint32_t pi : in_partition_) {
    const std::uint64_t begin = std::max(flat_offset_[pi], partition_begin_);
    const std::uint64_t end = std::min(flat_offset_[pi] + params_[pi].numel, partition_begin_ + partition_numel_);
    slices.push_back(end - begin);
  }
  if (offload_) return offload_before_optimizer();  // See Note [ZeRO-Offload]
  if (zero_pad_ == kNone) zero_pad(slices);  // the boundary epilogue was skipped by the replay
  if (item == 2) {
    // DeepSpeed's bf16 mode checks for overflow first (bf16.check_grad_overflow, on by default):
    // has_overflow_partitioned_grads_serial adds has_inf_or_nan of every averaged gradient (the
    // padding's too) into a float count: isfinite of its amax and of its amin, and, not. Then the
    // count's .bool() and .byte(), gone when has_overflow returns.
    t_.at(Phase::kOptimizer, kNoLayer, "zero.check_overflow");
    const TensorId count = scalar(4);
    const std::size_t grads = slices.size() + (zero_pad_ != kNoPad ? 1 : 0);
    for (std::size_t g = 0; g < grads; ++g) {
      TensorId finite[2];
      for (TensorId& f : finite) {
        const TensorId extreme = scalar(item);  // amax, then amin
        f = isfinite_of(item);
        t_.release(extreme);
      }
      const TensorId both = scalar(1);
      t_.release(finite[0]);
      t_.release(finite[1]);
      const TensorId either = scalar(1);  // logical_not
      t_.release(both);
      t_.release(either);  // added into the count in place
    }
    const TensorId as_bool = scalar(1);
    t_.release(count);
    const TensorId as_byte = scalar(1);
    t_.release(as_bool);
    t_.release(as_byte);
  }
  t_.at(Phase::kOptimizer, kNoLayer, "zero.grad_norm");
  // get_grad_norm_direct: one float64 copy at a time, a 0-dim norm per slice.
  std::vector<TensorId> norms;
  for (std::uint64_t n : slices) {
    TensorId wide = t_.alloc_bytes(detail::mul(n, 8, "grad norm bytes"), Category::kTemporaries);
    norms.push_back(scalar(8));  // vector_norm
    t_.release(wide);
  }
  TensorId stacked = scalar(8 * norms.size());  // torch.stack(all_norms)
  TensorId pow = scalar(8 * norms.size());      // .pow(2)
  t_.release(stacked);
  TensorId sum = scalar(8);  // .sum()
  t_.release(pow);
  TensorId total = scalar(4);  // .float()
  t_.release(sum);
  TensorId root = scalar(4);  // total_norm.pow(1 / 2)
  t_.release(total);
  mask_invalid_norm();
  for (auto it = norms.rbegin(); it != norms.rend(); ++it) t_.release(*it);  // all_norms goes, last first
  // combine_grad_norm_groups (runtime/utils.py) over the one group's norm, in norm_groups until
  // scaled_global_norm returns.
  TensorId group = scalar(4);  // torch.stack
  TensorId invalid = invalid_norm(4);
  TensorId combined = scalar(4), inf = scalar(4);  // vector_norm, full_like(combined, inf)
  scaled_norm_ = scalar(4);                        // torch.where: step's scaled_global_grad_norm
  t_.release(inf);
  t_.release(group);
  t_.release(invalid);
  t_.release(combined);
  t_.release(root);
  // step(): is_invalid_grad_norm (a 32-bit model, or bf16 with check_grad_overflow).
  t_.release(invalid_norm(4));
  // self._global_grad_norm = scaled_global_grad_norm / prev_scale, kept until the next step's.
  TensorId norm = scalar(4);
  set_global_grad_norm(norm);

  t_.at(Phase::kOptimizer, kNoLayer, "zero.fp32_grad_partition");
  TRAINMEM_ASSERT(accumulated_ != kNone, "ZeRO step without gradients");
  TensorId flat = accumulated_;  // one slice: _flatten_dense_tensors returns a view
  const bool padded = zero_pad_ != kNone && zero_pad_ != kNoPad;
  if (slices.size() + (padded ? 1 : 0) > 1) {
    flat = t_.alloc_bytes(detail::mul(partition_numel_, item, "ZeRO flat gradient bytes"), Category::kGradients);
  } else {
    t_.retain(flat);
  }
  if (item != 4) {
    fp32_grad_ = t_.alloc_bytes(detail::mul(partition_numel_, 4, "ZeRO fp32 gradient bytes"), Category::kGradients);
    t_.release(flat);
  } else {
    fp32_grad_ = flat;  // .to(float32) of an fp32 tensor is the tensor
  }
  t_.release(accumulated_);  // free_grad_in_param_list, averaged_gradients = None
  accumulated_ = kNone;
  if (padded) t_.release(zero_pad_);
  zero_pad_ = kNone;
  t_.at(Phase::kOptimizer, kNoLayer, "zero.unscale_and_clip_grads");
  clip_factor(4, /*checks_norm=*/true);
}

// DeepSpeed's gradient clipping at its default (gradient_clipping 1.0) with the loss scale 1:
// unscale_and_clip_grads (stages 1/2 first check the norm: is_invalid_grad_norm) makes
// clip = ((norm / loss_scale) + 1e-6) / clip_grad, clamps it, multiplies it by the loss scale, and
// multiplies the fp32 gradient in place by 1. / that (a reciprocal, then 1.0 times it); its locals
// go when it returns. `bytes`: the norm's element size (fp32 in stages 1/2, float64 in stage 3).
void DataParallel::clip_factor(std::uint64_t bytes, bool checks_norm) {
  if (checks_norm) t_.release(invalid_norm(bytes));
  TensorId div = scalar(bytes), add = scalar(bytes);
  t_.release(div);
  TensorId div2 = scalar(bytes);
  t_.release(add);
  TensorId clamp = scalar(bytes);
  t_.release(div2);
  TensorId combined = scalar(bytes), reciprocal = scalar(bytes), inverse = scalar(bytes);
  t_.release(reciprocal);
  t_.release(inverse);
  t_.release(combined);
  t_.release(clamp);
}

// torch.isfinite of a 0-dim tensor of `bytes` per element: it decomposes into abs, !=, == and a
// product, whose temporaries go last first. Returns the product.
TensorId DataParallel::isfinite_of(std::uint64_t bytes) {
  TensorId abs = scalar(bytes), ne = scalar(1), eq = scalar(1), finite = scalar(1);
  t_.release(eq);
  t_.release(ne);
  t_.release(abs);
  return finite;
}

// (~torch.isfinite(x) | (x < 0)).any() of a 0-dim norm of `bytes` per element (runtime/utils.py
// is_invalid_grad_norm and combine_grad_norm_groups). Returns the .any().
TensorId DataParallel::invalid_norm(std::uint64_t bytes) {
  const TensorId finite = isfinite_of(bytes);
  TensorId inverted = scalar(1);
  t_.release(finite);
  TensorId negative = scalar(1), either = scalar(1);
  t_.release(inverted);
  t_.release(negative);
  TensorId any = scalar(1);
  t_.release(either);
  return any;
}

// mask_nan_or_inf_with_val_inplace (runtime/utils.py) on a norm: isinf, isnan, their logical_or
// and the -1.0 it fills in, all gone when it returns.
void DataParallel::mask_invalid_norm() {
  const TensorId inf = scalar(1), nan = scalar(1), either = scalar(1), err = scalar(4);
  for (TensorId id : {inf, nan, either, err}) t_.release(id);
}

void DataParallel::zero_after_optimizer() {
  if (zero3()) return zero3_gather_persistent();
  if (offload_) offload_after_optimizer();
  if (fp32_grad_ != kNone) t_.release(fp32_grad_);  // single_partition_of_fp32_groups[i].grad = None
  fp32_grad_ = kNone;
  if (scaled_norm_ != kNone) t_.release(scaled_norm_);  // a local of step(), gone when it returns
  scaled_norm_ = kNone;
  engine_takes_global_grad_norm();
}

// The optimizer's self._global_grad_norm = norm: the previous step's stays referenced by the
// DeepSpeedEngine until step() has returned (see the Note above).
void DataParallel::set_global_grad_norm(TensorId norm) {
  if (engine_norm_ != kNone) t_.release(engine_norm_);  // not reached: the engine took it last step
  engine_norm_ = grad_norm_;
  grad_norm_ = norm;
}

// _take_model_step: self._global_grad_norm = self.optimizer._global_grad_norm.
void DataParallel::engine_takes_global_grad_norm() {
  if (engine_norm_ != kNone) t_.release(engine_norm_);
  engine_norm_ = kNone;
}

}  // namespace trainmem::graph
