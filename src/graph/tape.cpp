#include "graph/tape.h"

#include <algorithm>

#include "common/checked.h"

namespace trainmem::graph {

namespace {
// Traces of finished estimates, emptied, for the next Tape on this thread (see recycle()).
thread_local std::vector<Trace> t_spare_traces;
// The same for the node list's capacity (thousands of nodes per pass).
thread_local std::vector<std::vector<Node>> t_spare_nodes;
}  // namespace

void recycle(Trace&& trace) {
  if (t_spare_traces.size() >= 4) return;
  trace.storages.clear();
  trace.events.clear();
  trace.moments.clear();
  trace.trainable_parameters = 0;
  trace.stale_categories = false;
  t_spare_traces.push_back(std::move(trace));
}

Tape::Tape() {
  if (!t_spare_traces.empty()) {
    trace_ = std::move(t_spare_traces.back());
    t_spare_traces.pop_back();
  }
  if (!t_spare_nodes.empty()) {
    nodes_ = std::move(t_spare_nodes.back());
    t_spare_nodes.pop_back();
    nodes_.clear();
  }
  trace_.moments.push_back(tag_);
}

Tape::~Tape() {
  if (t_spare_nodes.size() < 4 && nodes_.capacity() > 0) {
    nodes_.clear();
    t_spare_nodes.push_back(std::move(nodes_));
  }
}

// A storage's category is read by the replay when it consumes the allocation; every change must
// come before that (the categories of docs/schema.md are what a storage *becomes*).
void Tape::recategorize(TensorId id, Category c) {
  Storage& s = trace_.storages[id];
  if (s.category == c) return;
  TRAINMEM_ASSERT(id >= sealed_storages_, "a storage's category changed after the replay read it");
  if (id < peeked_storages_) trace_.stale_categories = true;
  s.category = c;
}

void Tape::set_category(TensorId id, Category c) { recategorize(id, c); }

TensorId Tape::reserve(std::uint64_t bytes, Category category) {
  TensorId id = static_cast<TensorId>(trace_.storages.size());
  trace_.storages.push_back({bytes, category, false, 1});
  return id;
}

void Tape::resize(TensorId id, bool allocated) { trace_.events.push_back({id, moment_, allocated}); }

std::uint32_t Tape::new_param(TensorId) {
  param_grads_.push_back(kNone);
  return static_cast<std::uint32_t>(param_grads_.size() - 1);
}

void Tape::record(Node&& node) {
  TRAINMEM_ASSERT(!node_open_, "record with a node still open");
  nodes_.push_back(std::move(node));
  node_open_ = true;
  close_node();
}

void Tape::close_node() {
  TRAINMEM_ASSERT(node_open_ && !nodes_.empty(), "close_node without open_node");
  node_open_ = false;
  Node& node = nodes_.back();
  for (TensorId id : node.kept) retain(id);
  if (saving) {
    for (TensorId id : node.saved) {
      retain(id);
      Storage& s = trace_.storages[id];
      if (s.category == Category::kTemporaries) recategorize(id, Category::kActivations);
    }
  } else if (!node.recompute) {
    if (!node.saved.empty()) last_saving_node_ = nodes_.size() - 1;
    node.saved.clear();
  }
  node.unpacked = recomputing && saving && unpacking_;
  if (recomputing && saving) {
    // Early stop fires in the pack hook of the op's last saved tensor: autograd saves an op's
    // inputs before running it, so the stop is right after the newest saved tensor was made,
    // but not before this op began (after the previous node was recorded).
    if (!node.saved.empty() && node.saves_after_forward) {
      last_saving_event_ = trace_.events.size();  // packed once the op's forward has returned
    } else if (!node.saved.empty()) {
      std::size_t stop = op_begin_event_;
      for (std::size_t i = trace_.events.size(); i-- > op_begin_event_;) {
        const Event& e = trace_.events[i];
        if (e.alloc && std::find(node.saved.begin(), node.saved.end(), e.tensor) != node.saved.end()) {
          stop = i + 1;
          break;
        }
      }
      last_saving_event_ = stop;
    }
    op_begin_event_ = trace_.events.size();
  }
}

std::vector<std::uint32_t> Tape::recompute_hooks(std::size_t first) const {
  std::vector<std::uint32_t> out;
  if (last_saving_node_ < first) return out;
  // From the segment's last node down to its last saving one, inclusive.
  for (std::size_t i = std::min(nodes_.size(), module_begins_at_.size()); i > last_saving_node_;) {
    --i;
    out.insert(out.end(), module_begins_at_[i].rbegin(), module_begins_at_[i].rend());
  }
  return out;
}

void Tape::hold_with_graph(TensorId id) {
  retain(id);
  (recomputing ? recompute_held_ : graph_held_).push_back(id);
}

void Tape::free_graph_held() {
  for (TensorId id : graph_held_) release(id);
  graph_held_.clear();
}

void Tape::free_recompute_held() {
  for (TensorId id : recompute_held_) release(id);
  recompute_held_.clear();
}

std::shared_ptr<const CheckpointTail> Tape::take_tail(std::size_t first, ValueId output, ValueId first_value) const {
  if (last_saving_node_ < first || last_saving_node_ >= nodes_.size()) return nullptr;  // nothing saves: no unpack
  auto tail = std::make_shared<CheckpointTail>();
  tail->output = output;
  tail->saving_nodes = last_saving_node_ + 1 - first;
  if (last_saving_node_ < module_begins_at_.size()) tail->saving_begins = module_begins_at_[last_saving_node_];
  for (std::size_t k = first; k < nodes_.size(); ++k) tail->outputs.push_back(nodes_[k].output);
  for (std::size_t k = last_saving_node_ + 1; k < nodes_.size(); ++k) {
    const Node& n = nodes_[k];
    // A node that holds storages, makes parameter gradients or reuses forward storages would need
    // the recomputed ones: the recomputed tail stands for it then.
    if (!n.kept.empty() || !n.params.empty() || !n.co_outputs.empty() || n.recompute || n.kernel) return nullptr;
    for (const GradIn& g : n.inputs) {
      if (g.reuse != kNone) return nullptr;
      // The gradients the tail hands on: to its own nodes, the segment's earlier ones or outside it.
      if (g.value != kNone && g.value >= first_value &&
          std::find(tail->outputs.begin(), tail->outputs.end(), g.value) == tail->outputs.end()) {
        return nullptr;
      }
    }
    tail->nodes.push_back(n);
    tail->begins.push_back(k < module_begins_at_.size() ? module_begins_at_[k] : std::vector<std::uint32_t>{});
    tail->ends.push_back(k < module_ends_at_.size() ? module_ends_at_[k] : std::vector<std::uint32_t>{});
  }
  return tail;
}

void Tape::fire_before_recompute(const std::vector<std::uint32_t>& modules) {
  for (std::uint32_t m : modules) {
    on_module_backward(m, true);
    fired_before_recompute_.push_back(m);
  }
}

void Tape::module_end() {
  TRAINMEM_ASSERT(!open_modules_.empty(), "module_end without module_begin");
  const auto [module, first] = open_modules_.back();
  open_modules_.pop_back();
  if (!on_module_backward || nodes_.size() == first) return;  // no node: no backward hooks
  if (module_begins_at_.size() < nodes_.size()) {
    module_begins_at_.resize(nodes_.size());
    module_ends_at_.resize(nodes_.size());
  }
  module_begins_at_[nodes_.size() - 1].push_back(module);
  module_ends_at_[first].push_back(module);
}

void Tape::resize_nodes(std::size_t n) {
  nodes_.resize(n);
  // Layer ranges past the end go (Note [Stamped layer backwards]); all of them with the graph.
  while (!ranges_.empty() && (n == 0 || ranges_.back().nodes_end > n)) ranges_.pop_back();
  if (ranges_.empty()) {
    range_tables_.clear();
    retired_.clear();
  }
  if (module_begins_at_.size() > n) {
    module_begins_at_.resize(n);
    module_ends_at_.resize(n);
  }
}

void Tape::stop_recompute_at(std::size_t stop) {
  // Storages born after the stop were never made; those born before it die where it stops.
  std::vector<TensorId> born;
  std::size_t frees = 0;
  for (std::size_t i = stop; i < trace_.events.size(); ++i) {
    if (trace_.events[i].alloc) born.push_back(trace_.events[i].tensor);
  }
  std::sort(born.begin(), born.end());
  auto is_born = [&](TensorId id) { return std::binary_search(born.begin(), born.end(), id); };
  for (std::size_t i = stop; i < trace_.events.size(); ++i) {
    if (!trace_.events[i].alloc && is_born(trace_.events[i].tensor)) ++frees;
  }
  if (frees != born.size()) return;  // something made after the stop lives on: keep the full recompute
  trace_.events.erase(std::remove_if(trace_.events.begin() + static_cast<std::ptrdiff_t>(stop), trace_.events.end(),
                                     [&](const Event& e) { return is_born(e.tensor); }),
                      trace_.events.end());
}

void Tape::mark_subclass(TensorId id) {
  if (subclass_.size() <= id) subclass_.resize(trace_.storages.size(), false);
  subclass_[id] = true;
}

void Tape::deliver(ValueId v, TensorId g) {
  TensorId& buf = value_grad_[v];
  buf = buf == kNone ? g : buffer_sum(buf, g, value_bytes_[v]);
}

// InputBuffer::accumulate, `g` arriving where `buf` is buffered (See Note [Mirroring autograd]):
// added in place into `buf` when that one is exclusively owned and not a view; otherwise into a
// new tensor. A sum with a tensor subclass on either side is always a new tensor, and a subclass
// itself (DTensor + DTensor); `subclass` says one side is, where the ids do not. Returns what
// the buffer holds.
TensorId Tape::buffer_sum(TensorId buf, TensorId g, std::uint64_t bytes, bool subclass) {
  subclass = subclass || is_subclass(buf) || is_subclass(g);
  if (!subclass && trace_.storages[buf].refs == 1 && !trace_.storages[buf].view) {
    release(g);
    return buf;
  }
  const TensorId sum = alloc_bytes(bytes, Category::kTemporaries);
  release(buf);
  release(g);
  if (subclass) mark_subclass(sum);
  return sum;
}

// AccumulateGrad for a parameter. Its node runs once per backward pass, after every node that
// uses the parameter has delivered a gradient into its input buffer. A second gradient (a tied
// embedding: lm_head's, then the embedding's) is summed there as it arrives, by the rule of
// `deliver`: out of place into a plain nn.Linear's weight gradient, a view (`add`, measured with
// torch 2.13), in place into one that arrives fresh through autocast's cast or the fused loss
// (`add_`). Then the gradient is stolen into an empty .grad, or added in place (`add_`) into the
// existing one and freed.
//
// Note [Tied parameters of DTensors]
// Under tensor parallelism every parameter is a DTensor, the tied embedding a Replicate one
// (python/trainmem/measure/parallel.py, _replicate_the_rest), and so are both of its gradients.
// InputBuffer adds into a buffered gradient in place only when it is a plain tensor
// (can_accumulate_inplace: not isTensorSubclassLike), so the two are summed into a new one even
// where lm_head's arrives fresh through autocast's cast: one more [vocab, hidden] gradient alive
// at the embedding's backward. Measured: llama-3.2-1b-w512-l4-tied with --tp 2 and bf16-mixed,
// whose trace adds out of place after embedding_dense_backward on both ranks (the step's peak).
// (Only a parameter's two gradients are summed here; a second micro-batch's is still added into
// .grad in place, as AccumulateGrad adds into a DTensor .grad.)
void Tape::accumulate_param(const ParamGrad& pg, TensorId g) {
  PendingGrad& pending = param_pending_[pg.param];
  ++pending.arrived;
  if (pending.sum == kNone) {
    pending.sum = g;
  } else {
    // Neither part is a .grad unless the sum is in place; the end below names what it becomes.
    recategorize(pending.sum, Category::kTemporaries);
    recategorize(g, Category::kTemporaries);
    pending.sum = buffer_sum(pending.sum, g, trace_.storages[g].bytes, dtensor_params);
  }
  if (pending.arrived < std::max<std::uint32_t>(1, param_uses_[pg.param])) return;
  g = pending.sum;
  pending = PendingGrad{};
  TensorId& slot = param_grads_[pg.param];
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
  const bool defer = defer_routing_;  // a recompute below runs nodes of its own
  defer_routing_ = false;
  if (on_layer_change && n.tag.layer != backward_layer_) {
    const std::int32_t from = backward_layer_;
    backward_layer_ = n.tag.layer;
    on_layer_change(from, n.tag.layer);
  }
  at(Phase::kBackward, n.tag.layer, n.tag.op);
  if (n.output != kNone && n.output == hooked_value && value_grad_[n.output] != kNone) {
    hooked_value = kNone;
    if (on_hooked_value) on_hooked_value();
    at(Phase::kBackward, n.tag.layer, n.tag.op);
  }
  TensorId incoming = n.output == kNone ? kNone : value_grad_[n.output];
  if (n.output != kNone) value_grad_[n.output] = kNone;
  TRAINMEM_ASSERT(n.co_outputs.empty() || !n.recompute, "a checkpoint node with several outputs");
  std::vector<TensorId>& co = node_co_;
  co.clear();
  for (ValueId v : n.co_outputs) {
    if (value_grad_[v] != kNone) co.push_back(value_grad_[v]);
    value_grad_[v] = kNone;
  }
  if (incoming == kNone && n.output != kNone && co.empty()) {
    for (TensorId id : n.saved) release(id);
    for (TensorId id : n.kept) release(id);
    return;
  }
  TRAINMEM_ASSERT(!defer || !n.recompute, "a checkpoint node ends a module whose hook must route its gradients");
  if (n.recompute && n.reentrant) return run_reentrant_checkpoint(n, incoming);
  if (n.recompute && n.tail) return run_checkpoint_with_tail(n, incoming);
  if (n.recompute) {
    // Non-reentrant checkpoint: recompute the segment with saving on, then run its nodes. The
    // recompute appends to nodes_, so take what we need from `n` before it may move.
    auto [recompute, saved, kept, tag] = take_checkpoint(n);
    std::size_t begin = nodes_.size();
    const std::size_t recompute_events = trace_.events.size();
    const T out = recompute_segment(recompute, tag, SIZE_MAX);
    deliver(out.value, incoming);
    // The recompute runs when the first saved tensor is unpacked (torch/utils/checkpoint.py,
    // _checkpoint_hook.unpack_hook): the segment's last nodes that save nothing (a residual add,
    // bitsandbytes' casts and MatMul4Bit, which keeps its weight on ctx) run before it. Their
    // events are moved ahead of the recompute's.
    std::size_t first_saving = nodes_.size();
    while (first_saving > begin && nodes_[first_saving - 1].saved.empty() && !nodes_[first_saving - 1].recompute) {
      --first_saving;
    }
    const std::size_t recomputed_events = trace_.events.size();
    run(first_saving, nodes_.size());
    std::rotate(trace_.events.begin() + static_cast<std::ptrdiff_t>(recompute_events),
                trace_.events.begin() + static_cast<std::ptrdiff_t>(recomputed_events), trace_.events.end());
    const std::size_t lead = run_releasing_frame(begin, first_saving, saved, kept, tag);
    run(begin, lead);
    resize_nodes(begin);
    return;
  }
  // The node's working lists live in the tape (a plain node never re-enters run_node).
  std::vector<TensorId>& scratch = node_scratch_;
  std::vector<TensorId>& grads = node_grads_;
  std::vector<TensorId>& pgrads = node_pgrads_;
  scratch.clear();
  TRAINMEM_ASSERT(n.scratch_freed_early == 0 || n.scratch_freed_early < n.scratch.size(),
                  "scratch_freed_early reaches the last scratch buffer");
  for (std::size_t k = 0; k < n.scratch.size(); ++k) {
    scratch.push_back(alloc_bytes(n.scratch[k], Category::kTemporaries));
    if (k > 0 && k <= n.scratch_freed_early) release(scratch[k - 1]);
  }
  scratch.erase(scratch.begin(), scratch.begin() + n.scratch_freed_early);
  if (n.kernel) n.kernel(n, scratch);
  grads.assign(n.inputs.size(), kNone);
  pgrads.assign(n.params.size(), kNone);
  auto input_grad = [&](std::size_t k) {
    const GradIn& in = n.inputs[k];
    if (in.discard) {
      scratch.push_back(alloc_bytes(in.bytes, Category::kTemporaries));
      return;
    }
    if (in.value == kNone) return;
    if (in.passthrough) {
      retain(incoming);
      grads[k] = incoming;
      if (in.unwrap && is_subclass(incoming)) subclass_[incoming] = false;
    } else if (in.reuse != kNone) {
      retain(in.reuse);
      grads[k] = in.reuse;
    } else {
      grads[k] = alloc_bytes(in.compute_bytes ? in.compute_bytes : in.bytes, Category::kTemporaries);
      if (in.subclass) mark_subclass(grads[k]);
      trace_.storages[grads[k]].view = in.view;
    }
  };
  // The node's function returns: what it alone held goes (See Node::unpacked).
  auto function_returns = [&] {
    if (!n.unpacked) return;
    for (TensorId id : n.saved) release(id);
    n.saved.clear();
  };
  auto param_grad = [&](std::size_t k) {
    const ParamGrad& pg = n.params[k];
    if (pg.reuse != kNone) {
      pgrads[k] = pg.reuse;  // the node holds it until now (see kept)
      retain(pg.reuse);
      return;
    }
    TensorId sc = pg.scratch_bytes ? alloc_bytes(pg.scratch_bytes, Category::kTemporaries) : kNone;
    if (pg.reduced) function_returns();
    bool cast = pg.param_bytes != 0;
    Category c = (!cast && param_grads_[pg.param] == kNone) ? Category::kGradients : Category::kTemporaries;
    pgrads[k] = alloc_bytes(pg.compute_bytes, c);
    trace_.storages[pgrads[k]].view = pg.view;
    if (sc != kNone) release(sc);
  };
  // See Note [Gradient order of a node] in tape.h.
  if (n.grad_order == GradOrder::kParamsFirst) {
    for (std::size_t k = 0; k < n.params.size(); ++k) param_grad(k);
    for (std::size_t k = 0; k < n.inputs.size(); ++k) input_grad(k);
  } else if (n.grad_order == GradOrder::kInputsReversed) {
    for (std::size_t k = n.inputs.size(); k-- > 0;) input_grad(k);
    for (std::size_t k = 0; k < n.params.size(); ++k) param_grad(k);
  } else {
    for (std::size_t k = 0; k < n.inputs.size(); ++k) input_grad(k);
    if (n.grad_order == GradOrder::kParamsReversed) {
      for (std::size_t k = n.params.size(); k-- > 0;) param_grad(k);
    } else {
      for (std::size_t k = 0; k < n.params.size(); ++k) param_grad(k);
    }
  }
  for (TensorId id : scratch) release(id);
  function_returns();
  // validate_outputs, once the node's function has returned (its incoming gradient is still
  // held): a gradient made in another dtype than its input's is cast to it.
  for (std::size_t k = 0; k < n.inputs.size(); ++k) {
    const GradIn& in = n.inputs[k];
    if (in.compute_bytes == 0 || grads[k] == kNone || in.passthrough || in.reuse != kNone || in.discard) continue;
    const TensorId cast = alloc_bytes(in.bytes, Category::kTemporaries);
    if (in.subclass) mark_subclass(cast);
    release(grads[k]);
    grads[k] = cast;
  }
  release(incoming);
  for (TensorId id : co) release(id);
  for (TensorId id : n.saved) release(id);
  for (TensorId id : n.kept) release(id);
  n.saved.clear();
  n.kept.clear();
  // The engine routes the node's gradients into their consumers' input buffers (the sums there)
  // before any other node runs; then the weight's cast back to its parameter dtype and
  // AccumulateGrad run: they have the highest priority in the ready queue (measured: a shared
  // input's sum at gate_proj while gate_proj's weight gradient is alive, in a second micro-batch
  // where AccumulateGrad adds it into .grad and frees it). ParamGrad::param_bytes is such a cast
  // node (Gemma's weight.float()); a cast that validate_outputs makes inside the node would come
  // before the routing, which no node here tells apart (none of them sums what it delivers).
  auto route_inputs = [&] {
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      if (grads[k] == kNone) continue;
      if (defer) {
        deferred_routes_.emplace_back(n.inputs[k].value, grads[k]);
      } else {
        deliver(n.inputs[k].value, grads[k]);
      }
    }
  };
  if (!n.params_routed_first) route_inputs();
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
  if (n.params_routed_first) route_inputs();
}

