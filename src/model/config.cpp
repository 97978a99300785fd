// config.json → Architecture.
//
// Note [Which config keys matter]
// Only the shapes that decide parameter and activation sizes are read. Each family's defaults
// are the defaults of its Hugging Face configuration class (e.g. num_key_value_heads defaults
// to num_attention_heads, head_dim to hidden_size / num_attention_heads, GPT-2's n_inner to
// 4 * n_embd). A key that is present but of the wrong type or out of range is an error: a
// planner that silently falls back to a default prints a plausible wrong number.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "common/checked.h"
#include "model/model.h"

namespace trainmem::model {
namespace {

using nlohmann::json;

// Dimensions beyond this are certainly not a real model (2^24 = 16.7M). Keeping dimensions
// bounded keeps every product of a few of them inside 64 bits after the checked multiplies.
constexpr std::uint64_t kMaxDimension = std::uint64_t{1} << 24;
constexpr std::uint64_t kMaxLayers = 100000;

// A value as it may appear in a one-line message: scalars as written, containers by kind (a
// deeply nested value would overflow the stack when dumped, and would not be one line anyway).
std::string describe(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 40) + "...";
  return s;
}

// A whole number between `min` (1 for sizes; 0 where a count may be none) and `max`.
std::uint64_t get_dim(const json& c, const char* key, std::uint64_t max = kMaxDimension, std::uint64_t min = 1) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) {
    throw Error(std::string("config.json: missing field '") + key + "'");
  }
  const json& v = *it;
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) {
      throw Error(std::string("config.json: field '") + key + "' must be a whole number, got " + describe(v));
    }
    if (d < static_cast<double>(min) || d > static_cast<double>(max)) {
      throw Error(std::string("config.json: field '") + key + "' must be between " + std::to_string(min) + " and " +
                  std::to_string(max) + ", got " + describe(v));
    }
    return static_cast<std::uint64_t>(d);
  }
  if (v.is_number_unsigned() || v.is_number_integer()) {
    if (v.is_number_integer() && !v.is_number_unsigned() && v.get<std::int64_t>() < static_cast<std::int64_t>(min)) {
      throw Error(std::string("config.json: field '") + key + "' must be at least " + std::to_string(min) + ", got " +
                  describe(v));
    }
    std::uint64_t x = v.get<std::uint64_t>();
    if (x < min || x > max) {
      throw Error(std::string("config.json: field '") + key + "' must be between " + std::to_string(min) + " and " +
                  std::to_string(max) + ", got " + describe(v));
    }
    return x;
  }
  throw Error(std::string("config.json: field '") + key + (min ? "' must be a positive integer, got " : "' must be a whole number, got ") + describe(v));
}

std::uint64_t get_dim_or(const json& c, const char* key, std::uint64_t fallback,
                         std::uint64_t max = kMaxDimension, std::uint64_t min = 1) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback;
  return get_dim(c, key, max, min);
}

bool get_bool_or(const json& c, const char* key, bool fallback) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    throw Error(std::string("config.json: field '") + key + "' must be true or false, got " + describe(*it));
  }
  return it->get<bool>();
}

double get_number_or(const json& c, const char* key, double fallback) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback;
  if (!it->is_number()) {
    throw Error(std::string("config.json: field '") + key + "' must be a number, got " + describe(*it));
  }
  double d = it->get<double>();
  if (!std::isfinite(d) || d < 0) {
    throw Error(std::string("config.json: field '") + key + "' must be a finite number ≥ 0, got " + describe(*it));
  }
  return d;
}

