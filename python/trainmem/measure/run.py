"""One measurement: build the model, run the reference steps under the tracker, assemble the JSON."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import time

import torch

from .models import (ModelError, ModelSpec, build_fake_model, build_real_model, enable_checkpointing,
                     lora_targets_of, quant_state_tensors, resolve_model, resolved_for_model)
from .recipe import FLAGS_WHEN_ON, Recipe, RecipeError
from .tracker import CATEGORIES, MemoryTracker
from .generation import run_generation
from . import parallel as _parallel
from .training import convert_outputs_as_accelerate, hf_loss_fn, run_steps, training_batch

SEED = 0


class DeviceError(ValueError):
    """The requested device cannot be used here (exit code 2)."""


def versions(recipe: Recipe | None = None) -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version()}
    if recipe is not None and recipe.uses_lora:
        try:
            import peft

            out["peft"] = peft.__version__
        except ImportError:
            pass
    if recipe is not None and (recipe.optimizer == "adamw-8bit" or recipe.is_quantized):
        try:
            import bitsandbytes

            out["bitsandbytes"] = bitsandbytes.__version__
        except ImportError:
            pass
    return out


def quiet_libraries() -> None:
    """Keep transformers' advice (deprecations, loss_type, use_cache) off the CLI's stderr."""
    import warnings

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    # MatMul8bitLt logs "inputs will be cast from bfloat16 to float16" on every 8-bit matmul.
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # Fake-tensor mode logs the whole traceback of an op without a meta kernel before raising it;
    # the CLI reports the error in one line.
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


def expandable_segments_enabled() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def check_device(device: str, fake: bool, recipe: Recipe) -> None:
    if device not in ("cpu", "cuda"):
        raise DeviceError(f"device {device!r} is not one of cpu, cuda")
    if device == "cuda":
        if fake and not torch.backends.cuda.is_built():
            raise DeviceError(
                "--fake --device cuda needs a CUDA build of PyTorch: on this CPU-only build autograd "
                "aborts the process on fake CUDA tensors; use --fake --device cpu")
        if not fake and not torch.cuda.is_available():
            raise DeviceError("--device cuda: no CUDA device is available here; use --device cpu or --fake")
    if fake and recipe.is_quantized:
        raise RecipeError(f"{'load_in_8bit' if recipe.load_in_8bit else 'load_in_4bit'} cannot run on fake tensors: bitsandbytes quantizes real weights as they "
                          "are loaded; measure a reduced-depth model for real on the CPU")
    if fake and recipe.is_inference:
        raise RecipeError("mode=inference cannot run on fake tensors: generate() decides with data-dependent "
                          "tests (is the attention mask all ones? is every sequence finished? beam search's "
                          "early stop) that fake tensors cannot answer; measure a reduced-depth model for real "
                          "on the CPU (its cache and logits scale linearly with the layers)")
    if recipe.attention == "flash" and (device != "cuda" or fake):
        raise RecipeError("attention=flash (flash_attention_2) runs on a real CUDA device only; "
                          "use --attention sdpa or eager here")


def _cuda_device_name() -> str:
    name = torch.cuda.get_device_name()
    return name.lower().replace("nvidia", "").strip().replace(" ", "-")


def _import_step_modules(recipe: Recipe) -> None:
    """Imports what the step will import, before tracking starts. Some packages make tensors at
    import time (peft's LoHa default arguments, bitsandbytes' NF4 table: CPU tensors); imported
    during a tracked CPU step they would be counted, and only by the first run in a process."""
    if recipe.is_inference:
        return
    if recipe.optimizer == "adafactor":
        import transformers.optimization  # noqa: F401
    if recipe.optimizer == "adamw-8bit" or recipe.is_quantized:
        with contextlib.suppress(ImportError):
            import bitsandbytes  # noqa: F401


def measure(model: str | ModelSpec, recipe: Recipe, *, device: str = "cpu", fake: bool = False,
            trace: str | None = None, command: str | None = None, steps: int = 2) -> dict:
    """Measure `steps` optimizer steps of the reference loop, or with mode inference one generate()
    call (generation.py); returns the schema's JSON dict."""
    spec = resolve_model(model) if isinstance(model, str) else model
    check_device(device, fake, recipe)
    recipe = resolved_for_model(spec, recipe)
    if recipe.is_parallel and not _parallel.in_worker():  # one process per rank, each back here
        return _parallel.launch(model, recipe, device=device, fake=fake, trace=trace, command=command, steps=steps)
    started = time.perf_counter()
    torch.manual_seed(SEED)
    is_cuda = device == "cuda" and not fake
    cuda_info: dict = {}
    if is_cuda:
        _cuda_clean()
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
        model_obj = build_fake_model(spec, recipe, fake_mode, device)
    else:
        model_obj = build_real_model(spec, recipe, device)
    if recipe.checkpointing != "none":
        enable_checkpointing(model_obj, reentrant=recipe.checkpointing == "full-reentrant")
    if recipe.fp32_outputs:  # before DDP wraps it, as in Accelerate's prepare_model
        convert_outputs_as_accelerate(model_obj)
    # What the step calls: the model, or its DDP / FSDP2 wrapping in a rank (parallel.py).
    runner = _parallel.wrap_model(model_obj, recipe, device) if recipe.is_parallel else model_obj
    if recipe.is_inference:
        model_obj.eval()
    built = time.perf_counter()

    _import_step_modules(recipe)
    tracker = MemoryTracker(device, fake=fake, cuda_probe=is_cuda, detect_untracked=is_cuda and expandable_segments_enabled())
    tracker.attach_model(model_obj)
    for name, t in quant_state_tensors(model_obj):  # 4-bit weights' constants, 8-bit SCB: weights too
        tracker.add_weight(t, name)
    if recipe.is_parallel:
        _parallel.attach(tracker, runner, recipe)
    forward_and_loss = None if recipe.is_inference or recipe.is_pp else hf_loss_fn(runner, recipe, tracker)
    embedding = model_obj.get_input_embeddings()  # a later pipeline stage has none (pipeline.py)
    embedding = embedding.weight if embedding is not None else None
    vocab = getattr(embedding, "ds_shape", embedding.shape)[0] if embedding is not None else None  # ZeRO-3: placeholder

    def make_prompt():
        input_ids = torch.randint(vocab, (recipe.batch, recipe.seq), device=device)
        return input_ids, torch.ones(recipe.batch, recipe.seq, dtype=torch.int64, device=device)

    def make_batch():
        return training_batch(recipe, vocab, device)

    step_hooks = {}
    if is_cuda:
        cuda_info = {"steps": []}
        torch.cuda.synchronize()
        cuda_info["memory_allocated_before_steps"] = torch.cuda.memory_allocated()

        def on_step_start(step):
            if step > 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(step):
            torch.cuda.synchronize()
            cuda_info["steps"].append({"step": step,
                                       "max_memory_allocated": torch.cuda.max_memory_allocated(),
                                       "max_memory_reserved": torch.cuda.max_memory_reserved()})

        step_hooks = {"on_step_start": on_step_start, "on_step_end": on_step_end}

    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_hf_patches())
            stack.enter_context(fake_mode)
        stack.enter_context(tracker)
        if recipe.is_quantized and not fake:
            stack.enter_context(bnb_composites_visible(device))
        if recipe.is_inference:
            if step_hooks:
                step_hooks["on_step_start"](1)
            generation_info = run_generation(model_obj, recipe, tracker, device=device, make_inputs=make_prompt,
                                             fake_mode=fake_mode)
            if step_hooks:
                step_hooks["on_step_end"](1)
        elif recipe.is_pp:  # runner is this rank's PipelineStage (pipeline.py)
            generation_info = None
            from .pipeline import run_steps as run_pipeline_steps
            from .training import make_optimizer

            run_pipeline_steps(model_obj, runner, recipe, tracker, device=device, steps=steps,
                               make_optimizer=make_optimizer)
        else:
            generation_info = None
            run_steps(runner, recipe, tracker, device=device, make_batch=make_batch,
                      forward_and_loss=forward_and_loss, steps=steps, fake_mode=fake_mode,
                      engine=runner if recipe.is_zero else None, **step_hooks)
    tracker.close()
    finished = time.perf_counter()
    if is_cuda:
        cuda_info.update(_cuda_context())
    analysis = tracker.analyze()
    result = _result(spec, recipe, model_obj, tracker, analysis, device=device, fake=fake,
                     cuda_info=cuda_info, command=command)
    result["diagnostics"]["build_seconds"] = round(built - started, 3)
    result["diagnostics"]["steps_seconds"] = round(finished - built, 3)
    if generation_info is not None:
        result["diagnostics"]["generation"] = generation_info
    if trace:
        with open(trace, "w") as f:
            for row in tracker.trace_rows():
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
    del model_obj
    return result


