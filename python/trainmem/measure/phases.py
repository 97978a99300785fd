"""The peak of every phase of every micro-batch, from a step's allocation events.

A run's peak says little about the phases that do not hold it: a forward's masks, a checkpoint's
first forward or an optimizer's temporaries can be wrong while the peak, in another phase, is
right. Both sides give their events in the same terms (the tracker's records, or a trace file of
`trainmem-measure --trace` or `trainmem estimate --trace`), each request rounded up to the
allocator's 512-byte blocks; the peak of a phase is the most live bytes after any of its events.
No torch here: tools/trace_phases.py and the accuracy tests read trace files with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

BLOCK = 512

PhaseKey = tuple[int, int, str]  # (step, micro_batch, phase)


def block_bytes(nbytes: int) -> int:
    """The allocator's block for a request of nbytes (Note [Block size] in tracker.py)."""
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK)


def phase_peaks(events: Iterable[tuple[PhaseKey, int]]) -> dict[PhaseKey, int]:
    """The most live bytes after any event of each key, keys in the order of their first events;
    events are (key, signed block bytes)."""
    live = 0
    peaks: dict[PhaseKey, int] = {}
    for key, delta in events:
        live += delta
        peaks[key] = max(peaks.get(key, live), live)
    return peaks


def trace_records(path: Path) -> Iterable[tuple[PhaseKey, int, dict]]:
    """Every event of a trace file (JSON lines): its key, signed block bytes and the event itself.
    Blank lines are skipped; anything else that is not an event is an error naming its line."""
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                size = block_bytes(int(e["nbytes"]))
                key = (int(e["step"]), int(e.get("micro_batch", 0)), str(e["phase"]))
                delta = size if e["event"] == "alloc" else -size
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not a trace event ({err})") from None
            yield key, delta, e


def trace_events(path: Path) -> Iterable[tuple[PhaseKey, int]]:
    """The (key, signed block bytes) of every event of a trace file (JSON lines)."""
    for key, delta, _ in trace_records(path):
        yield key, delta


# Phases that are no part of a step: setup (the two sides load the model differently, and tracking
# starts after it) and teardown (Note [Teardown] in training.py).
OUTSIDE_STEPS = ("setup", "teardown")


def as_rows(peaks: dict[PhaseKey, int]) -> list[dict]:
    """The peaks as JSON rows, in the order of their first events, without the phases outside the
    steps."""
    return [{"step": k[0], "micro_batch": k[1], "phase": k[2], "peak_allocated_bytes": v}
            for k, v in peaks.items() if k[2] not in OUTSIDE_STEPS and k[0] >= 1]
