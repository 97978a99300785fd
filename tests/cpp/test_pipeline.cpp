// Tests for pipeline parallelism in the graph stage (src/graph/pipeline.{h,cpp}), against what
// torch.distributed.pipelining does with one PipelineStage per gloo rank (also with DDP replicas
// of each stage) for the narrow 4-layer Llama
// (data/ground_truth/configs/llama-3.2-1b-w512-l4.json: hidden 512, 8 heads, 4 KV heads,
// head_dim 64, intermediate 2,048, vocab 1,000, untied). The accuracy gate
// (tests/python/test_accuracy.py) holds whole estimates to the measurements; these pin the pieces.

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "graph/pipeline.h"
#include "graph/step.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using testing::error_of;
using testing::kWeights;
using testing::llama_w512;

// The measured recipe of cpu-pp2-llamaw512l4-fp32-adamw-ga4-b2s128.
Recipe pp_recipe(std::uint64_t pp, std::uint64_t micro_batches) {
  Recipe r;
  r.batch = 2;
  r.seq = 128;
  r.grad_accum = micro_batches;
  r.precision = Precision::kFp32;
  r.optimizer = Optimizer::kAdamW;
  r.gpu = "cpu";
  r.allocator = AllocatorMode::kExpandable;
  r.pp = pp;
  r.validate();
  return r;
}

std::string order_of(PipelineSchedule s, std::uint64_t stages, std::uint64_t stage, std::uint64_t m) {
  std::string out;
  for (const graph::PipelineAction& a : graph::pipeline_order(s, stages, stage, m)) {
    out += (a.forward ? "F" : "B") + std::to_string(a.micro) + " ";
  }
  return out;
}

TEST(Pipeline, SplitGivesEarlierStagesTheRemainder) {
  EXPECT_EQ(graph::pipeline_stage_layers(4, 2, 0).begin, 0u);
  EXPECT_EQ(graph::pipeline_stage_layers(4, 2, 0).end, 2u);
  EXPECT_EQ(graph::pipeline_stage_layers(4, 2, 1).begin, 2u);
  EXPECT_EQ(graph::pipeline_stage_layers(4, 2, 1).end, 4u);
  // 5 layers over 3 stages: 2, 2, 1.
  EXPECT_EQ(graph::pipeline_stage_layers(5, 3, 0).end, 2u);
  EXPECT_EQ(graph::pipeline_stage_layers(5, 3, 1).end, 4u);
  EXPECT_EQ(graph::pipeline_stage_layers(5, 3, 2).begin, 4u);
  EXPECT_EQ(graph::pipeline_stage_layers(5, 3, 2).end, 5u);
}

TEST(Pipeline, OneFOneBOrderIsTorchs) {
  // schedules.py Schedule1F1B: min(M, N - s) warm-up forwards, then B/F pairs, then the rest.
  EXPECT_EQ(order_of(PipelineSchedule::k1F1B, 2, 0, 4), "F0 F1 B0 F2 B1 F3 B2 B3 ");
  EXPECT_EQ(order_of(PipelineSchedule::k1F1B, 2, 1, 4), "F0 B0 F1 B1 F2 B2 F3 B3 ");
  EXPECT_EQ(order_of(PipelineSchedule::k1F1B, 4, 1, 4), "F0 F1 F2 B0 F3 B1 B2 B3 ");
  EXPECT_EQ(order_of(PipelineSchedule::kGPipe, 2, 1, 3), "F0 F1 F2 B0 B1 B2 ");
}

TEST(Pipeline, StagesHoldTheirOwnParameters) {
  const Model m = llama_w512();
  const Recipe r = pp_recipe(2, 4);
  EstimateOptions o0, o1;
  o0.rank = 0;
  o1.rank = 1;
  const Estimate s0 = estimate(m, r, o0), s1 = estimate(m, r, o1);
  // Measured (cpu-pp2-llamaw512l4-fp32-adamw-ga4-b2s128, weights at each rank's peak): stage 0 holds
  // the embedding and layers 0-1, stage 1 layers 2-3, the norm and lm_head; both the rotary buffers.
  EXPECT_EQ(s0.breakdown_at_peak[kWeights], 33'514'496u);
  EXPECT_EQ(s1.breakdown_at_peak[kWeights], 33'516'544u);
}

// Phi3Model.forward is Mistral's, its fused qkv_proj and gate_up_proj inside the layers a stage
// calls: the measured cpu-pp2-phi3w512l2-fp32-adamw-ga3-b2s128, each stage's peak and weights.
TEST(Pipeline, Phi3SplitsLikeTheLlamaFamily) {
  const Model m = testing::measured_config("phi-3-mini-4k-instruct-w512-l2");
  const Recipe r = pp_recipe(2, 3);
  EstimateOptions o0, o1;
  o0.rank = 0;
  o1.rank = 1;
  const Estimate s0 = estimate(m, r, o0), s1 = estimate(m, r, o1);
  EXPECT_EQ(s0.peak_allocated_bytes, 78'625'280u);
  EXPECT_EQ(s1.peak_allocated_bytes, 69'025'792u);
  EXPECT_EQ(s0.breakdown_at_peak[kWeights], 12'538'880u);
  EXPECT_EQ(s1.breakdown_at_peak[kWeights], 12'540'928u);
}

