#!/usr/bin/env python3
"""What data parallelism adds per rank: each data-parallel measurement against the engine's
single-process prediction of the same recipe (gpus / parallel dropped).

The engine reproduces single-process CPU measurements to the byte, so the difference is what
DDP or FSDP2 changes on one rank (docs/parallelism.md). Needs the built `trainmem` binary.

Usage:
    .venv/bin/python tools/parallel_vs_single.py                      # every file of data/ground_truth/parallel
    .venv/bin/python tools/parallel_vs_single.py FILE.json ... [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "ground_truth" / "parallel"
CATEGORIES = ("weights", "optimizer_states", "gradients", "activations", "temporaries", "other")
FLAGS = {"batch": "--batch", "seq": "--seq", "grad_accum": "--grad-accum", "precision": "--precision",
         "optimizer": "--optimizer", "checkpointing": "--checkpointing", "attention": "--attention",
         "loss": "--loss", "attention_mask": "--attention-mask"}


def binary() -> str:
    for cand in (os.environ.get("TRAINMEM_BIN"), ROOT / "build" / "trainmem", shutil.which("trainmem")):
        if cand and Path(cand).exists():
            return str(cand)
    sys.exit("parallel_vs_single: trainmem binary not found (make build, or set TRAINMEM_BIN)")


def single_prediction(result: dict, exe: str) -> dict:
    recipe = result["recipe"]
    model = result["provenance"]["model_argument"] if "provenance" in result else result["model"]
    args = [exe, "estimate", model, "--gpu", "cpu", "--allocator", "expandable", "--json"]
    for key, flag in FLAGS.items():
        if key in recipe:
            args += [flag, str(recipe[key])]
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    files = [Path(f) for f in args.files] or sorted(p for p in CORPUS.glob("*.json") if p.name != "index.json")
    exe = binary()
    rows = []
    for path in files:
        result = json.loads(path.read_text())
        single = single_prediction(result, exe)
        row = {"id": path.stem, "parallel": result["recipe"].get("parallel"), "gpus": result["recipe"].get("gpus"),
               "tp": result["recipe"].get("tp"),
               "measured_peak": result["peak_allocated_bytes"], "single_peak": single["peak_allocated_bytes"],
               "delta_peak": result["peak_allocated_bytes"] - single["peak_allocated_bytes"],
               "delta_at_peak": {c: result["breakdown_at_peak"][c] - single["breakdown_at_peak"][c]
                                 for c in CATEGORIES},
               "measured_peak_op": result["peak"]["op"], "single_peak_op": single["peak"]["op"]}
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        deltas = ", ".join(f"{c} {v:+,}" for c, v in r["delta_at_peak"].items() if v)
        print(f"{r['id']}: measured {r['measured_peak']:,} B vs single {r['single_peak']:,} B "
              f"({r['delta_peak']:+,}); at the peak: {deltas or 'same'}; peak op {r['measured_peak_op']!r} "
              f"(single {r['single_peak_op']!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
