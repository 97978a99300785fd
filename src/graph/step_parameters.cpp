// The parameter table of the step builder (step_builder.h): the model's parameters as
// from_pretrained makes them (model::parameter_groups), the data-parallel wrapper around them,
// and peft's LoRA adapters (get_peft_model) with the names of their ops.
#include "graph/step_builder.h"

namespace trainmem::graph::step {

constexpr LoraLabels kLoraLabels[] = {
    {"self_attn.q_proj", "self_attn.q_proj.lora_A.default", "self_attn.q_proj.lora_B.default"},
    {"self_attn.k_proj", "self_attn.k_proj.lora_A.default", "self_attn.k_proj.lora_B.default"},
    {"self_attn.v_proj", "self_attn.v_proj.lora_A.default", "self_attn.v_proj.lora_B.default"},
    {"self_attn.o_proj", "self_attn.o_proj.lora_A.default", "self_attn.o_proj.lora_B.default"},
    {"self_attn.qkv_proj", "self_attn.qkv_proj.lora_A.default", "self_attn.qkv_proj.lora_B.default"},
    {"mlp.gate_proj", "mlp.gate_proj.lora_A.default", "mlp.gate_proj.lora_B.default"},
    {"mlp.up_proj", "mlp.up_proj.lora_A.default", "mlp.up_proj.lora_B.default"},
    {"mlp.down_proj", "mlp.down_proj.lora_A.default", "mlp.down_proj.lora_B.default"},
    {"mlp.gate_up_proj", "mlp.gate_up_proj.lora_A.default", "mlp.gate_up_proj.lora_B.default"},
    {"attn.c_attn", "attn.c_attn.lora_A.default", "attn.c_attn.lora_B.default"},
    {"attn.c_proj", "attn.c_proj.lora_A.default", "attn.c_proj.lora_B.default"},
    {"mlp.c_fc", "mlp.c_fc.lora_A.default", "mlp.c_fc.lora_B.default"},
    {"mlp.c_proj", "mlp.c_proj.lora_A.default", "mlp.c_proj.lora_B.default"},
};

const LoraLabels& lora_labels(std::string_view path) {
  for (const LoraLabels& l : kLoraLabels) {
    if (l.path == path) return l;
  }
  throw Error("lora_targets: '" + std::string(path) + "' is not a projection trainmem models");
}

void StepBuilder::create_parameters() {
  const std::uint64_t L = a_.num_layers;
  layers_.assign(L, LayerParams{});
  bool in_layers_done = false;
  const auto& groups = m_.parameters;
  auto is_layer = [](const ParameterGroup& g) { return g.name.find(".N.") != std::string::npos; };
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (!is_layer(groups[gi])) {
      // A pipeline stage holds only its own part of the model (See Note [Pipeline split]).
      globals_.push_back({groups[gi].name, add_param(groups[gi], false, pp_holds_global(groups[gi].name))});
      continue;
    }
    if (in_layers_done) continue;
    // HF creates layer 0's tensors, then layer 1's, ...
    std::size_t gend = gi;
    while (gend < groups.size() && is_layer(groups[gend])) ++gend;
    // The names match once, not once per layer (80 layers × a dozen suffix tests each were a
    // twentieth of the 70B model's graph stage).
    std::vector<std::uint32_t LayerParams::*> fields;
    for (std::size_t k = gi; k < gend; ++k) fields.push_back(layer_field(groups[k].name));
    for (std::uint64_t l = 0; l < L; ++l) {
      for (std::size_t k = gi; k < gend; ++k) {
        layers_[l].*fields[k - gi] = add_param(groups[k], /*in_layer=*/true, pp_holds_layer(l));
      }
    }
    in_layers_done = true;
  }
  // Rotary inv_freq and original_inv_freq buffers (fp32, head_dim/2 each).
  if (a_.family != Family::kGpt2) {
    t_.alloc_bytes(a_.head_dim / 2 * 4, Category::kWeights);
    t_.alloc_bytes(a_.head_dim / 2 * 4, Category::kWeights);
  }
  if (a_.embedding_scale) t_.alloc_bytes(dtype_bytes(pol_.param), Category::kWeights);
}

