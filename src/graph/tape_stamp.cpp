// Layer stamping on the tape (Note [Stamped decoder layers] in tape.h): capturing a span of the
// tape and appending it again with other ids. A file of its own so that tape.cpp's per-event
// code is compiled (and inlined) as before.
#include <algorithm>
#include <cstring>
#include <memory>

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
thread_local std::uint64_t t_generation = 0;        // TapeSpan::generation's last
thread_local std::uint64_t t_stamped_backwards = 0;  // stamped_backwards()
thread_local std::uint64_t t_captured_backwards = 0;  // captured_backwards()

std::uint32_t slot_in(const std::vector<std::uint32_t>& table, std::uint32_t id) {
  for (std::size_t k = 0; k < table.size(); ++k) {
    if (table[k] == id) return static_cast<std::uint32_t>(k);
  }
  return kNone;
}

}  // namespace

// No id twice among the present ones: a stamp must know which slot a storage stands for. Each
// check marks the ids it sees with a number of its own (a table as long as the storages).
bool Tape::distinct(const std::uint32_t* ids, std::size_t n) const {
  if (seen_.size() < trace_.storages.size()) seen_.resize(trace_.storages.size(), 0);
  const std::uint32_t mark = ++seen_mark_;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t id = ids[i];
    if (id == kNone) continue;
    if (id >= seen_.size()) seen_.resize(std::size_t{id} + 1, 0);
    if (seen_[id] == mark) return false;
    seen_[id] = mark;
  }
  return true;
}

bool Tape::distinct_slots(const std::uint32_t* slots, std::size_t n) const {
  if (seen_slots_.size() < param_grads_.size()) seen_slots_.resize(param_grads_.size(), 0);
  const std::uint32_t mark = ++seen_mark_;
  for (std::size_t i = 0; i < n; ++i) {
    if (seen_slots_[slots[i]] == mark) return false;
    seen_slots_[slots[i]] = mark;
  }
  return true;
}

bool Tape::capture(const TapeMark& m, const std::vector<TensorId>& outside_storages,
                   const std::vector<ValueId>& outside_values, const std::vector<std::uint32_t>& param_slots,
                   std::int32_t layer, TapeSpan& span) {
  retire(span);
  span.generation = 0;
  span.backwards.clear();
  span.backward_failures = 0;
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
    // Copied whole (no closures: refused above), then its ids made relative, as append_nodes
    // makes them absolute again: a flag added to Node travels without being listed here.
    Node& c = span.nodes.emplace_back(n);
    c.output = value(n.output);
    for (ValueId& v : c.co_outputs) v = value(v);
    for (TensorId& id : c.saved) id = storage(id);
    for (TensorId& id : c.kept) id = storage(id);
    for (GradIn& in : c.inputs) {
      in.value = value(in.value);
      in.reuse = storage(in.reuse);
    }
    for (ParamGrad& pg : c.params) {
      pg.param = slot_in(param_slots, pg.param);
      if (pg.param == kNone) ok = false;
      pg.reuse = storage(pg.reuse);
    }
  }
  if (!ok) return false;
  span.storages.assign(trace_.storages.begin() + s0, trace_.storages.end());
  span.step = step;
  span.micro = micro;
  span.layer = layer;
  span.generation = ++t_generation;
  span.value_slots = static_cast<std::uint32_t>(outside_values.size());
  span.param_slots = static_cast<std::uint32_t>(param_slots.size());
  span.param_roles.clear();
  for (const Node& c : span.nodes) {
    for (const ParamGrad& pg : c.params) span.param_roles.push_back(pg.param);
  }
  note_range(span, m.nodes, s0, v0, outside_storages, outside_values, param_slots, layer, false);
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

void Tape::stamp(TapeSpan& span, const std::vector<TensorId>& outside_storages,
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
  // See Note [Stamped layer backwards]: where backward stamps the layer, its nodes are its span's
  // and are made only for a backward that cannot be stamped (materialize).
  const std::size_t first = nodes_.size();
  const bool in_span = stamp_backward && !on_module_backward;
  if (!in_span) {
    append_nodes(span, sbase, vbase, outside_storages.data(), outside_values.data(), param_slots.data(), layer);
  }
  tag_ = trace_.moments.back();
  moment_ = static_cast<std::uint32_t>(trace_.moments.size() - 1);
  note_range(span, static_cast<std::uint32_t>(first), sbase, vbase, outside_storages, outside_values, param_slots,
             layer, in_span);
}