// A checkpoint's recompute with saving on, up to its early stop (set_checkpoint_early_stop, on by
// default: the recompute ends once the last tensor to be saved is made; what the forward would
// do after it never runs). The recomputed graph then goes, with what it held (hold_with_graph).
// `stop_node`: past_recompute_stop's bound (SIZE_MAX: none).
T Tape::recompute_segment(const std::function<T()>& recompute, const MomentTag& tag, std::size_t stop_node) {
  unpacking_ = true;
  const T out = rerun(recompute, stop_node);
  unpacking_ = false;
  at(Phase::kBackward, tag.layer, tag.op);
  release(out.id);
  stop_recompute_at(last_saving_event_);
  free_recompute_held();
  return out;
}

// A checkpoint's recompute with saving on (recorded as the forward records); its output.
T Tape::rerun(const std::function<T()>& recompute, std::size_t stop_node) {
  last_saving_event_ = trace_.events.size();
  op_begin_event_ = trace_.events.size();
  recompute_stop_node_ = stop_node;
  const bool was = saving;
  saving = true;
  recomputing = true;
  T out = recompute();
  recomputing = false;
  saving = was;
  recompute_stop_node_ = SIZE_MAX;
  return out;
}

// See Note [Reentrant checkpoints] in tape.h.
void Tape::run_reentrant_checkpoint(Node& n, TensorId incoming) {
  const auto [recompute, saved, kept, tag] = take_checkpoint(n);
  const std::size_t begin = nodes_.size();
  retain(incoming);  // CheckpointFunction.backward's args
  const T out = rerun(recompute, SIZE_MAX);
  deliver(out.value, incoming);
  run(begin, nodes_.size());
  resize_nodes(begin);
  at(Phase::kBackward, tag.layer, tag.op);
  free_recompute_held();
  release(out.id);
  release(incoming);
  for (TensorId id : saved) release(id);
  // Kept on ctx (run_function's keyword arguments): the node's references go to the graph.
  graph_held_.insert(graph_held_.end(), kept.begin(), kept.end());
}

