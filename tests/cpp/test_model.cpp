// Tests for the model stage (include/trainmem/trainmem.h "Models", src/model/model.h): the
// catalog against data/models/param_counts.json (counted from the real Hugging Face modules by
// tools/param_counts.py, see its "provenance"), name resolution, config.json parsing with its
// exact error messages, and safetensors headers.

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <typeinfo>
#include <unistd.h>
#include <utility>
#include <vector>

#include "model/model.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using nlohmann::json;

using testing::error_of;

const json& param_counts() {
  static const json kDoc = [] {
    std::ifstream in(std::string(TRAINMEM_DATA_DIR) + "/models/param_counts.json");
    EXPECT_TRUE(in.good()) << "cannot open param_counts.json under " << TRAINMEM_DATA_DIR;
    return json::parse(in);
  }();
  return kDoc;
}

std::uint64_t numel_of(const json& shape) {
  std::uint64_t n = 1;
  for (const auto& d : shape) n *= d.get<std::uint64_t>();
  return n;
}

// ---- the catalog against the real modules ---------------------------------------------------

TEST(ModelCatalog, ListsExactlyTheCountedModels) {
  std::set<std::string> counted, listed;
  for (const auto& m : param_counts().at("models")) counted.insert(m.at("name").get<std::string>());
  for (const auto& e : catalog()) listed.insert(e.name);
  EXPECT_EQ(listed, counted);
  EXPECT_EQ(counted.size(), 15u);
}

TEST(ModelCatalog, ParameterCountsMatchTheRealModules) {
  for (const auto& ref : param_counts().at("models")) {
    const std::string name = ref.at("name").get<std::string>();
    SCOPED_TRACE(name);
    const Model m = load_model(name);
    EXPECT_EQ(m.parameter_count, ref.at("parameters").get<std::uint64_t>());
    EXPECT_EQ(model::count_parameters(m.parameters), m.parameter_count);
    EXPECT_EQ(m.hf_id, ref.at("hf_id").get<std::string>());
    EXPECT_EQ(m.name, name);
    EXPECT_EQ(m.arch.model_type, ref.at("model_type").get<std::string>());
    EXPECT_FALSE(m.from_safetensors);
  }
}

TEST(ModelCatalog, CatalogEntriesCarryTheCounts) {
  std::map<std::string, std::uint64_t> ref;
  for (const auto& m : param_counts().at("models"))
    ref[m.at("name").get<std::string>()] = m.at("parameters").get<std::uint64_t>();
  for (const auto& e : catalog()) {
    SCOPED_TRACE(e.name);
    EXPECT_EQ(e.parameter_count, ref.at(e.name));
    EXPECT_EQ(e.family, family_name(load_model(e.name).arch.family));
  }
}

TEST(ModelCatalog, DimensionsMatchTheRealConfigs) {
  for (const auto& ref : param_counts().at("models")) {
    SCOPED_TRACE(ref.at("name").get<std::string>());
    const Architecture a = load_model(ref.at("name").get<std::string>()).arch;
    const json& d = ref.at("dims");
    EXPECT_EQ(a.hidden_size, d.at("hidden_size").get<std::uint64_t>());
    EXPECT_EQ(a.num_layers, d.at("num_hidden_layers").get<std::uint64_t>());
    EXPECT_EQ(a.num_heads, d.at("num_attention_heads").get<std::uint64_t>());
    EXPECT_EQ(a.num_kv_heads, d.at("num_key_value_heads").get<std::uint64_t>());
    EXPECT_EQ(a.head_dim, d.at("head_dim").get<std::uint64_t>());
    EXPECT_EQ(a.intermediate_size, d.at("intermediate_size").get<std::uint64_t>());
    EXPECT_EQ(a.vocab_size, d.at("vocab_size").get<std::uint64_t>());
    EXPECT_EQ(a.max_positions, d.at("max_position_embeddings").get<std::uint64_t>());
    EXPECT_EQ(a.tie_word_embeddings, ref.at("tie_word_embeddings").get<bool>());
    // A config without a dtype key loads in fp32.
    const json& dt = ref.at("config_torch_dtype");
    EXPECT_EQ(dtype_name(a.torch_dtype), dt.is_null() ? "float32" : dt.get<std::string>());
  }
}

// Model::parameters lists each decoder-layer tensor once with count = num_layers and every
// other tensor with count 1; names are the module paths with the layer index written "N".
TEST(ModelCatalog, ParameterGroupsMatchTheRealTensors) {
  for (const auto& ref : param_counts().at("models")) {
    const std::string name = ref.at("name").get<std::string>();
    SCOPED_TRACE(name);
    const Model m = load_model(name);
    const json& layers = ref.at("layers");
    ASSERT_TRUE(layers.at("uniform").get<bool>());
    const std::uint64_t L = layers.at("count").get<std::uint64_t>();
    const std::string prefix = layers.at("prefix").get<std::string>() + ".N.";

    std::map<std::string, std::uint64_t> want_layer, want_top, got_layer, got_top;
    for (const auto& t : ref.at("layer0_tensors")) want_layer[t.at("name")] = numel_of(t.at("shape"));
    for (const auto& t : ref.at("non_layer_tensors")) want_top[t.at("name")] = numel_of(t.at("shape"));

    std::uint64_t per_layer = 0, top = 0;
    for (const ParameterGroup& g : m.parameters) {
      if (g.count == 1) {
        EXPECT_TRUE(got_top.emplace(g.name, g.numel).second) << "listed twice: " << g.name;
        top += g.numel;
        continue;
      }
      EXPECT_EQ(g.count, L) << g.name;
      ASSERT_EQ(g.name.rfind(prefix, 0), 0u) << g.name << " lacks the prefix " << prefix;
      EXPECT_TRUE(got_layer.emplace(g.name.substr(prefix.size()), g.numel).second) << "listed twice: " << g.name;
      per_layer += g.numel;
    }
    EXPECT_EQ(got_layer, want_layer);
    EXPECT_EQ(got_top, want_top);
    EXPECT_EQ(got_layer.size(), layers.at("tensors_per_layer").get<std::size_t>());
    EXPECT_EQ(per_layer, layers.at("parameters_per_layer").get<std::uint64_t>());
    EXPECT_EQ(top, ref.at("non_layer_parameters").get<std::uint64_t>());
    EXPECT_EQ(got_layer.size() * L + got_top.size(), ref.at("parameter_tensors").get<std::size_t>());
  }
}

