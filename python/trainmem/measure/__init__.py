"""trainmem's measuring side: what PyTorch really allocates in a training step (or a generate()
call), by category.

See `training` for the reference step both sides model, `generation` for the reference
generation, `tracker` for how every storage is recorded and categorised, and `cli` for
`trainmem-measure`.
"""

from .recipe import Recipe, RecipeError
from .run import DeviceError, measure
from .models import ModelError, ModelSpec, resolve_model
from .tracker import CATEGORIES, MemoryTracker, block_bytes

__all__ = ["CATEGORIES", "DeviceError", "MemoryTracker", "ModelError", "ModelSpec", "Recipe", "RecipeError",
           "block_bytes", "measure", "resolve_model"]
