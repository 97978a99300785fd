"""Pipeline-parallel measurements: torch.distributed.pipelining on gloo CPU ranks.

`recipe.pp` = N > 1 starts N processes (parallel.launch); rank r is pipeline stage r. With
`gpus` D > 1 and `parallel` ddp or fsdp (PP x DP) it starts N x D: a 2-D DeviceMesh (pp, dp), pp
outermost as torchtitan's, so rank r is stage r // D, and each stage module is wrapped by
DistributedDataParallel over its dp group (`_data_parallel`; torch's PipelineStage runs it under
no_sync but for the step's last backward: docs/parallelism.md "PP x DP with DDP"), or, with fsdp,
sharded by FSDP2 over the dp dimension of the mesh (`_fully_shard`: every decoder layer of the
stage, then the stage module; the PipelineStage turns gradient sync and the reshard
after backward off for every backward and runs the reductions once after the last one:
docs/parallelism.md "PP x DP with FSDP2"). With `tp` T > 1 (PP x TP) it starts N x T on a (pp, tp)
mesh, tp innermost as torchtitan's (rank r is stage r // T), and parallelizes each pruned stage
over the tp dimension with the TP path's own plan (parallel.py tensor_parallelize; under
sequence parallelism the stage's metadata is Shard(1) meta DTensors, `_shard_meta`); with fsdp
too (PP x TP x FSDP2) N x D x T on a (pp, dp, tp) mesh, the plan then FSDP2 over dp
(docs/parallelism.md "PP x TP"). Every rank
builds the whole model with the same seed (the same weights), keeps its own stage and drops the
rest before tracking (`make_stage`), and runs the schedule under its own tracker (`run_steps`).

The split (Note [Pipeline split] in src/graph/pipeline.h): the decoder layers are cut into N
contiguous groups as evenly as possible, the first `num_layers % N` stages taking one layer more
(torch's pipelining leaves the split to the user; this is our rule); stage 0 also holds the token embedding, the last stage the final norm and lm_head. Each stage
also keeps the rotary embedding (its `inv_freq` buffer): every stage computes the cos/sin it
hands its layers, as LlamaModel.forward does (modeling_llama.py).

Each stage is a `PipelineStage` built by hand (`_StageModule`: the stage's part of
LlamaModel.forward, by the HF modules themselves, with the attention masks the family's own
forward builds: `layer_masks`), with static metadata: `input_args` and
`output_args` as meta tensors of one micro-batch, so the schedule runs no metadata inference (no
extra forward/backward in the first step: stage.py `InferenceMode.needs_dynamic` is False for plain
tensors with complete forward metadata).

Micro-batches: the recipe's `batch` is the micro-batch size and `grad_accum` the schedule's
`n_microbatches`: `schedule.step` is handed a batch of batch x grad_accum sequences and splits it
along dim 0 (views). The loss function is the model's own (ForCausalLMLoss, mean over tokens);
the schedule's default `scale_grads=True` divides the gradients by n_microbatches after the last
backward (in place), so the step is the same as grad_accum micro-batches of `batch` on one GPU.
`schedule.step(..., return_outputs=False)`: the last stage keeps no micro-batch logits for a
merged output (torchtitan passes the same).

The loop per rank:

    for step in 1, 2:
        schedule.step(input_ids | , target=labels | , return_outputs=False)   # stage 0 | last stage
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

Several stages per rank (`pp_stages_per_rank` V > 1, `pp_schedule` interleaved-1f1b or looped-bfs:
ScheduleInterleaved1F1B, ScheduleLoopedBFS): the layers split over pp x V stages by the same rule,
rank r holding stages r, r + pp, ..., one PipelineStage per local stage over a stage module of its
own modules (`make_virtual_stages`, `_VirtualStageModule`), the schedule built with the list of
stages (Note [Interleaved pipeline schedules] in src/graph/pipeline.cpp). With `gpus` D > 1 and
`parallel` ddp or fsdp each local stage module is wrapped on its own (its own DDP, or FSDP2 on its
layers and on itself as a root); the schedule's lowering then adds UNSHARD / RESHARD actions around
FSDP2 stages and a REDUCE_GRAD after each stage's last backward (docs/parallelism.md "Several
stages per rank"). No HSDP and no tensor parallelism with several stages per rank.

Checkpointing: run.py enables HF's (non-reentrant) checkpointing on the whole model before the
stage is cut, so each decoder layer `_StageModule` calls is checkpointed as on one GPU. Precision
bf16-mixed: torch leaves the autocast context to the caller; here each stage forward runs in a
`torch.autocast` context of its own, and the last stage's loss_fn in another (`stage_autocast`),
not the whole `schedule.step` (which would run the backwards under autocast too and keep the weight
casts across micro-batches). What a stage sends stays fp32 (the residual stream), the last stage's
logits are bf16. bf16-master: fp32 masters of the stage's parameters, stepped by the optimizer and
copied back, as in training.py (`make_masters`, `grads_to_masters`, `masters_to_params`).

Phases and labels: each `forward_one_chunk` is phase forward of micro-batch chunk+1, the loss
function phase loss, each `backward_one_chunk` phase backward; what the schedule allocates when
it is first stepped (its receive buffers) is labelled forward of micro-batch 1.

Categories: the stage's receive buffers (`_RecvInfo.buffer`: one per micro-batch for the
activations a non-first stage receives, one per micro-batch for the gradients a non-last stage
receives, all made once at the first step and kept) are `other`, like the input batch: data
handed to this rank. The gradient autograd accumulates into a received activation (a leaf that
requires grad: `.grad` of the receive buffer, which `stage_backward` hands on and sets to None;
the send's P2P ops and works keep it a while) is an ordinary temporary.
"""

