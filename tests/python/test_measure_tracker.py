"""The measuring side's tracker: exact bytes on a hand-checkable model, parameter bytes, fake vs real.

These run real compute on tiny models (CPU, a few seconds each).
"""

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from measure_common import load_measure  # noqa: E402

measure_pkg = load_measure()
from trainmem.measure import Recipe, block_bytes, measure  # noqa: E402
from trainmem.measure.fused_loss import chunk_rows, fused_linear_cross_entropy  # noqa: E402
from trainmem.measure.models import ModelSpec  # noqa: E402
from trainmem.measure.tracker import MemoryTracker  # noqa: E402
from trainmem.measure.training import run_steps  # noqa: E402

MiB = 1 << 20


def tiny(model_type: str, **extra) -> ModelSpec:
    shapes = {
        "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
        "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True),
        "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128),
    }[model_type]
    config = {"model_type": model_type, **shapes, **extra}
    return ModelSpec(f"tiny-{model_type}", config, "test")


def normalized(rows):
    """Frees between two allocations happen in an unspecified order (autocast's cache is a hash map),
    and `call` counts every dispatched op, metadata queries included, which fake tensors make more
    of: calls are renumbered by first appearance, which keeps which allocations share one."""
    out, frees, calls = [], [], {}
    for row in rows:
        row = {k: v for k, v in row.items() if k not in ("i", "live_bytes")}
        if "call" in row:
            row["call"] = calls.setdefault(row["call"], len(calls))
        if row["event"] == "free":
            frees.append(row)
            continue
        out.extend(sorted(frees, key=lambda r: r["sid"]))
        frees = []
        out.append(row)
    return out + sorted(frees, key=lambda r: r["sid"])


def test_block_bytes_is_the_cuda_rounding():
    assert block_bytes(1) == 512
    assert block_bytes(512) == 512
    assert block_bytes(513) == 1024
    assert block_bytes(2 * MiB) == 2 * MiB
    assert block_bytes(2 * MiB + 1) == 2 * MiB + 512


