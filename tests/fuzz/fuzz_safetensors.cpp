// Fuzzes the safetensors header reader three ways, per input:
//  1. model::parse_safetensors_header on the input as header JSON;
//  2. model::read_safetensors_dir on a file made of the 8-byte little-endian length of the
//     input followed by the input (a well-framed file with a fuzzed header), and on the raw
//     input as a whole file (fuzzed framing: declared length, truncation);
//  3. trainmem::load_model on a model directory holding a tiny config.json and the framed file,
//     then trainmem::estimate on the model (a count other than the architecture's is refused).
// Input: header JSON bytes. Seeds: corpus/fuzz_safetensors/.
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "fuzz_common.h"
#include "model/model.h"

namespace {

std::string g_dir;  // a model directory of our own, rewritten per input

constexpr const char* kTinyConfig = R"({"model_type": "llama", "hidden_size": 16,
  "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "vocab_size": 64, "torch_dtype": "bfloat16"})";

void write_file(const std::string& path, std::string_view a, std::string_view b = {}) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(a.data(), static_cast<std::streamsize>(a.size()));
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char tmpl[] = "/dev/shm/trainmem-fuzz-XXXXXX";
  char alt[] = "/tmp/trainmem-fuzz-XXXXXX";
  const char* d = mkdtemp(tmpl);
  if (d == nullptr) d = mkdtemp(alt);
  if (d == nullptr) fuzz::finding("cannot create a temporary directory");
  g_dir = d;
  write_file(g_dir + "/config.json", kTinyConfig);
  std::atexit([] {
    std::remove((g_dir + "/config.json").c_str());
    std::remove((g_dir + "/model.safetensors").c_str());
    rmdir(g_dir.c_str());
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view header(reinterpret_cast<const char*>(data), size);
  namespace model = trainmem::model;

  // 1. the header parser alone
  fuzz::expected_outcome([&] {
    model::SafetensorsSummary s = model::parse_safetensors_header(header);
    FUZZ_CHECK(s.files == 0);
    FUZZ_CHECK(s.tensor_count <= size);  // every tensor needs at least a few bytes of header
    FUZZ_CHECK(s.dominant_dtype == trainmem::DType::kF32 || s.dominant_dtype == trainmem::DType::kBF16 ||
               s.dominant_dtype == trainmem::DType::kF16);
  });

  // 2. the file reader, raw framing then a correct one
  const std::string file = g_dir + "/model.safetensors";
  write_file(file, header);
  fuzz::expected_outcome([&] { model::read_safetensors_dir(g_dir); });
  char len[8];
  for (int k = 0; k < 8; ++k) len[k] = static_cast<char>((static_cast<std::uint64_t>(size) >> (8 * k)) & 0xff);
  write_file(file, std::string_view(len, 8), header);
  fuzz::expected_outcome([&] {
    model::SafetensorsSummary s = model::read_safetensors_dir(g_dir);
    FUZZ_CHECK(s.files == 1);
  });

  // 3. the whole model-directory path, then an estimate
  fuzz::expected_outcome([&] {
    trainmem::Model m = trainmem::load_model(g_dir);
    FUZZ_CHECK(m.from_safetensors);
    trainmem::Recipe r = fuzz::recipe_from_hash(fuzz::fnv1a(header));
    fuzz::check_estimate(m, r);
  });
  return 0;
}
