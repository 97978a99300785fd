// Tests for a training forward's attention masks (Note [Training masks] in src/graph/step.cpp),
// for forwards that keep no saved tensors (Note [Forwards without saves] in src/graph/tape.h)
// and for the phase peaks that check both (EstimateOptions::phases). Byte-exactness against
// real runs is held by the cpu-gemma2w512l2-*, cpu-phi3w512l2win128-*, cpu-mistralv01w512l2win128-*
// and cpu-qwen25w512l2slide128-* measurements, phase by phase (tests/python/test_accuracy.py).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "graph/step.h"
#include "model/model.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using testing::measured_config;

Recipe cpu(Precision precision, Attention attention, std::uint64_t batch = 2, std::uint64_t seq = 256) {
  Recipe r;
  r.batch = batch;
  r.seq = seq;
  r.precision = precision;
  r.optimizer = Optimizer::kSgd;
  r.attention = attention;
  r.gpu = "cpu";
  r.allocator = AllocatorMode::kExpandable;
  return r;
}

// The masks that step 1's forward holds when its first layer starts: storages of mask_bytes
// allocated under each mask kind's label and not freed by then, by kind.
struct MaskCount {
  int causal = 0, sliding = 0;
};
MaskCount masks_of(const Model& m, const Recipe& r, std::uint64_t mask_bytes) {
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu));
  std::vector<std::pair<graph::TensorId, bool>> live;  // (storage, sliding)
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mo = t.moments[e.moment];
    if (mo.step != 1) continue;
    if (mo.layer == 0) break;
    if (!e.alloc) {
      std::erase_if(live, [&](const auto& x) { return x.first == e.tensor; });
    } else if (t.storages[e.tensor].bytes == mask_bytes && (mo.op == std::string_view("causal_mask") ||
                                                            mo.op == std::string_view("sliding_window_mask"))) {
      live.emplace_back(e.tensor, mo.op == std::string_view("sliding_window_mask"));
    }
  }
  MaskCount n;
  for (const auto& x : live) ++(x.second ? n.sliding : n.causal);
  return n;
}

// Gemma-2 builds both kinds (eager, whatever the sequence), Llama the causal one; under SDPA a
// mask exists only where a sliding window is reached, as the bool [1, 1, s, s].
TEST(TrainingMasks, EachModelBuildsItsKinds) {
  const std::uint64_t B = 2, S = 256;
  const MaskCount gemma =
      masks_of(measured_config("gemma-2-2b-w512-l2"), cpu(Precision::kFp32, Attention::kEager), B * S * S * 4);
  EXPECT_EQ(gemma.causal, 1);
  EXPECT_EQ(gemma.sliding, 1);
  const MaskCount llama = masks_of(testing::llama_w512(), cpu(Precision::kFp32, Attention::kEager), B * S * S * 4);
  EXPECT_EQ(llama.causal, 1);
  EXPECT_EQ(llama.sliding, 0);
  const Model phi3 = measured_config("phi-3-mini-4k-instruct-w512-l2-win128");  // window 128
  const MaskCount reached = masks_of(phi3, cpu(Precision::kFp32, Attention::kSdpa), S * S);
  EXPECT_EQ(reached.causal, 0);
  EXPECT_EQ(reached.sliding, 1);
  const MaskCount short_seq = masks_of(phi3, cpu(Precision::kFp32, Attention::kSdpa, B, 64), 64 * 64);
  EXPECT_EQ(short_seq.sliding, 0);
  const MaskCount sdpa_llama = masks_of(testing::llama_w512(), cpu(Precision::kFp32, Attention::kSdpa), S * S);
  EXPECT_EQ(sdpa_llama.causal + sdpa_llama.sliding, 0);
}

std::uint64_t phase_peak(const Estimate& e, std::uint64_t step, Phase phase) {
  for (const PhasePeak& p : e.phases) {
    if (p.step == step && p.micro_batch == 1 && p.phase == phase) return p.peak_allocated_bytes;
  }
  ADD_FAILURE() << "no phase " << phase_name(phase) << " in step " << step;
  return 0;
}

