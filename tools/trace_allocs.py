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

Within one op the measured order says little: the tracker sees an op's outputs only once it has
returned, and records them in the order it returns them, while the kernel may allocate them in
another (data/ground_truth/README.md, "Within one op"). So the allocations the measured trace
marks with one `call` are compared as a set: both sides' allocations at those places are put in
the same order (by size) before live bytes are compared.

Usage:
    .venv/bin/python tools/trace_allocs.py MEASURED.jsonl PREDICTED.jsonl [--phases forward,loss]
        [--show N] [--whole-phases]

Prints each differing group with the first allocation where the two differ (`--show N`: the N
allocations from there, side by side; the measured side names its aten op, dtype and shape), and
how many frees the measured trace made on another thread in that group or the next (`off_thread`: on the CPU,
gloo's worker letting go of a collective's tensor after the main thread has, a race whose outcome
changes from run to run). Exits 1 when a group differs.
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


Allocation = tuple[int, int, str, int]  # (live bytes after it, its size, what it is, its call or 0)


def allocations(path: Path, whole_phases: bool = False) -> tuple[dict[Group, list[Allocation]], dict[Group, int]]:
    """Each group's allocations, groups in the order of their first; and for each group, in the
    order of its first event of either kind (a group of frees alone included: teardown), the frees
    made on another thread (`off_thread`) among its events."""
    live = 0
    groups: dict[Group, list[Allocation]] = {}
    late_in: dict[Group, int] = {}
    try:
        for (step, micro, phase), delta, e in trace_records(path):
            live += delta
            op = str(e.get("op") or "")
            m = _LAYER.match(op)
            key = (step, micro, phase, int(m.group(1)) if m and not whole_phases else -1)
            late_in.setdefault(key, 0)
            if delta < 0:
                late_in[key] += bool(e.get("off_thread"))
            else:
                what = " ".join(str(x) for x in (delta, op, e.get("aten_op"), e.get("dtype"), e.get("shape")) if x)
                groups.setdefault(key, []).append((live, delta, what, int(e.get("call") or 0)))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return groups, late_in


def as_sets(measured: list[Allocation], predicted: list[Allocation]) -> None:
    """Sorts each run of the measured side's allocations that share a call, and the predicted side's
    allocations at the same places, by size, recomputing live bytes within the run (in place). A
    side that frees something between two of those allocations keeps its order, so the difference
    shows where it is."""
    i = 0
    while i < len(measured):
        j = i + 1
        while j < len(measured) and measured[i][3] and measured[j][3] == measured[i][3]:
            j += 1
        for side in (measured, predicted):
            run = side[i:min(j, len(side))]
            if len(run) < 2 or any(b[0] - a[0] != b[1] for a, b in zip(run, run[1:])):
                continue
            live = run[0][0] - run[0][1]
            for k, (_, size, what, call) in enumerate(sorted(run, key=lambda a: a[1])):
                live += size
                side[i + k] = (live, size, what, call)
        i = j


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", type=Path)
    ap.add_argument("predicted", type=Path)
    ap.add_argument("--phases", default="forward,loss,backward,optimizer",
                    help="comma-separated phases to compare (default: a training step's; setup and teardown are no part of one)")
    ap.add_argument("--show", type=int, default=0, metavar="N", help="print N allocations from the first difference")
    ap.add_argument("--whole-phases", action="store_true",
                    help="one group per phase, whatever layer the ops are labelled with (the measuring side "
                         "labels backward ops by their autograd node, which DTensor's ops can leave behind)")
    a = ap.parse_args(argv)
    phases = set(a.phases.split(","))
    (measured, late_in), (predicted, _) = allocations(a.measured, a.whole_phases), allocations(a.predicted, a.whole_phases)
    keys = list(measured) + [k for k in predicted if k not in measured]  # the engine's extra groups last
    trace_order = list(late_in)  # the measured groups, those that only free included
    next_group = {k: trace_order[i + 1] for i, k in enumerate(trace_order[:-1])}
    compared = differing = raced = 0
    for key in keys:
        if key[2] not in phases:
            continue
        compared += 1
        m, p = measured.get(key, []), predicted.get(key, [])
        as_sets(m, p)
        if [x[0] for x in m] == [x[0] for x in p]:
            continue
        differing += 1
        i = next((i for i, (x, y) in enumerate(zip(m, p)) if x[0] != y[0]), min(len(m), len(p)))
        step, micro, phase, layer = key
        where = f"layer {layer}" if layer >= 0 else "outside the layers"
        # A free made on another thread (gloo's worker letting go of a collective's tensor) lands
        # when that thread gets to it, after the allocations it should have come before, in the
        # same group or the next: a group that differs with such a free in it or in the next one
        # may show one outcome of that race (live bytes are right again once the free has landed).
        late = late_in.get(key, 0) + late_in.get(next_group.get(key), 0)
        raced += late > 0
        after = f" ({late} free{'s' if late > 1 else ''} on another thread in it or the next group)" if late else ""
        print(f"step {step} micro-batch {micro} {phase}, {where}: {len(m)} allocations measured, {len(p)} "
              f"predicted; first difference at allocation {i}{after}")
        for j in range(i, min(i + a.show, max(len(m), len(p)))):
            left = f"{m[j][0]:>14,} {m[j][2]}" if j < len(m) else ""
            right = f"{p[j][0]:>14,} {p[j][2]}" if j < len(p) else ""
            print(f"    {left:<70} | {right}")
    print(f"{compared} groups compared, {differing} differ" + (f", {raced} with a free on another thread in or after them" if raced else ""))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
