"""Recipes from Hugging Face Trainer settings: "will this Trainer run fit?".

    >>> from transformers import TrainingArguments
    >>> args = TrainingArguments("out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
    ...                          bf16=True, gradient_checkpointing=True)
    >>> knobs = trainmem.hf.recipe_from_training_arguments(args, seq=2048)
    >>> trainmem.estimate("llama-3.1-8b", **knobs)

Only what trainmem models is mapped; a setting that would change memory in a way the engine does
not model raises ValueError naming it, rather than answering a different question.

    >>> trainmem.hf.recipe_from_deepspeed_config("ds_zero2.json", seq=2048, gpus=8)
    {'parallel': 'zero2', 'batch': 4, 'grad_accum': 1, 'gpus': 8, 'precision': 'bf16-master', 'optimizer': 'adamw-fused', 'seq': 2048}
"""
from __future__ import annotations

import json
import os
import sys
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


def _section(value: Any, what: str) -> dict[str, Any]:
    """A nested settings object (a DeepSpeed section, accelerator_config's kwargs): {} when absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected an object, got {value!r}"[:300])
    return value


def _flag(holder: Any, name: str, what: str | None = None) -> bool:
    """A boolean setting of a TrainingArguments, its dict or a config dict, read as transformers
    reads it (absent or None: False; "false" is false)."""
    value = _get(holder, name)
    return False if value is None else _str_to_bool(value, what or name)


def _str_to_bool(value: Any, what: str) -> bool:
    """A setting's truth as transformers and Accelerate read it (accelerate's str_to_bool):
    booleans as they are, y/yes/t/true/on/1 and n/no/f/false/off/0 in any case; anything else is
    an error naming `what`."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True
    if text in ("n", "no", "f", "false", "off", "0"):
        return False
    raise ValueError(f"{what}={value!r}: expected true or false")


def _half(args: Any, name: str) -> bool:
    """Whether the Trainer runs under `name` ("bf16" or "fp16") mixed precision: its flag, or, when
    neither flag is set, ACCELERATE_MIXED_PRECISION as TrainingArguments read it into
    `mixed_precision` (what the Trainer hands Accelerate). to_dict() leaves that attribute out, so
    for a dict without it the variable is read here."""
    mixed = _get(args, "mixed_precision")
    if mixed is None and isinstance(args, dict) and not (args.get("bf16") or args.get("fp16")):
        mixed = os.environ.get("ACCELERATE_MIXED_PRECISION")
    return _flag(args, name) or mixed == name


def _accelerator_config(args: Any) -> dict[str, Any]:
    """The Trainer's accelerator_config (an AcceleratorConfig, a dict, or its JSON path) as a dict."""
    config = _get(args, "accelerator_config")
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return _section(config.to_dict(), "accelerator_config")
    return _json_object(config, "accelerator_config")


def _grad_acc_kwargs(args: Any) -> dict[str, Any]:
    """accelerator_config's gradient_accumulation_kwargs (num_steps, sync_each_batch)."""
    return _section(_accelerator_config(args).get("gradient_accumulation_kwargs"),
                    "accelerator_config gradient_accumulation_kwargs")


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what}: expected a positive integer, got {value!r}")
    return value


def _trainer_checkpointing(args: Any) -> str:
    """The checkpointing the Trainer turns on: transformers' activation_checkpointing_enable with
    the arguments' kwargs, every_n_layers and offload taken out, as Trainer._inner_training_loop
    does. An empty rest is passed as None, which transformers makes use_reentrant=False; any other
    rest goes to torch.utils.checkpoint as it is, where a missing (or None) use_reentrant is torch's
    default, the reentrant variant."""
    kwargs = _get(args, "activation_checkpointing_kwargs") or _get(args, "gradient_checkpointing_kwargs") or {}
    if isinstance(kwargs, str):  # TrainingArguments takes them as a JSON string too
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"gradient_checkpointing_kwargs: not JSON: {e.msg}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"gradient_checkpointing_kwargs: expected a dict, got {type(kwargs).__name__}")
    kwargs = dict(kwargs)
    if kwargs.pop("every_n_layers", 1) != 1:
        raise ValueError("gradient_checkpointing_kwargs every_n_layers: checkpointing every n-th layer is not "
                         "modelled (every layer is)")
    if kwargs.pop("offload", False):
        raise ValueError("gradient_checkpointing_kwargs offload: checkpoints saved to the CPU are not modelled")
    if kwargs.get("early_stop", True) is False:
        raise ValueError("gradient_checkpointing_kwargs early_stop=False: a recompute run to the end of each layer "
                         "is not modelled (the default early stop is)")
    if not kwargs:
        return "full"
    return "full" if kwargs.get("use_reentrant") is False else "full-reentrant"


def _refuse_reentrant_find_unused(knobs: dict[str, Any]) -> dict[str, Any]:
    """DDP with find_unused_parameters fails under reentrant checkpoints (its forward marks the
    parameters the no_grad forward left out of the graph ready, and their hooks fire again in
    backward: "Expected to mark a variable ready only once"); the Trainer passes True for a peft
    model unless ddp_find_unused_parameters says otherwise."""
    if knobs.get("checkpointing") == "full-reentrant" and knobs.get("ddp_find_unused_parameters"):
        raise ValueError("reentrant checkpointing under DDP with find_unused_parameters=True (the Trainer's choice "
                         "for a peft model or an unset ddp_find_unused_parameters) fails in torch (\"Expected to mark a "
                         "variable ready only once\"); set ddp_find_unused_parameters=False")
    return knobs