// matmul_weight marks the tensors a matmul consumes (autocast casts them; §3.1 of
// MEMORY_MECHANICS): every 2-D tensor except the embedding tables, plus the input embedding when
// the lm_head is tied to it. Norm weights and biases are 1-D.
TEST(ModelCatalog, MatmulWeightsAreThe2dProjections) {
  for (const auto& ref : param_counts().at("models")) {
    const std::string name = ref.at("name").get<std::string>();
    SCOPED_TRACE(name);
    const bool tied = ref.at("tie_word_embeddings").get<bool>();
    std::map<std::string, bool> want;
    auto expect_for = [&](const json& t, const std::string& full) {
      const bool two_d = t.at("shape").size() == 2;
      const bool embedding = full.find("embed_tokens") != std::string::npos ||
                             full.find(".wte.") != std::string::npos;
      const bool positions = full.find(".wpe.") != std::string::npos;
      want[full] = two_d && !positions && (!embedding || tied);
    };
    const std::string prefix = ref.at("layers").at("prefix").get<std::string>() + ".N.";
    for (const auto& t : ref.at("layer0_tensors")) expect_for(t, prefix + t.at("name").get<std::string>());
    for (const auto& t : ref.at("non_layer_tensors")) expect_for(t, t.at("name").get<std::string>());
    std::map<std::string, bool> got;
    for (const ParameterGroup& g : load_model(name).parameters) got[g.name] = g.matmul_weight;
    EXPECT_EQ(got, want);
  }
}

// ---- name resolution ----------------------------------------------------------------------

TEST(ModelLookup, ByAlias) {
  const Model m = load_model("gpt2-small");
  EXPECT_EQ(m.name, "gpt2");
  EXPECT_EQ(m.hf_id, "openai-community/gpt2");
  EXPECT_EQ(m.parameter_count, 124439808u);
  EXPECT_EQ(load_model("llama3.1-8b").name, "llama-3.1-8b");
  EXPECT_EQ(load_model("LLAMA3.2-1B").name, "llama-3.2-1b");
}

TEST(ModelLookup, ByHuggingFaceId) {
  const Model m = load_model("Qwen/Qwen3-4B");
  EXPECT_EQ(m.name, "qwen3-4b");
  EXPECT_EQ(m.hf_id, "Qwen/Qwen3-4B");
  EXPECT_EQ(m.parameter_count, 4022468096u);
  EXPECT_EQ(load_model("qwen/qwen3-4b").name, "qwen3-4b");  // Hub ids are case-insensitive
  EXPECT_EQ(load_model("microsoft/Phi-3-mini-4k-instruct").name, "phi-3-mini-4k-instruct");
}

TEST(ModelLookup, ByNameIgnoringCase) {
  EXPECT_EQ(load_model("Mistral-7B-v0.3").name, "mistral-7b-v0.3");
  EXPECT_EQ(load_model("Mistral-7B-v0.3").parameter_count, 7248023552u);
}

TEST(ModelLookup, UnknownNameSuggestsTheClosestNames) {
  // Edit distance: qwen3-4b and qwen3-8b are one substitution away, qwen3-0.6b three edits.
  EXPECT_EQ(error_of([] { load_model("qwen3-5b"); }),
            "unknown model 'qwen3-5b'; did you mean: qwen3-4b, qwen3-8b, qwen3-0.6b? (`trainmem "
            "models` lists the catalog; a path to a config.json or model directory also works)");
}

TEST(ModelLookup, UnknownNameThatIsAPrefixSuggestsItsCompletions) {
  // Every catalog name containing "llama" ranks first; ties are broken by name.
  EXPECT_EQ(error_of([] { load_model("llama"); }),
            "unknown model 'llama'; did you mean: llama-3.1-70b, llama-3.1-8b, llama-3.2-1b? "
            "(`trainmem models` lists the catalog; a path to a config.json or model directory "
            "also works)");
}

TEST(ModelLookup, EmptyName) {
  EXPECT_EQ(error_of([] { load_model(""); }), "model: empty name; run `trainmem models` for the catalog");
}

// ---- config.json --------------------------------------------------------------------------

json llama_config() {
  return json{{"model_type", "llama"},        {"hidden_size", 256},       {"intermediate_size", 688},
              {"num_hidden_layers", 2},       {"num_attention_heads", 8}, {"num_key_value_heads", 2},
              {"vocab_size", 1000},           {"max_position_embeddings", 2048}, {"pad_token_id", nullptr}};
}

json gpt2_config() {
  return json{{"model_type", "gpt2"}, {"n_embd", 768},     {"n_layer", 2},
              {"n_head", 12},         {"vocab_size", 50257}, {"n_positions", 1024}};
}

Model from(const json& j) { return model_from_config_json(j.dump()); }
std::string error_from(const json& j) { return error_of([&] { from(j); }); }
std::string error_from_text(std::string_view text) { return error_of([&] { model_from_config_json(text); }); }

std::map<std::string, std::uint64_t> numels(const Model& m) {
  std::map<std::string, std::uint64_t> out;
  for (const auto& g : m.parameters) out[g.name] = g.numel * g.count;
  return out;
}

TEST(ModelConfig, SmallLlamaParameters) {
  const Model m = from(llama_config());
  EXPECT_EQ(m.name, "config.json");
  EXPECT_EQ(m.hf_id, "");
  EXPECT_EQ(m.arch.family, Family::kLlama);
  EXPECT_EQ(m.arch.head_dim, 32u);
  EXPECT_EQ(m.arch.torch_dtype, DType::kF32);  // no dtype key: the model loads in fp32
  // embed 1000·256; per layer: q 256·256, k,v 64·256 each, o 256·256, gate/up/down 688·256
  // each, two norms of 256; final norm 256; untied lm_head 1000·256.
  const std::uint64_t per_layer = 2 * 65536 + 2 * 16384 + 3 * 176128 + 2 * 256;
  EXPECT_EQ(m.parameter_count, 256000u + 2 * per_layer + 256 + 256000);
  EXPECT_EQ(m.parameter_count, 1897728u);
}

