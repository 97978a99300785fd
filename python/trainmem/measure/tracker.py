"""Storage-level allocation tracker.

Every tensor *storage* (not view) that appears on the tracked device during a run becomes a
record with an allocation event and, when its last reference dies, a free event. Allocations are
seen with a `TorchDispatchMode` (the outputs of every aten op, forward, backward and optimizer
alike); frees are seen with a `weakref.finalize` on the storage object, which fires when the C++
storage dies. Each event carries the context it happened in: phase (setup / forward / loss /
backward / optimizer; for generation prefill / decode; teardown once the runner returns, Note
[Teardown] in training.py), step, micro-batch, and a label naming the module and aten op.

A storage's category is decided once, after the run, from what the storage *became* (see
Note [Categories]); the peak and its breakdown are then computed by replaying the events.

Note [Categories]
    weights           parameter and buffer storages; the fp32 master copies of bf16-master
                      (registered by the driver); when the recipe uses autocast, `aten._to_copy`
                      outputs whose input is the storage of a parameter, made in forward, loss
                      or backward (the autocast weight casts: the parameters are fp32 there and
                      nothing else casts them to half; the checkpoint recompute re-enters
                      autocast and casts again). Autocast caches the cast of a parameter that
                      requires grad (one per forward); the frozen base parameters of a LoRA run
                      are not cached and are cast at every use: each cast is its own storage,
                      freed after the op unless autograd saved it. Without autocast a cast of a
                      parameter (Gemma's `weight.float()` in bf16) is an ordinary temporary.
    optimizer_states  storages found in `optimizer.state` after each step
    gradients         storages found as some parameter's (or master's) `.grad`, looked at after
                      every micro-batch's backward, after the master conversion and before
                      `zero_grad`
    other             storages allocated while the driver forces it: the input batch and
                      everything GradScaler allocates (scale, growth tracker, found_inf,
                      the scaled loss); on CUDA also device memory no op accounts for (the cuBLAS
                      workspaces), found by comparing `torch.cuda.memory_allocated()` with the
                      tracked sum after every op when expandable segments are on
    activations       storages packed by the saved-tensor hooks: ours for the ordinary
                      forward, and the checkpoint's recomputation hook (wrapped while
                      tracking) for what the non-reentrant recompute saves; the checkpoint
                      inputs are saved through the ordinary hooks
    temporaries       everything else
    When several apply the first in this order wins: weights, optimizer_states, gradients,
    other, activations, temporaries.

    In inference (recipe mode inference, generation.py) nothing is saved for a backward and
    there is no optimizer; the same flags mean:
    weights           parameters and buffers (as above; no autocast, so no casts)
    activations       the KV cache: every storage that is, at some point, a key or value tensor
                      held by a layer of the cache generate() makes (DynamicCache), marked by the
                      driver after every `Cache.update` and `Cache.reorder_cache`. A storage
                      keeps the category for its whole life, so the old cache of a layer, freed
                      when the next update's `cat` (or beam search's `index_select`) replaces
                      it, is activations too
    other             the two inputs the driver makes (input_ids, attention_mask)
    temporaries       everything else: the copies and growing tensors generate() makes
                      (input_ids grown by one column per token, position ids, beam search's
                      sequences and scores), logits, their float32 copy, the scores, the
                      masks, the layers' intermediates, the token selection

Note [Labels]
    An op's label is the module it ran in, written as the schema's `peak.op`: `embed_tokens`,
    `layer N <path in the layer>` (`layer 3 mlp.down_proj`), `norm`, `lm_head`, `loss`,
    `optimizer.<aten op>`; for a module with children the aten op is appended
    (`layer 0 self_attn._softmax`, `layer 2 add`). In the forward a stack kept by module
    pre/post hooks gives it; a post hook also labels every autograd node the module created
    (walking `grad_fn.next_functions` from its outputs, keyed by the node's sequence number),
    and a pre hook labels the nodes behind its inputs with the enclosing module. In the backward
    the label is that of `torch._C._current_autograd_node()` (AccumulateGrad: the module owning
    the parameter), and the checkpoint's recompute runs inside its layer's label.
    A peft model is labelled as the Hugging Face model inside it: the `base_model.model.` prefix is
    dropped, so is the `base_layer` of a wrapped layer (its base linear is `layer 0
    self_attn.q_proj`, as without LoRA) and the adapter name after `lora_A`, `lora_B` and
    `lora_dropout` (`layer 0 self_attn.q_proj.lora_A`); the wrapper's own ops (the casts, the
    scaling, the addition) are `layer 0 self_attn.q_proj.<aten op>`.
    In generation (phases prefill and decode) the model's ops are labelled as in a training
    forward; generate()'s own ops outside the model (input preparation, the logits' float32
    copy, token selection, beam bookkeeping, the cache reordering) are `generate.<aten op>`.

Note [Summing gradients]
    When a tensor feeds several ops, autograd sums its gradients in the consumer node's input
    buffer (InputBuffer::accumulate): in place into the buffered gradient (`add_`) when grad mode
    is off, that gradient is a plain dense tensor and the buffer holds its last reference and its
    storage's, and out of place (`add`) otherwise: a view whose base is alive (nn.Linear's weight
    gradient is mm's output transposed), a tensor handed to two buffers (an addition's), a
    subclass. While any TorchDispatchMode is active ATen treats every tensor as a subclass
    (isTensorSubclassLike), so under ours every sum would be out of place: one more tensor than a
    real run holds at that moment, the step's peak where a tied embedding's two [vocab, hidden]
    gradients meet. The tracker puts the real decision back: a post hook on every backward node
    (but AccumulateGrad) marks that autograd is routing what the node made, a pre hook on every
    node marks the end; an `add` in between whose second operand is one of those gradients is the
    buffer's sum (the producing node still current: the consumer's tensor hooks, retain_grad's
    sum among them, run in between), and it runs as `add_` when autograd, untracked, would add in
    place. Autograd's own test of the last reference (use counts) is read from inside the mode,
    where the dispatch adds references of its own: the counts of an exclusively held gradient are
    measured once on a probe (`_exclusive_counts`). Not told apart: a gradient that Python code
    keeps a reference to (a custom Function that also stores what its backward returns, a hook
    that keeps it) reads as held by the buffer alone, so the tracker would add into it in place
    where autograd would not; nothing the measuring side runs does that. Checked against
    untracked runs: tools/untracked_check.py and tests/python/test_measure_untracked.py.

Note [Block size]
    Each storage is charged `max(512, ceil(nbytes / 512) * 512)` bytes: the CUDA caching
    allocator's rounding. The live sum of these blocks is what `torch.cuda.memory_allocated()`
    reports with `expandable_segments:True` (every block is split, so no block is charged more
    than its rounded request); with the default allocator a large block whose remainder is not
    split (≤ 1 MiB) is charged whole, so the real figure can be slightly higher. Zero-byte
    storages are not allocations (the CUDA allocator hands out no block) and are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import weakref
from collections import Counter
from typing import Any, Iterator, NamedTuple

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as _non_overlapping_and_dense
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .phases import as_rows, block_bytes, phase_peaks  # block_bytes: see Note [Block size]

CATEGORIES = ("weights", "optimizer_states", "gradients", "activations", "temporaries", "other")
_PRIORITY = ("weights", "optimizer_states", "gradients", "other", "activations")
PHASES = ("setup", "forward", "loss", "backward", "optimizer", "prefill", "decode", "teardown")

ALLOC, FREE = 0, 1
_NO_SEQUENCE_NR = 2**64 - 1  # what AccumulateGrad nodes report
_TO_COPY = torch.ops.aten._to_copy.default
_ADD = torch.ops.aten.add.Tensor
_ADD_INPLACE = torch.ops.aten.add_.Tensor


class Label(NamedTuple):
    """Where an op ran: `display` is the schema's op prefix, `module` the qualified module name."""

    display: str
    module: str
    append_op: bool  # False for leaf modules, `loss`: the op name is then the display alone

    def op_name(self, aten: str) -> str:
        if not self.append_op:
            return self.display
        if self.display.startswith("layer ") and " " not in self.display[len("layer "):]:
            return f"{self.display} {aten}"  # an op directly in a decoder layer: "layer 3 add"
        return f"{self.display}.{aten}"


