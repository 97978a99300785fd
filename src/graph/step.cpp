// The training step of docs/schema.md ("The reference step"), op by op.
//
// Each builder mirrors a Hugging Face module of transformers 5.x (modeling_llama.py and its
// Mistral/Qwen2/Qwen3/Gemma-2/Phi-3 siblings, modeling_gpt2.py, loss_utils.py) and the PyTorch
// kernels it calls. MEMORY_MECHANICS.md in shared/design lists the saved tensors these builders
// reproduce; tests/cpp/test_graph.cpp checks them against its closed forms.
#include "graph/step.h"
#include "graph/parallel.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checked.h"
#include "graph/quant.h"
#include "model/model.h"

namespace trainmem::graph {
namespace {

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
struct Policy {
  DType param = DType::kF32;
  DType compute = DType::kF32;
  bool autocast = false;
  bool master = false;
};

Policy policy_for(Precision p) {
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

DType promote(DType a, DType b) {
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
  TensorId master = kNone;     // bf16-master fp32 copy
  bool matmul = false;
  std::uint64_t rows = 0;  // 2-D tensors: first dimension as stored; 0 for 1-D
  bool quantized = false;  // bitsandbytes 4-bit (Note [QLoRA]): storage is the packed weight
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

// Note [Sliding-window layers]
// DynamicCache(config=...) gives every layer whose config slides a DynamicSlidingWindowLayer
// (cache_utils.get_layer_types_and_kwargs): the layer_types list when the config has one,
// otherwise "sliding_attention" wherever config.sliding_window is set. Which layers slide, and
// with which window, comes from the model stage (model::attention_windows, with each config
// class's defaults: config.cpp, parse_generation_keys); so does whether the config has a
// bos_token_id, which generate() turns into a 0-dim device tensor.

class StepBuilder {
 public:
  StepBuilder(const Model& m, const Recipe& r, const Gpu& gpu, const MicroBatchHook& hook, std::uint64_t rank)
      : m_(m),
        a_(m.arch),
        r_(r),
        gpu_(gpu),
        hook_(hook),
        // A 4-bit base runs in fp32 outside its matmuls, whose dtype is the precision's (Note [QLoRA]).
        pol_(policy_for(r.quant.enabled() ? Precision::kFp32 : r.precision)),
        quant_dtype_(policy_for(r.precision).param),
        rank_(rank) {
    if (r.quant.enabled() && (a_.family == Family::kGpt2 || a_.qkv_bias || a_.o_bias || a_.mlp_bias)) {
      // Linear4bit.forward recasts a bias's .data to the compute dtype at the first forward.
      throw Error("load_in_4bit: " + std::string(family_name(a_.family)) +
                  " has biases on its linear layers, which bitsandbytes recasts in the first forward; "
                  "not modelled yet (Llama, Mistral, Qwen3, Gemma-2 and Phi-3 have none)");
    }
    B_ = r.batch;
    S_ = r.seq;
    tok_ = detail::mul(B_, S_, "batch * seq");
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
    attention_ = r.attention;
    // Gemma-2 declares no SDPA/flash support in transformers 5: it always runs eager attention.
    if (a_.family == Family::kGemma2) attention_ = Attention::kEager;
  }

  Trace build() {
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
    t_.at(Phase::kSetup, kNoLayer, "batch");
    input_ids_ = t_.make(tok_, DType::kI64, Category::kOther);
    labels_ = t_.make(tok_, DType::kI64, Category::kOther);
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
        ValueId loss = forward_and_loss();
        backward(loss);
        t_.seal_categories();  // the replay reads the events so far now
        const MicroBatchNext next = hook_ ? hook_(t_.trace(), step, micro) : MicroBatchNext::kGoOn;
        if (next == MicroBatchNext::kStop) return finish_trace();  // the replay has its answer
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

  Trace finish_trace() {
    Trace trace = t_.take();
    trace.trainable_parameters = m_.parameter_count;
    if (r_.lora.enabled()) {
      trace.trainable_parameters = 0;
      for (const Param& p : params_) {
        if (p.trainable) trace.trainable_parameters += p.numel;
      }
    }
    return trace;
  }

 private:
  // ---------------------------------------------------------------- parameters
  void create_parameters() {
    const std::uint64_t L = a_.num_layers;
    layers_.assign(L, LayerParams{});
    bool in_layers_done = false;
    const auto& groups = m_.parameters;
    auto is_layer = [](const ParameterGroup& g) { return g.name.find(".N.") != std::string::npos; };
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      if (!is_layer(groups[gi])) {
        globals_.push_back({groups[gi].name, add_param(groups[gi])});
        continue;
      }
      if (in_layers_done) continue;
      // HF creates layer 0's tensors, then layer 1's, ...
      std::size_t gend = gi;
      while (gend < groups.size() && is_layer(groups[gend])) ++gend;
      for (std::uint64_t l = 0; l < L; ++l) {
        for (std::size_t k = gi; k < gend; ++k) {
          bind_layer(layers_[l], groups[k].name, add_param(groups[k], /*in_layer=*/true));
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
  void wrap_data_parallel() {
    if (r_.parallel == Parallel::kNone) return;
    std::vector<WrappedParam> wp;
    for (const Param& p : params_) wp.push_back({p.slot, p.storage, p.numel, p.rows, p.dtype});
    std::vector<std::vector<std::uint32_t>> layers(a_.num_layers);
    std::vector<std::uint32_t> root;
    std::uint32_t idx = 0;
    bool in_layers_done = false;
    const auto& groups = m_.parameters;
    auto is_layer = [](const ParameterGroup& g) { return g.name.find(".N.") != std::string::npos; };
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      if (!is_layer(groups[gi])) {
        root.push_back(idx++);
        continue;
      }
      if (in_layers_done) continue;
      std::size_t per_layer = 0;
      while (gi + per_layer < groups.size() && is_layer(groups[gi + per_layer])) ++per_layer;
      for (auto& layer : layers) {
        for (std::size_t k = 0; k < per_layer; ++k) layer.push_back(idx++);
      }
      in_layers_done = true;
    }
    TRAINMEM_ASSERT(idx == params_.size(), "FSDP units miss parameters");
    // The module's buffers (create_parameters): rotary inv_freq and original_inv_freq, Gemma-2's
    // embedding scale.
    std::vector<std::pair<DType, std::uint64_t>> buffers;
    if (a_.family != Family::kGpt2) buffers.assign(2, {DType::kF32, a_.head_dim / 2 * 4});
    if (a_.embedding_scale) buffers.emplace_back(pol_.param, dtype_bytes(pol_.param));
    dp_.wrap(wp, layers, root, buffers);
    for (std::size_t i = 0; i < params_.size(); ++i) params_[i].storage = wp[i].storage;
    t_.on_param_ready = [this](std::uint32_t slot) { dp_.param_ready(slot); };
    t_.on_layer_change = [this](std::int32_t from, std::int32_t to) { dp_.layer_change(from, to); };
  }

  std::uint32_t add_param(const ParameterGroup& g, bool in_layer = false) {
    Param p;
    p.numel = g.numel;
    p.dtype = pol_.param;
    p.trainable = !r_.lora.enabled();  // get_peft_model freezes the whole base model
    p.quantized = r_.quant.enabled() && in_layer && g.matmul_weight;
    if (p.quantized) {
      // Params4bit and its QuantState's tensors (Note [QLoRA]); none requires grad.
      const Packed4bit q = packed_4bit(g.numel, r_.quant.double_quant);
      p.dtype = DType::kU8;
      p.storage = t_.alloc_bytes(q.packed_bytes, Category::kWeights);
      for (std::uint64_t b : {q.absmax_bytes, q.code_bytes, q.offset_bytes, q.nested_absmax_bytes, q.nested_code_bytes}) {
        if (b != 0) t_.alloc_bytes(b, Category::kWeights);
      }
    } else {
      const std::uint64_t bytes = detail::mul(g.numel, dtype_bytes(pol_.param), "parameter bytes");
      // FSDP2 holds shards only: the full parameter never has memory (See Note [FSDP2 units]);
      // ZeRO makes the parameters views of one flat buffer (See Note [DeepSpeed ZeRO-1/2]).
      p.storage = r_.parallel == Parallel::kFsdp || is_zero(r_.parallel) ? t_.reserve(bytes, Category::kWeights)
                                                                          : t_.alloc_bytes(bytes, Category::kWeights);
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
  void create_adapters() {
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
    if (pol_.param != DType::kF32) {
      t_.at(Phase::kSetup, kNoLayer, "lora.cast_adapter_dtype");
      for (auto& layer : adapters_) {
        for (const Adapter& ad : layer) {
          for (std::uint32_t pi : {ad.a, ad.b}) {
            Param& p = params_[pi];
            TensorId f32 = t_.alloc_bytes(p.numel * 4, Category::kWeights);
            t_.release(p.storage);
            p.storage = f32;
            p.dtype = DType::kF32;
          }
        }
      }
    }
  }

  std::uint32_t add_adapter_param(std::uint64_t numel, std::uint64_t rows) {
    Param p;
    p.numel = numel;
    p.dtype = pol_.param;
    p.storage = t_.alloc_bytes(detail::mul(numel, dtype_bytes(p.dtype), "adapter bytes"),
                               Category::kWeights);
    p.slot = t_.new_param(p.storage);
    p.matmul = true;
    p.rows = rows;
    params_.push_back(p);
    return static_cast<std::uint32_t>(params_.size() - 1);
  }

  // (in_features, out_features) of a projection of the decoder layer.
  std::pair<std::uint64_t, std::uint64_t> projection_shape(std::string_view path) const {
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

  const Adapter* adapter(std::string_view path) const {
    if (layer_ < 0 || adapters_.empty()) return nullptr;
    for (const Adapter& ad : adapters_[static_cast<std::size_t>(layer_)]) {
      if (ad.path == path) return &ad;
    }
    return nullptr;
  }

  bool trainable(std::uint32_t pi) const { return pi != kNone && params_[pi].trainable; }

  static bool ends_with(const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  }

  void bind_layer(LayerParams& lp, const std::string& n, std::uint32_t idx) {
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
      if (ends_with(n, b.suffix)) {
        lp.*b.field = idx;
        return;
      }
    }
    TRAINMEM_ASSERT(false, "unbound layer parameter");
  }

  std::uint32_t global(std::string_view suffix) const {
    for (const auto& [name, idx] : globals_) {
      if (ends_with(name, suffix)) return idx;
    }
    return kNone;
  }

  // ---------------------------------------------------------------- op helpers
  T fresh(std::uint64_t numel, DType d) { return t_.make(numel, d); }

  void requires_grad(T& out) { out.value = t_.new_value(out.bytes()); }

  Node node(const T& out) {
    Node n;
    n.tag = MomentTag{t_.step, t_.micro, Phase::kBackward, layer_, op_};
    n.output = out.value;
    return n;
  }

  static GradIn grad_of(const T& x) { return GradIn{x.value, x.bytes(), false}; }
  static GradIn pass_to(const T& x) { return GradIn{x.value, 0, true}; }
  // A fused attention backward computes the gradients of q, k and v together; one whose input
  // does not require grad (LoRA: layer 0 before the first adapter) is made and dropped.
  static GradIn fused_grad_of(const T& x) {
    GradIn g = grad_of(x);
    g.discard = !x.requires_grad();
    return g;
  }

  void op(std::string_view name) {
    op_ = name;
    t_.at(phase_, layer_, name);
  }

  // x.to(dtype): a new tensor when the dtype changes (ToCopyBackward saves nothing).
  T to(const T& x, DType d) {
    if (x.dtype == d) return t_.ref(x);
    T y = fresh(x.numel, d);
    if (x.requires_grad()) {
      requires_grad(y);
      Node n = node(y);
      n.inputs.push_back(grad_of(x));
      t_.record(std::move(n));
    }
    return y;
  }

  // Weight as a matmul sees it: under autocast the cached half copy (see Note [Precision
  // policies]), otherwise the parameter itself.
  T weight(std::uint32_t pi) {
    Param& p = params_[pi];
    T w;
    w.numel = p.numel;
    // A frozen weight's cast is not cached (Note [LoRA]): a new one at every use.
    if (pol_.autocast && !p.trainable) return t_.make(p.numel, pol_.compute, Category::kWeights);
    if (pol_.autocast) {
      if (p.cast == kNone) {
        p.cast = t_.alloc_bytes(p.numel * dtype_bytes(pol_.compute), Category::kWeights);
        casts_.push_back(pi);
      }
      w.id = p.cast;
      w.dtype = pol_.compute;
    } else {
      w.id = p.storage;
      w.dtype = p.dtype;
    }
    t_.retain(w.id);
    return w;
  }

  void exit_autocast() {
    for (std::uint32_t pi : casts_) {
      t_.release(params_[pi].cast);
      params_[pi].cast = kNone;
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

  // bnb.nn.Linear4bit (no bias: see the constructor): the input cast to the compute dtype, the
  // weight dequantized for the matmul and again in its backward (Note [QLoRA]).
  T linear_4bit(const T& x_in, std::uint32_t w, std::uint64_t out_features) {
    const std::uint64_t numel = params_[w].numel;
    const std::uint64_t rows = x_in.numel / (numel / out_features);
    const Packed4bit q = packed_4bit(numel, r_.quant.double_quant);
    const std::uint64_t absmax_f32_bytes = detail::mul(q.blocks, 4, "absmax bytes");
    T x = to(x_in, quant_dtype_);  // kept until forward returns
    // gemm_4bit: the fp32 absmax (double quant: dequantize_blockwise, then + offset), the
    // dequantized weight, F.linear.
    TensorId absmax = kNone;
    if (r_.quant.double_quant) {
      TensorId blockwise = t_.alloc_bytes(absmax_f32_bytes, Category::kTemporaries);
      absmax = t_.alloc_bytes(absmax_f32_bytes, Category::kTemporaries);
      t_.release(blockwise);
    }
    T wd = fresh(numel, quant_dtype_);
    ensure_workspace(false);
    T y = fresh(rows * out_features, quant_dtype_);
    if (absmax != kNone) t_.release(absmax);
    t_.drop(wd);
    if (x.requires_grad()) {
      // MatMul4Bit saves only the packed weight (a parameter). Its backward: the fp32 absmax
      // (double quant; dies once the weight is made), the weight in its load dtype, grad_A.
      requires_grad(y);
      Node n = node(y);
      if (r_.quant.double_quant) n.scratch.push_back(absmax_f32_bytes);
      n.scratch.push_back(numel * dtype_bytes(quant_dtype_));
      n.scratch_freed_early = r_.quant.double_quant ? 1 : 0;
      n.inputs.push_back(grad_of(x));
      t_.record(std::move(n));
    }
    T out = to(y, x_in.dtype);
    t_.drop(y);
    t_.drop(x);
    return out;
  }

  // nn.Linear (or GPT-2's Conv1D addmm): y = x W^T + b over `rows` rows.
  T linear(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
    if (params_[w].quantized) {
      TRAINMEM_ASSERT(b == kNone, "a 4-bit linear layer with a bias");
      return linear_4bit(x_in, w, out_features);
    }
    const std::uint64_t in_features = params_[w].numel / out_features;
    const std::uint64_t rows = x_in.numel / in_features;  // tokens
    const std::uint64_t out_numel = rows * out_features;
    T x = pol_.autocast ? to(x_in, pol_.compute) : t_.ref(x_in);
    T wc = weight(w);
    T bc;
    if (b != kNone) bc = weight(b);
    const DType cd = wc.dtype;
    T y = fresh(out_numel, cd);
    ensure_workspace(false);
    const bool wt = trainable(w), bt = trainable(b);
    if (x.requires_grad() || wt || bt) {
      // mm/addmm save the input for the weight's gradient and the weight for the input's.
      requires_grad(y);
      Node n = node(y);
      if (wt) n.saved.push_back(x.id);
      if (x.requires_grad()) {
        n.saved.push_back(wc.id);
        n.inputs.push_back(grad_of(x));
      }
      // addmm(bias, x, W): the bias is the first input, so its gradient is made and its
      // AccumulateGrad runs first (what DDP's gradient-ready order shows: Note [DDP buckets]).
      if (bt) n.params.push_back(param_grad(b, cd));
      if (wt) n.params.push_back(param_grad(w, cd));
      t_.record(std::move(n));
    }
    t_.drop(x);
    t_.drop(wc);
    if (b != kNone) t_.drop(bc);
    return y;
  }

  // A projection of the decoder layer: nn.Linear (GPT-2: Conv1D), or peft's lora.Linear
  // around it when LoRA targets it (Note [LoRA]).
  T proj(const T& x, std::string_view path, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
    op(path);
    T result = linear(x, w, b, out_features);
    const Adapter* ad = adapter(path);
    if (ad == nullptr) return result;
    const LoraLabels& labels = lora_labels(path);
    if (params_[w].quantized) return lora_4bit(x, result, *ad, labels);
    const DType result_dtype = result.dtype;
    T xa = to(x, params_[ad->a].dtype);  // _cast_input_dtype: x is rebound, kept to the end
    T xd = r_.lora.dropout > 0 ? dropout(xa) : t_.ref(xa);
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
    return out;
  }

  // peft's lora.bnb.Linear4bit around a 4-bit projection whose output is `base` (Note [QLoRA]).
  T lora_4bit(const T& x, T& base, const Adapter& ad, const LoraLabels& labels) {
    T result = fresh(base.numel, base.dtype);  // result.clone(): CloneBackward hands its gradient on
    if (base.requires_grad()) {
      requires_grad(result);
      Node n = node(result);
      n.inputs.push_back(pass_to(base));
      t_.record(std::move(n));
    }
    t_.drop(base);
    T xa = to(x, params_[ad.a].dtype);  // _cast_input_dtype (no autocast here)
    T xd = r_.lora.dropout > 0 ? dropout(xa) : t_.ref(xa);
    op(labels.a);
    T down = linear(xd, ad.a, kNone, r_.lora.rank);
    t_.drop(xd);
    op(labels.b);
    T up = linear(down, ad.b, kNone, ad.out);
    t_.drop(down);
    op(labels.path);
    T scaled = elementwise({&up}, up.numel, up.dtype, {});  // * scaling (a Python float)
    t_.drop(up);
    T cast = to(scaled, result.dtype);
    t_.drop(scaled);
    T sum = add(result, cast);
    t_.drop(cast);
    t_.drop(result);
    t_.drop(xa);
    return sum;
  }

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
      Node n = node(y);
      n.saved.assign(saved.begin(), saved.end());
      if (save_output) n.saved.push_back(y.id);
      for (const T* x : inputs) {
        if (x->requires_grad()) n.inputs.push_back(grad_of(*x));
      }
      n.scratch.assign(scratch.begin(), scratch.end());
      t_.record(std::move(n));
    }
    return y;
  }

  // A product of two tensors (a @ b, a * b): each operand is saved for the other's gradient, and
  // each operand that requires grad gets a gradient of its own size.
  T product(const T& a, const T& b, std::uint64_t out_numel, DType d) {
    T y = fresh(out_numel, d);
    if (!a.requires_grad() && !b.requires_grad()) return y;
    requires_grad(y);
    Node nd = node(y);
    if (b.requires_grad()) nd.saved.push_back(a.id);
    if (a.requires_grad()) nd.saved.push_back(b.id);
    if (a.requires_grad()) nd.inputs.push_back(grad_of(a));
    if (b.requires_grad()) nd.inputs.push_back(grad_of(b));
    t_.record(std::move(nd));
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

  // a + b where the gradient passes through to both (AddBackward saves nothing).
  T add(const T& a, const T& b) {
    T y = fresh(std::max(a.numel, b.numel), promote(a.dtype, b.dtype));
    if (!a.requires_grad() && !b.requires_grad()) return y;
    requires_grad(y);
    Node n = node(y);
    if (a.requires_grad()) n.inputs.push_back(a.dtype == y.dtype ? pass_to(a) : grad_of(a));
    if (b.requires_grad()) n.inputs.push_back(b.dtype == y.dtype ? pass_to(b) : grad_of(b));
    t_.record(std::move(n));
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

  // ---------------------------------------------------------------- modules
  // LlamaRMSNorm: x.to(fp32); pow(2).mean(-1); x * rsqrt(var + eps); weight * x.to(input_dtype).
  // Gemma2RMSNorm computes x.float() normalised, times (1 + weight.float()), then type_as(x).
  T rms_norm(const T& x, std::uint32_t w, std::uint64_t rows, std::string_view name) {
    op(name);
    const std::uint64_t n = x.numel;
    T h32 = to(x, DType::kF32);
    // pow's backward, grad * (2 * x.pow(1)): both expression temporaries live until the product.
    T sq = elementwise({&h32}, n, DType::kF32, {h32.id}, {n * 4, n * 4});
    T var = elementwise({&sq}, rows, DType::kF32, {});
    t_.drop(sq);
    T ve = fresh(rows, DType::kF32);
    if (var.requires_grad()) {
      requires_grad(ve);
      Node nd = node(ve);
      nd.inputs.push_back(pass_to(var));
      t_.record(std::move(nd));
    }
    t_.drop(var);
    // rsqrt's backward, -0.5 * grad * result.pow(3): two temporaries, then the product.
    T rs = elementwise({&ve}, rows, DType::kF32, {}, {rows * 4, rows * 4}, /*save_output=*/true);
    t_.drop(ve);
    T hn = fresh(n, DType::kF32);
    if (h32.requires_grad()) {
      requires_grad(hn);
      Node nd = node(hn);
      nd.saved = {h32.id, rs.id};  // mul saves both factors (both require grad)
      nd.inputs.push_back(grad_of(h32));
      nd.inputs.push_back(grad_of(rs));
      nd.scratch.push_back(n * 4);  // grad * x before the sum over the hidden dim
      t_.record(std::move(nd));
    }
    t_.drop(h32);
    t_.drop(rs);
    const bool gemma = a_.family == Family::kGemma2;
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
        if (trainable(w)) nd.params.push_back(param_grad(w, DType::kF32, n * 4));
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
    t_.drop(hn);
    DType od = promote(params_[w].dtype, x.dtype);
    out = fresh(n, od);
    if (!hc.requires_grad() && !trainable(w)) {
      t_.drop(hc);
      return out;
    }
    // weight * x: x is saved for the weight's gradient (the weight, saved for x's, is the
    // parameter itself).
    requires_grad(out);
    Node nd = node(out);
    if (trainable(w)) nd.saved = {hc.id};
    if (hc.requires_grad()) nd.inputs.push_back(GradIn{hc.value, hc.bytes(), false});
    if (trainable(w)) nd.params.push_back(param_grad(w, od, n * dtype_bytes(od)));
    t_.record(std::move(nd));
    t_.drop(hc);
    return out;
  }

  // nn.LayerNorm (GPT-2). Under CUDA autocast layer_norm runs in fp32: a half input is cast up
  // and the output is fp32. native_layer_norm saves its input, mean and rstd.
  T layer_norm(const T& x, std::uint32_t w, std::uint32_t b, std::uint64_t rows, std::string_view name) {
    op(name);
    T xin = (pol_.autocast && cuda_) ? to(x, DType::kF32) : t_.ref(x);
    // CUDA keeps mean/rstd in fp32; the CPU kernel in the input dtype.
    const DType stat = cuda_ ? DType::kF32 : xin.dtype;
    T mean = fresh(rows, stat);
    T rstd = fresh(rows, stat);
    T out = fresh(x.numel, xin.dtype);
    if (xin.requires_grad() || trainable(w) || trainable(b)) {
      requires_grad(out);
      Node nd = node(out);
      nd.saved = {xin.id, mean.id, rstd.id};
      if (xin.requires_grad()) nd.inputs.push_back(grad_of(xin));
      if (trainable(w)) nd.params.push_back(param_grad(w, xin.dtype));
      if (trainable(b)) nd.params.push_back(param_grad(b, xin.dtype));
      t_.record(std::move(nd));
    }
    t_.drop(mean);
    t_.drop(rstd);
    t_.drop(xin);
    return out;
  }

  // Dropout with p > 0 in training. CUDA's fused kernel saves a bool mask; the CPU path saves
  // the scaled noise in the input dtype (ATen Dropout.cpp).
  T dropout(const T& x) {
    T mask = cuda_ ? fresh(x.numel, DType::kU8) : fresh(x.numel, x.dtype);
    T y = elementwise({&x}, x.numel, x.dtype, {mask.id});
    t_.drop(mask);
    return y;
  }

  // Rotary embedding applied to q or k (apply_rotary_pos_emb): q*cos + rotate_half(q)*sin.
  // cos/sin carry the residual dtype, so under autocast the result is fp32.
  T rope(const T& q) {
    DType d = promote(q.dtype, cos_.dtype);
    T a = elementwise({&q}, q.numel, d, {cos_.id});
    T neg = elementwise({&q}, q.numel / 2, q.dtype, {});
    T rot = fresh(q.numel, q.dtype);  // cat((-x2, x1))
    if (q.requires_grad()) {
      requires_grad(rot);
      Node nd = node(rot);
      nd.inputs.push_back(GradIn{neg.value, neg.bytes(), false});
      nd.inputs.push_back(GradIn{q.value, q.bytes(), false});
      t_.record(std::move(nd));
    }
    t_.drop(neg);
    T b = elementwise({&rot}, q.numel, d, {sin_.id});
    t_.drop(rot);
    T y = add(a, b);
    t_.drop(a);
    t_.drop(b);
    y.bshd = q.bshd;  // elementwise outputs follow their strided input's layout
    return y;
  }

  // repeat_kv: expand + reshape copies K/V up to the query heads (no copy when groups == 1).
  T repeat_kv(const T& x) {
    const std::uint64_t groups = a_.num_heads / a_.num_kv_heads;
    if (groups == 1) return t_.ref(x);
    return elementwise({&x}, x.numel * groups, x.dtype, {});
  }

  // matmul of 4-D operands folds [b, heads] into one batch dimension with reshape before bmm.
  // An operand laid out as [b, s, heads, d] (a projection view, or an elementwise result that
  // kept its layout) folds as a view only when b == 1; otherwise reshape copies it, and bmm
  // saves the copy instead of the operand (checked with torch 2.13: expand + view for b = 1,
  // expand + clone + _unsafe_view for b = 2).
  bool folds_with_copy(const T& x) const { return x.bshd && B_ > 1; }

  T attention_core(T& q, T& k, T& v) {
    const std::uint64_t heads = a_.num_heads, d = a_.head_dim;
    const std::uint64_t qn = tok_ * heads * d;
    const std::uint64_t scores = B_ * heads * S_ * S_;
    const DType c = pol_.autocast ? pol_.compute : q.dtype;
    if (attention_ == Attention::kEager) {
      op("self_attn.attn_weights");
      T kr = repeat_kv(k);
      T vr = repeat_kv(v);
      // matmul reshapes each operand to 3-D for bmm (see folds_with_copy).
      auto for_bmm = [&](const T& x) {
        T y = pol_.autocast ? to(x, c) : t_.ref(x);
        y.bshd = x.bshd;
        if (!folds_with_copy(y)) return y;
        T copy = elementwise({&y}, y.numel, y.dtype, {});
        t_.drop(y);
        return copy;
      };
      T qc = for_bmm(q);
      T kc = for_bmm(kr);
      t_.drop(kr);
      ensure_workspace(false);
      T s0 = bmm(qc, kc, scores, c);  // q @ k^T
      t_.drop(qc);
      t_.drop(kc);
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
      t_.drop(s2);
      T p32 = softmax(s32);
      t_.drop(s32);
      T p = to(p32, q.dtype);  // .to(query.dtype): fp32 under autocast, so a no-op there
      t_.drop(p32);
      op("self_attn.attn_output");
      T pc = pol_.autocast ? to(p, c) : t_.ref(p);
      t_.drop(p);
      T vc = for_bmm(vr);
      t_.drop(vr);
      T o = bmm(pc, vc, qn, c);  // probs @ v
      t_.drop(pc);
      t_.drop(vc);
      T oc = elementwise({&o}, qn, c, {});  // transpose(1, 2).contiguous()
      t_.drop(o);
      return oc;
    }
    // SDPA / flash-attention: q, k, v (as passed), the output and the fp32 log-sum-exp are
    // saved; scores never exist. Without padding HF passes native GQA (enable_gqa).
    op("self_attn.sdpa");
    const bool gqa_native = a_.num_kv_heads != a_.num_heads;
    T qc = pol_.autocast ? to(q, c) : t_.ref(q);
    T kc = pol_.autocast ? to(k, c) : t_.ref(k);
    T vc = pol_.autocast ? to(v, c) : t_.ref(v);
    T o = fresh(qn, c);
    T lse = fresh(B_ * heads * S_, DType::kF32);
    if (qc.requires_grad() || kc.requires_grad() || vc.requires_grad()) {
      requires_grad(o);
      Node nd = node(o);
      nd.saved = {qc.id, kc.id, vc.id, o.id, lse.id};
      for (const T* x : {&qc, &kc, &vc}) nd.inputs.push_back(fused_grad_of(*x));
      // Flash backward (flash_api.cpp mha_bwd): a contiguous copy of grad_out, fp32 dq_accum,
      // fp32 softmax_d, and with GQA dk/dv at the query head count before the group sum.
      nd.scratch = {qn * dtype_bytes(c), qn * 4, B_ * heads * S_ * 4};
      if (gqa_native) nd.scratch.insert(nd.scratch.end(), {qn * dtype_bytes(c), qn * dtype_bytes(c)});
      t_.record(std::move(nd));
    }
    t_.drop(lse);
    t_.drop(qc);
    t_.drop(kc);
    t_.drop(vc);
    // The flash kernels allocate their output with q's layout. When q is laid out as
    // [b, s, heads, d] (a projection view), HF's transpose(1, 2).contiguous() is a no-op and
    // o_proj saves the very storage SDPA saved; otherwise (Phi-3's cat) it copies.
    if (q.bshd) return o;
    T oc = elementwise({&o}, qn, c, {});
    t_.drop(o);
    return oc;
  }

  // Note [GPT-2 attention]
  // q, k and v are strided views into the Conv1D output (split + view + transpose), which
  // changes what the kernels copy and save (transformers models/gpt2/modeling_gpt2.py):
  //  * eager: matmul reshapes each strided operand for bmm, so with b > 1 q, k^T and v are
  //    copied and the copies saved (b = 1: the views, so the Conv1D output; folds_with_copy);
  //    softmax takes no dtype argument (CUDA autocast runs it in fp32, CPU autocast in the
  //    input dtype), .type(value.dtype) casts back, and attention dropout (attn_pdrop, 0.1) is
  //    active in training; the output is transposed and copied.
  //  * sdpa on CUDA: the flash kernel takes the views (their storage, the Conv1D output, is
  //    what stays saved) and supports dropout; the output needs no copy.
  //  * sdpa on CPU with dropout: no fused kernel takes dropout, so the math kernel runs: half
  //    inputs are upcast to fp32 (contiguous copies), q and k^T are scaled separately (the
  //    products keep their operand's layout) and folded for bmm as in eager, the causal mask
  //    is built as [s, s] bool and float, softmax and the dropout noise and output
  //    are saved, and the result is cast back.
  T gpt2_attention_core(T& q, T& k, T& v) {
    const std::uint64_t heads = a_.num_heads;
    const std::uint64_t qn = q.numel, scores = B_ * heads * S_ * S_;
    const DType c = q.dtype;  // the Conv1D output dtype: the compute dtype
    auto copy = [&](const T& x, DType d) { return elementwise({&x}, x.numel, d, {}); };
    auto drop_out = [&](T& x) {  // dropout(p > 0) on probabilities: see dropout()
      T y = dropout(x);
      t_.drop(x);
      x = y;
    };
    if (attention_ == Attention::kEager) {
      op("attn.attn_weights");
      T qc = folds_with_copy(q) ? copy(q, c) : t_.ref(q);
      T kc = folds_with_copy(k) ? copy(k, c) : t_.ref(k);
      ensure_workspace(false);
      T s0 = bmm(qc, kc, scores, c);
      t_.drop(qc);
      t_.drop(kc);
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
      drop_out(pv);
      op("attn.attn_output");
      T vc = folds_with_copy(v) ? copy(v, v.dtype) : t_.ref(v);
      T o = bmm(pv, vc, qn, c);
      t_.drop(pv);
      t_.drop(vc);
      T oc = copy(o, c);  // transpose(1, 2).reshape(...).contiguous()
      t_.drop(o);
      return oc;
    }
    if (cuda_) {
      op("attn.sdpa");
      T o = fresh(qn, c);
      T lse = fresh(B_ * heads * S_, DType::kF32);
      if (q.requires_grad() || k.requires_grad() || v.requires_grad()) {
        requires_grad(o);
        Node nd = node(o);
        nd.saved = {q.id, k.id, v.id, o.id, lse.id};
        for (const T* x : {&q, &k, &v}) nd.inputs.push_back(fused_grad_of(*x));
        nd.scratch = {qn * dtype_bytes(c), qn * 4, B_ * heads * S_ * 4};
        t_.record(std::move(nd));
      }
      t_.drop(lse);
      return o;
    }
    // CPU: the math kernel (aten _scaled_dot_product_attention_math).
    op("attn.sdpa_math");
    const DType md = DType::kF32;
    T causal = fresh(S_ * S_, DType::kU8);
    T fmask = fresh(S_ * S_, md);
    t_.drop(causal);
    T qa = to(q, md), ka = to(k, md), va = to(v, md);
    T qs = elementwise({&qa}, qn, md, {});  // q * sqrt(scale)
    T ks = elementwise({&ka}, qn, md, {});  // k^T * sqrt(scale)
    qs.bshd = ks.bshd = q.dtype == md;       // a view of the Conv1D output when not upcast
    T qc = folds_with_copy(qs) ? copy(qs, md) : t_.ref(qs);
    T kc = folds_with_copy(ks) ? copy(ks, md) : t_.ref(ks);
    t_.drop(qs);
    t_.drop(ks);
    ensure_workspace(false);
    T sc = bmm(qc, kc, scores, md);  // the mask is added in place
    t_.drop(qc);
    t_.drop(kc);
    T p = softmax(sc);  // _safe_softmax
    t_.drop(sc);
    t_.drop(fmask);
    drop_out(p);
    va.bshd = v.dtype == md;
    T vc = folds_with_copy(va) ? copy(va, md) : t_.ref(va);
    T o = bmm(p, vc, qn, md);
    t_.drop(vc);
    T oc = to(o, c);
    t_.drop(o);
    T pw = to(p, c);  // the returned attention weights, dropped by the caller
    t_.drop(pw);
    t_.drop(p);
    t_.drop(qa);
    t_.drop(ka);
    t_.drop(va);
    T out = copy(oc, c);  // transpose(1, 2).reshape(...).contiguous()
    t_.drop(oc);
    return out;
  }

  T attention(const T& x, const LayerParams& lp) {
    const std::uint64_t heads = a_.num_heads, kvh = a_.num_kv_heads, d = a_.head_dim;
    const std::uint64_t qw = heads * d, kvw = kvh * d;
    T q, k, v;
    if (lp.qkv != kNone) {
      T qkv = proj(x, a_.family == Family::kGpt2 ? "attn.c_attn" : "self_attn.qkv_proj", lp.qkv, lp.qkv_b,
                   qw + 2 * kvw);
      // Slices of one output: each slice's backward makes a full-size zero gradient of the
      // fused output (SliceBackward), summed into one.
      q = slice(qkv, qw);
      k = slice(qkv, kvw);
      v = slice(qkv, kvw);
      t_.drop(qkv);
    } else {
      q = proj(x, "self_attn.q_proj", lp.q, lp.q_b, qw);
      k = proj(x, "self_attn.k_proj", lp.k, lp.k_b, kvw);
      v = proj(x, "self_attn.v_proj", lp.v, lp.v_b, kvw);
    }
    // Note [Attention layouts]: q, k, v are views (view + transpose) of the projection outputs,
    // laid out as [b, s, heads, d]; rope keeps that layout, Phi-3's cat and repeat_kv make
    // contiguous [b, heads, s, d] tensors. Whether eager matmul copies an operand, and whether
    // the attention output needs a copy, follows from it.
    q.bshd = k.bshd = v.bshd = true;
    if (lp.q_norm != kNone) {
      T qn = rms_norm(q, lp.q_norm, tok_ * heads, "self_attn.q_norm");
      t_.drop(q);
      q = qn;
      T kn = rms_norm(k, lp.k_norm, tok_ * kvh, "self_attn.k_norm");
      t_.drop(k);
      k = kn;
      q.bshd = k.bshd = true;  // normalised over head_dim before the transpose
    }
    if (a_.family != Family::kGpt2) {
      op("self_attn.rotary");
      // Phi-3 rotates the first rotary_dim channels and concatenates the rest (empty with
      // partial_rotary_factor 1.0): torch.cat copies the rotated q and k once more.
      auto rotate = [&](T& x) {
        T r = rope(x);
        t_.drop(x);
        if (a_.family == Family::kPhi3) {
          T c = fresh(r.numel, r.dtype);
          if (r.requires_grad()) {
            requires_grad(c);
            Node nd = node(c);
            nd.inputs.push_back(pass_to(r));  // CatBackward hands on narrowed views
            t_.record(std::move(nd));
          }
          t_.drop(r);
          r = c;
        }
        x = r;
      };
      rotate(q);
      rotate(k);
    }
    T o = a_.family == Family::kGpt2 ? gpt2_attention_core(q, k, v) : attention_core(q, k, v);
    t_.drop(q);
    t_.drop(k);
    t_.drop(v);
    T y = proj(o, a_.family == Family::kGpt2 ? "attn.c_proj" : "self_attn.o_proj", lp.o, lp.o_b,
               a_.hidden_size);
    t_.drop(o);
    return a_.family == Family::kGpt2 ? gpt2_residual_dropout(y) : y;
  }

  T slice(const T& fused, std::uint64_t width) {
    T s;
    s.id = fused.id;
    t_.retain(s.id);
    s.dtype = fused.dtype;
    s.numel = tok_ * width;
    if (!fused.requires_grad()) return s;
    requires_grad(s);
    Node nd = node(s);
    nd.inputs.push_back(GradIn{fused.value, fused.bytes(), false});
    t_.record(std::move(nd));
    return s;
  }

  T mlp(const T& x, const LayerParams& lp) {
    const std::uint64_t i = a_.intermediate_size, n = tok_ * i;
    if (!a_.gated_mlp) {  // GPT-2: c_fc, gelu_new, c_proj
      T h = proj(x, "mlp.c_fc", lp.up, lp.up_b, i);
      op("mlp.act");
      T g = gelu_tanh(h);
      t_.drop(h);
      T y = proj(g, "mlp.c_proj", lp.down, lp.down_b, a_.hidden_size);
      t_.drop(g);
      return gpt2_residual_dropout(y);  // GPT2MLP's dropout
    }
    T gate, up;
    if (lp.gate_up != kNone) {
      T gu = proj(x, "mlp.gate_up_proj", lp.gate_up, kNone, 2 * i);
      gate = slice(gu, i);
      up = slice(gu, i);
      t_.drop(gu);
    } else {
      gate = proj(x, "mlp.gate_proj", lp.gate, lp.gate_b, i);
    }
    op("mlp.act_fn");
    T act = a_.activation == Activation::kSilu ? elementwise({&gate}, n, gate.dtype, {gate.id})
                                                : gelu_tanh(gate);
    if (lp.gate_up == kNone) {
      up = proj(x, "mlp.up_proj", lp.up, lp.up_b, i);
    }
    op("mlp.act_fn*up");
    T prod = mul(act, up, n, promote(act.dtype, up.dtype));
    t_.drop(act);
    t_.drop(up);
    t_.drop(gate);
    T y = proj(prod, "mlp.down_proj", lp.down, lp.down_b, a_.hidden_size);
    t_.drop(prod);
    return y;
  }

  // gelu(approximate="tanh") saves its input; GPT-2's NewGELUActivation spells the same formula
  // out in elementwise ops that save more (x, x^3 terms, tanh output).
  T gelu_tanh(const T& x) {
    if (a_.family == Family::kGpt2) {
      // 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
      T x3 = elementwise({&x}, x.numel, x.dtype, {x.id});            // pow(x, 3)
      T m1 = elementwise({&x3}, x.numel, x.dtype, {});               // * 0.044715
      t_.drop(x3);
      T s = add(x, m1);
      t_.drop(m1);
      T m2 = elementwise({&s}, x.numel, x.dtype, {});                // * sqrt(2/pi)
      t_.drop(s);
      T th = elementwise({&m2}, x.numel, x.dtype, {}, {}, /*save_output=*/true);  // tanh
      t_.drop(m2);
      T p1 = elementwise({&th}, x.numel, x.dtype, {});               // 1 + tanh
      t_.drop(th);
      T hx = elementwise({&x}, x.numel, x.dtype, {});                // 0.5 * x
      T y = elementwise({&hx, &p1}, x.numel, x.dtype, {hx.id, p1.id});
      t_.drop(hx);
      t_.drop(p1);
      return y;
    }
    return elementwise({&x}, x.numel, x.dtype, {x.id});
  }

  T decoder_layer(const T& x, std::uint32_t l) {
    const LayerParams& lp = layers_[l];
    layer_ = static_cast<std::int32_t>(l);
    const bool gpt2 = a_.family == Family::kGpt2;
    T n1 = gpt2 ? layer_norm(x, lp.in_norm, lp.in_norm_b, tok_, "ln_1")
                : rms_norm(x, lp.in_norm, tok_, "input_layernorm");
    T att = attention(n1, lp);  // GPT-2's residual dropout happens inside, as in GPT2Attention
    t_.drop(n1);
    att = post_norm(att, lp.post_attn_norm, "post_attention_layernorm");
    T h1 = residual_add(x, att);
    T n2 = gpt2 ? layer_norm(h1, lp.post_attn_norm, lp.post_attn_norm_b, tok_, "ln_2")
                : rms_norm(h1, a_.sandwich_norms ? lp.pre_ff_norm : lp.post_attn_norm, tok_,
                           a_.sandwich_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm");
    T m = mlp(n2, lp);
    t_.drop(n2);
    m = post_norm(m, lp.post_ff_norm, "post_feedforward_layernorm");
    T out = residual_add(h1, m);
    t_.drop(h1);
    return out;
  }

  // Gemma-2's sandwich norms: the sub-layer output is normalised again before the residual add
  // (after the layer has rebound hidden_states, so the sub-layer's input is already dropped).
  T post_norm(T y, std::uint32_t norm, std::string_view name) {
    if (!a_.sandwich_norms) return y;
    T pn = rms_norm(y, norm, tok_, name);
    t_.drop(y);
    return pn;
  }

  T gpt2_residual_dropout(T y) {
    T dr = dropout(y);
    t_.drop(y);
    return dr;
  }

  // residual + branch; the branch output is dropped, the residual stays with the caller.
  T residual_add(const T& residual, T& branch) {
    op("residual_add");
    T sum = add(residual, branch);
    t_.drop(branch);
    return sum;
  }


  // GradientCheckpointingLayer with use_reentrant=False: the forward keeps only the layer input;
  // backward recomputes the layer (recording its nodes) and runs them.
  T checkpointed_layer(const T& x, std::uint32_t l) {
    t_.saving = false;
    std::size_t before = t_.node_count();
    T out = decoder_layer(x, l);
    (void)before;
    t_.saving = true;
    // The nodes recorded without saves stand for the graph the checkpoint discards; replace
    // them by one checkpoint node (their grads flow through the recompute instead).
    drop_nodes_since(before);
    T y = out;
    requires_grad(y);
    Node nd = node(y);
    nd.tag.op = "checkpoint";
    // torch.utils.checkpoint (non-reentrant) saves the positional tensor arguments (the hidden
    // states) with save_for_backward; the keyword arguments (mask, position embeddings,
    // position ids) are only referenced by the recompute closure.
    nd.saved = {x.id};
    for (const T* shared : {&cos_, &sin_, &mask_, &position_ids_}) {
      if (shared->id != kNone) nd.kept.push_back(shared->id);
    }
    T xin = x, cos = cos_, sin = sin_, mask = mask_;
    std::int32_t layer = static_cast<std::int32_t>(l);
    nd.recompute = [this, xin, cos, sin, mask, l, layer]() {
      Phase keep = phase_;
      phase_ = Phase::kForward;  // labelled "recompute" (the tape knows it is recomputing)
      std::string_view keep_op = op_;
      cos_ = cos;
      sin_ = sin;
      mask_ = mask;
      T o = decoder_layer(xin, l);
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

  void drop_nodes_since(std::size_t n) { t_.truncate_nodes(n); }

  // ---------------------------------------------------------------- the step
  ValueId forward_and_loss() {
    phase_ = Phase::kForward;
    layer_ = kNoLayer;
    dp_.pre_forward();
    const std::uint64_t h = a_.hidden_size;
    const bool gpt2 = a_.family == Family::kGpt2;
    op(gpt2 ? "wte" : "embed_tokens");
    std::uint32_t emb = global(gpt2 ? "wte.weight" : "embed_tokens.weight");
    T hs = fresh(tok_ * h, pol_.param);
    if (trainable(emb)) {
      requires_grad(hs);
      Node nd = node(hs);
      nd.saved = {input_ids_.id};
      // embedding_dense_backward: a dense weight-sized gradient; the CUDA kernel also sorts the
      // indices (sorted ids, original positions, segment offsets: int64 each), the CPU one not.
      nd.params.push_back(param_grad(emb, pol_.param, cuda_ ? tok_ * 8 * 3 : 0));
      t_.record(std::move(nd));
    }
    if (a_.embedding_scale) {  // inside the module (Gemma2TextScaledWordEmbedding)
      T scaled = elementwise({&hs}, hs.numel, hs.dtype, {});
      t_.drop(hs);
      hs = scaled;
    }
    // The model's forward keeps `inputs_embeds` (GPT-2 also `position_embeds`) to its return.
    T inputs_embeds = t_.ref(hs);
    T position_embeds;
    if (!trainable(emb) && r_.checkpointing == Checkpointing::kFull) {
      // enable_input_require_grads' hook on the module's output (Note [LoRA]): a leaf that
      // requires grad, held by its AccumulateGrad node until the graph is freed.
      requires_grad(hs);
      input_leaf_ = t_.ref(hs);
    }
    if (gpt2) {
      op("wpe");
      std::uint32_t wpe = global("wpe.weight");
      // position_ids = arange(s) + past_seen_tokens: GPT2Model.forward keeps it and hands it to
      // every block as a keyword argument (a checkpoint's closure keeps it to that layer's
      // backward); the embedding's backward saves it too when wpe trains.
      T ar = fresh(S_, DType::kI64);
      position_ids_ = fresh(S_, DType::kI64);
      t_.drop(ar);
      T pe = fresh(S_ * h, pol_.param);
      if (trainable(wpe)) {
        requires_grad(pe);
        Node nd = node(pe);
        nd.saved = {position_ids_.id};
        nd.params.push_back(param_grad(wpe, pol_.param, cuda_ ? S_ * 8 * 3 : 0));
        t_.record(std::move(nd));
      }
      T sum = add(hs, pe);
      t_.drop(hs);
      position_embeds = pe;
      op("drop");
      hs = dropout(sum);
      t_.drop(sum);
    }
    // Causal mask: eager attention materialises [b, 1, s, s] in the embedding dtype; SDPA and
    // flash use is_causal with no mask when there is no padding.
    if (attention_ == Attention::kEager) {
      op("causal_mask");
      T boolean = fresh(B_ * S_ * S_, DType::kU8);
      mask_ = fresh(B_ * S_ * S_, hs.dtype);
      t_.drop(boolean);
    }
    if (!gpt2) {
      // position_ids = arange(s) + past_seen_tokens (kept by the model's forward).
      op("position_ids");
      T ar = fresh(S_, DType::kI64);
      position_ids_ = fresh(S_, DType::kI64);
      t_.drop(ar);
      // LlamaRotaryEmbedding: freqs = position_ids[..., None].float() * inv_freq;
      // emb = cat(freqs, freqs); cos/sin = emb.cos()/sin() * attention_scaling, cast to x.dtype.
      op("rotary_emb");
      const std::uint64_t d = a_.head_dim;
      T pf = fresh(S_, DType::kF32);
      T freqs = fresh(S_ * d / 2, DType::kF32);
      t_.drop(pf);
      T emb = fresh(S_ * d, DType::kF32);
      t_.drop(freqs);
      auto trig = [&]() {
        T raw = fresh(S_ * d, DType::kF32);
        T scaled = fresh(S_ * d, DType::kF32);
        t_.drop(raw);
        if (hs.dtype == DType::kF32) return scaled;
        T cast = fresh(S_ * d, hs.dtype);
        t_.drop(scaled);
        return cast;
      };
      cos_ = trig();
      sin_ = trig();
      t_.drop(emb);
    }
    for (std::uint32_t l = 0; l < a_.num_layers; ++l) {
      dp_.layer_pre_forward(l);
      T next = r_.checkpointing == Checkpointing::kFull ? checkpointed_layer(hs, l) : decoder_layer(hs, l);
      dp_.layer_post_forward(l);
      t_.drop(hs);
      hs = next;
    }
    layer_ = kNoLayer;
    T normed = gpt2 ? layer_norm(hs, global("ln_f.weight"), global("ln_f.bias"), tok_, "ln_f")
                    : rms_norm(hs, global("norm.weight"), tok_, "norm");
    t_.drop(hs);
    if (mask_.id != kNone) t_.drop(mask_);
    if (cos_.id != kNone) {
      t_.drop(cos_);
      t_.drop(sin_);
    }
    if (position_ids_.id != kNone) t_.drop(position_ids_);
    t_.drop(inputs_embeds);
    if (position_embeds.id != kNone) t_.drop(position_embeds);
    ValueId loss = r_.loss == Loss::kFused ? fused_loss(normed, emb) : standard_loss(normed, emb);
    exit_autocast();
    return loss;
  }

  std::uint32_t lm_head_param(std::uint32_t emb) const {
    return a_.tie_word_embeddings ? emb : global("lm_head.weight");
  }

  // ForCausalLMLoss (loss_utils.py): logits.float(), labels padded by one and shifted, then
  // cross_entropy = log_softmax (saves its output) + nll_loss.
  ValueId standard_loss(T& normed, std::uint32_t emb) {
    const std::uint64_t V = a_.vocab_size;
    op("lm_head");
    T logits = linear(normed, lm_head_param(emb), kNone, V);
    t_.drop(normed);
    if (a_.final_logit_softcap > 0) {  // Gemma-2: logits / cap, tanh, * cap
      T d1 = elementwise({&logits}, logits.numel, logits.dtype, {});
      t_.drop(logits);
      T th = elementwise({&d1}, d1.numel, d1.dtype, {}, {}, /*save_output=*/true);
      t_.drop(d1);
      logits = elementwise({&th}, th.numel, th.dtype, {});
      t_.drop(th);
    }
    phase_ = Phase::kLoss;
    op("loss");
    T up = to(logits, DType::kF32);
    T padded = fresh(tok_ + B_, DType::kI64);
    T shifted = fresh(tok_, DType::kI64);
    t_.drop(padded);
    T logp = fresh(logits.numel, DType::kF32);
    requires_grad(logp);
    {
      Node nd = node(logp);
      nd.saved = {logp.id};
      nd.inputs.push_back(grad_of(up));
      t_.record(std::move(nd));
    }
    t_.drop(up);
    T loss = fresh(1, DType::kF32);
    T total_weight = fresh(1, DType::kF32);
    requires_grad(loss);
    {
      Node nd = node(loss);
      nd.saved = {logp.id, shifted.id, total_weight.id};
      nd.inputs.push_back(grad_of(logp));
      t_.record(std::move(nd));
    }
    t_.drop(logp);
    t_.drop(shifted);
    t_.drop(total_weight);
    // The model output (logits) is dropped with the output object, before backward.
    t_.drop(logits);
    return scale_loss(loss);
  }

  // Chunked linear + cross-entropy, `--loss fused`: the reference is the tracker's
  // python/trainmem/measure/fused_loss.py (see its Note [Fused loss allocations]); it behaves
  // like Liger-Kernel's fused linear cross-entropy. The gradients of the hidden states and of
  // the lm_head weight are computed in the forward, chunk by chunk; full logits never exist.
  ValueId fused_loss(T& hidden, std::uint32_t emb) {
    const std::uint64_t V = a_.vocab_size, h = a_.hidden_size, rows = tok_;
    phase_ = Phase::kLoss;
    op("fused_linear_cross_entropy");
    const std::uint32_t w = lm_head_param(emb);
    const DType cd = pol_.autocast ? pol_.compute : pol_.param;
    const DType md = cd == DType::kF32 ? DType::kF32 : DType::kF32;  // the math dtype is fp32
    const std::uint64_t cb = dtype_bytes(cd);
    // shift_labels: pad by one ignore_index, drop the first column, contiguous.
    T padded = fresh(rows + B_, DType::kI64);
    T targets = fresh(rows, DType::kI64);
    t_.drop(padded);
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
    return scale_loss(loss);
  }

  ValueId scale_loss(T& loss) {
    // (loss / grad_accum).backward(); fp16-mixed goes through GradScaler.scale(), which makes
    // its scale and growth tracker on first use and multiplies the loss by the scale.
    T scaled = elementwise({&loss}, 1, DType::kF32, {});
    if (is_zero(r_.parallel)) {
      // See Note [DeepSpeed ZeRO-1/2]: engine.backward(loss) divides by the accumulation steps
      // (gas_scaled_loss, which it returns) and multiplies by the loss scale (1.0 for bf16 and
      // fp32: LossScaler.scale_loss), and the caller keeps `loss` until backward returns.
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

  void backward(ValueId loss) {
    phase_ = Phase::kBackward;
    dp_.backward_begin();
    t_.at(Phase::kBackward, kNoLayer, "loss");
    ensure_workspace(true);
    t_.backward(loss);
    dp_.backward_end();
    t_.drop(pending_loss_);
    for (T& l : zero_losses_) t_.drop(l);
    zero_losses_.clear();
    if (input_leaf_.id != kNone) t_.drop(input_leaf_);
  }

  // ---------------------------------------------------------------- optimizer
  // bitsandbytes' two 256-entry fp32 quantization maps (signed and unsigned dynamic).
  // optimizer.state holds them (qmap1, qmap2) only for a tensor with 8-bit states (4096 elements
  // or more); when every trainable tensor is smaller (small LoRA adapters) they are temporaries
  // that live as long as the optimizer.
  void bnb_quantization_maps() {
    bool eight_bit = false;
    for (const Param& p : params_) eight_bit = eight_bit || (p.trainable && p.numel >= 4096);
    const Category c = eight_bit ? Category::kOptimizerStates : Category::kTemporaries;
    states_.push_back(t_.alloc_bytes(256 * 4, c));
    states_.push_back(t_.alloc_bytes(256 * 4, c));
  }

  void optimizer_step(bool first) {
    phase_ = Phase::kOptimizer;
    layer_ = kNoLayer;
    dp_.before_optimizer();
    TensorId found_inf = kNone;
    if (r_.precision == Precision::kFp16Mixed) {
      // GradScaler.step → unscale_: found_inf and the inverse scale, gradients unscaled in place.
      op("grad_scaler.unscale_");
      found_inf = t_.alloc_bytes(4, Category::kOther);
      TensorId inv_scale = t_.alloc_bytes(4, Category::kOther);
      t_.release(inv_scale);
    }
    // An optimizer that takes the scaling itself (fused AdamW: _step_supports_amp_scaling) is
    // handed optimizer.found_inf = sum(found_inf per device), a new 0-dim tensor that lives
    // through optimizer.step() (state creation included) and is deleted after it.
    TensorId found_inf_sum = kNone;
    if (r_.precision == Precision::kFp16Mixed && r_.optimizer == Optimizer::kAdamWFused) {
      found_inf_sum = t_.alloc_bytes(4, Category::kTemporaries);
    }
    if (pol_.master && !dp_.zero()) {
      // fp32 gradients for the master copy, parameter by parameter; the half .grad goes.
      op("optimizer.master_grads");
      for (Param& p : params_) {
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
    for (const Param& p : params_) {
      if (p.trainable) opt.push_back(&p);
    }
    // ZeRO hands the torch optimizer one parameter: this rank's fp32 master partition.
    Param zero_partition;
    if (dp_.zero()) {
      zero_partition.numel = dp_.zero_partition_numel();
      zero_partition.dtype = DType::kF32;
      opt = {&zero_partition};
    }
    auto sb_of = [&](const Param& p) { return dtype_bytes(pol_.master ? DType::kF32 : p.dtype); };
    // The elements this rank's optimizer holds of a parameter (FSDP2: its shard).
    auto numel_of = [&](const Param& p) { return dp_.local_numel(p.slot, p.numel); };
    switch (r_.optimizer) {
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
            states_.push_back(t_.alloc_bytes(numel_of(*p) * sb_of(*p), Category::kOptimizerStates));
            states_.push_back(t_.alloc_bytes(numel_of(*p) * sb_of(*p), Category::kOptimizerStates));
          }
        }
        if (r_.optimizer == Optimizer::kAdamW) {
          // foreach: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for the whole group, then
          // in-place ops; the list is freed at the end of the group's update. HF makes two
          // groups (weight decay / none); torch.optim with one group is the reference here.
          op("optimizer.foreach_sqrt");
          std::vector<TensorId> tmp;
          for (const Param* p : opt) {
            tmp.push_back(t_.alloc_bytes(numel_of(*p) * sb_of(*p), Category::kTemporaries));
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
          for (const Param* p : opt) {
            states_.push_back(t_.alloc_bytes(numel_of(*p) * sb_of(*p), Category::kOptimizerStates));
          }
        }
        break;
      }
      case Optimizer::kAdafactor: {
        // transformers.optimization.Adafactor, parameter by parameter (factored, no beta1).
        // State: row and column means of grad^2 for 2-D parameters, the full grad^2 average for
        // 1-D ones, in the dtype of the fp32 gradient copy; step and RMS are Python numbers.
        // Temporaries, all fp32 and parameter-sized (G): grad.float() and p.float() for half
        // parameters (alive for the whole update), grad**2 and grad**2 + eps, the factored
        // approximation (or rsqrt of the average), and -update for the final add.
        op(first ? "optimizer.adafactor_init" : "optimizer.adafactor");
        if (rms_.size() < opt.size()) rms_.assign(opt.size(), kNone);
        // _rms(x) = x.norm(2) / sqrt(numel): two 0-dim tensors, the norm freed.
        auto rms = [&]() {
          TensorId norm = t_.alloc_bytes(4, Category::kTemporaries);
          TensorId r = t_.alloc_bytes(4, Category::kTemporaries);
          t_.release(norm);
          return r;
        };
        for (std::size_t pi = 0; pi < opt.size(); ++pi) {
          const Param& p = *opt[pi];
          const std::uint64_t g = p.numel * 4;
          const bool half = p.dtype != DType::kF32 && !pol_.master;
          const bool factored = p.rows != 0;
          const std::uint64_t cols = factored ? p.numel / p.rows : 0;
          TensorId grad32 = half ? t_.alloc_bytes(g, Category::kTemporaries) : kNone;
          if (first) {
            if (factored) {
              states_.push_back(t_.alloc_bytes(p.rows * 4, Category::kOptimizerStates));
              states_.push_back(t_.alloc_bytes(cols * 4, Category::kOptimizerStates));
            } else {
              states_.push_back(t_.alloc_bytes(g, Category::kOptimizerStates));
            }
          }
          TensorId p32 = half ? t_.alloc_bytes(g, Category::kTemporaries) : kNone;
          TensorId r = rms();  // state["RMS"] replaces last step's
          t_.set_category(r, Category::kOptimizerStates);
          if (rms_[pi] != kNone) t_.release(rms_[pi]);
          rms_[pi] = r;
          TensorId sq = t_.alloc_bytes(g, Category::kTemporaries);   // grad ** 2
          TensorId upd = t_.alloc_bytes(g, Category::kTemporaries);  // + eps
          t_.release(sq);
          TensorId approx;
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
            approx = t_.alloc_bytes(g, Category::kTemporaries);
            t_.release(rf);
            t_.release(cf);
          } else {
            approx = t_.alloc_bytes(g, Category::kTemporaries);  // exp_avg_sq.rsqrt()
          }
          t_.release(upd);
          // update.div_((_rms(update) / clip_threshold).clamp_(min=1.0))
          TensorId ur = rms();
          TensorId clip = t_.alloc_bytes(4, Category::kTemporaries);
          t_.release(ur);
          t_.release(clip);
          TensorId neg = t_.alloc_bytes(g, Category::kTemporaries);  // p.add_(-update)
          t_.release(neg);
          t_.release(approx);
          t_.release(p32);
          t_.release(grad32);
        }
        break;
      }
    }
    if (found_inf_sum != kNone) t_.release(found_inf_sum);
    dp_.zero_after_optimizer();
    if (pol_.master) {
      op("optimizer.copy_to_half");  // in place: p.copy_(master)
    }
    if (found_inf != kNone) t_.release(found_inf);  // GradScaler.update() drops its per-step state
    op("optimizer.zero_grad");
    for (Param& p : params_) {
      TensorId g = t_.param_grad(p.slot);
      if (g != kNone) {
        t_.release(g);
        t_.set_param_grad(p.slot, kNone);
      }
    }
  }

  // ================================================================ generation
  // Note [Generation]
  // Mode::kInference mirrors one call of transformers 5.24's model.generate() with the reference
  // arguments of docs/schema.md (greedy or beam search, max_new_tokens, eos_token_id=None,
  // pad_token_id=0, use_cache=True, the default DynamicCache), model in eval mode, under
  // torch.no_grad(). Nothing requires grad, so no op records a node and nothing is saved: a
  // tensor lives exactly as long as a Python reference holds it. That makes the lifetimes of
  // the Python variables the whole story, and the builders below follow the modules' forward
  // code variable by variable (no grad: the training builders' order of frees is not the one
  // that counts here):
  //  * generate() before the first forward (generation/utils.py): the special tokens become
  //    0-dim int64 tensors (bos from the model config, pad; eos is None), kept by the generation
  //    config until generate returns; batch > 1 checks right padding (attention_mask[:, -1] ==
  //    0).any(); position_ids = attention_mask.cumsum(-1) - 1, masked_fill(mask == 0, 0) (kept
  //    by generate's model_kwargs to the end); an all-ones mask is dropped from model_kwargs
  //    ((mask == 1).all()), so no mask grows and SDPA runs without one; beam search expands
  //    input_ids and position_ids by repeat_interleave; the logits processors check
  //    (input_ids < 0).any();
  //  * every forward gets input_ids[:, -q:].clone() and position_ids[..., -q:].clone() (q = the
  //    prompt length for the prefill, no clone of position_ids then, 1 per decode step) from
  //    prepare_inputs_for_generation, logits_to_keep=1 (lm_head on the last position only), and
  //    the cache. The clones live until the next step's inputs replace them (the prefill's
  //    until _prefill returns);
  //  * DynamicLayer.update: keys = torch.cat([keys, key_states], dim=-2), the same for values.
  //    The prefill's cat with the empty initial tensor copies the new keys; every decode step
  //    allocates the grown cache and frees the old one. Cache tensors are `activations` (the
  //    measuring side's category for the KV cache), [batch·beams, kv_heads, len, head_dim];
  //  * after each forward (_sample): position_ids grow by cat (arange + last + 1), logits[:, -1]
  //    is copied to fp32 (.to(copy=True)), argmax, input_ids grow by cat, the stopping criteria
  //    (MaxLengthCriteria: full | full, ~, &) and max() == 0, then `del outputs` frees the logits;
  //  * SDPA: no mask, so GQA is native (enable_gqa) and there is no repeat_kv; eager builds the
  //    4-D float mask in every forward (masking_utils) and repeats K/V (Note [Generation masks]);
  //    sliding-window layers: Note [Sliding-window layers]; beam search: Note [Beam search];
  //  * when generate returns, its tensors go, then the output (the caller drops it), the cache
  //    (last layer first), then the caller's batch.
  // Every cpu-gen-* measurement of data/ground_truth matches this event by event (sizes,
  // categories and order; docs/mechanics_notes.md, "Generation").
  // max_new_tokens forwards run: the prefill (micro_batch 0) and new_tokens - 1 decode steps
  // (micro_batch i for the i-th).

  Trace build_generation() {
    if (r_.lora.enabled()) throw Error("lora_rank: inference with adapters is not modelled (merge them first)");
    const std::uint64_t N = r_.new_tokens, K = r_.beams;
    // Every forward of every layer is simulated: bound the work so the largest accepted input
    // finishes in seconds (Llama-3.1-70B: 80 layers x 3,276 new tokens).
    constexpr std::uint64_t kMaxLayerPasses = std::uint64_t{1} << 18;
    if (detail::mul(a_.num_layers, N, "layers * new_tokens") > kMaxLayerPasses) {
      throw Error("num_hidden_layers * new_tokens = " + std::to_string(a_.num_layers * N) +
                  " layer passes is more than trainmem simulates (" + std::to_string(kMaxLayerPasses) +
                  "); use fewer new_tokens");
    }
    Bg_ = detail::mul(B_, K, "batch * beams");
    const std::uint64_t total = S_ + N;
    detail::mul({Bg_, a_.num_heads + 2 * a_.num_kv_heads, total, a_.head_dim, 8}, "KV cache bytes");
    detail::mul({Bg_, a_.num_heads, S_, total, 8}, "attention scores bytes");
    detail::mul({Bg_, total, std::max({a_.hidden_size, a_.intermediate_size * 2, a_.vocab_size}), 8},
                "tokens * width bytes");
    t_.step = 1;
    t_.micro = 0;
    t_.at(Phase::kSetup, kNoLayer, "model");
    create_parameters();
    for (Param& p : params_) p.trainable = false;  // eval under no_grad: nothing requires grad
    t_.at(Phase::kSetup, kNoLayer, "batch");
    input_ids_ = t_.make(tok_, DType::kI64, Category::kOther);
    T attention_mask = t_.make(tok_, DType::kI64, Category::kOther);  // kept by the caller
    kc_.assign(a_.num_layers, T{});
    vc_.assign(a_.num_layers, T{});
    window_ = model::attention_windows(a_);
    stored_.assign(a_.num_layers, 0);
    swt_.assign(a_.num_layers, T{});

    phase_ = Phase::kPrefill;
    layer_ = kNoLayer;
    // ---- generate(): before the first forward
    op("generate.special_tokens");
    T bos = a_.bos_token ? fresh(1, DType::kI64) : T{};  // bos_token_id from the model config
    T pad = fresh(1, DType::kI64);                    // pad_token_id=0
    if (B_ > 1) {
      op("generate.padding_check");
      T last = fresh(B_, DType::kU8);
      T any = fresh(1, DType::kU8);
      t_.drop(last);
      t_.drop(any);
    }
    op("generate.position_ids");
    T cs = fresh(tok_, DType::kI64);
    T m1 = fresh(tok_, DType::kI64);
    t_.drop(cs);
    T zero = fresh(tok_, DType::kU8);
    T pos0 = fresh(tok_, DType::kI64);
    t_.drop(zero);
    t_.drop(m1);
    op("generate.mask_check");
    {
      T eq = fresh(tok_, DType::kU8);
      T all = fresh(1, DType::kU8);
      t_.drop(eq);
      t_.drop(all);
    }
    T ids = t_.ref(input_ids_);  // the growing input_ids
    T pos = t_.ref(pos0);        // model_kwargs["position_ids"] of the decoding loop
    T pos_expanded;
    if (K > 1) {
      // _expand_inputs_for_generation: repeat_interleave(K, dim=0) of input_ids, then of the
      // tensors in model_kwargs (position_ids).
      op("generate.expand_inputs");
      T ie = expand_rows(ids);
      t_.drop(ids);
      ids = ie;
      pos_expanded = expand_rows(pos);
      t_.drop(pos);
      pos = t_.ref(pos_expanded);
      t_.drop(pos0);  // generate's model_kwargs now holds the expanded position_ids
    }
    if (!cuda_) {
      // _prepare_cache_for_generation: DynamicCache(config=...); each sliding layer makes its
      // window tensor on the CPU (Note [Sliding-window layers]).
      op("generate.prepare_cache");
      for (std::size_t l = 0; l < window_.size(); ++l) {
        if (window_[l] > 0) swt_[l] = fresh(1, DType::kI64);
      }
    }
    op("generate.logits_processor");
    {
      T lt = fresh(tok_, DType::kU8);
      T any = fresh(1, DType::kU8);
      t_.drop(lt);
      t_.drop(any);
    }
    T beam_output;  // beam search returns a view of its `sequences`
    if (K > 1) {
      beam_output = beam_search(pos);
    } else {
      greedy(ids, pos);  // ids becomes the output
    }
    // generate() returns: the generation config's token tensors and generate's model_kwargs go.
    phase_ = Phase::kDecode;
    op("generate.return");
    if (bos.id != kNone) t_.drop(bos);
    t_.drop(pad);
    if (pos_expanded.id != kNone) {
      t_.drop(pos_expanded);
    } else {
      t_.drop(pos0);
    }
    t_.drop(ids);  // greedy: the returned sequences, dropped by the caller; beams: the expanded ids
    if (beam_output.id != kNone) t_.drop(beam_output);
    // The DynamicCache goes last (its list of layers is freed from the last layer to the first),
    // then the caller drops its batch.
    for (std::size_t l = kc_.size(); l-- > 0;) {
      t_.drop(kc_[l]);
      t_.drop(vc_[l]);
      if (swt_[l].id != kNone) t_.drop(swt_[l]);
    }
    t_.drop(input_ids_);
    t_.drop(attention_mask);
    TRAINMEM_ASSERT(t_.node_count() == 0, "generation recorded an autograd node");
    Trace trace = t_.take();
    trace.trainable_parameters = 0;  // eval under no_grad: nothing trains
    return trace;
  }

  // x.repeat_interleave(K, dim=0) for a [B, cols] int64 tensor (beam search's expansion).
  T expand_rows(const T& x) {
    return fresh(x.numel * r_.beams, x.dtype);
  }

  // One forward of generate's loop: prepare_inputs_for_generation, then the model.
  // Returns the logits [rows, V] (the CausalLM output's logits, held by `outputs`).
  T generation_forward(const T& pos, std::uint64_t q, std::uint32_t step, T& prev_ids_in,
                       T& prev_pos_in) {
    const bool prefill = step == 0;
    phase_ = prefill ? Phase::kPrefill : Phase::kDecode;
    t_.micro = step;
    layer_ = kNoLayer;
    op("generate.prepare_inputs");
    T ids_in = fresh(Bg_ * q, DType::kI64);  // input_ids[:, -q:].clone()
    T pos_in;
    if (prefill) {
      pos_in = t_.ref(pos);  // already as long as the inputs: passed as it is
    } else {
      pos_in = fresh(Bg_ * q, DType::kI64);  // position_ids[..., -q:].clone()
    }
    // model_inputs is rebound: last step's inputs go.
    if (prev_ids_in.id != kNone) t_.drop(prev_ids_in);
    if (prev_pos_in.id != kNone) t_.drop(prev_pos_in);
    q_ = q;
    past_ = prefill ? 0 : S_ + step - 1;
    T logits = model_forward();
    layer_ = kNoLayer;
    if (prefill) {
      // _prefill returns: its model_inputs go.
      t_.drop(ids_in);
      t_.drop(pos_in);
    } else {
      prev_ids_in = ids_in;
      prev_pos_in = pos_in;
    }
    return logits;
  }

  // _update_model_kwargs_for_generation: position_ids grow by one column.
  void grow_position_ids(T& pos, std::uint64_t len) {
    op("generate.update_position_ids");
    T ar = fresh(1, DType::kI64);          // arange(1)
    T a1 = fresh(Bg_, DType::kI64);        // + position_ids[..., -1:]
    t_.drop(ar);
    T a2 = fresh(Bg_, DType::kI64);        // + 1
    t_.drop(a1);
    T cat = fresh(Bg_ * (len + 1), DType::kI64);
    t_.drop(a2);
    t_.drop(pos);
    pos = cat;
  }

  // StoppingCriteriaList with MaxLengthCriteria only: is_done = full(False) | full(done);
  // unfinished = unfinished & ~is_done; then unfinished.max() == 0.
  void stopping_criteria(T& unfinished, std::uint64_t rows) {
    op("generate.stopping_criteria");
    T f1 = fresh(rows, DType::kU8);
    T f2 = fresh(rows, DType::kU8);
    T o = fresh(rows, DType::kU8);
    t_.drop(f2);
    t_.drop(f1);
    T n = fresh(rows, DType::kU8);
    t_.drop(o);
    T u = fresh(rows, DType::kI64);
    t_.drop(n);
    t_.drop(unfinished);
    unfinished = u;
    T mx = fresh(1, DType::kI64);
    T eq = fresh(1, DType::kU8);
    t_.drop(mx);
    t_.drop(eq);
  }

  // _sample with do_sample=False.
  void greedy(T& ids, T& pos) {
    const std::uint64_t N = r_.new_tokens, V = a_.vocab_size;
    op("generate.unfinished_sequences");
    T unfinished = fresh(Bg_, DType::kI64);
    T ids_in, pos_in, next_logits, next_tokens;
    for (std::uint32_t i = 0; i < N; ++i) {
      T logits = generation_forward(pos, i == 0 ? S_ : 1, i, ids_in, pos_in);
      const std::uint64_t len = S_ + i;
      grow_position_ids(pos, len);
      op("generate.next_token_logits");
      T nl = fresh(Bg_ * V, DType::kF32);  // logits[:, -1].to(copy=True, dtype=float32)
      if (next_logits.id != kNone) t_.drop(next_logits);
      next_logits = nl;
      op("generate.argmax");
      T nt = fresh(Bg_, DType::kI64);
      if (next_tokens.id != kNone) t_.drop(next_tokens);
      next_tokens = nt;
      op("generate.append_tokens");
      T grown = fresh(Bg_ * (len + 1), DType::kI64);
      t_.drop(ids);
      ids = grown;
      stopping_criteria(unfinished, Bg_);
      op("generate.del_outputs");
      t_.drop(logits);
    }
    // _sample returns: its model_kwargs (position_ids), the loop's locals.
    op("generate.return");
    t_.drop(pos);
    t_.drop(unfinished);
    if (ids_in.id != kNone) t_.drop(ids_in);
    if (pos_in.id != kNone) t_.drop(pos_in);
    t_.drop(next_logits);
    t_.drop(next_tokens);
  }

  // Note [Beam search]
  // _beam_search (generation/utils.py) with num_beams = K, beams_to_keep K2 = 2K (no eos), on
  // B prompts: the running and finished hypotheses are [B, K, max_length] int64 sequences,
  // [B, K] fp32 scores, [B, K, max_new_tokens] int32 beam indices and [B, K] bool flags, all
  // allocated before the prefill. Each step copies the last logits to fp32, takes log_softmax,
  // adds the running scores ([B, K, V] fp32), keeps the top K2 continuations, gathers the
  // sequences and indices they extend (take_along_dim: an int64 index broadcast, then the
  // gather), selects the next running beams and merges the finished ones (cat, topk, gather),
  // and reorders every layer's cache with index_select (a new tensor per layer, the old one
  // freed). Variables hold storages across iterations the way the loop binds them:
  // flat_running_sequences is a view of the last step's running_sequences (freed one step
  // late), beam_idx a view of running_beam_indices.
  // int32 (the beam indices): DType has no int32; only the size matters here, fp32's.
  static constexpr DType kInt32 = DType::kF32;

  struct BeamState {
    T running_sequences, sequences, running_beam_scores, beam_scores, is_sent_finished, unsat, hits,
        running_beam_indices, beam_indices, top_num_beam_mask;
    T topk_log_probs, topk_running_sequences, topk_running_beam_indices;
    T logits, log_probs, flat_view, beam_idx_view;
  };

  // take_along_dim(x, idx, dim=1): an int64 copy of the broadcast index (% size), then the gather.
  T gather_beams(std::uint64_t out_numel, DType d) {
    T idx = fresh(out_numel, DType::kI64);
    T y = fresh(out_numel, d);
    t_.drop(idx);
    return y;
  }

  void replace(T& var, T value) {
    if (var.id != kNone) t_.drop(var);
    var = value;
  }

  T beam_search(T& pos) {
    const std::uint64_t B = B_, K = r_.beams, K2 = 2 * K, N = r_.new_tokens, V = a_.vocab_size;
    const std::uint64_t L = S_ + N, G = N;
    BeamState s;
    op("generate.beam_search_init");
    if (cuda_) {
      s.top_num_beam_mask = fresh(K2, DType::kU8);  // built on the CPU, then .to(device)
    } else {
      T ones = fresh(K, DType::kU8);
      T zeros = fresh(K2 - K, DType::kU8);
      s.top_num_beam_mask = fresh(K2, DType::kU8);
      t_.drop(zeros);
      t_.drop(ones);
    }
    s.running_sequences = fresh(B * K * L, DType::kI64);
    s.sequences = fresh(B * K * L, DType::kI64);
    s.running_beam_scores = fresh(B * K, DType::kF32);
    if (!cuda_) {
      T scalar = fresh(1, DType::kF32);  // running_beam_scores[:, 1:] = -1e9 wraps the scalar (CPU)
      t_.drop(scalar);
    }
    s.beam_scores = fresh(B * K, DType::kF32);
    s.is_sent_finished = fresh(B * K, DType::kU8);
    s.unsat = fresh(B, DType::kU8);
    s.hits = fresh(B * K, DType::kU8);
    s.running_beam_indices = fresh(B * K * G, kInt32);
    s.beam_indices = fresh(B * K * G, kInt32);
    T ids_in, pos_in;
    for (std::uint32_t i = 0; i < N; ++i) {
      const std::uint64_t cur = S_ + i;
      if (i > 0) {
        // flat_running_sequences = running_sequences[:, :, :cur] flattened (a view)
        T view = t_.ref(s.running_sequences);
        replace(s.flat_view, view);
      }
      T model_logits = generation_forward(pos, i == 0 ? S_ : 1, i, ids_in, pos_in);
      grow_position_ids(pos, cur);
      op("generate.beam_scores");
      replace(s.logits, fresh(Bg_ * V, DType::kF32));  // logits[:, -1, :].to(copy=True, float32)
      replace(s.log_probs, fresh(Bg_ * V, DType::kF32));  // log_softmax
      t_.drop(model_logits);  // del model_outputs
      {
        T added = fresh(Bg_ * V, DType::kF32);  // + running_beam_scores[:, :, None]
        replace(s.log_probs, added);
      }
      // _get_top_k_continuations
      op("generate.top_k_continuations");
      T topk_indices = fresh(B * K2, DType::kI64);
      T topk_log_probs = fresh(B * K2, DType::kF32);
      T cur_beam = fresh(B * K2, DType::kI64);  // // vocab_size
      T trbi = gather_beams(B * K2 * G, kInt32);
      T trs = gather_beams(B * K2 * L, DType::kI64);
      T topk_ids = fresh(B * K2, DType::kI64);  // % vocab_size
      T ar = fresh(B, DType::kI64);
      T offset = fresh(B, DType::kI64);  // arange(B).view(-1, 1) * num_beams
      t_.drop(ar);
      T modified = fresh(B * K2, DType::kI64);
      t_.drop(topk_indices);
      t_.drop(cur_beam);
      t_.drop(topk_ids);
      t_.drop(offset);
      t_.drop(modified);
      replace(s.topk_log_probs, topk_log_probs);
      replace(s.topk_running_sequences, trs);
      replace(s.topk_running_beam_indices, trbi);
      // stopping_criteria on the flattened top-k sequences: [B * K2] flags
      op("generate.stopping_criteria");
      {
        T f1 = fresh(B * K2, DType::kU8);
        T f2 = fresh(B * K2, DType::kU8);
        T o = fresh(B * K2, DType::kU8);
        t_.drop(f2);
        t_.drop(f1);
        replace(s.hits, o);
      }
      // _get_running_beams_for_next_iteration
      op("generate.next_running_beams");
      {
        T hf = fresh(B * K2, DType::kF32);
        T hm = fresh(B * K2, DType::kF32);
        t_.drop(hf);
        T trlp = fresh(B * K2, DType::kF32);
        t_.drop(hm);
        T next_idx = fresh(B * K, DType::kI64);
        T vals = fresh(B * K, DType::kF32);
        t_.drop(vals);
        T rs = gather_beams(B * K * L, DType::kI64);
        T rbs = gather_beams(B * K, DType::kF32);
        T rbi = gather_beams(B * K * G, kInt32);
        t_.drop(trlp);
        t_.drop(next_idx);
        replace(s.running_sequences, rs);
        replace(s.running_beam_scores, rbs);
        replace(s.running_beam_indices, rbi);
      }
      // _update_finished_beams
      op("generate.update_finished_beams");
      {
        T did = fresh(B * K2, DType::kU8);
        T tlp = fresh(B * K2, DType::kF32);  // / length penalty
        T all = fresh(B, DType::kU8);
        T full = fresh(B, DType::kU8);  // & (early_stopping is True)
        t_.drop(all);
        T c1 = fresh(B, DType::kF32);
        T m1 = fresh(B, DType::kF32);
        t_.drop(c1);
        t_.drop(m1);  // added in place
        T n2 = fresh(B, DType::kU8);
        T c2 = fresh(B, DType::kF32);
        t_.drop(n2);
        T m2 = fresh(B, DType::kF32);
        t_.drop(c2);
        t_.drop(m2);
        T n3 = fresh(B * K2, DType::kU8);
        T m3 = fresh(B * K2, DType::kF32);
        t_.drop(n3);
        t_.drop(m3);
        const std::uint64_t KM = K + K2;
        T ms = fresh(B * KM * L, DType::kI64);
        T msc = fresh(B * KM, DType::kF32);
        T mbi = fresh(B * KM * G, kInt32);
        T mf = fresh(B * KM, DType::kU8);
        T idx = fresh(B * K, DType::kI64);
        T vals = fresh(B * K, DType::kF32);
        t_.drop(vals);
        T seq = gather_beams(B * K * L, DType::kI64);
        T bs = gather_beams(B * K, DType::kF32);
        T bi = gather_beams(B * K * G, kInt32);
        T fin = gather_beams(B * K, DType::kU8);
        for (T* x : {&tlp, &did, &full, &ms, &msc, &mbi, &mf, &idx}) t_.drop(*x);
        replace(s.sequences, seq);
        replace(s.beam_scores, bs);
        replace(s.beam_indices, bi);
        replace(s.is_sent_finished, fin);
      }
      // Reorder the cache: beam_idx is a view of running_beam_indices; each layer's keys and
      // values are index_select'ed into new tensors.
      op("generate.reorder_cache");
      replace(s.beam_idx_view, t_.ref(s.running_beam_indices));
      for (std::uint32_t l = 0; l < kc_.size(); ++l) {
        const std::uint64_t tokens = visible(l);  // a sliding layer's keys are a window view
        for (T* c : {&kc_[l], &vc_[l]}) {
          if (c->id == kNone) continue;
          T y = t_.make(Bg_ * a_.num_kv_heads * a_.head_dim * tokens, c->dtype, Category::kActivations);
          t_.drop(*c);
          *c = y;
        }
        stored_[l] = tokens;
      }
      // _check_early_stop_heuristic
      op("generate.early_stop_heuristic");
      {
        T best = fresh(B, DType::kF32);
        T mi = fresh(B, DType::kI64);
        T mv = fresh(B, DType::kF32);
        t_.drop(mi);
        T sc = fresh(1, DType::kF32);
        T worst = fresh(B * K, DType::kF32);
        t_.drop(sc);
        t_.drop(mv);
        T gt = fresh(B * K, DType::kU8);
        T any = fresh(B, DType::kU8);
        t_.drop(gt);
        T u = fresh(B, DType::kU8);
        t_.drop(any);
        t_.drop(best);
        t_.drop(worst);
        replace(s.unsat, u);
      }
      // _beam_search_has_unfinished_sequences: 0-dim flags
      op("generate.has_unfinished");
      {
        T improvement = fresh(1, DType::kU8);
        T all = fresh(1, DType::kU8);
        T a1 = fresh(1, DType::kU8);
        t_.drop(all);
        T open = fresh(1, DType::kU8);
        t_.drop(a1);
        T all2 = fresh(1, DType::kU8);
        T valid = fresh(1, DType::kU8);
        t_.drop(all2);
        T r1 = fresh(1, DType::kU8);
        T r2 = fresh(1, DType::kU8);
        t_.drop(r1);
        t_.drop(improvement);
        t_.drop(open);
        t_.drop(valid);
        t_.drop(r2);
      }
    }
    // After the loop: max_generated_length = ((beam_indices + 1).bool()).sum(1).max(), and
    // output_length = prompt + that (0-dim tensors); the output is a view of `sequences`.
    op("generate.finalize");
    T p1 = fresh(B * G, kInt32);
    T pb = fresh(B * G, DType::kU8);
    t_.drop(p1);
    T sum = fresh(B, DType::kI64);
    t_.drop(pb);
    T mx = fresh(1, DType::kI64);
    t_.drop(sum);
    T out_len = fresh(1, DType::kI64);
    op("generate.return");
    // _beam_search returns: its model_kwargs, then its locals in the order Python frees them.
    t_.drop(pos);
    for (T* x : {&s.top_num_beam_mask, &s.beam_indices, &s.running_sequences, &s.running_beam_scores,
                 &s.beam_scores, &s.is_sent_finished, &s.unsat, &s.hits, &s.flat_view, &ids_in, &pos_in,
                 &s.logits, &s.log_probs, &s.topk_log_probs, &s.topk_running_sequences,
                 &s.topk_running_beam_indices, &s.running_beam_indices, &s.beam_idx_view, &mx, &out_len}) {
      if (x->id != kNone) t_.drop(*x);
    }
    return s.sequences;
  }

  // ---- the model's forward under no_grad, on q_ new tokens per row with past_ cached.
  std::uint64_t rows() const { return Bg_ * q_; }

  T model_forward() {
    const std::uint64_t h = a_.hidden_size, n = rows() * h;
    const bool gpt2 = a_.family == Family::kGpt2;
    const DType dt = pol_.param;
    T embeds, pembeds, hs;
    if (gpt2) {
      op("wte");
      embeds = fresh(n, dt);
      op("wpe");
      pembeds = fresh(n, dt);  // position_ids come from generate: [rows, q]
      op("add");
      hs = fresh(n, dt);
    } else {
      op("embed_tokens");
      embeds = fresh(n, dt);
      if (a_.embedding_scale) {  // Gemma2TextScaledWordEmbedding: * embed_scale, inside the module
        T scaled = fresh(n, dt);
        t_.drop(embeds);
        embeds = scaled;
      }
      hs = t_.ref(embeds);  // hidden_states = inputs_embeds
    }
    std::vector<T> masks = generation_masks();
    if (!gpt2) generation_rotary();
    for (std::uint32_t l = 0; l < a_.num_layers; ++l) {
      T next = gpt2 ? g_gpt2_block(hs, l) : g_decoder_layer(hs, l);
      t_.drop(hs);
      hs = next;
    }
    layer_ = kNoLayer;
    T normed = gpt2 ? g_layer_norm(hs, "ln_f") : g_rms_norm(hs, global("norm.weight"), rows(), "norm");
    t_.drop(hs);
    // The base model returns: its locals go (inputs_embeds, then the position embeddings, last
    // element first; the masks).
    // Frame locals go in definition order: Qwen2/3 and Gemma-2 keep inputs_embeds in their
    // mask_kwargs dict, defined after the mask mapping; the others free the inputs_embeds
    // argument first.
    const bool embeds_in_mask_kwargs =
        a_.family == Family::kQwen2 || a_.family == Family::kQwen3 || a_.family == Family::kGemma2;
    if (embeds_in_mask_kwargs) {
      for (T& m : masks) t_.drop(m);
      t_.drop(embeds);
    } else {
      t_.drop(embeds);
      if (gpt2) t_.drop(pembeds);
      for (T& m : masks) t_.drop(m);
    }
    if (!gpt2) {
      t_.drop(sin_);
      t_.drop(cos_);
    }
    // lm_head on hidden_states[:, -1:, :] (logits_to_keep=1).
    op("lm_head");
    std::uint32_t emb = global(gpt2 ? "wte.weight" : "embed_tokens.weight");
    T last = t_.ref(normed);
    last.numel = Bg_ * h;
    T logits = linear(last, lm_head_param(emb), kNone, a_.vocab_size);
    t_.drop(last);
    if (a_.final_logit_softcap > 0) {  // Gemma-2: logits / cap, tanh, * cap (each rebinds)
      for (int k = 0; k < 3; ++k) {
        T y = fresh(logits.numel, logits.dtype);
        t_.drop(logits);
        logits = y;
      }
    }
    t_.drop(normed);  // the CausalLM forward returns
    return logits;
  }

  // ---- attention masks of one forward (masking_utils).
  // Note [Generation masks]
  // create_causal_mask / create_sliding_window_causal_mask build the mask from index vectors:
  // arange(batch), arange(1), arange(q) + q_offset, arange(kv) + kv_offset (int64), then the
  // mask function on broadcast views: causal is kv_idx <= q_idx ([1, 1, q, kv] bool); sliding
  // is and_masks(overlay, causal): a 0-dim True, (q_idx - window) [q], kv_idx > that, &, then
  // the causal le and another &. eager_mask turns it into [batch, 1, q, kv] of the hidden dtype
  // with torch.where(mask, zeros(()), min) (a 0-dim zero and the wrapped min). SDPA skips the
  // mask (None: is_causal, or q == 1) unless a sliding layer's window is reached (kv >= window),
  // where the bool mask is kept. Which masks a model builds: Llama, GPT-2 the causal one;
  // Mistral and Phi-3 one, sliding when the config has a window; Qwen2/3 the causal one plus a
  // sliding one when some layer slides; Gemma-2 both. The forward keeps them to its end.
  enum class MaskKind : std::uint8_t { kFull, kSliding };

  std::vector<MaskKind> mask_kinds() const {
    const bool any_sliding = std::any_of(window_.begin(), window_.end(), [](std::uint64_t w) { return w > 0; });
    switch (a_.family) {
      case Family::kGemma2: return {MaskKind::kFull, MaskKind::kSliding};
      case Family::kQwen2:
      case Family::kQwen3:
        if (any_sliding) return {MaskKind::kFull, MaskKind::kSliding};
        return {MaskKind::kFull};
      case Family::kMistral:
      case Family::kPhi3: return {any_sliding ? MaskKind::kSliding : MaskKind::kFull};
      default: return {MaskKind::kFull};
    }
  }

  std::uint64_t window_of_model() const {
    for (std::uint64_t w : window_) {
      if (w > 0) return w;
    }
    return 0;
  }

  std::vector<T> generation_masks() {
    std::vector<T> masks;
    const bool eager = attention_ == Attention::kEager;
    for (MaskKind kind : mask_kinds()) {
      const std::uint64_t W = kind == MaskKind::kSliding ? window_of_model() : 0;
      std::uint64_t kv = past_ + q_;
      if (W > 0 && past_ >= W) kv = W - 1 + q_;  // DynamicSlidingWindowLayer.get_mask_sizes
      // SDPA: no mask unless a sliding window is reached; flash-attention takes the window
      // as an argument and never gets a mask.
      if (!eager && (attention_ == Attention::kFlash || !(W > 0 && kv >= W))) continue;
      op(kind == MaskKind::kSliding ? "sliding_window_mask" : "causal_mask");
      T batch = fresh(Bg_, DType::kI64);
      T head = fresh(1, DType::kI64);
      T qa0 = fresh(q_, DType::kI64);
      T qa = fresh(q_, DType::kI64);
      t_.drop(qa0);
      T ka0 = fresh(kv, DType::kI64);
      T ka = fresh(kv, DType::kI64);
      t_.drop(ka0);
      const std::uint64_t qk = detail::mul(q_, kv, "mask size");
      T m;
      if (kind == MaskKind::kSliding) {
        T one = fresh(1, DType::kU8);
        T sub = fresh(q_, DType::kI64);
        T gt = fresh(qk, DType::kU8);
        t_.drop(sub);
        T a1 = fresh(qk, DType::kU8);
        t_.drop(gt);
        t_.drop(one);
        T le = fresh(qk, DType::kU8);
        m = fresh(qk, DType::kU8);
        t_.drop(le);
        t_.drop(a1);
      } else {
        m = fresh(qk, DType::kU8);
      }
      t_.drop(batch);
      t_.drop(head);
      t_.drop(qa);
      t_.drop(ka);
      if (eager) {
        T zero = fresh(1, pol_.param);
        T low = fresh(1, pol_.param);
        T w = fresh(detail::mul(Bg_, qk, "mask size"), pol_.param);
        t_.drop(low);
        t_.drop(zero);
        t_.drop(m);
        m = w;
      }
      masks.push_back(m);
    }
    return masks;
  }

  // LlamaRotaryEmbedding on position_ids [rows, q]: cos/sin [rows, q, rotary_dim], computed in
  // fp32 and cast to the hidden dtype at return.
  void generation_rotary() {
    op("rotary_emb");
    const std::uint64_t r = rows(), d = a_.head_dim;
    T pf = fresh(r, DType::kF32);                  // position_ids[:, None, :].float()
    T freqs = fresh(r * d / 2, DType::kF32);       // inv_freq @ positions
    t_.drop(pf);
    T emb = fresh(r * d, DType::kF32);             // cat((freqs, freqs))
    T c0 = fresh(r * d, DType::kF32);
    T cos = fresh(r * d, DType::kF32);             // * attention_scaling
    t_.drop(c0);
    T s0 = fresh(r * d, DType::kF32);
    T sin = fresh(r * d, DType::kF32);
    t_.drop(s0);
    if (pol_.param != DType::kF32) {
      cos_ = fresh(r * d, pol_.param);
      sin_ = fresh(r * d, pol_.param);
      t_.drop(freqs);
      t_.drop(emb);
      t_.drop(cos);
      t_.drop(sin);
    } else {
      t_.drop(freqs);
      t_.drop(emb);
      cos_ = cos;
      sin_ = sin;
    }
  }

  // RMSNorm without autograd (LlamaRMSNorm; Gemma2RMSNorm's (1 + weight) form).
  T g_rms_norm(const T& x, std::uint32_t w, std::uint64_t nrows, std::string_view name) {
    op(name);
    const std::uint64_t n = x.numel;
    const bool up = x.dtype != DType::kF32;
    if (a_.family == Family::kGemma2) {
      T h = up ? fresh(n, DType::kF32) : t_.ref(x);  // x.float()
      T sq = fresh(n, DType::kF32);
      T mean = fresh(nrows, DType::kF32);
      t_.drop(sq);
      T ve = fresh(nrows, DType::kF32);
      t_.drop(mean);
      T rs = fresh(nrows, DType::kF32);
      t_.drop(ve);
      T hn = fresh(n, DType::kF32);
      t_.drop(rs);
      t_.drop(h);  // _norm returns: its argument x.float() goes
      const std::uint64_t hw = params_[w].numel;
      T wf = params_[w].dtype != DType::kF32 ? fresh(hw, DType::kF32) : T{};
      T onep = fresh(hw, DType::kF32);  // 1.0 + weight.float()
      if (wf.id != kNone) t_.drop(wf);
      T out = fresh(n, DType::kF32);
      t_.drop(onep);
      t_.drop(hn);
      if (up) {
        T cast = fresh(n, x.dtype);  // type_as(x)
        t_.drop(out);
        out = cast;
      }
      return out;
    }
    T h = up ? fresh(n, DType::kF32) : t_.ref(x);  // hidden_states.to(float32)
    T sq = fresh(n, DType::kF32);                  // pow(2)
    T var = fresh(nrows, DType::kF32);             // mean(-1, keepdim=True), a local
    t_.drop(sq);
    T ve = fresh(nrows, DType::kF32);              // + eps
    T rs = fresh(nrows, DType::kF32);              // rsqrt
    t_.drop(ve);
    T hn = fresh(n, DType::kF32);                  // hidden_states * rsqrt(...)
    t_.drop(rs);
    t_.drop(h);
    T hc = up ? fresh(n, x.dtype) : t_.ref(hn);    // .to(input_dtype)
    T out = fresh(n, promote(params_[w].dtype, x.dtype));
    t_.drop(hc);
    t_.drop(hn);
    t_.drop(var);
    return out;
  }

  // nn.LayerNorm without autograd (GPT-2): the kernel's two statistics, then the output.
  T g_layer_norm(const T& x, std::string_view name) {
    op(name);
    const std::uint64_t r = x.numel / a_.hidden_size;
    const DType stat = cuda_ ? DType::kF32 : x.dtype;
    T s1 = fresh(r, stat);
    T s2 = fresh(r, stat);
    T out = fresh(x.numel, x.dtype);
    t_.drop(s2);
    t_.drop(s1);
    return out;
  }

  // apply_rotary_pos_emb on one of q, k: x*cos + rotate_half(x)*sin (Phi-3: then cat with the
  // pass-through channels).
  T g_rope(const T& x) {
    const std::uint64_t n = x.numel;
    T a = fresh(n, x.dtype);
    T neg = fresh(n / 2, x.dtype);
    T rot = fresh(n, x.dtype);
    t_.drop(neg);
    T b = fresh(n, x.dtype);
    t_.drop(rot);
    T y = fresh(n, x.dtype);
    t_.drop(a);
    t_.drop(b);
    if (a_.family == Family::kPhi3) {
      T c = fresh(n, x.dtype);
      t_.drop(y);
      y = c;
    }
    return y;
  }

  // DynamicLayer.update: keys = cat([keys, key_states], -2), values likewise.
  // DynamicSlidingWindowLayer.update: the same cat, then keys = full[:, :, -window + 1:] (a view:
  // the storage stays whole) and the full states go to attention; its `_sliding_window_tensor`
  // (torch.tensor(window), made on the CPU with the cache) moves to the device at the layer's
  // first update (Note [Sliding-window layers]).
  void cache_update(std::uint32_t l, const T& k, const T& v) {
    op("self_attn.kv_cache");
    if (cuda_ && window_[l] > 0 && swt_[l].id == kNone) swt_[l] = fresh(1, DType::kI64);
    const std::uint64_t tokens = visible(l) + q_;
    const std::uint64_t per = detail::mul({Bg_, a_.num_kv_heads, a_.head_dim, tokens}, "KV cache size");
    // DynamicLayer assigns each cat as it is made; the sliding layer makes both full states
    // before it rebinds keys and values to their windows.
    const bool sliding = window_[l] > 0;
    T kn = t_.make(per, k.dtype, Category::kActivations);
    if (!sliding && kc_[l].id != kNone) t_.drop(kc_[l]);
    T vn = t_.make(per, v.dtype, Category::kActivations);
    if (sliding && kc_[l].id != kNone) t_.drop(kc_[l]);
    kc_[l] = kn;
    if (vc_[l].id != kNone) t_.drop(vc_[l]);
    vc_[l] = vn;
    stored_[l] = tokens;
  }

  // Cached positions a layer hands on to the next update (a sliding layer keeps window - 1).
  std::uint64_t visible(std::uint32_t l) const {
    return window_[l] > 0 ? std::min(stored_[l], window_[l] - 1) : stored_[l];
  }

  // Whether this forward built a mask for layer l (see generation_masks).
  bool layer_has_mask(std::uint32_t l) const {
    if (attention_ == Attention::kEager) return true;
    if (attention_ == Attention::kFlash) return false;
    const std::uint64_t W = window_[l];
    return W > 0 && stored_[l] >= W;
  }

  // Attention of one layer on the cached keys and values; returns the output before o_proj,
  // laid out [rows, heads * head_dim]. q_bshd: q is laid out [b, s, heads, d] (a projection
  // view, or rope's elementwise output that kept that layout).
  T g_attention_core(const T& q, std::uint32_t l, bool q_bshd) {
    const std::uint64_t H = a_.num_heads, d = a_.head_dim, r = rows();
    const DType c = q.dtype;
    if (attention_ == Attention::kEager) {
      return a_.family == Family::kGpt2 ? g_gpt2_eager_core(q, l) : g_eager_core(q, l, q_bshd);
    }
    op(a_.family == Family::kGpt2 ? "attn.sdpa" : "self_attn.sdpa");
    ensure_workspace(false);
    // sdpa_attention_forward: without a mask GQA is native (enable_gqa); with one (a sliding
    // window reached), one query token packs the heads (a view) and more repeat K/V.
    T kr, vr;
    const std::uint64_t groups = a_.num_heads / a_.num_kv_heads;
    if (layer_has_mask(l) && groups > 1 && q_ > 1) {
      kr = fresh(Bg_ * H * stored_[l] * d, kc_[l].dtype);
      vr = fresh(Bg_ * H * stored_[l] * d, vc_[l].dtype);
    }
    // A bool mask becomes a float one inside scaled_dot_product_attention
    // (convert_boolean_attn_mask: where(mask, 0, -inf) with two wrapped scalars), [b, 1, q, kv]
    // of q's dtype, freed after the kernel.
    T fmask;
    if (layer_has_mask(l)) {
      T zero = fresh(1, c);
      T low = fresh(1, c);
      fmask = fresh(detail::mul({Bg_, q_, stored_[l]}, "mask size"), c);
      t_.drop(low);
      t_.drop(zero);
    }
    // The CPU flash kernel and CUDA's flash kernel (half inputs) always return the fp32
    // log-sum-exp; CUDA's memory-efficient kernel (fp32) computes it only for autograd.
    T lse = (cuda_ && c == DType::kF32) ? T{} : fresh(Bg_ * H * q_, DType::kF32);
    T o = fresh(r * H * d, c);
    if (lse.id != kNone) t_.drop(lse);
    if (fmask.id != kNone) t_.drop(fmask);
    if (!(q_bshd || q_ == 1)) {
      T oc = fresh(o.numel, c);  // transpose(1, 2).contiguous()
      t_.drop(o);
      o = oc;
    }
    if (kr.id != kNone) {
      t_.drop(kr);
      t_.drop(vr);
    }
    return o;
  }

  // eager_attention_forward (Llama family): repeat_kv copies K and V up to the query heads,
  // q @ k^T (matmul folds [b, heads]: a copy of q when it is laid out [b, s, heads, d] with
  // b > 1 and more than one token), * scaling, Gemma-2's soft-capping (/ cap, tanh, * cap),
  // + the mask, softmax in fp32 (a half input is upcast first) cast back, @ v, and
  // transpose(1, 2).contiguous() (a copy unless one token). The probabilities are returned and
  // held by the decoder layer until it returns.
  T g_eager_core(const T& q, std::uint32_t l, bool q_bshd) {
    const std::uint64_t H = a_.num_heads, d = a_.head_dim, kv = stored_[l];
    const std::uint64_t groups = H / a_.num_kv_heads;
    const std::uint64_t scores = detail::mul({Bg_, H, q_, kv}, "attention scores");
    const DType c = q.dtype;
    op("self_attn.attn_weights");
    T kr = groups > 1 ? fresh(Bg_ * H * kv * d, kc_[l].dtype) : t_.ref(kc_[l]);
    T vr = groups > 1 ? fresh(Bg_ * H * kv * d, vc_[l].dtype) : t_.ref(vc_[l]);
    T qc = (q_bshd && Bg_ > 1 && q_ > 1) ? fresh(q.numel, c) : T{};
    ensure_workspace(false);
    T s = fresh(scores, c);
    if (qc.id != kNone) t_.drop(qc);
    T s1 = fresh(scores, c);  // * scaling
    t_.drop(s);
    if (a_.attn_logit_softcap > 0) {
      for (int k = 0; k < 3; ++k) {  // / softcap, tanh, * softcap
        T y = fresh(scores, c);
        t_.drop(s1);
        s1 = y;
      }
    }
    T s2 = fresh(scores, c);  // + causal_mask
    t_.drop(s1);
    op("self_attn.softmax");
    T p;
    if (c != DType::kF32 && cuda_) {
      // softmax(dtype=float32) of a half CUDA tensor is one kernel (_softmax half_to_float).
      T p32 = fresh(scores, DType::kF32);
      p = fresh(scores, c);  // .to(query.dtype)
      t_.drop(p32);
    } else if (c != DType::kF32) {
      T up = fresh(scores, DType::kF32);  // the CPU upcasts the input first
      T p32 = fresh(scores, DType::kF32);
      t_.drop(up);
      p = fresh(scores, c);  // .to(query.dtype)
      t_.drop(p32);
    } else {
      p = fresh(scores, DType::kF32);
    }
    t_.drop(s2);
    op("self_attn.attn_output");
    T o = fresh(Bg_ * H * q_ * d, c);
    if (q_ > 1) {
      T oc = fresh(o.numel, c);
      t_.drop(o);
      o = oc;
    }
    t_.drop(kr);
    t_.drop(vr);
    attn_weights_ = p;
    return o;
  }

  // GPT-2's eager_attention_forward: q is a strided view of c_attn's output, so matmul copies
  // it for b > 1 (one token or more); no repeat_kv; softmax in the input dtype.
  T g_gpt2_eager_core(const T& q, std::uint32_t l) {
    const std::uint64_t H = a_.num_heads, d = a_.head_dim, kv = stored_[l];
    const std::uint64_t scores = detail::mul({Bg_, H, q_, kv}, "attention scores");
    const DType c = q.dtype;
    op("attn.attn_weights");
    T qc = Bg_ > 1 ? fresh(q.numel, c) : T{};
    ensure_workspace(false);
    T s = fresh(scores, c);
    if (qc.id != kNone) t_.drop(qc);
    T s1 = fresh(scores, c);  // scaling
    t_.drop(s);
    T s2 = fresh(scores, c);  // + causal_mask
    t_.drop(s1);
    op("attn.softmax");
    T p = fresh(scores, c);
    t_.drop(s2);
    op("attn.attn_output");
    T o = fresh(Bg_ * H * q_ * d, c);
    if (q_ > 1) {
      T oc = fresh(o.numel, c);
      t_.drop(o);
      o = oc;
    }
    attn_weights_ = p;
    return o;
  }

  T g_attention(const T& x, std::uint32_t l) {
    const LayerParams& lp = layers_[l];
    const std::uint64_t H = a_.num_heads, kvh = a_.num_kv_heads, d = a_.head_dim, r = rows();
    const std::uint64_t qw = H * d, kvw = kvh * d;
    if (lp.qkv != kNone) {  // Phi-3: one qkv projection, sliced
      T qkv = proj(x, "self_attn.qkv_proj", lp.qkv, lp.qkv_b, qw + 2 * kvw);
      T q = t_.ref(qkv);
      q.numel = r * qw;
      T k = t_.ref(qkv);
      k.numel = r * kvw;
      T v = t_.ref(qkv);
      v.numel = r * kvw;
      return g_attend(q, k, v, l, /*q_bshd=*/false, &qkv);
    }
    T q = proj(x, "self_attn.q_proj", lp.q, lp.q_b, qw);
    if (lp.q_norm != kNone) {
      T qn = g_rms_norm(q, lp.q_norm, r * H, "self_attn.q_norm");
      t_.drop(q);
      q = qn;
    }
    T k = proj(x, "self_attn.k_proj", lp.k, lp.k_b, kvw);
    if (lp.k_norm != kNone) {
      T kn = g_rms_norm(k, lp.k_norm, r * kvh, "self_attn.k_norm");
      t_.drop(k);
      k = kn;
    }
    T v = proj(x, "self_attn.v_proj", lp.v, lp.v_b, kvw);
    return g_attend(q, k, v, l, /*q_bshd=*/true, nullptr);
  }

  // The attention block after its projections: rotary on q and k, the cache update, attention
  // and o_proj, releasing each tensor where the Python variable dies. `fused` is Phi-3's qkv
  // output (q, k and v are views of it), released after o_proj.
  T g_attend(T& q, T& k, T& v, std::uint32_t l, bool q_bshd, T* fused) {
    const LayerParams& lp = layers_[l];
    op("self_attn.rotary");
    T qr = g_rope(q);
    T kr = g_rope(k);
    t_.drop(q);
    t_.drop(k);
    cache_update(l, kr, v);
    t_.drop(kr);
    t_.drop(v);
    T o = g_attention_core(qr, l, q_bshd);
    T y = proj(o, "self_attn.o_proj", lp.o, lp.o_b, a_.hidden_size);
    t_.drop(o);
    if (fused) t_.drop(*fused);
    t_.drop(qr);
    return y;
  }

  T g_mlp(const T& x, const LayerParams& lp) {
    const std::uint64_t i = a_.intermediate_size, n = rows() * i;
    if (lp.gate_up != kNone) {  // Phi-3: up * act(gate) on chunks of one projection
      T gu = proj(x, "mlp.gate_up_proj", lp.gate_up, kNone, 2 * i);
      op("mlp.activation_fn");
      T act = fresh(n, gu.dtype);
      op("mlp.mul");
      T prod = fresh(n, gu.dtype);
      t_.drop(act);
      T y = proj(prod, "mlp.down_proj", lp.down, lp.down_b, a_.hidden_size);
      t_.drop(prod);
      t_.drop(gu);
      return y;
    }
    T gate = proj(x, "mlp.gate_proj", lp.gate, lp.gate_b, i);
    op("mlp.act_fn");
    T act = fresh(n, gate.dtype);
    t_.drop(gate);
    T up = proj(x, "mlp.up_proj", lp.up, lp.up_b, i);
    op("mlp.act_fn*up");
    T prod = fresh(n, promote(act.dtype, up.dtype));
    t_.drop(act);
    t_.drop(up);
    T y = proj(prod, "mlp.down_proj", lp.down, lp.down_b, a_.hidden_size);
    t_.drop(prod);
    return y;
  }

  T g_decoder_layer(const T& x, std::uint32_t l) {
    const LayerParams& lp = layers_[l];
    layer_ = static_cast<std::int32_t>(l);
    const std::uint64_t r = rows();
    T n1 = g_rms_norm(x, lp.in_norm, r, "input_layernorm");
    T att = g_attention(n1, l);
    t_.drop(n1);
    if (a_.sandwich_norms) {
      T pn = g_rms_norm(att, lp.post_attn_norm, r, "post_attention_layernorm");
      t_.drop(att);
      att = pn;
    }
    op("residual_add");
    T h1 = fresh(x.numel, promote(x.dtype, att.dtype));
    t_.drop(att);
    T n2 = g_rms_norm(h1, a_.sandwich_norms ? lp.pre_ff_norm : lp.post_attn_norm, r,
                      a_.sandwich_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm");
    T m = g_mlp(n2, lp);
    t_.drop(n2);
    if (a_.sandwich_norms) {
      T pn = g_rms_norm(m, lp.post_ff_norm, r, "post_feedforward_layernorm");
      t_.drop(m);
      m = pn;
    }
    op("residual_add");
    T out = fresh(h1.numel, promote(h1.dtype, m.dtype));
    t_.drop(m);
    t_.drop(h1);
    if (attn_weights_.id != kNone) t_.drop(attn_weights_);  // the layer's `_` (eager)
    return out;
  }

  // GPT2Block without autograd (dropout is the identity in eval).
  T g_gpt2_block(const T& x, std::uint32_t l) {
    const LayerParams& lp = layers_[l];
    layer_ = static_cast<std::int32_t>(l);
    const std::uint64_t h = a_.hidden_size, i = a_.intermediate_size, r = rows();
    T n1 = g_layer_norm(x, "ln_1");
    T qkv = proj(n1, "attn.c_attn", lp.qkv, lp.qkv_b, 3 * h);
    T k = t_.ref(qkv);
    k.numel = r * h;
    cache_update(l, k, k);
    t_.drop(k);
    T q = t_.ref(qkv);
    q.numel = r * h;
    T o = g_attention_core(q, l, true);
    t_.drop(q);
    T a = proj(o, "attn.c_proj", lp.o, lp.o_b, h);
    t_.drop(o);
    t_.drop(qkv);
    op("residual_add");
    T h1 = fresh(x.numel, x.dtype);  // attn_output + residual
    t_.drop(n1);
    T n2 = g_layer_norm(h1, "ln_2");
    T f = proj(n2, "mlp.c_fc", lp.up, lp.up_b, i);
    op("mlp.act");
    // NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), left to right.
    const std::uint64_t n = f.numel;
    T half = fresh(n, f.dtype);
    T p3 = fresh(n, f.dtype);
    T m1 = fresh(n, f.dtype);
    t_.drop(p3);
    T s = fresh(n, f.dtype);
    t_.drop(m1);
    T m2 = fresh(n, f.dtype);
    t_.drop(s);
    T th = fresh(n, f.dtype);
    t_.drop(m2);
    T p1 = fresh(n, f.dtype);
    t_.drop(th);
    T act = fresh(n, f.dtype);
    t_.drop(half);
    t_.drop(p1);
    t_.drop(f);
    T m = proj(act, "mlp.c_proj", lp.down, lp.down_b, h);
    t_.drop(act);
    op("residual_add");
    T out = fresh(h1.numel, h1.dtype);  // residual + feed_forward_hidden_states
    t_.drop(n2);
    t_.drop(h1);
    t_.drop(a);
    if (attn_weights_.id != kNone) t_.drop(attn_weights_);  // self_attn_weights (eager)
    t_.drop(m);
    return out;
  }

  const Model& m_;
  const Architecture& a_;
  const Recipe& r_;
  const Gpu& gpu_;
  const MicroBatchHook& hook_;
  Policy pol_;
  DType quant_dtype_;  // a 4-bit base: the load and compute dtype of its matmuls (Note [QLoRA])
  std::uint64_t rank_ = 0;  // the data-parallel rank built (graph/parallel.h)
  Attention attention_;
  bool cuda_ = true;
  std::uint64_t B_ = 0, S_ = 0, tok_ = 0;
  Tape t_;
  DataParallel dp_{t_, r_, r_.gpu != "cpu", rank_};  // DDP / FSDP2 (graph/parallel.h); nothing without
  std::vector<Param> params_;
  std::vector<std::pair<std::string, std::uint32_t>> globals_;
  std::vector<LayerParams> layers_;
  std::vector<std::uint32_t> casts_;
  std::vector<TensorId> states_;
  T input_ids_, labels_, mask_, cos_, sin_, position_ids_, pending_loss_;
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
};

}  // namespace

Trace build_training_trace(const Model& model, const Recipe& recipe, const Gpu& gpu, const MicroBatchHook& hook,
                           std::uint64_t rank) {
  StepBuilder b(model, recipe, gpu, hook, rank);
  return b.build();
}

}  // namespace trainmem::graph