def recipe_from_training_arguments(args: Any, *, seq: int | None = None, model_dtype: str = "float32",
                                   gpu: str | None = None, gpus: int | None = None,
                                   peft: Any = False, quantization_config: Any = None,
                                   prepare_kbit_training: bool = True,
                                   kbit_gradient_checkpointing: bool | None = None,
                                   model_use_cache: bool = True) -> dict[str, Any]:
    """Keyword arguments for trainmem.estimate / trainmem.fit from a `TrainingArguments` (or its
    `to_dict()`). `seq` is the tokens per sequence the data collator produces (TrainingArguments
    has none; TRL's `max_length` is used when present). `model_dtype` is the dtype the model was
    loaded in: "float32" (the default of from_pretrained without torch_dtype), or "bfloat16" /
    "float16": half weights and half optimizer states (bf16-true / fp16-true without bf16=True /
    fp16=True). With bf16=True a bfloat16 model trains under bf16 autocast (precision bf16-mixed
    with load_dtype bf16), but under FSDP, where Accelerate casts its trainable parameters to fp32
    first (a float32 model's recipe). Under FSDP with bf16=True a float32 model's recipe has
    Accelerate's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) under autocast
    (fsdp_param_dtype and fsdp_reduce_dtype bf16, also over a half-loaded peft model and a 4-bit
    base stored as bf16; a uint8-stored one under FSDP is refused: Accelerate leaves it unsharded);
    with `peft=True` and bf16=True / fp16=True, the half model's fp32 adapters under autocast
    (bf16-mixed / fp16-mixed with load_dtype bf16 / fp16). A float16 model trained whole with
    fp16=True is refused: the GradScaler refuses fp16 gradients.

    `gpus` is the number of processes the run is launched with (torchrun / accelerate launch);
    TrainingArguments cannot know it. With more than one, the Trainer wraps the model in
    DistributedDataParallel, or FSDP / DeepSpeed when `fsdp` / `deepspeed` say so: `fsdp` maps to
    parallel fsdp when it is FSDP2 (transformers' default; `fsdp_config` version 1 is refused) with
    full sharding or shard_grad_op, one unit per decoder layer, and its "offload" (or `fsdp_config["cpu_offload"]`) to offload "both" (FSDP2's
    CPUOffloadPolicy); `deepspeed` (a dict or a JSON path) is read by recipe_from_deepspeed_config, with
    its "auto" values filled from these arguments as the Trainer fills them. Under DDP the Trainer
    passes `find_unused_parameters` as `ddp_find_unused_parameters` says, and when that is unset
    True for a model that is not a PreTrainedModel (`peft=True`: a peft model, whose adapters the
    caller gives as lora_rank etc., or passes its LoraConfig as `peft`, mapped by
    recipe_from_lora_config) and for one that is not checkpointed: the recipe's
    `ddp_find_unused_parameters` (docs/parallelism.md "find_unused_parameters"). With
    accumulation the Trainer runs every micro-batch but the last under accelerator.no_sync (unless
    accelerator_config's gradient_accumulation_kwargs say sync_each_batch): under DDP the recipe's
    `ddp_no_sync`, under FSDP2 `fsdp_no_sync` (unsharded gradients held through the accumulation).
    accelerator_config's num_steps is the accumulation; its split_batches and a
    parallelism_config are refused. bf16 / fp16 left unset, the precision is
    ACCELERATE_MIXED_PRECISION's, as TrainingArguments read it into `mixed_precision`. Under bf16 /
    fp16 mixed precision Accelerate wraps the forward in convert_outputs_to_fp32 (`fp32_outputs`).

    `quantization_config` is the model's BitsAndBytesConfig (or its to_dict(), as
    `model.config.quantization_config` holds it) for a QLoRA run: a 4-bit base prepared with
    peft's `prepare_model_for_kbit_training` (which makes everything but the 4-bit weights fp32)
    and trained through adapters (`peft=True` and the caller gives lora_rank etc., or `peft=` the
    LoraConfig). See
    recipe_from_quantization_config for what it maps; `prepare_kbit_training=False` when the base
    was not prepared (TRL's SFTTrainer with a base sharded by FSDP or ZeRO-3). A prepared base
    whose Trainer does not checkpoint needs `kbit_gradient_checkpointing`: whether it was prepared
    with use_gradient_checkpointing=True (peft's default, which turns on checkpointing with no
    kwargs, which transformers makes use_reentrant=False: recipe checkpointing full) or False (no
    checkpointing). With gradient_checkpointing=True the Trainer's own replaces peft's. (TRL's
    SFTTrainer prepares the base itself and may turn the Trainer's off: say what its call did.)

    Checkpointing: the Trainer's gradient_checkpointing (activation_checkpointing) is full
    (use_reentrant=False, what transformers passes for empty kwargs) or full-reentrant (kwargs with
    use_reentrant=True, or without it: torch's default); every_n_layers other than 1, offload and
    early_stop=False are refused.

    Every optimizer step the Trainer calls accelerator.clip_grad_norm_ (also with max_grad_norm 0,
    to log the norm, which skips the clip's four 0-dim coefficients): the recipe's
    `clip_grad_norm`, on one GPU and under DDP. DeepSpeed clips in its own step. Under FSDP2 the
    norms over DTensors are not modelled and left out: on CUDA each rank's buffer of partial sums
    (its gradients x the largest one's 65,536-element chunks, 4 bytes each: ~9 MB for an 8B model
    on one GPU) and the kept 0-dim total.

    `model_use_cache` is the model config's use_cache (True for most published configs): a Trainer
    run without checkpointing keeps it, so each training forward copies every layer's keys and
    values into a DynamicCache held to the loss (the recipe's `use_cache`): pass False where the run
    sets model.config.use_cache = False, as many fine-tuning scripts do.

    Not modelled, so refused: FSDP1, FSDP2's hybrid sharding options, FSDP's own
    activation_checkpointing (checkpoint_wrapper) and size-based wrapping, checkpointing of every
    n-th layer or offloaded, optimizers other than those of _OPTIMIZERS and SGD with momentum,
    label smoothing, torch_compile, DDP's bucket_cap_mb, broadcast_buffers and static_graph away
    from their defaults, and what recipe_from_deepspeed_config refuses. The Trainer puts weight-decayed and other parameters in
    two optimizer groups; trainmem models one group, which for foreach AdamW keeps one set of sqrt
    temporaries for all parameters (an upper bound of the two-group figure).
    """
    if not isinstance(args, dict) and not hasattr(args, "per_device_train_batch_size"):
        raise ValueError(f"args: expected a TrainingArguments or its to_dict(), got {type(args).__name__}")
    if peft is None:
        peft = False
    if isinstance(peft, dict) and len(peft) == 1 and not isinstance(next(iter(peft.values())), (int, float, str, bool)):
        peft = next(iter(peft.values()))  # a peft model's peft_config: {"default": LoraConfig(...)}
    if peft is not False and peft is not True:  # a LoraConfig: its knobs join the Trainer's
        knobs = recipe_from_training_arguments(args, seq=seq, model_dtype=model_dtype, gpu=gpu, gpus=gpus, peft=True,
                                               quantization_config=quantization_config,
                                               prepare_kbit_training=prepare_kbit_training,
                                               kbit_gradient_checkpointing=kbit_gradient_checkpointing,
                                               model_use_cache=model_use_cache)
        knobs.update(recipe_from_lora_config(peft))
        return knobs
    if quantization_config is not None:
        if not peft:
            raise ValueError("quantization_config: a 4-bit base is trained through adapters (QLoRA); pass peft= the "
                             "LoraConfig (or peft=True and the adapters' lora_rank)")
        # prepare_model_for_kbit_training makes the rest fp32 whatever the load dtype: the Trainer's
        # precision is that of a float32 model (DeepSpeed's bf16 mode casts it back).
        knobs = recipe_from_training_arguments(args, seq=seq, model_dtype="float32", gpu=gpu, gpus=gpus, peft=True,
                                               model_use_cache=model_use_cache)
        knobs.update(recipe_from_quantization_config(quantization_config, model_dtype=model_dtype,
                                                     precision=knobs.get("precision", "fp32"),
                                                     prepare_kbit_training=prepare_kbit_training))
        if knobs.get("parallel") == "fsdp" and knobs.get("bnb_4bit_quant_storage") != "bf16":
            # fsdp2_prepare_model passes non-floating frozen Params4bit to fully_shard as ignored_params:
            # every rank would hold the whole uint8 base, which the engine (it shards them) does not model.
            raise ValueError("quantization_config: under FSDP, Accelerate leaves uint8-stored 4-bit weights out of "
                             "fully_shard (each rank holds the whole base), which is not modelled; FSDP-QLoRA sets "
                             "bnb_4bit_quant_storage=torch.bfloat16, which is")
        if prepare_kbit_training and knobs.get("checkpointing", "none") == "none":
            # peft's prepare_model_for_kbit_training(use_gradient_checkpointing=True) calls
            # activation_checkpointing_enable with its activation_checkpointing_kwargs, None by
            # default, which transformers makes {"use_reentrant": False}: the non-reentrant
            # checkpoint. The Trainer does not touch it without gradient_checkpointing.
            if kbit_gradient_checkpointing is None:
                raise ValueError("quantization_config: without the Trainer's gradient_checkpointing, whether the run "
                                 "checkpoints depends on prepare_model_for_kbit_training: pass "
                                 "kbit_gradient_checkpointing=True (use_gradient_checkpointing=True, its default: "
                                 "non-reentrant checkpointing) or False (use_gradient_checkpointing=False: none)")
            if kbit_gradient_checkpointing:
                knobs["checkpointing"] = "full"
                knobs.pop("use_cache", None)  # checkpointing turns the cache off
        return _refuse_reentrant_find_unused(knobs)
    _refuse_unmodelled_trainer_settings(args)
    if _get(args, "deepspeed"):
        if _get(args, "fsdp"):
            raise ValueError("fsdp and deepspeed: the Trainer takes one or the other, not both")
        if "num_steps" in _grad_acc_kwargs(args):
            raise ValueError("accelerator_config gradient_accumulation_kwargs num_steps under DeepSpeed: not mapped; "
                             "set gradient_accumulation_steps")
        knobs = recipe_from_deepspeed_config(_get(args, "deepspeed"), seq=seq, gpus=gpus, training_arguments=args,
                                             gpu=gpu)
        # DeepSpeed's bf16 mode casts the model itself; its fp32 mode trains what it is given.
        if model_dtype != "float32" and knobs["precision"] != "bf16-master":
            raise ValueError(f"model_dtype={model_dtype!r} under DeepSpeed without its bf16 mode: a half model "
                             "trained without master weights by a ZeRO optimizer is not modelled")
        return _liger_and_cache(args, knobs, model_use_cache)
    knobs: dict[str, Any] = {}
    if _get(args, "fsdp"):
        knobs.update(_fsdp_knobs(args))
    if gpus is not None:
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise ValueError(f"gpus: expected a positive integer, got {gpus!r}")
        knobs["gpus"] = gpus
        if gpus > 1 and "parallel" not in knobs:
            knobs["parallel"] = "ddp"  # the Trainer's DistributedDataParallel (find_unused_parameters below)
    elif "parallel" in knobs:
        raise ValueError("fsdp: pass gpus= (the number of processes the run is launched with)")
    knobs["batch"] = _positive_int(_get(args, "per_device_train_batch_size", 8), "per_device_train_batch_size")
    knobs["grad_accum"] = _positive_int(_get(args, "gradient_accumulation_steps", 1), "gradient_accumulation_steps")
    num_steps = _grad_acc_kwargs(args).get("num_steps")
    if num_steps is not None:
        # The Trainer takes it as its gradient_accumulation_steps, and refuses both at once.
        if knobs["grad_accum"] > 1:
            raise ValueError("accelerator_config gradient_accumulation_kwargs num_steps with "
                             "gradient_accumulation_steps > 1: the Trainer refuses both")
        knobs["grad_accum"] = _positive_int(num_steps, "accelerator_config gradient_accumulation_kwargs num_steps")
    if seq is None:
        seq = _get(args, "max_length") or _get(args, "max_seq_length")
    if seq is not None:
        knobs["seq"] = _positive_int(seq, "seq")

    bf16, fp16 = _half(args, "bf16"), _half(args, "fp16")
    if model_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model_dtype: expected float32, bfloat16 or float16, got {model_dtype!r}")
    if model_dtype == "float32":
        knobs["precision"] = "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32"
    elif model_dtype == "bfloat16":
        if fp16:
            raise ValueError("fp16=True with a bfloat16 model is not a recipe trainmem models")
        knobs["precision"] = "bf16-true"
        if bf16 and (peft or knobs.get("parallel") != "fsdp"):
            # The half model (and a peft model's fp32 adapters) under bf16 autocast: load_dtype bf16,
            # measured (cpu-*-loadbf16-*).
            knobs["precision"], knobs["load_dtype"] = "bf16-mixed", "bf16"
        elif bf16:
            # Accelerate's fsdp2_prepare_model casts every trainable parameter that is not fp32 to
            # fp32 when mixed precision is on: the whole model's, so the run is a float32 model's.
            knobs["precision"] = "bf16-mixed"
    else:
        if bf16:
            raise ValueError("bf16=True with a float16 model is not a recipe trainmem models")
        if fp16 and not peft:
            raise ValueError("fp16=True with a float16 model trained whole: the GradScaler refuses fp16 gradients "
                             "(\"Attempting to unscale FP16 gradients\"); load it in float32 or bfloat16")
        knobs["precision"] = "fp16-true"
        if fp16 and peft and knobs.get("parallel") != "fsdp":  # FSDP2 under fp16 autocast is not modelled
            knobs["precision"], knobs["load_dtype"] = "fp16-mixed", "fp16"
    if knobs.get("parallel") == "fsdp" and knobs["precision"] == "bf16-mixed":
        # Accelerate's FSDP2 with mixed precision bf16 shards the parameters under
        # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) and still runs the forward under
        # autocast (measured: parallel/cpu-fsdp-*-bf16mixed-*-bf16params-bf16reduce-*, a half-loaded
        # peft model's frozen bf16 shards included).
        knobs["fsdp_param_dtype"], knobs["fsdp_reduce_dtype"] = "bf16", "bf16"
    if knobs["precision"] in ("bf16-mixed", "fp16-mixed"):
        # Accelerate's native mixed precision wraps the forward in convert_outputs_to_fp32: the half
        # logits copied to fp32 as it returns (Note [Outputs converted to fp32] in graph/step.cpp).
        knobs["fp32_outputs"] = True

    knobs["optimizer"] = _trainer_optimizer(args)

    # transformers 5 names them activation_checkpointing*, the gradient_checkpointing* spellings
    # being deprecated aliases that a TrainingArguments mirrors but a hand-made dict may not.
    checkpointed = _flag(args, "activation_checkpointing") or _flag(args, "gradient_checkpointing")
    knobs["checkpointing"] = _trainer_checkpointing(args) if checkpointed else "none"
    if knobs.get("parallel") == "ddp":
        # Trainer._build_accelerator_args passes these to DistributedDataParallel when they are set.
        for name, modelled in (("ddp_bucket_cap_mb", 25), ("ddp_broadcast_buffers", True), ("ddp_static_graph", False)):
            if _get(args, name) not in (None, modelled):
                raise ValueError(f"{name}={_get(args, name)!r}: DistributedDataParallel's default ({modelled}) is "
                                 "modelled; remove it to estimate with the default")
        # Trainer._build_accelerator_args: the argument when set, else True for a model that is not a
        # PreTrainedModel (a peft model) and for one that is not checkpointed.
        find_unused = _get(args, "ddp_find_unused_parameters")
        if find_unused is None:
            find_unused = peft or not checkpointed
        if find_unused:
            knobs["ddp_find_unused_parameters"] = True
    if knobs["grad_accum"] > 1 and not _grad_acc_kwargs(args).get("sync_each_batch", False):
        # The Trainer runs every micro-batch but the last under accelerator.no_sync (unless
        # sync_each_batch): DDP's no_sync, FSDP2's set_requires_gradient_sync(False).
        if knobs.get("parallel") == "ddp":
            knobs["ddp_no_sync"] = True  # Note [DDP no_sync]
        elif knobs.get("parallel") == "fsdp":
            knobs["fsdp_no_sync"] = True  # Note [FSDP2 no_sync]: unsharded gradients held to the last
    _liger_and_cache(args, knobs, model_use_cache)
    if knobs.get("parallel") != "fsdp":
        # Every optimizer step: accelerator.clip_grad_norm_ (max_grad_norm, or inf to log the norm
        # when it is 0), modelled outside DeepSpeed and FSDP (Note [Gradient clipping]).
        knobs["clip_grad_norm"] = True
    if gpu is not None:
        knobs["gpu"] = gpu
    return _refuse_reentrant_find_unused(knobs)


