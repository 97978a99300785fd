// bitsandbytes' 4-bit weights: what a quantized linear layer holds, and what its matmul allocates.
//
// Note [QLoRA]
// A QLoRA base model is loaded with transformers' BitsAndBytesConfig(load_in_4bit=True, ...) and
// prepared with peft's prepare_model_for_kbit_training (bitsandbytes 0.50, transformers 5, peft 0.21):
//  * every nn.Linear of the decoder layers becomes bnb.nn.Linear4bit; its weight (Params4bit) is
//    quantized as it is loaded (functional.py quantize_4bit, blocksize 64): packed uint8, two
//    values per byte, plus a QuantState: absmax (fp32, one per block of 64 elements) and the
//    16-entry fp32 code of nf4 or fp4 (get_4bit_type, a tensor of its own per weight). With
//    bnb_4bit_use_double_quant (compress_statistics) absmax is quantized again
//    (quantize_blockwise, blocksize 256): uint8 absmax, a 0-dim fp32 offset (absmax.mean()),
//    and a nested state with fp32 absmax per 256 blocks and its own copy of the 256-entry
//    dynamic code. The embeddings, lm_head and norms are not quantized;
//  * prepare_model_for_kbit_training (peft utils/other.py) freezes everything and casts every
//    bf16/fp16 parameter that is not Params4bit to fp32: embeddings, norms and lm_head, so the
//    residual stream and every op outside the 4-bit matmuls run in fp32, like the fp32 policy.
//    The adapters peft adds are fp32 too. Its use_gradient_checkpointing=True (the default)
//    turns on Hugging Face's checkpointing with torch's reentrant variant: checkpointing
//    full-reentrant (Note [Reentrant checkpoints] in tape.h); `full` is the non-reentrant one;
//  * Linear4bit.forward (nn/modules.py): x.to(compute_dtype) (kept until it returns), then
//    matmul_4bit → MatMul4Bit → gemm_4bit (backends/default/ops.py, the CPU kernel, and CUDA's
//    for more than 1536 input rows): with double quant dequantize_blockwise of the uint8 absmax
//    (fp32, one per block) plus the offset (a new tensor; the first dies), then
//    dequantize_4bit of the whole weight to the compute dtype, F.linear, and the two die. The
//    output is cast back to the input's dtype. MatMul4Bit saves only the packed weight;
//  * MatMul4Bit.backward: dequantize_4bit(B, state) again, in the dtype the weight was loaded
//    in (the precision's, the same as the compute dtype here; with double quant first the fp32
//    absmax, which dies as soon as the weight is made), matmul(grad_output, W) → grad_A, and W
//    dies; no weight gradient;
//  * peft's lora.bnb.Linear4bit.forward (tuners/lora/bnb.py): result = base_layer(x).clone(),
//    then result + lora_B(lora_A(dropout(x))) * scaling, the adapter output cast to the result's
//    dtype first (not after the sum, as lora.Linear does).
//
// Note [The load dtype of a 4-bit base]
// Loading quantizes each weight from the dtype from_pretrained loads the checkpoint in
// (`dtype=`), and the QuantState remembers it (quant_state.dtype). Only MatMul4Bit's backward
// reads it: dequantize_4bit(B, state) makes the weight in that dtype, then casts it to the
// gradient's (Note [QLoRA]); the forward's gemm_4bit dequantizes to the input's dtype directly.
// The recipes: a base loaded in the precision's parameter dtype (load_dtype auto: fp32 under
// autocast), or, the common Trainer recipe, loaded in bf16 (`dtype=torch.bfloat16`), prepared by
// prepare_model_for_kbit_training (the rest is fp32 again: the casts of Note [QLoRA]) and trained
// with bf16=True (load_dtype bf16 under bf16-mixed), or on a GPU without bf16 loaded in fp16 and
// trained with fp16=True (load_dtype fp16 under fp16-mixed). Nothing else changes: the absmax and codes
// are fp32 whatever the load dtype, and what is not 4-bit is fp32 either way. The backward then
// makes one half weight and no cast instead of an fp32 weight and its half cast (measured:
// data/ground_truth/cpu-*{qlora,4bit}*-load{bf,fp}16-*, parallel/cpu-[df]*-{qlora,4bit}*-load*16-*).
//
// Note [The packed weights' storage dtype]
// BitsAndBytesConfig's bnb_4bit_quant_storage is the dtype quantize_4bit returns the packed bytes
// as: shape ((n + 1) // (itemsize * 2), 1), uint8 by default. FSDP-QLoRA and ZeRO-3-QLoRA recipes
// set it to bf16 (the base's load dtype) so that a wrapper that wants one dtype per flat buffer
// sees none other. The bytes are the same; the kernels view them as uint8 (dequantize_4bit's
// `A.view(torch.uint8)`, no copy), and prepare_model_for_kbit_training leaves Params4bit out of
// its fp32 casts, so a single process holds and does exactly what it does with uint8. What
// changes is what a sharding wrapper sees: FSDP2 shards dim 0 of (n / 4, 1) bf16 rows, not of
// (n / 2, 1) uint8 ones (the padding to a multiple of the world differs), and ZeRO-3 partitions
// n / 4 bf16 elements and gathers them in the bf16 flat buffer of a coalesced fetch, beside the
// other bf16 parameters (Note [QLoRA under ZeRO-3] in zero3.cpp). Measured:
// data/ground_truth/*-qsbf16-*, parallel/cpu-*-qsbf16-*.
//
// Note [QLoRA without prepare_model_for_kbit_training]
// TRL's SFTTrainer calls prepare_model_for_kbit_training for a 4-bit base only when the base is
// not sharded: a Params4bit left on the CPU or the meta device (how FSDP and ZeRO-3 QLoRA scripts
// load it, low_cpu_mem_usage) skips it. Nothing is cast then: the embedding, the norms and lm_head
// stay in the half load dtype, the residual stream and the logits are half, peft still makes the
// adapters fp32, and the step runs under the load dtype's autocast. That is a half model under
// LoRA whose layers' linear weights are 4-bit (Recipe::half_model(), Note [A half model under
// autocast] in step_parameters.cpp), with the QuantState in the load dtype (Note [The load dtype
// of a 4-bit base]); recipe knob prepare_kbit_training false. Against the prepared base the
// activations saved between the layers are half as large: llama-3.1-8b, QLoRA rank 16, batch 4
// x seq 2048 on an H100, 53.3 GiB allocated at the peak against 79.2 GiB. Measured (one process,
// GPT-2, Qwen3 in fp16, DDP, FSDP2 on two and three ranks with bf16 storage):
// data/ground_truth/*-noprep-*, parallel/cpu-*-noprep-*.
//
// Note [Quantized generation]
// One generate() call with 4-bit weights (bitsandbytes 0.50, transformers 5): the model is loaded
// with from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...,
// bnb_4bit_compute_dtype = the precision's dtype), dtype = the precision's dtype) and used as it is:
// no prepare_model_for_kbit_training, so the embeddings, norms and lm_head stay in the precision's
// dtype and so does the residual stream (python/trainmem/measure/models.py build_quantized_model).
// The weights are those of Note [QLoRA]. Linear4bit.forward (nn/modules.py) in eval mode under
// no_grad:
//  * x.to(compute_dtype) is x itself (the same dtype), and the output's .to(input dtype) too;
//  * matmul_4bit (autograd/_functions.py) needs no gradient, so it calls gemm_4bit directly
//    (no MatMul4Bit, nothing saved). Its CPU kernel is the Python default one
//    (backends/default/ops.py _gemm_4bit_default_impl), the same ops as the training forward of
//    Note [QLoRA]: with double quant the fp32 absmax from dequantize_blockwise plus the offset (a
//    new tensor; the first dies), dequantize_4bit of the whole weight (out × in, compute dtype),
//    F.linear, then the absmax and the weight die. Measured (data/ground_truth/cpu-gen-*-4bit-*).
//    On a CPU with AVX512-BF16 Linear4bit.forward instead repacks the weight at the first forward
//    (functional.py _convert_weight_packed_for_cpu) and runs a fused CPU gemv: not modelled (the
//    corpus CPU has no AVX-512);
//  * CUDA (backends/cuda/ops.py, the gemm_4bit kernel), M = rows of the input (b·k·s in the
//    prefill, b·k in a decode step): M <= 4 (_GEMM_4BIT_CUSTOM_FLOOR_M) runs the fused kernel
//    (cgemm_4bit_*), which allocates its output only, when the input width is a multiple of the
//    block size (64; every catalog model's is); M > 1536 runs _dequant_linear_fallback:
//    with double quant an fp32 absmax (empty_like) and the sum with the offset, both alive until
//    it returns, the dequantized weight, F.linear. For 4 < M <= 1536 _gemm_4bit_use_custom_cuda
//    decides per architecture from the SM count and the weight's shape; trainmem takes the
//    fallback there (the upper bound: one dequantized weight more). Unmeasured.
//
// Note [LLM.int8]
// One generate() call with 8-bit weights (bitsandbytes 0.50, transformers 5):
//  * BitsAndBytesConfig(load_in_8bit=True) with transformers' defaults (llm_int8_threshold 6.0,
//    llm_int8_has_fp16_weight False; integrations/bitsandbytes.py keeps lm_head unquantized):
//    every nn.Linear of the decoder layers becomes Linear8bitLt(has_fp16_weights=False,
//    threshold=6.0); Int8Params._quantize (nn/modules.py) makes CB, int8 (out × in), which is the
//    parameter's data, and SCB, fp32 (out), the absmax of each row. The rest stays in the
//    precision's dtype;
//  * Linear8bitLt.forward in eval mode: state.is_training is False, so bnb.matmul takes
//    MatMul8bitLt (autograd/_functions.py) on every device; with no gradient needed it quantizes
//    the input with int8_vectorwise_quant (not int8_double_quant). Per matmul of `rows` × `in` to
//    `out`, the CPU kernels being the Python default ones (backends/default/ops.py):
//     - A.to(float16): an fp16 copy of the input, (rows, in), unless it is fp16 already; it dies
//       when int8_vectorwise_quant returns;
//     - int8_vectorwise_quant(threshold 6.0): |A| (fp16), `>= 6.0` (bool, rows × in; |A| dies),
//       .any() (0-dim bool); no outliers: an empty outlier_cols; |A| again, max over dim 1 (fp16
//       values and int64 indices, rows each; |A| and the indices die), .float() (fp32, rows: SCA;
//       the fp16 values die); 127 / SCA.unsqueeze(-1) as reciprocal and mul (fp32 rows × 1 each);
//       A * that (fp32 rows × in), round (fp32), .to(int8): CA (rows × in), each dying as the
//       next is made; with more than one row out_row[:, outlier_cols] = 0 makes a 0-dim int8 for
//       the 0 (an empty index writes nothing). The bool mask and the fp16 copy die at return;
//     - int8_mixed_scaled_mm (threshold > 0), no outliers: an empty subA, then int8_scaled_mm:
//       int8_linear_matmul is, without AVX-512 (backends/cpu/ops.py registers torch._int_mm only
//       with it), A.float() (fp32 rows × in), B.float() (the whole weight in fp32, out × in),
//       matmul (fp32 rows × out), both operands die, .to(int32) (the fp32 dies);
//       int8_mm_dequant: SCA × SCB (fp32 rows × out), int32 × that (fp32), × 6.200124e-05
//       (fp32), each dying as the next is made, .to(the input's dtype): the output; the int32
//       dies; then CA and SCA die as the forward returns;
//     Measured (data/ground_truth/cpu-gen-*-8bit-*). An input column with any |value| >= 6.0 is
//    an outlier column: then the kernels also allocate its indices, a copy of the outliers, the
//    input's outlier columns (rows × n), the weight's (out × n, int8, then fp32 and the dtype)
//    and an addmm output (rows × out). Which columns that is depends on the data, so it is not
//    modelled: trainmem assumes none (random checkpoints have none; real LLMs have a few
//    systematic outlier dimensions, a few MiB per matmul at most besides the output);
//  * CUDA (backends/cuda/ops.py): the fp16 copy; int8_vectorwise_quant allocates SCA (fp32 rows)
//    and CA (int8) first, then |A| and the mask as on the CPU; int8_linear_matmul (cuBLASLt) an
//    int32 (rows × out); int8_mm_dequant an fp16 (rows × out), then .to(dtype) copies it unless
//    the dtype is fp16. No fp32 copy of the weight. Unmeasured.
#pragma once