TEST(ModelConfig, DefaultsOfTheHuggingFaceConfigClasses) {
  json j = llama_config();
  j.erase("num_key_value_heads");
  j.erase("max_position_embeddings");
  const Model m = from(j);
  EXPECT_EQ(m.arch.num_kv_heads, 8u);      // LlamaConfig: num_key_value_heads = num_attention_heads
  EXPECT_EQ(m.arch.max_positions, 2048u);  // LlamaConfig default
  EXPECT_FALSE(m.arch.tie_word_embeddings);

  const Model g = from(gpt2_config());
  EXPECT_EQ(g.arch.intermediate_size, 3072u);  // n_inner = None → 4 · n_embd
  EXPECT_TRUE(g.arch.tie_word_embeddings);
  json gj = gpt2_config();
  gj["n_inner"] = nullptr;  // written out as null in the published gpt2 config
  EXPECT_EQ(from(gj).arch.intermediate_size, 3072u);
}

TEST(ModelConfig, NullMeansAbsent) {
  json j = llama_config();
  j["head_dim"] = nullptr;  // Mistral-style configs write "head_dim": null
  EXPECT_EQ(from(j).arch.head_dim, 32u);
  j["num_key_value_heads"] = nullptr;
  EXPECT_EQ(from(j).arch.num_kv_heads, 8u);
}

TEST(ModelConfig, WholeFloatsAreAccepted) {
  json j = llama_config();
  j["hidden_size"] = 256.0;
  EXPECT_EQ(from(j).arch.hidden_size, 256u);
}

TEST(ModelConfig, DtypeKeys) {
  json j = llama_config();
  j["torch_dtype"] = "bfloat16";
  EXPECT_EQ(from(j).arch.torch_dtype, DType::kBF16);
  j["dtype"] = "float16";  // transformers 5 writes "dtype"; it wins over torch_dtype
  EXPECT_EQ(from(j).arch.torch_dtype, DType::kF16);
  j["dtype"] = "int8";
  EXPECT_EQ(error_from(j), "config.json: field 'dtype' has unsupported dtype 'int8'; expected float32, "
                           "bfloat16 or float16");
  j.erase("dtype");
  j["torch_dtype"] = 16;
  EXPECT_EQ(error_from(j), "config.json: field 'torch_dtype' must be a string, got 16");
}

TEST(ModelConfig, MissingField) {
  json j = llama_config();
  j.erase("hidden_size");
  EXPECT_EQ(error_from(j), "config.json: missing field 'hidden_size'");
  j = llama_config();
  j["vocab_size"] = nullptr;
  EXPECT_EQ(error_from(j), "config.json: missing field 'vocab_size'");
  json g = gpt2_config();
  g.erase("n_positions");
  EXPECT_EQ(error_from(g), "config.json: missing field 'n_positions'");
}

TEST(ModelConfig, MissingModelType) {
  json j = llama_config();
  j.erase("model_type");
  EXPECT_EQ(error_from(j), "config.json: missing field 'model_type' (expected one of gpt2, llama, "
                           "mistral, qwen2, qwen3, gemma2, phi3)");
  j["model_type"] = 5;
  EXPECT_EQ(error_from(j), "config.json: field 'model_type' must be a string, got 5");
}

TEST(ModelConfig, WrongType) {
  json j = llama_config();
  j["hidden_size"] = "256";
  EXPECT_EQ(error_from(j), "config.json: field 'hidden_size' must be a positive integer, got \"256\"");
  j["hidden_size"] = true;
  EXPECT_EQ(error_from(j), "config.json: field 'hidden_size' must be a positive integer, got true");
  j["hidden_size"] = json::array({256});
  // Containers are described by kind: a deeply nested value must not be dumped into a message.
  EXPECT_EQ(error_from(j), "config.json: field 'hidden_size' must be a positive integer, got an array");
  j = llama_config();
  j["tie_word_embeddings"] = "true";
  EXPECT_EQ(error_from(j), "config.json: field 'tie_word_embeddings' must be true or false, got \"true\"");
}

TEST(ModelConfig, ZeroAndNegative) {
  json j = llama_config();
  j["num_hidden_layers"] = 0;
  EXPECT_EQ(error_from(j), "config.json: field 'num_hidden_layers' must be between 1 and 100000, got 0");
  j = llama_config();
  j["hidden_size"] = -256;
  EXPECT_EQ(error_from(j), "config.json: field 'hidden_size' must be at least 1, got -256");
  j = llama_config();
  j["num_attention_heads"] = 0.0;
  EXPECT_EQ(error_from(j), "config.json: field 'num_attention_heads' must be between 1 and 16777216, got 0.0");
  j = llama_config();
  j["head_dim"] = 0;
  EXPECT_EQ(error_from(j), "config.json: field 'head_dim' must be between 1 and 16777216, got 0");
}

TEST(ModelConfig, FloatWhereAnIntegerIsNeeded) {
  json j = llama_config();
  j["intermediate_size"] = 688.5;
  EXPECT_EQ(error_from(j), "config.json: field 'intermediate_size' must be a whole number, got 688.5");
}

TEST(ModelConfig, Gpt2HeadsMustDivideTheWidth) {
  json j = gpt2_config();
  j["n_head"] = 5;
  EXPECT_EQ(error_from(j), "config.json: n_head=5 does not divide n_embd=768 (GPT-2 splits the width "
                           "evenly across heads)");
}

TEST(ModelConfig, LlamaWidthMustSplitWithoutHeadDim) {
  json j = llama_config();
  j["hidden_size"] = 1000;
  j["num_attention_heads"] = 12;
  j["num_key_value_heads"] = 4;
  EXPECT_EQ(error_from(j), "config.json: num_attention_heads=12 does not divide hidden_size=1000 and "
                           "no head_dim is given");
}

// With head_dim set, the q/k/v widths are heads · head_dim and need not equal hidden_size
// (LlamaAttention: q_proj = Linear(hidden, heads·head_dim), o_proj = Linear(heads·head_dim, hidden)).
TEST(ModelConfig, LlamaHeadDimNeedNotDivideTheWidth) {
  json j = llama_config();
  j["hidden_size"] = 1000;
  j["num_attention_heads"] = 12;
  j["num_key_value_heads"] = 4;
  j["head_dim"] = 64;
  const Model m = from(j);
  EXPECT_EQ(m.arch.head_dim, 64u);
  const auto n = numels(m);
  EXPECT_EQ(n.at("model.layers.N.self_attn.q_proj.weight"), 2u * 768 * 1000);
  EXPECT_EQ(n.at("model.layers.N.self_attn.k_proj.weight"), 2u * 256 * 1000);
  EXPECT_EQ(n.at("model.layers.N.self_attn.v_proj.weight"), 2u * 256 * 1000);
  EXPECT_EQ(n.at("model.layers.N.self_attn.o_proj.weight"), 2u * 1000 * 768);
  EXPECT_EQ(n.at("model.layers.N.mlp.gate_proj.weight"), 2u * 688 * 1000);
  // embed + 2 layers (q 768000, k/v 256000 each, o 768000, mlp 3 · 688000, norms 2 · 1000)
  // + final norm + lm_head.
  EXPECT_EQ(m.parameter_count, 1000u * 1000 + 2 * (2 * 768000 + 2 * 256000 + 3 * 688000 + 2000) + 1000 +
                                   1000 * 1000);
}