from __future__ import annotations

import functools

import torch

from .recipe import Recipe, RecipeError
from .tracker import LOSS

PP_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")


def split_layers(num_layers: int, stages: int) -> list[range]:
    """Note [Pipeline split]: contiguous groups, the first num_layers % stages one layer longer."""
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class _StageModule(torch.nn.Module):
    """Stage `index` of the model's forward + the head: embedding (first), the attention masks
    (layer_masks), its layers, norm and lm_head (last). Holds the HF model as a child, so
    parameters and labels are the HF ones."""

    def __init__(self, hf_model, index: int, stages: int, layers: range, autocast):
        super().__init__()
        self.hf = hf_model
        self.first = index == 0
        self.last = index == stages - 1
        self.layer_ids = list(layers)
        self.autocast = autocast

    def forward(self, x):
        with self.autocast():  # bf16-mixed: each micro-batch's forward in a context of its own
            return self._forward(x)

    def _forward(self, x):
        base = self.hf.model
        hidden = base.embed_tokens(x) if self.first else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = layer_masks(base.config, hidden, position_ids)
        position_embeddings = base.rotary_emb(hidden, position_ids=position_ids)
        for i in self.layer_ids:
            hidden = base.layers[i](hidden, attention_mask=masks[i], position_embeddings=position_embeddings,
                                    position_ids=position_ids, cache=None, use_cache=False)
        if not self.last:
            return hidden
        hidden = base.norm(hidden)
        return self.hf.lm_head(hidden)


