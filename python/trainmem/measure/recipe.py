"""Recipe knobs of the measuring side, with the names, values and defaults of docs/schema.md."""

from __future__ import annotations

import dataclasses

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-true", "fp16-true")
OPTIMIZERS = ("adamw", "adamw-fused", "adamw-8bit", "sgd", "adafactor")
CHECKPOINTING = ("none", "full", "full-reentrant")
ATTENTIONS = ("eager", "sdpa", "flash")
LOSSES = ("standard", "fused")
# The attention_mask the training batch passes to the model (docs/schema.md): none (only input_ids
# and labels), ones (what a tokenizer gives an unpadded batch) or padded (the last row's second
# half is padding).
ATTENTION_MASKS = ("none", "ones", "padded")
ALLOCATORS = ("default", "expandable")
# Data parallelism (docs/parallelism.md): "none" is one process; "ddp" DistributedDataParallel,
# "fsdp" FSDP2 fully_shard per decoder layer and the root, "zero1" / "zero2" / "zero3" DeepSpeed's
# ZeRO stages, over `gpus` processes (world size).
PARALLELS = ("none", "ddp", "fsdp", "zero1", "zero2", "zero3")
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# DistributedDataParallel's knobs (parallel ddp, no pipeline), each off by default.
_DDP_KNOBS = ("ddp_find_unused_parameters", "ddp_gradient_as_bucket_view", "ddp_no_sync")
# The on/off knobs written (as_dict, and the command's flags) only when on, as the engine writes them.
FLAGS_WHEN_ON = (*_DDP_KNOBS, "fp32_outputs", "fsdp_no_sync", "use_cache", "clip_grad_norm")
# FSDP2's knobs (fully_shard and MixedPrecisionPolicy, torch/distributed/fsdp/_fully_shard/): the
# dtypes of MixedPrecisionPolicy(param_dtype, reduce_dtype), "none" being the policy's None.
FSDP_PARAM_DTYPES = ("none", "bf16")
FSDP_REDUCE_DTYPES = ("none", "fp32", "bf16")
FSDP_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}
MAX_GPUS = 4096
# Tensor parallelism (docs/parallelism.md "Tensor parallelism"): `tp` is the degree, a knob of its
# own beside the data-parallel `gpus`: tp > 1 runs with gpus 1 and parallel none on `tp` processes,
# or as TP x DP, FSDP2 over a 2-D mesh (world = gpus x tp).
MAX_TP = 64
# Pipeline parallelism (docs/parallelism.md "Pipeline parallelism"): `pp` stages, one process
# each, torch.distributed.pipelining with `pp_schedule`; grad_accum is the schedule's n_microbatches.
MAX_PP = 64
# The schedules with one stage per rank, and those with `pp_stages_per_rank` V >= 2 stages per rank
# (rank r holds stages r, r + pp, ..., r + (V - 1) pp: torch's PipelineScheduleMulti).
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs")
PP_MULTI_SCHEDULES = ("interleaved-1f1b", "looped-bfs")
MAX_PP_STAGES_PER_RANK = 64
MODES = ("training", "inference")
# Inference loads the weights in one dtype and runs in it: no autocast, no master copy.
INFERENCE_PRECISIONS = ("fp32", "bf16-true", "fp16-true")
DEFAULT_PRECISION = {"training": "bf16-mixed", "inference": "bf16-true"}
MAX_SEQ = 1 << 24     # the engine's kMaxSeq (src/recipe/recipe.cpp): also bounds seq + new_tokens
MAX_BEAMS = 64        # the engine's bound on num_beams
LORA_TARGET_KEYWORDS = ("default", "all-linear")
MAX_LORA_RANK = 65536  # the engine's bound: beyond it the adapters outgrow the layers they adapt
# bitsandbytes 4-bit base weights (transformers' BitsAndBytesConfig): the codes of
# bnb_4bit_quant_type, whose default "fp4" is transformers' own; the precisions a 4-bit base runs with
# (the precision's dtype is the load dtype and bnb_4bit_compute_dtype; no autocast, no master copy).
BNB_4BIT_QUANT_TYPES = ("fp4", "nf4")
# The dtype bitsandbytes stores a 4-bit weight's packed bytes as (bnb_4bit_quant_storage): uint8, its
# default, or bf16, what FSDP-QLoRA and ZeRO-3-QLoRA scripts set so that the packed weights share
# the dtype of a bf16 base (the same bytes, half as many elements).
BNB_4BIT_QUANT_STORAGES = ("uint8", "bf16")
# The dtype from_pretrained loads a 4-bit base or a LoRA model in (its `dtype`): "auto", the precision's
# weights' dtype, or "bf16" under bf16-mixed (fp16 under fp16-mixed), the Trainer recipe (dtype=torch.bfloat16,
# bf16=True). Without a 4-bit base the frozen model stays half and its fp32 adapters run under autocast;
# over one, the QuantState dtype is that half while prepare_model_for_kbit_training makes the rest
# fp32 again.
LOAD_DTYPES = ("auto", "bf16", "fp16")
QUANTIZED_PRECISIONS = ("fp32", "bf16-true", "fp16-true")

# Hugging Face's attn_implementation for each --attention value.
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


