// Tests for context parallelism in the graph stage (src/graph/context_parallel.{h,cpp} and the
// step builder's hooks). Context parallelism is mirrored from torch's _attention.py, not measured
// (Note [Context parallelism]): these pin what the source does, op by op, on the narrow 4-layer
// Llama (data/ground_truth/configs/llama-3.2-1b-w512-l4.json: hidden 512, 8 heads, 4 KV heads,
// head_dim 64, vocab 1,000).

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "graph/context_parallel.h"
#include "graph/step.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using testing::error_of;
using testing::kActs;
using testing::kWeights;
using testing::llama_w512;

Recipe cp_recipe(std::uint64_t cp, std::uint64_t seq = 512, Precision p = Precision::kFp32) {
  Recipe r;
  r.batch = 1;
  r.seq = seq;
  r.precision = p;
  r.optimizer = Optimizer::kSgd;
  r.gpu = "h100-80gb";
  r.cp = cp;
  r.validate();
  return r;
}

// Bytes of the storages first allocated in step 1's first micro-batch (or the set-up), `phase`,
// `layer`, under `op`.
std::vector<std::uint64_t> allocs(const graph::Trace& t, Phase phase, std::int32_t layer, std::string_view op) {
  std::vector<std::uint64_t> out;
  std::vector<bool> seen(t.storages.size(), false);
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    const bool first_micro = phase == Phase::kSetup || (m.step == 1 && m.micro == 1);  // set-up is step 0
    if (!e.alloc || seen[e.tensor] || !first_micro || m.phase != phase || m.layer != layer || m.op != op ||
        m.recompute) {
      continue;
    }
    seen[e.tensor] = true;
    out.push_back(t.storages[e.tensor].bytes);
  }
  return out;
}

graph::Trace trace_of(const Recipe& r) { return graph::build_training_trace(llama_w512(), r, find_gpu(r.gpu)); }

// cp 2, seq 512: a rank's q is [1, 8, 256, 64] (131,072 elements), k and v [1, 4, 256, 64]
// (65,536), the logsumexp [1, 8, 256] (2,048).
constexpr std::uint64_t kQ = 131'072, kKv = 65'536, kLse = 2'048;

TEST(ContextParallel, RingForwardOfTheLastRank) {
  // fp32, rank 1 of 2: key/value.contiguous(); at i = 0 the cat of k, v and its all-gather (2 x),
  // chunk 0's output and logsumexp; at i = 1 (full q, first half of k, v) chunk 1's output and
  // logsumexp, then the merge: block_lse - lse, sigmoid, out - block_out, the product, the new
  // out; lse - block_lse, logsigmoid, the new lse.
  const graph::Trace t = trace_of(cp_recipe(2));
  const std::uint64_t q = kQ * 4, kv = kKv * 4, l = kLse * 4;
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "self_attn.sdpa"),
            (std::vector<std::uint64_t>{kv, kv, 2 * kv, 4 * kv, q, l, q, l, l, l, q, q, q, l, l, l}));
}

TEST(ContextParallel, HalfDtypesMergeInFp32) {
  // bf16-true: each chunk's output is converted to fp32 before the merge, and the merged output
  // back to bf16 at the end.
  const graph::Trace t = trace_of(cp_recipe(2, 512, Precision::kBf16True));
  const std::uint64_t q2 = kQ * 2, q4 = kQ * 4, kv = kKv * 2, l = kLse * 4;
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "self_attn.sdpa"),
            (std::vector<std::uint64_t>{kv, kv, 2 * kv, 4 * kv, q2, l, q4, q2, l, q4, l, l, q4, q4, q4, l, l, l, q2}));
}

TEST(ContextParallel, RingBackwardAccumulatesInFp32AndSharesTheKvGradient) {
  const graph::Trace t = trace_of(cp_recipe(2));
  const std::vector<std::uint64_t> b = allocs(t, Phase::kBackward, 3, "self_attn.sdpa");
  ASSERT_GE(b.size(), 6u);
  // zeros_like(q, k, v) in fp32, then the contiguous copies of k and v.
  EXPECT_EQ((std::vector<std::uint64_t>(b.begin(), b.begin() + 5)),
            (std::vector<std::uint64_t>{kQ * 4, kKv * 4, kKv * 4, kKv * 4, kKv * 4}));
  // The all-gather of k, v (2 ranks x 2 kv) is made once; fp32 needs no final casts, so dq is the
  // accumulator and dk / dv are the halves of the last received buffer: nothing of q's size is
  // made after the last kernel's outputs but the partial-update cats of dk, dv (kv each) and the
  // 2 kv cat and receive.
  std::uint64_t gathers = 0;
  for (std::uint64_t x : b) gathers += x == 4 * kKv * 4;
  EXPECT_EQ(gathers, 1u);
  const std::vector<std::uint64_t> tail(b.end() - 4, b.end());
  EXPECT_EQ(tail, (std::vector<std::uint64_t>{kKv * 4, kKv * 4, 2 * kKv * 4, 2 * kKv * 4}));
}

