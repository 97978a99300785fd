// Tests for DeepSpeed ZeRO-Offload (offload_optimizer {device: cpu}) under ZeRO-1/2
// (src/graph/zero_offload.cpp, Note [ZeRO-Offload]): what stays on the GPU, the host memory
// against DeepSpeed's own estimator (stage_1_and_2.py estimate_zero2_model_states_mem_needs with
// cpu_offload=True), the pinned allocator's rounding, and the recipe's refusals. Offload is not
// measured (the measurements are CPU runs): these tests pin the mirror of the source.

#include <gtest/gtest.h>

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

constexpr std::uint64_t kGpt2Wte = 50'257 * 768;  // the largest parameter, first in the flat group

Recipe offload_recipe(Parallel parallel, std::uint64_t gpus, std::uint64_t grad_accum = 1) {
  Recipe r = dp_recipe(parallel, gpus, Precision::kBf16Master);
  r.grad_accum = grad_accum;
  r.offload = Offload::kOptimizer;
  r.validate();
  return r;
}

TEST(ZeroOffload, PinnedBlocksArePowersOfTwo) {
  // CachingHostAllocator::allocate rounds every pinned block up to the next power of two.
  EXPECT_EQ(DataParallel::pinned_block_bytes(0), 0u);
  EXPECT_EQ(DataParallel::pinned_block_bytes(1), 1u);
  EXPECT_EQ(DataParallel::pinned_block_bytes(4), 4u);
  EXPECT_EQ(DataParallel::pinned_block_bytes(5), 8u);
  EXPECT_EQ(DataParallel::pinned_block_bytes(3'000'000'000), 4'294'967'296u);
}

TEST(ZeroOffload, OnlyTheFlatGroupStaysOnTheGpu) {
  // With offload the GPU holds the 16-bit flat group (the parameters are views of it) and no fp32
  // partition, no optimizer state; without it the fp32 partition is a GPU weight and Adam's
  // states are on the GPU. Gradients gain temp_grad_buffer_for_gpu_offload (the largest
  // parameter, 16-bit, for the run) and lose the fp32 gradient partition (the ipg bucket, 1 GB of
  // bf16, stays the largest gradient buffer either way).
  const Model m = gpt2_l2();
  const std::uint64_t n = kGpt2L2Params;
  for (Parallel p : {Parallel::kZero1, Parallel::kZero2}) {
    for (std::uint64_t g : {1u, 2u}) {
      ASSERT_EQ(n % (2 * g), 0u);  // no padding: the flat group is the N parameters
      const graph::Trace t = graph::build_training_trace(m, offload_recipe(p, g), find_gpu("cpu"));
      const auto off = most_live(t);
      const auto on = most_live(graph::build_training_trace(m, dp_recipe(p, g, Precision::kBf16Master), find_gpu("cpu")));
      EXPECT_EQ(off[kWeights], 2 * n) << g;  // DeepSpeed's estimator: 2N per GPU
      EXPECT_EQ(on[kWeights], 2 * n + 4 * n / g) << g;
      EXPECT_EQ(off[kStates], 0u) << g;
      EXPECT_GT(on[kStates], 8 * n / g) << g;
      EXPECT_EQ(allocs_at(t, "zero.temp_grad_buffer_for_gpu_offload"), std::vector<std::uint64_t>{2 * kGpt2Wte});
      EXPECT_TRUE(allocs_at(t, "zero.fp32_grad_partition").empty());
      EXPECT_TRUE(allocs_at(t, "optimizer.init_state").empty());
    }
  }
}

TEST(ZeroOffload, HostMemoryPerRank) {
  // Per rank, of Np = N / G partition elements: pinned fp32 master (4 Np), pinned 16-bit staging
  // copy (2 Np), pinned fp32 gradient (4 Np), pinned temp_grad_buffer_for_cpu_offload (the
  // largest parameter, 16-bit); pageable CPUAdam exp_avg and exp_avg_sq (8 Np).
  const Model m = gpt2_l2();
  const std::uint64_t n = kGpt2L2Params, g = 2, np = n / g;
  for (std::int64_t rank : {0, 1}) {
    EstimateOptions o;
    o.rank = rank;
    const Estimate e = estimate(m, offload_recipe(Parallel::kZero2, g), o);
    const HostMemory& h = e.host;
    EXPECT_EQ(h.weights_bytes, 6 * np);
    EXPECT_EQ(h.optimizer_states_bytes, 8 * np);
    EXPECT_EQ(h.gradients_bytes, 4 * np + 2 * kGpt2Wte);
    EXPECT_EQ(h.pageable_bytes, 8 * np);
    EXPECT_EQ(h.pinned_requested_bytes, 10 * np + 2 * kGpt2Wte);
    const auto p2 = DataParallel::pinned_block_bytes;
    EXPECT_EQ(h.pinned_bytes, 2 * p2(4 * np) + p2(2 * np) + p2(2 * kGpt2Wte));
    EXPECT_EQ(h.total_bytes(), h.pinned_bytes + h.pageable_bytes);
  }
  EXPECT_EQ(estimate(m, dp_recipe(Parallel::kZero2, g, Precision::kBf16Master)).host.total_bytes(), 0u);
}

// DeepSpeed's estimator with cpu_offload=True: 2N per GPU, and per node N x max(4G, 16) x 1.5
// (additional_buffer_factor). The 16 is 4 (fp32 master) + 4 (fp32 gradient) + 8 (Adam's moments);
// the engine holds exactly those on the host, summed over the node's ranks. Where it differs, and
// why: it also counts the pinned 16-bit staging copy (2 Np per rank) and
// temp_grad_buffer_for_cpu_offload (the largest parameter per rank), which the estimator folds
// into its 1.5 factor; pinned blocks are rounded up to powers of two (up to 2x); for G > 4 the
// estimator's 4G per parameter (every rank's fp32 copy of the whole model while
// deepspeed.initialize builds the partitions) is a transient the engine does not hold at the step.
TEST(ZeroOffload, HostModelStatesMatchDeepSpeedsEstimator) {
  const Model m = gpt2_l2();
  const std::uint64_t n = kGpt2L2Params;
  for (std::uint64_t g : {1u, 2u, 4u}) {
    const double deepspeed_cpu = static_cast<double>(n) * static_cast<double>(std::max<std::uint64_t>(4 * g, 16)) * 1.5;
    std::uint64_t states = 0;
    for (std::uint64_t rank = 0; rank < g; ++rank) {
      EstimateOptions o;
      o.rank = static_cast<std::int64_t>(rank);
      const Estimate e = estimate(m, offload_recipe(Parallel::kZero2, g), o);
      const std::uint64_t staging = 2 * n / g, temp = 2 * kGpt2Wte;
      states += e.host.weights_bytes - staging + e.host.gradients_bytes - temp + e.host.optimizer_states_bytes;
      EXPECT_EQ(e.breakdown_at_peak[kWeights], 2 * n) << g;  // the estimator's 2N per GPU
    }
    EXPECT_EQ(static_cast<double>(states), deepspeed_cpu / 1.5) << g;
  }
}

TEST(ZeroOffload, AccumulationKeepsWholeParameterBuffersOnTheHost) {
  // accumulated_grads_in_cpu: a pinned 16-bit buffer of every parameter of the partition (rank 0
  // of 2: the embedding only, wte being larger than N/2), whole, kept for the run.
  const Model m = gpt2_l2();
  const std::uint64_t np = kGpt2L2Params / 2;
  EstimateOptions o;
  o.rank = 0;
  const Estimate e = estimate(m, offload_recipe(Parallel::kZero2, 2, 4), o);
  EXPECT_EQ(e.host.gradients_bytes, 4 * np + 2 * kGpt2Wte + 2 * kGpt2Wte);
  // ZeRO-1 reduces once, at the boundary, where DeepSpeed's micro_step_id is still 0: no host
  // accumulation buffers.
  const Estimate z1 = estimate(m, offload_recipe(Parallel::kZero1, 2, 4), o);
  EXPECT_EQ(z1.host.gradients_bytes, 4 * np + 2 * kGpt2Wte);
}

TEST(ZeroOffload, TheBoundaryMicroBatchIsNeverSkipped) {
  // The boundary micro-batch copies the gradients to the host's fp32 .grad (norm, .to(fp32)); the
  // ones before it only accumulate on the host. When the replay says the rest repeats, the
  // builder still builds the last micro-batch under ZeRO-2.
  const Model m = gpt2_l2();
  const auto skip = [](const graph::Trace&, std::uint32_t, std::uint32_t) { return graph::MicroBatchNext::kSkipRest; };
  const graph::Trace t = graph::build_training_trace(m, offload_recipe(Parallel::kZero2, 2, 4), find_gpu("cpu"), skip, 0);
  std::uint32_t boundary_norms = 0, other = 0;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mt = t.moments[e.moment];
    if (!e.alloc || mt.op != "zero.offload_grad_to_cpu" || t.storages[e.tensor].bytes != 8) continue;
    (mt.micro == 4 ? boundary_norms : other) += 1;
  }
  EXPECT_EQ(boundary_norms, 2u);  // rank 0's one parameter, in each of the two steps
  EXPECT_EQ(other, 0u);
}