// See Note [Checkpoint tails].
void Tape::run_checkpoint_with_tail(Node& n, TensorId incoming) {
  const std::shared_ptr<const CheckpointTail> tail = std::move(n.tail);
  const auto [recompute, saved, kept, tag] = take_checkpoint(n);
  const std::size_t begin = nodes_.size();
  // The tail of the first forward's graph, with its module hooks.
  deliver(tail->output, incoming);
  nodes_.insert(nodes_.end(), tail->nodes.begin(), tail->nodes.end());
  module_begins_at_.resize(begin);
  module_ends_at_.resize(begin);
  module_begins_at_.insert(module_begins_at_.end(), tail->begins.begin(), tail->begins.end());
  module_ends_at_.insert(module_ends_at_.end(), tail->ends.begin(), tail->ends.end());
  run(begin, nodes_.size());
  resize_nodes(begin);
  // The pre-backward hooks on the last saving node's outputs run before it unpacks.
  at(Phase::kBackward, tag.layer, tag.op);
  fire_before_recompute({tail->saving_begins.rbegin(), tail->saving_begins.rend()});
  recompute_segment(recompute, tag, begin + tail->saving_nodes);
  TRAINMEM_ASSERT(nodes_.size() - begin == tail->outputs.size(), "a recompute recorded other nodes than its forward");
  // What the tail handed to the first forward's values goes to the recomputed ones.
  for (std::size_t k = 0; k < tail->saving_nodes; ++k) {
    const ValueId first = tail->outputs[k];
    if (first == kNone || value_grad_[first] == kNone) continue;
    const TensorId g = value_grad_[first];
    value_grad_[first] = kNone;
    deliver(nodes_[begin + k].output, g);
  }
  // The recomputed tail never runs: the first forward's ran above.
  for (std::size_t k = begin + tail->saving_nodes; k < nodes_.size(); ++k) {
    for (TensorId id : nodes_[k].saved) release(id);
    for (TensorId id : nodes_[k].kept) release(id);
    nodes_[k].saved.clear();
    nodes_[k].kept.clear();
  }
  // The frame goes as without a tail (measured: ZeRO-3 QLoRA under checkpointing, a layer's bf16
  // input freed at input_layernorm's pow).
  const std::size_t end = begin + tail->saving_nodes;
  const std::size_t lead = run_releasing_frame(begin, end, saved, kept, tag);
  run(begin, lead);
  resize_nodes(begin);
}

