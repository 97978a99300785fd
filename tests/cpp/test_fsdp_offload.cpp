// Tests for FSDP2's CPUOffloadPolicy (src/graph/parallel.cpp, Note [FSDP2 CPU offload]): what
// leaves the GPU, what the all-gather copies to it, the host memory of a rank, the planner's view
// and the recipe's refusals. Offload is not measured (a CPU run cannot tell the host copies from
// device ones: docs/parallelism.md): these tests pin the mirror of torch 2.13's source.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "graph/parallel.h"
#include "graph/step.h"
#include "plan/plan.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using graph::DataParallel;
using testing::allocs_at;
using testing::dp_recipe;
using testing::error_of;
using testing::gpt2_l2;
using testing::kGpt2L2Params;
using testing::kGrads;
using testing::kStates;
using testing::kWeights;
using testing::most_live;

// GPT-2 cut to two layers over two ranks: the root's shards (wte padded to 25,129 rows of 768, wpe
// 512 rows, ln_f's weight and bias) and a layer's (every dim 0 even: half of each parameter).
constexpr std::uint64_t kWteShard = 25'129 * 768, kWpeShard = 512 * 768, kLnShard = 384;
constexpr std::uint64_t kRootShard = kWteShard + kWpeShard + 2 * kLnShard;
constexpr std::uint64_t kLayersShard = (kGpt2L2Params - (50'257 + 1'024) * 768 - 2 * 768) / 2;
constexpr std::uint64_t kTensors = 4 + 2 * 12;  // GPT-2's root and two blocks of 12 tensors

Recipe offload_recipe(Precision precision = Precision::kFp32) {
  Recipe r = dp_recipe(Parallel::kFsdp, 2, precision);
  r.gpu = "h100-80gb";  // CPUOffloadPolicy needs a CUDA device
  r.offload = Offload::kBoth;
  r.validate();
  return r;
}

Recipe plain(Recipe r) {
  r.offload = Offload::kNone;
  r.validate();
  return r;
}

graph::Trace trace_of(const Recipe& r) { return graph::build_training_trace(gpt2_l2(), r, find_gpu(r.gpu)); }

TEST(FsdpOffload, NoShardOptimizerStateOrShardedGradientOnTheGpu) {
  const Recipe off = offload_recipe();
  const graph::Trace t = trace_of(off), on = trace_of(plain(off));
  EXPECT_TRUE(allocs_at(t, "fsdp.fully_shard").empty());  // the shards are pinned host tensors
  EXPECT_EQ(allocs_at(on, "fsdp.fully_shard").size(), kTensors);
  EXPECT_TRUE(allocs_at(t, "optimizer.init_state").empty());
  EXPECT_EQ(most_live(t)[kStates], 0u);
  EXPECT_EQ(most_live(on)[kStates], 8 * (kRootShard + kLayersShard));  // exp_avg, exp_avg_sq (the step on the host)
  // Without offload the GPU's sharded .grads live from the reduce-scatter to zero_grad; with it
  // the outputs go when foreach_reduce returns, so the optimizer phase holds no gradient.
  std::array<std::uint64_t, 6> live{};
  std::uint64_t at_step = 0;
  for (const graph::Event& e : t.events) {
    const std::size_t c = static_cast<std::size_t>(t.storages[e.tensor].category);
    live[c] = e.alloc ? live[c] + t.storages[e.tensor].bytes : live[c] - t.storages[e.tensor].bytes;
    if (t.moments[e.moment].phase == Phase::kOptimizer) at_step = std::max(at_step, live[kGrads]);
  }
  EXPECT_EQ(at_step, 0u);
  const Estimate a = estimate(gpt2_l2(), off), b = estimate(gpt2_l2(), plain(off));
  EXPECT_LT(a.peak_allocated_bytes, b.peak_allocated_bytes);
  EXPECT_EQ(a.breakdown_at_peak[kStates], 0u);
}

TEST(FsdpOffload, EachShardIsCopiedToTheGpuBeforeTheAllGatherOutput) {
  // FSDPParam.all_gather_inputs: one .to(device) per parameter (no foreach copy under offload),
  // then foreach_all_gather's flat output of world x the unit's shards.
  const std::vector<std::uint64_t> g = allocs_at(trace_of(offload_recipe()), "fsdp.all_gather");
  ASSERT_GE(g.size(), 5u);
  std::vector<std::uint64_t> root(g.begin(), g.begin() + 4);
  std::sort(root.begin(), root.end());
  EXPECT_EQ(root, (std::vector<std::uint64_t>{kLnShard * 4, kLnShard * 4, kWpeShard * 4, kWteShard * 4}));
  EXPECT_EQ(g[4], kRootShard * 2 * 4);
  // A layer: its 12 shards, then the flat buffer; per step the root, two layers forward and two
  // backward, each with its copies.
  EXPECT_EQ(g.size(), 2 * (5 + 4 * 13));
  std::uint64_t copies = 0;
  for (std::size_t k = 5; k < 5 + 12; ++k) copies += g[k];
  EXPECT_EQ(copies, kLayersShard / 2 * 4);  // one layer's half of the two layers' shards
  EXPECT_EQ(g[17], kLayersShard / 2 * 2 * 4);
}

