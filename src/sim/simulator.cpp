#include "sim/simulator.h"

#include <string>

#include "common/checked.h"
#include "sim/caching_allocator.h"

namespace trainmem::sim {
namespace {

Moment to_moment(const graph::MomentTag& m) {
  Moment out;
  out.step = m.step;
  out.micro_batch = m.micro;
  out.phase = m.phase;
  if (m.layer >= 0) out.op = "layer " + std::to_string(m.layer) + " " + std::string(m.op);
  else out.op = std::string(m.op);
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

  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const graph::Event& e = trace.events[i];
    const graph::Storage& s = trace.storages[e.tensor];
    const auto cat = static_cast<std::size_t>(s.category);
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
