// Model sources: config.json, the built-in catalog and safetensors headers, all reduced to an
// Architecture plus its exact list of parameter tensors.
#pragma once

#include <array>
#include <nlohmann/json_fwd.hpp>

#include "trainmem/trainmem.h"

namespace trainmem::model {

// Reads the fields of a Hugging Face config.json that decide memory. Throws Error naming the
// field on anything missing, mistyped or impossible for the architecture.
Architecture parse_config(const nlohmann::json& config);

// Every parameter tensor the Hugging Face implementation creates, in module order; the decoder
// layer's tensors are listed once with count = num_layers. Tied lm_head weights are not listed.
std::vector<ParameterGroup> parameter_groups(const Architecture& arch);

std::uint64_t count_parameters(const std::vector<ParameterGroup>& groups);

// Each decoder layer's attention window in tokens (0: full attention), as DynamicCache(config)
// and the masks see it: config.layer_types when given, else the family's rule (Gemma-2 even
// layers, Qwen2/Qwen3 from max_window_layers on, Mistral and Phi-3 every layer).
std::vector<std::uint64_t> attention_windows(const Architecture& arch);

// The same model with `layers` decoder layers (parameters recounted). See Note [Estimates are
// not extrapolated over layers] in depth.cpp for why estimates never scale over depth.
Model with_layers(const Model& model, std::uint64_t layers);

// Sum of tensor element counts over the *.safetensors files of a directory (the header only is
// read). Returns 0 when the directory has none. Throws Error on a malformed header.
struct SafetensorsSummary {
  std::uint64_t parameter_count = 0;
  std::uint64_t tensor_count = 0;
  std::uint64_t files = 0;
  std::uint64_t lm_head_numel = 0;  // a tensor named lm_head.weight (counted), 0 if none
  DType dominant_dtype = DType::kF32;
  std::array<std::uint64_t, 5> elements_by_dtype{};  // indexed by DType
};
SafetensorsSummary read_safetensors_dir(const std::string& dir);
// `data_bytes`: the bytes after the header, which every tensor's data_offsets must lie within
// (UINT64_MAX: not known, only the offsets' own consistency is checked).
SafetensorsSummary parse_safetensors_header(std::string_view header_json, SafetensorsSummary into = {},
                                            std::uint64_t data_bytes = UINT64_MAX);

}  // namespace trainmem::model