// Note [Dropout probabilities]
// Dropout changes memory only through whether it runs: torch's dropout returns its input itself
// for p = 0 (ATen Dropout.cpp), so nothing is allocated or saved, while any p in (0, 1) makes
// the same mask and output whatever its value. CUDA's fused SDPA kernels draw theirs inside the
// kernel: flash keeps its Philox seed and offset as CPU scalars outside graph capture (mha_fwd in
// flash_api.cpp), so it saves what it saves without dropout. The engine needs each site's
// probability only to tell zero from non-zero, but a value outside [0, 1) is an error: p = 1
// zeroes every activation, which no training run means. Defaults are the config classes':
// 0.1 for GPT-2's attn_pdrop, resid_pdrop and embd_pdrop, 0.0 for the others' attention_dropout
// and Phi-3's resid_pdrop (its embd_pdrop is never used by the model).
double get_probability_or(const json& c, const char* key, double fallback) {
  const double p = get_number_or(c, key, fallback);
  if (p >= 1) {
    throw Error(std::string("config.json: field '") + key + "' is a dropout probability and must be below 1, got " +
                describe(c.at(key)));
  }
  return p;
}

DType parse_dtype(const json& c) {
  // transformers 5 writes "dtype"; older configs "torch_dtype".
  for (const char* key : {"dtype", "torch_dtype"}) {
    auto it = c.find(key);
    if (it == c.end() || it->is_null()) continue;
    if (!it->is_string()) {
      throw Error(std::string("config.json: field '") + key + "' must be a string, got " + describe(*it));
    }
    std::string s = it->get<std::string>();
    if (s == "float32" || s == "float") return DType::kF32;
    if (s == "bfloat16") return DType::kBF16;
    if (s == "float16" || s == "half") return DType::kF16;
    throw Error(std::string("config.json: field '") + key + "' has unsupported dtype '" + s +
                "'; expected float32, bfloat16 or float16");
  }
  return DType::kF32;
}

std::string model_type_of(const json& c) {
  auto it = c.find("model_type");
  if (it == c.end()) {
    throw Error("config.json: missing field 'model_type' (expected one of gpt2, llama, mistral, "
                "qwen2, qwen3, gemma2, phi3)");
  }
  if (!it->is_string()) throw Error("config.json: field 'model_type' must be a string, got " + describe(*it));
  return it->get<std::string>();
}

Activation parse_activation(const json& c, const char* key, Activation fallback) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback;
  if (!it->is_string()) throw Error(std::string("config.json: field '") + key + "' must be a string");
  std::string s = it->get<std::string>();
  if (s == "silu" || s == "swish") return Activation::kSilu;
  if (s == "gelu" || s == "gelu_pytorch_tanh") return Activation::kGelu;  // F.gelu, exact or approximate="tanh"
  if (s == "gelu_new") return Activation::kGeluNew;
  if (s == "relu") return Activation::kRelu;  // nn.ReLU
  // gelu_fast (FastGELUActivation) and the others spell their own formulas, which save other tensors.
  throw Error(std::string("config.json: field '") + key + "' has unsupported activation '" + s +
              "' (modelled: silu, swish, gelu, gelu_pytorch_tanh, gelu_new, relu)");
}

void check_heads(Architecture& a) {
  if (a.num_heads % a.num_kv_heads != 0) {
    throw Error("config.json: num_attention_heads=" + std::to_string(a.num_heads) +
                " is not a multiple of num_key_value_heads=" + std::to_string(a.num_kv_heads));
  }
}

Architecture parse_gpt2(const json& c) {
  Architecture a;
  a.family = Family::kGpt2;
  a.hidden_size = get_dim(c, "n_embd");
  a.num_layers = get_dim(c, "n_layer", kMaxLayers);
  a.num_heads = get_dim(c, "n_head");
  a.num_kv_heads = a.num_heads;
  if (a.hidden_size % a.num_heads != 0) {
    throw Error("config.json: n_head=" + std::to_string(a.num_heads) + " does not divide n_embd=" +
                std::to_string(a.hidden_size) + " (GPT-2 splits the width evenly across heads)");
  }
  a.head_dim = a.hidden_size / a.num_heads;
  a.intermediate_size = get_dim_or(c, "n_inner", detail::mul(4, a.hidden_size, "n_inner"));
  a.vocab_size = get_dim(c, "vocab_size");
  a.max_positions = get_dim(c, "n_positions");
  a.tie_word_embeddings = get_bool_or(c, "tie_word_embeddings", true);
  a.qkv_bias = a.o_bias = a.mlp_bias = true;
  a.fused_qkv = true;
  a.gated_mlp = false;
  a.learned_positions = true;
  a.norm = NormKind::kLayerNorm;
  a.activation = parse_activation(c, "activation_function", Activation::kGeluNew);
  a.reorder_and_upcast_attn = get_bool_or(c, "reorder_and_upcast_attn", false);
  if (get_bool_or(c, "add_cross_attention", false)) {
    throw Error("config.json: add_cross_attention (GPT-2 with cross-attention layers, an encoder-decoder's "
                "decoder) is not modelled");
  }
  a.attn_dropout = get_probability_or(c, "attn_pdrop", 0.1);
  a.resid_dropout = get_probability_or(c, "resid_pdrop", 0.1);
  a.embd_dropout = get_probability_or(c, "embd_pdrop", 0.1);
  return a;
}

