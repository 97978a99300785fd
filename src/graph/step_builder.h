// The step builder: one class that builds the event trace of one training step (or of one
// generate() call) op by op, as the Hugging Face modules run. Internal to src/graph; its methods
// are defined by concern: step.cpp (the constructor, the step, its forward, loss and backward),
// step_parameters.cpp (the parameter table and the LoRA adapters), step_modules.cpp (the ops and
// modules of the training forward), optimizer.cpp (the optimizer step) and generation.cpp
// (generate()). The helpers every op calls are defined here, so each file can inline them.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checked.h"
#include "graph/parallel.h"
#include "graph/pipeline.h"
#include "graph/quant.h"
#include "graph/step.h"
#include "model/model.h"

namespace trainmem::graph::step {

constexpr std::int32_t kNoLayer = -1;

// Note [Precision policies]
// fp32:        fp32 parameters, compute, gradients, optimizer states.
// *-mixed:     fp32 parameters under torch.autocast. Matmul inputs are cast to half per use; a
//              weight's cast is cached (it is an fp32 leaf that requires grad) until autocast
//              exits, and lives on while a backward node saves it. The embedding is not cast,
//              so the residual stream stays fp32.
// *-master:    half parameters and gradients; the optimizer keeps an fp32 master copy and fp32
//              gradients (the seed's 6 bytes/param of weights).
// *-true:      everything half, optimizer states included (zeros_like of half parameters).
// A half model (load_dtype bf16 / fp16; fp16 only under LoRA): *-true's parameters under
//              *-mixed's autocast, which casts only what is not half already (Notes [A half model
//              under autocast], [A half model trained whole] in step_parameters.cpp).
struct Policy {
  DType param = DType::kF32;
  DType compute = DType::kF32;
  bool autocast = false;
  bool master = false;
};

inline Policy policy_for(Precision p) {
  switch (p) {
    case Precision::kFp32: return {DType::kF32, DType::kF32, false, false};
    case Precision::kBf16Mixed: return {DType::kF32, DType::kBF16, true, false};
    case Precision::kFp16Mixed: return {DType::kF32, DType::kF16, true, false};
    case Precision::kBf16Master: return {DType::kBF16, DType::kBF16, false, true};
    case Precision::kBf16True: return {DType::kBF16, DType::kBF16, false, false};
    case Precision::kFp16True: return {DType::kF16, DType::kF16, false, false};
  }
  return {};
}

inline DType promote(DType a, DType b) {
  if (a == b) return a;
  return DType::kF32;  // float32 wins against either half type; bf16 × fp16 also promotes to fp32
}

struct Param {
  std::uint32_t slot = kNone;  // tape's .grad slot
  TensorId storage = kNone;
  std::uint64_t numel = 0;
  DType dtype = DType::kF32;
  bool trainable = true;       // requires_grad: false for the base model under LoRA
  TensorId cast = kNone;       // autocast cache entry
  ValueId cast_value = kNone;  // its ToCopyBackward's output (Note [Autocast's weight casts])
  TensorId master = kNone;     // bf16-master fp32 copy
  bool matmul = false;
  std::uint64_t rows = 0;  // 2-D tensors: first dimension as stored; 0 for 1-D
  bool quantized = false;  // bitsandbytes 4-bit (Note [QLoRA]): storage is the packed weight
  bool adapter = false;    // peft's lora_A / lora_B (an nn.Linear's weight)
};

// Indices into the parameter table for one decoder layer (kNone where the family has none).
struct LayerParams {
  std::uint32_t in_norm = kNone, in_norm_b = kNone, qkv = kNone, qkv_b = kNone, q = kNone,
                q_b = kNone, k = kNone, k_b = kNone, v = kNone, v_b = kNone, o = kNone, o_b = kNone,
                q_norm = kNone, k_norm = kNone, post_attn_norm = kNone, post_attn_norm_b = kNone,
                pre_ff_norm = kNone, post_ff_norm = kNone, gate_up = kNone, gate = kNone,
                gate_b = kNone, up = kNone, up_b = kNone, down = kNone, down_b = kNone;
};

// peft's lora.Linear beside one projection of one decoder layer: lora_A (rank × in) and lora_B
// (out × rank), indices into the parameter table.
struct Adapter {
  std::string_view path;  // the projection inside the layer, e.g. "self_attn.q_proj"
  std::uint32_t a = kNone, b = kNone;
  std::uint64_t in = 0, out = 0;
};

// The labels of a wrapped projection's ops (static strings: moments outlive the builder), as
// the module paths peft creates ("<path>.lora_A.default").
struct LoraLabels {
  std::string_view path, a, b;
};

// The labels of the projection at `path` (step_parameters.cpp); throws Error for a projection
// trainmem does not model.
const LoraLabels& lora_labels(std::string_view path);

// The order module.parameters() walks one decoder layer's `count` parameter groups in, starting at
// groups[first] (the catalog lists them in forward order): indices 0..count-1 into them
// (optimizer.cpp, Note [Parameter registration order]; FSDP2's fsdp_params and the optimizer's
// loops follow it).
std::vector<std::uint32_t> layer_registration_order(const std::vector<ParameterGroup>& groups, std::size_t first,
                                                    std::size_t count, Family family);

// A micro-batch in flight on a pipeline stage (Note [Pipeline parallelism] in pipeline.cpp): the
// stage's output and received input as fwd_cache holds them, the last stage's loss, its graph.
struct PipelineMicro {
  T out, leaf, loss;
  Graph graph;
};

class StepBuilder {
 public:
  StepBuilder(const Model& m, const Recipe& r, const Gpu& gpu, const MicroBatchHook& hook, std::uint64_t rank);
  Trace build();
  Trace finish_trace();

