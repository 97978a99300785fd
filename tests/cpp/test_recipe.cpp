// Tests for the recipe knobs of include/trainmem/trainmem.h (src/recipe/recipe.cpp): the
// spellings shared by the CLI, the Python API and the JSON output (docs/schema.md, "Recipe
// knobs"), their exact error messages, and the ranges Recipe::validate accepts.

#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using testing::error_of;

// ---- spellings ----------------------------------------------------------------------------

// Every value of an enum, with the spelling docs/schema.md gives it.
template <typename E>
using Table = std::vector<std::pair<E, std::string_view>>;

const Table<Precision> kPrecisions = {{Precision::kFp32, "fp32"},
                                      {Precision::kBf16Mixed, "bf16-mixed"},
                                      {Precision::kFp16Mixed, "fp16-mixed"},
                                      {Precision::kBf16Master, "bf16-master"},
                                      {Precision::kBf16True, "bf16-true"},
                                      {Precision::kFp16True, "fp16-true"}};
const Table<Optimizer> kOptimizers = {{Optimizer::kAdamW, "adamw"},
                                      {Optimizer::kAdamWFused, "adamw-fused"},
                                      {Optimizer::kAdamW8bit, "adamw-8bit"},
                                      {Optimizer::kSgd, "sgd"},
                                      {Optimizer::kAdafactor, "adafactor"}};
const Table<Checkpointing> kCheckpointing = {{Checkpointing::kNone, "none"},
                                             {Checkpointing::kFull, "full"},
                                             {Checkpointing::kFullReentrant, "full-reentrant"}};
const Table<Attention> kAttention = {
    {Attention::kEager, "eager"}, {Attention::kSdpa, "sdpa"}, {Attention::kFlash, "flash"}};
const Table<Loss> kLoss = {{Loss::kStandard, "standard"}, {Loss::kFused, "fused"}};
const Table<AllocatorMode> kAllocator = {{AllocatorMode::kDefault, "default"},
                                         {AllocatorMode::kExpandable, "expandable"}};

template <typename E, typename Parse>
void expect_round_trips(const Table<E>& table, Parse parse) {
  for (const auto& [value, spelling] : table) {
    EXPECT_EQ(to_string(value), spelling);
    EXPECT_EQ(parse(spelling), value) << spelling;
    EXPECT_EQ(to_string(parse(to_string(value))), spelling);
  }
}

TEST(RecipeSpellings, PrecisionRoundTrips) { expect_round_trips(kPrecisions, parse_precision); }
TEST(RecipeSpellings, OptimizerRoundTrips) { expect_round_trips(kOptimizers, parse_optimizer); }
TEST(RecipeSpellings, CheckpointingRoundTrips) {
  expect_round_trips(kCheckpointing, parse_checkpointing);
}
TEST(RecipeSpellings, AttentionRoundTrips) { expect_round_trips(kAttention, parse_attention); }
TEST(RecipeSpellings, LossRoundTrips) { expect_round_trips(kLoss, parse_loss); }
TEST(RecipeSpellings, AllocatorRoundTrips) { expect_round_trips(kAllocator, parse_allocator); }

// The tables above cover every enumerator: the enums are dense from 0.
TEST(RecipeSpellings, TablesCoverEveryValue) {
  EXPECT_EQ(kPrecisions.size(), static_cast<std::size_t>(Precision::kFp16True) + 1);
  EXPECT_EQ(kOptimizers.size(), static_cast<std::size_t>(Optimizer::kAdafactor) + 1);
  EXPECT_EQ(kCheckpointing.size(), static_cast<std::size_t>(Checkpointing::kFullReentrant) + 1);
  EXPECT_EQ(kAttention.size(), static_cast<std::size_t>(Attention::kFlash) + 1);
  EXPECT_EQ(kLoss.size(), static_cast<std::size_t>(Loss::kFused) + 1);
  EXPECT_EQ(kAllocator.size(), static_cast<std::size_t>(AllocatorMode::kExpandable) + 1);
}

