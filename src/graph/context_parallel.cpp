// Context parallelism on one rank: the ring attention's allocations. See Note [Context
// parallelism] in context_parallel.h (mirrored from torch's _attention.py, not measured).
#include "graph/context_parallel.h"

#include <string>

#include "common/checked.h"

namespace trainmem::graph {

void check_context_parallel(const Model& model, const Recipe& r) {
  if (r.cp <= 1) return;
  const std::string cp = "cp: " + std::to_string(r.cp);
  // With data parallelism: FSDP2 over the flattened dp_shard x cp mesh (See Note [Context
  // parallelism under FSDP2] in context_parallel.h); `gpus` is the data-parallel degree.
  if ((r.parallel != Parallel::kNone && r.parallel != Parallel::kFsdp) ||
      (r.parallel == Parallel::kNone && r.gpus != 1)) {
    throw Error(cp + " with gpus " + std::to_string(r.gpus) + " / parallel " + std::string(to_string(r.parallel)) +
                ": context parallelism with data parallelism is modelled under FSDP2 (parallel fsdp, sharded over "
                "the gpus x cp ranks); use parallel fsdp, or gpus 1 and parallel none");
  }
  if (r.parallel == Parallel::kFsdp && r.fsdp.replicate > 1) {
    throw Error(cp + " with fsdp_replicate " + std::to_string(r.fsdp.replicate) +
                ": HSDP with context parallelism is not modelled; use fsdp_replicate 1");
  }
  if (r.pp > 1) throw Error(cp + " with pp " + std::to_string(r.pp) + ": context and pipeline parallelism together are not modelled");
  if (r.tp > 1) throw Error(cp + " with tp " + std::to_string(r.tp) + ": context and tensor parallelism together are not modelled");
  if (r.mode == Mode::kInference) throw Error(cp + " is a training knob; inference runs on one GPU");
  if (find_gpu(r.gpu).name == "cpu") {  // docs/parallelism.md, "Why it is not measured"
    throw Error(cp + " needs a CUDA GPU: the ring dispatches SDPA's CUDA kernels only, and DTensor has no rule for "
                "the CPU's flash kernel; name a GPU (trainmem gpus)");
  }
  if (model.arch.family == Family::kGpt2 || model.arch.family == Family::kGemma2) {
    throw Error(cp + " with " + std::string(family_name(model.arch.family)) +
                " is not modelled: context parallelism replaces SDPA, and " +
                (model.arch.family == Family::kGpt2 ? "GPT-2's learned positions and Conv1D q/k/v are not mirrored"
                                                    : "Gemma-2 always runs eager attention"));
  }
  if (r.attention != Attention::kSdpa) {
    throw Error(cp + " with attention " + std::string(to_string(r.attention)) +
                ": context_parallel replaces torch's scaled_dot_product_attention only; use sdpa");
  }
  if (model.arch.attn_dropout > 0) {
    throw Error(cp + " with attention dropout (the config's attention_dropout > 0): the ring's dropout is not "
                "modelled; set attention_dropout to 0");
  }
  if (r.lora.enabled() || r.quant.enabled()) {
    throw Error(cp + " with LoRA or a 4-bit base is not modelled (untested)");
  }
  if (r.loss == Loss::kFused) throw Error(cp + " with loss fused is not modelled; use standard");
  // (Under FSDP2 a bf16 param_dtype policy over fp32 is a bf16 compute without autocast, as bf16-true.)
  if (r.precision != Precision::kFp32 && r.precision != Precision::kBf16True && r.precision != Precision::kFp16True) {
    throw Error(cp + " with precision " + std::string(to_string(r.precision)) +
                " is not modelled (autocast and master weights under the ring are unmirrored); use fp32, bf16-true "
                "or fp16-true");
  }
  if (r.seq % (2 * r.cp) != 0) {
    throw Error(cp + ": seq " + std::to_string(r.seq) + " is not divisible by 2 * cp = " + std::to_string(2 * r.cp) +
                "; context_parallel's head-tail load balancing (the case modelled) needs it");
  }
}

namespace {

// A storage of `numel` elements of `d`.
TensorId alloc(Tape& t, std::uint64_t numel, DType d) {
  return t.alloc_bytes(detail::mul(numel, dtype_bytes(d), "ring attention bytes"), Category::kTemporaries);
}

void release_if(Tape& t, TensorId& id) {
  if (id != kNone) t.release(id);
  id = kNone;
}

}  // namespace

// See Note [Context parallelism]: context_parallel's __enter__ on input_ids, labels ([batch, seq])
// and position_ids ([1, seq]), through _context_parallel_buffers.
std::vector<TensorId> shard_buffers(Tape& t, std::uint64_t batch, std::uint64_t seq, std::uint64_t cp) {
  const DType i64 = DType::kI64;
  TensorId index = alloc(t, seq, i64);  // the head-tail load balancer's (1, seq) indices
  std::vector<TensorId> shards;         // new_buffers, kept by the context's frame until it exits
  TensorId gathered = kNone;
  const std::uint64_t rows_of[] = {batch, batch, 1};
  for (std::uint64_t rows : rows_of) {
    release_if(t, gathered);  // the loop variable is rebound to the next buffer
    gathered = alloc(t, detail::mul(rows, seq, "buffer elements"), i64);  // torch.gather
    if (rows == 1) {  // the local chunk is contiguous already: a view of the gathered tensor
      shards.push_back(gathered);
      t.retain(gathered);
      continue;
    }
    // _split_tensor(contiguous=True): every chunk copied, this rank's kept.
    for (std::uint64_t k = 0; k < cp; ++k) {
      TensorId chunk = alloc(t, rows * seq / cp, i64);
      if (k + 1 < cp) {
        t.release(chunk);
      } else {
        shards.push_back(chunk);
      }
    }
  }
  release_if(t, gathered);
  t.release(index);
  TensorId clone = kNone;
  for (std::uint64_t rows : rows_of) {  // shard.clone(); buffer.resize_(shard.shape) keeps its storage
    TensorId next = alloc(t, rows * seq / cp, i64);
    release_if(t, clone);
    clone = next;
  }
  release_if(t, clone);
  return shards;
}

// See Note [Context parallelism]: _templated_ring_attention and _SDPAMerger, as Python runs them.
std::pair<TensorId, TensorId> ring_attention_forward(Tape& t, const RingAttention& a) {
  TRAINMEM_ASSERT(a.cp > 1 && a.rank < a.cp, "ring attention needs cp > 1 and a rank in the group");
  const DType c = a.dtype, f32 = DType::kF32;
  const std::uint64_t qn = a.q_numel, kvn = a.kv_numel, ln = a.lse_numel;
  TensorId kc = alloc(t, kvn, c);  // key.contiguous()
  TensorId vc = alloc(t, kvn, c);  // value.contiguous()
  TensorId gathered = kNone, in_flight = kNone;
  TensorId merged_out = kNone, merged_lse = kNone;  // the merger's _out and _lse
  TensorId loop_out = kNone, loop_lse = kNone;      // the loop's out, logsumexp
  for (std::uint64_t i = 0; i < a.cp; ++i) {
    if (i == 1) release_if(t, in_flight);  // next_buffer() waits: the all-gather's input is done with
    if (i + 1 < a.cp) {
      TensorId cat = alloc(t, 2 * kvn, c);  // torch.cat([key.flatten(), value.flatten()])
      if (gathered == kNone) {
        gathered = alloc(t, detail::mul(a.cp, 2 * kvn, "all-gathered kv elements"), c);
        in_flight = cat;
      } else {
        t.release(cat);  // exchange_buffers gathers once; the cat's variable is rebound to None
      }
    }
    const bool partial = i > a.rank;  // the second half of q only (load balancing, i > rank)
    const std::uint64_t q_sz = partial ? qn / 2 : qn, l_sz = partial ? ln / 2 : ln;
    TensorId out = alloc(t, q_sz, c);
    TensorId lse = alloc(t, l_sz, f32);
    release_if(t, loop_out);  // out, logsumexp, *rest = op(...) rebinds last iteration's
    release_if(t, loop_lse);
    // _SDPAMerger.step: out.to(float32), lse.to(float32) (lse is fp32 already).
    TensorId block_out = out;
    if (c != f32) {
      block_out = alloc(t, q_sz, f32);
    } else {
      t.retain(block_out);
    }
    if (merged_out == kNone) {
      merged_out = block_out;  // the first chunk becomes _out and _lse
      merged_lse = lse;
      t.retain(merged_lse);
    } else {
      // out - sigmoid(block_lse - lse) * (out - block_out)
      TensorId d1 = alloc(t, l_sz, f32);
      TensorId sg = alloc(t, l_sz, f32);
      t.release(d1);
      TensorId d2 = alloc(t, q_sz, f32);
      TensorId pr = alloc(t, q_sz, f32);
      t.release(sg);
      t.release(d2);
      TensorId new_out = alloc(t, q_sz, f32);
      t.release(pr);
      // lse - logsigmoid(lse - block_lse)
      TensorId d3 = alloc(t, l_sz, f32);
      TensorId ls = alloc(t, l_sz, f32);
      t.release(d3);
      TensorId new_lse = alloc(t, l_sz, f32);
      t.release(ls);
      if (partial) {  // _partial_update: torch.cat of the untouched half and the new one
        TensorId full_lse = alloc(t, ln, f32);
        t.release(merged_lse);
        merged_lse = full_lse;
        TensorId full_out = alloc(t, qn, f32);
        t.release(merged_out);
        merged_out = full_out;
        t.release(new_lse);
        t.release(new_out);
      } else {
        t.release(merged_lse);
        merged_lse = new_lse;
        t.release(merged_out);
        merged_out = new_out;
      }
      t.release(block_out);  // step()'s local
    }
    loop_out = out;
    loop_lse = lse;
  }
  // results(): _out.to(the output dtype), _lse.squeeze(-1).to(fp32) (a view).
  TensorId result = merged_out;
  if (c != f32) {
    result = alloc(t, qn, c);
    t.release(merged_out);
  }
  // The function returns: the rotater's gathered buffer, the loop's last outputs and the
  // contiguous copies go.
  release_if(t, loop_out);
  release_if(t, loop_lse);
  release_if(t, gathered);
  t.release(kc);
  t.release(vc);
  return {result, merged_lse};
}

// See Note [Context parallelism]: _templated_ring_attention_backward.
void ring_attention_backward(Tape& t, const RingAttention& a, Node& n, std::vector<TensorId>& left) {
  TRAINMEM_ASSERT(n.inputs.size() == 3, "the ring's SDPA node has q, k, v inputs");
  const DType c = a.dtype, f32 = DType::kF32;
  const std::uint64_t qn = a.q_numel, kvn = a.kv_numel, ln = a.lse_numel;
  TensorId gq = alloc(t, qn, f32);  // zeros_like(query, dtype=accum_dtype)
  TensorId gk = alloc(t, kvn, f32);
  TensorId gv = alloc(t, kvn, f32);
  TensorId gk_view_of = kNone;  // gk / gv are views of the received buffer when not cat'd
  TensorId kc = alloc(t, kvn, c);
  TensorId vc = alloc(t, kvn, c);
  TensorId gathered = kNone, next_kv = kNone;
  TensorId cq = kNone, ck = kNone, cv = kNone;  // grad_query_, grad_key_, grad_value_
  TensorId lse_half = kNone;                    // logsumexp.chunk(2)[1].contiguous()
  TensorId next_grad_kv = kNone, received = kNone;  // the cat sent, the permute's output
  for (std::uint64_t i = 0; i < a.cp; ++i) {
    if (i + 1 < a.cp) {
      TensorId cat = alloc(t, 2 * kvn, c);  // next_kv = torch.cat(...), held until rebound
      release_if(t, next_kv);
      next_kv = cat;
      if (gathered == kNone) gathered = alloc(t, detail::mul(a.cp, 2 * kvn, "all-gathered kv elements"), c);
    }
    const bool half_q = i > 0 && i > a.rank, half_kv = i > 0 && i <= a.rank;
    const std::uint64_t q_sz = half_q ? qn / 2 : qn, kv_sz = half_kv ? kvn / 2 : kvn;
    TensorId lse_now = kNone;
    if (half_q) lse_now = alloc(t, ln / 2, f32);
    release_if(t, lse_half);  // the tuple assignment rebinds lse
    lse_half = lse_now;
    // The kernel's backward: its own scratch (as without CP, for this chunk), then dq, dk, dv.
    std::vector<TensorId> scratch{alloc(t, q_sz, c), alloc(t, q_sz, f32), alloc(t, half_q ? ln / 2 : ln, f32)};
    if (a.gqa) {
      scratch.push_back(alloc(t, q_sz, c));
      scratch.push_back(alloc(t, q_sz, c));
    }
    TensorId nq = alloc(t, q_sz, c), nk = alloc(t, kv_sz, c), nv = alloc(t, kv_sz, c);
    for (TensorId id : scratch) t.release(id);
    release_if(t, cq);
    release_if(t, ck);
    release_if(t, cv);
    cq = nq;
    ck = nk;
    cv = nv;
    if (i > 0) {
      // next_grad_kv = dkv_rotater.next_buffer(): the last cat goes (the all-to-all is waited
      // for), and grad_key / grad_value become views of the received buffer.
      release_if(t, next_grad_kv);
      next_grad_kv = received;
      t.retain(next_grad_kv);
      release_if(t, gk);
      release_if(t, gv);
      release_if(t, gk_view_of);
      gk_view_of = received;
      t.retain(gk_view_of);
      if (i <= a.rank) {  // _partial_update(..., idx=0, add=True): new tensors replace the views
        gk = alloc(t, kvn, f32);
        gv = alloc(t, kvn, f32);
        release_if(t, gk_view_of);
      }  // else += in place into the received halves
    }  // i == 0: grad_key += grad_key_ in place into the zeros
    TensorId cat = alloc(t, 2 * kvn, f32);  // next_grad_kv = torch.cat([grad_key, grad_value])
    release_if(t, next_grad_kv);
    next_grad_kv = cat;
    TensorId sent = alloc(t, 2 * kvn, f32);  // exchange_buffers: permute_tensor's output, the
    release_if(t, received);                 // rotater's _buffer (the previous one goes)
    received = sent;
    if (i > a.rank) {                   // grad_query = _partial_update(..., idx=1, add=True)
      TensorId nq_full = alloc(t, qn, f32);
      t.release(gq);
      gq = nq_full;
    }  // else grad_query += grad_query_ in place
  }
  // grad_query.to(query.dtype); dkv_rotater.next_buffer().to(key.dtype): k and v are views of it.
  TensorId dq = gq, dkv = received;
  if (c != f32) {
    dq = alloc(t, qn, c);
    left.push_back(gq);
    dkv = alloc(t, 2 * kvn, c);
    left.push_back(received);
  }
  n.inputs[0].reuse = dq;
  n.inputs[1].reuse = dkv;
  n.inputs[2].reuse = dkv;
  left.push_back(dq);  // the function's references; the node's gradients retain their own
  left.push_back(dkv);
  for (TensorId id : {gk, gv, gk_view_of, kc, vc, gathered, next_kv, cq, ck, cv, lse_half, next_grad_kv}) {
    if (id != kNone) left.push_back(id);
  }
}

}  // namespace trainmem::graph