// Note [Config class defaults]
// A key a config.json leaves out takes its config class's default (transformers 5.25,
// models/*/configuration_*.py), which differs by family: num_key_value_heads is 8 for Mistral, 32
// for Qwen2 and Qwen3, 4 for Gemma-2 and the attention heads for Llama and Phi-3; head_dim is 128
// for Qwen3 and 256 for Gemma-2, hidden_size / heads elsewhere; Gemma-2's soft-caps are 50 and
// 30; max_position_embeddings 2048, 131072, 32768, 8192 and 4096. A key set to null is None,
// which the classes turn into the derived value (heads, hidden_size / heads) or "off". (A probe
// found the parser's one set of fallbacks 13-25 % off on configs that leave these out.)
std::uint64_t class_default_kv_heads(Family f, std::uint64_t heads) {
  switch (f) {
    case Family::kMistral: return 8;
    case Family::kQwen2:
    case Family::kQwen3: return 32;
    case Family::kGemma2: return 4;
    default: return heads;
  }
}

std::uint64_t class_default_positions(Family f) {
  switch (f) {
    case Family::kMistral: return 131072;
    case Family::kQwen2:
    case Family::kQwen3: return 32768;
    case Family::kGemma2: return 8192;
    case Family::kPhi3: return 4096;
    default: return 2048;
  }
}

