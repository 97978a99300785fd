// Skipping repeated micro-batches (Note [Repeated micro-batches] in src/sim/simulator.cpp) must
// change nothing but the count of replayed events. A timeline asks for every event, so the
// same estimate with a timeline is the full replay to compare with.

#include <gtest/gtest.h>

#include <tuple>
#include <string>
#include <vector>

#include "estimate.h"
#include "graph/step.h"
#include "model/model.h"
#include "plan/plan.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

void expect_same(const Estimate& skipped, const Estimate& full, const std::string& what) {
  EXPECT_EQ(skipped.peak_allocated_bytes, full.peak_allocated_bytes) << what;
  EXPECT_EQ(skipped.peak_reserved_bytes, full.peak_reserved_bytes) << what;
  EXPECT_EQ(skipped.breakdown_at_peak, full.breakdown_at_peak) << what;
  EXPECT_EQ(skipped.peak.step, full.peak.step) << what;
  EXPECT_EQ(skipped.peak.micro_batch, full.peak.micro_batch) << what;
  EXPECT_EQ(skipped.peak.phase, full.peak.phase) << what;
  EXPECT_EQ(skipped.peak.op, full.peak.op) << what;
  ASSERT_EQ(skipped.steps.size(), full.steps.size()) << what;
  for (std::size_t i = 0; i < full.steps.size(); ++i) {
    EXPECT_EQ(skipped.steps[i].peak_allocated_bytes, full.steps[i].peak_allocated_bytes) << what;
    EXPECT_EQ(skipped.steps[i].peak_reserved_bytes, full.steps[i].peak_reserved_bytes) << what;
  }
}

TEST(Replay, SkippingRepeatedMicroBatchesChangesNoResult) {
  EstimateOptions full;
  full.timeline = true;
  std::size_t skipped_some = 0, cases = 0;
  for (const char* name : {"gpt2", "qwen3-0.6b", "gemma-2-2b", "phi-3-mini-4k-instruct", "llama-3.2-1b"}) {
    const Model m = model::with_layers(load_model(name), 2);
    for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kFp16Mixed, Precision::kBf16Master}) {
      for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdamW8bit, Optimizer::kAdafactor}) {
        for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull}) {
          for (Loss l : {Loss::kStandard, Loss::kFused}) {
            for (AllocatorMode a : {AllocatorMode::kDefault, AllocatorMode::kExpandable}) {
              Recipe r;
              r.batch = 2;
              r.seq = 96;
              r.grad_accum = 5;
              r.precision = p;
              r.optimizer = o;
              r.checkpointing = c;
              r.loss = l;
              r.allocator = a;
              const Estimate fast = estimate(m, r);
              const Estimate slow = estimate(m, r, full);
              const std::string what = std::string(name) + " " + std::string(to_string(p)) + " " +
                                       std::string(to_string(o)) + " " + std::string(to_string(c)) + " " +
                                       std::string(to_string(l)) + " " + std::string(to_string(a));
              expect_same(fast, slow, what);
              EXPECT_LE(fast.events, slow.events) << what;
              skipped_some += fast.events < slow.events;
              ++cases;
            }
          }
        }
      }
    }
  }
  // The skip must actually happen, or this test checks nothing.
  EXPECT_GT(skipped_some, cases / 2);
}

