// Recipe knobs: their spellings (shared by the CLI, the Python API and the JSON output) and the
// checks on their ranges.
#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "common/checked.h"

namespace trainmem {
namespace {

template <typename E, std::size_t N>
using Spellings = std::array<std::pair<E, std::string_view>, N>;

constexpr Spellings<Precision, 6> kPrecisions{{{Precision::kFp32, "fp32"},
                                              {Precision::kBf16Mixed, "bf16-mixed"},
                                              {Precision::kFp16Mixed, "fp16-mixed"},
                                              {Precision::kBf16Master, "bf16-master"},
                                              {Precision::kBf16True, "bf16-true"},
                                              {Precision::kFp16True, "fp16-true"}}};
constexpr Spellings<Optimizer, 5> kOptimizers{{{Optimizer::kAdamW, "adamw"},
                                              {Optimizer::kAdamWFused, "adamw-fused"},
                                              {Optimizer::kAdamW8bit, "adamw-8bit"},
                                              {Optimizer::kSgd, "sgd"},
                                              {Optimizer::kAdafactor, "adafactor"}}};
constexpr Spellings<Checkpointing, 3> kCheckpointing{{{Checkpointing::kNone, "none"},
                                                      {Checkpointing::kFull, "full"},
                                                      {Checkpointing::kFullReentrant, "full-reentrant"}}};
constexpr Spellings<Attention, 3> kAttention{{{Attention::kEager, "eager"},
                                              {Attention::kSdpa, "sdpa"},
                                              {Attention::kFlash, "flash"}}};
constexpr Spellings<Loss, 2> kLoss{{{Loss::kStandard, "standard"}, {Loss::kFused, "fused"}}};
constexpr Spellings<AttentionMask, 3> kAttentionMask{
    {{AttentionMask::kNone, "none"}, {AttentionMask::kOnes, "ones"}, {AttentionMask::kPadded, "padded"}}};
constexpr Spellings<AllocatorMode, 2> kAllocator{{{AllocatorMode::kDefault, "default"},
                                                  {AllocatorMode::kExpandable, "expandable"}}};
constexpr Spellings<QuantType, 2> kQuantTypes{{{QuantType::kFp4, "fp4"}, {QuantType::kNf4, "nf4"}}};
constexpr Spellings<LoadDtype, 3> kLoadDtypes{
    {{LoadDtype::kAuto, "auto"}, {LoadDtype::kBf16, "bf16"}, {LoadDtype::kFp16, "fp16"}}};
constexpr Spellings<QuantStorage, 2> kQuantStorages{{{QuantStorage::kUint8, "uint8"}, {QuantStorage::kBf16, "bf16"}}};
constexpr Spellings<Mode, 2> kModes{{{Mode::kTraining, "training"}, {Mode::kInference, "inference"}}};
constexpr Spellings<Parallel, 6> kParallel{{{Parallel::kNone, "none"},
                                            {Parallel::kDdp, "ddp"},
                                            {Parallel::kFsdp, "fsdp"},
                                            {Parallel::kZero1, "zero1"},
                                            {Parallel::kZero2, "zero2"},
                                            {Parallel::kZero3, "zero3"}}};

constexpr Spellings<FsdpDtype, 3> kFsdpDtypes{{{FsdpDtype::kNone, "none"},
                                                {FsdpDtype::kFp32, "fp32"},
                                                {FsdpDtype::kBf16, "bf16"}}};
constexpr Spellings<Offload, 4> kOffload{{{Offload::kNone, "none"},
                                          {Offload::kOptimizer, "optimizer"},
                                          {Offload::kParams, "params"},
                                          {Offload::kBoth, "both"}}};
constexpr Spellings<PipelineSchedule, 4> kPipelineSchedule{{{PipelineSchedule::k1F1B, "1f1b"},
                                                             {PipelineSchedule::kGPipe, "gpipe"},
                                                             {PipelineSchedule::kInterleaved1F1B, "interleaved-1f1b"},
                                                             {PipelineSchedule::kLoopedBFS, "looped-bfs"}}};

template <typename E, std::size_t N>
std::string_view name_of(const Spellings<E, N>& table, E e) {
  for (const auto& [v, s] : table) {
    if (v == e) return s;
  }
  return "?";
}

template <typename E, std::size_t N>
E parse(const Spellings<E, N>& table, std::string_view s, std::string_view field) {
  for (const auto& [v, name] : table) {
    if (name == s) return v;
  }
  // Spellings are lowercase: name the one a differently cased value meant.
  const std::string folded = detail::lower(s);
  for (const auto& [v, name] : table) {
    if (name == folded) {
      throw Error(std::string(field) + ": unknown value '" + std::string(s) + "'; values are lowercase: '" +
                  std::string(name) + "'");
    }
  }
  std::string valid;
  for (const auto& [v, name] : table) valid += (valid.empty() ? "" : ", ") + std::string(name);
  throw Error(std::string(field) + ": unknown value '" + std::string(s) + "'; expected one of " + valid);
}

// Largest micro-batch (kMaxBatch, trainmem.h), sequence length or accumulation count we accept.
// Larger values are not training recipes, and keeping them bounded keeps b*s*s*heads products
// checkable. Every micro-batch is simulated (about as long as one forward and backward), so the
// count (kMaxAccum, trainmem.h) is capped where an estimate still takes seconds, not hours.
constexpr std::uint64_t kMaxSeq = std::uint64_t{1} << 24;
constexpr std::uint64_t kMaxCp = 64;  // as many as tensor parallelism's
constexpr std::uint64_t kMaxPp = 64;  // the measuring side's MAX_PP
constexpr std::uint64_t kMaxPpStagesPerRank = 64;  // the measuring side's MAX_PP_STAGES_PER_RANK
constexpr std::uint64_t kMaxTp = 64;  // the measuring side's MAX_TP (python/trainmem/measure/recipe.py)

// A precision with one dtype for weights and compute: no autocast, no master copy.
bool one_dtype(Precision p) { return p == Precision::kFp32 || p == Precision::kBf16True || p == Precision::kFp16True; }

// A torch optimizer (torch.optim.AdamW, fused or not, or SGD), not bitsandbytes' or transformers'.
bool torch_optimizer(Optimizer o) { return o == Optimizer::kAdamW || o == Optimizer::kAdamWFused || o == Optimizer::kSgd; }

void check_range(std::string_view field, std::uint64_t v, std::uint64_t max) {
  if (v < 1 || v > max) {
    throw Error(std::string(field) + ": must be between 1 and " + std::to_string(max) + ", got " +
                std::to_string(v));
  }
}

// "q_proj, v_proj" → {"q_proj", "v_proj"}; empty names are an error.
std::vector<std::string> split_targets(std::string_view s) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    std::size_t comma = s.find(',', start);
    std::string_view item = s.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) throw Error("lora_targets: empty module name in '" + std::string(s) + "'");
    out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

// What the engine models of TP x DP: torch's FSDP + TP recipe as the measuring side runs it
// (python/trainmem/measure/parallel.py _tp_fsdp; docs/parallelism.md "TP x DP"): a 2-D mesh
// (dp = gpus, tp), the Megatron plan over mesh["tp"], fully_shard over mesh["dp"] with FSDP2's
// default knobs, with or without sequence and loss parallelism (measured:
// data/ground_truth/parallel/cpu-tp2dp2sp*, cpu-tp2dp2lp-*; See Note [Partial gradients under
// FSDP2]). `gpus` is the data-parallel degree; the run has gpus x tp GPUs. What was not measured
// is refused.
void validate_tensor_x_data_parallel(const Recipe& r) {
  const std::string what = "tp: " + std::to_string(r.tp) + " with gpus " + std::to_string(r.gpus) + " / parallel " +
                           std::string(to_string(r.parallel));
  if (r.parallel != Parallel::kFsdp) {
    throw Error(what + ": tensor parallelism combined with data parallelism is modelled under parallel fsdp only (torch's "
                       "FSDP2 + TP over a (dp, tp) mesh); DDP or DeepSpeed ZeRO over a tensor-parallel model is "
                       "unmeasured");
  }
  if (r.gpus < 2) {
    throw Error(what + ": parallel fsdp with tp needs gpus (the data-parallel degree) of 2 or more; use parallel "
                       "none for tensor parallelism alone");
  }
  if (!r.fsdp.is_default()) {
    throw Error(what + ": fsdp_reshard_after_forward / fsdp_replicate / fsdp_param_dtype / fsdp_reduce_dtype / fsdp_no_sync are "
                       "not modelled with tensor parallelism (HSDP + TP and mixed-precision policies over DTensor "
                       "parameters are unmeasured); keep FSDP2's defaults");
  }
  if (r.precision != Precision::kFp32 && r.precision != Precision::kBf16True && r.precision != Precision::kBf16Mixed) {
    throw Error(what + " with precision " + std::string(to_string(r.precision)) +
                " is not modelled (unmeasured); use fp32, bf16-mixed or bf16-true");
  }
}

// What the engine models of tensor parallelism: what the measuring side runs
// (python/trainmem/measure/recipe.py _check_tp); the architecture's part (divisible heads, the
// families whose projections are separate nn.Linear modules) is checked with the model
// (graph/tensor_parallel.cpp).
void validate_tensor_parallel(const Recipe& r) {
  const std::string tp = "tp: " + std::to_string(r.tp);
  if (r.gpus > 1 || r.parallel != Parallel::kNone) validate_tensor_x_data_parallel(r);
  if (r.mode == Mode::kInference) throw Error(tp + " is a training knob; inference runs on one GPU");
  if (r.sequence_parallel && r.seq % r.tp != 0) {
    throw Error("sequence_parallel: seq " + std::to_string(r.seq) + " is not a multiple of " + tp +
                "; uneven sequence shards (DTensor pads them) are not modelled");
  }
  if (r.lora.enabled() || r.quant.enabled()) {
    throw Error(tp + " with LoRA or a 4-bit base is not modelled (peft's and bitsandbytes' layers are not the "
                     "nn.Linear modules ColwiseParallel / RowwiseParallel shard)");
  }
  if (!torch_optimizer(r.optimizer)) {
    throw Error(tp + " with optimizer " + std::string(to_string(r.optimizer)) +
                " is not modelled; use adamw, adamw-fused or sgd");
  }
  if (r.loss == Loss::kFused) {
    throw Error(tp + " with loss fused is not modelled (the chunked loss reads lm_head.weight outside the "
                     "module's forward); use standard");
  }
  // Every precision: autocast and master copies over DTensor parameters work on the local shards
  // as on one GPU (measured: cpu-tp2*-llamaw512l4-{bf16mixed,fp16mixed,bf16master}-*, and under
  // FSDP2 and a pipeline what those take); TP x DP below, FSDP2 and pipelines refuse their own.
}

// What the engine models of pipeline parallelism: what the measuring side runs
// (python/trainmem/measure/recipe.py _check_pp); the architecture's part (the Llama family or
// Phi-3, untied embeddings, at least one layer per stage) is checked with the model
// (graph/pipeline.cpp).
void validate_pipeline_parallel(const Recipe& r) {
  const std::string pp = "pp: " + std::to_string(r.pp);
  // PP x DP: --gpus is the data-parallel degree (as under --tp), DDP or FSDP2 over each stage's
  // replicas (See Notes [Pipeline with DDP] and [Pipeline with FSDP2] in graph/pipeline.cpp).
  if (r.parallel != Parallel::kNone && r.parallel != Parallel::kDdp && r.parallel != Parallel::kFsdp) {
    throw Error(pp + " with parallel " + std::string(to_string(r.parallel)) +
                ": pipeline parallelism combined with a data-parallel wrapper other than DDP or FSDP2 is not "
                "modelled yet; use parallel none, ddp or fsdp");
  }
  // PP x TP (See Note [Pipeline with tensor parallelism] in graph/pipeline.cpp): a (pp, tp) or,
  // with FSDP2, (pp, dp, tp) mesh, with sequence and loss parallelism; validate_tensor_parallel has
  // refused what TP alone and TP x DP do not model.
  if (r.parallel == Parallel::kFsdp && r.gpus < 2) {
    throw Error(pp + " with parallel fsdp and gpus 1: FSDP2 under a pipeline shards each stage over its gpus "
                     "data-parallel ranks and is modelled for 2 or more; use gpus 2 or more, or parallel none");
  }
  if (r.mode == Mode::kInference) throw Error(pp + " is a training knob; inference runs on one GPU");
  if (r.lora.enabled() || r.quant.any()) throw Error(pp + " with LoRA or a quantized base is not modelled");
  if (!torch_optimizer(r.optimizer)) {
    throw Error(pp + " with optimizer " + std::string(to_string(r.optimizer)) +
                " is not modelled; use adamw, adamw-fused or sgd");
  }
  if (r.loss != Loss::kStandard) {
    throw Error(pp + " with loss fused is not modelled (the last stage's loss is the schedule's loss_fn on the "
                     "logits); use standard");
  }
  if (r.precision == Precision::kFp16Mixed) {
    throw Error(pp + " with precision fp16-mixed is not modelled (a GradScaler inside the schedule's loss_fn is "
                     "unmeasured); use fp32, bf16-mixed, bf16-master, bf16-true or fp16-true");
  }
  if (r.attention == Attention::kFlash) {
    throw Error(pp + " with attention flash is not modelled yet (unmeasured: flash runs on a CUDA device only); use "
                     "sdpa or eager");
  }
  if (r.pp_schedule == PipelineSchedule::k1F1B && r.grad_accum < r.pp) {
    throw Error(pp + " with pp_schedule 1f1b needs grad_accum (the schedule's n_microbatches) of at least " +
                std::to_string(r.pp) + ", got " + std::to_string(r.grad_accum) +
                " (Schedule1F1B refuses fewer micro-batches than stages)");
  }
}

// Stages per rank against the schedule (python/trainmem/measure/recipe.py _check_pp_stages): the
// multi-stage schedules need two or more, the others one (See Note [Interleaved pipeline
// schedules] in graph/pipeline.cpp); the layers per stage are checked with the model.
void validate_pipeline_stages(const Recipe& r) {
  const std::uint64_t v = r.pp_stages_per_rank, m = r.grad_accum;
  const std::string schedule(to_string(r.pp_schedule));
  const bool multi = is_multi_stage(r.pp_schedule);
  if (multi && v < 2) {
    throw Error("pp_schedule " + schedule +
                " runs several stages per rank: set pp_stages_per_rank to 2 or more, or use 1f1b or gpipe");
  }
  if (!multi && v != 1) {
    throw Error("pp_stages_per_rank: " + std::to_string(v) +
                " needs a multi-stage schedule: use interleaved-1f1b or looped-bfs, not " + schedule);
  }
  // Several stages per rank are measured plain, with DDP and with FSDP2 (HSDP and a
  // MixedPrecisionPolicy included), and over tensor-parallel stages (See Notes [Interleaved
  // pipeline schedules with DDP] / [... with FSDP2] in graph/pipeline.cpp).
  if (multi && r.parallel != Parallel::kNone && r.parallel != Parallel::kDdp && r.parallel != Parallel::kFsdp) {
    throw Error("pp_schedule " + schedule + " with parallel " + std::string(to_string(r.parallel)) +
                " is not modelled (several stages per rank are measured plain, with ddp and with fsdp)");
  }
  if (r.pp_schedule == PipelineSchedule::kInterleaved1F1B) {
    // ScheduleInterleaved1F1B.__init__: number_of_rounds = max(1, n_microbatches // pp).
    const std::uint64_t rounds = std::max<std::uint64_t>(1, m / r.pp);
    if (m % rounds != 0) {
      throw Error("pp_schedule interleaved-1f1b needs grad_accum (n_microbatches) to be a multiple of its rounds "
                  "max(1, " + std::to_string(m) + " / pp " + std::to_string(r.pp) + ") = " + std::to_string(rounds) +
                  ", got " + std::to_string(m) + " (ScheduleInterleaved1F1B refuses it)");
    }
  }
}

// What the engine models of data parallelism: what the measuring side runs
// (python/trainmem/measure/recipe.py _check_parallel, docs/parallelism.md) and nothing more.
void validate_parallel(const Recipe& r) {
  check_range("gpus", r.gpus, kMaxGpus);
  check_range("tp", r.tp, kMaxTp);
  if (r.sequence_parallel && r.tp == 1) {
    throw Error("sequence_parallel: needs tensor parallelism (tp 2 or more); it shards what the tensor-parallel "
                "group replicates");
  }
  if (r.loss_parallel && r.tp == 1) {
    throw Error("loss_parallel: needs tensor parallelism (tp 2 or more); it shards lm_head and the loss over the "
                "tensor-parallel group");
  }
  check_range("cp", r.cp, kMaxCp);  // the rest is checked with the model (graph/context_parallel.cpp)
  if (r.tp > 1) validate_tensor_parallel(r);
  check_range("pp", r.pp, kMaxPp);
  check_range("pp_stages_per_rank", r.pp_stages_per_rank, kMaxPpStagesPerRank);
  if (r.pp > 1) validate_pipeline_parallel(r);
  if (r.pp > 1) validate_pipeline_stages(r);
  if (r.pp == 1 && r.pp_schedule != PipelineSchedule::k1F1B) throw Error("pp_schedule: a pipeline knob, it needs pp > 1");
  if (r.pp == 1 && r.pp_stages_per_rank != 1) {
    throw Error("pp_stages_per_rank: a pipeline knob, it needs pp > 1");
  }
  for (const auto& [knob, on] : {std::pair{"ddp_find_unused_parameters", r.ddp_find_unused_parameters},
                                  std::pair{"ddp_gradient_as_bucket_view", r.ddp_gradient_as_bucket_view},
                                  std::pair{"ddp_no_sync", r.ddp_no_sync}}) {
    if (on && (r.parallel != Parallel::kDdp || r.pp > 1)) {
      throw Error(std::string(knob) + ": a DistributedDataParallel knob, it needs parallel ddp (without a pipeline)");
    }
  }
  if (r.ddp_gradient_as_bucket_view && r.ddp_find_unused_parameters) {
    throw Error("ddp_gradient_as_bucket_view with ddp_find_unused_parameters is not modelled (unmeasured); "
                "use one of them");
  }
  if (r.ddp_find_unused_parameters && r.loss == Loss::kFused) {
    throw Error("ddp_find_unused_parameters with loss fused is not modelled (unmeasured: _DDPSink clones what the "
                "module returns, which the fused loss changes); use standard");
  }
  if (r.parallel != Parallel::kFsdp && !r.fsdp.is_default()) {
    throw Error("fsdp_reshard_after_forward / fsdp_replicate / fsdp_param_dtype / fsdp_reduce_dtype / fsdp_no_sync: FSDP2 knobs, "
                "they need parallel fsdp");
  }
  if (r.parallel == Parallel::kNone) {
    if (r.gpus != 1) {
      throw Error("gpus: " + std::to_string(r.gpus) +
                  " GPUs need a data-parallel wrapper: parallel ddp, fsdp, zero1, zero2 or zero3");
    }
    return;
  }
  const std::string p(to_string(r.parallel));
  if (r.mode == Mode::kInference) throw Error("parallel: " + p + " is a training knob; inference runs on one GPU");
  // DDP over a peft model buckets the adapters' gradients only (Note [DDP buckets]), ZeRO-1/2's
  // flat group holds them only, FSDP2 and ZeRO-3 partition the frozen base too and reduce the
  // adapters' gradients only (Notes [LoRA under FSDP2], [LoRA under ZeRO-3]).
  // FSDP2's CPUOffloadPolicy pins the frozen shards with the adapters' (Note [LoRA under FSDP2]);
  // DeepSpeed's offload over a peft model is not modelled.
  if (r.lora.enabled() && r.offload != Offload::kNone && r.parallel != Parallel::kFsdp) {
    throw Error("offload: " + std::string(to_string(r.offload)) + " with LoRA is not modelled yet (FSDP2's offload "
                "both is)");
  }
  // DDP over a QLoRA model buckets the adapters only, as over any peft model, and ZeRO-1/2's flat
  // group holds them only; the 4-bit base is every rank's own. FSDP2 shards the packed weights
  // as bytes and leaves their QuantState whole, and ZeRO-3 partitions them as bytes too (Notes
  // [DDP buckets], [QLoRA under ZeRO-1/2], [QLoRA under FSDP2], [QLoRA under ZeRO-3]).
  if (r.parallel == Parallel::kFsdp) {
    if (r.precision == Precision::kFp16Mixed || r.precision == Precision::kBf16Master) {
      throw Error("precision: " + std::string(to_string(r.precision)) +
                  " under parallel fsdp is not modelled (FSDP2 keeps no separate master copy: its bf16 compute "
                  "over fp32 weights is a MixedPrecisionPolicy); use fp32, bf16-true or bf16-mixed");
    }
    if (!torch_optimizer(r.optimizer)) {
      throw Error("optimizer: " + std::string(to_string(r.optimizer)) +
                  " under parallel fsdp is not modelled; use adamw, adamw-fused or sgd");
    }
    if (r.loss == Loss::kFused) {
      throw Error("loss: fused under parallel fsdp is not modelled (it reads lm_head.weight outside the root "
                  "module's forward, where FSDP2 has not gathered it); use standard");
    }
    const Fsdp& f = r.fsdp;
    check_range("fsdp_replicate", f.replicate, kMaxGpus);
    if (f.replicate > 1 && r.gpus % f.replicate != 0) {
      throw Error("fsdp_replicate: " + std::to_string(f.replicate) + " does not divide gpus " + std::to_string(r.gpus) +
                  ": HSDP's mesh is (fsdp_replicate, gpus / fsdp_replicate)");
    }
    if (f.replicate > 1 && r.gpus / f.replicate < 2) {
      throw Error("fsdp_replicate: " + std::to_string(f.replicate) + " with gpus " + std::to_string(r.gpus) +
                  ": HSDP's mesh is (fsdp_replicate, gpus / fsdp_replicate) and needs a shard group of 2 or more "
                  "GPUs");
    }
    if (f.param_dtype == FsdpDtype::kFp32) {
      throw Error("fsdp_param_dtype: fp32 is the parameters' own dtype (the policy's None); use none or bf16");
    }
    // MixedPrecisionPolicy casts fp32 parameters (sharded, the optimizer's) for the all-gather and the
    // compute: over fp32, or under autocast of the same dtype, Accelerate's FSDP2 with mixed precision
    // bf16 (Note [Autocast over an FSDP2 policy] in graph/step_parameters.cpp).
    if (f.param_dtype != FsdpDtype::kNone && r.precision != Precision::kFp32 &&
        !(f.param_dtype == FsdpDtype::kBf16 && r.precision == Precision::kBf16Mixed &&
          !(r.half_model() && !r.lora.enabled()))) {  // a half model trained whole is cast to fp32 first
      throw Error("fsdp_param_dtype: " + std::string(to_string(f.param_dtype)) + " with precision " +
                  std::string(to_string(r.precision)) +
                  ": MixedPrecisionPolicy casts fp32 parameters (sharded, the optimizer's) for the all-gather and "
                  "the compute; use precision fp32, or bf16-mixed (autocast over the policy, Accelerate's FSDP2) "
                  "with fsdp_param_dtype bf16 over an fp32-loaded model or a half-loaded LoRA model");
    }
    if (f.param_dtype != FsdpDtype::kNone && r.quant.load_in_4bit && r.quant.storage != QuantStorage::kBf16) {
      throw Error("fsdp_param_dtype: " + std::string(to_string(f.param_dtype)) + " over a 4-bit base stored as " +
                  std::string(to_string(r.quant.storage)) + " is not modelled (the policy would cast the packed "
                  "weights for the all-gather); use bnb_4bit_quant_storage bf16, or fsdp_param_dtype none");
    }
    if (f.reduce_dtype != FsdpDtype::kNone && f.param_dtype == FsdpDtype::kNone) {
      throw Error("fsdp_reduce_dtype: " + std::string(to_string(f.reduce_dtype)) +
                  " without fsdp_param_dtype is not modelled (the gradients are reduced in the parameters' dtype)");
    }
  }
  if (is_zero(r.parallel)) {
    // DeepSpeed's engine owns the precision: its bf16 mode is a bf16 model with fp32 master
    // partitions (bf16-master); without bf16 / fp16 everything is fp32. CPU offload has no knob.
    if (r.precision != Precision::kFp32 && r.precision != Precision::kBf16Master) {
      throw Error("precision: " + std::string(to_string(r.precision)) + " under parallel " + p +
                  " is not modelled (DeepSpeed's bf16 mode is a bf16 model over fp32 master partitions); use "
                  "fp32 or bf16-master");
    }
    if (!torch_optimizer(r.optimizer)) {
      throw Error("optimizer: " + std::string(to_string(r.optimizer)) + " under parallel " + p +
                  " is not modelled; use adamw, adamw-fused or sgd (a torch optimizer handed to deepspeed.initialize)");
    }
    if (r.loss == Loss::kFused) {
      throw Error("loss: fused under parallel " + p +
                  " is not modelled (it reads lm_head.weight outside the model's forward); use standard");
    }
  }
}

// What the engine models of CPU offload (Note [ZeRO-Offload] in graph/zero_offload.cpp, Note
// [ZeRO-3 offload] in graph/zero3_offload.cpp).
void validate_offload(const Recipe& r) {
  if (r.offload == Offload::kNone) return;
  const std::string what(to_string(r.offload));
  if (r.parallel == Parallel::kFsdp) {
    // FSDP2's CPUOffloadPolicy (Note [FSDP2 CPU offload] in graph/parallel.cpp): one policy for the
    // sharded parameters, their gradients and the optimizer step together.
    if (r.offload != Offload::kBoth) {
      throw Error("offload: " + what + " under parallel fsdp: FSDP2's CPUOffloadPolicy moves the sharded "
                  "parameters, their gradients and the optimizer states to the host together; use offload both");
    }
    if (find_gpu(r.gpu).name == "cpu") {
      throw Error("offload: both under parallel fsdp needs a CUDA GPU (CPUOffloadPolicy pins host memory and "
                  "copies each unit's shards to the device); with gpu cpu the host is the device");
    }
    if (r.pp > 1 || r.tp > 1 || r.cp > 1) {
      throw Error("offload: both under parallel fsdp with tensor, pipeline or context parallelism is not "
                  "modelled; FSDP2's CPUOffloadPolicy is modelled for plain FSDP2 and HSDP");
    }
    return;
  }
  if (!is_zero(r.parallel)) {
    throw Error("offload: " + what + " is DeepSpeed's offload_optimizer / offload_param {device: cpu}; it needs "
                "parallel zero1, zero2 or zero3 (with --gpus 1 too), or for both parallel fsdp (FSDP2's "
                "CPUOffloadPolicy), got parallel " + std::string(to_string(r.parallel)));
  }
  if (r.offload != Offload::kOptimizer && r.parallel != Parallel::kZero3) {
    throw Error("offload: " + what + " offloads the parameters (offload_param), which only ZeRO-3 does; use "
                "parallel zero3, or offload optimizer under " + std::string(to_string(r.parallel)));
  }
  // DeepSpeed refuses a client torch optimizer under offload_optimizer (zero_force_ds_cpu_optimizer,
  // true by default: deepspeed/runtime/engine.py); its config's Adam / AdamW become DeepSpeedCPUAdam.
  if (r.offload != Offload::kParams && r.optimizer != Optimizer::kAdamW) {
    throw Error("optimizer: " + std::string(to_string(r.optimizer)) + " under offload " + what +
                " is not modelled; use adamw (DeepSpeed steps the offloaded partition with DeepSpeedCPUAdam)");
  }
}

}  // namespace

