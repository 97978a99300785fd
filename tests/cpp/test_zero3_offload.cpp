// Tests for DeepSpeed ZeRO-3 with CPU offload (offload_optimizer and / or offload_param {device:
// cpu}; src/graph/zero3_offload.cpp, Note [ZeRO-3 offload]): what leaves the GPU, the host memory
// per rank against DeepSpeed's own estimator (stage3.py estimate_zero3_model_states_mem_needs with
// cpu_offload / cpu_offload_params), the boundary micro-batch, the recipe's refusals, and the
// planner's host budget (Note [Host memory in the planner]). Offload is not measured (the
// measurements are CPU runs): these tests pin the mirror of the source.

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

Recipe z3(std::uint64_t gpus, Offload off, std::uint64_t grad_accum = 1) {
  Recipe r = dp_recipe(Parallel::kZero3, gpus, Precision::kBf16Master);
  r.grad_accum = grad_accum;
  r.offload = off;
  r.validate();
  return r;
}

// Live bytes per category after the trace's last event of step `step`'s op `op` ("": the end).
std::array<std::uint64_t, 6> live_after(const graph::Trace& t, std::uint32_t step, std::string_view op) {
  std::size_t last = t.events.size();
  if (!op.empty()) {
    last = 0;
    for (std::size_t i = 0; i < t.events.size(); ++i) {
      const graph::MomentTag& m = t.moments[t.events[i].moment];
      if (m.step == step && m.op == op) last = i + 1;
    }
  }
  return testing::live_after_events(t, last);
}

std::uint64_t most_live(const graph::Trace& t, std::size_t category) { return testing::most_live(t)[category]; }

// GPT-2's parameter numels, one entry per tensor (the wrap's order does not matter here).
std::vector<std::uint64_t> partitions(const Model& m, std::uint64_t world) {
  std::vector<std::uint64_t> out;
  for (const ParameterGroup& g : m.parameters) {
    for (std::uint64_t k = 0; k < g.count; ++k) out.push_back(DataParallel::zero3_partition_numel(g.numel, world));
  }
  return out;
}

std::uint64_t sum(const std::vector<std::uint64_t>& v) {
  std::uint64_t s = 0;
  for (std::uint64_t x : v) s += x;
  return s;
}

TEST(Zero3Offload, WhatLeavesTheGpu) {
  // offload_optimizer: no fp32 master, no gradient partitions, no optimizer state and no fp32
  // gradient on the GPU; offload_param: no 16-bit partitions (lp_param_buffer). The ipg bucket
  // stays on the GPU either way.
  const Model m = gpt2_l2();
  const std::uint64_t g = 2, part = sum(partitions(m, g));
  ASSERT_EQ(part, kGpt2L2Params / g);
  const graph::Trace none = graph::build_training_trace(m, z3(g, Offload::kNone), find_gpu("cpu"));
  const graph::Trace opt = graph::build_training_trace(m, z3(g, Offload::kOptimizer), find_gpu("cpu"));
  const graph::Trace par = graph::build_training_trace(m, z3(g, Offload::kParams), find_gpu("cpu"));
  const graph::Trace both = graph::build_training_trace(m, z3(g, Offload::kBoth), find_gpu("cpu"));
  const auto end_none = live_after(none, 2, ""), end_opt = live_after(opt, 2, ""), end_par = live_after(par, 2, ""),
             end_both = live_after(both, 2, "");
  EXPECT_EQ(end_none[kWeights] - end_opt[kWeights], 4 * part);   // the fp32 masters
  EXPECT_EQ(end_none[kWeights] - end_par[kWeights], 2 * part);   // the 16-bit partitions
  EXPECT_EQ(end_none[kWeights] - end_both[kWeights], 6 * part);  // what is left: the persistent ones, gathered
  EXPECT_EQ(end_none[kGrads] - end_opt[kGrads], 2 * part);       // grad_partitions_flat_buffer
  EXPECT_EQ(end_opt[kGrads], 500'000'000u * 2);                  // the ipg bucket only
  EXPECT_EQ(end_opt[kStates], 0u);
  EXPECT_EQ(most_live(opt, kStates), 0u);
  EXPECT_EQ(end_par[kStates], end_none[kStates]);  // offload_param alone: the optimizer stays on the GPU
  EXPECT_TRUE(allocs_at(opt, "zero3.fp32_grad_partition").empty());
  EXPECT_TRUE(allocs_at(opt, "zero3.fp32_partitions").empty());
  EXPECT_TRUE(allocs_at(opt, "zero3.grad_partitions").empty());
  EXPECT_FALSE(allocs_at(par, "zero3.fp32_partitions").empty());
  // In the step, after _partition_all_parameters, the GPU weights are the 16-bit partitions
  // (optimizer offload) or nothing (both): DeepSpeed's estimator's 2N / GPUs, and 0.
  EXPECT_EQ(live_after(opt, 2, "zero3.partition_all_parameters")[kWeights], 2 * part);
  EXPECT_EQ(live_after(both, 2, "zero3.partition_all_parameters")[kWeights], 0u);
  // And the peak is lower the more is offloaded.
  const Estimate e_none = estimate(m, z3(g, Offload::kNone)), e_opt = estimate(m, z3(g, Offload::kOptimizer)),
                 e_both = estimate(m, z3(g, Offload::kBoth));
  EXPECT_LT(e_opt.peak_allocated_bytes, e_none.peak_allocated_bytes);
  EXPECT_LT(e_both.peak_allocated_bytes, e_opt.peak_allocated_bytes);
}