# The bitsandbytes ops whose CPU kernel is the Python "default" one (backends/default/ops.py) and
# that allocate inside: 4-bit matmul, and the LLM.int8 ops an 8-bit matmul calls
# (MatMul8bitLt, autograd/_functions.py). dequantize_4bit / dequantize_blockwise have C kernels on
# the CPU (backends/cpu/ops.py) that allocate their output only, and int8_linear_matmul has one
# (torch._int_mm) only on AVX-512 CPUs; they stay single ops.
BNB_COMPOSITE_OPS = ("gemm_4bit", "int8_vectorwise_quant", "int8_mixed_scaled_mm", "int8_scaled_mm",
                     "int8_linear_matmul", "int8_mm_dequant", "int8_vectorwise_dequant")


def _bnb_default_kernels(names) -> dict:
    """op name -> the Python function bitsandbytes registered as its "default" kernel.

    Most are module-level functions named `_` (the last overwrites the module's name), so they are
    found among live functions of backends/default/ops.py and _ops.py by the op their decorator
    names."""
    import gc
    import inspect
    import types

    from bitsandbytes.backends.default import ops as default_ops

    found = {"gemm_4bit": default_ops._gemm_4bit_default_impl}
    wanted = {f'"bitsandbytes::{name}", "default"': name for name in names if name not in found}
    modules = (default_ops.__name__, "bitsandbytes._ops")
    for obj in gc.get_objects():
        if not (type(obj) is types.FunctionType and obj.__name__ == "_" and obj.__module__ in modules):
            continue
        try:
            head = inspect.getsourcelines(obj)[0][0]
        except (OSError, TypeError):
            continue
        for key, name in wanted.items():
            if key in head:
                found[name] = obj
    return {name: found[name] for name in names if name in found}