// Accelerate wraps the forward in convert_outputs_to_fp32 when its native AMP is on (fp16 / bf16
// mixed precision, not under DeepSpeed); modelled for a training step on one GPU, DDP or FSDP2.
bool fp32_outputs_modelled(const Recipe& r) {
  return (r.precision == Precision::kBf16Mixed || r.precision == Precision::kFp16Mixed) && !is_zero(r.parallel) &&
         r.tp == 1 && r.pp == 1 && r.cp == 1;
}

bool clip_grad_norm_modelled(const Recipe& r) {
  // DeepSpeed clips inside its own step (Note [DeepSpeed ZeRO-1/2]); FSDP2 and tensor parallelism
  // would take the norms of DTensors, a pipeline runs no Trainer; bf16-master outside ZeRO is no
  // Trainer recipe (its master gradients come after the clip).
  return r.mode == Mode::kTraining && (r.parallel == Parallel::kNone || r.parallel == Parallel::kDdp) &&
         r.tp == 1 && r.pp == 1 && r.cp == 1 && r.precision != Precision::kBf16Master;
}

Precision autocast_of(LoadDtype d) { return d == LoadDtype::kBf16 ? Precision::kBf16Mixed : Precision::kFp16Mixed; }

std::string_view to_string(Precision x) { return name_of(kPrecisions, x); }
std::string_view to_string(Optimizer x) { return name_of(kOptimizers, x); }
std::string_view to_string(Checkpointing x) { return name_of(kCheckpointing, x); }
std::string_view to_string(Attention x) { return name_of(kAttention, x); }
std::string_view to_string(Loss x) { return name_of(kLoss, x); }
std::string_view to_string(AttentionMask x) { return name_of(kAttentionMask, x); }
std::string_view to_string(AllocatorMode x) { return name_of(kAllocator, x); }
std::string_view to_string(Mode x) { return name_of(kModes, x); }
std::string_view to_string(QuantType x) { return name_of(kQuantTypes, x); }
std::string_view to_string(LoadDtype x) { return name_of(kLoadDtypes, x); }
std::string_view to_string(QuantStorage x) { return name_of(kQuantStorages, x); }
DType storage_dtype(QuantStorage x) { return x == QuantStorage::kBf16 ? DType::kBF16 : DType::kU8; }
std::string_view to_string(Parallel x) { return name_of(kParallel, x); }
std::string_view to_string(FsdpDtype x) { return name_of(kFsdpDtypes, x); }
FsdpDtype parse_fsdp_dtype(std::string_view s, std::string_view field) { return parse(kFsdpDtypes, s, field); }
std::string_view to_string(Offload x) { return name_of(kOffload, x); }
std::string_view to_string(PipelineSchedule x) { return name_of(kPipelineSchedule, x); }

