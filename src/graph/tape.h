// The tape: a small mirror of PyTorch's autograd engine that turns the forward code of a model
// into allocator events.
//
// Note [Mirroring autograd]
// The forward builders (step_modules.cpp, generation.cpp) are written like the Hugging Face
// modules they mirror: each op allocates its output, drops Python references when the real
// code's variables die, and records a backward node with what autograd saves for it. Backward
// then replays the engine:
//  * nodes run in reverse creation order. PyTorch's ready queue orders by sequence number and a
//    node only becomes ready after all later-created consumers ran, so for the graphs built
//    here this is exactly the real order (torch/csrc/autograd/engine.cpp);
//  * a node allocates the gradients of its inputs (or passes its incoming gradient through, for
//    adds and views), then its incoming gradient is dropped and its saved tensors released
//    (evaluate_function → release_variables);
//  * gradients arriving at a tensor used twice are summed in place into the one already buffered
//    when that one is exclusively owned (InputBuffer::accumulate), otherwise into a new tensor
//    (never into the arriving one: until 2026-12-06 the engine did that too, which no measured
//    peak told apart; the reentrant checkpoint's held gradient shows the new tensor in traces);
//    never into a view whose base lives on (Storage::view); a tied parameter's too. The
//    measuring side's dispatch mode would make every sum out of place; its tracker puts autograd's
//    own decision back (Note [Summing gradients] in python/trainmem/measure/tracker.py);
//  * a parameter's first gradient is stolen into .grad, later ones are added in place
//    (AccumulateGrad).
// Categories are final per storage: a temporary that a node saves becomes an activation for
// its whole life, as the measuring side also counts it.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <new>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/checked.h"
#include "trainmem/trainmem.h"

namespace trainmem::graph {

using TensorId = std::uint32_t;
using ValueId = std::uint32_t;
inline constexpr std::uint32_t kNone = UINT32_MAX;

// A vector of trivially copyable values that keeps its first N in place: a node's lists
// (saved tensors, inputs, scratch buffers, parameters) hold a handful of entries, and with a
// std::vector each was a heap allocation per node, about an eighth of an estimate's time in
// malloc and free. Only what the node code uses is offered.
template <typename V, std::size_t N>
class SmallVec {
  static_assert(std::is_trivially_copyable_v<V>);

 public:
  SmallVec() = default;
  SmallVec(std::initializer_list<V> il) { assign(il.begin(), il.end()); }
  // A copy of a list in its inline buffer is one fixed-size copy (stamped layers copy every node:
  // Note [Stamped decoder layers]).
  SmallVec(const SmallVec& o) {
    if (o.heap_) {
      assign(o.begin(), o.end());
    } else {
      std::memcpy(inline_.v, o.inline_.v, sizeof(inline_.v));
      size_ = o.size_;
    }
  }
  SmallVec(SmallVec&& o) noexcept { take(o); }
  SmallVec& operator=(const SmallVec& o) {
    if (this != &o) assign(o.begin(), o.end());
    return *this;
  }
  SmallVec& operator=(SmallVec&& o) noexcept {
    if (this != &o) {
      if (heap_) std::free(heap_);
      heap_ = nullptr;
      take(o);
    }
    return *this;
  }
  SmallVec& operator=(std::initializer_list<V> il) {
    assign(il.begin(), il.end());
    return *this;
  }
  // Most lists never leave their inline buffer: no call into free() for them (a node's five
  // lists are destroyed twice per node, once moved from and once after its backward).
  ~SmallVec() {
    if (heap_) std::free(heap_);
  }

