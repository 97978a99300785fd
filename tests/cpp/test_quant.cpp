// Tests for bitsandbytes' 4-bit and 8-bit layouts (src/graph/quant.h, Notes [QLoRA], [LLM.int8])
// and the quantization recipe knobs: the sizes per parameter, and the exact errors of
// Recipe::validate.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "graph/quant.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using graph::packed_4bit;
using testing::error_of;

// 0.5 B/param packed plus one fp32 absmax per 64: 0.5625 B/param, and the 16-entry code.
TEST(Packed4bit, WithoutDoubleQuant) {
  const std::uint64_t n = 4096ull * 14336;
  const graph::Packed4bit q = packed_4bit(n, false);
  EXPECT_EQ(q.packed_bytes, n / 2);
  EXPECT_EQ(q.blocks, n / 64);
  EXPECT_EQ(q.absmax_bytes, n / 64 * 4);
  EXPECT_EQ(q.code_bytes, 64u);
  EXPECT_EQ(q.offset_bytes + q.nested_absmax_bytes + q.nested_code_bytes, 0u);
  EXPECT_DOUBLE_EQ(static_cast<double>(q.packed_bytes + q.absmax_bytes) / static_cast<double>(n), 0.5625);
}

// Double quant: uint8 absmax (1/64 B/param), an fp32 absmax per 256 blocks (4/(64·256)), the
// 0-dim fp32 offset and the 256-entry dynamic code beside the 16-entry one.
TEST(Packed4bit, WithDoubleQuant) {
  const std::uint64_t n = 4096ull * 4096;
  const graph::Packed4bit q = packed_4bit(n, true);
  EXPECT_EQ(q.absmax_bytes, n / 64);
  EXPECT_EQ(q.nested_absmax_bytes, n / 64 / 256 * 4);
  EXPECT_EQ(q.offset_bytes, 4u);
  EXPECT_EQ(q.code_bytes, 64u);
  EXPECT_EQ(q.nested_code_bytes, 1024u);
  EXPECT_DOUBLE_EQ(static_cast<double>(q.packed_bytes + q.absmax_bytes + q.nested_absmax_bytes) / static_cast<double>(n),
                   0.5 + 1.0 / 64 + 4.0 / (64 * 256));
  EXPECT_EQ(q.total_bytes(), n / 2 + n / 64 + n / 64 / 256 * 4 + 4 + 64 + 1024);
}

// Partial blocks round up, and an odd count still takes a whole last byte.
TEST(Packed4bit, PartialBlocksRoundUp) {
  const graph::Packed4bit q = packed_4bit(530 * 200 + 1, true);
  EXPECT_EQ(q.packed_bytes, 53001u);
  EXPECT_EQ(q.blocks, 1657u);  // ceil(106001 / 64)
  EXPECT_EQ(q.absmax_bytes, 1657u);
  EXPECT_EQ(q.nested_absmax_bytes, 7u * 4);  // ceil(1657 / 256) = 7
}

// bf16 storage (Note [The packed weights' storage dtype]): the same bytes as (n + 1) // 4 bf16
// elements, quantize_4bit's shape; the constants do not change.
TEST(Packed4bit, Bf16StorageHoldsTheSameBytes) {
  const std::uint64_t n = 2048ull * 8192;
  const graph::Packed4bit u = packed_4bit(n, true);
  const graph::Packed4bit b = packed_4bit(n, true, DType::kBF16);
  EXPECT_EQ(u.packed_numel, n / 2);
  EXPECT_EQ(b.packed_numel, n / 4);
  EXPECT_EQ(b.packed_bytes, u.packed_bytes);
  EXPECT_EQ(b.total_bytes(), u.total_bytes());
  // (n + 1) // 4: a count of 4k + 3 takes a last element, one of 4k + 1 does not.
  EXPECT_EQ(packed_4bit(4 * 1000 + 3, false, DType::kBF16).packed_numel, 1001u);
  EXPECT_EQ(packed_4bit(4 * 1000 + 1, false, DType::kBF16).packed_numel, 1000u);
  EXPECT_EQ(packed_4bit(4 * 1000 + 1, false).packed_numel, 2001u);
}