 private:
  // ---------------------------------------------------------------- parameters (step_parameters.cpp)
  void create_parameters();
  void wrap_data_parallel();
  void wrap_pipeline_stages(std::vector<WrappedParam>& wp, const std::vector<std::vector<std::uint32_t>>& layers,
                            const std::vector<std::uint32_t>& root, const std::vector<std::string>& root_names);
  // The wrapper holding a parameter: its pipeline stage's, with several stages per rank.
  DataParallel& dp_of_slot(std::uint32_t slot);
  std::uint32_t add_param(const ParameterGroup& g, bool in_layer = false, bool present = true);
  void create_adapters();
  std::uint32_t add_adapter_param(std::uint64_t numel, std::uint64_t rows);
  void ddp_sink(T& loss, T& logits);
  TensorId new_param_storage(std::uint64_t bytes);
  std::pair<std::uint64_t, std::uint64_t> projection_shape(std::string_view path) const;

  const Adapter* adapter(std::string_view path) const {
    if (layer_ < 0 || adapters_.empty()) return nullptr;
    for (const Adapter& ad : adapters_[static_cast<std::size_t>(layer_)]) {
      if (ad.path == path) return &ad;
    }
    return nullptr;
  }

  bool trainable(std::uint32_t pi) const { return pi != kNone && params_[pi].trainable; }
  // An nn.Linear's weight, whose forward is F.linear: every projection but GPT-2's Conv1D ones
  // (torch.addmm), peft's adapters and lm_head.
  bool functional_linear(std::uint32_t w) const {
    return a_.family != Family::kGpt2 || params_[w].adapter || in_lm_head_;
  }
  static bool ends_with(const std::string& s, std::string_view suffix);
  // The LayerParams field a layer parameter's name binds to ("model.layers.N.self_attn.q_proj.weight"
  // names every layer's q_proj: the same field for each layer).
  static std::uint32_t LayerParams::*layer_field(const std::string& n);
  std::uint32_t global(std::string_view suffix) const;

  // ---------------------------------------------------------------- op helpers (linear, proj: step_modules.cpp)
  T fresh(std::uint64_t numel, DType d) { return t_.make(numel, d); }

  void requires_grad(T& out) { out.value = t_.new_value(out.bytes()); }

  Node node(const T& out) {
    Node n;
    n.tag = MomentTag{t_.step, t_.micro, Phase::kBackward, layer_, op_};
    n.output = out.value;
    return n;
  }
  // node(out) built in the tape's node list (Tape::open_node): fill it, then t_.close_node().
  Node& open_node(const T& out) {
    Node& n = t_.open_node();
    n.tag = MomentTag{t_.step, t_.micro, Phase::kBackward, layer_, op_};
    n.output = out.value;
    return n;
  }

  // Under sequence parallelism the residual stream and the norms are DTensors, whose gradients
  // autograd never accumulates in place (See Note [Sequence parallelism]).
  GradIn grad_of(const T& x) const {
    GradIn g{x.value, x.bytes(), false};
    g.subclass = dtensor_;
    return g;
  }
  static GradIn pass_to(const T& x) { return GradIn{x.value, 0, true}; }
  // A fused attention backward computes the gradients of q, k and v together; one whose input
  // does not require grad (LoRA: layer 0 before the first adapter) is made and dropped.
  GradIn fused_grad_of(const T& x) const {
    GradIn g = grad_of(x);
    g.discard = !x.requires_grad();
    return g;
  }

  void op(std::string_view name) {
    op_ = name;
    t_.at(phase_, layer_, name);
  }

