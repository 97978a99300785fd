// Tests for DeepSpeed ZeRO-1/2 in the graph stage (src/graph/zero.cpp, Note [DeepSpeed ZeRO-1/2]):
// the flat group's padding and partitions, what is allocated where, and the model states against
// DeepSpeed's own estimator (stage_1_and_2.py estimate_zero2_model_states_mem_needs). The
// accuracy gate (tests/python/test_accuracy.py) holds whole estimates to the CPU measurements in
// data/ground_truth/parallel/cpu-zero*; these tests pin the pieces.

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "graph/parallel.h"
#include "graph/quant.h"
#include "graph/step.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using graph::DataParallel;
using testing::allocs_at;
using testing::kGpt2L2Params;
using testing::kGrads;
using testing::kStates;
using testing::kTemps;
using testing::kWeights;
using testing::dp_recipe;
using testing::gpt2_l2;

constexpr std::uint64_t kGpt2Wte = 50'257 * 768;  // the first parameter of the flat group
constexpr std::uint64_t kBucketElements = 500'000'000;

// Live bytes per category right after the last event of step `step`'s op `op` (the whole trace
// when `op` is empty); with `largest`, the most bytes of `category` live during that op.
std::array<std::uint64_t, 6> live_after(const graph::Trace& t, std::uint32_t step, std::string_view op,
                                        std::size_t largest = 6) {
  std::size_t last = t.events.size();
  if (!op.empty()) {
    for (std::size_t i = 0; i < t.events.size(); ++i) {
      const graph::MomentTag& m = t.moments[t.events[i].moment];
      if (m.step == step && m.op == op) last = i + 1;
    }
  }
  std::array<std::uint64_t, 6> live{}, most{};
  for (std::size_t i = 0; i < last; ++i) {
    const graph::Event& e = t.events[i];
    const graph::Storage& s = t.storages[e.tensor];
    const std::size_t c = static_cast<std::size_t>(s.category);
    live[c] = e.alloc ? live[c] + s.bytes : live[c] - s.bytes;
    const graph::MomentTag& m = t.moments[e.moment];
    if (largest < 6 && m.step == step && m.op == op && live[largest] > most[largest]) most = live;
  }
  return largest < 6 ? most : live;
}

TEST(ZeroFlatGroup, PaddedToTwiceTheWorldSize) {
  // nccl_start_alignment_factor (2) x world: the flat group splits into equal partitions.
  EXPECT_EQ(DataParallel::zero_flat_numel(kGpt2L2Params, 2), kGpt2L2Params);  // a multiple of 4
  EXPECT_EQ(DataParallel::zero_flat_numel(kGpt2L2Params, 5), 53'561'090u);
  EXPECT_EQ(DataParallel::zero_flat_numel(7, 2), 8u);
  EXPECT_EQ(DataParallel::zero_flat_numel(9, 4), 16u);
  EXPECT_EQ(DataParallel::zero_flat_numel(1, 1), 2u);
  EXPECT_EQ(DataParallel::zero_flat_numel(16, 4), 16u);
}

TEST(ZeroFlatGroup, SetupHoldsTheFlatGroupAndThisRanksFp32Partition) {
  const Model m = gpt2_l2();
  ASSERT_EQ(m.parameter_count, kGpt2L2Params);
  for (std::uint64_t world : {1u, 2u, 5u}) {
    const graph::Trace t = graph::build_training_trace(m, dp_recipe(Parallel::kZero2, world, Precision::kBf16Master), find_gpu("cpu"));
    const std::uint64_t flat = DataParallel::zero_flat_numel(kGpt2L2Params, world);
    EXPECT_EQ(allocs_at(t, "zero.flatten_params"), (std::vector<std::uint64_t>{flat * 2})) << world;
    EXPECT_EQ(allocs_at(t, "zero.fp32_partition"), (std::vector<std::uint64_t>{flat / world * 4})) << world;
    EXPECT_TRUE(allocs_at(t, "optimizer.master_copy").empty()) << "no per-parameter masters under ZeRO";
  }
}

TEST(ZeroBuckets, OneIpgBucketPerBackwardInTheModelDtype) {
  const Model m = gpt2_l2();
  for (Parallel stage : {Parallel::kZero1, Parallel::kZero2}) {
    const graph::Trace bf16 = graph::build_training_trace(m, dp_recipe(stage, 2, Precision::kBf16Master), find_gpu("cpu"));
    EXPECT_EQ(allocs_at(bf16, "zero.setup_buckets"),
              (std::vector<std::uint64_t>{kBucketElements * 2, kBucketElements * 2}));
    const graph::Trace fp32 = graph::build_training_trace(m, dp_recipe(stage, 2, Precision::kFp32), find_gpu("cpu"));
    EXPECT_EQ(allocs_at(fp32, "zero.setup_buckets"),
              (std::vector<std::uint64_t>{kBucketElements * 4, kBucketElements * 4}));
    // Freed by the epilogue: nothing of the backward's gradients is live after it.
    EXPECT_EQ(live_after(bf16, 1, "zero.gradient_partition_epilogue")[kGrads], kGpt2Wte * 2);
  }
}

TEST(ZeroBuckets, ReductionFlattensTheBucketAndKeepsThisPartitionsGradients) {
  // The whole bucket (every parameter, 53.6 M elements < 5e8) is one all-reduce chunk, flattened
  // by a torch.cat as the trace of the ZeRO-2 measurement shows; rank 0's partition (the first
  // half of the flat group) lies inside wte, so params_in_partition is wte alone and
  // grads_in_partition holds all of wte.
  const graph::Trace t = graph::build_training_trace(gpt2_l2(), dp_recipe(Parallel::kZero2, 2, Precision::kBf16Master), find_gpu("cpu"));
  EXPECT_EQ(allocs_at(t, "zero.reduce_ipg_grads"),
            (std::vector<std::uint64_t>{kGpt2L2Params * 2, kGpt2Wte * 2, kGpt2L2Params * 2, kGpt2Wte * 2}));
}