// ---- bad values ---------------------------------------------------------------------------

TEST(RecipeSpellings, UnknownPrecisionListsTheValidValues) {
  EXPECT_EQ(error_of([] { parse_precision("bf16"); }),
            "precision: unknown value 'bf16'; expected one of fp32, bf16-mixed, fp16-mixed, "
            "bf16-master, bf16-true, fp16-true");
}

TEST(RecipeSpellings, UnknownOptimizerListsTheValidValues) {
  EXPECT_EQ(error_of([] { parse_optimizer("adam"); }),
            "optimizer: unknown value 'adam'; expected one of adamw, adamw-fused, adamw-8bit, sgd, "
            "adafactor");
}

TEST(RecipeSpellings, UnknownCheckpointingListsTheValidValues) {
  EXPECT_EQ(error_of([] { parse_checkpointing("selective"); }),
            "checkpointing: unknown value 'selective'; expected one of none, full, full-reentrant");
}

TEST(RecipeSpellings, UnknownAttentionListsTheValidValues) {
  EXPECT_EQ(error_of([] { parse_attention("flash_attention_2"); }),
            "attention: unknown value 'flash_attention_2'; expected one of eager, sdpa, flash");
}

TEST(RecipeSpellings, UnknownLossListsTheValidValues) {
  EXPECT_EQ(error_of([] { parse_loss("liger"); }),
            "loss: unknown value 'liger'; expected one of standard, fused");
}

TEST(RecipeSpellings, UnknownAllocatorListsTheValidValues) {
  EXPECT_EQ(error_of([] { parse_allocator("expandable_segments:True"); }),
            "allocator: unknown value 'expandable_segments:True'; expected one of default, "
            "expandable");
}

TEST(RecipeSpellings, EmptyValueIsRejected) {
  EXPECT_EQ(error_of([] { parse_loss(""); }), "loss: unknown value ''; expected one of standard, fused");
}

// Spellings are matched exactly: no case folding (the JSON output and the Python API use the
// same lowercase ones; a value that differs only in case is refused with the spelling it meant),
// no surrounding blanks.
TEST(RecipeSpellings, MatchingIsExact) {
  EXPECT_EQ(error_of([] { parse_precision("FP32"); }), "precision: unknown value 'FP32'; values are lowercase: 'fp32'");
  EXPECT_EQ(error_of([] { parse_optimizer("AdamW"); }), "optimizer: unknown value 'AdamW'; values are lowercase: 'adamw'");
  EXPECT_EQ(error_of([] { parse_attention(" sdpa"); }),
            "attention: unknown value ' sdpa'; expected one of eager, sdpa, flash");
}

TEST(RecipeSpellings, ErrorIsAnInvalidArgument) {
  // So the Python binding raises ValueError (STYLE.md habit 4).
  static_assert(std::is_base_of_v<std::invalid_argument, Error>);
  EXPECT_THROW(parse_optimizer("lion"), std::invalid_argument);
}

// ---- defaults -----------------------------------------------------------------------------

// docs/schema.md, "Recipe knobs": the default column.
TEST(RecipeDefaults, MatchTheSchema) {
  const Recipe r;
  EXPECT_EQ(r.batch, 1u);
  EXPECT_EQ(r.seq, 2048u);
  EXPECT_EQ(r.grad_accum, 1u);
  EXPECT_EQ(r.precision, Precision::kBf16Mixed);
  EXPECT_EQ(r.optimizer, Optimizer::kAdamW);
  EXPECT_EQ(r.checkpointing, Checkpointing::kNone);
  EXPECT_EQ(r.attention, Attention::kSdpa);
  EXPECT_EQ(r.loss, Loss::kStandard);
  EXPECT_EQ(r.gpu, "h100-80gb");
  EXPECT_EQ(r.allocator, AllocatorMode::kDefault);
  EXPECT_EQ(r.steps, 2u);  // "Two optimizer steps are simulated"
  EXPECT_NO_THROW(r.validate());
}

// ---- Recipe::validate ---------------------------------------------------------------------

