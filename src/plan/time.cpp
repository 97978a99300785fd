// The step-time model the planner ranks recipes by. It is a model, not a measurement: its
// assumptions are stated in docs/planner.md and every constant is named here.
//
// Note [Step time]
// time = compute + memory traffic + launch overhead, with no overlap between the three (real
// steps overlap some of it, so absolute times are pessimistic; the ranking is what matters).
//  * compute: matmul and attention FLOPs per GPU per optimizer step at kMatmulEfficiency of the
//    GPU's dense throughput for the compute dtype (fp16/bf16 tensor cores, or plain fp32: PyTorch
//    leaves TF32 off). Forward = 2·tokens·(matmul parameters) + attention (QKᵀ and PV, 4·s·d per
//    head and token; causal SDPA/flash kernels skip the masked half, eager computes it all).
//    Backward = 2× forward for trainable weights (input and weight gradients), 1× for frozen
//    ones (input gradients only). Full checkpointing adds one more forward of the decoder layers.
//  * memory traffic at the GPU's bandwidth: the optimizer update (bytes read and written per
//    trainable parameter, by optimizer and dtype, over the partition the rank steps: ZeRO's and
//    FSDP2's shards), the elementwise work of the decoder layers
//    (norms, activation, rotary, residuals: kElementwisePasses passes over the hidden and
//    intermediate widths per token) and the loss (the logits written, upcast, normalized and
//    differentiated; the fused loss never writes the fp32 copies).
//  * data-parallel collectives (gpus N > 1) at the GPU's interconnect bandwidth, ring algorithms
//    (each GPU sends and receives (N-1)/N of the buffer per all-gather or reduce-scatter, twice
//    that per all-reduce), not overlapped with compute: DDP all-reduces every gradient in every
//    micro-batch's backward, or only in the step's last under no_sync (Note [DDP no_sync] in
//    graph/parallel.cpp; FSDP2's reduce-scatter likewise, Note [FSDP2 no_sync]); FSDP2 all-gathers the
//    parameters in the forward and again in the backward and reduce-scatters the gradients, per
//    micro-batch (the decoder layers' units twice, the root once: it is not resharded after forward;
//    under LoRA every gather carries the frozen base and the reduce-scatter the adapters). DeepSpeed
//    ZeRO-1/2 move DDP's volume plus one all-gather: the gradients are all-reduced in the model
//    dtype (average_tensor → allreduce_and_scatter all-reduces the bucket, then each rank keeps
//    its slices), ZeRO-2 in every micro-batch's backward, ZeRO-1 once per optimizer step (its
//    .grads accumulate locally until the boundary's reduce_gradients), and after the step the
//    updated 16-bit (or fp32) partitions are all-gathered into the flat group once. See Note
//    [DDP buckets] and Note [FSDP2 units] in graph/parallel.cpp, Note [DeepSpeed ZeRO-1/2] in
//    graph/zero.cpp;
//  * CPU offload (ZeRO-Offload, Note [ZeRO-Offload] in graph/zero_offload.cpp), not overlapped
//    either: over PCIe at the GPU's host_gbps per direction, directions summed, this rank's
//    partition (Np elements, model dtype b bytes): its fp32 gradient to the host at the boundary
//    (4 Np), the updated 16-bit partition back (b Np) and, under gradient accumulation over m
//    micro-batches, the partition's gradients through accumulated_grads_in_cpu (to the host in
//    every micro-batch, back from it in all but the first: (2m - 1) b Np); then DeepSpeedCPUAdam
//    on the host, memory-bound: fp32 parameter, gradient and two moments read, parameter and
//    moments written (28 B per element) plus the fp32 → 16-bit staging copy (4 + b), at
//    kHostMemoryGbps per rank. The GPU's optimizer traffic is dropped. ZeRO-3's offload_optimizer
//    (Note [ZeRO-3 offload] in graph/zero3_offload.cpp) moves every micro-batch's gradient
//    partitions to the pinned host buffer and back (2 b Np per micro-batch), the fp32 gradient at
//    the boundary (4 Np) and the updated partition back (b Np, host to host under offload_param);
//    offload_param reads the host partitions at every all-gather (two per micro-batch: 2 m b Np)
//    and, with the optimizer on the GPU, writes the updated partition to the host (b Np). FSDP2's
//    CPUOffloadPolicy (Note [FSDP2 CPU offload] in graph/parallel.cpp) copies the unit's shards
//    (this rank's Np = N / shard group elements, in the shards' dtype s: fp32 under a param_dtype
//    policy) to the GPU at every all-gather (two per micro-batch, one without
//    reshard_after_forward) and every micro-batch's sharded gradient back (s Np), and steps the
//    torch optimizer on the host with the GPU's optimizer traffic per element at kHostMemoryGbps;
//  * tensor parallelism (tp > 1, Note [Tensor parallelism] and Note [Sequence parallelism] in
//    graph/tensor_parallel.h): FLOPs, optimizer traffic and the MLP's elementwise traffic are those
//    of the rank's local model (num_heads / tp, intermediate_size / tp; embedding and lm_head
//    whole); the hidden-width elementwise traffic is whole, or 1/tp under sequence parallelism.
//    Its collectives at the GPU's interconnect bandwidth (intra-node), ring algorithms, per
//    decoder layer and micro-batch, of one activation (tokens x hidden in the compute dtype):
//    without sequence parallelism 2 all-reduces in the forward (o_proj, down_proj) and 5 in the
//    backward (the inputs of q/k/v, gate/up); with it 5 all-gathers and 2 reduce-scatters in the
//    forward and 5 reduce-scatters and 2 all-gathers in the backward (the same volume), plus
//    lm_head's all-gather and the embedding gradient's once per micro-batch; loss parallelism
//    (Note [Loss parallel]) shards lm_head's FLOPs and the loss traffic by tp and adds lm_head's
//    input-gradient all-reduce (reduce-scatter with sequence parallelism) and three per-token
//    fp32 all-reduces once per micro-batch. Full checkpointing
//    repeats the forward's collectives in the recompute. Not overlapped with compute;
//  * context parallelism (cp > 1, Note [Context parallelism] in graph/context_parallel.h): a rank
//    runs seq / cp tokens of every sequence, so every per-token term above (matmul FLOPs, the
//    elementwise and loss traffic) is 1/cp of it, and so is attention under the head-tail load
//    balancing (each rank's queries meet on average the same share of the causal keys); the
//    optimizer works on the whole model. Its collectives, per decoder layer and micro-batch, at
//    the interconnect bandwidth, not overlapped: the forward all-gathers the concatenated key and
//    value chunks ((cp - 1) local chunks received), the backward gathers them again and passes the
//    fp32 key and value gradients around the ring once per rotation ((cp - 1) rotations), and a
//    recompute gathers again; every .grad is all-reduced after each micro-batch's backward (the
//    reference step has no no_sync). Ring rotations add kCpKernelsPerRotation launches per layer;
//  * launches: kLaunchSeconds per kernel; kKernelsPerLayer per decoder layer and micro-batch
//    (forward and backward), more for eager attention and recomputation, and the optimizer's:
//    a few per tensor for per-parameter loops (8-bit AdamW, Adafactor), a few per group for
//    foreach and fused ones.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/checked.h"
#include "estimate.h"
#include "graph/pipeline.h"
#include "graph/tensor_parallel.h"
#include "plan/plan.h"