// A reached window makes SDPA save a float [b, 1, s, s] mask of q's dtype in every layer until
// that layer's backward: the forward holds one per layer (and the bool mask) more than the same
// model with its window out of reach.
TEST(TrainingMasks, AReachedWindowSavesAFloatMaskPerLayer) {
  const Model phi3 = measured_config("phi-3-mini-4k-instruct-w512-l2-win128");
  Model wide = phi3;
  wide.arch.sliding_window = 4096;  // not reached at seq 256
  const Recipe r = cpu(Precision::kFp32, Attention::kSdpa);
  EstimateOptions o;
  o.phases = true;
  const Estimate masked = estimate(phi3, r, o), plain = estimate(wide, r, o);
  const std::uint64_t mask = 2 * 256 * 256 * 4;
  const std::uint64_t layers = phi3.arch.num_layers;
  const std::uint64_t fwd = phase_peak(masked, 2, Phase::kForward), fwd_plain = phase_peak(plain, 2, Phase::kForward);
  EXPECT_GE(fwd, fwd_plain + layers * mask);
  EXPECT_LE(fwd, fwd_plain + (layers + 1) * mask + 256 * 256);  // and the bool mask, no more
  EXPECT_GT(masked.peak_allocated_bytes, plain.peak_allocated_bytes);
}

// Tensor-parallel ranks build the model's masks and attend over their local heads with them: the
// measured cpu-tp2-mistralv01w512l2win128-fp32-sgd-b1s256 (SDPA past the window). Context
// parallelism's ring is not modelled with a mask.
TEST(TrainingMasks, AReachedWindowIsModelledUnderTensorParallelismNotInARing) {
  Recipe r = cpu(Precision::kFp32, Attention::kSdpa, 1);
  r.tp = 2;
  const Model mistral = measured_config("mistral-7b-v0.1-w512-l2-win128");
  EXPECT_EQ(estimate(mistral, r).peak_allocated_bytes, 45'540'352u);
  r.tp = 1;
  r.cp = 2;
  r.gpu = "h100-80gb";  // a ring needs a CUDA device
  EXPECT_NE(testing::error_of([&] { estimate(mistral, r); }).find("not modelled under context parallelism"),
            std::string::npos);
  r.seq = 64;
  EXPECT_NO_THROW(estimate(mistral, r));
}

// The planner does not offer what the engine refuses there: a search at the window's length on
// several GPUs returns plans, none with context parallelism (it aborted on the first such
// candidate before), and tensor parallelism among them (refused there until session 28).
TEST(TrainingMasks, ThePlannerSkipsAReachedWindowsRefusals) {
  FitRequest q;
  q.base.seq = 4096;  // Mistral v0.1's window
  q.gpus = 8;
  const FitResult fr = fit(load_model("mistral-7b-v0.1"), q);
  ASSERT_FALSE(fr.plans.empty());
  bool tensor_parallel = false;
  for (const Plan& p : fr.plans) {
    EXPECT_EQ(p.recipe.cp, 1u);
    tensor_parallel = tensor_parallel || p.recipe.tp > 1;
  }
  EXPECT_TRUE(tensor_parallel);
}

// Whether the storage first allocated under op `made` (of `bytes`, unless 0) in layer 0's first
// forward of step 1 is still live when op `later` next allocates there.
bool alive_at(const graph::Trace& t, std::string_view made, std::string_view later, std::uint64_t bytes = 0) {
  graph::TensorId id = graph::kNone;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mo = t.moments[e.moment];
    if (mo.step != 1 || mo.layer != 0 || mo.recompute || mo.phase != Phase::kForward) continue;
    if (e.alloc && mo.op == made && id == graph::kNone && (bytes == 0 || t.storages[e.tensor].bytes == bytes)) {
      id = e.tensor;
    }
    if (!e.alloc && e.tensor == id) return false;
    if (e.alloc && mo.op == later && id != graph::kNone) return true;
  }
  return false;
}