TEST(ContextParallel, BatchIsWholeAndPositionsAreGiven) {
  const graph::Trace t = trace_of(cp_recipe(2));
  // input_ids, labels [1, 512] and position_ids [1, 512], int64.
  EXPECT_EQ(allocs(t, Phase::kSetup, -1, "batch"), (std::vector<std::uint64_t>{4096, 4096, 4096}));
  // context_parallel's entry: the load balancer's index, per buffer the gather (batch 1: the
  // local chunks are views), then the three clones of 256 tokens.
  EXPECT_EQ(allocs(t, Phase::kForward, -1, "context_parallel"),
            (std::vector<std::uint64_t>{4096, 4096, 4096, 4096, 2048, 2048, 2048}));
  // The model makes no position ids; the rotary embedding runs on the 256 local positions.
  EXPECT_TRUE(allocs(t, Phase::kForward, -1, "position_ids").empty());
  EXPECT_EQ(allocs(t, Phase::kForward, -1, "rotary_emb").front(), 256u * 4);
  // The loss gets shift_labels: no padded copy of the labels.
  for (std::uint64_t x : allocs(t, Phase::kLoss, -1, "loss")) EXPECT_NE(x, (256u + 1) * 8);
}

TEST(ContextParallel, ARankHoldsTheWholeModelAndFewerActivations) {
  const Model m = llama_w512();
  const Estimate cp = estimate(m, cp_recipe(2, 1024));
  const Estimate half = estimate(m, cp_recipe(1, 512));
  const Estimate full = estimate(m, cp_recipe(1, 1024));
  EXPECT_EQ(cp.breakdown_at_peak[kWeights], full.breakdown_at_peak[kWeights]);
  EXPECT_LT(cp.peak_allocated_bytes, full.peak_allocated_bytes);
  EXPECT_GT(cp.peak_allocated_bytes, half.peak_allocated_bytes);  // the ring's buffers, the whole batch
  // What autograd saves is that of seq / cp tokens.
  EXPECT_LT(cp.breakdown_at_peak[kActs], full.breakdown_at_peak[kActs]);
}

TEST(ContextParallel, RefusesWhatIsNotModelled) {
  const Model m = llama_w512();
  auto refused = [&](Recipe r) { return error_of([&] { graph::build_training_trace(m, r, find_gpu(r.gpu)); }); };
  Recipe r = cp_recipe(2);
  r.seq = 510;
  EXPECT_NE(refused(r).find("not divisible by 2 * cp = 4"), std::string::npos);
  r = cp_recipe(2);
  r.attention = Attention::kEager;
  EXPECT_NE(refused(r).find("scaled_dot_product_attention only"), std::string::npos);
  r = cp_recipe(2);
  r.gpus = 2;
  r.parallel = Parallel::kDdp;
  EXPECT_NE(refused(r).find("modelled under FSDP2"), std::string::npos);
  r.parallel = Parallel::kNone;
  EXPECT_NE(error_of([&] { r.validate(); }).find("need a data-parallel wrapper"), std::string::npos);
  r = cp_recipe(2);
  r.tp = 2;
  EXPECT_NE(refused(r).find("context and tensor parallelism"), std::string::npos);
  r = cp_recipe(2);
  r.lora.rank = 8;
  EXPECT_NE(refused(r).find("LoRA"), std::string::npos);
  r = cp_recipe(2);
  r.precision = Precision::kBf16Mixed;
  EXPECT_NE(refused(r).find("precision bf16-mixed"), std::string::npos);
  r = cp_recipe(2);
  r.loss = Loss::kFused;
  EXPECT_NE(refused(r).find("loss fused"), std::string::npos);
  r = cp_recipe(2);
  EXPECT_NE(error_of([&] { graph::build_training_trace(testing::gpt2_l2(), r, find_gpu(r.gpu)); }).find("gpt2"),
            std::string::npos);
  r = cp_recipe(2);
  r.cp = 65;
  EXPECT_NE(error_of([&] { r.validate(); }).find("cp: must be between 1 and 64"), std::string::npos);
}

// CP x FSDP2 (Note [Context parallelism under FSDP2]): `gpus` data-parallel groups of `cp`-rank
// rings, fully_shard over all gpus x cp ranks.
Recipe cp_fsdp_recipe(std::uint64_t cp, std::uint64_t gpus, std::uint64_t seq = 512) {
  Recipe r = cp_recipe(1, seq);
  r.cp = cp;
  r.gpus = gpus;
  r.parallel = Parallel::kFsdp;
  r.validate();
  return r;
}