TEST(ModelConfig, KvHeadsMustDivideHeads) {
  json j = llama_config();
  j["num_key_value_heads"] = 3;
  EXPECT_EQ(error_from(j), "config.json: num_attention_heads=8 is not a multiple of num_key_value_heads=3");
}

TEST(ModelConfig, UnsupportedModelType) {
  json j = llama_config();
  j["model_type"] = "falcon";
  EXPECT_EQ(error_from(j), "config.json: unsupported model_type 'falcon'; supported: gpt2, llama, "
                           "mistral, qwen2, qwen3, gemma2, phi3");
}

TEST(ModelConfig, UnsupportedActivation) {
  json j = llama_config();
  j["hidden_act"] = "relu2";  // ReLUSquaredActivation
  EXPECT_EQ(error_from(j), "config.json: field 'hidden_act' has unsupported activation 'relu2' (modelled: silu, "
                          "swish, gelu, gelu_pytorch_tanh, gelu_new, relu)");
  j["hidden_act"] = "relu";  // nn.ReLU (corpus: *relu-*)
  EXPECT_EQ(from(j).arch.activation, Activation::kRelu);
  j["hidden_act"] = "gelu_fast";  // FastGELUActivation's own formula
  EXPECT_NE(error_from(j).find("unsupported activation 'gelu_fast'"), std::string::npos);
}

// The activation follows the config's name, as transformers' ACT2CLS does, not the family: a
// probe measured a Llama cut with gelu_new 20 % above the one-op estimate, and a GPT-2 cut with
// gelu_pytorch_tanh 20 % below the formula's (corpus: *gelunew*, *gelupt*, *gelu-*).
TEST(ModelConfig, TheActivationIsTheConfigsNotTheFamilys) {
  json j = llama_config();
  EXPECT_EQ(from(j).arch.activation, Activation::kSilu);
  j["hidden_act"] = "gelu_new";
  const Model gelu_new = from(j);
  EXPECT_EQ(gelu_new.arch.activation, Activation::kGeluNew);
  j["hidden_act"] = "gelu";
  const Model gelu = from(j);
  EXPECT_EQ(gelu.arch.activation, Activation::kGelu);
  json g = gpt2_config();
  EXPECT_EQ(from(g).arch.activation, Activation::kGeluNew);  // GPT2Config's default
  g["activation_function"] = "gelu_pytorch_tanh";
  EXPECT_EQ(from(g).arch.activation, Activation::kGelu);
  // NewGELUActivation's formula saves more than F.gelu: the peak of a step rises.
  Recipe r;
  r.seq = 256;
  r.precision = Precision::kFp32;
  r.optimizer = Optimizer::kSgd;
  EXPECT_GT(estimate(gelu_new, r).breakdown_at_peak[static_cast<std::size_t>(Category::kActivations)],
            estimate(gelu, r).breakdown_at_peak[static_cast<std::size_t>(Category::kActivations)]);
}

// Config settings whose memory is not modelled are refused where they take effect.
TEST(ModelConfig, UpcastAttentionAndRescaledRopeAreRefusedWhereTheyAct) {
  json g = gpt2_config();
  g["reorder_and_upcast_attn"] = true;
  const Model gpt2 = from(g);
  Recipe r;
  r.seq = 128;
  r.attention = Attention::kEager;
  EXPECT_NE(error_of([&] { estimate(gpt2, r); }).find("reorder_and_upcast_attn"), std::string::npos);
  r.attention = Attention::kSdpa;  // only eager upcasts
  EXPECT_NO_THROW(estimate(gpt2, r));
  r.attention = Attention::kEager;
  r.precision = Precision::kFp32;  // nothing to upcast
  EXPECT_NO_THROW(estimate(gpt2, r));
  json j = llama_config();
  j["max_position_embeddings"] = 64;
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  const Model dynamic = from(j);
  Recipe d;
  d.seq = 64;
  EXPECT_NO_THROW(estimate(dynamic, d));
  d.seq = 65;
  EXPECT_NE(error_of([&] { estimate(dynamic, d); }).find("replaces inv_freq past 64 positions"), std::string::npos);
  // rope_type wins over the legacy type; longrope switches past original_max_position_embeddings,
  // the rope dict's first, and Phi3Config's own top-level one (4096 by default) always.
  j["rope_scaling"] = {{"rope_type", "default"}, {"type", "dynamic"}};
  EXPECT_EQ(from(j).arch.rope_rescales_past, 0u);
  j["max_position_embeddings"] = 131072;
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"original_max_position_embeddings", 8192}};
  EXPECT_EQ(from(j).arch.rope_rescales_past, 8192u);
  j["model_type"] = "phi3";
  EXPECT_EQ(from(j).arch.rope_rescales_past, 4096u);
  j["original_max_position_embeddings"] = 2048;
  EXPECT_EQ(from(j).arch.rope_rescales_past, 2048u);
  // fit leaves out a backend the model refuses instead of failing.
  FitRequest q;
  q.base.seq = 512;
  q.base.batch = 2;
  q.global_batch = 2;
  EXPECT_NO_THROW(fit(gpt2, q));
}

// Note [Config class defaults]: a key left out takes the family's class default, a null the
// derived value (a probe: Gemma-2 without head_dim was 123.5 MB measured against 67.2 MB).
TEST(ModelConfig, LeftOutKeysTakeTheirConfigClassDefaults) {
  json j = llama_config();  // 8 heads, hidden 256
  j.erase("num_key_value_heads");
  EXPECT_EQ(from(j).arch.num_kv_heads, 8u);  // LlamaConfig: the attention heads
  j["model_type"] = "mistral";
  EXPECT_EQ(from(j).arch.num_kv_heads, 8u);  // MistralConfig: 8
  EXPECT_EQ(from(j).arch.max_positions, 2048u);  // set in llama_config()
  j["model_type"] = "gemma2";
  const Model g = from(j);
  EXPECT_EQ(g.arch.num_kv_heads, 4u);
  EXPECT_EQ(g.arch.head_dim, 256u);
  EXPECT_EQ(g.arch.attn_logit_softcap, 50.0);
  EXPECT_EQ(g.arch.final_logit_softcap, 30.0);
  j["head_dim"] = nullptr;  // None: hidden_size / heads
  EXPECT_EQ(from(j).arch.head_dim, 32u);
  j["model_type"] = "qwen3";
  j.erase("head_dim");
  j["num_key_value_heads"] = 8;
  EXPECT_EQ(from(j).arch.head_dim, 128u);
  j.erase("num_key_value_heads");  // Qwen3Config: 32, which 8 heads cannot share (transformers fails)
  EXPECT_NE(error_from(j).find("num_key_value_heads=32"), std::string::npos);
  j["num_key_value_heads"] = nullptr;
  EXPECT_EQ(from(j).arch.num_kv_heads, 8u);
}

