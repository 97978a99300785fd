"""The reference training step, driven under the tracker.

Both trainmem sides model this loop (the engine predicts it, this package measures it):

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=..., dtype=...)
    input_ids = randint(vocab, (batch, seq)); labels = input_ids.clone()   # [attention_mask: ones, padded]
    for step in 1, 2:
        for micro in range(grad_accum):
            with autocast (only *-mixed):
                loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss  # output dropped at once
            (loss / grad_accum).backward()                 # fp16-mixed: scaler.scale(loss / grad_accum)
        [bf16-master: master.grad = p.grad.float(); p.grad = None, parameter by parameter]
        [fp16-mixed: scaler.unscale_(optimizer)]
        optimizer.step()                                   # fp16-mixed: scaler.step(optimizer); scaler.update()
        [bf16-master: p.copy_(master) for every parameter]
        optimizer.zero_grad(set_to_none=True)

Choices made here (the engine mirrors them):

* Precision: `fp32` (everything fp32); `bf16-mixed` / `fp16-mixed` (fp32 model, `torch.autocast`
  around the forward and the loss only; fp16 adds `torch.amp.GradScaler`); `bf16-master` (bf16
  model; the optimizer holds an fp32 master copy of every parameter, created before step 1,
  category weights; grads are converted to fp32 before the step); `bf16-true` / `fp16-true`
  (model, grads and optimizer states all half, no scaler).
* The GradScaler always takes the optimizer step. A real one skips the step when it finds
  inf/NaN gradients, which a fresh fp16 run does on its first steps; a skipped step would not
  create the optimizer states, and that is not the step we want to measure.
* Optimizers, one param group with every parameter, lr 1e-3:
  `adamw` = torch.optim.AdamW(foreach=True) (forced: foreach is the CUDA default, not the CPU
  one); `adamw-fused` = AdamW(fused=True) (torch 2.13 has a CPU fused kernel, so this runs on
  CPU too); `adamw-8bit` = bitsandbytes.optim.AdamW8bit (runs on CPU with bitsandbytes ≥ 0.45's
  CPU backend; its CPU kernel works in fp32 copies that the tracker does not see, because they
  are made inside one custom op: the CUDA kernel makes none either); `sgd` = SGD(momentum=0.9,
  foreach=True); `adafactor` = transformers' Adafactor(scale_parameter=False,
  relative_step=False, lr=1e-3): factored, no first moment.
* Checkpointing `full` = Hugging Face activation checkpointing with `use_reentrant=False`:
  it is what transformers 5 uses when no kwargs are given and what PyTorch recommends, it needs
  no input that requires grad, and the recompute stops early once the last saved tensor is
  rebuilt. The checkpoint keeps each decoder layer's positional input (the hidden states),
  saved through the saved-tensor hooks, so those count as activations. `full-reentrant` is the
  same with `use_reentrant=True` (torch's default for checkpoint kwargs that do not name it):
  the forward under no_grad, the whole layer recomputed when its backward starts.
* `use_cache=False` in every training forward unless the recipe's `use_cache` says True (what a
  Trainer run without checkpointing keeps from the config): then each layer's keys and values are
  copied into a DynamicCache the output object holds to the loss (the engine's Note [A cache in
  training]).
* Loss `standard` = the model's own loss (ForCausalLMLoss: logits.float(), labels padded and
  shifted, cross-entropy). `fused` = `fused_loss.fused_linear_cross_entropy` on the base
  model's last hidden state (base-model output dropped at once): see Note [Fused loss
  allocations] there.
* LoRA (`lora_rank` > 0; `models.apply_lora`): the model built as above is wrapped with
  `peft.get_peft_model(model, LoraConfig(r, lora_alpha=2r, lora_dropout, target_modules, bias="none"))`
  (`fan_in_fan_out=True` for GPT-2's Conv1D), peft's defaults otherwise; then checkpointing is
  enabled on the PeftModel, as the HF Trainer does with a model it is handed. So:

      model = AutoModelForCausalLM.from_config(...)            # as above
      model = get_peft_model(model, LoraConfig(...))           # base frozen, adapters trainable
      [checkpointing full: model.activation_checkpointing_enable({"use_reentrant": False})]
      ...the same loop; the optimizer gets the adapters only (requires_grad)

  What this means for memory (seen in the traces, peft 0.21, transformers 5.24, torch 2.13):
  * Adapters: lora_A (r x in) and lora_B (out x r) per targeted linear of every decoder layer,
    always fp32: peft makes them fp32 in the default dtype, casts them to the base layer's dtype
    and, with autocast_adapter_dtype=True, back to fp32 when that was bf16/fp16. They are made
    after the whole model (so they come after every base parameter), before tracking starts:
    at setup all are `weights`. Gradients and optimizer states exist for the adapters only.
  * A wrapped linear computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`, then casts the
    sum to the base output's dtype. x is first cast to the adapter dtype when it differs
    (bf16-true: an fp32 copy of x, the adapter path and the sum are fp32, then cast back to
    bf16). Saved for backward: the input of lora_A (x, or the dropout output, in the dtype the
    mm runs in: under autocast a bf16 cast of it, made separately from the base layer's own
    cast of x) and the output of lora_A (b·s·r); with dropout also its mask (on the CPU an
    x-sized tensor in x's dtype: the non-fused dropout; CUDA's fused dropout saves a bool mask).
    With lora_dropout 0 the dropout is nn.Identity: nothing. The base linear saves nothing for
    its frozen weight: not its input; under autocast it saves its own bf16 weight cast when x
    requires grad (for the input's gradient).
  * Under autocast the frozen base weights are not cached (autocast caches casts of leaves that
    require grad only): every use casts again (category weights, see tracker's Note
    [Categories]); the cast is freed at once where the input does not require grad, else kept
    until that layer's backward. The adapters' casts are cached as before.
  * The embedding output does not require grad without checkpointing: nothing before the first
    adapter of layer 0 saves anything for backward, and the backward stops there. With
    checkpointing, transformers' activation_checkpointing_enable always calls
    enable_input_require_grads (for every model whose main input is input_ids, whatever
    use_reentrant is; peft would call it too had checkpointing been enabled before wrapping):
    the embedding output is made a leaf that requires grad, so it is kept until the end of the
    backward and the backward runs through layer 0 down to it (its gradient is freed with the
    graph).
  * `loss=fused` with a frozen lm_head computes no lm_head gradient (Liger neither).
* Phases: `setup` (step 0: inputs, master copies), `forward` (model call up to the loss
  function), `loss` (the loss function, dropping the output, the division by grad_accum and
  the scaler's scaling), `backward`, `optimizer` (master conversion, unscale, step, update,
  copy-back, zero_grad; its micro_batch is the last micro-batch's number).
* `gc` is disabled while measuring and `gc.collect()` runs after each backward and each
  optimizer step, so frees do not depend on when Python's collector happens to run (the
  diagnostics report any bytes such a collection freed: they would mean a reference cycle).
"""

