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
//    The adapters peft adds are fp32 too. Its use_gradient_checkpointing=True would turn on
//    Hugging Face's reentrant checkpointing, which is not modelled: the checkpointing knob is
//    the non-reentrant one, as everywhere;
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
#pragma once

#include <cstdint>

namespace trainmem::graph {

// bitsandbytes' defaults (functional.py quantize_4bit / quantize_blockwise).
inline constexpr std::uint64_t kBnb4bitBlockSize = 64;
inline constexpr std::uint64_t kBnbNestedBlockSize = 256;
inline constexpr std::uint64_t kBnb4bitCodeEntries = 16;    // get_4bit_type: fp32 values
inline constexpr std::uint64_t kBnbDynamicCodeEntries = 256; // create_dynamic_map: fp32 values

// The storages of one 4-bit weight of `numel` elements (Note [QLoRA]); 0 bytes where there is none.
struct Packed4bit {
  std::uint64_t packed_bytes = 0;         // uint8, two 4-bit values per byte
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

Packed4bit packed_4bit(std::uint64_t numel, bool double_quant);

}  // namespace trainmem::graph