class RecipeError(ValueError):
    """A knob has a value the measuring side does not accept (user error, exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    batch: int = 1
    seq: int = 2048
    grad_accum: int = 1
    # "" (or None) is the mode's default: bf16-mixed for training, bf16-true for inference;
    # __post_init__ replaces it, so a Recipe always holds a real precision.
    precision: str = ""
    optimizer: str = "adamw"
    checkpointing: str = "none"
    attention: str = "sdpa"
    loss: str = "standard"
    attention_mask: str = "none"
    gpu: str = "cpu"
    allocator: str = "default"
    # LoRA (peft): rank 0 trains every parameter. lora_targets is spelled as on the command line
    # ("default", "all-linear" or comma-separated module names); models.apply_lora resolves it.
    lora_rank: int = 0
    lora_targets: str = "default"
    lora_dropout: float = 0.0
    # QLoRA: the base model loaded with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type,
    # bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=the precision's dtype), then peft's
    # prepare_model_for_kbit_training (models.build_quantized_model). The spellings are transformers'.
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_quant_storage: str = "uint8"
    load_dtype: str = "auto"
    # False: the sharded-QLoRA recipe (TRL skips prepare_model_for_kbit_training for a base loaded
    # to the CPU or meta device, as FSDP and ZeRO-3 runs load it): what is not 4-bit stays in the
    # half load dtype.
    prepare_kbit_training: bool = True
    # LLM.int8(): BitsAndBytesConfig(load_in_8bit=True) with transformers' defaults (threshold 6.0,
    # no fp16 weights kept); inference only (models.build_quantized_model).
    load_in_8bit: bool = False
    # Generation (docs/schema.md "The reference generation"): mode "inference" measures one
    # model.generate() call of new_tokens tokens after a prompt of seq tokens, num_beams = beams.
    mode: str = "training"
    new_tokens: int = 128
    beams: int = 1
    # World size and data-parallel wrapper (parallel.py): gpus 1 / parallel none is one process.
    gpus: int = 1
    parallel: str = "none"
    # Tensor-parallel degree (parallel.py wrap_model): torch's parallelize_module with the
    # Megatron plan over a 1-D mesh of `tp` ranks; 1 is no tensor parallelism.
    tp: int = 1
    # Sequence parallelism with tp > 1 (parallel.py tensor_parallelize): SequenceParallel on the
    # norms, the residual stream sharded on the sequence between them (docs/parallelism.md).
    sequence_parallel: bool = False
    # Loss parallelism with tp > 1 (parallel.py tensor_parallelize, training.py run_steps): lm_head
    # ColwiseParallel with vocab-sharded DTensor logits, the loss and its backward inside
    # torch.distributed.tensor.parallel.loss_parallel() (docs/parallelism.md "Loss parallel").
    loss_parallel: bool = False
    # Pipeline-parallel degree and schedule (pipeline.py): stage r on rank r; 1 is no pipeline.
    pp: int = 1
    pp_schedule: str = "1f1b"
    # Virtual stages per rank with the multi-stage schedules (pipeline.py): pp x V stages in all.
    pp_stages_per_rank: int = 1
    # FSDP2 (parallel fsdp, parallel.py): fully_shard(layer, reshard_after_forward=...) for the
    # decoder layers (False is FSDP1's SHARD_GRAD_OP: a layer stays gathered from its forward to
    # its backward); fsdp_replicate > 1 is HSDP, a 2-D mesh (replicate, shard) of fsdp_replicate x
    # gpus / fsdp_replicate ranks; the MixedPrecisionPolicy's param_dtype and reduce_dtype.
    fsdp_reshard_after_forward: bool = True
    fsdp_replicate: int = 1
    fsdp_param_dtype: str = "none"
    fsdp_reduce_dtype: str = "none"
    # DDP's find_unused_parameters (parallel ddp, parallel.py): True is what Hugging Face's Trainer
    # passes for a peft model; DDP then buckets by size at construction and routes the module's
    # outputs through _DDPSink (docs/parallelism.md "find_unused_parameters").
    ddp_find_unused_parameters: bool = False
    # DDP's gradient_as_bucket_view (parallel ddp): the .grads become views of the buckets at the
    # Reducer's hook (docs/parallelism.md "gradient_as_bucket_view").
    ddp_gradient_as_bucket_view: bool = False
    # Every micro-batch but the step's last runs its forward and backward under DDP's no_sync(), as
    # Accelerate's accumulate() and Hugging Face's Trainer (accelerator.no_sync) do (docs/parallelism.md
    # "no_sync accumulation").
    ddp_no_sync: bool = False
    # Accelerate's prepare() under its native mixed precision (Hugging Face's Trainer): the model's
    # forward wrapped in convert_outputs_to_fp32, which copies the half logits to fp32 (training.py
    # convert_outputs_as_accelerate).
    fp32_outputs: bool = False
    # FSDP2's set_requires_gradient_sync(False) on every micro-batch but the step's last, as
    # Accelerate's no_sync (Hugging Face's Trainer) accumulates (docs/parallelism.md "FSDP2 no_sync").
    fsdp_no_sync: bool = False
    # The training forward with use_cache=True (a Trainer run without checkpointing leaves the
    # config's, true for the catalog): each layer's keys and values copied into a DynamicCache.
    use_cache: bool = False
    # accelerator.clip_grad_norm_ before each optimizer step, as Hugging Face's Trainer runs it
    # (after the GradScaler's unscale_), its total norm kept to the next step.
    clip_grad_norm: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RecipeError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if self.precision in ("", None):  # a 4-bit base defaults to its matmuls' dtype, as the engine does
            quantized = self.load_in_4bit is True or self.load_in_8bit is True
            object.__setattr__(self, "precision", "bf16-true" if quantized else DEFAULT_PRECISION[self.mode])
        # The engine's ranges (src/recipe/recipe.cpp): past them a run would take hours or fail in
        # torch with a traceback rather than measure.
        for key, most in (("batch", 1 << 24), ("seq", 1 << 24), ("grad_accum", 1024), ("new_tokens", 1 << 24),
                          ("beams", None)):  # beams: checked with the mode
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RecipeError(f"{key} must be an integer >= 1, got {value!r}")
            if most is not None and value > most:
                raise RecipeError(f"{key} must be between 1 and {most}, got {value}")
        for key, allowed in (
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("checkpointing", CHECKPOINTING),
            ("attention", ATTENTIONS),
            ("loss", LOSSES),
            ("attention_mask", ATTENTION_MASKS),
            ("allocator", ALLOCATORS),
        ):
            value = getattr(self, key)
            if value not in allowed:
                raise RecipeError(f"{key}={value!r} is not one of {', '.join(allowed)}")
        self._check_lora()
        self._check_quantization()
        self._check_mode()
        self._check_parallel()

    def _check_mode(self) -> None:
        """The engine's rules for inference (src/recipe/recipe.cpp Recipe::validate)."""
        if self.mode == "training":
            self._check_attention_mask()
            if self.beams != 1:
                raise RecipeError(f"beams={self.beams} is beam search, an inference knob: use mode inference "
                                  "(--inference) or beams 1")
            if self.new_tokens != Recipe.new_tokens:
                raise RecipeError(f"new_tokens={self.new_tokens} is the tokens a generation adds, an inference knob: "
                                  "use mode inference (--inference)")
            return
        if self.optimizer != Recipe.optimizer:
            raise RecipeError(f"optimizer={self.optimizer!r}: inference runs no optimizer")
        if self.loss != Recipe.loss:
            raise RecipeError(f"loss={self.loss!r}: inference computes no loss")
        if self.precision not in INFERENCE_PRECISIONS:
            raise RecipeError(f"precision={self.precision!r}: inference loads the weights in one dtype: "
                              f"{', '.join(INFERENCE_PRECISIONS)}")
        if self.grad_accum != 1:
            raise RecipeError(f"grad_accum={self.grad_accum}: inference has no gradient accumulation")
        if self.attention_mask != "none":
            raise RecipeError(f"attention_mask={self.attention_mask!r} is a training knob: generation always passes "
                              "a mask of ones")
        if self.checkpointing != "none":
            raise RecipeError(f"checkpointing={self.checkpointing!r}: inference keeps no activations to recompute")
        if self.lora_rank > 0:
            raise RecipeError(f"lora_rank={self.lora_rank}: inference with adapters is not measured (merge them first)")
        if self.beams > MAX_BEAMS:
            raise RecipeError(f"beams must be at most {MAX_BEAMS}, got {self.beams}")
        if self.seq + self.new_tokens > MAX_SEQ:
            raise RecipeError(f"seq + new_tokens must be at most {MAX_SEQ}, got {self.seq + self.new_tokens}")

    def _check_attention_mask(self) -> None:
        """The engine's rules for attention_mask (src/recipe/recipe.cpp Recipe::validate)."""
        if self.attention_mask == "none":
            return
        if self.attention == "flash":
            raise RecipeError(f"attention_mask={self.attention_mask!r} with attention flash is not measured "
                              "(flash-attention unpads the batch); use sdpa or eager")
        if self.attention_mask == "padded" and self.seq < 2:
            raise RecipeError("attention_mask='padded' needs seq >= 2 (the first token is never padding)")
        if self.pp > 1:
            raise RecipeError(f"attention_mask={self.attention_mask!r} with pipeline parallelism is not measured (the "
                              "stages build their own masks)")

    def _check_parallel(self) -> None:
        """What the measuring side can run under data parallelism (docs/parallelism.md)."""
        gpus = self.gpus
        if not isinstance(gpus, int) or isinstance(gpus, bool) or not 1 <= gpus <= MAX_GPUS:
            raise RecipeError(f"gpus must be an integer between 1 and {MAX_GPUS}, got {gpus!r}")
        if self.parallel not in PARALLELS:
            raise RecipeError(f"parallel={self.parallel!r} is not one of {', '.join(PARALLELS)}")
        tp = self.tp
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
            raise RecipeError(f"tp must be an integer between 1 (no tensor parallelism) and {MAX_TP}, got {tp!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise RecipeError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if self.sequence_parallel and tp == 1:
            raise RecipeError("sequence_parallel needs tensor parallelism: tp 2 or more")
        if not isinstance(self.loss_parallel, bool):
            raise RecipeError(f"loss_parallel must be true or false, got {self.loss_parallel!r}")
        if self.loss_parallel and tp == 1:
            raise RecipeError("loss_parallel needs tensor parallelism: tp 2 or more")
        if tp > 1:
            self._check_tp()
        pp = self.pp
        if not isinstance(pp, int) or isinstance(pp, bool) or not 1 <= pp <= MAX_PP:
            raise RecipeError(f"pp must be an integer between 1 (no pipeline parallelism) and {MAX_PP}, got {pp!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise RecipeError(f"pp_schedule={self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        stages_per_rank = self.pp_stages_per_rank
        if (not isinstance(stages_per_rank, int) or isinstance(stages_per_rank, bool)
                or not 1 <= stages_per_rank <= MAX_PP_STAGES_PER_RANK):
            raise RecipeError(f"pp_stages_per_rank must be an integer between 1 and {MAX_PP_STAGES_PER_RANK}, "
                              f"got {stages_per_rank!r}")
        if pp > 1:
            self._check_pp()
        elif self.pp_schedule != "1f1b":
            raise RecipeError("pp_schedule is a pipeline knob: it needs pp > 1")
        elif stages_per_rank != 1:
            raise RecipeError("pp_stages_per_rank is a pipeline knob: it needs pp > 1")
        if self.parallel == "none" and gpus != 1:
            raise RecipeError(f"gpus={gpus} needs a data-parallel wrapper: parallel ddp, fsdp, zero1, zero2 or zero3")
        self._check_fsdp()
        for knob in _DDP_KNOBS:
            value = getattr(self, knob)
            if not isinstance(value, bool):
                raise RecipeError(f"{knob} must be true or false, got {value!r}")
            if value and (self.parallel != "ddp" or self.is_pp):
                raise RecipeError(f"{knob} is a DistributedDataParallel knob: it needs parallel ddp (without a pipeline)")
        if self.ddp_gradient_as_bucket_view and self.ddp_find_unused_parameters:
            raise RecipeError("ddp_gradient_as_bucket_view with ddp_find_unused_parameters is not measured: use one")
        if not isinstance(self.fsdp_no_sync, bool):
            raise RecipeError(f"fsdp_no_sync must be true or false, got {self.fsdp_no_sync!r}")
        if self.fsdp_no_sync and (self.parallel != "fsdp" or self.is_pp or self.is_tp):
            raise RecipeError("fsdp_no_sync is FSDP2's no_sync accumulation: it needs parallel fsdp (without a pipeline "
                              "or tensor parallelism)")
        if not isinstance(self.use_cache, bool):
            raise RecipeError(f"use_cache must be true or false, got {self.use_cache!r}")
        if self.use_cache and (self.is_inference or self.checkpointing != "none" or self.is_tp or self.is_pp):
            raise RecipeError("use_cache is measured in training without checkpointing, on one process, under DDP, "
                              "FSDP2 or ZeRO")
        if not isinstance(self.clip_grad_norm, bool):
            raise RecipeError(f"clip_grad_norm must be true or false, got {self.clip_grad_norm!r}")
        if self.clip_grad_norm and (self.is_inference or self.parallel not in ("none", "ddp") or self.is_tp
                                    or self.is_pp or self.precision == "bf16-master"):
            raise RecipeError("clip_grad_norm is measured in training on one process and under DDP, not with "
                              "bf16-master (as the engine models it)")
        if not isinstance(self.fp32_outputs, bool):
            raise RecipeError(f"fp32_outputs must be true or false, got {self.fp32_outputs!r}")
        if self.fp32_outputs:  # as the engine takes it: Accelerate's native mixed precision, training
            if self.precision not in ("bf16-mixed", "fp16-mixed") or self.is_inference:
                raise RecipeError("fp32_outputs is Accelerate's native mixed precision: it needs precision bf16-mixed "
                                  "or fp16-mixed, in training")
            if self.is_zero or self.is_tp or self.is_pp:
                raise RecipeError("fp32_outputs is measured on one process, under DDP and under FSDP2")
        if self.ddp_find_unused_parameters and self.checkpointing == "full-reentrant":
            # As the engine refuses it: DDP's forward marks the parameters the reentrant no_grad
            # forward left out of the graph ready, and their hooks fire again in the backward.
            raise RecipeError("checkpointing=full-reentrant under DDP with ddp_find_unused_parameters fails in torch "
                              "(\"Expected to mark a variable ready only once\"): use checkpointing full")
        if self.parallel == "none":
            return
        if self.is_inference:
            raise RecipeError(f"parallel={self.parallel!r} is a training knob: inference runs on one process")
        if self.parallel == "fsdp":
            if self.precision in ("fp16-mixed", "bf16-master"):
                raise RecipeError(f"parallel=fsdp with precision={self.precision!r} is not measured: FSDP2's form of "
                                  "bf16 compute over fp32 weights is MixedPrecisionPolicy(param_dtype=bfloat16, "
                                  "reduce_dtype=float32), not a separate master copy (docs/parallelism.md): precision "
                                  "fp32 with fsdp_param_dtype bf16 and fsdp_reduce_dtype fp32; or use fp32, bf16-true or "
                                  "bf16-mixed")
            if self.optimizer in ("adamw-8bit", "adafactor"):
                raise RecipeError(f"parallel=fsdp with optimizer={self.optimizer!r} is not measured: it would work on "
                                  "the local shards of DTensor parameters; use adamw, adamw-fused or sgd")
            if self.loss == "fused":
                raise RecipeError("parallel=fsdp with loss=fused is not measured: the fused loss calls the base model "
                                  "and reads lm_head.weight outside the root module's forward, where FSDP2 has not "
                                  "all-gathered the root's parameters")
        if self.is_zero:
            # DeepSpeed's engine owns the precision: {"bf16": {"enabled": true}} casts the model to
            # bf16 and keeps fp32 master partitions in the ZeRO optimizer (our bf16-master); with
            # neither bf16 nor fp16 enabled everything is fp32. Its fp16 mode (loss scaling over
            # fp32 masters) and torch autocast have no knob here.
            if self.precision not in ("fp32", "bf16-master"):
                raise RecipeError(f"parallel={self.parallel} with precision={self.precision!r} is not measured: "
                                  "DeepSpeed's bf16 mode is bf16-master (bf16 model, fp32 master partitions); "
                                  "use fp32 or bf16-master")
            if self.optimizer not in ("adamw", "adamw-fused", "sgd"):
                raise RecipeError(f"parallel={self.parallel} with optimizer={self.optimizer!r} is not measured; "
                                  "use adamw, adamw-fused or sgd (a torch optimizer handed to deepspeed.initialize)")
            if self.loss == "fused":
                raise RecipeError(f"parallel={self.parallel} with loss=fused is not measured: the fused loss reads "
                                  "lm_head.weight outside the model's forward")

    def _check_tp(self) -> None:
        """What the measuring side can run under tensor parallelism (docs/parallelism.md)."""
        # TP x DP: FSDP2 over the data-parallel dimension of a 2-D mesh (dp, tp), torch's FSDP + TP
        # recipe (parallel.py _tp_fsdp); FSDP2's default knobs only.
        fsdp_default = (self.fsdp_replicate == 1 and self.fsdp_param_dtype == "none"
                        and self.fsdp_reduce_dtype == "none")
        if (self.parallel not in ("none", "fsdp") or (self.parallel == "none" and self.gpus != 1)
                or (self.parallel == "fsdp" and (self.gpus < 2 or not fsdp_default))):
            raise RecipeError(f"tp={self.tp} with gpus={self.gpus} / parallel={self.parallel!r} is not measured: "
                              "tensor parallelism combined with data parallelism is measured only as FSDP2 over "
                              "a 2-D mesh (parallel fsdp, gpus 2 or more, FSDP2's default knobs); use gpus 1 "
                              "and parallel none otherwise")
        if self.parallel == "fsdp" and self.precision not in ("fp32", "bf16-mixed", "bf16-true"):
            raise RecipeError(f"tp={self.tp} with parallel=fsdp and precision={self.precision!r} is not measured; "
                              "use fp32, bf16-mixed or bf16-true")
        if self.is_inference:
            raise RecipeError(f"tp={self.tp} is a training knob: inference runs on one process")
        if self.uses_lora or self.load_in_4bit:
            raise RecipeError(f"tp={self.tp} with LoRA or a 4-bit base is not measured: peft's and bitsandbytes' "
                              "layers are not the nn.Linear modules ColwiseParallel / RowwiseParallel shard")
        if self.optimizer in ("adamw-8bit", "adafactor"):
            raise RecipeError(f"tp={self.tp} with optimizer={self.optimizer!r} is not measured: it would have to "
                              "work on DTensor parameters; use adamw, adamw-fused or sgd")
        if self.loss == "fused":
            raise RecipeError(f"tp={self.tp} with loss=fused is not measured: the chunked loss reads "
                              "lm_head.weight outside the module's forward")

    def _check_pp(self) -> None:
        """What the measuring side can run under pipeline parallelism (docs/parallelism.md)."""
        if self.parallel not in ("none", "ddp", "fsdp"):
            raise RecipeError(f"pp={self.pp} with parallel={self.parallel!r} is not measured: pipeline parallelism "
                              "combined with a data-parallel wrapper other than DDP or FSDP2 is not modelled yet; "
                              "use parallel none, ddp or fsdp")
        # PP x TP: a (pp, tp) mesh, the TP path's plan on each stage (pipeline.py make_stage), with
        # sequence and loss parallelism; with data parallelism FSDP2 over a (pp, dp, tp) mesh, the
        # only TP x DP _check_tp allows.
        if self.parallel == "fsdp" and self.gpus < 2:
            raise RecipeError(f"pp={self.pp} with parallel='fsdp' and gpus=1 is not measured: FSDP2 shards each stage "
                              "over its data-parallel ranks; use gpus 2 or more, or parallel none")
        if self.is_inference:
            raise RecipeError(f"pp={self.pp} is a training knob: inference runs on one process")
        if self.uses_lora or self.load_in_4bit or self.load_in_8bit:
            raise RecipeError(f"pp={self.pp} with LoRA or a quantized base is not measured")
        if self.optimizer not in ("adamw", "adamw-fused", "sgd"):
            raise RecipeError(f"pp={self.pp} with optimizer={self.optimizer!r} is not measured; use adamw, "
                              "adamw-fused or sgd")
        if self.loss != "standard":
            raise RecipeError(f"pp={self.pp} with loss={self.loss!r} is not measured: the last stage's loss is the "
                              "schedule's loss_fn on the logits")
        if self.precision == "fp16-mixed":
            raise RecipeError(f"pp={self.pp} with precision='fp16-mixed' is not measured (a GradScaler inside the "
                              "schedule's loss_fn is unexplored); use fp32, bf16-mixed, bf16-master, bf16-true or "
                              "fp16-true")
        self._check_pp_stages()
        if self.pp_schedule == "1f1b" and self.grad_accum < self.pp:
            raise RecipeError(f"pp={self.pp} with pp_schedule 1f1b needs grad_accum (the schedule's n_microbatches) "
                              f">= pp, got {self.grad_accum} (Schedule1F1B refuses fewer micro-batches than stages)")

    def _check_pp_stages(self) -> None:
        """Stages per rank against the schedule (the engine's validate_pipeline_stages)."""
        v, m = self.pp_stages_per_rank, self.grad_accum
        multi = self.pp_schedule in PP_MULTI_SCHEDULES
        if multi and v < 2:
            raise RecipeError(f"pp_schedule {self.pp_schedule} runs several stages per rank: set pp_stages_per_rank "
                              "to 2 or more, or use 1f1b or gpipe")
        if not multi and v != 1:
            raise RecipeError(f"pp_stages_per_rank={v} needs a multi-stage schedule: use interleaved-1f1b or "
                              f"looped-bfs, not {self.pp_schedule}")
        if multi and self.parallel not in ("none", "ddp", "fsdp"):
            raise RecipeError(f"pp_schedule {self.pp_schedule} with parallel={self.parallel!r} is not measured "
                              "(several stages per rank are measured plain, with DDP and with FSDP2); use none, ddp "
                              "or fsdp")
        if self.pp_schedule == "interleaved-1f1b":
            rounds = max(1, m // self.pp)
            if m % rounds != 0:
                raise RecipeError(f"pp_schedule interleaved-1f1b needs grad_accum (n_microbatches) to be a multiple "
                                  f"of its rounds max(1, {m} // pp={self.pp}) = {rounds}, got {m}")

    @property
    def world_size(self) -> int:
        """Processes of a run: data-parallel ranks times the tensor-parallel and pipeline degrees."""
        return self.gpus * self.tp * self.pp

    def _check_fsdp(self) -> None:
        """FSDP2's own knobs: only with parallel fsdp, and what FSDP2 accepts (docs/parallelism.md)."""
        if not isinstance(self.fsdp_reshard_after_forward, bool):
            raise RecipeError(f"fsdp_reshard_after_forward must be true or false, got {self.fsdp_reshard_after_forward!r}")
        replicate = self.fsdp_replicate
        if not isinstance(replicate, int) or isinstance(replicate, bool) or replicate < 1:
            raise RecipeError(f"fsdp_replicate must be an integer >= 1, got {replicate!r}")
        for key, allowed in (("fsdp_param_dtype", FSDP_PARAM_DTYPES), ("fsdp_reduce_dtype", FSDP_REDUCE_DTYPES)):
            if getattr(self, key) not in allowed:
                raise RecipeError(f"{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.parallel != "fsdp":
            if not self.fsdp_default:
                raise RecipeError("fsdp_reshard_after_forward / fsdp_replicate / fsdp_param_dtype / fsdp_reduce_dtype "
                                  "are FSDP2 knobs: they need parallel fsdp")
            return
        if replicate > 1 and self.gpus % replicate != 0:
            raise RecipeError(f"fsdp_replicate={replicate} does not divide gpus={self.gpus}: HSDP's mesh is "
                              "(replicate, shard) = (fsdp_replicate, gpus / fsdp_replicate)")
        if replicate > 1 and self.gpus // replicate < 2:
            raise RecipeError(f"fsdp_replicate={replicate}: HSDP's mesh is (replicate, shard) = (fsdp_replicate, "
                              f"gpus / fsdp_replicate) and needs a shard group of 2 or more ranks; gpus={self.gpus}")
        autocast_over_policy = (self.fsdp_param_dtype == "bf16" and self.precision == "bf16-mixed"
                                and (self.load_dtype == "auto" or self.uses_lora))
        if self.fsdp_param_dtype != "none" and self.precision != "fp32" and not autocast_over_policy:
            raise RecipeError(f"fsdp_param_dtype={self.fsdp_param_dtype} with precision={self.precision!r}: "
                              "MixedPrecisionPolicy casts fp32 parameters (sharded, the optimizer's) to param_dtype for "
                              "the all-gather and the compute; use precision fp32, or bf16-mixed with fsdp_param_dtype "
                              "bf16 over an fp32-loaded model or a half-loaded LoRA model")
        if self.fsdp_param_dtype != "none" and self.load_in_4bit and self.bnb_4bit_quant_storage != "bf16":
            raise RecipeError(f"fsdp_param_dtype={self.fsdp_param_dtype} over a 4-bit base stored as "
                              f"{self.bnb_4bit_quant_storage} is not measured: the "
                              "policy would cast the packed uint8 weights for the all-gather")
        if self.fsdp_reduce_dtype != "none" and self.fsdp_param_dtype == "none":
            raise RecipeError(f"fsdp_reduce_dtype={self.fsdp_reduce_dtype} without fsdp_param_dtype is not measured: "
                              "the gradients are reduced in the parameters' dtype")

    @property
    def fsdp_default(self) -> bool:
        return (self.fsdp_reshard_after_forward is True and self.fsdp_replicate == 1
                and self.fsdp_param_dtype == "none" and self.fsdp_reduce_dtype == "none")

    @property
    def is_parallel(self) -> bool:
        """More than one process (data or tensor parallelism)."""
        return self.parallel != "none" or self.tp > 1 or self.pp > 1

    @property
    def is_tp(self) -> bool:
        return self.tp > 1

    @property
    def is_pp(self) -> bool:
        return self.pp > 1

    @property
    def is_zero(self) -> bool:
        return self.parallel in ZERO_STAGES

    @property
    def is_inference(self) -> bool:
        return self.mode == "inference"

    def _check_lora(self) -> None:
        """The engine's rules (src/recipe/recipe.cpp): the same knobs are refused for the same reasons."""
        rank = self.lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= MAX_LORA_RANK:
            raise RecipeError(f"lora_rank must be an integer between 0 (no LoRA) and {MAX_LORA_RANK}, got {rank!r}")
        dropout = self.lora_dropout
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
            raise RecipeError(f"lora_dropout must be a number in [0, 1), got {dropout!r}")
        if not isinstance(self.lora_targets, str):
            raise RecipeError(f"lora_targets must be a string, got {self.lora_targets!r}")
        names = self.lora_target_names  # checks the spelling even without adapters, as the engine does
        if rank == 0:
            if dropout != 0:
                raise RecipeError("lora_dropout is set without lora_rank (no adapters)")
            if self.lora_targets != "default":
                raise RecipeError("lora_targets is set without lora_rank (no adapters)")
            return
        if self.precision == "bf16-master" and self.parallel not in ("zero1", "zero2", "zero3"):  # DeepSpeed's bf16 mode
            raise RecipeError("precision=bf16-master cannot be combined with LoRA: it keeps fp32 masters of half "
                              "trainable weights, but peft makes the adapters fp32 already; use bf16-true (half base, "
                              "fp32 adapters) or bf16-mixed")
        if len(names) > 1:
            for keyword in LORA_TARGET_KEYWORDS:
                if keyword in names:
                    raise RecipeError(f"lora_targets: {keyword!r} cannot be combined with module names")

    def _check_quantization(self) -> None:
        """The engine's rules for bitsandbytes weights (src/recipe/recipe.cpp)."""
        for key in ("load_in_4bit", "bnb_4bit_use_double_quant", "load_in_8bit", "prepare_kbit_training"):
            if not isinstance(getattr(self, key), bool):
                raise RecipeError(f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.bnb_4bit_quant_type not in BNB_4BIT_QUANT_TYPES:
            raise RecipeError(f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r} is not one of "
                              f"{', '.join(BNB_4BIT_QUANT_TYPES)}")
        if self.load_dtype not in LOAD_DTYPES:
            raise RecipeError(f"load_dtype={self.load_dtype!r} is not one of {', '.join(LOAD_DTYPES)}")
        if self.bnb_4bit_quant_storage not in BNB_4BIT_QUANT_STORAGES:
            raise RecipeError(f"bnb_4bit_quant_storage={self.bnb_4bit_quant_storage!r} is not one of "
                              f"{', '.join(BNB_4BIT_QUANT_STORAGES)}")
        if not self.load_in_4bit:
            if self.bnb_4bit_quant_type != "fp4" or self.bnb_4bit_use_double_quant:
                raise RecipeError("bnb_4bit_quant_type / bnb_4bit_use_double_quant are set without load_in_4bit")
            if self.bnb_4bit_quant_storage != "uint8":
                raise RecipeError("bnb_4bit_quant_storage is set without load_in_4bit")
            if self.load_dtype == "fp16" and not self.uses_lora:  # GradScaler refuses fp16 gradients
                raise RecipeError("load_dtype='fp16' without LoRA: fp16 parameters under fp16 autocast, whose "
                                  "GradScaler refuses fp16 gradients; use fp16-true, or bf16")
        if self.load_dtype != "auto" and not (self.precision == f"{self.load_dtype}-mixed" and self.mode == "training"):
            raise RecipeError(f"load_dtype={self.load_dtype!r} is a model loaded in {self.load_dtype} and trained "
                              f"under {self.load_dtype} autocast: it needs precision {self.load_dtype}-mixed")
        if not self.prepare_kbit_training and not (self.load_in_4bit and self.load_dtype != "auto"):
            raise RecipeError("prepare_kbit_training=False keeps a half-loaded 4-bit base's other weights half: it "
                              "needs load_in_4bit and load_dtype bf16 or fp16")
        if self.load_in_8bit:
            if self.load_in_4bit:
                raise RecipeError("load_in_8bit and load_in_4bit cannot both be set")
            if self.mode != "inference":
                raise RecipeError("load_in_8bit: training with 8-bit (LLM.int8) weights is not modelled; "
                                  "use it with inference, or load_in_4bit with LoRA (QLoRA) for training")
        if not (self.load_in_4bit or self.load_in_8bit):
            return
        if self.mode == "training" and not self.uses_lora:
            raise RecipeError("load_in_4bit: a 4-bit base model cannot be trained itself; add LoRA adapters "
                              "(lora_rank > 0): that is QLoRA")
        # DeepSpeed's bf16 mode (bf16-master under ZeRO) loads in bf16 and casts the fp32 rest of
        # prepare_model_for_kbit_training back to bf16 (the engine's Note [QLoRA under ZeRO-1/2]).
        zero_bf16 = (self.precision == "bf16-master" and self.parallel in ("zero1", "zero2", "zero3")
                     and self.load_in_4bit)
        if (self.precision not in QUANTIZED_PRECISIONS and not (self.autocast_dtype_name and self.mode == "training")
                and not zero_bf16):
            key = "load_in_4bit" if self.load_in_4bit else "load_in_8bit"
            raise RecipeError(f"precision={self.precision!r} with {key} is not measured: the precision's dtype "
                              f"is the load and compute dtype; use {', '.join(QUANTIZED_PRECISIONS)}, or for "
                              "training bf16-mixed / fp16-mixed (autocast's dtype is the compute dtype)")

    @property
    def is_quantized(self) -> bool:
        """bitsandbytes weights: 4-bit (Linear4bit) or 8-bit (Linear8bitLt)."""
        return self.load_in_4bit or self.load_in_8bit

    @property
    def lora_target_names(self) -> list[str]:
        """`lora_targets` split at commas: ["default"], ["all-linear"] or module names as peft matches them."""
        names = [item.strip() for item in self.lora_targets.split(",")]
        if any(not name for name in names):
            raise RecipeError(f"lora_targets: empty module name in {self.lora_targets!r}")
        return names

    @property
    def uses_lora(self) -> bool:
        return self.lora_rank > 0

    # --- what the precision policy means for dtypes -------------------------------------------

    @property
    def weight_dtype_name(self) -> str:
        """dtype the model is built in (a 4-bit base's load dtype is models.build_quantized_model's)."""
        if self.load_dtype != "auto" and not self.load_in_4bit:  # a half model under its autocast
            return {"bf16": "bfloat16", "fp16": "float16"}[self.load_dtype]
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

    def as_dict(self, lora_targets: list[str] | None = None) -> dict:
        """The JSON `recipe` object, with the engine's keys: `lora_rank` always, and with adapters
        `lora_targets` (the resolved module paths inside a decoder layer when given, else the
        spelling) and `lora_dropout`."""
        out = dataclasses.asdict(self)
        if not self.uses_lora:
            del out["lora_targets"], out["lora_dropout"]
        elif lora_targets is not None:
            out["lora_targets"] = list(lora_targets)
        if not self.load_in_4bit:  # as the engine writes it: the 4-bit keys only for a 4-bit base
            del out["load_in_4bit"], out["bnb_4bit_quant_type"], out["bnb_4bit_use_double_quant"]
        if out.get("load_dtype") == "auto":  # as the engine writes it: only when not the precision's
            del out["load_dtype"]
        if out.get("bnb_4bit_quant_storage") == "uint8":  # and the storage only when not bitsandbytes' default
            del out["bnb_4bit_quant_storage"]
        if out["prepare_kbit_training"]:  # and the preparation only when skipped
            del out["prepare_kbit_training"]
        if not self.load_in_8bit:  # and load_in_8bit only for 8-bit weights
            del out["load_in_8bit"]
        if self.attention_mask == "none":  # as the engine writes it: the mask only when the batch has one
            del out["attention_mask"]
        if not self.is_inference:  # as the engine writes it: new_tokens and beams for inference only
            del out["new_tokens"], out["beams"]
        if self.parallel == "none":  # no data parallelism: the keys of a single-GPU recipe, as before
            del out["gpus"], out["parallel"]
        if not self.is_tp:  # the tensor-parallel degree only when there is one
            del out["tp"]
        if not self.sequence_parallel:  # and sequence parallelism only when it is on
            del out["sequence_parallel"]
        if not self.loss_parallel:  # and loss parallelism only when it is on
            del out["loss_parallel"]
        if not self.is_pp:  # the pipeline degree and schedule only when there is a pipeline
            del out["pp"], out["pp_schedule"]
        if self.pp_stages_per_rank == 1:  # the stages per rank only with a multi-stage schedule
            del out["pp_stages_per_rank"]
        if self.parallel != "fsdp":  # FSDP2's knobs with parallel fsdp only, as the engine writes them
            for key in ("fsdp_reshard_after_forward", "fsdp_replicate", "fsdp_param_dtype", "fsdp_reduce_dtype"):
                del out[key]
        for knob in FLAGS_WHEN_ON:  # DDP's knobs, the output conversion, FSDP2's no_sync, the cache
            if not getattr(self, knob):
                del out[knob]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        """Inverse of as_dict: `lora_targets` may be a list of module names (the JSON's resolved paths)."""
        known = {f.name for f in dataclasses.fields(cls)} | {"steps"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(f"unknown recipe key(s): {', '.join(unknown)}")
        data = dict(data)
        data.pop("steps", None)  # the engine's training JSON carries steps (always 2)
        targets = data.get("lora_targets")
        if isinstance(targets, (list, tuple)):
            if not targets or not all(isinstance(t, str) for t in targets):
                raise RecipeError("lora_targets must be a string or a non-empty list of module names")
            data["lora_targets"] = ",".join(targets)
        return cls(**data)