TEST(ZeroOptimizer, TheNormIsMaskedCheckedAndClipsAtTheDefault) {
  // DeepSpeed 0.19.8's step, fp32 (measured: cpu-zero1-gpt2l2-fp32-sgd-b2s32 traced, every
  // allocation): get_grad_norm_direct (the slice's float64 copy and norm, stack, pow, sum, float,
  // the root, then mask_nan_or_inf_with_val_inplace's isinf, isnan, or and -1.0),
  // combine_grad_norm_groups (stack, isfinite's abs, !=, == and product, ~, < 0, |, any,
  // vector_norm, full_like, where), step()'s is_invalid_grad_norm (the same nine), the norm over
  // the loss scale; then unscale_and_clip_grads at gradient_clipping 1.0: the check again, /, +,
  // /, clamp, *, the reciprocal and 1.0 times it. 0-dim tensors, as the engine sizes them.
  const graph::Trace t = graph::build_training_trace(gpt2_l2(), dp_recipe(Parallel::kZero1, 2, Precision::kFp32), find_gpu("cpu"));
  const std::vector<std::uint64_t> invalid = {4, 1, 1, 1, 1, 1, 1, 1};
  // One slice: rank 0's half of the flat group, inside wte (26,780,544 elements, measured).
  std::vector<std::uint64_t> norm = {26'780'544 * 8, 8, 8, 8, 8, 4, 4, 1, 1, 1, 4, 4};
  norm.insert(norm.end(), invalid.begin(), invalid.end());
  for (std::uint64_t b : {4, 4, 4}) norm.push_back(b);  // vector_norm, full_like, where
  norm.insert(norm.end(), invalid.begin(), invalid.end());
  norm.push_back(4);  // _global_grad_norm
  std::vector<std::uint64_t> clip = invalid;
  for (std::uint64_t b : {4, 4, 4, 4, 4, 4, 4}) clip.push_back(b);
  const std::vector<std::uint64_t> step1 = allocs_at(t, "zero.grad_norm");
  ASSERT_GE(step1.size(), norm.size());
  EXPECT_EQ(std::vector<std::uint64_t>(step1.begin(), step1.begin() + static_cast<std::ptrdiff_t>(norm.size())), norm);
  const std::vector<std::uint64_t> clipped = allocs_at(t, "zero.unscale_and_clip_grads");
  ASSERT_GE(clipped.size(), clip.size());
  EXPECT_EQ(std::vector<std::uint64_t>(clipped.begin(), clipped.begin() + static_cast<std::ptrdiff_t>(clip.size())), clip);
}

TEST(ZeroOptimizer, Bf16ModeChecksEveryGradientForOverflowFirst) {
  // DeepSpeed's bf16 mode (bf16.check_grad_overflow, on by default) starts step() with
  // has_overflow_partitioned_grads_serial: a float count, then per averaged gradient isfinite of
  // its amax and of its amin (bf16 0-dim tensors), and, not; the count's bool and byte (measured:
  // cpu-zero2-qwen2.5w512l2-4bitfp4-lora8-bf16master-adamw-drop-b2s32 traced). An fp32 run has none.
  const graph::Trace t = graph::build_training_trace(gpt2_l2(), dp_recipe(Parallel::kZero1, 2, Precision::kBf16Master), find_gpu("cpu"));
  const std::vector<std::uint64_t> extreme = {2, 2, 1, 1, 1};  // amax (amin), isfinite: abs, !=, ==, product
  std::vector<std::uint64_t> want = {4};
  for (int k = 0; k < 2; ++k) want.insert(want.end(), extreme.begin(), extreme.end());
  for (std::uint64_t b : {1, 1, 1, 1}) want.push_back(b);  // and, not; then bool, byte (one slice: wte)
  std::vector<std::uint64_t> step1 = allocs_at(t, "zero.check_overflow");
  ASSERT_GE(step1.size(), want.size());
  step1.resize(want.size());
  EXPECT_EQ(step1, want);
  const graph::Trace fp32 = graph::build_training_trace(gpt2_l2(), dp_recipe(Parallel::kZero1, 2, Precision::kFp32), find_gpu("cpu"));
  EXPECT_TRUE(allocs_at(fp32, "zero.check_overflow").empty());
}

// dp_recipe at world 2, fp32 SGD, batch x seq: the quick measured entries' recipe.
Recipe fp32_sgd(Parallel parallel, std::uint64_t batch, std::uint64_t seq) {
  Recipe r = dp_recipe(parallel, 2, Precision::kFp32);
  r.optimizer = Optimizer::kSgd;
  r.batch = batch;
  r.seq = seq;
  r.validate();
  return r;
}

TEST(ZeroFlatGroup, ParametersInModuleOrder) {
  // The flat group follows the client optimizer's parameters, module.parameters(): in a decoder
  // layer q_proj comes first and the norms last, so rank 1's partition of a 2-layer Qwen3-0.6B under ZeRO-1
  // has the rest of the embedding and then layer 0's q_proj [2048, 1024] (measured: its gradient
  // norm's float64 copies, cpu-zero1-qwen3l2-fp32-sgd-ckpt-b1s32 traced; the table's order put
  // input_layernorm's [1024] there).
  const Model m = testing::measured_config("qwen3-0.6b-l2");
  Recipe r = fp32_sgd(Parallel::kZero1, 1, 32);
  r.checkpointing = Checkpointing::kFull;
  r.validate();
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu("cpu"), {}, /*rank=*/1);
  const std::vector<std::uint64_t> norm = allocs_at(t, "zero.grad_norm");
  ASSERT_GE(norm.size(), 3u);
  EXPECT_EQ(norm[1], 8u);  // the embedding slice's 0-dim norm
  EXPECT_EQ(norm[2], 2048u * 1024 * 8);
}

TEST(ZeroOptimizer, StatesAreSizedByThePartition) {
  const Model m = gpt2_l2();
  const graph::Trace t = graph::build_training_trace(m, dp_recipe(Parallel::kZero2, 4, Precision::kBf16Master), find_gpu("cpu"));
  // exp_avg and exp_avg_sq of one fp32 parameter (the partition), and its CPU `step`.
  EXPECT_EQ(allocs_at(t, "optimizer.init_state"),
            (std::vector<std::uint64_t>{4, kGpt2L2Params / 4 * 4, kGpt2L2Params / 4 * 4}));
}