// A half storage dtype must hold the packed bytes whole: bitsandbytes' CPU quantize_4bit fails to
// view an odd count as bf16 (measured: a Llama with hidden 201 and intermediate 333), its CUDA one
// makes a buffer a byte short. Refused; uint8 takes any count.
TEST(Packed4bit, HalfStorageNeedsAnEvenByteCount) {
  const Model odd = model_from_config_json(
      R"({"model_type": "llama", "hidden_size": 201, "intermediate_size": 333, "num_hidden_layers": 1,
          "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 36, "vocab_size": 1001})");
  Recipe r;
  r.seq = 16;
  r.lora.rank = 4;
  r.quant.load_in_4bit = true;
  r.precision = Precision::kBf16True;
  EXPECT_NO_THROW(estimate(odd, r));
  r.quant.storage = QuantStorage::kBf16;
  EXPECT_EQ(error_of([&] { estimate(odd, r); }),
            "bnb_4bit_quant_storage: bfloat16 cannot hold model.layers.N.mlp.gate_proj.weight's 33467 packed bytes "
            "(66933 4-bit values); use uint8");
}

// LLM.int8: CB is one int8 per element, SCB one fp32 absmax per output row (Note [LLM.int8]).
TEST(Int8Weight, CbAndScb) {
  const graph::Int8Weight w = graph::int8_weight(8192ull * 2048, 8192);  // Llama-3.2-1B's up_proj
  EXPECT_EQ(w.cb_bytes, 8192u * 2048);
  EXPECT_EQ(w.scb_bytes, 8192u * 4);
  EXPECT_EQ(w.total_bytes(), 8192u * 2048 + 8192u * 4);
  const graph::Int8Weight k = graph::int8_weight(512ull * 2048, 512);  // its k_proj: rows are out_features
  EXPECT_EQ(k.scb_bytes, 2048u);
  EXPECT_DOUBLE_EQ(graph::kLlmInt8Threshold, 6.0);
}

RecipeSpelling qlora_spelling() {
  RecipeSpelling s;
  s.precision = "bf16-true";
  s.lora_rank = 8;
  s.load_in_4bit = true;
  s.bnb_4bit_quant_type = "nf4";
  s.bnb_4bit_use_double_quant = true;
  return s;
}

TEST(QloraRecipe, Parses) {
  const Recipe r = parse_recipe(qlora_spelling());
  EXPECT_TRUE(r.quant.enabled());
  EXPECT_EQ(r.quant.quant_type, QuantType::kNf4);
  EXPECT_TRUE(r.quant.double_quant);
  EXPECT_EQ(to_string(QuantType::kFp4), "fp4");
  EXPECT_EQ(parse_quant_type("fp4"), QuantType::kFp4);
}

// Without a precision a 4-bit base runs in bf16-true, its matmuls' dtype (bf16-mixed is refused).
TEST(QloraRecipe, DefaultPrecisionIsBf16True) {
  RecipeSpelling s = qlora_spelling();
  s.precision = "";
  EXPECT_EQ(parse_recipe(s).precision, Precision::kBf16True);
  s.load_in_4bit = false;
  s.bnb_4bit_quant_type = "fp4";
  s.bnb_4bit_use_double_quant = false;
  EXPECT_EQ(parse_recipe(s).precision, Precision::kBf16Mixed);
}

// Under ZeRO a 4-bit base takes DeepSpeed's bf16 mode (bf16-master) by default, and only there
// (Notes [QLoRA under ZeRO-1/2] in src/graph/zero.cpp, [QLoRA under ZeRO-3] in zero3.cpp); fp32 is
// DeepSpeed's fp32 mode.
TEST(QloraRecipe, ZeroTakesDeepSpeedsBf16Mode) {
  RecipeSpelling s = qlora_spelling();
  s.precision = "";
  s.gpus = 2;
  s.parallel = "zero2";
  EXPECT_EQ(parse_recipe(s).precision, Precision::kBf16Master);
  s.parallel = "zero1";
  s.precision = "fp32";
  EXPECT_EQ(parse_recipe(s).precision, Precision::kFp32);
  s.precision = "bf16-true";  // not a DeepSpeed mode
  EXPECT_NE(error_of([&] { parse_recipe(s); }).find("DeepSpeed"), std::string::npos);
  s.parallel = "ddp";
  s.precision = "bf16-master";
  EXPECT_NE(error_of([&] { parse_recipe(s); }).find("bf16-master keeps fp32 masters"), std::string::npos);
  s.parallel = "zero3";
  s.precision = "";
  EXPECT_EQ(parse_recipe(s).precision, Precision::kBf16Master);
  s.precision = "fp32";
  EXPECT_EQ(parse_recipe(s).precision, Precision::kFp32);
  s.offload = "optimizer";  // DeepSpeed's offload over a peft model is not modelled
  EXPECT_NE(error_of([&] { parse_recipe(s); }).find("with LoRA is not modelled yet"), std::string::npos);
}

