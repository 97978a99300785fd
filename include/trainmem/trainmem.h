// trainmem: GPU memory of one training step, simulated op by op.
//
// The public API is small on purpose: load a model (catalog name, config.json or model
// directory), describe a recipe, ask for an Estimate. Everything else lives in src/.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace trainmem {

// Bad input (unknown model, malformed config, impossible recipe). Derives from
// std::invalid_argument so the Python binding raises ValueError. A broken internal invariant
// is never reported through this type (see detail::bug in src/).
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// ---- Vocabulary ---------------------------------------------------------------------------

// The seed's categories; docs/schema.md defines what belongs to each.
enum class Category : std::uint8_t {
  kWeights,
  kOptimizerStates,
  kGradients,
  kActivations,
  kTemporaries,
  kOther,
};
inline constexpr std::size_t kCategoryCount = 6;
std::string_view category_name(Category);

// Training steps run setup, forward, loss, backward, optimizer; generation (Mode::kInference)
// runs setup, prefill (the prompt) and decode (one forward per new token).
enum class Phase : std::uint8_t { kSetup, kForward, kLoss, kBackward, kOptimizer, kPrefill, kDecode };
std::string_view phase_name(Phase);

// kI8 and kI32: LLM.int8's quantized operands and their product (Note [LLM.int8]).
enum class DType : std::uint8_t { kF32, kBF16, kF16, kI64, kU8, kI8, kI32 };
std::string_view dtype_name(DType);
std::uint64_t dtype_bytes(DType);

// ---- Models -------------------------------------------------------------------------------

enum class Family : std::uint8_t { kGpt2, kLlama, kMistral, kQwen2, kQwen3, kGemma2, kPhi3 };
std::string_view family_name(Family);

enum class NormKind : std::uint8_t { kRmsNorm, kLayerNorm };
// The MLP's activation as transformers' ACT2CLS implements it: one op that saves its input (silu /
// swish, gelu, gelu_pytorch_tanh), or NewGELUActivation's Python formula (gelu_new: GPT-2's),
// whose elementwise ops save more.
enum class Activation : std::uint8_t { kSilu, kGelu, kGeluNew, kRelu };

// The shapes that decide memory, read from a Hugging Face config.json.
struct Architecture {
  Family family = Family::kLlama;
  std::string model_type;
  std::uint64_t hidden_size = 0;
  std::uint64_t intermediate_size = 0;
  std::uint64_t num_layers = 0;
  std::uint64_t num_heads = 0;
  std::uint64_t num_kv_heads = 0;
  std::uint64_t head_dim = 0;
  std::uint64_t vocab_size = 0;
  std::uint64_t max_positions = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;        // bias on q/k/v projections (Qwen2, Llama attention_bias)
  bool o_bias = false;          // bias on the output projection
  bool mlp_bias = false;
  bool qk_norm = false;         // RMSNorm over head_dim on q and k (Qwen3)
  bool fused_qkv = false;       // one qkv projection, split afterwards (Phi-3, GPT-2)
  bool fused_gate_up = false;   // one gate_up projection, chunked afterwards (Phi-3)
  bool gated_mlp = true;        // SwiGLU-style gate * up (all but GPT-2)
  bool sandwich_norms = false;  // extra post-attention / post-feedforward norms (Gemma-2)
  bool embedding_scale = false; // embeddings multiplied by sqrt(hidden) (Gemma-2)
  bool learned_positions = false;  // GPT-2 position embedding table
  bool reorder_and_upcast_attn = false;  // GPT-2: eager attention upcasts q and k (not modelled in half)
  // A rotary embedding whose inv_freq changes with the sequence (rope_type dynamic or longrope):
  // the positions past which it does (0: never).
  std::uint64_t rope_rescales_past = 0;
  // Phi-3's generate() drops its cache and runs the whole sequence again once it grows past
  // original_max_position_embeddings (prepare_inputs_for_generation): the positions (0: never).
  std::uint64_t generation_refills_past = 0;
  // A config.json key that changes what generate() does and is not modelled (copied into the
  // generation config, or read by the cache), refused in inference; empty: none.
  std::string generation_unmodelled;
  NormKind norm = NormKind::kRmsNorm;
  Activation activation = Activation::kSilu;
  double attn_logit_softcap = 0;   // Gemma-2: tanh soft-capping of scores (eager only)
  double final_logit_softcap = 0;  // Gemma-2: tanh soft-capping of logits
  // Dropout probabilities in training (Note [Dropout probabilities] in model/config.cpp); a
  // dropout of 0 returns its input and allocates nothing.
  double attn_dropout = 0;   // on the attention probabilities (GPT-2 attn_pdrop, attention_dropout)
  double resid_dropout = 0;  // on each sub-layer's output (GPT-2, Phi-3: resid_pdrop)
  double embd_dropout = 0;   // on the embeddings' sum (GPT-2: embd_pdrop)
  DType torch_dtype = DType::kF32; // the dtype the checkpoint was published in
  // Generation (model::attention_windows, Note [Sliding-window layers] in graph/generation.cpp):
  std::uint64_t sliding_window = 0;       // window of the layers that slide; 0: no layer does
  std::vector<bool> sliding_layer_types;  // config.layer_types (true: sliding); empty: not given
  std::uint64_t max_window_layers = 28;   // Qwen2/Qwen3: layers from this index on slide
  bool bos_token = true;                  // the config has a bos_token_id (generate() makes a tensor of it)
};