constexpr std::uint64_t k2to24 = std::uint64_t{1} << 24;  // 16777216
constexpr std::uint64_t k2to20 = std::uint64_t{1} << 20;  // 1048576

TEST(RecipeValidate, BatchZero) {
  Recipe r;
  r.batch = 0;
  EXPECT_EQ(error_of([&] { r.validate(); }), "batch: must be between 1 and 16777216, got 0");
}

TEST(RecipeValidate, BatchUpperBound) {
  Recipe r;
  r.batch = k2to24;
  EXPECT_NO_THROW(r.validate());
  r.batch = k2to24 + 1;
  EXPECT_EQ(error_of([&] { r.validate(); }), "batch: must be between 1 and 16777216, got 16777217");
}

TEST(RecipeValidate, SeqZero) {
  Recipe r;
  r.seq = 0;
  EXPECT_EQ(error_of([&] { r.validate(); }), "seq: must be between 1 and 16777216, got 0");
}

TEST(RecipeValidate, SeqOver2To24) {
  Recipe r;
  r.seq = k2to24;
  EXPECT_NO_THROW(r.validate());
  r.seq = k2to24 + 1;
  EXPECT_EQ(error_of([&] { r.validate(); }), "seq: must be between 1 and 16777216, got 16777217");
  r.seq = UINT64_MAX;
  EXPECT_EQ(error_of([&] { r.validate(); }),
            "seq: must be between 1 and 16777216, got 18446744073709551615");
}

TEST(RecipeValidate, GradAccumRange) {
  Recipe r;
  r.grad_accum = 0;
  // Every micro-batch is simulated, so the count is capped at 1024.
  EXPECT_EQ(error_of([&] { r.validate(); }), "grad_accum: must be between 1 and 1024, got 0");
  r.grad_accum = 1024;
  EXPECT_NO_THROW(r.validate());
  r.grad_accum = 1025;
  EXPECT_EQ(error_of([&] { r.validate(); }), "grad_accum: must be between 1 and 1024, got 1025");
}

TEST(RecipeValidate, StepsRange) {
  Recipe r;
  r.steps = 0;
  EXPECT_EQ(error_of([&] { r.validate(); }), "steps: must be between 1 and 100, got 0");
  r.steps = 1;
  EXPECT_NO_THROW(r.validate());
  r.steps = 100;
  EXPECT_NO_THROW(r.validate());
  r.steps = 101;
  EXPECT_EQ(error_of([&] { r.validate(); }), "steps: must be between 1 and 100, got 101");
}

TEST(RecipeValidate, TheFirstBadFieldIsNamed) {
  Recipe r;
  r.batch = 0;
  r.seq = 0;
  r.gpu = "nope";
  EXPECT_EQ(error_of([&] { r.validate(); }), "batch: must be between 1 and 16777216, got 0");
  r.batch = 1;
  EXPECT_EQ(error_of([&] { r.validate(); }), "seq: must be between 1 and 16777216, got 0");
}

TEST(RecipeValidate, UnknownGpuListsTheCatalog) {
  Recipe r;
  r.gpu = "h100";
  EXPECT_EQ(error_of([&] { r.validate(); }),
            "gpu: unknown GPU 'h100'; known: h100-80gb, h200-141gb, b200-192gb, a100-80gb, "
            "a100-40gb, l40s-48gb, a10g-24gb, l4-24gb, rtx-4090, rtx-3090, v100-32gb, t4-16gb, cpu");
}

TEST(RecipeValidate, GpuNamesIgnoreCase) {
  Recipe r;
  r.gpu = "A100-80GB";
  EXPECT_NO_THROW(r.validate());
  EXPECT_EQ(find_gpu("A100-80GB").name, "a100-80gb");
  r.gpu = "cpu";
  EXPECT_NO_THROW(r.validate());
}

