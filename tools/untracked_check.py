#!/usr/bin/env python3
"""Does the tracker change what it measures? The corpus's tracked peaks against untracked runs.

For each single-process CPU training entry of data/ground_truth/matrix.json (no 4-bit or 8-bit
base, no bitsandbytes optimizer), runs the same reference step again without the tracker
(trainmem.measure.crosscheck.untracked_peak: the CPU allocator's records through torch.profiler) and prints the
stored tracked peak, the untracked one and their difference. A difference is the tracker's
doing (its dispatch mode sends ATen down out-of-place paths) or an allocation inside a kernel
that no tensor the mode sees owns. `--json FILE` writes the rows with the versions and the date.

Usage:
    .venv/bin/python tools/untracked_check.py [--only ID ...] [--max-seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_common import ROOT, load_measure  # noqa: E402
from measure_corpus import CORPUS, MATRIX, write_derived  # noqa: E402


# The CPU allocator also holds blocks that are not tensors the tracker sees and that a GPU would
# not hold: kernel-internal CPU scalars, the CPU RNG state each checkpointed layer keeps (5,056 B),
# and in LoRA steps 8-byte blocks made outside any ATen op (not identified yet), each rounded to
# 512 B. An untracked peak up to this much above the tracked one is "small"; docs/accuracy.md.
SMALL = 128 * 1024


def candidates(matrix: dict, measure_pkg) -> list[tuple[dict, object]]:
    """Single-process CPU training entries the untracked run takes, with their recipes."""
    from trainmem.measure.crosscheck import untracked_refusal

    out = []
    defaults = matrix.get("defaults", {})
    for c in matrix["configurations"]:
        if c["mode"] != "cpu" or not (CORPUS / f"{c['id']}.json").exists():
            continue
        recipe = measure_pkg.Recipe(**{**defaults, **c["recipe"]})
        if untracked_refusal(recipe) is None:
            out.append((c, recipe))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="ID")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="skip entries whose recorded measurement took longer")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    measure_pkg = load_measure()
    from trainmem.measure.run import quiet_libraries, versions
    from trainmem.measure.crosscheck import untracked_peak

    quiet_libraries()
    matrix = json.loads(MATRIX.read_text())
    derived = write_derived(matrix)
    rows = []
    for c, recipe in candidates(matrix, measure_pkg):
        if args.only and c["id"] not in args.only:
            continue
        stored = json.loads((CORPUS / f"{c['id']}.json").read_text())
        if args.max_seconds is not None and stored.get("provenance", {}).get("wall_seconds", 0) > args.max_seconds:
            continue
        t0 = time.perf_counter()
        row = {"id": c["id"], "tracked": stored["peak_allocated_bytes"], "tracked_phase": stored["peak"]["phase"]}
        try:
            row["untracked"] = untracked_peak(derived.get(c["model"], c["model"]), recipe)["peak_allocated_bytes"]
        except Exception as e:  # keep going; the row says why
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{c['id']}: FAILED: {row['error']}", flush=True)
            rows.append(row)
            continue
        diff = row["untracked"] - row["tracked"]
        row["verdict"] = "equal" if diff == 0 else "small" if 0 < diff <= SMALL else "differs"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"{c['id']}: tracked {row['tracked']:,} untracked {row['untracked']:,} ({diff:+,} B, "
              f"{row['verdict']}) {row['seconds']} s", flush=True)
    counts = {v: sum(r.get("verdict") == v for r in rows) for v in ("equal", "small", "differs")}
    print(f"{len(rows)} entries: {counts['equal']} equal, {counts['small']} up to {SMALL // 1024} KiB above, "
          f"{counts['differs']} differ, {sum('error' in r for r in rows)} failed")
    if args.json:
        args.json.write_text(json.dumps({
            "generated_by": "tools/untracked_check.py",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(),
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