// Runs a checkpointed segment's nodes [lead, end) in backward, lead being the first that saves.
// The checkpoint's frame holds its inputs (the recompute's arguments) while any saved tensor's
// unpack hook can still need it: the hooks live in the saving nodes' SavedVariables, so the frame
// goes when the segment's first saving node releases its variables, once its function and
// validate_outputs are done and before its gradients are summed into their buffers (measured: a
// Qwen3 layer's input under bf16-mixed, freed before input_layernorm's cast back; under TP a
// Llama layer's fp32 input, freed before the replicated norm's DTensor sum). The recompute
// closure's keyword arguments go with it: the frame's tensors join that node's `kept`, which it
// releases there. Returns lead; the nodes before it, which save nothing, are the caller's to run.
template <class Saved, class Kept>
std::size_t Tape::run_releasing_frame(std::size_t begin, std::size_t end, const Saved& saved, const Kept& kept,
                                      const MomentTag& tag) {
  std::size_t lead = begin;
  while (lead < end && nodes_[lead].saved.empty() && !nodes_[lead].recompute) ++lead;
  const bool on_lead = lead < end && !nodes_[lead].recompute;
  if (on_lead) {
    for (TensorId id : saved) nodes_[lead].kept.push_back(id);
    for (TensorId id : kept) nodes_[lead].kept.push_back(id);
  }
  run(lead, end);
  if (!on_lead) {  // no saving node of its own (a nested checkpoint first): after the run
    at(Phase::kBackward, tag.layer, tag.op);
    for (TensorId id : saved) release(id);
    for (TensorId id : kept) release(id);
  }
  return lead;
}

