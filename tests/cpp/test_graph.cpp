// Tests for the graph stage (src/graph/step.h): the op graph of one training step, checked
// against the closed forms of /work/shared/design/MEMORY_MECHANICS.md (§3 mixed precision,
// §4 optimizers, §5 gradients, §6 activations, §7 the loss head) on small models, and the
// model-state bytes the Estimate API reports.
//
// Units: b = batch, s = seq, h = heads · head_dim (= hidden here), a = heads, kv = KV heads,
// i = intermediate, V = vocab, d = head_dim, N = parameters. "Raw" bytes are Storage::bytes;
// "rounded" bytes are what the allocator charges with expandable segments (every request
// rounded up to a multiple of 512 B, at least 512 B; docs/schema.md "Categories").

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "graph/quant.h"
#include "graph/step.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using graph::MomentTag;
using graph::Trace;
using nlohmann::json;
using testing::kActs;
using testing::kGrads;
using testing::kStates;
using testing::kTemps;
using testing::kWeights;
constexpr std::size_t kOther = static_cast<std::size_t>(Category::kOther);

std::uint64_t round512(std::uint64_t bytes) { return std::max<std::uint64_t>(512, (bytes + 511) / 512 * 512); }

// ---- trace replay -------------------------------------------------------------------------

struct Live {
  Breakdown raw{};
  Breakdown rounded{};
  std::uint64_t total_rounded() const {
    std::uint64_t t = 0;
    for (auto b : rounded) t += b;
    return t;
  }
};

void apply(const Trace& t, std::size_t i, Live& live) {
  const graph::Event& e = t.events[i];
  const graph::Storage& s = t.storages[e.tensor];
  const auto c = static_cast<std::size_t>(s.category);
  if (e.alloc) {
    live.raw[c] += s.bytes;
    live.rounded[c] += round512(s.bytes);
  } else {
    live.raw[c] -= s.bytes;
    live.rounded[c] -= round512(s.bytes);
  }
}

using MomentPred = std::function<bool(const MomentTag&)>;

// Live bytes just before the first event whose moment satisfies `pred`.
Live live_before_first(const Trace& t, const MomentPred& pred) {
  Live live;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    if (pred(t.moments[t.events[i].moment])) return live;
    apply(t, i, live);
  }
  ADD_FAILURE() << "no event matches";
  return live;
}

// The largest value of `metric` over the states right after each event whose moment satisfies
// `pred`.
std::uint64_t max_after(const Trace& t, const MomentPred& pred, const std::function<std::uint64_t(const Live&)>& metric) {
  Live live;
  std::uint64_t best = 0;
  bool any = false;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    apply(t, i, live);
    if (pred(t.moments[t.events[i].moment])) {
      best = std::max(best, metric(live));
      any = true;
    }
  }
  EXPECT_TRUE(any) << "no event matches";
  return best;
}

MomentPred first_backward_of(std::uint32_t step) {
  return [step](const MomentTag& m) { return m.step == step && m.phase == Phase::kBackward; };
}
MomentPred in(std::uint32_t step, Phase phase, std::uint32_t micro = 1) {
  return [=](const MomentTag& m) { return m.step == step && m.micro == micro && m.phase == phase; };
}

// ---- models -------------------------------------------------------------------------------

// The layer of MEMORY_MECHANICS §6.2's probe: h = 256, a = 8, kv = 2, i = 688 (d = 32).
Model small_llama(std::uint64_t layers, std::uint64_t vocab = 1000) {
  json c = {{"model_type", "llama"},        {"hidden_size", 256},       {"intermediate_size", 688},
            {"num_hidden_layers", layers},  {"num_attention_heads", 8}, {"num_key_value_heads", 2},
            {"vocab_size", vocab},          {"max_position_embeddings", 2048}};
  return model_from_config_json(c.dump());
}

// Dimensions whose byte sizes are not multiples of 512, so rounding shows in the sums.
Model odd_llama(bool tied = false) {
  json c = {{"model_type", "llama"},   {"hidden_size", 200},       {"intermediate_size", 530},
            {"num_hidden_layers", 2},  {"num_attention_heads", 4}, {"num_key_value_heads", 2},
            {"vocab_size", 1001},      {"tie_word_embeddings", tied}};
  return model_from_config_json(c.dump());
}

Recipe cpu_recipe(Precision p, Attention a, std::uint64_t batch = 2, std::uint64_t seq = 64) {
  Recipe r;
  r.batch = batch;
  r.seq = seq;
  r.precision = p;
  r.attention = a;
  r.optimizer = Optimizer::kAdamW;
  r.gpu = "cpu";
  r.allocator = AllocatorMode::kExpandable;
  return r;
}

Trace trace_of(const Model& m, const Recipe& r) { return graph::build_training_trace(m, r, find_gpu(r.gpu)); }

// Σ over parameter tensors of the rounded size of one tensor of `bytes_per_element`.
std::uint64_t rounded_params(const Model& m, std::uint64_t bytes_per_element) {
  std::uint64_t sum = 0;
  for (const ParameterGroup& g : m.parameters) sum += round512(g.numel * bytes_per_element) * g.count;
  return sum;
}

std::uint64_t param_tensors(const Model& m) {
  std::uint64_t n = 0;
  for (const ParameterGroup& g : m.parameters) n += g.count;
  return n;
}

// AdamW's `step` counters (torch/optim/adam.py _init_group): a 0-dim fp32 tensor per parameter
// tensor, on the parameter's device for fused (and capturable), otherwise a CPU scalar. A CPU
// scalar is outside the CUDA allocator but is measured on the cpu device. 512 B each.
std::uint64_t adamw_step_counters(const Model& m, const Recipe& r) {
  const bool on_measured_device = r.optimizer == Optimizer::kAdamWFused || r.gpu == "cpu";
  return on_measured_device ? 512 * param_tensors(m) : 0;
}

// The rotary inv_freq and original_inv_freq buffers: fp32, d/2 elements each.
std::uint64_t rope_buffers_rounded(const Model& m) { return 2 * round512(m.arch.head_dim / 2 * 4); }

// ---- §6: saved activations per decoder layer ----------------------------------------------

struct Dims {
  std::uint64_t b, s, h, a, kv, i, d, V;
  std::uint64_t bsh() const { return b * s * h; }
  std::uint64_t bsi() const { return b * s * i; }
  std::uint64_t bas2() const { return b * a * s * s; }
  std::uint64_t bas() const { return b * a * s; }
  std::uint64_t bs() const { return b * s; }
  std::uint64_t bsV() const { return b * s * V; }
  std::uint64_t bsh_kv() const { return b * s * h * kv / a; }  // bsh · kv/a
};

constexpr Dims kProbe{2, 64, 256, 8, 2, 688, 32, 1000};  // MEMORY_MECHANICS §6.2's probe shapes

// Activations live at the end of the forward of step 2 (just before its first backward event):
// every layer's saved tensors plus those outside the layers.
Live end_of_forward(std::uint64_t layers, Precision p, Attention a, Checkpointing c = Checkpointing::kNone) {
  Recipe r = cpu_recipe(p, a);
  r.checkpointing = c;
  return live_before_first(trace_of(small_llama(layers), r), first_backward_of(2));
}

void expect_one_layer_saves(Precision p, Attention a, std::uint64_t expected) {
  const Live two = end_of_forward(2, p, a);
  const Live three = end_of_forward(3, p, a);
  EXPECT_EQ(three.raw[kActs] - two.raw[kActs], expected);
}

// §6.2, pure bf16 model, eager attention: A_layer = 24·bsh + 8·bsi + 6·bas² + 8·bs
// (1,885,184 B for the probe's shapes, the probe's own total).
// The node lists keep a few entries in place and spill to the heap past that; both sides must
// behave like a vector (order kept, copies independent, moves leave the source empty).
TEST(GraphTape, SmallVecBehavesLikeAVector) {
  graph::SmallVec<std::uint64_t, 2> v = {1, 2};
  v.push_back(3);  // past the inline capacity
  v.insert(v.end(), {4, 5});
  v.insert(v.begin() + 1, {9});
  EXPECT_EQ(std::vector<std::uint64_t>(v.begin(), v.end()), (std::vector<std::uint64_t>{1, 9, 2, 3, 4, 5}));
  graph::SmallVec<std::uint64_t, 2> copy = v;
  copy[0] = 7;
  EXPECT_EQ(v[0], 1u);
  graph::SmallVec<std::uint64_t, 2> moved = std::move(copy);
  EXPECT_EQ(moved.size(), 6u);
  EXPECT_EQ(moved[0], 7u);
  EXPECT_TRUE(copy.empty());  // NOLINT(bugprone-use-after-move): a moved-from list is empty
  graph::SmallVec<std::uint64_t, 2> small = {8};
  moved = std::move(small);  // an inline list moved over a spilled one
  EXPECT_EQ(std::vector<std::uint64_t>(moved.begin(), moved.end()), (std::vector<std::uint64_t>{8}));
  const std::vector<std::uint64_t> src = {4, 5, 6, 7};
  moved.assign(src.begin(), src.end());
  moved.push_back(moved[0]);  // an element of the list itself, across a growth
  EXPECT_EQ(std::vector<std::uint64_t>(moved.begin(), moved.end()), (std::vector<std::uint64_t>{4, 5, 6, 7, 4}));
}

// A node filled in the tape's list (open_node / close_node) is recorded exactly as one built
// aside and handed to record(): the saved input becomes an activation held until the node runs,
// the kept tensor lives to then, and backward makes the same events. The graph: x (a leaf that
// requires grad) -> y = f(x) saving x and a temporary, keeping a third; backward from y.
TEST(GraphTape, NodesBuiltInPlaceMatchRecorded) {
  auto build = [](bool in_place) {
    graph::Tape t;
    t.at(Phase::kForward, 0, "f");
    graph::T x = t.make(8, DType::kF32);
    x.value = t.new_value(x.bytes());
    graph::T tmp = t.make(4, DType::kF32);
    graph::T kept = t.make(2, DType::kF32);
    graph::T y = t.make(8, DType::kF32);
    y.value = t.new_value(y.bytes());
    auto fill = [&](graph::Node& n) {
      n.tag = MomentTag{0, 0, Phase::kBackward, 0, "f"};
      n.output = y.value;
      n.saved = {x.id, tmp.id};
      n.kept.push_back(kept.id);
      n.inputs.push_back(graph::GradIn{x.value, x.bytes(), false});
      n.scratch.push_back(16);
    };
    if (in_place) {
      fill(t.open_node());
      t.close_node();
    } else {
      graph::Node n;
      fill(n);
      t.record(std::move(n));
    }
    EXPECT_EQ(t.category(tmp.id), Category::kActivations);
    t.drop(tmp);
    t.drop(kept);
    t.drop(x);
    t.backward(y.value);
    t.drop(y);
    return t.take();
  };
  const Trace a = build(true), b = build(false);
  ASSERT_EQ(a.storages.size(), b.storages.size());
  for (std::size_t i = 0; i < a.storages.size(); ++i) {
    EXPECT_EQ(a.storages[i].bytes, b.storages[i].bytes);
    EXPECT_EQ(a.storages[i].category, b.storages[i].category);
    EXPECT_EQ(a.storages[i].refs, 0u);  // everything was freed
    EXPECT_EQ(b.storages[i].refs, 0u);
  }
  ASSERT_EQ(a.events.size(), b.events.size());
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    EXPECT_EQ(a.events[i].tensor, b.events[i].tensor);
    EXPECT_EQ(a.events[i].moment, b.events[i].moment);
    EXPECT_EQ(a.events[i].alloc, b.events[i].alloc);
  }
  ASSERT_EQ(a.moments.size(), b.moments.size());
  // The saved temporary and the kept tensor are freed by the node's backward, not at their drop.
  std::size_t tmp_free = 0;
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    if (a.events[i].tensor == 1 && !a.events[i].alloc) tmp_free = i;
  }
  EXPECT_EQ(a.moments[a.events[tmp_free].moment].phase, Phase::kBackward);
}