  // ZeRO-3's forward hooks around every nn.Module call (See Note [DeepSpeed ZeRO-3]): one
  // with parameters (its own: `w`, `b`), or a container (no parameters of its own, but its
  // fetch prefetches), told apart by kind and layer. The nodes recorded until module_exit are
  // the module's backward (Tape::module_begin).
  // Under LoRA kCausalLM is the PeftModel, kPeftTuner its LoraModel (whose forward calls the
  // CausalLM's .forward, bypassing that module's hooks), kLora a lora.Linear and kLoraDropout its
  // lora_dropout (nn.Identity or nn.Dropout), one per adapted projection (`sub`).
  enum class Container : std::uint32_t { kCausalLM = 2, kBaseModel, kEmbedDropout, kRotary, kLayer, kAttention,
                                         kAttnDropout, kMlp, kAct, kMlpDropout, kPeftTuner, kLora, kLoraDropout };
  std::uint32_t module_enter(std::uint32_t w, std::uint32_t b = kNone, bool input_requires_grad = true) {
    if (!dp_->zero3()) return kNone;
    std::vector<std::uint32_t> own{w};
    if (b != kNone) own.push_back(b);
    return enter(dp_->zero3_module(own, in_lm_head_ ? 1 : 0, input_requires_grad));
  }
  std::uint32_t container_enter(Container kind, bool input_requires_grad = true, std::uint32_t sub = 0) {
    if (!dp_->zero3()) return kNone;
    const std::uint32_t key =
        static_cast<std::uint32_t>(kind) + 16 * static_cast<std::uint32_t>(layer_ + 1) + (sub << 20);
    return enter(dp_->zero3_module({}, key, input_requires_grad));
  }
  std::uint32_t enter(std::uint32_t m) {
    dp_->module_pre_forward(m);
    t_.module_begin(m);
    return m;
  }
  void module_exit(std::uint32_t m) {
    if (m == kNone) return;
    t_.module_end();
    dp_->module_post_forward(m);
  }

  // torch.where(cond, a, b) over `numel` elements of `d` with two Python numbers, each wrapped
  // as a 0-dim tensor first (masking_utils' eager mask, SDPA's conversion of a bool mask, the
  // math kernel's causal mask).
  T where_of_scalars(std::uint64_t numel, DType d) {
    T a = fresh(1, d), b = fresh(1, d);
    T w = fresh(numel, d);
    t_.drop(b);
    t_.drop(a);
    return w;
  }

  // x.to(dtype): a new tensor when the dtype changes (ToCopyBackward saves nothing).
  T to(const T& x, DType d) {
    if (x.dtype == d) return t_.ref(x);
    T y = fresh(x.numel, d);
    if (x.requires_grad()) {
      requires_grad(y);
      Node& n = open_node(y);
      n.inputs.push_back(grad_of(x));
      t_.close_node();
    }
    return y;
  }

  // An argument of an op on autocast's lower-precision list (matmul, SDPA): its cast to c, in
  // the same order of strides, or outside autocast the tensor itself.
  T autocast_arg(const T& x, DType c) {
    T y = pol_.autocast ? to(x, c) : t_.ref(x);
    y.bshd = x.bshd;
    return y;
  }

  // Weight as a matmul sees it: under autocast the cached half copy (see Note [Precision
  // policies]), otherwise the parameter itself.
  T weight(std::uint32_t pi) {
    Param& p = params_[pi];
    T w;
    w.numel = p.numel;
    // autocast casts only what is not in its dtype already (a half model's own weights are used
    // as they are: Note [A half model under autocast]).
    const bool cast = pol_.autocast && p.dtype != pol_.compute;
    // A frozen weight's cast is not cached (Note [LoRA]): a new one at every use.
    if (cast && !p.trainable) return t_.make(p.numel, pol_.compute, Category::kWeights);
    if (cast) {
      if (p.cast == kNone) {
        p.cast = t_.alloc_bytes(p.numel * dtype_bytes(pol_.compute), Category::kWeights);
        casts_.push_back(pi);
        // Its backward, ToCopyBackward: the gradient cast to the parameter's dtype, then
        // AccumulateGrad (See Note [Autocast's weight casts] in step_modules.cpp).
        T c;
        c.id = p.cast;
        c.numel = p.numel;
        c.dtype = pol_.compute;
        requires_grad(c);
        Node& n = open_node(c);
        n.params.push_back(param_grad(pi, p.dtype));
        t_.close_node();
        p.cast_value = c.value;
      }
      w.id = p.cast;
      w.dtype = pol_.compute;
      w.value = p.cast_value;
    } else {
      w.id = dp_->zero3() ? dp_->zero3_data(pi) : p.storage;  // ZeRO-3: what the module's fetch gathered
      w.dtype = p.dtype;
    }
    t_.retain(w.id);
    return w;
  }

  void exit_autocast() {
    for (std::uint32_t pi : casts_) {
      t_.release(params_[pi].cast);
      params_[pi].cast = kNone;
      params_[pi].cast_value = kNone;
    }
    casts_.clear();
  }