// One named parameter tensor; `count` > 1 for the tensors that every decoder layer repeats.
struct ParameterGroup {
  std::string name;  // e.g. "layers.N.mlp.down_proj.weight"
  std::uint64_t numel = 0;
  std::uint64_t count = 1;
  bool matmul_weight = false;  // used by a matmul (autocast casts it; weight decay applies)
  std::uint64_t rows = 0;      // first dimension of a 2-D tensor as stored; 0 for 1-D tensors
};

struct Model {
  std::string name;       // catalog name, or the path it was read from
  std::string hf_id;      // e.g. "Qwen/Qwen3-4B" when known
  Architecture arch;
  std::vector<ParameterGroup> parameters;  // layer tensors listed once with count = num_layers
  std::uint64_t parameter_count = 0;       // exact, tied embeddings counted once
  bool from_safetensors = false;           // counts were read from *.safetensors headers
};

// A catalog name ("qwen3-4b"), a Hugging Face id ("Qwen/Qwen3-4B"), a config.json path, or a
// directory holding config.json (and optionally *.safetensors). Throws Error with close names
// when nothing matches.
Model load_model(std::string_view source);
// Whether load_model takes `source` from the built-in catalog (a name, id or alias, any case).
bool is_catalog_name(std::string_view source);
Model model_from_config_json(std::string_view json_text, std::string name = "config.json");

struct CatalogEntry {
  std::string name;
  std::string hf_id;
  std::uint64_t parameter_count = 0;
  std::string family;
};
std::vector<CatalogEntry> catalog();

// ---- Devices ------------------------------------------------------------------------------

struct Gpu {
  std::string name;                     // "h100-80gb"
  std::string description;
  unsigned sm = 0;                      // compute capability x 10 (sm90: 90); 0 for the CPU replay
  std::uint64_t capacity_bytes = 0;     // total device memory
  std::uint64_t context_bytes = 0;      // CUDA context, outside the allocator
  std::uint64_t cublas_workspace_bytes = 0;  // one cuBLAS workspace (per handle and stream)
  double half_tflops = 0;   // dense fp16/bf16 tensor-core throughput (fp32 accumulation)
  bool bf16 = true;         // supports bfloat16 (V100 and T4 do not)
  double fp32_tflops = 0;   // fp32 without tensor cores (PyTorch's default: TF32 matmuls off)
  double memory_gbps = 0;   // device memory bandwidth, GB/s
  std::string interconnect; // "NVLink 4", "PCIe 4"
  double interconnect_gbps = 0;  // GPU to GPU, GB/s per direction
  double host_gbps = 0;          // GPU to host (PCIe), GB/s per direction
  // What a plan may use: the capacity less the CUDA context.
  std::uint64_t usable_bytes() const { return capacity_bytes > context_bytes ? capacity_bytes - context_bytes : 0; }
};
const Gpu& find_gpu(std::string_view name);
std::vector<Gpu> gpus();

// ---- Recipes ------------------------------------------------------------------------------

enum class Precision : std::uint8_t { kFp32, kBf16Mixed, kFp16Mixed, kBf16Master, kBf16True, kFp16True };
enum class Optimizer : std::uint8_t { kAdamW, kAdamWFused, kAdamW8bit, kSgd, kAdafactor };
// kFull: Hugging Face's per-layer checkpointing with torch.utils.checkpoint's use_reentrant=False;
// kFullReentrant: the same layers under use_reentrant=True (Note [Reentrant checkpoints] in
// src/graph/tape.h), which peft's prepare_model_for_kbit_training turns on by default.
enum class Checkpointing : std::uint8_t { kNone, kFull, kFullReentrant };
enum class Attention : std::uint8_t { kEager, kSdpa, kFlash };
enum class Loss : std::uint8_t { kStandard, kFused };
// The attention_mask a training batch passes to the model: none (input_ids and labels only), a
// mask of ones (an unpadded batch as a tokenizer gives it), or one with padding (Note [Padding
// masks] in src/graph/step.cpp). Which tokens are padding changes no tensor's size.
enum class AttentionMask : std::uint8_t { kNone, kOnes, kPadded };
enum class AllocatorMode : std::uint8_t { kDefault, kExpandable };
// kTraining: two optimizer steps (the reference step of docs/schema.md). kInference: one
// model.generate() call (greedy, or beam search with beams > 1) under torch.no_grad, with
// Hugging Face's default DynamicCache (docs/schema.md, "The reference generation").
enum class Mode : std::uint8_t { kTraining, kInference };
// Data parallelism over Recipe::gpus ranks (docs/parallelism.md): kDdp is PyTorch's
// DistributedDataParallel with its defaults; kFsdp is FSDP2 fully_shard on every decoder layer and
// then the root module; kZero1 / kZero2 / kZero3 are DeepSpeed ZeRO stages 1, 2 and 3 with DeepSpeed's
// default zero_optimization config (no offload). Each rank runs the recipe's micro-batch; the
// estimate is one rank's memory.
enum class Parallel : std::uint8_t { kNone, kDdp, kFsdp, kZero1, kZero2, kZero3 };
inline bool is_zero(Parallel p) { return p == Parallel::kZero1 || p == Parallel::kZero2 || p == Parallel::kZero3; }