# Liger's kernels other than its loss, on by default in apply_liger_kernel_to_<model>: they replace
# Hugging Face's RMSNorm, MLP and rotary ops with kernels that save other tensors (not modelled).
_LIGER_OTHER_KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "layer_norm")


def _liger_and_cache(args: Any, knobs: dict[str, Any], model_use_cache: bool) -> dict[str, Any]:
    """Liger's fused linear cross-entropy, which the Trainer applies first (use_liger_kernel, with
    liger_kernel_config's keyword arguments); and the training forward's DynamicCache, which
    transformers turns off only under checkpointing (Note [A cache in training]; Liger's forward
    keeps it through its loss too)."""
    if _flag(args, "use_liger_kernel"):
        config = _section(_get(args, "liger_kernel_config"), "liger_kernel_config")
        on = [k for k in _LIGER_OTHER_KERNELS if _str_to_bool(config.get(k, True), f"liger_kernel_config {k}")]
        if on:
            raise ValueError(f"use_liger_kernel: Liger's {', '.join(on)} kernels (on by default) replace Hugging Face's "
                             "ops with kernels that save other tensors, which is not modelled; its fused linear "
                             "cross-entropy alone is (liger_kernel_config with "
                             + ", ".join(f'"{k}": False' for k in on) + ")")
        if _str_to_bool(config.get("cross_entropy", False), "liger_kernel_config cross_entropy"):
            raise ValueError("liger_kernel_config cross_entropy: Liger's cross-entropy over the full logits is not "
                             "modelled; its fused linear cross-entropy (the default) is")
        fused = config.get("fused_linear_cross_entropy", True)
        if _str_to_bool(fused, "liger_kernel_config fused_linear_cross_entropy"):
            knobs["loss"] = "fused"
    if model_use_cache and knobs.get("checkpointing", "none") == "none":
        knobs["use_cache"] = True
    return knobs