void Tape::run(std::size_t begin, std::size_t end) {
  for (std::size_t i = end; i-- > begin;) {
    if (i < module_begins_at_.size() && !module_begins_at_[i].empty()) {
      at(Phase::kBackward, nodes_[i].tag.layer, nodes_[i].tag.op);
      const std::vector<std::uint32_t> outer_first(module_begins_at_[i].rbegin(), module_begins_at_[i].rend());
      for (std::uint32_t m : outer_first) {
        // Fired already, before the recompute that recorded this node (recompute_hooks).
        auto early = std::find(fired_before_recompute_.begin(), fired_before_recompute_.end(), m);
        if (early != fired_before_recompute_.end()) {
          fired_before_recompute_.erase(early);
          continue;
        }
        on_module_backward(m, true);
      }
    }
    // run_node may grow nodes_ and the module lists (a recompute) and shrink them again.
    std::vector<std::uint32_t> ends;
    if (i < module_ends_at_.size()) ends = module_ends_at_[i];
    const std::size_t routes = deferred_routes_.size();
    defer_routing_ = route_after_module_ends && !ends.empty();
    run_node(nodes_[i]);
    for (std::uint32_t m : ends) on_module_backward(m, false);
    for (std::size_t k = routes; k < deferred_routes_.size(); ++k) deliver(deferred_routes_[k].first, deferred_routes_[k].second);
    deferred_routes_.resize(routes);
  }
}

