"""Data-parallel measurements: one rank's memory in a multi-process CPU run (gloo).

`measure()` with a recipe whose `parallel` is "ddp" or "fsdp" calls `launch`, which starts
`recipe.gpus` processes (multiprocessing, spawn), sets up a gloo process group of that world size
in each, and runs `measure()` again in every rank: each rank builds the model (same seed, so the
same weights), wraps it (`wrap_model`), draws its own batch (rank r > 0 reseeds with SEED + r) and
runs the reference step under its own tracker. Rank 0's result is returned; every rank's peak and
breakdown are in `diagnostics.parallel.ranks`, and `ranks_identical` says whether they agree.

The wrappers, as the recipe knobs say (docs/parallelism.md):

* ddp: `DistributedDataParallel(model)` with PyTorch's defaults (bucket_cap_mb 25, first bucket
  1 MiB, broadcast_buffers True), find_unused_parameters and gradient_as_bucket_view as the recipe
  says (both False by default); no device_ids (CPU).
* fsdp: FSDP2, `fully_shard(layer, mesh, reshard_after_forward=recipe.fsdp_reshard_after_forward)`
  on every decoder layer (the modules whose class is in the model's `_no_split_modules`, as
  Accelerate's transformer auto-wrap picks them), then `fully_shard(model, mesh)`, both with
  `MixedPrecisionPolicy(param_dtype, reduce_dtype)` from fsdp_param_dtype / fsdp_reduce_dtype
  ("none": None; both none is the default policy); the mesh is a 1-D "cpu" DeviceMesh over the
  world, or with fsdp_replicate R > 1 the 2-D HSDP mesh (R, world / R) named ("replicate", "shard").
* tp (recipe `tp` > 1, gpus 1): tensor parallelism as torch.distributed.tensor.parallel does it,
  `parallelize_module(layer, mesh, plan)` on every decoder layer with the Megatron plan of torch's
  Llama example and of transformers' `base_model_tp_plan`: q_proj, k_proj, v_proj, gate_proj,
  up_proj ColwiseParallel(), o_proj, down_proj RowwiseParallel() (default layouts,
  use_local_output=True: the attention reshapes with -1 heads and sees num_heads / tp local heads);
  the embedding, the norms and lm_head stay replicated: `distribute_module` makes their
  parameters Replicate DTensors (the same values on every rank; a foreach optimizer cannot step
  DTensor and plain parameters in one group), their inputs Replicate views (`DTensor.from_local`)
  and their outputs local tensors again, so they compute exactly what they compute unwrapped.
  Every rank of the tensor-parallel group draws the same batch (rank 0's). With recipe
  `sequence_parallel`: SequenceParallel() on the norms, ColwiseParallel(input_layouts=Shard(1)),
  RowwiseParallel(output_layouts=Shard(1), use_local_output=False), the embedding's output split
  and lm_head's input gathered (`_sequence_parallelize`). With recipe `loss_parallel`: lm_head
  ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) (input_layouts Shard(1) with
  sequence parallelism), vocab-sharded DTensor logits, the step inside `loss_parallel()`.

Note [Parallel categories]
    A storage is categorized by what it holds (see docs/parallelism.md for the reasoning):
    weights           also FSDP2's sharded parameters (the DTensors' padded local shards, registered
                      like any parameter), the unsharded parameters each unit all-gathers (one
                      storage per parameter, resized to full size at each all-gather and to 0 at
                      each reshard: the tracker sees both through `storage_resized`), and the
                      all-gather buffers (the flat copy-in/out buffer of a unit, and with a
                      param_dtype policy the cast shards): everything allocated inside
                      `foreach_all_gather` and `foreach_all_gather_copy_out`
    gradients         also DDP's buckets (flat gradient buffers the Reducer allocates in C++ at
                      construction and again when it rebuilds them at the second forward; the
                      construction ones are registered at setup), FSDP2's unsharded gradients
                      (the `.grad` autograd accumulates on an unsharded parameter, marked when the
                      unit's post-backward takes it) and everything `foreach_reduce` allocates
                      (the reduce-scatter input, kept until the next unit's reduce-scatter, and
                      its output, whose views become the sharded `.grad`s)
    The other categories are unchanged. Memory a collective allocates inside gloo (C++, not
    through aten) is not seen; on a GPU, NCCL's buffers are outside PyTorch's allocator anyway.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import socket
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .recipe import Recipe, RecipeError
from .tracker import _iter_tensors

_WORKER_ENV = "TRAINMEM_PARALLEL_RANK"


def in_worker() -> bool:
    """True inside a rank started by `launch` (its process group is up)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _children_import_this_copy():
    """Spawned ranks import `_rank_main` by name with the parent's sys.path. The parent may have
    this trainmem.measure from a source tree grafted onto an installed trainmem (tools/
    measure_common.py): put the directory holding this copy first while the ranks start, so they
    run the same code and not an older installed one."""
    here = str(Path(__file__).resolve().parents[2])
    saved = list(sys.path)
    sys.path.insert(0, here)
    try:
        yield
    finally:
        sys.path[:] = saved


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model, recipe: Recipe, *, device: str, fake: bool, trace: str | None, command: str | None,
           steps: int, timeout: float | None = None) -> dict:
    """Run the measurement in `recipe.world_size` processes; rank 0's result with every rank's summary."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    what = (f"pp={recipe.pp}" if recipe.is_pp else f"tp={recipe.tp}" if recipe.is_tp
            else f"parallel={recipe.parallel!r}")
    if fake:
        raise RecipeError(f"{what} cannot run on fake tensors: the collectives move real data")
    if device != "cpu":
        raise RecipeError(f"{what} is measured on the CPU (gloo) only")
    if not (dist.is_available() and dist.is_gloo_available()):
        raise RecipeError(f"{what} needs torch.distributed with the gloo backend")
    world = recipe.world_size
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="trainmem-parallel-") as tmp, _children_import_this_copy():
        procs = []
        for rank in range(world):
            out = os.path.join(tmp, f"rank{rank}.json")
            rank_trace = trace if (trace is None or rank == 0) else f"{trace}.rank{rank}"
            proc = ctx.Process(target=_rank_main, args=(rank, world, port, model, recipe, device, rank_trace,
                                                         command, steps, out), daemon=False)
            proc.start()
            procs.append(proc)
        for proc in procs:
            proc.join(timeout)
        results = []
        docs = {}
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.json")
            if os.path.exists(path):
                docs[rank] = json.loads(open(path).read())
        # A rank that failed on its own is the cause; the others then see their peer's connection close.
        failed = [r for r, d in docs.items() if "error" in d]
        first = next((r for r in failed if "Connection closed by peer" not in docs[r]["error"]), None)
        if first is not None:
            doc = docs[first]
            cls = RecipeError if doc.get("type") == "RecipeError" else RuntimeError
            print(doc.get("traceback", ""), file=sys.stderr)
            raise cls(f"parallel rank {first}: {doc['error']}")
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
                proc.join()
            path = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"parallel rank {rank} exited with code {proc.exitcode} and no result")
            doc = json.loads(open(path).read())
            if "error" in doc:
                cls = RecipeError if doc.get("type") == "RecipeError" else RuntimeError
                raise cls(f"parallel rank {rank}: {doc['error']}")
            results.append(doc)
    return _merge(results, worst=recipe.is_pp)


def _rank_main(rank: int, world: int, port: int, model, recipe: Recipe, device: str, trace, command, steps,
               out: str) -> None:
    import torch.distributed as dist

    os.environ[_WORKER_ENV] = str(rank)
    # DeepSpeed prints to stdout (its op builder, its banner): keep the parent's stdout for the JSON.
    os.dup2(2, 1)
    # What a launcher (torchrun, deepspeed) sets; DeepSpeed's engine reads LOCAL_RANK.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        from .run import measure, quiet_libraries

        quiet_libraries()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            result = measure(model, recipe, device=device, trace=trace, command=command, steps=steps)
        finally:
            dist.destroy_process_group()
        doc = result
    except Exception as e:  # reported to the parent, which raises it
        doc = {"error": f"{type(e).__name__}: {e}", "type": type(e).__name__, "traceback": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(doc, f)


def _summary(rank: int, result: dict) -> dict:
    return {"rank": rank, "peak_allocated_bytes": result["peak_allocated_bytes"],
            "breakdown_at_peak": result["breakdown_at_peak"], "peak": result["peak"], "steps": result["steps"],
            "phases": result.get("phases", []),
            "storages": result["diagnostics"]["storages"], "events": result["diagnostics"]["events"],
            "freed_off_thread_bytes": result["diagnostics"].get("freed_off_thread_bytes", 0)}


def _merge(results: list[dict], worst: bool = False) -> dict:
    """Rank 0's result, or with `worst` (pipeline stages, which hold different memory) the rank with
    the highest peak (the lowest such rank): the per-GPU figure that must fit."""
    ranks = [_summary(r, doc) for r, doc in enumerate(results)]
    chosen = 0
    if worst:
        chosen = max(range(len(results)), key=lambda r: (results[r]["peak_allocated_bytes"], -r))
    out = results[chosen]
    keys = ("peak_allocated_bytes", "breakdown_at_peak", "peak", "steps", "storages", "events")
    identical = all(all(s[k] == ranks[0][k] for k in keys) for s in ranks[1:])
    info = out["diagnostics"].setdefault("parallel", {})
    info.update({"world_size": len(results), "rank": chosen, "ranks_identical": identical, "ranks": ranks})
    return out


# ---------------------------------------------------------------------------------------- wrapping


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: modules whose class is in `_no_split_modules` (Accelerate's auto-wrap)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RecipeError(f"parallel=fsdp: found no decoder layer in {type(model).__name__} "
                          f"(_no_split_modules={sorted(names)})")
    return layers


class _Capture(TorchDispatchMode):
    """Weak references to every tensor made while active (DDP's construction, in C++)."""

    def __init__(self):
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        stack = [out]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                self.made.append(weakref.ref(item))
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
        return out


def wrap_model(model: torch.nn.Module, recipe: Recipe, device: str) -> torch.nn.Module:
    """The module the step calls: DDP(model), or the model itself after fully_shard (in place).

    Called in a rank after the model is built (and checkpointing enabled), before tracking.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != recipe.world_size:
        raise RecipeError(f"world size {world} differs from gpus x tp x pp = {recipe.world_size}")
    if recipe.is_pp:  # also PP x TP (x FSDP2): the stage's own mesh (pipeline.py make_stage)
        from .pipeline import make_stage

        return make_stage(model, recipe, device)  # every stage runs rank 0's batch
    if recipe.is_tp and recipe.parallel == "fsdp":
        return _tp_fsdp(model, recipe, device)
    if recipe.is_tp:
        tensor_parallelize(model, recipe, device)
        return model  # every rank of the tensor-parallel group runs rank 0's batch
    if recipe.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        capture = _Capture()
        with capture:  # the Reducer's buckets are made here, in C++, through aten
            runner = DistributedDataParallel(model, find_unused_parameters=recipe.ddp_find_unused_parameters,
                                             gradient_as_bucket_view=recipe.ddp_gradient_as_bucket_view)
        runner._trainmem_made = capture.made
    elif recipe.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from torch.distributed.fsdp import MixedPrecisionPolicy

        from .recipe import FSDP_DTYPE_NAMES

        if recipe.fsdp_replicate > 1:  # HSDP: replicate over dim 0, shard over dim 1
            mesh = init_device_mesh(torch.device(device).type, (recipe.fsdp_replicate, world // recipe.fsdp_replicate),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(torch.device(device).type, (world,))
        dtypes = {key: getattr(torch, FSDP_DTYPE_NAMES[value]) if value != "none" else None
                  for key, value in (("param_dtype", recipe.fsdp_param_dtype), ("reduce_dtype", recipe.fsdp_reduce_dtype))}
        mp_policy = MixedPrecisionPolicy(**dtypes)  # output_dtype None, cast_forward_inputs True: the defaults
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=recipe.fsdp_reshard_after_forward, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # reshard_after_forward None: False for the root
        runner = model
    elif recipe.is_zero:
        runner = _deepspeed_engine(model, recipe)
    else:
        raise RecipeError(f"parallel={recipe.parallel!r}")
    if rank > 0:  # every rank draws its own batch; rank 0 draws the single-process one
        from .run import SEED

        torch.manual_seed(SEED + rank)
    return runner


# The Megatron plan (torch's Llama TP example, transformers' LlamaConfig.base_model_tp_plan): the
# projections into the heads and into the MLP's intermediate are split by output features
# (ColwiseParallel: weight Shard(0)), the projections back by input features (RowwiseParallel:
# weight Shard(1), the output all-reduced to Replicate).
TP_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
TP_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


# Qwen3's q_norm / k_norm normalise each head over head_dim, between a colwise projection and the
# attention: on a rank they see only its heads. transformers' own plan marks them
# "replicated_with_grad_allreduce" (a replicated weight whose gradient is summed over the group).
# The same in DTensor terms (_head_shard_norms): the weight is a Replicate DTensor, the input
# ([b, s, heads / tp, head_dim], a local tensor after ColwiseParallel) is declared Shard(2) of the
# global heads, so the norm is the local op on the local heads and the weight's gradient is
# Partial (summed when the optimizer's DTensor ops redistribute it); the output goes back to a
# local tensor for the attention.
TP_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def _head_shard_norms(layer: torch.nn.Module, mesh) -> None:
    from torch.distributed.tensor import distribute_module

    names = dict(layer.named_modules())
    for name in TP_HEAD_NORMS:
        if name in names:
            distribute_module(names[name], mesh, input_fn=_head_sharded_inputs, output_fn=_local_outputs)


def _head_sharded_inputs(module, inputs, mesh):
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _tp_fsdp(model: torch.nn.Module, recipe: Recipe, device: str) -> torch.nn.Module:
    """TP x DP, torch's FSDP + TP recipe: a 2-D mesh (dp, tp), the plan over mesh["tp"], then
    fully_shard over mesh["dp"] on every (tensor-parallelized) decoder layer and the root. The
    ranks of a tensor-parallel group run the same batch; each data-parallel group its own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (recipe.gpus, recipe.tp), mesh_dim_names=("dp", "tp"))
    tensor_parallelize(model, recipe, device, mesh=mesh["tp"])
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=recipe.fsdp_reshard_after_forward)
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = dist.get_rank() // recipe.tp
    if dp_rank > 0:
        from .run import SEED

        torch.manual_seed(SEED + dp_rank)
    return model


