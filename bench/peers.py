"""Time per estimate: trainmem's Python API against the tools people use to size a training run.

    /work/main/.venv/bin/python bench/peers.py                 # gpt2, llama-3.1-8b, llama-3.1-70b
    /work/main/.venv/bin/python bench/peers.py --skip-fake     # without the (slow) fake-tensor step

Each tool answers a narrower question than trainmem (bench/README.md, "What each peer covers"):

  trainmem     trainmem.estimate(name, batch=1, seq=S): peak allocated/reserved bytes of two
               training steps, op by op through the caching-allocator model
  accelerate   the `accelerate estimate-memory` code path without the Hub: an empty (meta) model
               built from the config, calculate_maximum_sizes, estimate_training_usage per dtype
  deepspeed    estimate_zero2/zero3_model_states_mem_needs_all_cold: closed forms for parameters,
               gradients and optimizer states (no activations), printed tables sent to a buffer
  fake-tensor  torch FakeTensorMode: the Hugging Face model built from the config, then one
               forward (with labels) and backward, the way a measuring tool sees a step without a GPU

Models are built from data/models/<name>.json, so nothing needs the network. Every timing is the
median of --rounds rounds, after one warm-up call; a round times enough calls to last
--min-seconds (at least one). The table shows CPU time of this process per estimate
(time.process_time), which a busy, shared machine inflates far less than wall-clock time;
--json records both.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ = {"gpt2": 1024}  # GPT-2 has 1,024 positions; the others run at 4,096 tokens


def load_config(name: str):
    from transformers import AutoConfig

    cfg = json.loads((ROOT / "data" / "models" / f"{name}.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def timed(fn, rounds: int, min_seconds: float) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) per call of fn() over `rounds` rounds, after one
    warm-up call."""
    fn()
    cpu, wall = [], []
    for _ in range(rounds):
        calls, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
        while True:
            fn()
            calls += 1
            if time.process_time() - cpu0 >= min_seconds:
                break
        cpu.append((time.process_time() - cpu0) / calls)
        wall.append((time.perf_counter() - wall0) / calls)
    return statistics.median(cpu), statistics.median(wall)


# ---- the tools ---------------------------------------------------------------------------------


def trainmem_call(name: str, seq: int):
    import trainmem

    def run():
        return trainmem.estimate(name, batch=1, seq=seq)

    return run


def accelerate_call(name: str):
    import torch
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModelForCausalLM

    config = load_config(name)

    def run():
        # create_empty_model() minus the Hub look-up: the config is local.
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        total_size, largest_layer = calculate_maximum_sizes(model)
        return [estimate_training_usage(total_size, d) for d in ("float32", "float16")], largest_layer

    return run


def deepspeed_call(name: str):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
    total, largest = model_counts(name)

    def run():
        with contextlib.redirect_stdout(io.StringIO()):
            estimate_zero2_model_states_mem_needs_all_cold(total_params=total, num_gpus_per_node=1, num_nodes=1)
            estimate_zero3_model_states_mem_needs_all_cold(
                total_params=total, largest_layer_params=largest, num_gpus_per_node=1, num_nodes=1)

    return run


_COUNTS: dict[str, tuple[int, int]] = {}


def model_counts(name: str) -> tuple[int, int]:
    """Total parameters and the largest module's own parameters (DeepSpeed's *_all_live rule),
    read from an empty model once, outside the timing: the cold estimators take them as input."""
    if name not in _COUNTS:
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(load_config(name), dtype=torch.float32)
        total = sum(p.numel() for p in model.parameters())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        _COUNTS[name] = (total, largest)
    return _COUNTS[name]


def fake_tensor_call(name: str, seq: int):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    config = load_config(name)
    config._attn_implementation = "sdpa"

    def run():
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.train()
            ids = torch.randint(0, config.vocab_size, (1, seq))
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        return out.loss.shape

    return run


# ---- what each tool answers ----------------------------------------------------------------------