def _linear_run(optimizer: str):
    """nn.Linear(1024 -> 512, no bias), fp32, batch of 64 rows, loss = out.sum(), two steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512, bias=False)
    tracker = MemoryTracker("cpu")
    tracker.attach_model(model)
    recipe = Recipe(batch=64, seq=1, precision="fp32", optimizer=optimizer)
    with tracker:
        run_steps(model, recipe, tracker, device="cpu", make_batch=lambda: torch.randn(64, 1024),
                  forward_and_loss=lambda x: model(x).sum())
    tracker.close()
    return tracker


def test_single_linear_adamw_exact_bytes():
    # W = 512*1024*4 = 2 MiB; x = 64*1024*4 = 256 KiB (input, category other).
    # forward: out = x @ W.T (64*512*4 = 128 KiB, a temporary: linear saves x and W, both not activations),
    #          out.sum() (512 B); loss / 1 (512 B).
    # backward: seed and the DivBackward scalar (512 B each), W.grad = mm (2 MiB, gradients).
    # step 1: AdamW creates exp_avg, exp_avg_sq (2 MiB each) and a 0-dim step counter (512 B; on CPU
    #         the counters are device memory), then _foreach_sqrt(exp_avg_sq) is a 2 MiB temporary.
    # peak = W + x + grad + 2 states + step + sqrt = 5 * 2 MiB + 256 KiB + 512.
    tracker = _linear_run("adamw")
    result = tracker.analyze()
    assert result["peak_allocated_bytes"] == 5 * 2 * MiB + 256 * 1024 + 512
    assert result["breakdown_at_peak"] == {
        "weights": 2 * MiB, "optimizer_states": 4 * MiB + 512, "gradients": 2 * MiB,
        "activations": 0, "temporaries": 2 * MiB, "other": 256 * 1024,
    }
    assert result["peak"] == {"step": 1, "micro_batch": 1, "phase": "optimizer", "op": "optimizer._foreach_sqrt",
                              "aten_op": "_foreach_sqrt", "module": ""}
    assert [s["peak_allocated_bytes"] for s in result["steps"]] == [result["peak_allocated_bytes"]] * 2
    # Every phase of every micro-batch once, setup left out; step 1's forward peaks at out + sum
    # over W and x, and each step's peak is its optimizer phase's.
    phases = {(p["step"], p["micro_batch"], p["phase"]): p["peak_allocated_bytes"] for p in result["phases"]}
    assert list(phases) == [(s, 1, ph) for s in (1, 2) for ph in ("forward", "loss", "backward", "optimizer")]
    assert phases[(1, 1, "forward")] == 2 * MiB + 256 * 1024 + 128 * 1024 + 512
    assert phases[(1, 1, "optimizer")] == phases[(2, 1, "optimizer")] == result["peak_allocated_bytes"]
    step1 = [(r["event"], r["bytes"], r["category"], r["phase"]) for r in tracker.trace_rows() if r["step"] <= 1]
    assert step1[:10] == [
        ("alloc", 2 * MiB, "weights", "setup"),
        ("alloc", 256 * 1024, "other", "setup"),
        ("alloc", 128 * 1024, "temporaries", "forward"),
        ("alloc", 512, "temporaries", "forward"),
        ("free", 128 * 1024, "temporaries", "forward"),
        ("alloc", 512, "temporaries", "loss"),
        ("free", 512, "temporaries", "loss"),
        ("alloc", 512, "temporaries", "backward"),
        ("alloc", 512, "temporaries", "backward"),
        ("alloc", 2 * MiB, "gradients", "backward"),
    ]


def test_the_runner_locals_go_in_teardown():
    # See Note [Teardown] in training.py: once the last step is done, the batch (256 KiB, other)
    # and AdamW's two states and step counter go when run_steps returns. They are frees of phase
    # teardown, after step 2's optimizer phase, and no phase row holds them.
    tracker = _linear_run("adamw")
    rows = list(tracker.trace_rows())
    last_step = max(i for i, r in enumerate(rows) if r["phase"] != "teardown")
    teardown = rows[last_step + 1:]
    assert rows[last_step]["phase"] == "optimizer"
    assert {r["phase"] for r in teardown} == {"teardown"} and {r["event"] for r in teardown} == {"free"}
    assert sorted((r["bytes"], r["category"]) for r in teardown) == [
        (512, "optimizer_states"), (256 * 1024, "other"), (2 * MiB, "optimizer_states"), (2 * MiB, "optimizer_states")]
    assert all(p["phase"] != "teardown" for p in tracker.analyze()["phases"])


def test_single_linear_sgd_momentum_buffer():
    # SGD(momentum) clones the gradient into momentum_buffer at step 1 (2 MiB optimizer state); step 2's
    # peak is the new gradient in backward: W + x + momentum + grad + three 512 B scalars (loss / 1,
    # still referenced during backward, the seed gradient and DivBackward's output).
    result = _linear_run("sgd").analyze()
    assert result["steps"][1]["peak_allocated_bytes"] == 3 * 2 * MiB + 256 * 1024 + 3 * 512
    assert result["peak"]["phase"] == "backward"
    assert result["breakdown_at_peak"]["optimizer_states"] == 2 * MiB


def test_parameter_bytes_are_the_sum_of_parameter_nbytes():
    spec = tiny("qwen3")
    result = measure(spec, Recipe(batch=1, seq=8, precision="fp32", optimizer="sgd"))
    from trainmem.measure.models import build_real_model

    model = build_real_model(spec, Recipe(precision="fp32"), "cpu")
    params = list({id(p): p for p in model.parameters()}.values())
    assert result["parameters"] == sum(p.numel() for p in params)
    weights = sum(block_bytes(p.untyped_storage().nbytes()) for p in params)
    weights += sum(block_bytes(b.untyped_storage().nbytes()) for b in model.buffers())
    # After both steps only the weights are alive.
    assert result["diagnostics"]["live_bytes_at_end"]["weights"] == weights
    assert result["breakdown_at_peak"]["weights"] == weights


@pytest.mark.parametrize("model_type,recipe", [
    ("llama", dict(precision="bf16-mixed", checkpointing="full")),
    ("llama", dict(precision="fp16-mixed", optimizer="adamw-fused", attention="eager")),
    ("qwen3", dict(precision="bf16-master", loss="fused", grad_accum=2)),
    ("gpt2", dict(precision="bf16-true", optimizer="adafactor")),
])
def test_fake_and_real_runs_record_the_same_trace(tmp_path, model_type, recipe):
    spec = tiny(model_type)
    r = Recipe(batch=2, seq=16, **recipe)
    real = measure(spec, r, trace=str(tmp_path / "real.jsonl"))
    fake = measure(spec, r, fake=True, trace=str(tmp_path / "fake.jsonl"))
    assert real["source"] == "measured-cpu" and fake["source"] == "measured-fake"
    for key in ("peak_allocated_bytes", "breakdown_at_peak", "peak", "steps"):
        assert real[key] == fake[key], key
    rows = [normalized([json.loads(line) for line in open(tmp_path / name)]) for name in ("real.jsonl", "fake.jsonl")]
    assert rows[0] == rows[1]


def test_breakdown_sums_to_peak_and_gradients_are_parameter_sized():
    spec = tiny("llama")
    result = measure(spec, Recipe(batch=2, seq=16, precision="bf16-mixed", grad_accum=2))
    assert sum(result["breakdown_at_peak"].values()) == result["peak_allocated_bytes"]
    params = result["parameters"]
    # fp32 gradients, one set per step (micro-batch 2 accumulates in place).
    assert result["diagnostics"]["allocated_bytes_by_category"]["gradients"] >= 2 * 4 * params
    assert result["diagnostics"]["freed_by_gc_bytes"] == 0


def test_fused_loss_matches_the_standard_loss():
    torch.manual_seed(0)
    rows, h, vocab = 24, 16, 100
    hidden = torch.randn(2, rows // 2, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(vocab, (2, rows // 2))
    labels[0, 3] = -100
    loss = fused_linear_cross_entropy(hidden, weight, labels, compute_dtype=torch.float64)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    reference = torch.nn.functional.cross_entropy((hidden @ weight.t()).view(-1, vocab), shifted.reshape(-1),
                                                  ignore_index=-100)
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_fused_loss_softcap_matches():
    torch.manual_seed(1)
    hidden = torch.randn(1, 10, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(40, (1, 10))
    loss = fused_linear_cross_entropy(hidden, weight, labels, compute_dtype=torch.float64, softcap=3.0)
    g = torch.autograd.grad(loss, (hidden, weight))
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    logits = torch.tanh((hidden @ weight.t()) / 3.0) * 3.0
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 40), shifted.reshape(-1), ignore_index=-100)
    g_ref = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g[0], g_ref[0])
    torch.testing.assert_close(g[1], g_ref[1])


def test_chunk_rows_follows_liger():
    assert chunk_rows(4096, 128256, 4096) == 128  # ceil(V/h) = 32 -> 4096/32 = 128
    assert chunk_rows(1000, 151936, 1024) == 8    # ceil(V/h) = 149 -> ceil(1000/149) = 7 -> 8
    assert chunk_rows(1, 50257, 768) == 1


def test_labels_name_layers_and_modules(tmp_path):
    spec = tiny("llama")
    trace = tmp_path / "t.jsonl"
    measure(spec, Recipe(batch=1, seq=8, precision="fp32", attention="eager"), trace=str(trace))
    ops = {json.loads(line)["op"] for line in open(trace)}
    assert "embed_tokens" in ops and "lm_head" in ops and "loss" in ops
    assert "layer 1 mlp.down_proj" in ops and "layer 0 self_attn._softmax" in ops
    assert any(op.startswith("optimizer._foreach") for op in ops)


def test_cuda_probe_records_transients_and_untracked_memory():
    """The CUDA probe's arithmetic, with the allocator counters stubbed (no GPU needed)."""
    tracker = MemoryTracker("cpu")
    tracker._cuda_probe = tracker._detect_untracked = True
    tracker._live_bytes = 10_000  # what the tracked storages add up to after the op
    # An op that left 1 MiB nobody accounts for (a cuBLAS workspace) and peaked 4096 B above its end state.
    allocated, peak = 10_000 + MiB, 10_000 + MiB + 4096
    tracker._cuda_counters = lambda: (allocated, peak)
    tracker._probe_cuda(peak_before=10_000)
    kinds = [(kind, tracker.records[sid].nbytes, tracker.records[sid].category()) for kind, sid, _ in tracker.events]
    assert kinds == [(0, MiB, "other"), (0, 4096, "temporaries"), (1, 4096, "temporaries")]
    assert tracker._live_bytes == 10_000 + MiB
    result = tracker.analyze()
    assert result["peak_allocated_bytes"] == MiB + 4096  # the tracker's own storages were never allocated here
    # The same op again: nothing new is missing and the running peak did not move.
    tracker._probe_cuda(peak_before=peak)
    assert len(tracker.events) == 3