// A stage builds the masks the model's own forward builds, each layer taking its kind's: Phi-3 cut
// to a window of 128 at seq 256 under eager attention, a sliding float mask per micro-batch
// forward; the measured cpu-pp2-phi3w512l2win128-fp32-sgd-eager-ga2-b1s256, each stage's peak. A
// reached window under SDPA is modelled in a pipeline too, also of tensor-parallel stages
// (Mistral v0.1 cut the same way).
TEST(Pipeline, StagesBuildTheModelsOwnMasks) {
  const Model m =
      testing::measured_config("phi-3-mini-4k-instruct-w512-l2-win128");
  Recipe past = pp_recipe(2, 2);  // fp32 SGD, two micro-batches of one sequence of 256
  past.batch = 1;
  past.seq = 256;
  past.optimizer = Optimizer::kSgd;
  Recipe r = past;
  r.attention = Attention::kEager;
  EstimateOptions o0, o1;
  o0.rank = 0;
  o1.rank = 1;
  EXPECT_EQ(estimate(m, r, o0).peak_allocated_bytes, 57'329'664u);
  EXPECT_EQ(estimate(m, r, o1).peak_allocated_bytes, 57'585'152u);
  // SDPA past the window: the bool mask, and the attention over it (the measured
  // cpu-pp2-phi3w512l2win128-bf16mixed-adamw-ga2-b2s256).
  r.attention = Attention::kSdpa;
  r.batch = 2;
  r.precision = Precision::kBf16Mixed;
  r.optimizer = Optimizer::kAdamW;
  EXPECT_EQ(estimate(m, r, o0).peak_allocated_bytes, 82'493'952u);
  EXPECT_EQ(estimate(m, r, o1).peak_allocated_bytes, 81'850'880u);
  const Model mistral =
      testing::measured_config("mistral-7b-v0.1-w512-l2-win128");
  r.tp = 2;  // PP x TP (Phi-3 takes no tensor parallelism at all): the measured
  r.batch = 1;  // cpu-pp2tp2-mistralv01w512l2win128-fp32-sgd-ga2-b1s256, its worst stage
  r.precision = Precision::kFp32;
  r.optimizer = Optimizer::kSgd;
  EXPECT_EQ(estimate(mistral, r).peak_allocated_bytes, 34'258'432u);
  // Each micro-batch forward of a stage makes the model's kinds of mask, whatever its own layers:
  // Phi-3 the sliding one; the Qwen2.5 cut, whose layer 0 is full and layer 1 sliding, both on
  // either stage (the measured cpu-pp2-qwen25w512l2slide128-fp32-sgd-ga2-b1s256).
  const Model qwen =
      testing::measured_config("qwen2.5-0.5b-w512-l2-slide128");
  EXPECT_EQ(estimate(qwen, past, o0).peak_allocated_bytes, 48'258'048u);
  EXPECT_EQ(estimate(qwen, past, o1).peak_allocated_bytes, 51'576'320u);
  auto mask_ops = [](const Model& model, const Recipe& rr, std::uint64_t stage) {
    const graph::Trace t = graph::build_training_trace(model, rr, find_gpu(rr.gpu), {}, stage);
    std::pair<int, int> n{0, 0};  // causal, sliding: moments of step 1 that allocate under them
    for (const graph::Event& e : t.events) {
      const graph::MomentTag& mo = t.moments[e.moment];
      if (!e.alloc || mo.step != 1) continue;
      n.first += mo.op == "causal_mask";
      n.second += mo.op == "sliding_window_mask";
    }
    return n;
  };
  r = past;
  r.attention = Attention::kEager;
  for (std::uint64_t stage : {0, 1}) {
    const auto [causal, sliding] = mask_ops(m, r, stage);
    EXPECT_EQ(causal, 0) << stage;
    EXPECT_GT(sliding, 0) << stage;
    const auto [q_causal, q_sliding] = mask_ops(qwen, past, stage);
    EXPECT_GT(q_causal, 0) << stage;
    EXPECT_GT(q_sliding, 0) << stage;
  }
}

TEST(Pipeline, TheWorstStageIsReported) {
  const Model m = llama_w512();
  const Estimate e = estimate(m, pp_recipe(2, 4));
  ASSERT_EQ(e.ranks.size(), 2u);
  const std::uint64_t worst = std::max(e.ranks[0].peak_allocated_bytes, e.ranks[1].peak_allocated_bytes);
  EXPECT_EQ(e.peak_allocated_bytes, worst);
  // 1F1B keeps two micro-batches in flight on stage 0 and one on stage 1.
  EXPECT_NE(e.ranks[0].peak_allocated_bytes, e.ranks[1].peak_allocated_bytes);
}

// The measured b1 s64, 2 micro-batch recipes (cpu-pp2-llamaw512l4-*-ga2-b1s64) with SGD.
Recipe pp2_small(Precision precision, Checkpointing checkpointing, Attention attention) {
  Recipe r = pp_recipe(2, 2);
  r.batch = 1;
  r.seq = 64;
  r.optimizer = Optimizer::kSgd;
  r.precision = precision;
  r.checkpointing = checkpointing;
  r.attention = attention;
  r.validate();
  return r;
}

TEST(Pipeline, CheckpointedStagesKeepLayerInputsOnly) {
  const Model m = llama_w512();
  EstimateOptions o0;
  o0.rank = 0;
  const Estimate plain = estimate(m, pp2_small(Precision::kFp32, Checkpointing::kNone, Attention::kSdpa), o0);
  const Estimate ckpt = estimate(m, pp2_small(Precision::kFp32, Checkpointing::kFull, Attention::kSdpa), o0);
  // Measured (cpu-pp2-llamaw512l4-fp32-sgd-ckpt-ga2-b1s64, stage 0): the peak is in step 2's
  // backward of micro-batch 2, in layer 1's recomputed down_proj.
  EXPECT_EQ(ckpt.peak_allocated_bytes, 109'098'496u);
  EXPECT_EQ(ckpt.breakdown_at_peak[testing::kActs], 3'443'712u);
  EXPECT_LT(ckpt.breakdown_at_peak[testing::kActs], plain.breakdown_at_peak[testing::kActs]);
}

TEST(Pipeline, MasterGradientsFollowTheRegistrationOrder) {
  // Note [Parameter registration order]: model.parameters() puts a layer's norms after its MLP,
  // so the fp32 master gradients peak at the last down_proj with two norms' bf16 gradients left
  // (measured: cpu-pp2-llamaw512l4-bf16master-sgd-ga2-b1s64, stage 0, step 2's master copies).
  EstimateOptions o0;
  o0.rank = 0;
  const Estimate e = estimate(llama_w512(), pp2_small(Precision::kBf16Master, Checkpointing::kNone, Attention::kSdpa), o0);
  EXPECT_EQ(e.peak_allocated_bytes, 119'525'376u);
  EXPECT_EQ(e.breakdown_at_peak[testing::kGrads], 35'608'576u);
}

