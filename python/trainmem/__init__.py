"""trainmem: GPU memory of a training step, simulated op by op.

    >>> import trainmem
    >>> est = trainmem.estimate("llama-3.1-8b", batch=1, seq=4096)
    >>> est.peak_allocated_bytes, est.breakdown_at_peak["activations"]

The numbers come from the C++ engine (trainmem._core); this module only turns its JSON into
Python objects. The measuring side (PyTorch) lives in trainmem.measure.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Estimate", "FitResult", "estimate", "fit", "models", "CATEGORIES", "RECIPE_DEFAULTS"]
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
    # Peak reserved bytes plus the CUDA context within the GPU's memory; None on the CPU.
    fits: bool | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # with phases=True
    source: str = "engine"
    # With gpus > 1: the rank these figures are (the worst unless `rank=` chose one) and every
    # rank replayed (docs/schema.md).
    rank: int = 0
    ranks: list[dict[str, int]] = field(default_factory=list)
    # With offload: the host memory of that rank (docs/schema.md, `host_bytes`); unmeasured.
    host_bytes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The object `trainmem estimate --json` prints (timeline and phases only when recorded)."""
        d = {k: v for k, v in self.__dict__.items() if k != "_text"}
        for recorded in ("timeline", "phases"):
            if not d[recorded]:
                del d[recorded]
        if self.recipe.get("gpus", 1) == 1 and self.recipe.get("pp", 1) == 1:  # a pipeline's ranks are its stages
            del d["rank"], d["ranks"]
        if not d["host_bytes"]:
            del d["host_bytes"]
        if d["fits"] is None:
            del d["fits"]
        return json.loads(json.dumps(d))

    def __str__(self) -> str:  # the terminal picture, as the CLI prints it
        return self._text

    _text: str = field(default="", repr=False, compare=False)


# Every recipe knob with its default, as docs/schema.md spells it.
RECIPE_DEFAULTS: dict[str, Any] = {
    "batch": 1,
    "seq": 2048,  # fewer where the model's learned positions end sooner (GPT-2: 1024): default_seq
    "grad_accum": 1,
    "precision": "",  # bf16-mixed for training, bf16-true for inference
    "optimizer": "adamw",
    "checkpointing": "none",
    "attention": "sdpa",
    "loss": "standard",
    "attention_mask": "none",  # the batch's attention_mask: none | ones | padded (Note [Padding masks])
    "gpu": "h100-80gb",
    "allocator": "default",
    "lora_rank": 0,
    "lora_targets": "default",
    "lora_dropout": 0.0,
    "load_in_4bit": False,  # BitsAndBytesConfig's spellings (QLoRA: True, "nf4", True)
    "bnb_4bit_quant_type": "fp4",
    "bnb_4bit_use_double_quant": False,
    "load_dtype": "auto",  # from_pretrained's dtype: auto (the precision's) | bf16 | fp16 (under its autocast; fp16 with adapters)
    "prepare_kbit_training": True,  # a half-loaded 4-bit base: False keeps what is not 4-bit half (sharded QLoRA)
    "bnb_4bit_quant_storage": "uint8",  # a 4-bit base: the packed weights' dtype, uint8 | bf16 (FSDP / ZeRO-3 QLoRA)
    "load_in_8bit": False,  # LLM.int8 weights (BitsAndBytesConfig(load_in_8bit=True)); inference only
    "mode": "training",
    "new_tokens": 128,
    "beams": 1,
    "gpus": 1,  # data-parallel ranks (with pp > 1: each stage's replicas); more than 1 needs parallel
    "parallel": "none",  # none | ddp | fsdp | zero1 | zero2 | zero3 (docs/parallelism.md)
    "tp": 1,  # tensor-parallel degree (docs/parallelism.md "Tensor parallelism")
    "sequence_parallel": False,  # with tp > 1: SequenceParallel on the norms ("Sequence parallelism")
    "loss_parallel": False,  # with tp > 1: vocab-parallel lm_head and loss_parallel() ("Loss parallel")
    "cp": 1,  # context-parallel degree, ring attention (docs/parallelism.md "Context parallelism"; unmeasured)
    "pp": 1,  # pipeline-parallel degree, one stage per GPU (docs/parallelism.md "Pipeline parallelism")
    "pp_schedule": "1f1b",  # with pp > 1: 1f1b | gpipe | interleaved-1f1b | looped-bfs
    "pp_stages_per_rank": 1,  # with interleaved-1f1b / looped-bfs: stages per GPU, 2 or more
    "fsdp_reshard_after_forward": True,  # parallel fsdp: False keeps the layers gathered (SHARD_GRAD_OP)
    "fsdp_replicate": 1,  # parallel fsdp: HSDP replica groups, mesh (fsdp_replicate, gpus / fsdp_replicate)
    "fsdp_param_dtype": "none",  # parallel fsdp, fp32: MixedPrecisionPolicy param_dtype, none | bf16
    "fsdp_reduce_dtype": "none",  # MixedPrecisionPolicy reduce_dtype, none | fp32 | bf16
    "ddp_find_unused_parameters": False,  # parallel ddp: find_unused_parameters=True (HF Trainer's default)
    "ddp_gradient_as_bucket_view": False,  # parallel ddp: gradient_as_bucket_view=True (one copy of the gradients)
    "ddp_no_sync": False,  # parallel ddp: no_sync() on every micro-batch but the step's last (Accelerate, HF Trainer)
    "fsdp_no_sync": False,  # parallel fsdp: set_requires_gradient_sync(False) until the step's last micro-batch
    "use_cache": False,  # training forwards build their DynamicCache (a Trainer run without checkpointing)
    "clip_grad_norm": False,  # clip_grad_norm_ before each optimizer step (Hugging Face's Trainer)
    "fp32_outputs": False,  # bf16-mixed / fp16-mixed: Accelerate's convert_outputs_to_fp32 (HF Trainer)
    "offload": "none",  # none | optimizer (DeepSpeed offload_optimizer, zero1 / zero2)
}
_COUNTS = ("batch", "seq", "grad_accum", "new_tokens", "beams", "gpus", "tp", "cp", "pp", "pp_stages_per_rank", "fsdp_replicate")