  V* data() noexcept { return heap_ ? heap_ : inline_.v; }
  const V* data() const noexcept { return heap_ ? heap_ : inline_.v; }
  V* begin() noexcept { return data(); }
  V* end() noexcept { return data() + size_; }
  const V* begin() const noexcept { return data(); }
  const V* end() const noexcept { return data() + size_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  V& operator[](std::size_t i) noexcept { return data()[i]; }
  const V& operator[](std::size_t i) const noexcept { return data()[i]; }
  void clear() noexcept { size_ = 0; }

  void push_back(const V& v) {
    if (size_ == cap_) {
      const V copy = v;  // v may live in this vector
      grow(size_ + 1);
      data()[size_++] = copy;
      return;
    }
    data()[size_++] = v;
  }
  template <typename It>
  void assign(It first, It last) {
    clear();
    for (; first != last; ++first) push_back(*first);
  }
  V* insert(V* pos, std::initializer_list<V> il) {
    const std::size_t at = static_cast<std::size_t>(pos - data());
    const std::size_t n = il.size();
    if (size_ + n > cap_) grow(size_ + n);
    V* d = data();
    std::memmove(d + at + n, d + at, (size_ - at) * sizeof(V));
    std::memcpy(d + at, il.begin(), n * sizeof(V));
    size_ += n;
    return d + at;
  }

 private:
  void grow(std::size_t want) {
    std::size_t cap = cap_ * 2;
    if (cap < want) cap = want;
    V* h = static_cast<V*>(std::malloc(cap * sizeof(V)));
    if (!h) throw std::bad_alloc();
    std::memcpy(h, data(), size_ * sizeof(V));
    if (heap_) std::free(heap_);
    heap_ = h;
    cap_ = cap;
  }
  void take(SmallVec& o) noexcept {
    size_ = o.size_;
    cap_ = o.cap_;
    if (o.heap_) {
      heap_ = o.heap_;
      o.heap_ = nullptr;
    } else {
      // The whole inline buffer, a constant size: a few moves instead of a memcpy call (a node
      // is moved twice on its way into the tape). Entries past size_ are never read.
      std::memcpy(inline_.v, o.inline_.v, sizeof(inline_.v));
    }
    o.size_ = 0;
    o.cap_ = N;
  }

  V* heap_ = nullptr;
  std::size_t size_ = 0;
  std::size_t cap_ = N;
  // Left uninitialised: entries past size_ are never read, and the entry types' default member
  // initializers would otherwise run for every slot of every node made or copied.
  union Inline {
    Inline() {}
    V v[N];
  } inline_;
};

struct Storage {
  std::uint64_t bytes = 0;
  Category category = Category::kTemporaries;
  // A gradient handed over as a view of what its op computed, whose base lives on with it:
  // autograd's input buffer never sums into it in place (GradIn::view, ParamGrad::view).
  bool view = false;
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
  HostMemory host;                         // CPU offload's host memory (Note [ZeRO-Offload])
  // A storage's category changed after a peek inside a schedule let the replay read it (Note
  // [Peeks inside a schedule] in graph/pipeline.cpp).
  bool stale_categories = false;
};

// Hands a finished trace's buffers to the next Tape made on this thread: an estimate's tens of
// thousands of events then reuse memory instead of fresh (kernel-zeroed) pages.
void recycle(Trace&& trace);

// Layer backwards stamped, and captured to be stamped, on this thread so far (Note [Stamped
// layer backwards]).
std::uint64_t stamped_backwards();
std::uint64_t captured_backwards();

// A tensor as Python code holds it: a reference to a storage (views share it) plus, when it
// requires grad, its autograd identity.
struct T {
  TensorId id = kNone;
  std::uint64_t numel = 0;
  DType dtype = DType::kF32;
  ValueId value = kNone;
  // Attention tensors: logically [b, heads, s, d] but laid out as [b, s, heads, d] (a view of a
  // projection output). See Note [Attention layouts] in step_modules.cpp.
  bool bshd = false;
  // A broadcast view (repeat_kv of one key/value head: expand gives the heads stride 0), whose
  // numel is the logical one; it owns no more memory than its base.
  bool expanded = false;
  std::uint64_t bytes() const { return numel * dtype_bytes(dtype); }
  bool requires_grad() const { return value != kNone; }
};

struct GradIn {
  ValueId value = kNone;
  std::uint64_t bytes = 0;   // size of the gradient the node allocates for this input
  bool passthrough = false;  // the node hands on its incoming gradient (add, view, no-op)
  TensorId reuse = kNone;    // the gradient is this existing storage (computed in the forward,
                             // or by the node's kernel)
  // The kernel computes this input's gradient although the input does not require grad (a
  // fused backward with one output per input): allocated with the others, then dropped
  // inside the node (value is kNone).
  bool discard = false;
  // The gradient is a tensor subclass (a DTensor: Note [Sequence parallelism] in
  // tensor_parallel.h): never accumulated into in place, nor is a sum with it.
  bool subclass = false;
  // With `passthrough`: the node hands on its incoming gradient's local tensor (DTensor.from_local's
  // backward, `to_local()` of a gradient whose placement is already the input's), a plain tensor
  // however the gradient arrived.
  bool unwrap = false;
  // The gradient is a view whose base lives on (Storage::view): a linear's input gradient,
  // mm's output reshaped back to the input's shape.
  bool view = false;
  // Nonzero: the formula computes the gradient in another dtype, this size, and the engine's
  // validate_outputs casts it to the input's (`bytes`) once the node's gradients are all made.
  std::uint64_t compute_bytes = 0;
};

struct ParamGrad {
  std::uint32_t param = kNone;
  std::uint64_t compute_bytes = 0;  // the gradient as the op computes it
  std::uint64_t scratch_bytes = 0;  // e.g. the full-size product before a broadcast reduction
  std::uint64_t param_bytes = 0;    // after the cast to the parameter dtype; 0 when no cast
  TensorId reuse = kNone;           // the gradient is this existing storage (made in the forward)
  // Handed over as a view whose base lives on (Storage::view): F.linear's weight gradient, mm's
  // output transposed back.
  bool view = false;
  // Summed from a broadcast gradient by validate_outputs, once the node's function has returned:
  // addmm's bias, a norm's weight (its full-size product is `scratch_bytes`).
  bool reduced = false;
};

// Note [Gradient order of a node]
// A backward node makes its gradients in the order its autograd function computes them, which
// decides where the caching allocator puts them (reserved bytes), not the peak: all of them are
// made before anything is freed. Measured on CPU traces (trainmem-measure --trace, torch 2.13):
//  * most nodes: the inputs' gradients, then the parameters' (kInputsFirst);
//  * a product of two tensors (MulBackward0, BmmBackward0): the second operand's gradient, then
//    the first's, as the generated Functions.cpp computes them (kInputsReversed; measured:
//    GPT-2's gelu_new, whose `0.5 * x * (1 + tanh(...))` hands the tanh branch its gradient
//    first);
//  * nn.Linear without a bias (matmul folded into mm: Llama's, Mistral's, Qwen3's projections,
//    lm_head, LoRA's adapters): the weight's gradient, then the input's (kParamsFirst);
//  * a linear with a bias (addmm: Qwen2's q/k/v, GPT-2's Conv1D): the input's gradient, the
//    weight's, then the bias's reduction of the incoming gradient (kParamsReversed: the params
//    are listed bias first, the order their AccumulateGrad hooks run in, Note [DDP buckets]).
// The accumulation into .grad follows the params' order in every case. A weight (and bias) cast
// by autocast is not a parameter of the matmul's node but an input, in the same place in that
// order: its gradient goes to the cast's own node, which casts and accumulates it (Note
// [Autocast's weight casts] in step_modules.cpp).
// The gradients are delivered to their inputs in the inputs' order whatever the order of making
// them (the engine's evaluate_function walks the outputs by index).
enum class GradOrder : std::uint8_t { kInputsFirst, kInputsReversed, kParamsFirst, kParamsReversed };

struct CheckpointTail;

struct Node {
  MomentTag tag;
  ValueId output = kNone;
  SmallVec<TensorId, 6> saved;
  SmallVec<TensorId, 4> kept;  // referenced until the node runs, but not saved by autograd
  SmallVec<GradIn, 3> inputs;
  // A multi-output op's other outputs (split's pieces after the first, `output`): the node runs
  // once, taking the gradients of all of them, and frees them in that order after making its own.
  SmallVec<ValueId, 2> co_outputs;
  SmallVec<std::uint64_t, 5> scratch;  // transient buffers alive while the node runs
  // The first this many scratch buffers each die as soon as the next one is made, before the
  // gradients are allocated (bitsandbytes' fp32 absmax, freed once the weight is dequantized,
  // and that weight, freed once its cast to the gradient's dtype is made).
  std::uint32_t scratch_freed_early = 0;
  SmallVec<ParamGrad, 2> params;
  // Recorded by a non-reentrant checkpoint's recompute: its saved tensors reach it through the
  // checkpoint's unpack hook, which lets go of each as it hands it over, so the node's function
  // holds the last references and they go when it returns, before validate_outputs' reductions
  // and casts (measured: GPT-2's c_proj bias and Gemma-2's norm weights under checkpointing).
  bool unpacked = false;
  GradOrder grad_order = GradOrder::kInputsFirst;
  // The parameters' AccumulateGrad run before the inputs' gradients reach their consumers' buffers
  // (where they may be summed): F.linear with a bias on a 3-D input reshapes the input before it
  // transposes the weight (_flatten_nd_linear), so the weight's TBackward outranks the input's
  // view in the ready queue, and the bias's AccumulateGrad outranks both (measured: Qwen2's q/k/v
  // in a second micro-batch, both .grad sums before k's and v's input gradients are summed).
  bool params_routed_first = false;
  // A custom autograd Function (ZeRO-3's LinearFunctionForZeroStage3): what its forward saves is
  // packed when the forward has returned, so a recompute's early stop there comes after the
  // op's outputs were made (measured: ZeRO-3 with checkpointing, down_proj's output made and
  // dropped in the recompute).
  bool saves_after_forward = false;
  // Checkpointed segments: re-runs the forward (recording nodes) and returns the recomputed
  // output whose gradient is the checkpoint's incoming gradient.
  std::function<T()> recompute;
  // With `recompute`: torch.utils.checkpoint's reentrant variant (Note [Reentrant checkpoints]).
  bool reentrant = false;
  // With `recompute` under module hooks: the nodes its backward runs before the recompute (See
  // Note [Checkpoint tails]).
  std::shared_ptr<const CheckpointTail> tail;
  // A backward whose own allocations are a sequence (context parallelism's ring: Note [Context
  // parallelism] in context_parallel.h): runs after the scratch buffers are made and before the
  // gradients; it may point inputs' `reuse` at storages it made, and what it leaves in `left`
  // is released with the scratch buffers.
  std::function<void(Node& n, std::vector<TensorId>& left)> kernel;
};

// Note [Checkpoint tails]
// A non-reentrant checkpoint recomputes its segment when backward first unpacks a saved tensor,
// at the segment's last node that saves (in forward order). The nodes after it save nothing (a
// residual add, casts, bitsandbytes' MatMul4Bit, which keeps its weight on ctx): they run before
// the recompute, and the recompute stops early once the last saved tensor is made, so it never
// enters the modules after that point. Where module hooks act on memory (DeepSpeed ZeRO-3's
// fetches and releases), their order matters: a 4-bit projection at the end of a layer is
// gathered, runs its backward and is released before the recompute gathers the layer again, and
// the recompute's gathers are owned by the module then innermost in backward (Note [LoRA under
// ZeRO-3] in zero3.cpp). So under hooks a checkpoint keeps the tail of its first forward's graph
// (Tape::take_tail): its backward runs those nodes with their hooks, then the recompute (whose
// module hooks past the stop do not fire: Tape::past_recompute_stop), hands the gradients the
// tail left on the forward's values to the recomputed ones (the recompute records the same nodes
// in the same order) and runs the recomputed nodes up to the last saving one. Without hooks the
// tail's events are the recomputed tail's, moved ahead of the recompute's (Tape::run_node).
struct CheckpointTail {
  std::vector<Node> nodes;  // the first forward's nodes after its last saving one
  std::vector<std::vector<std::uint32_t>> begins, ends;  // their module hooks
  std::vector<std::uint32_t> saving_begins;  // the hooks that begin at the last saving node
  ValueId output = kNone;       // the segment's output in the first forward
  std::vector<ValueId> outputs;  // every node's output in the first forward, by index in the segment
  std::size_t saving_nodes = 0;  // the segment's nodes up to and including the last saving one
};

// Note [Reentrant checkpoints]
// torch.utils.checkpoint with use_reentrant=True is an autograd Function (CheckpointFunction):
// its forward runs the segment under no_grad and saves the positional tensor arguments; its
// backward recomputes the whole segment under enable_grad and runs torch.autograd.backward on
// the recomputed outputs with the incoming gradients, then returns the inputs' gradients. Against
// the non-reentrant variant (Note [Checkpoint tails]) that means, measured on CPU traces with
// torch 2.13 (data/ground_truth, `ckptre` entries):
//  * the recompute runs first and to the end: no node runs before it, nothing stops it early,
//    and the recomputed output stays alive (the Function's `outputs`) until the backward returns;
//  * the incoming gradient stays alive as well (the Function's `args`), so no gradient is summed
//    into it in place: the sum at the residual stream is a new tensor;
//  * what the Function keeps on ctx besides saved tensors (run_function: the layer's keyword
//    arguments, the rotary tables, the mask, the position ids) lives as long as the graph, not
//    until the node runs.
// The forward allocates what the non-reentrant one does (no_grad saves nothing either: Note
// [Forwards without saves]). Under DDP
// (without find_unused_parameters, with which torch fails) the Reducer's hooks fire as the inner
// backward accumulates each parameter, in the same order: measured exact on two ranks.

// Note [Forwards without saves]
// A checkpoint's first forward keeps no saved tensors (non-reentrant: the saved-tensor hooks drop
// them; reentrant: no_grad). A tensor then lives exactly as long as Python references it, and
// the modules' locals decide where a saving forward's saves hid it (measured, narrowed Gemma-2
// and Phi-3 with `full`, Llama-family and Qwen3 with `full-reentrant`, GPT-2 with both):
//  * attention: the projections' outputs, rotated q and k and the value states live until the
//    attention module returns, after o_proj;
//  * eager attention: repeat_kv's copies until the attention function returns, the scores until
//    the probabilities replace them, the probabilities (the layer's `_`) to the layer's end;
//  * Phi-3's MLP: the gate_up output (the `gate` chunk's storage) until the MLP returns;
//  * SDPA on the CPU with dropout: the math kernel's own locals (math_kernel, the same in every
//    forward); GPT-2's block holding eager attention's returned weights to its end.
// A saving forward follows the same rule wherever its saves do not hide it, so the engine applies
// it always: the modules' locals (attention_module, mlp_module, decoder_layer_module) and both
// eager attention paths (measured: eager Llama under bf16-mixed, where bmm saves casts and the
// names alone hold the scores and probabilities).

// A recorded autograd graph taken off the tape (Tape::take_graph), to be put back before its
// backward runs (Tape::put_graph): a pipeline stage keeps several micro-batches' graphs alive at
// once and runs their backwards in the schedule's order (Note [Pipeline parallelism] in
// pipeline.cpp). Its values are numbered within the graph.
struct Graph {
  std::vector<Node> nodes;
  std::vector<std::vector<std::uint32_t>> module_begins_at, module_ends_at;
  std::vector<TensorId> value_grad;
  std::vector<std::uint64_t> value_bytes;
  std::vector<bool> subclass;
};

// Note [Stamped decoder layers]
// A decoder layer's forward records the same storages, events, moments, values and nodes in
// every layer of a plain model: only the ids differ (new ones, the layer's input, its
// parameters) and the layer number in the tags. The step builder records one layer as usual
// and captures that span of the tape (Tape::capture); a later layer whose inputs are the same
// is appended from the capture with its ids shifted and its outside storages, values and
// parameter slots substituted (Tape::stamp), which gives the trace, refcounts, categories and
// nodes that building it gives: backward then runs over the stamped nodes as over built ones.
// What may differ between the two layers is what the builder checks (step_stamp.cpp); what the
// tape checks is that the captured span touched nothing it cannot reproduce:
//  * no event names a storage made before the span, and no event has a moment from before it;
//  * every older storage whose references or category changed is one of the caller's outside
//    storages (the layer's input, the rotary tables, the layer's parameters, ...): the stamp
//    applies the same change to the stamped layer's one, which must hold at least as many
//    references as the captured one did (then none reaches zero inside the layer either) and
//    have the same category;
//  * nodes have no closures (checkpoint recomputes, context parallelism's kernels), and name
//    only storages, values and parameter slots the span made or the caller listed;
//  * nothing else of the tape changed (parameter slots, module lists, tensor subclasses), and
//    neither a checkpoint's recompute nor a non-saving forward was running.
// A span that fails a check is not captured, and the layer after it is built.
//
// Note [Stamped layer backwards]
// Backward runs a stamped layer's nodes (and those of the layer its template was captured
// from) as one contiguous range of the node list, and what that range does depends, besides
// the nodes themselves (the template's, renamed), only on this state when it starts:
//  * which of the layer's values hold a gradient, and which storage: at least the layer's
//    output, whose incoming gradient was made by the layer above (or the final norm);
//  * the references, category and view flag of every storage older than the range that its
//    nodes name or its values hold (the layer's saved activations, the rotary tables and the
//    mask it saved, its input, its parameters' storages, the incoming gradient). run_node reads a
//    storage's references only to see them reach zero (release) or be 1 (deliver's in-place
//    sums), and within a node it retains before it releases, so if the lowest count a storage
//    reaches at a node boundary is 2 or more, every such test fails for any count at least as
//    high (the rotary tables: every layer saves them, so their count differs in every layer but
//    reaches zero only in layer 0). Storages that do come down to 0 or 1 must match exactly;
//  * each parameter slot's `.grad` (empty: the gradient is stolen; set: it is added and freed),
//    how many nodes of the pass use the parameter, and nothing pending for it;
//  * the gradient sizes of the outside values (a sum into the layer's input allocates one).
// The first backward of a range whose state matches none captured so far is run node by node
// and captured (Tape::capture_backward: its new storages, events and moments, the older
// storages' changes, the values' and slots' gradients as the range leaves them); a later range
// of the same template whose start state matches one (Tape::stamp_backward) is appended from it
// with its ids. Recipes with data-parallel hooks that act on the backward (on_param_ready,
// on_layer_change, on_module_backward) do not stamp backwards (Tape::stamp_backward stays
// false), nor do tensor subclasses or closures (the forward stamp refuses those anyway).
struct TapeBackward {
  // Names of older storages: an id relative to the forward span, TapeSpan::kOutside | slot of
  // the outside storages, or kHeld | value name (the storage that value holds at the start).
  // Value names: the span's values, then its outside values. In values and slots, kOlder | i is
  // older storage i, anything else is relative to the range's first new storage.
  static constexpr std::uint32_t kHeld = 0x40000000u;
  static constexpr std::uint32_t kOlder = 0x80000000u;
  struct Older {
    std::uint32_t name = 0;
    std::uint32_t refs_before = 0;
    std::uint32_t lowest = 0;   // the lowest count at a node boundary
    std::int32_t refs_delta = 0;
    std::uint64_t bytes = 0;
    Category before = Category::kTemporaries, after = Category::kTemporaries;
    bool view = false;  // Storage::view: decides the sums into it
  };
  std::vector<Older> older;
  std::vector<std::uint32_t> held;  // the older ones named kHeld
  std::vector<std::uint32_t> values_before, values_after;  // per value name: kNone or an id as above
  std::vector<std::uint64_t> outside_value_bytes;
  std::vector<std::uint8_t> grad_before;   // per parameter slot: whether .grad was set
  std::vector<std::uint32_t> uses;         // per parameter slot: nodes of the pass using it
  std::vector<std::uint32_t> grad_after;   // per parameter slot: kNone (unchanged) or an id as above
  std::vector<Storage> storages;           // the new ones, as the range left them
  // Moments relative to the range's first; tensors relative to its first new storage, but for
  // the events in older_events (event, older storage).
  std::vector<Event> events;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> older_events;
  std::vector<MomentTag> moments;
};

struct TapeSpan {
  // Ids in a captured span: relative to the span's first storage or value, or the outside
  // storage or value at slot `id & ~kOutside` of the table the caller hands in.
  static constexpr std::uint32_t kOutside = 0x80000000u;
  struct Outside {
    bool present = false;           // the slot names a storage
    std::uint32_t refs_before = 0;  // references when the span began
    std::int32_t refs_delta = 0;    // net change over the span
    Category before = Category::kTemporaries, after = Category::kTemporaries;
  };
  std::vector<Storage> storages;  // as the span left them
  std::vector<Event> events;      // moments relative to the span's first
  std::vector<MomentTag> moments;
  std::vector<Node> nodes;
  std::vector<std::uint64_t> value_bytes;
  std::vector<Outside> outside;   // per slot of the outside storages (unused slots: kNone ids)
  std::uint32_t step = 0, micro = 0;
  std::int32_t layer = -1;
  // Set by each capture (0 while none holds): a backward range remembers the span by it.
  std::uint64_t generation = 0;
  std::uint32_t value_slots = 0, param_slots = 0;  // sizes of the outside values' and slots' tables
  // See Note [Stamped layer backwards]: the backwards captured for layers of this span, and the
  // captures that failed (after two none is tried).
  std::vector<TapeBackward> backwards;
  std::uint32_t backward_failures = 0;
  // Every node's parameters as indices into the parameter slots' table, node after node: the
  // uses Tape::backward counts for a layer whose nodes stay here.
  std::vector<std::uint32_t> param_roles;
};

// Where the tape stood when a span began, with the storages as they were (to find what the span
// changed among the older ones).
struct TapeMark {
  std::uint32_t storages = 0, events = 0, moments = 0, nodes = 0, values = 0;
  std::size_t param_slots = 0, module_lists = 0, open_modules = 0, subclass = 0;
  std::vector<Storage> before;
};

class Tape {
 public:
  Tape();
  ~Tape();
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  // ---- where we are (labels every event until changed) ----
  std::uint32_t step = 0;
  std::uint32_t micro = 0;
  bool recomputing = false;
  // The per-event calls (at, make, alloc_bytes, retain, release, new_value) are defined below the
  // class: inlined into the builders, each is a few stores instead of a call that saves
  // registers around a vector's growth path (a third of the graph stage's instructions).
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
  // Called before the replay may read the events so far in the middle of a micro-batch's work
  // (Note [Peeks inside a schedule] in pipeline.cpp): a later change of these storages'
  // categories does not assert but marks the trace's categories stale.
  void peeked() { peeked_storages_ = static_cast<TensorId>(trace_.storages.size()); }

