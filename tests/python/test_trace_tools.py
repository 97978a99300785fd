"""tools/trace_phases.py and tools/trace_allocs.py on small hand-made traces (no torch needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_trace(path: Path, events: list[tuple[str, int, str, str]]) -> Path:
    """events: (alloc|free, nbytes, phase, op), all in step 1, micro-batch 1."""
    with path.open("w") as f:
        for i, (kind, nbytes, phase, op) in enumerate(events):
            f.write(json.dumps({"i": i, "event": kind, "nbytes": nbytes, "phase": phase, "step": 1,
                                "micro_batch": 1, "op": op}) + "\n")
    return path


def run(tool: str, *args: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / tool), *map(str, args)],
                          capture_output=True, text=True)


# The measured side frees a layer's temporary before its second allocation; the engine after it.
MEASURED = [("alloc", 1000, "forward", "layer 0 a"), ("alloc", 2048, "forward", "layer 0 b"),
            ("free", 2048, "forward", "layer 0 b"), ("alloc", 512, "forward", "layer 0 c"),
            ("free", 1000, "forward", "layer 0 a"), ("free", 512, "forward", "layer 0 c"),
            ("alloc", 4096, "backward", "layer 0 d"), ("free", 4096, "backward", "layer 0 d")]
PREDICTED = [("alloc", 1000, "forward", "layer 0 a"), ("alloc", 2048, "forward", "layer 0 b"),
             ("alloc", 512, "forward", "layer 0 c"), ("free", 2048, "forward", "layer 0 b"),
             ("free", 1000, "forward", "layer 0 a"), ("free", 512, "forward", "layer 0 c"),
             ("alloc", 4096, "backward", "layer 0 d"), ("free", 4096, "backward", "layer 0 d")]


def test_trace_allocs_finds_the_first_allocation_that_differs(tmp_path):
    m = write_trace(tmp_path / "m.jsonl", MEASURED)
    p = write_trace(tmp_path / "p.jsonl", PREDICTED)
    out = run("trace_allocs.py", m, p)
    assert out.returncode == 1
    # 1024 + 2048 live, then the third allocation: 1024 + 512 measured, 1024 + 2048 + 512 predicted.
    assert "step 1 micro-batch 1 forward, layer 0: 3 allocations measured, 3 predicted; first difference at allocation 2" in out.stdout
    assert "2 groups compared, 1 differ" in out.stdout
    same = run("trace_allocs.py", m, m)
    assert same.returncode == 0 and "2 groups compared, 0 differ" in same.stdout


def test_trace_phases_sees_the_same_only_through_a_phase_peak(tmp_path):
    m = write_trace(tmp_path / "m.jsonl", MEASURED)
    p = write_trace(tmp_path / "p.jsonl", PREDICTED)
    out = run("trace_phases.py", m, p)
    # The forward's peak differs (3,072 measured against 3,584 predicted); the backward's does not.
    assert out.returncode == 1
    assert "3,072" in out.stdout and "3,584" in out.stdout


def test_trace_allocs_reports_a_group_only_the_engine_has(tmp_path):
    m = write_trace(tmp_path / "m.jsonl", MEASURED[:6])
    p = write_trace(tmp_path / "p.jsonl", MEASURED[:6] + [("alloc", 512, "loss", "loss")])
    out = run("trace_allocs.py", m, p)
    assert out.returncode == 1
    assert "step 1 micro-batch 1 loss, outside the layers: 0 allocations measured, 1 predicted" in out.stdout


def test_trace_allocs_lists_groups_in_trace_order_and_skips_blank_lines(tmp_path):
    m = write_trace(tmp_path / "m.jsonl", MEASURED)
    with m.open("a") as f:
        f.write("\n")
    p = write_trace(tmp_path / "p.jsonl", [(k, n + 512 if ph == "forward" and k == "alloc" and n == 512 else n, ph, op)
                                          for k, n, ph, op in MEASURED])
    out = run("trace_allocs.py", m, p)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    # The forward's third allocation is 512 B larger; the backward then runs 512 B higher too.
    assert lines[0].startswith("step 1 micro-batch 1 forward, layer 0")
    assert lines[1].startswith("step 1 micro-batch 1 backward, layer 0")


def test_trace_allocs_rejects_an_event_without_its_size(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"event": "alloc", "step": 1, "micro_batch": 1, "phase": "forward"}) + "\n")
    out = run("trace_allocs.py", m, m)
    assert out.returncode != 0 and "m.jsonl:1: not a trace event" in out.stderr



def test_trace_allocs_compares_one_ops_allocations_as_a_set(tmp_path):
    """An op's outputs, which the measured side marks with one `call`, may come in either order;
    allocations of two different calls may not."""
    def trace(name, sizes, calls):
        path = write_trace(tmp_path / name, [("alloc", n, "forward", "layer 0 ln") for n in sizes])
        if calls:
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps({**r, "call": c}) + "\n" for r, c in zip(rows, calls)))
        return path
    engine = trace("p.jsonl", [512, 512, 4096], None)  # the same three sizes, the small ones first
    one_call = trace("m1.jsonl", [4096, 512, 512], [7, 7, 7])
    assert run("trace_allocs.py", one_call, engine).returncode == 0
    two_calls = trace("m2.jsonl", [4096, 512, 512], [7, 8, 8])
    out = run("trace_allocs.py", two_calls, engine)
    assert out.returncode == 1 and "first difference at allocation 0" in out.stdout
    # An engine that frees something between the op's allocations is compared in its own order.
    freeing = write_trace(tmp_path / "p2.jsonl", [("alloc", 1024, "forward", "layer 0 x"),
                                                  ("alloc", 4096, "forward", "layer 0 ln"),
                                                  ("free", 1024, "forward", "layer 0 x"),
                                                  ("alloc", 512, "forward", "layer 0 ln"),
                                                  ("alloc", 512, "forward", "layer 0 ln")])
    kept = write_trace(tmp_path / "m3.jsonl", [("alloc", 1024, "forward", "layer 0 x"),
                                               ("alloc", 512, "forward", "layer 0 ln"),
                                               ("alloc", 512, "forward", "layer 0 ln"),
                                               ("alloc", 4096, "forward", "layer 0 ln")])
    rows = [json.loads(line) for line in kept.read_text().splitlines()]
    kept.write_text("".join(json.dumps({**r, "call": c}) + "\n" for r, c in zip(rows, [1, 2, 2, 2])))
    out = run("trace_allocs.py", kept, freeing)
    assert out.returncode == 1 and "first difference at allocation 1" in out.stdout


def test_trace_allocs_whole_phases_ignores_layer_labels(tmp_path):
    """The same allocations labelled with other layers differ group by group, not phase by phase."""
    m = write_trace(tmp_path / "m.jsonl", [("alloc", 1024, "backward", "lm_head"),
                                           ("alloc", 2048, "backward", "layer 1 mlp")])
    p = write_trace(tmp_path / "p.jsonl", [("alloc", 1024, "backward", "layer 1 mlp.down_proj"),
                                           ("alloc", 2048, "backward", "layer 1 mlp")])
    assert run("trace_allocs.py", m, p).returncode == 1
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "trace_allocs.py"), str(m), str(p), "--whole-phases"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "1 groups compared, 0 differ" in out.stdout


def test_trace_allocs_says_when_a_difference_follows_a_late_free(tmp_path):
    """A free the measured side made on another thread (gloo's worker) is named with a differing
    group that holds it or comes after it."""
    m = write_trace(tmp_path / "m.jsonl", MEASURED)
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    rows[4]["off_thread"] = True  # layer 0 a's free, after the differing allocation
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run("trace_allocs.py", m, write_trace(tmp_path / "p.jsonl", PREDICTED))
    assert out.returncode == 1
    assert "first difference at allocation 2 (1 free on another thread in it or the next group)" in out.stdout
    assert "2 groups compared, 1 differ, 1 with a free on another thread in or after them" in out.stdout
    # Without the mark the same difference is reported plainly.
    plain = run("trace_allocs.py", write_trace(tmp_path / "m2.jsonl", MEASURED), tmp_path / "p.jsonl")
    assert "another thread" not in plain.stdout and plain.stdout.rstrip().endswith("1 differ")


def test_trace_allocs_counts_a_late_free_that_lands_in_teardown(tmp_path):
    """The last step's last group is followed by teardown's frees alone (Note [Teardown] in
    python/trainmem/measure/training.py): a late free that lands there still names the group."""
    measured = [("alloc", 1000, "optimizer", "optimizer.a"), ("alloc", 2048, "optimizer", "optimizer.b"),
                ("free", 1000, "teardown", "teardown"), ("free", 2048, "teardown", "teardown")]
    predicted = [("alloc", 1000, "optimizer", "optimizer.a"), ("free", 1000, "optimizer", "optimizer.a"),
                 ("alloc", 2048, "optimizer", "optimizer.b"), ("free", 2048, "optimizer", "optimizer.b")]
    m = write_trace(tmp_path / "m.jsonl", measured)
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    rows[2]["off_thread"] = True  # optimizer.a's tensor, let go of by gloo's worker after the group
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run("trace_allocs.py", m, write_trace(tmp_path / "p.jsonl", predicted))
    assert out.returncode == 1
    assert "1 groups compared, 1 differ, 1 with a free on another thread in or after them" in out.stdout
    # Teardown is no group of its own to compare, nor a phase row.
    assert "teardown" not in out.stdout
    phases = run("trace_phases.py", m, tmp_path / "p.jsonl")
    assert "optimizer" in phases.stdout and "teardown" not in phases.stdout