Architecture parse_llama_like(const json& c, Family family) {
  Architecture a;
  a.family = family;
  a.hidden_size = get_dim(c, "hidden_size");
  a.intermediate_size = get_dim(c, "intermediate_size");
  a.num_layers = get_dim(c, "num_hidden_layers", kMaxLayers);
  a.num_heads = get_dim(c, "num_attention_heads");
  a.num_kv_heads = c.contains("num_key_value_heads") ? get_dim_or(c, "num_key_value_heads", a.num_heads)
                                                     : class_default_kv_heads(family, a.num_heads);
  a.vocab_size = get_dim(c, "vocab_size");
  a.max_positions = get_dim_or(c, "max_position_embeddings", class_default_positions(family), std::uint64_t{1} << 32);
  // Llama-family configs may set head_dim; then q/k/v widths are heads * head_dim and need not
  // equal hidden_size. Without it the width must split evenly (Qwen3's and Gemma-2's classes have
  // a head_dim of their own).
  const bool class_head_dim = !c.contains("head_dim") && (family == Family::kQwen3 || family == Family::kGemma2);
  if (class_head_dim) {
    a.head_dim = family == Family::kQwen3 ? 128 : 256;
  } else if (c.contains("head_dim") && !c["head_dim"].is_null()) {
    a.head_dim = get_dim(c, "head_dim");
  } else {
    if (a.hidden_size % a.num_heads != 0) {
      throw Error("config.json: num_attention_heads=" + std::to_string(a.num_heads) +
                  " does not divide hidden_size=" + std::to_string(a.hidden_size) +
                  " and no head_dim is given");
    }
    a.head_dim = a.hidden_size / a.num_heads;
  }
  check_heads(a);
  if (a.head_dim > 4 && a.head_dim % 2 != 0) {  // transformers' validate_rope (modeling_rope_utils.py)
    throw Error("config.json: head_dim " + std::to_string(a.head_dim) +
                " is odd; a rotary embedding needs an even one (transformers refuses it)");
  }
  // nn.Embedding(vocab, hidden, padding_idx=pad_token_id): Phi3Config's default is 32000, Gemma-2's 0.
  {
    const std::int64_t default_pad = family == Family::kPhi3 ? 32000 : family == Family::kGemma2 ? 0 : -1;
    auto it = c.find("pad_token_id");
    const std::int64_t pad = it == c.end()               ? default_pad
                             : it->is_number_integer() ? it->get<std::int64_t>()
                                                       : -1;
    if (pad >= 0 && static_cast<std::uint64_t>(pad) >= a.vocab_size) {
      throw Error("config.json: pad_token_id " + std::to_string(pad) + (it == c.end() ? " (the config class's default)" : "") +
                  " is not below vocab_size " + std::to_string(a.vocab_size) +
                  ": the embedding's padding_idx must be within it (transformers fails)");
    }
  }
  // Gemma-2 reads hidden_activation alone (below); its hidden_act is never used.
  if (family != Family::kGemma2) a.activation = parse_activation(c, "hidden_act", Activation::kSilu);
  a.attn_dropout = get_probability_or(c, "attention_dropout", 0);
  // A rotary embedding over part of each head (Phi-4-mini's 0.75): transformers 5 reads the factor
  // from rope_parameters (the legacy rope_scaling becomes it), and Phi3Config also takes it at the
  // top level. Its slices and concatenations are not modelled.
  auto check_rotary_factor = [&](const json& holder, const std::string& where) {
    const double f = get_number_or(holder, "partial_rotary_factor", 1.0);
    if (f != 1.0) {
      char text[32];
      std::snprintf(text, sizeof text, "%g", f);
      throw Error("config.json: " + where + "partial_rotary_factor " + text +
                  " (a rotary embedding over part of each head) is not modelled; only 1.0 is");
    }
  };
  bool in_rope_parameters = false;  // Phi3Config takes the top-level factor only where these lack one
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (auto it = c.find(key); it != c.end() && !it->is_null() && !it->is_object()) {
      throw Error(std::string("config.json: ") + key + " must be an object (or null)");
    }
    if (auto it = c.find(key); it != c.end() && it->is_object()) {
      check_rotary_factor(*it, std::string(key) + ".");
      in_rope_parameters = in_rope_parameters || it->contains("partial_rotary_factor");
      // dynamic_rope_update (transformers' modeling_rope_utils): "dynamic" recomputes inv_freq for
      // a sequence past max_position_embeddings, "longrope" switches to its long factors past
      // original_max_position_embeddings. Either replaces a buffer mid-forward, not modelled.
      // rope_type wins over the legacy "type" (standardize_rope_params: setdefault).
      const json* type = nullptr;
      for (const char* name : {"type", "rope_type"}) {
        if (auto t = it->find(name); t != it->end() && !t->is_null()) {
          if (!t->is_string()) throw Error(std::string("config.json: ") + key + "." + name + " must be a string");
          type = &*t;
        }
      }
      std::string rope = type != nullptr ? type->get<std::string>() : "default";
      // Phi3Config takes its old names for longrope and refuses the other kinds (validate_rope).
      if (family == Family::kPhi3 && (rope == "su" || rope == "yarn")) rope = "longrope";
      const bool known = family == Family::kPhi3
                             ? (rope == "default" || rope == "longrope")
                             : (rope == "default" || rope == "linear" || rope == "dynamic" || rope == "yarn" ||
                                rope == "longrope" || rope == "llama3");
      if (!known) {
        throw Error(std::string("config.json: ") + key + " rope_type '" + rope + "' is not one transformers takes for " +
                    (family == Family::kPhi3 ? "Phi-3 (default, longrope, su, yarn)"
                                             : "this model (default, linear, dynamic, yarn, longrope, llama3)"));
      }
      if (rope == "dynamic") a.rope_rescales_past = a.max_positions;
      if (rope == "longrope") {
        // Phi3Config always has a top-level original_max_position_embeddings (4096 by default),
        // which wins; other configs name it in the rope dict first, then at the top level.
        const std::uint64_t top = get_dim_or(c, "original_max_position_embeddings",
                                             family == Family::kPhi3 ? 4096 : a.max_positions, std::uint64_t{1} << 32);
        a.rope_rescales_past = family == Family::kPhi3
                                   ? top
                                   : get_dim_or(*it, "original_max_position_embeddings", top, std::uint64_t{1} << 32);
      }
    }
  }
  if (family == Family::kPhi3 && !in_rope_parameters) check_rotary_factor(c, "");
  switch (family) {
    case Family::kLlama: {
      bool bias = get_bool_or(c, "attention_bias", false);
      a.qkv_bias = a.o_bias = bias;
      a.mlp_bias = get_bool_or(c, "mlp_bias", false);
      a.tie_word_embeddings = get_bool_or(c, "tie_word_embeddings", false);
      break;
    }
    case Family::kMistral:
      a.tie_word_embeddings = get_bool_or(c, "tie_word_embeddings", false);
      break;
    case Family::kQwen2:
      a.qkv_bias = true;  // Qwen2Attention hard-codes bias on q/k/v, none on o_proj
      a.tie_word_embeddings = get_bool_or(c, "tie_word_embeddings", false);
      break;
    case Family::kQwen3: {
      bool bias = get_bool_or(c, "attention_bias", false);
      a.qkv_bias = a.o_bias = bias;
      a.qk_norm = true;
      a.tie_word_embeddings = get_bool_or(c, "tie_word_embeddings", false);
      break;
    }
    case Family::kGemma2: {
      bool bias = get_bool_or(c, "attention_bias", false);
      a.qkv_bias = a.o_bias = bias;
      a.sandwich_norms = true;
      a.embedding_scale = true;
      a.activation = parse_activation(c, "hidden_activation", Activation::kGelu);
      a.attn_logit_softcap = c.contains("attn_logit_softcapping") ? get_number_or(c, "attn_logit_softcapping", 0) : 50;
      a.final_logit_softcap =
          c.contains("final_logit_softcapping") ? get_number_or(c, "final_logit_softcapping", 0) : 30;
      a.tie_word_embeddings = get_bool_or(c, "tie_word_embeddings", true);
      break;
    }
    case Family::kPhi3:
      a.fused_qkv = true;
      a.fused_gate_up = true;
      a.resid_dropout = get_probability_or(c, "resid_pdrop", 0);
      a.tie_word_embeddings = get_bool_or(c, "tie_word_embeddings", false);
      break;
    case Family::kGpt2:
      break;
  }
  return a;
}