@contextlib.contextmanager
def bnb_composites_visible(device: str = "cpu"):
    """Let the tracker see inside bitsandbytes' composite ops.

    MatMul4Bit and matmul_4bit's no-grad path (bitsandbytes/autograd/_functions.py) call
    `torch.ops.bitsandbytes.gemm_4bit`, a custom op. On the CPU its kernel is the Python "default"
    one (backends/default/ops.py, `_gemm_4bit_default_impl`): with double quant
    `dequantize_blockwise` of the 8-bit absmax plus the offset, then `dequantize_4bit` of the whole
    weight to the input's dtype, then `F.linear`. Likewise MatMul8bitLt calls
    int8_vectorwise_quant, int8_mixed_scaled_mm, int8_scaled_mm, int8_linear_matmul and
    int8_mm_dequant, whose CPU kernels are Python functions too. A dispatch mode sees a custom op
    as one op, so what is really allocated and freed inside it (the dequantized weight, fp32
    copies of the int8 operands, the int32 product) would never reach the tracker. For the steps
    each op is replaced by its own default Python function: the same ops run, each now dispatched
    on its own. Only ops that have no CPU kernel of their own are replaced (on an AVX-512 CPU
    int8_linear_matmul has one), and only on the CPU: on CUDA every one of them has a CUDA kernel
    (gemm_4bit dequantizes for more than 1536 rows of input and below that may run a fused kernel
    that dequantizes nothing), which the CUDA probe measures as it is.
    """
    if device != "cpu":
        yield
        return
    try:
        names = [name for name in BNB_COMPOSITE_OPS
                 if not torch._C._dispatch_has_kernel_for_dispatch_key(f"bitsandbytes::{name}", "CPU")]
        kernels = _bnb_default_kernels(names)
    except ImportError:
        yield
        return
    namespace = torch.ops.bitsandbytes
    originals = {}
    for name, fn in kernels.items():
        class _Visible:
            default = staticmethod(fn)
            __call__ = staticmethod(fn)

        originals[name] = getattr(namespace, name)
        visible = _Visible()
        setattr(namespace, name, visible)
    try:
        yield
    finally:
        for name, op in originals.items():
            setattr(namespace, name, op)


