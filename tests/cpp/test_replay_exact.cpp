// The replay's fast loop (sim::Replay::State::consume, Note [Step peaks between steps] in
// src/sim/simulator.cpp) against the plain one it replaced: every event through the allocator
// model, the breakdown copied at every new peak, every event's step looked up for the step peaks.
// Same traces, every field compared, over many models and recipes, with and without a stop limit.

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "graph/step.h"
#include "model/model.h"
#include "sim/caching_allocator.h"
#include "sim/simulator.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

struct Plain {
  std::uint64_t peak_allocated_bytes = 0, peak_reserved_bytes = 0;
  Breakdown at_peak{};
  std::uint32_t peak_moment = 0;
  std::vector<StepPeak> steps;
  std::uint64_t events = 0;
  bool complete = true;
};

// The replay loop as it was written before the fast loop, event by event.
Plain plain_replay(const graph::Trace& t, const Recipe& r, std::uint64_t stop_above) {
  sim::AllocatorConfig cfg;
  cfg.expandable_segments = r.allocator == AllocatorMode::kExpandable;
  sim::CachingAllocator alloc(cfg);
  std::vector<sim::CachingAllocator::BlockId> block(t.storages.size(), UINT32_MAX);
  std::vector<Category> cat(t.storages.size());
  Breakdown live{};
  Plain p;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const graph::Event& e = t.events[i];
    const graph::Storage& s = t.storages[e.tensor];
    bool stop = false;
    if (e.alloc) {
      block[e.tensor] = alloc.allocate(s.bytes);
      cat[e.tensor] = s.category;
      live[static_cast<std::size_t>(s.category)] += alloc.block_bytes(block[e.tensor]);
      if (alloc.allocated_bytes() > p.peak_allocated_bytes) {
        p.peak_allocated_bytes = alloc.allocated_bytes();
        p.at_peak = live;
        p.peak_moment = e.moment;
      }
      stop = stop_above && alloc.reserved_bytes() > stop_above;
    } else {
      live[static_cast<std::size_t>(cat[e.tensor])] -= alloc.block_bytes(block[e.tensor]);
      alloc.release(block[e.tensor]);
    }
    const std::uint32_t step = t.moments[e.moment].step;
    if (step > 0) {
      if (p.steps.size() < step) p.steps.resize(step);
      StepPeak& sp = p.steps[step - 1];
      sp.step = step;
      sp.peak_allocated_bytes = std::max(sp.peak_allocated_bytes, alloc.allocated_bytes());
      sp.peak_reserved_bytes = std::max(sp.peak_reserved_bytes, alloc.reserved_bytes());
    }
    p.events = i + 1;
    if (stop) {
      p.complete = false;
      break;
    }
  }
  p.peak_reserved_bytes = alloc.peak_reserved_bytes();
  return p;
}

std::string moment_op(const graph::MomentTag& m) {
  std::string op = m.recompute ? "recompute " + std::string(m.op) : std::string(m.op);
  return m.layer >= 0 ? "layer " + std::to_string(m.layer) + " " + op : op;
}

void expect_same(const Estimate& fast, const Plain& plain, const graph::Trace& t, const std::string& what) {
  EXPECT_EQ(fast.peak_allocated_bytes, plain.peak_allocated_bytes) << what;
  EXPECT_EQ(fast.peak_reserved_bytes, plain.peak_reserved_bytes) << what;
  EXPECT_EQ(fast.breakdown_at_peak, plain.at_peak) << what;
  const graph::MomentTag& m = t.moments[plain.peak_moment];
  EXPECT_EQ(fast.peak.step, m.step) << what;
  EXPECT_EQ(fast.peak.micro_batch, m.micro) << what;
  EXPECT_EQ(fast.peak.phase, m.recompute ? Phase::kBackward : m.phase) << what;
  EXPECT_EQ(fast.peak.op, moment_op(m)) << what;
  EXPECT_EQ(fast.events, plain.events) << what;
  EXPECT_EQ(fast.complete, plain.complete) << what;
  ASSERT_EQ(fast.steps.size(), plain.steps.size()) << what;
  for (std::size_t i = 0; i < plain.steps.size(); ++i) {
    EXPECT_EQ(fast.steps[i].step, plain.steps[i].step) << what << " step " << i + 1;
    EXPECT_EQ(fast.steps[i].peak_allocated_bytes, plain.steps[i].peak_allocated_bytes) << what << " step " << i + 1;
    EXPECT_EQ(fast.steps[i].peak_reserved_bytes, plain.steps[i].peak_reserved_bytes) << what << " step " << i + 1;
  }
}