void Tape::backward(ValueId root) { backward(root, kNone, kNone, nullptr); }

void Tape::backward(ValueId root, TensorId grad, ValueId keep_leaf, TensorId* kept) {
  // The seed gradient of the scalar loss (torch.ones_like(loss)), or the caller's gradient.
  // torch.autograd.backward holds it in its grad_tensors for the whole call, so it outlives the
  // first node.
  param_uses_.assign(param_grads_.size(), 0);
  param_pending_.assign(param_grads_.size(), {});
  for (const Node& n : nodes_) {
    for (const ParamGrad& pg : n.params) ++param_uses_[pg.param];
  }
  if (!ranges_.empty()) count_range_uses();
  backward_layer_ = -1;
  TensorId seed = grad;
  if (seed == kNone) {
    seed = alloc_bytes(4, Category::kTemporaries);
  } else {
    retain(seed);  // the caller's reference stays: never summed into in place
  }
  retain(seed);
  deliver(root, seed);
  if (stamp_backward && !ranges_.empty()) {
    run_ranges();  // See Note [Stamped layer backwards]
  } else {
    run(0, nodes_.size());
  }
  if (on_layer_change && backward_layer_ != -1) on_layer_change(backward_layer_, -1);
  if (on_final_callbacks) on_final_callbacks();
  release(seed);
  resize_nodes(0);
  if (kept != nullptr) {
    *kept = kNone;
    if (keep_leaf != kNone && value_grad_[keep_leaf] != kNone) {
      *kept = value_grad_[keep_leaf];  // AccumulateGrad steals it into the leaf's .grad
      value_grad_[keep_leaf] = kNone;
    }
  }
  for (TensorId& g : value_grad_) {
    if (g != kNone) {
      release(g);  // gradients of leaves that need none (e.g. input embeddings) end here
      g = kNone;
    }
  }
  value_grad_.clear();
  value_bytes_.clear();
  subclass_.clear();
}