// Config values transformers fails on, or handles in ways not modelled, are refused (a probe of
// the config classes and modeling files, each measured or run).
TEST(ModelConfig, ValuesTransformersFailsOnAreRefused) {
  json j = llama_config();
  j["head_dim"] = 63;
  EXPECT_NE(error_from(j).find("head_dim 63 is odd"), std::string::npos);
  j = llama_config();
  j["pad_token_id"] = 1000;
  EXPECT_NE(error_from(j).find("pad_token_id 1000 is not below vocab_size 1000"), std::string::npos);
  j.erase("pad_token_id");
  j["model_type"] = "phi3";  // Phi3Config's pad_token_id is 32000
  EXPECT_NE(error_from(j).find("(the config class's default)"), std::string::npos);
  j["pad_token_id"] = nullptr;
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  EXPECT_NE(error_from(j).find("rope_type 'linear' is not one transformers takes for Phi-3"), std::string::npos);
  j["rope_scaling"] = {{"type", "su"}};  // Phi3Config's old name for longrope
  EXPECT_EQ(from(j).arch.rope_rescales_past, 4096u);
  j = llama_config();
  j["rope_scaling"] = {{"rope_type", "foo"}};
  EXPECT_NE(error_from(j).find("rope_type 'foo'"), std::string::npos);
  j = llama_config();
  j["return_dict"] = false;
  EXPECT_NE(error_from(j).find("return_dict false"), std::string::npos);
  j = llama_config();
  j["model_type"] = "gemma2";
  j["sliding_window"] = nullptr;
  EXPECT_NE(error_from(j).find("sliding_window null"), std::string::npos);
  json g = gpt2_config();
  g["add_cross_attention"] = true;
  EXPECT_NE(error_from(g).find("add_cross_attention"), std::string::npos);
  // Generation settings in config.json: refused in generation, nothing to training.
  j = llama_config();
  j["prefill_chunk_size"] = 16;
  const Model chunked = from(j);
  Recipe r;
  r.seq = 64;
  EXPECT_NO_THROW(estimate(chunked, r));
  r.mode = Mode::kInference;
  r.precision = Precision::kFp32;
  r.new_tokens = 4;
  EXPECT_NE(error_of([&] { estimate(chunked, r); }).find("prefill_chunk_size changes what generate() does"),
            std::string::npos);
}

// Gemma-2 reads hidden_activation; a hidden_act beside it is never used, so never refused.
TEST(ModelConfig, GemmaTwoIgnoresHiddenAct) {
  json j = llama_config();
  j["model_type"] = "gemma2";
  j["hidden_act"] = "gelu_fast";
  EXPECT_EQ(from(j).arch.activation, Activation::kGelu);
}

TEST(ModelConfig, NegativeSoftcap) {
  json j = llama_config();
  j["model_type"] = "gemma2";
  j["final_logit_softcapping"] = -1;
  EXPECT_EQ(error_from(j), "config.json: field 'final_logit_softcapping' must be a finite number ≥ 0, got -1");
}

TEST(ModelConfig, DropoutProbabilitiesFollowEachConfigClass) {
  // GPT2Config's attn_pdrop, resid_pdrop and embd_pdrop default to 0.1; the Llama family's
  // attention_dropout and Phi-3's resid_pdrop to 0 (Note [Dropout probabilities]).
  using P = std::array<double, 3>;  // attention, residual, embedding
  auto dropouts = [](const json& j) {
    const Architecture a = from(j).arch;
    return P{a.attn_dropout, a.resid_dropout, a.embd_dropout};
  };
  EXPECT_EQ(dropouts(gpt2_config()), (P{0.1, 0.1, 0.1}));
  json gj = gpt2_config();
  gj["attn_pdrop"] = 0;
  gj["resid_pdrop"] = 0.2;
  gj["embd_pdrop"] = nullptr;  // null: the class default
  EXPECT_EQ(dropouts(gj), (P{0, 0.2, 0.1}));
  EXPECT_EQ(dropouts(llama_config()), (P{0, 0, 0}));
  json lj = llama_config();
  lj["attention_dropout"] = 0.1;
  lj["resid_pdrop"] = 0.3;  // not a Llama key: ignored
  EXPECT_EQ(dropouts(lj), (P{0.1, 0, 0}));
  lj["model_type"] = "phi3";
  EXPECT_EQ(dropouts(lj), (P{0.1, 0.3, 0}));
}

TEST(ModelConfig, DropoutProbabilitiesMustBeBelowOne) {
  json g = gpt2_config();
  g["attn_pdrop"] = 1;
  EXPECT_EQ(error_from(g), "config.json: field 'attn_pdrop' is a dropout probability and must be below 1, got 1");
  g["attn_pdrop"] = -0.1;
  EXPECT_EQ(error_from(g), "config.json: field 'attn_pdrop' must be a finite number ≥ 0, got -0.1");
  json l = llama_config();
  l["attention_dropout"] = "0.1";
  EXPECT_EQ(error_from(l), "config.json: field 'attention_dropout' must be a number, got \"0.1\"");
}

TEST(ModelConfig, NanAndInfinityAreNotJson) {
  // Python's json.dump writes NaN and Infinity; they are not JSON and nlohmann rejects them.
  EXPECT_EQ(error_from_text(R"({"model_type": "llama", "hidden_size": NaN})"), "config.json: not valid JSON");
  EXPECT_EQ(error_from_text(R"({"model_type": "llama", "hidden_size": Infinity})"),
            "config.json: not valid JSON");
  EXPECT_EQ(error_of([] { model_from_config_json("{\"model_type\": ", "some/dir/config.json"); }),
            "some/dir/config.json: not valid JSON");
  EXPECT_EQ(error_from_text("[1, 2]"), "config.json: expected a JSON object at the top level");
}

