// The built-in model and GPU catalogs, and load_model's resolution order:
// catalog name or alias → Hugging Face id → config.json path → model directory.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/checked.h"
#include "common/json_input.h"
#include "model/embedded_data.h"
#include "model/model.h"

namespace trainmem {
namespace {

using nlohmann::json;
using detail::lower;

std::string_view data_file(std::string_view path) {
  for (const auto& f : data::files()) {
    if (f.path == path) return f.contents;
  }
  TRAINMEM_ASSERT(false, "missing embedded data file");
  return {};
}

struct IndexEntry {
  std::string name, hf_id, file;
  std::vector<std::string> aliases;
  std::uint64_t parameters = 0;
};

const std::vector<IndexEntry>& model_index() {
  static const std::vector<IndexEntry> kIndex = [] {
    std::vector<IndexEntry> out;
    for (const auto& e : json::parse(data_file("models/index.json"))) {
      IndexEntry x;
      x.name = e.at("name").get<std::string>();
      x.hf_id = e.at("hf_id").get<std::string>();
      x.file = e.at("file").get<std::string>();
      x.parameters = e.at("parameters").get<std::uint64_t>();
      for (const auto& a : e.value("aliases", json::array())) x.aliases.push_back(a.get<std::string>());
      out.push_back(std::move(x));
    }
    return out;
  }();
  return kIndex;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Up to three catalog names closest to what was asked, for "did you mean".
std::string suggestions(std::string_view asked) {
  std::vector<std::pair<std::size_t, std::string>> scored;
  std::string a = lower(asked);
  for (const auto& e : model_index()) {
    std::size_t d = edit_distance(a, e.name);
    for (const auto& al : e.aliases) d = std::min(d, edit_distance(a, al));
    if (e.name.find(a) != std::string::npos || a.find(e.name) != std::string::npos) d = std::min<std::size_t>(d, 1);
    scored.emplace_back(d, e.name);
  }
  std::sort(scored.begin(), scored.end());
  std::string out;
  for (std::size_t k = 0; k < scored.size() && k < 3; ++k) {
    if (k) out += ", ";
    out += scored[k].second;
  }
  return out;
}

Model finish(Architecture arch, std::string name, std::string hf_id) {
  Model m;
  m.name = std::move(name);
  m.hf_id = std::move(hf_id);
  m.arch = std::move(arch);
  m.parameters = model::parameter_groups(m.arch);
  m.parameter_count = model::count_parameters(m.parameters);
  return m;
}

Model load_directory(const std::filesystem::path& dir, const std::string& label) {
  auto cfg = dir / "config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(cfg, ec)) {
    throw Error(label + ": directory has no config.json");
  }
  Model m = load_model(cfg.string());
  m.name = label;
  auto st = model::read_safetensors_dir(dir.string());
  if (st.files > 0) {
    // The architecture decides the op graph and every byte of weights, so a checkpoint holding
    // another count (a shard missing, tensors the layer list does not know, a lying header) would
    // print a count the memory figures do not stand on: refused. Its dtype becomes torch_dtype.
    // Tied embeddings: some exports save lm_head.weight anyway, the embedding's copy.
    const bool tied_head_saved = m.arch.tie_word_embeddings && st.lm_head_numel > 0 &&
                                 st.parameter_count - st.lm_head_numel == m.parameter_count;
    if (st.parameter_count != m.parameter_count && !tied_head_saved) {
      throw Error(label + ": the *.safetensors files hold " + std::to_string(st.parameter_count) +
                  " parameters, config.json describes " + std::to_string(m.parameter_count) +
                  " (tensors the architecture does not have, or a shard missing); give the config.json alone to "
                  "estimate the architecture");
    }
    m.from_safetensors = true;
    m.arch.torch_dtype = st.dominant_dtype;
  }
  return m;
}

// Files larger than this are not config files (a config.json is a few kilobytes).
constexpr std::uintmax_t kMaxConfigBytes = 16ull << 20;

}  // namespace

Model model_from_config_json(std::string_view text, std::string name) {
  json j = detail::parse_input_json(text, name);
  return finish(model::parse_config(j), std::move(name), "");
}

namespace {

// The catalog entry `source` names (its name, Hugging Face id or an alias, in any case), or null.
const IndexEntry* catalog_entry(std::string_view source) {
  const std::string key = lower(source);
  for (const auto& e : model_index()) {
    bool hit = key == e.name || key == lower(e.hf_id);
    for (const auto& a : e.aliases) hit = hit || key == a;
    if (hit) return &e;
  }
  return nullptr;
}

}  // namespace

bool is_catalog_name(std::string_view source) { return catalog_entry(source) != nullptr; }

Model load_model(std::string_view source) {
  if (source.empty()) throw Error("model: empty name; run `trainmem models` for the catalog");
  if (const IndexEntry* e = catalog_entry(source)) {
    json j = json::parse(data_file("models/" + e->file));
    return finish(model::parse_config(j), e->name, e->hf_id);
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p{std::string(source)};
  if (fs::is_directory(p, ec)) return load_directory(p, std::string(source));
  if (fs::is_regular_file(p, ec)) {
    auto size = fs::file_size(p, ec);
    if (ec) throw Error(std::string(source) + ": cannot read its size (" + ec.message() + ")");
    if (size > kMaxConfigBytes) {
      throw Error(std::string(source) + ": file is too large to be a config.json (" +
                  detail::format_bytes(size) + ")");
    }
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return model_from_config_json(ss.str(), std::string(source));
  }
  // A name that can only be a path (absolute, relative, home, a .json file): say what the
  // file system said rather than suggest catalog names.
  const bool path_like = source.front() == '/' || source.front() == '.' || source.front() == '~' ||
                         source.ends_with(".json") || source.ends_with("/");
  if (path_like) {
    const fs::file_status st = fs::status(p, ec);
    const std::string why = ec ? ec.message()
                               : st.type() == fs::file_type::not_found ? "no such file or directory"
                                                                      : "not a regular file or a directory";
    throw Error("model: '" + std::string(source) + "': " + why +
                " (a config.json, a model directory, or a name from `trainmem models`)");
  }
  throw Error("unknown model '" + std::string(source) + "'; did you mean: " + suggestions(source) +
              "? (`trainmem models` lists the catalog; a path to a config.json or model directory also works)");
}

std::vector<CatalogEntry> catalog() {
  std::vector<CatalogEntry> out;
  for (const auto& e : model_index()) {
    Model m = load_model(e.name);
    out.push_back({e.name, e.hf_id, m.parameter_count, std::string(family_name(m.arch.family))});
  }
  return out;
}

std::vector<Gpu> gpus() {
  static const std::vector<Gpu> kGpus = [] {
    std::vector<Gpu> out;
    const json doc = json::parse(data_file("gpus.json"));  // must outlive the loop
    for (const auto& g : doc.at("gpus")) {
      Gpu x;
      x.name = g.at("name").get<std::string>();
      x.description = g.at("description").get<std::string>();
      x.sm = g.at("sm").get<unsigned>();
      x.capacity_bytes = g.at("capacity_bytes").get<std::uint64_t>();
      x.context_bytes = g.at("context_bytes").get<std::uint64_t>();
      x.cublas_workspace_bytes = g.at("cublas_workspace_bytes").get<std::uint64_t>();
      x.half_tflops = g.at("half_tflops").get<double>();
      x.bf16 = g.at("bf16").get<bool>();
      x.fp32_tflops = g.at("fp32_tflops").get<double>();
      x.memory_gbps = g.at("memory_gbps").get<double>();
      x.interconnect = g.at("interconnect").get<std::string>();
      x.interconnect_gbps = g.at("interconnect_gbps").get<double>();
      x.host_gbps = g.at("host_gbps").get<double>();
      out.push_back(std::move(x));
    }
    return out;
  }();
  return kGpus;
}

const Gpu& find_gpu(std::string_view name) {
  static const std::vector<Gpu> kGpus = gpus();
  std::string key = lower(name);
  for (const auto& g : kGpus) {
    if (g.name == key) return g;
  }
  std::string names;
  for (const auto& g : kGpus) names += (names.empty() ? "" : ", ") + g.name;
  throw Error("gpu: unknown GPU '" + std::string(name) + "'; known: " + names);
}

}  // namespace trainmem