from __future__ import annotations

import contextlib

import torch

from .fused_loss import fused_linear_cross_entropy
from .models import underlying_model
from .recipe import Recipe, RecipeError
from .tracker import LOSS, MemoryTracker

LEARNING_RATE = 1e-3


class _AlwaysStepGradScaler(torch.amp.GradScaler):
    """GradScaler that never skips the step (and so never calls .item(): fake tensors work)."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=True)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9, foreach=True)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=LEARNING_RATE, scale_parameter=False, relative_step=False)
    if name == "adamw-8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise RecipeError(f"optimizer=adamw-8bit needs the bitsandbytes package: {e}") from None
        return bnb.optim.AdamW8bit(params, lr=LEARNING_RATE)
    raise RecipeError(f"unknown optimizer {name!r}")


def _unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def training_batch(recipe: Recipe, vocab: int, device) -> tuple:
    """The reference step's inputs: (input_ids, labels), and the attention_mask the recipe passes
    (all ones, or the last row's second half zeroed in place, so that nothing more is allocated)."""
    input_ids = torch.randint(vocab, (recipe.batch, recipe.seq), device=device)
    labels = input_ids.clone()
    if recipe.attention_mask == "none":
        return input_ids, labels
    mask = torch.ones(recipe.batch, recipe.seq, dtype=torch.int64, device=device)
    if recipe.attention_mask == "padded":
        mask[-1, max(1, recipe.seq // 2):].zero_()  # right padding
    return input_ids, labels, mask


@contextlib.contextmanager
def _accelerate_no_sync(model: torch.nn.Module):
    """Accelerate's Accelerator.no_sync (accelerate 1.16): DDP's no_sync(), or on an FSDP2 module
    set_requires_gradient_sync(False) until the block ends."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def _accelerate_clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Accelerator.clip_grad_norm_ outside DeepSpeed and FSDP (accelerate 1.16, after its
    unscale_gradients): _clip_grad_norm_dtensor_aware, which torch.distributed's availability
    routes through (get_total_norm per device mesh, a stack of the totals, its norm, then
    clip_grads_with_norm_). The method reads nothing of the Accelerator, so no Accelerator (and
    none of its process state) is made for it."""
    from accelerate import Accelerator

    return Accelerator._clip_grad_norm_dtensor_aware(None, list(parameters), max_norm)


def convert_outputs_as_accelerate(model: torch.nn.Module) -> None:
    """Wrap `model.forward` in Accelerate's own convert_outputs_to_fp32, as Accelerate's
    prepare_model does under its native mixed precision (accelerate 1.16, accelerator.py): the
    half tensors of the output (the logits) copied to fp32 when the forward returns. (Its autocast
    context, which prepare_model wraps inside, is the loop's own here.)"""
    from types import MethodType

    from accelerate.utils.operations import convert_outputs_to_fp32

    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    else:
        model.forward = convert_outputs_to_fp32(model.forward)


def hf_loss_fn(model, recipe: Recipe, tracker: MemoryTracker):
    """The per-micro-batch forward + loss for a Hugging Face causal LM."""
    # Through a PeftModel: its forward calls the Hugging Face model's, which calls that model's
    # loss_function; the decoder and the head are the Hugging Face model's too.
    hf_model = underlying_model(model)
    if recipe.loss == "standard":
        original = hf_model.loss_function

        def loss_function(*args, **kwargs):
            tracker.set_phase("loss")
            with tracker.scope(LOSS):
                loss = original(*args, **kwargs)
            tracker.label_graph(loss, LOSS)
            return loss

        hf_model.loss_function = loss_function

        def forward_and_loss(batch):
            input_ids, labels, *mask = batch  # an attention_mask when the recipe passes one
            return model(input_ids=input_ids, labels=labels, attention_mask=mask[0] if mask else None,
                         use_cache=recipe.use_cache).loss

        return forward_and_loss

    head = hf_model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise RecipeError("loss=fused supports an lm_head without bias only")
    if not isinstance(head, torch.nn.Linear):
        raise RecipeError(f"loss=fused needs an nn.Linear lm_head, got {type(head).__name__}")
    base = getattr(hf_model, hf_model.base_model_prefix)
    softcap = getattr(hf_model.config, "final_logit_softcapping", None)
    if recipe.autocast_dtype_name:
        compute_dtype = getattr(torch, recipe.autocast_dtype_name)
    else:
        compute_dtype = head.weight.dtype

    def forward_and_loss(batch):
        input_ids, labels, *mask = batch
        # Liger's forward keeps the base model's output, and the DynamicCache in it under use_cache,
        # through the loss and returns it with the loss; the Trainer drops it before backward.
        out = base(input_ids=input_ids, attention_mask=mask[0] if mask else None, use_cache=recipe.use_cache)
        hidden = out.last_hidden_state
        tracker.set_phase("loss")
        with tracker.scope(LOSS):
            loss = fused_linear_cross_entropy(hidden, head.weight, labels,
                                              compute_dtype=compute_dtype, softcap=softcap)
        tracker.label_graph(loss, LOSS)
        del out
        return loss

    return forward_and_loss


def _build_optimizer(recipe: Recipe, params, tracker: MemoryTracker, fake_mode):
    if recipe.optimizer != "adamw-8bit":
        return make_optimizer(recipe.optimizer, params)
    # bitsandbytes computes its quantization maps with .tolist() when it is constructed, which
    # fake tensors cannot do. Construct it outside the tracker and the fake mode (real and fake
    # runs alike, so their traces agree) and register the maps afterwards: they are small CPU
    # tensors that init_state moves to the parameters' device at the first step.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        optimizer = make_optimizer(recipe.optimizer, params)
    qmaps = getattr(optimizer, "name2qmap", {})
    for key, qmap in list(qmaps.items()):
        if fake_mode is not None and isinstance(qmap, torch.Tensor):
            qmaps[key] = qmap = fake_mode.from_tensor(qmap)
        tracker.register(qmap, f"bitsandbytes qmap {key}")
    return optimizer


def make_masters(recipe: Recipe, params: list[torch.Tensor], tracker: MemoryTracker) -> list[torch.Tensor]:
    """bf16-master: an fp32 copy of every parameter (category weights), which the optimizer steps;
    no copies for the other precisions."""
    if not recipe.uses_master_weights:
        return []
    with tracker.forced("weights"):
        return [torch.nn.Parameter(p.detach().float()) for p in params]


def grads_to_masters(params: list[torch.Tensor], masters: list[torch.Tensor], tracker: MemoryTracker) -> None:
    """bf16-master, before optimizer.step(): each half .grad becomes its master's fp32 .grad, one
    parameter at a time (the half gradient goes at once)."""
    for p, master in zip(params, masters):
        master.grad = p.grad.float() if p.grad is not None else None
        tracker.mark(master.grad, "gradients")
        p.grad = None


def masters_to_params(params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
    """bf16-master, after optimizer.step(): the stepped fp32 masters copied into the half parameters."""
    with torch.no_grad():
        for p, master in zip(params, masters):
            p.copy_(master)


# Note [Teardown]
# When a runner returns, its locals go: the batch, the optimizer and its states, the masters, the
# scaler. The tracker is still on (run.py closes it after the runner), so those frees used to land
# in the last step's optimizer phase. The engine's step ends with the optimizer and frees nothing
# after it, so where that phase allocates and frees nothing itself (SGD under DDP's
# gradient_as_bucket_view: the update is in place and zero_grad only drops views of the buckets)
# the measured side had a phase row the engine has not. Each training runner (run_steps, the
# DeepSpeed one, the pipeline's) therefore ends in phase "teardown", which like setup is no part
# of a step: its frees stay in the traces and are left out of the phase rows (phases.as_rows) and
# of the comparisons. Generation does not: the engine's generate() frees its inputs and cache in
# decode, as the measured one does.
def run_steps(model: torch.nn.Module, recipe: Recipe, tracker: MemoryTracker, *, device: str,
              make_batch, forward_and_loss, steps: int = 2, on_step_start=None, on_step_end=None,
              fake_mode=None, engine=None) -> None:
    """Run `steps` optimizer steps of the reference loop under an active tracker.

    make_batch() makes the inputs (category other); forward_and_loss(batch) returns the loss.
    `engine` is a DeepSpeed engine (parallel zero*, parallel.py): it owns the optimizer, the
    master partitions and the loss scaling, so the loop calls its backward() and step() instead.
    """
    if engine is not None:
        return _run_engine_steps(engine, recipe, tracker, make_batch=make_batch, forward_and_loss=forward_and_loss,
                                 steps=steps, on_step_start=on_step_start, on_step_end=on_step_end)
    device_type = torch.device(device).type
    params = _unique_params(model)
    tracker.set_phase("setup", 0, 0)
    with tracker.forced("other"):
        batch = make_batch()
    masters = make_masters(recipe, params, tracker)
    optimizer = _build_optimizer(recipe, masters or params, tracker, fake_mode)
    scaler = _AlwaysStepGradScaler(device_type) if recipe.uses_grad_scaler else None
    tracker.autocast = recipe.autocast_dtype_name is not None
    if recipe.autocast_dtype_name:
        autocast_dtype = getattr(torch, recipe.autocast_dtype_name)

        def autocast():
            return torch.autocast(device_type, dtype=autocast_dtype)
    else:
        autocast = contextlib.nullcontext

    grad_norm = None  # the Trainer's: clip_grad_norm_'s total norm, kept to the next step
    # loss_parallel() swaps in the vocab-parallel log_softmax / nll_loss (and their backward) for
    # DTensor inputs; the backward must run inside it too (torch/distributed/tensor/parallel/loss.py).
    with _loss_context(recipe, tracker):
        for step in range(1, steps + 1):
            if on_step_start is not None:
                on_step_start(step)
            for micro in range(1, recipe.grad_accum + 1):
                # As Accelerate's accumulate() and Hugging Face's Trainer: accelerator.no_sync around
                # the forward and the backward of every micro-batch but the last.
                sync = recipe.grad_accum == micro or not (recipe.ddp_no_sync or recipe.fsdp_no_sync)
                with contextlib.nullcontext() if sync else _accelerate_no_sync(model):
                    tracker.set_phase("forward", step, micro)
                    with autocast():
                        loss = forward_and_loss(batch)
                    tracker.set_phase("loss")
                    with tracker.scope(LOSS):
                        scaled = loss / recipe.grad_accum
                        del loss
                        if scaler is not None:
                            with tracker.forced("other"):
                                scaled = scaler.scale(scaled)
                    tracker.label_graph(scaled, LOSS)
                    tracker.set_phase("backward")
                    scaled.backward()
                    del scaled
                tracker.collect_garbage()
                tracker.mark_gradients(params)

            tracker.set_phase("optimizer")
            grads_to_masters(params, masters, tracker)
            if recipe.clip_grad_norm:
                grad_norm = None  # the Trainer's sync step: grad_norm = None, then the clip
            if scaler is not None:  # (accelerator.clip_grad_norm_ unscales first: step() does not again)
                with tracker.forced("other"):
                    scaler.unscale_(optimizer)
            if recipe.clip_grad_norm:
                grad_norm = _accelerate_clip_grad_norm(model.parameters(), 1.0)
            if scaler is not None:
                scaler.step(optimizer)
                with tracker.forced("other"):
                    scaler.update()
            else:
                optimizer.step()
            masters_to_params(params, masters)
            tracker.mark_optimizer_state(optimizer)
            tracker.mark_gradients(masters or params)
            optimizer.zero_grad(set_to_none=True)
            tracker.collect_garbage()
            if on_step_end is not None:
                on_step_end(step)
    tracker.set_phase("teardown")  # See Note [Teardown]
    del grad_norm  # held, as the Trainer holds it, to the end


@contextlib.contextmanager
def _loss_context(recipe: Recipe, tracker: MemoryTracker):
    """loss_parallel() with each handler it installs run under the tracker's mode, so that its
    local intermediates (max, sum-exp, shifted logits, exp; zeros, masks in backward) are recorded
    (torch 2.13, torch/distributed/tensor/parallel/loss.py customized_loss_ops)."""
    if not recipe.loss_parallel:
        yield
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss as tp_loss

    handlers = DTensor._op_dispatcher._custom_op_handlers
    with tp_loss.loss_parallel():
        saved = {op: handlers[op] for op in tp_loss.customized_loss_ops}
        handlers.update({op: tracker.track_inside(h) for op, h in saved.items()})
        try:
            yield
        finally:
            handlers.update(saved)  # loss_parallel() pops them on exit


def _run_engine_steps(engine, recipe: Recipe, tracker: MemoryTracker, *, make_batch, forward_and_loss, steps: int,
                      on_step_start, on_step_end) -> None:
    """The reference loop through a DeepSpeed engine: engine.backward(loss) divides the loss by
    grad_accum and runs the ZeRO reduction hooks; engine.step() is called after every micro-batch
    (DeepSpeed's contract) and only updates at the last one, where it also zeroes the gradients.
    Phases as in run_steps; a non-final engine.step() belongs to the backward phase."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    tracker.set_phase("setup", 0, 0)
    with tracker.forced("other"):
        batch = make_batch()
    for step in range(1, steps + 1):
        if on_step_start is not None:
            on_step_start(step)
        for micro in range(1, recipe.grad_accum + 1):
            tracker.set_phase("forward", step, micro)
            loss = forward_and_loss(batch)
            tracker.set_phase("backward")
            engine.backward(loss)
            del loss
            tracker.collect_garbage()
            tracker.mark_gradients(params)
            if micro < recipe.grad_accum:
                engine.step()
        tracker.set_phase("optimizer")
        engine.step()
        tracker.collect_garbage()
        if on_step_end is not None:
            on_step_end(step)
    tracker.set_phase("teardown")  # See Note [Teardown]