def layer_masks(config, hidden: torch.Tensor, position_ids: torch.Tensor) -> list:
    """The attention mask of each decoder layer, made as the family's own model forward makes them
    (transformers 5): Llama a causal mask; Mistral and Phi-3 a sliding-window one where the config
    sets a window, else a causal one; Qwen2 and Qwen3 a causal one and, with sliding layers
    (`layer_types`), a sliding-window one, each layer taking its type's."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    def make(fn):
        return fn(config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids)

    layers = config.num_hidden_layers
    if config.model_type in ("qwen2", "qwen3"):
        by_type = {"full_attention": make(create_causal_mask)}
        if "sliding_attention" in config.layer_types:
            by_type["sliding_attention"] = make(create_sliding_window_causal_mask)
        return [by_type[t] for t in config.layer_types[:layers]]
    sliding = config.model_type != "llama" and getattr(config, "sliding_window", None) is not None
    return [make(create_sliding_window_causal_mask if sliding else create_causal_mask)] * layers


def check(model: torch.nn.Module, recipe: Recipe) -> None:
    name = type(model).__name__
    if name not in PP_FAMILIES:
        raise RecipeError(f"pp={recipe.pp}: {name} is not split by the measuring side; "
                          f"use one of {', '.join(PP_FAMILIES)}")
    if model.config.tie_word_embeddings:
        raise RecipeError(f"pp={recipe.pp}: the model ties lm_head to the embedding, which the first and the last "
                          "stage would each need; pipelining tied weights is not modelled")
    if model.config.num_hidden_layers < recipe.pp:
        raise RecipeError(f"pp={recipe.pp}: the model has {model.config.num_hidden_layers} decoder layers, fewer "
                          "than the stages")
    stages = recipe.pp * recipe.pp_stages_per_rank
    if model.config.num_hidden_layers < stages:
        raise RecipeError(f"pp={recipe.pp} x pp_stages_per_rank={recipe.pp_stages_per_rank}: the model has "
                          f"{model.config.num_hidden_layers} decoder layers, fewer than the {stages} stages")


def stage_autocast(recipe: Recipe, device: str):
    """bf16-mixed: a fresh torch.autocast context for each stage forward and each loss_fn call
    (see the module docstring); a no-op context otherwise."""
    import contextlib

    if recipe.autocast_dtype_name is None:
        return contextlib.nullcontext
    dtype = getattr(torch, recipe.autocast_dtype_name)
    return functools.partial(torch.autocast, torch.device(device).type, dtype=dtype)


def _pipeline_mesh(recipe: Recipe, device: str):
    """This rank's place in the pipeline's device mesh, torchtitan's order (pp outermost, tp
    innermost): (pipeline rank, pp group, dp mesh, dp group, tp mesh), None where the recipe has no
    such dimension. PP x TP: (pp, tp), rank r is pipeline rank r // T; PP x TP x FSDP2: (pp, dp,
    tp); PP x DP: (pp, dp), or (pp, replicate, shard) for HSDP; a plain pipeline: the world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    kind, pp = torch.device(device).type, recipe.pp
    if recipe.tp > 1:
        if recipe.gpus > 1:
            mesh = init_device_mesh(kind, (pp, recipe.gpus, recipe.tp), mesh_dim_names=("pp", "dp", "tp"))
            dp_mesh = mesh["dp"]
        else:
            mesh, dp_mesh = init_device_mesh(kind, (pp, recipe.tp), mesh_dim_names=("pp", "tp")), None
        return mesh["pp"].get_local_rank(), mesh.get_group("pp"), dp_mesh, None, mesh["tp"]
    if recipe.gpus > 1:
        if recipe.parallel == "fsdp" and recipe.fsdp_replicate > 1:
            mesh = init_device_mesh(kind, (pp, recipe.fsdp_replicate, recipe.gpus // recipe.fsdp_replicate),
                                    mesh_dim_names=("pp", "replicate", "shard"))
            dp_mesh, dp_group = mesh["replicate", "shard"], None
        else:
            mesh = init_device_mesh(kind, (pp, recipe.gpus), mesh_dim_names=("pp", "dp"))
            dp_mesh, dp_group = mesh["dp"], mesh.get_group("dp")
        return mesh["pp"].get_local_rank(), mesh.get_group("pp"), dp_mesh, dp_group, None
    return dist.get_rank(), None, None, None, None


def make_stage(model: torch.nn.Module, recipe: Recipe, device: str):
    """Prune the model to this rank's stage (in place, before tracking) and build its PipelineStage."""
    from torch.distributed.pipelining import PipelineStage

    check(model, recipe)
    if recipe.pp_stages_per_rank > 1:
        return make_virtual_stages(model, recipe, device)
    stages = recipe.pp
    rank, group, dp_mesh, dp_group, tp_mesh = _pipeline_mesh(recipe, device)
    cuts = split_layers(model.config.num_hidden_layers, stages)
    base = model.model
    for i in range(len(base.layers)):
        if i not in cuts[rank]:
            base.layers[i] = torch.nn.Identity()
    if rank != 0:
        base.embed_tokens = None
    if rank != stages - 1:
        base.norm = None
        model.lm_head = None
    if tp_mesh is not None:
        # The pruned stage parallelized as the TP path parallelizes the whole model (the Megatron plan
        # on each decoder layer it keeps, the rest replicated): torchtitan's pipeline_llm applies its
        # parallelize_fn to each model part the same way (torchtitan/distributed/pipeline_parallel.py).
        from .parallel import tensor_parallelize

        tensor_parallelize(model, recipe, device, mesh=tp_mesh)
    module = _StageModule(model, rank, stages, cuts[rank], stage_autocast(recipe, device))
    if recipe.gpus > 1 and recipe.parallel == "fsdp":
        module = _fully_shard(module, recipe, dp_mesh, [base.layers[i] for i in cuts[rank]])
    elif dp_group is not None:
        module = _data_parallel(module, recipe, dp_group)
    args = _stage_args(model, recipe, tp_mesh, rank, stages)
    stage = PipelineStage(module, rank, stages, torch.device(device), group=group, **args)
    return stage


def _stage_args(model: torch.nn.Module, recipe: Recipe, tp_mesh, index: int, stages: int) -> dict:
    """PipelineStage's metadata for stage `index` of `stages`: input_args, output_args and, where
    static DTensor mode needs them, input_grads / output_grads."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    if recipe.parallel == "fsdp" and recipe.fsdp_param_dtype != "none":
        from .recipe import FSDP_DTYPE_NAMES

        # MixedPrecisionPolicy(param_dtype): the stage computes, sends and receives in param_dtype
        # over its fp32 shards (what metadata inference from a real forward would find).
        dtype = getattr(torch, FSDP_DTYPE_NAMES[recipe.fsdp_param_dtype])
    # Under autocast the residual stream (what a stage sends) stays in the parameters' dtype and
    # the logits come out of lm_head in autocast's.
    logits_dtype = getattr(torch, recipe.autocast_dtype_name) if recipe.autocast_dtype_name else dtype
    meta = torch.device("meta")
    # The metadata says what requires grad: the hidden states between stages do (the receiving
    # stage makes its receive buffer a leaf that requires grad, and the sender gets a gradient
    # receive buffer), the input ids do not.
    hidden = torch.empty(recipe.batch, recipe.seq, cfg.hidden_size, dtype=dtype, device=meta, requires_grad=True)
    ids = torch.empty(recipe.batch, recipe.seq, dtype=torch.int64, device=meta)
    logits = torch.empty(recipe.batch, recipe.seq, cfg.vocab_size, dtype=logits_dtype, device=meta,
                         requires_grad=True)
    first, last = index == 0, index == stages - 1
    args = {}
    if tp_mesh is not None and (recipe.sequence_parallel or recipe.loss_parallel):
        # PP x TP with sequence parallelism: the residual stream a stage sends and receives is a
        # Shard(1) DTensor (parallel.py _sequence_parallelize). The metadata says so, with the
        # gradients' (Shard(1) too), as static DTensor mode needs (torch 2.13 stage.py:
        # InferenceMode.needs_dynamic): each rank sends and receives its local [b, s / tp, h] shard
        # (get_fwd_send_ops' to_local_if_dtensor) and the receiver rebuilds the DTensor around its
        # buffer (_retrieve_recv_activations: DTensor.from_local, the leaf that requires grad).
        # With loss parallelism the last stage's output is the Shard(-1) DTensor of the logits
        # (parallel.py _vocab_parallelize_head), whose gradient no stage receives.
        if recipe.sequence_parallel:
            hidden, hidden_grad = (_shard_meta(recipe, cfg.hidden_size, dtype, tp_mesh, 1) for _ in range(2))
            hidden.requires_grad_(True)
        else:
            hidden_grad = torch.empty(recipe.batch, recipe.seq, cfg.hidden_size, dtype=dtype, device=meta)
        if recipe.loss_parallel:
            logits = _shard_meta(recipe, cfg.vocab_size, logits_dtype, tp_mesh, 2).requires_grad_(True)
        args = {"input_grads": (None,) if first else (hidden_grad,),
                "output_grads": (None,) if last else (hidden_grad,)}
    args["input_args"] = (ids if first else hidden,)
    args["output_args"] = (logits if last else hidden,)
    return args


class _VirtualStageModule(_StageModule):
    """A stage of a multi-stage schedule: as _StageModule, but the HF model is not its child and it
    registers only the modules the stage runs, so that its parameters (what the PipelineStage
    scales in scale_grads, per stage) are its own and not those of the rank's other stages."""

    def __init__(self, hf_model, index: int, stages: int, layers: range, autocast):
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "hf", hf_model)  # an attribute, not a submodule
        self.first = index == 0
        self.last = index == stages - 1
        self.layer_ids = list(layers)
        self.autocast = autocast
        base = hf_model.model
        parts = [base.embed_tokens] if self.first else []
        parts += [base.layers[i] for i in layers]
        if self.last:
            parts += [base.norm, hf_model.lm_head]
        self.parts = torch.nn.ModuleList(parts)