def _refuse_unmodelled_trainer_settings(args: Any) -> None:
    """Trainer settings that change a step's memory in ways the engine does not model."""
    if _get(args, "label_smoothing_factor") not in (None, 0, 0.0):
        # LabelSmoother: a log-softmax of the logits and its negation beside the model's own loss.
        raise ValueError(f"label_smoothing_factor={_get(args, 'label_smoothing_factor')!r}: the Trainer's "
                         "LabelSmoother is not modelled (its log-softmax copies of the logits)")
    if _get(args, "torch_compile"):
        raise ValueError("torch_compile=True: a compiled model's memory is not modelled (eager PyTorch is)")
    if _get(args, "parallelism_config") is not None:
        # Handed to Accelerate, which builds its own device mesh (dp_shard, tp, cp) from it.
        raise ValueError("parallelism_config: Accelerate's device-mesh parallelism is not mapped; describe the run "
                         "with trainmem's own knobs (parallel, gpus, tp, cp)")
    if _accelerator_config(args).get("split_batches"):
        raise ValueError("accelerator_config split_batches=True: each rank takes a slice of the batch; pass the "
                         "per-rank batch as per_device_train_batch_size instead")


# The dtype the 4-bit matmuls compute in under each precision a QLoRA run can take (bf16-master: a
# DeepSpeed engine's bf16 mode), and the load dtypes modelled with it (the first: load_dtype auto).
_COMPUTE_DTYPES = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16", "fp32": "float32", "bf16-master": "bfloat16"}
_LOAD_DTYPES = {"bf16-mixed": ("float32", "bfloat16"), "fp16-mixed": ("float32", "float16"), "fp32": ("float32",),
                "bf16-master": ("bfloat16",)}


def _dtype_name(value: Any) -> str:
    """torch.bfloat16, "bfloat16", "torch.bfloat16" or "bf16" as "bfloat16" (None: float32,
    BitsAndBytesConfig's default compute dtype)."""
    if value is None:
        return "float32"
    name = str(value).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name)


_QUANT_STORAGES = {"uint8": "uint8", "bfloat16": "bf16"}  # torch's dtype name -> the knob's spelling


def recipe_from_quantization_config(config: Any, *, model_dtype: str = "float32",
                                    precision: str = "fp32", prepare_kbit_training: bool = True) -> dict[str, Any]:
    """The 4-bit knobs of a QLoRA run from its BitsAndBytesConfig (or the dict of to_dict()), for a
    base loaded with from_pretrained(dtype=`model_dtype`), prepared with peft's
    prepare_model_for_kbit_training (`prepare_kbit_training=False`: not prepared, as TRL's
    SFTTrainer leaves a base sharded by FSDP or ZeRO-3; a half-loaded base's other weights then
    stay half, Note [QLoRA without prepare_model_for_kbit_training] in src/graph/quant.h) and
    trained in `precision` (the Trainer's: "bf16-mixed" for bf16=True, "fp16-mixed" for fp16=True,
    else "fp32"; under DeepSpeed its bf16 mode, "bf16-master", over a bfloat16-loaded base, as
    measured).

    Mapped: load_in_4bit with bnb_4bit_quant_type and bnb_4bit_use_double_quant; a bfloat16-loaded
    base under bf16=True is load_dtype "bf16" (its QuantState is bf16; Note [The load dtype of a
    4-bit base] in src/graph/quant.h), a float16-loaded one under fp16=True load_dtype "fp16", a
    float32-loaded one load_dtype "auto"; bnb_4bit_quant_storage uint8 or bfloat16 (the FSDP and
    ZeRO-3 QLoRA recipes' setting; Note [The packed weights' storage dtype]). Refused, not being
    modelled: 8-bit training, another quant storage, a compute dtype other than the one the run computes in
    (bnb_4bit_compute_dtype must be autocast's dtype under bf16 / fp16, float32 without), and a
    half-loaded base without the matching autocast."""
    if not isinstance(config, dict):
        to_dict = getattr(config, "to_dict", None)
        as_dict = to_dict() if callable(to_dict) else None
        if not isinstance(as_dict, dict):
            raise ValueError("quantization_config: expected a BitsAndBytesConfig or its to_dict(), got "
                             f"{type(config).__name__}")
        config = as_dict
    if _flag(config, "load_in_8bit", "quantization_config load_in_8bit"):
        raise ValueError("quantization_config: load_in_8bit training is not modelled (LLM.int8 is, for inference)")
    if not _flag(config, "load_in_4bit", "quantization_config load_in_4bit"):
        raise ValueError("quantization_config: expected load_in_4bit=True (a QLoRA base)")
    storage = _dtype_name(config.get("bnb_4bit_quant_storage") or "uint8")
    if storage not in _QUANT_STORAGES:
        raise ValueError(f"quantization_config: bnb_4bit_quant_storage={storage} is not modelled (uint8 and bfloat16 are)")
    quant_type = config.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in ("fp4", "nf4"):
        raise ValueError(f"quantization_config: bnb_4bit_quant_type={quant_type!r} is not one of fp4, nf4")
    if not isinstance(precision, str) or precision not in _COMPUTE_DTYPES:
        raise ValueError(f"quantization_config: a 4-bit base trained in {precision} is not modelled "
                         "(bf16=True, fp16=True or neither over a float32- or bfloat16-loaded base are)")
    compute = _dtype_name(config.get("bnb_4bit_compute_dtype"))
    if compute != _COMPUTE_DTYPES[precision]:
        raise ValueError(f"quantization_config: bnb_4bit_compute_dtype={compute} under {precision} is not modelled; "
                         f"the matmuls compute in {_COMPUTE_DTYPES[precision]} there, set it to that")
    knobs: dict[str, Any] = {"load_in_4bit": True, "bnb_4bit_quant_type": quant_type,
                             "bnb_4bit_use_double_quant": _flag(config, "bnb_4bit_use_double_quant",
                                                                "quantization_config bnb_4bit_use_double_quant")}
    if storage != "uint8":
        knobs["bnb_4bit_quant_storage"] = _QUANT_STORAGES[storage]
    loaded = _dtype_name(model_dtype)
    if loaded not in _LOAD_DTYPES[precision]:
        raise ValueError(f"quantization_config: a {loaded}-loaded 4-bit base trained in {precision} is not modelled "
                         f"(loaded in {' or '.join(_LOAD_DTYPES[precision])} it is)")
    if precision == "bf16-mixed" and loaded == "bfloat16":
        knobs["load_dtype"] = "bf16"
    if precision == "fp16-mixed" and loaded == "float16":
        knobs["load_dtype"] = "fp16"
    # Unprepared, a float32 base is the same model, and DeepSpeed's bf16 mode casts it all anyway.
    if not prepare_kbit_training and "load_dtype" in knobs:
        knobs["prepare_kbit_training"] = False
    return knobs