void Tape::append_nodes(const TapeSpan& span, TensorId sbase, ValueId vbase, const TensorId* outside_storages,
                        const ValueId* outside_values, const std::uint32_t* param_slots, std::int32_t layer) {
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
    for (ValueId& v : n.co_outputs) v = value(v);
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
}

// ---------------------------------------------------------------- backward (Note [Stamped layer backwards])

std::uint64_t stamped_backwards() { return t_stamped_backwards; }
std::uint64_t captured_backwards() { return t_captured_backwards; }

void Tape::note_range(TapeSpan& span, std::uint32_t nodes_begin, TensorId sbase, ValueId vbase,
                      const std::vector<TensorId>& outside_storages, const std::vector<ValueId>& outside_values,
                      const std::vector<std::uint32_t>& param_slots, std::int32_t layer, bool in_span) {
  if (!stamp_backward) return;
  TRAINMEM_ASSERT(ranges_.empty() || ranges_.back().nodes_end <= nodes_begin, "layer ranges out of order");
  LayerRange& r = ranges_.emplace_back();
  r.nodes_begin = nodes_begin;
  r.nodes_end = nodes_begin + (in_span ? 0 : static_cast<std::uint32_t>(span.nodes.size()));
  r.in_span = in_span;
  r.span = &span;
  r.generation = span.generation;
  r.sbase = sbase;
  r.vbase = vbase;
  r.tables = static_cast<std::uint32_t>(range_tables_.size());
  r.layer = layer;
  range_tables_.insert(range_tables_.end(), outside_storages.begin(), outside_storages.end());
  range_tables_.insert(range_tables_.end(), outside_values.begin(), outside_values.end());
  range_tables_.insert(range_tables_.end(), param_slots.begin(), param_slots.end());
}

void Tape::run_ranges() {
  std::size_t end = nodes_.size();
  for (std::size_t k = ranges_.size(); k-- > 0;) {
    const LayerRange r = ranges_[k];
    TRAINMEM_ASSERT(r.nodes_end <= end, "a layer range past the nodes");
    run(r.nodes_end, end);
    run_range(r);
    end = r.nodes_begin;
  }
  run(0, end);
}

namespace {
// A range's view of its span's naming: the outside tables, and ids of the span made absolute.
struct RangeNames {
  const TapeSpan& span;
  const std::uint32_t* storages;  // outside storages
  const std::uint32_t* values;    // outside values
  const std::uint32_t* slots;     // parameter slots
  TensorId sbase;
  ValueId vbase;
  std::uint32_t span_values;
  // A value name (the span's values, then the outside ones) as an id (kNone: an absent outside value).
  ValueId value(std::uint32_t name) const { return name < span_values ? vbase + name : values[name - span_values]; }
  // An id as the span's nodes hold it.
  TensorId node_storage(TensorId id) const {
    if (id == kNone) return kNone;
    return (id & TapeSpan::kOutside) ? storages[id & ~TapeSpan::kOutside] : sbase + id;
  }
  ValueId node_value(ValueId v) const {
    if (v == kNone) return kNone;
    return (v & TapeSpan::kOutside) ? values[v & ~TapeSpan::kOutside] : vbase + v;
  }
  std::uint32_t node_value_name(ValueId v) const {
    return (v & TapeSpan::kOutside) ? span_values + (v & ~TapeSpan::kOutside) : v;
  }
};

constexpr std::uint32_t kMaxBackwards = 6;  // captured backwards kept per span
}  // namespace