// Note [Which config keys matter], generation part: the sliding window, which layers slide and
// whether there is a bos token, with each config class's defaults (transformers 5.24): Gemma-2
// and Mistral 4096 when the key is absent, none when it is null (Gemma-2 on even layers); Phi-3 none unless
// set; Qwen2/Qwen3 only with use_sliding_window (then as Mistral's, from max_window_layers = 28 on);
// Llama and GPT-2 never. Qwen2/Qwen3 configs have no bos token unless they name one.
void parse_generation_keys(const json& c, Architecture& a) {
  auto it = c.find("bos_token_id");
  a.bos_token = it != c.end() ? !it->is_null() : (a.family != Family::kQwen2 && a.family != Family::kQwen3);
  switch (a.family) {
    case Family::kGemma2:
    case Family::kMistral:  // absent: the class default; null: no window
      a.sliding_window = c.contains("sliding_window") ? get_dim_or(c, "sliding_window", 0) : 4096;
      break;
    case Family::kPhi3: a.sliding_window = get_dim_or(c, "sliding_window", 0); break;
    case Family::kQwen2:
    case Family::kQwen3:  // with use_sliding_window as Mistral's: absent 4096, null no window
      a.sliding_window = !get_bool_or(c, "use_sliding_window", false) ? 0
                         : c.contains("sliding_window")             ? get_dim_or(c, "sliding_window", 0)
                                                                    : 4096;
      // 0: every layer slides (transformers takes it; layer l slides from max_window_layers on).
      a.max_window_layers = get_dim_or(c, "max_window_layers", 28, kMaxLayers, /*min=*/0);
      break;
    case Family::kLlama:
    case Family::kGpt2: return;
  }
  auto lt = c.find("layer_types");
  if (lt == c.end() || lt->is_null()) return;
  if (!lt->is_array() || lt->size() != a.num_layers) {
    throw Error("config.json: field 'layer_types' must list one type per layer (" + std::to_string(a.num_layers) +
                "), got " + describe(*lt));
  }
  for (const json& t : *lt) {
    if (!t.is_string() || (t.get<std::string>() != "sliding_attention" && t.get<std::string>() != "full_attention")) {
      throw Error("config.json: field 'layer_types' must hold \"sliding_attention\" or \"full_attention\", got " +
                  describe(t));
    }
    a.sliding_layer_types.push_back(t.get<std::string>() == "sliding_attention");
  }
  // MistralModel and Phi3Model give every layer the window (attention and mask alike) whatever
  // layer_types says (transformers warns about it), while their DynamicCache makes its layers
  // from layer_types: one window per layer cannot stand for both.
  const bool mixed = std::find(a.sliding_layer_types.begin(), a.sliding_layer_types.end(), false) !=
                     a.sliding_layer_types.end();
  if ((a.family == Family::kMistral || a.family == Family::kPhi3) && a.sliding_window != 0 && mixed) {
    throw Error("config.json: field 'layer_types' has full-attention layers, which a " +
                std::string(family_name(a.family)) + " model ignores (every layer slides) but its cache " +
                "follows; that is not modelled");
  }
}

}  // namespace