Precision parse_precision(std::string_view s) { return parse(kPrecisions, s, "precision"); }
Optimizer parse_optimizer(std::string_view s) { return parse(kOptimizers, s, "optimizer"); }
Checkpointing parse_checkpointing(std::string_view s) { return parse(kCheckpointing, s, "checkpointing"); }
Attention parse_attention(std::string_view s) { return parse(kAttention, s, "attention"); }
Loss parse_loss(std::string_view s) { return parse(kLoss, s, "loss"); }
AttentionMask parse_attention_mask(std::string_view s) { return parse(kAttentionMask, s, "attention_mask"); }
AllocatorMode parse_allocator(std::string_view s) { return parse(kAllocator, s, "allocator"); }
Mode parse_mode(std::string_view s) { return parse(kModes, s, "mode"); }
QuantType parse_quant_type(std::string_view s) { return parse(kQuantTypes, s, "bnb_4bit_quant_type"); }
LoadDtype parse_load_dtype(std::string_view s) { return parse(kLoadDtypes, s, "load_dtype"); }
QuantStorage parse_quant_storage(std::string_view s) { return parse(kQuantStorages, s, "bnb_4bit_quant_storage"); }
Parallel parse_parallel(std::string_view s) { return parse(kParallel, s, "parallel"); }
Offload parse_offload(std::string_view s) { return parse(kOffload, s, "offload"); }
PipelineSchedule parse_pipeline_schedule(std::string_view s) { return parse(kPipelineSchedule, s, "pp_schedule"); }