def _source(model: Any) -> bytes:
    """A model name or path as the engine takes it: bytes, so a path that is not UTF-8 works."""
    if isinstance(model, (str, bytes, os.PathLike)):
        source = model if isinstance(model, bytes) else os.fsencode(model)
        if b"\0" in source:  # the engine's paths end at a NUL; Python's open() refuses them too
            raise ValueError(f"model: a name or path cannot hold a NUL byte, got {model!r}")
        return source
    raise ValueError(f"model: expected a name or a path, got {type(model).__name__}")


def _unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _spelling(knobs: dict[str, Any]):
    """A _core.RecipeSpelling from keyword arguments; ValueError on a bad type or name."""
    from . import _core  # the compiled engine; imported here so trainmem.measure works without it

    unknown = sorted(set(knobs) - set(RECIPE_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown recipe knob(s): {', '.join(unknown)}")
    sp = _core.RecipeSpelling()
    for name, default in RECIPE_DEFAULTS.items():
        value = knobs.get(name, default)
        if name in _COUNTS or name == "lora_rank":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
            if value < (0 if name == "lora_rank" else 1):
                raise ValueError(f"{name}: must be a positive integer, got {value}")
            if value >= 2**64:
                raise ValueError(f"{name}: must be between 1 and 2^64-1, got {value}")
        elif name == "lora_dropout":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"lora_dropout: must be a number, got {value!r}")
            try:
                value = float(value)
            except OverflowError:
                raise ValueError("lora_dropout: must be a probability below 1, got a number too large for a float") \
                    from None
        elif isinstance(default, bool):  # the on/off knobs, as RECIPE_DEFAULTS has them
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be True or False, got {value!r}")
        elif name == "lora_targets" and isinstance(value, (list, tuple)):
            if not all(isinstance(t, str) for t in value):
                raise ValueError(f"lora_targets: must be module names, got {value!r}")
            value = ",".join(value)
        elif not isinstance(value, str):
            raise ValueError(f"{name}: must be a string, got {value!r}")
        if isinstance(value, str) and ("\0" in value or _unencodable(value)):
            raise ValueError(f"{name}: {value!r} is not a value trainmem reads (a NUL byte or a lone surrogate)")
        setattr(sp, name, value)
    return sp


def estimate(model: str, *, timeline: bool = False, phases: bool = False, rank: int | None = None,
             **recipe: Any) -> Estimate:
    """Peak memory of one training step. Recipe knobs are keyword arguments with the names and
    defaults of RECIPE_DEFAULTS (the CLI's flags). With gpus > 1 the figures are the worst rank's,
    or rank `rank`'s (0 .. gpus - 1; with pp > 1, 0 .. gpus x pp - 1, rank = stage x gpus + dp
    rank). `timeline` and `phases` add the CLI's --timeline and --phases lists. Raises ValueError
    on bad input."""
    from . import _core

    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**63):
        raise ValueError(f"rank: must be a rank number 0 .. gpus - 1 or None (the worst rank), got {rank!r}")
    core = _core.estimate(_source(model), _spelling(recipe), bool(timeline), bool(phases),
                          -1 if rank is None else rank, "seq" in recipe)
    data = json.loads(core.to_json())
    data["_text"] = core.to_text().decode("utf-8", "replace")
    return Estimate(**data)