// PP x DP with DDP (See Note [Pipeline with DDP]): the measured cpu-pp2dp2-llamaw512l4-fp32-sgd-ga2-b1s64,
// 2 stages x 2 DDP replicas, rank = stage x 2 + dp rank.
TEST(Pipeline, DdpReplicasAddTheReducersBuckets) {
  const Model m = llama_w512();
  Recipe r = pp2_small(Precision::kFp32, Checkpointing::kNone, Attention::kSdpa);
  const Estimate alone = estimate(m, r);
  r.gpus = 2;
  r.parallel = Parallel::kDdp;
  r.validate();
  const Estimate e = estimate(m, r);
  // One replay per stage (a stage's replicas allocate the same): ranks 0 and 2; stage 1 is the worst.
  ASSERT_EQ(e.ranks.size(), 2u);
  EXPECT_EQ(e.ranks[0].rank, 0u);
  EXPECT_EQ(e.ranks[1].rank, 2u);
  EXPECT_EQ(e.rank, 2u);
  // Measured: every rank peaks in step 2's backward of micro-batch 2; stage 1 at 146,025,984 B with
  // 67,031,040 B of gradients, its .grads and the Reducer's buckets (33,515,520 B each).
  EXPECT_EQ(e.peak_allocated_bytes, 146'025'984u);
  EXPECT_EQ(e.breakdown_at_peak[testing::kGrads], 67'031'040u);
  EXPECT_EQ(e.breakdown_at_peak[testing::kGrads], 2 * alone.breakdown_at_peak[testing::kGrads]);
  // Rank 3 is stage 1's other replica, rank 1 stage 0's.
  EstimateOptions o1, o3;
  o1.rank = 1;
  o3.rank = 3;
  EXPECT_EQ(estimate(m, r, o3).peak_allocated_bytes, e.peak_allocated_bytes);
  EXPECT_EQ(estimate(m, r, o1).peak_allocated_bytes, 145'760'256u);
  EstimateOptions o4;
  o4.rank = 4;
  EXPECT_NE(error_of([&] { estimate(m, r, o4); }).find("not one of the 4 ranks"), std::string::npos);
}

// PP x DP with FSDP2 (See Note [Pipeline with FSDP2]): the measured cpu-pp2fsdp2-llamaw512l4-fp32-sgd-ga2-b1s64,
// 2 stages x 2 FSDP2 ranks, rank = stage x 2 + dp rank.
Recipe pp2_fsdp2() {
  Recipe r = pp2_small(Precision::kFp32, Checkpointing::kNone, Attention::kSdpa);
  r.gpus = 2;
  r.parallel = Parallel::kFsdp;
  r.validate();
  return r;
}

TEST(Pipeline, FsdpStagesAccumulateWholeGradients) {
  const Model m = llama_w512();
  const Recipe r = pp2_fsdp2();
  const Estimate e = estimate(m, r);
  // One replay per stage, as under DDP: ranks 0 and 2 (measured: 112,246,784 and 120,244,736 B;
  // their replicas, ranks 1 and 3, the same).
  ASSERT_EQ(e.ranks.size(), 2u);
  EXPECT_EQ(e.ranks[0].rank, 0u);
  EXPECT_EQ(e.ranks[1].rank, 2u);
  EXPECT_EQ(e.ranks[1].peak_allocated_bytes, 120'244'736u);
  EstimateOptions o3;
  o3.rank = 3;
  EXPECT_EQ(estimate(m, r, o3).peak_allocated_bytes, 120'244'736u);
  EstimateOptions o1;
  o1.rank = 1;
  const Estimate s0 = estimate(m, r, o1);
  // Stage 0 peaks in step 2's last backward, before perform_reduce_grad: its .grads are whole and
  // unsharded (33,513,472 B, what the stage holds without FSDP2), while SGD's momentum is over the
  // shards, half of it (measured: 16,756,736 B).
  EXPECT_EQ(s0.peak_allocated_bytes, 112'246'784u);
  EXPECT_EQ(s0.breakdown_at_peak[testing::kGrads], 33'513'472u);
  EXPECT_EQ(s0.breakdown_at_peak[testing::kGrads], 2 * s0.breakdown_at_peak[testing::kStates]);
}

TEST(Pipeline, FsdpReducesOnlyAtPerformReduceGrad) {
  // Under a pipeline no backward reduce-scatters: every unit's reduce-scatter comes after the
  // schedule's last backward, once per unit with parameters (stage 0: the root with the
  // embedding, layers 0 and 1) and per step.
  const Recipe r = pp2_fsdp2();
  const graph::Trace t = graph::build_training_trace(llama_w512(), r, find_gpu(r.gpu), {}, 0);
  std::map<std::uint32_t, int> per_step;
  std::map<std::uint32_t, std::size_t> last_layer_backward, first_reduce_scatter;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const graph::Event& ev = t.events[i];
    const graph::MomentTag& tag = t.moments[ev.moment];
    if (tag.phase == Phase::kBackward && tag.layer >= 0) last_layer_backward[tag.step] = i;
    if (ev.alloc && tag.op == "fsdp.reduce_scatter") {
      EXPECT_EQ(tag.micro, r.grad_accum);
      if (per_step[tag.step]++ == 0) first_reduce_scatter[tag.step] = i;
    }
  }
  // Each unit's reduce-scatter makes its input, its output and, on the CPU, gloo's temporary
  // (Note [gloo's reduce-scatter temporary]).
  EXPECT_EQ(per_step, (std::map<std::uint32_t, int>{{1, 9}, {2, 9}}));
  for (const auto& [step, first] : first_reduce_scatter) EXPECT_GT(first, last_layer_backward[step]) << step;
}