TEST(Zero3Offload, ParameterOffloadCopiesEachPartitionIn) {
  // offload_param: every all-gather reads the host partition through a GPU copy
  // (ds_tensor.to(device)): the same gathers, each with one more allocation of the partition
  // per parameter gathered, freed at once.
  const Model m = gpt2_l2();
  const graph::Trace none = graph::build_training_trace(m, z3(2, Offload::kNone), find_gpu("cpu"));
  const graph::Trace par = graph::build_training_trace(m, z3(2, Offload::kParams), find_gpu("cpu"));
  std::uint64_t allocs_none = 0, allocs_par = 0;
  for (const graph::Event& e : none.events) allocs_none += e.alloc && none.storages[e.tensor].category == Category::kWeights;
  for (const graph::Event& e : par.events) allocs_par += e.alloc && par.storages[e.tensor].category == Category::kWeights;
  // One fewer (lp_param_buffer), one more per gathered parameter: at least every parameter of
  // both steps' forwards.
  const std::uint64_t tensors = partitions(m, 2).size();
  EXPECT_GE(allocs_par + 1, allocs_none + 2 * tensors);
}

TEST(Zero3Offload, HostMemoryPerRank) {
  // offload_optimizer, per rank of P partition elements: pageable fp32 masters (4P) and CPUAdam's
  // moments (8P); pinned grad_partitions_flat_buffer (2P, bf16) and fp32 .grad (4P).
  // offload_param: the pinned 16-bit flat (2P), plus Init's per-parameter pinned partitions,
  // freed but cached by the host allocator (blocks only).
  const Model m = gpt2_l2();
  const std::uint64_t g = 2;
  const std::vector<std::uint64_t> parts = partitions(m, g);
  const std::uint64_t p = sum(parts);
  const auto p2 = DataParallel::pinned_block_bytes;
  const HostMemory opt = estimate(m, z3(g, Offload::kOptimizer)).host;
  EXPECT_EQ(opt.weights_bytes, 4 * p);
  EXPECT_EQ(opt.optimizer_states_bytes, 8 * p);
  EXPECT_EQ(opt.gradients_bytes, 6 * p);
  EXPECT_EQ(opt.pageable_bytes, 12 * p);
  EXPECT_EQ(opt.pinned_requested_bytes, 6 * p);
  EXPECT_EQ(opt.pinned_bytes, p2(2 * p) + p2(4 * p));
  const HostMemory par = estimate(m, z3(g, Offload::kParams)).host;
  std::uint64_t cached = 0;
  for (std::uint64_t n : parts) cached += p2(2 * n);
  EXPECT_EQ(par.weights_bytes, 2 * p);
  EXPECT_EQ(par.optimizer_states_bytes + par.gradients_bytes + par.pageable_bytes, 0u);
  EXPECT_EQ(par.pinned_requested_bytes, 2 * p);
  EXPECT_EQ(par.pinned_bytes, p2(2 * p) + cached);
  const HostMemory both = estimate(m, z3(g, Offload::kBoth)).host;
  EXPECT_EQ(both.total_bytes(), opt.total_bytes() + par.total_bytes());
  EXPECT_EQ(estimate(m, z3(g, Offload::kNone)).host.total_bytes(), 0u);
}

