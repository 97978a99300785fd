// The optimizer step of the training step (step_builder.h): torch.optim's AdamW (foreach and
// fused), SGD, transformers' Adafactor and bitsandbytes' 8-bit AdamW, with GradScaler's unscale
// and the bf16-master copy, then zero_grad.
#include <algorithm>

#include "graph/step_builder.h"

namespace trainmem::graph::step {

// See Note [Parameter registration order] (below).
std::vector<std::uint32_t> layer_registration_order(const std::vector<ParameterGroup>& groups, std::size_t first,
                                                    std::size_t count, Family family) {
  auto rank = [&](const std::string& name) {
    if (family == Family::kGpt2) return 0;
    const std::string rest = name.substr(name.find(".N.") + 3);
    if (rest.starts_with("self_attn.")) return family == Family::kPhi3 && rest == "self_attn.o_proj.weight" ? 0 : 1;
    return rest.starts_with("mlp.") ? 2 : 3;
  };
  std::vector<std::uint32_t> within(count);
  for (std::uint32_t k = 0; k < count; ++k) within[k] = k;
  std::stable_sort(within.begin(), within.end(), [&](std::uint32_t x, std::uint32_t y) {
    return rank(groups[first + x].name) < rank(groups[first + y].name);
  });
  return within;
}

namespace {

// Note [Parameter registration order]
// The catalog lists a decoder layer's parameters in forward order (input norm, attention,
// post-attention norm, MLP), the order the engine creates them in. model.parameters(), which a
// loop over the parameters walks, is the modules' registration order instead: HF's Llama-style
// decoder layers (modeling_llama.py LlamaDecoderLayer.__init__, likewise Mistral, Qwen2, Qwen3,
// Gemma-2, Phi-3) register self_attn, then mlp, then their norms; Phi3Attention registers o_proj
// before qkv_proj; GPT2Block registers ln_1, attn, ln_2, mlp, the catalog's order. Where a loop
// allocates per parameter and frees the previous one's input (bf16-master's fp32 gradients), the
// order moves the peak: measured, cpu-pp2-llamaw512l4-bf16master-sgd-ga2-b1s64 peaks at the last
// layer's down_proj with its norms' half gradients still there. FSDP2's fsdp_params are the same
// order (step_parameters.cpp wrap_data_parallel): it orders a unit's copy-out and reduce-scatter
// copy-in, and foreach_reduce holds its last gradient, a norm's, to its end; the measured trace of
// cpu-fsdp-phi3w512l2-fp32-adamw-b1s256 gathers o_proj before qkv_proj. layer_registration_order
// is the one place that knows it.
std::vector<std::uint32_t> registration_order(const std::vector<ParameterGroup>& groups,
                                              std::uint64_t num_layers, Family family) {
  auto is_layer = [](const ParameterGroup& g) { return g.name.find(".N.") != std::string::npos; };
  std::vector<std::uint32_t> out;
  std::uint32_t idx = 0;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (!is_layer(groups[gi])) {
      out.push_back(idx++);
      continue;
    }
    std::size_t per_layer = 0;
    while (gi + per_layer < groups.size() && is_layer(groups[gi + per_layer])) ++per_layer;
    const std::vector<std::uint32_t> within = layer_registration_order(groups, gi, per_layer, family);
    for (std::uint64_t l = 0; l < num_layers; ++l) {
      for (std::uint32_t k : within) out.push_back(idx + static_cast<std::uint32_t>(l * per_layer) + k);
    }
    idx += static_cast<std::uint32_t>(num_layers * per_layer);
    gi += per_layer - 1;
  }
  return out;
}

}  // namespace

// bitsandbytes' two 256-entry fp32 quantization maps (signed and unsigned dynamic).
// optimizer.state holds them (qmap1, qmap2) only for a tensor with 8-bit states (4096 elements
// or more); when every trainable tensor is smaller (small LoRA adapters) they are temporaries
// that live as long as the optimizer.
void StepBuilder::bnb_quantization_maps() {
  bool eight_bit = false;
  for (const Param& p : params_) eight_bit = eight_bit || (p.trainable && p.numel >= 4096);
  const Category c = eight_bit ? Category::kOptimizerStates : Category::kTemporaries;
  states_.push_back(t_.alloc_bytes(256 * 4, c));
  states_.push_back(t_.alloc_bytes(256 * 4, c));
}