def make_virtual_stages(model: torch.nn.Module, recipe: Recipe, device: str) -> list:
    """The multi-stage schedules (pp_stages_per_rank V > 1), as torchtitan builds them
    (torchtitan/distributed/pipeline_parallel.py: stage_ids_this_rank with style "loop", one
    PipelineStage per model part): the decoder layers split over pp x V stages by split_layers, rank
    r holding stages r, r + pp, ..., r + (V - 1) pp (torch's generate_stage_to_rank_mapping for
    interleaved and looped schedules); one pruned HF model per rank whose kept layers are those of
    every local stage, and one PipelineStage per local stage over its own modules
    (_VirtualStageModule). With `gpus` D > 1 (PP x DP, ranks as in make_stage: a (pp, dp) mesh,
    stage rank r // D) each stage module gets a data-parallel wrapper of its own, as torchtitan
    parallelizes each model part and torch's pipelining tests wrap each stage module: DDP over the
    dp group (`_data_parallel`), or FSDP2 on each of its decoder layers and then on the stage module
    (`_fully_shard`, HSDP and a MixedPrecisionPolicy as the recipe has them), so every local stage
    is its own FSDP2 root with its own communication state (Notes [Interleaved pipeline schedules
    with DDP] / [... with FSDP2] in src/graph/pipeline.cpp). With `tp` T > 1 the pruned model is
    parallelized over the tp dimension before the stages are cut from it, as in make_stage."""
    from torch.distributed.pipelining import PipelineStage

    pp, per_rank = recipe.pp, recipe.pp_stages_per_rank
    stages = pp * per_rank
    rank, group, dp_mesh, dp_group, tp_mesh = _pipeline_mesh(recipe, device)
    local = [rank + v * pp for v in range(per_rank)]
    cuts = split_layers(model.config.num_hidden_layers, stages)
    kept = {i for s in local for i in cuts[s]}
    base = model.model
    for i in range(len(base.layers)):
        if i not in kept:
            base.layers[i] = torch.nn.Identity()
    if 0 not in local:
        base.embed_tokens = None
    if stages - 1 not in local:
        base.norm = None
        model.lm_head = None
    if tp_mesh is not None:  # PP x TP: the pruned model parallelized as in make_stage, every local stage's layers
        from .parallel import tensor_parallelize

        tensor_parallelize(model, recipe, device, mesh=tp_mesh)
    autocast = stage_autocast(recipe, device)
    modules = []
    for s in local:
        module = _VirtualStageModule(model, s, stages, cuts[s], autocast)
        if recipe.gpus > 1 and recipe.parallel == "fsdp":
            module = _fully_shard(module, recipe, dp_mesh, [base.layers[i] for i in cuts[s]], reseed=False)
        elif recipe.gpus > 1 and recipe.parallel == "ddp":
            module = _data_parallel(module, recipe, dp_group, reseed=False)
        modules.append(module)
    if recipe.gpus > 1:
        _reseed_replica(recipe)
    out = []
    for s, module in zip(local, modules):
        out.append(PipelineStage(module, s, stages, torch.device(device), group=group,
                                 **_stage_args(model, recipe, tp_mesh, s, stages)))
    return out


