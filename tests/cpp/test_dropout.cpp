// Tests for the config's dropout probabilities in a training step (Note [Dropout probabilities]
// in src/model/config.cpp). Byte-exactness against real runs is held by the cpu-gpt2l2nodrop-*,
// cpu-gpt2l2attnpdrop0-*, cpu-llamaw512l4attndrop-* and cpu-phi3w512l2drop-* measurements
// (tests/python/test_accuracy.py).

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "graph/context_parallel.h"
#include "graph/step.h"
#include "model/model.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using testing::measured_config;

Recipe cpu(Attention attention, std::uint64_t batch = 2, std::uint64_t seq = 256) {
  Recipe r;
  r.batch = batch;
  r.seq = seq;
  r.precision = Precision::kFp32;
  r.optimizer = Optimizer::kSgd;
  r.attention = attention;
  r.gpu = "cpu";
  return r;
}

// What step 1's forward allocates: the number of storages and, of them, those of `bytes`.
struct ForwardAllocs {
  int all = 0, of_size = 0;
  std::uint64_t live_at_end = 0;  // bytes still allocated when the backward starts
};
ForwardAllocs forward_allocs(const Model& m, const Recipe& r, std::uint64_t bytes) {
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu));
  ForwardAllocs n;
  std::uint64_t live = 0;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mo = t.moments[e.moment];
    if (mo.step == 1 && mo.phase == Phase::kBackward) break;
    const std::uint64_t b = t.storages[e.tensor].bytes;
    live = e.alloc ? live + b : live - b;
    if (mo.step != 1 || mo.phase != Phase::kForward || !e.alloc) continue;
    ++n.all;
    if (b == bytes) ++n.of_size;
  }
  n.live_at_end = live;
  return n;
}

// GPT-2 with every pdrop 0: no dropout allocates, and CPU SDPA takes its flash kernel, so no
// [b, heads, s, s] tensor exists; with attn_pdrop 0.1 (the default) the math kernel makes them.
TEST(Dropout, GPT2WithoutDropoutTakesTheFlashKernelOnTheCpu) {
  // (At 256 tokens the MLP's [b, s, 4 * hidden] would be as large as the scores.)
  const std::uint64_t B = 2, S = 128, heads = 12, scores = B * heads * S * S * 4;
  const ForwardAllocs nodrop = forward_allocs(measured_config("gpt2-l2-nodrop"), cpu(Attention::kSdpa, B, S), scores);
  const ForwardAllocs drop = forward_allocs(testing::gpt2_l2(), cpu(Attention::kSdpa, B, S), scores);
  EXPECT_EQ(nodrop.of_size, 0);
  EXPECT_GT(drop.of_size, 0);
  // Only the residual dropouts off: the flash kernel again, but the masks stay.
  const ForwardAllocs attn_only =
      forward_allocs(measured_config("gpt2-l2-attnpdrop0"), cpu(Attention::kSdpa, B, S), scores);
  EXPECT_EQ(attn_only.of_size, 0);
  EXPECT_GT(attn_only.all, nodrop.all);
}

// A dropout of p = 0 returns its input: eager GPT-2 without dropout keeps less at the end of its
// forward by exactly, per layer, the probabilities' noise and dropped copy (the second matmul
// saves the copy, softmax its own output) and the two residual dropouts' noise, plus the
// embeddings' noise (fp32 noise on the CPU; a residual dropout's output replaces its input).
TEST(Dropout, AZeroProbabilityKeepsNoNoise) {
  const std::uint64_t B = 2, S = 256, heads = 12, hidden = 768, layers = 2;
  const std::uint64_t scores = B * heads * S * S * 4, act = B * S * hidden * 4;
  const ForwardAllocs on = forward_allocs(testing::gpt2_l2(), cpu(Attention::kEager), scores);
  const ForwardAllocs off = forward_allocs(measured_config("gpt2-l2-nodrop"), cpu(Attention::kEager), scores);
  EXPECT_EQ(on.live_at_end - off.live_at_end, layers * (2 * scores + 2 * act) + act);
}

// attention_dropout in the Llama family: eager attention saves the noise of its probabilities and
// the dropped copy that the second matmul saves, two [b, heads, s, s] per layer (fp32 on the
// CPU); SDPA on the CPU runs the math kernel, which saves the same two and repeats K and V for
// GQA; the ring of context parallelism is refused.
TEST(Dropout, LlamaAttentionDropout) {
  const std::uint64_t B = 2, S = 128, heads = 8, layers = 4, scores = B * heads * S * S * 4;
  const Model on = measured_config("llama-3.2-1b-w512-l4-attndrop");
  const ForwardAllocs with = forward_allocs(on, cpu(Attention::kEager, B, S), scores);
  const ForwardAllocs without = forward_allocs(testing::llama_w512(), cpu(Attention::kEager, B, S), scores);
  EXPECT_EQ(with.live_at_end - without.live_at_end, 2 * layers * scores);
  const ForwardAllocs math = forward_allocs(on, cpu(Attention::kSdpa, B, S), scores);
  const ForwardAllocs flash = forward_allocs(testing::llama_w512(), cpu(Attention::kSdpa, B, S), scores);
  EXPECT_EQ(flash.of_size, 0);
  EXPECT_GT(math.of_size, 0);
  EXPECT_GT(math.live_at_end, flash.live_at_end + 2 * layers * scores);
  // CUDA's fused kernels take the dropout: no [b, heads, s, s] tensor there.
  Recipe gpu = cpu(Attention::kSdpa, B, S);
  gpu.gpu = "h100-80gb";
  EXPECT_EQ(forward_allocs(on, gpu, scores).of_size, 0);
  gpu.cp = 2;
  EXPECT_EQ(testing::error_of([&] { graph::check_context_parallel(on, gpu); }),
            "cp: 2 with attention dropout (the config's attention_dropout > 0): the ring's dropout is not "
            "modelled; set attention_dropout to 0");
}

// A reached sliding window hands the CPU's math kernel HF's materialised mask: refused.
TEST(Dropout, TheCpuMathKernelWithAWindowsMaskIsRefused) {
  Model m = measured_config("mistral-7b-v0.1-w512-l2-win128");
  m.arch.attn_dropout = 0.1;
  EXPECT_NO_THROW(graph::build_training_trace(m, cpu(Attention::kSdpa, 2, 64), find_gpu("cpu")));
  EXPECT_EQ(testing::error_of([&] { graph::build_training_trace(m, cpu(Attention::kSdpa, 2, 128), find_gpu("cpu")); }),
            "attention: sdpa with attention dropout (the config's attention_dropout > 0) on the CPU, with a sequence "
            "of 128 tokens that reaches the sliding window (128), runs torch's math kernel on the model's mask, which "
            "is not modelled; use eager attention, a sequence shorter than the window, or attention_dropout 0");
  EXPECT_NO_THROW(graph::build_training_trace(m, cpu(Attention::kEager, 2, 128), find_gpu("cpu")));
}

}  // namespace
}  // namespace trainmem