Recipe parse_recipe(const RecipeSpelling& in) {
  Recipe r;
  r.batch = in.batch;
  r.seq = in.seq;
  r.grad_accum = in.grad_accum;
  r.mode = parse_mode(in.mode);
  // The default: the weights' dtype for inference and for quantized weights (the matmuls' dtype);
  // under DeepSpeed ZeRO its bf16 mode ("bf16": {"enabled": true}: bf16 weights, fp32 master
  // partitions), as autocast (bf16-mixed) is not what a DeepSpeed engine runs.
  const bool quantized = in.load_in_4bit || in.load_in_8bit;
  // A half load dtype is the Trainer recipe under that autocast (Notes [The load dtype of a 4-bit
  // base], [A half model under autocast]).
  r.load_dtype = parse_load_dtype(in.load_dtype);
  r.quant.storage = parse_quant_storage(in.bnb_4bit_quant_storage);
  r.quant.prepare_kbit_training = in.prepare_kbit_training;
  if (!in.precision.empty()) {
    r.precision = parse_precision(in.precision);
  } else if (r.load_dtype != LoadDtype::kAuto && r.mode == Mode::kTraining) {
    r.precision = autocast_of(r.load_dtype);
  } else if (r.mode == Mode::kInference || (quantized && !is_zero(parse_parallel(in.parallel)))) {
    r.precision = Precision::kBf16True;
  } else {
    // (With adapters too: under zero1 / zero2 bf16-master is DeepSpeed's bf16 mode over the adapters.)
    r.precision = is_zero(parse_parallel(in.parallel)) ? Precision::kBf16Master : Precision::kBf16Mixed;
  }
  r.new_tokens = in.new_tokens;
  r.beams = in.beams;
  r.optimizer = parse_optimizer(in.optimizer);
  r.checkpointing = parse_checkpointing(in.checkpointing);
  r.attention = parse_attention(in.attention);
  r.loss = parse_loss(in.loss);
  r.attention_mask = parse_attention_mask(in.attention_mask);
  r.gpu = in.gpu;
  r.allocator = parse_allocator(in.allocator);
  r.lora.rank = in.lora_rank;
  r.lora.dropout = in.lora_dropout;
  r.lora.targets = split_targets(in.lora_targets);
  r.quant.load_in_4bit = in.load_in_4bit;
  r.quant.quant_type = parse_quant_type(in.bnb_4bit_quant_type);
  r.quant.double_quant = in.bnb_4bit_use_double_quant;
  r.quant.load_in_8bit = in.load_in_8bit;
  r.gpus = in.gpus;
  r.parallel = parse_parallel(in.parallel);
  r.tp = in.tp;
  r.sequence_parallel = in.sequence_parallel;
  r.loss_parallel = in.loss_parallel;
  r.cp = in.cp;
  r.pp = in.pp;
  r.pp_schedule = parse_pipeline_schedule(in.pp_schedule);
  r.pp_stages_per_rank = in.pp_stages_per_rank;
  r.fsdp.reshard_after_forward = in.fsdp_reshard_after_forward;
  r.fsdp.no_sync = in.fsdp_no_sync;
  r.ddp_find_unused_parameters = in.ddp_find_unused_parameters;
  r.ddp_gradient_as_bucket_view = in.ddp_gradient_as_bucket_view;
  r.ddp_no_sync = in.ddp_no_sync;
  r.fp32_outputs = in.fp32_outputs;
  r.use_cache = in.use_cache;
  r.clip_grad_norm = in.clip_grad_norm;
  r.fsdp.replicate = in.fsdp_replicate;
  r.fsdp.param_dtype = parse_fsdp_dtype(in.fsdp_param_dtype, "fsdp_param_dtype");
  r.fsdp.reduce_dtype = parse_fsdp_dtype(in.fsdp_reduce_dtype, "fsdp_reduce_dtype");
  r.offload = parse_offload(in.offload);
  r.validate();
  return r;
}