TEST(GraphActivations, EagerBf16PerLayer) {
  const Dims x = kProbe;
  const std::uint64_t want = 24 * x.bsh() + 8 * x.bsi() + 6 * x.bas2() + 8 * x.bs();
  EXPECT_EQ(want, 1885184u);
  expect_one_layer_saves(Precision::kBf16True, Attention::kEager, want);
}

// SDPA per layer. The flash and memory-efficient kernels (CUDA, and ATen's CPU flash kernel)
// write their output as [b, s, heads, d] and return it transposed to [b, heads, s, d], so HF's
// attn_output.transpose(1, 2).contiguous() is a no-op and o_proj saves the very storage SDPA
// saves as its output. MEMORY_MECHANICS §6.2 counts the two separately (22·bsh + ...); with one
// shared tensor, and native GQA:
//   A_layer(sdpa, bf16)     = 20·bsh + 4·bsh·(kv/a) + 8·bsi + 4·bas + 8·bs
//   A_layer(sdpa, autocast) = 30·bsh + 4·bsh·(kv/a) + 8·bsi + 4·bas + 8·bs
std::uint64_t sdpa_bf16_layer(const Dims& x) {
  return 20 * x.bsh() + 4 * x.bsh_kv() + 8 * x.bsi() + 4 * x.bas() + 8 * x.bs();
}
std::uint64_t sdpa_autocast_layer(const Dims& x) {
  return 30 * x.bsh() + 4 * x.bsh_kv() + 8 * x.bsi() + 4 * x.bas() + 8 * x.bs();
}

TEST(GraphActivations, SdpaBf16PerLayer) {
  const Dims x = kProbe;
  expect_one_layer_saves(Precision::kBf16True, Attention::kSdpa,
                         sdpa_bf16_layer(x));
}

// §6.3, autocast over fp32 weights, eager: 34·bsh + 8·bsi + 6·bas² + 8·bs (2,212,864 B for the
// probe's shapes, the probe's autocast total).
TEST(GraphActivations, EagerAutocastPerLayer) {
  const Dims x = kProbe;
  const std::uint64_t want = 34 * x.bsh() + 8 * x.bsi() + 6 * x.bas2() + 8 * x.bs();
  EXPECT_EQ(want, 2212864u);
  expect_one_layer_saves(Precision::kBf16Mixed, Attention::kEager, want);
}

// §6.3, autocast, SDPA, with the shared output of sdpa_bf16_layer's note (§6.3 says 32·bsh).
TEST(GraphActivations, SdpaAutocastPerLayer) {
  const Dims x = kProbe;
  expect_one_layer_saves(Precision::kBf16Mixed, Attention::kSdpa,
                         sdpa_autocast_layer(x));
}

// Not in MEMORY_MECHANICS; the §6.2 save rules with every tensor fp32. x.to(fp32) in the norm is
// a no-op (x itself is saved) and so is softmax's .to(query.dtype), so the PV matmul saves the
// softmax output the softmax already saves: 40·bsh + 16·bsi + 4·bas² + 8·bs.
TEST(GraphActivations, EagerFp32PerLayer) {
  const Dims x = kProbe;
  expect_one_layer_saves(Precision::kFp32, Attention::kEager,
                         40 * x.bsh() + 16 * x.bsi() + 4 * x.bas2() + 8 * x.bs());
}

// fp16 autocast saves exactly what bf16 autocast saves (same element sizes). GradScaler adds
// its scalars to "other" (docs/schema.md): the scale and the growth tracker, made on first use
// and kept, and the scaled loss (4 B each) in place of the plain scaled loss.
TEST(GraphActivations, Fp16MixedSavesWhatBf16MixedSaves) {
  const Live bf = end_of_forward(2, Precision::kBf16Mixed, Attention::kSdpa);
  const Live fp = end_of_forward(2, Precision::kFp16Mixed, Attention::kSdpa);
  EXPECT_EQ(fp.raw[kActs], bf.raw[kActs]);
  EXPECT_EQ(fp.raw[kWeights], bf.raw[kWeights]);
  EXPECT_EQ(fp.raw[kStates], bf.raw[kStates]);
  EXPECT_EQ(fp.raw[kGrads], 0u);
  EXPECT_EQ(bf.raw[kTemps], 4u);
  EXPECT_EQ(fp.raw[kTemps], 0u);
  EXPECT_EQ(fp.raw[kOther], bf.raw[kOther] + 3 * 4);
}

// Everything live at the end of the forward, bf16 model, eager: L·A_layer plus §6.4's terms
// outside the layers: final RMSNorm 6·bsh + 4·bs, lm_head input 2·bsh, the log_softmax output
// 4·bsV (§7), nll_loss's target (int64, 8·bs) and total_weight (4 B), and cos/sin, shared by
// all layers: [1, s, d] each (position_ids = cache_position.unsqueeze(0)), bf16.
TEST(GraphActivations, Bf16EndOfForwardInFull) {
  const Dims x = kProbe;
  const Live live = end_of_forward(2, Precision::kBf16True, Attention::kEager);
  const std::uint64_t layer = 24 * x.bsh() + 8 * x.bsi() + 6 * x.bas2() + 8 * x.bs();
  const std::uint64_t outside = 8 * x.bsh() + 4 * x.bs() + 2 * (x.s * x.d * 2) + 4 * x.bsV() + 8 * x.bs() + 4;
  EXPECT_EQ(live.raw[kActs], 2 * layer + outside);
  // Weights: the bf16 parameters and the two fp32 rotary buffers; nothing cast.
  const Model m = small_llama(2);
  EXPECT_EQ(live.raw[kWeights], 2 * m.parameter_count + 2 * (x.d / 2 * 4));
  // AdamW's two zeros_like(param), bf16, and on the cpu device the 4-byte `step` counters.
  EXPECT_EQ(live.raw[kStates], 4 * m.parameter_count + 4 * param_tensors(m));
  EXPECT_EQ(live.raw[kGrads], 0u);                      // zero_grad(set_to_none=True) after step 1
  EXPECT_EQ(live.raw[kOther], 2 * 8 * x.bs());          // input_ids and labels
  EXPECT_EQ(live.raw[kTemps], 4u);                      // only the scaled loss
}

// The same under autocast: the fp32 residual makes each norm 8·bsh + 4·bs; the lm_head saves
// its bf16 cast of the final norm's output; cos/sin are fp32. Weights: fp32 parameters plus the
// bf16 casts of every matmul weight (all of them are still saved at the end of the forward, §3.1).
TEST(GraphActivations, AutocastEndOfForwardInFull) {
  const Dims x = kProbe;
  const Live live = end_of_forward(2, Precision::kBf16Mixed, Attention::kSdpa);
  const std::uint64_t layer = sdpa_autocast_layer(x);
  const std::uint64_t outside = 8 * x.bsh() + 4 * x.bs() + 2 * x.bsh() + 2 * (x.s * x.d * 4) + 4 * x.bsV() + 8 * x.bs() + 4;
  EXPECT_EQ(live.raw[kActs], 2 * layer + outside);
  const Model m = small_llama(2);
  std::uint64_t matmul = 0;
  for (const ParameterGroup& g : m.parameters) matmul += g.matmul_weight ? g.numel * g.count : 0;
  EXPECT_EQ(matmul, 2u * (2 * 65536 + 2 * 16384 + 3 * 176128) + 256000);  // q, k, v, o, mlp; lm_head
  EXPECT_EQ(live.raw[kWeights], 4 * m.parameter_count + 2 * matmul + 2 * (x.d / 2 * 4));
  EXPECT_EQ(live.raw[kStates], 8 * m.parameter_count + 4 * param_tensors(m));
  EXPECT_EQ(live.raw[kGrads], 0u);
  EXPECT_EQ(live.raw[kTemps], 4u);
}

// Note [Autocast's weight casts]: in layer 0's up_proj under bf16-mixed, the forward casts the
// weight before the input, and the backward casts the input's gradient to fp32 before the
// weight's. Sizes tell them apart: the weight's casts are hidden x intermediate, the input's
// tokens x hidden.
TEST(GraphActivations, AutocastCastsTheWeightFirstAndItsGradientLast) {
  Recipe r = cpu_recipe(Precision::kBf16Mixed, Attention::kSdpa);
  r.batch = 1;
  r.seq = 64;
  const Model m = testing::llama_w512();
  const Trace t = trace_of(m, r);
  const std::uint64_t w_half = 512 * 2048 * 2, x_half = 64 * 512 * 2;
  std::vector<std::uint64_t> forward, backward;  // allocation sizes under layer 0's up_proj
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mo = t.moments[e.moment];
    if (!e.alloc || mo.step != 1 || mo.layer != 0 || mo.op != std::string_view("mlp.up_proj")) continue;
    (mo.phase == Phase::kForward ? forward : backward).push_back(t.storages[e.tensor].bytes);
  }
  ASSERT_GE(forward.size(), 2u);
  EXPECT_EQ(forward[0], w_half);  // the weight's cast
  EXPECT_EQ(forward[1], x_half);  // then the input's
  const auto first = [&](std::uint64_t bytes) {
    return std::find(backward.begin(), backward.end(), bytes) - backward.begin();
  };
  ASSERT_LT(first(2 * w_half), static_cast<std::ptrdiff_t>(backward.size()));
  EXPECT_LT(first(2 * x_half), first(2 * w_half));  // the input's fp32 gradient before the weight's
}

// ---- §6.5: gradient checkpointing ---------------------------------------------------------

// With every layer checkpointed, the forward keeps only each layer's input (2·bsh in bf16)
// and the shared arguments the checkpoint holds for the recompute (cos/sin, saved again by the
// recompute), plus the terms outside the layers. The eager mask is only referenced by the
// recompute closure and nothing saves it: it stays a temporary (as measured on CPU by the
// tracker).
TEST(GraphCheckpointing, ForwardKeepsOnlyLayerInputs) {
  const Dims x = kProbe;
  const std::uint64_t outside = 8 * x.bsh() + 4 * x.bs() + 4 * x.bsV() + 8 * x.bs() + 4;
  const std::uint64_t rope = 2 * (x.s * x.d * 2);
  for (std::uint64_t L : {2u, 3u}) {
    SCOPED_TRACE(L);
    const Live live = end_of_forward(L, Precision::kBf16True, Attention::kSdpa, Checkpointing::kFull);
    EXPECT_EQ(live.raw[kActs], L * 2 * x.bsh() + rope + outside);
  }
  // Eager attention: the [b, 1, s, s] bf16 causal mask is alive (an argument of every layer)
  // but not an activation.
  const Live eager = end_of_forward(2, Precision::kBf16True, Attention::kEager, Checkpointing::kFull);
  EXPECT_EQ(eager.raw[kActs], 2 * 2 * x.bsh() + rope + outside);
}

// In backward one layer is recomputed at a time, so at most one full A_layer exists on top of
// the saved layer inputs (§6.5); the most is reached when the last layer has been recomputed.
TEST(GraphCheckpointing, BackwardHoldsOneRecomputedLayer) {
  const Dims x = kProbe;
  const std::uint64_t layer = sdpa_bf16_layer(x);
  for (std::uint64_t L : {2u, 3u}) {
    SCOPED_TRACE(L);
    Recipe r = cpu_recipe(Precision::kBf16True, Attention::kSdpa);
    r.checkpointing = Checkpointing::kFull;
    const Trace t = trace_of(small_llama(L), r);
    const std::uint64_t most = max_after(t, in(2, Phase::kBackward), [](const Live& l) { return l.raw[kActs]; });
    EXPECT_EQ(most, L * 2 * x.bsh() + 2 * (x.s * x.d * 2) + layer);
  }
}