void Tape::run_range(const LayerRange& r) {
  TapeSpan& span = *r.span;
  TRAINMEM_ASSERT(!r.in_span || span.generation == r.generation, "a stamped layer's span was replaced");
  const bool stampable = span.generation == r.generation && !on_module_backward && subclass_.empty();
  if (stampable && stamp_range(r)) {
    ++t_stamped_backwards;
    return;
  }
  // Built: a layer whose nodes are its span's gets them now, after the nodes already run.
  std::size_t begin = r.nodes_begin, end = r.nodes_end;
  if (r.in_span) {
    begin = nodes_.size();
    const std::uint32_t* t = range_tables_.data() + r.tables;
    append_nodes(span, r.sbase, r.vbase, t, t + span.outside.size(), t + span.outside.size() + span.value_slots,
                 r.layer);
    end = nodes_.size();
  }
  if (!stampable || span.backward_failures >= 2 || span.backwards.size() >= kMaxBackwards) {
    run(begin, end);
  } else {
    TapeBackward b;
    if (capture_range(r, begin, end, b)) {
      span.backwards.push_back(std::move(b));
      ++t_captured_backwards;
    } else {
      ++span.backward_failures;
    }
  }
  if (r.in_span) nodes_.resize(begin);
}

// A span with layers still waiting for their backward is moved to the tape before a capture
// overwrites it: those layers' nodes and captured backwards are in it.
void Tape::retire(TapeSpan& span) {
  bool pending = false;
  for (const LayerRange& r : ranges_) pending = pending || r.span == &span;
  if (!pending) return;
  TapeSpan* kept = retired_.emplace_back(std::make_unique<TapeSpan>(std::move(span))).get();
  for (LayerRange& r : ranges_) {
    if (r.span == &span) r.span = kept;
  }
  span = TapeSpan{};
}

void Tape::count_range_uses() {
  for (const LayerRange& r : ranges_) {
    if (!r.in_span) continue;  // its nodes are in the list
    const std::uint32_t* slots = range_tables_.data() + r.tables + r.span->outside.size() + r.span->value_slots;
    for (const std::uint32_t role : r.span->param_roles) ++param_uses_[slots[role]];
  }
}