TEST(Pipeline, FsdpShardsOnlyTheStagesOwnParameters) {
  // pp 3 x dp 2 (measured: cpu-pp3fsdp2-llamaw512l4-fp32-sgd-ga3-b1s64; 2, 1, 1 layers): fully_shard
  // gives each stage the shards of its own parameters only, and the middle stage's root (no
  // embedding, no head) none: its shards are layer 2's half (a layer is 15,732,736 B in fp32).
  Recipe r = pp2_fsdp2();
  r.pp = 3;
  r.grad_accum = 3;
  r.validate();
  auto sharded_bytes = [&](std::uint64_t rank) {
    const graph::Trace t = graph::build_training_trace(llama_w512(), r, find_gpu(r.gpu), {}, rank);
    std::uint64_t bytes = 0;
    for (const graph::Event& ev : t.events) {
      if (ev.alloc && t.moments[ev.moment].op == "fsdp.fully_shard") bytes += t.storages[ev.tensor].bytes;
    }
    return bytes;
  };
  EXPECT_EQ(sharded_bytes(2), 15'732'736u / 2);
  // Stage 0: the embedding (1,000 x 512 fp32) and layers 0 and 1, halved.
  EXPECT_EQ(sharded_bytes(0), (2'048'000u + 2 * 15'732'736u) / 2);
  const Estimate e = estimate(llama_w512(), r);
  ASSERT_EQ(e.ranks.size(), 3u);
  EXPECT_EQ(e.ranks[0].peak_allocated_bytes, 119'101'952u);
  EXPECT_EQ(e.ranks[1].peak_allocated_bytes, 70'605'824u);
  EXPECT_EQ(e.ranks[2].peak_allocated_bytes, 73'178'624u);
}

TEST(Pipeline, FsdpWithoutReshardAfterForwardHoldsTheWholeStage) {
  // torchtitan's default under PP (reshard_after_forward=False): a layer gathered once stays so to
  // perform_reduce_grad, and each stage peaks at what it holds without FSDP2 (measured:
  // cpu-pp2fsdp2-llamaw512l4-fp32-sgd-sgo-ga2-b1s64 and cpu-pp2-llamaw512l4-fp32-sgd-ga2-b1s64,
  // 112,246,784 and 112,510,464 B).
  const Model m = llama_w512();
  Recipe r = pp2_fsdp2();
  r.fsdp.reshard_after_forward = false;
  r.validate();
  const Estimate e = estimate(m, r);
  const Estimate alone = estimate(m, pp2_small(Precision::kFp32, Checkpointing::kNone, Attention::kSdpa));
  ASSERT_EQ(e.ranks.size(), 2u);
  EXPECT_EQ(e.ranks[0].peak_allocated_bytes, 112'246'784u);
  EXPECT_EQ(e.ranks[1].peak_allocated_bytes, 112'510'464u);
  EXPECT_EQ(e.ranks[0].peak_allocated_bytes, alone.ranks[0].peak_allocated_bytes);
  EXPECT_EQ(e.ranks[1].peak_allocated_bytes, alone.ranks[1].peak_allocated_bytes);
}

TEST(Pipeline, FsdpMixedPrecisionAccumulatesInTheReduceDtype) {
  // MixedPrecisionPolicy(bf16, reduce_dtype=fp32), torchtitan's: each schedule backward's
  // post-backward turns the bf16 .grads into fp32 unsharded_accumulated_grads (the first) or adds
  // them into those (the later ones); perform_reduce_grad reduce-scatters the fp32 ones. Measured:
  // cpu-pp2fsdp2-llamaw512l4-fp32-sgd-bf16params-ga2-b1s64, stage 0 97,669,120 B, at the last
  // unit's reduce-scatter.
  Recipe r = pp2_fsdp2();
  r.fsdp.param_dtype = FsdpDtype::kBf16;
  r.fsdp.reduce_dtype = FsdpDtype::kFp32;
  r.validate();
  EstimateOptions o0;
  o0.rank = 0;
  EXPECT_EQ(estimate(llama_w512(), r, o0).peak_allocated_bytes, 97'669'120u);
  const graph::Trace t = graph::build_training_trace(llama_w512(), r, find_gpu(r.gpu), {}, 0);
  std::map<std::uint32_t, int> converted;  // per micro-batch of step 1: fp32 copies made
  for (const graph::Event& ev : t.events) {
    const graph::MomentTag& tag = t.moments[ev.moment];
    if (ev.alloc && tag.step == 1 && tag.op == "fsdp.accumulate_grad") ++converted[tag.micro];
  }
  // Stage 0's parameters: the embedding and two layers of nine: one copy each, in the first backward.
  EXPECT_EQ(converted, (std::map<std::uint32_t, int>{{1, 19}}));
}

TEST(Pipeline, DdpAllReducesOncePerStepOnTheStagesShare) {
  // The planner's time: under a pipeline DDP all-reduces in the step's last backward only, each
  // stage its own share of the gradients (See Note [Pipeline with DDP]), whatever grad_accum is.
  const Model m = llama_w512();
  const double bw = find_gpu("h100-80gb").interconnect_gbps * 1e9;
  const double grads = static_cast<double>(m.parameter_count) * 4;  // fp32
  for (std::uint64_t micro : {4u, 8u}) {
    Recipe r = pp_recipe(2, micro);
    r.gpu = "h100-80gb";
    const double alone = step_time(m, r).comm_s;  // the P2P sends only
    r.gpus = 4;
    r.parallel = Parallel::kDdp;
    const double all_reduce_s = 2 * 3.0 / 4 * grads / 2 / bw;
    EXPECT_NEAR(step_time(m, r).comm_s - alone, all_reduce_s, all_reduce_s * 1e-12) << micro;
  }
}

