// Does the allocator state repeat from one decoder layer to the next? The question behind an
// exact skip of repeated layers (bench/README.md, "Where the time goes").
//
// For each model and recipe it builds the step's trace, replays it through the allocator model
// and, at every boundary between two layers of a pass (a forward, or a backward), takes the
// part of the allocator state that the next layer can touch and compares it with the same part
// at the previous boundary:
//   * a range is frozen when its tensor is not freed before the next boundary (the study looks
//     ahead in the trace, so this is the most generous choice a proof could make);
//   * a segment with no free range and only frozen ranges is left out (nothing in the next
//     layer can reach it); in the others a run of frozen ranges becomes one wall;
//   * tensors are named relative to the layer: allocated in the previous layer of the pass
//     (offset from its first tensor), allocated by this layer's forward (backward only; offset
//     from that forward's first tensor), or by absolute id (parameters, the batch, ...).
// Each boundary is "equal" (a proof by state equality, as Note [Repeated micro-batches] does
// for micro-batches, would hold), "periodic" (not equal to the previous boundary's form but to
// one 2 to 8 layers back: a proof over a group of layers would hold), "sizes" (equal once the sizes of free ranges are ignored:
// the same ranges, but the free tails of shared segments shrink as they fill), "free" (equal
// once free ranges are ignored altogether: the live tensors repeat, but free blocks are taken
// or left behind layer by layer) or "other" (the live tensors the layer can reach differ).
//
// The same classification is also made for each pool alone (the small pool's segments hold
// requests up to 1 MiB, the large pool's the rest, and no block ever moves between them): a
// skip that proved one pool's part of the state would still replay the other pool's events.
//
// Recipes: 3 precisions x AdamW, Adafactor x checkpointing none/full x eager/SDPA x
// default/expandable allocator x h100-80gb/cpu (96), batch 1.
//
//   trainmem_layer_study [seq] [model ...]   (default: 1024; llama-3.1-8b qwen3-4b gemma-2-2b gpt2)
// prints one Markdown table row per model and pass:
//   | model | seq | pass | pools | boundaries | equal | periodic | sizes | free | other |
// (pools: "both", "large" or "small").
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "graph/step.h"
#include "sim/caching_allocator.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using graph::Trace;

constexpr std::uint64_t kNever = UINT64_MAX;
constexpr std::size_t kMaxPeriod = 8;

// Which pass an event belongs to: step, micro-batch, forward or backward (recompute included).
struct PassKey {
  std::uint32_t step, micro;
  bool backward;
  bool operator==(const PassKey& o) const { return step == o.step && micro == o.micro && backward == o.backward; }
};

PassKey pass_of(const graph::MomentTag& m) {
  return {m.step, m.micro, m.phase == Phase::kBackward || m.recompute};
}

struct Boundary {
  std::size_t event;           // first event of the layer that starts here
  std::size_t next;            // first event after that layer (the next boundary or pass end)
  std::size_t prev_first_tensor;  // first tensor allocated by the previous layer of the pass
  std::size_t mirror_first = 0, mirror_end = 0;  // backward: tensors of this layer's forward
  std::int32_t layer;
  PassKey pass;
};

struct Counts {
  int equal = 0, sizes = 0, free = 0, other = 0;
  int periodic = 0;  // not equal to the previous boundary, but to one 2..kMaxPeriod layers back
};

// Layer spans: for every pass, the event ranges of consecutive layers.
std::vector<Boundary> boundaries(const Trace& t) {
  std::vector<Boundary> out;
  // forward layer tensor ranges, by (step, micro, layer)
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::int32_t>, std::pair<std::size_t, std::size_t>> fwd;
  struct Span {
    PassKey pass;
    std::int32_t layer;
    std::size_t begin, end, first_tensor, end_tensor;
  };
  std::vector<Span> spans;
  std::size_t next_tensor = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const graph::Event& e = t.events[i];
    const graph::MomentTag& m = t.moments[e.moment];
    if (e.alloc) next_tensor = e.tensor + 1;
    if (m.layer < 0 || (m.phase != Phase::kForward && m.phase != Phase::kBackward)) continue;
    const PassKey p = pass_of(m);
    if (spans.empty() || !(spans.back().pass == p) || spans.back().layer != m.layer) {
      spans.push_back({p, m.layer, i, i + 1, e.alloc ? e.tensor : next_tensor, next_tensor});
    }
    spans.back().end = i + 1;
    spans.back().end_tensor = next_tensor;
  }
  for (const Span& s : spans) {
    if (!s.pass.backward) fwd[{s.pass.step, s.pass.micro, s.layer}] = {s.first_tensor, s.end_tensor};
  }
  for (std::size_t k = 1; k < spans.size(); ++k) {
    const Span& a = spans[k - 1];
    const Span& b = spans[k];
    if (!(a.pass == b.pass)) continue;
    // a layer span that an op outside the layers interrupted is no boundary
    if (b.layer != a.layer + (b.pass.backward ? -1 : 1)) continue;
    Boundary bd{b.begin, b.end, a.first_tensor, 0, 0, b.layer, b.pass};
    if (b.pass.backward) {
      // this layer's forward, and the one before it (whose output this layer saved)
      auto it = fwd.find({b.pass.step, b.pass.micro, b.layer});
      if (it != fwd.end()) std::tie(bd.mirror_first, bd.mirror_end) = it->second;
      auto before = fwd.find({b.pass.step, b.pass.micro, b.layer - 1});
      if (before != fwd.end()) bd.mirror_first = before->second.first;
    }
    out.push_back(bd);
  }
  return out;
}

