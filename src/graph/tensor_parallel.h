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
//    the partial gradient dies. The redistribution waits for the collective and hands on its plain
//    result, so autograd's InputBuffer sums q/k/v's (and gate/up's) input gradients in place, as
//    on one process (re-measured with the tracker's in-place rule, docs/parallelism.md). On the
//    CPU gloo's worker may hold a collective's output a little longer than the main thread
//    (a free that lands late; the tracker's freed_off_thread_bytes): not modelled.
// The measuring side sees the wrappers' inner tensors only (tracker._local): a wrapper subclass
// has no memory of its own. On CUDA, NCCL's all-reduce runs on its own stream and the caching
// allocator keeps the freed partial buffers until the collective's event (record_stream):
// unmeasured, not modelled (Note [Collectives on CUDA] in parallel.cpp says the same for FSDP2).
// Qwen3's q_norm / k_norm (RMSNorm over head_dim, between q/k_proj and the attention) run on the
// rank's heads with the whole [head_dim] weight: transformers' own plan calls them
// "replicated_with_grad_allreduce", and the measuring side declares their input Shard(2) of the
// heads, so their weight gradient is a Partial DTensor (measured: parallel/cpu-*tp2*-qwen3w512l2-*,
// the engine unchanged: the local model has heads / tp heads).
// Not modelled (refused): degrees that do not divide the heads, key/value heads or the MLP's
// width; GPT-2 and Phi-3 (their fused c_attn, qkv_proj / gate_up_proj are not split by this
// plan); a sharded embedding or lm_head
// (a sharded lm_head is recipe loss_parallel: See Note [Loss parallel]), and tensor parallelism
// combined with data parallelism other than FSDP2 (DDP, ZeRO, HSDP).

// Note [Sequence parallelism]
// Recipe `sequence_parallel` with tp > 1 (python/trainmem/measure/parallel.py
// _sequence_parallelize is the measured code; torch 2.13, torch/distributed/tensor/parallel/style.py
// and torch/distributed/_functional_collectives.py): SequenceParallel() on input_layernorm,
// post_attention_layernorm and the final norm, ColwiseParallel(input_layouts=Shard(1)) on q/k/v and
// gate/up, RowwiseParallel(output_layouts=Shard(1), use_local_output=False) on o/down; the
// embedding and lm_head replicated, the embedding's output split to Shard(1)
// (PrepareModuleOutput) and lm_head's input gathered to Replicate (PrepareModuleInput). The
// residual stream stays a Shard(1) DTensor because transformers' LlamaModel takes the positions
// and the attention masks from inputs_embeds.shape[1] (a DTensor's global length). What a rank
// allocates (measured on 2 gloo ranks, data/ground_truth/parallel/cpu-tp2sp-*):
//  * the residual stream, the norms and their saved tensors are batch x seq/tp x hidden: a
//    DTensor op runs the local op on the shard. Every value there is a DTensor, so autograd's
//    InputBuffer never accumulates their gradients in place (the residual gradient and a norm's
//    input gradient are summed into a new tensor); inside the attention and the MLP (local
//    tensors after to_local) nothing changes.
//  * Shard(1) -> Replicate before each colwise projection (each of q, k, v, gate, up gathers
//    on its own: the redistribution is in the module's input hook): all_gather_into_tensor
//    stacks the shards on dim 0 ([tp*b, s/tp, h]), torch.cat of its chunks on dim 1 makes the
//    gathered [b, s, h], the stacked buffer dies. The projection saves the gathered input (its
//    own copy) for the weight's gradient. Backward: the Partial input gradient is
//    reduce-scattered to Shard(1) (its chunks concatenated on dim 0, a full-size buffer, then
//    reduce_scatter_tensor into the shard), after which the partial gradient dies.
//  * RowwiseParallel's Partial output is reduce-scattered the same way (the concatenated
//    chunks, then the shard), then the partial output dies; backward all-gathers the shard's
//    gradient (stacked, then concatenated) into the local matmul's output gradient.
//  * the embedding's full output dies once its shard (Replicate -> Shard(1): a clone of this
//    rank's chunk) is made; backward all-gathers the shard gradient. lm_head's input is
//    all-gathered like a colwise input; its gradient (Replicate) goes back to Shard(1) as a
//    clone of this rank's chunk. The final norm's output is a shard nothing saves: the model's
//    forward holds it until it returns, after the loss.
//  * the norms' weight gradients are Partial DTensors of the weight's size; the measured steps
//    show no collective for them (any redistribution inside the optimizer's DTensor ops is not
//    seen by the tracker, and is a few hidden-sized vectors).
// Not modelled (refused): a sequence not divisible by tp (DTensor pads uneven shards).