// DDP / FSDP2 wrap the built model (graph/parallel.h). FSDP2's units are the decoder layers
// (each layer's parameters, created layer by layer: create_parameters) and the root (the rest).
void StepBuilder::wrap_data_parallel() {
  if (r_.parallel == Parallel::kNone) return;
  std::vector<WrappedParam> wp;
  for (const Param& p : params_) {
    WrappedParam w{p.slot, p.storage, p.numel, p.rows, p.dtype};
    if (p.quantized && r_.quant.enabled()) {  // Params4bit: shape (packed elements, 1) of its storage dtype
      w.numel = w.rows = packed_4bit(p.numel, r_.quant.double_quant, p.dtype).packed_numel;
    }
    w.trainable = p.trainable;
    // See Note [FSDP2 variants] in parallel.cpp: under a param_dtype policy these are bf16 already.
    w.keeps_dtype = (p.quantized && r_.quant.enabled()) || (r_.half_model() && !p.trainable);
    wp.push_back(w);
  }
  std::vector<std::vector<std::uint32_t>> layers(a_.num_layers);
  std::vector<std::uint32_t> root;
  std::vector<std::string> root_names;
  std::vector<std::uint32_t> registration;  // module.parameters() order: the root's around the layers
  std::uint32_t idx = 0;
  bool in_layers_done = false;
  const auto& groups = m_.parameters;
  auto is_layer = [](const ParameterGroup& g) { return g.name.find(".N.") != std::string::npos; };
  // The SequenceParallel norms' weights get Partial gradients, and so do Qwen3's head norms' under
  // any tensor parallelism (See Note [Partial gradients under FSDP2]).
  auto partial = [&](const std::string& name) {
    if (r_.tp > 1 && (ends_with(name, ".q_norm.weight") || ends_with(name, ".k_norm.weight"))) return true;
    return r_.sequence_parallel && (ends_with(name, ".input_layernorm.weight") ||
                                    ends_with(name, ".post_attention_layernorm.weight") || name == "model.norm.weight");
  };
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (!is_layer(groups[gi])) {
      wp[idx].partial_grad = partial(groups[gi].name);
      root_names.push_back(groups[gi].name);
      registration.push_back(idx);
      root.push_back(idx++);
      continue;
    }
    if (in_layers_done) continue;
    std::size_t per_layer = 0;
    while (gi + per_layer < groups.size() && is_layer(groups[gi + per_layer])) ++per_layer;
    // FSDP2's fsdp_params follow module.parameters(), the order the decoder layer registers its
    // modules (See Note [Parameter registration order]): GPT-2's listed order; the Llama-like
    // layers self_attn (Phi-3: o_proj before qkv_proj), mlp, then the norms. It decides which
    // gradient foreach_reduce holds to its end (See Note [FSDP2 units]); measured on
    // cpu-tp2dp2sp-*, and for Phi-3 on cpu-fsdp-phi3w512l2-*.
    const std::vector<std::uint32_t> order = layer_registration_order(groups, gi, per_layer, a_.family);
    // A lora.Linear registers base_layer, then lora_A and lora_B (See Note [LoRA under FSDP2]):
    // each projection's adapters follow its weight and bias in the unit.
    std::vector<std::string_view> module_of(per_layer);
    for (std::size_t k = 0; k < per_layer; ++k) {
      const std::string_view name = groups[gi + k].name;
      const std::size_t begin = name.find(".N.") + 3;
      module_of[k] = name.substr(begin, name.rfind('.') - begin);
    }
    for (std::size_t l = 0; l < layers.size(); ++l) {
      for (std::size_t j = 0; j < order.size(); ++j) {
        const std::size_t k = order[j];
        wp[idx + k].partial_grad = partial(groups[gi + k].name);
        layers[l].push_back(static_cast<std::uint32_t>(idx + k));
        if (adapters_.empty() || (j + 1 < order.size() && module_of[order[j + 1]] == module_of[k])) continue;
        for (const Adapter& ad : adapters_[l]) {
          if (ad.path == module_of[k]) layers[l].insert(layers[l].end(), {ad.a, ad.b});
        }
      }
      registration.insert(registration.end(), layers[l].begin(), layers[l].end());
      idx += static_cast<std::uint32_t>(per_layer);
    }
    in_layers_done = true;
  }
  // LoRA's adapters follow the model's parameters in the table (create_adapters).
  std::size_t adapter_params = 0;
  for (const auto& layer : adapters_) adapter_params += 2 * layer.size();
  TRAINMEM_ASSERT(idx + adapter_params == params_.size(), "FSDP units miss parameters");
  // The module's buffers (create_parameters): rotary inv_freq and original_inv_freq, Gemma-2's
  // embedding scale.
  std::vector<std::pair<DType, std::uint64_t>> buffers;
  if (a_.family != Family::kGpt2) buffers.assign(2, {DType::kF32, a_.head_dim / 2 * 4});
  if (a_.embedding_scale) buffers.emplace_back(pol_.param, dtype_bytes(pol_.param));
  if (r_.pp_stages_per_rank > 1) {
    wrap_pipeline_stages(wp, layers, root, root_names);
  } else {
    dp_->wrap(wp, layers, root, buffers, registration);
  }
  // Under LoRA the frozen embedding's output requires grad only where checkpointing made
  // transformers call enable_input_require_grads (See Note [LoRA]).
  dp_->set_first_layer_hooked(!r_.lora.enabled() || r_.checkpointing != Checkpointing::kNone);
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].storage = wp[i].storage;
  t_.on_param_ready = [this](std::uint32_t slot) { dp_->param_ready(slot); };
  t_.on_layer_change = [this](std::int32_t from, std::int32_t to) { dp_->layer_change(from, to); };
  t_.on_final_callbacks = [this] { dp_->final_callback(); };
  // ZeRO-3's module hooks; under a pipeline, FSDP2's root hooks on the stage module (See Note
  // [Pipeline with FSDP2] in pipeline.cpp).
  if (dp_->zero3()) {
    t_.on_module_backward = [this](std::uint32_t m, bool begin) { dp_->module_backward(m, begin); };
    t_.route_after_module_ends = true;
  }
  if (r_.pp > 1 && r_.parallel == Parallel::kFsdp) {
    t_.on_module_backward = [this](std::uint32_t, bool begin) {
      if (begin) dp_->root_pre_backward();
    };
  }
}