// The parameters in model.parameters() order. A LoRA model's adapters are made in their layer's
// registration order already (create_adapters), and its frozen base holds no gradient.
std::vector<std::uint32_t> StepBuilder::optimizer_order() const {
  if (r_.lora.enabled()) {
    std::vector<std::uint32_t> order(params_.size());
    for (std::uint32_t k = 0; k < order.size(); ++k) order[k] = k;
    return order;
  }
  std::vector<std::uint32_t> order = registration_order(m_.parameters, a_.num_layers, a_.family);
  TRAINMEM_ASSERT(order.size() == params_.size(), "the registration order misses parameters");
  return order;
}

void StepBuilder::optimizer_step(bool first) {
  phase_ = Phase::kOptimizer;
  layer_ = kNoLayer;
  if (pp_dps_.empty()) {
    dp_->before_optimizer();
  } else {  // several pipeline stages per rank: each stage's wrapper, in stage order
    for (DataParallel& d : pp_dps_) d.before_optimizer();
  }
  if (grad_norm_ != kNone) {  // the Trainer's `grad_norm = None` as the sync step begins
    t_.release(grad_norm_);
    grad_norm_ = kNone;
  }
  TensorId found_inf = kNone;
  if (r_.precision == Precision::kFp16Mixed) {
    // GradScaler.unscale_ (torch/amp/grad_scaler.py): inv_scale = scale.double().reciprocal()
    // .float(), found_inf = torch.full((), 0.0); _unscale_grads_ hands the unscale kernel each
    // one's copy for the device (_MultiDeviceReplicator.get: .to(copy=True), found_inf's first),
    // keeps found_inf's in optimizer_state (until update()) and drops inv_scale's; unscale_'s own
    // locals go when it returns. Gradients are unscaled in place. (Measured: step 2's optimizer
    // phase of the fp16-mixed GPT-2 entries, four 0-dim tensors at once.)
    op("grad_scaler.unscale_");
    TensorId dbl = t_.alloc_bytes(8, Category::kOther);
    TensorId reciprocal = t_.alloc_bytes(8, Category::kOther);
    t_.release(dbl);
    TensorId inv_scale = t_.alloc_bytes(4, Category::kOther);
    t_.release(reciprocal);
    TensorId master_found_inf = t_.alloc_bytes(4, Category::kOther);
    found_inf = t_.alloc_bytes(4, Category::kOther);
    TensorId inv_scale_copy = t_.alloc_bytes(4, Category::kOther);
    t_.release(inv_scale_copy);
    t_.release(inv_scale);
    t_.release(master_found_inf);
  }
  // Accelerate's clip_grad_norm_ unscales first (unscale_gradients), so scaler.step() does not again.
  const std::vector<std::uint32_t> order = optimizer_order();
  if (r_.clip_grad_norm) clip_grad_norm(order);
  // An optimizer that takes the scaling itself (fused AdamW: _step_supports_amp_scaling) is
  // handed optimizer.found_inf = sum(found_inf per device), a new 0-dim tensor that lives
  // through optimizer.step() (state creation included) and is deleted after it.
  TensorId found_inf_sum = kNone;
  if (r_.precision == Precision::kFp16Mixed && r_.optimizer == Optimizer::kAdamWFused) {
    found_inf_sum = t_.alloc_bytes(4, Category::kTemporaries);
  }
  // The parameters in model.parameters() order (See Note [Parameter registration order]): the
  // master gradients are made, the optimizer walks them (Adafactor's loop keeps one parameter's
  // temporaries into the next's: Note [Adafactor's loop variables]) and zero_grad frees them in it.
  if (pol_.master && !dp_->zero()) {
    // fp32 gradients for the master copy, parameter by parameter; the half .grad goes.
    op("optimizer.master_grads");
    for (std::uint32_t pi : order) {
      Param& p = params_[pi];
      TensorId g = t_.param_grad(p.slot);
      if (g == kNone) continue;
      TensorId g32 = t_.alloc_bytes(p.numel * 4, Category::kGradients);
      t_.release(g);
      t_.set_param_grad(p.slot, g32);
    }
  }
  // The optimizer holds the trainable parameters only (LoRA: the adapters, fp32); states are
  // zeros_like the parameter (fp32 masters for bf16-master).
  std::vector<const Param*> opt;
  for (std::uint32_t pi : order) {
    if (params_[pi].trainable) opt.push_back(&params_[pi]);
  }
  // ZeRO hands the torch optimizer this rank's fp32 master partition, one sub-group at a time
  // (ZeRO-1/2: one; ZeRO-3: sub_group_size elements each, Note [DeepSpeed ZeRO-3]).
  if (dp_->zero()) {
    const std::vector<std::uint64_t>& groups = dp_->zero_sub_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      Param partition;
      partition.numel = groups[g];
      partition.dtype = DType::kF32;
      dp_->zero_before_sub_group(g);
      step_parameters({&partition}, first);
      dp_->zero_after_sub_group(g);
    }
  } else {
    step_parameters(opt, first);
  }
  if (found_inf_sum != kNone) t_.release(found_inf_sum);
  dp_->zero_after_optimizer();
  if (pol_.master) {
    op("optimizer.copy_to_half");  // in place: p.copy_(master)
  }
  if (found_inf != kNone) t_.release(found_inf);  // GradScaler.update() drops its per-step state
  op("optimizer.zero_grad");
  for (std::uint32_t pi : order) {
    Param& p = params_[pi];
    TensorId g = t_.param_grad(p.slot);
    if (g != kNone) {
      t_.release(g);
      t_.set_param_grad(p.slot, kNone);
    }
  }
}