@dataclass(frozen=True)
class FitResult:
    """The same fields as `trainmem fit --json` (docs/planner.md)."""

    model: str
    device: dict[str, Any]
    gpus: int
    global_batch: int
    capacity_bytes: int
    host_capacity_bytes: int
    searched: int
    simulated: int
    pruned: int
    plans: list[dict[str, Any]]
    baseline: dict[str, Any]
    changes: list[dict[str, Any]]
    closest_miss: dict[str, Any] | None
    fits_on: list[dict[str, Any]] = field(default_factory=list)  # when nothing fits: bigger GPUs that do
    # When no full fine-tuning recipe fits: plans with LoRA 16, or QLoRA 16 where LoRA does not fit
    adapter_plans: list[dict[str, Any]] = field(default_factory=list)
    baseline_moved: bool = False  # the global batch does not split over the GPUs: baseline as pp or tp
    batch_grown: bool = False  # no batch given: the baseline's micro-batch grew to reach the global batch
    source: str = "engine"
    _text: str = field(default="", repr=False, compare=False)

    def __str__(self) -> str:  # the table `trainmem fit` prints
        return self._text


def fit(model: str, *, gpus: int = 1, global_batch: int | None = None, top: int = 10,
        host_memory_gib: int | None = None, **recipe: Any) -> FitResult:
    """Recipes that fit `gpu` (a recipe knob, default h100-80gb), fastest first, plus what each
    single change of the given recipe saves; when nothing fits, what it takes (`fits_on`) and,
    for full fine-tuning, whether LoRA or QLoRA adapters would fit instead (`adapter_plans`). Of the knobs the planner searches (_core.fit_knobs():
    batch, precision, optimizer, checkpointing, attention, loss, allocator, parallel, offload, tp),
    those passed here are held and
    the others searched, as with `trainmem fit`. `host_memory_gib` is the host RAM each GPU's rank
    may use under CPU offload (`--host-memory`; None: the default, 128 GiB). Raises ValueError on
    bad input."""
    from . import _core

    for name, value in (("gpus", gpus), ("top", top), ("global_batch", 1 if global_batch is None else global_batch),
                        ("host_memory_gib", 1 if host_memory_gib is None else host_memory_gib)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**64:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if host_memory_gib is not None and host_memory_gib > 2**20:
        raise ValueError(f"host_memory: must be between 1 and 1048576 GiB of host memory per GPU, got {host_memory_gib}")
    if global_batch is not None and "grad_accum" in recipe:
        raise ValueError("grad_accum: with global_batch the planner chooses the accumulation; give global_batch or "
                         "grad_accum (with batch and gpus), not both")
    host = _core.DEFAULT_HOST_MEMORY_BYTES if host_memory_gib is None else host_memory_gib << 30
    fixed = [k for k in _core.fit_knobs() if k in recipe]
    spelling = _spelling(recipe)
    if spelling.parallel != "none":  # a data-parallel base recipe runs on all the GPUs
        spelling.gpus = gpus
    out, text = _core.fit(_source(model), spelling, gpus, global_batch or 0, fixed, top, host, "seq" in recipe)
    data = json.loads(out)
    data["_text"] = text.decode("utf-8", "replace")
    return FitResult(**data)


def __getattr__(name: str) -> Any:  # trainmem.hf without importing it eagerly
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'trainmem' has no attribute {name!r}")


def models() -> list[dict[str, Any]]:
    """The built-in catalog: name, hf_id, family, parameters."""
    from . import _core

    return json.loads(_core.catalog_json())