# LoraConfig fields that do not change what a training step holds: names, the scaling (lora_alpha,
# use_rslora, alpha_pattern), fan_in_fan_out (peft reads it off GPT-2's Conv1D anyway), the
# QA-LoRA group size and Megatron module name that matter only with their switches, and
# ensure_weight_tying (ties adapters of tied embeddings, which no modelled target wraps).
_LORA_NEUTRAL = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                 "lora_alpha", "use_rslora", "alpha_pattern", "fan_in_fan_out", "qalora_group_size",
                 "megatron_core", "layers_pattern", "ensure_weight_tying"}
_LORA_MAPPED = {"r", "target_modules", "lora_dropout", "init_lora_weights", "inference_mode"}


def _unset(value: Any) -> bool:
    """A LoraConfig field at its off value: None, False, "none", empty, or a dict of such."""
    if value is None or value is False or value == "none":
        return True
    if isinstance(value, dict):
        return all(_unset(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) == 0
    to_dict = getattr(value, "to_dict", None)  # LoraRuntimeConfig and the like
    if callable(to_dict):
        return _unset(to_dict())
    return False


def recipe_from_lora_config(config: Any) -> dict[str, Any]:
    """The adapter knobs of a peft LoraConfig (or its to_dict(), as adapter_config.json holds it):
    `r` is lora_rank, `lora_dropout` lora_dropout, and `target_modules` lora_targets: None is
    peft's default for the model type ("default"), "all-linear" every linear layer of the decoder
    layers, a list the module names peft matches by suffix (the engine refuses names it does not
    model, such as lm_head). The scaling (lora_alpha, use_rslora, alpha_pattern) holds no memory.

    Refused, not being modelled: a target_modules regex (a string other than "all-linear"; give
    the names), exclude_modules, layers_to_transform, rank_pattern, trainable biases (`bias`,
    `lora_bias`), modules_to_save, DoRA, QA-LoRA, inference_mode (frozen adapters), an
    initialization other than the default or "gaussian" (PiSSA, LoftQ, EVA and the rest rewrite the
    base or need data), and every other LoRA variant switched on (target_parameters,
    layer_replication, trainable_token_indices, runtime offload and so on)."""
    if not isinstance(config, dict):
        to_dict = getattr(config, "to_dict", None)
        as_dict = to_dict() if callable(to_dict) else None
        if not isinstance(as_dict, dict):
            raise ValueError(f"lora_config: expected a peft LoraConfig or its to_dict(), got {type(config).__name__}")
        config = as_dict
    peft_type = config.get("peft_type")
    if peft_type is not None and str(getattr(peft_type, "value", peft_type)) != "LORA":
        raise ValueError(f"lora_config: peft_type {peft_type!r} is not modelled (LORA is)")
    if config.get("inference_mode"):
        raise ValueError("lora_config: inference_mode=True freezes the adapters; nothing would train")
    init = config.get("init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        raise ValueError(f"lora_config: init_lora_weights={init!r} is not modelled (True, False and \"gaussian\" "
                         "are: the others rewrite the base weights or need data)")
    for name, value in config.items():
        if name in _LORA_NEUTRAL or name in _LORA_MAPPED or _unset(value):
            continue
        raise ValueError(f"lora_config: {name}={value!r} is not modelled; the engine models plain LoRA adapters "
                         "(r, target_modules, lora_dropout)")
    if "r" not in config:
        raise ValueError("lora_config: no r (the adapters' rank)")
    knobs: dict[str, Any] = {"lora_rank": _positive_int(config["r"], "lora_config r")}
    targets = config.get("target_modules")
    if targets is None:
        knobs["lora_targets"] = "default"
    elif isinstance(targets, str):
        if targets != "all-linear":
            raise ValueError(f"lora_config: target_modules={targets!r} is a regular expression peft matches against "
                             "full module paths, which is not mapped; give the module names as a list, or "
                             "\"all-linear\"")
        knobs["lora_targets"] = "all-linear"
    elif isinstance(targets, (list, tuple, set, frozenset)) and targets and all(
            isinstance(t, str) and t for t in targets):
        knobs["lora_targets"] = sorted(targets)  # a set has no order; peft's matching has none either
    else:
        raise ValueError(f"lora_config: target_modules must be None, \"all-linear\" or module names, got {targets!r}")
    dropout = config.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora_config: lora_dropout must be a number in [0, 1), got {dropout!r}")
    if dropout:
        knobs["lora_dropout"] = float(dropout)
    return knobs


def _trainer_optimizer(args: Any) -> str:
    """The Trainer's `optim` as trainmem's optimizer knob."""
    optim = str(getattr(_get(args, "optim", "adamw_torch_fused"), "value", _get(args, "optim", "adamw_torch_fused")))
    if optim == "sgd":
        # The Trainer splits optim_args at commas and each at "=" (Trainer.get_optimizer_cls_and_kwargs).
        optim_args = dict(kv.split("=", 1) for kv in str(_get(args, "optim_args") or "").replace(" ", "").split(",")
                          if "=" in kv)
        try:
            momentum = float(optim_args.get("momentum", 0))
        except ValueError:
            raise ValueError(f"optim_args momentum={optim_args['momentum']!r}: not a number") from None
        if momentum == 0:
            # torch's SGD keeps no momentum buffer at momentum 0 (its default).
            raise ValueError("optim=sgd: the Trainer's SGD has no momentum by default; trainmem models SGD "
                             "with momentum (optim_args='momentum=0.9')")
        return "sgd"
    if optim in _OPTIMIZERS:
        return _OPTIMIZERS[optim]
    raise ValueError(f"optim={optim!r} is not modelled; modelled: {', '.join(sorted(_OPTIMIZERS))}, sgd")


def _fsdp_knobs(args: Any) -> dict[str, Any]:
    """The Trainer's `fsdp` / `fsdp_config` as the parallel knobs: FSDP2, full sharding or
    shard_grad_op (transformers' _apply_legacy_fsdp_to_config turns it into
    reshard_after_forward=False for FSDP2). `fsdp` is the legacy string of words (or a list of
    them), or True with everything in `fsdp_config`: a TrainingArguments of transformers 5 holds
    the latter whatever it was given (the words moved into the config)."""
    option = _get(args, "fsdp")
    if option is True:
        words = ["full_shard"]  # reshard_after_forward, FSDP2's default True, may say otherwise below
    elif isinstance(option, str):
        words = option.split()
    elif isinstance(option, (list, tuple)):
        words = [str(getattr(w, "value", w)) for w in option]
    else:
        raise ValueError(f"fsdp: expected True, a string of options or a list of them, got {option!r}")
    # Keys with transformers' "fsdp_" prefix mean the same as without (TrainingArguments strips it).
    raw = _json_object(_get(args, "fsdp_config") or {}, "fsdp_config")  # TrainingArguments reads a path too
    config = {k.removeprefix("fsdp_") if k != "fsdp_version" else k: v for k, v in raw.items()}
    # transformers' _process_fsdp_args: FSDP2 unless the config says version 1.
    version = config.get("fsdp_version", config.get("version", 2))
    if isinstance(version, str) and version.isdigit():
        version = int(version)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"fsdp_config fsdp_version: expected 1 or 2, got {version!r}")
    if version != 2:
        raise ValueError(f"fsdp_config version={version}: FSDP1 (flat parameters) is not modelled; "
                         "FSDP2 (version 2, transformers' default) is")
    if _str_to_bool(config.get("activation_checkpointing", False), "fsdp_config activation_checkpointing"):
        # Accelerate's fsdp2_apply_ac wraps each layer in checkpoint_wrapper before fully_shard.
        raise ValueError("fsdp_config activation_checkpointing: FSDP's own checkpoint_wrapper is not modelled; "
                         "the Trainer's activation_checkpointing=True (checkpointing inside each decoder layer) is")
    policy = config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy != "TRANSFORMER_BASED_WRAP":
        raise ValueError(f"fsdp_config auto_wrap_policy={policy!r}: one FSDP unit per decoder layer "
                         "(TRANSFORMER_BASED_WRAP, the default) is modelled")
    # "offload" sets fsdp_config["cpu_offload"] (transformers' _apply_legacy_fsdp_to_config); Accelerate
    # turns it into FSDP2's CPUOffloadPolicy() (pin_memory True): recipe offload "both".
    # transformers tests the value's truth as Python does (`if fsdp_config.get("cpu_offload")`), so
    # any non-empty string, "false" included, offloads.
    cpu_offload = bool(config.get("cpu_offload", "offload" in words))
    words = [w for w in words if w != "offload"]
    if any(w in ("hybrid_shard", "hybrid_shard_zero2") for w in words):
        raise ValueError(f"fsdp={option!r}: hybrid sharding is FSDP1-only in the Trainer (transformers refuses it "
                         "with fsdp_version 2); FSDP2's HSDP is a 2-D mesh: estimate it with parallel='fsdp', "
                         "fsdp_replicate=R")
    unmodelled = [w for w in words if w not in ("full_shard", "shard_grad_op", "auto_wrap")]
    strategies = [w for w in words if w in ("full_shard", "shard_grad_op")]
    if len(strategies) != 1 or unmodelled:
        raise ValueError(f"fsdp={option!r}: 'full_shard' or 'shard_grad_op' (with 'auto_wrap' per decoder layer) "
                         "is modelled")
    reshard = _str_to_bool(config.get("reshard_after_forward", strategies[0] == "full_shard"),
                           "fsdp_config reshard_after_forward")
    knobs: dict[str, Any] = {"parallel": "fsdp"}
    if not reshard:
        knobs["fsdp_reshard_after_forward"] = False
    if cpu_offload:
        knobs["offload"] = "both"  # Note [FSDP2 CPU offload] in src/graph/parallel.cpp
    return knobs


# DeepSpeed's ZeRO settings the engine models at their defaults (deepspeed/runtime/zero/config.py,
# DeepSpeedZeroConfig), by field name; a config that changes one is refused rather than estimated
# as if it did not. overlap_comm's default depends on the stage (True under stage 3).
_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                  "contiguous_gradients": True, "reduce_scatter": True, "allgather_partitions": True,
                  "round_robin_gradients": False, "use_multi_rank_bucket_allreduce": True, "sub_group_size": 1_000_000_000,
                  "prefetch_bucket_size": 50_000_000, "param_persistence_threshold": 100_000,
                  "model_persistence_threshold": sys.maxsize, "max_live_parameters": 1_000_000_000,
                  "max_reuse_distance": 1_000_000_000, "module_granularity_threshold": 0,
                  "use_all_reduce_for_fetch_params": False, "allgather_sequential": False,
                  "zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_gradients": False,
                  "zero_quantized_nontrainable_weights": False, "memory_efficient_linear": True,
                  "compute_grad_norm": True}