// Note [Reentrant checkpoints] (src/graph/tape.h): the forward is the non-reentrant one's; in every
// layer's backward the recomputed layer output stays alive (one hidden state more through the MLP's
// backward), and so does the incoming gradient, so the residual stream's gradient sum is a new
// tensor instead of an in-place add (two more through the attention's). Which part holds the layer's
// peak depends on the shapes: the 1B cut of the corpus peaks in the attention (+2, measured:
// data/ground_truth/*-ckptre-*), this probe in the MLP (+1).
TEST(GraphCheckpointing, ReentrantHoldsTheLayerOutputAndItsGradient) {
  const Dims x = kProbe;
  const Model m = small_llama(3);
  for (Precision p : {Precision::kFp32, Precision::kBf16True}) {
    SCOPED_TRACE(to_string(p));
    const std::uint64_t hidden = x.bsh() * (p == Precision::kFp32 ? 4 : 2);
    Recipe r = cpu_recipe(p, Attention::kSdpa);
    r.checkpointing = Checkpointing::kFull;
    const Trace plain = trace_of(m, r);
    r.checkpointing = Checkpointing::kFullReentrant;
    const Trace reentrant = trace_of(m, r);
    const Live before_plain = live_before_first(plain, first_backward_of(1));
    const Live before_reentrant = live_before_first(reentrant, first_backward_of(1));
    EXPECT_EQ(before_plain.raw, before_reentrant.raw);
    auto total = [](const Live& l) {
      std::uint64_t t = 0;
      for (auto b : l.raw) t += b;
      return t;
    };
    for (std::int32_t layer = 0; layer < 3; ++layer) {
      SCOPED_TRACE(layer);
      auto in_layer = [layer](const MomentTag& t) {
        return t.step == 2 && t.phase == Phase::kBackward && t.layer == layer;
      };
      const std::uint64_t base = max_after(plain, in_layer, total);
      const std::uint64_t held = max_after(reentrant, in_layer, total);
      EXPECT_GE(held, base + hidden);
      EXPECT_LE(held, base + 2 * hidden);
    }
  }
}

// The reentrant variant is modelled where it was measured: one GPU or DDP without
// find_unused_parameters, SDPA or eager attention, every family.
TEST(GraphCheckpointing, ReentrantOutsideWhatIsModelledIsRefused) {
  Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa);
  r.checkpointing = Checkpointing::kFullReentrant;
  EXPECT_NO_THROW(estimate(small_llama(2), r));
  EXPECT_EQ(parse_checkpointing(to_string(r.checkpointing)), Checkpointing::kFullReentrant);
  Recipe eager = r;
  eager.attention = Attention::kEager;
  EXPECT_NO_THROW(estimate(small_llama(2), eager));
  EXPECT_NO_THROW(estimate(testing::gpt2_l2(), r));  // Note [Forwards without saves]
  EXPECT_NO_THROW(estimate(testing::gpt2_l2(), eager));
  EXPECT_NO_THROW(estimate(load_model("gemma-2-2b"), r));  // its two masks (Note [Training masks])
  Recipe ddp = r;
  ddp.gpus = 2;
  ddp.parallel = Parallel::kDdp;
  EXPECT_NO_THROW(ddp.validate());
  ddp.ddp_find_unused_parameters = true;
  EXPECT_NE(testing::error_of([&] { ddp.validate(); }).find("ready only once"), std::string::npos);
  Recipe wrapped = r;  // measured: parallel/cpu-zero*-*-ckptre-*, cpu-fsdp-*-ckptre-*, cpu-tp2*-ckptre-*
  wrapped.gpus = 2;
  for (Parallel p : {Parallel::kZero1, Parallel::kZero2, Parallel::kZero3, Parallel::kFsdp}) {
    wrapped.parallel = p;
    EXPECT_NO_THROW(estimate(small_llama(2), wrapped)) << to_string(p);
  }
  wrapped.tp = 2;
  EXPECT_NO_THROW(estimate(small_llama(2), wrapped));
  Recipe qlora = r;  // over a 4-bit base only on one GPU or under DDP (step 1 differs under ZeRO-3)
  qlora.gpus = 2;
  qlora.parallel = Parallel::kZero3;
  qlora.lora.rank = 8;
  qlora.quant.load_in_4bit = true;
  EXPECT_NE(testing::error_of([&] { qlora.validate(); }).find("full-reentrant over a quantized base under parallel zero3"),
            std::string::npos);
  qlora.parallel = Parallel::kDdp;
  EXPECT_NO_THROW(qlora.validate());
  Recipe tp = r;
  tp.tp = 2;
  tp.sequence_parallel = true;
  EXPECT_NO_THROW(estimate(small_llama(2), tp));
  Recipe pp = r;
  pp.pp = 2;
  pp.grad_accum = 2;
  EXPECT_NE(testing::error_of([&] { pp.validate(); }).find("full-reentrant with pipeline or context parallelism"),
            std::string::npos);
}

// Note [SDPA kernels on CUDA]: cuDNN attention on sm90 / sm100 for half inputs keeps a philox
// seed and offset (0-dim int64) per layer from its forward to its backward and makes no
// log-sum-exp without grad; flash (sm80) and the memory-efficient kernel (fp32) keep neither.
TEST(GraphAttention, CudnnOnHopperKeepsSeedAndOffset) {
  const Model m = small_llama(3);  // head dim 32
  auto sdpa_int64s = [&](const Recipe& r) {
    const Trace t = trace_of(m, r);
    std::uint64_t n = 0;
    for (const graph::Event& e : t.events) {
      const MomentTag& at = t.moments[e.moment];
      if (e.alloc && t.storages[e.tensor].bytes == 8 && at.op == "self_attn.sdpa" && at.phase == Phase::kForward) ++n;
    }
    return n;
  };
  Recipe r;
  r.seq = 256;
  r.precision = Precision::kBf16True;
  EXPECT_EQ(sdpa_int64s(r), 2u * 3 * r.steps);  // two per layer and forward
  r.gpu = "b200-192gb";
  EXPECT_EQ(sdpa_int64s(r), 2u * 3 * r.steps);
  r.gpu = "a100-80gb";
  EXPECT_EQ(sdpa_int64s(r), 0u);
  r.gpu = "h100-80gb";
  r.attention = Attention::kFlash;  // flash_attention_2 is flash-attn's kernel on any GPU
  EXPECT_EQ(sdpa_int64s(r), 0u);
  r.attention = Attention::kSdpa;
  r.precision = Precision::kFp32;
  EXPECT_EQ(sdpa_int64s(r), 0u);
  // The seed and offset live to the layer's backward: one step's forward adds 2 x 512 B a layer.
  r.precision = Precision::kBf16True;
  r.optimizer = Optimizer::kSgd;
  Recipe a100 = r;
  a100.gpu = "a100-80gb";
  const auto forward_growth = [&](const Recipe& x) {
    const Trace t = trace_of(m, x);
    return live_before_first(t, first_backward_of(2)).total_rounded() -
           live_before_first(t, in(2, Phase::kForward)).total_rounded();
  };
  EXPECT_EQ(forward_growth(r), forward_growth(a100) + 3 * 2 * 512);
  // Flash's backward buffers have their rows rounded to 128 (mha_bwd): at seq 200, dq_accum is
  // [1, 256, 8, 32] fp32 and softmax_d [1, 8, 256] fp32; cuDNN's one workspace is unrounded.
  auto backward_sdpa_allocs = [&](const Recipe& x) {
    const Trace t = trace_of(m, x);
    std::vector<std::uint64_t> sizes;
    for (const graph::Event& e : t.events) {
      const MomentTag& at = t.moments[e.moment];
      if (e.alloc && at.op == "self_attn.sdpa" && at.phase == Phase::kBackward && at.step == 1 && at.layer == 2) {
        sizes.push_back(t.storages[e.tensor].bytes);
      }
    }
    return sizes;
  };
  a100.seq = r.seq = 200;
  const std::vector<std::uint64_t> flash = backward_sdpa_allocs(a100), cudnn = backward_sdpa_allocs(r);
  EXPECT_NE(std::find(flash.begin(), flash.end(), 256u * 8 * 32 * 4), flash.end());
  EXPECT_NE(std::find(flash.begin(), flash.end(), 8u * 256 * 4), flash.end());
  EXPECT_NE(std::find(cudnn.begin(), cudnn.end(), 200u * 8 * 32 * 4 + 8 * 200 * 4), cudnn.end());
}

// When activations decide the peak, checkpointing lowers it and moves it out of the forward.
TEST(GraphCheckpointing, ReducesAnActivationPeak) {
  const Model m = small_llama(3);
  Recipe r = cpu_recipe(Precision::kBf16True, Attention::kEager, 2, 256);
  const Estimate plain = estimate(m, r);
  EXPECT_NE(plain.peak.phase, Phase::kOptimizer);
  r.checkpointing = Checkpointing::kFull;
  const Estimate ckpt = estimate(m, r);
  EXPECT_LT(ckpt.peak_allocated_bytes, plain.peak_allocated_bytes);
}

// ---- §3, §4: model states through the Estimate API ----------------------------------------

// With a tiny batch the step peak is the foreach AdamW update: weights, states, gradients and
// _foreach_sqrt(exp_avg_sqs), one temporary per parameter (§4.1, P_step = W + O + G + 4N).
struct StateBytes {
  std::uint64_t weights, states, grads, temps;
};

void expect_optimizer_peak(const Model& m, Precision p, const StateBytes& want) {
  const Recipe r = cpu_recipe(p, Attention::kSdpa, 1, 8);
  const Estimate e = estimate(m, r);
  EXPECT_EQ(e.peak.phase, Phase::kOptimizer);
  EXPECT_EQ(e.peak.op, "optimizer.foreach_sqrt");
  const Breakdown& got = e.breakdown_at_peak;
  EXPECT_EQ(got[kWeights], want.weights + rope_buffers_rounded(m));
  EXPECT_EQ(got[kStates], want.states + adamw_step_counters(m, r));
  EXPECT_EQ(got[kGrads], want.grads);
  EXPECT_EQ(got[kTemps], want.temps);
  EXPECT_EQ(got[kActs], 0u);
  EXPECT_EQ(got[kOther], 2 * round512(8 * r.batch * r.seq));  // input_ids, labels
  std::uint64_t sum = 0;
  for (auto b : got) sum += b;
  EXPECT_EQ(sum, e.peak_allocated_bytes);
  // With expandable segments nothing is charged beyond the rounded sizes.
  EXPECT_EQ(e.peak_allocated_bytes, want.weights + rope_buffers_rounded(m) + want.states +
                                        adamw_step_counters(m, r) + want.grads + want.temps + got[kOther]);
}

// fp32 + AdamW: weights 4N, states 8N, gradients 4N (+ the 4N foreach temporary).
TEST(GraphModelStates, Fp32AdamW) {
  const Model m = odd_llama();
  const std::uint64_t w4 = rounded_params(m, 4);
  expect_optimizer_peak(m, Precision::kFp32, {w4, 2 * w4, w4, w4});
}