@contextlib.contextmanager
def fake_hf_patches():
    """Make Hugging Face take the same path under fake tensors as with real ones.

    transformers checks whether the position ids describe packed sequences (several sequences
    in one row) with a data-dependent `.all()`, which it skips when it sees a fake tensor, and
    then treats the batch as packed: the mask and the attention path would differ from a real
    run. Our batches are never packed (position ids are 0..s-1 in every row), so the check is
    replaced by one that makes the same tensors as the real check and returns its real answer,
    None.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def one_sequence_per_row(position_ids):
        starts = position_ids[:, :1] - 1
        steps = torch.diff(position_ids, prepend=starts, dim=-1)
        sequence_index = (steps != 1).cumsum(-1)
        (sequence_index[:, -1] == 0).all()
        return None

    masking_utils.find_packed_sequence_indices = one_sequence_per_row
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _cuda_clean() -> None:
    import gc

    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _cuda_context() -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {"device_name": torch.cuda.get_device_name(), "total_memory": total,
            "memory_reserved_at_end": reserved, "memory_allocated_at_end": torch.cuda.memory_allocated(),
            "context_bytes": (total - free) - reserved,
            "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")),
            "expandable_segments": expandable_segments_enabled()}


def _result(spec: ModelSpec, recipe: Recipe, model, tracker: MemoryTracker, analysis: dict, *, device: str,
            fake: bool, cuda_info: dict, command: str | None) -> dict:
    params = list({id(p): p for p in model.parameters()}.values())
    # ZeRO-3 leaves a partitioned parameter an empty placeholder; ds_numel is its real size.
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
    is_cuda = device == "cuda" and not fake
    recipe_dict = recipe.as_dict(lora_targets_of(model))
    if is_cuda:
        source = "measured-cuda"
        steps = []
        for entry, raw in zip(analysis["steps"], cuda_info.get("steps", [])):
            steps.append({**entry, "peak_reserved_bytes": raw["max_memory_reserved"]})
        peak_reserved = max((s["max_memory_reserved"] for s in cuda_info.get("steps", [])), default=None)
        device_info = {"name": cuda_info.get("device_name", "cuda"), "capacity_bytes": cuda_info.get("total_memory"),
                       "context_bytes": cuda_info.get("context_bytes")}
        torch_figures = {
            "max_memory_allocated": max((s["max_memory_allocated"] for s in cuda_info.get("steps", [])), default=None),
            "max_memory_reserved": peak_reserved,
            "context_bytes": cuda_info.get("context_bytes"),
            **{k: v for k, v in cuda_info.items() if k not in ("context_bytes",)},
        }
    else:
        source = "measured-fake" if fake else "measured-cpu"
        steps = [{**entry, "peak_reserved_bytes": None} for entry in analysis["steps"]]
        peak_reserved = None
        device_info = {"name": f"fake-{device}" if fake else "cpu",
                       "capacity_bytes": None if fake else _physical_memory(), "context_bytes": 0}
        torch_figures = None
    breakdown = {c: analysis["breakdown_at_peak"].get(c, 0) for c in CATEGORIES}
    out = {
        "model": spec.name,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "peak_allocated_bytes": analysis["peak_allocated_bytes"],
        "peak_reserved_bytes": peak_reserved,
        "breakdown_at_peak": breakdown,
        "peak": analysis["peak"],
        "steps": steps,
        "phases": analysis["phases"],
        "device": device_info,
        "recipe": recipe_dict,
        "source": source,
        "versions": versions(recipe),
        "command": command or default_command(spec, recipe, device=device, fake=fake),
    }
    if torch_figures is not None:
        out["torch"] = torch_figures
    stats = tracker.stats
    out["diagnostics"] = {
        "storages": len(tracker.records),
        "events": len(tracker.events),
        "ops": stats["ops"],
        "autocast_weight_casts": stats["weight_casts"],
        "untracked_inputs": stats["untracked_inputs"],
        "freed_by_gc_bytes": stats["freed_by_gc_bytes"],
        "attention_kernels": {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("kernel:")},
        "peak_requested_bytes": analysis["peak_requested_bytes"],
        "allocated_bytes_by_category": analysis["allocated_bytes_by_category"],
        "requested_bytes_by_category": analysis["requested_bytes_by_category"],
        "live_bytes_at_end": analysis["live_bytes_at_end"],
    }
    for key in ("untracked_allocated_bytes", "op_internal_transients", "recomputation_hook_not_patched",
                "freed_off_thread_bytes"):
        if stats.get(key):
            out["diagnostics"][key] = stats[key]
    return out


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_command(spec: ModelSpec, recipe: Recipe, *, device: str, fake: bool) -> str:
    args = ["trainmem-measure", spec.name]
    defaults = Recipe(mode=recipe.mode)
    if recipe.is_inference:
        args.append("--inference")
    # The precision always: the CLI's default depends on the other knobs (a 4-bit base's is bf16-true).
    args += ["--precision", recipe.precision]
    for key, flag in (("batch", "--batch"), ("seq", "--seq"), ("grad_accum", "--grad-accum"),
                      ("new_tokens", "--new-tokens"), ("beams", "--beams"), ("optimizer", "--optimizer"),
                      ("checkpointing", "--checkpointing"), ("attention", "--attention"), ("loss", "--loss"),
                      ("attention_mask", "--attention-mask"),
                      ("allocator", "--allocator"), ("gpus", "--gpus"), ("parallel", "--parallel"),
                      ("tp", "--tp"), ("pp", "--pp"), ("pp_schedule", "--pp-schedule"),
                      ("pp_stages_per_rank", "--pp-stages-per-rank")):
        value = getattr(recipe, key)
        if value != getattr(defaults, key):
            args += [flag, str(value)]
    if recipe.sequence_parallel:
        args.append("--sequence-parallel")
    if recipe.loss_parallel:
        args.append("--loss-parallel")
    if not recipe.fsdp_reshard_after_forward:
        args += ["--fsdp-reshard-after-forward", "false"]
    args += ["--" + knob.replace("_", "-") for knob in FLAGS_WHEN_ON if getattr(recipe, knob)]
    for key, flag in (("fsdp_replicate", "--fsdp-replicate"), ("fsdp_param_dtype", "--fsdp-param-dtype"),
                      ("fsdp_reduce_dtype", "--fsdp-reduce-dtype")):
        if getattr(recipe, key) != getattr(defaults, key):
            args += [flag, str(getattr(recipe, key))]
    if recipe.uses_lora:
        args += ["--lora", str(recipe.lora_rank)]
        if recipe.lora_targets != defaults.lora_targets:
            args += ["--lora-targets", recipe.lora_targets]
        if recipe.lora_dropout != defaults.lora_dropout:
            args += ["--lora-dropout", repr(float(recipe.lora_dropout))]
    if recipe.load_in_8bit:
        args.append("--load-in-8bit")
    if recipe.load_in_4bit:
        if recipe.bnb_4bit_quant_type == "nf4" and recipe.bnb_4bit_use_double_quant:
            args.append("--qlora")
        else:
            args += ["--load-in-4bit", "--bnb-4bit-quant-type", recipe.bnb_4bit_quant_type]
            if recipe.bnb_4bit_use_double_quant:
                args.append("--bnb-4bit-use-double-quant")
        if recipe.bnb_4bit_quant_storage != "uint8":
            args += ["--bnb-4bit-quant-storage", recipe.bnb_4bit_quant_storage]
    if recipe.load_dtype != "auto":  # a half-loaded model (4-bit base, LoRA or whole)
        args += ["--load-dtype", recipe.load_dtype]
    if not recipe.prepare_kbit_training:
        args.append("--no-prepare-kbit-training")
    if fake:
        args.append("--fake")
    if device != "cpu":
        args += ["--device", device]
    args.append("--json")
    return shlex.join(args)


__all__ = ["measure", "DeviceError", "ModelError", "RecipeError", "versions"]