// FSDP2's own knobs (parallel kFsdp; torch/distributed/fsdp/_fully_shard/, docs/parallelism.md):
// fully_shard(layer, reshard_after_forward) for the decoder layers (false: a layer stays gathered
// from its forward to its backward, FSDP1's SHARD_GRAD_OP; the root is never resharded after
// forward); `replicate` > 1 is HSDP, the 2-D mesh (replicate, gpus / replicate): parameters are
// sharded over the gpus / replicate ranks of a shard group and replicated across groups;
// MixedPrecisionPolicy(param_dtype, reduce_dtype) over fp32 parameters (kNone: the policy's None).
enum class FsdpDtype : std::uint8_t { kNone, kFp32, kBf16 };
struct Fsdp {
  bool reshard_after_forward = true;
  std::uint64_t replicate = 1;
  FsdpDtype param_dtype = FsdpDtype::kNone;
  FsdpDtype reduce_dtype = FsdpDtype::kNone;
  // set_requires_gradient_sync(False) on every micro-batch but the step's last, as Accelerate's
  // no_sync (Hugging Face's Trainer) accumulates: unsharded gradients kept between micro-batches
  // (Note [FSDP2 no_sync] in graph/parallel.cpp).
  bool no_sync = false;
  bool is_default() const {
    return reshard_after_forward && replicate == 1 && param_dtype == FsdpDtype::kNone && reduce_dtype == FsdpDtype::kNone &&
           !no_sync;
  }
};
// CPU offload (docs/parallelism.md, "CPU offload"): kOptimizer is DeepSpeed's
// zero_optimization.offload_optimizer {device: cpu} (its defaults: pin_memory true, ratio 1) under
// kZero1 / kZero2 / kZero3, with DeepSpeedCPUAdam stepping this rank's fp32 partition on the host
// (Note [ZeRO-Offload] in src/graph/zero_offload.cpp, Note [ZeRO-3 offload] in
// src/graph/zero3_offload.cpp). kParams is ZeRO-3's offload_param {device: cpu} (pin_memory true):
// the 16-bit parameter partitions live on the host, the optimizer on the GPU; kBoth is both.
// Mirrored from the source, unmeasured.
enum class Offload : std::uint8_t { kNone, kOptimizer, kParams, kBoth };
// Pipeline schedules of torch.distributed.pipelining (docs/parallelism.md "Pipeline parallelism"):
// Schedule1F1B and ScheduleGPipe, one stage per rank (Note [Pipeline parallelism] in
// src/graph/pipeline.cpp); ScheduleInterleaved1F1B and ScheduleLoopedBFS, pp_stages_per_rank >= 2
// stages per rank (Note [Interleaved pipeline schedules]).
enum class PipelineSchedule : std::uint8_t { k1F1B, kGPipe, kInterleaved1F1B, kLoopedBFS };
// Whether the schedule runs several stages per rank (torch's PipelineScheduleMulti).
constexpr bool is_multi_stage(PipelineSchedule s) {
  return s == PipelineSchedule::kInterleaved1F1B || s == PipelineSchedule::kLoopedBFS;
}

// LoRA adapters (peft's LoraConfig): the base model is frozen, every targeted linear layer of
// every decoder layer gets A (rank × in) and B (out × rank) beside it.
struct Lora {
  std::uint64_t rank = 0;            // 0: no adapters, every parameter trains
  std::vector<std::string> targets;  // module names as peft matches them ("q_proj"); empty, or
                                     // "default": peft's default for the family; "all-linear"
  double dropout = 0;                // lora_dropout; 0 is nn.Identity (nothing saved)
  bool enabled() const { return rank > 0; }
};

