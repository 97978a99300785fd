"""Cross-checks of the tracker against PyTorch's own memory profiler (CPU).

`torch.profiler` with `profile_memory=True, record_shapes=True, with_stack=True` records every
allocation, and `torch.profiler._memory_profiler.MemoryProfile` (a private module, used by
`profile.export_memory_timeline`) gives each tensor version a category from the data flow of
the ops and the Python tracer: PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, INPUT,
TEMPORARY, AUTOGRAD_DETAIL. Its rules differ from ours (a category per version, ACTIVATION for
anything the forward made that the backward used, AUTOGRAD_DETAIL for gradients flowing between
ops), so only the categories both define the same way are compared: parameter, gradient and
optimizer-state bytes, as the sum over distinct tensors of their unrounded sizes.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .models import ModelSpec, build_real_model
from .recipe import Recipe
from .tracker import MemoryTracker
from .training import hf_loss_fn, run_steps, training_batch


def profiler_category_bytes(spec: ModelSpec, recipe: Recipe, *, steps: int = 2, seed: int = 0) -> dict[str, int]:
    """Run the reference steps under torch.profiler; bytes per profiler category (distinct tensors)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import TensorKey

    torch.manual_seed(seed)
    model = build_real_model(spec, recipe, "cpu")
    idle = MemoryTracker("cpu")  # never entered: run_steps' bookkeeping calls do nothing
    forward_and_loss = hf_loss_fn(model, recipe, idle)
    vocab = model.get_input_embeddings().weight.shape[0]

    def make_batch():
        return training_batch(recipe, vocab, "cpu")

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        run_steps(model, recipe, idle, device="cpu", make_batch=make_batch, forward_and_loss=forward_and_loss,
                  steps=steps)
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