// bf16-master: bf16 weights plus an fp32 master copy (6N), fp32 gradients for the master copy,
// fp32 states (§3.3).
TEST(GraphModelStates, Bf16MasterKeepsSixBytesOfWeights) {
  const Model m = odd_llama();
  const std::uint64_t w2 = rounded_params(m, 2), w4 = rounded_params(m, 4);
  expect_optimizer_peak(m, Precision::kBf16Master, {w2 + w4, 2 * w4, w4, w4});
}

// bf16-true: everything bf16, AdamW's zeros_like states included (4N of states, §3.2).
TEST(GraphModelStates, Bf16TrueStatesAreHalf) {
  const Model m = odd_llama();
  const std::uint64_t w2 = rounded_params(m, 2);
  expect_optimizer_peak(m, Precision::kBf16True, {w2, 2 * w2, w2, w2});
}

// bf16-mixed: fp32 parameters, so 4N + 8N + 4N as fp32; the bf16 casts are gone by the step.
TEST(GraphModelStates, Bf16MixedIsFp32ModelStates) {
  const Model m = odd_llama();
  const std::uint64_t w4 = rounded_params(m, 4);
  expect_optimizer_peak(m, Precision::kBf16Mixed, {w4, 2 * w4, w4, w4});
}

// A tied lm_head is one parameter: one weight, one gradient, one pair of states.
TEST(GraphModelStates, TiedEmbeddingCountsOnce) {
  const Model m = odd_llama(true);
  EXPECT_EQ(m.parameter_count, odd_llama(false).parameter_count - 1001u * 200);
  const std::uint64_t w4 = rounded_params(m, 4);
  expect_optimizer_peak(m, Precision::kFp32, {w4, 2 * w4, w4, w4});
}

// Optimizer states live at the start of step 2 (all created by step 1, none freed).
std::uint64_t states_at_step2(const Model& m, Precision p, Optimizer o) {
  Recipe r = cpu_recipe(p, Attention::kSdpa, 1, 8);
  r.optimizer = o;
  return live_before_first(trace_of(m, r), in(2, Phase::kForward)).rounded[kStates];
}

// bitsandbytes AdamW8bit (§4.2): tensors of at least 4096 elements keep two uint8 states and
// two fp32 absmax vectors of ceil(n/256) blocks; smaller ones keep two fp32 states. The
// optimizer also moves its two 256-entry fp32 quantization maps to the device once.
TEST(GraphModelStates, AdamW8bitLayout) {
  const Model m = odd_llama();
  std::uint64_t want = 2 * round512(256 * 4);
  for (const ParameterGroup& g : m.parameters) {
    const std::uint64_t n = g.numel;
    const std::uint64_t per = n < 4096 ? 2 * round512(4 * n) : 2 * round512(n) + 2 * round512((n + 255) / 256 * 4);
    want += per * g.count;
  }
  EXPECT_EQ(states_at_step2(m, Precision::kBf16True, Optimizer::kAdamW8bit), want);
  EXPECT_EQ(states_at_step2(m, Precision::kFp32, Optimizer::kAdamW8bit), want);  // independent of the dtype
}

// Fused AdamW keeps its `step` counters on the device: one 0-dim fp32 tensor (512 B) per
// parameter tensor (§4.1); foreach AdamW keeps them on the CPU, outside a GPU's allocator.
TEST(GraphModelStates, FusedAdamWKeepsStepOnDevice) {
  const Model m = odd_llama();
  EXPECT_EQ(param_tensors(m), 21u);  // embed, 2 × 9 layer tensors, norm, lm_head
  for (const char* gpu : {"cpu", "h100-80gb"}) {
    SCOPED_TRACE(gpu);
    for (Optimizer o : {Optimizer::kAdamWFused, Optimizer::kAdamW}) {
      Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 1, 8);
      r.optimizer = o;
      r.gpu = gpu;
      const std::uint64_t states = live_before_first(trace_of(m, r), in(2, Phase::kForward)).rounded[kStates];
      EXPECT_EQ(states, 2 * rounded_params(m, 4) + adamw_step_counters(m, r)) << to_string(o);
    }
  }
  Recipe fused_on_gpu = cpu_recipe(Precision::kFp32, Attention::kSdpa, 1, 8);
  fused_on_gpu.optimizer = Optimizer::kAdamWFused;
  fused_on_gpu.gpu = "h100-80gb";
  EXPECT_EQ(adamw_step_counters(m, fused_on_gpu), 21u * 512);
}

// SGD with momentum: one momentum buffer of the parameter's dtype (§4.2).
TEST(GraphModelStates, SgdMomentumBuffer) {
  const Model m = odd_llama();
  EXPECT_EQ(states_at_step2(m, Precision::kBf16True, Optimizer::kSgd), rounded_params(m, 2));
  EXPECT_EQ(states_at_step2(m, Precision::kFp32, Optimizer::kSgd), rounded_params(m, 4));
}

// Fused AdamW has no list-sized temporaries (§4.1): its step peak is W + G + O.
TEST(GraphModelStates, FusedAdamWHasNoStepTemporaries) {
  const Model m = odd_llama();
  Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 1, 8);
  r.optimizer = Optimizer::kAdamWFused;
  const Trace t = trace_of(m, r);
  const std::uint64_t most = max_after(t, in(2, Phase::kOptimizer), [](const Live& l) { return l.rounded[kTemps]; });
  EXPECT_EQ(most, 0u);
}

// §4.1: state is created lazily in the first step(), so step 1's forward has no optimizer
// states; step 2's forward peak is higher by exactly the states.
TEST(GraphModelStates, StepOneForwardHasNoStates) {
  const Model m = small_llama(2);
  const Trace t = trace_of(m, cpu_recipe(Precision::kFp32, Attention::kSdpa));
  auto total = [](const Live& l) { return l.total_rounded(); };
  const std::uint64_t fwd1 = max_after(t, in(1, Phase::kForward), total);
  const std::uint64_t fwd2 = max_after(t, in(2, Phase::kForward), total);
  const std::uint64_t states = 2 * rounded_params(m, 4) + adamw_step_counters(m, cpu_recipe(Precision::kFp32, Attention::kSdpa));
  EXPECT_EQ(max_after(t, in(1, Phase::kForward), [](const Live& l) { return l.rounded[kStates]; }), 0u);
  EXPECT_EQ(fwd2 - fwd1, states);
  EXPECT_LT(fwd1, fwd2);
}

// ---- §5.2: gradient accumulation ----------------------------------------------------------

// .grad persists through micro-batch 2's forward (and is None again after the optimizer step).
TEST(GraphGradAccum, GradientsPersistThroughTheNextMicroBatch) {
  const Model m = small_llama(2);
  Recipe r = cpu_recipe(Precision::kBf16True, Attention::kSdpa);
  r.grad_accum = 2;
  const Trace t = trace_of(m, r);
  const std::uint64_t g = rounded_params(m, 2);
  for (std::uint32_t step : {1u, 2u}) {
    SCOPED_TRACE(step);
    EXPECT_EQ(live_before_first(t, in(step, Phase::kForward, 1)).rounded[kGrads], 0u);
    EXPECT_EQ(live_before_first(t, in(step, Phase::kForward, 2)).rounded[kGrads], g);
    EXPECT_EQ(max_after(t, in(step, Phase::kForward, 2), [](const Live& l) { return l.rounded[kGrads]; }), g);
  }
  auto total = [](const Live& l) { return l.total_rounded(); };
  EXPECT_EQ(max_after(t, in(2, Phase::kForward, 2), total) - max_after(t, in(2, Phase::kForward, 1), total), g);
}

// ---- §7: the loss head ---------------------------------------------------------------------

// A large vocabulary with small layers (two of them), so the loss head is the peak. Every byte size here is a
// multiple of 512 except the 4-byte scalars, so rounded sizes are the raw ones.
constexpr Dims kWide{1, 128, 64, 4, 2, 172, 16, 32000};

Model wide_vocab_llama() {
  json c = {{"model_type", "llama"},       {"hidden_size", 64},        {"intermediate_size", 172},
            {"num_hidden_layers", 2},      {"num_attention_heads", 4}, {"num_key_value_heads", 2},
            {"vocab_size", 32000}};
  return model_from_config_json(c.dump());
}

// §7 timeline, current ForCausalLMLoss: at the log_softmax backward the fp32 log-probs (saved,
// 4·bsV), the nll_loss gradient w.r.t. them (4·bsV) and log_softmax's gradient input (4·bsV)
// coexist: 12·bsV. That is the step's peak.
TEST(GraphLossHead, SpikeAtLogSoftmaxBackward) {
  const Dims x = kWide;
  const Model m = wide_vocab_llama();
  const Recipe r = cpu_recipe(Precision::kBf16True, Attention::kSdpa, x.b, x.s);
  const Estimate e = estimate(m, r);
  EXPECT_EQ(e.peak.step, 2u);
  EXPECT_EQ(e.peak.phase, Phase::kBackward);
  EXPECT_EQ(e.peak.op, "loss");
  const std::uint64_t layer = sdpa_bf16_layer(x);
  // Saved: the layer, the final norm (6·bsh + 4·bs), the lm_head input (2·bsh), cos/sin, and the
  // log-probs; nll_loss's target and total_weight went with its node.
  const std::uint64_t acts = 2 * layer + 8 * x.bsh() + 4 * x.bs() + 2 * (x.s * x.d * 2) + 4 * x.bsV();
  // + the scaled loss and the seed gradient that backward() holds for the whole call (4 B each,
  // 512 B blocks)
  const std::uint64_t temps = 2 * 4 * x.bsV() + 2 * 512;
  const Breakdown& got = e.breakdown_at_peak;
  EXPECT_EQ(got[kActs], acts);
  EXPECT_EQ(got[kTemps], temps);
  EXPECT_EQ(got[kGrads], 0u);  // the lm_head has not run yet
  EXPECT_EQ(got[kWeights], rounded_params(m, 2) + rope_buffers_rounded(m));
  EXPECT_EQ(got[kStates], 2 * rounded_params(m, 2) + adamw_step_counters(m, r));
  EXPECT_EQ(got[kOther], 2 * 8 * x.bs());
  EXPECT_EQ(e.peak_allocated_bytes, acts + temps + got[kWeights] + got[kStates] + got[kOther]);
  // The loss head's own share: 12·bsV.
  EXPECT_EQ(got[kActs] + got[kTemps] - 2 * 512 - (2 * layer + 8 * x.bsh() + 4 * x.bs() + 2 * (x.s * x.d * 2)),
            12 * x.bsV());
}

// §7: 10·bsV at the end of the forward: bf16 logits (2), the fp32 upcast (4) and the
// log_softmax output (4) while the loss is computed.
TEST(GraphLossHead, TenBsvInsideTheLoss) {
  const Dims x = kWide;
  const Model m = wide_vocab_llama();
  const Trace t = trace_of(m, cpu_recipe(Precision::kBf16True, Attention::kSdpa, x.b, x.s));
  const Live before = live_before_first(t, in(2, Phase::kLoss));
  const std::uint64_t most = max_after(t, in(2, Phase::kLoss), [](const Live& l) { return l.raw[kActs] + l.raw[kTemps]; });
  // Entering the loss: the bf16 logits (2·bsV) are the only loss-head tensor.
  EXPECT_EQ(before.raw[kTemps], 2 * x.bsV());
  // Most inside: logits 2 + upcast 4 + log-probs 4, with the shifted labels (8·bs; for one
  // sequence the padded labels themselves, 8·(s + 1): pad(labels)[..., 1:] of a [1, s + 1] tensor
  // is contiguous, so .contiguous() copies nothing), and nll_loss's loss and total_weight (4 B
  // each), made while ForCausalLMLoss still holds the upcast.
  const std::uint64_t labels = x.b == 1 ? 8 * (x.bs() + 1) : 8 * x.bs();
  EXPECT_EQ(most - (before.raw[kActs] + before.raw[kTemps]), 8 * x.bsV() + labels + 2 * 4);
}