std::vector<std::uint64_t> attention_windows(const Architecture& a) {
  std::vector<std::uint64_t> w(a.num_layers, 0);
  if (a.sliding_window == 0) return w;
  for (std::uint64_t l = 0; l < a.num_layers; ++l) {
    bool slides = true;
    if (!a.sliding_layer_types.empty()) {
      // A model grown past its config's list (model::with_layers) repeats the list's pattern.
      slides = a.sliding_layer_types[l % a.sliding_layer_types.size()];
    } else if (a.family == Family::kGemma2) {
      slides = l % 2 == 0;
    } else if (a.family == Family::kQwen2 || a.family == Family::kQwen3) {
      slides = l >= a.max_window_layers;
    }
    if (slides) w[l] = a.sliding_window;
  }
  return w;
}

// What the config says about the checkpoint beside its shapes: `architectures` names the class
// its weights were saved from (another head, a sequence classifier's score layer, is not the
// causal LM's lm_head), and `quantization_config` marks a pre-quantized checkpoint (GPTQ, AWQ,
// bitsandbytes), whose weights are not the config's dtype. Both change memory; neither is modelled.
void check_head_and_weights(const json& c, const std::string& type) {
  // The causal LM, or the base model (AutoModelForCausalLM loads a LlamaModel export as the
  // causal LM, whose lm_head it makes).
  static const std::array<std::array<const char*, 3>, 7> kClasses = {{
      {"gpt2", "GPT2LMHeadModel", "GPT2Model"},       {"llama", "LlamaForCausalLM", "LlamaModel"},
      {"mistral", "MistralForCausalLM", "MistralModel"}, {"qwen2", "Qwen2ForCausalLM", "Qwen2Model"},
      {"qwen3", "Qwen3ForCausalLM", "Qwen3Model"},    {"gemma2", "Gemma2ForCausalLM", "Gemma2Model"},
      {"phi3", "Phi3ForCausalLM", "Phi3Model"}}};
  std::string expected, base;
  for (const auto& [t, cls, bare] : kClasses) {
    if (type == t) expected = cls, base = bare;
  }
  if (auto it = c.find("architectures"); it != c.end() && !it->is_null()) {
    if (!it->is_array()) throw Error("config.json: architectures must be a list of class names");
    for (const json& name : *it) {
      if (!name.is_string()) throw Error("config.json: architectures must be a list of class names");
      if (name.get<std::string>() != expected && name.get<std::string>() != base) {
        throw Error("config.json: architectures names " + name.get<std::string>() + "; trainmem models " + expected +
                    " for model_type " + type + " (another head or class changes the weights and the loss)");
      }
    }
  }
  if (auto it = c.find("quantization_config"); it != c.end() && !it->is_null()) {
    std::string method = "unknown";
    if (it->is_object() && it->contains("quant_method") && (*it)["quant_method"].is_string()) {
      method = (*it)["quant_method"].get<std::string>();
    }
    throw Error("config.json: quantization_config (a pre-quantized checkpoint, quant_method " + method +
                ") is not modelled; give the unquantized config and --load-in-4bit or --load-in-8bit");
  }
}

