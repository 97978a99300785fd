// The training step of docs/schema.md ("The reference step"), op by op.
//
// Each builder mirrors a Hugging Face module of transformers 5.x (modeling_llama.py and its
// Mistral/Qwen2/Qwen3/Gemma-2/Phi-3 siblings, modeling_gpt2.py, loss_utils.py) and the PyTorch
// kernels it calls. MEMORY_MECHANICS.md in shared/design lists the saved tensors these builders
// reproduce; tests/cpp/test_graph.cpp checks them against its closed forms.
//
// This file: the builder's constructor, the step (micro-batches, then the optimizer), the
// forward of the CausalLM with its loss, loss scaling and backward, and build_training_trace.
// The class: step_builder.h; the parameters, modules, optimizer and generation: the other
// step_*.cpp, optimizer.cpp and generation.cpp files.
#include "graph/step_builder.h"
#include "graph/context_parallel.h"
#include "graph/tensor_parallel.h"

namespace trainmem::graph::step {

StepBuilder::StepBuilder(const Model& m, const Recipe& r, const Gpu& gpu, const MicroBatchHook& hook,
                         std::uint64_t rank)
    : m_(m),
      a_(m.arch),
      r_(r),
      gpu_(gpu),
      hook_(hook),
      // A 4-bit base runs in fp32 outside its matmuls, whose dtype is the precision's (Note [QLoRA]);
      // generation keeps the precision's dtype everywhere (See Note [Quantized generation]).
      // FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes as bf16-true over fp32 shards
      // (See Note [FSDP2 variants]).
      // Under autocast (bf16-mixed) the fp32 model is autocast's as usual and the 4-bit matmuls
      // run in its dtype (bnb_4bit_compute_dtype).
      // DeepSpeed's bf16 mode (ZeRO-1/2, bf16-master) casts that fp32 rest back to bf16 (See
      // Note [QLoRA under ZeRO-1/2] in zero.cpp).
      // A half model under LoRA and its autocast: the half weights of *-true under *-mixed's
      // autocast (See Note [A half model under autocast] in step_parameters.cpp).
      // Autocast over FSDP2's bf16 policy: bf16-true's compute with autocast's fp32 ops (See Note
      // [Autocast over an FSDP2 policy] in step_parameters.cpp).
      pol_(r.half_model() || (r.fsdp.param_dtype == FsdpDtype::kBf16 && policy_for(r.precision).autocast)
               ? Policy{policy_for(r.precision).compute, policy_for(r.precision).compute, true, false}
               : policy_for(r.quant.enabled() && r.mode == Mode::kTraining && !policy_for(r.precision).autocast &&
                                    r.precision != Precision::kBf16Master
                                ? Precision::kFp32
                            : r.fsdp.param_dtype == FsdpDtype::kBf16 ? Precision::kBf16True
                                                                     : r.precision)),
      quant_dtype_(policy_for(r.precision).autocast ? policy_for(r.precision).compute : policy_for(r.precision).param),
      rank_(r.pp > 1 ? rank / r.gpus : rank),  // a pipeline's rank stage x gpus + dp rank: its stage
      stage_dp_rank_(r.pp > 1 ? rank % r.gpus : 0) {
  B_ = r.batch;
  S_ = r.seq / r.cp;  // a context-parallel rank's tokens (Note [Context parallelism])
  tok_ = detail::mul(B_, S_, "batch * seq");
  sp_ = r.sequence_parallel ? r.tp : 1;
  res_tok_ = tok_ / sp_;  // seq is a multiple of tp (recipe validation)
  // Every activation-sized product must fit in 64 bits with room for a few factors.
  detail::mul({tok_, std::max({a_.hidden_size, a_.intermediate_size * 2, a_.vocab_size}), 8},
              "tokens * width bytes");
  detail::mul({B_, a_.num_heads, S_, S_, 8}, "attention scores (batch * heads * seq^2) bytes");
  detail::mul({tok_, a_.num_heads, a_.head_dim, 8}, "tokens * heads * head_dim bytes");
  detail::mul({tok_, a_.num_heads + 2 * a_.num_kv_heads, a_.head_dim, 8}, "tokens * qkv width bytes");
  // Every layer of every micro-batch is simulated: bound the work, so the largest accepted
  // input finishes in seconds (Llama-3.1-70B with 1024 micro-batches is 81,920 layer passes).
  constexpr std::uint64_t kMaxLayerPasses = std::uint64_t{1} << 17;
  if (detail::mul(a_.num_layers, r.grad_accum, "layers * grad_accum") > kMaxLayerPasses) {
    throw Error("num_hidden_layers * grad_accum = " + std::to_string(a_.num_layers * r.grad_accum) +
                " layer passes per step is more than trainmem simulates (" +
                std::to_string(kMaxLayerPasses) + "); use a smaller grad_accum");
  }
  cuda_ = gpu.name != "cpu";
  gpu_sm_ = gpu.sm;
  attention_ = r.attention;
  // Gemma-2 runs eager attention (Note [Gemma-2's attention] in estimate.cpp, which resolves the
  // recipe before it gets here).
  if (a_.family == Family::kGemma2) attention_ = Attention::kEager;
  window_ = model::attention_windows(a_);
  // See Note [Layer stamp keys] (step_stamp.cpp): the recipes whose layers' forwards depend on
  // nothing but what the key holds.
  stamps_ = layer_stamping() && r.mode == Mode::kTraining && r.parallel == Parallel::kNone && r.tp == 1 &&
            r.cp == 1 && r.pp == 1 && !r.quant.any() && r.checkpointing == Checkpointing::kNone &&
            !r.use_cache;  // a training cache holds each layer's keys and values past the layer
  // See Note [Stamped layer backwards] (tape.h): without a data-parallel wrapper (stamps_ implies
  // Parallel::kNone) the backward hooks the tape calls do nothing.
  t_.stamp_backward = stamps_ && backward_stamping();
  t_.dtensor_params = r.tp > 1;  // See Note [Tied parameters of DTensors] (tape.cpp)
}

Trace StepBuilder::build() {
  if (r_.mode == Mode::kInference) return build_generation();
  t_.at(Phase::kSetup, kNoLayer, "model");
  create_parameters();
  create_adapters();
  wrap_data_parallel();
  if (pol_.master && !is_zero(r_.parallel)) {  // ZeRO keeps an fp32 partition instead (parallel.h)
    t_.at(Phase::kSetup, kNoLayer, "optimizer.master_copy");
    for (Param& p : params_) {
      if (p.trainable) p.master = t_.alloc_bytes(p.numel * 4, Category::kWeights);
    }
  }
  if (r_.pp > 1) return build_pipeline();  // one stage's step (Note [Pipeline parallelism])
  t_.at(Phase::kSetup, kNoLayer, "batch");
  // Under context parallelism the batch is whole (every rank holds the full sequences, and
  // position_ids beside them) until context_parallel shards it (See Note [Context parallelism]).
  input_ids_ = t_.make(tok_ * r_.cp, DType::kI64, Category::kOther);
  labels_ = t_.make(tok_ * r_.cp, DType::kI64, Category::kOther);
  if (r_.attention_mask != AttentionMask::kNone) padding_mask_ = t_.make(tok_, DType::kI64, Category::kOther);
  if (r_.cp > 1) cp_positions_ = t_.make(S_ * r_.cp, DType::kI64, Category::kOther);
  if (r_.optimizer == Optimizer::kAdamW8bit && !cuda_) {
    // On the CPU the maps bitsandbytes makes when the optimizer is built are already on the
    // parameters' device: they exist from the start.
    t_.at(Phase::kSetup, kNoLayer, "optimizer");
    bnb_quantization_maps();
  }
  for (std::uint32_t step = 1; step <= r_.steps; ++step) {
    t_.step = step;
    for (std::uint32_t micro = 1; micro <= r_.grad_accum; ++micro) {
      t_.micro = micro;
      dp_->begin_micro_batch(micro);
      std::vector<TensorId> cp_shards;  // what context_parallel's frame keeps (See Note [Context parallelism])
      if (r_.cp > 1) {
        t_.at(Phase::kForward, kNoLayer, "context_parallel");
        cp_shards = shard_buffers(t_, B_, S_ * r_.cp, r_.cp);
      }
      ValueId loss = forward_and_loss();
      backward(loss);
      for (TensorId id : cp_shards) t_.release(id);  // the context exits after backward
      t_.seal_categories();  // the replay reads the events so far now
      const MicroBatchNext next = hook_ ? hook_(t_.trace(), step, micro) : MicroBatchNext::kGoOn;
      if (next == MicroBatchNext::kStop) return finish_trace();  // the replay has its answer
      if (next == MicroBatchNext::kSkipRest && dp_->boundary_micro_batch_differs()) {
        // The boundary micro-batch does more than the repeated ones (Note [ZeRO-Offload], Note
        // [DDP no_sync]): on to it, whether or not others lie between.
        if (micro + 1 < r_.grad_accum) {
          micro = static_cast<std::uint32_t>(r_.grad_accum) - 1;
          dp_->skip_to_last_micro();
        }
        continue;
      }
      if (next == MicroBatchNext::kSkipRest) {
        // The rest of the step's micro-batches would repeat this one: on to the optimizer,
        // labelled with the last micro-batch.
        t_.micro = static_cast<std::uint32_t>(r_.grad_accum);
        break;
      }
    }
    optimizer_step(step == 1);
  }
  return finish_trace();
}

Trace StepBuilder::finish_trace() {
  Trace trace = t_.take();
  trace.host = dp_->host_memory();
  trace.trainable_parameters = m_.parameter_count;
  if (r_.lora.enabled()) {
    trace.trainable_parameters = 0;
    for (const Param& p : params_) {
      if (p.trainable) trace.trainable_parameters += p.numel;
    }
  }
  return trace;
}

// nn.Embedding over `n` ids: `n` rows of the weight. Its backward saves the ids;
// embedding_dense_backward makes a dense weight-sized gradient, and the CUDA kernel also sorts
// the indices (sorted ids, original positions, segment offsets: int64 each), the CPU one not.
T StepBuilder::embedding(std::uint32_t w, const T& ids, std::uint64_t n) {
  T out = fresh(n * a_.hidden_size, pol_.param);
  if (trainable(w)) {
    requires_grad(out);
    Node nd = node(out);
    nd.saved = {ids.id};
    nd.params.push_back(param_grad(w, pol_.param, cuda_ ? n * 8 * 3 : 0));
    t_.record(std::move(nd));
  }
  return out;
}

// Note [Training masks]
// A training forward (no cache; an attention_mask changes this: Note [Padding masks]) calls
// masking_utils once per mask kind the model builds (mask_kinds: Note [Generation masks]). Each
// call first checks the position ids,
// expanded to [b, s], for packed sequences (find_packed_sequence_indices: position_ids[:, :1] - 1,
// the diff with that prepended (a cat, then a sub), != 1, cumsum, the last column == 0, .all());
// all of it dies at once. Then the mask of Note [Generation masks] with q = kv = s:
//  * eager attention: the float [b, 1, s, s] of the hidden dtype;
//  * SDPA: none (is_causal) unless a sliding layer's window is reached (s >= window), where
//    the bool [1, 1, s, s] stays (expanded over the batch, a view);
//  * flash attention: none (the window is the kernel's argument).
// A layer uses its own kind's mask (causal or sliding, by window_), and a checkpoint's closure
// holds that one; the model's forward keeps every mask to its end. Under SDPA a mask changes
// the layer's attention: see attention_core. Measured on the CPU, the masks of every phase and
// layer: Gemma-2 (both kinds, eager), Phi-3 (sliding, SDPA, no GQA) and Mistral v0.1 (sliding,
// SDPA, GQA, under autocast), all narrowed, window 128 and seq 256; and so on tensor-parallel
// ranks and in pipeline stages, which build the same masks (Mistral v0.1, Phi-3, a Qwen2.5 with
// a full and a sliding layer).
//
// Note [Padding masks]
// With an attention_mask in the batch (Recipe::attention_mask: ones or padded; the measuring side
// makes it [b, s] int64 after input_ids and labels, and keeps it to the end of the run), each
// call skips the packed-sequence check and first turns the mask into a bool [b, s] copy, which
// dies when the call returns (after the mask is built). Then:
//  * SDPA, unless a sliding window is reached (where the skip is refused before looking at the
//    mask): fast_all(mask) (sum, then == numel: two 0-dim tensors). All ones: no mask, as
//    without one. Padding: fast_all again on mask[:, :s] (the prefill case, which fails too),
//    and the mask is built;
//  * eager attention (or a reached window): the mask is built, whatever the values.
// A built mask is and_masks(the kind's mask function, padding_mask_function) (attention_mask in
// generation.cpp): a [b, 1, s, s] bool that SDPA keeps (not an expanded view), or eager's float
// of that size as before. Under SDPA a mask makes the layer's attention the masked one (repeated
// K/V, the float copy of the mask: attention_core). Measured on the CPU with padding in the last
// row's second half: Llama (eager and SDPA, fp32 and bf16-mixed with checkpointing), GPT-2
// (eager and SDPA), Gemma-2 (eager, both kinds) and Mistral v0.1 (SDPA, window reached); a mask
// of ones under SDPA and eager.
void StepBuilder::training_masks(DType dtype) {
  masks_ = {};
  const bool eager = attention_ == Attention::kEager;
  const bool given = padding_mask_.id != kNone;
  for (MaskKind kind : mask_kinds()) {
    op(kind == MaskKind::kSliding ? "sliding_window_mask" : "causal_mask");
    const std::uint64_t W = kind == MaskKind::kSliding ? window_of_model() : 0;
    const bool window_reached = W > 0 && S_ >= W;
    bool build = eager || (attention_ == Attention::kSdpa && window_reached);
    T as_bool;
    if (given) {
      as_bool = fresh(B_ * S_, DType::kU8);
      if (attention_ == Attention::kSdpa && !window_reached) {
        fast_all();
        if (r_.attention_mask == AttentionMask::kPadded) {
          fast_all();
          build = true;
        }
      }
    } else {
      packed_sequence_check(B_, S_);
    }
    if (build) masks_[kind == MaskKind::kSliding ? 1 : 0] = attention_mask(kind, B_, S_, S_, eager, dtype, given);
    if (given) t_.drop(as_bool);
  }
}

// masking_utils.fast_all: mask.sum() == mask.numel(), read at once.
void StepBuilder::fast_all() {
  T sum = fresh(1, DType::kI64);
  T eq = fresh(1, DType::kU8);
  t_.drop(sum);
  t_.drop(eq);
}

void StepBuilder::packed_sequence_check(std::uint64_t rows, std::uint64_t cols) {
  T first = fresh(rows, DType::kI64);
  T prepended = fresh(detail::mul(rows, cols + 1, "position ids"), DType::kI64);
  T diff = fresh(rows * cols, DType::kI64);
  t_.drop(prepended);
  T ne = fresh(rows * cols, DType::kU8);
  T index = fresh(rows * cols, DType::kI64);
  t_.drop(ne);
  T last = fresh(rows, DType::kU8);
  T all = fresh(1, DType::kU8);
  t_.drop(last);
  t_.drop(all);
  t_.drop(first);
  t_.drop(diff);
  t_.drop(index);
}

void StepBuilder::drop_training_masks() {
  for (T& m : masks_) {
    if (m.id != kNone) t_.drop(m);
    m = T{};
  }
  mask_ = T{};
}

ValueId StepBuilder::forward_and_loss() {
  phase_ = Phase::kForward;
  layer_ = kNoLayer;
  if (dp_->zero3()) op("model");  // the model's forward pre-hooks run before its first op
  dp_->pre_forward();
  causal_lm_module_ = container_enter(Container::kCausalLM, false);
  if (r_.lora.enabled()) peft_tuner_module_ = container_enter(Container::kPeftTuner, false);
  base_model_module_ = container_enter(Container::kBaseModel, false);
  const bool gpt2 = a_.family == Family::kGpt2;
  op(gpt2 ? "wte" : "embed_tokens");
  std::uint32_t emb = global(gpt2 ? "wte.weight" : "embed_tokens.weight");
  const std::uint32_t emb_module = module_enter(emb, kNone, /*input_requires_grad=*/false);
  T hs = embedding(emb, input_ids_, tok_);
  if (a_.embedding_scale) {  // inside the module (Gemma2TextScaledWordEmbedding)
    T scaled = elementwise({&hs}, hs.numel, hs.dtype, {});
    t_.drop(hs);
    hs = scaled;
  }
  if (r_.use_cache && !cuda_) sliding_window_tensors();  // DynamicCache(config): Note [A cache in training]
  if (sp_ > 1) {  // PrepareModuleOutput's hook: this rank's sequence shard, a DTensor from here on
    T shard = seq_shard(hs);
    t_.drop(hs);
    hs = shard;
    dtensor_ = true;
  }
  if (!trainable(emb) && r_.checkpointing != Checkpointing::kNone) {
    // enable_input_require_grads' hook on the module's output (Note [LoRA]): a leaf that
    // requires grad, held by its AccumulateGrad node until the graph is freed.
    requires_grad(hs);
    input_leaf_ = t_.ref(hs);
    if (dp_->zero3()) {
      // ZeRO-3's forward hooks come after it: the output now requires grad, so the module gets
      // a pre-backward Function, whose backward fetches the embedding again at the end of the
      // backward (See Note [LoRA under ZeRO-3] in zero3.cpp).
      T out = t_.ref(hs);
      requires_grad(out);
      Node& n = open_node(out);
      n.inputs.push_back(pass_to(hs));
      t_.close_node();
      t_.drop(hs);
      hs = out;
    }
  }
  module_exit(emb_module);
  // The model's forward keeps `inputs_embeds` (GPT-2 also `position_embeds`) to its return.
  T inputs_embeds = t_.ref(hs);
  T position_embeds;
  if (gpt2) {
    op("wpe");
    std::uint32_t wpe = global("wpe.weight");
    // position_ids = arange(s) + past_seen_tokens: GPT2Model.forward keeps it and hands it to
    // every block as a keyword argument (a checkpoint's closure keeps it to that layer's
    // backward); the embedding's backward saves it too when wpe trains.
    T ar = fresh(S_, DType::kI64);
    position_ids_ = fresh(S_, DType::kI64);
    t_.drop(ar);
    const std::uint32_t wpe_module = module_enter(wpe, kNone, /*input_requires_grad=*/false);
    T pe = embedding(wpe, position_ids_, S_);
    module_exit(wpe_module);
    T sum = add(hs, pe);
    t_.drop(hs);
    position_embeds = pe;
    training_masks(sum.dtype);
    op("drop");
    hs = dropout_module(sum, a_.embd_dropout, Container::kEmbedDropout);
    t_.drop(sum);
  }
  if (!gpt2 && r_.cp > 1) {
    position_ids_ = t_.ref(cp_positions_);  // given: the model makes none (See Note [Context parallelism])
  } else if (!gpt2) {
    // position_ids = arange(s) + past_seen_tokens (kept by the model's forward).
    op("position_ids");
    T ar = fresh(S_, DType::kI64);
    position_ids_ = fresh(S_, DType::kI64);
    t_.drop(ar);
  }
  if (!gpt2) {
    training_masks(hs.dtype);
    rotary_embedding(hs.dtype);
  }
  for (std::uint32_t l = 0; l < a_.num_layers; ++l) {
    mask_ = layer_mask(l);
    dp_->layer_pre_forward(l);
    T next = r_.checkpointing != Checkpointing::kNone ? checkpointed_layer(hs, l) : layer_forward(hs, l);
    dp_->layer_post_forward(l);
    t_.drop(hs);
    hs = next;
  }
  layer_ = kNoLayer;
  T normed = gpt2 ? layer_norm(hs, global("ln_f.weight"), global("ln_f.bias"), tok_, "ln_f")
                  : rms_norm(hs, global("norm.weight"), res_tok_, "norm");
  module_exit(base_model_module_);
  base_model_module_ = kNone;
  t_.drop(hs);
  drop_training_masks();
  if (cos_.id != kNone) {
    t_.drop(cos_);
    t_.drop(sin_);
  }
  if (position_ids_.id != kNone) t_.drop(position_ids_);
  t_.drop(inputs_embeds);
  if (position_embeds.id != kNone) t_.drop(position_embeds);
  ValueId loss = r_.loss == Loss::kFused ? fused_loss(normed, emb)
                 : r_.loss_parallel        ? vocab_parallel_loss(normed, emb)
                                           : standard_loss(normed, emb);
  return loss;
}

// LlamaRotaryEmbedding: freqs = position_ids[..., None].float() * inv_freq;
// emb = cat(freqs, freqs); cos/sin = emb.cos()/sin() * attention_scaling, cast to x.dtype.
void StepBuilder::rotary_embedding(DType x_dtype) {
  op("rotary_emb");
  const std::uint32_t rotary = container_enter(Container::kRotary);
  const std::uint64_t d = a_.head_dim;
  T pf = fresh(S_, DType::kF32);
  T freqs = fresh(S_ * d / 2, DType::kF32);
  t_.drop(pf);
  T emb = fresh(S_ * d, DType::kF32);  // cat((freqs, freqs)); the locals live to the return
  auto trig = [&]() {  // emb.cos() * attention_scaling
    T raw = fresh(S_ * d, DType::kF32);
    T scaled = fresh(S_ * d, DType::kF32);
    t_.drop(raw);
    return scaled;
  };
  cos_ = trig();
  sin_ = trig();
  // return cos.to(x.dtype), sin.to(x.dtype); then the fp32 locals go.
  T cos32 = cos_, sin32 = sin_;
  cos_ = to(cos32, x_dtype);
  sin_ = to(sin32, x_dtype);
  for (T* local : {&freqs, &emb, &cos32, &sin32}) t_.drop(*local);
  module_exit(rotary);
}

std::uint32_t StepBuilder::lm_head_param(std::uint32_t emb) const {
  return a_.tie_word_embeddings ? emb : global("lm_head.weight");
}

// ForCausalLMLoss (loss_utils.py): logits.float(), labels padded by one and shifted, then
// cross_entropy = log_softmax (saves its output) + nll_loss.
ValueId StepBuilder::standard_loss(T& normed, std::uint32_t emb) {
  const std::uint64_t V = a_.vocab_size;
  op("lm_head");
  in_lm_head_ = true;
  // The norm's output is held by the CausalLM's forward (outputs.last_hidden_state and the
  // hidden_states local) until it returns, after the loss it computes from the labels: where
  // lm_head does not save it (autocast saves its bf16 cast; a frozen head saves nothing), it is a
  // temporary alive through the loss (measured: an untied 1,000-word Llama under bf16-mixed peaks
  // in the loss with it). Under sequence parallelism PrepareModuleInput all-gathers lm_head's
  // input, and the norm's output is this rank's shard.
  T gathered = sp_ > 1 ? seq_all_gather(normed, /*partial_grad=*/false) : T{};
  dtensor_ = false;
  T logits = linear(sp_ > 1 ? gathered : normed, lm_head_param(emb), kNone, V);
  in_lm_head_ = false;
  if (sp_ > 1) t_.drop(gathered);
  if (a_.final_logit_softcap > 0) {  // Gemma-2: logits / cap, tanh, * cap
    T d1 = elementwise({&logits}, logits.numel, logits.dtype, {});
    t_.drop(logits);
    T th = elementwise({&d1}, d1.numel, d1.dtype, {}, {}, /*save_output=*/true);
    t_.drop(d1);
    logits = elementwise({&th}, th.numel, th.dtype, {});
    t_.drop(th);
  }
  T loss = causal_lm_loss(logits);
  t_.drop(normed);
  if (r_.fp32_outputs && logits.dtype != DType::kF32) {
    // Note [Outputs converted to fp32]
    // Accelerate's prepare() (Hugging Face's Trainer) wraps the forward of a model trained under
    // its native mixed precision in convert_outputs_to_fp32 (accelerate/utils/operations.py): when
    // the forward returns, every half tensor of its output, the logits, is copied with .float()
    // into a new output object, and the old one goes with its half logits. The loss is fp32
    // already and kept. The copy is made outside autocast and nothing saves it; it lives as the
    // logits did, to the output object's end before backward. DDP wraps the converted forward,
    // so _DDPSink clones the fp32 logits. (Measured: cpu-*-fp32out-*.)
    op("convert_outputs_to_fp32");
    T up = fresh(logits.numel, DType::kF32);
    t_.drop(logits);
    logits = up;
  }
  if (r_.ddp_find_unused_parameters) ddp_sink(loss, logits);
  // The model output (logits) is dropped with the output object, before backward, and its
  // DynamicCache with it (Note [A cache in training]).
  t_.drop(logits);
  for (TensorId id : cache_) t_.release(id);
  cache_.clear();
  return scale_loss(loss);
}

// DDP's _DDPSink over the CausalLM's output (See Note [DDP find_unused_parameters] in
// parallel.cpp): the loss and the logits cloned, the originals given up for the clones. The loss'
// clone passes its gradient on.
void StepBuilder::ddp_sink(T& loss, T& logits) {
  T loss_clone = fresh(loss.numel, loss.dtype);
  requires_grad(loss_clone);
  Node& n = open_node(loss_clone);
  n.inputs.push_back(pass_to(loss));
  t_.close_node();
  T logits_clone = fresh(logits.numel, logits.dtype);
  t_.drop(loss);
  loss = loss_clone;
  t_.drop(logits);
  logits = logits_clone;
}

// ForCausalLMLoss on the logits (phase loss): the loss, which requires grad. `vocab_parallel`:
// vocab-sharded logits inside loss_parallel() (See Note [Loss parallel] in tensor_parallel.h).
T StepBuilder::causal_lm_loss(const T& logits, bool vocab_parallel) {
  phase_ = Phase::kLoss;
  op("loss");
  T up = to(logits, DType::kF32);
  // shift_labels = pad(labels, (0, 1))[..., 1:].contiguous() (transformers' ForCausalLMLoss): a
  // copy, except for one sequence, whose [1, s] slice is contiguous already and stays a view of
  // the padded labels (measured: cpu-fsdp-llamaw512l4-fp32-adamw-sgo-b1s256 peaks here). The
  // padded labels are ForCausalLMLoss's `labels`, a local until it returns, freed after the
  // logits' fp32 copy (measured, the loss phases of every batch-2 trace).
  T padded;
  T shifted;
  if (r_.cp > 1) {  // shift_labels given: no pad and no copy (See Note [Context parallelism])
    shifted = t_.ref(labels_);
  } else if (B_ == 1) {
    padded = fresh(tok_ + B_, DType::kI64);
    shifted = padded;
    shifted.numel = tok_;
  } else {
    padded = fresh(tok_ + B_, DType::kI64);
    shifted = fresh(tok_, DType::kI64);
  }
  T logp = vocab_parallel ? vocab_parallel_log_softmax(up) : fresh(logits.numel, DType::kF32);
  requires_grad(logp);
  {
    Node nd = node(logp);
    nd.saved = {logp.id};
    // loss_parallel's _log_softmax_backward_data hands its incoming gradient on: the fused
    // nll_loss backward computed both.
    nd.inputs.push_back(vocab_parallel ? pass_to(up) : grad_of(up));
    t_.record(std::move(nd));
  }
  // cross_entropy's own locals: loss_parallel's handler is done with the fp32 copy here; the
  // standard path's logits.float() is ForCausalLMLoss's local until it returns, after nll_loss.
  if (vocab_parallel) t_.drop(up);
  T total_weight;
  T loss;
  if (vocab_parallel) {
    loss = vocab_parallel_nll_loss(shifted, total_weight);
  } else {
    loss = fresh(1, DType::kF32);
    total_weight = fresh(1, DType::kF32);
    t_.drop(up);
    if (padded.id != kNone && B_ > 1) t_.drop(padded);
  }
  requires_grad(loss);
  {
    Node nd = node(loss);
    nd.saved = {logp.id, shifted.id, total_weight.id};
    nd.inputs.push_back(grad_of(logp));
    if (vocab_parallel) vocab_parallel_nll_backward(nd, tok_, logits.numel / tok_);
    t_.record(std::move(nd));
  }
  t_.drop(logp);
  t_.drop(shifted);
  t_.drop(total_weight);
  if (vocab_parallel && padded.id != kNone && B_ > 1) t_.drop(padded);
  return loss;
}

// Chunked linear + cross-entropy, `--loss fused`: the reference is the tracker's
// python/trainmem/measure/fused_loss.py (see its Note [Fused loss allocations]); it behaves
// like Liger-Kernel's fused linear cross-entropy. The gradients of the hidden states and of
// the lm_head weight are computed in the forward, chunk by chunk; full logits never exist.
ValueId StepBuilder::fused_loss(T& hidden, std::uint32_t emb) {
  const std::uint64_t V = a_.vocab_size, h = a_.hidden_size, rows = tok_;
  phase_ = Phase::kLoss;
  op("fused_linear_cross_entropy");
  const std::uint32_t w = lm_head_param(emb);
  const DType cd = pol_.autocast ? pol_.compute : pol_.param;
  const DType md = cd == DType::kF32 ? DType::kF32 : DType::kF32;  // the math dtype is fp32
  const std::uint64_t cb = dtype_bytes(cd);
  // shift_labels: pad by one ignore_index, drop the first column, contiguous: a copy, but for one
  // sequence, whose slice is contiguous already and stays a view of the padded labels to the end
  // (as in causal_lm_loss; measured: the loss phases of cpu-phi3w512l2-bf16mixed-loadbf16-*).
  T padded = fresh(rows + B_, DType::kI64);
  T targets = padded;
  if (B_ == 1) {
    targets.numel = rows;
  } else {
    targets = fresh(rows, DType::kI64);
    t_.drop(padded);
  }
  TensorId wc = kNone;  // weight.to(compute dtype), when the weight is not in it already
  if (pol_.param != cd) wc = t_.alloc_bytes(V * h * cb, Category::kWeights);
  const bool trains = trainable(w);  // a LoRA run's frozen lm_head has no grad_w at all
  T grad_x = fresh(rows * h, cd);
  const bool first_grad = t_.param_grad(params_[w].slot) == kNone;
  TensorId grad_w = trains ? t_.alloc_bytes(V * h * cb, Category::kTemporaries) : kNone;
  T valid = fresh(rows, DType::kU8);
  T nsum = fresh(1, DType::kI64);
  T n_valid = fresh(1, md);
  t_.drop(nsum);
  T loss_sum = fresh(1, md);
  T safe_t = fresh(rows, DType::kI64);
  // Liger's chunk: about as many logits per chunk as there are hidden-state elements.
  const std::uint64_t inc = (V + h - 1) / h;
  const std::uint64_t want = (rows + inc - 1) / inc;
  std::uint64_t step = 1;
  while (step < want) step <<= 1;
  std::vector<TensorId> smalls;  // last iteration's vc, row_max, target, row_sum (rebound)
  for (std::uint64_t start = 0; start < rows; start += step) {
    const std::uint64_t c = std::min(step, rows - start);
    TensorId xc = hidden.dtype != cd ? t_.alloc_bytes(c * h * cb, Category::kTemporaries) : kNone;
    ensure_workspace(false);
    TensorId logits = t_.alloc_bytes(c * V * cb, Category::kTemporaries);
    TensorId z = logits;
    if (cd != md) {
      z = t_.alloc_bytes(c * V * 4, Category::kTemporaries);
      t_.release(logits);
    }
    TensorId tanh = kNone;
    if (a_.final_logit_softcap > 0) tanh = t_.alloc_bytes(c * V * 4, Category::kTemporaries);
    std::vector<TensorId> next;
    for (std::size_t k = 0; k < 4; ++k) {  // vc, row_max, target, row_sum (c fp32 values each)
      next.push_back(t_.alloc_bytes(c * 4, Category::kTemporaries));
      // each replaces last iteration's tensor of the same name once it is made
      if (!smalls.empty()) t_.release(smalls[k]);
    }
    // The loss term: ((row_sum.log() - target) * vc).sum() added into loss_sum.
    TensorId lg = t_.alloc_bytes(c * 4, Category::kTemporaries);
    TensorId diff = t_.alloc_bytes(c * 4, Category::kTemporaries);
    t_.release(lg);
    TensorId prod = t_.alloc_bytes(c * 4, Category::kTemporaries);
    t_.release(diff);
    TensorId sum = t_.alloc_bytes(4, Category::kTemporaries);
    t_.release(prod);
    t_.release(sum);
    TensorId neg = t_.alloc_bytes(c * 4, Category::kTemporaries);  // vc.neg() for scatter_add_
    t_.release(neg);
    TensorId scale = t_.alloc_bytes(c * 4, Category::kTemporaries);  // vc / n_valid
    t_.release(scale);
    if (tanh != kNone) t_.release(tanh);
    TensorId g = z;
    if (cd != md) {
      g = t_.alloc_bytes(c * V * cb, Category::kTemporaries);
      t_.release(z);
    }
    t_.release(g);
    if (xc != kNone) t_.release(xc);
    smalls = std::move(next);
  }
  if (wc != kNone) t_.release(wc);
  if (grad_x.dtype != hidden.dtype) {
    T gx = fresh(grad_x.numel, hidden.dtype);
    t_.drop(grad_x);
    grad_x = gx;
  }
  if (trains && cd != pol_.param) {
    TensorId gw = t_.alloc_bytes(V * h * dtype_bytes(pol_.param), Category::kTemporaries);
    t_.release(grad_w);
    grad_w = gw;
  }
  // grad_w becomes the weight's .grad when it has none yet; otherwise it is added into it.
  if (trains) t_.set_category(grad_w, first_grad ? Category::kGradients : Category::kTemporaries);
  T loss = fresh(1, md);  // loss_sum / n_valid
  requires_grad(loss);
  {
    Node nd = node(loss);
    nd.saved = {grad_x.id};
    if (trains) nd.kept = {grad_w};  // ctx.grad_w
    GradIn gi = grad_of(hidden);
    gi.reuse = grad_x.id;
    nd.inputs.push_back(gi);
    if (trains) {
      ParamGrad pg = param_grad(w, pol_.param);
      pg.reuse = grad_w;
      nd.params.push_back(pg);
    }
    t_.record(std::move(nd));
  }
  if (trains) t_.release(grad_w);
  t_.drop(grad_x);
  for (TensorId id : smalls) t_.release(id);
  t_.drop(loss_sum);
  t_.drop(n_valid);
  t_.drop(valid);
  t_.drop(safe_t);
  t_.drop(targets);
  t_.drop(hidden);
  // Liger's forward returns the base model's output, its DynamicCache included, beside the loss;
  // the Trainer drops it before backward (Note [A cache in training]).
  for (TensorId id : cache_) t_.release(id);
  cache_.clear();
  return scale_loss(loss);
}

ValueId StepBuilder::scale_loss(T& loss) {
  module_exit(peft_tuner_module_);
  peft_tuner_module_ = kNone;
  module_exit(causal_lm_module_);  // the model's forward returns with the loss
  causal_lm_module_ = kNone;
  dp_->post_forward();  // the model's forward has returned (FSDP2's root post-forward)
  root_output_ = loss.value;
  exit_autocast();  // the autocast context ends with the forward, before the loss is scaled
  // (loss / grad_accum).backward(); fp16-mixed goes through GradScaler.scale(), which makes
  // its scale and growth tracker on first use and multiplies the loss by the scale.
  if (is_zero(r_.parallel)) {
    // See Note [DeepSpeed ZeRO-1/2]: engine.backward(loss) divides by the accumulation steps
    // (gas_scaled_loss, which it returns) and multiplies by the loss scale (1.0 for bf16 and
    // fp32: LossScaler.scale_loss), and the caller keeps `loss` until backward returns. Both
    // happen inside engine.backward, in the backward phase.
    phase_ = Phase::kBackward;
    op("loss");
  }
  T scaled = elementwise({&loss}, 1, DType::kF32, {});
  if (is_zero(r_.parallel)) {
    T by_scale = elementwise({&scaled}, 1, DType::kF32, {});
    zero_losses_ = {loss, scaled};
    pending_loss_ = by_scale;
    return by_scale.value;
  }
  t_.drop(loss);
  if (r_.precision == Precision::kFp16Mixed) {
    if (scaler_scale_ == kNone) {
      scaler_scale_ = t_.alloc_bytes(4, Category::kOther);
      t_.alloc_bytes(4, Category::kOther);  // _growth_tracker, kept for the run
    }
    T by_scale = elementwise({&scaled}, 1, DType::kF32, {});
    t_.drop(scaled);
    scaled = by_scale;
    t_.set_category(scaled.id, Category::kOther);
  }
  ValueId v = scaled.value;
  pending_loss_ = scaled;
  return v;
}

void StepBuilder::backward(ValueId loss) {
  phase_ = Phase::kBackward;
  dp_->backward_begin();
  // FSDP2's root pre-backward hook sits on the model's output, the loss: it runs once the seed and
  // the loss's scaling have made the loss's gradient (measured: the FSDP traces, the root's
  // all-gather after ones_like and div). No other wrapper has one.
  if (r_.parallel == Parallel::kFsdp) {
    t_.hooked_value = root_output_;
    t_.on_hooked_value = [this] { dp_->root_pre_backward(); };
  }
  t_.at(Phase::kBackward, kNoLayer, "loss");
  ensure_workspace(true);
  // The input leaf's gradient (LoRA with checkpointing) is stolen into its .grad, which goes with
  // the leaf, after the wrapper's end of backward (measured: ZeRO-1 QLoRA, the final norm's cast
  // gradient that the residual stream carried down to the embeddings, freed just before them).
  TensorId leaf_grad = kNone;
  t_.backward(loss, kNone, input_leaf_.value, &leaf_grad);
  dp_->backward_end();
  t_.free_graph_held();  // `del loss`: the graph goes (See Tape::hold_with_graph)
  t_.drop(pending_loss_);
  for (T& l : zero_losses_) t_.drop(l);
  zero_losses_.clear();
  if (leaf_grad != kNone) t_.release(leaf_grad);
  if (input_leaf_.id != kNone) t_.drop(input_leaf_);
}

}  // namespace trainmem::graph::step