// DeepSpeed's estimator (zero_init, additional_buffer_factor 1.5): per node N x 18 x 1.5 host
// bytes with both offloads, N x 16 x 1.5 with offload_optimizer alone; per GPU 4 x the largest
// module's own parameters, + 2N / GPUs with offload_optimizer alone. The 16 is 4 (fp32 master) + 8
// (Adam) + 4 (fp32 gradient), the 18 adds the 16-bit partitions. Summed over a node's ranks the
// engine holds those and, besides them, the pinned 16-bit gradient partitions
// (grad_partitions_flat_buffer, 2N): DeepSpeed's 16 and 18 leave it to the 1.5 factor. GPU: the
// engine's persistent weights in the step are the 2N / GPUs partitions (or none); the 4 x largest
// layer is what DeepSpeed allows for the gathered parameters, which the engine replays instead.
TEST(Zero3Offload, HostModelStatesAgainstDeepSpeedsEstimator) {
  const Model m = gpt2_l2();
  const std::uint64_t n = kGpt2L2Params;
  for (std::uint64_t g : {1u, 2u, 4u}) {
    ASSERT_EQ(sum(partitions(m, g)) * g, n);  // no padding: the estimator's N / G exactly
    for (Offload off : {Offload::kOptimizer, Offload::kBoth}) {
      std::uint64_t states = 0;
      for (std::uint64_t rank = 0; rank < g; ++rank) {
        EstimateOptions o;
        o.rank = static_cast<std::int64_t>(rank);
        const HostMemory h = estimate(m, z3(g, off), o).host;
        states += h.weights_bytes + h.optimizer_states_bytes + h.gradients_bytes - 2 * n / g;
      }
      const double deepspeed_cpu = static_cast<double>(n) * (off == Offload::kBoth ? 18 : 16) * 1.5;
      EXPECT_EQ(static_cast<double>(states), deepspeed_cpu / 1.5) << g;
    }
  }
}

TEST(Zero3Offload, TheBoundaryMicroBatchTakesTheNormsAndIsNeverSkipped) {
  // Every micro-batch copies the gradient partitions to the host and back (one GPU copy per
  // parameter); only the boundary takes the norms (kept to the step) and the fp32 copies. When
  // the replay says the rest repeats, the builder still builds the last micro-batch.
  const Model m = gpt2_l2();
  const auto skip = [](const graph::Trace&, std::uint32_t, std::uint32_t) { return graph::MicroBatchNext::kSkipRest; };
  const graph::Trace t = graph::build_training_trace(m, z3(2, Offload::kOptimizer, 4), find_gpu("cpu"), skip, 0);
  std::uint64_t boundary_scalars = 0, other_scalars = 0, boundary = 0, first = 0;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& mt = t.moments[e.moment];
    if (!e.alloc || mt.op != "zero3.reduce_ipg_grads" || mt.step != 2) continue;
    const bool scalar = t.storages[e.tensor].bytes == 8;
    if (mt.micro == 4) {
      ++boundary;
      boundary_scalars += scalar;
    } else {
      ++first;
      other_scalars += scalar;
    }
  }
  const std::uint64_t tensors = partitions(m, 2).size();
  EXPECT_GT(first, 0u);
  EXPECT_EQ(other_scalars, 0u);
  EXPECT_EQ(boundary_scalars, 3 * tensors);  // per parameter: .norm, ** 2, ** 0.5 (one chunk each)
  EXPECT_GT(boundary, first);
  // The norms live until reset_cpu_buffers, after the step.
  const graph::Trace one = graph::build_training_trace(m, z3(2, Offload::kOptimizer), find_gpu("cpu"));
  EXPECT_FALSE(allocs_at(one, "zero3.offload_grad_norm").empty());
}

