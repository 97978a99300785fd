"""`trainmem-measure`: the same model argument and flags as `trainmem estimate`, measured.

    trainmem-measure qwen3-0.6b --batch 1 --seq 512 --precision bf16-mixed --json
    trainmem-measure llama-3.1-70b --seq 4096 --checkpointing full --fake --json
    trainmem-measure path/to/config.json --device cuda --trace events.jsonl
    trainmem-measure qwen3-0.6b --lora 16 --lora-targets all-linear --lora-dropout 0.05 --json
    trainmem-measure qwen3-0.6b --lora 16 --qlora --precision bf16-true --json
    trainmem-measure qwen3-0.6b --inference --seq 64 --new-tokens 16 --beams 4 --precision fp32 --json
    trainmem-measure qwen3-0.6b --inference --seq 32 --new-tokens 8 --load-in-8bit --json

Exit codes: 0 success, 2 bad input (one line on stderr), 1 the measurement itself failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys

from .recipe import (ALLOCATORS, ATTENTION_MASKS, ATTENTIONS, BNB_4BIT_QUANT_STORAGES, BNB_4BIT_QUANT_TYPES,
                     CHECKPOINTING, FLAGS_WHEN_ON, FSDP_PARAM_DTYPES, FSDP_REDUCE_DTYPES, LOSSES, OPTIMIZERS,
                     PARALLELS, PRECISIONS, Recipe, RecipeError)

PROG = "trainmem-measure"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block
        raise _UsageError(message)


def _parser() -> _Parser:
    defaults = Recipe()
    p = _Parser(prog=PROG, description="Measure what PyTorch allocates in two training steps (or one generate() "
                                       "call with --inference), by category.")
    p.add_argument("model", help="catalog name, path to a config.json, or a directory holding one")
    p.add_argument("--batch", type=int, default=defaults.batch, help="micro-batch size (default %(default)s)")
    p.add_argument("--seq", type=int, default=defaults.seq, help="tokens per sequence (default %(default)s)")
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum,
                   help="micro-batches per optimizer step (default %(default)s)")
    p.add_argument("--precision", choices=PRECISIONS, default="",
                   help="default bf16-mixed (training; over a 4-bit or 8-bit base bf16-true, with --load-dtype "
                        "its autocast), bf16-true (inference: fp32, bf16-true or fp16-true)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
    p.add_argument("--checkpointing", choices=CHECKPOINTING, default=defaults.checkpointing)
    p.add_argument("--attention", choices=ATTENTIONS, default=defaults.attention)
    p.add_argument("--loss", choices=LOSSES, default=defaults.loss)
    p.add_argument("--attention-mask", choices=ATTENTION_MASKS, default=defaults.attention_mask,
                   help="the training batch's attention_mask: none (input_ids and labels only), ones (an unpadded "
                        "batch as a tokenizer gives it) or padded (the last row's second half is padding) "
                        "(default %(default)s)")
    p.add_argument("--gpu", default=None,
                   help="recorded as recipe.gpu (default: cpu, or the CUDA device's name with --device cuda)")
    p.add_argument("--allocator", choices=ALLOCATORS, default=defaults.allocator,
                   help="with --device cuda, expandable sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    p.add_argument("--gpus", type=int, default=defaults.gpus, metavar="N",
                   help="world size: N processes on the CPU (gloo), rank 0 reported (default %(default)s)")
    p.add_argument("--parallel", choices=PARALLELS, default=defaults.parallel,
                   help="data parallelism across --gpus: ddp (DistributedDataParallel), fsdp (FSDP2 fully_shard "
                        "per decoder layer and the root), or DeepSpeed ZeRO stage 1, 2 or 3 at its default settings "
                        "(zero1, zero2, zero3; needs the deepspeed package) (default %(default)s)")
    p.add_argument("--tp", type=int, default=defaults.tp, metavar="N",
                   help="tensor-parallel degree: N processes on the CPU (gloo), torch's parallelize_module with "
                        "the Megatron plan (q/k/v, gate/up colwise; o/down rowwise), rank 0 reported (default %(default)s)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: sequence parallelism, SequenceParallel on the norms, the residual stream "
                        "sharded on the sequence (all-gather before q/k/v and gate/up, reduce-scatter after o/down)")
    p.add_argument("--loss-parallel", action="store_true",
                   help="with --tp: lm_head ColwiseParallel with vocab-sharded logits (Shard(-1) DTensor) and the "
                        "loss and its backward inside torch's loss_parallel()")
    p.add_argument("--pp", type=int, default=defaults.pp, metavar="N",
                   help="pipeline-parallel degree: N processes on the CPU (gloo), torch.distributed.pipelining with "
                        "the decoder layers split evenly over N stages; --grad-accum is the schedule's "
                        "n_microbatches; with --tp T: N x T processes on a (pp, tp) mesh, each stage tensor-parallel; "
                        "the worst stage reported (default %(default)s)")
    p.add_argument("--pp-schedule", choices=("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs"),
                   default=defaults.pp_schedule,
                   help="with --pp: Schedule1F1B or ScheduleGPipe (one stage per rank), ScheduleInterleaved1F1B or "
                        "ScheduleLoopedBFS (--pp-stages-per-rank stages per rank) (default %(default)s)")
    p.add_argument("--pp-stages-per-rank", type=int, default=defaults.pp_stages_per_rank, metavar="V",
                   help="with --pp and a multi-stage schedule: V stages per rank, rank r holding stages r, r + N, "
                        "..., the decoder layers split over N x V stages (default %(default)s)")
    p.add_argument("--ddp-find-unused-parameters", action="store_true",
                   help="parallel ddp: DistributedDataParallel(find_unused_parameters=True), what Hugging Face's "
                        "Trainer passes for a peft model")
    p.add_argument("--ddp-gradient-as-bucket-view", action="store_true",
                   help="parallel ddp: DistributedDataParallel(gradient_as_bucket_view=True), the .grads views of "
                        "the buckets")
    p.add_argument("--ddp-no-sync", action="store_true",
                   help="parallel ddp: every micro-batch but the step's last runs under DistributedDataParallel."
                        "no_sync(), as Accelerate's accumulate() and Hugging Face's Trainer (accelerator.no_sync) do")
    p.add_argument("--fsdp-no-sync", action="store_true",
                   help="parallel fsdp: every micro-batch but the step's last under set_requires_gradient_sync(False), "
                        "as Accelerate's no_sync and Hugging Face's Trainer accumulate")
    p.add_argument("--use-cache", action="store_true",
                   help="training forwards with use_cache=True, as a Trainer run without checkpointing leaves the "
                        "config's: each layer's keys and values copied into a DynamicCache")
    p.add_argument("--clip-grad-norm", action="store_true",
                   help="accelerator.clip_grad_norm_ before each optimizer step, as Hugging Face's Trainer runs it "
                        "(its total norm kept to the next step)")
    p.add_argument("--fp32-outputs", action="store_true",
                   help="bf16-mixed / fp16-mixed: the model's forward wrapped in Accelerate's convert_outputs_to_fp32, "
                        "as Accelerate's prepare() (Hugging Face's Trainer) wraps it")
    p.add_argument("--fsdp-reshard-after-forward", choices=("true", "false"), default="true",
                   help="parallel fsdp: fully_shard(layer, reshard_after_forward=...) for the decoder layers; false "
                        "keeps each layer gathered from its forward to its backward (SHARD_GRAD_OP) (default true)")
    p.add_argument("--fsdp-replicate", type=int, default=defaults.fsdp_replicate, metavar="R",
                   help="parallel fsdp: R > 1 is HSDP, the 2-D mesh (R, gpus / R): shard in groups of gpus / R "
                        "ranks, replicate across R of them (default %(default)s)")
    p.add_argument("--fsdp-param-dtype", choices=FSDP_PARAM_DTYPES, default=defaults.fsdp_param_dtype,
                   help="parallel fsdp: MixedPrecisionPolicy(param_dtype=...) over fp32 parameters (default none)")
    p.add_argument("--fsdp-reduce-dtype", choices=FSDP_REDUCE_DTYPES, default=defaults.fsdp_reduce_dtype,
                   help="parallel fsdp: MixedPrecisionPolicy(reduce_dtype=...); none reduces in param_dtype "
                        "(default none)")
    p.add_argument("--lora", type=int, default=defaults.lora_rank, metavar="RANK",
                   help="LoRA rank (peft); 0 trains every parameter (default %(default)s)")
    p.add_argument("--lora-targets", default=defaults.lora_targets, metavar="NAMES",
                   help="modules LoRA wraps: default (peft's), all-linear, or names (q_proj,v_proj)")
    p.add_argument("--lora-dropout", type=float, default=defaults.lora_dropout, metavar="P",
                   help="lora_dropout in [0, 1); 0 is nn.Identity (default %(default)s)")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="4-bit base weights (bitsandbytes, BitsAndBytesConfig(load_in_4bit=True)); needs --lora "
                        "or --inference")
    p.add_argument("--bnb-4bit-quant-type", choices=BNB_4BIT_QUANT_TYPES, default=None,
                   help=f"with --load-in-4bit: the 4-bit code (default {defaults.bnb_4bit_quant_type}, as transformers')")
    p.add_argument("--bnb-4bit-use-double-quant", action="store_true",
                   help="with --load-in-4bit: quantize the block constants again (8-bit, blocks of 256)")
    p.add_argument("--bnb-4bit-quant-storage", choices=BNB_4BIT_QUANT_STORAGES, default="uint8",
                   help="with --load-in-4bit: the dtype of the packed weights (default %(default)s); bf16 is the "
                        "FSDP / ZeRO-3 QLoRA recipe's")
    p.add_argument("--no-prepare-kbit-training", action="store_true",
                   help="with --load-in-4bit and --load-dtype bf16/fp16: skip peft's prepare_model_for_kbit_training, "
                        "so what is not 4-bit stays half (TRL's sharded FSDP / ZeRO-3 QLoRA)")
    p.add_argument("--load-dtype", choices=("auto", "bf16", "fp16"), default="auto",
                   help="from_pretrained's dtype; auto is the precision's weights' dtype, bf16 (with bf16-mixed) or "
                        "fp16 (with fp16-mixed, and --load-in-4bit or --lora) the Trainer recipe of a half-loaded "
                        "QLoRA base, of a half model whose fp32 adapters run under autocast, or (bf16) of a half "
                        "model trained whole (default %(default)s)")
    p.add_argument("--qlora", action="store_true",
                   help="QLoRA's base: --load-in-4bit --bnb-4bit-quant-type nf4 --bnb-4bit-use-double-quant")
    p.add_argument("--load-in-8bit", action="store_true",
                   help="8-bit weights (bitsandbytes LLM.int8, BitsAndBytesConfig(load_in_8bit=True)); --inference only")
    p.add_argument("--inference", action="store_true",
                   help="measure one model.generate() call (prefill of --seq tokens, then decode) instead of training")
    p.add_argument("--new-tokens", type=int, default=defaults.new_tokens, metavar="N",
                   help="inference: max_new_tokens, all generated (default %(default)s)")
    p.add_argument("--beams", type=int, default=defaults.beams, metavar="K",
                   help="inference: num_beams (1: greedy search; default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the JSON document (docs/schema.md)")
    p.add_argument("--fake", action="store_true", help="fake tensors: no compute, no memory (any model size)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--trace", metavar="FILE", help="write every allocation and free as JSON lines")
    return p


def defaults_quant_type() -> str:
    return Recipe().bnb_4bit_quant_type


def _error(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def recipe_from_args(args: argparse.Namespace, gpu: str) -> Recipe:
    """The Recipe of parsed command-line arguments (`gpu`: the name recorded in it)."""
    if args.qlora and args.bnb_4bit_quant_type not in (None, "nf4"):  # as trainmem estimate refuses it
        raise RecipeError(f"bnb_4bit_quant_type: --qlora is an nf4 base with double quant; for "
                          f"{args.bnb_4bit_quant_type} use --load-in-4bit --bnb-4bit-quant-type "
                          f"{args.bnb_4bit_quant_type}")
    quant_type = args.bnb_4bit_quant_type or ("nf4" if args.qlora else defaults_quant_type())
    return Recipe(batch=args.batch, seq=args.seq, grad_accum=args.grad_accum, precision=args.precision,
                  optimizer=args.optimizer, checkpointing=args.checkpointing, attention=args.attention,
                  loss=args.loss, attention_mask=args.attention_mask, gpu=gpu, allocator=args.allocator, lora_rank=args.lora,
                  lora_targets=args.lora_targets, lora_dropout=args.lora_dropout,
                  mode="inference" if args.inference else "training", new_tokens=args.new_tokens,
                  beams=args.beams, gpus=args.gpus, parallel=args.parallel, tp=args.tp,
                  sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel,
                  pp=args.pp, pp_schedule=args.pp_schedule, pp_stages_per_rank=args.pp_stages_per_rank,
                  fsdp_reshard_after_forward=args.fsdp_reshard_after_forward == "true",
                  fsdp_replicate=args.fsdp_replicate, fsdp_param_dtype=args.fsdp_param_dtype,
                  fsdp_reduce_dtype=args.fsdp_reduce_dtype,
                  **{knob: getattr(args, knob) for knob in FLAGS_WHEN_ON},  # --ddp-no-sync etc.: one flag each
                  load_in_4bit=args.load_in_4bit or args.qlora, bnb_4bit_quant_type=quant_type,
                  bnb_4bit_use_double_quant=args.bnb_4bit_use_double_quant or args.qlora,
                  bnb_4bit_quant_storage=args.bnb_4bit_quant_storage,
                  load_dtype=args.load_dtype, load_in_8bit=args.load_in_8bit,
                  prepare_kbit_training=not args.no_prepare_kbit_training)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        return _error(str(e), 2)
    if args.device == "cuda" and args.allocator == "expandable" and not args.fake:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments" not in conf:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    if args.trace:
        try:
            open(args.trace, "a").close()  # writable? (not truncated before the recipe is checked)
        except OSError as e:
            return _error(f"cannot write the trace file {args.trace}: {e.strerror}", 2)

    # Libraries print to standard output on their own (DeepSpeed's "Setting accelerator to CPU"
    # when bitsandbytes brings it in, also from spawned ranks, which inherit the descriptor): while
    # the measurement runs, descriptor 1 is standard error, so the JSON alone reaches stdout.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # and Python's own stdout object
            status = _measure(args, argv)
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    if isinstance(status, int):
        return status
    print(json.dumps(status, indent=2) if args.json else render_text(status))
    return 0


def _measure(args, argv: list[str]):
    """The measurement's result, or the exit status of a failure (its message printed)."""
    from .models import ModelError
    from .run import DeviceError, measure, quiet_libraries

    quiet_libraries()

    gpu = args.gpu
    if gpu is None:
        gpu = "cpu"
        if args.device == "cuda" and not args.fake:
            import torch

            if torch.cuda.is_available():
                gpu = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "-")
    try:
        recipe = recipe_from_args(args, gpu)
        command = shlex.join([PROG, *argv])
        return measure(args.model, recipe, device=args.device, fake=args.fake, trace=args.trace, command=command)
    except (RecipeError, ModelError, DeviceError) as e:
        return _error(str(e), 2)
    except Exception as e:  # the measurement failed (out of memory, an unsupported model...)
        first_line = (str(e).strip().splitlines() or [""])[0]
        return _error(f"measurement failed: {type(e).__name__}: {first_line}", 1)