// Under the data-parallel wrappers the step's last micro-batch can differ from the repeated ones
// (ZeRO-Offload's boundary, DDP's no_sync): the skip goes on to it from any micro-batch, the one
// just before it included (until 2026-12-07 a repeat found there ended the step without it).
TEST(Replay, SkippingRepeatedMicroBatchesKeepsADataParallelBoundary) {
  EstimateOptions full;
  full.timeline = true;
  const Model m = model::with_layers(load_model("llama-3.2-1b"), 2);
  std::size_t skipped_some = 0, cases = 0;
  std::vector<std::pair<std::string, Recipe>> recipes;
  auto add = [&](const std::string& what, auto&& change) {
    Recipe r;
    r.batch = 1;
    r.seq = 128;
    r.gpus = 2;
    r.precision = Precision::kBf16Master;
    r.gpu = "h100-80gb";
    change(r);
    recipes.emplace_back(what, r);
  };
  add("ddp", [](Recipe& r) { r.parallel = Parallel::kDdp; });
  add("ddp no_sync", [](Recipe& r) {
    r.parallel = Parallel::kDdp;
    r.ddp_no_sync = true;
  });
  add("ddp no_sync bucket view", [](Recipe& r) {
    r.parallel = Parallel::kDdp;
    r.ddp_no_sync = true;
    r.ddp_gradient_as_bucket_view = true;
  });
  add("fsdp no_sync", [](Recipe& r) {
    r.parallel = Parallel::kFsdp;
    r.precision = Precision::kFp32;
    r.fsdp.param_dtype = FsdpDtype::kBf16;
    r.fsdp.reduce_dtype = FsdpDtype::kFp32;
    r.fsdp.no_sync = true;
  });
  for (Parallel p : {Parallel::kZero1, Parallel::kZero2, Parallel::kZero3}) {
    add(std::string(to_string(p)), [p](Recipe& r) { r.parallel = p; });
    add(std::string(to_string(p)) + " offload", [p](Recipe& r) {
      r.parallel = p;
      r.offload = Offload::kOptimizer;
    });
  }
  for (auto& [what, r] : recipes) {
    for (std::uint64_t accum = 2; accum <= 6; ++accum) {
      r.grad_accum = accum;
      r.validate();
      const Estimate fast = estimate(m, r);
      const Estimate slow = estimate(m, r, full);
      const std::string label = what + " grad_accum " + std::to_string(accum);
      expect_same(fast, slow, label);
      skipped_some += fast.events < slow.events;
      ++cases;
    }
  }
  EXPECT_GT(skipped_some, cases / 2);
}

