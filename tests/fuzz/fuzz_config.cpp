// Fuzzes the config.json reader (trainmem::model_from_config_json → model::parse_config →
// parameter_groups) and, for every config it accepts, the graph builder and the simulator
// through trainmem::estimate with a recipe derived from the input's hash.
// Input: the bytes of a config.json. Seeds: corpus/fuzz_config/.
#include <algorithm>

#include "fuzz_common.h"
#include "model/model.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fuzz::expected_outcome([&] {
    trainmem::Model m = trainmem::model_from_config_json(text, "fuzz/config.json");
    FUZZ_CHECK(m.parameter_count == trainmem::model::count_parameters(m.parameters));
    FUZZ_CHECK(m.arch.num_heads % m.arch.num_kv_heads == 0);
    FUZZ_CHECK(m.arch.head_dim >= 1 && m.arch.hidden_size >= 1 && m.arch.num_layers >= 1);
    const std::uint64_t h = fuzz::fnv1a(text);
    fuzz::check_estimate(m, fuzz::recipe_from_hash(h), /*timeline=*/h % 7 == 0);
  });
  return 0;
}