// Events of step 1's backward, micro-batch `micro`, under `op` in layer 0: +bytes for an
// allocation, -bytes for a free.
std::vector<std::int64_t> backward_events(const Trace& t, const char* op, std::uint32_t micro = 1) {
  std::vector<std::int64_t> out;
  for (const graph::Event& e : t.events) {
    const MomentTag& mt = t.moments[e.moment];
    if (mt.step == 1 && mt.micro == micro && mt.phase == Phase::kBackward && mt.layer == 0 && mt.op == op) {
      const auto b = static_cast<std::int64_t>(t.storages[e.tensor].bytes);
      out.push_back(e.alloc ? b : -b);
    }
  }
  return out;
}

// A tied embedding gets two gradients in step 1's backward, lm_head's first. A plain nn.Linear
// hands its weight gradient over as a view, which autograd's input buffer adds the embedding's
// into out of place: one more [V, h] fp32 tensor. Through the fused loss (or autocast's cast) it
// arrives fresh and the sum is in place (measured: the untracked and tracked runs of
// tests/python/test_measure_untracked.py).
TEST(GraphLossHead, TiedGradientSumInPlaceUnlessTheHeadsIsAView) {
  json c = {{"model_type", "llama"},  {"hidden_size", 64},           {"intermediate_size", 172},
            {"num_hidden_layers", 1}, {"num_attention_heads", 4},    {"num_key_value_heads", 2},
            {"vocab_size", 32000},    {"tie_word_embeddings", true}};
  const Model m = model_from_config_json(c.dump());
  const std::uint64_t vh = 32000u * 64 * 4;
  auto head_sized = [&](Loss loss) {
    Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 1, 8);
    r.optimizer = Optimizer::kSgd;
    r.loss = loss;
    const Trace t = trace_of(m, r);
    std::uint32_t n = 0;  // [V, h] fp32 tensors made in step 1's backward
    for (const graph::Event& e : t.events) {
      const MomentTag& at = t.moments[e.moment];
      n += e.alloc && at.step == 1 && at.phase == Phase::kBackward && t.storages[e.tensor].bytes == vh;
    }
    return n;
  };
  EXPECT_EQ(head_sized(Loss::kStandard), 3u);  // lm_head's, the embedding's, their sum
  EXPECT_EQ(head_sized(Loss::kFused), 1u);     // the embedding's (lm_head's is made in the forward)
}

// Projections that share an input (gate/up, q/k/v) hand their input gradients over as views of
// mm's output, so autograd's input buffer adds the second into a new tensor, and the third in
// place into that sum (measured, torch 2.13: `add` at gate_proj and k_proj, an in-place `add_`
// at q_proj; tools/trace_allocs.py over cpu-llamaw512l4-fp32-adamw-pad-b2s128).
TEST(GraphBackwardSums, SharedLinearInputsSumOutOfPlaceOnce) {
  const Model m = small_llama(1);
  const Trace t = trace_of(m, cpu_recipe(Precision::kFp32, Attention::kSdpa, 1, 8));
  auto hidden_sized = [&](const char* op) {
    const std::vector<std::int64_t> ev = backward_events(t, op);
    return std::count(ev.begin(), ev.end(), 8 * 256 * 4);
  };
  EXPECT_EQ(hidden_sized("mlp.up_proj"), 1);    // its input's gradient, buffered first
  EXPECT_EQ(hidden_sized("mlp.gate_proj"), 2);  // its input's gradient and the sum
  EXPECT_EQ(hidden_sized("self_attn.v_proj"), 1);
  EXPECT_EQ(hidden_sized("self_attn.k_proj"), 2);
  EXPECT_EQ(hidden_sized("self_attn.q_proj"), 1);  // added in place into k_proj's sum
}

// view + transpose of a projection's output: reshape's backward copies a gradient laid out
// [b, heads, s, d]. q's and k's always (the rotary embedding's backward makes them so); v's
// under eager attention (bmm) but not from SDPA's flash kernel without a mask (measured: the
// cpu-llama1bl2-lora8-... and cpu-qwen3l2-... traces).
TEST(GraphBackwardOrder, HeadTransposedGradientsAreCopied) {
  const Model m = small_llama(1);  // 8 heads, 2 K/V heads of 32
  auto copies = [&](Attention a) {
    const Trace t = trace_of(m, cpu_recipe(Precision::kFp32, a, 1, 8));
    std::vector<std::int64_t> made;
    for (std::int64_t b : backward_events(t, "self_attn.clone")) {
      if (b > 0) made.push_back(b);
    }
    return made;
  };
  EXPECT_EQ(copies(Attention::kSdpa), (std::vector<std::int64_t>{8 * 64 * 4, 8 * 256 * 4}));  // k, q
  EXPECT_EQ(copies(Attention::kEager), (std::vector<std::int64_t>{8 * 64 * 4, 8 * 64 * 4, 8 * 256 * 4}));
}

// GPT-2's c_attn(x).split(...): one SplitBackward, which concatenates the three gradients into
// one of the fused output's size once all have come; before it, reshape's backward copies q's and
// v's gradients (bmm makes them laid out [b, heads, s, d]), query's first (it is viewed last), and
// never k's (bmm makes k^T's, which folds back). With the flash kernel nothing is copied
// (measured: the GPT-2 fp32 traces, tools/trace_allocs.py, every allocation).
TEST(GraphBackwardOrder, Gpt2SplitConcatenatesItsGradients) {
  const Model m = testing::gpt2_l2();
  const std::int64_t piece = 2 * 16 * 768 * 4;  // b 2, s 16, fp32
  for (Attention a : {Attention::kEager, Attention::kSdpa}) {
    SCOPED_TRACE(a == Attention::kEager ? "eager" : "sdpa");
    Recipe r = cpu_recipe(Precision::kFp32, a, 2, 16);
    r.optimizer = Optimizer::kSgd;
    const Trace t = trace_of(m, r);
    std::vector<std::int64_t> made;
    for (std::int64_t b : backward_events(t, "attn.clone")) {
      if (b > 0) made.push_back(b);
    }
    // SDPA on the CPU with GPT-2's attention dropout runs the math kernel: bmm again.
    EXPECT_EQ(made, (std::vector<std::int64_t>{piece, piece}));
    const std::vector<std::int64_t> ev = backward_events(t, "attn.c_attn");
    ASSERT_GE(ev.size(), 4u);
    EXPECT_EQ((std::vector<std::int64_t>(ev.begin(), ev.begin() + 4)),
              (std::vector<std::int64_t>{3 * piece, -piece, -piece, -piece}));
  }
  json c = json::parse(std::ifstream(std::string(TRAINMEM_DATA_DIR) + "/ground_truth/configs/gpt2-l2.json"));
  c["attn_pdrop"] = 0.0;  // the CPU's flash kernel: gradients in their inputs' layout
  Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 2, 16);
  const Trace t = trace_of(model_from_config_json(c.dump()), r);
  EXPECT_TRUE(backward_events(t, "attn.clone").empty());
}

// A product's node makes the second operand's gradient first (MulBackward0, BmmBackward0):
// GPT-2's gelu_new ends in `0.5 * x * (1 + tanh(...))`, whose tanh branch gets its gradient
// first and frees it at tanh's backward, before the other is used; `1 + tanh` makes none, and
// pow's backward makes two temporaries before its product (measured, GPT-2 fp32).
TEST(GraphBackwardOrder, Gpt2GeluAsItsNodesRun) {
  Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 2, 16);
  r.optimizer = Optimizer::kSgd;
  const Trace t = trace_of(testing::gpt2_l2(), r);
  const std::int64_t n = 2 * 16 * 3072 * 4;
  std::vector<std::int64_t> made;
  for (std::int64_t b : backward_events(t, "mlp.act")) {
    if (b > 0) made.push_back(b);
  }
  // the product's two, tanh's, * sqrt(2/pi), * 0.044715, pow's two temporaries and product, * 0.5
  EXPECT_EQ(made, std::vector<std::int64_t>(9, n));
}

// The clone that folds a strided operand for bmm (b > 1) hands bmm's gradient on: eager Llama
// makes nothing between bmm's gradients and repeat_kv's sums (measured, b = 2).
TEST(GraphBackwardOrder, FoldForBmmMakesNoGradient) {
  const Model m = small_llama(1);  // 8 heads, 2 K/V heads of 32
  Recipe r = cpu_recipe(Precision::kFp32, Attention::kEager, 2, 8);
  const Trace t = trace_of(m, r);
  const std::vector<std::int64_t> ev = backward_events(t, "self_attn.attn_weights");
  const std::int64_t scores = 2 * 8 * 8 * 8 * 4, q = 2 * 8 * 256 * 4, kv = 2 * 8 * 64 * 4;
  std::vector<std::int64_t> made;
  for (std::int64_t b : ev) {
    if (b > 0) made.push_back(b);
  }
  // the scaling's gradient, bmm's (k^T's first, then q's), repeat_kv's sums over the groups (V's
  // and K's, made in the forward before the scores)
  EXPECT_EQ(made, (std::vector<std::int64_t>{scores, q, q, kv, kv}));
}

// Under a non-reentrant checkpoint a node's saved tensors come through the unpack hook, which lets
// go of them: they die when the node's function returns, before validate_outputs sums the bias's
// broadcast gradient; otherwise the node releases them after it (measured: GPT-2 fp32 with and
// without checkpointing, c_proj's bias).
TEST(GraphBackwardOrder, UnpackedSavesGoBeforeTheBiasSum) {
  const std::int64_t saved = 2 * 16 * 3072 * 4, bias = 768 * 4;
  for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull}) {
    SCOPED_TRACE(c == Checkpointing::kNone ? "none" : "full");
    Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 2, 16);
    r.optimizer = Optimizer::kSgd;
    r.checkpointing = c;
    const std::vector<std::int64_t> ev = backward_events(trace_of(testing::gpt2_l2(), r), "mlp.c_proj");
    const auto sum = std::find(ev.begin(), ev.end(), bias);
    const auto gone = std::find(ev.begin(), ev.end(), -saved);
    ASSERT_NE(sum, ev.end());
    ASSERT_NE(gone, ev.end());
    EXPECT_EQ(gone < sum, c == Checkpointing::kFull);
  }
}

// Phi-3's qkv_proj slices: their views copy the gradients back (q's and k's always, the rotary
// embedding makes them [b, heads, s, d]; v's under bmm), and q[..., rotary_dim:], an empty slice,
// still makes a q-sized gradient (measured: the Phi-3 fp32 traces, every allocation).
TEST(GraphBackwardOrder, Phi3SlicesAndTheirCopies) {
  const Model m = testing::measured_config("phi-3-mini-4k-instruct-w512-l2");
  const std::int64_t piece = 2 * 16 * 512 * 4;  // b 2, s 16, 8 heads of 64, fp32
  for (Attention a : {Attention::kEager, Attention::kSdpa}) {
    SCOPED_TRACE(a == Attention::kEager ? "eager" : "sdpa");
    Recipe r = cpu_recipe(Precision::kFp32, a, 2, 16);
    r.optimizer = Optimizer::kSgd;
    const Trace t = trace_of(m, r);
    const std::vector<std::int64_t> clones = backward_events(t, "self_attn.clone");
    EXPECT_EQ(std::count(clones.begin(), clones.end(), piece), a == Attention::kEager ? 3 : 2);
    const std::vector<std::int64_t> rotary = backward_events(t, "self_attn.rotary");
    // per rotation: rotate_half's negation and two slice_backwards, the two products; then the
    // two empty slices' zeros
    EXPECT_EQ(std::count(rotary.begin(), rotary.end(), piece), 2 * 4 + 2);
  }
}