# Settings that do not touch a training step's memory (saving, loading, checking).
_ZERO_IGNORED = {"gather_16bit_weights_on_model_save", "gather_fp16_weights_on_model_save", "load_from_fp32_weights",
                 "elastic_checkpoint", "ignore_unused_parameters", "log_trace_cache_warnings"}
# The Trainer's "auto" for these is a function of the model's hidden size (deepspeed.py,
# trainer_config_finalize), not DeepSpeed's default.
_ZERO_AUTO_FROM_MODEL = {"reduce_bucket_size": "hidden_size²", "prefetch_bucket_size": "0.9 × hidden_size²",
                         "param_persistence_threshold": "10 × hidden_size"}


def _zero_field(key: str) -> str:
    """A zero_optimization key as DeepSpeed's field: the stage3_ aliases without their prefix."""
    return key.removeprefix("stage3_")


def _check_zero_settings(zero: dict[str, Any], stage: int) -> None:
    for key, v in zero.items():
        field = _zero_field(key)
        if key in ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param") or \
                field in _ZERO_IGNORED:
            continue
        if v == "auto" and field in _ZERO_AUTO_FROM_MODEL:
            raise ValueError(f"deepspeed config zero_optimization.{key}='auto': the Trainer fills it with the model's "
                             f"{_ZERO_AUTO_FROM_MODEL[field]}, where trainmem models DeepSpeed's default "
                             f"({_ZERO_DEFAULTS[field]}); remove it to estimate with the default")
        if field == "overlap_comm":
            default: Any = stage == 3
        elif field in _ZERO_DEFAULTS:
            default = _ZERO_DEFAULTS[field]
        else:
            raise ValueError(f"deepspeed config zero_optimization.{key}: not modelled; remove it to estimate "
                             "with DeepSpeed's defaults")
        if v != default:
            raise ValueError(f"deepspeed config zero_optimization.{key}={v!r}: trainmem models DeepSpeed's "
                             f"default ({default}); remove it to estimate with the default")


def _json_object(value: Any, what: str) -> dict[str, Any]:
    """A config given as a dict or as the path of a JSON file holding one (as the Trainer takes
    `deepspeed` and `fsdp_config`)."""
    if isinstance(value, dict):
        return value
    import os
    from pathlib import Path

    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{what}: expected a dict or a JSON file's path, got {type(value).__name__}")
    path = Path(value)
    try:
        if not path.exists():
            raise ValueError(f"{what} {str(path)!r}: cannot read it: No such file or directory")
        if not path.is_file():  # a FIFO would block the read, /dev/zero fill the memory
            raise ValueError(f"{what} {str(path)!r}: cannot read it: not a regular file")
        if path.stat().st_size > 64 << 20:
            raise ValueError(f"{what} {str(path)!r}: too large for a config file")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {str(path)!r}: not UTF-8 text") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {str(path)!r}: not JSON: {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise ValueError(f"{what} {str(path)!r}: JSON nested too deeply") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} {str(path)!r}: expected a JSON object")
    return loaded


