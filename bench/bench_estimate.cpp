// Google Benchmark suite for trainmem::estimate (method and numbers: bench/README.md).
//
//   BM_Estimate/<model>     one estimate through the public API (seq 4096; gpt2 at its 1024)
//   BM_BuildTrace/<model>   the graph stage alone: the op-by-op event trace of the step
//   BM_Replay/<model>       the simulate stage alone: that trace through the allocator model
//   BM_CutModels/<model>    the replays a depth extrapolation would need (2, 3 and 4 layers);
//                           see Note [Estimates are not extrapolated over layers]
//   BM_Sweep/llama-3.1-8b   1,000 recipes: batch × seq × precision × checkpointing × attention
//   BM_Fit/<case>           trainmem fit: the recipe space timed, ordered, ruled out or replayed
//   BM_FitReference/<case>  the same search without Note [Fewer replays], one estimate() per recipe on
//                           one thread (plan::fit_reference)
//   BM_GradAccum/<n>        one llama-3.1-8b estimate with n micro-batches per step
#include <benchmark/benchmark.h>

#include <array>
#include <string>
#include <vector>

#include "graph/step.h"
#include "model/model.h"
#include "plan/plan.h"
#include "sim/simulator.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

struct Case {
  const char* model;
  std::uint64_t seq;
};
// GPT-2 has 1,024 positions; the others run at 4,096 tokens.
constexpr std::array kCases{Case{"gpt2", 1024}, Case{"llama-3.1-8b", 4096}, Case{"llama-3.1-70b", 4096}};

Recipe recipe_for(const Case& c) {
  Recipe r;  // batch 1, bf16-mixed, AdamW, sdpa, no checkpointing, h100-80gb, default allocator
  r.seq = c.seq;
  return r;
}

void per_event_counters(benchmark::State& state, std::uint64_t events) {
  state.counters["events"] = static_cast<double>(events);
  // CPU time per event, printed with its unit ("110ns").
  state.counters["per_event"] = benchmark::Counter(
      static_cast<double>(events), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_Estimate(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const Model m = load_model(c.model);
  const Recipe r = recipe_for(c);
  std::uint64_t events = 0;
  for (auto _ : state) {
    Estimate e = estimate(m, r);
    events = e.events;
    benchmark::DoNotOptimize(e.peak_reserved_bytes);
  }
  state.SetLabel(c.model);
  per_event_counters(state, events);
}

void BM_BuildTrace(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const Model m = load_model(c.model);
  const Recipe r = recipe_for(c);
  const Gpu& gpu = find_gpu(r.gpu);
  std::uint64_t events = 0;
  for (auto _ : state) {
    graph::Trace t = graph::build_training_trace(m, r, gpu);
    events = t.events.size();
    benchmark::DoNotOptimize(t.events.data());
  }
  state.SetLabel(c.model);
  per_event_counters(state, events);
}

void BM_Replay(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const Model m = load_model(c.model);
  const Recipe r = recipe_for(c);
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu));
  for (auto _ : state) {
    Estimate e = sim::simulate(t, r, {});
    benchmark::DoNotOptimize(e.peak_reserved_bytes);
  }
  state.SetLabel(c.model);
  per_event_counters(state, t.events.size());
}

void BM_CutModels(benchmark::State& state) {
  const Case& c = kCases[state.range(0)];
  const Model m = load_model(c.model);
  const Recipe r = recipe_for(c);
  const std::array cut{model::with_layers(m, 2), model::with_layers(m, 3), model::with_layers(m, 4)};
  std::uint64_t events = 0;
  for (auto _ : state) {
    events = 0;
    for (const Model& k : cut) {
      Estimate e = estimate(k, r);
      events += e.events;
      benchmark::DoNotOptimize(e.peak_reserved_bytes);
    }
  }
  state.SetLabel(c.model);
  per_event_counters(state, events);
}

// 10 batch sizes × 5 sequence lengths × 5 precisions × 2 checkpointing × 2 attention = 1,000.
std::vector<Recipe> sweep_recipes() {
  std::vector<Recipe> out;
  for (std::uint64_t batch : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32}) {
    for (std::uint64_t seq : {256, 512, 1024, 2048, 4096}) {
      for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kFp16Mixed, Precision::kBf16Master,
                          Precision::kBf16True}) {
        for (Checkpointing ck : {Checkpointing::kNone, Checkpointing::kFull}) {
          for (Attention a : {Attention::kEager, Attention::kSdpa}) {
            Recipe r;
            r.batch = batch;
            r.seq = seq;
            r.precision = p;
            r.checkpointing = ck;
            r.attention = a;
            out.push_back(r);
          }
        }
      }
    }
  }
  return out;
}

