// Reads parameter counts and dtypes from *.safetensors headers.
//
// A safetensors file starts with an 8-byte little-endian header length N followed by N bytes of
// JSON: {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}, "__metadata__": {..}}.
// Only the header is read, so a 140 GB checkpoint costs a few kilobytes of I/O.
#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/checked.h"
#include "common/json_input.h"
#include "model/model.h"

namespace trainmem::model {
namespace {

// Headers of real checkpoints are well under a megabyte; 100 MiB is the format's own limit.
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

// Buffers that older checkpoints saved beside the parameters (persistent buffers of earlier
// modeling code: GPT-2's causal mask as uint8 or bool and its masked_bias, the rotary tables):
// no parameters, whatever their dtype.
bool is_saved_buffer(std::string_view name) {
  return name.ends_with("rotary_emb.inv_freq") || name.ends_with("rotary_emb.cos_cached") ||
         name.ends_with("rotary_emb.sin_cached") || name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
}

}  // namespace

SafetensorsSummary parse_safetensors_header(std::string_view header, SafetensorsSummary s, std::uint64_t data_bytes) {
  nlohmann::json j;
  try {
    j = detail::parse_input_json(header, "safetensors: header");
  } catch (const Error& e) {
    if (std::string_view(e.what()).find("nested deeper") != std::string_view::npos) throw;
    throw Error("safetensors: header is not a JSON object");
  }
  if (!j.is_object()) throw Error("safetensors: header is not a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto& t = it.value();
    if (!t.is_object() || !t.contains("shape") || !t["shape"].is_array() || !t.contains("dtype") ||
        !t["dtype"].is_string()) {
      throw Error("safetensors: tensor '" + it.key() + "' lacks a dtype or shape");
    }
    std::uint64_t numel = 1;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) throw Error("safetensors: tensor '" + it.key() + "' has a bad shape");
      numel = detail::mul(numel, d.get<std::uint64_t>(), "safetensors tensor size");
    }
    ++s.tensor_count;
    if (is_saved_buffer(it.key())) continue;
    // Only floating-point checkpoints are read: integer or packed dtypes are a quantized
    // checkpoint's (bitsandbytes' U8, GPTQ's I32), whose elements are not parameters.
    const std::string dt = t["dtype"].get<std::string>();
    const DType d = dt == "BF16" ? DType::kBF16 : dt == "F16" ? DType::kF16 : DType::kF32;
    if (dt != "BF16" && dt != "F16" && dt != "F32") {
      throw Error("safetensors: tensor '" + it.key() + "' is " + dt +
                  "; only F32, F16 and BF16 checkpoints are read (for a quantized one, give its config.json and "
                  "--load-in-4bit or --load-in-8bit)");
    }
    const nlohmann::json* off = t.contains("data_offsets") ? &t["data_offsets"] : nullptr;
    if (off == nullptr || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned() || (*off)[0].get<std::uint64_t>() > (*off)[1].get<std::uint64_t>()) {
      throw Error("safetensors: tensor '" + it.key() + "' has bad data_offsets (expected [begin, end])");
    }
    const std::uint64_t begin = (*off)[0].get<std::uint64_t>(), end = (*off)[1].get<std::uint64_t>();
    if (end - begin != detail::mul(numel, dtype_bytes(d), "safetensors tensor size") || end > data_bytes) {
      throw Error("safetensors: tensor '" + it.key() + "' has data_offsets [" + std::to_string(begin) + ", " +
                  std::to_string(end) + "] that do not hold its shape" +
                  (end > data_bytes ? " within the file" : ""));
    }
    if (it.key() == "lm_head.weight") s.lm_head_numel = numel;  // saved even where tied, at times
    s.parameter_count = detail::add(s.parameter_count, numel, "safetensors parameter count");
    s.elements_by_dtype[static_cast<int>(d)] += numel;
  }
  // Across shards: the dtype holding most elements of all headers read so far.
  s.dominant_dtype = static_cast<DType>(
      std::max_element(s.elements_by_dtype.begin(), s.elements_by_dtype.end()) - s.elements_by_dtype.begin());
  return s;
}

namespace {

// The files from_pretrained loads: the shards model.safetensors.index.json's weight_map names, or
// model.safetensors; a directory with neither (shards named otherwise) is read whole. Other
// *.safetensors beside them (Mistral's consolidated.safetensors, the same weights for another
// loader) are not the model's.
std::vector<std::filesystem::path> checkpoint_files(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> files;
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    const nlohmann::json j = detail::parse_input_json(
        detail::read_input_file(index.string(), "safetensors index", 64ull << 20), "safetensors: " + index.string());
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw Error("safetensors: " + index.string() + " has no weight_map object");
    }
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
        throw Error("safetensors: " + index.string() + " maps '" + name + "' to something that is not a file name");
      }
      const fs::path f = dir / file.get<std::string>();
      if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
    }
    for (const fs::path& f : files) {
      if (!fs::exists(f, ec)) {
        throw Error("safetensors: " + f.string() + ", named in " + index.string() + ", is missing");
      }
    }
  } else if (fs::exists(dir / "model.safetensors", ec)) {
    files.push_back(dir / "model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    }
  }
  for (const fs::path& f : files) {
    // Checked before opening: a FIFO named *.safetensors would block the read forever.
    if (!fs::is_regular_file(f, ec)) throw Error("safetensors: " + f.string() + " is not a regular file");
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

SafetensorsSummary read_safetensors_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  SafetensorsSummary s;
  for (const auto& f : checkpoint_files(dir)) {
    std::ifstream in(f, std::ios::binary);
    unsigned char len_bytes[8];
    if (!in.read(reinterpret_cast<char*>(len_bytes), 8)) {
      throw Error("safetensors: " + f.string() + " is shorter than its 8-byte header length");
    }
    std::uint64_t n = 0;
    for (int k = 7; k >= 0; --k) n = (n << 8) | len_bytes[k];
    if (n == 0 || n > kMaxHeaderBytes) {
      throw Error("safetensors: " + f.string() + " declares a header of " + std::to_string(n) + " bytes");
    }
    std::string header(n, '\0');
    if (!in.read(header.data(), static_cast<std::streamsize>(n))) {
      throw Error("safetensors: " + f.string() + " is truncated inside its header");
    }
    std::error_code sec;
    const std::uint64_t size = fs::file_size(f, sec);
    if (sec) throw Error("safetensors: cannot read the size of " + f.string());
    s = parse_safetensors_header(header, s, size - 8 - n);  // the read above proved size >= 8 + n
    ++s.files;
  }
  if (s.files > 0 && s.parameter_count == 0) {
    throw Error("safetensors: the checkpoint in " + dir + " holds no tensors");
  }
  return s;
}

}  // namespace trainmem::model