  // ---- autograd ----
  ValueId new_value(std::uint64_t grad_bytes);
  // False inside a checkpointed forward: nodes are recorded without keeping saved tensors.
  bool saving = true;
  // Taken by reference: a node is a few hundred bytes, and each by-value hand-over moved it once
  // more on its way into the tape.
  void record(Node&& node);
  void record(const Node& node) { record(Node(node)); }
  // The same without moving a node in: open_node() appends an empty node and hands it out, the
  // caller fills it and close_node() records it as record() would. Nothing may touch the graph
  // in between (the reference lives in the node list). A node is a few hundred bytes: moving it
  // in and destroying the moved-from one was a tenth of the graph stage.
  Node& open_node() {
    TRAINMEM_ASSERT(!node_open_, "open_node with a node still open");
    node_open_ = true;
    return nodes_.emplace_back();
  }
  void close_node();
  std::size_t node_count() const { return nodes_.size(); }
  // Forgets nodes recorded since `n` (a checkpointed forward's graph, replaced by one node).
  void truncate_nodes(std::size_t n) { resize_nodes(n); }

  // Parameters' .grad slots.
  std::uint32_t new_param(TensorId storage);
  TensorId param_grad(std::uint32_t p) const { return param_grads_[p]; }
  void set_param_grad(std::uint32_t p, TensorId g) { param_grads_[p] = g; }
  std::uint32_t param_count() const { return static_cast<std::uint32_t>(param_grads_.size()); }

