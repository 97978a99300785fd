#include "graph/tape.h"

#include <algorithm>

#include "common/checked.h"

namespace trainmem::graph {

namespace {
// Traces of finished estimates, emptied, for the next Tape on this thread (see recycle()).
thread_local std::vector<Trace> t_spare_traces;
}  // namespace

void recycle(Trace&& trace) {
  if (t_spare_traces.size() >= 4) return;
  trace.storages.clear();
  trace.events.clear();
  trace.moments.clear();
  trace.trainable_parameters = 0;
  t_spare_traces.push_back(std::move(trace));
}

Tape::Tape() {
  if (!t_spare_traces.empty()) {
    trace_ = std::move(t_spare_traces.back());
    t_spare_traces.pop_back();
  }
  trace_.moments.push_back(tag_);
}

void Tape::at(Phase phase, std::int32_t layer, std::string_view op) {
  tag_ = MomentTag{step, micro, phase, layer, op, recomputing && phase != Phase::kBackward};
  trace_.moments.push_back(tag_);
  moment_ = static_cast<std::uint32_t>(trace_.moments.size() - 1);
}

// A storage's category is read by the replay when it consumes the allocation; every change must
// come before that (the categories of docs/schema.md are what a storage *becomes*).
void Tape::recategorize(TensorId id, Category c) {
  Storage& s = trace_.storages[id];
  if (s.category == c) return;
  TRAINMEM_ASSERT(id >= sealed_storages_, "a storage's category changed after the replay read it");
  s.category = c;
}

void Tape::set_category(TensorId id, Category c) { recategorize(id, c); }

TensorId Tape::alloc_bytes(std::uint64_t bytes, Category category) {
  TensorId id = static_cast<TensorId>(trace_.storages.size());
  trace_.storages.push_back({bytes, category, 1});
  trace_.events.push_back({id, moment_, true});
  return id;
}

TensorId Tape::reserve(std::uint64_t bytes, Category category) {
  TensorId id = static_cast<TensorId>(trace_.storages.size());
  trace_.storages.push_back({bytes, category, 1});
  return id;
}

void Tape::resize(TensorId id, bool allocated) { trace_.events.push_back({id, moment_, allocated}); }

T Tape::make(std::uint64_t numel, DType dtype, Category category) {
  T t;
  t.numel = numel;
  t.dtype = dtype;
  t.id = alloc_bytes(detail::mul(numel, dtype_bytes(dtype), "tensor size"), category);
  return t;
}

void Tape::retain(TensorId id) {
  if (id == kNone) return;
  ++trace_.storages[id].refs;
}

void Tape::release(TensorId id) {
  if (id == kNone) return;
  Storage& s = trace_.storages[id];
  TRAINMEM_ASSERT(s.refs > 0, "release of a freed storage");
  if (--s.refs == 0) trace_.events.push_back({id, moment_, false});
}

ValueId Tape::new_value(std::uint64_t grad_bytes) {
  value_grad_.push_back(kNone);
  value_bytes_.push_back(grad_bytes);
  return static_cast<ValueId>(value_grad_.size() - 1);
}

std::uint32_t Tape::new_param(TensorId) {
  param_grads_.push_back(kNone);
  return static_cast<std::uint32_t>(param_grads_.size() - 1);
}

void Tape::record(Node node) {
  for (TensorId id : node.kept) retain(id);
  if (saving) {
    for (TensorId id : node.saved) {
      retain(id);
      Storage& s = trace_.storages[id];
      if (s.category == Category::kTemporaries) recategorize(id, Category::kActivations);
    }
  } else if (!node.recompute) {
    node.saved.clear();
  }
  nodes_.push_back(std::move(node));
}

void Tape::deliver(ValueId v, TensorId g) {
  TensorId& buf = value_grad_[v];
  if (buf == kNone) {
    buf = g;
    return;
  }
  // See Note [Mirroring autograd]: in-place when one side is exclusively owned.
  if (trace_.storages[buf].refs == 1) {
    release(g);
  } else if (trace_.storages[g].refs == 1) {
    release(buf);
    buf = g;
  } else {
    TensorId sum = alloc_bytes(value_bytes_[v], Category::kTemporaries);
    release(buf);
    release(g);
    buf = sum;
  }
}

// AccumulateGrad for a parameter. Its node runs once per backward pass, after every node that
// uses the parameter has delivered a gradient into its input buffer; several gradients (a tied
// embedding: lm_head and the embedding) are summed out of place first (measured with torch
// 2.13: `add`, both parts freed). Then the gradient is stolen into an empty .grad, or added in
// place (`add_`) into the existing one and freed.
void Tape::accumulate_param(const ParamGrad& pg, TensorId g) {
  std::vector<TensorId>& pending = param_pending_[pg.param];
  pending.push_back(g);
  if (pending.size() < std::max<std::uint32_t>(1, param_uses_[pg.param])) return;
  TensorId& slot = param_grads_[pg.param];
  if (pending.size() > 1) {
    TensorId sum = alloc_bytes(trace_.storages[g].bytes, Category::kTemporaries);
    for (TensorId part : pending) {
      recategorize(part, Category::kTemporaries);
      release(part);
    }
    g = sum;
  }
  pending.clear();
  if (slot == kNone) {
    recategorize(g, Category::kGradients);  // stolen into .grad
    slot = g;
  } else {
    recategorize(g, Category::kTemporaries);
    release(g);  // added in place into the existing .grad
  }
  if (on_param_ready) on_param_ready(pg.param);
}

void Tape::run_node(Node& n) {
  if (on_layer_change && n.tag.layer != backward_layer_) {
    const std::int32_t from = backward_layer_;
    backward_layer_ = n.tag.layer;
    on_layer_change(from, n.tag.layer);
  }
  at(Phase::kBackward, n.tag.layer, n.tag.op);
  TensorId incoming = n.output == kNone ? kNone : value_grad_[n.output];
  if (n.output != kNone) value_grad_[n.output] = kNone;
  if (incoming == kNone && n.output != kNone) {
    for (TensorId id : n.saved) release(id);
    for (TensorId id : n.kept) release(id);
    return;
  }
  if (n.recompute) {
    // Non-reentrant checkpoint: recompute the segment with saving on, then run its nodes. The
    // recompute appends to nodes_, so take what we need from `n` before it may move.
    auto recompute = std::move(n.recompute);
    std::vector<TensorId> saved = std::move(n.saved);
    std::vector<TensorId> kept = std::move(n.kept);
    MomentTag tag = n.tag;
    std::size_t begin = nodes_.size();
    bool was = saving;
    saving = true;
    recomputing = true;
    T out = recompute();
    recomputing = false;
    saving = was;
    at(Phase::kBackward, tag.layer, tag.op);
    release(out.id);
    deliver(out.value, incoming);
    run(begin, nodes_.size());
    nodes_.resize(begin);
    // The checkpoint's inputs are saved by a node created before the layer's ops, so they are
    // released after the layer's backward; the recompute closure (with the keyword arguments)
    // lives as long as that graph.
    at(Phase::kBackward, tag.layer, tag.op);
    for (TensorId id : saved) release(id);
    for (TensorId id : kept) release(id);
    return;
  }
  std::vector<TensorId> scratch;
  for (std::uint64_t b : n.scratch) scratch.push_back(alloc_bytes(b, Category::kTemporaries));
  std::vector<TensorId> grads(n.inputs.size(), kNone);
  for (std::size_t k = 0; k < n.inputs.size(); ++k) {
    const GradIn& in = n.inputs[k];
    if (in.discard) {
      scratch.push_back(alloc_bytes(in.bytes, Category::kTemporaries));
      continue;
    }
    if (in.value == kNone) continue;
    if (in.passthrough) {
      retain(incoming);
      grads[k] = incoming;
    } else if (in.reuse != kNone) {
      retain(in.reuse);
      grads[k] = in.reuse;
    } else {
      grads[k] = alloc_bytes(in.bytes, Category::kTemporaries);
    }
  }
  std::vector<TensorId> pgrads(n.params.size(), kNone);
  for (std::size_t k = 0; k < n.params.size(); ++k) {
    const ParamGrad& pg = n.params[k];
    if (pg.reuse != kNone) {
      pgrads[k] = pg.reuse;  // the node holds it until now (see kept)
      retain(pg.reuse);
      continue;
    }
    TensorId sc = pg.scratch_bytes ? alloc_bytes(pg.scratch_bytes, Category::kTemporaries) : kNone;
    bool cast = pg.param_bytes != 0;
    Category c = (!cast && param_grads_[pg.param] == kNone) ? Category::kGradients : Category::kTemporaries;
    pgrads[k] = alloc_bytes(pg.compute_bytes, c);
    if (sc != kNone) release(sc);
  }
  for (TensorId id : scratch) release(id);
  release(incoming);
  for (TensorId id : n.saved) release(id);
  for (TensorId id : n.kept) release(id);
  n.saved.clear();
  n.kept.clear();
  // The weight's cast back to its parameter dtype and AccumulateGrad run next: they have the
  // highest priority in the ready queue.
  for (std::size_t k = 0; k < n.params.size(); ++k) {
    const ParamGrad& pg = n.params[k];
    TensorId g = pgrads[k];
    if (pg.param_bytes != 0) {
      Category c = param_grads_[pg.param] == kNone ? Category::kGradients : Category::kTemporaries;
      TensorId cast = alloc_bytes(pg.param_bytes, c);
      release(g);
      g = cast;
    }
    accumulate_param(pg, g);
  }
  for (std::size_t k = 0; k < n.inputs.size(); ++k) {
    if (grads[k] != kNone) deliver(n.inputs[k].value, grads[k]);
  }
}

void Tape::run(std::size_t begin, std::size_t end) {
  for (std::size_t i = end; i-- > begin;) run_node(nodes_[i]);
}

void Tape::backward(ValueId root) {
  // The seed gradient of the scalar loss (torch.ones_like(loss)). torch.autograd.backward
  // holds it in its grad_tensors for the whole call, so it outlives the first node.
  param_uses_.assign(param_grads_.size(), 0);
  param_pending_.assign(param_grads_.size(), {});
  for (const Node& n : nodes_) {
    for (const ParamGrad& pg : n.params) ++param_uses_[pg.param];
  }
  backward_layer_ = -1;
  TensorId seed = alloc_bytes(4, Category::kTemporaries);
  retain(seed);
  deliver(root, seed);
  run(0, nodes_.size());
  if (on_layer_change && backward_layer_ != -1) on_layer_change(backward_layer_, -1);
  release(seed);
  nodes_.clear();
  for (TensorId& g : value_grad_) {
    if (g != kNone) {
      release(g);  // gradients of leaves that need none (e.g. input embeddings) end here
      g = kNone;
    }
  }
  value_grad_.clear();
  value_bytes_.clear();
}

Trace Tape::take() { return std::move(trace_); }

}  // namespace trainmem::graph