  ParamGrad param_grad(std::uint32_t pi, DType computed_in, std::uint64_t scratch = 0) {
    const Param& p = params_[pi];
    ParamGrad g;
    g.param = p.slot;
    g.compute_bytes = p.numel * dtype_bytes(computed_in);
    g.scratch_bytes = scratch;
    if (computed_in != p.dtype) g.param_bytes = p.numel * dtype_bytes(p.dtype);
    return g;
  }
  static ParamGrad reduced(ParamGrad g) {
    g.reduced = true;
    return g;
  }
  T linear_4bit(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features);
  T linear_8bit(const T& x, std::uint32_t w, std::uint32_t b, std::uint64_t out_features);
  void recast_bias(std::uint32_t b, DType dtype);
  T linear(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features);
  T linear_module(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features);
  T proj(const T& x, std::string_view path, std::uint32_t w, std::uint32_t b, std::uint64_t out_features);
  // Tensor parallelism's projections (Note [Tensor parallelism] in tensor_parallel.h).
  T colwise_linear(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features);
  T rowwise_linear(const T& x, std::uint32_t w, std::uint32_t b, std::uint64_t out_features);
  // Sequence parallelism's redistributions of a [b, s, h] tensor along the sequence (Note
  // [Sequence parallelism] in tensor_parallel.h).
  T seq_all_gather(const T& shard, bool partial_grad);
  T seq_reduce_scatter(const T& partial);
  T seq_shard(const T& full);
  // A sequence all-gather's result is a view of the stacked buffer, no cat (Note [Gathering a
  // batch of one] in tensor_parallel.h).
  bool gather_is_view() const { return r_.batch == 1; }
  // SDPA runs torch's math kernel: no CPU kernel but that one takes dropout (with a padding mask,
  // or none; a reached window's mask is refused in step.cpp).
  bool sdpa_math_kernel() const { return !cuda_ && a_.attn_dropout > 0 && attention_ == Attention::kSdpa; }
  // `lora_module`, `sub`: the lora.Linear4bit's ZeRO-3 module and adapter index (See container_enter).
  T lora_4bit(const T& x, T& base, const Adapter& ad, const LoraLabels& labels, std::uint32_t lora_module,
              std::uint32_t sub);

  // Elementwise op producing `numel` elements of `d`; `saved` are kept for backward; each input
  // that requires grad gets a gradient of its own size.
  T elementwise(std::initializer_list<const T*> inputs, std::uint64_t numel, DType d,
                std::initializer_list<TensorId> saved, std::initializer_list<std::uint64_t> scratch = {},
                bool save_output = false) {
    T y = fresh(numel, d);
    bool any = false;
    for (const T* x : inputs) any = any || x->requires_grad();
    if (any) {
      requires_grad(y);
      Node& n = open_node(y);
      n.saved.assign(saved.begin(), saved.end());
      if (save_output) n.saved.push_back(y.id);
      for (const T* x : inputs) {
        if (x->requires_grad()) n.inputs.push_back(grad_of(*x));
      }
      n.scratch.assign(scratch.begin(), scratch.end());
      t_.close_node();
    }
    return y;
  }

  // A product of two tensors (a @ b, a * b): each operand is saved for the other's gradient, and
  // each operand that requires grad gets a gradient of its own size, b's first (Note [Gradient
  // order of a node] in tape.h).
  T product(const T& a, const T& b, std::uint64_t out_numel, DType d) {
    T y = fresh(out_numel, d);
    if (!a.requires_grad() && !b.requires_grad()) return y;
    requires_grad(y);
    Node& nd = open_node(y);
    if (b.requires_grad()) nd.saved.push_back(a.id);
    if (a.requires_grad()) nd.saved.push_back(b.id);
    if (a.requires_grad()) nd.inputs.push_back(grad_of(a));
    if (b.requires_grad()) nd.inputs.push_back(grad_of(b));
    nd.grad_order = GradOrder::kInputsReversed;
    t_.close_node();
    return y;
  }
  T bmm(const T& a, const T& b, std::uint64_t out_numel, DType d) { return product(a, b, out_numel, d); }
  T mul(const T& a, const T& b, std::uint64_t numel, DType d) { return product(a, b, numel, d); }

  // softmax over the last dim, in x's dtype: the output is what its backward saves.
  T softmax(const T& x) {
    T p = fresh(x.numel, x.dtype);
    if (!x.requires_grad()) return p;
    requires_grad(p);
    Node nd = node(p);
    nd.saved = {p.id};
    nd.inputs.push_back(grad_of(x));
    t_.record(std::move(nd));
    return p;
  }

  // A new tensor of x's size whose node hands its gradient on to x unchanged: x + a Python number
  // (AddBackward1), a clone (CloneBackward0).
  T handing_on(const T& x) {
    T y = fresh(x.numel, x.dtype);
    if (!x.requires_grad()) return y;
    requires_grad(y);
    Node& n = open_node(y);
    n.inputs.push_back(pass_to(x));
    t_.close_node();
    return y;
  }

  // a + b where the gradient passes through to both (AddBackward saves nothing), but for an
  // operand of another dtype or a broadcast one: validate_outputs casts (sums) the gradient to
  // it, a new tensor (measured: GPT-2's position embeddings, [1, s, h] under a batch of 2).
  T add(const T& a, const T& b) {
    T y = fresh(std::max(a.numel, b.numel), promote(a.dtype, b.dtype));
    if (!a.requires_grad() && !b.requires_grad()) return y;
    requires_grad(y);
    Node& n = open_node(y);
    auto grad = [&](const T& x) { return x.dtype == y.dtype && x.numel == y.numel ? pass_to(x) : grad_of(x); };
    if (a.requires_grad()) n.inputs.push_back(grad(a));
    if (b.requires_grad()) n.inputs.push_back(grad(b));
    t_.close_node();
    return y;
  }