// DeepSpeed's estimator without offload: 2N + 18N/G bytes of model states per GPU (2 for the
// 16-bit parameters; per partition 2 for 16-bit gradients, 4 for fp32 gradients, 4 for fp32
// parameters and 8 for Adam's two moments). The engine holds the same pieces: the weights and
// states after the run, and the gradients at their largest in the step (grads_in_partition and
// the fp32 gradient partition together, at the fp32 conversion). Where they differ, and why:
// grads_in_partition holds whole parameters (every parameter that overlaps the partition), so it
// exceeds 2N/G by the part of those parameters outside it; with more than one parameter in the
// partition, the 16-bit flat copy of the gradient slices (_flatten_dense_tensors, 2N/G) is live
// while .to(fp32) makes the fp32 gradient; the CPU `step` tensor (4 B); and what the estimator
// leaves out altogether (the ipg bucket, activations, temporaries).
TEST(ZeroOptimizer, ModelStatesMatchDeepSpeedsEstimator) {
  const Model m = gpt2_l2();
  const std::uint64_t n = kGpt2L2Params;
  for (std::uint64_t g : {1u, 2u, 4u}) {
    ASSERT_EQ(n % (2 * g), 0u);  // no padding, so the estimator's N/G is the partition exactly
    const graph::Trace t = graph::build_training_trace(m, dp_recipe(Parallel::kZero2, g, Precision::kBf16Master), find_gpu("cpu"));
    const auto end = live_after(t, 2, "");
    EXPECT_EQ(end[kWeights] + end[kStates], 2 * n + 12 * n / g + 4) << g;
    const auto step = live_after(t, 2, "zero.fp32_grad_partition", kGrads);
    const std::uint64_t in_partition = g == 1 ? n : kGpt2Wte;  // wte is larger than N/2
    const std::uint64_t flat_copy = g == 1 ? 2 * n / g : 0;        // one slice: a view, no copy
    EXPECT_EQ(step[kGrads], 2 * in_partition + flat_copy + 4 * n / g) << g;
    if (g == 1) {  // every parameter in the one partition: the estimator's pieces exactly
      const std::uint64_t estimator = 2 * n + 18 * n / g;
      EXPECT_EQ(step[kWeights] + step[kGrads] - flat_copy + end[kStates] - 4, estimator);
    }
  }
}

TEST(ZeroBuckets, Zero1KeepsTheFullGradientsUntilTheEndOfBackward) {
  // ZeRO-1 moves the .grads into the bucket only in reduce_gradients, after the backward; ZeRO-2
  // moves each as its hook runs. At the peak (the tied embedding's gradient sum, wte last) ZeRO-1
  // still holds every other parameter's 16-bit gradient, as measured (docs/parallelism.md).
  const Model m = gpt2_l2();
  const Estimate e1 = estimate(m, dp_recipe(Parallel::kZero1, 2, Precision::kBf16Master));
  const Estimate e2 = estimate(m, dp_recipe(Parallel::kZero2, 2, Precision::kBf16Master));
  EXPECT_EQ(e1.breakdown_at_peak[kGrads] - e2.breakdown_at_peak[kGrads], (kGpt2L2Params - kGpt2Wte) * 2);
  EXPECT_EQ(e1.peak_allocated_bytes - e2.peak_allocated_bytes, (kGpt2L2Params - kGpt2Wte) * 2);
}

// Accumulation (unmeasured): ZeRO-1 reduces at the boundary only, so one bucket per step; ZeRO-2
// one per micro-batch. The replay that skips repeated micro-batches agrees with the full one.
TEST(ZeroBuckets, AccumulationBucketsAndSkippedMicroBatches) {
  const Model m = gpt2_l2();
  for (Parallel stage : {Parallel::kZero1, Parallel::kZero2}) {
    Recipe r = dp_recipe(stage, 2, Precision::kBf16Master);
    r.batch = 1;
    r.grad_accum = 3;
    const graph::Trace t = graph::build_training_trace(m, r, find_gpu("cpu"));
    EXPECT_EQ(allocs_at(t, "zero.setup_buckets").size(), stage == Parallel::kZero1 ? 2u : 6u);
    const Estimate skipping = estimate(m, r);
    EstimateOptions every;
    every.timeline = true;  // every micro-batch replayed
    const Estimate full = estimate(m, r, every);
    EXPECT_EQ(skipping.peak_allocated_bytes, full.peak_allocated_bytes);
    EXPECT_EQ(skipping.breakdown_at_peak, full.breakdown_at_peak);
    ASSERT_EQ(skipping.steps.size(), full.steps.size());
    for (std::size_t i = 0; i < full.steps.size(); ++i) {
      EXPECT_EQ(skipping.steps[i].peak_allocated_bytes, full.steps[i].peak_allocated_bytes);
    }
  }
}

// Every rank's memory, against every rank of the ZeRO measurements: each records all ranks' step
// peaks (diagnostics.parallel.ranks), and ranks differ where their partitions overlap different
// parameters (grads_in_partition holds them whole). Allocated bytes on the CPU are the live
// storages rounded to 512 B blocks, as the replay counts them.
TEST(ZeroRanks, EveryRankOfTheMeasurements) {
  const std::filesystem::path dir = std::filesystem::path(TRAINMEM_DATA_DIR) / "ground_truth" / "parallel";
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("cpu-zero", 0) != 0) continue;
    ++files;
    std::ifstream in(entry.path());
    const nlohmann::json j = nlohmann::json::parse(in);
    const nlohmann::json& rj = j["recipe"];
    RecipeSpelling sp;
    sp.batch = rj["batch"];
    sp.seq = rj["seq"];
    sp.grad_accum = rj["grad_accum"];
    sp.precision = rj["precision"];
    sp.optimizer = rj["optimizer"];
    sp.gpu = "cpu";
    sp.allocator = "expandable";
    sp.gpus = rj["gpus"];
    sp.parallel = rj["parallel"];
    sp.checkpointing = rj.value("checkpointing", "none");
    sp.attention = rj.value("attention", "sdpa");
    sp.attention_mask = rj.value("attention_mask", "none");
    sp.loss = rj.value("loss", "standard");
    sp.lora_rank = rj.value("lora_rank", std::uint64_t{0});
    sp.lora_dropout = rj.value("lora_dropout", 0.0);
    sp.use_cache = rj.value("use_cache", false);  // a Trainer run's training cache under ZeRO
    sp.load_in_4bit = rj.value("load_in_4bit", false);  // QLoRA under ZeRO
    if (sp.load_in_4bit) {
      sp.bnb_4bit_quant_type = rj.value("bnb_4bit_quant_type", std::string("fp4"));
      sp.bnb_4bit_use_double_quant = rj.value("bnb_4bit_use_double_quant", false);
      sp.load_dtype = rj.value("load_dtype", std::string("auto"));
      sp.bnb_4bit_quant_storage = rj.value("bnb_4bit_quant_storage", std::string("uint8"));
    }
    if (rj.contains("lora_targets")) {  // the resolved module paths, as trainmem compare takes them
      std::string targets;
      for (const auto& t : rj["lora_targets"]) targets += (targets.empty() ? "" : ",") + t.get<std::string>();
      sp.lora_targets = targets;
    }
    const Recipe r = parse_recipe(sp);
    std::string model = j["provenance"]["model_argument"];
    model = std::string(TRAINMEM_DATA_DIR) + "/" + model.substr(std::string("data/").size());
    const Model m = load_model(model);
    for (const nlohmann::json& rank : j["diagnostics"]["parallel"]["ranks"]) {
      const graph::Trace t = graph::build_training_trace(m, r, find_gpu("cpu"), {}, rank["rank"]);
      std::vector<std::uint64_t> peaks(r.steps, 0);
      std::uint64_t live = 0;
      for (const graph::Event& e : t.events) {
        const std::uint64_t block = (t.storages[e.tensor].bytes + 511) / 512 * 512;
        live = e.alloc ? live + block : live - block;
        const std::uint32_t step = t.moments[e.moment].step;
        if (step >= 1 && step <= r.steps) peaks[step - 1] = std::max(peaks[step - 1], live);
      }
      std::vector<std::uint64_t> measured;
      for (const nlohmann::json& st : rank["steps"]) measured.push_back(st["peak_allocated_bytes"]);
      EXPECT_EQ(peaks, measured) << name << " rank " << rank["rank"];
    }
  }
  EXPECT_GE(files, 5);
}