// How much of a free range the canonical form keeps.
enum class FreeDetail { kAll, kNoSizes, kNone };
// Which pools' segments the canonical form covers.
enum class Scope { kBoth, kLarge, kSmall };
constexpr const char* kScopeNames[] = {"both", "large", "small"};

// The canonical form of what the layer starting at `b` can touch, with free ranges in full,
// without their sizes, or left out (then a segment counts only for its live tensors).
std::vector<std::uint64_t> canonical(const std::vector<sim::CachingAllocator::RangeView>& ranges,
                                     const std::vector<std::uint32_t>& owner, const std::vector<std::uint64_t>& freed_at,
                                     const Boundary& b, FreeDetail detail, Scope scope) {
  enum : std::uint64_t { kSegment = 1, kWall, kFree, kUnmapped, kRecent, kMirror, kAbsolute };
  std::vector<std::uint64_t> out;
  std::vector<std::uint64_t> seg;
  bool relevant = false;
  bool wall = false;
  auto flush = [&]() {
    if (relevant) out.insert(out.end(), seg.begin(), seg.end());
    seg.clear();
    relevant = false;
    wall = false;
  };
  for (const auto& r : ranges) {
    if ((scope == Scope::kLarge && r.small_pool) || (scope == Scope::kSmall && !r.small_pool)) continue;
    if (r.segment_start) {
      flush();
      seg.push_back(kSegment << 56 | static_cast<std::uint64_t>(r.stream & 0xff));
    }
    if (!r.allocated) {
      if (detail == FreeDetail::kNone) continue;
      relevant = true;
      wall = false;
      seg.push_back((r.mapped ? kFree : kUnmapped) << 56);
      seg.push_back(detail == FreeDetail::kAll ? r.size : 0);
      continue;
    }
    const std::uint32_t t = owner[r.id];
    const bool frozen = freed_at[t] >= b.next;
    if (frozen) {
      if (!wall) seg.push_back(kWall << 56);
      wall = true;
      continue;
    }
    relevant = true;
    wall = false;
    std::uint64_t name;
    if (t >= b.prev_first_tensor) {
      name = kRecent << 56 | (t - b.prev_first_tensor);
    } else if (b.pass.backward && t >= b.mirror_first && t < b.mirror_end) {
      name = kMirror << 56 | (t - b.mirror_first);
    } else {
      name = kAbsolute << 56 | t;
    }
    seg.push_back(name);
    seg.push_back(r.size);
  }
  flush();
  return out;
}

struct Result {
  std::map<std::string, Counts> by_pass[3];  // by scope, then "step 1 forward", ...
};

// What one scope remembers of the boundaries seen so far.
struct ScopeState {
  std::vector<std::uint64_t> prev_full, prev_shape, prev_live;
  std::vector<std::vector<std::uint64_t>> history;  // full forms of this pass's boundaries, latest last
};