  void ensure_workspace(bool backward) {
    // cuBLAS workspaces are made lazily at the first GEMM of each (handle, stream): one for the
    // Python thread's forward, one for the autograd thread's backward. MEMORY_MECHANICS §2.
    TensorId& ws = backward ? ws_bwd_ : ws_fwd_;
    if (ws == kNone && gpu_.cublas_workspace_bytes > 0) {
      ws = t_.alloc_bytes(gpu_.cublas_workspace_bytes, Category::kOther);
    }
  }

  // ---------------------------------------------------------------- modules (step_modules.cpp)
  T rms_norm(const T& x, std::uint32_t w, std::uint64_t rows, std::string_view name);
  T rms_norm_module(const T& x, std::uint32_t w, std::uint64_t rows);
  T layer_norm(const T& x, std::uint32_t w, std::uint32_t b, std::uint64_t rows, std::string_view name);
  T dropout(const T& x, double p);
  T rope(const T& q);
  T repeat_kv(const T& x);
  T fold_for_bmm(const T& x);
  T matmul(const T& a, const T& b, std::uint64_t out_numel, DType c);
  // Note [SDPA kernels on CUDA]
  // torch picks SDPA's kernel per call (sdp_utils.cpp, priority_order and the can_use_* checks).
  // From torch 2.11 its wheels ship cuDNN 9.19 or newer, and on sm90 and sm100 (check_prefer_
  // cudnn_attention: cuDNN newer than 9.15.0) cuDNN attention comes first: fp16 / bf16 inputs, a
  // head dim of at most 128 and a multiple of 8, a dropout probability that is a multiple of
  // 1/16, more than one key; masks are taken. Elsewhere a half call without a mask takes flash
  // on sm80 or newer, and any other the memory-efficient kernel. (So on sm90 a one-token step
  // takes flash, whose 128-row buffers hold more than cuDNN's at two tokens.) What each
  // allocates (read from the sources, not measured: no CUDA ground truth yet):
  //  * flash: the output, the fp32 log-sum-exp [b, heads, q] always; backward a contiguous copy
  //    of grad_out, fp32 dq_accum and softmax_d (rows rounded to 128, dq_accum's head dim to 32),
  //    and with GQA dk / dv at the query heads;
  //  * memory-efficient: the log-sum-exp only with grad mode on, its rows padded to 32;
  //    backward as flash's here, unrounded (its delta and workspace are not modelled);
  //  * cuDNN (_cudnn_attention_forward): the output, the fp32 log-sum-exp only with grad mode
  //    on, and two 0-dim int64 tensors (the philox seed and offset) that backward keeps;
  //    backward (run_cudnn_SDP_bprop) dq, dk, dv at their inputs' sizes and one workspace block,
  //    fp32 dq_accum and softmax_sum: no grad_out copy (HF's arrives with a unit inner stride)
  //    and no GQA expansion. Its forward's own workspace (closed source) is not counted.
  // The CPU's flash kernel makes the log-sum-exp always.
  enum class SdpaKernel : std::uint8_t { kCpuFlash, kFlash, kEfficient, kCudnn };
  // The kernel an SDPA call (attention sdpa) or flash_attention_2 (attention flash: flash-attn's
  // own, which allocates as flash does) runs, with `masked` a mask passed, `keys` the keys
  // (See Note [SDPA kernels on CUDA]).
  SdpaKernel sdpa_kernel(DType c, bool masked, double dropout, std::uint64_t keys) const {
    if (!cuda_) return SdpaKernel::kCpuFlash;
    if (attention_ == Attention::kFlash) return SdpaKernel::kFlash;
    const bool half = c == DType::kBF16 || c == DType::kF16;
    if ((gpu_sm_ / 10 == 9 || gpu_sm_ / 10 == 10) && half && a_.head_dim <= 128 && a_.head_dim % 8 == 0 &&
        dropout * 16 == std::floor(dropout * 16) && keys != 1) {
      return SdpaKernel::kCudnn;
    }
    return gpu_sm_ >= 80 && half && !masked && a_.head_dim <= 256 ? SdpaKernel::kFlash : SdpaKernel::kEfficient;
  }
  // HF's sdpa_attention_forward repeats K and V (repeat_kv) unless use_gqa_in_sdpa: no mask and a
  // head dim of at most 256; a single query token packs the heads instead (views). Flash
  // attention 2 takes GQA itself.
  bool sdpa_repeats_kv(bool masked, std::uint64_t queries) const {
    return masked || (attention_ == Attention::kSdpa && a_.head_dim > 256 && queries > 1);
  }
  // A fused SDPA kernel's output (dtype c), its log-sum-exp when it makes one, and cuDNN's seed and
  // offset, in the kernels' order: the output first (flash_api.cpp; the CPU's, by the profiler's
  // allocation records, data/ground_truth/README.md "Within one op").
  struct SdpaOutputs {
    T out, lse, seed, offset;
  };
  SdpaOutputs sdpa_outputs(std::uint64_t out_numel, std::uint64_t lse_numel, DType c, bool grad_mode, SdpaKernel k) {
    SdpaOutputs s;
    s.out = fresh(out_numel, c);
    const bool lse = k == SdpaKernel::kCudnn || k == SdpaKernel::kEfficient ? grad_mode : true;
    if (lse) s.lse = fresh(lse_numel, DType::kF32);
    if (k == SdpaKernel::kCudnn) {
      s.seed = fresh(1, DType::kI64);
      s.offset = fresh(1, DType::kI64);
    }
    return s;
  }
  T attention_core(T& q, T& k, T& v);
  T ring_attention_core(const T& q, T& qc, T& kc, T& vc);
  T gpt2_attention_core(T& q, T& k, T& v);
  T math_kernel(T& q, T& k, T& v, const T& attn_mask);
  T heads_last(T o, bool copied);
  T bmm_output(T o);
  T attention(const T& x, const LayerParams& lp);
  T attention_module(const T& x, const LayerParams& lp);
  T slice(const T& fused, std::uint64_t width);
  std::tuple<T, T, T> split3(const T& fused, std::uint64_t w0, std::uint64_t w1, std::uint64_t w2);
  // A view of `base` holding `numel` elements whose backward makes a new gradient of base's size
  // (slice_backward's zero-padded one, or reshape's copy of a gradient in another layout).
  T view_of(const T& base, std::uint64_t numel);
  T module_input(const T& x, bool unwrap);
  // Whether [b, heads, s, d] and [b, s, heads, d] are different memory layouts for `heads` heads:
  // not with one head or one token, where a transpose between them is contiguous as it stands.
  bool heads_layout_differs(std::uint64_t heads) const { return heads > 1 && S_ > 1; }
  T alias(const T& base, std::uint64_t numel);
  T mlp(const T& x, const LayerParams& lp);
  T mlp_module(const T& x, const LayerParams& lp);
  T act_fn(const T& x);
  T cache_update(T x);
  void sliding_window_tensors(std::int32_t layer = -1);  // -1: every sliding layer's
  T g_act_fn(std::uint64_t n, DType d);  // generation.cpp
  T decoder_layer(const T& x, std::uint32_t l);
  T decoder_layer_module(const T& x, std::uint32_t l);
  T post_norm(T y, std::uint32_t norm, std::string_view name);
  T residual_dropout(T y, Container module);
  T dropout_module(const T& x, double p, Container kind, bool input_requires_grad = true, std::uint32_t sub = 0);
  T residual_add(const T& residual, T& branch);
  T checkpointed_layer(const T& x, std::uint32_t l);
  void drop_nodes_since(std::size_t n);