def _deepspeed_batch(ds: dict[str, Any], gpus: int | None, args: Any) -> tuple[int, int, int]:
    """(micro-batch, accumulation, world size) as DeepSpeed settles them
    (DeepSpeedConfig._set_batch_related_parameters): any two of train_batch_size,
    train_micro_batch_size_per_gpu and gradient_accumulation_steps give the third, one alone
    means no accumulation, all three must agree. With the Trainer's settings (`args`), "auto" is
    its per_device_train_batch_size or gradient_accumulation_steps (transformers'
    trainer_config_process), a value that differs from them is the mismatch it refuses, a missing
    accumulation is 1 (Accelerate's DeepSpeedPlugin sets it) and a missing micro-batch stays missing
    (only "auto" values are filled)."""
    if gpus is not None:
        _positive_int(gpus, "gpus")
    # The DeepSpeed key, and the TrainingArguments field that fills its "auto", with its default.
    names = {"train_batch_size": (None, None),
             "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", 8),
             "gradient_accumulation_steps": ("gradient_accumulation_steps", 1)}
    got: dict[str, int | None] = {}
    for name, (arg, default) in names.items():
        v = ds.get(name)
        if args is not None and arg is not None and v is not None:
            mine = _positive_int(_get(args, arg, default), arg)
            if v != "auto" and v != mine:
                raise ValueError(f"deepspeed config {name}={v!r} and TrainingArguments {arg}={mine}: the Trainer "
                                 "refuses the mismatch; set it to 'auto'")
            v = mine
        elif v == "auto":
            if args is None:
                raise ValueError(f"deepspeed config {name}: 'auto' needs the Trainer's settings (pass training_arguments=)")
            v = None  # train_batch_size: the Trainer's world size x micro-batch x accumulation
        elif v is None and args is not None and name == "gradient_accumulation_steps":
            v = 1  # DeepSpeedPlugin.__post_init__
        got[name] = None if v is None else _positive_int(v, f"deepspeed config {name}")
    total, micro, accum = got["train_batch_size"], got["train_micro_batch_size_per_gpu"], got["gradient_accumulation_steps"]
    if gpus is None:
        if total is None or micro is None or accum is None:
            raise ValueError("deepspeed config: the world size is not given (train_batch_size = micro-batch x "
                             "accumulation x GPUs); pass gpus=")
        if total % (micro * accum):
            raise ValueError(f"deepspeed config train_batch_size={total} is not a multiple of micro-batch {micro} x "
                             f"accumulation {accum}")
        return micro, accum, total // (micro * accum)
    if micro is None and total is None:  # DeepSpeedConfig asserts one of them
        raise ValueError("deepspeed config: train_batch_size or train_micro_batch_size_per_gpu is needed")
    if micro is None and accum is None:
        micro, accum = total // gpus, 1
    elif micro is None:
        micro = total // gpus // accum if total is not None else None
    elif accum is None:
        accum = total // micro // gpus if total is not None else 1
    if not micro or not accum:
        raise ValueError(f"deepspeed config: train_batch_size={total} over {gpus} GPUs leaves no micro-batch "
                         f"(micro-batch {micro}, accumulation {accum})")
    if total is not None and total != micro * accum * gpus:
        raise ValueError(f"deepspeed config train_batch_size={total} is not micro-batch {micro} x accumulation "
                         f"{accum} x {gpus} GPUs; DeepSpeed refuses it")
    return micro, accum, gpus


def _deepspeed_precision(ds: dict[str, Any], name: str, args: Any) -> bool:
    """Whether DeepSpeed's bf16 (or fp16) mode is on: its section's `enabled` (bf16 also under the
    old name "bfloat16"). Under the Trainer, "auto" is its bf16 or bf16_full_eval (fp16 likewise),
    and a run with bf16=True and no section gets one from Accelerate (set_mixed_precision)."""
    section = ds.get(name)
    if section is None and args is not None:
        # Accelerate's set_mixed_precision adds {"enabled": <the Trainer's precision>}, which DeepSpeed
        # reads before the old "bfloat16" name.
        return _half(args, name)
    wanted = None if args is None else bool(_half(args, name) or _get(args, f"{name}_full_eval", False))
    if section is None and name == "bf16":
        section = ds.get("bfloat16")
        wanted = None  # transformers fills and checks "bf16" only
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ValueError(f"deepspeed config {name}: expected an object such as {{\"enabled\": true}}")
    v = section.get("enabled", False)
    if v == "auto":
        if wanted is None:
            raise ValueError(f"deepspeed config {name}.enabled: 'auto' needs the Trainer's settings "
                             "(pass training_arguments=)")
        return wanted
    enabled = _str_to_bool(v, f"deepspeed config {name}.enabled")
    if wanted is not None and "enabled" in section and enabled != wanted:  # fill_match skips a missing key
        raise ValueError(f"deepspeed config {name}.enabled={v!r} and TrainingArguments {name}={wanted}: the Trainer "
                         "refuses the mismatch; set it to 'auto'")
    return enabled