Architecture parse_config(const json& c) {
  if (!c.is_object()) throw Error("config.json: expected a JSON object at the top level");
  std::string type = model_type_of(c);
  Architecture a;
  if (type == "gpt2") a = parse_gpt2(c);
  else if (type == "llama") a = parse_llama_like(c, Family::kLlama);
  else if (type == "mistral") a = parse_llama_like(c, Family::kMistral);
  else if (type == "qwen2") a = parse_llama_like(c, Family::kQwen2);
  else if (type == "qwen3") a = parse_llama_like(c, Family::kQwen3);
  else if (type == "gemma2") a = parse_llama_like(c, Family::kGemma2);
  else if (type == "phi3") a = parse_llama_like(c, Family::kPhi3);
  else {
    throw Error("config.json: unsupported model_type '" + type +
                "'; supported: gpt2, llama, mistral, qwen2, qwen3, gemma2, phi3");
  }
  a.model_type = type;
  check_head_and_weights(c, type);
  a.torch_dtype = parse_dtype(c);
  parse_generation_keys(c, a);
  if (auto it = c.find("return_dict"); it != c.end() && it->is_boolean() && !it->get<bool>()) {
    throw Error("config.json: return_dict false (the model returns tuples) is not modelled");
  }
  if (a.family == Family::kGemma2) {
    if (auto it = c.find("sliding_window"); it != c.end() && it->is_null()) {
      throw Error("config.json: Gemma-2 with sliding_window null fails in transformers (its sliding layers need one)");
    }
    if (auto it = c.find("final_logit_softcapping"); it != c.end() && it->is_number() && it->get<double>() == 0) {
      throw Error("config.json: Gemma-2's final_logit_softcapping 0 is refused by transformers; null turns it off");
    }
  }
  if (a.family == Family::kPhi3) {
    a.generation_refills_past = get_dim_or(c, "original_max_position_embeddings", 4096, std::uint64_t{1} << 32);
  }
  // Keys from_model_config copies into generate()'s settings that change its memory, and the
  // windows a Llama's or GPT-2's DynamicCache reads though the model does not.
  for (const char* key : {"prefill_chunk_size", "prompt_lookup_num_tokens", "guidance_scale", "output_hidden_states",
                          "output_attentions", "renormalize_logits"}) {
    auto it = c.find(key);
    if (it == c.end() || it->is_null() || (it->is_boolean() && !it->get<bool>())) continue;
    if (a.generation_unmodelled.empty()) a.generation_unmodelled = key;
  }
  if (auto it = c.find("cache_implementation"); it != c.end() && !it->is_null() && *it != "hybrid") {
    if (a.generation_unmodelled.empty()) a.generation_unmodelled = "cache_implementation";
  }
  if (a.family == Family::kLlama || a.family == Family::kGpt2) {
    for (const char* key : {"sliding_window", "attention_chunk_size", "layer_types"}) {
      auto it = c.find(key);
      if (it != c.end() && !it->is_null() && a.generation_unmodelled.empty()) a.generation_unmodelled = key;
    }
  }
  return a;
}

}  // namespace trainmem::model