// Several pipeline stages per rank: each local stage module has a wrapper of its own, made in
// stage order over the stage's parameters only (its decoder layers, and the embedding, the final
// norm and lm_head where it holds them); no buffers, which the stage modules do not register
// (python/trainmem/measure/pipeline.py _VirtualStageModule). See Notes [Interleaved pipeline
// schedules with DDP] and [Interleaved pipeline schedules with FSDP2] in pipeline.cpp.
void StepBuilder::wrap_pipeline_stages(std::vector<WrappedParam>& wp, const std::vector<std::vector<std::uint32_t>>& layers,
                                       const std::vector<std::uint32_t>& root,
                                       const std::vector<std::string>& root_names) {
  const std::uint64_t stages = pp_num_stages();
  for (std::uint64_t v = 0; v < r_.pp_stages_per_rank; ++v) {
    const std::uint64_t s = rank_ + v * r_.pp;
    const StageLayers held = pipeline_stage_layers(a_.num_layers, stages, s);
    std::vector<WrappedParam> sub;
    std::vector<std::uint32_t> global;  // sub's index -> wp's
    auto take = [&](std::uint32_t i) {
      global.push_back(i);
      sub.push_back(wp[i]);
      return static_cast<std::uint32_t>(sub.size() - 1);
    };
    std::vector<std::vector<std::uint32_t>> sub_layers(layers.size());
    for (std::uint64_t l = held.begin; l < held.end; ++l) {
      for (std::uint32_t i : layers[l]) sub_layers[l].push_back(take(i));
    }
    std::vector<std::uint32_t> sub_root;
    for (std::size_t k = 0; k < root.size(); ++k) {
      const bool embedding = ends_with(root_names[k], "embed_tokens.weight");
      if (embedding ? s == 0 : s + 1 == stages) sub_root.push_back(take(root[k]));
    }
    pp_dps_.emplace_back(t_, r_, r_.gpu != "cpu", stage_dp_rank_);
    pp_dps_.back().wrap(sub, sub_layers, sub_root, {});
    for (std::size_t j = 0; j < sub.size(); ++j) wp[global[j]].storage = sub[j].storage;
  }
}

DataParallel& StepBuilder::dp_of_slot(std::uint32_t slot) {
  for (DataParallel& d : pp_dps_) {
    if (d.holds(slot)) return d;
  }
  return dp_rank_;
}