  // Data-parallel wrappers' hooks (graph/parallel.h): after a parameter's AccumulateGrad, and
  // when backward moves from one decoder layer's nodes to another's (-1: outside the layers).
  std::function<void(std::uint32_t slot)> on_param_ready;
  std::function<void(std::int32_t from, std::int32_t to)> on_layer_change;
  // The engine's final callbacks (Variable._execution_engine.queue_callback): after every node,
  // while torch.autograd.backward still holds the seed gradient.
  std::function<void()> on_final_callbacks;
  // A hook on one value's gradient (Tensor.register_hook): runs once, when the gradient has come
  // and before the node that takes it runs.
  ValueId hooked_value = kNone;
  std::function<void()> on_hooked_value;
  // A module's forward (nested calls nest): the nodes recorded in between are its backward.
  // on_module_backward runs before the first and after the last of them in backward, outer
  // modules first and last: DeepSpeed's pre- and post-backward module hooks, Functions on the
  // module's outputs and inputs (Note [DeepSpeed ZeRO-3] in zero3.cpp). A module that recorded
  // no node has no backward hooks.
  std::function<void(std::uint32_t module, bool begin)> on_module_backward;
  // The modules' post-backward hooks sit on autograd Functions applied to their inputs
  // (DeepSpeed ZeRO-3's PostBackwardFunctionModule): a gradient leaving a module reaches its
  // consumers' buffers (and the sums there) only after on_module_backward(m, false) ran, which
  // in turn runs after the module's parameters' AccumulateGrad.
  bool route_after_module_ends = false;
  // The parameters are DTensors (tensor parallelism: Note [Tied parameters of DTensors] in
  // tape.cpp): two gradients of one parameter are summed into a new tensor.
  bool dtensor_params = false;
  void module_begin(std::uint32_t module) { open_modules_.push_back({module, nodes_.size()}); }
  void module_end();
  // A checkpointed segment's backward unpacks at its last node that saves; the pre-backward hooks
  // of the modules whose backward begins at or before it (in backward order: at that node or one
  // after it in the forward) fire before that, so before the recompute. recompute_hooks(first)
  // lists them, outer first, for the segment recorded from node `first` on (the checkpoint's first
  // forward); fire_before_recompute runs them and run() then skips them once for the recomputed
  // nodes.
  std::vector<std::uint32_t> recompute_hooks(std::size_t first) const;
  void fire_before_recompute(const std::vector<std::uint32_t>& modules);
  // The segment recorded from node `first` on, whose output is `output` and whose values are
  // numbered from `first_value` on: its tail, or null where a tail cannot stand in for the
  // recomputed one (See Note [Checkpoint tails]).
  std::shared_ptr<const CheckpointTail> take_tail(std::size_t first, ValueId output, ValueId first_value) const;
  // A storage the recorded graph references outside saved tensors and Node::kept until the graph is
  // freed (a custom Function's ctx attribute: bitsandbytes' MatMul4Bit keeps B.view(-1, 1)), or
  // during a recompute until the recompute ends, when the recomputed graph goes.
  void hold_with_graph(TensorId id);
  void free_graph_held();  // the graph goes: the loss is dropped after its backward
  // In a recompute with a tail: its last saving node has been recorded, so the real recompute
  // has stopped and no module hook past it fires.
  bool past_recompute_stop() const { return recomputing && nodes_.size() >= recompute_stop_node_; }