  // ---------------------------------------------------------------- layer stamping (step_stamp.cpp)
  // A decoder layer's forward, built or stamped from a layer built before (See Note [Stamped
  // decoder layers] in tape.h; what must match: Note [Layer stamp keys] in step_stamp.cpp).
  struct LayerTemplate {
    bool valid = false;
    TapeSpan span;
    // The key: what the layer's forward reads besides its ids.
    std::uint64_t x_numel = 0;
    DType x_dtype = DType::kF32;
    bool x_bshd = false, x_grad = false, ws_fwd = false;
    std::string_view op_before, op_after;
    DType cos_dtype = DType::kF32, mask_dtype = DType::kF32;
    std::uint64_t cos_numel = 0, mask_numel = 0;
    std::vector<std::uint32_t> roles;  // the layer's parameters (kNone: absent)
    std::vector<Param> params;         // as they were, by role
    std::vector<Adapter> adapters;
    // What it leaves: the output (ids relative to the span) and the autocast cache entries it
    // made (role, cast storage and its node's value relative to the span), in the order they
    // joined casts_.
    T out;
    std::vector<std::tuple<std::uint32_t, TensorId, ValueId>> casts;
  };
  T layer_forward(const T& x, std::uint32_t l);
  void layer_tables(const T& x, std::uint32_t l);
  bool matches(const LayerTemplate& k, const T& x, std::uint32_t l) const;
  void capture_layer(LayerTemplate& k, std::uint32_t l, const T& out, std::size_t casts_before);
  T stamp_layer(LayerTemplate& k, std::uint32_t l);

  // ---------------------------------------------------------------- the step (step.cpp)
  T embedding(std::uint32_t w, const T& ids, std::uint64_t n);
  ValueId forward_and_loss();

