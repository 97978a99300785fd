// Tests for generation (Mode::kInference, Note [Generation] in src/graph/generation.cpp): one
// model.generate() call under no_grad. The KV cache is checked against its closed form, the
// trace against what no_grad rules out (no gradient, no optimizer state, nothing saved), and
// the labels against docs/schema.md. Byte-exactness against real generate() runs is held by the
// cpu-gen-* measurements of data/ground_truth (tools/accuracy_table.py).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "graph/step.h"
#include "model/model.h"
#include "report/report.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

constexpr auto kActs = Category::kActivations;

std::uint64_t round512(std::uint64_t bytes) { return std::max<std::uint64_t>(512, (bytes + 511) / 512 * 512); }

Recipe generation(std::uint64_t batch, std::uint64_t seq, std::uint64_t new_tokens, std::uint64_t beams,
                  Precision precision = Precision::kBf16True, Attention attention = Attention::kSdpa) {
  Recipe r;
  r.mode = Mode::kInference;
  r.batch = batch;
  r.seq = seq;
  r.new_tokens = new_tokens;
  r.beams = beams;
  r.precision = precision;
  r.attention = attention;
  r.gpu = "cpu";
  r.validate();
  return r;
}

graph::Trace trace_of(const Model& m, const Recipe& r) { return graph::build_training_trace(m, r, find_gpu(r.gpu)); }

// Live rounded bytes per category just before the first event labelled `op`.
Breakdown live_before(const graph::Trace& t, std::string_view op) {
  Breakdown live{};
  for (const graph::Event& e : t.events) {
    if (t.moments[e.moment].op == op) break;
    const graph::Storage& s = t.storages[e.tensor];
    auto& slot = live[static_cast<std::size_t>(s.category)];
    if (e.alloc) {
      slot += round512(s.bytes);
    } else {
      slot -= round512(s.bytes);
    }
  }
  return live;
}

// The cache after the last forward holds seq + new_tokens - 1 positions (the last token is never
// fed back): 2 (keys, values) x layers tensors of [batch * beams, kv_heads, positions, head_dim].
std::uint64_t final_cache_bytes(const Model& m, const Recipe& r) {
  const Architecture& a = m.arch;
  const std::uint64_t per = r.batch * r.beams * a.num_kv_heads * (r.seq + r.new_tokens - 1) * a.head_dim *
                            dtype_bytes(r.precision == Precision::kFp32 ? DType::kF32 : DType::kBF16);
  return 2 * a.num_layers * round512(per);
}

TEST(Generation, KvCacheAtTheEndHasItsClosedForm) {
  const Model m = model::with_layers(load_model("llama-3.2-1b"), 2);
  for (std::uint64_t beams : {1, 3}) {
    for (Precision p : {Precision::kBf16True, Precision::kFp32}) {
      const Recipe r = generation(2, 16, 5, beams, p);
      const graph::Trace t = trace_of(m, r);
      // generate.return is the first op after the decoding loop.
      const Breakdown live = live_before(t, "generate.return");
      EXPECT_EQ(live[static_cast<std::size_t>(kActs)], final_cache_bytes(m, r))
          << "beams " << beams << " " << to_string(p);
    }
  }
}

TEST(Generation, NoGradientsNoOptimizerStatesNothingSaved) {
  for (const char* name : {"gpt2", "qwen3-0.6b", "gemma-2-2b", "phi-3-mini-4k-instruct"}) {
    const Model m = model::with_layers(load_model(name), 2);
    for (Attention att : {Attention::kSdpa, Attention::kEager}) {
      const graph::Trace t = trace_of(m, generation(2, 8, 4, 2, Precision::kBf16True, att));
      EXPECT_EQ(t.trainable_parameters, 0u) << name;
      for (const graph::Event& e : t.events) {
        if (!e.alloc) continue;
        const graph::Storage& s = t.storages[e.tensor];
        EXPECT_NE(s.category, Category::kGradients) << name;
        EXPECT_NE(s.category, Category::kOptimizerStates) << name;
        // Only the KV cache is an activation: nothing is saved for a backward pass.
        if (s.category == kActs) {
          const std::string_view op = t.moments[e.moment].op;
          EXPECT_TRUE(op == "self_attn.kv_cache" || op == "generate.reorder_cache") << name << " " << op;
        }
      }
      // Every storage is freed but the weights.
      std::vector<int> live(t.storages.size(), 0);
      for (const graph::Event& e : t.events) live[e.tensor] += e.alloc ? 1 : -1;
      for (std::size_t i = 0; i < live.size(); ++i) {
        if (t.storages[i].category != Category::kWeights) EXPECT_EQ(live[i], 0) << name << " storage " << i;
      }
    }
  }
}

TEST(Generation, LabelsFollowTheForwards) {
  const Model m = model::with_layers(load_model("qwen3-0.6b"), 2);
  const std::uint64_t N = 6;
  const graph::Trace t = trace_of(m, generation(1, 8, N, 1));
  std::uint32_t max_micro = 0;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& tag = t.moments[e.moment];
    EXPECT_EQ(tag.step, 1u);
    EXPECT_TRUE(tag.phase == Phase::kSetup || tag.phase == Phase::kPrefill || tag.phase == Phase::kDecode);
    if (tag.phase == Phase::kPrefill) EXPECT_EQ(tag.micro, 0u);
    if (tag.phase == Phase::kDecode && tag.op != "generate.return") EXPECT_GE(tag.micro, 1u);
    max_micro = std::max(max_micro, tag.micro);
  }
  EXPECT_EQ(max_micro, N - 1);  // the prefill and N - 1 decode forwards

  Recipe r = generation(1, 8, N, 1);
  const Estimate est = estimate(m, r);
  ASSERT_EQ(est.steps.size(), 1u);
  EXPECT_EQ(est.trainable_parameters, 0u);
  EXPECT_EQ(est.breakdown_at_peak[static_cast<std::size_t>(Category::kGradients)], 0u);
  EXPECT_EQ(est.breakdown_at_peak[static_cast<std::size_t>(Category::kOptimizerStates)], 0u);
}