TEST(FsdpOffload, AParamDtypePolicyCastsEachCopy) {
  // _to_dtype_if_needed on each fp32 copy: the bf16 cast is made while the copy is alive.
  Recipe r = offload_recipe();
  r.fsdp.param_dtype = FsdpDtype::kBf16;
  r.validate();
  const std::vector<std::uint64_t> g = allocs_at(trace_of(r), "fsdp.all_gather");
  ASSERT_GE(g.size(), 9u);
  for (std::size_t k = 0; k < 8; k += 2) EXPECT_EQ(g[k], 2 * g[k + 1]) << k;  // fp32 copy, bf16 cast
  EXPECT_EQ(g[8], kRootShard * 2 * 2);  // world x the bf16 shards
}

TEST(FsdpOffload, HsdpKeepsEachReduceScatterOutputUntilTheEndOfBackward) {
  // Under HSDP the reduce-scatter output is also the replicas' all-reduce input, which
  // FSDPParamGroup._all_reduce_state holds until finalize_backward, offload or not; without
  // replicas the output goes when foreach_reduce returns. 4 GPUs as 2 replicas of 2 shards have
  // the 2-rank shards above: a layer unit's output is its fp32 shard (kLayersShard / 2 elements),
  // the root's kRootShard.
  Recipe hsdp = dp_recipe(Parallel::kFsdp, 4, Precision::kFp32);
  hsdp.gpu = "h100-80gb";
  hsdp.offload = Offload::kBoth;
  hsdp.fsdp.replicate = 2;
  hsdp.validate();
  const std::uint64_t layer_out = kLayersShard / 2 * 4, root_out = kRootShard * 4;
  const auto most_outputs = [&](const graph::Trace& t) {
    std::uint64_t live = 0, most = 0;
    std::vector<bool> output(t.storages.size(), false);
    for (const graph::Event& e : t.events) {
      const std::uint64_t bytes = t.storages[e.tensor].bytes;
      if (e.alloc && t.moments[e.moment].op == "fsdp.reduce_scatter" && (bytes == layer_out || bytes == root_out)) {
        output[e.tensor] = true;
      }
      if (!output[e.tensor]) continue;
      live = e.alloc ? live + bytes : live - bytes;
      most = std::max(most, live);
    }
    return most;
  };
  EXPECT_EQ(most_outputs(trace_of(hsdp)), 2 * layer_out + root_out);
  EXPECT_EQ(most_outputs(trace_of(offload_recipe())), root_out);
  // The kept outputs are GPU gradient bytes the 2-shard FSDP2 rank does not hold at its
  // end-of-backward.
  EXPECT_GT(estimate(gpt2_l2(), hsdp).peak_allocated_bytes, estimate(gpt2_l2(), offload_recipe()).peak_allocated_bytes);
}

TEST(FsdpOffload, HostHoldsShardsGradientsAndStates) {
  // Per rank: each parameter's pinned fp32 shard and pinned sharded .grad, AdamW's pageable
  // exp_avg and exp_avg_sq (and its 0-dim fp32 step) zeros_like the shard: 16 bytes per shard
  // element, as DeepSpeed's estimators count fp32 model states, plus 4 per tensor.
  const HostMemory h = estimate(gpt2_l2(), offload_recipe()).host;
  const std::uint64_t shard = (kRootShard + kLayersShard) * 4;
  EXPECT_EQ(h.weights_bytes, shard);
  EXPECT_EQ(h.gradients_bytes, shard);
  EXPECT_EQ(h.optimizer_states_bytes, 2 * shard + 4 * kTensors);
  EXPECT_EQ(h.pageable_bytes, h.optimizer_states_bytes);
  EXPECT_EQ(h.pinned_requested_bytes, 2 * shard);
  EXPECT_EQ(h.weights_bytes + h.gradients_bytes + h.optimizer_states_bytes, 16 * (kRootShard + kLayersShard) + 4 * kTensors);
  EXPECT_GE(h.pinned_bytes, h.pinned_requested_bytes);  // each tensor's block a power of two
  EXPECT_LT(h.pinned_bytes, 2 * h.pinned_requested_bytes);
  // SGD keeps one momentum buffer; a bf16 model's shards, gradients and states are half the size.
  Recipe sgd = offload_recipe();
  sgd.optimizer = Optimizer::kSgd;
  EXPECT_EQ(estimate(gpt2_l2(), sgd).host.optimizer_states_bytes, shard);
  const HostMemory bf16 = estimate(gpt2_l2(), offload_recipe(Precision::kBf16True)).host;
  EXPECT_EQ(bf16.weights_bytes, shard / 2);
  EXPECT_EQ(bf16.optimizer_states_bytes, shard + 4 * kTensors);
  EXPECT_EQ(estimate(gpt2_l2(), plain(offload_recipe())).host.total_bytes(), 0u);
}