def _shard_meta(recipe: Recipe, width: int, dtype, tp_mesh, dim: int):
    """A meta DTensor of one micro-batch's [b, s, width], Shard(dim) over the tp mesh."""
    from torch.distributed.tensor import DTensor, Shard

    tp = tp_mesh.size()
    shape = [recipe.batch, recipe.seq, width]
    local = list(shape)
    local[dim] //= tp
    return DTensor.from_local(torch.empty(local, dtype=dtype, device="meta"), tp_mesh, [Shard(dim)],
                              run_check=False, shape=tuple(shape), stride=(recipe.seq * width, width, 1))


def _data_parallel(module: torch.nn.Module, recipe: Recipe, dp_group, reseed: bool = True) -> torch.nn.Module:
    """PP x DP: the stage module wrapped by DDP over its data-parallel group (PyTorch's defaults,
    as parallel.wrap_model), and this replica's own batch (`_reseed_replica`)."""
    from torch.nn.parallel import DistributedDataParallel

    from .parallel import _Capture

    capture = _Capture()
    with capture:  # the Reducer's buckets are made here, in C++, through aten
        runner = DistributedDataParallel(module, process_group=dp_group)
    runner._trainmem_made = capture.made
    if reseed:
        _reseed_replica(recipe)
    return runner