// bitsandbytes weights in the linear layers of the decoder layers.
// 4-bit: transformers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type,
// bnb_4bit_use_double_quant, bnb_4bit_compute_dtype = the precision's dtype). For training that is
// a QLoRA base (peft's prepare_model_for_kbit_training makes everything else fp32, Note [QLoRA] in
// src/graph/quant.h); under inference the rest stays in the precision's dtype (Note [Quantized
// generation]). 8-bit: BitsAndBytesConfig(load_in_8bit=True) with transformers' defaults (LLM.int8,
// threshold 6.0), inference only (Note [LLM.int8]).
enum class QuantType : std::uint8_t { kFp4, kNf4 };
// The dtype from_pretrained loads the model in (its `dtype` argument). kAuto: the precision's
// parameter dtype (fp32 under autocast). kBf16 under bf16-mixed: the common Trainer recipe
// (dtype=bfloat16, bf16=True). Over a 4-bit base it is the QuantState's dtype, the one a 4-bit
// matmul's backward dequantizes to, and prepare_model_for_kbit_training makes the rest fp32 again
// (Note [The load dtype of a 4-bit base] in src/graph/quant.h); under LoRA without a 4-bit base
// the frozen model stays half and the fp32 adapters run under autocast (Note [A half model under
// autocast] in src/graph/step_parameters.cpp); without either a bf16 model is trained whole under
// bf16 autocast (Note [A half model trained whole], there). kFp16 the same under fp16-mixed
// (fp16=True, on GPUs without bf16), with LoRA or a 4-bit base only.
enum class LoadDtype : std::uint8_t { kAuto, kBf16, kFp16 };
// The dtype of a 4-bit weight's packed bytes (bnb_4bit_quant_storage): uint8, bitsandbytes'
// default, or bf16, what FSDP and ZeRO-3 QLoRA scripts set so that the packed weights share a bf16
// base's dtype: the same bytes as half as many bf16 elements (Note [The packed weights' storage
// dtype] in src/graph/quant.h).
enum class QuantStorage : std::uint8_t { kUint8, kBf16 };
DType storage_dtype(QuantStorage);
// The autocast a half load dtype is trained under (bf16 → bf16-mixed, fp16 → fp16-mixed).
Precision autocast_of(LoadDtype);
struct Quantization {
  bool load_in_4bit = false;
  QuantType quant_type = QuantType::kFp4;  // transformers' default; QLoRA uses nf4
  bool double_quant = false;               // the block constants quantized again (8-bit)
  QuantStorage storage = QuantStorage::kUint8;
  bool load_in_8bit = false;               // LLM.int8: int8 weights and fp32 row scales
  // peft's prepare_model_for_kbit_training, which casts what is not 4-bit to fp32. TRL skips it for
  // a base loaded to the CPU or meta device (sharded QLoRA under FSDP or ZeRO-3): false keeps a
  // half-loaded base's other weights half (Note [QLoRA without prepare_model_for_kbit_training]
  // in src/graph/quant.h).
  bool prepare_kbit_training = true;
  bool enabled() const { return load_in_4bit; }  // a 4-bit base
  bool any() const { return load_in_4bit || load_in_8bit; }
};