std::uint32_t StepBuilder::add_param(const ParameterGroup& g, bool in_layer, bool present) {
  Param p;
  p.numel = g.numel;
  p.dtype = pol_.param;
  p.trainable = !r_.lora.enabled();  // get_peft_model freezes the whole base model
  if (!present) {  // another pipeline stage's: no memory here, no gradient, not in the optimizer
    p.trainable = false;
    p.slot = t_.new_param(kNone);
    params_.push_back(p);
    return static_cast<std::uint32_t>(params_.size() - 1);
  }
  p.quantized = r_.quant.any() && in_layer && g.matmul_weight;
  if (p.quantized && r_.quant.load_in_8bit) {
    // Int8Params: CB, the parameter's data, and SCB (See Note [LLM.int8]); neither requires grad.
    // SCB has one scale per output row; GPT-2's Conv1D stores (in, out) and is transposed first
    // (See Note [Quantized linear biases]).
    const Int8Weight q = int8_weight(g.numel, a_.family == Family::kGpt2 ? g.numel / g.rows : g.rows);
    p.dtype = DType::kI8;
    p.storage = t_.alloc_bytes(q.cb_bytes, Category::kWeights);
    t_.alloc_bytes(q.scb_bytes, Category::kWeights);
  } else if (p.quantized) {
    // Params4bit and its QuantState's tensors (Note [QLoRA]); none requires grad.
    // Under FSDP2 only the packed weight's shard reaches the device; its QuantState, which is no
    // parameter, stays whole on every rank (See Note [QLoRA under FSDP2] in parallel.cpp).
    // See Note [The packed weights' storage dtype].
    p.dtype = storage_dtype(r_.quant.storage);
    // quantize_4bit packs ceil(n / 2) bytes and views them as the storage dtype: bitsandbytes' CPU
    // path fails where they do not divide it, its CUDA one makes a buffer a byte short.
    const std::uint64_t packed_bytes = g.numel / 2 + g.numel % 2;
    if (packed_bytes % dtype_bytes(p.dtype) != 0) {
      throw Error("bnb_4bit_quant_storage: " + std::string(dtype_name(p.dtype)) + " cannot hold " + g.name +
                  "'s " + std::to_string(packed_bytes) + " packed bytes (" + std::to_string(g.numel) +
                  " 4-bit values); use uint8");
    }
    const Packed4bit q = packed_4bit(g.numel, r_.quant.double_quant, p.dtype);
    p.storage = new_param_storage(q.packed_bytes);
    for (std::uint64_t b : {q.absmax_bytes, q.code_bytes, q.offset_bytes, q.nested_absmax_bytes, q.nested_code_bytes}) {
      if (b != 0) t_.alloc_bytes(b, Category::kWeights);
    }
  } else {
    const std::uint64_t bytes = detail::mul(g.numel, dtype_bytes(pol_.param), "parameter bytes");
    // ZeRO-1/2 makes the parameters views of one flat buffer (See Note [DeepSpeed ZeRO-1/2]);
    // under LoRA the frozen base is not flattened there: its parameters keep their storages.
    if (is_zero(r_.parallel) && r_.parallel != Parallel::kZero3 && !r_.lora.enabled()) {
      p.storage = t_.reserve(bytes, Category::kWeights);
    } else {
      p.storage = new_param_storage(bytes);
    }
  }
  p.slot = t_.new_param(p.storage);
  p.matmul = g.matmul_weight;
  p.rows = g.rows;
  params_.push_back(p);
  return static_cast<std::uint32_t>(params_.size() - 1);
}