TEST(ModelConfig, DimensionsOverTheLimit) {
  json j = llama_config();
  j["hidden_size"] = 16777216;  // 2^24 is the largest accepted dimension
  EXPECT_EQ(from(j).arch.hidden_size, 16777216u);
  j["hidden_size"] = 16777217;
  EXPECT_EQ(error_from(j), "config.json: field 'hidden_size' must be between 1 and 16777216, got 16777217");
  j = llama_config();
  j["vocab_size"] = 1e30;
  EXPECT_EQ(error_from(j), "config.json: field 'vocab_size' must be between 1 and 16777216, got 1e+30");
  j = llama_config();
  j["intermediate_size"] = std::uint64_t{18446744073709551615u};
  EXPECT_EQ(error_from(j),
            "config.json: field 'intermediate_size' must be between 1 and 16777216, got 18446744073709551615");
  j = llama_config();
  j["num_hidden_layers"] = 100001;
  EXPECT_EQ(error_from(j), "config.json: field 'num_hidden_layers' must be between 1 and 100000, got 100001");
  j = llama_config();
  j["max_position_embeddings"] = 4294967296;  // context lengths may exceed 2^24
  EXPECT_EQ(from(j).arch.max_positions, 4294967296u);
  j["max_position_embeddings"] = 4294967297;
  EXPECT_EQ(error_from(j),
            "config.json: field 'max_position_embeddings' must be between 1 and 4294967296, got 4294967297");
}

// Rotary embeddings over part of each head are refused where transformers would read the factor:
// rope_parameters (and the legacy rope_scaling) for every family, the top level for Phi-3.
TEST(ModelConfig, PartialRotaryFactorIsRefused) {
  json j = llama_config();
  j["rope_parameters"] = {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}};
  EXPECT_EQ(error_from(j), "config.json: rope_parameters.partial_rotary_factor 0.5 (a rotary embedding over part "
                           "of each head) is not modelled; only 1.0 is");
  j["rope_parameters"]["partial_rotary_factor"] = 1.0;
  EXPECT_NO_THROW(from(j));
  j["partial_rotary_factor"] = 0.75;  // a key LlamaConfig does not read
  EXPECT_NO_THROW(from(j));
  j["model_type"] = "phi3";
  EXPECT_NO_THROW(from(j));  // Phi3Config keeps rope_parameters' 1.0 (setdefault)
  j.erase("rope_parameters");
  EXPECT_NE(error_from(j).find("config.json: partial_rotary_factor 0.75"), std::string::npos);
  j["partial_rotary_factor"] = "half";
  EXPECT_EQ(error_from(j), "config.json: field 'partial_rotary_factor' must be a number, got \"half\"");
}

TEST(ModelConfig, ParameterCountOverflowIsAnError) {
  // Every dimension within its limit, but 100000 layers of 2^48-element projections overflow.
  json j = llama_config();
  j["hidden_size"] = 16777216;
  j["intermediate_size"] = 16777216;
  j["num_attention_heads"] = 1;
  j["num_key_value_heads"] = 1;
  j["num_hidden_layers"] = 100000;
  EXPECT_EQ(error_from(j), "parameter count overflows a 64-bit byte count; use smaller sizes");
}

TEST(ModelConfig, LoadsFromAPathAndADirectory) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("trainmem_test_model_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_EQ(error_of([&] { load_model(dir.string()); }), dir.string() + ": directory has no config.json");
  {
    std::ofstream(dir / "config.json") << llama_config().dump();
  }
  const Model by_path = load_model((dir / "config.json").string());
  EXPECT_EQ(by_path.name, (dir / "config.json").string());
  EXPECT_EQ(by_path.parameter_count, 1897728u);
  const Model by_dir = load_model(dir.string());
  EXPECT_EQ(by_dir.name, dir.string());
  EXPECT_EQ(by_dir.parameter_count, 1897728u);
  EXPECT_FALSE(by_dir.from_safetensors);  // no *.safetensors: counted from the architecture
  {
    std::ofstream(dir / "config.json") << "{\"model_type\": \"llama\", \"hidden_size\": NaN}";
  }
  EXPECT_EQ(error_of([&] { load_model((dir / "config.json").string()); }),
            (dir / "config.json").string() + ": not valid JSON");
  fs::remove_all(dir);
}

// ---- safetensors --------------------------------------------------------------------------

TEST(Safetensors, SumsElementCountsAndFindsTheDominantDtype) {
  const auto s = model::parse_safetensors_header(R"({
    "__metadata__": {"format": "pt"},
    "model.embed_tokens.weight": {"dtype": "BF16", "shape": [1000, 256], "data_offsets": [0, 512000]},
    "model.norm.weight": {"dtype": "F32", "shape": [256], "data_offsets": [512000, 513024]},
    "scalar": {"dtype": "F32", "shape": [], "data_offsets": [513024, 513028]}
  })");
  EXPECT_EQ(s.parameter_count, 256000u + 256 + 1);
  EXPECT_EQ(s.tensor_count, 3u);
  EXPECT_EQ(s.files, 0u);  // parse_safetensors_header does not count files
  EXPECT_EQ(s.dominant_dtype, DType::kBF16);
}

TEST(Safetensors, AccumulatesIntoAPreviousSummary) {
  model::SafetensorsSummary into;
  into.parameter_count = 100;
  into.tensor_count = 2;
  into.files = 1;
  const auto s = model::parse_safetensors_header(
      R"({"a": {"dtype": "F16", "shape": [3, 4], "data_offsets": [0, 24]}})", into);
  EXPECT_EQ(s.parameter_count, 112u);
  EXPECT_EQ(s.tensor_count, 3u);
  EXPECT_EQ(s.files, 1u);
  EXPECT_EQ(s.dominant_dtype, DType::kF16);
}

