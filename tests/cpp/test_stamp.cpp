// Layer stamping (Note [Stamped decoder layers] in src/graph/tape.h): every trace built with
// stamping on must be the trace built with every layer built, event by event, for the recipes
// that stamp and for those that must fall back to building.
#include <string>
#include <vector>

#include "graph/step.h"
#include "model/model.h"
#include "test_util.h"

namespace trainmem {
namespace {

// stamping: layers' forwards stamped; backwards: their backwards too (Note [Stamped layer
// backwards] in src/graph/tape.h).
graph::Trace build(const Model& m, const Recipe& r, bool stamping, bool backwards = true) {
  graph::set_layer_stamping(stamping);
  graph::set_backward_stamping(backwards);
  graph::Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu));
  graph::set_layer_stamping(true);
  graph::set_backward_stamping(true);
  return t;
}

// Compares two traces entry by entry; returns "" or what differs first.
std::string difference(const graph::Trace& a, const graph::Trace& b) {
  if (a.storages.size() != b.storages.size()) {
    return "storages " + std::to_string(a.storages.size()) + " vs " + std::to_string(b.storages.size());
  }
  for (std::size_t i = 0; i < a.storages.size(); ++i) {
    const auto &x = a.storages[i], &y = b.storages[i];
    if (x.bytes != y.bytes || x.category != y.category || x.refs != y.refs) return "storage " + std::to_string(i);
  }
  if (a.events.size() != b.events.size()) {
    return "events " + std::to_string(a.events.size()) + " vs " + std::to_string(b.events.size());
  }
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    const auto &x = a.events[i], &y = b.events[i];
    if (x.tensor != y.tensor || x.moment != y.moment || x.alloc != y.alloc) return "event " + std::to_string(i);
  }
  if (a.moments.size() != b.moments.size()) {
    return "moments " + std::to_string(a.moments.size()) + " vs " + std::to_string(b.moments.size());
  }
  for (std::size_t i = 0; i < a.moments.size(); ++i) {
    const auto &x = a.moments[i], &y = b.moments[i];
    if (x.step != y.step || x.micro != y.micro || x.phase != y.phase || x.layer != y.layer || x.op != y.op ||
        x.recompute != y.recompute) {
      return "moment " + std::to_string(i);
    }
  }
  if (a.trainable_parameters != b.trainable_parameters) return "trainable parameters";
  if (a.host.pinned_bytes != b.host.pinned_bytes) return "host memory";
  return "";
}

struct Case {
  std::string label;
  Recipe r;
  bool stamps;  // whether this recipe stamps layers (false: it must build every one)
};

std::vector<Case> cases_for(const Model& m, std::uint64_t variant) {
  std::vector<Case> cases;
  auto add = [&](std::string label, Recipe r, bool stamps) {
    try {
      if (r.lora.enabled()) r.lora.targets = resolve_lora_targets(m.arch, r.lora.targets);
      r.validate();
    } catch (const Error&) {
      return;  // not a recipe this model takes (the builder's own errors are compared below)
    }
    cases.push_back({std::move(label), r, stamps});
  };
  for (int p = 0; p < 6; ++p) {
    for (int a = 0; a < 3; ++a) {
      Recipe r;
      r.precision = Precision(p);
      r.attention = Attention(a);
      r.batch = 1 + (variant + p + a) % 3;
      r.seq = (p + a) % 2 ? 64 : 96;
      r.gpu = (p + a + variant) % 2 ? "cpu" : "h100-80gb";
      r.loss = (p + variant) % 3 == 0 ? Loss::kFused : Loss::kStandard;
      r.optimizer = Optimizer((p + a) % 5);
      r.grad_accum = a == 1 ? 2 : 1;
      add("precision " + std::to_string(p) + " attention " + std::to_string(a), r, true);
      if (p == 0 || p == 4 || p == 2) {
        Recipe lora = r;
        lora.lora.rank = 8;
        lora.lora.dropout = a == 2 ? 0.1 : 0;
        if (a == 1) lora.lora.targets = {"all-linear"};
        add("lora, precision " + std::to_string(p) + " attention " + std::to_string(a), lora, true);
      }
    }
  }
  Recipe base;
  base.batch = 2;
  base.seq = 64;
  base.gpu = "h100-80gb";
  Recipe r = base;
  r.checkpointing = Checkpointing::kFull;
  add("checkpointing", r, false);
  r = base;
  r.gpus = 2;
  r.parallel = Parallel::kDdp;
  add("ddp", r, false);
  r.parallel = Parallel::kZero2;
  add("zero2", r, false);
  r.parallel = Parallel::kZero3;
  add("zero3", r, false);
  r.parallel = Parallel::kFsdp;
  add("fsdp", r, false);
  r = base;
  r.lora.rank = 16;
  r.quant.load_in_4bit = true;
  r.quant.quant_type = QuantType::kNf4;
  r.precision = Precision::kBf16True;
  add("qlora", r, false);
  if (m.arch.num_kv_heads % 2 == 0 && m.arch.num_heads % 2 == 0) {
    r = base;
    r.tp = 2;
    add("tp 2", r, false);
  }
  if (m.arch.family != Family::kGpt2) {
    r = base;
    r.cp = 2;
    add("cp 2", r, false);
  }
  r = base;
  r.pp = 2;
  r.grad_accum = 4;
  add("pp 2", r, false);
  return cases;
}

