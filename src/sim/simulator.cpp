#include "sim/simulator.h"

#include <cstdio>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/checked.h"
#include "sim/caching_allocator.h"

namespace trainmem::sim {
namespace {

// A checkpointed layer's forward re-run happens inside backward: its phase is backward (and its
// op is named "layer N recompute <op>", to_moment).
Phase reported_phase(const graph::MomentTag& m) { return m.recompute ? Phase::kBackward : m.phase; }

Moment to_moment(const graph::MomentTag& m) {
  Moment out;
  out.step = m.step;
  out.micro_batch = m.micro;
  out.phase = reported_phase(m);
  std::string op = m.recompute ? "recompute " + std::string(m.op) : std::string(m.op);
  if (m.layer >= 0) out.op = "layer " + std::to_string(m.layer) + " " + op;
  else out.op = op;
  return out;
}

AllocatorConfig config_for(const Recipe& r) {
  AllocatorConfig cfg;
  cfg.expandable_segments = r.allocator == AllocatorMode::kExpandable;
  return cfg;
}

bool same_place(const graph::MomentTag& a, const graph::MomentTag& b) {
  return a.step == b.step && a.phase == b.phase && a.layer == b.layer && a.op == b.op && a.recompute == b.recompute;
}

}  // namespace

// Note [Repeated micro-batches]
// With gradient accumulation every micro-batch after the first runs the same ops on the same
// persistent tensors (parameters, .grad buffers, workspaces); only its transient tensors are
// new. The replay is a deterministic function of the allocator state and the event sequence,
// and the state is decided by the ranges of its segments (addresses, sizes, which tensor holds
// each one) and the next free device address. So when micro-batch m
//   (a) produced the same events as micro-batch m-1 (same sizes, categories, ops; persistent
//       tensors the same, transient ones renamed by one constant offset), and
//   (b) left the allocator exactly as m-1 left it,
// then micro-batch m+1 produces the same events from the same state again, and so on: each later
// micro-batch reaches the same peaks at the same moments (the first occurrence is the one
// reported) and leaves the same state. Skipping them changes no output but `events` (the events
// replayed). A timeline or an event trace asks for every event, so then nothing is skipped.
struct Replay::State {
  State() = default;
  // Back to a fresh replay, keeping every buffer's capacity (Note [Pooled replay state]).
  void start(const Recipe& r, const EstimateOptions& o) {
    alloc.reset(config_for(r));
    recipe = r;
    options = o;
    block.clear();
    cat_of.clear();
    owner.clear();
    live = {};
    at_peak = {};
    peak_moment = 0;
    peak = 0;
    next = 0;
    est = Estimate{};
    phase_index.clear();
    phase_at = 0;
    out.reset();
    stride = 0;
    stop_above = 0;
    peeks = true;
    peeked = false;
    optimizer_seen = false;
    stopped = false;
    prev.layout.clear();
    prev = Mark{};
    cur = Mark{};
    micro_events_begin = micro_storages_begin = 0;
    track_owners = r.grad_accum > 1;
    last_moment = UINT32_MAX;
    cur_step = UINT32_MAX;
    peak_allocated_all = peak_reserved_all = 0;
  }

  CachingAllocator alloc;
  Recipe recipe;
  EstimateOptions options;
  std::vector<CachingAllocator::BlockId> block;  // by tensor
  std::vector<std::uint8_t> cat_of;              // category charged at allocation, by tensor
  std::vector<std::uint32_t> owner;              // tensor by block id, when track_owners
  // Only the micro-batch fingerprint reads `owner`, and only with more than one micro-batch.
  bool track_owners = false;
  Breakdown live{};
  Breakdown at_peak{};
  std::uint32_t peak_moment = 0;
  std::uint64_t peak = 0;
  std::size_t next = 0;  // first event not replayed yet
  Estimate est;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> out{nullptr, &std::fclose};
  std::uint64_t stride = 0;
  std::uint64_t stop_above = 0;  // options.stop_above_reserved_bytes
  bool stopped = false;
  bool optimizer_seen = false;  // an event of an optimizer step was replayed
  bool peeks = true;    // mid-schedule peeks are taken (Note [Peeks inside a schedule])
  bool peeked = false;  // one was