TEST(Replay, ATimelineReplaysEveryMicroBatch) {
  const Model m = model::with_layers(load_model("gpt2"), 1);
  Recipe r;
  r.seq = 64;
  r.grad_accum = 4;
  EstimateOptions timeline;
  timeline.timeline = true;
  const Estimate full = estimate(m, r, timeline);
  const Estimate fast = estimate(m, r);
  EXPECT_LT(fast.events, full.events);
  r.grad_accum = 8;
  EXPECT_EQ(estimate(m, r).events, fast.events) << "the skip makes the replay independent of grad_accum";
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// A replay told to stop above a reserved-bytes limit (the planner's probes) stops exactly when
// the full replay's peak reserved bytes exceed the limit, and is the full replay otherwise.
TEST(Replay, StoppingAboveALimitIsExactlyPeakReservedAboveIt) {
  const Model m = model::with_layers(load_model("llama-3.2-1b"), 3);
  std::size_t stopped = 0, cases = 0;
  for (std::uint64_t accum : {1, 4}) {
    for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull}) {
      for (AllocatorMode a : {AllocatorMode::kDefault, AllocatorMode::kExpandable}) {
        Recipe r;
        r.batch = 2;
        r.seq = 512;
        r.grad_accum = accum;
        r.checkpointing = c;
        r.allocator = a;
        const Estimate full = estimate(m, r);
        for (double share : {0.5, 0.9, 0.99, 1.0, 1.01}) {
          EstimateOptions o;
          o.stop_above_reserved_bytes = static_cast<std::uint64_t>(static_cast<double>(full.peak_reserved_bytes) * share);
          const Estimate probe = estimate(m, r, o);
          const bool above = full.peak_reserved_bytes > o.stop_above_reserved_bytes;
          EXPECT_EQ(probe.complete, !above) << share;
          if (probe.complete) {
            EXPECT_EQ(probe.peak_reserved_bytes, full.peak_reserved_bytes);
            EXPECT_EQ(probe.peak_allocated_bytes, full.peak_allocated_bytes);
            EXPECT_EQ(probe.breakdown_at_peak, full.breakdown_at_peak);
          } else {
            EXPECT_GT(probe.peak_reserved_bytes, o.stop_above_reserved_bytes);
            EXPECT_LT(probe.events, full.events);
            ++stopped;
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(stopped, cases / 3);
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// Pipeline recipes of the narrow 4-layer Llama, as the planner probes them (Note [Peeks inside a
// schedule] in src/graph/pipeline.cpp): 1F1B, GPipe and interleaved stages, FSDP2 replicas,
// checkpointed and tensor-parallel stages.
std::vector<Recipe> peek_recipes() {
  std::vector<Recipe> out;
  auto add = [&](auto&& change) {
    Recipe r;
    r.batch = 2;
    r.seq = 128;
    r.grad_accum = 4;
    r.precision = Precision::kFp32;
    r.optimizer = Optimizer::kAdamW;
    r.gpu = "h100-80gb";
    r.pp = 2;
    change(r);
    r.validate();
    out.push_back(r);
  };
  add([](Recipe&) {});
  add([](Recipe& r) { r.pp_schedule = PipelineSchedule::kGPipe; });
  add([](Recipe& r) { r.checkpointing = Checkpointing::kFull; });
  add([](Recipe& r) {
    r.checkpointing = Checkpointing::kFull;
    r.allocator = AllocatorMode::kExpandable;
  });
  add([](Recipe& r) {  // activations, not states, make the peak
    r.checkpointing = Checkpointing::kFull;
    r.pp_schedule = PipelineSchedule::kGPipe;
    r.batch = 4;
    r.seq = 2048;
  });
  add([](Recipe& r) {
    r.pp_schedule = PipelineSchedule::kInterleaved1F1B;
    r.pp_stages_per_rank = 2;
  });
  add([](Recipe& r) {
    r.gpus = 2;
    r.parallel = Parallel::kFsdp;
    r.precision = Precision::kBf16Mixed;
  });
  add([](Recipe& r) {  // several stages per rank, each its own FSDP2 root
    r.pp_schedule = PipelineSchedule::kInterleaved1F1B;
    r.pp_stages_per_rank = 2;
    r.gpus = 2;
    r.parallel = Parallel::kFsdp;
  });
  add([](Recipe& r) {
    r.pp_schedule = PipelineSchedule::kLoopedBFS;
    r.pp_stages_per_rank = 2;
    r.gpus = 2;
    r.parallel = Parallel::kDdp;
    r.checkpointing = Checkpointing::kFull;
  });
  add([](Recipe& r) {
    r.tp = 2;
    r.precision = Precision::kBf16True;
    r.checkpointing = Checkpointing::kFull;
  });
  return out;
}

// A probe of a pipeline stage stops between the schedule's actions, and answers exactly what the
// whole step's replay answers: stopped exactly when its peak reserved bytes pass the limit, and
// otherwise every peak and the breakdown at the peak, also where a checkpointed recompute changed
// a category after a peek read it (the replay is then run again without peeks).
TEST(Replay, PipelineProbesAnswerAsTheWholeStep) {
  const Model m = testing::llama_w512();
  std::size_t stopped = 0, complete = 0;
  for (const Recipe& r : peek_recipes()) {
    for (std::uint64_t stage = 0; stage < r.pp; ++stage) {
      EstimateOptions whole;
      whole.rank = static_cast<std::int64_t>(stage * r.gpus);
      const Estimate full = estimate(m, r, whole);
      for (double share : {0.3, 0.6, 0.9, 0.99, 1.0, 1.01}) {
        EstimateOptions o = whole;
        o.stop_above_reserved_bytes = static_cast<std::uint64_t>(static_cast<double>(full.peak_reserved_bytes) * share);
        const Estimate probe = estimate(m, r, o);
        const std::string what = std::string(to_string(r.pp_schedule)) + " stage " + std::to_string(stage) +
                                 " share " + std::to_string(share);
        EXPECT_EQ(probe.complete, full.peak_reserved_bytes <= o.stop_above_reserved_bytes) << what;
        if (probe.complete) {
          expect_same(probe, full, what);
          ++complete;
        } else {
          EXPECT_GT(probe.peak_reserved_bytes, o.stop_above_reserved_bytes) << what;
          EXPECT_LT(probe.events, full.events) << what;
          ++stopped;
        }
      }
    }
  }
  EXPECT_GT(stopped, 0u);
  EXPECT_GT(complete, 0u);
}

// The builder itself: a kStop between two actions ends the step there, and a checkpointed
// stage's recompute does change a category the replay may have read (the case the rerun is for).
TEST(Replay, PipelinePeeksStopTheBuilderAndMarkLateCategories) {
  const Model m = testing::llama_w512();
  for (const Recipe& r : peek_recipes()) {
    std::size_t peeks = 0;
    const graph::Trace all = graph::build_training_trace(
        m, r, find_gpu(r.gpu),
        [&](const graph::Trace&, std::uint32_t, std::uint32_t micro) {
          peeks += micro == graph::kMidSchedule;
          return graph::MicroBatchNext::kGoOn;
        });
    // Every compute action of both steps: M forwards and M backwards per local stage.
    EXPECT_EQ(peeks, r.steps * 2 * r.grad_accum * r.pp_stages_per_rank) << to_string(r.pp_schedule);
    EXPECT_EQ(all.stale_categories, r.checkpointing == Checkpointing::kFull) << to_string(r.pp_schedule);
    std::size_t calls = 0;
    const graph::Trace cut = graph::build_training_trace(
        m, r, find_gpu(r.gpu), [&](const graph::Trace&, std::uint32_t, std::uint32_t micro) {
          ++calls;
          return micro == graph::kMidSchedule ? graph::MicroBatchNext::kStop : graph::MicroBatchNext::kGoOn;
        });
    EXPECT_EQ(calls, 1u);
    EXPECT_LT(cut.events.size(), all.events.size() / 4);
  }
}

}  // namespace
}  // namespace trainmem

namespace trainmem {
namespace {

// The events a training step makes before its first optimizer step, as (alloc, bytes) pairs with
// storage ids: Note [Optimizer twins] in src/plan/fit.cpp rests on them not depending on which
// torch optimizer the recipe names.
std::vector<std::tuple<bool, graph::TensorId, std::uint64_t>> before_optimizer(const Model& m, const Recipe& r,
                                                                               std::uint64_t rank) {
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu), {}, rank);
  std::vector<std::tuple<bool, graph::TensorId, std::uint64_t>> out;
  for (const graph::Event& e : t.events) {
    if (t.moments[e.moment].phase == Phase::kOptimizer) break;
    out.emplace_back(e.alloc, e.tensor, t.storages[e.tensor].bytes);
  }
  return out;
}

TEST(Replay, StepsBeforeTheOptimizerDoNotDependOnIt) {
  const Model m = testing::llama_w512();
  std::size_t twins = 0, apart = 0;
  for (const char* gpu : {"h100-80gb", "cpu"}) {
    for (int shape = 0; shape < 10; ++shape) {
      Recipe base;
      base.batch = 2;
      base.seq = 128;
      base.grad_accum = 2;
      base.gpu = gpu;
      base.precision = shape % 3 == 0 ? Precision::kBf16Mixed : shape % 3 == 1 ? Precision::kFp32 : Precision::kBf16True;
      if (shape == 1) base.checkpointing = Checkpointing::kFull;
      if (shape == 2) base.parallel = Parallel::kDdp, base.gpus = 2;
      if (shape == 3) base.parallel = Parallel::kFsdp, base.gpus = 2;
      if (shape == 4) base.tp = 2, base.precision = Precision::kBf16True;
      if (shape == 5) base.pp = 2;
      if (shape == 6) base.pp = 2, base.parallel = Parallel::kFsdp, base.gpus = 2;
      if (shape == 7) base.loss = Loss::kFused;
      if (shape == 8) base.precision = Precision::kBf16Master, base.allocator = AllocatorMode::kExpandable;
      if (shape == 9) base.lora.rank = 8, base.lora.targets = resolve_lora_targets(m.arch, {"all-linear"});
      // The first optimizer the recipe takes, and every other one, as the planner pairs them.
      std::vector<std::tuple<bool, graph::TensorId, std::uint64_t>> first;
      bool have = false;
      for (Optimizer o : {Optimizer::kAdamWFused, Optimizer::kAdamW, Optimizer::kSgd, Optimizer::kAdafactor,
                          Optimizer::kAdamW8bit}) {
        Recipe r = base;
        r.optimizer = o;
        try {
          r.validate();
        } catch (const Error&) {
          continue;  // e.g. a pipeline with adafactor
        }
        const auto events = before_optimizer(m, r, 0);
        ASSERT_GT(events.size(), 100u);
        const std::string what = std::string(to_string(o)) + " shape " + std::to_string(shape) + " " + gpu;
        if (!have) {
          ASSERT_TRUE(plan::optimizer_waits_for_its_step(r)) << what;
          first = events;
          have = true;
        } else if (plan::optimizer_waits_for_its_step(r)) {
          EXPECT_TRUE(events == first) << what;
          ++twins;
        } else {
          // Why the planner leaves it out: 8-bit AdamW's maps on the CPU come at construction.
          EXPECT_FALSE(events == first) << what;
          ++apart;
        }
      }
    }
  }
  EXPECT_GT(twins, 40u);
  EXPECT_GT(apart, 5u);
}

// Note [Requested bytes] in src/estimate.cpp: the requests of the live tensors, rounded to 512 B,
// never pass the allocated bytes of the replay, rank by rank, whatever the recipe and allocator;
// and the stop limit stops the graph stage once they pass it.
TEST(Estimate, RequestedBytesBoundTheReplay) {
  const Model llama = testing::llama_w512();
  const Model gpt2 = testing::gpt2_l2();
  std::vector<std::pair<std::string, Recipe>> cases;
  auto add = [&](std::string what, Recipe r) {
    r.validate();
    cases.emplace_back(std::move(what), r);
  };
  Recipe base;
  base.batch = 2;
  base.seq = 64;
  base.gpu = "cpu";
  add("plain", base);
  Recipe r = base;
  r.checkpointing = Checkpointing::kFull;
  r.allocator = AllocatorMode::kExpandable;
  r.grad_accum = 2;
  add("checkpointed, expandable, accumulation", r);
  r = base;
  r.gpu = "h100-80gb";
  r.precision = Precision::kBf16True;
  r.optimizer = Optimizer::kAdafactor;
  add("h100, bf16-true, adafactor", r);
  r = base;
  r.lora.rank = 8;
  r.lora.targets = {"default"};
  r.quant.load_in_4bit = true;
  r.quant.quant_type = QuantType::kNf4;
  r.load_dtype = LoadDtype::kBf16;
  add("qlora", r);
  for (Parallel p : {Parallel::kDdp, Parallel::kFsdp, Parallel::kZero2, Parallel::kZero3}) {
    r = testing::dp_recipe(p, 2, p == Parallel::kZero2 || p == Parallel::kZero3 ? Precision::kBf16Master : Precision::kFp32);
    add(std::string(to_string(p)), r);
  }
  r = base;
  r.precision = Precision::kBf16True;
  r.tp = 2;
  r.sequence_parallel = true;
  add("tp 2 sp", r);
  r = base;
  r.pp = 2;
  r.grad_accum = 3;
  add("pp 2", r);
  r = base;
  r.gpu = "h100-80gb";  // the ring needs a CUDA GPU
  r.precision = Precision::kFp32;
  r.cp = 2;
  r.gpus = 2;
  r.parallel = Parallel::kFsdp;
  add("cp 2", r);
  for (const auto& [what, recipe] : cases) {
    for (const Model* m : {&llama, &gpt2}) {
      if (m == &gpt2 && (recipe.tp > 1 || recipe.pp > 1 || recipe.cp > 1)) continue;  // GPT-2 is not modelled there
      const std::string name = what + " " + m->name;
      for (std::uint64_t rank : detail::replayed_ranks(recipe)) {
        EstimateOptions opt;
        opt.rank = static_cast<std::int64_t>(rank);
        const Estimate e = estimate(*m, recipe, opt);
        const std::uint64_t requested = detail::peak_requested_bytes(*m, recipe, rank);
        EXPECT_LE(requested, e.peak_allocated_bytes) << name << " rank " << rank;
        EXPECT_GT(requested, e.peak_allocated_bytes / 2) << name << " rank " << rank;  // not a loose bound
        EXPECT_EQ(detail::peak_requested_bytes(*m, recipe, rank, requested), requested) << name;
        const std::uint64_t stopped = detail::peak_requested_bytes(*m, recipe, rank, requested / 2);
        EXPECT_GT(stopped, requested / 2) << name;
        EXPECT_LE(stopped, requested) << name;
      }
    }
  }
}

}  // namespace
}  // namespace trainmem