// Note [The worst rank] in src/estimate.cpp: under ZeRO every rank is replayed and the estimate
// is the one with the most reserved bytes; a rank asked for is that rank alone.
TEST(ZeroRanks, TheEstimateIsTheWorstRank) {
  Recipe r = dp_recipe(Parallel::kZero2, 2, Precision::kBf16Master);
  r.batch = 1;
  r.grad_accum = 2;  // rank 1 keeps more whole-parameter gradients (the measured ga2 run)
  const Model m = gpt2_l2();
  const Estimate worst = estimate(m, r);
  ASSERT_EQ(worst.ranks.size(), 2u);
  EXPECT_EQ(worst.ranks[0].rank, 0u);
  EXPECT_EQ(worst.ranks[1].rank, 1u);
  EstimateOptions one;
  for (std::int64_t rank : {0, 1}) {
    one.rank = rank;
    const Estimate e = estimate(m, r, one);
    EXPECT_EQ(e.rank, static_cast<std::uint64_t>(rank));
    ASSERT_EQ(e.ranks.size(), 1u);
    EXPECT_EQ(e.ranks[0].peak_reserved_bytes, worst.ranks[rank].peak_reserved_bytes);
    EXPECT_EQ(e.peak_allocated_bytes, worst.ranks[rank].peak_allocated_bytes);
  }
  const RankPeak& hi = worst.ranks[0].peak_reserved_bytes >= worst.ranks[1].peak_reserved_bytes ? worst.ranks[0] : worst.ranks[1];
  EXPECT_EQ(worst.rank, hi.rank);
  EXPECT_EQ(worst.peak_reserved_bytes, hi.peak_reserved_bytes);
  EXPECT_NE(worst.ranks[0].peak_allocated_bytes, worst.ranks[1].peak_allocated_bytes);
  one.rank = 2;
  EXPECT_THROW(estimate(m, r, one), Error);
}

TEST(ZeroRanks, DdpAndFsdpReplayOneRankForAll) {
  for (Parallel p : {Parallel::kDdp, Parallel::kFsdp}) {
    const Estimate e = estimate(gpt2_l2(), dp_recipe(p, 4, Precision::kFp32));
    ASSERT_EQ(e.ranks.size(), 1u);
    EXPECT_EQ(e.rank, 0u);
    EXPECT_EQ(e.ranks[0].peak_allocated_bytes, e.peak_allocated_bytes);
  }
  EXPECT_TRUE(estimate(gpt2_l2(), dp_recipe(Parallel::kNone, 1, Precision::kFp32)).ranks.empty());
}

// ---- ZeRO-3 (src/graph/zero3.cpp, Note [DeepSpeed ZeRO-3]) ----------------------------------

// GPT-2's parameters in model.parameters() order (the engine's order, DeepSpeed's ds_id order).
std::vector<std::uint64_t> gpt2_l2_numels() {
  std::vector<std::uint64_t> n = {kGpt2Wte, 1024 * 768};
  for (int l = 0; l < 2; ++l) {
    for (std::uint64_t k : {768u, 768u, 768u * 2304, 2304u, 768u * 768, 768u, 768u, 768u, 768u * 3072, 3072u,
                            3072u * 768, 768u}) {
      n.push_back(k);
    }
  }
  n.push_back(768);
  n.push_back(768);
  return n;
}

// Live bytes per category after the last event of step `step`'s forward op `op`.
std::array<std::uint64_t, 6> live_after_forward(const graph::Trace& t, std::uint32_t step, std::string_view op) {
  std::size_t last = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const graph::MomentTag& m = t.moments[t.events[i].moment];
    if (m.step == step && m.phase == Phase::kForward && m.op == op) last = i + 1;
  }
  return testing::live_after_events(t, last);
}

std::uint64_t gpt2_l2_partition(std::uint64_t world) {
  std::uint64_t total = 0;
  for (std::uint64_t n : gpt2_l2_numels()) total += DataParallel::zero3_partition_numel(n, world);
  return total;
}