TEST(Safetensors, MalformedHeaders) {
  EXPECT_EQ(error_of([] { model::parse_safetensors_header("not json"); }),
            "safetensors: header is not a JSON object");
  EXPECT_EQ(error_of([] { model::parse_safetensors_header("[1]"); }), "safetensors: header is not a JSON object");
  EXPECT_EQ(error_of([] { model::parse_safetensors_header(R"({"w": {"dtype": "F32"}})"); }),
            "safetensors: tensor 'w' lacks a dtype or shape");
  EXPECT_EQ(error_of([] { model::parse_safetensors_header(R"({"w": {"shape": [2]}})"); }),
            "safetensors: tensor 'w' lacks a dtype or shape");
  EXPECT_EQ(error_of([] { model::parse_safetensors_header(R"({"w": [1, 2]})"); }),
            "safetensors: tensor 'w' lacks a dtype or shape");
  EXPECT_EQ(error_of([] { model::parse_safetensors_header(R"({"w": {"dtype": "F32", "shape": [2, -1]}})"); }),
            "safetensors: tensor 'w' has a bad shape");
  EXPECT_EQ(error_of([] { model::parse_safetensors_header(R"({"w": {"dtype": "F32", "shape": [2.5]}})"); }),
            "safetensors: tensor 'w' has a bad shape");
  EXPECT_EQ(error_of([] {
              model::parse_safetensors_header(
                  R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296]}})");
            }),
            "safetensors tensor size overflows a 64-bit byte count; use smaller sizes");
}

// A safetensors file: 8-byte little-endian header length, the JSON header, then as many zero
// bytes as its data_offsets reach.
void write_safetensors(const std::filesystem::path& path, const std::string& header) {
  std::ofstream out(path, std::ios::binary);
  std::uint64_t n = header.size();
  for (int k = 0; k < 8; ++k) out.put(static_cast<char>((n >> (8 * k)) & 0xff));
  out << header;
  std::uint64_t data = 0;
  const json j = json::parse(header, nullptr, false);
  if (j.is_object()) {
    for (const auto& [name, t] : j.items()) {
      if (t.is_object() && t.contains("data_offsets") && t["data_offsets"].is_array() &&
          t["data_offsets"].size() == 2 && t["data_offsets"][1].is_number_unsigned()) {
        data = std::max(data, t["data_offsets"][1].get<std::uint64_t>());
      }
    }
  }
  out << std::string(data, '\0');
}

TEST(Safetensors, ADirectoryCountsItsCheckpoint) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("trainmem_test_st_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream(dir / "config.json") << llama_config().dump();
  }
  const std::uint64_t total = from(llama_config()).parameter_count;
  // Two shards holding the architecture's count: the checkpoint's dtype becomes torch_dtype. A
  // rotary inv_freq buffer, which older checkpoints saved, is no parameter.
  write_safetensors(dir / "model-00001-of-00002.safetensors",
                    R"({"a": {"dtype": "BF16", "shape": [1000, 256], "data_offsets": [0, 512000]}})");
  const std::uint64_t rest = total - 256000 - 7;
  const fs::path second = dir / "model-00002-of-00002.safetensors";
  auto second_shard = [&](std::uint64_t c, const std::string& extra = "") {
    write_safetensors(second, R"({"__metadata__": {}, "b": {"dtype": "F32", "shape": [7], "data_offsets": [0, 28]},)"
                              R"( "c": {"dtype": "BF16", "shape": [)" + std::to_string(c) +
                                  R"(], "data_offsets": [28, )" + std::to_string(28 + 2 * c) + "]}" + extra + "}");
  };
  second_shard(rest, R"(, "model.layers.0.self_attn.rotary_emb.inv_freq": {"dtype": "F32", "shape": [16],)"
                     R"( "data_offsets": [0, 64]})");
  const auto s = model::read_safetensors_dir(dir.string());
  EXPECT_EQ(s.files, 2u);
  EXPECT_EQ(s.tensor_count, 4u);
  EXPECT_EQ(s.parameter_count, total);
  EXPECT_EQ(s.dominant_dtype, DType::kBF16);
  const Model m = load_model(dir.string());
  EXPECT_TRUE(m.from_safetensors);
  EXPECT_EQ(m.parameter_count, total);
  EXPECT_EQ(m.arch.torch_dtype, DType::kBF16);
  EXPECT_EQ(m.arch.hidden_size, 256u);

  // A checkpoint that holds another count is not the architecture's: refused, both counts named.
  second_shard(rest + 5);
  EXPECT_EQ(error_of([&] { load_model(dir.string()); }),
            dir.string() + ": the *.safetensors files hold " + std::to_string(total + 5) +
                " parameters, config.json describes " + std::to_string(total) +
                " (tensors the architecture does not have, or a shard missing); give the config.json alone to "
                "estimate the architecture");
  // What from_pretrained loads: the index's shards (a consolidated copy beside them is not read),
  // GPT-2's saved uint8 mask buffers are no parameters.
  second_shard(rest, R"(, "h.0.attn.bias": {"dtype": "U8", "shape": [1, 1, 4, 4], "data_offsets": [0, 16]})");
  write_safetensors(dir / "consolidated.safetensors",
                    R"({"all": {"dtype": "BF16", "shape": [16], "data_offsets": [0, 32]}})");
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",)"
         R"( "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})";
  EXPECT_EQ(load_model(dir.string()).parameter_count, total);
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-00001-of-00003.safetensors"}})";
  EXPECT_EQ(error_of([&] { load_model(dir.string()); }),
            "safetensors: " + (dir / "model-00001-of-00003.safetensors").string() + ", named in " +
                (dir / "model.safetensors.index.json").string() + ", is missing");
  fs::remove(dir / "model.safetensors.index.json");
  fs::remove(dir / "consolidated.safetensors");
  {
    // Tied embeddings with lm_head.weight saved anyway (some exports do): the architecture's count.
    const fs::path tied = dir / "tied";
    fs::create_directories(tied);
    json cfg = llama_config();
    cfg["tie_word_embeddings"] = true;
    std::ofstream(tied / "config.json") << cfg.dump();
    const std::uint64_t n = from(cfg).parameter_count;
    write_safetensors(tied / "model.safetensors",
                      R"({"w": {"dtype": "F32", "shape": [)" + std::to_string(n) + R"(], "data_offsets": [0, )" +
                          std::to_string(4 * n) + R"(]}, "lm_head.weight": {"dtype": "F32", "shape": [1000, 256],)"
                          R"( "data_offsets": [)" + std::to_string(4 * n) + ", " + std::to_string(4 * n + 1'024'000) +
                          "]}}");
    EXPECT_EQ(load_model(tied.string()).parameter_count, n);
  }
  // Quantized dtypes and offsets that do not hold the shape, or lie past the file, are refused.
  write_safetensors(second, R"({"q": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})");
  EXPECT_EQ(error_of([&] { model::read_safetensors_dir(dir.string()); }),
            "safetensors: tensor 'q' is U8; only F32, F16 and BF16 checkpoints are read (for a quantized one, give its "
            "config.json and --load-in-4bit or --load-in-8bit)");
  write_safetensors(second, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 4]}})");
  EXPECT_EQ(error_of([&] { model::read_safetensors_dir(dir.string()); }),
            "safetensors: tensor 'w' has data_offsets [0, 4] that do not hold its shape");
  write_safetensors(second, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}})");
  EXPECT_EQ(error_of([&] { model::read_safetensors_dir(dir.string()); }),
            "safetensors: tensor 'w' has bad data_offsets (expected [begin, end])");
  {
    std::ofstream out(second, std::ios::binary);
    const std::string h = R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})";
    for (int k = 0; k < 8; ++k) out.put(static_cast<char>((h.size() >> (8 * k)) & 0xff));
    out << h << "1234";  // 4 of the 16 data bytes
  }
  EXPECT_EQ(error_of([&] { model::read_safetensors_dir(dir.string()); }),
            "safetensors: tensor 'w' has data_offsets [0, 16] that do not hold its shape within the file");

  // Malformed files name the file and what is wrong.
  const fs::path bad = second;
  write_safetensors(bad, "");
  EXPECT_EQ(error_of([&] { model::read_safetensors_dir(dir.string()); }),
            "safetensors: " + bad.string() + " declares a header of 0 bytes");
  {
    std::ofstream(bad, std::ios::binary) << "abc";
  }
  EXPECT_EQ(error_of([&] { model::read_safetensors_dir(dir.string()); }),
            "safetensors: " + bad.string() + " is shorter than its 8-byte header length");
  {
    std::ofstream out(bad, std::ios::binary);
    const char len[8] = {100, 0, 0, 0, 0, 0, 0, 0};
    out.write(len, 8);
    out << "{\"a\":";
  }
  EXPECT_EQ(error_of([&] { model::read_safetensors_dir(dir.string()); }),
            "safetensors: " + bad.string() + " is truncated inside its header");
  write_safetensors(bad, "{\"a\": 1}");
  EXPECT_EQ(error_of([&] { load_model(dir.string()); }), "safetensors: tensor 'a' lacks a dtype or shape");
  fs::remove_all(dir);
}