void Recipe::validate() const {
  check_range("batch", batch, kMaxBatch);
  check_range("seq", seq, kMaxSeq);
  check_range("grad_accum", grad_accum, kMaxAccum);
  check_range("steps", steps, 100);
  if (const Gpu& g = find_gpu(gpu); attention == Attention::kFlash) {
    // transformers refuses flash_attention_2 without a CUDA device, so no CPU run measures it; and
    // flash-attn 2 runs on Ampere or newer (sm80+).
    if (g.sm == 0) {
      throw Error("attention: flash needs a CUDA GPU (flash-attn's kernels); gpu cpu replays what a CPU run "
                  "measures, and a CPU run cannot take flash_attention_2; use sdpa or eager, or name a GPU");
    }
    if (g.sm < 80) {
      throw Error("attention: flash needs an Ampere or newer GPU (flash-attn 2 runs on sm80+), and " + g.name +
                  " is older; use sdpa or eager");
    }
    // Without autocast transformers hands flash-attn the Linear weights' dtype
    // (integrations/flash_attention.py, get_target_dtype), and flash-attn takes fp16 and bf16 only.
    // (FSDP2's bf16 param_dtype runs an fp32 model's forward in bf16.)
    if (precision == Precision::kFp32 && !(parallel == Parallel::kFsdp && fsdp.param_dtype == FsdpDtype::kBf16)) {
      throw Error("attention: flash takes fp16 or bf16 tensors only, and precision fp32 runs attention in fp32; "
                  "use a half precision (bf16-mixed, bf16-true, ...) or sdpa or eager");
    }
  }
  if (mode == Mode::kInference) {
    // Generation: weights in one dtype, no optimizer, no accumulation, no adapters (merge them).
    if (!one_dtype(precision)) {
      throw Error("precision: inference loads the weights in one dtype: fp32, bf16-true or fp16-true, got " +
                  std::string(to_string(precision)));
    }
    if (grad_accum != 1) throw Error("grad_accum: inference has no gradient accumulation");
    if (lora.enabled()) throw Error("lora_rank: inference with adapters is not modelled (merge them first)");
    if (checkpointing != Checkpointing::kNone) throw Error("checkpointing: inference keeps no activations to recompute");
    check_range("new_tokens", new_tokens, kMaxSeq);
    check_range("beams", beams, 64);
    if (seq > kMaxSeq - new_tokens) throw Error("seq + new_tokens: must be at most " + std::to_string(kMaxSeq));
  } else if (beams != 1) {
    throw Error("beams: beam search is an inference knob (mode inference)");
  } else if (new_tokens != Recipe{}.new_tokens) {
    throw Error("new_tokens: the tokens a generation adds, an inference knob (mode inference)");
  }
  if (attention_mask != AttentionMask::kNone) {
    // See Note [Padding masks] in graph/step.cpp for what is modelled.
    const std::string m(to_string(attention_mask));
    if (mode == Mode::kInference) {
      throw Error("attention_mask: " + m + " is a training knob; generation always passes a mask of ones");
    }
    if (attention == Attention::kFlash) {
      throw Error("attention_mask: " + m + " with attention flash is not modelled (flash-attention unpads the "
                  "batch); use sdpa or eager");
    }
    if (pp > 1 || cp > 1) {
      throw Error("attention_mask: " + m + " with pipeline or context parallelism is not modelled");
    }
    if (attention_mask == AttentionMask::kPadded && seq < 2) {
      throw Error("attention_mask: padded needs seq >= 2 (a row's first token is never padding)");
    }
  }
  if (use_cache && (mode == Mode::kInference || checkpointing != Checkpointing::kNone || tp > 1 || pp > 1 || cp > 1)) {
    throw Error("use_cache: a training forward's DynamicCache is modelled without checkpointing (which turns it "
                "off), on one GPU, under DDP, FSDP2 or ZeRO (generation always caches)");
  }
  if (fsdp.no_sync && (pp > 1 || cp > 1)) {
    throw Error("fsdp_no_sync: Accelerate's no_sync accumulation is modelled for plain FSDP2 and HSDP (a pipeline "
                "runs its own, context parallelism is not Accelerate's)");
  }
  if (clip_grad_norm && !clip_grad_norm_modelled(*this)) {
    throw Error("clip_grad_norm: the gradient clip is modelled in training on one GPU and under DDP, "
                "without tensor, pipeline or context parallelism and not with bf16-master (DeepSpeed clips in its "
                "own step; FSDP2's norms over DTensors are not modelled)");
  }
  if (fp32_outputs && !fp32_outputs_modelled(*this)) {
    if (precision != Precision::kBf16Mixed && precision != Precision::kFp16Mixed) {
      throw Error("fp32_outputs: Accelerate converts the outputs under its native mixed precision only; it needs "
                  "precision bf16-mixed or fp16-mixed, got " + std::string(to_string(precision)));
    }
    throw Error("fp32_outputs: Accelerate's convert_outputs_to_fp32 is modelled on one GPU, under DDP and under "
                "FSDP2 (DeepSpeed runs without it; with tensor, pipeline or context parallelism it is not modelled)");
  }
  if (checkpointing == Checkpointing::kFullReentrant) {
    // The wrappers' hooks fire inside the inner backward as they do in the outer one (DDP's as
    // each parameter accumulates, ZeRO's and FSDP2's module hooks around the recomputed layer), so
    // the tape's reentrant checkpoint serves them all (measured: parallel/cpu-zero*-*-ckptre-*,
    // cpu-fsdp-*-ckptre-*, cpu-tp2*-ckptre-*). A pipeline stage's backward is not the loss's, and
    // the ring's is unmeasured: not modelled. DDP with find_unused_parameters fails in torch: its
    // forward marks the parameters the no_grad forward left out of the graph ready.
    if (pp > 1 || cp > 1) {
      throw Error("checkpointing: full-reentrant with pipeline or context parallelism is not modelled; use full "
                  "(use_reentrant=False)");
    }
    // Over a 4-bit base under ZeRO-3 the first step's forward frees a gathered weight the engine
    // keeps (measured: up to 13 MB over in step 1 on a QLoRA Llama cut, step 2 exact); not
    // modelled under any sharding wrapper until that is understood.
    if (quant.any() && parallel != Parallel::kNone && parallel != Parallel::kDdp) {
      throw Error("checkpointing: full-reentrant over a quantized base under parallel " +
                  std::string(to_string(parallel)) + " is not modelled; use full (use_reentrant=False), or DDP");
    }
    if (parallel == Parallel::kDdp && ddp_find_unused_parameters) {
      throw Error("checkpointing: full-reentrant under DDP with find_unused_parameters fails in torch (\"Expected "
                  "to mark a variable ready only once\"); use ddp_find_unused_parameters false, or full");
    }
  }
  if (lora.enabled()) {
    // peft's own ranks are small (8-256); beyond 2^16 the adapters outgrow the layers they adapt.
    if (lora.rank > 65536) {
      throw Error("lora_rank: must be between 0 (no adapters) and 65536, got " + std::to_string(lora.rank));
    }
    if (!(lora.dropout >= 0 && lora.dropout < 1)) {
      char text[32];
      std::snprintf(text, sizeof text, "%g", lora.dropout);
      throw Error(std::string("lora_dropout: must be in [0, 1), got ") + text);
    }
    // Under ZeRO bf16-master is DeepSpeed's bf16 mode, which casts the adapters to bf16 again and
    // keeps their fp32 master partition.
    // (ZeRO-3 with adapters is refused by validate_parallel, with its own reason.)
    if (precision == Precision::kBf16Master && !is_zero(parallel)) {
      throw Error("precision: bf16-master keeps fp32 masters of half trainable weights, but peft makes "
                  "LoRA adapters fp32 already; use bf16-true (half base, fp32 adapters) or bf16-mixed (under "
                  "zero1 / zero2 it is DeepSpeed's bf16 mode)");
    }
  } else if (lora.dropout != 0) {
    throw Error("lora_dropout: set without lora_rank (no adapters)");
  } else if (!lora.targets.empty() && lora.targets != std::vector<std::string>{"default"}) {
    throw Error("lora_targets: set without lora_rank (no adapters)");
  }
  if (!quant.load_in_4bit) {
    if (quant.quant_type != QuantType::kFp4 || quant.double_quant) {
      throw Error("bnb_4bit_quant_type / bnb_4bit_use_double_quant: set without load_in_4bit");
    }
    // A model trained whole from a half load: only bf16 (Note [A half model trained whole] in
    // graph/step_parameters.cpp); fp16's GradScaler refuses fp16 gradients.
    if (load_dtype == LoadDtype::kFp16 && !lora.enabled() && mode == Mode::kTraining) {
      throw Error("load_dtype: fp16 without LoRA trains fp16 parameters under fp16 autocast, whose GradScaler "
                  "refuses fp16 gradients (\"Attempting to unscale FP16 gradients\"); use fp16-true, or bf16");
    }
    if (quant.storage != QuantStorage::kUint8) {
      throw Error("bnb_4bit_quant_storage: set without load_in_4bit (it is the packed 4-bit weights' dtype)");
    }
  } else {
    if (quant.load_in_8bit) throw Error("load_in_8bit: cannot be combined with load_in_4bit; choose one");
    if (mode == Mode::kTraining && !lora.enabled()) {
      throw Error("load_in_4bit: a 4-bit base model cannot be trained itself; add LoRA adapters (lora_rank > 0): "
                  "that is QLoRA");
    }
    // The precision's dtype is the load dtype and bnb_4bit_compute_dtype; prepare_model_for_kbit_training
    // makes everything else fp32. Training may also run under autocast (bf16-mixed: the compute
    // dtype is autocast's); a master copy is not modelled.
    // Under ZeRO bf16-master is DeepSpeed's bf16 mode, which casts that fp32 rest and the
    // adapters to bf16 (Note [QLoRA under ZeRO-1/2] in graph/zero.cpp).
    const bool autocast = precision == Precision::kBf16Mixed || precision == Precision::kFp16Mixed;
    const bool deepspeed_bf16 = precision == Precision::kBf16Master && is_zero(parallel);
    if (!one_dtype(precision) && !(autocast && mode == Mode::kTraining) && !deepspeed_bf16) {
      throw Error("precision: load_in_4bit runs with fp32, bf16-true or fp16-true (the 4-bit matmuls' dtype), "
                  "for training under autocast (bf16-mixed, fp16-mixed), or under zero1 / zero2 / zero3 with "
                  "bf16-master (DeepSpeed's bf16 mode), got " + std::string(to_string(precision)));
    }
  }
  // A half-loaded model under the same autocast (Notes [The load dtype of a 4-bit base], [A half
  // model under autocast]); other combinations are not measured.
  if (load_dtype != LoadDtype::kAuto && mode == Mode::kInference) {
    const std::string d(to_string(load_dtype));
    throw Error("load_dtype: " + d + " is a training knob (a model loaded in " + d +
                " and trained under autocast); a generation loads the weights in its precision's dtype: drop "
                "load_dtype (precision " + d + "-true loads them in " + d + ")");
  }
  if (load_dtype != LoadDtype::kAuto && precision != autocast_of(load_dtype)) {
    const std::string d(to_string(load_dtype));
    throw Error("load_dtype: " + d + " is a model loaded in " + d + " and trained under " + d +
                " autocast (precision " + d + "-mixed); with " + std::string(to_string(precision)) +
                " use auto (the precision's dtype)");
  }
  if (!quant.prepare_kbit_training && (!quant.load_in_4bit || load_dtype == LoadDtype::kAuto)) {
    throw Error("prepare_kbit_training: false keeps the weights of a half-loaded 4-bit base that are not 4-bit "
                "half; it needs load_in_4bit and load_dtype bf16 or fp16");
  }
  if (quant.load_in_8bit && mode != Mode::kInference) {
    // MatMul8bitLt's backward (int8 double quant of grad_output, CAt, ...) and peft's 8-bit LoRA
    // layers are not modelled.
    throw Error("load_in_8bit: training with 8-bit (LLM.int8) weights is not modelled; use it with mode "
                "inference, or load_in_4bit with LoRA (QLoRA) to train");
  }
  validate_parallel(*this);
  validate_offload(*this);
  if (mode == Mode::kInference) {
    // Knobs of a training step a generation has no use for: refused rather than echoed back
    // (after the checks that name a knob the generation cannot take at all).
    if (optimizer != Recipe{}.optimizer) throw Error("optimizer: inference runs no optimizer");
    if (loss != Recipe{}.loss) throw Error("loss: inference computes no loss");
  }
}

}  // namespace trainmem