// Note [LoRA]
// get_peft_model(model, LoraConfig) runs on the built model (peft 0.21: tuners/lora/model.py,
// layer.py, tuners_utils.py, peft_model.py):
//  * every base parameter gets requires_grad=False. A frozen parameter gets no .grad and no
//    optimizer state, and autograd only records what the trainable parts need: an op whose
//    inputs all do not require grad records no node (the embedding, layer 0's first norm and
//    every projection before the first adapter save nothing); mm/addmm save the input only
//    for the weight's gradient and the weight only for the input's, mul saves each factor
//    only for the other's gradient, a product with a Python scalar saves nothing. Fused
//    attention kernels still compute (and drop) the gradient of an input that does not
//    require grad; the fused loss makes no grad_w for a frozen lm_head;
//  * each targeted projection (named_modules order: layer by layer, the layer's modules as
//    registered) becomes lora.Linear: lora_A = nn.Linear(in, r) and lora_B = nn.Linear(r, out),
//    no bias, made on the CPU and moved with .to(device, dtype) of the base weight, A then B.
//    With autocast_adapter_dtype (the default) cast_adapter_dtype then replaces every bf16 or
//    fp16 adapter parameter by an fp32 copy, module by module: the adapters are always fp32;
//  * lora.Linear.forward: result = base_layer(x); x = x.to(lora_A.weight.dtype) if it differs
//    (kept until the forward returns); result = result + lora_B(lora_A(dropout(x))) * scaling
//    (dropout 0 is nn.Identity); result.to(the base result's dtype);
//  * under autocast a weight's half cast is cached only for leaves that require grad
//    (autocast_mode.cpp cached_cast): the adapters' casts live until autocast exits, while a
//    frozen base weight is cast at every use and the cast lives as long as the op, or the
//    backward node that saved it, holds it. Both are casts of parameters: weights, saved or
//    not (the tracker's Note [Categories]);
//  * activation checkpointing makes transformers call enable_input_require_grads
//    (modeling_utils.py _activation_checkpointing_enable, main_input_name "input_ids"): a
//    forward hook marks the input embedding module's output (Gemma-2's is already scaled)
//    requires_grad. It is then a leaf, so everything after it records nodes as in full
//    fine-tuning, and its AccumulateGrad node keeps it (and later its .grad) alive until the
//    graph is freed after backward.
// Note [A half model under autocast]
// The usual LoRA script without a 4-bit base: from_pretrained(dtype=torch.bfloat16),
// get_peft_model, a Trainer with bf16=True (load_dtype bf16 under bf16-mixed; fp16 the same
// under fp16-mixed). The frozen model is bf16, the adapters fp32 (autocast_adapter_dtype, Note
// [LoRA]), and the whole step runs under bf16 autocast. So the policy is bf16-true's parameters
// under bf16-mixed's autocast (StepBuilder's pol_), and:
//  * autocast's cached_cast copies only a tensor of another dtype: the frozen bf16 weights go
//    to the matmuls as they are (no per-use copy, unlike an fp32 model's), the adapters' fp32
//    weights get the cached bf16 casts of any trainable leaf (StepBuilder::weight);
//  * lora.Linear still casts x to lora_A's fp32 (_cast_input_dtype does not look at autocast) and
//    keeps the copy to the end of its forward; lora_A's matmul casts it back to bf16;
//  * the embedding's output, the residual stream, the norms (which upcast inside) and the loss
//    (logits.float()) are bf16-true's. Autocast's fp32 ops (CUDA's softmax, layer_norm...) cast
//    their half inputs up as under bf16-mixed.
// Against bf16-mixed over an fp32 model the frozen weights are half and never copied; against
// bf16-true the adapters' matmuls run in bf16. Measured: data/ground_truth/cpu-*-lora*-loadbf16-*,
// *-loadfp16-*, parallel/cpu-[df]*-lora8-*-loadbf16-* (one process, DDP, FSDP2).
//
// Note [Autocast over an FSDP2 policy]
// Accelerate's FSDP2 with mixed precision bf16 (the Trainer's bf16=True under fsdp) sets
// MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) on fp32 shards (fsdp2_prepare_model
// upcasts what is trainable) and still wraps the forward in autocast. The all-gathered parameters
// are bf16 already, so autocast caches no copy of them: the compute is the policy's (bf16-true's,
// as precision fp32 with fsdp_param_dtype bf16) and autocast adds only what its fp32 ops do (their
// half inputs cast up, GPT-2's LayerNorm among them). Recipe: bf16-mixed with fsdp_param_dtype bf16
// (and fsdp_reduce_dtype bf16, Accelerate's), the policy StepBuilder's pol_ gets. Measured:
// parallel/cpu-fsdp-*-bf16mixed-*-bf16params-bf16reduce-* (Llama, GPT-2, Qwen3 checkpointed, a LoRA
// model loaded in fp32). Over a half-loaded LoRA model (Note [A half model under autocast]) the
// frozen shards stay bf16 and only the fp32 adapters are cast for the all-gather (Note [FSDP2
// variants] in parallel.cpp): measured on Llama and on Qwen3 all-linear checkpointed; before the
// wrapper knew it, it predicted 63,443,968 B for the Llama run's 46,686,720 B. A half model
// trained whole is refused under the policy (Accelerate casts it to fp32 first: trainmem.hf maps it
// to an fp32-loaded model).
//
// Note [A half model trained whole]
// The same load without adapters: from_pretrained(dtype=torch.bfloat16) and a Trainer with
// bf16=True, every parameter trained. It is bf16-true's step (bf16 weights, gradients and
// optimizer states, zeros_like of the parameters) under bf16 autocast, which changes only what
// autocast's fp32 ops do: their half inputs are cast up and their outputs are fp32 (GPT-2's
// LayerNorm under CUDA's autocast, whose fp32 output the next matmul casts back and saves).
// Nothing is cast per use, as no weight is fp32. Only bf16: under fp16=True the GradScaler's
// unscale_ refuses fp16 gradients, so an fp16 model trained whole is refused; and under
// Accelerate's FSDP2 the trainable parameters are cast to fp32 before sharding (fsdp2_prepare_model),
// which is bf16-mixed over an fp32 model (trainmem.hf maps it so); parallel fsdp with load_dtype bf16
// is fully_shard over the bf16 model itself. Measured: data/ground_truth/cpu-*-bf16mixed-loadbf16-*
// without lora (one process, DDP, FSDP2, a pipeline).
void StepBuilder::create_adapters() {
  if (!r_.lora.enabled()) return;
  // Nothing would require grad, and backward() would fail as loss.backward() does.
  if (r_.lora.targets.empty()) throw Error("lora_targets: no module to wrap (resolve the targets first)");
  t_.at(Phase::kSetup, kNoLayer, "lora.adapters");
  // The layer's modules in registration order (Phi-3 registers o_proj before qkv_proj).
  std::vector<std::string> targets = r_.lora.targets;
  auto rank_of = [&](const std::string& p) {
    if (a_.family == Family::kPhi3 && p == "self_attn.o_proj") return -1;
    const auto& t = r_.lora.targets;
    return static_cast<int>(std::find(t.begin(), t.end(), p) - t.begin());
  };
  std::stable_sort(targets.begin(), targets.end(),
                   [&](const std::string& x, const std::string& y) { return rank_of(x) < rank_of(y); });
  const std::uint64_t r = r_.lora.rank;
  adapters_.assign(a_.num_layers, {});
  for (std::uint64_t l = 0; l < a_.num_layers; ++l) {
    for (const std::string& path : targets) {
      Adapter ad;
      ad.path = lora_labels(path).path;
      std::tie(ad.in, ad.out) = projection_shape(path);
      ad.a = add_adapter_param(detail::mul(r, ad.in, "lora_A size"), r);
      ad.b = add_adapter_param(detail::mul(ad.out, r, "lora_B size"), ad.out);
      adapters_[l].push_back(ad);
    }
  }
  // DeepSpeed's bf16 mode casts every parameter to bf16 again (_cast_module_mixed_precision in
  // deepspeed.initialize), so under ZeRO the adapters end in the model's half dtype. Under an
  // FSDP2 param_dtype policy the model is fp32 (pol_ is the policy's compute), so peft's adapters
  // are fp32 already and FSDP2 casts them with the rest (See Note [LoRA under FSDP2]).
  const bool fsdp_cast = r_.parallel == Parallel::kFsdp && r_.fsdp.param_dtype != FsdpDtype::kNone;
  if (pol_.param != DType::kF32 && !is_zero(r_.parallel) && !fsdp_cast) {
    t_.at(Phase::kSetup, kNoLayer, "lora.cast_adapter_dtype");
    for (auto& layer : adapters_) {
      for (const Adapter& ad : layer) {
        for (std::uint32_t pi : {ad.a, ad.b}) {
          Param& p = params_[pi];
          p.dtype = DType::kF32;
          if (r_.parallel == Parallel::kFsdp) continue;  // no memory until fully_shard makes its shard
          TensorId f32 = t_.alloc_bytes(p.numel * 4, Category::kWeights);
          t_.release(p.storage);
          p.storage = f32;
        }
      }
    }
  }
}