// Note [Gathering a batch of one]
// all_gather_single (torch 2.13, torch/distributed/_functional_collectives.py), which a Shard(1)
// -> Replicate redistribution runs, gets the shards stacked on dim 0 ([tp x b, s/tp, h]) and hands
// them to torch._utils._maybe_view_chunk_cat: when dim 0 is exactly tp (b = 1) and no dimension
// lies between it and the gather dimension, chunking on dim 0 and joining on dim 1 keeps the
// memory order, so the result is a view ([1, s, h]) of the stacked buffer and there is no cat.
// With batch 1 the stacked buffer is therefore what a colwise projection (or lm_head) saves,
// an activation living to that projection's backward, and a gradient all-gathered in backward is
// the stacked output itself. The reduce-scatters still concatenate (_chunk_or_narrow_cat has no
// such view). Measured: the b1 s1024 fp32 SGD run of the 4-layer Llama on 2 gloo ranks
// (data/ground_truth/parallel/cpu-tp2sp-llamaw512l4-fp32-sgd-b1s1024) holds the 20 stacked
// [2, 512, 512] buffers of its colwise inputs at the peak, as activations (the tracker had
// counted them as temporaries until it unwrapped a DTensor's local AsyncCollectiveTensor).

// Note [Loss parallel]
// Recipe `loss_parallel` with tp > 1 (python/trainmem/measure/parallel.py _vocab_parallelize_head
// and training.py run_steps are the measured code; torch 2.13,
// torch/distributed/tensor/parallel/loss.py and style.py; torchtitan's Llama plan): lm_head is
// ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) (input_layouts=Shard(1) under
// sequence parallelism) and the step runs inside loss_parallel(), which swaps the DTensor
// handlers of _log_softmax, nll_loss_forward and their backwards for vocab-parallel ones. What a
// rank holds (measured on 2 gloo ranks, data/ground_truth/parallel/cpu-tp2lp-*, cpu-tp2splp-*):
//  * lm_head.weight is Shard(0): vocab / tp rows, and so are its gradient and optimizer states.
//    Its input is a Replicate view (from_local) whose backward all-reduces the Partial input
//    gradient, as for any colwise projection; under sequence parallelism it is all-gathered
//    from Shard(1) and its gradient reduce-scattered back (See Note [Sequence parallelism]).
//  * the logits are a Shard(-1) DTensor: [b, s, vocab / tp] on each rank; ForCausalLMLoss's
//    .float() and view(-1, vocab) act on the local shard.
//  * _log_softmax's handler computes the max and the sum-exp locally and all-reduces them
//    (funcol.all_reduce, out of place) and returns the local [tokens, vocab / tp] fp32 result,
//    which autograd saves as for a plain log_softmax. nll_loss_forward's handler masks the
//    targets outside this rank's vocab range (_MaskPartial), gathers, all-reduces the picked
//    values and returns the loss and total_weight, saved with the targets as usual.
//  * backward: nll_loss_backward's handler computes the fused gradient of nll_loss and
//    log_softmax ((one-hot + exp(logp)) * grad) into one [tokens, vocab / tp] tensor;
//    _log_softmax_backward_data's handler returns its incoming gradient as is (.to(the same
//    dtype)): no second logits-sized gradient, unlike a plain cross-entropy.
//  * the shifted labels' padded tensor lives until ForCausalLMLoss returns (measured).
//  * the handlers' own intermediates (measured: the measuring side runs each handler of
//    loss.py's customized_loss_ops under the tracker's dispatch mode, training.py _loss_context;
//    torch 2.13 loss.py _log_softmax, _nll_loss_forward, _nll_loss_and_log_softmax_backward and
//    _embedding_ops.py _MaskPartial._partition_value), category temporaries, op by op:
//    forward: amax and its all-reduced copy (the local max dies), the shifted logits, their exp
//    (freed once summed), the sum and its all-reduced copy, log, then the result, the locals
//    freed on return; nll_loss_forward: the safe targets, the vocab-range mask (lt, ge, or),
//    the rank-local targets (clone - offset), gather, its all-reduce, the masked negation, the
//    valid count, total_weight and the mean. Backward: grad_output / total_weight, the safe
//    targets, zeros_like(logp), the partition again, the mask update, arange, the masked
//    grad_output, then exp(logp), the sum and the product (the gradient). With logp saved, the
//    loss backward holds four [tokens, vocab / tp] fp32 buffers at once (zeros, exp, sum, logp),
//    which is where cpu-tp2lp-llamaw512l4-fp32-sgd-b2s512 peaks.
// Not modelled (refused): tied embeddings (ColwiseParallel would shard the embedding's weight
// too), a vocabulary not divisible by tp (uneven shards), loss fused, tp 1.

// The model one rank holds: the Architecture with local heads and MLP width, the projections'
// parameters sharded as the plan shards them, and with `loss_parallel` lm_head's weight Shard(0)
// (parameter_count stays the whole model's, as the DTensors report it). Throws Error for what is
// not modelled (see the Notes), `sequence_parallel` included.
Model tensor_parallel_model(const Model& model, std::uint64_t tp, bool loss_parallel = false,
                            bool sequence_parallel = false);

// The plan's style for a decoder-layer projection path ("self_attn.q_proj"): colwise, rowwise or
// none (the module is replicated).
enum class TpStyle : std::uint8_t { kNone, kColwise, kRowwise };
TpStyle tp_style(std::string_view path);

}  // namespace trainmem::graph