#include <cstdint>

#include "trainmem/trainmem.h"

namespace trainmem::graph {

// bitsandbytes' defaults (functional.py quantize_4bit / quantize_blockwise).
inline constexpr std::uint64_t kBnb4bitBlockSize = 64;
inline constexpr std::uint64_t kBnbNestedBlockSize = 256;
inline constexpr std::uint64_t kBnb4bitCodeEntries = 16;    // get_4bit_type: fp32 values
inline constexpr std::uint64_t kBnbDynamicCodeEntries = 256; // create_dynamic_map: fp32 values
// CUDA's gemm_4bit runs its fused kernel for at most this many input rows on every architecture
// (backends/cuda/ops.py _GEMM_4BIT_CUSTOM_FLOOR_M; Note [Quantized generation]).
inline constexpr std::uint64_t kBnbGemm4bitFusedMaxRows = 4;

// The storages of one 4-bit weight of `numel` elements (Note [QLoRA]); 0 bytes where there is none.
struct Packed4bit {
  std::uint64_t packed_numel = 0;         // elements of the storage dtype, shape (packed_numel, 1)
  std::uint64_t packed_bytes = 0;         // two 4-bit values per byte
  std::uint64_t blocks = 0;               // blocks of 64 elements
  std::uint64_t absmax_bytes = 0;         // fp32 per block, or uint8 with double quant
  std::uint64_t code_bytes = 0;           // the 16-entry fp32 code
  std::uint64_t offset_bytes = 0;         // double quant: 0-dim fp32
  std::uint64_t nested_absmax_bytes = 0;  // double quant: fp32 per 256 blocks
  std::uint64_t nested_code_bytes = 0;    // double quant: the 256-entry fp32 code
  std::uint64_t total_bytes() const {
    return packed_bytes + absmax_bytes + code_bytes + offset_bytes + nested_absmax_bytes + nested_code_bytes;
  }
};

// `storage`: the packed weight's dtype (uint8, or bf16: Note [The packed weights' storage dtype]).
Packed4bit packed_4bit(std::uint64_t numel, bool double_quant, DType storage = DType::kU8);

// bitsandbytes' LLM.int8 outlier threshold, transformers' llm_int8_threshold default (Note [LLM.int8]).
inline constexpr double kLlmInt8Threshold = 6.0;

// The storages of one 8-bit weight of `rows` × `numel / rows` (Note [LLM.int8]).
struct Int8Weight {
  std::uint64_t cb_bytes = 0;   // CB: int8, one byte per element (the parameter's data)
  std::uint64_t scb_bytes = 0;  // SCB: fp32, one absmax per row (output feature)
  std::uint64_t total_bytes() const { return cb_bytes + scb_bytes; }
};

Int8Weight int8_weight(std::uint64_t numel, std::uint64_t rows);

}  // namespace trainmem::graph
