// Layer stamping on the tape (Note [Stamped decoder layers] in tape.h): capturing a span of the
// tape and appending it again with other ids. A file of its own so that tape.cpp's per-event
// code is compiled (and inlined) as before.
#include <algorithm>
#include <cstring>

#include "common/checked.h"
#include "graph/tape.h"

namespace trainmem::graph {

// See Note [Stamped decoder layers].
void Tape::mark(TapeMark& m) const {
  m.storages = static_cast<std::uint32_t>(trace_.storages.size());
  m.events = static_cast<std::uint32_t>(trace_.events.size());
  m.moments = static_cast<std::uint32_t>(trace_.moments.size());
  m.nodes = static_cast<std::uint32_t>(nodes_.size());
  m.values = static_cast<std::uint32_t>(value_grad_.size());
  m.param_slots = param_grads_.size();
  m.module_lists = module_begins_at_.size();
  m.open_modules = open_modules_.size();
  m.subclass = subclass_.size();
  m.before.assign(trace_.storages.begin(), trace_.storages.end());
}

namespace {
std::uint32_t slot_in(const std::vector<std::uint32_t>& table, std::uint32_t id) {
  for (std::size_t k = 0; k < table.size(); ++k) {
    if (table[k] == id) return static_cast<std::uint32_t>(k);
  }
  return kNone;
}

}  // namespace

// No id twice among the present ones: a stamp must know which slot a storage stands for. Each
// check marks the ids it sees with a number of its own (a table as long as the storages).
bool Tape::distinct(const std::vector<TensorId>& table) const {
  if (seen_.size() < trace_.storages.size()) seen_.resize(trace_.storages.size(), 0);
  const std::uint32_t mark = ++seen_mark_;
  for (TensorId id : table) {
    if (id == kNone) continue;
    if (seen_[id] == mark) return false;
    seen_[id] = mark;
  }
  return true;
}

bool Tape::capture(const TapeMark& m, const std::vector<TensorId>& outside_storages,
                   const std::vector<ValueId>& outside_values, const std::vector<std::uint32_t>& param_slots,
                   std::int32_t layer, TapeSpan& span) const {
  if (!saving || recomputing || node_open_) return false;
  if (param_grads_.size() != m.param_slots || module_begins_at_.size() != m.module_lists ||
      open_modules_.size() != m.open_modules || subclass_.size() != m.subclass || sealed_storages_ > m.storages) {
    return false;
  }
  const std::uint32_t s0 = m.storages, s1 = static_cast<std::uint32_t>(trace_.storages.size());
  const std::uint32_t m0 = m.moments, m1 = static_cast<std::uint32_t>(trace_.moments.size());
  const std::uint32_t v0 = m.values, v1 = static_cast<std::uint32_t>(value_grad_.size());
  if (m1 == m0 || !distinct(outside_storages)) return false;
  // The older storages: only the outside ones may have changed.
  span.outside.assign(outside_storages.size(), {});
  for (std::size_t k = 0; k < outside_storages.size(); ++k) {
    const TensorId id = outside_storages[k];
    if (id == kNone) continue;
    if (id >= s0) return false;
    span.outside[k] = {true, m.before[id].refs, 0, m.before[id].category, m.before[id].category};
  }
  // Compared a block of bytes at a time, entry by entry only in a block whose bytes differ (a
  // layer changes a dozen storages; equal bytes are equal fields, and padding that differs only
  // sends a block to the exact comparison).
  constexpr TensorId kBlock = 64;
  for (TensorId lo = 0; lo < s0; lo += kBlock) {
    const TensorId hi = std::min<TensorId>(s0, lo + kBlock);
    if (std::memcmp(&m.before[lo], &trace_.storages[lo], (hi - lo) * sizeof(Storage)) == 0) continue;
    for (TensorId id = lo; id < hi; ++id) {
      const Storage& was = m.before[id];
      const Storage& now = trace_.storages[id];
      if (was.refs == now.refs && was.category == now.category) continue;
      const std::uint32_t k = slot_in(outside_storages, id);
      if (k == kNone) return false;
      span.outside[k].refs_delta = static_cast<std::int32_t>(now.refs) - static_cast<std::int32_t>(was.refs);
      span.outside[k].after = now.category;
    }
  }
  span.events.clear();
  for (std::size_t i = m.events; i < trace_.events.size(); ++i) {
    const Event& e = trace_.events[i];
    if (e.tensor < s0 || e.moment < m0) return false;
    span.events.push_back({e.tensor - s0, e.moment - m0, e.alloc});
  }
  for (std::uint32_t i = m0; i < m1; ++i) {
    const MomentTag& t = trace_.moments[i];
    if (t.step != step || t.micro != micro || t.layer != layer || t.recompute) return false;
  }
  span.moments.assign(trace_.moments.begin() + m0, trace_.moments.end());
  for (std::uint32_t v = v0; v < v1; ++v) {
    if (value_grad_[v] != kNone) return false;
  }
  span.value_bytes.assign(value_bytes_.begin() + v0, value_bytes_.end());
  bool ok = true;
  // An id relative to the span [lo, hi), or the slot of an older one (not a slot: the capture fails).
  auto relative = [&](std::uint32_t id, std::uint32_t lo, std::uint32_t hi,
                      const std::vector<std::uint32_t>& outside) -> std::uint32_t {
    if (id == kNone) return kNone;
    if (id >= lo && id < hi) return id - lo;
    const std::uint32_t k = id < lo ? slot_in(outside, id) : kNone;
    if (k == kNone) ok = false;
    return TapeSpan::kOutside | k;
  };
  auto storage = [&](TensorId id) -> TensorId { return relative(id, s0, s1, outside_storages); };
  auto value = [&](ValueId v) -> ValueId { return relative(v, v0, v1, outside_values); };
  span.nodes.clear();
  span.nodes.reserve(nodes_.size() - m.nodes);
  for (std::size_t i = m.nodes; i < nodes_.size() && ok; ++i) {
    const Node& n = nodes_[i];
    if (n.recompute || n.kernel || n.tag.step != step || n.tag.micro != micro || n.tag.layer != layer ||
        n.tag.recompute) {
      return false;
    }
    Node& c = span.nodes.emplace_back();
    c.tag = n.tag;
    c.output = value(n.output);
    for (TensorId id : n.saved) c.saved.push_back(storage(id));
    for (TensorId id : n.kept) c.kept.push_back(storage(id));
    for (GradIn in : n.inputs) {
      in.value = value(in.value);
      in.reuse = storage(in.reuse);
      c.inputs.push_back(in);
    }
    c.scratch = n.scratch;
    c.scratch_freed_early = n.scratch_freed_early;
    for (ParamGrad pg : n.params) {
      pg.param = slot_in(param_slots, pg.param);
      if (pg.param == kNone) ok = false;
      pg.reuse = storage(pg.reuse);
      c.params.push_back(pg);
    }
  }
  if (!ok) return false;
  span.storages.assign(trace_.storages.begin() + s0, trace_.storages.end());
  span.step = step;
  span.micro = micro;
  span.layer = layer;
  return true;
}

bool Tape::can_stamp(const TapeSpan& span, const std::vector<TensorId>& outside_storages) const {
  if (!saving || recomputing || node_open_ || outside_storages.size() != span.outside.size()) return false;
  for (std::size_t k = 0; k < outside_storages.size(); ++k) {
    const TapeSpan::Outside& o = span.outside[k];
    const TensorId id = outside_storages[k];
    if ((id != kNone) != o.present) return false;
    if (id == kNone) continue;
    const Storage& s = trace_.storages[id];
    if (s.refs < o.refs_before || s.category != o.before) return false;
  }
  return distinct(outside_storages);
}

void Tape::stamp(const TapeSpan& span, const std::vector<TensorId>& outside_storages,
                 const std::vector<ValueId>& outside_values, const std::vector<std::uint32_t>& param_slots,
                 std::int32_t layer) {
  TRAINMEM_ASSERT(can_stamp(span, outside_storages), "a layer stamped where it cannot be");
  const TensorId sbase = static_cast<TensorId>(trace_.storages.size());
  const std::uint32_t mbase = static_cast<std::uint32_t>(trace_.moments.size());
  const ValueId vbase = static_cast<ValueId>(value_grad_.size());
  trace_.storages.insert(trace_.storages.end(), span.storages.begin(), span.storages.end());
  for (std::size_t k = 0; k < outside_storages.size(); ++k) {
    const TapeSpan::Outside& o = span.outside[k];
    if (!o.present) continue;
    trace_.storages[outside_storages[k]].refs += static_cast<std::uint32_t>(o.refs_delta);
    if (o.after != o.before) recategorize(outside_storages[k], o.after);
  }
  for (const MomentTag& t : span.moments) {
    MomentTag& c = trace_.moments.emplace_back(t);
    c.step = step;
    c.micro = micro;
    c.layer = layer;
  }
  for (const Event& e : span.events) trace_.events.push_back({e.tensor + sbase, e.moment + mbase, e.alloc});
  value_grad_.resize(value_grad_.size() + span.value_bytes.size(), kNone);
  value_bytes_.insert(value_bytes_.end(), span.value_bytes.begin(), span.value_bytes.end());
  auto storage = [&](TensorId id) -> TensorId {
    if (id == kNone) return kNone;
    return (id & TapeSpan::kOutside) ? outside_storages[id & ~TapeSpan::kOutside] : id + sbase;
  };
  auto value = [&](ValueId v) -> ValueId {
    if (v == kNone) return kNone;
    return (v & TapeSpan::kOutside) ? outside_values[v & ~TapeSpan::kOutside] : v + vbase;
  };
  // Copied whole (a node's lists are mostly in place), then its ids rewritten.
  const std::size_t first = nodes_.size();
  nodes_.insert(nodes_.end(), span.nodes.begin(), span.nodes.end());
  for (std::size_t i = first; i < nodes_.size(); ++i) {
    Node& n = nodes_[i];
    n.tag.step = step;
    n.tag.micro = micro;
    n.tag.layer = layer;
    n.output = value(n.output);
    for (TensorId& id : n.saved) id = storage(id);
    for (TensorId& id : n.kept) id = storage(id);
    for (GradIn& in : n.inputs) {
      in.value = value(in.value);
      in.reuse = storage(in.reuse);
    }
    for (ParamGrad& pg : n.params) {
      pg.param = param_slots[pg.param];
      pg.reuse = storage(pg.reuse);
    }
  }
  tag_ = trace_.moments.back();
  moment_ = static_cast<std::uint32_t>(trace_.moments.size() - 1);
}

}  // namespace trainmem::graph