// A parameter's storage as the model is built: under FSDP2 and ZeRO-3 without memory, since only
// its shard or partition ever reaches the device (See Notes [FSDP2 units] and [DeepSpeed ZeRO-3]).
TensorId StepBuilder::new_param_storage(std::uint64_t bytes) {
  const bool sharded = r_.parallel == Parallel::kFsdp || r_.parallel == Parallel::kZero3;
  return sharded ? t_.reserve(bytes, Category::kWeights) : t_.alloc_bytes(bytes, Category::kWeights);
}

std::uint32_t StepBuilder::add_adapter_param(std::uint64_t numel, std::uint64_t rows) {
  Param p;
  p.numel = numel;
  p.dtype = pol_.param;
  p.storage = new_param_storage(detail::mul(numel, dtype_bytes(p.dtype), "adapter bytes"));
  p.adapter = true;
  p.slot = t_.new_param(p.storage);
  p.matmul = true;
  p.rows = rows;
  params_.push_back(p);
  return static_cast<std::uint32_t>(params_.size() - 1);
}

// (in_features, out_features) of a projection of the decoder layer.
std::pair<std::uint64_t, std::uint64_t> StepBuilder::projection_shape(std::string_view path) const {
  const std::uint64_t h = a_.hidden_size, i = a_.intermediate_size;
  const std::uint64_t qw = a_.num_heads * a_.head_dim, kvw = a_.num_kv_heads * a_.head_dim;
  if (path == "self_attn.q_proj") return {h, qw};
  if (path == "self_attn.k_proj" || path == "self_attn.v_proj") return {h, kvw};
  if (path == "self_attn.o_proj") return {qw, h};
  if (path == "self_attn.qkv_proj") return {h, qw + 2 * kvw};
  if (path == "mlp.gate_proj" || path == "mlp.up_proj" || path == "mlp.c_fc") return {h, i};
  if (path == "mlp.gate_up_proj") return {h, 2 * i};
  if (path == "mlp.down_proj" || path == "mlp.c_proj") return {i, h};
  if (path == "attn.c_attn") return {h, qw + 2 * kvw};
  if (path == "attn.c_proj") return {qw, h};
  TRAINMEM_ASSERT(false, "unknown projection");
  return {0, 0};
}