SETUP = Label("setup", "", True)
ROOT = Label("model", "", True)
LOSS = Label("loss", "", False)
OPTIMIZER = Label("optimizer", "", True)
GENERATE = Label("generate", "", True)  # generate()'s own ops, outside the model: `generate.<aten op>`
TEARDOWN = Label("teardown", "", True)  # the runner's locals going when it returns: see Note [Teardown]
# The label of the ops a phase runs outside any labelled module (a backward's ops are labelled by
# their autograd node first: _current_label).
_PHASE_LABELS = {"setup": SETUP, "forward": ROOT, "loss": LOSS, "backward": LOSS, "optimizer": OPTIMIZER,
                 "prefill": GENERATE, "decode": GENERATE, "teardown": TEARDOWN}
assert tuple(_PHASE_LABELS) == PHASES


def module_label(qualname: str, module: torch.nn.Module, base_prefix: str) -> Label:
    """`model.layers.3.mlp.down_proj` -> `layer 3 mlp.down_proj`; `model.norm` -> `norm`."""
    leaf = next(iter(module.children()), None) is None
    parts = qualname.split(".") if qualname else []
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            rest = ".".join(parts[i + 1:])
            return Label(f"layer {part}" + (f" {rest}" if rest else ""), qualname, not (leaf and rest))
    if parts and parts[0] == base_prefix:
        parts = parts[1:]
    if not parts:
        return Label(ROOT.display, qualname, True)
    return Label(".".join(parts), qualname, not leaf)


_PEFT_ADAPTER_DICTS = ("lora_A", "lora_B", "lora_dropout")