TEST(Zero3Partition, CeilPerParameterAndThePersistenceThreshold) {
  EXPECT_EQ(DataParallel::zero3_partition_numel(kGpt2Wte, 2), kGpt2Wte / 2);
  EXPECT_EQ(DataParallel::zero3_partition_numel(kGpt2Wte, 3), (kGpt2Wte + 2) / 3);
  EXPECT_EQ(DataParallel::zero3_partition_numel(7, 4), 2u);
  EXPECT_EQ(DataParallel::zero3_partition_numel(1, 8), 1u);  // every rank holds an element
  // stage3_param_persistence_threshold 1e5: `ds_numel <= threshold` stays gathered.
  EXPECT_TRUE(DataParallel::zero3_persistent(100'000));
  EXPECT_FALSE(DataParallel::zero3_persistent(100'001));
  EXPECT_TRUE(DataParallel::zero3_persistent(768));
  // Per parameter, not per group: with 5 GPUs each of the 28 parameters is padded to a multiple
  // of 5 on its own, 67 elements in all (a flat group would need 2).
  EXPECT_EQ(gpt2_l2_partition(2), kGpt2L2Params / 2);
  EXPECT_EQ(gpt2_l2_partition(5) * 5 - kGpt2L2Params, 67u);
}

// The narrow 4-layer Llama of cpu-zero3-llamaw512l4-fp32-sgd-b1s256, whose trace the engine
// matches allocation by allocation on both ranks.
graph::Trace zero3_llama_trace() {
  return graph::build_training_trace(testing::llama_w512(), fp32_sgd(Parallel::kZero3, 1, 256), find_gpu("cpu"));
}

// (alloc, bytes) of every event of `step` and `phase` from the first one at `op` on.
std::vector<std::pair<bool, std::uint64_t>> events_from(const graph::Trace& t, std::uint32_t step, Phase phase,
                                                        std::string_view op, std::size_t n) {
  std::vector<std::pair<bool, std::uint64_t>> out;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (m.step != step || m.phase != phase || (out.empty() && m.op != op)) continue;
    if (out.size() == n) break;
    out.emplace_back(e.alloc, t.storages[e.tensor].bytes);
  }
  return out;
}

// (alloc, bytes) of the events of step 1, decoder layer `layer`, at `op`, in or out of a recompute.
std::vector<std::pair<bool, std::uint64_t>> layer_events(const graph::Trace& t, std::int32_t layer, std::string_view op,
                                                         bool recompute) {
  std::vector<std::pair<bool, std::uint64_t>> out;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (m.step == 1 && m.layer == layer && m.recompute == recompute && m.op == op) out.emplace_back(e.alloc, t.storages[e.tensor].bytes);
  }
  return out;
}

// The llama_w512 LoRA recipe under ZeRO-3 at batch 1, `seq` tokens, with full checkpointing.
Recipe zero3_lora_ckpt(Precision p, std::uint64_t seq) {
  Recipe r = testing::dp_lora_recipe(testing::llama_w512(), Parallel::kZero3, p);
  r.batch = 1;
  r.seq = seq;
  r.checkpointing = Checkpointing::kFull;
  r.validate();
  return r;
}

TEST(Zero3Trace, TheRanksCompareTheRecordedOrdersAtTheForwardsStart) {
  // reset_step: step 1 compares the (empty) module order's length; step 2, with the trace
  // recorded, the module order (115 module calls, forward and backward) and the parameter
  // order's ds_ids and step ids (78 uses): a 0-dim int64 length, then the list (measured).
  const graph::Trace t = zero3_llama_trace();
  std::vector<std::uint64_t> first[3];
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (m.phase != Phase::kForward || !e.alloc || m.step > 2) continue;
    if (first[m.step].size() < 6) first[m.step].push_back(t.storages[e.tensor].bytes);
  }
  EXPECT_EQ(first[1].front(), 8u);
  EXPECT_NE(first[1][1], 8u);  // the embedding's gather: no list of no bytes
  EXPECT_EQ(first[2], (std::vector<std::uint64_t>{8, 115 * 8, 8, 78 * 8, 8, 78 * 8}));
}

TEST(Zero3Trace, ALoraDropoutIdentityIsFetchedInTheBackwardToo) {
  // All-linear LoRA: each lora.Linear calls its lora_dropout (an nn.Identity at p = 0), which
  // makes no node, yet DeepSpeed's Functions around it run its backward hooks wherever its input
  // requires grad (not in layer 0's q/k/v). Step 2's module order: 171 forward module calls and
  // 162 backward ones, 25 of them Identities (measured: rank 1 of
  // cpu-zero3-llamaw512l4-lora16-bf16master-sgd-alllinear-b1s128, a 3 KiB list).
  Recipe r = testing::dp_lora_recipe(testing::llama_w512(), Parallel::kZero3, Precision::kBf16Master);
  r.lora.rank = 16;
  r.lora.targets = resolve_lora_targets(testing::llama_w512().arch, {"all-linear"});
  r.optimizer = Optimizer::kSgd;
  r.batch = 1;
  r.seq = 128;
  r.validate();
  const graph::Trace t = graph::build_training_trace(testing::llama_w512(), r, find_gpu("cpu"));
  std::vector<std::uint64_t> first;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (m.step == 2 && m.phase == Phase::kForward && e.alloc && first.size() < 2) first.push_back(t.storages[e.tensor].bytes);
  }
  EXPECT_EQ(first, (std::vector<std::uint64_t>{8, 333 * 8}));
}

TEST(Zero3Trace, ALinearsInputGradientLeavesAfterItsModulesPostBackward) {
  // LinearFunctionForZeroStage3 makes the input's gradient first, then the weight's; the weight's
  // AccumulateGrad hook copies it into its partition; the module's post-backward hook, on a
  // Function over the module's input, releases the gathered weight; only then is the input's
  // gradient summed into up_proj's (measured: layer 3's gate_proj in step 1's backward).
  const graph::Trace t = zero3_llama_trace();
  const std::uint64_t w = 2048 * 512 * 4, x = 256 * 512 * 4, h = 256 * 2048 * 4;  // w: the whole gathered weight
  const std::vector<std::pair<bool, std::uint64_t>> want = {
      {true, w},  {true, x},  {true, w},    // the gather, the input's gradient, the weight's
      {false, h}, {false, x},               // silu's gradient, the saved input
      {false, w}, {false, w}, {false, x}};  // copied into the partition, released, summed
  EXPECT_EQ(events_from(t, 1, Phase::kBackward, "mlp.gate_proj", want.size()), want);
}

TEST(Zero3Trace, TheGradientNormGoesInModuleParametersOrder) {
  // The optimizer's group is module.parameters(): per layer q, k, v, o, gate, up, down, then the
  // two norms (each gradient partition's float64 copy, half of it on each rank).
  const graph::Trace t = zero3_llama_trace();
  std::vector<std::uint64_t> wide;
  for (std::uint64_t b : allocs_at(t, "zero3.grad_norm")) {
    if (b > 8 * 64) wide.push_back(b / 8);
  }
  ASSERT_GE(wide.size(), 10u);
  EXPECT_EQ(std::vector<std::uint64_t>(wide.begin(), wide.begin() + 10),
            (std::vector<std::uint64_t>{256000, 131072, 65536, 65536, 131072, 524288, 524288, 524288, 256, 256}));
}

TEST(Zero3Trace, ALoraLinearsInputGathersBothGradientsFirst) {
  // The lora.Linear's input passes DeepSpeed's PostBackwardFunction too: lora_A's input gradient
  // waits there for the base layer's (measured: cpu-zero3-llamaw512l4-lora8-fp32-adamw-b1s64,
  // layer 3's q_proj: lora_A's input gradient, its weight's (copied into the partition), then
  // the base weight's gather and the base input gradient, and only then the frees).
  Recipe r = testing::dp_lora_recipe(testing::llama_w512(), Parallel::kZero3, Precision::kFp32);
  r.batch = 1;
  r.seq = 64;
  r.validate();
  const graph::Trace t = graph::build_training_trace(testing::llama_w512(), r, find_gpu("cpu"));
  const std::uint64_t x = 64 * 512 * 4, a = 8 * 512 * 4;
  const std::vector<std::pair<bool, std::uint64_t>> want = {
      {true, x}, {true, a}, {false, 64 * 8 * 4}, {false, a}, {true, 512 * 512 * 4}, {true, x}};
  EXPECT_EQ(events_from(t, 1, Phase::kBackward, "self_attn.q_proj.lora_A.default", want.size()), want);
}

