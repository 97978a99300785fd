"""Recipes from Hugging Face Trainer settings: "will this Trainer run fit?".

    >>> from transformers import TrainingArguments
    >>> args = TrainingArguments("out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
    ...                          bf16=True, gradient_checkpointing=True)
    >>> knobs = trainmem.hf.recipe_from_training_arguments(args, seq=2048)
    >>> trainmem.estimate("llama-3.1-8b", **knobs)

Only what trainmem models is mapped; a setting that would change memory in a way the engine does
not model raises ValueError naming it, rather than answering a different question.
"""
from __future__ import annotations

from typing import Any

# Trainer `optim` values and the optimizer each becomes in trainmem.
_OPTIMIZERS = {
    "adamw_torch": "adamw",          # torch.optim.AdamW; foreach is its CUDA default
    "adamw_torch_fused": "adamw-fused",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
    "adafactor": "adafactor",
}


def _get(args: Any, name: str, default: Any = None) -> Any:
    if isinstance(args, dict):
        return args.get(name, default)
    return getattr(args, name, default)


def recipe_from_training_arguments(args: Any, *, seq: int | None = None, model_dtype: str = "float32",
                                   gpu: str | None = None) -> dict[str, Any]:
    """Keyword arguments for trainmem.estimate / trainmem.fit from a `TrainingArguments` (or its
    `to_dict()`). `seq` is the tokens per sequence the data collator produces (TrainingArguments
    has none; TRL's `max_length` is used when present). `model_dtype` is the dtype the model was
    loaded in: "float32" (the default of from_pretrained without torch_dtype), or "bfloat16" /
    "float16", which with bf16/fp16 autocast means half weights and half optimizer states.

    Not modelled, so refused: DeepSpeed and FSDP (sharding is not in the engine yet), reentrant
    checkpointing, optimizers other than those of _OPTIMIZERS and SGD with momentum. The
    Trainer puts weight-decayed and other parameters in two optimizer groups; trainmem models one
    group, which for foreach AdamW keeps one set of sqrt temporaries for all parameters (an
    upper bound of the two-group figure).
    """
    if _get(args, "deepspeed"):
        raise ValueError("deepspeed: ZeRO sharding is not modelled yet; estimate without it or see issue 4")
    if _get(args, "fsdp"):
        raise ValueError("fsdp: FSDP sharding is not modelled yet; estimate without it or see issue 4")
    knobs: dict[str, Any] = {}
    knobs["batch"] = int(_get(args, "per_device_train_batch_size", 8))
    knobs["grad_accum"] = int(_get(args, "gradient_accumulation_steps", 1))
    if seq is None:
        seq = _get(args, "max_length") or _get(args, "max_seq_length")
    if seq is not None:
        knobs["seq"] = int(seq)

    bf16, fp16 = bool(_get(args, "bf16", False)), bool(_get(args, "fp16", False))
    if model_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model_dtype: expected float32, bfloat16 or float16, got {model_dtype!r}")
    if model_dtype == "float32":
        knobs["precision"] = "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"
    elif model_dtype == "bfloat16":
        if fp16:
            raise ValueError("fp16=True with a bfloat16 model is not a recipe trainmem models")
        knobs["precision"] = "bf16-true"
    else:
        if bf16:
            raise ValueError("bf16=True with a float16 model is not a recipe trainmem models")
        knobs["precision"] = "fp16-true"

    optim = str(getattr(_get(args, "optim", "adamw_torch_fused"), "value", _get(args, "optim", "adamw_torch_fused")))
    if optim == "sgd":
        optim_args = str(_get(args, "optim_args") or "")
        if "momentum" not in optim_args:
            raise ValueError("optim=sgd: the Trainer's SGD has no momentum by default; trainmem models SGD "
                             "with momentum (optim_args='momentum=0.9')")
        knobs["optimizer"] = "sgd"
    elif optim in _OPTIMIZERS:
        knobs["optimizer"] = _OPTIMIZERS[optim]
    else:
        raise ValueError(f"optim={optim!r} is not modelled; modelled: {', '.join(sorted(_OPTIMIZERS))}, sgd")

    if _get(args, "gradient_checkpointing", False):
        kwargs = _get(args, "gradient_checkpointing_kwargs") or {}
        if kwargs.get("use_reentrant", False):
            raise ValueError("gradient_checkpointing_kwargs use_reentrant=True is not modelled (non-reentrant is)")
        knobs["checkpointing"] = "full"
    else:
        knobs["checkpointing"] = "none"
    if _get(args, "use_liger_kernel", False):
        knobs["loss"] = "fused"  # Liger's fused linear cross-entropy
    if gpu is not None:
        knobs["gpu"] = gpu
    return knobs