// The dominant dtype is the one holding most elements over the whole checkpoint, not over the
// last shard read: here shard 1 holds 256000 BF16 elements, shard 2 seven F32 and six BF16.
TEST(Safetensors, DominantDtypeIsOverAllShards) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("trainmem_test_dom_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  write_safetensors(dir / "model-00001-of-00002.safetensors",
                    R"({"a": {"dtype": "BF16", "shape": [1000, 256], "data_offsets": [0, 512000]}})");
  write_safetensors(dir / "model-00002-of-00002.safetensors",
                    R"({"b": {"dtype": "F32", "shape": [7], "data_offsets": [0, 28]},)"
                    R"( "c": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [28, 40]}})");
  const auto s = model::read_safetensors_dir(dir.string());
  EXPECT_EQ(s.parameter_count, 256013u);
  EXPECT_EQ(s.dominant_dtype, DType::kBF16);
  fs::remove_all(dir);
}

TEST(Safetensors, ADirectoryWithoutCheckpointReadsNothing) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("trainmem_test_empty_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto s = model::read_safetensors_dir(dir.string());
  EXPECT_EQ(s.files, 0u);
  EXPECT_EQ(s.parameter_count, 0u);
  EXPECT_EQ(s.tensor_count, 0u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// Which layers slide, from config.json with each config class's defaults (config.cpp,
// parse_generation_keys): what generate()'s DynamicCache and masks see.
TEST(ModelConfig, AttentionWindowsFollowEachConfigClass) {
  auto windows = [](const std::string& extra, const char* type = "qwen3") {
    const std::string text = std::string(R"({"model_type": ")") + type +
                             R"(", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                 "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100, "pad_token_id": null)" +
                             extra + "}";
    return model::attention_windows(model_from_config_json(text).arch);
  };
  using W = std::vector<std::uint64_t>;
  EXPECT_EQ(windows(""), (W{0, 0, 0, 0}));  // Qwen3 slides only with use_sliding_window
  EXPECT_EQ(windows(R"(, "use_sliding_window": true, "sliding_window": 256, "max_window_layers": 2)"),
            (W{0, 0, 256, 256}));
  // 0 is a count, not a size: every layer slides (transformers takes it).
  EXPECT_EQ(windows(R"(, "use_sliding_window": true, "sliding_window": 256, "max_window_layers": 0)"),
            (W{256, 256, 256, 256}));
  // Qwen2Config keeps sliding_window only under use_sliding_window, and a null one is none.
  EXPECT_EQ(windows(R"(, "use_sliding_window": true, "sliding_window": null, "max_window_layers": 0)"),
            (W{0, 0, 0, 0}));
  EXPECT_EQ(windows(R"(, "use_sliding_window": true, "max_window_layers": 0)"), (W{4096, 4096, 4096, 4096}));
  EXPECT_EQ(windows("", "gemma2"), (W{4096, 0, 4096, 0}));
  EXPECT_EQ(windows(R"(, "sliding_window": null)", "mistral"), (W{0, 0, 0, 0}));
  EXPECT_EQ(windows("", "mistral"), (W{4096, 4096, 4096, 4096}));
  EXPECT_EQ(windows("", "llama"), (W{0, 0, 0, 0}));
  // Phi3Model (and MistralModel) slides on every layer whatever layer_types says; its cache
  // follows layer_types: mixed types are refused.
  EXPECT_EQ(windows(R"(, "sliding_window": 8, "layer_types": ["sliding_attention", "sliding_attention",
                       "sliding_attention", "sliding_attention"])", "phi3"),
            (W{8, 8, 8, 8}));
  EXPECT_NE(testing::error_of([&] {
              windows(R"(, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention",
                         "sliding_attention", "full_attention"])", "mistral");
            }).find("which a mistral model ignores"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { windows(R"(, "sliding_window": 8, "layer_types": ["full_attention"])", "phi3"); })
                .find("'layer_types' must list one type per layer (4)"),
            std::string::npos);
  // Cut models keep the first layers' types, as the corpus's cut configs do.
  Model m = model_from_config_json(R"({"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100, "sliding_window": 16,
      "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]})");
  EXPECT_EQ(model::attention_windows(model::with_layers(m, 2).arch), (W{0, 16}));
  EXPECT_FALSE(model_from_config_json(R"({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100})").arch.bos_token);
}

}  // namespace
}  // namespace trainmem