bool Tape::stamp_range(const LayerRange& r) {
  const TapeSpan& span = *r.span;
  const std::uint32_t* t = range_tables_.data() + r.tables;
  const RangeNames names{span, t, t + span.outside.size(), t + span.outside.size() + span.value_slots,
                         r.sbase, r.vbase, static_cast<std::uint32_t>(span.value_bytes.size())};
  const TapeBackward* found = nullptr;
  for (const TapeBackward& b : span.backwards) {
    bool ok = true;
    older_ids_.resize(b.older.size());
    for (std::size_t j = 0; j < b.older.size() && ok; ++j) {
      const TapeBackward::Older& o = b.older[j];
      TensorId id;
      if (o.name & TapeSpan::kOutside) {
        id = names.storages[o.name & ~TapeSpan::kOutside];
      } else if (o.name & TapeBackward::kHeld) {
        const ValueId v = names.value(o.name & ~TapeBackward::kHeld);
        id = v == kNone ? kNone : value_grad_[v];
      } else {
        id = r.sbase + o.name;
      }
      if (id == kNone) {
        ok = false;
        break;
      }
      const Storage& s = trace_.storages[id];
      // See Note [Stamped layer backwards]: a count that never came down to 1 only needs to stay above it.
      ok = s.category == o.before && s.bytes == o.bytes && s.view == o.view &&
           (o.lowest < 2 ? s.refs == o.refs_before : s.refs >= o.refs_before - o.lowest + 2);
      older_ids_[j] = id;
    }
    // Storages named by the span are distinct (its own ids, and an outside table the forward
    // checked); one held by a value may be any storage, so it must be none of the others.
    for (const std::uint32_t j : b.held) {
      const TensorId id = older_ids_[j];
      if (id - r.sbase < span.storages.size()) ok = false;
      for (std::size_t i = 0; i < older_ids_.size() && ok; ++i) ok = i == j || older_ids_[i] != id;
    }
    if (!ok) continue;
    for (std::uint32_t v = 0; v < b.values_before.size() && ok; ++v) {
      const ValueId a = names.value(v);
      if (v >= names.span_values) {
        const std::uint64_t bytes = a == kNone ? UINT64_MAX : value_bytes_[a];
        if (bytes != b.outside_value_bytes[v - names.span_values]) ok = false;
      }
      if (a == kNone) continue;
      const std::uint32_t was = b.values_before[v];
      if (value_grad_[a] != (was == kNone ? kNone : older_ids_[was & ~TapeBackward::kOlder])) ok = false;
    }
    for (std::uint32_t k = 0; k < span.param_slots && ok; ++k) {
      const std::uint32_t p = names.slots[k];
      ok = (param_grads_[p] != kNone) == (b.grad_before[k] != 0) && param_uses_[p] == b.uses[k] &&
           param_pending_[p].empty();
    }
    if (ok && distinct_slots(names.slots, span.param_slots)) {
      found = &b;
      break;
    }
  }
  if (found == nullptr) return false;
  const TapeBackward& b = *found;
  if (on_layer_change && r.layer != backward_layer_) {  // as run_node would at the range's first node
    const std::int32_t from = backward_layer_;
    backward_layer_ = r.layer;
    on_layer_change(from, r.layer);
  }
  const TensorId bs0 = static_cast<TensorId>(trace_.storages.size());
  const std::uint32_t m0 = static_cast<std::uint32_t>(trace_.moments.size());
  trace_.storages.insert(trace_.storages.end(), b.storages.begin(), b.storages.end());
  for (std::size_t j = 0; j < b.older.size(); ++j) {
    const TapeBackward::Older& o = b.older[j];
    trace_.storages[older_ids_[j]].refs += static_cast<std::uint32_t>(o.refs_delta);
    if (o.after != o.before) recategorize(older_ids_[j], o.after);
  }
  trace_.moments.resize(m0 + b.moments.size());
  MomentTag* tags = trace_.moments.data() + m0;
  for (const MomentTag& tag : b.moments) {
    *tags = tag;
    tags->step = step;
    tags->micro = micro;
    tags->layer = r.layer;
    ++tags;
  }
  auto id = [&](std::uint32_t x) -> TensorId {
    if (x == kNone) return kNone;
    return (x & TapeBackward::kOlder) ? older_ids_[x & ~TapeBackward::kOlder] : x + bs0;
  };
  // The events shifted as if all named new storages, then those of older ones put right.
  const std::size_t e0 = trace_.events.size();
  for (const Event& e : b.events) trace_.events.push_back({e.tensor + bs0, e.moment + m0, e.alloc});
  for (const auto& [at, j] : b.older_events) trace_.events[e0 + at].tensor = older_ids_[j];
  for (std::uint32_t v = 0; v < b.values_after.size(); ++v) {
    const ValueId a = names.value(v);
    if (a != kNone) value_grad_[a] = id(b.values_after[v]);
  }
  for (std::uint32_t k = 0; k < span.param_slots; ++k) {
    if (b.grad_after[k] != kNone) param_grads_[names.slots[k]] = id(b.grad_after[k]);
  }
  if (!b.moments.empty()) {
    tag_ = trace_.moments.back();
    moment_ = static_cast<std::uint32_t>(trace_.moments.size() - 1);
  }
  return true;
}