bool StepBuilder::ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::uint32_t LayerParams::*StepBuilder::layer_field(const std::string& n) {
  struct Binding {
    std::string_view suffix;
    std::uint32_t LayerParams::*field;
  };
  static constexpr Binding kBindings[] = {
      {".input_layernorm.weight", &LayerParams::in_norm},
      {".ln_1.weight", &LayerParams::in_norm},
      {".ln_1.bias", &LayerParams::in_norm_b},
      {".qkv_proj.weight", &LayerParams::qkv},
      {".qkv_proj.bias", &LayerParams::qkv_b},
      {".c_attn.weight", &LayerParams::qkv},
      {".c_attn.bias", &LayerParams::qkv_b},
      {".q_proj.weight", &LayerParams::q},
      {".q_proj.bias", &LayerParams::q_b},
      {".k_proj.weight", &LayerParams::k},
      {".k_proj.bias", &LayerParams::k_b},
      {".v_proj.weight", &LayerParams::v},
      {".v_proj.bias", &LayerParams::v_b},
      {".o_proj.weight", &LayerParams::o},
      {".o_proj.bias", &LayerParams::o_b},
      {".attn.c_proj.weight", &LayerParams::o},
      {".attn.c_proj.bias", &LayerParams::o_b},
      {".q_norm.weight", &LayerParams::q_norm},
      {".k_norm.weight", &LayerParams::k_norm},
      {".post_attention_layernorm.weight", &LayerParams::post_attn_norm},
      {".ln_2.weight", &LayerParams::post_attn_norm},
      {".ln_2.bias", &LayerParams::post_attn_norm_b},
      {".pre_feedforward_layernorm.weight", &LayerParams::pre_ff_norm},
      {".post_feedforward_layernorm.weight", &LayerParams::post_ff_norm},
      {".gate_up_proj.weight", &LayerParams::gate_up},
      {".gate_proj.weight", &LayerParams::gate},
      {".gate_proj.bias", &LayerParams::gate_b},
      {".up_proj.weight", &LayerParams::up},
      {".up_proj.bias", &LayerParams::up_b},
      {".c_fc.weight", &LayerParams::up},
      {".c_fc.bias", &LayerParams::up_b},
      {".down_proj.weight", &LayerParams::down},
      {".down_proj.bias", &LayerParams::down_b},
      {".mlp.c_proj.weight", &LayerParams::down},
      {".mlp.c_proj.bias", &LayerParams::down_b},
  };
  for (const auto& b : kBindings) {
    if (ends_with(n, b.suffix)) return b.field;
  }
  TRAINMEM_ASSERT(false, "unbound layer parameter");
  return nullptr;
}

std::uint32_t StepBuilder::global(std::string_view suffix) const {
  for (const auto& [name, idx] : globals_) {
    if (ends_with(name, suffix)) return idx;
  }
  return kNone;
}

}  // namespace trainmem::graph::step