TEST(Pipeline, RefusesWhatIsNotModelled) {
  Recipe r = pp_recipe(2, 4);
  r.grad_accum = 1;
  EXPECT_NE(error_of([&] { r.validate(); }).find("grad_accum"), std::string::npos);
  r = pp_recipe(2, 4);
  r.gpus = 2;
  r.parallel = Parallel::kZero2;
  EXPECT_EQ(error_of([&] { r.validate(); }),
            "pp: 2 with parallel zero2: pipeline parallelism combined with a data-parallel wrapper other than DDP or "
            "FSDP2 is not modelled yet; use parallel none, ddp or fsdp");
  r.parallel = Parallel::kDdp;
  EXPECT_NO_THROW(r.validate());  // PP x DP with DDP (See Note [Pipeline with DDP])
  r.parallel = Parallel::kFsdp;
  EXPECT_NO_THROW(r.validate());  // PP x DP with FSDP2's defaults (See Note [Pipeline with FSDP2])
  // FSDP2's knobs under a pipeline: reshard_after_forward (torchtitan's PP default: False), the
  // MixedPrecisionPolicy and HSDP (a (pp, replicate, shard) mesh) are measured.
  r.fsdp.reshard_after_forward = false;
  EXPECT_NO_THROW(r.validate());
  r.fsdp.reshard_after_forward = true;
  r.precision = Precision::kFp32;
  r.fsdp.param_dtype = FsdpDtype::kBf16;
  r.fsdp.reduce_dtype = FsdpDtype::kFp32;
  EXPECT_NO_THROW(r.validate());
  r.fsdp.param_dtype = FsdpDtype::kNone;
  r.fsdp.reduce_dtype = FsdpDtype::kNone;
  r.gpus = 4;
  r.fsdp.replicate = 2;
  EXPECT_NO_THROW(r.validate());
  r.gpus = 1;
  r.fsdp.replicate = 1;
  EXPECT_EQ(error_of([&] { r.validate(); }),
            "pp: 2 with parallel fsdp and gpus 1: FSDP2 under a pipeline shards each stage over its gpus "
            "data-parallel ranks and is modelled for 2 or more; use gpus 2 or more, or parallel none");
  r.gpus = 2;
  r = pp_recipe(2, 4);
  r.precision = Precision::kFp16Mixed;
  EXPECT_NE(error_of([&] { r.validate(); }).find("fp16-mixed"), std::string::npos);
  r = pp_recipe(2, 4);
  r.attention = Attention::kFlash;
  r.gpu = "h100-80gb";  // on the CPU and in fp32 flash is refused for reasons of its own
  r.precision = Precision::kBf16Mixed;
  EXPECT_NE(error_of([&] { r.validate(); }).find("attention flash"), std::string::npos);
  r = pp_recipe(2, 4);
  r.checkpointing = Checkpointing::kFull;
  r.attention = Attention::kEager;
  EXPECT_NO_THROW(r.validate());
  r = pp_recipe(2, 4);
  r.mode = Mode::kInference;
  EXPECT_NE(error_of([&] { r.validate(); }).find("inference"), std::string::npos);
  // Tied embeddings (Llama-3.2-1B ties lm_head to embed_tokens) and too few layers.
  const Model tied = load_model("llama-3.2-1b");
  EXPECT_NE(error_of([&] { estimate(tied, pp_recipe(2, 4)); }).find("ties"), std::string::npos);
  EXPECT_NE(error_of([&] { estimate(llama_w512(), pp_recipe(8, 8)); }).find("fewer than the stages"),
            std::string::npos);
  EXPECT_NE(error_of([&] { estimate(testing::gpt2_l2(), pp_recipe(2, 4)); }).find("not modelled"), std::string::npos);
}

// Several stages per rank (See Note [Interleaved pipeline schedules]): the measured
// cpu-pp2v2-llamaw512l4-fp32-sgd-interleaved-ga{2,4}-b1s64, 2 ranks x 2 stages of one layer each.
Recipe pp2v2(PipelineSchedule schedule, std::uint64_t micro_batches) {
  Recipe r = pp2_small(Precision::kFp32, Checkpointing::kNone, Attention::kSdpa);
  r.grad_accum = micro_batches;
  r.pp_schedule = schedule;
  r.pp_stages_per_rank = 2;
  r.validate();
  return r;
}

// The measured PP x TP recipes (cpu-pp2tp2-llamaw512l4-fp32-sgd-ga2-b1s64, cpu-pp2tp2sp-*): 2 x 2
// ranks, fp32 SGD, 2 micro-batches.
Recipe pp_tp(std::uint64_t batch, std::uint64_t tp, bool sequence_parallel) {
  Recipe r = pp2_small(Precision::kFp32, Checkpointing::kNone, Attention::kSdpa);
  r.batch = batch;
  r.tp = tp;
  r.sequence_parallel = sequence_parallel;
  r.validate();
  return r;
}

std::string multi_order_of(PipelineSchedule s, std::uint64_t ranks, std::uint64_t per_rank, std::uint64_t rank,
                           std::uint64_t m) {
  std::string out;
  for (const graph::PipelineStageAction& a : graph::pipeline_multi_order(s, ranks, per_rank, rank, m)) {
    out += std::to_string(a.stage) + (a.forward ? "F" : "B") + std::to_string(a.micro) + " ";
  }
  return out;
}