struct Recipe {
  std::uint64_t batch = 1;
  std::uint64_t seq = 2048;
  std::uint64_t grad_accum = 1;
  Precision precision = Precision::kBf16Mixed;
  Optimizer optimizer = Optimizer::kAdamW;
  Checkpointing checkpointing = Checkpointing::kNone;
  Attention attention = Attention::kSdpa;
  Loss loss = Loss::kStandard;
  AttentionMask attention_mask = AttentionMask::kNone;
  std::string gpu = "h100-80gb";
  AllocatorMode allocator = AllocatorMode::kDefault;
  Lora lora;
  Quantization quant;
  LoadDtype load_dtype = LoadDtype::kAuto;  // from_pretrained's dtype (a 4-bit base's, a half model's)
  Mode mode = Mode::kTraining;
  std::uint64_t new_tokens = 128;  // inference: tokens generated after the prompt (max_new_tokens)
  std::uint64_t beams = 1;         // inference: num_beams (1: greedy)
  std::uint64_t steps = 2;  // step 1 creates optimizer state lazily; step 2 is steady state
  std::uint64_t gpus = 1;   // data-parallel world size (ranks); more than 1 needs `parallel`
  Parallel parallel = Parallel::kNone;
  // Tensor-parallel degree (docs/parallelism.md "Tensor parallelism"): torch's parallelize_module
  // with the Megatron plan of every decoder layer over `tp` ranks (q/k/v and gate/up
  // ColwiseParallel, o/down RowwiseParallel); 1 is none. A knob of its own beside `gpus` so that
  // the two compose as a 2-D mesh (world = gpus x tp) once that is modelled; today tp > 1 needs
  // gpus 1. The estimate is one rank's memory (every rank holds the same).
  std::uint64_t tp = 1;
  // Sequence parallelism with tp > 1 (docs/parallelism.md "Sequence parallelism"): torch's
  // SequenceParallel on the norms, the residual stream sharded on the sequence between the
  // all-gather before q/k/v and gate/up and the reduce-scatter after o/down.
  bool sequence_parallel = false;
  // Loss parallelism with tp > 1 (docs/parallelism.md "Loss parallel"): lm_head ColwiseParallel
  // with vocab-sharded logits (Shard(-1), use_local_output=False) and the cross-entropy inside
  // torch's loss_parallel(); each rank holds vocab / tp columns of the logits and of lm_head.
  bool loss_parallel = false;
  // Context-parallel degree (docs/parallelism.md "Context parallelism"): torch's context_parallel
  // over `cp` ranks, each holding seq / cp tokens and running ring attention in SDPA; 1 is none.
  // Mirrored from the source, not measured; today cp > 1 needs gpus 1 and tp 1. The estimate is
  // the last rank of the group (Note [Context parallelism] in graph/context_parallel.h).
  std::uint64_t cp = 1;
  // Pipeline-parallel degree (docs/parallelism.md "Pipeline parallelism"): torch.distributed.pipelining
  // with one stage per rank, the decoder layers split over `pp` stages; grad_accum is the schedule's
  // n_microbatches (batch stays the micro-batch size). 1 is none. The estimate is the worst stage's.
  std::uint64_t pp = 1;
  PipelineSchedule pp_schedule = PipelineSchedule::k1F1B;
  // Stages per rank with a multi-stage schedule (interleaved-1f1b, looped-bfs): pp x V stages, rank r
  // holding stages r, r + pp, ..., r + (V - 1) pp; 1 with 1f1b and gpipe.
  std::uint64_t pp_stages_per_rank = 1;
  Fsdp fsdp;  // parallel kFsdp only
  // DistributedDataParallel(find_unused_parameters=True), parallel kDdp only: what Hugging Face's
  // Trainer passes for a peft model or a model without checkpointing. Buckets by size at
  // construction and never rebuilt; the module's outputs cloned by _DDPSink (Note [DDP
  // find_unused_parameters] in graph/parallel.cpp).
  bool ddp_find_unused_parameters = false;
  // DistributedDataParallel(gradient_as_bucket_view=True), parallel kDdp only: each .grad becomes a
  // view of its bucket at the Reducer's hook, so a trainable parameter's gradient is held once
  // (Note [DDP gradient_as_bucket_view] in graph/parallel.cpp).
  bool ddp_gradient_as_bucket_view = false;
  // Every micro-batch but the step's last runs its forward and backward under
  // DistributedDataParallel.no_sync(), as Accelerate's accumulate() and Hugging Face's Trainer
  // (through accelerator.no_sync) do; parallel kDdp only, without a pipeline (Note [DDP no_sync] in graph/parallel.cpp).
  bool ddp_no_sync = false;
  // Under bf16-mixed / fp16-mixed: the model's forward wrapped by Accelerate's prepare() (Hugging
  // Face's Trainer), whose convert_outputs_to_fp32 copies the half logits to fp32 when the forward
  // returns (Note [Outputs converted to fp32] in graph/step.cpp).
  bool fp32_outputs = false;
  // The training forward with use_cache true (the config's default, which a Trainer run without
  // checkpointing keeps): every layer's keys and values copied into a DynamicCache that the output
  // holds to the loss (Note [A cache in training] in graph/step_modules.cpp).
  bool use_cache = false;
  // Before each optimizer step, accelerator.clip_grad_norm_ over the model's gradients, as
  // Hugging Face's Trainer runs it (with max_grad_norm > 0, and in transformers 5 with max_norm inf
  // otherwise, to log the norm) and keeps the total norm to the next step (Note [Gradient clipping]
  // in graph/optimizer.cpp).
  bool clip_grad_norm = false;
  Offload offload = Offload::kNone;

  void validate() const;  // throws Error naming the field
  // A model loaded half and trained under that autocast, no 4-bit base: through LoRA adapters, or
  // whole in bf16 (Notes [A half model under autocast], [A half model trained whole] in
  // src/graph/step_parameters.cpp).
  bool half_model() const {
    return load_dtype != LoadDtype::kAuto && (!quant.enabled() || !quant.prepare_kbit_training);
  }
};