// Runs the range node by node (as run() would) and captures what it did, when it is what the
// span's nodes renamed and the state it starts from and leaves can be named (else false, the
// range having run all the same).
bool Tape::capture_range(const LayerRange& r, std::size_t begin, std::size_t end, TapeBackward& b) {
  const TapeSpan& span = *r.span;
  const std::uint32_t* t = range_tables_.data() + r.tables;
  const RangeNames names{span, t, t + span.outside.size(), t + span.outside.size() + span.value_slots,
                         r.sbase, r.vbase, static_cast<std::uint32_t>(span.value_bytes.size())};
  auto plain = [&] {
    run(begin, end);
    return false;
  };
  // The range's nodes are the span's, renamed.
  if (end - begin != span.nodes.size()) return plain();
  for (std::size_t i = 0; i < span.nodes.size(); ++i) {
    const Node& n = nodes_[begin + i];
    const Node& c = span.nodes[i];
    bool same = !n.recompute && !n.kernel && n.tag.layer == r.layer && n.tag.op.data() == c.tag.op.data() &&
                n.tag.op.size() == c.tag.op.size() && n.output == names.node_value(c.output) &&
                n.saved.size() == c.saved.size() && n.kept.size() == c.kept.size() &&
                n.inputs.size() == c.inputs.size() && n.scratch.size() == c.scratch.size() &&
                n.params.size() == c.params.size() && n.scratch_freed_early == c.scratch_freed_early &&
                n.grad_order == c.grad_order && n.unpacked == c.unpacked &&
                n.params_routed_first == c.params_routed_first && n.saves_after_forward == c.saves_after_forward &&
                n.co_outputs.size() == c.co_outputs.size();
    for (std::size_t k = 0; same && k < n.co_outputs.size(); ++k) {
      same = n.co_outputs[k] == names.node_value(c.co_outputs[k]);
    }
    for (std::size_t k = 0; same && k < n.saved.size(); ++k) same = n.saved[k] == names.node_storage(c.saved[k]);
    for (std::size_t k = 0; same && k < n.kept.size(); ++k) same = n.kept[k] == names.node_storage(c.kept[k]);
    for (std::size_t k = 0; same && k < n.scratch.size(); ++k) same = n.scratch[k] == c.scratch[k];
    for (std::size_t k = 0; same && k < n.inputs.size(); ++k) {
      const GradIn &x = n.inputs[k], &y = c.inputs[k];
      same = x.value == names.node_value(y.value) && x.bytes == y.bytes && x.passthrough == y.passthrough &&
             x.reuse == names.node_storage(y.reuse) && x.discard == y.discard && x.subclass == y.subclass &&
             x.unwrap == y.unwrap && x.view == y.view && x.compute_bytes == y.compute_bytes;
    }
    for (std::size_t k = 0; same && k < n.params.size(); ++k) {
      const ParamGrad &x = n.params[k], &y = c.params[k];
      same = x.param == names.slots[y.param] && x.compute_bytes == y.compute_bytes &&
             x.scratch_bytes == y.scratch_bytes && x.param_bytes == y.param_bytes &&
             x.reuse == names.node_storage(y.reuse) && x.view == y.view && x.reduced == y.reduced;
    }
    if (!same) return plain();
  }
  if (!distinct_slots(names.slots, span.param_slots)) return plain();
  for (std::uint32_t k = 0; k < span.param_slots; ++k) {
    if (!param_pending_[names.slots[k]].empty()) return plain();
  }
  // The older storages: those the nodes name, then those the values hold.
  if (older_index_.size() < trace_.storages.size()) older_index_.resize(trace_.storages.size(), kNone);
  b.older.clear();
  older_ids_.clear();
  auto older = [&](TensorId id, std::uint32_t name) -> std::uint32_t {
    if (older_index_[id] == kNone) {
      older_index_[id] = static_cast<std::uint32_t>(older_ids_.size());
      older_ids_.push_back(id);
      const Storage& s = trace_.storages[id];
      b.older.push_back({name, s.refs, s.refs, 0, s.bytes, s.category, s.category, s.view});
    }
    return older_index_[id];
  };
  auto named = [&](TensorId id) {
    if (id != kNone) older(names.node_storage(id), id);
  };
  for (const Node& c : span.nodes) {
    for (TensorId id : c.saved) named(id);
    for (TensorId id : c.kept) named(id);
    for (const GradIn& in : c.inputs) named(in.reuse);
    for (const ParamGrad& pg : c.params) named(pg.reuse);
  }
  const std::uint32_t value_names = names.span_values + span.value_slots;
  const std::uint32_t span_storages = static_cast<std::uint32_t>(span.storages.size());
  b.values_before.assign(value_names, kNone);
  b.outside_value_bytes.assign(span.value_slots, UINT64_MAX);
  for (std::uint32_t v = 0; v < value_names; ++v) {
    const ValueId a = names.value(v);
    if (a == kNone) continue;
    if (v >= names.span_values) b.outside_value_bytes[v - names.span_values] = value_bytes_[a];
    const TensorId g = value_grad_[a];
    if (g == kNone) continue;
    std::uint32_t name = TapeBackward::kHeld | v;
    if (g >= r.sbase && g - r.sbase < span_storages) name = g - r.sbase;
    for (std::uint32_t k = 0; k < span.outside.size(); ++k) {
      if (names.storages[k] == g) name = TapeSpan::kOutside | k;
    }
    b.values_before[v] = TapeBackward::kOlder | older(g, name);
  }
  b.held.clear();
  for (std::uint32_t j = 0; j < b.older.size(); ++j) {
    if (!(b.older[j].name & TapeSpan::kOutside) && (b.older[j].name & TapeBackward::kHeld)) b.held.push_back(j);
  }
  b.grad_before.assign(span.param_slots, 0);
  b.uses.assign(span.param_slots, 0);
  std::vector<TensorId> grads_were(span.param_slots);
  for (std::uint32_t k = 0; k < span.param_slots; ++k) {
    const std::uint32_t p = names.slots[k];
    grads_were[k] = param_grads_[p];
    b.grad_before[k] = param_grads_[p] != kNone;
    b.uses[k] = param_uses_[p];
  }
  // The run, node by node, noting each older storage's lowest count at the boundaries.
  const TensorId bs0 = static_cast<TensorId>(trace_.storages.size());
  const std::size_t e0 = trace_.events.size(), m0 = trace_.moments.size(), node_count = nodes_.size();
  for (std::size_t i = end; i-- > begin;) {
    run(i, i + 1);
    for (std::size_t j = 0; j < older_ids_.size(); ++j) {
      b.older[j].lowest = std::min(b.older[j].lowest, trace_.storages[older_ids_[j]].refs);
    }
  }
  bool ok = nodes_.size() == node_count && subclass_.empty();
  auto encode = [&](TensorId id) -> std::uint32_t {
    if (id == kNone) return kNone;
    if (id >= bs0) return id - bs0;
    if (older_index_[id] != kNone) return TapeBackward::kOlder | older_index_[id];
    ok = false;
    return kNone;
  };
  b.moments.assign(trace_.moments.begin() + static_cast<std::ptrdiff_t>(m0), trace_.moments.end());
  for (const MomentTag& tag : b.moments) {
    if (tag.step != step || tag.micro != micro || tag.phase != Phase::kBackward || tag.layer != r.layer ||
        tag.recompute) {
      ok = false;
    }
  }
  b.events.clear();
  b.older_events.clear();
  for (std::size_t i = e0; i < trace_.events.size() && ok; ++i) {
    const Event& e = trace_.events[i];
    if (e.moment < m0) ok = false;
    const std::uint32_t id = encode(e.tensor);
    if (id != kNone && (id & TapeBackward::kOlder)) {
      b.older_events.push_back({static_cast<std::uint32_t>(i - e0), id & ~TapeBackward::kOlder});
    }
    b.events.push_back({(id & TapeBackward::kOlder) ? 0 : id, e.moment - static_cast<std::uint32_t>(m0), e.alloc});
  }
  b.values_after.assign(value_names, kNone);
  for (std::uint32_t v = 0; v < value_names && ok; ++v) {
    const ValueId a = names.value(v);
    if (a != kNone) b.values_after[v] = encode(value_grad_[a]);
  }
  b.grad_after.assign(span.param_slots, kNone);
  for (std::uint32_t k = 0; k < span.param_slots && ok; ++k) {
    const std::uint32_t p = names.slots[k];
    if (!param_pending_[p].empty()) ok = false;
    if (param_grads_[p] != grads_were[k]) {
      if (grads_were[k] != kNone) ok = false;  // AccumulateGrad never replaces a .grad
      b.grad_after[k] = encode(param_grads_[p]);
    }
  }
  for (std::size_t j = 0; j < older_ids_.size(); ++j) {
    TapeBackward::Older& o = b.older[j];
    const Storage& s = trace_.storages[older_ids_[j]];
    o.refs_delta = static_cast<std::int32_t>(s.refs) - static_cast<std::int32_t>(o.refs_before);
    o.after = s.category;
    older_index_[older_ids_[j]] = kNone;
  }
  b.storages.assign(trace_.storages.begin() + bs0, trace_.storages.end());
  return ok;
}

}  // namespace trainmem::graph
