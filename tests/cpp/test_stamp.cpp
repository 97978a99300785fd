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
      const std::uint64_t captured_before = graph::captured_backwards();
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
        EXPECT_EQ(graph::captured_backwards(), captured_before);
      }
    }
  }
  EXPECT_GT(stamping_cases, 300u);
}

// Four layers y = f(x, shared) on a bare tape, each saving its input and a storage all of them
// save (as every decoder layer saves the rotary tables), built or stamped from the first; the
// backward runs from the last output. `recapture`: a fifth layer is built and captured into the
// same span before the backward (the stamped layers' nodes and captures must survive it). See
// Note [Stamped layer backwards].
graph::Trace four_layers(bool stamping, bool python_holds_shared, bool recapture = false) {
  using namespace graph;
  Tape t;
  t.stamp_backward = stamping;
  t.at(Phase::kForward, -1, "inputs");
  const T shared = t.make(16, DType::kF32, Category::kActivations);
  T x = t.make(64, DType::kF32);
  x.value = t.new_value(x.bytes());
  auto layer = [&](const T& in, std::int32_t l) {
    t.at(Phase::kForward, l, "layer");
    T y = t.make(64, DType::kF32);
    y.value = t.new_value(y.bytes());
    Node& n = t.open_node();
    n.tag = t.trace().moments.back();
    n.output = y.value;
    n.saved = {in.id, shared.id};
    GradIn g;
    g.value = in.value;
    g.bytes = in.bytes();
    n.inputs.push_back(g);
    t.close_node();
    return y;
  };
  TapeMark mark;
  TapeSpan span;
  t.mark(mark);
  T h = layer(x, 0);
  const bool captured = stamping && t.capture(mark, {x.id, shared.id}, {x.value}, {}, 0, span);
  EXPECT_EQ(captured, stamping);
  const TensorId out_id = h.id - mark.storages;
  const ValueId out_value = h.value - mark.values;
  t.release(x.id);
  for (std::int32_t l = 1; l < 4; ++l) {
    T y = h;
    if (captured) {
      EXPECT_TRUE(t.can_stamp(span, {h.id, shared.id}));
      y.id = static_cast<TensorId>(t.trace().storages.size()) + out_id;
      y.value = t.value_count() + out_value;
      t.stamp(span, {h.id, shared.id}, {h.value}, {}, l);
    } else {
      y = layer(h, l);
    }
    t.release(h.id);
    h = y;
  }
  if (recapture) {
    t.mark(mark);
    T y = layer(h, 4);
    EXPECT_EQ(stamping && t.capture(mark, {h.id, shared.id}, {h.value}, {}, 4, span), stamping);
    t.release(h.id);
    h = y;
  }
  if (!python_holds_shared) t.release(shared.id);
  t.backward(h.value);
  t.release(h.id);
  if (python_holds_shared) t.release(shared.id);
  return t.take();
}

TEST(LayerStamp, BackwardFallsBackWhereASharedStorageComesDownToOne) {
  for (const bool holds : {true, false}) {
    SCOPED_TRACE(holds ? "shared storage held" : "shared storage dropped before backward");
    const graph::Trace built = four_layers(false, holds);
    const std::uint64_t stamped_before = graph::stamped_backwards();
    const std::uint64_t captured_before = graph::captured_backwards();
    const graph::Trace stamped = four_layers(true, holds);
    EXPECT_EQ(difference(built, stamped), "");
    // Layer 3 is captured (its incoming gradient is the seed, held twice), layer 2 too (its
    // incoming gradient is held once). Held: the shared storage comes down from 5 to 2 and
    // never to 1, so layer 1 is stamped from layer 2's capture however high its count; layer 0
    // would take it to 1 and is captured. Dropped: it comes down from 4 to 0, layer 1 takes it
    // to 1 and layer 0 frees it: neither may be stamped from a layer above.
    EXPECT_EQ(graph::stamped_backwards() - stamped_before, holds ? 1u : 0u);
    EXPECT_EQ(graph::captured_backwards() - captured_before, holds ? 3u : 4u);
    // The fifth layer's capture replaces the span the four were stamped from, and its backward
    // (from the seed) is captured; layer 3's incoming gradient is now held once, and the shared
    // storage is saved once more. Held: 6 down to 2, layer 3 captured, 2 and 1 stamped from it,
    // 0 captured. Dropped: 5 down to 0, layer 3 captured, 2 stamped (3 to 2), 1 (to 1) and 0
    // (to 0) captured.
    const std::uint64_t stamped_after = graph::stamped_backwards();
    const std::uint64_t captured_after = graph::captured_backwards();
    EXPECT_EQ(difference(four_layers(false, holds, true), four_layers(true, holds, true)), "");
    EXPECT_EQ(graph::stamped_backwards() - stamped_after, holds ? 2u : 1u);
    EXPECT_EQ(graph::captured_backwards() - captured_after, holds ? 3u : 4u);
  }
}

// The case at full depth: Llama-3.1-70B, seq 4096, the default recipe; and with
// stamping off no layer is stamped.
TEST(LayerStamp, Llama70bDefaultRecipe) {
  const Model m = load_model("llama-3.1-70b");
  Recipe r;
  r.seq = 4096;
  const std::uint64_t before = graph::stamped_layers();
  const std::uint64_t backwards_before = graph::stamped_backwards();
  const graph::Trace built = build(m, r, false);
  EXPECT_EQ(graph::stamped_layers(), before);
  EXPECT_EQ(graph::stamped_backwards(), backwards_before);
  const graph::Trace stamped = build(m, r, true);
  // Built: step 1's layers 0 (it makes the cuBLAS workspace and starts under another op label)
  // and 1 (its input is layer 0's output), and step 2's layer 0; the other 157 are stamped,
  // step 2's layer 1 from step 1's.
  EXPECT_EQ(graph::stamped_layers() - before, 157u);
  // Backwards: step 1's layer 79 is captured (the first of layer 1's template to run), 78..1
  // match it; step 1's layer 0 was not captured in the forward (it made the workspace), so it
  // has no range; step 2's 79..1 match step 1's capture and its layer 0 is captured (a template
  // of its own). 78 + 79 stamped.
  EXPECT_EQ(graph::stamped_backwards() - backwards_before, 157u);
  EXPECT_EQ(difference(built, stamped), "");
  EXPECT_EQ(stamped.events.size(), built.events.size());
  // Forwards stamped, backwards built: the same trace.
  EXPECT_EQ(difference(built, build(m, r, true, false)), "");
}

}  // namespace
}  // namespace trainmem