std::string_view to_string(Precision);
std::string_view to_string(Optimizer);
std::string_view to_string(Checkpointing);
std::string_view to_string(Attention);
std::string_view to_string(Loss);
std::string_view to_string(AttentionMask);
std::string_view to_string(AllocatorMode);
std::string_view to_string(Mode);
std::string_view to_string(QuantType);
std::string_view to_string(LoadDtype);
std::string_view to_string(QuantStorage);
std::string_view to_string(Parallel);
std::string_view to_string(FsdpDtype);
std::string_view to_string(Offload);
std::string_view to_string(PipelineSchedule);
// The knobs as a person spells them (CLI flags, Python keywords, the JSON `recipe` object).
struct RecipeSpelling {
  std::uint64_t batch = 1;
  std::uint64_t seq = 2048;
  std::uint64_t grad_accum = 1;
  std::string precision = "";  // "": bf16-mixed for training, bf16-true for inference or quantized weights
  std::string optimizer = "adamw";
  std::string checkpointing = "none";
  std::string attention = "sdpa";
  std::string loss = "standard";
  std::string attention_mask = "none";  // none | ones | padded
  std::string gpu = "h100-80gb";
  std::string allocator = "default";
  std::uint64_t lora_rank = 0;
  std::string lora_targets = "default";  // comma-separated module names, "default" or "all-linear"
  double lora_dropout = 0;
  bool load_in_4bit = false;                  // BitsAndBytesConfig's spellings
  std::string bnb_4bit_quant_type = "fp4";    // fp4 | nf4
  bool bnb_4bit_use_double_quant = false;
  std::string load_dtype = "auto";            // auto | bf16 | fp16: from_pretrained's dtype
  std::string bnb_4bit_quant_storage = "uint8";  // uint8 | bf16: the packed 4-bit weights' dtype
  bool prepare_kbit_training = true;             // false: the rest of a half-loaded 4-bit base stays half
  bool load_in_8bit = false;
  std::string mode = "training";  // training | inference
  std::uint64_t new_tokens = 128;
  std::uint64_t beams = 1;
  std::uint64_t gpus = 1;
  std::string parallel = "none";  // none | ddp | fsdp | zero1 | zero2 | zero3
  std::uint64_t tp = 1;           // tensor-parallel degree
  bool sequence_parallel = false;  // with tp > 1: SequenceParallel on the norms
  bool loss_parallel = false;      // with tp > 1: vocab-parallel lm_head and loss_parallel()
  std::uint64_t cp = 1;           // context-parallel degree
  std::uint64_t pp = 1;           // pipeline-parallel degree
  std::string pp_schedule = "1f1b";  // 1f1b | gpipe | interleaved-1f1b | looped-bfs
  std::uint64_t pp_stages_per_rank = 1;
  bool fsdp_reshard_after_forward = true;  // parallel fsdp: FSDP2's knobs (Fsdp above)
  std::uint64_t fsdp_replicate = 1;
  std::string fsdp_param_dtype = "none";   // none | bf16
  std::string fsdp_reduce_dtype = "none";  // none | fp32 | bf16
  bool ddp_find_unused_parameters = false;  // parallel ddp: find_unused_parameters=True (HF Trainer's default)
  bool ddp_gradient_as_bucket_view = false;  // parallel ddp: gradient_as_bucket_view=True
  bool ddp_no_sync = false;  // parallel ddp: no_sync() on every micro-batch but the step's last
  bool fsdp_no_sync = false;  // parallel fsdp: set_requires_gradient_sync(False) likewise
  bool fp32_outputs = false;  // bf16-mixed / fp16-mixed: Accelerate's convert_outputs_to_fp32
  bool use_cache = false;     // training forwards build their DynamicCache
  bool clip_grad_norm = false;  // accelerator.clip_grad_norm_ before each optimizer step
  std::string offload = "none";   // none | optimizer (zero1 / zero2 / zero3) | params | both (zero3)
};
// Parses and validates every knob; throws Error naming the first bad field.
Recipe parse_recipe(const RecipeSpelling& spelling);
// Whether Accelerate's convert_outputs_to_fp32 (Recipe::fp32_outputs) is modelled for `r`: bf16 /
// fp16 mixed precision on one GPU, under DDP or FSDP2.
bool fp32_outputs_modelled(const Recipe& r);
// Where the Trainer's clip_grad_norm_ (Recipe::clip_grad_norm) is modelled.
bool clip_grad_norm_modelled(const Recipe& r);

// Parse the CLI / JSON spelling; throws Error listing the valid values.
Precision parse_precision(std::string_view);
Optimizer parse_optimizer(std::string_view);
Checkpointing parse_checkpointing(std::string_view);
Attention parse_attention(std::string_view);
Loss parse_loss(std::string_view);
AttentionMask parse_attention_mask(std::string_view);
AllocatorMode parse_allocator(std::string_view);
Mode parse_mode(std::string_view);
QuantType parse_quant_type(std::string_view);
LoadDtype parse_load_dtype(std::string_view);
QuantStorage parse_quant_storage(std::string_view);
Parallel parse_parallel(std::string_view);
FsdpDtype parse_fsdp_dtype(std::string_view, std::string_view field);
Offload parse_offload(std::string_view);
PipelineSchedule parse_pipeline_schedule(std::string_view);

// The linear modules of one decoder layer that LoRA can target, as peft names them.
std::vector<std::string> lora_target_modules(const Architecture&);
// "default" / "all-linear" / an explicit list, resolved for this architecture; throws Error
// naming a module the architecture does not have.
std::vector<std::string> resolve_lora_targets(const Architecture&, const std::vector<std::string>& spelled);

// ---- Estimates ----------------------------------------------------------------------------

using Breakdown = std::array<std::uint64_t, kCategoryCount>;

struct Moment {
  std::uint64_t step = 0;
  std::uint64_t micro_batch = 0;
  Phase phase = Phase::kSetup;
  std::string op;  // "layer 3 mlp.down_proj", "lm_head", "optimizer.foreach_sqrt"
};

struct StepPeak {
  std::uint64_t step = 0;
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
};

