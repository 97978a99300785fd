#!/usr/bin/env python3
"""Allocation by allocation, measured against predicted: where two traces part ways.

Phase peaks (tools/trace_phases.py) hide an error that does not move a phase's highest moment,
and within a layer the attention's or the rotary embedding's temporaries rarely do. This compares
the live bytes after every allocation instead, group by group: a group is one (step, micro-batch,
phase, decoder layer) or the same outside the layers. Frees may come in another order between two
allocations without showing (the peak cannot tell either); an allocation made earlier or later,
of another size, or over a tensor that should have gone, does. Live bytes run on across groups,
so a tensor kept too long shows in every group until it goes: the first group listed (groups come
in the measured trace's order) is where the two part ways. Both traces are JSON lines as for
trace_phases.py; live bytes count each request rounded up to 512 B.

Usage:
    .venv/bin/python tools/trace_allocs.py MEASURED.jsonl PREDICTED.jsonl [--phases forward,loss]
        [--show N]

Prints each differing group with the first allocation where the two differ (`--show N`: the N
allocations from there, side by side; the measured side names its aten op, dtype and shape).
Exits 1 when a group differs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_common import load_phases  # noqa: E402

trace_records = load_phases().trace_records
_LAYER = re.compile(r"layer (\d+)")

Group = tuple[int, int, str, int]  # (step, micro_batch, phase, layer or -1)


def allocations(path: Path) -> dict[Group, list[tuple[int, str]]]:
    """Each group's allocations, groups in the order of their first: (live bytes after it, what it is)."""
    live = 0
    groups: dict[Group, list[tuple[int, str]]] = {}
    try:
        for (step, micro, phase), delta, e in trace_records(path):
            live += delta
            if delta < 0:
                continue
            op = str(e.get("op") or "")
            m = _LAYER.match(op)
            what = " ".join(str(x) for x in (delta, op, e.get("aten_op"), e.get("dtype"), e.get("shape")) if x)
            groups.setdefault((step, micro, phase, int(m.group(1)) if m else -1), []).append((live, what))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", type=Path)
    ap.add_argument("predicted", type=Path)
    ap.add_argument("--phases", default="forward,loss,backward,optimizer",
                    help="comma-separated phases to compare (default: all but setup)")
    ap.add_argument("--show", type=int, default=0, metavar="N", help="print N allocations from the first difference")
    a = ap.parse_args(argv)
    phases = set(a.phases.split(","))
    measured, predicted = allocations(a.measured), allocations(a.predicted)
    keys = list(measured) + [k for k in predicted if k not in measured]  # the engine's extra groups last
    compared = differing = 0
    for key in keys:
        if key[2] not in phases:
            continue
        compared += 1
        m, p = measured.get(key, []), predicted.get(key, [])
        if [x[0] for x in m] == [x[0] for x in p]:
            continue
        differing += 1
        i = next((i for i, (x, y) in enumerate(zip(m, p)) if x[0] != y[0]), min(len(m), len(p)))
        step, micro, phase, layer = key
        where = f"layer {layer}" if layer >= 0 else "outside the layers"
        print(f"step {step} micro-batch {micro} {phase}, {where}: {len(m)} allocations measured, {len(p)} "
              f"predicted; first difference at allocation {i}")
        for j in range(i, min(i + a.show, max(len(m), len(p)))):
            left = f"{m[j][0]:>14,} {m[j][1]}" if j < len(m) else ""
            right = f"{p[j][0]:>14,} {p[j][1]}" if j < len(p) else ""
            print(f"    {left:<70} | {right}")
    print(f"{compared} groups compared, {differing} differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
