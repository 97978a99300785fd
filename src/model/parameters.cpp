// Architecture → the exact list of parameter tensors of the Hugging Face implementation.
// tests/cpp/test_model.cpp checks every catalog model against data/models/param_counts.json,
// which was counted from the real modules (tools/param_counts.py).
#include "common/checked.h"
#include "model/model.h"

namespace trainmem::model {
namespace {

struct Lister {
  std::vector<ParameterGroup>& out;
  std::uint64_t count;
  void add(std::string name, std::uint64_t rows, std::uint64_t cols, bool matmul) {
    out.push_back({std::move(name), detail::mul(rows, cols, "parameter size"), count, matmul, rows});
  }
  void vec(std::string name, std::uint64_t n) { out.push_back({std::move(name), n, count, false, 0}); }
};

void list_gpt2(const Architecture& a, std::vector<ParameterGroup>& out) {
  const std::uint64_t h = a.hidden_size, i = a.intermediate_size, L = a.num_layers;
  Lister top{out, 1};
  top.add("transformer.wte.weight", a.vocab_size, h, a.tie_word_embeddings);
  top.add("transformer.wpe.weight", a.max_positions, h, false);
  Lister layer{out, L};
  layer.vec("transformer.h.N.ln_1.weight", h);
  layer.vec("transformer.h.N.ln_1.bias", h);
  layer.add("transformer.h.N.attn.c_attn.weight", h, 3 * h, true);
  layer.vec("transformer.h.N.attn.c_attn.bias", 3 * h);
  layer.add("transformer.h.N.attn.c_proj.weight", h, h, true);
  layer.vec("transformer.h.N.attn.c_proj.bias", h);
  layer.vec("transformer.h.N.ln_2.weight", h);
  layer.vec("transformer.h.N.ln_2.bias", h);
  layer.add("transformer.h.N.mlp.c_fc.weight", h, i, true);
  layer.vec("transformer.h.N.mlp.c_fc.bias", i);
  layer.add("transformer.h.N.mlp.c_proj.weight", i, h, true);
  layer.vec("transformer.h.N.mlp.c_proj.bias", h);
  top.vec("transformer.ln_f.weight", h);
  top.vec("transformer.ln_f.bias", h);
  if (!a.tie_word_embeddings) top.add("lm_head.weight", a.vocab_size, h, true);
}

void list_llama_like(const Architecture& a, std::vector<ParameterGroup>& out) {
  const std::uint64_t h = a.hidden_size, i = a.intermediate_size, L = a.num_layers;
  const std::uint64_t q = detail::mul(a.num_heads, a.head_dim, "q width");
  const std::uint64_t kv = detail::mul(a.num_kv_heads, a.head_dim, "kv width");
  Lister top{out, 1};
  top.add("model.embed_tokens.weight", a.vocab_size, h, a.tie_word_embeddings);
  Lister layer{out, L};
  layer.vec("model.layers.N.input_layernorm.weight", h);
  if (a.fused_qkv) {
    layer.add("model.layers.N.self_attn.qkv_proj.weight", q + 2 * kv, h, true);
    if (a.qkv_bias) layer.vec("model.layers.N.self_attn.qkv_proj.bias", q + 2 * kv);
  } else {
    layer.add("model.layers.N.self_attn.q_proj.weight", q, h, true);
    if (a.qkv_bias) layer.vec("model.layers.N.self_attn.q_proj.bias", q);
    layer.add("model.layers.N.self_attn.k_proj.weight", kv, h, true);
    if (a.qkv_bias) layer.vec("model.layers.N.self_attn.k_proj.bias", kv);
    layer.add("model.layers.N.self_attn.v_proj.weight", kv, h, true);
    if (a.qkv_bias) layer.vec("model.layers.N.self_attn.v_proj.bias", kv);
  }
  layer.add("model.layers.N.self_attn.o_proj.weight", h, q, true);
  if (a.o_bias) layer.vec("model.layers.N.self_attn.o_proj.bias", h);
  if (a.qk_norm) {
    layer.vec("model.layers.N.self_attn.q_norm.weight", a.head_dim);
    layer.vec("model.layers.N.self_attn.k_norm.weight", a.head_dim);
  }
  layer.vec("model.layers.N.post_attention_layernorm.weight", h);
  if (a.sandwich_norms) {
    layer.vec("model.layers.N.pre_feedforward_layernorm.weight", h);
    layer.vec("model.layers.N.post_feedforward_layernorm.weight", h);
  }
  if (a.fused_gate_up) {
    layer.add("model.layers.N.mlp.gate_up_proj.weight", 2 * i, h, true);
  } else {
    layer.add("model.layers.N.mlp.gate_proj.weight", i, h, true);
    if (a.mlp_bias) layer.vec("model.layers.N.mlp.gate_proj.bias", i);
    layer.add("model.layers.N.mlp.up_proj.weight", i, h, true);
    if (a.mlp_bias) layer.vec("model.layers.N.mlp.up_proj.bias", i);
  }
  layer.add("model.layers.N.mlp.down_proj.weight", h, i, true);
  if (a.mlp_bias) layer.vec("model.layers.N.mlp.down_proj.bias", h);
  top.vec("model.norm.weight", h);
  if (!a.tie_word_embeddings) top.add("lm_head.weight", a.vocab_size, h, true);
}

}  // namespace

std::vector<ParameterGroup> parameter_groups(const Architecture& a) {
  std::vector<ParameterGroup> out;
  if (a.family == Family::kGpt2) list_gpt2(a, out);
  else list_llama_like(a, out);
  count_parameters(out);  // throws when the total overflows
  return out;
}

std::uint64_t count_parameters(const std::vector<ParameterGroup>& groups) {
  std::uint64_t n = 0;
  for (const auto& g : groups) n = detail::add(n, detail::mul(g.numel, g.count, "parameter count"), "parameter count");
  return n;
}

}  // namespace trainmem::model