// A two-layer Mistral config with four query heads, `kv_heads` key/value heads and a 16-token
// window, loaded from a config.json written for it.
Model windowed_mistral(std::uint64_t kv_heads) {
  const std::string path = ::testing::TempDir() + "trainmem_windowed_config.json";
  {
    std::ofstream out(path);
    out << R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": )"
        << kv_heads << R"(, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 512,
               "sliding_window": 16, "tie_word_embeddings": false})";
  }
  Model m = load_model(path);
  std::remove(path.c_str());
  return m;
}

TEST(Generation, SlidingWindowLayersKeepTheWindow) {
  // With a 16-token window: after the last forward each layer's storage holds the window - 1
  // positions it kept plus the one it added.
  const Model m = windowed_mistral(2);
  const Recipe r = generation(1, 24, 10, 1, Precision::kFp32);
  const graph::Trace t = trace_of(m, r);
  const Breakdown live = live_before(t, "generate.return");
  const std::uint64_t per = 1 * 2 * (16 - 1 + 1) * 16 * 4;
  EXPECT_EQ(live[static_cast<std::size_t>(kActs)], 2 * 2 * round512(per));
}

TEST(Generation, OneKeyValueHeadRepeatsAsAView) {
  // repeat_kv of a single key/value head is an expanded view: under SDPA with a sliding-window
  // mask nothing is copied; under eager attention matmul's folds copy K and V at b = 2 only
  // (measured: cpu-gen-llamaw512l2mqa-*, cpu-gen-mistralw512l2win128mqa-*).
  const Model m = windowed_mistral(1);
  // The prefill's allocations at layer 0's attention op `op` of [b, 4 heads, 24 tokens, 16] fp32.
  auto repeated = [&](std::uint64_t batch, Attention attention, std::string_view op) {
    const graph::Trace t = trace_of(m, generation(batch, 24, 2, 1, Precision::kFp32, attention));
    std::size_t n = 0;
    for (const graph::Event& e : t.events) {
      const graph::MomentTag& mt = t.moments[e.moment];
      if (e.alloc && mt.phase == Phase::kPrefill && mt.layer == 0 && mt.op == op &&
          t.storages[e.tensor].bytes == batch * 4 * 24 * 16 * 4) {
        ++n;
      }
    }
    return n;
  };
  EXPECT_EQ(repeated(2, Attention::kSdpa, "self_attn.sdpa"), 1u);           // the kernel's output only
  EXPECT_EQ(repeated(1, Attention::kEager, "self_attn.attn_weights"), 0u);
  EXPECT_EQ(repeated(2, Attention::kEager, "self_attn.attn_weights"), 2u);  // q's fold copy and K's
  EXPECT_EQ(repeated(1, Attention::kEager, "self_attn.attn_output"), 2u);   // bmm's output, transpose's copy
  EXPECT_EQ(repeated(2, Attention::kEager, "self_attn.attn_output"), 3u);   // and V's fold copy first
}

TEST(Generation, ReportsSayWhatWasGenerated) {
  const Model m = model::with_layers(load_model("qwen3-0.6b"), 2);
  const Estimate est = estimate(m, generation(2, 16, 8, 4));
  const std::string text = report::to_text(est);
  EXPECT_NE(text.find("recipe: generate, prompt batch 2 × seq 16, 8 new tokens, beam search, 4 beams, bf16-true"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("grad_accum"), std::string::npos) << text;
  const std::string json = report::to_json(est, false);
  EXPECT_NE(json.find("\"mode\":\"inference\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"new_tokens\":8"), std::string::npos) << json;
  EXPECT_NE(json.find("\"beams\":4"), std::string::npos) << json;
  EXPECT_NE(json.find("\"trainable_parameters\":0"), std::string::npos) << json;
}

// A full-size model with a long generation is estimated (how long it takes is bench/'s business,
// not a test's): the peak holds the bf16 weights and at least the prompt's KV cache.
TEST(Generation, FullSizeModelWithALongGeneration) {
  const Model m = load_model("llama-3.1-70b");
  Recipe r = generation(1, 2048, 128, 1);
  r.gpu = "h100-80gb";
  const Estimate est = estimate(m, r);
  const Architecture& a = m.arch;
  const std::uint64_t prompt_kv = 2 * a.num_layers * a.num_kv_heads * 2048 * a.head_dim * 2;
  EXPECT_GE(est.breakdown_at_peak[static_cast<std::size_t>(Category::kWeights)], m.parameter_count * 2);
  EXPECT_GE(est.breakdown_at_peak[static_cast<std::size_t>(Category::kActivations)], prompt_kv);
}

TEST(Generation, TooManyLayerPassesIsAnError) {
  const Model m = load_model("llama-3.1-70b");
  Recipe r = generation(1, 16, 100000, 1);
  const std::string err = testing::error_of([&] { (void)estimate(m, r); });
  EXPECT_NE(err.find("new_tokens"), std::string::npos) << err;
}

}  // namespace
}  // namespace trainmem
