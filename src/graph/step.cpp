// The training step of docs/schema.md ("The reference step"), op by op.
//
// Each builder mirrors a Hugging Face module of transformers 5.x (modeling_llama.py and its
// Mistral/Qwen2/Qwen3/Gemma-2/Phi-3 siblings, modeling_gpt2.py, loss_utils.py) and the PyTorch
// kernels it calls. MEMORY_MECHANICS.md in shared/design lists the saved tensors these builders
// reproduce; tests/cpp/test_graph.cpp checks them against its closed forms.
#include "graph/step.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/checked.h"

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

class StepBuilder {
 public:
  StepBuilder(const Model& m, const Recipe& r, const Gpu& gpu, const MicroBatchHook& hook)
      : m_(m), a_(m.arch), r_(r), gpu_(gpu), hook_(hook), pol_(policy_for(r.precision)) {
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
    if (r_.mode == Mode::kInference) throw Error("mode: inference (generation) is not modelled yet");
    t_.at(Phase::kSetup, kNoLayer, "model");
    create_parameters();
    create_adapters();
    if (pol_.master) {
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
        for (std::size_t k = gi; k < gend; ++k) bind_layer(layers_[l], groups[k].name, add_param(groups[k]));
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

  std::uint32_t add_param(const ParameterGroup& g) {
    Param p;
    p.numel = g.numel;
    p.dtype = pol_.param;
    p.trainable = !r_.lora.enabled();  // get_peft_model freezes the whole base model
    p.storage = t_.alloc_bytes(detail::mul(g.numel, dtype_bytes(pol_.param), "parameter bytes"), Category::kWeights);
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

  // nn.Linear (or GPT-2's Conv1D addmm): y = x W^T + b over `rows` rows.
  T linear(const T& x_in, std::uint32_t w, std::uint32_t b, std::uint64_t out_features) {
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
      if (wt) n.params.push_back(param_grad(w, cd));
      if (bt) n.params.push_back(param_grad(b, cd));
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

  // Batched matmul a @ b: each operand is saved for the other's gradient; each operand that
  // requires grad gets a gradient of its own size.
  T bmm(const T& a, const T& b, std::uint64_t out_numel, DType d) {
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

  // a * b of two tensors: each factor is saved for the other's gradient.
  T mul(const T& a, const T& b, std::uint64_t numel, DType d) {
    T y = fresh(numel, d);
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
      t_.drop(pe);
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
      T next = r_.checkpointing == Checkpointing::kFull ? checkpointed_layer(hs, l) : decoder_layer(hs, l);
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
    t_.at(Phase::kBackward, kNoLayer, "loss");
    ensure_workspace(true);
    t_.backward(loss);
    t_.drop(pending_loss_);
    if (input_leaf_.id != kNone) t_.drop(input_leaf_);
  }

  // ---------------------------------------------------------------- optimizer
  // bitsandbytes' two 256-entry fp32 quantization maps (signed and unsigned dynamic).
  void bnb_quantization_maps() {
    states_.push_back(t_.alloc_bytes(256 * 4, Category::kOptimizerStates));
    states_.push_back(t_.alloc_bytes(256 * 4, Category::kOptimizerStates));
  }

  void optimizer_step(bool first) {
    phase_ = Phase::kOptimizer;
    layer_ = kNoLayer;
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
    if (pol_.master) {
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
    auto sb_of = [&](const Param& p) { return dtype_bytes(pol_.master ? DType::kF32 : p.dtype); };
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
            states_.push_back(t_.alloc_bytes(p->numel * sb_of(*p), Category::kOptimizerStates));
            states_.push_back(t_.alloc_bytes(p->numel * sb_of(*p), Category::kOptimizerStates));
          }
        }
        if (r_.optimizer == Optimizer::kAdamW) {
          // foreach: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for the whole group, then
          // in-place ops; the list is freed at the end of the group's update. HF makes two
          // groups (weight decay / none); torch.optim with one group is the reference here.
          op("optimizer.foreach_sqrt");
          std::vector<TensorId> tmp;
          for (const Param* p : opt) {
            tmp.push_back(t_.alloc_bytes(p->numel * sb_of(*p), Category::kTemporaries));
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
            states_.push_back(t_.alloc_bytes(p->numel * sb_of(*p), Category::kOptimizerStates));
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

  const Model& m_;
  const Architecture& a_;
  const Recipe& r_;
  const Gpu& gpu_;
  const MicroBatchHook& hook_;
  Policy pol_;
  Attention attention_;
  bool cuda_ = true;
  std::uint64_t B_ = 0, S_ = 0, tok_ = 0;
  Tape t_;
  std::vector<Param> params_;
  std::vector<std::pair<std::string, std::uint32_t>> globals_;
  std::vector<LayerParams> layers_;
  std::vector<std::uint32_t> casts_;
  std::vector<TensorId> states_;
  T input_ids_, labels_, mask_, cos_, sin_, position_ids_, pending_loss_;
  T input_leaf_;  // LoRA with checkpointing: the embeddings' output, a leaf (Note [LoRA])
  std::vector<std::vector<Adapter>> adapters_;  // per decoder layer, in module order
  TensorId ws_fwd_ = kNone, ws_bwd_ = kNone;
  TensorId scaler_scale_ = kNone;
  std::vector<TensorId> rms_;  // Adafactor's per-parameter state["RMS"]
  Phase phase_ = Phase::kForward;
  std::int32_t layer_ = kNoLayer;
  std::string_view op_ = "";
};

}  // namespace

Trace build_training_trace(const Model& model, const Recipe& recipe, const Gpu& gpu, const MicroBatchHook& hook) {
  StepBuilder b(model, recipe, gpu, hook);
  return b.build();
}

}  // namespace trainmem::graph
