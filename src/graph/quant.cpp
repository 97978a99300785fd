#include "graph/quant.h"

#include "common/checked.h"

namespace trainmem::graph {

// See Note [QLoRA].
Packed4bit packed_4bit(std::uint64_t numel, bool double_quant, DType storage) {
  Packed4bit p;
  // quantize_4bit's output: ((n + 1) // (itemsize * 2), 1) elements of the storage dtype.
  const std::uint64_t item = dtype_bytes(storage);
  p.packed_numel = numel / (2 * item) + (numel % (2 * item) == 2 * item - 1);
  p.packed_bytes = p.packed_numel * item;
  p.blocks = numel / kBnb4bitBlockSize + (numel % kBnb4bitBlockSize != 0);
  p.code_bytes = kBnb4bitCodeEntries * 4;
  if (!double_quant) {
    p.absmax_bytes = detail::mul(p.blocks, 4, "absmax bytes");
    return p;
  }
  p.absmax_bytes = p.blocks;
  p.offset_bytes = 4;
  const std::uint64_t nested = p.blocks / kBnbNestedBlockSize + (p.blocks % kBnbNestedBlockSize != 0);
  p.nested_absmax_bytes = detail::mul(nested, 4, "nested absmax bytes");
  p.nested_code_bytes = kBnbDynamicCodeEntries * 4;
  return p;
}

// See Note [LLM.int8].
Int8Weight int8_weight(std::uint64_t numel, std::uint64_t rows) {
  TRAINMEM_ASSERT(rows > 0 && numel % rows == 0, "an 8-bit weight that is not a matrix");
  Int8Weight w;
  w.cb_bytes = numel;
  w.scb_bytes = detail::mul(rows, 4, "SCB bytes");
  return w;
}

}  // namespace trainmem::graph