// Every catalog model cut to five layers, each with plain recipes (precisions, attentions, loss,
// optimizers, LoRA, batch, seq, micro-batches, GPU or CPU) and the recipes that fall back.
TEST(LayerStamp, StampedTracesAreBuiltTracesOverTheCatalog) {
  std::uint64_t variant = 0, stamping_cases = 0;
  for (const CatalogEntry& e : catalog()) {
    const Model m = model::with_layers(load_model(e.name), 5);
    for (const Case& c : cases_for(m, variant++)) {
      SCOPED_TRACE(e.name + ", " + c.label);
      graph::Trace built, forwards, stamped;
      std::string built_error, forwards_error, stamped_error;
      try {
        built = build(m, c.r, false);
      } catch (const Error& ex) {
        built_error = ex.what();
      }
      const std::uint64_t before = graph::stamped_backwards();
      try {
        forwards = build(m, c.r, true, false);
      } catch (const Error& ex) {
        forwards_error = ex.what();
      }
      EXPECT_EQ(graph::stamped_backwards(), before);  // backward stamping off: none
      const std::uint64_t layers_before = graph::stamped_layers();
      try {
        stamped = build(m, c.r, true);
      } catch (const Error& ex) {
        stamped_error = ex.what();
      }
      const std::uint64_t count = graph::stamped_layers() - layers_before;
      const std::uint64_t backwards = graph::stamped_backwards() - before;
      ASSERT_EQ(built_error, forwards_error);
      ASSERT_EQ(built_error, stamped_error);
      if (!built_error.empty()) continue;
      EXPECT_EQ(difference(built, forwards), "");
      EXPECT_EQ(difference(built, stamped), "");
      if (c.stamps) {
        // Five layers, two passes or more: at least layers 2..4 of each forward are stamped, and
        // of each backward at least one layer (layer 4's backward is captured: its incoming
        // gradient comes from the final norm; layer 0's is another: its input is no layer's
        // output).
        EXPECT_GE(count, 3u * c.r.steps);
        EXPECT_GE(backwards, 1u * c.r.steps);
        ++stamping_cases;
      } else {
        EXPECT_EQ(count, 0u);
        EXPECT_EQ(backwards, 0u);
      }
    }
  }
  EXPECT_GT(stamping_cases, 300u);
}

// The case at full depth: Llama-3.1-70B, seq 4096, the default recipe; and with
// stamping off no layer is stamped.
TEST(LayerStamp, Llama70bDefaultRecipe) {
  const Model m = load_model("llama-3.1-70b");
  Recipe r;
  r.seq = 4096;
  const std::uint64_t before = graph::stamped_layers();
  const graph::Trace built = build(m, r, false);
  EXPECT_EQ(graph::stamped_layers(), before);
  const graph::Trace stamped = build(m, r, true);
  // Built: step 1's layers 0 (it makes the cuBLAS workspace and starts under another op label)
  // and 1 (its input is layer 0's output), and step 2's layer 0; the other 157 are stamped,
  // step 2's layer 1 from step 1's.
  EXPECT_EQ(graph::stamped_layers() - before, 157u);
  EXPECT_EQ(difference(built, stamped), "");
  EXPECT_EQ(stamped.events.size(), built.events.size());
}

}  // namespace
}  // namespace trainmem
