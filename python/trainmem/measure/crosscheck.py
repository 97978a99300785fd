"""Cross-checks of the tracker against PyTorch's own memory profiler (CPU).

Both run the reference step (training.run_steps) with a tracker that does nothing (NullTracker)
under `torch.profiler`, which records the CPU allocator's every allocation and free through
RecordFunction callbacks: nothing is wrapped and no reference is taken.

Categories (profiler_category_bytes): with `record_shapes=True, with_stack=True` too,
`torch.profiler._memory_profiler.MemoryProfile` (a private module, used by
`profile.export_memory_timeline`) gives each tensor version a category from the data flow of
the ops and the Python tracer: PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, INPUT,
TEMPORARY, AUTOGRAD_DETAIL. Its rules differ from ours (a category per version, ACTIVATION for
anything the forward made that the backward used, AUTOGRAD_DETAIL for gradients flowing between
ops), so only the categories both define the same way are compared: parameter, gradient and
optimizer-state bytes, as the sum over distinct tensors of their unrounded sizes.

The peak (untracked_peak): the tracker sees tensors through a TorchDispatchMode, and an active
Python mode is not neutral: ATen's `isTensorSubclassLike` is true for every tensor while one is
on, so code that picks an in-place path only for plain tensors takes the out-of-place one.
Autograd's InputBuffer is one (a gradient arriving at a tensor used twice is added into the
buffered one in place untracked, into a new tensor under the mode: `add_` against `add`), the
CPU's SDPA math kernel's mask another (docs/mechanics_notes.md §6.5). untracked_peak runs the same
loop (model, batch, optimizer) with no mode and no hooks, rounds each request up to 512 B as the
tracker does, and returns the live bytes at the start (the model's parameters and buffers) plus
the highest point of the running sum. tools/untracked_check.py compares it with the tracked peak
of the corpus's single-process CPU entries (docs/accuracy.md "Does the tracker change what it
measures?"). The profiler also sees allocations that are no tensor the mode returns (scratch
inside kernels, the checkpoint's CPU RNG states); they can only raise the untracked peak.
"""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict

import torch

from .models import ModelSpec, build_real_model, enable_checkpointing, resolve_model
from .phases import block_bytes
from .recipe import Recipe, RecipeError
from .run import SEED, _import_step_modules
from .training import hf_loss_fn, run_steps, training_batch


class NullTracker:
    """What run_steps and hf_loss_fn ask of a tracker, doing nothing and holding nothing;
    garbage is collected at the tracker's points."""

    autocast = False

    def set_phase(self, *args, **kwargs) -> None:
        pass

    def scope(self, *args, **kwargs):
        return contextlib.nullcontext()

    def forced(self, *args, **kwargs):
        return contextlib.nullcontext()

    def label_graph(self, *args, **kwargs) -> None:
        pass

    def mark(self, *args, **kwargs) -> None:
        pass

    def mark_gradients(self, *args, **kwargs) -> None:
        pass

    def mark_optimizer_state(self, *args, **kwargs) -> None:
        pass

    def collect_garbage(self) -> None:
        gc.collect(1)


def _profiled_steps(model, recipe: Recipe, steps: int, **profile_kwargs):
    """The reference steps of `model` under torch.profiler; the profile."""
    from torch.profiler import ProfilerActivity, profile

    tracker = NullTracker()
    forward_and_loss = hf_loss_fn(model, recipe, tracker)
    vocab = model.get_input_embeddings().weight.shape[0]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, **profile_kwargs) as prof:
        run_steps(model, recipe, tracker, device="cpu", make_batch=lambda: training_batch(recipe, vocab, "cpu"),
                  forward_and_loss=forward_and_loss, steps=steps)
    return prof


def profiler_category_bytes(spec: ModelSpec, recipe: Recipe, *, steps: int = 2, seed: int = 0) -> dict[str, int]:
    """Run the reference steps under torch.profiler; bytes per profiler category (distinct tensors)."""
    from torch.profiler._memory_profiler import TensorKey

    torch.manual_seed(seed)
    model = build_real_model(spec, recipe, "cpu")
    prof = _profiled_steps(model, recipe, steps, record_shapes=True, with_stack=True)
    memory_profile = prof._memory_profile()
    keys: dict[str, set] = defaultdict(set)
    for (key, _version), category in memory_profile._category_snapshot().items():
        if isinstance(key, TensorKey):
            keys["none" if category is None else category.name.lower()].add(key)
    sizes = memory_profile._size_map
    return {name: sum(sizes[k] for k in found) for name, found in keys.items()}


def parameter_bytes(spec: ModelSpec, recipe: Recipe) -> int:
    with torch.device("meta"):
        from .models import _causal_lm_from_config, hf_config

        model = _causal_lm_from_config(hf_config(spec.config), recipe)
    model.tie_weights()
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def _allocations(prof) -> list[tuple[int, int, int]]:
    """(time, address, signed bytes) of every CPU allocation and free the profiler recorded, in
    time order (no two share a timestamp)."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == torch.device("cpu").type:
            out.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    out.sort()
    return out


def untracked_refusal(recipe: Recipe) -> str | None:
    """Why untracked_peak does not run `recipe`, or None."""
    if recipe.is_parallel or recipe.is_pp or recipe.is_inference or recipe.is_quantized:
        return "the untracked check runs single-process training without a 4-bit or 8-bit base"
    if recipe.optimizer == "adamw-8bit":
        return "the untracked check does not run bitsandbytes' optimizer"
    return None


def untracked_peak(model: str | ModelSpec, recipe: Recipe, steps: int = 2) -> dict:
    """The peak allocated bytes of `steps` reference steps on the CPU, untracked."""
    refusal = untracked_refusal(recipe)
    if refusal is not None:
        raise RecipeError(refusal)
    spec = resolve_model(model) if isinstance(model, str) else model
    torch.manual_seed(SEED)
    model_obj = build_real_model(spec, recipe, "cpu")
    if recipe.checkpointing != "none":
        enable_checkpointing(model_obj, reentrant=recipe.checkpointing == "full-reentrant")
    # The bytes alive when the step starts: the parameters and buffers (one storage counted once).
    # The profiler reports no free of a block allocated before it started (torch warns instead),
    # so these stay counted throughout; nothing in the reference loop frees a parameter.
    start = {t.untyped_storage().data_ptr(): block_bytes(t.untyped_storage().nbytes())
             for t in list(model_obj.parameters()) + list(model_obj.buffers())}
    _import_step_modules(recipe)  # what imports make is not the step's (measure() does the same)
    gc.collect()
    gc.disable()  # as under the tracker: collections only at its points
    try:
        prof = _profiled_steps(model_obj, recipe, steps)
    finally:
        gc.enable()
    live: dict[int, int] = {}
    base = current = sum(start.values())
    peak = current
    for _, address, nbytes in _allocations(prof):
        if nbytes > 0:
            live[address] = block_bytes(nbytes)
            current += live[address]
            peak = max(peak, current)
        elif address in live:
            current -= live.pop(address)
    return {"peak_allocated_bytes": peak, "start_bytes": base}
