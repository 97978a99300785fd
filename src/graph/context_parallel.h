// Context parallelism on one rank: what a rank of torch's context_parallel (ring attention over
// the sequence dimension) holds, and the ring's own allocations in the SDPA op's forward and
// backward (docs/parallelism.md, "Context parallelism"). Mirrored from the source; not measured.
#pragma once

#include <cstdint>
#include <vector>

#include "graph/tape.h"
#include "trainmem/trainmem.h"

namespace trainmem::graph {

// Note [Context parallelism]
// torch.distributed.tensor.experimental.context_parallel (torch 2.13,
// torch/distributed/tensor/experimental/_context_parallel/_attention.py, _load_balancer.py), as
// torchtitan uses it: every rank of a `cp`-way group runs the same model on seq / cp tokens of the
// same sequences. MIRRORED FROM THE SOURCE, NOT MEASURED: the ring dispatches only SDPA's CUDA ops
// (aten._scaled_dot_product_flash/efficient/cudnn_attention and their backwards, _sdpa_handler's
// call_maps); on the CPU, SDPA picks aten._scaled_dot_product_flash_attention_for_cpu, and on
// gloo ranks (torch 2.13) the step fails in DTensor's dispatch with "NotImplementedError:
// Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
// strategy registered." (sdpa_kernel(MATH) fails too: "aten.add.Tensor got mixed torch.Tensor and
// DTensor"). The reference step of a rank, and what the engine builds for it:
//  * the batch: input_ids, labels (already shifted, as torchtitan's loader gives them, and handed
//    to the loss as shift_labels too) and position_ids = arange(seq)[None], the context's
//    `buffers` with seq dim 1 and all in no_restore_buffers (no clone is kept). seq divisible by
//    2 * cp turns the head-tail load balancer on (_create_default_load_balancer): its index
//    [1, seq] int64, then per buffer torch.gather along dim 1 (a new full-size tensor),
//    distribute_tensor(Shard(1)).to_local() (the local chunk .contiguous(): a copy unless batch
//    1; every rank's chunk is copied, _split_tensor(contiguous=True)), shard.clone(),
//    buffer.resize_(local shape) (a shrinking resize keeps the storage: the buffers stay full
//    size) and copy_. The local chunks (for batch 1 views of the gathered tensors) stay in the
//    context's frame (`shards`) until it exits after backward; the rest dies on the way;
//  * the model: every activation has seq / cp tokens; the full parameters (pure CP: the
//    reference all-reduces each .grad in place after backward, which allocates nothing through
//    the caching allocator). The model gets position_ids, so LlamaModel makes no arange, and the
//    rotary embedding runs on the local positions. The loss is ForCausalLMLoss over the local
//    tokens with shift_labels given: no pad-and-shift copy. (transformers' create_causal_mask
//    runs find_packed_sequence_indices on given position_ids; the load-balanced chunks jump at
//    the seam, which it reads as packed sequences and would build a mask that the ring refuses:
//    the reference assumes the mask stays None and is_causal holds. Its few [b, seq / cp] int64
//    temporaries are modelled as on one GPU: Note [Training masks] in step.cpp.);
//  * SDPA: _ContextParallel.sdpa_input_fn wraps q, k, v as Shard(2) DTensors (views); the
//    autograd node above the DTensor dispatch saves q, k, v, the merged output and logsumexp,
//    as without CP. Under it, _templated_ring_attention (rotate method ALL_GATHER, the default
//    of _cp_options, which torchtitan keeps): key/value .contiguous() (copies: they are laid out
//    [b, s, heads, d]); at i = 0 torch.cat of k and v flattened, all_gather_single of it (cp
//    times that, kept to the end; the cat lives until the wait at i = 1, as the collective's
//    Work holds its input); at each later i < cp - 1 another cat (exchange_buffers gathers
//    once: it dies at once). Each i runs the kernel on the branch _is_causal_behavior and the
//    load balancer pick: i = 0 the local q, k, v; i <= rank the full q with the first half of
//    k, v; i > rank the second half of q with the full k, v (partial). _SDPAMerger converts each
//    chunk's output to fp32 (convert_to_f32; a copy for half dtypes), merges with
//    out - sigmoid(block_lse - lse) * (out - block_out) and lse - logsigmoid(lse - block_lse)
//    (each a new tensor, the temporaries dying as Python evaluates), and a partial chunk goes
//    back into the full-size out / lse through _partial_update's torch.cat. The result is
//    .to(the output dtype) (a copy for half dtypes). The kernel's outputs of iteration i die when
//    the loop rebinds them at i + 1. The merged output follows the first operand's layout, the
//    kernel's [b, s, heads, d]: no copy at HF's transpose(1, 2).contiguous() unless a partial
//    update's cat made it [b, heads, s, d] (every rank but the last);
//  * backward, _templated_ring_attention_backward: zeros_like q, k, v in fp32 (accumulators),
//    key/value .contiguous() copies, the same cat + all_gather of k, v (the cat held by its
//    variable until the next cat), per i the kernel's backward (its scratch as without CP, for
//    the chunk's sizes) giving dq, dk, dv of the chunk (dying when rebound at i + 1); dk, dv
//    accumulate in fp32 and travel the ring with ALL_TO_ALL (permute_tensor) every i: a cat of
//    dk and dv (2 kv fp32), the permute's output, and at i > 0 the received buffer's halves
//    updated (i <= rank: _partial_update's cat, new tensors; else in place); dq accumulates in
//    place (i > rank: a _partial_update cat). At the end dq.to(q's dtype) and the last received
//    buffer .to(k's dtype) (copies for half dtypes, else the fp32 tensors themselves); dk and dv
//    are views of one storage.
// The engine builds the last rank of the CP group (rank cp - 1): every i > 0 takes the
// full-query branch, whose merge holds four full-size fp32 outputs at once (a partial merge
// holds three), taken as the worst rank; the other ranks are not compared. On CUDA the
// collectives run on NCCL's stream and the allocator keeps their inputs until the Work
// completes (record_stream); as for TP (Note [Tensor parallelism]) that is not modelled.
// Not modelled (refused): cp with data parallelism other than FSDP2 (below), with HSDP, tensor or
// pipeline parallelism, eager attention (the ring replaces SDPA only), GPT-2 (its Conv1D q/k/v and
// learned positions), inference, LoRA / 4-bit bases, the fused loss, autocast and master-weight
// precisions, seq not divisible by 2 * cp (no load balancing: ranks skip chunks).

// Note [Context parallelism under FSDP2]
// torchtitan's composition (parallelize_llama: apply_fsdp over world_mesh["dp_shard_cp"], the
// context over world_mesh["cp"]), MIRRORED, NOT MEASURED: `gpus` data-parallel groups of `cp`
// ranks, gpus x cp GPUs. Each group runs its own micro-batches (the global batch splits over the
// gpus groups), every rank of a group seq / cp tokens of them as above; fully_shard shards every
// unit over the flattened mesh of all gpus x cp ranks (Note [FSDP2 units] with a shard group of
// gpus x cp), so its all-gathers and reduce-scatters run over all of them, and the reduce-scatter
// also sums the context ranks' gradients: no all-reduce of the .grads is left. A rank's ring
// allocations are pure CP's; its shards and FSDP2 buffers those of a plain FSDP2 rank of a world of
// gpus x cp. The engine's rank is the ring's last (the worst, above) with rank 0's padded shard
// sizes, which every rank whose chunks are whole has (all but the last few of a small dim 0).
// fsdp_param_dtype bf16 over fp32 (torchtitan's default mixed precision) is a bf16 compute without
// autocast, as bf16-true, so the ring runs in bf16.
// The units are the engine's FSDP2 units (Note [FSDP2 units]: one per decoder layer and one root
// unit with the embedding, the final norm and the head, the layout accelerate's transformer-layer
// wrap gives), not torchtitan's: apply_fsdp wraps the embedding alone and [norm, output] as one
// more unit, so there the embedding's gathered copy goes after the forward and the head's is
// gathered at its own time, while the engine's root holds both gathered from the first
// all-gather to the end of backward. The engine's peaks can therefore be above torchtitan's by
// up to one of the two matrices in the unsharded dtype (1 GiB for Llama-3.1-8B in bf16).

// Throws Error for what the Note says is not modelled.
void check_context_parallel(const Model& model, const Recipe& r);

// context_parallel's entry on the batch buffers of `seq` tokens: the transients, and what the
// context keeps until it exits (after backward; the caller releases them).
std::vector<TensorId> shard_buffers(Tape& t, std::uint64_t batch, std::uint64_t seq, std::uint64_t cp);

// One rank's ring attention over its local q [b, heads, s / cp, d] and k, v [b, kv heads, s / cp, d].
struct RingAttention {
  std::uint64_t cp = 1, rank = 0;
  std::uint64_t q_numel = 0, kv_numel = 0, lse_numel = 0;  // local
  DType dtype = DType::kF32;                              // q, k, v and the output
  bool gqa = false;  // the kernel's backward expands dk, dv to the query heads (flash's GQA)
  // Whether the merged output is laid out [b, heads, s, d] (a partial update's cat ran).
  bool output_contiguous() const { return rank + 1 < cp; }
};

// The forward under the dispatch: emits the ring's allocations and frees, and returns the
// merged output and its logsumexp (one reference each, owned by the caller).
std::pair<TensorId, TensorId> ring_attention_forward(Tape& t, const RingAttention& a);

// The backward of the SDPA node (Node::kernel): emits the ring's allocations, sets the node's
// q, k, v gradients (inputs 0, 1, 2) to the storages it returns (k and v share one), and leaves
// in `left` what dies when the node's function returns.
void ring_attention_backward(Tape& t, const RingAttention& a, Node& n, std::vector<TensorId>& left);

}  // namespace trainmem::graph