def _unwrap_peft(model: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
    """(the Hugging Face model, its qualified name inside the peft wrapper), or (model, None)."""
    get = getattr(model, "get_base_model", None)
    if not callable(get):
        return model, None
    inner = get()
    for qualname, module in model.named_modules():
        if module is inner:
            return inner, qualname
    return model, None


def _hf_qualname(qualname: str, wrapper_prefix: str | None) -> str:
    """A peft module's name as the Hugging Face model names it (see Note [Labels])."""
    if wrapper_prefix is None:
        return qualname
    if wrapper_prefix and (qualname == wrapper_prefix or wrapper_prefix.startswith(qualname + ".") or not qualname):
        return ""  # the wrappers above the Hugging Face model
    if wrapper_prefix and qualname.startswith(wrapper_prefix + "."):
        qualname = qualname[len(wrapper_prefix) + 1:]
    parts, out, skip = qualname.split("."), [], False
    for part in parts:
        if skip:
            skip = False
            continue
        if part == "base_layer":
            continue
        out.append(part)
        skip = part in _PEFT_ADAPTER_DICTS
    return ".".join(out)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: a DTensor's local shard (FSDP2's sharded parameters,
    their gradients and optimizer states are DTensors, wrappers without a storage), the tensor
    inside any other wrapper subclass of one inner tensor (the functional collectives'
    AsyncCollectiveTensor, which tensor parallelism's redistributions return: its own
    `untyped_storage()` is an invalid placeholder with the wrapped size, no memory), else t.
    Unwrapped all the way down: a DTensor's local tensor can itself be an AsyncCollectiveTensor
    (a sequence all-gather of batch 1 is a view of the collective's output, not a cat of it:
    Note [Gathering a batch of one] in src/graph/tensor_parallel.h)."""
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, torch.Tensor):
        return _local(inner)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        if len(names) == 1 and isinstance(getattr(t, names[0], None), torch.Tensor):
            return _local(getattr(t, names[0]))
    return t


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in `obj`, first to last: an op's outputs are recorded in the order it returns
    them, which for most kernels is the order they allocate them (data/ground_truth/README.md,
    "Within one op"); a trace marks each op's allocations with its `call` all the same."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield _local(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))


class StorageRecord:
    __slots__ = ("sid", "nbytes", "block_bytes", "dtype", "shape", "flags", "alloc_index",
                 "free_index", "name")

    def __init__(self, sid, nbytes, block, dtype, shape, flags, alloc_index, name=""):
        self.sid = sid
        self.nbytes = nbytes
        self.block_bytes = block
        self.dtype = dtype
        self.shape = shape
        self.flags = flags
        self.alloc_index = alloc_index
        self.free_index = None
        self.name = name

    def category(self) -> str:
        for flag in _PRIORITY:
            if flag in self.flags:
                return flag
        return "temporaries"


def _use_counts(t: torch.Tensor) -> tuple[int, int]:
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@functools.cache
def _exclusive_counts() -> tuple[int, int]:
    """What `_use_counts` reads, inside a dispatch mode, for a gradient only an input buffer holds.

    The mode's own bookkeeping (the boxed arguments, the Python objects) adds references, so the
    counts are measured once on a probe: `y = x.exp()` used twice, whose two gradients (MulBackward0's
    and SinBackward0's outputs) are fresh tensors; the only `add` of its backward is their sum."""
    seen = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _ADD:
                seen.append(_use_counts(args[0]))
            return func(*args, **(kwargs or {}))

    with torch.enable_grad():
        x = torch.ones(4, requires_grad=True)
        y = x.exp()
        loss = (y * 2 + y.sin()).sum()
        with Probe():
            loss.backward()
    assert len(seen) == 1, f"the probe's backward made {len(seen)} sums"
    return seen[0]


class _DispatchMode(TorchDispatchMode):
    def __init__(self, tracker: "MemoryTracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tracker = self.tracker
        if func is _ADD and tracker._routing is not None and not kwargs and tracker._sums_in_place(args):
            return tracker._dispatch(_ADD_INPLACE, args, {})
        return tracker._dispatch(func, args, kwargs or {})


class MemoryTracker:
    """Records storage allocations and frees on one device type ("cpu" or "cuda").

    Fake tensors are tracked by their fake device, so a fake run on "cpu" is tracked like a
    real CPU run. On CUDA, `cuda_probe=True` also reads the allocator's counters around every
    op (see `_probe_cuda`).
    """

    def __init__(self, device: str | torch.device, *, fake: bool = False, cuda_probe: bool = False,
                 detect_untracked: bool = False) -> None:
        self.device = torch.device(device)
        self.fake = fake
        self.device_type = self.device.type
        self.records: list[StorageRecord] = []
        self.events: list[tuple[int, int, tuple]] = []  # (ALLOC | FREE, sid, context)
        self._off_thread: set[int] = set()  # sids freed on another thread (a storage is freed once)
        self.stats: Counter = Counter()
        self.phase = "setup"
        self.step = 0
        self.micro_batch = 0
        self._live: dict[int, int] = {}  # storage _cdata -> sid
        self._live_bytes = 0  # sum of live blocks
        self._finalizers: dict[int, weakref.finalize] = {}
        self._weight_cdatas: set[int] = set()  # storages of the parameters (for the autocast weight casts)
        self._module_stack: list[Label] = []
        self._module_labels: dict[int, Label] = {}
        self._param_labels: dict[int, Label] = {}
        self._node_labels: dict[int, Label] = {}  # autograd sequence_nr -> label
        self._last_backward_label = LOSS
        self._forced: str | None = None
        # (phase, step, micro-batch, op, aten op, module, call): `call` counts the dispatched ops,
        # so that a trace tells one op's allocations apart from the next one's (0: none).
        self._ctx: tuple = ("setup", 0, 0, "setup", "", "", 0)
        self._calls = 0
        self._hooks: list = []
        self._restore: list = []
        # OpOverloadPacket -> fn(func, args, kwargs) that runs the op in the tracker's place (the
        # measuring side's settling of gloo's collectives: Note [Settled functional collectives]
        # in parallel.py)
        self.op_wrappers: dict = {}
        self._closed = False
        self._in_gc = False
        self._thread = threading.get_ident()  # the tracking thread (set again on __enter__)
        self._recomputing = False  # inside a checkpoint's recompute during backward
        self._cuda_probe = cuda_probe and self.device_type == "cuda"
        self._detect_untracked = detect_untracked and self._cuda_probe
        self._untracked_live = 0
        self._cuda_index = torch.cuda.current_device() if self._cuda_probe else None
        self._exit_stack: contextlib.ExitStack | None = None
        # Between a backward node's function and the next node's: the node, and weak references
        # to the gradients it made, which autograd is routing into input buffers (Note [Summing
        # gradients]); None elsewhere.
        self._routing: tuple[Any, list[weakref.ref]] | None = None
        # Set by the driver when the recipe runs the forward under autocast. Inside the dispatch
        # mode torch.is_autocast_enabled() reads False (autocast has already run), so the driver says.
        self.autocast = False

    # ------------------------------------------------------------------ registration

    def attach_model(self, model: torch.nn.Module) -> None:
        """Hooks for labels, and parameters/buffers registered as `weights`."""
        hf_model, wrapper_prefix = _unwrap_peft(model)
        base_prefix = getattr(hf_model, "base_model_prefix", "") or ""
        for qualname, module in model.named_modules():
            label = module_label(_hf_qualname(qualname, wrapper_prefix), module, base_prefix)
            self._module_labels[id(module)] = label
            self._hooks.append(module.register_forward_pre_hook(
                functools.partial(self._pre_hook, label), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(
                functools.partial(self._post_hook, label), with_kwargs=True, always_call=True))
            for p in module.parameters(recurse=False):
                self._param_labels.setdefault(id(p), label)
        for module in model.modules():
            func = module.__dict__.get("_gradient_checkpointing_func")
            if func is not None:
                module._gradient_checkpointing_func = self._wrap_checkpoint_func(func)
                self._restore.append(functools.partial(setattr, module, "_gradient_checkpointing_func", func))
        for name, p in model.named_parameters():
            self.add_existing(p, "weights", name)
            self._weight_cdatas.add(self._cdata(p))  # frozen ones too (LoRA's base)
        for name, b in model.named_buffers():
            self.add_existing(b, "weights", name)

    def add_existing(self, tensor: torch.Tensor, flag: str, name: str = "") -> int | None:
        """Register a storage made before tracking (or outside it) as allocated now."""
        sid = self._sid_of(tensor)
        if sid is not None:
            self.records[sid].flags.add(flag)
            return sid
        return self._new_record(tensor, {flag}, name)

    def register(self, tensor: torch.Tensor, name: str = "") -> int | None:
        """Register a storage made outside tracking, with no category yet."""
        sid = self._sid_of(tensor)
        return sid if sid is not None else self._new_record(tensor, set(), name)

    def add_weight(self, tensor: torch.Tensor, name: str = "") -> None:
        """A tensor made by the driver that is category weights (the bf16-master copies)."""
        self.add_existing(tensor, "weights", name)

    # ------------------------------------------------------------------ driver interface

    def set_phase(self, phase: str, step: int | None = None, micro_batch: int | None = None) -> None:
        assert phase in PHASES, phase
        self.phase = phase
        if step is not None:
            self.step = step
        if micro_batch is not None:
            self.micro_batch = micro_batch
        label = _PHASE_LABELS[phase]
        if phase == "backward":
            self._last_backward_label = LOSS  # the ops before the first labelled node seed the loss gradient
        self._ctx = (phase, self.step, self.micro_batch, label.display, "", "", 0)

    @contextlib.contextmanager
    def forced(self, flag: str):
        """Everything allocated inside gets `flag` (used for `other`: inputs, GradScaler)."""
        previous, self._forced = self._forced, flag
        try:
            yield
        finally:
            self._forced = previous

    @contextlib.contextmanager
    def scope(self, label: Label):
        """Ops inside are labelled `label` (the loss function, the fused loss)."""
        self._module_stack.append(label)
        try:
            yield
        finally:
            self._pop_label(label)

    def label_graph(self, obj: Any, label: Label) -> None:
        """Give `label` to every autograd node behind obj's tensors that has none yet."""
        stack = [t.grad_fn for t in _iter_tensors(obj) if t.grad_fn is not None]
        labels = self._node_labels
        while stack:
            node = stack.pop()
            try:
                seq = node._sequence_nr()
            except (AttributeError, RuntimeError):
                continue
            if seq == _NO_SEQUENCE_NR or seq in labels:
                continue
            labels[seq] = label
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    stack.append(nxt)

    def mark(self, tensor: torch.Tensor | None, flag: str) -> bool:
        if tensor is None:
            return False
        sid = self._sid_of(tensor)
        if sid is None:
            return False
        self.records[sid].flags.add(flag)
        return True

    def mark_gradients(self, params) -> None:
        for p in params:
            self.mark(p.grad, "gradients")

    def mark_optimizer_state(self, optimizer) -> None:
        for state in optimizer.state.values():
            for t in _iter_tensors(state):
                self.mark(t, "optimizer_states")

    def collect_garbage(self) -> None:
        """A garbage collection at a fixed point; what it frees is counted (reference cycles)."""
        self._in_gc = True
        try:
            # Generations 0 and 1 hold everything made since tracking started (gc is off and
            # __enter__ collected fully), which is where a cycle made by the step would be.
            gc.collect(1)
        finally:
            self._in_gc = False

    # ------------------------------------------------------------------ activation

    def __enter__(self) -> "MemoryTracker":
        self._thread = threading.get_ident()
        _exclusive_counts()  # before any tracking
        stack = contextlib.ExitStack()
        self._gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        stack.callback(lambda: gc.enable() if self._gc_was_enabled else None)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
        self._patch_recomputation_hook(stack)
        self._patch_backward(stack)
        stack.enter_context(_DispatchMode(self))
        self._exit_stack = stack
        return self

    def track_inside(self, handler):
        """`handler` (a DTensor custom op handler: op_call, args, kwargs) with this tracker's
        dispatch mode active in its body.

        DTensor's dispatch runs below the tracker's mode (the mode is off while it runs), so the
        local ops of a handler such as loss_parallel()'s vocab-parallel log_softmax would not be
        seen. Inside the handler the tensors are local ones: a fresh mode on this tracker records
        their outputs as any op's; the handler's DTensor result wraps a local tensor already
        recorded, so the outer op adds nothing twice. The fake tensors of DTensor's sharding
        propagation that a handler runs (_propagate_tensor_meta) are not memory (_trackable)."""

        @functools.wraps(handler)
        def tracked(op_call, args, kwargs):
            with _DispatchMode(self):
                return handler(op_call, args, kwargs)

        return tracked

    def __exit__(self, *exc) -> None:
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None

    def close(self) -> None:
        """Stop listening: finalizers detached, hooks removed, wrapped functions restored."""
        self._closed = True
        for fin in list(self._finalizers.values()):
            fin.detach()
        self._finalizers.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def _patch_recomputation_hook(self, stack: contextlib.ExitStack) -> None:
        # The non-reentrant checkpoint packs what the recompute saves with its own hook, which
        # hides ours; wrap its pack function so those tensors are seen as activations too.
        import torch.utils.checkpoint as checkpoint_module

        original = getattr(checkpoint_module, "_recomputation_hook", None)
        if not isinstance(original, type):
            self.stats["recomputation_hook_not_patched"] = 1
            return
        tracker = self

        class _TrackedRecomputationHook(original):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                inner = self.pack_hook

                def pack_hook(x):
                    tracker._on_saved(x)
                    return inner(x)

                self.pack_hook = pack_hook

        checkpoint_module._recomputation_hook = _TrackedRecomputationHook
        stack.callback(setattr, checkpoint_module, "_recomputation_hook", original)

    def _patch_backward(self, stack: contextlib.ExitStack) -> None:
        # Every backward (loss.backward(), a reentrant checkpoint's inner one, a pipeline stage's)
        # reaches the C++ engine through torch.autograd's _engine_run_backward: hook its graph
        # there (Note [Summing gradients]).
        import torch.autograd as autograd_module

        original = autograd_module._engine_run_backward
        tracker = self

        def run_backward(t_outputs, *args, **kwargs):
            handles = tracker._hook_graph(t_outputs)
            outer = tracker._routing  # a reentrant backward runs inside a node's function
            try:
                return original(t_outputs, *args, **kwargs)
            finally:
                tracker._routing = outer
                for handle in handles:
                    handle.remove()

        autograd_module._engine_run_backward = run_backward
        stack.callback(setattr, autograd_module, "_engine_run_backward", original)

    def _hook_graph(self, t_outputs) -> list:
        """A pre hook on every node of the graph behind `t_outputs` (routing over), and a post hook
        on every node but AccumulateGrad, which routes nothing (routing begins)."""
        roots = [t.node if isinstance(t, torch.autograd.graph.GradientEdge) else t.grad_fn
                 for t in t_outputs]
        seen = {node for node in roots if node is not None}
        queue = list(seen)
        handles = []

        def routing_over(grad_outputs):
            self._routing = None

        def routing_begins(grad_inputs, grad_outputs):
            made = [weakref.ref(g) for g in grad_inputs if isinstance(g, torch.Tensor)]
            self._routing = (torch._C._current_autograd_node(), made)

        while queue:
            node = queue.pop()
            handles.append(node.register_prehook(routing_over))
            if type(node).__name__ != "AccumulateGrad":
                handles.append(node.register_hook(routing_begins))
            for next_node, _ in node.next_functions:
                if next_node is not None and next_node not in seen:
                    seen.add(next_node)
                    queue.append(next_node)
        return handles

    def _sums_in_place(self, args) -> bool:
        """Whether autograd, with no dispatch mode active, would add `args[1]` (a gradient the node
        just made) into `args[0]` (the one already in the input buffer) in place: the sum of
        InputBuffer::accumulate with grad mode off, `old` a plain dense tensor whose last
        reference and storage the buffer holds, `new` a plain tensor."""
        old, new = args
        node, made = self._routing
        # The engine keeps the producing node current while it routes, and makes the consumer
        # current for its tensor hooks (retain_grad's sum, say), which run before our pre hook.
        if torch._C._current_autograd_node() is not node or not any(new is ref() for ref in made):
            return False  # an op of a hook, not the buffer's sum
        plain = FakeTensor if self.fake else torch.Tensor  # a fake run stands for a real one
        if torch.is_grad_enabled() or type(old) is not plain or type(new) is not plain:
            return False
        if (old.layout != torch.strided or new.layout != torch.strided or old.is_nested or old._is_zerotensor()
                or not _non_overlapping_and_dense(old)):
            return False
        return _use_counts(old) == _exclusive_counts()

    # ------------------------------------------------------------------ hooks

    def _labels_nodes(self) -> bool:
        # The forward's graph, and a reentrant checkpoint's recompute in backward, which builds a
        # new graph for its own backward (the non-reentrant one's recompute graph is discarded).
        return self.phase in ("forward", "loss") or self._recomputing

    def _pre_hook(self, label: Label, module, args, kwargs):
        if self._labels_nodes():
            self.label_graph((args, kwargs), self._module_stack[-1] if self._module_stack else self._top_label())
        self._module_stack.append(label)

    def _post_hook(self, label: Label, module, args, kwargs, output):
        if self._labels_nodes():
            self.label_graph(output, label)
            # A forward may give a parameter new storage (bitsandbytes' `bias.data = bias.data.to(x.dtype)`):
            # the new storage is the parameter's from birth.
            for p in module.parameters(recurse=False):
                sid = self._sid_of(p)
                if sid is not None and "weights" not in self.records[sid].flags:
                    self.records[sid].flags.add("weights")
                    self._weight_cdatas.add(self._cdata(p))
        self._pop_label(label)

    def _pop_label(self, label: Label) -> None:
        stack = self._module_stack
        if stack and stack[-1] is label:
            stack.pop()
            return
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is label:
                del stack[i]
                return

    def _top_label(self) -> Label:
        return LOSS if self.phase == "loss" else ROOT

    def _wrap_checkpoint_func(self, func):
        tracker = self

        def checkpoint_with_labels(function, *args, **kwargs):
            # Hugging Face passes partial(forward, layer, **kwargs): label the recompute with the layer.
            layer = function.args[0] if isinstance(function, functools.partial) and function.args else None
            label = tracker._module_labels.get(id(layer))
            if label is None:
                return func(function, *args, **kwargs)

            def run(*a, **k):
                recomputing = tracker._recomputing
                tracker._recomputing = tracker.phase == "backward"
                try:
                    with tracker.scope(label):
                        return function(*a, **k)
                finally:
                    tracker._recomputing = recomputing

            return func(run, *args, **kwargs)

        return checkpoint_with_labels

    def _pack(self, x):
        self._on_saved(x)
        # Note [Saved leaves]: a parameter is kept as itself, as autograd keeps it without hooks:
        # ZeRO-3 releases a gathered parameter by swapping its .data, which frees the storage
        # unless something else holds it, and an alias here would (the ZeRO-3 traces before
        # 2026-12-06 kept every saved weight gathered to its backward). Any other tensor is
        # detached: itself would make a reference cycle for a saved output, and other leaves (a
        # pipeline stage's received input, say) kept as themselves made PP x FSDP peaks vary.
        return x if isinstance(x, torch.nn.Parameter) else x.detach()

    def _on_saved(self, x) -> None:
        if isinstance(x, torch.Tensor):
            self.mark(x, "activations")

    # ------------------------------------------------------------------ dispatch

    def _current_label(self) -> Label:
        phase = self.phase
        if self._module_stack and phase != "optimizer":
            return self._module_stack[-1]
        if phase == "backward":
            label = None
            node = torch._C._current_autograd_node()
            if node is not None:
                try:
                    seq = node._sequence_nr()
                except (AttributeError, RuntimeError):
                    seq = None
                if seq == _NO_SEQUENCE_NR:
                    variable = getattr(node, "variable", None)
                    label = self._param_labels.get(id(variable)) if variable is not None else None
                elif seq is not None:
                    label = self._node_labels.get(seq)
            if label is None:
                label = self._last_backward_label
            self._last_backward_label = label
            return label
        return _PHASE_LABELS[phase]

    def _dispatch(self, func, args, kwargs):
        label = self._current_label()
        packet = getattr(func, "overloadpacket", None)
        aten = packet.__name__ if packet is not None else str(func)
        previous_ctx = self._ctx
        self._calls += 1
        self._ctx = (self.phase, self.step, self.micro_batch, label.op_name(aten), aten, label.module, self._calls)
        if self._cuda_probe:
            peak_before = self._cuda_counters()[1]
        wrapper = self.op_wrappers.get(packet)
        out = wrapper(func, args, kwargs) if wrapper is not None else func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) and next(_iter_tensors(out), None) is None:
            # Metadata queries (prim.device, sym_size...) reach this mode only for some tensor
            # types (fake tensors); they allocate nothing and must not change the free context.
            self._ctx = previous_ctx
            return out
        self.stats["ops"] += 1
        flags = {self._forced} if self._forced else set()
        if (self.autocast and func is _TO_COPY and args and isinstance(args[0], torch.Tensor)
                and self.phase in ("forward", "loss", "backward")
                and self._cdata(args[0]) in self._weight_cdatas):
            flags.add("weights")
            self.stats["weight_casts"] += 1
        if aten.startswith(("_scaled_dot_product", "_flash_attention", "_efficient_attention")):
            self.stats["kernel:" + aten] += 1
        for t in _iter_tensors(out):
            if self._sid_of(t) is None and self._trackable(t):
                self._new_record(t, set(flags))
        self._ctx = (*self._ctx[:6], 0)  # what is recorded after the op's outputs is no part of it
        for t in _iter_tensors(args):
            if self._sid_of(t) is None and self._trackable(t) and t.untyped_storage().nbytes() > 0:
                self.stats["untracked_inputs"] += 1
        if self._cuda_probe:
            self._probe_cuda(peak_before)
        return out

    def _probe_cuda(self, peak_before: int) -> None:
        """Allocator counters around one op (CUDA only).

        * If the op raised the allocator's running peak above what is allocated after it, the
          op had an internal transient (a kernel workspace, flash-attention's dq accumulator...):
          it is recorded as a temporary allocated and freed at once, so the replayed peak
          matches. Transients below the running peak are invisible here and do not matter for
          the peak.
        * With expandable segments (allocated = sum of rounded blocks), memory the op left
          allocated that no tracked storage explains is recorded as `other` (cuBLAS workspaces).
        """
        allocated, peak_after = self._cuda_counters()
        if self._detect_untracked:
            missing = allocated - self._live_bytes
            if missing > 0:
                self._synthetic(missing, {"other"}, "untracked allocation (cuBLAS workspace?)", free=False)
                self.stats["untracked_allocated_bytes"] += missing
        if peak_after > peak_before:
            transient = peak_after - allocated
            if transient > 0:
                self._synthetic(transient, {"temporaries"}, "op-internal transient", free=True)
                self.stats["op_internal_transients"] += 1

    def _cuda_counters(self) -> tuple[int, int]:
        """(allocated, peak allocated) bytes; the nested stats avoid memory_stats()' flattening."""
        stats = torch._C._cuda_memoryStats(self._cuda_index)["allocated_bytes"]["all"]
        return stats["current"], stats["peak"]

    def _synthetic(self, nbytes: int, flags: set, name: str, *, free: bool) -> None:
        sid = len(self.records)
        rec = StorageRecord(sid, nbytes, nbytes, "", (), flags, len(self.events), name)
        self.records.append(rec)
        self.events.append((ALLOC, sid, self._ctx))
        self._live_bytes += nbytes
        if free:
            rec.free_index = len(self.events)
            self.events.append((FREE, sid, self._ctx))
            self._live_bytes -= nbytes
        else:
            self._untracked_live += nbytes

    # ------------------------------------------------------------------ storages

    def _trackable(self, t: torch.Tensor) -> bool:
        if self.fake:
            if not isinstance(t, FakeTensor):
                return False  # a real constant being lifted into the fake world is not device memory
            device = t.fake_device  # t.device would dispatch prim.device through the fake mode
        else:
            if isinstance(t, FakeTensor):
                return False  # DTensor's sharding propagation inside a handler (track_inside): no memory
            device = t.device
        return device.type == self.device_type and not t.is_sparse

    @staticmethod
    def _cdata(t: torch.Tensor) -> int | None:
        try:
            return _local(t).untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None

    def _sid_of(self, t: torch.Tensor) -> int | None:
        cdata = self._cdata(t)
        return None if cdata is None else self._live.get(cdata)

    def _new_record(self, t: torch.Tensor, flags: set, name: str = "") -> int | None:
        t = _local(t)
        if not self._trackable(t):
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        cdata = storage._cdata
        sid = len(self.records)
        rec = StorageRecord(sid, nbytes, block_bytes(nbytes), str(t.dtype).replace("torch.", ""),
                            tuple(t.shape), flags, len(self.events), name)
        self.records.append(rec)
        self._live[cdata] = sid
        self._live_bytes += rec.block_bytes
        self.events.append((ALLOC, sid, self._ctx))
        fin = weakref.finalize(storage, self._on_free, cdata, sid)
        fin.atexit = False
        self._finalizers[sid] = fin
        return sid

    def _on_free(self, cdata: int, sid: int) -> None:
        self._finalizers.pop(sid, None)
        if self._closed:
            return
        if self._live.get(cdata) == sid:
            del self._live[cdata]
        rec = self.records[sid]
        rec.free_index = len(self.events)
        self.events.append((FREE, sid, self._ctx))
        self._live_bytes -= rec.block_bytes
        if self._in_gc:
            self.stats["freed_by_gc_bytes"] += rec.block_bytes
        if threading.get_ident() != self._thread:
            # The last reference went on another thread than the one tracking. On the CPU that is
            # gloo's worker, which releases a collective's tensors when its Work is done, now and
            # then after the tracking thread has dropped its own (FSDP2's all-gather buffers): the
            # free lands later than usual. (On CUDA the autograd engine's device threads run the
            # backward, so most of its frees count here.)
            self.stats["freed_off_thread_bytes"] += rec.block_bytes
            self._off_thread.add(sid)  # its event index could race with the tracking thread's appends

    def storage_resized(self, tensor: torch.Tensor, flag: str | None = None, name: str = "") -> None:
        """The storage of `tensor` was resized in place (`untyped_storage().resize_`, which no aten
        op reports): FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes and
        allocates it again by resizing it back. The old size is freed (its record ends) and a
        non-zero new size is a new record, flagged `flag` (or what `forced` imposes)."""
        t = _local(tensor)
        if not self._trackable(t):
            return
        storage = t.untyped_storage()
        cdata, nbytes = storage._cdata, storage.nbytes()
        sid = self._live.get(cdata)
        if sid is not None:
            if self.records[sid].nbytes == nbytes:
                return
            fin = self._finalizers.get(sid)
            if fin is not None:
                fin.detach()
            self._on_free(cdata, sid)
        if nbytes > 0:
            flags = {flag} if flag else ({self._forced} if self._forced else set())
            self._new_record(t, flags, name)

    # ------------------------------------------------------------------ results

    def analyze(self) -> dict:
        """Peak of the live block sum, its breakdown and context, and per-step peaks."""
        categories = [rec.category() for rec in self.records]
        per_category = dict.fromkeys(CATEGORIES, 0)
        live = live_requested = 0
        peak = peak_requested = -1
        peak_index = None
        peak_breakdown = dict(per_category)
        step_peaks: dict[int, int] = {}
        phase_events: list[tuple[tuple[int, int, str], int]] = []
        allocated_total = dict.fromkeys(CATEGORIES, 0)
        requested_total = dict.fromkeys(CATEGORIES, 0)
        for index, (kind, sid, ctx) in enumerate(self.events):
            rec = self.records[sid]
            category = categories[sid]
            phase_events.append(((ctx[1], ctx[2], ctx[0]), rec.block_bytes if kind == ALLOC else -rec.block_bytes))
            if kind == ALLOC:
                live += rec.block_bytes
                live_requested += rec.nbytes
                per_category[category] += rec.block_bytes
                allocated_total[category] += rec.block_bytes
                requested_total[category] += rec.nbytes
                if live > peak:
                    peak, peak_index, peak_breakdown = live, index, dict(per_category)
                peak_requested = max(peak_requested, live_requested)
                step = ctx[1]
                if step >= 1 and live > step_peaks.get(step, -1):
                    step_peaks[step] = live
            else:
                live -= rec.block_bytes
                live_requested -= rec.nbytes
                per_category[category] -= rec.block_bytes
        if peak_index is None:
            peak_ctx = ("setup", 0, 0, "setup", "", "", 0)
            peak = 0
        else:
            peak_ctx = self.events[peak_index][2]
        return {
            "peak_allocated_bytes": peak,
            "breakdown_at_peak": peak_breakdown,
            "peak": {"step": peak_ctx[1], "micro_batch": peak_ctx[2], "phase": peak_ctx[0],
                     "op": peak_ctx[3], "aten_op": peak_ctx[4], "module": peak_ctx[5]},
            "steps": [{"step": s, "peak_allocated_bytes": step_peaks[s]} for s in sorted(step_peaks)],
            "phases": as_rows(phase_peaks(phase_events)),
            "peak_requested_bytes": max(peak_requested, 0),
            "allocated_bytes_by_category": allocated_total,
            "requested_bytes_by_category": requested_total,
            "live_bytes_at_end": dict(per_category),
        }

    def trace_rows(self) -> Iterator[dict]:
        """Every event in order, for `--trace` (JSON lines)."""
        live = 0
        for index, (kind, sid, ctx) in enumerate(self.events):
            rec = self.records[sid]
            live += rec.block_bytes if kind == ALLOC else -rec.block_bytes
            row = {
                "i": index, "event": "alloc" if kind == ALLOC else "free", "sid": sid,
                "bytes": rec.block_bytes, "nbytes": rec.nbytes, "category": rec.category(),
                "dtype": rec.dtype, "shape": list(rec.shape),
                "phase": ctx[0], "step": ctx[1], "micro_batch": ctx[2], "op": ctx[3],
                "aten_op": ctx[4], "module": ctx[5], "live_bytes": live,
            }
            if ctx[6]:
                row["call"] = ctx[6]
            if kind == FREE and sid in self._off_thread:
                row["off_thread"] = True
            if rec.name:
                row["name"] = rec.name
            yield row


def _unpack(x):
    return x