TEST(ReplayExact, FastLoopEqualsThePlainReplayInEveryField) {
  std::size_t cases = 0, stopped = 0, multi_step = 0, zero = 0;
  std::size_t k = 0;
  for (const char* name : {"gpt2", "qwen3-0.6b", "gemma-2-2b", "phi-3-mini-4k-instruct", "llama-3.2-1b"}) {
    const Model m = model::with_layers(load_model(name), 3);
    for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kFp16Mixed, Precision::kBf16True}) {
      for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdamW8bit, Optimizer::kAdafactor, Optimizer::kSgd}) {
        for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull}) {
          for (AllocatorMode a : {AllocatorMode::kDefault, AllocatorMode::kExpandable}) {
            ++k;
            Recipe r;
            r.precision = p;
            r.optimizer = o;
            r.checkpointing = c;
            r.allocator = a;
            r.attention = k % 3 == 0 ? Attention::kEager : Attention::kSdpa;
            r.loss = k % 4 == 1 ? Loss::kFused : Loss::kStandard;
            r.batch = 1 + k % 3;
            r.seq = 64u << (k % 5);
            r.grad_accum = k % 5 == 2 ? 3 : 1;
            r.steps = k % 7 == 3 ? 3 : 2;
            r.gpu = k % 2 ? "cpu" : "h100-80gb";
            if (k % 6 == 5) {
              r.lora.rank = 8;
              r.lora.targets = resolve_lora_targets(m.arch, {"all-linear"});  // as estimate() resolves them
            }
            if (k % 11 == 4 && !r.lora.enabled()) {
              r.gpus = 2;
              r.parallel = Parallel::kDdp;
            }
            if (k % 9 == 2 && !r.lora.enabled() && p == Precision::kFp32 && (o == Optimizer::kAdamW || o == Optimizer::kSgd)) {
              r.gpus = 2;
              r.parallel = Parallel::kZero2;  // ranks differ: rank 1 is built below
            }
            r.validate();
            const std::string what = std::string(name) + " " + std::string(to_string(p)) + " " +
                                     std::string(to_string(o)) + " " + std::string(to_string(c)) + " " +
                                     std::string(to_string(a)) + " case " + std::to_string(k);
            const graph::Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu), {}, r.gpus - 1);
            const Plain plain = plain_replay(t, r, 0);
            expect_same(sim::simulate(t, r, {}), plain, t, what);
            multi_step += plain.steps.size() > 1;
            // A probe stops at the allocation that passes its limit (Note [Stopping early]).
            EstimateOptions probe;
            probe.stop_above_reserved_bytes = plain.peak_reserved_bytes / 2;
            const Plain plain_stop = plain_replay(t, r, probe.stop_above_reserved_bytes);
            expect_same(sim::simulate(t, r, probe), plain_stop, t, what + " stop");
            stopped += !plain_stop.complete;
            zero += r.parallel == Parallel::kZero2;
            ++cases;
          }
        }
      }
    }
  }
  // The comparisons must cover steps after the first and stopped probes, or they check less.
  EXPECT_EQ(multi_step, cases);
  EXPECT_GT(stopped, cases / 2);
  EXPECT_GT(zero, 0u);
}

}  // namespace
}  // namespace trainmem