  // Runs backward from `root` (a scalar) and clears the recorded graph.
  void backward(ValueId root);
  // torch.autograd.backward(root, grad_tensors=[grad]) for a non-scalar root: `grad` (a storage the
  // caller keeps) is held by the call instead of a seed. When `keep_leaf` is a leaf that requires
  // grad, the gradient it accumulated (its .grad) is handed to the caller in `*kept` instead of
  // being freed with the graph (kNone when none arrived).
  void backward(ValueId root, TensorId grad, ValueId keep_leaf, TensorId* kept);

  // The graph recorded so far, taken off the tape (which is then empty), and put back (onto an
  // empty tape). No module may be open.
  Graph take_graph();
  void put_graph(Graph&& g);

  // Layer stamping (See Note [Stamped decoder layers]). mark() before the layer's forward;
  // capture() after it, with the outside storages, values and parameter slots of that layer
  // (kNone for an absent one) and the tags' layer: false when the span cannot be stamped.
  void mark(TapeMark& m) const;
  bool capture(const TapeMark& m, const std::vector<TensorId>& outside_storages,
               const std::vector<ValueId>& outside_values, const std::vector<std::uint32_t>& param_slots,
               std::int32_t layer, TapeSpan& span);
  // Whether `span` can be stamped with these outside storages (same slots present, enough
  // references, same categories), and the stamp itself: the span appended with its ids shifted,
  // the tables' ids substituted and `layer` in its tags.
  bool can_stamp(const TapeSpan& span, const std::vector<TensorId>& outside_storages) const;
  void stamp(TapeSpan& span, const std::vector<TensorId>& outside_storages,
             const std::vector<ValueId>& outside_values, const std::vector<std::uint32_t>& param_slots,
             std::int32_t layer);
  std::uint32_t value_count() const { return static_cast<std::uint32_t>(value_grad_.size()); }
  // Whether backward may stamp the ranges of stamped and captured layers (See Note [Stamped layer
  // backwards]): set by the builder only where the data-parallel hooks do nothing.
  bool stamp_backward = false;