// A storage of no bytes holds no memory (a null pointer from either allocator): no events, so
// the replay never rounds it to a block. Phi-3's cat hands such a gradient to the empty q_pass
// under autocast, where validate_outputs casts it (measured: Phi-3 bf16-mixed traces).
TEST(GraphBackwardOrder, EmptyStoragesHoldNoMemory) {
  graph::Tape t;
  const graph::TensorId empty = t.alloc_bytes(0, Category::kTemporaries);
  const graph::TensorId one = t.alloc_bytes(4, Category::kTemporaries);
  t.release(empty);
  t.release(one);
  ASSERT_EQ(t.trace().events.size(), 2u);
  EXPECT_EQ(t.trace().events[0].tensor, one);
  EXPECT_EQ(t.trace().events[1].tensor, one);
}

// Under autocast the rotary embedding's products are fp32 (cos and sin are): their gradients are
// made in fp32 and cast back to q's dtype (measured: Llama bf16-mixed), and where bmm made the
// attention output its gradient's copy is in bmm's dtype, after the math kernel's cast back (fp16-
// mixed GPT-2 at b = 2).
TEST(GraphBackwardOrder, AutocastGradientsInTheProductsDtype) {
  Recipe r = cpu_recipe(Precision::kBf16Mixed, Attention::kSdpa, 1, 8);
  const std::vector<std::int64_t> rotary = backward_events(trace_of(small_llama(1), r), "self_attn.rotary");
  const std::int64_t k32 = 8 * 64 * 4;  // k: 8 tokens x 2 heads x 32, fp32
  ASSERT_GE(rotary.size(), 3u);
  EXPECT_EQ((std::vector<std::int64_t>(rotary.begin(), rotary.begin() + 3)),
            (std::vector<std::int64_t>{k32, k32 / 2, -k32}));
  Recipe g = cpu_recipe(Precision::kFp16Mixed, Attention::kSdpa, 2, 4);
  g.optimizer = Optimizer::kSgd;
  const std::vector<std::int64_t> ev = backward_events(trace_of(testing::gpt2_l2(), g), "attn.sdpa_math");
  const std::int64_t o32 = 2 * 4 * 768 * 4;
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev[0], o32);  // the cast's gradient back in fp32
  EXPECT_EQ(ev[2], o32);  // the copy for bmm (after the incoming gradient went)
}

// An RMSNorm's `weight * x.to(input_dtype)` under autocast: mul makes x's gradient in fp32, then
// (the weight's full-size product and reduction made) validate_outputs casts it to bf16
// (measured: Qwen3's k_norm under bf16-mixed).
TEST(GraphBackwardOrder, NormInputGradientIsCastAfterTheWeightsReduction) {
  json c = {{"model_type", "qwen3"}, {"hidden_size", 256}, {"intermediate_size", 688}, {"num_hidden_layers", 1},
            {"num_attention_heads", 8}, {"num_key_value_heads", 2}, {"head_dim", 32}, {"vocab_size", 1000}};
  const Model m = model_from_config_json(c.dump());
  const Trace t = trace_of(m, cpu_recipe(Precision::kBf16Mixed, Attention::kSdpa, 1, 8));
  const std::int64_t f32 = 8 * 2 * 32 * 4, bf16 = f32 / 2, weight = 32 * 4;  // k: 8 tokens x 2 heads x 32
  const std::vector<std::int64_t> ev = backward_events(t, "self_attn.k_norm");
  ASSERT_GE(ev.size(), 6u);
  // x's product, the weight's, the weight's reduction; the weight's product freed, x's cast, x's
  // product freed.
  EXPECT_EQ((std::vector<std::int64_t>(ev.begin(), ev.begin() + 6)),
            (std::vector<std::int64_t>{f32, f32, weight, -f32, bf16, -f32}));
}

// The engine routes a node's gradients (the sums into shared inputs) before the parameter's
// AccumulateGrad runs; in a second micro-batch AccumulateGrad adds the weight's gradient into
// .grad and frees it, so gate_proj's input sum is made while it is alive (measured: the
// cpu-llama1bl2-fp32-adamw8bit-fusedloss-ga2-b1s32 trace).
TEST(GraphBackwardOrder, SumsBeforeAccumulateGrad) {
  Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 1, 8);
  r.grad_accum = 2;
  const Trace t = trace_of(small_llama(1), r);
  const std::int64_t weight = 688 * 256 * 4, input = 8 * 256 * 4;
  const std::vector<std::int64_t> ev = backward_events(t, "mlp.gate_proj", 2);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(ev[0], weight);
  EXPECT_EQ(ev[1], input);
  const auto sum = std::find(ev.begin() + 2, ev.end(), input);
  const auto accumulated = std::find(ev.begin(), ev.end(), -weight);
  ASSERT_NE(sum, ev.end());
  ASSERT_NE(accumulated, ev.end());
  EXPECT_LT(sum - ev.begin(), accumulated - ev.begin());
}

// With a bias it is the other way round: F.linear reshapes the input before it transposes the
// weight, so the weight's AccumulateGrad (and the bias's, ahead of everything) add into .grad
// before the input's view hands its gradient to the shared buffer where k's and v's are summed
// (measured: Qwen2.5 w512 l2, fp32 SGD, seq 64, 2 micro-batches, every allocation).
TEST(GraphBackwardOrder, AccumulateGradBeforeSumsWithABias) {
  const Model m = testing::measured_config("qwen2.5-0.5b-w512-l2");
  Recipe r = cpu_recipe(Precision::kFp32, Attention::kSdpa, 1, 64);
  r.grad_accum = 2;
  r.optimizer = Optimizer::kSgd;
  const Trace t = trace_of(m, r);
  const std::int64_t input = 64 * 512 * 4, weight = 256 * 512 * 4, bias = 256 * 4;  // 4 KV heads of 64
  const std::vector<std::int64_t> ev = backward_events(t, "self_attn.k_proj", 2);
  const auto added = std::find(ev.begin(), ev.end(), -weight);
  const auto bias_added = std::find(ev.begin(), ev.end(), -bias);
  const auto sum = std::find(ev.begin() + 1, ev.end(), input);  // the first is mm's input gradient
  ASSERT_NE(added, ev.end());
  ASSERT_NE(bias_added, ev.end());
  ASSERT_NE(sum, ev.end());
  EXPECT_LT(bias_added - ev.begin(), added - ev.begin());
  EXPECT_LT(added - ev.begin(), sum - ev.begin());
}

// ---- buffers -------------------------------------------------------------------------------

// After setup the weights are the parameters plus the non-persistent buffers that
// tools/param_counts.py found on the real modules (rotary inv_freq/original_inv_freq, fp32 in
// both loads; Gemma-2's embed_scale in the load dtype).
TEST(GraphSetup, WeightsAreParametersPlusBuffers) {
  std::ifstream file(std::string(TRAINMEM_DATA_DIR) + "/models/param_counts.json");
  const json doc = json::parse(file);
  for (const auto& ref : doc.at("models")) {
    const std::string name = ref.at("name").get<std::string>();
    SCOPED_TRACE(name);
    const Model m = load_model(name);
    for (const auto& [precision, bytes, key] :
         {std::tuple{Precision::kFp32, 4u, "float32_load"}, std::tuple{Precision::kBf16True, 2u, "bfloat16_load"}}) {
      Recipe r = cpu_recipe(precision, Attention::kSdpa, 1, 1);
      r.steps = 1;
      const Live setup = live_before_first(trace_of(m, r), [](const MomentTag& t) { return t.phase != Phase::kSetup; });
      EXPECT_EQ(setup.raw[kWeights], bytes * m.parameter_count + ref.at("buffer_bytes").at(key).get<std::uint64_t>())
          << key;
    }
  }
}

// ---- whole estimates -----------------------------------------------------------------------

TEST(GraphEstimate, BreakdownSumsToThePeak) {
  const Model m = small_llama(2);
  for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16Master, Precision::kBf16True}) {
    for (Attention a : {Attention::kEager, Attention::kSdpa}) {
      for (AllocatorMode mode : {AllocatorMode::kDefault, AllocatorMode::kExpandable}) {
        Recipe r = cpu_recipe(p, a);
        r.allocator = mode;
        r.gpu = "h100-80gb";
        const Estimate e = estimate(m, r);
        std::uint64_t sum = 0;
        for (auto b : e.breakdown_at_peak) sum += b;
        SCOPED_TRACE(std::string(to_string(p)) + " " + std::string(to_string(a)) + " " + std::string(to_string(mode)));
        EXPECT_EQ(sum, e.peak_allocated_bytes);
        EXPECT_GE(e.peak_reserved_bytes, e.peak_allocated_bytes);
        ASSERT_EQ(e.steps.size(), 2u);
        EXPECT_EQ(std::max(e.steps[0].peak_allocated_bytes, e.steps[1].peak_allocated_bytes), e.peak_allocated_bytes);
        EXPECT_EQ(e.steps[e.peak.step - 1].peak_allocated_bytes, e.peak_allocated_bytes);
      }
    }
  }
}

// With expandable segments on the cpu device the peak is the largest sum of rounded live sizes.
TEST(GraphEstimate, ExpandablePeakIsTheLargestRoundedSum) {
  const Model m = small_llama(2);
  const Recipe r = cpu_recipe(Precision::kBf16Mixed, Attention::kEager);
  const Estimate e = estimate(m, r);
  const Trace t = trace_of(m, r);
  const std::uint64_t most = max_after(t, [](const MomentTag&) { return true; }, [](const Live& l) { return l.total_rounded(); });
  EXPECT_EQ(e.peak_allocated_bytes, most);
  EXPECT_EQ(e.events, t.events.size());
}

TEST(GraphEstimate, Deterministic) {
  const Model m = load_model("qwen3-0.6b");
  Recipe r;
  r.seq = 256;
  EstimateOptions opt;
  opt.timeline = true;
  opt.timeline_points = 50;
  const Estimate a = estimate(m, r, opt);
  const Estimate b = estimate(m, r, opt);
  EXPECT_EQ(a.peak_allocated_bytes, b.peak_allocated_bytes);
  EXPECT_EQ(a.peak_reserved_bytes, b.peak_reserved_bytes);
  EXPECT_EQ(a.breakdown_at_peak, b.breakdown_at_peak);
  EXPECT_EQ(a.peak.op, b.peak.op);
  EXPECT_EQ(a.peak.step, b.peak.step);
  EXPECT_EQ(a.events, b.events);
  ASSERT_EQ(a.timeline.size(), b.timeline.size());
  for (std::size_t k = 0; k < a.timeline.size(); ++k) {
    EXPECT_EQ(a.timeline[k].allocated_bytes, b.timeline[k].allocated_bytes);
    EXPECT_EQ(a.timeline[k].reserved_bytes, b.timeline[k].reserved_bytes);
  }
  const Trace t1 = trace_of(m, r), t2 = trace_of(m, r);
  ASSERT_EQ(t1.events.size(), t2.events.size());
  for (std::size_t k = 0; k < t1.events.size(); ++k) {
    ASSERT_EQ(t1.events[k].tensor, t2.events[k].tensor);
    ASSERT_EQ(t1.events[k].alloc, t2.events[k].alloc);
  }
}