TEST(Pipeline, InterleavedOrderIsTorchs) {
  // torch 2.13's ScheduleInterleaved1F1B(...).pipeline_order[rank] without its None slots, printed
  // from schedules.py for these (pp, V, M).
  const PipelineSchedule i = PipelineSchedule::kInterleaved1F1B;
  EXPECT_EQ(multi_order_of(i, 2, 2, 0, 2), "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 ");
  EXPECT_EQ(multi_order_of(i, 2, 2, 1, 2), "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 ");
  EXPECT_EQ(multi_order_of(i, 2, 2, 0, 4), "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 ");
  EXPECT_EQ(multi_order_of(i, 2, 2, 1, 4), "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 ");
  EXPECT_EQ(multi_order_of(i, 2, 2, 1, 3), "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1B0 1B1 1B2 ");
  EXPECT_EQ(multi_order_of(i, 3, 2, 2, 3), "2F0 2F1 2F2 5F0 5B0 5F1 5B1 5F2 5B2 2B0 2B1 2B2 ");
  // Fewer micro-batches than ranks: one round of M (measured: cpu-pp3v2-llamaw512l8-fp32-sgd-interleaved-ga2-b1s64).
  EXPECT_EQ(multi_order_of(i, 3, 2, 0, 2), "0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1 ");
  EXPECT_EQ(multi_order_of(i, 3, 2, 2, 2), "2F0 2F1 5F0 5B0 5F1 5B1 2B0 2B1 ");
  EXPECT_EQ(multi_order_of(i, 2, 3, 1, 4),
            "1F0 1F1 3F0 3F1 5F0 5B0 5F1 5B1 1F2 3B0 1F3 3B1 3F2 1B0 3F3 1B1 5F2 5B2 5F3 5B3 3B2 3B3 1B2 1B3 ");
  // ScheduleLoopedBFS: each stage's forwards in turn, then the backwards from the last stage, the
  // micro-batches in reverse.
  const PipelineSchedule bfs = PipelineSchedule::kLoopedBFS;
  EXPECT_EQ(multi_order_of(bfs, 2, 2, 1, 2), "1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0 ");
  EXPECT_EQ(multi_order_of(bfs, 2, 3, 0, 2), "0F0 0F1 2F0 2F1 4F0 4F1 4B1 4B0 2B1 2B0 0B1 0B0 ");
}

TEST(Pipeline, VirtualStagesSplitTheLayersOverEveryStage) {
  // 4 layers over pp 2 x V 2 = 4 stages: rank 0 holds stages 0 and 2 (layers 0 and 2, the
  // embedding), rank 1 stages 1 and 3 (layers 1 and 3, the norm and lm_head).
  EXPECT_EQ(graph::pipeline_stage_layers(4, 4, 2).begin, 2u);
  EXPECT_EQ(graph::pipeline_stage_layers(4, 4, 2).end, 3u);
  const Model m = llama_w512();
  EstimateOptions o0, o1;
  o0.rank = 0;
  o1.rank = 1;
  const Recipe r = pp2v2(PipelineSchedule::kInterleaved1F1B, 4);
  const Estimate s0 = estimate(m, r, o0), s1 = estimate(m, r, o1);
  // Measured: the weights at each rank's peak are those of the one-stage split (the layers are
  // alike); the peaks are step 2's, in the backward of layer 0 / 1.
  EXPECT_EQ(s0.breakdown_at_peak[kWeights], 33'514'496u);
  EXPECT_EQ(s1.breakdown_at_peak[kWeights], 33'516'544u);
  EXPECT_EQ(s0.peak_allocated_bytes, 124'446'720u);
  EXPECT_EQ(s1.peak_allocated_bytes, 117'955'072u);
  // Each rank receives for every stage but stage 0 and sends gradients back for every stage but
  // the last: rank 0 has 4 activation and 8 gradient receive buffers of 128 KiB (1,572,864 B with
  // the batch) and rank 1 8 and 4; the measured `other` at the peak is 1,574,912 B on both.
  EXPECT_EQ(s0.breakdown_at_peak[static_cast<std::size_t>(Category::kOther)], 1'574'912u);
  EXPECT_EQ(s1.breakdown_at_peak[static_cast<std::size_t>(Category::kOther)], 1'574'912u);
  // The rank runs 4 F and 4 B per stage; with 2 micro-batches rank 0 keeps fewer in flight.
  const Estimate two = estimate(m, pp2v2(PipelineSchedule::kInterleaved1F1B, 2), o0);
  EXPECT_EQ(two.peak_allocated_bytes, 110'146'560u);
}

TEST(Pipeline, LoopedBfsRunsEveryForwardFirst) {
  // Measured (cpu-pp2v2-llamaw512l4-fp32-sgd-loopedbfs-ga2-b1s64): with 2 micro-batches rank 0
  // holds both micro-batches of both stages before its first backward, as interleaved 1F1B does.
  const Model m = llama_w512();
  const Estimate e = estimate(m, pp2v2(PipelineSchedule::kLoopedBFS, 2));
  ASSERT_EQ(e.ranks.size(), 2u);
  EXPECT_EQ(e.ranks[0].peak_allocated_bytes, 110'146'560u);
  EXPECT_EQ(e.ranks[1].peak_allocated_bytes, 109'891'584u);
}

TEST(Pipeline, InterleavingShrinksTheBubble) {
  // Note [Step time]: (N - 1) / M of the busy time idle with one stage per rank, (N - 1) / (V M)
  // with V: the compute of 2 ranks x 1 stage over 4 micro-batches is (4 + 1) / 4 of a rank's share,
  // with 2 stages per rank (4 + 1/2) / 4.
  const Model m = llama_w512();
  Recipe one = pp_recipe(2, 4), two = pp2v2(PipelineSchedule::kInterleaved1F1B, 4);
  two.batch = one.batch;
  two.seq = one.seq;
  two.optimizer = one.optimizer;
  one.gpu = two.gpu = "h100-80gb";  // the CPU has no throughput figures
  one.allocator = two.allocator = AllocatorMode::kDefault;
  one.validate();
  two.validate();
  const StepTime a = step_time(m, one), b = step_time(m, two);
  EXPECT_DOUBLE_EQ(b.compute_s / a.compute_s, 4.5 / 5.0);
  EXPECT_DOUBLE_EQ(b.flops, a.flops);
  Recipe bfs = two;
  bfs.pp_schedule = PipelineSchedule::kLoopedBFS;
  EXPECT_DOUBLE_EQ(step_time(m, bfs).compute_s, b.compute_s);
}

std::string lowered_of(PipelineSchedule s, std::uint64_t ranks, std::uint64_t per_rank, std::uint64_t rank,
                       std::uint64_t m) {
  const std::vector<graph::PipelineStageAction> order = graph::pipeline_multi_order(s, ranks, per_rank, rank, m);
  std::string out;
  for (const graph::PipelineLoweredAction& a : graph::pipeline_add_unshard_reshard(order)) {
    if (a.kind == graph::PipelineLoweredAction::Kind::kCompute) {
      const graph::PipelineStageAction& c = order[a.compute];
      out += std::to_string(c.stage) + (c.forward ? "F" : "B") + std::to_string(c.micro) + " ";
    } else {
      out += std::to_string(a.stage) + (a.kind == graph::PipelineLoweredAction::Kind::kUnshard ? "UNSHARD " : "RESHARD ");
    }
  }
  return out;
}