  // Pipeline parallelism (pipeline.cpp): one stage's step.
  Trace build_pipeline();
  bool pp_holds_global(const std::string& name) const;
  bool pp_holds_layer(std::uint64_t layer) const;
  void pp_warmup_vote(bool first, bool last);
  std::uint64_t pp_act_bytes() const;
  void pp_batch(bool first, bool last);
  void pp_begin_step(std::uint32_t step);
  bool pp_end_step(std::uint32_t step);  // true: the hook stopped the replay
  void pp_forward(std::uint64_t k, PipelineMicro& mb);
  TensorId pp_backward(std::uint64_t k, PipelineMicro& mb);
  // Between two of the schedule's actions: true when the replay stopped (Note [Peeks inside a schedule]).
  bool pp_peek(std::uint32_t step);
  // Several stages per rank (Note [Interleaved pipeline schedules] in pipeline.cpp).
  Trace build_pipeline_multi();
  void pp_warmup_vote_multi();
  std::uint64_t pp_num_stages() const;
  T pp_shard_embedding(T& hs);  // PP x TP with sequence parallelism (pipeline.cpp)
  T pp_vocab_parallel_head(const T& normed);  // PP x TP with loss parallelism (pipeline.cpp)
  std::uint32_t lm_head_param(std::uint32_t emb) const;
  ValueId standard_loss(T& normed, std::uint32_t emb);
  T causal_lm_loss(const T& logits, bool vocab_parallel = false);
  // Recipe loss_parallel (tensor_parallel.cpp; Note [Loss parallel] in tensor_parallel.h).
  ValueId vocab_parallel_loss(T& normed, std::uint32_t emb);
  T vocab_parallel_log_softmax(const T& x);
  T vocab_parallel_nll_loss(const T& target, T& total_weight);
  T partition_targets(std::uint64_t n, T& local_target);
  void vocab_parallel_nll_backward(Node& nd, std::uint64_t tokens, std::uint64_t local_vocab);
  void rotary_embedding(DType x_dtype);
  ValueId fused_loss(T& hidden, std::uint32_t emb);
  ValueId scale_loss(T& loss);
  void backward(ValueId loss);

  // ---------------------------------------------------------------- optimizer (optimizer.cpp)
  void bnb_quantization_maps();
  void optimizer_step(bool first);
  std::vector<std::uint32_t> optimizer_order() const;  // model.parameters() order, indices into params_
  void clip_grad_norm(const std::vector<std::uint32_t>& order);
  void step_parameters(const std::vector<const Param*>& opt, bool first);

  // ================================================================ generation (generation.cpp)
  Trace build_generation();
  T expand_rows(const T& x);
  T generation_forward(const T& pos, std::uint64_t q, std::uint32_t step, T& prev_ids_in,
                       T& prev_pos_in);
  void grow_position_ids(T& pos, std::uint64_t len);
  void stopping_criteria(T& unfinished, std::uint64_t rows);
  void greedy(T& ids, T& pos);
  T gather_beams(std::uint64_t out_numel, DType d);
  void replace(T& var, T value);
  T beam_search(T& pos);
  std::uint64_t rows() const;
  T model_forward();

  // The masks a generation forward builds: Note [Generation masks] (generation.cpp).
  enum class MaskKind : std::uint8_t { kFull, kSliding };
  std::vector<MaskKind> mask_kinds() const;
  std::uint64_t window_of_model() const;
  std::vector<T> generation_masks();
  T attention_mask(MaskKind kind, std::uint64_t batch, std::uint64_t q, std::uint64_t kv, bool eager, DType dtype,
                   bool padding = false);
  // A training forward's masks: Notes [Training masks], [Padding masks] (step.cpp).
  void training_masks(DType dtype);
  void packed_sequence_check(std::uint64_t rows, std::uint64_t cols);
  void fast_all();
  void drop_training_masks();
  const T& layer_mask(std::uint32_t l) const { return masks_[window_[l] > 0 ? 1 : 0]; }
  void generation_rotary();
  T g_rms_norm(const T& x, std::uint32_t w, std::uint64_t nrows, std::string_view name);
  T g_post_norm(T y, std::uint32_t norm, std::uint64_t rows, std::string_view name);
  T g_layer_norm(const T& x, std::string_view name);
  T g_rope(const T& x);
  void cache_update(std::uint32_t l, const T& k, const T& v);
  std::uint64_t visible(std::uint32_t l) const;
  bool layer_has_mask(std::uint32_t l) const;
  T g_attention_core(const T& q, std::uint32_t l, bool q_bshd);
  T g_eager_core(const T& q, std::uint32_t l, bool q_bshd);
  T g_gpt2_eager_core(const T& q, std::uint32_t l);
  T g_attention(const T& x, std::uint32_t l);
  T g_attend(T& q, T& k, T& v, std::uint32_t l, bool q_bshd, T* fused);
  T g_mlp(const T& x, const LayerParams& lp);
  T g_decoder_layer(const T& x, std::uint32_t l);
  T g_gpt2_block(const T& x, std::uint32_t l);


