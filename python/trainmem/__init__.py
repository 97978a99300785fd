"""trainmem: GPU memory of a training step, simulated op by op.

    >>> import trainmem
    >>> est = trainmem.estimate("llama-3.1-8b", batch=1, seq=4096)
    >>> est.peak_allocated_bytes, est.breakdown_at_peak["activations"]

The numbers come from the C++ engine (trainmem._core); this module only turns its JSON into
Python objects. The measuring side (PyTorch) lives in trainmem.measure.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Estimate", "estimate", "models", "CATEGORIES"]
__version__ = "0.1.0"

CATEGORIES = ("weights", "optimizer_states", "gradients", "activations", "temporaries", "other")


@dataclass(frozen=True)
class Estimate:
    """The same fields as `trainmem estimate --json` (docs/schema.md)."""

    model: str
    parameters: int
    trainable_parameters: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    breakdown_at_peak: dict[str, int]
    peak: dict[str, Any]
    steps: list[dict[str, int]]
    device: dict[str, Any]
    recipe: dict[str, Any]
    timeline: list[dict[str, Any]] = field(default_factory=list)
    source: str = "engine"

    def to_dict(self) -> dict[str, Any]:
        """The object `trainmem estimate --json` prints (timeline only when recorded)."""
        d = {k: v for k, v in self.__dict__.items() if k != "_text"}
        if not d["timeline"]:
            del d["timeline"]
        return json.loads(json.dumps(d))

    def __str__(self) -> str:  # the terminal picture, as the CLI prints it
        return self._text

    _text: str = field(default="", repr=False, compare=False)


def estimate(
    model: str,
    *,
    batch: int = 1,
    seq: int = 2048,
    grad_accum: int = 1,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    checkpointing: str = "none",
    attention: str = "sdpa",
    loss: str = "standard",
    gpu: str = "h100-80gb",
    allocator: str = "default",
    timeline: bool = False,
) -> Estimate:
    """Peak memory of one training step. Raises ValueError on bad input."""
    for name, value in (("batch", batch), ("seq", seq), ("grad_accum", grad_accum)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value}")
        if value >= 2**64:
            raise ValueError(f"{name}: must be between 1 and 2^64-1, got {value}")
    from . import _core  # the compiled engine; imported here so trainmem.measure works without it

    core = _core.estimate(str(model), batch, seq, grad_accum, precision, optimizer, checkpointing,
                          attention, loss, gpu, allocator, timeline)
    data = json.loads(core.to_json())
    data["_text"] = core.to_text()
    return Estimate(**data)


def models() -> list[dict[str, Any]]:
    """The built-in catalog: name, hf_id, family, parameters."""
    from . import _core

    return json.loads(_core.catalog_json())