// The cpu pseudo-device: no cuBLAS workspace and no context (docs/schema.md, `gpu` knob).
TEST(RecipeValidate, CpuDeviceHasNoWorkspaceAndNoContext) {
  const Gpu& cpu = find_gpu("cpu");
  EXPECT_EQ(cpu.cublas_workspace_bytes, 0u);
  EXPECT_EQ(cpu.context_bytes, 0u);
  EXPECT_EQ(cpu.capacity_bytes, 0u);
  // And the Hopper default: 32 MiB per cuBLAS workspace (data/gpus.json source note).
  EXPECT_EQ(find_gpu("h100-80gb").cublas_workspace_bytes, 32ull << 20);
}

// flash-attn 2 needs a CUDA GPU of sm80 or newer; the CPU replay cannot check it either.
TEST(RecipeValidate, FlashNeedsAnAmpereOrNewerGpu) {
  Recipe r;
  r.attention = Attention::kFlash;
  EXPECT_NO_THROW(r.validate());
  r.gpu = "rtx-3090";
  EXPECT_NO_THROW(r.validate());
  r.gpu = "cpu";
  EXPECT_NE(error_of([&] { r.validate(); }).find("attention: flash needs a CUDA GPU"), std::string::npos);
  r.gpu = "t4-16gb";
  EXPECT_NE(error_of([&] { r.validate(); }).find("sm80+), and t4-16gb is older"), std::string::npos);
  r.gpu = "v100-32gb";
  EXPECT_THROW(r.validate(), Error);
  r.gpu = "h100-80gb";
  r.precision = Precision::kFp32;  // flash-attn takes fp16 and bf16 only
  EXPECT_NE(error_of([&] { r.validate(); }).find("flash takes fp16 or bf16 tensors only"), std::string::npos);
  r.precision = Precision::kBf16True;
  EXPECT_NO_THROW(r.validate());
  r.attention = Attention::kSdpa;
  r.precision = Precision::kFp32;
  EXPECT_NO_THROW(r.validate());
}

// estimate() validates before simulating, so a bad recipe never reaches the graph builder.
TEST(RecipeValidate, EstimateValidatesTheRecipe) {
  const Model m = load_model("gpt2");
  Recipe r;
  r.seq = k2to24 + 1;
  EXPECT_EQ(error_of([&] { estimate(m, r); }), "seq: must be between 1 and 16777216, got 16777217");
  r.seq = 16;
  r.gpu = "tpu-v5";
  EXPECT_EQ(error_of([&] { estimate(m, r); }),
            "gpu: unknown GPU 'tpu-v5'; known: h100-80gb, h200-141gb, b200-192gb, a100-80gb, "
            "a100-40gb, l40s-48gb, a10g-24gb, l4-24gb, rtx-4090, rtx-3090, v100-32gb, t4-16gb, cpu");
}

// GPT-2's position embedding has n_positions rows: a front end's unset seq stays within them, and
// a seq past them is refused (transformers fails with an IndexError there).
TEST(RecipeValidate, Gpt2PositionsBoundTheSeq) {
  const Model gpt2 = load_model("gpt2");
  Recipe r;
  EXPECT_EQ(default_seq(gpt2, r), 1024u);
  EXPECT_EQ(default_seq(load_model("qwen3-0.6b"), r), 2048u);
  EXPECT_EQ(error_of([&] { estimate(gpt2, r); }),
            "seq: 2048 is past the model's 1024 positions (n_positions: GPT-2's position embedding has no row "
            "past them); use seq 1024 or less");
  r.seq = 1024;
  EXPECT_NO_THROW(estimate(gpt2, r));
  r.mode = Mode::kInference;
  r.precision = Precision::kBf16True;
  r.new_tokens = 10;
  EXPECT_EQ(default_seq(gpt2, r), 1015u);
  EXPECT_NE(error_of([&] { estimate(gpt2, r); }).find("feed 1033 positions"), std::string::npos);
  r.seq = 1015;  // positions 0 .. 1023: the tenth new token is never fed back
  EXPECT_NO_THROW(estimate(gpt2, r));
  r.new_tokens = 5000;
  EXPECT_EQ(default_seq(gpt2, r), 1u);
}