  const Model& m_;
  const Architecture& a_;
  const Recipe& r_;
  const Gpu& gpu_;
  const MicroBatchHook& hook_;
  Policy pol_;
  DType quant_dtype_;  // a 4-bit base: the load and compute dtype of its matmuls (Note [QLoRA])
  std::uint64_t rank_ = 0;  // the data-parallel rank built (graph/parallel.h); under pp the stage
  std::uint64_t stage_dp_rank_ = 0;  // under pp: the rank's place among its stage's replicas
  Attention attention_;
  bool cuda_ = true;
  unsigned gpu_sm_ = 0;  // Gpu::sm: which SDPA kernel runs (Note [SDPA kernels on CUDA])
  std::uint64_t B_ = 0, S_ = 0, tok_ = 0;
  // Sequence parallelism: the degree the residual stream is sharded by (tp, else 1), the tokens
  // of that stream on a rank, and whether the values being built are DTensors (Note [Sequence
  // parallelism] in tensor_parallel.h).
  std::uint64_t sp_ = 1, res_tok_ = 0;
  bool dtensor_ = false;
  // A reentrant checkpoint's first forward runs under no_grad (Note [Reentrant checkpoints]).
  bool no_grad_ = false;
  Tape t_;
  // A pipeline stage (rank_ is the stage) is built as its replica stage_dp_rank_: DDP's replicas of a
  // stage hold the same memory (See Note [Pipeline with DDP] in pipeline.cpp), FSDP2's differ only
  // where a parameter's rows do not divide (Note [Uneven shards] in parallel.cpp).
  DataParallel dp_rank_{t_, r_, r_.gpu != "cpu", r_.pp > 1 ? stage_dp_rank_ : rank_};  // DDP / FSDP2 (graph/parallel.h); nothing without
  // The wrapper the hooks reach: the rank's, or with several pipeline stages per rank the wrapper of
  // the stage whose action runs (pp_dps_, one per local stage: See Notes [Interleaved pipeline
  // schedules with DDP] and [Interleaved pipeline schedules with FSDP2] in pipeline.cpp).
  DataParallel* dp_ = &dp_rank_;
  std::deque<DataParallel> pp_dps_;
  std::vector<Param> params_;
  std::vector<std::pair<std::string, std::uint32_t>> globals_;
  std::vector<LayerParams> layers_;
  std::vector<std::uint32_t> casts_;
  std::vector<TensorId> states_;
  T input_ids_, labels_, padding_mask_, mask_, cos_, sin_, position_ids_, pending_loss_;
  ValueId root_output_ = kNone;  // the model's output, the loss (FSDP2's root pre-backward hook)
  std::array<T, 2> masks_;  // a training forward's masks by kind (causal, sliding); mask_ is the layer's
  T cp_positions_;  // context parallelism's position_ids buffer (Note [Context parallelism])
  std::vector<T> zero_losses_;  // ZeRO: the loss and gas_scaled_loss, held through backward
  T input_leaf_;  // LoRA with checkpointing: the embeddings' output, a leaf (Note [LoRA])
  std::vector<std::vector<Adapter>> adapters_;  // per decoder layer, in module order
  TensorId ws_fwd_ = kNone, ws_bwd_ = kNone;
  TensorId scaler_scale_ = kNone;
  std::vector<TensorId> rms_;  // Adafactor's per-parameter state["RMS"]
  // Generation (Note [Generation]): rows of the expanded batch, tokens in this forward, tokens
  // already cached, and each layer's cached keys and values.
  std::uint64_t Bg_ = 1, q_ = 0, past_ = 0;
  std::vector<T> kc_, vc_;
  std::vector<std::uint64_t> window_;  // per layer: its sliding window, 0 for full attention
  std::vector<std::uint64_t> stored_;  // per layer: positions in its cached keys' storage
  std::vector<T> swt_;                 // per sliding layer: its _sliding_window_tensor
  T attn_weights_;                     // eager: the probabilities the layer holds to its end
  Phase phase_ = Phase::kForward;
  std::int32_t layer_ = kNoLayer;
  std::string_view op_ = "";
  std::uint32_t causal_lm_module_ = kNone, base_model_module_ = kNone;  // ZeRO-3: open until the loss
  std::uint32_t peft_tuner_module_ = kNone;
  // Pipeline stage (rank_ is the stage): the receive buffers, one per micro-batch.
  std::vector<TensorId> pp_recv_act_, pp_recv_grad_;
  // The stage pp_forward / pp_backward run (rank_ with one stage per rank) and its receive
  // buffers' offset in pp_recv_act_ / pp_recv_grad_ (local stage x micro-batches).
  std::uint64_t pp_stage_ = 0, pp_slot_ = 0;
  TensorId grad_norm_ = kNone;  // the Trainer's grad_norm: clip_grad_norm_'s total norm, kept to the next step
  std::vector<TensorId> cache_;  // a training forward's DynamicCache (Recipe::use_cache): its keys and values
  bool in_lm_head_ = false;  // ZeRO-3: lm_head's nn.Linear (tied: a second module over wte)
  // Layer stamping: whether this recipe may stamp, the templates, the tables of the layer at
  // hand (its parameters by role, its outside storages, values and parameter slots: Tape::stamp)
  // and the mark of a layer being captured.
  bool stamps_ = false;
  std::uint32_t stamp_failures_ = 0;
  // The last few layers captured (a forward's layers 0 and 1 and the rest have three keys; the
  // next forward's layers 1.. match the first's), the oldest replaced first.
  std::array<LayerTemplate, 3> templates_;
  std::uint32_t next_template_ = 0, last_template_ = 0;  // replaced next, matched last
  std::vector<std::uint32_t> roles_;
  std::vector<TensorId> outside_;
  std::vector<ValueId> outside_values_;
  std::vector<std::uint32_t> slots_;
  TapeMark mark_;
};

}  // namespace trainmem::graph::step