Graph Tape::take_graph() {
  TRAINMEM_ASSERT(open_modules_.empty(), "take_graph inside a module's forward");
  TRAINMEM_ASSERT(ranges_.empty(), "take_graph with stamped layers' nodes in their spans");
  Graph g;
  g.nodes = std::move(nodes_);
  g.module_begins_at = std::move(module_begins_at_);
  g.module_ends_at = std::move(module_ends_at_);
  g.value_grad = std::move(value_grad_);
  g.value_bytes = std::move(value_bytes_);
  g.subclass = std::move(subclass_);
  nodes_.clear();
  module_begins_at_.clear();
  module_ends_at_.clear();
  value_grad_.clear();
  value_bytes_.clear();
  subclass_.clear();
  return g;
}

void Tape::put_graph(Graph&& g) {
  TRAINMEM_ASSERT(nodes_.empty() && value_grad_.empty() && open_modules_.empty(), "put_graph onto a recording tape");
  nodes_ = std::move(g.nodes);
  module_begins_at_ = std::move(g.module_begins_at);
  module_ends_at_ = std::move(g.module_ends_at);
  value_grad_ = std::move(g.value_grad);
  value_bytes_ = std::move(g.value_bytes);
  subclass_ = std::move(g.subclass);
}

Trace Tape::take() {
  TRAINMEM_ASSERT(graph_held_.empty() && recompute_held_.empty(), "a graph's held storages were never freed");
  return std::move(trace_);
}

}  // namespace trainmem::graph