 private:
  // A captured or stamped layer's nodes [nodes_begin, nodes_end) (or, in_span, none: they are
  // its span's, renamed, made only if its backward is not stamped), its span (valid while the
  // span's generation is this one), where its forward's storages and values began, and its
  // outside storages, values and parameter slots (in range_tables_ from `tables`).
  struct LayerRange {
    std::uint32_t nodes_begin = 0, nodes_end = 0;
    bool in_span = false;
    TapeSpan* span = nullptr;
    std::uint64_t generation = 0;
    TensorId sbase = 0;
    ValueId vbase = 0;
    std::uint32_t tables = 0;
    std::int32_t layer = -1;
  };
  std::vector<LayerRange> ranges_;
  std::vector<std::uint32_t> range_tables_;
  void note_range(TapeSpan& span, std::uint32_t nodes_begin, TensorId sbase, ValueId vbase,
                  const std::vector<TensorId>& outside_storages, const std::vector<ValueId>& outside_values,
                  const std::vector<std::uint32_t>& param_slots, std::int32_t layer, bool in_span);
  void append_nodes(const TapeSpan& span, TensorId sbase, ValueId vbase, const TensorId* outside_storages,
                    const ValueId* outside_values, const std::uint32_t* param_slots, std::int32_t layer);
  void retire(TapeSpan& span);
  std::vector<std::unique_ptr<TapeSpan>> retired_;  // spans of pending ranges that a capture replaced
  // Backward over the node list with the ranges stamped where they can be.
  void count_range_uses();
  void run_ranges();
  void run_range(const LayerRange& r);
  bool stamp_range(const LayerRange& r);
  bool capture_range(const LayerRange& r, std::size_t begin, std::size_t end, TapeBackward& b);
  std::vector<TensorId> older_ids_;            // stamp_range's and capture_range's older storages
  std::vector<std::uint32_t> older_index_;     // capture_range's: by TensorId, kNone when not older
  bool distinct(const std::uint32_t* ids, std::size_t n) const;
  bool distinct_slots(const std::uint32_t* slots, std::size_t n) const;  // parameter slots
  mutable std::vector<std::uint32_t> seen_slots_;
  bool distinct(const std::vector<TensorId>& table) const { return distinct(table.data(), table.size()); }
  mutable std::vector<std::uint32_t> seen_;  // distinct()'s marks, by TensorId
  mutable std::uint32_t seen_mark_ = 0;