def tensor_parallelize(model: torch.nn.Module, recipe: Recipe, device: str, mesh=None) -> None:
    """parallelize_module on every decoder layer with the Megatron plan over a 1-D mesh of tp ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = model.config
    tp = recipe.tp
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": getattr(config, "intermediate_size", None)}
    for key, value in sizes.items():
        if not isinstance(value, int) or value % tp:
            raise RecipeError(f"tp={tp}: {key}={value} is not divisible by the tensor-parallel degree")
    layers = decoder_layers(model)
    for layer in layers:
        names = dict(layer.named_modules())
        missing = [n for n in TP_COLWISE + TP_ROWWISE if not isinstance(names.get(n), torch.nn.Linear)]
        if missing:
            raise RecipeError(f"tp={tp}: {type(layer).__name__} has no separate nn.Linear {', '.join(missing)} "
                              "(the Megatron plan needs q/k/v/o and gate/up/down projections; GPT-2's fused "
                              "c_attn and Phi-3's qkv_proj / gate_up_proj are not split)")
        extra = [n for n, m in layer.named_modules() if n.startswith("self_attn.") and n not in TP_COLWISE + TP_ROWWISE
                 + TP_HEAD_NORMS and any(True for _ in m.parameters(recurse=False))]
        if extra:
            raise RecipeError(f"tp={tp}: {type(layer).__name__} has parameters inside the attention besides the "
                              f"projections ({', '.join(extra)}), which the Megatron plan here does not split")
    if mesh is None:
        mesh = init_device_mesh(torch.device(device).type, (tp,))
    for layer in layers:
        _head_shard_norms(layer, mesh)
    # A pipeline stage other than the last has no lm_head (pipeline.py make_stage prunes it).
    loss_parallel = recipe.loss_parallel and model.get_output_embeddings() is not None
    if loss_parallel:
        _check_loss_parallel(model, tp)
    if recipe.sequence_parallel:
        _sequence_parallelize(model, layers, mesh, loss_parallel)
        return
    plan = {**{n: ColwiseParallel() for n in TP_COLWISE}, **{n: RowwiseParallel() for n in TP_ROWWISE}}
    for layer in layers:
        parallelize_module(layer, mesh, plan)
    if loss_parallel:
        _vocab_parallelize_head(model, mesh, sequence_parallel=False)
    _replicate_the_rest(model, mesh)


# Loss parallelism (torchtitan's Llama plan; torch/distributed/tensor/parallel/loss.py): lm_head is
# ColwiseParallel with output_layouts=Shard(-1), use_local_output=False, so each rank computes and
# keeps only its vocab / tp columns of the logits as a Shard(-1) DTensor; the model's own loss
# (ForCausalLMLoss: .float(), view, cross_entropy) then runs on that DTensor, and inside
# loss_parallel() (training.py run_steps) log_softmax and nll_loss dispatch to torch's
# vocab-parallel versions (all-reduces of the max, the sum-exp and the picked logit). With
# sequence parallelism the head's input is gathered from Shard(1) by the same style.
def _check_loss_parallel(model: torch.nn.Module, tp: int) -> None:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise RecipeError(f"loss_parallel needs an nn.Linear lm_head, got {type(head).__name__}")
    embed = model.get_input_embeddings()
    if embed is not None and head.weight is embed.weight:
        raise RecipeError("loss_parallel with tied embeddings is not measured: ColwiseParallel would shard the "
                          "embedding's weight too (use a model with tie_word_embeddings false)")
    if head.out_features % tp:
        raise RecipeError(f"loss_parallel: vocab_size={head.out_features} is not divisible by tp={tp}")


def _vocab_parallelize_head(model: torch.nn.Module, mesh, *, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model.get_output_embeddings(), mesh, ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Shard(-1),
        use_local_output=False))


def _replicate_the_rest(model: torch.nn.Module, mesh) -> None:
    """The modules the plan leaves alone (embedding, norms, lm_head) become Replicate DTensors.

    A parameter two modules share (tied embeddings: lm_head.weight is embed_tokens.weight) stays
    one parameter: distribute_module on each module alone would wrap the shared tensor twice,
    two Parameters over one storage, each with its own gradient and optimizer state, and the tie
    would drift apart in training. The second module gets the first one's DTensor, which
    distribute_module then keeps (it only replaces parameters that are not DTensors yet)."""
    from torch.distributed.tensor import DTensor, distribute_module

    distributed = {}  # id of a parameter as the model was built -> the DTensor that replaced it
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if not own or any(isinstance(p, DTensor) for p in own.values()):
            continue
        for name, p in own.items():
            if id(p) in distributed:
                setattr(module, name, distributed[id(p)])
        distribute_module(module, mesh, input_fn=_replicated_inputs, output_fn=_local_outputs)
        for name, p in own.items():
            distributed[id(p)] = getattr(module, name)


# Sequence parallelism (torch's Llama TP example, torch/distributed/tensor/parallel/style.py): the
# norms run on the sequence shard (SequenceParallel), the colwise projections all-gather their
# input from Shard(1), the rowwise ones reduce-scatter their output to Shard(1). The residual
# stream between them stays a Shard(1) DTensor (use_local_output=False): transformers' LlamaModel
# takes the positions and the attention masks from inputs_embeds.shape[1], the global length of a
# DTensor (torch's own example model counts the tokens instead and can pass local shards). The
# embedding and lm_head stay replicated: the embedding's output is split to Shard(1)
# (PrepareModuleOutput, a local chunk), lm_head's input all-gathered to Replicate
# (PrepareModuleInput).
def _sequence_parallelize(model: torch.nn.Module, layers, mesh, loss_parallel: bool = False) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            **{n: ColwiseParallel(input_layouts=Shard(1)) for n in TP_COLWISE},
            **{n: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) for n in TP_ROWWISE}}
    for layer in layers:
        missing = [n for n in ("input_layernorm", "post_attention_layernorm") if not hasattr(layer, n)]
        if missing:
            raise RecipeError(f"sequence_parallel: {type(layer).__name__} has no {', '.join(missing)}")
        # Gemma-2's feedforward norms are outside the plan: torch would add their replicated output
        # to the Shard(1) residual ("got mixed torch.Tensor and DTensor").
        extra = [n for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if hasattr(layer, n)]
        if extra:
            raise RecipeError(f"sequence_parallel: {type(layer).__name__}'s {', '.join(extra)} are not in the "
                              "sequence-parallel plan")
        parallelize_module(layer, mesh, plan)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    # A pipeline stage (pipeline.py make_stage) has pruned the embedding, the final norm and
    # lm_head it does not hold (None): only those it keeps are parallelized.
    if base.norm is not None:
        parallelize_module(base.norm, mesh, SequenceParallel())
    if loss_parallel:
        _vocab_parallelize_head(model, mesh, sequence_parallel=True)
    _replicate_the_rest(model, mesh)
    if base.embed_tokens is not None:
        parallelize_module(base.embed_tokens, mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False))
    if not loss_parallel and model.get_output_embeddings() is not None:
        parallelize_module(model.get_output_embeddings(), mesh, PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate()))


def _replicated_inputs(module, inputs, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor)
                 and not isinstance(x, DTensor) else x for x in inputs)


def _local_outputs(module, outputs, mesh):
    from torch.distributed.tensor import DTensor

    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def attach(tracker, runner: torch.nn.Module, recipe: Recipe) -> None:
    """Register what the wrapper made before tracking, and patch what tracking must see;
    undone by tracker.close()."""
    gloo = torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    if recipe.parallel == "ddp":
        # PP x DP: the stage's DDP; several stages per rank: each stage's own, in stage order.
        for stage in (runner if isinstance(runner, list) else [runner]):
            _attach_ddp(tracker, stage.submod if recipe.is_pp else stage, gloo)
    elif recipe.parallel == "fsdp":
        _attach_fsdp(tracker)
    elif recipe.is_zero:
        _attach_zero(tracker, runner)
    if gloo:
        _settle_functional_collectives(tracker)
        if recipe.is_zero:
            _settle_c10d_collectives(tracker)  # See Note [Settled c10d collectives]


# Note [Settled functional collectives]
# The functional collectives (torch.ops._c10d_functional: tensor parallelism's redistributions,
# sequence parallelism's all-gathers and reduce-scatters) register their Work until the
# `wait_tensor` of their output, and gloo's Work holds the collective's input and output, also on
# gloo's worker thread for a moment after the wait. So an input the caller let go of (a norm's
# output, gathered by q, k and v in turn) or an output it dropped (the stacked all-gather buffer
# once `cat` made the gathered sequence of it) was freed wherever the main thread was when the
# worker let go: one run in 30 traced 2,048 B more at the peak (the norm output,
# tests/python/test_measure_parallel.py test_sp_batch_one_saves_the_stacked_gather), 3 in 12 of
# cpu-tp2sp-llamaw512l4-fp32-sgd-b2s64 one rank 393,216 B more (all-gather buffers freed after the
# next projection's matmul). NCCL's Work holds no caching-allocator block past the stream's order.
# So, on gloo, each functional collective waits for its Work at once and then until its inputs'
# storages are back to the reference counts they had before it and its outputs are held by
# nothing but the tensors it returns, and those by nothing but their Python objects (sleeping
# hands the GIL to the worker thread). The tensors' own counts matter where the Work holds a
# returned tensor itself, as all_reduce's clone: its storage's count cannot show that (until
# session 26 only the storages' were read, and now and then an all-reduced activation or
# gradient was freed late, on the worker thread: traces marked `off_thread`). Each tensor is
# then freed where its last Python reference goes, deterministically; the caller's own
# `wait_tensor` finds no Work left and returns. Nothing is allocated by the wait. Checked: twelve
# runs of cpu-tp2sp-llamaw512l4-fp32-sgd-b2s64 traced the same events in the same order on both
# ranks, labels included, and the corpus's 50 TP, SP and PP x TP entries measured again with every
# peak, category and rank as stored.
def _settle_functional_collectives(tracker) -> None:
    use_count = torch._C._storage_Use_Count
    ops = torch.ops._c10d_functional

    def collective(func, args, kwargs):
        inputs = {}
        for t in _iter_tensors((args, kwargs)):
            st = t.untyped_storage()
            inputs.setdefault(st._cdata, st)
        # with `inputs` holding one reference each
        settled = [(st, use_count(cdata)) for cdata, st in inputs.items()]
        out = func(*args, **kwargs)
        outputs, returned = {}, list(_iter_tensors(out))
        for t in returned:
            ops.wait_tensor(t)
            st = t.untyped_storage()
            # each returned tensor's reference, and this storage object's
            outputs[st._cdata] = (st, outputs.get(st._cdata, (st, 1))[1] + 1)
        settled += list(outputs.values())

        def busy():
            # The Work holds an output tensor itself (all_reduce's clone): the storage's count does
            # not show that reference, the tensor's does (1: the Python object alone).
            return any(use_count(st._cdata) > n for st, n in settled) or any(t._use_count() > 1 for t in returned)

        def what():  # only on a timeout: the counts it was still waiting on
            return (f"gloo's Work kept {func} tensors alive (storage counts "
                    f"{[(use_count(st._cdata), n) for st, n in settled]}, returned tensors' {[t._use_count() for t in returned]})")

        _wait_until_settled(busy, 0.0002, what, "Settled functional collectives")
        return out

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce"):
        tracker.op_wrappers[getattr(ops, name)] = collective


# Note [Settled c10d collectives]
# DeepSpeed calls torch.distributed's own collectives: broadcast and all_reduce (synchronous), and
# through its comm backend all_gather_into_tensor (ZeRO-3's gathers, async: the caller waits on
# the Work later) and reduce_scatter_tensor. gloo's Work holds the tensors it was given until the
# Work itself goes, and gloo's worker thread holds the Work for a moment after it completes. So a
# tensor whose last holder let go of it right after the wait (assert_ints_same_as_other_ranks'
# broadcast lists, the gradient norm's all-reduced sum, a gathered flat buffer) was now and then
# freed on the worker thread, wherever the main thread was by then (31 late frees in the 23 ZeRO
# entries re-measured in session 26). A tensor's use count cannot tell the worker's reference to
# the Work from the caller's, so on gloo each of these calls is made async here, its Work waited
# on at once and let go of, and then the call waits until every tensor it was given is held by
# nothing the call added (its TensorImpl's use count as before the call): the Work is gone, and
# each tensor is freed where its caller lets go of it. An async caller gets a completed stand-in
# Work, so its collectives now complete in the order they are issued (DeepSpeed issues them in the
# same order on every rank); a call queued inside a `_coalescing_manager` is left to it. Nothing
# is allocated by the wait; the main thread's allocations keep their order (the traces and every
# entry's peaks are unchanged). gloo's reduce-scatter makes a temporary of its own and frees it on
# the worker thread, so that call also waits until what it made is freed, as FSDP2's does (Note
# [Settled reduce-scatter]). Not settled: the list-based all_gather (DeepSpeed's
# `_allgather_params_coalesced`), all_reduce_coalesced and all_gather_coalesced, which left no
# late free in the 23 re-measured ZeRO entries; a gathered parameter's release still waits for its
# storage as well (Note [Settled release]).
def _settled_collective(fn, temporaries=None):
    """`fn` waited on and settled (Note [Settled c10d collectives]); with `temporaries` (the tracker)
    also until the tensors the call itself made are freed (gloo's reduce-scatter temporary)."""
    from torch._C._distributed_c10d import _create_work_from_future
    from torch.distributed import distributed_c10d

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        async_op = bound.arguments.get("async_op", False)
        given = list(_iter_tensors((args, kwargs)))
        before = [t._use_count() for t in given]
        bound.arguments["async_op"] = True
        first = len(temporaries.records) if temporaries is not None else 0
        work = fn(*bound.args, **bound.kwargs)
        if work is None:
            return None  # a rank outside the group
        if isinstance(work, distributed_c10d._IllegalWork):  # queued inside a _coalescing_manager
            return work if async_op else None
        work.wait()
        del work

        def what():  # only on a timeout
            counts = [(t._use_count(), n) for t, n in zip(given, before)]
            return f"gloo's Work kept {fn.__name__}'s tensors alive (use counts {counts})"

        def busy():
            return (any(t._use_count() > n for t, n in zip(given, before))
                    or (temporaries is not None and _unfreed_since(temporaries, first)))

        _wait_until_settled(busy, 0.0002, what, "Settled c10d collectives")
        if not async_op:
            return None
        done = torch.futures.Future()
        done.set_result(None)
        return _create_work_from_future(done)
    return wrapper


def _settle_c10d_collectives(tracker) -> None:
    from deepspeed.comm import comm

    patches = [(torch.distributed, "broadcast", None), (torch.distributed, "all_reduce", None),
               (comm.cdb, "all_gather_function", None), (comm.cdb, "reduce_scatter_function", tracker)]
    for owner, name, temporaries in patches:
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        setattr(owner, name, _settled_collective(fn, temporaries))
        tracker._restore.append(functools.partial(setattr, owner, name, fn))


# ------------------------------------------------------------------------------------- DeepSpeed


def deepspeed_config(recipe: Recipe) -> dict:
    """The DeepSpeed config of a zero* recipe: the stage, the batch, and bf16 for bf16-master;
    every other setting (buckets, overlap_comm, contiguous_gradients, stage-3 prefetch and
    persistence) at DeepSpeed's own defaults (deepspeed/runtime/zero/config.py)."""
    from .recipe import ZERO_STAGES

    config = {"train_micro_batch_size_per_gpu": recipe.batch, "gradient_accumulation_steps": recipe.grad_accum,
              "train_batch_size": recipe.batch * recipe.grad_accum * recipe.gpus,
              "zero_optimization": {"stage": ZERO_STAGES[recipe.parallel]}, "steps_per_print": 1 << 30}
    if recipe.precision == "bf16-master":
        config["bf16"] = {"enabled": True}
    if recipe.optimizer == "sgd":  # DeepSpeed asks for this with any client optimizer but Adam(W)
        config["zero_allow_untested_optimizer"] = True
    return config


def _deepspeed_engine(model: torch.nn.Module, recipe: Recipe):
    """deepspeed.initialize with the recipe's torch optimizer (built here, before the engine, as a
    client optimizer: DeepSpeed's ZeRO optimizer re-points its param groups at the fp32 master
    partitions). Tensors made while it runs are remembered, as for DDP's construction."""
    try:
        import deepspeed
    except ImportError as e:
        raise RecipeError(f"parallel={recipe.parallel} needs the deepspeed package: {e}") from None
    from .training import make_optimizer

    optimizer = make_optimizer(recipe.optimizer, [p for p in model.parameters() if p.requires_grad])
    capture = _Capture()
    with capture:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(recipe),
                                               dist_init_required=False)
    engine._trainmem_made = capture.made
    return engine