TEST(Zero3Offload, RecipeRefusals) {  // FSDP2's CPUOffloadPolicy: ZeroOffload.RecipeRefusals
  Recipe r = dp_recipe(Parallel::kDdp, 2, Precision::kFp32);
  r.offload = Offload::kParams;
  EXPECT_NE(error_of([&] { r.validate(); }).find("needs parallel zero1, zero2 or zero3"), std::string::npos);
  r = dp_recipe(Parallel::kZero2, 2, Precision::kFp32);
  r.offload = Offload::kParams;
  EXPECT_NE(error_of([&] { r.validate(); }).find("only ZeRO-3 does"), std::string::npos);
  r = dp_recipe(Parallel::kZero3, 2, Precision::kFp32);
  r.offload = Offload::kBoth;
  r.optimizer = Optimizer::kSgd;
  EXPECT_NE(error_of([&] { r.validate(); }).find("DeepSpeedCPUAdam"), std::string::npos);
  r.offload = Offload::kParams;  // the torch optimizer stays on the GPU
  EXPECT_NO_THROW(r.validate());
  RecipeSpelling sp;
  sp.offload = "nvme";
  EXPECT_NE(error_of([&] { parse_recipe(sp); }).find("offload: unknown value 'nvme'"), std::string::npos);
}

TEST(Zero3Offload, FloorAndTime) {
  // The planner's floor drops what offload moves to the host and stays under the replay; the
  // step time carries the host side.
  const Model m = gpt2_l2();
  std::uint64_t last = ~0ull;
  for (Offload off : {Offload::kNone, Offload::kOptimizer, Offload::kBoth}) {
    const Recipe r = z3(2, off);
    const std::uint64_t floor = plan::persistent_floor(m, r);
    EXPECT_LT(floor, last);
    EXPECT_LE(floor, estimate(m, r).peak_reserved_bytes);
    last = floor;
  }
  auto host_s = [&](Offload off) {
    Recipe r = z3(2, off);
    r.gpu = "h100-80gb";  // the cpu pseudo-device has no step time
    return step_time(m, r).host_s;
  };
  EXPECT_EQ(host_s(Offload::kNone), 0);
  EXPECT_GT(host_s(Offload::kParams), 0);
  EXPECT_GT(host_s(Offload::kBoth), host_s(Offload::kOptimizer));
}

TEST(HostMemoryPlanner, PlansAreHeldToTheHostBudget) {
  // GPT-2 (2 layers) under ZeRO-3 with both offloads: more than half a GB of host memory per rank.
  // A host budget of 256 MiB per GPU rules the offloaded plans out; the default (128 GiB) does not.
  const Model m = gpt2_l2();
  Recipe base = z3(2, Offload::kBoth);
  base.seq = 256;
  base.gpu = "h100-80gb";
  const std::uint64_t host = estimate(m, base).host.total_bytes();
  ASSERT_GT(host, 256ull << 20);
  FitRequest q;
  q.base = base;
  q.gpus = 2;
  q.fixed = {"parallel", "precision", "offload", "optimizer"};
  q.top = 2;
  const FitResult roomy = fit(m, q);
  EXPECT_EQ(roomy.host_capacity_bytes, kDefaultHostMemoryBytes);
  ASSERT_FALSE(roomy.plans.empty());
  EXPECT_EQ(roomy.plans.front().host_bytes, estimate(m, roomy.plans.front().recipe).host.total_bytes());
  EXPECT_TRUE(roomy.baseline.fits);
  q.host_memory_bytes = 256ull << 20;
  const FitResult tight = fit(m, q);
  EXPECT_TRUE(tight.plans.empty());
  EXPECT_FALSE(tight.baseline.fits);
  EXPECT_LE(tight.baseline.peak_reserved_bytes, tight.capacity_bytes);  // the GPU is not the reason
  ASSERT_TRUE(tight.has_closest_miss);
  EXPECT_GT(tight.closest_miss.host_bytes, q.host_memory_bytes);
  // Without offload nothing is held on the host: the budget does not matter.
  q.base = z3(2, Offload::kNone);
  q.base.seq = 256;
  q.base.gpu = "h100-80gb";
  EXPECT_FALSE(fit(m, q).plans.empty());
  q.host_memory_bytes = 0;
  EXPECT_NE(error_of([&] { fit(m, q); }).find("host_memory: must be more than 0"), std::string::npos);
}

}  // namespace
}  // namespace trainmem
