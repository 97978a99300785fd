// The tape: a small mirror of PyTorch's autograd engine that turns the forward code of a model
// into allocator events.
//
// Note [Mirroring autograd]
// The forward builders (step.cpp) are written like the Hugging Face modules they mirror: each
// op allocates its output, drops Python references when the real code's variables die, and
// records a backward node with what autograd saves for it. Backward then replays the engine:
//  * nodes run in reverse creation order. PyTorch's ready queue orders by sequence number and a
//    node only becomes ready after all later-created consumers ran, so for the graphs built
//    here this is exactly the real order (torch/csrc/autograd/engine.cpp);
//  * a node allocates the gradients of its inputs (or passes its incoming gradient through, for
//    adds and views), then its incoming gradient is dropped and its saved tensors released
//    (evaluate_function → release_variables);
//  * gradients arriving at a tensor used twice are summed in place when one side is exclusively
//    owned (InputBuffer::accumulate), otherwise into a new tensor;
//  * a parameter's first gradient is stolen into .grad, later ones are added in place
//    (AccumulateGrad).
// Categories are final per storage: a temporary that a node saves becomes an activation for
// its whole life, as the measuring side also counts it.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "trainmem/trainmem.h"

namespace trainmem::graph {

using TensorId = std::uint32_t;
using ValueId = std::uint32_t;
inline constexpr std::uint32_t kNone = UINT32_MAX;

struct Storage {
  std::uint64_t bytes = 0;
  Category category = Category::kTemporaries;
  std::uint32_t refs = 0;
};

struct Event {
  TensorId tensor;
  std::uint32_t moment;
  bool alloc;
};

struct MomentTag {
  std::uint32_t step = 0;
  std::uint32_t micro = 0;
  Phase phase = Phase::kSetup;
  std::int32_t layer = -1;
  std::string_view op;  // static strings only
  bool recompute = false;  // a checkpointed layer's forward, re-run during backward
};

// What the graph stage hands to the simulator.
struct Trace {
  std::vector<Storage> storages;
  std::vector<Event> events;
  std::vector<MomentTag> moments;
  std::uint64_t trainable_parameters = 0;  // elements the optimizer updates
};

// Hands a finished trace's buffers to the next Tape made on this thread: an estimate's tens of
// thousands of events then reuse memory instead of fresh (kernel-zeroed) pages.
void recycle(Trace&& trace);

// A tensor as Python code holds it: a reference to a storage (views share it) plus, when it
// requires grad, its autograd identity.
struct T {
  TensorId id = kNone;
  std::uint64_t numel = 0;
  DType dtype = DType::kF32;
  ValueId value = kNone;
  // Attention tensors: logically [b, heads, s, d] but laid out as [b, s, heads, d] (a view of a
  // projection output). See Note [Attention layouts] in step.cpp.
  bool bshd = false;
  std::uint64_t bytes() const { return numel * dtype_bytes(dtype); }
  bool requires_grad() const { return value != kNone; }
};

struct GradIn {
  ValueId value = kNone;
  std::uint64_t bytes = 0;   // size of the gradient the node allocates for this input
  bool passthrough = false;  // the node hands on its incoming gradient (add, view, no-op)
  TensorId reuse = kNone;    // the gradient is this existing storage (computed in the forward)
  // The kernel computes this input's gradient although the input does not require grad (a
  // fused backward with one output per input): allocated with the others, then dropped
  // inside the node (value is kNone).
  bool discard = false;
};

struct ParamGrad {
  std::uint32_t param = kNone;
  std::uint64_t compute_bytes = 0;  // the gradient as the op computes it
  std::uint64_t scratch_bytes = 0;  // e.g. the full-size product before a broadcast reduction
  std::uint64_t param_bytes = 0;    // after the cast to the parameter dtype; 0 when no cast
  TensorId reuse = kNone;           // the gradient is this existing storage (made in the forward)
};

struct Node {
  MomentTag tag;
  ValueId output = kNone;
  std::vector<TensorId> saved;
  std::vector<TensorId> kept;  // referenced until the node runs, but not saved by autograd
  std::vector<GradIn> inputs;
  std::vector<std::uint64_t> scratch;  // transient buffers alive while the node runs
  std::vector<ParamGrad> params;
  // Checkpointed segments: re-runs the forward (recording nodes) and returns the recomputed
  // output whose gradient is the checkpoint's incoming gradient.
  std::function<T()> recompute;
};

class Tape {
 public:
  Tape();

