#include "sim/simulator.h"

#include <cstdio>
#include <memory>
#include <string>

#include "common/checked.h"
#include "sim/caching_allocator.h"

namespace trainmem::sim {
namespace {

Moment to_moment(const graph::MomentTag& m) {
  Moment out;
  out.step = m.step;
  out.micro_batch = m.micro;
  // A checkpointed layer's forward re-run happens inside backward: phase backward, op named
  // "layer N recompute <op>".
  out.phase = m.recompute ? Phase::kBackward : m.phase;
  std::string op = m.recompute ? "recompute " + std::string(m.op) : std::string(m.op);
  if (m.layer >= 0) out.op = "layer " + std::to_string(m.layer) + " " + op;
  else out.op = op;
  return out;
}

}  // namespace

Estimate simulate(const graph::Trace& trace, const Recipe& recipe, const EstimateOptions& options) {
  AllocatorConfig cfg;
  cfg.expandable_segments = recipe.allocator == AllocatorMode::kExpandable;
  CachingAllocator alloc(cfg);

  std::vector<CachingAllocator::BlockId> block(trace.storages.size(), UINT32_MAX);
  Breakdown live{};
  Breakdown at_peak{};
  std::uint32_t peak_moment = 0;
  std::uint64_t peak = 0;
  Estimate est;
  est.recipe = recipe;

  const std::uint64_t stride =
      options.timeline ? std::max<std::uint64_t>(1, trace.events.size() / std::max<std::uint64_t>(1, options.timeline_points)) : 0;

  std::unique_ptr<std::FILE, int (*)(std::FILE*)> out(nullptr, &std::fclose);
  if (!options.trace_path.empty()) {
    out.reset(std::fopen(options.trace_path.c_str(), "w"));
    if (!out) throw Error("trace: cannot write '" + options.trace_path + "'");
  }

  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const graph::Event& e = trace.events[i];
    const graph::Storage& s = trace.storages[e.tensor];
    const auto cat = static_cast<std::size_t>(s.category);
    if (out) {
      const graph::MomentTag& m = trace.moments[e.moment];
      Moment mo = to_moment(m);
      std::fprintf(out.get(),
                   "{\"i\":%zu,\"event\":\"%s\",\"sid\":%u,\"nbytes\":%llu,\"category\":\"%s\","
                   "\"phase\":\"%s\",\"step\":%u,\"micro_batch\":%u,\"op\":\"%s\"}\n",
                   i, e.alloc ? "alloc" : "free", e.tensor, static_cast<unsigned long long>(s.bytes),
                   std::string(category_name(s.category)).c_str(), std::string(phase_name(mo.phase)).c_str(),
                   m.step, m.micro, mo.op.c_str());
    }
    if (e.alloc) {
      auto id = alloc.allocate(s.bytes);
      block[e.tensor] = id;
      live[cat] += alloc.block_bytes(id);
      if (alloc.allocated_bytes() > peak) {
        peak = alloc.allocated_bytes();
        at_peak = live;
        peak_moment = e.moment;
      }
    } else {
      auto id = block[e.tensor];
      TRAINMEM_ASSERT(id != UINT32_MAX, "free of a storage never allocated");
      live[cat] -= alloc.block_bytes(id);
      alloc.release(id);
    }
    const graph::MomentTag& m = trace.moments[e.moment];
    if (m.step > 0) {
      if (est.steps.size() < m.step) est.steps.resize(m.step);
      StepPeak& sp = est.steps[m.step - 1];
      sp.step = m.step;
      sp.peak_allocated_bytes = std::max(sp.peak_allocated_bytes, alloc.allocated_bytes());
      sp.peak_reserved_bytes = std::max(sp.peak_reserved_bytes, alloc.reserved_bytes());
    }
    if (stride && (i % stride == 0 || i + 1 == trace.events.size())) {
      est.timeline.push_back({i, alloc.allocated_bytes(), alloc.reserved_bytes(), to_moment(m)});
    }
  }
  est.peak_allocated_bytes = alloc.peak_allocated_bytes();
  est.peak_reserved_bytes = alloc.peak_reserved_bytes();
  est.breakdown_at_peak = at_peak;
  est.peak = to_moment(trace.moments[peak_moment]);
  est.events = trace.events.size();
  std::uint64_t sum = 0;
  for (auto b : at_peak) sum += b;
  TRAINMEM_ASSERT(sum == est.peak_allocated_bytes, "breakdown does not sum to the peak");
  return est;
}

}  // namespace trainmem::sim
