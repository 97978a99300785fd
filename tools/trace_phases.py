#!/usr/bin/env python3
"""The peak of every phase of every micro-batch, measured against predicted, from two traces.

The corpus checks each run's peak, its categories and each step's peak. Where one buffer dominates
every peak (DeepSpeed's ipg bucket: 1 GB in bf16, 2 GB in fp32, from initialize on) those say
little about the backward or the optimizer; the phase peaks do. Both traces are JSON lines, one
event each (`event` alloc/free, `nbytes`, `step`, `micro_batch`, `phase`): the measuring side's
(`trainmem-measure ... --trace FILE`, `tools/measure_corpus.py --trace-dir DIR`; a parallel run
writes rank 0's to FILE and rank r's to FILE.rank<r>) and the engine's (`trainmem estimate ...
--trace FILE --rank R`). Live bytes are the allocator's view: each request rounded up to a
multiple of 512 B, as the caching allocator's blocks are (small requests included).

Usage:
    .venv/bin/python tools/trace_phases.py MEASURED.jsonl PREDICTED.jsonl [--json]

Exits 1 when a phase's peak differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_common import load_phases  # noqa: E402

_PHASES = load_phases()
phase_peaks, trace_events, OUTSIDE_STEPS = _PHASES.phase_peaks, _PHASES.trace_events, _PHASES.OUTSIDE_STEPS


def peaks_of(path: Path) -> dict[tuple[int, int, str], int]:
    try:
        return phase_peaks(trace_events(path))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", type=Path)
    ap.add_argument("predicted", type=Path)
    ap.add_argument("--json", action="store_true", help="one JSON object per phase")
    a = ap.parse_args(argv)
    measured, predicted = peaks_of(a.measured), peaks_of(a.predicted)
    rows = []
    for key in sorted(set(measured) | set(predicted)):
        if key[2] in OUTSIDE_STEPS:  # setup and teardown: see phases.as_rows
            continue
        m, p = measured.get(key), predicted.get(key)
        rows.append({"step": key[0], "micro_batch": key[1], "phase": key[2], "measured": m, "predicted": p,
                     "diff": None if m is None or p is None else p - m})
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(f"{'step':>4} {'micro':>5} {'phase':<10} {'measured':>16} {'predicted':>16} {'diff':>12}")
        for r in rows:
            show = lambda v: "-" if v is None else f"{v:,}"  # noqa: E731
            print(f"{r['step']:>4} {r['micro_batch']:>5} {r['phase']:<10} {show(r['measured']):>16} "
                  f"{show(r['predicted']):>16} {show(r['diff']):>12}")
    return 0 if all(r["diff"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
