"""Recipe knobs of the measuring side, with the names, values and defaults of docs/schema.md."""

from __future__ import annotations

import dataclasses

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-true", "fp16-true")
OPTIMIZERS = ("adamw", "adamw-fused", "adamw-8bit", "sgd", "adafactor")
CHECKPOINTING = ("none", "full")
ATTENTIONS = ("eager", "sdpa", "flash")
LOSSES = ("standard", "fused")
ALLOCATORS = ("default", "expandable")

# Hugging Face's attn_implementation for each --attention value.
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


class RecipeError(ValueError):
    """A knob has a value the measuring side does not accept (user error, exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    batch: int = 1
    seq: int = 2048
    grad_accum: int = 1
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    checkpointing: str = "none"
    attention: str = "sdpa"
    loss: str = "standard"
    gpu: str = "cpu"
    allocator: str = "default"

    def __post_init__(self) -> None:
        for key in ("batch", "seq", "grad_accum"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RecipeError(f"{key} must be an integer >= 1, got {value!r}")
        for key, allowed in (
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("checkpointing", CHECKPOINTING),
            ("attention", ATTENTIONS),
            ("loss", LOSSES),
            ("allocator", ALLOCATORS),
        ):
            value = getattr(self, key)
            if value not in allowed:
                raise RecipeError(f"{key}={value!r} is not one of {', '.join(allowed)}")

    # --- what the precision policy means for dtypes -------------------------------------------

    @property
    def weight_dtype_name(self) -> str:
        """dtype the model is built in."""
        if self.precision in ("bf16-master", "bf16-true"):
            return "bfloat16"
        if self.precision == "fp16-true":
            return "float16"
        return "float32"

    @property
    def autocast_dtype_name(self) -> str | None:
        if self.precision == "bf16-mixed":
            return "bfloat16"
        if self.precision == "fp16-mixed":
            return "float16"
        return None

    @property
    def uses_grad_scaler(self) -> bool:
        return self.precision == "fp16-mixed"

    @property
    def uses_master_weights(self) -> bool:
        return self.precision == "bf16-master"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(f"unknown recipe key(s): {', '.join(unknown)}")
        return cls(**data)