TEST(Pipeline, FsdpLoweringIsTorchs) {
  // torch 2.13's _add_unshard_reshard (schedules.py) over these compute actions, printed from torch:
  // a stage is fetched with the next three distinct stages and evicted once it is not among them
  // (See Note [Interleaved pipeline schedules with FSDP2]).
  const PipelineSchedule i = PipelineSchedule::kInterleaved1F1B, bfs = PipelineSchedule::kLoopedBFS;
  EXPECT_EQ(lowered_of(i, 2, 2, 0, 4),
            "0UNSHARD 2UNSHARD 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 2RESHARD 0B2 0B3 0RESHARD ");
  EXPECT_EQ(lowered_of(i, 2, 4, 0, 2),
            "0UNSHARD 2UNSHARD 4UNSHARD 0F0 0F1 0RESHARD 6UNSHARD 2F0 2F1 4F0 4F1 6F0 6F1 6B0 6B1 6RESHARD 0UNSHARD "
            "4B0 4B1 4RESHARD 2B0 2B1 2RESHARD 0B0 0B1 0RESHARD ");
  EXPECT_EQ(lowered_of(bfs, 2, 4, 1, 2),
            "1UNSHARD 3UNSHARD 5UNSHARD 1F0 1F1 1RESHARD 7UNSHARD 3F0 3F1 5F0 5F1 7F0 7F1 7B1 7B0 7RESHARD 1UNSHARD "
            "5B1 5B0 5RESHARD 3B1 3B0 3RESHARD 1B1 1B0 1RESHARD ");
  EXPECT_EQ(lowered_of(i, 3, 2, 1, 3), "1UNSHARD 4UNSHARD 1F0 1F1 1F2 4F0 4F1 4F2 4B0 4B1 4B2 4RESHARD 1B0 1B1 1B2 1RESHARD ");
}

TEST(Pipeline, RefusesStagesPerRankThatTheScheduleDoesNotRun) {
  Recipe r = pp_recipe(2, 4);
  r.pp_stages_per_rank = 2;
  EXPECT_EQ(error_of([&] { r.validate(); }),
            "pp_stages_per_rank: 2 needs a multi-stage schedule: use interleaved-1f1b or looped-bfs, not 1f1b");
  r.pp_schedule = PipelineSchedule::kGPipe;
  EXPECT_NE(error_of([&] { r.validate(); }).find("not gpipe"), std::string::npos);
  r = pp_recipe(2, 4);
  r.pp_schedule = PipelineSchedule::kInterleaved1F1B;
  EXPECT_EQ(error_of([&] { r.validate(); }),
            "pp_schedule interleaved-1f1b runs several stages per rank: set pp_stages_per_rank to 2 or more, or "
            "use 1f1b or gpipe");
  r.pp_stages_per_rank = 2;
  EXPECT_NO_THROW(r.validate());
  // ScheduleInterleaved1F1B: n_microbatches a multiple of max(1, n_microbatches // pp).
  r.grad_accum = 5;
  EXPECT_EQ(error_of([&] { r.validate(); }),
            "pp_schedule interleaved-1f1b needs grad_accum (n_microbatches) to be a multiple of its rounds max(1, 5 "
            "/ pp 2) = 2, got 5 (ScheduleInterleaved1F1B refuses it)");
  r.grad_accum = 3;  // one round of 3: accepted, as torch does
  EXPECT_NO_THROW(r.validate());
  r.pp_schedule = PipelineSchedule::kLoopedBFS;
  r.grad_accum = 5;
  EXPECT_NO_THROW(r.validate());
  // Each local stage its own DDP or FSDP2 root (Notes [Interleaved pipeline schedules with DDP] /
  // [... with FSDP2]), HSDP and an FSDP2 MixedPrecisionPolicy included (measured:
  // cpu-pp2v2hsdp4-*, cpu-pp2v2fsdp2-*-bf16params-*).
  r.gpus = 2;
  r.parallel = Parallel::kDdp;
  EXPECT_NO_THROW(r.validate());
  r.parallel = Parallel::kFsdp;
  EXPECT_NO_THROW(r.validate());
  r.gpus = 4;
  r.fsdp.replicate = 2;
  EXPECT_NO_THROW(r.validate());
  r.gpus = 2;
  r.fsdp.replicate = 1;
  r.fsdp.param_dtype = FsdpDtype::kBf16;
  EXPECT_NO_THROW(r.validate());
  // ZeRO is not pipelined at all.
  r.fsdp = Fsdp{};
  r.parallel = Parallel::kZero1;
  EXPECT_NE(error_of([&] { r.validate(); }).find("not modelled"), std::string::npos);
  r = pp_recipe(2, 4);
  r.pp_stages_per_rank = 0;
  EXPECT_EQ(error_of([&] { r.validate(); }), "pp_stages_per_rank: must be between 1 and 64, got 0");
  r = pp_recipe(2, 4);
  r.pp = 1;
  r.pp_stages_per_rank = 2;
  EXPECT_EQ(error_of([&] { r.validate(); }), "pp_stages_per_rank: a pipeline knob, it needs pp > 1");
  // More stages than decoder layers: 2 ranks x 3 stages over 4 layers.
  r = pp2v2(PipelineSchedule::kInterleaved1F1B, 2);
  r.pp_stages_per_rank = 3;
  r.validate();
  EXPECT_EQ(error_of([&] { estimate(llama_w512(), r); }),
            "pp: 2 x pp_stages_per_rank 3: the model has 4 decoder layers, fewer than the 6 stages");
}

