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

Model tensor_parallel_model(const Model& model, std::uint64_t tp, bool loss_parallel, bool sequence_parallel) {
  if (tp <= 1) return model;
  const Architecture& a = model.arch;
  const std::string prefix = "tp: " + std::to_string(tp) + " with " + std::string(family_name(a.family));
  if (a.family != Family::kLlama && a.family != Family::kMistral && a.family != Family::kQwen2 &&
      a.family != Family::kQwen3 && a.family != Family::kGemma2) {
    throw Error(prefix + " is not modelled: the Megatron plan here is measured on Llama, Qwen2, Qwen3 and "
                         "Gemma-2 (Mistral's layer is Llama's); GPT-2's c_attn and Phi-3's qkv_proj / "
                         "gate_up_proj are fused");
  }
  if (sequence_parallel && a.family == Family::kGemma2) {
    // The plan shards input_layernorm and post_attention_layernorm only; Gemma-2's
    // pre/post_feedforward_layernorm then add a replicated tensor to a Shard(1) DTensor, which
    // torch refuses ("got mixed torch.Tensor and DTensor"; measured).
    throw Error("sequence_parallel: " + std::string(family_name(a.family)) + " is not modelled (its pre/post "
                "feedforward norms are not in the sequence-parallel plan; torch fails there)");
  }
  // Colwise q/k/v biases are sharded with their weights (Shard(0): parameter_groups of the local
  // width has them); a rowwise bias is added to a Partial output, which is not modelled.
  if (a.o_bias || a.mlp_bias) {
    throw Error(prefix + ": biases on o_proj or the MLP are not modelled under tensor parallelism (unmeasured)");
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
  // The norm's output (under sequence parallelism a shard nothing saves) is held by the model's
  // forward until it returns, after the loss (as in standard_loss).
  T logits = colwise_linear(normed, lm_head_param(emb), kNone, local_vocab);
  in_lm_head_ = false;
  T loss = causal_lm_loss(logits, /*vocab_parallel=*/true);
  t_.drop(normed);
  t_.drop(logits);  // the model output, dropped with the output object before backward
  return scale_loss(loss);
}

// loss_parallel's _log_softmax handler on the local [tokens, vocab / tp] fp32 logits `x` (See
// Note [Loss parallel] in tensor_parallel.h): the row max and its all-reduced copy, the shifted
// logits, their exp (freed once summed), the sum-exp and its all-reduced copy, its log, then
// the result; the handler's locals die when it returns.
T StepBuilder::vocab_parallel_log_softmax(const T& x) {
  const std::uint64_t rows = tok_;
  T x_max = fresh(rows, DType::kF32);  // amax(keepdim)
  T max_all = fresh(rows, DType::kF32);  // funcol.all_reduce(MAX), out of place
  t_.drop(x_max);
  T shifted = fresh(x.numel, DType::kF32);
  T e = fresh(x.numel, DType::kF32);
  T sum_exp = fresh(rows, DType::kF32);
  t_.drop(e);
  T sum_all = fresh(rows, DType::kF32);  // funcol.all_reduce(SUM)
  t_.drop(sum_exp);
  T lse = fresh(rows, DType::kF32);
  T result = fresh(x.numel, DType::kF32);
  t_.drop(shifted);
  t_.drop(sum_all);
  t_.drop(lse);
  t_.drop(max_all);
  return result;
}

// loss_parallel's nll_loss_forward handler (reduction mean, no weight): the safe targets, this
// rank's vocab-range mask and the shifted targets (_MaskPartial._partition_value), the gathered
// values and their all-reduced copy, the masked negation, total_weight and the mean. Returns
// the loss; `total_weight` is set (both live on, as autograd saves the latter).
T StepBuilder::vocab_parallel_nll_loss(const T& target, T& total_weight) {
  const std::uint64_t n = target.numel;
  const DType b = DType::kU8, i64 = DType::kI64, f32 = DType::kF32;
  T ne = fresh(n, b);
  T safe = fresh(n, i64);  // where(target != ignore_index, target, 0)
  t_.drop(ne);
  T local_target;
  T mask = partition_targets(n, local_target);
  T picked = fresh(n, f32);  // gather
  {
    T lifted = fresh(1, f32);  // _reduce_value: result[mask] = 0, then the mask is released
    t_.drop(lifted);
  }
  t_.drop(mask);
  T reduced = fresh(n, f32);  // all_reduce(SUM)
  T neg = fresh(n, f32);
  T ne2 = fresh(n, b);
  T result = fresh(n, f32);  // where(target != ignore_index, result, 0)
  t_.drop(ne2);
  t_.drop(neg);
  T ne3 = fresh(n, b);
  T count = fresh(1, i64);
  t_.drop(ne3);
  total_weight = fresh(1, f32);  // count.to(x)
  t_.drop(count);
  T sum = fresh(1, f32);
  T loss = fresh(1, f32);  // sum / total_weight
  t_.drop(sum);
  t_.drop(result);
  t_.drop(safe);
  t_.drop(local_target);
  t_.drop(picked);
  t_.drop(reduced);
  return loss;
}

// _MaskPartial._partition_value (torch/distributed/tensor/_ops/_embedding_ops.py) on `n`
// targets: the mask (t < start) | (t >= end), the two comparisons freed once or'd; then
// t.clone() - start into `local_target`, after which the clone (its operand) dies; then
// masked_tensor[mask] = 0, whose one-element index value dies with it. Returns the mask.
T StepBuilder::partition_targets(std::uint64_t n, T& local_target) {
  T lt = fresh(n, DType::kU8);
  T ge = fresh(n, DType::kU8);
  T mask = fresh(n, DType::kU8);
  t_.drop(lt);
  t_.drop(ge);
  T copy = fresh(n, DType::kI64);
  local_target = fresh(n, DType::kI64);
  t_.drop(copy);
  T lifted = fresh(1, DType::kI64);
  t_.drop(lifted);
  return mask;
}

// The loss node's backward under loss_parallel: the nll_loss_backward handler
// (_nll_loss_and_log_softmax_backward) computes the gradient of log_softmax's input too.
// Its own buffers, in order: grad_output / total_weight, the safe targets, zeros_like(x), the
// partition's mask and shifted targets, the mask's update (to fp32, minus 1), arange, the
// masked grad_output, then exp(x), grad_input + exp, and their product: the gradient.
void StepBuilder::vocab_parallel_nll_backward(Node& nd, std::uint64_t tokens, std::uint64_t local_vocab) {
  nd.kernel = [this, tokens, local_vocab](Node& n, std::vector<TensorId>& left) {
    const std::uint64_t big = tokens * local_vocab;
    const DType b = DType::kU8, i64 = DType::kI64, f32 = DType::kF32;
    T scaled = fresh(1, f32);
    T ne = fresh(tokens, b);
    T safe = fresh(tokens, i64);
    t_.drop(ne);
    T zeros = fresh(big, f32);
    T local_target;
    T mask = partition_targets(tokens, local_target);
    T as_f32 = fresh(tokens, f32);
    T update = fresh(tokens, f32);
    t_.drop(as_f32);
    T arange = fresh(tokens, i64);
    T ne2 = fresh(tokens, b);
    T go = fresh(tokens, f32);  // where(target != ignore_index, grad_output, 0)
    t_.drop(ne2);
    t_.drop(scaled);
    T e = fresh(big, f32);
    T sum = fresh(big, f32);
    t_.drop(e);
    T grad = fresh(big, f32);
    t_.drop(sum);
    TRAINMEM_ASSERT(n.inputs.size() == 1, "the vocab-parallel loss node has one input");
    n.inputs[0].reuse = grad.id;
    for (TensorId id : {go.id, safe.id, zeros.id, mask.id, local_target.id, update.id, arange.id, grad.id}) {
      left.push_back(id);
    }
  };
}

}  // namespace trainmem::graph::step
