"""trainmem's measuring side: what PyTorch really allocates in a training step (or a generate()
call), by category.

See `training` for the reference step both sides model, `generation` for the reference
generation, `tracker` for how every storage is recorded and categorised, and `cli` for
`trainmem-measure`.
"""

import os

# Before torch is imported: its CPU kernels capped at AVX2, so that bitsandbytes registers the
# generic kernels the engine models, and oneDNN's with them, so that bf16 SDPA takes the same path
# (Note [bitsandbytes' CPU kernels] in models.py).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

from .recipe import Recipe, RecipeError  # noqa: E402
from .run import DeviceError, measure  # noqa: E402
from .models import ModelError, ModelSpec, resolve_model  # noqa: E402
from .tracker import CATEGORIES, MemoryTracker, block_bytes  # noqa: E402

__all__ = ["CATEGORIES", "DeviceError", "MemoryTracker", "ModelError", "ModelSpec", "Recipe", "RecipeError",
           "block_bytes", "measure", "resolve_model"]