  // Micro-batch boundaries of the current step.
  struct Mark {
    std::uint32_t step = 0;
    std::size_t events_begin = 0, events_end = 0;
    std::size_t storages_begin = 0;
    std::vector<std::uint64_t> layout;
  };
  Mark prev, cur;
  std::size_t micro_events_begin = 0, micro_storages_begin = 0;
  std::vector<CachingAllocator::RangeView> ranges;

  // The moment and step of the last event replayed (Note [Step peaks between steps]), and the
  // replay's peaks before the allocator's were last reset.
  std::uint32_t last_moment = UINT32_MAX;
  std::uint32_t cur_step = UINT32_MAX;
  std::uint64_t peak_allocated_all = 0, peak_reserved_all = 0;

  void consume(const graph::Trace& trace, std::size_t end_hint);
  template <bool kWatch>  // a trace file, a timeline or phase peaks are written
  void consume_events(const graph::Trace& trace, std::size_t end_hint);
  // Estimate::phases: the entry of each (step, micro-batch, phase) key, and the current one.
  std::unordered_map<std::uint64_t, std::size_t> phase_index;
  std::size_t phase_at = 0;
  void watch_phase(const graph::MomentTag& m, bool moved);
  void close_step();
  std::vector<std::uint64_t> fingerprint();
  bool same_events(const graph::Trace& t) const;
};

void Replay::State::consume(const graph::Trace& trace, std::size_t total_hint) {
  if (block.size() < trace.storages.size()) {
    block.resize(trace.storages.size(), UINT32_MAX);
    cat_of.resize(trace.storages.size(), 0);
  }
  if (out || stride || options.phases) {
    consume_events<true>(trace, total_hint);
  } else {
    consume_events<false>(trace, total_hint);
  }
}

// Note [Step peaks between steps]
// A step's peaks are the highest allocated and reserved bytes seen after any of its events. Only
// an allocation can raise either: a release lowers allocated bytes and leaves reserved bytes as
// they are (segments go back only through empty_cache, which is no event). So they are the
// allocator's own high-water marks (which every allocation keeps anyway) taken from the state
// after the step's first event: the replay resets the allocator's peaks after that event
// (reset_peak_stats: the peaks drop to the current state) and reads them when the step ends or
// the replay does (close_step), folding them into its own peaks for the whole replay. The step
// of an event is only looked up when its moment differs from the previous event's. (Until
// 2026-12-03 the loop took a step's peaks itself, after the first event and every allocation.)
void Replay::State::close_step() {
  peak_allocated_all = std::max(peak_allocated_all, alloc.peak_allocated_bytes());
  peak_reserved_all = std::max(peak_reserved_all, alloc.peak_reserved_bytes());
  if (cur_step == 0 || cur_step == UINT32_MAX) return;
  StepPeak& sp = est.steps[cur_step - 1];
  sp.step = cur_step;
  sp.peak_allocated_bytes = std::max(sp.peak_allocated_bytes, alloc.peak_allocated_bytes());
  sp.peak_reserved_bytes = std::max(sp.peak_reserved_bytes, alloc.peak_reserved_bytes());
}

template <bool kWatch>
void Replay::State::consume_events(const graph::Trace& trace, std::size_t total_hint) {
  const graph::Event* const events = trace.events.data();
  const graph::Storage* const storages = trace.storages.data();
  const std::size_t n = trace.events.size();
  for (std::size_t i = next; i < n; ++i) {
    const graph::Event& e = events[i];
    const graph::Storage& s = storages[e.tensor];
    if constexpr (kWatch) {
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
    }
    bool first_of_step = false;
    if (e.moment != last_moment) {
      last_moment = e.moment;
      if (trace.moments[e.moment].phase == Phase::kOptimizer) optimizer_seen = true;
      const std::uint32_t step = trace.moments[e.moment].step;
      if (step != cur_step) {
        close_step();
        cur_step = step;
        first_of_step = true;
        if (step > 0 && est.steps.size() < step) est.steps.resize(step);
      }
    }
    if (e.alloc) {
      const auto cat = static_cast<std::size_t>(s.category);
      // The block's charge is what allocated bytes moved by, the block's size (see Note
      // [Caching allocator replay]); cheaper than a checked block_bytes() per event.
      const std::uint64_t before = alloc.allocated_bytes();
      auto id = alloc.allocate(s.bytes);
      block[e.tensor] = id;
      cat_of[e.tensor] = static_cast<std::uint8_t>(cat);
      if (track_owners) {
        if (owner.size() <= id) owner.resize(static_cast<std::size_t>(id) + 1, UINT32_MAX);
        owner[id] = e.tensor;
      }
      const std::uint64_t allocated = alloc.allocated_bytes();
      live[cat] += allocated - before;
      if (stop_above && alloc.reserved_bytes() > stop_above) stopped = true;
      if (allocated > peak) {
        peak = allocated;
        at_peak = live;
        peak_moment = e.moment;
      }
    } else {
      auto id = block[e.tensor];
      TRAINMEM_ASSERT(id != UINT32_MAX, "free of a storage never allocated");
      if (track_owners) owner[id] = UINT32_MAX;
      const std::uint64_t before = alloc.allocated_bytes();
      alloc.release(id);
      live[cat_of[e.tensor]] -= before - alloc.allocated_bytes();
    }
    if (first_of_step) alloc.reset_peak_stats();  // See Note [Step peaks between steps]
    if constexpr (kWatch) {
      if (options.phases) watch_phase(trace.moments[e.moment], i == next || e.moment != events[i - 1].moment);
      if (stride && (i % stride == 0 || i + 1 == total_hint)) {
        est.timeline.push_back(
            {i, alloc.allocated_bytes(), alloc.reserved_bytes(), to_moment(trace.moments[e.moment])});
      }
    }
    if (stopped) {
      next = i + 1;
      return;
    }
  }
  next = n;
}

void Replay::State::watch_phase(const graph::MomentTag& m, bool moved) {
  if (moved) {
    const Phase phase = reported_phase(m);
    const std::uint64_t key = std::uint64_t{m.step} << 40 | std::uint64_t{m.micro} << 8 | static_cast<std::uint64_t>(phase);
    auto [it, fresh] = phase_index.try_emplace(key, est.phases.size());
    if (fresh) est.phases.push_back({m.step, m.micro, phase, 0, 0});
    phase_at = it->second;
  }
  PhasePeak& p = est.phases[phase_at];
  p.peak_allocated_bytes = std::max(p.peak_allocated_bytes, alloc.allocated_bytes());
  p.peak_reserved_bytes = std::max(p.peak_reserved_bytes, alloc.reserved_bytes());
}

// Note [Stopping early]
// With a stop limit the replay stops at the allocation that takes reserved bytes past it; the
// builder hears it at the next micro-batch boundary and stops too. The peaks are the peaks so
// far: above the limit, which is all the planner needs to know. Reserved bytes pass a limit only
// by an allocation, so "stopped" is exactly "the step's peak reserved bytes exceed the limit".


std::vector<std::uint64_t> Replay::State::fingerprint() {
  alloc.layout(ranges);
  std::vector<std::uint64_t> f;
  f.reserve(ranges.size() * 3 + 1);
  f.push_back(alloc.next_address());
  for (const auto& r : ranges) {
    f.push_back(r.address);
    f.push_back(r.size);
    const std::uint64_t holder = r.allocated ? owner[r.id] : UINT32_MAX;
    f.push_back(holder << 8 | (r.mapped ? 2u : 0u) | (r.allocated ? 1u : 0u) | static_cast<std::uint64_t>(r.stream & 0xf) << 2);
  }
  return f;
}

bool Replay::State::same_events(const graph::Trace& t) const {
  const std::size_t n = prev.events_end - prev.events_begin;
  if (cur.events_end - cur.events_begin != n) return false;
  const std::size_t delta = cur.storages_begin - prev.storages_begin;
  for (std::size_t k = 0; k < n; ++k) {
    const graph::Event& a = t.events[prev.events_begin + k];
    const graph::Event& b = t.events[cur.events_begin + k];
    if (a.alloc != b.alloc) return false;
    const std::size_t want = a.tensor >= prev.storages_begin ? a.tensor + delta : a.tensor;
    if (b.tensor != want) return false;
    const graph::Storage& sa = t.storages[a.tensor];
    const graph::Storage& sb = t.storages[b.tensor];
    if (sa.bytes != sb.bytes || sa.category != sb.category) return false;
    if (!same_place(t.moments[a.moment], t.moments[b.moment])) return false;
  }
  return true;
}

// Note [Pooled replay state]
// An estimate fills an allocator model and a few per-tensor tables with tens of thousands of
// entries; made fresh each time, much of an estimate's time went to the kernel handing out
// zeroed pages. Each thread keeps the states of finished replays and the next replay takes one
// back (reset, capacity kept), which matters for the planner's hundreds of replays. Nothing
// of a previous replay survives start(): the state is a pure function of what it is fed next.
namespace {
thread_local std::vector<std::unique_ptr<Replay::State>> t_spare_states;
}  // namespace

Replay::Replay(const Recipe& recipe, const EstimateOptions& options) {
  if (t_spare_states.empty()) {
    s_ = std::make_unique<State>();
  } else {
    s_ = std::move(t_spare_states.back());
    t_spare_states.pop_back();
  }
  s_->start(recipe, options);
  s_->est.recipe = recipe;
  s_->stop_above = options.stop_above_reserved_bytes;
  if (!options.trace_path.empty()) {
    s_->out.reset(std::fopen(options.trace_path.c_str(), "w"));
    if (!s_->out) throw Error("trace: cannot write '" + options.trace_path + "'");
  }
}

Replay::~Replay() {
  if (s_ && t_spare_states.size() < 4) {
    s_->out.reset();  // close a trace file now
    t_spare_states.push_back(std::move(s_));
  }
}

graph::MicroBatchNext Replay::micro_batch_done(const graph::Trace& trace, std::uint32_t step, std::uint32_t micro) {
  using graph::MicroBatchNext;
  State& s = *s_;
  if (s.options.timeline || s.out || s.options.phases) return MicroBatchNext::kGoOn;  // every event is wanted
  if (micro == graph::kMidSchedule) {  // See Note [Peeks inside a schedule] in graph/pipeline.cpp
    if (!s.stop_above || !s.peeks) return MicroBatchNext::kGoOn;
    s.peeked = true;
    s.consume(trace, 0);
    return s.stopped ? MicroBatchNext::kStop : MicroBatchNext::kGoOn;
  }
  s.consume(trace, 0);
  if (s.stopped) return MicroBatchNext::kStop;
  if (micro >= s.recipe.grad_accum) return MicroBatchNext::kGoOn;  // the optimizer step is next anyway
  s.prev = std::move(s.cur);
  s.cur = State::Mark{};
  s.cur.step = step;
  // The micro-batch just replayed began where the last boundary (or the step) left off.
  s.cur.events_begin = s.micro_events_begin;
  s.cur.storages_begin = s.micro_storages_begin;
  s.cur.events_end = trace.events.size();
  s.cur.layout = s.fingerprint();
  s.micro_events_begin = trace.events.size();
  s.micro_storages_begin = trace.storages.size();
  const bool repeated = s.prev.step == step && s.prev.layout == s.cur.layout && s.same_events(trace);
  return repeated ? MicroBatchNext::kSkipRest : MicroBatchNext::kGoOn;
}

void Replay::no_peeks() { s_->peeks = false; }
bool Replay::peeked() const { return s_->peeked; }

Estimate Replay::finish(const graph::Trace& trace) {
  State& s = *s_;
  s.stride = s.options.timeline
                 ? std::max<std::uint64_t>(1, trace.events.size() / std::max<std::uint64_t>(1, s.options.timeline_points))
                 : 0;
  if (!s.stopped) s.consume(trace, trace.events.size());
  s.close_step();
  if (s.out) {  // a full disk or a device that takes no writes fails here, not silently
    const bool failed = std::ferror(s.out.get()) != 0 || std::fflush(s.out.get()) != 0;
    const bool closed = std::fclose(s.out.release()) == 0;
    if (failed || !closed) throw Error("trace: writing '" + s.options.trace_path + "' failed");
  }
  Estimate est = std::move(s.est);
  est.complete = !s.stopped;
  est.stopped_before_optimizer = s.stopped && !s.optimizer_seen;
  est.peak_allocated_bytes = s.peak_allocated_all;
  est.peak_reserved_bytes = s.peak_reserved_all;
  est.breakdown_at_peak = s.at_peak;
  est.peak = to_moment(trace.moments[s.peak_moment]);
  est.events = s.next;
  std::uint64_t sum = 0;
  for (auto b : s.at_peak) sum += b;
  TRAINMEM_ASSERT(sum == est.peak_allocated_bytes, "breakdown does not sum to the peak");
  return est;
}

Estimate simulate(const graph::Trace& trace, const Recipe& recipe, const EstimateOptions& options) {
  Replay r(recipe, options);
  return r.finish(trace);
}

}  // namespace trainmem::sim
