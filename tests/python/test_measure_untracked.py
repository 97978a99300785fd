"""The tracker against the CPU allocator's own records of the same step, untracked
(trainmem.measure.crosscheck.untracked_peak; tools/untracked_check.py runs the corpus).

Real compute on tiny models, a few seconds each.
"""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from measure_common import load_measure  # noqa: E402

load_measure()
from trainmem.measure import Recipe, block_bytes, measure  # noqa: E402
from trainmem.measure.models import ModelSpec  # noqa: E402
from trainmem.measure.crosscheck import untracked_peak  # noqa: E402
from trainmem.measure.tracker import MemoryTracker  # noqa: E402

# What the CPU allocator holds that is not a tensor the dispatch mode returns, and that a GPU
# would not hold in its memory: kernel-internal CPU scalars (AdamW's bias corrections, say), and
# under checkpointing the CPU RNG state each checkpointed layer keeps (a 5,056-byte ByteTensor):
# the untracked run counts them on top (docs/accuracy.md "Does the tracker change what it
# measures?").
SCRATCH = 8 * 512
RNG_STATE = block_bytes(5056)


def spec(model_type: str, **config) -> ModelSpec:
    return ModelSpec(f"tiny-{model_type}", {"model_type": model_type, **config}, "test")


LLAMA = spec("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
# The embedding outweighs the layers, so the step peaks where its gradients meet.
GPT2 = spec("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=8192, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("knobs", [
    dict(precision="fp32", optimizer="adamw"),
    dict(precision="fp32", optimizer="sgd", checkpointing="full"),
    dict(precision="bf16-mixed", optimizer="sgd", attention="eager"),
])
def test_untied_model_measures_the_same_untracked(knobs):
    recipe = Recipe(batch=2, seq=32, **knobs)
    tracked = measure(LLAMA, recipe)["peak_allocated_bytes"]
    untracked = untracked_peak(LLAMA, recipe)
    rng = 2 * RNG_STATE if recipe.checkpointing != "none" else 0  # two checkpointed layers
    assert tracked <= untracked["peak_allocated_bytes"] <= tracked + SCRATCH + rng


@pytest.mark.parametrize("knobs", [
    dict(precision="fp32", optimizer="sgd", loss="fused"),
    dict(precision="fp32", optimizer="sgd"),
    dict(precision="bf16-mixed", optimizer="sgd"),
])
def test_a_tied_gradient_sum_measures_the_same_untracked(knobs):
    # GPT-2 ties lm_head to wte, and the step peaks where the two [vocab, hidden] gradients meet
    # in autograd's input buffer. Through the fused loss or autocast's cast the head's gradient
    # arrives fresh and the embedding's is added into it in place; a plain lm_head's is a view (mm's
    # output transposed), added into out of place. Under a dispatch mode ATen would add out of
    # place every time; the tracker puts the untracked decision back (Note [Summing gradients]).
    recipe = Recipe(batch=2, seq=32, **knobs)
    tracked = measure(GPT2, recipe)["peak_allocated_bytes"]
    assert tracked <= untracked_peak(GPT2, recipe)["peak_allocated_bytes"] <= tracked + SCRATCH


def test_in_place_sums_are_the_ones_autograd_makes_untracked():
    # The fused loss's step with every sum out of place (the tracker before Note [Summing
    # gradients]) peaks one [vocab, hidden] fp32 tensor higher, less what the real peak (a moment
    # later) holds besides.
    from trainmem.measure import tracker as tracker_module

    recipe = Recipe(batch=2, seq=32, precision="fp32", optimizer="sgd", loss="fused")
    in_place = measure(GPT2, recipe)["peak_allocated_bytes"]
    original = tracker_module.MemoryTracker._sums_in_place
    tracker_module.MemoryTracker._sums_in_place = lambda self, args: False
    try:
        out_of_place = measure(GPT2, recipe)["peak_allocated_bytes"]
    finally:
        tracker_module.MemoryTracker._sums_in_place = original
    assert block_bytes(8192 * 64 * 4) - 32 * 1024 <= out_of_place - in_place <= block_bytes(8192 * 64 * 4)


def _sums(make, tracked):
    """The top-level `add` and `add_` calls of a fresh `make()()`, in order: untracked from the
    profiler's records (no dispatch mode), or as the tracker's mode runs them."""
    run = make()
    if not tracked:
        with torch.profiler.profile() as prof:
            run()
        return [e.name[len("aten::"):] for e in prof.events() if e.name in ("aten::add", "aten::add_")
                and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    tracker, seen = MemoryTracker("cpu"), []
    dispatch = tracker._dispatch

    def spy(func, args, kwargs):
        if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor):
            seen.append(func.overloadpacket.__name__)
        return dispatch(func, args, kwargs)

    tracker._dispatch = spy
    tracker.set_phase("backward")
    with tracker:
        run()
    tracker.close()
    return seen


def _three_projections():
    # One input, three linears (q, k, v): their input gradients are views, so the second is added
    # out of place and the third in place into that sum.
    x = torch.randn(2, 3, 8, requires_grad=True)
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    h = x * 2
    return lambda: sum(torch.nn.functional.linear(h, w).sum() for w in ws).backward()


def _retained_gradient():
    # retain_grad's hook adds the second pass's gradient into .grad out of place; it runs while
    # the previous node's gradients are still being routed, and must not be taken for a buffer sum.
    x = torch.randn(8, requires_grad=True)

    def run():
        y = x.exp()
        y.retain_grad()
        loss = (y.sin() * 3 + y * 2).sum()
        loss.backward(retain_graph=True)
        first, kept = y.grad, y.grad.clone()
        loss.backward()
        assert torch.equal(first, kept)  # the first pass's .grad was not added into

    return run


def _hooked_sum():
    # A tensor hook that adds: its `+` is no buffer's sum.
    x = torch.randn(8, requires_grad=True)

    def run():
        y = x.exp()
        y.register_hook(lambda g: g + 1)
        (y * 2 + y.sin()).sum().backward()

    return run


@pytest.mark.parametrize("make", [_three_projections, _retained_gradient, _hooked_sum])
def test_the_tracker_sums_where_autograd_does_untracked(make):
    untracked = _sums(make, tracked=False)
    assert "add_" in untracked and untracked == _sums(make, tracked=True)


@pytest.mark.parametrize("knobs", [dict(parallel="ddp", gpus=2), dict(mode="inference"),
                                   dict(load_in_4bit=True, lora_rank=8), dict(optimizer="adamw-8bit")])
def test_refuses_what_it_does_not_run(knobs):
    with pytest.raises(ValueError, match="the untracked check"):
        untracked_peak(LLAMA, Recipe(**knobs))