// ---- data parallelism (gpus, parallel) -----------------------------------------------------

TEST(RecipeSpellings, ParallelRoundTrips) {
  expect_round_trips(Table<Parallel>{{Parallel::kNone, "none"},
                                     {Parallel::kDdp, "ddp"},
                                     {Parallel::kFsdp, "fsdp"},
                                     {Parallel::kZero1, "zero1"},
                                     {Parallel::kZero2, "zero2"},
                                     {Parallel::kZero3, "zero3"}},
                     parse_parallel);
  EXPECT_EQ(error_of([] { parse_parallel("zero4"); }),
            "parallel: unknown value 'zero4'; expected one of none, ddp, fsdp, zero1, zero2, zero3");
}

TEST(RecipeValidate, ParallelDefaultsToOneGpu) {
  const Recipe r;
  EXPECT_EQ(r.gpus, 1u);
  EXPECT_EQ(r.parallel, Parallel::kNone);
  RecipeSpelling sp;
  EXPECT_EQ(sp.gpus, 1u);
  EXPECT_EQ(sp.parallel, "none");
}

TEST(RecipeValidate, GpusNeedAWrapper) {
  Recipe r;
  r.gpus = 8;
  EXPECT_EQ(error_of([&] { r.validate(); }), "gpus: 8 GPUs need a data-parallel wrapper: parallel ddp, fsdp, zero1, zero2 or zero3");
  r.parallel = Parallel::kDdp;
  EXPECT_NO_THROW(r.validate());
  r.gpus = 0;
  EXPECT_EQ(error_of([&] { r.validate(); }), "gpus: must be between 1 and 4096, got 0");
  r.gpus = 4097;
  EXPECT_EQ(error_of([&] { r.validate(); }), "gpus: must be between 1 and 4096, got 4097");
}

TEST(RecipeValidate, ParallelRefusesWhatIsNotModelled) {
  Recipe r;
  r.gpus = 2;
  r.parallel = Parallel::kFsdp;
  EXPECT_NO_THROW(r.validate());
  Recipe inf = r;
  inf.mode = Mode::kInference;
  inf.precision = Precision::kBf16True;
  EXPECT_EQ(error_of([&] { inf.validate(); }), "parallel: fsdp is a training knob; inference runs on one GPU");
  Recipe lora = r;
  lora.lora.rank = 8;
  EXPECT_NO_THROW(lora.validate());  // FSDP2 over a peft model (measured: cpu-fsdp-*-lora*)
  lora.parallel = Parallel::kZero3;  // ZeRO-3 over a peft model (measured: cpu-zero3-*-lora*)
  lora.precision = Precision::kBf16Master;
  EXPECT_NO_THROW(lora.validate());
  lora.offload = Offload::kOptimizer;  // ... but not with DeepSpeed's offload
  EXPECT_EQ(error_of([&] { lora.validate(); }), "offload: optimizer with LoRA is not modelled yet (FSDP2's offload both is)");
  lora.offload = Offload::kNone;
  lora.parallel = Parallel::kDdp;  // DDP over a peft model (measured: cpu-ddp-*-lora*)
  lora.precision = r.precision;
  EXPECT_NO_THROW(lora.validate());
  RecipeSpelling zl;  // ZeRO's default precision is DeepSpeed's bf16 mode, adapters or not
  zl.gpus = 2;
  zl.parallel = "zero2";
  zl.lora_rank = 8;
  EXPECT_EQ(parse_recipe(zl).precision, Precision::kBf16Master);
  lora.quant.load_in_4bit = true;  // DDP over a 4-bit base too (measured: cpu-ddp-*-qlora*, *-4bit*) ...
  EXPECT_NO_THROW(lora.validate());
  lora.parallel = Parallel::kFsdp;  // FSDP2 shards the packed weights (measured: cpu-[fh]sdp-*-qlora*, *-4bit*) ...
  EXPECT_NO_THROW(lora.validate());
  lora.fsdp.param_dtype = FsdpDtype::kBf16;  // ... but no policy casts them (uint8)
  lora.precision = Precision::kFp32;
  EXPECT_NE(error_of([&] { lora.validate(); }).find("over a 4-bit base stored as uint8 is not modelled"),
            std::string::npos);
  lora.quant.storage = QuantStorage::kBf16;  // stored as bf16 they are left alone (Note [FSDP2 variants])
  EXPECT_NO_THROW(lora.validate());
  lora.quant.storage = QuantStorage::kUint8;
  lora.fsdp.param_dtype = FsdpDtype::kNone;
  lora.parallel = Parallel::kZero3;  // ZeRO-3 partitions them as bytes (measured: cpu-zero3-*-qlora*, *-4bit*)
  EXPECT_NO_THROW(lora.validate());
  lora.parallel = Parallel::kZero2;  // ZeRO-1/2 holds the adapters only (measured: cpu-zero*-*qlora*)
  lora.precision = Precision::kBf16Master;
  EXPECT_NO_THROW(lora.validate());
  Recipe master = r;
  master.precision = Precision::kBf16Master;
  EXPECT_NE(error_of([&] { master.validate(); }).find("precision: bf16-master under parallel fsdp is not modelled"),
            std::string::npos);
  master.parallel = Parallel::kDdp;  // DDP reduces whatever gradients the recipe makes
  EXPECT_NO_THROW(master.validate());
  Recipe opt = r;
  opt.optimizer = Optimizer::kAdafactor;
  EXPECT_EQ(error_of([&] { opt.validate(); }),
            "optimizer: adafactor under parallel fsdp is not modelled; use adamw, adamw-fused or sgd");
  Recipe fused = r;
  fused.loss = Loss::kFused;
  EXPECT_NE(error_of([&] { fused.validate(); }).find("loss: fused under parallel fsdp is not modelled"),
            std::string::npos);
}

