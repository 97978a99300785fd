// Tensor parallelism on one rank: the local model. See Note [Tensor parallelism] in tensor_parallel.h.
#include "graph/tensor_parallel.h"

#include <string>

#include "graph/step_builder.h"
#include "model/model.h"

namespace trainmem::graph {

TpStyle tp_style(std::string_view path) {
  if (path == "self_attn.q_proj" || path == "self_attn.k_proj" || path == "self_attn.v_proj" ||
      path == "mlp.gate_proj" || path == "mlp.up_proj") {
    return TpStyle::kColwise;
  }
  if (path == "self_attn.o_proj" || path == "mlp.down_proj") return TpStyle::kRowwise;
  return TpStyle::kNone;
}

Model tensor_parallel_model(const Model& model, std::uint64_t tp, bool loss_parallel) {
  if (tp <= 1) return model;
  const Architecture& a = model.arch;
  const std::string prefix = "tp: " + std::to_string(tp) + " with " + std::string(family_name(a.family));
  if (a.family != Family::kLlama && a.family != Family::kMistral) {
    throw Error(prefix + " is not modelled: the Megatron plan here is measured on Llama (Mistral's layer is the same); "
                         "GPT-2's c_attn and Phi-3's qkv_proj / gate_up_proj are fused, Qwen3's q_norm/k_norm "
                         "need their gradients all-reduced, Qwen2 and Gemma-2 are unmeasured");
  }
  if (a.qkv_bias || a.o_bias || a.mlp_bias) {
    throw Error(prefix + ": projections with biases are not modelled under tensor parallelism (unmeasured)");
  }
  auto check = [&](const char* key, std::uint64_t v) {
    if (v % tp != 0) {
      throw Error(prefix + ": " + key + " = " + std::to_string(v) +
                  " is not divisible by the tensor-parallel degree; ColwiseParallel would give ranks unequal heads");
    }
  };
  check("num_attention_heads", a.num_heads);
  check("num_key_value_heads", a.num_kv_heads);
  check("intermediate_size", a.intermediate_size);
  Model local = model;
  local.arch.num_heads = a.num_heads / tp;
  local.arch.num_kv_heads = a.num_kv_heads / tp;
  local.arch.intermediate_size = a.intermediate_size / tp;
  // The local shards are the same layer at the local width: ColwiseParallel's Shard(0) keeps
  // out_features / tp rows, RowwiseParallel's Shard(1) in_features / tp columns.
  local.parameters = model::parameter_groups(local.arch);
  local.parameter_count = model.parameter_count;  // a DTensor's numel is the global one
  if (loss_parallel) {  // See Note [Loss parallel]
    if (a.tie_word_embeddings) {
      throw Error("loss_parallel: " + std::string(family_name(a.family)) +
                  " with tied embeddings is not modelled (ColwiseParallel on lm_head would shard the embedding's "
                  "weight too); use a model with tie_word_embeddings false, or drop loss_parallel");
    }
    if (a.vocab_size % tp != 0) {
      throw Error("loss_parallel: vocab_size = " + std::to_string(a.vocab_size) + " is not divisible by tp " +
                  std::to_string(tp) + "; uneven vocabulary shards are not modelled");
    }
    bool found = false;
    for (ParameterGroup& g : local.parameters) {
      if (g.name != "lm_head.weight") continue;
      g.numel /= tp;  // Shard(0): vocab / tp rows of hidden_size
      g.rows /= tp;
      found = true;
    }
    if (!found) throw Error("loss_parallel: the model has no separate lm_head.weight to shard");
  }
  return local;
}

}  // namespace trainmem::graph

namespace trainmem::graph::step {

// lm_head ColwiseParallel with Shard(-1) logits, then ForCausalLMLoss inside loss_parallel()
// (See Note [Loss parallel]): the local vocab / tp columns of the logits only.
ValueId StepBuilder::vocab_parallel_loss(T& normed, std::uint32_t emb) {
  const std::uint64_t local_vocab = a_.vocab_size / r_.tp;  // tensor_parallel_model checked it
  op("lm_head");
  in_lm_head_ = true;
  dtensor_ = false;
  // Sequence parallelism: the norm's output (a shard nothing saves) is held by the model's
  // forward until it returns, after the loss (as in standard_loss).
  T logits = colwise_linear(normed, lm_head_param(emb), kNone, local_vocab);
  in_lm_head_ = false;
  T shard;
  if (sp_ > 1) {
    shard = normed;
  } else {
    t_.drop(normed);
  }
  T loss = causal_lm_loss(logits, /*vocab_parallel=*/true);
  if (shard.id != kNone) t_.drop(shard);
  t_.drop(logits);  // the model output, dropped with the output object before backward
  return scale_loss(loss);
}

}  // namespace trainmem::graph::step