TEST(ContextParallelFsdp, ShardsOverEveryRankOfTheMesh) {
  // The shards, all-gathers and reduce-scatters are those of a plain FSDP2 rank of gpus x cp.
  const graph::Trace t = trace_of(cp_fsdp_recipe(2, 2));
  Recipe flat = cp_recipe(1);
  flat.gpus = 4;
  flat.parallel = Parallel::kFsdp;
  flat.validate();
  const graph::Trace f = trace_of(flat);
  EXPECT_EQ(testing::allocs_at(t, "fsdp.fully_shard"), testing::allocs_at(f, "fsdp.fully_shard"));
  EXPECT_EQ(testing::allocs_at(t, "fsdp.all_gather"), testing::allocs_at(f, "fsdp.all_gather"));
  EXPECT_EQ(testing::allocs_at(t, "fsdp.reduce_scatter"), testing::allocs_at(f, "fsdp.reduce_scatter"));
  // One data-parallel group alone (gpus 1) still shards over its cp ranks.
  EXPECT_EQ(testing::allocs_at(trace_of(cp_fsdp_recipe(2, 1)), "fsdp.fully_shard"),
            testing::allocs_at(trace_of(cp_fsdp_recipe(1, 2)), "fsdp.fully_shard"));
}

TEST(ContextParallelFsdp, TheRingIsPureCpsAndTheModelStatesAreSharded) {
  const Model m = llama_w512();
  const graph::Trace t = trace_of(cp_fsdp_recipe(2, 2)), pure = trace_of(cp_recipe(2));
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "self_attn.sdpa"), allocs(pure, Phase::kForward, 0, "self_attn.sdpa"));
  EXPECT_EQ(allocs(t, Phase::kBackward, 3, "self_attn.sdpa"), allocs(pure, Phase::kBackward, 3, "self_attn.sdpa"));
  EXPECT_EQ(allocs(t, Phase::kForward, -1, "context_parallel"), allocs(pure, Phase::kForward, -1, "context_parallel"));
  const Estimate a = estimate(m, cp_fsdp_recipe(2, 2)), b = estimate(m, cp_recipe(2));
  EXPECT_LT(a.breakdown_at_peak[kWeights], b.breakdown_at_peak[kWeights]);
  EXPECT_LT(a.peak_allocated_bytes, b.peak_allocated_bytes);
}

TEST(ContextParallelFsdp, RefusesWhatIsNotModelled) {
  const Model m = llama_w512();
  auto refused = [&](Recipe r) { return error_of([&] { graph::build_training_trace(m, r, find_gpu(r.gpu)); }); };
  Recipe r = cp_fsdp_recipe(2, 2);
  r.gpus = 4;
  r.fsdp.replicate = 2;
  EXPECT_NE(refused(r).find("HSDP with context parallelism"), std::string::npos);
  r = cp_fsdp_recipe(2, 2);
  r.offload = Offload::kBoth;
  EXPECT_NE(error_of([&] { r.validate(); }).find("tensor, pipeline or context parallelism"), std::string::npos);
}

TEST(ContextParallelFsdp, PlannerSearchesRingsSmallerThanTheGpus) {
  // Llama-3.1-8B at seq 32,768 on 8 H100s: one sequence's activations outgrow a GPU under plain
  // FSDP2 without checkpointing, and a ring over all 8 GPUs holds the whole model on each; rings of
  // 4 under FSDP2 shard the model over all 8 and split the tokens 4 ways.
  const Model m = load_model("llama-3.1-8b");
  FitRequest q;
  q.base.seq = 32'768;
  q.base.precision = Precision::kBf16True;
  q.base.checkpointing = Checkpointing::kNone;
  q.gpus = 8;
  q.global_batch = 8;
  q.fixed = {"precision", "checkpointing"};
  q.top = 50;
  const FitResult f = fit(m, q);
  bool ring_of_4 = false;
  for (const Plan& p : f.plans) {
    if (p.recipe.cp != 4) continue;
    ring_of_4 = true;
    EXPECT_EQ(p.recipe.parallel, Parallel::kFsdp);
    EXPECT_EQ(p.recipe.gpus * p.recipe.batch * p.recipe.grad_accum, 8u);  // two groups share the global batch
    EXPECT_LE(p.peak_reserved_bytes, f.capacity_bytes);
  }
  EXPECT_TRUE(ring_of_4);
  bool shown = false;
  for (const Change& c : f.changes) shown = shown || c.what.starts_with("cp 4 x fsdp 2");
  EXPECT_TRUE(shown);
}

}  // namespace
}  // namespace trainmem