// The peaks of one phase of one micro-batch (Estimate::phases): the most bytes after any of its
// events. A run's peak lies in one phase; the others are checked against measurements here.
struct PhasePeak {
  std::uint64_t step = 0;
  std::uint64_t micro_batch = 0;
  Phase phase = Phase::kSetup;
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
};

struct TimelinePoint {
  std::uint64_t event = 0;  // index in the simulated event stream
  std::uint64_t allocated_bytes = 0;
  std::uint64_t reserved_bytes = 0;
  Moment moment;
};

// One data-parallel rank's peaks (Estimate::ranks).
struct RankPeak {
  std::uint64_t rank = 0;
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
};

// Host (CPU) memory one rank holds for the step under CPU offload (Recipe::offload), steady state
// at the optimizer step: pinned tensors as PyTorch's CachingHostAllocator hands them out (each
// rounded up to a power of two), pageable ones at their size. The categories count requested
// bytes. Mirrored from the framework's source, never measured (the measurements are CPU runs,
// where offloading to the CPU is a copy on the same device). All zero without offload.
struct HostMemory {
  std::uint64_t pinned_bytes = 0;            // page-locked blocks the host allocator holds (power-of-two
                                             // blocks; with ZeRO-3 offload_param also freed, cached ones)
  std::uint64_t pinned_requested_bytes = 0;  // the same tensors' own sizes
  std::uint64_t pageable_bytes = 0;
  std::uint64_t weights_bytes = 0;           // fp32 master partition, 16-bit staging copy or partitions
  std::uint64_t optimizer_states_bytes = 0;  // DeepSpeedCPUAdam's exp_avg, exp_avg_sq
  std::uint64_t gradients_bytes = 0;         // fp32 partition gradient, staging and accumulation buffers
  std::uint64_t total_bytes() const { return pinned_bytes + pageable_bytes; }
};

struct Estimate {
  std::string model;
  std::uint64_t parameters = 0;
  std::uint64_t trainable_parameters = 0;
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
  Breakdown breakdown_at_peak{};  // sums to peak_allocated_bytes
  Moment peak;
  std::vector<StepPeak> steps;
  std::vector<TimelinePoint> timeline;  // filled only when asked for
  std::vector<PhasePeak> phases;        // likewise (EstimateOptions::phases), in order of first event
  Recipe recipe;
  Gpu gpu;
  std::uint64_t events = 0;  // allocator events simulated
  // False when EstimateOptions::stop_above_reserved_bytes stopped the replay: the peaks are then
  // what had been reached (more than that limit), not the step's peaks.
  bool complete = true;
  // A stopped replay stopped before any event of an optimizer step (the planner's Note
  // [Optimizer twins] in src/plan/fit.cpp).
  bool stopped_before_optimizer = false;
  // The data-parallel rank the fields above describe: the worst rank (Note [The worst rank] in
  // src/estimate.cpp) unless EstimateOptions::rank chose one. `ranks` lists every rank replayed
  // (empty on one GPU); ranks not listed hold what rank 0 holds.
  std::uint64_t rank = 0;
  std::vector<RankPeak> ranks;
  HostMemory host;  // the reported rank's host memory under CPU offload
};

struct EstimateOptions {
  bool timeline = false;             // record a down-sampled allocated/reserved timeline
  std::uint64_t timeline_points = 400;
  bool phases = false;               // record each phase's peaks of every micro-batch (Estimate::phases)
  std::string trace_path;            // write every alloc/free event as JSON lines (same fields as
                                     // trainmem-measure --trace); empty: none
  // Stop the replay once reserved bytes pass this (0: never): the peaks are then only "above it".
  // Enough to know that a recipe does not fit, for a fraction of the replay (the planner).
  std::uint64_t stop_above_reserved_bytes = 0;
  // The data-parallel rank to report (0 .. gpus - 1); -1: the worst rank.
  std::int64_t rank = -1;
};

Estimate estimate(const Model& model, const Recipe& recipe, const EstimateOptions& = {});

// The seq a front end takes when none is given: Recipe's 2048, or fewer where the model's
// learned positions end sooner (GPT-2's n_positions, 1,024 in the catalog; a generation also
// feeds new_tokens - 1 positions after the prompt). At least 1.
std::uint64_t default_seq(const Model& model, const Recipe& recipe);

// ---- Planning -----------------------------------------------------------------------------

// Estimated time of one optimizer step on one GPU (Note [Step time] in src/plan/time.cpp;
// docs/planner.md states the assumptions). All zero for the cpu pseudo-device.
struct StepTime {
  double seconds = 0;
  double compute_s = 0;   // matmul and attention FLOPs at the assumed efficiency
  double memory_s = 0;    // elementwise, loss and optimizer traffic at the assumed bandwidth
  double overhead_s = 0;  // kernel launches
  double comm_s = 0;      // data-parallel collectives at the interconnect bandwidth (gpus > 1)
  double host_s = 0;      // CPU offload: PCIe transfers at host_gbps and the optimizer step on the CPU
  double flops = 0;       // per GPU per optimizer step
};
StepTime step_time(const Model& model, const Recipe& recipe);