 public:

  Trace take();
  const Trace& trace() const { return trace_; }  // what has been built so far

 private:
  void run(std::size_t begin, std::size_t end);
  void run_node(Node& n);
  // With route_after_module_ends: run_node leaves the input gradients of a node that ends a module
  // here, for run to route once the module's hooks have run.
  bool defer_routing_ = false;
  std::vector<std::pair<ValueId, TensorId>> deferred_routes_;
  void run_checkpoint_with_tail(Node& n, TensorId incoming);
  void run_reentrant_checkpoint(Node& n, TensorId incoming);
  // A checkpoint node's recompute, saved and kept storages and tag, taken out of it before the
  // recompute appends to nodes_ (which may move the node).
  struct TakenCheckpoint {
    std::function<T()> recompute;
    SmallVec<TensorId, 6> saved;
    SmallVec<TensorId, 4> kept;
    MomentTag tag;
  };
  static TakenCheckpoint take_checkpoint(Node& n) {
    return {std::move(n.recompute), std::move(n.saved), std::move(n.kept), n.tag};
  }
  T recompute_segment(const std::function<T()>& recompute, const MomentTag& tag, std::size_t stop_node);
  template <class Saved, class Kept>
  std::size_t run_releasing_frame(std::size_t begin, std::size_t end, const Saved& saved, const Kept& kept,
                                  const MomentTag& tag);
  T rerun(const std::function<T()>& recompute, std::size_t stop_node);
  void deliver(ValueId v, TensorId g);
  TensorId buffer_sum(TensorId buf, TensorId g, std::uint64_t bytes, bool subclass = false);
  void accumulate_param(const ParamGrad& pg, TensorId g);