  // ---- where we are (labels every event until changed) ----
  std::uint32_t step = 0;
  std::uint32_t micro = 0;
  bool recomputing = false;
  void at(Phase phase, std::int32_t layer, std::string_view op);
  Phase phase() const { return tag_.phase; }

  // ---- storages ----
  T make(std::uint64_t numel, DType dtype, Category category = Category::kTemporaries);
  TensorId alloc_bytes(std::uint64_t bytes, Category category);
  void retain(TensorId id);
  void release(TensorId id);
  T ref(const T& t) {
    retain(t.id);
    return t;
  }
  void drop(T& t) {
    release(t.id);
    t.id = kNone;
  }
  // A storage made without memory, and its memory freed and allocated again whatever references
  // it has: untyped_storage().resize_(0) / resize_(n), as FSDP2 does with its unsharded
  // parameters (Note [FSDP2 units] in parallel.cpp). The caller keeps track of which it is.
  TensorId reserve(std::uint64_t bytes, Category category);
  void resize(TensorId id, bool allocated);
  Category category(TensorId id) const { return trace_.storages[id].category; }
  void set_category(TensorId id, Category c);
  // Called at each micro-batch boundary, where sim::Replay reads the events so far: from then on
  // the storages allocated before keep their categories (a change asserts).
  void seal_categories() { sealed_storages_ = static_cast<TensorId>(trace_.storages.size()); }

  // ---- autograd ----
  ValueId new_value(std::uint64_t grad_bytes);
  // False inside a checkpointed forward: nodes are recorded without keeping saved tensors.
  bool saving = true;
  void record(Node node);
  std::size_t node_count() const { return nodes_.size(); }
  // Forgets nodes recorded since `n` (a checkpointed forward's graph, replaced by one node).
  void truncate_nodes(std::size_t n) { nodes_.resize(n); }

  // Parameters' .grad slots.
  std::uint32_t new_param(TensorId storage);
  TensorId param_grad(std::uint32_t p) const { return param_grads_[p]; }
  void set_param_grad(std::uint32_t p, TensorId g) { param_grads_[p] = g; }
  std::uint32_t param_count() const { return static_cast<std::uint32_t>(param_grads_.size()); }

  // Data-parallel wrappers' hooks (graph/parallel.h): after a parameter's AccumulateGrad, and
  // when backward moves from one decoder layer's nodes to another's (-1: outside the layers).
  std::function<void(std::uint32_t slot)> on_param_ready;
  std::function<void(std::int32_t from, std::int32_t to)> on_layer_change;

  // Runs backward from `root` (a scalar) and clears the recorded graph.
  void backward(ValueId root);

  Trace take();
  const Trace& trace() const { return trace_; }  // what has been built so far

 private:
  void run(std::size_t begin, std::size_t end);
  void run_node(Node& n);
  void deliver(ValueId v, TensorId g);
  void accumulate_param(const ParamGrad& pg, TensorId g);

  void recategorize(TensorId id, Category c);

  Trace trace_;
  TensorId sealed_storages_ = 0;  // storages below this id keep their categories
  MomentTag tag_;
  std::uint32_t moment_ = 0;
  std::vector<Node> nodes_;
  std::int32_t backward_layer_ = -1;  // the layer of the last node run (on_layer_change)
  std::vector<TensorId> value_grad_;
  std::vector<std::uint64_t> value_bytes_;
  std::vector<TensorId> param_grads_;
  // A parameter used by several nodes (a tied embedding) has one AccumulateGrad node whose
  // input buffer collects every gradient of the pass before it runs.
  std::vector<std::uint32_t> param_uses_;
  std::vector<std::vector<TensorId>> param_pending_;
};

}  // namespace trainmem::graph