namespace trainmem::graph {
namespace {

// The sliding window that a training sequence of the recipe's length reaches under SDPA, making
// HF materialise the mask (Note [Training masks]); 0 when none does. Gemma-2 runs eager
// attention whatever the recipe says (its mask is modelled everywhere).
std::uint64_t reached_window(const Model& model, const Recipe& r) {
  if (r.mode != Mode::kTraining || r.attention != Attention::kSdpa || model.arch.family == Family::kGemma2) return 0;
  std::uint64_t window = 0;
  for (std::uint64_t w : model::attention_windows(model.arch)) window = std::max(window, w);
  return window != 0 && r.seq >= window ? window : 0;
}

}  // namespace

void check_sliding_window(const Model& model, const Recipe& r) {
  // Tensor-parallel ranks and pipeline stages build the masks the model's own forward builds, and
  // attend over their local heads with them (Note [Training masks]; pipeline.cpp's pp_forward):
  // measured past a window (cpu-tp2*-*win128-*, cpu-pp2-*win128-*, the -slide128- ones). Context
  // parallelism's ring is mirrored from the source, not measured, and with a mask not at all.
  if (r.cp <= 1) return;
  const std::uint64_t window = reached_window(model, r);
  if (window == 0) return;
  throw Error("attention: sdpa with a sequence of " + std::to_string(r.seq) + " tokens reaches the model's " +
              "sliding window (" + std::to_string(window) + "), where the mask is materialised; that is not " +
              "modelled under context parallelism (use a sequence shorter than the window)");
}

void check_attention_dropout(const Model& model, const Recipe& r, const Gpu& gpu) {
  const Architecture& a = model.arch;
  // On the CPU no fused kernel takes dropout, so SDPA runs its math kernel (StepBuilder::
  // math_kernel), modelled with its own causal mask or a padding mask; a reached sliding window
  // hands it HF's sliding mask instead, which is not measured. Gemma-2 runs eager attention anyway.
  if (gpu.name != "cpu" || a.attn_dropout == 0) return;
  const std::uint64_t window = reached_window(model, r);
  if (window == 0) return;
  throw Error("attention: sdpa with attention dropout (the config's attention_dropout > 0) on the CPU, with a "
              "sequence of " + std::to_string(r.seq) + " tokens that reaches the sliding window (" +
              std::to_string(window) + "), runs torch's math kernel on the model's mask, which is not modelled; "
              "use eager attention, a sequence shorter than the window, or attention_dropout 0");
}

Trace build_training_trace(const Model& model, const Recipe& recipe, const Gpu& gpu, const MicroBatchHook& hook,
                           std::uint64_t rank) {
  // A tensor-parallel rank builds the step of its local model (Note [Tensor parallelism]).
  const Model local = tensor_parallel_model(model, recipe.tp, recipe.loss_parallel, recipe.sequence_parallel);
  check_context_parallel(model, recipe);
  check_sliding_window(model, recipe);
  check_attention_dropout(model, recipe, gpu);
  step::StepBuilder b(local, recipe, gpu, hook, rank);
  return b.build();
}

}  // namespace trainmem::graph
