// Tensor parallelism on one rank: the model a rank of a `tp`-way torch parallelize_module run
// holds, and the collectives the Megatron plan adds to its step (docs/parallelism.md, "Tensor
// parallelism"; python/trainmem/measure/parallel.py tensor_parallelize is the measured code).
#pragma once

#include <cstdint>
#include <string_view>

#include "trainmem/trainmem.h"

namespace trainmem::graph {

// Note [Tensor parallelism]
// What torch.distributed.tensor.parallel does to a Llama decoder layer with the Megatron plan
// (ColwiseParallel on q/k/v_proj and gate/up_proj, RowwiseParallel on o_proj and down_proj, the
// default layouts and use_local_output=True; torch 2.13, torch/distributed/tensor/parallel/style.py),
// and what one rank's memory is made of, measured on 2 gloo ranks (data/ground_truth/parallel/):
//  * parameters: ColwiseParallel distributes the weight as Shard(0) (rows: out_features / tp),
//    RowwiseParallel as Shard(1) (columns: in_features / tp); each rank holds only its local
//    shard (the DTensor's _local_tensor). So a rank is the same layer with num_heads / tp query
//    heads, num_key_value_heads / tp key/value heads and intermediate_size / tp: transformers'
//    LlamaAttention reshapes the local projection with -1 heads (view(*input_shape, -1,
//    head_dim)), and the grouping num_heads / num_kv_heads is unchanged. Gradients and optimizer
//    states are the local shards' size. The embedding, the norms and lm_head are replicated
//    (distribute_module: Replicate DTensors, the same values on every rank, full size).
//  * forward, RowwiseParallel (_prepare_output_fn: outputs.redistribute(Replicate) then
//    to_local): the local matmul's output is a Partial sum; the redistribution
//    (torch/distributed/tensor/_redistribute.py → _collective_utils.py → the functional
//    all_reduce of _functional_collectives.py) is out of place: a new tensor of the output's size
//    (the op clones its input and reduces the clone), after which the partial output dies (the
//    DTensor wrapping it is dropped by to_local). Autograd saves nothing more: the
//    redistribution's backward hands the Replicate gradient on as is (a Partial placement is
//    never produced in backward), so o_proj / down_proj backward are those of a plain linear.
//  * backward, ColwiseParallel (_prepare_input_fn: DTensor.from_local(x, Replicate), a view):
//    the local matmul's input gradient is Partial, and from_local's backward redistributes it to
//    the input's Replicate placement: one out-of-place all_reduce per colwise linear, after which
//    the partial gradient dies. Those gradients are AsyncCollectiveTensor wrappers; autograd's
//    InputBuffer never accumulates into a tensor subclass in place, so the sum of q/k/v's (and of
//    gate/up's) input gradients is a new tensor each time, and (measured) so is the next sum
//    into that result.
// The measuring side sees the wrappers' inner tensors only (tracker._local): a wrapper subclass
// has no memory of its own. On CUDA, NCCL's all-reduce runs on its own stream and the caching
// allocator keeps the freed partial buffers until the collective's event (record_stream):
// unmeasured, not modelled (Note [Collectives on CUDA] in parallel.cpp says the same for FSDP2).
// Not modelled (refused): degrees that do not divide the heads, key/value heads or the MLP's
// width; families other than Llama and Mistral (GPT-2's fused c_attn, Phi-3's qkv_proj /
// gate_up_proj are not split by this plan; Qwen3's q_norm/k_norm would need their gradients
// all-reduced; Qwen2's and Gemma-2's variants are unmeasured); sequence parallelism, a sharded
// embedding or lm_head (loss_parallel), and tensor parallelism combined with data parallelism.

// The model one rank holds: the Architecture with local heads and MLP width, the projections'
// parameters sharded as the plan shards them (parameter_count stays the whole model's, as the
// DTensors report it). Throws Error for what is not modelled (see the Note).
Model tensor_parallel_model(const Model& model, std::uint64_t tp);

// The plan's style for a decoder-layer projection path ("self_attn.q_proj"): colwise, rowwise or
// none (the module is replicated).
enum class TpStyle : std::uint8_t { kNone, kColwise, kRowwise };
TpStyle tp_style(std::string_view path);

}  // namespace trainmem::graph