void study(const Model& m, const Recipe& r, Result& res) {
  const Trace t = graph::build_training_trace(m, r, find_gpu(r.gpu));
  const std::vector<Boundary> bds = boundaries(t);
  std::vector<std::uint64_t> freed_at(t.storages.size(), kNever);
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    if (!t.events[i].alloc) freed_at[t.events[i].tensor] = i;
  }
  sim::AllocatorConfig cfg;
  cfg.expandable_segments = r.allocator == AllocatorMode::kExpandable;
  sim::CachingAllocator alloc(cfg);
  std::vector<sim::CachingAllocator::BlockId> block(t.storages.size(), UINT32_MAX);
  std::vector<std::uint32_t> owner;
  std::vector<sim::CachingAllocator::RangeView> ranges;
  std::size_t bi = 0;
  ScopeState states[3];
  PassKey prev_pass{0, 0, false};
  std::int32_t prev_layer = -2;
  for (std::size_t i = 0; i <= t.events.size(); ++i) {
    while (bi < bds.size() && bds[bi].event == i) {
      const Boundary& b = bds[bi];
      alloc.layout(ranges);
      const bool consecutive = prev_pass == b.pass && prev_layer == b.layer + (b.pass.backward ? 1 : -1);
      for (int sc = 0; sc < 3; ++sc) {
        const Scope scope = static_cast<Scope>(sc);
        ScopeState& st = states[sc];
        std::vector<std::uint64_t> full = canonical(ranges, owner, freed_at, b, FreeDetail::kAll, scope);
        std::vector<std::uint64_t> shape = canonical(ranges, owner, freed_at, b, FreeDetail::kNoSizes, scope);
        std::vector<std::uint64_t> live = canonical(ranges, owner, freed_at, b, FreeDetail::kNone, scope);
        if (consecutive) {
          const std::string key = "step " + std::string(b.pass.step == 1 ? "1" : "2+") +
                                  (b.pass.backward ? " backward" : " forward");
          Counts& c = res.by_pass[sc][key];
          // LAYER_STUDY_DEBUG=<layer>: print both forms at that layer's boundaries when they differ
          const char* debug = std::getenv("LAYER_STUDY_DEBUG");
          if (debug && b.layer == std::atoi(debug) && full != st.prev_full) {
            auto dump = [](const char* what, const std::vector<std::uint64_t>& v) {
              std::printf("%s:", what);
              for (std::uint64_t x : v) {
                const std::uint64_t tag = x >> 56;
                if (tag) std::printf(" %c%llu", "?SWFURMA"[tag], static_cast<unsigned long long>(x & ((1ull << 56) - 1)));
                else std::printf(" =%llu", static_cast<unsigned long long>(x));
              }
              std::printf("\n");
            };
            std::printf("%s layer %d, pools %s\n", key.c_str(), b.layer, kScopeNames[sc]);
            dump("prev", st.prev_full);
            dump("this", full);
          }
          bool periodic = false;
          for (std::size_t p = 2; p <= kMaxPeriod && p <= st.history.size(); ++p) {
            periodic = periodic || st.history[st.history.size() - p] == full;
          }
          if (full == st.prev_full) ++c.equal;
          else if (periodic) ++c.periodic;
          else if (shape == st.prev_shape) ++c.sizes;
          else if (live == st.prev_live) ++c.free;
          else ++c.other;
        }
        if (!consecutive) st.history.clear();
        st.history.push_back(full);
        if (st.history.size() > kMaxPeriod) st.history.erase(st.history.begin());
        st.prev_full = std::move(full);
        st.prev_shape = std::move(shape);
        st.prev_live = std::move(live);
      }
      prev_pass = b.pass;
      prev_layer = b.layer;
      ++bi;
    }
    if (i == t.events.size()) break;
    const graph::Event& e = t.events[i];
    if (e.alloc) {
      const auto id = alloc.allocate(t.storages[e.tensor].bytes);
      block[e.tensor] = id;
      if (owner.size() <= id) owner.resize(id + 1, UINT32_MAX);
      owner[id] = e.tensor;
    } else {
      alloc.release(block[e.tensor]);
    }
  }
}

}  // namespace
}  // namespace trainmem

int main(int argc, char** argv) {
  using namespace trainmem;
  std::uint64_t seq = 1024;
  std::vector<std::string> models;
  if (argc > 1) seq = std::strtoull(argv[1], nullptr, 10);
  for (int i = 2; i < argc; ++i) models.push_back(argv[i]);
  if (models.empty()) models = {"llama-3.1-8b", "qwen3-4b", "gemma-2-2b", "gpt2"};
  for (const std::string& name : models) {
    const Model m = load_model(name);
    Result res;
    for (Precision p : {Precision::kFp32, Precision::kBf16Mixed, Precision::kBf16True})
      for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdafactor})
        for (Checkpointing c : {Checkpointing::kNone, Checkpointing::kFull})
          for (Attention a : {Attention::kEager, Attention::kSdpa})
            for (AllocatorMode al : {AllocatorMode::kDefault, AllocatorMode::kExpandable})
              for (const char* gpu : {"h100-80gb", "cpu"}) {
                Recipe r;
                r.precision = p;
                r.optimizer = o;
                r.checkpointing = c;
                r.attention = a;
                r.allocator = al;
                r.gpu = gpu;
                r.seq = name == "gpt2" ? std::min<std::uint64_t>(seq, 1024) : seq;
                study(m, r, res);
              }
    for (const auto& [pass, unused] : res.by_pass[0]) {
      for (int sc = 0; sc < 3; ++sc) {
        const Counts& c = res.by_pass[sc][pass];
        const int n = c.equal + c.periodic + c.sizes + c.free + c.other;
        std::printf("| %s | %llu | %s | %s | %d | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.1f%% |\n", name.c_str(),
                    static_cast<unsigned long long>(name == "gpt2" ? std::min<std::uint64_t>(seq, 1024) : seq),
                    pass.c_str(), kScopeNames[sc], n, 100.0 * c.equal / n, 100.0 * c.periodic / n,
                    100.0 * c.sizes / n, 100.0 * c.free / n, 100.0 * c.other / n);
      }
    }
    std::fflush(stdout);
  }
}