// Note [Gradient clipping]
// Hugging Face's Trainer calls accelerator.clip_grad_norm_(model.parameters(), max_grad_norm) at
// every optimizer step (transformers 5 also with max_grad_norm 0, as max_norm inf, to log the
// norm), and keeps the returned total norm in its loop's grad_norm until the next step sets it to
// None. Outside DeepSpeed and FSDP, Accelerate 1.16 unscales under fp16 (so the GradScaler's step
// does not again) and runs its _clip_grad_norm_dtensor_aware (accelerator.py) over torch's
// nn/utils/clip_grad.py pieces:
//  * get_total_norm of the gradients (those not None, in model.parameters() order, one group of
//    plain tensors): grouped by dtype, each group's _foreach_norm makes one 0-dim norm per
//    gradient. On CUDA, _foreach_tensor_norm_cuda_impl (ForeachReduceOp.cu) zeroes a buffer of
//    n x max_chunks_per_tensor fp32 partial sums (chunks of 65,536 elements; the largest
//    gradient's count) and a 320-float global buffer, then makes the n results and a global 0-dim;
//    as it returns the global buffer goes, then the partial sums, and the global 0-dim with the
//    pair it was returned in. On the CPU the slow path, linalg_vector_norm per gradient. Then
//    torch.stack of the norms (n elements), its vector_norm (the group's total), the stack freed,
//    and the norms list as the function returns (a list lets its items go last first).
//  * Accelerate stacks the groups' totals again (a 1-element stack, the old list and its total
//    going as the name is rebound) and takes the vector_norm of that: the total it returns.
//  * With a finite max_norm, torch's clip_grads_with_norm_: clip_coef = max_norm / (total + 1e-6),
//    where a float over a tensor is reciprocal() * max_norm; clamp(max=1.0); _foreach_mul_ in place;
//    the two coefficients go with its frame, in the order they were named. Accelerate's 1-element
//    stack goes with its own frame after that. (max_norm inf, the Trainer's max_grad_norm 0, skips
//    the clip: its four 0-dim coefficients are not made; the recipe models the clip.)
// The norms take the gradients' dtype (the accumulation is fp32 inside the kernels); a stack of
// several dtypes promotes them.
void StepBuilder::clip_grad_norm(const std::vector<std::uint32_t>& order) {
  op("clip_grad_norm_");
  std::vector<DType> dtypes;  // the groups, in order of first appearance
  std::vector<std::uint64_t> count, chunks;
  for (std::uint32_t pi : order) {
    const Param& p = params_[pi];
    if (t_.param_grad(p.slot) == kNone) continue;
    std::size_t g = 0;
    while (g < dtypes.size() && dtypes[g] != p.dtype) ++g;
    if (g == dtypes.size()) {
      dtypes.push_back(p.dtype);
      count.push_back(0);
      chunks.push_back(0);
    }
    ++count[g];
    chunks[g] = std::max(chunks[g], (p.numel + 65'535) / 65'536);
  }
  if (dtypes.empty()) return;  // no gradient: Accelerate's torch.zeros(1) on the host
  std::vector<TensorId> norms;
  for (std::size_t g = 0; g < dtypes.size(); ++g) {
    const std::uint64_t item = dtype_bytes(dtypes[g]);
    TensorId partial = kNone, global_partial = kNone;
    if (cuda_) {
      partial = t_.alloc_bytes(count[g] * chunks[g] * 4, Category::kTemporaries);
      global_partial = t_.alloc_bytes(320 * 4, Category::kTemporaries);
    }
    for (std::uint64_t i = 0; i < count[g]; ++i) norms.push_back(t_.alloc_bytes(item, Category::kTemporaries));
    if (cuda_) {
      const TensorId global = t_.alloc_bytes(item, Category::kTemporaries);
      t_.release(global_partial);
      t_.release(partial);
      t_.release(global);
    }
  }
  // torch.stack promotes: any fp32 gradient makes an fp32 stack, fp16 with bf16 too.
  const bool one_dtype = std::all_of(dtypes.begin(), dtypes.end(), [&](DType d) { return d == dtypes.front(); });
  const std::uint64_t item = one_dtype ? dtype_bytes(dtypes.front()) : 4;
  const TensorId stacked = t_.alloc_bytes(norms.size() * item, Category::kTemporaries);
  const TensorId group_total = t_.alloc_bytes(item, Category::kTemporaries);
  t_.release(stacked);
  for (auto it = norms.rbegin(); it != norms.rend(); ++it) t_.release(*it);
  const TensorId totals = t_.alloc_bytes(item, Category::kTemporaries);  // Accelerate's stack of one
  t_.release(group_total);
  const TensorId total = t_.alloc_bytes(item, Category::kTemporaries);
  const TensorId shifted = t_.alloc_bytes(item, Category::kTemporaries);  // total + 1e-6
  const TensorId reciprocal = t_.alloc_bytes(item, Category::kTemporaries);
  const TensorId coef = t_.alloc_bytes(item, Category::kTemporaries);
  t_.release(reciprocal);
  t_.release(shifted);
  const TensorId clamped = t_.alloc_bytes(item, Category::kTemporaries);
  t_.release(coef);
  t_.release(clamped);
  t_.release(totals);
  grad_norm_ = total;
}

// The torch optimizer's step over `opt` (its parameters, state made at the first step).
void StepBuilder::step_parameters(const std::vector<const Param*>& opt, bool first) {
  // zeros_like the parameter the optimizer holds: fp32 masters, or FSDP2's sharded parameter (fp32
  // under a param_dtype policy, See Note [FSDP2 variants]).
  auto sb_of = [&](const Param& p) {
    return dtype_bytes(pol_.master ? DType::kF32 : dp_of_slot(p.slot).local_dtype(p.slot, p.dtype));
  };
  // The elements this rank's optimizer holds of a parameter (FSDP2: its shard).
  auto numel_of = [&](const Param& p) { return dp_of_slot(p.slot).local_numel(p.slot, p.numel); };
  // A tensor of no elements has no storage (an FSDP2 rank past a parameter's last chunk).
  auto alloc_into = [&](std::vector<TensorId>& into, std::uint64_t bytes, Category category) {
    if (bytes != 0) into.push_back(t_.alloc_bytes(bytes, category));
  };
  auto state = [&](std::uint64_t bytes) { alloc_into(states_, bytes, Category::kOptimizerStates); };
  if (dp_->fsdp_offload()) {
    op("optimizer.cpu_step");  // the torch optimizer on the host: nothing on the GPU (Note [FSDP2 CPU offload])
  } else if (dp_->offload()) {
    op("optimizer.cpu_adam");  // DeepSpeedCPUAdam on the host: nothing on the GPU (Note [ZeRO-Offload])
  } else switch (r_.optimizer) {
    case Optimizer::kAdamW:
    case Optimizer::kAdamWFused: {
      if (first) {
        op("optimizer.init_state");
        // _init_group, parameter by parameter: `step` (on the device for fused, a CPU scalar
        // for foreach), then exp_avg and exp_avg_sq as zeros_like(param).
        // On a CPU run the foreach step counter lives on the measured device too.
        const bool step_on_device = r_.optimizer == Optimizer::kAdamWFused || !cuda_;
        for (const Param* p : opt) {
          if (step_on_device) states_.push_back(t_.alloc_bytes(4, Category::kOptimizerStates));
          state(numel_of(*p) * sb_of(*p));
          state(numel_of(*p) * sb_of(*p));
        }
      }
      if (r_.optimizer == Optimizer::kAdamW) {
        // foreach: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for the whole group, then
        // in-place ops; the list is freed at the end of the group's update. HF makes two
        // groups (weight decay / none); torch.optim with one group is the reference here.
        op("optimizer.foreach_sqrt");
        // With the step counters on the CPU, _foreach_add_(state_steps, torch.tensor(1.0,
        // device="cpu")) makes a CPU scalar first: on the measured device only on a CPU run.
        if (!cuda_) t_.release(t_.alloc_bytes(4, Category::kTemporaries));
        std::vector<TensorId> tmp;
        for (const Param* p : opt) {
          alloc_into(tmp, numel_of(*p) * sb_of(*p), Category::kTemporaries);
        }
        for (TensorId id : tmp) t_.release(id);
      } else {
        op("optimizer.fused_adamw");
      }
      break;
    }
    case Optimizer::kAdamW8bit: {
      if (first) {
        op("optimizer.init_state");
        if (cuda_) bnb_quantization_maps();  // moved to the device once
        for (const Param* p : opt) {
          if (p->numel < 4096) {  // bitsandbytes keeps small tensors' states in fp32
            states_.push_back(t_.alloc_bytes(p->numel * 4, Category::kOptimizerStates));
            states_.push_back(t_.alloc_bytes(p->numel * 4, Category::kOptimizerStates));
          } else {
            std::uint64_t blocks = (p->numel + 255) / 256;
            states_.push_back(t_.alloc_bytes(p->numel, Category::kOptimizerStates));
            states_.push_back(t_.alloc_bytes(p->numel, Category::kOptimizerStates));
            states_.push_back(t_.alloc_bytes(blocks * 4, Category::kOptimizerStates));
            states_.push_back(t_.alloc_bytes(blocks * 4, Category::kOptimizerStates));
          }
        }
      }
      op("optimizer.adamw_8bit");
      break;
    }
    case Optimizer::kSgd: {
      // momentum_buffer = clone(grad) at the first step; foreach in-place afterwards.
      op(first ? "optimizer.init_state" : "optimizer.sgd");
      if (first) {
        for (const Param* p : opt) state(numel_of(*p) * sb_of(*p));
      }
      break;
    }
    case Optimizer::kAdafactor: {
      // transformers.optimization.Adafactor, parameter by parameter (factored, no beta1).
      // State: row and column means of grad^2 for 2-D parameters, the full grad^2 average for
      // 1-D ones, in the dtype of the fp32 gradient copy; step and RMS are Python numbers.
      // Temporaries, all fp32 and parameter-sized (G): grad.float() and p.float() for half
      // parameters, grad**2 and grad**2 + eps, the factored approximation (or rsqrt of the
      // average), and -update for the final add.
      // Note [Adafactor's loop variables]
      // step()'s locals outlive their iteration: `grad`, `p_data_fp32` and `update` still hold
      // the previous parameter's fp32 copies and update until the next iteration rebinds them
      // (grad at its first line, p_data_fp32 before its .float(), update once grad**2 + eps is
      // made), and the last parameter's until step() returns, freed then in the order the frame
      // lists them (grad, p_data_fp32, update). So two parameters' temporaries overlap: measured
      // in cpu-qwen3w512l2-bf16mixed-loadbf16-adafactor-ckpt-b1s64, whose peak is the next
      // parameter's grad**2 + eps beside the last one's three.
      op(first ? "optimizer.adafactor_init" : "optimizer.adafactor");
      if (rms_.size() < opt.size()) rms_.assign(opt.size(), kNone);
      // _rms(x) = x.norm(2) / sqrt(numel): two 0-dim tensors, the norm freed.
      auto rms = [&]() {
        TensorId norm = t_.alloc_bytes(4, Category::kTemporaries);
        TensorId r = t_.alloc_bytes(4, Category::kTemporaries);
        t_.release(norm);
        return r;
      };
      auto drop = [&](TensorId& id) {
        if (id != kNone) t_.release(id);
        id = kNone;
      };
      TensorId grad32 = kNone, p32 = kNone, update = kNone;  // step()'s locals
      for (std::size_t pi = 0; pi < opt.size(); ++pi) {
        const Param& p = *opt[pi];
        const std::uint64_t g = p.numel * 4;
        const bool half = p.dtype != DType::kF32 && !pol_.master;
        const bool factored = p.rows != 0;
        const std::uint64_t cols = factored ? p.numel / p.rows : 0;
        drop(grad32);  // grad = p.grad
        if (half) grad32 = t_.alloc_bytes(g, Category::kTemporaries);
        if (first) {
          if (factored) {
            states_.push_back(t_.alloc_bytes(p.rows * 4, Category::kOptimizerStates));
            states_.push_back(t_.alloc_bytes(cols * 4, Category::kOptimizerStates));
          } else {
            states_.push_back(t_.alloc_bytes(g, Category::kOptimizerStates));
          }
        }
        drop(p32);  // p_data_fp32 = p
        if (half) p32 = t_.alloc_bytes(g, Category::kTemporaries);
        TensorId r = rms();  // state["RMS"] replaces last step's
        t_.set_category(r, Category::kOptimizerStates);
        if (rms_[pi] != kNone) t_.release(rms_[pi]);
        rms_[pi] = r;
        TensorId sq = t_.alloc_bytes(g, Category::kTemporaries);   // grad ** 2
        TensorId upd = t_.alloc_bytes(g, Category::kTemporaries);  // + eps
        t_.release(sq);
        drop(update);  // update = grad**2 + eps
        if (factored) {
          // Row and column means of the update, added into the state in place.
          t_.release(t_.alloc_bytes(p.rows * 4, Category::kTemporaries));
          t_.release(t_.alloc_bytes(cols * 4, Category::kTemporaries));
          // _approx_sq_grad: (row / row.mean()).rsqrt_() and col.rsqrt(), then their outer
          // product, the full-size update.
          TensorId mean = t_.alloc_bytes(4, Category::kTemporaries);
          TensorId rf = t_.alloc_bytes(p.rows * 4, Category::kTemporaries);
          t_.release(mean);
          TensorId cf = t_.alloc_bytes(cols * 4, Category::kTemporaries);
          update = t_.alloc_bytes(g, Category::kTemporaries);
          t_.release(rf);
          t_.release(cf);
        } else {
          update = t_.alloc_bytes(g, Category::kTemporaries);  // exp_avg_sq.rsqrt()
        }
        t_.release(upd);
        // update.div_((_rms(update) / clip_threshold).clamp_(min=1.0))
        TensorId ur = rms();
        TensorId clip = t_.alloc_bytes(4, Category::kTemporaries);
        t_.release(ur);
        t_.release(clip);
        TensorId neg = t_.alloc_bytes(g, Category::kTemporaries);  // p.add_(-update)
        t_.release(neg);
      }
      drop(grad32);
      drop(p32);
      drop(update);
      break;
    }
  }
}

}  // namespace trainmem::graph::step