// A one-layer model: its layer tensors have count 1 like the global ones.
TEST(GraphTrace, OneLayerModel) {
  json c = {{"model_type", "llama"},      {"hidden_size", 256},       {"intermediate_size", 688},
            {"num_hidden_layers", 1},     {"num_attention_heads", 8}, {"num_key_value_heads", 2},
            {"vocab_size", 1000}};
  const Model one = model_from_config_json(c.dump());
  const Dims x = kProbe;
  const Live live = live_before_first(trace_of(one, cpu_recipe(Precision::kBf16True, Attention::kEager)),
                                      first_backward_of(2));
  const std::uint64_t layer = 24 * x.bsh() + 8 * x.bsi() + 6 * x.bas2() + 8 * x.bs();
  const std::uint64_t outside = 8 * x.bsh() + 4 * x.bs() + 2 * (x.s * x.d * 2) + 4 * x.bsV() + 8 * x.bs() + 4;
  EXPECT_EQ(live.raw[kActs], layer + outside);
}

// Every storage is allocated once and freed at most once, never before it is allocated.
TEST(GraphTrace, EveryStorageHasOneLifetime) {
  const Model m = small_llama(2);
  for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull}) {
    for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16Master, Precision::kBf16True}) {
      for (Attention a : {Attention::kEager, Attention::kSdpa}) {
        Recipe r = cpu_recipe(p, a);
        r.checkpointing = c;
        r.grad_accum = 2;
        const Trace t = trace_of(m, r);
        std::vector<int> allocs(t.storages.size()), frees(t.storages.size());
        int bad = 0;
        for (const auto& e : t.events) {
          if (e.alloc) bad += (allocs[e.tensor]++ != 0 || frees[e.tensor] != 0);
          else bad += (allocs[e.tensor] != 1 || frees[e.tensor]++ != 0);
        }
        EXPECT_EQ(bad, 0) << to_string(p) << " " << to_string(a) << " " << to_string(c);
        // Only the parameters, buffers, optimizer states and the batch outlive the run.
        Live end;
        for (std::size_t i = 0; i < t.events.size(); ++i) apply(t, i, end);
        EXPECT_EQ(end.raw[kGrads] + end.raw[kActs] + end.raw[kTemps], 0u) << to_string(p) << " " << to_string(a);
      }
    }
  }
}

// matmul folds a [b, heads, s, d] operand laid out as [b, s, heads, d] (a projection view) into
// [b·heads, s, d] as a view when b = 1 and copies it when b > 1 (torch 2.13: expand + view, or
// expand + clone + _unsafe_view); eager attention's q @ k^T shows it.
TEST(GraphActivations, EagerMatmulCopiesStridedOperandsOnlyForBatchAboveOne) {
  json c = {{"model_type", "llama"},     {"hidden_size", 256},       {"intermediate_size", 688},
            {"num_hidden_layers", 1},    {"num_attention_heads", 8}, {"num_key_value_heads", 8},
            {"vocab_size", 1000}};
  const Model m = model_from_config_json(c.dump());  // no GQA: repeat_kv copies nothing
  for (std::uint64_t b : {1u, 2u}) {
    const Trace t = trace_of(m, cpu_recipe(Precision::kFp32, Attention::kEager, b, 64));
    int copies = 0;
    for (const graph::Event& e : t.events) {
      const MomentTag& mt = t.moments[e.moment];
      if (e.alloc && mt.step == 1 && mt.phase == Phase::kForward && mt.op == "self_attn.attn_weights" &&
          t.storages[e.tensor].bytes == b * 64 * 256 * 4) {
        ++copies;
      }
    }
    EXPECT_EQ(copies, b == 1 ? 0 : 2) << "batch " << b;  // q and k^T
  }
}

// ---- LoRA (Note [LoRA] in src/graph/step_parameters.cpp) -------------------------------

// A recipe with peft adapters; `targets` are the resolved module paths estimate() hands on.
Recipe lora_recipe(Precision p, std::vector<std::string> targets, std::uint64_t rank = 8) {
  Recipe r = cpu_recipe(p, Attention::kSdpa);
  r.lora.rank = rank;
  r.lora.targets = std::move(targets);
  return r;
}

// (in, out) of each projection of odd_llama's layers: h = 200, 4 heads of d = 50, 2 KV heads,
// i = 530.
struct Proj {
  const char* path;
  std::uint64_t in, out;
};
constexpr Proj kOddProjections[] = {
    {"self_attn.q_proj", 200, 200}, {"self_attn.k_proj", 200, 100}, {"self_attn.v_proj", 200, 100},
    {"self_attn.o_proj", 200, 200}, {"mlp.gate_proj", 200, 530},    {"mlp.up_proj", 200, 530},
    {"mlp.down_proj", 530, 200},
};

std::vector<std::string> all_paths() {
  std::vector<std::string> v;
  for (const Proj& p : kOddProjections) v.push_back(p.path);
  return v;
}

// Σ over targeted projections and layers of f(A numel) + f(B numel).
std::uint64_t over_adapters(const std::vector<std::string>& targets, std::uint64_t layers, std::uint64_t r,
                            const std::function<std::uint64_t(std::uint64_t)>& f) {
  std::uint64_t sum = 0;
  for (const Proj& p : kOddProjections) {
    if (std::find(targets.begin(), targets.end(), p.path) == targets.end()) continue;
    sum += layers * (f(r * p.in) + f(p.out * r));
  }
  return sum;
}

// The optimizer updates r·(in + out) elements per targeted projection and layer; nothing else.
TEST(GraphLora, TrainableParametersAreTheAdapters) {
  const Model m = odd_llama();
  for (const auto& targets : {std::vector<std::string>{"self_attn.q_proj", "self_attn.v_proj"}, all_paths()}) {
    for (std::uint64_t rank : {1u, 8u, 64u}) {
      const Trace t = trace_of(m, lora_recipe(Precision::kBf16Mixed, targets, rank));
      EXPECT_EQ(t.trainable_parameters, over_adapters(targets, 2, rank, [](std::uint64_t n) { return n; }));
    }
  }
  // q_proj + v_proj at rank 8: 2 layers · 8 · ((200 + 200) + (200 + 100)).
  EXPECT_EQ(trace_of(m, lora_recipe(Precision::kFp32, {"self_attn.q_proj", "self_attn.v_proj"})).trainable_parameters,
            2u * 8 * (400 + 300));
  EXPECT_EQ(trace_of(m, cpu_recipe(Precision::kFp32, Attention::kSdpa)).trainable_parameters, m.parameter_count);
}

// Frozen parameters get no .grad and no optimizer state: at step 2's optimizer the gradients are
// the adapters' (fp32 under every precision: peft's autocast_adapter_dtype), the AdamW states
// two fp32 tensors per adapter plus its step counter (a device tensor on the cpu), and the
// weights the base model in its dtype plus the fp32 adapters.
TEST(GraphLora, NoGradientsOrStatesForFrozenParameters) {
  const Model m = odd_llama();
  const std::vector<std::string> targets = all_paths();
  const std::uint64_t a4 = over_adapters(targets, 2, 8, [](std::uint64_t n) { return round512(4 * n); });
  const std::uint64_t tensors = over_adapters(targets, 2, 8, [](std::uint64_t) { return 1; });
  for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kFp16Mixed, Precision::kBf16True,
                      Precision::kFp16True}) {
    SCOPED_TRACE(std::string(to_string(p)));
    const Trace t = trace_of(m, lora_recipe(p, targets));
    const Live at_step = live_before_first(t, in(2, Phase::kOptimizer));
    EXPECT_EQ(at_step.rounded[kGrads], a4);
    const Live step2 = live_before_first(t, in(2, Phase::kForward));
    EXPECT_EQ(step2.rounded[kStates], 2 * a4 + 512 * tensors);
    const std::uint64_t base = rounded_params(m, (p == Precision::kBf16True || p == Precision::kFp16True) ? 2 : 4);
    EXPECT_EQ(step2.rounded[kWeights], base + rope_buffers_rounded(m) + a4);
    EXPECT_EQ(step2.rounded[kGrads], 0u);
  }
}

// With bf16/fp16 base weights peft makes the adapters in the base dtype, then replaces each by
// an fp32 copy (cast_adapter_dtype): both exist only during setup.
TEST(GraphLora, HalfAdaptersAreReplacedByFp32Copies) {
  const Model m = odd_llama();
  const std::vector<std::string> targets = {"self_attn.q_proj", "self_attn.v_proj"};
  const Trace t = trace_of(m, lora_recipe(Precision::kBf16True, targets));
  const std::uint64_t a2 = over_adapters(targets, 2, 8, [](std::uint64_t n) { return round512(2 * n); });
  const std::uint64_t a4 = over_adapters(targets, 2, 8, [](std::uint64_t n) { return round512(4 * n); });
  const std::uint64_t setup_peak = max_after(t, [](const MomentTag& mt) { return mt.phase == Phase::kSetup; },
                                             [](const Live& l) { return l.rounded[kWeights]; });
  const std::uint64_t base = rounded_params(m, 2) + rope_buffers_rounded(m);
  EXPECT_GT(setup_peak, base + a4);  // a half adapter and its fp32 copy coexist once
  EXPECT_LE(setup_peak, base + a2 + a4);
  EXPECT_EQ(live_before_first(t, in(1, Phase::kForward)).rounded[kWeights], base + a4);
}

// Autograd records nothing before the first adapter: the embedding and layer 0's input norm
// save nothing, and with adapters on down_proj only layer 0's attention saves nothing either.
TEST(GraphLora, NothingIsSavedBeforeTheFirstAdapter) {
  const Model m = odd_llama();
  const Trace t = trace_of(m, lora_recipe(Precision::kBf16Mixed, {"mlp.down_proj"}));
  int saved_early = 0, saved_later = 0;
  bool early = true;  // each forward, until layer 0's down_proj
  for (const graph::Event& e : t.events) {
    const MomentTag& mt = t.moments[e.moment];
    if (mt.phase != Phase::kForward) continue;
    if (mt.op == "embed_tokens") early = true;
    if (mt.layer == 0 && mt.op.substr(0, 13) == "mlp.down_proj") early = false;
    if (!e.alloc || t.storages[e.tensor].category != Category::kActivations) continue;
    if (mt.layer != 0 && mt.op != "embed_tokens") continue;  // cos/sin: later layers save them
    (early ? saved_early : saved_later) += 1;
  }
  EXPECT_EQ(saved_early, 0);
  EXPECT_GT(saved_later, 0);
}

// A decoder layer whose input requires grad, fp32, SDPA, adapters on q_proj and v_proj (no
// dropout). Frozen projections save their weight (the parameter: no bytes), not their input,
// and the norms' weight products save nothing; lora_A saves its input (the norm output, shared
// by both adapters) and lora_B the b·s·r output of lora_A:
//   A_layer = 4·(5·bsh + 2·bsh·kv/a + 3·bsi + 2·bs + bas + 2·bs·r)
// against full fine-tuning's 4·(8·bsh + 2·bsh·kv/a + 4·bsi + 2·bs + bas) (both norms' outputs,
// the MLP input and down_proj's input are saved there for the weights' gradients).
TEST(GraphActivations, LoraFp32SdpaPerLayer) {
  const Dims x = kProbe;
  const std::uint64_t r = 8;
  auto layer_saves = [&](bool lora) {
    auto acts = [&](std::uint64_t layers) {
      Recipe rc = lora ? lora_recipe(Precision::kFp32, {"self_attn.q_proj", "self_attn.v_proj"}, r)
                       : cpu_recipe(Precision::kFp32, Attention::kSdpa);
      return live_before_first(trace_of(small_llama(layers), rc), first_backward_of(2)).raw[kActs];
    };
    return acts(3) - acts(2);
  };
  EXPECT_EQ(layer_saves(false), 4 * (8 * x.bsh() + 2 * x.bsh_kv() + 4 * x.bsi() + 2 * x.bs() + x.bas()));
  EXPECT_EQ(layer_saves(true),
            4 * (5 * x.bsh() + 2 * x.bsh_kv() + 3 * x.bsi() + 2 * x.bs() + x.bas() + 2 * x.bs() * r));
}