// A checkpoint's first forward keeps no saved tensors, so the modules' Python locals decide: the
// fused qkv projection (viewed by q, k, v) lives until o_proj has run, Phi-3's fused gate_up
// output (its `gate` chunk) until down_proj has. Either variant of checkpointing.
TEST(ForwardsWithoutSaves, TheModulesLocalsLiveUntilTheyReturn) {
  const Model phi3 = measured_config("phi-3-mini-4k-instruct-w512-l2-win128");
  for (Checkpointing c : {Checkpointing::kFull, Checkpointing::kFullReentrant}) {
    Recipe r = cpu(Precision::kFp32, Attention::kSdpa, 2, 64);
    r.checkpointing = c;
    const graph::Trace t = graph::build_training_trace(phi3, r, find_gpu(r.gpu));
    EXPECT_TRUE(alive_at(t, "self_attn.qkv_proj", "self_attn.o_proj")) << to_string(c);
    EXPECT_TRUE(alive_at(t, "mlp.gate_up_proj", "mlp.down_proj")) << to_string(c);
  }
}

// GPT2Block names the attention's and the MLP's outputs apart, so its hidden_states holds ln_1's
// (ln_2's) output until the residual add rebinds it. Under autocast the projections save a cast
// copy, and that name is all that holds the norm's fp32 output (measured:
// cpu-gpt2-bf16mixed-adamw-fusedloss-ga2-b1s8's forward phases).
TEST(ForwardsWithoutSaves, GPT2BlockHoldsItsNormOutputsToTheAdds) {
  const Recipe r = cpu(Precision::kBf16Mixed, Attention::kSdpa, 2, 64);
  const graph::Trace t = graph::build_training_trace(testing::gpt2_l2(), r, find_gpu(r.gpu));
  const std::uint64_t hidden_fp32 = 2 * 64 * 768 * 4;
  EXPECT_TRUE(alive_at(t, "ln_1", "residual_add", hidden_fp32));
  EXPECT_TRUE(alive_at(t, "ln_2", "residual_add", hidden_fp32));
}

// Every phase of every micro-batch is listed once, in order of its first event, and a step's
// peak is its highest phase's.
TEST(PhasePeaks, EveryPhaseOnceAndTheStepPeakAmongThem) {
  Recipe r = cpu(Precision::kBf16Mixed, Attention::kSdpa, 1, 64);
  r.grad_accum = 2;
  r.checkpointing = Checkpointing::kFull;
  EstimateOptions o;
  o.phases = true;
  const Estimate e = estimate(testing::llama_w512(), r, o);
  ASSERT_EQ(e.phases.size(), 1u + 2 * (2 * 3 + 1));  // setup; per step 2 x (forward, loss, backward), optimizer
  EXPECT_EQ(e.phases[0].phase, Phase::kSetup);
  for (std::uint64_t step = 1; step <= 2; ++step) {
    std::uint64_t top = 0;
    for (const PhasePeak& p : e.phases) {
      if (p.step == step) top = std::max(top, p.peak_allocated_bytes);
    }
    EXPECT_EQ(top, e.steps[step - 1].peak_allocated_bytes);
  }
  // Recomputed layers count to backward, as the measuring side labels them: step 2's forward
  // peak is the most live bytes (512-byte blocks, what the CPU's allocated bytes are) after a
  // forward event that is not a recompute.
  const graph::Trace t = graph::build_training_trace(testing::llama_w512(), r, find_gpu(r.gpu));
  std::uint64_t live = 0, forward = 0;
  for (const graph::Event& ev : t.events) {
    const std::uint64_t b = std::max<std::uint64_t>(512, (t.storages[ev.tensor].bytes + 511) / 512 * 512);
    live = ev.alloc ? live + b : live - b;
    const graph::MomentTag& mo = t.moments[ev.moment];
    if (mo.step == 2 && mo.micro == 1 && mo.phase == Phase::kForward && !mo.recompute) {
      forward = std::max(forward, live);
    }
  }
  EXPECT_EQ(phase_peak(e, 2, Phase::kForward), forward);
  EXPECT_TRUE(estimate(testing::llama_w512(), r).phases.empty());  // only when asked for
}