def recipe_from_deepspeed_config(config: Any, *, seq: int | None = None, gpus: int | None = None,
                                 training_arguments: Any = None, gpu: str | None = None) -> dict[str, Any]:
    """Keyword arguments for trainmem.estimate / trainmem.fit from a DeepSpeed config (a dict or
    the path of its JSON file): ZeRO stage, micro-batch, accumulation, precision, optimizer.

    "auto" values are filled from `training_arguments` (a TrainingArguments or its to_dict()) as
    the Hugging Face Trainer fills them, and a value that contradicts them is refused as the
    Trainer refuses it; without them an "auto" is an error naming the key. The batch settles as
    DeepSpeed settles it: any two of train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps give the third over `gpus` (the world size), which without the
    argument is train_batch_size / (micro-batch x accumulation). `bf16.enabled` (or the old
    "bfloat16" section) is DeepSpeed's bf16 mode: a bf16 model whose ZeRO optimizer keeps fp32
    master partitions, trainmem's bf16-master; a Trainer run with bf16=True and no section gets
    one (and one with enabled false without it, which hides an old "bfloat16" section); with
    neither bf16 nor fp16 everything is fp32. Without gradient_accumulation_steps DeepSpeed takes 1
    but under the Trainer the run accumulates the Trainer's micro-batches (Accelerate sets the
    boundary). An "optimizer" section of type Adam/AdamW with `torch_adam` is torch's AdamW
    (foreach, or fused with "fused": true; a single-tensor one, "foreach": false, is refused);
    without `torch_adam` it is DeepSpeed's FusedAdam, which updates in place like torch's fused
    AdamW (adamw-fused); without a section the Trainer's `optim` decides.

    `offload_optimizer {device: cpu}` (pin_memory and ratio at their defaults) is
    `offload="optimizer"` with the config's Adam/AdamW as DeepSpeedCPUAdam (`optimizer="adamw"`);
    under stage 3 `offload_param {device: cpu}` is `offload="params"`, both together `"both"`.

    The deprecated `cpu_offload` / `cpu_offload_param` booleans mean those sections with device cpu.

    Refused (not modelled): ZeRO stage 0 (DeepSpeed's own data parallelism), NVMe offload,
    fp16 with loss scaling, bf16 without fp32 masters (bf16_master_weights_and_grads), ZeRO
    settings other than DeepSpeed's defaults (buckets, overlap, stage-3 prefetch and persistence,
    ZeRO++; the Trainer's model-sized "auto" buckets included) and ZeRO keys trainmem does not
    know, other optimizers, a gradient accumulation dtype (data_types), torch_autocast and a
    communication_data_type.
    """
    ds = _json_object(config, "deepspeed config")
    args = training_arguments
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ValueError("deepspeed config zero_optimization: expected an object")
    stage = zero.get("stage")
    if stage == "auto":
        raise ValueError("deepspeed config zero_optimization.stage: 'auto' is not a value the Trainer fills")
    if isinstance(stage, float) and stage.is_integer():
        stage = int(stage)
    if stage in (None, 0):
        raise ValueError("deepspeed config zero_optimization.stage 0: DeepSpeed's data parallelism without ZeRO "
                         "is not modelled; stages 1, 2 and 3 are")
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"deepspeed config zero_optimization.stage: expected 0, 1, 2 or 3, got {stage!r}")
    offloaded = []  # "optimizer", "params": Note [ZeRO-Offload], Note [ZeRO-3 offload]
    for key, legacy in (("offload_optimizer", "cpu_offload"), ("offload_param", "cpu_offload_param")):
        section = zero.get(key)
        if section is None and zero.get(legacy) is not None:
            # The deprecated booleans: true is the section with device cpu (DeepSpeedZeroConfig).
            section = {"device": "cpu"} if _str_to_bool(zero[legacy], f"zero_optimization.{legacy}") else None
        section = section or {}
        if not isinstance(section, dict):
            raise ValueError(f"deepspeed config zero_optimization.{key}: expected an object such as "
                             f"{{\"device\": \"cpu\"}}, got {section!r}")
        device = section.get("device", "none")
        if device in (None, "none"):
            continue
        if device != "cpu":
            raise ValueError(f"deepspeed config zero_optimization.{key}.device={device!r}: offload to {device} is "
                             "not modelled (offload to the cpu is)")
        if key == "offload_param" and stage != 3:
            raise ValueError(f"deepspeed config zero_optimization.offload_param under stage {stage}: DeepSpeed "
                             "offloads parameters under stage 3 only")
        defaults = (("pin_memory", True), ("ratio", 1.0)) if key == "offload_optimizer" else (("pin_memory", True),)
        for name, default in defaults:
            if name in section and section[name] != default:
                raise ValueError(f"deepspeed config zero_optimization.{key}.{name}={section[name]!r}: "
                                 f"trainmem models DeepSpeed's default ({default})")
        offloaded.append("optimizer" if key == "offload_optimizer" else "params")
    offload = "optimizer" in offloaded
    _check_zero_settings(zero, stage)
    # Top-level settings that change what the ZeRO optimizer holds or moves.
    if _section(ds.get("data_types"), "deepspeed config data_types").get("grad_accum_dtype") is not None:
        raise ValueError("deepspeed config data_types.grad_accum_dtype: a gradient accumulation dtype of its own "
                         "(under bf16, DeepSpeed's BF16_Optimizer in place of ZeRO's) is not modelled")
    if _flag(_section(ds.get("torch_autocast"), "deepspeed config torch_autocast"), "enabled",
             "deepspeed config torch_autocast.enabled"):
        raise ValueError("deepspeed config torch_autocast: DeepSpeed's autocast over fp32 weights is not modelled")
    if ds.get("communication_data_type") is not None:
        raise ValueError("deepspeed config communication_data_type: reducing in another dtype is not modelled")

    knobs: dict[str, Any] = {"parallel": f"zero{stage}"}
    if offloaded:
        knobs["offload"] = "both" if len(offloaded) == 2 else offloaded[0]
    knobs["batch"], knobs["grad_accum"], knobs["gpus"] = _deepspeed_batch(ds, gpus, args)
    if args is not None and "gradient_accumulation_steps" not in ds:
        # Accelerate gives DeepSpeed an accumulation of 1 but sets the boundary itself from the
        # Trainer's sync_gradients: the run accumulates the Trainer's micro-batches.
        knobs["grad_accum"] = _positive_int(_get(args, "gradient_accumulation_steps", 1), "gradient_accumulation_steps")

    bf16 = _deepspeed_precision(ds, "bf16", args)
    if _deepspeed_precision(ds, "fp16", args):
        raise ValueError("deepspeed config fp16.enabled: fp16 with loss scaling over fp32 masters is not modelled; "
                         "bf16 is")
    if bf16:
        section = _section(ds.get("bf16", ds.get("bfloat16")), "deepspeed config bf16")
        for name in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if section.get(name):
                raise ValueError(f"deepspeed config bf16.{name}: a ZeRO optimizer without fp32 master weights is "
                                 "not modelled")
    knobs["precision"] = "bf16-master" if bf16 else "fp32"

    section = ds.get("optimizer")
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"deepspeed config optimizer: expected an object such as {{\"type\": \"AdamW\"}}, got {section!r}")
    if offload:
        # The config's Adam/AdamW becomes DeepSpeedCPUAdam on the host (engine.py,
        # get_optimizer_configuration); a Trainer's own optimizer is refused by DeepSpeed
        # (zero_force_ds_cpu_optimizer). Note [ZeRO-Offload] in src/graph/zero_offload.cpp.
        if section is None:
            raise ValueError("deepspeed config zero_optimization.offload_optimizer: DeepSpeed refuses a client "
                             "optimizer under offload (zero_force_ds_cpu_optimizer); add an \"optimizer\" section "
                             "of type AdamW")
        if str(section.get("type", "")).lower() not in ("adam", "adamw"):
            raise ValueError(f"deepspeed config optimizer.type={section.get('type')!r} is not modelled; Adam/AdamW is")
        knobs["optimizer"] = "adamw"
    elif section is not None:
        kind = str(section.get("type", "")).lower()
        params = _section(section.get("params"), "deepspeed config optimizer.params")
        if kind not in ("adam", "adamw"):
            raise ValueError(f"deepspeed config optimizer.type={section.get('type')!r} is not modelled; Adam/AdamW is")
        if not params.get("torch_adam"):
            knobs["optimizer"] = "adamw-fused"  # DeepSpeed's FusedAdam
        elif params.get("fused"):
            knobs["optimizer"] = "adamw-fused"  # torch's AdamW(fused=True): the other params go to it
        elif params.get("foreach") is False:
            # torch's single-tensor loop over ZeRO's flat partition: partition-sized temporaries.
            raise ValueError("deepspeed config optimizer.params foreach=false with torch_adam: torch's single-tensor "
                             "AdamW is not modelled; foreach (the default) and fused are")
        else:
            knobs["optimizer"] = "adamw"
    elif training_arguments is not None:
        knobs["optimizer"] = _trainer_optimizer(training_arguments)  # the engine says what ZeRO can take
    else:
        knobs["optimizer"] = "adamw"
    if training_arguments is not None and (_flag(training_arguments, "activation_checkpointing")
                                           or _flag(training_arguments, "gradient_checkpointing")):
        knobs["checkpointing"] = _trainer_checkpointing(training_arguments)
    if seq is None and training_arguments is not None:
        seq = _get(training_arguments, "max_length") or _get(training_arguments, "max_seq_length")
    if seq is not None:
        knobs["seq"] = _positive_int(seq, "seq")
    if gpu is not None:
        knobs["gpu"] = gpu
    return knobs