// Under autocast a frozen weight is cast at every use (only casts of leaves that require grad
// are cached): the casts a layer's backward needs stay alive as saved tensors, counted as
// weights, while the adapters' casts are cached once. For a layer whose input requires grad
// all seven projections keep their bf16 weight: 2 bytes per element of the layer's weights.
TEST(GraphLora, FrozenWeightCastsAreSavedPerUse) {
  const std::uint64_t layer_weights = 256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 688;  // q, o; k, v; mlp
  auto weights_at_backward = [&](std::uint64_t layers) {
    return live_before_first(trace_of(small_llama(layers), lora_recipe(Precision::kBf16Mixed, {"self_attn.q_proj"})),
                             first_backward_of(2)).raw[kWeights];
  };
  // One more layer: its fp32 weights, its adapters (fp32 + their cached bf16 casts), and the
  // bf16 casts its saved nodes keep.
  const std::uint64_t adapters = 8 * (256 + 256);
  EXPECT_EQ(weights_at_backward(3) - weights_at_backward(2),
            4 * layer_weights + 4 * 2 * 256 /* norms */ + 6 * adapters + 2 * layer_weights);
}

// With activation checkpointing transformers marks the embeddings' output as requiring grad
// (enable_input_require_grads): a leaf kept until the end of backward.
TEST(GraphLora, CheckpointingKeepsTheEmbeddingOutputLeaf) {
  const Model m = odd_llama();
  Recipe r = lora_recipe(Precision::kFp32, {"self_attn.q_proj"});
  r.checkpointing = Checkpointing::kFull;
  const Trace t = trace_of(m, r);
  std::vector<Phase> freed_in(t.storages.size(), Phase::kSetup);
  for (const graph::Event& e : t.events) {
    if (!e.alloc) freed_in[e.tensor] = t.moments[e.moment].phase;
  }
  int embeddings = 0;
  for (const graph::Event& e : t.events) {
    const MomentTag& mt = t.moments[e.moment];
    if (!e.alloc || mt.phase != Phase::kForward || mt.op != "embed_tokens" || mt.recompute) continue;
    ++embeddings;
    EXPECT_EQ(freed_in[e.tensor], Phase::kBackward);
  }
  EXPECT_EQ(embeddings, 2);  // one per step
  // The leaf's gradient (AccumulateGrad steals it into .grad) goes with it, just before it, after
  // the loss (measured: the ZeRO-1 QLoRA trace with checkpointing, the last two frees of backward).
  std::vector<std::pair<bool, std::uint64_t>> backward;
  for (const graph::Event& e : t.events) {
    const MomentTag& mt = t.moments[e.moment];
    if (mt.step == 1 && mt.phase == Phase::kBackward) backward.emplace_back(e.alloc, t.storages[e.tensor].bytes);
  }
  const std::uint64_t hidden = 4 * r.batch * r.seq * m.arch.hidden_size;
  ASSERT_GE(backward.size(), 3u);
  EXPECT_EQ((std::vector<std::pair<bool, std::uint64_t>>(backward.end() - 2, backward.end())),
            (std::vector<std::pair<bool, std::uint64_t>>{{false, hidden}, {false, hidden}}));
}

// ---- QLoRA (Note [QLoRA] in src/graph/quant.h) -----------------------------------------

Recipe qlora_recipe(Precision p, bool double_quant) {
  Recipe r = lora_recipe(p, {"self_attn.q_proj", "self_attn.v_proj"});
  r.quant.load_in_4bit = true;
  r.quant.quant_type = QuantType::kNf4;
  r.quant.double_quant = double_quant;
  return r;
}

// The base's weights: each linear weight of the layers as bitsandbytes stores it (packed uint8
// plus its QuantState's tensors, each its own storage), every other parameter fp32 whatever the
// precision (prepare_model_for_kbit_training), the adapters fp32.
TEST(GraphQlora, WeightsArePackedAndTheRestFp32) {
  const Model m = odd_llama();
  const std::vector<std::string> targets = {"self_attn.q_proj", "self_attn.v_proj"};
  const std::uint64_t a4 = over_adapters(targets, 2, 8, [](std::uint64_t n) { return round512(4 * n); });
  for (bool dq : {false, true}) {
    std::uint64_t base = 0;
    for (const ParameterGroup& g : m.parameters) {
      const bool packed = g.matmul_weight && g.name.find(".N.") != std::string::npos;
      std::uint64_t one = round512(4 * g.numel);
      if (packed) {
        const graph::Packed4bit q = graph::packed_4bit(g.numel, dq);
        one = 0;
        for (std::uint64_t b : {q.packed_bytes, q.absmax_bytes, q.code_bytes, q.offset_bytes, q.nested_absmax_bytes,
                                q.nested_code_bytes}) {
          if (b != 0) one += round512(b);
        }
      }
      base += one * g.count;
    }
    for (Precision p : {Precision::kBf16True, Precision::kFp32}) {
      SCOPED_TRACE(std::string(to_string(p)) + (dq ? " double quant" : ""));
      const Trace t = trace_of(m, qlora_recipe(p, dq));
      EXPECT_EQ(live_before_first(t, in(2, Phase::kForward)).rounded[kWeights], base + rope_buffers_rounded(m) + a4);
    }
  }
}

// Every 4-bit matmul dequantizes its whole weight to the precision's dtype, in the forward and
// again in the backward of each layer whose input needs a gradient (with q_proj and v_proj
// adapters: every layer's down_proj; layer 0's k_proj input needs none).
TEST(GraphQlora, DequantizedCopyPerMatmul) {
  const Model m = odd_llama();
  const Trace t = trace_of(m, qlora_recipe(Precision::kBf16True, true));
  auto count = [&](Phase phase, const char* op, std::uint64_t bytes) {
    int n = 0;
    for (const graph::Event& e : t.events) {
      const MomentTag& mt = t.moments[e.moment];
      if (e.alloc && mt.step == 1 && mt.phase == phase && mt.op == op && t.storages[e.tensor].bytes == bytes) ++n;
    }
    return n;
  };
  EXPECT_EQ(count(Phase::kForward, "mlp.down_proj", 530u * 200 * 2), 2);
  EXPECT_EQ(count(Phase::kBackward, "mlp.down_proj", 530u * 200 * 2), 2);
  EXPECT_EQ(count(Phase::kForward, "self_attn.k_proj", 200u * 100 * 2), 2);
  EXPECT_EQ(count(Phase::kBackward, "self_attn.k_proj", 200u * 100 * 2), 1);
  // Double quant: the fp32 absmax per block of 64 (530·200/64 → 1657 blocks), twice in the
  // forward (dequantize_blockwise, then + offset) and once in the backward.
  EXPECT_EQ(count(Phase::kForward, "mlp.down_proj", 1657u * 4), 4);
  EXPECT_EQ(count(Phase::kBackward, "mlp.down_proj", 1657u * 4), 2);
}

// Under autocast (bf16-mixed) the base was loaded in fp32, so MatMul4Bit's backward dequantizes
// the weight in fp32 and casts it to the bf16 gradient's dtype: the fp32 copy dies as the cast is
// made, before grad_A (measured: the DDP QLoRA entry of data/ground_truth/parallel/ whose peak is
// at layer 3's down_proj in backward). The forward dequantizes straight to bf16, as before.
TEST(GraphQlora, AutocastBackwardDequantizesInTheLoadDtype) {
  const Model m = odd_llama();
  const std::uint64_t numel = 530u * 200;
  // Step 1 of layer 1's down_proj: (forward bf16 copies, forward fp32 copies), then the backward's
  // weight copies as (alloc, bytes).
  auto copies = [&](const Trace& t) {
    std::vector<std::pair<bool, std::uint64_t>> seen;
    int forward_bf16 = 0, forward_fp32 = 0;
    for (const graph::Event& e : t.events) {
      const MomentTag& mt = t.moments[e.moment];
      if (mt.step != 1 || mt.layer != 1 || mt.op != "mlp.down_proj") continue;
      const std::uint64_t bytes = t.storages[e.tensor].bytes;
      if (mt.phase == Phase::kForward && e.alloc) {
        forward_bf16 += bytes == numel * 2;
        forward_fp32 += bytes == numel * 4;
      }
      if (mt.phase == Phase::kBackward && (bytes == numel * 2 || bytes == numel * 4)) seen.emplace_back(e.alloc, bytes);
    }
    EXPECT_EQ(forward_bf16, 1) << "the forward dequantizes to the input's dtype directly";
    EXPECT_EQ(forward_fp32, 0);
    return seen;
  };
  Recipe r = qlora_recipe(Precision::kBf16Mixed, false);
  const std::vector<std::pair<bool, std::uint64_t>> fp32_load = {
      {true, numel * 4}, {true, numel * 2}, {false, numel * 4}, {false, numel * 2}};
  EXPECT_EQ(copies(trace_of(m, r)), fp32_load);
  // A base loaded in bf16 (Note [The load dtype of a 4-bit base]): one bf16 weight, no cast.
  r.load_dtype = LoadDtype::kBf16;
  r.validate();
  const std::vector<std::pair<bool, std::uint64_t>> bf16_load = {{true, numel * 2}, {false, numel * 2}};
  EXPECT_EQ(copies(trace_of(m, r)), bf16_load);
}

// Qwen2's q/k/v biases under QLoRA: fp32 after prepare_model_for_kbit_training, recast to the
// compute dtype by Linear4bit's first forward (a new half storage, the fp32 one freed), once.
TEST(GraphQlora, BiasesRecastInTheFirstForward) {
  json c = {{"model_type", "qwen2"}, {"hidden_size", 64},  {"intermediate_size", 128}, {"num_hidden_layers", 2},
            {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"vocab_size", 100}};
  const Model m = model_from_config_json(c.dump());
  auto recasts = [&](const Trace& t, int step, bool alloc, std::uint64_t bytes) {
    int n = 0;
    for (const graph::Event& e : t.events) {
      const MomentTag& mt = t.moments[e.moment];
      const graph::Storage& s = t.storages[e.tensor];
      if (e.alloc == alloc && mt.step == step && mt.phase == Phase::kForward && s.category == Category::kWeights &&
          s.bytes == bytes && (mt.op == "self_attn.q_proj" || mt.op == "self_attn.k_proj" || mt.op == "self_attn.v_proj"))
        ++n;
    }
    return n;
  };
  const Trace half = trace_of(m, qlora_recipe(Precision::kBf16True, false));
  // Per layer: q (64 wide) and k, v (32 wide each), bf16 made, fp32 freed.
  EXPECT_EQ(recasts(half, 1, true, 64 * 2) + recasts(half, 1, true, 32 * 2), 2 * 3);
  EXPECT_EQ(recasts(half, 1, false, 64 * 4) + recasts(half, 1, false, 32 * 4), 2 * 3);
  EXPECT_EQ(recasts(half, 2, true, 64 * 2) + recasts(half, 2, true, 32 * 2), 0);
  const Trace full = trace_of(m, qlora_recipe(Precision::kFp32, false));
  EXPECT_EQ(recasts(full, 1, true, 64 * 4) + recasts(full, 1, true, 32 * 4), 0);
  EXPECT_EQ(recasts(full, 1, false, 64 * 4) + recasts(full, 1, false, 32 * 4), 0);
}

}  // namespace
}  // namespace trainmem