def answers(name: str, seq: int) -> dict[str, str]:
    """The number each tool gives for "memory to train this model" (batch 1, bf16, AdamW)."""
    out: dict[str, str] = {}
    gib = 2**30
    try:
        import trainmem

        e = trainmem.estimate(name, batch=1, seq=seq)
        out["trainmem"] = (f"{e.peak_allocated_bytes / gib:.1f} GiB allocated, "
                           f"{e.peak_reserved_bytes / gib:.1f} GiB reserved at peak (activations included)")
    except ImportError:
        pass
    try:
        from accelerate.commands.estimate import estimate_training_usage

        total, _ = model_counts(name)
        usage = estimate_training_usage(total * 4, "bfloat16")
        out["accelerate"] = (f"{max(usage.values()) / gib:.1f} GiB (its 'Training using Adam' figure: the largest of "
                             "its weights, gradients and optimizer terms; no activations)")
    except ImportError:
        pass
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        total, _ = model_counts(name)
        _, gpu = estimate_zero2_model_states_mem_needs(total, 1, 1, cpu_offload=False)
        out["deepspeed"] = f"{gpu / gib:.1f} GiB per GPU (ZeRO-2 on one GPU, no offload; model states only)"
    except ImportError:
        pass
    out["fake-tensor"] = "shapes and dtypes of every tensor; bytes need a tracker on top (trainmem.measure)"
    return out


# ---- the run -----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-3.1-8b", "llama-3.1-70b"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    ap.add_argument("--fake-rounds", type=int, default=1, help="rounds for the fake-tensor step")
    ap.add_argument("--skip-fake", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the timings here")
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))

    tools = ["trainmem", "accelerate", "deepspeed", "fake-tensor"]
    results: dict[str, dict[str, float | str]] = {}
    walls: dict[str, dict[str, float]] = {}
    for name in args.models:
        seq = SEQ.get(name, 4096)
        row: dict[str, float | str] = {"seq": seq}
        walls[name] = {}
        for tool in tools:
            if tool == "fake-tensor" and args.skip_fake:
                row[tool] = "skipped"
                continue
            try:
                if tool == "trainmem":
                    t = timed(trainmem_call(name, seq), args.rounds, args.min_seconds)
                elif tool == "accelerate":
                    t = timed(accelerate_call(name), args.rounds, args.min_seconds)
                elif tool == "deepspeed":
                    t = timed(deepspeed_call(name), args.rounds, args.min_seconds)
                else:
                    t = timed(fake_tensor_call(name, seq), args.fake_rounds, 0.0)
                row[tool], walls[name][tool] = t
            except ImportError as e:
                row[tool] = f"not installed ({e.name})"
            print(f"{name:15s} {tool:12s} {fmt(row[tool])}", file=sys.stderr, flush=True)
        results[name] = row

    print(table(results, tools))
    print()
    for name in args.models:
        print(f"{name}:")
        for tool, text in answers(name, SEQ.get(name, 4096)).items():
            print(f"  {tool:12s} {text}")
    if args.json:
        args.json.write_text(json.dumps({"cpu_seconds": results, "wall_seconds": walls}, indent=2) + "\n")
    return 0


def fmt(t) -> str:
    if isinstance(t, str):
        return t
    if t < 1e-3:
        return f"{t * 1e6:.1f} µs"
    if t < 1:
        return f"{t * 1e3:.2f} ms"
    return f"{t:.2f} s"


def table(results, tools) -> str:
    lines = ["| model | seq | " + " | ".join(tools) + " |", "|---|---:|" + "---:|" * len(tools)]
    for name, row in results.items():
        base = row["trainmem"]
        cells = []
        for tool in tools:
            t = row[tool]
            if isinstance(t, str) or isinstance(base, str) or tool == "trainmem":
                cells.append(fmt(t))
            else:
                cells.append(f"{fmt(t)} ({t / base:.3g}×)")
        lines.append(f"| {name} | {row['seq']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("(CPU time per estimate; ×: relative to trainmem's, below 1 means the peer is faster)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