// Under LoRA (Note [LoRA under FSDP2]) every shard is pinned, the frozen base's too, but only the
// adapters get a host .grad and optimizer states; bf16-true's base shards are bf16, the adapters'
// fp32. GPT-2's default target, attn.c_attn: lora_A 8 x 768 and lora_B 2,304 x 8 per layer, halved.
TEST(FsdpOffload, LoraPinsTheFrozenShardsAndStepsTheAdaptersOnly) {
  Recipe r = testing::dp_lora_recipe(gpt2_l2(), Parallel::kFsdp, Precision::kBf16True, "h100-80gb");
  r.offload = Offload::kBoth;
  r.validate();
  const HostMemory h = estimate(gpt2_l2(), r).host;
  const std::uint64_t adapters = 2 * (8 * 768 + 2'304 * 8) / 2 * 4;  // two layers' fp32 adapter shards
  EXPECT_EQ(h.weights_bytes, (kRootShard + kLayersShard) * 2 + adapters);
  EXPECT_EQ(h.gradients_bytes, adapters);
  EXPECT_EQ(h.optimizer_states_bytes, 2 * adapters + 4 * 4);  // AdamW's moments, a step per adapter tensor
  const graph::Trace t = trace_of(r);
  EXPECT_TRUE(allocs_at(t, "fsdp.fully_shard").empty());
  EXPECT_EQ(most_live(t)[kStates], 0u);
  // Each layer's reduce-scatter carries the adapters' fp32 gradients only; the root reduces nothing.
  EXPECT_EQ(allocs_at(t, "fsdp.reduce_scatter").front(), (8 * 768 + 2'304 * 8) * 4u);
}

TEST(FsdpOffload, PlannerSearchesItAndTimesTheHostSide) {
  // Llama-3.1-8B in bf16 over two 24 GiB GPUs: sharded weights, gradients and AdamW's states
  // (~30 GiB per rank) do not fit; with CPUOffloadPolicy they move to the host.
  const Model m = load_model("llama-3.1-8b");
  Recipe base;
  base.seq = 2048;
  base.gpus = 2;
  base.gpu = "rtx-4090";
  base.parallel = Parallel::kFsdp;
  base.precision = Precision::kBf16True;
  base.checkpointing = Checkpointing::kFull;
  base.validate();
  Recipe off = base;
  off.offload = Offload::kBoth;
  off.validate();
  EXPECT_FALSE(plan::plainly_refused(off));
  EXPECT_EQ(plan::persistent_floor(m, off), 0u);
  EXPECT_GT(plan::persistent_floor(m, base), find_gpu("rtx-4090").usable_bytes());
  const Estimate e = estimate(m, off);
  EXPECT_LT(e.peak_reserved_bytes, find_gpu("rtx-4090").usable_bytes());
  const StepTime t0 = step_time(m, base), t1 = step_time(m, off);
  EXPECT_EQ(t0.host_s, 0);
  EXPECT_GT(t1.host_s, 0);
  EXPECT_LT(t1.memory_s, t0.memory_s);  // the optimizer's traffic left the GPU
  FitRequest q;
  q.base = base;
  q.fixed = {"parallel", "precision", "checkpointing"};
  q.top = 3;
  const FitResult f = fit(m, q);
  ASSERT_FALSE(f.plans.empty());
  EXPECT_EQ(f.plans.front().recipe.offload, Offload::kBoth);
  EXPECT_GT(f.plans.front().host_bytes, 0u);
  bool shown = false;
  for (const Change& c : f.changes) shown = shown || (c.what == "offload both" && c.plan.fits);
  EXPECT_TRUE(shown);
}

TEST(FsdpOffload, RecipeRefusals) {
  Recipe r = dp_recipe(Parallel::kFsdp, 2, Precision::kFp32);
  r.gpu = "h100-80gb";
  for (Offload o : {Offload::kOptimizer, Offload::kParams}) {
    r.offload = o;
    EXPECT_NE(error_of([&] { r.validate(); }).find("use offload both"), std::string::npos);
    EXPECT_TRUE(plan::plainly_refused(r));
  }
  r.offload = Offload::kBoth;
  EXPECT_NO_THROW(r.validate());
  r.gpu = "cpu";
  EXPECT_NE(error_of([&] { r.validate(); }).find("needs a CUDA GPU"), std::string::npos);
  r.gpu = "h100-80gb";
  r.optimizer = Optimizer::kAdamW8bit;  // FSDP2 takes torch optimizers only
  EXPECT_THROW(r.validate(), Error);
  r = offload_recipe();
  r.gpus = 4;
  r.fsdp.replicate = 2;  // HSDP offloads the same way
  EXPECT_NO_THROW(r.validate());
  EXPECT_NO_THROW(estimate(gpt2_l2(), r));
  r = offload_recipe(Precision::kBf16True);
  r.tp = 2;  // TP x FSDP2
  EXPECT_NE(error_of([&] { r.validate(); }).find("tensor, pipeline or context parallelism"), std::string::npos);
  EXPECT_TRUE(plan::plainly_refused(r));
}

}  // namespace
}  // namespace trainmem