TEST(Zero3Trace, TheRecomputeStopsAfterTheLastCustomFunctionsOutput) {
  // LinearFunctionForZeroStage3 saves its input when its forward has returned, so the
  // checkpoint's early stop at down_proj (the segment's last saving op) comes after down_proj's
  // output is made, which the recompute then drops (measured:
  // cpu-zero3-llamaw512l4-lora8-fp32-adamw-ckpt-b1s128, layer 3's recompute in step 1).
  const graph::Trace t =
      graph::build_training_trace(testing::llama_w512(), zero3_lora_ckpt(Precision::kFp32, 128), find_gpu("cpu"));
  const std::vector<std::pair<bool, std::uint64_t>> down = layer_events(t, 3, "mlp.down_proj", /*recompute=*/true);
  const std::uint64_t out = 128 * 512 * 4;
  EXPECT_NE(std::find(down.begin(), down.end(), std::make_pair(true, out)), down.end());
}

TEST(Zero3Trace, ALinearWithABiasMakesInputWeightThenBias) {
  // LinearFunctionForZeroStage3's backward: the input's gradient, the weight's, then the bias's
  // sum (measured: cpu-zero3-qwen2.5w512l2-fp32-sgd-b1s64, layer 1's k_proj in step 1, after the
  // weight and bias are gathered: one flat buffer, then a cat per parameter).
  const Model m = testing::measured_config("qwen2.5-0.5b-w512-l2");
  Recipe r = fp32_sgd(Parallel::kZero3, 1, 64);
  r.allocator = AllocatorMode::kDefault;
  r.validate();
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu("cpu"));
  const std::uint64_t w = 256 * 512 * 4, b = 256 * 4, x = 64 * 512 * 4;
  const std::vector<std::pair<bool, std::uint64_t>> want = {{true, w + b}, {true, w}, {true, b}, {false, w + b},
                                                            {true, x},     {true, w}, {true, b}};
  EXPECT_EQ(events_from(t, 1, Phase::kBackward, "self_attn.k_proj", want.size()), want);
}

TEST(Zero3Trace, ReduceScatterPadsGoWhenTheCoalescedCallReturns) {
  // World 3: reduce_scatter_coalesced pads every short chunk with a torch.empty, cats the list
  // into the flat buffer, and gloo hands back a temporary of the same size; the pads go with the
  // list when the call returns, after that temporary, last first (measured:
  // cpu-zero3x3-qwen2.5w512l2-4bitfp4-lora8-bf16master-adamw-qsbf16-b2s32, every rank).
  Recipe r = dp_recipe(Parallel::kZero3, 3, Precision::kFp32);
  r.optimizer = Optimizer::kSgd;
  r.validate();
  const graph::Trace t = graph::build_training_trace(testing::llama_w512(), r, find_gpu("cpu"));
  std::vector<std::pair<bool, std::uint64_t>> ev;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (m.step == 1 && m.op == "zero3.reduce_ipg_grads") ev.emplace_back(e.alloc, t.storages[e.tensor].bytes);
  }
  std::size_t pads = 0;
  while (pads < ev.size() && ev[pads].first && ev[pads].second < 512) ++pads;
  ASSERT_GT(pads, 0u);
  ASSERT_GE(ev.size(), 2 * pads + 3);
  const std::uint64_t flat = ev[pads].second;
  EXPECT_EQ(ev[pads + 1], std::make_pair(true, flat));   // gloo's temporary
  EXPECT_EQ(ev[pads + 2], std::make_pair(false, flat));  // copied out and freed
  for (std::size_t k = 0; k < pads; ++k) {
    EXPECT_EQ(ev[pads + 3 + k], std::make_pair(false, ev[pads - 1 - k].second)) << k;  // last first
  }
}

TEST(Zero3Trace, APrefetchGathersInDsIdOrder) {
  // The prefetch's flat buffer takes the parameters by ds_id, module.parameters() order: Phi-3
  // registers o_proj before qkv_proj, so layer 0's o_proj (1 MiB in fp32) comes before its
  // qkv_proj (3 MiB) in step 2's first gather, after the embedding (measured: the traces of
  // cpu-zero3-phi3w512l2-qlora8-fp32-sgd-eager-qkvo-b1s64, packed 4-bit weights in that order).
  const Model m = testing::measured_config("phi-3-mini-4k-instruct-w512-l2");
  const graph::Trace t = graph::build_training_trace(m, fp32_sgd(Parallel::kZero3, 1, 64), find_gpu("cpu"));
  std::vector<std::uint64_t> gathered;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mt = t.moments[e.moment];
    if (mt.step == 2 && mt.phase == Phase::kForward && e.alloc && mt.op == "embed_tokens") {
      gathered.push_back(t.storages[e.tensor].bytes);
    }
  }
  ASSERT_GE(gathered.size(), 3u);
  EXPECT_EQ((std::vector<std::uint64_t>(gathered.begin(), gathered.begin() + 3)),
            (std::vector<std::uint64_t>{1000 * 512 * 4, 512 * 512 * 4, 1536 * 512 * 4}));
}

TEST(Zero3Trace, ACheckpointsFrameGoesWithItsFirstSavingNodeBehindATail) {
  // Under ZeRO-3 a checkpoint has a tail (its module hooks' nodes), and still its frame, which
  // holds the layer's bf16 input, goes when the segment's first saving node (input_layernorm's
  // pow of the fp32 copy) releases its variables: before the norm's input gradient is cast back
  // to bf16 (measured: cpu-zero3-llamaw512l4-qlora16-bf16master-sgd-alllinear-qsbf16-ckpt-b1s128,
  // layer 3 in step 1; the frame used to go after the whole segment).
  const graph::Trace t =
      graph::build_training_trace(testing::llama_w512(), zero3_lora_ckpt(Precision::kBf16Master, 128), find_gpu("cpu"));
  const std::vector<std::pair<bool, std::uint64_t>> norm = layer_events(t, 3, "input_layernorm", /*recompute=*/false);
  const std::uint64_t x = 128 * 512 * 2;
  const auto cast = std::find(norm.rbegin(), norm.rend(), std::make_pair(true, x)).base() - 1;  // the cast back
  ASSERT_GE(cast - norm.begin(), 2);
  EXPECT_EQ(*(cast - 2), std::make_pair(false, x));      // the frame's input, with pow's variables
  EXPECT_EQ(*(cast - 1), std::make_pair(false, 2 * x));  // the fp32 gradient added in place
}