namespace trainmem {
namespace {

constexpr double kMatmulEfficiency = 0.40;  // achieved share of dense peak in matmuls
constexpr double kMemoryEfficiency = 0.70;  // achieved share of memory bandwidth in elementwise ops
constexpr double kLaunchSeconds = 4e-6;     // per kernel launch, including framework overhead
constexpr double kKernelsPerLayer = 75;     // ~25 forward + ~50 backward kernels per decoder layer
constexpr double kElementwisePasses = 3;    // forward, and twice that in backward: 1 + 2
constexpr double kCpKernelsPerRotation = 10;  // a ring step's SDPA chunk, merge and copies, forward and backward
// Host memory bandwidth one rank's CPUAdam achieves, GB/s: a planning assumption (a server
// socket's DDR5 gives a few hundred GB/s shared by the GPUs it hosts), not measured.
constexpr double kHostMemoryGbps = 50;

bool half_compute(Precision p) { return p != Precision::kFp32; }

// The all-gathers of an FSDP2 layer unit per step on a pipeline's first rank, where it reshards
// after each forward and stays gathered after each backward (Note [Pipeline with FSDP2]): every
// action of its stage that comes first or follows a forward of that stage gathers it. M + 1 under
// both one-stage schedules. With several stages per rank each stage's layers do the same over
// that stage's actions (Note [Interleaved pipeline schedules with FSDP2]; the evictions of V >= 4
// are not counted): the average over the rank's stages, each 1 / V of its parameters.
double pipeline_gathers(const Recipe& r) {
  const std::uint64_t V = r.pp_stages_per_rank;
  std::vector<std::vector<bool>> by_stage(V);
  if (V == 1) {
    for (const graph::PipelineAction& a : graph::pipeline_order(r.pp_schedule, r.pp, 0, r.grad_accum)) {
      by_stage[0].push_back(a.forward);
    }
  } else {
    for (const graph::PipelineStageAction& a : graph::pipeline_multi_order(r.pp_schedule, r.pp, V, 0, r.grad_accum)) {
      by_stage[a.stage / r.pp].push_back(a.forward);
    }
  }
  double gathers = 0;
  for (const std::vector<bool>& actions : by_stage) {
    for (std::size_t i = 0; i < actions.size(); ++i) {
      if (i == 0 || actions[i - 1]) ++gathers;
    }
  }
  return gathers / static_cast<double>(V);
}

struct MatmulCounts {
  double trainable = 0;  // weight elements that get gradients
  double frozen = 0;
  double adapters = 0;   // LoRA A and B elements
  double layer = 0;      // elements inside the decoder layers (recomputed under checkpointing)
  double tensors = 0;    // parameter tensors the optimizer walks
  double trainable_elements = 0;
  double root_elements = 0;  // trainable elements outside the decoder layers (FSDP2's root unit)
  double base_elements = 0;  // the model's own parameters, trained or frozen (FSDP2 gathers them all)
  double base_root = 0;      // those outside the decoder layers
};

MatmulCounts count(const Model& m, const Recipe& r) {
  MatmulCounts c;
  const bool lora = r.lora.enabled();
  for (const ParameterGroup& g : m.parameters) {
    const double n = static_cast<double>(g.numel) * static_cast<double>(g.count);
    const bool in_layer = g.name.find(".N.") != std::string::npos;
    c.base_elements += n;
    if (!in_layer) c.base_root += n;
    if (!lora) {
      c.tensors += static_cast<double>(g.count);
      c.trainable_elements += n;
      if (!in_layer) c.root_elements += n;
    }
    if (!g.matmul_weight) continue;
    (lora ? c.frozen : c.trainable) += n;
    if (in_layer) c.layer += n;
    if (!lora || !in_layer) continue;
    for (const std::string& t : r.lora.targets) {
      // "self_attn.q_proj" matches "model.layers.N.self_attn.q_proj.weight"
      if (g.name.find("." + t + ".weight") == std::string::npos) continue;
      const double rows = static_cast<double>(g.rows), cols = static_cast<double>(g.numel / std::max<std::uint64_t>(1, g.rows));
      // nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out]: either way A+B = r·(in+out).
      const double a = static_cast<double>(r.lora.rank) * (rows + cols) * static_cast<double>(g.count);
      c.adapters += a;
      c.tensors += 2 * static_cast<double>(g.count);
      c.trainable_elements += a;
    }
  }
  c.layer += c.adapters;
  return c;
}

}  // namespace

StepTime step_time(const Model& full, const Recipe& spelled) {
  // A tensor-parallel rank computes on its local model (See Note [Tensor parallelism]).
  const Model model =
      spelled.tp > 1
          ? graph::tensor_parallel_model(full, spelled.tp, spelled.loss_parallel, spelled.sequence_parallel)
          : full;
  const Recipe recipe = detail::resolved_for_model(model, spelled);
  const Gpu& gpu = find_gpu(recipe.gpu);
  const Architecture& a = model.arch;
  StepTime t;
  if (gpu.half_tflops <= 0 || gpu.memory_gbps <= 0) return t;  // the cpu pseudo-device: no model
  const MatmulCounts c = count(model, recipe);
  // A context-parallel rank's tokens: seq / cp of each sequence (attention below still spans seq).
  const double cp = static_cast<double>(recipe.cp);
  const double tokens = static_cast<double>(recipe.batch) * static_cast<double>(recipe.seq) / cp;
  const double micro = static_cast<double>(recipe.grad_accum);
  const double L = static_cast<double>(a.num_layers);

  // FLOPs of one micro-batch.
  const double fwd_mm = 2 * tokens * (c.trainable + c.frozen + c.adapters);
  const double bwd_mm = 2 * 2 * tokens * (c.trainable + c.adapters) + 2 * tokens * c.frozen;
  const bool eager = recipe.attention == Attention::kEager || a.family == Family::kGemma2;
  const bool ckpt = recipe.checkpointing != Checkpointing::kNone;  // full or full-reentrant: one more forward
  const double causal = eager ? 1.0 : 0.5;
  const double attn_fwd = 4 * tokens * static_cast<double>(recipe.seq) * static_cast<double>(a.head_dim) *
                          static_cast<double>(a.num_heads) * L * causal;
  double per_micro = fwd_mm + bwd_mm + attn_fwd * 3;
  if (ckpt) per_micro += 2 * tokens * c.layer + attn_fwd;
  t.flops = per_micro * micro;
  const double peak = (half_compute(recipe.precision) ? gpu.half_tflops : gpu.fp32_tflops) * 1e12;
  t.compute_s = t.flops / (peak * kMatmulEfficiency);

  // Memory traffic.
  const double act = half_compute(recipe.precision) ? 2 : 4;
  const double h = static_cast<double>(a.hidden_size), inter = static_cast<double>(a.intermediate_size);
  const double residual_h = recipe.sequence_parallel ? h / static_cast<double>(recipe.tp) : h;
  double layer_bytes = tokens * L * (10 * residual_h + 4 * inter) * act * kElementwisePasses;
  if (ckpt) layer_bytes *= 4.0 / 3.0;
  // Loss parallelism: a rank's logits are vocab / tp wide (See Note [Loss parallel]).
  const double V = static_cast<double>(a.vocab_size) / (recipe.loss_parallel ? static_cast<double>(recipe.tp) : 1.0);
  const double loss_bytes = tokens * V * (recipe.loss == Loss::kFused ? 2 * act + 8 : 2 * (2 * act + 12));
  const double pb = static_cast<double>(plan::parameter_bytes(recipe));
  const bool master = recipe.precision == Precision::kBf16Master;
  // State dtype: LoRA adapters are fp32 whatever the base (Note [LoRA]).
  const double sb = recipe.lora.enabled() ? 4 : static_cast<double>(plan::state_bytes(recipe.precision));
  const double gb = master ? 4 : (recipe.lora.enabled() ? 4 : pb);       // gradient seen by the optimizer
  const double wb = recipe.lora.enabled() ? 4 : (master ? 4 : pb);       // weight the optimizer updates
  double per_param = 0;
  switch (recipe.optimizer) {
    case Optimizer::kAdamWFused: per_param = (wb + gb + 2 * sb) + (wb + 2 * sb); break;
    case Optimizer::kAdamW: per_param = 2 * ((wb + gb + 2 * sb) + (wb + 2 * sb)); break;
    case Optimizer::kAdamW8bit: per_param = (wb + gb + 2) + (wb + 2); break;
    case Optimizer::kSgd: per_param = (wb + gb + sb) + (wb + sb); break;
    case Optimizer::kAdafactor: per_param = 8 * 4 * 2; break;  // ~8 fp32 passes, read and write
  }
  if (master) per_param += (2 + 4) + (4 + 2);  // grads to fp32, masters back to half
  const bool offload = recipe.offload == Offload::kOptimizer || recipe.offload == Offload::kBoth;
  const bool offload_params = recipe.offload == Offload::kParams || recipe.offload == Offload::kBoth;
  // Each rank steps the optimizer on its own partition: ZeRO's 1/gpus, FSDP2's shard over its
  // shard group (Note [FSDP2 variants]; every rank of the dp_shard x cp mesh under context
  // parallelism), the whole (local) model otherwise.
  double opt_share = 1;
  if (is_zero(recipe.parallel)) {
    opt_share = static_cast<double>(recipe.gpus);
  } else if (recipe.parallel == Parallel::kFsdp) {
    opt_share = static_cast<double>(recipe.gpus) / static_cast<double>(recipe.fsdp.replicate) * cp;
  }
  const double opt_bytes = offload ? 0 : per_param * c.trainable_elements / opt_share;
  const double bw = gpu.memory_gbps * 1e9 * kMemoryEfficiency;
  t.memory_s = ((layer_bytes + loss_bytes) * micro + opt_bytes) / bw;

  // Launches.
  double kernels = kKernelsPerLayer * L * (eager ? 1.2 : 1.0) * (ckpt ? 4.0 / 3.0 : 1.0);
  if (recipe.lora.enabled()) kernels += 8 * static_cast<double>(recipe.lora.targets.size()) * L;
  kernels *= micro;
  const bool per_tensor = recipe.optimizer == Optimizer::kAdamW8bit || recipe.optimizer == Optimizer::kAdafactor;
  if (recipe.cp > 1) kernels += kCpKernelsPerRotation * (cp - 1) * L * micro;
  kernels += per_tensor ? 12 * c.tensors : 40;
  t.overhead_s = kernels * kLaunchSeconds;

  // Collectives.
  // (FSDP2 under context parallelism shards over the cp ranks even with one data-parallel group.)
  if ((recipe.gpus > 1 || (recipe.parallel == Parallel::kFsdp && recipe.cp > 1)) && recipe.parallel != Parallel::kNone &&
      gpu.interconnect_gbps > 0) {
    const double n = static_cast<double>(recipe.gpus);
    const double ring = (n - 1) / n;
    // The .grads in the parameter dtype; LoRA's adapters are fp32 (peft) except in DeepSpeed's
    // bf16 mode, which casts them to bf16 (Note [DeepSpeed ZeRO-1/2]).
    const double adapter = is_zero(recipe.parallel) && master ? 2 : 4;
    const double grads = c.trainable_elements * (recipe.lora.enabled() ? adapter : master ? 2 : pb);
    const double params = c.trainable_elements * (recipe.lora.enabled() ? adapter : pb);
    double moved = 0;  // bytes through each GPU's link per optimizer step
    switch (recipe.parallel) {
      // Under a pipeline each stage all-reduces its own share of the gradients once, in the step's
      // last backward (See Note [Pipeline with DDP] in graph/pipeline.cpp).
      case Parallel::kDdp:
        moved = recipe.pp > 1       ? 2 * ring * grads / static_cast<double>(recipe.pp)
                : recipe.ddp_no_sync ? 2 * ring * grads
                                     : 2 * ring * grads * micro;
        break;
      case Parallel::kFsdp: {
        // All-gathers of the (param_dtype) parameters, two per micro-batch or one with
        // reshard_after_forward false, and the reduce-scatter of the (reduce_dtype) gradients, over
        // the shard group; HSDP adds the all-reduce of the reduced shard across the replicas.
        // Under context parallelism the shard group is every rank of the dp_shard x cp mesh (Note
        // [Context parallelism under FSDP2] in graph/context_parallel.h).
        const Fsdp& f = recipe.fsdp;
        const double shard = n / static_cast<double>(f.replicate) * cp;
        const double shard_ring = (shard - 1) / shard;
        // The gathers carry the whole model: under LoRA the frozen base (in the precision's dtype,
        // half when loaded half)
        // and the fp32 adapters, which reduce alone (Note [LoRA under FSDP2] in graph/parallel.cpp).
        const double item = f.param_dtype == FsdpDtype::kBf16 ? 2 : pb;
        double root_gathered = c.base_root * item;
        double layers_gathered = (c.base_elements - c.base_root) * item + c.adapters * (f.param_dtype == FsdpDtype::kBf16 ? 2 : 4);
        if (recipe.quant.enabled()) {
          // A 4-bit base (Note [QLoRA under FSDP2] in graph/parallel.cpp): the layers' packed
          // weights, half a byte per element, and the fp32 rest of prepare_model_for_kbit_training.
          const double packed = c.layer - c.adapters;
          root_gathered = c.base_root * 4;
          layers_gathered = packed / 2 + (c.base_elements - c.base_root - packed) * 4 + c.adapters * 4;
        }
        const double gathered = root_gathered + layers_gathered;
        const double reduced = f.reduce_dtype == FsdpDtype::kFp32 ? c.trainable_elements * 4
                               : f.param_dtype == FsdpDtype::kBf16 ? c.trainable_elements * 2
                                                                   : grads;
        if (recipe.pp > 1) {
          // Under a pipeline (Note [Pipeline with FSDP2] in graph/pipeline.cpp) each stage moves
          // its own share, and a unit reshards after forwards only: it gathers where the stage's
          // schedule runs it after a forward, or first, (M + 1 times with reshard_after_forward,
          // once without), and it reduces once, in perform_reduce_grad.
          const double stage_gathers = f.reshard_after_forward ? pipeline_gathers(recipe) : 1;
          moved = shard_ring * (stage_gathers * gathered + reduced) / static_cast<double>(recipe.pp);
          if (f.replicate > 1) {
            const double rep = static_cast<double>(f.replicate);
            moved += 2 * (rep - 1) / rep * reduced / shard / static_cast<double>(recipe.pp);
          }
          break;
        }
        // Under no_sync the gradients are reduced once, in the step's last micro-batch (Note [FSDP2
        // no_sync] in graph/parallel.cpp); the gathers stay per micro-batch.
        const double reductions = f.no_sync ? 1 : micro;
        moved = shard_ring * (((f.reshard_after_forward ? 2 : 1) * layers_gathered + root_gathered) * micro +
                              reduced * reductions);
        if (f.replicate > 1) {
          const double rep = static_cast<double>(f.replicate);
          moved += 2 * (rep - 1) / rep * reduced / shard * reductions;
        }
        break;
      }
      case Parallel::kZero1: moved = 2 * ring * grads + ring * params; break;
      case Parallel::kZero2: moved = 2 * ring * grads * micro + ring * params; break;
      // ZeRO-3: every micro-batch gathers the parameters for the forward and again for the
      // backward and reduce-scatters the gradients, as FSDP2 does; under LoRA the gathers carry
      // the frozen base too (in the 16-bit dtype DeepSpeed's bf16 mode casts every parameter to,
      // fp32 in its fp32 mode).
      case Parallel::kZero3: {
        double gathered = recipe.lora.enabled() ? (c.base_elements + c.adapters) * adapter : params;
        if (recipe.quant.enabled()) {
          // A 4-bit base (Note [QLoRA under ZeRO-3] in graph/zero3.cpp): the layers' packed weights
          // as bytes, half a byte per element, beside the rest in the mode's dtype.
          const double packed = c.layer - c.adapters;
          gathered = packed / 2 + (c.base_elements - packed + c.adapters) * adapter;
        }
        moved = ring * (2 * gathered + grads) * micro;
        break;
      }
      case Parallel::kNone: break;
    }
    t.comm_s = moved / (gpu.interconnect_gbps * 1e9);
  }
  double tp_comm_s = 0;  // on the critical path of every micro-batch: scaled with the compute under a pipeline
  if (recipe.tp > 1 && gpu.interconnect_gbps > 0) {
    const double n = static_cast<double>(recipe.tp);
    const double ring = (n - 1) / n;
    const double activation = tokens * h * act;  // one [batch, seq, hidden] in the compute dtype
    double per_layer = 0, per_micro_extra = 0;  // ring-step bytes through each GPU's link
    if (recipe.sequence_parallel) {
      per_layer = (7 + 7 + (ckpt ? 7 : 0)) * ring * activation;  // forward, backward, recompute
      per_micro_extra = 2 * ring * activation;                     // lm_head's input, the embedding's gradient
    } else {
      per_layer = (2 + 5 + (ckpt ? 2 : 0)) * 2 * ring * activation;
    }
    if (recipe.loss_parallel) {
      // lm_head's input gradient: all-reduced, or reduce-scattered under sequence parallelism;
      // and loss_parallel's three all-reduces of one fp32 value per token (max, sum-exp, target).
      per_micro_extra += (recipe.sequence_parallel ? 1 : 2) * ring * activation + 3 * 2 * ring * tokens * 4;
    }
    tp_comm_s = (per_layer * L + per_micro_extra) * micro / (gpu.interconnect_gbps * 1e9);
  }
  if (recipe.cp > 1 && gpu.interconnect_gbps > 0) {
    const double kv = tokens * static_cast<double>(a.num_kv_heads) * static_cast<double>(a.head_dim) * 2;
    const double gathers = ckpt ? 3 : 2;  // forward, backward, recompute
    const double per_layer = (cp - 1) * kv * (gathers * act + 4);                 // + the fp32 gradients' rotations
    // Pure CP all-reduces every .grad; under FSDP2 its reduce-scatter (above) sums them instead.
    const double grads = recipe.parallel == Parallel::kNone ? c.trainable_elements * (master ? 2 : pb) : 0;
    t.comm_s += (per_layer * L + 2 * (cp - 1) / cp * grads) * micro / (gpu.interconnect_gbps * 1e9);
  }
  if (recipe.parallel == Parallel::kFsdp && recipe.offload == Offload::kBoth) {
    const Fsdp& f = recipe.fsdp;
    const double shards = static_cast<double>(recipe.gpus) / static_cast<double>(f.replicate);
    const double s = f.param_dtype == FsdpDtype::kNone ? pb : 4;  // the shards' dtype (LoRA's adapters: fp32)
    // Every all-gather copies its unit's shards to the GPU (the layers twice with
    // reshard_after_forward, the root once: it is never resharded after forward, Note [FSDP2
    // units]), under LoRA the frozen base's with the adapters'; every micro-batch copies the
    // trainable shards' gradients back, and the optimizer steps them on the host.
    const double root = c.base_root * s / shards;
    const double layers = ((c.base_elements - c.base_root) * s + c.adapters * 4) / shards;
    const double grads = recipe.lora.enabled() ? c.adapters * 4 / shards : c.trainable_elements * s / shards;
    if (gpu.host_gbps > 0) {
      t.host_s += ((f.reshard_after_forward ? 2 : 1) * layers + root + grads) * micro / (gpu.host_gbps * 1e9);
    }
    t.host_s += c.trainable_elements / shards * per_param / (kHostMemoryGbps * 1e9);
  } else if (offload || offload_params) {
    const double np = c.trainable_elements / static_cast<double>(recipe.gpus);
    const double b = pb;  // the flat group's (ZeRO-3: the partitions') dtype (bf16-master: bf16)
    double pcie = 0;
    if (offload && recipe.parallel == Parallel::kZero3) {
      pcie += np * (2 * b * micro + 4 + (offload_params ? 0 : b));
    } else if (offload) {
      pcie += np * (4 + b + (micro > 1 ? (2 * micro - 1) * b : 0));
    }
    if (offload_params) pcie += np * b * (2 * micro + (offload ? 0 : 1));
    if (gpu.host_gbps > 0) t.host_s += pcie / (gpu.host_gbps * 1e9);
    if (offload) t.host_s += np * (28 + 4 + b) / (kHostMemoryGbps * 1e9);
  }
  if (recipe.pp > 1) {
    // Pipeline parallelism (Note [Pipeline parallelism] in graph/pipeline.cpp): each of the N
    // stages does 1/N of the work above (an even split of the layers; the head and the loss are
    // not singled out), and a step of M micro-batches takes M + N - 1 micro-batch slots of a
    // stage: the bubble, (N - 1) / (M + N - 1) of the step idle. The optimizer runs after the
    // pipeline drains, on each stage's share, outside the bubble. On the critical path every
    // slot also moves one activation forward and one gradient back between neighbours, at the
    // interconnect bandwidth, not overlapped.
    // With V stages per rank (Note [Interleaved pipeline schedules]: ScheduleInterleaved1F1B,
    // ScheduleLoopedBFS) a slot is one stage's micro-batch, 1 / V of a rank's share: the fill and
    // the drain take N - 1 such slots, so the bubble is (N - 1) / V of a rank's micro-batch,
    // (N - 1) / (V M) of the busy time (Narayanan et al. 2021, sec. 2.2.2, for the interleaved
    // schedule; Lamy-Poirier 2023 for the breadth-first one), and each micro-batch crosses V
    // boundaries per rank.
    const double n = static_cast<double>(recipe.pp);
    const double v = static_cast<double>(recipe.pp_stages_per_rank);
    const double slots = (micro + (n - 1) / v) / micro;
    const double opt_s = opt_bytes / bw;
    t.compute_s = t.compute_s / n * slots;
    t.memory_s = ((t.memory_s - opt_s) / n) * slots + opt_s / n;
    t.overhead_s = t.overhead_s / n * slots;
    t.flops /= n;
    // PP x TP (Note [Pipeline with tensor parallelism] in graph/pipeline.cpp): a stage's
    // collectives are those of its 1/N of the layers, in every slot like its compute; under
    // sequence parallelism the stages exchange this rank's Shard(1), 1/T of the activation.
    tp_comm_s = tp_comm_s / n * slots;
    if (gpu.interconnect_gbps > 0) {
      const double p2p = 2 * tokens * residual_h * act;  // an activation and its gradient, one micro-batch
      t.comm_s += (v * micro + n - 1) * p2p / (gpu.interconnect_gbps * 1e9);
    }
  }
  t.comm_s += tp_comm_s;
  t.seconds = t.compute_s + t.memory_s + t.overhead_s + t.comm_s + t.host_s;
  return t;
}

}  // namespace trainmem