struct Plan {
  Recipe recipe;
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;  // what must fit in the GPU's usable memory
  Moment peak;
  StepTime time;
  bool simulated = false;  // false: only a lower bound is known (peak_* hold that bound)
  bool complete = true;    // the replay ran to the end (a probe that stopped says only "too big")
  // CPU offload: the host memory one rank needs (Estimate::host.total_bytes(); 0 without offload).
  std::uint64_t host_bytes = 0;
  bool fits = false;       // reserved bytes within the GPU's usable memory and host_bytes within the host's
};

// The host memory the planner allows each GPU's rank by default (FitRequest::host_memory_bytes):
// a node's RAM over its GPUs, 1 TiB over 8 GPUs (docs/planner.md, "Host memory").
constexpr std::uint64_t kDefaultHostMemoryBytes = 128ull << 30;

// The most GPUs a recipe or a plan may span (the measuring side's MAX_GPUS).
constexpr std::uint64_t kMaxGpus = 4096;
// The largest micro-batch, and the most micro-batches a step may accumulate, Recipe::validate
// accepts (the planner grows a micro-batch within them).
constexpr std::uint64_t kMaxBatch = std::uint64_t{1} << 24;
constexpr std::uint64_t kMaxAccum = 1024;

struct FitRequest {
  Recipe base;                       // the user's recipe; the planner starts from it
  std::uint64_t gpus = 1;            // data-parallel GPUs (1 to kMaxGpus); more than 1 searches ddp / fsdp / zero1 / zero2
  std::uint64_t global_batch = 0;    // sequences per optimizer step over all GPUs; 0: batch*grad_accum*gpus
  std::vector<std::string> fixed;    // knob names the search keeps at the base recipe's value
  std::size_t top = 10;              // plans to return
  // Host (CPU) RAM each GPU's rank may use, pinned and pageable together: a plan whose
  // Plan::host_bytes exceed it does not fit (only CPU offload holds host memory in the engine).
  std::uint64_t host_memory_bytes = kDefaultHostMemoryBytes;
};

// One single-knob change of the base recipe and what it does.
struct Change {
  std::string what;  // "checkpointing full", "optimizer adamw-8bit", "batch 2 x grad_accum 8"
  Plan plan;
};

struct FitResult {
  Gpu gpu;
  std::uint64_t gpus = 1;
  std::uint64_t global_batch = 0;
  std::uint64_t capacity_bytes = 0;  // usable memory per GPU the plans were held to
  std::uint64_t host_capacity_bytes = 0;  // host memory per GPU's rank the plans were held to
  std::vector<Plan> plans;           // fitting recipes, fastest first
  std::uint64_t searched = 0;        // recipes in the search space
  std::uint64_t simulated = 0;       // of those, replayed through the engine
  std::uint64_t pruned = 0;          // ruled out by a lower bound without replay
  Plan baseline;                     // the base recipe as given
  // The global batch does not split over the GPUs, so the baseline is the base recipe as a
  // pipeline (or tensor-parallel group) over all of them instead of data-parallel.
  bool baseline_moved = false;
  // The baseline's micro-batch is not the one asked for (no --batch: the default of 1 grew to the
  // smallest that reaches the global batch in at most kMaxAccum micro-batches).
  bool batch_grown = false;
  std::vector<Change> changes;       // single changes from the baseline, biggest saving first
  bool has_closest_miss = false;     // no plan fits: the recipe that came closest
  Plan closest_miss;
  struct OtherGpu {
    std::string gpu;
    Plan plan;  // the fastest recipe of the search that fits there, replayed on that GPU
  };
  std::vector<OtherGpu> fits_on;     // when nothing fits: catalog GPUs with more memory that do fit
  // When no full fine-tuning recipe fits: the fastest plans of the same search with LoRA adapters
  // (rank 16, peft's default targets), or with QLoRA (the same on a 4-bit nf4 base) where no LoRA
  // recipe fits either; empty when neither fits, or when the request trains adapters already.
  std::vector<Plan> adapter_plans;
};

// Searches the recipe space for `model` on `base.gpu`: micro-batch × grad_accum reaching the
// global batch, precision, optimizer, checkpointing, loss, allocator (knobs in `fixed` held).
// Throws Error on a request that cannot be planned (e.g. a global batch the GPUs cannot split).
FitResult fit(const Model& model, const FitRequest& request);
// parse_recipe for fit's base recipe: the knobs the planner chooses itself (pp, cp) are refused
// first, before the recipe's own checks would ask for what their values need.
Recipe parse_fit_recipe(const RecipeSpelling& spelling);
// The knob names FitRequest::fixed may hold (the recipe spellings of the knobs fit() searches).
const std::vector<std::string>& fit_knobs();

}  // namespace trainmem