# What a ZeRO optimizer holds after deepspeed.initialize, by attribute, and the category of each:
# the flat 16-bit (or fp32) parameter groups and the fp32 master partitions are weights
# (docs/parallelism.md); stage 3's flat gradient partitions are gradients.
_ZERO_ATTRIBUTES = {
    "bit16_groups_flat": "weights",
    "single_partition_of_fp32_groups": "weights",
    "fp16_partitioned_groups_flat": "weights",
    "fp32_partitioned_groups_flat": "weights",
    "lp_param_buffer": "weights",
    "grad_partitions_flat_buffer": "gradients",
}
# The ZeRO optimizer's methods that run inside and right after the backward to bucket, reduce
# and partition gradients: everything they allocate holds gradient values.
# (The hooks DeepSpeed registers call these by attribute, so patching the instance reaches them.)
_ZERO_GRADIENT_METHODS = ("setup_buckets", "process_gradients", "reduce_ready_partitions_and_remove_grads",
                          "update_hook_state_and_maybe_run_epilogue", "reduce_gradients", "backward_epilogue",
                          "overlapping_partition_gradients_reduce_epilogue", "independent_gradient_partition_epilogue")


def _attach_zero(tracker, engine) -> None:
    zero = engine.optimizer
    known: dict[int, tuple[str, str]] = {}
    for attr, kind in _ZERO_ATTRIBUTES.items():
        for i, t in enumerate(_iter_tensors(getattr(zero, attr, None))):
            known.setdefault(t.untyped_storage()._cdata, (kind, f"deepspeed {attr} {i}"))
    # Stage 3: every parameter's partition (ds_tensor). A trainable one's is a view of
    # lp_param_buffer (above); a frozen one's (a LoRA base) is a storage of its own.
    for i, p in enumerate(engine.module.parameters()):
        ds_tensor = getattr(p, "ds_tensor", None)
        if isinstance(ds_tensor, torch.Tensor):
            known.setdefault(ds_tensor.untyped_storage()._cdata, ("weights", f"deepspeed partition {i}"))
    for bucket in (getattr(zero, "ipg_buckets", None) or {}).values():  # stage 3: made at init
        if isinstance(getattr(bucket, "buffer", None), torch.Tensor):
            known.setdefault(bucket.buffer.untyped_storage()._cdata, ("gradients", "deepspeed ipg bucket"))
    params = {p.untyped_storage()._cdata for p in engine.module.parameters()}
    seen = set()
    for ref in getattr(engine, "_trainmem_made", []):
        t = ref()
        if t is None or t.device.type != torch.device(tracker.device).type:
            continue
        cdata = t.untyped_storage()._cdata
        if cdata in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(cdata)
        if cdata in params:
            continue  # the parameters (views of the flat groups): weights, from attach_model
        kind, name = known.get(cdata, ("other", f"deepspeed init {len(seen)}"))
        tracker.add_existing(t, kind, name)
    del engine._trainmem_made

    def forced(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # The hooks take the parameter whose full .grad they bucket and then drop: a gradient.
            if args and isinstance(args[0], torch.Tensor):
                tracker.mark(args[0].grad, "gradients")
            with tracker.forced("gradients"):
                return fn(*args, **kwargs)
        return wrapper

    for name in _ZERO_GRADIENT_METHODS:
        fn = getattr(zero, name, None)
        if fn is not None:
            setattr(zero, name, forced(fn))
            tracker._restore.append(functools.partial(delattr, zero, name))

    if getattr(zero, "parameter_offload", None) is not None:
        _attach_zero3(tracker, zero)

    # The basic (torch) optimizer steps the fp32 partitions: their .grad (the fp32 gradient
    # partition DeepSpeed made for the step) is gradients, its state optimizer_states.
    basic = zero.optimizer
    original_step = basic.step

    @functools.wraps(original_step)
    def step(*args, **kwargs):
        for group in basic.param_groups:
            tracker.mark_gradients(group["params"])
        out = original_step(*args, **kwargs)
        tracker.mark_optimizer_state(basic)
        return out

    basic.step = step
    tracker._restore.append(functools.partial(delattr, basic, "step"))


def _attach_zero3(tracker, zero) -> None:
    """ZeRO-3's gathered parameters are weights: what the coordinator's fetch (the submodule's
    all-gather, and the prefetch of the next ones) and the step's re-gather of the persistent
    parameters (_post_step) allocate, and each parameter's gathered .data."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.utils import z3_leaf_module

    def mark_weights(params) -> None:
        for p in params:
            if tracker.mark(p.data, "weights"):
                tracker._weight_cdatas.add(tracker._cdata(p.data))

    original_fetch = PartitionedParameterCoordinator.fetch_sub_module

    @functools.wraps(original_fetch)
    def fetch_sub_module(self, current_submodule, forward):
        with tracker.forced("weights"):
            out = original_fetch(self, current_submodule, forward)
        mark_weights(current_submodule.parameters(recurse=z3_leaf_module(current_submodule)))
        return out

    PartitionedParameterCoordinator.fetch_sub_module = fetch_sub_module
    tracker._restore.append(functools.partial(setattr, PartitionedParameterCoordinator, "fetch_sub_module",
                                              original_fetch))

    original_post_step = zero._post_step

    @functools.wraps(original_post_step)
    def post_step(*args, **kwargs):
        with tracker.forced("weights"):
            out = original_post_step(*args, **kwargs)
        mark_weights(zero.persistent_parameters)
        return out

    zero._post_step = post_step
    tracker._restore.append(functools.partial(delattr, zero, "_post_step"))

    # Note [Settled release]: gloo's all-gather Work holds its output (the gathered buffer) until
    # its worker thread lets go of it, so a released parameter's storage is freed wherever the
    # main thread is then: at once, or at the next collective. NCCL's work holds nothing of the
    # caching allocator's past the stream's order. The release waits (at most 50 ms) until only
    # it still holds the storage, so the free lands inside the release, deterministically. Since
    # the gathers are settled (Note [Settled c10d collectives]) it finds that at once; it stays
    # for the gathers that are not.
    from deepspeed.runtime.zero import partition_parameters

    original_free = partition_parameters.free_param

    @functools.wraps(original_free)
    def free_param(param):
        old = param.data.untyped_storage()
        original_free(param)
        deadline = time.monotonic() + 0.05
        while torch._C._storage_Use_Count(old._cdata) > 1 and time.monotonic() < deadline:
            time.sleep(0.0002)
        del old

    partition_parameters.free_param = free_param
    tracker._restore.append(functools.partial(setattr, partition_parameters, "free_param", original_free))


# Note [Settled DDP collectives]
# DDP broadcasts through gloo in two places of every measured step that the Python side can
# reach: `_sync_buffers` before each forward (broadcast_buffers, DDP's default) flattens the
# module's buffers (Llama's rotary inv_freq) into a temporary for `dist._broadcast_coalesced`, and
# the Reducer's one `_rebuild_buckets` (step 2's forward) first broadcasts the bucket assignment
# as int32 tensors (sync_bucket_indices, C++). gloo's Work holds those tensors, and its worker
# thread may hold the Work for a moment after the wait, so now and then one was freed on the
# worker thread inside layer 0's forward: a 512 B late free on one rank in 2 of 6 runs of a
# 2-rank Llama (session 29, `off_thread` in the traces; the float [64] inv_freq copy, the int32
# [4] bucket sizes). So, on gloo, the broadcast waits until everything it made is freed, and the
# rebuild until the integer tensors it made are (its new buckets stay); as the other settles,
# sleeping hands the GIL to the worker thread. The engine frees both inside their calls. The
# broadcast's late free went (none in 6 runs after); the rebuild's is made inside C++ before
# the new buckets, and the wait can only keep it inside the call: 2 of 6 runs still freed it on
# the worker thread, after some of the buckets, 512 B that no phase peak saw.
class _ReducerProxy:
    """DDP's Reducer with `_rebuild_buckets` run under `forced("gradients")`: the new buckets;
    on gloo settled (Note [Settled DDP collectives])."""

    def __init__(self, reducer, tracker, settle: bool):
        object.__setattr__(self, "_reducer", reducer)
        object.__setattr__(self, "_tracker", tracker)
        object.__setattr__(self, "_settle", settle)

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def __setattr__(self, name, value):
        setattr(self._reducer, name, value)

    def _rebuild_buckets(self):
        first = len(self._tracker.records)
        with self._tracker.forced("gradients"):
            out = self._reducer._rebuild_buckets()
        if self._settle:
            _wait_until_settled(lambda: _unfreed_since(self._tracker, first, integers_only=True), 0.0002,
                                "gloo kept DDP's bucket assignment broadcast alive", "Settled DDP collectives")
        return out


def _attach_ddp(tracker, ddp, gloo: bool) -> None:
    params = {p.untyped_storage()._cdata for p in ddp.parameters()}
    seen = set()
    n = 0
    for ref in getattr(ddp, "_trainmem_made", []):
        t = ref()
        if t is None:
            continue
        cdata = t.untyped_storage()._cdata
        if cdata in seen or cdata in params or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(cdata)
        # Alive after construction: the buckets' flat gradient buffers (and the Reducer's small
        # bookkeeping tensors, e.g. the int32 map of locally used parameters).
        kind = "gradients" if t.is_floating_point() else "other"
        tracker.add_existing(t, kind, f"ddp reducer {kind} {n}")
        n += 1
    del ddp._trainmem_made
    reducer = ddp.reducer
    ddp.reducer = _ReducerProxy(reducer, tracker, gloo)
    tracker._restore.append(functools.partial(setattr, ddp, "reducer", reducer))
    if gloo:  # See Note [Settled DDP collectives]
        ddp._distributed_broadcast_coalesced = _settled_call(tracker, ddp._distributed_broadcast_coalesced, 0.0002,
                                                             "gloo kept DDP's coalesced broadcast alive",
                                                             "Settled DDP collectives")
        tracker._restore.append(functools.partial(delattr, ddp, "_distributed_broadcast_coalesced"))


# Note [Settled reduce-scatter]
# gloo's reduce_scatter_tensor (ProcessGroupGloo, C++) reduces through a temporary of the input's
# size that, as far as the traces tell (the C++ was not read), its Work object owns. The Work runs on gloo's worker thread, which carries the
# caller's thread-local state (so the tracker's dispatch mode sees the temporary's ops there, at
# a `split`), and `dist.reduce_scatter_single(..., async_op=False)` returns once the Work's future
# completes, while the worker thread may still hold the Work. The temporary dies with the last
# reference, and its free (the storage's Python object, so it needs the GIL) lands wherever the
# main thread happens to be: at once, or only after the next unit's all-gather copy-out (traced:
# docs/parallelism.md, "TP x DP"). NCCL makes no such tensor: on CUDA the collective's memory
# is NCCL's own and is gone when the reduce-scatter ends, and FSDP2 (_fsdp_collectives.py
# foreach_reduce) keeps only its own input and output. So the
# measuring side waits, after FSDP2's reduce-scatter returns, until every storage made inside
# the call is freed (sleeping hands the GIL to the worker thread), which makes the run
# deterministic with the temporary living inside the collective only. Done for every FSDP2 run
# (1-D, HSDP and TP x DP meshes; the measuring side runs on gloo only), and the engine frees the
# temporary inside the collective too (Note [gloo's reduce-scatter temporary] in
# src/graph/parallel.cpp).
_SETTLE_TIMEOUT_S = 60.0


def _wait_until_settled(busy, interval_s: float, what, note: str) -> None:
    """Sleep `interval_s` at a time (releasing the GIL, so gloo's worker thread can drop its Work)
    while `busy()`; an error after _SETTLE_TIMEOUT_S, saying `what` (a string, or a function that
    describes the state then)."""
    deadline = time.monotonic() + _SETTLE_TIMEOUT_S
    while busy():
        if time.monotonic() > deadline:
            text = what() if callable(what) else what
            raise RuntimeError(f"{text} for {_SETTLE_TIMEOUT_S:.0f} s (Note [{note}])")
        time.sleep(interval_s)


def _unfreed_since(tracker, first: int, integers_only: bool = False) -> bool:
    """Whether a tensor the tracker recorded from record `first` on (of an integer dtype, with
    `integers_only`) is still alive."""
    return any(rec.free_index is None and (not integers_only or "int" in str(rec.dtype))
               for rec in tracker.records[first:])


def _settled_call(tracker, fn, interval_s: float, what: str, note: str):
    """`fn` that returns only once every tensor it made is freed (waited on first, if it hands back
    a Work): gloo's reduce-scatter temporary (Note [Settled reduce-scatter]), DDP's coalesced
    broadcast (Note [Settled DDP collectives])."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = len(tracker.records)
        out = fn(*args, **kwargs)
        if isinstance(out, torch.distributed.Work):
            out.wait()  # an async caller; FSDP2 calls it synchronously
        _wait_until_settled(lambda: _unfreed_since(tracker, first), interval_s, what, note)
        return out
    return wrapper


def _attach_fsdp(tracker) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    def resized(fn, name):
        @functools.wraps(fn)
        def wrapper(tensor):
            fn(tensor)
            tracker.storage_resized(tensor, "weights", name)
            tracker._weight_cdatas.add(tracker._cdata(tensor))
        return wrapper

    def forced(fn, flag):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with tracker.forced(flag):
                return fn(*args, **kwargs)
        return wrapper

    def copy_out(fn):
        @functools.wraps(fn)
        def wrapper(all_gather_result, fsdp_params, *args, **kwargs):
            with tracker.forced("weights"):
                out = fn(all_gather_result, fsdp_params, *args, **kwargs)
            for fsdp_param in fsdp_params:  # the unsharded parameters: weights, and cast by autocast
                for t in fsdp_param.all_gather_outputs:
                    tracker.mark(t, "weights")
                    tracker._weight_cdatas.add(tracker._cdata(t))
            return out
        return wrapper

    group_cls = _fsdp_param_group.FSDPParamGroup
    original_post_backward = group_cls.post_backward

    @functools.wraps(original_post_backward)
    def post_backward(self, *args, **kwargs):
        for fsdp_param in self.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                tracker.mark(unsharded.grad, "gradients")
            tracker.mark(getattr(fsdp_param, "unsharded_accumulated_grad", None), "gradients")
        return original_post_backward(self, *args, **kwargs)

    patches = [
        (_fsdp_param, "alloc_storage", resized(_fsdp_param.alloc_storage, "fsdp unsharded parameter")),
        (_fsdp_param, "free_storage", resized(_fsdp_param.free_storage, "fsdp unsharded parameter")),
        (_fsdp_param_group, "alloc_storage", resized(_fsdp_param_group.alloc_storage, "fsdp unsharded parameter")),
        (_fsdp_param_group, "foreach_all_gather", forced(_fsdp_param_group.foreach_all_gather, "weights")),
        (_fsdp_param_group, "foreach_all_gather_copy_out", copy_out(_fsdp_param_group.foreach_all_gather_copy_out)),
        (_fsdp_param_group, "foreach_reduce", forced(_fsdp_param_group.foreach_reduce, "gradients")),
        (group_cls, "post_backward", post_backward),
    ]
    comm = _fsdp_collectives.DefaultReduceScatter  # See Note [Settled reduce-scatter]
    patches.append((comm, "__call__", _settled_call(tracker, comm.__dict__["__call__"], 0.001,
                                                    "gloo's reduce-scatter kept a temporary alive",
                                                    "Settled reduce-scatter")))
    for owner, name, new in patches:
        old = owner.__dict__[name]
        setattr(owner, name, new)
        tracker._restore.append(functools.partial(setattr, owner, name, old))


__all__ = ["launch", "in_worker", "wrap_model", "attach", "decoder_layers"]