// Note [Padding masks]: a batch's attention_mask of ones changes nothing under SDPA (the mask is
// skipped as without one) and nothing under eager attention (the float mask is built either way);
// with padding SDPA gets the bool [b, 1, s, s] mask, no longer an expanded view.
TEST(PaddingMasks, OnesKeepTheMasksPaddingMakesTheSdpaOne) {
  const std::uint64_t B = 2, S = 256;
  const Model llama = testing::llama_w512();
  for (AttentionMask m : {AttentionMask::kNone, AttentionMask::kOnes, AttentionMask::kPadded}) {
    SCOPED_TRACE(std::string(to_string(m)));
    Recipe eager = cpu(Precision::kFp32, Attention::kEager), sdpa = cpu(Precision::kFp32, Attention::kSdpa);
    eager.attention_mask = sdpa.attention_mask = m;
    EXPECT_EQ(masks_of(llama, eager, B * S * S * 4).causal, 1);
    EXPECT_EQ(masks_of(llama, sdpa, B * S * S).causal, m == AttentionMask::kPadded ? 1 : 0);
  }
}

// Padding under SDPA saves a float [b, 1, s, s] mask of q's dtype in every layer, as a reached
// window does; eager attention allocates the same with a mask of ones or with padding.
TEST(PaddingMasks, PaddingUnderSdpaSavesAFloatMaskPerLayer) {
  const Model llama = testing::llama_w512();
  Recipe r = cpu(Precision::kFp32, Attention::kSdpa);
  EstimateOptions o;
  o.phases = true;
  const Estimate plain = estimate(llama, r, o);
  r.attention_mask = AttentionMask::kPadded;
  const Estimate padded = estimate(llama, r, o);
  const std::uint64_t B = 2, S = 256, mask = B * S * S * 4, layers = llama.arch.num_layers;
  const std::uint64_t fwd = phase_peak(padded, 2, Phase::kForward), fwd_plain = phase_peak(plain, 2, Phase::kForward);
  EXPECT_GE(fwd, fwd_plain + layers * mask);
  // And K and V repeated to the query heads (a mask turns native GQA off), the bool mask and the
  // batch's int64 attention_mask, no more.
  const Architecture& a = llama.arch;
  const std::uint64_t repeats = layers * 2 * B * S * (a.num_heads - a.num_kv_heads) * a.head_dim * 4;
  EXPECT_LE(fwd, fwd_plain + (layers + 1) * mask + repeats + B * S * S + B * S * 8 + 512);
  r.attention = Attention::kEager;
  r.attention_mask = AttentionMask::kOnes;
  const Estimate ones = estimate(llama, r);
  r.attention_mask = AttentionMask::kPadded;
  EXPECT_EQ(estimate(llama, r).peak_allocated_bytes, ones.peak_allocated_bytes);
}

TEST(PaddingMasks, WhereTheMaskIsNotModelledItIsRefused) {
  const Model llama = testing::llama_w512();
  Recipe r = cpu(Precision::kFp32, Attention::kFlash);
  r.gpu = "h100-80gb";  // flash needs a CUDA GPU and half tensors
  r.precision = Precision::kBf16Mixed;
  r.attention_mask = AttentionMask::kPadded;
  EXPECT_NE(testing::error_of([&] { r.validate(); }).find("flash-attention unpads"), std::string::npos);
  r.attention = Attention::kSdpa;
  r.tp = 2;
  EXPECT_NO_THROW(r.validate());  // measured: parallel/cpu-tp2*-llamaw512l4-*-pad-*
  r.tp = 1;
  r.cp = 2;
  EXPECT_NE(testing::error_of([&] { r.validate(); }).find("pipeline or context parallelism"), std::string::npos);
  r.cp = 1;
  r.seq = 1;
  EXPECT_NE(testing::error_of([&] { r.validate(); }).find("seq >= 2"), std::string::npos);
  r.attention_mask = AttentionMask::kOnes;
  EXPECT_NO_THROW(r.validate());
  r.mode = Mode::kInference;
  r.precision = Precision::kBf16True;
  EXPECT_NE(testing::error_of([&] { r.validate(); }).find("training knob"), std::string::npos);
  RecipeSpelling sp;
  sp.attention_mask = "left";
  EXPECT_NE(testing::error_of([&] { parse_recipe(sp); }).find("attention_mask"), std::string::npos);
}

}  // namespace
}  // namespace trainmem
