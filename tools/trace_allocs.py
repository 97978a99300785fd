#!/usr/bin/env python3
"""Allocation by allocation, measured against predicted: where two traces first part ways.

Phase peaks (tools/trace_phases.py) hide an error that does not move a phase's highest moment,
and within a layer the attention's or the rotary embedding's temporaries rarely do. This compares
the live bytes after every allocation instead, group by group: a group is one (step, micro-batch,
phase, decoder layer) or the same outside the layers. Frees may come in another order between two
allocations without showing (the peak cannot tell either); an allocation made earlier or later,
of another size, or over a tensor that should have gone, does. Both traces are JSON lines as for
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
import json
import re
import sys
from pathlib import Path

_LAYER = re.compile(r"layer (\d+)")


def _rounded(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


def allocations(path: Path) -> dict[tuple, list[tuple[int, str]]]:
    """(step, micro_batch, phase, layer or -1) -> [(live bytes after the allocation, what it is)]."""
    live = 0
    groups: dict[tuple, list[tuple[int, str]]] = {}
    with path.open() as f:
        for n, line in enumerate(f, 1):
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                raise SystemExit(f"{path}:{n}: not a JSON line") from None
            kind = e.get("event")
            if kind not in ("alloc", "free"):
                continue
            size = _rounded(int(e.get("nbytes", e.get("bytes", 0))))
            live += size if kind == "alloc" else -size
            if kind != "alloc":
                continue
            op = e.get("op") or ""
            m = _LAYER.match(op)
            key = (e.get("step"), e.get("micro_batch"), e.get("phase"), int(m.group(1)) if m else -1)
            what = " ".join(str(x) for x in (size, op, e.get("aten_op") or "", e.get("dtype") or "",
                                             e.get("shape") or "") if x != "")
            groups.setdefault(key, []).append((live, what))
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
    compared = differing = 0
    for key in sorted(measured, key=lambda k: tuple(-2 if x is None else x for x in k[:2]) + (str(k[2]), k[3])):
        if key[2] not in phases:
            continue
        compared += 1
        m, p = measured[key], predicted.get(key, [])
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
