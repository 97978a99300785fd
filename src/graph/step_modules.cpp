// The ops and modules of the training forward (step_builder.h): nn.Linear, bitsandbytes'
// Linear4bit and Linear8bitLt (generation only) and peft's lora.Linear around them, the norms, rotary embeddings, the attention
// cores (eager, SDPA, flash), the MLPs and the decoder layer with and without checkpointing, each
// mirroring its Hugging Face module of transformers 5.x (modeling_llama.py and its siblings,
// modeling_gpt2.py) and the PyTorch kernels it calls.
#include "graph/step_builder.h"
#include "graph/context_parallel.h"
#include "graph/tensor_parallel.h"

namespace trainmem::graph::step {

// Note [Quantized linear biases]
// bitsandbytes' Linear4bit and Linear8bitLt keep their bias as a plain parameter (transformers'
// replace_with_bnb_linear; GPT-2's Conv1D becomes one too, its weight transposed to (out, in)
// first: integrations/bitsandbytes.py). Their forward (bitsandbytes 0.50, nn/modules.py) recasts
// the bias in place when its dtype is not the matmul input's: `bias.data = bias.data.to(x.dtype)`,
// after Linear4bit has cast x to the compute dtype. A new storage is made and the old one freed,
// once, in the first forward: under QLoRA prepare_model_for_kbit_training has made every bias
// fp32, so with a bf16 (or fp16) compute dtype each bias is halved in step 1's first forward
// and stays half. The bias then goes into the matmul's own kernel (gemm_4bit's F.linear with the
// bias, int8_mm_dequant's in-place `out += bias`): no tensor of its own. A frozen base bias gets
// no gradient (MatMul4Bit's grad_bias only when it requires grad).
// Under FSDP2 the bias is FSDP's unsharded parameter while the unit is gathered: the recast
// swaps that nn.Parameter's data for the half copy, which FSDP2 neither frees at reshard nor
// gathers into again (it resizes the storages it made itself), so the copy lives for the run,
// whole on every rank, and FSDP2 keeps gathering and freeing the fp32 bias beside it (measured:
// data/ground_truth/parallel/cpu-hsdp-qwen2.5w512l2-4bitfp4-*; Note [QLoRA under FSDP2]).
void StepBuilder::recast_bias(std::uint32_t b, DType dtype) {
  if (b == kNone || params_[b].dtype == dtype) return;
  Param& p = params_[b];
  TRAINMEM_ASSERT(!p.trainable, "a trainable bias on a quantized layer");
  const TensorId cast = t_.alloc_bytes(detail::mul(p.numel, dtype_bytes(dtype), "bias bytes"), Category::kWeights);
  p.dtype = dtype;
  if (r_.parallel == Parallel::kFsdp) return;  // FSDP2's storage stays its own; the copy is never freed
  t_.release(p.storage);
  p.storage = cast;
}

// bnb.nn.Linear4bit: the input cast to the compute dtype, the weight dequantized for the matmul
// and again in its backward (Note [QLoRA]); the bias as Note [Quantized linear biases] says.
T StepBuilder::linear_4bit(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
  const std::uint64_t numel = params_[w].numel;
  const std::uint64_t rows = x_in.numel / (numel / out_features);
  const Packed4bit q = packed_4bit(numel, r_.quant.double_quant);
  const std::uint64_t absmax_f32_bytes = detail::mul(q.blocks, 4, "absmax bytes");
  T x = to(x_in, quant_dtype_);  // kept until forward returns
  recast_bias(b, quant_dtype_);  // See Note [Quantized linear biases]
  // gemm_4bit: the fp32 absmax (double quant: dequantize_blockwise, then + offset), the
  // dequantized weight, F.linear. Generation on CUDA: the fused kernel for a few rows, else
  // the fallback that keeps both absmax tensors to the end (See Note [Quantized generation]).
  const bool cuda_generation = cuda_ && r_.mode == Mode::kInference;
  T y;
  const bool aligned = (numel / out_features) % kBnb4bitBlockSize == 0;  // in_features: K % blocksize
  if (cuda_generation && rows <= kBnbGemm4bitFusedMaxRows && aligned) {
    y = fresh(rows * out_features, quant_dtype_);  // cgemm_4bit_*: nothing dequantized
  } else {
    TensorId absmax = kNone, blockwise = kNone;
    if (r_.quant.double_quant) {
      blockwise = t_.alloc_bytes(absmax_f32_bytes, Category::kTemporaries);
      absmax = t_.alloc_bytes(absmax_f32_bytes, Category::kTemporaries);
      if (!cuda_generation) {
        t_.release(blockwise);
        blockwise = kNone;
      }
    }
    T wd = fresh(numel, quant_dtype_);
    ensure_workspace(false);
    y = fresh(rows * out_features, quant_dtype_);
    if (absmax != kNone) t_.release(absmax);
    if (blockwise != kNone) t_.release(blockwise);
    t_.drop(wd);
  }
  if (x.requires_grad()) {
    // MatMul4Bit saves only the packed weight (a parameter). Its backward: the fp32 absmax
    // (double quant; dies once the weight is made), the weight in its load dtype, under
    // autocast cast to the gradient's dtype (the load one dies once the cast is made), grad_A.
    requires_grad(y);
    Node n = node(y);
    if (r_.quant.double_quant) n.scratch.push_back(absmax_f32_bytes);
    // See Note [The load dtype of a 4-bit base]: a half load dtype is its autocast's (validate).
    const DType load = r_.load_dtype == LoadDtype::kAuto ? policy_for(r_.precision).param : quant_dtype_;
    n.scratch.push_back(numel * dtype_bytes(load));
    if (load != quant_dtype_) n.scratch.push_back(numel * dtype_bytes(quant_dtype_));
    n.scratch_freed_early = static_cast<std::uint32_t>(n.scratch.size()) - 1;
    // ctx.tensors holds B.view(-1, 1), a view of the packed weight's .data: under ZeRO-3 the
    // gathered storage outlives the parameter's release until the graph goes (Note [QLoRA under
    // ZeRO-3]).
    if (dp_->zero3() && dp_->zero3_data(w) != kNone) t_.hold_with_graph(dp_->zero3_data(w));
    n.inputs.push_back(grad_of(x));
    t_.record(std::move(n));
  }
  T out = to(y, x_in.dtype);
  t_.drop(y);
  t_.drop(x);
  return out;
}

// bnb.nn.Linear8bitLt under generate() (its bias: Note [Quantized linear biases]): MatMul8bitLt with
// threshold 6.0 and no outlier columns. See Note [LLM.int8].
T StepBuilder::linear_8bit(const T& x, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
  recast_bias(b, x.dtype);  // See Note [Quantized linear biases]
  const std::uint64_t numel = params_[w].numel;
  const std::uint64_t rows = x.numel / (numel / out_features);
  const std::uint64_t out_numel = rows * out_features;
  T a16 = to(x, DType::kF16);  // A.to(float16): x itself when it is fp16
  // int8_vectorwise_quant(A, 6.0): CA (int8) and SCA (fp32 per row).
  T ca, sca;
  auto outlier_mask = [&] {  // |A| >= 6.0, then .any(); no outliers: an empty outlier_cols
    T abs_a = fresh(x.numel, DType::kF16);
    T mask = fresh(x.numel, DType::kU8);
    t_.drop(abs_a);
    T any = fresh(1, DType::kU8);
    t_.drop(any);
    return mask;
  };
  T mask;
  if (cuda_) {
    sca = fresh(rows, DType::kF32);
    ca = fresh(x.numel, DType::kI8);
    mask = outlier_mask();
  } else {
    mask = outlier_mask();
    T abs_a = fresh(x.numel, DType::kF16);  // torch.max(A.abs(), dim=1)
    T indices = fresh(rows, DType::kI64);
    T values = fresh(rows, DType::kF16);
    t_.drop(abs_a);
    t_.drop(indices);
    sca = fresh(rows, DType::kF32);  // .values.float()
    t_.drop(values);
    T reciprocal = fresh(rows, DType::kF32);  // 127.0 / SCA.unsqueeze(-1)
    T scale = fresh(rows, DType::kF32);
    t_.drop(reciprocal);
    T scaled = fresh(x.numel, DType::kF32);  // A * scale
    t_.drop(scale);
    T rounded = fresh(x.numel, DType::kF32);
    t_.drop(scaled);
    ca = fresh(x.numel, DType::kI8);
    t_.drop(rounded);
  }
  if (rows > 1) {  // out_row[:, outlier_cols] = 0: the 0 as a 0-dim int8
    T zero = fresh(1, DType::kI8);
    t_.drop(zero);
  }
  t_.drop(mask);
  t_.drop(a16);
  // int8_scaled_mm: the int32 product, dequantized to the input's dtype.
  T y;
  if (cuda_) {
    T product = fresh(out_numel, DType::kI32);  // cuBLASLt int8 matmul
    T half = fresh(out_numel, DType::kF16);     // int8_mm_dequant (fp16 only)
    y = to(half, x.dtype);
    t_.drop(half);
    t_.drop(product);
  } else {
    T a32 = fresh(x.numel, DType::kF32);  // A.float()
    T b32 = fresh(numel, DType::kF32);    // B.float(): the whole weight
    ensure_workspace(false);
    T mm = fresh(out_numel, DType::kF32);
    t_.drop(a32);
    t_.drop(b32);
    T product = fresh(out_numel, DType::kI32);
    t_.drop(mm);
    T stats = fresh(out_numel, DType::kF32);  // row_stats * col_stats
    T scaled = fresh(out_numel, DType::kF32);
    t_.drop(stats);
    T dequant = fresh(out_numel, DType::kF32);  // * 6.200124e-05
    t_.drop(scaled);
    y = to(dequant, x.dtype);
    t_.drop(dequant);
    t_.drop(product);
  }
  t_.drop(ca);
  t_.drop(sca);
  return y;
}

// Note [Autocast's weight casts]
// Under autocast, F.linear (and addmm) cast their arguments with cached_cast inside one call,
// whose arguments C++ evaluates right to left here (torch 2.13, GCC): F.linear(x, W, b) the
// bias, the weight, then the input; addmm(b, x, W) the weight, the input, then the bias. A
// trainable weight's cast is cached, with its own autograd node (ToCopyBackward, then the
// parameter's AccumulateGrad), made before the input's cast. Autograd runs the newest
// ready node first, so after the matmul's backward the input's cast back to fp32 runs (and its
// gradient is delivered, summed into a buffered one), then the weight's cast and its
// AccumulateGrad. Measured on the CPU under bf16-mixed (the forward's _to_copy order, and in
// backward the input's gradient cast before the weight's): one GPU, and pipeline stages, where
// with one micro-batch of 64 tokens the weight's cast first made a backward phase 64 KiB high.
// So a cached cast is a node of its own (weight()), and the linear hands the weight's gradient
// to it as an input.

// nn.Linear (or GPT-2's Conv1D addmm): y = x W^T + b over `rows` rows.
T StepBuilder::linear(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
  const std::uint32_t m = module_enter(w, b, x_in.requires_grad());
  T y = linear_module(x_in, w, b, out_features);
  module_exit(m);
  return y;
}

T StepBuilder::linear_module(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
  if (params_[w].quantized) {
    return r_.quant.load_in_8bit ? linear_8bit(x_in, w, b, out_features) : linear_4bit(x_in, w, b, out_features);
  }
  const std::uint64_t in_features = params_[w].numel / out_features;
  const std::uint64_t rows = x_in.numel / in_features;  // tokens
  const std::uint64_t out_numel = rows * out_features;
  // See Note [Autocast's weight casts]: F.linear(x, W, b) casts the bias, the weight, then the
  // input; addmm(b, x, W) (GPT-2's Conv1D) the weight, the input, then the bias.
  const bool addmm = !functional_linear(w);
  T bc;
  if (b != kNone && !addmm) bc = weight(b);
  T wc = weight(w);
  T x = pol_.autocast ? to(x_in, pol_.compute) : t_.ref(x_in);
  if (b != kNone && addmm) bc = weight(b);
  const DType cd = wc.dtype;
  T y = fresh(out_numel, cd);
  ensure_workspace(false);
  const bool wt = trainable(w), bt = trainable(b);
  if (x.requires_grad() || wt || bt) {
    // mm/addmm save the input for the weight's gradient and the weight for the input's; ZeRO-3's
    // F.linear, LinearFunctionForZeroStage3, saves the input, the weight and the bias whatever
    // needs a gradient (See Note [LoRA under ZeRO-3] in zero3.cpp).
    const bool save_all = dp_->zero3() && functional_linear(w);
    requires_grad(y);
    Node& n = open_node(y);
    if (wt || save_all) n.saved.push_back(x.id);
    // The weight (and the bias): autograd saves the parameter itself, a leaf, so under ZeRO-3
    // it holds no gathered storage once the parameter is released, except in a checkpoint's
    // recompute, whose saved-tensor hook keeps a detached alias of a trainable one until this
    // node runs (the frozen ones stay gathered for the module in backward: See Note
    // [DeepSpeed ZeRO-3]).
    const bool keeps_weight = !dp_->zero3() || (t_.recomputing && wt);
    if ((x.requires_grad() || save_all) && keeps_weight) n.saved.push_back(wc.id);
    // A weight cast by autocast hands its gradient to the cast's own node (Note [Autocast's
    // weight casts]): an input of this node, made in the same order as a parameter's.
    const bool wcast = wt && wc.value != kNone, bcast = bt && bc.value != kNone;
    if (wcast && b == kNone) n.inputs.push_back(grad_of(wc));
    if (x.requires_grad()) {
      // Its input is folded to [tokens, in_features] for the product, so the gradient is mm's
      // output viewed back (ZeRO-3's function for F.linear makes it with one matmul, no view).
      GradIn gx = grad_of(x);
      gx.view = !(dp_->zero3() && functional_linear(w));
      n.inputs.push_back(gx);
    }
    if (wcast && b != kNone) n.inputs.push_back(grad_of(wc));
    if (bcast) n.inputs.push_back(grad_of(bc));
    // addmm(bias, x, W): the bias is the first input, so its gradient is made and its
    // AccumulateGrad runs first (what DDP's gradient-ready order shows: Note [DDP buckets]).
    // addmm's bias gradient is validate_outputs' sum; ZeRO-3's function for F.linear sums it itself.
    if (bt && !bcast) {
      n.params.push_back(dp_->zero3() && functional_linear(w) ? param_grad(b, cd) : reduced(param_grad(b, cd)));
    }
    if (wt && !wcast) {
      // F.linear multiplies by W.t(), so W's gradient is mm's output transposed back, a view
      // (ZeRO-3's LinearFunctionForZeroStage3 makes it fresh); addmm(b, x, W) uses W as it is.
      ParamGrad pg = param_grad(w, cd);
      pg.view = !addmm && !dp_->zero3();
      n.params.push_back(pg);
    }
    // mm makes the weight's gradient first, addmm the input's and the bias's last (See Note
    // [Gradient order of a node] in tape.h); ZeRO-3's LinearFunctionForZeroStage3 the input's,
    // then the weight's, then the bias's (measured: ZeRO-3 traces, lm_head's backward; read in
    // deepspeed/runtime/zero/linear.py for the bias): the params list holds the bias first.
    n.grad_order = wcast || bcast ? GradOrder::kInputsFirst
                   : b != kNone   ? GradOrder::kParamsReversed
                   : save_all     ? GradOrder::kInputsFirst
                                  : GradOrder::kParamsFirst;
    // With a bias the input's gradient goes through a view made before the weight's transpose
    // (F.linear) or before a weight with no transpose (Conv1D's addmm): the parameters' nodes
    // outrank it (Node::params_routed_first). ZeRO-3's function hands the input its gradient
    // directly; a weight cast by autocast goes through the cast's node (not examined).
    n.params_routed_first = b != kNone && !wcast && !bcast && !save_all;
    n.saves_after_forward = save_all;
    t_.close_node();
  }
  t_.drop(x);
  t_.drop(wc);
  if (b != kNone) t_.drop(bc);
  return y;
}

// A projection of the decoder layer: nn.Linear (GPT-2: Conv1D), or peft's lora.Linear
// around it when LoRA targets it (Note [LoRA]).
T StepBuilder::proj(const T& x, std::string_view path, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
  op(path);
  const TpStyle style = r_.tp > 1 ? tp_style(path) : TpStyle::kNone;
  if (style == TpStyle::kColwise) return colwise_linear(x, w, b, out_features);
  if (style == TpStyle::kRowwise) return rowwise_linear(x, w, b, out_features);
  const Adapter* ad = adapter(path);
  // ZeRO-3 hooks the lora.Linear around the projection and its lora_dropout as modules too.
  const std::uint32_t sub = ad == nullptr ? 0 : static_cast<std::uint32_t>(ad - adapters_[layer_].data()) + 1;
  const std::uint32_t lora_module = ad != nullptr ? container_enter(Container::kLora, x.requires_grad(), sub) : kNone;
  if (ad == nullptr) return linear(x, w, b, out_features);
  // Under ZeRO-3 the lora.Linear's input is its own (See StepBuilder::module_input): the base
  // layer's and the adapter's gradients are summed there before they leave for x's (measured:
  // lora_A's input gradient kept until the base layer's comes).
  T xm = dp_->zero3() ? module_input(x, /*unwrap=*/false) : t_.ref(x);
  T result = linear(xm, w, b, out_features);
  const LoraLabels& labels = lora_labels(path);
  if (params_[w].quantized) {
    T out = lora_4bit(xm, result, *ad, labels, lora_module, sub);
    t_.drop(xm);
    module_exit(lora_module);
    return out;
  }
  const DType result_dtype = result.dtype;
  if (dp_->zero3()) {
    dp_->zero3_external_param(lora_module, ad->a);  // lora_A.weight.dtype, through ZeRO-3's getter
    op(path);
  }
  T xa = to(xm, params_[ad->a].dtype);  // _cast_input_dtype: x is rebound, kept to the end
  T xd = dropout_module(xa, r_.lora.dropout, Container::kLoraDropout, xa.requires_grad(), sub);
  op(labels.a);
  T down = linear(xd, ad->a, kNone, r_.lora.rank);
  t_.drop(xd);
  op(labels.b);
  T up = linear(down, ad->b, kNone, ad->out);
  t_.drop(down);
  op(path);
  T scaled = elementwise({&up}, up.numel, up.dtype, {});  // * scaling (a Python float)
  t_.drop(up);
  T sum = add(result, scaled);
  t_.drop(scaled);
  t_.drop(result);
  T out = to(sum, result_dtype);
  t_.drop(sum);
  t_.drop(xa);
  t_.drop(xm);
  module_exit(lora_module);
  return out;
}

// ColwiseParallel around nn.Linear (Note [Tensor parallelism]): DTensor.from_local(x, Replicate)
// is a view, whose backward all-reduces the linear's Partial input gradient into a new tensor,
// waits for it (a plain tensor, summed in place like any other) and frees the partial one.
T StepBuilder::colwise_linear(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
  if (sp_ > 1) {  // ColwiseParallel(input_layouts=Shard(1)): See Note [Sequence parallelism]
    T full = seq_all_gather(x_in, /*partial_grad=*/true);
    T y = linear(full, w, b, out_features);
    t_.drop(full);
    return y;
  }
  T x = t_.ref(x_in);
  if (x_in.requires_grad()) {
    requires_grad(x);
    Node n = node(x);
    n.inputs.push_back(grad_of(x_in));
    t_.record(std::move(n));
  }
  T y = linear(x, w, b, out_features);
  t_.drop(x);
  return y;
}

// RowwiseParallel around nn.Linear (Note [Tensor parallelism]): the local output is Partial;
// redistributing it to Replicate all-reduces it out of place, then the partial output dies. The
// redistribution's backward hands the gradient on.
T StepBuilder::rowwise_linear(const T& x, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
  T partial = linear(x, w, b, out_features);
  if (sp_ > 1) {  // RowwiseParallel(output_layouts=Shard(1)): See Note [Sequence parallelism]
    T y = seq_reduce_scatter(partial);
    t_.drop(partial);
    return y;
  }
  T y = handing_on(partial);
  t_.drop(partial);
  return y;
}

// Shard(1) -> Replicate: all_gather_into_tensor stacks the shards on dim 0, torch.cat(chunk(.., tp),
// dim=1) makes the gathered tensor; with batch 1 the gathered tensor is a view of the stacked one
// (See Note [Gathering a batch of one] in tensor_parallel.h). Backward redistributes its gradient
// back to Shard(1): a Partial one (a colwise input's) is reduce-scattered (the chunks concatenated
// on dim 0 first, a full-size buffer), a Replicate one (lm_head's input) is a clone of this rank's
// chunk. See Note [Sequence parallelism] in tensor_parallel.h.
T StepBuilder::seq_all_gather(const T& shard, bool partial_grad) {
  const std::uint64_t n = shard.numel * sp_;
  T stacked = fresh(n, shard.dtype);
  T full = gather_is_view() ? t_.ref(stacked) : fresh(n, shard.dtype);
  t_.drop(stacked);
  if (shard.requires_grad()) {
    requires_grad(full);
    Node nd = node(full);
    GradIn g = grad_of(shard);
    g.subclass = true;  // a DTensor around the collective's AsyncCollectiveTensor
    nd.inputs.push_back(g);
    if (partial_grad) nd.scratch.push_back(n * dtype_bytes(shard.dtype));
    t_.record(std::move(nd));
  }
  return full;
}

// Partial -> Shard(1): the chunks concatenated on dim 0, reduce_scatter_tensor into this rank's
// shard. Backward all-gathers the shard's gradient (stacked, then concatenated on dim 1).
T StepBuilder::seq_reduce_scatter(const T& partial) {
  T stacked = fresh(partial.numel, partial.dtype);
  T shard = seq_shard(partial);  // the shard, with the same backward as a plain one
  t_.drop(stacked);
  return shard;
}

// Replicate -> Shard(1): a clone of this rank's chunk. Backward all-gathers the gradient: the
// stacked output, then the cat of its chunks that is the gradient (with batch 1 the stacked
// output itself, viewed: Note [Gathering a batch of one]).
T StepBuilder::seq_shard(const T& full) {
  T shard = fresh(full.numel / sp_, full.dtype);
  if (full.requires_grad()) {
    requires_grad(shard);
    Node nd = node(shard);
    nd.inputs.push_back(grad_of(full));
    if (!gather_is_view()) nd.scratch.push_back(full.bytes());  // all_gather_into_tensor's stacked output
    t_.record(std::move(nd));
  }
  return shard;
}

// peft's lora.bnb.Linear4bit around a 4-bit projection whose output is `base` (Note [QLoRA]).
T StepBuilder::lora_4bit(const T& x, T& base, const Adapter& ad, const LoraLabels& labels, std::uint32_t lora_module,
                         std::uint32_t sub) {
  T result = fresh(base.numel, base.dtype);  // result.clone(): CloneBackward hands its gradient on
  if (base.requires_grad()) {
    requires_grad(result);
    Node n = node(result);
    n.inputs.push_back(pass_to(base));
    t_.record(std::move(n));
  }
  t_.drop(base);
  // peft converts x to the adapter's dtype and the adapter's output back unless
  // torch.is_autocast_enabled(), which asks about CUDA's autocast only: a CPU run under CPU
  // autocast converts, a CUDA run under autocast adds the bf16 output to the fp32 result.
  const bool convert = !(pol_.autocast && cuda_);
  if (convert && dp_->zero3()) {
    dp_->zero3_external_param(lora_module, ad.a);  // lora_A.weight.dtype, through ZeRO-3's getter
    op(labels.path);
  }
  T xa = convert ? to(x, params_[ad.a].dtype) : t_.ref(x);  // _cast_input_dtype
  T xd = dropout_module(xa, r_.lora.dropout, Container::kLoraDropout, xa.requires_grad(), sub);
  op(labels.a);
  T down = linear(xd, ad.a, kNone, r_.lora.rank);
  t_.drop(xd);
  op(labels.b);
  T up = linear(down, ad.b, kNone, ad.out);
  t_.drop(down);
  op(labels.path);
  T scaled = elementwise({&up}, up.numel, up.dtype, {});  // * scaling (a Python float)
  t_.drop(up);
  T cast = convert ? to(scaled, result.dtype) : t_.ref(scaled);
  t_.drop(scaled);
  T sum = add(result, cast);
  t_.drop(cast);
  t_.drop(result);
  t_.drop(xa);
  return sum;
}

// LlamaRMSNorm: x.to(fp32); pow(2).mean(-1); x * rsqrt(var + eps); weight * x.to(input_dtype).
// Gemma2RMSNorm computes x.float() normalised, times (1 + weight.float()), then type_as(x).
T StepBuilder::rms_norm(const T& x, std::uint32_t w, std::uint64_t rows, std::string_view name) {
  op(name);
  const std::uint32_t m = module_enter(w);
  // Under tensor parallelism without sequence parallelism a norm is a Replicate DTensor module
  // (distribute_module with DTensor.from_local on its input, python/trainmem/measure/parallel.py
  // _replicate_the_rest): its input is a view of x with a gradient of its own, its ops run on
  // DTensors, whose gradients are never summed in place, and from_local's backward hands the
  // local tensor of the norm's summed input gradient on to x, where it is added to the residual's
  // gradient like any plain tensor: in place when that one is held by the buffer alone (measured:
  // cpu-tp2-qwen3w512l2-fp32-sgd-b2s256 traced). Qwen3's q_norm and k_norm are such modules too
  // (Shard on the heads, _head_shard_norms), under sequence parallelism as well, where the other
  // norms' inputs are DTensors already (See Note [Sequence parallelism]) and are not wrapped
  // again (measured: cpu-tp2sp-qwen3w512l2-fp32-adamw-b2s128 traced). Under ZeRO-3 the module's
  // input is a detached alias too (See StepBuilder::module_input).
  const bool replicated = r_.tp > 1 && !dtensor_;
  const bool dtensor = dtensor_;
  T xd = replicated || dp_->zero3() ? module_input(x, /*unwrap=*/replicated) : t_.ref(x);
  if (replicated) dtensor_ = true;
  T out = rms_norm_module(xd, w, rows);
  dtensor_ = dtensor;
  t_.drop(xd);
  module_exit(m);
  return out;
}

T StepBuilder::rms_norm_module(const T& x, std::uint32_t w, std::uint64_t rows) {
  const std::uint64_t n = x.numel;
  T h32 = to(x, DType::kF32);
  // pow's backward, grad * (2 * x.pow(1)): both expression temporaries live until the product.
  T sq = elementwise({&h32}, n, DType::kF32, {h32.id}, {n * 4, n * 4});
  T var = elementwise({&sq}, rows, DType::kF32, {});
  t_.drop(sq);
  T ve = handing_on(var);  // variance + eps
  const bool gemma = a_.family == Family::kGemma2;
  // LlamaRMSNorm keeps `variance` to its return; Gemma-2's _norm has it in one expression.
  if (gemma) t_.drop(var);
  // rsqrt's backward, -0.5 * grad * result.pow(3): two temporaries, then the product.
  T rs = elementwise({&ve}, rows, DType::kF32, {}, {rows * 4, rows * 4}, /*save_output=*/true);
  t_.drop(ve);
  T hn = fresh(n, DType::kF32);
  if (h32.requires_grad()) {
    requires_grad(hn);
    Node& nd = open_node(hn);
    nd.saved = {h32.id, rs.id};  // mul saves both factors (both require grad)
    nd.inputs.push_back(grad_of(h32));
    nd.inputs.push_back(grad_of(rs));
    nd.scratch.push_back(n * 4);  // grad * x before the sum over the hidden dim
    t_.close_node();
  }
  t_.drop(h32);
  t_.drop(rs);
  T out;
  if (gemma) {
    // output * (1.0 + weight.float()): the mul saves each factor for the other's gradient,
    // the fp32 normalised tensor and the [h] fp32 (1 + weight).
    const std::uint64_t h = params_[w].numel;
    TensorId wf = pol_.param != DType::kF32 ? t_.alloc_bytes(h * 4, Category::kTemporaries) : kNone;
    T onep = fresh(h, DType::kF32);
    if (wf != kNone) t_.release(wf);
    T hc = t_.ref(hn);
    out = fresh(n, DType::kF32);
    if (hc.requires_grad() || trainable(w)) {
      requires_grad(out);
      Node nd = node(out);
      if (trainable(w)) nd.saved.push_back(hc.id);
      if (hc.requires_grad()) {
        nd.saved.push_back(onep.id);
        nd.inputs.push_back(grad_of(hc));
      }
      if (trainable(w)) nd.params.push_back(reduced(param_grad(w, DType::kF32, n * 4)));
      t_.record(std::move(nd));
    }
    t_.drop(onep);
    t_.drop(hc);
    t_.drop(hn);
    if (x.dtype != DType::kF32) {
      T cast = to(out, x.dtype);
      t_.drop(out);
      out = cast;
    }
    return out;
  }
  T hc = to(hn, x.dtype);
  DType od = promote(params_[w].dtype, x.dtype);
  out = fresh(n, od);
  // `return self.weight * hidden_states.to(input_dtype)`: the fp32 normalised hidden_states is a
  // local until the norm returns, after the product exists (measured: a bf16 Llama's final norm).
  t_.drop(hn);
  if (!hc.requires_grad() && !trainable(w)) {
    t_.drop(hc);
    t_.drop(var);
    return out;
  }
  // weight * x: x is saved for the weight's gradient (the weight, saved for x's, is the
  // parameter itself).
  requires_grad(out);
  Node& nd = open_node(out);
  if (trainable(w)) nd.saved = {hc.id};
  if (hc.requires_grad()) {
    // mul's formula makes it in the product's dtype; validate_outputs casts it to x's after the
    // weight's reduction (measured: Qwen3's k_norm under bf16-mixed).
    GradIn g{hc.value, hc.bytes(), false};
    if (od != hc.dtype) g.compute_bytes = n * dtype_bytes(od);
    nd.inputs.push_back(g);
  }
  if (trainable(w)) nd.params.push_back(reduced(param_grad(w, od, n * dtype_bytes(od))));
  t_.close_node();
  t_.drop(hc);
  t_.drop(var);
  return out;
}

// nn.LayerNorm (GPT-2). Under CUDA autocast layer_norm runs in fp32: a half input is cast up
// and the output is fp32. native_layer_norm saves its input, mean and rstd.
T StepBuilder::layer_norm(const T& x, std::uint32_t w, std::uint32_t b, std::uint64_t rows, std::string_view name) {
  op(name);
  const std::uint32_t m = module_enter(w, b);
  T xin = (pol_.autocast && cuda_) ? to(x, DType::kF32) : t_.ref(x);
  // CUDA keeps mean/rstd in fp32; the CPU kernel in the input dtype.
  const DType stat = cuda_ ? DType::kF32 : xin.dtype;
  // The kernel's order (layer_norm_cpu, layer_norm_cuda): the output, then mean and rstd.
  T out = fresh(x.numel, xin.dtype);
  T mean = fresh(rows, stat);
  T rstd = fresh(rows, stat);
  if (xin.requires_grad() || trainable(w) || trainable(b)) {
    requires_grad(out);
    Node nd = node(out);
    nd.saved = {xin.id, mean.id, rstd.id};
    // native_layer_norm also saves the weight and the bias: the parameters themselves, which
    // keep no storage of their own alive (under ZeRO-3 the release swaps it out: See Note
    // [DeepSpeed ZeRO-3]).
    if (xin.requires_grad()) nd.inputs.push_back(grad_of(xin));
    if (trainable(w)) nd.params.push_back(param_grad(w, xin.dtype));
    if (trainable(b)) nd.params.push_back(param_grad(b, xin.dtype));
    t_.record(std::move(nd));
  }
  t_.drop(mean);
  t_.drop(rstd);
  t_.drop(xin);
  module_exit(m);
  return out;
}

// Dropout in training. p = 0 returns the input itself (Note [Dropout probabilities] in
// model/config.cpp); otherwise CUDA's fused kernel saves a bool mask and the CPU path saves the
// scaled noise in the input dtype (ATen Dropout.cpp).
T StepBuilder::dropout(const T& x, double p) {
  if (p == 0) return t_.ref(x);
  T mask = cuda_ ? fresh(x.numel, DType::kU8) : fresh(x.numel, x.dtype);
  T y = elementwise({&x}, x.numel, x.dtype, {mask.id});
  t_.drop(mask);
  return y;
}

// Rotary embedding applied to q or k (apply_rotary_pos_emb): q*cos + rotate_half(q)*sin.
// cos/sin carry the residual dtype, so under autocast the result is fp32.
// rotate_half(q) = cat((-x2, x1)) of q's two halves, which are views: each one's backward
// (slice_backward) makes a q-sized gradient, and the cat's hands its gradient on to -x2 and x1 as
// narrowed views. In backward -x2's negation runs first, then x2's slice_backward (freeing the
// negation), then x1's (freeing the cat's gradient), whose result is added into x2's in place
// (measured: tools/trace_allocs.py --phases backward over the Llama cut). Under autocast both
// products' gradients are made in fp32 and cast back to q's dtype by validate_outputs (measured:
// Llama bf16-mixed).
T StepBuilder::rope(const T& q) {
  DType d = promote(q.dtype, cos_.dtype);
  auto times_table = [&](const T& x, const T& table) {
    T y = fresh(x.numel, d);
    if (!x.requires_grad()) return y;
    requires_grad(y);
    Node& nd = open_node(y);
    nd.saved.push_back(table.id);
    GradIn g = grad_of(x);
    if (d != x.dtype) g.compute_bytes = x.numel * dtype_bytes(d);
    nd.inputs.push_back(g);
    t_.close_node();
    return y;
  };
  T a = times_table(q, cos_);
  T x1 = view_of(q, q.numel / 2);
  T x2 = view_of(q, q.numel / 2);
  T neg = elementwise({&x2}, x2.numel, q.dtype, {});
  T rot = fresh(q.numel, q.dtype);
  if (q.requires_grad()) {
    requires_grad(rot);
    Node& nd = open_node(rot);
    nd.inputs.push_back(pass_to(neg));
    nd.inputs.push_back(pass_to(x1));
    t_.close_node();
  }
  t_.drop(neg);
  t_.drop(x2);
  t_.drop(x1);
  T b = times_table(rot, sin_);
  t_.drop(rot);
  T y = add(a, b);
  t_.drop(a);
  t_.drop(b);
  y.bshd = q.bshd;  // elementwise outputs follow their strided input's layout
  return y;
}

// repeat_kv: expand + reshape copies K/V up to the query heads (no copy when groups == 1). With
// one key/value head (a TP rank's) the reshape merges that head's dimension of size 1 away and
// is a view, the heads of stride 0: no copy here, and matmul's fold copies it instead where b > 1
// (measured: eager attention on a rank of a 2-KV-head Llama, both K's and V's copies made at their
// matmuls). Backward, expand's sum makes the one head's gradient either way.
T StepBuilder::repeat_kv(const T& x) {
  const std::uint64_t groups = a_.num_heads / a_.num_kv_heads;
  if (groups == 1) return t_.ref(x);
  if (a_.num_kv_heads == 1) {
    T r = view_of(x, x.numel * groups);
    r.expanded = true;
    return r;
  }
  return elementwise({&x}, x.numel * groups, x.dtype, {});
}

// matmul of 4-D operands folds [b, heads] into one batch dimension with reshape before bmm.
// An operand laid out as [b, s, heads, d] (a projection view, or an elementwise result that
// kept its layout), or expanded over the heads (repeat_kv of one head), folds as a view only
// when b == 1; otherwise reshape copies it, and bmm
// saves the copy instead of the operand (checked with torch 2.13: expand + view for b = 1,
// expand + clone + _unsafe_view for b = 2). Returns what bmm takes: the copy, or x itself. In
// backward the clone hands bmm's gradient on, laid out [b, heads, s, d] (measured: Llama eager at
// b = 2 makes nothing there); a reshape further up copies it where that layout does not fold
// back (Note [Attention layouts]).
T StepBuilder::fold_for_bmm(const T& x) { return (x.bshd || x.expanded) && B_ > 1 ? handing_on(x) : t_.ref(x); }

// torch.matmul(a, b) of 4-D operands in dtype c: autocast casts the arguments last to first
// (Note [Autocast's weight casts]), matmul folds each for bmm (fold_for_bmm), and
// the casts and copies are the call's temporaries, gone once it returns (bmm saves what it
// needs; measured: eager attention under bf16-mixed at b = 2).
T StepBuilder::matmul(const T& a, const T& b, std::uint64_t out_numel, DType c) {
  T bc = autocast_arg(b, c);
  T ac = autocast_arg(a, c);
  T af = fold_for_bmm(ac);
  T bf = fold_for_bmm(bc);
  ensure_workspace(false);
  T out = bmm(af, bf, out_numel, c);
  for (T* x : {&af, &bf, &ac, &bc}) t_.drop(*x);
  return out;
}

T StepBuilder::attention_core(T& q, T& k, T& v) {
  const std::uint64_t heads = a_.num_heads, d = a_.head_dim;
  const std::uint64_t qn = tok_ * heads * d;
  const std::uint64_t scores = B_ * heads * S_ * S_;
  const DType c = pol_.autocast ? pol_.compute : q.dtype;
  if (attention_ == Attention::kEager) {
    op("self_attn.attn_weights");
    // eager_attention_forward's Python names decide what lives, with saves or without
    // (measured: bf16-mixed at b = 2, where the saved tensors are casts): the repeated K and V
    // until it returns, the scores until the probabilities replace them, the returned
    // probabilities (the layer's `_`) to the layer's end.
    T kr = repeat_kv(k);
    T vr = repeat_kv(v);
    T s0 = matmul(q, kr, scores, c);  // q @ k^T
    T s1 = elementwise({&s0}, scores, c, {});  // * scaling
    t_.drop(s0);
    if (a_.attn_logit_softcap > 0) {  // Gemma-2: s / cap, tanh (saves output), * cap
      T d1 = elementwise({&s1}, scores, c, {});
      t_.drop(s1);
      T th = elementwise({&d1}, scores, c, {}, {}, /*save_output=*/true);
      t_.drop(d1);
      s1 = elementwise({&th}, scores, c, {});
      t_.drop(th);
    }
    T s2 = add(s1, mask_);  // + causal mask (promotes to the mask dtype)
    t_.drop(s1);
    op("self_attn.softmax");
    T s32 = to(s2, DType::kF32);
    T p32 = softmax(s32);
    t_.drop(s32);
    T p = to(p32, q.dtype);  // .to(query.dtype): fp32 under autocast, so a no-op there
    t_.drop(p32);
    t_.drop(s2);
    T pd = dropout(p, a_.attn_dropout);  // attention_dropout, rebinding attn_weights
    t_.drop(p);
    p = pd;
    op("self_attn.attn_output");
    T o = bmm_output(matmul(p, vr, qn, c));  // probs @ v
    attn_weights_ = p;
    T oc = heads_last(o, /*copied=*/false);
    t_.drop(kr);
    t_.drop(vr);
    return oc;
  }
  // SDPA / flash-attention: q, k, v (as passed), the output and the fp32 log-sum-exp are
  // saved; scores never exist. Without a mask HF passes native GQA (enable_gqa) where the head
  // dim is at most 256 (use_gqa_in_sdpa). With one (a sliding window reached, or padding: Notes
  // [Training masks], [Padding masks] in step.cpp), or a wider head, it repeats K and V first (a
  // single query token packs the heads instead: views), and SDPA turns a bool mask into a float
  // one of q's dtype (where with two 0-dim scalars) that the kernel saves; the repeated K and V
  // live until sdpa_attention_forward returns.
  const bool masked = mask_.id != kNone;
  const bool repeated = sdpa_repeats_kv(masked, S_);
  const bool gpt2 = a_.family == Family::kGpt2;
  const bool math = sdpa_math_kernel();
  op(gpt2 ? (math ? "attn.sdpa_math" : "attn.sdpa") : (math ? "self_attn.sdpa_math" : "self_attn.sdpa"));
  const bool gqa_native = !repeated && a_.num_kv_heads != a_.num_heads;
  T kr = repeated ? repeat_kv(k) : T{};
  T vr = repeated ? repeat_kv(v) : T{};
  const T& kin = repeated ? kr : k;
  const T& vin = repeated ? vr : v;
  // autocast casts the arguments last to first (Note [Autocast's weight casts]).
  T vc = autocast_arg(vin, c), kc = autocast_arg(kin, c), qc = autocast_arg(q, c);
  if (r_.cp > 1) return ring_attention_core(q, qc, kc, vc);  // never masked (step.cpp refuses it)
  T fmask = masked ? where_of_scalars(B_ * S_ * S_, c) : T{};
  if (math) {
    T o = math_kernel(qc, kc, vc, fmask);
    for (T* x : {&fmask, &qc, &kc, &vc}) {
      if (x->id != kNone) t_.drop(*x);
    }
    o = heads_last(o, /*copied=*/false);
    if (repeated) {
      t_.drop(kr);
      t_.drop(vr);
    }
    return o;
  }
  // See Note [SDPA kernels on CUDA] (step_builder.h).
  const SdpaKernel kernel = sdpa_kernel(c, masked, a_.attn_dropout, S_);
  auto round_up = [](std::uint64_t n, std::uint64_t m) { return (n + m - 1) / m * m; };
  // The memory-efficient kernel pads its log-sum-exp's rows to a multiple of 32 (kAlignLSE).
  const std::uint64_t lse_rows = kernel == SdpaKernel::kEfficient ? round_up(S_, 32) : S_;
  auto [o, lse, seed, offset] = sdpa_outputs(qn, B_ * heads * lse_rows, c, !no_grad_, kernel);
  if (qc.requires_grad() || kc.requires_grad() || vc.requires_grad()) {
    requires_grad(o);
    Node& nd = open_node(o);
    nd.saved = {qc.id, kc.id, vc.id, o.id};
    if (lse.id != kNone) nd.saved.push_back(lse.id);
    if (seed.id != kNone) nd.saved.insert(nd.saved.end(), {seed.id, offset.id});
    if (fmask.id != kNone) nd.saved.push_back(fmask.id);
    // dq, dk, dv in that order (the profiler's allocation records of the CPU kernel, untracked;
    // the order it returns them in, which the tracker records). On the CPU
    // (_scaled_dot_product_flash_attention_for_cpu_backward) the tracker sees them only
    // (measured: the SDPA backward of the cpu-tp2dp2sp-*-b2s64 traces, native GQA).
    for (const T* x : {&qc, &kc, &vc}) nd.inputs.push_back(fused_grad_of(*x));
    if (kernel == SdpaKernel::kCudnn) {
      nd.scratch = {qn * 4 + B_ * heads * S_ * 4};
    } else if (cuda_) {
      // Flash's (mha_bwd): grad_out's copy, fp32 dq_accum [b, s rounded to 128, heads, d rounded
      // to 32 (64 past 128)] and softmax_d [b, heads, s rounded to 128]; the memory-efficient
      // kernel's taken as the same buffers, unrounded.
      const bool flash = kernel == SdpaKernel::kFlash;
      const std::uint64_t rows = flash ? round_up(S_, 128) : S_;
      const std::uint64_t dims = flash ? round_up(a_.head_dim, a_.head_dim <= 128 ? 32 : 64) : a_.head_dim;
      nd.scratch = {qn * dtype_bytes(c), B_ * rows * heads * dims * 4, B_ * heads * rows * 4};
      if (gqa_native) nd.scratch.insert(nd.scratch.end(), {qn * dtype_bytes(c), qn * dtype_bytes(c)});
    }
    t_.close_node();
  }
  for (T* x : {&lse, &seed, &offset}) {  // the kernel's tuple goes in its order
    if (x->id != kNone) t_.drop(*x);
  }
  if (fmask.id != kNone) t_.drop(fmask);
  t_.drop(qc);
  t_.drop(kc);
  t_.drop(vc);
  // The flash kernels allocate their output with q's layout. When q is laid out as
  // [b, s, heads, d] (a projection view), HF's transpose(1, 2).contiguous() is a no-op and
  // o_proj saves the very storage SDPA saved; otherwise (Phi-3's cat) it copies.
  if (!q.bshd) o = heads_last(o, /*copied=*/false);
  if (repeated) {
    t_.drop(kr);
    t_.drop(vr);
  }
  return o;
}

// Context parallelism's SDPA: the ring under the DTensor dispatch, one autograd node above it
// saving what SDPA saves (See Note [Context parallelism]). q, k, v are the local chunks.
T StepBuilder::ring_attention_core(const T& q, T& qc, T& kc, T& vc) {
  RingAttention ring;
  ring.cp = r_.cp;
  ring.rank = r_.cp - 1;  // the last rank of the group (the Note's worst rank)
  ring.q_numel = qc.numel;
  ring.kv_numel = kc.numel;
  ring.lse_numel = B_ * a_.num_heads * S_;
  ring.dtype = qc.dtype;
  ring.gqa = a_.num_kv_heads != a_.num_heads;
  const auto [out_id, lse_id] = ring_attention_forward(t_, ring);
  T o;
  o.id = out_id;
  o.numel = qc.numel;
  o.dtype = qc.dtype;
  T lse;
  lse.id = lse_id;
  lse.numel = ring.lse_numel;
  lse.dtype = DType::kF32;
  if (qc.requires_grad() || kc.requires_grad() || vc.requires_grad()) {
    requires_grad(o);
    Node nd = node(o);
    nd.saved = {qc.id, kc.id, vc.id, o.id, lse.id};
    for (const T* x : {&qc, &kc, &vc}) nd.inputs.push_back(grad_of(*x));
    Tape* tape = &t_;
    nd.kernel = [tape, ring](Node& n, std::vector<TensorId>& left) { ring_attention_backward(*tape, ring, n, left); };
    t_.record(std::move(nd));
  }
  t_.drop(lse);
  t_.drop(qc);
  t_.drop(kc);
  t_.drop(vc);
  if (q.bshd && !ring.output_contiguous()) return o;
  return heads_last(o, /*copied=*/true);
}

// Note [GPT-2 attention]
// q, k and v are strided views into the Conv1D output (split + view + transpose), which
// changes what the kernels copy and save (transformers models/gpt2/modeling_gpt2.py):
//  * eager: matmul reshapes each strided operand for bmm, so with b > 1 q, k^T and v are
//    copied and the copies saved (b = 1: the views, so the Conv1D output; fold_for_bmm);
//    softmax takes no dtype argument (CUDA autocast runs it in fp32, CPU autocast in the
//    input dtype), .type(value.dtype) casts back, and attention dropout (attn_pdrop, 0.1 by
//    default) runs in training; the output is transposed and copied.
//  * sdpa on CUDA, or on the CPU with attn_pdrop 0: a fused kernel takes the views (their
//    storage, the Conv1D output, is what stays saved); the output needs no copy.
//  * sdpa on CPU with dropout: no fused kernel takes dropout, so the math kernel runs: half
//    inputs are upcast to fp32 (copies in the same layout), q and k^T are scaled separately (the
//    products keep their operand's layout) and folded for bmm as in eager, the causal mask
//    is built as [s, s] bool and float, softmax and the dropout noise and output
//    are saved, and the result is cast back.
T StepBuilder::gpt2_attention_core(T& q, T& k, T& v) {
  const std::uint64_t heads = a_.num_heads;
  const std::uint64_t qn = q.numel, scores = B_ * heads * S_ * S_;
  // The compute dtype: the Conv1D output's, but for a 4-bit base's fp32 output under autocast.
  const DType c = pol_.autocast ? pol_.compute : q.dtype;
  if (attention_ == Attention::kEager) {
    op("attn.attn_weights");
    T s0 = matmul(q, k, scores, c);
    T s1 = elementwise({&s0}, scores, c, {});  // * scaling
    t_.drop(s0);
    T s2 = add(s1, mask_);
    t_.drop(s1);
    op("attn.softmax");
    const DType sd = (pol_.autocast && cuda_) ? DType::kF32 : s2.dtype;
    T sin = to(s2, sd);
    t_.drop(s2);
    T p = softmax(sin);
    t_.drop(sin);
    T pv = to(p, v.dtype);  // .type(value.dtype)
    t_.drop(p);
    T pd = dropout(pv, a_.attn_dropout);  // attn_dropout, rebinding attn_weights
    t_.drop(pv);
    op("attn.attn_output");
    T o = bmm_output(matmul(pd, v, qn, c));
    attn_weights_ = pd;  // GPT2Block's `_` holds the returned weights to its end
    return heads_last(o, /*copied=*/false);  // transpose(1, 2).reshape(...).contiguous()
  }
  // SDPA as for the other families: a fused kernel (CUDA's take dropout, the CPU's flash kernel
  // only p = 0), whose output needs no copy (q is laid out as [b, s, heads, d]), or the CPU's
  // math kernel.
  return attention_core(q, k, v);
}

// aten _scaled_dot_product_attention_math with is_causal as its locals run, measured on the
// CPU (GPT-2 in fp32 and bf16-mixed, with and without saves: the same ops, the saves decide the
// rest; the Llama family with attention_dropout): the fp32 copies of half inputs first
// (query_acc, key_acc, value_acc, kept to the end); q is scaled and lives to the end; the causal
// mask is ones, tril and a where with two 0-dim scalars; with GQA (enable_gqa) K and V are
// repeated (unsqueeze, expand, clone: contiguous copies at the query head count, kept to the
// end); k^T is scaled and both are copied for bmm where their layout needs it (b > 1); the mask
// is added; softmax, dropout; v copied for the second bmm likewise; the returned tuple's casts
// back; then the locals go. A cast keeps its operand's order of strides (preserve_format), a
// slice of a fused projection's too (GPT-2's q, k, v; Phi-3's v), so the fp32 copies fold for bmm
// as their inputs would (measured: bf16-mixed GPT-2 and Phi-3 at b = 2). The add is out of place
// because the measuring side's TorchDispatchMode makes areAnyTensorSubclassLike true: an
// untracked CPU run adds in place and has one scores-sized tensor less at that moment. The
// engine follows what the corpus measures; CUDA never runs this kernel here (the fused kernels
// take dropout). With a padding mask (Note [Padding masks] in step.cpp) HF has repeated K and V
// and SDPA has made the float mask (`attn_mask`, its caller's) before the kernel runs: no causal
// mask and no GQA copies inside; the kernel adds the given one (measured: GPT-2 and Llama with
// attention_dropout, fp32 and bf16-mixed).
T StepBuilder::math_kernel(T& q, T& k, T& v, const T& attn_mask) {
  const std::uint64_t qn = q.numel, scores = B_ * a_.num_heads * S_ * S_;
  const bool given = attn_mask.id != kNone;
  const std::uint64_t groups = given ? 1 : a_.num_heads / a_.num_kv_heads;  // given: K/V repeated already
  const DType c = q.dtype, md = DType::kF32;
  T qa = to(q, md), ka = to(k, md), va = to(v, md);  // query_acc, key_acc, value_acc
  T qs = elementwise({&qa}, qn, md, {});               // q * sqrt(scale)
  qs.bshd = q.bshd;
  T fmask;
  if (given) {
    fmask = t_.ref(attn_mask);
  } else {
    T ones = fresh(S_ * S_, DType::kU8);
    T tril = fresh(S_ * S_, DType::kU8);
    t_.drop(ones);
    fmask = where_of_scalars(S_ * S_, md);
    t_.drop(tril);
  }
  T ke = t_.ref(ka), ve = t_.ref(va);  // key_expanded, value_expanded
  ke.bshd = k.bshd;
  ve.bshd = v.bshd;
  if (groups > 1) {
    t_.drop(ke);
    t_.drop(ve);
    ke = elementwise({&ka}, ka.numel * groups, md, {});
    ve = elementwise({&va}, va.numel * groups, md, {});
  }
  T ks = elementwise({&ke}, qn, md, {});  // k^T * sqrt(scale)
  ks.bshd = ke.bshd;
  T qc = fold_for_bmm(qs);
  T kc = fold_for_bmm(ks);
  ensure_workspace(false);
  T sc = bmm(qc, kc, scores, md);
  t_.drop(kc);
  t_.drop(qc);
  t_.drop(ks);
  T sa = add(sc, fmask);  // out of place under the tracker: see the comment above
  t_.drop(sc);
  T p = softmax(sa);  // _safe_softmax
  t_.drop(sa);
  T pd = dropout(p, a_.attn_dropout);
  t_.drop(p);
  // return make_tuple(matmul(attn, v).to(origin), attn.to(origin)): the second element first.
  T pw = to(pd, c);
  T vc = fold_for_bmm(ve);
  T o = bmm_output(bmm(pd, vc, qn, md));
  t_.drop(vc);
  T oc = to(o, c);
  // The kernel returns: its locals go, then the caller drops the weights it does not use.
  for (T* local : {&qs, &fmask, &pd, &o, &ke, &ve, &va, &ka, &qa, &pw}) t_.drop(*local);
  return oc;
}

// The attention function's transpose(1, 2).contiguous() of the [b, heads, s, d] attention output
// (after SDPA has returned, its arguments' casts gone). In backward the copy hands its gradient on,
// transposed, laid out [b, s, heads, d]: where bmm made the output (eager attention, the math
// kernel) bmm_output's view copies it, and the fused kernels' backwards take it as it is (measured:
// Phi-3, whose cat makes q contiguous, with SDPA on the CPU). The ring's backward is not measured:
// `copied` keeps a copy there. With one head (a rank's) or one token the transpose is contiguous
// already and .contiguous() returns it (measured: a 2-head Llama on 2 ranks, eager).
T StepBuilder::heads_last(T o, bool copied) {
  if (!copied && !heads_layout_differs(a_.num_heads)) return o;
  T out = copied ? elementwise({&o}, o.numel, o.dtype, {}) : handing_on(o);
  t_.drop(o);
  return out;
}

// matmul's view of bmm's [b·heads, s, d] attention output as [b, heads, s, d]. Its backward
// reshapes the gradient that the output's transpose handed on, laid out [b, s, heads, d]: a copy
// for b > 1, a view for b = 1, and after the math kernel's cast back to the input dtype, in bmm's
// dtype (measured: GPT-2 and Llama at b = 2 and b = 1, fp16-mixed GPT-2). One head or one token:
// a view too.
T StepBuilder::bmm_output(T o) {
  if (B_ == 1 || !heads_layout_differs(a_.num_heads) || !o.requires_grad()) return o;
  T v = view_of(o, o.numel);
  t_.drop(o);
  return v;
}

T StepBuilder::attention(const T& x, const LayerParams& lp) {
  const std::uint32_t m = container_enter(Container::kAttention);
  const bool dtensor = dtensor_;
  dtensor_ = false;  // the projections hand on local tensors (See Note [Sequence parallelism])
  T y = attention_module(x, lp);
  dtensor_ = dtensor;
  module_exit(m);
  return y;
}

T StepBuilder::attention_module(const T& x, const LayerParams& lp) {
  const std::uint64_t heads = a_.num_heads, kvh = a_.num_kv_heads, d = a_.head_dim;
  const std::uint64_t qw = heads * d, kvw = kvh * d;
  const bool gpt2 = a_.family == Family::kGpt2;
  // proj(x).view(b, s, heads, d): reshaping its gradient back copies it (clone) when that
  // gradient is laid out [b, heads, s, d] (Note [Attention layouts]): q's and k's always in the
  // rotary families, made by the rotary embedding's backward (slice_backward's zeros); v's (and
  // GPT-2's q) where a bmm makes it (eager attention, the CPU's math kernel) or the sum over K
  // and V's repetition (SDPA with a mask and fewer K/V heads than q's). GPT-2's k never: bmm makes
  // k^T's gradient laid out [b, heads, d, s], which folds back. Measured on the CPU: the flash
  // kernel hands the gradients back in their inputs' layout, no copy; the ring's is not measured
  // (no copy modelled). With one head of `n` (a rank's one key/value head under TP) or one token
  // the two layouts are the same and the reshape is a view (measured: a TP rank of a 2-KV-head
  // Llama, tests/python/test_measure_parallel.py).
  auto heads_view = [&](T p, std::uint64_t n, bool copies) {
    if (!copies || !heads_layout_differs(n)) return p;
    op(gpt2 ? "attn.clone" : "self_attn.clone");  // the copy's name in measured traces
    T h = view_of(p, p.numel);
    t_.drop(p);
    return h;
  };
  const bool bmm_grads = r_.cp == 1 && (attention_ == Attention::kEager || sdpa_math_kernel());
  const bool repeated = sdpa_repeats_kv(mask_.id != kNone, S_) && kvh != heads;
  const bool v_copies = bmm_grads || (r_.cp == 1 && attention_ == Attention::kSdpa && repeated);
  T q, k, v;
  if (gpt2) {
    // c_attn(x).split(split_size, dim=2): one SplitBackward, whose backward concatenates the three
    // gradients. GPT2Attention views key, value, then query, so query's copy runs first in
    // backward (measured, fp32 with the math kernel: q's copy, v's copy, then the cat).
    T qkv = proj(x, "attn.c_attn", lp.qkv, lp.qkv_b, qw + 2 * kvw);
    auto [sq, sk, sv] = split3(qkv, qw, kvw, kvw);
    t_.drop(qkv);
    k = heads_view(sk, kvh, false);
    v = heads_view(sv, kvh, bmm_grads);
    q = heads_view(sq, heads, bmm_grads);
  } else if (lp.qkv != kNone) {
    // Phi-3 slices qkv_proj's output (qkv[..., :query_pos] and so on): each slice's backward
    // makes a full-size zero gradient of the fused output (SliceBackward), summed into one. The
    // three slices come first, then their views (measured: v's, k's and q's copies, then the
    // slices' gradients).
    T qkv = proj(x, "self_attn.qkv_proj", lp.qkv, lp.qkv_b, qw + 2 * kvw);
    T sq = slice(qkv, qw), sk = slice(qkv, kvw), sv = slice(qkv, kvw);
    t_.drop(qkv);
    q = heads_view(sq, heads, true);
    k = heads_view(sk, kvh, true);
    v = heads_view(sv, kvh, v_copies);
  } else {
    // Qwen3 normalises each projection over head_dim as soon as it is made (q_norm(q_proj(x)),
    // then k_norm(k_proj(x)), then v_proj(x)): that order of creation is the backward's reverse
    // (measured: v_proj's weight gradient comes first, then k_norm's, k_proj's, q_norm's).
    auto normed = [&](T p, std::uint32_t w, std::uint64_t rows, const char* name) {
      if (w == kNone) return p;
      T n = rms_norm(p, w, rows, name);
      t_.drop(p);
      return n;
    };
    q = normed(heads_view(proj(x, "self_attn.q_proj", lp.q, lp.q_b, qw), heads, true), lp.q_norm, tok_ * heads,
               "self_attn.q_norm");
    k = normed(heads_view(proj(x, "self_attn.k_proj", lp.k, lp.k_b, kvw), kvh, true), lp.k_norm, tok_ * kvh,
               "self_attn.k_norm");
    v = heads_view(proj(x, "self_attn.v_proj", lp.v, lp.v_b, kvw), kvh, v_copies);
  }
  // Note [Attention layouts]: q, k, v are views (view + transpose) of the projection outputs
  // (q and k normalised over head_dim before the transpose, Qwen3), laid out as [b, s, heads, d];
  // rope keeps that layout, Phi-3's cat and repeat_kv make contiguous [b, heads, s, d] tensors.
  // Whether eager matmul copies an operand, and whether the attention output needs a copy,
  // follows from it.
  q.bshd = heads_layout_differs(heads);
  k.bshd = v.bshd = heads_layout_differs(kvh);
  if (a_.family != Family::kGpt2) {
    op("self_attn.rotary");
    // Phi-3 rotates the first rotary_dim channels and concatenates the rest (empty with
    // partial_rotary_factor 1.0): torch.cat copies the rotated q and k once more. q[..., :rotary_dim]
    // spans q, so indexing returns q itself; q[..., rotary_dim:] is an empty slice, whose backward
    // still makes a q-sized gradient (slice_backward's zeros), and both q's and k's slices are taken
    // before either is rotated (measured: their two slice_backwards after both rotations). The
    // caller's query_states and key_states hold q and k until apply_rotary_pos_emb returns both.
    const bool phi3 = a_.family == Family::kPhi3;
    T q_pass = phi3 ? view_of(q, 0) : T{}, k_pass = phi3 ? view_of(k, 0) : T{};
    auto rotate = [&](const T& x, const T& pass) {
      T r = rope(x);
      if (phi3) {
        T c = fresh(r.numel, r.dtype);
        if (r.requires_grad()) {
          requires_grad(c);
          Node nd = node(c);
          nd.inputs.push_back(pass_to(r));  // CatBackward hands on narrowed views
          // q_pass's, unless cat promoted it (the fp32 rotation under autocast): validate_outputs
          // then casts the empty view, a new tensor of no bytes, and lets the gradient go (measured:
          // Phi-3 bf16-mixed).
          nd.inputs.push_back(pass.dtype == c.dtype ? pass_to(pass) : GradIn{pass.value, 0, false});
          t_.record(std::move(nd));
        }
        t_.drop(r);
        r = c;
      }
      return r;
    };
    T rq = rotate(q, q_pass);
    T rk = rotate(k, k_pass);
    if (phi3) {
      t_.drop(q_pass);
      t_.drop(k_pass);
    }
    t_.drop(q);
    t_.drop(k);
    q = rq;
    k = rk;
  }
  if (r_.use_cache) {
    op(a_.family == Family::kGpt2 ? "attn.cache_update" : "self_attn.cache_update");
    if (cuda_) sliding_window_tensors(layer_);
    k = cache_update(k);
    v = cache_update(v);
  }
  T o = a_.family == Family::kGpt2 ? gpt2_attention_core(q, k, v) : attention_core(q, k, v);
  T y = proj(o, a_.family == Family::kGpt2 ? "attn.c_proj" : "self_attn.o_proj", lp.o, lp.o_b,
             a_.hidden_size);
  t_.drop(o);
  if (a_.family == Family::kGpt2) y = residual_dropout(y, Container::kAttnDropout);
  // The module's locals go when it returns (Note [Forwards without saves] in tape.h).
  t_.drop(q);
  t_.drop(k);
  t_.drop(v);
  return y;
}

// Note [A cache in training]
// A training forward with use_cache true (the config's default: transformers turns it off only
// under checkpointing, utils/generic.py) makes a DynamicCache, and each attention hands its keys
// and values to DynamicLayer.update (cache_utils.py), whose torch.cat onto an empty tensor copies
// them, contiguous [b, heads, s, d]; the attention then runs on the copies (CatBackward hands the
// gradient on as views) and the originals go. The cache, and so the copies, live in the model's
// output until it is dropped before backward. Under SDPA over the key/value heads the copies are
// what it saves anyway; where eager attention (or SDPA past head_dim 256) repeats them, they
// are extra to the loss. A sliding-window layer's DynamicSlidingWindowLayer makes the same copies
// and keeps a slice of them, a view that holds them whole. Under ZeRO the same (DeepSpeed's hooks
// gather parameters, not activations). Liger's fused-loss forward keeps the base model's output,
// the cache in it, through the loss and returns it beside the loss, so the copies live through
// the loss there too. Measured: cpu-*-usecache-*.
// Each DynamicSlidingWindowLayer makes torch.tensor(sliding_window) when the cache is made (after
// the embedding): a 0-dim int64 in host memory, which lazy_initialization moves to the device at
// the layer's first update. Host memory is the device on the CPU; on CUDA the copy comes then.
void StepBuilder::sliding_window_tensors(std::int32_t layer) {
  for (std::size_t l = 0; l < window_.size(); ++l) {
    if (window_[l] == 0 || (layer >= 0 && l != static_cast<std::size_t>(layer))) continue;
    cache_.push_back(t_.alloc_bytes(8, Category::kTemporaries));
  }
}

T StepBuilder::cache_update(T x) {
  T c = handing_on(x);  // contiguous [b, heads, s, d]; CatBackward hands the gradient on
  t_.drop(x);
  t_.retain(c.id);
  cache_.push_back(c.id);
  return c;
}

T StepBuilder::slice(const T& fused, std::uint64_t width) { return view_of(fused, tok_ * width); }

// fused.split(...) into pieces of tok_ * width elements (width 0: no third piece): views of
// `fused` with one SplitBackward node, which runs once all the pieces' gradients have come and
// concatenates them into a gradient of fused's size (split_backward's cat), then frees them.
std::tuple<T, T, T> StepBuilder::split3(const T& fused, std::uint64_t w0, std::uint64_t w1, std::uint64_t w2) {
  const std::uint64_t widths[3] = {w0, w1, w2};
  T p[3];
  for (int k = 0; k < 3; ++k) {
    if (widths[k] == 0) continue;
    p[k] = alias(fused, tok_ * widths[k]);
    if (fused.requires_grad()) requires_grad(p[k]);
  }
  if (fused.requires_grad()) {
    Node& nd = open_node(p[0]);
    for (int k = 1; k < 3; ++k) {
      if (p[k].value != kNone) nd.co_outputs.push_back(p[k].value);
    }
    nd.inputs.push_back(GradIn{fused.value, fused.bytes(), false});
    t_.close_node();
  }
  return {p[0], p[1], p[2]};
}

// `numel` elements of base's storage, with no gradient of its own.
T StepBuilder::alias(const T& base, std::uint64_t numel) {
  T v;
  v.id = base.id;
  t_.retain(v.id);
  v.dtype = base.dtype;
  v.numel = numel;
  return v;
}

// A module's input as its forward sees it when something wraps it on the way in: an alias of x with
// a gradient of its own, handed on to x by a node that does nothing else. DTensor.from_local
// under TP (`unwrap`: the local tensor goes on, a plain one), and DeepSpeed ZeRO-3's
// PostBackwardFunctionModule on every module's inputs, whose backward runs the module's
// post-backward hook (Tape::route_after_module_ends). The uses inside the module sum their
// gradients in that buffer, apart from the uses outside (measured: a ZeRO-3 Llama in fp32, the
// norm's pow and product summed before the residual's).
T StepBuilder::module_input(const T& x, bool unwrap) {
  T xd = t_.ref(x);
  if (!x.requires_grad()) return xd;
  requires_grad(xd);
  Node& nd = open_node(xd);
  GradIn g = pass_to(x);
  g.unwrap = unwrap;
  nd.inputs.push_back(g);
  t_.close_node();
  return xd;
}

T StepBuilder::view_of(const T& base, std::uint64_t numel) {
  T v = alias(base, numel);
  if (!base.requires_grad()) return v;
  requires_grad(v);
  Node nd = node(v);
  nd.inputs.push_back(GradIn{base.value, base.bytes(), false});
  t_.record(std::move(nd));
  return v;
}

T StepBuilder::mlp(const T& x, const LayerParams& lp) {
  const std::uint32_t m = container_enter(Container::kMlp);
  const bool dtensor = dtensor_;
  dtensor_ = false;  // See Note [Sequence parallelism]
  T y = mlp_module(x, lp);
  dtensor_ = dtensor;
  module_exit(m);
  return y;
}

T StepBuilder::mlp_module(const T& x, const LayerParams& lp) {
  const std::uint64_t i = a_.intermediate_size, n = tok_ * i;
  if (!a_.gated_mlp) {  // GPT-2: c_fc, gelu_new, c_proj
    T h = proj(x, "mlp.c_fc", lp.up, lp.up_b, i);
    op("mlp.act");
    const std::uint32_t act = container_enter(Container::kAct);
    T g = act_fn(h);
    module_exit(act);
    t_.drop(h);
    T y = proj(g, "mlp.c_proj", lp.down, lp.down_b, a_.hidden_size);
    t_.drop(g);
    return residual_dropout(y, Container::kMlpDropout);  // GPT2MLP's dropout
  }
  T gate, up;
  if (lp.gate_up != kNone) {
    // Phi-3's up_states.chunk(2, dim=-1) is a split: one node, whose backward concatenates.
    T gu = proj(x, "mlp.gate_up_proj", lp.gate_up, kNone, 2 * i);
    std::tie(gate, up, std::ignore) = split3(gu, i, i, 0);
    t_.drop(gu);
  } else {
    gate = proj(x, "mlp.gate_proj", lp.gate, lp.gate_b, i);
  }
  op("mlp.act_fn");
  const std::uint32_t act_module = container_enter(Container::kAct);
  T act = act_fn(gate);
  module_exit(act_module);
  // act_fn(gate_proj(x)): nothing but the activation's node holds the gate once it returns (under
  // checkpointing not even that: measured, ZeRO-3 with checkpointing peaks here). Phi-3's `gate`
  // chunk holds the fused output until the MLP returns (Note [Forwards without saves]).
  const bool gate_local = lp.gate_up != kNone;
  if (!gate_local) t_.drop(gate);
  if (lp.gate_up == kNone) {
    up = proj(x, "mlp.up_proj", lp.up, lp.up_b, i);
  }
  op("mlp.act_fn*up");
  T prod = mul(act, up, n, promote(act.dtype, up.dtype));
  t_.drop(act);
  t_.drop(up);
  T y = proj(prod, "mlp.down_proj", lp.down, lp.down_b, a_.hidden_size);
  t_.drop(prod);
  if (gate_local) t_.drop(gate);
  return y;
}

// The config's activation (Activation in trainmem.h): silu and gelu are one op that saves its
// input, relu (nn.ReLU) one that saves its output (threshold_backward reads the result);
// gelu_new, NewGELUActivation (GPT-2's default), spells the tanh approximation out in
// elementwise ops that save more (x, x^3 terms, tanh output). Found by a probe: a Llama cut with
// gelu_new was 20 % low and a GPT-2 cut with gelu_pytorch_tanh 20 % high while the family chose.
T StepBuilder::act_fn(const T& x) {
  if (a_.activation == Activation::kGeluNew) {
    // 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), in Python's order: 0.5 * x first
    // (measured with and without saves; Note [Forwards without saves] in tape.h).
    // The backward as the generated nodes compute it (measured, GPT-2 fp32 traces): pow's
    // grad * (3 * x.pow(2)) makes two temporaries before the product, `1.0 + tanh` hands its
    // gradient on, and the final product makes the tanh branch's gradient first.
    const std::uint64_t nb = x.bytes();
    T hx = elementwise({&x}, x.numel, x.dtype, {});                // 0.5 * x
    T x3 = elementwise({&x}, x.numel, x.dtype, {x.id}, {nb, nb});  // pow(x, 3)
    T m1 = elementwise({&x3}, x.numel, x.dtype, {});               // * 0.044715
    t_.drop(x3);
    T s = add(x, m1);
    t_.drop(m1);
    T m2 = elementwise({&s}, x.numel, x.dtype, {});                // * sqrt(2/pi)
    t_.drop(s);
    T th = elementwise({&m2}, x.numel, x.dtype, {}, {}, /*save_output=*/true);  // tanh
    t_.drop(m2);
    T p1 = handing_on(th);                                         // 1 + tanh
    t_.drop(th);
    T y = mul(hx, p1, x.numel, x.dtype);
    t_.drop(hx);
    t_.drop(p1);
    return y;
  }
  if (a_.activation == Activation::kRelu) {
    return elementwise({&x}, x.numel, x.dtype, {}, {}, /*save_output=*/true);
  }
  return elementwise({&x}, x.numel, x.dtype, {x.id});
}

T StepBuilder::decoder_layer(const T& x, std::uint32_t l) {
  layer_ = static_cast<std::int32_t>(l);
  const std::uint32_t m = container_enter(Container::kLayer);
  T out = decoder_layer_module(x, l);
  module_exit(m);
  return out;
}

// A decoder layer as the block's Python names hold its tensors:
//  * the Llama family rebinds hidden_states to each sub-layer's output, so a norm's output goes
//    when its sub-layer returns;
//  * Phi-3 adds `residual + self.resid_*_dropout(hidden_states)`: the sub-layer's output keeps
//    its name until the add rebinds it (measured with resid_pdrop 0.1);
//  * GPT2Block names the sub-layers' outputs apart (attn_output, feed_forward_hidden_states), so
//    its hidden_states holds ln_1's (ln_2's) output until the add rebinds it (measured under
//    autocast, where the projections save a cast copy and nothing else holds it), and
//    attn_output lives to the block's return (the residual dropout's output outlives the MLP).
T StepBuilder::decoder_layer_module(const T& x, std::uint32_t l) {
  const LayerParams& lp = layers_[l];
  const bool gpt2 = a_.family == Family::kGpt2, phi3 = a_.family == Family::kPhi3;
  T n1 = gpt2 ? layer_norm(x, lp.in_norm, lp.in_norm_b, res_tok_, "ln_1")
              : rms_norm(x, lp.in_norm, res_tok_, "input_layernorm");
  T att = attention(n1, lp);  // GPT-2's residual dropout happens inside, as in GPT2Attention
  if (!gpt2) t_.drop(n1);
  att = post_norm(att, lp.post_attn_norm, "post_attention_layernorm");
  T attn_output = gpt2 || phi3 ? t_.ref(att) : T{};
  if (phi3) att = residual_dropout(att, Container::kAttnDropout);
  T h1 = residual_add(x, att);
  if (gpt2) t_.drop(n1);
  if (phi3) t_.drop(attn_output);
  T n2 = gpt2 ? layer_norm(h1, lp.post_attn_norm, lp.post_attn_norm_b, res_tok_, "ln_2")
              : rms_norm(h1, a_.sandwich_norms ? lp.pre_ff_norm : lp.post_attn_norm, res_tok_,
                         a_.sandwich_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm");
  T m = mlp(n2, lp);
  if (!gpt2) t_.drop(n2);
  m = post_norm(m, lp.post_ff_norm, "post_feedforward_layernorm");
  T mlp_output = phi3 ? t_.ref(m) : T{};
  if (phi3) m = residual_dropout(m, Container::kMlpDropout);
  T out = residual_add(h1, m);
  if (gpt2) t_.drop(n2);
  if (phi3) t_.drop(mlp_output);
  t_.drop(h1);
  if (gpt2) t_.drop(attn_output);
  if (attn_weights_.id != kNone) {  // the layer's `_` (eager attention)
    t_.drop(attn_weights_);
    attn_weights_ = T{};
  }
  return out;
}

// Gemma-2's sandwich norms: the sub-layer output is normalised again before the residual add
// (after the layer has rebound hidden_states, so the sub-layer's input is already dropped).
T StepBuilder::post_norm(T y, std::uint32_t norm, std::string_view name) {
  if (!a_.sandwich_norms) return y;
  T pn = rms_norm(y, norm, res_tok_, name);
  t_.drop(y);
  return pn;
}

// The nn.Dropout on a sub-layer's output: inside GPT-2's attention and MLP modules, in Phi-3's
// decoder layer (resid_attn_dropout, resid_mlp_dropout).
T StepBuilder::residual_dropout(T y, Container module) {
  T dr = dropout_module(y, a_.resid_dropout, module);
  t_.drop(y);
  return dr;
}

// An nn.Dropout module (or LoRA's nn.Identity, p = 0). Under ZeRO-3 its input goes through the
// Function DeepSpeed puts on every module's inputs (PostBackwardFunctionModule,
// StepBuilder::module_input), so the module has a node even where the dropout is a no-op that
// returns its input: DeepSpeed's Functions around it run its backward hooks all the same
// (measured: every lora_dropout Identity whose input requires grad is fetched, and recorded in
// the module order, in the backward).
T StepBuilder::dropout_module(const T& x, double p, Container kind, bool input_requires_grad, std::uint32_t sub) {
  const std::uint32_t m = container_enter(kind, input_requires_grad, sub);
  T xi = m != kNone ? module_input(x, /*unwrap=*/false) : t_.ref(x);
  T y = dropout(xi, p);
  t_.drop(xi);
  module_exit(m);
  return y;
}

// residual + branch; the branch output is dropped, the residual stays with the caller.
T StepBuilder::residual_add(const T& residual, T& branch) {
  op("residual_add");
  T sum = add(residual, branch);
  t_.drop(branch);
  return sum;
}

// GradientCheckpointingLayer: the forward keeps only the layer input; backward recomputes the
// layer (recording its nodes) and runs them, the non-reentrant way or, with full-reentrant,
// torch's reentrant CheckpointFunction (Note [Reentrant checkpoints] in tape.h).
T StepBuilder::checkpointed_layer(const T& x, std::uint32_t l) {
  t_.saving = false;
  std::size_t before = t_.node_count();
  const ValueId first_value = t_.value_count();
  const bool reentrant = r_.checkpointing == Checkpointing::kFullReentrant;
  no_grad_ = reentrant;
  T out = decoder_layer(x, l);
  no_grad_ = false;
  t_.saving = true;
  // ZeRO-3's hooks: the backward of the graph's tail, with its modules' hooks, runs before the
  // recompute (See Note [Checkpoint tails] in tape.h); where no tail can stand in for the
  // recomputed one, only the pre-backward fetches run before the recompute (Note [LoRA under
  // ZeRO-3]).
  std::shared_ptr<const CheckpointTail> tail;
  std::vector<std::uint32_t> hooks;
  if (dp_->zero3()) tail = t_.take_tail(before, out.value, first_value);
  if (dp_->zero3() && !tail) hooks = t_.recompute_hooks(before);
  // The nodes recorded without saves stand for the graph the checkpoint discards; replace
  // them by one checkpoint node (their grads flow through the recompute instead).
  drop_nodes_since(before);
  T y = out;
  requires_grad(y);
  Node nd = node(y);
  nd.tag.op = "checkpoint";
  // torch.utils.checkpoint (either variant) saves the positional tensor arguments (the hidden
  // states) with save_for_backward; the keyword arguments (mask, position embeddings,
  // position ids) are only referenced by the recompute closure (reentrant: by ctx).
  nd.saved = {x.id};
  nd.tail = std::move(tail);
  nd.reentrant = reentrant;
  // GPT2Model.forward hands its causal mask to each block positionally: the reentrant Function
  // saves it with the hidden states (measured: it goes with the first layer's backward).
  const bool positional_mask = reentrant && a_.family == Family::kGpt2 && mask_.id != kNone;
  if (positional_mask) nd.saved.push_back(mask_.id);
  for (const T* shared : {&cos_, &sin_, &mask_, &position_ids_}) {
    if (shared->id != kNone && !(shared == &mask_ && positional_mask)) nd.kept.push_back(shared->id);
  }
  T xin = x, cos = cos_, sin = sin_, mask = mask_;
  std::int32_t layer = static_cast<std::int32_t>(l);
  nd.recompute = [this, xin, cos, sin, mask, l, layer, hooks]() {
    if (!hooks.empty()) {
      t_.at(Phase::kBackward, layer, "checkpoint");
      t_.fire_before_recompute(hooks);
    }
    Phase keep = phase_;
    phase_ = Phase::kForward;  // labelled "recompute" (the tape knows it is recomputing)
    std::string_view keep_op = op_;
    cos_ = cos;
    sin_ = sin;
    mask_ = mask;
    const bool dtensor = dtensor_;
    dtensor_ = sp_ > 1;  // the layer's input is a DTensor shard (See Note [Sequence parallelism])
    T o = decoder_layer(xin, l);
    dtensor_ = dtensor;
    exit_autocast();  // the recompute runs in an autocast context of its own
    cos_ = sin_ = mask_ = T{};
    layer_ = layer;
    phase_ = keep;
    op_ = keep_op;
    return o;
  };
  t_.record(std::move(nd));
  return y;
}

void StepBuilder::drop_nodes_since(std::size_t n) { t_.truncate_nodes(n); }

}  // namespace trainmem::graph::step