def test_trace_marks_each_ops_allocations_and_keeps_their_order(tmp_path):
    """native_layer_norm returns (out, mean, rstd) and allocates them in that order: the trace lists
    them so, under one `call`, and the next op's allocations under another."""
    spec = tiny("gpt2")
    measure(spec, Recipe(batch=2, seq=8, precision="fp32", optimizer="sgd"), trace=str(tmp_path / "t.jsonl"))
    rows = [json.loads(line) for line in open(tmp_path / "t.jsonl")]
    norm = [r for r in rows if r["event"] == "alloc" and r["aten_op"] == "native_layer_norm" and r["step"] == 1]
    assert norm and len(norm) % 3 == 0
    first = norm[:3]
    assert [r["shape"][-1] for r in first] == [spec.config["n_embd"], 1, 1]
    assert len({r["call"] for r in first}) == 1
    assert len({r["call"] for r in norm}) == len(norm) // 3


def test_trace_marks_a_free_made_on_another_thread():
    """The last reference to a tensor dropped by another thread (as gloo's worker does with a
    collective's output): the free counts in freed_off_thread_bytes and its trace row says so."""
    import threading

    with MemoryTracker("cpu") as tracker:
        here = torch.ones(1000)
        there = [torch.ones(2000)]
        worker = threading.Thread(target=there.clear)
        worker.start()
        worker.join()
        del here
    rows = list(tracker.trace_rows())
    frees = {r["nbytes"]: r.get("off_thread", False) for r in rows if r["event"] == "free"}
    assert frees == {8000: True, 4000: False}
    assert tracker.stats["freed_off_thread_bytes"] == block_bytes(8000)