  void recategorize(TensorId id, Category c);
  // Removes what a recompute made after event `stop` (a non-reentrant checkpoint's early stop).
  void stop_recompute_at(std::size_t stop);
  std::size_t last_saving_event_ = 0;  // during a recompute: the events when the last saving node was recorded
  std::size_t last_saving_node_ = 0;               // the newest node that saved, or would have (not saving)
  std::vector<std::uint32_t> fired_before_recompute_;
  std::size_t recompute_stop_node_ = SIZE_MAX;  // past_recompute_stop's bound, during a recompute with a tail
  std::vector<TensorId> graph_held_, recompute_held_;  // hold_with_graph's
  void free_recompute_held();
  std::size_t op_begin_event_ = 0;     // during a recompute: the events when the previous node was recorded

  Trace trace_;
  TensorId sealed_storages_ = 0;  // storages below this id keep their categories
  TensorId peeked_storages_ = 0;  // storages below this id may have been read by a peek
  MomentTag tag_;
  std::uint32_t moment_ = 0;
  std::vector<Node> nodes_;
  std::int32_t backward_layer_ = -1;  // the layer of the last node run (on_layer_change)
  std::vector<TensorId> value_grad_;
  std::vector<std::uint64_t> value_bytes_;
  // Gradients autograd's InputBuffer will not add into in place (GradIn::subclass), by TensorId.
  std::vector<bool> subclass_;
  bool is_subclass(TensorId id) const { return id < subclass_.size() && subclass_[id]; }
  void mark_subclass(TensorId id);
  std::vector<TensorId> param_grads_;
  // A parameter used by several nodes (a tied embedding) has one AccumulateGrad node whose
  // input buffer collects every gradient of the pass before it runs.
  std::vector<std::uint32_t> param_uses_;
  struct PendingGrad {
    TensorId sum = kNone;  // what the buffer holds
    std::uint32_t arrived = 0;
    bool empty() const { return arrived == 0; }
  };
  std::vector<PendingGrad> param_pending_;
  // Modules whose forward is running (module, first node), and per node the modules whose
  // backward begins before it (its last node; inner ones first) and ends after it (first node).
  std::vector<std::pair<std::uint32_t, std::size_t>> open_modules_;
  std::vector<std::vector<std::uint32_t>> module_begins_at_, module_ends_at_;
  void resize_nodes(std::size_t n);
  bool node_open_ = false;  // between open_node() and close_node()
  // run_node's working lists, kept for their capacity.
  std::vector<TensorId> node_scratch_, node_grads_, node_pgrads_, node_co_;
  bool unpacking_ = false;  // in a non-reentrant checkpoint's recompute (Node::unpacked)
};

inline void Tape::at(Phase phase, std::int32_t layer, std::string_view op) {
  tag_ = MomentTag{step, micro, phase, layer, op, recomputing && phase != Phase::kBackward};
  trace_.moments.push_back(tag_);
  moment_ = static_cast<std::uint32_t>(trace_.moments.size() - 1);
}

// A storage of no bytes holds no memory (both allocators hand out a null pointer for it): no
// events, and the allocator replay never sees it.
inline TensorId Tape::alloc_bytes(std::uint64_t bytes, Category category) {
  TensorId id = static_cast<TensorId>(trace_.storages.size());
  trace_.storages.push_back({bytes, category, false, 1});
  if (bytes != 0) trace_.events.push_back({id, moment_, true});
  return id;
}

inline T Tape::make(std::uint64_t numel, DType dtype, Category category) {
  T t;
  t.numel = numel;
  t.dtype = dtype;
  t.id = alloc_bytes(detail::mul(numel, dtype_bytes(dtype), "tensor size"), category);
  return t;
}

inline void Tape::retain(TensorId id) {
  if (id == kNone) return;
  ++trace_.storages[id].refs;
}

inline void Tape::release(TensorId id) {
  if (id == kNone) return;
  Storage& s = trace_.storages[id];
  TRAINMEM_ASSERT(s.refs > 0, "release of a freed storage");
  if (--s.refs == 0 && s.bytes != 0) trace_.events.push_back({id, moment_, false});
}

inline ValueId Tape::new_value(std::uint64_t grad_bytes) {
  value_grad_.push_back(kNone);
  value_bytes_.push_back(grad_bytes);
  return static_cast<ValueId>(value_grad_.size() - 1);
}

}  // namespace trainmem::graph
