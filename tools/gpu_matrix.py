#!/usr/bin/env python3
"""Measure a matrix of training configurations on one CUDA GPU (one command, under 8 minutes on an H200).

    tools/gpu_matrix.sh [OUT.json]                 # on the GPU machine
    python3 tools/gpu_matrix.py --out gpu_matrix.json
    python3 tools/gpu_matrix.py --dry-run          # the CPU path: fake tensors on the CPU, small shapes

Every configuration runs the reference training step of trainmem.measure (two optimizer steps)
under the tracker on the GPU and records, side by side, the tracker's categories and peak and
torch.cuda's own figures (max_memory_allocated / max_memory_reserved per step, the CUDA context
as mem_get_info's used minus reserved). Configurations run in worker processes, one per allocator
setting, because PYTORCH_CUDA_ALLOC_CONF is read once per process:

* group `expandable`: expandable_segments:True, so torch.cuda.memory_allocated() is the sum of
  512-rounded blocks and the tracker's peak should equal max_memory_allocated up to memory no op
  accounts for (cuBLAS workspaces, recorded as `other` by the tracker's CUDA probe);
* group `default`: the default caching allocator, for a few of the same configurations (large
  blocks whose remainder is not split are charged whole there);
* group `fake-cuda`: fake tensors on the cuda device (needs a CUDA build; no memory used), for
  configurations also run for real, to check that fake tensors follow CUDA's autocast rules.

Results are written after every configuration (JSON lines next to the output), so a run cut
short still leaves what it measured. Configurations left when the time budget runs out are
reported as skipped. The matrix lives in tools/gpu_matrix.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure_common import ROOT, load_measure  # noqa: E402

MATRIX = HERE / "gpu_matrix.json"
GROUP_ENV = {
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "default": {"PYTORCH_CUDA_ALLOC_CONF": ""},
    "fake-cuda": {"PYTORCH_CUDA_ALLOC_CONF": ""},
}
DRY_RUN_MAX_SEQ = 128
DRY_RUN_MAX_BATCH = 2


def load_matrix(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    defaults = doc.get("defaults", {})
    out = []
    for entry in doc["configurations"]:
        out.append({**entry, "recipe": {**defaults, **entry.get("recipe", {})}})
    return out


# ----------------------------------------------------------------------------------------------- worker

def _environment_info(dry_run: bool) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "python": platform.python_version()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if not dry_run and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update({"gpu": props.name, "gpu_total_memory": props.total_memory,
                     "compute_capability": f"{props.major}.{props.minor}",
                     "cudnn": torch.backends.cudnn.version()})
    for package in ("bitsandbytes", "flash_attn"):
        try:
            info[package] = __import__(package).__version__
        except Exception:  # not installed, or fails to load on this machine
            info[package] = None
    return info


def _skip_reason(config: dict, env: dict, dry_run: bool) -> str | None:
    recipe = config["recipe"]
    if recipe.get("attention") == "flash" and (dry_run or not env.get("flash_attn")):
        return "attention=flash needs the flash-attn package on a CUDA machine"
    if recipe.get("optimizer") == "adamw-8bit" and not env.get("bitsandbytes"):
        return "optimizer=adamw-8bit needs the bitsandbytes package"
    return None


def run_worker(group: str, configs: list[dict], results_path: Path, deadline: float, dry_run: bool) -> int:
    measure_pkg = load_measure()
    from trainmem.measure.models import resolve_model
    from trainmem.measure.run import default_command, quiet_libraries

    import torch

    quiet_libraries()
    env = _environment_info(dry_run)
    if not dry_run and not torch.cuda.is_available():
        print("gpu_matrix: no CUDA device; use --dry-run for the CPU path", file=sys.stderr)
        return 2
    with open(results_path, "a") as out:
        out.write(json.dumps({"group": group, "environment": env}) + "\n")
        for config in configs:
            row = {"id": config["id"], "group": group, "model": config["model"], "recipe": dict(config["recipe"])}
            reason = _skip_reason(config, env, dry_run)
            if reason is None and time.time() > deadline:
                reason = "time budget spent"
            if reason is not None:
                row.update(status="skipped", reason=reason)
                out.write(json.dumps(row) + "\n")
                out.flush()
                continue
            recipe_dict = dict(config["recipe"])
            fake = group == "fake-cuda" or dry_run
            device = "cpu" if dry_run else "cuda"
            if dry_run:
                recipe_dict["seq"] = min(recipe_dict.get("seq", 2048), DRY_RUN_MAX_SEQ)
                recipe_dict["batch"] = min(recipe_dict.get("batch", 1), DRY_RUN_MAX_BATCH)
                recipe_dict.pop("gpu", None)
            elif group != "fake-cuda":
                recipe_dict["gpu"] = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "-")
            recipe_dict["allocator"] = "expandable" if group == "expandable" else "default"
            started = time.time()
            try:
                recipe = measure_pkg.Recipe(**recipe_dict)
                spec = resolve_model(config["model"])
                command = default_command(spec, recipe, device=device, fake=fake)
                result = measure_pkg.measure(spec, recipe, device=device, fake=fake, command=command)
                row.update(status="ok", seconds=round(time.time() - started, 2), measurement=result)
                row["comparison"] = _compare(result)
            except Exception as e:  # out of memory, a missing kernel...: record it and go on
                row.update(status="failed", seconds=round(time.time() - started, 2),
                           error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                           traceback=traceback.format_exc(limit=-6))
            finally:
                if not dry_run and torch.cuda.is_available():
                    import gc

                    gc.collect()
                    torch.cuda.empty_cache()
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"  {group:<10} {config['id']:<48} {row['status']:<7} {row.get('seconds', 0):6.1f} s"
                  + (f"  tracker {_gib(result['peak_allocated_bytes'])} / torch {_gib(row['comparison'].get('torch_max_memory_allocated'))}"
                     if row["status"] == "ok" else f"  {row.get('error', '')[:100]}"), flush=True)
    return 0


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB"


def _compare(result: dict) -> dict:
    torch_figures = result.get("torch") or {}
    ma = torch_figures.get("max_memory_allocated")
    ours = result["peak_allocated_bytes"]
    out = {"tracker_peak_allocated_bytes": ours, "torch_max_memory_allocated": ma,
           "torch_max_memory_reserved": torch_figures.get("max_memory_reserved")}
    if ma:
        out["difference_bytes"] = ma - ours
        out["ratio"] = round(ours / ma, 5)
        steps = torch_figures.get("steps", [])
        out["per_step"] = [{"step": s["step"], "tracker": t["peak_allocated_bytes"], "torch": s["max_memory_allocated"],
                            "torch_reserved": s["max_memory_reserved"]}
                           for s, t in zip(steps, result["steps"])]
    return out


# ----------------------------------------------------------------------------------------------- parent

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output JSON (default: $OUT/gpu_matrix.json or ./gpu_matrix.json)")
    parser.add_argument("--budget-seconds", type=float, default=400.0,
                        help="stop starting configurations after this many seconds (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="CPU path: fake tensors on the CPU, small shapes")
    parser.add_argument("--only", nargs="+", metavar="ID")
    parser.add_argument("--matrix", default=str(MATRIX))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    configs = load_matrix(Path(args.matrix))
    if args.only:
        configs = [c for c in configs if c["id"] in set(args.only)]
    if args.worker:
        group_configs = [c for c in configs if c.get("group", "expandable") == args.worker]
        return run_worker(args.worker, group_configs, Path(args.results), args.deadline, args.dry_run)

    out_path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_matrix.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results_path = out_path.with_suffix(".jsonl")
    results_path.write_text("")
    started = time.time()
    deadline = started + args.budget_seconds
    groups = [g for g in GROUP_ENV if any(c.get("group", "expandable") == g for c in configs)]
    print(f"gpu_matrix: {len(configs)} configurations in groups {', '.join(groups)}"
          f"{' (dry run: fake tensors on the CPU)' if args.dry_run else ''}", flush=True)
    worker_status = {}
    for group in groups:
        remaining = deadline - time.time()
        env = {**os.environ, **GROUP_ENV[group]}
        if not env["PYTORCH_CUDA_ALLOC_CONF"]:
            env.pop("PYTORCH_CUDA_ALLOC_CONF")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", group, "--results", str(results_path),
               "--deadline", str(deadline), "--matrix", args.matrix]
        if args.dry_run:
            cmd.append("--dry-run")
        if args.only:
            cmd += ["--only", *args.only]
        try:
            # The worker stops starting configurations at the deadline; the extra minute lets the
            # one in flight finish.
            proc = subprocess.run(cmd, env=env, timeout=max(60.0, remaining + 60.0))
            worker_status[group] = proc.returncode
        except subprocess.TimeoutExpired:
            worker_status[group] = "timeout"
    document = assemble(results_path, configs, started, args, worker_status)
    out_path.write_text(json.dumps(document, indent=1) + "\n")
    ok = sum(r["status"] == "ok" for r in document["results"])
    print(f"gpu_matrix: {ok}/{len(document['results'])} measured in {document['wall_seconds']:.0f} s -> {out_path}")
    return 0 if ok else 1


def assemble(results_path: Path, configs: list[dict], started: float, args, worker_status: dict) -> dict:
    environments, rows = {}, {}
    for line in results_path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "environment" in row:
            environments[row["group"]] = row["environment"]
        else:
            rows[(row["group"], row["id"])] = row
    results = []
    for config in configs:
        key = (config.get("group", "expandable"), config["id"])
        results.append(rows.get(key, {"id": config["id"], "group": key[0], "model": config["model"],
                                      "recipe": config["recipe"], "status": "missing",
                                      "reason": "the worker did not report it (crashed or timed out)"}))
    return {
        "generated_by": "tools/gpu_matrix.py",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": bool(args.dry_run),
        "budget_seconds": args.budget_seconds,
        "wall_seconds": round(time.time() - started, 1),
        "workers": worker_status,
        "environment": environments,
        "repository": str(ROOT),
        "results": results,
    }


if __name__ == "__main__":
    raise SystemExit(main())