// load_dtype bf16: a base loaded in bf16 and trained under bf16 autocast; auto elsewhere.
TEST(QloraRecipe, LoadDtype) {
  RecipeSpelling s = qlora_spelling();
  s.precision = "bf16-mixed";
  s.load_dtype = "bf16";
  EXPECT_EQ(parse_recipe(s).load_dtype, LoadDtype::kBf16);
  s.load_dtype = "fp8";
  EXPECT_EQ(error_of([&] { parse_recipe(s); }), "load_dtype: unknown value 'fp8'; expected one of auto, bf16, fp16");
  s.load_dtype = "fp16";  // fp16 goes with fp16 autocast
  EXPECT_NE(error_of([&] { parse_recipe(s); }).find("precision fp16-mixed); with bf16-mixed"), std::string::npos);
  s.precision = "fp16-mixed";
  EXPECT_EQ(parse_recipe(s).load_dtype, LoadDtype::kFp16);
  s.load_dtype = "bf16";
  s.precision = "bf16-true";
  EXPECT_EQ(error_of([&] { parse_recipe(s); }),
            "load_dtype: bf16 is a model loaded in bf16 and trained under bf16 autocast (precision bf16-mixed); "
            "with bf16-true use auto (the precision's dtype)");
  s.precision = "";  // the load dtype's autocast by default
  EXPECT_EQ(parse_recipe(s).precision, Precision::kBf16Mixed);
  s.load_dtype = "fp16";
  EXPECT_EQ(parse_recipe(s).precision, Precision::kFp16Mixed);
  // A bf16 model trained whole under bf16 autocast (Note [A half model trained whole]); fp16's
  // GradScaler refuses fp16 gradients.
  RecipeSpelling plain;
  plain.load_dtype = "bf16";
  EXPECT_EQ(parse_recipe(plain).precision, Precision::kBf16Mixed);
  EXPECT_TRUE(parse_recipe(plain).half_model());
  plain.load_dtype = "fp16";
  EXPECT_NE(error_of([&] { parse_recipe(plain); }).find("refuses fp16 gradients"), std::string::npos);
  // LoRA over a half model under its autocast (Note [A half model under autocast]).
  plain.lora_rank = 8;
  EXPECT_EQ(parse_recipe(plain).precision, Precision::kFp16Mixed);
  plain.load_dtype = "bf16";
  EXPECT_EQ(parse_recipe(plain).precision, Precision::kBf16Mixed);
  plain.precision = "bf16-true";
  EXPECT_NE(error_of([&] { parse_recipe(plain); }).find("(precision bf16-mixed); with bf16-true"), std::string::npos);
}

TEST(QloraRecipe, PrepareKbitTraining) {
  // Skipped (TRL's sharded QLoRA): a half-loaded base's other weights stay half, which makes the
  // recipe a half model (Note [QLoRA without prepare_model_for_kbit_training]).
  RecipeSpelling s = qlora_spelling();
  s.precision = "bf16-mixed";
  s.load_dtype = "bf16";
  EXPECT_FALSE(parse_recipe(s).half_model());
  s.prepare_kbit_training = false;
  EXPECT_TRUE(parse_recipe(s).half_model());
  s.load_dtype = "auto";  // an fp32 base is the same model either way
  EXPECT_NE(error_of([&] { parse_recipe(s); }).find("needs load_in_4bit and load_dtype bf16 or fp16"),
            std::string::npos);
  RecipeSpelling plain;
  plain.lora_rank = 8;
  plain.load_dtype = "bf16";
  plain.prepare_kbit_training = false;
  EXPECT_NE(error_of([&] { parse_recipe(plain); }).find("needs load_in_4bit"), std::string::npos);
}