TEST(ZeroOffload, PlannerSearchesItAndTimesTheHostSide) {
  // A ZeRO-2 Llama-3.1-8B on one H100 fits only with the optimizer offloaded: the floor lets it
  // through, the single change shows it, and its step time carries the PCIe copies and the CPU
  // step (host_s) instead of the GPU's optimizer traffic.
  const Model m = load_model("llama-3.1-8b");
  Recipe base;
  base.seq = 2048;
  base.parallel = Parallel::kZero2;
  base.precision = Precision::kBf16Master;
  base.validate();
  Recipe off = base;
  off.offload = Offload::kOptimizer;
  EXPECT_LT(plan::persistent_floor(m, off), plan::persistent_floor(m, base));
  const Estimate e = estimate(m, off);
  EXPECT_LE(plan::persistent_floor(m, off), e.peak_reserved_bytes);
  const StepTime t0 = step_time(m, base), t1 = step_time(m, off);
  EXPECT_EQ(t0.host_s, 0);
  EXPECT_GT(t1.host_s, 0);
  EXPECT_LT(t1.memory_s, t0.memory_s);
  FitRequest q;
  q.base = base;
  q.fixed = {"parallel", "precision"};
  q.top = 3;
  // One rank holds the whole model's host states (about 140 GiB): more than the default host
  // budget per GPU (See Note [Host memory in the planner]); a 256 GiB host takes it.
  q.host_memory_bytes = 256ull << 30;
  const FitResult f = fit(m, q);
  ASSERT_FALSE(f.plans.empty());
  EXPECT_EQ(f.plans.front().recipe.offload, Offload::kOptimizer);  // nothing fits without it
  bool shown = false;
  for (const Change& c : f.changes) shown = shown || (c.what == "offload optimizer" && c.plan.fits);
  EXPECT_TRUE(shown);
}

TEST(ZeroOffload, RecipeRefusals) {
  Recipe r = dp_recipe(Parallel::kFsdp, 2, Precision::kFp32);
  r.offload = Offload::kOptimizer;
  EXPECT_NE(error_of([&] { r.validate(); }).find("use offload both"), std::string::npos);  // FSDP2's is all or nothing
  r = dp_recipe(Parallel::kDdp, 2, Precision::kFp32);
  r.offload = Offload::kOptimizer;
  EXPECT_NE(error_of([&] { r.validate(); }).find("needs parallel zero1, zero2 or zero3"), std::string::npos);
  r = dp_recipe(Parallel::kZero2, 2, Precision::kFp32);
  r.offload = Offload::kOptimizer;
  r.optimizer = Optimizer::kSgd;
  EXPECT_NE(error_of([&] { r.validate(); }).find("DeepSpeedCPUAdam"), std::string::npos);
  RecipeSpelling sp;
  sp.offload = "disk";
  EXPECT_NE(error_of([&] { parse_recipe(sp); }).find("offload: unknown value 'disk'"), std::string::npos);
}

}  // namespace
}  // namespace trainmem