def _fully_shard(module: torch.nn.Module, recipe: Recipe, dp_mesh, layers: list, reseed: bool = True) -> torch.nn.Module:
    """PP x FSDP2: the 1-D recipe's units (parallel.wrap_model) on each stage: fully_shard every
    decoder layer the stage holds, then the stage module (the root: the embedding, the final norm
    and lm_head, whichever it keeps), over the dp dimension of the (pp, dp) mesh, with the recipe's
    FSDP2 knobs (HSDP: the (replicate, shard) dimensions of a (pp, replicate, shard) mesh, as
    torchtitan's dp_replicate x fsdp). torchtitan's apply_fsdp (torchtitan/models/llama3/infra/parallelize.py) shards each
    model part the same way but gives the embedding and [norm, output] units of their own, and
    under PP defaults to reshard_after_forward=False. The PipelineStage drives the units
    (stage.py backward_maybe_with_nosync, perform_reduce_grad). Each replica draws its own batch,
    as under DDP (`_reseed_replica`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .recipe import FSDP_DTYPE_NAMES

    dtypes = {key: getattr(torch, FSDP_DTYPE_NAMES[value]) if value != "none" else None
              for key, value in (("param_dtype", recipe.fsdp_param_dtype), ("reduce_dtype", recipe.fsdp_reduce_dtype))}
    mp_policy = MixedPrecisionPolicy(**dtypes)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=recipe.fsdp_reshard_after_forward, mp_policy=mp_policy)
    fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy)  # the root: reshard_after_forward None, False
    if reseed:
        _reseed_replica(recipe)
    return module


def _reseed_replica(recipe: Recipe) -> None:
    """Data-parallel rank d > 0 (rank = stage x gpus + d, over the dp or (replicate, shard)
    dimensions) reseeds with SEED + d, so every stage of a replica draws the same batch (and stage d
    of replica 0 rank 0's)."""
    import torch.distributed as dist

    from .run import SEED

    dp_rank = dist.get_rank() // recipe.tp % recipe.gpus  # PP x TP x FSDP2: rank = (stage x gpus + d) x tp + t
    if dp_rank > 0:
        torch.manual_seed(SEED + dp_rank)


def run_steps(model, stage, recipe: Recipe, tracker, *, device: str, steps: int = 2, make_optimizer) -> None:
    """The reference loop of one pipeline rank under an active tracker (see the module docstring)."""
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleLoopedBFS)

    from .training import _loss_context, grads_to_masters, make_masters, masters_to_params

    hf = model
    vocab = hf.config.vocab_size
    original_loss = hf.loss_function
    autocast = stage_autocast(recipe, device)
    tracker.autocast = recipe.autocast_dtype_name is not None

    def loss_fn(logits, labels):
        tracker.set_phase("loss")
        with tracker.scope(LOSS), autocast():
            loss = original_loss(logits=logits, labels=labels, vocab_size=vocab)
        tracker.label_graph(loss, LOSS)
        return loss

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved-1f1b": ScheduleInterleaved1F1B,
           "looped-bfs": ScheduleLoopedBFS}[recipe.pp_schedule]
    # A multi-stage schedule takes the rank's stages (make_virtual_stages), a single one its stage.
    stages = stage if isinstance(stage, list) else [stage]
    schedule = cls(stage, n_microbatches=recipe.grad_accum, loss_fn=loss_fn)
    # The rank's parameters in the HF model's order, which is also the stages' order (one optimizer
    # over them; torchtitan's OptimizersContainer steps one per stage, in the same order).
    params = [p for s in stages for p in s.submod.parameters() if p.requires_grad]
    current = {"step": 0}

    def forward_one_chunk(fn):
        @functools.wraps(fn)
        def wrapper(chunk, *args, **kwargs):
            tracker.set_phase("forward", current["step"], chunk + 1)
            return fn(chunk, *args, **kwargs)
        return wrapper

    def backward_one_chunk(fn):
        @functools.wraps(fn)
        def wrapper(chunk, *args, **kwargs):
            tracker.set_phase("backward", current["step"], chunk + 1)
            out = fn(chunk, *args, **kwargs)
            tracker.collect_garbage()
            tracker.mark_gradients(params)
            return out
        return wrapper

    def forced_other(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with tracker.forced("other"):
                return fn(*args, **kwargs)
        return wrapper

    for s in stages:
        s.forward_one_chunk = forward_one_chunk(s.forward_one_chunk)
        s.backward_one_chunk = backward_one_chunk(s.backward_one_chunk)
        s._prepare_forward_infra = forced_other(s._prepare_forward_infra)
        s._prepare_backward_infra = forced_other(s._prepare_backward_infra)

    tracker.set_phase("setup", 0, 0)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    # Every rank draws rank 0's batch (the same seed): stage 0 keeps it as the input ids, the last
    # stage as the labels (the same values, as labels = input_ids.clone() on one GPU), a middle
    # stage needs neither.
    input_ids = labels = None
    with tracker.forced("other"):
        if first:
            input_ids = torch.randint(vocab, (recipe.batch * recipe.grad_accum, recipe.seq), device=device)
        elif last:
            labels = torch.randint(vocab, (recipe.batch * recipe.grad_accum, recipe.seq), device=device)
    masters = make_masters(recipe, params, tracker)
    optimizer = make_optimizer(recipe.optimizer, masters or params)
    for step in range(1, steps + 1):
        current["step"] = step
        tracker.set_phase("forward", step, 1)
        # loss_parallel (PP x TP): the schedule step inside loss_parallel(), as torchtitan's train
        # context wraps its pp_schedule.step (the optimizer outside it).
        with _loss_context(recipe, tracker):
            if first:
                schedule.step(input_ids, return_outputs=False)
            elif last:
                schedule.step(target=labels, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        tracker.collect_garbage()
        tracker.mark_gradients(params)
        tracker.set_phase("optimizer", step, recipe.grad_accum)
        grads_to_masters(params, masters, tracker)
        optimizer.step()
        masters_to_params(params, masters)
        tracker.mark_optimizer_state(optimizer)
        tracker.mark_gradients(masters or params)
        optimizer.zero_grad(set_to_none=True)
        tracker.collect_garbage()
    tracker.set_phase("teardown")  # See Note [Teardown] in training.py