TEST(QloraRecipe, QuantStorage) {
  RecipeSpelling s = qlora_spelling();
  EXPECT_EQ(parse_recipe(s).quant.storage, QuantStorage::kUint8);
  s.bnb_4bit_quant_storage = "bf16";
  EXPECT_EQ(parse_recipe(s).quant.storage, QuantStorage::kBf16);
  EXPECT_EQ(storage_dtype(QuantStorage::kBf16), DType::kBF16);
  s.bnb_4bit_quant_storage = "fp16";
  EXPECT_EQ(error_of([&] { parse_recipe(s); }),
            "bnb_4bit_quant_storage: unknown value 'fp16'; expected one of uint8, bf16");
  RecipeSpelling plain;
  plain.bnb_4bit_quant_storage = "bf16";
  EXPECT_EQ(error_of([&] { parse_recipe(plain); }),
            "bnb_4bit_quant_storage: set without load_in_4bit (it is the packed 4-bit weights' dtype)");
}

TEST(QloraRecipe, Errors) {
  RecipeSpelling s = qlora_spelling();
  s.bnb_4bit_quant_type = "int4";
  EXPECT_EQ(error_of([&] { parse_recipe(s); }), "bnb_4bit_quant_type: unknown value 'int4'; expected one of fp4, nf4");
  s = qlora_spelling();
  s.lora_rank = 0;
  EXPECT_EQ(error_of([&] { parse_recipe(s); }),
            "load_in_4bit: a 4-bit base model cannot be trained itself; add LoRA adapters (lora_rank > 0): that is QLoRA");
  s = qlora_spelling();
  s.precision = "bf16-mixed";  // autocast over the fp32 model, bf16 4-bit matmuls
  EXPECT_EQ(parse_recipe(s).precision, Precision::kBf16Mixed);
  s.precision = "bf16-master";
  EXPECT_EQ(error_of([&] { parse_recipe(s); }),
            "precision: bf16-master keeps fp32 masters of half trainable weights, but peft makes LoRA adapters fp32 "
            "already; use bf16-true (half base, fp32 adapters) or bf16-mixed (under zero1 / zero2 it is DeepSpeed's "
            "bf16 mode)");
  s = RecipeSpelling{};
  s.bnb_4bit_use_double_quant = true;
  EXPECT_EQ(error_of([&] { parse_recipe(s); }),
            "bnb_4bit_quant_type / bnb_4bit_use_double_quant: set without load_in_4bit");
  s = qlora_spelling();
  s.load_in_8bit = true;
  EXPECT_EQ(error_of([&] { parse_recipe(s); }), "load_in_8bit: cannot be combined with load_in_4bit; choose one");
}

// Generation with 4-bit weights needs no adapters (adapters are refused under inference anyway).
TEST(QuantizedGenerationRecipe, FourBitInferenceParses) {
  RecipeSpelling s = qlora_spelling();
  s.lora_rank = 0;
  s.mode = "inference";
  s.precision = "";
  const Recipe r = parse_recipe(s);
  EXPECT_TRUE(r.quant.enabled());
  EXPECT_FALSE(r.quant.load_in_8bit);
  EXPECT_EQ(r.precision, Precision::kBf16True);
}

TEST(QuantizedGenerationRecipe, EightBit) {
  RecipeSpelling s;
  s.mode = "inference";
  s.load_in_8bit = true;
  const Recipe r = parse_recipe(s);
  EXPECT_TRUE(r.quant.load_in_8bit);
  EXPECT_FALSE(r.quant.enabled());
  EXPECT_TRUE(r.quant.any());
  EXPECT_EQ(r.precision, Precision::kBf16True);  // the default, as for 4-bit
  s.mode = "training";
  EXPECT_EQ(error_of([&] { parse_recipe(s); }),
            "load_in_8bit: training with 8-bit (LLM.int8) weights is not modelled; use it with mode inference, or "
            "load_in_4bit with LoRA (QLoRA) to train");
  s.mode = "inference";
  s.precision = "bf16-mixed";
  EXPECT_EQ(error_of([&] { parse_recipe(s); }),
            "precision: inference loads the weights in one dtype: fp32, bf16-true or fp16-true, got bf16-mixed");
}

}  // namespace
}  // namespace trainmem