def format_bytes(n: int | None) -> str:
    """Binary units, as torch prints them."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def render_text(result: dict) -> str:
    r = result["recipe"]
    peak = result["peak"]
    if r.get("mode") == "inference":
        what = (f"generate: batch {r['batch']} x prompt {r['seq']} + {r['new_tokens']} new tokens,"
                f" beams {r['beams']}, {r['precision']}, attention {r['attention']} [{result['source']}]")
    else:
        what = (f"batch {r['batch']} x seq {r['seq']}"
                f" (grad_accum {r['grad_accum']}), {r['precision']}, {r['optimizer']}, checkpointing {r['checkpointing']},"
                f" attention {r['attention']}, loss {r['loss']} [{result['source']}]")
    lines = [
        f"{result['model']}: {result['parameters']:,} parameters, {what}",
        f"peak allocated {format_bytes(result['peak_allocated_bytes'])} at step {peak['step']}"
        f" micro-batch {peak['micro_batch']}, {peak['phase']}: {peak['op']}",
    ]
    if r.get("lora_rank"):
        targets = r.get("lora_targets")
        targets = ", ".join(targets) if isinstance(targets, list) else targets
        lines.insert(1, f"lora: rank {r['lora_rank']} on {targets} (dropout {r.get('lora_dropout', 0):g}),"
                        f" {result['trainable_parameters']:,} trainable parameters"
                        f"{'; model loaded in ' + r['load_dtype'] if r.get('load_dtype') and not r.get('load_in_4bit') else ''}")
    if r.get("load_in_4bit"):
        lines.insert(2, f"4-bit base: {r['bnb_4bit_quant_type']}"
                        f"{', double quant' if r.get('bnb_4bit_use_double_quant') else ''}"
                        f"{', stored as ' + r['bnb_4bit_quant_storage'] if r.get('bnb_4bit_quant_storage') else ''}"
                        f"{', loaded in ' + r['load_dtype'] if r.get('load_dtype') else ''} (bitsandbytes)")
    if r.get("load_in_8bit"):
        lines.insert(2, "8-bit weights: LLM.int8, threshold 6.0 (bitsandbytes)")
    total = result["peak_allocated_bytes"] or 1
    for category, value in result["breakdown_at_peak"].items():
        lines.append(f"  {category:<17} {format_bytes(value):>12}  {100.0 * value / total:5.1f} %")
    lines.append("  " + ", ".join(f"step {s['step']} peak {format_bytes(s['peak_allocated_bytes'])}"
                                  for s in result["steps"]))
    if "torch" in result:
        t = result["torch"]
        lines.append(f"torch.cuda: max_memory_allocated {format_bytes(t.get('max_memory_allocated'))},"
                     f" max_memory_reserved {format_bytes(t.get('max_memory_reserved'))},"
                     f" context {format_bytes(t.get('context_bytes'))}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