// The measuring side's rules for DeepSpeed (python/trainmem/measure/recipe.py _check_parallel).
TEST(RecipeValidate, ZeroRefusesWhatIsNotModelled) {
  for (Parallel stage : {Parallel::kZero1, Parallel::kZero2}) {
    Recipe r;
    r.gpus = 2;
    r.parallel = stage;
    r.precision = Precision::kBf16Master;
    EXPECT_NO_THROW(r.validate());
    const std::string p(to_string(stage));
    r.precision = Precision::kFp32;
    r.optimizer = Optimizer::kSgd;
    EXPECT_NO_THROW(r.validate());
    Recipe mixed = r;
    mixed.precision = Precision::kBf16Mixed;
    EXPECT_EQ(error_of([&] { mixed.validate(); }),
              "precision: bf16-mixed under parallel " + p +
                  " is not modelled (DeepSpeed's bf16 mode is a bf16 model over fp32 master partitions); use fp32 "
                  "or bf16-master");
    Recipe opt = r;
    opt.optimizer = Optimizer::kAdamW8bit;
    EXPECT_EQ(error_of([&] { opt.validate(); }),
              "optimizer: adamw-8bit under parallel " + p +
                  " is not modelled; use adamw, adamw-fused or sgd (a torch optimizer handed to deepspeed.initialize)");
    Recipe fused = r;
    fused.loss = Loss::kFused;
    EXPECT_NE(error_of([&] { fused.validate(); }).find("loss: fused under parallel " + p + " is not modelled"),
              std::string::npos);
    Recipe lora = r;
    lora.lora.rank = 8;
    EXPECT_NO_THROW(lora.validate());  // the flat group holds the adapters (measured: cpu-zero2-*-lora*)
    lora.offload = Offload::kOptimizer;
    lora.optimizer = Optimizer::kAdamW;
    EXPECT_EQ(error_of([&] { lora.validate(); }), "offload: optimizer with LoRA is not modelled yet (FSDP2's offload both is)");
    Recipe accum = r;
    accum.grad_accum = 2;
    EXPECT_NO_THROW(accum.validate());
  }
}

}  // namespace
}  // namespace trainmem
