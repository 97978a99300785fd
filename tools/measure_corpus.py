#!/usr/bin/env python3
"""Measure the ground-truth corpus: every configuration of data/ground_truth/matrix.json.

For each configuration it runs trainmem.measure in this process (real compute on the CPU, or
fake tensors) and writes data/ground_truth/<id>.json: the measurement JSON (docs/schema.md keys
plus diagnostics) and a `provenance` block (torch and transformers versions, the command that
reproduces it, the date, the machine, the wall time). Reduced-depth variants named in the
matrix's `derived` section are written to data/ground_truth/configs/<name>.json first; that
path is the model argument, so `trainmem estimate` can be run on exactly the same config.
data/ground_truth/index.json lists every result with its peak.

Usage:
    .venv/bin/python tools/measure_corpus.py --jobs 2        # everything (about 20 min on 2 busy cores)
    .venv/bin/python tools/measure_corpus.py --only ID ...   # some configurations
    .venv/bin/python tools/measure_corpus.py --list          # ids, models, modes
    .venv/bin/python tools/measure_corpus.py --skip-existing # keep results already there
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_common import ROOT, load_measure  # noqa: E402

CORPUS = ROOT / "data" / "ground_truth"
# Multi-process (data- or tensor-parallel) measurements: a directory of their own (with an index of every
# rank's peak), which the accuracy gate (tests/python/test_accuracy.py) reads besides *.json.
PARALLEL_CORPUS = CORPUS / "parallel"
MATRIX = CORPUS / "matrix.json"
CATALOG = ROOT / "data" / "models"


def write_derived(matrix: dict) -> dict[str, str]:
    """Reduced-depth variants -> repo-relative config paths (written if missing or changed)."""
    out = {}
    (CORPUS / "configs").mkdir(exist_ok=True)
    index = {e["name"]: e for e in json.loads((CATALOG / "index.json").read_text())}
    for name, spec in matrix.get("derived", {}).items():
        base = json.loads((CATALOG / index[spec["from"]]["file"]).read_text())
        config = dict(base)
        for key, value in spec["overrides"].items():
            config[key] = value
            if key in ("num_hidden_layers", "n_layer") and isinstance(config.get("layer_types"), list):
                config["layer_types"] = config["layer_types"][:value]
        path = CORPUS / "configs" / f"{name}.json"
        text = json.dumps(config, indent=2) + "\n"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        out[name] = str(path.relative_to(ROOT))
    return out


def is_parallel(config: dict) -> bool:
    """A multi-process run: data parallelism (`parallel`), tensor (`tp` > 1) or pipeline (`pp` > 1) parallelism."""
    return (config["recipe"].get("parallel", "none") != "none" or config["recipe"].get("tp", 1) > 1
            or config["recipe"].get("pp", 1) > 1)


def result_path(config: dict) -> Path:
    """data/ground_truth/<id>.json, data/ground_truth/parallel/<id>.json for a data-parallel run, or
    the folder the configuration names (`"folder": "zero-pending"`: measured, not yet gated)."""
    if config.get("folder"):
        folder = CORPUS / config["folder"]
        folder.mkdir(exist_ok=True)
        return folder / f"{config['id']}.json"
    if is_parallel(config):
        PARALLEL_CORPUS.mkdir(exist_ok=True)
        return PARALLEL_CORPUS / f"{config['id']}.json"
    return CORPUS / f"{config['id']}.json"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="measure only these configuration ids")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--skip-existing", action="store_true", help="do not re-measure ids that have a result")
    parser.add_argument("--matrix", default=str(MATRIX))
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes; real-compute runs all go to the first one (memory), fake runs "
                             "are spread over the others")
    parser.add_argument("--trace-dir", metavar="DIR",
                        help="also write every allocation and free of each run to DIR/<id>.jsonl (trainmem-measure --trace)")
    parser.add_argument("--no-index", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    matrix = json.loads(Path(args.matrix).read_text())
    configs = matrix["configurations"]
    if args.list:
        for c in configs:
            print(f"{c['id']:<60} {c['model']:<28} {c['mode']}")
        print(f"{len(configs)} configurations")
        return 0
    if args.only:
        unknown = set(args.only) - {c["id"] for c in configs}
        if unknown:
            print(f"measure_corpus: unknown id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        configs = [c for c in configs if c["id"] in args.only]

    if args.jobs > 1:
        return run_jobs(args, configs)

    measure_pkg = load_measure()
    from trainmem.measure.run import default_command, quiet_libraries, versions
    from trainmem.measure.models import resolve_model

    quiet_libraries()
    derived = write_derived(matrix)
    defaults = matrix.get("defaults", {})
    host = machine()
    started = time.perf_counter()
    failures = []
    for n, config in enumerate(configs, 1):
        out_path = result_path(config)
        if args.skip_existing and out_path.exists():
            continue
        model_arg = derived.get(config["model"], config["model"])
        knobs = {**defaults, **config["recipe"]}
        if config["recipe"].get("mode") == "inference" and "precision" not in config["recipe"]:
            knobs.pop("precision", None)  # the matrix default is a training precision: use inference's
        recipe = measure_pkg.Recipe(**knobs)
        fake = config["mode"] == "fake"
        spec = resolve_model(model_arg)
        command = default_command(spec, recipe, device="cpu", fake=fake)
        t0 = time.perf_counter()
        try:
            trace = str(Path(args.trace_dir) / f"{config['id']}.jsonl") if args.trace_dir else None
            result = measure_pkg.measure(spec, recipe, device="cpu", fake=fake, command=command, trace=trace)
        except Exception as e:  # keep going; the failure is reported at the end
            traceback.print_exc()
            failures.append(config["id"])
            print(f"[{n}/{len(configs)}] {config['id']}: FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        finally:
            gc.collect()
        seconds = time.perf_counter() - t0
        result["provenance"] = {
            "generated_by": "tools/measure_corpus.py",
            "configuration_id": config["id"],
            "mode": config["mode"],
            "model_argument": model_arg,
            "derived_from": matrix.get("derived", {}).get(config["model"]),
            "command": command,
            "versions": versions(recipe),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": host,
            "wall_seconds": round(seconds, 2),
        }
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[{n}/{len(configs)}] {config['id']}: peak {result['peak_allocated_bytes'] / 2**30:.3f} GiB"
              f" ({result['peak']['phase']}), {seconds:.1f} s", flush=True)
        late = {r["rank"]: r["freed_off_thread_bytes"] for r in result["diagnostics"].get("parallel", {}).get("ranks", [])
                if r.get("freed_off_thread_bytes")}
        if config["mode"] == "cpu" and late:
            print(f"    note: bytes freed on gloo's worker thread by rank {late}: a collective's tensors outlived the "
                  "tracking thread's references, which can raise a peak by at most that much", flush=True)
    total = time.perf_counter() - started
    if not args.no_index:
        write_index(matrix, total if not args.only and not args.skip_existing else None)
    print(f"done: {len(configs) - len(failures)} measured, {len(failures)} failed, {total:.0f} s")
    if failures:
        print("failed: " + ", ".join(failures), file=sys.stderr)
        return 1
    return 0


def run_jobs(args, configs: list[dict]) -> int:
    import subprocess

    buckets: list[list[str]] = [[] for _ in range(args.jobs)]
    fake_slot = 1
    for config in configs:
        if config["mode"] == "cpu":
            buckets[0].append(config["id"])
        else:
            buckets[fake_slot].append(config["id"])
            fake_slot = fake_slot % (args.jobs - 1) + 1
    started = time.perf_counter()
    procs = []
    for ids in buckets:
        if not ids:
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--matrix", args.matrix, "--no-index", "--only", *ids]
        if args.skip_existing:
            cmd.append("--skip-existing")
        if args.trace_dir:
            cmd += ["--trace-dir", args.trace_dir]
        procs.append(subprocess.Popen(cmd))
    codes = [p.wait() for p in procs]
    total = time.perf_counter() - started
    matrix = json.loads(Path(args.matrix).read_text())
    complete = not args.only and not args.skip_existing
    write_index(matrix, total if complete else None)
    print(f"all workers done in {total:.0f} s (exit codes {codes})")
    return max(codes, default=0)


def write_index(matrix: dict, generation_seconds: float | None) -> None:
    entries = []
    for config in matrix["configurations"]:
        path = CORPUS / f"{config['id']}.json"
        if is_parallel(config) or not path.exists():
            continue
        r = json.loads(path.read_text())
        entries.append({
            "id": config["id"], "file": path.name, "model": r["model"], "source": r["source"], "recipe": r["recipe"],
            "parameters": r["parameters"], "peak_allocated_bytes": r["peak_allocated_bytes"],
            "breakdown_at_peak": r["breakdown_at_peak"], "peak": r["peak"],
            "wall_seconds": r["provenance"]["wall_seconds"],
        })
    index_path = CORPUS / "index.json"
    previous = json.loads(index_path.read_text()) if index_path.exists() else {}
    doc = {
        "description": "Ground-truth measurements of trainmem.measure; one file per configuration of matrix.json.",
        "count": len(entries),
        "generation_seconds": round(generation_seconds, 1) if generation_seconds is not None
        else previous.get("generation_seconds"),
        "entries": entries,
    }
    index_path.write_text(json.dumps(doc, indent=1) + "\n")
    write_parallel_index(matrix)


def write_parallel_index(matrix: dict) -> None:
    """data/ground_truth/parallel/index.json: the data- and tensor-parallel measurements, rank 0's figures and
    whether every rank measured the same."""
    entries = []
    for config in matrix["configurations"]:
        path = PARALLEL_CORPUS / f"{config['id']}.json"
        if not is_parallel(config) or config.get("folder") or not path.exists():
            continue
        r = json.loads(path.read_text())
        info = r["diagnostics"].get("parallel", {})
        entries.append({
            "id": config["id"], "file": path.name, "model": r["model"], "recipe": r["recipe"],
            "parameters": r["parameters"], "peak_allocated_bytes": r["peak_allocated_bytes"],
            "breakdown_at_peak": r["breakdown_at_peak"], "peak": r["peak"],
            "ranks_identical": info.get("ranks_identical"),
            "rank_peaks": [x["peak_allocated_bytes"] for x in info.get("ranks", [])],
            "wall_seconds": r["provenance"]["wall_seconds"],
        })
    if not entries:
        return
    doc = {"description": "Data-, tensor- and pipeline-parallel ground truth (recipe gpus/parallel, tp, pp): rank 0 (pipeline: "
                          "the stage with the highest peak) of a multi-process CPU run "
                          "with gloo; see data/ground_truth/README.md and docs/parallelism.md. Read by the "
                          "accuracy gate (tests/python/test_accuracy.py) with data/ground_truth/*.json.",
           "count": len(entries), "entries": entries}
    (PARALLEL_CORPUS / "index.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