void BM_Sweep(benchmark::State& state) {
  const Model m = load_model("llama-3.1-8b");
  const std::vector<Recipe> recipes = sweep_recipes();
  for (auto _ : state) {
    for (const Recipe& r : recipes) {
      Estimate e = estimate(m, r);
      benchmark::DoNotOptimize(e.peak_reserved_bytes);
    }
  }
  state.SetLabel("llama-3.1-8b, " + std::to_string(recipes.size()) + " recipes");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * recipes.size()));
  state.counters["per_estimate"] = benchmark::Counter(
      static_cast<double>(recipes.size()), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

struct FitCase {
  const char* model;
  const char* gpu;
  std::uint64_t seq, global_batch, gpus;
};
constexpr std::array kFitCases{FitCase{"llama-3.1-8b", "h100-80gb", 4096, 64, 1},
                               FitCase{"qwen3-4b", "a100-40gb", 2048, 32, 1},
                               FitCase{"llama-3.1-70b", "rtx-4090", 4096, 1, 1},
                               FitCase{"llama-3.1-8b", "h100-80gb", 4096, 64, 8},
                               FitCase{"qwen3-4b", "t4-16gb", 4096, 8, 1},
                               // issue #4's multi-GPU case: 8 of its 10 plans are pipelines
                               FitCase{"llama-3.1-8b", "h100-80gb", 4096, 64, 4},
                               // the heaviest search measured: pipelines x tensor parallelism with
                               // checkpointing, 64 micro-batches each (bench/README.md)
                               FitCase{"llama-3.1-70b", "h100-80gb", 4096, 64, 8}};

void fit_case(benchmark::State& state, FitResult (*search)(const Model&, const FitRequest&)) {
  const FitCase& c = kFitCases[state.range(0)];
  const Model m = load_model(c.model);
  FitRequest q;
  q.base.gpu = c.gpu;
  q.base.seq = c.seq;
  if (!find_gpu(c.gpu).bf16) q.base.precision = Precision::kFp16Mixed;
  q.global_batch = c.global_batch;
  q.gpus = c.gpus;
  FitResult f;
  for (auto _ : state) {
    f = search(m, q);
    benchmark::DoNotOptimize(f.plans.data());
  }
  state.SetLabel(std::string(c.model) + " on " + c.gpu + " x" + std::to_string(c.gpus) + ": " + std::to_string(f.searched) + " searched, " +
                 std::to_string(f.simulated) + " replayed, " + std::to_string(f.pruned) + " ruled out");
  state.counters["searched"] = static_cast<double>(f.searched);
  state.counters["replayed"] = static_cast<double>(f.simulated);
}

void BM_Fit(benchmark::State& state) { fit_case(state, fit); }
void BM_FitReference(benchmark::State& state) { fit_case(state, plan::fit_reference); }

void BM_GradAccum(benchmark::State& state) {
  const Model m = load_model("llama-3.1-8b");
  Recipe r = recipe_for(kCases[1]);
  r.grad_accum = static_cast<std::uint64_t>(state.range(0));
  std::uint64_t events = 0;
  for (auto _ : state) {
    Estimate e = estimate(m, r);
    events = e.events;
    benchmark::DoNotOptimize(e.peak_reserved_bytes);
  }
  state.counters["events"] = static_cast<double>(events);
}

void each_model(benchmark::internal::Benchmark* b) {
  b->ArgName("model")->DenseRange(0, kCases.size() - 1)->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Estimate)->Apply(each_model);
BENCHMARK(BM_BuildTrace)->Apply(each_model);
BENCHMARK(BM_Replay)->Apply(each_model);
BENCHMARK(BM_CutModels)->Apply(each_model);
BENCHMARK(BM_Sweep)->Iterations(1)->Repetitions(3)->ReportAggregatesOnly(true)->Unit(benchmark::kSecond);
BENCHMARK(BM_Fit)->ArgName("case")->DenseRange(0, kFitCases.size() - 1)->Unit(benchmark::kMillisecond)->UseRealTime()->MeasureProcessCPUTime();
// Not case 6: one estimate() after another over its 8,744 recipes would take minutes.
BENCHMARK(BM_FitReference)->ArgName("case")->DenseRange(0, kFitCases.size() - 2)->Unit(benchmark::kMillisecond)->UseRealTime()->MeasureProcessCPUTime();
BENCHMARK(BM_GradAccum)->ArgName("grad_accum")->Arg(1)->Arg(2)->Arg(4)->Arg(64)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace trainmem

BENCHMARK_MAIN();