TEST(Pipeline, TensorParallelStagesHoldTheirLayersShards) {
  // See Note [Pipeline with tensor parallelism]: a stage's colwise and rowwise projections are 1/T,
  // its norms and lm_head whole.
  const Model m = llama_w512();
  const Architecture& a = m.arch;
  EstimateOptions o1;
  o1.rank = 1;  // stage 1: layers 2-3, the final norm and lm_head
  const Estimate plain = estimate(m, pp_tp(1, 1, false), o1);
  const Estimate tp2 = estimate(m, pp_tp(1, 2, false), o1);
  const std::uint64_t q_o = 2 * a.hidden_size * a.num_heads * a.head_dim;
  const std::uint64_t k_v = 2 * a.hidden_size * a.num_kv_heads * a.head_dim;
  const std::uint64_t mlp = 3 * a.hidden_size * a.intermediate_size;
  const std::uint64_t stage_linear_bytes = 2 * (q_o + k_v + mlp) * 4;  // two layers, fp32
  EXPECT_EQ(plain.breakdown_at_peak[kWeights] - tp2.breakdown_at_peak[kWeights], stage_linear_bytes / 2);
  // Measured (cpu-pp2tp2-llamaw512l4-fp32-sgd-ga2-b1s64, ranks 2 and 3): weights and the peak.
  EXPECT_EQ(tp2.breakdown_at_peak[kWeights], 17'787'904u);
  EXPECT_EQ(tp2.peak_allocated_bytes, 60'811'264u);
  // The tp ranks of a stage are not ranks of the estimate: one per stage, each replayed.
  const Estimate worst = estimate(m, pp_tp(1, 2, false));
  ASSERT_EQ(worst.ranks.size(), 2u);
  EXPECT_EQ(worst.rank, 1u);
  EXPECT_EQ(worst.peak_allocated_bytes, 60'811'264u);
}

TEST(Pipeline, SequenceParallelStagesExchangeShards) {
  // The last stage's `other`: the labels and one activation receive buffer per micro-batch, the
  // whole [b, s, h] micro-batch without sequence parallelism, this rank's Shard(1) with it (See
  // Note [Pipeline with tensor parallelism]); measured 264,192 B (cpu-pp2tp2sp-llamaw512l4-fp32-sgd-ga2-b2s64).
  const Model m = llama_w512();
  constexpr std::size_t kOther = static_cast<std::size_t>(Category::kOther);
  EstimateOptions o1;
  o1.rank = 1;
  const std::uint64_t labels = 2 * 2 * 64 * 8, micro_batch = 2 * 64 * 512 * 4;
  EXPECT_EQ(estimate(m, pp_tp(2, 2, false), o1).breakdown_at_peak[kOther], labels + 2 * micro_batch);
  const Estimate sp = estimate(m, pp_tp(2, 2, true), o1);
  EXPECT_EQ(sp.breakdown_at_peak[kOther], labels + 2 * micro_batch / 2);
  EXPECT_EQ(sp.breakdown_at_peak[kOther], 264'192u);
  EXPECT_EQ(sp.peak_allocated_bytes, 66'176'000u);
}

TEST(Pipeline, LossParallelShardsTheLastStagesHead) {
  // See Note [Pipeline with tensor parallelism]: under loss_parallel the last stage holds vocab / T
  // rows of lm_head; measured 16,763,904 B of weights on stage 1 (cpu-pp2tp2lp-llamaw512l4-fp32-sgd-ga2-b2s64).
  const Model m = llama_w512();
  EstimateOptions o1;
  o1.rank = 1;
  Recipe lp = pp_tp(2, 2, false);
  lp.loss_parallel = true;
  const Estimate plain = estimate(m, pp_tp(2, 2, false), o1), vocab = estimate(m, lp, o1);
  EXPECT_EQ(plain.breakdown_at_peak[kWeights] - vocab.breakdown_at_peak[kWeights],
            m.arch.vocab_size * m.arch.hidden_size * 4 / 2);
  EXPECT_EQ(vocab.breakdown_at_peak[kWeights], 16'763'904u);
  EXPECT_EQ(vocab.peak_allocated_bytes, 62'122'496u);
}

TEST(Pipeline, TensorParallelRefusesWhatIsNotModelled) {
  Recipe r = pp_tp(1, 2, false);
  r.gpus = 2;
  r.parallel = Parallel::kFsdp;
  EXPECT_NO_THROW(r.validate());  // PP x TP x FSDP2 over a (pp, dp, tp) mesh
  r.parallel = Parallel::kDdp;  // TP x DP's refusal: DDP over a tensor-parallel model is unmeasured
  EXPECT_NE(error_of([&] { r.validate(); }).find("modelled under parallel fsdp only"), std::string::npos);
  r.parallel = Parallel::kFsdp;
  r.fsdp.replicate = 2;
  r.gpus = 4;
  EXPECT_NE(error_of([&] { r.validate(); }).find("not modelled with tensor parallelism"), std::string::npos);
  r = pp_tp(1, 2, false);
  r.loss_parallel = true;
  EXPECT_NO_THROW(r.validate());  // the schedule step inside loss_parallel(), as torchtitan runs it
  // Several stages per rank over tensor-parallel stages (measured: cpu-pp2v2tp2-*).
  r = pp_tp(1, 2, false);
  r.pp_schedule = PipelineSchedule::kInterleaved1F1B;
  r.pp_stages_per_rank = 2;
  EXPECT_NO_THROW(r.validate());
  // Autocast and master weights over tensor-parallel stages (measured: cpu-pp2tp2-*-bf16mixed-*,
  // -bf16master-*); the pipeline's own refusal of fp16-mixed still applies.
  r = pp_tp(1, 2, false);
  r.precision = Precision::kBf16Mixed;
  EXPECT_NO_THROW(r.validate());
  r.precision = Precision::kFp16Mixed;
  EXPECT_NE(error_of([&] { r.validate(); }).find("pp: 2 with precision fp16-mixed"), std::string::npos);
  EXPECT_NE(error_of([&] { estimate(testing::gpt2_l2(), pp_tp(1, 2, false)); }).find("not modelled"),
            std::string::npos);
}

}  // namespace
}  // namespace trainmem