TEST(Zero3Setup, PartitionsBucketAndGradientPartitionsAreMadeOnce) {
  const Model m = gpt2_l2();
  for (std::uint64_t world : {2u, 3u}) {
    for (Precision p : {Precision::kBf16Master, Precision::kFp32}) {
      const std::uint64_t item = p == Precision::kFp32 ? 4 : 2;
      const graph::Trace t = graph::build_training_trace(m, dp_recipe(Parallel::kZero3, world, p), find_gpu("cpu"));
      const std::uint64_t part = gpt2_l2_partition(world);
      EXPECT_EQ(allocs_at(t, "zero3.partition_parameters"), (std::vector<std::uint64_t>{part * item})) << world;
      EXPECT_EQ(allocs_at(t, "zero3.fp32_partitions"), (std::vector<std::uint64_t>{part * 4})) << world;
      EXPECT_EQ(allocs_at(t, "zero3.ipg_bucket"), (std::vector<std::uint64_t>{kBucketElements * item})) << world;
      EXPECT_EQ(allocs_at(t, "zero3.grad_partitions"), (std::vector<std::uint64_t>{part * item, 1})) << world;
      EXPECT_TRUE(allocs_at(t, "optimizer.master_copy").empty());
      // The torch optimizer steps the one fp32 sub-group: its states are sized by it.
      EXPECT_EQ(allocs_at(t, "optimizer.init_state"), (std::vector<std::uint64_t>{4, part * 4, part * 4})) << world;
    }
  }
}

// What is gathered where. Step 1 runs without a trace: a module's parameters, persistent ones
// included, are gathered for its forward and released after it. What autograd saved does not hold
// them: it saved the parameters themselves, and the release swaps their .data for an empty
// placeholder (free_param), so the gathered storage goes at once (Note [DeepSpeed ZeRO-3]). After
// layer 1's c_fc only the partitions are held. In step 2 the recorded order keeps every parameter
// that the backward uses again (max_reuse_distance 1e9 covers the model) and prefetches the rest:
// at the end of the forward the whole model is gathered once.
TEST(Zero3Gather, NothingHeldAfterAModuleInStepOneTheWholeModelInStepTwo) {
  const Model m = gpt2_l2();
  const graph::Trace t = graph::build_training_trace(m, dp_recipe(Parallel::kZero3, 2, Precision::kBf16Master), find_gpu("cpu"));
  const std::uint64_t part = gpt2_l2_partition(2);
  const std::uint64_t states = part * 2 + part * 4;  // lp_param_buffer and the fp32 partition
  const auto in_fc = live_after_forward(t, 1, "mlp.c_fc");
  EXPECT_EQ(in_fc[kWeights], states);
  const auto before_loss = live_after_forward(t, 2, "ln_f");
  EXPECT_EQ(before_loss[kWeights], states + kGpt2L2Params * 2) << "every parameter gathered, once";
}

// DeepSpeed's estimator without offload (stage3.py estimate_zero3_model_states_mem_needs):
// 4 x largest_layer_params + 18 P / G bytes per GPU. largest_layer_params is the largest module's
// own parameters (GPT-2: wte, 38.6 M); 18 = 2 (16-bit parameter partition) + 4 (fp32 master) +
// 8 (Adam's moments) + 4 (fp32 gradient). The engine holds those pieces (exact per-parameter
// ceil partitions) and, besides them, the 16-bit gradient partitions (grad_partitions_flat_buffer,
// 2 P / G, for the whole run), the 16-bit flat copy of the gradients while they are converted to
// fp32 (2 P / G, a temporary: made in the step, outside the gradient hooks) and the ipg bucket (reduce_bucket_size x 2 B = 1 GB for the whole run); what it
// gathers is not one largest layer but what the coordinator holds (prefetch and reuse distance).
TEST(Zero3Optimizer, ModelStatesAgainstDeepSpeedsEstimator) {
  const Model m = gpt2_l2();
  for (std::uint64_t g : {2u, 4u}) {
    const std::uint64_t part = gpt2_l2_partition(g);
    ASSERT_EQ(part * g, kGpt2L2Params);  // no per-parameter padding: the estimator's P/G exactly
    const graph::Trace t = graph::build_training_trace(m, dp_recipe(Parallel::kZero3, g, Precision::kBf16Master), find_gpu("cpu"));
    const auto end = live_after(t, 2, "");
    const std::uint64_t bucket = kBucketElements * 2;
    EXPECT_EQ(end[kStates], 8 * part + 4) << g;  // exp_avg, exp_avg_sq and the CPU `step`
    const auto step = live_after(t, 2, "zero3.fp32_grad_partition", kGrads);
    const std::uint64_t estimator_states = 18 * kGpt2L2Params / g;
    // weights (2 + 4) + states (8) + the fp32 gradient (4) = the estimator's 18 P / G; the
    // engine's gradients also hold the 16-bit partitions, the flat copy and the bucket.
    EXPECT_EQ(step[kWeights] + (end[kStates] - 4) + 4 * part, estimator_states) << g;
    EXPECT_EQ(step[kGrads], bucket + 2 * part + 4 * part) << g;  // the flat 16-bit copy is a temporary
    EXPECT_GE(step[kTemps], 2 * part) << g;
    EXPECT_EQ(step[kWeights], 6 * part) << g << ": nothing gathered in the step (all partitioned)";
  }
}

// Note [LoRA under ZeRO-3]: GPT-2 with rank-8 adapters on c_attn (lora_A 8 x 768, lora_B 2,304 x
// 8 per layer). Init partitions every parameter; the frozen base keeps its own partitions, and
// lp_param_buffer, the fp32 sub-group and the gradient partitions hold the adapters'.
Recipe zero3_lora(const Model& m, Precision p) { return testing::dp_lora_recipe(m, Parallel::kZero3, p); }

TEST(Zero3Lora, TheOptimizersGroupsHoldTheAdaptersOnly) {
  const Model m = gpt2_l2();
  const graph::Trace t = graph::build_training_trace(m, zero3_lora(m, Precision::kFp32), find_gpu("cpu"));
  std::vector<std::uint64_t> want;
  for (std::uint64_t n : gpt2_l2_numels()) want.push_back(DataParallel::zero3_partition_numel(n, 2) * 4);
  const std::uint64_t adapters = 2 * (8 * 768 + 2'304 * 8) / 2;  // both layers' adapters, halved
  want.push_back(adapters * 4);                                 // lp_param_buffer
  EXPECT_EQ(allocs_at(t, "zero3.partition_parameters"), want);
  EXPECT_EQ(allocs_at(t, "zero3.fp32_partitions"), (std::vector<std::uint64_t>{adapters * 4}));
  EXPECT_EQ(allocs_at(t, "zero3.grad_partitions"), (std::vector<std::uint64_t>{adapters * 4, 1}));
  EXPECT_EQ(allocs_at(t, "optimizer.init_state"), (std::vector<std::uint64_t>{4, adapters * 4, adapters * 4}));
}

// lora.Linear reads lora_A.weight.dtype, which makes lora_A.weight its external parameter: step 1
// (no trace) gathers it through the getter, once per adapted projection; afterwards the lora.Linear's
// own fetch gathers it, so the getter finds it available.
TEST(Zero3Lora, LoraAIsAnExternalParameterOfItsLoraLinear) {
  const Model m = gpt2_l2();
  const graph::Trace t = graph::build_training_trace(m, zero3_lora(m, Precision::kBf16Master), find_gpu("cpu"));
  std::vector<std::uint32_t> steps;
  for (const graph::Event& e : t.events) {
    if (e.alloc && t.moments[e.moment].op == "zero3.external_parameter") {
      steps.push_back(t.moments[e.moment].step);
      EXPECT_EQ(t.storages[e.tensor].bytes, 8u * 768 * 2);  // lora_A's bf16 partition x world
    }
  }
  EXPECT_EQ(steps, (std::vector<std::uint32_t>{1, 1}));
}

// Note [QLoRA under ZeRO-3]: GPT-2 with rank-8 adapters on c_attn over an nf4 base (Conv1D
// becomes Linear4bit; its bias stays an fp32 parameter after prepare_model_for_kbit_training).
Recipe zero3_qlora(const Model& m, Checkpointing ckpt = Checkpointing::kNone) {
  Recipe r = testing::dp_lora_recipe(m, Parallel::kZero3, Precision::kFp32);
  r.quant.load_in_4bit = true;
  r.quant.quant_type = QuantType::kNf4;
  r.checkpointing = ckpt;
  r.validate();
  return r;
}

// The packed weights are partitioned as bytes; a coalesced fetch makes one flat buffer per dtype,
// in str(dtype) order (float32 before uint8), then each parameter's cat.
TEST(Zero3Qlora, PackedWeightsArePartitionedAndGatheredAsBytes) {
  const Model m = gpt2_l2();
  const graph::Trace t = graph::build_training_trace(m, zero3_qlora(m), find_gpu("cpu"));
  const std::uint64_t packed = graph::packed_4bit(768 * 2304, false).packed_bytes;  // c_attn
  const std::vector<std::uint64_t> parts = allocs_at(t, "zero3.partition_parameters");
  EXPECT_NE(std::find(parts.begin(), parts.end(), DataParallel::zero3_partition_numel(packed, 2)), parts.end());
  std::vector<std::uint64_t> fetch;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mo = t.moments[e.moment];
    if (e.alloc && mo.step == 1 && mo.layer == 0 && mo.op == "attn.c_attn" && fetch.size() < 4) {
      fetch.push_back(t.storages[e.tensor].bytes);
    }
  }
  const std::uint64_t bias = DataParallel::zero3_partition_numel(2304, 2) * 2 * 4;
  const std::uint64_t bytes = DataParallel::zero3_partition_numel(packed, 2) * 2;
  EXPECT_EQ(fetch, (std::vector<std::uint64_t>{bias, bytes, 2304 * 4, packed}));
}

// MatMul4Bit keeps B.view(-1, 1) on its ctx: the release after a module's forward (step 1 has no
// trace) swaps the parameter's .data, but the gathered bytes live until the graph goes, after the
// backward's epilogue. Both attn.c_proj inputs require grad (c_attn has adapters).
TEST(Zero3Qlora, TheGraphHoldsEachGatheredPackedWeightToItsEnd) {
  const Model m = gpt2_l2();
  const graph::Trace t = graph::build_training_trace(m, zero3_qlora(m), find_gpu("cpu"));
  const std::uint64_t packed = graph::packed_4bit(768 * 768, false).packed_bytes;  // attn.c_proj
  std::vector<graph::TensorId> held;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mo = t.moments[e.moment];
    if (e.alloc && mo.step == 1 && mo.phase == Phase::kForward && mo.op == "attn.c_proj" &&
        t.storages[e.tensor].bytes == packed) {
      held.push_back(e.tensor);
    }
  }
  // Per layer the coalesced fetch's flat buffer (freed once waited for) and the weight's cat.
  ASSERT_EQ(held.size(), 4u);
  std::size_t in_forward = 0, with_the_graph = 0;
  for (const graph::Event& e : t.events) {
    if (e.alloc || std::find(held.begin(), held.end(), e.tensor) == held.end()) continue;
    const graph::MomentTag& mo = t.moments[e.moment];
    in_forward += mo.phase == Phase::kForward && mo.op == "attn.c_proj";
    with_the_graph += mo.step == 1 && mo.op == "zero3.release_backward_leftovers";
  }
  EXPECT_EQ(in_forward, 2u);
  EXPECT_EQ(with_the_graph, 2u);
}

// Note [Checkpoint tails] in graph/tape.h: the narrow Llama's last layer ends in down_proj, a 4-bit
// projection without adapters whose MatMul4Bit saves nothing. Its backward gathers down_proj,
// dequantizes it and releases it before the recompute begins.
TEST(Zero3Qlora, TheCheckpointsTailRunsBeforeTheRecompute) {
  const Model m = testing::llama_w512();
  Recipe r = zero3_qlora(m, Checkpointing::kFull);
  r.batch = 1;
  r.seq = 64;
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu("cpu"));
  const std::int32_t last = static_cast<std::int32_t>(m.arch.num_layers) - 1;
  std::vector<graph::TensorId> gathered;
  bool freed = false, recomputed = false;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mo = t.moments[e.moment];
    if (mo.step != 1 || mo.layer != last) continue;
    if (mo.recompute) {
      recomputed = true;
      break;
    }
    if (mo.phase != Phase::kBackward) continue;
    const graph::Storage& s = t.storages[e.tensor];
    if (e.alloc && mo.op == "mlp.down_proj" && s.category == Category::kWeights) gathered.push_back(e.tensor);
    if (!e.alloc && std::find(gathered.begin(), gathered.end(), e.tensor) != gathered.end()) freed = true;
  }
  EXPECT_TRUE(recomputed);
  EXPECT_FALSE(gathered.empty()) << "down_proj is gathered for its backward before the recompute";
  EXPECT_TRUE(freed) << "and released by its post-backward hook before the recompute";
}

}  // namespace
}  // namespace trainmem
